//! The remote versions a folder's peer sessions have decided to fetch and not installed yet.
//!
//! With three or more devices the same new version is often offered by two peers at once: a
//! device relays what it has just received to the others, while the origin is still sending it
//! to them. Each session decides its batches on its own, so without this a receiver fetched the
//! same content from every peer that announced it (measured: one receiver of a 3-peer fan-out
//! got the dataset three times on wan, `bench/README.md`). Now a record at a path another
//! session has in flight is held back when its batch is decided, and decided again once that
//! session's batch has ended (installed or failed), against a journal that by then has the
//! version: nothing left to fetch. A failed fetch elsewhere only delays the record.
//!
//! No wait cycle: a batch is registered when it is decided (under the folder's lock) and waits
//! only for batches registered before it, here and in its own session's pipeline.

use meshfs_protocol::{DeviceId, RelPath};
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use tokio::sync::watch;

/// The paths a decided batch will change once installed: its transfers' targets and the
/// records it held back, with their parent directories.
#[derive(Clone, Debug, Default)]
pub struct InFlight {
    files: HashSet<RelPath>,
    dirs: HashSet<RelPath>,
}

impl InFlight {
    /// Adds `path` (and its ancestors, as directories).
    pub fn insert(&mut self, path: &RelPath) {
        if self.files.insert(path.clone()) {
            self.dirs.extend(path.ancestors());
        }
    }

    /// These paths and `earlier`'s (a batch before, not yet installed).
    pub fn with(mut self, earlier: &InFlight) -> InFlight {
        self.files.extend(earlier.files.iter().cloned());
        self.dirs.extend(earlier.dirs.iter().cloned());
        self
    }

    /// Whether a decision about `path` depends on what these installs will change: the same
    /// path, a directory above one of them, or a path below one of them.
    pub fn overlaps(&self, path: &RelPath) -> bool {
        self.files.contains(path)
            || self.dirs.contains(path)
            || path.ancestors().iter().any(|a| self.files.contains(a))
    }

    /// Whether it holds no path.
    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }
}

/// A folder's decided, unfinished batches, each with the peer whose session decided it.
#[derive(Default)]
pub struct Fetching {
    batches: Mutex<Vec<Entry>>,
}

struct Entry {
    peer: DeviceId,
    paths: Arc<InFlight>,
    done: watch::Receiver<()>,
}

/// Held while a batch is in flight; dropping it ends the batch for those waiting on it.
#[must_use = "the batch counts as ended as soon as this is dropped"]
pub struct Fetch {
    _done: Option<watch::Sender<()>>,
}

/// The end of another session's batch, to wait for.
pub struct Ended(watch::Receiver<()>);

impl Ended {
    /// Returns once the batch has ended, whether it installed or failed.
    pub async fn wait(mut self) {
        // Nothing is ever sent: `changed` fails exactly when the `Fetch` is dropped.
        while self.0.changed().await.is_ok() {}
    }
}

impl Fetching {
    /// Registers `peer`'s batch that will change `paths`, until the returned [`Fetch`] is
    /// dropped. An empty set registers nothing.
    pub fn start(&self, peer: DeviceId, paths: Arc<InFlight>) -> Fetch {
        if paths.is_empty() {
            return Fetch { _done: None };
        }
        let (tx, rx) = watch::channel(());
        let mut batches = self.lock();
        batches.push(Entry {
            peer,
            paths,
            done: rx,
        });
        Fetch { _done: Some(tx) }
    }

    /// The batches of peers other than `peer` that still have to change what `path` depends
    /// on.
    pub fn elsewhere(&self, peer: &DeviceId, path: &RelPath) -> Vec<Ended> {
        self.lock()
            .iter()
            .filter(|e| e.peer != *peer && e.paths.overlaps(path))
            .map(|e| Ended(e.done.clone()))
            .collect()
    }

    /// The batches, those that ended dropped.
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Entry>> {
        let mut batches = self.batches.lock().unwrap_or_else(|e| e.into_inner());
        batches.retain(|e| e.done.has_changed().is_ok());
        batches
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> RelPath {
        RelPath::new(s).unwrap()
    }

    #[test]
    fn a_batch_waits_for_the_one_before_only_where_their_paths_meet() {
        let mut f = InFlight::default();
        for path in ["a/b/f", "top"] {
            f.insert(&p(path));
        }
        // The same file, a directory above one in flight, a path below a file in flight.
        for meets in ["a/b/f", "a/b", "a", "top", "top/x"] {
            assert!(f.overlaps(&p(meets)), "{meets}");
        }
        // Siblings, other directories, a name that only shares a prefix.
        for apart in ["a/b/g", "a/c", "a/bb/f", "topper", "z/top"] {
            assert!(!f.overlaps(&p(apart)), "{apart}");
        }
    }

    #[tokio::test]
    async fn another_peers_batch_is_waited_for_until_it_ends_and_its_own_never() {
        let fetching = Fetching::default();
        let (a, b) = (DeviceId::from_bytes([1; 32]), DeviceId::from_bytes([2; 32]));
        let mut paths = InFlight::default();
        paths.insert(&p("d/f"));
        let batch = fetching.start(a, Arc::new(paths));
        assert!(fetching.elsewhere(&a, &p("d/f")).is_empty(), "its own peer");
        assert!(fetching.elsewhere(&b, &p("d/g")).is_empty(), "a sibling");
        let mut ended = fetching.elsewhere(&b, &p("d/f"));
        assert_eq!(ended.len(), 1, "in flight from a");
        let waiter = tokio::spawn(ended.remove(0).wait());
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "returned before the batch ended");
        drop(batch);
        tokio::time::timeout(std::time::Duration::from_secs(5), waiter)
            .await
            .expect("still waiting after the batch ended")
            .unwrap();
        assert!(
            fetching.elsewhere(&b, &p("d/f")).is_empty(),
            "ended: forgotten"
        );
        assert!(fetching.batches.lock().unwrap().is_empty());
        // Nothing to change: nothing registered.
        let _none = fetching.start(a, Arc::new(InFlight::default()));
        assert!(fetching.batches.lock().unwrap().is_empty());
    }
}
