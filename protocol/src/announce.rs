//! Local discovery's announcement datagram, and the address as the wire carries it.
//!
//! A daemon announces on every local network, in one UDP datagram to [`DISCOVERY_PORT`] (IPv4
//! broadcast, IPv6 link-local multicast to [`DISCOVERY_GROUP_V6`]), its device id, its
//! instance nonce, the UDP port of its QUIC endpoint and the addresses it listens on. The
//! layout (`docs/protocol.md`, "Local discovery") is fixed binary, big-endian, not postcard: it
//! is read before anything is known about its sender, so it is small, has no list longer than
//! [`MAX_ANNOUNCED_ADDRS`], and is refused whole if any byte is off.
//!
//! **An announcement is a hint, never a proof.** It is not signed: whoever can send a datagram
//! on the LAN can claim any device id at any address. A dialer still accepts only the pinned
//! key of the device it expects (the TLS handshake), so a forged announcement can make a dial
//! fail, never make meshfs talk to another device.

use crate::ids::DeviceId;
use serde::{Deserialize, Serialize};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// The four bytes an announcement starts with: `MFSA` ("meshfs announce").
pub const ANNOUNCE_MAGIC: [u8; 4] = *b"MFSA";
/// The layout version after the magic. A receiver ignores any other.
pub const ANNOUNCE_VERSION: u8 = 1;
/// The well-known UDP port announcements are sent to (and listened for on).
pub const DISCOVERY_PORT: u16 = 21788;
/// The IPv6 link-local multicast group announcements are sent to: `ff12::6d65:7368` ("mesh";
/// scope link-local, transient).
pub const DISCOVERY_GROUP_V6: Ipv6Addr = Ipv6Addr::new(0xff12, 0, 0, 0, 0, 0, 0x6d65, 0x7368);
/// Most addresses one announcement lists.
pub const MAX_ANNOUNCED_ADDRS: usize = 16;
/// Bytes before the address list: magic, version, device id, instance, port, count.
const HEADER_LEN: usize = 4 + 1 + 32 + 8 + 2 + 1;
/// The longest valid announcement, in bytes (every address IPv6). A receiver reads at most
/// this much (one byte more, to tell a longer datagram).
pub const MAX_ANNOUNCEMENT_LEN: usize = HEADER_LEN + MAX_ANNOUNCED_ADDRS * 17;

/// One announcement.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Announcement {
    /// The device the sender says it is.
    pub device: DeviceId,
    /// Its instance nonce (the QUIC welcome's): new when its daemon restarts or its addresses
    /// change.
    pub instance: u64,
    /// The UDP port of its QUIC endpoint.
    pub port: u16,
    /// The addresses it listens on (at most [`MAX_ANNOUNCED_ADDRS`]). A receiver also takes the
    /// datagram's source address with `port`.
    pub addrs: Vec<IpAddr>,
}

/// Why a datagram is not an announcement.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AnnounceError {
    /// Not meshfs's magic, or another layout version: not for us (ignored quietly).
    #[error("not a meshfs announcement of version {ANNOUNCE_VERSION}")]
    Foreign,
    /// The magic and version are ours but the rest is not a valid announcement.
    #[error("malformed announcement: {0}")]
    Malformed(&'static str),
}

impl Announcement {
    /// The datagram. Addresses past [`MAX_ANNOUNCED_ADDRS`] are left out.
    pub fn encode(&self) -> Vec<u8> {
        let addrs = &self.addrs[..self.addrs.len().min(MAX_ANNOUNCED_ADDRS)];
        let mut out = Vec::with_capacity(HEADER_LEN + addrs.len() * 17);
        out.extend_from_slice(&ANNOUNCE_MAGIC);
        out.push(ANNOUNCE_VERSION);
        out.extend_from_slice(self.device.as_bytes());
        out.extend_from_slice(&self.instance.to_be_bytes());
        out.extend_from_slice(&self.port.to_be_bytes());
        out.push(addrs.len() as u8);
        for a in addrs {
            match a {
                IpAddr::V4(v4) => {
                    out.push(4);
                    out.extend_from_slice(&v4.octets());
                }
                IpAddr::V6(v6) => {
                    out.push(6);
                    out.extend_from_slice(&v6.octets());
                }
            }
        }
        out
    }

    /// Reads one datagram: exactly one announcement, nothing after it.
    pub fn decode(data: &[u8]) -> Result<Announcement, AnnounceError> {
        if data.len() < 5 || data[..4] != ANNOUNCE_MAGIC || data[4] != ANNOUNCE_VERSION {
            return Err(AnnounceError::Foreign);
        }
        if data.len() > MAX_ANNOUNCEMENT_LEN {
            return Err(AnnounceError::Malformed("longer than any announcement"));
        }
        if data.len() < HEADER_LEN {
            return Err(AnnounceError::Malformed("shorter than its header"));
        }
        let mut id = [0u8; 32];
        id.copy_from_slice(&data[5..37]);
        let mut n = [0u8; 8];
        n.copy_from_slice(&data[37..45]);
        let port = u16::from_be_bytes([data[45], data[46]]);
        if port == 0 {
            return Err(AnnounceError::Malformed("port 0"));
        }
        let count = usize::from(data[47]);
        if count > MAX_ANNOUNCED_ADDRS {
            return Err(AnnounceError::Malformed("too many addresses"));
        }
        let mut rest = &data[HEADER_LEN..];
        let mut addrs = Vec::with_capacity(count);
        for _ in 0..count {
            let (addr, after) = match rest.split_first() {
                Some((4, r)) if r.len() >= 4 => {
                    let mut b = [0u8; 4];
                    b.copy_from_slice(&r[..4]);
                    (IpAddr::V4(Ipv4Addr::from(b)), &r[4..])
                }
                Some((6, r)) if r.len() >= 16 => {
                    let mut b = [0u8; 16];
                    b.copy_from_slice(&r[..16]);
                    (IpAddr::V6(Ipv6Addr::from(b)), &r[16..])
                }
                Some((4 | 6, _)) => return Err(AnnounceError::Malformed("address cut short")),
                Some(_) => return Err(AnnounceError::Malformed("unknown address family")),
                None => return Err(AnnounceError::Malformed("fewer addresses than counted")),
            };
            addrs.push(addr);
            rest = after;
        }
        if !rest.is_empty() {
            return Err(AnnounceError::Malformed("bytes after the last address"));
        }
        Ok(Announcement {
            device: DeviceId::from_bytes(id),
            instance: u64::from_be_bytes(n),
            port,
            addrs,
        })
    }
}

/// A UDP address as the session's `Addresses` message carries it: IPv4 or IPv6 (no scope: a
/// link-local address means nothing to another device), and a port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum WireAddr {
    /// An IPv4 address and port.
    V4 {
        /// The address.
        ip: [u8; 4],
        /// The UDP port.
        port: u16,
    },
    /// An IPv6 address and port.
    V6 {
        /// The address.
        ip: [u8; 16],
        /// The UDP port.
        port: u16,
    },
}

impl WireAddr {
    /// `addr` on the wire; an IPv4-mapped IPv6 address becomes the IPv4 one (a dual-stack
    /// socket shows IPv4 peers so), a scope id is dropped.
    pub fn from_socket_addr(addr: SocketAddr) -> WireAddr {
        match addr.ip().to_canonical() {
            IpAddr::V4(v4) => WireAddr::V4 {
                ip: v4.octets(),
                port: addr.port(),
            },
            IpAddr::V6(v6) => WireAddr::V6 {
                ip: v6.octets(),
                port: addr.port(),
            },
        }
    }

    /// The socket address.
    pub fn socket_addr(&self) -> SocketAddr {
        match *self {
            WireAddr::V4 { ip, port } => SocketAddr::new(IpAddr::V4(Ipv4Addr::from(ip)), port),
            WireAddr::V6 { ip, port } => SocketAddr::new(IpAddr::V6(Ipv6Addr::from(ip)), port),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ip() -> impl Strategy<Value = IpAddr> {
        prop_oneof![
            any::<[u8; 4]>().prop_map(|b| IpAddr::V4(Ipv4Addr::from(b))),
            any::<[u8; 16]>().prop_map(|b| IpAddr::V6(Ipv6Addr::from(b))),
        ]
    }

    fn announcement() -> impl Strategy<Value = Announcement> {
        (
            any::<[u8; 32]>(),
            any::<u64>(),
            1..=u16::MAX,
            prop::collection::vec(ip(), 0..=MAX_ANNOUNCED_ADDRS),
        )
            .prop_map(|(id, instance, port, addrs)| Announcement {
                device: DeviceId::from_bytes(id),
                instance,
                port,
                addrs,
            })
    }

    proptest! {
        #[test]
        fn an_announcement_reads_back_as_it_was_written(a in announcement()) {
            let bytes = a.encode();
            prop_assert!(bytes.len() <= MAX_ANNOUNCEMENT_LEN);
            prop_assert_eq!(Announcement::decode(&bytes), Ok(a));
        }

        #[test]
        fn any_datagram_is_read_or_refused_without_panic(data in prop::collection::vec(any::<u8>(), 0..400)) {
            let _ = Announcement::decode(&data);
            let mut ours = ANNOUNCE_MAGIC.to_vec();
            ours.push(ANNOUNCE_VERSION);
            ours.extend_from_slice(&data);
            let _ = Announcement::decode(&ours);
        }

        #[test]
        fn a_cut_or_extended_announcement_is_refused(a in announcement(), extra in 1..8usize) {
            let bytes = a.encode();
            for cut in 5..bytes.len() {
                prop_assert!(matches!(Announcement::decode(&bytes[..cut]), Err(AnnounceError::Malformed(_))));
            }
            let mut longer = bytes.clone();
            longer.extend(std::iter::repeat_n(4u8, extra));
            prop_assert!(Announcement::decode(&longer).is_err());
        }

        #[test]
        fn a_wire_address_is_the_socket_address(ip in ip(), port in any::<u16>()) {
            let sa = SocketAddr::new(ip, port);
            let back = WireAddr::from_socket_addr(sa).socket_addr();
            prop_assert_eq!(back, SocketAddr::new(ip.to_canonical(), port));
        }
    }

    #[test]
    fn the_layout_is_the_documented_one() {
        let a = Announcement {
            device: DeviceId::from_bytes([0xab; 32]),
            instance: 0x0102_0304_0506_0708,
            port: 7788,
            addrs: vec!["10.0.0.2".parse().unwrap(), "fd00::1".parse().unwrap()],
        };
        let b = a.encode();
        assert_eq!(&b[..5], b"MFSA\x01");
        assert_eq!(&b[5..37], &[0xab; 32]);
        assert_eq!(&b[37..45], &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(&b[45..48], &[0x1e, 0x6c, 2]);
        assert_eq!(&b[48..53], &[4, 10, 0, 0, 2]);
        assert_eq!(b[53], 6);
        assert_eq!(b.len(), 48 + 5 + 17);
    }

    #[test]
    fn another_magic_or_version_is_foreign_not_malformed() {
        assert_eq!(Announcement::decode(b""), Err(AnnounceError::Foreign));
        assert_eq!(
            Announcement::decode(b"MFSA\x02rest"),
            Err(AnnounceError::Foreign)
        );
        assert_eq!(
            Announcement::decode(b"SYNCthing"),
            Err(AnnounceError::Foreign)
        );
    }

    #[test]
    fn a_v4_mapped_address_goes_on_the_wire_as_v4() {
        let mapped: SocketAddr = "[::ffff:10.1.2.3]:7788".parse().unwrap();
        assert_eq!(
            WireAddr::from_socket_addr(mapped),
            WireAddr::V4 {
                ip: [10, 1, 2, 3],
                port: 7788
            }
        );
    }
}
