//! The folder runtime: what one running folder is (its store, capture channel, mount slot,
//! deferred and skipped remote versions) and [`Folders`], the journal handle with every
//! running folder — the narrow API that both drivers of a folder use. The peers apply
//! batches, serve chunks and read the index through it; the mount reports local changes
//! into a folder's capture channel and takes invalidations from its slot.
//!
//! **Architecture invariant:** nothing here knows of peers, sessions or the engine. A scan
//! runs on a blocking thread under the folder's lock, never on an async worker.

use crate::capture::CaptureMsg;
use crate::ignore::IgnoreRules;
use crate::journal::{Change, Journal, JournalError};
use crate::last_error::LastErrorSlot;
use crate::lock::{Rank, Ranked, RankedGuard};
use crate::progress::Progress;
use crate::scanner::{self, ScanError, ScanTarget};
use crate::store::{Store, StoreError};
use meshfs_protocol::{DeviceId, FileRecord, FolderId, RelPath, ShortId};
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::Instant;
use tokio::sync::{broadcast, mpsc};

/// Records committed per journal transaction by a scan.
const SCAN_COMMIT_BATCH: usize = 4096;
/// Most skipped remote versions a folder lists (and logs one by one): a peer that sends
/// records that cannot apply, at paths of its choosing, cannot grow the list or the log
/// without end.
pub const MAX_SKIPPED: usize = 1000;

/// Why a folder operation failed.
#[derive(Debug, thiserror::Error)]
pub enum FolderError {
    /// No such folder runs on this device.
    #[error("folder {0} is not running here")]
    NotRunning(FolderId),
    /// The journal failed (its disk is full, it is damaged…).
    #[error(transparent)]
    Journal(#[from] JournalError),
    /// A scan failed.
    #[error(transparent)]
    Scan(#[from] ScanError),
    /// A thread panicked while holding this lock.
    #[error("the {0} lock is poisoned: a thread panicked holding it")]
    Poisoned(&'static str),
    /// The blocking task running the work failed.
    #[error("a blocking task failed: {0}")]
    Task(String),
    /// An on-demand operation on a folder that is not on demand.
    #[error("folder {0} is not on demand: all of its content is here (`meshfs folder set {0} --on-demand` to change that)")]
    NotOnDemand(FolderId),
}

impl FolderError {
    /// The disk holding the journal is full: the folder waits for room instead of failing.
    pub fn is_disk_full(&self) -> bool {
        matches!(
            self,
            FolderError::Journal(JournalError::DiskFull { .. })
                | FolderError::Scan(ScanError::Journal(JournalError::DiskFull { .. }))
                | FolderError::Scan(ScanError::Commit(JournalError::DiskFull { .. }))
        )
    }
}

/// A running folder.
///
/// **Lock order** (`crate::lock`, checked in debug builds): the folder's `op_lock` first, then
/// the journal, then the peers' registry; the folder's small state (its mount, watcher, capture
/// queue, deferred, skipped and unreadable paths, why it is blocked) is held only for a few
/// steps, never while another lock is taken, and only through the methods below.
pub struct FolderRt {
    /// The folder id.
    pub id: FolderId,
    /// The replica store.
    pub store: Store,
    /// `.meshignore` rules (reloaded when the file changes).
    pub ignore: RwLock<IgnoreRules>,
    /// Serializes capture and apply on this folder, so the engine never captures its own
    /// applies as local edits and never applies over an edit it has not captured.
    pub op_lock: Ranked<()>,
    /// Feeds the capture loop (the watcher and, later, the FUSE layer send here).
    pub capture: mpsc::UnboundedSender<CaptureMsg>,
    /// Paths waiting in the capture loop.
    pub capture_pending: std::sync::atomic::AtomicUsize,
    /// The capture loop's queue: the loop holds the lock only between its awaits, and
    /// `status --pending` lists the paths from it when asked (building that list for every
    /// event was ~8 % of the daemon's CPU during a `tar -x` through the mount).
    capture_queue: Ranked<crate::capture::Coalescer>,
    /// The folder's first scan is still running, or failed and the rescan after it has not
    /// succeeded yet: the folder is not in sync meanwhile, here or with its peers (told in
    /// the Hello, then by `Scan`). Set before the folder is visible to sessions.
    pub scanning: std::sync::atomic::AtomicBool,
    /// Notified when the first scan has walked the tree and found more than a slice of files
    /// to hash: starting the folder stops waiting for the scan to end.
    pub scan_is_long: tokio::sync::Notify,
    /// Which paths are open for writing through a mount (never replaced under their writer).
    pub writers: Arc<dyn meshfs_fuse::WriterRegistry>,
    /// Invalidates a mount's kernel caches after the engine changed a path.
    pub invalidator: Arc<dyn meshfs_fuse::Invalidator>,
    /// The folder's mount while it has one (both of the above forward to it).
    pub mount_slot: Arc<crate::mounts::MountSlot>,
    /// The running mount, if any.
    mount: Ranked<Option<meshfs_fuse::Mount>>,
    /// Remote versions waiting for a path's writer through the mount to let go, with the
    /// peer each came from (the newest per path).
    deferred: Ranked<HashMap<RelPath, Deferred>>,
    /// Placeholders whose content no device sharing the folder holds any more, by path, with
    /// the version: a conflict does not keep them (D103).
    lost: Ranked<HashMap<RelPath, meshfs_protocol::VersionVector>>,
    /// Why receiving into this folder is stopped (the disk is full), if it is.
    blocked: Ranked<Option<String>>,
    /// Remote versions that cannot be applied here, by path, with the error: skipped so the
    /// rest of the folder keeps syncing, until a later version of the path applies.
    skipped: Ranked<Skipped>,
    /// Files of the folder that exist but cannot be read, by path, with the error: not
    /// replicated until a later scan reads them.
    unreadable: Ranked<std::collections::BTreeMap<RelPath, String>>,
    /// The folder's last error and its time (`status`).
    pub last_error: LastErrorSlot,
    /// How far its first scan got hashing.
    pub first_scan: Arc<Progress>,
    /// Remote changes received and applied, and those waiting.
    pub receiving: Arc<Progress>,
    /// What apply just did to paths, so the watcher's events for it are not rescanned.
    pub echoes: crate::capture::Echoes,
    /// The folder's watcher, while it has one (dropping it stops it).
    watcher: Ranked<Option<notify::RecommendedWatcher>>,
    /// Its role and version retention, as the config says now.
    policy: Ranked<FolderPolicy>,
    /// Told of the files each scan journals as this device's new versions (not the first
    /// scan's), once set: `crate::versions` holds their content ahead where no peer would.
    local_sink: std::sync::OnceLock<LocalSink>,
    /// Where the content of its past versions is kept, once opened.
    vault: std::sync::OnceLock<Arc<crate::vault::Vault>>,
    /// What is asked of its content on demand: fetches, failures, use, pins (D92–D94).
    pub demand: crate::demand::Demand,
}

/// Where a folder's scans hand the files they journaled as this device's new versions: each
/// file's path, its record as committed, and the stat it was read with. Called under the
/// folder's lock: it must not block.
pub type LocalSink = Arc<dyn Fn(Vec<LocalFile>) + Send + Sync>;

/// A file a scan journaled as this device's new version: its path, its record as committed,
/// the stat it was read with.
pub type LocalFile = (
    RelPath,
    meshfs_protocol::FileRecord,
    crate::store::LocalStat,
);

/// What the config says of a running folder that the engine follows (reloaded with it): its
/// role, and how long and in how much space the content of its past versions is kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FolderPolicy {
    /// Send-receive, send-only or receive-only.
    pub role: meshfs_sync::role::Role,
    /// Days past versions are kept; 0: none.
    pub versions_days: u64,
    /// The share of free space they may take, in percent.
    pub versions_space_percent: u8,
    /// And at most this many MiB, if set.
    pub versions_max_mib: Option<u64>,
    /// `[options] history_retention_days`: days each change stays in the history; 0: as long
    /// as the folder keeps past versions (`crate::versions::retention`).
    pub history_days: u64,
    /// No peer shares the folder: nobody else keeps what this device's own changes replace,
    /// so it holds their content ahead (`crate::versions::keeper`).
    pub alone: bool,
    /// Files on demand (D90–D94).
    pub on_demand: bool,
    /// The most bytes of content it keeps here, on demand.
    pub cache_max: Option<u64>,
    /// How much of its disk it keeps free, on demand (D97).
    pub min_free: crate::config::FreeFloor,
}

impl FolderPolicy {
    /// The policy `config` gives its folder `f`.
    pub fn new(f: &crate::config::FolderConfig, config: &crate::config::Config) -> FolderPolicy {
        FolderPolicy {
            role: f.role,
            versions_days: f.versions_days,
            versions_space_percent: f.versions_space_percent,
            versions_max_mib: f.versions_max_mib,
            history_days: config.options.history_retention_days,
            alone: config.sharing(&f.id).next().is_none(),
            on_demand: f.on_demand,
            cache_max: f.cache_max,
            min_free: f.min_free.unwrap_or(crate::config::DEFAULT_MIN_FREE),
        }
    }
}

impl Default for FolderPolicy {
    fn default() -> FolderPolicy {
        FolderPolicy {
            role: Default::default(),
            versions_days: crate::config::VERSIONS_DAYS,
            versions_space_percent: crate::config::VERSIONS_SPACE_PERCENT,
            versions_max_mib: None,
            history_days: 0,
            alone: false,
            on_demand: false,
            cache_max: None,
            min_free: crate::config::DEFAULT_MIN_FREE,
        }
    }
}

/// The remote versions a folder skipped, by path, with the error: at most [`MAX_SKIPPED`]
/// listed, the rest counted.
#[derive(Debug, Default)]
pub struct Skipped {
    listed: std::collections::BTreeMap<RelPath, String>,
    unlisted: u64,
}

/// What [`Skipped::note`] did.
#[derive(Debug, PartialEq, Eq)]
enum Noted {
    /// Listed, new.
    New,
    /// Listed already (its error updated).
    Known,
    /// Not listed: the list is full. `first`: the first one since it filled.
    Unlisted {
        /// Whether it is the first not listed.
        first: bool,
    },
}

impl Skipped {
    fn note(&mut self, path: RelPath, error: String) -> Noted {
        if let Some(e) = self.listed.get_mut(&path) {
            *e = error;
            return Noted::Known;
        }
        if self.listed.len() < MAX_SKIPPED {
            self.listed.insert(path, error);
            return Noted::New;
        }
        self.unlisted += 1;
        Noted::Unlisted {
            first: self.unlisted == 1,
        }
    }

    fn forget(&mut self, path: &RelPath) {
        if !self.listed.is_empty() {
            self.listed.remove(path);
        }
    }
}

/// A remote version waiting for a writer through the mount to let go of its path, or (on an
/// on-demand folder) for the local version it conflicts with to be made local first (D101).
#[derive(Debug)]
pub struct Deferred {
    /// The remote version.
    pub remote: FileRecord,
    /// The peer it came from (and its content may have to be fetched from).
    pub peer: DeviceId,
    /// Why it waits.
    pub wait: Wait,
    /// Its applies that failed so far.
    pub failed: u32,
    /// Not tried again before then (its last apply failed).
    not_before: Option<Instant>,
}

/// The longest a deferred remote version that waits for content waits between two tries.
const CONTENT_RETRY_MAX: std::time::Duration = std::time::Duration::from_secs(8);

/// What a deferred remote version waits for.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Wait {
    /// Its path's writers (through the mount, or another program) to let go.
    Writer,
    /// A placeholder at this path (the version's own, or an ancestor's where a directory must
    /// be) is what the conflict with it must keep as a sibling: its content is fetched first,
    /// so that the sibling never names content no peer may still hold (D101).
    Content(RelPath),
}

impl FolderRt {
    /// A folder `id` running over `store`, with `ignore` rules, reporting local changes to
    /// `capture`, whose mount (once it has one) plugs into `slot`.
    pub fn new(
        id: FolderId,
        store: Store,
        ignore: IgnoreRules,
        capture: mpsc::UnboundedSender<CaptureMsg>,
        slot: Arc<crate::mounts::MountSlot>,
    ) -> FolderRt {
        FolderRt {
            ignore: RwLock::new(ignore),
            store,
            op_lock: Ranked::new(Rank::Folder, "folder", ()),
            capture,
            capture_pending: Default::default(),
            capture_queue: Ranked::new(Rank::Leaf, "capture queue", Default::default()),
            scanning: Default::default(),
            scan_is_long: Default::default(),
            // Inert until the folder is mounted; then it forwards to the mount.
            writers: slot.clone(),
            invalidator: slot.clone(),
            mount_slot: slot,
            mount: Ranked::new(Rank::Leaf, "mount", None),
            deferred: Ranked::new(Rank::Leaf, "deferred", HashMap::new()),
            lost: Ranked::new(Rank::Leaf, "lost", HashMap::new()),
            blocked: Ranked::new(Rank::Leaf, "blocked", None),
            skipped: Ranked::new(Rank::Leaf, "skipped", Skipped::default()),
            unreadable: Ranked::new(Rank::Leaf, "unreadable", Default::default()),
            last_error: Default::default(),
            first_scan: Arc::new(Progress::new(id.clone(), crate::progress::Work::FirstScan)),
            receiving: Arc::new(Progress::new(id.clone(), crate::progress::Work::Receiving)),
            echoes: Default::default(),
            watcher: Ranked::new(Rank::Leaf, "watcher", None),
            policy: Ranked::new(Rank::Leaf, "policy", FolderPolicy::default()),
            local_sink: std::sync::OnceLock::new(),
            vault: Default::default(),
            demand: Default::default(),
            id,
        }
    }

    /// Its role and version retention now.
    pub fn policy(&self) -> FolderPolicy {
        *self.policy.lock_anyway()
    }

    /// Follows the config's `policy` from now on.
    pub fn set_policy(&self, policy: FolderPolicy) {
        *self.policy.lock_anyway() = policy;
    }

    /// Hands the files each later scan journals as this device's new versions to `sink` (set
    /// once; later calls are ignored).
    pub fn on_local(&self, sink: LocalSink) {
        let _ = self.local_sink.set(sink);
    }

    /// The new file versions among `changes`, for the sink once they are committed (none
    /// when no sink is set).
    fn local_files(&self, changes: &[Change]) -> Vec<LocalFile> {
        if self.local_sink.get().is_none() {
            return Vec::new();
        }
        changes
            .iter()
            .filter(|c| {
                c.source.is_none()
                    && !c.record.deleted
                    && c.record.kind == meshfs_protocol::FileKind::File
                    && c.record.size > 0
            })
            .filter_map(|c| Some((c.record.path.clone(), c.record.clone(), c.local?)))
            .collect()
    }

    /// Tells the sink of `files`, journaled.
    fn local_committed(&self, files: Vec<LocalFile>) {
        if let (Some(sink), false) = (self.local_sink.get(), files.is_empty()) {
            sink(files);
        }
    }

    /// Its role now.
    pub fn role(&self) -> meshfs_sync::role::Role {
        self.policy().role
    }

    /// Where the content of its past versions is kept (once the engine opened it).
    pub fn vault(&self) -> Option<&Arc<crate::vault::Vault>> {
        self.vault.get()
    }

    /// Gives the folder its vault (once; later calls are ignored).
    pub fn set_vault(&self, vault: Arc<crate::vault::Vault>) {
        let _ = self.vault.set(vault);
    }

    /// The capture loop's queue, held (for a few steps, never across an await).
    pub fn capture_queue(&self) -> crate::lock::RankedGuard<'_, crate::capture::Coalescer> {
        self.capture_queue.lock_anyway()
    }

    /// Gives the folder its watcher (`None`: stops it).
    pub fn set_watcher(&self, w: Option<notify::RecommendedWatcher>) {
        *self.watcher.lock_anyway() = w;
    }

    /// Runs `f` with the folder's mount slot held: mounting and unmounting (which wait for the
    /// kernel) hold it, so two never race.
    pub fn with_mount<R>(&self, f: impl FnOnce(&mut Option<meshfs_fuse::Mount>) -> R) -> R {
        f(&mut self.mount.lock_anyway())
    }

    /// The mount's status, if the folder is mounted.
    pub fn mount_status(&self) -> Option<crate::mounts::MountStatus> {
        self.with_mount(|m| {
            m.as_ref()
                .map(|m| crate::mounts::MountStatus::from(m.info()))
        })
    }

    /// Holds `remote` (from `peer`) until `remote.path` has no writer through the mount, or
    /// until its local content is fetched ([`Wait`]).
    pub fn defer(&self, remote: FileRecord, peer: DeviceId, wait: Wait) {
        if let Ok(mut d) = self.deferred.lock() {
            let path = remote.path.clone();
            let (failed, not_before) = (0, None);
            d.insert(
                path,
                Deferred {
                    remote,
                    peer,
                    wait,
                    failed,
                    not_before,
                },
            );
        }
    }

    /// Holds `w` again after its apply failed (its peer's link closed under the chunk
    /// requests, the peer no longer has the content, …): it is tried again after `first`,
    /// twice that after a second failure, and so on up to 256 times `first`, unless a newer
    /// version waits at its path by then. One that waits for content is tried again at least
    /// every [`CONTENT_RETRY_MAX`]: the version that superseded the content it could not find
    /// may have arrived meanwhile (D101).
    pub fn defer_again(&self, mut w: Deferred, first: std::time::Duration) {
        if let Ok(mut d) = self.deferred.lock() {
            let mut wait = first * (1 << w.failed.min(8));
            if matches!(w.wait, Wait::Content(_)) {
                wait = wait.min(CONTENT_RETRY_MAX);
            }
            w.not_before = Some(Instant::now() + wait);
            w.failed = w.failed.saturating_add(1);
            d.entry(w.remote.path.clone()).or_insert(w);
        }
    }

    /// Receiving stopped for `reason` (the disk is full). Returns whether it was not already
    /// stopped, so the caller tells the user once, not per batch.
    pub fn block(&self, reason: String) -> bool {
        self.last_error.set(&reason);
        self.blocked
            .lock()
            .map(|mut b| b.replace(reason).is_none())
            .unwrap_or(false)
    }

    /// Receiving works again. Returns whether it had been stopped.
    pub fn unblock(&self) -> bool {
        self.blocked
            .lock()
            .map(|mut b| b.take().is_some())
            .unwrap_or(false)
    }

    /// Why receiving is stopped, if it is.
    pub fn blocked(&self) -> Option<String> {
        self.blocked.lock().ok().and_then(|b| b.clone())
    }

    /// Records that a remote version of `path` cannot be applied. Returns whether the log
    /// should say so: the path is new to the list (which holds at most [`MAX_SKIPPED`]).
    pub fn skip(&self, path: RelPath, error: String) -> bool {
        self.last_error.set(format_args!(
            "cannot apply the remote version of {path}: {error}"
        ));
        let Ok(mut s) = self.skipped.lock() else {
            return false;
        };
        match s.note(path, error) {
            Noted::New => true,
            Noted::Known => false,
            Noted::Unlisted { first } => {
                if first {
                    tracing::warn!(folder = %self.id, max = MAX_SKIPPED, "more remote versions cannot be applied than are listed; the rest are neither listed in status nor logged one by one");
                }
                false
            }
        }
    }

    /// A version of `path` applied: it is no longer skipped.
    pub fn unskip(&self, path: &RelPath) {
        if let Ok(mut s) = self.skipped.lock() {
            s.forget(path);
        }
    }

    /// The skipped remote versions: (path, error).
    pub fn skipped(&self) -> Vec<(RelPath, String)> {
        self.skipped
            .lock()
            .map(|s| {
                s.listed
                    .iter()
                    .map(|(p, e)| (p.clone(), e.clone()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The files that exist but cannot be read: (path, error).
    pub fn unreadable(&self) -> Vec<(RelPath, String)> {
        self.unreadable
            .lock()
            .map(|u| u.iter().map(|(p, e)| (p.clone(), e.clone())).collect())
            .unwrap_or_default()
    }

    /// After a scan of `scopes` (empty: the whole folder) that could not read `unread`: the
    /// files among them that are still there but unreadable are listed (and logged, once
    /// each); the scopes' other files are no longer.
    fn note_unread(&self, scopes: &[RelPath], unread: Vec<RelPath>) {
        let found: Vec<(RelPath, String)> = unread
            .into_iter()
            .filter_map(|p| match self.store.open_file(&p) {
                // Vanished while it was hashed: nothing to read any more.
                Err(StoreError::Io { source, .. })
                    if source.kind() == std::io::ErrorKind::NotFound =>
                {
                    None
                }
                Err(StoreError::Io { source, .. }) => Some((p, source.to_string())),
                Err(e) => Some((p, e.to_string())),
                // Readable again already: its next event or scan picks it up.
                Ok(_) => None,
            })
            .collect();
        let Ok(mut listed) = self.unreadable.lock() else {
            return;
        };
        if scopes.is_empty() {
            listed.clear();
        } else if !listed.is_empty() {
            listed.retain(|p, _| !scopes.iter().any(|s| p.is_within(s)));
        }
        for (path, error) in found {
            if listed.insert(path.clone(), error.clone()).is_none() {
                tracing::warn!(folder = %self.id, %path, %error, "cannot read a file; it is not replicated until it can be read (see status)");
                self.last_error.set(format_args!(
                    "cannot read {path}: {error}; not replicated until it can be read"
                ));
            }
        }
    }

    /// Up to `limit` of the capture loop's waiting paths (sorted, each with whether it waits
    /// for its writer's close), and whether a rescan waits: what `status --pending` lists.
    pub fn capture_waiting(&self, limit: usize) -> (Vec<(RelPath, bool)>, bool) {
        self.capture_queue
            .lock()
            .map(|c| c.waiting(limit))
            .unwrap_or_default()
    }

    /// The deferred remote versions: (path, the peer it came from, what it waits for), by path.
    pub fn deferred_paths(&self) -> Vec<(RelPath, DeviceId, Wait)> {
        let mut out: Vec<(RelPath, DeviceId, Wait)> = self
            .deferred
            .lock()
            .map(|d| {
                d.iter()
                    .map(|(p, w)| (p.clone(), w.peer, w.wait.clone()))
                    .collect()
            })
            .unwrap_or_default();
        out.sort();
        out
    }

    /// The version `version` of the placeholder at `path` has content no device sharing the
    /// folder holds any more (every one connected said so, D103): a conflict replaces it
    /// instead of keeping it as a sibling.
    pub fn mark_lost(&self, path: RelPath, version: meshfs_protocol::VersionVector) {
        if let Ok(mut l) = self.lost.lock() {
            l.insert(path, version);
        }
    }

    /// Whether the version `version` at `path` was found lost ([`Self::mark_lost`]).
    pub fn is_lost(&self, path: &RelPath, version: &meshfs_protocol::VersionVector) -> bool {
        self.lost
            .lock()
            .is_ok_and(|l| l.get(path).is_some_and(|v| v == version))
    }

    /// Forgets the mark of `path` once the conflict that needed it is decided.
    pub fn forget_lost(&self, path: &RelPath) {
        if let Ok(mut l) = self.lost.lock() {
            l.remove(path);
        }
    }

    /// Whether `remote` itself waits for a writer (deferred again after being taken).
    pub fn waits(&self, remote: &FileRecord) -> bool {
        self.deferred
            .lock()
            .is_ok_and(|d| d.get(&remote.path).is_some_and(|w| &w.remote == remote))
    }

    /// Remote versions waiting for a writer to let go.
    pub fn deferred_count(&self) -> usize {
        self.deferred.lock().map_or(0, |d| d.len())
    }

    /// Remote versions waiting for content (`true`) or for writers (`false`).
    pub fn deferred_for(&self, content: bool) -> usize {
        self.deferred.lock().map_or(0, |d| {
            d.values()
                .filter(|w| matches!(w.wait, Wait::Content(_)) == content)
                .count()
        })
    }

    /// Takes the deferred versions whose paths no longer have a writer and whose peer is
    /// connected (the content may have to be fetched from it), except those whose last
    /// apply failed a moment ago.
    pub(crate) fn take_ready_deferred(&self, connected: &HashSet<DeviceId>) -> Vec<Deferred> {
        let Ok(mut d) = self.deferred.lock() else {
            return Vec::new();
        };
        let now = Instant::now();
        let ready: Vec<RelPath> = d
            .iter()
            .filter(|(p, w)| {
                connected.contains(&w.peer)
                    && w.not_before.is_none_or(|t| t <= now)
                    && !self.writers.has_writer(p)
                    && !self.store.open_for_writing(p)
            })
            .map(|(p, _)| p.clone())
            .collect();
        ready.into_iter().filter_map(|p| d.remove(&p)).collect()
    }
}

/// The journal and the running folders of one device: what the peers and the mounts share.
pub struct Folders {
    /// This device.
    pub device: DeviceId,
    /// Its short id (version-vector key).
    pub short: ShortId,
    /// Read-only connections to the same database, idle ([`Folders::reader`]). Declared before
    /// the writer, so dropped before it: the writer's close must be the log's last connection
    /// to checkpoint and mark it (`Journal::open`, step 5).
    readers: Ranked<Vec<Journal>>,
    /// The journal (blocking calls; never held across an await): the writer.
    journal: Ranked<Journal>,
    /// The database's path.
    journal_path: PathBuf,
    map: RwLock<HashMap<FolderId, Arc<FolderRt>>>,
    /// A folder's journal gained entries (local or applied remote changes).
    pub changes: broadcast::Sender<FolderId>,
    /// Where local ignore files live (`CONFIG_DIR/ignore`).
    ignore_dir: PathBuf,
    /// Disk room promised to remote versions being received, on every folder's filesystem.
    pub room: Arc<crate::room::Room>,
    /// The journal's filesystem: its growth is claimed there.
    pub journal_place: Option<crate::room::Place>,
}

impl Folders {
    /// The folders of `device`, none running yet.
    pub fn new(device: DeviceId, journal: Journal, ignore_dir: PathBuf) -> Folders {
        let (changes, _) = broadcast::channel(4096);
        let journal_place = journal
            .path()
            .parent()
            .and_then(|d| crate::room::Place::of(d).ok());
        Folders {
            device,
            short: device.short(),
            readers: Ranked::new(Rank::Leaf, "idle readers", Vec::new()),
            journal_path: journal.path().to_path_buf(),
            journal: Ranked::new(Rank::Journal, "journal", journal),
            map: RwLock::new(HashMap::new()),
            changes,
            ignore_dir,
            room: crate::room::Room::new(crate::store::space),
            journal_place,
        }
    }

    /// The journal, held (never across an await).
    pub fn journal(&self) -> Result<RankedGuard<'_, Journal>, FolderError> {
        self.journal
            .lock()
            .map_err(|_| FolderError::Poisoned("journal"))
    }

    /// A connection that only reads the journal, beside the writer ([`Folders::journal`]): WAL
    /// lets it read while the writer writes, so a long read (a scan comparing a folder, a
    /// session reading what to send) never waits for an apply or a scan of another folder, and
    /// they never wait for it. From a pool (one is opened when none is idle); back to it when
    /// dropped.
    pub fn reader(&self) -> Result<Reader<'_>, FolderError> {
        let idle = self.readers.lock_anyway().pop();
        let journal = match idle {
            Some(j) => j,
            None => Journal::open_reader(&self.journal_path)?,
        };
        Ok(Reader {
            pool: &self.readers,
            journal: Some(journal),
        })
    }

    /// The journal's lock as it is (for callers that tell a poisoned lock apart themselves).
    pub fn journal_lock(&self) -> std::sync::LockResult<RankedGuard<'_, Journal>> {
        self.journal.lock()
    }

    /// A running folder.
    pub fn get(&self, id: &FolderId) -> Option<Arc<FolderRt>> {
        self.map.read().ok()?.get(id).cloned()
    }

    /// A running folder, or why not.
    pub fn running(&self, id: &FolderId) -> Result<Arc<FolderRt>, FolderError> {
        self.get(id)
            .ok_or_else(|| FolderError::NotRunning(id.clone()))
    }

    /// Every running folder.
    pub fn all(&self) -> Vec<Arc<FolderRt>> {
        self.map
            .read()
            .map(|f| f.values().cloned().collect())
            .unwrap_or_default()
    }

    /// The ids of the running folders.
    pub fn ids(&self) -> HashSet<FolderId> {
        self.map
            .read()
            .map(|f| f.keys().cloned().collect())
            .unwrap_or_default()
    }

    /// Starts tracking a running folder.
    pub fn insert(&self, rt: Arc<FolderRt>) {
        if let Ok(mut m) = self.map.write() {
            m.insert(rt.id.clone(), rt);
        }
    }

    /// Stops tracking the folders `keep` says no to; returns them.
    pub fn retain(&self, mut keep: impl FnMut(&FolderId) -> bool) -> Vec<Arc<FolderRt>> {
        let mut gone = Vec::new();
        if let Ok(mut m) = self.map.write() {
            m.retain(|id, rt| {
                let k = keep(id);
                if !k {
                    gone.push(rt.clone());
                }
                k
            });
        }
        gone
    }

    /// The folder's local ignore file (`CONFIG_DIR/ignore/FOLDER-ID`): rules no peer can
    /// change, read with the replicated `.meshignore` (`crate::ignore`).
    pub fn local_ignore(&self, folder: &FolderId) -> PathBuf {
        self.ignore_dir.join(folder.as_str())
    }

    /// Reads `rt`'s ignore files again ([`IgnoreRules::reload`]): a shared file that does not
    /// compile keeps the shared rules in force and is shown as the folder's last error.
    pub fn reload_ignore(&self, rt: &FolderRt) {
        let local = self.local_ignore(&rt.id);
        let problem = match rt.ignore.write() {
            Ok(mut ig) => {
                ig.reload(rt.store.root(), Some(&local));
                ig.problem().map(str::to_string)
            }
            Err(_) => None,
        };
        if let Some(p) = problem {
            rt.last_error.set(p);
        }
    }

    /// Tells sessions that `folder`'s journal gained entries, or that its first scan moved on.
    pub fn changes_notify(&self, folder: &FolderId) {
        let _ = self.changes.send(folder.clone());
    }

    /// Scans `paths` (empty: the whole folder) and journals what changed. Returns the number of
    /// new versions. The first scan of a folder journals and announces its changes in slices as
    /// it goes ([`scanner::scan_new`]).
    pub async fn scan_paths(
        self: &Arc<Self>,
        folder: &FolderId,
        paths: Vec<RelPath>,
    ) -> Result<usize, FolderError> {
        let folders = self.clone();
        let folder = folder.clone();
        tokio::task::spawn_blocking(move || folders.scan_blocking(&folder, &paths))
            .await
            .map_err(|e| FolderError::Task(e.to_string()))?
    }

    fn scan_blocking(&self, folder: &FolderId, paths: &[RelPath]) -> Result<usize, FolderError> {
        let rt = self.running(folder)?;
        if paths.is_empty()
            || paths
                .iter()
                .any(|p| p.as_str() == crate::ignore::IGNORE_FILE)
        {
            self.reload_ignore(&rt);
        }
        let _guard = rt
            .op_lock
            .lock()
            .map_err(|_| FolderError::Poisoned("folder"))?;
        let ignore = rt
            .ignore
            .read()
            .map_err(|_| FolderError::Poisoned("ignore"))?;
        let target = ScanTarget {
            folder,
            store: &rt.store,
            ignore: &ignore,
            local: self.short,
            now_secs: now_secs(),
        };
        let t0 = Instant::now();
        let mut streamed = 0;
        let mut report = {
            let mut j = self.journal()?;
            // Only a whole-folder scan asks (a capture of a few paths is the hot path).
            let fresh = paths.is_empty() && j.folder(folder)?.max_sequence == 0;
            if fresh {
                // Nothing journaled yet: everything is new. Journal and announce it as it is
                // hashed, without holding the journal, so peers get the first files while the
                // rest are still being read.
                drop(j);
                let mut emit = |changes: Vec<Change>, to_hash: usize| -> Result<(), JournalError> {
                    // Known once the tree is walked: peers need not wait for a long scan.
                    if to_hash >= scanner::FIRST_SCAN_SLICE {
                        rt.scan_is_long.notify_one();
                    }
                    let (files, bytes) = changes
                        .iter()
                        .filter(|c| c.record.kind == meshfs_protocol::FileKind::File)
                        .fold((0, 0), |(n, b), c| (n + 1, b + c.record.size));
                    rt.first_scan.hashed(files, bytes, to_hash as u64);
                    if changes.is_empty() {
                        // The walk is done: peers hear how many files are left to hash.
                        self.changes_notify(folder);
                        return Ok(());
                    }
                    crate::failpoint::hit("scan.first_slice", "");
                    streamed += changes.len();
                    tracing::debug!(%folder, n = changes.len(), ms = t0.elapsed().as_millis() as u64, "first scan: slice journaled");
                    let mut j = self.journal.lock_anyway();
                    note_local_only(&mut j, &rt, folder, &changes)?;
                    commit_in_batches(&mut j, folder, changes)?;
                    drop(j);
                    self.changes_notify(folder);
                    Ok(())
                };
                let report = scanner::scan_new(&target, &mut emit);
                rt.first_scan.hashed(0, 0, 0);
                report?
            } else {
                // Compared through a connection that only reads: hashing what changed never
                // holds the writer that other folders' applies and captures need. This folder's
                // records cannot change meanwhile (its lock is held).
                drop(j);
                let mut reader = self.reader()?;
                reader.begin_reads();
                let mut report = scanner::scan(&target, &reader, paths)?;
                if !paths.is_empty() {
                    // A file with several names (a conflict copy is made as a hard link of
                    // the file it copies) written through one of them changed under the
                    // others too, and the watcher reports only the name it was written by.
                    let others = other_names(&reader, folder, paths, &report);
                    if !others.is_empty() {
                        let more = scanner::scan(&target, &reader, &others)?;
                        report.changes.extend(more.changes);
                        report.restat.extend(more.restat);
                        report.unread.extend(more.unread);
                        report.placeholders.extend(more.placeholders);
                        report.contents.extend(more.contents);
                        report.linked.extend(more.linked);
                    }
                }
                report
            }
        };
        let scanned = t0.elapsed();
        rt.note_unread(paths, std::mem::take(&mut report.unread));
        let n = report.changes.len() + streamed;
        let mut j = self.journal()?;
        if !report.restat.is_empty() {
            j.set_local_stats(folder, &report.restat)?;
        }
        note_local_only(&mut j, &rt, folder, &report.changes)?;
        let local = rt.local_files(&report.changes);
        commit_in_batches(&mut j, folder, report.changes)?;
        j.mark_absent(folder, &report.placeholders)?;
        j.mark_present(folder, &report.contents)?;
        rt.local_committed(local);
        if report.entries > 10_000 {
            j.release_memory();
        }
        drop(j);
        if report.entries > 10_000 {
            // A big scan's transient maps (and the journal's page cache, above) are freed now;
            // give the pages back to the system so the resident size of an idle daemon stays
            // small.
            #[cfg(target_env = "gnu")]
            // SAFETY: malloc_trim takes no pointers and only returns free heap pages to the
            // system; glibc makes it safe to call from any thread at any time.
            unsafe {
                libc::malloc_trim(0);
            }
            tracing::info!(%folder, entries = report.entries, hashed_files = report.hashed_files, hashed_bytes = report.hashed_bytes,
                scan_ms = scanned.as_millis() as u64, journal_ms = (t0.elapsed() - scanned).as_millis() as u64, "scan finished");
        }
        if n > 0 {
            self.changes_notify(folder);
        }
        Ok(n)
    }
}

/// Seconds since the Unix epoch (a new local version's clock).
pub(crate) fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// In a receive-only folder, notes each scanned change as a local change not sent, with the
/// shared record its path held before (the first note of a path is kept: `meshfs revert`
/// goes back to it). Before the commit: a crash in between leaves a note for a change the
/// next scan journals again.
fn note_local_only(
    j: &mut Journal,
    rt: &FolderRt,
    folder: &FolderId,
    changes: &[Change],
) -> Result<(), JournalError> {
    if rt.role() != meshfs_sync::role::Role::ReceiveOnly {
        return Ok(());
    }
    let mut items = Vec::with_capacity(changes.len());
    for c in changes {
        let before = j.get(folder, &c.record.path)?;
        items.push((c.record.path.clone(), before.map(|s| (s.record, s.source))));
    }
    j.note_local_only(folder, &items)
}

/// The journal's other live names of the files among `report`'s changes that the scan saw
/// with more than one link on disk (`ScanReport::linked`, from the scan's own stat: no second
/// one per changed file), not among `scanned` already.
fn other_names(
    journal: &Journal,
    folder: &FolderId,
    scanned: &[RelPath],
    report: &scanner::ScanReport,
) -> Vec<RelPath> {
    let mut out: Vec<RelPath> = Vec::new();
    if report.linked.is_empty() {
        // The scan saw no file with a second name: no other name to look up.
        return out;
    }
    let linked: std::collections::HashSet<&RelPath> = report.linked.iter().collect();
    for c in &report.changes {
        if c.record.deleted || c.record.kind != meshfs_protocol::FileKind::File {
            continue;
        }
        let (true, Some(local)) = (linked.contains(&c.record.path), c.local) else {
            continue;
        };
        for p in journal
            .paths_with_inode(folder, local.inode)
            .unwrap_or_default()
        {
            if p != c.record.path && !scanned.contains(&p) && !out.contains(&p) {
                out.push(p);
            }
        }
    }
    out
}

/// Commits scanned changes, [`SCAN_COMMIT_BATCH`] per transaction.
fn commit_in_batches(
    j: &mut Journal,
    folder: &FolderId,
    mut changes: Vec<Change>,
) -> Result<(), JournalError> {
    while !changes.is_empty() {
        let rest = changes.split_off(changes.len().min(SCAN_COMMIT_BATCH));
        j.commit(folder, changes)?;
        changes = rest;
    }
    Ok(())
}

/// A journal connection that reads, from [`Folders::reader`]; back in the pool when dropped.
pub struct Reader<'a> {
    pool: &'a Ranked<Vec<Journal>>,
    journal: Option<Journal>,
}

/// Idle readers kept at most.
const IDLE_READERS: usize = 4;

impl std::ops::Deref for Reader<'_> {
    type Target = Journal;
    fn deref(&self) -> &Journal {
        match &self.journal {
            Some(j) => j,
            None => unreachable!("a reader holds its connection until it is dropped"),
        }
    }
}

impl std::ops::DerefMut for Reader<'_> {
    fn deref_mut(&mut self) -> &mut Journal {
        match &mut self.journal {
            Some(j) => j,
            None => unreachable!("a reader holds its connection until it is dropped"),
        }
    }
}

impl Drop for Reader<'_> {
    fn drop(&mut self) {
        if let Some(mut j) = self.journal.take() {
            j.end_reads();
            let mut idle = self.pool.lock_anyway();
            if idle.len() < IDLE_READERS {
                idle.push(j);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_skipped_list_is_bounded_and_says_once_when_it_is_full() {
        let mut s = Skipped::default();
        let path = |i: usize| RelPath::new(&format!("p{i}")).unwrap();
        for i in 0..MAX_SKIPPED {
            assert_eq!(s.note(path(i), "e".into()), Noted::New);
        }
        assert_eq!(s.note(path(0), "again".into()), Noted::Known);
        assert_eq!(
            s.note(path(MAX_SKIPPED), "e".into()),
            Noted::Unlisted { first: true }
        );
        for i in 1..10_000 {
            assert_eq!(
                s.note(path(MAX_SKIPPED + i), "e".into()),
                Noted::Unlisted { first: false }
            );
        }
        assert_eq!(s.listed.len(), MAX_SKIPPED);
        assert_eq!(s.listed[&path(0)], "again");
        s.forget(&path(0));
        assert_eq!(s.note(path(MAX_SKIPPED), "e".into()), Noted::New);
    }
}
