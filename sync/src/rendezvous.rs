//! The address exchange of one session (protocol 8): each side asks for the addresses of the
//! devices it dials wherever they are found (`Seek`), and answers the other's asks with where it
//! reaches those of them it is connected to (`Addresses`). An always-on device thus tells two
//! laptops that never share a LAN where the other one is.
//!
//! Pure bookkeeping, owned by [`crate::session::Session`] (which checks that the hellos came
//! first): what we asked for and last told the peer we ask for, what the peer asks for, and what
//! we last told it of each device, so nothing is sent twice. It never decides who is trusted —
//! the driver passes only devices its config trusts — and never reads an address: the
//! addresses are opaque hints to the driver's dialer.
//!
//! Rules kept here: a `Seek` replaces the one before (none before the first); addresses are
//! told only of a device the peer seeks, never empty, never the same list twice in a row, and a
//! device it stops seeking is forgotten (sought again, it is told again); an `Addresses` for a
//! device we do not seek (it may cross a `Seek` that dropped it) is ignored.

use meshfs_protocol::{
    AddressList, DeviceId, SeekList, WireAddr, MAX_ADDRESSES_PER_DEVICE, MAX_SOUGHT_DEVICES,
};
use std::collections::{BTreeMap, BTreeSet};

/// One session's address exchange. See the module docs.
#[derive(Debug, Default)]
pub struct Rendezvous {
    /// What we want the peer to tell us of, as the driver last said.
    ours: BTreeSet<DeviceId>,
    /// What the peer was last told we seek (`None`: nothing yet; it assumes none).
    told_seek: Option<BTreeSet<DeviceId>>,
    /// What the peer seeks, as its last `Seek` said.
    theirs: BTreeSet<DeviceId>,
    /// What we last told the peer of each device it seeks.
    told: BTreeMap<DeviceId, Vec<WireAddr>>,
}

impl Rendezvous {
    /// We seek `devices` from now on (`peer`, the other end, is left out: we are connected to
    /// it). [`Rendezvous::seek_due`] says whether the peer must be told.
    pub fn set_ours(&mut self, peer: &DeviceId, devices: BTreeSet<DeviceId>) {
        self.ours = devices
            .into_iter()
            .filter(|d| d != peer)
            .take(MAX_SOUGHT_DEVICES)
            .collect();
    }

    /// The `Seek` the peer should get now, if what it was told differs from what we seek.
    pub fn seek_due(&mut self) -> Option<SeekList> {
        let empty = BTreeSet::new();
        if self.told_seek.as_ref().unwrap_or(&empty) == &self.ours {
            return None;
        }
        self.told_seek = Some(self.ours.clone());
        Some(SeekList {
            devices: self.ours.iter().copied().collect(),
        })
    }

    /// The peer's `Seek`: what it seeks from now on (`peer` itself and `me` left out). Returns
    /// the devices it seeks now that it did not before, to be told of at once.
    pub fn on_seek(&mut self, me: &DeviceId, peer: &DeviceId, list: SeekList) -> Vec<DeviceId> {
        let now: BTreeSet<DeviceId> = list
            .devices
            .into_iter()
            .filter(|d| d != me && d != peer)
            .collect();
        let new = now.difference(&self.theirs).copied().collect();
        self.told.retain(|d, _| now.contains(d));
        self.theirs = now;
        new
    }

    /// Whether the peer seeks `device`.
    pub fn peer_seeks(&self, device: &DeviceId) -> bool {
        self.theirs.contains(device)
    }

    /// The devices the peer seeks.
    pub fn sought_by_peer(&self) -> impl Iterator<Item = &DeviceId> {
        self.theirs.iter()
    }

    /// The `Addresses` to send for `device`, if the peer seeks it and `addrs` (at most
    /// [`MAX_ADDRESSES_PER_DEVICE`] kept, duplicates dropped) is news to it.
    pub fn tell(&mut self, device: DeviceId, addrs: Vec<WireAddr>) -> Option<AddressList> {
        if !self.theirs.contains(&device) {
            return None;
        }
        let mut addrs = addrs;
        let mut seen = BTreeSet::new();
        addrs.retain(|a| seen.insert(*a));
        addrs.truncate(MAX_ADDRESSES_PER_DEVICE);
        if addrs.is_empty() || self.told.get(&device) == Some(&addrs) {
            return None;
        }
        self.told.insert(device, addrs.clone());
        Some(AddressList { device, addrs })
    }

    /// The peer's `Addresses`: the list, if we seek its device (else it is ignored).
    pub fn on_addresses(&self, list: AddressList) -> Option<AddressList> {
        self.ours.contains(&list.device).then_some(list)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(b: u8) -> DeviceId {
        DeviceId::from_bytes([b; 32])
    }

    fn addr(port: u16) -> WireAddr {
        WireAddr::V4 {
            ip: [10, 0, 0, 1],
            port,
        }
    }

    #[test]
    fn a_seek_is_sent_once_per_change_and_never_names_the_peer() {
        let mut r = Rendezvous::default();
        assert_eq!(r.seek_due(), None, "nothing sought: the peer assumes none");
        r.set_ours(&id(9), [id(1), id(9)].into());
        assert_eq!(r.seek_due().map(|s| s.devices), Some(vec![id(1)]));
        assert_eq!(r.seek_due(), None);
        r.set_ours(&id(9), [id(1)].into());
        assert_eq!(r.seek_due(), None);
        r.set_ours(&id(9), BTreeSet::new());
        assert_eq!(r.seek_due().map(|s| s.devices), Some(vec![]));
    }

    #[test]
    fn addresses_go_only_to_a_peer_that_seeks_them_and_only_when_they_change() {
        let (me, peer) = (id(8), id(9));
        let mut r = Rendezvous::default();
        assert_eq!(r.tell(id(1), vec![addr(1)]), None, "not sought");
        let new = r.on_seek(
            &me,
            &peer,
            SeekList {
                devices: vec![id(1), me, peer],
            },
        );
        assert_eq!(new, vec![id(1)], "neither end is ever told of");
        assert!(r
            .tell(id(1), vec![addr(1), addr(1)])
            .is_some_and(|l| l.addrs == vec![addr(1)]));
        assert_eq!(r.tell(id(1), vec![addr(1)]), None, "the same list twice");
        assert_eq!(r.tell(id(1), vec![]), None, "never an empty list");
        assert!(r.tell(id(1), vec![addr(2)]).is_some());
        // It stops seeking, then seeks again: told again.
        r.on_seek(&me, &peer, SeekList { devices: vec![] });
        assert_eq!(r.tell(id(1), vec![addr(2)]), None);
        let new = r.on_seek(
            &me,
            &peer,
            SeekList {
                devices: vec![id(1)],
            },
        );
        assert_eq!(new, vec![id(1)]);
        assert!(r.tell(id(1), vec![addr(2)]).is_some());
    }

    #[test]
    fn an_address_list_for_a_device_not_sought_is_ignored() {
        let mut r = Rendezvous::default();
        r.set_ours(&id(9), [id(1)].into());
        let list = |d| AddressList {
            device: id(d),
            addrs: vec![addr(1)],
        };
        assert!(r.on_addresses(list(1)).is_some());
        assert!(r.on_addresses(list(2)).is_none());
    }

    #[test]
    fn at_most_max_addresses_per_device_are_told() {
        let mut r = Rendezvous::default();
        r.on_seek(
            &id(8),
            &id(9),
            SeekList {
                devices: vec![id(1)],
            },
        );
        let many = (0..40).map(addr).collect();
        assert_eq!(
            r.tell(id(1), many).map(|l| l.addrs.len()),
            Some(MAX_ADDRESSES_PER_DEVICE)
        );
    }
}
