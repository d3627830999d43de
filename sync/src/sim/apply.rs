//! The simulation's executor of the receive pipeline ([`crate::pipeline`]): the same
//! pipeline the daemon drives, its actions carried out against the replica models.
//!
//! Each action becomes an event some milliseconds later, so user operations, crashes and
//! other connections' messages land between any two steps; a fetch completes per transfer, in
//! any order, over the batch's own connection (gone: the batch fails), and its content may
//! have been superseded at the sender or arrive corrupt. A decision does the plans that need
//! no content at once and keeps the others as transfers; their install checks, as the store
//! does, that the journal still holds what the decision saw (`Basis`) and that nothing the user
//! changed and the watcher has not reported yet is in the way — otherwise the record is
//! rescanned and decided again. Two invariants are checked here:
//! - (g) no apply ever replaces a local change the watcher has not reported yet (in
//!   [`Sim::write`]);
//! - (h) a batch is acknowledged only once every record in it is in the journal (or a newer
//!   version is), or was skipped: the sender no longer had its content, or its path changed
//!   under every round of the pipeline.

use super::replica::Pending;
use super::{outcome_name, Event, Res, Sim};
use crate::pipeline::{Action, BatchId, Source};
use crate::plan::{plan, Disk, Plan};
use crate::reconcile::Outcome;
use meshfs_protocol::{FileKind, FileRecord, FolderId, Hash, RelPath, VersionVector};
use rand::Rng;
use std::collections::HashMap;

/// A pipeline step due as an event.
pub(super) enum Step {
    Decide(BatchId),
    Rescan(BatchId),
    Fetched(BatchId, usize),
    Install(BatchId),
}

/// What the executor holds for one batch.
pub(super) struct Work {
    conn: u64,
    sender: usize,
    folder: FolderId,
    /// The batch as received (for the acknowledgement's check).
    records: Vec<FileRecord>,
    /// Records of the outstanding decision.
    deciding: Vec<FileRecord>,
    /// The transfers of the last decision, and which of them to install.
    transfers: Vec<Transfer>,
    installing: Vec<usize>,
    /// Records not applied because their content was gone at the sender, or refused.
    skipped: Vec<FileRecord>,
    /// The highest transfer index fetched so far (for the out-of-order count).
    last_fetched: Option<usize>,
}

/// A decided record whose plan needs content: the part of its plan the daemon does at the
/// install (the steps with content, and the steps whose journal change waits for them), the
/// rest being done at the decision.
struct Transfer {
    remote: FileRecord,
    plan: Plan,
    /// The content steps, each with what its path held when decided (the daemon's `Basis`).
    content: Vec<Staged>,
    /// The steps that wait for an install (a local winner's resolution waits for the remote
    /// loser's sibling), likewise.
    waiting: Vec<Staged>,
    /// The content, once fetched.
    blobs: HashMap<Hash, Vec<u8>>,
}

/// One step held for the install, and what its path held when it was decided.
struct Staged {
    index: usize,
    pending: Pending,
    basis: Option<VersionVector>,
}

/// Whether one path is, contains or lies in the other.
pub(super) fn overlaps(a: &RelPath, b: &RelPath) -> bool {
    a.is_within(b) || b.is_within(a)
}

impl Sim {
    /// A session of connection `conn` hands over `records` from `sender`.
    pub(super) fn receive(
        &mut self,
        r: usize,
        conn: u64,
        sender: usize,
        folder: FolderId,
        records: Vec<FileRecord>,
        up_to: u64,
    ) -> Res<()> {
        let batch = self.replicas[r]
            .pipe
            .receive(Source(conn), records.clone(), Some(up_to));
        self.replicas[r].work.insert(
            batch,
            Work {
                conn,
                sender,
                folder,
                records,
                deciding: Vec::new(),
                transfers: Vec::new(),
                installing: Vec::new(),
                skipped: Vec::new(),
                last_fetched: None,
            },
        );
        self.pump(r)
    }

    fn later(&mut self, r: usize, max_ms: u64, step: Step) -> u64 {
        let at = self.now + self.rng.gen_range(0..=max_ms);
        let epoch = self.replicas[r].epoch;
        self.schedule(
            at,
            Event::Step {
                replica: r,
                epoch,
                step,
            },
        );
        at
    }

    /// Carries out what the pipeline of `r` asks for next.
    pub(super) fn pump(&mut self, r: usize) -> Res<()> {
        while let Some(action) = self.replicas[r].pipe.poll() {
            match action {
                Action::Decide { batch, records, .. } => {
                    let rep = &mut self.replicas[r];
                    if let Some(conn) = rep.work.get(&batch).map(|w| w.conn) {
                        if rep.work.iter().any(|(b, w)| *b < batch && w.conn == conn) {
                            self.report.ran_ahead += 1;
                        }
                    }
                    if let Some(w) = self.replicas[r].work.get_mut(&batch) {
                        w.deciding = records;
                    }
                    self.later(r, 5, Step::Decide(batch));
                }
                Action::Rescan { batch, .. } => {
                    self.later(r, 5, Step::Rescan(batch));
                }
                Action::Fetch {
                    batch, transfers, ..
                } => {
                    for i in transfers {
                        self.later(r, 40, Step::Fetched(batch, i));
                    }
                }
                Action::Install { batch, transfers } => {
                    let race = self.rng.gen_bool(0.2);
                    let at = self.now + self.rng.gen_range(0..=5);
                    let mut target = None;
                    if let Some(w) = self.replicas[r].work.get_mut(&batch) {
                        target = transfers
                            .first()
                            .and_then(|&i| w.transfers.get(i))
                            .and_then(|t| {
                                t.plan
                                    .steps
                                    .iter()
                                    .find(|s| s.disk == Disk::Content)
                                    .map(|s| s.record().path.clone())
                            });
                        w.installing = transfers;
                    }
                    // Now and then the user saves the very file a moment before it is installed
                    // (not a conflict copy: users keep to the names of the workload).
                    let target = target.filter(|p| !p.file_name().contains(".sync-conflict-"));
                    if let (true, Some(path)) = (race, target) {
                        self.schedule(at, Event::RaceWrite { replica: r, path });
                    }
                    let epoch = self.replicas[r].epoch;
                    self.schedule(
                        at,
                        Event::Step {
                            replica: r,
                            epoch,
                            step: Step::Install(batch),
                        },
                    );
                }
                Action::Discard { batch } => {
                    self.replicas[r].work.remove(&batch);
                }
                Action::Applied { batch, up_to, .. } => self.applied(r, batch, up_to)?,
                Action::Skip { batch, records } => {
                    self.report.skipped_changing += records.len() as u64;
                    self.log(|| {
                        let paths: Vec<&str> = records.iter().map(|x| x.path.as_str()).collect();
                        format!("r{r} skips {paths:?}: changed under every round")
                    });
                    if let Some(w) = self.replicas[r].work.get_mut(&batch) {
                        w.skipped.extend(records);
                    }
                }
                Action::Fail { source, error } => {
                    self.report.pipeline_failures += 1;
                    let conn = source.0;
                    self.log(|| format!("r{r} gives up conn {conn}'s batches: {error}"));
                    // The session ends; the link is up, so it is dialled again and the peer
                    // sends what was not acknowledged.
                    if let Some(ends) = self.conns.get(&conn).map(|c| c.ends) {
                        self.drop_conn(conn)?;
                        let t = self.now + self.rng.gen_range(10..=60);
                        self.schedule(t, Event::Connect(ends[0], ends[1]));
                    }
                }
            }
        }
        Ok(())
    }

    /// A pipeline step of `r` is due.
    pub(super) fn step(&mut self, r: usize, step: Step) -> Res<()> {
        // A crash between any two steps of the pipeline.
        if self.crash_apply_p > 0.0 && self.rng.gen_bool(self.crash_apply_p / 5.0) {
            self.log(|| format!("r{r} crash between pipeline steps"));
            return self.crash(r);
        }
        match step {
            Step::Decide(batch) => self.decide(r, batch),
            Step::Rescan(batch) => {
                self.capture(r)?;
                self.replicas[r].pipe.rescanned(batch);
                self.pump(r)
            }
            Step::Fetched(batch, i) => self.fetched(r, batch, i),
            Step::Install(batch) => self.install(r, batch),
        }
    }

    fn decide(&mut self, r: usize, batch: BatchId) -> Res<()> {
        let Some(w) = self.replicas[r].work.get_mut(&batch) else {
            // Discarded meanwhile: the answer only lets the pipeline's lock go.
            self.replicas[r]
                .pipe
                .decided(batch, Vec::new(), Vec::new(), Vec::new());
            return self.pump(r);
        };
        let records = std::mem::take(&mut w.deciding);
        let sender = w.sender;
        let (mut transfers, mut paths, mut redo, mut skipped) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        // Paths in flight beside the transfers' targets: where waiting changes will land.
        let mut also = Vec::new();
        let mut grew = false;
        for remote in records {
            let decision = plan(&self.replicas[r].journal, &remote).map_err(|e| e.to_string())?;
            if let Some(local) = self.replicas[r].journal.record(&remote.path).cloned() {
                self.truth
                    .check_order(&local, &remote, local.version.compare(&remote.version))?;
                self.check_resolution(r, &local, &remote, &decision)?;
            }
            if matches!(decision.outcome, Outcome::Refused(_)) {
                skipped.push(remote);
                continue;
            }
            if decision.steps.is_empty() {
                continue;
            }
            let content: Vec<usize> = (0..decision.steps.len())
                .filter(|&i| decision.steps[i].disk == Disk::Content)
                .collect();
            if content.is_empty() {
                if self.blocked(r, &decision, None) {
                    self.report.redecided += 1;
                    redo.push(remote);
                    continue;
                }
                self.count_outcome(r, &remote, &decision);
                if self.execute(r, sender, &remote, &decision, &HashMap::new())? {
                    return Ok(()); // crashed in the middle
                }
                grew = true;
                continue;
            }
            // As the daemon does: the steps without content now, those with content and those
            // whose journal change waits for them at the install.
            let waiting: Vec<usize> = (0..decision.steps.len())
                .filter(|&i| {
                    decision.steps[i]
                        .after
                        .is_some_and(|a| content.contains(&a))
                })
                .collect();
            let now_steps: Vec<usize> = (0..decision.steps.len())
                .filter(|i| !content.contains(i) && !waiting.contains(i))
                .collect();
            if self.blocked(r, &decision, Some(&now_steps)) {
                self.report.redecided += 1;
                redo.push(remote);
                continue;
            }
            let mut pending: Vec<Option<Pending>> = self
                .pending_steps(r, sender, &remote, &decision)?
                .into_iter()
                .map(Some)
                .collect();
            let mut take = |i: usize| pending.get_mut(i).and_then(Option::take);
            let now_run: Vec<(usize, Pending)> = now_steps
                .iter()
                .filter_map(|&i| Some((i, take(i)?)))
                .collect();
            let stage = |idx: &[usize], take: &mut dyn FnMut(usize) -> Option<Pending>| {
                idx.iter()
                    .filter_map(|&i| {
                        Some(Staged {
                            index: i,
                            pending: take(i)?,
                            basis: None,
                        })
                    })
                    .collect::<Vec<Staged>>()
            };
            let mut staged_content = stage(&content, &mut take);
            let mut staged_waiting = stage(&waiting, &mut take);
            if !now_run.is_empty() {
                self.count_outcome(r, &remote, &decision);
                if self.run_steps(r, &decision, now_run, &HashMap::new())? {
                    return Ok(()); // crashed in the middle
                }
                grew = true;
            }
            let j = &self.replicas[r].journal;
            for s in staged_content.iter_mut().chain(staged_waiting.iter_mut()) {
                let path = &decision.steps[s.index].record().path;
                s.basis = j.record(path).map(|rec| rec.version.clone());
            }
            paths.push(decision.steps[content[0]].record().path.clone());
            also.extend(
                staged_waiting
                    .iter()
                    .map(|s| decision.steps[s.index].record().path.clone()),
            );
            transfers.push(Transfer {
                remote,
                plan: decision,
                content: staged_content,
                waiting: staged_waiting,
                blobs: HashMap::new(),
            });
        }
        if let Some(w) = self.replicas[r].work.get_mut(&batch) {
            w.transfers = transfers;
            w.skipped.extend(skipped);
            w.last_fetched = None;
        }
        self.replicas[r].pipe.decided(batch, paths, also, redo);
        self.check_consistency(r)?;
        if grew {
            self.notify(r)?;
        }
        self.pump(r)
    }

    /// Whether a plan would touch something the user changed and the watcher has not
    /// reported yet (the store's expectation check, which sees it on disk).
    fn blocked(&self, r: usize, d: &Plan, only: Option<&[usize]>) -> bool {
        let uncaptured = &self.replicas[r].uncaptured;
        let steps: Vec<&crate::plan::Planned> = match only {
            Some(idx) => idx.iter().filter_map(|&i| d.steps.get(i)).collect(),
            None => d.steps.iter().collect(),
        };
        steps.into_iter().any(|s| {
            let from = match &s.disk {
                Disk::CopyLocal { from } => Some(from),
                _ => None,
            };
            uncaptured
                .iter()
                .any(|u| overlaps(u, &s.record().path) || from.is_some_and(|f| overlaps(u, f)))
        })
    }

    fn count_outcome(&mut self, r: usize, remote: &FileRecord, d: &Plan) {
        self.log(|| format!("r{r} {} {}: {:?}", remote.path, remote.version, d.outcome));
        *self
            .report
            .outcomes
            .entry(outcome_name(&d.outcome))
            .or_default() += 1;
    }

    fn fetched(&mut self, r: usize, batch: BatchId, i: usize) -> Res<()> {
        let Some(w) = self.replicas[r].work.get(&batch) else {
            return Ok(());
        };
        let (conn, sender) = (w.conn, w.sender);
        let Some(t) = w.transfers.get(i) else {
            return Ok(());
        };
        if w.last_fetched.is_some_and(|l| l > i) {
            self.report.out_of_order += 1;
        }
        // Chunks come over the batch's own connection.
        if !self.conns.contains_key(&conn) || !self.replicas[sender].alive {
            self.replicas[r]
                .pipe
                .failed(batch, "the peer went away mid-fetch".into());
            return self.pump(r);
        }
        let mut blobs = HashMap::new();
        let mut superseded = false;
        for step in t.plan.steps.iter().filter(|s| s.disk == Disk::Content) {
            let rec = step.record();
            if rec.size == 0 {
                blobs.insert(rec.hash, Vec::new());
                continue;
            }
            let found = self.replicas[r]
                .fs
                .find_content(&rec.hash)
                .or_else(|| self.replicas[sender].fs.find_content(&rec.hash))
                .map(<[u8]>::to_vec);
            match found {
                Some(b) => {
                    blobs.insert(rec.hash, b);
                }
                None => superseded = true,
            }
        }
        let remote = t.remote.clone();
        if superseded {
            self.report.superseded += 1;
            self.log(|| format!("r{r} skips superseded {} {}", remote.path, remote.version));
            if let Some(w) = self.replicas[r].work.get_mut(&batch) {
                w.skipped.push(remote);
            }
            self.replicas[r].pipe.superseded(batch, i);
            return self.pump(r);
        }
        if self.rng.gen_bool(self.fetch_fail_p) {
            self.report.fetch_retries += 1;
            self.replicas[r]
                .pipe
                .failed(batch, "a chunk arrived corrupt".into());
            return self.pump(r);
        }
        if let Some(w) = self.replicas[r].work.get_mut(&batch) {
            w.last_fetched = Some(w.last_fetched.map_or(i, |l| l.max(i)));
            if let Some(t) = w.transfers.get_mut(i) {
                t.blobs = blobs;
            }
        }
        self.replicas[r].pipe.fetched(batch, i);
        self.pump(r)
    }

    fn install(&mut self, r: usize, batch: BatchId) -> Res<()> {
        let Some(w) = self.replicas[r].work.get_mut(&batch) else {
            self.replicas[r].pipe.installed(batch, Vec::new());
            return self.pump(r);
        };
        let list = std::mem::take(&mut w.installing);
        let transfers = std::mem::take(&mut w.transfers);
        let mut redo = Vec::new();
        let mut grew = false;
        for i in list {
            let Some(t) = transfers.get(i) else { continue };
            // The daemon's `Basis`: the journal still holds, at each content step's path, what
            // the decision saw; and nothing the user changed is in the way.
            let j = &self.replicas[r].journal;
            let same = |s: &Staged| {
                j.record(&t.plan.steps[s.index].record().path)
                    .map(|rec| rec.version.clone())
                    == s.basis
            };
            let content_idx: Vec<usize> = t.content.iter().map(|s| s.index).collect();
            // A directory the file goes into that is gone since (a local `rm -r` captured
            // meanwhile) is a changed target too: decided again, it is revived or the file
            // conflicts with the deletion.
            let fs = &self.replicas[r].fs;
            let parents = t
                .content
                .iter()
                .all(|s| fs.parent_is_dir(&t.plan.steps[s.index].record().path));
            // A file replaces a directory only while it is empty (the store's `rmdir`): one
            // that holds entries since the decision (created and captured meanwhile) is a
            // changed target, decided again with them in view.
            let over_entries = t.content.iter().any(|s| {
                let p = &t.plan.steps[s.index].record().path;
                fs.nodes.get(p).is_some_and(|n| n.kind() == FileKind::Dir) && fs.has_children(p)
            });
            if !parents
                || over_entries
                || !t.content.iter().all(same)
                || self.blocked(r, &t.plan, Some(&content_idx))
            {
                self.report.redecided += 1;
                redo.push(t.remote.clone());
                continue;
            }
            // The waiting changes go ahead only if their paths still hold what the decision
            // saw (else the record is decided again; the sibling just installed is kept).
            let waiting_fresh = t.waiting.iter().all(same);
            self.count_outcome(r, &t.remote, &t.plan);
            let content = t
                .content
                .iter()
                .map(|s| (s.index, s.pending.clone()))
                .collect();
            if self.run_steps(r, &t.plan, content, &t.blobs)? {
                return Ok(()); // crashed in the middle
            }
            grew = true;
            if !waiting_fresh {
                self.report.redecided += 1;
                redo.push(t.remote.clone());
                continue;
            }
            let waiting = t
                .waiting
                .iter()
                .map(|s| (s.index, s.pending.clone()))
                .collect();
            if self.run_steps(r, &t.plan, waiting, &t.blobs)? {
                return Ok(());
            }
        }
        self.replicas[r].pipe.installed(batch, redo);
        self.check_consistency(r)?;
        if grew {
            self.notify(r)?;
        }
        self.pump(r)
    }

    /// (h) The batch is applied: every record in it is in the journal (or a newer version is),
    /// or was skipped. Only then its peer hears so.
    fn applied(&mut self, r: usize, batch: BatchId, up_to: Option<u64>) -> Res<()> {
        let Some(w) = self.replicas[r].work.remove(&batch) else {
            return Ok(());
        };
        let j = &self.replicas[r].journal;
        for rec in &w.records {
            let durable = j
                .record(&rec.path)
                .is_some_and(|now| now.version.dominates(&rec.version));
            let skipped = w
                .skipped
                .iter()
                .any(|s| s.path == rec.path && s.version == rec.version);
            if !durable && !skipped {
                return Err(format!(
                    "(h) r{r} acknowledges {} {} before it is applied",
                    rec.path, rec.version
                ));
            }
        }
        let Some(up_to) = up_to else { return Ok(()) };
        let Some(c) = self.conns.get_mut(&w.conn) else {
            return Ok(());
        };
        let side = if c.ends[0] == r { 0 } else { 1 };
        let acts = c.sessions[side].applied(&w.folder, up_to);
        self.process(w.conn, side, acts)
    }
}
