//! A placeholder's content made local (docs/decisions.md, D92, D95), the steps around the
//! stream (`super::stream`): what the journal and the disk hold at the path when it starts
//! ([`start`]: the transfer of the version, built exactly as a batch builds one), how a peer's
//! silence is noticed ([`watched`]), and the install over the placeholder under the folder's
//! lock, if the placeholder is still what the journal knows ([`install`]). The record keeps
//! its version; it gets the new file's stat, and its placeholder row goes
//! (`Journal::made_local`).
//!
//! What it never does: change a version, or install over anything but the placeholder of the
//! very record it built.

use super::transfer::{prepare, ApplyError, Look, Meta, Sources, Transfer};
use crate::folder::{FolderError, FolderRt, Folders};
use crate::journal::Op;
use crate::store::{DirCache, Expect, LocalStat, StoreError, TempFile};
use meshfs_protocol::{FileKind, FileRecord, RelPath};
use std::time::{Duration, Instant};

/// How long a peer's connection may carry nothing while a fetch waits on it before the fetch
/// gives that peer up (a peer killed without closing its connection looks connected until the
/// transport's idle timeout).
pub const STALL: Duration = Duration::from_secs(3);

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

/// What the journal holds at the path when a stream starts.
pub(super) struct Seen {
    pub(super) record: FileRecord,
    pub(super) local: LocalStat,
}

/// What the journal and the disk say at `path`, and the transfer of its content: `None` when
/// the content is local already.
#[allow(clippy::type_complexity)]
pub(super) fn start(
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
    // The chunks this device holds elsewhere are looked up once the first request is out (D98).
    let t = prepare(
        &reader,
        folders,
        rt,
        meta,
        &mut sources,
        &mut dirs,
        Look::Later,
    )?;
    Ok(Some((Seen { record, local }, t, sources, dirs)))
}

/// Installs `temp` over the placeholder `seen` names, under the folder's lock, if the journal
/// and the disk still hold that placeholder; journals the new file's stat.
pub(super) fn install(
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
pub(super) async fn watched<F: std::future::Future>(
    conn: &quinn::Connection,
    fut: F,
) -> Option<F::Output> {
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
