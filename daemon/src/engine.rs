//! The engine: wires the folders ([`Folders`]), the peers ([`Net`]) and the mounts together,
//! runs each folder's capture loop, and answers the control socket. `meshfs daemon` runs one.
//! Nothing below it imports it.
//!
//! Start-up order: open the journal → for each folder: remove leftover temp files, complete
//! interrupted applies ([`crate::apply::recover_pending`]), scan the whole folder (changes made
//! while no daemon ran are journaled exactly once), start the watcher → listen → local
//! discovery (if on) and the watch on this host's network → dial peers.

use crate::capture::{self, CaptureMsg};
use crate::config::{Config, Home, Options};
use crate::discovery::{self, interfaces, netlink};
use crate::folder::{FolderError, FolderRt, Folders};
use crate::identity::Identity;
use crate::ignore::IgnoreRules;
use crate::journal::{FolderCounts, Journal};
use crate::peers::{self, Net, Peers};
use crate::store::Store;
use crate::transport::{self, TrustStore};
use meshfs_protocol::{DeviceId, FolderId, RelPath, ShortId};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch, Notify};

/// Why a folder could not be mounted or unmounted.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    /// The folder does not run here (or a lock is poisoned).
    #[error("{0} (see `meshfs folder list`)")]
    Folder(#[from] FolderError),
    /// It is mounted already.
    #[error("folder {folder} is already mounted at {}; `meshfs unmount {folder}` first", at.display())]
    AlreadyMounted {
        /// The folder.
        folder: meshfs_protocol::FolderId,
        /// Where it is mounted.
        at: std::path::PathBuf,
    },
    /// It is not mounted.
    #[error("folder {0} is not mounted")]
    NotMounted(meshfs_protocol::FolderId),
    /// The kernel or the mount point refused.
    #[error(transparent)]
    Fuse(#[from] meshfs_fuse::MountError),
}

/// The engine of one device.
pub struct Engine {
    /// Where this device's files live.
    pub home: Home,
    /// This device.
    pub device: DeviceId,
    /// Its short id (version-vector key).
    pub short: ShortId,
    config: Arc<RwLock<Config>>,
    /// The journal and the running folders.
    pub folders: Arc<Folders>,
    /// The peers: connections, sessions, the endpoint.
    pub net: Arc<Net>,
    /// Devices allowed to connect.
    pub trust: TrustStore,
    /// Each dialed peer's dial loop.
    dialers: Mutex<HashMap<DeviceId, Dialer>>,
    started: Instant,
    /// Bytes moved with each peer over all its connections (taken under the peers lock).
    traffic: Mutex<crate::traffic::Traffic>,
    /// The folders mounted as they were at a past time (`meshfs mount --at`).
    pub snapshots: crate::versions::snapshot::Snapshots,
}

/// A running dial loop: the peer's addresses it was started for, and its stop signal.
type Dialer = (Vec<String>, Arc<Notify>);

/// Makes the state directory (keys, journal, staging, control socket) the owner's alone,
/// and the config file, its directory and the local ignore files too, whatever modes they
/// had (an older meshfs made them readable).
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
    set(&home.config_dir, 0o700);
    set(&home.local_ignore_dir(), 0o700);
    set(&home.config_file(), 0o600);
    // The local ignore files say what is secret; they are the user's, written by hand.
    for e in std::fs::read_dir(home.local_ignore_dir())
        .into_iter()
        .flatten()
        .flatten()
    {
        if e.file_type().is_ok_and(|t| t.is_file()) {
            set(&e.path(), 0o600);
        }
    }
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
        let (stopping, _) = watch::channel(false);
        let folders = Arc::new(Folders::new(
            identity.device_id,
            journal,
            home.local_ignore_dir(),
        ));
        let first = config.clone();
        let config = Arc::new(RwLock::new(config));
        let addresses =
            discovery::Addresses::new(Some(discovery::remembered::file(&home.state_dir)));
        let net = Arc::new(Net {
            folders: folders.clone(),
            config: config.clone(),
            peers: crate::lock::Ranked::new(crate::lock::Rank::Peers, "peers", Peers::default()),
            peer_changed: Notify::new(),
            links: watch::channel(Default::default()).0,
            endpoint: endpoint.clone(),
            stopping,
            shutdown: Notify::new(),
            addresses,
            network: watch::channel(0).0,
            seeking: watch::channel(Default::default()).0,
            link_addrs: watch::channel(Default::default()).0,
            lan: Mutex::new(None),
            receivers: Default::default(),
        });
        net.seeking.send_replace(net.dynamic_peers());
        let engine = Arc::new(Engine {
            device: identity.device_id,
            short: identity.device_id.short(),
            home,
            config,
            folders,
            net,
            trust,
            dialers: Mutex::new(HashMap::new()),
            started: Instant::now(),
            traffic: Mutex::default(),
            snapshots: Default::default(),
        });
        for f in &first.folders {
            engine.start_folder(f).await?;
        }
        for f in &first.folders {
            if let Some(point) = &f.mount {
                let (e, id, point, others) =
                    (engine.clone(), f.id.clone(), point.clone(), f.allow_other);
                let mounted =
                    tokio::task::spawn_blocking(move || e.mount(&id, &point, false, others))
                        .await?;
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
        match transport::lane_listener(&endpoint, &identity, engine.trust.clone()).await {
            Ok((listener, acceptor)) => {
                tokio::spawn(peers::lane_accept_loop(
                    engine.net.clone(),
                    listener,
                    acceptor,
                ));
            }
            // Peers' large fetches take QUIC streams, as every fetch did before the lane.
            Err(e) => tracing::warn!(error = %e, "no bulk lane for peers' fetches"),
        }
        tokio::spawn(peers::accept_loop(engine.net.clone(), endpoint));
        tokio::spawn(retention_loop(engine.clone()));
        tokio::spawn(traffic_loop(engine.clone()));
        tokio::spawn(network_loop(engine.clone()));
        engine.sync_discovery(None);
        engine.sync_dialers();
        tracing::info!(device = %engine.device, listen = %listen, "meshfs daemon running");
        Ok(engine)
    }

    /// This device's name.
    pub fn name(&self) -> String {
        self.net.name()
    }

    /// The options in force.
    pub fn options(&self) -> Options {
        self.net.options()
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
        self.net.shared_with(peer)
    }

    /// Mounts `folder` at `mountpoint`, served by this daemon; `allow_other` lets other users
    /// in. Blocking (the kernel's mount call): run it off the async workers.
    pub fn mount(
        &self,
        folder: &FolderId,
        mountpoint: &std::path::Path,
        read_only: bool,
        allow_other: bool,
    ) -> Result<crate::mounts::MountStatus, MountError> {
        let rt = self.folders.running(folder)?;
        rt.with_mount(|slot| {
            if let Some(m) = slot.as_ref() {
                return Err(MountError::AlreadyMounted {
                    folder: folder.clone(),
                    at: m.info().mountpoint,
                });
            }
            // Every mount can meet placeholders (a folder on demand now or before, D90).
            let content: Option<Arc<dyn meshfs_fuse::ContentSource>> =
                tokio::runtime::Handle::try_current().ok().map(|runtime| {
                    Arc::new(crate::ondemand::MountContent::new(
                        &self.folders,
                        folder.clone(),
                        self.ondemand_peers(),
                        runtime,
                    )) as Arc<dyn meshfs_fuse::ContentSource>
                });
            let opts = meshfs_fuse::MountOptions {
                read_only,
                allow_other,
                content,
                ..Default::default()
            };
            let sink = Arc::new(crate::mounts::CaptureSink::new(rt.capture.clone()));
            // Its request threads run at the daemon's own priority, above the engine's (D107).
            let (root, point) = (rt.store.root().to_path_buf(), mountpoint.to_path_buf());
            let m = crate::priority::in_foreground(move || {
                meshfs_fuse::mount(&root, &point, opts, sink)
            })?;
            rt.mount_slot.attach(m.handle());
            let status = crate::mounts::MountStatus::from(m.info());
            *slot = Some(m);
            Ok(status)
        })
    }

    /// Unmounts `folder`; its replica keeps syncing. Returns where it was mounted.
    pub fn unmount(&self, folder: &FolderId) -> Result<std::path::PathBuf, MountError> {
        let rt = self.folders.running(folder)?;
        rt.with_mount(|slot| {
            let m = slot
                .take()
                .ok_or_else(|| MountError::NotMounted(folder.clone()))?;
            rt.mount_slot.detach();
            let point = m.info().mountpoint;
            m.unmount()?;
            Ok(point)
        })
    }

    /// Decides again, and applies, the remote versions that waited for a writer through the
    /// mount which has since let go (its own version is captured by then, so a concurrent
    /// edit becomes an ordinary conflict with both versions kept), or for the local version
    /// they conflict with to be fetched (D101): fetched here first.
    pub fn apply_deferred(self: &Arc<Self>, rt: &Arc<FolderRt>) {
        let links: HashMap<DeviceId, quinn::Connection> = self.net.links().into_iter().collect();
        let connected: HashSet<DeviceId> = links.keys().copied().collect();
        for waiting in rt.take_ready_deferred(&connected) {
            let (record, peer) = (waiting.remote.clone(), waiting.peer);
            let Some(conn) = links.get(&peer).cloned() else {
                continue;
            };
            let (engine, folder, path) = (self.clone(), rt.id.clone(), record.path.clone());
            let Some(receiver) = self.net.receiver(&rt.id) else {
                continue;
            };
            let rt = rt.clone();
            tokio::spawn(async move {
                let Some(waiting) = engine.local_first(&rt, waiting).await else {
                    return;
                };
                let source = crate::apply::Receiver::new_source();
                let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
                receiver.receive(
                    source,
                    peer,
                    conn,
                    vec![record.clone()],
                    Vec::new(),
                    None,
                    tx,
                );
                let r = match rx.recv().await {
                    Some(crate::apply::Reply::Applied { .. }) => Ok(()),
                    Some(crate::apply::Reply::Failed { error, .. }) => Err(error),
                    None => Err(crate::apply::ApplyError::Task("the folder stopped".into())),
                };
                receiver.gone(source);
                match r {
                    Ok(()) => {
                        tracing::info!(%folder, %path, "applied the remote version that waited for the mount's writer");
                        engine.changes_notify(&folder);
                        // Decided: its row is no longer needed (unless a writer opened the
                        // path again meanwhile and it waits once more, under the same row).
                        if engine.folder(&folder).is_some_and(|rt| rt.waits(&record)) {
                            return;
                        }
                        let folders = engine.folders.clone();
                        let cleared = tokio::task::spawn_blocking(move || {
                            folders.journal()?.clear_deferred(&folder, &record)?;
                            Ok::<(), FolderError>(())
                        })
                        .await;
                        if let Ok(Err(e)) = cleared {
                            tracing::warn!(%path, error = %e, "cannot forget a decided deferred version; the next start decides it again (no change)");
                        }
                    }
                    Err(e) => {
                        // Right after a start the first link to the peer can be a crossed
                        // dial that closes under the chunk requests: tried again shortly.
                        tracing::warn!(%folder, %path, error = %e, failed = waiting.failed + 1, "applying a deferred remote version failed; it is tried again later");
                        if let Some(rt) = engine.folder(&folder) {
                            rt.defer_again(waiting, DEFERRED_RETRY);
                            rt.last_error.set(format_args!("applying the remote version of {path} that waited for the mount's writer failed: {e}"));
                        }
                    }
                }
            });
        }
    }

    /// Unmounts every mounted folder and snapshot (the daemon is stopping).
    pub fn unmount_all(&self) {
        for rt in self.folders.all() {
            unmount_folder(&rt);
        }
        self.snapshots.unmount_all(None);
    }

    /// `meshfs restore`: brings a past version (or a tree as it was at a time) back as a new
    /// local change ([`crate::versions::restore`]).
    pub async fn restore(
        &self,
        folder: &FolderId,
        path: RelPath,
        pick: crate::versions::restore::Pick,
        to: Option<RelPath>,
    ) -> Result<crate::versions::restore::RestoreReport, crate::versions::restore::RestoreError>
    {
        let peers = self.peers_of(folder);
        crate::versions::restore::restore(
            self.folders.clone(),
            folder.clone(),
            path,
            pick,
            to,
            peers,
        )
        .await
    }

    /// `meshfs mount FOLDER DIR --at TIME`: the folder as it was at `at_ns`, read-only at
    /// `mountpoint`. Blocking (the kernel's mount): run it on a blocking thread. Returns where
    /// it is mounted and how many paths it shows.
    pub fn mount_at(
        &self,
        folder: &FolderId,
        mountpoint: &std::path::Path,
        at_ns: i64,
    ) -> Result<(std::path::PathBuf, usize), crate::versions::snapshot::SnapshotError> {
        let (net, config, id) = (self.net.clone(), self.config.clone(), folder.clone());
        let peers: crate::versions::snapshot::Peers = Arc::new(move || {
            links_sharing(&net, &config, &id)
                .into_iter()
                .map(|(_, c)| c)
                .collect()
        });
        self.snapshots
            .mount(self.folders.clone(), folder, at_ns, mountpoint, peers)
    }

    /// The connections to every peer that shares `folder` with this device, now.
    pub fn peers_of(&self, folder: &FolderId) -> Vec<quinn::Connection> {
        links_sharing(&self.net, &self.config, folder)
            .into_iter()
            .map(|(_, c)| c)
            .collect()
    }

    /// The connected peers sharing a folder, asked at each use (on demand: where content is
    /// fetched from, D92).
    pub fn ondemand_peers(&self) -> crate::ondemand::Peers {
        let net = Arc::downgrade(&self.net);
        let config = self.config.clone();
        Arc::new(move |folder: &FolderId| {
            let Some(net) = net.upgrade() else {
                return Vec::new();
            };
            links_sharing(&net, &config, folder)
        })
    }

    /// For a remote version that waits for the local version it conflicts with (D101): fetches
    /// that version first, if it is still a placeholder (deleted or replaced meanwhile, the
    /// remote one is simply decided again). When it cannot be fetched, after a few tries it is
    /// looked for on every device sharing the folder; held nowhere, it is marked lost (D103)
    /// and the remote version is decided now; otherwise `waiting` is deferred again (`None`).
    async fn local_first(
        &self,
        rt: &Arc<FolderRt>,
        waiting: crate::folder::Deferred,
    ) -> Option<crate::folder::Deferred> {
        let local = match &waiting.wait {
            crate::folder::Wait::Content(local) => local.clone(),
            crate::folder::Wait::Writer => return Some(waiting),
        };
        if rt
            .store
            .placeholder_at(&mut crate::store::DirCache::default(), &local)
            .is_none()
        {
            return Some(waiting);
        }
        let peers = self.ondemand_peers();
        let Err(f) = crate::ondemand::make_local(&self.folders, rt, &peers, &local, 0).await else {
            return Some(waiting);
        };
        let (folder, path) = (&rt.id, waiting.remote.path.clone());
        let lost = if waiting.failed + 1 >= LOST_AFTER_TRIES {
            let links = links_sharing(&self.net, &self.config, folder);
            let sharing = {
                let config = self.config.read().unwrap_or_else(|p| p.into_inner());
                config.sharing(folder).count()
            };
            crate::ondemand::lost::held_nowhere(&self.folders, rt, links, sharing, &local).await
        } else {
            None
        };
        let Some(version) = lost else {
            tracing::info!(%folder, %path, error = %f.why, failed = waiting.failed + 1, "the local version a remote one conflicts with cannot be fetched yet; tried again later");
            rt.defer_again(waiting, DEFERRED_RETRY);
            return None;
        };
        tracing::warn!(%folder, %path, local = %local, %version, "the local version a remote one conflicts with is held by no device sharing the folder (every one is connected and says so): it is not kept; the remote state replaces it");
        rt.last_error.set(format_args!("{local}: the version here ({version}) was not local and no device sharing the folder holds its content any more; the remote version of {path} replaced it"));
        rt.mark_lost(local, version);
        Some(waiting)
    }

    /// The connected peers that may be counted as holding a folder's content, asked at each
    /// use: sharing it and keeping all of it (a peer on demand acknowledges versions it does
    /// not hold, D99).
    fn holders(&self) -> crate::ondemand::budget::Connected {
        let peers = self.ondemand_peers();
        let net = Arc::downgrade(&self.net);
        Arc::new(move |folder: &FolderId| {
            let Some(net) = net.upgrade() else {
                return Vec::new();
            };
            peers(folder)
                .into_iter()
                .filter(|(d, _)| !net.keeps_part(d, folder))
                .collect()
        })
    }

    /// `meshfs pin FOLDER PATH` (D94).
    pub async fn pin(
        &self,
        folder: &FolderId,
        path: RelPath,
    ) -> Result<crate::ondemand::pins::PinReport, crate::ondemand::pins::PinError> {
        let rt = self.folders.running(folder)?;
        let peers = self.ondemand_peers();
        crate::ondemand::pins::pin(&self.folders, &rt, &peers, path).await
    }

    /// `meshfs unpin FOLDER PATH`: whether it was pinned.
    pub async fn unpin(
        &self,
        folder: &FolderId,
        path: RelPath,
    ) -> Result<bool, crate::ondemand::pins::PinError> {
        let rt = self.folders.running(folder)?;
        let folders = self.folders.clone();
        tokio::task::spawn_blocking(move || crate::ondemand::pins::unpin(&folders, &rt, &path))
            .await
            .map_err(|e| FolderError::Task(e.to_string()))?
    }

    /// `meshfs evict FOLDER PATH` (D93).
    pub async fn evict(
        &self,
        folder: &FolderId,
        path: RelPath,
    ) -> Result<crate::ondemand::budget::EvictReport, FolderError> {
        let rt = self.folders.running(folder)?;
        if !rt.policy().on_demand {
            return Err(FolderError::NotOnDemand(folder.clone()));
        }
        let folders = self.folders.clone();
        let connected = self.holders()(folder);
        tokio::task::spawn_blocking(move || {
            crate::ondemand::budget::evict(&folders, &rt, &path, &connected)
        })
        .await
        .map_err(|e| FolderError::Task(e.to_string()))?
    }

    /// The folder's local ignore file (`CONFIG_DIR/ignore/FOLDER-ID`): rules no peer can
    /// change, read with the replicated `.meshignore` (`crate::ignore`).
    pub fn local_ignore(&self, folder: &FolderId) -> std::path::PathBuf {
        self.folders.local_ignore(folder)
    }

    /// A running folder.
    pub fn folder(&self, id: &FolderId) -> Option<Arc<FolderRt>> {
        self.folders.get(id)
    }

    /// Tells sessions that `folder`'s journal gained entries.
    pub fn changes_notify(&self, folder: &FolderId) {
        self.folders.changes_notify(folder);
    }

    /// Scans `paths` of `folder` (empty: all of it) and journals what changed.
    pub async fn scan_paths(
        &self,
        folder: &FolderId,
        paths: Vec<RelPath>,
    ) -> Result<usize, FolderError> {
        self.folders.scan_paths(folder, paths).await
    }

    async fn start_folder(self: &Arc<Self>, f: &crate::config::FolderConfig) -> anyhow::Result<()> {
        let id = f.id.clone();
        let store = Store::open_staged(&f.path, &self.home.staging_dir(&id))
            .map_err(|e| anyhow::anyhow!("folder {}: {e}", f.id))?;
        store.set_device(self.folders.short);
        store.set_umask(f.umask());
        let (tx, rx) = mpsc::unbounded_channel();
        let fresh;
        let slot = Arc::new(crate::mounts::MountSlot::default());
        let ignore = IgnoreRules::load(&f.path, Some(&self.local_ignore(&id)));
        let rt = Arc::new(FolderRt::new(id.clone(), store, ignore, tx.clone(), slot));
        // The keeper first: an old file kept aside when the daemon stopped goes to it as the
        // temp files are removed (`Store::remove_temps`).
        crate::versions::start_folder(
            &self.folders,
            &rt,
            crate::folder::FolderPolicy::new(f, &self.config()),
            &self.home.vault_file(&id),
        );
        let removed = rt.store.remove_temps();
        if removed > 0 {
            tracing::info!(folder = %id, removed, "removed temp files left by an interrupted apply");
        }
        {
            let mut j = self.folders.journal()?;
            fresh = j.folder(&id)?.max_sequence == 0;
            let done = crate::apply::recover_pending(&mut j, &rt, &id)?;
            if done > 0 {
                tracing::info!(folder = %id, done, "completed applies interrupted by a crash");
            }
            rt.demand.set_pins(j.pins(&id)?);
            rt.demand.set_under(f.on_demand_subtrees());
            j.prune_absent(&id)?;
        }
        if f.watch {
            let quiet = Duration::from_millis(self.options().coalesce_ms);
            match capture::watch(
                &f.path,
                tx,
                capture::Nap::for_quiet(quiet),
                rt.invalidator.clone(),
            ) {
                Ok(w) => rt.set_watcher(Some(w)),
                Err(e) => {
                    tracing::warn!(folder = %id, error = %e, "cannot watch the folder; changes are found by scans only")
                }
            }
        }
        // Before the folder is visible to sessions: a Hello never says a first scan is not
        // running and a `Scan` later that it is (a first scan runs once).
        rt.scanning
            .store(fresh, std::sync::atomic::Ordering::Relaxed);
        if let Ok(mut r) = self.net.receivers.write() {
            r.insert(
                id.clone(),
                crate::apply::Receiver::start(self.folders.clone(), id.clone()),
            );
        }
        self.folders.insert(rt.clone());
        self.start_on_demand(&rt, f);
        let started = Instant::now();
        let path = f.path.clone();
        if fresh {
            // Nothing journaled yet: the first scan journals and announces as it hashes, so
            // the daemon goes on to listen and dial at once and peers get the first files
            // while the rest are read (`scan_blocking`).
            let engine = self.clone();
            let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
            let waiting = rt.clone();
            tokio::spawn(async move {
                let scanned = engine.scan_paths(&rt.id, Vec::new()).await;
                let _ = done_tx.send(());
                match scanned {
                    Ok(n) => {
                        first_scan_done(&engine, &rt);
                        tracing::info!(folder = %rt.id, path = %path.display(), changes = n, ms = started.elapsed().as_millis() as u64, "folder scanned")
                    }
                    Err(e) => {
                        // Still scanning, to this device and its peers, until a whole-folder
                        // rescan has journaled what this one did not (`capture_loop`).
                        tracing::error!(folder = %rt.id, error = %e, "first scan failed; retrying with a rescan");
                        rt.last_error.set(format_args!("first scan failed: {e}"));
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
        let n = self.scan_paths(&id, Vec::new()).await?;
        tracing::info!(folder = %id, path = %path.display(), changes = n, ms = started.elapsed().as_millis() as u64, "folder scanned");
        // Remote versions that waited for a writer when the daemon stopped (a folder that was
        // never scanned has none): no writer holds them now, and what the user saved is
        // journaled by the scan above, so they are decided again as soon as their peer is
        // connected (`traffic_loop`).
        let waiting = self.folders.journal()?.deferred(&id)?;
        if !waiting.is_empty() {
            tracing::info!(folder = %id, n = waiting.len(), "remote versions that waited for a writer before the restart are decided again");
        }
        for (record, peer) in waiting {
            rt.defer(record, peer, crate::folder::Wait::Writer);
        }
        tokio::spawn(capture_loop(self.clone(), rt, rx));
        Ok(())
    }

    /// An on-demand folder's budget keeper (D93), after checking that its filesystem keeps
    /// the placeholder mark (D90): where it does not, the folder is not on demand (its
    /// content is fetched as on any device) and says so.
    fn start_on_demand(&self, rt: &Arc<FolderRt>, f: &crate::config::FolderConfig) {
        if f.on_demand {
            if let Err(e) = rt.store.keeps_placeholders() {
                let mut p = rt.policy();
                p.on_demand = false;
                rt.set_policy(p);
                tracing::error!(folder = %rt.id, error = %e, "the folder cannot be on demand: its filesystem keeps no user extended attributes; its content is fetched whole");
                rt.last_error.set(format_args!(
                    "not on demand: the filesystem of {} keeps no user extended attributes ({e})",
                    f.path.display()
                ));
            }
        }
        tokio::spawn(crate::ondemand::pins::keep_outside(
            Arc::downgrade(&self.folders),
            rt.id.clone(),
            self.ondemand_peers(),
        ));
        tokio::spawn(crate::ondemand::budget::run(
            Arc::downgrade(&self.folders),
            rt.id.clone(),
            self.holders(),
        ));
    }

    /// Starts or stops local discovery as `[discovery]` says (`before`: the config it ran
    /// with, `None` at start).
    fn sync_discovery(self: &Arc<Self>, before: Option<&crate::config::DiscoveryConfig>) {
        let now = self.config().discovery;
        if before == Some(&now) {
            return;
        }
        let Ok(mut slot) = self.net.lan.lock() else {
            return;
        };
        if let Some(old) = slot.take() {
            old.stop();
        }
        if !now.local {
            tracing::info!("local discovery is off: nothing is announced or listened for");
            return;
        }
        let quic = match self.net.endpoint.local_addr() {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "local discovery not started: the endpoint has no address");
                return;
            }
        };
        // No device on a network can reach an endpoint on loopback: nothing to announce.
        if quic.ip().is_loopback() {
            tracing::info!(listen = %quic, "local discovery not started: listening on loopback only");
            return;
        }
        let setup = discovery::lan::LanSetup {
            device: self.device,
            port: now.port,
            quic,
        };
        let net = Arc::downgrade(&self.net);
        let hook: discovery::lan::Hook = Arc::new(move |a, from| {
            if let Some(net) = net.upgrade() {
                net.heard(a, from);
            }
        });
        match discovery::lan::start(setup, hook, self.net.stopping.subscribe()) {
            Ok(lan) => {
                tracing::info!(port = now.port, "local discovery on");
                *slot = Some(lan);
            }
            Err(e) => {
                tracing::warn!(error = %e, "local discovery not started; peers are dialed at the addresses otherwise known")
            }
        }
    }

    /// Starts/stops dial loops so that every configured peer that is dialed (a fixed address
    /// or `dynamic`) has one.
    fn sync_dialers(self: &Arc<Self>) {
        let config = self.config();
        let Ok(mut dialers) = self.dialers.lock() else {
            return;
        };
        let mut wanted: HashMap<DeviceId, Vec<String>> = HashMap::new();
        for p in &config.peers {
            if p.is_dialed() {
                wanted.insert(p.id, p.addresses.clone());
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
                slot.insert((addr, stop.clone()));
                tokio::spawn(crate::dialer::dial_loop(self.net.clone(), id, stop));
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
        let running: HashSet<FolderId> = self.folders.ids();
        for f in &new.folders {
            if !running.contains(&f.id) {
                self.start_folder(f).await?;
            } else if let Some(rt) = self.folders.get(&f.id) {
                let was = rt.policy().on_demand;
                let (old_under, under) = (rt.demand.under(), f.on_demand_subtrees());
                rt.set_policy(crate::folder::FolderPolicy::new(f, &new));
                rt.demand.set_under(under.clone());
                // Placeholders that are to be local now: all of them, or those the subtrees
                // on demand no longer cover (D77).
                let shrank = was && f.on_demand && !under.is_empty() && under != old_under;
                if was && !f.on_demand || shrank {
                    tokio::spawn(crate::ondemand::pins::make_whole(
                        self.folders.clone(),
                        rt.clone(),
                        self.ondemand_peers(),
                    ));
                }
                if f.on_demand {
                    // A new budget is kept at once.
                    rt.demand.arrived.notify_one();
                }
            }
        }
        let wanted: HashSet<FolderId> = new.folders.iter().map(|f| f.id.clone()).collect();
        for rt in self.folders.retain(|id| wanted.contains(id)) {
            if let Ok(mut r) = self.net.receivers.write() {
                r.remove(&rt.id);
            }
            rt.set_watcher(None);
            // A removed folder's mount would go on serving a replica nothing journals any
            // more, out of reach of `meshfs unmount` (which knows only configured folders).
            unmount_folder(&rt);
            self.snapshots.unmount_all(Some(&rt.id));
        }
        let links = self.net.links();
        for (id, conn) in links {
            let before = old.peer(&id).map(|p| p.folders.clone());
            let after = new.peer(&id).map(|p| p.folders.clone());
            // A folder on demand from now on (or no longer) is said in a new hello (D99).
            let flipped = after.as_ref().is_some_and(|shared| {
                shared.iter().any(|f| {
                    old.folder(f).map(|x| x.on_demand) != new.folder(f).map(|x| x.on_demand)
                })
            });
            if before != after || flipped {
                conn.close(2u32.into(), b"configuration changed");
            }
        }
        let dynamic = self.net.dynamic_peers();
        self.net
            .addresses
            .retain(|d| dynamic.contains(d) || new.peer(d).is_some());
        self.net.seeking.send_if_modified(|s| {
            let changed = *s != dynamic;
            *s = dynamic;
            changed
        });
        self.sync_discovery(Some(&old.discovery));
        self.sync_dialers();
        Ok(())
    }

    /// Stops sessions and the endpoint.
    pub async fn stop(&self) {
        let _ = self.net.stopping.send(true);
        self.unmount_all();
        self.net.shutdown.notify_waiters();
        tokio::time::sleep(Duration::from_millis(50)).await;
        self.net
            .endpoint
            .close(transport::CLOSE_STOPPING, b"daemon stopping");
        if let Ok(d) = self.dialers.lock() {
            for (_, stop) in d.values() {
                stop.notify_one();
            }
        }
        let _ = tokio::time::timeout(Duration::from_secs(2), self.net.endpoint.wait_idle()).await;
    }

    /// What waits in `folder` (every running folder when `None`), path by path: the
    /// `status --pending` document.
    pub fn pending(
        &self,
        folder: Option<&FolderId>,
    ) -> Result<Vec<crate::pending::PendingFolder>, FolderError> {
        let config = self.config();
        let folders = match folder {
            Some(id) => vec![self.folders.running(id)?],
            None => {
                let mut all = self.folders.all();
                all.sort_by(|a, b| a.id.cmp(&b.id));
                all
            }
        };
        let connected: Vec<DeviceId> = self.net.links().into_iter().map(|(d, _)| d).collect();
        folders
            .iter()
            .map(|rt| {
                let sharing: Vec<_> = config.sharing(&rt.id).cloned().collect();
                crate::pending::of_folder(&self.folders, rt, &sharing, &connected)
            })
            .collect()
    }

    /// Updates the per-peer traffic counters from the current links.
    fn observe_traffic(&self) {
        if let (Ok(peers), Ok(mut t)) = (self.net.peers.lock(), self.traffic.lock()) {
            t.observe(&peers);
        }
    }

    /// Ticks each folder's progress with what its peers sent (see [`crate::progress`]).
    fn tick_progress(&self) {
        let config = self.config();
        let Ok(traffic) = self.traffic.lock() else {
            return;
        };
        for rt in self.folders.all() {
            let wire = config.sharing(&rt.id).map(|p| traffic.peer(&p.id).1).sum();
            rt.receiving.tick(wire);
            rt.first_scan.tick(0);
        }
    }

    /// The daemon's state as the `status --json` document: gathers a snapshot, and
    /// [`crate::status::build`] decides what it means.
    pub fn status(&self) -> crate::status::Status {
        // Through a reader, never the engine's writer (which an apply or a scan holds for as
        // long as its disk work takes); the journal first, and not under the peers lock.
        match self.folders.reader() {
            Ok(j) => self.status_with(|folders| journaled(&j, folders)),
            Err(e) => {
                tracing::warn!(error = %e, "status reads through the engine's journal connection");
                self.status_with(|folders| match self.folders.journal_lock() {
                    Ok(j) => journaled(&j, folders),
                    Err(_) => vec![Default::default(); folders.len()],
                })
            }
        }
    }

    /// The same document with the journal's part read through `journal`, another connection
    /// to this daemon's database (the page's): it never waits for the engine's journal lock,
    /// which an install holds for as long as the disk takes (seconds when it is slow).
    pub fn status_reading(&self, journal: &Journal) -> crate::status::Status {
        self.status_with(|folders| journaled(journal, folders))
    }

    fn status_with(
        &self,
        journaled: impl FnOnce(&[Arc<FolderRt>]) -> Vec<Journaled>,
    ) -> crate::status::Status {
        use crate::status::{DeviceSnapshot, FolderSnapshot, LocalWork, PeerSnapshot, Snapshot};
        let config = self.config();
        let folders: Vec<Arc<FolderRt>> = self.folders.all();
        let journaled = journaled(&folders);
        let relaxed = std::sync::atomic::Ordering::Relaxed;
        let folders = folders
            .into_iter()
            .zip(journaled)
            .map(|(rt, (counts, sequence, conflicts, versions, on_demand))| {
                let mount = rt.mount_status();
                FolderSnapshot {
                    id: rt.id.clone(),
                    path: rt.store.root().to_path_buf(),
                    counts,
                    sequence,
                    conflicts,
                    local: LocalWork {
                        capture_pending: rt.capture_pending.load(relaxed),
                        scanning: rt.scanning.load(relaxed),
                        waiting_for_writers: rt.deferred_for(false),
                        waiting_for_content: rt.deferred_for(true),
                        blocked: rt.blocked(),
                        invalidations_pending: mount
                            .as_ref()
                            .map_or(0, |m| m.invalidations_pending),
                    },
                    skipped: rt.skipped(),
                    unreadable: rt.unreadable(),
                    last_error: rt.last_error.get(),
                    progress: crate::status::FolderProgress {
                        scan: rt.first_scan.counts(),
                        receive: rt.receiving.counts(),
                    },
                    mount,
                    versions,
                    on_demand,
                }
            })
            .collect();
        let peers = self.net.peers.lock().ok();
        let traffic = self.traffic.lock().ok().map(|mut t| {
            if let Some(p) = &peers {
                t.observe(p);
            }
            t
        });
        let peer_snapshots = config
            .peers
            .iter()
            .map(|p| PeerSnapshot {
                address: peers.as_ref().and_then(|x| x.link(&p.id)).map(|l| {
                    (
                        discovery::book::canonical(l.conn.remote_address()),
                        l.source,
                    )
                }),
                candidates: self.net.addresses.candidates(&p.id),
                config: p.clone(),
                rtt: peers.as_ref().and_then(|x| x.stats(&p.id)).map(|s| s.rtt),
                last_seen_unix: peers
                    .as_ref()
                    .and_then(|x| x.last_seen.get(&p.id).copied())
                    .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                    .map(|d| d.as_secs()),
                bytes: traffic.as_ref().map_or((0, 0), |t| t.peer(&p.id)),
                last_seen_addr: traffic.as_ref().and_then(|t| t.addr(&p.id)),
                last_error: peers
                    .as_ref()
                    .and_then(|x| x.last_error.get(&p.id).cloned()),
                lane: peers
                    .as_ref()
                    .and_then(|x| x.link(&p.id))
                    .and_then(|_| crate::bulk::figures(&p.id)),
            })
            .collect();
        let sync = peers.as_ref().map(|p| p.sync.clone()).unwrap_or_default();
        let bytes = traffic.as_ref().map_or((0, 0), |t| t.totals());
        let resent = traffic.as_ref().map_or(0, |t| t.resent());
        drop((traffic, peers));
        let uptime_secs = self.started.elapsed().as_secs();
        let lan = self.net.lan.lock().ok().and_then(|l| l.clone());
        let counted = |f: fn(&discovery::lan::LanStats) -> &std::sync::atomic::AtomicU64| {
            lan.as_ref().map_or(0, |l| {
                f(&l.stats).load(std::sync::atomic::Ordering::Relaxed)
            })
        };
        let discovery = crate::status::DiscoveryStatus {
            local: lan.is_some(),
            port: config.discovery.port,
            sent: counted(|s| &s.sent),
            received: counted(|s| &s.received),
            limited: counted(|s| &s.limited),
            refused: counted(|s| &s.refused),
            heard: counted(|s| &s.heard),
            known_addresses: self.net.addresses.len(),
        };
        crate::status::build(Snapshot {
            device: DeviceSnapshot {
                id: self.device,
                name: config.device.name,
                listen: config.device.listen,
                uptime_secs,
                started_unix: crate::folder::now_secs().saturating_sub(uptime_secs),
                discovery,
            },
            folders,
            peers: peer_snapshots,
            sync,
            refused: self.trust.refused().into_iter().map(|(id, _)| id).collect(),
            bytes,
            resent,
        })
    }
}

/// What the journal holds of each folder for `status`: its counts, its highest sequence and
/// its conflicts and past versions, read only (a folder not in the journal yet has none).
fn journaled(j: &Journal, folders: &[Arc<FolderRt>]) -> Vec<Journaled> {
    let sequences: HashMap<FolderId, u64> = j
        .folders()
        .unwrap_or_default()
        .into_iter()
        .map(|(id, state)| (id, state.max_sequence))
        .collect();
    folders
        .iter()
        .map(|rt| {
            (
                j.counts(&rt.id).unwrap_or_default(),
                sequences.get(&rt.id).copied().unwrap_or(0),
                crate::conflicts::count(j, &rt.id),
                crate::versions::status_of(j, rt),
                crate::ondemand::status_of(j, rt),
            )
        })
        .collect()
}

/// A folder's counts, highest sequence, conflicts, past versions and what of it is local (on
/// demand), as `status` reads them.
type Journaled = (
    FolderCounts,
    u64,
    usize,
    crate::status::VersionsStatus,
    Option<crate::status::OnDemandStatus>,
);

/// Shows the traffic counters every link as it comes and goes, so a peer's bytes outlive its
/// connection (the sessions wake `peer_changed` when a link is registered or ends), and ticks
/// the folders' progress about once a second (and drops the small contents their scans kept
/// too long, D113).
async fn traffic_loop(engine: Arc<Engine>) {
    let mut stopping = engine.net.stopping.subscribe();
    let mut last_tick = Instant::now();
    loop {
        let changed = engine.net.peer_changed.notified();
        tokio::pin!(changed);
        // Registered before looking, so a link that comes meanwhile wakes the next round.
        changed.as_mut().enable();
        engine.observe_traffic();
        engine.net.observe_links();
        if last_tick.elapsed() >= Duration::from_secs(1) {
            last_tick = Instant::now();
            engine.tick_progress();
        }
        // Remote versions kept from before a restart wait for their peer's link; nothing
        // else wakes them when no local change comes.
        for rt in engine.folders.all() {
            rt.store.fresh().sweep();
            let capturing = rt
                .capture_pending
                .load(std::sync::atomic::Ordering::Relaxed)
                > 0;
            if rt.deferred_count() > 0 && !capturing {
                engine.apply_deferred(&rt);
            }
        }
        tokio::select! {
            _ = changed => {}
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = stopping.changed() => return,
        }
    }
}

/// Watches this host's network (netlink; polling the interfaces where it is unavailable) and
/// tells the peers when it changes: the addresses that went away, or that routes changed
/// ([`crate::dialer::network_changed`]).
async fn network_loop(engine: Arc<Engine>) {
    let mut stopping = engine.net.stopping.subscribe();
    let mut known = interfaces::local_ips();
    let mut watch = match netlink::Watch::new() {
        Ok(w) => Some(w),
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch this host's network (netlink); its addresses are compared every {} s", netlink::POLL.as_secs());
            None
        }
    };
    loop {
        let routes = match &mut watch {
            Some(w) => tokio::select! {
                c = w.next() => match c {
                    Ok(c) => c.routes,
                    Err(e) => {
                        tracing::warn!(error = %e, "netlink watch failed; comparing addresses every {} s instead", netlink::POLL.as_secs());
                        watch = None;
                        continue;
                    }
                },
                _ = stopping.changed() => return,
            },
            None => tokio::select! {
                _ = tokio::time::sleep(netlink::POLL) => false,
                _ = stopping.changed() => return,
            },
        };
        let now = interfaces::local_ips();
        let gone: std::collections::BTreeSet<std::net::IpAddr> =
            known.difference(&now).copied().collect();
        let addresses_changed = now != known;
        if addresses_changed {
            let added: Vec<_> = now.difference(&known).collect();
            tracing::info!(?gone, ?added, "this host's addresses changed");
        }
        known = now;
        if addresses_changed || routes {
            crate::dialer::network_changed(&engine.net, &gone, addresses_changed);
        }
    }
}

/// Applies the tombstone retention of `[options]` once an hour, and each folder's version and
/// history retention every few minutes (`crate::versions::retention`).
async fn retention_loop(engine: Arc<Engine>) {
    let mut stopping = engine.net.stopping.subscribe();
    tokio::spawn(crate::versions::retention_loop(
        engine.folders.clone(),
        engine.net.stopping.subscribe(),
    ));
    loop {
        let o = engine.options();
        let now_ns = crate::clock::now_ns();
        let day_ns: i64 = 86_400 * 1_000_000_000;
        let folders = engine.folders.ids();
        if let Ok(mut j) = engine.folders.journal_lock() {
            for f in &folders {
                if o.tombstone_retention_days > 0 {
                    let _ =
                        j.prune_tombstones(f, now_ns - o.tombstone_retention_days as i64 * day_ns);
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(crate::clock::real(Duration::from_secs(3600))) => {}
            _ = stopping.changed() => return,
        }
    }
}

/// Coalesces a folder's events and scans what is ready: the wiring of `capture::policy`, which
/// decides; this loop only does the IO it asks for.
async fn capture_loop(
    engine: Arc<Engine>,
    rt: Arc<FolderRt>,
    mut rx: mpsc::UnboundedReceiver<CaptureMsg>,
) {
    use capture::policy::{Policy, Scanned};
    let mut policy = Policy::new(Duration::from_millis(engine.options().coalesce_ms));
    // The queue lives in the folder's runtime so that status can list it; this loop is its
    // only writer and never holds it across an await.
    let queue = || rt.capture_queue();
    let mut stopping = engine.net.stopping.subscribe();
    loop {
        let sleep = async {
            match policy.wake_at() {
                Some(t) => tokio::time::sleep_until(t.into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            msg = rx.recv() => {
                let Some(msg) = msg else { return };
                let mut c = queue();
                let msgs = std::iter::once(msg).chain(std::iter::from_fn(|| rx.try_recv().ok()));
                policy.messages(&mut c, msgs, Instant::now());
                publish_count(&rt, c.len().max(1));
            }
            _ = sleep => {
                let now = Instant::now();
                let dirs = policy.due_looks(now, |d| rt.echoes.made_dir(d));
                if !dirs.is_empty() {
                    let root = rt.store.root().to_path_buf();
                    let files = tokio::task::spawn_blocking(move || capture::files_in(&root, dirs))
                        .await
                        .unwrap_or_default();
                    policy.looked(&mut queue(), files, now);
                }
                let pass = policy.pass(&mut queue(), now, |p| rt.writers.has_writer(p));
                let scopes: Vec<RelPath> = if pass.rescan {
                    Vec::new()
                } else {
                    let mut dirs = crate::store::DirCache::default();
                    pass.paths
                        .into_iter()
                        .filter(|p| {
                            !rt.echoes.is_echo(p, || rt.store.stat_in(&mut dirs, p).ok().flatten())
                        })
                        .collect()
                };
                if pass.rescan || !scopes.is_empty() {
                    let (t0, n) = (Instant::now(), scopes.len());
                    let first = tracing::enabled!(tracing::Level::DEBUG)
                        .then(|| scopes.first().cloned())
                        .flatten();
                    let how = match engine.scan_paths(&rt.id, scopes).await {
                        Ok(changes) => {
                            tracing::debug!(folder = %rt.id, rescan = pass.rescan, scopes = n, first = ?first, changes, ms = t0.elapsed().as_millis() as u64, "captured");
                            if pass.rescan {
                                first_scan_done(&engine, &rt);
                            }
                            Scanned::Done
                        }
                        Err(e) if e.is_disk_full() => {
                            if rt.block(format!("journal disk full: {e}")) {
                                tracing::error!(folder = %rt.id, error = %e, "the journal's disk is full; changes are captured again once there is room");
                            }
                            Scanned::DiskFull
                        }
                        Err(e) => {
                            tracing::warn!(folder = %rt.id, error = %e, "scan failed; rescanning the folder shortly");
                            rt.last_error.set(format_args!("scan failed: {e}"));
                            Scanned::Failed
                        }
                    };
                    let after = policy.scanned(&mut queue(), how, Instant::now());
                    if after.recovered && rt.unblock() {
                        tracing::info!(folder = %rt.id, "the journal's disk has room again; capture resumed");
                    }
                }
                // A writer let go: once its path is captured (nothing of it waits here any
                // more), the remote versions that waited for it are decided again.
                let deferred = rt.deferred_count();
                let (apply, len) = {
                    let c = queue();
                    (policy.apply_deferred_now(&c, deferred), c.len())
                };
                if apply {
                    engine.apply_deferred(&rt);
                }
                publish_count(&rt, len);
            }
            _ = stopping.changed() => return,
        }
    }
}

/// The folder's first scan (or the rescan after it failed) has journaled the whole folder: it
/// is no longer scanning, and the sessions tell their peers (`Session::scan_progress`).
fn first_scan_done(engine: &Engine, rt: &FolderRt) {
    if rt
        .scanning
        .swap(false, std::sync::atomic::Ordering::Relaxed)
    {
        engine.changes_notify(&rt.id);
    }
}

/// Tells status how many paths wait in the capture loop.
fn publish_count(rt: &FolderRt, n: usize) {
    rt.capture_pending
        .store(n, std::sync::atomic::Ordering::Relaxed);
}

/// How long a deferred remote version whose apply failed first waits before it is tried again
/// (doubled at each further failure).
const DEFERRED_RETRY: Duration = Duration::from_secs(2);

/// A local version a remote one conflicts with that could not be fetched this many times is
/// looked for on every device sharing the folder (D103): a holder may have been installing it,
/// or not yet connected, at the first tries.
const LOST_AFTER_TRIES: u32 = 3;

/// How long starting a folder waits for its first scan before going on while it runs.
const FIRST_SCAN_WAIT: Duration = Duration::from_millis(250);

/// Ends `rt`'s mount, if it has one (a busy mount is detached). The slot's lock is let go
/// before the unmount, which waits for the kernel.
fn unmount_folder(rt: &FolderRt) {
    let m = rt.with_mount(Option::take);
    if let Some(m) = m {
        rt.mount_slot.detach();
        let point = m.info().mountpoint;
        match m.unmount() {
            Ok(()) => tracing::info!(folder = %rt.id, mountpoint = %point.display(), "unmounted"),
            Err(e) => tracing::warn!(folder = %rt.id, error = %e, "unmount failed"),
        }
    }
}

/// The live connections of the peers that share `folder` with this device, by device: the one
/// place the configuration's sharing meets the links.
fn links_sharing(
    net: &Net,
    config: &std::sync::RwLock<Config>,
    folder: &FolderId,
) -> Vec<(DeviceId, quinn::Connection)> {
    let config = config.read().unwrap_or_else(|p| p.into_inner());
    net.links()
        .into_iter()
        .filter(|(d, _)| config.peer(d).is_some_and(|p| p.folders.contains(folder)))
        .collect()
}
