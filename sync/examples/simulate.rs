//! Runs the deterministic simulation.
//!
//! ```text
//! cargo run --release -p meshfs-sync --example simulate -- --seeds 100000
//! cargo run -p meshfs-sync --example simulate -- --seed 1234          # one run, with a trace
//! cargo run -p meshfs-sync --example simulate -- --seeds 1000 --replicas 5 --ops 40
//! ```

use meshfs_sync::sim::{run, SimConfig};
use std::process::ExitCode;
use std::time::Instant;

fn usage() -> ExitCode {
    eprintln!("usage: simulate [--seeds N | --seed S] [--replicas K] [--ops N] [--first S]");
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let mut seeds: Option<u64> = None;
    let mut one: Option<u64> = None;
    let mut first = 0u64;
    let mut replicas = None;
    let mut ops = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let Some(v) = args.next().and_then(|v| v.parse::<u64>().ok()) else {
            return usage();
        };
        match a.as_str() {
            "--seeds" => seeds = Some(v),
            "--seed" => one = Some(v),
            "--first" => first = v,
            "--replicas" if (1..=16).contains(&v) => replicas = Some(v as usize),
            "--ops" => ops = Some(v as usize),
            _ => return usage(),
        }
    }
    if let Some(seed) = one {
        let cfg = SimConfig {
            seed,
            replicas,
            ops,
            trace: true,
        };
        return match run(&cfg) {
            Ok(r) => {
                for line in &r.trace {
                    println!("{line}");
                }
                println!(
                    "seed {seed}: ok — {} replicas, {} ops, {} events, {} messages, {} virtual ms, {} paths, {} conflict files, outcomes {:?}, {} crashes ({} mid-apply), {} superseded, {} fetch failures, {} ran ahead, {} out of order, {} decided again, {} racing writes, {} failed sessions",
                    r.replicas, r.ops, r.events, r.messages, r.virtual_ms, r.paths, r.conflict_files, r.outcomes,
                    r.crashes, r.interrupted_applies, r.superseded, r.fetch_retries, r.ran_ahead, r.out_of_order,
                    r.redecided, r.race_writes, r.pipeline_failures
                );
                ExitCode::SUCCESS
            }
            Err(f) => {
                for line in &f.trace {
                    println!("{line}");
                }
                eprintln!("{f}");
                ExitCode::FAILURE
            }
        };
    }
    let n = seeds.unwrap_or(1000);
    let start = Instant::now();
    let (mut events, mut conflicts, mut crashes) = (0u64, 0usize, 0u64);
    let (mut interrupted, mut superseded) = (0u64, 0u64);
    let mut pipe = [0u64; 5];
    let (mut max_versions, mut max_extra, mut worst) = (0usize, 0usize, first);
    let mut outcomes = std::collections::BTreeMap::<String, u64>::new();
    for seed in first..first + n {
        match run(&SimConfig {
            seed,
            replicas,
            ops,
            trace: false,
        }) {
            Ok(r) => {
                events += r.events;
                conflicts += r.conflict_files;
                crashes += r.crashes;
                interrupted += r.interrupted_applies;
                superseded += r.superseded;
                for (acc, v) in pipe.iter_mut().zip([
                    r.ran_ahead,
                    r.out_of_order,
                    r.redecided,
                    r.race_writes,
                    r.pipeline_failures,
                ]) {
                    *acc += v;
                }
                max_versions = max_versions.max(r.max_versions_per_path);
                if r.max_extra_versions_per_path > max_extra {
                    (max_extra, worst) = (r.max_extra_versions_per_path, seed);
                }
                for (k, v) in r.outcomes {
                    *outcomes.entry(k).or_default() += v;
                }
            }
            Err(f) => {
                eprintln!("{f}");
                return ExitCode::FAILURE;
            }
        }
        let done = seed - first + 1;
        if done.is_multiple_of(10_000) || done == n {
            println!(
                "{done}/{n} seeds ok in {:.1?} ({events} events, {conflicts} conflict files, {crashes} crashes)",
                start.elapsed()
            );
        }
    }
    println!("decisions: {outcomes:?}; {interrupted} applies interrupted by a crash; {superseded} superseded records skipped");
    let [ahead, ooo, redecided, races, failures] = pipe;
    println!("receive pipeline: {ahead} batches decided while an earlier one of their session was in flight, {ooo} fetches completed out of order, {redecided} records decided again (their target changed), {races} local writes timed just before an install, {failures} sessions ended by a failed batch");
    println!("versions per path: at most {max_versions}, at most {max_extra} beyond its user edits (seed {worst})");
    println!("all {n} seeds passed in {:.1?}", start.elapsed());
    ExitCode::SUCCESS
}
