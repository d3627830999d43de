//! Turning journal rows into meshfs values and back.
//!
//! Everything read from the database is checked as if it came from a peer: a value that does
//! not decode, or a record that does not [`FileRecord::validate`], becomes
//! [`JournalError::Corrupt`] naming the folder and path, never a panic.

use super::{HistoryEntry, JournalError, Op, Result, StoredRecord};
use crate::store::LocalStat;
use meshfs_protocol::{
    Chunk, DeviceId, FileKind, FileRecord, FolderId, Hash, RelPath, ShortId, VersionVector,
};
use rusqlite::types::ValueRef;
use rusqlite::Row;
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::fmt::Display;

/// u64 → SQLite integer, bit for bit (values ≥ 2^63 come out negative).
pub(super) fn to_i64(v: u64) -> i64 {
    v as i64
}

/// SQLite integer → u64, the inverse of [`to_i64`].
pub(super) fn to_u64(v: i64) -> u64 {
    v as u64
}

/// The columns of `records` that [`stored_record`] reads, in its order.
pub(super) const RECORD_COLUMNS: &str = "path, kind, deleted, mode, mtime_ns, size, hash, \
     chunks, target, version, modified_by, sequence, local_inode, local_size, local_mtime_ns, \
     local_ctime_ns, local_mode, source";

/// The columns of `history` that [`history_entry`] reads, in its order.
pub(super) const HISTORY_COLUMNS: &str = "sequence, time_ns, path, op, kind, deleted, \
     modified_by, source, version, hash, size, mode, detail";

/// Postcard encoding of a column value.
pub(super) fn encode<T: Serialize>(value: &T, what: &str) -> Result<Vec<u8>> {
    postcard::to_allocvec(value).map_err(|e| JournalError::Corrupt {
        what: format!("cannot encode {what}: {e}"),
    })
}

/// Where a row came from, for error messages.
struct At<'a> {
    folder: &'a FolderId,
    path: &'a str,
}

impl At<'_> {
    fn corrupt(&self, what: impl Display) -> JournalError {
        JournalError::Corrupt {
            what: format!("folder {}, path {:?}: {what}", self.folder, self.path),
        }
    }

    fn decode<T: DeserializeOwned>(&self, bytes: &[u8], what: &str) -> Result<T> {
        match postcard::take_from_bytes::<T>(bytes) {
            Ok((v, [])) => Ok(v),
            Ok((_, rest)) => Err(self.corrupt(format!("{what}: {} trailing bytes", rest.len()))),
            Err(e) => Err(self.corrupt(format!("{what}: {e}"))),
        }
    }

    fn blob<'r>(&self, row: &'r Row<'_>, i: usize, what: &str) -> Result<&'r [u8]> {
        row.get_ref(i)?
            .as_blob()
            .map_err(|e| self.corrupt(format!("{what}: {e}")))
    }

    fn opt_blob<'r>(&self, row: &'r Row<'_>, i: usize, what: &str) -> Result<Option<&'r [u8]>> {
        row.get_ref(i)?
            .as_blob_or_null()
            .map_err(|e| self.corrupt(format!("{what}: {e}")))
    }

    fn int(&self, row: &Row<'_>, i: usize, what: &str) -> Result<i64> {
        row.get_ref(i)?
            .as_i64()
            .map_err(|e| self.corrupt(format!("{what}: {e}")))
    }

    fn opt_int(&self, row: &Row<'_>, i: usize, what: &str) -> Result<Option<i64>> {
        row.get_ref(i)?
            .as_i64_or_null()
            .map_err(|e| self.corrupt(format!("{what}: {e}")))
    }

    fn text<'r>(&self, row: &'r Row<'_>, i: usize, what: &str) -> Result<&'r str> {
        row.get_ref(i)?
            .as_str()
            .map_err(|e| self.corrupt(format!("{what}: {e}")))
    }

    fn hash(&self, row: &Row<'_>, i: usize) -> Result<Hash> {
        let b = self.blob(row, i, "hash")?;
        let arr: [u8; 32] = b
            .try_into()
            .map_err(|_| self.corrupt(format!("hash has {} bytes, not 32", b.len())))?;
        Ok(Hash(arr))
    }

    fn device(&self, row: &Row<'_>, i: usize) -> Result<Option<DeviceId>> {
        match self.opt_blob(row, i, "source device")? {
            None => Ok(None),
            Some(b) => {
                let arr: [u8; 32] = b.try_into().map_err(|_| {
                    self.corrupt(format!("source device id has {} bytes, not 32", b.len()))
                })?;
                Ok(Some(DeviceId::from_bytes(arr)))
            }
        }
    }

    fn mode(&self, row: &Row<'_>, i: usize) -> Result<u32> {
        let m = self.int(row, i, "mode")?;
        u32::try_from(m).map_err(|_| self.corrupt(format!("mode {m} is not a u32")))
    }

    fn kind(&self, row: &Row<'_>, i: usize) -> Result<FileKind> {
        let k = self.text(row, i, "kind")?;
        FileKind::parse(k).ok_or_else(|| self.corrupt(format!("unknown kind {k:?}")))
    }

    fn flag(&self, row: &Row<'_>, i: usize, what: &str) -> Result<bool> {
        match self.int(row, i, what)? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(self.corrupt(format!("{what} is {v}, not 0 or 1"))),
        }
    }
}

fn rel_path(folder: &FolderId, raw: &str) -> Result<RelPath> {
    RelPath::new(raw).map_err(|e| JournalError::Corrupt {
        what: format!("folder {folder}: stored path {raw:?} is invalid: {e}"),
    })
}

/// The five local-stat columns starting at `first` (inode, size, mtime, ctime, mode); a NULL
/// inode means no local file is known.
fn local_stat(at: &At<'_>, row: &Row<'_>, first: usize) -> Result<Option<LocalStat>> {
    let Some(inode) = at.opt_int(row, first, "local inode")? else {
        return Ok(None);
    };
    let m = at.int(row, first + 4, "local mode")?;
    Ok(Some(LocalStat {
        inode: to_u64(inode),
        size: to_u64(at.int(row, first + 1, "local size")?),
        mtime_ns: at.int(row, first + 2, "local mtime")?,
        ctime_ns: at.int(row, first + 3, "local ctime")?,
        mode: u32::try_from(m).map_err(|_| at.corrupt(format!("local mode {m} is not a u32")))?,
    }))
}

/// [`local_stat`] of the record at `raw` (a stored path) of `folder`.
pub(super) fn local_stat_of(
    folder: &FolderId,
    raw: &str,
    row: &Row<'_>,
    first: usize,
) -> Result<Option<LocalStat>> {
    local_stat(&At { folder, path: raw }, row, first)
}

/// The path in column 0 of a records row, as stored.
fn path_text<'r>(folder: &FolderId, row: &'r Row<'_>) -> Result<&'r str> {
    row.get_ref(0)?.as_str().map_err(|e| JournalError::Corrupt {
        what: format!("folder {folder}: a record's path is not text: {e}"),
    })
}

/// Decodes a row selected with [`RECORD_COLUMNS`], and checks the record's invariants.
pub(super) fn stored_record(folder: &FolderId, row: &Row<'_>) -> Result<StoredRecord> {
    let raw_path = path_text(folder, row)?;
    let at = At {
        folder,
        path: raw_path,
    };
    let path = rel_path(folder, raw_path)?;
    let local = local_stat(&at, row, 12)?;
    let record = FileRecord {
        kind: at.kind(row, 1)?,
        deleted: at.flag(row, 2, "deleted")?,
        mode: at.mode(row, 3)?,
        mtime_ns: at.int(row, 4, "mtime")?,
        size: to_u64(at.int(row, 5, "size")?),
        hash: at.hash(row, 6)?,
        chunks: at.decode::<Vec<Chunk>>(at.blob(row, 7, "chunks")?, "chunk list")?,
        target: at.text(row, 8, "symlink target")?.to_string(),
        version: at.decode::<VersionVector>(at.blob(row, 9, "version")?, "version vector")?,
        modified_by: ShortId(to_u64(at.int(row, 10, "modified_by")?)),
        sequence: to_u64(at.int(row, 11, "sequence")?),
        path,
    };
    // Read-back check, paired with the one in `commit` before the write.
    record.validate().map_err(|e| at.corrupt(e))?;
    Ok(StoredRecord {
        record,
        local,
        source: at.device(row, 17)?,
    })
}

/// Decodes a row selected with [`HISTORY_COLUMNS`].
pub(super) fn history_entry(folder: &FolderId, row: &Row<'_>) -> Result<HistoryEntry> {
    let raw_path = row
        .get_ref(2)?
        .as_str()
        .map_err(|e| JournalError::Corrupt {
            what: format!("folder {folder}: a history path is not text: {e}"),
        })?;
    let at = At {
        folder,
        path: raw_path,
    };
    let op_text = at.text(row, 3, "operation")?;
    let op = Op::parse(op_text).ok_or_else(|| at.corrupt(format!("unknown op {op_text:?}")))?;
    let detail = match row.get_ref(12)? {
        ValueRef::Null => None,
        v => Some(
            v.as_str()
                .map_err(|e| at.corrupt(format!("detail: {e}")))?
                .to_string(),
        ),
    };
    Ok(HistoryEntry {
        sequence: to_u64(at.int(row, 0, "sequence")?),
        time_ns: at.int(row, 1, "time")?,
        path: rel_path(folder, raw_path)?,
        op,
        kind: at.kind(row, 4)?,
        deleted: at.flag(row, 5, "deleted")?,
        modified_by: ShortId(to_u64(at.int(row, 6, "modified_by")?)),
        source: at.device(row, 7)?,
        version: at.decode::<VersionVector>(at.blob(row, 8, "version")?, "version vector")?,
        hash: at.hash(row, 9)?,
        size: to_u64(at.int(row, 10, "size")?),
        mode: at.mode(row, 11)?,
        detail,
    })
}

/// Decodes a pending row: `path, record, source`; the record must name the row's path.
pub(super) fn pending_item(
    folder: &FolderId,
    row: &Row<'_>,
) -> Result<(FileRecord, Option<DeviceId>)> {
    let raw_path = row
        .get_ref(0)?
        .as_str()
        .map_err(|e| JournalError::Corrupt {
            what: format!("folder {folder}: a pending path is not text: {e}"),
        })?;
    let at = At {
        folder,
        path: raw_path,
    };
    let record: FileRecord = at.decode(at.blob(row, 1, "pending record")?, "pending record")?;
    if record.path.as_str() != raw_path {
        return Err(at.corrupt(format!("pending record names {}", record.path)));
    }
    record.validate().map_err(|e| at.corrupt(e))?;
    Ok((record, at.device(row, 2)?))
}

/// A stored folder name.
pub(super) fn folder_id(raw: &str) -> Result<FolderId> {
    FolderId::new(raw).map_err(|e| JournalError::Corrupt {
        what: format!("stored folder id is invalid: {e}"),
    })
}

/// A stored path of `folder` (for queries that return bare paths).
pub(super) fn path_of(folder: &FolderId, raw: &str) -> Result<RelPath> {
    rel_path(folder, raw)
}

/// The columns [`summary`] reads, in its order.
pub(super) const SUMMARY_COLUMNS: &str = "path, kind, deleted, mode, mtime_ns, hash, \
     local_inode, local_size, local_mtime_ns, local_ctime_ns, local_mode";

/// Decodes a row selected with [`SUMMARY_COLUMNS`].
pub(super) fn summary(folder: &FolderId, row: &Row<'_>) -> Result<super::RecordSummary> {
    let raw_path = path_text(folder, row)?;
    let at = At {
        folder,
        path: raw_path,
    };
    let local = local_stat(&at, row, 6)?;
    Ok(super::RecordSummary {
        path: rel_path(folder, raw_path)?,
        kind: at.kind(row, 1)?,
        deleted: at.flag(row, 2, "deleted")?,
        mode: at.mode(row, 3)?,
        mtime_ns: at.int(row, 4, "mtime")?,
        hash: at.hash(row, 5)?,
        local,
    })
}
