//! Local discovery on the wire: announcing this device on every local network and hearing the
//! others' announcements (`docs/protocol.md`, "Local discovery").
//!
//! **What it owns.** Two UDP sockets on the discovery port (IPv4: each interface's broadcast
//! address; IPv6: the link-local multicast group on each interface), both opened with
//! `SO_REUSEADDR` so several daemons on one host all hear announcements; the
//! announcing schedule (at start, again [`SECOND_ANNOUNCE`] later, then every
//! [`ANNOUNCE_EVERY`], and at once when asked after an address change); and the
//! [`Limiter`] in front of the decoder.
//!
//! **What it never does.** Decide what an announcement means: a well-formed one from another
//! device goes to the caller's hook, which checks trust and keeps the address as a hint. It is
//! started only when `[discovery] local` is on: with it off, this module opens no socket and
//! sends nothing.

use super::interfaces;
use super::limiter::Limiter;
use meshfs_protocol::{
    AnnounceError, Announcement, DeviceId, DISCOVERY_GROUP_V6, MAX_ANNOUNCEMENT_LEN,
};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::UdpSocket;
use tokio::sync::{watch, Notify};

/// The usual time between two announcements.
pub const ANNOUNCE_EVERY: Duration = Duration::from_secs(30);
/// The second announcement after start comes sooner: a device that started a moment later
/// (or whose first datagram was lost) hears of this one without waiting half a minute.
pub const SECOND_ANNOUNCE: Duration = Duration::from_secs(2);

/// What local discovery needs to know of this device.
#[derive(Clone, Debug)]
pub struct LanSetup {
    /// This device (its own announcements, looped back, are ignored).
    pub device: DeviceId,
    /// The UDP port announcements go to and are heard on.
    pub port: u16,
    /// The QUIC endpoint's local address: its port is announced, and its IP (all of this
    /// host's if it is a wildcard) and family decide what is announced where.
    pub quic: SocketAddr,
}

/// Counts of what local discovery did, for `status`.
#[derive(Debug, Default)]
pub struct LanStats {
    /// Datagrams announced (one per interface and family).
    pub sent: AtomicU64,
    /// Datagrams received on the discovery port.
    pub received: AtomicU64,
    /// Received and not read: over a source's or the overall rate.
    pub limited: AtomicU64,
    /// Read and refused: not a meshfs announcement, or malformed.
    pub refused: AtomicU64,
    /// Read and handed to the hook (another device's announcement).
    pub heard: AtomicU64,
}

/// Running local discovery.
pub struct Lan {
    /// What it did so far.
    pub stats: LanStats,
    announce_now: Notify,
    stop: watch::Sender<bool>,
}

impl Lan {
    /// Announces at once (this host's addresses changed).
    pub fn announce_now(&self) {
        self.announce_now.notify_one();
    }

    /// Stops announcing and listening (the config switched it off); the sockets close.
    pub fn stop(&self) {
        self.stop.send_replace(true);
    }
}

/// Resolves when either the daemon stops or this local discovery is stopped.
async fn stopped(daemon: &mut watch::Receiver<bool>, own: &mut watch::Receiver<bool>) {
    loop {
        if *daemon.borrow_and_update() || *own.borrow_and_update() {
            return;
        }
        tokio::select! {
            r = daemon.changed() => if r.is_err() { return },
            r = own.changed() => if r.is_err() { return },
        }
    }
}

/// What the caller does with another device's announcement heard from `from`.
pub type Hook = Arc<dyn Fn(Announcement, SocketAddr) + Send + Sync>;

/// Opens the sockets and starts announcing and listening until `stopping` turns true. Must be
/// called inside a tokio runtime. Fails only if no socket at all could be opened.
pub fn start(
    setup: LanSetup,
    hook: Hook,
    stopping: watch::Receiver<bool>,
) -> std::io::Result<Arc<Lan>> {
    let v4 = if accepts_v4(&setup.quic) {
        match socket(SocketAddr::from((Ipv4Addr::UNSPECIFIED, setup.port))) {
            Ok(s) => Some(Arc::new(s)),
            Err(e) => {
                tracing::warn!(port = setup.port, error = %e, "local discovery: cannot open the IPv4 socket");
                None
            }
        }
    } else {
        None
    };
    let v6 = if setup.quic.is_ipv6() {
        match socket(SocketAddr::from((Ipv6Addr::UNSPECIFIED, setup.port))) {
            Ok(s) => Some(Arc::new(s)),
            Err(e) => {
                tracing::debug!(port = setup.port, error = %e, "local discovery: no IPv6 socket");
                None
            }
        }
    } else {
        None
    };
    if v4.is_none() && v6.is_none() {
        return Err(std::io::Error::other(format!(
            "cannot open UDP port {} for local discovery",
            setup.port
        )));
    }
    let lan = Arc::new(Lan {
        stats: LanStats::default(),
        announce_now: Notify::new(),
        stop: watch::channel(false).0,
    });
    for s in [&v4, &v6].into_iter().flatten() {
        tokio::spawn(listen(
            s.clone(),
            setup.device,
            lan.clone(),
            hook.clone(),
            (stopping.clone(), lan.stop.subscribe()),
        ));
    }
    let stops = (stopping, lan.stop.subscribe());
    tokio::spawn(announce_loop(setup, v4, v6, lan.clone(), stops));
    Ok(lan)
}

/// The QUIC endpoint takes IPv4 (an IPv4 address, or the IPv6 wildcard, which is dual-stack).
fn accepts_v4(quic: &SocketAddr) -> bool {
    quic.is_ipv4() || quic.ip().is_unspecified()
}

fn socket(addr: SocketAddr) -> std::io::Result<UdpSocket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let s = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
    // Every daemon on the host binds the port this way, and each gets every broadcast and
    // multicast datagram.
    s.set_reuse_address(true)?;
    if addr.is_ipv6() {
        s.set_only_v6(true)?;
        s.set_multicast_loop_v6(true)?;
    } else {
        s.set_broadcast(true)?;
    }
    s.set_nonblocking(true)?;
    s.bind(&addr.into())?;
    UdpSocket::from_std(s.into())
}

/// Reads announcements until `stopping`.
async fn listen(
    socket: Arc<UdpSocket>,
    me: DeviceId,
    lan: Arc<Lan>,
    hook: Hook,
    (mut daemon, mut own): (watch::Receiver<bool>, watch::Receiver<bool>),
) {
    // One byte more than the longest announcement: a longer datagram is seen as such.
    let mut buf = [0u8; MAX_ANNOUNCEMENT_LEN + 1];
    let mut limiter = Limiter::new(Instant::now());
    loop {
        let (n, from) = tokio::select! {
            r = socket.recv_from(&mut buf) => match r {
                Ok(x) => x,
                Err(e) => {
                    tracing::debug!(error = %e, "local discovery: receive failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = stopped(&mut daemon, &mut own) => return,
        };
        let stats = &lan.stats;
        stats.received.fetch_add(1, Relaxed);
        if !limiter.allow(from.ip(), Instant::now()) {
            stats.limited.fetch_add(1, Relaxed);
            continue;
        }
        match Announcement::decode(&buf[..n]) {
            Ok(a) if a.device == me => {}
            Ok(a) => {
                stats.heard.fetch_add(1, Relaxed);
                hook(a, from);
            }
            Err(AnnounceError::Foreign) => {
                stats.refused.fetch_add(1, Relaxed);
            }
            Err(e) => {
                stats.refused.fetch_add(1, Relaxed);
                tracing::debug!(%from, error = %e, "local discovery: refused a datagram");
            }
        }
    }
}

/// Announces at start, after [`SECOND_ANNOUNCE`], then every [`ANNOUNCE_EVERY`] and whenever
/// asked.
async fn announce_loop(
    setup: LanSetup,
    v4: Option<Arc<UdpSocket>>,
    v6: Option<Arc<UdpSocket>>,
    lan: Arc<Lan>,
    (mut daemon, mut own): (watch::Receiver<bool>, watch::Receiver<bool>),
) {
    let mut wait = SECOND_ANNOUNCE;
    loop {
        if *daemon.borrow() || *own.borrow() {
            return;
        }
        let sent = announce(&setup, v4.as_deref(), v6.as_deref()).await;
        lan.stats.sent.fetch_add(sent, Relaxed);
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = lan.announce_now.notified() => {}
            _ = stopped(&mut daemon, &mut own) => return,
        }
        wait = ANNOUNCE_EVERY;
    }
}

/// One announcement on every interface that is up (loopback left out). Returns the datagrams
/// sent.
async fn announce(setup: &LanSetup, v4: Option<&UdpSocket>, v6: Option<&UdpSocket>) -> u64 {
    let ifs = match interfaces::addresses() {
        Ok(a) => a,
        Err(e) => {
            tracing::debug!(error = %e, "local discovery: cannot list the interfaces");
            return 0;
        }
    };
    let usable: Vec<&interfaces::IfAddr> = ifs.iter().filter(|a| a.up && !a.loopback).collect();
    let addrs: Vec<IpAddr> = if setup.quic.ip().is_unspecified() {
        usable
            .iter()
            .map(|a| a.ip)
            .filter(|ip| match ip {
                IpAddr::V4(_) => accepts_v4(&setup.quic),
                IpAddr::V6(v6) => setup.quic.is_ipv6() && !interfaces::is_link_local_v6(v6),
            })
            .collect()
    } else {
        vec![setup.quic.ip().to_canonical()]
    };
    let datagram = Announcement {
        device: setup.device,
        instance: crate::transport::instance(),
        port: setup.quic.port(),
        addrs,
    }
    .encode();
    let mut sent = 0;
    tracing::debug!(
        broadcast = ?usable.iter().filter_map(|a| a.broadcast).collect::<Vec<_>>(),
        v6 = ?usable.iter().filter(|a| a.multicast && a.ip.is_ipv6()).map(|a| &a.name).collect::<Vec<_>>(),
        bytes = datagram.len(),
        "local discovery: announcing"
    );
    if let Some(s) = v4 {
        let mut done = std::collections::BTreeSet::new();
        for b in usable.iter().filter_map(|a| a.broadcast) {
            if done.insert(b) {
                match s.send_to(&datagram, (b, setup.port)).await {
                    Ok(_) => sent += 1,
                    Err(e) => {
                        tracing::debug!(broadcast = %b, error = %e, "local discovery: announcement not sent")
                    }
                }
            }
        }
    }
    if let Some(s) = v6 {
        let sock = socket2::SockRef::from(s);
        let mut done = std::collections::BTreeSet::new();
        for a in usable.iter().filter(|a| a.multicast && a.ip.is_ipv6()) {
            if !done.insert(a.index) {
                continue;
            }
            // Joined again at each announcement: an interface that came up since is heard too
            // (joining twice is refused, harmlessly).
            let _ = sock.join_multicast_v6(&DISCOVERY_GROUP_V6, a.index);
            if let Err(e) = sock.set_multicast_if_v6(a.index) {
                tracing::debug!(interface = %a.name, error = %e, "local discovery: cannot pick the interface");
                continue;
            }
            let to = SocketAddr::from((DISCOVERY_GROUP_V6, setup.port));
            match s.send_to(&datagram, to).await {
                Ok(_) => sent += 1,
                Err(e) => {
                    tracing::debug!(interface = %a.name, error = %e, "local discovery: announcement not sent")
                }
            }
        }
    }
    sent
}
