//! The engine: owns the journal, the folders (store, watcher, capture loop), the QUIC endpoint
//! and the peer connections, and answers the control socket. `meshfs daemon` runs one.
//!
//! Start-up order: open the journal → for each folder: remove leftover temp files, complete
//! interrupted applies ([`crate::apply::recover_pending`]), scan the whole folder (changes made
//! while no daemon ran are journaled exactly once), start the watcher → listen → dial peers.

use crate::capture::{self, CaptureMsg, Coalescer};
use crate::config::{Config, Home, Options};
use crate::identity::Identity;
use crate::ignore::IgnoreRules;
use crate::journal::{Change, FolderCounts, Journal};
use crate::peers::{self, Peers};
use crate::scanner::{self, ScanTarget};
use crate::store::Store;
use crate::transport::{self, TrustStore};
use meshfs_protocol::{DeviceId, FileRecord, FolderId, RelPath, ShortId};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use tokio::sync::{broadcast, mpsc, watch, Notify};

/// Records committed per journal transaction by a scan.
const SCAN_COMMIT_BATCH: usize = 4096;

/// A running folder.
pub struct FolderRt {
    /// The folder id.
    pub id: FolderId,
    /// The replica store.
    pub store: Store,
    /// `.meshignore` rules (reloaded when the file changes).
    pub ignore: RwLock<IgnoreRules>,
    /// Serializes capture and apply on this folder, so the engine never captures its own
    /// applies as local edits and never applies over an edit it has not captured.
    pub op_lock: Mutex<()>,
    /// Feeds the capture loop (the watcher and, later, the FUSE layer send here).
    pub capture: mpsc::UnboundedSender<CaptureMsg>,
    /// Paths waiting in the capture loop.
    pub capture_pending: std::sync::atomic::AtomicUsize,
    /// The folder's first scan is still running (the folder is not in sync meanwhile).
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
    mount: Mutex<Option<meshfs_fuse::Mount>>,
    /// Remote versions waiting for a path's writer through the mount to let go, with the
    /// peer each came from (the newest per path).
    deferred: Mutex<HashMap<RelPath, (FileRecord, DeviceId)>>,
    /// Why receiving into this folder is stopped (the disk is full), if it is.
    blocked: Mutex<Option<String>>,
    /// Remote versions that cannot be applied here, by path, with the error: skipped so the
    /// rest of the folder keeps syncing, until a later version of the path applies.
    skipped: Mutex<std::collections::BTreeMap<RelPath, String>>,
    /// What apply just did to paths, so the watcher's events for it are not rescanned.
    pub echoes: crate::capture::Echoes,
    watcher: Mutex<Option<notify::RecommendedWatcher>>,
}

impl FolderRt {
    /// Holds `remote` (from `peer`) until `remote.path` has no writer through the mount.
    pub fn defer(&self, remote: FileRecord, peer: DeviceId) {
        if let Ok(mut d) = self.deferred.lock() {
            d.insert(remote.path.clone(), (remote, peer));
        }
    }

    /// Receiving stopped for `reason` (the disk is full). Returns whether it was not already
    /// stopped, so the caller tells the user once, not per batch.
    pub fn block(&self, reason: String) -> bool {
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

    /// Records that a remote version of `path` cannot be applied. Returns whether this is new
    /// (so the log says it once).
    pub fn skip(&self, path: RelPath, error: String) -> bool {
        self.skipped
            .lock()
            .map(|mut s| s.insert(path, error).is_none())
            .unwrap_or(false)
    }

    /// A version of `path` applied: it is no longer skipped.
    pub fn unskip(&self, path: &RelPath) {
        if let Ok(mut s) = self.skipped.lock() {
            if !s.is_empty() {
                s.remove(path);
            }
        }
    }

    /// The skipped remote versions: (path, error).
    pub fn skipped(&self) -> Vec<(RelPath, String)> {
        self.skipped
            .lock()
            .map(|s| s.iter().map(|(p, e)| (p.clone(), e.clone())).collect())
            .unwrap_or_default()
    }

    /// Remote versions waiting for a writer to let go.
    pub fn deferred_count(&self) -> usize {
        self.deferred.lock().map_or(0, |d| d.len())
    }

    /// Takes the deferred versions whose paths no longer have a writer and whose peer is
    /// connected (the content may have to be fetched from it).
    fn take_ready_deferred(&self, connected: &HashSet<DeviceId>) -> Vec<(FileRecord, DeviceId)> {
        let Ok(mut d) = self.deferred.lock() else {
            return Vec::new();
        };
        let ready: Vec<RelPath> = d
            .iter()
            .filter(|(p, (_, peer))| connected.contains(peer) && !self.writers.has_writer(p))
            .map(|(p, _)| p.clone())
            .collect();
        ready.into_iter().filter_map(|p| d.remove(&p)).collect()
    }
}

/// The engine of one device.
pub struct Engine {
    /// Where this device's files live.
    pub home: Home,
    /// This device.
    pub device: DeviceId,
    /// Its short id (version-vector key).
    pub short: ShortId,
    config: RwLock<Config>,
    /// The journal (blocking calls; never held across an await).
    pub journal: Mutex<Journal>,
    folders: RwLock<HashMap<FolderId, Arc<FolderRt>>>,
    /// Connected peers and their sync status.
    pub peers: Mutex<Peers>,
    /// Woken when a peer connects, disconnects or reports progress.
    pub peer_changed: Notify,
    /// A folder's journal gained entries (local or applied remote changes).
    pub changes: broadcast::Sender<FolderId>,
    /// The QUIC endpoint.
    pub endpoint: quinn::Endpoint,
    /// Devices allowed to connect.
    pub trust: TrustStore,
    /// Set to true when the daemon stops.
    pub stopping: watch::Sender<bool>,
    /// Woken at shutdown (sessions say goodbye).
    pub shutdown: Notify,
    dialers: Mutex<HashMap<DeviceId, (String, Arc<Notify>)>>,
    started: Instant,
    /// Bytes moved with each peer over all its connections (taken under the peers lock).
    traffic: Mutex<crate::traffic::Traffic>,
}

/// Makes the state directory (keys, journal, staging, control socket) the owner's alone,
/// and the config file too, whatever modes they had (an older meshfs made them readable).
fn private_state(home: &Home) {
    use std::os::unix::fs::PermissionsExt;
    let set = |p: &std::path::Path, mode: u32| {
        if p.exists() {
            if let Err(e) = std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)) {
                tracing::warn!(path = %p.display(), error = %e, "cannot restrict permissions");
            }
        }
    };
    set(&home.state_dir, 0o700);
    set(&home.config_file(), 0o600);
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl Engine {
    /// Opens everything and starts the background work. Must run inside a tokio runtime.
    pub async fn start(home: Home) -> anyhow::Result<Arc<Engine>> {
        let config = Config::load(&home)?;
        let identity = Identity::load(&home.identity_dir())?;
        let mut journal = Journal::open(&home.journal_file())?;
        journal.check()?;
        private_state(&home);
        let listen = config.listen_addr(&home)?;
        let trust = TrustStore::new(config.peer_ids());
        let endpoint = transport::endpoint(&identity, listen, trust.clone()).map_err(|e| {
            anyhow::anyhow!(
                "{e}; change device.listen in {}",
                home.config_file().display()
            )
        })?;
        let (changes, _) = broadcast::channel(4096);
        let (stopping, _) = watch::channel(false);
        let engine = Arc::new(Engine {
            device: identity.device_id,
            short: identity.device_id.short(),
            home,
            config: RwLock::new(config.clone()),
            journal: Mutex::new(journal),
            folders: RwLock::new(HashMap::new()),
            peers: Mutex::new(Peers::default()),
            peer_changed: Notify::new(),
            changes,
            endpoint: endpoint.clone(),
            trust,
            stopping,
            shutdown: Notify::new(),
            dialers: Mutex::new(HashMap::new()),
            started: Instant::now(),
            traffic: Mutex::default(),
        });
        for f in &config.folders {
            engine.start_folder(f).await?;
        }
        for f in &config.folders {
            if let (Some(point), Ok(id)) = (&f.mount, FolderId::new(&f.id)) {
                let (e, point) = (engine.clone(), point.clone());
                let mounted =
                    tokio::task::spawn_blocking(move || e.mount(&id, &point, false)).await?;
                match mounted {
                    Ok(m) => {
                        tracing::info!(folder = %f.id, mountpoint = %m.mountpoint.display(), passthrough = m.passthrough, "folder mounted")
                    }
                    Err(e) => {
                        tracing::error!(folder = %f.id, error = %e, "cannot mount the folder; it keeps syncing unmounted")
                    }
                }
            }
        }
        tokio::spawn(peers::accept_loop(engine.clone(), endpoint));
        tokio::spawn(retention_loop(engine.clone()));
        tokio::spawn(traffic_loop(engine.clone()));
        engine.sync_dialers();
        tracing::info!(device = %engine.device, listen = %listen, "meshfs daemon running");
        Ok(engine)
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

    /// A copy of the config in force.
    pub fn config(&self) -> Config {
        self.config
            .read()
            .map(|c| c.clone())
            .unwrap_or_else(|p| p.into_inner().clone())
    }

    /// The folders this device shares with `peer` (and runs).
    pub fn shared_with(&self, peer: &DeviceId) -> Vec<FolderId> {
        let running: HashSet<FolderId> = self
            .folders
            .read()
            .map(|f| f.keys().cloned().collect())
            .unwrap_or_default();
        self.config
            .read()
            .ok()
            .and_then(|c| c.peer(peer).map(|p| p.folders.clone()))
            .unwrap_or_default()
            .into_iter()
            .filter_map(|f| FolderId::new(&f).ok())
            .filter(|f| running.contains(f))
            .collect()
    }

    /// Mounts `folder` at `mountpoint`, served by this daemon. Blocking (the kernel's mount
    /// call): run it off the async workers.
    pub fn mount(
        &self,
        folder: &FolderId,
        mountpoint: &std::path::Path,
        read_only: bool,
    ) -> Result<crate::mounts::MountStatus, String> {
        let rt = self
            .folder(folder)
            .ok_or_else(|| format!("no running folder {folder} (see `meshfs folder list`)"))?;
        let mut slot = rt.mount.lock().map_err(|_| "mount lock poisoned")?;
        if let Some(m) = slot.as_ref() {
            return Err(format!(
                "folder {folder} is already mounted at {}; `meshfs unmount {folder}` first",
                m.info().mountpoint.display()
            ));
        }
        let opts = meshfs_fuse::MountOptions {
            read_only,
            ..Default::default()
        };
        let sink = Arc::new(crate::mounts::CaptureSink::new(rt.capture.clone()));
        let m = meshfs_fuse::mount(rt.store.root(), mountpoint, opts, sink)
            .map_err(|e| e.to_string())?;
        rt.mount_slot.attach(m.handle());
        let status = crate::mounts::MountStatus::from(m.info());
        *slot = Some(m);
        Ok(status)
    }

    /// Unmounts `folder`; its replica keeps syncing. Returns where it was mounted.
    pub fn unmount(&self, folder: &FolderId) -> Result<std::path::PathBuf, String> {
        let rt = self
            .folder(folder)
            .ok_or_else(|| format!("no running folder {folder} (see `meshfs folder list`)"))?;
        let mut slot = rt.mount.lock().map_err(|_| "mount lock poisoned")?;
        let m = slot
            .take()
            .ok_or_else(|| format!("folder {folder} is not mounted"))?;
        rt.mount_slot.detach();
        let point = m.info().mountpoint;
        m.unmount().map_err(|e| e.to_string())?;
        Ok(point)
    }

    /// The connection to each connected peer.
    fn links(&self) -> Vec<(DeviceId, quinn::Connection)> {
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

    /// Decides again, and applies, the remote versions that waited for a writer through the
    /// mount which has since let go (its own version is captured by then, so a concurrent
    /// edit becomes an ordinary conflict with both versions kept).
    pub fn apply_deferred(self: &Arc<Self>, rt: &Arc<FolderRt>) {
        let links: HashMap<DeviceId, quinn::Connection> = self.links().into_iter().collect();
        let connected: HashSet<DeviceId> = links.keys().copied().collect();
        for (record, peer) in rt.take_ready_deferred(&connected) {
            let Some(conn) = links.get(&peer).cloned() else {
                continue;
            };
            let (engine, folder, path) = (self.clone(), rt.id.clone(), record.path.clone());
            tokio::spawn(async move {
                let (turn, _) = crate::apply::Turn::after(None);
                let r = crate::apply::receive(
                    &engine,
                    &folder,
                    peer,
                    &conn,
                    vec![record],
                    HashMap::new(),
                    turn,
                )
                .await;
                match r {
                    Ok(()) => {
                        tracing::info!(%folder, %path, "applied the remote version that waited for the mount's writer");
                        engine.changes_notify(&folder);
                    }
                    Err(e) => {
                        tracing::warn!(%folder, %path, error = %e, "applying a deferred remote version failed; the peer's next change of it brings it again")
                    }
                }
            });
        }
    }

    /// Unmounts every mounted folder (the daemon is stopping).
    pub fn unmount_all(&self) {
        let folders: Vec<Arc<FolderRt>> = self
            .folders
            .read()
            .map(|f| f.values().cloned().collect())
            .unwrap_or_default();
        for rt in folders {
            let m = rt.mount.lock().ok().and_then(|mut s| s.take());
            if let Some(m) = m {
                rt.mount_slot.detach();
                let point = m.info().mountpoint;
                match m.unmount() {
                    Ok(()) => {
                        tracing::info!(folder = %rt.id, mountpoint = %point.display(), "unmounted")
                    }
                    Err(e) => tracing::warn!(folder = %rt.id, error = %e, "unmount failed"),
                }
            }
        }
    }

    /// The folder's local ignore file (`CONFIG_DIR/ignore/FOLDER-ID`): rules no peer can
    /// change, read with the replicated `.meshignore` (`crate::ignore`).
    pub fn local_ignore(&self, folder: &FolderId) -> std::path::PathBuf {
        self.home.config_dir.join("ignore").join(folder.as_str())
    }

    /// A running folder.
    pub fn folder(&self, id: &FolderId) -> Option<Arc<FolderRt>> {
        self.folders.read().ok()?.get(id).cloned()
    }

    /// Tells sessions that `folder`'s journal gained entries.
    pub fn changes_notify(&self, folder: &FolderId) {
        let _ = self.changes.send(folder.clone());
    }

    async fn start_folder(self: &Arc<Self>, f: &crate::config::FolderConfig) -> anyhow::Result<()> {
        let id = FolderId::new(&f.id)?;
        let store = Store::open_staged(&f.path, &self.home.staging_dir(&id))
            .map_err(|e| anyhow::anyhow!("folder {}: {e}", f.id))?;
        let removed = store.remove_temps();
        if removed > 0 {
            tracing::info!(folder = %id, removed, "removed temp files left by an interrupted apply");
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let fresh;
        let slot = Arc::new(crate::mounts::MountSlot::default());
        let rt = Arc::new(FolderRt {
            id: id.clone(),
            ignore: RwLock::new(IgnoreRules::load(&f.path, Some(&self.local_ignore(&id)))),
            store,
            op_lock: Mutex::new(()),
            capture: tx.clone(),
            capture_pending: Default::default(),
            scanning: Default::default(),
            scan_is_long: Default::default(),
            // Inert until the folder is mounted; then it forwards to the mount.
            writers: slot.clone(),
            invalidator: slot.clone(),
            mount_slot: slot,
            mount: Mutex::new(None),
            deferred: Mutex::new(HashMap::new()),
            blocked: Mutex::new(None),
            skipped: Mutex::new(Default::default()),
            echoes: Default::default(),
            watcher: Mutex::new(None),
        });
        {
            let mut j = self
                .journal
                .lock()
                .map_err(|_| anyhow::anyhow!("journal lock poisoned"))?;
            fresh = j.folder(&id)?.max_sequence == 0;
            let done =
                crate::apply::recover_pending(&mut j, &rt, &id).map_err(|e| anyhow::anyhow!(e))?;
            if done > 0 {
                tracing::info!(folder = %id, done, "completed applies interrupted by a crash");
            }
        }
        if f.watch {
            match capture::watch(&f.path, tx) {
                Ok(w) => {
                    if let Ok(mut slot) = rt.watcher.lock() {
                        *slot = Some(w);
                    }
                }
                Err(e) => {
                    tracing::warn!(folder = %id, error = %e, "cannot watch the folder; changes are found by scans only")
                }
            }
        }
        if let Ok(mut m) = self.folders.write() {
            m.insert(id.clone(), rt.clone());
        }
        let started = Instant::now();
        let path = f.path.clone();
        if fresh {
            // Nothing journaled yet: the first scan journals and announces as it hashes, so
            // the daemon goes on to listen and dial at once and peers get the first files
            // while the rest are read (`scan_blocking`).
            rt.scanning
                .store(true, std::sync::atomic::Ordering::Relaxed);
            let engine = self.clone();
            let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
            let waiting = rt.clone();
            tokio::spawn(async move {
                let scanned = engine.scan_paths(&rt.id, Vec::new()).await;
                rt.scanning
                    .store(false, std::sync::atomic::Ordering::Relaxed);
                let _ = done_tx.send(());
                match scanned {
                    Ok(n) => {
                        tracing::info!(folder = %rt.id, path = %path.display(), changes = n, ms = started.elapsed().as_millis() as u64, "folder scanned")
                    }
                    Err(e) => {
                        tracing::error!(folder = %rt.id, error = %e, "first scan failed; retrying with a rescan");
                        let _ = rt.capture.send(CaptureMsg::Rescan);
                    }
                }
                capture_loop(engine, rt, rx).await;
            });
            // A small folder is done at once: wait for it, so the Hello says it is not
            // scanning and peers attach small files' content (`HelloFolder::scanning`). A
            // folder with more than a slice of files to hash is not small: waiting for it
            // would only delay its first files to peers (known once the tree is walked).
            tokio::select! {
                _ = done_rx => {}
                _ = waiting.scan_is_long.notified() => {}
                _ = tokio::time::sleep(FIRST_SCAN_WAIT) => {}
            }
            return Ok(());
        }
        let n = self
            .scan_paths(&id, Vec::new())
            .await
            .map_err(|e| anyhow::anyhow!(e))?;
        tracing::info!(folder = %id, path = %path.display(), changes = n, ms = started.elapsed().as_millis() as u64, "folder scanned");
        tokio::spawn(capture_loop(self.clone(), rt, rx));
        Ok(())
    }

    /// Scans `paths` (empty: the whole folder) and journals what changed. Returns the number of
    /// new versions. The first scan of a folder journals and announces its changes in slices as
    /// it goes ([`scanner::scan_new`]).
    pub async fn scan_paths(
        self: &Arc<Self>,
        folder: &FolderId,
        paths: Vec<RelPath>,
    ) -> Result<usize, String> {
        let engine = self.clone();
        let folder = folder.clone();
        tokio::task::spawn_blocking(move || engine.scan_blocking(&folder, &paths))
            .await
            .map_err(|e| e.to_string())?
    }

    fn scan_blocking(&self, folder: &FolderId, paths: &[RelPath]) -> Result<usize, String> {
        let rt = self
            .folder(folder)
            .ok_or_else(|| format!("no folder {folder} on this device"))?;
        if paths.is_empty()
            || paths
                .iter()
                .any(|p| p.as_str() == crate::ignore::IGNORE_FILE)
        {
            if let Ok(mut ig) = rt.ignore.write() {
                *ig = IgnoreRules::load(rt.store.root(), Some(&self.local_ignore(&rt.id)));
            }
        }
        let _guard = rt.op_lock.lock().map_err(|_| "folder lock poisoned")?;
        let ignore = rt.ignore.read().map_err(|_| "ignore lock poisoned")?;
        let target = ScanTarget {
            folder,
            store: &rt.store,
            ignore: &ignore,
            local: self.short,
            now_secs: now_secs(),
        };
        let t0 = Instant::now();
        let mut streamed = 0;
        let report = {
            let mut j = self.journal.lock().map_err(|_| "journal lock poisoned")?;
            // Only a whole-folder scan asks (a capture of a few paths is the hot path).
            let fresh =
                paths.is_empty() && j.folder(folder).map_err(|e| e.to_string())?.max_sequence == 0;
            if fresh {
                // Nothing journaled yet: everything is new. Journal and announce it as it is
                // hashed, without holding the journal, so peers get the first files while the
                // rest are still being read.
                drop(j);
                let mut emit = |changes: Vec<Change>, to_hash: usize| -> Result<(), String> {
                    // Known once the tree is walked: peers need not wait for a long scan.
                    if to_hash >= scanner::FIRST_SCAN_SLICE {
                        rt.scan_is_long.notify_one();
                    }
                    if changes.is_empty() {
                        return Ok(());
                    }
                    streamed += changes.len();
                    tracing::debug!(%folder, n = changes.len(), ms = t0.elapsed().as_millis() as u64, "first scan: slice journaled");
                    let mut j = self.journal.lock().map_err(|_| "journal lock poisoned")?;
                    commit_in_batches(&mut j, folder, changes)?;
                    drop(j);
                    self.changes_notify(folder);
                    Ok(())
                };
                scanner::scan_new(&target, &mut emit).map_err(|e| e.to_string())?
            } else {
                scanner::scan(&target, &j, paths).map_err(|e| e.to_string())?
            }
        };
        let scanned = t0.elapsed();
        let n = report.changes.len() + streamed;
        let mut j = self.journal.lock().map_err(|_| "journal lock poisoned")?;
        if !report.restat.is_empty() {
            j.set_local_stats(folder, &report.restat)
                .map_err(|e| e.to_string())?;
        }
        commit_in_batches(&mut j, folder, report.changes)?;
        if report.entries > 10_000 {
            j.release_memory();
        }
        drop(j);
        if report.entries > 10_000 {
            // A big scan's transient maps (and the journal's page cache, above) are freed now;
            // give the pages back to the system so the resident size of an idle daemon stays
            // small.
            #[cfg(target_env = "gnu")]
            // SAFETY: malloc_trim only returns free heap pages to the system; it takes the
            // allocator's own locks and leaves every live allocation where it is.
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

    /// Starts/stops dial loops so that every configured peer with an address has one.
    fn sync_dialers(self: &Arc<Self>) {
        let config = self.config();
        let Ok(mut dialers) = self.dialers.lock() else {
            return;
        };
        let mut wanted: HashMap<DeviceId, String> = HashMap::new();
        for p in &config.peers {
            if let (Ok(id), false) = (p.id.parse::<DeviceId>(), p.addr.is_empty()) {
                wanted.insert(id, p.addr.clone());
            }
        }
        dialers.retain(|id, (addr, stop)| {
            let keep = wanted.get(id) == Some(addr);
            if !keep {
                stop.notify_one();
            }
            keep
        });
        for (id, addr) in wanted {
            if let std::collections::hash_map::Entry::Vacant(slot) = dialers.entry(id) {
                let stop = Arc::new(Notify::new());
                slot.insert((addr.clone(), stop.clone()));
                tokio::spawn(peers::dial_loop(self.clone(), id, addr, stop));
            }
        }
    }

    /// Re-reads the config: new folders start, removed ones stop, trust and dialers follow the
    /// peer list, and peers whose shares changed reconnect (so their hello is current).
    pub async fn reload(self: &Arc<Self>) -> anyhow::Result<()> {
        let new = Config::load(&self.home)?;
        let old = self.config();
        *self
            .config
            .write()
            .map_err(|_| anyhow::anyhow!("config lock poisoned"))? = new.clone();
        let new_ids: HashSet<DeviceId> = new.peer_ids().into_iter().collect();
        for id in old.peer_ids() {
            if !new_ids.contains(&id) {
                self.trust.remove(&id);
            }
        }
        for id in &new_ids {
            self.trust.add(*id);
        }
        let running: HashSet<String> = self
            .folders
            .read()
            .map(|f| f.keys().map(|k| k.to_string()).collect())
            .unwrap_or_default();
        for f in &new.folders {
            if !running.contains(&f.id) {
                self.start_folder(f).await?;
            }
        }
        let wanted: HashSet<String> = new.folders.iter().map(|f| f.id.clone()).collect();
        if let Ok(mut m) = self.folders.write() {
            m.retain(|id, rt| {
                let keep = wanted.contains(id.as_str());
                if !keep {
                    if let Ok(mut w) = rt.watcher.lock() {
                        *w = None;
                    }
                }
                keep
            });
        }
        let links = self.links();
        for (id, conn) in links {
            let before = old.peer(&id).map(|p| p.folders.clone());
            let after = new.peer(&id).map(|p| p.folders.clone());
            if before != after {
                conn.close(2u32.into(), b"configuration changed");
            }
        }
        self.sync_dialers();
        Ok(())
    }

    /// Stops sessions and the endpoint.
    pub async fn stop(&self) {
        let _ = self.stopping.send(true);
        self.unmount_all();
        self.shutdown.notify_waiters();
        tokio::time::sleep(Duration::from_millis(50)).await;
        self.endpoint.close(0u32.into(), b"daemon stopping");
        if let Ok(d) = self.dialers.lock() {
            for (_, stop) in d.values() {
                stop.notify_one();
            }
        }
        let _ = tokio::time::timeout(Duration::from_secs(2), self.endpoint.wait_idle()).await;
    }

    /// Updates the per-peer traffic counters from the current links.
    fn observe_traffic(&self) {
        if let (Ok(peers), Ok(mut t)) = (self.peers.lock(), self.traffic.lock()) {
            t.observe(&peers);
        }
    }

    /// The daemon's state as the `status --json` document (see `docs/cli.md`).
    ///
    /// A folder is `in_sync` when its own work is done (nothing waits in capture, the first
    /// scan is over, no remote version waits for a writer, receiving is not blocked) and every
    /// peer sharing it is connected and caught up both ways; `in_sync_with_connected` asks the
    /// latter only of the peers that are connected.
    pub fn status(&self) -> serde_json::Value {
        let config = self.config();
        let folders: Vec<Arc<FolderRt>> = self
            .folders
            .read()
            .map(|f| f.values().cloned().collect())
            .unwrap_or_default();
        // The journal first, in one hold, and not under the peers lock: an install can hold
        // the journal for tens of milliseconds, and the sessions take the peers lock meanwhile.
        let journaled: Vec<(FolderCounts, u64, usize)> = match self.journal.lock() {
            Ok(mut j) => folders
                .iter()
                .map(|rt| {
                    (
                        j.counts(&rt.id).unwrap_or_default(),
                        j.folder(&rt.id).map(|s| s.max_sequence).unwrap_or(0),
                        crate::conflicts::count(&j, &rt.id),
                    )
                })
                .collect(),
            Err(_) => vec![Default::default(); folders.len()],
        };
        let peers = self.peers.lock().ok();
        let traffic = self.traffic.lock().ok().map(|mut t| {
            if let Some(p) = &peers {
                t.observe(p);
            }
            t
        });
        let last_seen_unix = |pid: &DeviceId| {
            peers
                .as_ref()
                .and_then(|x| x.last_seen.get(pid).copied())
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map(|d| d.as_secs())
        };
        let mut folders_json = Vec::new();
        let mut all_synced = true;
        let mut all_synced_connected = true;
        for (rt, (counts, max, conflicts)) in folders.into_iter().zip(journaled) {
            let capture_pending = rt
                .capture_pending
                .load(std::sync::atomic::Ordering::Relaxed);
            let mut peer_list = Vec::new();
            let scanning = rt.scanning.load(std::sync::atomic::Ordering::Relaxed);
            let waiting_for_writers = rt.deferred_count();
            let blocked = rt.blocked();
            let local_done =
                capture_pending == 0 && !scanning && waiting_for_writers == 0 && blocked.is_none();
            let mut folder_synced = local_done;
            let mut folder_synced_connected = local_done;
            let mut all_connected = true;
            for p in &config.peers {
                if !p.folders.iter().any(|f| f == rt.id.as_str()) {
                    continue;
                }
                let Ok(pid) = p.id.parse::<DeviceId>() else {
                    continue;
                };
                let connected = peers.as_ref().is_some_and(|x| x.link(&pid).is_some());
                let s = peers
                    .as_ref()
                    .and_then(|x| x.sync.get(&(pid, rt.id.clone())).cloned());
                let in_sync =
                    connected && s.as_ref().is_some_and(|s| s.in_sync && s.our_acked >= max);
                // In sync means with every peer sharing the folder: a peer that is down (or
                // never came) has not got our changes. `in_sync_with_connected` is the weaker
                // claim, for scripts that only care about the peers reachable now.
                folder_synced &= in_sync;
                folder_synced_connected &= in_sync || !connected;
                all_connected &= connected;
                peer_list.push(serde_json::json!({
                    "device_id": pid.to_string(),
                    "name": p.name,
                    "connected": connected,
                    "in_sync": in_sync,
                    "our_sequence": max,
                    "acked_by_peer": s.as_ref().map_or(0, |s| s.our_acked),
                    "their_sequence": s.as_ref().map_or(0, |s| s.their_known_max),
                    "applied_from_peer": s.as_ref().map_or(0, |s| s.their_applied),
                    "pending_records": s.as_ref().map_or(0, |s| max.saturating_sub(s.our_acked)),
                    "last_seen_unix": last_seen_unix(&pid),
                }));
            }
            all_synced &= folder_synced;
            all_synced_connected &= folder_synced_connected;
            folders_json.push(serde_json::json!({
                "id": rt.id.to_string(),
                "path": rt.store.root().display().to_string(),
                "files": counts.files,
                "dirs": counts.dirs,
                "symlinks": counts.symlinks,
                "bytes": counts.bytes,
                "tombstones": counts.tombstones,
                "sequence": max,
                "capture_pending": capture_pending,
                "scanning": scanning,
                "conflicts": conflicts,
                "waiting_for_writers": waiting_for_writers,
                "skipped": rt.skipped().into_iter().map(|(p, e)| serde_json::json!({"path": p.as_str(), "error": e})).collect::<Vec<_>>(),
                "blocked": blocked,
                "mount": rt.mount.lock().ok().and_then(|m| m.as_ref().map(|m| crate::mounts::MountStatus::from(m.info()))),
                "in_sync": folder_synced,
                "in_sync_with_connected": folder_synced_connected,
                "peers_connected": all_connected,
                "peers": peer_list,
            }));
        }
        let mut peers_json = Vec::new();
        for p in &config.peers {
            let Ok(pid) = p.id.parse::<DeviceId>() else {
                continue;
            };
            let stats = peers.as_ref().and_then(|x| x.stats(&pid));
            let (bytes_sent, bytes_received) = traffic.as_ref().map_or((0, 0), |t| t.peer(&pid));
            peers_json.push(serde_json::json!({
                "device_id": pid.to_string(),
                "short_id": pid.short().display7(),
                "name": p.name,
                "addr": p.addr,
                "folders": p.folders,
                "connected": stats.is_some(),
                "rtt_ms": stats.as_ref().map(|s| s.rtt.as_secs_f64() * 1000.0),
                "bytes_sent": bytes_sent,
                "bytes_received": bytes_received,
                "last_seen_unix": last_seen_unix(&pid),
            }));
        }
        let (sent, received) = traffic.as_ref().map_or((0, 0), |t| t.totals());
        drop(traffic);
        let refused: Vec<serde_json::Value> = self
            .trust
            .refused()
            .into_iter()
            .map(|(id, _)| serde_json::json!(id.to_string()))
            .collect();
        serde_json::json!({
            "device": {
                "id": self.device.to_string(),
                "short_id": self.short.display7(),
                "name": config.device.name,
                "listen": config.device.listen,
                "uptime_secs": self.started.elapsed().as_secs(),
                "started_unix": now_secs().saturating_sub(self.started.elapsed().as_secs()),
            },
            "in_sync": all_synced,
            "in_sync_with_connected": all_synced_connected,
            "folders": folders_json,
            "peers": peers_json,
            "refused_devices": refused,
            "bytes_sent": sent,
            "bytes_received": received,
        })
    }
}

/// Shows the traffic counters every link as it comes and goes, so a peer's bytes outlive its
/// connection (the sessions wake `peer_changed` when a link is registered or ends).
async fn traffic_loop(engine: Arc<Engine>) {
    let mut stopping = engine.stopping.subscribe();
    loop {
        let changed = engine.peer_changed.notified();
        tokio::pin!(changed);
        // Registered before looking, so a link that comes meanwhile wakes the next round.
        changed.as_mut().enable();
        engine.observe_traffic();
        tokio::select! {
            _ = changed => {}
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = stopping.changed() => return,
        }
    }
}

/// Applies the history and tombstone retention of `[options]` once an hour.
async fn retention_loop(engine: Arc<Engine>) {
    let mut stopping = engine.stopping.subscribe();
    loop {
        let o = engine.options();
        let now_ns = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as i64)
            .unwrap_or(0);
        let day_ns: i64 = 86_400 * 1_000_000_000;
        let folders: Vec<FolderId> = engine
            .folders
            .read()
            .map(|f| f.keys().cloned().collect())
            .unwrap_or_default();
        if let Ok(mut j) = engine.journal.lock() {
            for f in &folders {
                if o.history_retention_days > 0 {
                    let _ = j.prune_history(f, now_ns - o.history_retention_days as i64 * day_ns);
                }
                if o.tombstone_retention_days > 0 {
                    let _ =
                        j.prune_tombstones(f, now_ns - o.tombstone_retention_days as i64 * day_ns);
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(3600)) => {}
            _ = stopping.changed() => return,
        }
    }
}

/// Coalesces a folder's events and scans what is ready.
async fn capture_loop(
    engine: Arc<Engine>,
    rt: Arc<FolderRt>,
    mut rx: mpsc::UnboundedReceiver<CaptureMsg>,
) {
    let quiet = Duration::from_millis(engine.options().coalesce_ms);
    let open_quiet = Duration::from_secs(1);
    let mut c = Coalescer::default();
    let mut next: Option<Instant> = None;
    let mut released = false;
    // Set while scans fail (the journal's disk full): the next success says it is over.
    let mut scan_failing: Option<Instant> = None;
    let mut stopping = engine.stopping.subscribe();
    loop {
        let sleep = async {
            match next {
                Some(t) => tokio::time::sleep_until(t.into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            msg = rx.recv() => {
                let Some(msg) = msg else { return };
                let now = Instant::now();
                let mut final_now = false;
                for m in std::iter::once(msg).chain(std::iter::from_fn(|| rx.try_recv().ok())) {
                    match m {
                        CaptureMsg::Released(p) => {
                            released = true;
                            c.finalize(&p, now, quiet);
                            final_now = true;
                        }
                        m => c.add(m, now),
                    }
                }
                rt.capture_pending.store(c.len().max(1), std::sync::atomic::Ordering::Relaxed);
                // A file whose last writer let go through the mount is captured at once:
                // the quiet time only guesses when a burst of inotify events is over.
                let due = if final_now { now } else { now + quiet };
                next = Some(next.map_or(due, |n| n.min(due)));
            }
            _ = sleep => {
                let (rescan, paths, n) = c.take_ready(Instant::now(), quiet, open_quiet);
                next = n;
                let scopes = if rescan {
                    Vec::new()
                } else {
                    let mut dirs = crate::store::DirCache::default();
                    paths
                        .into_iter()
                        .filter(|p| {
                            !rt.echoes.is_echo(p, || rt.store.stat_in(&mut dirs, p).ok().flatten())
                        })
                        .collect()
                };
                if rescan || !scopes.is_empty() {
                    let (t0, n) = (Instant::now(), scopes.len());
                    let first = tracing::enabled!(tracing::Level::DEBUG)
                        .then(|| scopes.first().cloned())
                        .flatten();
                    match engine.scan_paths(&rt.id, scopes).await {
                        Ok(changes) => {
                            tracing::debug!(folder = %rt.id, rescan, scopes = n, first = ?first, changes, ms = t0.elapsed().as_millis() as u64, "captured");
                            if scan_failing.take().is_some() && rt.unblock() {
                                tracing::info!(folder = %rt.id, "the journal's disk has room again; capture resumed");
                            }
                        }
                        Err(e) => {
                            // What the scan took from the queue is not journaled: nothing is
                            // lost as long as a later scan covers it, so the folder is rescanned
                            // whole after a pause.
                            let full = e.contains("the disk holding the journal");
                            if full {
                                if rt.block(format!("journal disk full: {e}")) {
                                    tracing::error!(folder = %rt.id, error = %e, "the journal's disk is full; changes are captured again once there is room");
                                }
                            } else {
                                tracing::warn!(folder = %rt.id, error = %e, "scan failed; rescanning the folder shortly");
                            }
                            let retry = Instant::now() + RESCAN_AFTER_FAILURE;
                            scan_failing = Some(retry);
                            c.add(CaptureMsg::Rescan, retry);
                            next = Some(next.map_or(retry, |n| n.min(retry)));
                        }
                    }
                }
                // A writer let go: once its path is captured (nothing of it waits here any
                // more), the remote versions that waited for it are decided again.
                if std::mem::take(&mut released) || rt.deferred_count() > 0 {
                    if c.is_empty() {
                        engine.apply_deferred(&rt);
                    } else {
                        released = true;
                    }
                }
                rt.capture_pending.store(c.len(), std::sync::atomic::Ordering::Relaxed);
            }
            _ = stopping.changed() => return,
        }
    }
}

/// How long the capture loop waits before rescanning a folder whose scan failed.
const RESCAN_AFTER_FAILURE: Duration = Duration::from_secs(2);

/// How long starting a folder waits for its first scan before going on while it runs.
const FIRST_SCAN_WAIT: Duration = Duration::from_millis(250);

/// Commits scanned changes, [`SCAN_COMMIT_BATCH`] per transaction.
fn commit_in_batches(
    j: &mut Journal,
    folder: &FolderId,
    mut changes: Vec<Change>,
) -> Result<(), String> {
    while !changes.is_empty() {
        let rest = changes.split_off(changes.len().min(SCAN_COMMIT_BATCH));
        j.commit(folder, changes).map_err(|e| e.to_string())?;
        changes = rest;
    }
    Ok(())
}
