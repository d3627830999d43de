//! What is asked of an on-demand folder's content while the daemon runs (docs/decisions.md,
//! D92–D94): the fetches under way (one per path, whoever else opens it waits for that one),
//! the paths that could not be fetched and why, when each file was last used, the pins, and the
//! signal that content arrived (the budget is checked then).
//!
//! Plain state behind short locks: it reads no clock but the callers', touches no file, socket
//! or journal. `crate::ondemand` acts on it; the folder runtime owns one.

use meshfs_protocol::RelPath;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};

/// Paths listed as not fetched, at most (the rest are counted).
pub const MAX_UNAVAILABLE: usize = 1000;

/// Why a file's content could not be made local: the errno its open fails with, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    /// `EHOSTUNREACH` (no connected peer holds it), `EIO`, `ENOSPC`…
    pub errno: i32,
    /// In words, for `status` and the log.
    pub why: String,
}

/// One fetch under way.
#[derive(Debug)]
pub struct Flight {
    /// The process whose open started it (0: a pin).
    pub pid: u32,
    /// The file's size.
    pub size: u64,
    /// Bytes of it fetched so far (chunks copied from local files are not counted).
    pub done: Arc<AtomicU64>,
    outcome: Mutex<Option<Result<(), Failure>>>,
    ended: Condvar,
}

impl Flight {
    /// Waits for the fetch to end; its outcome.
    pub fn wait(&self) -> Result<(), Failure> {
        let mut o = lock(&self.outcome);
        loop {
            if let Some(r) = o.as_ref() {
                return r.clone();
            }
            o = self.ended.wait(o).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// Who fetches a path: this caller, or another one it waits for.
#[derive(Debug)]
pub enum Turn {
    /// This caller fetches, then calls [`Demand::end`].
    Lead(Arc<Flight>),
    /// Another caller fetches: [`Flight::wait`].
    Follow(Arc<Flight>),
}

/// A path that could not be fetched.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unavailable {
    /// Why.
    pub failure: Failure,
    /// When it was tried last (Unix seconds).
    pub at_unix: u64,
}

/// What is asked of one on-demand folder's content.
#[derive(Debug, Default)]
pub struct Demand {
    flights: Mutex<HashMap<RelPath, Arc<Flight>>>,
    unavailable: Mutex<(BTreeMap<RelPath, Unavailable>, u64)>,
    used: Mutex<HashMap<RelPath, i64>>,
    pins: RwLock<Vec<RelPath>>,
    /// Content arrived: the budget is to be checked.
    pub arrived: tokio::sync::Notify,
    /// Bytes of content made local since the daemon started (copied or fetched).
    pub fetched_bytes: AtomicU64,
    /// Files made local since the daemon started.
    pub fetched_files: AtomicU64,
    /// Files evicted since the daemon started.
    pub evicted_files: AtomicU64,
    /// What `status` last read of the folder's residency (local files and bytes, online files
    /// and bytes), and when: `status` is polled every 10–25 ms by `--wait-synced`, and reading
    /// it is a pass over the folder's records.
    residency: Mutex<Option<(std::time::Instant, [u64; 4])>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Demand {
    /// Starts fetching `path` for `pid`, unless a fetch of it is under way already.
    pub fn begin(&self, path: &RelPath, pid: u32, size: u64) -> Turn {
        let mut f = lock(&self.flights);
        if let Some(flight) = f.get(path) {
            return Turn::Follow(flight.clone());
        }
        let flight = Arc::new(Flight {
            pid,
            size,
            done: Arc::new(AtomicU64::new(0)),
            outcome: Mutex::new(None),
            ended: Condvar::new(),
        });
        f.insert(path.clone(), flight.clone());
        Turn::Lead(flight)
    }

    /// The fetch of `path` (led by this caller) ended with `outcome`, at `now_unix`: those who
    /// wait for it are told, and the path is listed as unavailable, or no longer.
    pub fn end(&self, path: &RelPath, outcome: Result<(), Failure>, now_unix: u64) {
        let flight = lock(&self.flights).remove(path);
        {
            let mut u = lock(&self.unavailable);
            match &outcome {
                Ok(()) => {
                    u.0.remove(path);
                }
                Err(failure) => {
                    let entry = Unavailable {
                        failure: failure.clone(),
                        at_unix: now_unix,
                    };
                    if u.0.len() < MAX_UNAVAILABLE || u.0.contains_key(path) {
                        u.0.insert(path.clone(), entry);
                    } else {
                        u.1 += 1;
                    }
                }
            }
        }
        if let Some(f) = flight {
            *lock(&f.outcome) = Some(outcome);
            f.ended.notify_all();
        }
    }

    /// Whether `path` is being fetched.
    pub fn fetching(&self, path: &RelPath) -> bool {
        lock(&self.flights).contains_key(path)
    }

    /// The fetches under way: (path, pid, size, bytes done), by path.
    pub fn flights(&self) -> Vec<(RelPath, u32, u64, u64)> {
        let mut v: Vec<_> = lock(&self.flights)
            .iter()
            .map(|(p, f)| (p.clone(), f.pid, f.size, f.done.load(Ordering::Relaxed)))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// The paths that could not be fetched (by path), and how many more were not listed.
    pub fn unavailable(&self) -> (Vec<(RelPath, Unavailable)>, u64) {
        let u = lock(&self.unavailable);
        (
            u.0.iter().map(|(p, x)| (p.clone(), x.clone())).collect(),
            u.1,
        )
    }

    /// Forgets that `path` could not be fetched (it is local or gone now).
    pub fn available(&self, path: &RelPath) {
        lock(&self.unavailable).0.remove(path);
    }

    /// `path` was used at `now_ns`.
    pub fn used(&self, path: &RelPath, now_ns: i64) {
        lock(&self.used).insert(path.clone(), now_ns);
    }

    /// When `path` was last used, if it was since the daemon started.
    pub fn last_used(&self, path: &RelPath) -> Option<i64> {
        lock(&self.used).get(path).copied()
    }

    /// The residency `status` shows: the one read within `fresh` (and not made stale since),
    /// else `read`'s.
    pub fn residency(
        &self,
        now: std::time::Instant,
        fresh: std::time::Duration,
        read: impl FnOnce() -> [u64; 4],
    ) -> [u64; 4] {
        let mut r = lock(&self.residency);
        if let Some((at, v)) = *r {
            if now.saturating_duration_since(at) < fresh {
                return v;
            }
        }
        let v = read();
        *r = Some((now, v));
        v
    }

    /// What is local changed (a fetch, an eviction, an install): the next `status` reads the
    /// residency again.
    pub fn changed(&self) {
        *lock(&self.residency) = None;
    }

    /// The pins now.
    pub fn pins(&self) -> Vec<RelPath> {
        self.pins.read().map(|p| p.clone()).unwrap_or_default()
    }

    /// Takes `pins` as the pins from now on.
    pub fn set_pins(&self, pins: Vec<RelPath>) {
        if let Ok(mut p) = self.pins.write() {
            *p = pins;
        }
    }

    /// Whether `path` is pinned: it or a directory above it is.
    pub fn pinned(&self, path: &RelPath) -> bool {
        self.pins
            .read()
            .map(|p| p.iter().any(|pin| path == pin || path.is_within(pin)))
            .unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> RelPath {
        RelPath::new(s).unwrap()
    }

    #[test]
    fn a_second_open_of_a_file_being_fetched_waits_for_the_first_fetch() {
        let d = Arc::new(Demand::default());
        let Turn::Lead(_) = d.begin(&p("a"), 7, 10) else {
            panic!("first is the lead")
        };
        let Turn::Follow(f) = d.begin(&p("a"), 8, 10) else {
            panic!("second follows")
        };
        assert!(d.fetching(&p("a")));
        assert_eq!(d.flights()[0].1, 7);
        let waiter = std::thread::spawn(move || f.wait());
        let no = Failure {
            errno: libc::EHOSTUNREACH,
            why: "offline".into(),
        };
        d.end(&p("a"), Err(no.clone()), 100);
        assert_eq!(waiter.join().unwrap(), Err(no));
        assert!(!d.fetching(&p("a")));
        assert_eq!(d.unavailable().0.len(), 1);
        let Turn::Lead(_) = d.begin(&p("a"), 9, 10) else {
            panic!("a new fetch after the end")
        };
        d.end(&p("a"), Ok(()), 101);
        assert!(d.unavailable().0.is_empty(), "fetched: no longer listed");
    }

    #[test]
    fn a_pin_covers_the_path_and_everything_below_it() {
        let d = Demand::default();
        d.set_pins(vec![p("photos")]);
        assert!(d.pinned(&p("photos")));
        assert!(d.pinned(&p("photos/2024/a.jpg")));
        assert!(!d.pinned(&p("photosx")));
        assert!(!d.pinned(&p("docs/a")));
    }
}
