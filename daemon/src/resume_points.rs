//! A session's resume points: how far this device has applied the peer's index, per folder,
//! written to the journal at most once per [`SAVE_INTERVAL`] (and when the session ends).
//!
//! Every acknowledged batch moves the point, and an empty batch with a higher `up_to` is one
//! the peer sends for nothing: written at once, a peer flooding them made this device write
//! SQLite for each, holding the journal's lock every time. Kept here instead, only the latest
//! point of each folder is written. A point not yet written when the daemon dies costs only a
//! resend: the peer sends again what came after the last point written, and records already
//! applied are equal to the journal's (nothing is done). This device's own progress with the
//! peer (what the peer acknowledged) moves only as fast as this device sends, and is written
//! at once by the session driver.
//!
//! It owns the unwritten points only; what is written, and when the session ends, is the
//! driver's to say.

use crate::folder::Folders;
use meshfs_protocol::{DeviceId, FolderId};
use std::collections::BTreeMap;
use std::time::Duration;
use tokio::time::Instant;

/// The least time between two writes of a session's resume points.
pub const SAVE_INTERVAL: Duration = Duration::from_secs(1);

/// The points of one session not written yet.
pub struct ResumePoints {
    peer: DeviceId,
    /// Per folder: the peer's index epoch and the highest of its sequences applied here.
    unsaved: BTreeMap<FolderId, (u64, u64)>,
    /// When they were last written.
    saved_at: Option<Instant>,
    /// Journal writes so far (for the log at the session's end).
    writes: u64,
}

impl ResumePoints {
    /// No point noted yet for the session with `peer`.
    pub fn new(peer: DeviceId) -> ResumePoints {
        ResumePoints {
            peer,
            unsaved: BTreeMap::new(),
            saved_at: None,
            writes: 0,
        }
    }

    /// The peer's records of `folder` (epoch `index_id`) are applied here up to `sequence`.
    pub fn note(&mut self, folder: FolderId, index_id: u64, sequence: u64) {
        self.unsaved.insert(folder, (index_id, sequence));
    }

    /// When the points noted should be written: now, if none were for [`SAVE_INTERVAL`];
    /// `None` when there is nothing to write.
    pub fn due(&self) -> Option<Instant> {
        if self.unsaved.is_empty() {
            return None;
        }
        Some(
            self.saved_at
                .map_or_else(Instant::now, |t| t + SAVE_INTERVAL),
        )
    }

    /// Writes the points noted, if [`ResumePoints::due`] says it is time.
    pub fn save_if_due(&mut self, folders: &Folders) {
        if self.due().is_some_and(|t| t <= Instant::now()) {
            self.save(folders);
        }
    }

    /// Writes the points noted now (the session ends).
    pub fn save(&mut self, folders: &Folders) {
        if self.unsaved.is_empty() {
            return;
        }
        self.saved_at = Some(Instant::now());
        let Ok(mut j) = folders.journal_lock() else {
            return;
        };
        for (folder, (index_id, sequence)) in std::mem::take(&mut self.unsaved) {
            self.writes += 1;
            if let Err(e) = j.set_their_sequence(&folder, &self.peer, index_id, sequence) {
                tracing::error!(%folder, error = %e, "cannot save peer progress");
            }
        }
    }

    /// Journal writes so far.
    pub fn writes(&self) -> u64 {
        self.writes
    }
}
