//! The mount: a folder served through FUSE by this daemon (`meshfs-fuse`), plugged into the
//! folder's two engine edges (docs/design.md, "Capture" and "The mount"):
//!
//! - **events in:** [`CaptureSink`] turns the mount's change events into the same capture
//!   messages the watcher sends, on the folder's capture channel. A send never blocks, so no
//!   FUSE request thread waits for hashing or the journal; the capture loop coalesces and
//!   scans exactly the paths named (a rename names both ends, so the scan journals it as a
//!   rename). Capture is idempotent: the same change seen by the mount and the watcher is
//!   one version.
//! - **invalidations out, open writers:** [`MountSlot`] is the folder's `Invalidator` and
//!   `WriterRegistry` for its whole life; it forwards to the mount while one is up and is
//!   inert otherwise, so apply never needs to know whether the folder is mounted.
//!
//! **Who writes a replica.** The store alone applies *remote* changes to the replica
//! directory; the mount writes only what the local user writes, through the user's own
//! handles, and every such write is reported here as a local change.
//!
//! It never touches SQLite or the network, and never calls into the kernel on the caller's
//! thread (the mount queues invalidations to its notifier thread).

use crate::capture::{CaptureMsg, Hint};
use meshfs_fuse::{
    ChangeEvent, ChangeKind, ChangeSink, Invalidator, MountHandle, MountInfo, WriterRegistry,
};
use meshfs_protocol::RelPath;
use std::path::PathBuf;

/// Whether `/etc/fuse.conf` lets ordinary users mount with `allow_other` (checked by
/// `meshfs config check`, as the mount itself does).
pub use meshfs_fuse::{fuse_conf_allows_other, FUSE_CONF};
use std::sync::{Arc, RwLock};
use tokio::sync::mpsc;

/// A folder's link to its mount, if any.
#[derive(Default)]
pub struct MountSlot {
    handle: RwLock<Option<Arc<MountHandle>>>,
}

impl MountSlot {
    /// The mount is up: forward to `handle`.
    pub fn attach(&self, handle: Arc<MountHandle>) {
        if let Ok(mut h) = self.handle.write() {
            *h = Some(handle);
        }
    }

    /// The mount is gone.
    pub fn detach(&self) {
        if let Ok(mut h) = self.handle.write() {
            *h = None;
        }
    }

    fn current(&self) -> Option<Arc<MountHandle>> {
        self.handle.read().ok().and_then(|h| h.clone())
    }
}

impl Invalidator for MountSlot {
    fn invalidate(&self, path: &RelPath) {
        if let Some(h) = self.current() {
            h.invalidate(path);
        }
    }

    fn invalidate_foreign(&self, path: &RelPath) -> bool {
        match self.current() {
            Some(h) => h.invalidate_foreign(path),
            None => true,
        }
    }
}

impl WriterRegistry for MountSlot {
    fn has_writer(&self, path: &RelPath) -> bool {
        self.current().is_some_and(|h| h.has_writer(path))
    }

    fn holds_inode(&self, inode: u64) -> bool {
        self.current().is_some_and(|h| h.holds_inode(inode))
    }
}

/// Feeds a mount's change events into a folder's capture loop.
pub struct CaptureSink {
    tx: mpsc::UnboundedSender<CaptureMsg>,
}

impl CaptureSink {
    /// A sink sending to `tx` (the folder's capture channel).
    pub fn new(tx: mpsc::UnboundedSender<CaptureMsg>) -> CaptureSink {
        CaptureSink { tx }
    }
}

/// The capture messages of one mount event.
pub fn capture_messages(ev: ChangeEvent) -> Vec<CaptureMsg> {
    let hint = match ev.kind {
        // A handle that wrote was flushed or fsynced; the last writer's release follows.
        ChangeKind::Written => Hint::Written,
        ChangeKind::Closed => {
            return vec![
                CaptureMsg::Changed(ev.path.clone(), Hint::Closed),
                CaptureMsg::Released(ev.path),
            ]
        }
        ChangeKind::Created | ChangeKind::Removed | ChangeKind::Metadata => Hint::Other,
        ChangeKind::RenamedFrom(from) => {
            // Both ends in the same capture scan: the scanner pairs them as one rename.
            return vec![CaptureMsg::Renamed(from, ev.path)];
        }
    };
    vec![CaptureMsg::Changed(ev.path, hint)]
}

impl ChangeSink for CaptureSink {
    fn changed(&self, ev: ChangeEvent) {
        for m in capture_messages(ev) {
            // A closed channel means the folder is stopping; nothing is left to capture.
            let _ = self.tx.send(m);
        }
    }
}

/// What `status` shows of a mount.
#[derive(Clone, Debug, serde::Serialize)]
pub struct MountStatus {
    /// Where the user works.
    pub mountpoint: PathBuf,
    /// `"read-only"` or `"read-write"`.
    pub mode: &'static str,
    /// Other users may enter (`allow_other`; the kernel checks modes).
    pub allow_other: bool,
    /// Whether the kernel passes reads and writes straight to the backing files.
    pub passthrough: bool,
    /// Why not, when it does not.
    pub passthrough_off: Option<PassthroughOffStatus>,
    /// Whether requests come over io_uring, answered on the caller's CPU
    /// (`meshfs_fuse::MountOptions::io_uring`).
    pub io_uring: bool,
    /// Handles open through the mount.
    pub open_handles: usize,
    /// Invalidations of what the kernel caches, queued and not yet sent (a folder is not in
    /// sync until they are: the mount could still show a path's previous state).
    pub invalidations_pending: usize,
}

/// Why kernel passthrough is off on a mount ([`meshfs_fuse::PassthroughOff`]).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct PassthroughOffStatus {
    /// A stable name: `not_asked`, `not_offered`, `needs_cap_sys_admin`, `stacked`, `refused`.
    pub code: &'static str,
    /// The reason in words.
    pub why: String,
}

impl From<MountInfo> for MountStatus {
    fn from(i: MountInfo) -> MountStatus {
        MountStatus {
            mountpoint: i.mountpoint,
            mode: if i.read_only {
                "read-only"
            } else {
                "read-write"
            },
            allow_other: i.allow_other,
            passthrough: i.passthrough,
            passthrough_off: i.passthrough_off.map(|why| PassthroughOffStatus {
                code: why.code(),
                why: why.to_string(),
            }),
            io_uring: i.io_uring,
            open_handles: i.open_handles,
            invalidations_pending: i.invalidations_pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> RelPath {
        RelPath::new(s).unwrap()
    }

    #[test]
    fn a_rename_through_the_mount_names_both_ends_for_one_capture_scan() {
        let msgs = capture_messages(ChangeEvent {
            path: p("new"),
            kind: ChangeKind::RenamedFrom(p("old")),
        });
        match &msgs[..] {
            [CaptureMsg::Renamed(from, to)] => {
                assert_eq!((from.as_str(), to.as_str()), ("old", "new"))
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_write_waits_for_the_last_writers_release() {
        let w = capture_messages(ChangeEvent {
            path: p("f"),
            kind: ChangeKind::Written,
        });
        assert!(matches!(w[..], [CaptureMsg::Changed(_, Hint::Written)]));
        let c = capture_messages(ChangeEvent {
            path: p("f"),
            kind: ChangeKind::Closed,
        });
        assert!(matches!(
            c[..],
            [
                CaptureMsg::Changed(_, Hint::Closed),
                CaptureMsg::Released(_)
            ]
        ));
    }

    #[test]
    fn an_empty_slot_has_no_writers_and_invalidates_nothing() {
        let s = MountSlot::default();
        assert!(!s.has_writer(&p("x")));
        s.invalidate(&p("x"));
    }
}
