//! # meshfs-fuse: the mount of a replicated folder
//!
//! A FUSE filesystem that shows a folder's replica directory exactly as it is (docs/design.md, "The mount"),
//! plus the small interface through which it plugs into the engine (docs/design.md, "Capture" and "The mount"):
//!
//! - **the mount:** [`mount`] serves a backing directory at a mount point with multi-threaded
//!   request handling, long kernel entry/attribute caching, readdirplus, directory listings
//!   kept by the kernel across opens (no directory handles: OPENDIR is answered `ENOSYS`,
//!   which makes the kernel cache listings and stop sending OPENDIR), and kernel
//!   passthrough of reads and writes where the kernel allows it (Linux ≥ 6.9, root), with
//!   ordinary forwarding as the fallback. [`Mount`] unmounts on [`Mount::unmount`] or drop;
//!   a dead mount point ("transport endpoint is not connected", left by a killed daemon) is
//!   detached and reused.
//! - **events in:** every mutating operation that succeeded on the backing directory
//!   becomes a [`ChangeEvent`] given to the engine's [`ChangeSink`], so a change made
//!   through the mount needs no rescan. Content changes are reported at the fsync or
//!   release of a handle that wrote ([`ChangeKind::Written`]), and the release of the last
//!   writer of a path is reported as [`ChangeKind::Closed`].
//! - **invalidations out:** when the engine applies a remote change it calls
//!   [`Invalidator::invalidate`]; the mount queues it to its notifier thread, which drops
//!   the kernel's cached entry, attributes and pages for that path. What the engine's watcher
//!   sees change on the backing directory comes through [`Invalidator::invalidate_foreign`],
//!   which drops the echoes of the mount's own changes and invalidates the rest, so the
//!   kernel may keep entries and attributes for a minute (D34).
//! - **no replace under an open writer:** [`WriterRegistry::has_writer`] tells the engine
//!   a path is open for writing, so it defers an apply until the `Closed` event
//!   ([`WriterRegistry::holds_inode`]: a backing file open at all, which on-demand eviction
//!   respects).
//! - **content on demand:** in a folder that is on demand, a file whose content is not here is
//!   a *placeholder* (true size, mode and mtime, no data, the [`PLACEHOLDER_XATTR`] attribute,
//!   docs/decisions.md D90). An open of one asks the engine's [`ContentSource`] to make it
//!   local first (D92), or, for reading, gives it a stream whose reads wait for their own
//!   verified bytes (D95); `user.meshfs.state` ([`STATE_XATTR`]) is answered from it (D94), and
//!   meshfs's own attributes are hidden.
//!
//! ## What it owns and what it never does
//!
//! It owns the FUSE session, the inode table (FUSE node ↔ backing path) and the open
//! handles. It **never** touches SQLite, the network or an async runtime (its dependencies
//! leave no way to); it never hashes or reads a file on its own behalf, and never blocks a
//! request on the engine: the sink must not block, and invalidations are queued (the one
//! exceptions: an open of a placeholder waits for [`ContentSource::fetch`] or
//! [`ContentSource::open`], a read of one for [`ContentStream::ready`]). The one
//! thing it reads unasked is metadata: after a listing that went to disk, one thread lists
//! the directories it named and `statx`es their entries ahead of the caller (bounded, never
//! for a warm listing; `prefetch`, D33).
//! It never shows, creates, or renames onto meshfs's own names (any path component
//! starting with [`meshfs_protocol::INTERNAL_PREFIX`]: the `.meshfs` state directory and
//! the store's temp files). It never follows a symlink out of the backing directory: every
//! path is resolved beneath an `O_PATH` descriptor of the backing root.
//!
//! **File descriptors are a budget** (the open-file limit is 20,000 and shared with the
//! engine): the mount holds one descriptor per open file, the backing root, at most
//! 1,024 cached directory descriptors and at most 5 more for the read-ahead, whatever the size
//! of the tree. Known inodes cost
//! memory (a table entry), not descriptors.
//!
//! ## Decisions worth knowing
//!
//! - **Node ids are backing inode numbers** (root and inode 1 swapped), generations are
//!   birth times: `st_ino` through the mount is the backing's, and a reused inode number
//!   reaches the kernel as a new inode.
//! - **Permissions:** without `allow_other` only the mounting user gets in and the backing
//!   checks its accesses; with it, the kernel checks modes (`default_permissions`), what
//!   other users create is given to them (when the mount runs as root), and set-id bits
//!   are cleared on their writes and truncates (`FUSE_HANDLE_KILLPRIV_V2`, which also spares every `write(2)` a
//!   `security.capability` lookup).
//! - **No directory handles:** OPENDIR is answered `ENOSYS`, so the kernel keeps each
//!   directory's listing across opens (until a change through the mount, a changed mtime seen
//!   after the TTL, or an engine invalidation of a child drops it) and an open costs no round
//!   trip; READDIR and FSYNCDIR open the directory for the request alone.
//! - **Locks** (POSIX and BSD) are the kernel's local ones: they work between processes of
//!   this machine, which is all a replica directory can offer.
//! - **Forwarded files** (no passthrough): the kernel keeps a file's cached pages across opens
//!   while its backing size and times are unchanged (`kept`, D48); a write-only open writes
//!   past the page cache (`FOPEN_DIRECT_IO`, D49).
//! - **Not used:** the writeback cache (a write must reach the backing before the engine
//!   hears of it, and the kernel would ignore the sizes the mount reports, D49), `FUSE_ATOMIC_O_TRUNC` (it let an `O_TRUNC` open reach the backing before
//!   the kernel's `ETXTBSY` check), `FLUSH` (answered `ENOSYS` once, so `close(2)` costs no
//!   round trip: nothing is buffered here).
#![deny(missing_docs)]

mod backing;
mod dircache;
mod fs;
mod handles;
mod inodes;
mod invalidate;
mod kept;
mod mount;
mod passthrough;
mod placeholder;
mod prefetch;
mod recent;
mod snapshot;
mod sys;
mod unmount;

pub use mount::{
    fuse_conf_allows_other, mount, Mount, MountError, MountHandle, MountInfo, MountOptions,
    FUSE_CONF,
};
pub use passthrough::PassthroughOff;
pub use snapshot::{mount_snapshot, SnapshotContent, SnapshotEntry, SnapshotKind, SnapshotMount};

use meshfs_protocol::RelPath;
use std::sync::{Mutex, MutexGuard};

/// What the mount saw happen to a path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChangeKind {
    /// A handle that wrote (or, with kernel passthrough, that could write) was fsynced or
    /// released: the content may have changed.
    Written,
    /// Created (file, directory, symlink, device node, fifo or hard link).
    Created,
    /// Removed (unlink or rmdir).
    Removed,
    /// Renamed from another path (a `RENAME_EXCHANGE` is two of these).
    RenamedFrom(RelPath),
    /// Mode, owner, size (truncate), times or extended attributes changed.
    Metadata,
    /// The last handle open for writing on this path was released (after its `Written`):
    /// the content is final for now, and an apply the engine deferred because of
    /// [`WriterRegistry::has_writer`] may proceed.
    Closed,
}

/// One change seen by the mount.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChangeEvent {
    /// The folder-relative path.
    pub path: RelPath,
    /// What happened.
    pub kind: ChangeKind,
}

/// Where the mount reports changes: the engine's capture path.
///
/// Called on a FUSE request thread, after the operation succeeded and (mostly) after the
/// kernel got its answer. **Must not block** and must not call back into the mount (a
/// channel send is the expected implementation).
pub trait ChangeSink: Send + Sync {
    /// `ev` happened.
    fn changed(&self, ev: ChangeEvent);
}

impl<F: Fn(ChangeEvent) + Send + Sync> ChangeSink for F {
    fn changed(&self, ev: ChangeEvent) {
        self(ev)
    }
}

impl ChangeSink for std::sync::mpsc::Sender<ChangeEvent> {
    fn changed(&self, ev: ChangeEvent) {
        // A receiver that went away no longer wants events.
        let _ = self.send(ev);
    }
}

/// Invalidates the kernel's caches for a path after the engine changed it.
pub trait Invalidator: Send + Sync {
    /// The entry, attributes and cached pages of `path` are stale. Never blocks.
    fn invalidate(&self, path: &RelPath);

    /// `path` changed on the backing directory, seen by the engine's watcher: either an echo
    /// of a change made through the mount (the kernel knows it) or a change made behind the
    /// mount's back (a program writing the replica directory), whose kernel caches are then
    /// stale. Invalidates in the second case, and says which it was (true: behind the mount's
    /// back). Never blocks. By default the same as [`Invalidator::invalidate`], and foreign.
    fn invalidate_foreign(&self, path: &RelPath) -> bool {
        self.invalidate(path);
        true
    }
}

/// Tells the engine which paths are open for writing through the mount.
pub trait WriterRegistry: Send + Sync {
    /// Whether a handle that may write `path` is open.
    fn has_writer(&self, path: &RelPath) -> bool;

    /// Whether a file open through the mount holds the backing inode `inode` (reading or
    /// writing): what on-demand eviction never replaces. By default: nothing is.
    fn holds_inode(&self, _inode: u64) -> bool {
        false
    }
}

/// The extended attribute that marks a placeholder: a regular file of an on-demand folder
/// whose content is not here (docs/decisions.md, D90). Its value is the 32-byte content hash of
/// the version it stands for. Never visible through the mount.
pub const PLACEHOLDER_XATTR: &str = "user.meshfs.placeholder";
/// The extended attribute the mount answers for a regular file with its on-demand state:
/// `local`, `online`, `pinned` or `fetching` (D94).
pub const STATE_XATTR: &str = "user.meshfs.state";
/// meshfs's own extended attributes (the placeholder mark, the store's mark of a file kept
/// aside): none can be read, set or removed through the mount, but [`STATE_XATTR`].
pub const OWN_XATTR_PREFIX: &str = "user.meshfs.";

/// Where the content of placeholders comes from: the engine (docs/decisions.md, D92).
///
/// Called on FUSE request threads. [`ContentSource::fetch`] may take as long as a fetch from a
/// peer takes, but must not call back into the mount; the others must not block.
pub trait ContentSource: Send + Sync + std::fmt::Debug {
    /// Makes the content of `path`, a placeholder, local: returns once the backing file at
    /// `path` holds it (a new inode), or with the errno the caller's request fails with.
    /// `pid`: the process that asked (shown by `status`).
    fn fetch(&self, path: &RelPath, pid: u32) -> Result<(), i32>;
    /// Opens the placeholder `path` for reading (D95): returns once its first chunk is verified
    /// (or the errno the open fails with), with the stream its reads wait on, or
    /// [`Opened::Local`] when the file at `path` turned out to be local (it is opened by name).
    fn open(&self, path: &RelPath, pid: u32) -> Result<Opened, i32>;
    /// The regular file `path` was opened through the mount (what was used least recently is
    /// evicted first).
    fn used(&self, path: &RelPath);
    /// What [`STATE_XATTR`] says of the regular file `path`; `local`: the backing holds its
    /// content (it is no placeholder).
    fn state(&self, path: &RelPath, local: bool) -> &'static str;
    /// Whether the folder is on demand now: new placeholders may appear under any name (a
    /// create checks the name it opens). An open checks its file whatever this says.
    fn active(&self) -> bool;
}

/// What [`ContentSource::open`] gives.
#[derive(Debug)]
pub enum Opened {
    /// The file at the path is local now: open it by name.
    Local,
    /// Its content is being assembled: every read waits on this stream.
    Stream(Box<dyn ContentStream>),
}

/// A file being assembled for one open (D95). Dropped when the open is released: the engine
/// stops fetching a file no open reads (unless it is whole by then).
pub trait ContentStream: Send + Sync + std::fmt::Debug {
    /// The file being assembled: the same inode before and after it is installed. Only the
    /// ranges [`ContentStream::ready`] allowed are read from it (the rest may be holes).
    fn file(&self) -> std::os::fd::BorrowedFd<'_>;
    /// The file's size.
    fn size(&self) -> u64;
    /// Waits until every byte of `[offset, offset + len)` (clamped to the size) is verified
    /// in [`ContentStream::file`]; else the errno the read fails with.
    fn ready(&self, offset: u64, len: u64) -> Result<(), i32>;
}

/// The registry of a folder with no mount: nothing is ever open through it.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoMount;

impl Invalidator for NoMount {
    fn invalidate(&self, _path: &RelPath) {}
}

impl WriterRegistry for NoMount {
    fn has_writer(&self, _path: &RelPath) -> bool {
        false
    }
}

/// Whether `name` is one of meshfs's own (state dir, store temp files).
pub(crate) fn is_internal(name: &std::ffi::OsStr) -> bool {
    use std::os::unix::ffi::OsStrExt;
    name.as_bytes()
        .starts_with(meshfs_protocol::INTERNAL_PREFIX.as_bytes())
}

/// Locks `m`, through poisoning: every critical section in this crate is panic-free
/// bookkeeping, so a poisoned lock still guards consistent data.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
