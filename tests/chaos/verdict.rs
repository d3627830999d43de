//! What must hold once every device says "in sync": the invariants of a randomized run,
//! checked against each device's journal (`meshfs journal work --json --all`) and replica.
//!
//! (1) the replicas are equal (checked by the caller as it waits);
//! (2) every device's last write to a path was captured: its journal has a local row (no
//!     source) with the content's hash at that path — or at a conflict sibling of it, where
//!     D39 keeps what a program wrote into a file an install had just swapped out. A write is
//!     a device's last at a path when no later local operation of that device changed the
//!     path (a later write coalesced with it, a delete or a rename would legitimately leave
//!     it unjournaled). A write never captured is the bug of issue #41;
//! (3) no lost version: every version a device made (a local row) is dominated (every
//!     counter ≥) by the current record of its path — superseded causally, or merged by a
//!     conflict resolution. History is kept whole for an hour, every row of it for 30 days by
//!     default (D64, D67), and tombstones for a year: a run of minutes still has every row
//!     and every path's record.
//!     Stronger, and checked too: on each device each row of a path dominates the one
//!     before it (versions never move backwards);
//! (4) the devices agree on each path's current record (kind, deleted, hash, version), and
//!     each device's live records are exactly what its replica holds;
//! (5) no lost content: the content of a path's last write in the whole run (no device
//!     changed the path afterwards) is in every replica, at the path or at a conflict sibling
//!     of it. A concurrent edit, delete or rename made earlier on a partitioned device loses
//!     to it or becomes a sibling, never hides it.

use super::run::Run;
use std::collections::{BTreeMap, BTreeSet};

/// One history row, as `meshfs journal --json` prints it.
#[derive(Clone, Debug)]
pub struct Row {
    pub sequence: u64,
    pub path: String,
    pub op: String,
    pub kind: String,
    pub deleted: bool,
    pub source: Option<String>,
    pub version: BTreeMap<String, u64>,
    pub vv_text: String,
    pub hash: String,
}

/// `{ABCDEFG:12,HIJKLMN:3}` → its counters.
fn parse_vv(s: &str) -> BTreeMap<String, u64> {
    let inner = s.trim().trim_start_matches('{').trim_end_matches('}');
    inner
        .split(',')
        .filter(|e| !e.is_empty())
        .map(|e| {
            let (id, c) = e
                .split_once(':')
                .unwrap_or_else(|| panic!("bad version {s:?}"));
            (
                id.to_string(),
                c.parse()
                    .unwrap_or_else(|_| panic!("bad counter in version {s:?}")),
            )
        })
        .collect()
}

fn row(v: &serde_json::Value) -> Row {
    let s = |k: &str| v[k].as_str().unwrap_or_default().to_string();
    Row {
        sequence: v["sequence"].as_u64().expect("sequence"),
        path: s("path"),
        op: s("op"),
        kind: s("kind"),
        deleted: v["deleted"].as_bool().expect("deleted"),
        source: v["source"].as_str().map(str::to_string),
        version: parse_vv(v["version"].as_str().expect("version")),
        vv_text: s("version"),
        hash: s("hash").to_ascii_lowercase(),
    }
}

/// Whether `a` dominates `b` (every counter of `b` is ≤ `a`'s).
fn dominates(a: &BTreeMap<String, u64>, b: &BTreeMap<String, u64>) -> bool {
    b.iter()
        .all(|(id, c)| a.get(id).is_some_and(|have| have >= c))
}

/// Whether `candidate` is `path` or a conflict sibling of it (`NAME.sync-conflict-…[.EXT]`
/// in the same directory, or a sibling of such a sibling).
pub fn is_or_sibling(candidate: &str, path: &str) -> bool {
    if candidate == path {
        return true;
    }
    let (dir, name) = path.rsplit_once('/').unwrap_or(("", path));
    let stem = match name.rfind('.') {
        Some(i) if i > 0 && i + 1 < name.len() => &name[..i],
        _ => name,
    };
    let prefix = if dir.is_empty() {
        format!("{stem}.sync-conflict-")
    } else {
        format!("{dir}/{stem}.sync-conflict-")
    };
    candidate.starts_with(&prefix) && !candidate[prefix.len()..].contains('/')
}

/// A written content for a message: its first line, and its size when it has more.
fn shown(content: &[u8]) -> String {
    let text = String::from_utf8_lossy(content);
    let first = text.lines().next().unwrap_or_default();
    if first.len() + 1 >= content.len() {
        first.to_string()
    } else {
        format!("{first} … ({} bytes)", content.len())
    }
}

fn hex(data: &[u8]) -> String {
    super::ondemand::content_hash(data)
}

/// Each device's history rows, ascending by sequence.
pub fn journals(run: &Run) -> Vec<Vec<Row>> {
    run.devs
        .iter()
        .map(|d| d.journal(&["--all"]).iter().map(row).collect())
        .collect()
}

/// The current record of each path: its last row.
fn current(rows: &[Row]) -> BTreeMap<&str, &Row> {
    let mut out = BTreeMap::new();
    for r in rows {
        out.insert(r.path.as_str(), r);
    }
    out
}

/// Every violation of (2)–(5), one line each (empty: the run is sound).
pub fn check(run: &Run, journals: &[Vec<Row>]) -> Vec<String> {
    let mut bad = Vec::new();
    let name = |d: usize| run.devs[d].name.clone();
    let currents: Vec<BTreeMap<&str, &Row>> = journals.iter().map(|j| current(j)).collect();
    let trees: Vec<BTreeMap<String, String>> = (0..run.devs.len()).map(|d| run.tree(d)).collect();

    // (2) each device's last write at each path was captured.
    let mut last_touch: BTreeMap<(usize, &str), u64> = BTreeMap::new();
    for t in &run.touches {
        let e = last_touch.entry((t.dev, t.path.as_str())).or_default();
        *e = (*e).max(t.tick);
    }
    for w in &run.written {
        if last_touch.get(&(w.dev, w.path.as_str())) != Some(&w.tick) {
            continue;
        }
        let h = hex(&w.content);
        let found = journals[w.dev].iter().any(|r| {
            r.source.is_none() && !r.deleted && r.hash == h && is_or_sibling(&r.path, &w.path)
        });
        if !found {
            bad.push(format!(
                "(2) write never captured: {}'s last write to {} (step {}, {:?}, hash {}) has no local row in its journal",
                name(w.dev),
                w.path,
                w.step,
                shown(&w.content),
                &h[..16]
            ));
        }
    }

    // (3) every local version is dominated by its path's current record.
    for (d, rows) in journals.iter().enumerate() {
        for r in rows.iter().filter(|r| r.source.is_none()) {
            let Some(cur) = currents[d].get(r.path.as_str()) else {
                bad.push(format!(
                    "(3) {}: {} has a row and no record",
                    name(d),
                    r.path
                ));
                continue;
            };
            if !dominates(&cur.version, &r.version) {
                bad.push(format!(
                    "(3) lost version: {}'s {} of {} (seq {}, {}) is not dominated by the current record {} (seq {}, {})",
                    name(d),
                    r.op,
                    r.path,
                    r.sequence,
                    r.vv_text,
                    cur.op,
                    cur.sequence,
                    cur.vv_text
                ));
            }
        }
    }

    // (3) and the versions of a path on a device only ever move forward: each row
    // dominates the one before it (architecture: "versions dominate the record at their
    // path, tombstones included, never moving backwards").
    for (d, rows) in journals.iter().enumerate() {
        let mut last: BTreeMap<&str, &Row> = BTreeMap::new();
        for r in rows {
            if let Some(before) = last.insert(r.path.as_str(), r) {
                if !dominates(&r.version, &before.version) {
                    bad.push(format!(
                        "(3) version went backwards: {}'s {} of {} (seq {}, {}) after {} (seq {}, {})",
                        name(d),
                        r.op,
                        r.path,
                        r.sequence,
                        r.vv_text,
                        before.op,
                        before.sequence,
                        before.vv_text
                    ));
                }
            }
        }
    }

    // (4) the devices agree on every record, and each journal matches its replica.
    let paths: BTreeSet<&str> = currents.iter().flat_map(|c| c.keys().copied()).collect();
    for p in &paths {
        let states: Vec<Option<(String, bool, String, String)>> = currents
            .iter()
            .map(|c| {
                c.get(p).map(|r| {
                    let hash = if r.deleted {
                        String::new()
                    } else {
                        r.hash.clone()
                    };
                    (r.kind.clone(), r.deleted, hash, r.vv_text.clone())
                })
            })
            .collect();
        if states.iter().any(|s| s != &states[0]) {
            let shown: Vec<String> = states
                .iter()
                .enumerate()
                .map(|(d, s)| format!("{}: {s:?}", name(d)))
                .collect();
            bad.push(format!("(4) records of {p} differ: {}", shown.join("; ")));
        }
    }
    for (d, t) in trees.iter().enumerate() {
        let live: BTreeMap<&str, &Row> = currents[d]
            .iter()
            .filter(|(_, r)| !r.deleted)
            .map(|(p, r)| (*p, *r))
            .collect();
        for (p, r) in &live {
            let on_disk = t.get(*p);
            let matches = match (r.kind.as_str(), on_disk) {
                ("file", Some(v)) => v.starts_with("file ") && v.ends_with(&r.hash),
                ("dir", Some(v)) => v.starts_with("dir "),
                ("symlink", Some(v)) => v.starts_with("link "),
                _ => false,
            };
            if !matches {
                bad.push(format!(
                    "(4) {}: journal has {} {p} ({}) but the replica has {on_disk:?}",
                    name(d),
                    r.kind,
                    &r.hash[..r.hash.len().min(16)]
                ));
            }
        }
        for p in t.keys().filter(|p| !live.contains_key(p.as_str())) {
            bad.push(format!(
                "(4) {}: {p} is in the replica and not live in the journal",
                name(d)
            ));
        }
    }

    // (5) the last write of each path in the whole run survives somewhere at it.
    let mut last_global: BTreeMap<&str, u64> = BTreeMap::new();
    for t in &run.touches {
        let e = last_global.entry(t.path.as_str()).or_default();
        *e = (*e).max(t.tick);
    }
    for w in &run.written {
        if last_global.get(w.path.as_str()) != Some(&w.tick) {
            continue;
        }
        let h = hex(&w.content);
        for (d, t) in trees.iter().enumerate() {
            let kept = t.iter().any(|(p, v)| {
                v.starts_with("file ") && v.ends_with(&h) && is_or_sibling(p, &w.path)
            });
            if !kept {
                bad.push(format!(
                    "(5) lost content: the last write to {} ({}'s, step {}, {:?}) is not on {}",
                    w.path,
                    name(w.dev),
                    w.step,
                    shown(&w.content),
                    name(d)
                ));
            }
        }
    }
    bad
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_version_vector_parses_and_domination_is_per_counter() {
        let a = parse_vv("{AAAAAAA:3,BBBBBBB:1}");
        let b = parse_vv("{AAAAAAA:2}");
        assert!(dominates(&a, &b));
        assert!(!dominates(&b, &a));
        assert!(dominates(&a, &parse_vv("{}")));
    }

    #[test]
    fn conflict_siblings_are_recognised_with_and_without_an_extension() {
        assert!(is_or_sibling(
            "d0/f0.sync-conflict-20261127-201000-ABCDEFG.txt",
            "d0/f0.txt"
        ));
        assert!(is_or_sibling(
            "f1.sync-conflict-20261127-201000-ABCDEFG",
            "f1"
        ));
        assert!(!is_or_sibling(
            "d1/f1.sync-conflict-20261127-201000-ABCDEFG",
            "f1"
        ));
        assert!(!is_or_sibling("f10", "f1"));
    }
}
