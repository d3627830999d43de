//! The notifier thread: turns the engine's invalidations into kernel notifications.
//!
//! Owns the only place the mount calls into the kernel unprompted. The engine's
//! [`crate::Invalidator::invalidate`] only queues a path (it never blocks and never makes a
//! syscall on the caller's thread); this thread then, for the deepest name of the path the
//! kernel knows, sends `inval_inode` for the node (attributes and pages) and — unless the
//! name still leads to that same inode — `inval_entry` on its parent (the dentry) and
//! `inval_inode` of the parent: its attributes and the pages of its cached listing
//! (`FOPEN_CACHE_DIR`; the kernel drops the listing by itself only when the dentry was in
//! its cache, and a name the kernel never looked up is exactly what a remote creation adds).
//!
//! **Why a thread of its own:** an `inval_entry` takes the parent directory's lock in the
//! kernel, which a request in flight in that directory may hold while it waits for a FUSE
//! worker; sent from a worker (or from an engine thread a worker waits on) it could
//! deadlock. Here it only waits for that request to finish. No lock of ours is held while
//! the kernel is called.

use crate::backing::{Inval, Shared};
use crate::{lock, sys};
use fuser::{INodeNo, Notifier};
use meshfs_protocol::RelPath;
use std::ffi::OsStr;
use std::io;
use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tracing::debug;

/// How long a foreign invalidation waits for the mount's own report of the same change.
pub(crate) const FOREIGN_DELAY: Duration = Duration::from_millis(5);

/// Starts the notifier thread; it ends when every sender of `rx` is gone.
pub(crate) fn spawn(
    sh: Arc<Shared>,
    notifier: Notifier,
    rx: Receiver<Inval>,
) -> io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("meshfs-fuse-inval".into())
        .spawn(move || {
            while let Ok(inval) = rx.recv() {
                let echo = inval.foreign_at.is_some_and(|at| {
                    let due = at + FOREIGN_DELAY;
                    let now = Instant::now();
                    if due > now {
                        std::thread::sleep(due - now);
                    }
                    lock(&sh.recent).was_told(&inval.path, Instant::now())
                });
                if !echo {
                    if inval.foreign_at.is_some() {
                        debug!(path = %inval.path, "a change made behind the mount");
                    }
                    invalidate(&sh, &notifier, &inval.path);
                }
                sh.invalidations_pending.fetch_sub(1, Ordering::SeqCst);
            }
        })
}

fn invalidate(sh: &Shared, notifier: &Notifier, path: &RelPath) {
    let target = {
        let t = lock(&sh.table);
        t.walk(path.components())
            .map(|(parent, name, node)| (parent, name.to_owned(), node))
    };
    let Some((parent, name, node)) = target else {
        return;
    };
    if let Some(ino) = node {
        let same = still_named(sh, parent, &name, ino);
        if !same {
            // A directory the engine replaced or moved must be resolved by its path again.
            sh.dirs.remove(ino);
        }
        // Offset 0, length 0: attributes and every cached page.
        sh.kept.forget(ino);
        if let Err(e) = notifier.inval_inode(INodeNo(ino), 0, 0) {
            debug!(%path, error = %e, "inval_inode");
        }
        if same {
            // The name still leads to the same inode (metadata changed, or a directory made
            // again over itself): the entry is right. Invalidating it would unhash a
            // directory in use, and every process working inside it would get ENOENT from
            // getcwd (git in a mounted repository did).
            return;
        }
    }
    if let Err(e) = notifier.inval_entry(INodeNo(parent), OsStr::new(&name)) {
        debug!(%path, error = %e, "inval_entry");
    }
    // The parent's entries changed: its cached listing and mtime are stale.
    if let Err(e) = notifier.inval_inode(INodeNo(parent), 0, 0) {
        debug!(%path, error = %e, "inval_inode of the parent");
    }
}

/// Whether `name` in `parent` still leads, on the backing directory, to node `ino`.
fn still_named(sh: &Shared, parent: u64, name: &str, ino: u64) -> bool {
    let Ok(dir) = sh.dir(parent) else {
        return false;
    };
    let Ok(cname) = sys::cstr(OsStr::new(name)) else {
        return false;
    };
    match sys::openat(dir.as_fd(), &cname, libc::O_PATH | libc::O_NOFOLLOW, 0) {
        Ok(fd) => sys::fstat(fd.as_fd()).is_ok_and(|st| sh.nodeid(st.ino) == ino),
        Err(_) => false,
    }
}
