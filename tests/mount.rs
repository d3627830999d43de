//! The mount through the daemon: `meshfs mount`/`unmount`, trace capture with the watcher off,
//! changes reaching a peer, clear errors, and a mount left dead by a killed daemon recovered.

use crate::common;
use common::*;
use std::path::Path;
use std::time::{Duration, Instant};

/// Turns the folder's watcher off, so only the mount can report changes.
fn no_watcher(d: &Device) {
    let cfg = d.home.join("config.toml");
    let s = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(&cfg, s.replace("watch = true", "watch = false")).unwrap();
}

fn mount(d: &Device, point: &Path) {
    std::fs::create_dir_all(point).unwrap();
    ok(&d.home, &["mount", "work", point.to_str().unwrap()]);
}

/// Waits until the journal holds `n` rows; returns them.
fn journal_rows(d: &Device, n: usize) -> Vec<serde_json::Value> {
    let t0 = Instant::now();
    loop {
        let j = d.journal(&[]);
        if j.len() >= n || t0.elapsed() > Duration::from_secs(10) {
            return j;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn settle() {
    // Longer than the capture loop's coalescing, so each step is its own version.
    std::thread::sleep(Duration::from_millis(150));
}

fn is_mounted(point: &Path) -> bool {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let p = point.to_string_lossy();
    mounts.lines().any(|l| l.split(' ').nth(1) == Some(&*p))
}

#[test]
fn every_change_through_the_mount_is_journaled_once_with_the_watcher_off() {
    let t = tmp();
    let mut a = Device::new(&t, "a");
    no_watcher(&a);
    a.start();
    let m = t.path().join("mnt-a");
    mount(&a, &m);
    std::fs::write(m.join("notes.txt"), b"first").unwrap();
    settle();
    std::fs::create_dir(m.join("dir")).unwrap();
    settle();
    std::fs::rename(m.join("notes.txt"), m.join("dir/notes.txt")).unwrap();
    settle();
    std::os::unix::fs::symlink("dir/notes.txt", m.join("link")).unwrap();
    settle();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(
        m.join("dir/notes.txt"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    settle();
    std::fs::write(m.join("dir/notes.txt"), b"second version").unwrap();
    settle();
    std::fs::remove_file(m.join("link")).unwrap();
    let rows = journal_rows(&a, 8);
    let got: Vec<(String, String)> = rows
        .iter()
        .map(|e| {
            (
                e["op"].as_str().unwrap().to_string(),
                e["path"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let want: Vec<(String, String)> = [
        ("create", "notes.txt"),
        ("create", "dir"),
        ("rename", "dir/notes.txt"),
        ("delete", "notes.txt"),
        ("create", "link"),
        ("metadata", "dir/notes.txt"),
        ("modify", "dir/notes.txt"),
        ("delete", "link"),
    ]
    .iter()
    .map(|(o, p)| (o.to_string(), p.to_string()))
    .collect();
    let mut sorted_got = got.clone();
    sorted_got.sort();
    let mut sorted_want = want.clone();
    sorted_want.sort();
    assert_eq!(sorted_got, sorted_want, "journal: {got:?}");
    // The backing replica holds what the mount showed.
    assert_eq!(
        std::fs::read(a.path("dir/notes.txt")).unwrap(),
        b"second version"
    );
    // status shows the mount.
    let st = a.status();
    assert_eq!(st["folders"][0]["mount"]["mode"], "read-write");
    ok(&a.home, &["unmount", "work"]);
    assert!(!is_mounted(&m));
    assert!(a.status()["folders"][0]["mount"].is_null());
}

#[test]
fn a_file_saved_in_the_mount_reaches_the_peer_and_the_peers_edit_shows_in_the_mount() {
    let t = tmp();
    let mut a = Device::new(&t, "a");
    let mut b = Device::new(&t, "b");
    pair(&a, &b);
    a.start();
    b.start();
    let m = t.path().join("mnt-a");
    mount(&a, &m);
    // The editor's save: write a temp file, fsync, rename over.
    write(&m.join("doc.txt"), b"v1");
    let tmpf = m.join(".doc.txt.swp");
    std::fs::write(&tmpf, b"v2 from the mount").unwrap();
    std::fs::File::open(&tmpf).unwrap().sync_all().unwrap();
    std::fs::rename(&tmpf, m.join("doc.txt")).unwrap();
    wait_synced(&[&a, &b], 30);
    assert_eq!(
        std::fs::read(b.path("doc.txt")).unwrap(),
        b"v2 from the mount"
    );
    // b edits; the mount on a shows it (apply invalidates the kernel's caches).
    write(&b.path("doc.txt"), b"v3 from b, longer than before");
    wait_synced(&[&a, &b], 30);
    let t0 = Instant::now();
    while std::fs::read(m.join("doc.txt")).unwrap() != b"v3 from b, longer than before" {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the mount never showed b's edit"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_bad_mount_point_gets_an_error_naming_it() {
    let t = tmp();
    let mut a = Device::new(&t, "a");
    a.start();
    let missing = t.path().join("nowhere");
    let out = meshfs(&a.home, &["mount", "work", missing.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("nowhere") && err.contains("does not exist"),
        "{err}"
    );
    let full = t.path().join("full");
    write(&full.join("x"), b"x");
    let out = meshfs(&a.home, &["mount", "work", full.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("not empty"), "{err}");
    let out = meshfs(&a.home, &["unmount", "work"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("not mounted"),
        "{err}"
    );
}

#[test]
fn folder_remove_ends_the_folders_mount_and_leaves_its_files() {
    let t = tmp();
    let mut a = Device::new(&t, "a");
    write(&a.path("kept.txt"), b"stays in the replica");
    a.start();
    let point = t.path().join("mnt");
    mount(&a, &point);
    assert!(is_mounted(&point));
    assert_eq!(
        std::fs::read(point.join("kept.txt")).unwrap(),
        b"stays in the replica"
    );
    ok(&a.home, &["folder", "remove", "work"]);
    // Unmounted by the time the command returns: `meshfs unmount work` could not reach a
    // mount of a folder the config no longer has.
    assert!(
        !is_mounted(&point),
        "the removed folder's mount is still served"
    );
    assert_eq!(std::fs::read_dir(&point).unwrap().count(), 0);
    assert_eq!(
        std::fs::read(a.path("kept.txt")).unwrap(),
        b"stays in the replica"
    );
    a.stop();
}

#[test]
fn a_mount_left_dead_by_a_killed_daemon_comes_back_with_the_next_start() {
    let t = tmp();
    let mut a = Device::new(&t, "a");
    let m = t.path().join("mnt-a");
    std::fs::create_dir_all(&m).unwrap();
    let cfg = a.home.join("config.toml");
    let s = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(
        &cfg,
        s.replace(
            "watch = true",
            &format!("watch = true\nmount = {:?}", m.to_str().unwrap()),
        ),
    )
    .unwrap();
    a.start();
    write(&a.path("kept.txt"), b"still here");
    let t0 = Instant::now();
    while std::fs::read(m.join("kept.txt")).ok().as_deref() != Some(b"still here".as_slice()) {
        assert!(t0.elapsed() < Duration::from_secs(5), "config mount not up");
        std::thread::sleep(Duration::from_millis(20));
    }
    a.kill();
    // The mount point is dead now ("Transport endpoint is not connected").
    assert!(std::fs::read_dir(&m).is_err());
    a.start();
    assert_eq!(std::fs::read(m.join("kept.txt")).unwrap(), b"still here");
    a.stop();
    assert!(!is_mounted(&m), "SIGTERM unmounts");
}

#[test]
fn a_file_open_for_writing_in_the_mount_is_never_replaced_and_both_versions_survive_its_release() {
    use std::io::Write;
    let t = tmp();
    let mut a = Device::new(&t, "a");
    let mut b = Device::new(&t, "b");
    pair(&a, &b);
    write(&a.path("doc.txt"), b"base");
    a.start();
    b.start();
    wait_synced(&[&a, &b], 30);
    let m = t.path().join("mnt-a");
    mount(&a, &m);
    // The user on a holds doc.txt open for writing, as an editor or a log writer does.
    let mut held = std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(m.join("doc.txt"))
        .unwrap();
    held.write_all(b"a's unsaved work, ").unwrap();
    let ino_before = inode(&a.path("doc.txt"));
    // b edits the same file and adds another one in the same moment.
    write(&b.path("doc.txt"), b"b's edit");
    write(&b.path("other.txt"), b"unrelated");
    // The rest of b's changes arrive; the held file is not replaced under its writer.
    let t0 = Instant::now();
    while std::fs::read(a.path("other.txt")).ok().as_deref() != Some(b"unrelated".as_slice()) {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "other.txt never arrived"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        inode(&a.path("doc.txt")),
        ino_before,
        "replaced under its writer"
    );
    assert_eq!(a.status()["folders"][0]["waiting_for_writers"], 1);
    held.write_all(b"saved").unwrap();
    drop(held);
    // After the release both versions are kept, on both devices.
    wait_synced(&[&a, &b], 30);
    let tr = tree(&a.dir);
    let docs: Vec<_> = tr.keys().filter(|k| k.starts_with("doc")).collect();
    assert_eq!(docs.len(), 2, "{docs:?}");
    let contents: Vec<Vec<u8>> = docs
        .iter()
        .map(|k| std::fs::read(a.path(k)).unwrap())
        .collect();
    assert!(
        contents.contains(&b"a's unsaved work, saved".to_vec()),
        "{contents:?}"
    );
    assert!(contents.contains(&b"b's edit".to_vec()), "{contents:?}");
    assert_eq!(a.status()["folders"][0]["waiting_for_writers"], 0);
}

/// With the kernel trusting entries and attributes for a minute (D34), a program that writes
/// the replica directory itself is still seen through the mount at once: the watcher's report
/// invalidates what the kernel holds. Through the mount, only `stat`s (as `git status` and
/// `make` do; a read or a listing would make the kernel ask again anyway): a file's attributes,
/// a name that does not exist (a negative entry) and one that does. Behind it: the file
/// rewritten longer, the missing name created, the other removed.
#[test]
fn a_change_written_straight_into_the_replica_shows_through_the_mount_without_waiting_for_the_ttl()
{
    let t = tmp();
    let mut a = Device::new(&t, "a");
    write(&a.path("dir/old.txt"), b"short");
    write(&a.path("dir/gone.txt"), b"to be removed");
    a.start();
    let point = t.path().join("mnt");
    mount(&a, &point);
    let size = |name: &str| {
        std::fs::symlink_metadata(point.join("dir").join(name))
            .map(|m| m.len())
            .ok()
    };
    assert_eq!(size("old.txt"), Some(5));
    assert_eq!(size("new.txt"), None);
    assert_eq!(size("gone.txt"), Some(13));
    // Past the two seconds in which the watcher's reports of a path count as echoes of the
    // mount's own changes (there are none here).
    std::thread::sleep(Duration::from_millis(2100));
    assert_eq!(size("old.txt"), Some(5));

    write(&a.path("dir/old.txt"), b"a longer content now");
    write(&a.path("dir/new.txt"), b"made behind the mount");
    std::fs::remove_file(a.path("dir/gone.txt")).unwrap();
    let t0 = Instant::now();
    loop {
        let seen = (size("old.txt"), size("new.txt"), size("gone.txt"));
        if seen == (Some(20), Some(21), None) {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the mount still shows {seen:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!("seen through the mount after {:?}", t0.elapsed());
    assert_eq!(
        std::fs::read(point.join("dir/old.txt")).unwrap(),
        b"a longer content now"
    );
    let mut names: Vec<String> = std::fs::read_dir(point.join("dir"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["new.txt", "old.txt"]);
    a.stop();
}
