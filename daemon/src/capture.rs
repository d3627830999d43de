//! Local change capture: the inotify watcher and the coalescing loop that turns events into
//! targeted scans.
//!
//! Events name paths; they never carry content. Each path waits a few milliseconds for more
//! events (a burst of writes to one file becomes one version), and a file that was written
//! waits for its close (or a second of quiet), so a file still being written is never
//! journaled half-written. The scan of a path is idempotent: a path that already matches its
//! record (for example one the engine itself just applied) yields no version.
//!
//! The FUSE layer (meshfs-fuse) plugs in here: its change events enter the same channel.

use meshfs_protocol::{RelPath, INTERNAL_PREFIX};
use notify::event::{AccessKind, AccessMode, EventKind, ModifyKind};
use notify::{RecommendedWatcher, RecursiveMode, Watcher};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// A message to a folder's capture loop.
#[derive(Debug)]
pub enum CaptureMsg {
    /// Something happened at these paths (relative to the folder root).
    Changed(RelPath, Hint),
    /// The whole folder must be rescanned (watcher overflow, or asked by the user).
    Rescan,
}

/// What kind of event a path saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hint {
    /// Content was written; wait for the close.
    Written,
    /// The writer closed the file.
    Closed,
    /// Anything else (create, delete, rename, metadata).
    Other,
}

/// Starts an inotify watcher on `root`, feeding `tx`.
pub fn watch(
    root: &Path,
    tx: mpsc::UnboundedSender<CaptureMsg>,
) -> notify::Result<RecommendedWatcher> {
    let root_buf = root.to_path_buf();
    let mut w = notify::recommended_watcher(move |res: notify::Result<notify::Event>| match res {
        Ok(ev) => {
            if ev.need_rescan() {
                let _ = tx.send(CaptureMsg::Rescan);
                return;
            }
            let hint = match ev.kind {
                EventKind::Access(AccessKind::Close(AccessMode::Write)) => Hint::Closed,
                EventKind::Access(_) => return,
                EventKind::Modify(ModifyKind::Data(_)) => Hint::Written,
                _ => Hint::Other,
            };
            for p in &ev.paths {
                if let Some(rel) = relative(&root_buf, p) {
                    let _ = tx.send(CaptureMsg::Changed(rel, hint));
                }
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "watcher error; rescanning");
            let _ = tx.send(CaptureMsg::Rescan);
        }
    })?;
    w.watch(root, RecursiveMode::Recursive)?;
    Ok(w)
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
    waiting: HashMap<RelPath, (Instant, bool)>,
    rescan: bool,
}

impl Coalescer {
    /// Records an event.
    pub fn add(&mut self, msg: CaptureMsg, now: Instant) {
        match msg {
            CaptureMsg::Rescan => self.rescan = true,
            CaptureMsg::Changed(p, hint) => {
                let e = self.waiting.entry(p).or_insert((now, false));
                e.0 = now;
                match hint {
                    Hint::Written => e.1 = true,
                    Hint::Closed => e.1 = false,
                    Hint::Other => {}
                }
            }
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

    /// Takes what is ready: `(rescan, paths)`; and when the next path becomes ready.
    pub fn take_ready(
        &mut self,
        now: Instant,
        quiet: Duration,
        open_quiet: Duration,
    ) -> (bool, Vec<RelPath>, Option<Instant>) {
        let mut ready = Vec::new();
        let mut next: Option<Instant> = None;
        self.waiting.retain(|p, (at, open)| {
            let due = *at + if *open { open_quiet } else { quiet };
            if due <= now {
                ready.push(p.clone());
                false
            } else {
                next = Some(next.map_or(due, |n| n.min(due)));
                true
            }
        });
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
}
