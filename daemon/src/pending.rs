//! The `status --pending` document: what waits in a folder, path by path, and why — local
//! changes still being recorded, remote versions skipped or held back for a writer, files that
//! cannot be read, and the records each peer sharing the folder has not acknowledged.
//!
//! Asked for on demand (the control socket's `pending` op), never by the status polls: listing
//! a peer's unacknowledged records reads the journal from that peer's acknowledgement on. Each
//! list shows at most [`LISTED`] paths, with the count of all.

use crate::config::PeerConfig;
use crate::folder::{FolderError, FolderRt, Folders};
use meshfs_protocol::{DeviceId, FolderId, RelPath};
use serde::Serialize;

/// Paths shown per list at most; `count` says how many there are.
pub const LISTED: usize = 200;

/// Records read from the journal per hold of its lock while counting a peer's unacknowledged
/// records (others use the journal in between).
const PAGE: usize = 4096;

/// What waits in one folder.
#[derive(Clone, Debug, Serialize)]
pub struct PendingFolder {
    /// The folder.
    pub id: FolderId,
    /// Its first scan is still running: files not hashed yet are in no list.
    pub scanning: bool,
    /// Why receiving is stopped, or null.
    pub blocked: Option<String>,
    /// Local changes waiting in the capture loop to be recorded.
    pub capture: Listed<CapturePath>,
    /// A rescan of the whole folder waits in the capture loop.
    pub rescan_waiting: bool,
    /// Remote versions that cannot be applied here.
    pub skipped: Listed<PathError>,
    /// Files that exist but cannot be read.
    pub unreadable: Listed<PathError>,
    /// Remote versions held back while the path is open for writing through the mount.
    pub waiting_for_writers: Listed<DeferredPath>,
    /// Per peer sharing the folder, this device's records it has not acknowledged.
    pub unacknowledged: Vec<Unacknowledged>,
}

/// A list, cut at [`LISTED`] items.
#[derive(Clone, Debug, Serialize)]
pub struct Listed<T> {
    /// How many there are.
    pub count: usize,
    /// The first [`LISTED`] of them.
    pub items: Vec<T>,
}

impl<T> Listed<T> {
    fn of(count: usize, items: impl IntoIterator<Item = T>) -> Listed<T> {
        Listed {
            count,
            items: items.into_iter().take(LISTED).collect(),
        }
    }
}

/// A path waiting in the capture loop.
#[derive(Clone, Debug, Serialize)]
pub struct CapturePath {
    /// The path.
    pub path: String,
    /// It was written and waits for its writer to close it (or for a second of quiet).
    pub open_for_writing: bool,
}

/// A path and what went wrong with it.
#[derive(Clone, Debug, Serialize)]
pub struct PathError {
    /// The path.
    pub path: String,
    /// The error.
    pub error: String,
}

/// A remote version waiting for a writer through the mount.
#[derive(Clone, Debug, Serialize)]
pub struct DeferredPath {
    /// The path.
    pub path: String,
    /// The peer the version came from.
    pub from: String,
    /// What it waits for: `writer` (the path is open for writing) or `content` (the local
    /// version it conflicts with is fetched first, D101).
    pub waits_for: &'static str,
}

/// The records of this device a peer sharing the folder has not acknowledged.
#[derive(Clone, Debug, Serialize)]
pub struct Unacknowledged {
    /// The peer.
    pub device_id: String,
    /// Its name in the config.
    pub name: String,
    /// It is connected now.
    pub connected: bool,
    /// It acknowledged this device's records of the folder up to this sequence.
    pub acked: u64,
    /// Records after it (the newest version of each path; those it sent us are not counted).
    pub count: usize,
    /// The first [`LISTED`] of their paths, oldest first.
    pub paths: Vec<String>,
}

fn path_errors(items: Vec<(RelPath, String)>) -> Listed<PathError> {
    let count = items.len();
    Listed::of(
        count,
        items.into_iter().map(|(p, error)| PathError {
            path: p.as_str().to_string(),
            error,
        }),
    )
}

/// What waits in `rt`, shared with `sharing` (of which `connected` are connected now).
pub fn of_folder(
    folders: &Folders,
    rt: &FolderRt,
    sharing: &[PeerConfig],
    connected: &[DeviceId],
) -> Result<PendingFolder, FolderError> {
    let relaxed = std::sync::atomic::Ordering::Relaxed;
    let (paths, rescan_waiting) = rt.capture_waiting(LISTED);
    let capture = Listed::of(
        rt.capture_pending.load(relaxed).max(paths.len()),
        paths.into_iter().map(|(p, open)| CapturePath {
            path: p.as_str().to_string(),
            open_for_writing: open,
        }),
    );
    let deferred = rt.deferred_paths();
    let waiting_for_writers = Listed::of(
        deferred.len(),
        deferred.into_iter().map(|(p, from, wait)| DeferredPath {
            path: p.as_str().to_string(),
            from: from.to_string(),
            waits_for: match wait {
                crate::folder::Wait::Writer => "writer",
                crate::folder::Wait::Content(_) => "content",
            },
        }),
    );
    let unacknowledged = sharing
        .iter()
        .map(|p| unacknowledged(folders, &rt.id, p, connected.contains(&p.id)))
        .collect::<Result<_, _>>()?;
    Ok(PendingFolder {
        id: rt.id.clone(),
        scanning: rt.scanning.load(relaxed),
        blocked: rt.blocked(),
        capture,
        rescan_waiting,
        skipped: path_errors(rt.skipped()),
        unreadable: path_errors(rt.unreadable()),
        waiting_for_writers,
        unacknowledged,
    })
}

/// This device's records of `folder` after `peer`'s acknowledgement, read a page at a time.
fn unacknowledged(
    folders: &Folders,
    folder: &FolderId,
    peer: &PeerConfig,
    connected: bool,
) -> Result<Unacknowledged, FolderError> {
    let acked = folders
        .journal()?
        .peer_progress(folder, &peer.id)?
        .our_acked;
    let (mut after, mut count, mut paths) = (acked, 0, Vec::new());
    loop {
        let page = folders.journal()?.records_since(folder, after, PAGE)?;
        let Some(last) = page.last() else { break };
        after = last.record.sequence;
        let full = page.len() == PAGE;
        // What came from the peer is not sent back to it.
        for r in page.into_iter().filter(|r| r.source != Some(peer.id)) {
            count += 1;
            if paths.len() < LISTED {
                paths.push(r.record.path.as_str().to_string());
            }
        }
        if !full {
            break;
        }
    }
    Ok(Unacknowledged {
        device_id: peer.id.to_string(),
        name: peer.name.clone(),
        connected,
        acked,
        count,
        paths,
    })
}
