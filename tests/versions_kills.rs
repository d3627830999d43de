//! Past versions under SIGKILL: a loop of restores and prunings on a real daemon, each killed
//! at a chosen step (a failpoint that aborts) or at a random instant (a real SIGKILL), each
//! followed by a restart and the checks a user would make: every file of the folder whole (its
//! old content or its new one, never a mix, never a stray copy), and every version that was
//! kept before the kill still kept and restorable byte-identical unless the budget had to let
//! it go (the vault is full: the policy no longer covers it).
//!
//! `MESHFS_TEST_KILL_LOOPS=N` runs N rounds instead of one per kill point (a soak);
//! `MESHFS_TEST_SEED=S` replays the random instants of a failed run (the seed is printed).

use crate::common;
use crate::versions::{set_folder, versions};
use common::*;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

/// Bytes of every version: noise, so nothing compresses and each costs its size in the vault.
const SIZE: usize = 300_000;
/// B's budget: six versions fit, a seventh does not.
const BUDGET_MIB: u64 = 2;
const BUDGET: u64 = BUDGET_MIB << 20;
const FILES: [&str; 3] = ["f0.bin", "f1.bin", "f2.bin"];

/// Where each round kills the daemon: at a failpoint (the first time it is passed), or at a
/// random instant after the restore is asked for.
const KILLS: [Option<&str>; 9] = [
    Some("restore.built"),
    Some("install.after_exchange"),
    Some("restore.installed"),
    Some("vault.before_commit"),
    Some("prune.retired"),
    Some("vault.sweep_before_commit"),
    None,
    None,
    None,
];

/// xorshift64*: the random instants, replayable from the printed seed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % n
    }
}

/// What the test knows: every content each path ever had, by the hash the journal gives it.
#[derive(Default)]
struct Known {
    by_hash: HashMap<String, Vec<u8>>,
    of_path: HashMap<&'static str, Vec<Vec<u8>>>,
    written: u64,
}

impl Known {
    /// Writes a new content at `path` on `a`.
    fn fresh(&mut self, a: &Device, path: &'static str) {
        self.written += 1;
        let data = noise(SIZE, 1000 + self.written);
        write(&a.path(path), &data);
        self.of_path.entry(path).or_default().push(data);
    }

    /// Learns the hash of each path's current content from B's listing (every content is
    /// current on B at some time before it can be a past version there).
    fn learn(&mut self, b: &Device) {
        for p in FILES {
            let listed = versions(b, p);
            for v in listed["versions"].as_array().unwrap() {
                if v["content"] == "current" {
                    let data = std::fs::read(b.path(p)).unwrap();
                    self.by_hash
                        .insert(v["hash"].as_str().unwrap().to_string(), data);
                }
            }
        }
    }
}

/// Each path's versions on `d`: hash → (content mark, sequence of its newest row).
fn marks(d: &Device) -> BTreeMap<(&'static str, String), (String, u64)> {
    let mut out = BTreeMap::new();
    for p in FILES {
        for v in versions(d, p)["versions"].as_array().unwrap() {
            if v["deleted"] == true {
                continue;
            }
            out.insert(
                (p, v["hash"].as_str().unwrap().to_string()),
                (
                    v["content"].as_str().unwrap().to_string(),
                    v["sequence"].as_u64().unwrap(),
                ),
            );
        }
    }
    out
}

fn vault_held(d: &Device) -> u64 {
    d.status()["folders"][0]["versions"]["bytes"]
        .as_u64()
        .unwrap()
}

/// Every file of `d`'s folder is one of the contents its path had, and nothing else is there.
fn all_whole(d: &Device, known: &Known, when: &str) {
    let names: Vec<String> = tree(&d.dir).into_keys().collect();
    assert_eq!(names, FILES, "{when}: files in the folder");
    for p in FILES {
        let now = std::fs::read(d.path(p)).unwrap();
        assert!(
            known.of_path[p].contains(&now),
            "{when}: {p} on {} is not one of its versions ({} bytes): a partial file",
            d.name,
            now.len()
        );
    }
}

/// After a restart: in sync, the keeper done (no version of a path is listed without its
/// content here) and retention within its budget.
fn settled(a: &Device, b: &Device, when: &str) {
    wait_synced(&[a, b], 60);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let last = marks(b);
        let whole = last
            .values()
            .all(|(c, _)| matches!(c.as_str(), "current" | "kept" | "pruned"));
        if whole && vault_held(b) <= BUDGET {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{when}: B never settled: versions {last:?}, vault {} bytes\n{}",
            vault_held(b),
            b.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn killed_during_restores_and_prunings_no_file_is_ever_partial_and_no_covered_version_is_lost() {
    let seed = std::env::var("MESHFS_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    eprintln!("MESHFS_TEST_SEED={seed}");
    let mut rng = Rng(seed);
    let rounds: usize = std::env::var("MESHFS_TEST_KILL_LOOPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(KILLS.len());

    let t = tmp();
    let mut a = Device::new(&t, "a");
    let mut b = Device::new(&t, "b");
    pair(&a, &b);
    set_folder(&b, "versions_max_mib", &BUDGET_MIB.to_string(), false);
    let mut known = Known::default();
    for p in FILES {
        known.fresh(&a, p);
    }
    a.start();
    b.start();
    wait_synced(&[&a, &b], 60);
    known.learn(&b);
    // Two edits of each file: B keeps six past versions, a full vault.
    for _ in 0..2 {
        for p in FILES {
            known.fresh(&a, p);
        }
        wait_synced(&[&a, &b], 60);
        known.learn(&b);
    }
    settled(&a, &b, "before the loop");
    assert_eq!(
        marks(&b).values().filter(|(c, _)| c == "kept").count(),
        6,
        "{:?}",
        marks(&b)
    );

    let mut fired: HashSet<&str> = HashSet::new();
    let mut pruned_for_space = 0;
    for round in 0..rounds {
        let p = FILES[round % FILES.len()];
        let kill = KILLS[round % KILLS.len()];
        let when = format!("round {round} ({p}, kill at {})", kill.unwrap_or("random"));
        // A fresh content from A: what the restore replaces is new to B's vault, so the
        // restore makes the keeper store it and retention prune (the vault is full).
        let before_restore = std::fs::read(b.path(p)).unwrap();
        known.fresh(&a, p);
        wait_synced(&[&a, &b], 60);
        known.learn(&b);
        settled(&a, &b, &when);
        let replaced = std::fs::read(b.path(p)).unwrap();
        let kept_before: Vec<((&str, String), u64)> = marks(&b)
            .into_iter()
            .filter(|(_, (c, _))| c == "kept")
            .map(|(k, (_, seq))| (k, seq))
            .collect();

        b.kill();
        match kill {
            Some(point) => b.arm(&format!("{point}=abort")),
            None => b.env.clear(),
        }
        b.start();
        let asked = Instant::now();
        let restore = std::process::Command::new(bin())
            .arg("--home")
            .arg(&b.home)
            .args(["restore", "work", p, "--json"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        match kill {
            Some(point) => {
                if b.wait_exit(6.0).is_some() {
                    fired.insert(point);
                }
            }
            // Within the restore's own steps (it takes some 30 ms on a debug build), the
            // keeping of what it replaced (done by some 90 ms), or the pruning that follows a
            // second later.
            None => std::thread::sleep(Duration::from_millis(match rng.below(3) {
                0 => rng.below(45),
                1 => 60 + rng.below(90),
                _ => 900 + rng.below(400),
            })),
        }
        b.kill();
        let killed_after = asked.elapsed();
        let out = restore.wait_with_output().unwrap();
        let restored = out.status.success();
        eprintln!(
            "{when}: killed after {} ms, the restore {}",
            killed_after.as_millis(),
            if restored { "went through" } else { "cut off" }
        );

        // Dead: every file whole, nothing else in the folder.
        all_whole(&b, &known, &when);
        let now = std::fs::read(b.path(p)).unwrap();
        assert!(
            now == replaced || now == before_restore,
            "{when}: {p} is neither what it was nor the version restored"
        );
        if restored {
            assert!(now == before_restore, "{when}: the restore said done");
        }

        b.env.clear();
        b.start();
        settled(&a, &b, &when);
        all_whole(&a, &known, &when);
        all_whole(&b, &known, &when);
        known.learn(&b);
        let after = marks(&b);
        let held = vault_held(&b);
        for (key, _) in &kept_before {
            let (mark, _) = after
                .get(key)
                .cloned()
                .unwrap_or_else(|| panic!("{when}: {key:?} no longer listed"));
            match mark.as_str() {
                "kept" | "current" => {}
                // Let go only for room: the vault holds all the budget allows but one more.
                "pruned" => {
                    assert!(
                        held + SIZE as u64 > BUDGET,
                        "{when}: {key:?} was kept and is gone while the vault holds only {held} bytes of {BUDGET}"
                    );
                    pruned_for_space += 1;
                }
                other => panic!("{when}: {key:?} was kept and is now {other}"),
            }
        }
        // The newest past version of the path (whichever of the two the kill left current)
        // is kept: the budget always covers the newest.
        let other = if now == replaced {
            &before_restore
        } else {
            &replaced
        };
        let other_hash = known
            .by_hash
            .iter()
            .find(|(_, d)| *d == other)
            .map(|(h, _)| h.clone())
            .expect("the other content's hash was learned");
        assert_eq!(
            after.get(&(p, other_hash)).map(|m| m.0.as_str()),
            Some("kept"),
            "{when}: {after:?}"
        );
    }

    // Every version kept now is restorable byte-identical (restored beside its path).
    let mut checked = 0;
    for ((p, hash), (mark, seq)) in marks(&b) {
        if mark != "kept" {
            continue;
        }
        let to = format!("check/{seq}-{p}");
        b.cli_ok(&["restore", "work", p, "--seq", &seq.to_string(), "--to", &to]);
        assert_eq!(
            std::fs::read(b.path(&to)).unwrap(),
            known.by_hash[&hash],
            "{p} version {seq}"
        );
        checked += 1;
    }
    eprintln!(
        "{rounds} rounds: failpoints that fired {fired:?}; {pruned_for_space} kept versions let go for room; {checked} kept versions restored byte-identical"
    );
    // Each file's newest past version at least: the last rounds touched every file.
    assert!(checked >= FILES.len(), "{checked}");
    if rounds >= KILLS.len() {
        let points: HashSet<&str> = KILLS.iter().flatten().copied().collect();
        assert_eq!(fired, points, "every kill point was reached");
    }
    wait_synced(&[&a, &b], 60);
}
