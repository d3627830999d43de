//! Read-only memory mappings of files that survive the file being truncated under them.
//!
//! Hashing a file through a mapping saves the copy out of the page cache that `read(2)` makes
//! (a tenth of a first scan's CPU). The hazard: when another process truncates the file while
//! we read it, touching a mapped page past the new end raises `SIGBUS`, whose default action
//! kills the daemon. A [`Mapped`] region is therefore only read inside [`Mapped::guarded`],
//! which registers the region for the current thread; a process-wide `SIGBUS` handler maps a
//! page of zeros over a faulting address inside a registered region, notes the fault, and
//! returns, so the read goes on (seeing zeros) and `guarded` reports the read as
//! [`Torn`]. A fault anywhere else is handed to the handler that was installed before ours
//! (Rust's own, which reports stack overflows) or to the default action.
//!
//! A torn read is not an error the user sees: the file changed while it was read, so the
//! watcher reports it again and the next scan reads the new content.
//!
//! This module never writes to a file: mappings are `PROT_READ` and the zero pages are
//! private and anonymous.

use std::cell::Cell;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::atomic::{compiler_fence, AtomicBool, Ordering};
use std::sync::{Once, OnceLock};

/// A read through a mapping met the end of a file that had shrunk (or an I/O error, which the
/// kernel also reports as `SIGBUS`): part of what was read is zeros, not the file's content.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Torn;

thread_local! {
    /// The region (address, length) this thread is reading inside `guarded`, or (0, 0).
    /// `const`-initialized and without a destructor, so the signal handler's access is a plain
    /// thread-local load, with no lazy initialization.
    static GUARD: Cell<(usize, usize)> = const { Cell::new((0, 0)) };
    /// Set by the signal handler when it patched a page of the guarded region.
    static FAULTED: AtomicBool = const { AtomicBool::new(false) };
}

/// The disposition of `SIGBUS` before ours, for faults that are not ours.
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();
static INSTALL: Once = Once::new();

/// The system's page size, the unit mappings are aligned to.
pub fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if n > 0 {
        n as usize
    } else {
        4096
    }
}

/// A read-only, shared mapping of `len` bytes of a file from `offset`.
pub struct Mapped {
    ptr: *mut libc::c_void,
    len: usize,
}

// SAFETY: the mapping is read-only memory owned by this value; moving it between threads moves
// nothing but the address, and threads that share it only read it (each inside its own guard).
unsafe impl Send for Mapped {}
// SAFETY: see `Send`: no method mutates the mapping.
unsafe impl Sync for Mapped {}

impl Mapped {
    /// Maps `len` (> 0) bytes of `file` from `offset`, which must be a multiple of the page
    /// size. The kernel is told the access is sequential and starts reading the whole range
    /// in at once.
    pub fn new(file: BorrowedFd<'_>, offset: u64, len: usize) -> std::io::Result<Mapped> {
        install_handler();
        let map = Mapped::unadvised(file, offset, len)?;
        // SAFETY: the range is the mapping just made. Advice only: failure changes nothing.
        // WILLNEED starts reading the whole range from disk at once: page faults alone read
        // ahead in small windows, and a cold first scan of 2 GiB took 3.2-3.4 s instead of
        // read(2)'s 1.9-2.7 s.
        unsafe {
            libc::madvise(map.ptr, len, libc::MADV_SEQUENTIAL);
            libc::madvise(map.ptr, len, libc::MADV_WILLNEED);
        }
        Ok(map)
    }

    /// The mapping alone: no advice, nothing read in (and, without [`Mapped::new`]'s handler,
    /// not for [`Mapped::guarded`] reads).
    fn unadvised(file: BorrowedFd<'_>, offset: u64, len: usize) -> std::io::Result<Mapped> {
        assert!(len > 0, "an empty mapping");
        assert_eq!(offset % page_size() as u64, 0, "an unaligned mapping");
        // SAFETY: a fresh mapping chosen by the kernel (no MAP_FIXED), read-only; failure is
        // checked below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                offset as libc::off_t,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Mapped { ptr, len })
    }

    /// Runs `read` over the mapped bytes with this thread's `SIGBUS` guard on the region.
    /// Returns `Err(Torn)` if any page `read` touched lay past the file's end (it saw zeros).
    ///
    /// The bytes may change while `read` runs if another process writes the file; callers
    /// treat the result as a snapshot to be checked against the file's stat afterwards, as
    /// they would a `read(2)` that raced a writer.
    pub fn guarded<R>(&self, read: impl FnOnce(&[u8]) -> R) -> Result<R, Torn> {
        struct Unguard;
        impl Drop for Unguard {
            fn drop(&mut self) {
                GUARD.with(|g| g.set((0, 0)));
            }
        }
        assert_eq!(GUARD.with(Cell::get), (0, 0), "nested guarded reads");
        FAULTED.with(|f| f.store(false, Ordering::Relaxed));
        GUARD.with(|g| g.set((self.ptr as usize, self.len)));
        let _unguard = Unguard;
        // SAFETY: `ptr..ptr+len` is a live read-only mapping owned by `self`, which outlives
        // the borrow; a page past the file's end is patched with zeros by the handler instead
        // of killing the process.
        let bytes = unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) };
        // The handler runs on this thread, between two of `read`'s loads: without the fences
        // an optimized build may carry the `false` stored above straight to the check below
        // (nothing in `read` writes memory), and a torn read would pass as whole.
        compiler_fence(Ordering::SeqCst);
        let out = read(bytes);
        compiler_fence(Ordering::SeqCst);
        if FAULTED.with(|f| f.load(Ordering::Relaxed)) {
            Err(Torn)
        } else {
            Ok(out)
        }
    }
}

/// The share (0.0 to 1.0) of the pages of `len` (> 0) bytes of `file` from `offset` (a multiple
/// of the page size) that are in the page cache now. Reads nothing: the range is mapped without
/// advice and `mincore(2)` asked, which faults no page in.
pub fn resident_share(file: BorrowedFd<'_>, offset: u64, len: usize) -> std::io::Result<f64> {
    let map = Mapped::unadvised(file, offset, len)?;
    let pages = len.div_ceil(page_size());
    let mut vec = vec![0u8; pages];
    // SAFETY: `map` is a live mapping of `len` bytes and `vec` has one byte per page of it.
    if unsafe { libc::mincore(map.ptr, len, vec.as_mut_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(vec.iter().filter(|b| **b & 1 != 0).count() as f64 / pages as f64)
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `new` (and any zero pages placed inside it).
        unsafe { libc::munmap(self.ptr, self.len) };
    }
}

fn install_handler() {
    INSTALL.call_once(|| {
        // SAFETY: a zeroed sigaction is valid; the fields are filled below. The handler only
        // makes async-signal-safe calls (mmap, sigaction) and plain thread-local accesses.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_sigbus as *const () as libc::sighandler_t;
            action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_NODEFER;
            libc::sigemptyset(&mut action.sa_mask);
            let mut previous: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(libc::SIGBUS, &action, &mut previous) == 0 {
                let _ = PREVIOUS.set(previous);
            }
        }
    });
}

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for a SA_SIGINFO handler.
    let addr = unsafe { (*info).si_addr() } as usize;
    let (start, len) = GUARD.with(Cell::get);
    if len != 0 && addr >= start && addr - start < len {
        let page = addr & !(page_size() - 1);
        // SAFETY: the page lies inside this thread's guarded mapping (the mapping is page
        // aligned, so the whole page does); MAP_FIXED replaces just that page with zeros, and
        // `Mapped::drop` unmaps it with the rest.
        let p = unsafe {
            libc::mmap(
                page as *mut libc::c_void,
                page_size(),
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if p != libc::MAP_FAILED {
            FAULTED.with(|f| f.store(true, Ordering::Relaxed));
            return;
        }
    }
    // Not ours: what would have happened without us.
    match PREVIOUS.get() {
        Some(prev) if prev.sa_sigaction != libc::SIG_DFL && prev.sa_sigaction != libc::SIG_IGN => {
            // SAFETY: `prev` is the disposition the kernel gave us back, so its handler has the
            // signature its flags say.
            unsafe {
                if prev.sa_flags & libc::SA_SIGINFO != 0 {
                    let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                        std::mem::transmute(prev.sa_sigaction);
                    f(sig, info, ctx);
                } else {
                    let f: extern "C" fn(libc::c_int) = std::mem::transmute(prev.sa_sigaction);
                    f(sig);
                }
            }
        }
        _ => {
            // Back to the default action; returning re-runs the faulting access, which then
            // ends the process as it would have without this module.
            // SAFETY: a zeroed sigaction with SIG_DFL is valid.
            unsafe {
                let mut dfl: libc::sigaction = std::mem::zeroed();
                dfl.sa_sigaction = libc::SIG_DFL;
                libc::sigaction(libc::SIGBUS, &dfl, std::ptr::null_mut());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsFd;

    #[test]
    fn a_mapping_reads_the_file() {
        let mut f = tempfile::tempfile().unwrap();
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        f.write_all(&data).unwrap();
        let m = Mapped::new(f.as_fd(), 0, data.len()).unwrap();
        assert_eq!(m.guarded(|b| b.to_vec()), Ok(data.clone()));
        let page = page_size();
        let m = Mapped::new(f.as_fd(), page as u64, data.len() - page).unwrap();
        assert_eq!(m.guarded(|b| b.to_vec()), Ok(data[page..].to_vec()));
    }

    #[test]
    fn the_resident_share_counts_cached_pages_without_reading_any() {
        let f = tempfile::tempfile().unwrap();
        let page = page_size();
        // A hole was never read: none of it is cached, and asking reads none of it in.
        f.set_len(8 * page as u64).unwrap();
        assert_eq!(resident_share(f.as_fd(), 0, 8 * page).unwrap(), 0.0);
        assert_eq!(resident_share(f.as_fd(), 0, 8 * page).unwrap(), 0.0);
        // Written pages are in the cache.
        (&f).write_all(&vec![1u8; 4 * page]).unwrap();
        assert_eq!(resident_share(f.as_fd(), 0, 8 * page).unwrap(), 0.5);
        assert_eq!(resident_share(f.as_fd(), 0, 4 * page).unwrap(), 1.0);
        assert_eq!(
            resident_share(f.as_fd(), 4 * page as u64, 4 * page).unwrap(),
            0.0
        );
    }

    #[test]
    fn a_file_truncated_under_its_mapping_is_a_torn_read_not_a_crash() {
        let mut f = tempfile::tempfile().unwrap();
        let len = 64 * page_size();
        f.write_all(&vec![7u8; len]).unwrap();
        let m = Mapped::new(f.as_fd(), 0, len).unwrap();
        f.set_len(page_size() as u64 * 2).unwrap();
        let seen = m.guarded(|b| {
            (
                b[0],
                b[len / 2],
                b[len - 1],
                b.iter().map(|&x| x as u64).sum::<u64>(),
            )
        });
        assert_eq!(seen, Err(Torn));
        // Every page past the new end read as zeros; the two that remain are intact.
        let sum = m.guarded(|b| b.iter().map(|&x| x as u64).sum::<u64>());
        assert_eq!(
            sum,
            Ok(7 * 2 * page_size() as u64),
            "patched pages stay zero, no new fault"
        );
        // The guard is per read: a later read of an intact mapping is whole again.
        let g = tempfile::tempfile().unwrap();
        (&g).write_all(&[1u8; 8192]).unwrap();
        let m2 = Mapped::new(g.as_fd(), 0, 8192).unwrap();
        assert_eq!(m2.guarded(|b| b.len()), Ok(8192));
    }
}
