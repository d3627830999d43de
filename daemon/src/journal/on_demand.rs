//! What the journal keeps for folders on demand (docs/decisions.md, D90–D94): which files are
//! placeholders (`absent`, by inode), the pins, and the reads that weigh a folder against its
//! budget. The journal decides nothing: `crate::ondemand` does.

use super::rows::{to_i64, to_u64};
use super::{ensure_folder, lookup_folder, set_local, Change, Journal, Result};
use crate::store::LocalStat;
use meshfs_protocol::{DeviceId, FolderId, Hash, RelPath};
use rusqlite::{params, Connection};

/// What of a folder's file content is here and what is not.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Residency {
    /// Live files whose content is here (empty files included).
    pub local_files: u64,
    /// Their bytes.
    pub local_bytes: u64,
    /// Live files that are placeholders.
    pub online_files: u64,
    /// Their bytes (what the folder would take whole).
    pub online_bytes: u64,
}

/// A local file of a folder, as eviction weighs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resident {
    /// Where.
    pub path: RelPath,
    /// Its size.
    pub size: u64,
    /// Its content hash (what a placeholder of it is marked with).
    pub hash: Hash,
    /// Its permission bits and mtime (the placeholder's).
    pub mode: u32,
    /// See `mode`.
    pub mtime_ns: i64,
    /// Its local sequence (a peer that acknowledged it or more has it).
    pub sequence: u64,
    /// The peer it came from (`None`: made here).
    pub source: Option<DeviceId>,
    /// The file on disk, as the journal knows it (what an eviction expects to replace).
    pub local: LocalStat,
    /// When its version was journaled here (ns), its use time until it is opened.
    pub changed_ns: i64,
}

/// The live file records of folder `?1` that are placeholders: `NOT` it for the local ones.
const IS_ABSENT: &str =
    "EXISTS (SELECT 1 FROM absent a WHERE a.folder = r.folder AND a.inode = r.local_inode)";

/// The paths in the first column of `rows` (a row that is not a path is skipped).
fn paths(mut rows: rusqlite::Rows<'_>) -> Result<Vec<RelPath>> {
    let mut out = Vec::new();
    while let Some(r) = rows.next()? {
        let p: String = r.get(0)?;
        if let Ok(p) = RelPath::new(&p) {
            out.push(p);
        }
    }
    Ok(out)
}

fn mark(tx: &Connection, key: i64, inodes: &[u64]) -> Result<()> {
    let mut st =
        tx.prepare_cached("INSERT OR IGNORE INTO absent (folder, inode) VALUES (?1, ?2)")?;
    for i in inodes {
        st.execute(params![key, to_i64(*i)])?;
    }
    Ok(())
}

impl Journal {
    /// [`Journal::commit`] of `changes`, noting in the same transaction that the files with
    /// inodes `absent` are placeholders (installed by the same apply).
    pub fn commit_absent(
        &mut self,
        folder: &FolderId,
        changes: Vec<Change>,
        absent: &[u64],
    ) -> Result<Vec<u64>> {
        let time_ns = super::now_ns();
        self.write(|tx| {
            let (key, seqs) = super::commit_in(tx, folder, &changes, time_ns)?;
            mark(tx, key, absent)?;
            Ok(seqs)
        })
    }

    /// Notes that the files with these inodes are placeholders.
    pub fn mark_absent(&mut self, folder: &FolderId, inodes: &[u64]) -> Result<()> {
        if inodes.is_empty() {
            return Ok(());
        }
        self.write(|tx| {
            let (key, _) = ensure_folder(tx, folder)?;
            mark(tx, key, inodes)
        })
    }

    /// Notes that the files with these inodes hold their content (read as such by a scan):
    /// rows of placeholders they were are dropped (D101).
    pub fn mark_present(&mut self, folder: &FolderId, inodes: &[u64]) -> Result<()> {
        if inodes.is_empty() {
            return Ok(());
        }
        // Most folders hold no placeholder: one read, no write transaction.
        let any: bool = self.read(|c| match lookup_folder(c, folder)? {
            Some((key, _)) => super::any_absent(c, key),
            None => Ok(false),
        })?;
        if !any {
            return Ok(());
        }
        self.write(|tx| {
            let Some((key, _)) = lookup_folder(tx, folder)? else {
                return Ok(());
            };
            let mut st =
                tx.prepare_cached("DELETE FROM absent WHERE folder = ?1 AND inode = ?2")?;
            for i in inodes {
                st.execute(params![key, to_i64(*i)])?;
            }
            Ok(())
        })
    }

    /// The content of `path` is here now, in the file `local` (which replaced the placeholder
    /// with inode `was`): its record's local stat, and the placeholder's row gone, in one
    /// transaction.
    pub fn made_local(
        &mut self,
        folder: &FolderId,
        path: &RelPath,
        local: LocalStat,
        was: u64,
    ) -> Result<()> {
        self.write(|tx| {
            let Some((key, _)) = lookup_folder(tx, folder)? else {
                return Ok(());
            };
            set_local(tx, key, path, &local, false)?;
            tx.prepare_cached("DELETE FROM absent WHERE folder = ?1 AND inode = ?2")?
                .execute(params![key, to_i64(was)])?;
            Ok(())
        })
    }

    /// `path` is a placeholder now, the file `local`: its record's local stat and its row, in
    /// one transaction.
    pub fn made_absent(
        &mut self,
        folder: &FolderId,
        path: &RelPath,
        local: LocalStat,
    ) -> Result<()> {
        self.write(|tx| {
            let (key, _) = ensure_folder(tx, folder)?;
            set_local(tx, key, path, &local, false)?;
            mark(tx, key, &[local.inode])
        })
    }

    /// Drops the rows of placeholders no live file record names any more (deleted, replaced,
    /// made local behind the daemon's back); returns how many.
    pub fn prune_absent(&mut self, folder: &FolderId) -> Result<u64> {
        self.write(|tx| {
            let Some((key, _)) = lookup_folder(tx, folder)? else {
                return Ok(0);
            };
            let n = tx
                .prepare_cached(
                    // NOT IN: the list is made once (a probe per row would read every record
                    // for each placeholder: no index on local_inode).
                    "DELETE FROM absent WHERE folder = ?1 AND inode NOT IN (SELECT local_inode \
                     FROM records WHERE folder = ?1 AND kind = 'file' AND deleted = 0 \
                     AND local_inode IS NOT NULL)",
                )?
                .execute([key])?;
            tx.prepare_cached(
                "DELETE FROM used WHERE folder = ?1 AND path NOT IN (SELECT path FROM records \
                 WHERE folder = ?1 AND deleted = 0)",
            )?
            .execute([key])?;
            Ok(n as u64)
        })
    }

    /// Notes when each of `items`' paths was last used (ns since the Unix epoch).
    pub fn save_used(&mut self, folder: &FolderId, items: &[(RelPath, i64)]) -> Result<()> {
        if items.is_empty() {
            return Ok(());
        }
        self.write(|tx| {
            let (key, _) = ensure_folder(tx, folder)?;
            let mut st = tx.prepare_cached(
                "INSERT INTO used (folder, path, at_ns) VALUES (?1, ?2, ?3) \
                 ON CONFLICT (folder, path) DO UPDATE SET at_ns = max(at_ns, excluded.at_ns)",
            )?;
            for (path, at) in items {
                st.execute(params![key, path.as_str(), at])?;
            }
            Ok(())
        })
    }

    /// When each path of the folder was last used, as [`Journal::save_used`] noted it.
    pub fn used(&self, folder: &FolderId) -> Result<Vec<(RelPath, i64)>> {
        self.read(|c| {
            let Some(key) = self.key(c, folder)? else {
                return Ok(Vec::new());
            };
            let mut st = c.prepare_cached("SELECT path, at_ns FROM used WHERE folder = ?1")?;
            let mut rows = st.query([key])?;
            let mut out = Vec::new();
            while let Some(r) = rows.next()? {
                let p: String = r.get(0)?;
                if let Ok(p) = RelPath::new(&p) {
                    out.push((p, r.get(1)?));
                }
            }
            Ok(out)
        })
    }

    /// What of the folder's file content is here.
    pub fn residency(&self, folder: &FolderId) -> Result<Residency> {
        self.read(|c| {
            let Some(key) = self.key(c, folder)? else {
                return Ok(Residency::default());
            };
            let sql = format!(
                "SELECT {IS_ABSENT} AS gone, count(*), coalesce(sum(r.size), 0) FROM records r \
                 WHERE r.folder = ?1 AND r.kind = 'file' AND r.deleted = 0 GROUP BY gone"
            );
            let mut st = c.prepare_cached(&sql)?;
            let mut rows = st.query([key])?;
            let mut out = Residency::default();
            while let Some(r) = rows.next()? {
                let (gone, n, bytes): (bool, i64, i64) = (r.get(0)?, r.get(1)?, r.get(2)?);
                if gone {
                    out.online_files = to_u64(n);
                    out.online_bytes = to_u64(bytes);
                } else {
                    out.local_files = to_u64(n);
                    out.local_bytes = to_u64(bytes);
                }
            }
            Ok(out)
        })
    }

    /// The folder's local, non-empty files, in no particular order.
    pub fn residents(&self, folder: &FolderId) -> Result<Vec<Resident>> {
        self.read(|c| {
            let Some(key) = self.key(c, folder)? else {
                return Ok(Vec::new());
            };
            let sql = format!(
                "SELECT r.path, r.size, r.hash, r.mode, r.mtime_ns, r.sequence, r.source, \
                 r.local_inode, r.local_size, r.local_mtime_ns, r.local_ctime_ns, r.local_mode, \
                 r.changed_at FROM records r WHERE r.folder = ?1 AND r.kind = 'file' \
                 AND r.deleted = 0 AND r.size > 0 AND r.local_inode IS NOT NULL AND NOT {IS_ABSENT}"
            );
            let mut st = c.prepare_cached(&sql)?;
            let mut rows = st.query([key])?;
            let mut out = Vec::new();
            while let Some(r) = rows.next()? {
                let path: String = r.get(0)?;
                let Ok(path) = RelPath::new(&path) else {
                    continue;
                };
                let hash: Vec<u8> = r.get(2)?;
                let Ok(hash) = <[u8; 32]>::try_from(hash.as_slice()) else {
                    continue;
                };
                let source: Option<Vec<u8>> = r.get(6)?;
                let source = source
                    .and_then(|b| <[u8; 32]>::try_from(b.as_slice()).ok())
                    .map(DeviceId::from_bytes);
                let opt =
                    |i: usize| -> Result<i64> { Ok(r.get::<_, Option<i64>>(i)?.unwrap_or(0)) };
                out.push(Resident {
                    path,
                    size: to_u64(r.get(1)?),
                    hash: Hash(hash),
                    mode: r.get(3)?,
                    mtime_ns: r.get(4)?,
                    sequence: to_u64(r.get(5)?),
                    source,
                    local: LocalStat {
                        inode: to_u64(opt(7)?),
                        size: to_u64(opt(8)?),
                        mtime_ns: opt(9)?,
                        ctime_ns: opt(10)?,
                        mode: opt(11)? as u32,
                    },
                    changed_ns: r.get(12)?,
                });
            }
            Ok(out)
        })
    }

    /// The live files that are placeholders, `scope` itself or below it (the whole folder when
    /// `None`), by path.
    pub fn online(&self, folder: &FolderId, scope: Option<&RelPath>) -> Result<Vec<RelPath>> {
        self.read(|c| {
            let Some(key) = self.key(c, folder)? else {
                return Ok(Vec::new());
            };
            let (lo, hi) = match scope {
                Some(s) => (format!("{}/", s.as_str()), format!("{}0", s.as_str())),
                None => (String::new(), String::from("\u{10FFFF}")),
            };
            let exact = scope.map(|s| s.as_str().to_string()).unwrap_or_default();
            let sql = format!(
                "SELECT r.path FROM records r WHERE r.folder = ?1 AND r.kind = 'file' \
                 AND r.deleted = 0 AND {IS_ABSENT} \
                 AND ((r.path >= ?2 AND r.path < ?3) OR r.path = ?4) ORDER BY r.path"
            );
            let mut st = c.prepare_cached(&sql)?;
            let rows = st.query(params![key, lo, hi, exact])?;
            paths(rows)
        })
    }

    /// The folder's pins, by path.
    pub fn pins(&self, folder: &FolderId) -> Result<Vec<RelPath>> {
        self.read(|c| {
            let Some(key) = self.key(c, folder)? else {
                return Ok(Vec::new());
            };
            let mut st =
                c.prepare_cached("SELECT path FROM pins WHERE folder = ?1 ORDER BY path")?;
            let rows = st.query([key])?;
            paths(rows)
        })
    }

    /// Pins `path` (kept if it was pinned already).
    pub fn pin(&mut self, folder: &FolderId, path: &RelPath) -> Result<()> {
        self.write(|tx| {
            let (key, _) = ensure_folder(tx, folder)?;
            tx.prepare_cached("INSERT OR IGNORE INTO pins (folder, path) VALUES (?1, ?2)")?
                .execute(params![key, path.as_str()])?;
            Ok(())
        })
    }

    /// Drops the pin of `path`; whether there was one.
    pub fn unpin(&mut self, folder: &FolderId, path: &RelPath) -> Result<bool> {
        self.write(|tx| {
            let Some((key, _)) = lookup_folder(tx, folder)? else {
                return Ok(false);
            };
            let n = tx
                .prepare_cached("DELETE FROM pins WHERE folder = ?1 AND path = ?2")?
                .execute(params![key, path.as_str()])?;
            Ok(n > 0)
        })
    }
}
