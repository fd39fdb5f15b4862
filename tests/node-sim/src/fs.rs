//! The FUSE side: one `SimFs` per mount (`sys`, `dev`, `proc`), all over one shared state.
//!
//! `sys` and `dev` let the kernel cache names and attributes ([`CACHED`]): a path walk or a
//! `stat` costs no request. Every change of the node is brought into the tree before the write
//! that made it returns, and what it removed or changed is invalidated in the kernel's caches
//! first ([`Shared::change`]), so the very next read sees it. Inode numbers never come back with
//! other contents (see [`crate::tree`]), so symlinks are cached too. `proc` follows host
//! processes that change without telling node-sim: nothing there is cached.

use std::collections::{BTreeSet, HashMap};
use std::ffi::OsStr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags,
    KernelConfig, LockOwner, Notifier, OpenAccMode, OpenFlags, ReplyAttr, ReplyData,
    ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyWrite, Request, TimeOrNow, WriteFlags,
};

use crate::faults::Faults;
use crate::holders::Holders;
use crate::state::State;
use crate::tree::{Changes, Content, Entry, File, Node, Tree, WriteTarget};
use crate::uevent::UeventSender;

/// How long the kernel may keep names and attributes of `sys` and `dev`: every change is
/// invalidated explicitly, so this only bounds the cache's memory.
const CACHED: Duration = Duration::from_secs(3600);

/// FUSE's inode number of each mount's root.
const ROOT_INO: u64 = 1;

/// Inode numbers of `proc/<pid>/…` start here, above any the tree hands out.
const PROC_INO_BASE: u64 = 1 << 48;

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

/// Inode numbers of `proc/<pid>/…`: one per path and contents, so a descriptor that now names
/// another node is another inode (the kernel caches symlinks by inode).
#[derive(Debug, Default)]
struct ProcInodes {
    by_key: HashMap<String, u64>,
    paths: HashMap<u64, String>,
}

impl ProcInodes {
    fn ino(&mut self, path: &str, node: &Node) -> u64 {
        let key = match node {
            Node::Link(t) => format!("{path}\0{t}"),
            Node::Dir(_) => format!("{path}\0/"),
            Node::File(_) => path.to_string(),
        };
        if let Some(i) = self.by_key.get(&key) {
            return *i;
        }
        let i = PROC_INO_BASE + self.paths.len() as u64;
        self.paths.insert(i, path.to_string());
        self.by_key.insert(key, i);
        i
    }
}

/// Everything behind the three mounts.
#[derive(Debug)]
pub(crate) struct Inner {
    pub state: State,
    tree: Tree,
    proc_inodes: ProcInodes,
    handles: HashMap<u64, Handle>,
    next_fh: u64,
}

impl Inner {
    pub fn new(mut state: State) -> Inner {
        let mut tree = Tree::default();
        state.refresh(&mut tree);
        Inner {
            state,
            tree,
            proc_inodes: ProcInodes::default(),
            handles: HashMap::new(),
            next_fh: 1,
        }
    }

    fn new_fh(&mut self) -> u64 {
        let fh = self.next_fh;
        self.next_fh += 1;
        fh
    }
}

/// An invalidation for the kernel's caches of one mount.
#[derive(Debug)]
enum Invalidate {
    /// A name gone from a directory (the kernel drops the dentry, and those under it).
    Entry { parent: u64, name: String },
    /// A directory's attributes (its link count follows its children).
    Attrs(u64),
}

/// The shared state, the uevent socket and the mounts' notifiers.
#[derive(Debug)]
pub(crate) struct Shared {
    inner: Mutex<Inner>,
    uevents: Option<UeventSender>,
    notifiers: Mutex<HashMap<String, Notifier>>,
}

impl Shared {
    pub fn new(inner: Inner, uevents: Option<UeventSender>) -> Shared {
        Shared {
            inner: Mutex::new(inner),
            uevents,
            notifiers: Mutex::new(HashMap::new()),
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while the lock is held leaves a state that is still the best we have.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Lets the kernel's caches of mount `name` (`sys`) be invalidated.
    pub fn add_notifier(&self, name: &str, notifier: Notifier) {
        self.notifiers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_string(), notifier);
    }

    /// Runs a change of the node: the state's effect, then the tree brought up to date, the
    /// uevents sent and the kernel's caches of what changed invalidated — all before this
    /// returns, so that the next request sees the change.
    pub fn change<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        let (r, events, invalidations) = {
            let mut inner = self.lock();
            let r = f(&mut inner.state);
            let Inner { state, tree, .. } = &mut *inner;
            let changes = state.refresh(tree);
            let events = std::mem::take(&mut state.events);
            (r, events, invalidations(tree, changes))
        };
        if let Some(s) = &self.uevents {
            s.send(&events);
        }
        // Without the lock: the kernel waits for requests in flight in a directory before it
        // invalidates a name there, and those requests need the lock.
        self.invalidate(invalidations);
        r
    }

    fn invalidate(&self, list: Vec<(String, Invalidate)>) {
        if list.is_empty() {
            return;
        }
        let notifiers = self
            .notifiers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        for (mount, inv) in list {
            let Some(n) = notifiers.get(&mount) else {
                continue;
            };
            // ENOENT: the kernel had forgotten it already.
            let _ = match inv {
                Invalidate::Entry { parent, name } => {
                    n.inval_entry(INodeNo(parent), OsStr::new(&name))
                }
                Invalidate::Attrs(ino) => n.inval_inode(INodeNo(ino), -1, 0),
            };
        }
    }

    /// A write to a kernel file: faults, delay, the kernel's effect, the op log.
    pub fn write(&self, path: &str, target: &WriteTarget, value: &str) -> Result<(), i32> {
        if *target == WriteTarget::Control {
            return self.change(|st| st.control(value)).map_err(|e| {
                tracing::warn!("control: {e}");
                libc::EINVAL
            });
        }
        let keys = Faults::keys(target, value);
        let taken = match &keys {
            Some((op, keys)) => self.lock().state.faults.take(op, keys),
            None => Default::default(),
        };
        if !taken.delay.is_zero() {
            std::thread::sleep(taken.delay);
        }
        let result = self.change(|st| {
            let result = match taken.errno {
                Some(e) => Err(e),
                None => st.write(target, value),
            };
            st.ops.log(path, value, result);
            result
        });
        if !taken.after.is_zero() {
            std::thread::sleep(taken.after);
        }
        result
    }
}

/// What the kernel must forget after `changes`: names gone that it may have looked up (only
/// the topmost of a removed subtree) and directories whose listing changed, by mount. `proc` is
/// never cached, so never invalidated.
fn invalidations(tree: &Tree, changes: Changes) -> Vec<(String, Invalidate)> {
    let removed: BTreeSet<&str> = changes.removed.iter().map(|(p, _)| p.as_str()).collect();
    let ino_of = |path: &str| -> Option<u64> {
        if path.contains('/') {
            tree.ino(path)
        } else {
            Some(ROOT_INO)
        }
    };
    let mut out = Vec::new();
    for (path, looked_up) in &changes.removed {
        let Some((parent, name)) = path.rsplit_once('/') else {
            continue;
        };
        let mount = mount_of(path);
        if !looked_up || mount == "proc" || removed.contains(parent) {
            continue;
        }
        if let Some(parent) = ino_of(parent) {
            out.push((
                mount.to_string(),
                Invalidate::Entry {
                    parent,
                    name: name.to_string(),
                },
            ));
        }
    }
    for dir in &changes.dirs {
        let mount = mount_of(dir);
        let known = !dir.contains('/')
            || tree
                .ino(dir)
                .and_then(|i| tree.entry(i))
                .is_some_and(|e| e.looked_up);
        if known
            && mount != "proc"
            && let Some(ino) = ino_of(dir)
        {
            out.push((mount.to_string(), Invalidate::Attrs(ino)));
        }
    }
    out
}

fn mount_of(path: &str) -> &str {
    path.split('/').next().unwrap_or(path)
}

/// `proc/<pid>/…`: a process holding a simulated device node now (see [`Holders`]); `None` for
/// any other path.
fn proc_node(tree: &Tree, holders: &Holders, path: &str) -> Option<Option<Node>> {
    let rest = path.strip_prefix("proc/")?;
    let (pid, rest) = rest.split_once('/').unwrap_or((rest, ""));
    let pid: u32 = pid.parse().ok()?;
    let Some(p) = holders.process(pid, |node| tree.get(node).is_some()) else {
        return Some(None);
    };
    let file = |text: String| {
        Node::File(File {
            content: Content::Text(text),
            mode: 0o444,
            write: None,
            open: None,
        })
    };
    Some(match rest {
        "" => Some(Node::Dir(BTreeSet::from(
            ["comm", "cmdline", "fd"].map(String::from),
        ))),
        "comm" => Some(file(p.comm())),
        "cmdline" => Some(file(p.cmdline())),
        "fd" => Some(Node::Dir(p.fds.keys().map(u32::to_string).collect())),
        _ => rest
            .strip_prefix("fd/")
            .and_then(|n| n.parse::<u32>().ok())
            .and_then(|fd| p.fds.get(&fd))
            .map(|t| Node::Link(t.clone())),
    })
}

/// A node found: the tree's, or one made for `proc/<pid>/…`.
#[derive(Debug)]
enum Found<'a> {
    Tree(&'a Entry),
    Made(String, Node),
}

impl Found<'_> {
    fn path(&self) -> &str {
        match self {
            Found::Tree(e) => &e.path,
            Found::Made(p, _) => p,
        }
    }

    fn node(&self) -> &Node {
        match self {
            Found::Tree(e) => &e.node,
            Found::Made(_, n) => n,
        }
    }
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
    /// How long the kernel may cache this mount's names and attributes.
    fn ttl(&self) -> Duration {
        if self.root == "proc" {
            Duration::ZERO
        } else {
            CACHED
        }
    }

    fn path_of(&self, inner: &Inner, ino: u64) -> Option<String> {
        if ino == ROOT_INO {
            return Some(self.root.clone());
        }
        if let Some(e) = inner.tree.entry(ino) {
            return Some(e.path.clone());
        }
        inner.proc_inodes.paths.get(&ino).cloned()
    }

    /// The node at `path` and its inode number (the tree's, or `proc`'s own).
    fn node<'a>(&self, inner: &'a mut Inner, path: &str) -> Option<(u64, Found<'a>)> {
        let Inner {
            state,
            tree,
            proc_inodes,
            ..
        } = inner;
        if path == "proc" {
            // The mount root: the tree's `proc` and the holders.
            let Some(Node::Dir(children)) = tree.get(path) else {
                return None;
            };
            let mut children = children.clone();
            children.extend(state.holders.pids().iter().map(u32::to_string));
            return Some((ROOT_INO, Found::Made(path.to_string(), Node::Dir(children))));
        }
        if let Some(found) = proc_node(tree, &state.holders, path) {
            let node = found?;
            let ino = proc_inodes.ino(path, &node);
            return Some((ino, Found::Made(path.to_string(), node)));
        }
        let ino = tree.ino(path)?;
        let e = tree.entry(ino)?;
        let ino = if path == self.root { ROOT_INO } else { ino };
        Some((ino, Found::Tree(e)))
    }

    /// The node of an inode number.
    fn node_of<'a>(&self, inner: &'a mut Inner, ino: u64) -> Option<Found<'a>> {
        if ino != ROOT_INO && inner.tree.entry(ino).is_some() {
            return inner.tree.entry(ino).map(Found::Tree);
        }
        let path = self.path_of(inner, ino)?;
        self.node(inner, &path).map(|(_, f)| f)
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
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // Symlinks are cached by inode (their target never changes under one number); lookups
        // in one directory run in parallel. Both are optional: without them it is slower.
        for cap in [
            InitFlags::FUSE_CACHE_SYMLINKS,
            InitFlags::FUSE_PARALLEL_DIROPS,
        ] {
            let _ = config.add_capabilities(cap);
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let mut inner = self.shared.lock();
        let Some(pp) = self.path_of(&inner, parent.0) else {
            return reply.error(Errno::ENOENT);
        };
        let Some(name) = name.to_str() else {
            return reply.error(Errno::ENOENT);
        };
        let path = format!("{pp}/{name}");
        if let Some(e) = inner.tree.ino(&path).and_then(|i| inner.tree.entry_mut(i)) {
            e.looked_up = true;
        }
        match self.node(&mut inner, &path) {
            Some((ino, found)) => {
                let ttl = if ino >= PROC_INO_BASE {
                    Duration::ZERO
                } else {
                    self.ttl()
                };
                reply.entry(&ttl, &self.attr(ino, &path, found.node()), Generation(0));
            }
            None => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let mut inner = self.shared.lock();
        match self.node_of(&mut inner, ino.0) {
            Some(found) => {
                let ttl = if ino.0 >= PROC_INO_BASE || ino.0 == ROOT_INO {
                    Duration::ZERO
                } else {
                    self.ttl()
                };
                reply.attr(&ttl, &self.attr(ino.0, found.path(), found.node()));
            }
            None => reply.error(Errno::ENOENT),
        }
    }

    fn setattr(
        &self,
        req: &Request,
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
        self.getattr(req, ino, None, reply);
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let mut inner = self.shared.lock();
        match self.node_of(&mut inner, ino.0).as_ref().map(Found::node) {
            Some(Node::Link(t)) => reply.data(t.as_bytes()),
            Some(_) => reply.error(Errno::EINVAL),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let mut inner = self.shared.lock();
        let found = self.node_of(&mut inner, ino.0);
        let file = match found.as_ref().map(Found::node) {
            Some(Node::File(f)) => f.clone(),
            Some(Node::Dir(_)) => return reply.error(Errno::EISDIR),
            Some(Node::Link(_)) => return reply.error(Errno::ELOOP),
            None => return reply.error(Errno::ENOENT),
        };
        let acc = flags.acc_mode();
        let reads = matches!(acc, OpenAccMode::O_RDONLY | OpenAccMode::O_RDWR);
        let writes = matches!(acc, OpenAccMode::O_WRONLY | OpenAccMode::O_RDWR);
        if (reads && file.content == Content::WriteOnly)
            || (writes && file.write.is_none() && self.root != "dev")
        {
            return reply.error(Errno::EACCES);
        }
        let (open, writable) = (file.open, file.write.is_some());
        let data = match file.content {
            Content::Text(s) => s.into_bytes(),
            Content::Attr(a) => inner.state.attr(&a).into_bytes(),
            Content::WriteOnly => Vec::new(),
            Content::Ops => inner.state.ops.text().into_bytes(),
        };
        let fh = inner.new_fh();
        if let Some(kind) = open
            && let Err(e) = inner.state.holders.open(kind, fh)
        {
            return reply.error(Errno::from_i32(e));
        }
        // Writes to one attribute from several processes (every GPU's unbind goes to
        // drivers/nvidia/unbind) run in parallel, as sysfs runs them: without this flag FUSE
        // serialises writes to one inode, and a slow unbind would hold up every other one.
        // Only device nodes need to hear of each close (their holders, see `flush`).
        let mut open_flags = FopenFlags::FOPEN_DIRECT_IO;
        if writable {
            open_flags |= FopenFlags::FOPEN_PARALLEL_DIRECT_WRITES;
        }
        if open.is_none() {
            open_flags |= FopenFlags::FOPEN_NOFLUSH;
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
            let inner = self.shared.lock();
            match inner.tree.entry(ino.0) {
                Some(e) => match &e.node {
                    Node::File(File { write: Some(t), .. }) => (e.path.clone(), t.clone()),
                    _ => return reply.error(Errno::EACCES),
                },
                // The file went away since it was opened (its device is gone).
                None => return reply.error(Errno::ENODEV),
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
        // Only device nodes are flushed. close() sends FLUSH, after the descriptor left the
        // process, and waits for it; RELEASE comes later, asynchronously, once the description
        // is gone. A holder is forgotten here when no process has a descriptor of the node any
        // more, so that an open right after the last close succeeds, as on the kernel.
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
        let Some(path) = self.path_of(&inner, ino.0) else {
            return reply.error(Errno::ENOENT);
        };
        let children = match self.node(&mut inner, &path).as_ref().map(|(_, f)| f.node()) {
            Some(Node::Dir(children)) => children.clone(),
            _ => return reply.error(Errno::ENOTDIR),
        };
        let mut entries = vec![
            (ino.0, FileType::Directory, ".".to_string()),
            (ROOT_INO, FileType::Directory, "..".to_string()),
        ];
        for name in children {
            let cp = format!("{path}/{name}");
            if let Some((i, found)) = self.node(&mut inner, &cp) {
                entries.push((i, kind_of(found.node()), name));
            }
        }
        let fh = inner.new_fh();
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
