//! Which files the kernel may keep its cached pages of across opens (`FOPEN_KEEP_CACHE`).
//!
//! Without it the kernel drops a FUSE file's pages at every open, so a file read twice is
//! read through the mount twice: on a forwarded mount (no kernel passthrough, as for a daemon
//! run as an ordinary user) a warm `cat` then costs a request per 128 KiB instead of a copy from
//! memory. With it, pages survive an open only where they are still the file's content.
//!
//! **What it owns.** For each node a regular file was opened through, the backing file's
//! content signature (size, mtime, ctime) as of the last time the mount knew the kernel's
//! pages to be right: the open that read it, or the release of a handle that wrote it through
//! the mount (the kernel's pages hold what was written; the mount keeps no writeback cache).
//! An open whose signature is the one recorded keeps the pages; any other drops them, as
//! before.
//!
//! **What it never does.** It never tells the kernel anything itself: the open's reply carries
//! its verdict, and the engine's invalidations (`invalidate.rs`) drop the pages of what it
//! changed, and the record here with them.
//!
//! A change behind the mount's back changes ctime (and, on the filesystems meshfs runs on,
//! fine-grained where it was just read), so it is seen at the next open even if the watcher
//! missed it; the watcher's report of it also drops the pages at once (D34).

use crate::lock;
use crate::sys::Stat;
use std::collections::HashMap;
use std::sync::Mutex;

/// What changes whenever a file's content can have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ContentSig {
    size: u64,
    mtime: (i64, u32),
    ctime: (i64, u32),
}

impl ContentSig {
    /// The signature of `st`.
    pub fn of(st: &Stat) -> ContentSig {
        ContentSig {
            size: st.size,
            mtime: (st.mtime.sec, st.mtime.nsec),
            ctime: (st.ctime.sec, st.ctime.nsec),
        }
    }
}

/// The recorded signatures, by node id.
#[derive(Debug, Default)]
pub(crate) struct Kept {
    sigs: Mutex<HashMap<u64, ContentSig>>,
}

impl Kept {
    /// A file is opened and is `sig` now: whether the kernel may keep the pages it has of
    /// node `ino` (the file is as it was when they were last right). Records `sig`.
    pub fn open(&self, ino: u64, sig: ContentSig) -> bool {
        lock(&self.sigs).insert(ino, sig) == Some(sig)
    }

    /// A handle that wrote `ino` through the mount is released, the file now `sig`: the
    /// kernel's pages are its content.
    pub fn wrote(&self, ino: u64, sig: ContentSig) {
        lock(&self.sigs).insert(ino, sig);
    }

    /// The pages of `ino` are dropped (an invalidation) or the kernel let go of the node.
    pub fn forget(&self, ino: u64) {
        lock(&self.sigs).remove(&ino);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sig(size: u64, ctime: i64) -> ContentSig {
        ContentSig {
            size,
            mtime: (1, 0),
            ctime: (ctime, 0),
        }
    }

    #[test]
    fn pages_are_kept_only_for_a_file_unchanged_since_they_were_known_right() {
        let k = Kept::default();
        assert!(!k.open(5, sig(10, 1)), "the first open has nothing to keep");
        assert!(k.open(5, sig(10, 1)));
        assert!(!k.open(5, sig(10, 2)), "changed behind the mount: ctime");
        assert!(k.open(5, sig(10, 2)));
        k.wrote(5, sig(20, 3));
        assert!(
            k.open(5, sig(20, 3)),
            "written through the mount: the pages are right"
        );
        k.forget(5);
        assert!(!k.open(5, sig(20, 3)), "invalidated");
        assert!(!k.open(6, sig(20, 3)), "another node");
    }
}
