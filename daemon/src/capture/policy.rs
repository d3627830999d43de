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
        }
    }

    /// When the loop must wake next (`None`: only for a message).
    pub fn wake_at(&self) -> Option<Instant> {
        let look = self.second_looks.iter().map(|(t, _)| *t).min();
        match (self.next, look) {
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
        let (rescan, ready, next) = queue.take_ready(now, self.quiet, OPEN_QUIET);
        let paths = ready
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
