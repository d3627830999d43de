//! The retention policy: which past versions go, and why. Pure: it reads no clock and touches
//! nothing; [`super::retention`] feeds it the journal's versions and the vault's chunk sizes
//! and carries out what it says.
//!
//! The rules, in order (docs/decisions.md, D44):
//! 1. **off** (`versions_days = 0`): every version goes;
//! 2. **age**: a version that left the tree more than `versions_days` ago goes;
//! 3. **thinning**: of the versions of one path that left the tree more than an hour ago, one
//!    per hour is kept (the last of each hour) while younger than a day, then one per day (the
//!    last of each day): a file saved every minute for a month leaves about 24 + 30 versions,
//!    not 43,200. The last hour is kept whole;
//! 4. **space**: the versions left need the vault's chunks they name (a chunk counted once,
//!    however many versions share it, and not at all when the live tree holds it — those are
//!    not in the vault); while that is more than the budget, the oldest version goes.
//!
//! A folder no peer shares also holds the content of its own recent files ahead (D68): each is
//! a *live* candidate, timed by when it changed, never aged or thinned (it is the current
//! version, changed within the age limit), weighed in the budget with the versions, newest
//! first. A live candidate that does not fit is not held; nothing of the journal goes for it.
//!
//! It never touches a file of the folder: what it names goes from the vault, or from the
//! journal's list of past versions.

use meshfs_protocol::{Hash, RelPath};
use std::collections::{HashMap, HashSet};

/// One hour, in ns.
pub const HOUR_NS: i64 = 3_600_000_000_000;
/// One day, in ns.
pub const DAY_NS: i64 = 24 * HOUR_NS;

/// A folder's retention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    /// How long a version is kept after it left the tree, in ns; `None`: keeping is off.
    pub max_age_ns: Option<i64>,
    /// The most bytes the vault's chunks of the versions kept may take.
    pub budget_bytes: u64,
}

impl Policy {
    /// The policy of a folder that keeps versions `days` days (0: off) in at most `percent`
    /// of `room` bytes (the free space, counting what the vault takes as free) and at most
    /// `max_bytes`, if given.
    pub fn new(days: u64, percent: u8, room: u64, max_bytes: Option<u64>) -> Policy {
        let share = room / 100 * u64::from(percent.min(100));
        Policy {
            max_age_ns: (days > 0).then(|| (days.min(100_000) as i64) * DAY_NS),
            budget_bytes: max_bytes.map_or(share, |m| m.min(share)),
        }
    }
}

/// A version as retention weighs it.
#[derive(Clone, Debug)]
pub struct Candidate<'a> {
    /// Its row.
    pub id: i64,
    /// Its path.
    pub path: &'a RelPath,
    /// When it left the tree, ns since the epoch.
    pub left_ns: i64,
    /// Its chunks.
    pub chunks: Vec<Hash>,
    /// A live file's content held ahead (`left_ns`: when it changed), not a past version.
    pub live: bool,
}

/// Which versions go (their rows, with the reason: `off`, `age`, `thinned`, `space`) given
/// `versions` (oldest first), the vault's chunk sizes `stored` (a chunk absent there costs
/// nothing) and the time `now_ns`. The rest stay. Live candidates come back too where they
/// are not held (`off`, `space`); they are no journal rows to retire.
pub fn retire(
    policy: &Policy,
    versions: &[Candidate<'_>],
    stored: &HashMap<Hash, u64>,
    now_ns: i64,
) -> Vec<(i64, &'static str)> {
    let Some(max_age) = policy.max_age_ns else {
        return versions.iter().map(|v| (v.id, "off")).collect();
    };
    let mut out = Vec::new();
    let mut left: Vec<&Candidate<'_>> = Vec::new();
    for v in versions {
        if !v.live && now_ns.saturating_sub(v.left_ns) > max_age {
            out.push((v.id, "age"));
        } else {
            left.push(v);
        }
    }
    // Thinning: the last of each (path, bucket) stays; `left` is oldest first, so a later one
    // in the same bucket replaces the one before.
    let mut last: HashMap<(&RelPath, i64, i64), i64> = HashMap::new();
    for v in left.iter().filter(|v| !v.live) {
        if let Some(key) = bucket(v, now_ns) {
            last.insert((v.path, key.0, key.1), v.id);
        }
    }
    let mut kept: Vec<&Candidate<'_>> = Vec::new();
    for v in left {
        match bucket(v, now_ns) {
            Some(key) if !v.live && last.get(&(v.path, key.0, key.1)) != Some(&v.id) => {
                out.push((v.id, "thinned"))
            }
            _ => kept.push(v),
        }
    }
    // Space: the newest versions whose chunks fit stay; from the first that does not fit
    // (counting back from the newest), it and everything older go.
    let mut need: HashSet<Hash> = HashSet::new();
    let mut bytes = 0u64;
    let mut cut = None;
    for (i, v) in kept.iter().enumerate().rev() {
        let mut add = 0u64;
        let mut fresh = Vec::new();
        for h in &v.chunks {
            if let Some(&b) = stored.get(h) {
                if !need.contains(h) && !fresh.contains(h) {
                    add += b;
                    fresh.push(*h);
                }
            }
        }
        if bytes + add > policy.budget_bytes {
            cut = Some(i);
            break;
        }
        bytes += add;
        need.extend(fresh);
    }
    if let Some(i) = cut {
        out.extend(kept[..=i].iter().map(|v| (v.id, "space")));
    }
    out
}

/// The thinning bucket of a version (its width, and its index counted from the epoch); `None`
/// while it is younger than an hour (kept whole).
fn bucket(v: &Candidate<'_>, now_ns: i64) -> Option<(i64, i64)> {
    let age = now_ns.saturating_sub(v.left_ns);
    let width = if age < HOUR_NS {
        return None;
    } else if age < DAY_NS {
        HOUR_NS
    } else {
        DAY_NS
    };
    Some((width, v.left_ns.div_euclid(width)))
}

/// The chunks the versions that stay need: what a sweep of the vault keeps.
pub fn needed<'a>(
    versions: impl IntoIterator<Item = &'a Candidate<'a>>,
    gone: &HashSet<i64>,
) -> HashSet<Hash> {
    versions
        .into_iter()
        .filter(|v| !gone.contains(&v.id))
        .flat_map(|v| v.chunks.iter().copied())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn h(n: u32) -> Hash {
        Hash::of(&n.to_le_bytes())
    }

    fn cands<'a>(path: &'a RelPath, spec: &[(i64, i64, &[u32])]) -> Vec<Candidate<'a>> {
        spec.iter()
            .map(|&(id, left_ns, chunks)| Candidate {
                id,
                path,
                left_ns,
                chunks: chunks.iter().map(|&c| h(c)).collect(),
                live: false,
            })
            .collect()
    }

    const NOW: i64 = 1_000 * DAY_NS;

    #[test]
    fn off_retires_everything_and_age_retires_only_what_is_too_old() {
        let p = RelPath::new("f").unwrap();
        let v = cands(
            &p,
            &[
                (1, NOW - 40 * DAY_NS, &[1]),
                (2, NOW - 60_000_000_000, &[2]),
            ],
        );
        let stored = HashMap::new();
        let off = Policy::new(0, 10, 1 << 30, None);
        assert_eq!(retire(&off, &v, &stored, NOW), vec![(1, "off"), (2, "off")]);
        let month = Policy::new(30, 10, 1 << 30, None);
        assert_eq!(retire(&month, &v, &stored, NOW), vec![(1, "age")]);
    }

    #[test]
    fn over_budget_the_oldest_go_first_and_shared_or_live_chunks_count_once_or_not_at_all() {
        let p = RelPath::new("f").unwrap();
        // Each version 10 bytes of its own; v3 and v4 share chunk 30; chunk 99 is live.
        let v = cands(
            &p,
            &[
                (1, NOW - 50 * 60_000_000_000, &[10, 99]),
                (2, NOW - 40 * 60_000_000_000, &[20, 99]),
                (3, NOW - 30 * 60_000_000_000, &[30]),
                (4, NOW - 20 * 60_000_000_000, &[30, 40]),
            ],
        );
        let stored: HashMap<Hash, u64> = [(h(10), 10), (h(20), 10), (h(30), 10), (h(40), 10)]
            .into_iter()
            .collect();
        let budget = |b| Policy {
            max_age_ns: Some(30 * DAY_NS),
            budget_bytes: b,
        };
        assert!(retire(&budget(40), &v, &stored, NOW).is_empty());
        assert_eq!(retire(&budget(30), &v, &stored, NOW), vec![(1, "space")]);
        assert_eq!(
            retire(&budget(20), &v, &stored, NOW),
            vec![(1, "space"), (2, "space")],
            "v3 costs nothing beside v4"
        );
        assert_eq!(retire(&budget(0), &v, &stored, NOW).len(), 4);
    }

    #[test]
    fn an_hour_is_kept_whole_then_one_per_hour_then_one_per_day() {
        let p = RelPath::new("f").unwrap();
        let min = 60_000_000_000i64;
        let mut spec = Vec::new();
        // A save every minute for three days.
        for i in 0..(3 * 24 * 60) {
            spec.push((i as i64, NOW - (3 * 24 * 60 - i) as i64 * min, &[][..]));
        }
        let v = cands(&p, &spec);
        let gone = retire(
            &Policy::new(30, 10, 1 << 40, None),
            &v,
            &HashMap::new(),
            NOW,
        );
        let kept = v.len() - gone.len();
        assert!(gone.iter().all(|g| g.1 == "thinned"));
        // 60 of the last hour, ~23 hours of the last day, ~2-3 days.
        assert!((60 + 22..=60 + 24 + 4).contains(&kept), "{kept}");
    }

    #[test]
    fn a_live_file_held_ahead_is_never_aged_or_thinned_and_weighs_in_the_budget_newest_first() {
        let p = RelPath::new("f").unwrap();
        let q = RelPath::new("g").unwrap();
        let min = 60_000_000_000i64;
        let mut v = cands(
            &p,
            &[
                (1, NOW - 4 * DAY_NS, &[1]),
                (2, NOW - 2 * DAY_NS - 10 * min, &[2]),
                (3, NOW - 2 * DAY_NS - 5 * min, &[3]),
            ],
        );
        // g changed 40 days ago (past the age limit: held all the same) and f 2 minutes ago.
        v.insert(
            0,
            Candidate {
                id: -10,
                path: &q,
                left_ns: NOW - 40 * DAY_NS,
                chunks: vec![h(10)],
                live: true,
            },
        );
        v.push(Candidate {
            id: -11,
            path: &p,
            left_ns: NOW - 2 * min,
            chunks: vec![h(11)],
            live: true,
        });
        let stored: HashMap<Hash, u64> = [1, 2, 3, 10, 11].iter().map(|&c| (h(c), 10)).collect();
        let month = Policy {
            max_age_ns: Some(30 * DAY_NS),
            budget_bytes: 1000,
        };
        assert_eq!(retire(&month, &v, &stored, NOW), vec![(2, "thinned")]);
        // Room for two: the live f and the newest past version; the rest go, g not held.
        let two = Policy {
            budget_bytes: 20,
            ..month
        };
        assert_eq!(
            retire(&two, &v, &stored, NOW),
            vec![(2, "thinned"), (-10, "space"), (1, "space")]
        );
        let off = Policy::new(0, 10, 1 << 30, None);
        assert_eq!(retire(&off, &v, &stored, NOW).len(), 5);
    }

    proptest! {
        #[test]
        fn what_stays_fits_the_budget_and_no_newer_version_goes_for_space_before_an_older_one(
            sizes in proptest::collection::vec((1u64..1000, proptest::collection::vec(0u32..40, 0..6)), 1..30),
            budget in 0u64..20_000,
        ) {
            let p = RelPath::new("f").unwrap();
            let spec: Vec<(i64, i64, Vec<u32>)> = sizes.iter().enumerate()
                .map(|(i, (_, c))| (i as i64, NOW - (100 - i as i64) * 1_000_000_000, c.clone()))
                .collect();
            let v: Vec<Candidate<'_>> = spec.iter().map(|(id, left, c)| Candidate {
                id: *id, path: &p, left_ns: *left, chunks: c.iter().map(|&x| h(x)).collect(),
                live: id % 5 == 4,
            }).collect();
            let stored: HashMap<Hash, u64> = (0u32..40).filter(|x| x % 3 != 0)
                .map(|x| (h(x), sizes[x as usize % sizes.len()].0)).collect();
            let policy = Policy { max_age_ns: Some(30 * DAY_NS), budget_bytes: budget };
            let gone: HashSet<i64> = retire(&policy, &v, &stored, NOW).into_iter().map(|g| g.0).collect();
            let need = needed(&v, &gone);
            let bytes: u64 = need.iter().filter_map(|x| stored.get(x)).sum();
            prop_assert!(bytes <= budget);
            // Oldest first: what goes is a prefix of the versions, by age.
            let max_gone = gone.iter().max().copied().unwrap_or(-1);
            prop_assert!((0..=max_gone).all(|id| gone.contains(&id)));
        }
    }
}
