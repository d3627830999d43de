//! One peer session as a state machine: hello, incremental index exchange, acknowledgements,
//! flow control, and whether a folder is in sync — in the style of `quinn-proto`.
//!
//! **Architecture invariant:** no IO, no clock, no randomness. The driver (the engine with a
//! QUIC control stream, or the simulation in memory) feeds the session events — [`Session::start`],
//! [`Session::handle`] for each control-stream message, [`Session::local_changed`] when the
//! journal grew, [`Session::applied`] when received records are applied — and executes the
//! [`Action`]s it returns, in order. Local records are read through [`IndexSource`].
//!
//! Protocol rules kept here:
//! - both sides send `Hello` first; a different protocol version ends the session;
//! - a folder is exchanged only if it is in our list (shared with this peer) and in theirs;
//!   an index, ack or batch for any other folder ends the session (`NotShared`) and is never
//!   delivered;
//! - we resume sending from `your_sequence` when the peer names our current index epoch, else
//!   from 0; when the peer's epoch is not the one we remember, its sequence restarts at 0;
//! - a batch holds at most [`MAX_BATCH_RECORDS`] records and about [`MAX_BATCH_BYTES`] of
//!   encoded records; at most [`MAX_IN_FLIGHT`] unacknowledged batches per folder;
//! - at most [`RECEIVE_DEPTH`] `Receive`s per folder are outstanding at a time (further
//!   batches queue behind them), and the driver reports them applied in the order it got
//!   them: the receiver decides and assembles one batch while the one before it installs;
//! - progress (sequences applied, acknowledged, known) never moves backwards;
//! - a folder whose first scan runs says so in its Hello, then reports the scan's progress
//!   and, once, its end in `Scan` messages ([`Session::scan_progress`]); a peer is not in sync
//!   with us while it is scanning, and a `Scan` for a folder the peer did not say it scans is a
//!   protocol violation;
//! - each side tells the other, per shared folder, which other devices it is connected to and
//!   shares the folder with (`Peers`, after the hellos, again whenever that changes, never
//!   twice the same); a `Peers` before the peer's hello is a protocol violation, one for a
//!   folder not shared in both hellos ends the session (`NotShared`). The driver asks
//!   [`Session::peer_hears`] before attaching a relayed file's content to a batch: a device the
//!   peer hears from directly sends it its own;
//! - each side asks the other for the addresses of the devices it seeks (`Seek`, after the
//!   hellos, again whenever that changes) and tells it where it reaches those the other seeks
//!   (`Addresses`; [`crate::rendezvous`]); either before the peer's hello is a protocol
//!   violation.

use crate::error::ReadError;
use crate::rendezvous::Rendezvous;
use meshfs_protocol::{
    AddressList, ChunkResponse, DeviceId, ErrorCode, FileRecord, FolderId, Hello, HelloFolder,
    IndexAck, IndexBatch, Message, PeerList, ScanState, ShortId, WireAddr, MAX_FRAME_LEN,
    MAX_PEERS_PER_LIST, PROTOCOL_VERSION,
};
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// Receives of one folder handed to the driver before the first of them is applied. Three:
/// the driver decides and assembles a batch while the ones before it install (`apply::Turn`);
/// once a decision no longer creates temp files under the folder lock, three took an initial
/// sync of 10,000 small files on loopback from 1.9-2.1 s to 1.5-1.8 s (four: 1.8 s).
pub const RECEIVE_DEPTH: usize = 3;

/// Most records in one index batch.
pub const MAX_BATCH_RECORDS: usize = meshfs_protocol::MAX_RECORDS_PER_BATCH;
/// Target upper bound of one batch's encoded records (well under [`MAX_FRAME_LEN`]).
pub const MAX_BATCH_BYTES: usize = MAX_FRAME_LEN / 8;
/// Most unacknowledged batches in flight per folder.
pub const MAX_IN_FLIGHT: usize = 4;
/// Bytes of the peer's batches a session holds (queued, or handed to the driver and not yet
/// applied: [`IndexBatch::held_bytes`]) beyond which it takes no more messages
/// ([`Session::wants_messages`]): the driver stops reading the control stream, and the peer's
/// flow control holds the rest. Per session, so per connection and per device, whatever the
/// number of folders: a peer's batches are at most [`MAX_IN_FLIGHT`] per folder, each up to a
/// frame, and a device may share thousands of folders.
pub const RECEIVE_BUDGET: usize = 64 << 20;

/// Where the driver reads local records for sending.
pub trait IndexSource {
    /// Local records of `folder` with sequence > `after`, ascending, at most `limit`,
    /// EXCLUDING records whose source is `peer` (the peer already has them); returns
    /// (records, scanned_up_to) where scanned_up_to is the highest sequence examined (≥ any
    /// returned record's sequence; = max_sequence when exhausted).
    fn records_since(
        &mut self,
        folder: &FolderId,
        peer: &DeviceId,
        after: u64,
        limit: usize,
    ) -> Result<(Vec<FileRecord>, u64), ReadError>;
    /// The highest local journal sequence of `folder`.
    fn max_sequence(&mut self, folder: &FolderId) -> Result<u64, ReadError>;
}

/// The source as the session reads it. A read error is kept (the first one) and every read
/// after it returns nothing new, so no progress is made on it; the public method that met it
/// ends the session with it ([`Session::settle`]): a journal that cannot be read is never
/// taken for "nothing to send", which would let both sides say in sync.
struct Reader<'a> {
    src: &'a mut dyn IndexSource,
    failed: Option<ReadError>,
}

impl<'a> Reader<'a> {
    fn new(src: &'a mut dyn IndexSource) -> Reader<'a> {
        Reader { src, failed: None }
    }

    fn max_sequence(&mut self, folder: &FolderId) -> u64 {
        if self.failed.is_some() {
            return 0;
        }
        self.src.max_sequence(folder).unwrap_or_else(|e| {
            self.failed = Some(e);
            0
        })
    }

    fn records_since(
        &mut self,
        folder: &FolderId,
        peer: &DeviceId,
        after: u64,
        limit: usize,
    ) -> (Vec<FileRecord>, u64) {
        if self.failed.is_some() {
            return (Vec::new(), after);
        }
        self.src
            .records_since(folder, peer, after, limit)
            .unwrap_or_else(|e| {
                self.failed = Some(e);
                (Vec::new(), after)
            })
    }
}

/// A folder shared with this peer, with the resume points stored in the journal.
#[derive(Clone, Debug)]
pub struct SessionFolder {
    /// The folder.
    pub folder: FolderId,
    /// Our index epoch for this folder.
    pub index_id: u64,
    /// The peer's index epoch we remember (0: none).
    pub their_index_id: u64,
    /// Highest of their sequences applied here (in `their_index_id`).
    pub their_sequence: u64,
    /// Highest of our sequences the peer acknowledged.
    pub our_acked: u64,
    /// Our first scan of this folder is still running (told to the peer in the Hello; its
    /// progress and end follow through [`Session::scan_progress`]).
    pub scanning: bool,
    /// This device keeps only part of the folder's content (on demand): told to the peer in
    /// the Hello (`HelloFolder::partial`).
    pub partial: bool,
}

/// How far a folder's first scan got.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScanCounts {
    /// Files hashed.
    pub files_hashed: u64,
    /// Their bytes.
    pub bytes_hashed: u64,
    /// Files found and not hashed yet.
    pub files_left: u64,
}

/// What the driver must do, in order.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Send this message on the control stream.
    Send(Message),
    /// Reconcile and apply these records of the peer, in order; then call
    /// [`Session::applied`]`(folder, up_to)`. Up to [`RECEIVE_DEPTH`] Receives of a folder may
    /// be outstanding; `applied` may be called for them in any order (each is acknowledged
    /// once every older one is applied too). If some record of the *oldest* cannot be applied
    /// yet (content unavailable), call `applied` with the sequence just below it: the peer
    /// gets a partial acknowledgement, the Receive stays outstanding, and the driver retries
    /// the rest and calls `applied` again up to `up_to`.
    Receive {
        /// The folder.
        folder: FolderId,
        /// The peer's records, in its sequence order.
        records: Vec<FileRecord>,
        /// The peer's sequence this batch brings us to.
        up_to: u64,
        /// Content the peer attached to the batch ([`IndexBatch::inline`]): unverified hints.
        inline: Vec<ChunkResponse>,
    },
    /// Persist in the journal: their index epoch and the highest of their sequences applied here.
    SaveTheirSequence {
        /// The folder.
        folder: FolderId,
        /// Their index epoch.
        index_id: u64,
        /// Highest of their sequences applied here.
        sequence: u64,
    },
    /// Persist: the peer acknowledged our records up to `sequence`.
    SaveOurAcked {
        /// The folder.
        folder: FolderId,
        /// Highest of our sequences acknowledged.
        sequence: u64,
    },
    /// The session must end (protocol violation, version mismatch, unshared folder …): send
    /// nothing more, close the connection with this reason.
    Close {
        /// For logs.
        reason: String,
    },
    /// The peer seeks these devices now and did not before: tell it where they are
    /// ([`Session::tell_addresses`]) if we know.
    Sought {
        /// The devices newly sought.
        devices: Vec<DeviceId>,
    },
    /// The peer says where a device we seek is (unverified hints for our dials).
    Learned(AddressList),
}

/// Sync progress of one folder with this peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FolderSyncStatus {
    /// Our highest journal sequence (as last seen).
    pub our_max: u64,
    /// The peer processed ours up to this.
    pub our_acked: u64,
    /// The highest of their sequences we know of (hello and batches).
    pub their_known_max: u64,
    /// The highest of their sequences applied here.
    pub their_applied: u64,
    /// A Receive is outstanding (or batches are queued behind one).
    pub receiving: bool,
    /// The peer's first scan of the folder is still running, with how far it got as it last
    /// said: files on its disk may not be in its index yet.
    pub their_scan: Option<ScanCounts>,
    /// established ∧ hello seen ∧ our_acked ≥ our_max ∧ their_applied ≥ their_known_max ∧
    /// !receiving ∧ the peer is not scanning.
    pub in_sync: bool,
    /// The peer's hello did not list the folder: it does not share it with this device, so
    /// nothing of it flows either way on this connection (never in sync until it does).
    pub not_shared: bool,
}

/// One folder's exchange state.
#[derive(Debug)]
struct FolderState {
    cfg: SessionFolder,
    /// The peer's hello said it keeps only part of the folder's content.
    their_partial: bool,
    /// The peer's hello listed it too: records flow both ways.
    shared: bool,
    /// Our highest sequence, as last read from the source.
    our_max: u64,
    /// Our records up to here are sent (or skipped) in this session.
    sent_up_to: u64,
    /// `up_to` of each unacknowledged batch, oldest first.
    in_flight: VecDeque<u64>,
    /// The peer processed ours up to here.
    our_acked: u64,
    their_known_max: u64,
    /// Highest of their sequences applied here.
    their_applied: u64,
    /// Highest `up_to` of their batches received in this session.
    their_received: u64,
    /// Outstanding Receives, oldest first.
    receiving: VecDeque<Receiving>,
    /// Batches received and not handed to the driver yet, each with its held bytes.
    queued: VecDeque<(IndexBatch, usize)>,
    /// Bytes of the batches queued and receiving ([`IndexBatch::held_bytes`]).
    held: usize,
    /// Our records with a sequence above this are new to the peer (see [`Session::inline_after`]).
    inline_after: u64,
    /// `inline_after` is set when our first scan ends, to our highest sequence then: the peer
    /// is not empty, and what our scan journals may be on its disk too.
    inline_after_our_scan: bool,
    /// Our first scan, as the driver last reported it: `Some` while it runs.
    our_scan: Option<ScanCounts>,
    /// Its counts when it ended.
    our_scan_end: ScanCounts,
    /// What the peer was last told of our first scan (in the Hello, then in `Scan`s): `Some`
    /// while it believes the scan runs.
    told_scan: Option<ScanCounts>,
    /// The peer's first scan, as it last said: `Some` while it runs.
    their_scan: Option<ScanCounts>,
}

/// A Receive handed to the driver and not acknowledged yet.
#[derive(Debug)]
struct Receiving {
    /// Its `up_to`.
    up_to: u64,
    /// How far applying it lets us acknowledge (further, when empty batches arrived behind it).
    ack_to: u64,
    /// It is applied already (its report overtook an older one's: it waits to be
    /// acknowledged in order).
    applied: bool,
    /// Bytes its batch held when received ([`IndexBatch::held_bytes`]).
    held: usize,
}

/// One peer session. See the module docs.
pub struct Session {
    local_name: String,
    peer: DeviceId,
    folders: BTreeMap<FolderId, FolderState>,
    hello_sent: bool,
    peer_name: Option<String>,
    closed: bool,
    /// Per folder, the other devices we are connected to and share it with, as the driver last
    /// said.
    our_links: BTreeMap<FolderId, BTreeSet<ShortId>>,
    /// What the peer was last told of them (nothing before: it assumes none).
    told_links: BTreeMap<FolderId, BTreeSet<ShortId>>,
    /// Per folder, the other devices the peer said it is connected to.
    peer_links: BTreeMap<FolderId, BTreeSet<ShortId>>,
    /// The address exchange.
    rendezvous: Rendezvous,
    /// This device (never sought, never told of).
    me: DeviceId,
}

impl Session {
    /// A session with `peer` over the folders we share with it (resume points from the journal).
    pub fn new(local_name: String, peer: DeviceId, folders: Vec<SessionFolder>) -> Session {
        Session::with_device(local_name, DeviceId::from_bytes([0; 32]), peer, folders)
    }

    /// [`Session::new`] for this device `me`, which the address exchange never tells of or
    /// asks for.
    pub fn with_device(
        local_name: String,
        me: DeviceId,
        peer: DeviceId,
        folders: Vec<SessionFolder>,
    ) -> Session {
        let folders = folders
            .into_iter()
            .map(|f| (f.folder.clone(), FolderState::new(f)))
            .collect();
        Session {
            local_name,
            peer,
            folders,
            hello_sent: false,
            peer_name: None,
            closed: false,
            our_links: BTreeMap::new(),
            told_links: BTreeMap::new(),
            peer_links: BTreeMap::new(),
            rendezvous: Rendezvous::default(),
            me,
        }
    }

    /// Opens the session: our Hello, listing our shared folders with resume points.
    pub fn start(&mut self, src: &mut dyn IndexSource) -> Vec<Action> {
        let mut src = Reader::new(src);
        let out = self.open(&mut src);
        self.settle(out, src)
    }

    /// What a step produced, unless reading the source failed during it: then the session
    /// ends with that error instead (what the step built from the failed read is dropped).
    fn settle(&mut self, out: Vec<Action>, src: Reader<'_>) -> Vec<Action> {
        match src.failed {
            None => out,
            Some(e) => {
                self.closed = true;
                vec![Action::Close {
                    reason: e.to_string(),
                }]
            }
        }
    }

    fn open(&mut self, src: &mut Reader<'_>) -> Vec<Action> {
        if self.closed || self.hello_sent {
            return Vec::new();
        }
        self.hello_sent = true;
        let folders = self
            .folders
            .values_mut()
            .map(|f| {
                f.told_scan = f.our_scan.map(|_| ScanCounts::default());
                f.our_max = f.our_max.max(src.max_sequence(&f.cfg.folder));
                HelloFolder {
                    folder: f.cfg.folder.clone(),
                    index_id: f.cfg.index_id,
                    your_index_id: f.cfg.their_index_id,
                    your_sequence: f.their_applied,
                    max_sequence: f.our_max,
                    scanning: f.our_scan.is_some(),
                    partial: f.cfg.partial,
                }
            })
            .collect();
        let mut out = vec![Action::Send(Message::Hello(Hello {
            protocol_version: PROTOCOL_VERSION,
            device_name: self.local_name.clone(),
            folders,
        }))];
        if self.peer_name.is_some() {
            out.extend(self.pump_all(src));
            out.extend(self.tell_links());
            out.extend(self.tell_seek());
        }
        out
    }

    /// A message from the peer's control stream.
    pub fn handle(&mut self, msg: Message, src: &mut dyn IndexSource) -> Vec<Action> {
        let mut src = Reader::new(src);
        let out = self.handle_with(msg, &mut src);
        self.settle(out, src)
    }

    fn handle_with(&mut self, msg: Message, src: &mut Reader<'_>) -> Vec<Action> {
        if self.closed {
            return Vec::new();
        }
        let mut out = Vec::new();
        if !self.hello_sent {
            out = self.open(src);
        }
        match msg {
            Message::Hello(h) => {
                out.extend(self.on_hello(h, src));
                out.extend(self.tell_links());
                out.extend(self.tell_seek());
            }
            Message::Peers(p) => out.extend(self.on_peers(p)),
            Message::Seek(list) => {
                if self.peer_name.is_none() {
                    return self.fail(ErrorCode::BadFrame, "seek list before hello");
                }
                let devices = self.rendezvous.on_seek(&self.me, &self.peer, list);
                if !devices.is_empty() {
                    out.push(Action::Sought { devices });
                }
            }
            Message::Addresses(list) => {
                if self.peer_name.is_none() {
                    return self.fail(ErrorCode::BadFrame, "address list before hello");
                }
                out.extend(self.rendezvous.on_addresses(list).map(Action::Learned));
            }
            Message::Index(batch) => out.extend(self.on_index(batch)),
            Message::IndexAck(ack) => out.extend(self.on_ack(ack, src)),
            Message::Scan(scan) => out.extend(self.on_scan(scan, src)),
            Message::Error { code, message } => {
                self.closed = true;
                out.push(Action::Close {
                    reason: format!("peer refused ({code:?}): {message}"),
                });
            }
            Message::Request(_) | Message::Response(_) | Message::Probe(_) | Message::Held(_) => {
                out.extend(self.fail(
                    ErrorCode::BadFrame,
                    "chunk messages are not allowed on the control stream",
                ))
            }
        }
        out
    }

    /// New local journal entries exist in `folder`: sends them if established and within the
    /// flow-control window.
    pub fn local_changed(&mut self, folder: &FolderId, src: &mut dyn IndexSource) -> Vec<Action> {
        if self.closed {
            return Vec::new();
        }
        let mut src = Reader::new(src);
        let established = self.is_established();
        let peer = self.peer;
        let out = match self.folders.get_mut(folder) {
            Some(f) if established && f.shared => f.pump(&peer, &mut src),
            Some(f) => {
                f.our_max = f.our_max.max(src.max_sequence(folder));
                Vec::new()
            }
            None => Vec::new(),
        };
        self.settle(out, src)
    }

    /// Our first scan of `folder` has got this far (`scanning`: it still runs; `false`: it has
    /// finished and everything it found is journaled). Tells the peer, if it was told the scan
    /// runs and this is news: progress while it runs, then its end once, with our highest
    /// sequence, after sending what the window allows. A first scan runs once: after its end,
    /// `scanning = true` is ignored.
    pub fn scan_progress(
        &mut self,
        folder: &FolderId,
        scanning: bool,
        counts: ScanCounts,
        src: &mut dyn IndexSource,
    ) -> Vec<Action> {
        if self.closed {
            return Vec::new();
        }
        let mut src = Reader::new(src);
        let established = self.is_established();
        let peer = self.peer;
        let Some(f) = self.folders.get_mut(folder) else {
            return Vec::new();
        };
        if f.our_scan.is_none() {
            return Vec::new();
        }
        f.our_scan = scanning.then_some(counts);
        f.our_scan_end = counts;
        if !scanning && f.inline_after_our_scan && f.their_scan.is_none() {
            // Before the pump: what the scan journaled is not news to the peer.
            f.inline_after_our_scan = false;
            f.our_max = f.our_max.max(src.max_sequence(folder));
            f.inline_after = f.our_max;
        }
        let out = if established && f.shared {
            let mut out = f.pump(&peer, &mut src);
            out.extend(f.tell_scan(&mut src));
            out
        } else {
            Vec::new()
        };
        self.settle(out, src)
    }

    /// The outstanding Receive of `folder` is applied up to `up_to` (all of the peer's records
    /// with a sequence ≤ `up_to` are processed): acknowledges and persists that progress, then
    /// delivers the next queued batch.
    pub fn applied(&mut self, folder: &FolderId, up_to: u64) -> Vec<Action> {
        if self.closed {
            return Vec::new();
        }
        let Some(f) = self.folders.get_mut(folder) else {
            return Vec::new();
        };
        let Some(oldest) = f.receiving.front().map(|r| r.up_to) else {
            return Vec::new();
        };
        if up_to < oldest {
            return f.progress(up_to);
        }
        // A Receive is applied: the oldest, or a later one whose report overtook the oldest's
        // (the driver's applies install in order, but each reports from its own task, and the
        // newer one can report first). It is acknowledged once everything before it is.
        let i = f
            .receiving
            .iter()
            .position(|r| r.up_to == up_to)
            .unwrap_or(0);
        f.receiving[i].applied = true;
        let mut ack = None;
        while let Some(r) = f.receiving.pop_front() {
            if !r.applied {
                f.receiving.push_front(r);
                break;
            }
            f.held -= r.held;
            ack = Some(r.ack_to);
        }
        let mut out = ack.map(|a| f.progress(a)).unwrap_or_default();
        out.extend(f.deliver());
        out
    }

    /// Per folder, the other devices this one is connected to now and shares it with (the
    /// driver's view; the peer itself is left out, and folders not shared with it): the peer is
    /// told once the hellos are exchanged, and of each folder whose list changes after that.
    pub fn connected_peers(
        &mut self,
        links: impl IntoIterator<Item = (FolderId, Vec<ShortId>)>,
    ) -> Vec<Action> {
        let me = self.peer.short();
        self.our_links = links
            .into_iter()
            .filter(|(f, _)| self.folders.contains_key(f))
            .map(|(f, devices)| {
                let set: BTreeSet<ShortId> = devices
                    .into_iter()
                    .filter(|d| *d != me)
                    .take(MAX_PEERS_PER_LIST)
                    .collect();
                (f, set)
            })
            .filter(|(_, set)| !set.is_empty())
            .collect();
        self.tell_links()
    }

    fn tell_links(&mut self) -> Vec<Action> {
        if !self.is_established() {
            return Vec::new();
        }
        let mut out = Vec::new();
        let empty = BTreeSet::new();
        let folders: BTreeSet<FolderId> = self
            .our_links
            .keys()
            .chain(self.told_links.keys())
            .filter(|f| self.folders.get(*f).is_some_and(|s| s.shared))
            .cloned()
            .collect();
        for folder in folders {
            let now = self.our_links.get(&folder).unwrap_or(&empty);
            if self.told_links.get(&folder).unwrap_or(&empty) == now {
                continue;
            }
            out.push(Action::Send(Message::Peers(PeerList {
                folder: folder.clone(),
                connected: now.iter().copied().collect(),
            })));
            if now.is_empty() {
                self.told_links.remove(&folder);
            } else {
                self.told_links.insert(folder, now.clone());
            }
        }
        out
    }

    /// We seek the addresses of `devices` (every device we trust and dial wherever it is found;
    /// the peer is left out): the peer is told once the hellos are through, and again whenever
    /// the set changes.
    pub fn seek(&mut self, devices: BTreeSet<DeviceId>) -> Vec<Action> {
        if self.closed {
            return Vec::new();
        }
        self.rendezvous.set_ours(&self.peer, devices);
        self.tell_seek()
    }

    fn tell_seek(&mut self) -> Vec<Action> {
        if !self.is_established() {
            return Vec::new();
        }
        self.rendezvous
            .seek_due()
            .map(|s| Action::Send(Message::Seek(s)))
            .into_iter()
            .collect()
    }

    /// We reach `device` at `addrs` (where its packets come from): the peer is told if it
    /// seeks that device and this is news to it.
    pub fn tell_addresses(&mut self, device: DeviceId, addrs: Vec<WireAddr>) -> Vec<Action> {
        if !self.is_established() {
            return Vec::new();
        }
        self.rendezvous
            .tell(device, addrs)
            .map(|l| Action::Send(Message::Addresses(l)))
            .into_iter()
            .collect()
    }

    /// The devices the peer seeks (see [`Session::tell_addresses`]).
    pub fn sought_by_peer(&self) -> Vec<DeviceId> {
        self.rendezvous.sought_by_peer().copied().collect()
    }

    fn on_peers(&mut self, list: PeerList) -> Vec<Action> {
        if self.peer_name.is_none() {
            return self.fail(ErrorCode::BadFrame, "peer list before hello");
        }
        if !self.folders.get(&list.folder).is_some_and(|f| f.shared) {
            let msg = format!("folder {} is not shared with this device", list.folder);
            return self.fail(ErrorCode::NotShared, &msg);
        }
        if list.connected.is_empty() {
            self.peer_links.remove(&list.folder);
        } else {
            self.peer_links
                .insert(list.folder, list.connected.into_iter().collect());
        }
        Vec::new()
    }

    /// The peer said it is connected to `device` (not this device) and shares `folder` with
    /// it: a version of `folder` that `device` made reaches the peer from `device` itself, so a
    /// batch relaying it here need not carry its content too (`docs/protocol.md`, "Inline
    /// content").
    pub fn peer_hears(&self, folder: &FolderId, device: ShortId) -> bool {
        self.peer_links
            .get(folder)
            .is_some_and(|s| s.contains(&device))
    }

    /// The folders both hellos listed: those this session exchanges.
    pub fn shared_folders(&self) -> BTreeSet<FolderId> {
        self.folders
            .iter()
            .filter(|(_, f)| f.shared)
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// The shared folders whose content the peer keeps only in part (its hello said so): its
    /// acknowledgements there do not say it holds content.
    pub fn partial_folders(&self) -> BTreeSet<FolderId> {
        self.folders
            .iter()
            .filter(|(_, f)| f.shared && f.their_partial)
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// Both hellos exchanged and the session not ended.
    pub fn is_established(&self) -> bool {
        self.hello_sent && self.peer_name.is_some() && !self.closed
    }

    /// The peer's name for itself, once its hello arrived.
    pub fn peer_name(&self) -> Option<&str> {
        self.peer_name.as_deref()
    }

    /// The peer's device id.
    pub fn peer(&self) -> &DeviceId {
        &self.peer
    }

    /// Our records of `folder` with a sequence above this are new to the peer, so the driver
    /// may attach small files' content to the batches that carry them: the peer's journal was
    /// empty at hello, or the peer had seen our index before (everything after its resume
    /// point is news), or the record was journaled after hello. `u64::MAX` before hello.
    pub fn inline_after(&self, folder: &FolderId) -> u64 {
        self.folders
            .get(folder)
            .filter(|f| f.shared)
            .map_or(u64::MAX, |f| f.inline_after)
    }

    /// Bytes of the peer's batches this session holds: queued, or handed to the driver and not
    /// applied yet ([`IndexBatch::held_bytes`]).
    pub fn held_bytes(&self) -> usize {
        self.folders.values().map(|f| f.held).sum()
    }

    /// Whether the driver should read the peer's next message: the batches held are under
    /// [`RECEIVE_BUDGET`]. Otherwise the driver waits for applies to report first (a batch is
    /// always taken when it arrives; the budget is passed by at most one message).
    pub fn wants_messages(&self) -> bool {
        self.closed || self.held_bytes() < RECEIVE_BUDGET
    }

    /// Progress of `folder`, if it is one of ours.
    pub fn folder_status(&self, folder: &FolderId) -> Option<FolderSyncStatus> {
        let f = self.folders.get(folder)?;
        let receiving = !f.receiving.is_empty() || !f.queued.is_empty();
        Some(FolderSyncStatus {
            our_max: f.our_max,
            our_acked: f.our_acked,
            their_known_max: f.their_known_max,
            their_applied: f.their_applied,
            receiving,
            their_scan: f.their_scan,
            in_sync: self.is_established()
                && f.shared
                && f.our_acked >= f.our_max
                && f.their_applied >= f.their_known_max
                && !receiving
                && f.their_scan.is_none(),
            not_shared: self.peer_name.is_some() && !f.shared,
        })
    }

    fn on_hello(&mut self, h: Hello, src: &mut Reader<'_>) -> Vec<Action> {
        if self.peer_name.is_some() {
            return self.fail(ErrorCode::BadFrame, "second hello");
        }
        if h.protocol_version != PROTOCOL_VERSION {
            let older = h.protocol_version.min(PROTOCOL_VERSION);
            let msg = format!(
                "protocol version {} is not supported (this device speaks {PROTOCOL_VERSION}): upgrade meshfs on the device that speaks {older}",
                h.protocol_version
            );
            return self.fail(ErrorCode::Version, &msg);
        }
        self.peer_name = Some(h.device_name);
        let mut out = Vec::new();
        for hf in h.folders {
            let Some(f) = self.folders.get_mut(&hf.folder) else {
                continue;
            };
            if f.shared {
                continue;
            }
            f.shared = true;
            if hf.index_id != f.cfg.their_index_id {
                // Their journal was recreated (or never seen): their sequences restart.
                f.cfg.their_index_id = hf.index_id;
                f.their_applied = 0;
                out.push(Action::SaveTheirSequence {
                    folder: hf.folder.clone(),
                    index_id: hf.index_id,
                    sequence: 0,
                });
            }
            f.their_known_max = f.their_known_max.max(hf.max_sequence);
            // Resume where the peer says it is, if it speaks of our current epoch and is not
            // ahead of us; otherwise send everything.
            let resume = if hf.your_index_id == f.cfg.index_id && hf.your_sequence <= f.our_max {
                hf.your_sequence
            } else {
                0
            };
            f.sent_up_to = resume;
            f.our_acked = resume;
            // Content worth attaching to the index: everything when the peer's journal is empty
            // or it has seen our index before (what follows is new to it); after a fresh start
            // against a non-empty peer (which may hold the same files), only what is journaled
            // from now on; nothing while the peer is still in its first scan (its disk may
            // hold any of our files, its journal does not say yet), nor to a peer that keeps
            // only part of the folder (it would drop the content for a placeholder). While our
            // own first scan runs, nothing either unless the peer is empty: what the scan
            // journals after this Hello may be on the peer's disk as much as what it journaled
            // before (two devices that start with the same tree, ours the slower scan).
            f.their_partial = hf.partial;
            let their_empty = hf.max_sequence == 0 && !hf.scanning && !hf.partial;
            f.inline_after_our_scan = f.our_scan.is_some() && !their_empty && !hf.partial;
            f.inline_after = if hf.scanning || hf.partial || f.inline_after_our_scan {
                u64::MAX
            } else if their_empty || resume > 0 {
                0
            } else {
                f.our_max
            };
            f.their_scan = hf.scanning.then(ScanCounts::default);
        }
        out.extend(self.pump_all(src));
        // Our scan may have moved on (or ended) since our Hello went out.
        for f in self.folders.values_mut().filter(|f| f.shared) {
            out.extend(f.tell_scan(src));
        }
        out
    }

    fn on_scan(&mut self, scan: ScanState, src: &mut Reader<'_>) -> Vec<Action> {
        if self.peer_name.is_none() {
            return self.fail(ErrorCode::BadFrame, "scan state before hello");
        }
        let Some(f) = self.folders.get_mut(&scan.folder).filter(|f| f.shared) else {
            let msg = format!("folder {} is not shared with this device", scan.folder);
            return self.fail(ErrorCode::NotShared, &msg);
        };
        if f.their_scan.is_none() {
            let msg = format!(
                "scan state of folder {} from a device that did not say it was scanning it",
                scan.folder
            );
            return self.fail(ErrorCode::BadFrame, &msg);
        }
        // Its index reaches at least this far: not caught up before it is applied here.
        f.their_known_max = f.their_known_max.max(scan.max_sequence);
        if scan.scanning {
            f.their_scan = Some(ScanCounts {
                files_hashed: scan.files_hashed,
                bytes_hashed: scan.bytes_hashed,
                files_left: scan.files_left,
            });
        } else {
            f.their_scan = None;
            // Its journal now lists what its disk holds: as after a Hello from a device that
            // scanned its own copy, what we journal from now on is new to it (unless it keeps
            // only part of the folder: it would drop the content).
            if f.our_scan.is_some() && !f.their_partial {
                // Ours still runs: from its end on.
                f.inline_after_our_scan = true;
            } else if f.inline_after == u64::MAX && !f.their_partial {
                f.our_max = f.our_max.max(src.max_sequence(&scan.folder));
                f.inline_after = f.our_max;
            }
        }
        Vec::new()
    }

    fn on_index(&mut self, batch: IndexBatch) -> Vec<Action> {
        if self.peer_name.is_none() {
            return self.fail(ErrorCode::BadFrame, "index before hello");
        }
        let Some(f) = self.folders.get_mut(&batch.folder).filter(|f| f.shared) else {
            let msg = format!("folder {} is not shared with this device", batch.folder);
            return self.fail(ErrorCode::NotShared, &msg);
        };
        let ascending = batch
            .records
            .windows(2)
            .all(|w| w[0].sequence < w[1].sequence);
        let bounded = batch
            .records
            .last()
            .is_none_or(|r| r.sequence <= batch.up_to);
        let after = batch
            .records
            .first()
            .is_none_or(|r| r.sequence > f.their_received);
        if !ascending || !bounded || !after || batch.up_to < f.their_received {
            let msg = format!(
                "index batch of folder {} out of sequence order",
                batch.folder
            );
            return self.fail(ErrorCode::BadFrame, &msg);
        }
        // The sender may have MAX_IN_FLIGHT batches unacknowledged; every batch here is
        // unacknowledged until applied. More is a peer ignoring the window: refused rather
        // than queued without bound.
        if f.queued.len() + f.receiving.len() >= MAX_IN_FLIGHT {
            let msg = format!(
                "more than {MAX_IN_FLIGHT} unacknowledged index batches of folder {}",
                batch.folder
            );
            return self.fail(ErrorCode::BadFrame, &msg);
        }
        f.their_received = batch.up_to;
        f.their_known_max = f.their_known_max.max(batch.up_to);
        let held = batch.held_bytes();
        f.held += held;
        f.queued.push_back((batch, held));
        f.deliver()
    }

    fn on_ack(&mut self, ack: IndexAck, src: &mut Reader<'_>) -> Vec<Action> {
        if self.peer_name.is_none() {
            return self.fail(ErrorCode::BadFrame, "ack before hello");
        }
        let peer = self.peer;
        let Some(f) = self.folders.get_mut(&ack.folder).filter(|f| f.shared) else {
            let msg = format!("folder {} is not shared with this device", ack.folder);
            return self.fail(ErrorCode::NotShared, &msg);
        };
        if ack.sequence > f.sent_up_to {
            let msg = format!("ack of folder {} beyond what was sent", ack.folder);
            return self.fail(ErrorCode::BadFrame, &msg);
        }
        while f.in_flight.front().is_some_and(|&u| u <= ack.sequence) {
            f.in_flight.pop_front();
        }
        let mut out = Vec::new();
        if ack.sequence > f.our_acked {
            f.our_acked = ack.sequence;
            out.push(Action::SaveOurAcked {
                folder: ack.folder.clone(),
                sequence: ack.sequence,
            });
        }
        out.extend(f.pump(&peer, src));
        out
    }

    fn pump_all(&mut self, src: &mut Reader<'_>) -> Vec<Action> {
        if !self.is_established() {
            return Vec::new();
        }
        let peer = self.peer;
        let mut out = Vec::new();
        for f in self.folders.values_mut().filter(|f| f.shared) {
            out.extend(f.pump(&peer, src));
        }
        out
    }

    fn fail(&mut self, code: ErrorCode, message: &str) -> Vec<Action> {
        self.closed = true;
        vec![
            Action::Send(Message::Error {
                code,
                message: message.to_string(),
            }),
            Action::Close {
                reason: message.to_string(),
            },
        ]
    }
}

impl FolderState {
    fn new(cfg: SessionFolder) -> FolderState {
        FolderState {
            our_acked: cfg.our_acked,
            their_applied: cfg.their_sequence,
            their_known_max: cfg.their_sequence,
            their_received: 0,
            shared: false,
            our_max: 0,
            sent_up_to: 0,
            in_flight: VecDeque::new(),
            receiving: VecDeque::new(),
            queued: VecDeque::new(),
            held: 0,
            inline_after: u64::MAX,
            inline_after_our_scan: false,
            our_scan: cfg.scanning.then(ScanCounts::default),
            our_scan_end: ScanCounts::default(),
            told_scan: None,
            their_scan: None,
            their_partial: false,
            cfg,
        }
    }

    /// Tells the peer what changed in our first scan since it was last told: its progress
    /// while it runs; once it has ended, that it has, with our highest sequence. Nothing when
    /// the peer was never told the scan runs.
    fn tell_scan(&mut self, src: &mut Reader<'_>) -> Vec<Action> {
        let Some(told) = self.told_scan else {
            return Vec::new();
        };
        let (scanning, counts) = match self.our_scan {
            Some(now) if now == told => return Vec::new(),
            Some(now) => (true, now),
            None => (false, self.our_scan_end),
        };
        self.told_scan = self.our_scan;
        self.our_max = self.our_max.max(src.max_sequence(&self.cfg.folder));
        vec![Action::Send(Message::Scan(ScanState {
            folder: self.cfg.folder.clone(),
            scanning,
            max_sequence: self.our_max,
            files_hashed: counts.files_hashed,
            bytes_hashed: counts.bytes_hashed,
            files_left: if scanning { counts.files_left } else { 0 },
        }))]
    }

    /// Sends batches while the window allows and records remain.
    fn pump(&mut self, peer: &DeviceId, src: &mut Reader<'_>) -> Vec<Action> {
        let mut out = Vec::new();
        self.our_max = self.our_max.max(src.max_sequence(&self.cfg.folder));
        while self.in_flight.len() < MAX_IN_FLIGHT && self.sent_up_to < self.our_max {
            let (mut records, scanned) =
                src.records_since(&self.cfg.folder, peer, self.sent_up_to, MAX_BATCH_RECORDS);
            self.our_max = self.our_max.max(scanned);
            let mut up_to = scanned;
            let mut bytes = 0usize;
            let mut keep = records.len();
            for (i, r) in records.iter().enumerate() {
                bytes += encoded_size_bound(r);
                if bytes > MAX_BATCH_BYTES && i > 0 {
                    keep = i;
                    up_to = records[i - 1].sequence;
                    break;
                }
            }
            records.truncate(keep);
            if let Some(last) = records.last() {
                up_to = up_to.max(last.sequence);
            }
            if up_to <= self.sent_up_to {
                // The source made no progress; wait for the next change.
                break;
            }
            self.sent_up_to = up_to;
            self.in_flight.push_back(up_to);
            out.push(Action::Send(Message::Index(IndexBatch {
                folder: self.cfg.folder.clone(),
                records,
                up_to,
                inline: Vec::new(),
            })));
        }
        out
    }

    /// Hands queued batches to the driver while fewer than [`RECEIVE_DEPTH`] are outstanding;
    /// an empty batch is acknowledged at once, or with the Receive it queued behind.
    fn deliver(&mut self) -> Vec<Action> {
        let mut out = Vec::new();
        while self.receiving.len() < RECEIVE_DEPTH {
            let Some((batch, held)) = self.queued.pop_front() else {
                break;
            };
            if batch.records.is_empty() {
                self.held -= held;
                match self.receiving.back_mut() {
                    Some(r) => r.ack_to = batch.up_to,
                    None => out.extend(self.progress(batch.up_to)),
                }
            } else {
                self.receiving.push_back(Receiving {
                    up_to: batch.up_to,
                    ack_to: batch.up_to,
                    applied: false,
                    held,
                });
                out.push(Action::Receive {
                    folder: batch.folder,
                    records: batch.records,
                    up_to: batch.up_to,
                    inline: batch.inline,
                });
            }
        }
        out
    }

    /// Their records up to `up_to` are applied: acknowledge and persist, never backwards.
    fn progress(&mut self, up_to: u64) -> Vec<Action> {
        if up_to <= self.their_applied {
            return Vec::new();
        }
        self.their_applied = up_to;
        vec![
            Action::Send(Message::IndexAck(IndexAck {
                folder: self.cfg.folder.clone(),
                sequence: up_to,
            })),
            Action::SaveTheirSequence {
                folder: self.cfg.folder.clone(),
                index_id: self.cfg.their_index_id,
                sequence: up_to,
            },
        ]
    }
}

/// An upper bound of a record's postcard encoding, in bytes.
fn encoded_size_bound(r: &FileRecord) -> usize {
    64 + r.path.as_str().len()
        + r.target.len()
        + r.chunks.len() * 38
        + r.version.entries().len() * 20
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshfs_protocol::{FileKind, Hash, RelPath, ShortId, VersionVector};

    /// An in-memory journal of one folder: records by sequence, each with its source device.
    #[derive(Default)]
    struct Journal {
        records: Vec<(FileRecord, Option<DeviceId>)>,
    }

    impl Journal {
        fn add(&mut self, path: &str, dev: u64) {
            let seq = self.records.len() as u64 + 1;
            self.records.push((record(path, dev, seq), None));
        }
    }

    impl IndexSource for Journal {
        fn records_since(
            &mut self,
            _f: &FolderId,
            peer: &DeviceId,
            after: u64,
            limit: usize,
        ) -> Result<(Vec<FileRecord>, u64), ReadError> {
            let mut out = Vec::new();
            let mut scanned = after;
            for (r, source) in self.records.iter().filter(|(r, _)| r.sequence > after) {
                if out.len() == limit {
                    break;
                }
                scanned = r.sequence;
                if source.as_ref() != Some(peer) {
                    out.push(r.clone());
                }
            }
            Ok((out, scanned))
        }
        fn max_sequence(&mut self, _f: &FolderId) -> Result<u64, ReadError> {
            Ok(self.records.len() as u64)
        }
    }

    fn record(path: &str, dev: u64, seq: u64) -> FileRecord {
        FileRecord {
            path: RelPath::new(path).unwrap(),
            kind: FileKind::File,
            deleted: false,
            mode: 0o644,
            mtime_ns: 0,
            size: 0,
            hash: Hash::ZERO,
            chunks: vec![],
            target: String::new(),
            version: VersionVector::new().incremented(ShortId(dev), 0),
            modified_by: ShortId(dev),
            sequence: seq,
        }
    }

    fn fid(s: &str) -> FolderId {
        FolderId::new(s).unwrap()
    }

    fn dev(n: u8) -> DeviceId {
        DeviceId::from_bytes([n; 32])
    }

    fn folder(name: &str, index_id: u64) -> SessionFolder {
        SessionFolder {
            folder: fid(name),
            index_id,
            their_index_id: 0,
            their_sequence: 0,
            our_acked: 0,
            scanning: false,
            partial: false,
        }
    }

    /// One side: its session, its journal, what it persisted and received.
    struct Side {
        session: Session,
        journal: Journal,
        id: DeviceId,
        received: Vec<FileRecord>,
        saved_their: Vec<(u64, u64)>,
        closed: Option<String>,
        max_in_flight: usize,
        /// Devices the peer newly sought, and address lists it told us.
        sought: Vec<DeviceId>,
        learned: Vec<AddressList>,
    }

    impl Side {
        fn new(me: u8, peer: u8, folders: Vec<SessionFolder>) -> Side {
            Side {
                session: Session::with_device(format!("dev{me}"), dev(me), dev(peer), folders),
                journal: Journal::default(),
                id: dev(me),
                received: vec![],
                saved_their: vec![],
                closed: None,
                max_in_flight: 0,
                sought: vec![],
                learned: vec![],
            }
        }
    }

    /// Runs both sides back to back until nothing moves; messages are delivered FIFO.
    /// Receives are applied immediately (records journaled with the peer as source).
    fn run(
        a: &mut Side,
        b: &mut Side,
        mut to_a: VecDeque<Message>,
        mut to_b: VecDeque<Message>,
        first: [Vec<Action>; 2],
    ) {
        let [fa, fb] = first;
        let mut pending: VecDeque<(bool, Action)> = fa
            .into_iter()
            .map(|x| (true, x))
            .chain(fb.into_iter().map(|x| (false, x)))
            .collect();
        for _ in 0..100_000 {
            if let Some((is_a, action)) = pending.pop_front() {
                let (me, to_peer) = if is_a {
                    (&mut *a, &mut to_b)
                } else {
                    (&mut *b, &mut to_a)
                };
                match action {
                    Action::Send(m) => {
                        if me.closed.is_none() {
                            to_peer.push_back(m)
                        }
                    }
                    Action::Receive {
                        folder,
                        records,
                        up_to,
                        ..
                    } => {
                        let peer = *me.session.peer();
                        for r in records {
                            me.received.push(r.clone());
                            let seq = me.journal.records.len() as u64 + 1;
                            me.journal
                                .records
                                .push((FileRecord { sequence: seq, ..r }, Some(peer)));
                        }
                        let mut more = me.session.applied(&folder, up_to);
                        // The journal grew: the driver tells every session, this one included.
                        more.extend(me.session.local_changed(&folder, &mut me.journal));
                        pending.extend(more.into_iter().map(|x| (is_a, x)));
                    }
                    Action::SaveTheirSequence {
                        index_id, sequence, ..
                    } => me.saved_their.push((index_id, sequence)),
                    Action::SaveOurAcked { .. } => {}
                    Action::Close { reason } => me.closed = Some(reason),
                    Action::Sought { devices } => me.sought.extend(devices),
                    Action::Learned(list) => me.learned.push(list),
                }
                continue;
            }
            for s in [&mut *a, &mut *b] {
                let now = s
                    .session
                    .folders
                    .values()
                    .map(|f| f.in_flight.len())
                    .max()
                    .unwrap_or(0);
                s.max_in_flight = s.max_in_flight.max(now);
            }
            if let Some(m) = to_a.pop_front() {
                if a.closed.is_none() {
                    let acts = a.session.handle(m, &mut a.journal);
                    pending.extend(acts.into_iter().map(|x| (true, x)));
                }
            } else if let Some(m) = to_b.pop_front() {
                if b.closed.is_none() {
                    let acts = b.session.handle(m, &mut b.journal);
                    pending.extend(acts.into_iter().map(|x| (false, x)));
                }
            } else {
                return;
            }
        }
        panic!("sessions did not go quiet");
    }

    fn connect(a: &mut Side, b: &mut Side) {
        let sa = a.session.start(&mut a.journal);
        let sb = b.session.start(&mut b.journal);
        run(a, b, VecDeque::new(), VecDeque::new(), [sa, sb]);
    }

    /// Whether `actions` are exactly: acknowledge up to `sequence`, and save it.
    fn acks_through(actions: &[Action], sequence: u64) -> bool {
        matches!(
            actions,
            [
                Action::Send(Message::IndexAck(IndexAck { sequence: a, .. })),
                Action::SaveTheirSequence { sequence: b, .. }
            ] if *a == sequence && *b == sequence
        )
    }

    fn status(s: &Side, f: &str) -> FolderSyncStatus {
        s.session.folder_status(&fid(f)).unwrap()
    }

    /// Reopens a side's session with the resume points it persisted.
    fn reconnect(s: &mut Side, peer: u8, index_id: u64) {
        let st = status(s, "f");
        let their = s.saved_their.last().copied().unwrap_or((0, 0));
        let f = SessionFolder {
            folder: fid("f"),
            index_id,
            their_index_id: their.0,
            their_sequence: their.1,
            our_acked: st.our_acked,
            scanning: false,
            partial: false,
        };
        s.session = Session::new(format!("dev{}", s.id.as_bytes()[0]), dev(peer), vec![f]);
        s.received.clear();
    }

    #[test]
    fn two_sessions_reach_in_sync_both_ways() {
        let mut a = Side::new(1, 2, vec![folder("f", 11)]);
        let mut b = Side::new(2, 1, vec![folder("f", 22)]);
        for i in 0..2500 {
            a.journal.add(&format!("a{i}"), 1);
        }
        for i in 0..30 {
            b.journal.add(&format!("b{i}"), 2);
        }
        connect(&mut a, &mut b);
        assert!(a.session.is_established() && b.session.is_established());
        assert_eq!(b.received.len(), 2500);
        assert_eq!(a.received.len(), 30);
        assert!(status(&a, "f").in_sync, "{:?}", status(&a, "f"));
        assert!(status(&b, "f").in_sync, "{:?}", status(&b, "f"));
        // Live update after sync.
        a.journal.add("late", 1);
        let acts = a.session.local_changed(&fid("f"), &mut a.journal);
        assert!(!status(&a, "f").in_sync);
        run(
            &mut a,
            &mut b,
            VecDeque::new(),
            VecDeque::new(),
            [acts, vec![]],
        );
        assert_eq!(b.received.last().unwrap().path.as_str(), "late");
        assert!(status(&a, "f").in_sync && status(&b, "f").in_sync);
    }

    fn scanning(name: &str, index_id: u64) -> SessionFolder {
        SessionFolder {
            scanning: true,
            ..folder(name, index_id)
        }
    }

    fn counts(files_hashed: u64, files_left: u64) -> ScanCounts {
        ScanCounts {
            files_hashed,
            bytes_hashed: files_hashed * 4096,
            files_left,
        }
    }

    /// The `Scan` messages among `actions`.
    fn scans(actions: &[Action]) -> Vec<ScanState> {
        actions
            .iter()
            .filter_map(|x| match x {
                Action::Send(Message::Scan(s)) => Some(s.clone()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_peer_in_its_first_scan_is_not_in_sync_until_it_says_the_scan_ended_and_all_is_applied() {
        let mut a = Side::new(1, 2, vec![scanning("f", 11)]);
        let mut b = Side::new(2, 1, vec![folder("f", 22)]);
        // a's scan journaled its first slice before the session started.
        for i in 0..5 {
            a.journal.add(&format!("first{i}"), 1);
        }
        connect(&mut a, &mut b);
        // b has everything a journaled so far, but a's disk holds more: b is not in sync.
        assert_eq!(b.received.len(), 5);
        let st = status(&b, "f");
        assert_eq!(st.their_scan, Some(ScanCounts::default()));
        assert!(!st.in_sync, "{st:?}");
        // a's view of b is not affected: b is not scanning and has acknowledged everything.
        assert!(status(&a, "f").in_sync);

        // The next slice: journaled, then its progress told.
        for i in 0..1000 {
            a.journal.add(&format!("second{i}"), 1);
        }
        let mut acts = a.session.local_changed(&fid("f"), &mut a.journal);
        acts.extend(
            a.session
                .scan_progress(&fid("f"), true, counts(1005, 995), &mut a.journal),
        );
        assert_eq!(scans(&acts).len(), 1);
        run(
            &mut a,
            &mut b,
            VecDeque::new(),
            VecDeque::new(),
            [acts, vec![]],
        );
        let st = status(&b, "f");
        assert_eq!(st.their_scan, Some(counts(1005, 995)));
        assert!(!st.in_sync);
        // The same progress again is not news.
        assert!(a
            .session
            .scan_progress(&fid("f"), true, counts(1005, 995), &mut a.journal)
            .is_empty());

        // The last slice is journaled and the scan ends before the session heard of the
        // change: the end is told after the batches, with the highest sequence.
        for i in 0..995 {
            a.journal.add(&format!("last{i}"), 1);
        }
        let acts = a
            .session
            .scan_progress(&fid("f"), false, counts(2000, 0), &mut a.journal);
        let told = scans(&acts);
        assert_eq!(told.len(), 1);
        assert!(!told[0].scanning);
        assert_eq!(
            (
                told[0].max_sequence,
                told[0].files_hashed,
                told[0].files_left
            ),
            (2000, 2000, 0)
        );
        assert!(
            matches!(acts.last(), Some(Action::Send(Message::Scan(_)))),
            "the batches the window allows go first"
        );
        run(
            &mut a,
            &mut b,
            VecDeque::new(),
            VecDeque::new(),
            [acts, vec![]],
        );
        assert_eq!(b.received.len(), 2000);
        let st = status(&b, "f");
        assert_eq!(st.their_scan, None);
        assert!(st.in_sync, "{st:?}");
        assert!(status(&a, "f").in_sync);
        // A first scan runs once: a later report of one is not sent.
        assert!(a
            .session
            .scan_progress(&fid("f"), true, counts(1, 1), &mut a.journal)
            .is_empty());
    }

    #[test]
    fn the_end_of_a_scan_is_not_in_sync_before_every_record_up_to_its_max_sequence_is_applied() {
        let mut b = Side::new(2, 1, vec![folder("f", 22)]);
        b.session.start(&mut b.journal);
        let hello = Message::Hello(Hello {
            protocol_version: PROTOCOL_VERSION,
            device_name: "a".into(),
            folders: vec![HelloFolder {
                folder: fid("f"),
                index_id: 11,
                your_index_id: 0,
                your_sequence: 0,
                max_sequence: 0,
                scanning: true,
                partial: false,
            }],
        });
        b.session.handle(hello, &mut b.journal);
        // The end overtakes the batches (a full window): it carries a's highest sequence.
        let end = Message::Scan(ScanState {
            folder: fid("f"),
            scanning: false,
            max_sequence: 3,
            files_hashed: 3,
            bytes_hashed: 3,
            files_left: 0,
        });
        assert!(b.session.handle(end, &mut b.journal).is_empty());
        let st = status(&b, "f");
        assert_eq!((st.their_scan, st.their_known_max), (None, 3));
        assert!(!st.in_sync, "nothing of a applied yet: {st:?}");
        let batch = Message::Index(IndexBatch {
            folder: fid("f"),
            records: vec![record("x", 1, 1), record("y", 1, 3)],
            up_to: 3,
            inline: Vec::new(),
        });
        b.session.handle(batch, &mut b.journal);
        assert!(!status(&b, "f").in_sync, "received, not applied");
        b.session.applied(&fid("f"), 3);
        assert!(status(&b, "f").in_sync);
    }

    #[test]
    fn a_scan_state_the_peer_may_not_send_ends_the_session() {
        let hello = |scanning| {
            Message::Hello(Hello {
                protocol_version: PROTOCOL_VERSION,
                device_name: "a".into(),
                folders: vec![HelloFolder {
                    folder: fid("f"),
                    index_id: 11,
                    your_index_id: 0,
                    your_sequence: 0,
                    max_sequence: 0,
                    scanning,
                    partial: false,
                }],
            })
        };
        let scan = |folder: &str, scanning| {
            Message::Scan(ScanState {
                folder: fid(folder),
                scanning,
                max_sequence: 0,
                files_hashed: 0,
                bytes_hashed: 0,
                files_left: 0,
            })
        };
        let refused = |acts: Vec<Action>, code: ErrorCode| matches!(&acts[..], [Action::Send(Message::Error { code: c, .. }), Action::Close { .. }] if *c == code);
        // Before the hello.
        let mut b = Side::new(2, 1, vec![folder("f", 22)]);
        b.session.start(&mut b.journal);
        let acts = b.session.handle(scan("f", true), &mut b.journal);
        assert!(refused(acts, ErrorCode::BadFrame));
        // For a folder the peer did not say it was scanning.
        let mut b = Side::new(2, 1, vec![folder("f", 22)]);
        b.session.handle(hello(false), &mut b.journal);
        let acts = b.session.handle(scan("f", false), &mut b.journal);
        assert!(refused(acts, ErrorCode::BadFrame));
        // Scanning again after saying the scan ended.
        let mut b = Side::new(2, 1, vec![folder("f", 22)]);
        b.session.handle(hello(true), &mut b.journal);
        assert!(b
            .session
            .handle(scan("f", false), &mut b.journal)
            .is_empty());
        let acts = b.session.handle(scan("f", true), &mut b.journal);
        assert!(refused(acts, ErrorCode::BadFrame));
        // For a folder not shared in both hellos.
        let mut b = Side::new(2, 1, vec![folder("f", 22), folder("g", 23)]);
        b.session.handle(hello(true), &mut b.journal);
        let acts = b.session.handle(scan("g", false), &mut b.journal);
        assert!(refused(acts, ErrorCode::NotShared));
    }

    #[test]
    fn a_scan_that_moved_on_before_the_peer_said_hello_is_told_once_the_peer_has() {
        let mut a = Side::new(1, 2, vec![scanning("f", 11)]);
        let mut b = Side::new(2, 1, vec![folder("f", 22)]);
        let sa = a.session.start(&mut a.journal);
        let Some(Action::Send(Message::Hello(h))) = sa.first() else {
            panic!("{sa:?}")
        };
        assert!(h.folders[0].scanning);
        // Not established: nothing is sent yet.
        a.journal.add("x", 1);
        assert!(a
            .session
            .scan_progress(&fid("f"), false, counts(1, 0), &mut a.journal)
            .is_empty());
        let sb = b.session.start(&mut b.journal);
        run(&mut a, &mut b, VecDeque::new(), VecDeque::new(), [sa, sb]);
        let st = status(&b, "f");
        assert_eq!(st.their_scan, None);
        assert!(st.in_sync, "{st:?}");
        assert_eq!(b.received.len(), 1);
        // A Hello built after the scan ended says it is not scanning, and no Scan follows.
        reconnect(&mut a, 2, 11);
        reconnect(&mut b, 1, 22);
        let sa = a.session.start(&mut a.journal);
        let Some(Action::Send(Message::Hello(h))) = sa.first() else {
            panic!("{sa:?}")
        };
        assert!(!h.folders[0].scanning);
    }

    #[test]
    fn once_the_peer_ends_its_first_scan_what_we_journal_next_carries_its_content() {
        let mut e = Side::new(5, 6, vec![folder("f", 55)]);
        let mut g = Side::new(6, 5, vec![scanning("f", 66)]);
        e.journal.add("y", 5);
        connect(&mut e, &mut g);
        assert_eq!(e.session.inline_after(&fid("f")), u64::MAX);
        let acts = g
            .session
            .scan_progress(&fid("f"), false, counts(0, 0), &mut g.journal);
        run(
            &mut e,
            &mut g,
            VecDeque::new(),
            VecDeque::new(),
            [vec![], acts],
        );
        assert_eq!(
            e.session.inline_after(&fid("f")),
            1,
            "records journaled from now on are new to g"
        );
        assert!(status(&e, "f").in_sync && status(&g, "f").in_sync);
    }

    #[test]
    fn records_received_from_the_peer_are_not_echoed_but_sequence_is_acked() {
        let mut a = Side::new(1, 2, vec![folder("f", 11)]);
        let mut b = Side::new(2, 1, vec![folder("f", 22)]);
        a.journal.add("x", 1);
        connect(&mut a, &mut b);
        // b journaled x with a as the source: b's records since 0 for a are all filtered, yet
        // a acknowledged b's sequence (an empty batch carried up_to).
        assert!(a.received.is_empty());
        assert_eq!(status(&b, "f").our_acked, 1);
        assert!(status(&b, "f").in_sync);
    }

    #[test]
    fn resume_after_reconnect_sends_only_what_changed() {
        let mut a = Side::new(1, 2, vec![folder("f", 11)]);
        let mut b = Side::new(2, 1, vec![folder("f", 22)]);
        for i in 0..50 {
            a.journal.add(&format!("a{i}"), 1);
        }
        connect(&mut a, &mut b);
        a.journal.add("new", 1);
        reconnect(&mut a, 2, 11);
        reconnect(&mut b, 1, 22);
        connect(&mut a, &mut b);
        assert_eq!(
            b.received
                .iter()
                .map(|r| r.path.as_str())
                .collect::<Vec<_>>(),
            vec!["new"]
        );
        assert!(status(&a, "f").in_sync && status(&b, "f").in_sync);
    }

    #[test]
    fn each_side_tells_the_other_where_the_devices_it_seeks_are() {
        let mut a = Side::new(1, 2, vec![folder("f", 11)]);
        let mut b = Side::new(2, 1, vec![folder("f", 22)]);
        let laptop = dev(3);
        let at = |port| WireAddr::V4 {
            ip: [10, 0, 0, 3],
            port,
        };
        // Asked before the hellos: sent once they are through; neither end is ever sought.
        assert!(a.session.seek([laptop, dev(1), dev(2)].into()).is_empty());
        connect(&mut a, &mut b);
        assert_eq!(b.sought, vec![laptop]);
        assert_eq!(b.session.sought_by_peer(), vec![laptop]);
        let told = b.session.tell_addresses(laptop, vec![at(7788)]);
        assert!(b.session.tell_addresses(laptop, vec![at(7788)]).is_empty());
        assert!(b.session.tell_addresses(dev(4), vec![at(1)]).is_empty());
        run(
            &mut a,
            &mut b,
            VecDeque::new(),
            VecDeque::new(),
            [Vec::new(), told],
        );
        assert_eq!(a.learned.len(), 1);
        assert_eq!(a.learned[0].device, laptop);
        assert_eq!(a.learned[0].addrs, vec![at(7788)]);
        assert!(a.closed.is_none() && b.closed.is_none());
    }

    #[test]
    fn a_seek_or_an_address_list_before_the_hello_ends_the_session() {
        let list = meshfs_protocol::SeekList {
            devices: vec![dev(3)],
        };
        let mut a = Side::new(1, 2, vec![folder("f", 11)]);
        let acts = a.session.handle(Message::Seek(list), &mut a.journal);
        assert!(acts.iter().any(
            |x| matches!(x, Action::Send(Message::Error { code, .. }) if *code == ErrorCode::BadFrame)
        ));
        let mut a = Side::new(1, 2, vec![folder("f", 11)]);
        let addrs = Message::Addresses(AddressList {
            device: dev(3),
            addrs: vec![],
        });
        let acts = a.session.handle(addrs, &mut a.journal);
        assert!(matches!(acts.last(), Some(Action::Close { .. })));
    }

    #[test]
    fn each_side_hears_which_other_devices_the_other_is_connected_to() {
        let mut a = Side::new(1, 2, vec![folder("f", 11)]);
        let mut b = Side::new(2, 1, vec![folder("f", 22)]);
        let (c, d) = (dev(3).short(), dev(4).short());
        let f = || fid("f");
        // Said before the hellos: kept until they are exchanged. The peer itself is left out,
        // and so is a folder the session does not share.
        let said = a
            .session
            .connected_peers([(f(), vec![c, dev(2).short()]), (fid("other"), vec![d])]);
        assert!(said.is_empty());
        connect(&mut a, &mut b);
        assert!(b.session.peer_hears(&f(), c));
        assert!(!b.session.peer_hears(&f(), dev(2).short()), "not itself");
        assert!(!b.session.peer_hears(&fid("other"), d));
        assert!(
            !a.session.peer_hears(&f(), c),
            "b said nothing: connected to none"
        );
        // A change is told once; the same list again is not.
        let told = a.session.connected_peers([(f(), vec![c, d])]);
        assert!(
            matches!(&told[..], [Action::Send(Message::Peers(p))] if p.connected == vec![c.min(d), c.max(d)])
        );
        assert!(a.session.connected_peers([(f(), vec![d, c])]).is_empty());
        run(
            &mut a,
            &mut b,
            VecDeque::new(),
            VecDeque::new(),
            [told, Vec::new()],
        );
        assert!(b.session.peer_hears(&f(), d));
        let gone = a.session.connected_peers([(f(), vec![d])]);
        run(
            &mut a,
            &mut b,
            VecDeque::new(),
            VecDeque::new(),
            [gone, Vec::new()],
        );
        assert!(!b.session.peer_hears(&f(), c) && b.session.peer_hears(&f(), d));
        // No one left: an empty list says so.
        let none = a.session.connected_peers([]);
        assert!(matches!(&none[..], [Action::Send(Message::Peers(p))] if p.connected.is_empty()));
        run(
            &mut a,
            &mut b,
            VecDeque::new(),
            VecDeque::new(),
            [none, Vec::new()],
        );
        assert!(!b.session.peer_hears(&f(), d));
        // A list for a folder not shared in both hellos, or before the sender's hello, breaks
        // the protocol.
        let refused = |acts: &[Action], code: ErrorCode| {
            acts.iter()
                .any(|x| matches!(x, Action::Send(Message::Error { code: c, .. }) if *c == code))
                && matches!(acts.last(), Some(Action::Close { .. }))
        };
        let unshared = Message::Peers(PeerList {
            folder: fid("other"),
            connected: vec![c],
        });
        let acts = b.session.handle(unshared, &mut b.journal);
        assert!(refused(&acts, ErrorCode::NotShared));
        let mut e = Side::new(5, 6, vec![folder("f", 55)]);
        let early = Message::Peers(PeerList {
            folder: f(),
            connected: vec![c],
        });
        let acts = e.session.handle(early, &mut e.journal);
        assert!(refused(&acts, ErrorCode::BadFrame));
    }

    #[test]
    fn inline_content_only_where_the_peer_cannot_have_it() {
        // An empty peer: everything of ours is news to it.
        let mut a = Side::new(1, 2, vec![folder("f", 11)]);
        let mut b = Side::new(2, 1, vec![folder("f", 22)]);
        assert_eq!(a.session.inline_after(&fid("f")), u64::MAX, "before hello");
        for i in 0..5 {
            a.journal.add(&format!("a{i}"), 1);
        }
        connect(&mut a, &mut b);
        assert_eq!(a.session.inline_after(&fid("f")), 0);
        // Two devices that each scanned a tree of their own: what is journaled at hello may
        // already be on the peer; only later changes are attached.
        let mut c = Side::new(3, 4, vec![folder("f", 33)]);
        let mut d = Side::new(4, 3, vec![folder("f", 44)]);
        for i in 0..5 {
            c.journal.add(&format!("x{i}"), 3);
            d.journal.add(&format!("x{i}"), 4);
        }
        connect(&mut c, &mut d);
        assert_eq!(c.session.inline_after(&fid("f")), 5);
        // Once the peer has seen our index, a reconnect resumes and all that follows is new.
        c.journal.add("later", 3);
        reconnect(&mut c, 4, 33);
        reconnect(&mut d, 3, 44);
        connect(&mut c, &mut d);
        assert_eq!(c.session.inline_after(&fid("f")), 0);
        assert_eq!(d.received.len(), 1);
        // A peer still in its first scan may have any of our files on disk, whatever its
        // journal says: nothing is attached to it in this session, not even from a resume.
        let mut e = Side::new(5, 6, vec![folder("f", 55)]);
        let mut g = Side::new(
            6,
            5,
            vec![SessionFolder {
                scanning: true,
                ..folder("f", 66)
            }],
        );
        e.journal.add("y", 5);
        connect(&mut e, &mut g);
        assert_eq!(e.session.inline_after(&fid("f")), u64::MAX);
        assert_eq!(g.received.len(), 1, "records still flow");
        // Nor does g attach any while its own scan runs: e is not empty, and what g's scan
        // journals may be on e's disk too (two devices that start with the same tree). From
        // the scan's end on, what g journals is news to e.
        assert_eq!(g.session.inline_after(&fid("f")), u64::MAX, "g is scanning");
        for i in 0..3 {
            g.journal.add(&format!("y{i}"), 6);
        }
        let acts = g
            .session
            .scan_progress(&fid("f"), false, counts(3, 0), &mut g.journal);
        // g's journal: e's record it applied, then its scan's three.
        assert_eq!(
            g.session.inline_after(&fid("f")),
            4,
            "from the scan's end on"
        );
        run(
            &mut g,
            &mut e,
            VecDeque::new(),
            VecDeque::new(),
            [acts, vec![]],
        );
        assert_eq!(e.received.len(), 3, "its records reach e");
        // An empty peer still gets content while our scan runs: it can hold none of it.
        let mut h = Side::new(
            7,
            8,
            vec![SessionFolder {
                scanning: true,
                ..folder("f", 77)
            }],
        );
        let mut k = Side::new(8, 7, vec![folder("f", 88)]);
        h.journal.add("z", 7);
        connect(&mut h, &mut k);
        assert_eq!(h.session.inline_after(&fid("f")), 0, "k is empty");
    }

    #[test]
    fn a_peer_that_keeps_part_of_a_folder_gets_no_content_attached_and_is_not_a_holder() {
        let mut a = Side::new(1, 2, vec![folder("f", 11)]);
        let mut b = Side::new(
            2,
            1,
            vec![SessionFolder {
                partial: true,
                scanning: true,
                ..folder("f", 22)
            }],
        );
        a.journal.add("x", 1);
        connect(&mut a, &mut b);
        assert_eq!(a.session.inline_after(&fid("f")), u64::MAX);
        assert_eq!(b.received.len(), 1, "records flow");
        assert_eq!(a.session.partial_folders(), BTreeSet::from([fid("f")]));
        assert!(b.session.partial_folders().is_empty(), "a keeps all of it");
        // Its first scan ends: still nothing attached.
        let acts = b
            .session
            .scan_progress(&fid("f"), false, counts(1, 0), &mut b.journal);
        run(
            &mut b,
            &mut a,
            VecDeque::new(),
            VecDeque::new(),
            [acts, vec![]],
        );
        assert_eq!(a.session.inline_after(&fid("f")), u64::MAX);
    }

    #[test]
    fn reset_index_id_resends_everything() {
        let mut a = Side::new(1, 2, vec![folder("f", 11)]);
        let mut b = Side::new(2, 1, vec![folder("f", 22)]);
        for i in 0..50 {
            a.journal.add(&format!("a{i}"), 1);
        }
        connect(&mut a, &mut b);
        // a's journal is recreated: new epoch, same content.
        reconnect(&mut a, 2, 99);
        reconnect(&mut b, 1, 22);
        connect(&mut a, &mut b);
        assert_eq!(b.received.len(), 50);
        assert!(b.saved_their.contains(&(99, 0)), "{:?}", b.saved_their);
        assert!(status(&a, "f").in_sync && status(&b, "f").in_sync);
    }

    #[test]
    fn unshared_folder_in_a_batch_closes_without_receive() {
        let mut a = Side::new(1, 2, vec![folder("f", 11)]);
        let mut b = Side::new(2, 1, vec![folder("f", 22)]);
        connect(&mut a, &mut b);
        let batch = Message::Index(IndexBatch {
            folder: fid("secret"),
            records: vec![record("x", 2, 1)],
            up_to: 1,
            inline: Vec::new(),
        });
        let acts = a.session.handle(batch, &mut a.journal);
        assert!(acts.iter().all(|x| !matches!(x, Action::Receive { .. })));
        assert!(
            matches!(
                &acts[..],
                [
                    Action::Send(Message::Error {
                        code: ErrorCode::NotShared,
                        ..
                    }),
                    Action::Close { .. }
                ]
            ),
            "{acts:?}"
        );
        assert!(!a.session.is_established());
        // A folder we share but the peer does not is not exchanged either.
        let mut c = Side::new(3, 4, vec![folder("f", 1), folder("only-mine", 2)]);
        let mut d = Side::new(4, 3, vec![folder("f", 3)]);
        connect(&mut c, &mut d);
        assert!(status(&c, "only-mine").not_shared && !status(&c, "only-mine").in_sync);
        assert!(!status(&c, "f").not_shared && status(&c, "f").in_sync);
        let ack = Message::IndexAck(IndexAck {
            folder: fid("only-mine"),
            sequence: 0,
        });
        let acts = c.session.handle(ack, &mut c.journal);
        assert!(matches!(acts.last(), Some(Action::Close { .. })));
    }

    #[test]
    fn version_mismatch_closes() {
        let mut a = Side::new(1, 2, vec![folder("f", 11)]);
        a.session.start(&mut a.journal);
        let hello = Message::Hello(Hello {
            protocol_version: PROTOCOL_VERSION + 1,
            device_name: "x".into(),
            folders: vec![],
        });
        let acts = a.session.handle(hello, &mut a.journal);
        assert!(
            matches!(
                &acts[..],
                [
                    Action::Send(Message::Error {
                        code: ErrorCode::Version,
                        ..
                    }),
                    Action::Close { .. }
                ]
            ),
            "{acts:?}"
        );
        assert!(a
            .session
            .handle(
                Message::IndexAck(IndexAck {
                    folder: fid("f"),
                    sequence: 0
                }),
                &mut a.journal
            )
            .is_empty());
    }

    #[test]
    fn flow_control_never_exceeds_four_outstanding_batches() {
        let mut a = Side::new(1, 2, vec![folder("f", 11)]);
        let mut b = Side::new(2, 1, vec![folder("f", 22)]);
        for i in 0..10_500 {
            a.journal.add(&format!("a{i}"), 1);
        }
        let sa = a.session.start(&mut a.journal);
        let sb = b.session.start(&mut b.journal);
        // Deliver hellos only; count the batches a sends without any ack.
        let hello_b = sb
            .into_iter()
            .find_map(|x| {
                if let Action::Send(m) = x {
                    Some(m)
                } else {
                    None
                }
            })
            .unwrap();
        let acts = a.session.handle(hello_b, &mut a.journal);
        let batches = acts
            .iter()
            .filter(|x| matches!(x, Action::Send(Message::Index(_))))
            .count();
        assert_eq!(batches, MAX_IN_FLIGHT);
        // More local changes do not open the window.
        a.journal.add("more", 1);
        assert!(a
            .session
            .local_changed(&fid("f"), &mut a.journal)
            .is_empty());
        // A full exchange completes, never with more than four in flight.
        let mut a2 = Side::new(1, 2, vec![folder("f", 11)]);
        a2.journal = std::mem::take(&mut a.journal);
        let mut b2 = Side::new(2, 1, vec![folder("f", 22)]);
        let _ = sa;
        connect(&mut a2, &mut b2);
        assert_eq!(b2.received.len(), 10_501);
        assert!(a2.max_in_flight <= MAX_IN_FLIGHT, "{}", a2.max_in_flight);
        assert!(status(&a2, "f").in_sync);
    }

    /// Side a of folder `f`, established with b, whose hello says it has records up to
    /// `max_sequence`.
    fn hearing_b(max_sequence: u64) -> Side {
        let mut a = Side::new(1, 2, vec![folder("f", 11)]);
        a.session.start(&mut a.journal);
        let hello = Message::Hello(Hello {
            protocol_version: PROTOCOL_VERSION,
            device_name: "b".into(),
            folders: vec![HelloFolder {
                folder: fid("f"),
                index_id: 5,
                your_index_id: 0,
                your_sequence: 0,
                max_sequence,
                scanning: false,
                partial: false,
            }],
        });
        a.session.handle(hello, &mut a.journal);
        a
    }

    /// b's index batch of folder `f`.
    fn index_batch(records: Vec<FileRecord>, up_to: u64) -> Message {
        Message::Index(IndexBatch {
            folder: fid("f"),
            records,
            up_to,
            inline: Vec::new(),
        })
    }

    #[test]
    fn a_receive_reported_before_an_older_one_is_acknowledged_once_both_are_applied() {
        let mut a = hearing_b(3);
        a.session
            .handle(index_batch(vec![record("x", 2, 1)], 2), &mut a.journal);
        a.session
            .handle(index_batch(vec![record("y", 2, 3)], 3), &mut a.journal);
        // The newer Receive reports first (each apply reports from its own task): nothing is
        // acknowledged past what is applied in order...
        let early = a.session.applied(&fid("f"), 3);
        assert!(
            !early
                .iter()
                .any(|x| matches!(x, Action::Send(Message::IndexAck(_)))),
            "{early:?}"
        );
        assert!(!status(&a, "f").in_sync);
        // ... and once the older one reports, both are: the folder is in sync, nothing waits.
        let late = a.session.applied(&fid("f"), 2);
        assert!(acks_through(&late, 3), "{late:?}");
        let st = status(&a, "f");
        assert_eq!(
            (st.their_applied, st.their_known_max, st.receiving),
            (3, 3, false)
        );
        assert!(st.in_sync, "{st:?}");
    }

    #[test]
    fn receives_are_pipelined_three_deep_and_acknowledged_in_order() {
        let mut a = hearing_b(9);
        let r1 = a
            .session
            .handle(index_batch(vec![record("x", 2, 1)], 2), &mut a.journal);
        assert!(matches!(&r1[..], [Action::Receive { up_to: 2, .. }]));
        // The second and third are handed out before the first is applied
        // (RECEIVE_DEPTH = 3) ...
        assert_eq!(RECEIVE_DEPTH, 3);
        let r2 = a
            .session
            .handle(index_batch(vec![record("y", 2, 3)], 4), &mut a.journal);
        assert!(matches!(&r2[..], [Action::Receive { up_to: 4, .. }]));
        let r3 = a
            .session
            .handle(index_batch(vec![record("w", 2, 5)], 6), &mut a.journal);
        assert!(matches!(&r3[..], [Action::Receive { up_to: 6, .. }]));
        // ... an empty batch waits, and nothing is acknowledged yet. That is the sender's
        // whole window (MAX_IN_FLIGHT = 4): one more would be refused.
        assert_eq!(MAX_IN_FLIGHT, 4);
        assert!(a
            .session
            .handle(index_batch(vec![], 7), &mut a.journal)
            .is_empty());
        assert!(!status(&a, "f").in_sync);
        // Partial progress keeps the first Receive outstanding.
        let p = a.session.applied(&fid("f"), 1);
        assert!(acks_through(&p, 1), "{p:?}");
        assert!(status(&a, "f").receiving);
        // The first applied: acknowledged up to 2 only (the others are still outstanding, the
        // empty batch waits behind the third), and the fourth is handed out.
        let next = a.session.applied(&fid("f"), 2);
        let acked: Vec<u64> = next
            .iter()
            .filter_map(|x| match x {
                Action::Send(Message::IndexAck(a)) => Some(a.sequence),
                _ => None,
            })
            .collect();
        assert_eq!(acked, vec![2]);
        // The sender's window has room again: its next batch is handed out at once.
        let next = a
            .session
            .handle(index_batch(vec![record("z", 2, 8)], 9), &mut a.journal);
        assert!(
            matches!(next.last(), Some(Action::Receive { up_to: 9, .. })),
            "{next:?}"
        );
        let second = a.session.applied(&fid("f"), 4);
        assert!(acks_through(&second, 4), "{second:?}");
        let third = a.session.applied(&fid("f"), 6);
        assert!(
            acks_through(&third, 7),
            "the empty batch is acknowledged with the Receive it waited behind: {third:?}"
        );
        a.session.applied(&fid("f"), 9);
        let st = status(&a, "f");
        assert_eq!(
            (st.their_applied, st.their_known_max, st.receiving),
            (9, 9, false)
        );
        assert!(st.in_sync);
        // Progress never goes backwards; an out-of-order batch is a protocol violation.
        let old = index_batch(vec![record("z", 2, 3)], 3);
        assert!(matches!(
            a.session.handle(old, &mut a.journal).last(),
            Some(Action::Close { .. })
        ));
    }

    #[test]
    fn a_peer_that_ignores_the_batch_window_is_refused_not_queued() {
        let mut a = Side::new(1, 2, vec![folder("f", 11)]);
        let hello = Message::Hello(Hello {
            protocol_version: PROTOCOL_VERSION,
            device_name: "b".into(),
            folders: vec![HelloFolder {
                folder: fid("f"),
                index_id: 22,
                your_index_id: 11,
                your_sequence: 0,
                max_sequence: 100,
                scanning: false,
                partial: false,
            }],
        });
        a.session.handle(hello, &mut a.journal);
        let mut last = Vec::new();
        for i in 0..MAX_IN_FLIGHT as u64 + 1 {
            let b = Message::Index(IndexBatch {
                folder: fid("f"),
                records: vec![record(&format!("r{i}"), 2, i + 1)],
                up_to: i + 1,
                inline: Vec::new(),
            });
            last = a.session.handle(b, &mut a.journal);
        }
        assert!(
            matches!(last.last(), Some(Action::Close { .. })),
            "{last:?}"
        );
    }

    #[test]
    fn a_session_holding_its_budget_of_batches_takes_no_more_messages_until_one_applies() {
        let mut a = hearing_b(100);
        let big = |seq: u64| {
            let mut r = record(&format!("big{seq}"), 2, seq);
            r.target = "t".repeat(RECEIVE_BUDGET / 3);
            r
        };
        assert!(a.session.wants_messages());
        for seq in 1..=2 {
            a.session
                .handle(index_batch(vec![big(seq)], seq), &mut a.journal);
            assert!(a.session.wants_messages(), "after {seq}");
        }
        // The third passes the budget: it is taken, and nothing more is read.
        a.session
            .handle(index_batch(vec![big(3)], 3), &mut a.journal);
        assert!(a.session.held_bytes() >= RECEIVE_BUDGET);
        assert!(!a.session.wants_messages());
        // Applied (and acknowledged), the first lets go of what it held.
        let acts = a.session.applied(&fid("f"), 1);
        assert!(acks_through(&acts, 1), "{acts:?}");
        assert!(a.session.wants_messages());
        a.session.applied(&fid("f"), 2);
        a.session.applied(&fid("f"), 3);
        assert_eq!(a.session.held_bytes(), 0);
    }

    #[test]
    fn a_batch_sent_stays_within_the_vector_entries_a_receiver_takes() {
        let mut a = Side::new(1, 2, vec![folder("f", 11)]);
        for i in 0..200u64 {
            let seq = i + 1;
            let mut r = record(&format!("long{i}"), 1, seq);
            r.version = VersionVector::from_pairs(
                (1..meshfs_protocol::MAX_VV_ENTRIES as u64).map(|d| (ShortId(d * 1000 + i), 1)),
            );
            a.journal.records.push((r, None));
        }
        let mut b = Side::new(2, 1, vec![folder("f", 22)]);
        let (fa, fb) = (
            a.session.start(&mut a.journal),
            b.session.start(&mut b.journal),
        );
        let mut sent = Vec::new();
        let mut pending: VecDeque<Action> = fa.into();
        let hello_b = fb
            .into_iter()
            .find_map(|x| match x {
                Action::Send(m @ Message::Hello(_)) => Some(m),
                _ => None,
            })
            .unwrap();
        pending.extend(a.session.handle(hello_b, &mut a.journal));
        while let Some(act) = pending.pop_front() {
            if let Action::Send(Message::Index(batch)) = act {
                assert!(
                    batch.vector_entries() <= meshfs_protocol::MAX_VV_ENTRIES_PER_BATCH,
                    "{} entries",
                    batch.vector_entries()
                );
                let ack = Message::IndexAck(IndexAck {
                    folder: batch.folder.clone(),
                    sequence: batch.up_to,
                });
                sent.extend(batch.records);
                pending.extend(a.session.handle(ack, &mut a.journal));
            }
        }
        assert_eq!(sent.len(), 200);
    }

    #[test]
    fn big_chunk_lists_split_batches_by_size() {
        let mut a = Side::new(1, 2, vec![folder("f", 11)]);
        let mut b = Side::new(2, 1, vec![folder("f", 22)]);
        for i in 0..40 {
            a.journal.add(&format!("big{i}"), 1);
            let r = &mut a.journal.records.last_mut().unwrap().0;
            r.chunks = vec![
                meshfs_protocol::Chunk {
                    len: 1,
                    hash: Hash::ZERO
                };
                20_000
            ];
            r.size = 20_000;
        }
        let sa = a.session.start(&mut a.journal);
        let sb = b.session.start(&mut b.journal);
        let hello_b = sb
            .into_iter()
            .find_map(|x| {
                if let Action::Send(m) = x {
                    Some(m)
                } else {
                    None
                }
            })
            .unwrap();
        for act in a.session.handle(hello_b, &mut a.journal) {
            if let Action::Send(m @ Message::Index(_)) = act {
                let frame = meshfs_protocol::encode_frame(&m).unwrap();
                assert!(frame.len() <= MAX_BATCH_BYTES + 1024, "{}", frame.len());
            }
        }
        let _ = sa;
    }
}
