//! Step 1: plan every record of a batch against the journal and do the steps that need no
//! content (metadata, directories, symlinks, deletions, copies of local losers), journaling
//! them as they are done. File contents become [`Transfer`]s for step 2.

use super::transfer::{prepare, seen_of, skip_or_fail, ApplyError, Look, Meta, Sources, Transfer};
use crate::failpoint;
use crate::folder::{FolderError, FolderRt, Folders, Wait};
use crate::ignore::{IgnoreRules, IGNORE_FILE};
use crate::journal::{Change, Journal, StoredRecord};
use crate::lock::RankedGuard;
use crate::store::{DirCache, Expect, LocalStat, StoreError};
use meshfs_protocol::{DeviceId, FileKind, FileRecord, FolderId, RelPath};
use meshfs_sync::plan::{self, Disk, Plan, Planned};
use meshfs_sync::reconcile::{Outcome, ReadError, ReplicaView, Step};
use meshfs_sync::role::{self, Intake};
use std::cell::RefCell;
use std::collections::HashMap;

/// The journal records read while deciding one batch, so that the parent directory shared by a
/// thousand records is read once, not a thousand times. Lives only inside [`decide_all`] (which
/// holds the journal), and forgets a path whenever a change to it is committed.
#[derive(Default)]
struct Memo(
    RefCell<HashMap<RelPath, Option<StoredRecord>>>,
    /// The paths of changes done but not committed, by path text, and whether each is live:
    /// what the journal does not know yet below a directory.
    RefCell<std::collections::BTreeMap<String, bool>>,
);

impl Memo {
    fn get(
        &self,
        journal: &Journal,
        folder: &FolderId,
        path: &RelPath,
    ) -> Result<Option<StoredRecord>, ReadError> {
        if let Some(v) = self.0.borrow().get(path) {
            return Ok(v.clone());
        }
        let v = journal.get(folder, path).map_err(ReadError::from_display)?;
        self.0.borrow_mut().insert(path.clone(), v.clone());
        Ok(v)
    }

    /// `change` is decided and done on disk but not committed yet: later reads see it.
    fn put(&self, change: &Change) {
        self.1.borrow_mut().insert(
            change.record.path.as_str().to_owned(),
            !change.record.deleted,
        );
        self.0.borrow_mut().insert(
            change.record.path.clone(),
            Some(StoredRecord {
                record: change.record.clone(),
                local: change.local,
                source: change.source,
            }),
        );
    }
}

/// The journal as the planner reads it. A read error fails the plan (and the batch): it is
/// never taken for "no record here" or "nothing below".
struct View<'a> {
    journal: &'a Journal,
    folder: &'a FolderId,
    memo: &'a Memo,
}

impl ReplicaView for View<'_> {
    fn get(&self, path: &RelPath) -> Result<Option<FileRecord>, ReadError> {
        Ok(self
            .memo
            .get(self.journal, self.folder, path)?
            .map(|s| s.record))
    }
    /// What the journal has below `dir`, with this batch's changes done but not committed yet
    /// (a deletion below a directory that a file replaces goes first in the batch: the file's
    /// decision must see it).
    fn has_live_below(&self, dir: &RelPath) -> Result<bool, ReadError> {
        // Strictly below `dir`: from "dir/" up to "dir0" ('0' follows '/').
        let (lo, hi) = (format!("{}/", dir.as_str()), format!("{}0", dir.as_str()));
        let done = self.memo.1.borrow();
        let mut noted = done.range(lo..hi).peekable();
        if noted.peek().is_none() {
            return self
                .journal
                .has_live_below(self.folder, dir)
                .map_err(ReadError::from_display);
        }
        if noted.any(|(_, live)| *live) {
            return Ok(true);
        }
        Ok(self
            .journal
            .below(self.folder, dir)
            .map_err(ReadError::from_display)?
            .iter()
            .any(|s| !s.record.deleted && !done.contains_key(s.record.path.as_str())))
    }
}

/// What step 1 leaves to do.
pub(super) struct Decided {
    /// File contents to assemble.
    pub transfers: Vec<Transfer>,
    /// Remote records whose local target changed under us: rescan, then decide again.
    pub redo: Vec<FileRecord>,
    /// The directories the decision walked to, reused to assemble the contents.
    pub dirs: DirCache,
    /// The local files the contents' chunks are copied from, opened by the decision.
    pub sources: Sources,
}

/// Step 1 for records of a batch from `peer` (those the receive pipeline did not hold back),
/// under the folder's lock and holding the journal.
pub(super) fn decide_all(
    folders: &Folders,
    rt: &FolderRt,
    folder: &FolderId,
    peer: DeviceId,
    records: Vec<FileRecord>,
) -> Result<Decided, ApplyError> {
    // The locks and the rules are let go before the rules are read again.
    let (decided, touched_ignore) = {
        let _guard = rt
            .op_lock
            .lock()
            .map_err(|_| FolderError::Poisoned("folder"))?;
        let ignore = rt
            .ignore
            .read()
            .map_err(|_| FolderError::Poisoned("ignore"))?;
        let mut d = Deciding {
            journal: Held {
                folders,
                guard: None,
            },
            folders,
            rt,
            ignore: &ignore,
            sources: Sources::default(),
            touched_ignore: false,
            folder,
            peer,
            memo: Memo::default(),
            dirs: DirCache::default(),
            done: Vec::new(),
            transfers: Vec::new(),
            redo: Vec::new(),
        };
        let result = records.into_iter().try_for_each(|r| d.record(r));
        d.journal.release();
        // Changes done on disk are committed even when deciding fails.
        let flushed = match d.done.is_empty() {
            true => Ok(()),
            false => folders
                .journal()?
                .commit(folder, std::mem::take(&mut d.done))
                .map(|_| ()),
        };
        result?;
        flushed?;
        // Between a decision and its install the folder's lock is let go (for tests: what another
        // batch or a local edit does meanwhile). Detail: a transfer's remote path.
        for t in &d.transfers {
            failpoint::hit("apply.decided", t.meta.remote.path.as_str());
        }
        let Deciding {
            transfers,
            redo,
            dirs,
            sources,
            touched_ignore,
            ..
        } = d;
        let decided = Decided {
            transfers,
            redo,
            dirs,
            sources,
        };
        (decided, touched_ignore)
    };
    if touched_ignore {
        folders.reload_ignore(rt);
    }
    Ok(decided)
}

/// Why a remote version at an ignored path is skipped (`status`).
pub(super) const IGNORED_HERE: &str =
    "ignored on this device (a local or shared ignore rule covers it); not written here";

/// Whether the rest of a plan goes on after a step.
enum Flow {
    Next,
    Stop,
}

/// The journal as a decision holds it: in one read transaction (`Journal::begin_reads`), let go
/// while a transfer copies local chunks (disk work whose size the peer's record decides), so
/// that other folders' sessions and scans do not wait for it, and taken again at its next use.
/// This folder's records cannot change meanwhile: the decision holds the folder's lock.
struct Held<'a> {
    folders: &'a Folders,
    guard: Option<RankedGuard<'a, Journal>>,
}

impl Held<'_> {
    fn get(&mut self) -> Result<&mut Journal, ApplyError> {
        let guard = match self.guard.take() {
            Some(g) => g,
            None => {
                let mut g = self.folders.journal()?;
                g.begin_reads();
                g
            }
        };
        Ok(&mut **self.guard.insert(guard))
    }

    fn release(&mut self) {
        if let Some(mut g) = self.guard.take() {
            g.end_reads();
        }
    }
}

/// One batch being decided: the journal held, and what the steps done so far left.
struct Deciding<'a> {
    journal: Held<'a>,
    folders: &'a Folders,
    rt: &'a FolderRt,
    /// The files this batch's contents copy chunks from.
    sources: Sources,
    /// A change of `.meshignore` was done: the rules are read again once the locks are let go.
    touched_ignore: bool,
    /// The folder's ignore rules (local and shared): what they cover is never written here.
    ignore: &'a IgnoreRules,
    folder: &'a FolderId,
    peer: DeviceId,
    memo: Memo,
    dirs: DirCache,
    /// Changes done on disk, committed together: one transaction per thousand records rather
    /// than one per record (two devices starting from the same tree exchange every record
    /// and each becomes a metadata-only change).
    done: Vec<Change>,
    transfers: Vec<Transfer>,
    redo: Vec<FileRecord>,
}

impl Deciding<'_> {
    /// Plans one remote record and does its steps.
    fn record(&mut self, remote: FileRecord) -> Result<(), ApplyError> {
        if self.ignored(&remote) {
            return Ok(());
        }
        // Under the folder's lock, before anything of the record is looked at: no capture
        // can journal a local file at its path until it goes on.
        failpoint::hit("apply.deciding", remote.path.as_str());
        // Tombstones come after every live record (children first) and ask SQLite whether
        // live entries remain below them: commit what this batch did so far first.
        if (remote.deleted || self.done.len() >= 1000) && !self.done.is_empty() {
            self.journal
                .get()?
                .commit(self.folder, std::mem::take(&mut self.done))?;
        }
        let journal = self.journal.get()?;
        let local_before = self
            .memo
            .get(journal, self.folder, &remote.path)?
            .map(|s| s.record);
        let view = View {
            journal,
            folder: self.folder,
            memo: &self.memo,
        };
        // The folder's role may keep a peer's version from being applied, or take it as it
        // is (`meshfs_sync::role`).
        let plan = match role::intake(self.rt.role(), local_before.as_ref(), &remote) {
            Intake::Decide => plan::plan(&view, &remote)?,
            Intake::Take => plan::plan_taking(&view, &remote)?,
            Intake::Hold => {
                tracing::debug!(folder = %self.folder, path = %remote.path, "send-only: a peer's version is held, not applied");
                self.journal
                    .get()?
                    .put_held(self.folder, &remote, &self.peer)?;
                return Ok(());
            }
        };
        let Some((plan, not_kept)) = self.settle_placeholders(plan, &remote)? else {
            return Ok(());
        };
        if let Outcome::Refused(why) = &plan.outcome {
            // Keeping it would make a record no peer accepts: shown, the rest goes on.
            if self.rt.skip(remote.path.clone(), why.to_string()) {
                tracing::warn!(folder = %self.folder, path = %remote.path, error = %why, "a remote version is refused; skipped (see status)");
            }
            return Ok(());
        }
        // Objects made without a temp file are journaled pending first: a crash after the
        // link or symlink is made and before its commit leaves a pending row that start-up
        // recognises (`recover_pending`), never an object the scan would take for an edit.
        let made_here: Vec<(FileRecord, Option<DeviceId>)> = plan
            .steps
            .iter()
            .filter(|s| s.pending_first)
            .map(|s| (s.record().clone(), None))
            .collect();
        if !made_here.is_empty() {
            self.journal.get()?.put_pending(self.folder, &made_here)?;
        }
        // The journal's detail: the conflict, or the local versions not kept (D103).
        let conflict = plan
            .conflict
            .map(|winner_is_local| conflict_detail(local_before.as_ref(), &remote, winner_is_local))
            .or(not_kept);
        if let Some(d) = &conflict {
            tracing::info!(folder = %self.folder, path = %remote.path, detail = %d, "conflict resolved");
        }
        // Where each step's transfer went (a later step's change may wait for its install).
        let mut transfer_of: Vec<Option<usize>> = Vec::with_capacity(plan.steps.len());
        for planned in plan.steps {
            let waits = planned
                .after
                .and_then(|i| transfer_of.get(i).copied().flatten());
            transfer_of.push(None);
            let (change, flow) = match planned.disk {
                Disk::Content => {
                    if let Some(i) = self.content(planned, &remote, conflict.clone())? {
                        if let Some(slot) = transfer_of.last_mut() {
                            *slot = Some(i);
                        }
                    }
                    (None, Flow::Next)
                }
                _ => self.step(planned, &remote, conflict.clone())?,
            };
            if let Some(c) = change {
                self.rt.unskip(&c.record.path);
                self.rt.invalidator.invalidate(&c.record.path);
                match waits {
                    Some(i) => {
                        // What its path holds now: the change is journaled at the install only
                        // if the path still holds it.
                        let basis = self.stored(&c.record.path)?.map(|s| s.record.version);
                        self.transfers[i].meta.then.push((c, basis));
                    }
                    None => {
                        self.touched_ignore |= c.record.path.as_str() == IGNORE_FILE;
                        self.memo.put(&c);
                        self.done.push(c);
                    }
                }
            }
            if let Flow::Stop = flow {
                break;
            }
        }
        Ok(())
    }

    /// A remote version at a path this device ignores (its local rules, or the shared ones)
    /// is neither written nor journaled: the user said meshfs must not touch that path here,
    /// and a peer must not be able to write there (`.git/hooks/…`) because it does not ignore
    /// it. A live version is listed as skipped (`status`); a deletion leaves whatever is
    /// there alone, unlisted (it is not this device's to delete). The batch goes on and is
    /// acknowledged: the version is not sent again; it applies once the peer changes the path
    /// after the rule is lifted.
    fn ignored(&mut self, remote: &FileRecord) -> bool {
        if !self
            .ignore
            .is_ignored(&remote.path, remote.kind == FileKind::Dir)
        {
            return false;
        }
        if remote.deleted {
            tracing::debug!(folder = %self.folder, path = %remote.path, "a remote deletion at a path ignored here; the path is left alone");
        } else if self.rt.skip(remote.path.clone(), IGNORED_HERE.into()) {
            tracing::info!(folder = %self.folder, path = %remote.path, "a remote version at a path ignored here is not written (see status)");
        }
        true
    }

    /// The journal's record at `path` (read through the batch's memo).
    fn stored(&mut self, path: &RelPath) -> Result<Option<StoredRecord>, ApplyError> {
        let journal = self.journal.get()?;
        Ok(self.memo.get(journal, self.folder, path)?)
    }

    /// A step whose content comes from chunks: starts its transfer. Returns the transfer's
    /// index, or `None` when the path is open for writing through the mount (deferred).
    fn content(
        &mut self,
        planned: Planned,
        remote: &FileRecord,
        detail: Option<String>,
    ) -> Result<Option<usize>, ApplyError> {
        if self.deferred(&planned, remote)? {
            return Ok(None);
        }
        let stored = self.stored(&planned.record().path)?;
        let (expect, basis) = seen_of(stored.as_ref());
        // A loser kept here as a sibling is fetched now, from the peer that sent it: that
        // peer may supersede it before the sibling reaches it (D101).
        let placeholder = !matches!(planned.step, Step::PreserveRemote { .. })
            && self.on_demand(planned.record(), stored.as_ref())?;
        let meta = Meta {
            record: planned.record().clone(),
            op: planned.op,
            source: planned.from_peer.then_some(self.peer),
            expect,
            basis,
            detail,
            remote: remote.clone(),
            then: Vec::new(),
            content_room: None,
            journal_room: None,
            placeholder,
        };
        // Room claimed and sources found under the lock; the copying is the assembly's.
        let t = prepare(
            self.journal.get()?,
            self.folders,
            self.rt,
            meta,
            &mut self.sources,
            &mut self.dirs,
            Look::Now,
        )?;
        self.transfers.push(t);
        Ok(Some(self.transfers.len() - 1))
    }

    /// Whether the content of `record` stays online (a placeholder is installed, D91): the
    /// folder is on demand, the file is not empty, its path is not kept (pinned, or outside
    /// the subtrees on demand, D77), it does not hold a
    /// local file now (a file that is local stays local: the budget decides later), and some
    /// of its content is not here (a file a peer renamed or copied is made from local chunks,
    /// as anywhere).
    fn on_demand(
        &mut self,
        record: &FileRecord,
        stored: Option<&StoredRecord>,
    ) -> Result<bool, ApplyError> {
        if !self.rt.policy().on_demand
            || record.kind != FileKind::File
            || record.size == 0
            || self.rt.demand.kept(&record.path)
        {
            return Ok(false);
        }
        let had_file = stored.is_some_and(|s| !s.record.deleted && s.record.kind == FileKind::File);
        if had_file
            && self
                .rt
                .store
                .placeholder_at(&mut self.dirs, &record.path)
                .is_none()
        {
            return Ok(false);
        }
        // Placeholders' chunks are not in the chunk index (`Journal::find_chunk`): a chunk
        // found is local content. The first one missing settles it.
        let folder = self.folder;
        let journal = self.journal.get()?;
        let all_here = crate::journal::indexed_chunks(record).all(|(_, c)| {
            journal
                .find_chunk(folder, &c.hash)
                .is_ok_and(|at| at.iter().any(|l| l.len == c.len))
        });
        Ok(!all_here)
    }

    /// A remote version of a path open for writing through the mount is never replaced,
    /// renamed away or deleted under its writer. The rest of the batch goes on; the path is
    /// decided again after the last writing handle is released (`Engine::apply_deferred`).
    /// The version is journaled first: the batch is acknowledged, so the peer will not send
    /// it again, and a restart must still find it (a journal error fails the batch instead).
    fn deferred(&mut self, planned: &Planned, remote: &FileRecord) -> Result<bool, ApplyError> {
        let path = &planned.record().path;
        if !matches!(planned.step, Step::ApplyRemote { .. }) {
            return Ok(false);
        }
        if self.rt.writers.has_writer(path) {
            tracing::info!(folder = %self.folder, %path, "open for writing through the mount; the remote version waits for its release");
        } else if self.rt.store.open_for_writing_in(&mut self.dirs, path) {
            tracing::info!(folder = %self.folder, %path, "open for writing by another program; the remote version waits for it");
        } else {
            return Ok(false);
        }
        self.defer(remote, Wait::Writer)?;
        Ok(true)
    }

    /// Holds `remote` until its path has no writer, or until its local content is here
    /// ([`Wait`]); journaled first (see [`Self::deferred`]).
    fn defer(&mut self, remote: &FileRecord, wait: Wait) -> Result<(), ApplyError> {
        self.journal
            .get()?
            .put_deferred(self.folder, remote, &self.peer)?;
        self.rt.defer(remote.clone(), self.peer, wait);
        Ok(())
    }

    /// `plan`, unless it keeps a local version that is a placeholder here, as a conflict
    /// sibling or as the path's resolved version: then `remote` waits, journaled, and the
    /// content is fetched before it is decided again (`Engine::apply_deferred`); `None`. Such a
    /// version names content this device never had, which its holders may supersede before
    /// it reaches them: a file no peer can ever fetch (D101). A placeholder whose content no
    /// device holds any more (`FolderRt::mark_lost`, D103) is not kept: at the path the remote
    /// state replaces it under a version that dominates both, at an ancestor the sibling is not
    /// made; the plan comes with
    /// the journal's detail naming the versions not kept, if any.
    fn settle_placeholders(
        &mut self,
        mut plan: Plan,
        remote: &FileRecord,
    ) -> Result<Option<(Plan, Option<String>)>, ApplyError> {
        if !self.rt.policy().on_demand {
            return Ok(Some((plan, None)));
        }
        let mut not_kept = Vec::new();
        let detail = |not_kept: Vec<serde_json::Value>| {
            (!not_kept.is_empty()).then(|| serde_json::json!({ "not_kept": not_kept }).to_string())
        };
        // Each pass settles one path (the record's own, or an ancestor's).
        for _ in 0..remote.path.ancestors().len() + 2 {
            let Some(from) = self.kept_placeholder(&plan, remote) else {
                return Ok(Some((plan, detail(not_kept))));
            };
            let Some(version) = self.stored(&from)?.map(|s| s.record.version) else {
                break;
            };
            if !self.rt.is_lost(&from, &version) {
                break;
            }
            tracing::warn!(folder = %self.folder, path = %remote.path, local = %from, "a conflict with a version not local here whose content no device holds: it is not kept");
            self.rt.forget_lost(&from);
            not_kept.push(serde_json::json!({
                "path": from.as_str(),
                "version": version.to_string(),
                "why": "not local here, and no device sharing the folder holds its content",
            }));
            plan = if from == remote.path {
                let view = View {
                    journal: self.journal.get()?,
                    folder: self.folder,
                    memo: &self.memo,
                };
                plan::plan_superseding(&view, remote)?
            } else {
                plan.without_keeping(&from)
            };
        }
        let Some(from) = self.kept_placeholder(&plan, remote) else {
            return Ok(Some((plan, detail(not_kept))));
        };
        tracing::info!(folder = %self.folder, path = %remote.path, local = %from, "a conflict with a file that is not local here: its content is fetched before the remote version is applied");
        self.defer(remote, Wait::Content(from))?;
        Ok(None)
    }

    /// The path of a placeholder whose local content `plan` keeps: as a conflict sibling, or as
    /// the path's new version (a resolution that keeps the local content, a modification that
    /// survives a remote deletion), which the sender does not hold.
    fn kept_placeholder(&mut self, plan: &Plan, remote: &FileRecord) -> Option<RelPath> {
        let (store, dirs) = (&self.rt.store, &mut self.dirs);
        plan.steps.iter().find_map(|s| {
            let kept = match &s.step {
                Step::PreserveLocal { from, .. } => from,
                Step::UpdateLocal { record }
                    if record.path == remote.path
                        && record.kind == FileKind::File
                        && !record.deleted
                        && (remote.deleted || remote.hash != record.hash) =>
                {
                    &record.path
                }
                _ => return None,
            };
            store.placeholder_at(dirs, kept).map(|_| kept.clone())
        })
    }

    /// A step without content: does its disk work and returns its journal change.
    fn step(
        &mut self,
        planned: Planned,
        remote: &FileRecord,
        conflict: Option<String>,
    ) -> Result<(Option<Change>, Flow), ApplyError> {
        if self.deferred(&planned, remote)? {
            return Ok((None, Flow::Next));
        }
        let stored = self.stored(&planned.record().path)?;
        let (expect, _) = seen_of(stored.as_ref());
        let Planned {
            step,
            disk,
            op,
            from_peer,
            ..
        } = planned;
        let change = |record, local, source, detail| Change {
            record,
            op,
            local,
            source,
            detail,
        };
        let store = &self.rt.store;
        match step {
            Step::UpdateLocal { record } => {
                // The local content stays; only its metadata may change on disk, and a failure
                // there is left to the next scan.
                let mut local = stored.as_ref().and_then(|s| s.local);
                if let Disk::SetMeta { mtime, .. } = disk {
                    let mtime = mtime.then_some(record.mtime_ns);
                    match store.set_meta(&record.path, record.mode, mtime, expect) {
                        Ok(l) => local = Some(l),
                        Err(e) => {
                            tracing::warn!(path = %record.path, error = %e, "cannot set metadata; the next scan will reconcile it")
                        }
                    }
                }
                Ok((Some(change(record, local, None, conflict)), Flow::Next))
            }
            Step::ReviveDir { record } => {
                let made = store.make_dir(&record.path, record.mode);
                let detail = Some("directory kept: a live entry below it".into());
                self.made(made, change(record, None, None, detail), remote, false)
            }
            Step::PreserveLocal { from, record } => {
                let expect = match self.stored(&from)?.and_then(|s| s.local) {
                    Some(l) => Expect::Matches(l),
                    None => Expect::Anything,
                };
                let made = store.preserve_as(&from, &record.path, expect);
                let detail = conflict.or(Some(format!("conflict copy of {from}")));
                self.made(made, change(record, None, None, detail), remote, true)
            }
            Step::PreserveRemote { record } => {
                // A losing symlink (or directory) is made as what it is: only a regular
                // file's content is assembled from chunks.
                let made = match record.kind {
                    FileKind::Symlink => {
                        store.make_symlink(&record.path, &record.target, record.mtime_ns, expect)
                    }
                    _ => store.make_dir(&record.path, record.mode),
                };
                self.made(made, change(record, None, None, conflict), remote, true)
            }
            Step::ApplyRemote { record } => {
                let result = apply_remote(store, &record, &disk, expect);
                if result.is_ok() && matches!(disk, Disk::MakeDir { .. }) {
                    // What fills it comes from the engine too: the directory needs no second
                    // look for files written before its watch (`CaptureMsg::NewDir`).
                    self.rt.echoes.expect_dir(record.path.clone());
                }
                let source = from_peer.then_some(self.peer);
                self.applied(result, change(record, None, source, conflict), remote)
            }
        }
    }

    /// The journal change of a remote version just applied on disk (or why it was not).
    fn applied(
        &mut self,
        result: Result<Option<LocalStat>, StoreError>,
        mut change: Change,
        remote: &FileRecord,
    ) -> Result<(Option<Change>, Flow), ApplyError> {
        if let Ok(local) = &result {
            if change.record.kind != FileKind::Dir {
                self.rt.echoes.expect(change.record.path.clone(), *local);
            }
        }
        match result {
            Ok(local) => {
                change.local = local;
                Ok((Some(change), Flow::Next))
            }
            Err(StoreError::NotEmpty(p)) => {
                tracing::info!(path = %p, "directory still holds untracked entries; kept on disk");
                change.detail = Some("directory kept on disk: untracked entries inside".into());
                Ok((Some(change), Flow::Next))
            }
            Err(StoreError::Changed(p)) => {
                tracing::debug!(path = %p, "changed under apply; rescanning and deciding again");
                self.redo.push(remote.clone());
                Ok((None, Flow::Next))
            }
            Err(StoreError::Busy(p)) => {
                tracing::info!(path = %p, "open for writing by another program; the remote version waits for it");
                self.defer(remote, Wait::Writer)?;
                Ok((None, Flow::Next))
            }
            Err(e) => {
                skip_or_fail(self.rt, remote, e)?;
                Ok((None, Flow::Stop))
            }
        }
    }

    /// The journal change of a kept copy or a revived directory just made (or why the plan
    /// stops here).
    fn made(
        &mut self,
        made: Result<LocalStat, StoreError>,
        mut change: Change,
        remote: &FileRecord,
        redo_on_change: bool,
    ) -> Result<(Option<Change>, Flow), ApplyError> {
        match made {
            Ok(local) => {
                change.local = Some(local);
                Ok((Some(change), Flow::Next))
            }
            Err(StoreError::Changed(_)) if redo_on_change => {
                // The local file changed since it was scanned: capture that edit, then decide
                // again.
                self.redo.push(remote.clone());
                Ok((None, Flow::Stop))
            }
            Err(StoreError::Busy(p)) => {
                tracing::info!(path = %p, "open for writing by another program; the remote version waits for it");
                self.defer(remote, Wait::Writer)?;
                Ok((None, Flow::Stop))
            }
            Err(e) => {
                skip_or_fail(self.rt, remote, e)?;
                Ok((None, Flow::Stop))
            }
        }
    }
}

/// The disk work of a remote version (its content already known to be here, or none needed).
fn apply_remote(
    store: &crate::store::Store,
    record: &FileRecord,
    disk: &Disk,
    expect: Expect,
) -> Result<Option<LocalStat>, StoreError> {
    match disk {
        Disk::Nothing => Ok(None),
        Disk::RemoveDir => store.remove_dir(&record.path).map(|_| None),
        Disk::RemoveFile => store.remove_file(&record.path, expect).map(|_| None),
        Disk::MakeDir { replace_file } => {
            if *replace_file {
                store.remove_file(&record.path, expect)?;
            }
            store.make_dir(&record.path, record.mode).map(Some)
        }
        Disk::MakeSymlink => store
            .make_symlink(&record.path, &record.target, record.mtime_ns, expect)
            .map(Some),
        Disk::SetMeta { mtime, .. } => store
            .set_meta(
                &record.path,
                record.mode,
                mtime.then_some(record.mtime_ns),
                expect,
            )
            .map(Some),
        Disk::Content | Disk::CopyLocal { .. } => {
            unreachable!("the plan gives a remote version content or metadata")
        }
    }
}

/// The journal's detail of a resolved conflict (shown by `meshfs journal`).
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
