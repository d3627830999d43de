//! The replica store: the only code that writes into a replica directory.
//!
//! **Architecture invariant:** every user file always has either its old or its new content.
//! A remote version is written to a temp file (`.meshfs-tmp-*`) chunk by chunk, each chunk
//! verified against its blake3 before it is written (by `peers::open_chunk` for chunks from a
//! peer, by [`Store::copy_chunks_in`] for chunks copied from local files); the temp file must be
//! covered exactly (bytes written = its size) and the record's hash is the one its chunk list
//! gives (`FileRecord::validate`), so the file is the version's content without being read
//! again. It is then made durable, and only then renamed over the target, after checking that
//! the target is still the version the journal expects to replace.
//!
//! Temp files live in the folder's *staging directory* (outside the replica, in the daemon's
//! state, on the same filesystem) so that the watcher, the user and other programs watching
//! the folder never see them: an applied file costs the watcher one event (its final rename)
//! instead of six. Where the staging directory is on another filesystem than a target's
//! directory (a rename could not cross), the temp file is made in the target's directory.
//!
//! A temp file that stays open until it is installed is made *unnamed* where the filesystem
//! allows (`O_TMPFILE` in the staging directory) and is given its one name by `linkat` at
//! install. Compared with a named temp file and a rename, that skips two entries of the
//! staging directory (its insert and its removal), the contention of the thread creating the
//! next batch's temp files with the one installing this batch on that directory's lock, and the
//! filesystem-wide lock a cross-directory rename takes. A crash leaves nothing to clean up: an
//! unnamed file is freed when its last descriptor closes (on a filesystem without a journal,
//! by the next `fsck`).
//!
//! **Architecture invariant:** incoming paths never escape the replica. Every path is a
//! validated [`RelPath`] (no `..`, never `.meshfs*`), and parents are walked one component at
//! a time with `openat(O_NOFOLLOW | O_DIRECTORY)`, so a symlink planted in a parent component
//! is refused instead of followed.
//!
//! Durability is batched (docs/design.md, "Safe apply"): [`Store::install`] makes a whole batch of temp files
//! durable with one `syncfs`, renames them, then fsyncs each touched directory once.

mod displace;
mod fresh;
mod placeholder;

pub use fresh::Fresh;

use crate::failpoint;
use crate::room::Claim;
use displace::{same_version, Keeper, Old, Verdict};
pub use displace::{Displaced, DisplacedSink};
use meshfs_protocol::{FileKind, Hash, RelPath, ShortId, INTERNAL_PREFIX, MODE_SYNC_MASK};
use meshfs_sys as sys;
pub use placeholder::placeholder_of;
use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Name prefix of the store's temp files (inside [`INTERNAL_PREFIX`], so never replicated).
pub const TEMP_PREFIX: &str = ".meshfs-tmp-";

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A parent component is a symlink or not a directory: the path would leave the replica.
    #[error("{0}: a parent component is a symlink or not a directory; refusing to follow it")]
    Escape(RelPath),
    /// The target changed since the journal last saw it; the apply stopped.
    #[error(
        "{0}: changed on disk since it was last scanned; the change will be reconciled instead"
    )]
    Changed(RelPath),
    /// Another program has the target open for writing: the remote version waits until it
    /// is closed (the store's read lease on the file is refused, [`displace`]).
    #[error(
        "{0}: open for writing by another program; the remote version waits until it is closed"
    )]
    Busy(RelPath),
    /// A temp file's chunks do not cover its size.
    #[error("{path}: {written} bytes written of {size}")]
    Incomplete {
        /// Which file.
        path: RelPath,
        /// Bytes written.
        written: u64,
        /// The version's size.
        size: u64,
    },
    /// Read content does not hash to what the record says.
    #[error("{path}: content hashes to {got}, expected {want}")]
    Verify {
        /// Which file.
        path: RelPath,
        /// What was written.
        got: Hash,
        /// What the record promises.
        want: Hash,
    },
    /// A directory to be removed still holds entries.
    #[error("{0}: directory not empty")]
    NotEmpty(RelPath),
    /// An operating-system error.
    #[error("{path}: {source}")]
    Io {
        /// Which path.
        path: String,
        /// What happened.
        source: io::Error,
    },
}

impl StoreError {
    /// The disk (or the user's quota) is full.
    pub fn is_disk_full(&self) -> bool {
        matches!(self, StoreError::Io { source, .. }
            if matches!(source.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT)))
    }
}

fn io_err(path: impl ToString, source: io::Error) -> StoreError {
    StoreError::Io {
        path: path.to_string(),
        source,
    }
}

/// What meshfs knows about the file on disk that backs a record: the store reads it with
/// every stat, the scanner compares it to find changes, the journal keeps it per record.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct LocalStat {
    /// Inode number.
    pub inode: u64,
    /// Size in bytes.
    pub size: u64,
    /// Modification time, ns since the Unix epoch.
    pub mtime_ns: i64,
    /// Status change time, ns since the Unix epoch.
    pub ctime_ns: i64,
    /// `st_mode` (type and permission bits).
    pub mode: u32,
}

/// What an apply expects to find at the target before replacing it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// Nothing is there.
    Absent,
    /// The file the journal knows (same inode, size and mtime).
    Matches(LocalStat),
    /// Don't check (used for conflict siblings whose name was checked by the reconciler).
    Anything,
}

/// A file's metadata as the store sees it (never following a final symlink).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stat {
    /// What it is, or `None` for special files (fifo, socket, device).
    pub kind: Option<FileKind>,
    /// Inode, size, times, permission bits.
    pub local: LocalStat,
    /// Names the inode has (`st_nlink`): a file with more than one is a hard link.
    pub nlink: u64,
}

/// The store of one replica directory.
#[derive(Debug)]
pub struct Store {
    root: PathBuf,
    root_fd: OwnedFd,
    staging: Option<Staging>,
    /// Files an apply replaced or removed, kept aside a while ([`displace`]).
    keeper: Keeper,
    /// Permission bits a remote version never gets here ([`Store::local_mode`]).
    umask: std::sync::atomic::AtomicU32,
    /// The filesystem temp files are made on ([`Store::temp_place`]), from the stat of the
    /// descriptor they are made through; `None` if it could not be read.
    temp_place: Option<crate::room::Place>,
    /// Small files' content as the scan read it, for the index batch that announces them.
    fresh: Fresh,
}

pub use crate::config::DEFAULT_UMASK;

/// The directory temp files are assembled in, when it is outside the replica.
#[derive(Debug)]
struct Staging {
    path: PathBuf,
    fd: Arc<OwnedFd>,
    /// Its filesystem: temp files are staged only for targets on the same one.
    dev: u64,
    /// How an unnamed temp file made here gets a name, if it can (probed at open).
    link: Option<LinkVia>,
}

/// How an unnamed (`O_TMPFILE`) file is given a name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LinkVia {
    /// `linkat(fd, "", ..., AT_EMPTY_PATH)`: needs `CAP_DAC_READ_SEARCH` on older kernels.
    EmptyPath,
    /// `linkat("/proc/self/fd/N", ..., AT_SYMLINK_FOLLOW)`: needs `/proc`.
    ProcFd,
}

/// Directories opened during one batch of work (an apply), by path (`None`: the root), so
/// that each is walked to once rather than once per file. Only for a short-lived batch: a
/// cached descriptor keeps pointing at the directory it opened even if that is later moved.
/// A descriptor is shared with whoever walked to it, so it stays open as long as either uses it.
#[derive(Default)]
pub struct DirCache {
    dirs: HashMap<Option<RelPath>, Arc<OwnedFd>>,
    /// The filesystem of each directory that got a temp file.
    devs: HashMap<Option<RelPath>, u64>,
}

/// A remote version being assembled in a temp file next to its target.
#[derive(Debug)]
pub struct TempFile {
    /// The path it will be installed at.
    pub target: RelPath,
    name: CString,
    file: Option<File>,
    /// It lives in the staging directory (else in the target's directory).
    staged: bool,
    /// Bytes written into it so far (chunks never overlap, so the file is covered when this
    /// reaches its size).
    written: u64,
    /// `written` when writeback of its dirty pages was last started.
    flushing_from: u64,
    /// The disk room promised to its content ([`crate::room`]): what is written into it is
    /// let go of as it is written.
    claim: Option<Arc<Claim>>,
    /// What it replaces is the same version (its content fetched over a placeholder, or a
    /// placeholder evicting it, D92–D93): the old file is not handed over as a version that
    /// leaves ([`Store::on_displaced`]).
    pub same_version: bool,
    /// An unnamed temp file's stat once [`Store::finish_temp`] has given it its mode and
    /// times: nothing else can reach it before its install, which journals this stat.
    finished: Option<LocalStat>,
}

impl TempFile {
    /// It has no name (`O_TMPFILE`, and `name` is empty): `file` is its only handle and is
    /// never closed before the install.
    fn unnamed(&self) -> bool {
        self.name.is_empty()
    }

    /// Its content's disk room: written bytes let go of it.
    pub fn set_claim(&mut self, claim: Arc<Claim>) {
        self.claim = Some(claim);
    }

    /// `n` more bytes were written into it.
    fn wrote(&mut self, n: u64) {
        self.written += n;
        if let Some(c) = &self.claim {
            c.written(n);
        }
    }
}

/// One chunk of a temp file to copy from local files ([`Store::copy_chunks_in`]).
#[derive(Debug, Clone)]
pub struct LocalCopy {
    /// Where it goes in the temp file.
    pub offset: u64,
    /// What it must hash to.
    pub hash: Hash,
    /// Its length.
    pub len: u32,
    /// Files of the replica, with the chunk's offset in each, that should hold it (tried in
    /// order until one verifies); shared by every place of the same chunk.
    pub sources: Arc<Vec<(RelPath, u64)>>,
}

/// From this size on, a temp file gets its blocks before it is written
/// ([`Store::preallocate_temp`]); below, the `fallocate` call would cost about what it saves.
pub const PREALLOCATE_FROM: u64 = 1 << 20;

/// From this many files on, [`Store::install_synced_in`] installs on two threads.
const PARALLEL_INSTALL_FROM: usize = 64;

/// From this many chunks on, [`Store::copy_chunks_in`] verifies and writes on two threads.
const PARALLEL_COPY_FROM: usize = 64;

/// Starts writing a temp file's dirty pages out once [`WRITEBACK_EVERY`] more bytes were
/// written into it since the last start.
fn start_writeback(t: &mut TempFile) {
    if t.written - t.flushing_from < WRITEBACK_EVERY {
        return;
    }
    if let Some(f) = &t.file {
        // Only a hint: the durability step (`sync_temps`) still flushes the whole file, so a
        // failure here loses nothing.
        let _ = sys::sync_file_range(f.as_fd(), 0, 0, libc::SYNC_FILE_RANGE_WRITE);
    }
    t.flushing_from = t.written;
}

/// Every this many bytes written into a temp file, the kernel is asked to start writing its
/// dirty pages out (without waiting): the flush that makes it durable before its rename then
/// has only the last few MiB left, instead of the whole file after the whole transfer.
const WRITEBACK_EVERY: u64 = 8 << 20;

fn open_path_dir(path: &Path) -> Result<OwnedFd, StoreError> {
    let c = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| io_err(path.display(), io::Error::from(io::ErrorKind::InvalidInput)))?;
    sys::openat(sys::cwd(), &c, libc::O_RDONLY | libc::O_DIRECTORY, 0)
        .map_err(|e| io_err(path.display(), e))
}

fn fstat_dev(fd: BorrowedFd<'_>) -> io::Result<u64> {
    sys::fstat(fd).map(|st| st.st_dev)
}

fn cstr(s: &str) -> Result<CString, StoreError> {
    CString::new(s).map_err(|_| io_err(s, io::Error::from(io::ErrorKind::InvalidInput)))
}

/// What `name` in `dir` is, never following a final symlink.
fn lstat_at(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<libc::stat> {
    sys::fstatat(dir, name, libc::AT_SYMLINK_NOFOLLOW)
}

/// Converts a `stat` into the store's view.
pub fn stat_of(st: &libc::stat) -> Stat {
    let kind = match st.st_mode & libc::S_IFMT {
        libc::S_IFREG => Some(FileKind::File),
        libc::S_IFDIR => Some(FileKind::Dir),
        libc::S_IFLNK => Some(FileKind::Symlink),
        _ => None,
    };
    Stat {
        kind,
        local: LocalStat {
            inode: st.st_ino,
            size: st.st_size as u64,
            mtime_ns: st.st_mtime * 1_000_000_000 + st.st_mtime_nsec,
            ctime_ns: st.st_ctime * 1_000_000_000 + st.st_ctime_nsec,
            mode: st.st_mode & MODE_SYNC_MASK,
        },
        nlink: st.st_nlink,
    }
}

fn random_suffix() -> String {
    format!("{:016x}", rand::random::<u64>())
}

impl Store {
    /// Opens the replica at `root` (created if missing); temp files are made next to their
    /// targets.
    pub fn open(root: &Path) -> Result<Store, StoreError> {
        std::fs::create_dir_all(root).map_err(|e| io_err(root.display(), e))?;
        sys::ignore_sigio();
        let root_fd = open_path_dir(root)?;
        let temp_place = fstat_dev(root_fd.as_fd())
            .ok()
            .map(|dev| crate::room::Place::on(dev, root));
        Ok(Store {
            root: root.to_path_buf(),
            root_fd,
            staging: None,
            keeper: Keeper::default(),
            umask: std::sync::atomic::AtomicU32::new(DEFAULT_UMASK),
            temp_place,
            fresh: Fresh::default(),
        })
    }

    /// Small files' content as the scan read it ([`Fresh`], D113).
    pub fn fresh(&self) -> &Fresh {
        &self.fresh
    }

    /// Opens the replica at `root` with `staging` (created if missing; it must not be inside
    /// the replica) as the directory temp files are assembled in. If `staging` cannot be used
    /// (another filesystem, not creatable), temp files are made next to their targets.
    pub fn open_staged(root: &Path, staging: &Path) -> Result<Store, StoreError> {
        let mut store = Store::open(root)?;
        let staged = std::fs::create_dir_all(staging)
            .map_err(|e| io_err(staging.display(), e))
            .and_then(|()| open_path_dir(staging))
            .and_then(|fd| {
                let dev = fstat_dev(fd.as_fd()).map_err(|e| io_err(staging.display(), e))?;
                let root_dev =
                    fstat_dev(store.root_fd.as_fd()).map_err(|e| io_err(root.display(), e))?;
                Ok((fd, dev, root_dev))
            });
        match staged {
            Ok((fd, dev, root_dev)) if dev == root_dev => {
                let link = probe_unnamed(fd.as_fd());
                store.temp_place = Some(crate::room::Place::on(dev, staging));
                store.staging = Some(Staging {
                    path: staging.to_path_buf(),
                    fd: Arc::new(fd),
                    dev,
                    link,
                })
            }
            Ok(_) => tracing::info!(
                replica = %root.display(),
                staging = %staging.display(),
                "staging directory is on another filesystem; temp files go next to their targets"
            ),
            Err(e) => tracing::warn!(
                replica = %root.display(),
                error = %e,
                "no staging directory; temp files go next to their targets"
            ),
        }
        Ok(store)
    }

    /// The replica directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The filesystem temp files are written on (the staging directory's, else the
    /// replica's): where a remote version's content needs its room. Known since the store was
    /// opened, from the descriptor temp files are made through (not a stat of its path for
    /// each record an apply decides: 2 % of a receiver's samples in a first sync of 10,000
    /// small files).
    pub fn temp_place(&self) -> Option<&crate::room::Place> {
        self.temp_place.as_ref()
    }

    /// Sets the permission bits remote versions never get here (owner bits are not taken:
    /// see [`Store::local_mode`]).
    pub fn set_umask(&self, umask: u32) {
        self.umask
            .store(umask & 0o077, std::sync::atomic::Ordering::Relaxed);
    }

    /// The mode a record's `mode` gets on disk here: the folder's umask taken off (a peer's
    /// world-writable directory would let any local user add files that then sync
    /// everywhere), and never less than meshfs needs to go on reading and applying the path:
    /// a directory is the owner's `rwx`, a file readable by its owner (a directory of mode
    /// 000 from a peer would fail every record below it, a file of mode 000 every later
    /// version of it). The record keeps the mode as sent ([`Store::same_mode`]).
    pub fn local_mode(&self, mode: u32, kind: FileKind) -> u32 {
        let umask = self.umask.load(std::sync::atomic::Ordering::Relaxed);
        let least = match kind {
            FileKind::Dir => 0o700,
            _ => 0o400,
        };
        (mode | least) & !umask & MODE_SYNC_MASK
    }

    /// Whether a path whose record says `record` and whose disk says `disk` shows no local
    /// change of mode: the same bits, or those [`Store::local_mode`] gives the record here
    /// (what the umask took or the owner's bits added is not an edit to send back).
    pub fn same_mode(&self, record: u32, disk: u32, kind: FileKind) -> bool {
        record == disk || self.local_mode(record, kind) == disk
    }

    /// Names the conflict copies this store keeps of local writes that raced an apply after
    /// this device (`by`, its short id).
    pub fn set_device(&self, by: ShortId) {
        self.keeper.set_device(by);
    }

    /// Hands every regular file an apply replaces or removes to `sink` as it is kept aside
    /// (the content of a version leaving the tree: `crate::versions` keeps what it needs of
    /// it). Set once, before the folder's first apply.
    pub fn on_displaced(&self, sink: DisplacedSink) {
        self.keeper.on_displaced(sink);
    }

    /// Looks now at every file an apply kept aside, instead of after its grace period (a
    /// stopping daemon, tests).
    pub fn settle_displaced(&self) {
        self.keeper.settle_all();
    }

    /// Whether another program has the file at `path` open for writing (then a remote version
    /// of it waits, as it does for a writer through the mount). `false` when nothing can be
    /// told (no such regular file, no leases on this filesystem).
    pub fn open_for_writing(&self, path: &RelPath) -> bool {
        self.open_for_writing_in(&mut DirCache::default(), path)
    }

    /// [`Store::open_for_writing`] walking to the parent through `cache` (an apply asks this
    /// of every file it writes: one directory walk per directory, not per file).
    pub fn open_for_writing_in(&self, cache: &mut DirCache, path: &RelPath) -> bool {
        let Ok((dir, name)) = self.parent_and_name_in(cache, path, false) else {
            return false;
        };
        displace::open_for_writing(&*dir, &name)
    }

    /// Opens the directory `dir` (None: the root) without following symlinks, creating
    /// missing components when `create` is set.
    fn open_dir(&self, dir: Option<&RelPath>, create: bool) -> Result<Arc<OwnedFd>, StoreError> {
        let mut cache = DirCache::default();
        self.dir_in(&mut cache, dir, create)?;
        cache.dirs.remove(&dir.cloned()).ok_or_else(|| {
            io_err(
                self.root.display(),
                io::Error::from(io::ErrorKind::NotFound),
            )
        })
    }

    fn parent_and_name(
        &self,
        path: &RelPath,
        create: bool,
    ) -> Result<(Arc<OwnedFd>, CString), StoreError> {
        self.parent_and_name_in(&mut DirCache::default(), path, create)
    }

    /// [`Store::parent_and_name`] walking to the parent through `cache`.
    fn parent_and_name_in(
        &self,
        cache: &mut DirCache,
        path: &RelPath,
        create: bool,
    ) -> Result<(Arc<OwnedFd>, CString), StoreError> {
        let fd = self.dir_in(cache, path.parent().as_ref(), create)?;
        Ok((fd, cstr(path.file_name())?))
    }

    /// What is at `path` now (`None` if nothing), without following a final symlink.
    pub fn stat(&self, path: &RelPath) -> Result<Option<Stat>, StoreError> {
        self.stat_in(&mut DirCache::default(), path)
    }

    /// [`Store::stat`] walking to the parent through `cache`.
    pub fn stat_in(
        &self,
        cache: &mut DirCache,
        path: &RelPath,
    ) -> Result<Option<Stat>, StoreError> {
        let dir = match self.dir_in(cache, path.parent().as_ref(), false) {
            Ok(fd) => fd,
            Err(StoreError::Io { source, .. }) if source.raw_os_error() == Some(libc::ENOENT) => {
                return Ok(None)
            }
            Err(StoreError::Escape(_)) => return Ok(None),
            Err(e) => return Err(e),
        };
        match lstat_at(dir.as_fd(), &cstr(path.file_name())?) {
            Ok(st) => Ok(Some(stat_of(&st))),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
            Err(e) => Err(io_err(path, e)),
        }
    }

    /// [`Store::open_file`] walking to the parent through `cache`.
    pub fn open_file_in(&self, cache: &mut DirCache, path: &RelPath) -> Result<File, StoreError> {
        let dir = self.dir_in(cache, path.parent().as_ref(), false)?;
        let name = cstr(path.file_name())?;
        let flags = libc::O_RDONLY | libc::O_NOFOLLOW;
        // Reading a file to sync it is not the user's access: its access time stays (a mail
        // reader's "new mail" is atime older than mtime; a scan would clear it on every file,
        // and dirty every inode it read). The flag needs the file's owner (or CAP_FOWNER): a
        // file of another user in the folder is read as before.
        let fd = match sys::openat(dir.as_fd(), &name, flags | libc::O_NOATIME, 0) {
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
                sys::openat(dir.as_fd(), &name, flags, 0)
            }
            r => r,
        }
        .map_err(|e| io_err(path, e))?;
        Ok(File::from(fd))
    }

    /// Opens a regular file for reading (never through a symlink), leaving its access time.
    pub fn open_file(&self, path: &RelPath) -> Result<File, StoreError> {
        self.open_file_in(&mut DirCache::default(), path)
    }

    /// Reads `len` bytes at `offset` of `path` (walking to its directory through `cache`) and
    /// checks they hash to `hash`.
    pub fn read_chunk_in(
        &self,
        cache: &mut DirCache,
        path: &RelPath,
        offset: u64,
        len: u32,
        hash: &Hash,
    ) -> Result<Vec<u8>, StoreError> {
        let f = self.open_file_in(cache, path)?;
        read_chunk_of(&f, path, offset, len, hash)
    }

    /// Reads a symlink's target.
    pub fn read_link(&self, path: &RelPath) -> Result<String, StoreError> {
        let (dir, name) = self.parent_and_name(path, false)?;
        let mut buf = vec![0u8; 4096];
        let n = sys::readlinkat(dir.as_fd(), &name, &mut buf).map_err(|e| io_err(path, e))?;
        buf.truncate(n);
        String::from_utf8(buf)
            .map_err(|_| io_err(path, io::Error::from(io::ErrorKind::InvalidData)))
    }

    /// Opens directory `dir` through `cache`: each directory is walked to (without following
    /// symlinks) once per cache, from its nearest cached ancestor.
    fn dir_in(
        &self,
        cache: &mut DirCache,
        dir: Option<&RelPath>,
        create: bool,
    ) -> Result<Arc<OwnedFd>, StoreError> {
        let key = dir.cloned();
        if let Some(fd) = cache.dirs.get(&key) {
            return Ok(Arc::clone(fd));
        }
        let fd = match dir {
            None => sys::openat(
                self.root_fd.as_fd(),
                c".",
                libc::O_RDONLY | libc::O_DIRECTORY,
                0,
            )
            .map_err(|e| io_err(self.root.display(), e))?,
            Some(d) => {
                let parent = self.dir_in(cache, d.parent().as_ref(), create)?;
                let c = cstr(d.file_name())?;
                let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW;
                let escape = |e: io::Error| match e.raw_os_error() {
                    Some(libc::ELOOP) | Some(libc::ENOTDIR) => StoreError::Escape(d.clone()),
                    _ => io_err(d, e),
                };
                match sys::openat(parent.as_fd(), &c, flags, 0) {
                    Ok(fd) => fd,
                    Err(e) if e.raw_os_error() == Some(libc::ENOENT) && create => {
                        match sys::mkdirat(parent.as_fd(), &c, 0o755) {
                            Ok(()) => {}
                            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
                            Err(e) => return Err(io_err(d, e)),
                        }
                        sys::openat(parent.as_fd(), &c, flags, 0).map_err(escape)?
                    }
                    Err(e) => return Err(escape(e)),
                }
            }
        };
        let fd = Arc::new(fd);
        cache.dirs.insert(key, Arc::clone(&fd));
        Ok(fd)
    }

    /// Starts a temp file for a new version of `target` (parents are created as needed).
    pub fn create_temp(&self, target: &RelPath) -> Result<TempFile, StoreError> {
        self.create_temp_in(&mut DirCache::default(), target, false)
    }

    /// [`Store::create_temp`] walking to the parent through `cache`. With `kept_open` (the
    /// caller will not close it before the install), the temp file is unnamed where the
    /// staging directory allows: [`Store::close_temp`] then leaves it open.
    pub fn create_temp_in(
        &self,
        cache: &mut DirCache,
        target: &RelPath,
        kept_open: bool,
    ) -> Result<TempFile, StoreError> {
        let parent = target.parent();
        let dir = self.dir_in(cache, parent.as_ref(), true)?;
        let staged = match &self.staging {
            None => false,
            Some(s) => {
                let dev = match cache.devs.get(&parent) {
                    Some(d) => *d,
                    None => {
                        let d = fstat_dev(dir.as_fd()).map_err(|e| io_err(target, e))?;
                        cache.devs.insert(parent, d);
                        d
                    }
                };
                dev == s.dev
            }
        };
        let at = self.staging_fd(staged).unwrap_or(dir.as_fd());
        if kept_open && staged && self.staging.as_ref().is_some_and(|s| s.link.is_some()) {
            let flags = libc::O_RDWR | libc::O_TMPFILE;
            match sys::openat(at, c".", flags, 0o600) {
                Ok(fd) => {
                    return Ok(TempFile {
                        target: target.clone(),
                        name: CString::default(),
                        file: Some(File::from(fd)),
                        staged,
                        written: 0,
                        flushing_from: 0,
                        claim: None,
                        same_version: false,
                        finished: None,
                    })
                }
                // Out of space or descriptors is an error; anything else, a named file.
                Err(e) if matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EMFILE)) => {
                    return Err(io_err(target, e))
                }
                Err(_) => {}
            }
        }
        let name = cstr(&format!("{TEMP_PREFIX}{}", random_suffix()))?;
        let fd = sys::openat(
            at,
            &name,
            libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW,
            0o600,
        )
        .map_err(|e| io_err(target, e))?;
        Ok(TempFile {
            target: target.clone(),
            name,
            file: Some(File::from(fd)),
            staged,
            written: 0,
            flushing_from: 0,
            claim: None,
            same_version: false,
            finished: None,
        })
    }

    /// The staging directory's descriptor, for a temp file that is `staged` there.
    fn staging_fd(&self, staged: bool) -> Option<BorrowedFd<'_>> {
        self.staging
            .as_ref()
            .filter(|_| staged)
            .map(|s| s.fd.as_fd())
    }

    /// Runs `f` with the directory descriptor `t` lives in.
    fn in_temp_dir<R>(
        &self,
        t: &TempFile,
        f: impl FnOnce(BorrowedFd<'_>) -> Result<R, StoreError>,
    ) -> Result<R, StoreError> {
        match self.staging_fd(t.staged) {
            Some(fd) => f(fd),
            None => {
                let (dir, _) = self.parent_and_name(&t.target, false)?;
                f(dir.as_fd())
            }
        }
    }

    /// Re-opens a temp file whose handle was closed (to bound open descriptors).
    fn temp_handle(&self, t: &TempFile, write: bool) -> Result<File, StoreError> {
        if t.unnamed() {
            // Never closed before the install (close_temp leaves it open), so never re-opened.
            return match &t.file {
                Some(f) => f.try_clone().map_err(|e| io_err(&t.target, e)),
                None => Err(io_err(&t.target, io::Error::from_raw_os_error(libc::EBADF))),
            };
        }
        let flags = if write {
            libc::O_WRONLY
        } else {
            libc::O_RDONLY
        };
        self.in_temp_dir(t, |dir| {
            let fd = sys::openat(dir, &t.name, flags | libc::O_NOFOLLOW, 0)
                .map_err(|e| io_err(&t.target, e))?;
            Ok(File::from(fd))
        })
    }

    /// The temp file `t`'s descriptor for writing, opened again if it was closed.
    fn writable<'t>(&self, t: &'t mut TempFile) -> Result<&'t File, StoreError> {
        let f = match t.file.take() {
            Some(f) => f,
            None => self.temp_handle(t, true)?,
        };
        Ok(t.file.insert(f))
    }

    /// Gives the temp file `t` the disk blocks of its `size` bytes before its content is
    /// written (`fallocate` keeping its size, so only written bytes count as its content),
    /// from [`PREALLOCATE_FROM`] bytes on. Buffered writes into blocks a file already has skip
    /// the filesystem's per-page reservation of delayed allocation: on ext4 a third less CPU in
    /// the writes of a large file (D115). A full disk is an error now, before anything was
    /// received; a filesystem without `fallocate` is written as before.
    pub fn preallocate_temp(&self, t: &mut TempFile, size: u64) -> Result<(), StoreError> {
        if size < PREALLOCATE_FROM {
            return Ok(());
        }
        let f = self.writable(t)?;
        match sys::preallocate(f.as_fd(), size.min(i64::MAX as u64) as i64) {
            Ok(()) => {
                // The blocks are taken from the disk's free space now: the room promised to
                // this file is let go of at once (its writes then let go of nothing more), or
                // it would count twice against every other claim until the file was written.
                if let Some(c) = &t.claim {
                    c.written(size);
                }
                Ok(())
            }
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) => {
                Err(io_err(&t.target, e))
            }
            Err(_) => Ok(()),
        }
    }

    /// Writes `data`, one verified chunk, at `offset` into the temp file.
    pub fn write_temp(&self, t: &mut TempFile, offset: u64, data: &[u8]) -> Result<(), StoreError> {
        let f = self.writable(t)?;
        f.write_all_at(data, offset)
            .map_err(|e| io_err(&t.target, e))?;
        t.wrote(data.len() as u64);
        start_writeback(t);
        Ok(())
    }

    /// A read-only descriptor of the temp file `t` (its readers', D95): the same inode, before
    /// and after its install. Read-only: a writable one would refuse the store's read lease
    /// (D39) to every later install at its path for as long as a reader holds it.
    pub fn temp_descriptor(&self, t: &TempFile) -> Result<std::os::fd::OwnedFd, StoreError> {
        use std::os::fd::AsRawFd;
        let reopened;
        let f = match &t.file {
            Some(f) => f,
            None => {
                reopened = self.temp_handle(t, false)?;
                &reopened
            }
        };
        File::open(format!("/proc/self/fd/{}", f.as_raw_fd()))
            .map(std::os::fd::OwnedFd::from)
            .map_err(|e| io_err(&t.target, e))
    }

    /// Copies chunks into a temp file from local files that the chunk index says hold them,
    /// each read into a private buffer and verified by blake3 before that same buffer is
    /// written. Returns the indexes of the `copies` no source had (a stale index: the file
    /// changed since it was scanned), to be fetched from a peer instead.
    ///
    /// Each source file is opened once for the whole list, not once per chunk; from
    /// [`PARALLEL_COPY_FROM`] chunks on, two threads verify and write (a 4 KiB edit of a
    /// 512 MiB file copies 8,192 chunks, and their blake3 was a fifth of the receiver's CPU).
    /// A source in `held` is read through that descriptor instead of being opened: a file the
    /// same batch deleted or replaced since it was decided.
    pub fn copy_chunks_in(
        &self,
        cache: &mut DirCache,
        t: &mut TempFile,
        copies: &[LocalCopy],
        held: &HashMap<RelPath, Arc<File>>,
    ) -> Result<Vec<usize>, StoreError> {
        let mut sources: HashMap<&RelPath, Option<Arc<File>>> = HashMap::new();
        for c in copies {
            for (path, _) in c.sources.iter() {
                if !sources.contains_key(path) {
                    let f = match held.get(path) {
                        Some(f) => Some(f.clone()),
                        None => self.open_file_in(cache, path).ok().map(Arc::new),
                    };
                    sources.insert(path, f);
                }
            }
        }
        let out = self.writable(t)?;
        let lanes = if copies.len() >= PARALLEL_COPY_FROM {
            2
        } else {
            1
        };
        let lane = |lane: usize| -> io::Result<(u64, Vec<usize>)> {
            let mut buf = Vec::new();
            let mut written = 0u64;
            let mut missing = Vec::new();
            for (i, c) in copies.iter().enumerate().skip(lane).step_by(lanes) {
                buf.resize(c.len as usize, 0);
                let found = c.sources.iter().any(|(path, offset)| {
                    sources.get(path).and_then(Option::as_ref).is_some_and(|f| {
                        f.read_exact_at(&mut buf, *offset).is_ok() && Hash::of(&buf) == c.hash
                    })
                });
                if found {
                    out.write_all_at(&buf, c.offset)?;
                    written += c.len as u64;
                } else {
                    missing.push(i);
                }
            }
            Ok((written, missing))
        };
        let results: Vec<io::Result<(u64, Vec<usize>)>> = std::thread::scope(|s| {
            let helpers: Vec<_> = (1..lanes).map(|l| s.spawn(move || lane(l))).collect();
            let mut results = vec![lane(0)];
            for h in helpers {
                results.push(match h.join() {
                    Ok(r) => r,
                    Err(panic) => std::panic::resume_unwind(panic),
                });
            }
            results
        });
        let mut missing = Vec::new();
        for r in results {
            let (written, m) = r.map_err(|e| io_err(&t.target, e))?;
            t.wrote(written);
            missing.extend(m);
        }
        start_writeback(t);
        missing.sort_unstable();
        Ok(missing)
    }

    /// Closes the temp file's descriptor (it is re-opened on demand). An unnamed temp file
    /// stays open: its descriptor is all there is of it.
    pub fn close_temp(&self, t: &mut TempFile) {
        if !t.unnamed() {
            t.file = None;
        }
    }

    /// Checks the temp file is exactly covered by the chunks written into it (`size` bytes
    /// written, `size` bytes long), then sets its mode and mtime. This is the "verify before
    /// rename" half of the store's paired assertion: each chunk was verified before it was
    /// written, and a record's hash is its chunk list's, so a covered file is the version.
    pub fn finish_temp(
        &self,
        t: &mut TempFile,
        size: u64,
        mode: u32,
        mtime_ns: i64,
    ) -> Result<(), StoreError> {
        if t.written != size {
            return Err(StoreError::Incomplete {
                path: t.target.clone(),
                written: t.written,
                size,
            });
        }
        // A named temp file's descriptor is closed here (the install needs only its name).
        let f = match t.file.take() {
            Some(f) => f,
            None => self.temp_handle(t, false)?,
        };
        let mode = self.local_mode(mode, FileKind::File);
        set_mode_fd(f.as_fd(), mode).map_err(|e| io_err(&t.target, e))?;
        set_mtime_fd(f.as_fd(), mtime_ns).map_err(|e| io_err(&t.target, e))?;
        // One stat after the mode and times: the size check, and for an unnamed file the stat
        // its install journals (no second one under the folder lock).
        let st = sys::fstat(f.as_fd()).map_err(|e| io_err(&t.target, e))?;
        if st.st_size as u64 != size {
            return Err(io_err(
                &t.target,
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("temp file has {} bytes, expected {size}", st.st_size),
                ),
            ));
        }
        if t.unnamed() {
            t.finished = Some(stat_of(&st).local);
            t.file = Some(f);
        }
        Ok(())
    }

    /// Deletes a temp file that will not be installed.
    pub fn discard_temp(&self, mut t: TempFile) {
        t.file = None;
        if t.unnamed() {
            return;
        }
        let _ = self.in_temp_dir(&t, |dir| {
            let _ = sys::unlinkat(dir, &t.name, 0);
            Ok(())
        });
    }

    /// Installs finished temp files: one `syncfs` makes them all durable, each target is
    /// checked against its expectation and replaced by rename, then every touched directory is
    /// fsynced once. Returns, per file, the installed file's stat or why it was not installed
    /// (its temp file is removed).
    pub fn install(&self, batch: Vec<(TempFile, Expect)>) -> Vec<Result<LocalStat, StoreError>> {
        self.install_in(&mut DirCache::default(), batch)
    }

    /// [`Store::install`] walking to parents through `cache`.
    pub fn install_in(
        &self,
        cache: &mut DirCache,
        batch: Vec<(TempFile, Expect)>,
    ) -> Vec<Result<LocalStat, StoreError>> {
        let temps: Vec<&TempFile> = batch.iter().map(|(t, _)| t).collect();
        self.sync_temps(&temps);
        self.install_synced_in(cache, batch, &|_, _| {})
    }

    /// Makes finished temp files durable: few, `fsync` each; many, one `syncfs` for the whole
    /// filesystem. Needs no lock: temp files are the store's own.
    pub fn sync_temps(&self, temps: &[&TempFile]) {
        if temps.len() <= 4 {
            for t in temps {
                let reopened;
                let f = match &t.file {
                    Some(f) => f,
                    None => match self.temp_handle(t, false) {
                        Ok(f) => {
                            reopened = f;
                            &reopened
                        }
                        Err(_) => continue,
                    },
                };
                let _ = f.sync_all();
            }
        } else if !temps.is_empty() {
            let _ = sys::syncfs(self.root_fd.as_fd());
        }
    }

    /// [`Store::install_in`] of temp files already made durable by [`Store::sync_temps`].
    /// `installed` is called the moment each file is in place (from either thread), before
    /// the batch's directories are fsynced: the watcher's event for it can come that soon.
    pub fn install_synced_in(
        &self,
        cache: &mut DirCache,
        batch: Vec<(TempFile, Expect)>,
        installed: &(dyn Fn(&RelPath, &LocalStat) + Sync),
    ) -> Vec<Result<LocalStat, StoreError>> {
        if batch.is_empty() {
            return Vec::new();
        }
        // The staging directory loses the staged names: it is synced with the targets'.
        let staging = batch
            .iter()
            .find_map(|(t, _)| self.staging_fd(t.staged && !t.unnamed()));
        // Each target's directory, walked to once through `cache`, before any install.
        let mut items: Vec<(Result<Arc<OwnedFd>, StoreError>, TempFile, Expect)> = batch
            .into_iter()
            .map(|(t, e)| (self.dir_in(cache, t.target.parent().as_ref(), false), t, e))
            .collect();
        // Large batches install on two threads, split where the directory changes so that
        // each directory (its lock, its fsync) is one thread's. Installs into different
        // directories of one filesystem do not serialize: a link takes only its directory's
        // lock (a rename across directories takes the filesystem's, so named temp files gain
        // little here).
        let mut split = items.len();
        if items.len() >= PARALLEL_INSTALL_FROM {
            split = items.len() / 2;
            let same = |a: &Result<Arc<OwnedFd>, StoreError>,
                        b: &Result<Arc<OwnedFd>, StoreError>| {
                matches!((a, b), (Ok(x), Ok(y)) if Arc::ptr_eq(x, y))
            };
            while split < items.len() && same(&items[split].0, &items[split - 1].0) {
                split += 1;
            }
        }
        let right = items.split_off(split);
        let out = if right.is_empty() {
            self.install_lane(items, installed)
        } else {
            std::thread::scope(|s| {
                let other = s.spawn(|| self.install_lane(right, installed));
                let mut out = self.install_lane(items, installed);
                match other.join() {
                    Ok(rest) => out.extend(rest),
                    Err(p) => std::panic::resume_unwind(p),
                }
                out
            })
        };
        if let Some(fd) = staging {
            let _ = sys::fsync(fd);
        }
        out
    }

    /// Installs `items` in order, then fsyncs each directory they went into.
    fn install_lane(
        &self,
        items: Vec<(Result<Arc<OwnedFd>, StoreError>, TempFile, Expect)>,
        installed: &(dyn Fn(&RelPath, &LocalStat) + Sync),
    ) -> Vec<Result<LocalStat, StoreError>> {
        let mut touched = Vec::new();
        let out: Vec<_> = items
            .into_iter()
            .map(|(dir, t, expect)| match dir {
                Ok(dir) => {
                    let target = t.target.clone();
                    let r = self.install_one(&dir, t, expect);
                    if let Ok(local) = &r {
                        installed(&target, local);
                        if !touched.last().is_some_and(|d| Arc::ptr_eq(d, &dir)) {
                            touched.push(dir);
                        }
                    }
                    r
                }
                Err(e) => {
                    self.discard_temp(t);
                    Err(e)
                }
            })
            .collect();
        touched.sort_unstable_by_key(|d| d.as_raw_fd());
        touched.dedup_by_key(|d| d.as_raw_fd());
        for dir in touched {
            let _ = sys::fsync(dir.as_fd());
        }
        out
    }

    fn install_one(
        &self,
        dir: &Arc<OwnedFd>,
        t: TempFile,
        expect: Expect,
    ) -> Result<LocalStat, StoreError> {
        let name = cstr(t.target.file_name())?;
        if t.unnamed() {
            return self.install_unnamed(dir, t, &name, expect);
        }
        let aside = match &self.staging {
            Some(s) if t.staged => s.fd.clone(),
            _ => dir.clone(),
        };
        let refuse = |e| {
            let _ = sys::unlinkat(aside.as_fd(), &t.name, 0);
            Err(e)
        };
        // What this install wrote, before anyone else can reach it: the stat to journal.
        let ours = match lstat_at(aside.as_fd(), &t.name) {
            Ok(st) => stat_of(&st).local,
            Err(e) => return refuse(io_err(&t.target, e)),
        };
        let expect = match clear_dir(dir, &name, &t.target, expect) {
            Ok(e) => e,
            Err(e) => return refuse(e),
        };
        match expect {
            // A new file: the rename itself refuses an existing target (no stat first, and no
            // window between the check and the rename). Where the filesystem cannot, check first.
            Expect::Absent => match rename_noreplace(aside.as_fd(), &t.name, dir.as_fd(), &name) {
                Ok(true) => {}
                Ok(false) => {
                    if let Err(e) = check_expect(dir.as_fd(), &name, &t.target, expect) {
                        return refuse(e);
                    }
                    if let Err(e) = sys::renameat(aside.as_fd(), &t.name, dir.as_fd(), &name) {
                        return refuse(io_err(&t.target, e));
                    }
                }
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                    return refuse(StoreError::Changed(t.target.clone()))
                }
                Err(e) => return refuse(io_err(&t.target, e)),
            },
            // The file the journal knows is swapped out, checked and kept aside; `replace`
            // leaves no temp name behind whatever happens, so nothing here may remove one.
            Expect::Matches(want) => {
                let hand_over = !t.same_version;
                self.replace(dir, &name, &t.target, (&aside, &t.name), &want, hand_over)?;
            }
            Expect::Anything => {
                if let Err(e) = sys::renameat(aside.as_fd(), &t.name, dir.as_fd(), &name) {
                    return refuse(io_err(&t.target, e));
                }
            }
        }
        failpoint::hit("install.after_rename", t.target.as_str());
        Ok(settled(&ours, lstat_at(dir.as_fd(), &name)))
    }

    /// [`Store::install_one`] of an unnamed temp file: a new file is linked in (the link
    /// itself refuses an existing target); a replacement is linked into the staging directory
    /// under a temp name, then swapped into place. Dropping `t` frees an unlinked file.
    fn install_unnamed(
        &self,
        dir: &Arc<OwnedFd>,
        t: TempFile,
        name: &CStr,
        expect: Expect,
    ) -> Result<LocalStat, StoreError> {
        let (Some(file), Some(staging)) = (t.file.as_ref(), self.staging.as_ref()) else {
            return Err(io_err(&t.target, io::Error::from_raw_os_error(libc::EBADF)));
        };
        let via = staging.link.unwrap_or(LinkVia::ProcFd);
        let expect = clear_dir(dir, name, &t.target, expect)?;
        let fd = file.as_fd();
        let ours = match t.finished {
            Some(ours) => ours,
            None => stat_of(&sys::fstat(fd).map_err(|e| io_err(&t.target, e))?).local,
        };
        if expect == Expect::Absent {
            match link_unnamed(fd, via, dir.as_fd(), name) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                    return Err(StoreError::Changed(t.target.clone()))
                }
                Err(e) => return Err(io_err(&t.target, e)),
            }
        } else {
            let sdir = &staging.fd;
            let tmp = cstr(&format!("{TEMP_PREFIX}{}", random_suffix()))?;
            link_unnamed(fd, via, sdir.as_fd(), &tmp).map_err(|e| io_err(&t.target, e))?;
            match expect {
                Expect::Matches(want) => {
                    let hand_over = !t.same_version;
                    self.replace(dir, name, &t.target, (sdir, &tmp), &want, hand_over)?
                }
                _ => {
                    if let Err(e) = sys::renameat(sdir.as_fd(), &tmp, dir.as_fd(), name) {
                        let _ = sys::unlinkat(sdir.as_fd(), &tmp, 0);
                        return Err(io_err(&t.target, e));
                    }
                }
            }
        }
        failpoint::hit("install.after_rename", t.target.as_str());
        // Our own descriptor: what this install put there, whatever the path holds now.
        Ok(settled(&ours, sys::fstat(fd)))
    }

    /// Puts the file `new` (a directory and a temp name in it) at `name` in `dir` (the target
    /// `path`) in place of the file `want` describes, which is swapped out and kept aside
    /// ([`displace`]). A local write that reached the old file after its check undoes the
    /// swap (`Changed`), and so does a writer that has it open (`Busy`). Whatever it returns,
    /// no temp name of `new`'s holds anything that must be removed: ours is dropped, installed
    /// or kept, the old file is back, kept aside or kept as a conflict copy. `hand_over`: the
    /// old file is a version that leaves (handed to [`Store::on_displaced`]'s sink).
    fn replace(
        &self,
        dir: &Arc<OwnedFd>,
        name: &CStr,
        path: &RelPath,
        new: (&Arc<OwnedFd>, &CStr),
        want: &LocalStat,
        hand_over: bool,
    ) -> Result<(), StoreError> {
        let (aside, tname) = new;
        let opened = lstat_at(aside.as_fd(), tname)
            .map(|st| stat_of(&st).local)
            .map_err(|e| io_err(path, e))
            .and_then(|ours| Ok((ours, Old::open(dir.as_fd(), name, path, want)?)));
        let (ours, old) = match opened {
            Ok(x) => x,
            Err(e) => {
                let _ = sys::unlinkat(aside.as_fd(), tname, 0);
                return Err(e);
            }
        };
        failpoint::hit("install.before_rename", path.as_str());
        old.mark(path);
        match sys::renameat2(
            aside.as_fd(),
            tname,
            dir.as_fd(),
            name,
            libc::RENAME_EXCHANGE,
        ) {
            Ok(()) => {}
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS)) => {
                return self.replace_linked_aside(dir, name, path, new, old, hand_over);
            }
            Err(e) => {
                old.unmark();
                let _ = sys::unlinkat(aside.as_fd(), tname, 0);
                return Err(io_err(path, e));
            }
        }
        failpoint::hit("install.after_exchange", path.as_str());
        // The old file is at `tname` now.
        match old.verdict() {
            Verdict::Same => {
                self.keeper.keep(
                    old,
                    aside.clone(),
                    tname.to_owned(),
                    path,
                    dir.clone(),
                    hand_over,
                );
                Ok(())
            }
            v => {
                old.unmark();
                drop(old);
                self.put_back(dir, name, path, new, &ours);
                Err(match v {
                    Verdict::Writer => StoreError::Busy(path.clone()),
                    _ => StoreError::Changed(path.clone()),
                })
            }
        }
    }

    /// Undoes a swap: the old file, at the temp name in `swapped`, goes back to `name` in `dir`
    /// in exchange for what the path holds. What comes back is dropped if it is `ours` as this
    /// install wrote it; anything else (ours written to while it was at the path, or a file
    /// that replaced ours meanwhile) is kept as a conflict copy. If the swap back fails, the
    /// old file is kept as a conflict copy.
    fn put_back(
        &self,
        dir: &Arc<OwnedFd>,
        name: &CStr,
        path: &RelPath,
        swapped: (&Arc<OwnedFd>, &CStr),
        ours: &LocalStat,
    ) {
        let (aside, tname) = swapped;
        let by = self.keeper.device();
        let back = sys::renameat2(
            aside.as_fd(),
            tname,
            dir.as_fd(),
            name,
            libc::RENAME_EXCHANGE,
        );
        if back.is_err() {
            let _ = displace::keep_as_copy(aside.as_fd(), tname, dir.as_fd(), path, by);
            return;
        }
        match lstat_at(aside.as_fd(), tname).map(|st| stat_of(&st).local) {
            Ok(r) if same_version(&r, ours) && r.mode == ours.mode => {
                let _ = sys::unlinkat(aside.as_fd(), tname, 0);
            }
            Ok(_) => {
                let _ = displace::keep_as_copy(aside.as_fd(), tname, dir.as_fd(), path, by);
            }
            Err(_) => {}
        }
    }

    /// [`Store::replace`] where the filesystem cannot exchange two names: the old file gets a
    /// second name aside first, the path is checked to hold it still, and ours is renamed over
    /// it. Between that check and the rename the path can still be replaced (D39); a write to
    /// the old file after it is only ever kept, as a conflict copy.
    fn replace_linked_aside(
        &self,
        dir: &Arc<OwnedFd>,
        name: &CStr,
        path: &RelPath,
        new: (&Arc<OwnedFd>, &CStr),
        old: Old,
        hand_over: bool,
    ) -> Result<(), StoreError> {
        let (aside, tname) = new;
        // `old` was marked by `replace`: unmarked wherever it stays at its path.
        let drop_ours = |e| {
            old.unmark();
            let _ = sys::unlinkat(aside.as_fd(), tname, 0);
            Err(e)
        };
        let kept = match cstr(&format!("{TEMP_PREFIX}{}", random_suffix())) {
            Ok(k) => k,
            Err(e) => return drop_ours(e),
        };
        let linked = sys::linkat(dir.as_fd(), name, aside.as_fd(), &kept, 0).is_ok();
        let still = lstat_at(dir.as_fd(), name)
            .is_ok_and(|st| st.st_ino == old.inode() && (st.st_mode & libc::S_IFMT) != 0);
        if !still {
            if linked {
                let _ = sys::unlinkat(aside.as_fd(), &kept, 0);
            }
            return drop_ours(StoreError::Changed(path.clone()));
        }
        if let Err(e) = sys::renameat(aside.as_fd(), tname, dir.as_fd(), name) {
            if linked {
                let _ = sys::unlinkat(aside.as_fd(), &kept, 0);
            }
            return drop_ours(io_err(path, e));
        }
        if !linked {
            // No links either: the old file lives on only while someone holds it open.
            return Ok(());
        }
        match old.verdict() {
            Verdict::Written => {
                old.unmark();
                drop(old);
                let by = self.keeper.device();
                let _ = displace::keep_as_copy(aside.as_fd(), &kept, dir.as_fd(), path, by);
            }
            _ => self
                .keeper
                .keep(old, aside.clone(), kept, path, dir.clone(), hand_over),
        }
        Ok(())
    }

    /// Removes a file or symlink if it is still what the journal expects. The file is moved
    /// aside, checked again and kept a while ([`displace`]): a local write that reached it after
    /// the check puts it back (`Changed`), and so does a writer that has it open (`Busy`).
    pub fn remove_file(&self, path: &RelPath, expect: Expect) -> Result<(), StoreError> {
        let (dir, name) = match self.parent_and_name(path, false) {
            Ok(x) => x,
            Err(StoreError::Io { source, .. }) if source.raw_os_error() == Some(libc::ENOENT) => {
                return Ok(())
            }
            Err(e) => return Err(e),
        };
        let Expect::Matches(want) = expect else {
            check_expect(dir.as_fd(), &name, path, expect)?;
            match sys::unlinkat(dir.as_fd(), &name, 0) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                Err(e) => return Err(io_err(path, e)),
            }
            let _ = sys::fsync(dir.as_fd());
            return Ok(());
        };
        let old = Old::open(dir.as_fd(), &name, path, &want)?;
        let aside = self.aside_for(&dir, path)?;
        let kept = cstr(&format!("{TEMP_PREFIX}{}", random_suffix()))?;
        failpoint::hit("remove.before_rename", path.as_str());
        old.mark(path);
        if let Err(e) = sys::renameat(dir.as_fd(), &name, aside.as_fd(), &kept) {
            old.unmark();
            return Err(io_err(path, e));
        }
        failpoint::hit("remove.after_rename", path.as_str());
        match old.verdict() {
            Verdict::Same => {
                self.keeper.keep(old, aside, kept, path, dir.clone(), true);
                let _ = sys::fsync(dir.as_fd());
                Ok(())
            }
            v => {
                old.unmark();
                drop(old);
                // Back where it was, unless the path was made again meanwhile: then kept.
                let back = sys::renameat2(
                    aside.as_fd(),
                    &kept,
                    dir.as_fd(),
                    &name,
                    libc::RENAME_NOREPLACE,
                );
                if back.is_err() {
                    let by = self.keeper.device();
                    displace::keep_as_copy(aside.as_fd(), &kept, dir.as_fd(), path, by)?;
                }
                Err(match v {
                    Verdict::Writer => StoreError::Busy(path.clone()),
                    _ => StoreError::Changed(path.clone()),
                })
            }
        }
    }

    /// Where a file removed from `dir` is kept aside: the staging directory when it is on
    /// the same filesystem (a rename cannot cross), else `dir` itself under a temp name.
    fn aside_for(&self, dir: &Arc<OwnedFd>, path: &RelPath) -> Result<Arc<OwnedFd>, StoreError> {
        match &self.staging {
            Some(s) if fstat_dev(dir.as_fd()).map_err(|e| io_err(path, e))? == s.dev => {
                Ok(s.fd.clone())
            }
            _ => Ok(dir.clone()),
        }
    }

    /// Removes an empty directory (a directory with entries is left alone: `NotEmpty`).
    pub fn remove_dir(&self, path: &RelPath) -> Result<(), StoreError> {
        let (dir, name) = match self.parent_and_name(path, false) {
            Ok(x) => x,
            Err(StoreError::Io { source, .. }) if source.raw_os_error() == Some(libc::ENOENT) => {
                return Ok(())
            }
            Err(e) => return Err(e),
        };
        match sys::unlinkat(dir.as_fd(), &name, libc::AT_REMOVEDIR) {
            Ok(()) => Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::ENOTEMPTY) => {
                Err(StoreError::NotEmpty(path.clone()))
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => {
                Err(StoreError::Changed(path.clone()))
            }
            Err(e) => Err(io_err(path, e)),
        }
    }

    /// Creates a directory (and its parents) with `mode`; an existing directory gets `mode`.
    pub fn make_dir(&self, path: &RelPath, mode: u32) -> Result<LocalStat, StoreError> {
        let (dir, name) = self.parent_and_name(path, true)?;
        match sys::mkdirat(dir.as_fd(), &name, 0o700) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
            Err(e) => return Err(io_err(path, e)),
        }
        let fd = sys::openat(
            dir.as_fd(),
            &name,
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW,
            0,
        )
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) | Some(libc::ENOTDIR) => StoreError::Changed(path.clone()),
            _ => io_err(path, e),
        })?;
        let mode = self.local_mode(mode, FileKind::Dir);
        set_mode_fd(fd.as_fd(), mode).map_err(|e| io_err(path, e))?;
        let st = lstat_at(dir.as_fd(), &name).map_err(|e| io_err(path, e))?;
        Ok(stat_of(&st).local)
    }

    /// Creates or replaces a symlink atomically (a temp link, then a rename that refuses an
    /// existing target, or a swap with the expected file, which is kept aside: [`displace`]).
    pub fn make_symlink(
        &self,
        path: &RelPath,
        target: &str,
        mtime_ns: i64,
        expect: Expect,
    ) -> Result<LocalStat, StoreError> {
        let (dir, name) = self.parent_and_name(path, true)?;
        let tmp = cstr(&format!("{TEMP_PREFIX}{}", random_suffix()))?;
        let tgt = cstr(target)?;
        sys::symlinkat(&tgt, dir.as_fd(), &tmp).map_err(|e| io_err(path, e))?;
        let _ = sys::utimensat(
            dir.as_fd(),
            &tmp,
            &mtime_spec(mtime_ns),
            libc::AT_SYMLINK_NOFOLLOW,
        );
        let ours = lstat_at(dir.as_fd(), &tmp).map(|st| stat_of(&st).local);
        let drop_tmp = |e| {
            let _ = sys::unlinkat(dir.as_fd(), &tmp, 0);
            Err(e)
        };
        let ours = match ours {
            Ok(o) => o,
            Err(e) => return drop_tmp(io_err(path, e)),
        };
        match expect {
            Expect::Matches(want) => self.replace(&dir, &name, path, (&dir, &tmp), &want, true)?,
            Expect::Absent => match rename_noreplace(dir.as_fd(), &tmp, dir.as_fd(), &name) {
                Ok(true) => {}
                Ok(false) => {
                    if let Err(e) = check_expect(dir.as_fd(), &name, path, expect) {
                        return drop_tmp(e);
                    }
                    if let Err(e) = sys::renameat(dir.as_fd(), &tmp, dir.as_fd(), &name) {
                        return drop_tmp(io_err(path, e));
                    }
                }
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                    return drop_tmp(StoreError::Changed(path.clone()))
                }
                Err(e) => return drop_tmp(io_err(path, e)),
            },
            Expect::Anything => {
                if let Err(e) = sys::renameat(dir.as_fd(), &tmp, dir.as_fd(), &name) {
                    return drop_tmp(io_err(path, e));
                }
            }
        }
        let _ = sys::fsync(dir.as_fd());
        Ok(settled(&ours, lstat_at(dir.as_fd(), &name)))
    }

    /// Sets mode (and, for files, mtime) of an existing file or directory in place, after
    /// checking `expect`. A file is held under a read lease meanwhile ([`displace`]): nobody
    /// can write it between the check and the stat that is journaled, and a file open for
    /// writing is not touched (`Busy`).
    pub fn set_meta(
        &self,
        path: &RelPath,
        mode: u32,
        mtime_ns: Option<i64>,
        expect: Expect,
    ) -> Result<LocalStat, StoreError> {
        let (dir, name) = self.parent_and_name(path, false)?;
        let is_dir =
            lstat_at(dir.as_fd(), &name).is_ok_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFDIR);
        let (held, fd);
        match expect {
            Expect::Matches(want) if !is_dir => {
                let old = Old::open(dir.as_fd(), &name, path, &want)?;
                fd = old.fd().try_clone().map_err(|e| io_err(path, e))?;
                held = Some(old);
            }
            _ => {
                check_expect(dir.as_fd(), &name, path, expect)?;
                fd = sys::openat(dir.as_fd(), &name, libc::O_RDONLY | libc::O_NOFOLLOW, 0)
                    .map_err(|e| io_err(path, e))?;
                held = None;
            }
        }
        failpoint::hit("meta.before_set", path.as_str());
        let kind = if is_dir {
            FileKind::Dir
        } else {
            FileKind::File
        };
        set_mode_fd(fd.as_fd(), self.local_mode(mode, kind)).map_err(|e| io_err(path, e))?;
        if let Some(m) = mtime_ns {
            set_mtime_fd(fd.as_fd(), m).map_err(|e| io_err(path, e))?;
        }
        // The file's own descriptor, while the lease still holds writers off.
        let st = sys::fstat(fd.as_fd()).map_err(|e| io_err(path, e))?;
        drop(held);
        Ok(stat_of(&st).local)
    }

    /// Gives the current content of `from` a second name `to` (a hard link: instant, and the
    /// content survives when `from` is replaced by rename). Used for conflict siblings of the
    /// local version. Falls back to a copy where links are not possible. A file is held under
    /// a read lease from its check to the stat that is journaled ([`displace`]).
    pub fn preserve_as(
        &self,
        from: &RelPath,
        to: &RelPath,
        expect: Expect,
    ) -> Result<LocalStat, StoreError> {
        let (fdir, fname) = self.parent_and_name(from, false)?;
        let held = match expect {
            Expect::Matches(want) => Some(Old::open(fdir.as_fd(), &fname, from, &want)?),
            _ => {
                check_expect(fdir.as_fd(), &fname, from, expect)?;
                None
            }
        };
        let (tdir, tname) = self.parent_and_name(to, true)?;
        if let Err(e) = sys::linkat(fdir.as_fd(), &fname, tdir.as_fd(), &tname, 0) {
            if e.raw_os_error() == Some(libc::EEXIST) {
                return Err(StoreError::Changed(to.clone()));
            }
            drop(held);
            // Symlinks, cross-device or link-limit: copy through a temp file instead.
            let st = self
                .stat(from)?
                .ok_or_else(|| StoreError::Changed(from.clone()))?;
            if st.kind == Some(FileKind::Symlink) {
                let target = self.read_link(from)?;
                return self.make_symlink(to, &target, st.local.mtime_ns, Expect::Absent);
            }
            let mut t = self.create_temp(to)?;
            let src = self.open_file(from)?;
            if let Some(hash) = placeholder_of(src.as_fd()) {
                // Not local (D90): its copy is a placeholder of the same content, never zeros.
                let made = self
                    .make_placeholder(&mut t, st.local.size, &hash)
                    .and_then(|()| {
                        self.finish_temp(&mut t, st.local.size, st.local.mode, st.local.mtime_ns)
                    });
                if let Err(e) = made {
                    self.discard_temp(t);
                    return Err(e);
                }
                return self
                    .install(vec![(t, Expect::Absent)])
                    .pop()
                    .unwrap_or_else(|| Err(StoreError::Changed(to.clone())));
            }
            let mut buf = vec![0u8; 1 << 20];
            let mut off = 0u64;
            loop {
                let n = src.read_at(&mut buf, off).map_err(|e| io_err(from, e))?;
                if n == 0 {
                    break;
                }
                self.write_temp(&mut t, off, &buf[..n])?;
                off += n as u64;
            }
            self.close_temp(&mut t);
            let f = self.temp_handle(&t, false)?;
            let _ = set_mode_fd(f.as_fd(), st.local.mode);
            let _ = set_mtime_fd(f.as_fd(), st.local.mtime_ns);
            drop(f);
            return self
                .install(vec![(t, Expect::Absent)])
                .pop()
                .unwrap_or_else(|| Err(StoreError::Changed(to.clone())));
        }
        let st = lstat_at(tdir.as_fd(), &tname).map_err(|e| io_err(to, e))?;
        // The name was linked, not the descriptor: it must be the file that was checked.
        if let Some(old) = &held {
            if st.st_ino != old.inode() {
                let _ = sys::unlinkat(tdir.as_fd(), &tname, 0);
                return Err(StoreError::Changed(from.clone()));
            }
        }
        let _ = sys::fsync(tdir.as_fd());
        drop(held);
        Ok(stat_of(&st).local)
    }

    /// Removes leftover temp files (run at start-up: a crash leaves only temp files behind),
    /// except the files an apply had kept aside ([`displace`]): such a file is removed only
    /// if it is unchanged (after it is handed to [`Store::on_displaced`]'s sink, if set), else
    /// moved next to its path as a conflict copy. Returns how many
    /// were removed.
    pub fn remove_temps(&self) -> usize {
        let by = self.keeper.device();
        let sink = self.keeper.sink();
        let open_dir = |p: &RelPath| self.open_dir(Some(p), false).ok();
        let mut removed = 0;
        let mut clean = |dir: &Path| {
            let Ok(fd) = open_path_dir(dir) else { return };
            for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
                let name = e.file_name();
                if !name.to_string_lossy().starts_with(TEMP_PREFIX) {
                    continue;
                }
                let Ok(c) = CString::new(name.as_encoded_bytes()) else {
                    continue;
                };
                if e.file_type().is_ok_and(|t| t.is_file())
                    && displace::recover(&fd, &c, &self.root_fd, open_dir, by, sink)
                {
                    continue;
                }
                if sys::unlinkat(fd.as_fd(), &c, 0).is_ok() {
                    removed += 1;
                }
            }
        };
        if let Some(s) = &self.staging {
            clean(&s.path);
        }
        let mut stack = vec![self.root.clone()];
        while let Some(d) = stack.pop() {
            clean(&d);
            let Ok(rd) = std::fs::read_dir(&d) else {
                continue;
            };
            for e in rd.flatten() {
                let name = e.file_name();
                let n = name.to_string_lossy();
                if e.file_type().is_ok_and(|t| t.is_dir()) && !n.starts_with(INTERNAL_PREFIX) {
                    stack.push(e.path());
                }
            }
        }
        removed
    }
}

/// Gives the unnamed file `fd` the name `name` in `dir`; fails with `EEXIST` if it is taken.
fn link_unnamed(
    fd: BorrowedFd<'_>,
    via: LinkVia,
    dir: BorrowedFd<'_>,
    name: &CStr,
) -> io::Result<()> {
    match via {
        LinkVia::EmptyPath => sys::linkat(fd, c"", dir, name, libc::AT_EMPTY_PATH),
        LinkVia::ProcFd => {
            let proc = CString::new(format!("/proc/self/fd/{}", fd.as_raw_fd()))
                .map_err(io::Error::other)?;
            sys::linkat(sys::cwd(), &proc, dir, name, libc::AT_SYMLINK_FOLLOW)
        }
    }
}

/// Whether unnamed temp files can be made in `dir` and named afterwards, and how: makes one,
/// links it, and removes the link again.
fn probe_unnamed(dir: BorrowedFd<'_>) -> Option<LinkVia> {
    let fd = sys::openat(dir, c".", libc::O_RDWR | libc::O_TMPFILE, 0o600).ok()?;
    for via in [LinkVia::EmptyPath, LinkVia::ProcFd] {
        let name = CString::new(format!("{TEMP_PREFIX}{}", random_suffix())).ok()?;
        if link_unnamed(fd.as_fd(), via, dir, &name).is_ok() {
            let _ = sys::unlinkat(dir, &name, 0);
            return Some(via);
        }
    }
    None
}

/// `renameat2(RENAME_NOREPLACE)`: `Ok(false)` where the filesystem cannot (nothing renamed).
fn rename_noreplace(
    from: BorrowedFd<'_>,
    old: &CStr,
    dir: BorrowedFd<'_>,
    new: &CStr,
) -> io::Result<bool> {
    match sys::renameat2(from, old, dir, new, libc::RENAME_NOREPLACE) {
        Ok(()) => Ok(true),
        Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS)) => Ok(false),
        Err(e) => Err(e),
    }
}

/// The stat to journal for a file an install just put in place: `now` (what the path or the
/// installed file's own descriptor shows) if that is still the very file the install wrote, as
/// it wrote it (`ours`: same inode, size, mtime, mode), with the times the rename gave it; else
/// `ours` itself, so that the local write which has landed since is seen as a change by the
/// scanner and by the echo check. Never a stat that could hide a local write.
fn settled(ours: &LocalStat, now: io::Result<libc::stat>) -> LocalStat {
    match now.map(|st| stat_of(&st).local) {
        Ok(l) if same_version(ours, &l) && l.mode == ours.mode => l,
        _ => *ours,
    }
}

/// A file replacing the directory the journal knows at its path: the directory goes first if
/// it is empty (`rmdir` refuses one with entries: `Changed`, and the decision, made again, sees
/// what is below it), and the file then goes in as a new one (`Expect::Absent`: whatever
/// appears at the path meanwhile is not replaced). Any other expectation is returned as it is.
fn clear_dir(
    dir: &Arc<OwnedFd>,
    name: &CStr,
    path: &RelPath,
    expect: Expect,
) -> Result<Expect, StoreError> {
    let Expect::Matches(want) = expect else {
        return Ok(expect);
    };
    match lstat_at(dir.as_fd(), name) {
        Ok(st) if st.st_mode & libc::S_IFMT != libc::S_IFDIR => return Ok(expect),
        Ok(st) if st.st_ino == want.inode => {}
        Ok(_) => return Err(StoreError::Changed(path.clone())),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(expect),
        Err(e) => return Err(io_err(path, e)),
    }
    match sys::unlinkat(dir.as_fd(), name, libc::AT_REMOVEDIR) {
        Ok(()) => Ok(Expect::Absent),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(Expect::Absent),
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTEMPTY | libc::EEXIST)) => {
            Err(StoreError::Changed(path.clone()))
        }
        Err(e) => Err(io_err(path, e)),
    }
}

fn check_expect(
    dir: BorrowedFd<'_>,
    name: &CStr,
    path: &RelPath,
    expect: Expect,
) -> Result<(), StoreError> {
    if expect == Expect::Anything {
        return Ok(());
    }
    let now = match lstat_at(dir, name) {
        Ok(st) => Some(stat_of(&st).local),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => None,
        Err(e) => return Err(io_err(path, e)),
    };
    let ok = match (expect, now) {
        (Expect::Anything, _) => true,
        (Expect::Absent, None) => true,
        (Expect::Absent, Some(_)) => false,
        (Expect::Matches(_), None) => false,
        (Expect::Matches(want), Some(have)) => {
            want.inode == have.inode && want.size == have.size && want.mtime_ns == have.mtime_ns
        }
    };
    if ok {
        Ok(())
    } else {
        Err(StoreError::Changed(path.clone()))
    }
}

fn set_mode_fd(fd: BorrowedFd<'_>, mode: u32) -> io::Result<()> {
    sys::fchmod(fd, (mode & MODE_SYNC_MASK) as libc::mode_t)
}

fn mtime_spec(mtime_ns: i64) -> [libc::timespec; 2] {
    [
        libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_OMIT,
        },
        libc::timespec {
            tv_sec: mtime_ns.div_euclid(1_000_000_000),
            tv_nsec: mtime_ns.rem_euclid(1_000_000_000),
        },
    ]
}

fn set_mtime_fd(fd: BorrowedFd<'_>, mtime_ns: i64) -> io::Result<()> {
    sys::futimens(fd, &mtime_spec(mtime_ns))
}

/// Free bytes for unprivileged writers on the filesystem holding `path`.
pub fn free_bytes(path: &Path) -> Option<u64> {
    space(path).map(|(free, _)| free)
}

/// (free bytes for unprivileged writers, total bytes) of the filesystem holding `path`
/// (a [`crate::room::Space`]).
pub fn space(path: &Path) -> Option<(u64, u64)> {
    let c = CString::new(path.as_os_str().as_encoded_bytes()).ok()?;
    let st = sys::statvfs(&c).ok()?;
    Some((
        st.f_bavail.saturating_mul(st.f_frsize),
        st.f_blocks.saturating_mul(st.f_frsize),
    ))
}

/// How long before now a file's last change must lie for its unchanged stat to stand for its
/// content: a write in the same tick of the kernel's coarse clock (a few ms) as the change the
/// stat shows leaves mtime and ctime as they were. Short enough that a file moved or copied in
/// is served unhashed while its peers fetch it (D106).
pub const SETTLED: std::time::Duration = std::time::Duration::from_millis(100);

/// [`read_chunk_of`] for a chunk served to a peer from the file its location names (`f`, at
/// `path`). When the file's stat is `hashed` (the stat under which the journaled version was
/// hashed: same inode, size, mtime and ctime, the last change at least [`SETTLED`] ago) both
/// before and after the read, the bytes are what was hashed and are not hashed again: the
/// requester verifies every chunk anyway, and one that fails there fails only that fetch.
/// Otherwise the bytes are checked as [`read_chunk_of`] does.
pub fn read_served_chunk(
    f: &File,
    path: &RelPath,
    offset: u64,
    len: u32,
    hash: &Hash,
    hashed: Option<&LocalStat>,
) -> Result<Vec<u8>, StoreError> {
    let now_ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i64);
    served_chunk_at(f, path, (offset, len, hash), hashed, now_ns)
}

/// [`read_served_chunk`] at `now_ns` (ns since the Unix epoch).
fn served_chunk_at(
    f: &File,
    path: &RelPath,
    (offset, len, hash): (u64, u32, &Hash),
    hashed: Option<&LocalStat>,
    now_ns: i64,
) -> Result<Vec<u8>, StoreError> {
    let still = |h: &LocalStat| {
        sys::fstat(f.as_fd()).is_ok_and(|st| {
            let now = stat_of(&st).local;
            (now.inode, now.size, now.mtime_ns, now.ctime_ns)
                == (h.inode, h.size, h.mtime_ns, h.ctime_ns)
        })
    };
    let settled = |h: &LocalStat| h.ctime_ns.max(h.mtime_ns) <= now_ns - SETTLED.as_nanos() as i64;
    match hashed.filter(|h| settled(h) && still(h)) {
        Some(h) => {
            let buf =
                sys::pread_exact(f.as_fd(), len as usize, offset).map_err(|e| io_err(path, e))?;
            if still(h) {
                Ok(buf)
            } else {
                verified(path, buf, hash)
            }
        }
        None => read_chunk_of(f, path, offset, len, hash),
    }
}

/// Reads `len` bytes at `offset` of `f`, the open file at `path`, and checks they hash to
/// `hash`: a chunk read for a peer, which leaves only as the bytes its hash names.
pub fn read_chunk_of(
    f: &File,
    path: &RelPath,
    offset: u64,
    len: u32,
    hash: &Hash,
) -> Result<Vec<u8>, StoreError> {
    let buf = sys::pread_exact(f.as_fd(), len as usize, offset).map_err(|e| io_err(path, e))?;
    verified(path, buf, hash)
}

/// `buf`, read from `path`, if it hashes to `hash`.
fn verified(path: &RelPath, buf: Vec<u8>, hash: &Hash) -> Result<Vec<u8>, StoreError> {
    let got = Hash::of(&buf);
    if &got != hash {
        return Err(StoreError::Verify {
            path: path.clone(),
            got,
            want: *hash,
        });
    }
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    fn p(s: &str) -> RelPath {
        RelPath::new(s).unwrap()
    }

    #[test]
    fn install_replaces_only_what_it_expects() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let data = b"hello";
        let mut t = store.create_temp(&p("a/b/f.txt")).unwrap();
        store.write_temp(&mut t, 0, data).unwrap();
        store.finish_temp(&mut t, 5, 0o640, 1_000_000_000).unwrap();
        let st = store
            .install(vec![(t, Expect::Absent)])
            .pop()
            .unwrap()
            .unwrap();
        assert_eq!(std::fs::read(dir.path().join("a/b/f.txt")).unwrap(), data);
        assert_eq!(st.mode, 0o640);
        assert_eq!(st.mtime_ns, 1_000_000_000);
        // A second install expecting absence must not clobber the file.
        let mut t = store.create_temp(&p("a/b/f.txt")).unwrap();
        store.write_temp(&mut t, 0, b"other").unwrap();
        store.finish_temp(&mut t, 5, 0o644, 0).unwrap();
        let r = store.install(vec![(t, Expect::Absent)]).pop().unwrap();
        assert!(matches!(r, Err(StoreError::Changed(_))));
        assert_eq!(std::fs::read(dir.path().join("a/b/f.txt")).unwrap(), data);
        assert_eq!(
            store.remove_temps(),
            0,
            "a refused install leaves no temp file"
        );
    }

    #[test]
    fn reading_a_file_to_sync_it_leaves_its_access_time() {
        use std::io::Read;
        use std::time::{Duration, SystemTime};
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let old = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let atime = |name: &str| {
            std::fs::metadata(dir.path().join(name))
                .unwrap()
                .accessed()
                .unwrap()
        };
        for name in ["synced", "read"] {
            std::fs::write(dir.path().join(name), b"mail").unwrap();
            // Older than the file's mtime: a relatime mount updates it on the next read.
            let f = File::options()
                .write(true)
                .open(dir.path().join(name))
                .unwrap();
            f.set_times(std::fs::FileTimes::new().set_accessed(old))
                .unwrap();
        }
        std::fs::read(dir.path().join("read")).unwrap();
        if atime("read") == old {
            eprintln!("this filesystem keeps no access times (noatime): nothing to tell apart");
            return;
        }
        let mut got = Vec::new();
        store
            .open_file(&p("synced"))
            .unwrap()
            .read_to_end(&mut got)
            .unwrap();
        assert_eq!(got, b"mail");
        let hash = meshfs_protocol::Hash::of(b"mail");
        store
            .read_chunk_in(&mut DirCache::default(), &p("synced"), 0, 4, &hash)
            .unwrap();
        assert_eq!(
            atime("synced"),
            old,
            "the daemon's read is not the user's access"
        );
    }

    #[test]
    fn a_served_chunk_is_hashed_again_unless_its_file_is_as_hashed_and_settled() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f");
        std::fs::write(&file, b"0123456789").unwrap();
        let f = File::open(&file).unwrap();
        let hashed = stat_of(&sys::fstat(f.as_fd()).unwrap()).local;
        let (path, right, wrong) = (p("f"), Hash::of(b"2345"), Hash::of(b"else"));
        let later = hashed.ctime_ns + SETTLED.as_nanos() as i64;
        let read = |hash: &Hash, local: Option<&LocalStat>, now: i64| {
            served_chunk_at(&f, &path, (2, 4, hash), local, now)
        };
        // Unchanged and settled: the bytes as read, not hashed again (so a hash that does not
        // match is not noticed here: the requester's check is the one that counts).
        assert_eq!(read(&wrong, Some(&hashed), later).unwrap(), b"2345");
        // Unknown stat, or changed too recently to tell: hashed.
        for (local, now) in [(None, later), (Some(&hashed), later - 1)] {
            assert!(matches!(
                read(&wrong, local, now),
                Err(StoreError::Verify { .. })
            ));
            assert_eq!(read(&right, local, now).unwrap(), b"2345");
        }
        // Written since (the size tells, whatever the clock's tick): hashed, and what no
        // longer matches is refused.
        let w = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
        w.write_all_at(b"xy", 2).unwrap();
        w.write_all_at(b"!", 10).unwrap();
        let later = later + 10 * SETTLED.as_nanos() as i64;
        assert!(matches!(
            read(&right, Some(&hashed), later),
            Err(StoreError::Verify { .. })
        ));
        assert_eq!(
            read(&Hash::of(b"xy45"), Some(&hashed), later).unwrap(),
            b"xy45"
        );
    }

    #[test]
    fn local_chunks_are_copied_only_where_they_verify() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        // 100 chunks of 1 KiB (two lanes), from two source files; the second was edited since
        // the chunk index saw it, so its chunk 7 no longer verifies.
        let chunk = |i: u32| -> Vec<u8> { (0..1024u32).map(|b| (i * 7 + b) as u8).collect() };
        let whole: Vec<u8> = (0..100).flat_map(chunk).collect();
        std::fs::write(dir.path().join("src1"), &whole[..50 * 1024]).unwrap();
        let mut edited = whole[50 * 1024..].to_vec();
        edited[7 * 1024] ^= 1;
        std::fs::create_dir(dir.path().join("d")).unwrap();
        std::fs::write(dir.path().join("d/src2"), &edited).unwrap();
        let copies: Vec<LocalCopy> = (0..100u32)
            .map(|i| LocalCopy {
                offset: i as u64 * 1024,
                hash: Hash::of(&chunk(i)),
                len: 1024,
                sources: Arc::new(if i < 50 {
                    vec![(p("missing"), 0), (p("src1"), i as u64 * 1024)]
                } else {
                    vec![(p("d/src2"), (i - 50) as u64 * 1024)]
                }),
            })
            .collect();
        let mut t = store.create_temp(&p("out")).unwrap();
        let absent = store
            .copy_chunks_in(&mut DirCache::default(), &mut t, &copies, &HashMap::new())
            .unwrap();
        assert_eq!(absent, vec![57], "only the edited chunk is to be fetched");
        store.write_temp(&mut t, 57 * 1024, &chunk(57)).unwrap();
        store
            .finish_temp(&mut t, whole.len() as u64, 0o644, 0)
            .unwrap();
        store
            .install(vec![(t, Expect::Absent)])
            .pop()
            .unwrap()
            .unwrap();
        assert_eq!(std::fs::read(dir.path().join("out")).unwrap(), whole);
        // A copy that finds nothing leaves the temp file uncovered: it cannot be finished.
        let mut t = store.create_temp(&p("out2")).unwrap();
        let absent = store
            .copy_chunks_in(
                &mut DirCache::default(),
                &mut t,
                &copies[57..58],
                &HashMap::new(),
            )
            .unwrap();
        assert_eq!(absent, vec![0]);
        assert!(matches!(
            store.finish_temp(&mut t, 1024, 0o644, 0),
            Err(StoreError::Incomplete { .. })
        ));
        store.discard_temp(t);
    }

    /// Names in `dir` (one level) that are temp files.
    fn temps_in(dir: &Path) -> usize {
        std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with(TEMP_PREFIX))
            .count()
    }

    #[test]
    fn staged_temp_files_never_appear_in_the_replica() {
        let dir = tempfile::tempdir().unwrap();
        let state = tempfile::tempdir().unwrap();
        let staging = state.path().join("staging");
        let store = Store::open_staged(dir.path(), &staging).unwrap();
        std::fs::write(dir.path().join("old"), b"old").unwrap();
        let mut batch = Vec::new();
        for name in ["new", "old"] {
            let data = name.as_bytes();
            let mut t = store.create_temp(&p(name)).unwrap();
            store.write_temp(&mut t, 0, data).unwrap();
            store
                .finish_temp(&mut t, data.len() as u64, 0o644, 0)
                .unwrap();
            batch.push(t);
        }
        assert_eq!(
            temps_in(dir.path()),
            0,
            "assembly happens outside the replica"
        );
        assert_eq!(temps_in(&staging), 2);
        // "new" installs; "old" was expected absent but exists: refused, its temp removed.
        let results = store.install(batch.into_iter().map(|t| (t, Expect::Absent)).collect());
        assert!(results[0].is_ok());
        assert!(matches!(results[1], Err(StoreError::Changed(_))));
        assert_eq!(std::fs::read(dir.path().join("new")).unwrap(), b"new");
        assert_eq!(std::fs::read(dir.path().join("old")).unwrap(), b"old");
        assert_eq!(temps_in(&staging), 0);
        // A crash leaves staged temp files; the next start removes them.
        let mut t = store.create_temp(&p("d/f")).unwrap();
        store.write_temp(&mut t, 0, b"partial").unwrap();
        drop(t);
        let store = Store::open_staged(dir.path(), &staging).unwrap();
        assert_eq!(store.remove_temps(), 1);
        assert_eq!(temps_in(&staging), 0);
    }

    #[test]
    fn unnamed_temp_files_are_linked_in_and_leave_nothing_behind() {
        let dir = tempfile::tempdir().unwrap();
        let state = tempfile::tempdir().unwrap();
        let staging = state.path().join("staging");
        let store = Store::open_staged(dir.path(), &staging).unwrap();
        if store.staging.as_ref().and_then(|s| s.link).is_none() {
            // A filesystem without O_TMPFILE: named temp files (the other tests) are all there is.
            return;
        }
        std::fs::write(dir.path().join("old"), b"old").unwrap();
        std::fs::write(dir.path().join("taken"), b"mine").unwrap();
        let old = store.stat(&p("old")).unwrap().unwrap().local;
        let mut batch = Vec::new();
        for (name, expect) in [
            ("d/new", Expect::Absent),
            ("taken", Expect::Absent),
            ("old", Expect::Matches(old)),
        ] {
            let data = format!("{name} v2");
            let mut cache = DirCache::default();
            let mut t = store.create_temp_in(&mut cache, &p(name), true).unwrap();
            assert!(t.unnamed());
            store.write_temp(&mut t, 0, data.as_bytes()).unwrap();
            store.close_temp(&mut t);
            assert!(
                t.file.is_some(),
                "an unnamed temp file is never closed early"
            );
            store
                .finish_temp(&mut t, data.len() as u64, 0o640, 2_000_000_000)
                .unwrap();
            // The stat its install journals, taken here (outside the folder lock).
            let finished = t
                .finished
                .expect("an unnamed temp file's stat once finished");
            assert_eq!(
                (finished.size, finished.mode & 0o777),
                (data.len() as u64, 0o640)
            );
            assert_eq!(finished.mtime_ns, 2_000_000_000);
            batch.push((t, expect));
        }
        assert_eq!(
            temps_in(&staging),
            0,
            "unnamed files have no entry anywhere"
        );
        assert_eq!(temps_in(dir.path()), 0);
        let results = store.install(batch);
        let st = results[0].as_ref().unwrap();
        assert_eq!(
            std::fs::read(dir.path().join("d/new")).unwrap(),
            b"d/new v2"
        );
        assert_eq!(*st, store.stat(&p("d/new")).unwrap().unwrap().local);
        assert_eq!(st.mode & 0o777, 0o640);
        assert_eq!(st.mtime_ns, 2_000_000_000);
        // Expected absent but taken: refused, and the user's file is untouched.
        assert!(matches!(results[1], Err(StoreError::Changed(_))));
        assert_eq!(std::fs::read(dir.path().join("taken")).unwrap(), b"mine");
        // A replacement of the version the journal expects.
        assert!(results[2].is_ok());
        assert_eq!(std::fs::read(dir.path().join("old")).unwrap(), b"old v2");
        // A replacement whose target moved on is refused.
        let mut t = store
            .create_temp_in(&mut DirCache::default(), &p("old"), true)
            .unwrap();
        store.write_temp(&mut t, 0, b"v3").unwrap();
        store.finish_temp(&mut t, 2, 0o644, 0).unwrap();
        let r = store
            .install(vec![(t, Expect::Matches(old))])
            .pop()
            .unwrap();
        assert!(matches!(r, Err(StoreError::Changed(_))));
        assert_eq!(std::fs::read(dir.path().join("old")).unwrap(), b"old v2");
        // A crash (the temp dropped unfinished) leaves nothing to clean up.
        let mut t = store
            .create_temp_in(&mut DirCache::default(), &p("e/f"), true)
            .unwrap();
        store.write_temp(&mut t, 0, b"partial").unwrap();
        drop(t);
        // The replaced file was kept aside a while; once looked at, it is gone too.
        store.settle_displaced();
        assert_eq!(temps_in(&staging), 0);
        assert_eq!(store.remove_temps(), 0);
        assert!(!dir.path().join("e/f").exists());
    }

    #[test]
    fn a_preallocated_temp_file_holds_only_what_was_written_and_must_be_covered() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let size = 3 * PREALLOCATE_FROM;
        let data: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
        let mut t = store
            .create_temp_in(&mut DirCache::default(), &p("big"), false)
            .unwrap();
        // The room promised to it, as an apply claims it.
        let room = crate::room::Room::new(space);
        let place = crate::room::Place::of(dir.path()).unwrap();
        let claim = Arc::new(room.claim(&[(&place, size)]).unwrap().remove(0));
        t.set_claim(claim.clone());
        store.preallocate_temp(&mut t, size).unwrap();
        let meta = std::fs::metadata(dir.path().join(t.name.to_str().unwrap())).unwrap();
        // Its blocks are there (on a filesystem that preallocates), its size is not; the room
        // promised to it is let go of as the blocks are taken (else it counted twice).
        assert_eq!(meta.len(), 0);
        if meta.blocks() > 0 {
            assert!(meta.blocks() * 512 >= size, "{} blocks", meta.blocks());
            assert_eq!((claim.left(), room.claimed(&place)), (0, 0));
        }
        // Half written: not covered, refused; the size counts only written bytes.
        let half = (size / 2) as usize;
        store.write_temp(&mut t, 0, &data[..half]).unwrap();
        assert!(matches!(
            store.finish_temp(&mut t, size, 0o644, 0),
            Err(StoreError::Incomplete { .. })
        ));
        store
            .write_temp(&mut t, half as u64, &data[half..])
            .unwrap();
        store.finish_temp(&mut t, size, 0o644, 0).unwrap();
        let r = store.install(vec![(t, Expect::Absent)]).pop().unwrap();
        assert!(r.is_ok());
        assert_eq!(std::fs::read(dir.path().join("big")).unwrap(), data);
        // Below the threshold nothing is asked of the filesystem.
        let mut small = store
            .create_temp_in(&mut DirCache::default(), &p("small"), false)
            .unwrap();
        store.preallocate_temp(&mut small, 4096).unwrap();
        let meta = std::fs::metadata(dir.path().join(small.name.to_str().unwrap())).unwrap();
        assert_eq!(meta.blocks(), 0);
        store.discard_temp(small);
    }

    #[test]
    fn a_large_batch_installs_on_two_threads_with_results_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let state = tempfile::tempdir().unwrap();
        let store = Store::open_staged(dir.path(), &state.path().join("staging")).unwrap();
        let n = 3 * PARALLEL_INSTALL_FROM;
        let name = |i: usize| format!("d{}/f{i:03}", i / 50);
        std::fs::create_dir_all(dir.path().join("d1")).unwrap();
        // Every seventh target is taken: expected absent, so refused.
        for i in (0..n).step_by(7) {
            std::fs::create_dir_all(dir.path().join(format!("d{}", i / 50))).unwrap();
            std::fs::write(dir.path().join(name(i)), b"mine").unwrap();
        }
        let mut cache = DirCache::default();
        let batch: Vec<_> = (0..n)
            .map(|i| {
                let data = format!("v{i}");
                let mut t = store
                    .create_temp_in(&mut cache, &p(&name(i)), i % 2 == 0)
                    .unwrap();
                store.write_temp(&mut t, 0, data.as_bytes()).unwrap();
                store
                    .finish_temp(&mut t, data.len() as u64, 0o644, 0)
                    .unwrap();
                (t, Expect::Absent)
            })
            .collect();
        let seen = std::sync::Mutex::new(0usize);
        let results = store.install_synced_in(&mut cache, batch, &|_, _| {
            *seen.lock().unwrap() += 1;
        });
        assert_eq!(
            *seen.lock().unwrap(),
            n - n.div_ceil(7),
            "one call per installed file"
        );
        assert_eq!(results.len(), n);
        for (i, r) in results.iter().enumerate() {
            let on_disk = std::fs::read(dir.path().join(name(i))).unwrap();
            if i % 7 == 0 {
                assert!(matches!(r, Err(StoreError::Changed(_))), "{i}: {r:?}");
                assert_eq!(on_disk, b"mine");
            } else {
                let st = r.as_ref().unwrap();
                assert_eq!(on_disk, format!("v{i}").as_bytes());
                assert_eq!(*st, store.stat(&p(&name(i))).unwrap().unwrap().local, "{i}");
            }
        }
        assert_eq!(store.remove_temps(), 0, "no temp file left behind");
    }

    #[test]
    fn a_staging_directory_on_another_filesystem_is_not_used() {
        let dir = tempfile::tempdir().unwrap();
        let Ok(other) = tempfile::tempdir_in("/dev/shm") else {
            return;
        };
        let dev = |p: &Path| std::os::unix::fs::MetadataExt::dev(&std::fs::metadata(p).unwrap());
        assert_ne!(
            dev(dir.path()),
            dev(other.path()),
            "/dev/shm is its own filesystem"
        );
        let staging = other.path().join("staging");
        let store = Store::open_staged(dir.path(), &staging).unwrap();
        let mut t = store.create_temp(&p("f")).unwrap();
        store.write_temp(&mut t, 0, b"x").unwrap();
        assert_eq!(
            temps_in(dir.path()),
            1,
            "the temp file sits next to its target"
        );
        store.finish_temp(&mut t, 1, 0o644, 0).unwrap();
        assert!(store
            .install(vec![(t, Expect::Absent)])
            .pop()
            .unwrap()
            .is_ok());
        assert_eq!(std::fs::read(dir.path().join("f")).unwrap(), b"x");
    }

    #[test]
    fn a_temp_file_with_a_hole_is_refused_before_rename() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let mut t = store.create_temp(&p("f")).unwrap();
        // Four bytes long, but its first chunk never arrived.
        store.write_temp(&mut t, 1, b"bcd").unwrap();
        let r = store.finish_temp(&mut t, 4, 0o644, 0);
        assert!(matches!(r, Err(StoreError::Incomplete { written: 3, .. })));
        store.discard_temp(t);
        assert!(!dir.path().join("f").exists());
        assert_eq!(store.remove_temps(), 0);
    }

    #[test]
    fn symlinked_parents_are_never_followed() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(outside.path(), dir.path().join("link")).unwrap();
        let store = Store::open(dir.path()).unwrap();
        assert!(matches!(
            store.create_temp(&p("link/x")),
            Err(StoreError::Escape(_))
        ));
        assert!(matches!(
            store.make_dir(&p("link/d"), 0o755),
            Err(StoreError::Escape(_))
        ));
        assert_eq!(std::fs::read_dir(outside.path()).unwrap().count(), 0);
    }

    #[test]
    fn leftover_temps_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let mut t = store.create_temp(&p("d/x")).unwrap();
        store.write_temp(&mut t, 0, b"partial").unwrap();
        drop(t);
        assert_eq!(store.remove_temps(), 1);
    }
}
