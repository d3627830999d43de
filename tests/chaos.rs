//! Randomized runs of real daemons (issue #41's "randomized run"): 3 to 8 devices, each in its
//! own network namespace, joined pairwise by veth links; a seeded script of writes in a small
//! path space (in place and by rename), deletes, renames, removed directories, files held
//! open for writing, links cut and mended, the devices split into groups, daemons SIGKILLed
//! and restarted, and the race of #41 (a write the moment a peer's version lands). Then
//! every link up and every daemon running: once all say "in sync", the invariants of
//! `chaos/verdict.rs` are checked; then every daemon is restarted (its start-up scan would
//! find anything the watcher missed) and they are checked again on the same, unchanged trees.
//!
//! A seed replays the same script (`chaos/plan.rs`); the timing, and so the outcome of each
//! step, is the machine's. A failing seed keeps its directory (daemon logs, the plan, the
//! trace of what each step did, each device's journal and status) and prints it.
//!
//! With one device on demand (issue #48: `MESHFS_CHAOS_ON_DEMAND=1`; the last device, e.g. r2 of
//! three), that device's folder is on demand with a small budget and mounted, and the script
//! works on it through its mount only: writes, renames, deletes, reads of files not local (which
//! fetch), `meshfs evict`, held files, as well as SIGKILLs and partitions like the others. Its
//! replica is compared by what its placeholders stand for, and once in sync `chaos/ondemand.rs`
//! checks its mount: every path there with the right size and mode, every file reading back
//! exactly what the others hold (never a zero-filled range, nor during the script), and no
//! content evicted that no other device held (the last-copy rule).
//!
//! Environment (the default, for CI: seeds 0 and 1 on 3 devices, seed 2 on 5, and seed 3 on 3
//! with r2 on demand, 40 steps):
//! - `MESHFS_CHAOS_SEEDS`: seeds, e.g. `0-199` or `3,7,10-12`;
//! - `MESHFS_CHAOS_DEVICES`: device counts, e.g. `3,5,8` (every seed runs on each);
//! - `MESHFS_CHAOS_ON_DEMAND`: `1`: the last device of every run is on demand;
//! - `MESHFS_CHAOS_OPS`: steps per run (default 100 when seeds are given);
//! - `MESHFS_CHAOS_CONVERGE_SECS`: how long to wait for "in sync" at the end (default 300);
//! - `MESHFS_BIN`: the daemon to run, e.g. `target/release/meshfs` (default: this build's).
//!
//! Needs root (network namespaces). One seed at a time; `-- --nocapture` prints a line per seed.

use crate::common;
#[path = "chaos/mesh.rs"]
mod mesh;
#[path = "chaos/ondemand.rs"]
mod ondemand;
#[path = "chaos/plan.rs"]
mod plan;
#[path = "chaos/run.rs"]
mod run;
#[path = "chaos/verdict.rs"]
mod verdict;

use common::{meshfs, tree};
use run::Run;
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long the devices get to say "in sync" with equal trees once everything is back up
/// (`MESHFS_CHAOS_CONVERGE_SECS`, default 300).
fn converge_limit() -> Duration {
    let secs = std::env::var("MESHFS_CHAOS_CONVERGE_SECS")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(300);
    Duration::from_secs(secs)
}

/// `0-3,7` → 0, 1, 2, 3, 7.
fn parse_list(s: &str) -> Vec<u64> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (u64, u64) = (
                    a.trim().parse().expect("a number"),
                    b.trim().parse().expect("a number"),
                );
                out.extend(a..=b);
            }
            None => out.push(part.parse().expect("a number")),
        }
    }
    out
}

/// One run: how many devices, whether the last is on demand, the seed.
type Spec = (usize, bool, u64);

/// The runs and the steps of each, from the environment.
fn runs() -> (Vec<Spec>, usize) {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
    let (seeds, devices) = (var("MESHFS_CHAOS_SEEDS"), var("MESHFS_CHAOS_DEVICES"));
    let on_demand = var("MESHFS_CHAOS_ON_DEMAND").is_some_and(|v| v.trim() == "1");
    let ops =
        var("MESHFS_CHAOS_OPS").map(|o| o.trim().parse().expect("MESHFS_CHAOS_OPS: a number"));
    if seeds.is_none() && devices.is_none() && !on_demand {
        return (
            vec![(3, false, 0), (3, false, 1), (5, false, 2), (3, true, 3)],
            ops.unwrap_or(40),
        );
    }
    let seeds = parse_list(seeds.as_deref().unwrap_or("0-1"));
    let devices = parse_list(devices.as_deref().unwrap_or("3"));
    let mut out = Vec::new();
    for &n in &devices {
        for &s in &seeds {
            out.push((n as usize, on_demand, s));
        }
    }
    (out, ops.unwrap_or(100))
}

/// The entries that are not the same on every device (at most 20).
fn tree_differences(trees: &[BTreeMap<String, String>]) -> Vec<String> {
    let mut keys: Vec<&String> = trees.iter().flat_map(|t| t.keys()).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .filter(|k| trees.iter().any(|t| t.get(*k) != trees[0].get(*k)))
        .take(20)
        .map(|k| {
            let each: Vec<String> = trees
                .iter()
                .enumerate()
                .map(|(d, t)| format!("r{d}: {:?}", t.get(k)))
                .collect();
            format!("{k}: {}", each.join(", "))
        })
        .collect()
}

/// Waits until every device says it is in sync with every peer (all connected) and the
/// replicas are equal; how long it took.
fn converge(run: &Run, within: Duration) -> Result<Duration, String> {
    let start = Instant::now();
    loop {
        let synced = run.devs.iter().all(|d| {
            meshfs(&d.home, &["status", "--wait-synced", "--timeout", "5"])
                .status
                .success()
        });
        let trees: Vec<_> = (0..run.devs.len()).map(|d| run.tree(d)).collect();
        if synced && trees.iter().all(|t| t == &trees[0]) {
            return Ok(start.elapsed());
        }
        if start.elapsed() > within {
            let not_synced: Vec<&str> = run
                .devs
                .iter()
                .filter(|d| {
                    !meshfs(&d.home, &["status", "--wait-synced", "--timeout", "1"])
                        .status
                        .success()
                })
                .map(|d| d.name.as_str())
                .collect();
            let state = if not_synced.is_empty() {
                "every device says it is in sync".to_string()
            } else {
                format!("not in sync: {not_synced:?}")
            };
            return Err(format!(
                "no convergence within {within:?}: {state}; the replicas differ at:\n  {}",
                tree_differences(&trees).join("\n  ")
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Each device's journal, status and tree into the run's directory, for a failure.
fn keep_state(run: &Run, dir: &Path) {
    for d in &run.devs {
        let j = meshfs(&d.home, &["journal", "work", "--json", "--all"]);
        let _ = std::fs::write(dir.join(format!("journal-{}.jsonl", d.name)), &j.stdout);
        let s = meshfs(&d.home, &["status", "--json"]);
        let _ = std::fs::write(dir.join(format!("status-{}.json", d.name)), &s.stdout);
    }
    for d in 0..run.devs.len() {
        let _ = std::fs::write(
            dir.join(format!("tree-{}.txt", run.devs[d].name)),
            format!("{:#?}", run.tree(d)),
        );
    }
    if let Some((o, mnt)) = &run.od {
        let _ = std::fs::write(
            dir.join(format!("tree-{}-mount.txt", run.devs[*o].name)),
            format!("{:#?}", tree(mnt)),
        );
        let _ = std::fs::write(
            dir.join(format!("watch-{}.txt", run.devs[*o].name)),
            format!("{:#?}", run.watch),
        );
    }
}

/// Checks the invariants; `phase` names the moment for the message. `mount`: the on-demand
/// device's mount is checked too (it reads every file through it), with its figures.
fn verdict(
    run: &Run,
    phase: &str,
    mount: Option<&mut ondemand::MountCheck>,
) -> Result<usize, String> {
    let journals = verdict::journals(run);
    let mut bad = verdict::check(run, &journals);
    if let (Some(figures), Some((o, _))) = (mount, &run.od) {
        bad.extend(ondemand::check(run, *o, &run.watch, &journals, figures));
    }
    if bad.is_empty() {
        Ok(journals.iter().map(Vec::len).sum())
    } else {
        Err(format!("{phase}:\n  {}", bad.join("\n  ")))
    }
}

/// The on-demand device's figures from its status: (bytes received, files fetched, files
/// evicted, bytes local).
fn od_figures(run: &Run) -> Option<(u64, u64, u64, u64)> {
    let (o, _) = run.od.as_ref()?;
    let s = run.devs[*o].status();
    let d = &s["folders"][0]["on_demand"];
    let n = |v: &serde_json::Value| v.as_u64().unwrap_or(0);
    Some((
        n(&s["bytes_received"]),
        n(&d["fetched_files"]),
        n(&d["evicted_files"]),
        n(&d["local_bytes"]),
    ))
}

/// One seed from start to verdict; the summary line.
fn one_run(
    seed: u64,
    n: usize,
    on_demand: bool,
    ops: usize,
    base: &Arc<tempfile::TempDir>,
) -> Result<String, String> {
    let od = on_demand.then_some(n - 1);
    let steps = plan::plan(seed, n, ops, od);
    let listing: Vec<String> = steps
        .iter()
        .enumerate()
        .map(|(i, s)| format!("#{i:<3} {:?}  (then {} ms)", s.op, s.pause_ms))
        .collect();
    std::fs::write(base.path().join("plan.txt"), listing.join("\n")).expect("plan file");

    let mut run = Run::new(seed, n, od, base);
    let result = (|| {
        converge(&run, converge_limit()).map_err(|e| format!("at start: {e}"))?;
        let began = Instant::now();
        for (i, s) in steps.iter().enumerate() {
            run.step(i, s);
        }
        let ran = began.elapsed();
        run.settle(steps.len());
        let first = converge(&run, converge_limit()).map_err(|e| {
            // What the invariants say of the state it got stuck in.
            let more = verdict(&run, "meanwhile", None).err().unwrap_or_default();
            format!("after the script: {e}\n{more}")
        })?;
        run.note(steps.len(), format!("in sync after {first:?}"));
        let script_figures = od_figures(&run);
        let mut mount = ondemand::MountCheck::default();
        verdict(&run, "once in sync", Some(&mut mount))?;
        let od_line = match (script_figures, od_figures(&run)) {
            (Some((rx, fetched, evicted, _)), Some((rx2, fetched2, evicted2, local))) => format!(
                "; on demand r{}: since its last start received {rx} bytes, {fetched} files fetched, {evicted} evicted; in the script `evict` run {} times (keeping {} files), {} reads through the mount ({} bytes, {} failed offline), {} evictions seen; the check read {} files ({} bytes) through the mount, fetching {} more files ({} bytes), {} more evicted, {local} bytes local (budget {})",
                n - 1,
                run.watch.evict_calls,
                run.watch.evict_kept,
                run.watch.reads,
                run.watch.read_bytes,
                run.watch.read_failures,
                run.watch.evicted.len(),
                mount.files,
                mount.bytes,
                fetched2 - fetched,
                rx2 - rx,
                evicted2 - evicted,
                run::CACHE_MAX,
            ),
            _ => String::new(),
        };

        // Every daemon restarted: its start-up scan sees anything its watcher missed, and
        // nothing may change.
        let before: Vec<_> = (0..run.devs.len()).map(|d| run.tree(d)).collect();
        run.restart_all();
        let second =
            converge(&run, converge_limit()).map_err(|e| format!("after restarting all: {e}"))?;
        let after: Vec<_> = (0..run.devs.len()).map(|d| run.tree(d)).collect();
        if after != before {
            let both: Vec<_> = before.iter().chain(after.iter().take(1)).cloned().collect();
            return Err(format!(
                "restarting every daemon changed the replicas (last column: r0 after):\n  {}",
                tree_differences(&both).join("\n  ")
            ));
        }
        let mut again = ondemand::MountCheck::default();
        let rows = verdict(&run, "after restarting every daemon", Some(&mut again))?;
        let c = &run.counts;
        Ok(format!(
            "chaos seed {seed:>4} devices {n}{} steps {ops}: writes {} (offline {}), kills {}, partitions {}, races {} ({} overwrites), held files {}; script {:.1} s, in sync {:.1} s after, again {:.1} s after restarting all; {rows} journal rows{od_line}",
            if on_demand { " (one on demand)" } else { "" },
            c.writes,
            c.offline_writes,
            c.kills,
            c.partitions,
            c.races,
            c.race_overwrites,
            c.holds,
            ran.as_secs_f64(),
            first.as_secs_f64(),
            second.as_secs_f64(),
        ))
    })();
    if result.is_err() {
        keep_state(&run, base.path());
    }
    result
}

#[test]
fn randomized_runs_with_partitions_kills_and_racing_writes_lose_no_version_and_end_identical() {
    let (runs, ops) = runs();
    let mut per_size: BTreeMap<(usize, bool), (usize, Vec<u64>)> = BTreeMap::new();
    let mut failures = Vec::new();
    let all = Instant::now();
    for (n, on_demand, seed) in runs {
        let od_tag = if on_demand { "od" } else { "" };
        let base = Arc::new(
            tempfile::Builder::new()
                .prefix(&format!("meshfs-chaos-s{seed}-n{n}{od_tag}-"))
                .tempdir()
                .expect("tempdir"),
        );
        let outcome = catch_unwind(AssertUnwindSafe(|| one_run(seed, n, on_demand, ops, &base)))
            .unwrap_or_else(|p| {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                Err(format!("panicked: {msg}"))
            });
        let entry = per_size.entry((n, on_demand)).or_default();
        entry.0 += 1;
        match outcome {
            Ok(line) => eprintln!("{line}"),
            Err(why) => {
                let kept = Arc::try_unwrap(base)
                    .map(|t| t.keep().display().to_string())
                    .unwrap_or_else(|_| "(not kept)".into());
                let msg = format!(
                    "chaos seed {seed} devices {n}{} steps {ops} FAILED ({kept}; replay: MESHFS_CHAOS_SEEDS={seed} MESHFS_CHAOS_DEVICES={n}{} MESHFS_CHAOS_OPS={ops} cargo test --test it chaos:: -- --nocapture): {why}",
                    if on_demand { " (one on demand)" } else { "" },
                    if on_demand { " MESHFS_CHAOS_ON_DEMAND=1" } else { "" },
                );
                eprintln!("{msg}");
                entry.1.push(seed);
                failures.push(msg);
            }
        }
    }
    for ((n, on_demand), (count, failed)) in &per_size {
        let od = if *on_demand { " (one on demand)" } else { "" };
        eprintln!(
            "chaos summary: {n} devices{od}: {count} seeds, {} passed, failed: {failed:?}",
            count - failed.len()
        );
    }
    eprintln!(
        "chaos summary: {ops} steps per seed, {:.0} s in all",
        all.elapsed().as_secs_f64()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
