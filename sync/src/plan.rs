//! The apply planner: what a replica does with one received record, as steps a driver
//! executes.
//!
//! [`reconcile::decide`] says who wins and which records result; the planner adds what
//! every driver needs to carry that out safely and the same way: for each step, what to do
//! on disk ([`Disk`]), which journal operation it is ([`Op`]), whether the sending peer is
//! its source, whether it is journaled *pending* before the disk is touched, and whether its
//! journal change must wait for another step's install. The daemon's `apply` executes a
//! plan against the real store and SQLite; the simulation executes the very same plan
//! against its in-memory replicas. Only the executors differ.
//!
//! **Architecture invariant:** pure. The planner reads the replica through a
//! [`ReplicaView`] (which may fail: then no plan is made) and does nothing itself.

use crate::error::ReadError;
use crate::reconcile::{self, Outcome, ReplicaView, Step};
use meshfs_protocol::{FileKind, FileRecord, RelPath};
use std::fmt;

/// The operation a journal history row records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// A path came into existence.
    Create,
    /// A file's content changed.
    Modify,
    /// A path was deleted (the record is a tombstone).
    Delete,
    /// A path appeared as the destination of a rename.
    Rename,
    /// Only metadata (mode, mtime) changed.
    Metadata,
    /// The result of resolving a conflict.
    Conflict,
    /// Bookkeeping: only the version vector changed (two devices' versions of the same
    /// state met and merged). Nobody changed content, mode or mtime, so `meshfs journal`
    /// hides these rows unless asked for them.
    Merged,
}

impl Op {
    /// Lower-case name, as stored and shown.
    pub fn as_str(&self) -> &'static str {
        match self {
            Op::Create => "create",
            Op::Modify => "modify",
            Op::Delete => "delete",
            Op::Rename => "rename",
            Op::Metadata => "metadata",
            Op::Conflict => "conflict",
            Op::Merged => "merged",
        }
    }

    /// Inverse of [`Op::as_str`].
    pub fn parse(s: &str) -> Option<Op> {
        Some(match s {
            "create" => Op::Create,
            "modify" => Op::Modify,
            "delete" => Op::Delete,
            "rename" => Op::Rename,
            "metadata" => Op::Metadata,
            "conflict" => Op::Conflict,
            "merged" => Op::Merged,
            _ => return None,
        })
    }

    /// The operation that takes a path from `prev` to `new` (a received version).
    pub fn between(prev: Option<&FileRecord>, new: &FileRecord) -> Op {
        match prev {
            _ if new.deleted => Op::Delete,
            None => Op::Create,
            Some(p) if p.deleted => Op::Create,
            Some(p) if p.same_state(new) => Op::Merged,
            Some(p) if p.same_content(new) => Op::Metadata,
            Some(_) => Op::Modify,
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a step does on disk. Every write is conditional on the disk still holding what the
/// journal says (the executor's business); the planner only says which write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Disk {
    /// Nothing: only the journal's record changes (a vector, or metadata the disk already has).
    Nothing,
    /// Set the mode, and the mtime when `mtime`, of what is there. `required`: a failure
    /// fails the step; otherwise it is left to the next scan (the content is already right).
    SetMeta {
        /// Set the mtime too (regular files).
        mtime: bool,
        /// Whether a failure fails the step.
        required: bool,
    },
    /// Make a directory; `replace_file`: a file or symlink stands there and goes first.
    MakeDir {
        /// A file or symlink is removed first.
        replace_file: bool,
    },
    /// Make (or replace) a symlink.
    MakeSymlink,
    /// Assemble the file's content from its chunks (found locally, else fetched), verify it
    /// and install it.
    Content,
    /// Copy the current local content of `from` to the step's path (a local loser kept as a
    /// conflict sibling).
    CopyLocal {
        /// The path whose content is kept.
        from: RelPath,
    },
    /// Remove a directory (kept on disk if untracked entries remain in it).
    RemoveDir,
    /// Remove a file or symlink.
    RemoveFile,
}

/// One step of a [`Plan`].
#[derive(Clone, Debug, PartialEq)]
pub struct Planned {
    /// The reconciler's step (its record is the path's complete new record).
    pub step: Step,
    /// What to do on disk.
    pub disk: Disk,
    /// The journal operation.
    pub op: Op,
    /// Journal it with the sending peer as source: the peer holds exactly this version, so it
    /// is not sent back. Any other version (merged, resolved, kept) is new to the peer too.
    pub from_peer: bool,
    /// Journal it *pending* before the disk is touched: an object made without a temp file
    /// (a kept copy, a symlink, a directory) must never be found after a crash without a
    /// journal row, or the scan would take it for the user's edit.
    pub pending_first: bool,
    /// Commit its journal change only once the step at this index (a remote loser's content)
    /// is installed: a winner's merged vector must not exist without the loser's sibling, or a
    /// crash in between would lose the loser everywhere.
    pub after: Option<usize>,
}

impl Planned {
    /// The step's record.
    pub fn record(&self) -> &FileRecord {
        self.step.record()
    }
}

/// What to do with one received record.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// The reconciler's outcome.
    pub outcome: Outcome,
    /// A conflict that keeps a loser here: `Some(winner_is_local)`. Its steps are journaled
    /// as op `conflict` (the kept sibling as `create`). A conflict whose loser is already kept
    /// (another device's resolution of the same versions arriving) is not one of its own.
    pub conflict: Option<bool>,
    /// The steps, in order.
    pub steps: Vec<Planned>,
}

impl Plan {
    /// The plan without the steps that keep the local content of `from` as a conflict
    /// sibling: a local version whose content no device holds any more cannot be kept (its
    /// sibling would name content nobody can fetch); whatever replaces it at `from` is made as
    /// planned. The other steps' waits follow their steps; a plan left keeping no loser is no
    /// conflict of its own.
    pub fn without_keeping(self, from: &RelPath) -> Plan {
        let dropped =
            |s: &Planned| matches!(&s.step, Step::PreserveLocal { from: f, .. } if f == from);
        let mut index = Vec::with_capacity(self.steps.len());
        let mut kept = 0;
        for s in &self.steps {
            index.push((!dropped(s)).then_some(kept));
            kept += usize::from(!dropped(s));
        }
        let steps: Vec<Planned> = self
            .steps
            .into_iter()
            .filter(|s| !dropped(s))
            .map(|mut s| {
                s.after = s.after.and_then(|i| index.get(i).copied().flatten());
                s
            })
            .collect();
        let keeps_a_loser = steps.iter().any(|s| {
            matches!(
                s.step,
                Step::PreserveLocal { .. } | Step::PreserveRemote { .. }
            )
        });
        Plan {
            outcome: self.outcome,
            conflict: self.conflict.filter(|_| keeps_a_loser),
            steps,
        }
    }
}

/// Plans what this replica does with `remote`, a peer's record.
pub fn plan(view: &dyn ReplicaView, remote: &FileRecord) -> Result<Plan, ReadError> {
    plan_decision(view, remote, reconcile::decide(view, remote)?)
}

/// Plans taking `remote` as it is ([`reconcile::take`]): a receive-only folder's answer to a
/// peer's version concurrent with a local change ([`crate::role::Intake::Take`]).
pub fn plan_taking(view: &dyn ReplicaView, remote: &FileRecord) -> Result<Plan, ReadError> {
    plan_decision(view, remote, reconcile::take(view, remote)?)
}

/// Plans replacing a concurrent local record whose content is gone by `remote`'s state
/// ([`reconcile::supersede`], D103).
pub fn plan_superseding(view: &dyn ReplicaView, remote: &FileRecord) -> Result<Plan, ReadError> {
    plan_decision(view, remote, reconcile::supersede(view, remote)?)
}

fn plan_decision(
    view: &dyn ReplicaView,
    remote: &FileRecord,
    decision: reconcile::Decision,
) -> Result<Plan, ReadError> {
    let keeps_a_loser = decision
        .steps
        .iter()
        .any(|s| matches!(s, Step::PreserveLocal { .. } | Step::PreserveRemote { .. }));
    let conflict = match decision.outcome {
        Outcome::Conflict { winner_is_local } if keeps_a_loser => Some(winner_is_local),
        _ => None,
    };
    let mut steps: Vec<Planned> = Vec::with_capacity(decision.steps.len());
    let mut waits_for = None;
    for step in decision.steps {
        let prev = view.get(&step.record().path)?;
        let live_prev = prev.as_ref().filter(|p| !p.deleted);
        let (disk, op) = match &step {
            Step::UpdateLocal { record } => {
                let disk = match live_prev {
                    Some(p)
                        if !record.deleted
                            && record.kind != FileKind::Symlink
                            && (p.mode != record.mode
                                || (record.kind == FileKind::File
                                    && p.mtime_ns != record.mtime_ns)) =>
                    {
                        Disk::SetMeta {
                            mtime: record.kind == FileKind::File,
                            required: false,
                        }
                    }
                    _ => Disk::Nothing,
                };
                let op = match &prev {
                    _ if conflict.is_some() => Op::Conflict,
                    Some(p) if p.same_state(record) => Op::Merged,
                    _ => Op::Metadata,
                };
                (disk, op)
            }
            // A file or symlink standing where the directory must be was kept as a sibling
            // first (a link to its content), or its content is gone (`without_keeping`).
            Step::ReviveDir { .. } => (
                Disk::MakeDir {
                    replace_file: live_prev.is_some_and(|p| p.kind != FileKind::Dir),
                },
                Op::Create,
            ),
            Step::PreserveLocal { from, .. } => {
                (Disk::CopyLocal { from: from.clone() }, Op::Create)
            }
            Step::PreserveRemote { record } => (made(record, live_prev), Op::Create),
            Step::ApplyRemote { record } => {
                let op = match conflict {
                    Some(_) => Op::Conflict,
                    None => Op::between(prev.as_ref(), record),
                };
                (made(record, live_prev), op)
            }
        };
        let from_peer =
            matches!(&step, Step::ApplyRemote { record } if record.version == remote.version);
        let pending_first = matches!(&step, Step::PreserveLocal { .. })
            || matches!(&step, Step::PreserveRemote { record } if record.kind != FileKind::File);
        let content = disk == Disk::Content;
        let keeps_remote = matches!(&step, Step::PreserveRemote { .. }) && content;
        steps.push(Planned {
            after: if content { None } else { waits_for },
            step,
            disk,
            op,
            from_peer,
            pending_first,
        });
        if keeps_remote {
            waits_for = Some(steps.len() - 1);
        }
    }
    Ok(Plan {
        outcome: decision.outcome,
        conflict,
        steps,
    })
}

/// The disk work that makes `record` (a remote version or a remote loser's sibling) exist
/// where `live_prev` is.
fn made(record: &FileRecord, live_prev: Option<&FileRecord>) -> Disk {
    if record.deleted {
        return match live_prev.map(|p| p.kind) {
            Some(FileKind::Dir) => Disk::RemoveDir,
            Some(_) => Disk::RemoveFile,
            None => Disk::Nothing,
        };
    }
    match record.kind {
        FileKind::Dir => Disk::MakeDir {
            replace_file: live_prev.is_some_and(|p| p.kind != FileKind::Dir),
        },
        FileKind::Symlink => Disk::MakeSymlink,
        FileKind::File
            if live_prev.is_some_and(|p| {
                p.kind == FileKind::File && p.hash == record.hash && p.size == record.size
            }) =>
        {
            Disk::SetMeta {
                mtime: true,
                required: true,
            }
        }
        FileKind::File => Disk::Content,
    }
}

/// A version's content cannot be had right now. `at_sender`: the peer that sent the record
/// still holds it. If it does, the transfer is tried again later; if it does not, the version
/// was superseded there and its successor follows in the same index stream: the record is
/// skipped (waiting for it would livelock, the successor queued behind it).
pub fn unavailable(at_sender: bool) -> Unavailable {
    if at_sender {
        Unavailable::Retry
    } else {
        Unavailable::Superseded
    }
}

/// What to do about content that cannot be had ([`unavailable`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unavailable {
    /// Try the record again later.
    Retry,
    /// Skip the record: a newer version of the path follows.
    Superseded,
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshfs_protocol::{Hash, ShortId, VersionVector};

    use crate::testing::MapView as View;

    struct Broken;

    impl ReplicaView for Broken {
        fn get(&self, _: &RelPath) -> Result<Option<FileRecord>, ReadError> {
            Err(ReadError("disk I/O error".into()))
        }
        fn has_live_below(&self, _: &RelPath) -> Result<bool, ReadError> {
            Err(ReadError("disk I/O error".into()))
        }
    }

    fn file(path: &str, dev: u64, n: u64, content: &[u8]) -> FileRecord {
        FileRecord {
            path: RelPath::new(path).unwrap(),
            kind: FileKind::File,
            deleted: false,
            mode: 0o644,
            mtime_ns: n as i64,
            size: content.len() as u64,
            hash: Hash::of(content),
            chunks: vec![],
            target: String::new(),
            version: VersionVector::new().incremented(ShortId(dev), n),
            modified_by: ShortId(dev),
            sequence: 0,
        }
    }

    fn view(records: &[&FileRecord]) -> View {
        View::with(records)
    }

    #[test]
    fn a_new_remote_file_is_fetched_and_journaled_from_the_peer() {
        let r = file("a", 1, 1, b"x");
        let p = plan(&View::default(), &r).unwrap();
        assert_eq!(p.steps.len(), 1);
        let s = &p.steps[0];
        assert_eq!(
            (s.disk.clone(), s.op, s.from_peer),
            (Disk::Content, Op::Create, true)
        );
        assert!(!s.pending_first && s.after.is_none() && p.conflict.is_none());
    }

    #[test]
    fn a_metadata_only_remote_change_sets_metadata_instead_of_fetching() {
        let l = file("a", 1, 1, b"x");
        let mut r = l.clone();
        r.mode = 0o600;
        r.version = l.version.incremented(ShortId(2), 1);
        let p = plan(&view(&[&l]), &r).unwrap();
        let s = &p.steps[0];
        assert_eq!(
            s.disk,
            Disk::SetMeta {
                mtime: true,
                required: true
            }
        );
        assert_eq!(s.op, Op::Metadata);
    }

    #[test]
    fn a_conflict_keeps_the_loser_first_and_the_winner_waits_for_a_remote_losers_install() {
        // The local version wins (newer mtime), the remote loser's content is kept.
        let base = VersionVector::new().incremented(ShortId(9), 1);
        let mut l = file("a", 1, 5, b"local");
        l.version = base.incremented(ShortId(1), 1);
        let mut r = file("a", 2, 1, b"remote");
        r.version = base.incremented(ShortId(2), 1);
        let p = plan(&view(&[&l]), &r).unwrap();
        assert_eq!(p.conflict, Some(true));
        let disks: Vec<_> = p.steps.iter().map(|s| s.disk.clone()).collect();
        assert_eq!(disks, vec![Disk::Content, Disk::Nothing]);
        assert_eq!(p.steps[0].op, Op::Create);
        assert_eq!(p.steps[1].op, Op::Conflict);
        assert_eq!(p.steps[1].after, Some(0));
        assert!(!p.steps[1].from_peer);
        // The remote wins the other way round: the local loser is copied, pending first.
        let p = plan(&view(&[&r]), &l).unwrap();
        assert_eq!(p.conflict, Some(false));
        assert!(matches!(p.steps[0].disk, Disk::CopyLocal { .. }));
        assert!(p.steps[0].pending_first);
        assert_eq!(
            (p.steps[1].disk.clone(), p.steps[1].op),
            (Disk::Content, Op::Conflict)
        );
    }

    #[test]
    fn a_remote_losing_symlink_is_made_as_a_symlink_and_journaled_pending_first() {
        let base = VersionVector::new().incremented(ShortId(9), 1);
        let mut l = file("s", 1, 5, b"");
        l.kind = FileKind::Symlink;
        l.target = "one".into();
        l.version = base.incremented(ShortId(1), 1);
        let mut r = l.clone();
        r.target = "two".into();
        r.mtime_ns = 1;
        r.modified_by = ShortId(2);
        r.version = base.incremented(ShortId(2), 1);
        let p = plan(&view(&[&l]), &r).unwrap();
        assert_eq!(p.steps[0].disk, Disk::MakeSymlink);
        assert!(p.steps[0].pending_first);
        assert_eq!(p.steps[1].after, None);
    }

    #[test]
    fn a_remote_deletion_removes_what_the_journal_says_is_there() {
        let l = file("a", 1, 1, b"x");
        let mut r = l.clone();
        r.deleted = true;
        r.version = l.version.incremented(ShortId(2), 1);
        let p = plan(&view(&[&l]), &r).unwrap();
        assert_eq!(
            (p.steps[0].disk.clone(), p.steps[0].op),
            (Disk::RemoveFile, Op::Delete)
        );
        let p = plan(&View::default(), &r).unwrap();
        assert_eq!(p.steps[0].disk, Disk::Nothing);
    }

    #[test]
    fn a_journal_that_cannot_be_read_gives_no_plan() {
        let r = file("a", 1, 1, b"x");
        assert_eq!(plan(&Broken, &r), Err(ReadError("disk I/O error".into())));
    }

    #[test]
    fn a_local_loser_whose_content_is_gone_is_not_kept_and_the_rest_stands() {
        let base = VersionVector::new().incremented(ShortId(9), 1);
        let mut l = file("a", 1, 1, b"local");
        l.version = base.incremented(ShortId(1), 1);
        let mut r = file("a", 2, 5, b"remote");
        r.version = base.incremented(ShortId(2), 1);
        let p = plan(&view(&[&l]), &r).unwrap();
        assert_eq!(p.conflict, Some(false));
        let resolution = p.steps[1].record().clone();
        let p = p.without_keeping(&RelPath::new("a").unwrap());
        assert_eq!(p.conflict, None, "no loser kept: no conflict of its own");
        assert_eq!(p.steps.len(), 1);
        assert_eq!(p.steps[0].disk, Disk::Content);
        assert_eq!(p.steps[0].record(), &resolution);
        // A file where a directory must be, its remote loser kept too: the waits follow.
        let mut d = file("a/x", 2, 5, b"child");
        d.version = VersionVector::new().incremented(ShortId(2), 2);
        let p = plan(&view(&[&l]), &d).unwrap();
        assert!(matches!(p.steps[0].step, Step::PreserveLocal { .. }));
        let n = p.steps.len();
        let p = p.without_keeping(&RelPath::new("a").unwrap());
        assert_eq!(p.steps.len(), n - 1);
        assert!(p
            .steps
            .iter()
            .all(|s| !matches!(s.step, Step::PreserveLocal { .. })));
        assert!(matches!(
            p.steps[0].disk,
            Disk::MakeDir { replace_file: true }
        ));
        // Another path's loser is not touched.
        let p = plan(&view(&[&l]), &r).unwrap();
        assert_eq!(p.clone().without_keeping(&RelPath::new("b").unwrap()), p);
    }

    #[test]
    fn a_dropped_step_moves_the_waits_of_the_steps_after_it() {
        // A remote loser's content (index 1) and the winner waiting for it (index 2), after
        // a local loser at an ancestor (index 0).
        let base = VersionVector::new().incremented(ShortId(9), 1);
        let step = |step: Step, disk: Disk, after| Planned {
            step,
            disk,
            op: Op::Create,
            from_peer: false,
            pending_first: false,
            after,
        };
        let mut f = file("a", 1, 1, b"x");
        f.version = base.clone();
        let p = Plan {
            outcome: Outcome::Conflict {
                winner_is_local: true,
            },
            conflict: Some(true),
            steps: vec![
                step(
                    Step::PreserveLocal {
                        from: f.path.clone(),
                        record: f.clone(),
                    },
                    Disk::CopyLocal {
                        from: f.path.clone(),
                    },
                    None,
                ),
                step(
                    Step::PreserveRemote { record: f.clone() },
                    Disk::Content,
                    None,
                ),
                step(
                    Step::UpdateLocal { record: f.clone() },
                    Disk::Nothing,
                    Some(1),
                ),
            ],
        };
        let p = p.without_keeping(&f.path);
        assert_eq!(p.steps.len(), 2);
        assert_eq!(p.steps[1].after, Some(0));
        assert_eq!(p.conflict, Some(true), "a remote loser is still kept");
    }

    #[test]
    fn content_the_sender_no_longer_has_is_skipped_not_retried() {
        assert_eq!(unavailable(true), Unavailable::Retry);
        assert_eq!(unavailable(false), Unavailable::Superseded);
    }
}
