//! Applying a peer's records: the real executor of the sync core's plans
//! ([`meshfs_sync::plan`]) against the store and the journal. The simulation executes the
//! same plans against its model; only the executors differ. The numbered commit order:
//!
//! 1. [`decide`]: plan every record against the journal (under the folder's lock); steps
//!    without content (metadata, directories, symlinks, deletions, conflict siblings of local
//!    content) are done and journaled at once;
//! 2. [`assemble`]: file contents are assembled in temp files from local chunks (chunk index)
//!    and chunks fetched from the peer, each verified by blake3 (no lock held: local edits go
//!    on);
//! 3. every temp file is checked to be exactly covered by its verified chunks (the record's
//!    hash is its chunk list's, checked when the record was decoded, so the file is not read
//!    again), and the batch's temp files are made durable together (`syncfs`; still no lock);
//! 4. [`install`] (lock): the records are journaled as *pending* in one transaction;
//! 5. each target is checked against the stat the journal expects (and the journal against the
//!    record the decision saw), and the temp file renamed over it; each touched directory is
//!    fsynced once;
//! 6. the applied records are committed in one transaction, which also clears their pending
//!    rows. A crash between 4 and 6 is completed at start-up ([`recover_pending`]).
//!
//! A target that changed on disk since it was last scanned is not replaced: the path is
//! rescanned (its local edit becomes a version) and the record planned again, up to
//! [`MAX_ROUNDS`] times; then the batch fails and the session ends (the peer sends it again).

mod assemble;
mod decide;
mod install;
mod transfer;

pub use install::recover_pending;
pub use transfer::ApplyError;

use crate::chunks;
use crate::failpoint;
use crate::fetching::InFlight;
use crate::folder::{FolderRt, Folders};
use assemble::{assemble, discard_all, finish_all, Assembled, TempWriter, Wanted};
use decide::Decided;
use install::install;
use meshfs_protocol::{ChunkResponse, DeviceId, FileRecord, FolderId, Hash};
use std::collections::HashMap;
use std::sync::Arc;
use tokio::sync::oneshot;

/// How often a record whose target keeps changing under us is decided again.
const MAX_ROUNDS: usize = 3;

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

/// Waits for the batch before to have installed, if it has not been waited for yet.
async fn wait_installed(prev: &mut Option<oneshot::Receiver<()>>) -> Result<(), ApplyError> {
    match prev.take() {
        Some(rx) => rx.await.map_err(|_| ApplyError::EarlierFailed),
        None => Ok(()),
    }
}

/// Reconciles and applies `records` received from `peer`, in its turn of the folder's
/// receive pipeline.
pub async fn receive(
    folders: &Arc<Folders>,
    folder: &FolderId,
    peer: DeviceId,
    conn: &quinn::Connection,
    records: Vec<FileRecord>,
    mut inline: HashMap<Hash, ChunkResponse>,
    turn: Turn,
) -> Result<(), ApplyError> {
    let rt = folders.running(folder)?;
    let Turn {
        before,
        mut decided,
        installed,
    } = turn;
    let mut todo = order(records);
    let mut prev_installed = None;
    let mut prev_in_flight: Option<Arc<InFlight>> = None;
    if let Some(b) = before {
        let in_flight = b.decided.await.map_err(|_| ApplyError::EarlierFailed)?;
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
    // Registrations of this batch's decisions (`crate::fetching`): kept until it has ended.
    let mut fetches = Vec::new();
    let mut may_hold = true;
    let mut rounds = 0;
    while !todo.is_empty() && rounds < MAX_ROUNDS {
        let deciding = std::time::Instant::now();
        let (this, held) = {
            let folders = folders.clone();
            let rt = rt.clone();
            let folder = folder.clone();
            on_blocking(move || {
                let decided = decide::decide_all(&folders, &rt, &folder, peer, todo, may_hold);
                // Between a decision and its install, the folder's lock let go (for tests:
                // what another batch or a local edit does meanwhile). Detail: a remote path.
                if let Ok((d, _)) = &decided {
                    for t in &d.transfers {
                        failpoint::hit("apply.decided", t.meta.remote.path.as_str());
                    }
                }
                decided
            })
            .await?
        };
        let decide_ms = deciding.elapsed().as_millis() as u64;
        if let Some(tx) = decided.take() {
            let all = match still_in_flight(&mut prev_installed, prev_in_flight.take()) {
                Some(p) => Arc::new((*held.in_flight).clone().with(&p)),
                None => held.in_flight.clone(),
            };
            let _ = tx.send(all);
        }
        fetches.push(held.fetch);
        todo = transfer(
            folders,
            &rt,
            folder,
            peer,
            conn,
            this,
            decide_ms,
            &mut inline,
            &mut prev_installed,
        )
        .await?;
        // Held back once only, so a path that two peers keep changing cannot starve.
        may_hold = false;
        if held.records.is_empty() {
            rounds += 1;
        } else {
            for w in held.waits {
                w.wait().await;
            }
            todo.extend(held.records);
            todo = order(todo);
        }
    }
    if !todo.is_empty() {
        tracing::warn!(%folder, n = todo.len(), "paths kept changing during apply; they will be retried");
        return Err(ApplyError::KeptChanging);
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

/// Steps 2–6 for the transfers; returns the remote records to decide again. Installs only
/// after the batch before has (`prev_installed`).
#[allow(clippy::too_many_arguments)]
async fn transfer(
    folders: &Arc<Folders>,
    rt: &Arc<FolderRt>,
    folder: &FolderId,
    peer: DeviceId,
    conn: &quinn::Connection,
    decided: Decided,
    decide_ms: u64,
    inline: &mut HashMap<Hash, ChunkResponse>,
    prev_installed: &mut Option<oneshot::Receiver<()>>,
) -> Result<Vec<FileRecord>, ApplyError> {
    let Decided {
        transfers: work,
        redo,
        dirs,
    } = decided;
    if !redo.is_empty() {
        rescan(folders, folder, &redo).await?;
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
        temps,
        metas,
        missing,
        wanted,
        mut dirs,
    } = {
        let rt = rt.clone();
        on_blocking(move || assemble(&rt, dirs, work, missing, attached)).await?
    };
    // Chunks asked of the peer (the rest were at hand: attached to the index, or local).
    let requested = wanted.len();
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
            },
        )
        .await;
        let TempWriter {
            missing, mut temps, ..
        } = back;
        match got {
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
                return Err(e.into());
            }
        }
        temps
    };
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
    let folders2 = folders.clone();
    let rt2 = rt.clone();
    let folder2 = folder.clone();
    let mut changed =
        on_blocking(move || install(&folders2, &rt2, &folder2, peer, &mut dirs, ready)).await?;
    if !changed.is_empty() {
        rescan(folders, folder, &changed).await?;
    }
    // Logged for batches of many files, and for any that took a while (a large file).
    if files >= 100 || started.elapsed() >= std::time::Duration::from_millis(200) {
        tracing::info!(%folder, files, requested, decide_ms, fetch_ms = fetched_at.as_millis() as u64,
            verify_ms = (verified_at - fetched_at).as_millis() as u64,
            install_ms = (started.elapsed() - verified_at).as_millis() as u64, "batch applied");
    }
    changed.extend(redo);
    Ok(changed)
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

/// Runs a step that blocks (SQLite, the disk) on a blocking thread, off the runtime's workers.
async fn on_blocking<T: Send + 'static>(
    step: impl FnOnce() -> Result<T, ApplyError> + Send + 'static,
) -> Result<T, ApplyError> {
    tokio::task::spawn_blocking(step)
        .await
        .map_err(|e| ApplyError::Task(e.to_string()))?
}

/// Captures local edits at `paths` (they beat an apply to the disk).
async fn rescan(
    folders: &Arc<Folders>,
    folder: &FolderId,
    records: &[FileRecord],
) -> Result<(), ApplyError> {
    let paths = records.iter().map(|r| r.path.clone()).collect();
    folders.scan_paths(folder, paths).await?;
    Ok(())
}
