//! An on-demand folder's budget, kept as content arrives, and evictions (docs/decisions.md,
//! D93, D97): beyond `cache_max`, or while its disk has less free than `min_free`, local files leave in least recently used order, each replaced by
//! a placeholder through the store's checks; never a pinned file, an open one, or content no
//! connected peer is known to hold (a last copy, or a local change not acknowledged yet).

use crate::folder::{FolderError, FolderRt, Folders};
use crate::journal::Resident;
use crate::store::StoreError;
use meshfs_protocol::{DeviceId, FolderId, RelPath};
use serde::Serialize;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// How often the budget is checked when no content arrived (what a peer's install or a local
/// write added meanwhile), and stale placeholder rows are dropped.
pub const BUDGET_TICK: Duration = Duration::from_secs(30);
/// How soon the budget is checked again when it was kept over only by files open or being
/// fetched (the file whose fetch woke the check is still open by its reader).
pub const BUSY_RETRY: Duration = Duration::from_secs(1);

/// Why a file open through the mount is kept.
const OPEN: &str = "open through the mount";
/// Why a file being fetched is kept.
const FETCHING: &str = "being fetched";
/// Why a file outside the subtrees on demand is kept (D77).
const OUTSIDE: &str = "outside the folder's on-demand subtrees (`on_demand_under`)";

/// The connected peers that share a folder now and hold all of it (not on demand there), with
/// their links.
pub type Connected = Arc<dyn Fn(&FolderId) -> Vec<Holder> + Send + Sync>;

/// A connected peer that may hold what this device evicts.
pub type Holder = (DeviceId, quinn::Connection);

/// Why a file no connected peer said it holds is kept.
const UNCONFIRMED: &str =
    "no connected peer says it holds its content (acknowledging a version is not holding it)";

/// What an eviction did.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct EvictReport {
    /// The files evicted (placeholders now).
    pub evicted: Vec<String>,
    /// Their bytes.
    pub freed_bytes: u64,
    /// Local files that were not evicted, and why.
    pub kept: Vec<KeptFile>,
    /// The folder's local bytes after it.
    pub local_bytes: u64,
    /// Its budget.
    pub cache_max: Option<u64>,
}

/// A local file that eviction kept.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct KeptFile {
    /// The path.
    pub path: String,
    /// Why, in words.
    pub why: String,
}

/// Why `res` must stay local, if it must: pinned, outside the subtrees on demand, open,
/// being fetched, or held by no connected peer (`acked`: what each connected peer
/// acknowledged of this device's index). A peer that passes this is then asked whether it
/// holds the content ([`confirmed`]).
fn keeps(res: &Resident, rt: &FolderRt, acked: &HashMap<DeviceId, u64>) -> Option<&'static str> {
    if rt.demand.pinned(&res.path) {
        return Some("pinned (`meshfs unpin` lets it go)");
    }
    if rt.demand.outside(&res.path) {
        return Some(OUTSIDE);
    }
    if rt.writers.holds_inode(res.local.inode) {
        return Some(OPEN);
    }
    if rt.demand.fetching(&res.path) {
        return Some(FETCHING);
    }
    let held = acked
        .iter()
        .any(|(peer, ack)| res.source == Some(*peer) || *ack >= res.sequence);
    if held {
        return None;
    }
    Some(match res.source {
        None => "a change made here that no connected peer has acknowledged yet",
        Some(_) => "a last copy: no connected peer is known to hold it",
    })
}

/// Evicts `candidates` in order while `more(freed)` says so, by the rules of [`keeps`] and
/// only once a connected peer said it holds the content ([`confirmed`], D101). Runs on a
/// blocking thread of the runtime (the probes are awaited there).
fn evict_files(
    folders: &Folders,
    rt: &FolderRt,
    candidates: Vec<Resident>,
    connected: &[Holder],
    more: impl Fn(u64) -> bool,
) -> Result<EvictReport, FolderError> {
    let acked: HashMap<DeviceId, u64> = {
        let reader = folders.reader()?;
        connected
            .iter()
            .map(|(p, _)| Ok((*p, reader.peer_progress(&rt.id, p)?.our_acked)))
            .collect::<Result<_, crate::journal::JournalError>>()?
    };
    let mut report = EvictReport::default();
    let mut candidates = candidates.into_iter().peekable();
    while candidates.peek().is_some() && more(report.freed_bytes) {
        // The next files that may go, as many as one probe asks about.
        let mut group: Vec<(Resident, Vec<meshfs_protocol::Hash>)> = Vec::new();
        let mut hashes = 0;
        while hashes < meshfs_protocol::MAX_HASHES_PER_PROBE {
            let Some(res) = candidates.next() else {
                break;
            };
            if let Some(why) = keeps(&res, rt, &acked) {
                report.kept.push(kept(&res, why.to_string()));
                continue;
            }
            let chunks = chunks_of(folders, rt, &res)?;
            hashes += chunks.len();
            group.push((res, chunks));
        }
        let held = confirmed(rt, connected, &acked, &group);
        for ((res, _), held) in group.into_iter().zip(held) {
            if !more(report.freed_bytes) {
                break;
            }
            if !held {
                report.kept.push(kept(&res, UNCONFIRMED.to_string()));
                continue;
            }
            match evict_one(folders, rt, &res) {
                Ok(()) => {
                    report.freed_bytes += res.size;
                    report.evicted.push(res.path.as_str().to_string());
                }
                Err(why) => report.kept.push(kept(&res, why)),
            }
        }
    }
    let r = folders.reader()?.residency(&rt.id)?;
    report.local_bytes = r.local_bytes;
    report.cache_max = rt.policy().cache_max;
    Ok(report)
}

fn kept(res: &Resident, why: String) -> KeptFile {
    KeptFile {
        path: res.path.as_str().to_string(),
        why,
    }
}

/// The chunk hashes of the version `res` holds (none if the journal moved on: `evict_one`
/// finds that out under the lock).
fn chunks_of(
    folders: &Folders,
    rt: &FolderRt,
    res: &Resident,
) -> Result<Vec<meshfs_protocol::Hash>, FolderError> {
    let stored = folders.reader()?.get(&rt.id, &res.path)?;
    Ok(stored
        .filter(|s| s.record.sequence == res.sequence)
        .map(|s| s.record.chunks.iter().map(|c| c.hash).collect())
        .unwrap_or_default())
}

/// For each file of `group` (with its chunk hashes), whether a connected peer that passes
/// [`keeps`] for it says it holds every one of its chunks (a `Probe`, D101): an acknowledgement
/// says the peer journaled the version, not that it has the content (it may have deferred it
/// for a writer, skipped it, or replaced it since). Asked peer by peer, each about the files
/// not confirmed yet; a peer that cannot be asked confirms nothing.
fn confirmed(
    rt: &FolderRt,
    connected: &[Holder],
    acked: &HashMap<DeviceId, u64>,
    group: &[(Resident, Vec<meshfs_protocol::Hash>)],
) -> Vec<bool> {
    let mut held: Vec<bool> = group.iter().map(|(_, c)| c.is_empty()).collect();
    let runtime = tokio::runtime::Handle::current();
    for (peer, conn) in connected {
        let ack = acked.get(peer).copied().unwrap_or(0);
        let ask: Vec<usize> = (0..group.len())
            .filter(|&i| {
                let res = &group[i].0;
                !held[i] && (res.source == Some(*peer) || ack >= res.sequence)
            })
            .collect();
        if ask.is_empty() {
            continue;
        }
        let mut wanted: Vec<meshfs_protocol::Hash> = ask
            .iter()
            .flat_map(|&i| group[i].1.iter().copied())
            .collect();
        wanted.sort_unstable();
        wanted.dedup();
        let mut has = std::collections::HashSet::new();
        for part in wanted.chunks(meshfs_protocol::MAX_HASHES_PER_PROBE) {
            let asked = runtime.block_on(crate::chunks::probe(conn, &rt.id, part.to_vec()));
            match asked {
                Ok(flags) => {
                    has.extend(part.iter().zip(flags).filter(|(_, f)| *f).map(|(h, _)| *h))
                }
                Err(e) => {
                    tracing::debug!(folder = %rt.id, peer = %peer.short(), error = %e, "a peer could not be asked what it holds");
                    break;
                }
            }
        }
        for i in ask {
            held[i] = group[i].1.iter().all(|h| has.contains(h));
        }
    }
    held
}

/// Replaces the local file `res` by a placeholder, under the folder's lock, if the journal and
/// the disk still hold what `res` says and nobody opened it meanwhile. Why not, otherwise.
fn evict_one(folders: &Folders, rt: &FolderRt, res: &Resident) -> Result<(), String> {
    let _guard = rt
        .op_lock
        .lock()
        .map_err(|_| "the folder's lock is poisoned".to_string())?;
    let now = folders
        .journal()
        .and_then(|j| Ok(j.get(&rt.id, &res.path)?))
        .map_err(|e| e.to_string())?;
    let Some(now) = now.filter(|s| s.record.sequence == res.sequence && s.local == Some(res.local))
    else {
        return Err("changed since it was weighed".into());
    };
    if rt.writers.holds_inode(res.local.inode) {
        return Err(OPEN.into());
    }
    match rt.store.evict(&now.record, res.local) {
        Ok(local) => {
            rt.echoes.expect(res.path.clone(), Some(local));
            rt.invalidator.invalidate(&res.path);
            folders
                .journal()
                .and_then(|mut j| Ok(j.made_absent(&rt.id, &res.path, local)?))
                .map_err(|e| e.to_string())?;
            rt.demand.evicted_files.fetch_add(1, Ordering::Relaxed);
            rt.demand.changed();
            tracing::info!(folder = %rt.id, path = %res.path, size = res.size, "evicted: its content stays with the peers, a placeholder here");
            Ok(())
        }
        Err(StoreError::Busy(_)) => Err("open for writing by another program".into()),
        Err(StoreError::Changed(_)) => Err("changed on disk since it was scanned".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// The folder's local files, least recently used first (their last use since the daemon
/// started, else when their version was journaled).
fn by_last_use(rt: &FolderRt, mut files: Vec<Resident>) -> Vec<Resident> {
    files.sort_by_key(|r| {
        (
            rt.demand.last_used(&r.path).unwrap_or(r.changed_ns),
            r.path.clone(),
        )
    });
    files
}

/// How long an evicted file's bytes may still take the disk (the store keeps the old file
/// aside for its grace, `store::GRACE`, before it drops it): the free floor counts them as
/// freed meanwhile, and is looked at again once they are gone.
const FREEING: Duration = Duration::from_secs(6);

/// Evicts least recently used files of `rt` until it is under its budget and its disk has its
/// free floor (D97); nothing when the folder is not on demand.
pub fn keep_budget(
    folders: &Folders,
    rt: &FolderRt,
    connected: &[Holder],
) -> Result<EvictReport, FolderError> {
    let policy = rt.policy();
    if !policy.on_demand {
        return Ok(EvictReport::default());
    }
    let (short, _) = floor_short(rt, &policy);
    let (local, files) = {
        let reader = folders.reader()?;
        let local = reader.residency(&rt.id)?.local_bytes;
        let over = policy.cache_max.map_or(0, |max| local.saturating_sub(max));
        if over == 0 && short == 0 {
            return Ok(EvictReport {
                local_bytes: local,
                cache_max: policy.cache_max,
                ..Default::default()
            });
        }
        // What lies outside the subtrees on demand is never evicted: not even weighed.
        let mut files = reader.residents(&rt.id)?;
        files.retain(|r| !rt.demand.outside(&r.path));
        (local, files)
    };
    let over = policy.cache_max.map_or(0, |max| local.saturating_sub(max));
    let need = over.max(short);
    if short > over {
        tracing::info!(folder = %rt.id, short, floor = %policy.min_free.text(), "the disk is under the folder's free floor: evicting");
    }
    let report = evict_files(folders, rt, by_last_use(rt, files), connected, |freed| {
        freed < need
    })?;
    rt.demand.freed(Instant::now(), report.freed_bytes);
    Ok(report)
}

/// How many bytes the disk holding `rt` lacks of its free floor (0: none, or it cannot be
/// read), counting what was evicted within [`FREEING`] as free already; and whether it lacks
/// some without counting those (then it is looked at again once they are gone).
pub fn floor_short(rt: &FolderRt, policy: &crate::folder::FolderPolicy) -> (u64, bool) {
    let Some((free, total)) = crate::store::space(rt.store.root()) else {
        return (0, false);
    };
    let raw = policy.min_free.bytes(total).saturating_sub(free);
    let freeing = rt.demand.freeing(Instant::now(), FREEING);
    (raw.saturating_sub(freeing), raw > 0 && freeing > 0)
}

/// `meshfs evict FOLDER PATH`: evicts what is local at or below `scope` now, by the same rules.
pub fn evict(
    folders: &Folders,
    rt: &FolderRt,
    scope: &RelPath,
    connected: &[Holder],
) -> Result<EvictReport, FolderError> {
    let files: Vec<Resident> = folders
        .reader()?
        .residents(&rt.id)?
        .into_iter()
        .filter(|r| r.path.is_within(scope))
        .collect();
    evict_files(folders, rt, by_last_use(rt, files), connected, |_| true)
}

/// Keeps `folder` under its budget while it runs: at once when content arrived
/// (`Demand::arrived`), and every [`BUDGET_TICK`]; stale placeholder rows are dropped at each
/// tick. The files' last uses are read from the journal at the start and written to it at each
/// round, so the eviction order survives a restart. Ends when the folder stops.
pub async fn run(folders: Weak<Folders>, folder: FolderId, connected: Connected) {
    let mut pruned = Instant::now() - BUDGET_TICK;
    let mut wait = BUDGET_TICK;
    if let Some(f) = folders.upgrade() {
        let folder = folder.clone();
        let _ = tokio::task::spawn_blocking(move || {
            let rt = f.get(&folder)?;
            match f.reader().and_then(|r| Ok(r.used(&folder)?)) {
                Ok(uses) => rt.demand.load_used(uses),
                Err(e) => {
                    tracing::warn!(%folder, error = %e, "cannot read when files were last used")
                }
            }
            Some(())
        })
        .await;
    }
    loop {
        let Some(rt) = folders.upgrade().and_then(|f| f.get(&folder)) else {
            return;
        };
        let _ = tokio::time::timeout(wait, rt.demand.arrived.notified()).await;
        wait = BUDGET_TICK;
        drop(rt);
        let Some(f) = folders.upgrade() else {
            return;
        };
        let Some(rt) = f.get(&folder) else {
            return;
        };
        if !rt.policy().on_demand {
            continue;
        }
        let prune = pruned.elapsed() >= BUDGET_TICK;
        if prune {
            pruned = Instant::now();
        }
        let ids = connected(&folder);
        let rt_after = rt.clone();
        let done = tokio::task::spawn_blocking(move || {
            let uses = rt.demand.take_unsaved();
            if prune || !uses.is_empty() {
                let mut j = f.journal()?;
                j.save_used(&rt.id, &uses)?;
                if prune {
                    j.prune_absent(&rt.id)?;
                }
            }
            keep_budget(&f, &rt, &ids)
        })
        .await;
        if let Ok(Ok(r)) = &done {
            let busy = r.kept.iter().any(|k| k.why == OPEN || k.why == FETCHING);
            let (short, freeing) = floor_short(&rt_after, &rt_after.policy());
            if freeing || busy && (short > 0 || r.cache_max.is_some_and(|max| r.local_bytes > max))
            {
                wait = BUSY_RETRY;
            }
        }
        match done {
            Ok(Ok(r)) if !r.evicted.is_empty() || !r.kept.is_empty() => {
                tracing::info!(%folder, evicted = r.evicted.len(), freed = r.freed_bytes, kept = r.kept.len(),
                    local = r.local_bytes, max = ?r.cache_max, "budget kept");
            }
            Ok(Ok(_)) => {}
            Ok(Err(e)) => tracing::warn!(%folder, error = %e, "keeping the folder's budget failed"),
            Err(e) => tracing::warn!(%folder, error = %e, "keeping the folder's budget failed"),
        }
    }
}
