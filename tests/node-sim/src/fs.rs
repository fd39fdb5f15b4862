//! The FUSE side: one `SimFs` per mount (`sys`, `dev`, `proc`), all over one shared state.

use std::borrow::Cow;
use std::collections::{BTreeSet, HashMap};
use std::ffi::OsStr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, LockOwner,
    OpenAccMode, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry,
    ReplyOpen, ReplyWrite, Request, TimeOrNow, WriteFlags,
};

use crate::faults::Faults;
use crate::holders::Holders;
use crate::state::State;
use crate::tree::{Content, File, Node, Tree, WriteTarget};
use crate::uevent::UeventSender;

const TTL: Duration = Duration::ZERO;

/// What an open handle keeps.
#[derive(Debug)]
enum Handle {
    File {
        data: Vec<u8>,
    },
    Dir {
        entries: Vec<(u64, FileType, String)>,
    },
}

#[derive(Debug, Default)]
struct Inodes {
    by_path: HashMap<String, u64>,
    paths: Vec<String>,
}

impl Inodes {
    fn ino(&mut self, path: &str) -> u64 {
        if let Some(i) = self.by_path.get(path) {
            return *i;
        }
        let i = self.paths.len() as u64 + 2;
        self.paths.push(path.to_string());
        self.by_path.insert(path.to_string(), i);
        i
    }

    fn path(&self, ino: u64) -> Option<&str> {
        let idx = usize::try_from(ino.checked_sub(2)?).ok()?;
        self.paths.get(idx).map(String::as_str)
    }
}

/// Everything behind the three mounts.
#[derive(Debug)]
pub(crate) struct Inner {
    pub state: State,
    tree: Option<Arc<Tree>>,
    inodes: Inodes,
    handles: HashMap<u64, Handle>,
    next_fh: u64,
}

impl Inner {
    pub fn new(state: State) -> Inner {
        Inner {
            state,
            tree: None,
            inodes: Inodes::default(),
            handles: HashMap::new(),
            next_fh: 1,
        }
    }

    pub fn tree(&mut self) -> Arc<Tree> {
        if let Some(t) = &self.tree {
            return t.clone();
        }
        let t = Arc::new(self.state.render());
        self.tree = Some(t.clone());
        t
    }

    pub fn dirty(&mut self) {
        self.tree = None;
    }
}

/// The shared state and the uevent socket.
#[derive(Debug)]
pub(crate) struct Shared {
    pub inner: Mutex<Inner>,
    pub uevents: Option<UeventSender>,
}

impl Shared {
    pub fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while the lock is held leaves a state that is still the best we have.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sends the uevents queued by the last change.
    pub fn flush_events(&self, inner: &mut Inner) {
        let events = std::mem::take(&mut inner.state.events);
        if let Some(s) = &self.uevents {
            for e in &events {
                s.send(e);
            }
        }
    }

    /// A write to a kernel file: faults, delay, the kernel's effect, the op log.
    pub fn write(&self, path: &str, target: &WriteTarget, value: &str) -> Result<(), i32> {
        if *target == WriteTarget::Control {
            let mut inner = self.lock();
            let r = inner.state.control(value);
            inner.dirty();
            self.flush_events(&mut inner);
            return r.map_err(|e| {
                tracing::warn!("control: {e}");
                libc::EINVAL
            });
        }
        let keys = Faults::keys(target, value);
        let (delay, errno) = match &keys {
            Some((op, keys)) => self.lock().state.faults.take(op, keys),
            None => (Duration::ZERO, None),
        };
        if !delay.is_zero() {
            std::thread::sleep(delay);
        }
        let mut inner = self.lock();
        let result = match errno {
            Some(e) => Err(e),
            None => inner.state.write(target, value),
        };
        inner.state.ops.log(path, value, result);
        inner.dirty();
        self.flush_events(&mut inner);
        result
    }
}

/// The node at `path`: the rendered tree's, except under `proc`, where each `proc/<pid>` is a
/// process holding a simulated device node now (see [`Holders`]).
fn resolve<'t>(tree: &'t Tree, holders: &Holders, path: &str) -> Option<Cow<'t, Node>> {
    if path == "proc" {
        let Some(Node::Dir(children)) = tree.get(path) else {
            return None;
        };
        let mut children = children.clone();
        children.extend(holders.pids().iter().map(u32::to_string));
        return Some(Cow::Owned(Node::Dir(children)));
    }
    let Some((pid, rest)) = path
        .strip_prefix("proc/")
        .map(|r| r.split_once('/').unwrap_or((r, "")))
        .and_then(|(p, rest)| Some((p.parse::<u32>().ok()?, rest)))
    else {
        return tree.get(path).map(Cow::Borrowed);
    };
    let p = holders.process(pid, |node| tree.get(node).is_some())?;
    let file = |text: String| {
        Node::File(File {
            content: Content::Text(text),
            mode: 0o444,
            write: None,
            open: None,
        })
    };
    let node = match rest {
        "" => Node::Dir(BTreeSet::from(["comm", "cmdline", "fd"].map(String::from))),
        "comm" => file(p.comm),
        "cmdline" => file(p.cmdline),
        "fd" => Node::Dir(p.fds.keys().map(u32::to_string).collect()),
        _ => {
            let fd: u32 = rest.strip_prefix("fd/")?.parse().ok()?;
            Node::Link(p.fds.get(&fd)?.clone())
        }
    };
    Some(Cow::Owned(node))
}

/// One mount.
#[derive(Debug)]
pub(crate) struct SimFs {
    pub shared: Arc<Shared>,
    /// `sys`, `dev` or `proc`.
    pub root: String,
    pub mounted_at: SystemTime,
}

fn kind_of(n: &Node) -> FileType {
    match n {
        Node::Dir(_) => FileType::Directory,
        Node::File(_) => FileType::RegularFile,
        Node::Link(_) => FileType::Symlink,
    }
}

impl SimFs {
    fn path_of(&self, inner: &Inner, ino: INodeNo) -> Option<String> {
        if ino.0 == 1 {
            return Some(self.root.clone());
        }
        inner.inodes.path(ino.0).map(str::to_string)
    }

    fn attr(&self, ino: u64, path: &str, node: &Node) -> FileAttr {
        let (kind, perm, size, nlink) = match node {
            Node::Dir(c) => (FileType::Directory, 0o755, 0, 2 + c.len() as u32),
            Node::File(f) => {
                let size = if path.starts_with("sys/") { 4096 } else { 0 };
                (FileType::RegularFile, f.mode, size, 1)
            }
            Node::Link(t) => (FileType::Symlink, 0o777, t.len() as u64, 1),
        };
        FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: 0,
            atime: self.mounted_at,
            mtime: self.mounted_at,
            ctime: self.mounted_at,
            crtime: self.mounted_at,
            kind,
            perm,
            nlink,
            uid: 0,
            gid: 0,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }
}

impl Filesystem for SimFs {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let mut inner = self.shared.lock();
        let Some(pp) = self.path_of(&inner, parent) else {
            return reply.error(Errno::ENOENT);
        };
        let Some(name) = name.to_str() else {
            return reply.error(Errno::ENOENT);
        };
        let path = format!("{pp}/{name}");
        let tree = inner.tree();
        match resolve(&tree, &inner.state.holders, &path) {
            Some(node) => {
                let ino = inner.inodes.ino(&path);
                reply.entry(&TTL, &self.attr(ino, &path, &node), Generation(0));
            }
            None => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let mut inner = self.shared.lock();
        let Some(path) = self.path_of(&inner, ino) else {
            return reply.error(Errno::ENOENT);
        };
        let tree = inner.tree();
        match resolve(&tree, &inner.state.holders, &path) {
            Some(node) => reply.attr(&TTL, &self.attr(ino.0, &path, &node)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        _size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        // `echo x > f` truncates first; sysfs ignores it.
        self.getattr(_req, ino, None, reply);
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let mut inner = self.shared.lock();
        let Some(path) = self.path_of(&inner, ino) else {
            return reply.error(Errno::ENOENT);
        };
        let tree = inner.tree();
        match resolve(&tree, &inner.state.holders, &path).as_deref() {
            Some(Node::Link(t)) => reply.data(t.as_bytes()),
            Some(_) => reply.error(Errno::EINVAL),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let mut inner = self.shared.lock();
        let Some(path) = self.path_of(&inner, ino) else {
            return reply.error(Errno::ENOENT);
        };
        let tree = inner.tree();
        let node = resolve(&tree, &inner.state.holders, &path);
        let file = match node.as_deref() {
            Some(Node::File(f)) => f,
            Some(Node::Dir(_)) => return reply.error(Errno::EISDIR),
            Some(Node::Link(_)) => return reply.error(Errno::ELOOP),
            None => return reply.error(Errno::ENOENT),
        };
        let acc = flags.acc_mode();
        let reads = matches!(acc, OpenAccMode::O_RDONLY | OpenAccMode::O_RDWR);
        let writes = matches!(acc, OpenAccMode::O_WRONLY | OpenAccMode::O_RDWR);
        if (reads && file.content == Content::WriteOnly)
            || (writes && file.write.is_none() && !path.starts_with("dev/"))
        {
            return reply.error(Errno::EACCES);
        }
        let fh = inner.next_fh;
        inner.next_fh += 1;
        if let Some(kind) = file.open
            && let Err(e) = inner.state.holders.open(kind, fh)
        {
            return reply.error(Errno::from_i32(e));
        }
        let data = match &file.content {
            Content::Text(s) => s.clone().into_bytes(),
            Content::WriteOnly => Vec::new(),
            Content::Ops => inner.state.ops.text().into_bytes(),
        };
        // Writes to one attribute from several processes (every GPU's unbind goes to
        // drivers/nvidia/unbind) run in parallel, as sysfs runs them: without this flag FUSE
        // serialises writes to one inode, and a slow unbind would hold up every other one.
        let mut open_flags = FopenFlags::FOPEN_DIRECT_IO;
        if file.write.is_some() {
            open_flags |= FopenFlags::FOPEN_PARALLEL_DIRECT_WRITES;
        }
        inner.handles.insert(fh, Handle::File { data });
        reply.opened(FileHandle(fh), open_flags);
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let inner = self.shared.lock();
        match inner.handles.get(&fh.0) {
            Some(Handle::File { data }) => {
                let start = usize::try_from(offset)
                    .unwrap_or(usize::MAX)
                    .min(data.len());
                let end = start.saturating_add(size as usize).min(data.len());
                reply.data(&data[start..end]);
            }
            _ => reply.error(Errno::EBADF),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let (path, target) = {
            let mut inner = self.shared.lock();
            let Some(path) = self.path_of(&inner, ino) else {
                return reply.error(Errno::ENODEV);
            };
            match inner.tree().get(&path) {
                Some(Node::File(f)) => match &f.write {
                    Some(t) => (path, t.clone()),
                    None => return reply.error(Errno::EACCES),
                },
                // The device went away since the file was opened.
                _ => return reply.error(Errno::ENODEV),
            }
        };
        let value = String::from_utf8_lossy(data);
        match self.shared.write(&path, &target, &value) {
            Ok(()) => reply.written(data.len() as u32),
            Err(e) => reply.error(Errno::from_i32(e)),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // close() sends FLUSH, after the descriptor left the process, and waits for it;
        // RELEASE comes later, asynchronously, once the description is gone. A device node's
        // holder is forgotten here when no process has a descriptor of it any more, so that an
        // open right after the last close succeeds, as on the kernel.
        self.shared.lock().state.holders.flush(fh.0);
        reply.ok();
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let mut inner = self.shared.lock();
        inner.handles.remove(&fh.0);
        inner.state.holders.release(fh.0);
        reply.ok();
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let mut inner = self.shared.lock();
        let Some(path) = self.path_of(&inner, ino) else {
            return reply.error(Errno::ENOENT);
        };
        let tree = inner.tree();
        let node = resolve(&tree, &inner.state.holders, &path);
        let Some(Node::Dir(children)) = node.as_deref() else {
            return reply.error(Errno::ENOTDIR);
        };
        let mut entries = vec![
            (ino.0, FileType::Directory, ".".to_string()),
            (1, FileType::Directory, "..".to_string()),
        ];
        for name in children {
            let cp = format!("{path}/{name}");
            if let Some(n) = resolve(&tree, &inner.state.holders, &cp) {
                let i = inner.inodes.ino(&cp);
                entries.push((i, kind_of(&n), name.clone()));
            }
        }
        let fh = inner.next_fh;
        inner.next_fh += 1;
        inner.handles.insert(fh, Handle::Dir { entries });
        reply.opened(FileHandle(fh), FopenFlags::empty());
    }

    fn readdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let inner = self.shared.lock();
        let Some(Handle::Dir { entries }) = inner.handles.get(&fh.0) else {
            return reply.error(Errno::EBADF);
        };
        for (i, (ino, kind, name)) in entries.iter().enumerate().skip(offset as usize) {
            if reply.add(INodeNo(*ino), (i + 1) as u64, *kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        self.shared.lock().handles.remove(&fh.0);
        reply.ok();
    }
}
