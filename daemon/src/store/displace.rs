//! What an apply replaces or deletes is put aside, never dropped on a guess.
//!
//! A remote version replaces the file at its path only if that file is the version the
//! journal knows. Checking that and then renaming over the path leaves a window: a local write
//! between the check and the rename would be replaced without a trace, and a program that
//! holds the old file open keeps writing into a file nobody will ever read. So:
//!
//! 1. [`Old::open`] opens what is at the path, checks it is the expected file (inode, size,
//!    mtime), and takes a *read lease* on it: the kernel refuses one while anyone has the file
//!    open for writing (the apply waits for that writer: [`StoreError::Busy`]), and while it is
//!    held an open for writing or a truncate must break it first. From here the old file's
//!    content cannot change unnoticed.
//! 2. The new file and the old one swap places atomically (`renameat2(RENAME_EXCHANGE)`; a
//!    deletion moves the old file aside with one rename): the old file survives under the temp
//!    name, outside the folder.
//! 3. [`Old::verdict`] looks at the old file again: written since the check (its size or mtime
//!    moved), or someone began to open it for writing (the lease is breaking, or a second lease
//!    is refused). Then the swap is undone, the old file is back at its path with everything
//!    written to it, and the apply is told (`Changed`: capture that edit and decide again, so
//!    it meets the remote version as any concurrent edit does; `Busy`: wait for the writer).
//! 4. Otherwise the old file is kept aside for [`GRACE`] ([`Keeper`]) and looked at once more:
//!    a program whose `open()` had found the path just before the swap completes it on the old
//!    file, and what it writes there is kept as a conflict copy next to the path.
//!
//! Where leases are not available (a filesystem without them, a file owned by another user
//! and no `CAP_LEASE`), steps 3 and 4 still compare the old file's stat. Where the filesystem
//! has no `RENAME_EXCHANGE`, the old file is linked aside first and the path checked to still
//! hold it just before the rename (`docs/decisions.md`, D39, says what that leaves open).
//!
//! A crash while a file is kept aside leaves it in the staging directory with an extended
//! attribute naming its path and the stat it was kept with; start-up ([`recover`]) deletes it
//! if it is unchanged and otherwise moves it next to its path as a conflict copy.

use super::{cstr, io_err, lstat_at, stat_of, LocalStat, StoreError};
use meshfs_protocol::{RelPath, ShortId};
use meshfs_sys as sys;
use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// How long an old file is kept aside after a swap, for a writer whose open raced the swap.
pub const GRACE: Duration = Duration::from_secs(5);

/// The extended attribute a kept-aside file carries: `SIZE MTIME_NS PATH`.
const KEPT_XATTR: &CStr = c"user.meshfs.displaced";

/// Same file, same content as far as a stat can tell: the comparison the scanner makes.
pub(super) fn same_version(a: &LocalStat, b: &LocalStat) -> bool {
    a.inode == b.inode && a.size == b.size && a.mtime_ns == b.mtime_ns
}

/// The file at a target, opened and checked before an apply replaces or removes it.
pub(super) struct Old {
    fd: OwnedFd,
    /// Its stat when checked (the journal's expectation, ctime aside).
    st: LocalStat,
    /// A regular file (symlinks cannot be written, so need no lease).
    regular: bool,
    /// A read lease is held on it.
    leased: bool,
}

/// What became of the old file between its check and now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Unchanged, and nobody has it open for writing.
    Same,
    /// Written since the check.
    Written,
    /// Somebody has it open for writing, or is opening it so.
    Writer,
}

impl Old {
    /// Opens `name` in `dir` (the target `path`), which must be the file `want` describes.
    pub(super) fn open(
        dir: impl AsFd,
        name: &CStr,
        path: &RelPath,
        want: &LocalStat,
    ) -> Result<Old, StoreError> {
        let dir = dir.as_fd();
        // Non-blocking: an open that would have to break another holder's lease fails at once.
        let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK;
        let fd = match sys::openat(dir, name, flags, 0) {
            Ok(fd) => fd,
            Err(e) => match e.raw_os_error() {
                Some(libc::ENOENT) | Some(libc::ENXIO) => {
                    return Err(StoreError::Changed(path.clone()))
                }
                Some(libc::EWOULDBLOCK) => return Err(StoreError::Busy(path.clone())),
                // A symlink (or a special file, refused below by its stat).
                Some(libc::ELOOP) => sys::openat(dir, name, libc::O_PATH | libc::O_NOFOLLOW, 0)
                    .map_err(|e| io_err(path, e))?,
                _ => return Err(io_err(path, e)),
            },
        };
        let st = sys::fstat(fd.as_fd()).map_err(|e| io_err(path, e))?;
        let kind = st.st_mode & libc::S_IFMT;
        let local = stat_of(&st).local;
        if !matches!(kind, libc::S_IFREG | libc::S_IFLNK) || !same_version(want, &local) {
            return Err(StoreError::Changed(path.clone()));
        }
        let regular = kind == libc::S_IFREG;
        let leased = regular
            && match sys::set_lease(fd.as_fd(), libc::F_RDLCK) {
                Ok(()) => true,
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
                    if a_process_writes(st.st_dev, st.st_ino) {
                        return Err(StoreError::Busy(path.clone()));
                    }
                    // A write reference no process holds (see `a_process_writes`): no lease,
                    // as below.
                    false
                }
                // No leases here: the stat comparisons still hold.
                Err(_) => false,
            };
        Ok(Old {
            fd,
            st: local,
            regular,
            leased,
        })
    }

    /// Its descriptor (read-only; `fchmod` and `futimens` work through it).
    pub(super) fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    /// Its inode.
    pub(super) fn inode(&self) -> u64 {
        self.st.inode
    }

    /// Whether it is still as checked and free of writers.
    pub(super) fn verdict(&self) -> Verdict {
        let Ok(now) = sys::fstat(self.fd.as_fd()) else {
            return Verdict::Written;
        };
        let now = stat_of(&now).local;
        if now.size != self.st.size || now.mtime_ns != self.st.mtime_ns {
            return Verdict::Written;
        }
        if !self.regular {
            return Verdict::Same;
        }
        if self.leased {
            // A break has begun: someone is opening it for writing (or truncating it).
            if sys::get_lease(self.fd.as_fd()).ok() != Some(libc::F_RDLCK) {
                return Verdict::Writer;
            }
            // Asked again, the kernel checks again that nobody has it open for writing.
            if matches!(sys::set_lease(self.fd.as_fd(), libc::F_RDLCK), Err(e) if e.raw_os_error() == Some(libc::EAGAIN))
            {
                return Verdict::Writer;
            }
        } else if has_writer(&self.fd) {
            return Verdict::Writer;
        }
        Verdict::Same
    }

    /// Marks it, for a start-up after a crash, as kept aside for `path` (best effort: a
    /// filesystem without user extended attributes keeps no mark). Done before it is moved
    /// aside, so that a crash right after the move finds it marked: unmarked, it would be
    /// taken for a temp file and removed, and the version it holds lost.
    pub(super) fn mark(&self, path: &RelPath) {
        let value = format!("{} {} {}", self.st.size, self.st.mtime_ns, path);
        if self.regular {
            let _ = sys::fsetxattr(self.fd.as_fd(), KEPT_XATTR, value.as_bytes());
        }
    }

    /// Takes the mark off again: the file goes back to its path, or next to it as a conflict
    /// copy (a user's file carries nothing of ours).
    pub(super) fn unmark(&self) {
        if self.regular {
            let _ = sys::fremovexattr(self.fd.as_fd(), KEPT_XATTR);
        }
    }
}

impl Drop for Old {
    fn drop(&mut self) {
        if self.leased {
            let _ = sys::set_lease(self.fd.as_fd(), libc::F_UNLCK);
        }
    }
}

/// Whether anyone has the file `fd` open for writing: a read lease is refused then, and some
/// process holds it so ([`a_process_writes`]). `false` where leases are not available (nothing
/// can be told).
fn has_writer(fd: &OwnedFd) -> bool {
    match sys::set_lease(fd.as_fd(), libc::F_RDLCK) {
        Ok(()) => {
            let _ = sys::set_lease(fd.as_fd(), libc::F_UNLCK);
            false
        }
        Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
            sys::fstat(fd.as_fd()).map_or(true, |st| a_process_writes(st.st_dev, st.st_ino))
        }
        Err(_) => false,
    }
}

/// Whether a process has the file (`dev`, `ino`) open for writing, or mapped shared and
/// writable, by its entries in /proc — directly, or through a FUSE mount of the folder (a
/// mount's files have their backing files' inode numbers; a file with that number on any
/// virtual filesystem, device major 0, counts: at worst a remote version waits for nothing);
/// `true` when a process's entries cannot be read (nothing can be told of it: a daemon running
/// as a user cannot read root's). A lease refused while no process writes is a write reference
/// the kernel holds for nobody: Linux keeps the backing file of a FUSE passthrough open for
/// writing for a while after the mount's server was killed with requests in flight, and taking
/// that for a writer held remote versions of the file back (the randomized on-demand run,
/// seeds 1, 2 and 7; D101). A program that still has a file open for writing through the
/// dead mount writes to its backing file directly: while one does, every refused lease counts
/// (which file it holds cannot be told: it cannot be stat'ed, and its inode number may be that
/// of a placeholder the file replaced).
fn a_process_writes(dev: libc::dev_t, ino: libc::ino_t) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return true;
    };
    let dev_hex = format!("{:02x}:{:02x}", libc::major(dev), libc::minor(dev));
    let ino_text = ino.to_string();
    for p in procs.flatten() {
        let name = p.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        let fds = match std::fs::read_dir(format!("/proc/{pid}/fd")) {
            Ok(fds) => fds,
            // Exited meanwhile.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(_) => return true,
        };
        for fd in fds.flatten() {
            match std::fs::metadata(fd.path()) {
                Ok(md) if md.ino() != ino || (md.dev() != dev && libc::major(md.dev()) != 0) => {
                    continue
                }
                // The file, or a mount's file with its number.
                Ok(_) => {}
                // Closed meanwhile.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                // A file on a dead FUSE mount cannot be stat'ed (its server is gone), and its
                // inode number may be a replaced placeholder's: which file it is cannot be
                // told, so any writer there counts.
                Err(_) => {}
            }
            let info = std::fs::read_to_string(format!(
                "/proc/{pid}/fdinfo/{}",
                fd.file_name().to_string_lossy()
            ))
            .unwrap_or_default();
            if info.is_empty() {
                continue;
            }
            let flags = info
                .lines()
                .find_map(|l| l.strip_prefix("flags:"))
                .and_then(|f| u32::from_str_radix(f.trim(), 8).ok());
            // O_WRONLY or O_RDWR (or unreadable: counted as a writer).
            if flags.is_none_or(|f| f & libc::O_ACCMODE as u32 != libc::O_RDONLY as u32) {
                return true;
            }
        }
        // `maps`: address, permissions, offset, device, inode, path.
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
        let mapped = maps.lines().any(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() >= 5
                && (f[3] == dev_hex || f[3].starts_with("00:"))
                && f[4] == ino_text
                && f[1].contains('w')
                && f[1].contains('s')
        });
        if mapped {
            return true;
        }
    }
    false
}

/// Whether another program has `name` in `dir` open for writing (a regular file only; `false`
/// when nothing can be told). What decides whether a remote version must wait for a writer.
pub(super) fn open_for_writing(dir: impl AsFd, name: &CStr) -> bool {
    let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK;
    match sys::openat(dir.as_fd(), name, flags, 0) {
        Ok(fd) => sys::fstat(fd.as_fd())
            .is_ok_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFREG && has_writer(&fd)),
        // Another holder's lease that does not give way at once: a writer.
        Err(e) => e.raw_os_error() == Some(libc::EWOULDBLOCK),
    }
}

/// The name of a conflict copy of `path` kept on this device `by`, from its mtime.
pub(super) fn kept_name(path: &RelPath, mtime_ns: i64, by: ShortId) -> RelPath {
    meshfs_sync::reconcile::local_conflict_name(path, mtime_ns, by)
}

/// Moves `name` in `from` to a fresh conflict-copy name next to `path` (in `dir`, or the
/// folder root `root` if `dir` is gone). Never replaces anything.
pub(super) fn keep_as_copy(
    from: impl AsFd,
    name: &CStr,
    dir: impl AsFd,
    path: &RelPath,
    by: ShortId,
) -> Result<RelPath, StoreError> {
    let st = lstat_at(from.as_fd(), name).map_err(|e| io_err(path, e))?;
    let mtime = stat_of(&st).local.mtime_ns;
    let base = kept_name(path, mtime, by);
    for n in 0..100u32 {
        let candidate = if n == 0 {
            base.clone()
        } else {
            let tagged = format!("{}-{n}", base.file_name());
            base.with_file_name(&tagged)
                .unwrap_or_else(|_| base.clone())
        };
        let c = cstr(candidate.file_name())?;
        match sys::renameat2(from.as_fd(), name, dir.as_fd(), &c, libc::RENAME_NOREPLACE) {
            Ok(()) => {
                tracing::warn!(%path, copy = %candidate, "a local write raced a remote version; kept as a conflict copy");
                return Ok(candidate);
            }
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => continue,
            Err(e) => return Err(io_err(path, e)),
        }
    }
    Err(io_err(path, io::Error::from_raw_os_error(libc::EEXIST)))
}

/// An old file kept aside for [`GRACE`], and for as long as the keeper of past versions still
/// reads it ([`Displaced`]).
struct Kept {
    /// The directory it is in (staging, or its target's) and its name there.
    dir: Arc<OwnedFd>,
    name: CString,
    /// Its stat once kept. Compared as the scanner compares (inode, size, mtime), never by
    /// ctime: the file is often also a conflict sibling (`Store::preserve_as` links the local
    /// loser's content to its sibling name before the swap), so its ctime moves when that
    /// name is renamed, deleted, chmodded or kept aside in turn, none of which is a write.
    st: LocalStat,
    /// Where it came from, and that path's directory (for a conflict copy).
    path: RelPath,
    target_dir: Arc<OwnedFd>,
    until: Instant,
    /// Shared with the [`Displaced`] handed over, if any: while that lives, the file keeps its
    /// name aside (a crash before its content is kept leaves it for the next start).
    held: Arc<()>,
}

/// A file an apply replaced or deleted, handed over as it is kept aside: the content of a
/// version leaving the tree, for the engine to keep what it needs of it (`crate::versions`)
/// off the folder's lock. The descriptor is the file's own (read-only). The file keeps its
/// (marked) name aside until this is dropped, whatever the grace: the receiver drops it once
/// the content is kept, or it will not be, so a crash before then leaves the file for the next
/// start to hand over again ([`recover`]).
#[derive(Debug)]
pub struct Displaced {
    /// Where it was.
    pub path: RelPath,
    /// Its stat when it was checked against the journal (inode, size, mtime).
    pub stat: LocalStat,
    /// The file, open for reading.
    pub file: std::fs::File,
    _hold: Hold,
}

/// What keeps a [`Displaced`] file's name aside until it is dropped.
enum Hold {
    /// A file kept aside by a running install: the store's keeper removes it after its grace,
    /// once this is gone.
    Shared(#[allow(dead_code)] Arc<()>),
    /// A file found aside at start-up: removed when this is dropped.
    Unlink(Arc<OwnedFd>, CString),
}

impl std::fmt::Debug for Hold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Hold")
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        if let Hold::Unlink(dir, name) = self {
            let _ = sys::unlinkat(dir.as_fd(), name, 0);
        }
    }
}

/// Where displaced files go ([`Displaced`]). Called on the installing thread: it must not
/// block, nor take the journal or the folder's lock (an install may hold both).
pub type DisplacedSink = Arc<dyn Fn(Displaced) + Send + Sync>;

/// The old files kept aside, each looked at once more after [`GRACE`] by a thread of its own
/// (started when the first file is kept, gone when none is left).
#[derive(Default)]
pub(super) struct Keeper {
    state: Arc<(Mutex<KeeperState>, Condvar)>,
    /// Told of every regular file kept aside, if set.
    sink: std::sync::OnceLock<DisplacedSink>,
}

#[derive(Default)]
struct KeeperState {
    kept: Vec<Kept>,
    running: bool,
    /// The device conflict copies are named after.
    by: ShortId,
}

impl std::fmt::Debug for Keeper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keeper").finish_non_exhaustive()
    }
}

impl Keeper {
    /// Names conflict copies after device `by`.
    pub(super) fn set_device(&self, by: ShortId) {
        if let Ok(mut s) = self.state.0.lock() {
            s.by = by;
        }
    }

    /// The device conflict copies are named after.
    pub(super) fn device(&self) -> ShortId {
        self.state.0.lock().map(|s| s.by).unwrap_or_default()
    }

    /// Hands every regular file kept aside from now on to `sink` too (once; later calls are
    /// ignored).
    pub(super) fn on_displaced(&self, sink: DisplacedSink) {
        let _ = self.sink.set(sink);
    }

    /// Where displaced files go, once set.
    pub(super) fn sink(&self) -> Option<&DisplacedSink> {
        self.sink.get()
    }

    /// Keeps `old`, now at `name` in `dir`, for [`GRACE`]; `path` is where it was, in
    /// `target_dir`. The caller marked it ([`Old::mark`]) before it moved it there.
    /// `hand_over`: it is a version that leaves, for the sink (not when its replacement holds
    /// the same version: a fetched content or an eviction).
    pub(super) fn keep(
        &self,
        old: Old,
        dir: Arc<OwnedFd>,
        name: CString,
        path: &RelPath,
        target_dir: Arc<OwnedFd>,
        hand_over: bool,
    ) {
        let st = match sys::fstat(old.fd.as_fd()) {
            Ok(st) => stat_of(&st).local,
            Err(_) => old.st,
        };
        let held = Arc::new(());
        if let (Some(sink), true) = (self.sink.get().filter(|_| hand_over), old.regular) {
            // A descriptor of its own: the old one's lease goes with `old`.
            if let Ok(fd) = old.fd.try_clone() {
                sink(Displaced {
                    path: path.clone(),
                    stat: old.st,
                    file: std::fs::File::from(fd),
                    _hold: Hold::Shared(held.clone()),
                });
            }
        }
        drop(old);
        self.watch(vec![Kept {
            dir,
            name,
            st,
            path: path.clone(),
            target_dir,
            until: Instant::now() + GRACE,
            held,
        }]);
    }

    /// Adds `kept` to the files looked at when their time comes, starting the thread that
    /// looks if it is not running.
    fn watch(&self, kept: Vec<Kept>) {
        if kept.is_empty() {
            return;
        }
        let (lock, wake) = &*self.state;
        let Ok(mut s) = lock.lock() else { return };
        s.kept.extend(kept);
        if !s.running {
            s.running = true;
            let state = self.state.clone();
            let spawned = std::thread::Builder::new()
                .name("meshfs-keeper".into())
                .spawn(move || {
                    crate::priority::background();
                    run(state)
                });
            if spawned.is_err() {
                s.running = false;
            }
        }
        wake.notify_one();
    }

    /// Looks at every kept file now (not waiting out its grace); for tests and shutdown. One
    /// the keeper of past versions still reads is looked at again later (and at a stop stays
    /// where it is, marked, for the next start).
    pub(super) fn settle_all(&self) {
        let (lock, _) = &*self.state;
        let (due, by) = match lock.lock() {
            Ok(mut s) => (std::mem::take(&mut s.kept), s.by),
            Err(_) => return,
        };
        let again: Vec<Kept> = due.into_iter().filter_map(|k| settle(k, by)).collect();
        self.watch(again);
    }
}

fn run(state: Arc<(Mutex<KeeperState>, Condvar)>) {
    let (lock, wake) = &*state;
    let Ok(mut s) = lock.lock() else { return };
    loop {
        let now = Instant::now();
        let Some(next) = s.kept.iter().map(|k| k.until).min() else {
            s.running = false;
            return;
        };
        if next > now {
            s = match wake.wait_timeout(s, next - now) {
                Ok((s, _)) => s,
                Err(_) => return,
            };
            continue;
        }
        let (due, rest): (Vec<Kept>, Vec<Kept>) = std::mem::take(&mut s.kept)
            .into_iter()
            .partition(|k| k.until <= now);
        s.kept = rest;
        let by = s.by;
        drop(s);
        let mut again = Vec::new();
        for k in due {
            if let Some(k) = settle(k, by) {
                again.push(k);
            }
        }
        s = match lock.lock() {
            Ok(s) => s,
            Err(_) => return,
        };
        s.kept.extend(again);
    }
}

/// How soon a kept file is looked at again while the keeper of past versions still reads it.
const HELD_AGAIN: Duration = Duration::from_millis(500);

/// Looks at a kept file whose grace is over: dropped if unchanged and free of writers, kept
/// as a conflict copy if written, looked at again later while someone has it open for writing
/// or the keeper of past versions has not kept its content yet.
fn settle(mut k: Kept, by: ShortId) -> Option<Kept> {
    if Arc::strong_count(&k.held) > 1 {
        k.until = Instant::now() + HELD_AGAIN;
        return Some(k);
    }
    let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK;
    let fd = match sys::openat(k.dir.as_fd(), &k.name, flags, 0) {
        Ok(fd) => fd,
        Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) => {
            k.until = Instant::now() + GRACE;
            return Some(k);
        }
        // A symlink (O_NOFOLLOW) cannot have been written; anything else is gone already.
        Err(_) => {
            let _ = sys::unlinkat(k.dir.as_fd(), &k.name, 0);
            return None;
        }
    };
    if has_writer(&fd) {
        k.until = Instant::now() + GRACE;
        return Some(k);
    }
    let unchanged = sys::fstat(fd.as_fd()).is_ok_and(|st| same_version(&stat_of(&st).local, &k.st));
    drop(fd);
    if unchanged {
        let _ = sys::unlinkat(k.dir.as_fd(), &k.name, 0);
    } else if let Err(e) = keep_as_copy(&*k.dir, &k.name, &*k.target_dir, &k.path, by) {
        tracing::error!(path = %k.path, error = %e, "a write to a replaced file could not be kept as a conflict copy; it stays in the staging directory");
    }
    None
}

/// At start-up: a temp-named file `name` in `dir` is either a temp file (no mark: `false`, the
/// caller removes it) or an old file kept aside when the daemon stopped. That one is removed
/// if unchanged (handed to `sink` first, as a displaced file: a crash between an install and
/// the keeping of what it replaced loses no past version), else moved next to its path (found
/// from `root`) as a conflict copy. Returns `true` when it was dealt with here.
pub(super) fn recover(
    dir: impl AsFd,
    name: &CStr,
    root: impl AsFd,
    open_dir: impl Fn(&RelPath) -> Option<Arc<OwnedFd>>,
    by: ShortId,
    sink: Option<&DisplacedSink>,
) -> bool {
    let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK;
    let Ok(fd) = sys::openat(dir.as_fd(), name, flags, 0) else {
        return false;
    };
    let Ok(mark) = sys::fgetxattr(fd.as_fd(), KEPT_XATTR) else {
        return false;
    };
    let Some((size, mtime, path)) = parse_mark(&mark) else {
        return false;
    };
    let st = sys::fstat(fd.as_fd()).ok().map(|st| stat_of(&st).local);
    let unchanged = st.is_some_and(|l| l.size == size && l.mtime_ns == mtime);
    if let (true, Some(sink), Some(stat)) = (unchanged, sink, st) {
        // Read-only, so the keeper's reads never count as a writer. The name goes when the
        // keeper is done with it: killed before then, the next start hands it over again.
        let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK;
        let ro = sys::openat(dir.as_fd(), name, flags, 0);
        let own_dir = dir.as_fd().try_clone_to_owned();
        if let (Ok(ro), Ok(own_dir)) = (ro, own_dir) {
            sink(Displaced {
                path: path.clone(),
                stat,
                file: std::fs::File::from(ro),
                _hold: Hold::Unlink(Arc::new(own_dir), name.to_owned()),
            });
            return true;
        }
    }
    drop(fd);
    if unchanged {
        let _ = sys::unlinkat(dir.as_fd(), name, 0);
        return true;
    }
    let kept = match path.parent().as_ref().map_or_else(
        || {
            sys::openat(root.as_fd(), c".", libc::O_RDONLY | libc::O_DIRECTORY, 0)
                .ok()
                .map(Arc::new)
        },
        &open_dir,
    ) {
        Some(target_dir) => keep_as_copy(dir.as_fd(), name, &*target_dir, &path, by),
        None => keep_as_copy(dir.as_fd(), name, root.as_fd(), &path, by),
    };
    if let Err(e) = kept {
        tracing::error!(%path, error = %e, "a file written after a remote version replaced it could not be recovered; it stays in the staging directory");
    }
    true
}

fn parse_mark(mark: &[u8]) -> Option<(u64, i64, RelPath)> {
    let s = std::str::from_utf8(mark).ok()?;
    let mut parts = s.splitn(3, ' ');
    let size = parts.next()?.parse().ok()?;
    let mtime = parts.next()?.parse().ok()?;
    let path = RelPath::new(parts.next()?).ok()?;
    Some((size, mtime, path))
}

#[cfg(test)]
mod tests {
    use super::super::{DirCache, Expect, Store};
    use super::*;
    use std::fs::OpenOptions;
    use std::io::Write;

    #[test]
    fn a_writer_is_a_process_holding_the_file_for_writing_or_mapped_shared_and_writable() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        std::fs::write(&p, vec![1u8; 4096]).unwrap();
        let md = std::fs::metadata(&p).unwrap();
        let (dev, ino) = (md.dev(), md.ino());
        // SAFETY: no arguments, no memory.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!(
                "not root: other users' processes cannot be read, every lease refusal counts"
            );
            return;
        }
        let reader = std::fs::File::open(&p).unwrap();
        assert!(!a_process_writes(dev, ino), "a reader is no writer");
        let writer = OpenOptions::new().append(true).open(&p).unwrap();
        assert!(a_process_writes(dev, ino));
        drop(writer);
        assert!(!a_process_writes(dev, ino));
        // A shared writable mapping outlives its descriptor.
        let rw = OpenOptions::new().read(true).write(true).open(&p).unwrap();
        // SAFETY: a fresh mapping of 4096 bytes of an open file, unmapped below.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                std::os::fd::AsRawFd::as_raw_fd(&rw),
                0,
            )
        };
        assert_ne!(map, libc::MAP_FAILED);
        drop(rw);
        assert!(a_process_writes(dev, ino), "mapped shared and writable");
        // SAFETY: the mapping made above.
        unsafe { libc::munmap(map, 4096) };
        assert!(!a_process_writes(dev, ino));
        drop(reader);
    }
    use std::path::Path;

    fn p(s: &str) -> RelPath {
        RelPath::new(s).unwrap()
    }

    /// A store with a staging directory, and the directories behind it.
    fn staged() -> (Store, tempfile::TempDir, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let state = tempfile::tempdir().unwrap();
        let store = Store::open_staged(dir.path(), &state.path().join("staging")).unwrap();
        store.set_device(ShortId(7));
        (store, dir, state)
    }

    /// Installs `data` at `path` as a remote version would be, expecting `expect` there; the
    /// temp file is unnamed (`unnamed`) or named.
    fn install(
        store: &Store,
        path: &str,
        data: &[u8],
        expect: Expect,
        unnamed: bool,
    ) -> Result<LocalStat, StoreError> {
        let mut t = store
            .create_temp_in(&mut DirCache::default(), &p(path), unnamed)
            .unwrap();
        store.write_temp(&mut t, 0, data).unwrap();
        store.close_temp(&mut t);
        store
            .finish_temp(&mut t, data.len() as u64, 0o644, 1_000_000_000)
            .unwrap();
        store.install(vec![(t, expect)]).pop().unwrap()
    }

    /// What the store sees at `path` now.
    fn local(store: &Store, path: &str) -> LocalStat {
        store.stat(&p(path)).unwrap().unwrap().local
    }

    /// The conflict copies next to `name` in `dir`.
    fn copies(dir: &Path, name: &str) -> Vec<String> {
        files_in(dir)
            .into_iter()
            .filter(|f| f.starts_with(name) && f.contains(".sync-conflict-"))
            .collect()
    }

    #[test]
    fn a_file_open_for_writing_is_not_replaced_and_its_version_waits() {
        let (store, dir, state) = staged();
        for unnamed in [false, true] {
            std::fs::write(dir.path().join("doc"), b"mine").unwrap();
            let before = local(&store, "doc");
            let mut writer = OpenOptions::new()
                .append(true)
                .open(dir.path().join("doc"))
                .unwrap();
            assert!(store.open_for_writing(&p("doc")));
            let r = install(&store, "doc", b"theirs", Expect::Matches(before), unnamed);
            assert!(matches!(r, Err(StoreError::Busy(_))), "{r:?}");
            // The writer goes on writing into the file at the path.
            writer.write_all(b" and more").unwrap();
            drop(writer);
            assert_eq!(
                std::fs::read(dir.path().join("doc")).unwrap(),
                b"mine and more"
            );
            assert!(!store.open_for_writing(&p("doc")));
            assert!(files_in(&state.path().join("staging")).is_empty());
            let r = store.remove_file(&p("doc"), Expect::Matches(local(&store, "doc")));
            assert!(r.is_ok());
            store.settle_displaced();
        }
    }

    #[test]
    fn a_file_being_deleted_while_open_for_writing_stays() {
        let (store, dir, _state) = staged();
        std::fs::write(dir.path().join("log"), b"line\n").unwrap();
        let before = local(&store, "log");
        let writer = OpenOptions::new()
            .append(true)
            .open(dir.path().join("log"))
            .unwrap();
        let r = store.remove_file(&p("log"), Expect::Matches(before));
        assert!(matches!(r, Err(StoreError::Busy(_))), "{r:?}");
        drop(writer);
        assert!(dir.path().join("log").exists());
    }

    #[test]
    fn a_write_that_reaches_a_replaced_file_after_the_swap_is_kept_as_a_conflict_copy() {
        let (store, dir, state) = staged();
        std::fs::write(dir.path().join("notes.txt"), b"old").unwrap();
        let before = local(&store, "notes.txt");
        install(
            &store,
            "notes.txt",
            b"remote",
            Expect::Matches(before),
            true,
        )
        .unwrap();
        assert_eq!(
            std::fs::read(dir.path().join("notes.txt")).unwrap(),
            b"remote"
        );
        // A program whose open found the old file just before the swap writes into it.
        let staging = state.path().join("staging");
        let kept = files_in(&staging);
        assert_eq!(kept.len(), 1, "the old file is kept aside a while");
        std::fs::write(staging.join(&kept[0]), b"old, edited late").unwrap();
        store.settle_displaced();
        let c = copies(dir.path(), "notes");
        assert_eq!(c.len(), 1, "{:?}", files_in(dir.path()));
        assert_eq!(
            std::fs::read(dir.path().join(&c[0])).unwrap(),
            b"old, edited late"
        );
        assert!(c[0].ends_with(".txt"));
        assert!(files_in(&staging).is_empty());
        // Unwritten, a kept-aside file just goes.
        let before = local(&store, "notes.txt");
        install(
            &store,
            "notes.txt",
            b"remote 2",
            Expect::Matches(before),
            false,
        )
        .unwrap();
        store.settle_displaced();
        assert!(files_in(&staging).is_empty());
        assert_eq!(copies(dir.path(), "notes").len(), 1);
    }

    /// Seed 41 of `tests/chaos.rs` (3 devices): the local loser of a conflict was linked to
    /// its sibling name, the winner swapped in, and a peer's deletion of the sibling arrived
    /// within the grace; the kept file's ctime had moved, so it was "kept" as a new conflict
    /// copy of content the user had just deleted (and once more at shutdown).
    #[test]
    fn a_kept_file_whose_sibling_name_is_renamed_or_deleted_in_its_grace_is_not_copied() {
        let (store, dir, state) = staged();
        std::fs::write(dir.path().join("f"), b"mine").unwrap();
        let before = local(&store, "f");
        // The local loser of a conflict: its content gets the sibling's name too.
        store
            .preserve_as(&p("f"), &p("f.sync-conflict-x"), Expect::Matches(before))
            .unwrap();
        install(&store, "f", b"theirs", Expect::Matches(before), true).unwrap();
        // Within the grace, the sibling is renamed, then deleted as a peer's deletion is
        // (which keeps the same file aside a second time).
        std::fs::rename(dir.path().join("f.sync-conflict-x"), dir.path().join("g")).unwrap();
        let g = local(&store, "g");
        store.remove_file(&p("g"), Expect::Matches(g)).unwrap();
        store.settle_displaced();
        assert_eq!(files_in(dir.path()), vec!["f".to_string()]);
        assert!(files_in(&state.path().join("staging")).is_empty());
        assert_eq!(std::fs::read(dir.path().join("f")).unwrap(), b"theirs");
    }

    #[test]
    fn a_file_kept_aside_when_the_daemon_stopped_is_recovered_only_if_it_was_written() {
        let (store, dir, state) = staged();
        std::fs::create_dir(dir.path().join("d")).unwrap();
        for name in ["d/a", "d/b"] {
            std::fs::write(dir.path().join(name), b"old").unwrap();
            let before = local(&store, name);
            install(&store, name, b"new", Expect::Matches(before), true).unwrap();
        }
        let staging = state.path().join("staging");
        let kept = files_in(&staging);
        assert_eq!(kept.len(), 2);
        // The daemon stops before their grace is over; one of them is written meanwhile.
        let (a, b) = (staging.join(&kept[0]), staging.join(&kept[1]));
        std::fs::write(&a, b"written after the swap").unwrap();
        drop(store);
        let store = Store::open_staged(dir.path(), &staging).unwrap();
        store.set_device(ShortId(7));
        assert_eq!(
            store.remove_temps(),
            0,
            "kept-aside files are not temp files"
        );
        assert!(!a.exists() && !b.exists());
        let mut recovered = copies(&dir.path().join("d"), "a");
        recovered.extend(copies(&dir.path().join("d"), "b"));
        assert_eq!(recovered.len(), 1, "{:?}", files_in(&dir.path().join("d")));
        assert_eq!(
            std::fs::read(dir.path().join("d").join(&recovered[0])).unwrap(),
            b"written after the swap"
        );
    }

    /// A sink that keeps what it is handed, as the keeper of past versions does until the
    /// content is in its vault.
    fn holding_sink(store: &Store) -> Arc<Mutex<Vec<Displaced>>> {
        let held: Arc<Mutex<Vec<Displaced>>> = Arc::default();
        let h = held.clone();
        store.on_displaced(Arc::new(move |d| h.lock().unwrap().push(d)));
        held
    }

    #[test]
    fn a_replaced_file_keeps_its_name_aside_until_the_keeper_of_versions_lets_it_go() {
        let (store, dir, state) = staged();
        let held = holding_sink(&store);
        std::fs::write(dir.path().join("f"), b"old").unwrap();
        let before = local(&store, "f");
        install(&store, "f", b"new", Expect::Matches(before), true).unwrap();
        let staging = state.path().join("staging");
        store.settle_displaced();
        assert_eq!(files_in(&staging).len(), 1, "still read by the keeper");
        held.lock().unwrap().clear();
        store.settle_displaced();
        assert!(files_in(&staging).is_empty());
    }

    #[test]
    fn a_file_found_aside_at_start_goes_only_once_the_keeper_of_versions_lets_it_go() {
        let (store, dir, state) = staged();
        std::fs::write(dir.path().join("f"), b"old").unwrap();
        let before = local(&store, "f");
        install(&store, "f", b"new", Expect::Matches(before), true).unwrap();
        let staging = state.path().join("staging");
        // Killed before its grace was over: the next start finds it aside, marked.
        drop(store);
        let store = Store::open_staged(dir.path(), &staging).unwrap();
        let held = holding_sink(&store);
        store.remove_temps();
        assert_eq!(held.lock().unwrap().len(), 1);
        assert_eq!(files_in(&staging).len(), 1, "until the keeper is done");
        // Killed again before the keeper was done: the start after hands it over again.
        let again = Store::open_staged(dir.path(), &staging).unwrap();
        let held_again = holding_sink(&again);
        again.remove_temps();
        assert_eq!(held_again.lock().unwrap().len(), 1);
        held.lock().unwrap().clear();
        held_again.lock().unwrap().clear();
        assert!(files_in(&staging).is_empty());
        assert_eq!(std::fs::read(dir.path().join("f")).unwrap(), b"new");
    }

    #[test]
    fn a_file_swapped_out_is_marked_before_the_swap_and_a_user_file_never_keeps_the_mark() {
        let (store, dir, state) = staged();
        std::fs::write(dir.path().join("f"), b"old").unwrap();
        let before = local(&store, "f");
        install(&store, "f", b"new", Expect::Matches(before), true).unwrap();
        let staging = state.path().join("staging");
        let kept = files_in(&staging);
        let f = std::fs::File::open(staging.join(&kept[0])).unwrap();
        assert!(sys::fgetxattr(f.as_fd(), KEPT_XATTR).is_ok(), "marked");
        // A write between the check and the swap puts the old file back, unmarked.
        std::fs::write(dir.path().join("g"), b"mine").unwrap();
        let g = local(&store, "g");
        std::fs::write(dir.path().join("g"), b"mine, written since").unwrap();
        let r = install(&store, "g", b"theirs", Expect::Matches(g), true);
        assert!(matches!(r, Err(StoreError::Changed(_))), "{r:?}");
        let g = std::fs::File::open(dir.path().join("g")).unwrap();
        assert!(sys::fgetxattr(g.as_fd(), KEPT_XATTR).is_err());
        let f = std::fs::File::open(dir.path().join("f")).unwrap();
        assert!(sys::fgetxattr(f.as_fd(), KEPT_XATTR).is_err());
        store.settle_displaced();
    }

    #[test]
    fn the_stat_journaled_for_an_install_is_never_one_a_later_write_made() {
        let (store, dir, _state) = staged();
        let ours = install(&store, "f", b"remote", Expect::Absent, true).unwrap();
        // Right after: the path's stat is what was installed.
        assert_eq!(ours, local(&store, "f"));
        std::fs::write(dir.path().join("f"), b"local!").unwrap();
        let now = local(&store, "f");
        assert!(!same_version(&ours, &now), "the scanner sees the write");
    }

    fn files_in(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn a_kept_mark_round_trips_and_a_foreign_one_is_refused() {
        let p = RelPath::new("d/a b.txt").unwrap();
        let mark = format!("{} {} {}", 12, -5, p);
        assert_eq!(parse_mark(mark.as_bytes()), Some((12, -5, p)));
        assert_eq!(parse_mark(b"12 x d/a"), None);
        assert_eq!(parse_mark(b"12 3 ../escape"), None);
    }
}
