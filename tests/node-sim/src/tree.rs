//! The file tree `sys`, `dev` and `proc` show, kept up to date piece by piece.
//!
//! Paths are relative to the sim's root directory (`sys/bus/pci/drivers/nvidia/bind`). Each part
//! of the node (the fixed files, one PCI function, one mdev: an [`Owner`]) renders a
//! [`Fragment`], the files it contributes; [`Tree::apply`] replaces an owner's fragment and
//! changes only the paths that differ, so a write costs what it changes, not the size of the
//! node. Several owners may contribute one path (the `type` of a group two functions share, the
//! `dev/nvidiactl` every GPU on `nvidia` has): it stays while one does.
//!
//! Every node has an inode number for as long as it exists unchanged: a node that goes, or
//! changes (a link's target, a file's kind), gets a fresh number when it comes back, so what the
//! kernel caches about an inode never goes stale. [`Changes`] lists what went (for the kernel's
//! caches to forget) and which directories' listings changed.

use std::collections::{BTreeSet, HashMap, HashSet};

/// What a write to a file does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum WriteTarget {
    /// `<dev>/driver_override` of the device.
    DriverOverride(String),
    /// `drivers/<d>/bind`.
    Bind(String),
    /// `drivers/<d>/unbind`.
    Unbind(String),
    /// `bus/pci/drivers_probe`.
    Probe,
    /// `<pf>/sriov_numvfs`.
    SriovNumvfs(String),
    /// `<parent>/mdev_supported_types/nvidia-<id>/create`.
    Create { parent: String, type_id: u32 },
    /// `<mdev>/remove`.
    Remove(String),
    /// `<vf>/nvidia/current_vgpu_type`.
    CurrentVgpu(String),
    /// `kernel/node-sim/control`.
    Control,
    /// Accepted and ignored (`rescan`, `new_id`).
    Ignore,
}

/// What opening a device node records.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum OpenKind {
    /// `/dev/vfio/<group>`: one opener at a time.
    VfioGroup(u32),
    /// `/dev/vfio/devices/vfio<N>` (iommufd): any number of openers.
    VfioCdev(u32),
    /// `/dev/nvidia<N>`: any number of openers.
    Nvidia(u32),
}

/// An attribute whose value follows the node's state: read from the state when the file is
/// opened (as sysfs reads an attribute at its first read), so a change of value alone changes
/// nothing in the tree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Attr {
    /// `<dev>/driver_override`.
    DriverOverride(String),
    /// `<dev>/uevent` (its `DRIVER=` line follows the binding).
    Uevent(String),
    /// `<pf>/sriov_numvfs`.
    SriovNumvfs(String),
    /// `<parent>/mdev_supported_types/nvidia-<id>/available_instances`.
    AvailableInstances { parent: String, type_id: u32 },
    /// `<vf>/nvidia/creatable_vgpu_types`.
    Creatable(String),
    /// `<vf>/nvidia/current_vgpu_type`.
    CurrentVgpu(String),
}

/// A file's contents.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Content {
    /// Fixed text.
    Text(String),
    /// An attribute read from the state at open.
    Attr(Attr),
    /// Write-only attribute: opening for read fails with EACCES.
    WriteOnly,
    /// The op log, read at open time.
    Ops,
}

/// A regular file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct File {
    pub content: Content,
    pub mode: u16,
    pub write: Option<WriteTarget>,
    pub open: Option<OpenKind>,
}

/// A tree entry. A directory's children are the tree's business: a fragment contributes a
/// directory as `Dir` with no children.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Node {
    Dir(BTreeSet<String>),
    File(File),
    Link(String),
}

impl Node {
    /// The same node for the kernel: same kind, and for files and links the same contents.
    fn same(&self, other: &Node) -> bool {
        match (self, other) {
            (Node::Dir(_), Node::Dir(_)) => true,
            (a, b) => a == b,
        }
    }
}

/// What contributes files to the tree.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Owner {
    /// The fixed files: buses, drivers, node-sim's own files.
    Base,
    /// A PCI function, by address.
    Dev(String),
    /// An mdev, by UUID.
    Mdev(String),
}

/// The files one owner contributes.
#[derive(Debug, Default)]
pub(crate) struct Fragment {
    nodes: Vec<(String, Node)>,
}

impl Fragment {
    fn push(&mut self, path: String, node: Node) {
        self.nodes.push((path, node));
    }

    /// A directory (its parents are implied by any path).
    pub fn dir(&mut self, path: &str) {
        self.push(path.to_string(), Node::Dir(BTreeSet::new()));
    }

    /// A read-only file.
    pub fn ro(&mut self, path: &str, text: impl Into<String>) {
        self.file(path, Content::Text(text.into()), 0o444, None);
    }

    /// A read-only attribute read from the state.
    pub fn ro_attr(&mut self, path: &str, attr: Attr) {
        self.file(path, Content::Attr(attr), 0o444, None);
    }

    /// A read-write attribute with fixed contents.
    pub fn rw(&mut self, path: &str, text: impl Into<String>, write: WriteTarget) {
        self.file(path, Content::Text(text.into()), 0o644, Some(write));
    }

    /// A read-write attribute read from the state.
    pub fn rw_attr(&mut self, path: &str, attr: Attr, write: WriteTarget) {
        self.file(path, Content::Attr(attr), 0o644, Some(write));
    }

    /// A write-only attribute.
    pub fn wo(&mut self, path: &str, write: WriteTarget) {
        self.file(path, Content::WriteOnly, 0o200, Some(write));
    }

    pub fn file(&mut self, path: &str, content: Content, mode: u16, write: Option<WriteTarget>) {
        self.push(
            path.to_string(),
            Node::File(File {
                content,
                mode,
                write,
                open: None,
            }),
        );
    }

    /// A device node (a regular file: FUSE mounts are nodev).
    pub fn devnode(&mut self, path: &str, mode: u16, open: Option<OpenKind>) {
        self.push(
            path.to_string(),
            Node::File(File {
                content: Content::Text(String::new()),
                mode,
                write: None,
                open,
            }),
        );
    }

    /// A symlink at `path` to the tree path `target`, written relative like the kernel's.
    pub fn link(&mut self, path: &str, target: &str) {
        self.push(path.to_string(), Node::Link(rel_link(path, target)));
    }
}

/// One node of the tree.
#[derive(Debug)]
pub(crate) struct Entry {
    pub path: String,
    pub node: Node,
    /// How many fragments contribute it (0: a directory that exists for its children).
    refs: u32,
    /// Whether the kernel may have a dentry for it (it was looked up).
    pub looked_up: bool,
}

/// What one update removed or changed, for the kernel's caches.
#[derive(Debug, Default)]
pub(crate) struct Changes {
    /// Paths gone (or replaced by a different node), with whether the kernel may know them.
    pub removed: Vec<(String, bool)>,
    /// Directories still there whose listing changed.
    pub dirs: BTreeSet<String>,
}

/// The whole tree.
#[derive(Debug, Default)]
pub(crate) struct Tree {
    entries: HashMap<u64, Entry>,
    by_path: HashMap<String, u64>,
    /// The paths each owner contributes.
    fragments: HashMap<Owner, Vec<String>>,
    next_ino: u64,
}

impl Tree {
    /// The inode number of a path.
    pub fn ino(&self, path: &str) -> Option<u64> {
        self.by_path.get(path).copied()
    }

    /// The entry of an inode number.
    pub fn entry(&self, ino: u64) -> Option<&Entry> {
        self.entries.get(&ino)
    }

    /// The entry of an inode number, to mark it looked up.
    pub fn entry_mut(&mut self, ino: u64) -> Option<&mut Entry> {
        self.entries.get_mut(&ino)
    }

    /// The node at a path.
    pub fn get(&self, path: &str) -> Option<&Node> {
        self.ino(path)
            .and_then(|i| self.entries.get(&i))
            .map(|e| &e.node)
    }

    /// Replaces what `owner` contributes with `fragment` (empty: the owner is gone), changing
    /// only the paths that differ.
    pub fn apply(&mut self, owner: Owner, fragment: Fragment, changes: &mut Changes) {
        let new = fragment.nodes;
        let old = self.fragments.remove(&owner).unwrap_or_default();
        let new_paths: HashSet<&str> = new.iter().map(|(p, _)| p.as_str()).collect();
        for p in &old {
            if !new_paths.contains(p.as_str()) {
                self.unref(p, changes);
            }
        }
        let old_paths: HashSet<&str> = old.iter().map(String::as_str).collect();
        let mut paths = Vec::with_capacity(new.len());
        for (p, n) in new {
            if old_paths.contains(p.as_str()) {
                if self.get(&p).is_some_and(|cur| cur.same(&n)) {
                    paths.push(p);
                    continue;
                }
                self.unref(&p, changes);
            }
            self.add(&p, n, changes);
            paths.push(p);
        }
        if !paths.is_empty() {
            self.fragments.insert(owner, paths);
        }
    }

    fn alloc(&mut self, path: &str, node: Node, refs: u32) -> u64 {
        self.next_ino += 1;
        // 1 is each mount's root for the kernel: start above it.
        let ino = self.next_ino + 1;
        self.entries.insert(
            ino,
            Entry {
                path: path.to_string(),
                node,
                refs,
                looked_up: false,
            },
        );
        self.by_path.insert(path.to_string(), ino);
        ino
    }

    fn add(&mut self, path: &str, node: Node, changes: &mut Changes) {
        if let Some(ino) = self.ino(path)
            && let Some(e) = self.entries.get_mut(&ino)
        {
            e.refs += 1;
            if !e.node.same(&node) {
                // Another node at this path: a fresh inode, and the old one is gone.
                let looked_up = e.looked_up;
                let refs = e.refs;
                self.entries.remove(&ino);
                self.alloc(path, node, refs);
                changes.removed.push((path.to_string(), looked_up));
            }
            return;
        }
        self.alloc(path, node, 1);
        self.link_to_parents(path, changes);
    }

    /// Adds `path` to its parent's children, creating missing parents.
    fn link_to_parents(&mut self, path: &str, changes: &mut Changes) {
        let mut child = path;
        while let Some((parent, name)) = child.rsplit_once('/') {
            match self.ino(parent).and_then(|i| self.entries.get_mut(&i)) {
                Some(Entry {
                    node: Node::Dir(children),
                    ..
                }) => {
                    children.insert(name.to_string());
                    if !changes.dirs.contains(parent) {
                        changes.dirs.insert(parent.to_string());
                    }
                    return;
                }
                Some(_) => return,
                None => {
                    self.alloc(parent, Node::Dir(BTreeSet::from([name.to_string()])), 0);
                    child = parent;
                }
            }
        }
    }

    fn unref(&mut self, path: &str, changes: &mut Changes) {
        let Some(ino) = self.ino(path) else {
            return;
        };
        let Some(e) = self.entries.get_mut(&ino) else {
            return;
        };
        e.refs = e.refs.saturating_sub(1);
        let empty = !matches!(&e.node, Node::Dir(c) if !c.is_empty());
        if e.refs == 0 && empty {
            self.remove(ino, changes);
        }
    }

    /// Removes an entry with no contributions and no children, and its parents that are left
    /// with neither.
    fn remove(&mut self, ino: u64, changes: &mut Changes) {
        let Some(e) = self.entries.remove(&ino) else {
            return;
        };
        self.by_path.remove(&e.path);
        changes.dirs.remove(&e.path);
        changes.removed.push((e.path.clone(), e.looked_up));
        let Some((parent, name)) = e.path.rsplit_once('/') else {
            return;
        };
        let Some(pino) = self.ino(parent) else {
            return;
        };
        if let Some(p) = self.entries.get_mut(&pino) {
            if let Node::Dir(children) = &mut p.node {
                children.remove(name);
                if children.is_empty() && p.refs == 0 {
                    self.remove(pino, changes);
                    return;
                }
            }
            if !changes.dirs.contains(parent) {
                changes.dirs.insert(parent.to_string());
            }
        }
    }

    /// Every path and its node (for comparing two trees).
    #[cfg(test)]
    pub fn nodes(&self) -> std::collections::BTreeMap<&str, &Node> {
        self.entries
            .values()
            .map(|e| (e.path.as_str(), &e.node))
            .collect()
    }
}

/// The relative target of a link at `link` pointing to `target` (both tree paths).
pub(crate) fn rel_link(link: &str, target: &str) -> String {
    let from: Vec<&str> = link.split('/').collect();
    let from_dir = &from[..from.len().saturating_sub(1)];
    let to: Vec<&str> = target.split('/').collect();
    let common = from_dir.iter().zip(&to).take_while(|(a, b)| a == b).count();
    let mut parts: Vec<&str> = vec![".."; from_dir.len() - common];
    parts.extend(&to[common..]);
    parts.join("/")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_links_match_the_kernel() {
        assert_eq!(
            rel_link(
                "sys/devices/pci0000:40/0000:40:01.1/0000:41:00.0/driver",
                "sys/bus/pci/drivers/nvidia"
            ),
            "../../../../bus/pci/drivers/nvidia"
        );
        assert_eq!(
            rel_link(
                "sys/devices/p/0000:41:00.4/abc/mdev_type",
                "sys/devices/p/0000:41:00.4/mdev_supported_types/nvidia-593"
            ),
            "../mdev_supported_types/nvidia-593"
        );
        assert_eq!(
            rel_link(
                "sys/bus/pci/devices/0000:41:00.0",
                "sys/devices/p/0000:41:00.0"
            ),
            "../../../devices/p/0000:41:00.0"
        );
    }

    fn fragment(files: &[&str]) -> Fragment {
        let mut f = Fragment::default();
        for p in files {
            f.ro(p, "x");
        }
        f
    }

    fn children(t: &Tree, path: &str) -> Vec<String> {
        match t.get(path) {
            Some(Node::Dir(c)) => c.iter().cloned().collect(),
            other => panic!("{path}: {other:?}"),
        }
    }

    #[test]
    fn parents_are_created_and_list_children() {
        let mut t = Tree::default();
        let mut ch = Changes::default();
        t.apply(Owner::Base, fragment(&["sys/a/b/c", "sys/a/d"]), &mut ch);
        assert_eq!(children(&t, "sys/a"), ["b", "d"]);
        assert!(matches!(t.get("sys"), Some(Node::Dir(_))));
    }

    #[test]
    fn an_update_changes_only_what_differs_and_empty_parents_go() {
        let mut t = Tree::default();
        let mut ch = Changes::default();
        t.apply(
            Owner::Dev("a".into()),
            fragment(&["s/d/a/x", "s/d/a/y"]),
            &mut ch,
        );
        t.apply(
            Owner::Dev("b".into()),
            fragment(&["s/d/b/x", "s/shared"]),
            &mut ch,
        );
        t.apply(Owner::Mdev("m".into()), fragment(&["s/shared"]), &mut ch);
        let x = t.ino("s/d/a/x").unwrap();
        let mut ch = Changes::default();
        t.apply(Owner::Dev("a".into()), fragment(&["s/d/a/x"]), &mut ch);
        assert_eq!(t.ino("s/d/a/x"), Some(x), "unchanged: same inode");
        assert_eq!(ch.removed, [("s/d/a/y".to_string(), false)]);
        assert_eq!(ch.dirs, BTreeSet::from(["s/d/a".to_string()]));
        // Gone: its directory too; a path another owner still contributes stays.
        let mut ch = Changes::default();
        t.apply(Owner::Dev("b".into()), Fragment::default(), &mut ch);
        assert!(t.get("s/d/b").is_none());
        assert!(t.get("s/shared").is_some());
        assert_eq!(children(&t, "s/d"), ["a"]);
        // A link whose target changes is a new inode.
        let mut f = Fragment::default();
        f.link("s/l", "s/d/a");
        t.apply(Owner::Base, f, &mut Changes::default());
        let l = t.ino("s/l").unwrap();
        let mut f = Fragment::default();
        f.link("s/l", "s/shared");
        let mut ch = Changes::default();
        t.apply(Owner::Base, f, &mut ch);
        assert_ne!(t.ino("s/l"), Some(l));
        assert_eq!(ch.removed, [("s/l".to_string(), false)]);
        assert!(t.entry(l).is_none());
    }
}
