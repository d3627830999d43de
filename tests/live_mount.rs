//! Two devices, each working in its folder's mount while the folders sync (real FUSE, real
//! daemons on 127.0.x.y): what is written in one mount is what the other mount shows.

use crate::common;
use common::*;
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub(crate) struct Mounted {
    pub(crate) dev: Device,
    pub(crate) mnt: PathBuf,
}

fn mounted(t: &std::sync::Arc<tempfile::TempDir>, name: &str) -> Mounted {
    let dev = Device::new(t, name);
    let mnt = t.path().join(format!("mnt-{name}"));
    std::fs::create_dir_all(&mnt).unwrap();
    Mounted { dev, mnt }
}

pub(crate) fn two_mounts(t: &std::sync::Arc<tempfile::TempDir>) -> (Mounted, Mounted) {
    let mut a = mounted(t, "a");
    let mut b = mounted(t, "b");
    pair(&a.dev, &b.dev);
    Device::start_together(&mut [&mut a.dev, &mut b.dev]);
    for m in [&a, &b] {
        ok(&m.dev.home, &["mount", "work", m.mnt.to_str().unwrap()]);
    }
    (a, b)
}

fn read(p: &Path) -> Option<Vec<u8>> {
    std::fs::read(p).ok()
}

#[test]
fn a_file_written_in_mount_a_is_read_stat_and_listed_in_mount_b() {
    let t = tmp();
    let (a, b) = two_mounts(&t);
    write(&a.mnt.join("notes/today.txt"), b"first");
    until("b's mount shows the file", 10, || {
        read(&b.mnt.join("notes/today.txt")).as_deref() == Some(b"first".as_slice())
    });
    // A longer version: after wait-synced, stat in b's mount shows the new size and mtime.
    let longer = b"a much longer second version of today's notes".to_vec();
    write(&a.mnt.join("notes/today.txt"), &longer);
    let mtime_a = std::fs::metadata(a.mnt.join("notes/today.txt"))
        .unwrap()
        .modified()
        .unwrap();
    wait_synced(&[&a.dev, &b.dev], 30);
    // At once, with no retry: "in sync" waits until the mount has told the kernel.
    let md = std::fs::metadata(b.mnt.join("notes/today.txt")).unwrap();
    assert_eq!(
        md.len(),
        longer.len() as u64,
        "stat right after wait-synced"
    );
    assert_eq!(md.modified().unwrap(), mtime_a);
    assert_eq!(read(&b.mnt.join("notes/today.txt")).unwrap(), longer);
    let names: Vec<String> = std::fs::read_dir(b.mnt.join("notes"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["today.txt"]);
}

#[test]
fn a_directory_renamed_in_mount_a_is_renamed_in_mount_b_with_no_data_on_the_wire() {
    let t = tmp();
    let (a, b) = two_mounts(&t);
    for i in 0..50 {
        write(
            &a.mnt.join(format!("project/src/f{i}.rs")),
            &noise(64 << 10, i),
        );
    }
    wait_synced(&[&a.dev, &b.dev], 60);
    let before = a.dev.wire_bytes();
    std::fs::rename(a.mnt.join("project"), a.mnt.join("renamed")).unwrap();
    until("b's mount shows the rename", 20, || {
        b.mnt.join("renamed/src/f49.rs").exists() && !b.mnt.join("project").exists()
    });
    wait_synced(&[&a.dev, &b.dev], 30);
    let moved = a.dev.wire_bytes() - before;
    assert!(
        moved < 200 << 10,
        "{moved} bytes moved for a rename of 3.2 MiB"
    );
    assert_eq!(
        read(&b.mnt.join("renamed/src/f7.rs")).unwrap(),
        noise(64 << 10, 7)
    );
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn a_directory_listing_cached_in_mount_b_shows_files_created_and_removed_in_mount_a() {
    let t = tmp();
    let (a, b) = two_mounts(&t);
    write(&a.mnt.join("shared/keep.txt"), b"keep");
    write(&a.mnt.join("shared/old.txt"), b"old");
    until("b lists both files", 10, || {
        b.mnt.join("shared").is_dir() && names(&b.mnt.join("shared")) == ["keep.txt", "old.txt"]
    });
    // Listed again: the kernel now answers from its cached listing.
    assert_eq!(names(&b.mnt.join("shared")), ["keep.txt", "old.txt"]);

    write(&a.mnt.join("shared/new.txt"), b"new");
    std::fs::remove_file(a.mnt.join("shared/old.txt")).unwrap();
    wait_synced(&[&a.dev, &b.dev], 30);
    until(
        "b's cached listing shows the creation and the removal",
        10,
        || names(&b.mnt.join("shared")) == ["keep.txt", "new.txt"],
    );
    assert_eq!(read(&b.mnt.join("shared/new.txt")).unwrap(), b"new");
}

#[test]
fn a_reader_in_mount_b_keeps_consistent_data_and_sees_the_new_version_on_reopen() {
    let t = tmp();
    let (a, b) = two_mounts(&t);
    let v1 = noise(256 << 10, 1);
    let v2 = noise(256 << 10, 2);
    write(&a.mnt.join("data.bin"), &v1);
    until("v1 in b", 10, || {
        read(&b.mnt.join("data.bin")).as_deref() == Some(v1.as_slice())
    });
    let mut held = std::fs::File::open(b.mnt.join("data.bin")).unwrap();
    let mut first = vec![0u8; 1000];
    held.read_exact(&mut first).unwrap();
    write(&a.mnt.join("data.bin"), &v2);
    until("v2 in b", 10, || {
        read(&b.mnt.join("data.bin")).as_deref() == Some(v2.as_slice())
    });
    // The open handle reads the version it opened, whole.
    held.rewind().unwrap();
    let mut all = Vec::new();
    held.read_to_end(&mut all).unwrap();
    assert!(all == v1, "the open handle saw a mix of versions");
}

#[test]
fn a_file_open_for_writing_in_mount_b_while_a_changes_it_keeps_both_versions() {
    let t = tmp();
    let (a, b) = two_mounts(&t);
    write(&a.mnt.join("draft.txt"), b"base");
    until("base in b", 10, || {
        read(&b.mnt.join("draft.txt")).as_deref() == Some(b"base".as_slice())
    });
    let mut held = std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(b.mnt.join("draft.txt"))
        .unwrap();
    held.write_all(b"b's words").unwrap();
    write(&a.mnt.join("draft.txt"), b"a's words");
    std::thread::sleep(Duration::from_millis(500));
    drop(held);
    wait_synced(&[&a.dev, &b.dev], 30);
    for m in [&a, &b] {
        let mut versions: Vec<Vec<u8>> = std::fs::read_dir(&m.mnt)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| {
                p.file_name()
                    .unwrap()
                    .to_string_lossy()
                    .starts_with("draft")
            })
            .map(|p| std::fs::read(p).unwrap())
            .collect();
        versions.sort();
        assert_eq!(versions, [b"a's words".to_vec(), b"b's words".to_vec()]);
    }
}

#[test]
fn a_remote_version_waiting_for_a_writer_in_mount_b_is_decided_again_after_b_restarts() {
    let t = tmp();
    let (a, mut b) = two_mounts(&t);
    write(&a.mnt.join("plan.txt"), b"first plan");
    until("the first plan in b", 10, || {
        read(&b.mnt.join("plan.txt")).as_deref() == Some(b"first plan".as_slice())
    });
    // b's editor holds the file open for writing and has saved nothing yet.
    let held = std::fs::OpenOptions::new()
        .write(true)
        .open(b.mnt.join("plan.txt"))
        .unwrap();
    write(&a.mnt.join("plan.txt"), b"second plan, from a");
    let waiting = |d: &Device| d.status()["folders"][0]["waiting_for_writers"].as_u64();
    until("b holds a's version back for its writer", 10, || {
        waiting(&b.dev) == Some(1)
    });
    // b's batch was acknowledged, so a will not send that version again: b stops while it
    // waits, its editor goes away with the mount, and b starts again.
    b.dev.stop();
    drop(held);
    assert_eq!(
        read(&b.dev.path("plan.txt")).as_deref(),
        Some(b"first plan".as_slice()),
        "not applied under the writer"
    );
    b.dev.start();
    ok(&b.dev.home, &["mount", "work", b.mnt.to_str().unwrap()]);
    wait_synced(&[&a.dev, &b.dev], 30);
    for m in [&a, &b] {
        assert_eq!(
            read(&m.mnt.join("plan.txt")).as_deref(),
            Some(b"second plan, from a".as_slice())
        );
        let names: Vec<String> = std::fs::read_dir(&m.mnt)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["plan.txt"], "nothing to resolve: b saved nothing");
    }
    assert_eq!(waiting(&b.dev), Some(0));
}

#[test]
fn a_version_waiting_for_a_writer_that_saved_before_b_restarted_ends_as_a_conflict_with_both_kept()
{
    let t = tmp();
    let (a, mut b) = two_mounts(&t);
    write(&a.mnt.join("plan.txt"), b"first plan");
    until("the first plan in b", 10, || {
        read(&b.mnt.join("plan.txt")).as_deref() == Some(b"first plan".as_slice())
    });
    let mut held = std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(b.mnt.join("plan.txt"))
        .unwrap();
    held.write_all(b"b's plan").unwrap();
    write(&a.mnt.join("plan.txt"), b"a's plan");
    until("b holds a's version back for its writer", 10, || {
        b.dev.status()["folders"][0]["waiting_for_writers"].as_u64() == Some(1)
    });
    b.dev.stop();
    drop(held);
    b.dev.start();
    ok(&b.dev.home, &["mount", "work", b.mnt.to_str().unwrap()]);
    wait_synced(&[&a.dev, &b.dev], 30);
    for m in [&a, &b] {
        let mut files: Vec<(String, String)> = std::fs::read_dir(&m.mnt)
            .unwrap()
            .map(|e| e.unwrap().path())
            .map(|p| {
                let name = p.file_name().unwrap().to_string_lossy().into_owned();
                (
                    name,
                    String::from_utf8_lossy(&std::fs::read(&p).unwrap()).into_owned(),
                )
            })
            .collect();
        files.sort_by(|x, y| x.1.cmp(&y.1));
        let versions: Vec<&str> = files.iter().map(|(_, c)| c.as_str()).collect();
        assert_eq!(
            versions,
            ["a's plan", "b's plan"],
            "{}: {files:?}",
            m.dev.name
        );
    }
}

#[test]
fn a_directory_renamed_in_a_while_b_writes_a_file_inside_it_loses_neither_side() {
    let t = tmp();
    let (a, b) = two_mounts(&t);
    write(&a.mnt.join("notes/todo.txt"), b"base");
    write(&a.mnt.join("notes/other.txt"), b"other");
    until("notes in b", 10, || {
        read(&b.mnt.join("notes/todo.txt")).as_deref() == Some(b"base".as_slice())
    });
    let mut held = std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(b.mnt.join("notes/todo.txt"))
        .unwrap();
    held.write_all(b"b's edit").unwrap();
    std::fs::rename(a.mnt.join("notes"), a.mnt.join("archive")).unwrap();
    // The rename reaches b while the file inside is still open for writing there: the file
    // is not deleted under its writer, the rest of the directory moves.
    until("the rename in b", 60, || {
        read(&b.mnt.join("archive/other.txt")).as_deref() == Some(b"other".as_slice())
    });
    assert!(
        b.mnt.join("notes/todo.txt").exists(),
        "a file open for writing was deleted under its writer"
    );
    drop(held);
    wait_synced(&[&a.dev, &b.dev], 30);
    // Delete against modify keeps the modification: b's edit stays at the old path on both
    // sides, and a's renamed copy of the old content is in the new directory.
    let state = |m: &Mounted| {
        ["notes/todo.txt", "archive/todo.txt", "archive/other.txt"]
            .map(|p| read(&m.mnt.join(p)).map(|b| String::from_utf8_lossy(&b).into_owned()))
    };
    let want = [Some("b's edit"), Some("base"), Some("other")].map(|s| s.map(String::from));
    let t0 = Instant::now();
    while [&a, &b].iter().any(|m| state(m) != want) {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "not settled: a {:?}, b {:?}",
            state(&a),
            state(&b)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_git_repository_committed_in_mount_a_is_clean_in_mount_b() {
    if std::process::Command::new("git")
        .arg("--version")
        .output()
        .is_err()
    {
        panic!("git is needed (CI installs it)");
    }
    let t = tmp();
    let (a, b) = two_mounts(&t);
    let git = |dir: &Path, args: &[&str]| {
        let out = std::process::Command::new("git")
            .args(["-c", "user.name=t", "-c", "user.email=t@example.invalid"])
            .args(args)
            .current_dir(dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "git {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let repo_a = a.mnt.join("repo");
    std::fs::create_dir(&repo_a).unwrap();
    git(&repo_a, &["init", "-q"]);
    for i in 0..30 {
        write(
            &repo_a.join(format!("src/m{i}.txt")),
            format!("module {i}\n").as_bytes(),
        );
    }
    git(&repo_a, &["add", "-A"]);
    git(&repo_a, &["commit", "-q", "-m", "first"]);
    let log_a = git(&repo_a, &["log", "--format=%H %s"]);
    wait_synced(&[&a.dev, &b.dev], 60);
    let repo_b = b.mnt.join("repo");
    until("b's repository has a's commit", 20, || {
        std::process::Command::new("git")
            .args(["log", "--format=%H %s"])
            .current_dir(&repo_b)
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout) == log_a)
    });
    assert_eq!(git(&repo_b, &["status", "--porcelain"]), "");
}

pub(crate) fn walk(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            match e.file_type() {
                Ok(t) if t.is_dir() => stack.push(p),
                Ok(t) if t.is_file() => out.push(p),
                _ => {}
            }
        }
    }
    out
}

/// The install race through a mount: for each of 40 files, b holds the file open for writing in
/// its mount while a's new version arrives, then writes its own bytes through that handle and
/// closes it. The mount's writer registry holds a's version until the release, so b's bytes are
/// never replaced unseen: both versions survive on both devices, 5 rounds.
#[test]
fn files_held_open_and_written_in_mount_b_while_a_version_arrives_keep_b_bytes() {
    let t = tmp();
    let (a, b) = two_mounts(&t);
    let names: Vec<String> = (0..40).map(|i| format!("f{i:02}")).collect();
    for n in &names {
        write(&a.mnt.join(n), b"seed");
    }
    wait_synced(&[&a.dev, &b.dev], 60);
    for round in 0..5 {
        let theirs = |n: &str| format!("{n} round {round} from a").into_bytes();
        let ours = |n: &str| format!("{n} round {round} from b").into_bytes();
        let mut held: Vec<std::fs::File> = names
            .iter()
            .map(|n| {
                std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(b.mnt.join(n))
                    .unwrap()
            })
            .collect();
        for n in &names {
            write(&a.mnt.join(n), &theirs(n));
        }
        // Every one of a's versions has reached b and waits for b's writers.
        until("a's versions wait for b's writers", 60, || {
            b.dev.status()["folders"][0]["waiting_for_writers"].as_u64() == Some(40)
        });
        for (f, n) in held.iter_mut().zip(&names) {
            f.set_len(0).unwrap();
            f.seek(std::io::SeekFrom::Start(0)).unwrap();
            f.write_all(&ours(n)).unwrap();
        }
        drop(held);
        wait_synced(&[&a.dev, &b.dev], 60);
        for d in [&a.dev, &b.dev] {
            let all = tree(&d.dir);
            for n in &names {
                let versions: Vec<Vec<u8>> = all
                    .keys()
                    .filter(|k| *k == n || k.starts_with(&format!("{n}.sync-conflict-")))
                    .map(|k| std::fs::read(d.path(k)).unwrap())
                    .collect();
                assert!(
                    versions.contains(&ours(n)) && versions.contains(&theirs(n)),
                    "round {round}, {} on {}: {:?}",
                    n,
                    d.name,
                    versions
                        .iter()
                        .map(|v| String::from_utf8_lossy(v).into_owned())
                        .collect::<Vec<_>>()
                );
            }
        }
    }
}

/// B's daemon is killed while a program holds a file open for writing through its mount and
/// others read and write beside it. The program keeps writing through the dead mount (the
/// passthrough sends its writes to the backing file): back, B holds A's next version of the file
/// back while it does, and keeps both once it closes. Linux may also keep the file's backing open
/// for writing for a while after the close (not every time): a lease is refused, and no process
/// has it open; B tells that from a writer (D101) and does not wait for it.
#[test]
fn a_file_held_open_through_a_killed_daemons_mount_is_a_writer_until_closed_and_loses_nothing() {
    let t = tmp();
    let (a, mut b) = two_mounts(&t);
    for i in 0..8 {
        write(&b.mnt.join(format!("g{i}")), &noise(64 << 10, i));
    }
    write(&b.mnt.join("held.txt"), b"first\n");
    wait_synced(&[&a.dev, &b.dev], 30);
    let mut held = std::fs::OpenOptions::new()
        .read(true)
        .append(true)
        .open(b.mnt.join("held.txt"))
        .unwrap();
    held.write_all(b"held\n").unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let busy: Vec<_> = (0..4u64)
        .map(|k| {
            let (mnt, stop) = (b.mnt.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut i = k;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let p = mnt.join(format!("g{}", i % 8));
                    if let Ok(mut f) = std::fs::OpenOptions::new().read(true).write(true).open(&p) {
                        let mut buf = Vec::new();
                        let _ = f.read_to_end(&mut buf);
                        let _ = f.write_all(b"y");
                    }
                    i += 1;
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    b.dev.kill();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for t in busy {
        t.join().unwrap();
    }
    b.dev.start();
    ok(&b.dev.home, &["mount", "work", b.mnt.to_str().unwrap()]);
    // A writes while the program still holds the file through the dead mount.
    let theirs = noise(10 << 10, 99);
    write(&a.dev.path("held.txt"), &theirs);
    // Past the 5 s an old file is kept aside after a swap for a writer that raced it.
    std::thread::sleep(Duration::from_millis(6500));
    held.write_all(b"after the restart\n").unwrap();
    drop(held);
    wait_synced(&[&a.dev, &b.dev], 30);
    let contents = |root: &Path| -> Vec<Vec<u8>> {
        let mut v: Vec<Vec<u8>> = std::fs::read_dir(root)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("held"))
            .map(|e| std::fs::read(e.path()).unwrap())
            .collect();
        v.sort();
        v
    };
    until("both versions of held.txt on both devices", 20, || {
        let (on_a, on_b) = (contents(&a.dev.dir), contents(&b.dev.dir));
        on_a == on_b
            && on_a.contains(&theirs)
            && on_a.iter().any(|c| c.ends_with(b"after the restart\n"))
    });
}
