//! Progress of a folder's long work — its first scan, the remote changes it receives —
//! counted as it happens for `status` (the CLI makes rates and ETAs from successive
//! documents), and logged at info every [`LOG_EVERY`] while a stretch of work lasts longer
//! than that, with one line when it ends: never per file or chunk.
//!
//! A stretch begins when work is known to wait and ends when none waits any more. Counts are
//! per batch: a scan slice ([`crate::scanner::FIRST_SCAN_SLICE`] files) or a received index
//! batch, so a batch of large files counts when it is done, not byte by byte. Meanwhile the
//! engine ticks every second ([`Progress::tick`]) with the bytes received from the folder's
//! peers, so a long batch is still logged, with the bytes that came in so far.

use meshfs_protocol::{FileKind, FileRecord, FolderId};
use serde::Serialize;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How often a long stretch of work is logged.
pub const LOG_EVERY: Duration = Duration::from_secs(5);

/// What is done and what waits, as `status` shows it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Counts {
    /// Items done since the daemon started: files hashed, or records applied.
    pub done: u64,
    /// Their bytes.
    pub bytes_done: u64,
    /// Items known to wait.
    pub left: u64,
    /// Their bytes; null when not known (a scan knows how many files it has left to hash,
    /// not their size).
    pub bytes_left: Option<u64>,
}

/// The kind of work, for the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Work {
    /// A folder's first scan hashing its files.
    FirstScan,
    /// Remote changes being applied.
    Receiving,
}

/// The progress of one kind of work on one folder.
#[derive(Debug)]
pub struct Progress {
    folder: FolderId,
    work: Work,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    counts: Counts,
    /// Bytes received from the folder's peers since the daemon started, as last ticked.
    wire: u64,
    /// The current stretch: when it began, what was done and received before it; `None` when
    /// idle.
    stretch: Option<(Instant, Counts, u64)>,
    /// When the current stretch was last logged.
    logged: Option<Instant>,
}

/// What to log after a change of the counts.
#[derive(Debug, PartialEq, Eq)]
enum Log {
    /// The stretch goes on: (done, bytes done, bytes received) in it so far, the counts, its
    /// age.
    Going((u64, u64, u64), Counts, Duration),
    /// The stretch ended after a long time: (done, bytes done) in it, its length.
    Ended(u64, u64, Duration),
}

impl State {
    /// Applies `change` to the counts at `now` and says what to log.
    fn update(&mut self, now: Instant, change: impl FnOnce(&mut Counts)) -> Option<Log> {
        let before = self.counts;
        change(&mut self.counts);
        if self.stretch.is_none() && self.counts.left > 0 {
            self.stretch = Some((now, before, self.wire));
            self.logged = None;
        }
        let (start, at_start, wire_at_start) = self.stretch?;
        let age = now.saturating_duration_since(start);
        let done = (
            self.counts.done - at_start.done,
            self.counts.bytes_done - at_start.bytes_done,
        );
        if self.counts.left == 0 {
            self.stretch = None;
            return (age >= LOG_EVERY).then_some(Log::Ended(done.0, done.1, age));
        }
        let due = self.logged.map_or(age >= LOG_EVERY, |t| {
            now.saturating_duration_since(t) >= LOG_EVERY
        });
        if due {
            self.logged = Some(now);
            let received = self.wire.saturating_sub(wire_at_start);
            return Some(Log::Going((done.0, done.1, received), self.counts, age));
        }
        None
    }
}

/// Bytes as MiB with one decimal, for a log line.
fn mib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / f64::from(1 << 20))
}

impl Progress {
    /// No work done yet on `folder`.
    pub fn new(folder: FolderId, work: Work) -> Progress {
        Progress {
            folder,
            work,
            state: Mutex::default(),
        }
    }

    /// The counts now.
    pub fn counts(&self) -> Counts {
        self.state.lock().map(|s| s.counts).unwrap_or_default()
    }

    fn update(&self, change: impl FnOnce(&mut Counts)) {
        let log = match self.state.lock() {
            Ok(mut s) => s.update(Instant::now(), change),
            Err(_) => return,
        };
        self.log(log);
    }

    fn log(&self, log: Option<Log>) {
        let folder = &self.folder;
        let secs = |d: Duration| d.as_secs();
        match (self.work, log) {
            (_, None) => {}
            (Work::FirstScan, Some(Log::Going((n, b, _), c, age))) => {
                tracing::info!(%folder, hashed_files = n, hashed_mib = %mib(b), files_left = c.left, secs = secs(age), "first scan: still hashing")
            }
            (Work::FirstScan, Some(Log::Ended(n, b, age))) => {
                tracing::info!(%folder, hashed_files = n, hashed_mib = %mib(b), secs = secs(age), "first scan: hashing done")
            }
            (Work::Receiving, Some(Log::Going((n, b, wire), c, age))) => {
                tracing::info!(%folder, applied_records = n, applied_mib = %mib(b), records_left = c.left,
                    mib_left = %mib(c.bytes_left.unwrap_or(0)), received_mib = %mib(wire), secs = secs(age), "receiving: still applying")
            }
            (Work::Receiving, Some(Log::Ended(n, b, age))) => {
                tracing::info!(%folder, applied_records = n, applied_mib = %mib(b), secs = secs(age), "receiving: done")
            }
        }
    }

    /// A second passed; `wire` is what the folder's peers have sent this device since the
    /// daemon started (all of their traffic: exact when they share only this folder).
    pub fn tick(&self, wire: u64) {
        let log = match self.state.lock() {
            Ok(mut s) => {
                s.wire = wire;
                s.update(Instant::now(), |_| {})
            }
            Err(_) => return,
        };
        self.log(log);
    }

    /// A scan hashed `files` files of `bytes` bytes and has `left` more to hash.
    pub fn hashed(&self, files: u64, bytes: u64, left: u64) {
        self.update(|c| {
            c.done += files;
            c.bytes_done += bytes;
            c.left = left;
            c.bytes_left = None;
        });
    }

    /// The records of a received batch wait to be applied; the returned guard says when they
    /// are applied, or (dropped unapplied) that they no longer wait.
    pub fn queue(self: &Arc<Self>, records: &[FileRecord]) -> Queued {
        let n = records.len() as u64;
        let bytes = records
            .iter()
            .filter(|r| r.kind == FileKind::File && !r.deleted)
            .map(|r| r.size)
            .sum();
        self.update(|c| {
            c.left += n;
            c.bytes_left = Some(c.bytes_left.unwrap_or(0) + bytes);
        });
        Queued {
            progress: self.clone(),
            n,
            bytes,
            applied: false,
        }
    }
}

/// A received batch waiting to be applied ([`Progress::queue`]).
#[derive(Debug)]
pub struct Queued {
    progress: Arc<Progress>,
    n: u64,
    bytes: u64,
    applied: bool,
}

impl Queued {
    /// The batch is applied.
    pub fn applied(mut self) {
        self.applied = true;
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        let (n, bytes, applied) = (self.n, self.bytes, self.applied);
        self.progress.update(|c| {
            c.left = c.left.saturating_sub(n);
            c.bytes_left = Some(c.bytes_left.unwrap_or(0).saturating_sub(bytes));
            if applied {
                c.done += n;
                c.bytes_done += bytes;
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn add(left: u64) -> impl FnOnce(&mut Counts) {
        move |c| c.left += left
    }

    fn finish(done: u64, bytes: u64) -> impl FnOnce(&mut Counts) {
        move |c| {
            c.left = c.left.saturating_sub(done);
            c.done += done;
            c.bytes_done += bytes;
        }
    }

    #[test]
    fn a_short_stretch_of_work_logs_nothing() {
        let mut s = State::default();
        let t = Instant::now();
        assert_eq!(s.update(t, add(10)), None);
        assert_eq!(s.update(t + Duration::from_secs(1), finish(10, 100)), None);
        assert!(s.stretch.is_none());
        assert_eq!(s.counts.done, 10);
    }

    #[test]
    fn a_long_stretch_is_logged_every_few_seconds_then_once_when_it_ends() {
        let mut s = State::default();
        let t = Instant::now();
        let at = |secs: u64| t + Duration::from_secs(secs);
        s.update(t, add(100));
        assert_eq!(s.update(at(2), finish(10, 1000)), None, "not long yet");
        let going = s.update(at(6), finish(10, 1000));
        assert!(
            matches!(
                going,
                Some(Log::Going((20, 2000, 0), Counts { left: 80, .. }, _))
            ),
            "{going:?}"
        );
        assert_eq!(s.update(at(8), finish(10, 1000)), None, "logged 2 s ago");
        // A second passes with nothing applied, and the peers sent 3000 bytes meanwhile.
        s.wire = 3000;
        let going = s.update(at(11), |_| {});
        assert!(
            matches!(going, Some(Log::Going((30, 3000, 3000), _, _))),
            "{going:?}"
        );
        let ended = s.update(at(12), finish(70, 7000));
        assert_eq!(
            ended,
            Some(Log::Ended(100, 10_000, Duration::from_secs(12)))
        );
        // The next stretch counts from zero.
        s.update(at(100), add(5));
        assert!(matches!(
            s.update(at(110), finish(1, 10)),
            Some(Log::Going((1, 10, 0), _, _))
        ));
    }

    fn record(size: u64, deleted: bool) -> FileRecord {
        FileRecord {
            path: meshfs_protocol::RelPath::new("f").unwrap(),
            kind: FileKind::File,
            deleted,
            mode: 0o644,
            mtime_ns: 0,
            size,
            hash: meshfs_protocol::Hash::ZERO,
            chunks: Vec::new(),
            target: String::new(),
            version: Default::default(),
            modified_by: meshfs_protocol::DeviceId::from_bytes([1; 32]).short(),
            sequence: 1,
        }
    }

    #[test]
    fn a_received_batch_waits_until_applied_and_a_failed_one_no_longer_waits() {
        let p = Arc::new(Progress::new(
            FolderId::new("work").unwrap(),
            Work::Receiving,
        ));
        let one = p.queue(&[record(100, false), record(0, true)]);
        let two = p.queue(&[record(50, false)]);
        let c = p.counts();
        assert_eq!((c.left, c.bytes_left), (3, Some(150)));
        one.applied();
        let c = p.counts();
        assert_eq!(
            (c.done, c.bytes_done, c.left, c.bytes_left),
            (2, 100, 1, Some(50))
        );
        drop(two);
        let c = p.counts();
        assert_eq!(
            (c.done, c.bytes_done, c.left, c.bytes_left),
            (2, 100, 0, Some(0))
        );
    }
}
