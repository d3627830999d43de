//! A FUSE server that does no work: the floor under any FUSE filesystem's create path on this
//! machine, measured with the same transport the mount uses (fuser 0.18 as vendored, io_uring
//! where the kernel offers it, kernel passthrough for the data where the process may register
//! backing files; otherwise, as for an ordinary user, data forwarded and answered at once).
//!
//! ```text
//! null_mount [--no-io-uring] <scratch-dir> <mountpoint>
//! ```
//!
//! It keeps no tree but the directories made through it (so that they resolve after a
//! `drop_caches`). Every other LOOKUP is a negative entry; CREATE, MKDIR, SYMLINK, MKNOD and LINK
//! hand out a node id with made-up attributes (GETATTR and SETATTR too; the id carries the kind),
//! UNLINK, RMDIR and RENAME succeed, OPEN passes through to the scratch file below,
//! GETXATTR answers "no such attribute", RELEASE and FORGET do nothing. Run by an ordinary user
//! (no `CAP_SYS_ADMIN`, so no passthrough, as meshfs's own mount then), WRITE is acknowledged
//! whole at once and READ returns nothing.
//! File data goes by kernel passthrough to one scratch file, `<scratch-dir>/null-backing`, that
//! every created file shares (its content is meaningless; it stays in the page cache). So a
//! create (`open(O_CREAT)`, `write`, `close`) costs exactly the requests the kernel itself sends
//! for it — LOOKUP, CREATE, GETXATTR `security.capability`, RELEASE — each answered at once; a
//! `tar -x` costs what the kernel sends for its creates, links, `fchown`s and `utimensat`s.
//! `bench/mount/run --ops create,tar --null` times both beside the
//! mount and the backing directory. It serves nothing else: a stat of a created name gives
//! made-up attributes, a listing fails. Same start and stop protocol as `passthrough_mount`:
//! one `mounted ...` line on stdout, SIGINT or SIGTERM unmounts.

#[path = "common/mod.rs"]
mod common;

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags,
    KernelConfig, OpenFlags, ReplyAttr, ReplyCreate, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyXattr,
    Request,
};
use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

const TTL: Duration = Duration::from_secs(3600);
const ROOT: u64 = 1;

/// A node id carries its node's kind in its low two bits (no table to look it up in).
fn kind_of(ino: u64) -> FileType {
    match ino & 3 {
        _ if ino == ROOT => FileType::Directory,
        1 => FileType::Directory,
        2 => FileType::Symlink,
        3 => FileType::NamedPipe,
        _ => FileType::RegularFile,
    }
}

struct Null {
    /// The one file every created file's data goes to, registered once as a backing file.
    scratch: File,
    backing: Mutex<Option<Arc<fuser::BackingId>>>,
    /// The directories made through it, by (parent, name): the one thing it remembers, so that a
    /// directory still resolves after the kernel dropped its cached entries (`drop_caches`).
    dirs: Mutex<HashMap<(u64, OsString), u64>>,
    next_ino: AtomicU64,
    want_io_uring: bool,
    passthrough: Arc<AtomicBool>,
}

/// Whether this process may register backing files (`CAP_SYS_ADMIN` in the initial user
/// namespace, which fuse_backing_open asks for): otherwise data is forwarded.
fn capable_sys_admin() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .unwrap_or(0);
    let map = std::fs::read_to_string("/proc/self/uid_map").unwrap_or_default();
    eff & (1 << 21) != 0 && map.split_whitespace().collect::<Vec<_>>() == ["0", "0", "4294967295"]
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn attr(ino: u64) -> FileAttr {
    let now = SystemTime::now();
    let kind = kind_of(ino);
    // SAFETY: getuid and getgid cannot fail and touch no memory of ours.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    FileAttr {
        ino: INodeNo(ino),
        size: 0,
        blocks: 0,
        atime: now,
        mtime: now,
        ctime: now,
        crtime: now,
        kind,
        perm: if kind == FileType::RegularFile {
            0o644
        } else {
            0o755
        },
        nlink: if kind == FileType::Directory { 2 } else { 1 },
        uid,
        gid,
        rdev: 0,
        blksize: 4096,
        flags: 0,
    }
}

impl Null {
    /// A fresh node id of kind `kind` (see [`kind_of`]).
    fn new_ino(&self, kind: u64) -> u64 {
        self.next_ino.fetch_add(1, Ordering::Relaxed) * 4 + kind
    }

    /// The scratch file's backing id, registered on first use through `open_backing`.
    fn backing_id(
        &self,
        open_backing: impl FnOnce(&File) -> std::io::Result<fuser::BackingId>,
    ) -> Option<Arc<fuser::BackingId>> {
        let mut b = lock(&self.backing);
        if let Some(id) = &*b {
            return Some(id.clone());
        }
        match open_backing(&self.scratch) {
            Ok(id) => Some(b.insert(Arc::new(id)).clone()),
            Err(e) => {
                eprintln!("error: registering the scratch file as a backing file: {e}");
                None
            }
        }
    }
}

impl Filesystem for Null {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // The same capabilities as the mount's (fuse/src/fs.rs) where they bear on a create.
        let caps = config.capabilities();
        let _ = config.add_capabilities(
            (InitFlags::FUSE_PARALLEL_DIROPS | InitFlags::FUSE_HANDLE_KILLPRIV_V2) & caps,
        );
        if self.want_io_uring {
            let _ = config.add_capabilities(InitFlags::FUSE_OVER_IO_URING & caps);
        }
        let _ = config.set_max_write(1 << 20);
        if caps.contains(InitFlags::FUSE_PASSTHROUGH)
            && capable_sys_admin()
            && config.add_capabilities(InitFlags::FUSE_PASSTHROUGH).is_ok()
            && config.set_max_stack_depth(1).is_ok()
        {
            self.passthrough.store(true, Ordering::Relaxed);
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let dir = lock(&self.dirs).get(&(parent.0, name.to_owned())).copied();
        // Otherwise node id 0 with a TTL: a negative entry the kernel caches, as the mount
        // answers a miss.
        reply.entry(&TTL, &attr(dir.unwrap_or(0)), Generation(0));
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        reply.attr(&TTL, &attr(ino.0));
    }

    #[allow(clippy::too_many_arguments)]
    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        _size: Option<u64>,
        _atime: Option<fuser::TimeOrNow>,
        _mtime: Option<fuser::TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        self.getattr(_req, ino, None, reply);
    }

    fn mkdir(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        _mode: u32,
        _umask: u32,
        reply: ReplyEntry,
    ) {
        let ino = self.new_ino(1);
        lock(&self.dirs).insert((parent.0, name.to_owned()), ino);
        reply.entry(&TTL, &attr(ino), Generation(0));
    }

    fn symlink(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _target: &Path,
        reply: ReplyEntry,
    ) {
        reply.entry(&TTL, &attr(self.new_ino(2)), Generation(0));
    }

    fn mknod(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        reply.entry(&TTL, &attr(self.new_ino(3)), Generation(0));
    }

    fn unlink(&self, _req: &Request, _parent: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        reply.ok();
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        lock(&self.dirs).remove(&(parent.0, name.to_owned()));
        reply.ok();
    }

    fn rename(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _newparent: INodeNo,
        _newname: &OsStr,
        _flags: fuser::RenameFlags,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        _newparent: INodeNo,
        _newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let mut a = attr(ino.0);
        a.nlink = 2;
        reply.entry(&TTL, &a, Generation(0));
    }

    fn create(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        let a = attr(self.new_ino(0));
        if !self.passthrough.load(Ordering::Relaxed) {
            return reply.created(&TTL, &a, Generation(0), FileHandle(0), FopenFlags::empty());
        }
        match self.backing_id(|f| reply.open_backing(f)) {
            Some(id) => reply.created_passthrough(
                &TTL,
                &a,
                Generation(0),
                FileHandle(0),
                FopenFlags::empty(),
                &id,
            ),
            None => reply.error(Errno::EIO),
        }
    }

    fn open(&self, _req: &Request, _ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        if !self.passthrough.load(Ordering::Relaxed) {
            return reply.opened(FileHandle(0), FopenFlags::empty());
        }
        match self.backing_id(|f| reply.open_backing(f)) {
            Some(id) => reply.opened_passthrough(FileHandle(0), FopenFlags::empty(), &id),
            None => reply.error(Errno::EIO),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _offset: u64,
        data: &[u8],
        _write_flags: fuser::WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<fuser::LockOwner>,
        reply: fuser::ReplyWrite,
    ) {
        reply.written(data.len() as u32);
    }

    #[allow(clippy::too_many_arguments)]
    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _offset: u64,
        _size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<fuser::LockOwner>,
        reply: fuser::ReplyData,
    ) {
        reply.data(&[]);
    }

    fn getxattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _name: &OsStr,
        _size: u32,
        reply: ReplyXattr,
    ) {
        reply.error(Errno::ENODATA);
    }
}

fn main() {
    // `RUST_LOG=fuser=debug` lists every request the kernel sends.
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let mut want_io_uring = true;
    let mut paths = Vec::new();
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "--no-io-uring" => want_io_uring = false,
            _ => paths.push(PathBuf::from(arg)),
        }
    }
    let [scratch_dir, mountpoint] = paths.as_slice() else {
        eprintln!("usage: null_mount [--no-io-uring] <scratch-dir> <mountpoint>");
        std::process::exit(2);
    };
    let scratch = match OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(scratch_dir.join("null-backing"))
    {
        Ok(f) => f,
        Err(e) => {
            eprintln!("error: {}: {e}", scratch_dir.join("null-backing").display());
            std::process::exit(1);
        }
    };

    let stop = common::StopSignals::block();

    let passthrough = Arc::new(AtomicBool::new(false));
    let fs = Null {
        scratch,
        backing: Mutex::new(None),
        dirs: Mutex::new(HashMap::new()),
        next_ino: AtomicU64::new(ROOT + 1),
        want_io_uring,
        passthrough: passthrough.clone(),
    };
    let mut config = fuser::Config::default();
    config.mount_options = vec![
        fuser::MountOption::FSName("meshfs-null".into()),
        fuser::MountOption::NoSuid,
        fuser::MountOption::NoDev,
    ];
    config.n_threads = Some(2);
    config.clone_fd = true;
    let mut session = match fuser::Session::new(fs, mountpoint, &config) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: mounting at {}: {e}", mountpoint.display());
            std::process::exit(1);
        }
    };
    let io_uring = session.io_uring_queues();
    let mut unmounter = session.unmount_callable();
    let thread = std::thread::spawn(move || session.run());
    // The handshake is done once a request passes: stat the mount point.
    let _ = std::fs::metadata(mountpoint);
    if io_uring.negotiated() {
        io_uring.wait_serving(Duration::from_secs(5));
    }
    println!(
        "mounted null server at {} (passthrough: {}, io_uring: {})",
        mountpoint.display(),
        passthrough.load(Ordering::Relaxed),
        io_uring.serving()
    );

    stop.wait();
    if let Err(e) = unmounter.unmount() {
        eprintln!("error: unmounting: {e}");
    }
    let _ = thread.join();
    println!("unmounted");
}
