//! Offline edits reconcile on reconnect with deterministic, loss-free conflict handling.

use crate::common;
use common::*;

fn conflict_files(d: &Device) -> Vec<String> {
    tree(&d.dir)
        .into_keys()
        .filter(|k| k.contains(".sync-conflict-"))
        .collect()
}

#[test]
fn the_same_file_edited_on_two_disconnected_devices_ends_with_one_winner_and_one_conflict_file() {
    let t = tmp();
    let mut a = Device::new(&t, "a");
    let mut b = Device::new(&t, "b");
    pair(&a, &b);
    write(&a.path("report.txt"), b"base");
    a.start();
    b.start();
    wait_synced(&[&a, &b], 30);
    b.stop();
    write(&a.path("report.txt"), b"edited on a");
    std::thread::sleep(std::time::Duration::from_millis(50));
    write(&b.path("report.txt"), b"edited on b, later");
    b.start();
    wait_synced(&[&a, &b], 30);
    let ca = conflict_files(&a);
    assert_eq!(ca.len(), 1, "{ca:?}");
    assert_eq!(ca, conflict_files(&b));
    // The later edit (b) keeps the name; a's version survives as the sibling.
    assert_eq!(
        std::fs::read(a.path("report.txt")).unwrap(),
        b"edited on b, later"
    );
    assert_eq!(std::fs::read(a.path(&ca[0])).unwrap(), b"edited on a");
    assert!(ca[0].starts_with("report.sync-conflict-") && ca[0].ends_with(".txt"));
    let listed: serde_json::Value =
        serde_json::from_str(&ok(&a.home, &["conflicts", "work", "--json"])).unwrap();
    assert_eq!(listed[0]["original"], "report.txt");
    assert!(a
        .journal(&["--path", "report.txt"])
        .iter()
        .any(|e| e["op"] == "conflict"));
    // Deleting the conflict file is an ordinary change that propagates.
    std::fs::remove_file(a.path(&ca[0])).unwrap();
    wait_synced(&[&a, &b], 30);
    assert!(conflict_files(&b).is_empty());
}

#[test]
fn two_devices_resolving_the_same_conflict_independently_create_exactly_one_conflict_file() {
    let t = tmp();
    let mut a = Device::new(&t, "a");
    let mut b = Device::new(&t, "b");
    let mut c = Device::new(&t, "c");
    pair(&a, &b);
    pair(&b, &c);
    pair(&a, &c);
    write(&a.path("shared.txt"), b"base");
    for d in [&mut a, &mut b, &mut c] {
        d.start();
    }
    wait_synced(&[&a, &b, &c], 30);
    a.stop();
    b.stop();
    c.stop();
    write(&a.path("shared.txt"), b"from a");
    std::thread::sleep(std::time::Duration::from_millis(20));
    write(&b.path("shared.txt"), b"from b");
    // c learns both versions while a and b never talk to each other first.
    ok(&a.home, &["peer", "remove", &b.id]);
    ok(&b.home, &["peer", "remove", &a.id]);
    for d in [&mut a, &mut b, &mut c] {
        d.start();
    }
    wait_synced(&[&a, &c], 30);
    wait_synced(&[&b, &c], 30);
    pair(&a, &b);
    wait_synced(&[&a, &b, &c], 30);
    for d in [&a, &b, &c] {
        assert_eq!(
            conflict_files(d).len(),
            1,
            "{}: {:?}",
            d.name,
            conflict_files(d)
        );
        assert_eq!(std::fs::read(d.path("shared.txt")).unwrap(), b"from b");
    }
}

#[test]
fn delete_against_modify_keeps_the_modification() {
    let t = tmp();
    let mut a = Device::new(&t, "a");
    let mut b = Device::new(&t, "b");
    pair(&a, &b);
    write(&a.path("keep-me.txt"), b"v1");
    write(&a.path("dir/inner.txt"), b"v1");
    a.start();
    b.start();
    wait_synced(&[&a, &b], 30);
    b.stop();
    std::fs::remove_file(a.path("keep-me.txt")).unwrap();
    std::fs::remove_dir_all(a.path("dir")).unwrap();
    write(&b.path("keep-me.txt"), b"v2 edited while a deleted it");
    write(
        &b.path("dir/inner.txt"),
        b"v2 edited inside a deleted directory",
    );
    std::thread::sleep(std::time::Duration::from_millis(300));
    b.start();
    wait_synced(&[&a, &b], 30);
    for d in [&a, &b] {
        assert_eq!(
            std::fs::read(d.path("keep-me.txt")).unwrap(),
            b"v2 edited while a deleted it"
        );
        assert_eq!(
            std::fs::read(d.path("dir/inner.txt")).unwrap(),
            b"v2 edited inside a deleted directory"
        );
        assert!(conflict_files(d).is_empty());
    }
}

#[test]
fn many_non_conflicting_offline_edits_merge_without_conflict_files() {
    let t = tmp();
    let mut a = Device::new(&t, "a");
    let mut b = Device::new(&t, "b");
    pair(&a, &b);
    for i in 0..50 {
        write(
            &a.path(&format!("common/{i}.txt")),
            format!("base {i}").as_bytes(),
        );
    }
    a.start();
    b.start();
    wait_synced(&[&a, &b], 30);
    b.stop();
    for i in 0..25 {
        write(
            &a.path(&format!("common/{i}.txt")),
            format!("a edit {i}").as_bytes(),
        );
        write(&a.path(&format!("only-a/{i}.txt")), b"a");
    }
    for i in 25..50 {
        write(
            &b.path(&format!("common/{i}.txt")),
            format!("b edit {i}").as_bytes(),
        );
        write(&b.path(&format!("only-b/{i}.txt")), b"b");
    }
    std::fs::remove_file(b.path("common/49.txt")).unwrap();
    b.start();
    wait_synced(&[&a, &b], 60);
    assert!(conflict_files(&a).is_empty());
    assert_eq!(std::fs::read(b.path("common/3.txt")).unwrap(), b"a edit 3");
    assert_eq!(
        std::fs::read(a.path("common/30.txt")).unwrap(),
        b"b edit 30"
    );
    assert!(!a.path("common/49.txt").exists());
    assert_eq!(tree(&a.dir).len(), 1 + 49 + 1 + 25 + 1 + 25);
}

fn link(d: &Device, name: &str, target: &str) {
    let p = d.path(name);
    let _ = std::fs::remove_file(&p);
    std::os::unix::fs::symlink(target, &p).unwrap();
}

/// Journal rows of `work` on `d` with op `op` at paths starting with `prefix`.
fn rows(d: &Device, op: &str, prefix: &str) -> usize {
    d.journal(&[])
        .iter()
        .filter(|e| e["op"] == op && e["path"].as_str().unwrap_or("").starts_with(prefix))
        .count()
}

/// Full mesh between every pair of `devs`.
fn mesh(devs: &[&Device]) {
    for (i, a) in devs.iter().enumerate() {
        for b in &devs[i + 1..] {
            pair(a, b);
        }
    }
}

#[test]
fn a_symlink_retargeted_on_three_disconnected_devices_leaves_symlink_siblings_everywhere() {
    let t = tmp();
    let mut a = Device::new(&t, "a");
    let mut b = Device::new(&t, "b");
    let mut c = Device::new(&t, "c");
    mesh(&[&a, &b, &c]);
    link(&a, "link", "target-0");
    Device::start_together(&mut [&mut a, &mut b, &mut c]);
    wait_synced(&[&a, &b, &c], 30);
    b.stop();
    c.stop();
    for (d, x) in [(&a, "a"), (&b, "b"), (&c, "c")] {
        link(d, "link", &format!("target-{x}"));
    }
    Device::start_together(&mut [&mut b, &mut c]);
    // Equal trees on all three (wait_synced compares kinds and link targets too).
    wait_synced(&[&a, &b, &c], 30);
    let ta = tree(&a.dir);
    let links: Vec<_> = ta.iter().filter(|(k, _)| k.starts_with("link")).collect();
    assert_eq!(links.len(), 3, "one winner and two siblings: {links:?}");
    let mut targets: Vec<_> = links.iter().map(|(_, v)| v.as_str()).collect();
    targets.sort();
    assert_eq!(
        targets,
        ["link target-a", "link target-b", "link target-c"],
        "every sibling is a symlink to its losing target"
    );
    for d in [&a, &b, &c] {
        // Resolutions leave no trail of metadata rows nobody made.
        assert_eq!(rows(d, "metadata", "link"), 0, "{}", d.name);
    }
}

#[test]
fn a_losing_remote_symlink_becomes_a_symlink_sibling_on_two_devices() {
    let t = tmp();
    let mut a = Device::new(&t, "a");
    let mut b = Device::new(&t, "b");
    pair(&a, &b);
    link(&a, "link", "target-0");
    a.start();
    b.start();
    wait_synced(&[&a, &b], 30);
    b.stop();
    link(&a, "link", "target-a");
    link(&b, "link", "target-b");
    b.start();
    wait_synced(&[&a, &b], 30);
    let kinds: Vec<_> = tree(&a.dir)
        .into_iter()
        .filter(|(k, _)| k.starts_with("link"))
        .map(|(_, v)| v)
        .collect();
    assert_eq!(kinds.len(), 2, "{kinds:?}");
    assert!(kinds.iter().all(|v| v.starts_with("link ")), "{kinds:?}");
}

#[test]
fn five_devices_settle_a_three_way_conflict_with_one_entry_per_resolution_even_after_a_kill() {
    let t = tmp();
    let mut devs: Vec<Device> = ["a", "b", "c", "d", "e"]
        .iter()
        .map(|n| Device::new(&t, n))
        .collect();
    mesh(&devs.iter().collect::<Vec<_>>());
    write(&devs[0].path("doc.txt"), b"base");
    link(&devs[0], "link", "target-0");
    Device::start_together(&mut devs.iter_mut().collect::<Vec<_>>());
    wait_synced(&devs.iter().collect::<Vec<_>>(), 30);
    let bytes_before: u64 = devs.iter().map(|d| d.wire_bytes()).sum();
    // Three devices edit both paths while cut off from everyone.
    for d in &mut devs[1..3] {
        d.stop();
    }
    devs[0].stop();
    for (i, d) in devs[..3].iter().enumerate() {
        write(&d.path("doc.txt"), format!("edit {i}").as_bytes());
        link(d, "link", &format!("target-edit-{i}"));
    }
    let back = std::time::Instant::now();
    Device::start_together(&mut devs[..3].iter_mut().collect::<Vec<_>>());
    eprintln!("three devices up {:?} after their start", back.elapsed());
    let back = std::time::Instant::now();
    // One of them dies in the middle of resolving and comes back.
    std::thread::sleep(std::time::Duration::from_millis(30));
    devs[2].kill();
    devs[2].start();
    let all: Vec<&Device> = devs.iter().collect();
    // From the last change (the restarted device is up) until all five trees hold the same
    // settled state: one winner and two siblings for each path.
    let t0 = std::time::Instant::now();
    let settled = |d: &Device| {
        let tr = tree(&d.dir);
        tr.keys().filter(|k| k.starts_with("doc")).count() == 3
            && tr.keys().filter(|k| k.starts_with("link")).count() == 3
    };
    loop {
        let first = tree(&all[0].dir);
        if all.iter().all(|d| settled(d) && tree(&d.dir) == first) {
            break;
        }
        if t0.elapsed() >= std::time::Duration::from_secs(60) {
            for d in &all {
                eprintln!("== {} tree {:?}", d.name, tree(&d.dir));
                eprintln!("{}", tail(&d.log(), 60));
            }
        }
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(60),
            "never settled"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    eprintln!(
        "five devices identical {:?} after the last restart, {:?} after the three edited devices were up",
        t0.elapsed(),
        back.elapsed()
    );
    wait_synced(&all, 60);
    let tr = tree(&devs[0].dir);
    let doc: Vec<_> = tr.keys().filter(|k| k.starts_with("doc")).collect();
    let links: Vec<_> = tr.iter().filter(|(k, _)| k.starts_with("link")).collect();
    assert_eq!(
        doc.len(),
        3,
        "one winner and one sibling per losing version: {doc:?}"
    );
    assert_eq!(links.len(), 3, "{links:?}");
    assert!(
        links.iter().all(|(_, v)| v.starts_with("link target-")),
        "{links:?}"
    );
    for d in &devs {
        for p in ["doc", "link"] {
            // Nobody changed metadata; at most one resolution per losing version.
            assert_eq!(rows(d, "metadata", p), 0, "{} {p}", d.name);
            let conflicts = rows(d, "conflict", p);
            assert!(
                conflicts <= 2,
                "{}: {conflicts} conflict rows for {p}",
                d.name
            );
        }
    }
    let bytes_after: u64 = devs.iter().map(|d| d.wire_bytes()).sum();
    eprintln!(
        "index traffic of the conflict: {} bytes",
        bytes_after.saturating_sub(bytes_before)
    );
}

/// Bytes on the wire while `n` devices settle one conflict made on two of them, per pair of
/// devices.
fn conflict_traffic_per_pair(n: usize) -> f64 {
    let t = tmp();
    let names = ["a", "b", "c", "d", "e"];
    let mut devs: Vec<Device> = names[..n].iter().map(|x| Device::new(&t, x)).collect();
    mesh(&devs.iter().collect::<Vec<_>>());
    write(&devs[0].path("doc.txt"), b"base");
    Device::start_together(&mut devs.iter_mut().collect::<Vec<_>>());
    wait_synced(&devs.iter().collect::<Vec<_>>(), 30);
    for d in &mut devs[..2] {
        d.stop();
    }
    write(&devs[0].path("doc.txt"), b"edit on a");
    write(&devs[1].path("doc.txt"), b"edit on b");
    // The restarted two count from zero; the others from here.
    let before: u64 = devs[2..].iter().map(|d| d.wire_bytes()).sum();
    Device::start_together(&mut devs[..2].iter_mut().collect::<Vec<_>>());
    wait_synced(&devs.iter().collect::<Vec<_>>(), 30);
    let after: u64 = devs.iter().map(|d| d.wire_bytes()).sum();
    let pairs = (n * (n - 1) / 2) as f64;
    (after - before) as f64 / pairs
}

#[test]
fn a_conflict_among_five_devices_costs_each_pair_no_more_than_twice_what_two_devices_pay() {
    let two = conflict_traffic_per_pair(2);
    let five = conflict_traffic_per_pair(5);
    eprintln!("index traffic per device pair: 2 devices {two:.0} B, 5 devices {five:.0} B");
    assert!(
        five <= 2.0 * two,
        "5 devices: {five:.0} B per pair, 2 devices: {two:.0} B"
    );
}
