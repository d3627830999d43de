//! Finding peers: where each trusted device may be reached, how that was learned, and the
//! machinery that learns it — local discovery on the LAN ([`lan`]), the host's own network
//! changes ([`netlink`], [`interfaces`]), the race over candidate addresses ([`dial`]), and the
//! address each peer last worked at, kept across restarts ([`remembered`]).
//!
//! **Architecture invariant: an address is only ever a hint.** Whatever taught it (a LAN
//! announcement anyone can forge, a peer, an incoming connection), a dial to it still accepts
//! only the pinned key of the device it expects; a wrong or forged address can make a dial fail,
//! never connect meshfs to another device.
//!
//! **What it never does.** Decide trust (only devices in the config are offered to it), keep a
//! connection, or touch a session: `peers` asks it for candidates and tells it what worked and
//! what failed; sessions tell it what other peers said (`Addresses`, protocol 8).

pub mod book;
pub mod dial;
pub mod interfaces;
pub mod lan;
pub mod limiter;
pub mod netlink;
pub mod remembered;

use crate::lock::{Rank, Ranked, RankedGuard};
use book::{AddressBook, Candidate, Failure, Source};
use meshfs_protocol::DeviceId;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::watch;

/// The address book shared by the dialers, the sessions and local discovery, with a signal for
/// the dialers when a device gains an address, and the remembered file kept up to date.
pub struct Addresses {
    /// A leaf of the lock order: read under the peers' registry by `status`, never held while
    /// another lock is taken.
    book: Ranked<Book>,
    /// Bumped whenever a device gains a candidate address: a dialer waiting for one tries now.
    changed: watch::Sender<u64>,
    /// The remembered addresses' file (none in tests of the book alone).
    file: Option<PathBuf>,
    /// The generation of the remembered addresses last written, held while the file is
    /// written: a write of an older generation than the file's is skipped.
    saving: Mutex<u64>,
}

/// The book, and how many times its remembered addresses changed.
struct Book {
    book: AddressBook,
    remembered: u64,
}

impl Addresses {
    /// The book, with the remembered addresses of `file` (if given) loaded.
    pub fn new(file: Option<PathBuf>) -> Arc<Addresses> {
        let mut book = AddressBook::default();
        if let Some(f) = &file {
            let now = Instant::now();
            for (device, addr) in remembered::load(f) {
                book.worked(device, addr, now);
            }
        }
        Arc::new(Addresses {
            book: Ranked::new(
                Rank::Leaf,
                "address book",
                Book {
                    book,
                    remembered: 0,
                },
            ),
            changed: watch::channel(0).0,
            file,
            saving: Mutex::new(0),
        })
    }

    fn state(&self) -> RankedGuard<'_, Book> {
        // The book is left consistent by every method (no panic between its steps).
        self.book.lock_anyway()
    }

    /// `device` was heard of at `addr` by `source`. Returns whether that is a new address for
    /// it (its dialer is woken).
    pub fn learn(&self, device: DeviceId, addr: SocketAddr, source: Source) -> bool {
        if !dialable(&addr) {
            return false;
        }
        let new = self
            .state()
            .book
            .learn(device, addr, source, Instant::now());
        if new {
            self.changed.send_modify(|n| *n += 1);
        }
        new
    }

    /// `addr` just worked for `device`: remembered (and saved, off the async workers).
    pub fn worked(self: &Arc<Self>, device: DeviceId, addr: SocketAddr) {
        if !dialable(&addr) {
            return;
        }
        let changed = {
            let mut b = self.state();
            let changed = b.book.worked(device, addr, Instant::now());
            b.remembered += u64::from(changed);
            changed
        };
        if changed && self.file.is_some() {
            let me = self.clone();
            tokio::task::spawn_blocking(move || me.save());
        }
    }

    /// Writes the remembered addresses as they are now.
    fn save(&self) {
        let Some(file) = &self.file else {
            return;
        };
        let (generation, entries) = {
            let b = self.state();
            (b.remembered, b.book.remembered())
        };
        let mut written = self.saving.lock().unwrap_or_else(|e| e.into_inner());
        if *written >= generation {
            // A later snapshot is on disk already.
            return;
        }
        match remembered::save(file, &entries) {
            Ok(()) => *written = generation,
            Err(e) => {
                tracing::warn!(path = %file.display(), error = %e, "cannot save the remembered peer addresses")
            }
        }
    }

    /// A dial of `device` at `addr` failed so.
    pub fn failed(&self, device: &DeviceId, addr: SocketAddr, how: Failure) {
        self.state().book.failed(device, addr, how);
    }

    /// The addresses to try for `device`, best first.
    pub fn candidates(&self, device: &DeviceId) -> Vec<Candidate> {
        self.state().book.candidates(device, Instant::now())
    }

    /// How `addr` of `device` was learned, if known.
    pub fn source_of(&self, device: &DeviceId, addr: SocketAddr) -> Option<Source> {
        self.state().book.source_of(device, addr)
    }

    /// Forgets every device `keep` refuses.
    pub fn retain(&self, keep: impl Fn(&DeviceId) -> bool) {
        self.state().book.retain_devices(keep);
    }

    /// Entries in the book.
    pub fn len(&self) -> usize {
        self.state().book.len()
    }

    /// The book is empty.
    pub fn is_empty(&self) -> bool {
        self.state().book.is_empty()
    }

    /// Changes when a device gains an address.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }
}

/// An address another device could dial: a unicast address with a port, not loopback or
/// unspecified (an IPv6 link-local address only with its interface, as a datagram's source has
/// it).
pub fn dialable(addr: &SocketAddr) -> bool {
    if addr.port() == 0 {
        return false;
    }
    match book::canonical(*addr) {
        SocketAddr::V4(v4) => {
            let ip = v4.ip();
            !(ip.is_loopback() || ip.is_unspecified() || ip.is_multicast() || ip.is_broadcast())
        }
        SocketAddr::V6(v6) => {
            let ip = v6.ip();
            !(ip.is_loopback() || ip.is_unspecified() || ip.is_multicast())
                && (!interfaces::is_link_local_v6(ip) || v6.scope_id() != 0)
        }
    }
}

/// An address worth telling another device (`Addresses`): dialable, and not link-local (its
/// scope means nothing elsewhere).
pub fn shareable(addr: &SocketAddr) -> bool {
    dialable(addr)
        && match book::canonical(*addr) {
            SocketAddr::V6(v6) => !interfaces::is_link_local_v6(v6.ip()),
            SocketAddr::V4(v4) => !v4.ip().is_link_local(),
        }
}

/// Whether an endpoint bound to `local` can send to `addr` (an IPv4 socket cannot reach IPv6;
/// an IPv6 one reaches IPv4 only when it is dual-stack, bound to the wildcard).
pub fn reachable_from(local: &SocketAddr, addr: &SocketAddr) -> bool {
    match (local.ip(), book::canonical(*addr).ip()) {
        (IpAddr::V4(_), IpAddr::V4(_)) => true,
        (IpAddr::V4(_), IpAddr::V6(_)) => false,
        (IpAddr::V6(_), IpAddr::V6(_)) => true,
        (IpAddr::V6(l), IpAddr::V4(_)) => l.is_unspecified(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_addresses_another_device_could_dial_are_kept() {
        for ok in ["10.0.0.1:7788", "[fd00::1]:7788", "[fe80::1%2]:7788"] {
            assert!(dialable(&ok.parse().unwrap()), "{ok}");
        }
        for no in [
            "127.0.0.1:7788",
            "0.0.0.0:7788",
            "10.0.0.1:0",
            "[::1]:7788",
            "[fe80::1]:7788",
            "[::ffff:127.0.0.1]:7788",
            "255.255.255.255:7788",
        ] {
            assert!(!dialable(&no.parse().unwrap()), "{no}");
        }
        assert!(!shareable(&"[fe80::1%2]:7788".parse().unwrap()));
        assert!(shareable(&"10.0.0.1:7788".parse().unwrap()));
    }

    #[test]
    fn a_v4_endpoint_reaches_only_v4_and_a_dual_stack_one_reaches_both() {
        let v4: SocketAddr = "0.0.0.0:7788".parse().unwrap();
        let dual: SocketAddr = "[::]:7788".parse().unwrap();
        let v6only: SocketAddr = "[fd00::1]:7788".parse().unwrap();
        let (a4, a6): (SocketAddr, SocketAddr) = (
            "10.0.0.1:1".parse().unwrap(),
            "[fd00::2]:1".parse().unwrap(),
        );
        assert!(reachable_from(&v4, &a4) && !reachable_from(&v4, &a6));
        assert!(reachable_from(&dual, &a4) && reachable_from(&dual, &a6));
        assert!(!reachable_from(&v6only, &a4) && reachable_from(&v6only, &a6));
    }

    #[test]
    fn the_remembered_address_survives_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let file = remembered::file(dir.path());
        let rt = tokio::runtime::Runtime::new().unwrap();
        let dev = DeviceId::from_bytes([4; 32]);
        let addr: SocketAddr = "10.1.2.3:7788".parse().unwrap();
        rt.block_on(async {
            let a = Addresses::new(Some(file.clone()));
            a.worked(dev, addr);
        });
        drop(rt);
        let again = Addresses::new(Some(file));
        assert_eq!(
            again.candidates(&dev),
            vec![Candidate {
                addr,
                source: Source::Remembered
            }]
        );
    }
}
