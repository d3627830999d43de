//! The journal's contract, on real SQLite files in temporary directories.

use meshfs_daemon::journal::{
    Change, ChunkLocation, FolderCounts, FolderState, HistoryQuery, Journal, JournalError, Op,
    PeerProgress, StoredRecord, INDEXED_FROM,
};
use meshfs_daemon::store::LocalStat;
use meshfs_protocol::{
    Chunk, DeviceId, FileKind, FileRecord, FolderId, Hash, RelPath, ShortId, VersionVector,
};
use proptest::prelude::*;
use std::collections::HashMap;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tempfile::TempDir;

// ---- building records ----

fn folder() -> FolderId {
    FolderId::new("work").unwrap()
}

fn other_folder() -> FolderId {
    FolderId::new("photos").unwrap()
}

fn p(s: &str) -> RelPath {
    RelPath::new(s).unwrap()
}

fn dev(n: u8) -> DeviceId {
    DeviceId::from_bytes([n; 32])
}

fn short(n: u8) -> ShortId {
    dev(n).short()
}

fn vv(pairs: &[(u8, u64)]) -> VersionVector {
    VersionVector::from_pairs(pairs.iter().map(|&(d, c)| (short(d), c)))
}

/// A file whose content is `parts` concatenated, one chunk per part.
fn file_parts(path: &str, parts: &[&[u8]], version: VersionVector) -> FileRecord {
    let all: Vec<u8> = parts.concat();
    let chunks: Vec<Chunk> = parts
        .iter()
        .map(|c| Chunk {
            len: c.len() as u32,
            hash: Hash::of(c),
        })
        .collect();
    FileRecord {
        path: p(path),
        kind: FileKind::File,
        deleted: false,
        mode: 0o644,
        mtime_ns: 1_700_000_000_000_000_000,
        size: all.len() as u64,
        hash: Hash::of_chunks(&chunks),
        chunks,
        target: String::new(),
        modified_by: version.entries().last().map(|e| e.0).unwrap_or_default(),
        version,
        sequence: 0,
    }
}

fn file(path: &str, content: &[u8], version: VersionVector) -> FileRecord {
    file_parts(path, &[content], version)
}

fn dir(path: &str, version: VersionVector) -> FileRecord {
    FileRecord {
        path: p(path),
        kind: FileKind::Dir,
        deleted: false,
        mode: 0o755,
        mtime_ns: 0,
        size: 0,
        hash: Hash::ZERO,
        chunks: Vec::new(),
        target: String::new(),
        modified_by: version.entries().last().map(|e| e.0).unwrap_or_default(),
        version,
        sequence: 0,
    }
}

fn symlink(path: &str, target: &str, version: VersionVector) -> FileRecord {
    FileRecord {
        kind: FileKind::Symlink,
        hash: Hash::of(target.as_bytes()),
        target: target.to_string(),
        mode: 0o777,
        ..dir(path, version)
    }
}

/// The deletion of `r`, made by device `by`.
fn tombstone(r: &FileRecord, by: u8) -> FileRecord {
    FileRecord {
        deleted: true,
        size: 0,
        hash: Hash::ZERO,
        chunks: Vec::new(),
        target: String::new(),
        version: r.version.incremented(short(by), 0),
        modified_by: short(by),
        sequence: 0,
        ..r.clone()
    }
}

fn change(record: FileRecord, op: Op) -> Change {
    Change {
        record,
        op,
        local: None,
        source: None,
        detail: None,
    }
}

fn open(dir: &TempDir) -> (Journal, PathBuf) {
    let path = dir.path().join("journal.db");
    (Journal::open(&path).unwrap(), path)
}

fn all_history(j: &Journal, f: &FolderId) -> Vec<meshfs_daemon::journal::HistoryEntry> {
    j.history(f, &HistoryQuery::default()).unwrap()
}

fn sequences(h: &[meshfs_daemon::journal::HistoryEntry]) -> Vec<u64> {
    h.iter().map(|e| e.sequence).collect()
}

fn paths_of(h: &[meshfs_daemon::journal::HistoryEntry]) -> Vec<String> {
    h.iter().map(|e| e.path.to_string()).collect()
}

// ---- opening, schema, migrations ----

#[test]
fn a_missing_journal_is_created_and_folders_get_random_nonzero_index_ids() {
    let tmp = TempDir::new().unwrap();
    let (mut j, path) = open(&tmp);
    assert!(path.exists());
    assert!(j.schema_version() >= 1);
    let a = j.folder(&folder()).unwrap();
    let b = j.folder(&other_folder()).unwrap();
    assert_ne!(a.index_id, 0);
    assert_ne!(b.index_id, 0);
    assert_ne!(a.index_id, b.index_id);
    assert_eq!(a.max_sequence, 0);
    assert_eq!(
        j.folder(&folder()).unwrap(),
        a,
        "asking again creates nothing new"
    );
    assert_eq!(
        j.folders().unwrap(),
        vec![(other_folder(), b), (folder(), a)]
    );
}

#[test]
fn a_journal_in_a_missing_directory_gives_an_error_naming_the_path() {
    let tmp = TempDir::new().unwrap();
    let path = tmp.path().join("no-such-dir").join("journal.db");
    let err = Journal::open(&path).unwrap_err();
    assert!(matches!(err, JournalError::CannotOpen { .. }), "{err:?}");
    assert!(err.to_string().contains("no-such-dir"), "{err}");
}

#[test]
fn an_empty_file_is_migrated_to_the_latest_schema() {
    let tmp = TempDir::new().unwrap();
    let path = tmp.path().join("journal.db");
    std::fs::write(&path, b"").unwrap();
    let mut j = Journal::open(&path).unwrap();
    let latest = j.schema_version();
    j.commit(&folder(), vec![change(dir("a", vv(&[(1, 1)])), Op::Create)])
        .unwrap();
    drop(j);
    assert_eq!(Journal::open(&path).unwrap().schema_version(), latest);
}

#[test]
fn schema_3_gives_multi_chunk_files_their_chunk_list_hash() {
    let tmp = TempDir::new().unwrap();
    let path = tmp.path().join("journal.db");
    let big = file_parts("big", &[b"first part", b"second part"], vv(&[(1, 1)]));
    let small = file("small", b"one chunk", vv(&[(1, 2)]));
    let mut j = Journal::open(&path).unwrap();
    j.commit(
        &folder(),
        vec![
            change(big.clone(), Op::Create),
            change(small.clone(), Op::Create),
        ],
    )
    .unwrap();
    drop(j);
    // Rewind to schema 2, where a file's hash was blake3 of its whole content.
    {
        let c = rusqlite::Connection::open(&path).unwrap();
        let old = Hash::of(b"first partsecond part");
        c.execute(
            "UPDATE records SET hash = ?1 WHERE path = 'big'",
            [&old.0[..]],
        )
        .unwrap();
        c.execute(
            "UPDATE history SET hash = ?1 WHERE path = 'big'",
            [&old.0[..]],
        )
        .unwrap();
        // Without what later migrations added (4: the deferred table, 5: the WAL mark, 6:
        // versions and roles, 7: files on demand, 8: their last uses).
        c.execute_batch(
            "DROP TABLE deferred; DROP TABLE wal_mark; DROP TABLE versions; DROP TABLE pruned; \
             DROP TABLE held; DROP TABLE local_only; DROP TABLE absent; DROP TABLE pins; \
             DROP TABLE used; PRAGMA user_version = 2;",
        )
        .unwrap();
    }
    let j = Journal::open(&path).unwrap();
    assert!(j.schema_version() >= 3);
    let got = |path: &str| j.get(&folder(), &p(path)).unwrap().unwrap();
    assert_eq!(got("big").record.hash, Hash::of_chunks(&big.chunks));
    assert_eq!(got("small").record.hash, Hash::of(b"one chunk"));
    assert_eq!(got("small").record.hash, small.hash);
}

#[test]
fn an_sqlite_file_at_schema_version_zero_is_migrated() {
    let tmp = TempDir::new().unwrap();
    // A database with a header but no tables and user_version 0, as SQLite leaves it.
    let plain = tmp.path().join("plain.db");
    {
        let c = rusqlite::Connection::open(&plain).unwrap();
        c.execute_batch("CREATE TABLE t (x); DROP TABLE t; PRAGMA user_version = 0;")
            .unwrap();
    }
    let mut j = Journal::open(&plain).unwrap();
    assert!(j.schema_version() >= 1);
    assert_eq!(
        j.commit(&folder(), vec![change(dir("a", vv(&[(1, 1)])), Op::Create)])
            .unwrap(),
        vec![1]
    );

    // Marked as meshfs's but never migrated (a crash during the first open).
    let marked = tmp.path().join("marked.db");
    {
        let c = rusqlite::Connection::open(&marked).unwrap();
        c.execute_batch("PRAGMA application_id = 1836279910; PRAGMA user_version = 0;")
            .unwrap();
    }
    assert!(Journal::open(&marked).unwrap().schema_version() >= 1);
}

#[test]
fn a_file_that_is_not_sqlite_gives_an_error_naming_the_path_and_is_left_alone() {
    let tmp = TempDir::new().unwrap();
    let path = tmp.path().join("notes.txt");
    let text = "these are my notes, not a database\n".repeat(200);
    std::fs::write(&path, &text).unwrap();
    let err = Journal::open(&path).unwrap_err();
    assert!(matches!(err, JournalError::NotAJournal { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    assert!(msg.contains("not a meshfs journal"), "{msg}");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), text);
}

#[test]
fn an_sqlite_database_of_another_program_is_refused_untouched() {
    let tmp = TempDir::new().unwrap();
    let path = tmp.path().join("cookies.sqlite");
    {
        let c = rusqlite::Connection::open(&path).unwrap();
        c.execute_batch("CREATE TABLE cookies (name TEXT); INSERT INTO cookies VALUES ('x');")
            .unwrap();
    }
    let before = std::fs::read(&path).unwrap();
    let err = Journal::open(&path).unwrap_err();
    assert!(matches!(err, JournalError::NotAJournal { .. }), "{err:?}");
    assert!(err.to_string().contains("cookies.sqlite"), "{err}");
    assert_eq!(
        std::fs::read(&path).unwrap(),
        before,
        "not one byte changed"
    );
    assert!(!tmp.path().join("cookies.sqlite-wal").exists());
}

#[test]
fn a_journal_written_by_a_newer_meshfs_is_refused() {
    let tmp = TempDir::new().unwrap();
    let (j, path) = open(&tmp);
    drop(j);
    rusqlite::Connection::open(&path)
        .unwrap()
        .execute_batch("PRAGMA user_version = 999;")
        .unwrap();
    let err = Journal::open(&path).unwrap_err();
    assert!(
        matches!(err, JournalError::TooNew { found: 999, .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("upgrade meshfs"), "{err}");
}

#[test]
fn a_stored_row_that_does_not_decode_gives_a_corrupt_error_naming_folder_and_path() {
    let tmp = TempDir::new().unwrap();
    let (mut j, path) = open(&tmp);
    j.commit(
        &folder(),
        vec![change(
            file("docs/a.txt", b"hello", vv(&[(1, 1)])),
            Op::Create,
        )],
    )
    .unwrap();
    rusqlite::Connection::open(&path)
        .unwrap()
        .execute("UPDATE records SET version = x'ff'", [])
        .unwrap();
    let err = j.get(&folder(), &p("docs/a.txt")).unwrap_err();
    assert!(matches!(err, JournalError::Corrupt { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("work") && msg.contains("docs/a.txt"), "{msg}");
    assert!(j
        .for_each_record(&folder(), &mut |_| ControlFlow::Continue(()))
        .is_err());
}

// ---- durability and atomicity ----

#[test]
fn reopen_after_close_keeps_everything() {
    let tmp = TempDir::new().unwrap();
    let (mut j, path) = open(&tmp);
    let f = folder();
    let state = j.folder(&f).unwrap();
    let a = file_parts("docs/a.txt", &[b"first chunk", b"second"], vv(&[(1, 1)]));
    let gone = tombstone(&dir("old", vv(&[(1, 1)])), 2);
    let local = LocalStat {
        inode: 42,
        size: 17,
        mtime_ns: -5,
        ctime_ns: 7,
        mode: 0o100644,
    };
    j.commit_at(
        &f,
        vec![
            Change {
                local: Some(local),
                detail: Some("{\"from\":\"a.tmp\"}".into()),
                ..change(a.clone(), Op::Rename)
            },
            change(dir("docs", vv(&[(1, 1)])), Op::Create),
            Change {
                source: Some(dev(2)),
                ..change(symlink("link", "docs/a.txt", vv(&[(2, 3)])), Op::Create)
            },
            change(gone, Op::Delete),
        ],
        1_000,
    )
    .unwrap();
    let pending = file("incoming", b"remote", vv(&[(2, 4)]));
    j.put_pending(&f, &[(pending.clone(), Some(dev(2)))])
        .unwrap();
    j.set_their_sequence(&f, &dev(2), 77, 12).unwrap();
    j.set_our_acked(&f, &dev(2), 3).unwrap();

    let mut records = Vec::new();
    j.for_each_record(&f, &mut |r| {
        records.push(r);
        ControlFlow::Continue(())
    })
    .unwrap();
    let history = all_history(&j, &f);
    let chunk = a.chunks[1].hash;
    let located = j.find_chunk(&f, &chunk).unwrap();
    assert_eq!(
        located,
        vec![ChunkLocation {
            folder: f.clone(),
            path: p("docs/a.txt"),
            offset: 11,
            len: 6,
            local: Some(local),
        }]
    );
    drop(j);

    let mut j = Journal::open(&path).unwrap();
    assert_eq!(
        j.folder(&f).unwrap(),
        FolderState {
            index_id: state.index_id,
            max_sequence: 4
        }
    );
    let mut again = Vec::new();
    j.for_each_record(&f, &mut |r| {
        again.push(r);
        ControlFlow::Continue(())
    })
    .unwrap();
    assert_eq!(again, records);
    assert_eq!(
        j.get(&f, &p("docs/a.txt")).unwrap(),
        Some(StoredRecord {
            record: FileRecord {
                sequence: 1,
                ..a.clone()
            },
            local: Some(local),
            source: None
        })
    );
    assert_eq!(all_history(&j, &f), history);
    assert_eq!(history.len(), 4);
    assert_eq!(history[0].op, Op::Rename);
    assert_eq!(history[0].detail.as_deref(), Some("{\"from\":\"a.tmp\"}"));
    assert_eq!(history[2].source, Some(dev(2)));
    assert_eq!(history[3].op, Op::Delete);
    assert!(history.iter().all(|h| h.time_ns == 1_000));
    assert_eq!(j.find_chunk(&f, &chunk).unwrap(), located);
    assert_eq!(j.pending(&f).unwrap(), vec![(pending, Some(dev(2)))]);
    assert_eq!(
        j.peer_progress(&f, &dev(2)).unwrap(),
        PeerProgress {
            their_index_id: 77,
            their_sequence: 12,
            our_acked: 3
        }
    );
}

#[test]
fn a_commit_that_fails_midway_leaves_no_partial_change_and_sequences_stay_gapless() {
    let tmp = TempDir::new().unwrap();
    let (mut j, _) = open(&tmp);
    let f = folder();
    let a1 = file("a", b"one", vv(&[(1, 1)]));
    j.commit(&f, vec![change(a1.clone(), Op::Create)]).unwrap();
    let incoming = file("c", b"from a peer", vv(&[(2, 1)]));
    j.put_pending(&f, &[(incoming.clone(), Some(dev(2)))])
        .unwrap();

    // The third change is invalid (its chunks do not add up to its size): commit must fail
    // after the first two were written inside the transaction, and roll them back.
    let a2 = file("a", b"two", vv(&[(1, 2)]));
    let mut broken = file("b", b"broken", vv(&[(1, 1)]));
    broken.size += 1;
    let err = j
        .commit(
            &f,
            vec![
                change(a2.clone(), Op::Modify),
                change(incoming.clone(), Op::Create),
                change(broken, Op::Create),
            ],
        )
        .unwrap_err();
    assert!(matches!(err, JournalError::InvalidRecord { .. }), "{err:?}");

    assert_eq!(
        j.get(&f, &p("a")).unwrap().unwrap().record.version,
        a1.version
    );
    assert_eq!(j.get(&f, &p("c")).unwrap(), None);
    assert_eq!(j.folder(&f).unwrap().max_sequence, 1);
    assert_eq!(sequences(&all_history(&j, &f)), vec![1]);
    assert!(j.find_chunk(&f, &a2.chunks[0].hash).unwrap().is_empty());
    assert!(!j.find_chunk(&f, &a1.chunks[0].hash).unwrap().is_empty());
    assert_eq!(
        j.pending(&f).unwrap().len(),
        1,
        "the pending row is still there"
    );

    assert_eq!(
        j.commit(
            &f,
            vec![change(a2, Op::Modify), change(incoming, Op::Create)]
        )
        .unwrap(),
        vec![2, 3]
    );
    assert_eq!(sequences(&all_history(&j, &f)), vec![1, 2, 3]);
    assert!(j.pending(&f).unwrap().is_empty());
}

#[test]
fn a_transaction_abandoned_by_a_dropped_connection_leaves_nothing() {
    let tmp = TempDir::new().unwrap();
    let (mut j, path) = open(&tmp);
    let f = folder();
    j.commit(&f, vec![change(file("a", b"1", vv(&[(1, 1)])), Op::Create)])
        .unwrap();
    {
        // Another writer takes the lock, writes half of a change, and goes away uncommitted.
        let raw = rusqlite::Connection::open(&path).unwrap();
        raw.execute_batch(
            "BEGIN IMMEDIATE;
             UPDATE folders SET max_sequence = 2;
             UPDATE records SET sequence = 2, deleted = 1;",
        )
        .unwrap();
    }
    let j2 = Journal::open(&path).unwrap();
    let r = j2.get(&f, &p("a")).unwrap().unwrap();
    assert_eq!((r.record.sequence, r.record.deleted), (1, false));
    drop(j2);
    assert_eq!(
        j.commit(&f, vec![change(file("b", b"2", vv(&[(1, 1)])), Op::Create)])
            .unwrap(),
        vec![2]
    );
    assert_eq!(sequences(&all_history(&j, &f)), vec![1, 2]);
}

const KILL_CHILD_ENV: &str = "MESHFS_JOURNAL_KILL_TEST_DB";
const KILL_BATCH: u64 = 400;

/// Run by `a_process_killed_during_commits_leaves_only_whole_batches` in a child process.
#[test]
#[ignore = "helper process of a_process_killed_during_commits_leaves_only_whole_batches"]
fn helper_commits_batches_until_killed() {
    let Some(db) = std::env::var_os(KILL_CHILD_ENV) else {
        return;
    };
    let mut j = Journal::open(Path::new(&db)).unwrap();
    let f = folder();
    let mut counter = j.folder(&f).unwrap().max_sequence;
    loop {
        let batch = (0..KILL_BATCH)
            .map(|i| {
                counter += 1;
                let content = format!("version {counter}");
                let path = format!("d{}/f{i}", i % 7);
                change(
                    file(&path, content.as_bytes(), vv(&[(1, counter)])),
                    Op::Modify,
                )
            })
            .collect();
        j.commit(&f, batch).unwrap();
    }
}

#[test]
fn a_process_killed_during_commits_leaves_only_whole_batches() {
    let tmp = TempDir::new().unwrap();
    let db = tmp.path().join("journal.db");
    let f = folder();
    let exe = std::env::current_exe().unwrap();
    let mut last_max = 0;
    for delay_ms in [60, 110, 170, 240, 320] {
        let mut child = Command::new(&exe)
            .args([
                "helper_commits_batches_until_killed",
                "--exact",
                "--ignored",
                "--test-threads=1",
            ])
            .env(KILL_CHILD_ENV, &db)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(delay_ms));
        child.kill().unwrap(); // SIGKILL: no destructor, no rollback, no checkpoint
        child.wait().unwrap();

        // The next round's helper continues from here: the check after it proves that the
        // sequence continues gapless across crashes.
        let mut j = Journal::open(&db).unwrap();
        let max = j.folder(&f).unwrap().max_sequence;
        assert_eq!(max % KILL_BATCH, 0, "a batch was committed in part");
        assert!(max >= last_max, "committed batches were lost");
        last_max = max;
        let history = all_history(&j, &f);
        assert_eq!(sequences(&history), (1..=max).collect::<Vec<_>>());
        assert_eq!(j.counts(&f).unwrap(), j.recount(&f).unwrap());
        let current = j.records_since(&f, 0, usize::MAX).unwrap();
        assert_eq!(current.len() as u64, max.min(KILL_BATCH));
        for r in &current {
            let h = &history[(r.record.sequence - 1) as usize];
            assert_eq!((&h.path, &h.version), (&r.record.path, &r.record.version));
            let at = j.find_chunk(&f, &r.record.chunks[0].hash).unwrap();
            assert_eq!(at.len(), 1);
            assert_eq!(at[0].path, r.record.path);
        }
    }
    assert!(
        last_max > 0,
        "the helper never committed: is the test binary runnable?"
    );
}

// ---- sequences and current records ----

#[test]
fn commit_assigns_increasing_gapless_sequences_per_folder() {
    let tmp = TempDir::new().unwrap();
    let (mut j, _) = open(&tmp);
    let (f, g) = (folder(), other_folder());
    let v = vv(&[(1, 1)]);
    assert_eq!(
        j.commit(
            &f,
            vec![
                change(dir("a", v.clone()), Op::Create),
                change(dir("b", v.clone()), Op::Create),
                change(dir("c", v.clone()), Op::Create),
            ]
        )
        .unwrap(),
        vec![1, 2, 3]
    );
    assert_eq!(
        j.commit(&g, vec![change(dir("a", v.clone()), Op::Create)])
            .unwrap(),
        vec![1]
    );
    assert_eq!(
        j.commit(
            &f,
            vec![
                change(dir("d", v.clone()), Op::Create),
                change(dir("a", vv(&[(1, 2)])), Op::Metadata),
            ]
        )
        .unwrap(),
        vec![4, 5]
    );
    assert_eq!(j.commit(&f, Vec::new()).unwrap(), Vec::<u64>::new());
    assert_eq!(j.folder(&f).unwrap().max_sequence, 5);
    assert_eq!(j.get(&f, &p("a")).unwrap().unwrap().record.sequence, 5);
    assert_eq!(j.get(&g, &p("a")).unwrap().unwrap().record.sequence, 1);
}

#[test]
fn the_same_path_twice_in_one_commit_keeps_the_later_version_and_both_history_rows() {
    let tmp = TempDir::new().unwrap();
    let (mut j, _) = open(&tmp);
    let f = folder();
    let first = file("a", b"first", vv(&[(1, 1)]));
    let second = file("a", b"second", vv(&[(1, 2)]));
    j.commit(
        &f,
        vec![
            change(first.clone(), Op::Create),
            change(second.clone(), Op::Modify),
        ],
    )
    .unwrap();
    let r = j.get(&f, &p("a")).unwrap().unwrap();
    assert_eq!(
        r.record,
        FileRecord {
            sequence: 2,
            ..second.clone()
        }
    );
    assert_eq!(sequences(&all_history(&j, &f)), vec![1, 2]);
    assert!(j.find_chunk(&f, &first.chunks[0].hash).unwrap().is_empty());
    assert_eq!(j.find_chunk(&f, &second.chunks[0].hash).unwrap().len(), 1);
}

#[test]
fn records_since_pages_through_the_current_records_in_sequence_order() {
    let tmp = TempDir::new().unwrap();
    let (mut j, _) = open(&tmp);
    let f = folder();
    let batch = (0..10)
        .map(|i| change(dir(&format!("d{i}"), vv(&[(1, 1)])), Op::Create))
        .collect();
    j.commit(&f, batch).unwrap();
    // d3 and d7 change again: they move to the end, their old sequences disappear.
    j.commit(
        &f,
        vec![
            change(dir("d7", vv(&[(1, 2)])), Op::Metadata),
            change(dir("d3", vv(&[(1, 2)])), Op::Metadata),
        ],
    )
    .unwrap();
    let mut pages = Vec::new();
    let mut after = 0;
    loop {
        let page = j.records_since(&f, after, 3).unwrap();
        if page.is_empty() {
            break;
        }
        assert!(page.len() <= 3);
        after = page.last().unwrap().record.sequence;
        pages.extend(page);
    }
    let order: Vec<(String, u64)> = pages
        .iter()
        .map(|r| (r.record.path.to_string(), r.record.sequence))
        .collect();
    let expected: Vec<(String, u64)> = [0, 1, 2, 4, 5, 6, 8, 9]
        .iter()
        .map(|&i| (format!("d{i}"), i + 1))
        .chain([("d7".to_string(), 11), ("d3".to_string(), 12)])
        .collect();
    assert_eq!(order, expected);
    assert!(j.records_since(&f, 12, 100).unwrap().is_empty());
    assert_eq!(j.records_since(&f, 10, 100).unwrap().len(), 2);
    assert!(j.records_since(&other_folder(), 0, 100).unwrap().is_empty());
}

#[test]
fn tombstones_keep_their_version_vector() {
    let tmp = TempDir::new().unwrap();
    let (mut j, _) = open(&tmp);
    let f = folder();
    let a = file("a", b"content", vv(&[(1, 3)]));
    j.commit(&f, vec![change(a.clone(), Op::Create)]).unwrap();
    let gone = tombstone(&a, 2);
    j.commit(&f, vec![change(gone.clone(), Op::Delete)])
        .unwrap();
    let r = j.get(&f, &p("a")).unwrap().unwrap();
    assert!(r.record.deleted);
    assert_eq!(r.record.version, vv(&[(1, 3), (2, 1)]));
    assert_eq!(r.record.modified_by, short(2));
    assert_eq!(r.record.kind, FileKind::File);
    let last = all_history(&j, &f).pop().unwrap();
    assert_eq!((last.op, last.deleted), (Op::Delete, true));
    assert_eq!(last.version, gone.version);
}

#[test]
fn the_chunk_index_follows_a_files_changes_and_deletion() {
    let tmp = TempDir::new().unwrap();
    let (mut j, _) = open(&tmp);
    let (f, g) = (folder(), other_folder());
    // A chunk shorter than INDEXED_FROM is indexed only as a file's last: c1 is long enough
    // to be found anywhere in a file, c2 and c3 only at a file's end.
    let long = [&b"alpha-"[..], &vec![b'a'; INDEXED_FROM as usize - 6]].concat();
    let (c1, c2, c3) = (&long[..], &b"beta"[..], &b"gamma"[..]);
    let n1 = INDEXED_FROM;
    let h = |c: &[u8]| Hash::of(c);
    let loc = |folder: &FolderId, path: &str, offset: u64, len: u32| ChunkLocation {
        folder: folder.clone(),
        path: p(path),
        offset,
        len,
        local: None,
    };
    j.commit(
        &f,
        vec![change(
            file_parts("a", &[c1, c2], vv(&[(1, 1)])),
            Op::Create,
        )],
    )
    .unwrap();
    assert_eq!(j.find_chunk(&f, &h(c1)).unwrap(), vec![loc(&f, "a", 0, n1)]);
    assert_eq!(
        j.find_chunk(&f, &h(c2)).unwrap(),
        vec![loc(&f, "a", u64::from(n1), 4)]
    );

    // Modified: its old chunks are no longer there.
    j.commit(
        &f,
        vec![change(file_parts("a", &[c3], vv(&[(1, 2)])), Op::Modify)],
    )
    .unwrap();
    assert!(j.find_chunk(&f, &h(c1)).unwrap().is_empty());
    assert_eq!(j.find_chunk(&f, &h(c3)).unwrap(), vec![loc(&f, "a", 0, 5)]);

    // A copy in this folder and one in another folder.
    j.commit(
        &f,
        vec![change(
            file_parts("b", &[c2, c3], vv(&[(1, 1)])),
            Op::Create,
        )],
    )
    .unwrap();
    j.commit(
        &g,
        vec![change(file_parts("z", &[c3], vv(&[(1, 1)])), Op::Create)],
    )
    .unwrap();
    let mut here = j.find_chunk(&f, &h(c3)).unwrap();
    here.sort_by(|x, y| x.path.cmp(&y.path));
    assert_eq!(here, vec![loc(&f, "a", 0, 5), loc(&f, "b", 4, 5)]);
    assert_eq!(j.find_chunk(&g, &h(c3)).unwrap(), vec![loc(&g, "z", 0, 5)]);
    assert_eq!(j.find_chunk_anywhere(&h(c3)).unwrap().len(), 3);
    // A whole request at once finds what each lookup finds, in the request's order.
    let asked = [h(c3), h(b"nowhere"), h(c2)];
    let each: Vec<_> = asked.iter().map(|x| j.find_chunk(&f, x).unwrap()).collect();
    assert_eq!(j.find_chunks(&f, &asked), each);
    // Inside a read transaction someone else began, and leaving it open: a write after it still
    // commits and is seen.
    j.begin_reads();
    assert_eq!(j.find_chunks(&f, &asked), each);
    j.commit(
        &f,
        vec![change(file_parts("c", &[c1], vv(&[(1, 1)])), Op::Create)],
    )
    .unwrap();
    assert_eq!(j.find_chunks(&f, &[h(c1)]), vec![vec![loc(&f, "c", 0, n1)]]);
    j.end_reads();

    // Deleted, or replaced by a directory: gone from the index.
    let a = j.get(&f, &p("a")).unwrap().unwrap().record;
    j.commit(
        &f,
        vec![
            change(tombstone(&a, 1), Op::Delete),
            change(dir("b", vv(&[(1, 2)])), Op::Create),
        ],
    )
    .unwrap();
    assert!(j.find_chunk(&f, &h(c3)).unwrap().is_empty());
    assert!(j.find_chunk(&f, &h(c2)).unwrap().is_empty());
    assert_eq!(
        j.find_chunk_anywhere(&h(c3)).unwrap(),
        vec![loc(&g, "z", 0, 5)]
    );
}

#[test]
fn a_deferred_version_outlives_a_reopen_until_that_version_is_cleared() {
    let tmp = TempDir::new().unwrap();
    let (mut j, path) = open(&tmp);
    let f = folder();
    let a = file("a", b"remote a", vv(&[(2, 1)]));
    let b = file("b", b"remote b", vv(&[(2, 2)]));
    let b2 = file("b", b"remote b, newer", vv(&[(2, 3)]));
    j.put_deferred(&f, &b, &dev(2)).unwrap();
    j.put_deferred(&f, &a, &dev(3)).unwrap();
    drop(j);
    let mut j = Journal::open(&path).unwrap();
    assert_eq!(
        j.deferred(&f).unwrap(),
        vec![(a.clone(), dev(3)), (b.clone(), dev(2))],
        "kept across a reopen, ordered by path"
    );
    j.put_deferred(&f, &b2, &dev(2)).unwrap();
    // The older version of b was decided meanwhile: clearing it keeps the newer one.
    j.clear_deferred(&f, &b).unwrap();
    j.clear_deferred(&f, &a).unwrap();
    assert_eq!(j.deferred(&f).unwrap(), vec![(b2.clone(), dev(2))]);
    assert!(j.deferred(&other_folder()).unwrap().is_empty());
    j.put_deferred(&f, &a, &dev(3)).unwrap();
    j.forget_peer(&dev(3)).unwrap();
    assert_eq!(
        j.deferred(&f).unwrap(),
        vec![(b2.clone(), dev(2))],
        "a removed peer's versions go with it"
    );
    j.remove_folder(&f).unwrap();
    assert!(j.deferred(&f).unwrap().is_empty());
}

#[test]
fn commit_clears_the_pending_row_of_each_path_it_journals() {
    let tmp = TempDir::new().unwrap();
    let (mut j, _) = open(&tmp);
    let f = folder();
    let a = file("a", b"remote a", vv(&[(2, 1)]));
    let b = file("b", b"remote b", vv(&[(2, 2)]));
    let b2 = file("b", b"remote b, newer", vv(&[(2, 3)]));
    j.put_pending(&f, &[(b.clone(), Some(dev(2))), (a.clone(), None)])
        .unwrap();
    assert_eq!(
        j.pending(&f).unwrap(),
        vec![(a.clone(), None), (b.clone(), Some(dev(2)))],
        "ordered by path"
    );
    j.put_pending(&f, &[(b2.clone(), Some(dev(3)))]).unwrap();
    assert_eq!(
        j.pending(&f).unwrap(),
        vec![(a.clone(), None), (b2.clone(), Some(dev(3)))],
        "a new pending version of a path replaces the old one"
    );
    j.commit(
        &f,
        vec![Change {
            source: Some(dev(2)),
            ..change(a, Op::Create)
        }],
    )
    .unwrap();
    assert_eq!(j.pending(&f).unwrap(), vec![(b2, Some(dev(3)))]);
    j.clear_pending(&f, &[p("b"), p("never-pending")]).unwrap();
    assert!(j.pending(&f).unwrap().is_empty());
    assert!(j.pending(&other_folder()).unwrap().is_empty());
}

#[test]
fn an_invalid_pending_record_is_refused_and_nothing_of_the_batch_is_written() {
    let tmp = TempDir::new().unwrap();
    let (mut j, _) = open(&tmp);
    let f = folder();
    let good = file("a", b"ok", vv(&[(2, 1)]));
    let bad = FileRecord {
        version: VersionVector::new(),
        ..file("b", b"no version", vv(&[(2, 1)]))
    };
    let err = j.put_pending(&f, &[(good, None), (bad, None)]).unwrap_err();
    assert!(matches!(err, JournalError::InvalidRecord { .. }), "{err:?}");
    assert!(j.pending(&f).unwrap().is_empty());
}

#[test]
fn below_and_has_live_below_see_exactly_the_subtree() {
    let tmp = TempDir::new().unwrap();
    let (mut j, _) = open(&tmp);
    let f = folder();
    let v = vv(&[(1, 1)]);
    let names = ["a", "a/b", "a/b/c", "a.txt", "a0", "ab/x", "a-b", "a/é"];
    j.commit(
        &f,
        names
            .iter()
            .map(|n| change(dir(n, v.clone()), Op::Create))
            .collect(),
    )
    .unwrap();
    let below = |j: &Journal, d: &str| -> Vec<String> {
        j.below(&f, &p(d))
            .unwrap()
            .iter()
            .map(|r| r.record.path.to_string())
            .collect()
    };
    assert_eq!(below(&j, "a"), vec!["a/b", "a/b/c", "a/é"]);
    assert_eq!(below(&j, "a/b"), vec!["a/b/c"]);
    assert!(below(&j, "a/b/c").is_empty());
    assert!(j.has_live_below(&f, &p("a")).unwrap());
    assert!(!j.has_live_below(&f, &p("a.txt")).unwrap());

    let gone: Vec<Change> = ["a/b", "a/b/c", "a/é"]
        .iter()
        .map(|n| change(tombstone(&dir(n, v.clone()), 1), Op::Delete))
        .collect();
    j.commit(&f, gone).unwrap();
    assert!(!j.has_live_below(&f, &p("a")).unwrap());
    assert_eq!(below(&j, "a").len(), 3, "tombstones are still below");
    assert!(!j.has_live_below(&other_folder(), &p("a")).unwrap());
}

#[test]
fn for_each_record_visits_every_record_in_path_order_and_stops_when_asked() {
    let tmp = TempDir::new().unwrap();
    let (mut j, _) = open(&tmp);
    let f = folder();
    let v = vv(&[(1, 1)]);
    let names = ["b", "a/z", "a", "c", "a.b"];
    j.commit(
        &f,
        names
            .iter()
            .map(|n| change(dir(n, v.clone()), Op::Create))
            .collect(),
    )
    .unwrap();
    j.commit(
        &f,
        vec![change(tombstone(&dir("c", v.clone()), 1), Op::Delete)],
    )
    .unwrap();
    let mut seen = Vec::new();
    j.for_each_record(&f, &mut |r| {
        seen.push(r.record.path.to_string());
        ControlFlow::Continue(())
    })
    .unwrap();
    assert_eq!(
        seen,
        vec!["a", "a.b", "a/z", "b", "c"],
        "byte order, tombstones too"
    );
    let mut first_two = Vec::new();
    j.for_each_record(&f, &mut |r| {
        first_two.push(r.record.path.to_string());
        if first_two.len() == 2 {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    })
    .unwrap();
    assert_eq!(first_two, vec!["a", "a.b"]);
}

#[test]
fn set_local_stat_records_the_disk_state_without_a_new_version_or_history() {
    let tmp = TempDir::new().unwrap();
    let (mut j, _) = open(&tmp);
    let f = folder();
    let a = file("a", b"x", vv(&[(1, 1)]));
    j.commit(&f, vec![change(a.clone(), Op::Create)]).unwrap();
    let stat = LocalStat {
        inode: u64::MAX,
        size: 1,
        mtime_ns: 5,
        ctime_ns: 6,
        mode: 0o100600,
    };
    j.set_local_stat(&f, &p("a"), stat).unwrap();
    j.set_local_stat(&f, &p("missing"), stat).unwrap();
    let r = j.get(&f, &p("a")).unwrap().unwrap();
    assert_eq!(r.local, Some(stat));
    assert_eq!(r.record, FileRecord { sequence: 1, ..a });
    assert_eq!(j.get(&f, &p("missing")).unwrap(), None);
    assert_eq!(j.folder(&f).unwrap().max_sequence, 1);
    assert_eq!(all_history(&j, &f).len(), 1);
    let stat2 = LocalStat { inode: 9, ..stat };
    j.set_local_stats(&f, &[(p("a"), stat2)]).unwrap();
    assert_eq!(j.get(&f, &p("a")).unwrap().unwrap().local, Some(stat2));
}

// ---- history ----

/// docs (dir), docs/a.txt, docs/sub/b.txt, docs.txt, docs-old/c, other — by devices 1 and 2,
/// at times 100, 200, 300 (two changes each).
fn history_fixture() -> (TempDir, Journal) {
    let tmp = TempDir::new().unwrap();
    let (mut j, _) = open(&tmp);
    let f = folder();
    j.commit_at(
        &f,
        vec![
            change(dir("docs", vv(&[(1, 1)])), Op::Create),
            change(file("docs/a.txt", b"a", vv(&[(1, 1)])), Op::Create),
        ],
        100,
    )
    .unwrap();
    j.commit_at(
        &f,
        vec![
            change(file("docs/sub/b.txt", b"b", vv(&[(2, 1)])), Op::Create),
            change(file("docs.txt", b"t", vv(&[(2, 1)])), Op::Create),
        ],
        200,
    )
    .unwrap();
    j.commit_at(
        &f,
        vec![
            change(file("docs-old/c", b"c", vv(&[(1, 1)])), Op::Create),
            change(file("docs/a.txt", b"a2", vv(&[(1, 1), (2, 1)])), Op::Modify),
        ],
        300,
    )
    .unwrap();
    j.commit_at(
        &f,
        vec![change(file("other", b"o", vv(&[(2, 1)])), Op::Create)],
        300,
    )
    .unwrap();
    (tmp, j)
}

fn query(j: &Journal, q: HistoryQuery) -> Vec<u64> {
    sequences(&j.history(&folder(), &q).unwrap())
}

#[test]
fn history_by_path_returns_that_path_and_everything_below_it() {
    let (_tmp, j) = history_fixture();
    let by = |path: &str| {
        paths_of(
            &j.history(
                &folder(),
                &HistoryQuery {
                    path: Some(p(path)),
                    ..Default::default()
                },
            )
            .unwrap(),
        )
    };
    assert_eq!(
        by("docs"),
        vec!["docs", "docs/a.txt", "docs/sub/b.txt", "docs/a.txt"]
    );
    assert_eq!(by("docs/a.txt"), vec!["docs/a.txt", "docs/a.txt"]);
    assert_eq!(by("docs/sub"), vec!["docs/sub/b.txt"]);
    assert_eq!(by("docs.txt"), vec!["docs.txt"]);
    assert!(by("doc").is_empty());
    assert!(by("nothing/here").is_empty());
}

#[test]
fn history_by_device_returns_only_versions_that_device_made() {
    let (_tmp, j) = history_fixture();
    let q = |d: u8| HistoryQuery {
        device: Some(short(d)),
        ..Default::default()
    };
    assert_eq!(query(&j, q(1)), vec![1, 2, 5]);
    assert_eq!(query(&j, q(2)), vec![3, 4, 6, 7]);
    assert!(query(&j, q(3)).is_empty());
    let h = j.history(&folder(), &q(2)).unwrap();
    assert!(h.iter().all(|e| e.modified_by == short(2)));
}

#[test]
fn history_since_time_is_inclusive_and_since_sequence_is_exclusive() {
    let (_tmp, j) = history_fixture();
    let since_time = |t: i64| HistoryQuery {
        since_time_ns: Some(t),
        ..Default::default()
    };
    assert_eq!(query(&j, since_time(200)), vec![3, 4, 5, 6, 7]);
    assert_eq!(query(&j, since_time(201)), vec![5, 6, 7]);
    assert_eq!(query(&j, since_time(0)), vec![1, 2, 3, 4, 5, 6, 7]);
    assert!(query(&j, since_time(301)).is_empty());
    let since_seq = |s: u64| HistoryQuery {
        since_sequence: Some(s),
        ..Default::default()
    };
    assert_eq!(query(&j, since_seq(5)), vec![6, 7]);
    assert_eq!(query(&j, since_seq(0)).len(), 7);
    assert!(query(&j, since_seq(7)).is_empty());
    let h = j.history(&folder(), &since_seq(4)).unwrap();
    assert_eq!(
        h.iter().map(|e| e.time_ns).collect::<Vec<_>>(),
        vec![300, 300, 300]
    );
    // Filters combine.
    assert_eq!(
        query(
            &j,
            HistoryQuery {
                path: Some(p("docs")),
                device: Some(short(2)),
                since_time_ns: Some(150),
                ..Default::default()
            }
        ),
        vec![3, 6]
    );
}

#[test]
fn history_limit_gives_the_most_recent_rows_unless_a_since_is_given() {
    let (_tmp, j) = history_fixture();
    let limit = |n: usize| HistoryQuery {
        limit: Some(n),
        ..Default::default()
    };
    assert_eq!(
        query(&j, limit(3)),
        vec![5, 6, 7],
        "the last three, ascending"
    );
    assert_eq!(query(&j, limit(100)).len(), 7);
    assert!(query(&j, limit(0)).is_empty());
    assert_eq!(
        query(
            &j,
            HistoryQuery {
                since_sequence: Some(2),
                ..limit(3)
            }
        ),
        vec![3, 4, 5],
        "the first three after the point"
    );
    assert_eq!(
        query(
            &j,
            HistoryQuery {
                since_time_ns: Some(100),
                ..limit(2)
            }
        ),
        vec![1, 2]
    );
    // The page's newest-first view: the last rows after the point, not the first.
    assert_eq!(
        query(
            &j,
            HistoryQuery {
                since_sequence: Some(2),
                newest: true,
                ..limit(3)
            }
        ),
        vec![5, 6, 7],
        "the last three after the point"
    );
    assert_eq!(
        query(
            &j,
            HistoryQuery {
                path: Some(p("docs")),
                ..limit(2)
            }
        ),
        vec![3, 6]
    );
    assert!(j.history(&other_folder(), &limit(5)).unwrap().is_empty());
}

#[test]
fn prune_history_keeps_each_path_s_newest_row_and_the_row_of_every_version_still_listed() {
    let (_tmp, mut j) = history_fixture();
    let f = folder();
    // Before 250: `docs` and `docs/sub/b.txt`, `docs.txt` have no later row; the first
    // `docs/a.txt` has (its modification at 300) but is a past version still listed.
    assert_eq!(j.prune_history(&f, 250, usize::MAX).unwrap(), 0);
    let listed = j.all_versions(&f).unwrap();
    assert_eq!(sequences_of(&listed), [2]);
    j.retire_versions(
        &f,
        &[meshfs_daemon::journal::Retired {
            id: listed[0].id,
            reason: "age",
        }],
        260,
    )
    .unwrap();
    assert_eq!(j.prune_history(&f, 250, usize::MAX).unwrap(), 1);
    assert_eq!(sequences(&all_history(&j, &f)), vec![1, 3, 4, 5, 6, 7]);
    assert!(j.get(&f, &p("docs")).unwrap().is_some());
    assert_eq!(j.max_history_sequence(&f).unwrap(), 7);
    assert_eq!(j.records_since(&f, 0, usize::MAX).unwrap().len(), 6);
    // A directory deleted long ago: its deletion stays while its tombstone does, then goes.
    j.commit_at(&f, vec![change(dir("old", vv(&[(1, 2)])), Op::Create)], 400)
        .unwrap();
    j.commit_at(
        &f,
        vec![change(tombstone(&dir("old", vv(&[(1, 2)])), 1), Op::Delete)],
        500,
    )
    .unwrap();
    assert_eq!(j.prune_history(&f, 600, 0).unwrap(), 0, "a batch of none");
    assert_eq!(j.prune_history(&f, 600, 1).unwrap(), 1, "the creation");
    assert_eq!(j.prune_history(&f, 600, 1).unwrap(), 0);
    assert_eq!(j.prune_tombstones(&f, 600).unwrap(), 1);
    assert_eq!(
        j.prune_history(&f, 600, usize::MAX).unwrap(),
        1,
        "the deletion"
    );
    assert!(j
        .history(
            &f,
            &HistoryQuery {
                path: Some(p("old")),
                ..Default::default()
            }
        )
        .unwrap()
        .is_empty());
}

fn sequences_of(v: &[meshfs_daemon::journal::KeptVersion]) -> Vec<u64> {
    v.iter().map(|v| v.record.sequence).collect()
}

#[test]
fn prune_tombstones_removes_only_tombstones_older_than_the_limit() {
    let tmp = TempDir::new().unwrap();
    let (mut j, _) = open(&tmp);
    let f = folder();
    let v = vv(&[(1, 1)]);
    j.commit_at(
        &f,
        vec![
            change(tombstone(&dir("old", v.clone()), 1), Op::Delete),
            change(dir("live", v.clone()), Op::Create),
        ],
        100,
    )
    .unwrap();
    j.commit_at(
        &f,
        vec![change(tombstone(&dir("recent", v.clone()), 1), Op::Delete)],
        300,
    )
    .unwrap();
    assert_eq!(j.prune_tombstones(&f, 200).unwrap(), 1);
    assert_eq!(j.get(&f, &p("old")).unwrap(), None);
    assert!(j.get(&f, &p("recent")).unwrap().is_some());
    assert!(j.get(&f, &p("live")).unwrap().is_some());
    assert_eq!(all_history(&j, &f).len(), 3, "history is kept");
}

#[test]
fn thinning_keeps_the_history_row_of_every_version_still_kept_and_the_newest_of_each_bucket() {
    let dir = TempDir::new().unwrap();
    let (mut j, _) = open(&dir);
    let f = folder();
    // Four saves of one file in one bucket [0, 1000): each replaces the one before, which
    // becomes a past version (a `versions` row).
    let mut seqs = Vec::new();
    for (i, t) in [(1u64, 10i64), (2, 20), (3, 30), (4, 40)] {
        let op = if i == 1 { Op::Create } else { Op::Modify };
        let rec = file("doc", format!("save {i}").as_bytes(), vv(&[(1, i)]));
        seqs.extend(j.commit_at(&f, vec![change(rec, op)], t).unwrap());
    }
    let kept = j.all_versions(&f).unwrap();
    assert_eq!(kept.len(), 3);
    // Retention let go of the second save only (its content); the third is still kept.
    let second = kept.iter().find(|v| v.record.sequence == seqs[1]).unwrap();
    j.retire_versions(
        &f,
        &[meshfs_daemon::journal::Retired {
            id: second.id,
            reason: "thinned",
        }],
        50,
    )
    .unwrap();
    assert_eq!(j.thin_history(&f, 0, 1000, 1000).unwrap(), 1);
    assert_eq!(
        sequences(&all_history(&j, &f)),
        [seqs[0], seqs[2], seqs[3]],
        "the creation, the kept third save, the current fourth"
    );
}

// ---- peers, folders, counts ----

#[test]
fn peer_progress_is_zero_until_recorded_and_forget_peer_clears_every_folder() {
    let tmp = TempDir::new().unwrap();
    let (mut j, _) = open(&tmp);
    let (f, g) = (folder(), other_folder());
    assert_eq!(
        j.peer_progress(&f, &dev(2)).unwrap(),
        PeerProgress::default()
    );
    j.set_their_sequence(&f, &dev(2), 55, 10).unwrap();
    j.set_our_acked(&f, &dev(2), 4).unwrap();
    j.set_their_sequence(&f, &dev(2), 55, 12).unwrap();
    j.set_our_acked(&g, &dev(2), 9).unwrap();
    j.set_our_acked(&f, &dev(3), 1).unwrap();
    assert_eq!(
        j.peer_progress(&f, &dev(2)).unwrap(),
        PeerProgress {
            their_index_id: 55,
            their_sequence: 12,
            our_acked: 4
        }
    );
    assert_eq!(
        j.peer_progress(&g, &dev(2)).unwrap(),
        PeerProgress {
            our_acked: 9,
            ..Default::default()
        }
    );
    j.forget_peer(&dev(2)).unwrap();
    assert_eq!(
        j.peer_progress(&f, &dev(2)).unwrap(),
        PeerProgress::default()
    );
    assert_eq!(
        j.peer_progress(&g, &dev(2)).unwrap(),
        PeerProgress::default()
    );
    assert_eq!(j.peer_progress(&f, &dev(3)).unwrap().our_acked, 1);
}

#[test]
fn reset_index_gives_a_new_index_id_and_forgets_what_peers_acknowledged() {
    let tmp = TempDir::new().unwrap();
    let (mut j, _) = open(&tmp);
    let f = folder();
    j.commit(&f, vec![change(dir("a", vv(&[(1, 1)])), Op::Create)])
        .unwrap();
    let before = j.folder(&f).unwrap();
    j.set_their_sequence(&f, &dev(2), 5, 6).unwrap();
    j.set_our_acked(&f, &dev(2), 1).unwrap();
    let after = j.reset_index(&f).unwrap();
    assert_ne!(after.index_id, before.index_id);
    assert_ne!(after.index_id, 0);
    assert_eq!(after.max_sequence, 1);
    assert_eq!(j.folder(&f).unwrap(), after);
    let progress = j.peer_progress(&f, &dev(2)).unwrap();
    assert_eq!((progress.their_sequence, progress.our_acked), (6, 0));
}

#[test]
fn remove_folder_deletes_every_row_of_that_folder_and_only_that_folder() {
    let tmp = TempDir::new().unwrap();
    let (mut j, _) = open(&tmp);
    let (f, g) = (folder(), other_folder());
    let shared = b"same content in both";
    for x in [&f, &g] {
        j.commit(
            x,
            vec![change(file("a", shared, vv(&[(1, 1)])), Op::Create)],
        )
        .unwrap();
        j.put_pending(x, &[(file("p", b"p", vv(&[(2, 1)])), None)])
            .unwrap();
        j.set_our_acked(x, &dev(2), 1).unwrap();
    }
    j.remove_folder(&f).unwrap();
    assert_eq!(j.get(&f, &p("a")).unwrap(), None);
    assert!(all_history(&j, &f).is_empty());
    assert!(j.pending(&f).unwrap().is_empty());
    assert_eq!(
        j.peer_progress(&f, &dev(2)).unwrap(),
        PeerProgress::default()
    );
    assert_eq!(
        j.find_chunk_anywhere(&Hash::of(shared)).unwrap(),
        vec![ChunkLocation {
            folder: g.clone(),
            path: p("a"),
            offset: 0,
            len: shared.len() as u32,
            local: None,
        }]
    );
    assert_eq!(
        j.folders()
            .unwrap()
            .into_iter()
            .map(|x| x.0)
            .collect::<Vec<_>>(),
        vec![g.clone()]
    );
    assert!(j.get(&g, &p("a")).unwrap().is_some());
    assert_eq!(j.pending(&g).unwrap().len(), 1);
    assert_eq!(
        j.folder(&f).unwrap().max_sequence,
        0,
        "re-added folders start afresh"
    );
    j.remove_folder(&FolderId::new("never-existed").unwrap())
        .unwrap();
}

#[test]
fn counts_follow_every_commit_and_prune_and_match_a_recount() {
    let tmp = TempDir::new().unwrap();
    let (mut j, path) = open(&tmp);
    let f = folder();
    let v = vv(&[(1, 1)]);
    assert_eq!(j.counts(&f).unwrap(), FolderCounts::default());
    j.commit_at(
        &f,
        vec![
            change(file("a", b"12345", v.clone()), Op::Create),
            change(file("b", b"123", v.clone()), Op::Create),
            change(dir("d", v.clone()), Op::Create),
            change(symlink("l", "a", v.clone()), Op::Create),
            change(tombstone(&file("c", b"gone", v.clone()), 1), Op::Delete),
            change(tombstone(&dir("e", v.clone()), 1), Op::Delete),
        ],
        100,
    )
    .unwrap();
    let expected = FolderCounts {
        files: 2,
        dirs: 1,
        symlinks: 1,
        bytes: 8,
        tombstones: 2,
    };
    assert_eq!(j.counts(&f).unwrap(), expected);
    assert_eq!(j.recount(&f).unwrap(), expected);

    // a grows, b is deleted, the dir d becomes a file, c comes back.
    let b = j.get(&f, &p("b")).unwrap().unwrap().record;
    j.commit_at(
        &f,
        vec![
            change(file("a", b"1234567", vv(&[(1, 2)])), Op::Modify),
            change(tombstone(&b, 1), Op::Delete),
            change(file("d", b"xy", vv(&[(1, 2)])), Op::Create),
            change(file("c", b"back", vv(&[(1, 3)])), Op::Create),
        ],
        300,
    )
    .unwrap();
    let expected = FolderCounts {
        files: 3,
        dirs: 0,
        symlinks: 1,
        bytes: 13,
        tombstones: 2,
    };
    assert_eq!(j.counts(&f).unwrap(), expected);
    assert_eq!(j.recount(&f).unwrap(), expected);

    assert_eq!(
        j.prune_tombstones(&f, 200).unwrap(),
        1,
        "e; b is too recent"
    );
    drop(j);
    let j = Journal::open(&path).unwrap();
    let expected = FolderCounts {
        tombstones: 1,
        ..expected
    };
    assert_eq!(j.counts(&f).unwrap(), expected);
    assert_eq!(j.recount(&f).unwrap(), expected);
}

// ---- the law: the current records are the latest version of every path ----

const PROP_PATHS: [&str; 6] = ["a", "a/b", "a/c", "b", "c/d/e", "é"];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn records_since_zero_returns_exactly_the_latest_record_of_each_path_in_sequence_order(
        batches in prop::collection::vec(
            prop::collection::vec((0..PROP_PATHS.len(), 0u8..4, 1u8..4), 0..7),
            1..8,
        ),
        page in 1usize..6,
    ) {
        let tmp = TempDir::new().unwrap();
        let (mut j, _) = open(&tmp);
        let f = folder();
        let mut model: HashMap<&str, FileRecord> = HashMap::new();
        let mut total = 0u64;
        for (b, batch) in batches.iter().enumerate() {
            let mut changes = Vec::new();
            let mut expected = Vec::new();
            for (i, &(pi, what, by)) in batch.iter().enumerate() {
                let path = PROP_PATHS[pi];
                let version = model
                    .get(path)
                    .map(|r| r.version.clone())
                    .unwrap_or_default()
                    .incremented(short(by), 0);
                let content = format!("{path} {b} {i}");
                let record = match what {
                    0 | 1 => file(path, content.as_bytes(), version),
                    2 => dir(path, version),
                    _ => FileRecord {
                        version,
                        ..tombstone(&dir(path, vv(&[(by, 1)])), by)
                    },
                };
                // Later changes in this batch see this one.
                model.insert(path, record.clone());
                expected.push(path);
                changes.push(change(record, Op::Modify));
            }
            let seqs = j.commit(&f, changes).unwrap();
            prop_assert_eq!(seqs.len(), expected.len());
            for (k, (&seq, path)) in seqs.iter().zip(&expected).enumerate() {
                prop_assert_eq!(seq, total + k as u64 + 1);
                if let Some(r) = model.get_mut(path) {
                    r.sequence = seq;
                }
            }
            total += seqs.len() as u64;
        }
        let mut latest: Vec<StoredRecord> = model
            .values()
            .map(|r| StoredRecord { record: r.clone(), local: None, source: None })
            .collect();
        latest.sort_by_key(|r| r.record.sequence);
        let all = j.records_since(&f, 0, usize::MAX).unwrap();
        prop_assert_eq!(&all, &latest);

        let mut paged = Vec::new();
        let mut after = 0;
        loop {
            let got = j.records_since(&f, after, page).unwrap();
            match got.last() {
                None => break,
                Some(r) => after = r.record.sequence,
            }
            paged.extend(got);
        }
        prop_assert_eq!(&paged, &latest);
        prop_assert_eq!(j.folder(&f).unwrap().max_sequence, total);
        prop_assert_eq!(j.counts(&f).unwrap(), j.recount(&f).unwrap());
        prop_assert_eq!(all_history(&j, &f).len() as u64, total);
    }
}

// ---- measurement ----

/// CPU time of this process (user + system), which a loaded machine does not inflate.
fn cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a valid pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// 100,000 one-chunk file records as a first scan produces them: in directory-walk order
/// (`random` scatters them instead, as a worst case for the path indexes).
fn scan_of_100k(round: u64, random: bool) -> Vec<Change> {
    (0..100_000u64)
        .map(|i| {
            let content = format!("file {i} round {round} {}", "x".repeat(40));
            let path = if random {
                format!("dir{:03}/sub{:02}/file{i:06}.txt", i % 1000, i % 37)
            } else {
                format!("dir{:03}/sub{:02}/file{i:06}.txt", i / 100, (i / 10) % 10)
            };
            Change {
                local: Some(LocalStat {
                    inode: i,
                    size: content.len() as u64,
                    mtime_ns: 1,
                    ctime_ns: 1,
                    mode: 0o100644,
                }),
                ..change(
                    file(&path, content.as_bytes(), vv(&[(1, round + 1)])),
                    Op::Create,
                )
            }
        })
        .collect()
}

fn timed_commits(j: &mut Journal, changes: Vec<Change>, batch: usize) -> (Duration, Duration) {
    let (wall, cpu) = (Instant::now(), cpu_time());
    let mut it = changes.into_iter().peekable();
    while it.peek().is_some() {
        j.commit(&folder(), it.by_ref().take(batch).collect())
            .unwrap();
    }
    (wall.elapsed(), cpu_time() - cpu)
}

/// `cargo test --release -p meshfs-daemon --test journal -- --ignored --nocapture commit_of`
#[test]
#[ignore = "measurement; run in release mode with --ignored --nocapture"]
fn commit_of_100000_one_chunk_records_is_fast() {
    let tmp = TempDir::new().unwrap();
    let (mut j, path) = open(&tmp);
    let report = |what: &str, (wall, cpu): (Duration, Duration), n: f64| {
        println!(
            "{what}: wall {wall:.2?} ({:.0} records/s), cpu {cpu:.2?}",
            n / wall.as_secs_f64()
        )
    };
    let ten_k: Vec<Change> = scan_of_100k(9, false).into_iter().take(10_000).collect();
    report(
        "10,000 records in one commit",
        timed_commits(&mut j, ten_k, 10_000),
        1e4,
    );
    j.remove_folder(&folder()).unwrap();
    for (round, batch, what) in [
        (0, 5_000, "insert 100,000 in commits of 5,000"),
        (1, 10_000, "replace 100,000 in commits of 10,000"),
    ] {
        report(
            what,
            timed_commits(&mut j, scan_of_100k(round, false), batch),
            1e5,
        );
    }
    let start = Instant::now();
    let c = j.counts(&folder()).unwrap();
    println!("counts {c:?}: {:.2?}", start.elapsed());
    let start = Instant::now();
    let mut n = 0;
    j.for_each_record(&folder(), &mut |_| {
        n += 1;
        ControlFlow::Continue(())
    })
    .unwrap();
    println!("for_each_record over {n}: {:.2?}", start.elapsed());
    println!(
        "database file: {} MiB",
        std::fs::metadata(&path).unwrap().len() >> 20
    );
    drop(j);
    let tmp = TempDir::new().unwrap();
    let (mut j, _) = open(&tmp);
    report(
        "insert 100,000 in random path order, commits of 5,000",
        timed_commits(&mut j, scan_of_100k(0, true), 5_000),
        1e5,
    );
    if let Ok(status) = std::fs::read_to_string("/proc/self/status") {
        for line in status.lines().filter(|l| l.starts_with("VmHWM")) {
            println!("{line} (includes the 100,000 changes built in memory)");
        }
    }
}

#[test]
fn conflict_records_lists_live_siblings_only() {
    let tmp = TempDir::new().unwrap();
    let (mut j, _) = open(&tmp);
    let f = folder();
    let sibling = file(
        "a.sync-conflict-20261122-141503-ABCDEF1.txt",
        b"old",
        vv(&[(1, 1)]),
    );
    let gone = file(
        "b.sync-conflict-20261122-141503-ABCDEF1",
        b"x",
        vv(&[(1, 1)]),
    );
    j.commit(
        &f,
        vec![
            change(file("a.txt", b"new", vv(&[(2, 1)])), Op::Create),
            change(sibling.clone(), Op::Conflict),
            change(gone.clone(), Op::Conflict),
        ],
    )
    .unwrap();
    j.commit(&f, vec![change(tombstone(&gone, 1), Op::Delete)])
        .unwrap();
    let found: Vec<String> = j
        .conflict_records(&f)
        .unwrap()
        .into_iter()
        .map(|s| s.record.path.to_string())
        .collect();
    assert_eq!(found, vec![sibling.path.to_string()]);
    assert!(j.conflict_records(&other_folder()).unwrap().is_empty());
}

#[test]
fn a_held_read_transaction_sees_writes_and_blocks_no_one() {
    let tmp = TempDir::new().unwrap();
    let path = tmp.path().join("journal.db");
    let mut j = Journal::open(&path).unwrap();
    j.commit(&folder(), vec![change(dir("a", vv(&[(1, 1)])), Op::Create)])
        .unwrap();
    j.begin_reads();
    assert!(j.get(&folder(), &p("a")).unwrap().is_some());
    // A write while reads are held commits, and later reads see it.
    j.commit(&folder(), vec![change(dir("b", vv(&[(1, 2)])), Op::Create)])
        .unwrap();
    assert!(j.get(&folder(), &p("b")).unwrap().is_some());
    // Another connection (the CLI) reads and writes meanwhile.
    let mut other = Journal::open(&path).unwrap();
    assert!(other.get(&folder(), &p("b")).unwrap().is_some());
    other
        .commit(&folder(), vec![change(dir("c", vv(&[(1, 3)])), Op::Create)])
        .unwrap();
    j.end_reads();
    j.end_reads();
    assert!(j.get(&folder(), &p("c")).unwrap().is_some());
}

#[test]
fn placeholders_are_counted_apart_follow_their_inode_and_stale_rows_are_dropped() {
    let dir = TempDir::new().unwrap();
    let (mut j, _) = open(&dir);
    let f = folder();
    let local = |inode: u64, size: u64| LocalStat {
        inode,
        size,
        mtime_ns: 1,
        ctime_ns: 1,
        mode: 0o100644,
    };
    let a = file("a", &[7u8; 100], vv(&[(1, 1)]));
    let b = file("d/b", &[8u8; 300], vv(&[(1, 2)]));
    let mut ca = change(a.clone(), Op::Create);
    ca.local = Some(local(10, 100));
    ca.source = Some(dev(1));
    let mut cb = change(b.clone(), Op::Create);
    cb.local = Some(local(11, 300));
    // b arrives as a placeholder: in the same transaction as its record.
    j.commit_absent(&f, vec![ca, cb], &[11]).unwrap();
    let r = j.residency(&f).unwrap();
    assert_eq!((r.local_files, r.local_bytes), (1, 100));
    assert_eq!((r.online_files, r.online_bytes), (1, 300));
    assert_eq!(j.online(&f, None).unwrap(), vec![p("d/b")]);
    assert_eq!(j.online(&f, Some(&p("d"))).unwrap(), vec![p("d/b")]);
    assert_eq!(j.online(&f, Some(&p("d/b"))).unwrap(), vec![p("d/b")]);
    assert!(j.online(&f, Some(&p("a"))).unwrap().is_empty());
    let res = j.residents(&f).unwrap();
    assert_eq!(res.len(), 1);
    assert_eq!(res[0].path, p("a"));
    assert_eq!(res[0].source, Some(dev(1)));
    assert_eq!(res[0].local.inode, 10);
    // Its content fetched: a new inode, the row gone.
    j.made_local(&f, &p("d/b"), local(12, 300), 11).unwrap();
    assert_eq!(j.residency(&f).unwrap().online_files, 0);
    // a evicted: a placeholder with a new inode.
    j.made_absent(&f, &p("a"), local(13, 100)).unwrap();
    let r = j.residency(&f).unwrap();
    assert_eq!((r.local_bytes, r.online_bytes), (300, 100));
    // A chunk of a placeholder is not offered as local content.
    let chunk = a.chunks[0].hash;
    assert!(j.find_chunk(&f, &chunk).unwrap().is_empty());
    assert_eq!(j.find_chunk(&f, &b.chunks[0].hash).unwrap().len(), 1);
    // A row no live record names any more is dropped.
    j.mark_absent(&f, &[99]).unwrap();
    assert_eq!(j.prune_absent(&f).unwrap(), 1);
    assert_eq!(j.prune_absent(&f).unwrap(), 0);
    assert_eq!(j.residency(&f).unwrap().online_files, 1);
    // A placeholder replaced by another version's (a new inode): its row goes with it, so a
    // file that later reuses the inode number is not taken for a placeholder.
    let mut a2 = change(file("a", &[9u8; 100], vv(&[(1, 3)])), Op::Modify);
    a2.local = Some(local(14, 100));
    j.commit_absent(&f, vec![a2], &[14]).unwrap();
    j.mark_absent(&f, &[15]).unwrap();
    let mut c = change(file("c", &[7u8; 100], vv(&[(1, 4)])), Op::Create);
    c.local = Some(local(13, 100));
    j.commit(&f, vec![c]).unwrap();
    assert_eq!(
        j.find_chunk(&f, &chunk).unwrap().len(),
        1,
        "inode 13 reused"
    );
    // A placeholder another live record still names (a sibling made as a hard link) keeps its
    // row when one of the names changes.
    let mut sib = change(file("a.sibling", &[9u8; 100], vv(&[(1, 5)])), Op::Create);
    sib.local = Some(local(14, 100));
    j.commit(&f, vec![sib]).unwrap();
    let mut gone = change(file("a", &[9u8; 100], vv(&[(1, 6)])), Op::Delete);
    gone.record.deleted = true;
    gone.record.chunks.clear();
    gone.record.size = 0;
    gone.record.hash = meshfs_protocol::Hash::ZERO;
    j.commit(&f, vec![gone]).unwrap();
    let hash9 = file("x", &[9u8; 100], vv(&[(1, 1)])).chunks[0].hash;
    assert!(
        j.find_chunk(&f, &hash9).unwrap().is_empty(),
        "the sibling is a placeholder"
    );
    assert_eq!(j.residency(&f).unwrap().online_files, 1);
    // Pins.
    j.pin(&f, &p("d")).unwrap();
    j.pin(&f, &p("d")).unwrap();
    j.pin(&f, &p("a")).unwrap();
    assert_eq!(j.pins(&f).unwrap(), vec![p("a"), p("d")]);
    assert!(j.unpin(&f, &p("d")).unwrap());
    assert!(!j.unpin(&f, &p("d")).unwrap());
    assert_eq!(j.pins(&f).unwrap(), vec![p("a")]);
}
