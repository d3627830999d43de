//! Ground truth the simulation keeps beside the replicas, to judge them.
//!
//! Every version made anywhere is an *event*: a user's edit (create, modify, chmod, delete,
//! rename half), a conflict sibling made by a reconcile, or an internal directory version
//! (revived or kept for live children). Each record `(path, vector)` is given its *history*:
//! the set of events at that path it incorporates — computed by set union and insertion,
//! independently of version vectors — and its *content events*: the events whose content it
//! shows. From that:
//! - one vector never names two histories, and a path's history never shrinks on a replica;
//! - two records are truly concurrent exactly when neither history contains the other, so a
//!   decision's vector comparison can be checked against the truth (invariant (c));
//! - a content event is *discharged* when a later user edit at its path had seen it, or when
//!   a conflict sibling took it over; every undischarged content must survive (invariant (b)).

use meshfs_protocol::{FileKind, FileRecord, Hash, RelPath, VersionVector, VvOrdering};
use std::collections::{BTreeMap, BTreeSet, HashMap};

/// The truth about one record.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct RecTruth {
    pub hist: BTreeSet<u32>,
    pub content: BTreeSet<u32>,
}

/// Who made an event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EventKind {
    /// A user's edit, captured by the replica.
    User,
    /// A conflict sibling made by a reconcile.
    Sibling,
    /// A directory version made by a reconcile.
    Internal,
}

#[derive(Clone, Debug)]
pub(crate) struct EventInfo {
    pub path: RelPath,
    pub kind: EventKind,
    /// Live content (kind, hash), or `None` for deletions and directories.
    pub content: Option<(FileKind, Hash)>,
    pub replica: usize,
}

#[derive(Default)]
pub(crate) struct Truth {
    by_version: HashMap<(RelPath, VersionVector), RecTruth>,
    events: BTreeMap<u32, EventInfo>,
    next_event: u32,
    transferred: BTreeSet<u32>,
    discharged: BTreeSet<u32>,
    /// Versions made by a reconcile (siblings, resolutions, kept directories), by what they
    /// are: the reconciler makes the same version from the same inputs on every replica, and
    /// the same version made twice is one event.
    derived: HashMap<(RelPath, VersionVector), u32>,
}

impl Truth {
    pub fn alloc(&mut self) -> u32 {
        self.next_event += 1;
        self.next_event
    }

    /// The event of a version a reconcile made: the same (path, vector) made on two replicas
    /// is the same event.
    pub fn derived(&mut self, path: &RelPath, version: &VersionVector) -> u32 {
        let key = (path.clone(), version.clone());
        if let Some(&id) = self.derived.get(&key) {
            return id;
        }
        let id = self.alloc();
        self.derived.insert(key, id);
        id
    }

    /// The truth of a record (the empty truth for no record).
    pub fn of(&self, r: Option<&FileRecord>) -> Result<RecTruth, String> {
        match r {
            None => Ok(RecTruth::default()),
            Some(r) => self
                .by_version
                .get(&(r.path.clone(), r.version.clone()))
                .cloned()
                .ok_or_else(|| format!("record {} {} has no known origin", r.path, r.version)),
        }
    }

    /// Registers that `r` has truth `t`; the same vector must always mean the same history.
    pub fn register(&mut self, r: &FileRecord, t: &RecTruth) -> Result<(), String> {
        let key = (r.path.clone(), r.version.clone());
        match self.by_version.get(&key) {
            Some(known) if known.hist != t.hist => Err(format!(
                "vector {} at {} names two histories: {:?} and {:?}",
                r.version, r.path, known.hist, t.hist
            )),
            Some(_) => Ok(()),
            None => {
                self.by_version.insert(key, t.clone());
                Ok(())
            }
        }
    }

    /// An event became real (its record was committed).
    pub fn materialize(&mut self, id: u32, info: EventInfo, hist: &BTreeSet<u32>) {
        if info.kind == EventKind::User {
            self.discharged
                .extend(hist.iter().copied().filter(|&e| e != id));
        }
        self.events.entry(id).or_insert(info);
    }

    pub fn transfer(&mut self, events: &BTreeSet<u32>) {
        self.transferred.extend(events.iter().copied());
    }

    /// Checks a vector comparison against the histories it summarizes.
    pub fn check_order(
        &self,
        local: &FileRecord,
        remote: &FileRecord,
        ord: VvOrdering,
    ) -> Result<(), String> {
        let (l, r) = (self.of(Some(local))?, self.of(Some(remote))?);
        let ok = match ord {
            VvOrdering::Equal => l.hist == r.hist,
            VvOrdering::Before => l.hist.is_subset(&r.hist) && l.hist != r.hist,
            VvOrdering::After => r.hist.is_subset(&l.hist) && l.hist != r.hist,
            VvOrdering::Concurrent => !l.hist.is_subset(&r.hist) && !r.hist.is_subset(&l.hist),
        };
        if ok {
            Ok(())
        } else {
            Err(format!(
                "(c) vectors of {} say {ord:?} ({} vs {}) but the true histories are {:?} and {:?}",
                local.path, local.version, remote.version, l.hist, r.hist
            ))
        }
    }

    /// Content events that must still exist on every replica.
    pub fn obligations(&self) -> impl Iterator<Item = (u32, &EventInfo)> {
        self.events.iter().filter_map(|(&id, e)| {
            let owed = e.content.is_some()
                && e.kind != EventKind::Internal
                && !self.transferred.contains(&id)
                && !self.discharged.contains(&id);
            owed.then_some((id, e))
        })
    }

    pub fn events_made(&self) -> usize {
        self.events.len()
    }

    /// Per path: (distinct versions that ever existed on some replica, user edits made there).
    pub fn versions_per_path(&self) -> BTreeMap<RelPath, (usize, usize)> {
        let mut out: BTreeMap<RelPath, (usize, usize)> = BTreeMap::new();
        for (path, _) in self.by_version.keys() {
            out.entry(path.clone()).or_default().0 += 1;
        }
        for e in self.events.values() {
            if e.kind == EventKind::User {
                out.entry(e.path.clone()).or_default().1 += 1;
            }
        }
        out
    }
}
