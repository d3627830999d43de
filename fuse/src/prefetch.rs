//! Metadata read-ahead after a cold listing.
//!
//! A `find`, `du`, `ls -R` or an editor's project scan after a reboot (or once the page cache
//! dropped the tree) walks it one directory at a time. Through the mount each directory's
//! READDIRPLUS has the request thread `statx` every entry on the backing filesystem, reading
//! its inode from disk while the caller waits; the caller then works through the reply while
//! the daemon idles, and asks for the next directory only after that. Natively the same reads
//! happen once, in the caller; through the mount they sit on the critical path of every round
//! trip. So when a listing turns out cold (the request thread read from storage while listing
//! it: its `ru_inblock` grew, [`sys::thread_inblock`]), the directories it lists are handed to
//! one thread here, which lists them and
//! `statx`es their entries (and, where those listings are cold too, the level below, depth
//! first as a walk goes) ahead of the caller. Its next READDIRPLUS calls then find the
//! backing's inodes in memory.
//!
//! It is a hint and never changes an answer: nothing it reads is kept or reported, and a job
//! that does not fit the queue is dropped. A warm walk never starts it (no listing is cold), and
//! the kernel asks for a listing at most once while it keeps it cached.
//!
//! **Bounds:** at most [`QUEUE`] jobs waiting; per job at most 1,024 directories listed,
//! 65,536 entries `statx`ed and four levels below the listing that asked ([`LIMITS`]); one
//! directory descriptor open at a time (plus the parent descriptor each waiting job holds: at
//! most `QUEUE + 1` more descriptors in all). Directories are opened `O_NOATIME` where the
//! process may (it owns them or is root), beneath the listed one, following no symlink and
//! crossing no mount; meshfs's own names are skipped.

use crate::{is_internal, sys};
use std::collections::{HashMap, VecDeque};
use std::ffi::{CStr, CString, OsStr};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::debug;

/// Jobs waiting for the thread; more are dropped.
pub(crate) const QUEUE: usize = 4;

/// How far one job goes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// Directories listed at most.
    pub dirs: usize,
    /// Entries `statx`ed at most.
    pub stats: usize,
    /// Levels below the listing that asked: its subdirectories are level 1.
    pub depth: u32,
    /// A listed directory's own subdirectories are read too (below `depth`) only when its
    /// listing was cold (went to storage); with this set, always.
    pub always_deeper: bool,
}

/// The mount's limits: 1,024 directories, 65,536 entries, four levels (a cold `find` of
/// /usr/include through the mount: 0.47 s without read-ahead, 0.37 s two levels deep, 0.35 s
/// four, 0.34 s eight; native 0.24 s).
pub(crate) const LIMITS: Limits = Limits {
    dirs: 1024,
    stats: 65_536,
    depth: 4,
    always_deeper: false,
};

/// Directories read ahead in the last [`SEEN_FOR`] are not read again (two cold listings naming
/// the same ones, a directory listed in several replies); after that they may be cold again.
const SEEN_FOR: Duration = Duration::from_secs(5);
/// Directories remembered at most; forgotten all at once past this many.
const SEEN: usize = 16_384;

/// What a cold listing hands over: the directory listed and the names of its subdirectories,
/// in listing order (the order a walk descends).
pub(crate) struct Job {
    /// The listed directory (its cached `O_PATH` descriptor).
    pub dir: Arc<OwnedFd>,
    /// Its subdirectories' names.
    pub children: Vec<CString>,
}

/// The read-ahead thread's queue. Dropping it (the mount is gone) ends the thread at its next
/// directory: queued jobs are dropped, not read.
#[derive(Debug)]
pub(crate) struct Prefetcher {
    tx: Option<SyncSender<Job>>,
    stop: Arc<AtomicBool>,
}

impl Drop for Prefetcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

impl Prefetcher {
    /// Starts the thread; without one (it could not be started, or `enabled` is false) every
    /// offer is declined.
    pub fn start(enabled: bool) -> Prefetcher {
        let stop = Arc::new(AtomicBool::new(false));
        if !enabled {
            return Prefetcher { tx: None, stop };
        }
        let (tx, rx) = sync_channel(QUEUE);
        let stopped = stop.clone();
        let started = std::thread::Builder::new()
            .name("meshfs-fuse-ahead".into())
            .spawn(move || run(rx, &stopped));
        match started {
            Ok(_) => Prefetcher { tx: Some(tx), stop },
            Err(e) => {
                debug!(error = %e, "no metadata read-ahead: its thread did not start");
                Prefetcher { tx: None, stop }
            }
        }
    }

    /// Where the current thread stands in reading from storage: compare with [`Self::went_to_disk`]
    /// after a listing.
    pub fn mark() -> u64 {
        sys::thread_inblock()
    }

    /// Whether the current thread read from storage since `mark`.
    pub fn went_to_disk(mark: u64) -> bool {
        sys::thread_inblock() > mark
    }

    /// Queues `job` unless the queue is full or the thread is gone; never blocks.
    pub fn offer(&self, job: Job) -> bool {
        if job.children.is_empty() {
            return false;
        }
        match &self.tx {
            Some(tx) => match tx.try_send(job) {
                Ok(()) => true,
                Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => false,
            },
            None => false,
        }
    }
}

fn run(rx: Receiver<Job>, stop: &AtomicBool) {
    let mut seen = HashMap::new();
    let mut buf = vec![0u8; 64 * 1024];
    while let Ok(job) = rx.recv() {
        let t0 = Instant::now();
        let done = read_ahead(&job, &mut seen, &mut buf, &LIMITS, stop);
        debug!(
            dirs = done.dirs,
            stats = done.stats,
            ms = t0.elapsed().as_millis() as u64,
            "read ahead"
        );
    }
}

/// What one job did.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Done {
    pub dirs: usize,
    pub stats: usize,
}

/// Lists the job's directories (a cold one's subdirectories right after it, down to
/// `limits.depth`), `statx`ing every entry, within `limits`.
pub(crate) fn read_ahead(
    job: &Job,
    seen: &mut HashMap<u64, Instant>,
    buf: &mut [u8],
    limits: &Limits,
    stop: &AtomicBool,
) -> Done {
    let mut done = Done::default();
    let mut queue: VecDeque<(CString, u32)> = job.children.iter().map(|c| (c.clone(), 1)).collect();
    let mut entries = Vec::new();
    while let Some((rel, depth)) = queue.pop_front() {
        if done.dirs >= limits.dirs || done.stats >= limits.stats || stop.load(Ordering::Relaxed) {
            break;
        }
        let Some(fd) = open_dir(job.dir.as_fd(), &rel) else {
            continue;
        };
        let Ok(st) = sys::fstat(fd.as_fd()) else {
            continue;
        };
        let now = Instant::now();
        if seen
            .insert(st.ino, now)
            .is_some_and(|at| now.duration_since(at) < SEEN_FOR)
        {
            continue;
        }
        if seen.len() > SEEN {
            seen.clear();
        }
        done.dirs += 1;
        let mark = Prefetcher::mark();
        let mut subdirs = Vec::new();
        'dir: loop {
            entries.clear();
            match sys::getdents(fd.as_fd(), buf, &mut entries) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            for e in &entries {
                let name = e.name.as_os_str();
                if name == "." || name == ".." || is_internal(name) {
                    continue;
                }
                if done.stats >= limits.stats {
                    break 'dir;
                }
                let Ok(cname) = sys::cstr(name) else {
                    continue;
                };
                done.stats += 1;
                let is_dir = match sys::statx(fd.as_fd(), &cname) {
                    Ok(st) => st.is_dir() && !st.mount_root,
                    Err(_) => false,
                };
                if is_dir && depth < limits.depth {
                    if let Some(p) = child(&rel, name) {
                        subdirs.push(p);
                    }
                }
            }
        }
        // Depth first, in listing order: the order `find`, `du` and `ls -R` descend in, so the
        // read-ahead stays just ahead of the walk instead of reading a whole level first.
        if limits.always_deeper || Prefetcher::went_to_disk(mark) {
            for p in subdirs.into_iter().rev() {
                queue.push_front((p, depth + 1));
            }
        }
    }
    done
}

/// `rel/name`.
fn child(rel: &CStr, name: &OsStr) -> Option<CString> {
    let rel = rel.to_bytes();
    let mut p = Vec::with_capacity(rel.len() + 1 + name.len());
    p.extend_from_slice(rel);
    p.push(b'/');
    p.extend_from_slice(name.as_bytes());
    CString::new(p).ok()
}

/// Opens `rel` beneath `dir` for listing, without touching its access time where allowed.
fn open_dir(dir: BorrowedFd<'_>, rel: &CString) -> Option<OwnedFd> {
    let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW;
    match sys::open_beneath(dir, rel, flags | libc::O_NOATIME) {
        Ok(fd) => Some(fd),
        // O_NOATIME needs ownership or CAP_FOWNER.
        Err(libc::EPERM) => sys::open_beneath(dir, rel, flags).ok(),
        Err(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    fn job(root: &std::path::Path, children: &[&str]) -> Job {
        let fd = sys::open_dir_path(&CString::new(root.as_os_str().as_bytes()).unwrap()).unwrap();
        Job {
            dir: Arc::new(fd),
            children: children.iter().map(|c| CString::new(*c).unwrap()).collect(),
        }
    }

    fn run_job(j: &Job, seen: &mut HashMap<u64, Instant>, limits: &Limits) -> Done {
        read_ahead(
            j,
            seen,
            &mut vec![0u8; 4096],
            limits,
            &AtomicBool::new(false),
        )
    }

    /// Every listing counts as cold.
    const ALL_COLD: Limits = Limits {
        always_deeper: true,
        ..LIMITS
    };

    #[test]
    fn a_job_lists_every_named_directory_once_and_stats_its_entries() {
        let t = tempfile::tempdir().unwrap();
        for d in ["a", "b"] {
            fs::create_dir(t.path().join(d)).unwrap();
            for f in 0..3 {
                fs::write(t.path().join(d).join(format!("f{f}")), b"x").unwrap();
            }
        }
        fs::create_dir(t.path().join("a/.meshfs-tmp-1")).unwrap();
        let mut seen = HashMap::new();
        // "a" twice and a name that is gone: each directory is read once, the missing one
        // skipped, meshfs's own names neither counted nor entered.
        let done = run_job(
            &job(t.path(), &["a", "b", "a", "gone"]),
            &mut seen,
            &ALL_COLD,
        );
        assert_eq!(done, Done { dirs: 2, stats: 6 });
        // Remembered: the same job again reads nothing, until the memory is old.
        let again = run_job(&job(t.path(), &["a", "b"]), &mut seen, &ALL_COLD);
        assert_eq!(again, Done::default());
        for at in seen.values_mut() {
            *at = at.checked_sub(SEEN_FOR).unwrap_or(*at);
        }
        let later = run_job(&job(t.path(), &["a", "b"]), &mut seen, &ALL_COLD);
        assert_eq!(later, Done { dirs: 2, stats: 6 });
    }

    #[test]
    fn a_symlink_is_not_followed_out_of_the_listed_directory() {
        let t = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        fs::create_dir(outside.path().join("secret")).unwrap();
        fs::create_dir(t.path().join("inner")).unwrap();
        std::os::unix::fs::symlink(outside.path(), t.path().join("out")).unwrap();
        std::os::unix::fs::symlink(outside.path(), t.path().join("inner/out")).unwrap();
        let mut seen = HashMap::new();
        let done = run_job(
            &job(t.path(), &["out", "inner/out", "inner"]),
            &mut seen,
            &ALL_COLD,
        );
        assert_eq!(done, Done { dirs: 1, stats: 1 });
    }

    #[test]
    fn cold_listings_lead_down_to_the_depth_limit_and_no_further() {
        let t = tempfile::tempdir().unwrap();
        fs::create_dir_all(t.path().join("l1/l2/l3/l4")).unwrap();
        let mut seen = HashMap::new();
        let two = Limits {
            depth: 2,
            ..ALL_COLD
        };
        // l1 (level 1) and l2 (level 2) are listed; l3 is only seen as l2's entry.
        let done = run_job(&job(t.path(), &["l1"]), &mut seen, &two);
        assert_eq!(done, Done { dirs: 2, stats: 2 });
        // A warm listing leads nowhere: only the named directory is read.
        let warm = Limits {
            always_deeper: false,
            ..ALL_COLD
        };
        let done = run_job(&job(t.path(), &["l1/l2"]), &mut HashMap::new(), &warm);
        assert_eq!(done, Done { dirs: 1, stats: 1 });
    }

    #[test]
    fn a_stopped_job_reads_nothing_more() {
        let t = tempfile::tempdir().unwrap();
        fs::create_dir(t.path().join("d")).unwrap();
        let stopped = AtomicBool::new(true);
        let j = job(t.path(), &["d"]);
        let done = read_ahead(&j, &mut HashMap::new(), &mut [0u8; 4096], &LIMITS, &stopped);
        assert_eq!(done, Done::default());
    }

    #[test]
    fn a_job_stays_within_its_bounds() {
        let t = tempfile::tempdir().unwrap();
        for d in 0..3 {
            fs::create_dir(t.path().join(format!("d{d}"))).unwrap();
            for f in 0..10 {
                fs::write(t.path().join(format!("d{d}/{f}")), b"").unwrap();
            }
        }
        let names = ["d0", "d1", "d2"];
        let few_stats = Limits {
            stats: 15,
            ..ALL_COLD
        };
        let done = run_job(&job(t.path(), &names), &mut HashMap::new(), &few_stats);
        assert_eq!(done, Done { dirs: 2, stats: 15 });
        let few_dirs = Limits {
            dirs: 1,
            ..ALL_COLD
        };
        let done = run_job(&job(t.path(), &names), &mut HashMap::new(), &few_dirs);
        assert_eq!(done, Done { dirs: 1, stats: 10 });
    }

    #[test]
    fn a_listing_from_the_cache_is_not_cold_and_an_offer_without_a_thread_is_declined() {
        let t = tempfile::tempdir().unwrap();
        fs::create_dir(t.path().join("d")).unwrap();
        let mut seen = HashMap::new();
        // Listed once (maybe from disk), then again from the caches: nothing read.
        run_job(&job(t.path(), &["d"]), &mut seen, &LIMITS);
        let mark = Prefetcher::mark();
        let _ = fs::read_dir(t.path().join("d")).unwrap().count();
        assert!(!Prefetcher::went_to_disk(mark));
        let off = Prefetcher::start(false);
        assert!(!off.offer(job(std::path::Path::new("/"), &["tmp"])));
    }
}
