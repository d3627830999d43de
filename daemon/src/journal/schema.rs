//! The journal's schema: numbered migrations, and the checks that a file is a meshfs journal.
//!
//! The schema version lives in `PRAGMA user_version`; `PRAGMA application_id` marks the file as
//! meshfs's. Migration `n` (1-based) turns version `n - 1` into version `n` and runs in one
//! transaction together with the version bump, so a crash mid-migration leaves the previous
//! version intact. Migrations are only ever appended: an existing one is never edited.

use super::{JournalError, Result};
use meshfs_protocol::{Chunk, Hash};
use rusqlite::{Connection, Transaction, TransactionBehavior};
use std::path::Path;

/// `PRAGMA application_id` of a meshfs journal: "mshf".
pub(super) const APPLICATION_ID: i32 = 0x6D73_6866;

/// One migration: SQL, or a step that needs code.
enum Migration {
    Sql(&'static str),
    Code(fn(&Transaction) -> Result<()>),
}

/// Every migration, in order; `MIGRATIONS[n - 1]` produces schema version `n`.
///
/// Integers are SQLite's signed 64 bits; u64 values are stored bit-cast (see the module
/// documentation of `journal`). Tables are STRICT so a value of the wrong type is refused
/// when written instead of discovered when read.
const MIGRATIONS: &[Migration] = &[
    Migration::Sql(SCHEMA_1),
    Migration::Sql(CONFLICT_INDEX_2),
    Migration::Code(file_hash_from_chunks_3),
    Migration::Sql(DEFERRED_4),
    Migration::Sql(WAL_MARK_5),
    Migration::Sql(VERSIONS_6),
    Migration::Sql(ON_DEMAND_7),
    Migration::Sql(USED_8),
];

const SCHEMA_1: &str =
    // 1: folders, current records, history, peers, chunk index, pending bracket.
    r#"
    CREATE TABLE folders (
        id           INTEGER PRIMARY KEY,
        name         TEXT NOT NULL UNIQUE,
        index_id     INTEGER NOT NULL,
        max_sequence INTEGER NOT NULL,
        -- FolderCounts, kept by every commit so that status reads one row
        files        INTEGER NOT NULL DEFAULT 0,
        dirs         INTEGER NOT NULL DEFAULT 0,
        symlinks     INTEGER NOT NULL DEFAULT 0,
        bytes        INTEGER NOT NULL DEFAULT 0,
        tombstones   INTEGER NOT NULL DEFAULT 0
    ) STRICT;

    CREATE TABLE records (
        id             INTEGER PRIMARY KEY,
        folder         INTEGER NOT NULL,
        path           TEXT NOT NULL,
        kind           TEXT NOT NULL,
        deleted        INTEGER NOT NULL,
        mode           INTEGER NOT NULL,
        mtime_ns       INTEGER NOT NULL,
        size           INTEGER NOT NULL,
        hash           BLOB NOT NULL,
        chunks         BLOB NOT NULL,
        target         TEXT NOT NULL,
        version        BLOB NOT NULL,
        modified_by    INTEGER NOT NULL,
        sequence       INTEGER NOT NULL,
        local_inode    INTEGER,
        local_size     INTEGER,
        local_mtime_ns INTEGER,
        local_ctime_ns INTEGER,
        local_mode     INTEGER,
        source         BLOB,
        changed_at     INTEGER NOT NULL,
        UNIQUE (folder, path)
    ) STRICT;
    CREATE UNIQUE INDEX records_by_sequence ON records (folder, sequence);

    CREATE TABLE history (
        folder      INTEGER NOT NULL,
        sequence    INTEGER NOT NULL,
        time_ns     INTEGER NOT NULL,
        path        TEXT NOT NULL,
        op          TEXT NOT NULL,
        kind        TEXT NOT NULL,
        deleted     INTEGER NOT NULL,
        modified_by INTEGER NOT NULL,
        source      BLOB,
        version     BLOB NOT NULL,
        hash        BLOB NOT NULL,
        size        INTEGER NOT NULL,
        mode        INTEGER NOT NULL,
        detail      TEXT,
        PRIMARY KEY (folder, sequence)
    ) STRICT, WITHOUT ROWID;
    CREATE INDEX history_by_path ON history (folder, path, sequence);
    CREATE INDEX history_by_time ON history (folder, time_ns);

    CREATE TABLE peers (
        folder         INTEGER NOT NULL,
        peer           BLOB NOT NULL,
        their_index_id INTEGER NOT NULL,
        their_sequence INTEGER NOT NULL,
        our_acked      INTEGER NOT NULL,
        PRIMARY KEY (folder, peer)
    ) STRICT, WITHOUT ROWID;
    CREATE INDEX peers_by_peer ON peers (peer);

    -- hash_key is the first 8 bytes of hash (big-endian, bit-cast): chunk hashes are random,
    -- so every insert lands on a random leaf of the hash index, and a key of 8 bytes instead
    -- of 32 keeps that index small enough to stay in the page cache.
    CREATE TABLE chunks (
        record      INTEGER NOT NULL,
        file_offset INTEGER NOT NULL,
        len         INTEGER NOT NULL,
        hash_key    INTEGER NOT NULL,
        hash        BLOB NOT NULL,
        folder      INTEGER NOT NULL,
        PRIMARY KEY (record, file_offset)
    ) STRICT, WITHOUT ROWID;
    CREATE INDEX chunks_by_hash ON chunks (hash_key);

    CREATE TABLE pending (
        folder INTEGER NOT NULL,
        path   TEXT NOT NULL,
        record BLOB NOT NULL,
        source BLOB,
        PRIMARY KEY (folder, path)
    ) STRICT;
    "#;

// 2: the live conflict siblings, for `status` (polled every 10–25 ms by `--wait-synced`):
// a partial index holds only them, so counting them does not read the whole folder.
// The expression must stay identical to `Journal::conflict_records`' WHERE clause.
const CONFLICT_INDEX_2: &str = r#"
    CREATE INDEX records_conflicts ON records (folder, path)
        WHERE deleted = 0 AND instr(path, '.sync-conflict-') > 0;
    "#;

/// 3: protocol 4 defines a file's hash by its chunk list (`Hash::of_chunks`) instead of
/// blake3 of the whole content. The two agree for files of zero or one chunk; a live file
/// of several chunks gets the new hash, in its record and in the history entry of the same
/// version (older history keeps the hashes it was written with). Every device rewrites the
/// same versions to the same hashes, so peers keep agreeing on what they hold. Pending rows
/// (remote versions not yet acknowledged) are left: their hashes no longer match, so they are
/// dropped at start-up and the peer sends them again.
fn file_hash_from_chunks_3(tx: &Transaction) -> Result<()> {
    let mut read = tx.prepare(
        "SELECT id, folder, sequence, chunks FROM records \
         WHERE kind = 'file' AND deleted = 0 AND size > 0",
    )?;
    let mut changed: Vec<(i64, i64, i64, Hash)> = Vec::new();
    let mut rows = read.query([])?;
    while let Some(row) = rows.next()? {
        let id: i64 = row.get(0)?;
        let blob: Vec<u8> = row.get(3)?;
        let chunks: Vec<Chunk> =
            postcard::from_bytes(&blob).map_err(|e| JournalError::Corrupt {
                what: format!("record {id}: chunk list: {e}"),
            })?;
        if chunks.len() > 1 {
            changed.push((id, row.get(1)?, row.get(2)?, Hash::of_chunks(&chunks)));
        }
    }
    drop(rows);
    let mut record = tx.prepare("UPDATE records SET hash = ?2 WHERE id = ?1")?;
    let mut history =
        tx.prepare("UPDATE history SET hash = ?3 WHERE folder = ?1 AND sequence = ?2")?;
    for (id, folder, sequence, hash) in changed {
        record.execute(rusqlite::params![id, &hash.0[..]])?;
        history.execute(rusqlite::params![folder, sequence, &hash.0[..]])?;
    }
    Ok(())
}

// 4: remote versions waiting for a writer through the mount, kept across a restart: the peer
// had them acknowledged and does not send them again.
const DEFERRED_4: &str = r#"
    CREATE TABLE deferred (
        folder INTEGER NOT NULL,
        path   TEXT NOT NULL,
        record BLOB NOT NULL,
        source BLOB NOT NULL,
        PRIMARY KEY (folder, path)
    ) STRICT;
    "#;

// 5: the mark the daemon writes at each open and close, after noting it beside the database,
// so that a write-ahead log started with random salts nobody could note first is still known
// as ours by its content (`journal/wal.rs`). One row.
const WAL_MARK_5: &str = r#"
    CREATE TABLE wal_mark (
        id   INTEGER PRIMARY KEY CHECK (id = 0),
        mark BLOB NOT NULL
    ) STRICT;
    "#;

/// The first schema version with the `wal_mark` table.
pub(super) const WAL_MARK_VERSION: u32 = 5;

/// Writes `mark` as the journal's WAL mark (schema 5 on).
pub(super) fn put_wal_mark(tx: &Connection, mark: &[u8]) -> Result<()> {
    tx.prepare_cached(
        "INSERT INTO wal_mark (id, mark) VALUES (0, ?1) ON CONFLICT (id) DO UPDATE SET mark = ?1",
    )?
    .execute([mark])?;
    Ok(())
}

// 6: past versions and folder roles.
// - `versions`: every version that left this device's tree (a live file or symlink replaced by
//   other content or another kind, or deleted), copied from `records` by the commit that
//   replaced it, in the same transaction, with its chunk list: what `meshfs versions` lists,
//   `restore` brings back and `mount --at` shows. Its content may be kept in the folder's
//   vault (`crate::vault`); whether it is, is the vault's to say. `sequence` is the version's
//   own (its history row's), `left_ns`/`left_seq` those of the change that replaced it.
// - `pruned`: what retention removed, and why (`meshfs journal --all` shows it).
// - `held`: a send-only folder's remote versions, received and not applied (the newest per
//   path), for `status` and `meshfs override`.
// - `local_only`: a receive-only folder's paths changed here and not sent, each with the
//   record it had before its first local change (`shared`, and the peer it came from;
//   NULL: the path did not exist), for `status` and `meshfs revert`.
const VERSIONS_6: &str = r#"
    CREATE TABLE versions (
        id             INTEGER PRIMARY KEY,
        folder         INTEGER NOT NULL,
        sequence       INTEGER NOT NULL,
        path           TEXT NOT NULL,
        kind           TEXT NOT NULL,
        mode           INTEGER NOT NULL,
        mtime_ns       INTEGER NOT NULL,
        size           INTEGER NOT NULL,
        hash           BLOB NOT NULL,
        chunks         BLOB NOT NULL,
        target         TEXT NOT NULL,
        version        BLOB NOT NULL,
        modified_by    INTEGER NOT NULL,
        source         BLOB,
        local_inode    INTEGER,
        local_size     INTEGER,
        local_mtime_ns INTEGER,
        local_ctime_ns INTEGER,
        local_mode     INTEGER,
        made_ns        INTEGER NOT NULL,
        left_ns        INTEGER NOT NULL,
        left_seq       INTEGER NOT NULL,
        UNIQUE (folder, sequence)
    ) STRICT;
    CREATE INDEX versions_by_path ON versions (folder, path, left_ns);
    CREATE INDEX versions_by_age ON versions (folder, left_ns);

    CREATE TABLE pruned (
        folder   INTEGER NOT NULL,
        time_ns  INTEGER NOT NULL,
        path     TEXT NOT NULL,
        sequence INTEGER NOT NULL,
        hash     BLOB NOT NULL,
        size     INTEGER NOT NULL,
        reason   TEXT NOT NULL
    ) STRICT;
    CREATE INDEX pruned_by_time ON pruned (folder, time_ns);

    CREATE TABLE held (
        folder  INTEGER NOT NULL,
        path    TEXT NOT NULL,
        record  BLOB NOT NULL,
        source  BLOB NOT NULL,
        time_ns INTEGER NOT NULL,
        PRIMARY KEY (folder, path)
    ) STRICT;

    CREATE TABLE local_only (
        folder  INTEGER NOT NULL,
        path    TEXT NOT NULL,
        shared  BLOB,
        source  BLOB,
        time_ns INTEGER NOT NULL,
        PRIMARY KEY (folder, path)
    ) STRICT;
    "#;

// 7: files on demand (docs/decisions.md, D90-D94).
// - `absent`: the inodes of placeholders, the files of an on-demand folder whose content is not
//   here. A live file record whose `local_inode` is listed is not local. Keyed by inode, so the
//   row follows a rename (the scanner keeps the record's local stat) and a conflict sibling made
//   as a hard link; a row no live record names any more is dropped (`Journal::prune_absent`).
// - `pins`: paths of a folder kept local (a file, or a directory and everything below it).
const ON_DEMAND_7: &str = r#"
    CREATE TABLE absent (
        folder INTEGER NOT NULL,
        inode  INTEGER NOT NULL,
        PRIMARY KEY (folder, inode)
    ) STRICT, WITHOUT ROWID;

    CREATE TABLE pins (
        folder INTEGER NOT NULL,
        path   TEXT NOT NULL,
        PRIMARY KEY (folder, path)
    ) STRICT, WITHOUT ROWID;
    "#;

// 8: when each file of an on-demand folder was last used here (opened through the mount or
//    fetched), so its eviction order survives a restart (docs/decisions.md, D93). Written in
//    batches by the budget's loop, not at each open; a row whose path has no live record is
//    dropped with the stale placeholder rows.
const USED_8: &str = r#"
    CREATE TABLE used (
        folder INTEGER NOT NULL,
        path   TEXT NOT NULL,
        at_ns  INTEGER NOT NULL,
        PRIMARY KEY (folder, path)
    ) STRICT, WITHOUT ROWID;
    "#;

/// The schema version this build writes and understands.
pub(super) const LATEST_VERSION: u32 = MIGRATIONS.len() as u32;

/// Migrates a database that [`check_identity`] accepted at version `found` to
/// [`LATEST_VERSION`]. Returns the schema version. Each migration's transaction from
/// [`WAL_MARK_VERSION`] on also writes `mark` (noted beside the database before), so a log
/// that a migration starts is known as ours.
pub(super) fn migrate(
    conn: &mut Connection,
    path: &Path,
    found: u32,
    mark: Option<&[u8; 16]>,
) -> Result<u32> {
    if found == LATEST_VERSION {
        return Ok(found);
    }
    for (i, step) in MIGRATIONS.iter().enumerate() {
        let version = i as u32 + 1;
        // IMMEDIATE, and the version re-read inside: another process opening the same new
        // file at the same moment migrates first, and this one then sees nothing to do.
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let current = user_version(&tx)?;
        if current >= version {
            continue;
        }
        match step {
            Migration::Sql(sql) => tx.execute_batch(sql)?,
            Migration::Code(f) => f(&tx)?,
        }
        tx.pragma_update(None, "user_version", version)?;
        tx.pragma_update(None, "application_id", APPLICATION_ID)?;
        if let Some(m) = mark.filter(|_| version >= WAL_MARK_VERSION) {
            put_wal_mark(&tx, m)?;
        }
        tx.commit()?;
    }
    let now = user_version(conn)?;
    if now != LATEST_VERSION {
        return Err(JournalError::Corrupt {
            what: format!(
                "{}: schema version is {now} after migrating to {LATEST_VERSION}",
                path.display()
            ),
        });
    }
    Ok(now)
}

/// Reads the file's identity and schema version, refusing files that belong to another
/// program or to a newer meshfs. Writes nothing.
pub(super) fn check_identity(conn: &Connection, path: &Path) -> Result<u32> {
    let app: i32 = conn.pragma_query_value(None, "application_id", |r| r.get(0))?;
    let version = user_version(conn)?;
    let not_ours = |reason: String| JournalError::NotAJournal {
        path: path.to_path_buf(),
        reason,
    };
    if app != APPLICATION_ID {
        if app != 0 {
            return Err(not_ours(format!(
                "it is an SQLite database with application id {app:#x}, not meshfs's"
            )));
        }
        let tables: i64 = conn.query_row(
            "SELECT count(*) FROM sqlite_schema WHERE type = 'table'",
            [],
            |r| r.get(0),
        )?;
        // A database without our mark may only be new: no tables and schema version 0.
        if version != 0 || tables != 0 {
            return Err(not_ours(format!(
                "it is an SQLite database of another program ({tables} tables, user_version {version})"
            )));
        }
    }
    if version > LATEST_VERSION {
        return Err(JournalError::TooNew {
            path: path.to_path_buf(),
            found: version,
            supported: LATEST_VERSION,
        });
    }
    Ok(version)
}

fn user_version(conn: &Connection) -> Result<u32> {
    let v: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
    // user_version is a signed 32-bit header field: a negative value is not ours.
    u32::try_from(v).map_err(|_| JournalError::Corrupt {
        what: format!("schema version {v} is negative"),
    })
}
