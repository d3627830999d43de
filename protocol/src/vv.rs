//! Version vectors: which device's edits a version has seen.
//!
//! A vector maps a device's [`ShortId`] to a counter. Vectors are kept sorted by device with
//! no zero counters, so equal histories have equal representations (and equal encodings).

use crate::ids::ShortId;
use serde::{Deserialize, Deserializer, Serialize};
use std::cmp::Ordering;
use std::fmt;

/// How two versions relate causally.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VvOrdering {
    /// Same history.
    Equal,
    /// `self` happened before `other` (`other` has seen everything `self` has, and more).
    Before,
    /// `self` has seen everything `other` has, and more.
    After,
    /// Neither has seen all of the other: a conflict candidate.
    Concurrent,
}

/// A version vector: device → counter, sorted, without zero entries.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize)]
pub struct VersionVector(Vec<(ShortId, u64)>);

impl VersionVector {
    /// The empty vector (no history).
    pub fn new() -> VersionVector {
        VersionVector(Vec::new())
    }

    /// Builds a vector from any (device, counter) pairs; zero counters are dropped and
    /// duplicates keep their largest counter.
    pub fn from_pairs(pairs: impl IntoIterator<Item = (ShortId, u64)>) -> VersionVector {
        // Sort once, then keep each device's largest counter: O(n log n) whatever the order
        // (inserting one by one was quadratic for a descending list).
        let mut all: Vec<(ShortId, u64)> = pairs.into_iter().filter(|p| p.1 > 0).collect();
        all.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
        all.dedup_by_key(|p| p.0);
        // Exactly as long as it is: a decoded vector would otherwise keep the spare room of
        // the collection, up to twice its entries.
        all.shrink_to_fit();
        VersionVector(all)
    }

    /// The (device, counter) pairs, sorted by device.
    pub fn entries(&self) -> &[(ShortId, u64)] {
        &self.0
    }

    /// About the memory its entries take.
    pub fn held_bytes(&self) -> usize {
        self.0.capacity() * std::mem::size_of::<(ShortId, u64)>()
    }

    /// Whether no device has a counter.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The counter of `dev` (0 when absent).
    pub fn get(&self, dev: ShortId) -> u64 {
        match self.0.binary_search_by_key(&dev, |e| e.0) {
            Ok(i) => self.0[i].1,
            Err(_) => 0,
        }
    }

    fn set(&mut self, dev: ShortId, counter: u64) {
        match self.0.binary_search_by_key(&dev, |e| e.0) {
            Ok(i) if counter == 0 => {
                self.0.remove(i);
            }
            Ok(i) => self.0[i].1 = counter,
            Err(_) if counter == 0 => {}
            Err(i) => self.0.insert(i, (dev, counter)),
        }
    }

    /// Records a new edit by `dev`: its counter becomes `max(counter + 1, floor)`.
    ///
    /// The daemon passes the current Unix time in seconds as `floor`, so a device whose
    /// journal was lost and recreated still produces versions that are never *before* the
    /// ones it made earlier (they are concurrent or newer, and so never silently overwritten).
    ///
    /// No counter passes [`MAX_VV_COUNTER`], the most a peer accepts. Once `dev`'s is there (a
    /// peer may send it so, to stop this device's edits of a path from reaching anyone), the
    /// edit is counted under [`spill_id`]`(dev)` instead, and so on along that chain. The
    /// result still strictly dominates `self`, and is the same on every device.
    pub fn increment(&mut self, dev: ShortId, floor: u64) {
        let mut dev = dev;
        // Every id of the chain at the cap is an entry: within one more step than there are
        // entries the chain reaches one that is not (a cycle would take a blake3 collision).
        for _ in 0..=self.0.len() {
            let counter = self.get(dev);
            if counter < MAX_VV_COUNTER {
                self.set(dev, (counter + 1).max(floor).min(MAX_VV_COUNTER));
                return;
            }
            dev = spill_id(dev);
        }
    }

    /// A copy with `dev`'s counter incremented (see [`VersionVector::increment`]).
    pub fn incremented(&self, dev: ShortId, floor: u64) -> VersionVector {
        let mut v = self.clone();
        v.increment(dev, floor);
        v
    }

    /// Pointwise maximum of the two vectors: the least vector that has seen both.
    pub fn merge(&self, other: &VersionVector) -> VersionVector {
        let mut out = Vec::with_capacity(self.0.len().max(other.0.len()));
        let (mut i, mut j) = (0, 0);
        while i < self.0.len() || j < other.0.len() {
            match (self.0.get(i), other.0.get(j)) {
                (Some(a), Some(b)) => match a.0.cmp(&b.0) {
                    Ordering::Less => {
                        out.push(*a);
                        i += 1;
                    }
                    Ordering::Greater => {
                        out.push(*b);
                        j += 1;
                    }
                    Ordering::Equal => {
                        out.push((a.0, a.1.max(b.1)));
                        i += 1;
                        j += 1;
                    }
                },
                (Some(a), None) => {
                    out.push(*a);
                    i += 1;
                }
                (None, Some(b)) => {
                    out.push(*b);
                    j += 1;
                }
                (None, None) => break,
            }
        }
        VersionVector(out)
    }

    /// How `self` relates to `other`.
    pub fn compare(&self, other: &VersionVector) -> VvOrdering {
        let (mut less, mut greater) = (false, false);
        let (mut i, mut j) = (0, 0);
        while i < self.0.len() || j < other.0.len() {
            let (a, b) = match (self.0.get(i), other.0.get(j)) {
                (Some(a), Some(b)) => match a.0.cmp(&b.0) {
                    Ordering::Less => {
                        i += 1;
                        (a.1, 0)
                    }
                    Ordering::Greater => {
                        j += 1;
                        (0, b.1)
                    }
                    Ordering::Equal => {
                        i += 1;
                        j += 1;
                        (a.1, b.1)
                    }
                },
                (Some(a), None) => {
                    i += 1;
                    (a.1, 0)
                }
                (None, Some(b)) => {
                    j += 1;
                    (0, b.1)
                }
                (None, None) => break,
            };
            less |= a < b;
            greater |= a > b;
        }
        match (less, greater) {
            (false, false) => VvOrdering::Equal,
            (true, false) => VvOrdering::Before,
            (false, true) => VvOrdering::After,
            (true, true) => VvOrdering::Concurrent,
        }
    }

    /// Whether `self` has seen everything `other` has (Equal or After).
    pub fn dominates(&self, other: &VersionVector) -> bool {
        matches!(self.compare(other), VvOrdering::Equal | VvOrdering::After)
    }
}

impl std::fmt::Display for VersionVector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("{")?;
        for (i, (d, c)) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{}:{}", d.display7(), c)?;
        }
        f.write_str("}")
    }
}

/// The id an edit by `dev` is counted under once `dev`'s counter is at [`MAX_VV_COUNTER`]
/// ([`VersionVector::increment`]): 64 bits of blake3 of `dev`, like a resolver id; no real
/// device has it.
pub fn spill_id(dev: ShortId) -> ShortId {
    let mut h = blake3::Hasher::new();
    h.update(b"meshfs-vv-spill/1");
    h.update(&dev.0.to_be_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&h.finalize().as_bytes()[..8]);
    ShortId(u64::from_be_bytes(first))
}

/// Most entries a received vector may have. A vector gains an entry per device that edited the
/// path and per distinct conflict resolution of it; a peer cannot make us hold or compare more.
pub const MAX_VV_ENTRIES: usize = 4096;
/// Most entries a vector kept by a device may have: one fewer than a peer accepts, so that the
/// next local edit, which adds at most this device's own entry, still makes a vector every peer
/// accepts. A peer's record whose decision would keep a longer vector (a merge of two long
/// histories) is refused, never pruned: a pruned vector would forget edits it has seen.
pub const MAX_VV_ENTRIES_KEPT: usize = MAX_VV_ENTRIES - 1;
/// Largest counter a received vector may carry: counters are Unix seconds or small counts,
/// and a counter near `u64::MAX` would make the next local increment wrap. No increment
/// passes it either ([`VersionVector::increment`]).
pub const MAX_VV_COUNTER: u64 = 1 << 62;

struct PairsVisitor;

impl<'de> serde::de::Visitor<'de> for PairsVisitor {
    type Value = VersionVector;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "at most {MAX_VV_ENTRIES} (device, counter) pairs with counters up to {MAX_VV_COUNTER}"
        )
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(
        self,
        mut seq: A,
    ) -> Result<VersionVector, A::Error> {
        // Refused on the declared count when the format states one (postcard does), before
        // any entry is read.
        if let Some(n) = seq.size_hint().filter(|&n| n > MAX_VV_ENTRIES) {
            return Err(serde::de::Error::invalid_length(n, &self));
        }
        let mut pairs: Vec<(ShortId, u64)> =
            Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
        while let Some((dev, counter)) = seq.next_element::<(ShortId, u64)>()? {
            if pairs.len() == MAX_VV_ENTRIES {
                return Err(serde::de::Error::invalid_length(MAX_VV_ENTRIES + 1, &self));
            }
            if counter > MAX_VV_COUNTER {
                return Err(serde::de::Error::invalid_value(
                    serde::de::Unexpected::Unsigned(counter),
                    &self,
                ));
            }
            pairs.push((dev, counter));
        }
        Ok(VersionVector::from_pairs(pairs))
    }
}

impl<'de> Deserialize<'de> for VersionVector {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // Canonicalise whatever arrives: sorted, unique, no zeros; bounded in size and counters.
        d.deserialize_seq(PairsVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn vv() -> impl Strategy<Value = VersionVector> {
        prop::collection::vec((0u64..5, 0u64..6), 0..6)
            .prop_map(|p| VersionVector::from_pairs(p.into_iter().map(|(d, c)| (ShortId(d), c))))
    }

    proptest! {
        #[test]
        fn merge_is_commutative(a in vv(), b in vv()) {
            prop_assert_eq!(a.merge(&b), b.merge(&a));
        }

        #[test]
        fn merge_is_associative(a in vv(), b in vv(), c in vv()) {
            prop_assert_eq!(a.merge(&b).merge(&c), a.merge(&b.merge(&c)));
        }

        #[test]
        fn merge_is_idempotent(a in vv()) {
            prop_assert_eq!(a.merge(&a), a);
        }

        #[test]
        fn merge_is_an_upper_bound(a in vv(), b in vv()) {
            let m = a.merge(&b);
            prop_assert!(m.dominates(&a));
            prop_assert!(m.dominates(&b));
        }

        #[test]
        fn compare_is_consistent_with_merge(a in vv(), b in vv()) {
            // a ≤ b exactly when merging a into b changes nothing.
            prop_assert_eq!(b.dominates(&a), a.merge(&b) == b);
        }

        #[test]
        fn compare_is_antisymmetric(a in vv(), b in vv()) {
            let flipped = match a.compare(&b) {
                VvOrdering::Before => VvOrdering::After,
                VvOrdering::After => VvOrdering::Before,
                o => o,
            };
            prop_assert_eq!(b.compare(&a), flipped);
            prop_assert_eq!(a.compare(&b) == VvOrdering::Equal, a == b);
        }

        #[test]
        fn compare_is_transitive(a in vv(), b in vv(), c in vv()) {
            if a.dominates(&b) && b.dominates(&c) {
                prop_assert!(a.dominates(&c));
            }
        }

        #[test]
        fn decoding_canonicalises_any_order(p in prop::collection::vec((0u64..50, 0u64..6), 0..60)) {
            let raw: Vec<(ShortId, u64)> = p.iter().map(|(d, c)| (ShortId(*d), *c)).collect();
            let bytes = postcard::to_allocvec(&raw).unwrap();
            let v: VersionVector = postcard::from_bytes(&bytes).unwrap();
            let mut slow = VersionVector::new();
            for (d, c) in raw {
                if c > slow.get(d) {
                    slow.set(d, c);
                }
            }
            prop_assert_eq!(v, slow);
        }

        #[test]
        fn increment_moves_strictly_forward(a in vv(), d in 0u64..5, floor in 0u64..10) {
            let b = a.incremented(ShortId(d), floor);
            prop_assert_eq!(b.compare(&a), VvOrdering::After);
            prop_assert!(b.get(ShortId(d)) >= floor);
        }
    }

    #[test]
    fn concurrent_edits_are_concurrent() {
        let base = VersionVector::new().incremented(ShortId(1), 0);
        let a = base.incremented(ShortId(1), 0);
        let b = base.incremented(ShortId(2), 0);
        assert_eq!(a.compare(&b), VvOrdering::Concurrent);
        assert_eq!(base.compare(&a), VvOrdering::Before);
    }
}

#[cfg(test)]
mod limits {
    use super::*;

    #[test]
    fn a_million_descending_entries_are_refused_at_once() {
        let raw: Vec<(ShortId, u64)> = (0..1_000_000u64).rev().map(|d| (ShortId(d), 1)).collect();
        let bytes = postcard::to_allocvec(&raw).unwrap();
        // Refused at entry MAX_VV_ENTRIES + 1, before the rest is even read.
        assert!(postcard::from_bytes::<VersionVector>(&bytes).is_err());
    }

    #[test]
    fn the_most_entries_allowed_decode_in_any_order() {
        let raw: Vec<(ShortId, u64)> = (0..MAX_VV_ENTRIES as u64)
            .rev()
            .map(|d| (ShortId(d), 1))
            .collect();
        let bytes = postcard::to_allocvec(&raw).unwrap();
        let v: VersionVector = postcard::from_bytes(&bytes).unwrap();
        assert_eq!(v.entries().len(), MAX_VV_ENTRIES);
        assert!(v.entries().windows(2).all(|w| w[0].0 < w[1].0));
    }

    #[test]
    fn a_counter_that_would_wrap_is_refused_and_an_edit_at_the_cap_is_counted_apart() {
        let bytes = postcard::to_allocvec(&vec![(ShortId(1), u64::MAX)]).unwrap();
        assert!(postcard::from_bytes::<VersionVector>(&bytes).is_err());
        let ok = postcard::to_allocvec(&vec![(ShortId(1), MAX_VV_COUNTER)]).unwrap();
        let v: VersionVector = postcard::from_bytes(&ok).unwrap();
        let next = v.incremented(ShortId(1), 0);
        assert_eq!(next.get(ShortId(1)), MAX_VV_COUNTER);
        assert_eq!(next.get(spill_id(ShortId(1))), 1);
        assert_eq!(next.compare(&v), VvOrdering::After);
        // A later edit goes on counting there; a floor above the cap is held to it.
        let later = next.incremented(ShortId(1), u64::MAX);
        assert_eq!(later.get(spill_id(ShortId(1))), MAX_VV_COUNTER);
        assert_eq!(later.compare(&next), VvOrdering::After);
    }

    fn at_cap(ids: impl IntoIterator<Item = ShortId>) -> VersionVector {
        VersionVector::from_pairs(ids.into_iter().map(|d| (d, MAX_VV_COUNTER)))
    }

    #[test]
    fn a_chain_of_spill_ids_at_the_cap_is_followed_to_its_end() {
        let mut chain = vec![ShortId(5)];
        for _ in 0..10 {
            chain.push(spill_id(*chain.last().unwrap()));
        }
        let v = at_cap(chain.iter().copied());
        let next = v.incremented(ShortId(5), 0);
        assert_eq!(next.get(spill_id(chain[10])), 1);
        assert_eq!(next.compare(&v), VvOrdering::After);
    }

    proptest::proptest! {
        #[test]
        fn an_increment_never_passes_the_cap_and_always_moves_forward(
            capped in proptest::collection::vec(0u64..4, 0..4),
            others in proptest::collection::vec((0u64..6, 0..=MAX_VV_COUNTER), 0..6),
            dev in 0u64..4,
            floor in proptest::prelude::any::<u64>(),
        ) {
            // Some devices and their spill ids at the cap, others anywhere up to it.
            let ids = capped.iter().flat_map(|&d| [ShortId(d), spill_id(ShortId(d))]);
            let v = at_cap(ids).merge(&VersionVector::from_pairs(
                others.iter().map(|&(d, c)| (ShortId(d), c)),
            ));
            let next = v.incremented(ShortId(dev), floor);
            proptest::prop_assert_eq!(next.compare(&v), VvOrdering::After);
            proptest::prop_assert!(next.entries().iter().all(|e| e.1 <= MAX_VV_COUNTER));
            proptest::prop_assert!(next.entries().len() <= v.entries().len() + 1);
        }
    }
}
