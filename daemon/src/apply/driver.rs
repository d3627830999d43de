//! A folder's receive pipeline at work: the sync core's [`Pipeline`] (which batch does what
//! when) driven by one task per folder that executes its actions with this module's steps and
//! feeds their outcomes back. Each action runs on a task of its own (its disk work on a
//! blocking thread), so the driver only ever waits for its inbox.
//!
//! Sessions hand their batches over with [`Receiver::receive`] and hear back on their reply
//! channel: [`Reply::Applied`] once a batch is durable (acknowledge it), [`Reply::Failed`] when
//! their batches cannot be applied now (end the session: the peer sends them again). A
//! session that ends says so ([`Receiver::gone`]), and what its batches made is dropped.
//!
//! What it owns: the temp files of batches between their steps (dropped when a batch is
//! discarded, also when a step's answer comes for a batch discarded meanwhile). What it never
//! does: decide anything the pipeline decides, or touch a file itself.

use super::assemble::{assemble, discard_all, finish_all, Assembled, TempWriter};
use super::decide::{decide_all, Decided};
use super::install::install;
use super::on_blocking;
use super::transfer::{ApplyError, Meta, Sources, Transfer};
use crate::chunks;
use crate::failpoint;
use crate::folder::{FolderRt, Folders};
use crate::progress::Queued;
use crate::store::{DirCache, TempFile};
use meshfs_protocol::{ChunkResponse, DeviceId, FileRecord, FolderId, Hash, RelPath};
use meshfs_sync::pipeline::{Action, BatchId, Failure, Pipeline, Source, MAX_ROUNDS};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Why a remote version is skipped after the pipeline's last round (`status`).
const KEPT_CHANGING: &str = "its path here changed at every try to apply it: a local edit kept beating it, or something this device does not sync is in its way (a special file, an ignored entry); not applied, until a later version of it";

/// What a source hears about its batches.
#[derive(Debug)]
pub enum Reply {
    /// Its batches up to this one are applied and durable: acknowledge `up_to` (a local
    /// source has nothing to acknowledge: `None`).
    Applied {
        /// The folder.
        folder: FolderId,
        /// What the peer may be told.
        up_to: Option<u64>,
    },
    /// Its batches cannot be applied now.
    Failed {
        /// The folder.
        folder: FolderId,
        /// Why.
        error: ApplyError,
    },
}

/// The handle sessions give their batches to; the folder's driver task holds the other end.
#[derive(Clone)]
pub struct Receiver {
    tx: mpsc::UnboundedSender<Input>,
}

impl std::fmt::Debug for Receiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Receiver").finish_non_exhaustive()
    }
}

/// Sources are numbered for the whole daemon: a session's number is unique among all folders.
static NEXT_SOURCE: AtomicU64 = AtomicU64::new(1);

impl Receiver {
    /// A receiver for folder `folder` of `folders`, and starts its driver task (which ends
    /// once every handle is dropped).
    pub fn start(folders: Arc<Folders>, folder: FolderId) -> Receiver {
        let (tx, rx) = mpsc::unbounded_channel();
        let driver = Driver {
            folders,
            folder,
            pipe: Pipeline::new(),
            sources: HashMap::new(),
            batches: HashMap::new(),
            errors: HashMap::new(),
            tx: tx.downgrade(),
        };
        tokio::spawn(driver.run(rx));
        Receiver { tx }
    }

    /// A new source (a session, or a local caller) for any folder's receiver.
    pub fn new_source() -> Source {
        Source(NEXT_SOURCE.fetch_add(1, Ordering::Relaxed))
    }

    /// `source` hands over `records` from `peer`, whose content is fetched over `conn` (or
    /// attached: `inline`); `ack` is what to acknowledge once applied. The outcome comes on
    /// `reply`.
    #[allow(clippy::too_many_arguments)]
    pub fn receive(
        &self,
        source: Source,
        peer: DeviceId,
        conn: quinn::Connection,
        records: Vec<FileRecord>,
        inline: Vec<ChunkResponse>,
        ack: Option<u64>,
        reply: mpsc::UnboundedSender<Reply>,
    ) {
        let _ = self.tx.send(Input::Receive(Box::new(Received {
            source,
            peer,
            conn,
            records,
            inline,
            ack,
            reply,
        })));
    }

    /// `source` is gone: its batches are dropped.
    pub fn gone(&self, source: Source) {
        let _ = self.tx.send(Input::Gone(source));
    }
}

/// A batch handed over.
struct Received {
    source: Source,
    peer: DeviceId,
    conn: quinn::Connection,
    records: Vec<FileRecord>,
    inline: Vec<ChunkResponse>,
    ack: Option<u64>,
    reply: mpsc::UnboundedSender<Reply>,
}

/// What the driver's inbox takes: batches, and the answers of the steps it started.
enum Input {
    Receive(Box<Received>),
    Gone(Source),
    Decided(BatchId, Result<Decided, ApplyError>),
    Rescanned(BatchId, Result<(), ApplyError>),
    Fetched(BatchId, Result<Fetched, ApplyError>),
    Installed(BatchId, Result<Vec<FileRecord>, ApplyError>),
}

/// What a fetch leaves: the ready files by transfer index, and those superseded at the peer.
struct Fetched {
    ready: Vec<(usize, Meta, TempFile)>,
    superseded: Vec<usize>,
    dirs: DirCache,
}

struct SourceInfo {
    peer: DeviceId,
    conn: quinn::Connection,
    reply: mpsc::UnboundedSender<Reply>,
}

/// What the driver holds for one batch between its steps.
struct BatchInfo {
    source: Source,
    /// Chunks the peer attached to the index (kept until the batch ends: a record decided
    /// again is fetched from them again).
    inline: HashMap<Hash, ChunkResponse>,
    /// The transfers of its last decision (taken by the fetch).
    transfers: Vec<Transfer>,
    /// Files ready to install, by transfer index.
    ready: HashMap<usize, (Meta, TempFile)>,
    /// The directories its decision walked to (reused by its install).
    dirs: Option<DirCache>,
    /// The local files its decision opened to copy chunks from (taken by the fetch).
    sources: Option<Sources>,
    /// Its records, counted in `status` until it is applied.
    queued: Option<Queued>,
    /// When its current round was decided, and how long that took (for the batch's log line).
    round: Option<(Instant, u64)>,
}

impl BatchInfo {
    /// Drops what it holds on disk.
    fn discard(self, rt: Option<&FolderRt>) {
        let Some(rt) = rt else { return };
        discard_all(rt, self.ready.into_values().map(|(_, t)| t));
    }
}

struct Driver {
    folders: Arc<Folders>,
    folder: FolderId,
    pipe: Pipeline,
    sources: HashMap<Source, SourceInfo>,
    batches: HashMap<BatchId, BatchInfo>,
    /// The error a source's failed step gave, for its `Failed` reply.
    errors: HashMap<Source, ApplyError>,
    /// The inbox, for the steps' answers: weak, so that the driver ends once the folder's
    /// handles are gone and no step is under way.
    tx: mpsc::WeakUnboundedSender<Input>,
}

impl Driver {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Input>) {
        while let Some(input) = rx.recv().await {
            self.take(input);
            while let Some(action) = self.pipe.poll() {
                self.execute(action);
            }
        }
    }

    fn rt(&self) -> Option<Arc<FolderRt>> {
        self.folders.get(&self.folder)
    }

    /// A sender for a step's answer (none once the folder is gone: the step is not started).
    fn answer(&self) -> Option<mpsc::UnboundedSender<Input>> {
        self.tx.upgrade()
    }

    /// Hands one input to the pipeline.
    fn take(&mut self, input: Input) {
        match input {
            Input::Receive(r) => {
                let Received {
                    source,
                    peer,
                    conn,
                    records,
                    inline,
                    ack,
                    reply,
                } = *r;
                tracing::debug!(folder = %self.folder, records = records.len(), inline = inline.len(), ?ack, "index batch received");
                let queued = self.rt().map(|rt| rt.receiving.queue(&records));
                self.sources
                    .entry(source)
                    .or_insert(SourceInfo { peer, conn, reply });
                let batch = self.pipe.receive(source, records, ack);
                self.batches.insert(
                    batch,
                    BatchInfo {
                        source,
                        inline: inline.into_iter().map(|c| (c.hash, c)).collect(),
                        transfers: Vec::new(),
                        ready: HashMap::new(),
                        dirs: None,
                        sources: None,
                        queued,
                        round: None,
                    },
                );
            }
            Input::Gone(source) => {
                self.sources.remove(&source);
                self.errors.remove(&source);
                self.pipe.source_gone(source);
            }
            Input::Decided(batch, result) => match result {
                Ok(d) => {
                    let paths: Vec<RelPath> = d
                        .transfers
                        .iter()
                        .map(|t| t.meta.record.path.clone())
                        .collect();
                    // A change waiting for a transfer's install lands at its own path: that
                    // path is in flight too.
                    let also: Vec<RelPath> = d
                        .transfers
                        .iter()
                        .flat_map(|t| t.meta.then.iter().map(|(c, _)| c.record.path.clone()))
                        .collect();
                    // Discarded while it was decided: its claims and sources go with it.
                    if let Some(b) = self.batches.get_mut(&batch) {
                        if let Some((at, ms)) = b.round.as_mut() {
                            *ms = at.elapsed().as_millis() as u64;
                        }
                        b.transfers = d.transfers;
                        b.dirs = Some(d.dirs);
                        b.sources = Some(d.sources);
                    }
                    self.pipe.decided(batch, paths, also, d.redo);
                }
                Err(e) => self.fail(batch, e),
            },
            Input::Rescanned(batch, result) => match result {
                Ok(()) => self.pipe.rescanned(batch),
                Err(e) => self.fail(batch, e),
            },
            Input::Fetched(batch, result) => match result {
                Ok(f) => {
                    let Some(b) = self.batches.get_mut(&batch) else {
                        if let Some(rt) = self.rt() {
                            discard_all(&rt, f.ready.into_iter().map(|(_, _, t)| t));
                        }
                        return;
                    };
                    b.dirs = Some(f.dirs);
                    let done: Vec<usize> = f.ready.iter().map(|(i, _, _)| *i).collect();
                    for (i, meta, temp) in f.ready {
                        b.ready.insert(i, (meta, temp));
                    }
                    for i in done {
                        self.pipe.fetched(batch, i);
                    }
                    for i in f.superseded {
                        self.pipe.superseded(batch, i);
                    }
                }
                Err(e) => self.fail(batch, e),
            },
            Input::Installed(batch, result) => match result {
                Ok(redo) => self.pipe.installed(batch, redo),
                Err(e) => self.fail(batch, e),
            },
        }
    }

    /// A step of `batch` failed with `e`.
    fn fail(&mut self, batch: BatchId, e: ApplyError) {
        let message = e.to_string();
        if let Some(source) = self.batches.get(&batch).map(|b| b.source) {
            self.errors.entry(source).or_insert(e);
        }
        self.pipe.failed(batch, message);
    }

    /// Starts what the pipeline asks for.
    fn execute(&mut self, action: Action) {
        let folder = self.folder.clone();
        match action {
            Action::Decide {
                batch,
                source,
                records,
            } => {
                let Some(tx) = self.answer() else { return };
                let Some(peer) = self.sources.get(&source).map(|s| s.peer) else {
                    let _ = tx.send(Input::Decided(
                        batch,
                        Err(ApplyError::Task("the session ended".into())),
                    ));
                    return;
                };
                if let Some(b) = self.batches.get_mut(&batch) {
                    b.round = Some((Instant::now(), 0));
                }
                let folders = self.folders.clone();
                tokio::spawn(async move {
                    let result = match folders.running(&folder) {
                        Ok(rt) => {
                            let folders = folders.clone();
                            on_blocking(move || decide_all(&folders, &rt, &folder, peer, records))
                                .await
                        }
                        Err(e) => Err(e.into()),
                    };
                    let _ = tx.send(Input::Decided(batch, result));
                });
            }
            Action::Rescan { batch, paths } => {
                let Some(tx) = self.answer() else { return };
                let folders = self.folders.clone();
                tokio::spawn(async move {
                    let result = folders
                        .scan_paths(&folder, paths)
                        .await
                        .map(drop)
                        .map_err(ApplyError::from);
                    let _ = tx.send(Input::Rescanned(batch, result));
                });
            }
            Action::Fetch {
                batch,
                source,
                transfers,
            } => {
                let conn = self.sources.get(&source).map(|s| s.conn.clone());
                let Some(b) = self.batches.get_mut(&batch) else {
                    return;
                };
                let work = std::mem::take(&mut b.transfers);
                let dirs = b.dirs.take().unwrap_or_default();
                let sources = b.sources.take().unwrap_or_default();
                let wanted_inline: Vec<Hash> = work
                    .iter()
                    .flat_map(|t| t.missing.iter().map(|(h, _, _)| *h))
                    .collect();
                // Copies: a record decided again (its target changed) is fetched again in its
                // next round, from what the peer attached if it can.
                let attached: HashMap<Hash, ChunkResponse> = wanted_inline
                    .into_iter()
                    .filter_map(|h| Some((h, b.inline.get(&h)?.clone())))
                    .collect();
                debug_assert_eq!(transfers.len(), work.len());
                let Some(tx) = self.answer() else { return };
                let folders = self.folders.clone();
                tokio::spawn(async move {
                    let result = match (folders.running(&folder), conn) {
                        (Ok(rt), Some(conn)) => {
                            fetch(&rt, &folder, &conn, work, dirs, sources, attached).await
                        }
                        (Err(e), _) => Err(e.into()),
                        (Ok(_), None) => Err(ApplyError::Task("the session ended".into())),
                    };
                    let _ = tx.send(Input::Fetched(batch, result));
                });
            }
            Action::Install { batch, transfers } => {
                let source = self.batches.get(&batch).map(|b| b.source);
                let peer = source.and_then(|s| self.sources.get(&s)).map(|s| s.peer);
                let Some(tx) = self.answer() else { return };
                let Some(b) = self.batches.get_mut(&batch) else {
                    let _ = tx.send(Input::Installed(batch, Ok(Vec::new())));
                    return;
                };
                let ready: Vec<(Meta, TempFile)> =
                    transfers.iter().filter_map(|i| b.ready.remove(i)).collect();
                // Directories walked to afresh: one the decision opened may have been moved or
                // removed while the contents were fetched (a cached descriptor would follow it).
                b.dirs = None;
                let mut dirs = DirCache::default();
                let files = ready.len();
                let round = b.round;
                let folders = self.folders.clone();
                tokio::spawn(async move {
                    let started = Instant::now();
                    let result = match (folders.running(&folder), peer) {
                        (Ok(rt), Some(peer)) => {
                            let folders = folders.clone();
                            let f = folder.clone();
                            on_blocking(move || install(&folders, &rt, &f, peer, &mut dirs, ready))
                                .await
                        }
                        (Ok(rt), None) => {
                            discard_all(&rt, ready.into_iter().map(|(_, t)| t));
                            Err(ApplyError::Task("the session ended".into()))
                        }
                        (Err(e), _) => Err(e.into()),
                    };
                    // Logged for batches of many files, and for any that took a while.
                    if let Some((decided_at, decide_ms)) = round {
                        let total = decided_at.elapsed();
                        if files >= 100 || total >= Duration::from_millis(200) {
                            tracing::info!(%folder, files, decide_ms,
                                fetch_ms = (total - started.elapsed()).as_millis() as u64,
                                install_ms = started.elapsed().as_millis() as u64, "batch applied");
                        }
                    }
                    let _ = tx.send(Input::Installed(batch, result));
                });
            }
            Action::Discard { batch } => {
                if let Some(b) = self.batches.remove(&batch) {
                    b.discard(self.rt().as_deref());
                }
            }
            Action::Applied {
                batch,
                source,
                up_to,
            } => {
                if let Some(b) = self.batches.remove(&batch) {
                    if let Some(q) = b.queued {
                        q.applied();
                    }
                }
                if let Some(s) = self.sources.get(&source) {
                    let _ = s.reply.send(Reply::Applied { folder, up_to });
                }
            }
            Action::Skip { batch: _, records } => {
                let Some(rt) = self.rt() else { return };
                for r in records {
                    if rt.skip(r.path.clone(), KEPT_CHANGING.into()) {
                        tracing::warn!(%folder, path = %r.path, rounds = MAX_ROUNDS, "a remote version found its path changed at every try; skipped (see status)");
                    }
                }
            }
            Action::Fail { source, error } => {
                let e = self.errors.remove(&source).unwrap_or(match error {
                    Failure::Step(s) => ApplyError::Task(s),
                });
                let Some(reply) = self.sources.get(&source).map(|s| s.reply.clone()) else {
                    return;
                };
                let rt = self.rt();
                tokio::spawn(async move {
                    if let (true, Some(rt)) = (e.is_disk_full(), rt) {
                        // The failed batch's temp files are gone and no user file was touched.
                        // Say it once; the session keeps serving meanwhile, and the batch is
                        // received again (at the reconnect this failure causes) once the disk
                        // has more room, or after a minute, instead of re-fetching into a full
                        // disk over and over.
                        if rt.block(format!("disk full: {e}")) {
                            tracing::error!(folder = %rt.id, error = %e, "the disk is full; receiving into this folder stopped until there is room (other folders and peers go on)");
                        }
                        wait_for_room(rt.store.root()).await;
                    }
                    let _ = reply.send(Reply::Failed { folder, error: e });
                });
            }
        }
    }
}

/// Steps 2 and 3 for a decision's transfers: temp files made and filled with what is at hand
/// (local chunks, chunks the peer attached), the rest fetched over `conn`, every file checked
/// to be covered and made durable. A file whose chunks the peer no longer has is superseded.
async fn fetch(
    rt: &Arc<FolderRt>,
    folder: &FolderId,
    conn: &quinn::Connection,
    work: Vec<Transfer>,
    dirs: DirCache,
    sources: Sources,
    attached: HashMap<Hash, ChunkResponse>,
) -> Result<Fetched, ApplyError> {
    // Temp files, and writing what is at hand into them (local copies, attached chunks), are
    // a thousand system calls and more for a batch of small files, and for a big file
    // gigabytes read and hashed: on a blocking thread, not on the runtime that moves packets.
    let Assembled {
        temps,
        metas,
        missing,
        wanted,
        dirs,
        skipped,
    } = {
        let rt = rt.clone();
        on_blocking(move || {
            // Decided, the folder's lock let go, nothing fetched or installed yet (for tests:
            // what a local edit or another batch does meanwhile). Detail: a remote path.
            for t in &work {
                failpoint::hit("apply.fetch", t.meta.remote.path.as_str());
            }
            assemble(&rt, dirs, work, &sources, attached)
        })
        .await?
    };
    // Skipped here (shown in `status`): nothing to install for them.
    let mut superseded = skipped;
    let temps = if wanted.is_empty() {
        temps
    } else {
        let (got, back) = chunks::fetch(
            conn,
            folder,
            wanted,
            TempWriter {
                rt: rt.clone(),
                missing,
                temps,
                progress: None,
            },
        )
        .await;
        let TempWriter {
            missing, mut temps, ..
        } = back;
        match got {
            Ok(absent) => {
                // The peer no longer has these chunks: the version was superseded there, and its
                // successor follows in the index.
                for h in absent {
                    for (i, _) in missing.get(&h).map(|m| m.1.clone()).unwrap_or_default() {
                        if let Some(t) = temps.get_mut(i).and_then(Option::take) {
                            tracing::info!(%folder, path = %t.target, "version superseded on the peer before it was fetched; skipped");
                            rt.store.discard_temp(t);
                            superseded.push(i);
                        }
                    }
                }
            }
            Err(e) => {
                discard_all(rt, temps.into_iter().flatten());
                return Err(e.into());
            }
        }
        temps
    };
    // Step 3: no lock: it overlaps the install of another batch.
    let ready = {
        let rt = rt.clone();
        on_blocking(move || finish_all(&rt, metas, temps)).await?
    };
    Ok(Fetched {
        ready,
        superseded,
        dirs,
    })
}

/// Waits until the filesystem of `path` has more free room than now (checked every second),
/// or a minute at most.
async fn wait_for_room(path: &std::path::Path) {
    let start = crate::store::free_bytes(path).unwrap_or(0);
    for _ in 0..60 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        if crate::store::free_bytes(path).is_some_and(|f| f > start.saturating_add(1 << 20)) {
            return;
        }
    }
}
