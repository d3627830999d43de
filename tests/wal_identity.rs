//! The journal's write-ahead log keeps its identity through any crash: a daemon killed at
//! each step of the bookkeeping (`Journal::open`'s steps, each a failpoint), or another
//! program killed right after writing the journal, never makes the next start take the
//! journal's own log for another database's; a log copied from another journal is still
//! refused (`tests/resilience.rs`,
//! `a_write_ahead_log_from_another_journal_is_refused_and_repair_loses_nothing`).

use crate::common;
use common::*;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

fn journal(d: &Device) -> PathBuf {
    d.home.join("state").join("journal.db")
}

fn wal(d: &Device) -> PathBuf {
    d.home.join("state").join("journal.db-wal")
}

/// Waits until the daemon's folder holds `files` files.
fn wait_files(d: &Device, files: u64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while d.status()["folders"][0]["files"] != files {
        assert!(Instant::now() < deadline, "{}: {}", d.name, d.status());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Every path in the journal's history of `work`.
fn journaled(d: &Device) -> std::collections::BTreeSet<String> {
    d.journal(&[])
        .iter()
        .map(|e| e["path"].as_str().unwrap().to_string())
        .collect()
}

/// Where the daemon of a case is killed.
#[derive(Clone, Copy, Debug)]
enum When {
    /// While it starts.
    Start,
    /// While it stops (SIGTERM).
    Stop,
}

/// A device with `n` files journaled and stopped cleanly; with `no_wal`, its log then removed
/// as an older meshfs or the sqlite3 shell would leave it (checkpointed, deleted), so the next
/// start's first write begins a log with random salts.
fn journaled_device(
    t: &std::sync::Arc<tempfile::TempDir>,
    name: &str,
    n: usize,
    no_wal: bool,
) -> Device {
    let mut d = Device::new(t, name);
    for i in 0..n {
        write(
            &d.path(&format!("f{i}.txt")),
            format!("file {i}").as_bytes(),
        );
    }
    d.start();
    wait_files(&d, n as u64);
    d.stop();
    if no_wal {
        std::fs::remove_file(wal(&d)).unwrap();
    }
    d
}

/// Whether `d`'s last daemon died at `point` (`name` or `name@detail`, as armed).
fn died_at(d: &Device, point: &str) -> bool {
    let log = d.log();
    log.contains("fault injection: aborting") && log.contains(&format!("point={point}"))
}

/// Arms `point` on `d` (abort), runs until the daemon dies there (at start or at its stop),
/// and checks that it died there and that the next start opens the journal with every file.
fn crash_at(d: &mut Device, point: &str, when: When) {
    d.arm(&format!("{point}=abort"));
    let mut expect = 3;
    match when {
        When::Start => {
            let status = d.run_to_exit(60);
            assert!(!status.success(), "{point}: {status:?}");
        }
        When::Stop => {
            d.start();
            write(&d.path("during.txt"), b"written while the daemon ran");
            expect += 1;
            wait_files(d, expect);
            d.stop_status();
        }
    }
    assert!(
        died_at(d, point),
        "{point} ({when:?}) was never reached:\n{}",
        d.log()
    );
    d.env.clear();
    d.start();
    wait_files(d, expect);
    let have = journaled(d);
    for i in 0..3 {
        assert!(have.contains(&format!("f{i}.txt")), "{point}: {have:?}");
    }
    if expect == 4 {
        assert!(have.contains("during.txt"), "{point}: {have:?}");
    }
    d.stop();
}

#[test]
fn a_daemon_killed_at_any_step_of_its_wal_bookkeeping_starts_again_with_nothing_lost() {
    let t = tmp();
    // (point, when, whether the log was gone before: the open's mark then begins a log with
    // random salts).
    let cases: &[(&str, When, bool)] = &[
        ("journal.open.mark_noted", When::Start, false),
        ("journal.open.marked", When::Start, false),
        ("journal.open.noted", When::Start, false),
        ("journal.open.mark_noted", When::Start, true),
        ("journal.open.marked", When::Start, true),
        ("journal.open.noted", When::Start, true),
        ("journal.note.synced@open.mark", When::Start, true),
        ("journal.note.renamed@open.mark", When::Start, true),
        ("journal.note.synced@open.salts", When::Start, true),
        ("journal.note.renamed@open.salts", When::Start, true),
        ("journal.note.synced@close.mark", When::Stop, false),
        ("journal.note.renamed@close.salts", When::Stop, false),
        ("journal.close.checkpointed", When::Stop, false),
        ("journal.close.mark_noted", When::Stop, false),
        ("journal.close.marked", When::Stop, false),
        ("journal.close.noted", When::Stop, false),
    ];
    let handles: Vec<_> = cases
        .iter()
        .enumerate()
        .map(|(i, &(point, when, no_wal))| {
            let t = t.clone();
            std::thread::spawn(move || {
                let mut d = journaled_device(&t, &format!("d{i}"), 3, no_wal);
                crash_at(&mut d, point, when);
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

/// Runs python3 on `script` with `args`; python3's exit status.
fn python(script: &str, args: &[&str]) -> std::process::ExitStatus {
    Command::new("python3")
        .arg("-c")
        .arg(script)
        .args(args)
        .status()
        .expect("python3 (with its sqlite3 module) is needed by this test")
}

#[test]
fn another_program_killed_after_committing_to_the_stopped_journal_does_not_strand_it() {
    // The reproduction: stop the daemon cleanly; commit one transaction to the
    // journal from another process and SIGKILL it before it closes; start.
    let t = tmp();
    let mut d = journaled_device(&t, "a", 3, false);
    let before = std::fs::metadata(wal(&d)).map(|m| m.len()).unwrap_or(0);
    let status = python(
        "import sqlite3, os, signal, sys\n\
         c = sqlite3.connect(sys.argv[1])\n\
         v = c.execute('PRAGMA user_version').fetchone()[0]\n\
         c.execute('PRAGMA user_version = %d' % v)\n\
         c.commit()\n\
         os.kill(os.getpid(), signal.SIGKILL)\n",
        &[journal(&d).to_str().unwrap()],
    );
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
    let after = std::fs::metadata(wal(&d)).unwrap().len();
    assert!(
        after > before,
        "python committed nothing to the log ({before} → {after} bytes)"
    );
    d.start();
    wait_files(&d, 3);
    assert_eq!(journaled(&d).len(), 3);
    // And once more from a log the program began itself (none left by the daemon).
    d.stop();
    std::fs::remove_file(wal(&d)).unwrap();
    python(
        "import sqlite3, os, signal, sys\n\
         c = sqlite3.connect(sys.argv[1])\n\
         c.execute('PRAGMA user_version = %d' % c.execute('PRAGMA user_version').fetchone()[0])\n\
         os.kill(os.getpid(), signal.SIGKILL)\n",
        &[journal(&d).to_str().unwrap()],
    );
    let err = d.run_to_exit(30);
    // A log nobody noted: refused, as another journal's would be. This is the case the
    // daemon's close rules out by leaving its log on disk; meshfs repair is the way out.
    assert!(!err.success());
    assert!(
        d.log().contains("belongs to another database"),
        "{}",
        d.log()
    );
}

#[test]
fn a_log_started_again_after_a_checkpoint_and_killed_before_its_note_is_still_ours() {
    let t = tmp();
    let mut d = journaled_device(&t, "a", 3, false);
    d.arm("journal.wal.restarted=abort");
    d.start();
    // Another connection checkpoints the whole log: the daemon's next write starts it again
    // (salt-1 + 1, a new salt-2), and the daemon dies before noting it.
    let status = python(
        "import sqlite3, sys\n\
         c = sqlite3.connect(sys.argv[1])\n\
         busy, log, done = c.execute('PRAGMA wal_checkpoint(PASSIVE)').fetchone()\n\
         assert busy == 0 and log == done, (busy, log, done)\n",
        &[journal(&d).to_str().unwrap()],
    );
    assert!(status.success());
    write(&d.path("after.txt"), b"journaled in the new log");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !died_at(&d, "journal.wal.restarted") {
        assert!(Instant::now() < deadline, "{}", d.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    d.stop();
    d.env.clear();
    d.start();
    wait_files(&d, 4);
    assert!(journaled(&d).contains("after.txt"));
}

#[test]
fn a_journal_from_before_the_mark_killed_right_after_its_upgrade_starts_again() {
    let t = tmp();
    let mut d = journaled_device(&t, "a", 3, false);
    // As meshfs left it before the mark: schema 4 (without the mark, 5, the past
    // versions' tables, 6, and on demand's, 7 and 8), a note of 8 bytes (salts alone), the log
    // checkpointed and deleted at the last close (python's connection closes last here).
    let status = python(
        "import sqlite3, sys\n\
         c = sqlite3.connect(sys.argv[1])\n\
         c.executescript('DROP TABLE wal_mark; DROP TABLE versions; DROP TABLE pruned; \
         DROP TABLE held; DROP TABLE local_only; DROP TABLE absent; DROP TABLE pins; DROP TABLE used; \
         PRAGMA user_version = 4;')\n\
         c.close()\n",
        &[journal(&d).to_str().unwrap()],
    );
    assert!(status.success());
    assert!(!wal(&d).exists());
    std::fs::write(d.home.join("state/journal.db-meshfs-wal"), [7u8; 8]).unwrap();
    crash_at(&mut d, "journal.open.migrated", When::Start);
}
