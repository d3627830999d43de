//! What a decision hands to the steps after it: a [`Transfer`] (a file content to assemble,
//! with what the journal held when it was decided), the error every step returns, and the
//! rule that skips a record this device cannot take.

use crate::chunks::FetchError;
use crate::folder::{FolderError, FolderRt};
use crate::journal::{Change, Journal, JournalError, Op, StoredRecord};
use crate::store::{DirCache, Expect, LocalCopy, StoreError, TempFile};
use meshfs_protocol::{DeviceId, FileRecord, FolderId, Hash, RelPath, VersionVector};
use meshfs_sync::reconcile::ReadError;

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
    /// A version declares more bytes than the disk can take.
    #[error("{path}: No space left on device: the version is {size} bytes, {free} are free")]
    NoRoom {
        /// The version's path.
        path: RelPath,
        /// Its declared size.
        size: u64,
        /// Free bytes on the replica's disk.
        free: u64,
    },
    /// The batch before this one in the pipeline failed.
    #[error("the batch received before this one failed to apply")]
    EarlierFailed,
    /// Local edits kept beating the apply to the same paths.
    #[error("local files kept changing during apply")]
    KeptChanging,
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
    /// The temp file, already holding every chunk found locally; none yet when no chunk was
    /// (it is made after the decision, outside the folder lock).
    pub(super) temp: Option<TempFile>,
    /// Chunks still to fetch: (hash, length, offset in this file).
    pub(super) missing: Vec<(Hash, u32, u64)>,
}

/// Starts a transfer: copies every chunk this device already has (any file of the folder,
/// through the chunk index) into a new temp file. Done at decision time, under the folder
/// lock, so a later deletion in the same batch (the old name of a renamed file) cannot take
/// the local copy away first. A file none of whose chunks is here gets its temp file later,
/// outside the lock (`transfer`): creating a thousand files was a fifth of a receiving
/// daemon's time under the lock, which the next batch's decision waits for.
pub(super) fn prepare(
    rt: &FolderRt,
    meta: Meta,
    local: Located,
    keep_open: bool,
    dirs: &mut DirCache,
) -> Result<Transfer, ApplyError> {
    let record = &meta.record;
    // A record declares its size (a peer can declare terabytes in a few bytes, one chunk
    // listed many times): nothing is written that would leave the disk less than a margin.
    if let Err(free) = crate::store::room_for(rt.store.root(), record.size) {
        return Err(ApplyError::NoRoom {
            path: record.path.clone(),
            size: record.size,
            free,
        });
    }
    let Located {
        copies,
        mut missing,
    } = local;
    let mut temp: Option<TempFile> = None;
    if !copies.is_empty() {
        let t = temp.insert(rt.store.create_temp_in(dirs, &record.path, keep_open)?);
        let absent = rt.store.copy_chunks_in(dirs, t, &copies)?;
        missing.extend(absent.into_iter().map(|i| {
            let c = &copies[i];
            (c.hash, c.len, c.offset)
        }));
    }
    if let (Some(t), false) = (&mut temp, keep_open) {
        rt.store.close_temp(t);
    }
    Ok(Transfer {
        meta,
        temp,
        missing,
    })
}

/// Where the chunks of a version are: copies from local files (the chunk index), and the rest
/// to fetch.
pub(super) struct Located {
    pub(super) copies: Vec<LocalCopy>,
    pub(super) missing: Vec<(Hash, u32, u64)>,
}

impl Located {
    /// Bytes to copy from local files.
    pub(super) fn copy_bytes(&self) -> u64 {
        self.copies.iter().map(|c| c.len as u64).sum()
    }
}

/// Looks up which chunks of `record` this device holds (the journal's chunk index).
pub(super) fn locate(journal: &Journal, folder: &FolderId, record: &FileRecord) -> Located {
    let mut missing = Vec::new();
    let mut copies = Vec::new();
    for (offset, c) in record.chunk_offsets() {
        let sources: Vec<(RelPath, u64)> = journal
            .find_chunk(folder, &c.hash)
            .unwrap_or_default()
            .into_iter()
            .filter(|l| l.len == c.len)
            .map(|l| (l.path, l.offset))
            .collect();
        if sources.is_empty() {
            missing.push((c.hash, c.len, offset));
        } else {
            copies.push(LocalCopy {
                offset,
                hash: c.hash,
                len: c.len,
                sources,
            });
        }
    }
    Located { copies, missing }
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
