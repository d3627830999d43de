//! The backing directory as the request handlers see it: the mount's shared state, and how
//! a FUSE node becomes something a syscall can act on.
//!
//! Owns the node → backing resolution, cheapest first: the directory descriptor cache (one
//! syscall for anything naming a child); else an `openat2` of the node's path beneath the
//! backing root with no symlink followed; and for an unlinked or replaced file, the
//! descriptor of one of its open handles. A node whose name now leads to another inode
//! answers `ESTALE`, so the kernel looks the path up again rather than acting on the wrong
//! file. Also owns what every handler shares: attributes as FUSE wants them, the owner and
//! mode of new nodes, the change reports to the engine.
//!
//! **Invariant:** a descriptor handed out by [`Shared::dir`] or [`Shared::target`] holds
//! the inode the node id names (checked with `fstat` when it is opened), and was reached
//! without following a symlink.

use crate::dircache::DirCache;
use crate::handles::{Handle, Handles};
use crate::inodes::{Remembered, Table, ROOT};
use crate::kept::Kept;
use crate::passthrough::PassthroughOff;
use crate::prefetch::Prefetcher;
use crate::recent::Recent;
use crate::sys::{self, Stat, SysResult};
use crate::{lock, ChangeEvent, ChangeKind, ChangeSink};
use fuser::{BackingId, Errno, FileAttr, FileType, Generation, INodeNo, ReplyEntry, Request};
use meshfs_protocol::RelPath;
use std::cell::Cell;
use std::ffi::{CString, OsStr};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, UNIX_EPOCH};
use tracing::{debug, warn};

/// One queued invalidation.
#[derive(Debug)]
pub(crate) struct Inval {
    /// What is stale.
    pub path: RelPath,
    /// For a change the watcher saw (`MountHandle::invalidate_foreign`), when it was queued:
    /// it is sent only if, `invalidate::FOREIGN_DELAY` later, the mount has not reported the
    /// path as its own change (the request thread reports after its backing call, which the
    /// watcher may see first).
    pub foreign_at: Option<Instant>,
}

/// Directory descriptors kept open between requests (a small part of the fd budget).
pub(crate) const DIR_CACHE: usize = 1024;
/// The state the request threads, the notifier thread and the engine's handle share.
pub(crate) struct Shared {
    /// The backing directory, O_PATH.
    pub root: Arc<OwnedFd>,
    /// Its backing inode number (shown as node 1).
    pub root_ino: u64,
    /// Its device: nodes on another device (a mount inside the folder) are not served.
    pub root_dev: u64,
    /// The inode table.
    pub table: Mutex<Table>,
    /// Directory descriptors.
    pub dirs: DirCache,
    /// Open handles.
    pub handles: Handles,
    /// Where changes go.
    pub sink: Arc<dyn ChangeSink>,
    /// Entry and attribute time-to-live in the kernel.
    pub ttl: Duration,
    /// Refuse every change (the kernel already does, with the `ro` mount flag).
    pub read_only: bool,
    /// The caller asked for kernel passthrough.
    pub want_passthrough: bool,
    /// Kernel passthrough is negotiated and has not been refused.
    pub passthrough: AtomicBool,
    /// Why kernel passthrough is off (`None` while it is on, or before FUSE_INIT).
    pub passthrough_off: Mutex<Option<PassthroughOff>>,
    /// The caller asked for FUSE over io_uring where the kernel offers it.
    pub want_io_uring: bool,
    /// The effective ids of this process (the owner of what the backing creates).
    pub euid: u32,
    /// See `euid`.
    pub egid: u32,
    /// The queue of the notifier thread; `None` once the mount is going away.
    pub invalidations: Mutex<Option<Sender<Inval>>>,
    /// Invalidations queued and not yet sent to the kernel: until it is 0 the kernel may
    /// still show a path's previous state, so the engine's "in sync" waits for it.
    pub invalidations_pending: AtomicUsize,
    /// Metadata read-ahead after a cold listing.
    pub prefetch: Prefetcher,
    /// Paths changed through the mount lately: the watcher's reports of them are echoes.
    pub recent: Mutex<Recent>,
    /// Files whose cached pages the kernel may keep across opens.
    pub kept: Kept,
    /// Whether they may be kept at all (`MountOptions::keep_cache`).
    pub keep_cache: bool,
    /// The caller asked for write-only forwarded opens to bypass the kernel's pages
    /// (`MountOptions::write_direct`).
    pub want_write_direct: bool,
    /// They do: asked for, and the kernel drops the pages such a write covers
    /// (`FUSE_DIRECT_IO_ALLOW_MMAP` agreed at FUSE_INIT).
    pub write_direct: AtomicBool,
    /// Where placeholders' content comes from, if the folder can have any (D90–D92).
    pub content: Option<Arc<dyn crate::ContentSource>>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("root_ino", &self.root_ino)
            .field("read_only", &self.read_only)
            .field("passthrough", &self.passthrough)
            .finish_non_exhaustive()
    }
}

pub(crate) use crate::is_internal;

pub(crate) fn file_type(mode: u32) -> FileType {
    match mode & libc::S_IFMT {
        libc::S_IFDIR => FileType::Directory,
        libc::S_IFLNK => FileType::Symlink,
        libc::S_IFIFO => FileType::NamedPipe,
        libc::S_IFSOCK => FileType::Socket,
        libc::S_IFCHR => FileType::CharDevice,
        libc::S_IFBLK => FileType::BlockDevice,
        _ => FileType::RegularFile,
    }
}

/// The generation of a backing inode: its birth time, which differs between two inodes
/// that had the same number one after the other.
pub(crate) fn generation(st: &Stat) -> u64 {
    st.btime
        .map(|t| {
            (t.sec as u64)
                .wrapping_mul(1_000_000_000)
                .wrapping_add(u64::from(t.nsec))
        })
        .unwrap_or(0)
}

thread_local! {
    /// Whether this request thread runs with its own umask of 0 (`None`: not tried yet).
    static ZERO_UMASK: Cell<Option<bool>> = const { Cell::new(None) };
}

/// Makes this request thread create with exactly the modes the kernel sends; false if it
/// could not (the caller then fixes the mode with chmod).
pub(crate) fn zero_umask() -> bool {
    ZERO_UMASK.with(|c| match c.get() {
        Some(ok) => ok,
        None => {
            let ok = sys::private_zero_umask();
            if !ok {
                warn!("cannot give a FUSE thread its own umask; modes are fixed after create");
            }
            c.set(Some(ok));
            ok
        }
    })
}

/// What a node operation acts on: the root, a verified O_PATH descriptor of the node, or
/// an open handle of it (an unlinked or replaced file).
pub(crate) enum Target {
    /// The backing root.
    Root(Arc<OwnedFd>),
    /// An O_PATH descriptor, checked to hold the node's inode.
    Path(OwnedFd),
    /// An open file of the node.
    Open(Arc<Handle>),
}

impl Target {
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        match self {
            Target::Root(fd) => fd.as_fd(),
            Target::Path(fd) => fd.as_fd(),
            Target::Open(h) => h.fd(),
        }
    }
}

impl Shared {
    /// The FUSE node id of a backing inode number.
    pub(crate) fn nodeid(&self, st_ino: u64) -> u64 {
        if st_ino == self.root_ino {
            ROOT
        } else if st_ino == ROOT {
            self.root_ino
        } else {
            st_ino
        }
    }

    pub(crate) fn attr(&self, st: &Stat) -> FileAttr {
        FileAttr {
            ino: INodeNo(self.nodeid(st.ino)),
            size: st.size,
            blocks: st.blocks,
            atime: st.atime.system_time(),
            mtime: st.mtime.system_time(),
            ctime: st.ctime.system_time(),
            crtime: st.btime.map(|b| b.system_time()).unwrap_or(UNIX_EPOCH),
            kind: file_type(st.mode),
            perm: (st.mode & 0o7777) as u16,
            nlink: st.nlink,
            uid: st.uid,
            gid: st.gid,
            rdev: st.rdev,
            blksize: st.blksize,
            flags: 0,
        }
    }

    /// The descriptor of directory node `ino`.
    pub(crate) fn dir(&self, ino: u64) -> Result<Arc<OwnedFd>, sys::Errno> {
        if ino == ROOT {
            return Ok(self.root.clone());
        }
        if let Some(fd) = self.dirs.get(ino) {
            return Ok(fd);
        }
        for _ in 0..4 {
            let (path, epoch) = {
                let t = lock(&self.table);
                match t.path(ino) {
                    Some(p) => (p, t.epoch()),
                    None => return Err(libc::ENOENT),
                }
            };
            let path = CString::new(path).map_err(|_| libc::EINVAL)?;
            match sys::open_beneath(self.root.as_fd(), &path, libc::O_PATH | libc::O_DIRECTORY) {
                Ok(fd) => {
                    let st = sys::fstat(fd.as_fd())?;
                    if self.nodeid(st.ino) != ino {
                        return Err(libc::ESTALE);
                    }
                    let fd = Arc::new(fd);
                    self.dirs.insert(ino, fd.clone());
                    return Ok(fd);
                }
                Err(e) if lock(&self.table).epoch() != epoch => {
                    debug!(
                        ino,
                        errno = e,
                        "directory path raced a rename; resolving again"
                    );
                }
                // A component became a symlink or left the tree: not the node we know.
                Err(libc::ELOOP) | Err(libc::EXDEV) => return Err(libc::ESTALE),
                Err(e) => return Err(e),
            }
        }
        Err(libc::ESTALE)
    }

    /// The parent directory descriptor and name of node `ino` (not the root).
    pub(crate) fn locate(&self, ino: u64) -> Result<(Arc<OwnedFd>, CString), sys::Errno> {
        let (parent, name) = {
            let t = lock(&self.table);
            let (p, n) = t.primary(ino).ok_or(libc::ENOENT)?;
            (p, sys::cstr(n)?)
        };
        Ok((self.dir(parent)?, name))
    }

    /// The node `ino` itself, verified to still be that inode.
    pub(crate) fn target(&self, ino: u64) -> Result<Target, sys::Errno> {
        if ino == ROOT {
            return Ok(Target::Root(self.root.clone()));
        }
        let failure = match self.locate(ino) {
            Ok((dir, name)) => {
                match sys::openat(dir.as_fd(), &name, libc::O_PATH | libc::O_NOFOLLOW, 0) {
                    Ok(fd) => match sys::fstat(fd.as_fd()) {
                        Ok(st) if self.nodeid(st.ino) == ino => return Ok(Target::Path(fd)),
                        Ok(_) => libc::ESTALE,
                        Err(e) => e,
                    },
                    Err(e) => e,
                }
            }
            Err(e) => e,
        };
        self.handles
            .any_file_of(ino)
            .map(Target::Open)
            .ok_or(failure)
    }

    /// The node itself, preferring the descriptor of one of its open files: no path walk,
    /// and the right inode even after a rename or unlink (a program that changes the
    /// attributes of a file usually has it open: tar, editors, the writer's own fchmod).
    pub(crate) fn target_open_first(&self, ino: u64) -> Result<Target, sys::Errno> {
        match self.handles.any_file_of(ino) {
            Some(h) => Ok(Target::Open(h)),
            None => self.target(ino),
        }
    }

    pub(crate) fn kind_of(&self, ino: u64) -> Option<u32> {
        lock(&self.table).get(ino).map(|n| n.kind)
    }

    /// Records a lookup the kernel will hold, dropping a stale directory descriptor.
    pub(crate) fn remember(&self, parent: u64, name: &OsStr, st: &Stat) {
        let ino = self.nodeid(st.ino);
        let outcome = lock(&self.table).remember(parent, name, ino, st.kind(), generation(st));
        if outcome == Remembered::Replaced {
            self.dirs.remove(ino);
        }
    }

    pub(crate) fn entry(&self, parent: u64, name: &OsStr, st: &Stat, reply: ReplyEntry) {
        self.remember(parent, name, st);
        reply.entry(&self.ttl, &self.attr(st), Generation(generation(st)));
    }

    pub(crate) fn path_of(&self, ino: u64) -> Option<Vec<u8>> {
        lock(&self.table).path(ino)
    }

    pub(crate) fn child_path(&self, parent: u64, name: &OsStr) -> Option<Vec<u8>> {
        lock(&self.table).child_path(parent, name)
    }

    /// Tells the engine; paths that are not valid folder paths (not UTF-8, not NFC) are
    /// left to its scanner.
    pub(crate) fn emit(&self, path: Option<Vec<u8>>, kind: ChangeKind) {
        if let Some(path) = path.and_then(|p| rel_path(&p)) {
            self.report(ChangeEvent { path, kind });
        }
    }

    /// A write through `h` reached its file: the path stays a recent change of the mount's
    /// own while the file is being written, refreshed at most every quarter of
    /// [`crate::recent::RECENT`], so that the watcher's echoes of a write longer than that stay
    /// the mount's own (no invalidation each, and the watcher's long nap, D111), as those of the
    /// first seconds after its open are.
    pub(crate) fn writing(&self, h: &Handle) {
        let now_ms = crate::recent::ms_now();
        let every = (crate::recent::RECENT / 4).as_millis() as u64;
        let last = h.told_ms.load(Ordering::Relaxed);
        if last != 0 && now_ms.saturating_sub(last) < every {
            return;
        }
        h.told_ms.store(now_ms, Ordering::Relaxed);
        if let Some(path) = self.path_of(h.ino).and_then(|p| rel_path(&p)) {
            lock(&self.recent).told(&path, Instant::now());
        }
    }

    /// Gives `ev` to the engine, remembering its paths as changed through the mount (the
    /// watcher's report of them is an echo: `MountHandle::invalidate_foreign`).
    pub(crate) fn report(&self, ev: ChangeEvent) {
        {
            let now = Instant::now();
            let mut recent = lock(&self.recent);
            recent.told(&ev.path, now);
            if let ChangeKind::RenamedFrom(from) = &ev.kind {
                recent.told(from, now);
            }
        }
        self.sink.changed(ev);
    }

    /// If the caller is not the process's own user (a root daemon serving others), gives a
    /// new node the caller's uid and gid (the directory's gid if it is setgid).
    pub(crate) fn new_owner(
        &self,
        req: &Request,
        dir: BorrowedFd<'_>,
    ) -> Option<(u32, Option<u32>)> {
        if self.euid != 0 || (req.uid() == self.euid && req.gid() == self.egid) {
            return None;
        }
        let setgid_dir = sys::fstat(dir).is_ok_and(|s| s.mode & libc::S_ISGID != 0);
        Some((req.uid(), (!setgid_dir).then_some(req.gid())))
    }

    /// Gives the new `dir/name` its owner and exact mode when needed, and returns its stat.
    pub(crate) fn finish_new(
        &self,
        req: &Request,
        dir: BorrowedFd<'_>,
        name: &CString,
        mode: Option<u32>,
    ) -> SysResult<Stat> {
        let owner = self.new_owner(req, dir);
        let fix_mode = mode.filter(|_| !zero_umask());
        if owner.is_none() && fix_mode.is_none() {
            return sys::statx(dir, name);
        }
        let fd = sys::openat(dir, name, libc::O_PATH | libc::O_NOFOLLOW, 0)?;
        if let Some((uid, gid)) = owner {
            sys::chown_fd(fd.as_fd(), Some(uid), gid)?;
        }
        if let Some(mode) = fix_mode {
            sys::chmod_fd(fd.as_fd(), mode & 0o7777)?;
        }
        sys::fstat(fd.as_fd())
    }

    pub(crate) fn check_writable(&self) -> Result<(), Errno> {
        if self.read_only {
            Err(Errno::EROFS)
        } else {
            Ok(())
        }
    }

    /// Registers a backing file with the kernel for passthrough; turns passthrough off for
    /// the mount if the kernel refuses it for lack of privilege.
    /// Kernel passthrough is off from now on, for `why`.
    pub(crate) fn passthrough_refused(&self, why: PassthroughOff) {
        *lock(&self.passthrough_off) = Some(why);
        if self.passthrough.swap(false, Ordering::Relaxed) {
            warn!(reason = %why, "kernel passthrough off; forwarding reads and writes");
        }
    }

    pub(crate) fn make_backing(
        &self,
        fd: BorrowedFd<'_>,
        open: impl FnOnce(BorrowedFd<'_>) -> std::io::Result<BackingId>,
    ) -> Option<BackingId> {
        match open(fd) {
            Ok(id) => Some(id),
            Err(e) => {
                if matches!(e.raw_os_error(), Some(libc::EPERM) | Some(libc::EOPNOTSUPP)) {
                    self.passthrough_refused(PassthroughOff::from_errno(
                        e.raw_os_error().unwrap_or(libc::EIO),
                    ));
                } else {
                    debug!(error = %e, "no passthrough for this open; forwarding it");
                }
                None
            }
        }
    }
}

/// A folder path from backing-relative bytes, if it is one.
pub(crate) fn rel_path(bytes: &[u8]) -> Option<RelPath> {
    let s = std::str::from_utf8(bytes).ok()?;
    match RelPath::new(s) {
        Ok(p) => Some(p),
        Err(e) => {
            debug!(path = %s, error = %e, "not reported to the engine");
            None
        }
    }
}

/// Clears set-user-ID, and set-group-ID of a group-executable file, as the kernel does when
/// a caller without `CAP_FSETID` writes or truncates (`FUSE_HANDLE_KILLPRIV_V2` leaves it to
/// the filesystem, and the backing sees every write come from this process). `known`: the
/// mode, if just read.
pub(crate) fn kill_suidgid(fd: BorrowedFd<'_>, known: Option<u32>) -> SysResult<()> {
    let mode = match known {
        Some(m) => m,
        None => sys::fstat(fd)?.mode,
    };
    if mode & libc::S_IFMT != libc::S_IFREG {
        return Ok(());
    }
    let mut kill = libc::S_ISUID;
    if mode & libc::S_IXGRP != 0 {
        kill |= libc::S_ISGID;
    }
    if mode & kill == 0 {
        return Ok(());
    }
    sys::chmod_fd(fd, mode & 0o7777 & !kill)
}

/// A stat of nothing (for negative entries and `.`/`..`).
pub(crate) fn zero_stat() -> Stat {
    Stat {
        ino: 0,
        dev: 0,
        mode: 0,
        nlink: 0,
        uid: 0,
        gid: 0,
        rdev: 0,
        size: 0,
        blocks: 0,
        blksize: 4096,
        atime: sys::Ts::default(),
        mtime: sys::Ts::default(),
        ctime: sys::Ts::default(),
        btime: None,
        mount_root: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn internal_names_are_recognised_at_any_depth_component() {
        assert!(is_internal(OsStr::new(".meshfs")));
        assert!(is_internal(OsStr::new(".meshfs-tmp-123")));
        assert!(!is_internal(OsStr::new("meshfs")));
        assert!(!is_internal(OsStr::new(".mesh")));
    }

    #[test]
    fn non_folder_paths_are_not_reported() {
        assert!(rel_path(b"a/b").is_some());
        assert!(rel_path(b"a/\xff").is_none());
        assert!(rel_path(b"").is_none());
    }
}
