//! The Linux system calls meshfs makes beyond std, as safe functions over borrowed descriptors.
//!
//! **What it owns.** The `unsafe` blocks of the engine's replica store and scanner, of the
//! command line's `SIGPIPE` and control requests, and of the calls the mount makes too
//! (`meshfs-fuse` turns their `io::Error` into the errno it answers the kernel with,
//! untouched): each wrapper takes `BorrowedFd`s (so the descriptor is open for the whole call)
//! and `CStr` names (so every string is NUL-terminated), and returns what the kernel filled in
//! only once the call succeeded. Each block says why the pointers it passes are valid; nothing
//! else in a syscall can break memory safety.
//!
//! **What it never does.** Decide anything: no retries, no fallbacks, no path handling. The
//! wrappers are named after the syscall they make and keep its arguments; what an error means
//! is the caller's business. Other concerns keep their own `unsafe` next to them: the file
//! mappings in the daemon's `mapped`, the socket buffer option in its `transport`, the mount's
//! own requests in `meshfs-fuse`'s `sys`.

#![deny(missing_docs)]

use std::ffi::CStr;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// `AT_FDCWD` as a directory argument: relative names resolve against the working
/// directory, absolute ones ignore it.
pub fn cwd() -> BorrowedFd<'static> {
    // SAFETY: AT_FDCWD (-100) is not -1, and it names no descriptor that could be closed: the
    // *at calls this is passed to take it to mean the working directory.
    unsafe { BorrowedFd::borrow_raw(libc::AT_FDCWD) }
}

/// `openat(dir, name, flags | O_CLOEXEC, mode)`: the descriptor it opens (an interrupted
/// open is made again).
pub fn openat(
    dir: BorrowedFd<'_>,
    name: &CStr,
    flags: libc::c_int,
    mode: libc::c_uint,
) -> io::Result<OwnedFd> {
    loop {
        // SAFETY: `name` is NUL-terminated and outlives the call.
        let r = cvt(unsafe {
            libc::openat(
                dir.as_raw_fd(),
                name.as_ptr(),
                flags | libc::O_CLOEXEC,
                mode,
            )
        });
        match r {
            // SAFETY: the kernel returned a new descriptor that nothing else owns.
            Ok(fd) => return Ok(unsafe { OwnedFd::from_raw_fd(fd) }),
            // An open of a FIFO or of a file on a slow filesystem may be interrupted.
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
}

/// `fstat(fd)`.
pub fn fstat(fd: BorrowedFd<'_>) -> io::Result<libc::stat> {
    let mut st = MaybeUninit::<libc::stat>::uninit();
    // SAFETY: `st` is writable memory of the type fstat fills.
    cvt(unsafe { libc::fstat(fd.as_raw_fd(), st.as_mut_ptr()) })?;
    // SAFETY: fstat succeeded, so it filled `st`.
    Ok(unsafe { st.assume_init() })
}

/// `fstatat(dir, name, flags)` (`AT_SYMLINK_NOFOLLOW` to stat a symlink itself).
pub fn fstatat(dir: BorrowedFd<'_>, name: &CStr, flags: libc::c_int) -> io::Result<libc::stat> {
    let mut st = MaybeUninit::<libc::stat>::uninit();
    // SAFETY: `name` is NUL-terminated and outlives the call; `st` is writable memory of the
    // type fstatat fills.
    cvt(unsafe { libc::fstatat(dir.as_raw_fd(), name.as_ptr(), st.as_mut_ptr(), flags) })?;
    // SAFETY: fstatat succeeded, so it filled `st`.
    Ok(unsafe { st.assume_init() })
}

/// `mkdirat(dir, name, mode)`.
pub fn mkdirat(dir: BorrowedFd<'_>, name: &CStr, mode: libc::mode_t) -> io::Result<()> {
    // SAFETY: `name` is NUL-terminated and outlives the call.
    cvt(unsafe { libc::mkdirat(dir.as_raw_fd(), name.as_ptr(), mode) }).map(drop)
}

/// `unlinkat(dir, name, flags)` (`AT_REMOVEDIR` for a directory).
pub fn unlinkat(dir: BorrowedFd<'_>, name: &CStr, flags: libc::c_int) -> io::Result<()> {
    // SAFETY: `name` is NUL-terminated and outlives the call.
    cvt(unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), flags) }).map(drop)
}

/// `renameat(from, old, to, new)`: replaces `new` if it exists.
pub fn renameat(
    from: BorrowedFd<'_>,
    old: &CStr,
    to: BorrowedFd<'_>,
    new: &CStr,
) -> io::Result<()> {
    // SAFETY: both names are NUL-terminated and outlive the call.
    cvt(unsafe { libc::renameat(from.as_raw_fd(), old.as_ptr(), to.as_raw_fd(), new.as_ptr()) })
        .map(drop)
}

/// `renameat2(from, old, to, new, flags)` (`RENAME_NOREPLACE`, …).
pub fn renameat2(
    from: BorrowedFd<'_>,
    old: &CStr,
    to: BorrowedFd<'_>,
    new: &CStr,
    flags: libc::c_uint,
) -> io::Result<()> {
    // SAFETY: both names are NUL-terminated and outlive the call.
    cvt(unsafe {
        libc::renameat2(
            from.as_raw_fd(),
            old.as_ptr(),
            to.as_raw_fd(),
            new.as_ptr(),
            flags,
        )
    })
    .map(drop)
}

/// `linkat(from, old, to, new, flags)` (`AT_EMPTY_PATH` with an empty `old` links the file
/// `from` itself holds; `AT_SYMLINK_FOLLOW` follows a final symlink in `old`).
pub fn linkat(
    from: BorrowedFd<'_>,
    old: &CStr,
    to: BorrowedFd<'_>,
    new: &CStr,
    flags: libc::c_int,
) -> io::Result<()> {
    // SAFETY: both names are NUL-terminated and outlive the call.
    cvt(unsafe {
        libc::linkat(
            from.as_raw_fd(),
            old.as_ptr(),
            to.as_raw_fd(),
            new.as_ptr(),
            flags,
        )
    })
    .map(drop)
}

/// `symlinkat(target, dir, name)`: makes `name` in `dir` a symlink to `target`.
pub fn symlinkat(target: &CStr, dir: BorrowedFd<'_>, name: &CStr) -> io::Result<()> {
    // SAFETY: both strings are NUL-terminated and outlive the call.
    cvt(unsafe { libc::symlinkat(target.as_ptr(), dir.as_raw_fd(), name.as_ptr()) }).map(drop)
}

/// `readlinkat(dir, name)` into `buf`: how many bytes of it the target fills (the target is
/// cut short if it is longer than `buf`).
pub fn readlinkat(dir: BorrowedFd<'_>, name: &CStr, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `name` is NUL-terminated and outlives the call; `buf` is writable for the length
    // passed, and readlinkat writes no more than that.
    let n = unsafe {
        libc::readlinkat(
            dir.as_raw_fd(),
            name.as_ptr(),
            buf.as_mut_ptr().cast::<libc::c_char>(),
            buf.len(),
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// `utimensat(dir, name, times, flags)`: `times` is (atime, mtime), `UTIME_OMIT` to keep one.
pub fn utimensat(
    dir: BorrowedFd<'_>,
    name: &CStr,
    times: &[libc::timespec; 2],
    flags: libc::c_int,
) -> io::Result<()> {
    // SAFETY: `name` is NUL-terminated; `times` points to the two timespecs utimensat reads.
    cvt(unsafe { libc::utimensat(dir.as_raw_fd(), name.as_ptr(), times.as_ptr(), flags) }).map(drop)
}

/// `futimens(fd, times)`: `times` is (atime, mtime), `UTIME_OMIT` to keep one.
pub fn futimens(fd: BorrowedFd<'_>, times: &[libc::timespec; 2]) -> io::Result<()> {
    // SAFETY: `times` points to the two timespecs futimens reads.
    cvt(unsafe { libc::futimens(fd.as_raw_fd(), times.as_ptr()) }).map(drop)
}

/// `fchmod(fd, mode)`.
pub fn fchmod(fd: BorrowedFd<'_>, mode: libc::mode_t) -> io::Result<()> {
    // SAFETY: integer arguments only; the descriptor is borrowed for the call.
    cvt(unsafe { libc::fchmod(fd.as_raw_fd(), mode) }).map(drop)
}

/// `fcntl(fd, F_SETLEASE, kind)` (`F_RDLCK`, `F_WRLCK`, `F_UNLCK`). A read lease is refused
/// (`EAGAIN`) while anyone has the file open for writing; while it is held, an open for writing
/// (or a truncate) must first break it.
pub fn set_lease(fd: BorrowedFd<'_>, kind: libc::c_int) -> io::Result<()> {
    // SAFETY: F_SETLEASE takes an int argument and touches no memory of ours.
    cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETLEASE, kind) }).map(drop)
}

/// `fcntl(fd, F_GETLEASE)`: the lease `fd` holds (`F_UNLCK` once a break has begun).
pub fn get_lease(fd: BorrowedFd<'_>) -> io::Result<libc::c_int> {
    // SAFETY: F_GETLEASE takes no argument and touches no memory of ours.
    cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETLEASE) })
}

/// Ignores `SIGIO`: the kernel sends it to a lease holder when someone breaks the lease, and
/// its default action ends the process. The store's leases are only held for a few system
/// calls and read back with [`get_lease`], never waited on with the signal.
pub fn ignore_sigio() {
    // SAFETY: SIG_IGN installs no handler code; it only changes the disposition of SIGIO,
    // which nothing else in the daemon uses.
    unsafe {
        libc::signal(libc::SIGIO, libc::SIG_IGN);
    }
}

/// `fsetxattr(fd, name, value, 0)`.
pub fn fsetxattr(fd: BorrowedFd<'_>, name: &CStr, value: &[u8]) -> io::Result<()> {
    // SAFETY: `name` is NUL-terminated and `value` is readable for its length; both outlive
    // the call.
    cvt(unsafe {
        libc::fsetxattr(
            fd.as_raw_fd(),
            name.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    })
    .map(drop)
}

/// `fremovexattr(fd, name)`.
pub fn fremovexattr(fd: BorrowedFd<'_>, name: &CStr) -> io::Result<()> {
    // SAFETY: `name` is NUL-terminated and outlives the call.
    cvt(unsafe { libc::fremovexattr(fd.as_raw_fd(), name.as_ptr()) }).map(drop)
}

/// `fgetxattr(fd, name)`: the value (at most 4 KiB).
pub fn fgetxattr(fd: BorrowedFd<'_>, name: &CStr) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; 4096];
    // SAFETY: `name` is NUL-terminated; `buf` is writable for its length; both outlive the
    // call.
    let n = unsafe {
        libc::fgetxattr(
            fd.as_raw_fd(),
            name.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    buf.truncate(n as usize);
    Ok(buf)
}

/// `fgetxattr(fd, name)` into `buf`: the value's length (`ERANGE` if it is longer than `buf`).
pub fn fgetxattr_into(fd: BorrowedFd<'_>, name: &CStr, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `name` is NUL-terminated; `buf` is writable for its length; both outlive the
    // call.
    let n = unsafe {
        libc::fgetxattr(
            fd.as_raw_fd(),
            name.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// `fsync(fd)` (a directory's too: its entries become durable).
pub fn fsync(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: integer arguments only; the descriptor is borrowed for the call.
    cvt(unsafe { libc::fsync(fd.as_raw_fd()) }).map(drop)
}

/// `fdatasync(fd)`: the data and what is needed to read it back, not every timestamp.
pub fn fdatasync(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: integer arguments only; the descriptor is borrowed for the call.
    cvt(unsafe { libc::fdatasync(fd.as_raw_fd()) }).map(drop)
}

/// `syncfs(fd)`: flushes the whole filesystem `fd` is on.
pub fn syncfs(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: integer arguments only; the descriptor is borrowed for the call.
    cvt(unsafe { libc::syncfs(fd.as_raw_fd()) }).map(drop)
}

/// `sync_file_range(fd, offset, nbytes, flags)` (`nbytes` 0: to the end of the file).
pub fn sync_file_range(
    fd: BorrowedFd<'_>,
    offset: i64,
    nbytes: i64,
    flags: libc::c_uint,
) -> io::Result<()> {
    // SAFETY: integer arguments only; the descriptor is borrowed for the call.
    cvt(unsafe { libc::sync_file_range(fd.as_raw_fd(), offset, nbytes, flags) }).map(drop)
}

/// `fallocate(fd, FALLOC_FL_KEEP_SIZE, 0, len)`: gives the file its blocks for `len` bytes
/// now, without changing its size.
pub fn preallocate(fd: BorrowedFd<'_>, len: i64) -> io::Result<()> {
    // SAFETY: integer arguments only; the descriptor is borrowed for the call.
    cvt(unsafe { libc::fallocate(fd.as_raw_fd(), libc::FALLOC_FL_KEEP_SIZE, 0, len) }).map(drop)
}

/// `posix_fadvise(fd, offset, len, POSIX_FADV_WILLNEED)`: starts reading the range into the
/// page cache. Advice only: the caller may ignore a failure.
pub fn fadvise_willneed(fd: BorrowedFd<'_>, offset: i64, len: i64) -> io::Result<()> {
    // SAFETY: integer arguments only; the descriptor is borrowed for the call.
    let rc = unsafe { libc::posix_fadvise(fd.as_raw_fd(), offset, len, libc::POSIX_FADV_WILLNEED) };
    // posix_fadvise returns the error number instead of setting errno.
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(rc))
    }
}

/// `len` bytes of `fd` from `offset` by `pread`, read into a buffer that is not zeroed first
/// (a chunk is read in full or not at all, so zeroing it first was only work). Fails with
/// `UnexpectedEof` if the file ends first.
pub fn pread_exact(fd: BorrowedFd<'_>, len: usize, offset: u64) -> io::Result<Vec<u8>> {
    let mut buf: Vec<u8> = Vec::with_capacity(len);
    while buf.len() < len {
        let at = buf.len();
        let spare = &mut buf.spare_capacity_mut()[..len - at];
        // SAFETY: `spare` is unused capacity of the vector, `len - at` bytes, of which `pread`
        // writes at most `spare.len()`; only the bytes it reports written are then made part
        // of the vector.
        let n = unsafe {
            libc::pread(
                fd.as_raw_fd(),
                spare.as_mut_ptr().cast(),
                spare.len(),
                (offset + at as u64) as libc::off_t,
            )
        };
        match n {
            0 => return Err(io::Error::from(io::ErrorKind::UnexpectedEof)),
            n if n < 0 => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
            // SAFETY: the kernel initialised `n` more bytes after the first `at`, and
            // `at + n <= len <= capacity`.
            n => unsafe { buf.set_len(at + n as usize) },
        }
    }
    Ok(buf)
}

/// `statvfs(path)`.
pub fn statvfs(path: &CStr) -> io::Result<libc::statvfs> {
    let mut st = MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `path` is NUL-terminated and outlives the call; `st` is writable memory of the
    // type statvfs fills.
    cvt(unsafe { libc::statvfs(path.as_ptr(), st.as_mut_ptr()) })?;
    // SAFETY: statvfs succeeded, so it filled `st`.
    Ok(unsafe { st.assume_init() })
}

/// The effective user id of this process.
pub fn geteuid() -> libc::uid_t {
    // SAFETY: geteuid takes nothing, touches no memory and cannot fail.
    unsafe { libc::geteuid() }
}

/// The CPU time the calling thread has used so far (`clock_gettime(CLOCK_THREAD_CPUTIME_ID)`);
/// zero if the clock cannot be read.
pub fn thread_cpu_time() -> std::time::Duration {
    let mut ts = MaybeUninit::<libc::timespec>::uninit();
    // SAFETY: `ts` is a writable timespec for the kernel to fill; the call touches nothing else.
    let r = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, ts.as_mut_ptr()) };
    if r != 0 {
        return std::time::Duration::ZERO;
    }
    // SAFETY: clock_gettime succeeded, so it filled `ts`.
    let ts = unsafe { ts.assume_init() };
    std::time::Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// The calling thread's nice value (`getpriority(PRIO_PROCESS, gettid())`: on Linux each
/// thread has its own, and a thread it starts inherits it).
pub fn thread_nice() -> io::Result<i32> {
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::gettid() };
    // -1 is a valid nice value: errno tells an error from it.
    // SAFETY: __errno_location points at this thread's errno.
    unsafe { *libc::__errno_location() = 0 };
    // SAFETY: getpriority reads the scheduler's value for this thread, nothing in memory.
    let n = unsafe { libc::getpriority(libc::PRIO_PROCESS, tid as libc::id_t) };
    if n == -1 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(0) {
            return Err(e);
        }
    }
    Ok(n)
}

/// Sets the calling thread's nice value (`setpriority(PRIO_PROCESS, gettid(), nice)`); only
/// the thread and the threads it starts afterwards run at it. Without privilege a thread can
/// only raise its value (lower its priority).
pub fn set_thread_nice(nice: i32) -> io::Result<()> {
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::gettid() };
    // SAFETY: setpriority changes this thread's scheduling weight, nothing in memory.
    cvt(unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice) })?;
    Ok(())
}

/// `send(fd, buf, flags)`: the bytes the socket took. With `MSG_NOSIGNAL` a peer that has
/// closed its end is `EPIPE`, never a `SIGPIPE` (which ends a process that lets it,
/// [`default_sigpipe`]).
pub fn send(fd: BorrowedFd<'_>, buf: &[u8], flags: libc::c_int) -> io::Result<usize> {
    // SAFETY: `buf` is a readable slice of `buf.len()` bytes for the whole call; `fd` is open
    // for it (borrowed).
    let n = unsafe { libc::send(fd.as_raw_fd(), buf.as_ptr().cast(), buf.len(), flags) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// Lets `SIGPIPE` end the process, as it ends `cat` or `ls`: a command whose reader has gone
/// (`meshfs journal | head`) stops quietly instead of failing its next `print!`. Rust programs
/// start with `SIGPIPE` ignored; a long-running process that writes to sockets keeps that.
pub fn default_sigpipe() {
    // SAFETY: installs the default disposition for one signal; no handler code runs in Rust.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn a_failed_call_reports_the_kernel_error() {
        let dir = tempfile::tempdir().unwrap();
        let fd = std::fs::File::open(dir.path()).unwrap();
        let err = fstatat(fd.as_fd(), c"missing", libc::AT_SYMLINK_NOFOLLOW).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ENOENT));
        let err = openat(fd.as_fd(), c"missing", libc::O_RDONLY, 0).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ENOENT));
    }

    #[test]
    fn a_send_to_a_closed_socket_is_epipe_not_a_signal() {
        use std::io::Read;
        let (a, mut b) = std::os::unix::net::UnixStream::pair().unwrap();
        assert_eq!(send(a.as_fd(), b"hello", libc::MSG_NOSIGNAL).unwrap(), 5);
        let mut got = [0u8; 5];
        b.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"hello");
        drop(b);
        // SIGPIPE's default would end this test process: MSG_NOSIGNAL makes it an error.
        default_sigpipe();
        let err = send(a.as_fd(), b"x", libc::MSG_NOSIGNAL).unwrap_err();
        // SAFETY: restores what the test harness had (Rust ignores SIGPIPE).
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
        assert_eq!(err.raw_os_error(), Some(libc::EPIPE));
    }

    #[test]
    fn pread_exact_reads_the_range_or_says_the_file_ended() {
        let dir = tempfile::tempdir().unwrap();
        let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(dir.path().join("f"), &data).unwrap();
        let f = std::fs::File::open(dir.path().join("f")).unwrap();
        assert_eq!(pread_exact(f.as_fd(), 0, 5).unwrap(), b"");
        assert_eq!(
            pread_exact(f.as_fd(), 200_000, 70_000).unwrap(),
            &data[70_000..270_000]
        );
        assert_eq!(
            pread_exact(f.as_fd(), 10, 299_990).unwrap(),
            &data[299_990..]
        );
        let err = pread_exact(f.as_fd(), 11, 299_990).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn readlinkat_fills_only_the_target() {
        let dir = tempfile::tempdir().unwrap();
        let fd = std::fs::File::open(dir.path()).unwrap();
        symlinkat(c"some/where", fd.as_fd(), c"l").unwrap();
        let mut buf = [0xffu8; 64];
        let n = readlinkat(fd.as_fd(), c"l", &mut buf).unwrap();
        assert_eq!(&buf[..n], b"some/where");
        let st = fstatat(fd.as_fd(), c"l", libc::AT_SYMLINK_NOFOLLOW).unwrap();
        assert_eq!(st.st_mode & libc::S_IFMT, libc::S_IFLNK);
    }
}
