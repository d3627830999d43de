//! The address book: where each trusted device may be reached, as learned, and the order to
//! try those addresses in.
//!
//! **What it owns.** Candidate addresses per device, each with how it was learned
//! ([`Source`]), when it expires, and the one address per device that last worked
//! ([`Source::Remembered`], kept across restarts by `remembered`). It is pure: the caller passes
//! the time, nothing here reads a clock, a socket or a file.
//!
//! **What it never does.** Decide trust: the caller only offers devices it trusts (an
//! announcement of an unknown device never reaches it). Nor does it hold fixed addresses from
//! the config: those are the dialer's, resolved at every attempt.
//!
//! **Bounded.** At most [`MAX_PER_DEVICE`] entries per device and [`MAX_ENTRIES`] in all; every
//! learned entry expires ([`Source::ttl`]). A hint (LAN, from a peer) only ever displaces a
//! hint: an address proved by an authenticated connection (incoming, remembered) is not pushed
//! out by a flood of forged announcements.
//!
//! **Hints that fail are dropped.** A LAN announcement is unauthenticated: an address from one
//! that fails a dial is forgotten at once (it comes back with the next announcement), so a
//! forged announcement costs one failed dial. An address at which another device answered is
//! forgotten whatever taught it. Addresses from a trusted peer or an incoming connection stay
//! until they expire, since a route to them may appear at any moment.

use meshfs_protocol::DeviceId;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Most entries one device may have.
pub const MAX_PER_DEVICE: usize = 16;
/// Most entries in all.
pub const MAX_ENTRIES: usize = 4096;

/// How an address of a device was learned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Source {
    /// The config's `addresses` (never held in the book; named for `status`).
    Static,
    /// Its announcement on a local network.
    Lan,
    /// Another peer told us where it reaches it.
    Peer,
    /// Its own authenticated connection to us came from there.
    Incoming,
    /// It worked last time (a dial that succeeded, or its connection to us), kept across
    /// restarts.
    Remembered,
}

impl Source {
    /// The word `status` shows.
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Static => "static",
            Source::Lan => "lan",
            Source::Peer => "peer",
            Source::Incoming => "incoming",
            Source::Remembered => "remembered",
        }
    }

    /// The word back (from the remembered file).
    pub fn parse(s: &str) -> Option<Source> {
        Some(match s {
            "static" => Source::Static,
            "lan" => Source::Lan,
            "peer" => Source::Peer,
            "incoming" => Source::Incoming,
            "remembered" => Source::Remembered,
            _ => return None,
        })
    }

    /// How long an entry learned this way lasts after it was last heard (`None`: for good).
    /// LAN: three announcement periods; from a peer: ten minutes (it tells again when its
    /// connection moves); incoming: an hour.
    pub fn ttl(self) -> Option<Duration> {
        match self {
            Source::Lan => Some(Duration::from_secs(90)),
            Source::Peer => Some(Duration::from_secs(600)),
            Source::Incoming => Some(Duration::from_secs(3600)),
            Source::Static | Source::Remembered => None,
        }
    }

    /// Proved by an authenticated connection (never displaced by a hint).
    fn proved(self) -> bool {
        matches!(self, Source::Incoming | Source::Remembered | Source::Static)
    }
}

/// An address to try, and how it was learned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Candidate {
    /// The address.
    pub addr: SocketAddr,
    /// How it was learned (the best of its sources: remembered, incoming, peer, LAN).
    pub source: Source,
}

#[derive(Clone, Debug)]
struct Entry {
    addr: SocketAddr,
    source: Source,
    /// Last learned (or confirmed).
    heard: Instant,
}

impl Entry {
    fn expired(&self, now: Instant) -> bool {
        self.source
            .ttl()
            .is_some_and(|ttl| now.saturating_duration_since(self.heard) >= ttl)
    }
}

/// How a dial to a candidate failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// No answer, or no meshfs there: a hint from the LAN is dropped.
    Unreachable,
    /// Another device answered there: every learned entry of that address is dropped.
    WrongDevice,
}

/// The address book. See the module docs.
#[derive(Debug, Default)]
pub struct AddressBook {
    devices: HashMap<DeviceId, Vec<Entry>>,
    total: usize,
}

impl AddressBook {
    /// `device` was heard of at `addr` (by `source`, not [`Source::Remembered`] — see
    /// [`AddressBook::worked`]). Returns whether the address is new for it (a dialer waiting for
    /// one should try now); refreshing an entry returns false. Refused (false) when the device
    /// or the book is full of entries this one may not displace.
    pub fn learn(
        &mut self,
        device: DeviceId,
        addr: SocketAddr,
        source: Source,
        now: Instant,
    ) -> bool {
        debug_assert!(source != Source::Remembered && source != Source::Static);
        let addr = canonical(addr);
        let list = self.devices.entry(device).or_default();
        let before = list.len();
        list.retain(|e| !e.expired(now));
        self.total -= before - list.len();
        if let Some(e) = list
            .iter_mut()
            .find(|e| e.addr == addr && e.source == source)
        {
            e.heard = now;
            return false;
        }
        let known = list.iter().any(|e| e.addr == addr);
        if list.len() >= MAX_PER_DEVICE || self.total >= MAX_ENTRIES {
            // Displace the oldest entry this one may: a hint only a hint.
            let victim = list
                .iter()
                .enumerate()
                .filter(|(_, e)| {
                    e.source != Source::Remembered && (source.proved() || !e.source.proved())
                })
                .min_by_key(|(_, e)| e.heard)
                .map(|(i, _)| i);
            match victim {
                Some(i) => {
                    list.remove(i);
                    self.total -= 1;
                }
                None => return false,
            }
            if self.total >= MAX_ENTRIES {
                return false;
            }
        }
        list.push(Entry {
            addr,
            source,
            heard: now,
        });
        self.total += 1;
        !known
    }

    /// `addr` just worked for `device` (a dial succeeded there, or its authenticated connection
    /// came from there): it becomes the device's remembered address, tried first. Returns
    /// whether the remembered address changed (to be saved).
    pub fn worked(&mut self, device: DeviceId, addr: SocketAddr, now: Instant) -> bool {
        let addr = canonical(addr);
        let list = self.devices.entry(device).or_default();
        if let Some(e) = list.iter_mut().find(|e| e.source == Source::Remembered) {
            let changed = e.addr != addr;
            e.addr = addr;
            e.heard = now;
            return changed;
        }
        if list.len() >= MAX_PER_DEVICE || self.total >= MAX_ENTRIES {
            if let Some(i) = list
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.heard)
                .map(|(i, _)| i)
            {
                list.remove(i);
                self.total -= 1;
            }
        }
        list.push(Entry {
            addr,
            source: Source::Remembered,
            heard: now,
        });
        self.total += 1;
        true
    }

    /// A dial of `device` at `addr` failed so.
    pub fn failed(&mut self, device: &DeviceId, addr: SocketAddr, how: Failure) {
        let addr = canonical(addr);
        let Some(list) = self.devices.get_mut(device) else {
            return;
        };
        let before = list.len();
        list.retain(|e| {
            e.addr != addr
                || match how {
                    Failure::Unreachable => e.source != Source::Lan,
                    Failure::WrongDevice => false,
                }
        });
        self.total -= before - list.len();
    }

    /// The addresses to try for `device`, best first: the remembered one, then the others by
    /// how they were learned (an incoming connection, a peer, the LAN) and, within that, the
    /// most recently heard. Each address once. Expired entries are dropped on the way.
    pub fn candidates(&mut self, device: &DeviceId, now: Instant) -> Vec<Candidate> {
        let Some(list) = self.devices.get_mut(device) else {
            return Vec::new();
        };
        let before = list.len();
        list.retain(|e| !e.expired(now));
        self.total -= before - list.len();
        let mut sorted: Vec<&Entry> = list.iter().collect();
        sorted.sort_by(|a, b| b.source.cmp(&a.source).then(b.heard.cmp(&a.heard)));
        let mut out: Vec<Candidate> = Vec::new();
        for e in sorted {
            if !out.iter().any(|c| c.addr == e.addr) {
                out.push(Candidate {
                    addr: e.addr,
                    source: e.source,
                });
            }
        }
        out
    }

    /// How `addr` of `device` was learned, if it is in the book (its best source).
    pub fn source_of(&self, device: &DeviceId, addr: SocketAddr) -> Option<Source> {
        let addr = canonical(addr);
        self.devices
            .get(device)?
            .iter()
            .filter(|e| e.addr == addr)
            .map(|e| e.source)
            .max()
    }

    /// Forgets every device but those `keep` accepts (no longer trusted, or no longer dialed
    /// wherever found).
    pub fn retain_devices(&mut self, keep: impl Fn(&DeviceId) -> bool) {
        self.devices.retain(|d, _| keep(d));
        self.total = self.devices.values().map(Vec::len).sum();
    }

    /// Each device's remembered address (for the remembered file).
    pub fn remembered(&self) -> Vec<(DeviceId, SocketAddr)> {
        let mut out: Vec<(DeviceId, SocketAddr)> = self
            .devices
            .iter()
            .filter_map(|(d, l)| {
                l.iter()
                    .find(|e| e.source == Source::Remembered)
                    .map(|e| (*d, e.addr))
            })
            .collect();
        out.sort();
        out
    }

    /// Entries in all.
    pub fn len(&self) -> usize {
        self.total
    }

    /// No entry at all.
    pub fn is_empty(&self) -> bool {
        self.total == 0
    }
}

/// `addr` with an IPv4-mapped IPv6 address written as IPv4 (a dual-stack socket shows IPv4
/// peers so): one address, one entry.
pub fn canonical(addr: SocketAddr) -> SocketAddr {
    match addr {
        SocketAddr::V6(v6) if v6.ip().to_ipv4_mapped().is_some() => {
            SocketAddr::new(v6.ip().to_canonical(), v6.port())
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn dev(n: u8) -> DeviceId {
        DeviceId::from_bytes([n; 32])
    }

    fn at(n: u16) -> SocketAddr {
        SocketAddr::from(([10, 0, (n >> 8) as u8, n as u8], 7788))
    }

    #[test]
    fn the_remembered_address_comes_first_then_proved_ones_then_hints_newest_first() {
        let t0 = Instant::now();
        let mut b = AddressBook::default();
        assert!(b.learn(dev(1), at(1), Source::Lan, t0));
        assert!(b.learn(dev(1), at(2), Source::Peer, t0 + Duration::from_secs(1)));
        assert!(b.learn(dev(1), at(3), Source::Incoming, t0));
        assert!(b.learn(dev(1), at(4), Source::Lan, t0 + Duration::from_secs(2)));
        assert!(
            !b.learn(dev(1), at(4), Source::Lan, t0 + Duration::from_secs(3)),
            "a refresh is not news"
        );
        assert!(b.worked(dev(1), at(1), t0));
        let order: Vec<(SocketAddr, Source)> = b
            .candidates(&dev(1), t0 + Duration::from_secs(4))
            .into_iter()
            .map(|c| (c.addr, c.source))
            .collect();
        assert_eq!(
            order,
            vec![
                (at(1), Source::Remembered),
                (at(3), Source::Incoming),
                (at(2), Source::Peer),
                (at(4), Source::Lan),
            ]
        );
        assert_eq!(b.source_of(&dev(1), at(1)), Some(Source::Remembered));
    }

    #[test]
    fn a_lan_hint_that_fails_is_dropped_and_a_proved_address_stays() {
        let t0 = Instant::now();
        let mut b = AddressBook::default();
        b.learn(dev(1), at(1), Source::Lan, t0);
        b.learn(dev(1), at(2), Source::Peer, t0);
        b.learn(dev(1), at(3), Source::Incoming, t0);
        for n in 1..=3 {
            b.failed(&dev(1), at(n), Failure::Unreachable);
        }
        let left: Vec<SocketAddr> = b
            .candidates(&dev(1), t0)
            .into_iter()
            .map(|c| c.addr)
            .collect();
        assert_eq!(left, vec![at(3), at(2)]);
        b.failed(&dev(1), at(3), Failure::WrongDevice);
        assert_eq!(b.candidates(&dev(1), t0).len(), 1);
        assert_eq!(b.len(), 1);
    }

    #[test]
    fn learned_addresses_expire_and_the_remembered_one_does_not() {
        let t0 = Instant::now();
        let mut b = AddressBook::default();
        b.learn(dev(1), at(1), Source::Lan, t0);
        b.learn(dev(1), at(2), Source::Peer, t0);
        b.worked(dev(1), at(3), t0);
        let later = t0 + Duration::from_secs(91);
        let left: Vec<SocketAddr> = b
            .candidates(&dev(1), later)
            .into_iter()
            .map(|c| c.addr)
            .collect();
        assert_eq!(left, vec![at(3), at(2)]);
        let much_later = t0 + Duration::from_secs(100_000);
        assert_eq!(b.candidates(&dev(1), much_later).len(), 1);
        assert_eq!(b.remembered(), vec![(dev(1), at(3))]);
    }

    #[test]
    fn a_flood_of_hints_never_displaces_a_proved_address() {
        let t0 = Instant::now();
        let mut b = AddressBook::default();
        b.learn(dev(1), at(9999), Source::Incoming, t0);
        b.worked(dev(1), at(9998), t0);
        for n in 0..1000 {
            b.learn(
                dev(1),
                at(n),
                Source::Lan,
                t0 + Duration::from_millis(u64::from(n)),
            );
        }
        let c = b.candidates(&dev(1), t0 + Duration::from_secs(2));
        assert!(c.len() <= MAX_PER_DEVICE);
        assert!(c.iter().any(|c| c.addr == at(9999)) && c.iter().any(|c| c.addr == at(9998)));
        // The newest hints are the ones kept.
        assert!(c.iter().any(|c| c.addr == at(999)));
    }

    #[test]
    fn an_ipv4_mapped_address_is_the_ipv4_one() {
        let t0 = Instant::now();
        let mut b = AddressBook::default();
        b.learn(
            dev(1),
            "[::ffff:10.0.0.1]:7788".parse().unwrap(),
            Source::Incoming,
            t0,
        );
        assert!(!b.learn(
            dev(1),
            "10.0.0.1:7788".parse().unwrap(),
            Source::Incoming,
            t0
        ));
        assert_eq!(b.candidates(&dev(1), t0)[0].addr, at(1));
    }

    proptest! {
        /// Whatever is learned, in any order, the book stays within its caps and its count is
        /// right.
        #[test]
        fn the_book_stays_within_its_bounds(ops in prop::collection::vec((0u8..40, 0u16..64, 0u8..5, 0u64..400), 0..3000)) {
            let t0 = Instant::now();
            let mut b = AddressBook::default();
            for (d, a, s, t) in ops {
                let now = t0 + Duration::from_secs(t);
                match s {
                    0 => { b.learn(dev(d), at(a), Source::Lan, now); }
                    1 => { b.learn(dev(d), at(a), Source::Peer, now); }
                    2 => { b.learn(dev(d), at(a), Source::Incoming, now); }
                    3 => { b.worked(dev(d), at(a), now); }
                    _ => b.failed(&dev(d), at(a), Failure::Unreachable),
                }
                let counted: usize = b.devices.values().map(Vec::len).sum();
                prop_assert_eq!(counted, b.len());
                prop_assert!(b.len() <= MAX_ENTRIES);
                prop_assert!(b.devices.values().all(|l| l.len() <= MAX_PER_DEVICE));
                prop_assert!(b.devices.values().all(|l| l.iter().filter(|e| e.source == Source::Remembered).count() <= 1));
            }
        }
    }
}
