//! The Linux syscalls the passthrough makes, as safe functions over file descriptors, answering
//! the errno the kernel gave. The calls the engine makes too (open, mkdir, unlink, rename,
//! symlink, readlink, fsync) are `meshfs-sys`'s, their one home; this module turns their
//! `io::Error` back into the errno.
//!
//! Owns every other `unsafe` block of the request path (the mount module has a few more for
//! `umount2`). Each wrapper returns the errno the backing filesystem returned, untouched, so
//! a failure seen through the mount is the failure ext4 gave.
//!
//! **Invariant:** no wrapper follows a symbolic link in a path it is given: paths are
//! resolved with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` below the backing root, and
//! single names with `*at` calls and `AT_SYMLINK_NOFOLLOW` / `O_NOFOLLOW`. The one place a
//! link is followed on purpose is `/proc/self/fd/N`, which names exactly the inode the
//! descriptor holds.

use std::ffi::{CStr, CString, OsStr, OsString};
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};

/// An errno from the kernel (positive).
pub(crate) type Errno = i32;
/// The result of a syscall: its value or the errno it failed with.
pub(crate) type SysResult<T> = Result<T, Errno>;

/// The errno of an error from a `meshfs_sys` call (every one carries the kernel's).
fn errno(e: std::io::Error) -> Errno {
    e.raw_os_error().unwrap_or(libc::EIO)
}

fn last_errno() -> Errno {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

fn check(ret: libc::c_int) -> SysResult<libc::c_int> {
    if ret < 0 {
        Err(last_errno())
    } else {
        Ok(ret)
    }
}

fn check_long(ret: libc::c_long) -> SysResult<libc::c_long> {
    if ret < 0 {
        Err(last_errno())
    } else {
        Ok(ret)
    }
}

fn check_size(ret: libc::ssize_t) -> SysResult<usize> {
    if ret < 0 {
        Err(last_errno())
    } else {
        Ok(ret as usize)
    }
}

/// `name` as a C string; a NUL inside is `EINVAL` (the kernel never sends one).
pub(crate) fn cstr(name: &OsStr) -> SysResult<CString> {
    CString::new(name.as_bytes()).map_err(|_| libc::EINVAL)
}

/// The empty path, for the `AT_EMPTY_PATH` calls.
pub(crate) const EMPTY: &CStr = c"";

/// `/proc/self/fd/N`: names exactly the inode `fd` holds (an O_PATH one included).
pub(crate) fn proc_path(fd: BorrowedFd<'_>) -> CString {
    // A formatted integer never holds a NUL.
    CString::new(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap_or_default()
}

/// A timestamp (seconds, nanoseconds) since the epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub(crate) struct Ts {
    pub sec: i64,
    pub nsec: u32,
}

impl Ts {
    fn from_statx(t: libc::statx_timestamp) -> Ts {
        Ts {
            sec: t.tv_sec,
            nsec: t.tv_nsec,
        }
    }

    /// As a `SystemTime`.
    pub fn system_time(self) -> std::time::SystemTime {
        use std::time::{Duration, UNIX_EPOCH};
        if self.sec >= 0 {
            UNIX_EPOCH + Duration::new(self.sec as u64, self.nsec)
        } else {
            UNIX_EPOCH - Duration::from_secs(self.sec.unsigned_abs())
                + Duration::from_nanos(u64::from(self.nsec))
        }
    }
}

/// What `statx` says about an inode.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Stat {
    pub ino: u64,
    pub dev: u64,
    pub mode: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    /// Encoded as the FUSE wire wants it (`new_encode_dev`).
    pub rdev: u32,
    pub size: u64,
    pub blocks: u64,
    pub blksize: u32,
    pub atime: Ts,
    pub mtime: Ts,
    pub ctime: Ts,
    /// Birth time, when the filesystem keeps one (ext4 does): tells a reused inode number
    /// from the inode that had it before.
    pub btime: Option<Ts>,
    /// This inode is the root of a mount.
    pub mount_root: bool,
}

impl Stat {
    /// The file type bits (`S_IFMT`).
    pub fn kind(&self) -> u32 {
        self.mode & libc::S_IFMT
    }

    /// A directory.
    pub fn is_dir(&self) -> bool {
        self.kind() == libc::S_IFDIR
    }
}

fn encode_dev(major: u32, minor: u32) -> u32 {
    (minor & 0xff) | ((major & 0xfff) << 8) | ((minor & !0xff) << 12)
}

/// `statx(dir, name)` without following a final symlink; `name` empty means `dir` itself.
pub(crate) fn statx(dir: BorrowedFd<'_>, name: &CStr) -> SysResult<Stat> {
    let mut flags = libc::AT_SYMLINK_NOFOLLOW | libc::AT_STATX_SYNC_AS_STAT;
    if name.is_empty() {
        flags |= libc::AT_EMPTY_PATH;
    }
    let mut buf = MaybeUninit::<libc::statx>::zeroed();
    // SAFETY: `name` is NUL-terminated and outlives the call; `buf` is a writable statx the
    // kernel fills on success.
    check(unsafe {
        libc::statx(
            dir.as_raw_fd(),
            name.as_ptr(),
            flags,
            libc::STATX_BASIC_STATS | libc::STATX_BTIME,
            buf.as_mut_ptr(),
        )
    })?;
    // SAFETY: statx succeeded, so the kernel initialised the buffer (it was zeroed anyway).
    let s = unsafe { buf.assume_init() };
    let btime = (s.stx_mask & libc::STATX_BTIME != 0).then(|| Ts::from_statx(s.stx_btime));
    Ok(Stat {
        ino: s.stx_ino,
        dev: (u64::from(s.stx_dev_major) << 32) | u64::from(s.stx_dev_minor),
        mode: u32::from(s.stx_mode),
        nlink: s.stx_nlink,
        uid: s.stx_uid,
        gid: s.stx_gid,
        rdev: encode_dev(s.stx_rdev_major, s.stx_rdev_minor),
        size: s.stx_size,
        blocks: s.stx_blocks,
        blksize: s.stx_blksize,
        atime: Ts::from_statx(s.stx_atime),
        mtime: Ts::from_statx(s.stx_mtime),
        ctime: Ts::from_statx(s.stx_ctime),
        btime,
        mount_root: s.stx_attributes & libc::STATX_ATTR_MOUNT_ROOT as u64 != 0,
    })
}

/// `statx` of what `fd` holds.
pub(crate) fn fstat(fd: BorrowedFd<'_>) -> SysResult<Stat> {
    statx(fd, EMPTY)
}

/// Opens `path` (relative, `/`-separated) below `root`: no symlink is followed (not even the
/// last one: an `O_PATH | O_NOFOLLOW` open returns the link itself), no `..` escapes, no
/// mount is crossed.
pub(crate) fn open_beneath(root: BorrowedFd<'_>, path: &CStr, flags: i32) -> SysResult<OwnedFd> {
    // SAFETY: open_how is three integers; all-zero is a valid value.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (flags | libc::O_CLOEXEC) as u64;
    how.resolve = libc::RESOLVE_BENEATH
        | libc::RESOLVE_NO_SYMLINKS
        | libc::RESOLVE_NO_MAGICLINKS
        | libc::RESOLVE_NO_XDEV;
    let mut tries = 0;
    loop {
        // SAFETY: `path` is NUL-terminated, `how` is a valid open_how of the size passed;
        // the kernel only reads them.
        let r = unsafe {
            libc::syscall(
                libc::SYS_openat2,
                root.as_raw_fd(),
                path.as_ptr(),
                &how as *const libc::open_how,
                std::mem::size_of::<libc::open_how>(),
            )
        };
        match check_long(r) {
            // SAFETY: the kernel returned a new descriptor that nothing else owns.
            Ok(fd) => return Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) }),
            // EAGAIN: a concurrent rename raced the beneath-check; the kernel asks to retry.
            Err(libc::EAGAIN) | Err(libc::EINTR) if tries < 16 => tries += 1,
            Err(e) => return Err(e),
        }
    }
}

/// `openat(dir, name, flags | O_CLOEXEC, mode)`.
pub(crate) fn openat(
    dir: BorrowedFd<'_>,
    name: &CStr,
    flags: i32,
    mode: u32,
) -> SysResult<OwnedFd> {
    meshfs_sys::openat(dir, name, flags, mode).map_err(errno)
}

/// `open(path, flags)` of a `/proc/self/fd/N` path: reopens the inode a descriptor holds.
pub(crate) fn reopen(fd: BorrowedFd<'_>, flags: i32) -> SysResult<OwnedFd> {
    let path = proc_path(fd);
    // SAFETY: `path` is NUL-terminated and outlives the call.
    let r = unsafe { libc::open(path.as_ptr(), flags | libc::O_CLOEXEC) };
    // SAFETY: on success the kernel returned a new descriptor that nothing else owns.
    check(r).map(|fd| unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `mkdirat`.
pub(crate) fn mkdirat(dir: BorrowedFd<'_>, name: &CStr, mode: u32) -> SysResult<()> {
    meshfs_sys::mkdirat(dir, name, mode).map_err(errno)
}

/// `mknodat` (fifos, sockets, device nodes, regular files).
pub(crate) fn mknodat(dir: BorrowedFd<'_>, name: &CStr, mode: u32, rdev: u64) -> SysResult<()> {
    // SAFETY: `name` is NUL-terminated and outlives the call.
    check(unsafe { libc::mknodat(dir.as_raw_fd(), name.as_ptr(), mode, rdev) }).map(drop)
}

/// `symlinkat(target, dir, name)`.
pub(crate) fn symlinkat(target: &CStr, dir: BorrowedFd<'_>, name: &CStr) -> SysResult<()> {
    meshfs_sys::symlinkat(target, dir, name).map_err(errno)
}

/// A new name `dir/name` for the inode `fd` holds (via its `/proc/self/fd` link, which
/// needs no privilege, unlike `AT_EMPTY_PATH`).
pub(crate) fn link_fd(fd: BorrowedFd<'_>, dir: BorrowedFd<'_>, name: &CStr) -> SysResult<()> {
    let path = proc_path(fd);
    // SAFETY: both strings are NUL-terminated and outlive the call.
    check(unsafe {
        libc::linkat(
            libc::AT_FDCWD,
            path.as_ptr(),
            dir.as_raw_fd(),
            name.as_ptr(),
            libc::AT_SYMLINK_FOLLOW,
        )
    })
    .map(drop)
}

/// `unlinkat` (`AT_REMOVEDIR` for a directory).
pub(crate) fn unlinkat(dir: BorrowedFd<'_>, name: &CStr, flags: i32) -> SysResult<()> {
    meshfs_sys::unlinkat(dir, name, flags).map_err(errno)
}

/// `renameat2` with its flags (`RENAME_NOREPLACE`, `RENAME_EXCHANGE`, `RENAME_WHITEOUT`).
pub(crate) fn renameat2(
    from_dir: BorrowedFd<'_>,
    from: &CStr,
    to_dir: BorrowedFd<'_>,
    to: &CStr,
    flags: u32,
) -> SysResult<()> {
    meshfs_sys::renameat2(from_dir, from, to_dir, to, flags).map_err(errno)
}

/// `readlinkat(dir, name)`: the link's target bytes.
pub(crate) fn readlinkat(dir: BorrowedFd<'_>, name: &CStr) -> SysResult<Vec<u8>> {
    let mut buf = vec![0u8; libc::PATH_MAX as usize + 1];
    let n = meshfs_sys::readlinkat(dir, name, &mut buf).map_err(errno)?;
    buf.truncate(n);
    Ok(buf)
}

/// chmod of the inode `fd` holds (an O_PATH descriptor included).
pub(crate) fn chmod_fd(fd: BorrowedFd<'_>, mode: u32) -> SysResult<()> {
    // SAFETY: EMPTY is NUL-terminated; fchmodat2 only reads it.
    let r = unsafe {
        libc::syscall(
            libc::SYS_fchmodat2,
            fd.as_raw_fd(),
            EMPTY.as_ptr(),
            mode,
            libc::AT_EMPTY_PATH,
        )
    };
    match check_long(r) {
        Ok(_) => Ok(()),
        // Kernels before 6.6: go through the descriptor's /proc link.
        Err(libc::ENOSYS) => {
            let path = proc_path(fd);
            // SAFETY: `path` is NUL-terminated and outlives the call.
            check(unsafe { libc::chmod(path.as_ptr(), mode) }).map(drop)
        }
        Err(e) => Err(e),
    }
}

/// chown of the inode `fd` holds, never following a symlink; `None` keeps the id.
pub(crate) fn chown_fd(fd: BorrowedFd<'_>, uid: Option<u32>, gid: Option<u32>) -> SysResult<()> {
    // SAFETY: EMPTY is NUL-terminated; -1 (as uid_t) means "unchanged".
    check(unsafe {
        libc::fchownat(
            fd.as_raw_fd(),
            EMPTY.as_ptr(),
            uid.unwrap_or(u32::MAX),
            gid.unwrap_or(u32::MAX),
            libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW,
        )
    })
    .map(drop)
}

/// A time for [`utimens_fd`].
#[derive(Clone, Copy, Debug)]
pub(crate) enum SetTime {
    /// Leave as it is (`UTIME_OMIT`).
    Omit,
    /// The current time (`UTIME_NOW`).
    Now,
    /// This time.
    At(std::time::SystemTime),
}

impl SetTime {
    fn timespec(self) -> libc::timespec {
        match self {
            SetTime::Omit => libc::timespec {
                tv_sec: 0,
                tv_nsec: libc::UTIME_OMIT,
            },
            SetTime::Now => libc::timespec {
                tv_sec: 0,
                tv_nsec: libc::UTIME_NOW,
            },
            SetTime::At(t) => match t.duration_since(std::time::UNIX_EPOCH) {
                Ok(d) => libc::timespec {
                    tv_sec: d.as_secs() as libc::time_t,
                    tv_nsec: libc::c_long::from(d.subsec_nanos()),
                },
                Err(e) => {
                    // Before the epoch: floor to whole seconds below, then add the nanos.
                    let d = e.duration();
                    let mut sec = -(d.as_secs() as i64);
                    let mut nsec = i64::from(d.subsec_nanos());
                    if nsec > 0 {
                        sec -= 1;
                        nsec = 1_000_000_000 - nsec;
                    }
                    libc::timespec {
                        tv_sec: sec as libc::time_t,
                        tv_nsec: nsec as libc::c_long,
                    }
                }
            },
        }
    }
}

/// utimensat of the inode `fd` holds, never following a symlink.
pub(crate) fn utimens_fd(fd: BorrowedFd<'_>, atime: SetTime, mtime: SetTime) -> SysResult<()> {
    let times = [atime.timespec(), mtime.timespec()];
    // SAFETY: EMPTY is NUL-terminated; `times` is two valid timespecs.
    check(unsafe {
        libc::utimensat(
            fd.as_raw_fd(),
            EMPTY.as_ptr(),
            times.as_ptr(),
            libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW,
        )
    })
    .map(drop)
}

/// Truncates the regular file `fd` holds to `size` (through its /proc link, so an O_PATH or
/// read-only descriptor will do; the permission check is the kernel's, as for truncate(2)).
pub(crate) fn truncate_fd(fd: BorrowedFd<'_>, size: u64) -> SysResult<()> {
    let path = proc_path(fd);
    // SAFETY: `path` is NUL-terminated and outlives the call.
    check(unsafe { libc::truncate(path.as_ptr(), size as libc::off_t) }).map(drop)
}

/// `ftruncate` on a descriptor open for writing.
pub(crate) fn ftruncate(fd: BorrowedFd<'_>, size: u64) -> SysResult<()> {
    // SAFETY: plain syscall on a descriptor we own.
    check(unsafe { libc::ftruncate(fd.as_raw_fd(), size as libc::off_t) }).map(drop)
}

/// `pread` of up to `len` bytes at `offset` into `buf` (cleared first; short at end of
/// file). The buffer's memory is reused and never zeroed: a request's reply is read into the
/// same allocation as the last one's, and the pages are written only by the kernel's copy.
pub(crate) fn pread_into(
    fd: BorrowedFd<'_>,
    offset: u64,
    len: usize,
    buf: &mut Vec<u8>,
) -> SysResult<()> {
    buf.clear();
    buf.reserve(len);
    let mut done = 0;
    while done < len {
        // SAFETY: the destination is the vector's spare capacity, `len - done` bytes past its
        // `done` initialised ones, all inside the `len` reserved above; the kernel writes at
        // most that many.
        let r = unsafe {
            libc::pread(
                fd.as_raw_fd(),
                buf.as_mut_ptr().add(done).cast(),
                len - done,
                (offset + done as u64) as libc::off_t,
            )
        };
        match check_size(r) {
            Ok(0) => break,
            Ok(n) => {
                done += n;
                // SAFETY: the kernel initialised the `n` bytes it reported, right after the
                // `done - n` initialised before; `done <= len <= capacity`.
                unsafe { buf.set_len(done) };
            }
            Err(libc::EINTR) => continue,
            Err(e) if done == 0 => return Err(e),
            Err(_) => break,
        }
    }
    Ok(())
}

/// `pwrite` of all of `data` (or what fits before an error, if some was written).
pub(crate) fn pwrite(fd: BorrowedFd<'_>, offset: u64, data: &[u8]) -> SysResult<usize> {
    let mut done = 0;
    while done < data.len() {
        // SAFETY: the source is inside `data` and readable for `data.len() - done` bytes.
        let r = unsafe {
            libc::pwrite(
                fd.as_raw_fd(),
                data[done..].as_ptr().cast(),
                data.len() - done,
                (offset + done as u64) as libc::off_t,
            )
        };
        match check_size(r) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(libc::EINTR) => continue,
            Err(e) if done == 0 => return Err(e),
            Err(_) => break,
        }
    }
    Ok(done)
}

/// `fsync`, or `fdatasync` when `data_only`.
pub(crate) fn fsync(fd: BorrowedFd<'_>, data_only: bool) -> SysResult<()> {
    if data_only {
        meshfs_sys::fdatasync(fd)
    } else {
        meshfs_sys::fsync(fd)
    }
    .map_err(errno)
}

/// `fallocate`.
pub(crate) fn fallocate(fd: BorrowedFd<'_>, mode: i32, offset: u64, len: u64) -> SysResult<()> {
    // SAFETY: plain syscall on a descriptor we own.
    check(unsafe {
        libc::fallocate(
            fd.as_raw_fd(),
            mode,
            offset as libc::off_t,
            len as libc::off_t,
        )
    })
    .map(drop)
}

/// `lseek` (SEEK_SET, SEEK_DATA, SEEK_HOLE…).
pub(crate) fn lseek(fd: BorrowedFd<'_>, offset: i64, whence: i32) -> SysResult<i64> {
    // SAFETY: plain syscall on a descriptor we own.
    let r = unsafe { libc::lseek(fd.as_raw_fd(), offset as libc::off_t, whence) };
    if r < 0 {
        Err(last_errno())
    } else {
        Ok(r as i64)
    }
}

/// `copy_file_range` between two descriptors at explicit offsets.
pub(crate) fn copy_file_range(
    fd_in: BorrowedFd<'_>,
    off_in: u64,
    fd_out: BorrowedFd<'_>,
    off_out: u64,
    len: usize,
) -> SysResult<usize> {
    let mut oi = off_in as libc::loff_t;
    let mut oo = off_out as libc::loff_t;
    // SAFETY: the offsets are valid writable loff_t's; the descriptors are ours.
    check_size(unsafe {
        libc::copy_file_range(
            fd_in.as_raw_fd(),
            &mut oi,
            fd_out.as_raw_fd(),
            &mut oo,
            len,
            0,
        )
    })
}

/// What `statvfs` says about the backing filesystem.
pub(crate) struct StatFs {
    pub blocks: u64,
    pub bfree: u64,
    pub bavail: u64,
    pub files: u64,
    pub ffree: u64,
    pub bsize: u32,
    pub namelen: u32,
    pub frsize: u32,
}

/// `fstatvfs` (works on an O_PATH descriptor).
pub(crate) fn statvfs(fd: BorrowedFd<'_>) -> SysResult<StatFs> {
    let mut buf = MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: `buf` is a writable statvfs the kernel fills on success.
    check(unsafe { libc::fstatvfs(fd.as_raw_fd(), buf.as_mut_ptr()) })?;
    // SAFETY: fstatvfs succeeded (and the buffer was zeroed anyway).
    let s = unsafe { buf.assume_init() };
    Ok(StatFs {
        blocks: s.f_blocks,
        bfree: s.f_bfree,
        bavail: s.f_bavail,
        files: s.f_files,
        ffree: s.f_ffree,
        bsize: s.f_bsize as u32,
        namelen: s.f_namemax as u32,
        frsize: s.f_frsize as u32,
    })
}

/// `faccessat(dir, name, mask)` without following a final symlink.
pub(crate) fn faccessat(dir: BorrowedFd<'_>, name: &CStr, mask: i32) -> SysResult<()> {
    let mut flags = libc::AT_SYMLINK_NOFOLLOW;
    if name.is_empty() {
        flags |= libc::AT_EMPTY_PATH;
    }
    // SAFETY: `name` is NUL-terminated and outlives the call.
    check(unsafe { libc::faccessat(dir.as_raw_fd(), name.as_ptr(), mask, flags) }).map(drop)
}

/// One entry of a directory stream.
#[derive(Clone, Debug)]
pub(crate) struct DirEntry {
    /// The backing inode number.
    pub ino: u64,
    /// The cookie that resumes the stream after this entry.
    pub next: i64,
    /// `DT_*` type.
    pub dtype: u8,
    pub name: OsString,
}

/// Reads the next entries of the directory `fd` (at its current position) into `out`.
/// Returns how many were read; 0 is the end of the directory.
pub(crate) fn getdents(
    fd: BorrowedFd<'_>,
    buf: &mut [u8],
    out: &mut Vec<DirEntry>,
) -> SysResult<usize> {
    // SAFETY: `buf` is writable for its length; the kernel writes linux_dirent64 records.
    let n = check_long(unsafe {
        libc::syscall(
            libc::SYS_getdents64,
            fd.as_raw_fd(),
            buf.as_mut_ptr(),
            buf.len(),
        )
    })? as usize;
    let mut pos = 0;
    let mut count = 0;
    // struct linux_dirent64 { u64 d_ino; i64 d_off; u16 d_reclen; u8 d_type; char d_name[]; }
    while pos + 19 <= n {
        let rec = &buf[pos..n];
        let ino = u64::from_ne_bytes(rec[0..8].try_into().unwrap_or_default());
        let next = i64::from_ne_bytes(rec[8..16].try_into().unwrap_or_default());
        let reclen = u16::from_ne_bytes(rec[16..18].try_into().unwrap_or_default()) as usize;
        if reclen < 19 || reclen > rec.len() {
            break;
        }
        let dtype = rec[18];
        let name_bytes = &rec[19..reclen];
        let len = name_bytes
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(name_bytes.len());
        out.push(DirEntry {
            ino,
            next,
            dtype,
            name: OsString::from_vec(name_bytes[..len].to_vec()),
        });
        count += 1;
        pos += reclen;
    }
    Ok(count)
}

/// Where the xattrs of a node are reached: the descriptor of an open file (not O_PATH),
/// or a path — the `/proc/self/fd` link of an O_PATH descriptor (followed: it names the
/// inode itself), or, for a symlink, its parent's link plus its name (not followed).
pub(crate) enum XattrAt<'a> {
    /// An ordinary open descriptor: the `f*xattr` calls.
    Fd(BorrowedFd<'a>),
    /// A path: `*xattr` when `follow`, else `l*xattr`.
    Path { path: CString, follow: bool },
}

fn size_or_buf(size: usize) -> (Vec<u8>, *mut libc::c_void) {
    let mut buf = vec![0u8; size];
    let ptr = if size == 0 {
        std::ptr::null_mut()
    } else {
        buf.as_mut_ptr().cast()
    };
    (buf, ptr)
}

fn sized(mut buf: Vec<u8>, size: usize, n: usize) -> Vec<u8> {
    if size == 0 {
        return vec![0u8; n];
    }
    buf.truncate(n);
    buf
}

/// `getxattr`. `size` 0 asks the size (the result then has that length).
pub(crate) fn getxattr(at: &XattrAt<'_>, name: &CStr, size: usize) -> SysResult<Vec<u8>> {
    let (buf, ptr) = size_or_buf(size);
    // SAFETY: the strings are NUL-terminated; `ptr` is null with size 0 or points into
    // `buf`, writable for `size` bytes; `buf` outlives the call.
    let n = check_size(unsafe {
        match at {
            XattrAt::Fd(fd) => libc::fgetxattr(fd.as_raw_fd(), name.as_ptr(), ptr, size),
            XattrAt::Path { path, follow: true } => {
                libc::getxattr(path.as_ptr(), name.as_ptr(), ptr, size)
            }
            XattrAt::Path { path, .. } => libc::lgetxattr(path.as_ptr(), name.as_ptr(), ptr, size),
        }
    })?;
    Ok(sized(buf, size, n))
}

/// `listxattr`. `size` 0 asks the size.
pub(crate) fn listxattr(at: &XattrAt<'_>, size: usize) -> SysResult<Vec<u8>> {
    let (buf, ptr) = size_or_buf(size);
    let ptr = ptr.cast::<libc::c_char>();
    // SAFETY: as for getxattr.
    let n = check_size(unsafe {
        match at {
            XattrAt::Fd(fd) => libc::flistxattr(fd.as_raw_fd(), ptr, size),
            XattrAt::Path { path, follow: true } => libc::listxattr(path.as_ptr(), ptr, size),
            XattrAt::Path { path, .. } => libc::llistxattr(path.as_ptr(), ptr, size),
        }
    })?;
    Ok(sized(buf, size, n))
}

/// `setxattr`.
pub(crate) fn setxattr(at: &XattrAt<'_>, name: &CStr, value: &[u8], flags: i32) -> SysResult<()> {
    let (v, len) = (value.as_ptr().cast(), value.len());
    // SAFETY: the strings are NUL-terminated; `value` is readable for its length.
    check(unsafe {
        match at {
            XattrAt::Fd(fd) => libc::fsetxattr(fd.as_raw_fd(), name.as_ptr(), v, len, flags),
            XattrAt::Path { path, follow: true } => {
                libc::setxattr(path.as_ptr(), name.as_ptr(), v, len, flags)
            }
            XattrAt::Path { path, .. } => {
                libc::lsetxattr(path.as_ptr(), name.as_ptr(), v, len, flags)
            }
        }
    })
    .map(drop)
}

/// `removexattr`.
pub(crate) fn removexattr(at: &XattrAt<'_>, name: &CStr) -> SysResult<()> {
    // SAFETY: the strings are NUL-terminated and outlive the call.
    check(unsafe {
        match at {
            XattrAt::Fd(fd) => libc::fremovexattr(fd.as_raw_fd(), name.as_ptr()),
            XattrAt::Path { path, follow: true } => libc::removexattr(path.as_ptr(), name.as_ptr()),
            XattrAt::Path { path, .. } => libc::lremovexattr(path.as_ptr(), name.as_ptr()),
        }
    })
    .map(drop)
}

/// Gives the calling thread its own umask of 0 (after `unshare(CLONE_FS)`, so the rest of
/// the process keeps its own): the kernel already applied the caller's umask to the modes
/// it sends, and the backing must create exactly those. Returns false if the thread could
/// not get a private fs context (the caller then fixes modes with chmod).
pub(crate) fn private_zero_umask() -> bool {
    // SAFETY: unshare(CLONE_FS) only detaches this thread's cwd/root/umask from the rest of
    // the process; umask cannot fail.
    unsafe {
        if libc::unshare(libc::CLONE_FS) != 0 {
            return false;
        }
        libc::umask(0);
    }
    true
}

/// Whether this process runs with `no_new_privs` (systemd's `NoNewPrivileges=`, or a seccomp
/// option of a service run as a user): then a setuid helper such as fusermount3 runs without
/// its privileges.
pub(crate) fn no_new_privs() -> bool {
    // SAFETY: PR_GET_NO_NEW_PRIVS takes no pointer and only reads a flag of this thread.
    unsafe { libc::prctl(libc::PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0) == 1 }
}

/// The effective uid and gid of this process.
pub(crate) fn effective_ids() -> (u32, u32) {
    // SAFETY: geteuid/getegid cannot fail.
    unsafe { (libc::geteuid(), libc::getegid()) }
}

/// `FUSE_DEV_IOC_BACKING_CLOSE`: drops the backing file `id` registered on the FUSE device
/// `dev`.
pub(crate) fn backing_close(dev: BorrowedFd<'_>, id: u32) -> SysResult<()> {
    // _IOW(229, 2, uint32_t), include/uapi/linux/fuse.h.
    const FUSE_DEV_IOC_BACKING_CLOSE: libc::c_ulong = (1 << 30) | (4 << 16) | (229 << 8) | 2;
    // SAFETY: the ioctl reads one u32 at the pointer, which outlives the call.
    check(unsafe {
        libc::ioctl(
            dev.as_raw_fd(),
            FUSE_DEV_IOC_BACKING_CLOSE,
            &id as *const u32,
        )
    })
    .map(drop)
}

/// `umount2(path, flags)`.
pub(crate) fn umount2(path: &CStr, flags: i32) -> SysResult<()> {
    // SAFETY: `path` is NUL-terminated and outlives the call.
    check(unsafe { libc::umount2(path.as_ptr(), flags) }).map(drop)
}

/// `statx` of an absolute or relative path, following nothing at the end.
pub(crate) fn stat_path(path: &CStr) -> SysResult<Stat> {
    // SAFETY: AT_FDCWD is always a valid dirfd argument.
    let cwd = unsafe { BorrowedFd::borrow_raw(libc::AT_FDCWD) };
    statx(cwd, path)
}

/// Whether `errno`, from a syscall on a FUSE mount, says its server is gone: `ENOTCONN` for a
/// mount served over `/dev/fuse`; one served over io_uring answers `ECONNABORTED` or
/// `ECANCELED` while the kernel tears its queues down (both seen after a `SIGKILL`).
pub(crate) fn is_dead_mount(errno: Errno) -> bool {
    matches!(errno, libc::ENOTCONN | libc::ECONNABORTED | libc::ECANCELED)
}

/// `statfs(path)`, for its verdict only. It always asks a FUSE server (it is never
/// cached), so it tells a dead FUSE mount (`ENOTCONN`) from a live one.
pub(crate) fn statfs_probe(path: &CStr) -> SysResult<()> {
    let mut buf = MaybeUninit::<libc::statfs>::zeroed();
    // SAFETY: `path` is NUL-terminated; `buf` is a writable statfs the kernel fills.
    check(unsafe { libc::statfs(path.as_ptr(), buf.as_mut_ptr()) }).map(drop)
}

/// Opens a directory path (following links, as a user-given path is) as O_PATH.
pub(crate) fn open_dir_path(path: &CStr) -> SysResult<OwnedFd> {
    // SAFETY: AT_FDCWD is always a valid dirfd argument.
    let cwd = unsafe { BorrowedFd::borrow_raw(libc::AT_FDCWD) };
    openat(cwd, path, libc::O_PATH | libc::O_DIRECTORY, 0)
}

/// Blocks this thread has read from storage so far (`ru_inblock` of `getrusage(RUSAGE_THREAD)`:
/// the kernel's per-task I/O accounting, in 512-byte units). A call that raised it went to disk;
/// page-cache and dentry-cache hits leave it as it was. 0 where the kernel does not count.
pub(crate) fn thread_inblock() -> u64 {
    let mut ru = MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: `ru` is a writable rusage the kernel fills on success; it was zeroed anyway.
    let r = unsafe { libc::getrusage(libc::RUSAGE_THREAD, ru.as_mut_ptr()) };
    if r != 0 {
        return 0;
    }
    // SAFETY: getrusage succeeded, so the kernel initialised the buffer.
    let ru = unsafe { ru.assume_init() };
    u64::try_from(ru.ru_inblock).unwrap_or(0)
}
