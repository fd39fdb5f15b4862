//! The rendered file tree: what `sys`, `dev` and `proc` show for one state of the node.
//! Paths are relative to the sim's root directory (`sys/bus/pci/drivers/nvidia/bind`).

use std::collections::{BTreeSet, HashMap};

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
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OpenKind {
    /// `/dev/vfio/<group>`: one opener at a time.
    VfioGroup(u32),
    /// `/dev/vfio/devices/vfio<N>` (iommufd): any number of openers.
    VfioCdev(u32),
    /// `/dev/nvidia<N>`: any number of openers.
    Nvidia(u32),
}

/// A file's contents.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Content {
    /// Fixed text.
    Text(String),
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

/// A tree entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Node {
    Dir(BTreeSet<String>),
    File(File),
    Link(String),
}

/// The whole tree, by path.
#[derive(Debug, Default)]
pub(crate) struct Tree {
    nodes: HashMap<String, Node>,
}

impl Tree {
    pub fn get(&self, path: &str) -> Option<&Node> {
        self.nodes.get(path)
    }

    fn ensure_parents(&mut self, path: &str) {
        let mut child = path;
        while let Some((parent, name)) = child.rsplit_once('/') {
            let entry = self
                .nodes
                .entry(parent.to_string())
                .or_insert_with(|| Node::Dir(BTreeSet::new()));
            let existed = match entry {
                Node::Dir(children) => !children.insert(name.to_string()),
                _ => true,
            };
            if existed {
                return;
            }
            child = parent;
        }
    }

    fn insert(&mut self, path: String, node: Node) {
        self.ensure_parents(&path);
        self.nodes.insert(path, node);
    }

    /// An empty directory (parents are created as needed).
    pub fn dir(&mut self, path: &str) {
        self.ensure_parents(path);
        self.nodes
            .entry(path.to_string())
            .or_insert_with(|| Node::Dir(BTreeSet::new()));
    }

    /// A read-only file.
    pub fn ro(&mut self, path: &str, text: impl Into<String>) {
        self.file(path, Content::Text(text.into()), 0o444, None);
    }

    /// A read-write attribute.
    pub fn rw(&mut self, path: &str, text: impl Into<String>, write: WriteTarget) {
        self.file(path, Content::Text(text.into()), 0o644, Some(write));
    }

    /// A write-only attribute.
    pub fn wo(&mut self, path: &str, write: WriteTarget) {
        self.file(path, Content::WriteOnly, 0o200, Some(write));
    }

    pub fn file(&mut self, path: &str, content: Content, mode: u16, write: Option<WriteTarget>) {
        self.insert(
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
        self.insert(
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
        let rel = rel_link(path, target);
        self.insert(path.to_string(), Node::Link(rel));
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

    #[test]
    fn parents_are_created_and_list_children() {
        let mut t = Tree::default();
        t.ro("sys/a/b/c", "x");
        t.ro("sys/a/d", "y");
        match t.get("sys/a") {
            Some(Node::Dir(c)) => assert_eq!(c.iter().collect::<Vec<_>>(), ["b", "d"]),
            other => panic!("{other:?}"),
        }
        assert!(matches!(t.get("sys"), Some(Node::Dir(_))));
    }
}
