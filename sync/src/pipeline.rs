//! The receive pipeline: what becomes of the records a peer's session hands over, from the
//! session to their acknowledgement, as a state machine that does no IO.
//!
//! One [`Pipeline`] per folder takes the batches of every session of that folder. It decides
//! nothing about files itself (that is [`crate::plan`]): it says which batch's records to
//! decide, rescan, fetch and install next, and when a batch is applied and may be
//! acknowledged. Its caller executes each [`Action`] and reports how it went (`decided`,
//! `fetched`, `installed`, …). The daemon executes the actions against the store, the journal
//! and the network; the simulation executes the very same actions against its model, with
//! completions out of order, peers lost mid-fetch and crashes between any two steps.
//!
//! The rules, each a test below:
//! - **One step under the folder's lock at a time.** `Decide`, `Rescan` and `Install` read and
//!   write the journal and the replica; at most one of them is outstanding for the folder.
//!   Fetching needs no lock and overlaps everything.
//! - **A session's batches in order.** A batch decides once the one before it (from the same
//!   source) has decided; if one of its paths is, contains or lies in a path still in flight in
//!   an earlier batch of the source, it first waits for that batch to be applied. It installs,
//!   and is applied, only after the batch before it is applied. Acknowledgements follow in order.
//! - **A version two peers offer is fetched from one.** A record at a path another source's
//!   unfinished batch has in flight (or above or below one), and every later record of the
//!   batch at a path it overlaps, is held back; once this batch's own transfers are installed
//!   and those batches have ended (applied or failed), the held records are decided again, once,
//!   without holding. A batch waits only for batches that decided before it: no cycle.
//! - **Bounded rounds.** A record whose target changed under it (a local edit beat the apply)
//!   is rescanned and decided again; after [`MAX_ROUNDS`] rounds, the records still changing
//!   are skipped ([`Action::Skip`]: not applied, shown) and the rest of the batch goes on to be
//!   applied and acknowledged. A record can fail every round for good: something this device
//!   does not sync is in its way (a FIFO, a directory its own rules ignore), which the rescan
//!   never records; failing the source for it would fail the batch at every reconnect, and
//!   every later batch with it. A local edit that really kept beating the apply is journaled
//!   and reaches the peer, where the two versions meet as any concurrent ones do.
//! - **Failure is the source's.** A failed step fails its batch and every later batch of the
//!   same source ([`Action::Fail`], once); other sources go on, and those holding on the failed
//!   batch decide again.
//!
//! What it never does: read a clock, touch a file or a socket, or hold anything a step made
//! (temp files stay with the executor, which drops them on [`Action::Discard`]).

use meshfs_protocol::{FileRecord, RelPath};
use std::collections::{BTreeMap, BTreeSet, HashSet, VecDeque};

/// Rounds of deciding a batch's changing records before its source fails.
pub const MAX_ROUNDS: usize = 3;

/// Who handed a batch over: a peer session, or a local caller (versions that waited for a
/// writer). The pipeline only compares sources; the caller chooses them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Source(pub u64);

/// A batch, numbered in the order the pipeline received it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BatchId(pub u64);

/// What the executor is asked to do next.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Plan `records` in order against the journal, under the folder's lock; do and journal
    /// the steps that need no content; start a transfer for each content. Answer with
    /// [`Pipeline::decided`].
    Decide {
        /// The batch.
        batch: BatchId,
        /// Its source (whose peer holds the content).
        source: Source,
        /// What to decide.
        records: Vec<FileRecord>,
    },
    /// Capture the local state of `paths` (local edits that beat the apply there), under the
    /// folder's lock. Answer with [`Pipeline::rescanned`].
    Rescan {
        /// The batch.
        batch: BatchId,
        /// The paths.
        paths: Vec<RelPath>,
    },
    /// Assemble and fetch the contents of the transfers of the batch's last decision (their
    /// indexes in its `decided` list), verify and flush them. Answer each with
    /// [`Pipeline::fetched`] or [`Pipeline::superseded`], in any order, or the batch with
    /// [`Pipeline::failed`].
    Fetch {
        /// The batch.
        batch: BatchId,
        /// Its source.
        source: Source,
        /// Indexes of the transfers.
        transfers: Vec<usize>,
    },
    /// Install these fetched transfers of the batch's last decision, under the folder's lock.
    /// Answer with [`Pipeline::installed`].
    Install {
        /// The batch.
        batch: BatchId,
        /// Indexes of the transfers, in the order they were decided.
        transfers: Vec<usize>,
    },
    /// Forget the batch: drop what was made for it (temp files). It will not go on.
    Discard {
        /// The batch.
        batch: BatchId,
    },
    /// Every batch of `source` up to this one is applied: acknowledge `up_to` to its peer
    /// (`None`: a local source, nothing to acknowledge).
    Applied {
        /// The batch applied last.
        batch: BatchId,
        /// The source.
        source: Source,
        /// What its peer may be told.
        up_to: Option<u64>,
    },
    /// These records of the batch changed under every round ([`MAX_ROUNDS`]): they are not
    /// applied (show them as skipped); the rest of the batch goes on, and the batch is
    /// applied and acknowledged without them.
    Skip {
        /// The batch.
        batch: BatchId,
        /// The records skipped, in decision order.
        records: Vec<FileRecord>,
    },
    /// `source`'s batches cannot be applied now: end its session.
    Fail {
        /// The source.
        source: Source,
        /// Why.
        error: Failure,
    },
}

/// Why a source failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Failure {
    /// A step failed (the executor said why).
    #[error("{0}")]
    Step(String),
}

/// The paths a batch will change once installed: its transfers' targets and the records it
/// held back, with their ancestors as directories.
#[derive(Clone, Debug, Default)]
pub struct InFlight {
    files: HashSet<RelPath>,
    dirs: HashSet<RelPath>,
}

impl InFlight {
    /// Adds `path` (and its ancestors, as directories).
    pub fn insert(&mut self, path: &RelPath) {
        if self.files.insert(path.clone()) {
            self.dirs.extend(path.ancestors());
        }
    }

    /// Whether a decision about `path` depends on what these installs will change: the same
    /// path, a directory above one of them, or a path below one of them.
    pub fn overlaps(&self, path: &RelPath) -> bool {
        self.files.contains(path)
            || self.dirs.contains(path)
            || path.ancestors().iter().any(|a| self.files.contains(a))
    }

    /// Whether it holds no path.
    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }
}

/// Where a batch is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// Waiting to decide its next round.
    Ready,
    /// Its round is being decided.
    Deciding,
    /// Its round's transfers are fetched, its rescans done; the round goes on from `step`.
    Working,
    /// Its held records wait for other sources' batches to end.
    Holding,
    /// All its records are done; it waits for the batch before it to be applied.
    Finished,
}

/// The work of one round after its decision.
#[derive(Debug, Default)]
struct Round {
    /// Transfers decided: their targets.
    transfers: Vec<RelPath>,
    /// Of those, how many are not fetched yet, and which were superseded.
    unfetched: BTreeSet<usize>,
    superseded: BTreeSet<usize>,
    /// Records whose target changed at the decision (rescan, then decide again).
    redo_decided: Vec<FileRecord>,
    /// The decision's redo paths are being rescanned / have been.
    rescan_decided: Progress,
    /// Installed (or nothing to install), and the install's own redo.
    install: Progress,
    redo_installed: Vec<FileRecord>,
    rescan_installed: Progress,
}

/// A step's progress within a round.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Progress {
    #[default]
    NotYet,
    Running,
    Done,
}

#[derive(Debug)]
struct Batch {
    source: Source,
    ack: Option<u64>,
    stage: Stage,
    /// Records to decide in the next round, in order.
    todo: Vec<FileRecord>,
    /// Held back this round, and the batches they wait for.
    held: Vec<FileRecord>,
    waits: BTreeSet<BatchId>,
    may_hold: bool,
    rounds: usize,
    /// It has decided once (the next batch of its source may decide).
    decided_once: bool,
    /// What it will change, over all its rounds, until it ends.
    in_flight: InFlight,
    round: Round,
}

/// The receive pipeline of one folder. See the module's documentation.
#[derive(Debug, Default)]
pub struct Pipeline {
    next: u64,
    batches: BTreeMap<BatchId, Batch>,
    /// A Decide, Rescan or Install is outstanding.
    locked: Option<BatchId>,
    /// Sources failed, until they are gone (their later batches fail at once).
    failed: BTreeSet<Source>,
    actions: VecDeque<Action>,
}

impl Pipeline {
    /// An empty pipeline.
    pub fn new() -> Pipeline {
        Pipeline::default()
    }

    /// `source` hands over `records` (a peer's batch, `ack` the sequence to acknowledge once
    /// applied; `None` for a local source).
    pub fn receive(
        &mut self,
        source: Source,
        records: Vec<FileRecord>,
        ack: Option<u64>,
    ) -> BatchId {
        self.next += 1;
        let id = BatchId(self.next);
        if self.failed.contains(&source) {
            return id;
        }
        self.batches.insert(
            id,
            Batch {
                source,
                ack,
                stage: Stage::Ready,
                todo: order(records),
                held: Vec::new(),
                waits: BTreeSet::new(),
                may_hold: true,
                rounds: 0,
                decided_once: false,
                in_flight: InFlight::default(),
                round: Round::default(),
            },
        );
        self.advance();
        id
    }

    /// The batch's round was decided: `transfers` are the targets of the contents to fetch
    /// (numbered from 0 in this order), `also` other paths the round will change once they are
    /// installed (a resolution that waits for its sibling), `redo` the records whose target
    /// changed under the decision.
    pub fn decided(
        &mut self,
        batch: BatchId,
        transfers: Vec<RelPath>,
        also: Vec<RelPath>,
        redo: Vec<FileRecord>,
    ) {
        self.unlock(batch);
        let Some(b) = self.batches.get_mut(&batch) else {
            return self.advance();
        };
        if b.stage != Stage::Deciding {
            return self.advance();
        }
        b.decided_once = true;
        for t in transfers.iter().chain(&also) {
            b.in_flight.insert(t);
        }
        b.round = Round {
            unfetched: (0..transfers.len()).collect(),
            transfers,
            redo_decided: redo,
            ..Round::default()
        };
        if b.round.redo_decided.is_empty() {
            b.round.rescan_decided = Progress::Done;
        }
        b.stage = Stage::Working;
        if !b.round.transfers.is_empty() {
            let transfers = (0..b.round.transfers.len()).collect();
            let source = b.source;
            self.actions.push_back(Action::Fetch {
                batch,
                source,
                transfers,
            });
        }
        self.advance();
    }

    /// A rescan the batch asked for is done.
    pub fn rescanned(&mut self, batch: BatchId) {
        self.unlock(batch);
        if let Some(b) = self.batches.get_mut(&batch) {
            let r = &mut b.round;
            if r.rescan_decided == Progress::Running {
                r.rescan_decided = Progress::Done;
            } else if r.rescan_installed == Progress::Running {
                r.rescan_installed = Progress::Done;
            }
        }
        self.advance();
    }

    /// Transfer `transfer` of the batch's round is assembled, verified and durable.
    pub fn fetched(&mut self, batch: BatchId, transfer: usize) {
        if let Some(b) = self.batches.get_mut(&batch) {
            b.round.unfetched.remove(&transfer);
        }
        self.advance();
    }

    /// Transfer `transfer`'s content is no longer at its peer (superseded there: its successor
    /// follows in the same index stream). It is skipped.
    pub fn superseded(&mut self, batch: BatchId, transfer: usize) {
        if let Some(b) = self.batches.get_mut(&batch) {
            if b.round.unfetched.remove(&transfer) {
                b.round.superseded.insert(transfer);
            }
        }
        self.advance();
    }

    /// The round's install is done; `redo` are the records whose target changed under it.
    pub fn installed(&mut self, batch: BatchId, redo: Vec<FileRecord>) {
        self.unlock(batch);
        if let Some(b) = self.batches.get_mut(&batch) {
            b.round.install = Progress::Done;
            b.round.rescan_installed = if redo.is_empty() {
                Progress::Done
            } else {
                Progress::NotYet
            };
            b.round.redo_installed = redo;
        }
        self.advance();
    }

    /// A step of the batch failed: the batch and every later one of its source fail.
    pub fn failed(&mut self, batch: BatchId, error: String) {
        self.unlock(batch);
        if let Some(source) = self.batches.get(&batch).map(|b| b.source) {
            self.fail_source(source, Failure::Step(error));
        }
        self.advance();
    }

    /// `source` is gone (its session ended): its batches are dropped.
    pub fn source_gone(&mut self, source: Source) {
        let gone: Vec<BatchId> = self
            .batches
            .iter()
            .filter(|(_, b)| b.source == source)
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            self.batches.remove(&id);
            if self.locked == Some(id) {
                // Its outstanding step still answers; until then the lock stays taken, so
                // that the executor never runs two locked steps at once.
            }
            self.actions.push_back(Action::Discard { batch: id });
        }
        self.failed.remove(&source);
        self.advance();
    }

    /// The next thing to do, if any.
    pub fn poll(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// Nothing is received and unfinished, and no step is outstanding.
    pub fn is_idle(&self) -> bool {
        self.batches.is_empty() && self.locked.is_none() && self.actions.is_empty()
    }

    /// Batches not yet applied.
    pub fn len(&self) -> usize {
        self.batches.len()
    }

    /// Whether no batch waits to be applied.
    pub fn is_empty(&self) -> bool {
        self.batches.is_empty()
    }

    fn unlock(&mut self, batch: BatchId) {
        if self.locked == Some(batch) {
            self.locked = None;
        }
    }

    fn fail_source(&mut self, source: Source, error: Failure) {
        let ids: Vec<BatchId> = self
            .batches
            .iter()
            .filter(|(_, b)| b.source == source)
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            self.batches.remove(&id);
            self.actions.push_back(Action::Discard { batch: id });
        }
        if self.failed.insert(source) {
            self.actions.push_back(Action::Fail { source, error });
        }
    }

    /// The earlier unfinished batch of the same source, if any.
    fn before(&self, id: BatchId) -> Option<BatchId> {
        let source = self.batches.get(&id)?.source;
        self.batches
            .range(..id)
            .rev()
            .find(|(_, b)| b.source == source)
            .map(|(id, _)| *id)
    }

    /// Moves every batch as far as the rules allow, queuing actions.
    fn advance(&mut self) {
        loop {
            let moved = self.finish_rounds() | self.finish_batches() | self.start_locked_step();
            if !moved {
                return;
            }
        }
    }

    /// Rounds whose work is done end: the batch decides again, holds, finishes or fails.
    fn finish_rounds(&mut self) -> bool {
        let mut moved = false;
        let ids: Vec<BatchId> = self.batches.keys().copied().collect();
        for id in ids {
            let Some(b) = self.batches.get(&id) else {
                continue;
            };
            if b.stage == Stage::Working {
                let r = &b.round;
                let nothing_to_install = r.install == Progress::NotYet
                    && r.unfetched.is_empty()
                    && r.superseded.len() == r.transfers.len();
                if nothing_to_install {
                    if let Some(b) = self.batches.get_mut(&id) {
                        b.round.install = Progress::Done;
                        b.round.rescan_installed = Progress::Done;
                    }
                }
            }
            let Some(b) = self.batches.get(&id) else {
                continue;
            };
            match b.stage {
                Stage::Working if round_done(&b.round) => {}
                Stage::Holding => {
                    // Held records go once the batches they wait for have ended.
                    let ended = b.waits.iter().all(|w| !self.batches.contains_key(w));
                    if ended {
                        let Some(b) = self.batches.get_mut(&id) else {
                            continue;
                        };
                        b.todo.append(&mut b.held);
                        b.todo = order(std::mem::take(&mut b.todo));
                        b.waits.clear();
                        b.stage = Stage::Ready;
                        moved = true;
                    }
                    continue;
                }
                _ => continue,
            }
            let Some(b) = self.batches.get_mut(&id) else {
                continue;
            };
            let round = std::mem::take(&mut b.round);
            let mut todo = round.redo_installed;
            todo.extend(round.redo_decided);
            b.todo = order(todo);
            // Held back once only, so a path two peers keep changing cannot starve.
            b.may_hold = false;
            moved = true;
            if !b.held.is_empty() {
                b.stage = Stage::Holding;
                continue;
            }
            b.rounds += 1;
            if b.todo.is_empty() {
                b.stage = Stage::Finished;
            } else if b.rounds >= MAX_ROUNDS {
                let records = std::mem::take(&mut b.todo);
                b.stage = Stage::Finished;
                self.actions.push_back(Action::Skip { batch: id, records });
            } else {
                b.stage = Stage::Ready;
            }
        }
        moved
    }

    /// Finished batches whose predecessor is applied are applied, in order.
    fn finish_batches(&mut self) -> bool {
        let mut moved = false;
        let ids: Vec<BatchId> = self.batches.keys().copied().collect();
        for id in ids {
            if self.batches.get(&id).map(|b| b.stage) != Some(Stage::Finished) {
                continue;
            }
            if self.before(id).is_some() {
                continue;
            }
            if let Some(b) = self.batches.remove(&id) {
                self.actions.push_back(Action::Applied {
                    batch: id,
                    source: b.source,
                    up_to: b.ack,
                });
                moved = true;
            }
        }
        moved
    }

    /// Starts the next step that needs the folder's lock, if the lock is free: an install
    /// first, then a rescan, then a decision, each in batch order.
    fn start_locked_step(&mut self) -> bool {
        if self.locked.is_some() {
            return false;
        }
        let ids: Vec<BatchId> = self.batches.keys().copied().collect();
        // Installs: every transfer fetched, the decision's rescan done, the batch before applied.
        for &id in &ids {
            let before = self.before(id);
            let Some(b) = self.batches.get_mut(&id) else {
                continue;
            };
            let r = &mut b.round;
            if b.stage == Stage::Working
                && r.install == Progress::NotYet
                && r.unfetched.is_empty()
                && r.rescan_decided == Progress::Done
            {
                let transfers: Vec<usize> = (0..r.transfers.len())
                    .filter(|i| !r.superseded.contains(i))
                    .collect();
                if transfers.is_empty() || before.is_some() {
                    continue;
                }
                r.install = Progress::Running;
                self.locked = Some(id);
                self.actions.push_back(Action::Install {
                    batch: id,
                    transfers,
                });
                return true;
            }
        }
        // Rescans of records whose target changed.
        for &id in &ids {
            let Some(b) = self.batches.get_mut(&id) else {
                continue;
            };
            if b.stage != Stage::Working {
                continue;
            }
            let r = &mut b.round;
            let paths = if r.rescan_decided == Progress::NotYet {
                r.rescan_decided = Progress::Running;
                paths_of(&r.redo_decided)
            } else if r.install == Progress::Done && r.rescan_installed == Progress::NotYet {
                r.rescan_installed = Progress::Running;
                paths_of(&r.redo_installed)
            } else {
                continue;
            };
            self.locked = Some(id);
            self.actions.push_back(Action::Rescan { batch: id, paths });
            return true;
        }
        // Decisions.
        for &id in &ids {
            if self.batches.get(&id).map(|b| b.stage) != Some(Stage::Ready) {
                continue;
            }
            if !self.may_decide(id) {
                continue;
            }
            // For each record, the other sources' batches it would wait for.
            let waits_of: Vec<Vec<BatchId>> = match self.batches.get(&id) {
                Some(b) if b.may_hold => {
                    let held_by = self.holds(id);
                    b.todo
                        .iter()
                        .map(|r| {
                            held_by
                                .iter()
                                .filter(|(_, f)| f.overlaps(&r.path))
                                .map(|(w, _)| *w)
                                .collect()
                        })
                        .collect()
                }
                _ => Vec::new(),
            };
            let Some(b) = self.batches.get_mut(&id) else {
                continue;
            };
            let mut held_paths = InFlight::default();
            let mut records = Vec::new();
            for (i, r) in std::mem::take(&mut b.todo).into_iter().enumerate() {
                let waits = waits_of.get(i).cloned().unwrap_or_default();
                if b.may_hold && (!waits.is_empty() || held_paths.overlaps(&r.path)) {
                    held_paths.insert(&r.path);
                    b.in_flight.insert(&r.path);
                    b.waits.extend(waits);
                    b.held.push(r);
                } else {
                    records.push(r);
                }
            }
            let source = b.source;
            if records.is_empty() {
                // Nothing to decide this round: the round is done at once.
                b.stage = Stage::Working;
                b.decided_once = true;
                b.round = Round {
                    rescan_decided: Progress::Done,
                    install: Progress::Done,
                    rescan_installed: Progress::Done,
                    ..Round::default()
                };
                return true;
            }
            b.stage = Stage::Deciding;
            self.locked = Some(id);
            self.actions.push_back(Action::Decide {
                batch: id,
                source,
                records,
            });
            return true;
        }
        false
    }

    /// Whether batch `id` may decide now: the batch before it (same source) has decided once,
    /// and none of its records depends on a path an earlier batch of its source still has in
    /// flight (then it waits for that batch to be applied).
    fn may_decide(&self, id: BatchId) -> bool {
        let Some(b) = self.batches.get(&id) else {
            return false;
        };
        let earlier: Vec<&Batch> = self
            .batches
            .range(..id)
            .map(|(_, e)| e)
            .filter(|e| e.source == b.source)
            .collect();
        if earlier.iter().any(|e| !e.decided_once) {
            return false;
        }
        !b.todo
            .iter()
            .any(|r| earlier.iter().any(|e| e.in_flight.overlaps(&r.path)))
    }

    /// The unfinished batches of other sources that decided before now, with their paths in
    /// flight: what `id`'s records may be held back for.
    fn holds(&self, id: BatchId) -> Vec<(BatchId, &InFlight)> {
        let Some(b) = self.batches.get(&id) else {
            return Vec::new();
        };
        self.batches
            .iter()
            .filter(|(other, o)| {
                **other != id
                    && o.source != b.source
                    && o.decided_once
                    && !o.in_flight.is_empty()
                    // A batch holding on this one must not be waited for (no cycle).
                    && !o.waits.contains(&id)
            })
            .map(|(other, o)| (*other, &o.in_flight))
            .collect()
    }
}

fn round_done(r: &Round) -> bool {
    r.unfetched.is_empty()
        && r.rescan_decided == Progress::Done
        && r.install == Progress::Done
        && r.rescan_installed == Progress::Done
}

fn paths_of(records: &[FileRecord]) -> Vec<RelPath> {
    records.iter().map(|r| r.path.clone()).collect()
}

/// The order a batch's records are decided in: live records parents before children, then
/// tombstones children before parents; ties by sequence. Except the tombstones below a path
/// that the batch makes a file or a symlink: they come first (children before parents), so a
/// directory replaced by a file (`rm -r d; mv f d` on the sender) is empty by the time the file
/// is decided, instead of being kept for entries that the same batch deletes (whereupon the
/// file, dominated by the kept directory, would be lost).
pub fn order(mut records: Vec<FileRecord>) -> Vec<FileRecord> {
    let replaced: HashSet<RelPath> = records
        .iter()
        .filter(|r| !r.deleted && r.kind != meshfs_protocol::FileKind::Dir)
        .map(|r| r.path.clone())
        .collect();
    records.sort_by_key(|r| {
        let depth = r.path.components().count();
        let group = match (r.deleted, replaced.is_empty()) {
            (false, _) => 1,
            (true, false) if r.path.ancestors().iter().any(|a| replaced.contains(a)) => 0,
            (true, _) => 2,
        };
        (
            group,
            if r.deleted { usize::MAX - depth } else { depth },
            r.sequence,
        )
    });
    records
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshfs_protocol::{FileKind, Hash, ShortId, VersionVector};

    fn rec(path: &str, seq: u64) -> FileRecord {
        FileRecord {
            path: RelPath::new(path).unwrap(),
            kind: FileKind::File,
            deleted: false,
            mode: 0o644,
            mtime_ns: 1,
            size: 1,
            hash: Hash::of(path.as_bytes()),
            chunks: vec![],
            target: String::new(),
            version: VersionVector::new().incremented(ShortId(1), seq),
            modified_by: ShortId(1),
            sequence: seq,
        }
    }

    fn p(s: &str) -> RelPath {
        RelPath::new(s).unwrap()
    }

    /// The actions queued, with the batch of `Applied` left out (tests compare the rest).
    fn drain(pl: &mut Pipeline) -> Vec<Action> {
        std::iter::from_fn(|| pl.poll())
            .map(|a| match a {
                Action::Applied { source, up_to, .. } => Action::Applied {
                    batch: BatchId(0),
                    source,
                    up_to,
                },
                a => a,
            })
            .collect()
    }

    const A: Source = Source(1);
    const B: Source = Source(2);

    #[test]
    fn a_batch_goes_decide_fetch_install_applied() {
        let mut pl = Pipeline::new();
        let id = pl.receive(A, vec![rec("f", 1), rec("g", 2)], Some(2));
        let acts = drain(&mut pl);
        assert!(
            matches!(&acts[..], [Action::Decide { batch, records, .. }] if *batch == id && records.len() == 2)
        );
        pl.decided(id, vec![p("f"), p("g")], vec![], vec![]);
        assert_eq!(
            drain(&mut pl),
            vec![Action::Fetch {
                batch: id,
                source: A,
                transfers: vec![0, 1]
            }]
        );
        pl.fetched(id, 1);
        assert!(
            drain(&mut pl).is_empty(),
            "installs only once all are fetched"
        );
        pl.fetched(id, 0);
        assert_eq!(
            drain(&mut pl),
            vec![Action::Install {
                batch: id,
                transfers: vec![0, 1]
            }]
        );
        pl.installed(id, vec![]);
        assert_eq!(
            drain(&mut pl),
            vec![Action::Applied {
                batch: BatchId(0),
                source: A,
                up_to: Some(2)
            }]
        );
        assert!(pl.is_idle());
    }

    #[test]
    fn a_superseded_transfer_is_not_installed_and_a_batch_of_nothing_but_skips_is_applied() {
        let mut pl = Pipeline::new();
        let id = pl.receive(A, vec![rec("f", 1), rec("g", 2)], Some(2));
        drain(&mut pl);
        pl.decided(id, vec![p("f"), p("g")], vec![], vec![]);
        drain(&mut pl);
        pl.superseded(id, 0);
        pl.fetched(id, 1);
        assert_eq!(
            drain(&mut pl),
            vec![Action::Install {
                batch: id,
                transfers: vec![1]
            }]
        );
        let id2 = pl.receive(A, vec![rec("h", 3)], Some(3));
        pl.installed(id, vec![]);
        let acts = drain(&mut pl);
        assert!(acts.contains(&Action::Applied {
            batch: BatchId(0),
            source: A,
            up_to: Some(2)
        }));
        pl.decided(id2, vec![p("h")], vec![], vec![]);
        drain(&mut pl);
        pl.superseded(id2, 0);
        assert_eq!(
            drain(&mut pl),
            vec![Action::Applied {
                batch: BatchId(0),
                source: A,
                up_to: Some(3)
            }]
        );
    }

    #[test]
    fn one_locked_step_at_a_time_and_fetches_overlap_them() {
        let mut pl = Pipeline::new();
        let a = pl.receive(A, vec![rec("a", 1)], Some(1));
        let b = pl.receive(B, vec![rec("b", 1)], Some(1));
        let acts = drain(&mut pl);
        assert_eq!(acts.len(), 1, "b's decision waits for a's: {acts:?}");
        pl.decided(a, vec![p("a")], vec![], vec![]);
        let acts = drain(&mut pl);
        assert!(acts
            .iter()
            .any(|x| matches!(x, Action::Fetch { batch, .. } if *batch == a)));
        assert!(acts
            .iter()
            .any(|x| matches!(x, Action::Decide { batch, .. } if *batch == b)));
        pl.fetched(a, 0);
        assert!(
            drain(&mut pl).is_empty(),
            "a's install waits for b's decision"
        );
        pl.decided(b, vec![p("b")], vec![], vec![]);
        let acts = drain(&mut pl);
        assert!(acts
            .iter()
            .any(|x| matches!(x, Action::Install { batch, .. } if *batch == a)));
        assert!(acts
            .iter()
            .any(|x| matches!(x, Action::Fetch { batch, .. } if *batch == b)));
    }

    #[test]
    fn a_sessions_batches_decide_in_order_install_in_order_and_are_acknowledged_in_order() {
        let mut pl = Pipeline::new();
        let one = pl.receive(A, vec![rec("x/1", 1)], Some(1));
        let two = pl.receive(A, vec![rec("y/2", 2)], Some(2));
        let acts = drain(&mut pl);
        assert_eq!(acts.len(), 1, "the second waits for the first's decision");
        pl.decided(one, vec![p("x/1")], vec![], vec![]);
        let acts = drain(&mut pl);
        assert!(
            acts.iter()
                .any(|x| matches!(x, Action::Decide { batch, .. } if *batch == two)),
            "apart from the first's paths, the second decides while the first fetches"
        );
        pl.decided(two, vec![p("y/2")], vec![], vec![]);
        drain(&mut pl);
        pl.fetched(two, 0);
        assert!(
            drain(&mut pl).is_empty(),
            "the second installs after the first"
        );
        pl.fetched(one, 0);
        assert_eq!(
            drain(&mut pl),
            vec![Action::Install {
                batch: one,
                transfers: vec![0]
            }]
        );
        pl.installed(one, vec![]);
        assert_eq!(
            drain(&mut pl),
            vec![
                Action::Applied {
                    batch: BatchId(0),
                    source: A,
                    up_to: Some(1)
                },
                Action::Install {
                    batch: two,
                    transfers: vec![0]
                }
            ]
        );
        pl.installed(two, vec![]);
        assert_eq!(
            drain(&mut pl),
            vec![Action::Applied {
                batch: BatchId(0),
                source: A,
                up_to: Some(2)
            }]
        );
    }

    #[test]
    fn a_batch_that_meets_a_path_in_flight_before_it_waits_for_that_batch() {
        let mut pl = Pipeline::new();
        let one = pl.receive(A, vec![rec("d/f", 1)], Some(1));
        let two = pl.receive(A, vec![rec("d", 2)], Some(2));
        drain(&mut pl);
        pl.decided(one, vec![p("d/f")], vec![], vec![]);
        let acts = drain(&mut pl);
        assert!(
            !acts
                .iter()
                .any(|x| matches!(x, Action::Decide { batch, .. } if *batch == two)),
            "{acts:?}"
        );
        pl.fetched(one, 0);
        drain(&mut pl);
        pl.installed(one, vec![]);
        let acts = drain(&mut pl);
        assert!(acts
            .iter()
            .any(|x| matches!(x, Action::Decide { batch, .. } if *batch == two)));
    }

    #[test]
    fn a_record_another_source_has_in_flight_is_held_and_decided_again_once_that_batch_ends() {
        let mut pl = Pipeline::new();
        let a = pl.receive(A, vec![rec("f", 1)], Some(1));
        drain(&mut pl);
        pl.decided(a, vec![p("f")], vec![], vec![]);
        drain(&mut pl);
        // b offers the same version (and an unrelated one, and one below a held path).
        let b = pl.receive(B, vec![rec("f", 7), rec("g", 8)], Some(8));
        let acts = drain(&mut pl);
        let decided: Vec<String> = acts
            .iter()
            .find_map(|x| match x {
                Action::Decide { records, .. } => {
                    Some(records.iter().map(|r| r.path.to_string()).collect())
                }
                _ => None,
            })
            .unwrap();
        assert_eq!(decided, ["g"]);
        pl.decided(b, vec![p("g")], vec![], vec![]);
        drain(&mut pl);
        pl.fetched(b, 0);
        let acts = drain(&mut pl);
        assert!(matches!(&acts[..], [Action::Install { batch, .. }] if *batch == b));
        pl.installed(b, vec![]);
        assert!(
            drain(&mut pl).is_empty(),
            "b waits for a's batch to end before deciding f again"
        );
        pl.fetched(a, 0);
        drain(&mut pl);
        pl.installed(a, vec![]);
        let acts = drain(&mut pl);
        assert!(acts.contains(&Action::Applied {
            batch: BatchId(0),
            source: A,
            up_to: Some(1)
        }));
        let again = acts.iter().find_map(|x| match x {
            Action::Decide { batch, records, .. } if *batch == b => Some(records.clone()),
            _ => None,
        });
        assert_eq!(again.map(|r| r[0].path.clone()), Some(p("f")));
        // Decided again, not held again.
        pl.decided(b, vec![], vec![], vec![]);
        assert_eq!(
            drain(&mut pl),
            vec![Action::Applied {
                batch: BatchId(0),
                source: B,
                up_to: Some(8)
            }]
        );
    }

    #[test]
    fn records_that_change_under_every_round_are_skipped_and_the_rest_of_the_batch_applies() {
        let mut pl = Pipeline::new();
        let id = pl.receive(A, vec![rec("f", 1), rec("g", 2)], Some(2));
        let later = pl.receive(A, vec![rec("h", 3)], Some(3));
        for round in 0..MAX_ROUNDS {
            let acts = drain(&mut pl);
            assert!(
                acts.iter()
                    .any(|x| matches!(x, Action::Decide { batch, .. } if *batch == id)),
                "round {round}: {acts:?}"
            );
            // The first round installs g; f is in the way each time (its rescan finds
            // nothing to record), and is decided alone after that.
            if round == 0 {
                pl.decided(id, vec![p("f"), p("g")], vec![], vec![]);
                pl.fetched(id, 0);
                pl.fetched(id, 1);
            } else {
                pl.decided(id, vec![p("f")], vec![], vec![]);
                pl.fetched(id, 0);
            }
            let acts = drain(&mut pl);
            if round == 0 {
                // The source's next batch decides meanwhile (nothing to fetch), and waits.
                assert!(acts
                    .iter()
                    .any(|x| matches!(x, Action::Decide { batch, .. } if *batch == later)));
                pl.decided(later, vec![], vec![], vec![]);
            }
            let acts: Vec<Action> = acts.into_iter().chain(drain(&mut pl)).collect();
            assert!(acts
                .iter()
                .any(|x| matches!(x, Action::Install { batch, .. } if *batch == id)));
            pl.installed(id, vec![rec("f", 1)]);
            let acts = drain(&mut pl);
            assert!(
                matches!(&acts[..], [Action::Rescan { batch, paths }] if *batch == id && paths == &[p("f")]),
                "round {round}: {acts:?}"
            );
            pl.rescanned(id);
        }
        // f is skipped; the batch, and the source's next one, are applied and acknowledged.
        assert_eq!(
            drain(&mut pl),
            [
                Action::Skip {
                    batch: id,
                    records: vec![rec("f", 1)]
                },
                Action::Applied {
                    batch: BatchId(0),
                    source: A,
                    up_to: Some(2)
                },
                Action::Applied {
                    batch: BatchId(0),
                    source: A,
                    up_to: Some(3)
                },
            ]
        );
        assert!(pl.is_idle());
    }

    #[test]
    fn a_failed_step_fails_every_later_batch_of_its_source_once_and_no_other() {
        let mut pl = Pipeline::new();
        let one = pl.receive(A, vec![rec("a", 1)], Some(1));
        let two = pl.receive(A, vec![rec("b", 2)], Some(2));
        let other = pl.receive(B, vec![rec("c", 1)], Some(1));
        drain(&mut pl);
        pl.failed(one, "disk full".into());
        let acts = drain(&mut pl);
        assert_eq!(
            acts.iter()
                .filter(|x| matches!(x, Action::Fail { .. }))
                .count(),
            1
        );
        assert!(acts.contains(&Action::Discard { batch: one }));
        assert!(acts.contains(&Action::Discard { batch: two }));
        assert!(acts
            .iter()
            .any(|x| matches!(x, Action::Decide { batch, .. } if *batch == other)));
        // Late answers about the failed batches change nothing.
        pl.decided(two, vec![p("b")], vec![], vec![]);
        assert!(!drain(&mut pl)
            .iter()
            .any(|x| matches!(x, Action::Fetch { batch, .. } if *batch == two)));
    }

    #[test]
    fn a_gone_source_is_forgotten_and_its_outstanding_step_still_holds_the_lock() {
        let mut pl = Pipeline::new();
        let one = pl.receive(A, vec![rec("a", 1)], Some(1));
        let other = pl.receive(B, vec![rec("c", 1)], Some(1));
        drain(&mut pl);
        pl.source_gone(A);
        let acts = drain(&mut pl);
        assert_eq!(acts, vec![Action::Discard { batch: one }]);
        // The decision still runs in the executor: b waits for its answer.
        pl.decided(one, vec![p("a")], vec![], vec![]);
        let acts = drain(&mut pl);
        assert!(acts
            .iter()
            .any(|x| matches!(x, Action::Decide { batch, .. } if *batch == other)));
    }

    #[test]
    fn the_entries_of_a_directory_a_batch_makes_a_file_are_deleted_before_it() {
        let mut gone = rec("d/x", 1);
        gone.deleted = true;
        let mut sym = rec("d", 2);
        sym.kind = meshfs_protocol::FileKind::Symlink;
        let out = order(vec![sym, rec("e", 3), gone]);
        let names: Vec<String> = out.iter().map(|r| r.path.to_string()).collect();
        assert_eq!(names, ["d/x", "d", "e"]);
    }

    #[test]
    fn order_puts_parents_first_and_tombstones_last_children_first() {
        let mut dead = rec("d", 1);
        dead.deleted = true;
        let mut dead_child = rec("d/x", 2);
        dead_child.deleted = true;
        let out = order(vec![dead.clone(), rec("a/b", 3), dead_child, rec("a", 4)]);
        let names: Vec<String> = out.iter().map(|r| r.path.to_string()).collect();
        assert_eq!(names, ["a", "a/b", "d/x", "d"]);
    }
}
