//! A file being assembled for readers (docs/decisions.md, D95): which of its chunks are
//! verified in the temp file, which are asked of a peer, which readers want next, and how far
//! ahead of a sequential reader to fetch.
//!
//! Pure state: no IO, no clock, no lock. `crate::demand::Flight` holds one behind its lock;
//! the stream driver (`crate::apply::stream`) takes what to fetch from it and tells it what
//! arrived; readers ask it whether a byte range is covered.
//!
//! **Invariant:** a chunk is covered only when it was local from the start (copied into the
//! temp file and verified by `assemble`) or a verified copy of it was written ([`Assembly::arrived`]):
//! [`Assembly::covered`] never says yes for a byte that is a hole in the temp file.

use meshfs_protocol::{Chunk, Hash};
use std::collections::HashMap;

/// How far a sequential reader is fetched ahead at first.
pub const FIRST_AHEAD: u64 = 256 << 10;
/// How far a sequential reader is fetched ahead at most (the window doubles up to it).
pub const MAX_AHEAD: u64 = 64 << 20;
/// Most bytes in one fetch the driver starts for what readers want (a whole-file want is cut
/// into pieces of this size, so a reader's own range is not queued behind all of it).
pub const PIECE: u64 = 32 << 20;

/// Where a chunk the temp file lacks stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Not asked of any peer, and no reader wants it.
    Absent,
    /// Wanted; not asked yet (queued in `wants`).
    Wanted,
    /// Asked of a peer, not written yet.
    Asked,
    /// A verified copy is being written into the temp file.
    Writing,
    /// Written, verified: readable.
    Present,
}

#[derive(Debug)]
struct Missing {
    hash: Hash,
    len: u32,
    state: State,
}

/// The assembly of one file: its chunks and what is known of each.
#[derive(Debug)]
pub struct Assembly {
    size: u64,
    /// Each chunk's first byte, in file order.
    starts: Vec<u64>,
    /// Each chunk's entry in `missing`, or `None`: it was local and is in the temp file.
    of_chunk: Vec<Option<usize>>,
    missing: Vec<Missing>,
    by_hash: HashMap<Hash, usize>,
    /// Entries of `missing` not present yet.
    left: usize,
    /// Entries of `missing` wanted, in the order wanted, each with whether a read waits for
    /// it (`false`: read-ahead, or the whole file wanted).
    wants: Vec<(usize, bool)>,
    /// Where the last read ended (a read starting there is sequential).
    next_read: Option<u64>,
    /// The read-ahead window, in bytes (0: none).
    ahead: u64,
    /// The last chunk read ahead so far.
    ahead_to: usize,
    /// Whether the lookup of local copies is still running (D98): until it ends, only the
    /// chunks a read waits for are handed to the network; the rest wait the few milliseconds
    /// until the lookup says which of them this device can copy instead.
    looking: bool,
}

impl Assembly {
    /// The assembly of a file of `chunks`, of which the chunks whose hash is in `absent` are
    /// not in the temp file (all the others are, verified).
    pub fn new(chunks: &[Chunk], absent: impl IntoIterator<Item = Hash>) -> Assembly {
        let mut by_hash = HashMap::new();
        let mut missing = Vec::new();
        for h in absent {
            by_hash.entry(h).or_insert_with(|| {
                missing.push(Missing {
                    hash: h,
                    len: 0,
                    state: State::Absent,
                });
                missing.len() - 1
            });
        }
        let mut starts = Vec::with_capacity(chunks.len());
        let mut of_chunk = Vec::with_capacity(chunks.len());
        let mut at = 0u64;
        for c in chunks {
            starts.push(at);
            let m = by_hash.get(&c.hash).copied();
            if let Some(i) = m {
                missing[i].len = c.len;
            }
            of_chunk.push(m);
            at += c.len as u64;
        }
        // A hash named absent that the file does not hold is nothing to fetch.
        let left = missing.iter().filter(|m| m.len > 0).count();
        for m in missing.iter_mut().filter(|m| m.len == 0) {
            m.state = State::Present;
        }
        Assembly {
            size: at,
            starts,
            of_chunk,
            missing,
            by_hash,
            left,
            wants: Vec::new(),
            next_read: None,
            ahead: 0,
            ahead_to: 0,
            looking: false,
        }
    }

    /// The same assembly, whose absent chunks may still turn out to be on this device: until
    /// [`Assembly::looked`], the network gets only the chunks a read waits for.
    pub fn looking(mut self) -> Assembly {
        self.looking = true;
        self
    }

    /// The lookup of local copies ended: of `local`, the chunks this file still lacks and no
    /// one writes are claimed for the caller, who copies each and calls [`Assembly::arrived`]
    /// (or [`Assembly::not_local`]); the network gets the rest of what readers want.
    pub fn looked(&mut self, local: impl IntoIterator<Item = Hash>) -> Vec<Hash> {
        self.looking = false;
        local.into_iter().filter(|h| self.claim(h)).collect()
    }

    /// `hash`, claimed by [`Assembly::looked`], could not be copied here after all: it is
    /// asked of a peer now (a reader may be waiting for it).
    pub fn not_local(&mut self, hash: &Hash) {
        if let Some(&m) = self.by_hash.get(hash) {
            if self.missing[m].state == State::Writing {
                self.missing[m].state = State::Wanted;
                self.wants.push((m, true));
            }
        }
    }

    /// The file's size.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Whether every chunk is present.
    pub fn complete(&self) -> bool {
        self.left == 0
    }

    /// The chunks (first, last) holding the bytes `[offset, offset + len)`, clamped to the
    /// file; `None` for no byte.
    fn span(&self, offset: u64, len: u64) -> Option<(usize, usize)> {
        let end = offset.saturating_add(len).min(self.size);
        if offset >= end {
            return None;
        }
        let chunk_of = |b: u64| self.starts.partition_point(|&s| s <= b).saturating_sub(1);
        Some((chunk_of(offset), chunk_of(end - 1)))
    }

    fn present(&self, chunk: usize) -> bool {
        self.of_chunk[chunk].is_none_or(|m| self.missing[m].state == State::Present)
    }

    /// Whether every byte of `[offset, offset + len)` (clamped to the file) is verified here.
    pub fn covered(&self, offset: u64, len: u64) -> bool {
        match self.span(offset, len) {
            None => true,
            Some((a, b)) => (a..=b).all(|c| self.present(c)),
        }
    }

    /// Whether some byte of `[offset, offset + len)` is neither here nor asked of a peer: a
    /// reader waiting for it after a fetch failed waits for nothing.
    pub fn stranded(&self, offset: u64, len: u64) -> bool {
        let Some((a, b)) = self.span(offset, len) else {
            return false;
        };
        (a..=b).any(|c| self.of_chunk[c].is_some_and(|m| self.missing[m].state == State::Absent))
    }

    /// Chunks `first..=last` are wanted; `urgent`: a read waits for them.
    fn want(&mut self, first: usize, last: usize, urgent: bool) {
        for c in first..=last.min(self.starts.len().saturating_sub(1)) {
            if let Some(m) = self.of_chunk[c] {
                match self.missing[m].state {
                    State::Absent => {
                        self.missing[m].state = State::Wanted;
                        self.wants.push((m, urgent));
                    }
                    // Held back as read-ahead while the lookup runs, and now read.
                    State::Wanted if urgent && self.looking => self.wants.push((m, true)),
                    _ => {}
                }
            }
        }
    }

    /// A read of `[offset, offset + len)`: its chunks are wanted first, and a reader that goes
    /// on where its last read ended is fetched ahead, the window doubling from
    /// [`FIRST_AHEAD`] to [`MAX_AHEAD`] as it keeps going (a read elsewhere drops it).
    /// Returns whether anything new is wanted.
    pub fn read(&mut self, offset: u64, len: u64) -> bool {
        let before = self.wants.len();
        let Some((a, b)) = self.span(offset, len) else {
            return false;
        };
        self.want(a, b, true);
        let end = offset.saturating_add(len).min(self.size);
        let sequential = self.next_read == Some(offset);
        self.next_read = Some(end);
        if !sequential {
            self.ahead = 0;
            self.ahead_to = b;
            return self.wants.len() > before;
        }
        if self.ahead == 0 {
            self.ahead = FIRST_AHEAD;
        }
        let reached = self
            .starts
            .get(self.ahead_to + 1)
            .copied()
            .unwrap_or(self.size);
        if self.ahead_to <= b || reached.saturating_sub(end) < self.ahead / 2 {
            let to = match self.span(end, self.ahead) {
                Some((_, to)) => to,
                None => b,
            };
            let from = self.ahead_to.max(b) + 1;
            if to >= from {
                self.want(from, to, false);
            }
            self.ahead_to = to.max(b);
            self.ahead = (self.ahead * 2).min(MAX_AHEAD);
        }
        self.wants.len() > before
    }

    /// The chunks of `[offset, offset + len)` are wanted, without counting as a read (an
    /// open's first chunk). Returns whether anything new is wanted.
    pub fn read_probe(&mut self, offset: u64, len: u64) -> bool {
        let before = self.wants.len();
        if let Some((a, b)) = self.span(offset, len) {
            self.want(a, b, true);
        }
        self.wants.len() > before
    }

    /// Every chunk not here is wanted (an open for writing, a pin: the whole file).
    pub fn want_all(&mut self) -> bool {
        let before = self.wants.len();
        self.want(0, self.starts.len().saturating_sub(1), false);
        self.wants.len() > before
    }

    /// What to ask a peer for now: the wanted chunks that are neither here nor asked yet, in
    /// the order wanted, cut into pieces of at most [`PIECE`] bytes; they count as asked.
    /// While the lookup of local copies runs, only those a read waits for are given.
    pub fn take(&mut self) -> Vec<Vec<(Hash, u32)>> {
        let mut pieces: Vec<Vec<(Hash, u32)>> = Vec::new();
        let mut bytes = 0u64;
        let wants = std::mem::take(&mut self.wants);
        let mut held = Vec::new();
        for (m, urgent) in wants {
            let e = &mut self.missing[m];
            if e.state != State::Wanted {
                continue;
            }
            if self.looking && !urgent {
                held.push((m, urgent));
                continue;
            }
            e.state = State::Asked;
            if pieces.is_empty() || bytes + e.len as u64 > PIECE {
                pieces.push(Vec::new());
                bytes = 0;
            }
            bytes += e.len as u64;
            if let Some(p) = pieces.last_mut() {
                p.push((e.hash, e.len));
            }
        }
        self.wants = held;
        pieces
    }

    /// A verified copy of `hash` is about to be written: `true` for the first (the caller
    /// writes it, then calls [`Assembly::arrived`]); `false` when it is written or being
    /// written already, or not part of this file.
    pub fn claim(&mut self, hash: &Hash) -> bool {
        match self.by_hash.get(hash).map(|&m| &mut self.missing[m]) {
            Some(e) if matches!(e.state, State::Absent | State::Wanted | State::Asked) => {
                e.state = State::Writing;
                true
            }
            _ => false,
        }
    }

    /// `hash`, claimed, is written in every place the file holds it.
    pub fn arrived(&mut self, hash: &Hash) {
        if let Some(&m) = self.by_hash.get(hash) {
            if self.missing[m].state != State::Present {
                self.missing[m].state = State::Present;
                self.left -= 1;
            }
        }
    }

    /// Every reader left (the driver stopped its fetches): what was wanted or asked and is not
    /// written is absent again, and a reader that comes back starts without a read-ahead.
    /// Chunks present stay present.
    pub fn paused(&mut self) {
        for m in &mut self.missing {
            if matches!(m.state, State::Wanted | State::Asked) {
                m.state = State::Absent;
            }
        }
        self.wants.clear();
        self.next_read = None;
        self.ahead = 0;
    }

    /// A fetch of `asked` ended without some of them: those not present are absent again
    /// (a later read asks again).
    pub fn failed(&mut self, asked: &[(Hash, u32)]) {
        for (h, _) in asked {
            if let Some(&m) = self.by_hash.get(h) {
                if self.missing[m].state != State::Present {
                    self.missing[m].state = State::Absent;
                }
            }
        }
    }

    /// Of `asked`, those not present.
    pub fn not_present(&self, asked: &[(Hash, u32)]) -> Vec<(Hash, u32)> {
        asked
            .iter()
            .filter(|(h, _)| {
                self.by_hash
                    .get(h)
                    .is_some_and(|&m| self.missing[m].state != State::Present)
            })
            .copied()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn chunks(lens: &[u32]) -> Vec<Chunk> {
        lens.iter()
            .enumerate()
            .map(|(i, &len)| Chunk {
                len,
                hash: Hash::of(&(i as u64).to_le_bytes()),
            })
            .collect()
    }

    fn asked(a: &mut Assembly) -> Vec<Hash> {
        a.take().into_iter().flatten().map(|(h, _)| h).collect()
    }

    #[test]
    fn a_first_small_read_asks_only_the_chunk_it_covers() {
        let c = chunks(&[65536; 64]);
        let mut a = Assembly::new(&c, c.iter().map(|c| c.hash));
        assert!(a.read(0, 4096));
        assert_eq!(asked(&mut a), vec![c[0].hash]);
        assert!(!a.covered(0, 1));
        assert!(a.claim(&c[0].hash));
        assert!(!a.claim(&c[0].hash), "written once");
        a.arrived(&c[0].hash);
        assert!(a.covered(0, 4096));
        assert!(!a.covered(0, 65537));
    }

    #[test]
    fn a_sequential_reader_is_fetched_ahead_in_a_growing_window() {
        let c = chunks(&[65536; 4096]);
        let mut a = Assembly::new(&c, c.iter().map(|c| c.hash));
        a.read(0, 131072);
        assert_eq!(asked(&mut a).len(), 2);
        a.read(131072, 131072);
        // Its own two chunks and 256 KiB ahead.
        assert_eq!(asked(&mut a).len(), 2 + 4);
        let mut off = 262144;
        let mut most = 0;
        while off < 64 << 20 {
            a.read(off, 131072);
            most = most.max(a.take().into_iter().flatten().count());
            off += 131072;
        }
        assert_eq!(a.ahead, MAX_AHEAD);
        assert!(most as u64 * 65536 <= MAX_AHEAD, "{most}");
        // A jump elsewhere drops the window.
        a.read(200 << 20, 4096);
        assert_eq!(a.ahead, 0);
        assert_eq!(asked(&mut a).len(), 1);
    }

    #[test]
    fn a_pause_keeps_what_arrived_and_a_returning_reader_asks_only_for_the_rest() {
        let c = chunks(&[65536; 16]);
        let mut a = Assembly::new(&c, c.iter().map(|c| c.hash));
        a.read(0, 65536);
        a.read(65536, 65536);
        let first = asked(&mut a);
        assert!(first.len() > 2, "its own chunks and read-ahead");
        assert!(a.claim(&c[0].hash));
        a.arrived(&c[0].hash);
        a.want_all();
        a.paused();
        assert!(a.take().is_empty(), "nothing goes out while no one reads");
        assert!(a.stranded(65536, 1), "asked and not arrived: absent again");
        // Back: the first chunk is here; the second is asked again, without read-ahead.
        assert!(a.covered(0, 65536));
        a.read(0, 2 * 65536);
        assert_eq!(asked(&mut a), vec![c[1].hash]);
    }

    #[test]
    fn a_failed_fetch_strands_its_readers_and_a_later_read_asks_again() {
        let c = chunks(&[1000, 2000, 3000]);
        let mut a = Assembly::new(&c, [c[1].hash]);
        assert!(a.covered(0, 1000), "local chunks are covered");
        a.read(500, 1000);
        let p = a.take();
        assert_eq!(p, vec![vec![(c[1].hash, 2000)]]);
        assert!(!a.stranded(500, 1000), "asked");
        a.failed(&p[0]);
        assert!(a.stranded(500, 1000));
        assert!(a.read(500, 1000), "asked again");
        assert_eq!(asked(&mut a), vec![c[1].hash]);
        a.claim(&c[1].hash);
        a.arrived(&c[1].hash);
        assert!(a.complete());
        assert!(a.covered(0, 6000));
    }

    #[test]
    fn while_local_copies_are_looked_up_the_network_gets_only_what_reads_wait_for() {
        let c = chunks(&[65536; 64]);
        let mut a = Assembly::new(&c, c.iter().map(|c| c.hash)).looking();
        a.read_probe(0, 1);
        a.want_all();
        assert_eq!(
            asked(&mut a),
            vec![c[0].hash],
            "the open's probe, not the whole file"
        );
        a.read(65536 + 10, 100);
        assert_eq!(
            asked(&mut a),
            vec![c[1].hash],
            "a read does not wait for the lookup"
        );
        assert!(asked(&mut a).is_empty(), "the rest waits for it");
        assert!(!a.stranded(0, 64 * 65536), "held back is not stranded");
        // Chunks 1 (asked already) and 5..10 are local; chunk 7's copy turns out stale.
        let local: Vec<Hash> = [1, 5, 6, 7, 8, 9].iter().map(|&i| c[i].hash).collect();
        let claimed = a.looked(local.clone());
        assert_eq!(
            claimed, local,
            "asked is not written yet: the copy may claim it"
        );
        assert!(
            !a.claim(&c[1].hash),
            "the peer's copy of chunk 1 is not written twice"
        );
        for &i in &[1, 5, 6, 8, 9] {
            a.arrived(&c[i].hash);
        }
        a.not_local(&c[7].hash);
        let rest = asked(&mut a);
        assert_eq!(
            rest.len(),
            64 - 6,
            "all but 0, 1 (asked) and 5, 6, 8, 9 (copied)"
        );
        assert!(rest.contains(&c[7].hash) && !rest.contains(&c[5].hash));
        for h in rest {
            assert!(a.claim(&h));
            a.arrived(&h);
        }
        assert!(a.claim(&c[0].hash));
        a.arrived(&c[0].hash);
        assert!(a.complete());
    }

    proptest! {
        #[test]
        fn no_range_is_covered_before_every_chunk_under_it_arrived(
            lens in prop::collection::vec(1u32..5000, 1..40),
            reads in prop::collection::vec((0u64..200_000, 1u64..20_000), 1..30),
            arrive_every in 1usize..4,
        ) {
            let c = chunks(&lens);
            let mut a = Assembly::new(&c, c.iter().map(|c| c.hash));
            let mut here = std::collections::HashSet::new();
            let mut pending = Vec::new();
            let mut n = 0;
            for (off, len) in reads {
                a.read(off, len);
                for (h, len) in a.take().into_iter().flatten() {
                    n += 1;
                    if n % arrive_every == 0 && a.claim(&h) {
                        a.arrived(&h);
                        here.insert(h);
                    } else {
                        pending.push((h, len));
                    }
                }
                // Covered exactly when every chunk overlapping the range arrived.
                let mut at = 0u64;
                let end = (off + len).min(a.size());
                let want = c.iter().all(|ch| {
                    let (s, e) = (at, at + ch.len as u64);
                    at = e;
                    e <= off || s >= end || here.contains(&ch.hash)
                });
                prop_assert_eq!(a.covered(off, len), want);
            }
            a.failed(&pending);
            a.want_all();
            for (h, _) in a.take().into_iter().flatten() {
                if a.claim(&h) { a.arrived(&h); }
            }
            prop_assert!(a.complete());
        }
    }
}
