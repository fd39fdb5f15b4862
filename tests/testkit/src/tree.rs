//! A host root's whole tree, to show that a command wrote nothing: every file's content (or
//! the error reading it gives), every link's target, every directory and socket.
//!
//! ```no_run
//! # let root = std::path::Path::new("/tmp/node");
//! let before = testkit::tree::Tree::read(root);
//! // run a read-only command against root ...
//! before.assert_same(&testkit::tree::Tree::read(root), "status");
//! ```

use std::collections::BTreeMap;
use std::os::unix::fs::FileTypeExt as _;
use std::path::{Path, PathBuf};

/// One entry of the tree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Node {
    /// A directory.
    Dir,
    /// A symbolic link and its target (not followed).
    Link(PathBuf),
    /// A regular file's bytes, or the error reading it gives (a write-only sysfs file).
    File(Result<Vec<u8>, String>),
    /// Anything else (a socket, a FIFO).
    Other(String),
}

/// Every entry under a root, by path relative to it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tree(pub BTreeMap<PathBuf, Node>);

impl Tree {
    /// Reads everything under `root`, following no link.
    pub fn read(root: &Path) -> Tree {
        let mut out = BTreeMap::new();
        walk(root, Path::new(""), &mut out);
        Tree(out)
    }

    /// What differs from `after`: one line per path added, removed or changed.
    pub fn diff(&self, after: &Tree) -> Vec<String> {
        let mut d = Vec::new();
        for (p, n) in &self.0 {
            match after.0.get(p) {
                None => d.push(format!("removed {}", p.display())),
                Some(m) if m != n => d.push(format!(
                    "changed {}: {} -> {}",
                    p.display(),
                    show(n),
                    show(m)
                )),
                Some(_) => {}
            }
        }
        for (p, n) in &after.0 {
            if !self.0.contains_key(p) {
                d.push(format!("added {}: {}", p.display(), show(n)));
            }
        }
        d
    }

    /// Panics, listing the differences, unless `after` is the same tree.
    pub fn assert_same(&self, after: &Tree, what: &str) {
        let d = self.diff(after);
        assert!(
            d.is_empty(),
            "{what} changed the host root:\n  {}",
            d.join("\n  ")
        );
    }
}

fn show(n: &Node) -> String {
    match n {
        Node::Dir => "directory".into(),
        Node::Link(t) => format!("-> {}", t.display()),
        Node::File(Ok(b)) => format!("{:?}", String::from_utf8_lossy(b)),
        Node::File(Err(e)) => format!("unreadable ({e})"),
        Node::Other(k) => k.clone(),
    }
}

fn walk(root: &Path, rel: &Path, out: &mut BTreeMap<PathBuf, Node>) {
    let dir = root.join(rel);
    let Ok(rd) = std::fs::read_dir(&dir) else {
        return;
    };
    for e in rd.flatten() {
        let rel = rel.join(e.file_name());
        let path = root.join(&rel);
        let Ok(ft) = e.file_type() else {
            out.insert(rel, Node::Other("vanished".into()));
            continue;
        };
        let node = if ft.is_symlink() {
            Node::Link(std::fs::read_link(&path).unwrap_or_default())
        } else if ft.is_dir() {
            walk(root, &rel, out);
            Node::Dir
        } else if ft.is_file() {
            Node::File(std::fs::read(&path).map_err(|e| e.to_string()))
        } else if ft.is_socket() {
            Node::Other("socket".into())
        } else {
            Node::Other(format!("{ft:?}"))
        };
        out.insert(rel, node);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_of_content_link_or_entry_is_seen() {
        let dir = tempfile::tempdir().unwrap();
        let r = dir.path();
        std::fs::create_dir_all(r.join("run/x")).unwrap();
        std::fs::write(r.join("run/x/f"), "1").unwrap();
        std::os::unix::fs::symlink("../x", r.join("run/l")).unwrap();
        let before = Tree::read(r);
        assert!(before.diff(&Tree::read(r)).is_empty());
        std::fs::write(r.join("run/x/f"), "2").unwrap();
        std::fs::write(r.join("run/new"), "").unwrap();
        std::fs::remove_file(r.join("run/l")).unwrap();
        std::os::unix::fs::symlink("../y", r.join("run/l")).unwrap();
        let d = before.diff(&Tree::read(r));
        assert_eq!(
            d,
            vec![
                "changed run/l: -> ../x -> -> ../y",
                "changed run/x/f: \"1\" -> \"2\"",
                "added run/new: \"\"",
            ]
        );
    }
}
