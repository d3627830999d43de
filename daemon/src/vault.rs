//! The vault: the chunks of past versions that nothing else on this device holds, one SQLite
//! database per folder (`STATE/versions/FOLDER-ID.db`, docs/decisions.md D43).
//!
//! **What it owns.** Chunks by hash: each stored once (a version kept is only the chunks it does
//! not share with the live tree or another kept version; a folder no peer shares also holds its
//! own recent files' chunks ahead, D68), zstd-compressed where that saves an
//! eighth, verified by blake3 before it is written and again whenever it is read back. A chunk
//! is in the vault entirely or not at all: every write is one SQLite transaction (WAL), so a
//! crash (SIGKILL at any instant) leaves each chunk either durable and whole or absent, never
//! half of one, and never a half-written file in the folder (the vault is outside it).
//!
//! **What it never does.** It decides nothing: which versions exist and which chunks they
//! need is the journal's (`versions` rows), which to prune the retention policy's
//! (`crate::versions`). It never touches a replica directory, and nothing in it is synced as
//! content: a peer gets a kept chunk only by asking for its hash (`crate::chunks`).
//!
//! Space: the database is created with `auto_vacuum = INCREMENTAL`, so the pages a sweep frees
//! go back to the filesystem ([`Vault::sweep`]); [`Vault::stored_bytes`] is what the chunks take
//! as stored, the figure retention holds to its budget.

use meshfs_protocol::Hash;
use rusqlite::{params, Connection, OpenFlags, OptionalExtension, TransactionBehavior};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

/// `PRAGMA application_id` of a vault: "mshv".
const APPLICATION_ID: i32 = 0x6D73_6876;
/// How long a statement waits for another connection's lock.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);
/// Chunks stored per transaction at most (a version's missing chunks come in batches).
const PUT_BATCH: usize = 256;

const SCHEMA: &str = r#"
    CREATE TABLE chunks (
        id     INTEGER PRIMARY KEY,
        hash   BLOB NOT NULL UNIQUE,
        len    INTEGER NOT NULL,
        zstd   INTEGER NOT NULL,
        stored INTEGER NOT NULL,
        data   BLOB NOT NULL
    ) STRICT;
    "#;

/// Why a vault operation failed.
#[derive(Debug, thiserror::Error)]
pub enum VaultError {
    /// SQLite failed.
    #[error("the version vault {}: {source}", path.display())]
    Sqlite {
        /// The database file.
        path: PathBuf,
        /// What SQLite said.
        source: rusqlite::Error,
    },
    /// The file is not a vault.
    #[error("{} is not a meshfs version vault; move it aside (the versions it kept are lost, the folder is not touched)", .0.display())]
    NotAVault(PathBuf),
    /// A stored chunk does not decode or does not hash to its key.
    #[error("the version vault {}: chunk {hash} is damaged ({what}); it is not used", path.display())]
    Damaged {
        /// The database file.
        path: PathBuf,
        /// The chunk.
        hash: String,
        /// What is wrong.
        what: String,
    },
}

/// Result of vault operations.
pub type Result<T> = std::result::Result<T, VaultError>;

/// One folder's vault.
pub struct Vault {
    conn: Mutex<Connection>,
    path: PathBuf,
    /// Held by whoever decides which chunks to add ([`Vault::has`] then [`Vault::put`]) and by
    /// retention from reading the journal's versions to its sweep, so a sweep never drops a
    /// chunk added for a version it did not see ([`Vault::gate`]).
    gate: Mutex<()>,
    /// What the chunks take as stored, kept up to date by this handle's writes (`status`
    /// reads it every few milliseconds while it waits for sync).
    bytes: std::sync::atomic::AtomicU64,
    /// The space retention last allowed the folder's versions (0: not known yet).
    budget: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for Vault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vault").field("path", &self.path).finish()
    }
}

impl Vault {
    /// Opens the vault at `path`, creating it (and its directory, owner-only) if missing.
    pub fn open(path: &Path) -> Result<Vault> {
        let err = |source| VaultError::Sqlite {
            path: path.to_path_buf(),
            source,
        };
        if let Some(dir) = path.parent() {
            let _ = std::fs::create_dir_all(dir);
            use std::os::unix::fs::PermissionsExt;
            let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700));
        }
        let conn = Connection::open(path).map_err(err)?;
        {
            use std::os::unix::fs::PermissionsExt;
            let _ = std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600));
        }
        conn.busy_timeout(BUSY_TIMEOUT).map_err(err)?;
        let app: i32 = conn
            .pragma_query_value(None, "application_id", |r| r.get(0))
            .map_err(err)?;
        let tables: i64 = conn
            .query_row(
                "SELECT count(*) FROM sqlite_schema WHERE type = 'table'",
                [],
                |r| r.get(0),
            )
            .map_err(err)?;
        if app != APPLICATION_ID && (app != 0 || tables != 0) {
            return Err(VaultError::NotAVault(path.to_path_buf()));
        }
        if tables == 0 {
            // Before any table: auto_vacuum can only be chosen in an empty database.
            conn.pragma_update(None, "auto_vacuum", "INCREMENTAL")
                .map_err(err)?;
        }
        conn.pragma_update(None, "journal_mode", "wal")
            .map_err(err)?;
        conn.pragma_update(None, "synchronous", "NORMAL")
            .map_err(err)?;
        conn.pragma_update(None, "journal_size_limit", 16i64 << 20)
            .map_err(err)?;
        if tables == 0 {
            let tx = conn.unchecked_transaction().map_err(err)?;
            tx.execute_batch(SCHEMA).map_err(err)?;
            tx.pragma_update(None, "application_id", APPLICATION_ID)
                .map_err(err)?;
            tx.commit().map_err(err)?;
        }
        let v = Vault {
            conn: Mutex::new(conn),
            path: path.to_path_buf(),
            gate: Mutex::new(()),
            bytes: Default::default(),
            budget: Default::default(),
        };
        let (_, bytes) = v.stored()?;
        v.bytes.store(bytes, std::sync::atomic::Ordering::Relaxed);
        Ok(v)
    }

    /// Opens an existing vault read-only (`meshfs versions` and `journal` beside a running
    /// daemon); `None` when the folder never kept anything.
    pub fn open_read_only(path: &Path) -> Result<Option<Vault>> {
        if !path.exists() {
            return Ok(None);
        }
        let conn = Connection::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(|source| VaultError::Sqlite {
            path: path.to_path_buf(),
            source,
        })?;
        let _ = conn.busy_timeout(BUSY_TIMEOUT);
        let v = Vault {
            conn: Mutex::new(conn),
            path: path.to_path_buf(),
            gate: Mutex::new(()),
            bytes: Default::default(),
            budget: Default::default(),
        };
        let (_, bytes) = v.stored()?;
        v.bytes.store(bytes, std::sync::atomic::Ordering::Relaxed);
        Ok(Some(v))
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The vault's gate: held across a decision about which chunks to add and the adding
    /// (the keeper), and across retention's reading of the journal and its sweep. Never held
    /// while waiting for the journal's lock the other way round: the keeper reads the journal
    /// before it takes the gate.
    pub fn gate(&self) -> std::sync::MutexGuard<'_, ()> {
        self.gate.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn err(&self, source: rusqlite::Error) -> VaultError {
        VaultError::Sqlite {
            path: self.path.clone(),
            source,
        }
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Which of `hashes` the vault holds, in order.
    pub fn has(&self, hashes: &[Hash]) -> Result<Vec<bool>> {
        let c = self.conn();
        let mut st = c
            .prepare_cached("SELECT 1 FROM chunks WHERE hash = ?1")
            .map_err(|e| self.err(e))?;
        hashes
            .iter()
            .map(|h| {
                st.query_row([&h.0[..]], |_| Ok(()))
                    .optional()
                    .map(|o| o.is_some())
                    .map_err(|e| self.err(e))
            })
            .collect()
    }

    /// The chunk `hash`, decompressed and verified; `None` if the vault does not hold it.
    pub fn get(&self, hash: &Hash) -> Result<Option<Vec<u8>>> {
        let row: Option<(i64, bool, Vec<u8>)> = self
            .conn()
            .prepare_cached("SELECT len, zstd, data FROM chunks WHERE hash = ?1")
            .and_then(|mut st| {
                st.query_row([&hash.0[..]], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
                    .optional()
            })
            .map_err(|e| self.err(e))?;
        let Some((len, packed, data)) = row else {
            return Ok(None);
        };
        let damaged = |what: String| VaultError::Damaged {
            path: self.path.clone(),
            hash: hash.to_string(),
            what,
        };
        let data = if packed {
            zstd::bulk::decompress(&data, len.max(0) as usize)
                .map_err(|e| damaged(format!("bad zstd: {e}")))?
        } else {
            data
        };
        // Paired with the check before the write: what is read back is what was verified.
        if data.len() as i64 != len || &Hash::of(&data) != hash {
            return Err(damaged("content does not match its hash".into()));
        }
        Ok(Some(data))
    }

    /// Stores `chunks` (hash, content) the vault does not hold yet, each checked against its
    /// hash first (a chunk that does not match is refused, and nothing of its batch is
    /// written). Durable and whole when it returns: one transaction per [`PUT_BATCH`] chunks.
    /// Returns the bytes added as stored.
    pub fn put(&self, chunks: &[(Hash, Vec<u8>)]) -> Result<u64> {
        let mut added = 0;
        for batch in chunks.chunks(PUT_BATCH) {
            for (hash, data) in batch {
                if &Hash::of(data) != hash {
                    return Err(VaultError::Damaged {
                        path: self.path.clone(),
                        hash: hash.to_string(),
                        what: "refused before storing: content does not match its hash".into(),
                    });
                }
            }
            let packed: Vec<(&Hash, usize, Option<Vec<u8>>)> = batch
                .iter()
                .map(|(h, d)| (h, d.len(), compress(d)))
                .collect();
            let mut c = self.conn();
            let tx = c
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .map_err(|e| self.err(e))?;
            {
                let mut st = tx
                    .prepare_cached(
                        "INSERT OR IGNORE INTO chunks (hash, len, zstd, stored, data) \
                         VALUES (?1, ?2, ?3, ?4, ?5)",
                    )
                    .map_err(|e| self.err(e))?;
                for ((hash, len, packed), (_, raw)) in packed.iter().zip(batch) {
                    let (zstd, data): (bool, &[u8]) = match packed {
                        Some(p) => (true, p),
                        None => (false, raw),
                    };
                    let n = st
                        .execute(params![
                            &hash.0[..],
                            *len as i64,
                            zstd,
                            data.len() as i64,
                            data
                        ])
                        .map_err(|e| self.err(e))?;
                    if n > 0 {
                        added += data.len() as u64;
                    }
                }
            }
            crate::failpoint::hit("vault.before_commit", "");
            tx.commit().map_err(|e| self.err(e))?;
        }
        self.bytes
            .fetch_add(added, std::sync::atomic::Ordering::Relaxed);
        Ok(added)
    }

    /// How many chunks the vault holds, and their bytes as stored.
    pub fn stored(&self) -> Result<(u64, u64)> {
        self.conn()
            .query_row(
                "SELECT count(*), coalesce(sum(stored), 0) FROM chunks",
                [],
                |r| Ok((r.get::<_, i64>(0)? as u64, r.get::<_, i64>(1)? as u64)),
            )
            .map_err(|e| self.err(e))
    }

    /// Notes the space retention allows the folder's versions now.
    pub fn set_budget(&self, bytes: u64) {
        self.budget
            .store(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    /// The space retention last allowed (0: it has not run yet).
    pub fn budget(&self) -> u64 {
        self.budget.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The chunks' bytes as stored ([`Vault::stored`]), as this handle last counted them.
    pub fn stored_bytes(&self) -> u64 {
        self.bytes.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Every chunk the vault holds, with its bytes as stored.
    pub fn chunk_sizes(&self) -> Result<Vec<(Hash, u64)>> {
        let c = self.conn();
        let mut st = c
            .prepare_cached("SELECT hash, stored FROM chunks")
            .map_err(|e| self.err(e))?;
        let mut rows = st.query([]).map_err(|e| self.err(e))?;
        let mut out = Vec::new();
        while let Some(r) = rows.next().map_err(|e| self.err(e))? {
            let h: Vec<u8> = r.get(0).map_err(|e| self.err(e))?;
            let stored: i64 = r.get(1).map_err(|e| self.err(e))?;
            if let Ok(arr) = <[u8; 32]>::try_from(h.as_slice()) {
                out.push((Hash(arr), stored.max(0) as u64));
            }
        }
        Ok(out)
    }

    /// Deletes every chunk `keep` says no to, in one transaction, then gives the freed pages
    /// back to the filesystem. Returns the chunks deleted and their bytes as stored.
    pub fn sweep(&self, keep: impl Fn(&Hash) -> bool) -> Result<(u64, u64)> {
        let gone: Vec<(Hash, u64)> = self
            .chunk_sizes()?
            .into_iter()
            .filter(|(h, _)| !keep(h))
            .collect();
        if gone.is_empty() {
            return Ok((0, 0));
        }
        let bytes = gone.iter().map(|(_, b)| b).sum();
        {
            let mut c = self.conn();
            let tx = c
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .map_err(|e| self.err(e))?;
            {
                let mut st = tx
                    .prepare_cached("DELETE FROM chunks WHERE hash = ?1")
                    .map_err(|e| self.err(e))?;
                for (h, _) in &gone {
                    st.execute([&h.0[..]]).map_err(|e| self.err(e))?;
                }
            }
            crate::failpoint::hit("vault.sweep_before_commit", "");
            tx.commit().map_err(|e| self.err(e))?;
            let _ = self.bytes.fetch_update(
                std::sync::atomic::Ordering::Relaxed,
                std::sync::atomic::Ordering::Relaxed,
                |b| Some(b.saturating_sub(bytes)),
            );
            // The pages freed go back to the filesystem (best effort: the next sweep tries
            // again), and the log with them.
            // The pragma frees one page per step: every step is taken.
            let _ = c.prepare("PRAGMA incremental_vacuum").and_then(|mut st| {
                let mut rows = st.raw_query();
                while rows.next()?.is_some() {}
                Ok(())
            });
            let _ = c.execute_batch("PRAGMA wal_checkpoint(TRUNCATE)");
        }
        Ok((gone.len() as u64, bytes))
    }

    /// The database's size on disk: the file and its write-ahead log.
    pub fn disk_bytes(&self) -> u64 {
        let wal = PathBuf::from(format!("{}-wal", self.path.display()));
        [&self.path, &wal]
            .iter()
            .filter_map(|p| std::fs::metadata(p).ok())
            .map(|m| m.len())
            .sum()
    }
}

/// zstd when it saves at least an eighth; `None` otherwise.
fn compress(data: &[u8]) -> Option<Vec<u8>> {
    if data.len() < 512 {
        return None;
    }
    let c = zstd::bulk::compress(data, 3).ok()?;
    (c.len() + data.len() / 8 <= data.len()).then_some(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn noise(n: usize, seed: u8) -> Vec<u8> {
        let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ seed as u64;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    #[test]
    fn a_chunk_is_stored_once_read_back_verified_and_swept_when_not_kept() {
        let dir = tempfile::tempdir().unwrap();
        let v = Vault::open(&dir.path().join("versions/work.db")).unwrap();
        let text = b"meshfs keeps what left the tree. ".repeat(200);
        let random = noise(100_000, 1);
        let (ht, hr) = (Hash::of(&text), Hash::of(&random));
        let added = v
            .put(&[(ht, text.clone()), (hr, random.clone()), (ht, text.clone())])
            .unwrap();
        assert!(
            added < (text.len() + random.len()) as u64,
            "text compressed"
        );
        assert_eq!(v.put(&[(ht, text.clone())]).unwrap(), 0, "stored once");
        assert_eq!(v.get(&ht).unwrap().unwrap(), text);
        assert_eq!(v.get(&hr).unwrap().unwrap(), random);
        assert_eq!(
            v.has(&[ht, Hash::of(b"x"), hr]).unwrap(),
            [true, false, true]
        );
        assert_eq!(v.stored().unwrap().0, 2);
        let (n, _) = v.sweep(|h| *h == ht).unwrap();
        assert_eq!(n, 1);
        assert!(v.get(&hr).unwrap().is_none());
        assert_eq!(v.get(&ht).unwrap().unwrap(), text);
    }

    #[test]
    fn a_chunk_that_does_not_match_its_hash_is_refused_with_its_whole_batch() {
        let dir = tempfile::tempdir().unwrap();
        let v = Vault::open(&dir.path().join("v.db")).unwrap();
        let good = b"good".to_vec();
        let r = v.put(&[
            (Hash::of(&good), good.clone()),
            (Hash::of(b"a"), b"b".to_vec()),
        ]);
        assert!(matches!(r, Err(VaultError::Damaged { .. })), "{r:?}");
        assert!(v.get(&Hash::of(&good)).unwrap().is_none());
    }

    #[test]
    fn a_damaged_chunk_is_never_returned() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v.db");
        let v = Vault::open(&path).unwrap();
        let data = noise(4096, 2);
        let h = Hash::of(&data);
        v.put(&[(h, data)]).unwrap();
        v.conn()
            .execute("UPDATE chunks SET data = zeroblob(4096)", [])
            .unwrap();
        assert!(matches!(v.get(&h), Err(VaultError::Damaged { .. })));
    }

    #[test]
    fn swept_pages_go_back_to_the_filesystem() {
        let dir = tempfile::tempdir().unwrap();
        let v = Vault::open(&dir.path().join("v.db")).unwrap();
        let chunks: Vec<(Hash, Vec<u8>)> = (0..64)
            .map(|i| {
                let d = noise(64 << 10, i);
                (Hash::of(&d), d)
            })
            .collect();
        v.put(&chunks).unwrap();
        let full = v.disk_bytes();
        assert!(full > 4 << 20, "{full}");
        v.sweep(|_| false).unwrap();
        assert!(v.disk_bytes() < full / 4, "{} of {full}", v.disk_bytes());
    }

    #[test]
    fn a_database_of_another_program_is_not_taken_for_a_vault() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("other.db");
        Connection::open(&path)
            .unwrap()
            .execute_batch("CREATE TABLE t (x)")
            .unwrap();
        assert!(matches!(Vault::open(&path), Err(VaultError::NotAVault(_))));
    }
}
