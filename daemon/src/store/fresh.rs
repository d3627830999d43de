//! Small files' content as a scan read it, kept a few seconds for the index batch that
//! announces them (D113).
//!
//! A new small file's content rides the index batch that carries its record (D35). The scan
//! has just read the file to hash it; without this, the batch's writer opens, reads and hashes
//! it once more (`chunks::attach_inline`), 7–43 ms a batch of 1,000 on the sender's blocking
//! threads in a first sync. The scan puts what it read here under its hash; the writer takes
//! it. The bytes are the ones the record's hash was computed from, so they are that version's
//! content whatever became of the file since (the receiver verifies them in any case).
//!
//! Bounded: at most [`BUDGET`] bytes are held (a content that does not fit is not kept: the
//! oldest are the next to be sent), each for [`KEEP`] at most, swept at every use and by the
//! engine's once-a-second pass over its folders. A content is taken once: a second peer's
//! batch reads the file as before.

use crate::lock::{Rank, Ranked};
use meshfs_protocol::Hash;
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// Bytes of content held at most.
pub const BUDGET: usize = 16 << 20;
/// How long a content is held at most.
pub const KEEP: Duration = Duration::from_secs(10);
/// Entries remembered at most (taken ones until they expire): a bound on the queue's memory.
const ENTRIES: usize = 1 << 16;

/// The store's recently read small contents, by hash.
#[derive(Debug)]
pub struct Fresh {
    inner: Ranked<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    by_hash: HashMap<Hash, Vec<u8>>,
    /// Hashes in the order they were put, with when.
    order: VecDeque<(Instant, Hash)>,
    bytes: usize,
}

impl Default for Fresh {
    fn default() -> Fresh {
        Fresh {
            inner: Ranked::new(Rank::Leaf, "fresh contents", Inner::default()),
        }
    }
}

impl Inner {
    fn sweep(&mut self, now: Instant) {
        while let Some(&(at, hash)) = self.order.front() {
            if now.duration_since(at) < KEEP && self.order.len() <= ENTRIES {
                break;
            }
            self.order.pop_front();
            if let Some(d) = self.by_hash.remove(&hash) {
                self.bytes -= d.len();
            }
        }
    }
}

impl Fresh {
    /// The largest file whose content is kept: the largest that rides an index batch
    /// (`chunks::INLINE_FILE_BYTES` is this).
    pub const FILE_BYTES: u64 = 64 << 10;

    /// Keeps `data`, whose hash is `hash`, if it fits.
    pub fn put(&self, hash: Hash, data: Vec<u8>) {
        let now = Instant::now();
        let mut inner = self.inner.lock_anyway();
        inner.sweep(now);
        if inner.bytes + data.len() > BUDGET || inner.by_hash.contains_key(&hash) {
            return;
        }
        inner.bytes += data.len();
        inner.by_hash.insert(hash, data);
        inner.order.push_back((now, hash));
    }

    /// The content of `hash`, if it was kept (and is no longer).
    pub fn take(&self, hash: &Hash) -> Option<Vec<u8>> {
        let mut inner = self.inner.lock_anyway();
        inner.sweep(Instant::now());
        let d = inner.by_hash.remove(hash)?;
        inner.bytes -= d.len();
        Some(d)
    }

    /// Drops what was kept too long.
    pub fn sweep(&self) {
        self.inner.lock_anyway().sweep(Instant::now());
    }

    /// Bytes held now.
    pub fn bytes(&self) -> usize {
        self.inner.lock_anyway().bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_content_is_taken_once_and_what_does_not_fit_is_not_kept() {
        let fresh = Fresh::default();
        let a = vec![1u8; 4096];
        fresh.put(Hash::of(&a), a.clone());
        assert_eq!(fresh.take(&Hash::of(&a)), Some(a.clone()));
        assert_eq!(fresh.take(&Hash::of(&a)), None, "taken once");
        assert_eq!(fresh.bytes(), 0);

        let big = vec![2u8; BUDGET - 100];
        fresh.put(Hash::of(&big), big.clone());
        let c = vec![3u8; 4096];
        fresh.put(Hash::of(&c), c.clone());
        assert_eq!(fresh.take(&Hash::of(&c)), None, "over the budget: not kept");
        assert_eq!(
            fresh.take(&Hash::of(&big)),
            Some(big),
            "the older content stays"
        );
        fresh.put(Hash::of(&c), c.clone());
        assert_eq!(fresh.bytes(), 4096);
    }

    #[test]
    fn a_content_kept_too_long_is_dropped() {
        let mut inner = Inner::default();
        let t0 = Instant::now();
        let a = vec![1u8; 10];
        inner.by_hash.insert(Hash::of(&a), a.clone());
        inner.order.push_back((t0, Hash::of(&a)));
        inner.bytes = a.len();
        inner.sweep(t0 + KEEP / 2);
        assert_eq!(inner.bytes, 10);
        inner.sweep(t0 + KEEP);
        assert_eq!(inner.bytes, 0);
        assert!(inner.by_hash.is_empty() && inner.order.is_empty());
    }
}
