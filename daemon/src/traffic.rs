//! Bytes moved with each peer since the daemon started, over every connection to it: a
//! reconnect does not reset a peer's count, and the device's totals are the sum of its peers'.
//! And the address each peer was last seen at, which outlives its connection too.
//!
//! The engine shows it the peers' current links whenever one comes or goes
//! ([`Traffic::observe`]); a link that is no longer current is read one last time and
//! retired. It only reads connection statistics: it never opens, closes or keeps a connection
//! alive beyond its session (it holds a handle until it has read the final counts).

use crate::peers::Peers;
use crate::transport;
use meshfs_protocol::DeviceId;
use std::collections::HashMap;
use std::net::SocketAddr;

/// Per-peer byte counters.
#[derive(Default)]
pub struct Traffic {
    peers: HashMap<DeviceId, PeerTraffic>,
}

#[derive(Default)]
struct PeerTraffic {
    /// Bytes of connections that have ended (or were replaced).
    retired: (u64, u64),
    /// Bytes those connections declared lost and sent again.
    retired_resent: u64,
    /// The connections seen current, by link serial.
    live: HashMap<u64, quinn::Connection>,
    /// The remote address of its current connection when last observed.
    addr: Option<SocketAddr>,
}

impl Traffic {
    /// Takes note of `peers`' current links and retires those that are no longer current.
    pub fn observe(&mut self, peers: &Peers) {
        let mut current: HashMap<DeviceId, u64> = HashMap::new();
        for id in peers.connected() {
            if let Some(link) = peers.link(&id) {
                current.insert(id, link.serial);
                let t = self.peers.entry(id).or_default();
                // QUIC follows a peer that moves (migration): read it each time.
                t.addr = Some(link.conn.remote_address());
                t.live
                    .entry(link.serial)
                    .or_insert_with(|| link.conn.clone());
            }
        }
        for (id, t) in &mut self.peers {
            let keep = current.get(id);
            let ended: Vec<u64> = t
                .live
                .keys()
                .filter(|s| Some(*s) != keep)
                .copied()
                .collect();
            for serial in ended {
                if let Some(conn) = t.live.remove(&serial) {
                    let s = transport::link_stats(&conn);
                    t.retired.0 += s.bytes_sent;
                    t.retired.1 += s.bytes_received;
                    t.retired_resent += s.lost_bytes;
                    transport::forget_lanes(&conn);
                }
            }
        }
    }

    /// Bytes (sent, received) with `peer` since the daemon started.
    pub fn peer(&self, peer: &DeviceId) -> (u64, u64) {
        self.peers.get(peer).map_or((0, 0), PeerTraffic::bytes)
    }

    /// The address `peer` was last seen at (its connection's, while it is connected).
    pub fn addr(&self, peer: &DeviceId) -> Option<SocketAddr> {
        self.peers.get(peer).and_then(|t| t.addr)
    }

    /// Bytes (sent, received) with every peer (also peers removed since) since the daemon
    /// started.
    pub fn totals(&self) -> (u64, u64) {
        self.peers
            .values()
            .map(PeerTraffic::bytes)
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
    }

    /// Bytes sent to every peer since the daemon started that were declared lost and sent
    /// again (counted in [`Traffic::totals`]' sent too).
    pub fn resent(&self) -> u64 {
        self.peers
            .values()
            .map(|t| {
                t.live.values().fold(t.retired_resent, |n, conn| {
                    n + transport::link_stats(conn).lost_bytes
                })
            })
            .sum()
    }
}

impl PeerTraffic {
    fn bytes(&self) -> (u64, u64) {
        self.live.values().fold(self.retired, |(s, r), conn| {
            let l = transport::link_stats(conn);
            (s + l.bytes_sent, r + l.bytes_received)
        })
    }
}
