//! Local change capture: the inotify watcher and the coalescing loop that turns events into
//! targeted scans.
//!
//! Events name paths; they never carry content. Each path waits a few milliseconds for more
//! events (a burst of writes to one file becomes one version), and a file that was written
//! waits for its close (or a second of quiet), so a file still being written is never
//! journaled half-written. The scan of a path is idempotent: a path that already matches its
//! record (for example one the engine itself just applied) yields no version.
//!
//! The FUSE layer (meshfs-fuse) plugs in here: its change events enter the same channel. The
//! mount knows what inotify can only guess: the release of a path's last writing handle is
//! the end of that change, so a released path is ready at once and stays ready until the next
//! pass, whatever the watcher reports of the same writes meanwhile (its events for them
//! arrive late, from another thread; seen after the pass, they cost one more scan that finds
//! nothing new).

pub mod policy;

use crate::store::{LocalStat, Stat};
use meshfs_protocol::{FileKind, RelPath, INTERNAL_PREFIX};
use notify::event::{AccessKind, AccessMode, CreateKind, EventKind, ModifyKind, RenameMode};
use notify::{Config, EventKindMask, RecommendedWatcher, RecursiveMode, Watcher};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// A message to a folder's capture loop.
#[derive(Debug)]
pub enum CaptureMsg {
    /// Something happened at these paths (relative to the folder root).
    Changed(RelPath, Hint),
    /// A rename, both ends in one message: they wait and become ready together, so one
    /// capture scan sees the old path gone and the new one there and pairs them as a rename
    /// (two messages could be taken apart by a capture pass between them, and the rename
    /// would become a deletion and a creation whose content is sent again).
    Renamed(RelPath, RelPath),
    /// The whole folder must be rescanned (watcher overflow, or asked by the user).
    Rescan,
    /// The last handle open for writing on this path through the mount was released: a
    /// remote version deferred for it may be applied once the path is captured.
    Released(RelPath),
    /// The watcher saw a directory created behind the mount's back. Captured like
    /// [`CaptureMsg::Changed`], and [`NEW_DIR_SECOND_LOOK`] later the files directly in it are
    /// captured once more ([`files_in`]): the watcher adds the new directory's watch only after
    /// handing on its event, and a file created in it before that gives no event of its own, so
    /// a capture pass of the directory that ran in between (the watcher's thread preempted on a
    /// busy machine) would have missed it for good. Not for a directory an apply made
    /// ([`Echoes::made_dir`]): its files are the engine's.
    NewDir(RelPath),
}

/// How long after a new directory's event the capture loop scans it a second time (see
/// [`CaptureMsg::NewDir`]): far longer than the watcher takes to add the watch.
pub const NEW_DIR_SECOND_LOOK: Duration = Duration::from_secs(1);

/// What kind of event a path saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hint {
    /// Content was written; wait for the close.
    Written,
    /// The writer closed the file.
    Closed,
    /// One end of a rename, seen alone: its pair (a [`CaptureMsg::Renamed`]) should follow at
    /// once; it waits for it up to [`RENAME_PAIR_WAIT`] (the rename left or entered the tree).
    RenameEnd,
    /// Anything else (create, delete, metadata).
    Other,
}

/// Which rename ends the watcher has seen, to tell a move into the folder from one end of a
/// rename inside it (D114). inotify queues a rename inside the watched tree as its old name
/// (`IN_MOVED_FROM`) and right after it its new name (`IN_MOVED_TO`, the same cookie), and
/// notify hands on the new name followed, in the same breath, by both ends together. A new
/// name whose cookie is not the last old name's has no pair to wait for: a file or a tree moved
/// in from outside the folder. notify matches the pair the same way (the last old name only).
#[derive(Debug, Default)]
pub struct RenameEnds {
    last_from: Option<usize>,
}

impl RenameEnds {
    /// The hint for a rename's end with inotify's `cookie`: `from` its old name, else its new
    /// one.
    pub fn end(&mut self, from: bool, cookie: usize) -> Hint {
        if from {
            self.last_from = Some(cookie);
            return Hint::RenameEnd;
        }
        if self.last_from == Some(cookie) {
            self.last_from = None;
            Hint::RenameEnd
        } else {
            // Moved in: created here, as far as this folder knows.
            Hint::Other
        }
    }
}

/// How long one end of a rename waits for the message with both ends. The watcher hands on a
/// rename as three events (the old name, the new name, then both), and between them its thread
/// may nap or be preempted: under load a capture pass took a moved directory's old name alone,
/// journaled its files as deleted and then the new name's as created, and the content crossed
/// the wire again. Only a rename out of the folder pays this wait: one into it is told apart
/// at once ([`RenameEnds`]).
pub const RENAME_PAIR_WAIT: Duration = Duration::from_millis(200);

/// The events watched: changes, and a file closed after writing (its "done" hint). Not opens
/// or reads: every open in the folder (our own scans, chunk reads and inline attachments
/// included) would wake the watcher and fill the kernel's queue (16,384 events) for nothing.
const WATCHED: EventKindMask = EventKindMask::CORE.union(EventKindMask::ACCESS_CLOSE);

/// The watcher thread's naps in a burst of events.
///
/// The kernel wakes a reader waiting on the inotify descriptor for every event it queues, and
/// that wake-up runs in the thread that made the change: for the mount, the FUSE request's
/// own thread (its backing-directory calls queue the events). After an event, the watcher's
/// thread therefore naps (at most once per two naps' time), so that during a burst it is off
/// the wait queue and the kernel only queues; it then reads everything at once. An isolated
/// event is handled at once (the nap comes after it). D32 has the measurements.
///
/// An event that only echoes the mount's own writing of a file (its data changed, and the
/// mount changed it lately) is followed by a longer nap, [`OWN_WRITE_NAP`]: a program writing
/// a large file through the mount makes one event per WRITE request (one per MiB), and the
/// kernel merges the same file's next ones while the thread is off the wait queue (D111).
#[derive(Debug, Clone, Copy)]
pub struct Nap {
    len: Duration,
    last_end: Option<Instant>,
}

impl Nap {
    /// At most 1 ms and at most half the capture loop's quiet time: a new directory's watch is
    /// added after its event's batch, and the capture scan of that directory (a quiet time
    /// after the event) must come after the watch, so that a file created in between is found
    /// by one or the other. Should the watcher's thread be preempted past that, the new
    /// directory's second look ([`CaptureMsg::NewDir`]) finds the file.
    pub fn for_quiet(quiet: Duration) -> Nap {
        Nap {
            len: (quiet / 2).min(Duration::from_millis(1)),
            last_end: None,
        }
    }

    /// How long to sleep now, after an event handled at `now`: `len` if the last nap ended
    /// at least two naps ago (so the thread reads at least two thirds of the time in a
    /// burst, and the kernel's queue of 16,384 events drains), otherwise nothing; after an
    /// echo of the mount's own writing (`own_write`), [`OWN_WRITE_NAP`].
    pub fn after_event(&self, now: Instant, own_write: bool) -> Option<Duration> {
        if self.len.is_zero() {
            return None;
        }
        if own_write {
            return Some(OWN_WRITE_NAP);
        }
        match self.last_end {
            Some(end) if now.saturating_duration_since(end) < 2 * self.len => None,
            _ => Some(self.len),
        }
    }

    /// A nap ended at `now`.
    pub fn ended(&mut self, now: Instant) {
        self.last_end = Some(now);
    }
}

/// The watcher thread's nap after an echo of the mount's own writing ([`Nap`]). What arrives
/// meanwhile waits at most this long: the mount reports its own changes itself, and a change
/// behind its back is seen 10 ms later at worst.
pub const OWN_WRITE_NAP: Duration = Duration::from_millis(10);

/// Starts an inotify watcher on `root`, feeding `tx`; its thread naps as `nap` says. Every
/// path it reports is also handed to `mount` (the folder's mount slot), which invalidates the
/// kernel's caches of a change made behind the mount's back and drops the echoes of the
/// mount's own changes (D34).
pub fn watch(
    root: &Path,
    tx: mpsc::UnboundedSender<CaptureMsg>,
    mut nap: Nap,
    mount: Arc<dyn meshfs_fuse::Invalidator>,
) -> notify::Result<RecommendedWatcher> {
    let root_buf = root.to_path_buf();
    let mut renames = RenameEnds::default();
    // Hands the event on; true if it only echoes the mount's own writing of a file.
    let mut send = move |res: notify::Result<notify::Event>| -> bool {
        let ev = match res {
            Ok(ev) => ev,
            Err(e) => {
                tracing::warn!(error = %e, "watcher error; rescanning");
                let _ = tx.send(CaptureMsg::Rescan);
                return false;
            }
        };
        if ev.need_rescan() {
            let _ = tx.send(CaptureMsg::Rescan);
            return false;
        }
        let hint = match ev.kind {
            EventKind::Access(AccessKind::Close(AccessMode::Write)) => Hint::Closed,
            EventKind::Access(_) => return false,
            EventKind::Modify(ModifyKind::Data(_)) => Hint::Written,
            // One end of a rename (inotify's cookie: a pair may follow). A watched
            // directory's own move comes without one, after the pair.
            EventKind::Modify(ModifyKind::Name(mode @ (RenameMode::From | RenameMode::To))) => {
                match ev.tracker() {
                    Some(cookie) => renames.end(mode == RenameMode::From, cookie),
                    None => Hint::Other,
                }
            }
            _ => Hint::Other,
        };
        let rel: Vec<RelPath> = ev
            .paths
            .iter()
            .filter_map(|p| relative(&root_buf, p))
            .collect();
        // Whether the change was made behind the mount's back (always, with no mount).
        let foreign: Vec<bool> = rel.iter().map(|p| mount.invalidate_foreign(p)).collect();
        let own_write = hint == Hint::Written && !foreign.is_empty() && !foreign.contains(&true);
        // Two paths are a rename's two ends (notify pairs them): one message.
        match <[RelPath; 2]>::try_from(rel) {
            Ok([from, to]) => {
                let _ = tx.send(CaptureMsg::Renamed(from, to));
            }
            Err(rel) => {
                // A directory made through the mount needs no second look: what is
                // created in it through the mount is reported by the mount.
                let new_dir = ev.kind == EventKind::Create(CreateKind::Folder);
                for (p, foreign) in rel.into_iter().zip(foreign) {
                    let _ = tx.send(match new_dir && foreign {
                        true => CaptureMsg::NewDir(p),
                        false => CaptureMsg::Changed(p, hint),
                    });
                }
            }
        }
        own_write
    };
    let handler = move |res: notify::Result<notify::Event>| {
        // The watcher's thread is the engine's: below the mount's request threads (D107).
        crate::priority::background();
        let own_write = send(res);
        if let Some(d) = nap.after_event(Instant::now(), own_write) {
            std::thread::sleep(d);
            nap.ended(Instant::now());
        }
    };
    // Never follow symlinks: a synced `x -> /` would otherwise make the watcher walk and
    // watch the whole filesystem and use up the user's inotify watches.
    let config = Config::default()
        .with_event_kinds(WATCHED)
        .with_follow_symlinks(false);
    let mut w = RecommendedWatcher::new(handler, config)?;
    w.watch(root, RecursiveMode::Recursive)?;
    Ok(w)
}

/// The files (anything but directories) directly in each of `dirs`, relative to `root`: a new
/// directory's second look ([`CaptureMsg::NewDir`]). Its subdirectories need none: the watcher
/// watches each before it reports it, so their own capture passes come after their watches.
pub fn files_in(root: &Path, dirs: Vec<RelPath>) -> Vec<RelPath> {
    let mut out = Vec::new();
    for d in dirs {
        let Ok(entries) = std::fs::read_dir(root.join(d.as_str())) else {
            continue;
        };
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            out.extend(relative(root, &e.path()));
        }
    }
    out
}

/// `p` relative to `root`, if it is a replicable path (internal names are dropped).
pub fn relative(root: &Path, p: &Path) -> Option<RelPath> {
    let rel = p.strip_prefix(root).ok()?;
    let s = rel.to_str()?;
    if s.is_empty() || s.split('/').any(|c| c.starts_with(INTERNAL_PREFIX)) {
        return None;
    }
    RelPath::new(s).ok()
}

/// Paths waiting for their quiet period.
#[derive(Debug, Default)]
pub struct Coalescer {
    waiting: HashMap<RelPath, Waiting>,
    /// Paths put back once because a writer through the mount held them when they were due.
    held: std::collections::HashSet<RelPath>,
    /// The two ends of each rename still waiting, both ways: when one end is ready the other
    /// leaves with it, whatever came for it since. A moved directory's own event (inotify's
    /// `IN_MOVE_SELF`, after the pair) restarts the old name's quiet time; taken alone a
    /// quiet time before it, the new name's files were journaled as created and their
    /// content crossed the wire again (the old name's, a pass later, as deleted).
    partners: HashMap<RelPath, RelPath>,
    rescan: bool,
}

/// One waiting path.
#[derive(Debug, Clone, Copy)]
struct Waiting {
    /// Its last event (its release, once released).
    at: Instant,
    /// Written and not closed yet: waits for its close.
    open: bool,
    /// Its last writer through the mount let go: ready now, whatever comes before the pass.
    released: bool,
    /// One end of a rename whose pair has not come yet.
    renaming: bool,
}

impl Waiting {
    fn due(&self, quiet: Duration, open_quiet: Duration) -> Instant {
        if self.released {
            self.at
        } else if self.open {
            self.at + open_quiet
        } else if self.renaming {
            self.at + quiet.max(RENAME_PAIR_WAIT)
        } else {
            self.at + quiet
        }
    }
}

impl Coalescer {
    /// Records an event.
    pub fn add(&mut self, msg: CaptureMsg, now: Instant) {
        match msg {
            CaptureMsg::Rescan => self.rescan = true,
            // The capture loop handles releases itself.
            CaptureMsg::Released(_) => {}
            CaptureMsg::NewDir(p) => self.add(CaptureMsg::Changed(p, Hint::Other), now),
            CaptureMsg::Renamed(from, to) => {
                if from != to {
                    self.partners.insert(from.clone(), to.clone());
                    self.partners.insert(to.clone(), from.clone());
                }
                for p in [from, to] {
                    if let Some(e) = self.waiting.get_mut(&p) {
                        e.renaming = false;
                    }
                    self.add(CaptureMsg::Changed(p, Hint::Other), now);
                }
            }
            CaptureMsg::Changed(p, hint) => {
                let e = self.waiting.entry(p).or_insert(Waiting {
                    at: now,
                    open: false,
                    released: false,
                    renaming: false,
                });
                if e.released {
                    // The watcher's late report of writes the release already ended.
                    return;
                }
                e.at = now;
                match hint {
                    Hint::Written => e.open = true,
                    Hint::Closed => e.open = false,
                    Hint::RenameEnd => e.renaming = true,
                    Hint::Other => {}
                }
            }
        }
    }

    /// The last writer of `p` through the mount let go (the mount knows it exactly, no quiet
    /// time guesses it): its content is final, so it is captured at the next pass, which the
    /// caller starts at once.
    pub fn finalize(&mut self, p: &RelPath, now: Instant) {
        if let Some(e) = self.waiting.get_mut(p) {
            *e = Waiting {
                at: now,
                open: false,
                released: true,
                renaming: false,
            };
        }
    }

    /// `p` was due but a handle through the mount still has it open for writing (an
    /// `O_TRUNC` open is reported before the writes that follow it): it waits for that
    /// writer's release, or a second of quiet, like a written path. Returns false, and
    /// keeps nothing, when `p` was already put back once: then it is captured now, so a file
    /// held open for long is still journaled.
    pub fn hold(&mut self, p: &RelPath, now: Instant) -> bool {
        if self.held.remove(p) {
            return false;
        }
        self.held.insert(p.clone());
        let e = self.waiting.entry(p.clone()).or_insert(Waiting {
            at: now,
            open: true,
            released: false,
            renaming: false,
        });
        if !e.released {
            e.at = e.at.max(now);
            e.open = true;
        }
        true
    }

    /// `p` is captured: whatever held it is over.
    pub fn captured(&mut self, p: &RelPath) {
        if !self.held.is_empty() {
            self.held.remove(p);
        }
    }

    /// Whether anything is waiting.
    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty() && !self.rescan
    }

    /// How many paths wait.
    pub fn len(&self) -> usize {
        self.waiting.len()
    }

    /// Up to `limit` of the waiting paths, sorted, each with whether it was written and waits
    /// for its close; and whether a rescan of the whole folder waits.
    pub fn waiting(&self, limit: usize) -> (Vec<(RelPath, bool)>, bool) {
        let mut some: Vec<(RelPath, bool)> = self
            .waiting
            .iter()
            .take(limit)
            .map(|(p, w)| (p.clone(), w.open))
            .collect();
        some.sort();
        (some, self.rescan)
    }

    /// Takes what is ready: `(rescan, paths)`; and when the next path becomes ready.
    pub fn take_ready(
        &mut self,
        now: Instant,
        quiet: Duration,
        open_quiet: Duration,
    ) -> (bool, Vec<RelPath>, Option<Instant>) {
        let mut ready = Vec::new();
        let mut next: Option<Instant> = None;
        self.waiting.retain(|p, w| {
            let due = w.due(quiet, open_quiet);
            if due <= now {
                ready.push(p.clone());
                false
            } else {
                next = Some(next.map_or(due, |n| n.min(due)));
                true
            }
        });
        // A ready end takes its partner along (see `partners`).
        let (mut i, mut pulled) = (0, false);
        while i < ready.len() {
            if let Some(other) = self.partners.remove(&ready[i]) {
                self.partners.remove(&other);
                if self.waiting.remove(&other).is_some() {
                    ready.push(other);
                    pulled = true;
                }
            }
            i += 1;
        }
        if pulled {
            next = self
                .waiting
                .values()
                .map(|w| w.due(quiet, open_quiet))
                .min();
        }
        let rescan = std::mem::take(&mut self.rescan);
        (rescan, ready, next)
    }
}

/// Absolute path of `rel` under `root`.
pub fn absolute(root: &Path, rel: &RelPath) -> PathBuf {
    root.join(rel.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_directorys_second_look_is_its_files_alone() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path();
        std::fs::create_dir_all(root.join("new/sub")).unwrap();
        std::fs::write(root.join("new/a"), b"a").unwrap();
        std::fs::write(root.join("new/sub/b"), b"b").unwrap();
        std::os::unix::fs::symlink("a", root.join("new/l")).unwrap();
        std::fs::write(root.join(format!("new/{INTERNAL_PREFIX}tmp")), b"").unwrap();
        let mut got = files_in(
            root,
            vec![RelPath::new("new").unwrap(), RelPath::new("gone").unwrap()],
        );
        got.sort();
        let want: Vec<RelPath> = ["new/a", "new/l"]
            .iter()
            .map(|p| RelPath::new(p).unwrap())
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn a_burst_becomes_one_scan_and_open_files_wait_for_close() {
        let mut c = Coalescer::default();
        let t0 = Instant::now();
        let q = Duration::from_millis(5);
        let oq = Duration::from_secs(1);
        let f = RelPath::new("f").unwrap();
        for i in 0..100 {
            c.add(
                CaptureMsg::Changed(f.clone(), Hint::Written),
                t0 + Duration::from_micros(i),
            );
        }
        let (_, ready, _) = c.take_ready(t0 + Duration::from_millis(10), q, oq);
        assert!(ready.is_empty(), "written but not closed: waits");
        c.add(
            CaptureMsg::Changed(f.clone(), Hint::Closed),
            t0 + Duration::from_millis(11),
        );
        let (_, ready, _) = c.take_ready(t0 + Duration::from_millis(17), q, oq);
        assert_eq!(ready, vec![f]);
        assert!(c.is_empty());
    }

    #[test]
    fn a_release_through_the_mount_is_ready_at_once_whatever_the_watcher_adds() {
        let mut c = Coalescer::default();
        let t0 = Instant::now();
        let (q, oq) = (Duration::from_millis(5), Duration::from_secs(1));
        let f = RelPath::new("f").unwrap();
        // The mount: created, written, its last writer closed and released.
        c.add(CaptureMsg::Changed(f.clone(), Hint::Other), t0);
        c.add(CaptureMsg::Changed(f.clone(), Hint::Written), t0);
        c.add(CaptureMsg::Changed(f.clone(), Hint::Closed), t0);
        c.finalize(&f, t0);
        // The watcher's events for the same writes, arriving after the release.
        c.add(CaptureMsg::Changed(f.clone(), Hint::Written), t0);
        c.add(CaptureMsg::Changed(f.clone(), Hint::Closed), t0);
        let (_, ready, next) = c.take_ready(t0, q, oq);
        assert_eq!(ready, vec![f.clone()], "no quiet time after a release");
        assert!(next.is_none() && c.is_empty());
        // A later event is a new change and waits as usual.
        c.add(CaptureMsg::Changed(f.clone(), Hint::Written), t0);
        assert!(c.take_ready(t0 + q, q, oq).1.is_empty());
        // A release of a path that waits for nothing starts nothing.
        let g = RelPath::new("g").unwrap();
        c.finalize(&g, t0);
        assert_eq!(c.len(), 1);
    }

    #[test]
    fn a_path_due_while_its_writer_holds_it_waits_once_for_the_release() {
        let mut c = Coalescer::default();
        let t0 = Instant::now();
        let (q, oq) = (Duration::from_millis(5), Duration::from_secs(1));
        let f = RelPath::new("f").unwrap();
        // An O_TRUNC open reported as a metadata change: due after the quiet time.
        c.add(CaptureMsg::Changed(f.clone(), Hint::Other), t0);
        let (_, ready, _) = c.take_ready(t0 + q, q, oq);
        assert_eq!(ready, vec![f.clone()]);
        assert!(c.hold(&f, t0 + q), "the writer still has it: put back");
        assert!(c.take_ready(t0 + q * 2, q, oq).1.is_empty());
        // The release makes it ready at once, and the capture clears the hold.
        c.add(CaptureMsg::Changed(f.clone(), Hint::Closed), t0 + q * 3);
        c.finalize(&f, t0 + q * 3);
        assert_eq!(c.take_ready(t0 + q * 3, q, oq).1, vec![f.clone()]);
        c.captured(&f);
        // Held for longer than a second of quiet: put back once, then captured anyway.
        c.add(CaptureMsg::Changed(f.clone(), Hint::Other), t0);
        assert!(c.hold(&f, t0));
        assert_eq!(c.take_ready(t0 + oq, q, oq).1, vec![f.clone()]);
        assert!(!c.hold(&f, t0 + oq), "captured this time");
        assert!(c.is_empty());
    }

    #[test]
    fn the_watcher_naps_at_most_once_per_two_naps_and_never_past_half_the_quiet_time() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut nap = Nap::for_quiet(ms(5));
        // The first event of a burst is handled, then the thread naps.
        assert_eq!(nap.after_event(t0, false), Some(ms(1)));
        nap.ended(t0 + ms(1));
        // Events read right after a nap are handled without one...
        assert_eq!(nap.after_event(t0 + ms(2), false), None);
        // ...but an echo of the mount's own writing, whose next ones the kernel merges.
        assert_eq!(nap.after_event(t0 + ms(2), true), Some(OWN_WRITE_NAP));
        // ...until two naps' length has passed since the last ended.
        assert_eq!(nap.after_event(t0 + ms(3), false), Some(ms(1)));
        // A short quiet time shortens the nap; none without a quiet time.
        assert_eq!(
            Nap::for_quiet(Duration::from_micros(600)).after_event(t0, false),
            Some(Duration::from_micros(300))
        );
        assert_eq!(Nap::for_quiet(Duration::ZERO).after_event(t0, false), None);
        assert_eq!(Nap::for_quiet(Duration::ZERO).after_event(t0, true), None);
    }

    #[test]
    fn both_ends_of_a_rename_become_ready_in_the_same_pass() {
        let mut c = Coalescer::default();
        let t0 = Instant::now();
        let q = Duration::from_millis(5);
        let (a, b) = (RelPath::new("a").unwrap(), RelPath::new("b").unwrap());
        c.add(CaptureMsg::Renamed(a.clone(), b.clone()), t0);
        let (_, mut ready, next) = c.take_ready(t0 + q, q, Duration::from_secs(1));
        ready.sort();
        assert_eq!(ready, vec![a, b]);
        assert!(next.is_none() && c.is_empty());
    }

    #[test]
    fn one_end_of_a_rename_waits_for_its_pair_and_leaves_with_it_or_alone_later() {
        let mut c = Coalescer::default();
        let t0 = Instant::now();
        let q = Duration::from_millis(5);
        let open = Duration::from_secs(1);
        let (a, b) = (RelPath::new("src").unwrap(), RelPath::new("moved").unwrap());
        // The old name alone: not ready after the quiet time (the pair may still come).
        c.add(CaptureMsg::Changed(a.clone(), Hint::RenameEnd), t0);
        c.add(CaptureMsg::Changed(b.clone(), Hint::RenameEnd), t0 + q);
        let (_, ready, next) = c.take_ready(t0 + 10 * q, q, open);
        assert!(ready.is_empty(), "{ready:?}");
        assert_eq!(next, Some(t0 + RENAME_PAIR_WAIT));
        // The pair, late: both ends are ready together, a quiet time after it.
        let t1 = t0 + 20 * q;
        c.add(CaptureMsg::Renamed(a.clone(), b.clone()), t1);
        let (_, mut ready, _) = c.take_ready(t1 + q, q, open);
        ready.sort();
        assert_eq!(ready, vec![b, a.clone()]);
        // Moved out of the folder: no pair ever comes; the old name leaves after the wait.
        c.add(CaptureMsg::Changed(a.clone(), Hint::RenameEnd), t1);
        assert!(c.take_ready(t1 + 10 * q, q, open).1.is_empty());
        assert_eq!(c.take_ready(t1 + RENAME_PAIR_WAIT, q, open).1, vec![a]);
    }

    #[test]
    fn a_renamed_directorys_own_late_event_does_not_hold_back_its_old_name() {
        let mut c = Coalescer::default();
        let t0 = Instant::now();
        let q = Duration::from_millis(5);
        let open = Duration::from_secs(1);
        let (a, b) = (RelPath::new("src").unwrap(), RelPath::new("moved").unwrap());
        c.add(CaptureMsg::Renamed(a.clone(), b.clone()), t0);
        // `IN_MOVE_SELF` of the old name, handled 2 ms later by a preempted watcher thread.
        c.add(CaptureMsg::Changed(a.clone(), Hint::Other), t0 + q / 2);
        c.add(
            CaptureMsg::Changed(RelPath::new("x").unwrap(), Hint::Other),
            t0 + q / 2,
        );
        let (_, mut ready, next) = c.take_ready(t0 + q, q, open);
        ready.sort();
        assert_eq!(ready, vec![b, a.clone()]);
        assert_eq!(next, Some(t0 + q / 2 + q));
        // Once taken, the pair is forgotten: a later event of the old name is its own.
        c.add(CaptureMsg::Changed(a.clone(), Hint::Other), t0 + 2 * q);
        assert_eq!(c.take_ready(t0 + 3 * q, q, open).1.len(), 2);
        assert!(c.partners.is_empty());
    }
}

/// How long an expected echo is kept when no event comes for it (a watcher that lost events,
/// a path changed twice before the event arrived).
const ECHO_TTL: Duration = Duration::from_secs(30);

/// How many expected echoes are kept before the stale ones are dropped.
const ECHO_PRUNE_AT: usize = 4096;

/// What the engine itself just did to paths (an apply installing or removing a file), so that
/// the watcher's event for it is recognised and dropped instead of rescanned: an initial sync
/// of 10,000 files would otherwise rescan each of them once more.
///
/// An event is an echo only if the path's stat *now* is exactly what the apply left (inode,
/// size, mtime, ctime, mode), the same comparison the scanner makes; a local edit that came
/// after the apply changes that stat and is scanned as usual.
///
/// It also keeps the directories an apply made ([`Echoes::expect_dir`]): such a directory needs
/// no second look ([`CaptureMsg::NewDir`]), since what the engine puts in it is journaled by the
/// engine and expected here, just as a directory made through the mount needs none.
#[derive(Debug, Default)]
pub struct Echoes {
    map: std::sync::Mutex<EchoMap>,
}

#[derive(Debug, Default)]
struct EchoMap {
    paths: TtlMap<Option<LocalStat>>,
    dirs: TtlMap<()>,
}

/// Paths with a value and when it was left, each kept at most [`ECHO_TTL`].
#[derive(Debug)]
struct TtlMap<V> {
    map: HashMap<RelPath, (V, Instant)>,
    /// The size at which stale entries are dropped next: twice what a pruning kept (at least
    /// [`ECHO_PRUNE_AT`]), so a burst of young entries is pruned in amortized constant time.
    prune_at: usize,
}

impl<V> Default for TtlMap<V> {
    fn default() -> Self {
        TtlMap {
            map: HashMap::new(),
            prune_at: ECHO_PRUNE_AT,
        }
    }
}

impl<V> TtlMap<V> {
    fn insert(&mut self, path: RelPath, value: V) {
        let now = Instant::now();
        // Pruned at every insert past a fixed size, an initial sync of 10,000 files walked the
        // whole map ~6,000 times (156 ms of CPU, with the lock held, against 3 ms now).
        if self.map.len() >= self.prune_at {
            self.map
                .retain(|_, (_, at)| now.duration_since(*at) < ECHO_TTL);
            self.prune_at = (2 * self.map.len()).max(ECHO_PRUNE_AT);
        }
        self.map.insert(path, (value, now));
    }

    /// The value left at `path`, if it is younger than [`ECHO_TTL`]; removed either way.
    fn take(&mut self, path: &RelPath) -> Option<V> {
        self.map
            .remove(path)
            .filter(|(_, at)| at.elapsed() < ECHO_TTL)
            .map(|(v, _)| v)
    }
}

impl Echoes {
    fn lock(&self) -> std::sync::MutexGuard<'_, EchoMap> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The engine left `path` as `local` (`None`: removed it).
    pub fn expect(&self, path: RelPath, local: Option<LocalStat>) {
        self.lock().paths.insert(path, local);
    }

    /// Whether an event at `path` is the echo of the engine's own change, given what is on disk
    /// now (`stat` is only called when an echo is expected there). Consumes the expectation.
    pub fn is_echo(&self, path: &RelPath, stat: impl FnOnce() -> Option<Stat>) -> bool {
        let Some(expected) = self.lock().paths.take(path) else {
            return false;
        };
        match (expected, stat()) {
            (None, None) => true,
            (Some(want), Some(now)) => {
                matches!(now.kind, Some(FileKind::File) | Some(FileKind::Symlink))
                    && now.local == want
            }
            _ => false,
        }
    }

    /// The engine made the directory `path`.
    pub fn expect_dir(&self, path: RelPath) {
        self.lock().dirs.insert(path, ());
    }

    /// Whether the engine made the directory `path` lately. Consumes the expectation.
    pub fn made_dir(&self, path: &RelPath) -> bool {
        self.lock().dirs.take(path).is_some()
    }
}

#[cfg(test)]
mod rename_end_tests {
    use super::*;

    #[test]
    fn a_new_name_without_its_old_one_is_a_move_in_and_waits_for_nothing() {
        let mut r = RenameEnds::default();
        // A rename inside the folder: the old name, then the new one with its cookie.
        assert_eq!(r.end(true, 7), Hint::RenameEnd);
        assert_eq!(r.end(false, 7), Hint::RenameEnd);
        // Moved in from outside: a new name alone.
        assert_eq!(r.end(false, 8), Hint::Other);
        // Moved out: an old name alone waits for a pair that does not come.
        assert_eq!(r.end(true, 9), Hint::RenameEnd);
        // A move in right after it is not taken for its pair.
        assert_eq!(r.end(false, 10), Hint::Other);
        // The old name's pair, later in the queue, still is.
        assert_eq!(r.end(true, 11), Hint::RenameEnd);
        assert_eq!(r.end(false, 11), Hint::RenameEnd);
        assert_eq!(r.end(false, 11), Hint::Other, "each old name pairs once");
    }
}

#[cfg(test)]
mod echo_tests {
    use super::*;

    fn stat(inode: u64, size: u64) -> Stat {
        Stat {
            kind: Some(FileKind::File),
            local: LocalStat {
                inode,
                size,
                ..Default::default()
            },
            nlink: 1,
        }
    }

    #[test]
    fn only_an_unchanged_stat_is_an_echo_and_only_once() {
        let e = Echoes::default();
        let p = RelPath::new("d/f").unwrap();
        e.expect(p.clone(), Some(stat(7, 10).local));
        assert!(e.is_echo(&p, || Some(stat(7, 10))));
        // Consumed: a second event is a real change.
        assert!(!e.is_echo(&p, || Some(stat(7, 10))));
        e.expect(p.clone(), Some(stat(7, 10).local));
        assert!(
            !e.is_echo(&p, || Some(stat(7, 11))),
            "written after the apply"
        );
        e.expect(p.clone(), None);
        assert!(e.is_echo(&p, || None));
        e.expect(p.clone(), None);
        assert!(
            !e.is_echo(&p, || Some(stat(8, 1))),
            "re-created after the removal"
        );
        assert!(!e.is_echo(&RelPath::new("other").unwrap(), || None));
    }

    #[test]
    fn every_echo_of_a_burst_larger_than_the_pruning_size_is_kept() {
        let e = Echoes::default();
        let paths: Vec<RelPath> = (0..3 * ECHO_PRUNE_AT)
            .map(|i| RelPath::new(&format!("d/f{i}")).unwrap())
            .collect();
        for p in &paths {
            e.expect(p.clone(), None);
        }
        // Young entries survive every pruning; each is recognised once.
        assert!(paths.iter().all(|p| e.is_echo(p, || None)));
        assert!(paths.iter().all(|p| !e.is_echo(p, || None)));
    }

    #[test]
    fn a_directory_the_engine_made_is_known_once_and_apart_from_files() {
        let e = Echoes::default();
        let d = RelPath::new("d").unwrap();
        e.expect_dir(d.clone());
        // A file's echo at the same path is another matter.
        assert!(!e.is_echo(&d, || None));
        assert!(e.made_dir(&d));
        assert!(!e.made_dir(&d), "consumed");
        assert!(!e.made_dir(&RelPath::new("made/elsewhere").unwrap()));
        let many: Vec<RelPath> = (0..3 * ECHO_PRUNE_AT)
            .map(|i| RelPath::new(&format!("d{i}")).unwrap())
            .collect();
        for p in &many {
            e.expect_dir(p.clone());
        }
        assert!(many.iter().all(|p| e.made_dir(p)));
    }
}
