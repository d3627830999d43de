//! How many announcements are read: a token bucket per source address and one for all, so a
//! flood costs the daemon a receive and a table lookup per datagram and nothing more.
//!
//! **What it owns.** The buckets, in a table of at most [`MAX_SOURCES`] sources. Pure: the
//! caller passes the time. A full table is emptied at once (a few hundred nanoseconds, rarely):
//! forgetting every source gives each a new burst, which the bucket for all still caps, whereas
//! evicting the oldest one at a time would cost a scan of the table per datagram in a flood of
//! spoofed sources.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::Instant;

/// Most sources remembered at once.
pub const MAX_SOURCES: usize = 1024;
/// Announcements one source may send in a burst, and per second after it. A daemon announces
/// every 30 s and when its addresses change: a burst of 4 covers a few changes in a row.
pub const PER_SOURCE: Bucket = Bucket::new(4.0, 0.5);
/// Announcements read per second from all sources together.
pub const ALL_SOURCES: Bucket = Bucket::new(64.0, 32.0);

/// A token bucket's shape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bucket {
    /// Tokens it holds when full.
    pub burst: f64,
    /// Tokens it gains per second.
    pub rate: f64,
}

impl Bucket {
    /// A bucket of `burst` tokens refilled at `rate` per second.
    pub const fn new(burst: f64, rate: f64) -> Bucket {
        Bucket { burst, rate }
    }
}

#[derive(Clone, Copy, Debug)]
struct Tokens {
    left: f64,
    at: Instant,
}

impl Tokens {
    fn full(shape: Bucket, now: Instant) -> Tokens {
        Tokens {
            left: shape.burst,
            at: now,
        }
    }

    fn take(&mut self, shape: Bucket, now: Instant) -> bool {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.left = (self.left + dt * shape.rate).min(shape.burst);
        self.at = now;
        if self.left >= 1.0 {
            self.left -= 1.0;
            true
        } else {
            false
        }
    }
}

/// The limiter. See the module docs.
#[derive(Debug)]
pub struct Limiter {
    per_source: HashMap<IpAddr, Tokens>,
    all: Tokens,
    source_shape: Bucket,
    all_shape: Bucket,
}

impl Limiter {
    /// A limiter with [`PER_SOURCE`] and [`ALL_SOURCES`].
    pub fn new(now: Instant) -> Limiter {
        Limiter::with(PER_SOURCE, ALL_SOURCES, now)
    }

    /// A limiter of these shapes.
    pub fn with(source_shape: Bucket, all_shape: Bucket, now: Instant) -> Limiter {
        Limiter {
            per_source: HashMap::new(),
            all: Tokens::full(all_shape, now),
            source_shape,
            all_shape,
        }
    }

    /// Whether a datagram from `source` arriving at `now` is read.
    pub fn allow(&mut self, source: IpAddr, now: Instant) -> bool {
        if !self.per_source.contains_key(&source) && self.per_source.len() >= MAX_SOURCES {
            self.per_source.clear();
        }
        let shape = self.source_shape;
        let mine = self
            .per_source
            .entry(source)
            .or_insert_with(|| Tokens::full(shape, now));
        mine.take(shape, now) && self.all.take(self.all_shape, now)
    }

    /// Sources remembered now.
    pub fn sources(&self) -> usize {
        self.per_source.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn ip(n: u32) -> IpAddr {
        IpAddr::from(std::net::Ipv4Addr::from(0x0a00_0000 + n))
    }

    #[test]
    fn one_source_gets_its_burst_then_its_rate() {
        let t0 = Instant::now();
        let mut l = Limiter::new(t0);
        let allowed = (0..100).filter(|_| l.allow(ip(1), t0)).count();
        assert_eq!(allowed, PER_SOURCE.burst as usize);
        // Ten seconds later: five more at 0.5/s (capped by the burst).
        let later = t0 + Duration::from_secs(10);
        let allowed = (0..100).filter(|_| l.allow(ip(1), later)).count();
        assert_eq!(
            allowed,
            PER_SOURCE.burst.min(10.0 * PER_SOURCE.rate) as usize
        );
        // Another source is not held back by the first.
        assert!(l.allow(ip(2), later));
    }

    #[test]
    fn many_sources_together_get_no_more_than_the_bucket_for_all() {
        let t0 = Instant::now();
        let mut l = Limiter::new(t0);
        // 10,000 datagrams in one second from 10,000 sources.
        let allowed = (0..10_000u32)
            .filter(|&n| l.allow(ip(n), t0 + Duration::from_micros(u64::from(n) * 100)))
            .count();
        assert!(
            allowed <= (ALL_SOURCES.burst + ALL_SOURCES.rate) as usize + 1,
            "{allowed}"
        );
        assert!(l.sources() <= MAX_SOURCES);
    }
}
