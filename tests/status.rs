//! What `meshfs status` claims, checked against what is true: "in sync" means with every peer
//! that shares the folder; `--wait-synced` waits for the daemon and for every such peer; byte
//! counters per peer survive reconnects and add up to the device's; a listen address may be a
//! host name; a peer that cannot be reached is logged once, not on every retry.

use crate::common;
use common::*;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn run(home: &std::path::Path, args: &[&str]) -> (i32, String, String) {
    let out = meshfs(home, args);
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

/// A daemon started by hand, killed when dropped.
struct Daemon(std::process::Child);

impl Daemon {
    fn spawn(home: &std::path::Path, rust_log: &str) -> Daemon {
        let log = std::fs::File::create(home.join("daemon.log")).unwrap();
        Daemon(
            Command::new(bin())
                .arg("--home")
                .arg(home)
                .arg("daemon")
                .env("RUST_LOG", rust_log)
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .unwrap(),
        )
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_folder_is_not_in_sync_while_a_peer_sharing_it_never_connected_or_is_offline() {
    let t = tmp();
    let mut a = Device::new(&t, "a");
    let mut b = Device::new(&t, "b");
    pair(&a, &b);
    a.start();
    write(&a.path("new.txt"), b"only a has it");

    // b never came: not in sync, and status says why in words.
    let (code, out, err) = run(&a.home, &["status", "--wait-synced", "--timeout", "1"]);
    assert_eq!(code, 4, "{out}{err}");
    assert!(
        out.contains("up to date with 0 of 1 peer; b never connected"),
        "{out}"
    );
    assert!(out.contains("sync    not in sync"), "{out}");
    assert!(err.contains("not in sync after 1 s: folder work"), "{err}");
    let st = a.status();
    assert_eq!(st["in_sync"], false);
    assert_eq!(st["folders"][0]["in_sync"], false);
    assert_eq!(st["folders"][0]["peers_connected"], false);
    // The old meaning, on request: in sync with the peers that are connected (none).
    assert_eq!(st["in_sync_with_connected"], true);
    assert_eq!(st["folders"][0]["in_sync_with_connected"], true);
    let (code, _, err) = run(
        &a.home,
        &["status", "--wait-synced", "--connected", "--timeout", "10"],
    );
    assert_eq!(code, 0, "{err}");

    b.start();
    wait_synced(&[&a, &b], 30);
    let (code, out, _) = run(&a.home, &["status"]);
    assert_eq!(code, 0);
    assert!(
        out.contains("in sync with every peer that shares it (b)"),
        "{out}"
    );
    assert_eq!(a.status()["in_sync"], true);

    // b goes away and a changes something: a is not in sync with b any more.
    b.stop();
    write(&a.path("later.txt"), b"b has not got this");
    let (code, out, _) = run(&a.home, &["status", "--wait-synced", "--timeout", "1"]);
    assert_eq!(code, 4, "{out}");
    assert!(
        out.contains("up to date with 0 of 1 peer; b offline since "),
        "{out}"
    );
    let st = a.status();
    let seen = st["peers"][0]["last_seen_unix"].as_u64().unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert!(now.abs_diff(seen) < 60, "last seen {seen}, now {now}");
    assert_eq!(st["folders"][0]["peers"][0]["connected"], false);
}

#[test]
fn wait_synced_right_after_starting_the_daemon_waits_for_it_to_come_up() {
    let t = tmp();
    let a = Device::new(&t, "a");
    write(&a.path("f.txt"), b"x");
    // The README's `meshfs daemon & meshfs status --wait-synced`.
    let _d = Daemon::spawn(&a.home, "info");
    let (code, out, err) = run(&a.home, &["status", "--wait-synced", "--timeout", "30"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("up to date (shared with no peer)"), "{out}");
    assert!(out.contains("1 files"), "{out}");

    // No daemon at all: it waits for the timeout, then says so with exit 3.
    let b = Device::new(&t, "b");
    let started = Instant::now();
    let (code, _, err) = run(&b.home, &["status", "--wait-synced", "--timeout", "0.5"]);
    assert_eq!(code, 3);
    assert!(started.elapsed() >= Duration::from_millis(500));
    assert!(
        err.contains("no daemon came up") && err.contains("meshfs daemon"),
        "{err}"
    );
    // Without --wait-synced it does not wait.
    let (code, _, err) = run(&b.home, &["status"]);
    assert_eq!(code, 3);
    assert!(err.contains("no daemon is running"), "{err}");
}

/// Names and sizes of the files in a replica, without reading them: cheap enough to take the
/// instant a wait returns.
fn sizes(root: &std::path::Path) -> std::collections::BTreeMap<String, u64> {
    let mut out = std::collections::BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let md = e.metadata().unwrap();
            let rel = e.path().strip_prefix(root).unwrap().display().to_string();
            if rel.starts_with(".meshfs") {
                continue;
            }
            if md.is_dir() {
                stack.push(e.path());
            } else {
                out.insert(rel, md.len());
            }
        }
    }
    out
}

/// Writes `data` at `p`, makes it durable and drops it from the page cache: a first scan of a
/// folder that was not just written reads it from the disk.
fn write_cold(p: &std::path::Path, data: &[u8]) {
    use std::os::fd::AsRawFd;
    write(p, data);
    let f = std::fs::File::open(p).unwrap();
    f.sync_all().unwrap();
    // SAFETY: posix_fadvise takes the open descriptor and two integers and touches no memory.
    let r = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(r, 0);
}

/// A device still hashing its first scan has files its journal does not list yet: a peer that
/// has applied everything it announced so far is not in sync with it. The peer says it waits
/// for that scan (with its progress), and `--wait-synced` there returns only once the scan has
/// ended and every file of it is applied — not as soon as the peer has caught up with what was
/// journaled so far.
#[test]
fn wait_synced_on_the_peer_of_a_device_in_its_first_scan_returns_only_with_every_file_of_it() {
    let t = tmp();
    let mut a = Device::new(&t, "a");
    let mut b = Device::new(&t, "b");
    pair(&a, &b);
    // 2,000 files of 1 MiB of distinct content, not in the page cache: two slices of a's
    // first scan, each reading 1 GiB from the disk before it is journaled (here 1.6 s in all,
    // 0.6 s with the data cached). Meanwhile b connects and applies what a has journaled.
    const FILES: u64 = 2000;
    for i in 0..FILES {
        write_cold(
            &a.path(&format!("d{}/f{i}.bin", i % 10)),
            &noise(1 << 20, i),
        );
    }
    let want = tree(&a.dir);
    b.start();
    // b waits from before a is up, as a script started with it would.
    let (home, dir) = (b.home.clone(), b.dir.clone());
    let waiter = std::thread::spawn(move || {
        let started = Instant::now();
        let out = meshfs(&home, &["status", "--wait-synced", "--timeout", "600"]);
        // What is on b the moment the wait says "in sync".
        let at_return = sizes(&dir);
        (out, at_return, started.elapsed())
    });

    a.start();
    let scan_started = Instant::now();
    // While a scans, b never says in sync; once connected, it says what it waits for.
    let mut waiting_seen = Vec::new();
    let mut polls = 0;
    loop {
        if a.status()["folders"][0]["scanning"] != true {
            break;
        }
        // The JSON first, then the text: b learns of a's scan once connected and forgets it
        // only when a's scan ends (checked after both), so a text taken after a JSON answer
        // that shows the scan shows it too. The other order raced: the text could be taken
        // the moment before b heard of the scan.
        //
        // A pair whose text lost the scan the JSON showed is taken again, a few times: b's
        // session with a can be replaced between the two answers (both devices dial), and for
        // the moment the new one has no hello yet b knows nothing of a's scan.
        let mut tries = 0;
        let (st, (code, out, err)) = loop {
            let st = b.status();
            let text = run(&b.home, &["status"]);
            let p = &st["folders"][0]["peers"][0];
            let shown = p["connected"] != true
                || p["scanning"] != true
                || text.1.contains("with a: waiting for its first scan: ");
            tries += 1;
            if shown || tries == 5 {
                break (st, text);
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        if a.status()["folders"][0]["scanning"] != true {
            break;
        }
        // a was scanning before and after both answers.
        polls += 1;
        assert_eq!(code, 0, "{err}");
        assert_eq!(st["in_sync"], false, "{st:#}");
        assert_eq!(st["folders"][0]["in_sync"], false, "{st:#}");
        assert!(out.contains("sync    not in sync"), "{out}");
        let p = &st["folders"][0]["peers"][0];
        if p["connected"] == true && p["scanning"] == true {
            assert_eq!(st["in_sync_with_connected"], false, "{st:#}");
            assert_eq!(p["in_sync"], false);
            assert!(
                out.contains("waiting for a's first scan: ")
                    && out.contains("with a: waiting for its first scan: "),
                "{out}"
            );
            let hashed = p["scan"]["done"].as_u64().unwrap();
            assert!(hashed <= FILES, "{p:#}");
            waiting_seen.push(hashed);
        }
    }
    let scan_secs = scan_started.elapsed().as_secs_f64();
    let log = a.log();
    let scanned = log.lines().find(|l| l.contains("folder scanned"));
    eprintln!(
        "a's first scan: {scanned:?}; b polled {polls} times during it, {} of them connected \
         and waiting for it (files hashed: {waiting_seen:?})",
        waiting_seen.len()
    );
    assert!(
        !waiting_seen.is_empty(),
        "a's first scan ({scan_secs:.1} s) ended before b saw it connected:\n{}\n{}",
        a.log(),
        b.log()
    );

    let (out, at_return, waited) = waiter.join().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("in sync with every peer that shares it (a)"),
        "{stdout}"
    );
    eprintln!(
        "b's --wait-synced returned after {:.1} s",
        waited.as_secs_f64()
    );
    let files = want.values().filter(|v| v.starts_with("file ")).count() as u64;
    assert_eq!(files, FILES);
    assert_eq!(
        at_return.len() as u64,
        FILES,
        "--wait-synced returned with {} of a's {FILES} files on b",
        at_return.len()
    );
    assert_eq!(at_return, sizes(&a.dir));
    assert_eq!(tree(&b.dir), want, "every file with a's content");
    let st = b.status();
    let p = &st["folders"][0]["peers"][0];
    assert_eq!(
        (p["scanning"].as_bool(), st["in_sync"].as_bool()),
        (Some(false), Some(true))
    );
    assert_eq!(p["scan"]["done"], 0, "no scan is reported once it is over");
}

/// (sent, received) of the one peer and of the device.
fn counters(d: &Device) -> ((u64, u64), (u64, u64)) {
    let st = d.status();
    let p = &st["peers"][0];
    (
        (
            p["bytes_sent"].as_u64().unwrap(),
            p["bytes_received"].as_u64().unwrap(),
        ),
        (
            st["bytes_sent"].as_u64().unwrap(),
            st["bytes_received"].as_u64().unwrap(),
        ),
    )
}

#[test]
fn per_peer_byte_counters_add_up_to_the_device_totals_and_survive_a_reconnect() {
    let t = tmp();
    let mut a = Device::new(&t, "a");
    let mut b = Device::new(&t, "b");
    pair(&a, &b);
    a.start();
    b.start();
    write(&a.path("big.bin"), &noise(2 << 20, 1));
    wait_synced(&[&a, &b], 60);
    let (peer, total) = counters(&a);
    assert!(peer.0 > 2 << 20, "the file's bytes count for b: {peer:?}");
    assert_eq!(peer, total);

    // b restarts: a new connection, the count goes on.
    b.stop();
    b.start();
    write(&a.path("second.bin"), &noise(1 << 20, 2));
    wait_synced(&[&a, &b], 60);
    let (after, total) = counters(&a);
    assert!(
        after.0 > peer.0 + (1 << 20),
        "not reset by the reconnect: {peer:?} then {after:?}"
    );
    assert_eq!(after, total);
}

#[test]
fn listen_takes_a_host_name() {
    let t = tmp();
    let port = std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let home = t.path().join("named");
    let dir = t.path().join("named-files");
    ok(
        &home,
        &[
            "init",
            "--name",
            "named",
            "--listen",
            &format!("localhost:{port}"),
            "--no-discovery",
        ],
    );
    ok(
        &home,
        &["folder", "add", dir.to_str().unwrap(), "--id", "work"],
    );
    let mut b = Device::new(&t, "b");
    let id = ok(&home, &["id"]).trim().to_string();
    ok(
        &home,
        &[
            "peer", "add", &b.id, "--addr", &b.addr, "--name", "b", "--share", "work",
        ],
    );
    // b reaches it at the address localhost resolved to.
    ok(
        &b.home,
        &[
            "peer",
            "add",
            &id,
            "--addr",
            &format!("127.0.0.1:{port}"),
            "--name",
            "named",
            "--share",
            "work",
        ],
    );
    let _d = Daemon::spawn(&home, "info");
    b.start();
    write(&b.path("hello.txt"), b"hello");
    let (code, out, err) = run(&home, &["status", "--wait-synced", "--timeout", "30"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains(&format!("listening on localhost:{port}")),
        "{out}"
    );
    assert_eq!(std::fs::read(dir.join("hello.txt")).unwrap(), b"hello");
}

#[test]
fn an_unreachable_peer_is_logged_once_at_info_and_its_retries_at_debug() {
    let t = tmp();
    let a = Device::new(&t, "a");
    let b = Device::new(&t, "b");
    // b is configured but never runs.
    ok(
        &a.home,
        &[
            "peer", "add", &b.id, "--addr", &b.addr, "--name", "b", "--share", "work",
        ],
    );
    let _d = Daemon::spawn(&a.home, "debug");
    let deadline = Instant::now() + Duration::from_secs(30);
    let retries = |log: &str| {
        log.lines()
            .filter(|l| l.contains("DEBUG") && l.contains("dial failed"))
            .count()
    };
    while retries(&a.log()) < 3 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
    }
    let log = a.log();
    assert!(retries(&log) >= 3, "it keeps retrying:\n{log}");
    let at_info = log
        .lines()
        .filter(|l| l.contains(" INFO ") && l.contains("dial failed"))
        .count();
    assert_eq!(at_info, 1, "{log}");
}

/// Root reads any file whatever its mode (CAP_DAC_OVERRIDE), and the tests run as root: the
/// daemon runs without the two capabilities that bypass file permissions, so a file of mode
/// 000 is as unreadable to it as to any user's daemon.
const WITHOUT_DAC_OVERRIDE: [&str; 3] = [
    "setpriv",
    "--bounding-set=-dac_override,-dac_read_search",
    "--",
];

#[test]
fn an_unreadable_file_is_shown_with_its_error_and_the_rest_of_the_folder_keeps_syncing() {
    use std::os::unix::fs::PermissionsExt;
    let t = tmp();
    let mut a = Device::new(&t, "a");
    let mut b = Device::new(&t, "b");
    pair(&a, &b);
    write(&a.path("readable.txt"), b"for b");
    write(&a.path("secret.txt"), b"nobody may read this");
    let mode = |m| std::fs::Permissions::from_mode(m);
    std::fs::set_permissions(a.path("secret.txt"), mode(0o000)).unwrap();
    a.under = WITHOUT_DAC_OVERRIDE.iter().map(|s| s.to_string()).collect();
    Device::start_together(&mut [&mut a, &mut b]);
    let (code, out, err) = run(&a.home, &["status", "--wait-synced", "--timeout", "30"]);
    assert_eq!(code, 0, "the unreadable file is not waited for: {out}{err}");
    assert_eq!(std::fs::read(b.path("readable.txt")).unwrap(), b"for b");
    assert!(!b.path("secret.txt").exists());
    let st = a.status();
    let f = &st["folders"][0];
    assert_eq!(f["unreadable"][0]["path"], "secret.txt", "{st}");
    let error = f["unreadable"][0]["error"].as_str().unwrap();
    assert!(error.contains("Permission denied"), "{error}");
    let last = f["last_error"]["message"].as_str().unwrap();
    assert!(
        last.contains("cannot read secret.txt") && last.contains("Permission denied"),
        "{last}"
    );
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert!(now.abs_diff(f["last_error"]["unix"].as_u64().unwrap()) < 60);
    assert!(
        out.contains("not replicated, cannot be read: secret.txt (Permission denied"),
        "{out}"
    );
    assert!(out.contains("last error at "), "{out}");
    assert!(a.log().contains("cannot read a file"), "{}", a.log());
    let (code, out, _) = run(&a.home, &["status", "work", "--pending"]);
    assert_eq!(code, 0);
    assert!(
        out.contains(
            "files not replicated, they cannot be read (1):\n    secret.txt  Permission denied"
        ),
        "{out}"
    );

    // Readable again: it is captured, sent, and no longer listed.
    std::fs::set_permissions(a.path("secret.txt"), mode(0o644)).unwrap();
    wait_synced(&[&a, &b], 30);
    assert_eq!(
        std::fs::read(b.path("secret.txt")).unwrap(),
        b"nobody may read this"
    );
    assert_eq!(
        a.status()["folders"][0]["unreadable"],
        serde_json::json!([])
    );
}

#[test]
fn a_peer_that_refuses_this_device_is_shown_with_the_error_and_the_address_it_was_last_seen_at() {
    let t = tmp();
    let mut a = Device::new(&t, "a");
    let mut b = Device::new(&t, "b");
    // a trusts b, b does not know a.
    ok(
        &a.home,
        &[
            "peer", "add", &b.id, "--addr", &b.addr, "--name", "b", "--share", "work",
        ],
    );
    b.start();
    a.start();
    let deadline = Instant::now() + Duration::from_secs(30);
    let st = loop {
        let st = a.status();
        if st["peers"][0]["last_error"].is_object() || Instant::now() > deadline {
            break st;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let e = &st["peers"][0]["last_error"];
    let message = e["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("refused our certificate") && message.contains(&a.id),
        "{st}"
    );
    assert!(e["unix"].as_u64().is_some(), "{st}");
    assert_eq!(st["peers"][0]["last_seen_addr"], serde_json::Value::Null);
    let (_, out, _) = run(&a.home, &["status"]);
    assert!(out.contains("last error at "), "{out}");
    assert!(out.contains("refused our certificate"), "{out}");
    assert!(b.status()["refused_devices"][0] == a.id.as_str());

    // Once b trusts a they connect, and a says where b is.
    ok(
        &b.home,
        &[
            "peer", "add", &a.id, "--addr", &a.addr, "--name", "a", "--share", "work",
        ],
    );
    wait_synced(&[&a, &b], 30);
    let st = a.status();
    assert_eq!(st["peers"][0]["last_seen_addr"], b.addr.as_str(), "{st}");
    let (_, out, _) = run(&a.home, &["status"]);
    assert!(out.contains(&format!("connected at {}", b.addr)), "{out}");
    b.stop();
    let (_, out, _) = run(&a.home, &["status"]);
    assert!(out.contains(&format!("last at {}", b.addr)), "{out}");
}

#[test]
fn pending_lists_the_records_a_peer_has_not_acknowledged_and_the_changes_being_recorded() {
    let t = tmp();
    let mut a = Device::new(&t, "a");
    let mut b = Device::new(&t, "b");
    pair(&a, &b);
    write(&a.path("one.txt"), b"1");
    write(&a.path("dir/two.txt"), b"2");
    a.start();
    // b never came: everything a has is unacknowledged by it.
    let (code, out, err) = run(&a.home, &["status", "work", "--pending"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains(
            "not yet acknowledged by b (not connected; acknowledged up to sequence 0) (3):"
        ),
        "{out}"
    );
    for path in ["    dir\n", "    dir/two.txt\n", "    one.txt\n"] {
        assert!(out.contains(path), "{path}: {out}");
    }
    let doc: serde_json::Value =
        serde_json::from_str(&ok(&a.home, &["status", "work", "--pending", "--json"])).unwrap();
    let f = &doc["folders"][0];
    assert_eq!(f["id"], "work");
    let unacked = &f["unacknowledged"][0];
    assert_eq!(unacked["device_id"], b.id.as_str());
    assert_eq!(unacked["connected"], false);
    assert_eq!(
        (unacked["acked"].as_u64(), unacked["count"].as_u64()),
        (Some(0), Some(3))
    );
    assert_eq!(f["skipped"], serde_json::json!({"count": 0, "items": []}));

    // A file being written goes on waiting in capture until its writer is done.
    let writing = a.path("growing.log");
    let writer = std::thread::spawn(move || {
        use std::io::Write;
        let mut f = std::fs::File::create(writing).unwrap();
        for _ in 0..40 {
            f.write_all(b"line\n").unwrap();
            std::thread::sleep(Duration::from_millis(50));
        }
    });
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut seen = String::new();
    while Instant::now() < deadline && !seen.contains("growing.log") {
        std::thread::sleep(Duration::from_millis(100));
        seen = ok(&a.home, &["status", "work", "--pending"]);
    }
    writer.join().unwrap();
    assert!(
        seen.contains("local changes being recorded (1):")
            && seen.contains("growing.log  (written; waits for its writer to close it)"),
        "{seen}"
    );

    // b comes and catches up: nothing waits.
    b.start();
    wait_synced(&[&a, &b], 30);
    let (_, out, _) = run(&a.home, &["status", "--pending"]);
    assert_eq!(out, "folder work: nothing waits\n");
    // Without a daemon it says so; an unknown folder is named.
    a.stop();
    let (code, _, err) = run(&a.home, &["status", "work", "--pending"]);
    assert_eq!(code, 3, "{err}");
    let (code, _, err) = run(&a.home, &["status", "nope", "--pending"]);
    assert_eq!(code, 1);
    assert!(err.contains("no folder \"nope\""), "{err}");
    let (code, _, err) = run(&a.home, &["status", "work"]);
    assert_eq!(code, 2, "a folder id goes with --pending: {err}");
}

/// `status --watch` on a pipe: one plain line per second, no terminal codes.
#[test]
fn watch_on_a_pipe_prints_one_plain_line_per_second_until_the_timeout() {
    let t = tmp();
    let mut a = Device::new(&t, "a");
    let b = Device::new(&t, "b");
    pair(&a, &b);
    a.start();
    let started = Instant::now();
    let (code, out, err) = run(&a.home, &["status", "--watch", "--timeout", "2.5"]);
    assert_eq!(code, 0, "{err}");
    assert!(started.elapsed() >= Duration::from_millis(2500));
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3, "{out}");
    for l in &lines {
        assert!(!l.contains('\x1b') && !l.contains('\r'), "{l:?}");
        assert!(
            l.contains("folder work: not in sync (up to date with 0 of 1 peer; b never connected")
                && l.contains("| peer b never connected"),
            "{l}"
        );
    }
    // Not with --json or --wait-synced; and it needs a daemon like status does.
    for args in [
        &["status", "--watch", "--json"][..],
        &["status", "--watch", "--wait-synced"],
    ] {
        assert_eq!(run(&a.home, args).0, 2, "{args:?}");
    }
    a.stop();
    let (code, _, err) = run(&a.home, &["status", "--watch"]);
    assert_eq!(code, 3);
    assert!(err.contains("no daemon is running"), "{err}");
}

/// Runs `args` of meshfs under a pseudo-terminal (util-linux `script`); returns what the
/// terminal received and the exit code.
fn on_a_terminal(home: &std::path::Path, args: &str) -> (i32, String) {
    let t = tmp();
    let typescript = t.path().join("typescript");
    let out = Command::new("script")
        .args(["--quiet", "--flush", "--return", "--command"])
        // A pseudo-terminal starts without a size; a real one has one.
        .arg(format!(
            "stty cols 160 rows 50 && exec {} --home {} {args}",
            bin(),
            home.display()
        ))
        .arg(&typescript)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = std::fs::read_to_string(&typescript).unwrap_or_default();
    (out.status.code().unwrap_or(-1), text)
}

#[test]
fn watch_and_the_wait_synced_bar_draw_on_a_terminal_and_finish() {
    let t = tmp();
    let mut a = Device::new(&t, "a");
    let mut b = Device::new(&t, "b");
    pair(&a, &b);
    a.start();
    // The view is redrawn in place, once a second, until the timeout.
    let (code, tty) = on_a_terminal(&a.home, "status --watch --timeout 2.5");
    assert_eq!(code, 0, "{tty}");
    assert_eq!(tty.matches("\x1b[H").count(), 3, "{tty:?}");
    assert!(tty.contains("meshfs status --watch   a "), "{tty}");
    assert!(tty.contains("peer    b never connected"), "{tty}");

    // b never comes: the bar says what it waits for, then is cleared for the status.
    let (code, tty) = on_a_terminal(&a.home, "status --wait-synced --timeout 1.5");
    assert_eq!(code, 4, "{tty}");
    assert!(
        tty.contains(
            "waiting to be in sync: folder work: up to date with 0 of 1 peer; b never connected"
        ),
        "{tty:?}"
    );
    assert!(tty.contains("\x1b[2K"), "the bar is cleared: {tty:?}");
    assert!(tty.contains("sync    not in sync"), "{tty}");
    // b comes with work to do: the bar counts it and finishes with exit 0.
    write(&a.path("f.bin"), &noise(4 << 20, 3));
    b.start();
    let (code, tty) = on_a_terminal(&a.home, "status --wait-synced --timeout 30");
    assert_eq!(code, 0, "{tty}");
    assert!(tty.contains("sync    in sync"), "{tty}");

    // On a pipe the same command prints the status and nothing else.
    let (code, out, _) = run(&a.home, &["status", "--wait-synced", "--timeout", "30"]);
    assert_eq!(code, 0);
    assert!(out.starts_with("device  a "), "{out:?}");
    assert!(
        !out.contains('\r') && !out.contains('\x1b') && !out.contains("waiting"),
        "{out:?}"
    );
    let (_, json, _) = run(
        &a.home,
        &["status", "--wait-synced", "--json", "--timeout", "30"],
    );
    assert!(
        serde_json::from_str::<serde_json::Value>(&json).is_ok(),
        "{json}"
    );
}

#[test]
fn a_peer_that_stops_is_shown_offline_and_its_stopping_is_not_its_last_error() {
    let t = tmp();
    let mut a = Device::new(&t, "a");
    let mut b = Device::new(&t, "b");
    pair(&a, &b);
    Device::start_together(&mut [&mut a, &mut b]);
    for round in 0..3 {
        wait_synced(&[&a, &b], 30);
        // a redials at once when b's session ends, and reaches b while it is going down.
        b.stop();
        let st = a.status();
        let message = st["peers"][0]["last_error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert!(!message.contains("stopping"), "round {round}: {st}");
        let (_, out, _) = run(&a.home, &["status"]);
        assert!(out.contains("b offline since "), "round {round}: {out}");
        assert!(!out.contains("daemon stopping"), "round {round}: {out}");
        b.start();
    }
}

#[test]
fn a_connected_peer_that_does_not_share_the_folder_back_ends_wait_synced_at_once_saying_what_to_run_on_it(
) {
    let t = tmp();
    let mut a = Device::new(&t, "a");
    let mut b = Device::new(&t, "b");
    // a shares work with b; b trusts a but shares nothing with it.
    ok(
        &a.home,
        &[
            "peer", "add", &b.id, "--addr", &b.addr, "--name", "b", "--share", "work",
        ],
    );
    ok(
        &b.home,
        &["peer", "add", &a.id, "--addr", &a.addr, "--name", "a"],
    );
    Device::start_together(&mut [&mut a, &mut b]);
    let t0 = Instant::now();
    let (code, out, err) = run(&a.home, &["status", "--wait-synced", "--timeout", "120"]);
    let took = t0.elapsed();
    eprintln!("--wait-synced answered the pairing question after {took:?}");
    assert_eq!(code, 5, "{out}{err}");
    assert!(took < Duration::from_secs(60), "{took:?}");
    let run_on_b = format!("on b run `meshfs share work {}`", a.id);
    assert!(
        err.contains("b is connected but does not share folder work with this device")
            && err.contains(&run_on_b),
        "{err}"
    );
    // The plain status says the same, below the folder.
    assert!(out.contains(&run_on_b), "{out}");
    let (_, plain, _) = run(&a.home, &["status"]);
    assert!(
        plain.contains("connected, but it does not share this folder") && plain.contains(&run_on_b),
        "{plain}"
    );
    // Done on b: in sync, once a has heard of it (until then the question stands, and is
    // answered at once).
    ok(&b.home, &["share", "work", &a.id]);
    let deadline = Instant::now() + Duration::from_secs(60);
    let (code, out, err) = loop {
        let (code, out, err) = run(&a.home, &["status", "--wait-synced", "--timeout", "60"]);
        if code != 5 || Instant::now() > deadline {
            break (code, out, err);
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(code, 0, "{out}{err}");
}
