//! A placeholder's content made local (docs/decisions.md, D92): the version the journal holds
//! at the path, built exactly as a batch builds a transfer — chunks this device has copied by
//! the chunk index, the rest fetched from a peer with [`chunks::fetch`], every chunk verified
//! by blake3 and its length, the temp file covered exactly and made durable — and installed
//! over the placeholder under the folder's lock, if the placeholder is still what the journal
//! knows. The record keeps its version; it gets the new file's stat, and its placeholder row
//! goes (`Journal::made_local`).
//!
//! What it never does: change a version, or install over anything but the placeholder of the
//! very record it built.

use super::assemble::{assemble, discard_all, finish_all, Assembled, TempWriter};
use super::on_blocking;
use super::transfer::{prepare, ApplyError, Meta, Sources, Transfer};
use crate::chunks::{self, FetchError};
use crate::folder::{FolderError, FolderRt, Folders};
use crate::journal::Op;
use crate::store::{DirCache, Expect, LocalStat, StoreError, TempFile};
use meshfs_protocol::{FileKind, FileRecord, Hash, RelPath};
use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a peer's connection may carry nothing while a fetch waits on it before the fetch
/// gives that peer up (a peer killed without closing its connection looks connected until the
/// transport's idle timeout).
pub const STALL: Duration = Duration::from_secs(3);

/// What [`fill`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Filled {
    /// The content is local now, in this file.
    Local(LocalStat),
    /// It was local already (another fetch, or a peer's version installed meanwhile).
    Already,
}

/// Why a placeholder's content could not be made local.
#[derive(Debug, thiserror::Error)]
pub enum FillError {
    /// No connected peer shares the folder, and this device lacks some of the chunks.
    #[error("no connected peer shares the folder, and the content is not on this device")]
    NoPeer,
    /// The connected peers were asked and none gave the whole content (they lack it, their
    /// connection broke or carried nothing for [`STALL`]).
    #[error("no connected peer could give the content: {why}")]
    NotHeld {
        /// What each peer did.
        why: String,
        /// One of them sent a chunk that failed its verification.
        bad: bool,
    },
    /// The path no longer holds the placeholder the journal knows (a newer version, a local
    /// change, a deletion).
    #[error("{0}: changed while its content was fetched")]
    Changed(RelPath),
    /// The path holds no live file.
    #[error("{0}: no such file in the journal")]
    Gone(RelPath),
    /// Another program has the placeholder open for writing.
    #[error("{0}: open for writing by another program")]
    Busy(RelPath),
    /// The disk, the journal or a peer failed otherwise.
    #[error(transparent)]
    Apply(#[from] ApplyError),
}

impl From<FolderError> for FillError {
    fn from(e: FolderError) -> Self {
        FillError::Apply(e.into())
    }
}

impl From<crate::journal::JournalError> for FillError {
    fn from(e: crate::journal::JournalError) -> Self {
        FillError::Apply(e.into())
    }
}

/// Makes the content of the placeholder at `path` local, asking `peers` in turn (those first in
/// the list first) for the chunks this device lacks. `progress` counts the bytes written.
pub async fn fill(
    folders: Arc<Folders>,
    rt: Arc<FolderRt>,
    path: RelPath,
    peers: Vec<quinn::Connection>,
    progress: Arc<AtomicU64>,
) -> Result<Filled, FillError> {
    let mut peers = peers.into_iter();
    let mut conn = peers.next();
    let mut failures: Vec<String> = Vec::new();
    let mut bad = false;
    loop {
        match attempt(&folders, &rt, &path, conn.as_ref(), &progress).await {
            Err(Attempt::Peer(why, corrupt)) => {
                if let Some(c) = &conn {
                    tracing::info!(folder = %rt.id, %path, peer = %c.remote_address(), %why, "a peer could not give a file's content; asking the next");
                }
                failures.push(why);
                bad |= corrupt;
                conn = peers.next();
                if conn.is_none() {
                    return Err(FillError::NotHeld {
                        why: failures.join("; "),
                        bad,
                    });
                }
            }
            Err(Attempt::Fail(e)) => return Err(e),
            Ok(f) => return Ok(f),
        }
    }
}

/// How one attempt ended badly: the peer (the next one may do; `true`: it sent a chunk that
/// failed its verification), or for good.
enum Attempt {
    Peer(String, bool),
    Fail(FillError),
}

impl<E: Into<FillError>> From<E> for Attempt {
    fn from(e: E) -> Self {
        Attempt::Fail(e.into())
    }
}

/// What the journal holds at the path when an attempt starts.
struct Seen {
    record: FileRecord,
    local: LocalStat,
}

async fn attempt(
    folders: &Arc<Folders>,
    rt: &Arc<FolderRt>,
    path: &RelPath,
    conn: Option<&quinn::Connection>,
    progress: &Arc<AtomicU64>,
) -> Result<Filled, Attempt> {
    let (f, r, p) = (folders.clone(), rt.clone(), path.clone());
    let Some((seen, transfer, sources, dirs)) =
        on_blocking(move || Ok(start(&f, &r, &p))).await??
    else {
        return Ok(Filled::Already);
    };
    let r = rt.clone();
    let Assembled {
        temps,
        metas,
        missing,
        wanted,
        dirs: _,
        skipped,
    } = on_blocking(move || assemble(&r, dirs, vec![transfer], &sources, HashMap::new())).await?;
    if !skipped.is_empty() {
        discard_all(rt, temps.into_iter().flatten());
        return Err(Attempt::Fail(FillError::Apply(ApplyError::Task(format!(
            "{path}: no temp file could be made for it"
        )))));
    }
    let temps = if wanted.is_empty() {
        temps
    } else {
        let Some(conn) = conn else {
            discard_all(rt, temps.into_iter().flatten());
            return Err(Attempt::Fail(FillError::NoPeer));
        };
        let writer = TempWriter {
            rt: rt.clone(),
            missing,
            temps,
            progress: Some(progress.clone()),
        };
        let lens: HashMap<Hash, u32> = wanted.iter().copied().collect();
        // Dropped when the peer stalls: its writer stops at its next chunk and the temp file,
        // unnamed, goes with it.
        let Some((got, back)) = watched(conn, chunks::fetch(conn, &rt.id, wanted, writer)).await
        else {
            return Err(Attempt::Peer(
                format!("its connection carried nothing for {} s", STALL.as_secs()),
                false,
            ));
        };
        match got {
            Ok(absent) if absent.is_empty() => back.temps,
            Ok(absent) => {
                discard_all(rt, back.temps.into_iter().flatten());
                let bytes: u64 = absent
                    .iter()
                    .filter_map(|h| lens.get(h))
                    .map(|&l| l as u64)
                    .sum();
                return Err(Attempt::Peer(
                    format!(
                        "it does not have {} of the chunks ({bytes} bytes)",
                        absent.len()
                    ),
                    false,
                ));
            }
            Err(FetchError::Store(e)) => {
                discard_all(rt, back.temps.into_iter().flatten());
                return Err(Attempt::Fail(ApplyError::from(e).into()));
            }
            Err(e) => {
                discard_all(rt, back.temps.into_iter().flatten());
                let corrupt = matches!(e, FetchError::Protocol(_));
                return Err(Attempt::Peer(e.to_string(), corrupt));
            }
        }
    };
    let r = rt.clone();
    let mut ready = on_blocking(move || finish_all(&r, metas, temps)).await?;
    let Some((_, _, temp)) = ready.pop() else {
        return Err(Attempt::Fail(FillError::Changed(path.clone())));
    };
    let (f, r, p) = (folders.clone(), rt.clone(), path.clone());
    let local = on_blocking(move || Ok(install(&f, &r, &p, seen, temp))).await??;
    Ok(Filled::Local(local))
}

/// What the journal and the disk say at `path`, and the transfer of its content: `None` when
/// the content is local already.
#[allow(clippy::type_complexity)]
fn start(
    folders: &Folders,
    rt: &FolderRt,
    path: &RelPath,
) -> Result<Option<(Seen, Transfer, Sources, DirCache)>, FillError> {
    let reader = folders.reader()?;
    let stored = reader
        .get(&rt.id, path)?
        .filter(|s| !s.record.deleted && s.record.kind == FileKind::File)
        .ok_or_else(|| FillError::Gone(path.clone()))?;
    let mut dirs = DirCache::default();
    match rt.store.placeholder_at(&mut dirs, path) {
        None => return Ok(None),
        Some(h) if h != stored.record.hash => return Err(FillError::Changed(path.clone())),
        Some(_) => {}
    }
    let local = stored
        .local
        .ok_or_else(|| FillError::Changed(path.clone()))?;
    let record = stored.record;
    let meta = Meta {
        record: record.clone(),
        op: Op::Modify,
        source: None,
        expect: Expect::Matches(local),
        basis: Some(record.version.clone()),
        detail: None,
        remote: record.clone(),
        then: Vec::new(),
        content_room: None,
        journal_room: None,
        placeholder: false,
    };
    let mut sources = Sources::default();
    let t = prepare(&reader, folders, rt, meta, &mut sources, &mut dirs)?;
    Ok(Some((Seen { record, local }, t, sources, dirs)))
}

/// Installs `temp` over the placeholder `seen` names, under the folder's lock, if the journal
/// and the disk still hold that placeholder; journals the new file's stat.
fn install(
    folders: &Folders,
    rt: &FolderRt,
    path: &RelPath,
    seen: Seen,
    mut temp: TempFile,
) -> Result<LocalStat, FillError> {
    let _guard = rt
        .op_lock
        .lock()
        .map_err(|_| FolderError::Poisoned("folder"))?;
    let now = folders.journal()?.get(&rt.id, path)?;
    let same = now
        .as_ref()
        .is_some_and(|s| s.record.version == seen.record.version && s.local == Some(seen.local));
    if !same {
        rt.store.discard_temp(temp);
        return Err(FillError::Changed(path.clone()));
    }
    // The placeholder it replaces is the same version: not handed over as one that leaves.
    temp.same_version = true;
    let installed = rt
        .store
        .install_synced_in(
            &mut DirCache::default(),
            vec![(temp, Expect::Matches(seen.local))],
            &|p, local| {
                rt.echoes.expect(p.clone(), Some(*local));
                rt.invalidator.invalidate(p);
            },
        )
        .pop()
        .unwrap_or_else(|| Err(StoreError::Changed(path.clone())));
    match installed {
        Ok(local) => {
            folders
                .journal()?
                .made_local(&rt.id, path, local, seen.local.inode)?;
            Ok(local)
        }
        Err(StoreError::Changed(_)) => Err(FillError::Changed(path.clone())),
        Err(StoreError::Busy(_)) => Err(FillError::Busy(path.clone())),
        Err(e) => Err(FillError::Apply(e.into())),
    }
}

/// Runs `fut` (a fetch over `conn`) unless the connection carries nothing for [`STALL`] or
/// closes: then `None`, and `fut` is dropped.
async fn watched<F: std::future::Future>(conn: &quinn::Connection, fut: F) -> Option<F::Output> {
    tokio::pin!(fut);
    let mut last = conn.stats().udp_rx.bytes;
    let mut since = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        tokio::select! {
            out = &mut fut => return Some(out),
            _ = tick.tick() => {
                let now = conn.stats().udp_rx.bytes;
                if now != last {
                    last = now;
                    since = Instant::now();
                } else if since.elapsed() >= STALL || conn.close_reason().is_some() {
                    return None;
                }
            }
        }
    }
}
