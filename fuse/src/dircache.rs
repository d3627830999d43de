//! A small, bounded cache of O_PATH descriptors of directories the kernel knows.
//!
//! Owns nothing but the descriptors: saves the path walk (`openat2` of the directory's path)
//! that every operation naming a child (lookup, getattr, create, unlink…) would otherwise
//! start with. A descriptor stays valid across renames of its directory (it names the inode,
//! not the path), so only a directory's removal, replacement or forgetting drops it.
//!
//! **Invariant:** at most `capacity` descriptors, whatever the size of the tree (the fd
//! budget of the process is 20,000 and shared with the engine).

use crate::lock;
use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};

/// See the module documentation.
#[derive(Debug)]
pub(crate) struct DirCache {
    capacity: usize,
    map: Mutex<HashMap<u64, Arc<OwnedFd>>>,
}

impl DirCache {
    /// An empty cache of at most `capacity` descriptors.
    pub fn new(capacity: usize) -> DirCache {
        DirCache {
            capacity,
            map: Mutex::new(HashMap::new()),
        }
    }

    /// The descriptor of directory node `ino`, if cached.
    pub fn get(&self, ino: u64) -> Option<Arc<OwnedFd>> {
        lock(&self.map).get(&ino).cloned()
    }

    /// Caches `fd` for `ino`, evicting an arbitrary entry when full (a user of an evicted
    /// descriptor keeps its `Arc`).
    pub fn insert(&self, ino: u64, fd: Arc<OwnedFd>) {
        if self.capacity == 0 {
            return;
        }
        let mut map = lock(&self.map);
        if map.len() >= self.capacity && !map.contains_key(&ino) {
            if let Some(&victim) = map.keys().next() {
                map.remove(&victim);
            }
        }
        map.insert(ino, fd);
    }

    /// Drops `ino`'s descriptor (removed, replaced or forgotten).
    pub fn remove(&self, ino: u64) {
        lock(&self.map).remove(&ino);
    }

    /// How many descriptors are cached.
    pub fn len(&self) -> usize {
        lock(&self.map).len()
    }
}
