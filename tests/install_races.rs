//! A local write that lands while a remote version is installed is never lost (plain folders,
//! the inotify path). Each window of the install is hit deterministically: the receiving daemon
//! pauses at a named point (`daemon/src/failpoint.rs`), the test writes as a user would, and
//! the daemon goes on. Afterwards the write survives on both devices, as the file or as a
//! conflict copy, and `--wait-synced` is true only once it has.

use crate::common;
use common::*;
use std::io::Write;
use std::time::{Duration, Instant};

/// Two devices sharing `work` with `f` in sync; then `b` restarted with `points` armed (so
/// that the initial sync does not pass them).
fn pair_with_file(points: &str) -> (Device, Device) {
    let t = tmp();
    let mut a = Device::new(&t, "a");
    let mut b = Device::new(&t, "b");
    pair(&a, &b);
    write(&a.path("f"), b"base");
    Device::start_together(&mut [&mut a, &mut b]);
    wait_synced(&[&a, &b], 30);
    if !points.is_empty() {
        b.stop();
        b.arm(points);
        b.start();
        wait_synced(&[&a, &b], 30);
    }
    (a, b)
}

fn read(d: &Device, rel: &str) -> Vec<u8> {
    std::fs::read(d.path(rel)).unwrap_or_default()
}

/// Every version of `f` on `d`: the file and its conflict copies, contents sorted.
fn versions_of_f(d: &Device) -> Vec<Vec<u8>> {
    let mut v: Vec<Vec<u8>> = tree(&d.dir)
        .into_keys()
        .filter(|k| k == "f" || k.starts_with("f.sync-conflict-"))
        .map(|k| read(d, &k))
        .collect();
    v.sort();
    v
}

/// Whether some process is breaking a lease right now (`/proc/locks`: the daemon holds a read
/// lease on a file it is about to replace, and an open for writing has to break it).
fn a_lease_is_breaking() -> bool {
    std::fs::read_to_string("/proc/locks")
        .unwrap_or_default()
        .lines()
        .any(|l| l.contains("LEASE") && l.contains("BREAK"))
}

#[test]
fn a_write_between_the_rename_and_the_stat_of_an_install_is_captured() {
    let point = "install.after_rename@f";
    let (a, b) = pair_with_file(&format!("{point}=pause"));
    write(&a.path("f"), b"from a");
    b.wait_paused(point, 30);
    // The path holds a's version now; b's user overwrites it at once.
    assert_eq!(read(&b, "f"), b"from a");
    write(&b.path("f"), b"from b, after a's arrived");
    b.resume(point);
    wait_synced(&[&a, &b], 30);
    for d in [&a, &b] {
        assert_eq!(read(d, "f"), b"from b, after a's arrived", "on {}", d.name);
    }
    // b's write is journaled on b as its own (no source peer).
    let rows = b.journal(&["--path", "f"]);
    assert!(rows.iter().any(|e| e["source"].is_null()), "{rows:#?}");
}

#[test]
fn a_write_between_the_check_and_the_rename_of_an_install_is_kept() {
    let point = "install.before_rename@f";
    let (a, b) = pair_with_file(&format!("{point}=pause"));
    write(&a.path("f"), b"from a");
    b.wait_paused(point, 30);
    // b's user opens the file to write it: the daemon's lease on the file it is about to
    // replace makes the open wait until the daemon has decided.
    let target = b.path("f");
    let writer = std::thread::spawn(move || {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(&target)
            .unwrap();
        f.write_all(b"from b, during the install").unwrap();
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    while !a_lease_is_breaking() {
        assert!(Instant::now() < deadline, "the writer never met the lease");
        std::thread::sleep(Duration::from_millis(2));
    }
    b.resume(point);
    writer.join().unwrap();
    wait_synced(&[&a, &b], 60);
    let want = vec![b"from a".to_vec(), b"from b, during the install".to_vec()];
    for d in [&a, &b] {
        assert_eq!(versions_of_f(d), want, "on {}", d.name);
    }
}

#[test]
fn a_program_that_holds_the_file_open_for_writing_keeps_its_bytes() {
    let (a, b) = pair_with_file("");
    let mut held = std::fs::OpenOptions::new()
        .append(true)
        .open(b.path("f"))
        .unwrap();
    write(&a.path("f"), b"from a");
    // b's daemon waits for the writer: the path keeps b's file meanwhile, and b is not in sync.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !b.log().contains("open for writing by another program") {
        assert!(Instant::now() < deadline, "{}", b.log());
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(read(&b, "f"), b"base");
    let waiting = meshfs(
        &b.home,
        &["status", "--wait-synced", "--connected", "--timeout", "1"],
    );
    assert!(
        !waiting.status.success(),
        "b is not in sync while a version waits"
    );
    held.write_all(b" and b's line").unwrap();
    drop(held);
    wait_synced(&[&a, &b], 60);
    let want = vec![b"base and b's line".to_vec(), b"from a".to_vec()];
    for d in [&a, &b] {
        assert_eq!(versions_of_f(d), want, "on {}", d.name);
    }
}

#[test]
fn a_write_in_the_echo_window_after_an_install_is_captured() {
    let point = "apply.installed";
    let (a, b) = pair_with_file(&format!("{point}=pause"));
    write(&a.path("f"), b"from a");
    b.wait_paused(point, 30);
    assert_eq!(read(&b, "f"), b"from a");
    write(&b.path("f"), b"from b, before the echo was looked at");
    b.resume(point);
    wait_synced(&[&a, &b], 30);
    for d in [&a, &b] {
        assert_eq!(read(d, "f"), b"from b, before the echo was looked at");
    }
}

#[test]
fn a_write_to_a_file_a_peer_deletes_keeps_the_file() {
    let point = "remove.before_rename@f";
    let (a, b) = pair_with_file(&format!("{point}=pause"));
    std::fs::remove_file(a.path("f")).unwrap();
    b.wait_paused(point, 30);
    let target = b.path("f");
    let writer = std::thread::spawn(move || {
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&target)
            .unwrap();
        f.write_all(b" kept by b").unwrap();
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    while !a_lease_is_breaking() {
        assert!(Instant::now() < deadline, "the writer never met the lease");
        std::thread::sleep(Duration::from_millis(2));
    }
    b.resume(point);
    writer.join().unwrap();
    wait_synced(&[&a, &b], 60);
    for d in [&a, &b] {
        assert_eq!(read(d, "f"), b"base kept by b", "on {}", d.name);
    }
}

/// The race users hit: for each of 40 files, a writes new content, and b overwrites it the
/// moment a's content is readable in b's copy; 20 rounds. No write of b's is ever lost.
#[test]
fn forty_files_overwritten_the_moment_a_peer_version_lands_lose_nothing_in_twenty_rounds() {
    let t = tmp();
    let mut a = Device::new(&t, "a");
    let mut b = Device::new(&t, "b");
    pair(&a, &b);
    let names: Vec<String> = (0..40).map(|i| format!("f{i:02}")).collect();
    for n in &names {
        write(&a.path(n), b"seed");
    }
    Device::start_together(&mut [&mut a, &mut b]);
    wait_synced(&[&a, &b], 60);
    for round in 0..20 {
        let theirs = |n: &str| format!("{n} round {round} from a").into_bytes();
        let ours = |n: &str| format!("{n} round {round} from b").into_bytes();
        for n in &names {
            write(&a.path(n), &theirs(n));
        }
        let mut left: Vec<&String> = names.iter().collect();
        let deadline = Instant::now() + Duration::from_secs(60);
        while !left.is_empty() {
            assert!(
                Instant::now() < deadline,
                "round {round}: {left:?} never arrived"
            );
            left.retain(|n| {
                if read(&b, n) == theirs(n) {
                    write(&b.path(n), &ours(n));
                    false
                } else {
                    true
                }
            });
        }
        wait_synced(&[&a, &b], 60);
        for n in &names {
            assert_eq!(read(&a, n), ours(n), "round {round}: b's write of {n} lost");
        }
        let conflicts: Vec<String> = tree(&a.dir)
            .into_keys()
            .filter(|k| k.contains(".sync-conflict-"))
            .collect();
        assert!(conflicts.is_empty(), "round {round}: {conflicts:?}");
    }
}
