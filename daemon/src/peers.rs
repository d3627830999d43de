//! Peer connections: dialing with backoff, accepting, keeping exactly one connection per peer,
//! driving a [`Session`] over it, and serving and fetching chunks on request streams.
//!
//! **One connection per peer pair.** When both sides dial at once, each ends up holding two
//! connections; both keep the one dialed by the larger device id and close the other, so the
//! choice is the same on both ends without another round trip and no dial waits on a timer.
//!
//! The session logic (what to send, when a folder is in sync) lives in [`crate::session`]; this
//! module only moves its messages and runs the applies it asks for.

use crate::apply;
use crate::engine::Engine;
use crate::journal::{Journal, Op};
use crate::session::{Action, FolderSyncStatus, IndexSource, Session, SessionFolder};
use crate::store::DirCache;
use crate::transport::{self, LinkStats};
use meshfs_protocol::{
    ChunkRequest, ChunkResponse, DeviceId, ErrorCode, FileKind, FileRecord, FolderId, Hash,
    IndexBatch, Message,
};
use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, Notify};

/// Most hashes in one chunk request.
const REQUEST_HASHES: usize = meshfs_protocol::MAX_HASHES_PER_REQUEST;
/// Most bytes asked for in one chunk request.
const REQUEST_BYTES: u64 = 4 << 20;
/// Chunk requests in flight per fetch.
const REQUESTS_IN_FLIGHT: usize = 24;

/// Chunk requests served to one peer at once (each holds a blocking reader thread).
const SERVED_AT_ONCE: usize = 32;
/// Most hashes a peer may ask for in one chunk request (the decoder refuses more already).
const MAX_REQUEST_HASHES: usize = meshfs_protocol::MAX_HASHES_PER_REQUEST;
/// How long one response may wait for the requester to take it.
const RESPONSE_WRITE_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a redial (after a failed dial) waits for the handshake before starting over.
const RETRY_ATTEMPT: Duration = Duration::from_millis(1500);

/// Largest file whose content rides inside the index batch that announces it.
pub const INLINE_FILE_BYTES: u64 = 64 << 10;
/// Most inline bytes (as sent, after compression) in one index batch: with the records'
/// 2 MiB this stays well under the frame limit.
pub const INLINE_BATCH_BYTES: usize = 8 << 20;

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
}

/// What the engine knows about each peer's connection and sessions.
#[derive(Default)]
pub struct Peers {
    links: HashMap<DeviceId, PeerLink>,
    /// Per (peer, folder) sync status, as the session last reported it.
    pub sync: HashMap<(DeviceId, FolderId), FolderSyncStatus>,
    /// Bytes moved by connections that have closed.
    pub closed_sent: u64,
    /// Bytes received by connections that have closed.
    pub closed_received: u64,
    /// When each peer was last connected.
    pub last_seen: HashMap<DeviceId, std::time::SystemTime>,
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

    /// Stats of every live connection, summed, plus closed ones.
    pub fn totals(&self) -> (u64, u64) {
        let mut sent = self.closed_sent;
        let mut recv = self.closed_received;
        for l in self.links.values() {
            let s = transport::link_stats(&l.conn);
            sent += s.bytes_sent;
            recv += s.bytes_received;
        }
        (sent, recv)
    }

    /// Link stats of one peer.
    pub fn stats(&self, peer: &DeviceId) -> Option<LinkStats> {
        self.links.get(peer).map(|l| transport::link_stats(&l.conn))
    }
}

/// Registers a new connection, resolving duplicates. Returns the link to run a session on, or
/// `None` when the new connection lost to an existing one (it is closed).
fn register(engine: &Engine, est: transport::Established, dialer: DeviceId) -> Option<PeerLink> {
    let transport::Established {
        conn,
        peer,
        instance,
    } = est;
    // A stopping daemon starts no session: the peer would only see it end at once and redial.
    if *engine.stopping.borrow() {
        conn.close(0u32.into(), b"daemon stopping");
        return None;
    }
    let mut peers = engine.peers.lock().ok()?;
    peers.serial += 1;
    let serial = peers.serial;
    let preferred = engine.device.max(peer);
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
        let s = transport::link_stats(&old.conn);
        peers.closed_sent += s.bytes_sent;
        peers.closed_received += s.bytes_received;
        old.conn
            .close(transport::CLOSE_DUPLICATE, b"duplicate connection");
    }
    let link = PeerLink {
        conn,
        dialer,
        since: Instant::now(),
        serial,
        instance,
    };
    peers.links.insert(peer, link.clone());
    peers.last_seen.insert(peer, std::time::SystemTime::now());
    Some(link)
}

fn unregister(engine: &Engine, peer: &DeviceId, serial: u64) {
    if let Ok(mut peers) = engine.peers.lock() {
        if peers.links.get(peer).is_some_and(|l| l.serial == serial) {
            if let Some(old) = peers.links.remove(peer) {
                let s = transport::link_stats(&old.conn);
                peers.closed_sent += s.bytes_sent;
                peers.closed_received += s.bytes_received;
            }
            peers.sync.retain(|(p, _), _| p != peer);
            peers.last_seen.insert(*peer, std::time::SystemTime::now());
        }
    }
    engine.peer_changed.notify_waiters();
}

/// Accepts incoming connections forever.
pub async fn accept_loop(engine: Arc<Engine>, endpoint: quinn::Endpoint) {
    while let Some(incoming) = endpoint.accept().await {
        let engine = engine.clone();
        tokio::spawn(async move {
            match transport::accept_peer(incoming).await {
                Ok(est) => {
                    let peer = est.peer;
                    if let Some(link) = register(&engine, est, peer) {
                        run_link(engine, peer, link).await;
                    }
                }
                Err(e) => tracing::debug!(error = %e, "incoming connection failed"),
            }
        });
    }
}

/// Keeps a connection to `peer` (at `addr`) up: dials when there is none, with backoff.
pub async fn dial_loop(engine: Arc<Engine>, peer: DeviceId, addr: String, stop: Arc<Notify>) {
    let mut backoff = Duration::from_millis(100);
    let max = Duration::from_secs(engine.options().max_redial_secs.max(1));
    let mut retrying = false;
    loop {
        if *engine.stopping.borrow() {
            return;
        }
        let connected = engine
            .peers
            .lock()
            .map(|p| p.links.contains_key(&peer))
            .unwrap_or(false);
        if connected {
            backoff = Duration::from_millis(100);
            retrying = false;
            tokio::select! {
                _ = engine.peer_changed.notified() => continue,
                _ = stop.notified() => return,
                _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
            }
        }
        // After a failure the peer is likely unreachable for now (an outage, a laptop asleep):
        // attempts are cut short, so a handshake started into a dead path does not hold the
        // next one back once the path returns (QUIC backs its Initial retransmissions off).
        let attempt = async {
            match resolve(&addr).await {
                Some(sa) if retrying => {
                    match tokio::time::timeout(
                        RETRY_ATTEMPT,
                        transport::dial_peer(&engine.endpoint, sa, peer),
                    )
                    .await
                    {
                        Ok(r) => Some(r),
                        Err(_) => Some(Err(transport::TransportError::Connect {
                            addr: sa,
                            reason: "no answer yet".into(),
                        })),
                    }
                }
                Some(sa) => Some(transport::dial_peer(&engine.endpoint, sa, peer).await),
                None => None,
            }
        };
        match attempt.await {
            Some(r) => match r {
                Ok(est) => {
                    if let Some(link) = register(&engine, est, engine.device) {
                        let e = engine.clone();
                        tokio::spawn(run_link(e, peer, link));
                    }
                    continue;
                }
                // Both dialed at once and the peer kept its own connection: nothing failed.
                Err(e @ transport::TransportError::Duplicate { .. }) => {
                    tracing::debug!(peer = %peer.short(), %addr, reason = %e, "crossed dial")
                }
                Err(e) => {
                    if !retrying {
                        tracing::info!(peer = %peer.short(), %addr, error = %e, "dial failed; retrying")
                    } else {
                        tracing::debug!(peer = %peer.short(), %addr, error = %e, "dial failed; retrying")
                    }
                }
            },
            None => tracing::warn!(peer = %peer.short(), %addr, "cannot resolve peer address"),
        }
        retrying = true;
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = stop.notified() => return,
        }
        backoff = (backoff * 2).min(max);
    }
}

async fn resolve(addr: &str) -> Option<SocketAddr> {
    if let Ok(sa) = addr.parse() {
        return Some(sa);
    }
    tokio::net::lookup_host(addr).await.ok()?.next()
}

/// The journal as the session's source of records to send.
struct JournalSource<'a> {
    journal: &'a mut Journal,
}

impl IndexSource for JournalSource<'_> {
    fn records_since(
        &mut self,
        folder: &FolderId,
        peer: &DeviceId,
        after: u64,
        limit: usize,
    ) -> (Vec<FileRecord>, u64) {
        let max = self.max_sequence(folder);
        match self.journal.records_since(folder, after, limit) {
            Ok(rows) => {
                let scanned = if rows.len() < limit {
                    max
                } else {
                    rows.last().map_or(max, |r| r.record.sequence)
                };
                let recs = rows
                    .into_iter()
                    .filter(|r| r.source.as_ref() != Some(peer))
                    .map(|r| r.record)
                    .collect();
                (recs, scanned.max(after))
            }
            Err(e) => {
                tracing::error!(%folder, error = %e, "journal read failed");
                (Vec::new(), after)
            }
        }
    }

    fn max_sequence(&mut self, folder: &FolderId) -> u64 {
        self.journal
            .folder(folder)
            .map(|s| s.max_sequence)
            .unwrap_or(0)
    }
}

enum LinkEvent {
    Message(Message),
    Closed(String),
    Applied(FolderId, u64),
    ApplyFailed(FolderId, String),
}

/// Runs the session of one connection until it closes.
async fn run_link(engine: Arc<Engine>, peer: DeviceId, link: PeerLink) {
    let conn = link.conn.clone();
    // Crossed dials open two connections and keep one: the user hears of the peer once.
    let first = engine
        .peers
        .lock()
        .is_ok_and(|mut p| p.announced.insert(peer));
    if first {
        tracing::info!(peer = %peer.short(), addr = %conn.remote_address(), "peer connected");
    } else {
        tracing::debug!(peer = %peer.short(), addr = %conn.remote_address(), "another connection to a connected peer");
    }
    engine.peer_changed.notify_waiters();
    let serial = link.serial;
    let result = drive_session(&engine, peer, &link).await;
    // Read before closing: a local close replaces the reason.
    let closed_as_duplicate = conn
        .close_reason()
        .is_some_and(|e| transport::closed_as_duplicate(&e));
    conn.close(0u32.into(), b"session ended");
    unregister(&engine, &peer, serial);
    // Another connection to the peer is live, or the peer closed this one as the duplicate of
    // one it keeps: this one lost a crossed dial (or was replaced by a newer one), and the peer
    // is still connected.
    let superseded = closed_as_duplicate
        || engine
            .peers
            .lock()
            .is_ok_and(|p| p.links.get(&peer).is_some_and(|l| l.serial != serial));
    if superseded {
        tracing::debug!(peer = %peer.short(), reason = ?result.err(), "duplicate connection closed; the other one stays");
        return;
    }
    if let Ok(mut p) = engine.peers.lock() {
        p.announced.remove(&peer);
    }
    if let Err(reason) = &result {
        tracing::info!(peer = %peer.short(), %reason, "session ended");
    }
    tracing::info!(peer = %peer.short(), "peer disconnected");
}

/// Whether an apply failed because the disk (or the user's quota) is full.
fn is_disk_full(error: &str) -> bool {
    // The store's IO errors carry the OS error; ENOSPC is 28, EDQUOT 122 on Linux.
    error.contains("(os error 28)") || error.contains("(os error 122)")
}

/// Waits until the filesystem of `path` has more free room than now (checked every second),
/// or a minute at most.
async fn wait_for_room(path: &std::path::Path) {
    let start = crate::store::free_bytes(path).unwrap_or(0);
    for _ in 0..60 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        if crate::store::free_bytes(path).is_some_and(|f| f > start.saturating_add(1 << 20)) {
            return;
        }
    }
}

fn session_folders(engine: &Engine, peer: &DeviceId) -> Vec<SessionFolder> {
    let shared = engine.shared_with(peer);
    let Ok(mut j) = engine.journal.lock() else {
        return Vec::new();
    };
    shared
        .into_iter()
        .filter_map(|folder| {
            let st = j.folder(&folder).ok()?;
            let pr = j.peer_progress(&folder, peer).ok()?;
            let scanning = engine
                .folder(&folder)
                .is_some_and(|rt| rt.scanning.load(std::sync::atomic::Ordering::Relaxed));
            Some(SessionFolder {
                folder,
                index_id: st.index_id,
                their_index_id: pr.their_index_id,
                their_sequence: pr.their_sequence,
                our_acked: pr.our_acked,
                scanning,
            })
        })
        .collect()
}

async fn drive_session(
    engine: &Arc<Engine>,
    peer: DeviceId,
    link: &PeerLink,
) -> Result<(), String> {
    let conn = &link.conn;
    let (send, recv) = if link.dialer == engine.device {
        conn.open_bi().await.map_err(|e| e.to_string())?
    } else {
        conn.accept_bi().await.map_err(|e| e.to_string())?
    };
    let (tx, mut rx) = mpsc::unbounded_channel::<LinkEvent>();
    // Control stream reader.
    {
        let tx = tx.clone();
        let mut recv = recv;
        tokio::spawn(async move {
            loop {
                match transport::read_message(&mut recv).await {
                    Ok(Some(m)) => {
                        if tx.send(LinkEvent::Message(m)).is_err() {
                            return;
                        }
                    }
                    Ok(None) => {
                        let _ = tx.send(LinkEvent::Closed("control stream ended".into()));
                        return;
                    }
                    Err(e) => {
                        let _ = tx.send(LinkEvent::Closed(e.to_string()));
                        return;
                    }
                }
            }
        });
    }
    // Control stream writer: messages leave in order; an index batch first gets its small new
    // files' content attached, read on a blocking thread so this loop goes on meanwhile.
    let (out, writer) = control_writer(engine.clone(), send, tx.clone());
    // Request streams from the peer.
    {
        let engine = engine.clone();
        let conn = conn.clone();
        tokio::spawn(async move {
            // A peer gets at most this many requests served at once, each with one blocking
            // reader: one that opens streams and stops reading cannot hold the blocking pool
            // that every apply, scan and status shares.
            let serving = Arc::new(tokio::sync::Semaphore::new(SERVED_AT_ONCE));
            while let Ok((s, r)) = conn.accept_bi().await {
                let engine = engine.clone();
                let Ok(permit) = serving.clone().acquire_owned().await else {
                    return;
                };
                tokio::spawn(async move {
                    let _permit = permit;
                    if let Err(e) = serve_request(&engine, peer, s, r).await {
                        tracing::warn!(peer = %peer.short(), error = %e, "refused a chunk request");
                    }
                });
            }
        });
    }
    let mut session = Session::new(engine.name(), peer, session_folders(engine, &peer));
    let mut changes = engine.changes.subscribe();
    let first = {
        let mut j = engine.journal.lock().map_err(|_| "journal lock poisoned")?;
        session.start(&mut JournalSource { journal: &mut j })
    };
    let mut pending = first;
    // Per folder, what the next Receive waits on (the receive pipeline, `apply::Turn`).
    let mut pipeline: HashMap<FolderId, apply::Before> = HashMap::new();
    loop {
        for action in std::mem::take(&mut pending) {
            match action {
                Action::Send(m) => {
                    let after = match &m {
                        Message::Index(b) => session.inline_after(&b.folder),
                        _ => u64::MAX,
                    };
                    out.send((m, after))
                        .map_err(|_| "control stream writer stopped".to_string())?;
                }
                Action::Receive {
                    folder,
                    records,
                    up_to,
                    inline,
                } => {
                    tracing::debug!(%folder, records = records.len(), inline = inline.len(), up_to, "index batch received");
                    let inline = inline.into_iter().map(|c| (c.hash, c)).collect();
                    let (turn, next) = apply::Turn::after(pipeline.remove(&folder));
                    pipeline.insert(folder.clone(), next);
                    let engine = engine.clone();
                    let tx = tx.clone();
                    let conn = conn.clone();
                    tokio::spawn(async move {
                        let ev = match apply::receive(
                            &engine, &folder, peer, &conn, records, inline, turn,
                        )
                        .await
                        {
                            Ok(()) => LinkEvent::Applied(folder, up_to),
                            Err(e) => {
                                if let (true, Some(rt)) = (is_disk_full(&e), engine.folder(&folder))
                                {
                                    // The failed batch's temp files are gone and no user file
                                    // was touched. Say it once; the session keeps serving
                                    // meanwhile, and the batch is received again (at the
                                    // reconnect this failure causes) once the disk has more
                                    // room, or after a minute, instead of re-fetching into a
                                    // full disk over and over.
                                    if rt.block(format!("disk full: {e}")) {
                                        tracing::error!(%folder, error = %e, "the disk is full; receiving into this folder stopped until there is room (other folders and peers go on)");
                                    }
                                    wait_for_room(rt.store.root()).await;
                                }
                                LinkEvent::ApplyFailed(folder, e)
                            }
                        };
                        let _ = tx.send(ev);
                    });
                }
                Action::SaveTheirSequence {
                    folder,
                    index_id,
                    sequence,
                } => {
                    if let Ok(mut j) = engine.journal.lock() {
                        if let Err(e) = j.set_their_sequence(&folder, &peer, index_id, sequence) {
                            tracing::error!(%folder, error = %e, "cannot save peer progress");
                        }
                    }
                }
                Action::SaveOurAcked { folder, sequence } => {
                    if let Ok(mut j) = engine.journal.lock() {
                        if let Err(e) = j.set_our_acked(&folder, &peer, sequence) {
                            tracing::error!(%folder, error = %e, "cannot save peer progress");
                        }
                    }
                }
                Action::Close { reason } => return Err(reason),
            }
        }
        publish_status(engine, peer, &session);
        tokio::select! {
            ev = rx.recv() => {
                let Some(ev) = ev else { return Err("link closed".into()) };
                let mut j = engine.journal.lock().map_err(|_| "journal lock poisoned")?;
                let mut src = JournalSource { journal: &mut j };
                pending = match ev {
                    LinkEvent::Message(m) => {
                        if let Message::Error { code, message } = &m {
                            tracing::warn!(peer = %peer.short(), ?code, %message, "peer reported an error");
                        }
                        session.handle(m, &mut src)
                    }
                    LinkEvent::Applied(folder, up_to) => {
                        drop(j);
                        if engine.folder(&folder).is_some_and(|rt| rt.unblock()) {
                            tracing::info!(%folder, "the disk has room again; receiving resumed");
                        }
                        engine.changes_notify(&folder);
                        session.applied(&folder, up_to)
                    }
                    LinkEvent::ApplyFailed(folder, e) => {
                        if !is_disk_full(&e) {
                            tracing::error!(peer = %peer.short(), %folder, error = %e, "applying remote changes failed; will retry after reconnecting");
                        }
                        return Err(format!("apply failed: {e}"));
                    }
                    LinkEvent::Closed(reason) => return Err(reason),
                };
            }
            ch = changes.recv() => {
                let folders: Vec<FolderId> = match ch {
                    Ok(f) => vec![f],
                    Err(_) => engine.shared_with(&peer),
                };
                let mut j = engine.journal.lock().map_err(|_| "journal lock poisoned")?;
                let mut src = JournalSource { journal: &mut j };
                for f in folders {
                    pending.extend(session.local_changed(&f, &mut src));
                }
            }
            _ = engine.shutdown.notified() => {
                let bye = Message::Error { code: ErrorCode::Shutdown, message: "daemon stopping".into() };
                let _ = out.send((bye, u64::MAX));
                drop(out);
                let _ = tokio::time::timeout(Duration::from_secs(1), writer).await;
                return Err("shutdown".into());
            }
        }
    }
}

/// Messages for the control stream, each with the sequence above which its records may carry
/// inline content ([`Session::inline_after`]).
type Outgoing = mpsc::UnboundedSender<(Message, u64)>;

/// Starts the task that owns the control stream's send side (see `drive_session`). A write
/// error ends the session through `events`.
fn control_writer(
    engine: Arc<Engine>,
    mut send: quinn::SendStream,
    events: mpsc::UnboundedSender<LinkEvent>,
) -> (Outgoing, tokio::task::JoinHandle<()>) {
    let (out, mut queue) = mpsc::unbounded_channel::<(Message, u64)>();
    let task = tokio::spawn(async move {
        while let Some((mut msg, after)) = queue.recv().await {
            if let Message::Index(batch) = msg {
                let engine = engine.clone();
                let t0 = std::time::Instant::now();
                let attached = tokio::task::spawn_blocking(move || {
                    let mut batch = batch;
                    attach_inline(&engine, &mut batch, after);
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

/// Attaches to `batch` the content of its small files journaled after sequence `after`: files
/// of one chunk whose hash is the file's, up to [`INLINE_FILE_BYTES`] each and
/// [`INLINE_BATCH_BYTES`] in all, compressed as in responses, if journaled as a creation or a
/// modification.
/// Read as of now: a file changed since it was journaled fails its hash and is left out (the
/// receiver asks, as for any chunk).
fn attach_inline(engine: &Engine, batch: &mut IndexBatch, after: u64) {
    let Some(rt) = engine.folder(&batch.folder) else {
        return;
    };
    let candidates: Vec<&FileRecord> = batch
        .records
        .iter()
        .filter(|r| {
            r.sequence > after
                && !r.deleted
                && r.kind == FileKind::File
                && r.size <= INLINE_FILE_BYTES
                && r.chunks.len() == 1
        })
        .collect();
    if candidates.is_empty() {
        return;
    }
    let sequences: Vec<u64> = candidates.iter().map(|r| r.sequence).collect();
    // Only content that is new at its path: a rename's content is on the peer under the old
    // name, a metadata change or a resolution (e.g. two devices that scanned the same tree
    // merging their versions) keeps content the peer sent or has. No history left (pruned):
    // an old file, attached like a creation.
    let ops = match engine.journal.lock() {
        Ok(j) => j.ops_of(&batch.folder, &sequences).unwrap_or_default(),
        Err(_) => return,
    };
    let mut dirs = DirCache::default();
    let mut seen = HashSet::new();
    let mut bytes = 0usize;
    let mut packer = Packer::default();
    for r in candidates {
        let fresh = ops
            .get(&r.sequence)
            .is_none_or(|op| matches!(op, Op::Create | Op::Modify));
        if !fresh || !seen.insert(r.hash) {
            continue;
        }
        let Ok(d) = rt
            .store
            .read_chunk_in(&mut dirs, &r.path, 0, r.size as u32, &r.hash)
        else {
            continue;
        };
        let (data, compressed) = packer.pack(d);
        bytes += data.len();
        if bytes > INLINE_BATCH_BYTES {
            break;
        }
        batch.inline.push(ChunkResponse {
            hash: r.hash,
            data: Some(data),
            compressed,
        });
    }
}

fn publish_status(engine: &Engine, peer: DeviceId, session: &Session) {
    let folders = engine.shared_with(&peer);
    if let Ok(mut p) = engine.peers.lock() {
        for f in folders {
            if let Some(s) = session.folder_status(&f) {
                p.sync.insert((peer, f), s);
            }
        }
    }
    engine.peer_changed.notify_waiters();
}

/// Answers one chunk request stream, checking on every request that the folder is shared with
/// the requester.
async fn serve_request(
    engine: &Arc<Engine>,
    peer: DeviceId,
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
) -> Result<(), String> {
    let req = match transport::read_message(&mut recv)
        .await
        .map_err(|e| e.to_string())?
    {
        Some(Message::Request(r)) => r,
        Some(_) | None => {
            let _ = transport::write_message(
                &mut send,
                &Message::Error {
                    code: ErrorCode::BadFrame,
                    message: "expected a chunk request".into(),
                },
            )
            .await;
            return Err("request stream without a request".into());
        }
    };
    if !engine.shared_with(&peer).contains(&req.folder) {
        let _ = transport::write_message(
            &mut send,
            &Message::Error {
                code: ErrorCode::NotShared,
                message: format!("folder {} is not shared with you", req.folder),
            },
        )
        .await;
        return Err(format!(
            "peer {} asked for unshared folder {}",
            peer.short(),
            req.folder
        ));
    }
    let Some(rt) = engine.folder(&req.folder) else {
        return Err(format!("folder {} not running", req.folder));
    };
    if req.hashes.len() > MAX_REQUEST_HASHES {
        let _ = transport::write_message(
            &mut send,
            &Message::Error {
                code: ErrorCode::BadFrame,
                message: format!(
                    "{} hashes in one request; at most {MAX_REQUEST_HASHES}",
                    req.hashes.len()
                ),
            },
        )
        .await;
        return Err(format!(
            "peer {} asked for {} chunks in one request",
            peer.short(),
            req.hashes.len()
        ));
    }
    // Reading is blocking work (journal, files, zstd): a blocking thread reads the chunks in
    // order and hands each response to this task, at most a few ahead of the stream.
    let (tx, mut rx) = mpsc::channel::<ChunkResponse>(4);
    let engine_folder = req.folder.clone();
    let engine2 = engine.clone();
    let reader = tokio::task::spawn_blocking(move || {
        let journal = &engine2.journal;
        let mut dirs = DirCache::default();
        let mut packer = Packer::default();
        for hash in req.hashes {
            let locs = journal
                .lock()
                .ok()
                .and_then(|j| j.find_chunk(&engine_folder, &hash).ok())
                .unwrap_or_default();
            let data = locs.into_iter().find_map(|l| {
                rt.store
                    .read_chunk_in(&mut dirs, &l.path, l.offset, l.len, &hash)
                    .ok()
            });
            let resp = match data {
                Some(d) => {
                    let (data, compressed) = packer.pack(d);
                    ChunkResponse {
                        hash,
                        data: Some(data),
                        compressed,
                    }
                }
                None => ChunkResponse {
                    hash,
                    data: None,
                    compressed: false,
                },
            };
            if tx.blocking_send(resp).is_err() {
                return;
            }
        }
    });
    while let Some(resp) = rx.recv().await {
        // A requester that stops reading frees its reader after a while (dropping `rx`
        // ends the blocking thread's sends).
        tokio::time::timeout(
            RESPONSE_WRITE_TIMEOUT,
            transport::write_message(&mut send, &Message::Response(resp)),
        )
        .await
        .map_err(|_| "the requester stopped reading".to_string())?
        .map_err(|e| e.to_string())?;
    }
    reader.await.map_err(|e| e.to_string())?;
    let _ = send.finish();
    Ok(())
}

/// One fetched chunk (or its absence), or why the request failed.
type FetchItem = Result<(Hash, Option<Vec<u8>>), String>;

/// zstd when it saves at least an eighth; raw otherwise. A chunk over 16 KiB is first judged
/// by compressing 4 KiB from its middle: zstd gives up on incompressible input without
/// finding matches, but it still reads, histograms and copies every block, which was a tenth
/// of a sending daemon's CPU on already-compressed data (`perf`, 1.9 GB of mixed files).
/// Compression over one stream of chunks (a batch's inline contents, a request's responses)
/// that stops trying where it does not pay: after [`Packer::GIVE_UP`] chunks in a row that
/// zstd could not shrink (a tree of photos, archives, random data), only every
/// [`Packer::PROBE`]th chunk is tried, and one that pays turns it back on. For 4 KiB files zstd
/// cost a fifth of a sending daemon's CPU, to find out there was nothing to save.
#[derive(Default)]
struct Packer {
    misses: u32,
    skipped: u32,
}

impl Packer {
    const GIVE_UP: u32 = 8;
    const PROBE: u32 = 16;

    fn pack(&mut self, d: Vec<u8>) -> (Vec<u8>, bool) {
        if self.misses >= Self::GIVE_UP && self.skipped + 1 < Self::PROBE {
            self.skipped += 1;
            return (d, false);
        }
        self.skipped = 0;
        let (out, packed) = compress(d);
        if packed {
            self.misses = 0;
        } else {
            self.misses += 1;
        }
        (out, packed)
    }
}

fn compress(d: Vec<u8>) -> (Vec<u8>, bool) {
    thread_local! {
        // A compression context per thread: creating one per chunk cost more than
        // compressing a 4 KiB chunk.
        static ZSTD: std::cell::RefCell<Option<zstd::bulk::Compressor<'static>>> =
            std::cell::RefCell::new(zstd::bulk::Compressor::new(1).ok());
    }
    const SAMPLE: usize = 4096;
    let pays = |data: &[u8], need: usize| {
        ZSTD.with(|z| {
            let mut z = z.borrow_mut();
            let c = z.as_mut()?.compress(data).ok()?;
            (c.len() + need <= data.len()).then_some(c)
        })
    };
    if d.len() > 4 * SAMPLE {
        let mid = d.len() / 2 - SAMPLE / 2;
        // The sample must save a sixteenth: looser than the whole chunk's eighth, so a chunk
        // that would just pay is not turned away by its sample.
        if pays(&d[mid..mid + SAMPLE], SAMPLE / 16).is_none() {
            return (d, false);
        }
    }
    if d.len() >= 512 {
        if let Some(c) = pays(&d, d.len() / 8) {
            return (c, true);
        }
    }
    (d, false)
}

/// A chunk as it came from a peer (`compressed`: a zstd frame), decompressed and verified
/// against `hash`.
pub(crate) fn open_chunk(hash: &Hash, data: Vec<u8>, compressed: bool) -> Result<Vec<u8>, String> {
    let data = if compressed {
        zstd::bulk::decompress(&data, meshfs_protocol::MAX_CHUNK_LEN as usize)
            .map_err(|e| format!("bad zstd chunk: {e}"))?
    } else {
        data
    };
    if &Hash::of(&data) != hash {
        return Err(format!("chunk {} failed verification", hash.short()));
    }
    Ok(data)
}

/// Fetches chunks of `folder` from `conn`, many requests in flight; calls `sink` with each
/// verified chunk. Returns the hashes the peer did not have.
pub async fn fetch(
    conn: &quinn::Connection,
    folder: &FolderId,
    wanted: Vec<(Hash, u32)>,
    sink: &mut (dyn FnMut(Hash, Vec<u8>) -> Result<(), String> + Send),
) -> Result<Vec<Hash>, String> {
    let mut groups: Vec<Vec<(Hash, u32)>> = Vec::new();
    let mut cur: Vec<(Hash, u32)> = Vec::new();
    let mut bytes = 0u64;
    for (h, len) in wanted {
        if !cur.is_empty() && (cur.len() >= REQUEST_HASHES || bytes + len as u64 > REQUEST_BYTES) {
            groups.push(std::mem::take(&mut cur));
            bytes = 0;
        }
        bytes += len as u64;
        cur.push((h, len));
    }
    if !cur.is_empty() {
        groups.push(cur);
    }
    let (tx, mut rx) = mpsc::channel::<FetchItem>(256);
    let sem = Arc::new(tokio::sync::Semaphore::new(REQUESTS_IN_FLIGHT));
    for g in groups {
        let conn = conn.clone();
        let folder = folder.clone();
        let tx = tx.clone();
        let sem = sem.clone();
        tokio::spawn(async move {
            let Ok(_permit) = sem.acquire_owned().await else {
                return;
            };
            if let Err(e) = request_group(&conn, folder, g, &tx).await {
                let _ = tx.send(Err(e)).await;
            }
        });
    }
    drop(tx);
    let mut missing = Vec::new();
    while let Some(item) = rx.recv().await {
        let (hash, data) = item?;
        match data {
            Some(d) => sink(hash, d)?,
            None => missing.push(hash),
        }
    }
    Ok(missing)
}

async fn request_group(
    conn: &quinn::Connection,
    folder: FolderId,
    wanted: Vec<(Hash, u32)>,
    tx: &mpsc::Sender<FetchItem>,
) -> Result<(), String> {
    let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
    let hashes: Vec<Hash> = wanted.iter().map(|w| w.0).collect();
    let n = hashes.len();
    transport::write_message(
        &mut send,
        &Message::Request(ChunkRequest {
            folder,
            hashes: hashes.clone(),
        }),
    )
    .await
    .map_err(|e| e.to_string())?;
    let _ = send.finish();
    for (want, want_len) in wanted.iter().take(n) {
        let msg = transport::read_message(&mut recv)
            .await
            .map_err(|e| e.to_string())?;
        let resp = match msg {
            Some(Message::Response(r)) => r,
            Some(Message::Error { message, .. }) => {
                return Err(format!("peer refused chunk request: {message}"))
            }
            _ => return Err("chunk stream ended early".into()),
        };
        if &resp.hash != want {
            return Err("chunk responses out of order".into());
        }
        let data = match resp.data {
            Some(d) => Some(open_chunk(&resp.hash, d, resp.compressed)?),
            None => None,
        };
        // The hash proves the bytes; the record's chunk list also states their length, and a
        // chunk of another length would shift every byte after it in the file.
        if let Some(d) = &data {
            if d.len() != *want_len as usize {
                return Err(format!(
                    "chunk {} is {} bytes where its record says {want_len}",
                    want.short(),
                    d.len()
                ));
            }
        }
        if tx.send(Ok((resp.hash, data))).await.is_err() {
            return Ok(());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn noise(n: usize) -> Vec<u8> {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    #[test]
    fn a_stream_of_incompressible_chunks_stops_trying_until_one_pays() {
        let text = b"meshfs keeps a folder identical on every device. ".repeat(100);
        let mut p = Packer::default();
        let packed: Vec<bool> = (0..64).map(|_| p.pack(noise(4096)).1).collect();
        assert!(!packed.iter().any(|&b| b));
        assert_eq!(
            p.misses,
            Packer::GIVE_UP + 56 / Packer::PROBE,
            "tried only every 16th"
        );
        // Compressible content again: found at the next probe, then every chunk is tried.
        let mut first = None;
        for i in 0..Packer::PROBE {
            let (sent, packed) = p.pack(text.clone());
            if packed {
                assert_eq!(open_chunk(&Hash::of(&text), sent, true).unwrap(), text);
                first = Some(i);
                break;
            }
        }
        assert!(first.is_some(), "a probe within 16 chunks");
        assert!((0..4).all(|_| p.pack(text.clone()).1));
    }

    #[test]
    fn compression_is_used_only_where_it_pays_and_round_trips() {
        let text: Vec<u8> = b"meshfs keeps a folder identical on every device. "
            .iter()
            .copied()
            .cycle()
            .take(1 << 20)
            .collect();
        for (data, want_packed) in [
            (text.clone(), true),
            (text[..4096].to_vec(), true),
            (noise(1 << 20), false),
            (noise(4096), false),
            (b"tiny".to_vec(), false),
        ] {
            let hash = Hash::of(&data);
            let (sent, packed) = compress(data.clone());
            assert_eq!(packed, want_packed, "{} bytes", data.len());
            assert_eq!(open_chunk(&hash, sent, packed).unwrap(), data);
        }
    }

    #[test]
    fn an_attached_chunk_that_does_not_match_its_hash_is_refused() {
        let data = b"the real content".to_vec();
        let hash = Hash::of(&data);
        assert!(open_chunk(&hash, b"something else".to_vec(), false).is_err());
        assert!(open_chunk(&hash, b"not zstd".to_vec(), true).is_err());
        assert_eq!(open_chunk(&hash, data.clone(), false).unwrap(), data);
    }
}
