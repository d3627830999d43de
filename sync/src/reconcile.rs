//! The reconciler: the only place that decides who wins when a peer's record meets ours.
//!
//! **Architecture invariant:** pure. No IO, no clock, no randomness: [`decide`] is a function
//! of (this replica's records as seen through [`ReplicaView`], the local device and a time
//! floor, the incoming record) → a [`Decision`], a list of [`Step`]s that the driver (the
//! engine with real files, or the simulation with a model) executes in order.
//!
//! The rules (docs/design.md, "Reconciliation"), per path, local record L against remote record R:
//!
//! | compare(L, R) | content | decision |
//! |---|---|---|
//! | L absent | — | apply R (a tombstone is just recorded) |
//! | Equal | — | nothing |
//! | After | — | nothing: the peer will get ours |
//! | Before | — | apply R |
//! | Concurrent | identical state | merge the vectors |
//! | Concurrent | same content | keep the content, metadata of the precedence winner, as a new version (merged vector + the resolver id) |
//! | Concurrent | differ | the precedence winner keeps the name, as a new version (merged vector + the resolver id); a live loser is preserved as a conflict sibling |
//!
//! *Precedence* is one total order over every kind of record — a live directory beats a live
//! file or symlink, which beats a tombstone (so delete-vs-modify keeps the modification and
//! file-vs-directory keeps the directory); then the newer mtime, the larger `modified_by`, the
//! larger hash, and finally the remaining state. Because it is a total order, resolving a
//! set of concurrent versions pairwise in any order on any device ends in the same state.
//!
//! A resolution that changes either side's state is a new version (the merged vector
//! incremented by a [`resolver_id`] of the merge and its result, the same on every device),
//! never a bare merged vector: see `concurrent` for the divergence the bare merge caused.
//! Only identical states merge without a new version.
//!
//! A peer's file whose chunk list no meshfs chunker makes (a chunk shorter than
//! [`meshfs_protocol::MIN_CHUNK_LEN`] before its last) is [`Outcome::Refused`] before anything
//! else: its chunks' cost to the receiver stays proportional to the size it declares.
//!
//! Whatever a decision would keep must stay sendable: a step record whose vector is longer
//! than [`MAX_VV_ENTRIES_KEPT`] (two long histories merged) or whose encoding outgrows a frame
//! makes the whole decision [`Outcome::Refused`], with no steps. The local version stays as it
//! is and the peer's is not applied; pruning the vector instead would forget edits it has seen
//! and let an older version overwrite a newer one.
//!
//! Two rules look around the path, through the view:
//! - a result that is not a live directory while live entries remain below the path keeps a
//!   directory there instead ([`Outcome::DirKeptForLiveChildren`]), with a new local version
//!   that dominates what it replaces, so the kept directory propagates;
//! - a live result needs live directories above it: a tombstoned or missing ancestor is
//!   revived ([`Step::ReviveDir`]), and a file or symlink in an ancestor's place is moved to
//!   its conflict sibling first.

#[cfg(doc)]
use meshfs_protocol::MAX_VV_ENTRIES_KEPT;
use meshfs_protocol::{
    FileKind, FileRecord, Hash, RecordError, RelPath, ShortId, VersionVector, VvOrdering,
};
use meshfs_protocol::{MAX_NAME_LEN, MAX_PATH_LEN};

pub use crate::error::ReadError;

/// Read access to this replica's current records (journal), for decisions that look around a path.
pub trait ReplicaView {
    /// The current record of `path` (tombstones included).
    fn get(&self, path: &RelPath) -> Result<Option<FileRecord>, ReadError>;
    /// Whether any non-deleted record lies strictly below `dir`.
    fn has_live_below(&self, dir: &RelPath) -> Result<bool, ReadError>;
}

/// One thing the driver must do to carry out a [`Decision`].
///
/// Every record in a step is the path's complete new current record; its `sequence` is 0 (the
/// journal assigns its own). A record stored with exactly the remote record's vector may be
/// journaled with the peer as its source; any other (merged or new local) vector is new to the
/// peer as well and must be sent back to it.
#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    /// Copy the CURRENT local content of `from` to a conflict sibling, as a new local file
    /// `record` (its version already assigned). No network.
    PreserveLocal {
        /// The path whose current local content is copied.
        from: RelPath,
        /// The sibling's record.
        record: FileRecord,
    },
    /// Materialize the REMOTE losing version as a conflict sibling `record` (its content = the
    /// remote record's chunks; version already assigned).
    PreserveRemote {
        /// The sibling's record.
        record: FileRecord,
    },
    /// Make the path hold the remote version `record` (write content / mkdir / symlink /
    /// delete / chmod), with `record.version` the final vector.
    ApplyRemote {
        /// The path's final record.
        record: FileRecord,
    },
    /// Keep the local content; store `record` (local content, final merged vector, possibly
    /// metadata taken from the winner) — may need a chmod/utimens on disk if mode/mtime differ
    /// from local.
    UpdateLocal {
        /// The path's final record.
        record: FileRecord,
    },
    /// A tombstoned or missing ancestor directory must exist again because a live entry is
    /// being kept/applied below it (or a directory is kept for its live children): `record`
    /// is the live directory, its vector dominating the record it replaces.
    ReviveDir {
        /// The directory's record.
        record: FileRecord,
    },
}

/// What kind of decision was made (for logs, the journal and tests).
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// Same version: nothing to do.
    Nothing,
    /// Ours is newer: nothing to do; the peer will get ours.
    LocalNewer,
    /// Theirs is newer (or new to us): apply it.
    ApplyRemote,
    /// Concurrent versions with the same content: no conflict; the vectors merged (and, if the
    /// metadata differed, a new version carrying the precedence winner's metadata).
    MergedNoConflict,
    /// Concurrent versions with different content: the loser became a conflict sibling.
    Conflict {
        /// Whether the local version kept the name.
        winner_is_local: bool,
    },
    /// A delete concurrent with a modification: the modification won, no conflict file.
    DeleteLostToModify {
        /// Whether the live version was the local one.
        kept_local: bool,
    },
    /// A directory was kept (not deleted or replaced) because live entries remain below it.
    DirKeptForLiveChildren,
    /// Nothing is done: a record the decision would keep could not be sent on
    /// ([`FileRecord::check_sendable`]). The driver shows the peer's record as not applied.
    Refused(RecordError),
}

/// The decision for one incoming record.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    /// What was decided.
    pub outcome: Outcome,
    /// Steps in the order the driver must execute them.
    pub steps: Vec<Step>,
}

/// Who is deciding, and when.
#[derive(Clone, Debug)]
pub struct Context {
    /// This device.
    pub local_device: ShortId,
    /// Current time in seconds since the epoch: the floor for [`VersionVector::increment`].
    pub now_secs: u64,
}

/// The vector of a new version made on this device: `prev`'s vector (or empty) incremented by
/// `ctx.local_device` with floor `ctx.now_secs`. The ONE rule for a version made here.
pub fn new_local_version(prev: Option<&FileRecord>, ctx: &Context) -> VersionVector {
    prev.map(|p| p.version.clone())
        .unwrap_or_default()
        .incremented(ctx.local_device, ctx.now_secs)
}

/// Decides what to do with `remote`, a peer's record, given this replica's records. Fails
/// only when the view cannot be read: no decision is made on a guess. A decision that would
/// keep a record no peer could accept is [`Outcome::Refused`] instead.
pub fn decide(view: &dyn ReplicaView, remote: &FileRecord) -> Result<Decision, ReadError> {
    checked(remote, || decide_unchecked(view, remote))
}

/// The decision `decide` makes for `remote`, or [`Outcome::Refused`] when `remote`'s chunk
/// list is malformed or the decision would keep a record no peer could accept.
fn checked(
    remote: &FileRecord,
    decide: impl FnOnce() -> Result<Decision, ReadError>,
) -> Result<Decision, ReadError> {
    if let Err(e) = remote.check_chunking() {
        return Ok(none(Outcome::Refused(e)));
    }
    let decision = decide()?;
    let unsendable = decision
        .steps
        .iter()
        .find_map(|s| s.record().check_sendable().err());
    Ok(match unsendable {
        Some(e) => none(Outcome::Refused(e)),
        None => decision,
    })
}

/// Decides to take `remote` as it is, whatever the local record: what a receive-only folder
/// does with a peer's version concurrent with a local change ([`crate::role`]): the shared
/// state wins without a resolution (no new version only this device would have), the local
/// content becomes a past version. The rules around the path (live entries below it, a
/// missing parent) hold as for any applied version; a decision that would keep an unsendable
/// record is [`Outcome::Refused`], as in [`decide`].
pub fn take(view: &dyn ReplicaView, remote: &FileRecord) -> Result<Decision, ReadError> {
    checked(remote, || {
        let local = view.get(&remote.path)?;
        Plan::new(Outcome::ApplyRemote, remote.clone(), false).finish(view, local.as_ref())
    })
}

/// Decides that `remote`'s state replaces a concurrent local record without keeping it: the
/// local content exists nowhere any more (an on-demand device's placeholder whose every holder
/// has overwritten it, D103), so a sibling of it would name content nobody can fetch. The result
/// is the remote state under a version that dominates both records, made as any resolution's
/// ([`resolver_id`]): the versions the local record superseded stay superseded, and devices that
/// settle the same pair make the same version. A record not concurrent with the local one is
/// decided as [`decide`] does.
pub fn supersede(view: &dyn ReplicaView, remote: &FileRecord) -> Result<Decision, ReadError> {
    let local = match view.get(&remote.path)? {
        Some(l) if l.version.compare(&remote.version) == VvOrdering::Concurrent => l,
        _ => return decide(view, remote),
    };
    checked(remote, || {
        let mut result = remote.clone();
        result.version = resolved(&local.version.merge(&remote.version), &result);
        Plan::new(Outcome::ApplyRemote, result, false).finish(view, Some(&local))
    })
}

fn decide_unchecked(view: &dyn ReplicaView, remote: &FileRecord) -> Result<Decision, ReadError> {
    let Some(local) = view.get(&remote.path)? else {
        let plan = Plan::new(Outcome::ApplyRemote, remote.clone(), false);
        return plan.finish(view, None);
    };
    match local.version.compare(&remote.version) {
        // Equal vectors name the same version; content cannot differ between honest peers.
        VvOrdering::Equal => Ok(none(Outcome::Nothing)),
        VvOrdering::After => Ok(none(Outcome::LocalNewer)),
        VvOrdering::Before => {
            Plan::new(Outcome::ApplyRemote, remote.clone(), false).finish(view, Some(&local))
        }
        VvOrdering::Concurrent => concurrent(view, &local, remote),
    }
}

fn none(outcome: Outcome) -> Decision {
    Decision {
        outcome,
        steps: Vec::new(),
    }
}

/// Concurrent versions: the precedence winner keeps the name.
///
/// The result's vector is the merge of both, and — unless both records are already in the
/// very same state — incremented by a *resolver id* ([`resolver_id`]): a resolution is a new
/// version. A bare merged vector could otherwise name two different states: it can be
/// reached from different pairs of inputs (say `{a:3,b:2} ∨ {a:4,b:1}` on one device and
/// `{a:4,b:1} ∨ {a:2,b:2}` on another, where `{a:4,b:1}` superseded `{a:3,…}` on the
/// second device only), and the precedence winner of each pair differs; two replicas would
/// then hold different states under equal vectors and never reconcile again (found by the
/// simulation, seed 2).
///
/// The resolver id is a function of the merged vector and the resulting state, not of the
/// device that resolves: every device that resolves the same versions makes the *same*
/// version, so a resolution is never itself a new concurrent change that others resolve
/// again (with an increment per device, n devices made O(n²) bookkeeping versions of one
/// conflict). Different inputs give different ids, which keeps the seed-2 rule: equal
/// vectors still name one state.
fn concurrent(
    view: &dyn ReplicaView,
    local: &FileRecord,
    remote: &FileRecord,
) -> Result<Decision, ReadError> {
    let merged = local.version.merge(&remote.version);
    let local_wins = precedence(local) > precedence(remote);
    let (winner, loser) = if local_wins {
        (local, remote)
    } else {
        (remote, local)
    };
    let mut result = winner.clone();
    result.version = if identical_state(local, remote) {
        merged
    } else {
        resolved(&merged, &result)
    };
    if local.same_content(remote) {
        // Same content: both sides end with the winner's metadata.
        return Plan::new(Outcome::MergedNoConflict, result, true).finish(view, Some(local));
    }
    let outcome = if loser.deleted {
        Outcome::DeleteLostToModify {
            kept_local: local_wins,
        }
    } else {
        Outcome::Conflict {
            winner_is_local: local_wins,
        }
    };
    let mut plan = Plan::new(outcome, result, local_wins);
    if !loser.deleted {
        plan.preserve(view, loser, !local_wins)?;
    }
    plan.finish(view, Some(local))
}

/// Every replicated field equal (all but the vector and the sequence), `modified_by` included.
fn identical_state(a: &FileRecord, b: &FileRecord) -> bool {
    a.kind == b.kind
        && a.deleted == b.deleted
        && a.mode == b.mode
        && a.mtime_ns == b.mtime_ns
        && a.size == b.size
        && a.hash == b.hash
        && a.chunks == b.chunks
        && a.target == b.target
        && a.modified_by == b.modified_by
}

/// The id a resolution increments: derived from the merged vector and the resulting state
/// (everything [`identical_state`] compares), so the same inputs give the same version on
/// every device. It is 64 bits of blake3, like a device's [`ShortId`]; no real device uses
/// it, so no device's own edits can collide with a resolution's counter.
pub fn resolver_id(merged: &VersionVector, result: &FileRecord) -> ShortId {
    let mut buf = Vec::with_capacity(128 + result.target.len() + 16 * merged.entries().len());
    buf.extend_from_slice(b"meshfs-resolution/1");
    for (dev, counter) in merged.entries() {
        buf.extend_from_slice(&dev.0.to_be_bytes());
        buf.extend_from_slice(&counter.to_be_bytes());
    }
    buf.extend_from_slice(result.path.as_str().as_bytes());
    buf.push(0);
    buf.push(result.kind as u8);
    buf.push(u8::from(result.deleted));
    buf.extend_from_slice(&result.mode.to_be_bytes());
    buf.extend_from_slice(&result.mtime_ns.to_be_bytes());
    buf.extend_from_slice(&result.size.to_be_bytes());
    buf.extend_from_slice(&result.hash.0);
    buf.extend_from_slice(&result.modified_by.0.to_be_bytes());
    buf.extend_from_slice(result.target.as_bytes());
    let h = Hash::of(&buf);
    let mut first = [0u8; 8];
    first.copy_from_slice(&h.0[..8]);
    ShortId(u64::from_be_bytes(first))
}

/// A decision being assembled: preserves, then the path's final record, then the checks that
/// look around the path.
struct Plan {
    outcome: Outcome,
    /// The path's final record.
    result: FileRecord,
    /// The final content is the local content (UpdateLocal) rather than the remote (ApplyRemote).
    result_is_local: bool,
    preserves: Vec<Step>,
}

impl Plan {
    fn new(outcome: Outcome, mut result: FileRecord, result_is_local: bool) -> Plan {
        result.sequence = 0;
        Plan {
            outcome,
            result,
            result_is_local,
            preserves: Vec::new(),
        }
    }

    /// Keeps `loser` (live) as a conflict sibling, unless that content is already there.
    fn preserve(
        &mut self,
        view: &dyn ReplicaView,
        loser: &FileRecord,
        local: bool,
    ) -> Result<(), ReadError> {
        debug_assert!(!loser.deleted);
        if let Some(step) = preserve_step(view, &loser.path, loser, local)? {
            self.preserves.push(step);
        }
        Ok(())
    }

    fn finish(
        mut self,
        view: &dyn ReplicaView,
        local: Option<&FileRecord>,
    ) -> Result<Decision, ReadError> {
        let path = self.result.path.clone();
        let is_live_dir = !self.result.deleted && self.result.kind == FileKind::Dir;
        let mut last = None;
        if !is_live_dir && view.has_live_below(&path)? {
            // Deleting or replacing this directory would lose the live entries below it: keep a
            // directory, as a new local version that dominates what it replaces.
            if !self.result.deleted {
                let content = self.result.clone();
                self.preserve(view, &content, self.result_is_local)?;
            }
            let local_dir = local.filter(|l| !l.deleted && l.kind == FileKind::Dir);
            let mut base = self.result.version.clone();
            if let Some(l) = local {
                base = base.merge(&l.version);
            }
            let record = match local_dir {
                Some(l) => {
                    let mut r = l.clone();
                    r.version = resolved(&base, &r);
                    r.sequence = 0;
                    Step::UpdateLocal { record: r }
                }
                None => Step::ReviveDir {
                    record: dir_record(&path, local, &base, self.result.modified_by),
                },
            };
            self.outcome = Outcome::DirKeptForLiveChildren;
            self.result = record.record().clone();
            last = Some(record);
        }
        let mut steps = Vec::new();
        if !self.result.deleted {
            ancestors(view, self.result.modified_by, &path, &mut steps)?;
        }
        steps.append(&mut self.preserves);
        steps.push(match last {
            Some(step) => step,
            None if self.result_is_local => Step::UpdateLocal {
                record: self.result,
            },
            None => Step::ApplyRemote {
                record: self.result,
            },
        });
        Ok(Decision {
            outcome: self.outcome,
            steps,
        })
    }
}

impl Step {
    /// The path's complete new record this step makes.
    pub fn record(&self) -> &FileRecord {
        match self {
            Step::PreserveLocal { record, .. }
            | Step::PreserveRemote { record }
            | Step::ApplyRemote { record }
            | Step::UpdateLocal { record }
            | Step::ReviveDir { record } => record,
        }
    }
}

/// Steps that make every ancestor of `path` a live directory, outermost first; `by` is the
/// author of the entry that needs them.
fn ancestors(
    view: &dyn ReplicaView,
    by: ShortId,
    path: &RelPath,
    steps: &mut Vec<Step>,
) -> Result<(), ReadError> {
    let mut ancestors = path.ancestors();
    ancestors.reverse();
    for anc in ancestors {
        let prev = view.get(&anc)?;
        match &prev {
            Some(p) if !p.deleted && p.kind == FileKind::Dir => continue,
            Some(p) if !p.deleted => {
                // A file or symlink stands where a directory must be: move it aside first.
                if let Some(step) = preserve_step(view, &anc, p, true)? {
                    steps.push(step);
                }
            }
            _ => {}
        }
        let base = prev.as_ref().map(|p| p.version.clone()).unwrap_or_default();
        steps.push(Step::ReviveDir {
            record: dir_record(&anc, prev.as_ref(), &base, by),
        });
    }
    Ok(())
}

/// A live directory record at `path` replacing `prev`, as a version that dominates `base`.
///
/// A revived directory keeps a previous directory's mode and mtime; otherwise it gets 0o755 and
/// mtime 0, so that a real directory version concurrent with it wins the metadata on merge.
/// Its author is the previous record's, or `by` (whoever made the entry that needs it): like a
/// resolution, two devices that revive the same directory from the same record make the same
/// version.
fn dir_record(
    path: &RelPath,
    prev: Option<&FileRecord>,
    base: &VersionVector,
    by: ShortId,
) -> FileRecord {
    let prev_dir = prev.filter(|p| p.kind == FileKind::Dir);
    let mut record = FileRecord {
        path: path.clone(),
        kind: FileKind::Dir,
        deleted: false,
        mode: prev_dir
            .map(|p| p.mode)
            .filter(|m| *m != 0)
            .unwrap_or(0o755),
        mtime_ns: prev_dir.map(|p| p.mtime_ns).unwrap_or(0),
        size: 0,
        hash: Hash::ZERO,
        chunks: Vec::new(),
        target: String::new(),
        version: VersionVector::new(),
        modified_by: prev.map_or(by, |p| p.modified_by),
        sequence: 0,
    };
    record.version = resolved(base, &record);
    record
}

/// The version of `result` made by a reconcile on top of `base`: `base` incremented by the
/// [`resolver_id`] of the two, the same on every device.
fn resolved(base: &VersionVector, result: &FileRecord) -> VersionVector {
    base.incremented(resolver_id(base, result), 1)
}

/// The step that keeps `content` (live, found at `path`) as its conflict sibling, or `None`
/// when a live record with the same content already holds the sibling's name.
fn preserve_step(
    view: &dyn ReplicaView,
    path: &RelPath,
    content: &FileRecord,
    local: bool,
) -> Result<Option<Step>, ReadError> {
    let Some(sibling) = free_sibling(view, path, content)? else {
        return Ok(None);
    };
    let prev = view.get(&sibling)?;
    let mut record = FileRecord {
        path: sibling,
        kind: content.kind,
        deleted: false,
        mode: content.mode,
        mtime_ns: content.mtime_ns,
        size: content.size,
        hash: content.hash,
        chunks: content.chunks.clone(),
        target: content.target.clone(),
        version: VersionVector::new(),
        // The content's author: every device that keeps this loser makes the same record.
        modified_by: content.modified_by,
        sequence: 0,
    };
    // Like a resolution, a sibling's version depends on what it keeps, not on who keeps it:
    // two devices that preserve the same losing version make the same object, which never
    // conflicts with itself. It dominates whatever this replica had at the name.
    let base = prev.map(|p| p.version).unwrap_or_default();
    record.version = resolved(&base, &record);
    Ok(Some(if local {
        Step::PreserveLocal {
            from: path.clone(),
            record,
        }
    } else {
        Step::PreserveRemote { record }
    }))
}

/// The first free conflict name for `loser`: [`conflict_name`], then with `-HASH8`, then with
/// a counter. `None` if a candidate already holds the same content live.
fn free_sibling(
    view: &dyn ReplicaView,
    path: &RelPath,
    loser: &FileRecord,
) -> Result<Option<RelPath>, ReadError> {
    let mut n = 0u32;
    loop {
        let candidate = match n {
            0 => conflict_name(path, loser),
            1 => sibling_name(path, loser, Some(&loser.hash.short())),
            _ => sibling_name(path, loser, Some(&format!("{}-{n}", loser.hash.short()))),
        };
        match view.get(&candidate)? {
            Some(r) if !r.deleted && r.same_content(loser) => return Ok(None),
            Some(r) if !r.deleted => n += 1,
            _ => return Ok(Some(candidate)),
        }
    }
}

/// The conflict sibling name of `loser` at `path`:
/// `NAME.sync-conflict-YYYYMMDD-HHMMSS-SHORTID.EXT`, from the losing version's own data (UTC
/// of its mtime, `modified_by.display7()`), so every device that resolves the same conflict
/// picks the same name. The extension is what follows the last `.` of the file name, unless
/// the name starts with `.` and has no other dot. A name longer than [`MAX_NAME_LEN`] has its
/// stem shortened.
pub fn conflict_name(path: &RelPath, loser: &FileRecord) -> RelPath {
    sibling_name(path, loser, None)
}

/// The conflict sibling name for a copy of `path` that this device `by` keeps of its own
/// (a local write that raced a remote version into the file it replaced): the same pattern as
/// [`conflict_name`], from that copy's mtime.
pub fn local_conflict_name(path: &RelPath, mtime_ns: i64, by: ShortId) -> RelPath {
    sibling_name_of(
        path,
        mtime_ns,
        by,
        None,
        &Hash::of(path.as_str().as_bytes()),
    )
}

fn sibling_name(path: &RelPath, loser: &FileRecord, tag: Option<&str>) -> RelPath {
    sibling_name_of(path, loser.mtime_ns, loser.modified_by, tag, &loser.hash)
}

fn sibling_name_of(
    path: &RelPath,
    mtime_ns: i64,
    by: ShortId,
    tag: Option<&str>,
    hash: &Hash,
) -> RelPath {
    let name = path.file_name();
    let (stem, ext) = match name.rfind('.') {
        Some(0) | None => (name, ""),
        Some(i) if i + 1 == name.len() => (name, ""),
        Some(i) => (&name[..i], &name[i + 1..]),
    };
    let mut mid = format!(".sync-conflict-{}-{}", utc_stamp(mtime_ns), by.display7());
    if let Some(tag) = tag {
        mid.push('-');
        mid.push_str(tag);
    }
    let parent_len = path.parent().map(|p| p.as_str().len() + 1).unwrap_or(0);
    let limit = MAX_NAME_LEN.min(MAX_PATH_LEN.saturating_sub(parent_len));
    let mut ext_part = if ext.is_empty() {
        String::new()
    } else {
        format!(".{ext}")
    };
    if mid.len() + ext_part.len() > limit {
        ext_part.clear();
    }
    let room = limit.saturating_sub(mid.len() + ext_part.len());
    let mut cut = stem.len().min(room);
    while !stem.is_char_boundary(cut) {
        cut -= 1;
    }
    let file = format!("{}{mid}{ext_part}", &stem[..cut]);
    path.with_file_name(&file)
        .or_else(|_| RelPath::new(&file))
        .or_else(|_| RelPath::new(&format!("sync-conflict-{hash}")))
        .unwrap_or_else(|_| path.clone())
}

/// `YYYYMMDD-HHMMSS` in UTC.
fn utc_stamp(mtime_ns: i64) -> String {
    let secs = mtime_ns.div_euclid(1_000_000_000);
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}{m:02}{d:02}-{:02}{:02}{:02}",
        sod / 3600,
        sod % 3600 / 60,
        sod % 60
    )
}

/// Proleptic Gregorian date of a day count since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// The total order that picks the winner of concurrent versions: live directory > live file
/// or symlink > tombstone; then newer mtime, larger `modified_by`, larger hash; then the rest
/// of the state, so that two different states never tie.
fn precedence(r: &FileRecord) -> impl Ord + '_ {
    let rank: u8 = match (r.deleted, r.kind) {
        (true, _) => 0,
        (false, FileKind::Dir) => 2,
        (false, _) => 1,
    };
    let kind: u8 = match r.kind {
        FileKind::File => 0,
        FileKind::Symlink => 1,
        FileKind::Dir => 2,
    };
    (
        rank,
        r.mtime_ns,
        r.modified_by,
        r.hash,
        kind,
        r.mode,
        r.size,
        &r.target,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshfs_protocol::Chunk;
    use proptest::prelude::*;

    /// The view in these tests is a map: it cannot fail.
    fn decide(view: &dyn ReplicaView, remote: &FileRecord) -> Decision {
        super::decide(view, remote).expect("an in-memory view cannot fail")
    }

    const A: ShortId = ShortId(0xA000_0000_0000_0000);
    const B: ShortId = ShortId(0xB000_0000_0000_0000);
    const C: ShortId = ShortId(0xC000_0000_0000_0000);

    use crate::testing::MapView as View;

    impl View {
        /// Executes a decision's steps on the model.
        fn apply(&mut self, d: &Decision) {
            for s in &d.steps {
                let r = s.record();
                if let Some(prev) = self.0.get(&r.path) {
                    assert!(
                        r.version.dominates(&prev.version),
                        "vector moved backwards at {}",
                        r.path
                    );
                }
                self.0.insert(r.path.clone(), r.clone());
            }
        }
    }

    fn p(s: &str) -> RelPath {
        RelPath::new(s).unwrap()
    }

    fn vv(pairs: &[(ShortId, u64)]) -> VersionVector {
        VersionVector::from_pairs(pairs.iter().copied())
    }

    fn file(path: &str, content: &[u8], mtime_s: i64, by: ShortId, v: VersionVector) -> FileRecord {
        FileRecord {
            path: p(path),
            kind: FileKind::File,
            deleted: false,
            mode: 0o644,
            mtime_ns: mtime_s * 1_000_000_000,
            size: content.len() as u64,
            hash: Hash::of(content),
            chunks: if content.is_empty() {
                vec![]
            } else {
                vec![Chunk {
                    len: content.len() as u32,
                    hash: Hash::of(content),
                }]
            },
            target: String::new(),
            version: v,
            modified_by: by,
            sequence: 7,
        }
    }

    fn dir(path: &str, by: ShortId, v: VersionVector) -> FileRecord {
        FileRecord {
            path: p(path),
            kind: FileKind::Dir,
            deleted: false,
            mode: 0o755,
            mtime_ns: 1_000_000_000,
            size: 0,
            hash: Hash::ZERO,
            chunks: vec![],
            target: String::new(),
            version: v,
            modified_by: by,
            sequence: 3,
        }
    }

    fn tombstone(r: &FileRecord, by: ShortId, v: VersionVector) -> FileRecord {
        FileRecord {
            deleted: true,
            size: 0,
            hash: Hash::ZERO,
            chunks: vec![],
            target: String::new(),
            version: v,
            modified_by: by,
            ..r.clone()
        }
    }

    #[test]
    fn conflict_name_follows_the_pattern() {
        let loser = file("docs/report.txt", b"x", 1_795_356_903, A, vv(&[(A, 1)]));
        // 2026-11-22 14:15:03 UTC
        let n = conflict_name(&loser.path, &loser);
        let short = A.display7();
        assert_eq!(
            n.as_str(),
            format!("docs/report.sync-conflict-20261122-141503-{short}.txt")
        );
        let dot = file(".bashrc", b"x", 0, A, vv(&[(A, 1)]));
        assert_eq!(
            conflict_name(&dot.path, &dot).as_str(),
            format!(".bashrc.sync-conflict-19700101-000000-{short}")
        );
        let two = file(".config.toml", b"x", 0, A, vv(&[(A, 1)]));
        assert!(conflict_name(&two.path, &two)
            .as_str()
            .starts_with(".config.sync-conflict-"));
        assert!(conflict_name(&two.path, &two).as_str().ends_with(".toml"));
        let plain = file("Makefile", b"x", 0, A, vv(&[(A, 1)]));
        assert!(conflict_name(&plain.path, &plain)
            .as_str()
            .ends_with(&short));
        let gz = file("a.tar.gz", b"x", 0, A, vv(&[(A, 1)]));
        assert!(conflict_name(&gz.path, &gz)
            .as_str()
            .starts_with("a.tar.sync-conflict-"));
    }

    #[test]
    fn conflict_name_of_a_long_name_shortens_the_stem() {
        let long = format!("{}.txt", "é".repeat(125));
        let loser = file(&long, b"x", 0, A, vv(&[(A, 1)]));
        let n = conflict_name(&loser.path, &loser);
        assert!(n.file_name().len() <= MAX_NAME_LEN);
        assert!(n.file_name().ends_with(".txt"));
        assert!(n.file_name().contains(".sync-conflict-"));
        let neg = file("x", b"x", -1, A, vv(&[(A, 1)]));
        assert!(conflict_name(&neg.path, &neg)
            .as_str()
            .contains("19691231-235959"));
    }

    #[test]
    fn remote_for_unknown_path_is_applied() {
        let r = file("a", b"x", 1, B, vv(&[(B, 1)]));
        let d = decide(&View::default(), &r);
        assert_eq!(d.outcome, Outcome::ApplyRemote);
        assert_eq!(d.steps.len(), 1);
        let t = tombstone(&r, B, vv(&[(B, 2)]));
        let d = decide(&View::default(), &t);
        assert_eq!(d.outcome, Outcome::ApplyRemote);
        assert!(matches!(&d.steps[..], [Step::ApplyRemote { record }] if record.deleted));
    }

    #[test]
    fn ordered_versions_apply_the_newer() {
        let l = file("a", b"x", 1, A, vv(&[(A, 1)]));
        let r = file("a", b"y", 2, B, vv(&[(A, 1), (B, 1)]));
        let view = View::with(&[&l]);
        assert_eq!(decide(&view, &r).outcome, Outcome::ApplyRemote);
        assert_eq!(decide(&View::with(&[&r]), &l).outcome, Outcome::LocalNewer);
        assert_eq!(decide(&view, &l).outcome, Outcome::Nothing);
    }

    #[test]
    fn concurrent_edits_keep_the_loser_as_a_conflict_sibling() {
        let base = vv(&[(A, 1)]);
        let l = file("a.txt", b"mine", 10, A, base.incremented(A, 0));
        let r = file("a.txt", b"theirs", 20, B, base.incremented(B, 0));
        let d = decide(&View::with(&[&l]), &r);
        assert_eq!(
            d.outcome,
            Outcome::Conflict {
                winner_is_local: false
            }
        );
        match &d.steps[..] {
            [Step::PreserveLocal { from, record: sib }, Step::ApplyRemote { record }] => {
                assert_eq!(from, &l.path);
                assert_eq!(sib.path, conflict_name(&l.path, &l));
                assert_eq!(sib.hash, l.hash);
                assert_eq!(sib.modified_by, A);
                assert_eq!(record.hash, r.hash);
                assert!(
                    record.version.dominates(&l.version) && record.version.dominates(&r.version)
                );
            }
            s => panic!("{s:?}"),
        }
    }

    #[test]
    fn a_local_record_whose_content_is_gone_is_superseded_by_the_remote_state_without_a_sibling() {
        let base = vv(&[(A, 1)]);
        // The local version wins by precedence (newer), but its content is gone.
        let l = file("a.txt", b"mine", 20, A, base.incremented(A, 0));
        let r = file("a.txt", b"theirs", 10, B, base.incremented(B, 0));
        let d = super::supersede(&View::with(&[&l]), &r).unwrap();
        assert_eq!(d.outcome, Outcome::ApplyRemote);
        match &d.steps[..] {
            [Step::ApplyRemote { record }] => {
                assert_eq!((record.hash, record.mtime_ns), (r.hash, r.mtime_ns));
                assert!(
                    record.version.dominates(&l.version) && record.version.dominates(&r.version),
                    "the versions the local record superseded stay superseded"
                );
                // Another device settling the same pair makes the same version.
                let again = super::supersede(&View::with(&[&l]), &r).unwrap();
                assert_eq!(again.steps[0].record().version, record.version);
            }
            s => panic!("{s:?}"),
        }
        // A deletion replaces it the same way; a record not concurrent is decided as usual.
        let mut gone = r.clone();
        gone.deleted = true;
        let d = super::supersede(&View::with(&[&l]), &gone).unwrap();
        assert!(matches!(&d.steps[..], [Step::ApplyRemote { record }] if record.deleted));
        let newer = file("a.txt", b"theirs", 10, B, l.version.incremented(B, 0));
        assert_eq!(
            super::supersede(&View::with(&[&l]), &newer).unwrap(),
            decide(&View::with(&[&l]), &newer)
        );
    }

    #[test]
    fn conflict_name_taken_by_other_content_gets_the_hash() {
        let l = file("a.txt", b"mine", 10, A, vv(&[(A, 1)]));
        let r = file("a.txt", b"theirs", 20, B, vv(&[(B, 1)]));
        let squatter = file(
            conflict_name(&l.path, &l).as_str(),
            b"other",
            5,
            C,
            vv(&[(C, 1)]),
        );
        let d = decide(&View::with(&[&l, &squatter]), &r);
        let Step::PreserveLocal { record, .. } = &d.steps[0] else {
            panic!("{d:?}")
        };
        assert!(record
            .path
            .as_str()
            .ends_with(&format!("-{}.txt", l.hash.short())));
        // Already preserved with the same content: no second copy.
        let same = file(
            conflict_name(&l.path, &l).as_str(),
            b"mine",
            5,
            C,
            vv(&[(C, 1)]),
        );
        let d = decide(&View::with(&[&l, &same]), &r);
        assert_eq!(d.steps.len(), 1, "{d:?}");
    }

    #[test]
    fn two_losers_in_the_same_second_get_different_names() {
        // Syncthing 1.19 gave both the same name and lost one.
        let x = file("a.txt", b"one", 10, A, vv(&[(A, 1)]));
        let y = file("a.txt", b"two", 10, A, vv(&[(A, 1), (C, 1)]));
        let mut view = View::with(&[&file("a.txt", b"win", 99, B, vv(&[(B, 1)]))]);
        view.apply(&decide(&view, &x));
        view.apply(&decide(&view, &y));
        let contents: Vec<_> = view.0.values().map(|r| r.hash).collect();
        assert!(
            contents.contains(&x.hash) && contents.contains(&y.hash),
            "{:?}",
            view.0.keys()
        );
    }

    #[test]
    fn delete_concurrent_with_chmod_keeps_the_file_everywhere() {
        // Syncthing 1.19 left replicas disagreeing forever on this one.
        let base = file("a", b"x", 1, A, vv(&[(A, 1)]));
        let mut chmod = base.clone();
        chmod.mode = 0o600;
        chmod.version = base.version.incremented(A, 0);
        let del = tombstone(&base, B, base.version.incremented(B, 0));
        let at_a = decide(&View::with(&[&chmod]), &del);
        let at_b = decide(&View::with(&[&del]), &chmod);
        assert_eq!(
            at_a.outcome,
            Outcome::DeleteLostToModify { kept_local: true }
        );
        assert_eq!(
            at_b.outcome,
            Outcome::DeleteLostToModify { kept_local: false }
        );
        let (ra, rb) = (
            at_a.steps.last().unwrap().record(),
            at_b.steps.last().unwrap().record(),
        );
        assert!(ra.same_state(rb) && !ra.deleted);
        let mut views = [(View::with(&[&chmod]), A), (View::with(&[&del]), B)];
        sync(&mut views);
        same_everywhere(&views);
        assert!(!views[0].0.get(&base.path).unwrap().unwrap().deleted);
    }

    #[test]
    fn directory_beats_file_which_becomes_the_sibling() {
        let f = file("x", b"f", 50, A, vv(&[(A, 1)]));
        let d = dir("x", B, vv(&[(B, 1)]));
        let at_a = decide(&View::with(&[&f]), &d);
        assert_eq!(
            at_a.outcome,
            Outcome::Conflict {
                winner_is_local: false
            }
        );
        assert!(
            matches!(&at_a.steps[..], [Step::PreserveLocal { .. }, Step::ApplyRemote { record }] if record.kind == FileKind::Dir)
        );
        let at_b = decide(&View::with(&[&d]), &f);
        assert!(
            matches!(&at_b.steps[..], [Step::PreserveRemote { .. }, Step::UpdateLocal { record }] if record.kind == FileKind::Dir)
        );
    }

    #[test]
    fn remote_dir_tombstone_keeps_dir_with_live_children() {
        let d = dir("d", A, vv(&[(A, 1)]));
        let child = file("d/new", b"n", 1, A, vv(&[(A, 1)]));
        let del = tombstone(&d, B, vv(&[(A, 1), (B, 1)]));
        let view = View::with(&[&d, &child]);
        let dec = decide(&view, &del);
        assert_eq!(dec.outcome, Outcome::DirKeptForLiveChildren);
        let [Step::UpdateLocal { record }] = &dec.steps[..] else {
            panic!("{dec:?}")
        };
        assert!(!record.deleted);
        assert_eq!(record.version.compare(&del.version), VvOrdering::After);
    }

    #[test]
    fn live_child_under_tombstoned_dirs_revives_them_outermost_first() {
        let top = tombstone(&dir("a", A, vv(&[])), A, vv(&[(A, 2)]));
        let mid = tombstone(&dir("a/b", A, vv(&[])), A, vv(&[(A, 2)]));
        let r = file("a/b/c", b"c", 1, B, vv(&[(B, 1)]));
        let dec = decide(&View::with(&[&top, &mid]), &r);
        match &dec.steps[..] {
            [Step::ReviveDir { record: x }, Step::ReviveDir { record: y }, Step::ApplyRemote { .. }] =>
            {
                assert_eq!(x.path.as_str(), "a");
                assert_eq!(y.path.as_str(), "a/b");
                assert_eq!(x.version.compare(&top.version), VvOrdering::After);
            }
            s => panic!("{s:?}"),
        }
    }

    #[test]
    fn live_child_under_a_local_file_moves_the_file_aside() {
        let f = file("a", b"file", 1, A, vv(&[(A, 1)]));
        let r = file("a/c", b"c", 1, B, vv(&[(B, 1)]));
        let dec = decide(&View::with(&[&f]), &r);
        assert!(
            matches!(
                &dec.steps[..],
                [
                    Step::PreserveLocal { .. },
                    Step::ReviveDir { .. },
                    Step::ApplyRemote { .. }
                ]
            ),
            "{dec:?}"
        );
    }

    #[test]
    fn newer_remote_file_over_dir_with_live_children_keeps_both() {
        let d = dir("d", A, vv(&[(A, 1)]));
        let child = file("d/new", b"n", 1, A, vv(&[(A, 1)]));
        let f = file("d", b"f", 1, B, vv(&[(A, 1), (B, 1)]));
        let dec = decide(&View::with(&[&d, &child]), &f);
        assert_eq!(dec.outcome, Outcome::DirKeptForLiveChildren);
        assert!(
            matches!(&dec.steps[..], [Step::PreserveRemote { record }, Step::UpdateLocal { .. }] if record.hash == f.hash),
            "{dec:?}"
        );
    }

    #[test]
    fn symlink_vs_file_is_a_conflict() {
        let f = file("l", b"target", 1, A, vv(&[(A, 1)]));
        let mut s = f.clone();
        s.kind = FileKind::Symlink;
        s.target = "target".into();
        s.chunks.clear();
        s.version = vv(&[(B, 1)]);
        s.modified_by = B;
        let dec = decide(&View::with(&[&f]), &s);
        assert!(matches!(dec.outcome, Outcome::Conflict { .. }), "{dec:?}");
        assert_eq!(dec.steps.len(), 2);
    }

    #[test]
    fn conflict_on_a_conflict_file_gets_its_own_sibling() {
        let first = file("a.txt", b"one", 10, A, vv(&[(A, 1)]));
        let sib = conflict_name(&first.path, &first);
        let l = file(sib.as_str(), b"edited here", 20, A, vv(&[(A, 2)]));
        let r = file(sib.as_str(), b"edited there", 30, B, vv(&[(B, 1)]));
        let d = decide(&View::with(&[&l]), &r);
        assert_eq!(
            d.outcome,
            Outcome::Conflict {
                winner_is_local: false
            }
        );
        let Step::PreserveLocal { record, .. } = &d.steps[0] else {
            panic!("{d:?}")
        };
        assert_eq!(record.path, conflict_name(&sib, &l));
        assert_eq!(record.path.as_str().matches(".sync-conflict-").count(), 2);
    }

    #[test]
    fn permission_only_change_concurrent_with_content_change_loses_nothing() {
        let base = file("a", b"old", 10, A, vv(&[(A, 1)]));
        let mut chmod = base.clone();
        chmod.mode = 0o600;
        chmod.version = vv(&[(A, 2)]);
        let edit = file("a", b"new", 20, B, vv(&[(A, 1), (B, 1)]));
        let d = decide(&View::with(&[&chmod]), &edit);
        // The newer content keeps the name; the chmod-only version (old content, new mode)
        // survives as the sibling.
        assert_eq!(
            d.outcome,
            Outcome::Conflict {
                winner_is_local: false
            }
        );
        match &d.steps[..] {
            [Step::PreserveLocal { record: sib, .. }, Step::ApplyRemote { record }] => {
                assert_eq!((sib.hash, sib.mode), (base.hash, 0o600));
                assert_eq!(record.hash, edit.hash);
            }
            s => panic!("{s:?}"),
        }
    }

    #[test]
    fn concurrent_same_content_merges_without_conflict() {
        let l = file("a", b"x", 1, A, vv(&[(A, 1)]));
        let mut r = file("a", b"x", 2, B, vv(&[(B, 1)]));
        r.mode = 0o600;
        let dec = decide(&View::with(&[&l]), &r);
        assert_eq!(dec.outcome, Outcome::MergedNoConflict);
        let [Step::UpdateLocal { record }] = &dec.steps[..] else {
            panic!()
        };
        assert_eq!(record.mode, 0o600);
        // Metadata changed for one side: a new version, the same whoever resolves it.
        let merged = vv(&[(A, 1), (B, 1)]);
        assert_eq!(
            record.version,
            merged.incremented(resolver_id(&merged, record), 1)
        );
        let on_b = decide(&View::with(&[&r]), &l);
        assert_eq!(on_b.steps.last().map(Step::record), Some(record));
        // Identical states merge without one.
        let mut same = l.clone();
        same.version = vv(&[(B, 1)]);
        let dec = decide(&View::with(&[&l]), &same);
        let [Step::UpdateLocal { record }] = &dec.steps[..] else {
            panic!()
        };
        assert_eq!(record.version, vv(&[(A, 1), (B, 1)]));
    }

    /// Exchanges every record between the views until nothing changes.
    fn sync(views: &mut [(View, ShortId)]) {
        for _ in 0..20 {
            let mut changed = false;
            for i in 0..views.len() {
                for j in 0..views.len() {
                    if i == j {
                        continue;
                    }
                    let records: Vec<FileRecord> = views[i].0 .0.values().cloned().collect();
                    for r in records {
                        let (view, _) = &mut views[j];
                        let d = decide(view, &r);
                        changed |= !d.steps.is_empty();
                        view.apply(&d);
                    }
                }
            }
            if !changed {
                return;
            }
        }
        panic!("replicas did not converge");
    }

    fn same_everywhere(views: &[(View, ShortId)]) {
        let strip = |v: &View| {
            v.0.values()
                .map(|r| FileRecord {
                    sequence: 0,
                    ..r.clone()
                })
                .collect::<Vec<_>>()
        };
        for (v, _) in views {
            assert_eq!(strip(v), strip(&views[0].0));
        }
    }

    #[test]
    fn equal_vectors_never_name_two_states_after_partial_supersession() {
        // Simulation seed 2, with files. M's edit R1 and T's edit DK are concurrent; M then
        // deletes the path (X supersedes R1, not DK). T resolves R1 vs DK (R1 wins on mtime),
        // then meets X; M meets DK directly. With bare merged vectors both ended at
        // {M:4,T:2}, one holding R1's content and the other DK's, forever.
        let (m, t) = (A, B);
        let r1 = file("p", b"r1", 50, m, vv(&[(m, 3), (t, 1)]));
        let dk = file("p", b"dk", 10, t, vv(&[(m, 2), (t, 2)]));
        let x = tombstone(&r1, m, vv(&[(m, 4), (t, 1)]));
        let mut at_t = View::with(&[&dk]);
        at_t.apply(&decide(&at_t, &r1));
        at_t.apply(&decide(&at_t, &x));
        let mut at_m = View::with(&[&x]);
        at_m.apply(&decide(&at_m, &dk));
        let (pt, pm) = (
            at_t.get(&r1.path).unwrap().unwrap(),
            at_m.get(&r1.path).unwrap().unwrap(),
        );
        assert!(
            pt.version != pm.version || pt.same_state(&pm),
            "{pt:?}\n{pm:?}"
        );
        let mut views = [(at_t, t), (at_m, m)];
        sync(&mut views);
        same_everywhere(&views);
    }

    // ---- properties ----

    fn record_strategy() -> impl Strategy<Value = FileRecord> {
        let vector = prop::collection::vec((0u64..3, 0u64..3), 1..4).prop_map(|p| {
            let v = VersionVector::from_pairs(p.into_iter().map(|(d, c)| (ShortId(d + 1), c)));
            if v.is_empty() {
                VersionVector::new().incremented(ShortId(1), 0)
            } else {
                v
            }
        });
        (0u8..4, 0u8..3, 0u8..2, 0i64..3, 1u64..4, vector).prop_map(|(k, content, m, mt, by, v)| {
            let data = [b'a' + content];
            let mut r = file("d/f.txt", &data, mt, ShortId(by), v);
            r.mode = if m == 0 { 0o644 } else { 0o600 };
            match k {
                0 => {}
                1 => {
                    r.kind = FileKind::Symlink;
                    r.chunks.clear();
                    r.target = format!("t{content}");
                    r.hash = Hash::of(r.target.as_bytes());
                }
                2 => {
                    r = FileRecord {
                        version: r.version,
                        modified_by: r.modified_by,
                        mtime_ns: r.mtime_ns,
                        ..dir("d/f.txt", A, vv(&[]))
                    };
                }
                _ => r = tombstone(&r, r.modified_by, r.version.clone()),
            }
            r
        })
    }

    fn final_at(
        view: &View,
        d: &Decision,
        path: &RelPath,
    ) -> (Option<FileRecord>, Vec<(RelPath, Hash, FileKind)>) {
        let mut v = view.clone();
        v.apply(d);
        let sibs = d
            .steps
            .iter()
            .filter_map(|s| match s {
                Step::PreserveLocal { record, .. } | Step::PreserveRemote { record } => {
                    Some((record.path.clone(), record.hash, record.kind))
                }
                _ => None,
            })
            .collect();
        (v.0.get(path).cloned(), sibs)
    }

    proptest! {
        #[test]
        fn both_sides_reach_the_same_record(l in record_strategy(), r0 in record_strategy()) {
            let r = if l.version == r0.version { l.clone() } else { r0 };
            let parent = dir("d", C, vv(&[(C, 1)]));
            let va = View::with(&[&parent, &l]);
            let vb = View::with(&[&parent, &r]);
            let da = decide(&va, &r);
            let db = decide(&vb, &l);
            // Deterministic.
            prop_assert_eq!(&da, &decide(&va, &r));
            let (fa, sa) = final_at(&va, &da, &l.path);
            let (fb, sb) = final_at(&vb, &db, &l.path);
            let (fa, fb) = (fa.unwrap(), fb.unwrap());
            // The same state on both sides, with a vector that dominates both inputs.
            prop_assert!(fa.same_state(&fb), "{:?}\n{:?}", fa, fb);
            prop_assert_eq!(fa.modified_by, fb.modified_by);
            for f in [&fa, &fb] {
                prop_assert!(f.version.dominates(&l.version) && f.version.dominates(&r.version));
            }
            let concurrent = l.version.compare(&r.version) == VvOrdering::Concurrent;
            if concurrent {
                // The same conflict sibling (path and content) on both sides.
                prop_assert_eq!(&sa, &sb);
                // Nothing live is lost.
                for input in [&l, &r] {
                    if !input.deleted {
                        let kept = fa.same_content(input)
                            || sa.iter().any(|(_, h, k)| *h == input.hash && *k == input.kind);
                        prop_assert!(kept, "lost {:?}", input);
                    }
                }
            } else {
                prop_assert!(sa.is_empty() && sb.is_empty());
                prop_assert_eq!(&fa.version, &fb.version);
            }
            // Exchanging the results converges to identical records without new conflicts.
            let mut views = [(va.clone(), A), (vb.clone(), B)];
            views[0].0.apply(&da);
            views[1].0.apply(&db);
            let before = views[0].0 .0.len();
            sync(&mut views);
            same_everywhere(&views);
            prop_assert_eq!(views[0].0 .0.len(), before);
        }

        #[test]
        fn resolution_order_does_not_matter(x in record_strategy(), y in record_strategy(), z in record_strategy()) {
            // Three pairwise-concurrent versions, resolved in two different orders.
            // Each made by its own device, as real concurrent versions are.
            let (mut x, mut y, mut z) = (x, y, z);
            for (r, dev) in [(&mut x, A), (&mut y, B), (&mut z, C)] {
                r.version = vv(&[(dev, 1)]);
                r.modified_by = dev;
            }
            // A fourth device resolves them, in two different orders.
            let d4 = ShortId(0xD000_0000_0000_0000);
            let parent = dir("d", d4, vv(&[(d4, 1)]));
            let mut one = View::with(&[&parent, &x]);
            for r in [&y, &z] {
                let d = decide(&one, r);
                one.apply(&d);
            }
            let mut two = View::with(&[&parent, &z]);
            for r in [&y, &x] {
                let d = decide(&two, r);
                two.apply(&d);
            }
            let (a, b) = (one.get(&x.path).unwrap().unwrap(), two.get(&x.path).unwrap().unwrap());
            prop_assert!(a.same_state(&b) && a.modified_by == b.modified_by, "{:?}\n{:?}", a, b);
            // The same live contents survive (two versions with equal content that lose in
            // different rounds may each get their own sibling: a duplicate, never a loss).
            let live = |v: &View| v.0.values().filter(|r| !r.deleted && r.path != parent.path)
                .map(|r| (r.hash, r.kind.as_str())).collect::<std::collections::BTreeSet<_>>();
            prop_assert_eq!(live(&one), live(&two));
        }
    }
}

#[cfg(test)]
mod long_histories {
    //! Vectors near the entry cap: what a decision keeps stays sendable, and a decision that
    //! could not keep it so is refused whole.
    use super::*;
    use meshfs_protocol::{
        decode_frame, encode_frame, Chunk, FolderId, IndexBatch, Message, MAX_VV_COUNTER,
        MAX_VV_ENTRIES, MAX_VV_ENTRIES_KEPT,
    };
    use proptest::prelude::*;

    const A: ShortId = ShortId(0xA000_0000_0000_0000);
    const B: ShortId = ShortId(0xB000_0000_0000_0000);
    const C: ShortId = ShortId(0xC000_0000_0000_0000);

    use crate::testing::MapView;

    fn view(records: &[&FileRecord]) -> MapView {
        MapView::with(records)
    }

    /// `len` devices from `first` on, each with `counter`.
    fn history(first: u64, len: usize, counter: u64) -> VersionVector {
        VersionVector::from_pairs((first..first + len as u64).map(|d| (ShortId(d * 7919), counter)))
    }

    fn file(content: &[u8], by: ShortId, version: VersionVector) -> FileRecord {
        FileRecord {
            path: RelPath::new("f").unwrap(),
            kind: FileKind::File,
            deleted: false,
            mode: 0o644,
            mtime_ns: 1_000_000_000,
            size: content.len() as u64,
            hash: Hash::of(content),
            chunks: vec![Chunk {
                len: content.len() as u32,
                hash: Hash::of(content),
            }],
            target: String::new(),
            version,
            modified_by: by,
            sequence: 9,
        }
    }

    /// `r` after one more edit on a device it has not seen, framed alone and decoded again.
    fn sendable_after_an_edit(r: &FileRecord) -> bool {
        let mut r = r.clone();
        r.version.increment(C, MAX_VV_COUNTER);
        r.sequence = u64::MAX;
        let batch = Message::Index(IndexBatch {
            folder: FolderId::new(&"f".repeat(64)).unwrap(),
            records: vec![r],
            up_to: u64::MAX,
            inline: Vec::new(),
        });
        encode_frame(&batch).is_ok_and(|f| decode_frame(&f).is_ok_and(|m| m.is_some()))
    }

    #[test]
    fn a_file_of_chunks_no_meshfs_cuts_is_refused_whatever_the_local_record() {
        let mut remote = file(b"theirs", B, history(0, 1, 1));
        remote.chunks = (0..1000u32)
            .map(|i| Chunk {
                len: 1,
                hash: Hash::of(&i.to_le_bytes()),
            })
            .collect();
        remote.size = 1000;
        remote.hash = Hash::of_chunks(&remote.chunks);
        let local = file(b"mine", A, history(5, 1, 1));
        for v in [view(&[]), view(&[&local])] {
            for d in [
                super::decide(&v, &remote).unwrap(),
                super::take(&v, &remote).unwrap(),
            ] {
                assert_eq!(
                    d.outcome,
                    Outcome::Refused(RecordError::ShortChunk(remote.path.clone(), 0, 1))
                );
                assert!(d.steps.is_empty());
            }
        }
    }

    #[test]
    fn two_long_histories_that_would_merge_past_the_cap_are_refused_not_pruned() {
        let local = file(b"mine", A, history(0, 3000, 1));
        let remote = file(b"theirs", B, history(3000, 3000, 1));
        let d = super::decide(&view(&[&local]), &remote).unwrap();
        assert_eq!(
            d.outcome,
            Outcome::Refused(RecordError::VersionTooLong(local.path.clone(), 6001))
        );
        assert!(d.steps.is_empty(), "nothing is written or journaled");
    }

    #[test]
    fn a_new_record_is_kept_only_with_room_for_one_more_edit() {
        let empty = view(&[]);
        let at_cap = file(b"x", B, history(0, MAX_VV_ENTRIES, 1));
        assert!(matches!(
            super::decide(&empty, &at_cap).unwrap().outcome,
            Outcome::Refused(RecordError::VersionTooLong(_, MAX_VV_ENTRIES))
        ));
        let kept = file(b"x", B, history(0, MAX_VV_ENTRIES_KEPT, 1));
        let d = super::decide(&empty, &kept).unwrap();
        assert_eq!(d.outcome, Outcome::ApplyRemote);
        assert!(sendable_after_an_edit(d.steps[0].record()));
    }

    /// Vectors of 2,500 to 4,096 entries over partly shared devices: their merges fall on both
    /// sides of the cap.
    fn long_vv() -> impl Strategy<Value = VersionVector> {
        (0u64..1500, 2500usize..=MAX_VV_ENTRIES, 1u64..3)
            .prop_map(|(first, len, counter)| history(first, len, counter))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        #[test]
        fn whatever_a_decision_keeps_stays_sendable_after_one_more_edit(
            lv in long_vv(),
            rv in long_vv(),
            same_content in any::<bool>(),
            known in any::<bool>(),
        ) {
            let local = file(b"mine", A, lv);
            let theirs: &[u8] = if same_content { b"mine" } else { b"theirs" };
            let remote = file(theirs, B, rv);
            let v = if known { view(&[&local]) } else { view(&[]) };
            let d = super::decide(&v, &remote).unwrap();
            // Refused exactly when a record of the decision would have been too long.
            let unchecked = decide_unchecked(&v, &remote).unwrap();
            let too_long = unchecked
                .steps
                .iter()
                .any(|s| s.record().version.entries().len() > MAX_VV_ENTRIES_KEPT);
            prop_assert_eq!(matches!(d.outcome, Outcome::Refused(_)), too_long);
            if too_long {
                prop_assert!(d.steps.is_empty());
            } else {
                prop_assert_eq!(&d, &unchecked);
            }
            for s in &d.steps {
                prop_assert!(sendable_after_an_edit(s.record()), "{:?}", d.outcome);
            }
        }
    }
}
