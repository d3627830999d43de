//! The capture loop's decisions, with no IO: which messages make which paths wait, when a pass is
//! due and what it scans, which new directories get their second look, what a failed scan
//! leads to, and when the remote versions that waited for a writer are decided again. The
//! engine's loop only wires it: it feeds messages and the clock in, does the IO the policy
//! asks for (listing a directory, checking an echo, scanning, applying deferred versions), and
//! sleeps until [`Policy::wake_at`].

use super::{CaptureMsg, Coalescer, Hint, NEW_DIR_SECOND_LOOK};
use meshfs_protocol::RelPath;
use std::time::{Duration, Instant};

/// How long after a failed scan the folder is rescanned whole.
pub const RESCAN_AFTER_FAILURE: Duration = Duration::from_secs(2);

/// A path due while a writer through the mount still holds it waits at most this long more.
pub const OPEN_QUIET: Duration = Duration::from_secs(1);

/// Under a steady stream of changes (an `rm -rf`, a `tar -x`, a build) a pass starts at most
/// this often. Each path waits only its own quiet time, so a stream that never pauses would
/// otherwise make a pass, and a journal transaction, every millisecond or so, each for the
/// few paths that came due since the last (an `rm -rf` of 22,327 entries through the mount:
/// 9,234 passes of three paths on average). A change after a pause is captured at once.
pub const BUSY_GAP: Duration = Duration::from_millis(25);

/// The capture loop's state beside its queue (the [`Coalescer`], which `status` also reads).
#[derive(Debug)]
pub struct Policy {
    quiet: Duration,
    /// The queue's next due time.
    next: Option<Instant>,
    /// New directories to look into again, and when.
    second_looks: Vec<(Instant, RelPath)>,
    /// A writer through the mount let go since the last pass.
    released: bool,
    /// Scans fail (the journal's disk is full): the next success says it is over.
    failing: bool,
    /// When the last two passes that found something started, the latest first.
    recent: [Option<Instant>; 2],
}

/// What a pass found to do.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Pass {
    /// Rescan the whole folder.
    pub rescan: bool,
    /// Scan these paths (the caller drops the engine's own echoes first).
    pub paths: Vec<RelPath>,
}

/// How a scan ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scanned {
    /// It journaled what it found.
    Done,
    /// It failed: the journal's disk is full.
    DiskFull,
    /// It failed otherwise.
    Failed,
}

/// What to tell the user, and the folder, after a scan.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct AfterScan {
    /// Scans work again after failing: the folder is unblocked.
    pub recovered: bool,
    /// Capture stops until the journal's disk has room (say it, block the folder).
    pub blocked: bool,
}

impl Policy {
    /// A policy for paths quiet for `quiet` before they are captured.
    pub fn new(quiet: Duration) -> Policy {
        Policy {
            quiet,
            next: None,
            second_looks: Vec::new(),
            released: false,
            failing: false,
            recent: [None, None],
        }
    }

    /// The earliest start of the next pass: set while passes come close together (the
    /// last two less than twice [`BUSY_GAP`] apart), then [`BUSY_GAP`] after the last.
    fn gate(&self) -> Option<Instant> {
        let [Some(last), Some(before)] = self.recent else {
            return None;
        };
        (last.saturating_duration_since(before) < 2 * BUSY_GAP).then_some(last + BUSY_GAP)
    }

    /// When the loop must wake next (`None`: only for a message).
    pub fn wake_at(&self) -> Option<Instant> {
        let look = self.second_looks.iter().map(|(t, _)| *t).min();
        let next = self.next.map(|n| self.gate().map_or(n, |gate| n.max(gate)));
        match (next, look) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn due_by(&mut self, t: Instant) {
        self.next = Some(self.next.map_or(t, |n| n.min(t)));
    }

    /// Messages arrived at `now`.
    pub fn messages(
        &mut self,
        queue: &mut Coalescer,
        msgs: impl IntoIterator<Item = CaptureMsg>,
        now: Instant,
    ) {
        let mut final_now = false;
        for m in msgs {
            match m {
                CaptureMsg::Released(p) => {
                    self.released = true;
                    queue.finalize(&p, now);
                    final_now = true;
                }
                CaptureMsg::NewDir(p) => {
                    self.second_looks
                        .push((now + NEW_DIR_SECOND_LOOK, p.clone()));
                    queue.add(CaptureMsg::NewDir(p), now);
                }
                m => queue.add(m, now),
            }
        }
        // A file whose last writer let go through the mount is captured at once: the quiet
        // time only guesses when a burst of watcher events is over.
        self.due_by(if final_now { now } else { now + self.quiet });
    }

    /// The new directories due for their second look at `now` (not those an apply made:
    /// `made_by_apply`). The caller lists the files in them and hands them to [`Policy::looked`].
    pub fn due_looks(
        &mut self,
        now: Instant,
        made_by_apply: impl Fn(&RelPath) -> bool,
    ) -> Vec<RelPath> {
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.second_looks)
            .into_iter()
            .partition(|(t, _)| *t <= now);
        self.second_looks = later;
        due.into_iter()
            .map(|(_, p)| p)
            .filter(|d| !made_by_apply(d))
            .collect()
    }

    /// The files found in new directories by their second look: captured in this pass.
    pub fn looked(&mut self, queue: &mut Coalescer, files: Vec<RelPath>, now: Instant) {
        let since = now.checked_sub(self.quiet).unwrap_or(now);
        for f in files {
            queue.add(CaptureMsg::Changed(f, Hint::Other), since);
        }
    }

    /// What is ready at `now`: a path a writer through the mount still holds waits (once) for
    /// its release.
    pub fn pass(
        &mut self,
        queue: &mut Coalescer,
        now: Instant,
        held_by_writer: impl Fn(&RelPath) -> bool,
    ) -> Pass {
        if let Some(gate) = self.gate().filter(|gate| now < *gate) {
            // What waits (a second look's files too) is taken once the gap is over.
            if !queue.is_empty() {
                self.due_by(gate);
            }
            return Pass::default();
        }
        let (rescan, ready, next) = queue.take_ready(now, self.quiet, OPEN_QUIET);
        let paths: Vec<RelPath> = ready
            .into_iter()
            .filter(|p| {
                let held = held_by_writer(p) && queue.hold(p, now);
                if !held {
                    queue.captured(p);
                }
                !held
            })
            .collect();
        self.next = match queue.is_empty() {
            true => next,
            false => Some(next.map_or(now + OPEN_QUIET, |t| t.min(now + OPEN_QUIET))),
        };
        if rescan || !paths.is_empty() {
            self.recent = [Some(now), self.recent[0]];
        }
        Pass { rescan, paths }
    }

    /// A scan of this pass ended as `how` at `now`. A failed scan's paths are not journaled:
    /// nothing is lost as long as a later scan covers them, so the folder is rescanned whole
    /// after a pause.
    pub fn scanned(&mut self, queue: &mut Coalescer, how: Scanned, now: Instant) -> AfterScan {
        match how {
            Scanned::Done => AfterScan {
                recovered: std::mem::take(&mut self.failing),
                blocked: false,
            },
            Scanned::DiskFull | Scanned::Failed => {
                self.failing = true;
                let retry = now + RESCAN_AFTER_FAILURE;
                queue.add(CaptureMsg::Rescan, retry);
                self.due_by(retry);
                AfterScan {
                    recovered: false,
                    blocked: how == Scanned::DiskFull,
                }
            }
        }
    }

    /// After a pass: whether the remote versions that waited for a writer are to be decided
    /// again now (`deferred` of them wait). A writer let go, or some wait: once nothing of the
    /// folder is waiting to be captured (the user's version is journaled first, so the two
    /// meet as a conflict with both kept); until then the question stays open.
    pub fn apply_deferred_now(&mut self, queue: &Coalescer, deferred: usize) -> bool {
        if !(self.released || deferred > 0) {
            return false;
        }
        if queue.is_empty() {
            self.released = false;
            true
        } else {
            self.released = true;
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> RelPath {
        RelPath::new(s).unwrap()
    }

    const Q: Duration = Duration::from_millis(10);

    #[test]
    fn a_change_is_scanned_after_its_quiet_time_and_a_release_at_once() {
        let (mut pol, mut q) = (Policy::new(Q), Coalescer::default());
        let t0 = Instant::now();
        pol.messages(&mut q, [CaptureMsg::Changed(p("a"), Hint::Other)], t0);
        assert_eq!(pol.wake_at(), Some(t0 + Q));
        assert!(pol.pass(&mut q, t0, |_| false).paths.is_empty());
        assert_eq!(pol.pass(&mut q, t0 + Q, |_| false).paths, vec![p("a")]);
        // Written through the mount and released: ready now.
        pol.messages(&mut q, [CaptureMsg::Changed(p("b"), Hint::Written)], t0);
        pol.messages(&mut q, [CaptureMsg::Released(p("b"))], t0);
        assert_eq!(pol.wake_at(), Some(t0));
        assert_eq!(pol.pass(&mut q, t0, |_| false).paths, vec![p("b")]);
    }

    #[test]
    fn a_steady_stream_is_captured_in_passes_a_busy_gap_apart_and_a_change_after_a_pause_at_once() {
        let (mut pol, mut q) = (Policy::new(Q), Coalescer::default());
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let change = |pol: &mut Policy, q: &mut Coalescer, name: String, at: Instant| {
            pol.messages(q, [CaptureMsg::Changed(p(&name), Hint::Other)], at)
        };
        // One path a millisecond for 200 ms, a pass whenever the loop is woken.
        let (mut passes, mut captured) = (Vec::new(), 0);
        for n in 0..200u64 {
            change(&mut pol, &mut q, format!("f{n}"), ms(n));
            if pol.wake_at().is_some_and(|t| t <= ms(n)) {
                let pass = pol.pass(&mut q, ms(n), |_| false);
                if !pass.paths.is_empty() {
                    passes.push(n);
                    captured += pass.paths.len();
                }
            }
        }
        // The first two as soon as their paths are due, then one per gap, each taking all
        // that came due meanwhile.
        assert_eq!(&passes[..2], &[10, 11]);
        for w in passes[1..].windows(2) {
            assert!(w[1] - w[0] >= BUSY_GAP.as_millis() as u64, "{passes:?}");
        }
        assert!(passes.len() <= 2 + 200 / BUSY_GAP.as_millis() as usize);
        // The stream ends: what is left is taken once the gap is over, nothing is lost.
        let wake = pol.wake_at().unwrap();
        assert!(wake >= ms(*passes.last().unwrap()) + BUSY_GAP);
        assert!(pol
            .pass(&mut q, wake - Duration::from_millis(1), |_| false)
            .paths
            .is_empty());
        captured += pol.pass(&mut q, wake, |_| false).paths.len();
        captured += pol.pass(&mut q, ms(1000), |_| false).paths.len();
        assert_eq!(captured, 200);
        // A new directory's second look that falls in a gap: its files are taken once the
        // gap is over, though nothing else is queued.
        pol.messages(&mut q, [CaptureMsg::NewDir(p("d"))], ms(1100));
        pol.pass(&mut q, ms(1100) + Q, |_| false);
        pol.messages(&mut q, [CaptureMsg::Changed(p("e"), Hint::Other)], ms(1101));
        pol.pass(&mut q, ms(1101) + Q, |_| false);
        let t1 = ms(1100) + NEW_DIR_SECOND_LOOK;
        pol.messages(&mut q, [CaptureMsg::Changed(p("g"), Hint::Other)], t1 - Q);
        assert_eq!(pol.pass(&mut q, t1, |_| false).paths, vec![p("g")]);
        pol.messages(&mut q, [CaptureMsg::Changed(p("h"), Hint::Other)], t1 - Q);
        assert_eq!(
            pol.pass(&mut q, t1 + Duration::from_millis(1), |_| false)
                .paths,
            vec![p("h")]
        );
        assert_eq!(
            pol.due_looks(t1 + Duration::from_millis(1), |_| false),
            vec![p("d")]
        );
        pol.looked(&mut q, vec![p("d/f")], t1 + Duration::from_millis(1));
        assert!(pol
            .pass(&mut q, t1 + Duration::from_millis(1), |_| false)
            .paths
            .is_empty());
        let wake = pol
            .wake_at()
            .expect("the looked file waits for the gap, not for a message");
        assert_eq!(wake, t1 + Duration::from_millis(1) + BUSY_GAP);
        assert_eq!(pol.pass(&mut q, wake, |_| false).paths, vec![p("d/f")]);
        // After a pause a change is due after its quiet time alone, and so is a release.
        change(&mut pol, &mut q, "late".into(), ms(5000));
        assert_eq!(pol.wake_at(), Some(ms(5000) + Q));
        assert_eq!(
            pol.pass(&mut q, ms(5000) + Q, |_| false).paths,
            vec![p("late")]
        );
        pol.messages(
            &mut q,
            [CaptureMsg::Changed(p("saved"), Hint::Written)],
            ms(6000),
        );
        pol.messages(&mut q, [CaptureMsg::Released(p("saved"))], ms(6000));
        assert_eq!(pol.wake_at(), Some(ms(6000)));
        assert_eq!(
            pol.pass(&mut q, ms(6000), |_| false).paths,
            vec![p("saved")]
        );
    }

    #[test]
    fn a_path_held_by_a_writer_waits_once_then_is_captured() {
        let (mut pol, mut q) = (Policy::new(Q), Coalescer::default());
        let t0 = Instant::now();
        pol.messages(&mut q, [CaptureMsg::Changed(p("a"), Hint::Other)], t0);
        assert!(pol.pass(&mut q, t0 + Q, |_| true).paths.is_empty());
        assert_eq!(pol.wake_at(), Some(t0 + Q + OPEN_QUIET));
        let later = t0 + Q + OPEN_QUIET;
        assert_eq!(pol.pass(&mut q, later, |_| true).paths, vec![p("a")]);
    }

    #[test]
    fn a_new_directory_gets_a_second_look_unless_an_apply_made_it() {
        let (mut pol, mut q) = (Policy::new(Q), Coalescer::default());
        let t0 = Instant::now();
        pol.messages(
            &mut q,
            [CaptureMsg::NewDir(p("d")), CaptureMsg::NewDir(p("e"))],
            t0,
        );
        assert_eq!(pol.pass(&mut q, t0 + Q, |_| false).paths.len(), 2);
        assert!(pol.due_looks(t0 + Q, |_| false).is_empty());
        assert_eq!(pol.wake_at(), Some(t0 + NEW_DIR_SECOND_LOOK));
        let t1 = t0 + NEW_DIR_SECOND_LOOK;
        assert_eq!(pol.due_looks(t1, |d| d == &p("e")), vec![p("d")]);
        pol.looked(&mut q, vec![p("d/f")], t1);
        assert_eq!(pol.pass(&mut q, t1, |_| false).paths, vec![p("d/f")]);
    }

    #[test]
    fn a_failed_scan_rescans_the_folder_after_a_pause_and_a_success_says_it_recovered() {
        let (mut pol, mut q) = (Policy::new(Q), Coalescer::default());
        let t0 = Instant::now();
        let after = pol.scanned(&mut q, Scanned::DiskFull, t0);
        assert!(after.blocked && !after.recovered);
        // The loop wakes for it after the pause (a pass that comes sooner takes it then).
        assert_eq!(pol.wake_at(), Some(t0 + RESCAN_AFTER_FAILURE));
        assert!(
            pol.pass(&mut q, t0 + RESCAN_AFTER_FAILURE, |_| false)
                .rescan
        );
        let after = pol.scanned(&mut q, Scanned::Done, t0 + RESCAN_AFTER_FAILURE);
        assert!(after.recovered && !after.blocked);
        assert!(!pol.scanned(&mut q, Scanned::Done, t0).recovered);
    }

    #[test]
    fn deferred_versions_are_decided_again_only_once_nothing_waits_to_be_captured() {
        let (mut pol, mut q) = (Policy::new(Q), Coalescer::default());
        let t0 = Instant::now();
        assert!(!pol.apply_deferred_now(&q, 0));
        pol.messages(&mut q, [CaptureMsg::Changed(p("a"), Hint::Written)], t0);
        pol.messages(&mut q, [CaptureMsg::Released(p("a"))], t0);
        pol.messages(&mut q, [CaptureMsg::Changed(p("b"), Hint::Other)], t0);
        let pass = pol.pass(&mut q, t0, |_| false);
        assert_eq!(pass.paths, vec![p("a")]);
        assert!(!pol.apply_deferred_now(&q, 1), "b still waits");
        pol.pass(&mut q, t0 + Q, |_| false);
        assert!(pol.apply_deferred_now(&q, 0), "the release is remembered");
        assert!(!pol.apply_deferred_now(&q, 0));
        assert!(pol.apply_deferred_now(&q, 2));
    }
}
