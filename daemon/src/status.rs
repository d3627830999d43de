//! The daemon's state as the `status --json` document, and the rule that says when a folder
//! is in sync.
//!
//! Owns the document's shape ([`Status`], written out by serde; `docs/cli.md` lists every
//! field) and the rule ([`in_sync`]). Both are pure: [`build`] takes a [`Snapshot`] of plain
//! values that the engine gathered under its locks, and reads no lock, clock, file or socket
//! itself, so every reason a folder is not in sync is tested here with plain values. The words
//! `meshfs status` prints are made from the document by `readout`, not here.

use crate::config::PeerConfig;
use crate::discovery::book::{Candidate, Source};
use crate::journal::FolderCounts;
use crate::last_error::LastError;
use crate::mounts::MountStatus;
use crate::progress::Counts;
use meshfs_protocol::{DeviceId, FolderId, RelPath};
use meshfs_sync::session::FolderSyncStatus;
use serde::Serialize;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// Everything [`build`] needs, gathered by the engine in one pass.
#[derive(Clone, Debug)]
pub struct Snapshot {
    /// This device.
    pub device: DeviceSnapshot,
    /// The running folders.
    pub folders: Vec<FolderSnapshot>,
    /// The configured peers, in config order.
    pub peers: Vec<PeerSnapshot>,
    /// Exchange progress by (peer, folder), as the sessions last reported it.
    pub sync: HashMap<(DeviceId, FolderId), FolderSyncStatus>,
    /// Unknown devices that tried to connect.
    pub refused: Vec<DeviceId>,
    /// UDP bytes (sent, received) over all peer connections since the daemon started.
    pub bytes: (u64, u64),
    /// Of the bytes sent, those declared lost and sent again.
    pub resent: u64,
}

/// This device, as `status` shows it.
#[derive(Clone, Debug)]
pub struct DeviceSnapshot {
    /// Its id.
    pub id: DeviceId,
    /// `device.name`.
    pub name: String,
    /// `device.listen`, as configured.
    pub listen: String,
    /// Seconds since the daemon started.
    pub uptime_secs: u64,
    /// When the daemon started (Unix seconds).
    pub started_unix: u64,
    /// Local discovery.
    pub discovery: DiscoveryStatus,
}

/// `device.discovery` in [`Status`]: local discovery's switch and counts.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DiscoveryStatus {
    /// `[discovery] local`: announcing and listening on the LAN.
    pub local: bool,
    /// The UDP port of announcements.
    pub port: u16,
    /// Announcement datagrams sent since start (one per interface and family).
    pub sent: u64,
    /// Datagrams received on the port.
    pub received: u64,
    /// Received and not read: over a source's or the overall rate.
    pub limited: u64,
    /// Read and refused: not an announcement, or malformed.
    pub refused: u64,
    /// Other devices' announcements read (a peer's, or an unknown device's, which is ignored).
    pub heard: u64,
    /// Addresses known for peers (learned, remembered), in all.
    pub known_addresses: usize,
}

/// One running folder.
#[derive(Clone, Debug)]
pub struct FolderSnapshot {
    /// Its id.
    pub id: FolderId,
    /// The replica directory.
    pub path: PathBuf,
    /// What the journal holds of it.
    pub counts: FolderCounts,
    /// This device's highest journal sequence for it.
    pub sequence: u64,
    /// Conflict files that still exist.
    pub conflicts: usize,
    /// Its own work still to do.
    pub local: LocalWork,
    /// Remote versions that could not be applied: (path, error).
    pub skipped: Vec<(RelPath, String)>,
    /// Files that exist but cannot be read: (path, error).
    pub unreadable: Vec<(RelPath, String)>,
    /// Its last error.
    pub last_error: Option<LastError>,
    /// How far its long work got.
    pub progress: FolderProgress,
    /// Its mount, if it has one.
    pub mount: Option<MountStatus>,
    /// Its role and past versions.
    pub versions: VersionsStatus,
    /// What of it is local, when it is on demand.
    pub on_demand: Option<OnDemandStatus>,
}

/// A folder's `on_demand` in `status` (docs/decisions.md, D90–D94): what of its content is
/// local, its budget, its pins, what is being fetched and what could not be.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct OnDemandStatus {
    /// The most bytes of content it keeps here; null: no budget.
    pub cache_max: Option<u64>,
    /// Files whose content is here, and their bytes.
    pub local_files: u64,
    /// See `local_files`.
    pub local_bytes: u64,
    /// Files that are placeholders (content online only), and their bytes.
    pub online_files: u64,
    /// See `online_files`.
    pub online_bytes: u64,
    /// How far `local_bytes` is over `cache_max` (what eviction could not free: pinned, open
    /// or last copies, files outside the subtrees on demand).
    pub over_budget: u64,
    /// The free floor of its disk (D97), in bytes, and as configured (`"5%"`, `"2GiB"`).
    pub min_free_bytes: u64,
    /// See `min_free_bytes`.
    pub min_free: String,
    /// Bytes free on its disk now (for unprivileged writers); null when it cannot be read.
    pub disk_free_bytes: Option<u64>,
    /// The subtrees on demand (`on_demand_under`, D77); empty: the whole folder. What lies
    /// outside them is kept local as a pinned path is.
    pub under: Vec<String>,
    /// The pinned paths.
    pub pins: Vec<String>,
    /// Fetches under way.
    pub fetching: Vec<FetchingStatus>,
    /// Paths that could not be fetched, and why (until a fetch of them succeeds).
    pub unavailable: Vec<UnavailableStatus>,
    /// More that could not be fetched than listed.
    pub unavailable_unlisted: u64,
    /// Files made local since the daemon started, and their bytes.
    pub fetched_files: u64,
    /// See `fetched_files`.
    pub fetched_bytes: u64,
    /// Files evicted since the daemon started.
    pub evicted_files: u64,
}

/// One of `on_demand.fetching`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FetchingStatus {
    /// The path.
    pub path: String,
    /// The process whose open started it (0: a pin).
    pub pid: u32,
    /// The file's size.
    pub size: u64,
    /// Bytes of it here so far.
    pub done: u64,
}

/// One of `on_demand.unavailable`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct UnavailableStatus {
    /// The path.
    pub path: String,
    /// Why, in words.
    pub error: String,
    /// The errno its open failed with (`EHOSTUNREACH`, `EIO`, …), by name.
    pub errno: &'static str,
    /// When it was tried last (Unix seconds).
    pub at_unix: u64,
}

/// A folder's role and past versions, as `status` shows them (`role`, `versions`,
/// `not_applied`, `not_sent`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct VersionsStatus {
    /// `send-receive`, `send-only` or `receive-only`.
    pub role: &'static str,
    /// Versions that left the tree and are still listed (`meshfs versions`).
    pub count: u64,
    /// What the vault's chunks of them take on disk, as stored.
    pub bytes: u64,
    /// How long they are kept, in days (0: off).
    pub max_age_days: u64,
    /// Send-only: peers' versions not applied here (what differs; `meshfs override`).
    pub not_applied: PathList,
    /// Receive-only: local changes not sent (`meshfs revert`).
    pub not_sent: PathList,
}

/// How many paths, and the first of them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PathList {
    /// How many.
    pub count: u64,
    /// The first ones (at most 200).
    pub items: Vec<String>,
}

/// A folder's `progress`: the counts of its long work, from which the CLI makes rates and
/// ETAs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct FolderProgress {
    /// The first scan: files hashed, and files left to hash (zero once it is over).
    pub scan: Counts,
    /// Remote changes: records applied since the daemon started, and those received and
    /// waiting to be applied.
    pub receive: Counts,
}

/// One configured peer.
#[derive(Clone, Debug)]
pub struct PeerSnapshot {
    /// Its `[[peer]]` entry.
    pub config: PeerConfig,
    /// The round-trip time of its connection; `None` when it is not connected.
    pub rtt: Option<Duration>,
    /// When it connected or disconnected last (Unix seconds); `None`: never since start.
    pub last_seen_unix: Option<u64>,
    /// Bytes (sent, received) with it since the daemon started.
    pub bytes: (u64, u64),
    /// The address it was last seen at (its connection's).
    pub last_seen_addr: Option<SocketAddr>,
    /// Its last error.
    pub last_error: Option<LastError>,
    /// Its connection's address now and how that address was learned; `None` when it is not
    /// connected.
    pub address: Option<(SocketAddr, Source)>,
    /// The addresses known for it (fixed ones not included), best first.
    pub candidates: Vec<Candidate>,
    /// This device's bulk lane to it (D105); `None` when it is not connected.
    pub lane: Option<crate::bulk::LaneFigures>,
}

/// What a folder still has to do on this device before it can be in sync.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LocalWork {
    /// Paths waiting in the capture loop.
    pub capture_pending: usize,
    /// The first scan is still running.
    pub scanning: bool,
    /// Remote versions held back while their path is open for writing through the mount.
    pub waiting_for_writers: usize,
    /// Remote versions held back while the local version they conflict with is fetched
    /// (an on-demand folder, D101).
    pub waiting_for_content: usize,
    /// Why receiving is stopped (the disk is full), if it is.
    pub blocked: Option<String>,
    /// The mount's invalidations not yet sent to the kernel: a change applied here that the
    /// mount may not show yet.
    pub invalidations_pending: usize,
}

impl LocalWork {
    /// Nothing waits: every local change is journaled and every received version applied
    /// or deliberately skipped.
    pub fn is_done(&self) -> bool {
        self.capture_pending == 0
            && !self.scanning
            && self.waiting_for_writers == 0
            && self.waiting_for_content == 0
            && self.blocked.is_none()
            && self.invalidations_pending == 0
    }
}

/// How one peer sharing a folder stands, as [`in_sync`] reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerProgress {
    /// It is connected now.
    pub connected: bool,
    /// It is connected, both sides' records are exchanged and applied, and it acknowledged
    /// this device's newest record ([`peer_caught_up`]).
    pub caught_up: bool,
}

/// Whether a peer is caught up in a folder: connected, its session reports the exchange
/// complete both ways, and it acknowledged `our_sequence`, this device's newest record (the
/// session may not have seen a record journaled a moment ago).
pub fn peer_caught_up(connected: bool, sync: Option<&FolderSyncStatus>, our_sequence: u64) -> bool {
    connected && sync.is_some_and(|s| s.in_sync && s.our_acked >= our_sequence)
}

/// A folder's verdict.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FolderVerdict {
    /// Its own work is done and every peer sharing it is caught up: a peer that is offline,
    /// or never connected, has not got this device's changes.
    pub in_sync: bool,
    /// The weaker claim, for scripts that only care about the peers reachable now: its own
    /// work is done and every connected peer sharing it is caught up.
    pub in_sync_with_connected: bool,
    /// Every peer sharing it is connected.
    pub peers_connected: bool,
}

/// When a folder is in sync, from its own work and the peers that share it.
pub fn in_sync(local: &LocalWork, peers: &[PeerProgress]) -> FolderVerdict {
    let done = local.is_done();
    FolderVerdict {
        in_sync: done && peers.iter().all(|p| p.caught_up),
        in_sync_with_connected: done && peers.iter().all(|p| p.caught_up || !p.connected),
        peers_connected: peers.iter().all(|p| p.connected),
    }
}

/// The `status --json` document.
#[derive(Clone, Debug, Serialize)]
pub struct Status {
    /// This device.
    pub device: DeviceStatus,
    /// Every folder is in sync with every peer sharing it.
    pub in_sync: bool,
    /// Every folder is in sync with the connected peers sharing it.
    pub in_sync_with_connected: bool,
    /// The running folders.
    pub folders: Vec<FolderStatus>,
    /// The configured peers.
    pub peers: Vec<PeerStatus>,
    /// Unknown devices that tried to connect.
    #[serde(serialize_with = "device_ids_text")]
    pub refused_devices: Vec<DeviceId>,
    /// UDP bytes sent over all peer connections since start.
    pub bytes_sent: u64,
    /// UDP bytes received over all peer connections since start.
    pub bytes_received: u64,
    /// Of `bytes_sent`, those declared lost and sent again (a lossy or congested link).
    pub bytes_resent: u64,
}

/// `device` in [`Status`].
#[derive(Clone, Debug, Serialize)]
pub struct DeviceStatus {
    /// The device id.
    #[serde(serialize_with = "device_id_text")]
    pub id: DeviceId,
    /// The short id (seven characters).
    pub short_id: String,
    /// `device.name`.
    pub name: String,
    /// `device.listen`.
    pub listen: String,
    /// Seconds since the daemon started.
    pub uptime_secs: u64,
    /// When the daemon started (Unix seconds).
    pub started_unix: u64,
    /// Local discovery.
    pub discovery: DiscoveryStatus,
}

/// One element of `folders` in [`Status`].
#[derive(Clone, Debug, Serialize)]
pub struct FolderStatus {
    /// The folder id.
    pub id: FolderId,
    /// The replica directory.
    pub path: String,
    /// Live regular files.
    pub files: u64,
    /// Live directories.
    pub dirs: u64,
    /// Live symlinks.
    pub symlinks: u64,
    /// Total size of live files.
    pub bytes: u64,
    /// Tombstones.
    pub tombstones: u64,
    /// This device's highest journal sequence for the folder.
    pub sequence: u64,
    /// Paths waiting in the capture loop.
    pub capture_pending: usize,
    /// The first scan is still running.
    pub scanning: bool,
    /// Conflict files that still exist.
    pub conflicts: usize,
    /// Remote versions held back for a writer through the mount.
    pub waiting_for_writers: usize,
    /// Remote versions held back while the local version they conflict with is fetched.
    pub waiting_for_content: usize,
    /// Remote versions that could not be applied.
    pub skipped: Vec<SkippedStatus>,
    /// Files that exist but cannot be read (not replicated until they can be).
    pub unreadable: Vec<SkippedStatus>,
    /// Its last error and when, or null.
    pub last_error: Option<LastError>,
    /// How far its long work got.
    pub progress: FolderProgress,
    /// Why receiving is stopped, or null.
    pub blocked: Option<String>,
    /// The mount, or null.
    pub mount: Option<MountStatus>,
    /// `send-receive`, `send-only` or `receive-only`.
    pub role: &'static str,
    /// Its past versions: `{"count", "bytes", "max_age_days"}`.
    pub versions: serde_json::Value,
    /// Send-only: peers' versions not applied here.
    pub not_applied: PathList,
    /// Receive-only: local changes not sent.
    pub not_sent: PathList,
    /// See [`FolderVerdict::in_sync`].
    pub in_sync: bool,
    /// See [`FolderVerdict::in_sync_with_connected`].
    pub in_sync_with_connected: bool,
    /// See [`FolderVerdict::peers_connected`].
    pub peers_connected: bool,
    /// The peers sharing the folder.
    pub peers: Vec<FolderPeerStatus>,
    /// What of it is local, when it is on demand; null otherwise.
    pub on_demand: Option<OnDemandStatus>,
}

/// One element of a folder's `skipped` or `unreadable`.
#[derive(Clone, Debug, Serialize)]
pub struct SkippedStatus {
    /// The path.
    pub path: String,
    /// Why its remote version could not be applied, or why it cannot be read.
    pub error: String,
}

impl SkippedStatus {
    fn list(items: Vec<(RelPath, String)>) -> Vec<SkippedStatus> {
        items
            .into_iter()
            .map(|(path, error)| SkippedStatus {
                path: path.as_str().to_string(),
                error,
            })
            .collect()
    }
}

/// One element of a folder's `peers`: a peer sharing it.
#[derive(Clone, Debug, Serialize)]
pub struct FolderPeerStatus {
    /// The peer's device id.
    #[serde(serialize_with = "device_id_text")]
    pub device_id: DeviceId,
    /// Its name in the config.
    pub name: String,
    /// It is connected now.
    pub connected: bool,
    /// It is caught up ([`peer_caught_up`]).
    pub in_sync: bool,
    /// This device's highest sequence.
    pub our_sequence: u64,
    /// The peer processed ours up to this.
    pub acked_by_peer: u64,
    /// The highest of its sequences known here.
    pub their_sequence: u64,
    /// The highest of its sequences applied here.
    pub applied_from_peer: u64,
    /// Our records it has not acknowledged (0 before its session reported).
    pub pending_records: u64,
    /// Its first scan of the folder is still running, as it last said: files on its disk
    /// may not be in its index yet, so it is not caught up whatever else holds.
    pub scanning: bool,
    /// How far that scan got, as it last said: files hashed (`done`, `bytes_done`) and files
    /// left to hash (`left`; `bytes_left` is null). Zero when it is not scanning.
    pub scan: Counts,
    /// When it connected or disconnected last, or null: never.
    pub last_seen_unix: Option<u64>,
    /// Connected, but it did not offer the folder: it does not share it with this device
    /// (it has no folder of that id, or has not shared it with this device), so it can
    /// never be in sync until it does.
    pub not_shared: bool,
}

/// One element of `peers` in [`Status`]: a configured peer.
#[derive(Clone, Debug, Serialize)]
pub struct PeerStatus {
    /// Its device id.
    #[serde(serialize_with = "device_id_text")]
    pub device_id: DeviceId,
    /// Its short id.
    pub short_id: String,
    /// Its name in the config.
    pub name: String,
    /// Where it is dialed, as configured: `HOST:PORT`s and `dynamic` (wherever it is found);
    /// empty: never dialed (it dials us).
    pub addresses: Vec<String>,
    /// Its connection's address now (`IP:PORT`), or null when it is not connected.
    pub address: Option<String>,
    /// How that address was learned: `static` (the config), `lan` (its announcement),
    /// `peer` (another peer told us), `incoming` (it dialed us from there), `remembered` (it
    /// worked before, kept across restarts); null when not connected.
    pub address_source: Option<&'static str>,
    /// The addresses known for it besides the configured ones, best first.
    pub known_addresses: Vec<KnownAddress>,
    /// The folders shared with it.
    pub folders: Vec<FolderId>,
    /// It is connected now.
    pub connected: bool,
    /// The connection's round-trip time, or null when not connected.
    pub rtt_ms: Option<f64>,
    /// Bytes sent to it since the daemon started.
    pub bytes_sent: u64,
    /// Bytes received from it since the daemon started.
    pub bytes_received: u64,
    /// When it connected or disconnected last, or null: never.
    pub last_seen_unix: Option<u64>,
    /// The address it was last seen at (`IP:PORT`), or null: never.
    pub last_seen_addr: Option<String>,
    /// Its last error and when, or null.
    pub last_error: Option<LastError>,
    /// This device's bulk lane to it (large fetches on a short path, D105), or null when it is
    /// not connected.
    pub bulk_lane: Option<crate::bulk::LaneFigures>,
}

/// One of a peer's `known_addresses`.
#[derive(Clone, Debug, Serialize)]
pub struct KnownAddress {
    /// `IP:PORT`.
    pub addr: String,
    /// How it was learned (as `address_source`).
    pub source: &'static str,
}

/// Device ids in the document are the text `meshfs id` prints.
fn device_id_text<S: serde::Serializer>(id: &DeviceId, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(id)
}

fn device_ids_text<S: serde::Serializer>(ids: &[DeviceId], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(ids.iter().map(DeviceId::to_string))
}

/// The document for `snapshot`.
pub fn build(snapshot: Snapshot) -> Status {
    let Snapshot {
        device,
        folders,
        peers,
        sync,
        refused,
        bytes,
        resent,
    } = snapshot;
    let folders: Vec<FolderStatus> = folders
        .into_iter()
        .map(|f| folder_status(f, &peers, &sync))
        .collect();
    Status {
        device: DeviceStatus {
            id: device.id,
            short_id: device.id.short().display7(),
            name: device.name,
            listen: device.listen,
            uptime_secs: device.uptime_secs,
            started_unix: device.started_unix,
            discovery: device.discovery,
        },
        in_sync: folders.iter().all(|f| f.in_sync),
        in_sync_with_connected: folders.iter().all(|f| f.in_sync_with_connected),
        folders,
        peers: peers.into_iter().map(peer_status).collect(),
        refused_devices: refused,
        bytes_sent: bytes.0,
        bytes_received: bytes.1,
        bytes_resent: resent,
    }
}

fn folder_status(
    f: FolderSnapshot,
    peers: &[PeerSnapshot],
    sync: &HashMap<(DeviceId, FolderId), FolderSyncStatus>,
) -> FolderStatus {
    let max = f.sequence;
    let sharing: Vec<FolderPeerStatus> = peers
        .iter()
        .filter(|p| p.config.folders.contains(&f.id))
        .map(|p| {
            let id = p.config.id;
            let connected = p.rtt.is_some();
            let s = sync.get(&(id, f.id.clone()));
            FolderPeerStatus {
                device_id: id,
                name: p.config.name.clone(),
                connected,
                in_sync: peer_caught_up(connected, s, max),
                our_sequence: max,
                acked_by_peer: s.map_or(0, |s| s.our_acked),
                their_sequence: s.map_or(0, |s| s.their_known_max),
                applied_from_peer: s.map_or(0, |s| s.their_applied),
                pending_records: s.map_or(0, |s| max.saturating_sub(s.our_acked)),
                scanning: connected && s.is_some_and(|s| s.their_scan.is_some()),
                scan: s
                    .and_then(|s| s.their_scan)
                    .filter(|_| connected)
                    .map_or_else(Counts::default, |c| Counts {
                        done: c.files_hashed,
                        bytes_done: c.bytes_hashed,
                        left: c.files_left,
                        bytes_left: None,
                    }),
                last_seen_unix: p.last_seen_unix,
                not_shared: connected && s.is_some_and(|s| s.not_shared),
            }
        })
        .collect();
    let progress: Vec<PeerProgress> = sharing
        .iter()
        .map(|p| PeerProgress {
            connected: p.connected,
            caught_up: p.in_sync,
        })
        .collect();
    let verdict = in_sync(&f.local, &progress);
    FolderStatus {
        id: f.id,
        path: f.path.display().to_string(),
        files: f.counts.files,
        dirs: f.counts.dirs,
        symlinks: f.counts.symlinks,
        bytes: f.counts.bytes,
        tombstones: f.counts.tombstones,
        sequence: max,
        capture_pending: f.local.capture_pending,
        scanning: f.local.scanning,
        conflicts: f.conflicts,
        waiting_for_writers: f.local.waiting_for_writers,
        waiting_for_content: f.local.waiting_for_content,
        skipped: SkippedStatus::list(f.skipped),
        unreadable: SkippedStatus::list(f.unreadable),
        last_error: f.last_error,
        progress: f.progress,
        blocked: f.local.blocked,
        mount: f.mount,
        role: f.versions.role,
        versions: serde_json::json!({
            "count": f.versions.count,
            "bytes": f.versions.bytes,
            "max_age_days": f.versions.max_age_days,
        }),
        not_applied: f.versions.not_applied,
        not_sent: f.versions.not_sent,
        in_sync: verdict.in_sync,
        in_sync_with_connected: verdict.in_sync_with_connected,
        peers_connected: verdict.peers_connected,
        peers: sharing,
        on_demand: f.on_demand,
    }
}

fn peer_status(p: PeerSnapshot) -> PeerStatus {
    let id = p.config.id;
    PeerStatus {
        device_id: id,
        short_id: id.short().display7(),
        name: p.config.name,
        addresses: p.config.addresses,
        address: p.address.map(|(a, _)| a.to_string()),
        address_source: p.address.map(|(_, s)| s.as_str()),
        known_addresses: p
            .candidates
            .iter()
            .map(|c| KnownAddress {
                addr: c.addr.to_string(),
                source: c.source.as_str(),
            })
            .collect(),
        folders: p.config.folders,
        connected: p.rtt.is_some(),
        rtt_ms: p.rtt.map(|r| r.as_secs_f64() * 1000.0),
        bytes_sent: p.bytes.0,
        bytes_received: p.bytes.1,
        last_seen_unix: p.last_seen_unix,
        last_seen_addr: p.last_seen_addr.map(|a| a.to_string()),
        last_error: p.last_error,
        bulk_lane: p.lane,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const DONE: LocalWork = LocalWork {
        capture_pending: 0,
        scanning: false,
        waiting_for_writers: 0,
        waiting_for_content: 0,
        blocked: None,
        invalidations_pending: 0,
    };
    const UP: PeerProgress = PeerProgress {
        connected: true,
        caught_up: true,
    };
    /// Connected, but behind (or its session has not reported yet).
    const BEHIND: PeerProgress = PeerProgress {
        connected: true,
        caught_up: false,
    };
    /// Offline, or never connected since the daemon started: the same to the rule.
    const DOWN: PeerProgress = PeerProgress {
        connected: false,
        caught_up: false,
    };

    fn sync(our_acked: u64, in_sync: bool) -> FolderSyncStatus {
        FolderSyncStatus {
            our_max: our_acked,
            our_acked,
            their_known_max: 7,
            their_applied: 7,
            receiving: false,
            their_scan: None,
            in_sync,
            not_shared: false,
        }
    }

    #[test]
    fn a_folder_with_its_work_done_and_every_peer_caught_up_is_in_sync() {
        let v = in_sync(&DONE, &[UP, UP]);
        assert!(v.in_sync && v.in_sync_with_connected && v.peers_connected);
    }

    #[test]
    fn a_folder_shared_with_no_peer_is_in_sync_once_its_own_work_is_done() {
        let v = in_sync(&DONE, &[]);
        assert!(v.in_sync && v.in_sync_with_connected && v.peers_connected);
    }

    #[test]
    fn each_piece_of_local_work_keeps_a_folder_out_of_sync_even_with_every_peer_caught_up() {
        let cases = [
            (
                "first scan running",
                LocalWork {
                    scanning: true,
                    ..DONE
                },
            ),
            (
                "local changes waiting in capture",
                LocalWork {
                    capture_pending: 3,
                    ..DONE
                },
            ),
            (
                "remote versions waiting for writers through the mount",
                LocalWork {
                    waiting_for_writers: 1,
                    ..DONE
                },
            ),
            (
                "remote versions waiting for the local version they conflict with",
                LocalWork {
                    waiting_for_content: 1,
                    ..DONE
                },
            ),
            (
                "an applied change the mount may not show yet",
                LocalWork {
                    invalidations_pending: 2,
                    ..DONE
                },
            ),
            (
                "receiving blocked by a full disk",
                LocalWork {
                    blocked: Some("disk full: a: No space left on device".into()),
                    ..DONE
                },
            ),
        ];
        for (why, local) in cases {
            assert!(!local.is_done(), "{why}");
            for peers in [&[UP][..], &[]] {
                let v = in_sync(&local, peers);
                assert!(!v.in_sync, "{why}");
                assert!(!v.in_sync_with_connected, "{why}");
                assert!(v.peers_connected, "{why}");
            }
        }
    }

    #[test]
    fn a_peer_that_is_offline_or_never_connected_keeps_the_folder_out_of_sync_but_not_out_of_sync_with_the_connected(
    ) {
        let v = in_sync(&DONE, &[UP, DOWN]);
        assert!(!v.in_sync);
        assert!(v.in_sync_with_connected);
        assert!(!v.peers_connected);
    }

    #[test]
    fn a_connected_peer_that_is_behind_keeps_the_folder_out_of_both_kinds_of_sync() {
        let v = in_sync(&DONE, &[UP, BEHIND]);
        assert!(!v.in_sync && !v.in_sync_with_connected);
        assert!(v.peers_connected);
    }

    #[test]
    fn a_peer_is_caught_up_only_connected_with_the_exchange_done_and_our_newest_record_acked() {
        assert!(peer_caught_up(true, Some(&sync(42, true)), 42));
        assert!(
            !peer_caught_up(false, Some(&sync(42, true)), 42),
            "disconnected: its last report is stale"
        );
        assert!(
            !peer_caught_up(true, None, 42),
            "connected, its session has not reported yet"
        );
        assert!(
            !peer_caught_up(true, Some(&sync(42, false)), 42),
            "the exchange is not complete both ways"
        );
        assert!(
            !peer_caught_up(true, Some(&sync(41, true)), 42),
            "a record journaled a moment ago is not acknowledged yet"
        );
    }

    /// Skipped versions are acknowledged to their peer (a record that cannot apply never
    /// fails a batch forever) and shown apart in `skipped`: they do not hold the folder back,
    /// or `status --wait-synced` would wait for them forever.
    #[test]
    fn a_skipped_remote_version_does_not_keep_the_folder_out_of_sync() {
        let mut s = snapshot();
        s.folders[0].skipped = vec![(RelPath::new("bad").unwrap(), "name too long".into())];
        let st = build(s);
        assert!(st.folders[0].in_sync && st.in_sync);
        assert_eq!(st.folders[0].skipped[0].path, "bad");
    }

    /// An unreadable file is shown, with the folder's last error, and does not hold the
    /// folder back either: nothing will change until the user changes its permissions.
    #[test]
    fn an_unreadable_file_and_the_last_errors_are_shown_without_keeping_the_folder_out_of_sync() {
        let mut s = snapshot();
        let denied = "Permission denied (os error 13)".to_string();
        s.folders[0].unreadable = vec![(RelPath::new("secret").unwrap(), denied.clone())];
        let error = LastError {
            message: format!("cannot read secret: {denied}"),
            unix: 1_790_000_100,
        };
        s.folders[0].last_error = Some(error.clone());
        s.peers[1].last_error = Some(LastError {
            message: "peer 10.0.0.2:7788 refused our certificate".into(),
            unix: 1_790_000_200,
        });
        let st = build(s);
        assert!(st.folders[0].in_sync && st.in_sync);
        assert_eq!(st.folders[0].unreadable[0].path, "secret");
        assert_eq!(st.folders[0].unreadable[0].error, denied);
        assert_eq!(st.folders[0].last_error, Some(error));
        let v = serde_json::to_value(&st).unwrap();
        assert_eq!(v["peers"][1]["last_error"]["unix"], 1_790_000_200);
        assert_eq!(v["peers"][0]["last_error"], serde_json::Value::Null);
        assert_eq!(
            v["folders"][0]["last_error"]["message"],
            format!("cannot read secret: {denied}")
        );
    }

    fn peer_id() -> DeviceId {
        DeviceId::from_bytes([2; 32])
    }

    fn work() -> FolderId {
        FolderId::new("work").unwrap()
    }

    /// One folder shared with one connected, caught-up peer; a second peer shares nothing.
    fn snapshot() -> Snapshot {
        let peer = |id: DeviceId, name: &str, folders: Vec<FolderId>, rtt: Option<Duration>| {
            PeerSnapshot {
                config: PeerConfig {
                    id,
                    name: name.into(),
                    addresses: vec!["dynamic".into()],
                    folders,
                },
                rtt,
                last_seen_unix: Some(1_790_000_000),
                bytes: (1234, 5678),
                last_seen_addr: Some("10.0.0.2:7788".parse().unwrap()),
                last_error: None,
                address: rtt.map(|_| ("10.0.0.2:7788".parse().unwrap(), Source::Lan)),
                candidates: vec![Candidate {
                    addr: "10.0.0.2:7788".parse().unwrap(),
                    source: Source::Remembered,
                }],
                lane: rtt.map(|_| crate::bulk::LaneFigures {
                    up: true,
                    down: None,
                    fetches: 2,
                    bytes: 3 << 20,
                }),
            }
        };
        Snapshot {
            device: DeviceSnapshot {
                id: DeviceId::from_bytes([1; 32]),
                name: "laptop".into(),
                listen: "0.0.0.0:7788".into(),
                uptime_secs: 12,
                started_unix: 1_790_000_000,
                discovery: DiscoveryStatus {
                    local: true,
                    port: 21788,
                    sent: 3,
                    received: 5,
                    limited: 0,
                    refused: 1,
                    heard: 2,
                    known_addresses: 1,
                },
            },
            folders: vec![FolderSnapshot {
                id: work(),
                path: "/home/u/work".into(),
                counts: FolderCounts {
                    files: 10,
                    dirs: 2,
                    symlinks: 0,
                    bytes: 40960,
                    tombstones: 1,
                },
                sequence: 42,
                conflicts: 0,
                local: DONE,
                skipped: Vec::new(),
                unreadable: Vec::new(),
                last_error: None,
                progress: FolderProgress {
                    scan: Counts::default(),
                    receive: Counts {
                        done: 30,
                        bytes_done: 4096,
                        left: 2,
                        bytes_left: Some(100),
                    },
                },
                mount: None,
                versions: VersionsStatus {
                    role: "send-receive",
                    count: 3,
                    bytes: 8192,
                    max_age_days: 30,
                    ..Default::default()
                },
                on_demand: None,
            }],
            peers: vec![
                peer(
                    peer_id(),
                    "server",
                    vec![work()],
                    Some(Duration::from_millis(2)),
                ),
                peer(DeviceId::from_bytes([3; 32]), "idle", Vec::new(), None),
            ],
            sync: HashMap::from([((peer_id(), work()), sync(42, true))]),
            refused: vec![DeviceId::from_bytes([4; 32])],
            bytes: (1234, 5678),
            resent: 12,
        }
    }

    #[test]
    fn the_document_has_the_shape_docs_cli_md_describes() {
        let me = DeviceId::from_bytes([1; 32]);
        let idle = DeviceId::from_bytes([3; 32]);
        let got = serde_json::to_value(build(snapshot())).unwrap();
        let folder_peer = json!({
            "device_id": peer_id().to_string(), "name": "server", "connected": true,
            "in_sync": true, "our_sequence": 42, "acked_by_peer": 42,
            "their_sequence": 7, "applied_from_peer": 7, "pending_records": 0,
            "scanning": false,
            "scan": {"done": 0, "bytes_done": 0, "left": 0, "bytes_left": null},
            "last_seen_unix": 1_790_000_000, "not_shared": false,
        });
        let want = json!({
            "device": {"id": me.to_string(), "short_id": me.short().display7(), "name": "laptop",
                       "listen": "0.0.0.0:7788", "uptime_secs": 12, "started_unix": 1_790_000_000,
                       "discovery": {"local": true, "port": 21788, "sent": 3, "received": 5,
                                     "limited": 0, "refused": 1, "heard": 2, "known_addresses": 1}},
            "in_sync": true,
            "in_sync_with_connected": true,
            "folders": [{
                "id": "work", "path": "/home/u/work",
                "files": 10, "dirs": 2, "symlinks": 0, "bytes": 40960, "tombstones": 1,
                "sequence": 42, "capture_pending": 0, "scanning": false, "conflicts": 0,
                "waiting_for_writers": 0, "waiting_for_content": 0, "skipped": [], "unreadable": [], "last_error": null,
                "progress": {
                    "scan": {"done": 0, "bytes_done": 0, "left": 0, "bytes_left": null},
                    "receive": {"done": 30, "bytes_done": 4096, "left": 2, "bytes_left": 100},
                },
                "blocked": null, "mount": null,
                "role": "send-receive",
                "versions": {"count": 3, "bytes": 8192, "max_age_days": 30},
                "not_applied": {"count": 0, "items": []},
                "not_sent": {"count": 0, "items": []},
                "in_sync": true, "in_sync_with_connected": true, "peers_connected": true,
                "peers": [folder_peer],
                "on_demand": null,
            }],
            "peers": [
                {"device_id": peer_id().to_string(), "short_id": peer_id().short().display7(),
                 "name": "server", "addresses": ["dynamic"], "address": "10.0.0.2:7788",
                 "address_source": "lan",
                 "known_addresses": [{"addr": "10.0.0.2:7788", "source": "remembered"}],
                 "folders": ["work"], "connected": true,
                 "rtt_ms": 2.0, "bytes_sent": 1234, "bytes_received": 5678,
                 "last_seen_unix": 1_790_000_000, "last_seen_addr": "10.0.0.2:7788",
                 "last_error": null,
                 "bulk_lane": {"up": true, "down": null, "fetches": 2, "bytes": 3145728}},
                {"device_id": idle.to_string(), "short_id": idle.short().display7(),
                 "name": "idle", "addresses": ["dynamic"], "address": null,
                 "address_source": null,
                 "known_addresses": [{"addr": "10.0.0.2:7788", "source": "remembered"}],
                 "folders": [], "connected": false,
                 "rtt_ms": null, "bytes_sent": 1234, "bytes_received": 5678,
                 "last_seen_unix": 1_790_000_000, "last_seen_addr": "10.0.0.2:7788",
                 "last_error": null, "bulk_lane": null},
            ],
            "refused_devices": [DeviceId::from_bytes([4; 32]).to_string()],
            "bytes_sent": 1234,
            "bytes_received": 5678,
            "bytes_resent": 12,
        });
        assert_eq!(got, want);
    }

    #[test]
    fn a_peer_behind_shows_what_it_has_not_acknowledged_and_the_device_is_not_in_sync() {
        let mut s = snapshot();
        s.sync.insert((peer_id(), work()), sync(40, true));
        let st = build(s);
        let p = &st.folders[0].peers[0];
        assert!(!p.in_sync && p.connected);
        assert_eq!((p.acked_by_peer, p.pending_records), (40, 2));
        assert!(!st.folders[0].in_sync && !st.in_sync && !st.in_sync_with_connected);
    }

    #[test]
    fn a_peer_gone_offline_leaves_the_device_in_sync_only_with_the_connected() {
        let mut s = snapshot();
        s.peers[0].rtt = None;
        let st = build(s);
        assert!(!st.folders[0].peers[0].connected && !st.peers[0].connected);
        assert_eq!(st.peers[0].rtt_ms, None);
        assert!(!st.in_sync && st.in_sync_with_connected);
        assert!(!st.folders[0].peers_connected);
    }

    #[test]
    fn a_peer_that_never_connected_has_no_last_seen_and_keeps_the_folder_out_of_sync() {
        let mut s = snapshot();
        s.peers[0].rtt = None;
        s.peers[0].last_seen_unix = None;
        s.sync.clear();
        let st = build(s);
        let p = &st.folders[0].peers[0];
        assert!(!p.connected && !p.in_sync);
        assert_eq!(p.last_seen_unix, None);
        assert_eq!((p.acked_by_peer, p.pending_records), (0, 0));
        assert!(!st.folders[0].in_sync && st.folders[0].in_sync_with_connected);
    }

    /// The session does not report in sync while the peer scans; the document says why, with
    /// the peer's progress, and the folder is not in sync.
    #[test]
    fn a_peer_still_in_its_first_scan_is_shown_scanning_and_keeps_the_folder_out_of_sync() {
        let mut s = snapshot();
        let scan = meshfs_sync::session::ScanCounts {
            files_hashed: 1000,
            bytes_hashed: 256 << 20,
            files_left: 1400,
        };
        s.sync.insert(
            (peer_id(), work()),
            FolderSyncStatus {
                their_scan: Some(scan),
                in_sync: false,
                ..sync(42, true)
            },
        );
        let st = build(s.clone());
        let p = &st.folders[0].peers[0];
        assert!(p.connected && p.scanning && !p.in_sync);
        assert_eq!(
            p.scan,
            Counts {
                done: 1000,
                bytes_done: 256 << 20,
                left: 1400,
                bytes_left: None
            }
        );
        assert!(!st.folders[0].in_sync && !st.in_sync && !st.in_sync_with_connected);
        // Once it is offline, its last report is stale: shown offline, not scanning.
        s.peers[0].rtt = None;
        let st = build(s);
        let p = &st.folders[0].peers[0];
        assert!(!p.connected && !p.scanning);
        assert_eq!(p.scan, Counts::default());
    }

    #[test]
    fn a_device_without_folders_is_in_sync() {
        let mut s = snapshot();
        s.folders.clear();
        let st = build(s);
        assert!(st.in_sync && st.in_sync_with_connected);
    }

    #[test]
    fn one_folder_out_of_sync_makes_the_device_out_of_sync() {
        let mut s = snapshot();
        let mut other = s.folders[0].clone();
        other.id = FolderId::new("other").unwrap();
        other.local.scanning = true;
        s.folders.push(other);
        let st = build(s);
        assert!(st.folders[0].in_sync && !st.folders[1].in_sync);
        assert!(!st.in_sync && !st.in_sync_with_connected);
        assert!(st.folders[1].peers.is_empty(), "no peer shares it");
    }
}
