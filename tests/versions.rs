//! Past versions with real daemons: what a delete or an overwrite takes from the tree is kept
//! (on the device that applied it), listed by `meshfs versions`, brought back by `meshfs
//! restore` as a new change that reaches every device, shown as it was by `mount --at`; and
//! the folder roles (send-only, receive-only) with `override` and `revert`.

use crate::common;
use common::*;
use std::time::{Duration, Instant};

/// Now as RFC 3339 with nanoseconds, as `--at` takes it.
pub(crate) fn now_rfc3339() -> String {
    let out = std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%dT%H:%M:%S.%NZ"])
        .output()
        .unwrap();
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// `meshfs versions work PATH --json`.
pub(crate) fn versions(d: &Device, path: &str) -> serde_json::Value {
    serde_json::from_str(&d.cli_ok(&["versions", "work", path, "--json"])).unwrap()
}

/// The `content` marks of the versions `meshfs versions` lists for `path`, oldest first.
pub(crate) fn contents(d: &Device, path: &str) -> Vec<String> {
    versions(d, path)["versions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["content"].as_str().unwrap().to_string())
        .collect()
}

/// Waits up to `secs` for `cond`, saying `what` if it never holds.
pub(crate) fn wait_for(secs: u64, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !cond() {
        assert!(Instant::now() < deadline, "never: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Sets `key = value` (TOML) in the folder `work` of `d`'s config and reloads a running
/// daemon.
pub(crate) fn set_folder(d: &Device, key: &str, value: &str, running: bool) {
    let file = d.home.join("config.toml");
    let text = std::fs::read_to_string(&file).unwrap();
    let text = text.replacen(
        "id = \"work\"\n",
        &format!("id = \"work\"\n{key} = {value}\n"),
        1,
    );
    std::fs::write(&file, text).unwrap();
    if running {
        d.cli_ok(&["reload"]);
    }
}

fn two() -> (std::sync::Arc<tempfile::TempDir>, Device, Device) {
    let t = tmp();
    let a = Device::new(&t, "a");
    let b = Device::new(&t, "b");
    pair(&a, &b);
    (t, a, b)
}

#[test]
fn a_file_deleted_on_one_device_is_restored_byte_identical_from_either_device_and_reaches_both() {
    let (_t, mut a, mut b) = two();
    let one = noise(700_000, 1);
    let two = noise(300_000, 2);
    write(&a.path("docs/one.bin"), &one);
    write(&a.path("docs/two.bin"), &two);
    a.start();
    b.start();
    wait_synced(&[&a, &b], 60);

    std::fs::remove_file(a.path("docs/one.bin")).unwrap();
    std::fs::remove_file(a.path("docs/two.bin")).unwrap();
    wait_synced(&[&a, &b], 60);
    assert!(!b.path("docs/one.bin").exists());
    // B applied the deletions and kept what they took; A deleted them itself (the watcher saw
    // them gone), so A's copy of the content is B's.
    wait_for(20, "B keeps the deleted files' content", || {
        contents(&b, "docs/one.bin").first().map(String::as_str) == Some("kept")
            && contents(&b, "docs/two.bin").first().map(String::as_str) == Some("kept")
    });
    let listed = versions(&a, "docs/one.bin");
    let first = &listed["versions"][0];
    assert_eq!(first["size"], 700_000);
    assert_eq!(first["modified_by"], a.id[..7].to_uppercase());

    // Restored on B, which applied the deletion: it comes back on both.
    let out = b.cli_ok(&["restore", "work", "docs/one.bin"]);
    assert!(out.contains("restored docs/one.bin"), "{out}");
    wait_synced(&[&a, &b], 60);
    assert_eq!(std::fs::read(a.path("docs/one.bin")).unwrap(), one);
    assert_eq!(std::fs::read(b.path("docs/one.bin")).unwrap(), one);

    // Restored on A, where the deletion was made: the content comes from B.
    let report: serde_json::Value =
        serde_json::from_str(&a.cli_ok(&["restore", "work", "docs/two.bin", "--json"])).unwrap();
    assert_eq!(report["restored"][0]["path"], "docs/two.bin", "{report}");
    assert!(report["fetched_chunks"].as_u64().unwrap() > 0, "{report}");
    wait_synced(&[&a, &b], 60);
    assert_eq!(std::fs::read(b.path("docs/two.bin")).unwrap(), two);

    // Both restores are journaled as this device's new versions.
    let rows = a.journal(&["--path", "docs/two.bin"]);
    assert_eq!(
        rows.last().unwrap()["modified_by"],
        a.id[..7].to_uppercase()
    );
    assert_eq!(rows.last().unwrap()["op"], "create");
}

#[test]
fn an_overwritten_file_gets_its_previous_version_back_on_every_device() {
    let (_t, mut a, mut b) = two();
    let before = noise(500_000, 3);
    write(&a.path("report.txt"), &before);
    a.start();
    b.start();
    wait_synced(&[&a, &b], 60);
    let after = noise(400_000, 4);
    write(&a.path("report.txt"), &after);
    wait_synced(&[&a, &b], 60);
    assert_eq!(std::fs::read(b.path("report.txt")).unwrap(), after);
    wait_for(20, "B keeps the replaced version", || {
        contents(&b, "report.txt") == ["kept", "current"]
    });
    let listed = versions(&b, "report.txt");
    let seq = listed["versions"][0]["sequence"]
        .as_u64()
        .unwrap()
        .to_string();

    // By its sequence, to another name first: the current file is not touched.
    b.cli_ok(&[
        "restore",
        "work",
        "report.txt",
        "--seq",
        &seq,
        "--to",
        "report-before.txt",
    ]);
    wait_synced(&[&a, &b], 60);
    assert_eq!(std::fs::read(a.path("report-before.txt")).unwrap(), before);
    assert_eq!(std::fs::read(a.path("report.txt")).unwrap(), after);

    // Then in place (no flag: the newest kept version that is not the current one).
    b.cli_ok(&["restore", "work", "report.txt"]);
    wait_synced(&[&a, &b], 60);
    assert_eq!(std::fs::read(a.path("report.txt")).unwrap(), before);
    assert_eq!(std::fs::read(b.path("report.txt")).unwrap(), before);
    // What the restore replaced is a past version in its turn.
    wait_for(20, "the overwritten content is kept in turn on A", || {
        contents(&a, "report.txt").iter().any(|c| c == "kept")
    });
}

#[test]
fn a_tree_removed_with_rm_rf_on_one_device_comes_back_on_every_device_restored_as_of_earlier_on_a_third(
) {
    let t = tmp();
    let mut a = Device::new(&t, "a");
    let mut b = Device::new(&t, "b");
    let mut c = Device::new(&t, "c");
    pair(&a, &b);
    pair(&b, &c);
    pair(&a, &c);
    for i in 0..1000 {
        write(
            &a.path(&format!("tree/d{}/f{i}.txt", i % 20)),
            format!("file {i}\n").repeat(1 + i % 7).as_bytes(),
        );
    }
    Device::start_together(&mut [&mut a, &mut b, &mut c]);
    wait_synced(&[&a, &b, &c], 180);
    let whole = tree(&a.dir);
    assert_eq!(whole.len(), 1000 + 20 + 1);
    std::thread::sleep(Duration::from_millis(1100));
    let then = now_rfc3339();
    std::thread::sleep(Duration::from_millis(1100));

    std::fs::remove_dir_all(a.path("tree")).unwrap();
    wait_synced(&[&a, &b, &c], 180);
    assert!(!c.path("tree").exists());
    let listed = versions(&c, "tree");
    assert_eq!(
        listed["below"].as_array().unwrap().len(),
        1000 + 20,
        "{listed}"
    );

    let report: serde_json::Value =
        serde_json::from_str(&c.cli_ok(&["restore", "work", "tree", "--at", &then, "--json"]))
            .unwrap();
    assert_eq!(report["failed"].as_array().unwrap().len(), 0, "{report}");
    wait_synced(&[&a, &b, &c], 180);
    assert_eq!(tree(&a.dir), whole);
    assert_eq!(tree(&b.dir), whole);
    assert_eq!(tree(&c.dir), whole);
}

#[test]
fn the_folder_mounted_as_of_a_past_time_shows_deleted_files_and_not_later_ones() {
    let (t, mut a, mut b) = two();
    write(&a.path("keep.txt"), b"kept as is\n");
    write(&a.path("gone.txt"), b"deleted later\n");
    write(&a.path("sub/edited.txt"), b"first words\n");
    a.start();
    b.start();
    wait_synced(&[&a, &b], 60);
    std::thread::sleep(Duration::from_millis(1100));
    let then = now_rfc3339();
    std::thread::sleep(Duration::from_millis(1100));
    std::fs::remove_file(b.path("gone.txt")).unwrap();
    write(&b.path("sub/edited.txt"), b"second words\n");
    write(&b.path("new.txt"), b"written after\n");
    wait_synced(&[&a, &b], 60);

    // On A, which applied B's changes (and so kept what they took).
    let point = t.path().join("a-then");
    std::fs::create_dir_all(&point).unwrap();
    let point_s = point.to_str().unwrap();
    a.cli_ok(&["mount", "work", point_s, "--at", &then]);
    struct Unmount<'a>(&'a Device, &'a str);
    impl Drop for Unmount<'_> {
        fn drop(&mut self) {
            let _ = self.0.cli(&["unmount", "work", self.1]);
        }
    }
    let _guard = Unmount(&a, point_s);
    let seen = tree(&point);
    let names: Vec<&str> = seen.keys().map(String::as_str).collect();
    assert_eq!(names, ["gone.txt", "keep.txt", "sub", "sub/edited.txt"]);
    assert_eq!(
        std::fs::read(point.join("gone.txt")).unwrap(),
        b"deleted later\n"
    );
    assert_eq!(
        std::fs::read(point.join("sub/edited.txt")).unwrap(),
        b"first words\n"
    );
    // Read-only, and ordinary tools work on it.
    assert!(std::fs::write(point.join("keep.txt"), b"x").is_err());
    let copy = t.path().join("copy");
    let cp = std::process::Command::new("cp")
        .args(["-a", &format!("{point_s}/."), copy.to_str().unwrap()])
        .status()
        .unwrap();
    assert!(cp.success());
    assert_eq!(tree(&copy), seen);
    let diff = std::process::Command::new("diff")
        .args(["-r", point_s, a.dir.to_str().unwrap()])
        .output()
        .unwrap();
    let diff = String::from_utf8_lossy(&diff.stdout);
    assert!(
        diff.contains("Only in") && diff.contains("new.txt"),
        "{diff}"
    );
    drop(_guard);
    wait_for(10, "the snapshot is unmounted", || {
        std::fs::read_dir(&point)
            .map(|d| d.count() == 0)
            .unwrap_or(false)
    });
}

#[test]
fn a_receive_only_device_does_not_send_its_edits_lists_them_and_revert_brings_the_shared_state_back(
) {
    let (_t, mut a, mut b) = two();
    write(&a.path("shared.txt"), b"shared state\n");
    set_folder(&b, "role", "\"receive-only\"", false);
    a.start();
    b.start();
    wait_synced(&[&a, &b], 60);
    assert_eq!(
        std::fs::read(b.path("shared.txt")).unwrap(),
        b"shared state\n"
    );

    write(&b.path("shared.txt"), b"local edit on the backup\n");
    write(&b.path("local-new.txt"), b"only here\n");
    wait_for(20, "B lists its local changes", || {
        b.status()["folders"][0]["not_sent"]["count"] == 2
    });
    // Nothing reached A.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        std::fs::read(a.path("shared.txt")).unwrap(),
        b"shared state\n"
    );
    assert!(!a.path("local-new.txt").exists());
    let text = b.cli_ok(&["status"]);
    assert!(
        text.contains("receive-only: 2 local changes not sent"),
        "{text}"
    );

    // A's changes still arrive.
    write(&a.path("from-a.txt"), b"news\n");
    wait_for(20, "A's new file reaches B", || {
        b.path("from-a.txt").exists()
    });

    b.cli_ok(&["revert", "work"]);
    wait_for(20, "B is back to the shared state", || {
        std::fs::read(b.path("shared.txt")).ok().as_deref() == Some(&b"shared state\n"[..])
            && !b.path("local-new.txt").exists()
    });
    assert_eq!(b.status()["folders"][0]["not_sent"]["count"], 0);
    // The local edit is kept as a past version.
    wait_for(20, "the reverted local edit is kept", || {
        versions(&b, "shared.txt")["versions"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v["size"] == 25 && v["content"] == "kept")
    });
    wait_synced(&[&a, &b], 60);
}

#[test]
fn a_send_only_device_holds_peers_changes_lists_them_and_override_makes_its_state_win() {
    let (_t, mut a, mut b) = two();
    write(&a.path("master.txt"), b"the master copy\n");
    set_folder(&a, "role", "\"send-only\"", false);
    a.start();
    b.start();
    wait_synced(&[&a, &b], 60);

    // A's changes go out as usual.
    write(&a.path("master.txt"), b"the master copy, edited\n");
    wait_for(20, "A's edit reaches B", || {
        std::fs::read(b.path("master.txt")).ok().as_deref()
            == Some(&b"the master copy, edited\n"[..])
    });
    // B's do not land on A.
    write(&b.path("master.txt"), b"B scribbled here\n");
    write(&b.path("b-new.txt"), b"from b\n");
    wait_for(20, "A lists the changes it holds", || {
        a.status()["folders"][0]["not_applied"]["count"] == 2
    });
    assert_eq!(
        std::fs::read(a.path("master.txt")).unwrap(),
        b"the master copy, edited\n"
    );
    assert!(!a.path("b-new.txt").exists());
    let text = a.cli_ok(&["status"]);
    assert!(
        text.contains("send-only: 2 changes of peers not applied here"),
        "{text}"
    );

    a.cli_ok(&["override", "work"]);
    wait_for(30, "A's state wins on B", || {
        std::fs::read(b.path("master.txt")).ok().as_deref()
            == Some(&b"the master copy, edited\n"[..])
            && !b.path("b-new.txt").exists()
    });
    wait_for(20, "A holds nothing any more", || {
        a.status()["folders"][0]["not_applied"]["count"] == 0
    });
    // B's overridden edit is a past version on B.
    assert!(contents(&b, "master.txt").iter().any(|c| c == "kept"));
    wait_synced(&[&a, &b], 60);
}

/// The vault's bytes on disk (the database and its WAL).
pub(crate) fn vault_bytes(d: &Device) -> u64 {
    let dir = d.home.join("state").join("versions");
    std::fs::read_dir(&dir)
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

#[test]
fn a_big_file_edited_in_ten_places_keeps_about_ten_chunks_of_history_not_ten_copies() {
    let (_t, mut a, mut b) = two();
    let size: usize = std::env::var("MESHFS_TEST_BIG_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
        << 20;
    let path = a.path("big.bin");
    write(&path, &noise(size, 9));
    a.start();
    b.start();
    wait_synced(&[&a, &b], 300);
    for i in 0..10u64 {
        use std::io::{Seek, Write};
        let mut f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.seek(std::io::SeekFrom::Start(
            (i * 997 + 13) * (size as u64 / 10_000),
        ))
        .unwrap();
        f.write_all(&noise(4096, 100 + i)).unwrap();
        f.sync_all().unwrap();
        drop(f);
        wait_synced(&[&a, &b], 300);
    }
    wait_for(30, "B keeps ten past versions", || {
        contents(&b, "big.bin")
            .iter()
            .filter(|c| *c == "kept")
            .count()
            == 10
    });
    let st = b.status();
    let kept = st["folders"][0]["versions"]["bytes"].as_u64().unwrap();
    let on_disk = vault_bytes(&b);
    eprintln!(
        "{} MiB file, 10 edits of 4 KiB: vault holds {kept} bytes of chunks, its files {on_disk} bytes on disk",
        size >> 20
    );
    // A chunk averages 1 MiB at most (docs/protocol.md); an edit replaces one or two.
    assert!(kept <= 20 << 20, "{kept} bytes kept");
    assert!(on_disk <= 24 << 20, "{on_disk} bytes on disk");
    assert!(on_disk < size as u64 / 2);
}

#[test]
fn a_budget_prunes_the_oldest_versions_first_and_never_touches_the_live_tree() {
    let (_t, mut a, mut b) = two();
    set_folder(&b, "versions_max_mib", "2", false);
    write(&a.path("live.bin"), &noise(1_500_000, 50));
    a.start();
    b.start();
    wait_synced(&[&a, &b], 60);
    for i in 0..6u64 {
        write(&a.path("doc.bin"), &noise(700_000, 60 + i));
        wait_synced(&[&a, &b], 60);
    }
    // Five past versions of 700 kB each do not fit in 2 MiB: the oldest go.
    wait_for(30, "retention keeps B's versions within its budget", || {
        let st = b.status();
        st["folders"][0]["versions"]["bytes"].as_u64().unwrap() <= 2 << 20
            && contents(&b, "doc.bin")
                .iter()
                .filter(|c| *c == "pruned")
                .count()
                >= 2
    });
    let marks = contents(&b, "doc.bin");
    // Oldest first: every pruned version is older than every kept one.
    let last_pruned = marks.iter().rposition(|c| c == "pruned").unwrap();
    let first_kept = marks.iter().position(|c| c == "kept").unwrap();
    assert!(last_pruned < first_kept, "{marks:?}");
    assert_eq!(marks.last().map(String::as_str), Some("current"));
    assert_eq!(
        std::fs::read(b.path("live.bin")).unwrap(),
        noise(1_500_000, 50)
    );
    assert_eq!(
        std::fs::read(b.path("doc.bin")).unwrap(),
        noise(700_000, 65)
    );
    let pruned: Vec<serde_json::Value> = b
        .journal(&["--all"])
        .into_iter()
        .filter(|r| r["op"] == "pruned")
        .collect();
    assert!(pruned.len() >= 2, "{pruned:?}");
    assert!(pruned.iter().all(|r| r["path"] == "doc.bin"));
}

/// `(size, content mark)` of each version of `path` that `meshfs versions` lists, oldest first.
fn listed(d: &Device, path: &str) -> Vec<(u64, String)> {
    versions(d, path)["versions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| {
            (
                v["size"].as_u64().unwrap(),
                v["content"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// `MESHFS_TEST_CLOCK` for a daemon whose journal clock reads noon UTC of today plus `days`
/// (the daemon/src/clock.rs knob: days of retention in seconds of a test).
fn clock_at_day(noon: i64, days: i64) -> (String, String) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    (
        "MESHFS_TEST_CLOCK".to_string(),
        format!("offset={}s", noon + days * 86_400 - now),
    )
}

#[test]
fn past_versions_are_thinned_then_pruned_by_age_oldest_first_and_the_live_tree_is_never_touched() {
    let (_t, mut a, mut b) = two();
    // Each version of doc.bin a size of its own: the listing tells them apart by it.
    let v = |i: u64| noise(100_000 + i as usize * 1000, 300 + i);
    let size = |i: u64| 100_000 + i * 1000;
    write(&a.path("old.txt"), b"written once, long ago\n");
    write(&a.path("doc.bin"), &v(0));
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    // Noon of today (UTC): every version B keeps "on day 0" leaves in one hour of one day.
    let noon = now - now.rem_euclid(86_400) + 43_200;
    let at_day = |b: &mut Device, day: i64| {
        b.kill();
        b.env = vec![clock_at_day(noon, day)];
        b.start();
    };
    b.env = vec![clock_at_day(noon, 0)];
    a.start();
    b.start();
    wait_synced(&[&a, &b], 60);
    let old = std::fs::metadata(b.path("old.txt")).unwrap();
    let edit = |a: &Device, b: &Device, i: u64| {
        write(&a.path("doc.bin"), &v(i));
        wait_synced(&[a, b], 60);
    };
    let expect = |b: &Device, want: &[(u64, &str)], what: &str| {
        let want: Vec<(u64, String)> = want
            .iter()
            .map(|(i, m)| (size(*i), m.to_string()))
            .collect();
        let mut seen = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        while seen != want {
            assert!(
                Instant::now() < deadline,
                "never: {what}: listed {seen:?}\n{:#?}",
                b.journal(&["--all"])
            );
            std::thread::sleep(Duration::from_millis(50));
            seen = listed(b, "doc.bin");
        }
    };
    // Day 0: three edits within minutes. B keeps the three versions they replaced.
    for i in 1..=3 {
        edit(&a, &b, i);
    }
    expect(
        &b,
        &[(0, "kept"), (1, "kept"), (2, "kept"), (3, "current")],
        "day 0: every past version kept",
    );
    // Day 10: older than a day, the versions of day 0 are thinned to the last of that day;
    // the history rows of the ones that went go with them.
    at_day(&mut b, 10);
    expect(
        &b,
        &[(0, "pruned"), (2, "kept"), (3, "current")],
        "day 10: day 0 thinned to its last version",
    );
    edit(&a, &b, 4);
    // Day 20: another.
    at_day(&mut b, 20);
    edit(&a, &b, 5);
    expect(
        &b,
        &[
            (0, "pruned"),
            (2, "kept"),
            (3, "kept"),
            (4, "kept"),
            (5, "current"),
        ],
        "day 20: three past versions kept",
    );
    let count = |b: &Device| {
        b.status()["folders"][0]["versions"]["count"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(count(&b), 3);
    // Day 35: past 30 days, the oldest goes first; the next still restores byte-identical.
    // The history past 30 days keeps each path's newest row only: doc.bin's creation and the
    // rows of what was pruned are gone, old.txt's creation (its newest) stays.
    at_day(&mut b, 35);
    expect(
        &b,
        &[(3, "kept"), (4, "kept"), (5, "current")],
        "day 35: the version of day 0 pruned by age",
    );
    assert_eq!(count(&b), 2);
    let rows: Vec<String> = b
        .journal(&["--all"])
        .into_iter()
        .map(|r| {
            format!(
                "{} {} {}",
                r["op"].as_str().unwrap(),
                r["path"].as_str().unwrap(),
                r["size"]
            )
        })
        .collect();
    assert_eq!(
        rows,
        [
            "create old.txt 23".to_string(),
            format!("modify doc.bin {}", size(3)),
            format!("modify doc.bin {}", size(4)),
            format!("modify doc.bin {}", size(5)),
        ]
    );
    let seq = versions(&b, "doc.bin")["versions"][0]["sequence"]
        .as_u64()
        .unwrap()
        .to_string();
    b.cli_ok(&[
        "restore", "work", "doc.bin", "--seq", &seq, "--to", "v3.bin",
    ]);
    assert_eq!(std::fs::read(b.path("v3.bin")).unwrap(), v(3));
    wait_synced(&[&a, &b], 60);
    // Day 45, day 55: one more each time, oldest first, until none is left.
    at_day(&mut b, 45);
    expect(
        &b,
        &[(4, "kept"), (5, "current")],
        "day 45: the version of day 10 pruned",
    );
    assert_eq!(count(&b), 1);
    at_day(&mut b, 55);
    expect(
        &b,
        &[(5, "current")],
        "day 55: the version of day 20 pruned",
    );
    assert_eq!(count(&b), 0);
    wait_for(20, "the vault is empty", || {
        let st = b.status();
        st["folders"][0]["versions"]["bytes"] == 0
    });
    // The live tree, never: the file untouched since day 0 is the same file, unchanged.
    let still = std::fs::metadata(b.path("old.txt")).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!(
        (still.ino(), still.mtime_nsec(), still.ctime_nsec()),
        (old.ino(), old.mtime_nsec(), old.ctime_nsec())
    );
    assert_eq!(
        std::fs::read(b.path("old.txt")).unwrap(),
        b"written once, long ago\n"
    );
    assert_eq!(std::fs::read(b.path("doc.bin")).unwrap(), v(5));
    wait_synced(&[&a, &b], 60);
}

#[test]
fn a_device_alone_keeps_what_its_own_edits_and_deletions_outside_a_mount_replace_and_restores_it() {
    let t = tmp();
    let mut a = Device::new(&t, "a");
    write(&a.path("before.txt"), b"there before meshfs first ran\n");
    a.start();
    wait_synced(&[&a], 30);
    let held = |a: &Device| {
        a.status()["folders"][0]["versions"]["bytes"]
            .as_u64()
            .unwrap()
    };
    // Changes made as any program makes them (no mount, the watcher's path): each new version
    // is held ahead, so what the next change replaces is kept.
    let v1 = noise(300_000, 90);
    write(&a.path("notes.txt"), &v1);
    wait_for(20, "the first version held ahead", || held(&a) >= 300_000);
    let v2 = noise(200_000, 91);
    write(&a.path("notes.txt"), &v2);
    wait_for(20, "the overwritten version kept", || {
        contents(&a, "notes.txt") == ["kept", "current"]
    });
    let report = noise(1_500_000, 92);
    write(&a.path("docs/report.bin"), &report);
    wait_for(20, "the report held ahead", || held(&a) >= 2_000_000);
    std::fs::remove_dir_all(a.path("docs")).unwrap();
    wait_for(20, "the deleted report kept", || {
        contents(&a, "docs/report.bin") == ["kept", "none"]
    });
    // Both come back byte-identical, from this device alone.
    a.cli_ok(&["restore", "work", "notes.txt"]);
    a.cli_ok(&["restore", "work", "docs/report.bin"]);
    assert_eq!(std::fs::read(a.path("notes.txt")).unwrap(), v1);
    assert_eq!(std::fs::read(a.path("docs/report.bin")).unwrap(), report);
    // What the restore replaced is kept in its turn.
    wait_for(20, "the second version kept", || {
        contents(&a, "notes.txt")
            .iter()
            .filter(|c| *c == "kept")
            .count()
            == 1
            && contents(&a, "notes.txt").last().map(String::as_str) == Some("current")
    });
    // A file nobody changed since meshfs first scanned it was never held: its deletion is
    // listed, its content is not here (docs/decisions.md, D68).
    std::fs::remove_file(a.path("before.txt")).unwrap();
    wait_for(20, "the deletion listed", || {
        contents(&a, "before.txt") == ["not_here", "none"]
    });
}

#[test]
fn a_restore_killed_at_each_step_leaves_the_old_file_or_the_restored_one_never_a_partial() {
    let (_t, mut a, mut b) = two();
    let before = noise(900_000, 70);
    write(&a.path("f.bin"), &before);
    a.start();
    b.start();
    wait_synced(&[&a, &b], 60);
    let after = noise(800_000, 71);
    write(&a.path("f.bin"), &after);
    wait_synced(&[&a, &b], 60);
    wait_for(20, "B keeps the replaced version", || {
        contents(&b, "f.bin") == ["kept", "current"]
    });
    for point in ["restore.built", "restore.installed"] {
        b.stop();
        b.arm(&format!("{point}=abort"));
        b.start();
        // The daemon aborts in the middle of the request: the CLI sees it gone.
        let out = b.cli(&["restore", "work", "f.bin"]);
        assert!(!out.status.success(), "{point}: the restore went through");
        b.kill();
        let now = std::fs::read(b.path("f.bin")).unwrap();
        assert!(
            now == before || now == after,
            "a partial file after {point}"
        );
        b.env.clear();
        b.start();
        // Nothing the policy covers was lost: the version the restore replaced (when it got
        // that far) is kept as any replaced version, from the file the install had put aside.
        wait_for(20, "every past version is kept here", || {
            let marks = contents(&b, "f.bin");
            marks.iter().all(|c| c == "kept" || c == "current") && marks.iter().any(|c| c == "kept")
        });
    }
    // The install that went through before its crash is journaled and sent as a restore;
    // restoring again brings back the version it replaced, on both devices.
    wait_synced(&[&a, &b], 60);
    let now = std::fs::read(b.path("f.bin")).unwrap();
    let other = if now == before { &after } else { &before };
    b.cli_ok(&["restore", "work", "f.bin"]);
    wait_synced(&[&a, &b], 60);
    assert!(std::fs::read(a.path("f.bin")).unwrap() == *other);
    assert!(std::fs::read(b.path("f.bin")).unwrap() == *other);
}

#[test]
fn pruning_killed_between_its_steps_loses_no_version_the_policy_still_covers() {
    let (_t, mut a, mut b) = two();
    a.start();
    b.start();
    for i in 0..4u64 {
        write(&a.path("doc.bin"), &noise(700_000, 80 + i));
        wait_synced(&[&a, &b], 60);
    }
    wait_for(20, "B keeps three past versions", || {
        contents(&b, "doc.bin") == ["kept", "kept", "kept", "current"]
    });
    b.stop();
    // A budget of 1 MiB keeps the newest past version only; each start prunes at once.
    set_folder(&b, "versions_max_mib", "1", false);
    // Killed after the journal retired the versions, then after the vault dropped their
    // chunks but before that committed: each time, `versions` (which reads the disk, no daemon
    // needed) still finds the version the budget keeps, whole.
    for point in ["prune.retired", "vault.sweep_before_commit"] {
        b.arm(&format!("{point}=abort"));
        let status = b.run_to_exit(60);
        assert!(
            !status.success(),
            "{point}: the daemon was not stopped there"
        );
        let marks = contents(&b, "doc.bin");
        assert_eq!(marks, ["pruned", "pruned", "kept", "current"], "{point}");
    }
    b.env.clear();
    b.start();
    wait_for(30, "the budget holds", || {
        b.status()["folders"][0]["versions"]["bytes"]
            .as_u64()
            .unwrap()
            <= 1 << 20
    });
    assert_eq!(
        contents(&b, "doc.bin"),
        ["pruned", "pruned", "kept", "current"]
    );
    assert_eq!(
        std::fs::read(b.path("doc.bin")).unwrap(),
        noise(700_000, 83)
    );
    b.cli_ok(&["restore", "work", "doc.bin"]);
    wait_synced(&[&a, &b], 60);
    assert_eq!(
        std::fs::read(a.path("doc.bin")).unwrap(),
        noise(700_000, 82)
    );
}
