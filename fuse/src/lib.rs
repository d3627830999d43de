//! # meshfs-fuse: the meeting point of a FUSE mount and the engine
//!
//! The mount itself arrives in the next stage; this crate already fixes the small interface
//! through which it will plug into the engine (DESIGN §2, §4, §9), so the engine is built
//! against it from the start:
//!
//! - **events in:** every mutating operation the mount sees becomes a [`ChangeEvent`] sent to
//!   the engine's capture path (the same path inotify events take), so a change made through
//!   the mount needs no rescan;
//! - **invalidations out:** when the engine applies a remote change it calls an
//!   [`Invalidator`], so readers in the mount see the new version at once;
//! - **no replace under an open writer:** the mount answers [`WriterRegistry::has_writer`],
//!   and the engine defers an apply to a path that is open for writing until its release.
//!
//! **Architecture invariant:** this crate never touches SQLite or the network; it only knows
//! the vocabulary crate.
#![deny(missing_docs)]

use meshfs_protocol::RelPath;

/// What the mount saw happen to a path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChangeKind {
    /// A file opened for writing was released or fsynced: its content may have changed.
    Written,
    /// Created (file, directory, symlink or hard link).
    Created,
    /// Removed (unlink or rmdir).
    Removed,
    /// Renamed from another path.
    RenamedFrom(RelPath),
    /// Mode, size (truncate) or times changed.
    Metadata,
}

/// One change seen by the mount.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChangeEvent {
    /// The folder-relative path.
    pub path: RelPath,
    /// What happened.
    pub kind: ChangeKind,
}

/// Invalidates the kernel's caches for a path after the engine changed it.
pub trait Invalidator: Send + Sync {
    /// The entry, attributes and cached pages of `path` are stale.
    fn invalidate(&self, path: &RelPath);
}

/// Tells the engine which paths are open for writing through the mount.
pub trait WriterRegistry: Send + Sync {
    /// Whether a handle that may write `path` is open.
    fn has_writer(&self, path: &RelPath) -> bool;
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
