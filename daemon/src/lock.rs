//! The daemon's lock order, written down once and checked in debug builds.
//!
//! Every lock that is ever held while another is taken is a [`Ranked`] mutex with a [`Rank`];
//! a thread may take a lock only if every lock it already holds has a lower rank. The order:
//!
//! 1. [`Rank::Folder`]: a folder's operation lock (`FolderRt`): capture and apply of one folder,
//!    never two folders at once;
//! 2. [`Rank::Journal`]: the journal's connection (`Folders::journal`);
//! 3. [`Rank::Peers`]: the registry of connected peers (`Net::peers`);
//! 4. [`Rank::Leaf`]: the small state a folder keeps (deferred and skipped versions, the
//!    capture queue, the mount…) and the address book (`discovery::Addresses`): held for a few
//!    instructions, never while taking another.
//!
//! In a debug build (every test), taking a lock out of order panics with both locks' names, so
//! a deadlock that a rare interleaving would need is found by any test that takes that path
//! once. A release build keeps no record.

use std::sync::{LockResult, Mutex, MutexGuard, PoisonError};

/// Where a lock stands in the order: a thread holding one takes only higher ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Rank {
    /// A folder's operation lock.
    Folder = 1,
    /// The journal.
    Journal = 2,
    /// The registry of connected peers.
    Peers = 3,
    /// A folder's small state.
    Leaf = 4,
}

/// A mutex with a place in the lock order.
#[derive(Debug)]
pub struct Ranked<T> {
    /// Checked only in debug builds.
    #[cfg_attr(not(debug_assertions), allow(dead_code))]
    rank: Rank,
    name: &'static str,
    inner: Mutex<T>,
}

/// A held [`Ranked`] lock.
pub struct RankedGuard<'a, T> {
    guard: MutexGuard<'a, T>,
    /// Kept for its `Drop`, which forgets the lock in the thread's record.
    #[cfg(debug_assertions)]
    _held: Held,
}

#[cfg(debug_assertions)]
mod held {
    use super::Rank;
    use std::cell::RefCell;

    thread_local! {
        /// The ranked locks this thread holds, in the order it took them.
        static HELD: RefCell<Vec<(Rank, &'static str)>> = const { RefCell::new(Vec::new()) };
    }

    /// One entry of [`HELD`], removed when dropped.
    pub struct Held {
        rank: Rank,
        name: &'static str,
    }

    /// Checks that `name` (`rank`) may be taken now, and records it.
    pub fn take(rank: Rank, name: &'static str) -> Held {
        HELD.with(|h| {
            let mut h = h.borrow_mut();
            if let Some((r, n)) = h.iter().find(|(r, _)| *r >= rank) {
                panic!(
                    "lock order: taking {name} ({rank:?}) while holding {n} ({r:?}); see daemon/src/lock.rs"
                );
            }
            h.push((rank, name));
        });
        Held { rank, name }
    }

    impl Drop for Held {
        fn drop(&mut self) {
            HELD.with(|h| {
                let mut h = h.borrow_mut();
                if let Some(i) = h
                    .iter()
                    .rposition(|(r, n)| *r == self.rank && *n == self.name)
                {
                    h.remove(i);
                }
            });
        }
    }
}

#[cfg(debug_assertions)]
use held::Held;

impl<T> Ranked<T> {
    /// A lock named `name` at `rank`.
    pub const fn new(rank: Rank, name: &'static str, value: T) -> Ranked<T> {
        Ranked {
            rank,
            name,
            inner: Mutex::new(value),
        }
    }

    /// Takes the lock (in a debug build, panics if the order is broken).
    pub fn lock(&self) -> LockResult<RankedGuard<'_, T>> {
        #[cfg(debug_assertions)]
        let held = held::take(self.rank, self.name);
        let wrap = |guard| RankedGuard {
            guard,
            #[cfg(debug_assertions)]
            _held: held,
        };
        match self.inner.lock() {
            Ok(g) => Ok(wrap(g)),
            Err(p) => Err(PoisonError::new(wrap(p.into_inner()))),
        }
    }

    /// Takes the lock, whether or not a thread panicked holding it (for state that stays
    /// consistent at every step).
    pub fn lock_anyway(&self) -> RankedGuard<'_, T> {
        self.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Its name.
    pub fn name(&self) -> &'static str {
        self.name
    }
}

impl<T> std::ops::Deref for RankedGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<T> std::ops::DerefMut for RankedGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.guard
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locks_taken_in_order_are_fine_and_out_of_order_panic_in_debug_builds() {
        let folder = Ranked::new(Rank::Folder, "folder", ());
        let journal = Ranked::new(Rank::Journal, "journal", ());
        let leaf = Ranked::new(Rank::Leaf, "skipped", ());
        {
            let _f = folder.lock_anyway();
            let _j = journal.lock_anyway();
            let _l = leaf.lock_anyway();
        }
        // Released: any order again.
        {
            let _j = journal.lock_anyway();
        }
        let _f = folder.lock_anyway();
        drop(_f);
        if cfg!(debug_assertions) {
            let out_of_order = std::panic::catch_unwind(|| {
                let _j = journal.lock_anyway();
                let _f = folder.lock_anyway();
            });
            assert!(out_of_order.is_err());
            let two_leaves = std::panic::catch_unwind(|| {
                let other = Ranked::new(Rank::Leaf, "deferred", ());
                let _l = leaf.lock_anyway();
                let _o = other.lock_anyway();
            });
            assert!(two_leaves.is_err());
        }
    }
}
