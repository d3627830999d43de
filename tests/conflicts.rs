//! Offline edits reconcile on reconnect with deterministic, loss-free conflict handling.

mod common;
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
