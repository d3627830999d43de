//! The mount, through real mounts: what a program sees through it, what the engine hears
//! from it, and what it costs in descriptors.
//!
//! Tests run as root with /dev/fuse present; each mounts its own temporary directory.

use meshfs_fuse::{
    mount, ChangeEvent, ChangeKind, Invalidator, Mount, MountError, MountOptions, WriterRegistry,
};
use meshfs_protocol::RelPath;
use std::collections::HashSet;
use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::io::{BufRead, BufReader, ErrorKind, Read, Seek, SeekFrom, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A backing directory mounted at a mount point, with the events the mount reported.
struct Fixture {
    back: PathBuf,
    mnt: PathBuf,
    mount: Option<Mount>,
    events: Arc<Mutex<Vec<ChangeEvent>>>,
    _dir: tempfile::TempDir,
}

impl Fixture {
    fn new() -> Fixture {
        Fixture::with(MountOptions::default())
    }

    fn with(opts: MountOptions) -> Fixture {
        let dir = tempfile::Builder::new()
            .prefix("meshfs-fuse-test")
            .tempdir_in("/tmp")
            .unwrap();
        let back = dir.path().join("back");
        let mnt = dir.path().join("mnt");
        fs::create_dir(&back).unwrap();
        fs::create_dir(&mnt).unwrap();
        let events = Arc::new(Mutex::new(Vec::new()));
        let sink_events = events.clone();
        let sink = move |ev: ChangeEvent| sink_events.lock().unwrap().push(ev);
        let mount = mount(&back, &mnt, opts, Arc::new(sink)).unwrap();
        Fixture {
            back,
            mnt,
            mount: Some(mount),
            events,
            _dir: dir,
        }
    }

    /// A path through the mount.
    fn m(&self, rel: &str) -> PathBuf {
        self.mnt.join(rel)
    }

    /// The same path in the backing directory.
    fn b(&self, rel: &str) -> PathBuf {
        self.back.join(rel)
    }

    fn mount(&self) -> &Mount {
        self.mount.as_ref().unwrap()
    }

    fn events(&self) -> Vec<ChangeEvent> {
        self.events.lock().unwrap().clone()
    }

    /// Waits until `n` handles are open: a release is asynchronous (close(2) returns before
    /// the mount hears of it).
    fn wait_for_open_handles(&self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.mount().info().open_handles != n && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(self.mount().info().open_handles, n);
    }

    /// Waits (events are sent after the kernel got its answer) until `ev` was reported.
    fn expect_event(&self, path: &str, kind: ChangeKind) {
        let want = ChangeEvent {
            path: RelPath::new(path).unwrap(),
            kind,
        };
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if self.events().contains(&want) {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("no event {want:?}; got {:#?}", self.events());
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        if let Some(m) = self.mount.take() {
            m.unmount().unwrap();
        }
    }
}

fn forwarding() -> MountOptions {
    MountOptions {
        passthrough: false,
        ..MountOptions::default()
    }
}

fn errno<T: std::fmt::Debug>(r: std::io::Result<T>) -> i32 {
    r.unwrap_err().raw_os_error().unwrap()
}

fn c(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap()
}

fn renameat2(from: &Path, to: &Path, flags: u32) -> std::io::Result<()> {
    let (f, t) = (c(from), c(to));
    // SAFETY: both paths are NUL-terminated and outlive the call.
    let r = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            f.as_ptr(),
            libc::AT_FDCWD,
            t.as_ptr(),
            flags,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

fn count_fds() -> usize {
    fs::read_dir("/proc/self/fd").unwrap().count()
}

fn rel(s: &str) -> RelPath {
    RelPath::new(s).unwrap()
}

// ---------------------------------------------------------------------------------------
// Reading and writing

fn create_write_read_back(fx: &Fixture) {
    fs::write(fx.m("a.txt"), b"hello").unwrap();
    assert_eq!(fs::read(fx.m("a.txt")).unwrap(), b"hello");
    assert_eq!(
        fs::read(fx.b("a.txt")).unwrap(),
        b"hello",
        "it is in the backing dir"
    );

    let mut f = OpenOptions::new().append(true).open(fx.m("a.txt")).unwrap();
    f.write_all(b" world").unwrap();
    drop(f);
    assert_eq!(fs::read(fx.m("a.txt")).unwrap(), b"hello world");

    // A larger file, written and read in pieces at offsets.
    let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    fs::write(fx.m("big"), &data).unwrap();
    assert_eq!(fs::read(fx.m("big")).unwrap(), data);
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(fx.m("big"))
        .unwrap();
    f.seek(SeekFrom::Start(1_000_000)).unwrap();
    f.write_all(b"XYZ").unwrap();
    f.seek(SeekFrom::Start(999_999)).unwrap();
    let mut buf = [0u8; 5];
    f.read_exact(&mut buf).unwrap();
    assert_eq!(&buf[1..4], b"XYZ");
    assert_eq!(fs::metadata(fx.m("big")).unwrap().len(), 3_000_000);
    assert_eq!(
        fs::read(fx.b("big")).unwrap()[1_000_000..1_000_003],
        *b"XYZ"
    );
}

/// How many of the pages of the file at `path` the kernel holds in its page cache, seen
/// through an open of it (`mmap` + `mincore`, which read nothing).
fn resident_pages(path: &Path) -> usize {
    let f = File::open(path).unwrap();
    let len = f.metadata().unwrap().len() as usize;
    // SAFETY: a fresh read-only shared mapping of an open file; unmapped below.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            std::os::fd::AsRawFd::as_raw_fd(&f),
            0,
        )
    };
    assert_ne!(addr, libc::MAP_FAILED);
    let pages = len.div_ceil(4096);
    let mut vec = vec![0u8; pages];
    // SAFETY: `addr` maps `len` bytes; `vec` has one byte per page of them.
    let r = unsafe { libc::mincore(addr, len, vec.as_mut_ptr()) };
    // SAFETY: the mapping made above, of that length.
    unsafe { libc::munmap(addr, len) };
    assert_eq!(r, 0);
    vec.iter().filter(|&&b| b & 1 != 0).count()
}

#[test]
fn a_forwarded_file_opened_again_keeps_its_cached_pages_until_it_changes() {
    let fx = Fixture::with(forwarding());
    let data = vec![7u8; 1 << 20];
    fs::write(fx.b("f"), &data).unwrap();
    // Read once (the kernel may drop its pages once more as it first sees the file's times).
    assert_eq!(fs::read(fx.m("f")).unwrap(), data);
    fs::metadata(fx.m("f")).unwrap();
    assert_eq!(fs::read(fx.m("f")).unwrap(), data);
    // Opened again and again, unchanged: the pages are kept.
    for _ in 0..3 {
        assert_eq!(resident_pages(&fx.m("f")), 256);
    }
    // Changed behind the mount's back, in place, same size (no watcher here): the next open
    // drops the pages, and the new content is read.
    let new = vec![9u8; 1 << 20];
    OpenOptions::new()
        .write(true)
        .open(fx.b("f"))
        .unwrap()
        .write_all(&new)
        .unwrap();
    assert_eq!(resident_pages(&fx.m("f")), 0);
    assert_eq!(fs::read(fx.m("f")).unwrap(), new);
    fs::metadata(fx.m("f")).unwrap();
    assert_eq!(fs::read(fx.m("f")).unwrap(), new);
    assert_eq!(resident_pages(&fx.m("f")), 256);
    // An invalidation from the engine drops them too.
    fx.mount().handle().invalidate(&rel("f"));
    let deadline = Instant::now() + Duration::from_secs(5);
    while fx.mount().info().invalidations_pending > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(resident_pages(&fx.m("f")), 0);
    // Written through the mount: what is read back is what was written.
    let mut f = OpenOptions::new().write(true).open(fx.m("f")).unwrap();
    f.write_all(&data[..4096]).unwrap();
    drop(f);
    fx.wait_for_open_handles(0);
    let mut want = new.clone();
    want[..4096].copy_from_slice(&data[..4096]);
    assert_eq!(fs::read(fx.m("f")).unwrap(), want);
    assert_eq!(fs::read(fx.b("f")).unwrap(), want);
}

#[test]
fn a_write_only_writer_bypassing_the_page_cache_is_seen_by_a_reader_that_mapped_the_file() {
    let fx = Fixture::with(forwarding());
    fs::write(fx.b("f"), vec![b'o'; 8192]).unwrap();
    let reader = File::open(fx.m("f")).unwrap();
    // SAFETY: a fresh read-only shared mapping of an open file, unmapped below.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            8192,
            libc::PROT_READ,
            libc::MAP_SHARED,
            std::os::fd::AsRawFd::as_raw_fd(&reader),
            0,
        )
    };
    assert_ne!(addr, libc::MAP_FAILED);
    // SAFETY: the mapping is 8192 bytes long and lives until the munmap below.
    let mapped = unsafe { std::slice::from_raw_parts(addr as *const u8, 8192) };
    assert_eq!(mapped[4096], b'o', "the reader's pages are cached now");
    // A write-only open writes past the page cache (FOPEN_DIRECT_IO).
    let mut w = OpenOptions::new().write(true).open(fx.m("f")).unwrap();
    w.seek(SeekFrom::Start(4096)).unwrap();
    w.write_all(b"new").unwrap();
    drop(w);
    assert_eq!(&mapped[4096..4099], b"new", "the mapping shows the write");
    let mut buf = [0u8; 3];
    use std::os::unix::fs::FileExt;
    reader.read_exact_at(&mut buf, 4096).unwrap();
    assert_eq!(&buf, b"new", "so does a read of the reader's descriptor");
    // SAFETY: the mapping made above, of that length.
    unsafe { libc::munmap(addr, 8192) };
    assert_eq!(&fs::read(fx.b("f")).unwrap()[4096..4099], b"new");
}

#[test]
fn a_file_written_through_the_mount_reads_back_with_passthrough() {
    let fx = Fixture::new();
    create_write_read_back(&fx);
}

#[test]
fn a_file_written_through_the_mount_reads_back_when_forwarded() {
    let fx = Fixture::with(forwarding());
    assert!(!fx.mount().info().passthrough);
    assert_eq!(
        fx.mount().info().passthrough_off,
        Some(meshfs_fuse::PassthroughOff::NotAsked)
    );
    create_write_read_back(&fx);
}

/// Whether this kernel offers FUSE over io_uring (Linux ≥ 6.14 with the `fuse` module's
/// `enable_uring` switch on; `.ci/run` turns it on) and this process may use io_uring.
fn kernel_offers_io_uring() -> bool {
    fs::read_to_string("/sys/module/fuse/parameters/enable_uring").is_ok_and(|s| s.trim() == "Y")
        && fs::read_to_string("/proc/sys/kernel/io_uring_disabled")
            .map_or(true, |s| s.trim() != "2")
}

#[test]
fn requests_come_over_io_uring_where_the_kernel_offers_it_forwarded_writes_included() {
    // Forwarded, so reads and writes of up to 1 MiB pass through the queues' payload buffers.
    let fx = Fixture::with(forwarding());
    assert_eq!(
        fx.mount().info().io_uring,
        kernel_offers_io_uring(),
        "{:?}",
        fx.mount().info()
    );
    create_write_read_back(&fx);
    let fx = Fixture::new();
    assert_eq!(fx.mount().info().io_uring, kernel_offers_io_uring());
    create_write_read_back(&fx);
}

#[test]
fn without_io_uring_requests_come_through_the_device_threads() {
    for passthrough in [true, false] {
        let fx = Fixture::with(MountOptions {
            io_uring: false,
            passthrough,
            ..MountOptions::default()
        });
        assert!(!fx.mount().info().io_uring, "{:?}", fx.mount().info());
        create_write_read_back(&fx);
        open_file_survives_unlink_and_rename_over(&fx);
    }
}

/// The child half of `a_mount_whose_io_uring_queues_cannot_start_comes_up_over_dev_fuse`: in
/// a process where every queue fails to start (`FUSER_URING_FAIL_QUEUES`), a mount still comes
/// up and serves. Does nothing when run as an ordinary test.
#[test]
fn uring_fallback_child() {
    if std::env::var_os("FUSER_URING_FAIL_QUEUES").is_none() {
        return;
    }
    let fx = Fixture::new();
    assert!(!fx.mount().info().io_uring, "{:?}", fx.mount().info());
    create_write_read_back(&fx);
    println!("FALLBACK-SERVED");
}

#[test]
fn a_mount_whose_io_uring_queues_cannot_start_comes_up_over_dev_fuse() {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "uring_fallback_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("FUSER_URING_FAIL_QUEUES", "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("FALLBACK-SERVED"),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn kernel_passthrough_is_active_where_the_kernel_allows_it() {
    let fx = Fixture::new();
    // This machine runs Linux ≥ 6.9 as root: passthrough must be negotiated.
    fs::write(fx.m("f"), b"x").unwrap();
    let _open = File::open(fx.m("f")).unwrap();
    assert!(fx.mount().info().passthrough, "{:?}", fx.mount().info());
    assert_eq!(fx.mount().info().passthrough_off, None);
    fx.wait_for_open_handles(1);
}

#[test]
fn files_in_the_backing_dir_are_visible_with_their_metadata() {
    let fx = Fixture::new();
    fs::create_dir_all(fx.b("d/e")).unwrap();
    fs::write(fx.b("d/e/f"), b"content").unwrap();
    fs::set_permissions(fx.b("d/e/f"), fs::Permissions::from_mode(0o640)).unwrap();
    let m = fs::metadata(fx.m("d/e/f")).unwrap();
    let b = fs::metadata(fx.b("d/e/f")).unwrap();
    assert_eq!(m.len(), 7);
    assert_eq!(m.mode(), b.mode());
    assert_eq!(m.ino(), b.ino(), "inode numbers are the backing's");
    assert_eq!(m.mtime(), b.mtime());
    assert_eq!(m.mtime_nsec(), b.mtime_nsec());
    assert_eq!(fs::read(fx.m("d/e/f")).unwrap(), b"content");
}

// ---------------------------------------------------------------------------------------
// Renames, links, removal

#[test]
fn rename_over_an_existing_file_replaces_it() {
    let fx = Fixture::new();
    fs::write(fx.m("old"), b"old").unwrap();
    fs::write(fx.m("new"), b"new").unwrap();
    fs::rename(fx.m("new"), fx.m("old")).unwrap();
    assert_eq!(fs::read(fx.m("old")).unwrap(), b"new");
    assert!(!fx.m("new").exists());
    assert_eq!(fs::read(fx.b("old")).unwrap(), b"new");
    fx.expect_event("old", ChangeKind::RenamedFrom(rel("new")));
}

#[test]
fn renamed_directories_keep_their_contents_reachable() {
    let fx = Fixture::new();
    fs::create_dir_all(fx.m("a/b")).unwrap();
    fs::write(fx.m("a/b/f"), b"1").unwrap();
    assert_eq!(fs::read(fx.m("a/b/f")).unwrap(), b"1");
    fs::rename(fx.m("a"), fx.m("z")).unwrap();
    assert_eq!(fs::read(fx.m("z/b/f")).unwrap(), b"1");
    fs::write(fx.m("z/b/g"), b"2").unwrap();
    assert_eq!(fs::read(fx.b("z/b/g")).unwrap(), b"2");
    assert!(!fx.m("a").exists());
}

fn open_file_survives_unlink_and_rename_over(fx: &Fixture) {
    // Unlink.
    fs::write(fx.m("u"), b"before").unwrap();
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(fx.m("u"))
        .unwrap();
    fs::remove_file(fx.m("u")).unwrap();
    assert!(!fx.m("u").exists());
    f.seek(SeekFrom::End(0)).unwrap();
    f.write_all(b"+after").unwrap();
    f.seek(SeekFrom::Start(0)).unwrap();
    let mut s = String::new();
    f.read_to_string(&mut s).unwrap();
    assert_eq!(s, "before+after");
    assert_eq!(f.metadata().unwrap().len(), 12);
    assert_eq!(f.metadata().unwrap().nlink(), 0);
    f.set_len(3).unwrap();
    assert_eq!(f.metadata().unwrap().len(), 3);
    drop(f);

    // Rename over.
    fs::write(fx.m("r"), b"first").unwrap();
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(fx.m("r"))
        .unwrap();
    fs::write(fx.m("r.tmp"), b"second").unwrap();
    fs::rename(fx.m("r.tmp"), fx.m("r")).unwrap();
    let mut s = String::new();
    f.read_to_string(&mut s).unwrap();
    assert_eq!(s, "first", "the open handle still reads the replaced file");
    f.write_all(b"!").unwrap();
    f.seek(SeekFrom::Start(0)).unwrap();
    s.clear();
    f.read_to_string(&mut s).unwrap();
    assert_eq!(s, "first!");
    assert_eq!(
        fs::read(fx.m("r")).unwrap(),
        b"second",
        "the path shows the new file"
    );
    // fchmod on the replaced file reaches it through its handle.
    f.set_permissions(fs::Permissions::from_mode(0o600))
        .unwrap();
    assert_eq!(f.metadata().unwrap().mode() & 0o777, 0o600);
    assert_ne!(
        fs::metadata(fx.m("r")).unwrap().mode() & 0o777,
        0o600,
        "not the file at the path"
    );
}

#[test]
fn an_open_file_stays_usable_after_unlink_and_rename_over() {
    let fx = Fixture::new();
    open_file_survives_unlink_and_rename_over(&fx);
}

#[test]
fn an_open_file_stays_usable_after_unlink_and_rename_over_when_forwarded() {
    let fx = Fixture::with(forwarding());
    open_file_survives_unlink_and_rename_over(&fx);
}

#[test]
fn rename_noreplace_refuses_and_exchange_swaps() {
    let fx = Fixture::new();
    fs::write(fx.m("a"), b"A").unwrap();
    fs::write(fx.m("b"), b"B").unwrap();
    assert_eq!(
        errno(renameat2(&fx.m("a"), &fx.m("b"), libc::RENAME_NOREPLACE)),
        libc::EEXIST
    );
    assert_eq!(fs::read(fx.m("b")).unwrap(), b"B");
    renameat2(&fx.m("a"), &fx.m("c"), libc::RENAME_NOREPLACE).unwrap();
    assert_eq!(fs::read(fx.m("c")).unwrap(), b"A");

    fs::create_dir(fx.m("d")).unwrap();
    fs::write(fx.m("d/inside"), b"I").unwrap();
    renameat2(&fx.m("c"), &fx.m("d"), libc::RENAME_EXCHANGE).unwrap();
    assert_eq!(fs::read(fx.m("d")).unwrap(), b"A");
    assert_eq!(fs::read(fx.m("c/inside")).unwrap(), b"I");
    assert_eq!(fs::read(fx.b("c/inside")).unwrap(), b"I");
    fx.expect_event("d", ChangeKind::RenamedFrom(rel("c")));
    fx.expect_event("c", ChangeKind::RenamedFrom(rel("d")));
    assert_eq!(
        errno(renameat2(
            &fx.m("c"),
            &fx.m("nothing"),
            libc::RENAME_EXCHANGE
        )),
        libc::ENOENT
    );
}

#[test]
fn hard_links_share_an_inode() {
    let fx = Fixture::new();
    fs::write(fx.m("a"), b"data").unwrap();
    fs::hard_link(fx.m("a"), fx.m("b")).unwrap();
    let (ma, mb) = (
        fs::metadata(fx.m("a")).unwrap(),
        fs::metadata(fx.m("b")).unwrap(),
    );
    assert_eq!(ma.ino(), mb.ino());
    assert_eq!(ma.nlink(), 2);
    assert_eq!(fs::metadata(fx.b("b")).unwrap().nlink(), 2);
    fs::write(fx.m("b"), b"changed").unwrap();
    assert_eq!(fs::read(fx.m("a")).unwrap(), b"changed");
    fs::remove_file(fx.m("a")).unwrap();
    assert_eq!(fs::metadata(fx.m("b")).unwrap().nlink(), 1);
    assert_eq!(fs::read(fx.m("b")).unwrap(), b"changed");
    fx.expect_event("b", ChangeKind::Created);
}

#[test]
fn symlinks_are_created_and_read_as_links() {
    let fx = Fixture::new();
    fs::write(fx.m("target"), b"t").unwrap();
    std::os::unix::fs::symlink("target", fx.m("link")).unwrap();
    assert_eq!(fs::read_link(fx.m("link")).unwrap(), Path::new("target"));
    assert!(fs::symlink_metadata(fx.m("link"))
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(fs::read(fx.m("link")).unwrap(), b"t");
    assert_eq!(fs::read_link(fx.b("link")).unwrap(), Path::new("target"));
    // A link pointing out of the folder is stored as it is (the kernel, not the mount,
    // follows it, as on any filesystem).
    std::os::unix::fs::symlink("/etc/hostname", fx.m("out")).unwrap();
    assert_eq!(
        fs::read_link(fx.m("out")).unwrap(),
        Path::new("/etc/hostname")
    );
    fx.expect_event("link", ChangeKind::Created);
}

#[test]
fn a_directory_replaced_by_a_symlink_in_the_backing_is_not_followed_out() {
    let fx = Fixture::with(MountOptions {
        ttl: Duration::from_secs(60),
        ..MountOptions::default()
    });
    fs::create_dir(fx.m("d")).unwrap();
    fs::write(fx.m("d/f"), b"inside").unwrap();
    assert_eq!(fs::read(fx.m("d/f")).unwrap(), b"inside");
    // Behind the mount's back (no invalidation): d becomes a link to a directory outside.
    let outside = fx._dir.path().join("outside");
    fs::create_dir(&outside).unwrap();
    fs::write(outside.join("f"), b"secret").unwrap();
    fs::write(outside.join("g"), b"secret").unwrap();
    fs::rename(fx.b("d"), fx._dir.path().join("moved")).unwrap();
    std::os::unix::fs::symlink(&outside, fx.b("d")).unwrap();
    // The kernel still believes d is the directory it knew; nothing the link points to is
    // reached, neither for reading nor for writing.
    for name in ["d/f", "d/g"] {
        if let Ok(data) = fs::read(fx.m(name)) {
            assert_ne!(data, b"secret", "{name} leaked from outside the folder");
        }
    }
    let _ = fs::write(fx.m("d/new"), b"x");
    assert!(!outside.join("new").exists(), "written through the link");
    fx.mount().handle().invalidate(&rel("d"));
    std::thread::sleep(Duration::from_millis(100));
    // Once the engine invalidated it, d is what the backing has: a symlink (which the
    // kernel, not the mount, follows, as on any filesystem).
    assert!(fs::symlink_metadata(fx.m("d"))
        .unwrap()
        .file_type()
        .is_symlink());
}

#[test]
fn removing_files_and_directories() {
    let fx = Fixture::new();
    fs::create_dir(fx.m("d")).unwrap();
    fs::write(fx.m("d/f"), b"").unwrap();
    fs::remove_file(fx.m("d/f")).unwrap();
    fs::remove_dir(fx.m("d")).unwrap();
    assert!(!fx.b("d").exists());
    fx.expect_event("d/f", ChangeKind::Removed);
    fx.expect_event("d", ChangeKind::Removed);
}

#[test]
fn fifos_can_be_made() {
    let fx = Fixture::new();
    let p = c(&fx.m("fifo"));
    // SAFETY: the path is NUL-terminated.
    assert_eq!(unsafe { libc::mkfifo(p.as_ptr(), 0o640) }, 0);
    let m = fs::symlink_metadata(fx.m("fifo")).unwrap();
    assert_eq!(m.mode() & libc::S_IFMT, libc::S_IFIFO);
    assert_eq!(m.mode() & 0o777, 0o640);
    fx.expect_event("fifo", ChangeKind::Created);
}

// ---------------------------------------------------------------------------------------
// Attributes

#[test]
fn chmod_truncate_and_times_reach_the_backing_file() {
    let fx = Fixture::new();
    fs::write(fx.m("f"), b"0123456789").unwrap();
    fs::set_permissions(fx.m("f"), fs::Permissions::from_mode(0o751)).unwrap();
    assert_eq!(fs::metadata(fx.m("f")).unwrap().mode() & 0o7777, 0o751);
    assert_eq!(fs::metadata(fx.b("f")).unwrap().mode() & 0o7777, 0o751);

    OpenOptions::new()
        .write(true)
        .open(fx.m("f"))
        .unwrap()
        .set_len(4)
        .unwrap();
    assert_eq!(fs::read(fx.m("f")).unwrap(), b"0123");
    // truncate(2) by path, growing.
    let p = c(&fx.m("f"));
    // SAFETY: the path is NUL-terminated.
    assert_eq!(unsafe { libc::truncate(p.as_ptr(), 100) }, 0);
    assert_eq!(fs::metadata(fx.b("f")).unwrap().len(), 100);

    // utimensat: a fixed atime, mtime left alone (UTIME_OMIT), then mtime = now.
    let before = fs::metadata(fx.m("f")).unwrap();
    let times = [
        libc::timespec {
            tv_sec: 1_000_000_000,
            tv_nsec: 123_456_789,
        },
        libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_OMIT,
        },
    ];
    utimensat(&p, &times);
    let m = fs::metadata(fx.m("f")).unwrap();
    assert_eq!((m.atime(), m.atime_nsec()), (1_000_000_000, 123_456_789));
    assert_eq!(
        (m.mtime(), m.mtime_nsec()),
        (before.mtime(), before.mtime_nsec())
    );
    let b = fs::metadata(fx.b("f")).unwrap();
    assert_eq!((b.atime(), b.atime_nsec()), (1_000_000_000, 123_456_789));

    let times = [
        libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_OMIT,
        },
        libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_NOW,
        },
    ];
    let t0 = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    utimensat(&p, &times);
    let m = fs::metadata(fx.m("f")).unwrap();
    assert!(m.mtime() >= t0 - 1, "mtime {} is now", m.mtime());
    assert_eq!(m.atime(), 1_000_000_000, "atime omitted");
    fx.expect_event("f", ChangeKind::Metadata);
}

fn utimensat(path: &CString, times: &[libc::timespec; 2]) {
    // SAFETY: the path is NUL-terminated and `times` holds two timespecs.
    let r = unsafe { libc::utimensat(libc::AT_FDCWD, path.as_ptr(), times.as_ptr(), 0) };
    assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
}

#[test]
fn chown_as_root_reaches_the_backing_file() {
    let fx = Fixture::new();
    fs::write(fx.m("f"), b"").unwrap();
    std::os::unix::fs::chown(fx.m("f"), Some(1234), Some(5678)).unwrap();
    let b = fs::metadata(fx.b("f")).unwrap();
    assert_eq!((b.uid(), b.gid()), (1234, 5678));
    let m = fs::metadata(fx.m("f")).unwrap();
    assert_eq!((m.uid(), m.gid()), (1234, 5678));
}

#[test]
fn extended_attributes_round_trip() {
    let fx = Fixture::new();
    fs::write(fx.m("f"), b"").unwrap();
    let p = c(&fx.m("f"));
    let name = c(Path::new("user.meshfs-test"));
    let value = b"value\0with bytes";
    // SAFETY: strings are NUL-terminated; buffers are valid for the lengths passed.
    unsafe {
        assert_eq!(
            libc::setxattr(
                p.as_ptr(),
                name.as_ptr(),
                value.as_ptr().cast(),
                value.len(),
                0
            ),
            0,
            "{}",
            std::io::Error::last_os_error()
        );
        let mut buf = [0u8; 64];
        let n = libc::getxattr(
            p.as_ptr(),
            name.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        );
        assert_eq!(&buf[..n as usize], value);
        assert_eq!(
            libc::getxattr(p.as_ptr(), name.as_ptr(), std::ptr::null_mut(), 0),
            value.len() as isize
        );
        let mut small = [0u8; 2];
        assert_eq!(
            libc::getxattr(p.as_ptr(), name.as_ptr(), small.as_mut_ptr().cast(), 2),
            -1
        );
        assert_eq!(
            std::io::Error::last_os_error().raw_os_error(),
            Some(libc::ERANGE)
        );
        let mut list = [0u8; 256];
        let n = libc::listxattr(p.as_ptr(), list.as_mut_ptr().cast(), list.len());
        assert!(n > 0);
        let names: Vec<&[u8]> = list[..n as usize].split(|&b| b == 0).collect();
        assert!(names.contains(&&b"user.meshfs-test"[..]));
        // Same attribute in the backing file.
        let bp = c(&fx.b("f"));
        let n = libc::getxattr(
            bp.as_ptr(),
            name.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        );
        assert_eq!(&buf[..n as usize], value);
        assert_eq!(libc::removexattr(p.as_ptr(), name.as_ptr()), 0);
        assert_eq!(
            libc::getxattr(
                p.as_ptr(),
                name.as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len()
            ),
            -1
        );
        assert_eq!(
            std::io::Error::last_os_error().raw_os_error(),
            Some(libc::ENODATA)
        );
        // XATTR_CREATE on an existing attribute: EEXIST, as on ext4.
        assert_eq!(
            libc::setxattr(p.as_ptr(), name.as_ptr(), value.as_ptr().cast(), 1, 0),
            0
        );
        assert_eq!(
            libc::setxattr(
                p.as_ptr(),
                name.as_ptr(),
                value.as_ptr().cast(),
                1,
                libc::XATTR_CREATE
            ),
            -1
        );
        assert_eq!(
            std::io::Error::last_os_error().raw_os_error(),
            Some(libc::EEXIST)
        );
    }
}

#[test]
fn statfs_reports_the_backing_filesystem() {
    let fx = Fixture::new();
    let stat = |p: &Path| {
        let cp = c(p);
        // SAFETY: statvfs is plain integers; all-zero is a valid value.
        let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: the path is NUL-terminated, `s` is writable.
        assert_eq!(unsafe { libc::statvfs(cp.as_ptr(), &mut s) }, 0);
        s
    };
    let (m, b) = (stat(&fx.mnt), stat(&fx.back));
    assert_eq!(m.f_blocks, b.f_blocks);
    assert_eq!(m.f_bsize, b.f_bsize);
    assert_eq!(m.f_files, b.f_files);
    assert_eq!(m.f_namemax, b.f_namemax);
}

// ---------------------------------------------------------------------------------------
// Directories and errors

#[test]
fn a_directory_of_ten_thousand_entries_lists_completely() {
    let fx = Fixture::new();
    fs::create_dir(fx.b("many")).unwrap();
    let mut want = HashSet::new();
    for i in 0..10_000 {
        let name = format!("entry-{i:05}-with-a-longer-name-to-fill-the-buffers");
        File::create(fx.b("many").join(&name)).unwrap();
        want.insert(name);
    }
    // Twice: the first listing is readdirplus, a later one may be plain readdir.
    for _ in 0..2 {
        let got: HashSet<String> = fs::read_dir(fx.m("many"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(got.len(), 10_000);
        assert_eq!(got, want);
    }
    // Through `ls -f` (plain getdents with its own buffer size) as well.
    let out = Command::new("ls")
        .arg("-f")
        .arg(fx.m("many"))
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8(out.stdout).unwrap().lines().count(),
        10_002
    );
}

#[test]
fn failures_carry_the_backing_errno() {
    let fx = Fixture::new();
    fs::create_dir(fx.m("d")).unwrap();
    fs::write(fx.m("d/f"), b"").unwrap();
    fs::write(fx.m("file"), b"").unwrap();

    assert_eq!(errno(File::open(fx.m("missing"))), libc::ENOENT);
    assert_eq!(errno(fs::metadata(fx.m("d/missing/x"))), libc::ENOENT);
    assert_eq!(errno(fs::create_dir(fx.m("d"))), libc::EEXIST);
    assert_eq!(
        errno(
            OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(fx.m("file"))
        ),
        libc::EEXIST
    );
    assert_eq!(errno(fs::remove_dir(fx.m("d"))), libc::ENOTEMPTY);
    assert_eq!(
        errno(OpenOptions::new().write(true).open(fx.m("d"))),
        libc::EISDIR
    );
    assert_eq!(errno(fs::remove_file(fx.m("d"))), libc::EISDIR);
    assert_eq!(errno(File::open(fx.m("file/x"))), libc::ENOTDIR);
    assert_eq!(errno(fs::remove_dir(fx.m("file"))), libc::ENOTDIR);
    assert_eq!(errno(fs::rename(fx.m("d"), fx.m("file"))), libc::ENOTDIR);
    assert_eq!(errno(fs::rename(fx.m("file"), fx.m("d"))), libc::EISDIR);
    assert_eq!(errno(fs::rename(fx.m("d"), fx.m("d/sub"))), libc::EINVAL);
    assert_eq!(errno(fs::read_link(fx.m("file"))), libc::EINVAL);
    assert_eq!(
        errno(fs::write(fx.m(&"n".repeat(256)), b"")),
        libc::ENAMETOOLONG
    );
}

#[test]
fn the_editor_save_pattern_replaces_the_file_atomically() {
    let fx = Fixture::new();
    fs::write(fx.m("doc.txt"), b"version 1").unwrap();
    let reader = File::open(fx.m("doc.txt")).unwrap();

    // Write a temp file, fsync it, rename it over the document, fsync the directory.
    let mut tmp = File::create(fx.m(".doc.txt.swp")).unwrap();
    tmp.write_all(b"version 2").unwrap();
    tmp.sync_all().unwrap();
    drop(tmp);
    fs::rename(fx.m(".doc.txt.swp"), fx.m("doc.txt")).unwrap();
    File::open(&fx.mnt).unwrap().sync_all().unwrap();

    assert_eq!(fs::read(fx.m("doc.txt")).unwrap(), b"version 2");
    assert_eq!(fs::read(fx.b("doc.txt")).unwrap(), b"version 2");
    let mut old = String::new();
    (&reader).read_to_string(&mut old).unwrap();
    assert_eq!(old, "version 1", "an open reader keeps the old version");
    assert!(!fx.m(".doc.txt.swp").exists());

    fx.expect_event(".doc.txt.swp", ChangeKind::Created);
    fx.expect_event(".doc.txt.swp", ChangeKind::Written);
    fx.expect_event("doc.txt", ChangeKind::RenamedFrom(rel(".doc.txt.swp")));
}

// ---------------------------------------------------------------------------------------
// meshfs's own names

#[test]
fn meshfs_internal_names_are_invisible_and_untouchable() {
    let fx = Fixture::new();
    fs::create_dir_all(fx.b(".meshfs/state")).unwrap();
    fs::write(fx.b(".meshfs/state/db"), b"secret").unwrap();
    fs::write(fx.b(".meshfs-tmp-123"), b"partial").unwrap();
    fs::create_dir(fx.b("sub")).unwrap();
    fs::write(fx.b("sub/.meshfs-tmp-9"), b"partial").unwrap();
    fs::write(fx.b("visible"), b"v").unwrap();

    let names = |p: PathBuf| -> Vec<String> {
        fs::read_dir(p)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect()
    };
    assert_eq!(sorted(names(fx.mnt.clone())), vec!["sub", "visible"]);
    assert!(names(fx.m("sub")).is_empty());

    for p in [
        ".meshfs",
        ".meshfs/state/db",
        ".meshfs-tmp-123",
        "sub/.meshfs-tmp-9",
    ] {
        assert_eq!(errno(fs::symlink_metadata(fx.m(p))), libc::ENOENT, "{p}");
        assert_eq!(errno(File::open(fx.m(p))), libc::ENOENT, "{p}");
    }
    assert_eq!(errno(fs::write(fx.m(".meshfs-new"), b"")), libc::EPERM);
    assert_eq!(errno(fs::write(fx.m("sub/.meshfs"), b"")), libc::EPERM);
    assert_eq!(errno(fs::create_dir(fx.m(".meshfs2"))), libc::EPERM);
    assert_eq!(
        errno(fs::rename(fx.m("visible"), fx.m(".meshfs"))),
        libc::EPERM
    );
    assert_eq!(
        errno(fs::rename(fx.m("visible"), fx.m("sub/.meshfs-tmp-9"))),
        libc::EPERM
    );
    assert_eq!(
        errno(fs::hard_link(fx.m("visible"), fx.m(".meshfs-l"))),
        libc::EPERM
    );
    assert_eq!(
        errno(std::os::unix::fs::symlink("visible", fx.m(".meshfs-s"))),
        libc::EPERM
    );
    assert_eq!(
        errno(fs::remove_file(fx.m(".meshfs-tmp-123"))),
        libc::ENOENT
    );
    // Untouched underneath.
    assert_eq!(fs::read(fx.b(".meshfs/state/db")).unwrap(), b"secret");
    assert_eq!(fs::read(fx.b("sub/.meshfs-tmp-9")).unwrap(), b"partial");
    assert_eq!(fs::read(fx.b("visible")).unwrap(), b"v");
}

fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v
}

// ---------------------------------------------------------------------------------------
// The engine's interface

#[test]
fn every_change_is_reported_with_its_kind() {
    let fx = Fixture::new();
    fs::create_dir(fx.m("dir")).unwrap();
    let mut f = File::create(fx.m("dir/f")).unwrap();
    f.write_all(b"x").unwrap();
    drop(f);
    fs::rename(fx.m("dir/f"), fx.m("dir/g")).unwrap();
    fs::set_permissions(fx.m("dir/g"), fs::Permissions::from_mode(0o600)).unwrap();
    fs::hard_link(fx.m("dir/g"), fx.m("h")).unwrap();
    std::os::unix::fs::symlink("dir/g", fx.m("s")).unwrap();
    fs::remove_file(fx.m("h")).unwrap();

    fx.expect_event("dir", ChangeKind::Created);
    fx.expect_event("dir/f", ChangeKind::Created);
    fx.expect_event("dir/f", ChangeKind::Written);
    fx.expect_event("dir/f", ChangeKind::Closed);
    fx.expect_event("dir/g", ChangeKind::RenamedFrom(rel("dir/f")));
    fx.expect_event("dir/g", ChangeKind::Metadata);
    fx.expect_event("h", ChangeKind::Created);
    fx.expect_event("s", ChangeKind::Created);
    fx.expect_event("h", ChangeKind::Removed);

    // Reading reports nothing.
    let n = fx.events().len();
    let _ = fs::read(fx.m("dir/g")).unwrap();
    let _ = fs::read_dir(fx.m("dir")).unwrap().count();
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(fx.events().len(), n, "{:#?}", &fx.events()[n..]);
}

#[test]
fn a_forwarded_handle_reports_written_only_if_it_wrote() {
    let fx = Fixture::with(forwarding());
    fs::write(fx.b("f"), b"x").unwrap();
    drop(OpenOptions::new().write(true).open(fx.m("f")).unwrap());
    fx.expect_event("f", ChangeKind::Closed);
    assert!(!fx.events().iter().any(|e| e.kind == ChangeKind::Written));
    let mut f = OpenOptions::new().write(true).open(fx.m("f")).unwrap();
    f.write_all(b"y").unwrap();
    f.sync_data().unwrap();
    fx.expect_event("f", ChangeKind::Written);
}

#[test]
fn the_writer_registry_sees_open_writers_until_their_release() {
    let fx = Fixture::new();
    let handle = fx.mount().handle();
    fs::write(fx.m("f"), b"1").unwrap();
    fx.expect_event("f", ChangeKind::Closed);
    assert!(!handle.has_writer(&rel("f")));
    let reader = File::open(fx.m("f")).unwrap();
    assert!(!handle.has_writer(&rel("f")), "a reader is not a writer");
    let w1 = OpenOptions::new().write(true).open(fx.m("f")).unwrap();
    let w2 = OpenOptions::new().append(true).open(fx.m("f")).unwrap();
    assert!(handle.has_writer(&rel("f")));
    assert!(fx.mount().has_writer(&rel("f")));
    assert!(!handle.has_writer(&rel("other")));
    let closed_before = fx
        .events()
        .iter()
        .filter(|e| e.kind == ChangeKind::Closed)
        .count();
    drop(w1);
    std::thread::sleep(Duration::from_millis(100));
    assert!(handle.has_writer(&rel("f")), "one writer is left");
    drop(w2);
    let deadline = Instant::now() + Duration::from_secs(5);
    while handle.has_writer(&rel("f")) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(!handle.has_writer(&rel("f")));
    fx.expect_event("f", ChangeKind::Closed);
    let closed = fx
        .events()
        .iter()
        .filter(|e| e.kind == ChangeKind::Closed)
        .count();
    assert_eq!(
        closed,
        closed_before + 1,
        "one Closed for the last writer only"
    );
    drop(reader);
}

#[test]
fn an_invalidation_shows_a_change_made_behind_the_mount_at_once() {
    // Long TTLs: without the invalidation the kernel would keep the old view for a minute.
    let fx = Fixture::with(MountOptions {
        ttl: Duration::from_secs(60),
        ..MountOptions::default()
    });
    fs::create_dir(fx.m("d")).unwrap();
    fs::write(fx.m("d/f"), b"old").unwrap();
    assert_eq!(fs::metadata(fx.m("d/f")).unwrap().len(), 3);
    assert!(!fx.m("d/new").exists(), "cached as absent");

    // The engine applies remote changes the safe way: temp file, rename over.
    fs::write(fx.b("d/.meshfs-tmp-1"), b"new content").unwrap();
    fs::rename(fx.b("d/.meshfs-tmp-1"), fx.b("d/f")).unwrap();
    fs::write(fx.b("d/new"), b"created remotely").unwrap();
    assert_eq!(fs::metadata(fx.m("d/f")).unwrap().len(), 3, "still cached");

    let handle = fx.mount().handle();
    handle.invalidate(&rel("d/f"));
    handle.invalidate(&rel("d/new"));
    handle.invalidate(&rel("never/seen/path"));
    // The notifier thread sends them in turn: wait until it has sent all three (waiting for
    // the first path to change only raced the second one's notification under load).
    let deadline = Instant::now() + Duration::from_secs(5);
    while fx.mount().info().invalidations_pending > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(fx.mount().info().invalidations_pending, 0, "queue drained");
    assert_eq!(fs::read(fx.m("d/f")).unwrap(), b"new content");
    assert_eq!(fs::read(fx.m("d/new")).unwrap(), b"created remotely");
    // Nothing the engine did itself is reported back to it.
    assert!(!fx.events().iter().any(|e| e.path.as_str() == "d/new"));
}

fn listing(dir: &Path) -> Vec<String> {
    sorted(
        fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect(),
    )
}

#[test]
fn a_cached_directory_listing_follows_changes_through_the_mount_and_invalidations() {
    // Long TTLs: the listing is cached across opens, and nothing but the changes themselves
    // or an invalidation may refresh it within the test.
    let fx = Fixture::with(MountOptions {
        ttl: Duration::from_secs(60),
        ..MountOptions::default()
    });
    fs::create_dir(fx.m("d")).unwrap();
    fs::write(fx.m("d/a"), b"a").unwrap();
    fs::write(fx.m("d/b"), b"b").unwrap();
    assert_eq!(listing(&fx.m("d")), ["a", "b"]);

    // Changes through the mount: the kernel drops the cached listing itself.
    fs::write(fx.m("d/c"), b"c").unwrap();
    assert_eq!(listing(&fx.m("d")), ["a", "b", "c"]);
    fs::remove_file(fx.m("d/a")).unwrap();
    assert_eq!(listing(&fx.m("d")), ["b", "c"]);
    fs::rename(fx.m("d/b"), fx.m("moved")).unwrap();
    assert_eq!(listing(&fx.m("d")), ["c"]);
    assert_eq!(listing(&fx.mnt), ["d", "moved"]);
    fs::create_dir(fx.m("d/sub")).unwrap();
    fs::hard_link(fx.m("moved"), fx.m("d/link")).unwrap();
    assert_eq!(listing(&fx.m("d")), ["c", "link", "sub"]);

    // A change behind the mount's back is not seen before the TTL: the listing is cached.
    // (The open after a listing read from the mount checks the directory's mtime once more;
    // the one after a cached listing does not.)
    assert_eq!(listing(&fx.m("d")), ["c", "link", "sub"]);
    fs::write(fx.b("d/behind"), b"x").unwrap();
    assert_eq!(listing(&fx.m("d")), ["c", "link", "sub"]);

    // The engine's invalidations: a name the kernel never looked up, a removal, a directory
    // below one the kernel has not listed.
    let handle = fx.mount().handle();
    handle.invalidate(&rel("d/behind"));
    let deadline = Instant::now() + Duration::from_secs(5);
    while listing(&fx.m("d")).len() != 4 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(listing(&fx.m("d")), ["behind", "c", "link", "sub"]);
    fs::remove_file(fx.b("d/c")).unwrap();
    fs::create_dir_all(fx.b("d/sub/deeper/still")).unwrap();
    assert_eq!(
        listing(&fx.m("d/sub")),
        ["deeper"],
        "never listed: read fresh"
    );
    assert_eq!(listing(&fx.m("d/sub/deeper")), ["still"]);
    for _ in 0..2 {
        assert_eq!(listing(&fx.m("d/sub/deeper/still")), Vec::<String>::new());
    }
    fs::write(fx.b("d/sub/deeper/still/f"), b"f").unwrap();
    assert_eq!(listing(&fx.m("d/sub/deeper/still")), Vec::<String>::new());
    handle.invalidate(&rel("d/c"));
    handle.invalidate(&rel("d/sub/deeper/still/f"));
    let deadline = Instant::now() + Duration::from_secs(5);
    while (listing(&fx.m("d")).len() != 3 || listing(&fx.m("d/sub/deeper/still")).is_empty())
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(listing(&fx.m("d")), ["behind", "link", "sub"]);
    assert_eq!(listing(&fx.m("d/sub/deeper/still")), ["f"]);
}

#[test]
fn a_busy_mount_unmounts_by_detaching() {
    let mut fx = Fixture::new();
    fs::write(fx.m("f"), b"still readable").unwrap();
    let mut open = File::open(fx.m("f")).unwrap();
    let m = fx.mount.take().unwrap();
    m.unmount().unwrap();
    assert_eq!(
        fs::read_dir(&fx.mnt).unwrap().count(),
        0,
        "the mount point is free"
    );
    let mut s = String::new();
    open.read_to_string(&mut s).unwrap();
    assert_eq!(s, "still readable", "its last user is still served");
}

#[test]
fn a_read_only_mount_refuses_changes() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let (back, mnt) = (dir.path().join("b"), dir.path().join("m"));
    fs::create_dir(&back).unwrap();
    fs::create_dir(&mnt).unwrap();
    fs::write(back.join("f"), b"ro").unwrap();
    let opts = MountOptions {
        read_only: true,
        ..MountOptions::default()
    };
    let m = mount(&back, &mnt, opts, Arc::new(|_ev: ChangeEvent| {})).unwrap();
    assert!(m.info().read_only);
    assert_eq!(fs::read(mnt.join("f")).unwrap(), b"ro");
    assert_eq!(errno(fs::write(mnt.join("f"), b"x")), libc::EROFS);
    assert_eq!(errno(fs::write(mnt.join("g"), b"x")), libc::EROFS);
    assert_eq!(errno(fs::remove_file(mnt.join("f"))), libc::EROFS);
    m.unmount().unwrap();
}

// ---------------------------------------------------------------------------------------
// Mount points

#[test]
fn mount_point_problems_are_named_clearly() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let back = dir.path().join("back");
    fs::create_dir(&back).unwrap();
    let sink = Arc::new(|_ev: ChangeEvent| {});
    let opts = MountOptions::default;

    let missing = dir.path().join("missing");
    let e = mount(&back, &missing, opts(), sink.clone()).unwrap_err();
    assert!(matches!(e, MountError::MountPointMissing(_)), "{e}");
    assert!(e.to_string().contains(missing.to_str().unwrap()), "{e}");

    let file = dir.path().join("file");
    fs::write(&file, b"").unwrap();
    let e = mount(&back, &file, opts(), sink.clone()).unwrap_err();
    assert!(matches!(e, MountError::NotADirectory(_)), "{e}");

    let full = dir.path().join("full");
    fs::create_dir(&full).unwrap();
    fs::write(full.join("x"), b"").unwrap();
    let e = mount(&back, &full, opts(), sink.clone()).unwrap_err();
    assert!(matches!(e, MountError::NotEmpty(_)), "{e}");
    assert!(e.to_string().contains("not empty"), "{e}");

    let inside = back.join("inside");
    fs::create_dir(&inside).unwrap();
    let e = mount(&back, &inside, opts(), sink.clone()).unwrap_err();
    assert!(matches!(e, MountError::Nested { .. }), "{e}");

    let e = mount(&dir.path().join("nope"), &full, opts(), sink.clone()).unwrap_err();
    assert!(matches!(e, MountError::Backing { .. }), "{e}");

    let mnt = dir.path().join("mnt");
    fs::create_dir(&mnt).unwrap();
    let first = mount(&back, &mnt, opts(), sink.clone()).unwrap();
    let e = mount(&back, &mnt, opts(), sink.clone()).unwrap_err();
    assert!(matches!(e, MountError::AlreadyMounted(_)), "{e}");
    first.unmount().unwrap();
    mount(&back, &mnt, opts(), sink).unwrap().unmount().unwrap();
}

/// The child half of `a_dead_mount_point_is_recovered`: mounts, says so, waits to be
/// killed. Does nothing when run as an ordinary test.
#[test]
fn dead_mount_child() {
    let Ok(spec) = std::env::var("MESHFS_FUSE_TEST_CHILD") else {
        return;
    };
    let (back, mnt) = spec.split_once('\n').unwrap();
    let m = mount(
        Path::new(back),
        Path::new(mnt),
        MountOptions::default(),
        Arc::new(|_ev: ChangeEvent| {}),
    )
    .unwrap();
    println!("MOUNTED");
    std::io::stdout().flush().unwrap();
    std::thread::sleep(Duration::from_secs(600));
    drop(m);
}

/// Detaches whatever is still mounted at its path when dropped: a failed assertion must not
/// leave a dead mount behind for the next run to trip on.
struct DetachOnDrop(std::ffi::CString);

impl Drop for DetachOnDrop {
    fn drop(&mut self) {
        // SAFETY: a NUL-terminated path; EINVAL (nothing mounted there) is expected and ignored.
        unsafe { libc::umount2(self.0.as_ptr(), libc::MNT_DETACH) };
    }
}

#[test]
fn a_dead_mount_point_is_recovered() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let (back, mnt) = (dir.path().join("b"), dir.path().join("m"));
    fs::create_dir(&back).unwrap();
    fs::create_dir(&mnt).unwrap();
    // Dropped before `dir`, whose removal would otherwise stop at the dead mount point.
    let _detach = DetachOnDrop(std::ffi::CString::new(mnt.as_os_str().as_bytes()).unwrap());
    fs::write(back.join("f"), b"survives").unwrap();

    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "dead_mount_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(
            "MESHFS_FUSE_TEST_CHILD",
            format!("{}\n{}", back.display(), mnt.display()),
        )
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut lines = BufReader::new(stdout).lines();
    assert!(
        lines.any(|l| l.is_ok_and(|l| l.contains("MOUNTED"))),
        "the child did not mount"
    );
    assert_eq!(fs::read(mnt.join("f")).unwrap(), b"survives");
    child.kill().unwrap();
    child.wait().unwrap();
    // A dead mount answers ENOTCONN; one served over io_uring answers ECONNABORTED or
    // ECANCELED until the kernel has torn its queues down.
    let e = fs::read_dir(&mnt).unwrap_err();
    assert!(
        matches!(
            e.raw_os_error(),
            Some(libc::ENOTCONN | libc::ECONNABORTED | libc::ECANCELED)
        ),
        "{e}"
    );

    let m = mount(
        &back,
        &mnt,
        MountOptions::default(),
        Arc::new(|_ev: ChangeEvent| {}),
    )
    .unwrap();
    assert_eq!(fs::read(mnt.join("f")).unwrap(), b"survives");
    m.unmount().unwrap();
    assert_eq!(fs::read_dir(&mnt).unwrap().count(), 0);
}

// ---------------------------------------------------------------------------------------
// Descriptors and real tools

#[test]
fn descriptors_stay_bounded_while_thirty_thousand_files_are_known() {
    let fx = Fixture::new();
    for d in 0..30 {
        let dir = fx.b(&format!("d{d:02}"));
        fs::create_dir(&dir).unwrap();
        for f in 0..1000 {
            File::create(dir.join(format!("f{f:04}"))).unwrap();
        }
    }
    let before = count_fds();
    let mut seen = 0;
    for d in 0..30 {
        for f in 0..1000 {
            let m = fs::metadata(fx.m(&format!("d{d:02}/f{f:04}"))).unwrap();
            assert!(m.is_file());
            seen += 1;
        }
    }
    assert_eq!(seen, 30_000);
    let after = count_fds();
    let info = fx.mount().info();
    assert!(info.known_inodes > 30_000, "{info:?}");
    assert!(info.cached_dirs <= 1024, "{info:?}");
    // Other tests run in this process at the same time: allow them some slack, but nothing
    // near one descriptor per inode.
    assert!(
        after < before + 300,
        "descriptors went from {before} to {after}"
    );
    assert!(after < 2_000, "{after} descriptors open");
}

#[test]
fn git_works_in_the_mount() {
    if Command::new("git").arg("--version").output().is_err() {
        eprintln!("git not installed; skipped");
        return;
    }
    let fx = Fixture::new();
    let git = |args: &[&str]| {
        let out = Command::new("git")
            .args([
                "-c",
                "user.name=meshfs",
                "-c",
                "user.email=test@meshfs.invalid",
            ])
            .args([
                "-c",
                "init.defaultBranch=main",
                "-c",
                "core.fsmonitor=false",
            ])
            .args(args)
            .current_dir(&fx.mnt)
            .env("GIT_CONFIG_NOSYSTEM", "1")
            .env("HOME", fx._dir.path())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "git {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    git(&["init", "-q"]);
    for i in 0..200 {
        let d = fx.m(&format!("src/m{}", i % 10));
        fs::create_dir_all(&d).unwrap();
        fs::write(d.join(format!("f{i}.rs")), format!("fn f{i}() {{}}\n")).unwrap();
    }
    git(&["add", "."]);
    git(&["commit", "-q", "-m", "first"]);
    assert_eq!(git(&["status", "--porcelain"]), "");
    fs::write(fx.m("src/m3/f3.rs"), "changed\n").unwrap();
    fs::rename(fx.m("src/m4/f4.rs"), fx.m("src/m4/g4.rs")).unwrap();
    let status = git(&["status", "--porcelain"]);
    assert!(status.contains(" M src/m3/f3.rs"), "{status}");
    assert!(status.contains(" D src/m4/f4.rs"), "{status}");
    git(&["add", "-A"]);
    git(&["commit", "-q", "-m", "second"]);
    assert_eq!(git(&["status", "--porcelain"]), "");
    assert_eq!(git(&["log", "--oneline"]).lines().count(), 2);
    git(&["fsck", "--no-progress"]);
}

#[test]
fn a_thousand_files_created_through_the_mount_all_arrive() {
    let fx = Fixture::new();
    fs::create_dir(fx.m("d")).unwrap();
    let start = Instant::now();
    for i in 0..1000 {
        fs::write(fx.m(&format!("d/{i}")), [b'x'; 4096]).unwrap();
    }
    eprintln!(
        "1000 × 4 KiB files through the mount: {:?}",
        start.elapsed()
    );
    assert_eq!(fs::read_dir(fx.b("d")).unwrap().count(), 1000);
    assert_eq!(fs::read_dir(fx.m("d")).unwrap().count(), 1000);
    fx.wait_for_open_handles(0);
    let err = fs::read(fx.m("d/1000")).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound);
}

// ---------------------------------------------------------------------------------------
// Other users, special I/O

/// Runs `script` with `sh -c` as the unprivileged user 65534 (nobody).
fn as_nobody(script: &str) -> std::process::Output {
    use std::os::unix::process::CommandExt;
    Command::new("sh")
        .arg("-c")
        .arg(script)
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap()
}

fn set_id_bits_are_cleared_by_a_write_from_another_user(fx: &Fixture) {
    for (name, how) in [("w", "echo more >> {}"), ("t", "truncate -s 1 {}")] {
        let p = fx.m(name);
        fs::write(&p, b"x").unwrap();
        fs::set_permissions(&p, fs::Permissions::from_mode(0o6777)).unwrap();
        let out = as_nobody(&how.replace("{}", p.to_str().unwrap()));
        assert!(out.status.success(), "{how}: {:?}", out);
        let mode = fs::metadata(fx.b(name)).unwrap().mode() & 0o7777;
        assert_eq!(mode, 0o777, "{how} left set-id bits: {mode:o}");
        // Root (CAP_FSETID) keeps them, as on ext4.
        fs::set_permissions(&p, fs::Permissions::from_mode(0o6777)).unwrap();
        OpenOptions::new()
            .append(true)
            .open(&p)
            .unwrap()
            .write_all(b"r")
            .unwrap();
        assert_eq!(fs::metadata(fx.b(name)).unwrap().mode() & 0o7777, 0o6777);
    }
}

#[test]
fn other_users_get_the_access_the_modes_give_them() {
    let fx = Fixture::with(MountOptions {
        allow_other: true,
        ..MountOptions::default()
    });
    fs::write(fx.m("private"), b"root only").unwrap();
    fs::set_permissions(fx.m("private"), fs::Permissions::from_mode(0o600)).unwrap();
    fs::write(fx.m("public"), b"everyone").unwrap();
    fs::set_permissions(fx.m("public"), fs::Permissions::from_mode(0o644)).unwrap();
    fs::create_dir(fx.m("shared")).unwrap();
    fs::set_permissions(fx.m("shared"), fs::Permissions::from_mode(0o1777)).unwrap();

    let m = |p: &str| fx.m(p).to_str().unwrap().to_string();
    assert!(as_nobody(&format!("cat {}", m("public"))).status.success());
    assert!(!as_nobody(&format!("cat {}", m("private"))).status.success());
    assert!(!as_nobody(&format!("echo x >> {}", m("public")))
        .status
        .success());
    assert!(!as_nobody(&format!("rm -f {}", m("public")))
        .status
        .success());
    let out = as_nobody(&format!("echo mine > {0}/f && mkdir {0}/d", m("shared")));
    assert!(out.status.success(), "{out:?}");
    // What another user creates is theirs, in the backing too.
    for p in ["shared/f", "shared/d"] {
        let b = fs::metadata(fx.b(p)).unwrap();
        assert_eq!((b.uid(), b.gid()), (65534, 65534), "{p}");
    }
    assert_eq!(fs::read(fx.b("public")).unwrap(), b"everyone");
    set_id_bits_are_cleared_by_a_write_from_another_user(&fx);
}

#[test]
fn set_id_bits_are_cleared_by_another_users_write_when_forwarded() {
    let fx = Fixture::with(MountOptions {
        allow_other: true,
        passthrough: false,
        ..MountOptions::default()
    });
    set_id_bits_are_cleared_by_a_write_from_another_user(&fx);
}

fn seek_fallocate_and_copy(fx: &Fixture) {
    use std::os::fd::AsRawFd;
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(fx.m("sparse"))
        .unwrap();
    let fd = f.as_raw_fd();
    // SAFETY: plain syscalls on an open descriptor; the buffer outlives the call.
    unsafe {
        assert_eq!(libc::pwrite(fd, b"data".as_ptr().cast(), 4, 1 << 20), 4);
        assert_eq!(libc::lseek(fd, 0, libc::SEEK_DATA), 1 << 20);
        assert_eq!(libc::lseek(fd, 0, libc::SEEK_HOLE), 0);
        assert_eq!(
            libc::lseek(fd, 1 << 20, libc::SEEK_HOLE),
            (1 << 20) + 4,
            "EOF is a hole"
        );
        assert_eq!(
            libc::fallocate(fd, 0, 0, 8192),
            0,
            "{}",
            std::io::Error::last_os_error()
        );
        // Preallocated (unwritten) blocks read as zeros: still a "hole" to SEEK_DATA on
        // ext4, but allocated.
        assert_eq!(libc::lseek(fd, 0, libc::SEEK_DATA), 1 << 20);
        assert_eq!(
            libc::fallocate(
                fd,
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                1 << 20,
                4096
            ),
            0
        );
    }
    assert_eq!(f.metadata().unwrap().len(), (1 << 20) + 4);
    assert_eq!(
        fs::metadata(fx.b("sparse")).unwrap().blocks(),
        8192 / 512,
        "punched"
    );
    fs::write(fx.m("src"), b"copy me exactly").unwrap();
    let src = File::open(fx.m("src")).unwrap();
    let dst = File::create(fx.m("dst")).unwrap();
    let (mut off_in, mut off_out) = (5i64, 0i64);
    // SAFETY: both descriptors are open; the offsets are valid pointers.
    let n = unsafe {
        libc::copy_file_range(
            src.as_raw_fd(),
            &mut off_in,
            dst.as_raw_fd(),
            &mut off_out,
            10,
            0,
        )
    };
    assert_eq!(n, 10, "{}", std::io::Error::last_os_error());
    drop(dst);
    assert_eq!(fs::read(fx.m("dst")).unwrap(), b"me exactly");
    assert_eq!(fs::read(fx.b("dst")).unwrap(), b"me exactly");
}

#[test]
fn seek_data_and_holes_fallocate_and_copy_file_range_work() {
    let fx = Fixture::new();
    seek_fallocate_and_copy(&fx);
}

#[test]
fn seek_data_and_holes_fallocate_and_copy_file_range_work_when_forwarded() {
    let fx = Fixture::with(forwarding());
    seek_fallocate_and_copy(&fx);
}

fn shared_mapping_round_trip(fx: &Fixture) {
    use std::os::fd::AsRawFd;
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(fx.m("mapped"))
        .unwrap();
    f.set_len(8192).unwrap();
    // SAFETY: maps 8 KiB of an open file of that size, writes inside the mapping, syncs
    // and unmaps it before the file is closed.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            8192,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        );
        assert_ne!(p, libc::MAP_FAILED, "{}", std::io::Error::last_os_error());
        std::ptr::copy_nonoverlapping(b"mapped!".as_ptr(), p.cast::<u8>().add(4096), 7);
        assert_eq!(libc::msync(p, 8192, libc::MS_SYNC), 0);
        assert_eq!(libc::munmap(p, 8192), 0);
    }
    drop(f);
    assert_eq!(&fs::read(fx.b("mapped")).unwrap()[4096..4103], b"mapped!");
    assert_eq!(&fs::read(fx.m("mapped")).unwrap()[4096..4103], b"mapped!");
}

#[test]
fn shared_writable_mappings_reach_the_backing_file() {
    let fx = Fixture::new();
    shared_mapping_round_trip(&fx);
}

#[test]
fn shared_writable_mappings_reach_the_backing_file_when_forwarded() {
    let fx = Fixture::with(forwarding());
    shared_mapping_round_trip(&fx);
}

#[test]
fn names_that_are_not_folder_paths_work_but_are_left_to_the_scanner() {
    use std::os::unix::ffi::OsStrExt;
    let fx = Fixture::new();
    let name = std::ffi::OsStr::from_bytes(b"latin1-\xe9t\xe9");
    fs::write(fx.mnt.join(name), b"bytes").unwrap();
    assert_eq!(fs::read(fx.back.join(name)).unwrap(), b"bytes");
    let listed: Vec<_> = fs::read_dir(&fx.mnt)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(listed.iter().any(|n| n == name));
    fs::write(fx.m("ok"), b"").unwrap();
    fx.expect_event("ok", ChangeKind::Created);
    assert!(
        fx.events().iter().all(|e| e.path.as_str() == "ok"),
        "{:#?}",
        fx.events()
    );
}

#[test]
fn the_mount_and_its_handle_can_be_shared_across_threads() {
    fn shareable<T: Send + Sync>() {}
    shareable::<Mount>();
    shareable::<meshfs_fuse::MountHandle>();
    shareable::<MountError>();
    fn as_engine_traits(h: Arc<meshfs_fuse::MountHandle>) -> [Arc<dyn Send + Sync>; 2] {
        let invalidator: Arc<dyn Invalidator> = h.clone();
        let writers: Arc<dyn WriterRegistry> = h.clone();
        [Arc::new(invalidator), Arc::new(writers)]
    }
    let _ = as_engine_traits;
}

#[test]
fn a_running_executable_cannot_be_truncated_through_the_mount() {
    let fx = Fixture::new();
    let sleep = ["/usr/bin/sleep", "/bin/sleep"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect("a sleep binary");
    let size = fs::metadata(sleep).unwrap().len();
    // The kernel must refuse before the backing truncates (it once did not: the open
    // carried O_TRUNC to the backing first). The window was narrow: try a few times.
    for i in 0..20 {
        let exe = fx.m(&format!("sleep{i}"));
        fs::copy(sleep, &exe).unwrap();
        fs::set_permissions(&exe, fs::Permissions::from_mode(0o755)).unwrap();
        let mut child = Command::new(&exe).arg("10").spawn().unwrap();
        for flags in [libc::O_WRONLY, libc::O_RDWR, libc::O_RDONLY | libc::O_TRUNC] {
            let p = c(&exe);
            // SAFETY: the path is NUL-terminated; a returned descriptor is closed below.
            let fd = unsafe { libc::open(p.as_ptr(), flags) };
            let e = std::io::Error::last_os_error();
            if fd >= 0 {
                // SAFETY: `fd` was just opened and is not used again.
                unsafe { libc::close(fd) };
            }
            assert_eq!(fd, -1, "open({flags:#x}) of a running executable succeeded");
            assert_eq!(e.raw_os_error(), Some(libc::ETXTBSY), "{e}");
        }
        assert_eq!(
            fs::metadata(fx.b(&format!("sleep{i}"))).unwrap().len(),
            size
        );
        assert!(child.try_wait().unwrap().is_none(), "it is still running");
        child.kill().unwrap();
        child.wait().unwrap();
    }
}

#[test]
fn a_file_in_the_mount_is_not_a_terminal_as_on_ext4() {
    use std::os::fd::AsRawFd;
    let fx = Fixture::new();
    std::fs::write(fx.mnt.join("f"), b"x").unwrap();
    let f = std::fs::File::open(fx.mnt.join("f")).unwrap();
    // SAFETY: a valid open descriptor.
    let tty = unsafe { libc::isatty(f.as_raw_fd()) };
    let errno = std::io::Error::last_os_error().raw_os_error();
    assert_eq!((tty, errno), (0, Some(libc::ENOTTY)));
}

/// The watcher's reports (`invalidate_foreign`): of a path the mount itself just changed, an
/// echo the kernel already knows (nothing is invalidated, so its long-TTL caches stay: here
/// the attributes of a file it created); of any other path, a change made behind the mount,
/// invalidated at once.
#[test]
fn a_watcher_report_of_the_mounts_own_change_is_an_echo_and_of_another_an_invalidation() {
    let fx = Fixture::new();
    fs::write(fx.m("mine"), b"short").unwrap();
    fs::write(fx.b("theirs"), b"short").unwrap();
    assert_eq!(fs::metadata(fx.m("mine")).unwrap().len(), 5);
    assert_eq!(fs::metadata(fx.m("theirs")).unwrap().len(), 5);

    // Both rewritten behind the mount; the watcher would report both.
    fs::write(fx.b("mine"), b"a longer content now").unwrap();
    fs::write(fx.b("theirs"), b"a longer content now").unwrap();
    let handle = fx.mount().handle();
    assert!(
        !handle.invalidate_foreign(&rel("mine")),
        "the mount's own change is not foreign"
    );
    assert_eq!(
        fx.mount().info().invalidations_pending,
        0,
        "an echo is dropped before it is queued"
    );
    assert!(handle.invalidate_foreign(&rel("theirs")));
    let deadline = Instant::now() + Duration::from_secs(5);
    while fs::metadata(fx.m("theirs")).unwrap().len() != 20 {
        assert!(
            Instant::now() < deadline,
            "the change behind the mount is not seen"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    while fx.mount().info().invalidations_pending != 0 {
        assert!(Instant::now() < deadline, "invalidations still queued");
        std::thread::sleep(Duration::from_millis(2));
    }
    // The echo left the kernel's attributes of `mine` as they were (the TTL is a minute).
    assert_eq!(fs::metadata(fx.m("mine")).unwrap().len(), 5);
}
