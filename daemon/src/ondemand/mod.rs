//! Files on demand, the engine's side (docs/decisions.md, D90–D94): making a placeholder's
//! content local when it is opened or pinned ([`make_local`], through the same fill as a batch:
//! `apply::fill`), the mount's [`ContentSource`](meshfs_fuse::ContentSource) ([`MountContent`]),
//! the budget kept as content arrives and evictions ([`budget`]), pins ([`pins`]), and what
//! `status` shows ([`status_of`]).
//!
//! What it never does: decide which versions a folder has (the receive pipeline does, and on
//! an on-demand folder it installs placeholders itself, D91), or serve a byte that was not
//! verified: a placeholder is never read as content.

pub mod budget;
pub mod pins;
pub mod source;

pub use source::MountContent;

use crate::apply::{FillError, Filled};
use crate::demand::{Failure, Turn};
use crate::folder::{FolderRt, Folders};
use crate::status::{FetchingStatus, OnDemandStatus, UnavailableStatus};
use meshfs_protocol::{DeviceId, FolderId, RelPath};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// How long `status` shows the residency it read, unless something local changed meanwhile
/// (a local write the scanner journals is seen that much later).
const RESIDENCY_FRESH: std::time::Duration = std::time::Duration::from_secs(1);

/// The connected peers that share a folder now, with their ids (asked at each use).
pub type Peers = Arc<dyn Fn(&FolderId) -> Vec<(DeviceId, quinn::Connection)> + Send + Sync>;

/// Nanoseconds since the Unix epoch.
pub(crate) fn now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// Makes the content of the placeholder at `path` local, for the process `pid` (0: a pin):
/// one fetch per path (a second caller waits for the first), from the connected peers that share
/// the folder, the version's source first. Content that arrived wakes the budget (D93).
pub async fn make_local(
    folders: &Arc<Folders>,
    rt: &Arc<FolderRt>,
    peers: &Peers,
    path: &RelPath,
    pid: u32,
) -> Result<(), Failure> {
    let stored = folders
        .reader()
        .and_then(|r| Ok(r.get(&rt.id, path)?))
        .map_err(|e| failure(libc::EIO, e.to_string()))?;
    let Some(stored) = stored.filter(|s| !s.record.deleted) else {
        return Err(failure(libc::ENOENT, format!("{path}: not in the journal")));
    };
    let size = stored.record.size;
    let flight = match rt.demand.begin(path, pid, size) {
        Turn::Follow(f) => {
            return tokio::task::spawn_blocking(move || f.wait())
                .await
                .unwrap_or_else(|e| Err(failure(libc::EIO, e.to_string())));
        }
        Turn::Lead(f) => f,
    };
    let mut conns = peers(&rt.id);
    // The version's source first: it had this very version.
    conns.sort_by_key(|(d, _)| Some(*d) != stored.source);
    let conns: Vec<quinn::Connection> = conns.into_iter().map(|(_, c)| c).collect();
    let mut asked: Vec<usize> = conns.iter().map(|c| c.stable_id()).collect();
    let started = std::time::Instant::now();
    let mut filled = crate::apply::fill(
        folders.clone(),
        rt.clone(),
        path.clone(),
        conns,
        flight.done.clone(),
    )
    .await;
    // The peers' links may have changed meanwhile: a peer that came back dials while it is
    // dialed, and the connection of the two that loses is closed, maybe under this fetch.
    // The links that came up since are asked once more before the open fails.
    while matches!(
        filled,
        Err(FillError::NoPeer | FillError::NotHeld { bad: false, .. })
    ) {
        let fresh: Vec<quinn::Connection> = peers(&rt.id)
            .into_iter()
            .map(|(_, c)| c)
            .filter(|c| !asked.contains(&c.stable_id()))
            .collect();
        if fresh.is_empty() {
            break;
        }
        asked.extend(fresh.iter().map(|c| c.stable_id()));
        tracing::info!(folder = %rt.id, %path, links = fresh.len(), "asking the links that came up during the fetch");
        filled = crate::apply::fill(
            folders.clone(),
            rt.clone(),
            path.clone(),
            fresh,
            flight.done.clone(),
        )
        .await;
    }
    let outcome = match filled {
        Ok(Filled::Local(_)) => {
            rt.demand.fetched_bytes.fetch_add(size, Ordering::Relaxed);
            rt.demand.fetched_files.fetch_add(1, Ordering::Relaxed);
            tracing::info!(folder = %rt.id, %path, size, pid, ms = started.elapsed().as_millis() as u64, "content fetched on demand");
            Ok(())
        }
        Ok(Filled::Already) => Ok(()),
        Err(e) => {
            let f = failure(errno_of(&e), e.to_string());
            tracing::warn!(folder = %rt.id, %path, pid, errno = errno_name(f.errno), error = %e, "content could not be fetched on demand");
            Err(f)
        }
    };
    if outcome.is_ok() {
        rt.demand.used(path, now_ns());
        rt.demand.changed();
        rt.demand.arrived.notify_one();
    }
    rt.demand
        .end(path, outcome.clone(), crate::folder::now_secs());
    outcome
}

fn failure(errno: i32, why: String) -> Failure {
    Failure { errno, why }
}

/// The errno an open fails with for `e` (D92).
fn errno_of(e: &FillError) -> i32 {
    match e {
        FillError::NoPeer => libc::EHOSTUNREACH,
        FillError::NotHeld { bad: false, .. } => libc::EHOSTUNREACH,
        FillError::NotHeld { bad: true, .. } => libc::EIO,
        // The kernel looks the name up again and retries the open once.
        FillError::Changed(_) => libc::ESTALE,
        FillError::Gone(_) => libc::ENOENT,
        FillError::Busy(_) => libc::EBUSY,
        FillError::Apply(a) if a.is_disk_full() => libc::ENOSPC,
        FillError::Apply(_) => libc::EIO,
    }
}

/// The name of an errno this module answers with.
pub fn errno_name(errno: i32) -> &'static str {
    match errno {
        libc::EHOSTUNREACH => "EHOSTUNREACH",
        libc::EIO => "EIO",
        libc::ESTALE => "ESTALE",
        libc::ENOENT => "ENOENT",
        libc::EBUSY => "EBUSY",
        libc::ENOSPC => "ENOSPC",
        _ => "EIO",
    }
}

/// What `status` shows of `rt` when it is on demand (`None` otherwise), read through
/// `journal`.
pub fn status_of(journal: &crate::journal::Journal, rt: &FolderRt) -> Option<OnDemandStatus> {
    let policy = rt.policy();
    if !policy.on_demand {
        return None;
    }
    let [local_files, local_bytes, online_files, online_bytes] =
        rt.demand
            .residency(std::time::Instant::now(), RESIDENCY_FRESH, || {
                let r = journal.residency(&rt.id).unwrap_or_default();
                [r.local_files, r.local_bytes, r.online_files, r.online_bytes]
            });
    let (unavailable, unlisted) = rt.demand.unavailable();
    Some(OnDemandStatus {
        cache_max: policy.cache_max,
        local_files,
        local_bytes,
        online_files,
        online_bytes,
        over_budget: policy
            .cache_max
            .map_or(0, |max| local_bytes.saturating_sub(max)),
        pins: rt
            .demand
            .pins()
            .iter()
            .map(|p| p.as_str().to_string())
            .collect(),
        fetching: rt
            .demand
            .flights()
            .into_iter()
            .map(|(path, pid, size, done)| FetchingStatus {
                path: path.as_str().to_string(),
                pid,
                size,
                done: done.min(size),
            })
            .collect(),
        unavailable: unavailable
            .into_iter()
            .map(|(path, u)| UnavailableStatus {
                path: path.as_str().to_string(),
                error: u.failure.why,
                errno: errno_name(u.failure.errno),
                at_unix: u.at_unix,
            })
            .collect(),
        unavailable_unlisted: unlisted,
        fetched_files: rt.demand.fetched_files.load(Ordering::Relaxed),
        fetched_bytes: rt.demand.fetched_bytes.load(Ordering::Relaxed),
        evicted_files: rt.demand.evicted_files.load(Ordering::Relaxed),
    })
}
