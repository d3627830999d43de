//! What a decision hands to the steps after it: a [`Transfer`] (a file content to assemble,
//! with what the journal held when it was decided), the error every step returns, and the
//! rule that skips a record this device cannot take.

use crate::chunks::FetchError;
use crate::folder::{FolderError, FolderRt, Folders};
use crate::journal::{indexed_chunks, Change, Journal, JournalError, Op, StoredRecord};
use crate::room::{Claim, NoRoom, Place};
use crate::store::{DirCache, Expect, LocalCopy, StoreError};
use meshfs_protocol::{DeviceId, FileRecord, Hash, RelPath, VersionVector};
use meshfs_sync::reconcile::ReadError;
use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::sync::Arc;

/// Temp files kept open between assembly and install; beyond this many, a batch's temp files
/// are closed and reopened (the open-file limit is shared with the mount and the scanner).
pub(super) const MAX_OPEN_TEMPS: usize = 1024;

/// Why a batch could not be applied.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// The folder is not running, its lock or the journal's is poisoned, or a rescan failed.
    #[error(transparent)]
    Folder(#[from] FolderError),
    /// The journal failed.
    #[error(transparent)]
    Journal(#[from] JournalError),
    /// The journal could not be read while planning.
    #[error(transparent)]
    Read(#[from] ReadError),
    /// The replica could not be written (a full disk is the one that fails a batch).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Chunks could not be fetched from the peer.
    #[error(transparent)]
    Fetch(#[from] FetchError),
    /// A version declares more bytes than the disk can take, with what is promised to the
    /// other versions being received and the reserve ([`crate::room`]).
    #[error("{path}: No space left on device: the version is {size} bytes; {why}")]
    NoRoom {
        /// The version's path.
        path: RelPath,
        /// Its declared size.
        size: u64,
        /// The disk's free, promised and reserved bytes.
        why: NoRoom,
    },
    /// The batch before this one in the pipeline failed.
    #[error("the batch received before this one failed to apply")]
    EarlierFailed,
    /// A blocking task failed.
    #[error("a blocking task failed: {0}")]
    Task(String),
}

impl ApplyError {
    /// The disk (or the user's quota) is full: receiving waits for room instead of retrying.
    pub fn is_disk_full(&self) -> bool {
        match self {
            ApplyError::NoRoom { .. } => true,
            ApplyError::Store(e) | ApplyError::Fetch(FetchError::Store(e)) => e.is_disk_full(),
            _ => false,
        }
    }
}

/// The version of the journal's record at a path when a transfer to it was decided (`None`:
/// no record; whether it is a tombstone is in the [`Expect`] beside it). The install goes
/// ahead only if the journal still holds the same, so a decision made before an earlier
/// batch's install (the receive pipeline) or a local edit landed is made again instead of
/// acted on.
pub(super) type Basis = Option<VersionVector>;

/// What a transfer to a path records of the journal's record there when it is decided, and
/// what the install compares with the journal's record then.
pub(super) fn seen_of(stored: Option<&StoredRecord>) -> (Expect, Basis) {
    (expect_of(stored), stored.map(|s| s.record.version.clone()))
}

pub(super) fn expect_of(stored: Option<&StoredRecord>) -> Expect {
    match stored {
        Some(s) if !s.record.deleted => match s.local {
            Some(l) => Expect::Matches(l),
            None => Expect::Anything,
        },
        _ => Expect::Absent,
    }
}

/// A file content to assemble: what its install will journal, and where its chunks are.
pub(super) struct Transfer {
    pub(super) meta: Meta,
    /// Chunks found in local files, to copy ([`super::assemble`], outside the folder lock).
    pub(super) copies: Vec<LocalCopy>,
    /// Chunks still to fetch: (hash, length, offset in this file).
    pub(super) missing: Vec<(Hash, u32, u64)>,
}

/// Distinct local files a record's chunks are copied from, at most: a peer's record can name
/// every chunk this device has, and each source is a file opened under the folder lock.
const MAX_SOURCES_PER_RECORD: usize = 64;
/// Source files a batch holds open from its decision to its assembly, at most (beyond, a
/// source is opened again at assembly, if it is still there).
pub(super) const MAX_HELD_SOURCES: usize = 1024;

/// The local files a batch copies chunks from, opened when it is decided: a later decision of
/// the same batch that deletes or replaces one (the old name of a renamed file) cannot take
/// its content away before it is copied, outside the lock.
#[derive(Default)]
pub(super) struct Sources {
    pub(super) held: HashMap<RelPath, Arc<File>>,
}

/// Journal bytes one record may add when it is committed: its row and history row, its
/// chunk list (~37 bytes a chunk), its chunk-index rows ([`indexed_chunks`], ~100 bytes a row
/// with the hash index), twice over for the write-ahead log that carries them first.
pub(super) fn journal_growth(record: &FileRecord) -> u64 {
    let listed = record.chunks.len() as u64;
    let indexed = indexed_chunks(record).count() as u64;
    2 * (4096 + 4 * record.path.as_str().len() as u64 + 40 * listed + 100 * indexed)
}

/// When [`prepare`] finds the chunks this device holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Look {
    /// Now: the transfer's copies are listed.
    Now,
    /// Later, by the caller: every chunk is listed as missing.
    Later,
}

/// Starts a transfer, under the folder lock. First it claims the disk room its content and
/// journal rows need ([`crate::room`]: against every version in flight on the same
/// filesystem, keeping the reserve), so nothing is read or written for a version that does
/// not fit. Then, with [`Look::Now`], it finds which chunks this device has ([`local_copies`]); the
/// copying itself is left to the assembly, outside the lock (a placeholder's stream looks
/// later, after its first request is out: D98). A record
/// that lists a chunk this device has half a million times costs one lookup here and its
/// copies there, within its claimed room.
pub(super) fn prepare(
    journal: &Journal,
    folders: &Folders,
    rt: &FolderRt,
    mut meta: Meta,
    sources: &mut Sources,
    dirs: &mut DirCache,
    look: Look,
) -> Result<Transfer, ApplyError> {
    let record = &meta.record;
    // A placeholder takes no room for content (D91): it has no data blocks.
    let content = rt.store.temp_place().filter(|_| !meta.placeholder);
    let journal_place = folders.journal_place.as_ref();
    let mut wants: Vec<(&Place, u64)> = Vec::with_capacity(2);
    if let Some(p) = content {
        wants.push((p, record.size));
    }
    if let Some(p) = journal_place {
        wants.push((p, journal_growth(record)));
    }
    let mut claims = folders
        .room
        .claim(&wants)
        .map_err(|why| ApplyError::NoRoom {
            path: record.path.clone(),
            size: record.size,
            why,
        })?
        .into_iter();
    meta.content_room = content.and_then(|_| claims.next()).map(Arc::new);
    meta.journal_room = journal_place.and_then(|_| claims.next());
    if meta.placeholder {
        return Ok(Transfer {
            meta,
            copies: Vec::new(),
            missing: Vec::new(),
        });
    }
    if look == Look::Later {
        let missing = meta
            .record
            .chunk_offsets()
            .map(|(offset, c)| (c.hash, c.len, offset))
            .collect();
        return Ok(Transfer {
            meta,
            copies: Vec::new(),
            missing,
        });
    }
    let (copies, missing) = local_copies(journal, rt, &meta.record, sources, dirs);
    Ok(Transfer {
        meta,
        copies,
        missing,
    })
}

/// Where this device holds each chunk of `record` (any file of the folder, through the chunk
/// index: each distinct chunk the index can hold looked up once, [`indexed_chunks`]), opening
/// the files that do into `sources`: the copies to make, and the chunks (hash, length,
/// offset) to fetch.
pub(super) fn local_copies(
    journal: &Journal,
    rt: &FolderRt,
    record: &FileRecord,
    sources: &mut Sources,
    dirs: &mut DirCache,
) -> (Vec<LocalCopy>, Vec<(Hash, u32, u64)>) {
    let folder = &rt.id;
    // Where each distinct chunk the index can hold lives here.
    let mut found: HashMap<Hash, Arc<Vec<(RelPath, u64)>>> = HashMap::new();
    let mut files: HashSet<RelPath> = HashSet::new();
    for (_, c) in indexed_chunks(record) {
        let at: Vec<(RelPath, u64)> = journal
            .find_chunk(folder, &c.hash)
            .unwrap_or_default()
            .into_iter()
            .filter(|l| l.len == c.len)
            .filter(|l| files.contains(&l.path) || files.len() < MAX_SOURCES_PER_RECORD)
            .map(|l| (l.path, l.offset))
            .collect();
        if at.is_empty() {
            continue;
        }
        for (path, _) in &at {
            if files.insert(path.clone())
                && !sources.held.contains_key(path)
                && sources.held.len() < MAX_HELD_SOURCES
            {
                if let Ok(f) = rt.store.open_file_in(dirs, path) {
                    sources.held.insert(path.clone(), Arc::new(f));
                }
            }
        }
        found.insert(c.hash, Arc::new(at));
    }
    let mut copies = Vec::new();
    let mut missing = Vec::new();
    for (offset, c) in record.chunk_offsets() {
        match found.get(&c.hash) {
            Some(at) => copies.push(LocalCopy {
                offset,
                hash: c.hash,
                len: c.len,
                sources: at.clone(),
            }),
            None => missing.push((c.hash, c.len, offset)),
        }
    }
    (copies, missing)
}

/// A transfer's record and bookkeeping: what its install checks and journals.
pub(super) struct Meta {
    pub(super) record: FileRecord,
    pub(super) op: Op,
    pub(super) source: Option<DeviceId>,
    pub(super) expect: Expect,
    pub(super) basis: Basis,
    pub(super) detail: Option<String>,
    /// The remote record this transfer serves (for re-deciding after a failed install).
    pub(super) remote: FileRecord,
    /// Journal changes of the same decision that may only be committed once this file is
    /// installed (a local winner's merged vector must not exist without the remote loser's
    /// sibling, or a crash in between would lose the loser everywhere), each with the version
    /// its path had when decided: committed only if the path still has it.
    pub(super) then: Vec<(Change, Basis)>,
    /// The disk room claimed for its content (its temp file lets go of it as it is written);
    /// dropped with the transfer: installed, discarded or superseded.
    pub(super) content_room: Option<Arc<Claim>>,
    /// The journal room claimed for its rows, until they are committed.
    pub(super) journal_room: Option<Claim>,
    /// Installed as a placeholder, its content not fetched (an on-demand folder, D91).
    pub(super) placeholder: bool,
}

/// A record that cannot be applied here (its parent is a symlink or not a directory, a
/// directory refuses entries, a name the filesystem rejects…) is skipped and reported
/// (`FolderRt::skipped`, in `status`) so that the rest of its batch, and every later one,
/// still applies; only a full disk fails the batch, to be received again once there is room.
pub(super) fn skip_or_fail(
    rt: &FolderRt,
    remote: &FileRecord,
    e: StoreError,
) -> Result<(), ApplyError> {
    if e.is_disk_full() {
        return Err(e.into());
    }
    if rt.skip(remote.path.clone(), e.to_string()) {
        tracing::warn!(folder = %rt.id, path = %remote.path, error = %e, "a remote version cannot be applied here; skipped (see status)");
    }
    Ok(())
}
