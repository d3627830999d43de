//! Past versions: the `versions` rows the commit writes when a version leaves the tree, the
//! folder as it was at a past time, and what retention prunes (docs/decisions.md, D43–D45).
//!
//! The journal only stores and answers here: which versions to prune is the retention
//! policy's (`crate::versions::policy`), whether a version's content is kept is the vault's.

use super::rows::{self, to_i64, to_u64, HISTORY_COLUMNS, RECORD_COLUMNS};
use super::{below_bounds, limit_sql, lookup_folder, HistoryEntry, Journal, Result};
use crate::store::LocalStat;
use meshfs_protocol::{DeviceId, FileRecord, FolderId, Hash, RelPath};
use rusqlite::{params, OptionalExtension};

/// The columns [`kept_version`] reads: a `records`-shaped prefix ([`rows::stored_record`])
/// and the version's own.
const VERSION_COLUMNS: &str = "path, kind, 0, mode, mtime_ns, size, hash, chunks, target, \
     version, modified_by, sequence, local_inode, local_size, local_mtime_ns, local_ctime_ns, \
     local_mode, source, id, made_ns, left_ns, left_seq";

/// A version that left this device's tree: replaced by other content or another kind, or
/// deleted (a `versions` row).
#[derive(Clone, Debug, PartialEq)]
pub struct KeptVersion {
    /// Its row.
    pub id: i64,
    /// The version as it was (`sequence`: its own, the sequence of its history row).
    pub record: FileRecord,
    /// The peer it came from; `None`: made here.
    pub source: Option<DeviceId>,
    /// The file that held it here, as last seen.
    pub local: Option<LocalStat>,
    /// When it was journaled here (ns since the epoch).
    pub made_ns: i64,
    /// When the change that replaced it was journaled here.
    pub left_ns: i64,
    /// That change's sequence.
    pub left_seq: u64,
}

/// One version retention removed (a `pruned` row).
#[derive(Clone, Debug, PartialEq)]
pub struct PrunedEvent {
    /// When.
    pub time_ns: i64,
    /// The version's path.
    pub path: RelPath,
    /// The version's sequence.
    pub sequence: u64,
    /// Its content hash.
    pub hash: Hash,
    /// Its size.
    pub size: u64,
    /// Why: `age`, `space`, `thinned`, `off`.
    pub reason: String,
}

/// A version retention removes, and why (see [`PrunedEvent::reason`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Retired {
    /// Its row ([`KeptVersion::id`]).
    pub id: i64,
    /// Why.
    pub reason: &'static str,
}

/// Where the content of a file an apply displaced stands in the journal (see
/// [`Journal::departed`]).
#[derive(Clone, Debug, PartialEq)]
pub enum Departed {
    /// Journaled as a version that left the tree.
    Version(Box<KeptVersion>),
    /// Still the current record: the change that replaces it is not committed yet.
    NotYet,
    /// Neither (the change was not committed, or the file was not the journal's).
    Unknown,
}

fn kept_version(folder: &FolderId, r: &rusqlite::Row<'_>) -> Result<KeptVersion> {
    let stored = rows::stored_record(folder, r)?;
    Ok(KeptVersion {
        record: stored.record,
        source: stored.source,
        local: stored.local,
        id: r.get(18)?,
        made_ns: r.get(19)?,
        left_ns: r.get(20)?,
        left_seq: to_u64(r.get(21)?),
    })
}

impl Journal {
    /// The versions of `path` that left the tree, newest first.
    pub fn versions_of(&self, folder: &FolderId, path: &RelPath) -> Result<Vec<KeptVersion>> {
        self.read(|c| {
            let Some(key) = self.key(c, folder)? else {
                return Ok(Vec::new());
            };
            let mut st = c.prepare_cached(&format!(
                "SELECT {VERSION_COLUMNS} FROM versions WHERE folder = ?1 AND path = ?2 \
                 ORDER BY left_ns DESC, sequence DESC"
            ))?;
            let mut rows = st.query(params![key, path.as_str()])?;
            let mut out = Vec::new();
            while let Some(r) = rows.next()? {
                out.push(kept_version(folder, r)?);
            }
            Ok(out)
        })
    }

    /// The version of `folder` whose own sequence is `sequence`, if it left the tree.
    pub fn version_at_sequence(
        &self,
        folder: &FolderId,
        sequence: u64,
    ) -> Result<Option<KeptVersion>> {
        self.read(|c| {
            let Some(key) = self.key(c, folder)? else {
                return Ok(None);
            };
            let mut st = c.prepare_cached(&format!(
                "SELECT {VERSION_COLUMNS} FROM versions WHERE folder = ?1 AND sequence = ?2"
            ))?;
            let mut rows = st.query(params![key, to_i64(sequence)])?;
            match rows.next()? {
                Some(r) => Ok(Some(kept_version(folder, r)?)),
                None => Ok(None),
            }
        })
    }

    /// The newest version of `path` with content `hash` that left the tree (a metadata change
    /// keeps content: several history rows may name one version's content).
    pub fn version_with_content(
        &self,
        folder: &FolderId,
        path: &RelPath,
        hash: &Hash,
    ) -> Result<Option<KeptVersion>> {
        self.read(|c| {
            let Some(key) = self.key(c, folder)? else {
                return Ok(None);
            };
            let mut st = c.prepare_cached(&format!(
                "SELECT {VERSION_COLUMNS} FROM versions WHERE folder = ?1 AND path = ?2 \
                 AND hash = ?3 ORDER BY left_ns DESC, sequence DESC LIMIT 1"
            ))?;
            let mut rows = st.query(params![key, path.as_str(), &hash.0[..]])?;
            match rows.next()? {
                Some(r) => Ok(Some(kept_version(folder, r)?)),
                None => Ok(None),
            }
        })
    }

    /// What the journal says of the file with inode `inode` that an apply just moved away
    /// from `path`: the version that left the tree (its newest row held by that inode), not
    /// yet (the current record still names it), or nothing known.
    pub fn departed(&self, folder: &FolderId, path: &RelPath, inode: u64) -> Result<Departed> {
        self.read(|c| {
            let Some(key) = self.key(c, folder)? else {
                return Ok(Departed::Unknown);
            };
            let current: Option<i64> = c
                .prepare_cached(
                    "SELECT 1 FROM records WHERE folder = ?1 AND path = ?2 AND deleted = 0 \
                     AND local_inode = ?3",
                )?
                .query_row(params![key, path.as_str(), to_i64(inode)], |r| r.get(0))
                .optional()?;
            if current.is_some() {
                return Ok(Departed::NotYet);
            }
            let mut st = c.prepare_cached(&format!(
                "SELECT {VERSION_COLUMNS} FROM versions WHERE folder = ?1 AND path = ?2 \
                 AND local_inode = ?3 ORDER BY left_ns DESC LIMIT 1"
            ))?;
            let mut rows = st.query(params![key, path.as_str(), to_i64(inode)])?;
            match rows.next()? {
                Some(r) => Ok(Departed::Version(Box::new(kept_version(folder, r)?))),
                None => Ok(Departed::Unknown),
            }
        })
    }

    /// Every version of the folder that left the tree, oldest first (what retention weighs).
    pub fn all_versions(&self, folder: &FolderId) -> Result<Vec<KeptVersion>> {
        self.read(|c| {
            let Some(key) = self.key(c, folder)? else {
                return Ok(Vec::new());
            };
            let mut st = c.prepare_cached(&format!(
                "SELECT {VERSION_COLUMNS} FROM versions WHERE folder = ?1 \
                 ORDER BY left_ns, sequence"
            ))?;
            let mut rows = st.query([key])?;
            let mut out = Vec::new();
            while let Some(r) = rows.next()? {
                out.push(kept_version(folder, r)?);
            }
            Ok(out)
        })
    }

    /// The live files this device made (no peer's version) that changed at or after
    /// `since_ns`, oldest first: each record's row, when it changed, and the record. What a
    /// folder no peer shares holds ahead (`crate::versions::retention`).
    pub fn own_files_since(
        &self,
        folder: &FolderId,
        since_ns: i64,
    ) -> Result<Vec<(i64, i64, FileRecord)>> {
        self.read(|c| {
            let Some(key) = self.key(c, folder)? else {
                return Ok(Vec::new());
            };
            let mut st = c.prepare_cached(&format!(
                "SELECT {RECORD_COLUMNS}, id, changed_at FROM records WHERE folder = ?1 \
                 AND deleted = 0 AND kind = 'file' AND source IS NULL AND changed_at >= ?2 \
                 ORDER BY changed_at, sequence"
            ))?;
            let mut rows = st.query(params![key, since_ns])?;
            let mut out = Vec::new();
            while let Some(r) = rows.next()? {
                let stored = rows::stored_record(folder, r)?;
                out.push((r.get(18)?, r.get(19)?, stored.record));
            }
            Ok(out)
        })
    }

    /// How many versions of the folder left the tree and are still listed.
    pub fn version_count(&self, folder: &FolderId) -> Result<u64> {
        self.read(|c| {
            let Some(key) = self.key(c, folder)? else {
                return Ok(0);
            };
            let n: i64 = c
                .prepare_cached("SELECT count(*) FROM versions WHERE folder = ?1")?
                .query_row([key], |r| r.get(0))?;
            Ok(to_u64(n))
        })
    }

    /// Removes the `retired` versions and records each as a [`PrunedEvent`] at `now_ns`, in
    /// one transaction. Returns how many were removed.
    pub fn retire_versions(
        &mut self,
        folder: &FolderId,
        retired: &[Retired],
        now_ns: i64,
    ) -> Result<u64> {
        if retired.is_empty() {
            return Ok(0);
        }
        self.write(|tx| {
            let Some((key, _)) = lookup_folder(tx, folder)? else {
                return Ok(0);
            };
            let mut note = tx.prepare_cached(
                "INSERT INTO pruned (folder, time_ns, path, sequence, hash, size, reason) \
                 SELECT folder, ?3, path, sequence, hash, size, ?4 FROM versions \
                 WHERE id = ?1 AND folder = ?2",
            )?;
            let mut delete =
                tx.prepare_cached("DELETE FROM versions WHERE id = ?1 AND folder = ?2")?;
            let mut n = 0;
            for r in retired {
                note.execute(params![r.id, key, now_ns, r.reason])?;
                n += delete.execute(params![r.id, key])? as u64;
            }
            Ok(n)
        })
    }

    /// The prune events of the folder at or after `since_ns`, oldest first, at most `limit`
    /// (the most recent ones when more match).
    pub fn pruned_since(
        &self,
        folder: &FolderId,
        since_ns: i64,
        limit: Option<usize>,
    ) -> Result<Vec<PrunedEvent>> {
        self.read(|c| {
            let Some(key) = self.key(c, folder)? else {
                return Ok(Vec::new());
            };
            let mut st = c.prepare_cached(
                "SELECT time_ns, path, sequence, hash, size, reason FROM pruned \
                 WHERE folder = ?1 AND time_ns >= ?2 ORDER BY time_ns DESC LIMIT ?3",
            )?;
            let mut rows = st.query(params![key, since_ns, limit.map_or(-1, limit_sql)])?;
            let mut out = Vec::new();
            while let Some(r) = rows.next()? {
                let raw: String = r.get(1)?;
                let hash: Vec<u8> = r.get(3)?;
                out.push(PrunedEvent {
                    time_ns: r.get(0)?,
                    path: rows::path_of(folder, &raw)?,
                    sequence: to_u64(r.get(2)?),
                    hash: Hash(hash.as_slice().try_into().unwrap_or([0; 32])),
                    size: to_u64(r.get(4)?),
                    reason: r.get(5)?,
                });
            }
            out.reverse();
            Ok(out)
        })
    }

    /// The folder as this device's journal had it at `at_ns`: for every path (`below`: that
    /// path and everything below it) its last history row at or before then, by path. A
    /// tombstone says the path was deleted then. Rows pruned or thinned from the history are
    /// missing here too (`history_retention_days`, [`Journal::thin_history`]).
    pub fn state_at(
        &self,
        folder: &FolderId,
        below: Option<&RelPath>,
        at_ns: i64,
    ) -> Result<Vec<HistoryEntry>> {
        self.read(|c| {
            let Some(key) = self.key(c, folder)? else {
                return Ok(Vec::new());
            };
            let mut out: Vec<HistoryEntry> = Vec::new();
            let mut push = |e: HistoryEntry| match out.last_mut() {
                Some(last) if last.path == e.path => *last = e,
                _ => out.push(e),
            };
            match below {
                Some(p) => {
                    let (lo, hi) = below_bounds(p);
                    let mut st = c.prepare_cached(&format!(
                        "SELECT {HISTORY_COLUMNS} FROM history WHERE folder = ?1 \
                         AND (path = ?2 OR (path >= ?3 AND path < ?4)) AND time_ns <= ?5 \
                         ORDER BY path, sequence"
                    ))?;
                    let mut rows = st.query(params![key, p.as_str(), lo, hi, at_ns])?;
                    while let Some(r) = rows.next()? {
                        push(rows::history_entry(folder, r)?);
                    }
                }
                None => {
                    let mut st = c.prepare_cached(&format!(
                        "SELECT {HISTORY_COLUMNS} FROM history WHERE folder = ?1 \
                         AND time_ns <= ?2 ORDER BY path, sequence"
                    ))?;
                    let mut rows = st.query(params![key, at_ns])?;
                    while let Some(r) = rows.next()? {
                        push(rows::history_entry(folder, r)?);
                    }
                }
            }
            Ok(out)
        })
    }

    /// Thins the history journaled in `[from_ns, to_ns)`: of the rows of one path whose times
    /// fall in the same `bucket_ns` (counted from the epoch), a `modify`, `metadata` or
    /// `merged` row is deleted when a later row of that path is in the bucket too. Creations,
    /// deletions, renames and resolutions stay, and so does every path's newest row (the
    /// current record's), and every row whose version is still listed in `versions`: a
    /// version is thinned by when it left the tree, its row by when it was made, and a kept
    /// version must stay listed (`meshfs versions`, `restore --at`). Returns how many rows
    /// were deleted.
    pub fn thin_history(
        &mut self,
        folder: &FolderId,
        from_ns: i64,
        to_ns: i64,
        bucket_ns: i64,
    ) -> Result<u64> {
        if bucket_ns <= 0 || from_ns >= to_ns {
            return Ok(0);
        }
        self.write(|tx| {
            let Some((key, _)) = lookup_folder(tx, folder)? else {
                return Ok(0);
            };
            let n = tx.execute(
                "DELETE FROM history WHERE folder = ?1 AND time_ns >= ?2 AND time_ns < ?3 \
                 AND op IN ('modify', 'metadata', 'merged') \
                 AND EXISTS (SELECT 1 FROM history n WHERE n.folder = history.folder \
                    AND n.path = history.path AND n.sequence > history.sequence \
                    AND n.time_ns / ?4 = history.time_ns / ?4) \
                 AND NOT EXISTS (SELECT 1 FROM versions v WHERE v.folder = history.folder \
                    AND v.sequence = history.sequence)",
                params![key, from_ns, to_ns, bucket_ns],
            )?;
            Ok(n as u64)
        })
    }

    /// Forgets the prunings recorded before `before_ns`, and those whose version's history row
    /// is gone (thinned or pruned: nothing in `meshfs journal` names that version any more).
    /// A pruning is shown by `meshfs journal --all` beside the row of the version it retired,
    /// for as long as that version would have been kept. Returns how many.
    pub fn forget_pruned(&mut self, folder: &FolderId, before_ns: i64) -> Result<u64> {
        self.write(|tx| {
            let Some((key, _)) = lookup_folder(tx, folder)? else {
                return Ok(0);
            };
            let n = tx.execute(
                "DELETE FROM pruned WHERE folder = ?1 AND (time_ns < ?2 \
                 OR NOT EXISTS (SELECT 1 FROM history h WHERE h.folder = pruned.folder \
                    AND h.sequence = pruned.sequence))",
                params![key, before_ns],
            )?;
            Ok(n as u64)
        })
    }

    /// How many history rows the folder has (for `status` and measurements).
    pub fn history_count(&self, folder: &FolderId) -> Result<u64> {
        self.read(|c| {
            let Some(key) = self.key(c, folder)? else {
                return Ok(0);
            };
            let n: i64 = c
                .prepare_cached("SELECT count(*) FROM history WHERE folder = ?1")?
                .query_row([key], |r| r.get(0))?;
            Ok(to_u64(n))
        })
    }
}
