//! The passthrough filesystem: every FUSE request, answered from the backing directory.
//!
//! Owns the meaning of each operation: resolve the node(s) through the inode table, do the
//! one syscall on the backing directory, keep the table in step, report the change to the
//! engine's sink. It never hashes, never reads a whole file, never blocks on the engine:
//! a request costs its syscalls and a few map updates — but for the open (or truncate) of a
//! placeholder, which waits for the engine to make its content local (D92) or, for reading,
//! for its first chunk, and a read of it, which waits for the bytes it asks (D95).
//!
//! How a node is reached is [`crate::backing`]'s business.
//!
//! **Invariants:**
//! - meshfs's own names (any component starting with `.meshfs`) do not exist through the
//!   mount: lookups miss, listings skip them, creating or renaming onto them is `EPERM`;
//! - every failure returns the errno the backing returned;
//! - a change is reported only after it succeeded on the backing directory;
//! - no lock is held across a syscall, except the per-mount lock that makes the first
//!   passthrough open of an inode register exactly one backing file.
//!
//! POSIX and BSD locks are left to the kernel's local locking (no `FUSE_POSIX_LOCKS` /
//! `FUSE_FLOCK_LOCKS`): they work between processes of this machine, which is all a
//! replica directory can offer anyway.

use crate::backing::{
    file_type, generation, is_internal, kill_suidgid, rel_path, zero_stat, zero_umask, Shared,
    Target,
};
use crate::handles::MakeBacking;
use crate::inodes::ROOT;
use crate::kept::ContentSig;
use crate::passthrough::{capable_sys_admin, PassthroughOff};
use crate::placeholder;
use crate::prefetch::{Job, Prefetcher};
use crate::sys::{self, SetTime, Stat, SysResult};
use crate::{lock, ChangeEvent, ChangeKind};
use fuser::{
    AccessFlags, BsdFileFlags, CopyFileRangeFlags, Errno, FileHandle, FileType, Filesystem,
    FopenFlags, Generation, INodeNo, InitFlags, IoctlFlags, KernelConfig, LockOwner, OpenFlags,
    RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty,
    ReplyEntry, ReplyIoctl, ReplyLseek, ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr, Request,
    TimeOrNow, WriteFlags,
};
use std::ffi::{CString, OsStr};
use std::os::fd::{AsFd, BorrowedFd};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

thread_local! {
    /// Each request thread's buffer for READ replies, reused (a fresh zeroed vector per
    /// request was a memset of up to 1 MiB each time).
    static READ_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The largest READ buffer a request thread keeps between requests.
const KEPT_READ_BUF: usize = 256 * 1024;

/// Bytes asked of `getdents64` per call.
const DIRENT_BUF: usize = 32 * 1024;

fn err(e: sys::Errno) -> Errno {
    Errno::from_i32(e)
}

fn dtype_kind(dtype: u8) -> Option<FileType> {
    Some(match dtype {
        libc::DT_DIR => FileType::Directory,
        libc::DT_REG => FileType::RegularFile,
        libc::DT_LNK => FileType::Symlink,
        libc::DT_FIFO => FileType::NamedPipe,
        libc::DT_SOCK => FileType::Socket,
        libc::DT_CHR => FileType::CharDevice,
        libc::DT_BLK => FileType::BlockDevice,
        _ => return None,
    })
}

fn set_time(t: Option<TimeOrNow>) -> SetTime {
    match t {
        None => SetTime::Omit,
        Some(TimeOrNow::Now) => SetTime::Now,
        Some(TimeOrNow::SpecificTime(t)) => SetTime::At(t),
    }
}

/// The FUSE filesystem handed to fuser.
pub(crate) struct Passthrough {
    sh: Arc<Shared>,
}

impl Passthrough {
    /// Serves `sh`.
    pub fn new(sh: Arc<Shared>) -> Passthrough {
        Passthrough { sh }
    }

    /// Runs `f` on where the xattrs of `ino` are reached.
    fn with_xattr<T>(
        &self,
        ino: u64,
        f: impl FnOnce(&sys::XattrAt<'_>) -> SysResult<T>,
    ) -> Result<T, Errno> {
        if ino != ROOT && self.sh.kind_of(ino) == Some(libc::S_IFLNK) {
            // A symlink's own xattrs: its parent's /proc link plus its name, not followed.
            let (dir, name) = self.sh.locate(ino).map_err(err)?;
            let mut path = sys::proc_path(dir.as_fd()).into_bytes();
            path.push(b'/');
            path.extend_from_slice(name.as_bytes());
            let at = sys::XattrAt::Path {
                path: CString::new(path).map_err(|_| Errno::EINVAL)?,
                follow: false,
            };
            return f(&at).map_err(err);
        }
        let target = self.sh.target_open_first(ino).map_err(err)?;
        let at = match &target {
            Target::Open(h) => sys::XattrAt::Fd(h.fd()),
            _ => sys::XattrAt::Path {
                path: sys::proc_path(target.fd()),
                follow: true,
            },
        };
        f(&at).map_err(err)
    }

    /// The value of `user.meshfs.state` for node `ino`: asked of the engine for a regular file
    /// of a mount with a content source; `ENODATA` (no such attribute) otherwise. A node whose
    /// name now holds another file answers `ESTALE`, as for any attribute (the kernel looks the
    /// name up again).
    fn state_xattr(&self, ino: u64) -> Result<Vec<u8>, Errno> {
        let Some(source) = self.sh.content.as_ref() else {
            return Err(Errno::ENODATA);
        };
        if self.sh.kind_of(ino) != Some(libc::S_IFREG) {
            return Err(Errno::ENODATA);
        }
        let path = self
            .sh
            .path_of(ino)
            .and_then(|p| rel_path(&p))
            .ok_or(Errno::ENODATA)?;
        let local = !self.with_xattr(ino, |at| Ok(placeholder::is_placeholder(at)))?;
        Ok(source.state(&path, local).as_bytes().to_vec())
    }

    fn do_create_node(
        &self,
        req: &Request,
        parent: u64,
        name: &OsStr,
        mode: Option<u32>,
        make: impl FnOnce(BorrowedFd<'_>, &CString) -> SysResult<()>,
    ) -> Result<Stat, Errno> {
        self.sh.check_writable()?;
        if is_internal(name) {
            return Err(Errno::EPERM);
        }
        let dir = self.sh.dir(parent).map_err(err)?;
        let cname = sys::cstr(name).map_err(err)?;
        zero_umask();
        make(dir.as_fd(), &cname).map_err(err)?;
        let st = self
            .sh
            .finish_new(req, dir.as_fd(), &cname, mode)
            .map_err(err)?;
        Ok(st)
    }

    /// The open flags of a forwarded open of `ino` (now `st`) with open(2) `flags`. A
    /// write-only open writes past the kernel's pages (`FOPEN_DIRECT_IO`): each write goes
    /// straight from the caller's buffer to the mount, one copy and one page cache fewer (a
    /// program that only writes a file does not read it back through that descriptor). Any
    /// other open keeps the kernel's cached pages where they are still the file's content
    /// (`kept`).
    fn open_flags(&self, ino: u64, st: &Stat, flags: i32) -> FopenFlags {
        if st.kind() != libc::S_IFREG {
            return FopenFlags::empty();
        }
        let keep = self.sh.kept.open(ino, ContentSig::of(st));
        if self.sh.write_direct.load(Ordering::Relaxed) && flags & libc::O_ACCMODE == libc::O_WRONLY
        {
            FopenFlags::FOPEN_DIRECT_IO
        } else if self.sh.keep_cache && keep {
            FopenFlags::FOPEN_KEEP_CACHE
        } else {
            FopenFlags::empty()
        }
    }

    fn created(&self, parent: u64, name: &OsStr, st: &Stat, reply: ReplyEntry) {
        self.sh.entry(parent, name, st, reply);
        self.sh
            .emit(self.sh.child_path(parent, name), ChangeKind::Created);
    }

    /// Reads directory `ino` from `offset` (0, or a cookie an earlier reply gave the kernel),
    /// handing `emit` each entry until it reports the reply full. The directory is opened for
    /// this request alone (the mount holds no directory handles: OPENDIR is answered
    /// `ENOSYS`); the cookies are the backing's own, so each request resumes where the last
    /// one stopped.
    fn fill_dir(
        &self,
        ino: u64,
        offset: u64,
        mut emit: impl FnMut(BorrowedFd<'_>, &sys::DirEntry) -> Fill,
    ) -> Result<(), Errno> {
        let fd = match self.open_dir(ino) {
            Ok(fd) => fd,
            // Removed while a process had it open: an empty directory, as on ext4.
            Err(libc::ENOENT) => return Ok(()),
            Err(e) => return Err(err(e)),
        };
        let fd = fd.as_fd();
        if offset != 0 {
            sys::lseek(fd, offset as i64, libc::SEEK_SET).map_err(err)?;
        }
        let mut buf = vec![0u8; DIRENT_BUF];
        let mut entries = Vec::new();
        loop {
            entries.clear();
            if sys::getdents(fd, &mut buf, &mut entries).map_err(err)? == 0 {
                return Ok(());
            }
            for entry in &entries {
                if is_internal(&entry.name) {
                    continue;
                }
                if let Fill::Full = emit(fd, entry) {
                    return Ok(());
                }
            }
        }
    }

    /// The open of node `ino` as `fd` (`st`), with its content local or streamed: a regular
    /// file that is a placeholder is, for a read-only open, streamed by the engine (the open
    /// waits for its first chunk, D95: reads then read the file being assembled, each waiting
    /// for its range); for any other open, fetched whole (the request waits, D92), and the file
    /// now at the node's name is opened with `oflags` instead. Each regular file opened is
    /// reported as used (eviction takes the least recently used first).
    #[allow(clippy::type_complexity)]
    fn local_content(
        &self,
        req: &Request,
        ino: u64,
        fd: std::os::fd::OwnedFd,
        st: Stat,
        oflags: i32,
    ) -> SysResult<(
        std::os::fd::OwnedFd,
        Stat,
        Option<Box<dyn crate::ContentStream>>,
    )> {
        let Some(source) = self.sh.content.as_ref() else {
            return Ok((fd, st, None));
        };
        if st.kind() != libc::S_IFREG {
            return Ok((fd, st, None));
        }
        let path = self.sh.path_of(ino).and_then(|p| rel_path(&p));
        if !placeholder::is_placeholder(&sys::XattrAt::Fd(fd.as_fd())) {
            if let Some(p) = &path {
                source.used(p);
            }
            return Ok((fd, st, None));
        }
        // Not a folder path (not UTF-8, not NFC): the engine journals no such file, so there
        // is nothing to fetch it from.
        let path = path.ok_or(libc::EIO)?;
        drop(fd);
        let reading = oflags & libc::O_ACCMODE == libc::O_RDONLY && oflags & libc::O_TRUNC == 0;
        if reading {
            if let crate::Opened::Stream(stream) = source.open(&path, req.pid())? {
                let fd = sys::reopen(stream.file(), libc::O_RDONLY)?;
                let st = sys::fstat(fd.as_fd())?;
                source.used(&path);
                return Ok((fd, st, Some(stream)));
            }
        } else {
            source.fetch(&path, req.pid())?;
        }
        // The fetched file replaced the placeholder under the same name: a new inode, handed
        // to the kernel under the node it opened (later lookups find the new one).
        let (dir, name) = self.sh.locate(ino)?;
        let fd = sys::openat(dir.as_fd(), &name, oflags | libc::O_NOFOLLOW, 0)?;
        let st = sys::fstat(fd.as_fd())?;
        if st.kind() != libc::S_IFREG || placeholder::is_placeholder(&sys::XattrAt::Fd(fd.as_fd()))
        {
            // Replaced again meanwhile (a peer's newer version, an eviction): not this open's.
            return Err(libc::ESTALE);
        }
        source.used(&path);
        Ok((fd, st, None))
    }

    /// Before a CREATE opens `name` in `dir` (the kernel sends one for a name it holds as
    /// absent; the engine may have installed a placeholder there since): a placeholder there is
    /// made local first, as an open of it is (D92), so the create's open (`O_TRUNC` included)
    /// acts on the content. Only while the folder is on demand: an `openat` more per create.
    fn local_before_create(
        &self,
        req: &Request,
        parent: u64,
        dir: BorrowedFd<'_>,
        cname: &CString,
        name: &OsStr,
    ) -> SysResult<()> {
        let Some(source) = self.sh.content.as_ref().filter(|s| s.active()) else {
            return Ok(());
        };
        let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK;
        let Ok(fd) = sys::openat(dir, cname, flags, 0) else {
            return Ok(());
        };
        let st = sys::fstat(fd.as_fd())?;
        if st.kind() != libc::S_IFREG || !placeholder::is_placeholder(&sys::XattrAt::Fd(fd.as_fd()))
        {
            return Ok(());
        }
        drop(fd);
        let path = self
            .sh
            .child_path(parent, name)
            .and_then(|p| rel_path(&p))
            .ok_or(libc::EIO)?;
        source.fetch(&path, req.pid())
    }

    /// A truncate of a placeholder that is not open (opens make it whole): to 0, its content
    /// is known (none) and the mark goes after the truncate; to another size, the engine makes
    /// it local first, and the node then names the old inode (`ESTALE`: the kernel looks the
    /// name up again and retries, as `truncate(2)` does). `Ok(true)`: unmark after truncating.
    fn truncating_placeholder(
        &self,
        req: &Request,
        ino: u64,
        target: &Target,
        size: u64,
    ) -> SysResult<bool> {
        let Some(source) = self.sh.content.as_ref() else {
            return Ok(false);
        };
        if matches!(target, Target::Open(_) | Target::Root(_))
            || self.sh.kind_of(ino) != Some(libc::S_IFREG)
        {
            return Ok(false);
        }
        let at = sys::XattrAt::Path {
            path: sys::proc_path(target.fd()),
            follow: true,
        };
        if !placeholder::is_placeholder(&at) {
            return Ok(false);
        }
        if size == 0 {
            return Ok(true);
        }
        let path = self
            .sh
            .path_of(ino)
            .and_then(|p| rel_path(&p))
            .ok_or(libc::EIO)?;
        source.fetch(&path, req.pid())?;
        Err(libc::ESTALE)
    }

    /// Directory node `ino`, open for reading, through its (verified) cached descriptor.
    fn open_dir(&self, ino: u64) -> SysResult<std::os::fd::OwnedFd> {
        let dir = self.sh.dir(ino)?;
        sys::openat(
            dir.as_fd(),
            c".",
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
            0,
        )
    }
}

/// What a directory reply did with an entry.
enum Fill {
    Added,
    Skipped,
    Full,
}

fn is_dot(name: &OsStr) -> bool {
    name == "." || name == ".."
}

impl Filesystem for Passthrough {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let caps = config.capabilities();
        let wanted = InitFlags::FUSE_DO_READDIRPLUS
            | InitFlags::FUSE_READDIRPLUS_AUTO
            | InitFlags::FUSE_PARALLEL_DIROPS
            // Not FUSE_ATOMIC_O_TRUNC: with it the kernel sends O_TRUNC in OPEN before it
            // checks ETXTBSY, and the backing truncated a running executable (pjdfstest
            // open::etxtbsy caught it). Without it the kernel checks, then sends a SETATTR.
            | InitFlags::FUSE_CACHE_SYMLINKS
            | InitFlags::FUSE_AUTO_INVAL_DATA
            // Lets the kernel mark inodes "no security xattr" (SB_NOSEC): otherwise every
            // write(2), passthrough ones included, first asks GETXATTR security.capability.
            // In exchange the mount clears set-id bits itself (see `kill_suidgid`).
            | InitFlags::FUSE_HANDLE_KILLPRIV_V2
            // A write-only forwarded open bypasses the kernel's pages (`open_flags`); with this
            // the kernel writes back and drops the pages of the range such a write covers, so
            // other opens (mmap included) never read around it.
            | InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP;
        let _ = config.add_capabilities(wanted & caps);
        self.sh.write_direct.store(
            self.sh.want_write_direct && caps.contains(InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP),
            Ordering::Relaxed,
        );
        // The kernel offers io_uring only where it is enabled (see `MountOptions::io_uring`).
        if self.sh.want_io_uring {
            let _ = config.add_capabilities(InitFlags::FUSE_OVER_IO_URING & caps);
        }
        // Writes never exceed the kernel's 256 pages (`max_pages_limit`) whatever this says;
        // it also sizes each io_uring entry's payload buffer.
        let _ = config.set_max_write(1 << 20);
        let _ = config.set_max_background(64);
        let off = if !self.sh.want_passthrough {
            Some(PassthroughOff::NotAsked)
        } else if !caps.contains(InitFlags::FUSE_PASSTHROUGH) {
            Some(PassthroughOff::NotOffered)
        } else if !capable_sys_admin() {
            // Not asked for at all: the kernel would refuse every backing file.
            Some(PassthroughOff::NeedsCapSysAdmin)
        } else if config
            .add_capabilities(InitFlags::FUSE_PASSTHROUGH)
            .is_err()
            || config.set_max_stack_depth(1).is_err()
        {
            // Depth 1 (above): the backing is a plain filesystem, and the mount itself may
            // still be stacked under overlayfs.
            Some(PassthroughOff::NotOffered)
        } else {
            None
        };
        self.sh.passthrough.store(off.is_none(), Ordering::Relaxed);
        *lock(&self.sh.passthrough_off) = off;
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let negative = |reply: ReplyEntry| {
            let mut attr = self.sh.attr(&zero_stat());
            attr.ino = INodeNo(0);
            reply.entry(&self.sh.ttl, &attr, Generation(0));
        };
        if is_internal(name) {
            return negative(reply);
        }
        let res = (|| {
            let dir = self.sh.dir(parent.0)?;
            let cname = sys::cstr(name)?;
            sys::statx(dir.as_fd(), &cname)
        })();
        match res {
            // Another filesystem (or a bind mount) inside the folder: not served.
            Ok(st) if st.dev != self.sh.root_dev || st.mount_root => reply.error(Errno::EXDEV),
            Ok(st) => self.sh.entry(parent.0, name, &st, reply),
            Err(libc::ENOENT) => negative(reply),
            Err(e) => reply.error(err(e)),
        }
    }

    // batch_forget: fuser's default calls this once per node (its `ForgetOne` type is not
    // public in 0.18.0, so it cannot be overridden).
    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        if lock(&self.sh.table).forget(ino.0, nlookup) {
            self.sh.dirs.remove(ino.0);
            self.sh.kept.forget(ino.0);
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, fh: Option<FileHandle>, reply: ReplyAttr) {
        let ino = ino.0;
        let res = (|| {
            // Not a stream's file being assembled: its size is not yet the file's (D95).
            let open = fh.and_then(|fh| self.sh.handles.get(fh.0));
            if let Some(h) = open.filter(|h| h.stream.is_none()) {
                return sys::fstat(h.fd());
            }
            if ino == ROOT {
                return sys::fstat(self.sh.root.as_fd());
            }
            let first = match self.sh.locate(ino) {
                Ok((dir, name)) => match sys::statx(dir.as_fd(), &name) {
                    Ok(st) if self.sh.nodeid(st.ino) == ino => return Ok(st),
                    Ok(_) => libc::ESTALE,
                    Err(e) => e,
                },
                Err(e) => e,
            };
            match self.sh.handles.any_file_of(ino) {
                Some(h) => sys::fstat(h.fd()),
                None => Err(first),
            }
        })();
        match res {
            Ok(st) => reply.attr(&self.sh.ttl, &self.sh.attr(&st)),
            Err(e) => reply.error(err(e)),
        }
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        if let Err(e) = self.sh.check_writable() {
            return reply.error(e);
        }
        let ino = ino.0;
        let open = fh
            .and_then(|fh| self.sh.handles.get(fh.0))
            .filter(|h| h.stream.is_none())
            .map(Target::Open);
        let target = match open.map_or_else(|| self.sh.target_open_first(ino), Ok) {
            Ok(t) => t,
            Err(e) => return reply.error(err(e)),
        };
        let fd = target.fd();
        let res = (|| {
            if let Some(mode) = mode {
                if self.sh.kind_of(ino) == Some(libc::S_IFLNK) {
                    return Err(libc::EOPNOTSUPP);
                }
                sys::chmod_fd(fd, mode & 0o7777)?;
            }
            if uid.is_some() || gid.is_some() {
                sys::chown_fd(fd, uid, gid)?;
            }
            if let Some(size) = size {
                let unmark = self.truncating_placeholder(req, ino, &target, size)?;
                match &target {
                    Target::Open(h) if h.writable => sys::ftruncate(fd, size)?,
                    _ => sys::truncate_fd(fd, size)?,
                }
                if unmark {
                    placeholder::unmark(&sys::XattrAt::Path {
                        path: sys::proc_path(fd),
                        follow: true,
                    })?;
                }
                if req.uid() != 0 {
                    kill_suidgid(fd, None)?;
                }
            }
            if atime.is_some() || mtime.is_some() {
                sys::utimens_fd(fd, set_time(atime), set_time(mtime))?;
            }
            sys::fstat(fd)
        })();
        match res {
            Ok(st) => {
                // The path as it is now: once the kernel has its answer, a link or rename
                // may give the inode another name before the event is sent.
                let path = self.sh.path_of(ino);
                reply.attr(&self.sh.ttl, &self.sh.attr(&st));
                self.sh.emit(path, ChangeKind::Metadata);
            }
            Err(e) => reply.error(err(e)),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let res = self
            .sh
            .locate(ino.0)
            .and_then(|(dir, name)| sys::readlinkat(dir.as_fd(), &name));
        match res {
            Ok(target) => reply.data(&target),
            Err(e) => reply.error(err(e)),
        }
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        let rdev = u64::from(rdev);
        // rdev comes in the kernel's new_encode_dev form; makedev wants major/minor.
        let dev = libc::makedev(
            ((rdev >> 8) & 0xfff) as u32,
            ((rdev & 0xff) | ((rdev >> 12) & 0xfff00)) as u32,
        );
        let res = self.do_create_node(req, parent.0, name, Some(mode), |dir, n| {
            sys::mknodat(dir, n, mode, dev)
        });
        match res {
            Ok(st) => self.created(parent.0, name, &st, reply),
            Err(e) => reply.error(e),
        }
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        reply: ReplyEntry,
    ) {
        let res = self.do_create_node(req, parent.0, name, Some(mode), |dir, n| {
            sys::mkdirat(dir, n, mode & 0o7777)
        });
        match res {
            Ok(st) => self.created(parent.0, name, &st, reply),
            Err(e) => reply.error(e),
        }
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        self.remove(parent.0, name, 0, reply);
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        self.remove(parent.0, name, libc::AT_REMOVEDIR, reply);
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let res = sys::cstr(target.as_os_str()).map_err(err).and_then(|t| {
            self.do_create_node(req, parent.0, link_name, None, |dir, n| {
                sys::symlinkat(&t, dir, n)
            })
        });
        match res {
            Ok(st) => self.created(parent.0, link_name, &st, reply),
            Err(e) => reply.error(e),
        }
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        if let Err(e) = self.sh.check_writable() {
            return reply.error(e);
        }
        if is_internal(name) {
            return reply.error(Errno::ENOENT);
        }
        if is_internal(newname) {
            return reply.error(Errno::EPERM);
        }
        let (parent, newparent) = (parent.0, newparent.0);
        let res = (|| {
            let from_dir = self.sh.dir(parent)?;
            let to_dir = self.sh.dir(newparent)?;
            let from = sys::cstr(name)?;
            let to = sys::cstr(newname)?;
            sys::renameat2(from_dir.as_fd(), &from, to_dir.as_fd(), &to, flags.bits())
        })();
        if let Err(e) = res {
            return reply.error(err(e));
        }
        let exchange = flags.contains(RenameFlags::RENAME_EXCHANGE);
        let (old_path, new_path) = {
            let mut t = lock(&self.sh.table);
            let paths = (t.child_path(parent, name), t.child_path(newparent, newname));
            if exchange {
                t.exchanged(parent, name, newparent, newname);
            } else if let Some(replaced) = t.renamed(parent, name, newparent, newname) {
                if t.get(replaced).is_some_and(|n| n.kind == libc::S_IFDIR) {
                    self.sh.dirs.remove(replaced);
                }
            }
            paths
        };
        reply.ok();
        let old = old_path.as_deref().and_then(rel_path);
        let new = new_path.as_deref().and_then(rel_path);
        match (old, new) {
            (Some(old), Some(new)) => {
                if exchange {
                    self.sh.report(ChangeEvent {
                        path: old.clone(),
                        kind: ChangeKind::RenamedFrom(new.clone()),
                    });
                }
                self.sh.report(ChangeEvent {
                    path: new,
                    kind: ChangeKind::RenamedFrom(old),
                });
            }
            // One side is not a folder path: what the engine can see is a removal or a
            // creation.
            (Some(old), None) => self.sh.report(ChangeEvent {
                path: old,
                kind: if exchange {
                    ChangeKind::Created
                } else {
                    ChangeKind::Removed
                },
            }),
            (None, Some(new)) => self.sh.report(ChangeEvent {
                path: new,
                kind: ChangeKind::Created,
            }),
            (None, None) => {}
        }
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        if let Err(e) = self.sh.check_writable() {
            return reply.error(e);
        }
        if is_internal(newname) {
            return reply.error(Errno::EPERM);
        }
        let res = (|| {
            let target = self.sh.target(ino.0)?;
            if matches!(target, Target::Root(_)) {
                return Err(libc::EPERM);
            }
            let dir = self.sh.dir(newparent.0)?;
            let name = sys::cstr(newname)?;
            sys::link_fd(target.fd(), dir.as_fd(), &name)?;
            sys::statx(dir.as_fd(), &name)
        })();
        match res {
            Ok(st) => self.created(newparent.0, newname, &st, reply),
            Err(e) => reply.error(err(e)),
        }
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let ino = ino.0;
        let flags = flags.0;
        let writable = flags & libc::O_ACCMODE != libc::O_RDONLY;
        if writable && self.sh.read_only {
            return reply.error(Errno::EROFS);
        }
        let oflags = flags & !(libc::O_CREAT | libc::O_EXCL | libc::O_NOCTTY | libc::O_DIRECT);
        let res = (|| {
            let failure = match self.sh.locate(ino) {
                Ok((dir, name)) => {
                    match sys::openat(dir.as_fd(), &name, oflags | libc::O_NOFOLLOW, 0) {
                        Ok(fd) => match sys::fstat(fd.as_fd()) {
                            Ok(st) if self.sh.nodeid(st.ino) == ino => return Ok((fd, st)),
                            Ok(_) => libc::ESTALE,
                            Err(e) => e,
                        },
                        Err(e) => e,
                    }
                }
                Err(e) => e,
            };
            // Unlinked or replaced, but open elsewhere: reopen that inode (never a file being
            // assembled: its holes would be read as content).
            let h = self.sh.handles.any_file_of(ino).ok_or(failure)?;
            let fd = sys::reopen(h.fd(), oflags)?;
            let st = sys::fstat(fd.as_fd())?;
            Ok((fd, st))
        })();
        let (fd, st) = match res {
            Ok(v) => v,
            Err(e) => return reply.error(err(e)),
        };
        // A placeholder (on demand): a reader gets a stream of it, its first chunk fetched
        // (D95); a writer waits until it is whole (D92), and the open goes on with the file that
        // now holds it.
        let (fd, st, stream) = match self.local_content(req, ino, fd, st, oflags) {
            Ok(v) => v,
            Err(e) => return reply.error(err(e)),
        };
        if let Some(stream) = stream {
            // Forwarded and past the page cache: each read reaches the mount with the caller's
            // own range and waits for just that (no kernel read-ahead, which would make the
            // first 4 KiB wait for 128 KiB); mmap still works (`FUSE_DIRECT_IO_ALLOW_MMAP`).
            let (fh, _) = self
                .sh
                .handles
                .add_file(ino, st.ino, fd, false, None, Some(stream));
            return reply.opened(FileHandle(fh), FopenFlags::FOPEN_DIRECT_IO);
        }
        // A writer without CAP_FSETID (taken as: not root) clears the set-id bits. With
        // passthrough its writes never come here, so it is done when it opens.
        if writable && req.uid() != 0 {
            if let Err(e) = kill_suidgid(fd.as_fd(), Some(st.mode)) {
                return reply.error(err(e));
            }
        }
        let passthrough = self.sh.passthrough.load(Ordering::Relaxed) && st.kind() == libc::S_IFREG;
        let (fh, backing) = {
            let mut make =
                |fd: BorrowedFd<'_>| self.sh.make_backing(fd, |fd| reply.open_backing(fd));
            self.sh.handles.add_file(
                ino,
                st.ino,
                fd,
                writable,
                passthrough.then_some(&mut make as MakeBacking<'_>),
                None,
            )
        };
        match backing {
            Some(id) => reply.opened_passthrough(FileHandle(fh), FopenFlags::empty(), &id),
            None => reply.opened(FileHandle(fh), self.open_flags(ino, &st, flags)),
        }
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let Some(h) = self.sh.handles.get(fh.0) else {
            return reply.error(Errno::EBADF);
        };
        // A placeholder being assembled: served once every byte asked is verified (D95).
        if let Some(s) = &h.stream {
            if let Err(e) = s.ready(offset, size as u64) {
                return reply.error(err(e));
            }
        }
        READ_BUF.with_borrow_mut(|buf| {
            match sys::pread_into(h.fd(), offset, size as usize, buf) {
                Ok(()) => reply.data(buf),
                Err(e) => reply.error(err(e)),
            }
            // Readahead asks 128 KiB at a time; a rare bigger read (O_DIRECT) is not kept.
            if buf.capacity() > KEPT_READ_BUF {
                *buf = Vec::new();
            }
        });
    }

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let Some(h) = self.sh.handles.get(fh.0) else {
            return reply.error(Errno::EBADF);
        };
        let f = &*h;
        if write_flags.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID) {
            if let Err(e) = kill_suidgid(f.fd.as_fd(), None) {
                return reply.error(err(e));
            }
        }
        match sys::pwrite(f.fd.as_fd(), offset, data) {
            Ok(n) => {
                f.wrote.store(true, Ordering::Relaxed);
                reply.written(n as u32);
                self.sh.writing(f);
            }
            Err(e) => reply.error(err(e)),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // Nothing to flush: writes are not buffered here (each reached the backing before
        // it was answered) and locks are the kernel's. ENOSYS tells the kernel so once, and
        // it stops sending FLUSH: close(2) then returns without a round trip.
        reply.error(Errno::ENOSYS);
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let released = self.sh.handles.release(fh.0);
        reply.ok();
        let Some(r) = released else {
            return;
        };
        let f = &*r.handle;
        if !f.writable {
            return;
        }
        if !f.passthrough && f.wrote.load(Ordering::Relaxed) {
            // Written through the mount, so through the kernel's pages: they are the content.
            if let Ok(st) = sys::fstat(f.fd()) {
                self.sh.kept.wrote(f.ino, ContentSig::of(&st));
            }
        }
        let path = self.sh.path_of(f.ino);
        // With passthrough the writes never came here: any writable open may have written.
        if f.passthrough || f.wrote.load(Ordering::Relaxed) {
            self.sh.emit(path.clone(), ChangeKind::Written);
        }
        if r.last_writer {
            self.sh.emit(path, ChangeKind::Closed);
        }
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        let Some(h) = self.sh.handles.get(fh.0) else {
            return reply.error(Errno::EBADF);
        };
        let f = &*h;
        match sys::fsync(f.fd.as_fd(), datasync) {
            Ok(()) => {
                reply.ok();
                if f.writable && (f.passthrough || f.wrote.load(Ordering::Relaxed)) {
                    self.sh.emit(self.sh.path_of(f.ino), ChangeKind::Written);
                }
            }
            Err(e) => reply.error(err(e)),
        }
    }

    /// Answered `ENOSYS`: the kernel then never sends OPENDIR or RELEASEDIR again, and gives
    /// every directory open `FOPEN_KEEP_CACHE | FOPEN_CACHE_DIR` (its default without
    /// opendir): listings stay cached across opens, and an open costs no round trip. A warm
    /// `find` or `ls` then asks at most a GETATTR per directory (its mtime, to check the
    /// cached listing). The kernel drops a directory's listing itself when a change through
    /// the mount touches it, when it sees the directory's mtime change (after the attribute
    /// TTL), and when the engine's invalidation names a child (`invalidate`).
    fn opendir(&self, _req: &Request, _ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        reply.error(Errno::ENOSYS);
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let res = self.fill_dir(ino.0, offset, |dir, e| {
            let kind = match dtype_kind(e.dtype) {
                Some(k) => k,
                None => match sys::cstr(&e.name).and_then(|n| sys::statx(dir, &n)) {
                    Ok(st) => file_type(st.mode),
                    Err(_) => return Fill::Skipped,
                },
            };
            if reply.add(INodeNo(self.sh.nodeid(e.ino)), e.next as u64, kind, &e.name) {
                Fill::Full
            } else {
                Fill::Added
            }
        });
        match res {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        let mut added: Vec<(std::ffi::OsString, Stat)> = Vec::new();
        // A listing that went to disk hands its subdirectories to the read-ahead (`prefetch`).
        let mark = Prefetcher::mark();
        let mut subdirs = Vec::new();
        let res = self.fill_dir(ino.0, offset, |dir, e| {
            if is_dot(&e.name) {
                // The kernel takes no lookup for these; they only need an inode number.
                let mut st = zero_stat();
                st.ino = e.ino;
                st.mode = libc::S_IFDIR;
                let attr = self.sh.attr(&st);
                return if reply.add(
                    INodeNo(attr.ino.0),
                    e.next as u64,
                    &e.name,
                    &Duration::ZERO,
                    &attr,
                    Generation(0),
                ) {
                    Fill::Full
                } else {
                    Fill::Added
                };
            }
            let (st, cname) = match sys::cstr(&e.name).and_then(|n| Ok((sys::statx(dir, &n)?, n))) {
                Ok((st, n)) if st.dev == self.sh.root_dev && !st.mount_root => (st, n),
                // Gone since the listing was read, or another filesystem mounted here.
                _ => return Fill::Skipped,
            };
            if st.is_dir() {
                subdirs.push(cname);
            }
            let attr = self.sh.attr(&st);
            if reply.add(
                attr.ino,
                e.next as u64,
                &e.name,
                &self.sh.ttl,
                &attr,
                Generation(generation(&st)),
            ) {
                Fill::Full
            } else {
                added.push((e.name.clone(), st));
                Fill::Added
            }
        });
        match res {
            Ok(()) => {
                // Each entry given is a lookup the kernel now holds: record them before the
                // reply can be answered with a forget.
                for (name, st) in &added {
                    self.sh.remember(ino.0, name, st);
                }
                reply.ok();
                if Prefetcher::went_to_disk(mark) {
                    if let Ok(dir) = self.sh.dir(ino.0) {
                        self.sh.prefetch.offer(Job {
                            dir,
                            children: subdirs,
                        });
                    }
                }
            }
            Err(e) => reply.error(e),
        }
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        // No directory handles (see `opendir`): the directory itself is synced.
        match self
            .open_dir(ino.0)
            .and_then(|fd| sys::fsync(fd.as_fd(), datasync))
        {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(err(e)),
        }
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        match sys::statvfs(self.sh.root.as_fd()) {
            Ok(s) => reply.statfs(
                s.blocks, s.bfree, s.bavail, s.files, s.ffree, s.bsize, s.namelen, s.frsize,
            ),
            Err(e) => reply.error(err(e)),
        }
    }

    fn setxattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        if let Err(e) = self.sh.check_writable() {
            return reply.error(e);
        }
        let res = sys::cstr(name).map_err(err).and_then(|n| {
            if placeholder::is_own(&n) {
                return Err(Errno::EPERM);
            }
            self.with_xattr(ino.0, |at| sys::setxattr(at, &n, value, flags))
        });
        match res {
            Ok(()) => {
                let path = self.sh.path_of(ino.0);
                reply.ok();
                self.sh.emit(path, ChangeKind::Metadata);
            }
            Err(e) => reply.error(e),
        }
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        let res = sys::cstr(name).map_err(err).and_then(|n| {
            if placeholder::is_state(&n) {
                return self.state_xattr(ino.0);
            }
            if placeholder::is_own(&n) {
                return Err(Errno::ENODATA);
            }
            self.with_xattr(ino.0, |at| sys::getxattr(at, &n, size as usize))
        });
        let res = match res {
            Ok(v) if size != 0 && v.len() > size as usize => Err(Errno::ERANGE),
            r => r,
        };
        match res {
            Ok(v) if size == 0 => reply.size(v.len() as u32),
            Ok(v) => reply.data(&v),
            Err(e) => reply.error(e),
        }
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        // The whole list is read (its size asked first), so meshfs's own names can be left out
        // and the state added before the size is told.
        let res = self
            .with_xattr(ino.0, |at| {
                let n = sys::listxattr(at, 0)?.len();
                sys::listxattr(at, n)
            })
            .map(|list| {
                let with_state =
                    self.sh.content.is_some() && self.sh.kind_of(ino.0) == Some(libc::S_IFREG);
                placeholder::filter_list(&list, with_state)
            });
        let res = match res {
            Ok(v) if size != 0 && v.len() > size as usize => Err(Errno::ERANGE),
            r => r,
        };
        match res {
            Ok(v) if size == 0 => reply.size(v.len() as u32),
            Ok(v) => reply.data(&v),
            Err(e) => reply.error(e),
        }
    }

    fn removexattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        if let Err(e) = self.sh.check_writable() {
            return reply.error(e);
        }
        let res = sys::cstr(name).map_err(err).and_then(|n| {
            if placeholder::is_own(&n) {
                return Err(Errno::EPERM);
            }
            self.with_xattr(ino.0, |at| sys::removexattr(at, &n))
        });
        match res {
            Ok(()) => {
                let path = self.sh.path_of(ino.0);
                reply.ok();
                self.sh.emit(path, ChangeKind::Metadata);
            }
            Err(e) => reply.error(e),
        }
    }

    fn access(&self, _req: &Request, ino: INodeNo, mask: AccessFlags, reply: ReplyEmpty) {
        // A question, not a change: asked of the name (one syscall), not of a verified
        // descriptor. Only sent without `default_permissions`, where the backing's answer
        // for this process's identity is the answer.
        let res = if ino.0 == ROOT {
            sys::faccessat(self.sh.root.as_fd(), sys::EMPTY, mask.bits())
        } else {
            self.sh
                .locate(ino.0)
                .and_then(|(dir, name)| sys::faccessat(dir.as_fd(), &name, mask.bits()))
        };
        match res {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(err(e)),
        }
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        if let Err(e) = self.sh.check_writable() {
            return reply.error(e);
        }
        if is_internal(name) {
            return reply.error(Errno::EPERM);
        }
        let parent = parent.0;
        let writable = flags & libc::O_ACCMODE != libc::O_RDONLY;
        let oflags =
            (flags | libc::O_CREAT | libc::O_NOFOLLOW) & !(libc::O_NOCTTY | libc::O_DIRECT);
        let res = (|| {
            let dir = self.sh.dir(parent)?;
            let cname = sys::cstr(name)?;
            self.local_before_create(req, parent, dir.as_fd(), &cname, name)?;
            let private_umask = zero_umask();
            let fd = sys::openat(dir.as_fd(), &cname, oflags, mode & 0o7777)?;
            if let Some((uid, gid)) = self.sh.new_owner(req, dir.as_fd()) {
                sys::chown_fd(fd.as_fd(), Some(uid), gid)?;
            }
            if !private_umask {
                sys::chmod_fd(fd.as_fd(), mode & 0o7777)?;
            }
            let st = sys::fstat(fd.as_fd())?;
            Ok((fd, st))
        })();
        let (fd, st) = match res {
            Ok(v) => v,
            Err(e) => return reply.error(err(e)),
        };
        let ino = self.sh.nodeid(st.ino);
        self.sh.remember(parent, name, &st);
        let passthrough = self.sh.passthrough.load(Ordering::Relaxed) && st.kind() == libc::S_IFREG;
        let (fh, backing) = {
            let mut make =
                |fd: BorrowedFd<'_>| self.sh.make_backing(fd, |fd| reply.open_backing(fd));
            self.sh.handles.add_file(
                ino,
                st.ino,
                fd,
                writable,
                passthrough.then_some(&mut make as MakeBacking<'_>),
                None,
            )
        };
        let attr = self.sh.attr(&st);
        let generation = Generation(generation(&st));
        match backing {
            Some(id) => reply.created_passthrough(
                &self.sh.ttl,
                &attr,
                generation,
                FileHandle(fh),
                FopenFlags::empty(),
                &id,
            ),
            None => reply.created(
                &self.sh.ttl,
                &attr,
                generation,
                FileHandle(fh),
                self.open_flags(ino, &st, flags),
            ),
        }
        self.sh
            .emit(self.sh.child_path(parent, name), ChangeKind::Created);
    }

    fn fallocate(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let Some(h) = self.sh.handles.get(fh.0) else {
            return reply.error(Errno::EBADF);
        };
        let f = &*h;
        match sys::fallocate(f.fd.as_fd(), mode, offset, length) {
            Ok(()) => {
                f.wrote.store(true, Ordering::Relaxed);
                reply.ok();
            }
            Err(e) => reply.error(err(e)),
        }
    }

    /// No ioctl is passed through: a regular file answers ENOTTY, as on ext4 for the
    /// terminal queries every `isatty()` makes (fuser's default logged a warning for each, and
    /// Python's `open()` asks once per file).
    #[allow(clippy::too_many_arguments)]
    fn ioctl(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: IoctlFlags,
        _cmd: u32,
        _in_data: &[u8],
        _out_size: u32,
        reply: ReplyIoctl,
    ) {
        reply.error(Errno::ENOTTY);
    }

    fn lseek(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: i64,
        whence: i32,
        reply: ReplyLseek,
    ) {
        let Some(h) = self.sh.handles.get(fh.0) else {
            return reply.error(Errno::EBADF);
        };
        // A file being assembled has holes where its content is not here yet: it is all
        // data, as the file it becomes.
        if let Some(s) = &h.stream {
            let size = s.size() as i64;
            return match whence {
                _ if offset < 0 => reply.error(Errno::EINVAL),
                _ if offset >= size => reply.error(Errno::ENXIO),
                libc::SEEK_DATA => reply.offset(offset),
                libc::SEEK_HOLE => reply.offset(size),
                _ => reply.error(Errno::EINVAL),
            };
        }
        match sys::lseek(h.fd(), offset, whence) {
            Ok(off) => reply.offset(off),
            Err(e) => reply.error(err(e)),
        }
    }

    fn copy_file_range(
        &self,
        _req: &Request,
        _ino_in: INodeNo,
        fh_in: FileHandle,
        offset_in: u64,
        _ino_out: INodeNo,
        fh_out: FileHandle,
        offset_out: u64,
        len: u64,
        _flags: CopyFileRangeFlags,
        reply: ReplyWrite,
    ) {
        let (Some(hin), Some(hout)) = (self.sh.handles.get(fh_in.0), self.sh.handles.get(fh_out.0))
        else {
            return reply.error(Errno::EBADF);
        };
        let (fin, fout) = (&*hin, &*hout);
        let len = len.min(u64::from(u32::MAX) & !0xfff) as usize;
        if let Some(s) = &fin.stream {
            if let Err(e) = s.ready(offset_in, len as u64) {
                return reply.error(err(e));
            }
        }
        match sys::copy_file_range(fin.fd.as_fd(), offset_in, fout.fd.as_fd(), offset_out, len) {
            Ok(n) => {
                fout.wrote.store(true, Ordering::Relaxed);
                reply.written(n as u32);
            }
            Err(e) => reply.error(err(e)),
        }
    }
}

impl Passthrough {
    fn remove(&self, parent: u64, name: &OsStr, flags: i32, reply: ReplyEmpty) {
        if let Err(e) = self.sh.check_writable() {
            return reply.error(e);
        }
        if is_internal(name) {
            return reply.error(Errno::ENOENT);
        }
        let res = (|| {
            let dir = self.sh.dir(parent)?;
            let cname = sys::cstr(name)?;
            sys::unlinkat(dir.as_fd(), &cname, flags)
        })();
        if let Err(e) = res {
            return reply.error(err(e));
        }
        let path = {
            let mut t = lock(&self.sh.table);
            let path = t.child_path(parent, name);
            if let Some(ino) = t.unlinked(parent, name) {
                if flags & libc::AT_REMOVEDIR != 0 {
                    self.sh.dirs.remove(ino);
                }
            }
            path
        };
        reply.ok();
        self.sh.emit(path, ChangeKind::Removed);
    }
}
