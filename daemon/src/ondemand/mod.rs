//! Files on demand, the engine's side (docs/decisions.md, D90–D95): a placeholder's content
//! streamed to the reads of an open ([`open_stream`]) or made local when it is opened for
//! writing or pinned ([`make_local`]), both through one flight per file driven by
//! `apply::drive` (the same steps as a batch), what of it is verified (`crate::assembly`), the mount's [`ContentSource`](meshfs_fuse::ContentSource) ([`MountContent`]),
//! the budget kept as content arrives and evictions ([`budget`]), pins ([`pins`]), and what
//! `status` shows ([`status_of`]).
//!
//! What it never does: decide which versions a folder has (the receive pipeline does, and on
//! an on-demand folder it installs placeholders itself, D91), or serve a byte that was not
//! verified: a placeholder is never read as content.

pub mod budget;
pub mod lost;
pub mod pins;
pub mod source;

pub use source::MountContent;

use crate::apply::{Conns, FillError, Streamed};
use crate::demand::{End, Failure, Flight};
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

/// The flight of the placeholder at `path`, joined or started for the process `pid` (0: a
/// pin): one per path, whoever else opens it shares it. A new one's driver runs on `runtime`.
/// The caller holds the flight until it calls [`Flight::leave`].
fn flight_of(
    folders: &Arc<Folders>,
    rt: &Arc<FolderRt>,
    peers: &Peers,
    path: &RelPath,
    pid: u32,
    runtime: &tokio::runtime::Handle,
) -> Result<Arc<Flight>, Failure> {
    let stored = folders
        .reader()
        .and_then(|r| Ok(r.get(&rt.id, path)?))
        .map_err(|e| failure(libc::EIO, e.to_string()))?;
    let Some(stored) = stored.filter(|s| !s.record.deleted) else {
        return Err(failure(libc::ENOENT, format!("{path}: not in the journal")));
    };
    let (flight, lead) = rt
        .demand
        .begin(path, pid, stored.record.size, stored.record.hash);
    if lead {
        runtime.spawn(run(
            folders.clone(),
            rt.clone(),
            peers.clone(),
            path.clone(),
            flight.clone(),
            stored.source,
        ));
    }
    Ok(flight)
}

/// Drives `flight` to its end (`apply::drive`): the connected peers that share the folder are
/// asked, the version's source first (it had this very version). Content that arrived wakes
/// the budget (D93).
async fn run(
    folders: Arc<Folders>,
    rt: Arc<FolderRt>,
    peers: Peers,
    path: RelPath,
    flight: Arc<Flight>,
    source: Option<DeviceId>,
) {
    let id = rt.id.clone();
    let conns: Conns = Arc::new(move || {
        let mut conns = peers(&id);
        conns.sort_by_key(|(d, _)| Some(*d) != source);
        conns.into_iter().map(|(_, c)| c).collect()
    });
    let started = std::time::Instant::now();
    let (size, pid) = (flight.size, flight.pid.load(Ordering::Relaxed));
    let out = crate::apply::drive(
        folders,
        rt.clone(),
        path.clone(),
        flight.clone(),
        conns,
        failure_of,
    )
    .await;
    let end = match out {
        Ok(Streamed::Local(_)) => {
            rt.demand.fetched_bytes.fetch_add(size, Ordering::Relaxed);
            rt.demand.fetched_files.fetch_add(1, Ordering::Relaxed);
            tracing::info!(folder = %rt.id, %path, size, pid, ms = started.elapsed().as_millis() as u64, "content fetched on demand");
            rt.demand.used(&path, now_ns());
            rt.demand.changed();
            rt.demand.arrived.notify_one();
            End::Local
        }
        Ok(Streamed::Already) => End::Local,
        Ok(Streamed::Abandoned) => {
            tracing::info!(folder = %rt.id, %path, pid, fetched = flight.done.load(Ordering::Relaxed), "every reader left before the file was whole: what was fetched of it is dropped");
            End::Abandoned
        }
        Err(e) => {
            let f = failure_of(&e);
            tracing::warn!(folder = %rt.id, %path, pid, errno = errno_name(f.errno), error = %e, "content could not be fetched on demand");
            End::Failed(f)
        }
    };
    rt.demand
        .end(&path, &flight, end, crate::folder::now_secs());
}

/// Makes the content of the placeholder at `path` local, for the process `pid` (0: a pin):
/// the whole file, through the flight of the path (readers of it share it), installed before
/// this returns.
pub async fn make_local(
    folders: &Arc<Folders>,
    rt: &Arc<FolderRt>,
    peers: &Peers,
    path: &RelPath,
    pid: u32,
) -> Result<(), Failure> {
    let runtime = tokio::runtime::Handle::current();
    let flight = flight_of(folders, rt, peers, path, pid, &runtime)?;
    tokio::task::spawn_blocking(move || {
        let out = flight.whole();
        flight.leave();
        out
    })
    .await
    .unwrap_or_else(|e| Err(failure(libc::EIO, e.to_string())))
}

/// One open's hold on a flight, released when dropped: the mount's stream of a placeholder
/// being assembled (D95).
#[derive(Debug)]
pub struct Reader {
    flight: Arc<Flight>,
    file: Arc<std::os::fd::OwnedFd>,
}

impl Drop for Reader {
    fn drop(&mut self) {
        self.flight.leave();
    }
}

impl meshfs_fuse::ContentStream for Reader {
    fn file(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.file.as_fd()
    }

    fn size(&self) -> u64 {
        self.flight.size
    }

    fn ready(&self, offset: u64, len: u64) -> Result<(), i32> {
        self.flight.ready(offset, len, false).map_err(|f| f.errno)
    }
}

/// Opens the placeholder at `path` for reading by `pid`, blocking (a FUSE request thread):
/// its flight joined or started, its first chunk verified; `None` when the file turned out to
/// be local (it is opened by name).
pub fn open_stream(
    folders: &Arc<Folders>,
    rt: &Arc<FolderRt>,
    peers: &Peers,
    path: &RelPath,
    pid: u32,
    runtime: &tokio::runtime::Handle,
) -> Result<Option<Reader>, Failure> {
    let flight = flight_of(folders, rt, peers, path, pid, runtime)?;
    let file = match flight.wait_started() {
        Ok(Some(file)) => file,
        other => {
            flight.leave();
            return other.map(|_| None);
        }
    };
    // Held from here: dropped (an error below, or the open's release), it leaves the flight.
    let reader = Reader { flight, file };
    // The open answers once the first chunk is here (or cannot be: offline, the open fails
    // as before, D92).
    reader.flight.ready(0, 1, true)?;
    Ok(Some(reader))
}

fn failure(errno: i32, why: String) -> Failure {
    Failure { errno, why }
}

/// What a reader waiting for `e` is told.
fn failure_of(e: &FillError) -> Failure {
    failure(errno_of(e), e.to_string())
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
    let space = crate::store::space(rt.store.root());
    Some(OnDemandStatus {
        min_free_bytes: space.map_or(0, |(_, total)| policy.min_free.bytes(total)),
        min_free: policy.min_free.text(),
        disk_free_bytes: space.map(|(free, _)| free),
        cache_max: policy.cache_max,
        local_files,
        local_bytes,
        online_files,
        online_bytes,
        over_budget: policy
            .cache_max
            .map_or(0, |max| local_bytes.saturating_sub(max)),
        under: rt
            .demand
            .under()
            .iter()
            .map(|p| p.as_str().to_string())
            .collect(),
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
