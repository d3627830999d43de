//! The paths the kernel has just been told about: changed through the mount (it made the
//! change itself) or invalidated for the engine. A change the engine's watcher reports on the
//! backing directory for such a path is the echo of one of these, and needs no invalidation;
//! any other was made behind the mount's back and does (`MountHandle::invalidate_foreign`).
//!
//! **Invariant:** an entry younger than [`RECENT`] is kept; older ones are pruned in
//! amortized constant time per insert (the map is swept when it doubles).

use meshfs_protocol::RelPath;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// How long a path counts as just told: longer than the watcher takes to report a change
/// (milliseconds, D32), short enough that a program writing the backing directory soon after
/// is still seen.
pub(crate) const RECENT: Duration = Duration::from_secs(2);

/// A monotonic clock in milliseconds for marks kept in atomics (never 0 once read).
pub(crate) fn ms_now() -> u64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let start = *START.get_or_init(Instant::now);
    start.elapsed().as_millis() as u64 + 1
}

/// See the module documentation.
#[derive(Debug)]
pub(crate) struct Recent {
    map: HashMap<RelPath, Instant>,
    sweep_at: usize,
}

/// The smallest size at which the map is swept.
const SWEEP_AT: usize = 4096;

impl Default for Recent {
    fn default() -> Recent {
        Recent {
            map: HashMap::new(),
            sweep_at: SWEEP_AT,
        }
    }
}

impl Recent {
    /// `path` was just told to the kernel (at `now`).
    pub fn told(&mut self, path: &RelPath, now: Instant) {
        if let Some(at) = self.map.get_mut(path) {
            *at = now;
            return;
        }
        self.map.insert(path.clone(), now);
        if self.map.len() >= self.sweep_at {
            self.map
                .retain(|_, at| now.saturating_duration_since(*at) < RECENT);
            self.sweep_at = (self.map.len() * 2).max(SWEEP_AT);
        }
    }

    /// Whether `path` was told less than [`RECENT`] before `now`.
    pub fn was_told(&self, path: &RelPath, now: Instant) -> bool {
        self.map
            .get(path)
            .is_some_and(|at| now.saturating_duration_since(*at) < RECENT)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.map.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> RelPath {
        RelPath::new(s).unwrap()
    }

    #[test]
    fn a_path_is_recent_for_a_while_then_not() {
        let mut r = Recent::default();
        let t0 = Instant::now();
        r.told(&p("a/b"), t0);
        assert!(r.was_told(&p("a/b"), t0 + RECENT / 2));
        assert!(!r.was_told(&p("a"), t0));
        assert!(!r.was_told(&p("a/b"), t0 + RECENT));
        // Told again: recent again.
        r.told(&p("a/b"), t0 + RECENT);
        assert!(r.was_told(&p("a/b"), t0 + RECENT + RECENT / 2));
    }

    #[test]
    fn old_paths_are_swept_and_young_ones_kept() {
        let mut r = Recent::default();
        let t0 = Instant::now();
        for i in 0..SWEEP_AT - 1 {
            r.told(&p(&format!("old/{i}")), t0);
        }
        let later = t0 + RECENT;
        r.told(&p("young"), later);
        assert_eq!(r.len(), 1);
        assert!(r.was_told(&p("young"), later));
        for i in 0..SWEEP_AT * 3 {
            r.told(&p(&format!("burst/{i}")), later);
        }
        // A burst younger than RECENT is never swept away.
        assert!(r.len() > SWEEP_AT * 3);
        assert!((0..SWEEP_AT * 3).all(|i| r.was_told(&p(&format!("burst/{i}")), later)));
    }
}
