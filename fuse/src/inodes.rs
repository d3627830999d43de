//! The inode table: which FUSE node ids the kernel holds, and under which names.
//!
//! Owns the mapping the kernel's dentry cache mirrors: node id → (kind, generation, lookup
//! count, names), and (parent, name) → node id. Pure memory: no syscalls, no descriptors.
//! The passthrough resolves a node to a backing path through it, so it holds **no file
//! descriptor per known inode** (libfuse's passthrough_hp keeps an O_PATH fd per inode and
//! runs out of descriptors on an 8,000-file `git clone`).
//!
//! Node ids are the backing inode numbers (the kernel shows them as `st_ino`, so `ls -i`,
//! tar and git see the backing's), with the backing root and inode 1 swapped, because FUSE
//! calls the root 1. The generation is the backing birth time, so an inode number that ext4
//! reused for a new file reaches the kernel as a new inode.
//!
//! **Invariants:** a node lives while the kernel holds lookups on it (the root always);
//! every (parent, name) in `children` is in that child's `names` and vice versa; a node's
//! primary name (the last of `names`) is the one its path is built from. A node with no
//! names is orphaned (unlinked or replaced): it is reached only through open handles.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;

/// The FUSE root node id.
pub(crate) const ROOT: u64 = 1;

/// The deepest path the table builds (guards against a corrupted parent chain).
const MAX_DEPTH: usize = 4096;

/// One node the kernel knows.
#[derive(Debug)]
pub(crate) struct Node {
    /// `S_IFMT` bits.
    pub kind: u32,
    /// The generation the kernel was told.
    pub generation: u64,
    /// Lookups the kernel holds (sum over every kernel inode that had this id).
    lookups: u64,
    /// (parent, name) pairs, primary last.
    names: Vec<(u64, OsString)>,
}

/// What [`Table::remember`] found.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Remembered {
    /// The same inode as before (or a first lookup).
    Same,
    /// The id now names a different inode (kind or generation changed).
    Replaced,
}

/// The inode table. See the module documentation.
#[derive(Debug)]
pub(crate) struct Table {
    nodes: HashMap<u64, Node>,
    children: HashMap<u64, HashMap<OsString, u64>>,
    /// Bumped by every rename and removal, so a path resolution that raced one can retry.
    epoch: u64,
}

impl Table {
    /// A table holding only the root.
    pub fn new() -> Table {
        let mut nodes = HashMap::new();
        nodes.insert(
            ROOT,
            Node {
                kind: libc::S_IFDIR,
                generation: 0,
                lookups: 1,
                names: Vec::new(),
            },
        );
        Table {
            nodes,
            children: HashMap::new(),
            epoch: 0,
        }
    }

    /// The rename/removal counter.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The node `ino`, if the kernel holds it.
    pub fn get(&self, ino: u64) -> Option<&Node> {
        self.nodes.get(&ino)
    }

    /// How many nodes the kernel holds (the root included).
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// The kernel got one more lookup of `ino` as `parent/name` (lookup, create, mkdir,
    /// link, a readdirplus entry).
    pub fn remember(
        &mut self,
        parent: u64,
        name: &OsStr,
        ino: u64,
        kind: u32,
        generation: u64,
    ) -> Remembered {
        debug_assert_ne!(ino, ROOT, "the root is never looked up by name");
        let mut outcome = Remembered::Same;
        let node = self.nodes.entry(ino).or_insert_with(|| Node {
            kind,
            generation,
            lookups: 0,
            names: Vec::new(),
        });
        if node.kind != kind || node.generation != generation {
            // ext4 reused the number (or the kernel's inode is stale): the old names belong
            // to the old inode.
            node.kind = kind;
            node.generation = generation;
            outcome = Remembered::Replaced;
        }
        node.lookups += 1;
        let stale_names = if outcome == Remembered::Replaced {
            std::mem::take(&mut node.names)
        } else {
            Vec::new()
        };
        for (p, n) in stale_names {
            self.drop_dentry(p, &n, ino);
        }
        self.link_name(parent, name, ino);
        outcome
    }

    /// Records `parent/name` → `ino` as the node's primary name, taking the name from
    /// whichever node had it.
    fn link_name(&mut self, parent: u64, name: &OsStr, ino: u64) {
        let dir = self.children.entry(parent).or_default();
        let previous = match dir.get_mut(name) {
            Some(slot) => Some(std::mem::replace(slot, ino)),
            None => {
                dir.insert(name.to_os_string(), ino);
                None
            }
        };
        if let Some(prev) = previous.filter(|&p| p != ino) {
            if let Some(old) = self.nodes.get_mut(&prev) {
                old.names.retain(|(p, n)| !(*p == parent && n == name));
            }
        }
        if let Some(node) = self.nodes.get_mut(&ino) {
            if let Some(i) = node
                .names
                .iter()
                .position(|(p, n)| *p == parent && n == name)
            {
                let entry = node.names.remove(i);
                node.names.push(entry);
            } else {
                node.names.push((parent, name.to_os_string()));
            }
        }
    }

    /// Removes `parent/name` from `children` if it points at `ino`.
    fn drop_dentry(&mut self, parent: u64, name: &OsStr, ino: u64) {
        if let Some(dir) = self.children.get_mut(&parent) {
            if dir.get(name) == Some(&ino) {
                dir.remove(name);
                if dir.is_empty() {
                    self.children.remove(&parent);
                }
            }
        }
    }

    /// The kernel dropped `n` lookups of `ino`. Returns true if the node is gone.
    pub fn forget(&mut self, ino: u64, n: u64) -> bool {
        if ino == ROOT {
            return false;
        }
        let Some(node) = self.nodes.get_mut(&ino) else {
            return false;
        };
        node.lookups = node.lookups.saturating_sub(n);
        if node.lookups > 0 {
            return false;
        }
        let names = std::mem::take(&mut node.names);
        self.nodes.remove(&ino);
        for (p, n) in names {
            self.drop_dentry(p, &n, ino);
        }
        true
    }

    /// `parent/name` was removed (unlink, rmdir): whichever node had the name loses it.
    /// Returns that node.
    pub fn unlinked(&mut self, parent: u64, name: &OsStr) -> Option<u64> {
        self.epoch += 1;
        let ino = self.children.get_mut(&parent)?.remove(name)?;
        if self.children.get(&parent).is_some_and(HashMap::is_empty) {
            self.children.remove(&parent);
        }
        if let Some(node) = self.nodes.get_mut(&ino) {
            node.names.retain(|(p, n)| !(*p == parent && n == name));
        }
        Some(ino)
    }

    /// `from_parent/from` was renamed to `to_parent/to`. Returns the node it replaced.
    pub fn renamed(
        &mut self,
        from_parent: u64,
        from: &OsStr,
        to_parent: u64,
        to: &OsStr,
    ) -> Option<u64> {
        self.epoch += 1;
        let moved = self.unlinked(from_parent, from);
        let replaced = self.unlinked(to_parent, to);
        if let Some(ino) = moved {
            self.link_name(to_parent, to, ino);
        }
        replaced.filter(|&r| Some(r) != moved)
    }

    /// `a_parent/a` and `b_parent/b` were exchanged (RENAME_EXCHANGE).
    pub fn exchanged(&mut self, a_parent: u64, a: &OsStr, b_parent: u64, b: &OsStr) {
        self.epoch += 1;
        let at_a = self.unlinked(a_parent, a);
        let at_b = self.unlinked(b_parent, b);
        if let Some(ino) = at_a {
            self.link_name(b_parent, b, ino);
        }
        if let Some(ino) = at_b {
            self.link_name(a_parent, a, ino);
        }
    }

    /// The node the kernel knows as `parent/name`.
    pub fn child(&self, parent: u64, name: &OsStr) -> Option<u64> {
        self.children.get(&parent)?.get(name).copied()
    }

    /// The primary (parent, name) of `ino`; `None` for the root or an orphan.
    pub fn primary(&self, ino: u64) -> Option<(u64, &OsStr)> {
        let node = self.nodes.get(&ino)?;
        node.names.last().map(|(p, n)| (*p, n.as_os_str()))
    }

    /// The backing-relative path of `ino` (`/`-separated, no leading `/`; empty for the
    /// root), or `None` if it or an ancestor is orphaned.
    pub fn path(&self, ino: u64) -> Option<Vec<u8>> {
        let mut parts: Vec<&OsStr> = Vec::new();
        let mut cur = ino;
        while cur != ROOT {
            if parts.len() > MAX_DEPTH {
                return None;
            }
            let (parent, name) = self.primary(cur)?;
            parts.push(name);
            cur = parent;
        }
        let mut out = Vec::with_capacity(parts.iter().map(|p| p.len() + 1).sum());
        for (i, part) in parts.iter().rev().enumerate() {
            if i > 0 {
                out.push(b'/');
            }
            out.extend_from_slice(part.as_bytes());
        }
        Some(out)
    }

    /// The path of `parent/name`.
    pub fn child_path(&self, parent: u64, name: &OsStr) -> Option<Vec<u8>> {
        let mut p = self.path(parent)?;
        if !p.is_empty() {
            p.push(b'/');
        }
        p.extend_from_slice(name.as_bytes());
        Some(p)
    }

    /// Walks `components` from the root through the names the kernel knows. Returns the
    /// deepest known (parent, name, node): the node is `Some` if every component is known.
    /// `None` if not even the first component's parent (the root) could be used (empty).
    pub fn walk<'a>(
        &self,
        components: impl Iterator<Item = &'a str>,
    ) -> Option<(u64, &'a str, Option<u64>)> {
        let mut parent = ROOT;
        let mut last: Option<(u64, &'a str, Option<u64>)> = None;
        for comp in components {
            if let Some((_, _, node)) = last {
                match node {
                    Some(n) => parent = n,
                    None => return last,
                }
            }
            last = Some((parent, comp, self.child(parent, OsStr::new(comp))));
        }
        last
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const F: u32 = libc::S_IFREG;
    const D: u32 = libc::S_IFDIR;

    fn os(s: &str) -> &OsStr {
        OsStr::new(s)
    }

    #[test]
    fn paths_follow_renames_of_ancestors() {
        let mut t = Table::new();
        t.remember(ROOT, os("a"), 10, D, 0);
        t.remember(10, os("b"), 11, D, 0);
        t.remember(11, os("f"), 12, F, 0);
        assert_eq!(t.path(12).unwrap(), b"a/b/f");
        t.renamed(ROOT, os("a"), ROOT, os("z"));
        assert_eq!(t.path(12).unwrap(), b"z/b/f");
        assert_eq!(t.child(ROOT, os("a")), None);
        assert_eq!(t.child(ROOT, os("z")), Some(10));
    }

    #[test]
    fn rename_over_orphans_the_replaced_node() {
        let mut t = Table::new();
        t.remember(ROOT, os("f"), 10, F, 0);
        t.remember(ROOT, os("f.tmp"), 11, F, 0);
        t.renamed(ROOT, os("f.tmp"), ROOT, os("f"));
        assert_eq!(t.path(11).unwrap(), b"f");
        assert_eq!(t.path(10), None, "the replaced file has no name left");
        assert!(t.get(10).is_some(), "but the kernel still holds it");
        assert!(t.forget(10, 1));
        assert!(t.get(10).is_none());
        assert_eq!(t.child(ROOT, os("f")), Some(11));
    }

    #[test]
    fn hard_links_share_a_node_and_survive_the_loss_of_one_name() {
        let mut t = Table::new();
        t.remember(ROOT, os("a"), 10, F, 0);
        t.remember(ROOT, os("b"), 10, F, 0);
        assert_eq!(t.path(10).unwrap(), b"b");
        t.unlinked(ROOT, os("b"));
        assert_eq!(t.path(10).unwrap(), b"a");
        assert!(!t.forget(10, 1));
        assert!(t.forget(10, 1));
    }

    #[test]
    fn a_reused_inode_number_drops_the_old_names() {
        let mut t = Table::new();
        t.remember(ROOT, os("old"), 10, F, 1);
        assert_eq!(t.remember(ROOT, os("new"), 10, D, 2), Remembered::Replaced);
        assert_eq!(t.child(ROOT, os("old")), None);
        assert_eq!(t.path(10).unwrap(), b"new");
        // Both kernel inodes' lookups must be forgotten before the node goes.
        assert!(!t.forget(10, 1));
        assert!(t.forget(10, 1));
    }

    #[test]
    fn exchange_swaps_names() {
        let mut t = Table::new();
        t.remember(ROOT, os("a"), 10, F, 0);
        t.remember(ROOT, os("b"), 11, D, 0);
        t.remember(11, os("x"), 12, F, 0);
        t.exchanged(ROOT, os("a"), ROOT, os("b"));
        assert_eq!(t.path(10).unwrap(), b"b");
        assert_eq!(t.path(12).unwrap(), b"a/x");
    }

    #[test]
    fn walk_stops_at_the_first_unknown_component() {
        let mut t = Table::new();
        t.remember(ROOT, os("a"), 10, D, 0);
        t.remember(10, os("b"), 11, D, 0);
        assert_eq!(t.walk("a/b".split('/')), Some((10, "b", Some(11))));
        assert_eq!(t.walk("a/c/d".split('/')), Some((10, "c", None)));
        assert_eq!(t.walk("x".split('/')), Some((ROOT, "x", None)));
    }

    #[test]
    fn forgetting_a_directory_drops_only_its_own_names() {
        let mut t = Table::new();
        t.remember(ROOT, os("d"), 10, D, 0);
        t.remember(10, os("f"), 11, F, 0);
        assert!(t.forget(10, 1));
        assert_eq!(t.child(ROOT, os("d")), None);
        // The child is orphaned by its parent's absence, not removed.
        assert!(t.get(11).is_some());
        assert_eq!(t.path(11), None);
    }
}
