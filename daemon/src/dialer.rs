//! Where and when to dial each peer, and what a move of this host does to its connections.
//!
//! **Where.** Each configured peer that is dialed has a dial loop while it is not connected
//! ([`dial_loop`], started by the engine). It races the peer's candidate addresses
//! ([`discovery::dial`]): the one that worked last, the config's fixed ones (resolved at every
//! attempt), and — for a peer whose `addresses` say `dynamic` — those learned on the LAN, from
//! its own connections and from other peers (`discovery`). What answers as the pinned device is
//! remembered; a hint that fails is told to the book. With nothing to try, it waits for an
//! address to be learned.
//!
//! **Roaming.** When this host's addresses change ([`network_changed`]): the connections it
//! accepted on an address that went away cannot follow it (a QUIC listener does not migrate),
//! so they are closed and the instance nonce is drawn anew — the peer replaces its old
//! connection at once when ours arrives; the connections it dialed migrate (the endpoint is
//! rebound, which makes each send from the new address at once); every dial loop starts over
//! now, without backoff, and so it does when only a route changed.
//!
//! It never runs a session (`peers` does, on the connection it hands over) and never decides
//! trust.

use crate::discovery;
use crate::discovery::book::{Candidate, Failure, Source};
use crate::peers::{register, run_link, Net};
use crate::transport;
use meshfs_protocol::DeviceId;
use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;

/// How long a redial (after a failed dial) waits for the handshake before starting over.
const RETRY_ATTEMPT: Duration = Duration::from_millis(1500);

/// Keeps a connection to `peer` up: dials its candidate addresses when there is none, with
/// backoff; waits for an address to be learned when none is known; starts over at once when
/// this host's network changes.
pub async fn dial_loop(net: Arc<Net>, peer: DeviceId, stop: Arc<Notify>) {
    let mut backoff = Duration::from_millis(100);
    let max = Duration::from_secs(net.options().max_redial_secs.max(1));
    let mut retrying = false;
    let mut network = net.network.subscribe();
    let mut learned = net.addresses.subscribe();
    loop {
        if *net.stopping.borrow() {
            return;
        }
        let connected = net.is_connected(&peer);
        if connected {
            backoff = Duration::from_millis(100);
            retrying = false;
            tokio::select! {
                _ = net.peer_changed.notified() => continue,
                _ = stop.notified() => return,
                _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
            }
        }
        network.borrow_and_update();
        learned.borrow_and_update();
        let candidates = candidates(&net, &peer).await;
        if candidates.is_empty() {
            // Nowhere to dial yet: wait until an address is learned (or the peer dials us).
            tokio::select! {
                _ = learned.changed() => {}
                _ = network.changed() => {}
                _ = net.peer_changed.notified() => {}
                _ = stop.notified() => return,
                _ = tokio::time::sleep(Duration::from_secs(5)) => {}
            }
            continue;
        }
        let tried: Vec<SocketAddr> = candidates.iter().map(|c| c.addr).collect();
        // After a failure the peer is likely unreachable for now (an outage, a laptop asleep):
        // attempts are cut short, so a handshake started into a dead path does not hold the
        // next one back once the path returns (QUIC backs its Initial retransmissions off).
        let attempt = retrying.then_some(RETRY_ATTEMPT);
        let outcome = tokio::select! {
            // Given up (`None`) if the peer's own dial connects before any attempt has shaken
            // hands: completed, this one would land as a second connection (its handshake
            // retransmitted hundreds of ms later, when the peer began listening after this
            // dial's first packet), and the crossed dials' rule would close one of the two,
            // the first maybe, restarting its session mid-sync. A dial already shaken hands
            // goes on: the peer may count it already, and the rule decides as before.
            r = discovery::dial::race(
                &net.endpoint,
                peer,
                &candidates,
                attempt,
                connected_meanwhile(&net, &peer),
            ) => r,
            // The host's network changed under the attempt: start over with what is true now.
            _ = network.changed() => None,
            _ = stop.notified() => return,
        };
        match outcome {
            None => {
                backoff = Duration::from_millis(100);
                retrying = false;
                continue;
            }
            Some(Ok(won)) => {
                // A hint nothing answered at before the device did elsewhere is dropped too: a
                // forged announcement costs one dial, however the race ended.
                for c in &won.cut {
                    net.addresses.failed(&peer, c.addr, Failure::Unreachable);
                }
                if let Some(link) = register(&net, won.established, net.folders.device, won.source)
                {
                    let e = net.clone();
                    tokio::spawn(run_link(e, peer, link));
                }
                continue;
            }
            Some(Err(lost)) => dial_failed(&net, &peer, lost, retrying),
        }
        retrying = true;
        // Wait out the backoff, unless the network changes or a new address is learned.
        let until = tokio::time::Instant::now() + backoff;
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(until) => break,
                _ = stop.notified() => return,
                _ = network.changed() => {
                    backoff = Duration::from_millis(100);
                    retrying = false;
                    break;
                }
                _ = learned.changed() => {
                    let now: Vec<SocketAddr> = candidates_now(&net, &peer).into_iter().map(|c| c.addr).collect();
                    if now.iter().any(|a| !tried.contains(a)) {
                        break;
                    }
                }
            }
        }
        backoff = (backoff * 2).min(max);
    }
}

/// Returns once `peer` is connected (a link registered, whoever dialed it).
async fn connected_meanwhile(net: &Net, peer: &DeviceId) {
    loop {
        // Made before the check: a registration between the two still wakes it.
        let changed = net.peer_changed.notified();
        if net.is_connected(peer) {
            return;
        }
        changed.await;
    }
}

/// What a failed race says: each lost attempt tells the address book how its address failed,
/// and the peer's last error says why it could not be reached (a refusal first: the device
/// answered).
fn dial_failed(net: &Net, peer: &DeviceId, lost: Vec<discovery::dial::Lost>, retrying: bool) {
    let mut shown: Option<&discovery::dial::Lost> = None;
    // The device answered and said why not: no error to show (every other attempt still tells
    // the book how it failed).
    let mut answered = false;
    for l in &lost {
        match &l.error {
            // Both dialed at once and the peer kept its own connection: nothing failed.
            transport::TransportError::Duplicate { .. } => {
                tracing::debug!(peer = %peer.short(), addr = %l.addr, reason = %l.error, "crossed dial");
                answered = true;
            }
            // Its daemon is going down: shown as offline, not as an error (the same as a
            // session it ends with a Shutdown message).
            transport::TransportError::Stopping { .. } => {
                tracing::debug!(peer = %peer.short(), addr = %l.addr, reason = %l.error, "peer stopping");
                answered = true;
            }
            transport::TransportError::Refused { .. } => shown = Some(l),
            transport::TransportError::WrongDevice { .. } => {
                net.addresses.failed(peer, l.addr, Failure::WrongDevice)
            }
            _ => net.addresses.failed(peer, l.addr, Failure::Unreachable),
        }
    }
    if answered {
        return;
    }
    let Some(l) = shown.or(lost.first()) else {
        return;
    };
    let more = match lost.len() {
        1 => String::new(),
        n => format!(
            " (and {} other address{})",
            n - 1,
            if n == 2 { "" } else { "es" }
        ),
    };
    net.peer_error(*peer, format_args!("{}{more}", l.error));
    if !retrying {
        tracing::info!(peer = %peer.short(), addr = %l.addr, source = l.source.as_str(), error = %l.error, tried = lost.len(), "dial failed; retrying")
    } else {
        tracing::debug!(peer = %peer.short(), addr = %l.addr, source = l.source.as_str(), error = %l.error, tried = lost.len(), "dial failed; retrying")
    }
}

/// The addresses to race for `peer`, best first: the one that worked last, the config's fixed
/// ones (resolved now), then what was learned; only those this endpoint can send to, each once.
async fn candidates(net: &Net, peer: &DeviceId) -> Vec<Candidate> {
    let Some(cfg) = net.peer_config(peer) else {
        return Vec::new();
    };
    let mut fixed = Vec::new();
    for a in cfg.static_addrs() {
        let resolved = resolve(a).await;
        if resolved.is_empty() {
            tracing::warn!(peer = %peer.short(), addr = %a, "cannot resolve peer address");
            net.peer_error(*peer, format_args!("cannot resolve the address {a}"));
        }
        fixed.extend(resolved);
    }
    let learned = if cfg.is_dynamic() {
        net.addresses.candidates(peer)
    } else {
        Vec::new()
    };
    order_candidates(net.endpoint.local_addr().ok(), &fixed, learned)
}

/// [`candidates`] without resolving host names again: to tell whether a new address was
/// learned.
fn candidates_now(net: &Net, peer: &DeviceId) -> Vec<Candidate> {
    if !net.peer_config(peer).is_some_and(|p| p.is_dynamic()) {
        return Vec::new();
    }
    order_candidates(
        net.endpoint.local_addr().ok(),
        &[],
        net.addresses.candidates(peer),
    )
}

/// The remembered address first, the fixed ones next, then the learned ones in the book's
/// order; a remembered address that is a fixed one counts as fixed. Only addresses `local`
/// can send to; each once.
fn order_candidates(
    local: Option<SocketAddr>,
    fixed: &[SocketAddr],
    learned: Vec<Candidate>,
) -> Vec<Candidate> {
    let fixed: Vec<SocketAddr> = fixed
        .iter()
        .map(|a| discovery::book::canonical(*a))
        .collect();
    let (remembered, rest): (Vec<Candidate>, Vec<Candidate>) = learned
        .into_iter()
        .partition(|c| c.source == Source::Remembered);
    let mut out: Vec<Candidate> = Vec::new();
    let all = remembered
        .into_iter()
        .chain(fixed.iter().map(|&addr| Candidate {
            addr,
            source: Source::Static,
        }))
        .chain(rest);
    for mut c in all {
        if fixed.contains(&c.addr) {
            c.source = Source::Static;
        }
        if local.is_some_and(|l| !discovery::reachable_from(&l, &c.addr)) {
            continue;
        }
        if !out.iter().any(|o| o.addr == c.addr) {
            out.push(c);
        }
    }
    out
}

/// Every address `addr` (`IP:PORT` or `HOST:PORT`) stands for.
async fn resolve(addr: &str) -> Vec<SocketAddr> {
    if let Ok(sa) = addr.parse() {
        return vec![sa];
    }
    match tokio::net::lookup_host(addr).await {
        Ok(found) => found.take(4).collect(),
        Err(_) => Vec::new(),
    }
}

/// This host's network changed (`discovery::netlink`): `gone` are the addresses it lost (empty
/// when only routes changed or addresses were added). Connections accepted on a lost address
/// are closed and the instance nonce is drawn anew (the peers replace their side at once when
/// the new connection arrives), the endpoint is rebound (the connections it dialed move to the
/// new address at once), and every dial loop starts over now.
pub fn network_changed(net: &Net, gone: &BTreeSet<IpAddr>, addresses_changed: bool) {
    if addresses_changed {
        let stranded: Vec<(DeviceId, quinn::Connection)> = net
            .accepted()
            .into_iter()
            .filter(|(_, c)| {
                c.local_ip()
                    .is_some_and(|ip| gone.contains(&ip.to_canonical()))
            })
            .collect();
        if !gone.is_empty() {
            transport::new_instance();
        }
        for (peer, conn) in stranded {
            tracing::info!(peer = %peer.short(), local = ?conn.local_ip(), "this device's address went away: the connection the peer dialed is replaced");
            conn.close(transport::CLOSE_STOPPING, b"address changed");
        }
        if let Err(e) = transport::rebind(&net.endpoint) {
            tracing::warn!(error = %e, "cannot rebind the QUIC endpoint after an address change");
        }
        if let Some(lan) = net.lan.lock().ok().and_then(|l| l.clone()) {
            lan.announce_now();
        }
    }
    net.network.send_modify(|n| *n += 1);
}
