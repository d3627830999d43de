//! The scanner on real directories and a real journal: an unchanged tree reads no file
//! contents (the scanner's own byte counter says so), and changes are found exactly once.

use meshfs_daemon::ignore::IgnoreRules;
use meshfs_daemon::journal::Journal;
use meshfs_daemon::scanner::{scan, ScanTarget};
use meshfs_daemon::store::Store;
use meshfs_protocol::{FolderId, ShortId};

/// A folder on `root` with no ignore rules, scanned as device 1.
struct Fixture {
    folder: FolderId,
    store: Store,
    ignore: IgnoreRules,
}

impl Fixture {
    fn new(root: &std::path::Path) -> Fixture {
        Fixture {
            folder: FolderId::new("f").unwrap(),
            store: Store::open(root).unwrap(),
            ignore: IgnoreRules::none(),
        }
    }

    fn target(&self) -> ScanTarget<'_> {
        ScanTarget {
            folder: &self.folder,
            store: &self.store,
            ignore: &self.ignore,
            local: ShortId(1),
            now_secs: 0,
        }
    }
}

fn commit_all(j: &mut Journal, f: &FolderId, t: &ScanTarget<'_>) -> (usize, u64) {
    let r = scan(t, j, &[]).unwrap();
    let n = r.changes.len();
    j.commit(f, r.changes).unwrap();
    j.set_local_stats(f, &r.restat).unwrap();
    (n, r.hashed_bytes)
}

#[test]
fn an_unchanged_tree_is_scanned_without_reading_any_file() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("replica");
    for i in 0..500 {
        let d = root.join(format!("d{}", i % 20));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join(format!("f{i}")), vec![i as u8; 3000]).unwrap();
    }
    let mut j = Journal::open(&dir.path().join("journal.db")).unwrap();
    let fx = Fixture::new(&root);
    let (folder, t) = (&fx.folder, fx.target());

    let (n, bytes) = commit_all(&mut j, folder, &t);
    assert_eq!(n, 520, "500 files and 20 directories");
    assert_eq!(bytes, 500 * 3000);

    let (n, bytes) = commit_all(&mut j, folder, &t);
    assert_eq!(
        (n, bytes),
        (0, 0),
        "an unchanged tree: no versions, no bytes read"
    );

    // One modified file: exactly that file is read.
    std::fs::write(root.join("d3/f3"), b"changed").unwrap();
    std::fs::remove_file(root.join("d4/f4")).unwrap();
    let r = scan(&t, &j, &[]).unwrap();
    assert_eq!(r.hashed_bytes, 7);
    let mut ops: Vec<_> = r
        .changes
        .iter()
        .map(|c| (c.op.as_str(), c.record.path.to_string()))
        .collect();
    ops.sort();
    assert_eq!(
        ops,
        vec![
            ("delete", "d4/f4".to_string()),
            ("modify", "d3/f3".to_string())
        ]
    );
}

#[test]
fn special_files_and_internal_names_are_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("replica");
    std::fs::create_dir_all(root.join(".meshfs")).unwrap();
    std::fs::write(root.join(".meshfs/state"), b"x").unwrap();
    std::fs::write(root.join(".meshfs-tmp-123"), b"partial").unwrap();
    std::fs::write(root.join("real"), b"r").unwrap();
    let fifo = std::ffi::CString::new(root.join("pipe").to_str().unwrap()).unwrap();
    // SAFETY: `fifo` is NUL-terminated and outlives the call.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) }, 0);
    let j = Journal::open(&dir.path().join("journal.db")).unwrap();
    let fx = Fixture::new(&root);
    let t = fx.target();
    let r = scan(&t, &j, &[]).unwrap();
    let paths: Vec<_> = r
        .changes
        .iter()
        .map(|c| c.record.path.to_string())
        .collect();
    assert_eq!(paths, vec!["real"]);
}

#[test]
fn a_deep_wide_tree_is_walked_once_per_entry() {
    // Enough directories, nested deep and wide, that the walk goes on several threads; every
    // entry must be found exactly once, and a scope finds exactly its own subtree.
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("replica");
    let mut expected = std::collections::BTreeSet::new();
    let mut stack = vec![(String::new(), 0)];
    while let Some((d, depth)) = stack.pop() {
        std::fs::create_dir_all(root.join(&d)).unwrap();
        for f in 0..3 {
            let p = format!("{d}f{f}");
            std::fs::write(root.join(&p), p.as_bytes()).unwrap();
            expected.insert(p);
        }
        if depth < 4 {
            for s in 0..4 {
                let sub = format!("{d}s{s}");
                expected.insert(sub.clone());
                stack.push((format!("{sub}/"), depth + 1));
            }
        }
    }
    let mut j = Journal::open(&dir.path().join("journal.db")).unwrap();
    let fx = Fixture::new(&root);
    let (folder, t) = (&fx.folder, fx.target());
    let r = scan(&t, &j, &[]).unwrap();
    assert_eq!(r.entries as usize, expected.len());
    let found: Vec<String> = r
        .changes
        .iter()
        .map(|c| c.record.path.to_string())
        .collect();
    let unique: std::collections::BTreeSet<String> = found.iter().cloned().collect();
    assert_eq!(found.len(), unique.len(), "an entry was found twice");
    assert_eq!(unique, expected);
    j.commit(folder, r.changes).unwrap();

    let scope = meshfs_protocol::RelPath::new("s2/s1").unwrap();
    std::fs::write(root.join("s2/s1/s3/new"), b"n").unwrap();
    std::fs::write(root.join("s1/new"), b"n").unwrap();
    let r = scan(&t, &j, &[scope]).unwrap();
    let found: Vec<String> = r
        .changes
        .iter()
        .map(|c| c.record.path.to_string())
        .collect();
    assert_eq!(found, vec!["s2/s1/s3/new".to_string()]);
    let below = expected.iter().filter(|p| p.starts_with("s2/s1/")).count();
    assert_eq!(
        r.entries as usize,
        below + 2,
        "the scope, its subtree and the new file"
    );
}

#[test]
fn a_first_scan_says_how_much_is_to_hash_before_reading_and_streams_every_file_once() {
    // The engine stops waiting for a long first scan once the walk is done (before any file
    // is read), and journals each slice while the next is hashed: the first emit carries only
    // the directories and the count of files to hash, then every file comes exactly once.
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("replica");
    let files = 2 * meshfs_daemon::scanner::FIRST_SCAN_SLICE + 345;
    for d in 0..5 {
        std::fs::create_dir_all(root.join(format!("d{d}"))).unwrap();
    }
    for i in 0..files {
        std::fs::write(root.join(format!("d{}/f{i:05}", i % 5)), i.to_le_bytes()).unwrap();
    }
    let fx = Fixture::new(&root);
    let t = fx.target();
    let mut calls: Vec<(Vec<String>, usize)> = Vec::new();
    let report = meshfs_daemon::scanner::scan_new(&t, &mut |changes, to_hash| {
        let paths = changes.iter().map(|c| c.record.path.to_string()).collect();
        calls.push((paths, to_hash));
        Ok(())
    })
    .unwrap();
    assert!(report.changes.is_empty(), "a streamed scan returns nothing");
    assert_eq!(report.hashed_files as usize, files);
    let (dirs, first_to_hash) = &calls[0];
    assert_eq!(dirs, &["d0", "d1", "d2", "d3", "d4"]);
    assert_eq!(*first_to_hash, files);
    let mut seen = std::collections::BTreeSet::new();
    for (paths, _) in &calls[1..] {
        assert!(paths.len() <= meshfs_daemon::scanner::FIRST_SCAN_SLICE);
        for p in paths {
            assert!(seen.insert(p.clone()), "{p} emitted twice");
        }
    }
    assert_eq!(seen.len(), files);
    let left: Vec<usize> = calls.iter().map(|c| c.1).collect();
    assert!(left.windows(2).all(|w| w[0] >= w[1]), "{left:?}");
    assert_eq!(left.last(), Some(&0));

    // A failing emit stops the scan (and the hashing thread) with its error.
    let mut n = 0;
    let err = meshfs_daemon::scanner::scan_new(&t, &mut |_, _| {
        n += 1;
        if n == 2 {
            Err(meshfs_daemon::journal::JournalError::Corrupt {
                what: "disk full".into(),
            })
        } else {
            Ok(())
        }
    })
    .unwrap_err();
    assert!(err.to_string().contains("disk full"), "{err}");
    assert_eq!(n, 2);
}

/// Versions made faster than one a second run their counter ahead of the clock floor. A file
/// created again where a tombstone lies (a plain create, or a rename onto the name) must get
/// a version after the tombstone's, not one from the bare clock: peers that hold the tombstone
/// took it for an older version and never applied it (found by two mounts syncing under load).
#[test]
fn a_file_created_again_over_its_tombstone_gets_a_newer_version() {
    use meshfs_protocol::{RelPath, VvOrdering};
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("replica");
    std::fs::create_dir_all(&root).unwrap();
    let mut j = Journal::open(&dir.path().join("journal.db")).unwrap();
    let fx = Fixture::new(&root);
    let (folder, t) = (&fx.folder, fx.target());
    let path = RelPath::new("f.txt").unwrap();
    let version = |j: &Journal| j.get(folder, &path).unwrap().unwrap().record.version;
    // Many versions within one clock second (the fixture's clock is 0).
    for i in 0..5u8 {
        std::fs::write(root.join("f.txt"), [i; 10]).unwrap();
        commit_all(&mut j, folder, &t);
    }
    std::fs::remove_file(root.join("f.txt")).unwrap();
    commit_all(&mut j, folder, &t);
    let tombstone = version(&j);
    // Created again, as a new file.
    std::fs::write(root.join("f.txt"), b"created again").unwrap();
    commit_all(&mut j, folder, &t);
    assert_eq!(version(&j).compare(&tombstone), VvOrdering::After);
    // Deleted, then a file renamed onto the name.
    std::fs::remove_file(root.join("f.txt")).unwrap();
    commit_all(&mut j, folder, &t);
    std::fs::write(root.join("other.txt"), b"renamed onto it").unwrap();
    commit_all(&mut j, folder, &t);
    let tombstone = version(&j);
    std::fs::rename(root.join("other.txt"), root.join("f.txt")).unwrap();
    commit_all(&mut j, folder, &t);
    assert_eq!(version(&j).compare(&tombstone), VvOrdering::After);
}

/// `rm -r d; mv f d`: the deletions below `d` are journaled before `d`'s new version, so a peer
/// never keeps a directory for entries that the same change deletes (and loses the file to it).
#[test]
fn a_directory_replaced_by_a_file_is_journaled_after_the_deletions_below_it() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("replica");
    std::fs::create_dir_all(root.join("d/sub")).unwrap();
    std::fs::write(root.join("d/x"), b"x").unwrap();
    std::fs::write(root.join("d/sub/y"), b"y").unwrap();
    std::fs::write(root.join("f"), b"the new d").unwrap();
    let mut j = Journal::open(&dir.path().join("journal.db")).unwrap();
    let fx = Fixture::new(&root);
    let (folder, t) = (&fx.folder, fx.target());
    commit_all(&mut j, folder, &t);
    std::fs::remove_dir_all(root.join("d")).unwrap();
    std::fs::rename(root.join("f"), root.join("d")).unwrap();
    let r = scan(&t, &j, &[]).unwrap();
    let order: Vec<(String, bool)> = r
        .changes
        .iter()
        .map(|c| (c.record.path.to_string(), c.record.deleted))
        .collect();
    let at = |p: &str, deleted: bool| {
        order
            .iter()
            .position(|(q, d)| q == p && *d == deleted)
            .unwrap_or_else(|| panic!("{p} {deleted} not in {order:?}"))
    };
    assert!(at("d/sub/y", true) < at("d/sub", true), "{order:?}");
    assert!(at("d/sub", true) < at("d", false), "{order:?}");
    assert!(at("d/x", true) < at("d", false), "{order:?}");
}

#[test]
fn a_scan_of_many_scopes_finds_what_a_whole_scan_finds() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("replica");
    // `a-b` sorts between `a` and `a/…` as text: a scope inside another is found by its
    // ancestors, not by its neighbours in order.
    for d in ["a/in", "a-b", "gone/deep", "x"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    for f in [
        "a/1",
        "a/in/2",
        "a-b/3",
        "gone/4",
        "gone/deep/5",
        "x/file",
        "top",
    ] {
        std::fs::write(root.join(f), f.as_bytes()).unwrap();
    }
    let mut j = Journal::open(&dir.path().join("journal.db")).unwrap();
    let fx = Fixture::new(&root);
    let (folder, t) = (&fx.folder, fx.target());
    commit_all(&mut j, folder, &t);
    // A tree removed, files edited, a file become a directory, new files.
    std::fs::remove_dir_all(root.join("gone")).unwrap();
    std::fs::write(root.join("a/in/2"), b"edited").unwrap();
    std::fs::write(root.join("a-b/3"), b"edited too").unwrap();
    std::fs::remove_file(root.join("top")).unwrap();
    std::fs::create_dir(root.join("top")).unwrap();
    std::fs::write(root.join("top/new"), b"new").unwrap();
    std::fs::write(root.join("x/file2"), b"new").unwrap();
    let p = |s: &str| meshfs_protocol::RelPath::new(s).unwrap();
    // Every path the events would name, parents and children both, in no order.
    let scopes: Vec<_> = [
        "gone/deep/5",
        "a/in/2",
        "gone",
        "a-b/3",
        "gone/4",
        "a",
        "top",
        "x/file2",
        "gone/deep",
        "top/new",
        "a/in/2",
    ]
    .iter()
    .map(|s| p(s))
    .collect();
    let changes = |r: meshfs_daemon::scanner::ScanReport| {
        let mut v: Vec<(String, bool)> = r
            .changes
            .iter()
            .map(|c| (c.record.path.to_string(), c.record.deleted))
            .collect();
        v.sort();
        v
    };
    let scoped = changes(scan(&t, &j, &scopes).unwrap());
    let whole = changes(scan(&t, &j, &[]).unwrap());
    assert_eq!(scoped, whole);
    let s = |p: &str, d: bool| (p.to_string(), d);
    for want in [
        s("gone", true),
        s("gone/deep", true),
        s("gone/deep/5", true),
        s("gone/4", true),
        s("a/in/2", false),
        s("a-b/3", false),
        s("top", false),
        s("top/new", false),
        s("x/file2", false),
    ] {
        assert!(scoped.contains(&want), "{want:?} not in {scoped:?}");
    }
}

/// Sets `p`'s mtime to `secs` after the epoch.
fn set_mtime(p: &std::path::Path, secs: u64) {
    let f = std::fs::OpenOptions::new().write(true).open(p).unwrap();
    f.set_modified(std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs))
        .unwrap();
}

/// Two files of one size written in the same clock tick have the same mtime; one renamed over
/// the other is a new inode of that size and mtime. It was taken for the same content
/// ("restored by a copy") and no version made: the rename's content never reached a peer
/// (`tests/chaos.rs` seed 58 on 3 devices: a `mv f1 f2` right after both were written).
/// A new inode is read; only the same content is still no version.
#[test]
fn a_file_renamed_over_one_of_the_same_size_and_mtime_is_a_new_version() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("replica");
    std::fs::create_dir_all(&root).unwrap();
    std::fs::write(root.join("f1"), b"content one").unwrap();
    std::fs::write(root.join("f2"), b"content two").unwrap();
    set_mtime(&root.join("f1"), 1_700_000_000);
    set_mtime(&root.join("f2"), 1_700_000_000);
    let mut j = Journal::open(&dir.path().join("journal.db")).unwrap();
    let fx = Fixture::new(&root);
    let (folder, t) = (&fx.folder, fx.target());
    commit_all(&mut j, folder, &t);

    std::fs::rename(root.join("f1"), root.join("f2")).unwrap();
    let r = scan(&t, &j, &[]).unwrap();
    let mut ops: Vec<_> = r
        .changes
        .iter()
        .map(|c| (c.op.as_str(), c.record.path.to_string()))
        .collect();
    ops.sort();
    assert_eq!(ops, vec![("delete", "f1".into()), ("modify", "f2".into())]);
    let f2 = r
        .changes
        .iter()
        .find(|c| c.record.path.as_str() == "f2")
        .unwrap();
    assert_eq!(
        f2.record.hash.to_string(),
        blake3::hash(b"content one").to_hex().to_string()
    );
    j.commit(folder, r.changes).unwrap();

    // The same content and times under a new inode (a restore by `cp -p`): read, no version.
    std::fs::write(root.join("copy"), b"content one").unwrap();
    set_mtime(&root.join("copy"), 1_700_000_000);
    std::fs::rename(root.join("copy"), root.join("f2")).unwrap();
    let r = scan(&t, &j, &[]).unwrap();
    assert!(r.changes.is_empty(), "{:?}", r.changes);
    assert_eq!(r.hashed_bytes, 11);
}

/// Marks `p` a placeholder of the content `hash` (as the store makes them, D90).
fn mark(p: &std::path::Path, hash: &meshfs_protocol::Hash) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
    // SAFETY: a NUL-terminated path and name, and a 32-byte value, valid for the call.
    let r = unsafe {
        libc::setxattr(
            c.as_ptr(),
            c"user.meshfs.placeholder".as_ptr(),
            hash.0.as_ptr().cast(),
            32,
            0,
        )
    };
    r == 0
}

#[test]
fn a_placeholder_is_never_read_as_content_a_touched_one_is_a_metadata_version_and_a_stray_one_is_left_alone(
) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("replica");
    std::fs::create_dir_all(&root).unwrap();
    let data = vec![9u8; 200_000];
    std::fs::write(root.join("f"), &data).unwrap();
    let mut j = Journal::open(&dir.path().join("journal.db")).unwrap();
    let fx = Fixture::new(&root);
    let (folder, t) = (&fx.folder, fx.target());
    commit_all(&mut j, folder, &t);
    let rec = j
        .get(folder, &meshfs_protocol::RelPath::new("f").unwrap())
        .unwrap()
        .unwrap()
        .record;
    // f becomes a placeholder of its own version (an eviction's new inode, journaled late).
    // Made beside it and renamed over it: a new inode, as an eviction's is.
    let f = std::fs::File::create(root.join("f.new")).unwrap();
    f.set_len(data.len() as u64).unwrap();
    drop(f);
    if !mark(&root.join("f.new"), &rec.hash) {
        eprintln!("no user extended attributes here; skipped");
        return;
    }
    std::fs::rename(root.join("f.new"), root.join("f")).unwrap();
    let mtime =
        std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_nanos(rec.mtime_ns as u64);
    std::fs::File::options()
        .write(true)
        .open(root.join("f"))
        .unwrap()
        .set_modified(mtime)
        .unwrap();
    let r = scan(&t, &j, &[]).unwrap();
    assert_eq!(r.hashed_bytes, 0, "a placeholder is not read");
    assert!(r.changes.is_empty(), "same version: a restat, no version");
    assert_eq!(
        r.placeholders.len(),
        1,
        "noted as not local: {:?} {:?}",
        r.unread,
        r.restat
    );
    j.set_local_stats(folder, &r.restat).unwrap();
    // Touched: a metadata version with the record's content, never zeros.
    let later = mtime + std::time::Duration::from_secs(60);
    std::fs::File::options()
        .write(true)
        .open(root.join("f"))
        .unwrap()
        .set_modified(later)
        .unwrap();
    let r = scan(&t, &j, &[]).unwrap();
    assert_eq!(r.changes.len(), 1);
    let c = &r.changes[0];
    assert_eq!(c.op.as_str(), "metadata");
    assert_eq!(c.record.hash, rec.hash);
    assert_eq!(c.record.chunks, rec.chunks);
    j.commit(folder, r.changes).unwrap();
    // A placeholder at a path that has no such version: left alone, no version.
    let stray = std::fs::File::create(root.join("stray")).unwrap();
    stray.set_len(1000).unwrap();
    drop(stray);
    assert!(mark(&root.join("stray"), &rec.hash));
    let r = scan(&t, &j, &[]).unwrap();
    assert!(r.changes.is_empty(), "{:?}", r.changes);
    assert_eq!(r.unread.len(), 1);
}

#[test]
fn a_scan_names_the_files_it_saw_with_a_second_name() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("replica");
    std::fs::create_dir_all(root.join("d")).unwrap();
    std::fs::write(root.join("d/one"), b"alone").unwrap();
    std::fs::write(root.join("d/a"), b"shared").unwrap();
    std::fs::hard_link(root.join("d/a"), root.join("b")).unwrap();
    let j = Journal::open(&dir.path().join("journal.db")).unwrap();
    let fx = Fixture::new(&root);
    let rel = |p: &str| meshfs_protocol::RelPath::new(p).unwrap();

    // A whole scan and a scan of given paths: both from their own stat of each file.
    let mut whole = scan(&fx.target(), &j, &[]).unwrap().linked;
    whole.sort();
    assert_eq!(whole, vec![rel("b"), rel("d/a")]);
    let scoped = scan(&fx.target(), &j, &[rel("d/a"), rel("d/one")]).unwrap();
    assert_eq!(scoped.linked, vec![rel("d/a")]);
    assert_eq!(scoped.changes.len(), 2, "both files are new");

    // The second name gone, the file is alone again.
    std::fs::remove_file(root.join("b")).unwrap();
    assert!(scan(&fx.target(), &j, &[rel("d")])
        .unwrap()
        .linked
        .is_empty());
}

#[test]
fn a_scan_keeps_what_it_read_of_small_files_for_their_index_batch() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("replica");
    std::fs::create_dir_all(&root).unwrap();
    let small = b"a small file's content".to_vec();
    let big: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(root.join("small"), &small).unwrap();
    std::fs::write(root.join("big"), &big).unwrap();
    let mut j = Journal::open(&dir.path().join("journal.db")).unwrap();
    let fx = Fixture::new(&root);
    let (folder, t) = (&fx.folder, fx.target());
    commit_all(&mut j, folder, &t);

    let hash = meshfs_protocol::Hash::of(&small);
    assert_eq!(
        fx.store.fresh().bytes(),
        small.len(),
        "only the small file is kept"
    );
    assert_eq!(
        fx.store.fresh().take(&hash),
        Some(small),
        "the bytes its hash was made of"
    );
    assert_eq!(fx.store.fresh().bytes(), 0);
}
