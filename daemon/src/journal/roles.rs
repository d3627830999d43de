//! What a folder's role keeps aside: a send-only folder's remote versions received and not
//! applied (`held`), a receive-only folder's local changes not sent (`local_only`). The journal
//! stores them; `crate::roles` and `crate::apply` decide what goes in.

use super::rows::{encode, to_u64};
use super::{device_blob, lookup_folder, now_ns, Journal, JournalError, Result};
use meshfs_protocol::{DeviceId, FileRecord, FolderId, RelPath};
use rusqlite::params;

/// Decodes a record stored as a postcard blob, checking it names `path` and is valid.
fn record_of(folder: &FolderId, path: &str, blob: &[u8]) -> Result<FileRecord> {
    let corrupt = |what: String| JournalError::Corrupt {
        what: format!("folder {folder}, path {path:?}: {what}"),
    };
    let record: FileRecord = match postcard::take_from_bytes::<FileRecord>(blob) {
        Ok((r, [])) => r,
        Ok(_) => return Err(corrupt("trailing bytes after a stored record".into())),
        Err(e) => return Err(corrupt(format!("stored record: {e}"))),
    };
    if record.path.as_str() != path {
        return Err(corrupt(format!("stored record names {}", record.path)));
    }
    record.validate().map_err(|e| corrupt(e.to_string()))?;
    Ok(record)
}

fn device_of(folder: &FolderId, path: &str, blob: Option<Vec<u8>>) -> Result<Option<DeviceId>> {
    match blob {
        None => Ok(None),
        Some(b) => {
            let arr: [u8; 32] = b.as_slice().try_into().map_err(|_| JournalError::Corrupt {
                what: format!(
                    "folder {folder}, path {path:?}: a device id of {} bytes",
                    b.len()
                ),
            })?;
            Ok(Some(DeviceId::from_bytes(arr)))
        }
    }
}

impl Journal {
    /// Keeps `record` from `source` as a send-only folder's remote version not applied here
    /// (replacing the one kept at its path).
    pub fn put_held(
        &mut self,
        folder: &FolderId,
        record: &FileRecord,
        source: &DeviceId,
    ) -> Result<()> {
        let blob = encode(record, "held record")?;
        self.write(|tx| {
            let (key, _) = super::ensure_folder(tx, folder)?;
            tx.prepare_cached(
                "INSERT OR REPLACE INTO held (folder, path, record, source, time_ns) \
                 VALUES (?1, ?2, ?3, ?4, ?5)",
            )?
            .execute(params![
                key,
                record.path.as_str(),
                blob,
                &source.as_bytes()[..],
                now_ns()
            ])?;
            Ok(())
        })
    }

    /// A send-only folder's remote versions not applied here, by path.
    pub fn held(&self, folder: &FolderId) -> Result<Vec<(FileRecord, DeviceId)>> {
        self.read(|c| {
            let Some(key) = self.key(c, folder)? else {
                return Ok(Vec::new());
            };
            let mut st = c.prepare_cached(
                "SELECT path, record, source FROM held WHERE folder = ?1 ORDER BY path",
            )?;
            let mut rows = st.query([key])?;
            let mut out = Vec::new();
            while let Some(r) = rows.next()? {
                let path: String = r.get(0)?;
                let record = record_of(folder, &path, &r.get::<_, Vec<u8>>(1)?)?;
                let Some(source) = device_of(folder, &path, r.get(2)?)? else {
                    continue;
                };
                out.push((record, source));
            }
            Ok(out)
        })
    }

    /// How many remote versions a send-only folder holds unapplied.
    pub fn held_count(&self, folder: &FolderId) -> Result<u64> {
        self.count_of(folder, "SELECT count(*) FROM held WHERE folder = ?1")
    }

    /// Forgets the held remote versions of `paths`.
    pub fn clear_held(&mut self, folder: &FolderId, paths: &[RelPath]) -> Result<()> {
        self.clear_paths(
            folder,
            "DELETE FROM held WHERE folder = ?1 AND path = ?2",
            paths,
        )
    }

    /// Notes that each path of `items` of a receive-only folder is about to change here (a
    /// local change, not sent), with the shared record it holds now and the peer that came
    /// from, in one transaction. The first note of a path stays until
    /// [`Journal::clear_local_only`]: the shared state is what the path had before its first
    /// local change.
    #[allow(clippy::type_complexity)]
    pub fn note_local_only(
        &mut self,
        folder: &FolderId,
        items: &[(RelPath, Option<(FileRecord, Option<DeviceId>)>)],
    ) -> Result<()> {
        if items.is_empty() {
            return Ok(());
        }
        let encoded = items
            .iter()
            .map(|(p, shared)| {
                let blob = shared
                    .as_ref()
                    .map(|(r, _)| encode(r, "shared record"))
                    .transpose()?;
                Ok((p, blob, shared.as_ref().and_then(|(_, s)| *s)))
            })
            .collect::<Result<Vec<_>>>()?;
        let now = now_ns();
        self.write(|tx| {
            let (key, _) = super::ensure_folder(tx, folder)?;
            let mut st = tx.prepare_cached(
                "INSERT OR IGNORE INTO local_only (folder, path, shared, source, time_ns) \
                 VALUES (?1, ?2, ?3, ?4, ?5)",
            )?;
            for (path, blob, source) in &encoded {
                st.execute(params![key, path.as_str(), blob, device_blob(source), now])?;
            }
            Ok(())
        })
    }

    /// A receive-only folder's paths changed here and not sent, each with the shared record it
    /// had before (and the peer that record came from), by path.
    #[allow(clippy::type_complexity)]
    pub fn local_only(
        &self,
        folder: &FolderId,
    ) -> Result<Vec<(RelPath, Option<(FileRecord, Option<DeviceId>)>)>> {
        self.read(|c| {
            let Some(key) = self.key(c, folder)? else {
                return Ok(Vec::new());
            };
            let mut st = c.prepare_cached(
                "SELECT path, shared, source FROM local_only WHERE folder = ?1 ORDER BY path",
            )?;
            let mut rows = st.query([key])?;
            let mut out = Vec::new();
            while let Some(r) = rows.next()? {
                let raw: String = r.get(0)?;
                let path = super::rows::path_of(folder, &raw)?;
                let shared = match r.get::<_, Option<Vec<u8>>>(1)? {
                    Some(b) => Some((
                        record_of(folder, &raw, &b)?,
                        device_of(folder, &raw, r.get(2)?)?,
                    )),
                    None => None,
                };
                out.push((path, shared));
            }
            Ok(out)
        })
    }

    /// How many paths of a receive-only folder are changed here and not sent.
    pub fn local_only_count(&self, folder: &FolderId) -> Result<u64> {
        self.count_of(folder, "SELECT count(*) FROM local_only WHERE folder = ?1")
    }

    /// `path`'s local change is no longer apart from the shared state (reverted, or a shared
    /// version replaced it).
    pub fn clear_local_only(&mut self, folder: &FolderId, paths: &[RelPath]) -> Result<()> {
        self.clear_paths(
            folder,
            "DELETE FROM local_only WHERE folder = ?1 AND path = ?2",
            paths,
        )
    }

    fn count_of(&self, folder: &FolderId, sql: &str) -> Result<u64> {
        self.read(|c| {
            let Some(key) = self.key(c, folder)? else {
                return Ok(0);
            };
            let n: i64 = c.prepare_cached(sql)?.query_row([key], |r| r.get(0))?;
            Ok(to_u64(n))
        })
    }

    fn clear_paths(&mut self, folder: &FolderId, sql: &str, paths: &[RelPath]) -> Result<()> {
        if paths.is_empty() {
            return Ok(());
        }
        self.write(|tx| {
            let Some((key, _)) = lookup_folder(tx, folder)? else {
                return Ok(());
            };
            let mut st = tx.prepare_cached(sql)?;
            for p in paths {
                st.execute(params![key, p.as_str()])?;
            }
            Ok(())
        })
    }
}
