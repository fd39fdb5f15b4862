//! Errors of the sysfs layer. Every variant names the file it concerns and, where there is one,
//! the device.

use std::path::PathBuf;
use std::time::Duration;

/// A failed read, write or parse of the node's sysfs, dev or proc tree.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Reading or listing a file or directory failed.
    #[error("cannot read {path}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// Writing or removing a file of the daemons' own node state failed.
    #[error("cannot write {path}")]
    Save {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The kernel refused a write.
    #[error("{device}: writing {value:?} to {path} failed")]
    Write {
        /// The device the write was for (PCI address, mdev UUID or parent name).
        device: String,
        /// The file written.
        path: PathBuf,
        /// What was written (without the trailing newline).
        value: String,
        /// The kernel's answer.
        #[source]
        source: std::io::Error,
    },
    /// A write did not return in time (a driver probe hanging, for example). The write may
    /// still complete later in the background.
    #[error("{device}: writing {value:?} to {path} did not finish within {after:?}")]
    Timeout {
        /// The device the write was for.
        device: String,
        /// The file written.
        path: PathBuf,
        /// What was written.
        value: String,
        /// How long we waited.
        after: Duration,
    },
    /// A device did not reach the expected driver in time.
    #[error("{device}: not bound to {driver} after {after:?} (driver now: {current})")]
    BindTimeout {
        /// The device.
        device: String,
        /// The driver we waited for.
        driver: String,
        /// How long we waited.
        after: Duration,
        /// The driver it is on now, or "none".
        current: String,
    },
    /// A file held something we could not understand.
    #[error("{path}: {reason}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What was wrong with it.
        reason: String,
    },
    /// A record of the daemons' own state was written by a newer version, in a format this one
    /// does not know.
    #[error("{path} was written in format v{version}; this version reads up to v{current}")]
    Newer {
        /// The file.
        path: PathBuf,
        /// The version it declares.
        version: u32,
        /// The newest this version reads.
        current: u32,
    },
    /// The device (PCI function, mdev, parent, type) does not exist on this node.
    #[error("{device}: no such device ({path} does not exist)")]
    NotFound {
        /// The device.
        device: String,
        /// Where it was looked for.
        path: PathBuf,
    },
}

impl Error {
    /// The errno behind the error, when there is one (EBUSY, ENODEV, ENOSPC, ...).
    pub fn errno(&self) -> Option<i32> {
        match self {
            Error::Io { source, .. } | Error::Save { source, .. } | Error::Write { source, .. } => {
                source.raw_os_error()
            }
            _ => None,
        }
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}

/// The full message of an error and its sources, for reports.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

/// Result of the sysfs layer.
pub type Result<T, E = Error> = std::result::Result<T, E>;
