//! Files on demand (docs/decisions.md, D90–D94), with real daemons and a real FUSE mount: A
//! holds the files, B is on demand and works in its mount. B lists everything with true
//! sizes, modes and times and fetches nothing for it; an open fetches the file (verified); the
//! budget, pins and evictions keep what they say; offline, an open fails fast with
//! `EHOSTUNREACH` and `status` says why.

use crate::common;
use common::*;
use std::collections::BTreeMap;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// B: on demand (with `cache_max`, if any), mounted.
struct OnDemand {
    a: Device,
    b: Device,
    mnt: PathBuf,
}

/// A with `files` (path, content, mode), B on demand with `budget`, both started, B mounted
/// and caught up with A.
fn setup(
    t: &std::sync::Arc<tempfile::TempDir>,
    files: &[(&str, Vec<u8>, u32)],
    budget: Option<&str>,
) -> OnDemand {
    let mut set = vec!["--on-demand"];
    if let Some(max) = budget {
        set.extend(["--cache-max", max]);
    }
    setup_as(t, files, &set)
}

/// A with `files`, B on demand as `meshfs folder set work SET...` says, both started, B
/// mounted and caught up with A.
fn setup_as(
    t: &std::sync::Arc<tempfile::TempDir>,
    files: &[(&str, Vec<u8>, u32)],
    set_args: &[&str],
) -> OnDemand {
    let mut a = Device::new(t, "a");
    let mut b = Device::new(t, "b");
    for (path, data, mode) in files {
        let p = a.path(path);
        write(&p, data);
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(*mode)).unwrap();
    }
    set_work(&b.home, set_args);
    pair(&a, &b);
    Device::start_together(&mut [&mut a, &mut b]);
    let mnt = t.path().join("mnt-b");
    std::fs::create_dir_all(&mnt).unwrap();
    ok(&b.home, &["mount", "work", mnt.to_str().unwrap()]);
    let od = OnDemand { a, b, mnt };
    in_sync(&od.b, 60);
    in_sync(&od.a, 60);
    od
}

/// `n` files made by `file(i)`: (path, content).
fn numbered(n: u64, file: impl Fn(u64) -> (String, Vec<u8>)) -> Vec<(String, Vec<u8>)> {
    (0..n).map(file).collect()
}

/// `files` as [`setup`] takes them, mode 0644.
fn listed(files: &[(String, Vec<u8>)]) -> Vec<(&str, Vec<u8>, u32)> {
    files
        .iter()
        .map(|(p, d)| (p.as_str(), d.clone(), 0o644))
        .collect()
}

/// Waits until `d` says it is in sync with its connected peers (its tree is not compared: an
/// on-demand device's backing differs from its peers' by design).
fn in_sync(d: &Device, secs: u64) {
    let out = meshfs(
        &d.home,
        &[
            "status",
            "--wait-synced",
            "--connected",
            "--timeout",
            &secs.to_string(),
        ],
    );
    assert!(
        out.status.success(),
        "{} not in sync: {}{}\n{}",
        d.name,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        d.log()
    );
}

fn received(d: &Device) -> u64 {
    d.status()["bytes_received"].as_u64().unwrap()
}

fn on_demand(d: &Device) -> serde_json::Value {
    d.status()["folders"][0]["on_demand"].clone()
}

/// Bytes a directory tree takes on disk (st_blocks), and its files' sizes.
fn disk_use(root: &Path) -> (u64, u64) {
    let (mut blocks, mut sizes) = (0, 0);
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            if e.file_name().to_string_lossy().starts_with(".meshfs") {
                continue;
            }
            let md = std::fs::symlink_metadata(e.path()).unwrap();
            if md.is_dir() {
                stack.push(e.path());
            } else if md.is_file() {
                blocks += md.blocks() * 512;
                sizes += md.len();
            }
        }
    }
    (blocks, sizes)
}

/// `user.meshfs.state` of `p`.
fn state(p: &Path) -> String {
    let c = CString::new(p.as_os_str().as_bytes()).unwrap();
    let mut buf = [0u8; 64];
    // SAFETY: both pointers are valid for the call; `buf` is writable for its length.
    let n = unsafe {
        libc::getxattr(
            c.as_ptr(),
            c"user.meshfs.state".as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    assert!(
        n >= 0,
        "getxattr {}: {}",
        p.display(),
        std::io::Error::last_os_error()
    );
    String::from_utf8_lossy(&buf[..n as usize]).into_owned()
}

/// Every file below `root`: (size, mode, mtime) by path.
fn listing(root: &Path) -> BTreeMap<String, (u64, u32, i64)> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let rel = e
                .path()
                .strip_prefix(root)
                .unwrap()
                .to_string_lossy()
                .into_owned();
            if rel.starts_with(".meshfs") {
                continue;
            }
            let md = std::fs::symlink_metadata(e.path()).unwrap();
            if md.is_dir() {
                stack.push(e.path());
            } else {
                out.insert(rel, (md.len(), md.mode() & 0o7777, md.mtime()));
            }
        }
    }
    out
}

fn blake(data: &[u8]) -> String {
    blake3::hash(data).to_hex().to_string()
}

#[test]
fn an_on_demand_device_lists_every_file_truly_fetches_nothing_for_it_and_fetches_a_file_when_read()
{
    let t = tmp();
    let big = noise(6 << 20, 1);
    let files = vec![
        ("big.bin", big.clone(), 0o640),
        ("docs/a.txt", noise(300 << 10, 2), 0o644),
        ("docs/deep/b.txt", noise(90 << 10, 3), 0o600),
        ("docs/small.txt", b"a small file".to_vec(), 0o644),
        ("empty", Vec::new(), 0o644),
        ("edit.bin", noise(200 << 10, 4), 0o644),
        ("gone.bin", noise(150 << 10, 5), 0o644),
    ];
    let od = setup(&t, &files, None);
    // B's backing holds nearly nothing: placeholders, no data blocks.
    let (blocks, sizes) = disk_use(&od.b.dir);
    let total: u64 = files.iter().map(|f| f.1.len() as u64).sum();
    assert_eq!(sizes, total, "true sizes in the backing");
    assert!(
        blocks < total / 100,
        "backing uses {blocks} bytes of {total}"
    );
    // Listing and stat through the mount: true sizes, modes, times; nothing fetched.
    let before = received(&od.b);
    let theirs = listing(&od.a.dir);
    let ours = listing(&od.mnt);
    assert_eq!(ours, theirs, "ls -lR through B's mount is A's tree");
    for (path, _, _) in &files {
        let md = std::fs::metadata(od.mnt.join(path)).unwrap();
        if md.len() > 0 {
            assert_eq!(
                md.blocks(),
                0,
                "{path}: st_blocks counts what is local: nothing"
            );
            assert_eq!(state(&od.mnt.join(path)), "online", "{path}");
        }
    }
    let got = received(&od.b) - before;
    assert!(got < 64 << 10, "listing and stat received {got} bytes");
    assert_eq!(on_demand(&od.b)["fetched_files"], 0);
    // Read through the mount: the right content, fetched, and local from then on.
    let before = received(&od.b);
    let read = std::fs::read(od.mnt.join("big.bin")).unwrap();
    assert_eq!(blake(&read), blake(&big), "cat gives the right hash");
    let got = received(&od.b) - before;
    assert!(got >= big.len() as u64, "fetched: {got} bytes received");
    // The last read is served once its chunk is verified; the file is installed a moment
    // later (made durable first).
    until_state(&od.mnt.join("big.bin"), "local");
    let md = std::fs::metadata(od.mnt.join("big.bin")).unwrap();
    assert!(
        md.blocks() * 512 >= big.len() as u64,
        "st_blocks: all of it is local"
    );
    assert_eq!(
        std::fs::read(od.b.path("big.bin")).unwrap(),
        big,
        "the backing holds it"
    );
    // Read again: nothing more fetched.
    let before = received(&od.b);
    assert_eq!(std::fs::read(od.mnt.join("big.bin")).unwrap(), big);
    assert!(received(&od.b) - before < 64 << 10);
    let d = on_demand(&od.b);
    assert_eq!(d["fetched_files"], 1, "{d}");
    assert_eq!(d["local_bytes"], big.len() as u64, "{d}");
    // The fetch made no version: B's journal and A's still agree, and A changed nothing.
    in_sync(&od.b, 30);
    assert_eq!(listing(&od.mnt), theirs);
    // A renames it: B makes the new name from its local copy, fetching nothing, and it stays
    // local.
    let before = received(&od.b);
    std::fs::rename(od.a.path("big.bin"), od.a.path("moved.bin")).unwrap();
    in_sync(&od.a, 30);
    in_sync(&od.b, 30);
    assert_eq!(state(&od.mnt.join("moved.bin")), "local");
    assert!(
        received(&od.b) - before < 256 << 10,
        "a rename moved no content"
    );
    assert_eq!(std::fs::read(od.mnt.join("moved.bin")).unwrap(), big);
    std::fs::rename(od.a.path("moved.bin"), od.a.path("big.bin")).unwrap();
    in_sync(&od.a, 30);
    in_sync(&od.b, 30);
    // Every other file reads right through the mount.
    for (path, data, _) in files
        .iter()
        .filter(|f| !f.0.ends_with(".bin") || f.0 == "big.bin")
    {
        assert_eq!(std::fs::read(od.mnt.join(path)).unwrap(), *data, "{path}");
    }
    // An edit of a file that is not local keeps the bytes it did not touch: the open for
    // writing makes it whole first; the edit reaches A.
    let edited = {
        use std::io::{Seek, SeekFrom, Write};
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(od.mnt.join("edit.bin"))
            .unwrap();
        f.seek(SeekFrom::Start(1000)).unwrap();
        f.write_all(b"EDITED").unwrap();
        let mut want = files.iter().find(|f| f.0 == "edit.bin").unwrap().1.clone();
        want[1000..1006].copy_from_slice(b"EDITED");
        want
    };
    assert_eq!(std::fs::read(od.mnt.join("edit.bin")).unwrap(), edited);
    // A truncate to nothing needs no content.
    let before = received(&od.b);
    let c = CString::new(od.mnt.join("gone.bin").as_os_str().as_bytes()).unwrap();
    // SAFETY: a NUL-terminated path, valid for the call.
    let truncated = unsafe { libc::truncate(c.as_ptr(), 0) };
    assert_eq!(truncated, 0, "{}", std::io::Error::last_os_error());
    assert!(
        received(&od.b) - before < 64 << 10,
        "the truncate fetched nothing"
    );
    assert_eq!(std::fs::metadata(od.mnt.join("gone.bin")).unwrap().len(), 0);
    assert_eq!(state(&od.mnt.join("gone.bin")), "local");
    let t0 = Instant::now();
    while std::fs::read(od.a.path("edit.bin")).unwrap() != edited
        || std::fs::metadata(od.a.path("gone.bin")).unwrap().len() != 0
    {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the edits never reached A"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits until `user.meshfs.state` of `p` is `want`.
fn until_state(p: &Path, want: &str) {
    let t0 = Instant::now();
    while state(p) != want {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{}: {} instead of {want}",
            p.display(),
            state(p)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits until `what` holds of B's `on_demand` status.
fn until_status(b: &Device, secs: u64, what: &str, f: impl Fn(&serde_json::Value) -> bool) {
    let t0 = Instant::now();
    loop {
        let d = on_demand(b);
        if f(&d) {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(secs),
            "{what}: {d:#}\n{}",
            b.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn evict(b: &Device, path: &str) -> serde_json::Value {
    serde_json::from_str(&b.cli_ok(&["evict", "work", path, "--json"])).unwrap()
}

fn kept_why(report: &serde_json::Value, path: &str) -> String {
    report["kept"]
        .as_array()
        .unwrap()
        .iter()
        .find(|k| k["path"] == path)
        .map(|k| k["why"].as_str().unwrap().to_string())
        .unwrap_or_else(|| panic!("{path} not kept: {report:#}"))
}

#[test]
fn the_budget_holds_while_reading_and_pinned_open_and_unacknowledged_files_stay() {
    let t = tmp();
    const MIB: usize = 1 << 20;
    let mut files: Vec<(String, Vec<u8>, u32)> = (0..6)
        .map(|i| (format!("x/f{i}"), noise(3 * MIB, 10 + i as u64), 0o644))
        .collect();
    files.push(("keep/k0".into(), noise(3 * MIB, 20), 0o644));
    files.push(("keep/k1".into(), noise(3 * MIB, 21), 0o644));
    let refs: Vec<(&str, Vec<u8>, u32)> = files
        .iter()
        .map(|(p, d, m)| (p.as_str(), d.clone(), *m))
        .collect();
    let mut od = setup(&t, &refs, Some("8MiB"));
    let budget = 8u64 << 20;
    // Reading 18 MiB one file after another: the folder stays under 8 MiB, least recently
    // used first out.
    for (path, want, _) in files.iter().take(6) {
        let data = std::fs::read(od.mnt.join(path)).unwrap();
        assert_eq!(&data, want, "{path}");
        until_status(&od.b, 10, "under the budget after a read", |d| {
            d["local_bytes"].as_u64().unwrap() <= budget
        });
    }
    let (blocks, _) = disk_use(&od.b.dir);
    assert!(blocks <= budget + (1 << 20), "backing holds {blocks} bytes");
    assert_eq!(
        state(&od.mnt.join("x/f0")),
        "online",
        "read first, evicted first"
    );
    until_state(&od.mnt.join("x/f5"), "local");
    // A pin fetches now, and a pinned tree survives what the budget does.
    let pinned: serde_json::Value =
        serde_json::from_str(&od.b.cli_ok(&["pin", "work", "keep", "--json"])).unwrap();
    assert_eq!(pinned["fetched"], 2, "{pinned}");
    assert_eq!(state(&od.mnt.join("keep/k0")), "pinned");
    for i in 0..3 {
        std::fs::read(od.mnt.join(format!("x/f{i}"))).unwrap();
    }
    until_status(&od.b, 10, "only the pins and one more left", |d| {
        d["local_bytes"].as_u64().unwrap() <= budget
    });
    for k in ["keep/k0", "keep/k1"] {
        assert_eq!(state(&od.mnt.join(k)), "pinned", "{k} survived");
        assert_eq!(
            std::fs::read(od.b.path(k)).unwrap(),
            files.iter().find(|f| f.0 == k).unwrap().1
        );
    }
    let r = evict(&od.b, "keep");
    assert_eq!(r["evicted"].as_array().unwrap().len(), 0, "{r}");
    assert!(kept_why(&r, "keep/k0").contains("pinned"));
    // An open file survives the budget and `evict` (read whole through the open: local).
    let mut held = std::fs::File::open(od.mnt.join("x/f4")).unwrap();
    let mut whole = Vec::new();
    std::io::Read::read_to_end(&mut held, &mut whole).unwrap();
    assert_eq!(whole, files[4].1);
    until_state(&od.mnt.join("x/f4"), "local");
    // The mount shows the install at its rename, the journal (what `evict` and the budget
    // read) a moment later at its commit; on a loaded machine `evict` ran in between once and
    // found nothing to keep. Only the pins (6 MiB) were local before: wait for x/f4's 3 MiB.
    until_status(&od.b, 10, "x/f4 journaled as local", |d| {
        d["local_bytes"].as_u64().unwrap() >= 9 << 20
    });
    std::fs::read(od.mnt.join("x/f3")).unwrap();
    until_status(&od.b, 10, "over the budget: pins and an open file", |d| {
        d["over_budget"].as_u64().unwrap() > 0 || d["local_bytes"].as_u64().unwrap() <= budget
    });
    assert_eq!(state(&od.mnt.join("x/f4")), "local", "open: not evicted");
    let r = evict(&od.b, "x");
    assert_eq!(kept_why(&r, "x/f4"), "open through the mount");
    assert_eq!(state(&od.mnt.join("x/f4")), "local");
    drop(held);
    let r = evict(&od.b, "x/f4");
    assert_eq!(r["evicted"], serde_json::json!(["x/f4"]), "{r}");
    assert_eq!(state(&od.mnt.join("x/f4")), "online");
    assert_eq!(
        std::fs::read(od.mnt.join("x/f4")).unwrap(),
        files[4].1,
        "fetched again"
    );
    // Unpinned, a file may go; but not while its only other holder is offline, nor a change
    // made here that no peer has acknowledged.
    od.b.cli_ok(&["unpin", "work", "keep"]);
    od.a.stop();
    let r = evict(&od.b, "keep");
    assert_eq!(r["evicted"].as_array().unwrap().len(), 0, "{r}");
    let kept = r["kept"].as_array().unwrap().clone();
    assert!(!kept.is_empty(), "{r}");
    for k in &kept {
        assert!(k["why"].as_str().unwrap().contains("last copy"), "{r}");
    }
    write(&od.mnt.join("mine.txt"), &noise(100 << 10, 30));
    let t0 = Instant::now();
    let r = loop {
        let r = evict(&od.b, "mine.txt");
        if r["kept"]
            .as_array()
            .unwrap()
            .iter()
            .any(|k| k["path"] == "mine.txt")
        {
            break r;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "mine.txt never journaled: {r}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(kept_why(&r, "mine.txt").contains("acknowledged"), "{r}");
    od.a.start();
    // Once A has it, it may go, and it comes back whole.
    in_sync(&od.b, 30);
    in_sync(&od.a, 30);
    let r = evict(&od.b, "keep");
    assert_eq!(r["evicted"].as_array().unwrap().len(), kept.len(), "{r}");
    let r = evict(&od.b, "mine.txt");
    assert_eq!(r["evicted"], serde_json::json!(["mine.txt"]), "{r}");
    assert_eq!(
        std::fs::read(od.mnt.join("mine.txt")).unwrap(),
        noise(100 << 10, 30)
    );
}

fn open_errno(p: &Path) -> Option<i32> {
    match std::fs::File::open(p) {
        Ok(_) => None,
        Err(e) => Some(e.raw_os_error().unwrap_or(0)),
    }
}

#[test]
fn offline_an_open_fails_within_seconds_with_ehostunreach_and_status_says_why_then_succeeds() {
    let t = tmp();
    let data = noise(2 << 20, 40);
    let mut od = setup(&t, &[("far.bin", data.clone(), 0o644)], None);
    let path = od.mnt.join("far.bin");
    // Killed: its connection is not closed, B learns it is gone only by the silence.
    od.a.kill();
    let t0 = Instant::now();
    let errno = open_errno(&path);
    let took = t0.elapsed();
    eprintln!("offline open (peer killed) failed in {took:?}");
    assert_eq!(errno, Some(libc::EHOSTUNREACH), "{}", od.b.log());
    assert!(
        took < Duration::from_secs(5),
        "the open failed after {took:?}"
    );
    let d = on_demand(&od.b);
    let u = &d["unavailable"][0];
    assert_eq!(u["path"], "far.bin", "{d:#}");
    assert_eq!(u["errno"], "EHOSTUNREACH");
    let human = od.b.cli_ok(&["status"]);
    assert!(
        human.contains("could not fetch far.bin (EHOSTUNREACH)"),
        "{human}"
    );
    // Once the connection is gone too: at once.
    let t0 = Instant::now();
    until_status(&od.b, 60, "A seen offline", |_| {
        od.b.status()["peers"][0]["connected"] == false
    });
    let t1 = Instant::now();
    assert_eq!(open_errno(&path), Some(libc::EHOSTUNREACH));
    assert!(
        t1.elapsed() < Duration::from_secs(1),
        "offline known: {:?}",
        t1.elapsed()
    );
    let _ = t0;
    // A back: the same open succeeds and gives the content.
    od.a.start();
    until_status(&od.b, 30, "A connected again", |_| {
        od.b.status()["peers"][0]["connected"] == true
    });
    match std::fs::read(&path) {
        Ok(got) => assert!(got == data, "far.bin read back wrong"),
        Err(e) => panic!(
            "A back, the open failed: {e}\nB:\n{}\nA:\n{}",
            od.b.log(),
            od.a.log()
        ),
    }
    // Listed until the file is installed, a moment after its last read.
    until_status(&od.b, 10, "no longer listed as unavailable", |d| {
        d["unavailable"].as_array().unwrap().is_empty()
    });
}

#[test]
fn a_crash_right_after_a_placeholder_is_installed_is_completed_at_restart_and_the_file_still_opens()
{
    let t = tmp();
    let mut a = Device::new(&t, "a");
    let mut b = Device::new(&t, "b");
    let data = noise(1 << 20, 50);
    write(&a.path("far.bin"), &data);
    set_work(&b.home, &["--on-demand"]);
    pair(&a, &b);
    // Killed between the rename of the placeholder into place and the journal's commit.
    b.arm("install.after_rename@far.bin=abort");
    a.start();
    let status = b.run_to_exit(30);
    assert!(!status.success(), "b died at the failpoint");
    assert!(
        is_placeholder(&b.path("far.bin")),
        "the placeholder is in place"
    );
    b.env.clear();
    b.start();
    in_sync(&b, 30);
    let d = on_demand(&b);
    assert_eq!(d["online_files"], 1, "journaled as not local: {d:#}");
    assert!(
        !b.log().contains("kept changing"),
        "no rescan loop over the placeholder"
    );
    let mnt = t.path().join("mnt-b");
    std::fs::create_dir_all(&mnt).unwrap();
    ok(&b.home, &["mount", "work", mnt.to_str().unwrap()]);
    assert_eq!(std::fs::read(mnt.join("far.bin")).unwrap(), data);
    // Nothing of it became a version of B's: A's journal has the one it made.
    assert_eq!(a.journal(&["--path", "far.bin"]).len(), 1);
}

/// Whether `p` carries the placeholder mark.
fn is_placeholder(p: &Path) -> bool {
    let c = CString::new(p.as_os_str().as_bytes()).unwrap();
    // SAFETY: a NUL-terminated path and a null buffer of size 0 (asks the value's size).
    let n = unsafe {
        libc::getxattr(
            c.as_ptr(),
            c"user.meshfs.placeholder".as_ptr(),
            std::ptr::null_mut(),
            0,
        )
    };
    n == 32
}

#[test]
fn a_concurrent_edit_of_a_file_that_is_not_local_keeps_both_versions_on_both_devices() {
    let t = tmp();
    let mut od = setup(&t, &[("c.txt", noise(80 << 10, 60), 0o644)], None);
    assert_eq!(state(&od.mnt.join("c.txt")), "online");
    // Apart: B empties it (no fetch needed), A writes a new version.
    od.a.stop();
    let c = CString::new(od.mnt.join("c.txt").as_os_str().as_bytes()).unwrap();
    // SAFETY: a NUL-terminated path, valid for the call.
    let truncated = unsafe { libc::truncate(c.as_ptr(), 0) };
    assert_eq!(truncated, 0, "{}", std::io::Error::last_os_error());
    let theirs = noise(70 << 10, 61);
    std::thread::sleep(Duration::from_millis(1100));
    write(&od.a.path("c.txt"), &theirs);
    od.a.start();
    in_sync(&od.a, 60);
    in_sync(&od.b, 60);
    let names = |root: &Path| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(root)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| !n.starts_with(".meshfs"))
            .collect();
        v.sort();
        v
    };
    let t0 = Instant::now();
    while names(&od.mnt).len() < 2 || names(&od.a.dir).len() < 2 {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "no conflict copy: {:?} {:?}",
            names(&od.mnt),
            names(&od.a.dir)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(names(&od.mnt), names(&od.a.dir));
    let mut got: Vec<Vec<u8>> = names(&od.mnt)
        .iter()
        .map(|n| std::fs::read(od.mnt.join(n)).unwrap())
        .collect();
    got.sort();
    assert_eq!(got, vec![Vec::new(), theirs.clone()], "both versions, on B");
    let mut on_a: Vec<Vec<u8>> = names(&od.a.dir)
        .iter()
        .map(|n| std::fs::read(od.a.path(n)).unwrap())
        .collect();
    on_a.sort();
    assert_eq!(on_a, vec![Vec::new(), theirs], "both versions, on A");
}

#[test]
fn a_folder_set_back_from_on_demand_fetches_what_is_not_local_and_is_whole_again() {
    let t = tmp();
    let files = vec![
        ("one.bin", noise(500 << 10, 70), 0o644),
        ("d/two.bin", noise(300 << 10, 71), 0o644),
    ];
    let od = setup(&t, &files, Some("100MiB"));
    assert_eq!(on_demand(&od.b)["online_files"], 2);
    od.b.cli_ok(&["folder", "set", "work", "--no-on-demand"]);
    let t0 = Instant::now();
    while tree(&od.b.dir) != tree(&od.a.dir) {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "not whole: {:#?}\n{}",
            tree(&od.b.dir),
            od.b.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(od.b.status()["folders"][0]["on_demand"].is_null());
    for (path, data, _) in &files {
        assert_eq!(state(&od.mnt.join(path)), "local", "{path}");
        assert_eq!(std::fs::read(od.b.path(path)).unwrap(), *data);
    }
    // A new file from A is fetched as it arrives.
    write(&od.a.path("three.bin"), &noise(100 << 10, 72));
    wait_synced(&[&od.a, &od.b], 30);
}

/// Runs `cmd` and says whether it succeeded, with its output.
fn run(cmd: &str, args: &[&str]) -> (bool, Vec<u8>) {
    let out = std::process::Command::new(cmd).args(args).output().unwrap();
    (out.status.success(), out.stdout)
}

#[test]
fn a_reader_of_a_file_not_local_is_served_each_range_once_it_is_verified_not_the_whole_file_first()
{
    let t = tmp();
    const MIB: usize = 1 << 20;
    let big = noise(64 * MIB, 80);
    let od = setup(&t, &[("big.bin", big.clone(), 0o644)], None);
    let path = od.mnt.join("big.bin");
    let p = path.to_str().unwrap();
    // The first 4 KiB: the chunk under them, not the file. Chunks of a 64 MiB file are at most
    // 256 KiB (`chunker::chunk_sizes`).
    let before = received(&od.b);
    let (ok_, head) = run("head", &["-c", "4096", p]);
    assert!(ok_);
    assert_eq!(head, big[..4096], "head -c 4096");
    let got = received(&od.b) - before;
    eprintln!("head -c 4096 of 64 MiB not local: {got} bytes received");
    assert!(got <= 2 * (256 << 10), "head received {got} bytes");
    // A read in the middle is served before the whole file arrives; status shows the open
    // file being fetched, for this process.
    let before = received(&od.b);
    let mid = 40 * MIB + 12345;
    {
        use std::io::{Read, Seek, SeekFrom};
        let mut f = std::fs::File::open(&path).unwrap();
        f.seek(SeekFrom::Start(mid as u64)).unwrap();
        let mut buf = vec![0u8; 64 << 10];
        f.read_exact(&mut buf).unwrap();
        assert_eq!(buf, big[mid..mid + (64 << 10)], "the middle");
        let d = on_demand(&od.b);
        assert_eq!(d["fetching"][0]["path"], "big.bin", "{d:#}");
        // SAFETY: gettid has no preconditions. FUSE names the calling thread.
        let tid = unsafe { libc::gettid() };
        assert_eq!(d["fetching"][0]["pid"], tid, "{d:#}");
        assert_eq!(state(&path), "fetching");
    }
    let got = received(&od.b) - before;
    eprintln!("64 KiB from the middle: {got} bytes received");
    assert!(got < 2 * MIB as u64, "the middle received {got} bytes");
    // Closed before it was whole: nothing is installed, and nothing more is fetched.
    until_status(&od.b, 10, "the partial fetch dropped", |d| {
        d["fetching"].as_array().unwrap().is_empty()
    });
    assert_eq!(state(&path), "online");
    // Two processes read it at once, whole: both get the right bytes, from one fetch.
    let before = received(&od.b);
    let theirs = od.a.path("big.bin");
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (mine, theirs) = (path.clone(), theirs.clone());
            std::thread::spawn(move || {
                run("cmp", &[mine.to_str().unwrap(), theirs.to_str().unwrap()])
            })
        })
        .collect();
    for r in readers {
        let (same, out) = r.join().unwrap();
        assert!(same, "cmp: {}", String::from_utf8_lossy(&out));
    }
    let got = received(&od.b) - before;
    assert!(
        got < big.len() as u64 + big.len() as u64 / 4,
        "two readers fetched it once: {got} bytes received"
    );
    until_state(&path, "local");
    let before = received(&od.b);
    assert_eq!(blake(&std::fs::read(&path).unwrap()), blake(&big), "cat");
    assert!(
        received(&od.b) - before < 64 << 10,
        "local: nothing fetched"
    );
    assert_eq!(std::fs::read(od.b.path("big.bin")).unwrap(), big, "backing");
    assert_eq!(on_demand(&od.b)["fetched_files"], 1);
}

#[test]
fn a_peer_killed_mid_stream_fails_the_read_never_with_zeros_and_a_read_once_it_is_back_succeeds() {
    use std::io::{Read, Seek, SeekFrom};
    let t = tmp();
    const MIB: usize = 1 << 20;
    let big = noise(16 * MIB, 81);
    let mut od = setup(&t, &[("big.bin", big.clone(), 0o644)], None);
    let mut f = std::fs::File::open(od.mnt.join("big.bin")).unwrap();
    let mut buf = vec![0u8; 4096];
    f.read_exact(&mut buf).unwrap();
    assert_eq!(buf, big[..4096]);
    // Killed: its connection is not closed; the read of a range not here fails once the
    // connection has been silent for the stall time.
    od.a.kill();
    let at = 10 * MIB;
    f.seek(SeekFrom::Start(at as u64)).unwrap();
    let mut buf = vec![0u8; 256 << 10];
    let t0 = Instant::now();
    let e = f.read(&mut buf).unwrap_err();
    eprintln!(
        "read with the peer killed failed in {:?}: {e}",
        t0.elapsed()
    );
    assert_eq!(e.raw_os_error(), Some(libc::EHOSTUNREACH), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(5));
    let d = on_demand(&od.b);
    assert_eq!(d["unavailable"][0]["path"], "big.bin", "{d:#}");
    // Back: the same open reads the same range, right.
    od.a.start();
    until_status(&od.b, 30, "A connected again", |_| {
        od.b.status()["peers"][0]["connected"] == true
    });
    f.seek(SeekFrom::Start(at as u64)).unwrap();
    f.read_exact(&mut buf).unwrap();
    assert_eq!(buf, big[at..at + buf.len()], "after the peer returned");
    // And the rest of it, to the end.
    let mut rest = Vec::new();
    f.seek(SeekFrom::Start(0)).unwrap();
    f.read_to_end(&mut rest).unwrap();
    assert_eq!(blake(&rest), blake(&big));
    drop(f);
    until_state(&od.mnt.join("big.bin"), "local");
    until_status(&od.b, 10, "no longer listed as unavailable", |d| {
        d["unavailable"].as_array().unwrap().is_empty()
    });
}

#[test]
fn a_file_is_fetched_from_every_connected_peer_that_holds_it_at_once() {
    let t = tmp();
    const MIB: usize = 1 << 20;
    let big = noise(64 * MIB, 90);
    let mut a = Device::new(&t, "a");
    let mut b = Device::new(&t, "b");
    let mut c = Device::new(&t, "c");
    write(&a.path("big.bin"), &big);
    set_work(&b.home, &["--on-demand"]);
    pair(&a, &b);
    pair(&a, &c);
    pair(&b, &c);
    Device::start_together(&mut [&mut a, &mut b, &mut c]);
    wait_synced(&[&a, &c], 60);
    in_sync(&b, 60);
    until_status(&b, 30, "A and C connected to B", |_| {
        let s = b.status();
        s["peers"]
            .as_array()
            .unwrap()
            .iter()
            .all(|p| p["connected"] == true)
    });
    let from = |name: &str| -> u64 {
        b.status()["peers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == name)
            .unwrap()["bytes_received"]
            .as_u64()
            .unwrap()
    };
    let (a0, c0) = (from("a"), from("c"));
    // A pin wants the whole file: its pieces go to both peers at once.
    let pinned: serde_json::Value =
        serde_json::from_str(&b.cli_ok(&["pin", "work", "big.bin", "--json"])).unwrap();
    assert_eq!(pinned["fetched"], 1, "{pinned}");
    let (from_a, from_c) = (from("a") - a0, from("c") - c0);
    eprintln!("64 MiB pinned: {from_a} bytes from A, {from_c} from C");
    assert!(
        from_a >= 16 * MIB as u64 && from_c >= 16 * MIB as u64,
        "both gave part of it: {from_a} from A, {from_c} from C"
    );
    assert!(from_a + from_c < 80 * MIB as u64, "fetched once");
    assert_eq!(std::fs::read(b.path("big.bin")).unwrap(), big);
}

#[test]
fn the_disk_is_kept_above_its_free_floor_by_evicting_the_least_recently_used_files() {
    let t = tmp();
    const MIB: u64 = 1 << 20;
    let disk = t.path().join("small-disk");
    let _small = SmallDisk::mount(&disk, 64);
    let mut a = Device::new(&t, "a");
    let mut b = Device::with_replica(&t, "b", disk.join("replica"));
    let files: Vec<(String, Vec<u8>)> = (0..4)
        .map(|i| (format!("f{i}"), noise(12 << 20, 100 + i)))
        .collect();
    for (p, d) in &files {
        write(&a.path(p), d);
    }
    ok(
        &b.home,
        &[
            "folder",
            "set",
            "work",
            "--on-demand",
            "--min-free",
            "32MiB",
        ],
    );
    pair(&a, &b);
    Device::start_together(&mut [&mut a, &mut b]);
    let mnt = t.path().join("mnt-b");
    std::fs::create_dir_all(&mnt).unwrap();
    ok(&b.home, &["mount", "work", mnt.to_str().unwrap()]);
    in_sync(&b, 60);
    let d = on_demand(&b);
    assert_eq!(d["min_free_bytes"], 32 * MIB, "{d:#}");
    assert_eq!(d["min_free"], "32MiB", "{d:#}");
    // 48 MiB read one after another on a 64 MiB disk that keeps 32 MiB free: the least
    // recently read files leave as the next ones arrive.
    for (p, want) in &files {
        assert_eq!(&std::fs::read(mnt.join(p)).unwrap(), want, "{p}");
        until_state(&mnt.join(p), "local");
        until_status(&b, 20, "the disk above its free floor", |d| {
            d["disk_free_bytes"].as_u64().unwrap() >= d["min_free_bytes"].as_u64().unwrap()
        });
    }
    assert_eq!(
        state(&mnt.join("f0")),
        "online",
        "read first, evicted first"
    );
    assert_eq!(state(&mnt.join("f3")), "local", "read last, kept");
    assert!(on_demand(&b)["evicted_files"].as_u64().unwrap() >= 2);
    // Evicted, it comes back whole when read again.
    assert_eq!(std::fs::read(mnt.join("f0")).unwrap(), files[0].1);
}

#[test]
fn a_file_not_local_whose_chunks_this_device_holds_elsewhere_fetches_only_what_it_lacks() {
    let t = tmp();
    const MIB: usize = 1 << 20;
    let big = noise(16 * MIB, 81);
    let od = setup(&t, &[("big.bin", big.clone(), 0o644)], None);
    // B makes big.bin local; then A writes a copy of it with 64 KiB changed in the middle.
    let (same, _) = run(
        "cmp",
        &[
            od.mnt.join("big.bin").to_str().unwrap(),
            od.a.path("big.bin").to_str().unwrap(),
        ],
    );
    assert!(same);
    until_state(&od.mnt.join("big.bin"), "local");
    let mut edited = big.clone();
    edited[8 * MIB..8 * MIB + (64 << 10)].copy_from_slice(&noise(64 << 10, 82));
    write(&od.a.path("edited.bin"), &edited);
    in_sync(&od.a, 60);
    in_sync(&od.b, 60);
    let path = od.mnt.join("edited.bin");
    assert_eq!(state(&path), "online");
    let before = received(&od.b);
    // Made whole by a pin: it waits for the lookup of local copies before it asks the network
    // for anything. (A sequential reader such as `cat` also gets each chunk it waits for while
    // the lookup runs, D98: how many depends on how long the lookup takes, which on a loaded CI
    // machine was 2.4 MB worth; here, 245 KB.)
    let pinned: serde_json::Value =
        serde_json::from_str(&od.b.cli_ok(&["pin", "work", "edited.bin", "--json"])).unwrap();
    assert_eq!(pinned["fetched"], 1, "{pinned}");
    let got = received(&od.b) - before;
    eprintln!("16 MiB, 64 KiB of it new: {got} bytes received");
    // The changed chunks (chunks of a 16 MiB file are at most 256 KiB): not the file.
    assert!(got < MIB as u64, "{got} bytes received for 64 KiB changed");
    assert_eq!(state(&path), "pinned");
    assert_eq!(blake(&std::fs::read(&path).unwrap()), blake(&edited), "cat");
    assert_eq!(std::fs::read(od.b.path("edited.bin")).unwrap(), edited);
}

#[test]
fn a_change_only_another_on_demand_device_has_acknowledged_is_not_evicted_and_gets_no_inline_content(
) {
    let t = tmp();
    // 200 small files: content a batch would attach to its records (≤ 64 KiB a file).
    let files = numbered(200, |i| (format!("s/f{i:03}"), noise(8 << 10, 1000 + i)));
    let mut od = setup(&t, &listed(&files), None);
    // C: a second on-demand device.
    let mut c = third(&t, &mut od, &["--on-demand"]);
    // The small files reached C without their content attached: C's hello said it keeps only
    // part of the folder (D99), so their 1.6 MB would only be dropped for placeholders.
    let got = received(&c);
    eprintln!("C, on demand, received {got} bytes for 200 records of 8 KiB files");
    assert!(got < 800 << 10, "C received {got} bytes: content attached");
    let m = std::fs::metadata(c.path("s/f000")).unwrap();
    assert_eq!((m.len(), m.blocks()), (8 << 10, 0), "a placeholder on C");
    // A goes away; B writes a file. C (on demand) acknowledges it, holding no content.
    od.a.stop();
    let mine = noise(300 << 10, 84);
    write(&od.mnt.join("mine.bin"), &mine);
    let t0 = Instant::now();
    let r = loop {
        in_sync(&od.b, 30);
        in_sync(&c, 30);
        let r = evict(&od.b, "mine.bin");
        if r["kept"]
            .as_array()
            .unwrap()
            .iter()
            .any(|k| k["path"] == "mine.bin")
            || r["evicted"] == serde_json::json!(["mine.bin"])
        {
            break r;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "mine.bin never journaled: {r}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        kept_why(&r, "mine.bin").contains("acknowledged"),
        "C's acknowledgement counted as a copy: {r}"
    );
    assert_eq!(state(&od.mnt.join("mine.bin")), "local");
    // A back: A holds it, so it may go, and it comes back whole.
    od.a.start();
    in_sync(&od.b, 30);
    in_sync(&od.a, 30);
    let r = evict(&od.b, "mine.bin");
    assert_eq!(r["evicted"], serde_json::json!(["mine.bin"]), "{r}");
    assert_eq!(std::fs::read(od.mnt.join("mine.bin")).unwrap(), mine);
    c.stop();
}

#[test]
fn the_least_recently_used_order_survives_a_restart() {
    let t = tmp();
    let files = numbered(4, |i| (format!("x/f{i}"), noise(1 << 20, 90 + i)));
    let mut od = setup(&t, &listed(&files), Some("3MiB"));
    // Used in the order f2, f0, f1: f2 is the least recently used, though its version was
    // journaled after f0's and f1's.
    for i in [2, 0, 1] {
        assert_eq!(
            std::fs::read(od.mnt.join(format!("x/f{i}"))).unwrap(),
            files[i].1
        );
        until_state(&od.mnt.join(format!("x/f{i}")), "local");
    }
    // The uses are written at the budget's next round (after each fetch); then B restarts.
    std::thread::sleep(Duration::from_millis(500));
    ok(&od.b.home, &["unmount", "work"]);
    od.b.stop();
    od.b.start();
    in_sync(&od.b, 30);
    ok(&od.b.home, &["mount", "work", od.mnt.to_str().unwrap()]);
    // A fourth file read: the budget (3 MiB) lets one go, the least recently used.
    assert_eq!(std::fs::read(od.mnt.join("x/f3")).unwrap(), files[3].1);
    until_state(&od.mnt.join("x/f3"), "local");
    until_state(&od.mnt.join("x/f2"), "online");
    for i in [0, 1, 3] {
        assert_eq!(state(&od.mnt.join(format!("x/f{i}"))), "local", "x/f{i}");
    }
}

#[test]
fn a_file_closed_before_it_was_whole_keeps_what_was_fetched_for_a_reader_that_comes_back() {
    let t = tmp();
    const MIB: usize = 1 << 20;
    let big = noise(32 * MIB, 85);
    let od = setup(&t, &[("big.bin", big.clone(), 0o644)], None);
    let path = od.mnt.join("big.bin");
    // One read of the first 4 KiB (no read-ahead: not a sequential reader), then close.
    let peek = |what: &str| {
        use std::io::Read;
        let before = received(&od.b);
        let mut buf = vec![0u8; 4096];
        std::fs::File::open(&path)
            .unwrap()
            .read_exact(&mut buf)
            .unwrap();
        assert_eq!(buf, big[..4096], "{what}");
        received(&od.b) - before
    };
    let first = peek("first");
    // Closed: nothing is fetched for it, nothing is listed, and a reopen finds what was here.
    until_status(&od.b, 10, "no fetch listed", |d| {
        d["fetching"].as_array().unwrap().is_empty()
    });
    assert_eq!(state(&path), "online");
    let again = peek("again");
    eprintln!("4 KiB of 32 MiB not local: {first} bytes received, reopened: {again}");
    assert!(first >= 4096, "{first}");
    assert!(
        again < 4096,
        "a reopen fetched {again} bytes again (first: {first})"
    );
    // Left alone past the linger, what was fetched is dropped: a reopen fetches again.
    let t0 = Instant::now();
    while !od.b.log().contains("what was fetched of it is dropped") {
        assert!(t0.elapsed() < Duration::from_secs(30), "never dropped");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(peek("after the linger") >= 4096);
}

/// Waits until B's backing file `path` holds `want`, as a plain local file.
fn until_local(od: &OnDemand, path: &str, want: &[u8]) {
    let t0 = Instant::now();
    let p = od.b.path(path);
    while is_placeholder(&p) || std::fs::read(&p).ok().as_deref() != Some(want) {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{path} not local on B\n{}",
            od.b.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn only_a_subtree_on_demand_leaves_placeholders_there_and_keeps_everything_else_local() {
    let t = tmp();
    let files = vec![
        ("big/a.bin", noise(400 << 10, 90), 0o644),
        ("big/deep/b.bin", noise(300 << 10, 91), 0o644),
        ("small/c.txt", noise(200 << 10, 92), 0o644),
        ("top.bin", noise(100 << 10, 93), 0o644),
    ];
    let mut od = setup_as(&t, &files, &["--on-demand-under", "./big/"]);
    // Inside big/: placeholders. Outside: the content, in B's backing directory.
    for (path, data, _) in &files {
        if path.starts_with("big/") {
            assert!(is_placeholder(&od.b.path(path)), "{path}: a placeholder");
        } else {
            until_local(&od, path, data);
        }
    }
    let d = on_demand(&od.b);
    assert_eq!(d["under"], serde_json::json!(["big"]), "{d:#}");
    assert_eq!(d["online_files"], 2, "{d:#}");
    let text = od.b.cli_ok(&["status"]);
    assert!(
        text.contains("on demand only under: big (the rest is kept here)"),
        "{text}"
    );
    // Listing the mount fetches nothing; reading inside big/ fetches that file.
    let before = received(&od.b);
    assert_eq!(listing(&od.mnt), listing(&od.a.dir));
    assert!(
        received(&od.b) - before < 64 << 10,
        "listing fetched content"
    );
    assert_eq!(state(&od.mnt.join("big/deep/b.bin")), "online");
    assert_eq!(std::fs::read(od.mnt.join("big/a.bin")).unwrap(), files[0].1);
    // Eviction never touches what lies outside; inside it does.
    let r = evict(&od.b, "small");
    assert_eq!(r["evicted"], serde_json::json!([]), "{r}");
    assert!(kept_why(&r, "small/c.txt").contains("outside"), "{r}");
    let r = evict(&od.b, "big/a.bin");
    assert_eq!(r["evicted"], serde_json::json!(["big/a.bin"]), "{r}");
    // New versions from A: outside, fetched as they arrive; inside, placeholders.
    let fresh = noise(150 << 10, 94);
    write(&od.a.path("new/n.bin"), &fresh);
    write(&od.a.path("big/n2.bin"), &noise(120 << 10, 95));
    until_local(&od, "new/n.bin", &fresh);
    let t0 = Instant::now();
    while !od.b.path("big/n2.bin").exists() {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "big/n2.bin never came"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(is_placeholder(&od.b.path("big/n2.bin")));
    // The subtree narrowed later: what moved outside it is fetched now.
    od.b.cli_ok(&["folder", "set", "work", "--on-demand-under", "big/deep"]);
    until_local(&od, "big/a.bin", &files[0].1);
    until_local(&od, "big/n2.bin", &noise(120 << 10, 95));
    assert!(is_placeholder(&od.b.path("big/deep/b.bin")));
    assert_eq!(on_demand(&od.b)["under"], serde_json::json!(["big/deep"]));
    // And the whole folder on demand again: nothing is fetched, the list is gone.
    od.b.cli_ok(&["folder", "set", "work", "--on-demand"]);
    until_status(&od.b, 10, "the whole folder on demand", |d| {
        d["under"] == serde_json::json!([])
    });
    assert!(is_placeholder(&od.b.path("big/deep/b.bin")));
    // Changed while B was stopped: what is outside is fetched once B is back with its peer.
    od.b.stop();
    ok(
        &od.b.home,
        &["folder", "set", "work", "--on-demand-under", "big/a.bin"],
    );
    od.b.start();
    until_local(&od, "big/deep/b.bin", &files[1].1);
}

#[test]
fn a_file_not_local_renamed_over_another_through_the_mount_is_a_rename_on_every_device() {
    let t = tmp();
    let (x, y) = (noise(300 << 10, 110), noise(200 << 10, 111));
    let od = setup(
        &t,
        &[("x.bin", x.clone(), 0o644), ("y.bin", y.clone(), 0o644)],
        None,
    );
    assert_eq!(state(&od.mnt.join("x.bin")), "online");
    assert_eq!(state(&od.mnt.join("y.bin")), "online");
    // On B, x.bin (not local) replaces y.bin (not local either), as an editor's save does.
    std::fs::rename(od.mnt.join("x.bin"), od.mnt.join("y.bin")).unwrap();
    let t0 = Instant::now();
    while std::fs::read(od.a.path("y.bin")).ok().as_deref() != Some(x.as_slice())
        || od.a.path("x.bin").exists()
    {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the rename never reached A: {:#?}\n{}",
            tree(&od.a.dir),
            od.b.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    in_sync(&od.b, 30);
    in_sync(&od.a, 30);
    // B's journal has it, and the mount reads it.
    let rows = od.b.journal(&["--path", "y.bin"]);
    let last = rows.last().unwrap();
    assert_eq!(
        last["source"],
        serde_json::Value::Null,
        "B's own change: {last}"
    );
    assert_eq!(std::fs::read(od.mnt.join("y.bin")).unwrap(), x);
}

/// A conflict with a version B holds only as a placeholder, whose holder (C) then overwrote it:
/// B fetches its local version before keeping it as a sibling, so no device is left with a
/// sibling whose content no peer holds; once C's newer version reaches it, the three agree
/// (D101).
#[test]
fn a_conflict_with_a_version_not_local_here_whose_holder_overwrote_it_ends_in_one_tree_everywhere()
{
    let t = tmp();
    let mut od = setup(&t, &[("f.txt", noise(40 << 10, 90), 0o644)], None);
    // C: a full device.
    let mut c = third(&t, &mut od, &[]);
    in_sync(&od.b, 60);
    let t0 = Instant::now();
    while std::fs::read(c.path("f.txt")).ok() != Some(noise(40 << 10, 90)) {
        assert!(t0.elapsed() < Duration::from_secs(20), "C never had V1");
        std::thread::sleep(Duration::from_millis(50));
    }
    od.a.stop();
    // Without A: C writes V2 (41 KiB), which B takes as a placeholder.
    write(&c.path("f.txt"), &noise(41 << 10, 91));
    journaled(&od.b, "f.txt", 41 << 10);
    in_sync(&od.b, 30);
    assert!(is_placeholder(&od.b.path("f.txt")));
    // B goes; C overwrites V2 with V4: V2's content is nowhere now.
    ok(&od.b.home, &["unmount", "work"]);
    od.b.stop();
    write(&c.path("f.txt"), &noise(42 << 10, 92));
    journaled(&c, "f.txt", 42 << 10);
    c.stop();
    // A, which never saw V2, writes V3; B comes back to A alone: a conflict with V2.
    od.a.start();
    write(&od.a.path("f.txt"), &noise(43 << 10, 93));
    journaled(&od.a, "f.txt", 43 << 10);
    od.b.start();
    let t0 = Instant::now();
    while od.b.status()["folders"][0]["waiting_for_content"] != 1 {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "A's version does not wait for V2 on B: {}",
            od.b.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let siblings = |root: &Path| -> Vec<String> {
        tree(root)
            .into_keys()
            .filter(|n| n.contains("sync-conflict"))
            .collect()
    };
    assert_eq!(
        siblings(&od.b.dir),
        Vec::<String>::new(),
        "B kept a version it does not hold as a sibling"
    );
    // C back: one tree on the three, every file readable on B.
    ok(&od.b.home, &["mount", "work", od.mnt.to_str().unwrap()]);
    c.start();
    let t0 = Instant::now();
    loop {
        in_sync(&od.a, 30);
        in_sync(&c, 30);
        in_sync(&od.b, 30);
        let (ta, tc, tb) = (tree(&od.a.dir), tree(&c.dir), tree(&od.mnt));
        if ta == tc && ta == tb && ta.len() == 2 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(40),
            "not one tree:\nA {ta:?}\nC {tc:?}\nB {tb:?}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    c.stop();
}

/// B changes the mode of a file that is not local (a version with V1's content only B has
/// made); A, apart, overwrites V1: V1's content is held nowhere now, and no version A makes
/// descends from B's. Back together, A's version conflicts with B's, whose sibling would need
/// that content: B fetches it in vain, asks A, which says it does not hold it, and takes A's
/// version instead of waiting for good (D103). One tree on both, no sibling naming content
/// that exists nowhere, and `status` says what was not kept.
#[test]
fn a_conflict_with_a_version_not_local_here_whose_content_no_device_holds_takes_the_remote_version()
{
    let t = tmp();
    let mut od = setup(&t, &[("f.txt", noise(40 << 10, 94), 0o644)], None);
    assert!(is_placeholder(&od.b.path("f.txt")));
    od.a.stop();
    std::fs::set_permissions(od.mnt.join("f.txt"), std::fs::Permissions::from_mode(0o600)).unwrap();
    journal_says(&od.b, "f.txt", "mode", "600".into());
    assert!(
        is_placeholder(&od.b.path("f.txt")),
        "a chmod fetched the file"
    );
    ok(&od.b.home, &["unmount", "work"]);
    od.b.stop();
    od.a.start();
    write(&od.a.path("f.txt"), &noise(43 << 10, 95));
    journaled(&od.a, "f.txt", 43 << 10);
    od.b.start();
    ok(&od.b.home, &["mount", "work", od.mnt.to_str().unwrap()]);
    let t0 = Instant::now();
    loop {
        in_sync(&od.a, 30);
        in_sync(&od.b, 30);
        let (ta, tb) = (tree(&od.a.dir), tree(&od.mnt));
        if ta == tb && ta.len() == 1 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(40),
            "not one tree:\nA {ta:?}\nB {tb:?}\n{}",
            od.b.log()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    assert_eq!(
        std::fs::read(od.mnt.join("f.txt")).unwrap(),
        noise(43 << 10, 95)
    );
    let status = od.b.status();
    let folder = &status["folders"][0];
    assert_eq!(folder["waiting_for_content"], 0);
    let said = folder["last_error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        said.contains("no device sharing the folder holds its content"),
        "status does not say what was not kept: {said}"
    );
    // The journal says it too, on the entry of the version taken.
    let entry = od.b.journal(&["--path", "f.txt"]).last().cloned().unwrap();
    assert_eq!(entry["size"], 43 << 10);
    let detail: serde_json::Value =
        serde_json::from_str(entry["detail"].as_str().unwrap_or("null")).unwrap();
    assert_eq!(detail["not_kept"][0]["path"], "f.txt", "{entry}");
}

/// C, sharing with A and B (`meshfs folder set work SET...` first, if any), started and in sync;
/// A restarted to take it (its config changed).
fn third(t: &std::sync::Arc<tempfile::TempDir>, od: &mut OnDemand, set_args: &[&str]) -> Device {
    let mut c = Device::new(t, "c");
    if !set_args.is_empty() {
        set_work(&c.home, set_args);
    }
    pair(&od.a, &c);
    pair(&od.b, &c);
    od.a.stop();
    od.a.start();
    c.start();
    in_sync(&c, 60);
    c
}

/// `meshfs folder set work SET_ARGS` on the device at `home`, with no free floor unless they
/// give one: these devices share the machine's disk, and the default floor (5 % of it) made
/// them evict what they had just fetched whenever the disk was nearly full. A test of the floor
/// sets its own.
fn set_work(home: &Path, set_args: &[&str]) {
    let mut set = vec!["folder", "set", "work"];
    set.extend(set_args);
    if set_args.iter().any(|a| a.starts_with("--on-demand")) && !set_args.contains(&"--min-free") {
        set.extend(["--min-free", "0"]);
    }
    ok(home, &set);
}

/// Waits until `d`'s journal holds a version of `path` of `size` bytes.
fn journaled(d: &Device, path: &str, size: u64) {
    journal_says(d, path, "size", size.into());
}

/// Waits until the last journal entry of `path` on `d` has `field` = `want`.
fn journal_says(d: &Device, path: &str, field: &str, want: serde_json::Value) {
    let t0 = Instant::now();
    while d
        .journal(&["--path", path])
        .last()
        .map(|e| e[field].clone())
        != Some(want.clone())
    {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{} never journaled {path} with {field} {want}\n{}",
            d.name,
            d.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// B (on demand) writes a file that A holds open for writing: A defers B's version for its
/// writer and acknowledges the batch, without the content. `meshfs evict` on B keeps the file,
/// since A, asked, says it does not hold it; once A's writer lets go and A takes the version,
/// it may go, and it comes back whole (D101).
#[test]
fn a_version_a_peer_acknowledged_without_its_content_is_not_evicted_until_the_peer_holds_it() {
    let t = tmp();
    let od = setup(&t, &[("f.txt", noise(50 << 10, 70), 0o644)], None);
    let held = std::fs::OpenOptions::new()
        .append(true)
        .open(od.a.path("f.txt"))
        .unwrap();
    let mine = noise(60 << 10, 71);
    write(&od.mnt.join("f.txt"), &mine);
    journaled(&od.b, "f.txt", 60 << 10);
    in_sync(&od.b, 30);
    let r = evict(&od.b, "f.txt");
    assert!(
        kept_why(&r, "f.txt").contains("says it holds"),
        "evicted while A only acknowledged it: {r}"
    );
    assert_eq!(state(&od.mnt.join("f.txt")), "local");
    drop(held);
    let t0 = Instant::now();
    while std::fs::read(od.a.path("f.txt")).ok().as_deref() != Some(&mine[..]) {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "A never took B's version"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let r = evict(&od.b, "f.txt");
    assert_eq!(r["evicted"], serde_json::json!(["f.txt"]), "{r}");
    assert_eq!(std::fs::read(od.mnt.join("f.txt")).unwrap(), mine);
}

/// A file not local, truncated to nothing through B's mount (no fetch: its content is known)
/// and written again: the same inode holds B's content now, and A gets it (the placeholder's
/// row went when the scan read it as content; kept, it hid the chunks from A's requests, D101).
#[test]
fn a_placeholder_truncated_and_written_through_the_mount_is_served_to_peers() {
    let t = tmp();
    let od = setup(&t, &[("t.txt", noise(30 << 10, 80), 0o644)], None);
    let p = od.mnt.join("t.txt");
    assert_eq!(state(&p), "online");
    let c = CString::new(p.as_os_str().as_bytes()).unwrap();
    // SAFETY: a NUL-terminated path, valid for the call.
    let truncated = unsafe { libc::truncate(c.as_ptr(), 0) };
    assert_eq!(truncated, 0, "{}", std::io::Error::last_os_error());
    // Over the 64 KiB a batch carries inline: A asks B for its chunks.
    let mine = noise(300 << 10, 81);
    let mut f = std::fs::OpenOptions::new().append(true).open(&p).unwrap();
    std::io::Write::write_all(&mut f, &mine).unwrap();
    drop(f);
    let t0 = Instant::now();
    while std::fs::read(od.a.path("t.txt")).ok().as_deref() != Some(&mine[..]) {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "A never got B's content\n{}",
            od.a.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
