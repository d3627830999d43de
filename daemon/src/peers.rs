//! Peer connections: dialing with backoff, accepting, keeping exactly one connection per peer,
//! driving a [`Session`] over it, and serving and fetching chunks on request streams.
//!
//! **One connection per peer pair.** When both sides dial at once, each ends up holding two
//! connections; both keep the one dialed by the larger device id and close the other, so the
//! choice is the same on both ends without another round trip and no dial waits on a timer.
//!
//! Where to dial a peer, and what a move of this host does to its connections, is
//! [`crate::dialer`]'s; this module keeps what each peer's addresses are learned from: the
//! connections it holds (the address of each, told to the peers that seek it) and what other
//! peers and the LAN say ([`Net::heard`], protocol 8's `Addresses`).
//!
//! The session logic (what to send, when a folder is in sync) lives in [`meshfs_sync::session`]; this
//! module only moves its messages and runs the applies it asks for.

use crate::apply;
use crate::chunks::{self, Inline, SERVED_AT_ONCE};
use crate::config::{Config, Options};
use crate::discovery::book::Source;
use crate::discovery::{self, Addresses};
use crate::folder::{Folders, Reader};
use crate::last_error::LastError;
use crate::outbox::{outbox, Outbox};
use crate::resume_points::ResumePoints;
use crate::transport::{self, LinkStats};
use meshfs_protocol::{DeviceId, ErrorCode, FileRecord, FolderId, Message, ShortId, WireAddr};
use meshfs_sync::reconcile::ReadError;
use meshfs_sync::session::{
    Action, FolderSyncStatus, IndexSource, ScanCounts, Session, SessionFolder,
};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch, Notify};

/// What the peers share with the engine: the folders they sync, the config they read, the
/// registry of connections and the endpoint. The engine holds one and wires it to the
/// folders and mounts; nothing here knows of the engine.
pub struct Net {
    /// The journal and the running folders.
    pub folders: Arc<Folders>,
    /// The config in force (the engine replaces it on reload).
    pub config: Arc<RwLock<Config>>,
    /// Connected peers and their sync status.
    pub peers: crate::lock::Ranked<Peers>,
    /// Woken when a peer connects, disconnects or reports progress.
    pub peer_changed: Notify,
    /// The devices with a live connection now, each with the folders its session exchanges
    /// (both hellos listed them; none until the hellos are through): each session tells its
    /// peer, per folder, the others (the `Peers` message), so that it does not relay content
    /// they send the peer themselves.
    pub links: watch::Sender<Links>,
    /// The QUIC endpoint.
    pub endpoint: quinn::Endpoint,
    /// Set to true when the daemon stops.
    pub stopping: watch::Sender<bool>,
    /// Woken at shutdown (sessions say goodbye).
    pub shutdown: Notify,
    /// Where each trusted device may be reached (`discovery`).
    pub addresses: Arc<Addresses>,
    /// Bumped when this host's network changed: every dial loop starts over at once.
    pub network: watch::Sender<u64>,
    /// The devices this one dials wherever they are found (its `dynamic` peers): each session
    /// asks its peer where they are (`Seek`).
    pub seeking: watch::Sender<BTreeSet<DeviceId>>,
    /// The address of each connected peer's connection (where its packets come from), told to
    /// the peers that seek it (`Addresses`).
    pub link_addrs: watch::Sender<BTreeMap<DeviceId, SocketAddr>>,
    /// Local discovery, when it runs.
    pub lan: Mutex<Option<Arc<discovery::lan::Lan>>>,
    /// Each running folder's receive pipeline: sessions hand their batches to it.
    pub receivers: RwLock<HashMap<FolderId, apply::Receiver>>,
}

impl Net {
    /// The receive pipeline of `folder`, if it runs.
    pub fn receiver(&self, folder: &FolderId) -> Option<apply::Receiver> {
        self.receivers.read().ok()?.get(folder).cloned()
    }

    /// Every folder's receive pipeline.
    fn all_receivers(&self) -> Vec<apply::Receiver> {
        self.receivers
            .read()
            .map(|r| r.values().cloned().collect())
            .unwrap_or_default()
    }

    /// This device's name.
    pub fn name(&self) -> String {
        self.config
            .read()
            .map(|c| c.device.name.clone())
            .unwrap_or_default()
    }

    /// The options in force.
    pub fn options(&self) -> Options {
        self.config
            .read()
            .map(|c| c.options.clone())
            .unwrap_or_default()
    }

    /// The folders this device shares with `peer` (and runs).
    pub fn shared_with(&self, peer: &DeviceId) -> Vec<FolderId> {
        let running = self.folders.ids();
        self.config
            .read()
            .ok()
            .and_then(|c| c.peer(peer).map(|p| p.folders.clone()))
            .unwrap_or_default()
            .into_iter()
            .filter(|f| running.contains(f))
            .collect()
    }

    /// `error` happened with `peer` now (`status` shows the last one).
    pub fn peer_error(&self, peer: DeviceId, error: impl std::fmt::Display) {
        if let Ok(mut p) = self.peers.lock() {
            p.last_error.insert(peer, LastError::now(error));
        }
    }

    /// The peer's `[[peer]]` entry, if it is configured.
    pub fn peer_config(&self, peer: &DeviceId) -> Option<crate::config::PeerConfig> {
        self.config.read().ok()?.peer(peer).cloned()
    }

    /// The devices to seek: the configured peers dialed wherever they are found.
    pub fn dynamic_peers(&self) -> BTreeSet<DeviceId> {
        self.config
            .read()
            .map(|c| {
                c.peers
                    .iter()
                    .filter(|p| p.is_dynamic())
                    .map(|p| p.id)
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Another device's announcement, heard on a local network from `from`: its addresses
    /// become candidates if it is a peer dialed wherever it is found (anything else is
    /// ignored). Only a hint: see `discovery`.
    pub fn heard(&self, a: meshfs_protocol::Announcement, from: SocketAddr) {
        if !self.peer_config(&a.device).is_some_and(|p| p.is_dynamic()) {
            return;
        }
        // The sender's own address, with the announced port (and, for an IPv6 link-local
        // source, the interface it came in on).
        let sender = match from {
            SocketAddr::V6(v6) => SocketAddr::V6(std::net::SocketAddrV6::new(
                *v6.ip(),
                a.port,
                0,
                v6.scope_id(),
            )),
            SocketAddr::V4(v4) => SocketAddr::new((*v4.ip()).into(), a.port),
        };
        let addrs =
            std::iter::once(sender).chain(a.addrs.iter().map(|ip| SocketAddr::new(*ip, a.port)));
        let mut new = 0;
        for addr in addrs {
            new += usize::from(self.addresses.learn(a.device, addr, Source::Lan));
        }
        if new > 0 {
            tracing::debug!(peer = %a.device.short(), %from, new, "heard a peer on the LAN");
        }
    }

    /// A peer said where a device this one seeks is.
    fn learned_from(&self, peer: &DeviceId, list: meshfs_protocol::AddressList) {
        if !self
            .peer_config(&list.device)
            .is_some_and(|p| p.is_dynamic())
        {
            return;
        }
        for a in list.addrs {
            if self
                .addresses
                .learn(list.device, a.socket_addr(), Source::Peer)
            {
                tracing::debug!(device = %list.device.short(), via = %peer.short(), addr = %a.socket_addr(), "learned an address from a peer");
            }
        }
    }

    /// Compares each connection's address with the one published; a connection that moved
    /// (QUIC migration) is published anew and its address learned. Called about once a second.
    pub fn observe_links(&self) {
        let now: BTreeMap<DeviceId, SocketAddr> = match self.peers.lock() {
            Ok(p) => p
                .links
                .iter()
                .map(|(d, l)| (*d, discovery::book::canonical(l.conn.remote_address())))
                .collect(),
            Err(_) => return,
        };
        let moved: Vec<(DeviceId, SocketAddr)> = {
            let before = self.link_addrs.borrow();
            now.iter()
                .filter(|(d, a)| before.get(d).is_some_and(|b| b != *a))
                .map(|(d, a)| (*d, *a))
                .collect()
        };
        for (d, a) in &moved {
            tracing::info!(peer = %d.short(), addr = %a, "peer's connection moved");
            self.addresses.learn(*d, *a, Source::Incoming);
            self.addresses.worked(*d, *a);
        }
        self.link_addrs.send_if_modified(|l| {
            let changed = *l != now;
            *l = now;
            changed
        });
    }

    /// Whether `peer` has a live connection.
    pub fn is_connected(&self, peer: &DeviceId) -> bool {
        self.peers
            .lock()
            .map(|p| p.links.contains_key(peer))
            .unwrap_or(false)
    }

    /// The connections the peers dialed (this device accepted them).
    pub fn accepted(&self) -> Vec<(DeviceId, quinn::Connection)> {
        let me = self.folders.device;
        self.peers
            .lock()
            .map(|p| {
                p.links
                    .iter()
                    .filter(|(_, l)| l.dialer != me)
                    .map(|(d, l)| (*d, l.conn.clone()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The connection held for `peer`, its hellos exchanged or not.
    pub fn link_to(&self, peer: &DeviceId) -> Option<quinn::Connection> {
        self.peers
            .lock()
            .ok()
            .and_then(|p| p.links.get(peer).map(|l| l.conn.clone()))
    }

    /// The connection to each connected peer.
    pub fn links(&self) -> Vec<(DeviceId, quinn::Connection)> {
        self.peers
            .lock()
            .map(|p| {
                p.connected()
                    .into_iter()
                    .filter_map(|d| p.link(&d).map(|l| (d, l.conn.clone())))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Whether `peer`'s hello said it keeps only part of `folder`'s content (on demand there):
    /// it is not counted as holding what it acknowledged (D99). `false` before its hello.
    pub fn keeps_part(&self, peer: &DeviceId, folder: &FolderId) -> bool {
        self.peers
            .lock()
            .is_ok_and(|p| p.partial.get(peer).is_some_and(|f| f.contains(folder)))
    }
}

/// A live connection to a peer.
#[derive(Clone)]
pub struct PeerLink {
    /// The QUIC connection.
    pub conn: quinn::Connection,
    /// Which device dialed it.
    pub dialer: DeviceId,
    /// When it was established.
    pub since: Instant,
    /// Distinguishes connections to the same peer.
    pub serial: u64,
    /// The peer process's instance nonce (`transport::instance` on its side).
    pub instance: u64,
    /// How the address of this connection was learned: the candidate dialed, or
    /// [`Source::Incoming`] for one the peer dialed.
    pub source: Source,
}

/// The devices connected now, with the folders each one's session exchanges (see [`Net::links`]).
pub type Links = BTreeMap<ShortId, BTreeSet<FolderId>>;

/// What the net knows about each peer's connection and sessions.
#[derive(Default)]
pub struct Peers {
    links: HashMap<DeviceId, PeerLink>,
    /// The folders each connected peer's session exchanges, once its hellos are through.
    exchanged: HashMap<DeviceId, BTreeSet<FolderId>>,
    /// Of those, the folders whose content the peer keeps only in part (on demand there: its
    /// acknowledgements do not say it holds content).
    partial: HashMap<DeviceId, BTreeSet<FolderId>>,
    /// Per (peer, folder) sync status, as the session last reported it.
    pub sync: HashMap<(DeviceId, FolderId), FolderSyncStatus>,
    /// When each peer was last connected.
    pub last_seen: HashMap<DeviceId, std::time::SystemTime>,
    /// Each peer's last error: a failed dial, an error it reported, a failed apply of its
    /// changes.
    pub last_error: HashMap<DeviceId, LastError>,
    /// Peers whose connection was logged and not yet its end (one line each way per peer,
    /// however many connections a crossed dial opened).
    announced: HashSet<DeviceId>,
    serial: u64,
}

impl Peers {
    /// The current connection to `peer`.
    pub fn link(&self, peer: &DeviceId) -> Option<&PeerLink> {
        self.links.get(peer)
    }

    /// Every connected peer.
    pub fn connected(&self) -> Vec<DeviceId> {
        self.links.keys().copied().collect()
    }

    /// Link stats of one peer.
    pub fn stats(&self, peer: &DeviceId) -> Option<LinkStats> {
        self.links.get(peer).map(|l| transport::link_stats(&l.conn))
    }
}

/// Registers a new connection, resolving duplicates. Returns the link to run a session on, or
/// `None` when the new connection lost to an existing one (it is closed). `source`: how its
/// address was learned.
pub(crate) fn register(
    net: &Net,
    est: transport::Established,
    dialer: DeviceId,
    source: Source,
) -> Option<PeerLink> {
    let transport::Established {
        conn,
        peer,
        instance,
    } = est;
    // A stopping daemon starts no session: the peer would only see it end at once and redial.
    if *net.stopping.borrow() {
        conn.close(transport::CLOSE_STOPPING, b"daemon stopping");
        return None;
    }
    let mut peers = net.peers.lock().ok()?;
    peers.serial += 1;
    let serial = peers.serial;
    let preferred = net.folders.device.max(peer);
    if let Some(old) = peers.links.get(&peer) {
        // A connection from another instance of the peer proves the old one dead: that
        // process is gone, whatever our side of the old connection still believes. Only two
        // connections between the same two live processes (a crossed dial) are settled by
        // who dialed.
        let old_alive = old.conn.close_reason().is_none() && old.instance == instance;
        let keep_old = old_alive && old.dialer == preferred && dialer != preferred;
        if keep_old {
            conn.close(transport::CLOSE_DUPLICATE, b"duplicate connection");
            return None;
        }
        let old = old.clone();
        old.conn
            .close(transport::CLOSE_DUPLICATE, b"duplicate connection");
    }
    let remote = discovery::book::canonical(conn.remote_address());
    let link = PeerLink {
        conn,
        dialer,
        since: Instant::now(),
        serial,
        instance,
        source,
    };
    peers.links.insert(peer, link.clone());
    peers.last_seen.insert(peer, std::time::SystemTime::now());
    publish_links(net, &peers);
    drop(peers);
    // An authenticated connection proves the address (a peer's connection comes from the
    // socket it listens on).
    if source == Source::Incoming {
        net.addresses.learn(peer, remote, Source::Incoming);
    }
    net.addresses.worked(peer, remote);
    net.link_addrs.send_modify(|l| {
        l.insert(peer, remote);
    });
    Some(link)
}

/// Publishes the devices with a live connection (see [`Net::links`]).
fn publish_links(net: &Net, peers: &Peers) {
    let now: Links = peers
        .links
        .keys()
        .map(|d| {
            (
                d.short(),
                peers.exchanged.get(d).cloned().unwrap_or_default(),
            )
        })
        .collect();
    net.links.send_if_modified(|l| {
        let changed = *l != now;
        *l = now;
        changed
    });
}

fn unregister(net: &Net, peer: &DeviceId, serial: u64) {
    if let Ok(mut peers) = net.peers.lock() {
        if is_current(&peers, peer, serial) {
            peers.links.remove(peer);
            peers.sync.retain(|(p, _), _| p != peer);
            peers.exchanged.remove(peer);
            peers.partial.remove(peer);
            peers.last_seen.insert(*peer, std::time::SystemTime::now());
            publish_links(net, &peers);
            net.link_addrs
                .send_if_modified(|l| l.remove(peer).is_some());
        }
    }
    net.peer_changed.notify_waiters();
}

/// Accepts incoming connections forever.
pub async fn accept_loop(net: Arc<Net>, endpoint: quinn::Endpoint) {
    while let Some(incoming) = endpoint.accept().await {
        let net = net.clone();
        let endpoint = endpoint.clone();
        tokio::spawn(async move {
            match transport::accept_peer(&endpoint, incoming).await {
                Ok(est) => {
                    let peer = est.peer;
                    if let Some(link) = register(&net, est, peer, Source::Incoming) {
                        run_link(net, peer, link).await;
                    }
                }
                Err(e) => tracing::debug!(error = %e, "incoming connection failed"),
            }
        });
    }
}

/// Lanes being bound at once (TLS and binding, at most `transport::LANE_HELLO_TIMEOUT` each):
/// anyone can open TCP connections, and one more is closed at once.
const LANES_BINDING: usize = 32;
/// Bound lanes served to one device at once, each with a blocking reader while it answers a
/// request: a device has one per connection, two for a moment when a connection replaces
/// another. One more is closed.
const LANES_PER_DEVICE: usize = 4;

/// Accepts bulk lanes (`transport::lane`, D105) on `listener` and serves each bound one's chunk
/// requests until the daemon stops.
pub async fn lane_accept_loop(
    net: Arc<Net>,
    listener: tokio::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
) {
    let binding = Arc::new(tokio::sync::Semaphore::new(LANES_BINDING));
    let served = transport::DeviceSlots::new(LANES_PER_DEVICE);
    let mut stopping = net.stopping.subscribe();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stopping.wait_for(|s| *s) => return,
        };
        let (tcp, from) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of descriptors, most likely: wait rather than spin.
                tracing::warn!(error = %e, "cannot accept a bulk lane");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(permit) = binding.clone().try_acquire_owned() else {
            continue;
        };
        let (net, acceptor, served) = (net.clone(), acceptor.clone(), served.clone());
        tokio::spawn(async move {
            let links = |d: &DeviceId| net.link_to(d).into_iter().collect();
            let bound = transport::accept_lane(&acceptor, tcp, links).await;
            drop(permit);
            let (peer, conn, stream) = match bound {
                Ok(b) => b,
                Err(e) => {
                    tracing::debug!(%from, error = %e, "bulk lane not bound");
                    return;
                }
            };
            let Some(_slot) = served.enter(peer) else {
                tracing::warn!(peer = %peer.short(), "a bulk lane over {LANES_PER_DEVICE} of one device closed");
                return;
            };
            let shared = || net.shared_with(&peer);
            let lane = chunks::serve_lane(net.folders.clone(), peer, shared, conn, stream);
            if let Err(e) = lane.await {
                tracing::info!(peer = %peer.short(), error = %e, "bulk lane ended");
            }
        });
    }
}

/// The index a session sends, read through a connection that only reads ([`Folders::reader`]),
/// in one read transaction: a session of one folder never waits for another folder's apply or
/// scan holding the writer.
struct JournalSource<'a> {
    journal: Reader<'a>,
    folders: &'a Folders,
}

impl<'a> JournalSource<'a> {
    fn open(net: &'a Net) -> Result<Self, String> {
        let mut journal = net
            .folders
            .reader()
            .map_err(|e| format!("cannot read the journal: {e}"))?;
        journal.begin_reads();
        Ok(JournalSource {
            journal,
            folders: &net.folders,
        })
    }
}

impl IndexSource for JournalSource<'_> {
    fn records_since(
        &mut self,
        folder: &FolderId,
        peer: &DeviceId,
        after: u64,
        limit: usize,
    ) -> Result<(Vec<FileRecord>, u64), ReadError> {
        let max = self.max_sequence(folder)?;
        let rows = self
            .journal
            .records_since(folder, after, limit)
            .map_err(ReadError::from_display)?;
        let scanned = if rows.len() < limit {
            max
        } else {
            rows.last().map_or(max, |r| r.record.sequence)
        };
        let role = self
            .folders
            .get(folder)
            .map(|rt| rt.role())
            .unwrap_or_default();
        let recs = rows
            .into_iter()
            .filter(|r| {
                r.source.as_ref() != Some(peer)
                    && meshfs_sync::role::sends(role, r.source.is_none())
            })
            .map(|r| r.record)
            .collect();
        Ok((recs, scanned.max(after)))
    }

    fn max_sequence(&mut self, folder: &FolderId) -> Result<u64, ReadError> {
        self.journal
            .folder_state(folder)
            .map(|s| s.map_or(0, |s| s.max_sequence))
            .map_err(ReadError::from_display)
    }
}

enum LinkEvent {
    Message(Message),
    Closed(String),
    Applied(FolderId, u64),
    ApplyFailed(FolderId, apply::ApplyError),
}

/// Runs the session of one connection until it closes.
pub(crate) async fn run_link(net: Arc<Net>, peer: DeviceId, link: PeerLink) {
    let conn = link.conn.clone();
    // Crossed dials open two connections and keep one: the user hears of the peer once.
    let first = net.peers.lock().is_ok_and(|mut p| p.announced.insert(peer));
    if first {
        tracing::info!(peer = %peer.short(), addr = %conn.remote_address(), "peer connected");
    } else {
        tracing::debug!(peer = %peer.short(), addr = %conn.remote_address(), "another connection to a connected peer");
    }
    net.peer_changed.notify_waiters();
    let serial = link.serial;
    // The session's batches, in every folder's receive pipeline.
    let source = apply::Receiver::new_source();
    let mut points = ResumePoints::new(peer);
    let result = drive_session(&net, peer, &link, source, &mut points).await;
    points.save(&net.folders);
    tracing::debug!(peer = %peer.short(), writes = points.writes(), "resume points written");
    for receiver in net.all_receivers() {
        receiver.gone(source);
    }
    // Read before closing: a local close replaces the reason.
    let closed_as_duplicate = conn
        .close_reason()
        .is_some_and(|e| transport::closed_as_duplicate(&e));
    conn.close(transport::CLOSE_STOPPING, b"session ended");
    unregister(&net, &peer, serial);
    // Another connection to the peer is live, or the peer closed this one as the duplicate of
    // one it keeps: this one lost a crossed dial (or was replaced by a newer one), and the peer
    // is still connected.
    let superseded = closed_as_duplicate
        || net
            .peers
            .lock()
            .is_ok_and(|p| p.links.get(&peer).is_some_and(|l| l.serial != serial));
    if superseded {
        tracing::debug!(peer = %peer.short(), reason = ?result.err(), "duplicate connection closed; the other one stays");
        return;
    }
    if let Ok(mut p) = net.peers.lock() {
        p.announced.remove(&peer);
    }
    if let Err(reason) = &result {
        tracing::info!(peer = %peer.short(), %reason, "session ended");
    }
    let s = transport::link_stats(&conn);
    tracing::info!(peer = %peer.short(), sent = s.bytes_sent, received = s.bytes_received,
        lost_packets = s.lost_packets, congestion_events = s.congestion_events,
        rtt_us = s.rtt.as_micros() as u64, "peer disconnected");
}

fn session_folders(net: &Net, peer: &DeviceId) -> Vec<SessionFolder> {
    let shared = net.shared_with(peer);
    let Ok(mut j) = net.folders.journal_lock() else {
        return Vec::new();
    };
    shared
        .into_iter()
        .filter_map(|folder| {
            let st = j.folder(&folder).ok()?;
            let pr = j.peer_progress(&folder, peer).ok()?;
            let rt = net.folders.get(&folder);
            let scanning = rt
                .as_ref()
                .is_some_and(|rt| rt.scanning.load(std::sync::atomic::Ordering::Relaxed));
            let partial = rt.as_ref().is_some_and(|rt| rt.policy().on_demand);
            Some(SessionFolder {
                folder,
                index_id: st.index_id,
                their_index_id: pr.their_index_id,
                their_sequence: pr.their_sequence,
                our_acked: pr.our_acked,
                scanning,
                partial,
            })
        })
        .collect()
}

async fn drive_session(
    net: &Arc<Net>,
    peer: DeviceId,
    link: &PeerLink,
    source: apply::Source,
    points: &mut ResumePoints,
) -> Result<(), String> {
    let conn = &link.conn;
    let (send, recv) = if link.dialer == net.folders.device {
        conn.open_bi().await.map_err(|e| e.to_string())?
    } else {
        conn.accept_bi().await.map_err(|e| e.to_string())?
    };
    let (tx, mut rx) = mpsc::unbounded_channel::<LinkEvent>();
    // The peer's messages, one at a time: the next is read only once the session takes it
    // (below, while it holds less than its budget of batches), so what the peer sends beyond
    // waits in its flow control, not here.
    let (msgs_tx, mut msgs) = mpsc::channel::<LinkEvent>(1);
    tokio::spawn(control_reader(recv, msgs_tx));
    // Control stream writer: messages leave in order; an index batch first gets its small new
    // files' content attached, read on a blocking thread so this loop goes on meanwhile.
    let (out, writer) = control_writer(net.clone(), send, tx.clone());
    tokio::spawn(serve_requests(net.clone(), peer, conn.clone()));
    // This device's bulk lane for its large fetches from the peer, while the session runs.
    let _lane = crate::bulk::register(&net.endpoint, conn, peer);
    let mut session = Session::with_device(
        net.name(),
        net.folders.device,
        peer,
        session_folders(net, &peer),
    );
    let mut changes = net.folders.changes.subscribe();
    let mut links = net.links.subscribe();
    let mut seeking = net.seeking.subscribe();
    let mut link_addrs = net.link_addrs.subscribe();
    // Said once the hellos are through.
    let _ = session.seek(seeking.borrow_and_update().clone());
    link_addrs.borrow_and_update();
    // Nothing to send yet (the hellos are not exchanged): the session says it after them.
    let linked = links_by_folder(net, &peer, &links.borrow_and_update());
    let _ = session.connected_peers(linked);
    let first = {
        let mut src = JournalSource::open(net)?;
        let mut first = session.start(&mut src);
        // A first scan that moved on (or ended) between reading it for the session and
        // subscribing to the changes was not announced on the channel.
        for f in net.shared_with(&peer) {
            if let Some((scanning, counts)) = our_scan(net, &f) {
                first.extend(session.scan_progress(&f, scanning, counts, &mut src));
            }
        }
        first
    };
    let mut pending = first;
    // What the folders' receive pipelines say of this session's batches.
    let (replies_tx, mut replies) = mpsc::unbounded_channel::<apply::Reply>();
    let mut exchanged_told = false;
    loop {
        let mut queue: std::collections::VecDeque<Action> = std::mem::take(&mut pending).into();
        while let Some(action) = queue.pop_front() {
            match action {
                Action::Send(m) => {
                    let inline = match &m {
                        Message::Index(b) => Inline {
                            after: session.inline_after(&b.folder),
                            relayed: relayed_content(
                                &session,
                                &b.folder,
                                &b.records,
                                &net.folders.device,
                            ),
                        },
                        _ => Inline::none(),
                    };
                    if !out.push(m, inline) {
                        return Err("control stream writer stopped".to_string());
                    }
                }
                Action::Receive {
                    folder,
                    records,
                    up_to,
                    inline,
                } => {
                    let Some(receiver) = net.receiver(&folder) else {
                        return Err(format!("apply failed: folder {folder} is not running here"));
                    };
                    receiver.receive(
                        source,
                        peer,
                        conn.clone(),
                        records,
                        inline,
                        Some(up_to),
                        replies_tx.clone(),
                    );
                }
                Action::Close { reason } => return Err(reason),
                Action::Sought { devices } => {
                    let known = link_addrs.borrow().clone();
                    for d in devices {
                        queue.extend(tell_address(&mut session, d, &known));
                    }
                }
                Action::Learned(list) => net.learned_from(&peer, list),
                Action::SaveTheirSequence {
                    folder,
                    index_id,
                    sequence,
                } => points.note(folder, index_id, sequence),
                Action::SaveOurAcked { folder, sequence } => {
                    save_our_acked(net, &peer, &folder, sequence)
                }
            }
        }
        points.save_if_due(&net.folders);
        let save_at = points.due();
        publish_status(net, peer, link.serial, &session);
        // The folders both hellos listed are known once, when the hellos are through.
        if !exchanged_told && session.is_established() {
            publish_exchanged(
                net,
                &peer,
                link.serial,
                session.shared_folders(),
                session.partial_folders(),
            );
            exchanged_told = true;
        }
        tokio::select! {
            ev = msgs.recv(), if session.wants_messages() => {
                let Some(ev) = ev else { return Err("link closed".into()) };
                pending = on_event(net, peer, &mut session, ev)?;
            }
            ev = rx.recv() => {
                let Some(ev) = ev else { return Err("link closed".into()) };
                pending = on_event(net, peer, &mut session, ev)?;
            }
            _ = tokio::time::sleep_until(save_at.unwrap_or_else(tokio::time::Instant::now)), if save_at.is_some() => {}
            Some(reply) = replies.recv() => {
                let ev = match reply {
                    apply::Reply::Applied { folder, up_to } => {
                        LinkEvent::Applied(folder, up_to.unwrap_or_default())
                    }
                    apply::Reply::Failed { folder, error } => LinkEvent::ApplyFailed(folder, error),
                };
                pending = on_event(net, peer, &mut session, ev)?;
            }
            ch = changes.recv() => {
                let folders: Vec<FolderId> = match ch {
                    Ok(f) => vec![f],
                    Err(_) => net.shared_with(&peer),
                };
                let mut src = JournalSource::open(net)?;
                for f in folders {
                    pending.extend(session.local_changed(&f, &mut src));
                    if let Some((scanning, counts)) = our_scan(net, &f) {
                        pending.extend(session.scan_progress(&f, scanning, counts, &mut src));
                    }
                }
            }
            Ok(()) = links.changed() => {
                let linked = links_by_folder(net, &peer, &links.borrow_and_update());
                pending = session.connected_peers(linked);
            }
            Ok(()) = seeking.changed() => {
                pending = session.seek(seeking.borrow_and_update().clone());
            }
            Ok(()) = link_addrs.changed() => {
                let known = link_addrs.borrow_and_update().clone();
                for d in session.sought_by_peer() {
                    pending.extend(tell_address(&mut session, d, &known));
                }
            }
            _ = net.shutdown.notified() => {
                let bye = Message::Error { code: ErrorCode::Shutdown, message: "daemon stopping".into() };
                out.push(bye, Inline::none());
                drop(out);
                let _ = tokio::time::timeout(Duration::from_secs(1), writer).await;
                return Err("shutdown".into());
            }
        }
    }
}

/// What the session tells its peer of where `device` is: the address of this device's
/// connection to it, if any and if another device could dial it.
fn tell_address(
    session: &mut Session,
    device: DeviceId,
    known: &BTreeMap<DeviceId, SocketAddr>,
) -> Vec<Action> {
    match known.get(&device) {
        Some(a) if discovery::shareable(a) => {
            session.tell_addresses(device, vec![WireAddr::from_socket_addr(*a)])
        }
        _ => Vec::new(),
    }
}

/// Our first scan of `folder`: whether it still runs, and how far it got.
fn our_scan(net: &Net, folder: &FolderId) -> Option<(bool, ScanCounts)> {
    let rt = net.folders.get(folder)?;
    // The flag first: once it is down, the counts are the scan's totals.
    let scanning = rt.scanning.load(std::sync::atomic::Ordering::Relaxed);
    let c = rt.first_scan.counts();
    Some((
        scanning,
        ScanCounts {
            files_hashed: c.done,
            bytes_hashed: c.bytes_done,
            files_left: c.left,
        },
    ))
}

/// Stores that the peer acknowledged this device's records of `folder` up to `sequence`. At
/// most once per batch this device sent: the peer cannot acknowledge more than it was sent.
/// (The peer's own progress here goes through [`ResumePoints`], at most once a second.)
fn save_our_acked(net: &Net, peer: &DeviceId, folder: &FolderId, sequence: u64) {
    let Ok(mut j) = net.folders.journal_lock() else {
        return;
    };
    if let Err(e) = j.set_our_acked(folder, peer, sequence) {
        tracing::error!(%folder, error = %e, "cannot save peer progress");
    }
}

/// Hands one event of the link to the session; returns what it asks for next.
fn on_event(
    net: &Net,
    peer: DeviceId,
    session: &mut Session,
    ev: LinkEvent,
) -> Result<Vec<Action>, String> {
    match ev {
        LinkEvent::Message(m) => {
            if let Message::Error { code, message } = &m {
                tracing::warn!(peer = %peer.short(), ?code, %message, "peer reported an error");
                if *code != ErrorCode::Shutdown {
                    net.peer_error(peer, format_args!("the peer reported {code:?}: {message}"));
                }
            }
            Ok(session.handle(m, &mut JournalSource::open(net)?))
        }
        LinkEvent::Applied(folder, up_to) => {
            if net.folders.get(&folder).is_some_and(|rt| rt.unblock()) {
                tracing::info!(%folder, "the disk has room again; receiving resumed");
            }
            net.folders.changes_notify(&folder);
            Ok(session.applied(&folder, up_to))
        }
        LinkEvent::ApplyFailed(folder, e) => {
            let what = format!("applying its changes to folder {folder} failed: {e}");
            net.peer_error(peer, &what);
            if let Some(rt) = net.folders.get(&folder) {
                rt.last_error.set(what);
            }
            if !e.is_disk_full() {
                tracing::error!(peer = %peer.short(), %folder, error = %e, "applying remote changes failed; will retry after reconnecting");
            }
            Err(format!("apply failed: {e}"))
        }
        LinkEvent::Closed(reason) => Err(reason),
    }
}

/// Reads the control stream into the session's events until it ends, a message at a time:
/// the next frame is read once the one before is taken.
async fn control_reader(mut recv: quinn::RecvStream, tx: mpsc::Sender<LinkEvent>) {
    loop {
        let ev = match transport::read_message(&mut recv).await {
            Ok(Some(m)) => LinkEvent::Message(m),
            Ok(None) => LinkEvent::Closed("control stream ended".into()),
            Err(e) => LinkEvent::Closed(e.to_string()),
        };
        let last = !matches!(ev, LinkEvent::Message(_));
        if tx.send(ev).await.is_err() || last {
            return;
        }
    }
}

/// Serves the peer's chunk request streams until the connection ends.
async fn serve_requests(net: Arc<Net>, peer: DeviceId, conn: quinn::Connection) {
    // A peer gets at most this many requests served at once, each with one blocking
    // reader: one that opens streams and stops reading cannot hold the blocking pool
    // that every apply, scan and status shares.
    let serving = Arc::new(tokio::sync::Semaphore::new(SERVED_AT_ONCE));
    while let Ok((s, r)) = conn.accept_bi().await {
        let net = net.clone();
        let Ok(permit) = serving.clone().acquire_owned().await else {
            return;
        };
        tokio::spawn(async move {
            let _permit = permit;
            let shared = net.shared_with(&peer);
            if let Err(e) = chunks::serve_request(&net.folders, peer, &shared, s, r).await {
                tracing::warn!(peer = %peer.short(), error = %e, "refused a chunk request");
            }
        });
    }
}

/// Messages for the control stream, each with what of its records' content may ride inline.
type Outgoing = Outbox<Inline>;

/// The authors of `records` (of `folder`) other than this device whose versions the peer gets
/// from them directly.
fn relayed_content(
    session: &Session,
    folder: &FolderId,
    records: &[FileRecord],
    me: &DeviceId,
) -> HashSet<ShortId> {
    let me = me.short();
    records
        .iter()
        .map(|r| r.modified_by)
        .filter(|&by| by != me && session.peer_hears(folder, by))
        .collect()
}

/// Per folder shared with `peer`, the other connected devices whose sessions exchange it too.
fn links_by_folder(net: &Net, peer: &DeviceId, linked: &Links) -> Vec<(FolderId, Vec<ShortId>)> {
    others_by_folder(peer.short(), net.shared_with(peer), linked)
}

/// Per folder of `folders`, the devices of `linked` but `peer` that exchange it. Not this
/// device's config: a device it lists for a folder whose own config does not share it back
/// exchanges nothing of it, and the peer will not hear of that folder's versions from there.
fn others_by_folder(
    peer: ShortId,
    folders: Vec<FolderId>,
    linked: &Links,
) -> Vec<(FolderId, Vec<ShortId>)> {
    folders
        .into_iter()
        .map(|folder| {
            let others = linked
                .iter()
                .filter(|(d, exchanged)| **d != peer && exchanged.contains(&folder))
                .map(|(d, _)| *d)
                .collect();
            (folder, others)
        })
        .collect()
}

/// Records the folders `peer`'s session exchanges (once its hellos are through), for the other
/// sessions' `Peers` lists, and those it keeps only in part; a no-op if they are unchanged or
/// the link is gone.
fn publish_exchanged(
    net: &Net,
    peer: &DeviceId,
    serial: u64,
    exchanged: BTreeSet<FolderId>,
    partial: BTreeSet<FolderId>,
) {
    let Ok(mut peers) = net.peers.lock() else {
        return;
    };
    if !is_current(&peers, peer, serial) {
        return;
    }
    peers.partial.insert(*peer, partial);
    if peers.exchanged.get(peer) == Some(&exchanged) {
        return;
    }
    peers.exchanged.insert(*peer, exchanged);
    publish_links(net, &peers);
}

/// Starts the task that owns the control stream's send side (see `drive_session`). A write
/// error ends the session through `events`. Its queue ([`crate::outbox`]) keeps one of each
/// message that only states the latest (an acknowledgement of a folder …): a peer that reads
/// nothing makes it hold no more than that, however many batches it sends.
fn control_writer(
    net: Arc<Net>,
    mut send: quinn::SendStream,
    events: mpsc::UnboundedSender<LinkEvent>,
) -> (Outgoing, tokio::task::JoinHandle<()>) {
    let (out, queue) = outbox::<Inline>();
    let task = tokio::spawn(async move {
        while let Some((mut msg, inline)) = queue.next().await {
            if let Message::Index(batch) = msg {
                let net = net.clone();
                let t0 = std::time::Instant::now();
                let attached = tokio::task::spawn_blocking(move || {
                    let mut batch = batch;
                    chunks::attach_inline(&net.folders, &mut batch, &inline);
                    batch
                })
                .await;
                if let Ok(b) = &attached {
                    tracing::debug!(folder = %b.folder, records = b.records.len(), inline = b.inline.len(),
                        up_to = b.up_to, attach_ms = t0.elapsed().as_millis() as u64, "index batch sent");
                }
                msg = match attached {
                    Ok(b) => Message::Index(b),
                    Err(e) => {
                        let _ = events.send(LinkEvent::Closed(e.to_string()));
                        return;
                    }
                };
            }
            if let Err(e) = transport::write_message(&mut send, &msg).await {
                let _ = events.send(LinkEvent::Closed(e.to_string()));
                return;
            }
        }
    });
    (out, task)
}

/// Whether the connection numbered `serial` is `peer`'s current one.
fn is_current(peers: &Peers, peer: &DeviceId, serial: u64) -> bool {
    peers.links.get(peer).is_some_and(|l| l.serial == serial)
}

/// Publishes what the session of connection `serial` says of each folder, unless that
/// connection is no longer the peer's current one: a crossed dial's losing session, still
/// running for a moment, would otherwise overwrite the winner's word, and a winner with nothing
/// more to say (two empty folders in sync) would never correct it.
fn publish_status(net: &Net, peer: DeviceId, serial: u64, session: &Session) {
    let folders = net.shared_with(&peer);
    if let Ok(mut p) = net.peers.lock() {
        if !is_current(&p, &peer, serial) {
            return;
        }
        for f in folders {
            if let Some(s) = session.folder_status(&f) {
                p.sync.insert((peer, f), s);
            }
        }
    }
    net.peer_changed.notify_waiters();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn folder(s: &str) -> FolderId {
        FolderId::new(s).unwrap()
    }

    #[test]
    fn a_peer_is_told_only_of_devices_whose_sessions_exchange_the_folder() {
        let (peer, b, c) = (ShortId(1), ShortId(2), ShortId(3));
        let linked: Links = [
            (peer, BTreeSet::from([folder("docs"), folder("music")])),
            // Connected, and its hello listed "docs" only: this device's config may say it
            // shares "music" with it too, but that device does not share it back.
            (b, BTreeSet::from([folder("docs")])),
            // Connected, hellos not through yet.
            (c, BTreeSet::new()),
        ]
        .into();
        let got = others_by_folder(peer, vec![folder("docs"), folder("music")], &linked);
        assert_eq!(
            got,
            vec![(folder("docs"), vec![b]), (folder("music"), vec![])]
        );
    }
}
