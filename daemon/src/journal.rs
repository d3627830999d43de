//! The journal: this device's durable memory of its replicated folders, one SQLite database
//! in WAL mode.
//!
//! **What it owns.** The schema (numbered migrations in `journal/schema.rs`) and, per folder:
//! the current record of every path (tombstones included) with the local stat of the file
//! that backs it and the peer it came from; the local sequence counter and index id; the
//! append-only history of every change applied here; per-peer progress; the chunk index
//! (chunk hash → where a local copy lives); the *pending* rows of the apply bracket
//! (docs/design.md, "Safe apply"); and the *deferred* rows, remote versions waiting for a writer through the
//! mount to let go.
//!
//! **What it never does.** It opens no file but its database and decides nothing: it does
//! not compare versions, pick winners or look at replica directories. It stores what the
//! engine hands it, checks it (every record is validated before it is written and again
//! when it is read back) and gives it back. The wall clock is read only to timestamp
//! history rows, and [`Journal::commit_at`] takes that time as an argument.
//!
//! # Commit order
//!
//! [`Journal::commit`] is one SQLite transaction:
//! 1. `BEGIN IMMEDIATE`: the write lock is taken up-front, so a commit never fails half-way
//!    on a lock upgrade;
//! 2. read the folder's `max_sequence` (creating the folder if it is new);
//! 3. for each change, in order: validate the record; `seq = ++max_sequence`; write the
//!    current record (with `seq`, local stat, source, `changed_at = now`), updating the
//!    existing row in place so its id stays; append the history row; replace the chunk-index
//!    rows of that record (live files only: offsets are the running sum of chunk lengths);
//!    delete the pending row of that path;
//! 4. store `max_sequence` and the folder's counts, adjusted by what each change replaced;
//! 5. `COMMIT`.
//!
//! An error or a crash anywhere before step 5 leaves nothing of the batch behind: no record,
//! no history row, no consumed sequence. So sequences are gapless, every history row has a
//! record change with the same sequence, and a peer that resumes from a sequence misses
//! nothing.
//!
//! # Durability
//!
//! `synchronous = NORMAL` in WAL mode: every transaction is atomic, and transactions reach the
//! disk in order — a power cut may lose the last few, never half of one, never one without
//! those before it (so peer progress written after a commit never outlives that commit).
//! [`Journal::put_pending`] alone runs with `synchronous = FULL`: it is the promise written
//! before the store renames files into place, and it must be on disk before any rename is.
//! The commit that replaces it afterwards needs no flush: if it is lost, the pending rows
//! survive and start-up completes them.
//!
//! # Storage conventions
//!
//! - SQLite integers are signed 64-bit. u64 values (sequences, index ids, short ids, sizes,
//!   inodes) are stored **bit-cast** (`v as i64`, read back `as u64`): values ≥ 2^63 read back
//!   exactly but sort negative in SQL. Only sequences are compared in SQL, and they never get
//!   there.
//! - Paths are stored as their UTF-8 text; SQLite's BINARY collation orders them byte-wise,
//!   exactly as `RelPath`'s `Ord` does. "Ordered by path" means that order.
//! - Version vectors and chunk lists are postcard-encoded blobs; hashes and device ids are
//!   32-byte blobs.
//! - The chunk index refers to a record by its row id (not its path, which would be repeated
//!   per chunk) and is searched by the first 8 bytes of the chunk hash.

mod on_demand;
mod roles;
mod rows;
mod schema;
mod versions;
mod wal;

pub use on_demand::{Residency, Resident};
pub use versions::{Departed, KeptVersion, PrunedEvent, Retired};

use crate::store::LocalStat;
use meshfs_protocol::{
    DeviceId, FileKind, FileRecord, FolderId, Hash, RecordError, RelPath, ShortId, VersionVector,
};
use rows::{encode, to_i64, to_u64, HISTORY_COLUMNS, RECORD_COLUMNS};
use rusqlite::ffi::ErrorCode;
use rusqlite::types::Value;
use rusqlite::{
    params, params_from_iter, CachedStatement, Connection, OptionalExtension, TransactionBehavior,
};
use std::collections::HashMap;
use std::fmt;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// How long a statement waits for another connection's lock before failing.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);
/// SQLite page cache per connection, in KiB (a negative `cache_size` is KiB).
const CACHE_KIB: i64 = 8000;
/// At most this many locations are returned for one chunk: one good copy is enough, a few
/// allow for copies that changed on disk since they were journaled.
pub const MAX_CHUNK_LOCATIONS: usize = 8;

/// Why a journal operation failed.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// An SQLite error without a more specific meaning.
    #[error("journal database error: {0}")]
    Sqlite(#[from] rusqlite::Error),
    /// The journal file cannot be opened or created.
    #[error("cannot open the journal {}: {source}; check that its directory exists and is writable", path.display())]
    CannotOpen {
        /// The database file.
        path: PathBuf,
        /// What SQLite said.
        source: rusqlite::Error,
    },
    /// The file exists but is not a meshfs journal.
    #[error("{} is not a meshfs journal: {reason}; if it was one, stop the daemon and run `meshfs repair` (it keeps the file aside and the next start rebuilds the journal by a rescan); otherwise point --home elsewhere", path.display())]
    NotAJournal {
        /// The file.
        path: PathBuf,
        /// What it is instead.
        reason: String,
    },
    /// The journal was written by a newer meshfs.
    #[error("the journal {} has schema version {found}, this meshfs understands up to {supported}: it was written by a newer meshfs; upgrade meshfs", path.display())]
    TooNew {
        /// The database file.
        path: PathBuf,
        /// Its schema version.
        found: u32,
        /// The newest version this build knows.
        supported: u32,
    },
    /// SQLite reports the database file damaged.
    #[error("the journal {} is damaged ({source}); stop the daemon and run `meshfs repair`: it keeps the damaged file aside and the next start rescans the folders into a new journal (their change history is not carried over; no file is touched)", path.display())]
    Damaged {
        /// The database file.
        path: PathBuf,
        /// What SQLite said.
        source: rusqlite::Error,
    },
    /// Another connection held the database lock for longer than the busy timeout.
    #[error("the journal {} stayed locked by another process ({source}); is another meshfs daemon running with the same --home?", path.display())]
    Locked {
        /// The database file.
        path: PathBuf,
        /// What SQLite said.
        source: rusqlite::Error,
    },
    /// The disk holding the journal is full.
    #[error("the disk holding the journal {} is full ({source}): the change was not recorded; free some space", path.display())]
    DiskFull {
        /// The database file.
        path: PathBuf,
        /// What SQLite said.
        source: rusqlite::Error,
    },
    /// A stored row does not decode or breaks a record invariant.
    #[error("journal row is unreadable: {what}; the journal may be damaged: stop the daemon and run `meshfs repair` to rebuild it by a rescan")]
    Corrupt {
        /// Which row, and what is wrong with it.
        what: String,
    },
    /// The caller asked to journal a record that breaks its invariants (a bug in the caller).
    #[error("refusing to journal an invalid record in folder {folder}: {source}")]
    InvalidRecord {
        /// The folder.
        folder: FolderId,
        /// What is wrong with the record.
        source: RecordError,
    },
}

/// Result of journal operations.
pub type Result<T> = std::result::Result<T, JournalError>;

/// The operation a history row records: the planner's ([`meshfs_sync::plan::Op`]).
pub use meshfs_sync::plan::Op;

/// One new version to journal.
#[derive(Clone, Debug, PartialEq)]
pub struct Change {
    /// The version; `record.sequence` is ignored: commit assigns the sequence.
    pub record: FileRecord,
    /// What happened, for history.
    pub op: Op,
    /// The file on disk that backs it; `None` for tombstones or when unknown.
    pub local: Option<LocalStat>,
    /// The peer this version was received from; `None` = made on this device.
    pub source: Option<DeviceId>,
    /// Free text (or JSON) for history, e.g. a rename's origin or a conflict's description.
    pub detail: Option<String>,
}

/// The part of a current record that change detection compares (see
/// [`Journal::for_each_summary`]).
#[derive(Clone, Debug, PartialEq)]
pub struct RecordSummary {
    /// The path.
    pub path: RelPath,
    /// What it is.
    pub kind: FileKind,
    /// A tombstone.
    pub deleted: bool,
    /// Permission bits.
    pub mode: u32,
    /// Modification time (ns).
    pub mtime_ns: i64,
    /// Content (or symlink target) hash.
    pub hash: Hash,
    /// The file on disk when last scanned or applied.
    pub local: Option<LocalStat>,
}

/// A current record as stored.
#[derive(Clone, Debug, PartialEq)]
pub struct StoredRecord {
    /// The record; `record.sequence` is its local sequence.
    pub record: FileRecord,
    /// The file on disk that backs it, as last seen.
    pub local: Option<LocalStat>,
    /// The peer it was received from; `None` = made on this device.
    pub source: Option<DeviceId>,
}

/// A folder's index identity and sequence counter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FolderState {
    /// Random, non-zero; a new one tells peers to forget what they know of our sequences.
    pub index_id: u64,
    /// The highest sequence assigned in this folder (0 before the first commit).
    pub max_sequence: u64,
}

/// One row of a folder's history.
#[derive(Clone, Debug, PartialEq)]
pub struct HistoryEntry {
    /// The local sequence assigned to this change.
    pub sequence: u64,
    /// When it was journaled here, ns since the Unix epoch (wall clock).
    pub time_ns: i64,
    /// The path.
    pub path: RelPath,
    /// What happened.
    pub op: Op,
    /// What the path is.
    pub kind: FileKind,
    /// Whether the version is a tombstone.
    pub deleted: bool,
    /// The device that made the version.
    pub modified_by: ShortId,
    /// The peer it came from; `None` = made here.
    pub source: Option<DeviceId>,
    /// The version's vector.
    pub version: VersionVector,
    /// Content hash.
    pub hash: Hash,
    /// Size in bytes.
    pub size: u64,
    /// Permission bits.
    pub mode: u32,
    /// Free text given with the change.
    pub detail: Option<String>,
}

/// Which history rows to return.
///
/// The result is ascending by sequence. With `since_time_ns` or `since_sequence`, it is the
/// *first* `limit` matches after that point (unless `newest`); otherwise the *last* `limit`
/// matches (the most recent), still ascending.
#[derive(Clone, Debug, Default)]
pub struct HistoryQuery {
    /// That path, or anything below it.
    pub path: Option<RelPath>,
    /// Versions made by this device (`modified_by`).
    pub device: Option<ShortId>,
    /// Rows journaled at or after this time (inclusive).
    pub since_time_ns: Option<i64>,
    /// Rows with a sequence greater than this (exclusive).
    pub since_sequence: Option<u64>,
    /// At most this many rows.
    pub limit: Option<usize>,
    /// Include bookkeeping rows ([`Op::Merged`]): vector-only changes nobody made.
    pub bookkeeping: bool,
    /// The *last* `limit` matches even after a `since`: the page lists the newest rows first
    /// whatever the filter, where `meshfs journal --since` prints from that point on.
    pub newest: bool,
}

/// How far a peer and this device have exchanged one folder's index.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PeerProgress {
    /// The peer's index id that `their_sequence` refers to.
    pub their_index_id: u64,
    /// The highest of their records applied here.
    pub their_sequence: u64,
    /// The highest of ours they acknowledged.
    pub our_acked: u64,
}

/// Where a local copy of a chunk lives (as of the last journaled version of that file; the
/// file may have changed since: the reader verifies the hash, or finds the file's stat still
/// `local`, see [`crate::store::read_served_chunk`]).
#[derive(Clone, Debug, PartialEq)]
pub struct ChunkLocation {
    /// The folder.
    pub folder: FolderId,
    /// The file.
    pub path: RelPath,
    /// Byte offset of the chunk in the file.
    pub offset: u64,
    /// Length of the chunk.
    pub len: u32,
    /// The file's stat when that version was journaled (its content hashed), if known.
    pub local: Option<LocalStat>,
}

/// What a folder holds, by current records.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FolderCounts {
    /// Live regular files.
    pub files: u64,
    /// Live directories.
    pub dirs: u64,
    /// Live symlinks.
    pub symlinks: u64,
    /// Total size of live files.
    pub bytes: u64,
    /// Tombstones of any kind.
    pub tombstones: u64,
}

/// What marks a conflict sibling's name (`name.sync-conflict-DATE-TIME-ID.ext`); the journal
/// indexes the records whose path holds it.
pub const CONFLICT_MARKER: &str = ".sync-conflict-";

/// The journal database. `Send`; the engine shares it behind a mutex.
pub struct Journal {
    conn: Connection,
    path: PathBuf,
    schema_version: u32,
    /// Row ids of folders already looked up: a folder's id never changes while it exists,
    /// and reads are far too frequent (several per applied record) to ask SQLite each time.
    keys: std::cell::RefCell<std::collections::HashMap<FolderId, i64>>,
    /// A read transaction is held open ([`Journal::begin_reads`]).
    reading: bool,
    /// What the note beside the database says of our write-ahead log ([`wal`]).
    note: wal::Note,
    /// This is the daemon's journal: it marks its log and notes its salts, and leaves a log
    /// behind when it closes ([`Journal::open`]); a reader ([`Journal::open_reader`]) only
    /// checks.
    owner: bool,
}

impl Drop for Journal {
    fn drop(&mut self) {
        if self.owner {
            if let Err(e) = self.close_wal() {
                tracing::warn!(path = %self.path.display(), error = %e, "closing the journal's write-ahead log failed; it is checked at the next start as it is");
            }
        }
        // The log stays on disk when the connection closes, whole: with a size limit SQLite
        // would truncate it to nothing, and the next writer would start one from nothing.
        if let Err(e) = self.conn.pragma_update(None, "journal_size_limit", -1) {
            tracing::debug!(error = %e, "cannot lift the journal size limit before closing");
        }
    }
}

impl fmt::Debug for Journal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Journal")
            .field("path", &self.path)
            .field("schema_version", &self.schema_version)
            .finish()
    }
}

// Insert and update are separate statements (after a probe) rather than one upsert: a
// single-row INSERT or rowid UPDATE needs no statement journal, and the probe tells whether
// old chunk rows exist. Parameters are the same for both: ?1 is the folder key on insert and
// the record id on update.
const INSERT_RECORD: &str = "INSERT INTO records (folder, path, kind, deleted, mode, mtime_ns, \
    size, hash, chunks, target, version, modified_by, sequence, local_inode, local_size, \
    local_mtime_ns, local_ctime_ns, local_mode, source, changed_at) \
    VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19, ?20)";

const UPDATE_RECORD: &str = "UPDATE records SET kind = ?3, deleted = ?4, mode = ?5, \
    mtime_ns = ?6, size = ?7, hash = ?8, chunks = ?9, target = ?10, version = ?11, \
    modified_by = ?12, sequence = ?13, local_inode = ?14, local_size = ?15, \
    local_mtime_ns = ?16, local_ctime_ns = ?17, local_mode = ?18, source = ?19, \
    changed_at = ?20 WHERE id = ?1 AND path = ?2";

const INSERT_HISTORY: &str = "INSERT INTO history (folder, sequence, time_ns, path, op, kind, \
    deleted, modified_by, source, version, hash, size, mode, detail) \
    VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14)";

// A record leaving the tree, copied into `versions` before it is overwritten: ?1 its row,
// ?2 the time and ?3 the sequence of the change that replaces it. A sequence is assigned once,
// so the unique (folder, sequence) never meets itself; `OR IGNORE` keeps a commit going if it
// ever did.
const KEEP_VERSION: &str = "INSERT OR IGNORE INTO versions (folder, sequence, path, kind, mode, \
    mtime_ns, size, hash, chunks, target, version, modified_by, source, local_inode, local_size, \
    local_mtime_ns, local_ctime_ns, local_mode, made_ns, left_ns, left_seq) \
    SELECT folder, sequence, path, kind, mode, mtime_ns, size, hash, chunks, target, version, \
    modified_by, source, local_inode, local_size, local_mtime_ns, local_ctime_ns, local_mode, \
    changed_at, ?2, ?3 FROM records WHERE id = ?1";

/// The range of the paths strictly below `dir`: every "dir/…" sorts in `["dir/", "dir0")`
/// because `'0'` is the byte after `'/'`.
fn below_bounds(dir: &RelPath) -> (String, String) {
    (format!("{}/", dir.as_str()), format!("{}0", dir.as_str()))
}

/// The journal's stamps: the system clock, unless a test moved it (`crate::clock`).
fn now_ns() -> i64 {
    crate::clock::now_ns()
}

/// Chunks shorter than this are indexed only as a file's last chunk: the chunker never cuts
/// one shorter anywhere else (D8's smallest minimum), so only a peer's crafted chunk list has
/// them, and copying a few bytes locally saves nothing over fetching them.
pub const INDEXED_FROM: u32 = meshfs_protocol::MIN_CHUNK_LEN;

/// The chunks of a live file's record that the chunk index holds, with their offsets: each
/// distinct chunk once (its first place is enough to copy or serve it from), and of those
/// shorter than [`INDEXED_FROM`] only the last. A peer's record listing one byte half a
/// million times costs one row, not half a million, and so does its lookup.
pub fn indexed_chunks(rec: &FileRecord) -> impl Iterator<Item = (u64, &meshfs_protocol::Chunk)> {
    let last = rec.chunks.len().saturating_sub(1);
    let mut seen = std::collections::HashSet::new();
    rec.chunk_offsets()
        .enumerate()
        .filter(move |(i, (_, c))| (c.len >= INDEXED_FROM || *i == last) && seen.insert(c.hash))
        .map(|(_, oc)| oc)
}

/// The chunk index's key for a hash: its first 8 bytes (see the schema).
fn hash_key(hash: &Hash) -> i64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&hash.0[..8]);
    i64::from_be_bytes(b)
}

fn limit_sql(limit: usize) -> i64 {
    i64::try_from(limit).unwrap_or(i64::MAX)
}

fn device_blob(d: &Option<DeviceId>) -> Option<&[u8]> {
    d.as_ref().map(|d| &d.as_bytes()[..])
}

/// Turns SQLite errors that have a meaning for the user into errors that name the file.
fn classify(path: &Path, e: JournalError) -> JournalError {
    let JournalError::Sqlite(err) = e else {
        return e;
    };
    let path = path.to_path_buf();
    match err.sqlite_error_code() {
        Some(ErrorCode::DatabaseCorrupt) | Some(ErrorCode::NotADatabase) => {
            JournalError::Damaged { path, source: err }
        }
        Some(ErrorCode::DatabaseBusy) | Some(ErrorCode::DatabaseLocked) => {
            JournalError::Locked { path, source: err }
        }
        Some(ErrorCode::DiskFull) => JournalError::DiskFull { path, source: err },
        Some(ErrorCode::CannotOpen) => JournalError::CannotOpen { path, source: err },
        _ => JournalError::Sqlite(err),
    }
}

/// The folder's key and state, if it exists.
fn lookup_folder(conn: &Connection, folder: &FolderId) -> Result<Option<(i64, FolderState)>> {
    let mut st =
        conn.prepare_cached("SELECT id, index_id, max_sequence FROM folders WHERE name = ?1")?;
    let row = st
        .query_row([folder.as_str()], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, i64>(1)?,
                r.get::<_, i64>(2)?,
            ))
        })
        .optional()?;
    Ok(row.map(|(key, index_id, max)| {
        (
            key,
            FolderState {
                index_id: to_u64(index_id),
                max_sequence: to_u64(max),
            },
        )
    }))
}

/// A new random mark for the log ([`wal`]).
fn new_mark() -> [u8; wal::MARK_LEN] {
    rand::random()
}

/// Writes the note beside `db` (at `step`, for the failpoints); a failure is logged (the
/// daemon runs on: the note only matters to tell a foreign log after a crash) and returned as
/// false.
fn note_or_warn(db: &Path, note: &wal::Note, step: &str) -> bool {
    match wal::write_note(db, note, step) {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(path = %wal::note_path(db).display(), error = %e, "cannot record the identity of the journal's write-ahead log; after a crash now, the next start may take it for another database's");
            false
        }
    }
}

fn new_index_id() -> u64 {
    loop {
        let id: u64 = rand::random();
        if id != 0 {
            return id;
        }
    }
}

/// The folder's key and state, creating the folder if it is missing.
fn ensure_folder(conn: &Connection, folder: &FolderId) -> Result<(i64, FolderState)> {
    if let Some(found) = lookup_folder(conn, folder)? {
        return Ok(found);
    }
    let index_id = new_index_id();
    conn.prepare_cached("INSERT INTO folders (name, index_id, max_sequence) VALUES (?1, ?2, 0)")?
        .execute(params![folder.as_str(), to_i64(index_id)])?;
    Ok((
        conn.last_insert_rowid(),
        FolderState {
            index_id,
            max_sequence: 0,
        },
    ))
}

/// Journals `changes` in `tx` (see the module's commit order), timestamping history with
/// `time_ns`: the folder's key and the assigned sequences, in order.
fn commit_in(
    tx: &Connection,
    folder: &FolderId,
    changes: &[Change],
    time_ns: i64,
) -> Result<(i64, Vec<u64>)> {
    let (key, state) = ensure_folder(tx, folder)?;
    let mut commit = Commit::prepare(tx, folder, key, state.max_sequence, time_ns)?;
    let mut out = Vec::with_capacity(changes.len());
    for change in changes {
        out.push(commit.change(change)?);
    }
    commit.finish()?;
    Ok((key, out))
}

impl Journal {
    /// Opens the journal at `path` as the daemon's own, creating it if missing and migrating
    /// it to the current schema. A file that is not a meshfs journal, is damaged, or was
    /// written by a newer meshfs gives an error naming the path; so does a write-ahead log
    /// beside it that is another database's ([`wal`]).
    ///
    /// The daemon's journal keeps its log identifiable through any crash (the steps, each a
    /// failpoint named in brackets, are what `tests/wal_identity.rs` kills):
    /// 1. the log is checked against the note, before SQLite may replay it;
    /// 2. SQLite opens it; a new journal, or one older than the `wal_mark` table, first loses
    ///    its note (nothing to protect yet, and a migration could not carry a mark) and is
    ///    migrated;
    /// 3. a new random mark is noted durably \[`journal.open.mark_noted`\], then written into
    ///    `wal_mark` \[`journal.open.marked`\]: whatever log that write starts (random salts
    ///    if it starts one from nothing) holds the mark the note names;
    /// 4. the log's salts are noted \[`journal.open.noted`\], and again whenever a commit
    ///    finds the log started again \[`journal.wal.restarted`\];
    /// 5. at close ([`Drop`]) the log is checkpointed and emptied
    ///    \[`journal.close.checkpointed`\], marked as in 3 \[`journal.close.mark_noted`,
    ///    `journal.close.marked`\], its salts noted \[`journal.close.noted`\], and kept on disk
    ///    (persistent WAL): another program that writes the journal before the next start
    ///    appends to that log, under the noted salts, rather than start one with salts nobody
    ///    noted.
    ///
    /// Each note write is a synced temp file renamed over the note, then the directory synced
    /// \[`journal.note.synced@STEP`, `journal.note.renamed@STEP`, STEP one of `open.mark`,
    /// `open.salts`, `close.mark`, `close.salts`, `restart.salts`, `migrate.mark`\]. The
    /// failpoints are `daemon/src/failpoint.rs`'s: `MESHFS_FAILPOINTS=journal.open.marked=abort`.
    pub fn open(path: &Path) -> Result<Journal> {
        Journal::open_as(path, true)
    }

    /// Opens the journal to read it beside a running daemon (`meshfs journal`, `meshfs
    /// conflicts`): the log is checked as by [`Journal::open`], but never marked or noted, and
    /// left on disk at close if this was the last connection.
    pub fn open_reader(path: &Path) -> Result<Journal> {
        Journal::open_as(path, false)
    }

    fn open_as(path: &Path, owner: bool) -> Result<Journal> {
        wal::check(path).map_err(|reason| JournalError::NotAJournal {
            path: path.to_path_buf(),
            reason,
        })?;
        let mut note = wal::read_note(path).unwrap_or_default();
        let opened = (|| {
            let mut conn = Connection::open(path)?;
            // Every path, its history and the peers' ids: the owner's alone (SQLite gives
            // its WAL and shared-memory files the database's mode).
            {
                use std::os::unix::fs::PermissionsExt;
                let _ = std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600));
            }
            conn.busy_timeout(BUSY_TIMEOUT)?;
            // Read-only checks first, so that a file that is not ours is left byte for byte
            // as it was (switching to WAL would rewrite its header). The first read of a
            // file that is not a database fails here.
            let found = schema::check_identity(&conn, path)?;
            let mode: String =
                conn.pragma_update_and_check(None, "journal_mode", "wal", |r| r.get(0))?;
            if !mode.eq_ignore_ascii_case("wal") {
                tracing::warn!(
                    path = %path.display(),
                    mode,
                    "the journal's file system does not support WAL mode; using {mode}"
                );
            }
            conn.pragma_update(None, "synchronous", "NORMAL")?;
            conn.pragma_update(None, "cache_size", -CACHE_KIB)?;
            // Checkpoint every 16 MiB of WAL rather than 4: a page rewritten by several
            // commits in that window (random leaves of the path and hash indexes at first
            // scan) is copied into the database once. Truncate the WAL back after that.
            conn.pragma_update(None, "wal_autocheckpoint", 4000)?;
            conn.pragma_update(None, "journal_size_limit", 64i64 << 20)?;
            // The last connection to close keeps the log file (see `open`, step 5).
            conn.file_control(
                Some(rusqlite::MAIN_DB),
                rusqlite::FileControl::PersistWal(&mut 1),
            )?;
            conn.set_prepared_statement_cache_capacity(64);
            // Plans never depend on bound values: without this, a statement whose plan looked
            // at a parameter (a LIMIT ?, a range bound) is re-prepared on every execution,
            // since the statement cache clears bindings (a tenth of an apply's CPU time).
            conn.set_db_config(
                rusqlite::config::DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG,
                true,
            )?;
            if found < schema::LATEST_VERSION {
                // A migration may start the log; only one from the version with `wal_mark`
                // on can carry a mark. Before that the note goes (accepting any log until
                // the first mark), and it comes back with the first mark.
                let mark = (found >= schema::WAL_MARK_VERSION).then(new_mark);
                if let Some(m) = mark {
                    note.mark = Some(m);
                    note_or_warn(path, &note, "migrate.mark");
                } else {
                    note = wal::Note::default();
                    if let Err(e) = wal::remove_note(path) {
                        tracing::warn!(path = %path.display(), error = %e, "cannot remove the journal's WAL note before migrating");
                    }
                }
                let version = schema::migrate(&mut conn, path, found, mark.as_ref())?;
                crate::failpoint::hit("journal.open.migrated", "");
                return Ok((conn, version));
            }
            Ok((conn, found))
        })();
        let (conn, schema_version) = opened.map_err(|e| match e {
            JournalError::Sqlite(err)
                if err.sqlite_error_code() == Some(ErrorCode::NotADatabase) =>
            {
                JournalError::NotAJournal {
                    path: path.to_path_buf(),
                    reason: format!("it is not an SQLite database ({err})"),
                }
            }
            e => classify(path, e),
        })?;
        let mut j = Journal {
            conn,
            path: path.to_path_buf(),
            schema_version,
            keys: Default::default(),
            reading: false,
            note,
            owner,
        };
        if owner {
            j.mark_wal("open");
        }
        Ok(j)
    }

    /// Notes a new mark, then writes it into `wal_mark`, then notes the log's salts (steps
    /// 3–4 of [`Journal::open`]); `at` names the failpoints (`journal.{at}.…`). A failure to
    /// write the mark (a full disk) is logged, not returned: the journal works without it, and
    /// its log is then known by its salts alone until the next mark.
    fn mark_wal(&mut self, at: &str) {
        let mark = new_mark();
        let noted = wal::Note {
            mark: Some(mark),
            ..self.note
        };
        if !note_or_warn(&self.path, &noted, &format!("{at}.mark")) {
            // Unnoted, a mark would prove nothing: the log keeps its salts' identity alone.
            return;
        }
        self.note = noted;
        crate::failpoint::hit(&format!("journal.{at}.mark_noted"), "");
        if let Err(e) = self.transact(|tx| schema::put_wal_mark(tx, &mark)) {
            tracing::warn!(path = %self.path.display(), error = %e, "cannot write the journal's WAL mark; its log is known by its salts alone for now");
            return;
        }
        crate::failpoint::hit(&format!("journal.{at}.marked"), "");
        self.note_wal_salts(&format!("{at}.salts"));
        crate::failpoint::hit(&format!("journal.{at}.noted"), "");
    }

    /// Checks the whole database file (`PRAGMA quick_check`): the daemon runs it at start so
    /// that it never trusts a damaged journal.
    pub fn check(&mut self) -> Result<()> {
        self.note_wal();
        let problems: Vec<String> = self
            .conn
            .prepare("PRAGMA quick_check(5)")
            .and_then(|mut st| {
                st.query_map([], |r| r.get::<_, String>(0))?
                    .collect::<std::result::Result<Vec<_>, _>>()
            })
            .map_err(|e| classify(&self.path, e.into()))?;
        if problems.len() == 1 && problems[0] == "ok" {
            return Ok(());
        }
        Err(JournalError::Damaged {
            path: self.path.clone(),
            source: rusqlite::Error::SqliteFailure(
                rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_CORRUPT),
                Some(problems.join("; ")),
            ),
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The schema version of the open database (always the latest this build knows).
    pub fn schema_version(&self) -> u32 {
        self.schema_version
    }

    /// The row id of `folder` (`None` if the journal does not know it), cached.
    fn key(&self, c: &Connection, folder: &FolderId) -> Result<Option<i64>> {
        if let Some(k) = self.keys.borrow().get(folder) {
            return Ok(Some(*k));
        }
        let found = lookup_folder(c, folder)?.map(|(key, _)| key);
        if let Some(k) = found {
            self.keys.borrow_mut().insert(folder.clone(), k);
        }
        Ok(found)
    }

    /// Gives back the page cache and cached statements of this connection (they refill on
    /// demand). After a scan of a big tree, so that an idle daemon stays small.
    pub fn release_memory(&self) {
        self.conn.flush_prepared_statement_cache();
        if let Err(e) = self.conn.execute_batch("PRAGMA shrink_memory") {
            tracing::debug!(error = %e, "shrink_memory failed");
        }
    }

    /// Runs a read, naming the file in errors that concern it.
    fn read<T>(&self, f: impl FnOnce(&Connection) -> Result<T>) -> Result<T> {
        f(&self.conn).map_err(|e| classify(&self.path, e))
    }

    /// [`Journal::read`] for many statements: inside one read transaction (unless one is open
    /// already, [`Journal::begin_reads`]), so SQLite's WAL locks are taken once for all of
    /// them rather than once per statement (an `fcntl` each way).
    fn read_many<T>(&self, f: impl FnOnce(&Connection) -> Result<T>) -> Result<T> {
        self.read(|c| {
            if !c.is_autocommit() {
                return f(c);
            }
            let tx = c.unchecked_transaction()?;
            let v = f(&tx)?;
            tx.commit()?;
            Ok(v)
        })
    }

    /// Holds one read transaction open until [`Journal::end_reads`], so that a batch's
    /// thousands of lookups take SQLite's WAL locks (an `fcntl` each on the shared-memory
    /// index) once rather than once per statement: they were a tenth of a receiving daemon's
    /// CPU. A write meanwhile ends it and opens a new one after, so reads see every write.
    pub fn begin_reads(&mut self) {
        if !self.reading && self.conn.is_autocommit() {
            self.reading = self.conn.execute_batch("BEGIN DEFERRED").is_ok();
        }
    }

    /// Ends what [`Journal::begin_reads`] opened (nothing if it opened nothing).
    pub fn end_reads(&mut self) {
        if std::mem::take(&mut self.reading) {
            if let Err(e) = self.conn.execute_batch("COMMIT") {
                tracing::warn!(error = %e, "cannot end a read transaction");
            }
        }
    }

    /// Runs `f` in one IMMEDIATE transaction: all of it is committed, or none of it.
    fn write<T>(&mut self, f: impl FnOnce(&Connection) -> Result<T>) -> Result<T> {
        let resume = self.reading;
        self.end_reads();
        let r = self.write_now(f);
        if resume {
            self.begin_reads();
        }
        r
    }

    fn write_now<T>(&mut self, f: impl FnOnce(&Connection) -> Result<T>) -> Result<T> {
        let v = self.transact(f)?;
        self.note_wal();
        Ok(v)
    }

    /// One IMMEDIATE transaction, nothing else.
    fn transact<T>(&mut self, f: impl FnOnce(&Connection) -> Result<T>) -> Result<T> {
        let r = (|| {
            let tx = self
                .conn
                .transaction_with_behavior(TransactionBehavior::Immediate)?;
            let v = f(&tx)?;
            tx.commit()?;
            Ok(v)
        })();
        r.map_err(|e| classify(&self.path, e))
    }

    /// The close of the daemon's journal (step 5 of [`Journal::open`]): the log checkpointed
    /// and emptied, marked, its salts noted. Skipped when another connection reads (the
    /// checkpoint cannot empty the log under it): the log is then left as it is, noted.
    fn close_wal(&mut self) -> Result<()> {
        self.end_reads();
        self.conn.busy_timeout(Duration::ZERO)?;
        let busy: i64 = self
            .conn
            .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| r.get(0))?;
        if busy != 0 {
            return Ok(());
        }
        crate::failpoint::hit("journal.close.checkpointed", "");
        self.mark_wal("close");
        Ok(())
    }

    /// Notes the log's salts beside the database when they changed (the log started again),
    /// so the next open can tell this database's log from another's ([`wal`]). Only the
    /// daemon's journal notes.
    fn note_wal(&mut self) {
        if !self.owner {
            return;
        }
        match wal::header(&self.path) {
            Some(h) if self.note.salts != Some(h.salts) => {
                crate::failpoint::hit("journal.wal.restarted", "");
                self.note_wal_salts("restart.salts");
            }
            _ => {}
        }
    }

    fn note_wal_salts(&mut self, step: &str) {
        let Some(h) = wal::header(&self.path) else {
            return;
        };
        let noted = wal::Note {
            salts: Some(h.salts),
            ..self.note
        };
        if noted != self.note && note_or_warn(&self.path, &noted, step) {
            self.note = noted;
        }
    }

    /// The folder's state, creating the folder (random non-zero index id, sequence 0) if it
    /// is missing.
    pub fn folder(&mut self, folder: &FolderId) -> Result<FolderState> {
        self.write(|tx| Ok(ensure_folder(tx, folder)?.1))
    }

    /// The live paths whose journaled local stat names `inode` (other names of a file with
    /// several links: a conflict copy made as a hard link of the file it copies). Not indexed:
    /// asked only for a file that has more than one link.
    pub fn paths_with_inode(&self, folder: &FolderId, inode: u64) -> Result<Vec<RelPath>> {
        self.read(|c| {
            let Some(key) = self.key(c, folder)? else {
                return Ok(Vec::new());
            };
            let mut st = c.prepare_cached(
                "SELECT path FROM records WHERE folder = ?1 AND local_inode = ?2 AND deleted = 0",
            )?;
            let rows = st.query_map(params![key, to_i64(inode)], |r| r.get::<_, String>(0))?;
            let mut out = Vec::new();
            for p in rows {
                if let Ok(p) = RelPath::new(&p?) {
                    out.push(p);
                }
            }
            Ok(out)
        })
    }

    /// A folder's identity and sequence counter as the journal has them, without creating the
    /// folder (`None` for one it has nothing of): for connections that only read.
    pub fn folder_state(&self, folder: &FolderId) -> Result<Option<FolderState>> {
        self.read(|c| Ok(lookup_folder(c, folder)?.map(|(_, st)| st)))
    }

    /// Every folder in the journal, ordered by folder id.
    pub fn folders(&self) -> Result<Vec<(FolderId, FolderState)>> {
        self.read(|c| {
            let mut st =
                c.prepare_cached("SELECT name, index_id, max_sequence FROM folders ORDER BY name")?;
            let mut rows = st.query([])?;
            let mut out = Vec::new();
            while let Some(r) = rows.next()? {
                let name: String = r.get(0)?;
                out.push((
                    rows::folder_id(&name)?,
                    FolderState {
                        index_id: to_u64(r.get(1)?),
                        max_sequence: to_u64(r.get(2)?),
                    },
                ));
            }
            Ok(out)
        })
    }

    /// Deletes every row of the folder (records, history, peers, chunks, pending, deferred) in
    /// one transaction. Nothing happens if the folder is unknown.
    pub fn remove_folder(&mut self, folder: &FolderId) -> Result<()> {
        self.write(|tx| {
            let Some((key, _)) = lookup_folder(tx, folder)? else {
                return Ok(());
            };
            for table in [
                "chunks",
                "history",
                "records",
                "pending",
                "deferred",
                "peers",
                "versions",
                "pruned",
                "held",
                "local_only",
            ] {
                tx.execute(&format!("DELETE FROM {table} WHERE folder = ?1"), [key])?;
            }
            tx.execute("DELETE FROM folders WHERE id = ?1", [key])?;
            Ok(())
        })?;
        self.keys.borrow_mut().remove(folder);
        Ok(())
    }

    /// Gives the folder a new random index id (creating it if missing), so that peers
    /// re-request our whole index, and forgets what every peer acknowledged of ours. The
    /// sequence counter continues.
    pub fn reset_index(&mut self, folder: &FolderId) -> Result<FolderState> {
        self.write(|tx| {
            let (key, state) = ensure_folder(tx, folder)?;
            let mut index_id = new_index_id();
            while index_id == state.index_id {
                index_id = new_index_id();
            }
            tx.execute(
                "UPDATE folders SET index_id = ?2 WHERE id = ?1",
                params![key, to_i64(index_id)],
            )?;
            tx.execute("UPDATE peers SET our_acked = 0 WHERE folder = ?1", [key])?;
            Ok(FolderState { index_id, ..state })
        })
    }

    /// The current record of `path`, tombstones included.
    pub fn get(&self, folder: &FolderId, path: &RelPath) -> Result<Option<StoredRecord>> {
        self.read(|c| {
            let Some(key) = self.key(c, folder)? else {
                return Ok(None);
            };
            let mut st = c.prepare_cached(&format!(
                "SELECT {RECORD_COLUMNS} FROM records WHERE folder = ?1 AND path = ?2"
            ))?;
            let mut rows = st.query(params![key, path.as_str()])?;
            match rows.next()? {
                Some(r) => Ok(Some(rows::stored_record(folder, r)?)),
                None => Ok(None),
            }
        })
    }

    /// Every record strictly below `dir` ("dir/…", tombstones included), ordered by path.
    pub fn below(&self, folder: &FolderId, dir: &RelPath) -> Result<Vec<StoredRecord>> {
        self.read(|c| {
            let Some(key) = self.key(c, folder)? else {
                return Ok(Vec::new());
            };
            let (lo, hi) = below_bounds(dir);
            let mut st = c.prepare_cached(&format!(
                "SELECT {RECORD_COLUMNS} FROM records \
                 WHERE folder = ?1 AND path >= ?2 AND path < ?3 ORDER BY path"
            ))?;
            let mut rows = st.query(params![key, lo, hi])?;
            let mut out = Vec::new();
            while let Some(r) = rows.next()? {
                out.push(rows::stored_record(folder, r)?);
            }
            Ok(out)
        })
    }

    /// Whether any non-deleted record lies strictly below `dir`.
    pub fn has_live_below(&self, folder: &FolderId, dir: &RelPath) -> Result<bool> {
        self.read(|c| {
            let Some(key) = self.key(c, folder)? else {
                return Ok(false);
            };
            let (lo, hi) = below_bounds(dir);
            let mut st = c.prepare_cached(
                "SELECT EXISTS (SELECT 1 FROM records \
                 WHERE folder = ?1 AND path >= ?2 AND path < ?3 AND deleted = 0)",
            )?;
            Ok(st.query_row(params![key, lo, hi], |r| r.get::<_, bool>(0))?)
        })
    }

    /// Live records whose path contains [`CONFLICT_MARKER`] (conflict siblings, and entries
    /// below a directory whose name holds it), ordered by path. Served by a partial index of
    /// exactly these records, so the cost does not grow with the folder.
    pub fn conflict_records(&self, folder: &FolderId) -> Result<Vec<StoredRecord>> {
        self.read(|c| {
            let Some(key) = self.key(c, folder)? else {
                return Ok(Vec::new());
            };
            // The literal must match the partial index (schema migration 2) for SQLite to use it.
            let mut st = c.prepare_cached(&format!(
                "SELECT {RECORD_COLUMNS} FROM records INDEXED BY records_conflicts \
                 WHERE folder = ?1 AND deleted = 0 AND instr(path, '.sync-conflict-') > 0 \
                 ORDER BY path"
            ))?;
            let mut rows = st.query(params![key])?;
            let mut out = Vec::new();
            while let Some(r) = rows.next()? {
                out.push(rows::stored_record(folder, r)?);
            }
            Ok(out)
        })
    }

    /// Calls `f` with every current record (tombstones too), ordered by path, one row at a
    /// time (memory does not grow with the folder), until `f` breaks.
    ///
    /// The statement stays open while `f` runs: `f` may read the journal, but a write through
    /// another connection waits for it (WAL readers do not block writers of this database,
    /// but this connection's own writes are impossible while it is borrowed).
    pub fn for_each_record(
        &self,
        folder: &FolderId,
        f: &mut dyn FnMut(StoredRecord) -> ControlFlow<()>,
    ) -> Result<()> {
        self.read(|c| {
            let Some(key) = self.key(c, folder)? else {
                return Ok(());
            };
            let mut st = c.prepare_cached(&format!(
                "SELECT {RECORD_COLUMNS} FROM records WHERE folder = ?1 ORDER BY path"
            ))?;
            let mut rows = st.query([key])?;
            while let Some(r) = rows.next()? {
                if f(rows::stored_record(folder, r)?).is_break() {
                    break;
                }
            }
            Ok(())
        })
    }

    /// What change detection needs of every current record (tombstones too), ordered by path:
    /// kind, deletion, mode, mtime, hash and the local stat — without chunk lists or vectors,
    /// so a scan of an unchanged 100,000-file tree neither decodes nor holds full records.
    pub fn for_each_summary(
        &self,
        folder: &FolderId,
        f: &mut dyn FnMut(RecordSummary) -> ControlFlow<()>,
    ) -> Result<()> {
        self.read(|c| {
            let Some(key) = self.key(c, folder)? else {
                return Ok(());
            };
            let mut st = c.prepare_cached(&format!(
                "SELECT {} FROM records WHERE folder = ?1 ORDER BY path",
                rows::SUMMARY_COLUMNS
            ))?;
            let mut rows = st.query([key])?;
            while let Some(r) = rows.next()? {
                if f(rows::summary(folder, r)?).is_break() {
                    break;
                }
            }
            Ok(())
        })
    }

    /// Current records with a sequence greater than `after`, ascending, at most `limit`.
    pub fn records_since(
        &self,
        folder: &FolderId,
        after: u64,
        limit: usize,
    ) -> Result<Vec<StoredRecord>> {
        self.read(|c| {
            let Some(key) = self.key(c, folder)? else {
                return Ok(Vec::new());
            };
            let mut st = c.prepare_cached(&format!(
                "SELECT {RECORD_COLUMNS} FROM records \
                 WHERE folder = ?1 AND sequence > ?2 ORDER BY sequence LIMIT ?3"
            ))?;
            let mut rows = st.query(params![key, to_i64(after), limit_sql(limit)])?;
            let mut out = Vec::new();
            while let Some(r) = rows.next()? {
                out.push(rows::stored_record(folder, r)?);
            }
            Ok(out)
        })
    }

    /// Journals `changes` in one transaction (see the module's commit order), timestamping
    /// history with the wall clock. Returns the assigned sequences, in order.
    pub fn commit(&mut self, folder: &FolderId, changes: Vec<Change>) -> Result<Vec<u64>> {
        self.commit_at(folder, changes, now_ns())
    }

    /// [`Journal::commit`] with an explicit history time (ns since the Unix epoch).
    pub fn commit_at(
        &mut self,
        folder: &FolderId,
        changes: Vec<Change>,
        time_ns: i64,
    ) -> Result<Vec<u64>> {
        self.write(|tx| commit_in(tx, folder, &changes, time_ns).map(|(_, seqs)| seqs))
    }

    /// Records what the scanner saw on disk for an existing record: no new version, no
    /// history. Nothing happens if the path has no record.
    pub fn set_local_stat(
        &mut self,
        folder: &FolderId,
        path: &RelPath,
        local: LocalStat,
    ) -> Result<()> {
        self.set_local_stats(folder, &[(path.clone(), local)])
    }

    /// [`Journal::set_local_stat`] for many paths in one transaction.
    pub fn set_local_stats(
        &mut self,
        folder: &FolderId,
        items: &[(RelPath, LocalStat)],
    ) -> Result<()> {
        self.write(|tx| {
            let Some((key, _)) = lookup_folder(tx, folder)? else {
                return Ok(());
            };
            let placeholders = any_absent(tx, key)?;
            for (path, l) in items {
                set_local(tx, key, path, l, placeholders)?;
            }
            Ok(())
        })
    }

    /// History rows matching `q`, ascending by sequence (see [`HistoryQuery`] for `limit`).
    pub fn history(&self, folder: &FolderId, q: &HistoryQuery) -> Result<Vec<HistoryEntry>> {
        self.read(|c| {
            let Some(key) = self.key(c, folder)? else {
                return Ok(Vec::new());
            };
            let mut sql = format!("SELECT {HISTORY_COLUMNS} FROM history WHERE folder = ?");
            let mut args = vec![Value::Integer(key)];
            if let Some(p) = &q.path {
                // [p, p0) holds p, everything below it, and names like "p.txt" that sort
                // between them; the last clause keeps only p and "p/…".
                let (below, hi) = below_bounds(p);
                sql.push_str(" AND path >= ? AND path < ? AND (path = ? OR path >= ?)");
                args.push(Value::Text(p.as_str().to_string()));
                args.push(Value::Text(hi));
                args.push(Value::Text(p.as_str().to_string()));
                args.push(Value::Text(below));
            }
            if !q.bookkeeping {
                sql.push_str(" AND op != 'merged'");
            }
            if let Some(d) = q.device {
                sql.push_str(" AND modified_by = ?");
                args.push(Value::Integer(to_i64(d.0)));
            }
            if let Some(t) = q.since_time_ns {
                sql.push_str(" AND time_ns >= ?");
                args.push(Value::Integer(t));
            }
            if let Some(s) = q.since_sequence {
                sql.push_str(" AND sequence > ?");
                args.push(Value::Integer(to_i64(s)));
            }
            let oldest_first =
                !q.newest && (q.since_time_ns.is_some() || q.since_sequence.is_some());
            sql.push_str(if oldest_first {
                " ORDER BY sequence ASC LIMIT ?"
            } else {
                " ORDER BY sequence DESC LIMIT ?"
            });
            args.push(Value::Integer(q.limit.map_or(-1, limit_sql)));
            let mut st = c.prepare_cached(&sql)?;
            let mut rows = st.query(params_from_iter(args))?;
            let mut out = Vec::new();
            while let Some(r) = rows.next()? {
                out.push(rows::history_entry(folder, r)?);
            }
            if !oldest_first {
                out.reverse();
            }
            Ok(out)
        })
    }

    /// The history operation of each of `sequences` that still has a history entry (pruned
    /// ones are absent).
    pub fn ops_of(&self, folder: &FolderId, sequences: &[u64]) -> Result<HashMap<u64, Op>> {
        self.read_many(|c| {
            let mut out = HashMap::new();
            let Some(key) = self.key(c, folder)? else {
                return Ok(out);
            };
            let mut st =
                c.prepare_cached("SELECT op FROM history WHERE folder = ?1 AND sequence = ?2")?;
            for &seq in sequences {
                let op: Option<String> = st
                    .query_row(params![key, to_i64(seq)], |r| r.get(0))
                    .optional()?;
                if let Some(op) = op.as_deref().and_then(Op::parse) {
                    out.insert(seq, op);
                }
            }
            Ok(out)
        })
    }

    /// The highest sequence in the folder's history (0 if it has none).
    pub fn max_history_sequence(&self, folder: &FolderId) -> Result<u64> {
        self.read(|c| {
            let Some(key) = self.key(c, folder)? else {
                return Ok(0);
            };
            let max: Option<i64> = c
                .prepare_cached("SELECT max(sequence) FROM history WHERE folder = ?1")?
                .query_row([key], |r| r.get(0))?;
            Ok(max.map_or(0, to_u64))
        })
    }

    /// How far `peer` and this device got with the folder's index; zeros when unknown.
    pub fn peer_progress(&self, folder: &FolderId, peer: &DeviceId) -> Result<PeerProgress> {
        self.read(|c| {
            let Some(key) = self.key(c, folder)? else {
                return Ok(PeerProgress::default());
            };
            let mut st = c.prepare_cached(
                "SELECT their_index_id, their_sequence, our_acked FROM peers \
                 WHERE folder = ?1 AND peer = ?2",
            )?;
            let row = st
                .query_row(params![key, &peer.as_bytes()[..]], |r| {
                    Ok(PeerProgress {
                        their_index_id: to_u64(r.get(0)?),
                        their_sequence: to_u64(r.get(1)?),
                        our_acked: to_u64(r.get(2)?),
                    })
                })
                .optional()?;
            Ok(row.unwrap_or_default())
        })
    }

    /// Records that the peer's records up to `sequence` of its index `index_id` are applied
    /// here (creating the folder if missing).
    pub fn set_their_sequence(
        &mut self,
        folder: &FolderId,
        peer: &DeviceId,
        index_id: u64,
        sequence: u64,
    ) -> Result<()> {
        self.write(|tx| {
            let (key, _) = ensure_folder(tx, folder)?;
            tx.prepare_cached(
                "INSERT INTO peers (folder, peer, their_index_id, their_sequence, our_acked) \
                 VALUES (?1, ?2, ?3, ?4, 0) ON CONFLICT (folder, peer) DO UPDATE SET \
                 their_index_id = excluded.their_index_id, \
                 their_sequence = excluded.their_sequence",
            )?
            .execute(params![
                key,
                &peer.as_bytes()[..],
                to_i64(index_id),
                to_i64(sequence)
            ])?;
            Ok(())
        })
    }

    /// Records that the peer acknowledged our records up to `sequence` (creating the folder
    /// if missing).
    pub fn set_our_acked(
        &mut self,
        folder: &FolderId,
        peer: &DeviceId,
        sequence: u64,
    ) -> Result<()> {
        self.write(|tx| {
            let (key, _) = ensure_folder(tx, folder)?;
            tx.prepare_cached(
                "INSERT INTO peers (folder, peer, their_index_id, their_sequence, our_acked) \
                 VALUES (?1, ?2, 0, 0, ?3) ON CONFLICT (folder, peer) DO UPDATE SET \
                 our_acked = excluded.our_acked",
            )?
            .execute(params![key, &peer.as_bytes()[..], to_i64(sequence)])?;
            Ok(())
        })
    }

    /// Forgets the peer's progress in every folder, and the versions from it that waited for
    /// a writer: they could only be fetched from it, and would keep every folder waiting.
    pub fn forget_peer(&mut self, peer: &DeviceId) -> Result<()> {
        self.write(|tx| {
            tx.execute("DELETE FROM peers WHERE peer = ?1", [&peer.as_bytes()[..]])?;
            tx.execute(
                "DELETE FROM deferred WHERE source = ?1",
                [&peer.as_bytes()[..]],
            )?;
            Ok(())
        })
    }

    /// Where local copies of the chunk `hash` live in `folder`, placeholders left out (their
    /// bytes are not content, D90) (at most
    /// [`MAX_CHUNK_LOCATIONS`]).
    pub fn find_chunk(&self, folder: &FolderId, hash: &Hash) -> Result<Vec<ChunkLocation>> {
        self.read(|c| {
            let Some(key) = self.key(c, folder)? else {
                return Ok(Vec::new());
            };
            let mut st = c.prepare_cached(
                "SELECT r.path, c.file_offset, c.len, r.local_inode, r.local_size, r.local_mtime_ns, \
                 r.local_ctime_ns, r.local_mode FROM chunks c \
                 JOIN records r ON r.id = c.record \
                 WHERE c.hash_key = ?1 AND c.hash = ?2 AND c.folder = ?3 \
                 AND NOT EXISTS (SELECT 1 FROM absent a WHERE a.folder = c.folder \
                 AND a.inode = r.local_inode) LIMIT ?4",
            )?;
            let mut rows = st.query(params![
                hash_key(hash),
                &hash.0[..],
                key,
                limit_sql(MAX_CHUNK_LOCATIONS)
            ])?;
            let mut out = Vec::new();
            while let Some(r) = rows.next()? {
                out.push(chunk_location(folder.clone(), r, 0)?);
            }
            Ok(out)
        })
    }

    /// [`Journal::find_chunk`] for each of `hashes`, in one read transaction (one round of WAL
    /// locks for a whole chunk request, not one per chunk). A lookup that fails finds nothing.
    pub fn find_chunks(&mut self, folder: &FolderId, hashes: &[Hash]) -> Vec<Vec<ChunkLocation>> {
        let began = !self.reading;
        self.begin_reads();
        let found = hashes
            .iter()
            .map(|h| self.find_chunk(folder, h).unwrap_or_default())
            .collect();
        if began {
            self.end_reads();
        }
        found
    }

    /// Where local copies of the chunk `hash` live in any folder (at most
    /// [`MAX_CHUNK_LOCATIONS`]).
    pub fn find_chunk_anywhere(&self, hash: &Hash) -> Result<Vec<ChunkLocation>> {
        self.read(|c| {
            let mut st = c.prepare_cached(
                "SELECT f.name, r.path, c.file_offset, c.len, r.local_inode, r.local_size, \
                 r.local_mtime_ns, r.local_ctime_ns, r.local_mode FROM chunks c \
                 JOIN records r ON r.id = c.record JOIN folders f ON f.id = c.folder \
                 WHERE c.hash_key = ?1 AND c.hash = ?2 LIMIT ?3",
            )?;
            let mut rows = st.query(params![
                hash_key(hash),
                &hash.0[..],
                limit_sql(MAX_CHUNK_LOCATIONS)
            ])?;
            let mut out = Vec::new();
            while let Some(r) = rows.next()? {
                let name: String = r.get(0)?;
                out.push(chunk_location(rows::folder_id(&name)?, r, 1)?);
            }
            Ok(out)
        })
    }

    /// Writes the pending side of the apply bracket (docs/design.md, "Safe apply"): these remote versions are
    /// about to be renamed into place. One transaction, flushed to disk before it returns;
    /// replaces any pending row of the same paths. [`Journal::commit`] of a path, or
    /// [`Journal::clear_pending`], removes its row.
    pub fn put_pending(
        &mut self,
        folder: &FolderId,
        items: &[(FileRecord, Option<DeviceId>)],
    ) -> Result<()> {
        // FULL only around this transaction: the promise must be durable before any rename.
        // SQLite refuses to change it inside a transaction: let go of an open read first.
        let resume = self.reading;
        self.end_reads();
        let full = self
            .conn
            .pragma_update(None, "synchronous", "FULL")
            .map_err(|e| classify(&self.path, e.into()));
        if let Err(e) = full {
            if resume {
                self.begin_reads();
            }
            return Err(e);
        }
        let written = self.write(|tx| {
            let (key, _) = ensure_folder(tx, folder)?;
            let mut st = tx.prepare_cached(
                "INSERT OR REPLACE INTO pending (folder, path, record, source) \
                 VALUES (?1, ?2, ?3, ?4)",
            )?;
            for (record, source) in items {
                record
                    .validate()
                    .map_err(|source| JournalError::InvalidRecord {
                        folder: folder.clone(),
                        source,
                    })?;
                st.execute(params![
                    key,
                    record.path.as_str(),
                    encode(record, "pending record")?,
                    device_blob(source)
                ])?;
            }
            Ok(())
        });
        let restored = self
            .conn
            .pragma_update(None, "synchronous", "NORMAL")
            .map_err(|e| classify(&self.path, e.into()));
        if resume {
            self.begin_reads();
        }
        written.and(restored)
    }

    /// The pending rows of the folder, ordered by path.
    pub fn pending(&self, folder: &FolderId) -> Result<Vec<(FileRecord, Option<DeviceId>)>> {
        self.held_records(
            folder,
            "SELECT path, record, source FROM pending WHERE folder = ?1 ORDER BY path",
        )
    }

    /// The (record, source) rows `sql` selects for the folder (`pending` and `deferred`
    /// have the same shape).
    fn held_records(
        &self,
        folder: &FolderId,
        sql: &str,
    ) -> Result<Vec<(FileRecord, Option<DeviceId>)>> {
        self.read(|c| {
            let Some(key) = self.key(c, folder)? else {
                return Ok(Vec::new());
            };
            let mut st = c.prepare_cached(sql)?;
            let mut rows = st.query([key])?;
            let mut out = Vec::new();
            while let Some(r) = rows.next()? {
                out.push(rows::pending_item(folder, r)?);
            }
            Ok(out)
        })
    }

    /// Removes the pending rows of `paths` (an apply that was abandoned), in one transaction.
    pub fn clear_pending(&mut self, folder: &FolderId, paths: &[RelPath]) -> Result<()> {
        self.write(|tx| {
            let Some((key, _)) = lookup_folder(tx, folder)? else {
                return Ok(());
            };
            let mut st =
                tx.prepare_cached("DELETE FROM pending WHERE folder = ?1 AND path = ?2")?;
            for p in paths {
                st.execute(params![key, p.as_str()])?;
            }
            Ok(())
        })
    }

    /// Keeps `record`, a remote version from `peer` that waits for a writer through the mount
    /// to let go of its path (replacing what waited there before). The peer counts it as
    /// received once its batch is acknowledged: without this row a restart would forget it.
    pub fn put_deferred(
        &mut self,
        folder: &FolderId,
        record: &FileRecord,
        peer: &DeviceId,
    ) -> Result<()> {
        record
            .validate()
            .map_err(|source| JournalError::InvalidRecord {
                folder: folder.clone(),
                source,
            })?;
        let blob = encode(record, "deferred record")?;
        self.write(|tx| {
            let (key, _) = ensure_folder(tx, folder)?;
            tx.prepare_cached(
                "INSERT OR REPLACE INTO deferred (folder, path, record, source) \
                 VALUES (?1, ?2, ?3, ?4)",
            )?
            .execute(params![
                key,
                record.path.as_str(),
                blob,
                &peer.as_bytes()[..]
            ])?;
            Ok(())
        })
    }

    /// The remote versions of the folder that wait for a writer, with the peer each came
    /// from, ordered by path.
    pub fn deferred(&self, folder: &FolderId) -> Result<Vec<(FileRecord, DeviceId)>> {
        self.held_records(
            folder,
            "SELECT path, record, source FROM deferred WHERE folder = ?1 ORDER BY path",
        )?
        .into_iter()
        .map(|(record, source)| match source {
            Some(peer) => Ok((record, peer)),
            None => Err(JournalError::Corrupt {
                what: format!("folder {folder}: deferred {} names no peer", record.path),
            }),
        })
        .collect()
    }

    /// Forgets the waiting version `record` once it has been decided; a newer version that
    /// waits at the same path since (the writer opened it again) is kept.
    pub fn clear_deferred(&mut self, folder: &FolderId, record: &FileRecord) -> Result<()> {
        let blob = encode(record, "deferred record")?;
        self.write(|tx| {
            let Some((key, _)) = lookup_folder(tx, folder)? else {
                return Ok(());
            };
            tx.prepare_cached(
                "DELETE FROM deferred WHERE folder = ?1 AND path = ?2 AND record = ?3",
            )?
            .execute(params![key, record.path.as_str(), blob])?;
            Ok(())
        })
    }

    /// How many live files, directories and symlinks, bytes and tombstones the folder holds.
    ///
    /// Kept up to date by every commit (and tombstone pruning), so this reads one row.
    pub fn counts(&self, folder: &FolderId) -> Result<FolderCounts> {
        self.read(|c| {
            let mut st = c.prepare_cached(
                "SELECT files, dirs, symlinks, bytes, tombstones FROM folders WHERE name = ?1",
            )?;
            let row = st
                .query_row([folder.as_str()], |r| {
                    Ok([r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?])
                })
                .optional()?;
            let Some(values) = row else {
                return Ok(FolderCounts::default());
            };
            let [files, dirs, symlinks, bytes, tombstones] = values.map(|v: i64| u64::try_from(v));
            let bad = |_| JournalError::Corrupt {
                what: format!("folder {folder}: a count is negative: {values:?}"),
            };
            Ok(FolderCounts {
                files: files.map_err(bad)?,
                dirs: dirs.map_err(bad)?,
                symlinks: symlinks.map_err(bad)?,
                bytes: bytes.map_err(bad)?,
                tombstones: tombstones.map_err(bad)?,
            })
        })
    }

    /// Counts the folder's records from scratch (what [`Journal::counts`] keeps
    /// incrementally): for checks and repairs, it reads every record.
    pub fn recount(&self, folder: &FolderId) -> Result<FolderCounts> {
        self.read(|c| {
            let mut counts = FolderCounts::default();
            let Some(key) = self.key(c, folder)? else {
                return Ok(counts);
            };
            let mut st = c.prepare_cached(
                "SELECT kind, deleted, count(*), coalesce(sum(size), 0) FROM records \
                 WHERE folder = ?1 GROUP BY kind, deleted",
            )?;
            let mut rows = st.query([key])?;
            while let Some(r) = rows.next()? {
                let kind: String = r.get(0)?;
                let deleted: bool = r.get(1)?;
                let n = to_u64(r.get(2)?);
                let bytes = to_u64(r.get(3)?);
                if deleted {
                    counts.tombstones += n;
                    continue;
                }
                match FileKind::parse(&kind) {
                    Some(FileKind::File) => {
                        counts.files += n;
                        counts.bytes += bytes;
                    }
                    Some(FileKind::Dir) => counts.dirs += n,
                    Some(FileKind::Symlink) => counts.symlinks += n,
                    None => {
                        return Err(JournalError::Corrupt {
                            what: format!("folder {folder}: records of unknown kind {kind:?}"),
                        })
                    }
                }
            }
            Ok(counts)
        })
    }

    /// Deletes history rows journaled before `older_than_ns`, but for each path's newest row
    /// while the path has a record (what the folder is: `state_at` finds a file unchanged for
    /// years) and every row whose version is still listed in `versions` (a kept version stays
    /// listed). Current records are untouched. At most `limit` rows per call (one
    /// transaction: a long history's first compaction does not hold the journal for long).
    /// Returns how many rows were deleted.
    pub fn prune_history(
        &mut self,
        folder: &FolderId,
        older_than_ns: i64,
        limit: usize,
    ) -> Result<u64> {
        self.write(|tx| {
            let Some((key, _)) = lookup_folder(tx, folder)? else {
                return Ok(0);
            };
            let n = tx.execute(
                "DELETE FROM history WHERE folder = ?1 AND sequence IN (\
                 SELECT h.sequence FROM history h WHERE h.folder = ?1 AND h.time_ns < ?2 \
                 AND NOT EXISTS (SELECT 1 FROM versions v WHERE v.folder = h.folder \
                    AND v.sequence = h.sequence) \
                 AND (EXISTS (SELECT 1 FROM history n WHERE n.folder = h.folder \
                        AND n.path = h.path AND n.sequence > h.sequence) \
                    OR NOT EXISTS (SELECT 1 FROM records r WHERE r.folder = h.folder \
                        AND r.path = h.path)) \
                 LIMIT ?3)",
                params![key, older_than_ns, limit_sql(limit)],
            )?;
            Ok(n as u64)
        })
    }

    /// Deletes tombstones whose last change was journaled before `older_than_ns`. Returns how
    /// many were deleted.
    pub fn prune_tombstones(&mut self, folder: &FolderId, older_than_ns: i64) -> Result<u64> {
        self.write(|tx| {
            let Some((key, _)) = lookup_folder(tx, folder)? else {
                return Ok(0);
            };
            // Tombstones have no chunk rows; this keeps it so even if one had.
            tx.execute(
                "DELETE FROM chunks WHERE record IN (SELECT id FROM records \
                 WHERE folder = ?1 AND deleted = 1 AND changed_at < ?2)",
                params![key, older_than_ns],
            )?;
            let n = tx.execute(
                "DELETE FROM records WHERE folder = ?1 AND deleted = 1 AND changed_at < ?2",
                params![key, older_than_ns],
            )?;
            tx.execute(
                "UPDATE folders SET tombstones = tombstones - ?2 WHERE id = ?1",
                params![key, n as i64],
            )?;
            Ok(n as u64)
        })
    }
}

/// One [`Journal::commit_at`] under way in its transaction: the statements it runs for every
/// change, prepared once, and what it has done so far.
struct Commit<'c> {
    tx: &'c Connection,
    folder: &'c FolderId,
    key: i64,
    time_ns: i64,
    /// The last sequence assigned.
    seq: u64,
    tally: Tally,
    probe: CachedStatement<'c>,
    insert: CachedStatement<'c>,
    update: CachedStatement<'c>,
    history: CachedStatement<'c>,
    drop_chunks: CachedStatement<'c>,
    add_chunk: CachedStatement<'c>,
    drop_pending: CachedStatement<'c>,
    any_pending: bool,
    any_absent: bool,
    keep_version: CachedStatement<'c>,
    /// The folder has local changes not sent (receive-only): a peer's version ends one.
    any_local_only: bool,
    /// Inodes the changed records named before, no longer: their placeholder rows, if any,
    /// are dropped at the end ([`forget_absent`]; after every change, so a placeholder renamed
    /// in the same commit keeps its row).
    left: Vec<i64>,
}

/// The current record a change replaces.
struct Existing {
    id: i64,
    kind: FileKind,
    deleted: bool,
    size: u64,
    hash: Hash,
    /// The inode of the file it was last seen in.
    local_inode: Option<i64>,
}

impl Existing {
    /// Whether `new` makes this record's content leave the tree: a live file or symlink
    /// replaced by a tombstone, another kind, or other content (a metadata or vector change
    /// keeps it).
    fn leaves_for(&self, new: &FileRecord) -> bool {
        !self.deleted
            && matches!(self.kind, FileKind::File | FileKind::Symlink)
            && (new.deleted || new.kind != self.kind || new.hash != self.hash)
    }
}

/// A change with its sequence, its version vector and chunk list encoded.
struct Encoded<'a> {
    change: &'a Change,
    seq: u64,
    time_ns: i64,
    version: Vec<u8>,
    chunks: Vec<u8>,
}

impl Encoded<'_> {
    /// The parameters of [`INSERT_RECORD`] (`first`: the folder key) or [`UPDATE_RECORD`]
    /// (`first`: the record id).
    fn record_values(&self, first: i64) -> [Value; 20] {
        let rec = &self.change.record;
        let local = self.change.local.as_ref();
        let source = device_blob(&self.change.source);
        [
            Value::Integer(first),
            Value::Text(rec.path.as_str().to_string()),
            Value::Text(rec.kind.as_str().to_string()),
            Value::Integer(rec.deleted.into()),
            Value::Integer(rec.mode.into()),
            Value::Integer(rec.mtime_ns),
            Value::Integer(to_i64(rec.size)),
            Value::Blob(rec.hash.0.to_vec()),
            Value::Blob(self.chunks.clone()),
            Value::Text(rec.target.clone()),
            Value::Blob(self.version.clone()),
            Value::Integer(to_i64(rec.modified_by.0)),
            Value::Integer(to_i64(self.seq)),
            local.map_or(Value::Null, |l| Value::Integer(to_i64(l.inode))),
            local.map_or(Value::Null, |l| Value::Integer(to_i64(l.size))),
            local.map_or(Value::Null, |l| Value::Integer(l.mtime_ns)),
            local.map_or(Value::Null, |l| Value::Integer(l.ctime_ns)),
            local.map_or(Value::Null, |l| Value::Integer(l.mode.into())),
            source.map_or(Value::Null, |s| Value::Blob(s.to_vec())),
            Value::Integer(self.time_ns),
        ]
    }
}

impl<'c> Commit<'c> {
    /// Prepares a commit to folder `key`, whose last sequence is `seq`.
    fn prepare(
        tx: &'c Connection,
        folder: &'c FolderId,
        key: i64,
        seq: u64,
        time_ns: i64,
    ) -> Result<Commit<'c>> {
        Ok(Commit {
            tx,
            folder,
            key,
            time_ns,
            seq,
            tally: Tally::default(),
            probe: tx.prepare_cached(
                "SELECT id, kind, deleted, size, hash, local_inode FROM records \
                 WHERE folder = ?1 AND path = ?2",
            )?,
            insert: tx.prepare_cached(INSERT_RECORD)?,
            update: tx.prepare_cached(UPDATE_RECORD)?,
            history: tx.prepare_cached(INSERT_HISTORY)?,
            drop_chunks: tx.prepare_cached("DELETE FROM chunks WHERE record = ?1")?,
            add_chunk: tx.prepare_cached(
                "INSERT INTO chunks (record, file_offset, len, hash_key, hash, folder) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            )?,
            drop_pending: tx
                .prepare_cached("DELETE FROM pending WHERE folder = ?1 AND path = ?2")?,
            // Pending rows are rare; when there are none, skip one probe per change.
            any_pending: tx
                .prepare_cached("SELECT EXISTS (SELECT 1 FROM pending WHERE folder = ?1)")?
                .query_row([key], |r| r.get(0))?,
            // Folders on demand only: when no placeholder is listed, no probe per change.
            any_absent: any_absent(tx, key)?,
            keep_version: tx.prepare_cached(KEEP_VERSION)?,
            any_local_only: tx
                .prepare_cached("SELECT EXISTS (SELECT 1 FROM local_only WHERE folder = ?1)")?
                .query_row([key], |r| r.get(0))?,
            left: Vec::new(),
        })
    }

    /// Journals one change (step 3 of the module's commit order) and returns its sequence.
    fn change(&mut self, change: &Change) -> Result<u64> {
        let rec = &change.record;
        rec.validate()
            .map_err(|source| JournalError::InvalidRecord {
                folder: self.folder.clone(),
                source,
            })?;
        self.seq += 1;
        let encoded = Encoded {
            change,
            seq: self.seq,
            time_ns: self.time_ns,
            version: encode(&rec.version, "version vector")?,
            chunks: encode(&rec.chunks, "chunk list")?,
        };
        let existing = self.existing(rec)?;
        if let Some(e) = &existing {
            self.tally.remove(e.kind, e.deleted, e.size);
            // The version leaving the tree is remembered, in this transaction, before its
            // row is overwritten (`versions`: what `meshfs versions` and `restore` read).
            if e.leaves_for(rec) {
                self.keep_version
                    .execute(params![e.id, self.time_ns, to_i64(self.seq)])?;
            }
        }
        self.tally.add(rec.kind, rec.deleted, rec.size);
        let record_id = self.write_record(&encoded, existing.as_ref())?;
        if let Some(was) = existing
            .as_ref()
            .and_then(|e| e.local_inode)
            .filter(|_| self.any_absent)
        {
            let now = change.local.map(|l| to_i64(l.inode));
            if now.is_some_and(|n| n != was) || rec.deleted || rec.kind != FileKind::File {
                self.left.push(was);
            }
        }
        self.add_history(&encoded)?;
        if rec.kind == FileKind::File && !rec.deleted {
            self.add_chunks(rec, record_id)?;
        }
        if self.any_pending {
            self.drop_pending
                .execute(params![self.key, rec.path.as_str()])?;
        }
        // A shared version (a peer's) at a path a receive-only folder changed here ends that
        // local change: the path holds the shared state again.
        if self.any_local_only && change.source.is_some() {
            self.tx
                .prepare_cached("DELETE FROM local_only WHERE folder = ?1 AND path = ?2")?
                .execute(params![self.key, rec.path.as_str()])?;
        }
        Ok(self.seq)
    }

    /// The current record at `rec`'s path, if there is one.
    fn existing(&mut self, rec: &FileRecord) -> Result<Option<Existing>> {
        let folder = self.folder;
        type Row = ((i64, String, bool, i64), Vec<u8>, Option<i64>);
        let existing: Option<Row> = self
            .probe
            .query_row(params![self.key, rec.path.as_str()], |r| {
                Ok((
                    (r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?),
                    r.get(4)?,
                    r.get(5)?,
                ))
            })
            .optional()?;
        let Some(((id, kind, deleted, size), hash, local_inode)) = existing else {
            return Ok(None);
        };
        let kind = FileKind::parse(&kind).ok_or_else(|| JournalError::Corrupt {
            what: format!("folder {folder}, path {}: unknown kind {kind:?}", rec.path),
        })?;
        let hash = <[u8; 32]>::try_from(hash.as_slice())
            .map(Hash)
            .map_err(|_| JournalError::Corrupt {
                what: format!("folder {folder}, path {}: hash is not 32 bytes", rec.path),
            })?;
        Ok(Some(Existing {
            id,
            kind,
            deleted,
            size: to_u64(size),
            hash,
            local_inode,
        }))
    }

    /// Writes the current record: over `existing` in place, so its id stays (and its chunk
    /// rows go), or as a new row. Returns the record's id.
    fn write_record(&mut self, encoded: &Encoded<'_>, existing: Option<&Existing>) -> Result<i64> {
        let folder = self.folder;
        match existing {
            Some(&Existing {
                id, kind, deleted, ..
            }) => {
                let n = self
                    .update
                    .execute(params_from_iter(encoded.record_values(id)))?;
                if n != 1 {
                    return Err(JournalError::Corrupt {
                        what: format!(
                            "folder {folder}, path {}: record {id} vanished during a commit",
                            encoded.change.record.path
                        ),
                    });
                }
                // Only live files have chunk rows ([`Commit::change`] keeps it so).
                if (kind, deleted) == (FileKind::File, false) {
                    self.drop_chunks.execute([id])?;
                }
                Ok(id)
            }
            None => {
                self.insert
                    .execute(params_from_iter(encoded.record_values(self.key)))?;
                Ok(self.tx.last_insert_rowid())
            }
        }
    }

    /// Appends the change's history row.
    fn add_history(&mut self, encoded: &Encoded<'_>) -> Result<()> {
        let change = encoded.change;
        let rec = &change.record;
        self.history.execute(params![
            self.key,
            to_i64(encoded.seq),
            encoded.time_ns,
            rec.path.as_str(),
            change.op.as_str(),
            rec.kind.as_str(),
            rec.deleted,
            to_i64(rec.modified_by.0),
            device_blob(&change.source),
            encoded.version,
            &rec.hash.0[..],
            to_i64(rec.size),
            rec.mode,
            change.detail,
        ])?;
        Ok(())
    }

    /// Adds the chunk-index rows of record `record_id` (a live file): [`indexed_chunks`].
    fn add_chunks(&mut self, rec: &FileRecord, record_id: i64) -> Result<()> {
        for (offset, chunk) in indexed_chunks(rec) {
            self.add_chunk.execute(params![
                record_id,
                to_i64(offset),
                chunk.len,
                hash_key(&chunk.hash),
                &chunk.hash.0[..],
                self.key
            ])?;
        }
        Ok(())
    }

    /// Stores the folder's last sequence and its counts, adjusted by what each change replaced
    /// (step 4 of the module's commit order).
    fn finish(self) -> Result<()> {
        for inode in &self.left {
            forget_absent(self.tx, self.key, *inode)?;
        }
        self.tx
            .prepare_cached(
                "UPDATE folders SET max_sequence = ?2, files = files + ?3, dirs = dirs + ?4, \
                 symlinks = symlinks + ?5, bytes = bytes + ?6, tombstones = tombstones + ?7 \
                 WHERE id = ?1",
            )?
            .execute(params![
                self.key,
                to_i64(self.seq),
                self.tally.files,
                self.tally.dirs,
                self.tally.symlinks,
                self.tally.bytes,
                self.tally.tombstones
            ])?;
        Ok(())
    }
}

/// Changes to a folder's counts during one commit.
#[derive(Default)]
struct Tally {
    files: i64,
    dirs: i64,
    symlinks: i64,
    bytes: i64,
    tombstones: i64,
}

impl Tally {
    fn apply(&mut self, kind: FileKind, deleted: bool, size: u64, sign: i64) {
        if deleted {
            self.tombstones += sign;
            return;
        }
        match kind {
            FileKind::File => {
                self.files += sign;
                self.bytes = self.bytes.wrapping_add(sign.wrapping_mul(to_i64(size)));
            }
            FileKind::Dir => self.dirs += sign,
            FileKind::Symlink => self.symlinks += sign,
        }
    }

    fn add(&mut self, kind: FileKind, deleted: bool, size: u64) {
        self.apply(kind, deleted, size, 1);
    }

    fn remove(&mut self, kind: FileKind, deleted: bool, size: u64) {
        self.apply(kind, deleted, size, -1);
    }
}

/// Decodes `path, file_offset, len` and the record's five local-stat columns starting at column
/// `first`.
fn chunk_location(folder: FolderId, r: &rusqlite::Row<'_>, first: usize) -> Result<ChunkLocation> {
    let raw: String = r.get(first)?;
    let len: i64 = r.get(first + 2)?;
    let len = u32::try_from(len).map_err(|_| JournalError::Corrupt {
        what: format!("folder {folder}, path {raw:?}: chunk length {len} is not a u32"),
    })?;
    Ok(ChunkLocation {
        path: rows::path_of(&folder, &raw)?,
        offset: to_u64(r.get(first + 1)?),
        len,
        local: rows::local_stat_of(&folder, &raw, r, first + 3)?,
        folder,
    })
}

/// Records `l` as what `path`'s file is on disk (the stat a scan compares with).
/// Sets the record's local stat; `placeholders`: the folder lists placeholders, so the inode
/// the record named before loses its row ([`forget_absent`]).
fn set_local(
    tx: &Connection,
    key: i64,
    path: &RelPath,
    l: &LocalStat,
    placeholders: bool,
) -> Result<()> {
    let was: Option<i64> = if placeholders {
        tx.prepare_cached("SELECT local_inode FROM records WHERE folder = ?1 AND path = ?2")?
            .query_row(params![key, path.as_str()], |r| r.get(0))
            .optional()?
            .flatten()
    } else {
        None
    };
    tx.prepare_cached(
        "UPDATE records SET local_inode = ?3, local_size = ?4, local_mtime_ns = ?5, \
         local_ctime_ns = ?6, local_mode = ?7 WHERE folder = ?1 AND path = ?2",
    )?
    .execute(params![
        key,
        path.as_str(),
        to_i64(l.inode),
        to_i64(l.size),
        l.mtime_ns,
        l.ctime_ns,
        l.mode
    ])?;
    if let Some(was) = was.filter(|w| *w != to_i64(l.inode)) {
        forget_absent(tx, key, was)?;
    }
    Ok(())
}

/// Whether the folder `key` lists any placeholder (most folders: none).
pub(crate) fn any_absent(c: &Connection, key: i64) -> Result<bool> {
    Ok(
        c.prepare_cached("SELECT EXISTS (SELECT 1 FROM absent WHERE folder = ?1)")?
            .query_row([key], |r| r.get(0))?,
    )
}

/// Drops the placeholder row of `inode`, which a record named until now, unless a live record
/// still names it (a conflict sibling made as a hard link of the placeholder). Left behind
/// until the next `prune_absent`, the row would mark whatever file reuses the inode number as
/// not local: its chunks would not be served, and peers would skip its version as superseded.
fn forget_absent(tx: &Connection, key: i64, inode: i64) -> Result<()> {
    let listed: bool = tx
        .prepare_cached("SELECT EXISTS (SELECT 1 FROM absent WHERE folder = ?1 AND inode = ?2)")?
        .query_row(params![key, inode], |r| r.get(0))?;
    if listed {
        tx.prepare_cached(
            "DELETE FROM absent WHERE folder = ?1 AND inode = ?2 AND NOT EXISTS \
             (SELECT 1 FROM records WHERE folder = ?1 AND local_inode = ?2 AND deleted = 0)",
        )?
        .execute(params![key, inode])?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn op_names_round_trip() {
        for op in [
            Op::Create,
            Op::Modify,
            Op::Delete,
            Op::Rename,
            Op::Metadata,
            Op::Conflict,
        ] {
            assert_eq!(Op::parse(op.as_str()), Some(op));
        }
        assert_eq!(Op::parse("moved"), None);
    }

    #[test]
    fn below_bounds_hold_exactly_the_subtree() {
        let dir = RelPath::new("a/b").unwrap();
        let (lo, hi) = below_bounds(&dir);
        let inside = |p: &str| p >= lo.as_str() && p < hi.as_str();
        for p in ["a/b/c", "a/b/c/d", "a/b/\u{10FFFF}", "a/b/!"] {
            assert!(inside(p), "{p}");
        }
        for p in [
            "a/b",
            "a/b.txt",
            "a/b!",
            "a/b0",
            "a/bc",
            "a/c",
            "a/b\u{e9}/x",
        ] {
            assert!(!inside(p), "{p}");
        }
    }

    #[test]
    fn bit_cast_keeps_every_u64() {
        for v in [0, 1, i64::MAX as u64, i64::MAX as u64 + 1, u64::MAX] {
            assert_eq!(to_u64(to_i64(v)), v);
        }
    }

    #[test]
    fn sqlite_errors_that_concern_the_file_name_it() {
        let err = rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_CORRUPT),
            None,
        );
        let e = classify(Path::new("/x/journal.db"), JournalError::Sqlite(err));
        assert!(matches!(e, JournalError::Damaged { .. }));
        assert!(e.to_string().contains("/x/journal.db"), "{e}");
    }

    #[test]
    fn journal_is_send() {
        fn send<T: Send>() {}
        send::<Journal>();
    }
}
