//! The errnos node-sim answers with, and their kernel names (the op log, fault commands).

/// An errno a write fails with.
pub(crate) type Errno = i32;

/// The kernel's name of an errno (`EBUSY`).
pub(crate) fn errno_name(e: Errno) -> String {
    ERRNOS
        .iter()
        .find(|(_, n)| *n == e)
        .map(|(s, _)| s.to_string())
        .unwrap_or_else(|| format!("E{e}"))
}

/// The errno a kernel name (`EBUSY`) stands for.
pub(crate) fn errno_from_name(s: &str) -> Option<Errno> {
    ERRNOS.iter().find(|(n, _)| *n == s).map(|(_, e)| *e)
}

const ERRNOS: &[(&str, Errno)] = &[
    ("EPERM", libc::EPERM),
    ("ENOENT", libc::ENOENT),
    ("EIO", libc::EIO),
    ("ENXIO", libc::ENXIO),
    ("EAGAIN", libc::EAGAIN),
    ("ENOMEM", libc::ENOMEM),
    ("EACCES", libc::EACCES),
    ("EBUSY", libc::EBUSY),
    ("EEXIST", libc::EEXIST),
    ("ENODEV", libc::ENODEV),
    ("EINVAL", libc::EINVAL),
    ("ENOSPC", libc::ENOSPC),
    ("ERANGE", libc::ERANGE),
    ("EINTR", libc::EINTR),
    ("ETIMEDOUT", libc::ETIMEDOUT),
    ("EUSERS", libc::EUSERS),
    ("EOPNOTSUPP", libc::EOPNOTSUPP),
];
