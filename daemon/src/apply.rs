//! Applying a peer's records: the driver of [`reconcile::decide`]'s steps against the real
//! store and journal. This is the numbered commit order of `docs/architecture.md`:
//!
//! 1. decide every record against the journal (under the folder's lock); local-only steps
//!    (metadata, directories, symlinks, deletions, conflict siblings of local content) are done
//!    and journaled at once;
//! 2. file contents are assembled in temp files from local chunks (chunk index) and chunks
//!    fetched from the peer, each verified by blake3 (no lock held: local edits go on);
//! 3. every temp file is checked to be exactly covered by its verified chunks (the record's
//!    hash is its chunk list's, checked when the record was decoded, so the file is not read
//!    again), and the batch's temp files are made durable together (`syncfs`; still no lock);
//! 4. (lock) the records are journaled as *pending* in one transaction;
//! 5. each target is checked against the stat the journal expects (and the journal against the
//!    record the decision saw), and the temp file renamed over it; each touched directory is
//!    fsynced once;
//! 6. the applied records are committed in one transaction, which also clears their pending
//!    rows. A crash between 4 and 6 is completed at start-up ([`recover_pending`]).
//!
//! A target that changed on disk since it was last scanned is not replaced: the path is
//! rescanned (its local edit becomes a version) and the remote record decided again.

use crate::engine::{Engine, FolderRt};
use crate::journal::{Change, Journal, Op, StoredRecord};
use crate::reconcile::{self, Outcome, ReplicaView, Step};
use crate::store::{DirCache, Expect, LocalCopy, LocalStat, StoreError, TempFile};
use meshfs_protocol::{
    ChunkResponse, DeviceId, FileKind, FileRecord, FolderId, Hash, RelPath, VersionVector,
};
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use tokio::sync::oneshot;

/// Temp files kept open while a batch is assembled (beyond this they are closed and re-opened
/// on demand): a batch holds at most 1,000 records, well inside the 20,000-descriptor limit.
const MAX_OPEN_TEMPS: usize = 1024;

/// How often a record whose target keeps changing under us is decided again.
const MAX_ROUNDS: usize = 3;

/// The journal records read while deciding one batch, so that the parent directory shared by a
/// thousand records is read once, not a thousand times. Lives only inside [`decide_all`] (which
/// holds the journal), and forgets a path whenever a change to it is committed.
#[derive(Default)]
struct Memo(RefCell<HashMap<RelPath, Option<StoredRecord>>>);

impl Memo {
    fn get(
        &self,
        journal: &Journal,
        folder: &FolderId,
        path: &RelPath,
    ) -> Result<Option<StoredRecord>, String> {
        if let Some(v) = self.0.borrow().get(path) {
            return Ok(v.clone());
        }
        let v = journal.get(folder, path).map_err(|e| e.to_string())?;
        self.0.borrow_mut().insert(path.clone(), v.clone());
        Ok(v)
    }

    /// `change` is decided and done on disk but not committed yet: later reads see it.
    fn put(&self, change: &Change) {
        self.0.borrow_mut().insert(
            change.record.path.clone(),
            Some(StoredRecord {
                record: change.record.clone(),
                local: change.local,
                source: change.source,
            }),
        );
    }

    /// What apply expects to find on disk at `path` (see [`expect_of`]).
    fn expect(&self, journal: &Journal, folder: &FolderId, path: &RelPath) -> Expect {
        expect_of(self.get(journal, folder, path).ok().flatten().as_ref())
    }
}

struct View<'a> {
    journal: &'a Journal,
    folder: &'a FolderId,
    memo: &'a Memo,
}

impl ReplicaView for View<'_> {
    fn get(&self, path: &RelPath) -> Option<FileRecord> {
        self.memo
            .get(self.journal, self.folder, path)
            .ok()
            .flatten()
            .map(|s| s.record)
    }
    fn has_live_below(&self, dir: &RelPath) -> bool {
        self.journal
            .has_live_below(self.folder, dir)
            .unwrap_or(true)
    }
}

/// The version of the journal's record at a path when a transfer to it was decided (`None`:
/// no record; whether it is a tombstone is in the [`Expect`] beside it). The install goes
/// ahead only if the journal still holds the same, so a decision made before an earlier
/// batch's install (the receive pipeline) or a local edit landed is made again instead of
/// acted on.
type Basis = Option<VersionVector>;

/// What a transfer to a path records of the journal's record there when it is decided, and
/// what the install compares with the journal's record then.
fn seen_of(stored: Option<&StoredRecord>) -> (Expect, Basis) {
    (expect_of(stored), stored.map(|s| s.record.version.clone()))
}

/// A file content to assemble.
struct Transfer {
    record: FileRecord,
    op: Op,
    source: Option<DeviceId>,
    expect: Expect,
    basis: Basis,
    detail: Option<String>,
    /// The remote record this transfer serves (for re-deciding after a failed install).
    remote: FileRecord,
    /// The temp file, already holding every chunk found locally; none yet when no chunk was
    /// (it is made after the decision, outside the folder lock).
    temp: Option<TempFile>,
    /// Chunks still to fetch: (hash, length, offset in this file).
    missing: Vec<(Hash, u32, u64)>,
    /// Journal changes of the same decision that may only be committed once this file is
    /// installed (a local winner's merged vector must not exist without the remote loser's
    /// sibling, or a crash in between would lose the loser everywhere).
    then: Vec<Change>,
}

/// Starts a transfer: copies every chunk this device already has (any file of the folder,
/// through the chunk index) into a new temp file. Done at decision time, under the folder
/// lock, so a later deletion in the same batch (the old name of a renamed file) cannot take
/// the local copy away first. A file none of whose chunks is here gets its temp file later,
/// outside the lock (`transfer`): creating a thousand files was a fifth of a receiving
/// daemon's time under the lock, which the next batch's decision waits for.
#[allow(clippy::too_many_arguments)]
fn prepare(
    journal: &Journal,
    rt: &FolderRt,
    folder: &FolderId,
    record: FileRecord,
    op: Op,
    source: Option<DeviceId>,
    (expect, basis): (Expect, Basis),
    detail: Option<String>,
    remote: FileRecord,
    keep_open: bool,
    dirs: &mut DirCache,
) -> Result<Transfer, String> {
    // A record declares its size (a peer can declare terabytes in a few bytes, one chunk
    // listed many times): nothing is written that would leave the disk less than a margin.
    if let Err(free) = crate::store::room_for(rt.store.root(), record.size) {
        return Err(format!(
            "{}: No space left on device (os error 28): the version is {} bytes, {} are free",
            record.path, record.size, free
        ));
    }
    let mut temp: Option<TempFile> = None;
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
    if !copies.is_empty() {
        let t = temp.insert(
            rt.store
                .create_temp_in(dirs, &record.path, keep_open)
                .map_err(|e| e.to_string())?,
        );
        let absent = rt
            .store
            .copy_chunks_in(dirs, t, &copies)
            .map_err(|e| e.to_string())?;
        missing.extend(absent.into_iter().map(|i| {
            let c = &copies[i];
            (c.hash, c.len, c.offset)
        }));
    }
    if let (Some(t), false) = (&mut temp, keep_open) {
        rt.store.close_temp(t);
    }
    Ok(Transfer {
        record,
        op,
        source,
        expect,
        basis,
        detail,
        remote,
        temp,
        missing,
        then: Vec::new(),
    })
}

fn expect_of(stored: Option<&StoredRecord>) -> Expect {
    match stored {
        Some(s) if !s.record.deleted => match s.local {
            Some(l) => Expect::Matches(l),
            None => Expect::Anything,
        },
        _ => Expect::Absent,
    }
}

/// The peer a stored version came from: only when its vector is exactly the one received.
/// A resolution that changed the vector must be sent back to that peer too.
fn source_for(record: &FileRecord, remote: &FileRecord, peer: DeviceId) -> Option<DeviceId> {
    (record.version == remote.version).then_some(peer)
}

fn op_for(prev: Option<&FileRecord>, new: &FileRecord) -> Op {
    match prev {
        _ if new.deleted => Op::Delete,
        None => Op::Create,
        Some(p) if p.deleted => Op::Create,
        Some(p) if p.same_state(new) => Op::Merged,
        Some(p) if p.same_content(new) => Op::Metadata,
        Some(_) => Op::Modify,
    }
}

/// The paths a decided batch still has to install: its transfers' targets and their parent
/// directories.
#[derive(Debug, Default)]
pub struct InFlight {
    files: HashSet<RelPath>,
    dirs: HashSet<RelPath>,
}

impl InFlight {
    fn of(transfers: &[Transfer]) -> InFlight {
        let mut f = InFlight::default();
        for t in transfers {
            let p = &t.record.path;
            if f.files.insert(p.clone()) {
                f.dirs.extend(p.ancestors());
            }
        }
        f
    }

    /// These paths and `earlier`'s (a batch before, not yet installed).
    fn with(mut self, earlier: &InFlight) -> InFlight {
        self.files.extend(earlier.files.iter().cloned());
        self.dirs.extend(earlier.dirs.iter().cloned());
        self
    }

    /// Whether a decision about `path` depends on what these installs will change: the same
    /// path, a directory above one of them, or a path below one of them.
    fn overlaps(&self, path: &RelPath) -> bool {
        self.files.contains(path)
            || self.dirs.contains(path)
            || path.ancestors().iter().any(|a| self.files.contains(a))
    }
}

/// The batch before this one in a folder's receive pipeline (`session::RECEIVE_DEPTH`).
pub struct Before {
    /// Its paths in flight once it has decided, with those of the batches before it that had
    /// not installed yet (dropped: it failed).
    decided: oneshot::Receiver<Arc<InFlight>>,
    /// Fires once it has installed everything (dropped: it failed).
    installed: oneshot::Receiver<()>,
}

/// A Receive's place in its folder's receive pipeline. Batch N+1 decides once batch N has
/// decided, and — unless one of its paths overlaps N's paths in flight, when it waits for N's
/// install first — assembles and fetches while N installs; it installs, and reports itself
/// applied, only after N has. The overlap rule keeps decisions off a view N is about to change;
/// each install also checks that the journal still holds what its decision saw ([`Basis`]).
pub struct Turn {
    before: Option<Before>,
    decided: Option<oneshot::Sender<Arc<InFlight>>>,
    installed: Option<oneshot::Sender<()>>,
}

impl Turn {
    /// The turn after `before` (`None`: nothing in flight), and what the next batch waits on.
    pub fn after(before: Option<Before>) -> (Turn, Before) {
        let (dtx, drx) = oneshot::channel();
        let (itx, irx) = oneshot::channel();
        (
            Turn {
                before,
                decided: Some(dtx),
                installed: Some(itx),
            },
            Before {
                decided: drx,
                installed: irx,
            },
        )
    }
}

const EARLIER_FAILED: &str = "the batch received before this one failed to apply";

/// Waits for the batch before to have installed, if it has not been waited for yet.
async fn wait_installed(prev: &mut Option<oneshot::Receiver<()>>) -> Result<(), String> {
    match prev.take() {
        Some(rx) => rx.await.map_err(|_| EARLIER_FAILED.to_string()),
        None => Ok(()),
    }
}

/// Reconciles and applies `records` received from `peer`, in its turn of the folder's
/// receive pipeline.
pub async fn receive(
    engine: &Arc<Engine>,
    folder: &FolderId,
    peer: DeviceId,
    conn: &quinn::Connection,
    records: Vec<FileRecord>,
    mut inline: HashMap<Hash, ChunkResponse>,
    turn: Turn,
) -> Result<(), String> {
    let rt = engine
        .folder(folder)
        .ok_or_else(|| format!("folder {folder} is not running here"))?;
    let Turn {
        before,
        mut decided,
        installed,
    } = turn;
    let mut todo = order(records);
    let mut prev_installed = None;
    let mut prev_in_flight: Option<Arc<InFlight>> = None;
    if let Some(b) = before {
        let in_flight = b.decided.await.map_err(|_| EARLIER_FAILED.to_string())?;
        prev_installed = Some(b.installed);
        if todo.iter().any(|r| in_flight.overlaps(&r.path)) {
            wait_installed(&mut prev_installed).await?;
        } else {
            prev_in_flight = Some(in_flight);
        }
    }
    // What the next batch must not decide against: ours, and the earlier batches' while they
    // have not installed (several batches may be in flight, `session::RECEIVE_DEPTH`).
    let still_in_flight = |prev_installed: &mut Option<oneshot::Receiver<()>>,
                           prev: Option<Arc<InFlight>>|
     -> Option<Arc<InFlight>> {
        match prev_installed.as_mut().map(|rx| rx.try_recv()) {
            Some(Err(oneshot::error::TryRecvError::Empty)) => prev,
            // Installed: nothing to wait for any more.
            Some(Ok(())) => {
                *prev_installed = None;
                None
            }
            // Failed (this batch fails too when it waits), or already waited for.
            Some(Err(oneshot::error::TryRecvError::Closed)) | None => None,
        }
    };
    for _round in 0..MAX_ROUNDS {
        if todo.is_empty() {
            break;
        }
        let deciding = std::time::Instant::now();
        let this = {
            let engine = engine.clone();
            let rt = rt.clone();
            let folder = folder.clone();
            on_blocking(move || decide_all(&engine, &rt, &folder, peer, todo)).await?
        };
        let decide_ms = deciding.elapsed().as_millis() as u64;
        if let Some(tx) = decided.take() {
            let mine = InFlight::of(&this.transfers);
            let all = match still_in_flight(&mut prev_installed, prev_in_flight.take()) {
                Some(p) => mine.with(&p),
                None => mine,
            };
            let _ = tx.send(Arc::new(all));
        }
        todo = transfer(
            engine,
            &rt,
            folder,
            conn,
            this,
            decide_ms,
            &mut inline,
            &mut prev_installed,
        )
        .await?;
    }
    if !todo.is_empty() {
        tracing::warn!(%folder, n = todo.len(), "paths kept changing during apply; they will be retried");
        return Err("local files kept changing during apply".into());
    }
    if let Some(tx) = decided.take() {
        let _ = tx
            .send(still_in_flight(&mut prev_installed, prev_in_flight.take()).unwrap_or_default());
    }
    // Applied in order: not before the batch before this one.
    wait_installed(&mut prev_installed).await?;
    if let Some(tx) = installed {
        let _ = tx.send(());
    }
    Ok(())
}

/// Live records first, parents before children; then tombstones, children before parents.
fn order(mut records: Vec<FileRecord>) -> Vec<FileRecord> {
    records.sort_by(|a, b| {
        let ka = (
            a.deleted,
            if a.deleted {
                usize::MAX - depth(a)
            } else {
                depth(a)
            },
        );
        let kb = (
            b.deleted,
            if b.deleted {
                usize::MAX - depth(b)
            } else {
                depth(b)
            },
        );
        ka.cmp(&kb).then(a.sequence.cmp(&b.sequence))
    });
    records
}

fn depth(r: &FileRecord) -> usize {
    r.path.components().count()
}

fn conflict_detail(
    local: Option<&FileRecord>,
    remote: &FileRecord,
    winner_is_local: bool,
) -> String {
    let side = |r: &FileRecord| {
        serde_json::json!({
            "modified_by": r.modified_by.display7(),
            "mtime_ns": r.mtime_ns,
            "size": r.size,
            "hash": r.hash.to_string(),
            "deleted": r.deleted,
            "version": r.version.to_string(),
        })
    };
    serde_json::json!({
        "winner": if winner_is_local { "local" } else { "remote" },
        "local": local.map(side),
        "remote": side(remote),
    })
    .to_string()
}

/// A transfer's record and bookkeeping once its temp file is handed to the fetcher.
struct Meta {
    record: FileRecord,
    op: Op,
    source: Option<DeviceId>,
    expect: Expect,
    basis: Basis,
    detail: Option<String>,
    remote: FileRecord,
    then: Vec<Change>,
}

/// What step 1 leaves to do.
struct Decided {
    /// File contents to assemble.
    transfers: Vec<Transfer>,
    /// Remote records whose local target changed under us: rescan, then decide again.
    redo: Vec<FileRecord>,
    /// The directories the temp files were created in, reused to install them.
    dirs: DirCache,
}

/// Step 1: decide each record and do what needs no content transfer.
fn decide_all(
    engine: &Engine,
    rt: &FolderRt,
    folder: &FolderId,
    peer: DeviceId,
    records: Vec<FileRecord>,
) -> Result<Decided, String> {
    let _guard = rt.op_lock.lock().map_err(|_| "folder lock poisoned")?;
    let mut journal = engine.journal.lock().map_err(|_| "journal lock poisoned")?;
    let mut transfers = Vec::new();
    let mut redo = Vec::new();
    let mut dirs = DirCache::default();
    let memo = Memo::default();
    // Changes done on disk, committed together: one transaction per thousand records rather
    // than one per record (two devices starting from the same tree exchange every record and
    // each becomes a metadata-only change). Always committed, even when deciding fails.
    let mut done: Vec<Change> = Vec::new();
    journal.begin_reads();
    let result = decide_each(
        &mut journal,
        rt,
        folder,
        peer,
        records,
        &memo,
        &mut dirs,
        &mut done,
        &mut transfers,
        &mut redo,
    );
    journal.end_reads();
    let flushed = if done.is_empty() {
        Ok(())
    } else {
        journal
            .commit(folder, done)
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    result?;
    flushed?;
    Ok(Decided {
        transfers,
        redo,
        dirs,
    })
}

/// The loop of [`decide_all`]: decides and does each record, leaving the changes to commit in
/// `done` (committing them whenever a later decision must read them from SQLite).
#[allow(clippy::too_many_arguments)]
fn decide_each(
    journal: &mut Journal,
    rt: &FolderRt,
    folder: &FolderId,
    peer: DeviceId,
    records: Vec<FileRecord>,
    memo: &Memo,
    dirs: &mut DirCache,
    done: &mut Vec<Change>,
    transfers: &mut Vec<Transfer>,
    redo: &mut Vec<FileRecord>,
) -> Result<(), String> {
    for remote in records {
        // Tombstones come after every live record (children first) and ask SQLite whether
        // live entries remain below them: commit what this batch did so far first.
        if (remote.deleted || done.len() >= 1000) && !done.is_empty() {
            journal
                .commit(folder, std::mem::take(done))
                .map_err(|e| e.to_string())?;
        }
        let local_before = memo.get(journal, folder, &remote.path)?.map(|s| s.record);
        let decision = reconcile::decide(
            &View {
                journal,
                folder,
                memo,
            },
            &remote,
        );
        // Siblings made here, not through a temp file, go inside the apply bracket too: a
        // crash after the link or symlink is made and before its commit leaves a pending row
        // that start-up recognises (`recover_pending`), never an object the scan would take
        // for a user's edit.
        let made_here: Vec<(FileRecord, Option<DeviceId>)> = decision
            .steps
            .iter()
            .filter_map(|step| match step {
                Step::PreserveLocal { record, .. } => Some((record.clone(), None)),
                Step::PreserveRemote { record } if record.kind != FileKind::File => {
                    Some((record.clone(), None))
                }
                _ => None,
            })
            .collect();
        if !made_here.is_empty() {
            journal
                .put_pending(folder, &made_here)
                .map_err(|e| e.to_string())?;
        }
        let journal: &Journal = journal;
        // A conflict whose loser is already kept as a sibling (another device's resolution of
        // the same versions arriving here) keeps nothing new: it is not a resolution of its
        // own, and the journal shows it as the change it makes here.
        let keeps_a_loser = decision
            .steps
            .iter()
            .any(|s| matches!(s, Step::PreserveLocal { .. } | Step::PreserveRemote { .. }));
        let conflict = match decision.outcome {
            Outcome::Conflict { winner_is_local } if keeps_a_loser => Some(conflict_detail(
                local_before.as_ref(),
                &remote,
                winner_is_local,
            )),
            _ => None,
        };
        if let Some(d) = &conflict {
            tracing::info!(%folder, path = %remote.path, detail = %d, "conflict resolved");
        }
        let mut preserve_remote_at: Option<usize> = None;
        for step in decision.steps {
            let change = match step {
                Step::UpdateLocal { record } => {
                    let prev = memo.get(journal, folder, &record.path)?;
                    let mut local = prev.as_ref().and_then(|p| p.local);
                    if let (Some(p), false) = (&prev, record.deleted) {
                        let disk_differs = p.record.mode != record.mode
                            || (record.kind == FileKind::File
                                && p.record.mtime_ns != record.mtime_ns);
                        if disk_differs && record.kind != FileKind::Symlink {
                            let mtime = (record.kind == FileKind::File).then_some(record.mtime_ns);
                            match rt.store.set_meta(
                                &record.path,
                                record.mode,
                                mtime,
                                memo.expect(journal, folder, &record.path),
                            ) {
                                Ok(l) => local = Some(l),
                                Err(e) => {
                                    tracing::warn!(path = %record.path, error = %e, "cannot set metadata; the next scan will reconcile it")
                                }
                            }
                        }
                    }
                    let op = match &prev {
                        _ if conflict.is_some() => Op::Conflict,
                        Some(p) if p.record.same_state(&record) => Op::Merged,
                        _ => Op::Metadata,
                    };
                    Some(Change {
                        record,
                        op,
                        local,
                        source: None,
                        detail: conflict.clone(),
                    })
                }
                Step::ReviveDir { record } => {
                    let local = match rt.store.make_dir(&record.path, record.mode) {
                        Ok(l) => l,
                        Err(e) => {
                            skip_or_fail(rt, &remote, e)?;
                            break;
                        }
                    };
                    Some(Change {
                        record,
                        op: Op::Create,
                        local: Some(local),
                        source: None,
                        detail: Some("directory kept: a live entry below it".into()),
                    })
                }
                Step::PreserveLocal { from, record } => {
                    let expect = match memo.get(journal, folder, &from)?.and_then(|s| s.local) {
                        Some(l) => Expect::Matches(l),
                        None => Expect::Anything,
                    };
                    match rt.store.preserve_as(&from, &record.path, expect) {
                        Ok(local) => Some(Change {
                            record,
                            op: Op::Create,
                            local: Some(local),
                            source: None,
                            detail: conflict
                                .clone()
                                .or(Some(format!("conflict copy of {from}"))),
                        }),
                        Err(StoreError::Changed(_)) => {
                            // The local file changed since it was scanned: capture that edit, then decide again.
                            redo.push(remote.clone());
                            break;
                        }
                        Err(e) => {
                            skip_or_fail(rt, &remote, e)?;
                            break;
                        }
                    }
                }
                Step::PreserveRemote { record } if record.kind != FileKind::File => {
                    // A losing symlink (or directory) is made as what it is: only a regular
                    // file's content is assembled from chunks.
                    let expect = seen_of(memo.get(journal, folder, &record.path)?.as_ref()).0;
                    let made = match record.kind {
                        FileKind::Symlink => rt.store.make_symlink(
                            &record.path,
                            &record.target,
                            record.mtime_ns,
                            expect,
                        ),
                        _ => rt.store.make_dir(&record.path, record.mode),
                    };
                    match made {
                        Ok(local) => Some(Change {
                            record,
                            op: Op::Create,
                            local: Some(local),
                            source: None,
                            detail: conflict.clone(),
                        }),
                        Err(StoreError::Changed(_)) => {
                            redo.push(remote.clone());
                            break;
                        }
                        Err(e) => {
                            skip_or_fail(rt, &remote, e)?;
                            break;
                        }
                    }
                }
                Step::PreserveRemote { record } => {
                    let expect = seen_of(memo.get(journal, folder, &record.path)?.as_ref());
                    let keep_open = transfers.len() < MAX_OPEN_TEMPS;
                    preserve_remote_at = Some(transfers.len());
                    transfers.push(prepare(
                        journal,
                        rt,
                        folder,
                        record,
                        Op::Create,
                        None,
                        expect,
                        conflict.clone(),
                        remote.clone(),
                        keep_open,
                        dirs,
                    )?);
                    None
                }
                Step::ApplyRemote { record } => {
                    let prev = memo.get(journal, folder, &record.path)?;
                    let prev_rec = prev.as_ref().map(|p| &p.record);
                    let op = if conflict.is_some() {
                        Op::Conflict
                    } else {
                        op_for(prev_rec, &record)
                    };
                    let (expect, basis) = seen_of(prev.as_ref());
                    let live_prev = prev.as_ref().filter(|p| !p.record.deleted);
                    if rt.writers.has_writer(&record.path) {
                        // Open for writing through the mount: never replaced, renamed away or
                        // deleted under its writer. The rest of the batch goes on; this path
                        // is decided again after the last writing handle is released
                        // (`Engine::apply_deferred`).
                        tracing::info!(%folder, path = %record.path, "open for writing through the mount; the remote version waits for its release");
                        rt.defer(remote.clone(), peer);
                        continue;
                    }
                    let result: Result<Option<LocalStat>, StoreError> = if record.deleted {
                        match live_prev.map(|p| p.record.kind) {
                            Some(FileKind::Dir) => rt.store.remove_dir(&record.path).map(|_| None),
                            Some(_) => rt.store.remove_file(&record.path, expect).map(|_| None),
                            None => Ok(None),
                        }
                    } else {
                        match record.kind {
                            FileKind::Dir => {
                                if live_prev.is_some_and(|p| p.record.kind != FileKind::Dir) {
                                    rt.store
                                        .remove_file(&record.path, expect)
                                        .and_then(|_| rt.store.make_dir(&record.path, record.mode))
                                        .map(Some)
                                } else {
                                    rt.store.make_dir(&record.path, record.mode).map(Some)
                                }
                            }
                            FileKind::Symlink => rt
                                .store
                                .make_symlink(&record.path, &record.target, record.mtime_ns, expect)
                                .map(Some),
                            FileKind::File => {
                                if live_prev.is_some_and(|p| {
                                    p.record.kind == FileKind::File
                                        && p.record.hash == record.hash
                                        && p.record.size == record.size
                                }) {
                                    rt.store
                                        .set_meta(
                                            &record.path,
                                            record.mode,
                                            Some(record.mtime_ns),
                                            expect,
                                        )
                                        .map(Some)
                                } else {
                                    let keep_open = transfers.len() < MAX_OPEN_TEMPS;
                                    let source = source_for(&record, &remote, peer);
                                    transfers.push(prepare(
                                        journal,
                                        rt,
                                        folder,
                                        record,
                                        op,
                                        source,
                                        (expect, basis),
                                        conflict.clone(),
                                        remote.clone(),
                                        keep_open,
                                        dirs,
                                    )?);
                                    continue;
                                }
                            }
                        }
                    };
                    let source = source_for(&record, &remote, peer);
                    if let Ok(local) = &result {
                        if record.kind != FileKind::Dir {
                            rt.echoes.expect(record.path.clone(), *local);
                        }
                    }
                    match result {
                        Ok(local) => Some(Change {
                            record,
                            op,
                            local,
                            source,
                            detail: conflict.clone(),
                        }),
                        Err(StoreError::NotEmpty(p)) => {
                            tracing::info!(path = %p, "directory still holds untracked entries; kept on disk");
                            Some(Change {
                                record,
                                op,
                                local: None,
                                source,
                                detail: Some(
                                    "directory kept on disk: untracked entries inside".into(),
                                ),
                            })
                        }
                        Err(StoreError::Changed(p)) => {
                            tracing::debug!(path = %p, "changed under apply; rescanning and deciding again");
                            redo.push(remote.clone());
                            None
                        }
                        Err(e) => {
                            skip_or_fail(rt, &remote, e)?;
                            break;
                        }
                    }
                }
            };
            if let Some(c) = change {
                rt.unskip(&c.record.path);
                rt.invalidator.invalidate(&c.record.path);
                match preserve_remote_at {
                    Some(i) => transfers[i].then.push(c),
                    None => {
                        memo.put(&c);
                        done.push(c);
                    }
                }
            }
        }
    }
    Ok(())
}

/// Steps 2–6 for the transfers; returns the remote records to decide again. Installs only
/// after the batch before has (`prev_installed`).
#[allow(clippy::too_many_arguments)]
async fn transfer(
    engine: &Arc<Engine>,
    rt: &Arc<FolderRt>,
    folder: &FolderId,
    conn: &quinn::Connection,
    decided: Decided,
    decide_ms: u64,
    inline: &mut HashMap<Hash, ChunkResponse>,
    prev_installed: &mut Option<oneshot::Receiver<()>>,
) -> Result<Vec<FileRecord>, String> {
    let Decided {
        transfers: work,
        redo,
        dirs,
    } = decided;
    if !redo.is_empty() {
        rescan(engine, folder, &redo).await?;
    }
    if work.is_empty() {
        return Ok(redo);
    }
    let started = std::time::Instant::now();
    let files = work.len();
    let mut work = work;
    let mut missing: Wanted = HashMap::new();
    for (i, t) in work.iter_mut().enumerate() {
        for (h, len, off) in std::mem::take(&mut t.missing) {
            missing
                .entry(h)
                .or_insert((len, Vec::new()))
                .1
                .push((i, off));
        }
    }
    // The chunks the peer attached to the index for these files.
    let attached = missing
        .keys()
        .filter_map(|h| Some((*h, inline.remove(h)?)))
        .collect();
    // Temp files, and writing what is at hand into them, are a thousand system calls and more
    // for a batch of small files: on a blocking thread, not on the runtime that moves packets.
    let Assembled {
        mut temps,
        metas,
        missing,
        wanted,
        mut dirs,
    } = {
        let rt = rt.clone();
        on_blocking(move || assemble(&rt, dirs, work, missing, attached)).await?
    };
    if !wanted.is_empty() {
        let store = &rt.store;
        let mut sink = |hash: Hash, data: Vec<u8>| -> Result<(), String> {
            write_chunk(store, &missing, &mut temps, hash, &data)
        };
        match crate::peers::fetch(conn, folder, wanted, &mut sink).await {
            Ok(absent) => {
                // The peer no longer has these chunks: the version was superseded there, and its
                // successor follows in the index. Skip the files that need them (retrying would
                // livelock: the successor waits behind them in the same stream).
                for h in absent {
                    for (i, _) in missing.get(&h).map(|m| m.1.clone()).unwrap_or_default() {
                        if let Some(t) = temps.get_mut(i).and_then(Option::take) {
                            tracing::info!(%folder, path = %t.target, "version superseded on the peer before it was fetched; skipped");
                            rt.store.discard_temp(t);
                        }
                    }
                }
            }
            Err(e) => {
                discard_all(rt, temps.into_iter().flatten());
                return Err(e);
            }
        }
    }
    let fetched_at = started.elapsed();
    // Step 3: check every file is covered by its verified chunks, and flush them. The flush
    // needs no lock: it overlaps the install of the batch before this one.
    let ready = {
        let rt = rt.clone();
        on_blocking(move || finish_all(&rt, metas, temps)).await?
    };
    let verified_at = started.elapsed();
    wait_installed(prev_installed).await?;
    // Steps 4–6 under the folder lock.
    let engine2 = engine.clone();
    let rt2 = rt.clone();
    let folder2 = folder.clone();
    let mut changed =
        on_blocking(move || install(&engine2, &rt2, &folder2, &mut dirs, ready)).await?;
    if !changed.is_empty() {
        rescan(engine, folder, &changed).await?;
    }
    if files >= 100 {
        tracing::info!(%folder, files, decide_ms, fetch_ms = fetched_at.as_millis() as u64,
            verify_ms = (verified_at - fetched_at).as_millis() as u64,
            install_ms = (started.elapsed() - verified_at).as_millis() as u64, "batch applied");
    }
    changed.extend(redo);
    Ok(changed)
}

/// Runs a step that blocks (SQLite, the disk) on a blocking thread, off the runtime's workers.
async fn on_blocking<T: Send + 'static>(
    step: impl FnOnce() -> Result<T, String> + Send + 'static,
) -> Result<T, String> {
    tokio::task::spawn_blocking(step)
        .await
        .map_err(|e| e.to_string())?
}

/// Chunks wanted by a batch: each hash's length and where it goes (file index, offset).
type Wanted = HashMap<Hash, (u32, Vec<(usize, u64)>)>;

/// What [`assemble`] leaves for the network.
struct Assembled {
    /// One temp file per transfer (`None` once skipped).
    temps: Vec<Option<TempFile>>,
    metas: Vec<Meta>,
    missing: Wanted,
    /// The chunks to ask the peer for.
    wanted: Vec<(Hash, u32)>,
    dirs: DirCache,
}

/// Step 2 without the network: a temp file for each transfer (files with no chunk here get
/// theirs now, outside the folder lock), and the chunks the peer attached written into them.
fn assemble(
    rt: &FolderRt,
    mut dirs: DirCache,
    work: Vec<Transfer>,
    missing: Wanted,
    mut attached: HashMap<Hash, ChunkResponse>,
) -> Result<Assembled, String> {
    let mut temps: Vec<Option<TempFile>> = Vec::with_capacity(work.len());
    let mut metas = Vec::with_capacity(work.len());
    let mut work = work.into_iter();
    while let Some(t) = work.next() {
        let Transfer {
            record,
            op,
            source,
            expect,
            basis,
            detail,
            remote,
            temp,
            then,
            ..
        } = t;
        let kept = temps.len() < MAX_OPEN_TEMPS;
        let made = temp.map_or_else(
            || rt.store.create_temp_in(&mut dirs, &record.path, kept),
            Ok,
        );
        let mut temp = match made {
            Ok(t) => t,
            Err(e) => {
                let rest = work.filter_map(|t| t.temp);
                discard_all(rt, temps.into_iter().flatten().chain(rest));
                return Err(e.to_string());
            }
        };
        if !kept {
            rt.store.close_temp(&mut temp);
        }
        temps.push(Some(temp));
        metas.push(Meta {
            record,
            op,
            source,
            expect,
            basis,
            detail,
            remote,
            then,
        });
    }
    // Chunks the peer attached to the index need no request; a bad one is asked for.
    let mut wanted: Vec<(Hash, u32)> = Vec::new();
    for (h, (len, _)) in &missing {
        let data = attached.remove(h).and_then(|c| {
            let data = c.data?;
            crate::peers::open_chunk(h, data, c.compressed).ok()
        });
        match data {
            Some(data) if data.len() == *len as usize => {
                if let Err(e) = write_chunk(&rt.store, &missing, &mut temps, *h, &data) {
                    discard_all(rt, temps.into_iter().flatten());
                    return Err(e);
                }
            }
            _ => wanted.push((*h, *len)),
        }
    }
    Ok(Assembled {
        temps,
        metas,
        missing,
        wanted,
        dirs,
    })
}

/// Drops a failed batch's temp files.
fn discard_all(rt: &FolderRt, temps: impl IntoIterator<Item = TempFile>) {
    for t in temps {
        rt.store.discard_temp(t);
    }
}

/// Writes a verified chunk everywhere a batch wants it.
fn write_chunk(
    store: &crate::store::Store,
    missing: &Wanted,
    temps: &mut [Option<TempFile>],
    hash: Hash,
    data: &[u8],
) -> Result<(), String> {
    if let Some((_, places)) = missing.get(&hash) {
        for (i, off) in places {
            if let Some(Some(t)) = temps.get_mut(*i) {
                store.write_temp(t, *off, data).map_err(|e| e.to_string())?;
            }
        }
    }
    Ok(())
}

/// Step 3: checks every file is covered by its verified chunks and makes the batch durable.
fn finish_all(
    rt: &FolderRt,
    metas: Vec<Meta>,
    temps: Vec<Option<TempFile>>,
) -> Result<Vec<(Meta, TempFile)>, String> {
    let mut ready: Vec<(Meta, TempFile)> = Vec::with_capacity(metas.len());
    for (t, temp) in metas.into_iter().zip(temps) {
        let Some(mut temp) = temp else { continue };
        match rt
            .store
            .finish_temp(&mut temp, t.record.size, t.record.mode, t.record.mtime_ns)
        {
            Ok(()) => ready.push((t, temp)),
            Err(e) => {
                let rest = ready.into_iter().map(|(_, t)| t);
                discard_all(rt, std::iter::once(temp).chain(rest));
                return Err(e.to_string());
            }
        }
    }
    let temps: Vec<&TempFile> = ready.iter().map(|(_, t)| t).collect();
    rt.store.sync_temps(&temps);
    Ok(ready)
}

fn install(
    engine: &Engine,
    rt: &FolderRt,
    folder: &FolderId,
    dirs: &mut DirCache,
    ready: Vec<(Meta, TempFile)>,
) -> Result<Vec<FileRecord>, String> {
    let _guard = rt.op_lock.lock().map_err(|_| "folder lock poisoned")?;
    let mut journal = engine.journal.lock().map_err(|_| "journal lock poisoned")?;
    let t0 = std::time::Instant::now();
    let pending: Vec<(FileRecord, Option<DeviceId>)> = ready
        .iter()
        .map(|(t, _)| (t.record.clone(), t.source))
        .collect();
    journal
        .put_pending(folder, &pending)
        .map_err(|e| e.to_string())?;
    let pending_at = t0.elapsed();
    // Re-read expectations now that the lock is held again: a scan may have run meanwhile. An
    // expectation that moved is turned into one no file can meet, so that path is redone.
    journal.begin_reads();
    let (meta, batch): (Vec<Meta>, Vec<(TempFile, Expect)>) = ready
        .into_iter()
        .map(|(t, temp)| {
            let stored = journal.get(folder, &t.record.path).ok().flatten();
            let (expect, basis) = seen_of(stored.as_ref());
            let same = expect == t.expect && basis == t.basis;
            // A file open for writing through the mount is never replaced under its writer:
            // the remote version waits (it is decided again after the writer's release).
            let e = if same && !rt.writers.has_writer(&t.record.path) {
                t.expect
            } else {
                Expect::Matches(LocalStat {
                    inode: u64::MAX,
                    ..Default::default()
                })
            };
            (t, (temp, e))
        })
        .unzip();
    journal.end_reads();
    // The links and directory syncs need the folder lock, not the journal: others (a
    // session acknowledging, reading its next batch, `status`) use it meanwhile.
    drop(journal);
    let reread_at = t0.elapsed();
    // The watcher's event for a file can come as soon as it is in place: its echo is
    // expected from then on, not after the whole batch (else the event, seen first, is
    // rescanned, waiting for this lock).
    let results = rt.store.install_synced_in(dirs, batch, &|path, local| {
        rt.echoes.expect(path.clone(), Some(*local))
    });
    let renamed_at = t0.elapsed();
    let mut journal = engine.journal.lock().map_err(|_| "journal lock poisoned")?;
    let mut changes = Vec::new();
    let mut redo = Vec::new();
    let mut cleared = Vec::new();
    for (t, r) in meta.into_iter().zip(results) {
        match r {
            Ok(local) => {
                rt.unskip(&t.record.path);
                rt.invalidator.invalidate(&t.record.path);
                changes.push(Change {
                    record: t.record,
                    op: t.op,
                    local: Some(local),
                    source: t.source,
                    detail: t.detail,
                });
                changes.extend(t.then);
            }
            Err(StoreError::Changed(_)) => {
                cleared.push(t.record.path.clone());
                redo.push(t.remote);
            }
            Err(e) => {
                cleared.push(t.record.path.clone());
                skip_or_fail(rt, &t.remote, e)?;
            }
        }
    }
    journal
        .clear_pending(folder, &cleared)
        .map_err(|e| e.to_string())?;
    let files = changes.len();
    journal.commit(folder, changes).map_err(|e| e.to_string())?;
    if files >= 100 {
        tracing::debug!(%folder, files, pending_ms = pending_at.as_millis() as u64,
            reread_ms = (reread_at - pending_at).as_millis() as u64,
            rename_ms = (renamed_at - reread_at).as_millis() as u64,
            commit_ms = (t0.elapsed() - renamed_at).as_millis() as u64, "batch installed");
    }
    Ok(redo)
}

/// A record that cannot be applied here (its parent is a symlink or not a directory, a
/// directory refuses entries, a name the filesystem rejects…) is skipped and reported
/// (`FolderRt::skipped`, in `status`) so that the rest of its batch, and every later one,
/// still applies; only a full disk fails the batch, to be received again once there is room.
fn skip_or_fail(rt: &FolderRt, remote: &FileRecord, e: StoreError) -> Result<(), String> {
    let full = matches!(&e, StoreError::Io { source, .. }
        if matches!(source.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT)));
    if full {
        return Err(e.to_string());
    }
    if rt.skip(remote.path.clone(), e.to_string()) {
        tracing::warn!(folder = %rt.id, path = %remote.path, error = %e, "a remote version cannot be applied here; skipped (see status)");
    }
    Ok(())
}

/// Captures local edits at `paths` (they beat an apply to the disk).
async fn rescan(
    engine: &Arc<Engine>,
    folder: &FolderId,
    records: &[FileRecord],
) -> Result<(), String> {
    let paths = records.iter().map(|r| r.path.clone()).collect();
    engine.scan_paths(folder, paths).await.map(|_| ())
}

/// Completes applies interrupted between steps 4 and 6: a file that already holds the pending
/// content becomes that remote version; any other pending row is dropped (the peer sends the
/// record again, since it was never acknowledged).
pub fn recover_pending(
    journal: &mut Journal,
    rt: &FolderRt,
    folder: &FolderId,
) -> Result<usize, String> {
    let pending = journal.pending(folder).map_err(|e| e.to_string())?;
    let mut done = Vec::new();
    let mut dropped = Vec::new();
    for (record, source) in pending {
        let ok = match rt.store.stat(&record.path) {
            Ok(Some(st)) if record.deleted || st.kind != Some(record.kind) => None,
            Ok(Some(st)) if record.kind == FileKind::Dir => Some(st.local),
            Ok(Some(st)) if record.kind == FileKind::Symlink => rt
                .store
                .read_link(&record.path)
                .ok()
                .filter(|t| *t == record.target)
                .map(|_| st.local),
            Ok(Some(st)) if st.local.size == record.size => rt
                .store
                .open_file(&record.path)
                .ok()
                .and_then(|f| crate::chunker::chunk_file(f, record.size).ok())
                .filter(|c| c.hash == record.hash)
                .map(|_| st.local),
            _ => None,
        };
        match ok {
            Some(local) => done.push(Change {
                op: Op::Modify,
                local: Some(local),
                source,
                detail: Some("completed after restart".into()),
                record,
            }),
            None => dropped.push(record.path),
        }
    }
    let n = done.len();
    journal
        .clear_pending(folder, &dropped)
        .map_err(|e| e.to_string())?;
    journal.commit(folder, done).map_err(|e| e.to_string())?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_waits_for_the_one_before_only_where_their_paths_meet() {
        let p = |s: &str| RelPath::new(s).unwrap();
        let mut f = InFlight::default();
        for path in ["a/b/f", "top"] {
            let path = p(path);
            f.dirs.extend(path.ancestors());
            f.files.insert(path);
        }
        // The same file, a directory above one in flight, a path below a file in flight.
        for meets in ["a/b/f", "a/b", "a", "top", "top/x"] {
            assert!(f.overlaps(&p(meets)), "{meets}");
        }
        // Siblings, other directories, a name that only shares a prefix.
        for apart in ["a/b/g", "a/c", "a/bb/f", "topper", "z/top"] {
            assert!(!f.overlaps(&p(apart)), "{apart}");
        }
    }
}
