//! Keeping what an apply displaces: the content of a version that leaves this device's tree
//! because a peer's version replaced or deleted it; and, in a folder no peer shares, holding
//! the content of this device's own new file versions ahead (below).
//!
//! The store hands over each old file as it keeps it aside (`store::Displaced`: its path, the
//! stat the journal expected, a descriptor of its own). This module's thread (one per folder)
//! takes it from there, off the folder's lock and off the request paths:
//!
//! 1. it waits until the journal has committed the change that replaced the file, which copied
//!    the old record into `versions` (`Journal::departed`): that record's chunk list says what
//!    the file held, chunk by chunk, with offsets;
//! 2. of those chunks it keeps only what nothing else holds: not in the live tree (the chunk
//!    index) and not in the vault already — a 1 GiB file edited in ten places leaves ten chunks
//!    here, not a copy;
//! 3. it reads each such chunk from the old file, checks it against its blake3 (a chunk a late
//!    writer changed is not kept: the version is then not kept whole, never kept wrong), and
//!    stores the batch in the vault in one transaction.
//!
//! A file whose change is never committed (the install failed, the swap was undone) is let go
//! after [`GIVE_UP`]. Its descriptor keeps the old inode readable meanwhile; the queue is
//! bounded ([`QUEUE`]) so that descriptors stay a budget: what does not fit is not kept, and
//! says so in the log.
//!
//! Each file keeps its marked name aside until this thread drops it (`store::Displaced`): after
//! its content is in the vault, or once it will not be. Killed before then, the daemon finds it
//! at its next start and hands it over again, so a SIGKILL at any instant loses no version the
//! keeper had been given.
//!
//! **Held ahead (D68).** A local edit or deletion made outside a mount is seen by the watcher
//! only after the old content is gone; peers keep it as they apply the change, but a folder no
//! peer shares has nobody to do so. There each file a scan journals as this device's new
//! version (not the first scan's) is read again from its path, each chunk the vault lacks
//! checked against the journaled record (a file written since is not held: never held wrong)
//! and stored; when that version leaves the tree its chunks are here. Retention weighs what is
//! held ahead in the same budget (`super::policy`), newest first. A file larger than a quarter
//! of the budget is not held.

use crate::folder::{Folders, LocalFile, LocalSink};
use crate::journal::{Departed, KeptVersion};
use crate::store::{read_chunk_of, DirCache, Displaced, DisplacedSink};
use crate::vault::Vault;
use meshfs_protocol::{FolderId, Hash};
use std::collections::HashSet;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Displaced files waiting for the keeper at most (each holds a descriptor).
pub const QUEUE: usize = 4096;
/// How long a displaced file waits for the journal to commit its replacement: after a crash,
/// a restore's replacement is journaled by the start-up scan, which a large folder takes
/// minutes over.
const GIVE_UP: Duration = Duration::from_secs(600);
/// Files looked up under one hold of the journal at most.
const PER_HOLD: usize = 256;

/// A file waiting for its replacement's commit.
struct Waiting {
    job: Displaced,
    since: Instant,
}

/// What the keeper is handed.
enum Job {
    /// A file an apply or a restore moved aside.
    Displaced(Displaced),
    /// Files a scan journaled as this device's new versions.
    Ahead(Vec<LocalFile>),
}

/// When the keeper works: `on`, versions are kept at all (the folder's retention may be off);
/// `ahead`, this device's own new files are held ahead (no peer shares the folder).
pub struct Switches {
    /// Whether versions are kept.
    pub on: Box<dyn Fn() -> bool + Send>,
    /// Whether new local files are held ahead.
    pub ahead: Box<dyn Fn() -> bool + Send>,
}

/// Starts the keeper of `folder` and returns the sinks the folder's store hands displaced files
/// to and its scans the files they journaled. `kept` is told the bytes each batch added to the
/// vault.
pub fn start(
    folders: Arc<Folders>,
    folder: FolderId,
    vault: Arc<Vault>,
    switches: Switches,
    kept: impl Fn(u64) + Send + 'static,
) -> (DisplacedSink, LocalSink) {
    let (tx, rx) = mpsc::sync_channel::<Job>(QUEUE);
    // Weak: the sink lives in the folder's store, which `folders` holds; a strong reference here
    // would keep the folders (and the journal, whose close marks its log) alive forever.
    let folders = Arc::downgrade(&folders);
    let name = format!("meshfs-keep-{}", folder.as_str());
    let spawned = std::thread::Builder::new().name(name).spawn(move || {
        crate::priority::background();
        run(&folders, &folder, &vault, &switches, &kept, rx);
    });
    if let Err(e) = spawned {
        tracing::error!(error = %e, "cannot start the thread that keeps past versions; none are kept");
    }
    let ahead_tx = tx.clone();
    let displaced: DisplacedSink = Arc::new(move |job: Displaced| {
        match tx.try_send(Job::Displaced(job)) {
            Ok(()) => {}
            Err(mpsc::TrySendError::Full(Job::Displaced(job))) => {
                tracing::warn!(path = %job.path, "too many replaced files wait to be kept; this version's content is not kept here");
            }
            Err(_) => {}
        }
    });
    let ahead: LocalSink = Arc::new(move |files: Vec<LocalFile>| {
        if let Err(mpsc::TrySendError::Full(_)) = ahead_tx.try_send(Job::Ahead(files)) {
            tracing::warn!("too many new files wait to be held ahead; some are not");
        }
    });
    (displaced, ahead)
}

fn run(
    folders: &std::sync::Weak<Folders>,
    folder: &FolderId,
    vault: &Vault,
    switches: &Switches,
    kept: &dyn Fn(u64),
    rx: mpsc::Receiver<Job>,
) {
    let mut waiting: Vec<Waiting> = Vec::new();
    loop {
        // Block for work when nothing waits; otherwise look again shortly.
        let first = if waiting.is_empty() {
            match rx.recv() {
                Ok(j) => Some(j),
                Err(_) => return,
            }
        } else {
            match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(j) => Some(j),
                Err(mpsc::RecvTimeoutError::Timeout) => None,
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            }
        };
        let now = Instant::now();
        let mut ahead = Vec::new();
        for job in first
            .into_iter()
            .chain(std::iter::from_fn(|| rx.try_recv().ok()))
        {
            match job {
                Job::Displaced(job) => waiting.push(Waiting { job, since: now }),
                Job::Ahead(files) => ahead.extend(files),
            }
        }
        if !(switches.on)() {
            waiting.clear();
            continue;
        }
        let Some(live) = folders.upgrade() else {
            return;
        };
        if !ahead.is_empty() && (switches.ahead)() {
            hold_ahead(&live, folder, vault, ahead, kept);
        }
        let (ready, still) = resolve(&live, folder, std::mem::take(&mut waiting));
        drop(live);
        waiting = still;
        for (job, version, candidates) in ready {
            // Under the gate from the check to the write: a sweep cannot slip between them.
            let _gate = vault.gate();
            let hashes: Vec<Hash> = candidates.iter().map(|c| c.2).collect();
            let held = vault
                .has(&hashes)
                .unwrap_or_else(|_| vec![false; hashes.len()]);
            let missing: Vec<(u64, u32, Hash)> = candidates
                .into_iter()
                .zip(held)
                .filter(|(_, h)| !h)
                .map(|(c, _)| c)
                .collect();
            match keep(vault, &job, &version, &missing) {
                Ok(bytes) => {
                    if bytes > 0 {
                        kept(bytes);
                    }
                    tracing::debug!(%folder, path = %job.path, sequence = version.record.sequence, chunks = missing.len(), bytes, "kept a past version");
                }
                Err(e) => {
                    tracing::warn!(%folder, path = %job.path, error = %e, "cannot keep the replaced version's content");
                }
            }
        }
    }
}

/// Looks up each waiting file in the journal (a few hundred per hold): those whose
/// replacement is committed come back with their version and the chunks the live tree does not
/// hold; those whose replacement is not yet stay waiting (until [`GIVE_UP`]).
#[allow(clippy::type_complexity)]
fn resolve(
    folders: &Folders,
    folder: &FolderId,
    waiting: Vec<Waiting>,
) -> (
    Vec<(Displaced, KeptVersion, Vec<(u64, u32, Hash)>)>,
    Vec<Waiting>,
) {
    let mut ready = Vec::new();
    let mut still = Vec::new();
    let mut rest = waiting.into_iter().peekable();
    while rest.peek().is_some() {
        let hold: Vec<Waiting> = rest.by_ref().take(PER_HOLD).collect();
        let Ok(mut j) = folders.journal() else {
            // Looked up again at the next round (or given up after GIVE_UP).
            still.extend(hold);
            still.extend(rest);
            return (ready, still);
        };
        j.begin_reads();
        for w in hold {
            match j.departed(folder, &w.job.path, w.job.stat.inode) {
                Ok(Departed::Version(v)) => {
                    let chunks: Vec<(u64, u32, Hash)> = v
                        .record
                        .chunk_offsets()
                        .map(|(o, c)| (o, c.len, c.hash))
                        .collect();
                    let hashes: Vec<Hash> = chunks.iter().map(|c| c.2).collect();
                    let live = j.find_chunks(folder, &hashes);
                    let mut seen = HashSet::new();
                    let candidates: Vec<(u64, u32, Hash)> = chunks
                        .into_iter()
                        .zip(live)
                        .filter(|(c, locs)| locs.is_empty() && seen.insert(c.2))
                        .map(|(c, _)| c)
                        .collect();
                    ready.push((w.job, *v, candidates));
                }
                Ok(Departed::NotYet) | Ok(Departed::Unknown) | Err(_)
                    if w.since.elapsed() < GIVE_UP =>
                {
                    still.push(w)
                }
                Ok(_) | Err(_) => {
                    tracing::debug!(%folder, path = %w.job.path, "a replaced file's change was never journaled; not kept");
                }
            }
        }
        j.end_reads();
    }
    (ready, still)
}

/// Holds ahead the chunks of `files` (this device's new versions) the vault lacks, each read
/// from its path and checked against the journaled record: a file replaced or written since
/// (another inode, a chunk that no longer matches) is not held. Files larger than a quarter of
/// the versions' budget are not held (they would not stay).
fn hold_ahead(
    folders: &Folders,
    folder: &FolderId,
    vault: &Vault,
    files: Vec<LocalFile>,
    kept: &dyn Fn(u64),
) {
    let Some(rt) = folders.get(folder) else {
        return;
    };
    let budget = match vault.budget() {
        0 => AHEAD_UNKNOWN_BUDGET,
        b => b,
    };
    let mut dirs = DirCache::default();
    let mut added = 0;
    for (path, record, local) in files {
        if record.size > budget / 4 {
            tracing::debug!(%folder, %path, size = record.size, "too large to hold ahead");
            continue;
        }
        let Ok(file) = rt.store.open_file_in(&mut dirs, &path) else {
            continue;
        };
        use std::os::unix::fs::MetadataExt;
        if file.metadata().map(|m| m.ino()).ok() != Some(local.inode) {
            continue;
        }
        // Under the gate from the check to the write: a sweep cannot slip between them.
        let _gate = vault.gate();
        let mut seen = HashSet::new();
        let wanted: Vec<(u64, u32, Hash)> = record
            .chunk_offsets()
            .map(|(o, c)| (o, c.len, c.hash))
            .filter(|c| seen.insert(c.2))
            .collect();
        let hashes: Vec<Hash> = wanted.iter().map(|c| c.2).collect();
        let held = vault
            .has(&hashes)
            .unwrap_or_else(|_| vec![true; hashes.len()]);
        let mut batch = Vec::new();
        let mut whole = true;
        for ((offset, len, hash), here) in wanted.into_iter().zip(held) {
            if here {
                continue;
            }
            match read_chunk_of(&file, &path, offset, len, &hash) {
                Ok(data) => batch.push((hash, data)),
                Err(_) => {
                    whole = false;
                    break;
                }
            }
        }
        if !whole {
            tracing::debug!(%folder, %path, "written since it was journaled; not held ahead");
            continue;
        }
        match vault.put(&batch) {
            Ok(b) => added += b,
            Err(e) => {
                tracing::warn!(%folder, %path, error = %e, "cannot hold the new version's content ahead")
            }
        }
    }
    if added > 0 {
        kept(added);
        tracing::debug!(%folder, bytes = added, "held new local versions ahead");
    }
}

/// The budget assumed before retention has run once: files up to a quarter of it are held.
const AHEAD_UNKNOWN_BUDGET: u64 = 256 << 20;

/// Reads `missing` (offset, length, hash) from the displaced file, checks each against its
/// hash and stores them in the vault. Returns the bytes added.
fn keep(
    vault: &Vault,
    job: &Displaced,
    version: &KeptVersion,
    missing: &[(u64, u32, Hash)],
) -> Result<u64, String> {
    if missing.is_empty() {
        return Ok(0);
    }
    let mut batch = Vec::with_capacity(missing.len().min(64));
    let mut added = 0;
    let mut unreadable = 0;
    for &(offset, len, hash) in missing {
        match read_chunk_of(&job.file, &version.record.path, offset, len, &hash) {
            Ok(data) => batch.push((hash, data)),
            // Written since it was checked (a late writer): not this version's bytes.
            Err(_) => unreadable += 1,
        }
        if batch.len() >= 64 {
            added += vault
                .put(&std::mem::take(&mut batch))
                .map_err(|e| e.to_string())?;
        }
    }
    added += vault.put(&batch).map_err(|e| e.to_string())?;
    if unreadable > 0 {
        tracing::warn!(path = %job.path, unreadable, "some chunks of a replaced file no longer match its version; that version is not kept whole");
    }
    Ok(added)
}
