//! What is asked of an on-demand folder's content while the daemon runs (docs/decisions.md,
//! D92–D94): the fetches under way (one per path, whoever else opens it waits for that one),
//! the paths that could not be fetched and why, when each file was last used, the pins, and the
//! signal that content arrived (the budget is checked then).
//!
//! Plain state behind short locks: it reads no clock but the callers', touches no file, socket
//! or journal. `crate::ondemand` acts on it; the folder runtime owns one.

use crate::assembly::Assembly;
use meshfs_protocol::{Hash, RelPath};
use std::collections::{BTreeMap, HashMap};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
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

/// How a flight ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum End {
    /// The content is local: installed over the placeholder, or it was local already.
    Local,
    /// It could not be made local (the install found the path changed, the temp file could
    /// not be made…).
    Failed(Failure),
    /// Every reader left before it was whole: what was fetched is dropped.
    Abandoned,
}

/// What a flight knows, behind its lock.
#[derive(Debug, Default)]
struct Stage {
    /// Set once the temp file exists (`None` before, and for good when it was local).
    assembly: Option<Assembly>,
    /// The temp file being assembled, for readers.
    file: Option<Arc<OwnedFd>>,
    /// Readers and whole-file waiters holding it.
    holds: usize,
    ended: Option<End>,
    /// Fetches that failed so far, and the last one's failure.
    failures: u64,
    last: Option<Failure>,
}

/// One file being made local (docs/decisions.md, D95): its assembly, shared by the readers
/// that wait on ranges of it (on FUSE request threads) and the driver that fetches (on the
/// engine's runtime).
#[derive(Debug)]
pub struct Flight {
    /// The process whose open started it, or last joined it (0: a pin).
    pub pid: AtomicU32,
    /// The file's size.
    pub size: u64,
    /// The content it assembles (the version's hash): a later version is another flight.
    pub hash: Hash,
    /// Bytes of it fetched so far (chunks copied from local files are not counted).
    pub done: Arc<AtomicU64>,
    stage: Mutex<Stage>,
    changed: Condvar,
    /// Wakes the driver: a reader wants more, or left.
    pub wake: tokio::sync::Notify,
}

/// How long a waiting reader sleeps before it looks again without being woken (a safety net:
/// every change wakes it).
const RECHECK: std::time::Duration = std::time::Duration::from_secs(1);

impl Flight {
    fn new(pid: u32, size: u64, hash: Hash) -> Flight {
        Flight {
            pid: AtomicU32::new(pid),
            size,
            hash,
            done: Arc::new(AtomicU64::new(0)),
            stage: Mutex::new(Stage {
                holds: 1,
                ..Stage::default()
            }),
            changed: Condvar::new(),
            wake: tokio::sync::Notify::new(),
        }
    }

    fn wait<'a>(&self, g: MutexGuard<'a, Stage>) -> MutexGuard<'a, Stage> {
        self.changed
            .wait_timeout(g, RECHECK)
            .map(|(g, _)| g)
            .unwrap_or_else(|p| p.into_inner().0)
    }

    /// One more holder (`pid`'s open), unless it ended.
    fn join(&self, pid: u32) -> bool {
        let mut s = lock(&self.stage);
        if s.ended.is_some() {
            return false;
        }
        if s.holds == 0 {
            // Back to a flight that lingered with no holder: it is this process's now.
            self.pid.store(pid, Ordering::Relaxed);
        }
        s.holds += 1;
        true
    }

    /// Whether anyone holds it (an open, a pin, a writer's wait).
    pub fn held(&self) -> bool {
        lock(&self.stage).holds > 0
    }

    /// The driver: every holder left and its fetches are stopped; what they had asked for is
    /// absent again (D100). Nothing, when a holder came back meanwhile (what it wants stays
    /// wanted): `false`.
    pub fn pause(&self) -> bool {
        let mut s = lock(&self.stage);
        if s.holds > 0 {
            return false;
        }
        if let Some(a) = s.assembly.as_mut() {
            a.paused();
        }
        true
    }

    /// A holder leaves (its open closed, or its wait is over).
    pub fn leave(&self) {
        let mut s = lock(&self.stage);
        s.holds = s.holds.saturating_sub(1);
        drop(s);
        self.wake.notify_one();
    }

    /// Waits until the temp file exists: its descriptor, or `None` when the content turned
    /// out to be local already.
    pub fn wait_started(&self) -> Result<Option<Arc<OwnedFd>>, Failure> {
        let mut s = lock(&self.stage);
        loop {
            if let Some(f) = &s.file {
                return Ok(Some(f.clone()));
            }
            match &s.ended {
                Some(End::Local) => return Ok(None),
                Some(End::Failed(f)) => return Err(f.clone()),
                Some(End::Abandoned) => return Err(abandoned()),
                None => {}
            }
            s = self.wait(s);
        }
    }

    /// Waits until `[offset, offset + len)` is verified in the temp file (it is then read from
    /// [`Flight::wait_started`]'s descriptor). `probe`: wanted, but not a read (the read-ahead
    /// does not count it). Fails with the failure of the fetch that should have brought it.
    pub fn ready(&self, offset: u64, len: u64, probe: bool) -> Result<(), Failure> {
        let mut s = lock(&self.stage);
        let seen = s.failures;
        let mut asked = false;
        loop {
            let failures = s.failures;
            if let Some(a) = s.assembly.as_mut() {
                if !asked {
                    asked = true;
                    let more = if probe {
                        !a.covered(offset, len) && a.read_probe(offset, len)
                    } else {
                        a.read(offset, len)
                    };
                    if more {
                        self.wake.notify_one();
                    }
                }
                if a.covered(offset, len) {
                    return Ok(());
                }
                if failures != seen && a.stranded(offset, len) {
                    return Err(s.last.clone().unwrap_or_else(abandoned));
                }
            }
            match &s.ended {
                Some(End::Failed(f)) => return Err(f.clone()),
                Some(End::Abandoned) | Some(End::Local) if s.assembly.is_none() => {
                    return Err(abandoned())
                }
                _ => {}
            }
            s = self.wait(s);
        }
    }

    /// Wants the whole file and waits until it is installed (or cannot be).
    pub fn whole(&self) -> Result<(), Failure> {
        let mut s = lock(&self.stage);
        let seen = s.failures;
        let mut asked = false;
        loop {
            let failures = s.failures;
            match &s.ended {
                Some(End::Local) => return Ok(()),
                Some(End::Failed(f)) => return Err(f.clone()),
                Some(End::Abandoned) => return Err(abandoned()),
                None => {}
            }
            if let Some(a) = s.assembly.as_mut() {
                if !asked {
                    asked = true;
                    if a.want_all() {
                        self.wake.notify_one();
                    }
                }
                if failures != seen && a.stranded(0, a.size()) {
                    return Err(s.last.clone().unwrap_or_else(abandoned));
                }
            }
            s = self.wait(s);
        }
    }

    /// The driver: the temp file exists, `assembly` says what it holds.
    pub fn started(&self, assembly: Assembly, file: OwnedFd) {
        let mut s = lock(&self.stage);
        s.assembly = Some(assembly);
        s.file = Some(Arc::new(file));
        drop(s);
        self.changed.notify_all();
    }

    /// The driver: what to fetch now (pieces of (hash, length)), whether the file is whole,
    /// and whether anyone still holds it.
    pub fn take(&self) -> (Vec<Vec<(Hash, u32)>>, bool, bool) {
        let mut s = lock(&self.stage);
        let held = s.holds > 0;
        match s.assembly.as_mut() {
            Some(a) => (a.take(), a.complete(), held),
            None => (Vec::new(), false, held),
        }
    }

    /// The driver gives up a file no one holds and that is not whole: `true` if it may (no
    /// one joined meanwhile), and from then on no one can.
    pub fn abandon(&self) -> bool {
        let mut s = lock(&self.stage);
        if s.holds > 0 || s.assembly.as_ref().is_some_and(Assembly::complete) {
            return false;
        }
        s.ended = Some(End::Abandoned);
        true
    }

    /// The fetch sink: whether to write `hash` (the first verified copy only).
    pub fn claim(&self, hash: &Hash) -> bool {
        lock(&self.stage)
            .assembly
            .as_mut()
            .is_some_and(|a| a.claim(hash))
    }

    /// The fetch sink: `hash` is written (`bytes` of it), verified.
    pub fn arrived(&self, hash: &Hash, bytes: u64) {
        let complete = lock(&self.stage).assembly.as_mut().is_some_and(|a| {
            a.arrived(hash);
            a.complete()
        });
        self.done.fetch_add(bytes, Ordering::Relaxed);
        self.changed.notify_all();
        if complete {
            // The driver installs it. Its own fetches wake it as they end; a local copy that
            // lands last does not (a pin of a file whose changed chunks came first waited for
            // good: nothing else was left to wake it).
            self.wake.notify_one();
        }
    }

    /// The driver: the lookup of local copies ended; of `local`, the chunks the caller is to
    /// copy (claimed: it writes each, then [`Flight::arrived`] or [`Flight::not_local`]). What
    /// readers wanted meanwhile goes to the network now.
    pub fn looked(&self, local: impl IntoIterator<Item = Hash>) -> Vec<Hash> {
        let claimed = lock(&self.stage)
            .assembly
            .as_mut()
            .map(|a| a.looked(local))
            .unwrap_or_default();
        self.wake.notify_one();
        claimed
    }

    /// The driver: `hash`, claimed by [`Flight::looked`], could not be copied here; it is
    /// asked of a peer instead.
    pub fn not_local(&self, hash: &Hash) {
        if let Some(a) = lock(&self.stage).assembly.as_mut() {
            a.not_local(hash);
        }
        self.wake.notify_one();
    }

    /// Of `asked`, the chunks not here yet.
    pub fn not_present(&self, asked: &[(Hash, u32)]) -> Vec<(Hash, u32)> {
        lock(&self.stage)
            .assembly
            .as_ref()
            .map_or_else(|| asked.to_vec(), |a| a.not_present(asked))
    }

    /// The driver: a fetch of `asked` ended without some of them, because of `failure`; the
    /// readers waiting for them are told.
    pub fn failed(&self, asked: &[(Hash, u32)], failure: Failure) {
        let mut s = lock(&self.stage);
        if let Some(a) = s.assembly.as_mut() {
            a.failed(asked);
        }
        s.failures += 1;
        s.last = Some(failure);
        drop(s);
        self.changed.notify_all();
    }

    fn finish(&self, end: End) {
        let mut s = lock(&self.stage);
        if s.ended.is_none() {
            s.ended = Some(end);
        }
        drop(s);
        self.changed.notify_all();
    }
}

fn abandoned() -> Failure {
    Failure {
        errno: libc::EIO,
        why: "the fetch was given up".into(),
    }
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
    /// The uses not written to the journal yet (`Journal::save_used`).
    unsaved: Mutex<HashMap<RelPath, i64>>,
    pins: RwLock<Vec<RelPath>>,
    /// The subtrees on demand (`on_demand_under`, D77); empty: the whole folder.
    under: RwLock<Vec<RelPath>>,
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
    /// Bytes evicted, and when: their old files may still take the disk for the store's grace
    /// (the free floor counts them as freed meanwhile, D97).
    freeing: Mutex<Vec<(std::time::Instant, u64)>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Demand {
    /// The flight of `path`'s content `hash`, joined (`false`), or a new one this caller
    /// drives (`true`): one per path, whoever else opens the same version shares it (an open
    /// of a newer version starts its own; the older one's install then finds the placeholder
    /// changed). The caller holds it until [`Flight::leave`].
    pub fn begin(&self, path: &RelPath, pid: u32, size: u64, hash: Hash) -> (Arc<Flight>, bool) {
        let mut f = lock(&self.flights);
        if let Some(flight) = f.get(path).filter(|x| x.hash == hash) {
            if flight.join(pid) {
                return (flight.clone(), false);
            }
        }
        let flight = Arc::new(Flight::new(pid, size, hash));
        f.insert(path.clone(), flight.clone());
        (flight, true)
    }

    /// A fetch of `path` failed, at `now_unix`: listed as unavailable until one succeeds.
    pub fn note(&self, path: &RelPath, failure: &Failure, now_unix: u64) {
        let mut u = lock(&self.unavailable);
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

    /// The flight of `path` (driven by this caller) ended with `end`, at `now_unix`: those who
    /// wait for it are told, and the path is listed as unavailable, or no longer.
    pub fn end(&self, path: &RelPath, flight: &Arc<Flight>, end: End, now_unix: u64) {
        {
            let mut f = lock(&self.flights);
            if f.get(path).is_some_and(|x| Arc::ptr_eq(x, flight)) {
                f.remove(path);
            }
        }
        match &end {
            End::Local => self.available(path),
            End::Failed(failure) => self.note(path, failure, now_unix),
            End::Abandoned => {}
        }
        flight.finish(end);
    }

    /// Whether `path` is being fetched for someone (a fetch that lingers with no holder is
    /// not: nothing is asked for it).
    pub fn fetching(&self, path: &RelPath) -> bool {
        lock(&self.flights).get(path).is_some_and(|f| f.held())
    }

    /// The fetches under way for someone: (path, pid, size, bytes done), by path.
    pub fn flights(&self) -> Vec<(RelPath, u32, u64, u64)> {
        let mut v: Vec<_> = lock(&self.flights)
            .iter()
            .filter(|(_, f)| f.held())
            .map(|(p, f)| {
                let pid = f.pid.load(Ordering::Relaxed);
                (p.clone(), pid, f.size, f.done.load(Ordering::Relaxed))
            })
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
        lock(&self.unsaved).insert(path.clone(), now_ns);
    }

    /// Takes the uses noted since the last call, to be written to the journal.
    pub fn take_unsaved(&self) -> Vec<(RelPath, i64)> {
        lock(&self.unsaved).drain().collect()
    }

    /// The uses the journal kept from before this start (a later use stays).
    pub fn load_used(&self, uses: Vec<(RelPath, i64)>) {
        let mut u = lock(&self.used);
        for (path, at) in uses {
            let e = u.entry(path).or_insert(at);
            *e = (*e).max(at);
        }
    }

    /// When `path` was last used (since the daemon started, or as the journal kept it).
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

    /// `bytes` were evicted at `now`.
    pub fn freed(&self, now: std::time::Instant, bytes: u64) {
        if bytes > 0 {
            lock(&self.freeing).push((now, bytes));
        }
    }

    /// The bytes evicted within `window` before `now`.
    pub fn freeing(&self, now: std::time::Instant, window: std::time::Duration) -> u64 {
        let mut f = lock(&self.freeing);
        f.retain(|(at, _)| now.saturating_duration_since(*at) < window);
        f.iter().map(|(_, b)| b).sum()
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

    /// The subtrees on demand now (empty: the whole folder).
    pub fn under(&self) -> Vec<RelPath> {
        self.under.read().map(|u| u.clone()).unwrap_or_default()
    }

    /// Takes `under` as the subtrees on demand from now on (empty: the whole folder).
    pub fn set_under(&self, under: Vec<RelPath>) {
        if let Ok(mut u) = self.under.write() {
            *u = under;
        }
    }

    /// Whether `path` lies outside the subtrees on demand (never, when the whole folder is):
    /// it is kept as a pinned path is (D77).
    pub fn outside(&self, path: &RelPath) -> bool {
        self.under
            .read()
            .map(|u| !u.is_empty() && !u.iter().any(|d| path == d || path.is_within(d)))
            .unwrap_or(false)
    }

    /// Whether `path` is always local: pinned, or outside the subtrees on demand. Its new
    /// versions are fetched as they arrive, never left as placeholders, never evicted.
    pub fn kept(&self, path: &RelPath) -> bool {
        self.pinned(path) || self.outside(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshfs_protocol::Chunk;

    fn p(s: &str) -> RelPath {
        RelPath::new(s).unwrap()
    }

    #[test]
    fn a_second_open_of_a_file_being_fetched_shares_its_flight_and_a_failure_reaches_both() {
        let d = Arc::new(Demand::default());
        let (first, lead) = d.begin(&p("a"), 7, 10, Hash::ZERO);
        assert!(lead);
        let (second, lead) = d.begin(&p("a"), 8, 10, Hash::ZERO);
        assert!(!lead, "second follows");
        assert!(Arc::ptr_eq(&first, &second));
        assert!(d.fetching(&p("a")));
        assert_eq!(d.flights()[0].1, 7);
        let waiter = std::thread::spawn(move || second.wait_started().map(|f| f.is_some()));
        let no = Failure {
            errno: libc::EHOSTUNREACH,
            why: "offline".into(),
        };
        d.end(&p("a"), &first, End::Failed(no.clone()), 100);
        assert_eq!(waiter.join().unwrap(), Err(no));
        assert!(!d.fetching(&p("a")));
        assert_eq!(d.unavailable().0.len(), 1);
        let (again, lead) = d.begin(&p("a"), 9, 10, Hash::ZERO);
        assert!(lead, "a new flight after the end");
        d.end(&p("a"), &again, End::Local, 101);
        assert!(d.unavailable().0.is_empty(), "fetched: no longer listed");
        // An open of a newer version does not join the older one's flight (a lingering one
        // would serve the old content).
        let (old, _) = d.begin(&p("a"), 10, 10, Hash::ZERO);
        old.leave();
        let (newer, lead) = d.begin(&p("a"), 11, 10, Hash::of(b"v2"));
        assert!(lead && !Arc::ptr_eq(&old, &newer));
        assert_eq!(d.flights()[0].1, 11);
    }

    /// A flight of `n` chunks of 1,000 bytes, none here, started over /dev/null; `looking`:
    /// the lookup of local copies runs.
    fn started(d: &Demand, pid: u32, n: u8, looking: bool) -> (Arc<Flight>, Vec<Chunk>) {
        let (f, _) = d.begin(&p("a"), pid, n as u64 * 1000, Hash::ZERO);
        let c: Vec<Chunk> = (0..n)
            .map(|i| Chunk {
                len: 1000,
                hash: Hash::of(&[i]),
            })
            .collect();
        let a = Assembly::new(&c, c.iter().map(|c| c.hash));
        let file = std::fs::File::open("/dev/null").unwrap();
        f.started(if looking { a.looking() } else { a }, OwnedFd::from(file));
        (f, c)
    }

    #[test]
    fn the_driver_is_woken_when_a_local_copy_completes_the_file() {
        let (f, c) = started(&Demand::default(), 0, 2, true);
        // A pin wants the whole file; the lookup finds chunk 1 here; chunk 0 comes from a peer
        // (the fetch that brought it wakes the driver as it ends), chunk 1's copy lands last.
        let claimed = f.looked([c[1].hash]);
        assert_eq!(claimed, vec![c[1].hash]);
        assert!(f.claim(&c[0].hash));
        f.arrived(&c[0].hash, 1000);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            // Spend the permits given so far (the lookup's end), as the driver's loop does.
            let _ =
                tokio::time::timeout(std::time::Duration::from_millis(10), f.wake.notified()).await;
            f.arrived(&c[1].hash, 1000);
            let woken =
                tokio::time::timeout(std::time::Duration::from_secs(5), f.wake.notified()).await;
            assert!(woken.is_ok(), "the driver must see the file whole");
        });
        assert!(f.take().1, "complete");
    }

    #[test]
    fn a_reader_waits_for_its_range_and_not_for_the_rest() {
        let d = Demand::default();
        let (f, c) = started(&d, 7, 3, false);
        let reader = {
            let f = f.clone();
            std::thread::spawn(move || f.ready(1500, 100, false))
        };
        // The driver takes what the reader wants: the middle chunk only.
        let t0 = std::time::Instant::now();
        let asked = loop {
            let (pieces, complete, held) = f.take();
            assert!(!complete && held);
            if !pieces.is_empty() {
                break pieces;
            }
            assert!(t0.elapsed() < std::time::Duration::from_secs(5));
            std::thread::sleep(std::time::Duration::from_millis(5));
        };
        assert_eq!(asked, vec![vec![(c[1].hash, 1000)]]);
        assert!(f.claim(&c[1].hash));
        f.arrived(&c[1].hash, 1000);
        assert_eq!(reader.join().unwrap(), Ok(()));
        // A failed fetch reaches the reader waiting for it.
        let reader = {
            let f = f.clone();
            std::thread::spawn(move || f.ready(0, 10, false))
        };
        let asked = loop {
            let (pieces, _, _) = f.take();
            if !pieces.is_empty() {
                break pieces;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        };
        let no = Failure {
            errno: libc::EHOSTUNREACH,
            why: "gone".into(),
        };
        f.failed(&asked[0], no.clone());
        assert_eq!(reader.join().unwrap(), Err(no));
        f.leave();
        assert!(f.abandon(), "no one holds it, not whole");
        assert!(!f.join(9), "abandoned: a later open starts anew");
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

    #[test]
    fn only_what_lies_outside_the_on_demand_subtrees_is_kept_local() {
        let d = Demand::default();
        assert!(!d.kept(&p("a")), "the whole folder on demand");
        d.set_under(vec![p("big"), p("archive/2019")]);
        assert!(!d.kept(&p("big")));
        assert!(!d.kept(&p("big/x/y")));
        assert!(!d.kept(&p("archive/2019/a")));
        assert!(d.kept(&p("archive/2020/a")));
        assert!(
            d.kept(&p("archive")),
            "a directory above a subtree is outside it"
        );
        assert!(d.kept(&p("bigger/a")));
        assert!(d.kept(&p("small.txt")));
        d.set_pins(vec![p("big/keep")]);
        assert!(
            d.kept(&p("big/keep/a")),
            "a pin inside a subtree still keeps"
        );
        assert!(!d.outside(&p("big/keep/a")));
    }
}
