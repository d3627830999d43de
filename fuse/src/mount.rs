//! Mounting and unmounting: the mount point checks, the FUSE session's threads, and the
//! handle the engine keeps.
//!
//! Owns the life of a mount: [`mount`] checks the mount point (exists, is an empty
//! directory, is not already a mount point; a dead one left by a killed daemon is detached
//! first), opens the backing root, mounts, and starts the request threads and the notifier
//! thread. [`Mount::unmount`] (or drop) unmounts; if the mount is busy (an open file, a shell
//! inside it) it is detached lazily and the request threads serve the last users until they
//! leave.

use crate::backing::{Inval, Shared, DIR_CACHE};
use crate::dircache::DirCache;
use crate::fs::Passthrough;
use crate::handles::Handles;
use crate::inodes::Table;
use crate::prefetch::Prefetcher;
use crate::recent::Recent;
use crate::{invalidate, lock, sys, ChangeSink, Invalidator, WriterRegistry};
use meshfs_protocol::RelPath;
use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;
use tracing::{info, warn};

/// How to mount.
#[derive(Clone, Debug)]
pub struct MountOptions {
    /// Refuse every change (`EROFS`).
    pub read_only: bool,
    /// Request threads, each on its own clone of the FUSE device (default: the number of
    /// CPUs, clamped to 2..=4).
    pub n_threads: usize,
    /// Try kernel passthrough of reads and writes; without the kernel's support or the
    /// privilege, reads and writes are forwarded instead (silently).
    pub passthrough: bool,
    /// How long the kernel may trust an entry or attributes without asking again (default 60
    /// s). Long is fast: a `git status` or `make` after a pause asks nothing. The engine
    /// invalidates what it applies and what its watcher sees changed behind the mount
    /// ([`crate::Invalidator::invalidate_foreign`]); only a change behind the mount the watcher
    /// misses (watcher off or overflowed, or a path the mount itself changed in the two
    /// seconds before) waits for the TTL.
    pub ttl: Duration,
    /// Let other users than the mounting one in (`allow_other`, which for a non-root mount
    /// needs `user_allow_other` in /etc/fuse.conf). The kernel then checks every access
    /// against the files' modes (`default_permissions`), as on any filesystem. Off (the
    /// default), only the mounting user gets in, and the backing's own permission checks
    /// (made with that user's identity) suffice: the kernel then skips refreshing a
    /// directory's attributes for a permission check after every create in it.
    pub allow_other: bool,
    /// Serve requests over io_uring (one queue per CPU, answered on the caller's CPU) when
    /// the kernel offers it: Linux 6.14 or later with `enable_uring` set on the `fuse`
    /// module (`/sys/module/fuse/parameters/enable_uring`, off by default). Otherwise, and
    /// for what the kernel never sends that way (forgets, interrupts), requests come through
    /// `/dev/fuse` to the request threads.
    pub io_uring: bool,
    /// After a listing that came from disk, read the metadata of the directories it lists
    /// (and, where cold too, of theirs) ahead of the caller, on a thread of its own: a cold
    /// `find` or `ls -R` then finds the backing's inodes in memory. Metadata only, bounded,
    /// never for a warm listing.
    pub read_ahead: bool,
    /// Let the kernel keep a forwarded file's cached pages across opens while the file is
    /// unchanged (`FOPEN_KEEP_CACHE`, see `kept`); off, every open drops them, as FUSE does by
    /// default.
    pub keep_cache: bool,
    /// A forwarded write-only open writes past the kernel's pages (`FOPEN_DIRECT_IO`): one
    /// copy and one page cache fewer per write; the kernel drops the pages other opens cached
    /// of what it overwrites.
    pub write_direct: bool,
    /// Where placeholders' content comes from (a folder that is on demand, D90–D92). Without
    /// one, a placeholder is an ordinary file to the mount (it reads as zeros).
    pub content: Option<Arc<dyn crate::ContentSource>>,
}

impl Default for MountOptions {
    fn default() -> MountOptions {
        let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
        MountOptions {
            read_only: false,
            n_threads: cpus.clamp(2, 4),
            passthrough: true,
            ttl: Duration::from_secs(60),
            allow_other: false,
            io_uring: true,
            read_ahead: true,
            keep_cache: true,
            write_direct: true,
            content: None,
        }
    }
}

/// Why a mount or unmount failed.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    /// The mount point does not exist.
    #[error("mount point {} does not exist; create an empty directory there", .0.display())]
    MountPointMissing(PathBuf),
    /// The mount point is not a directory.
    #[error("mount point {} is not a directory", .0.display())]
    NotADirectory(PathBuf),
    /// The mount point has entries.
    #[error("mount point {} is not empty; meshfs mounts only on an empty directory (move its contents into the folder first)", .0.display())]
    NotEmpty(PathBuf),
    /// Something is already mounted there.
    #[error("{} is already a mount point; unmount it first (umount {})", .0.display(), .0.display())]
    AlreadyMounted(PathBuf),
    /// The backing directory is missing or not a directory.
    #[error("backing directory {}: {source}", path.display())]
    Backing {
        /// The backing directory.
        path: PathBuf,
        /// What failed.
        source: io::Error,
    },
    /// The mount point is inside the backing directory (the mount would serve itself).
    #[error("mount point {} lies inside the backing directory {}; choose a mount point outside it", mountpoint.display(), backing.display())]
    Nested {
        /// The mount point.
        mountpoint: PathBuf,
        /// The backing directory.
        backing: PathBuf,
    },
    /// A dead mount (its daemon was killed) could not be detached.
    #[error("{} is a dead mount (transport endpoint is not connected) and detaching it failed: {source}; try `fusermount3 -u -z {}`, or `umount -l {}` as root", path.display(), path.display(), path.display())]
    DeadMount {
        /// The mount point.
        path: PathBuf,
        /// What failed.
        source: io::Error,
    },
    /// Inspecting the mount point failed.
    #[error("cannot inspect mount point {}: {source}", path.display())]
    Inspect {
        /// The mount point.
        path: PathBuf,
        /// What failed.
        source: io::Error,
    },
    /// The kernel (or fusermount) refused the mount, or its threads could not start.
    #[error("mounting {} failed: {source}", path.display())]
    Mount {
        /// The mount point.
        path: PathBuf,
        /// What failed.
        source: io::Error,
    },
    /// An ordinary user's mount failed while the process runs with `no_new_privs`: the
    /// setuid helper fusermount3 could not mount.
    #[error("mounting {} failed: {source}; this daemon runs with no_new_privs (systemd's NoNewPrivileges=, or a seccomp option such as SystemCallFilter= in a service run as a user, e.g. the drop-in no-mount.conf), so fusermount3, the setuid helper an ordinary user mounts with, has no privileges: remove that setting, or do not mount on this device", path.display())]
    NoNewPrivs {
        /// The mount point.
        path: PathBuf,
        /// What failed.
        source: io::Error,
    },
    /// Unmounting failed.
    #[error("unmounting {} failed: {source}", path.display())]
    Unmount {
        /// The mount point.
        path: PathBuf,
        /// What failed.
        source: io::Error,
    },
    /// Other users were asked in by a mount of an ordinary user, and fuse.conf does not
    /// allow it.
    #[error("letting other users into the mount (allow_other) as an ordinary user needs the line `user_allow_other` in {}; add it there (as root), or mount without allow_other", .0.display())]
    AllowOtherNotPermitted(PathBuf),
}

/// Where fusermount3 reads whether ordinary users may mount with `allow_other`.
pub const FUSE_CONF: &str = "/etc/fuse.conf";

/// Whether the text of fuse.conf lets ordinary users mount with `allow_other`: a line holding
/// `user_allow_other` alone (what follows a `#` is a comment), as fusermount3 reads it.
pub fn fuse_conf_allows_other(conf: &str) -> bool {
    conf.lines()
        .any(|l| l.split('#').next().unwrap_or("").trim() == "user_allow_other")
}

/// What a mount is doing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountInfo {
    /// Where it is mounted.
    pub mountpoint: PathBuf,
    /// The directory it shows.
    pub backing: PathBuf,
    /// Mounted read-only.
    pub read_only: bool,
    /// Other users than the mounting one may enter (`allow_other`, with the kernel checking
    /// modes).
    pub allow_other: bool,
    /// Reads and writes go through kernel passthrough (negotiated and not refused).
    pub passthrough: bool,
    /// Why not, when it is off.
    pub passthrough_off: Option<crate::PassthroughOff>,
    /// Open files (the mount keeps no directory handles).
    pub open_handles: usize,
    /// Inodes the kernel holds (the inode table's size).
    pub known_inodes: usize,
    /// Directory descriptors cached.
    pub cached_dirs: usize,
    /// Request threads (on `/dev/fuse`).
    pub threads: usize,
    /// Requests come over io_uring: FUSE_INIT agreed and every queue (one per CPU) is up.
    pub io_uring: bool,
    /// Invalidations queued for the kernel and not yet sent.
    pub invalidations_pending: usize,
}

/// The part of a mount the engine keeps: its [`Invalidator`] and [`WriterRegistry`].
/// Cheap to share; after the mount is gone it invalidates nothing and has no writers.
#[derive(Debug)]
pub struct MountHandle {
    sh: Arc<Shared>,
}

impl MountHandle {
    fn queue(&self, inval: Inval) {
        if let Some(tx) = lock(&self.sh.invalidations).as_ref() {
            // Counted before it is queued, so the count never misses a queued path.
            self.sh.invalidations_pending.fetch_add(1, Ordering::SeqCst);
            // Unbounded: never blocks. A closed queue means the mount is going away.
            if tx.send(inval).is_err() {
                self.sh.invalidations_pending.fetch_sub(1, Ordering::SeqCst);
            }
        }
    }
}

impl Invalidator for MountHandle {
    fn invalidate(&self, path: &RelPath) {
        self.queue(Inval {
            path: path.clone(),
            foreign_at: None,
        });
    }

    /// Skipped when the mount reported `path` as its own change within the last two seconds
    /// (`recent::RECENT`; a file being written through the mount renews it, `Shared::writing`),
    /// now or after a few milliseconds (the watcher may see the backing call before the request
    /// thread reports it); queued otherwise. So the kernel's long
    /// entry and attribute TTLs hold for what the mount did, and a program writing the replica
    /// directory is seen through the mount as soon as the watcher reports it. A change behind
    /// the mount's back to a path changed through it in the two seconds before is seen when
    /// the TTL ends.
    fn invalidate_foreign(&self, path: &RelPath) -> bool {
        let now = std::time::Instant::now();
        if lock(&self.sh.recent).was_told(path, now) {
            return false;
        }
        self.queue(Inval {
            path: path.clone(),
            foreign_at: Some(now),
        });
        true
    }
}

impl MountHandle {
    /// The node the kernel knows at `path`, if any.
    fn node_of(&self, path: &RelPath) -> Option<u64> {
        lock(&self.sh.table)
            .walk(path.components())
            .and_then(|(_, _, node)| node)
    }
}

impl WriterRegistry for MountHandle {
    fn has_writer(&self, path: &RelPath) -> bool {
        self.node_of(path)
            .is_some_and(|ino| self.sh.handles.has_writer(ino))
    }

    fn holds_inode(&self, inode: u64) -> bool {
        self.sh.handles.holds_backing(inode)
    }
}

/// A live mount. Unmounts on [`Mount::unmount`] or drop.
pub struct Mount {
    mountpoint: PathBuf,
    backing: PathBuf,
    threads: usize,
    allow_other: bool,
    io_uring: fuser::UringQueues,
    handle: Arc<MountHandle>,
    unmounter: Option<fuser::SessionUnmounter>,
    session: Option<JoinHandle<io::Result<()>>>,
    notifier: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Mount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mount")
            .field("mountpoint", &self.mountpoint)
            .field("backing", &self.backing)
            .finish_non_exhaustive()
    }
}

fn cpath(path: &Path) -> CString {
    // A path from the OS never holds a NUL; an empty one fails its syscall instead.
    CString::new(path.as_os_str().as_bytes()).unwrap_or_default()
}

fn os_err(e: sys::Errno) -> io::Error {
    io::Error::from_raw_os_error(e)
}

/// Checks `mountpoint` and returns its canonical path; detaches a dead mount there.
pub(crate) fn prepare_mountpoint(mountpoint: &Path) -> Result<PathBuf, MountError> {
    let c = cpath(mountpoint);
    // statfs, not stat: the kernel may still answer a stat of a dead FUSE mount from its
    // attribute cache, but it always asks the server for statfs.
    match sys::statfs_probe(&c) {
        Ok(_) => {}
        Err(libc::ENOENT) => return Err(MountError::MountPointMissing(mountpoint.into())),
        Err(e) if sys::is_dead_mount(e) => {
            warn!(mountpoint = %mountpoint.display(), "dead mount point (its daemon died); detaching it");
            crate::unmount::detach(mountpoint).map_err(|source| MountError::DeadMount {
                path: mountpoint.into(),
                source,
            })?;
        }
        Err(e) => {
            return Err(MountError::Inspect {
                path: mountpoint.into(),
                source: os_err(e),
            })
        }
    }
    let canonical = mountpoint
        .canonicalize()
        .map_err(|source| MountError::Inspect {
            path: mountpoint.into(),
            source,
        })?;
    let st = sys::stat_path(&cpath(&canonical)).map_err(|e| MountError::Inspect {
        path: mountpoint.into(),
        source: os_err(e),
    })?;
    if !st.is_dir() {
        return Err(MountError::NotADirectory(mountpoint.into()));
    }
    if st.mount_root {
        return Err(MountError::AlreadyMounted(mountpoint.into()));
    }
    let mut entries = std::fs::read_dir(&canonical).map_err(|source| MountError::Inspect {
        path: mountpoint.into(),
        source,
    })?;
    if entries.next().is_some() {
        return Err(MountError::NotEmpty(mountpoint.into()));
    }
    Ok(canonical)
}

/// Mounts `backing` (a folder's replica directory) at `mountpoint`, reporting every change
/// made through the mount to `sink`.
pub fn mount(
    backing: &Path,
    mountpoint: &Path,
    opts: MountOptions,
    sink: Arc<dyn ChangeSink>,
) -> Result<Mount, MountError> {
    let backing_err = |source| MountError::Backing {
        path: backing.into(),
        source,
    };
    let backing_abs = backing.canonicalize().map_err(backing_err)?;
    if opts.allow_other && sys::effective_ids().0 != 0 {
        let conf = std::fs::read_to_string(FUSE_CONF).unwrap_or_default();
        if !fuse_conf_allows_other(&conf) {
            return Err(MountError::AllowOtherNotPermitted(FUSE_CONF.into()));
        }
    }
    let mp = prepare_mountpoint(mountpoint)?;
    if mp.starts_with(&backing_abs) {
        return Err(MountError::Nested {
            mountpoint: mp,
            backing: backing_abs,
        });
    }
    let root = sys::open_dir_path(&cpath(&backing_abs)).map_err(|e| backing_err(os_err(e)))?;
    let root_st = sys::fstat(root.as_fd()).map_err(|e| backing_err(os_err(e)))?;
    let sh = shared(root, &root_st, &opts, sink);

    let threads = opts.n_threads.max(1);
    let config = session_config(&opts, threads);
    let mount_err = |source| MountError::Mount {
        path: mp.clone(),
        source,
    };
    let session = start_session(&sh, &mp, &config)?;
    // Once FUSE_INIT has agreed to io_uring the kernel holds every request until all queues
    // have registered (they start with the session's thread, within milliseconds). A queue
    // that cannot start would leave the mount hanging: end that connection and mount again
    // over /dev/fuse only.
    if session.io_uring.negotiated() && !session.io_uring.wait_serving(URING_START) {
        warn!(
            mountpoint = %mp.display(),
            "the io_uring queues did not start; mounting again with requests through /dev/fuse"
        );
        abandon_session(session, &mp);
        let sink = sh.sink.clone();
        drop(sh);
        let opts = MountOptions {
            io_uring: false,
            ..opts
        };
        return mount(backing, mountpoint, opts, sink);
    }
    let (tx, rx) = mpsc::channel();
    *lock(&sh.invalidations) = Some(tx);
    let notifier_thread = invalidate::spawn(sh.clone(), session.notifier, rx).map_err(mount_err);
    let mut m = Mount {
        mountpoint: mp,
        backing: backing_abs,
        threads,
        allow_other: opts.allow_other,
        io_uring: session.io_uring,
        handle: Arc::new(MountHandle { sh }),
        unmounter: Some(session.unmounter),
        session: Some(session.thread),
        notifier: None,
    };
    m.notifier = Some(notifier_thread?);
    info!(
        mountpoint = %m.mountpoint.display(),
        backing = %m.backing.display(),
        passthrough = m.handle.sh.passthrough.load(Ordering::Relaxed),
        io_uring = m.io_uring.serving(),
        "mounted"
    );
    Ok(m)
}

/// How long a mount waits for its io_uring queues to register.
const URING_START: Duration = Duration::from_secs(5);

/// Ends a session whose kernel connection no request can get through: aborts the connection
/// (fusectl), unmounts, and joins the session's thread if it ends.
fn abandon_session(session: Session, mp: &Path) {
    let aborted = connection_id(mp).is_some_and(|id| {
        std::fs::write(format!("/sys/fs/fuse/connections/{id}/abort"), "1").is_ok()
    });
    let mut unmounter = session.unmounter;
    if let Err(e) = unmounter.unmount() {
        warn!(mountpoint = %mp.display(), error = %e, "unmounting the abandoned session failed; detaching it");
        let _ = crate::unmount::detach(mp);
    }
    if aborted {
        let _ = session.thread.join();
    }
}

/// The FUSE connection id of the mount at `mp` (its device's minor number), read from
/// `/proc/self/mountinfo`: a `stat` of the mount point would be a request to the connection.
fn connection_id(mp: &Path) -> Option<u32> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let want = mp.to_str()?;
    info.lines().rev().find_map(|l| {
        let mut f = l.split(' ');
        let dev = f.nth(2)?;
        let point = f.nth(1)?;
        (point == want)
            .then(|| dev.split_once(':')?.1.parse().ok())
            .flatten()
    })
}

/// The state the request threads share, for the backing directory `root` (whose stat is
/// `root_st`).
fn shared(
    root: OwnedFd,
    root_st: &sys::Stat,
    opts: &MountOptions,
    sink: Arc<dyn ChangeSink>,
) -> Arc<Shared> {
    let (euid, egid) = sys::effective_ids();
    Arc::new(Shared {
        root: Arc::new(root),
        root_ino: root_st.ino,
        root_dev: root_st.dev,
        table: Mutex::new(Table::new()),
        dirs: DirCache::new(DIR_CACHE),
        handles: Handles::new(),
        sink,
        ttl: opts.ttl,
        read_only: opts.read_only,
        want_passthrough: opts.passthrough,
        want_io_uring: opts.io_uring,
        passthrough: AtomicBool::new(false),
        passthrough_off: Mutex::new(None),
        euid,
        egid,
        invalidations: Mutex::new(None),
        invalidations_pending: AtomicUsize::new(0),
        prefetch: Prefetcher::start(opts.read_ahead),
        recent: Mutex::new(Recent::default()),
        kept: Default::default(),
        keep_cache: opts.keep_cache,
        want_write_direct: opts.write_direct,
        write_direct: AtomicBool::new(false),
        content: opts.content.clone(),
    })
}

/// The FUSE session's mount options and threads.
fn session_config(opts: &MountOptions, threads: usize) -> fuser::Config {
    let mut options = vec![
        fuser::MountOption::FSName("meshfs".into()),
        fuser::MountOption::Subtype("meshfs".into()),
        fuser::MountOption::NoSuid,
        fuser::MountOption::NoDev,
    ];
    if opts.allow_other {
        // Other users' requests run with this process's identity on the backing: the
        // kernel must check them against the modes we report (it knows the caller's
        // supplementary groups; FUSE requests do not carry them).
        options.push(fuser::MountOption::DefaultPermissions);
    }
    if opts.read_only {
        options.push(fuser::MountOption::RO);
    }
    let mut config = fuser::Config::default();
    config.mount_options = options;
    config.acl = if opts.allow_other {
        fuser::SessionACL::All
    } else {
        fuser::SessionACL::Owner
    };
    config.n_threads = Some(threads);
    config.clone_fd = true;
    config
}

/// A FUSE session, mounted and served.
struct Session {
    /// The thread that serves it.
    thread: JoinHandle<io::Result<()>>,
    unmounter: fuser::SessionUnmounter,
    /// For the invalidation thread.
    notifier: fuser::Notifier,
    /// The io_uring queues, if FUSE_INIT agreed to them.
    io_uring: fuser::UringQueues,
}

/// Mounts at `mp` and starts the session's thread. If the thread cannot start, the session is
/// unmounted again.
fn start_session(
    sh: &Arc<Shared>,
    mp: &Path,
    config: &fuser::Config,
) -> Result<Session, MountError> {
    let mount_err = |source| MountError::Mount {
        path: mp.into(),
        source,
    };
    let mut session =
        fuser::Session::new(Passthrough::new(sh.clone()), mp, config).map_err(|source| {
            if sys::effective_ids().0 != 0 && sys::no_new_privs() {
                MountError::NoNewPrivs {
                    path: mp.into(),
                    source,
                }
            } else {
                mount_err(source)
            }
        })?;
    // FUSE_INIT is answered: what passthrough would meet is known before the first open.
    if sh.passthrough.load(Ordering::Relaxed) {
        if let Err(why) = crate::passthrough::probe(session.as_fd(), sh.root.as_fd()) {
            sh.passthrough_refused(why);
        }
    }
    let notifier = session.notifier();
    let io_uring = session.io_uring_queues();
    let mut unmounter = session.unmount_callable();
    let session_thread = std::thread::Builder::new()
        .name("meshfs-fuse".into())
        .spawn(move || session.run());
    match session_thread {
        Ok(thread) => Ok(Session {
            thread,
            unmounter,
            notifier,
            io_uring,
        }),
        Err(e) => {
            let _ = unmounter.unmount();
            Err(mount_err(e))
        }
    }
}

impl Mount {
    /// What the mount is doing.
    pub fn info(&self) -> MountInfo {
        let sh = &self.handle.sh;
        MountInfo {
            mountpoint: self.mountpoint.clone(),
            backing: self.backing.clone(),
            read_only: sh.read_only,
            allow_other: self.allow_other,
            passthrough: sh.passthrough.load(Ordering::Relaxed),
            passthrough_off: *lock(&sh.passthrough_off),
            open_handles: sh.handles.count(),
            known_inodes: lock(&sh.table).len(),
            cached_dirs: sh.dirs.len(),
            threads: self.threads,
            io_uring: self.io_uring.serving(),
            invalidations_pending: sh.invalidations_pending.load(Ordering::SeqCst),
        }
    }

    /// The engine's side of the mount: invalidations and the writer registry.
    pub fn handle(&self) -> Arc<MountHandle> {
        self.handle.clone()
    }

    /// Unmounts. A busy mount (an open file, a process inside it) is detached: it vanishes
    /// from the mount point now and its last users are served until they leave.
    pub fn unmount(mut self) -> Result<(), MountError> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Result<(), MountError> {
        let Some(session) = self.session.take() else {
            return Ok(());
        };
        // Ends the notifier thread once its queue drains.
        lock(&self.handle.sh.invalidations).take();
        let mut detached = false;
        let mut result = Ok(());
        if let Some(mut unmounter) = self.unmounter.take() {
            // As an ordinary user fuser's unmount detaches (`fusermount3 -u -z`) even a busy
            // mount and reports success: the session would then be joined while its last users
            // hold it. Ask fusermount3 for a plain unmount first, which says busy.
            let user = sys::effective_ids().0 != 0;
            let first = if user {
                match crate::unmount::unmount_as_user(&self.mountpoint) {
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(()),
                    other => other,
                }
            } else {
                Ok(())
            };
            match first.and_then(|()| unmounter.unmount()) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                    info!(mountpoint = %self.mountpoint.display(), "mount busy; detaching it");
                    match crate::unmount::detach(&self.mountpoint) {
                        Ok(()) => detached = true,
                        Err(source) => {
                            result = Err(MountError::Unmount {
                                path: self.mountpoint.clone(),
                                source,
                            })
                        }
                    }
                }
                // Already unmounted (by `umount` from outside, or the connection aborted).
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
                Err(source) => {
                    result = Err(MountError::Unmount {
                        path: self.mountpoint.clone(),
                        source,
                    })
                }
            }
        }
        if result.is_ok() && !detached {
            match session.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => warn!(error = %e, "FUSE session ended with an error"),
                Err(_) => warn!("FUSE session thread panicked"),
            }
        }
        // Otherwise the session thread is left to serve the detached mount's last users.
        if let Some(n) = self.notifier.take() {
            let _ = n.join();
        }
        result
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            warn!(error = %e, "unmount on drop failed");
        }
    }
}

impl Invalidator for Mount {
    fn invalidate(&self, path: &RelPath) {
        self.handle.invalidate(path)
    }
}

impl WriterRegistry for Mount {
    fn has_writer(&self, path: &RelPath) -> bool {
        self.handle.has_writer(path)
    }

    fn holds_inode(&self, inode: u64) -> bool {
        self.handle.holds_inode(inode)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fuse_conf_allows_other_users_only_with_user_allow_other_on_a_line_of_its_own() {
        let debian = "# user_allow_other - Using the allow_other mount option...\n#user_allow_other\n\n#mount_max = 1000\n";
        assert!(!fuse_conf_allows_other(debian));
        assert!(!fuse_conf_allows_other(""));
        assert!(fuse_conf_allows_other(
            "mount_max = 10\n  user_allow_other  \n"
        ));
        assert!(fuse_conf_allows_other("user_allow_other # for samba\n"));
        assert!(!fuse_conf_allows_other("user_allow_other_not\n"));
    }
}
