//! `meshfs restore`: a past version (or a whole tree as it was at a time) back as a new local
//! change of this device — journaled, sent to every peer, and a conflict by the usual rules
//! where a peer changed the path meanwhile.
//!
//! The order, each step a test's kill point:
//! 1. **choose** (journal): the versions to bring back: one `versions` row (`--seq N`, or the
//!    newest that differs from the path now), or every path below `PATH` as the history had it
//!    at `--at TIME` (directories, symlinks and files, each file's content by its hash from
//!    `versions` or the current record);
//! 2. **fetch** what no local source has (vault, live tree) from the connected peers into the
//!    vault, every chunk verified; a version whose content no one has is reported, not guessed;
//! 3. **build** each file in a temp file of the store (verified chunks, covered exactly, mode
//!    and mtime of the version) and make them durable together;
//! 4. **install** under the folder's lock, with the checks an apply makes: a new path must
//!    still be absent, an existing file must still be the one the journal knows (it is swapped
//!    out and kept as a past version itself, like any file an apply replaces); directories and
//!    symlinks are made as the version had them;
//! 5. **capture**: the restored paths are scanned, so the capture path journals them as this
//!    device's new versions (their vectors dominate what the journal held) and the sessions
//!    send them.
//!
//! A crash before 4 leaves temp files (removed at the next start) and nothing else; during 4,
//! each path has its old content or its restored one, and the start-up scan journals what is
//! there. Nothing is ever half-written at a path.

use super::content;
use crate::folder::{FolderError, FolderRt, Folders};
use crate::journal::{HistoryEntry, Journal, JournalError, StoredRecord};
use crate::store::{DirCache, Expect, StoreError, TempFile};
use meshfs_protocol::{FileKind, FileRecord, FolderId, Hash, RelPath};
use serde::Serialize;
use std::sync::Arc;

/// Which version of a path to bring back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pick {
    /// The newest kept version that is not the current one.
    Newest,
    /// The version whose sequence is this (as `meshfs versions` lists it).
    Sequence(u64),
    /// The path (and everything below it) as it was at this time, ns since the epoch.
    At(i64),
}

/// What a restore did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RestoreReport {
    /// Paths written (files, directories, symlinks), in order.
    pub restored: Vec<RestoredPath>,
    /// Paths that already held the version.
    pub unchanged: usize,
    /// Chunks fetched from peers.
    pub fetched_chunks: usize,
    /// Paths that could not be restored, and why.
    pub failed: Vec<FailedPath>,
}

/// One path a restore wrote.
#[derive(Clone, Debug, Serialize)]
pub struct RestoredPath {
    /// Where.
    pub path: String,
    /// `file`, `dir` or `symlink`.
    pub kind: &'static str,
    /// The sequence of the version it holds again.
    pub from_sequence: u64,
    /// Its size.
    pub size: u64,
}

/// One path a restore could not write.
#[derive(Clone, Debug, Serialize)]
pub struct FailedPath {
    /// Where.
    pub path: String,
    /// Why.
    pub error: String,
}

/// Why a restore could not start.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    /// The folder does not run here.
    #[error(transparent)]
    Folder(#[from] FolderError),
    /// The journal failed.
    #[error(transparent)]
    Journal(#[from] JournalError),
    /// There is no such version.
    #[error("{0}")]
    NoVersion(String),
    /// A blocking step failed to run.
    #[error("restore task failed: {0}")]
    Task(String),
}

/// One path to bring back.
#[derive(Clone, Debug)]
struct Target {
    /// Where it goes.
    path: RelPath,
    /// The version (a live record: file, directory or symlink); its `path` is where it was.
    version: FileRecord,
}

/// Restores `path` of `folder` as `pick` says, at `to` instead of `path` if given, fetching
/// from `peers` what no local source has.
pub async fn restore(
    folders: Arc<Folders>,
    folder: FolderId,
    path: RelPath,
    pick: Pick,
    to: Option<RelPath>,
    peers: Vec<quinn::Connection>,
) -> Result<RestoreReport, RestoreError> {
    let rt = folders.running(&folder)?;
    // 1. choose
    let (f, r, p) = (folders.clone(), rt.clone(), path.clone());
    let (targets, failed) = blocking(move || choose(&f, &r, &p, pick, to.as_ref())).await??;
    let mut report = RestoreReport {
        failed,
        ..Default::default()
    };
    // 2. fetch
    let wanted: Vec<(Hash, u32)> = targets
        .iter()
        .filter(|t| t.version.kind == FileKind::File)
        .flat_map(|t| t.version.chunks.iter().map(|c| (c.hash, c.len)))
        .collect();
    let (f, r) = (folders.clone(), rt.clone());
    let missing = blocking(move || Ok(content::missing(&f, &r, &wanted))).await??;
    if !missing.is_empty() {
        tracing::info!(%folder, %path, chunks = missing.len(), peers = peers.len(), "fetching past content from peers");
        let (fetched, _) = content::fetch_into_vault(&rt, &folder, missing, &peers).await;
        report.fetched_chunks = fetched;
    }
    // 3.–5.
    let (f, r) = (folders.clone(), rt.clone());
    let (done, written) = blocking(move || Ok(write(&f, &r, targets, report))).await??;
    report = done;
    if !written.is_empty() {
        folders.scan_paths(&folder, written).await?;
    }
    tracing::info!(%folder, %path, restored = report.restored.len(), unchanged = report.unchanged, failed = report.failed.len(), fetched = report.fetched_chunks, "restored");
    Ok(report)
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, RestoreError> + Send + 'static,
) -> Result<Result<T, RestoreError>, RestoreError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| RestoreError::Task(e.to_string()))
}

/// Step 1: what to bring back, each at its destination, and the paths whose version's content
/// the journal no longer lists.
fn choose(
    folders: &Folders,
    rt: &FolderRt,
    path: &RelPath,
    pick: Pick,
    to: Option<&RelPath>,
) -> Result<(Vec<Target>, Vec<FailedPath>), RestoreError> {
    let mut unlisted = Vec::new();
    let j = folders.journal()?;
    let folder = &rt.id;
    let current = j.get(folder, path)?;
    let live_now = current.as_ref().filter(|c| !c.record.deleted);
    let mut targets = match pick {
        Pick::Sequence(seq) => {
            let Some(v) = j.version_at_sequence(folder, seq)? else {
                if live_now.is_some_and(|c| c.record.sequence == seq) {
                    return Err(RestoreError::NoVersion(format!(
                        "version {seq} is {path} as it is now; nothing to restore"
                    )));
                }
                return Err(RestoreError::NoVersion(format!(
                    "no past version {seq} of {path} (see `meshfs versions {folder} {path}`)"
                )));
            };
            if &v.record.path != path {
                return Err(RestoreError::NoVersion(format!(
                    "version {seq} is of {}, not of {path}",
                    v.record.path
                )));
            }
            vec![Target {
                path: path.clone(),
                version: v.record,
            }]
        }
        Pick::Newest => {
            let now = live_now.map(|c| &c.record);
            let newest = j
                .versions_of(folder, path)?
                .into_iter()
                .find(|v| now.is_none_or(|n| !n.same_content(&v.record)));
            match newest {
                Some(v) => vec![Target {
                    path: path.clone(),
                    version: v.record,
                }],
                None if live_now.is_some_and(|c| c.record.kind == FileKind::Dir)
                    || j.has_live_below(folder, path)?
                    || current.as_ref().is_some_and(|c| c.record.kind == FileKind::Dir) =>
                {
                    return Err(RestoreError::NoVersion(format!(
                        "{path} is a directory: give --at TIME to restore the tree as it was then"
                    )))
                }
                None => {
                    return Err(RestoreError::NoVersion(format!(
                        "{path} has no earlier version kept in this device's journal (see `meshfs versions {folder} {path}`)"
                    )))
                }
            }
        }
        Pick::At(at) => {
            let state = j.state_at(folder, Some(path), at)?;
            if !state.iter().any(|e| &e.path == path && !e.deleted) {
                return Err(RestoreError::NoVersion(format!(
                    "{path} did not exist at that time in this device's journal"
                )));
            }
            let mut out = Vec::new();
            for e in state.into_iter().filter(|e| !e.deleted) {
                match version_of(&j, folder, &e)? {
                    Some(v) => out.push(Target {
                        path: e.path.clone(),
                        version: v,
                    }),
                    None => unlisted.push(FailedPath {
                        path: e.path.to_string(),
                        error: format!(
                            "the journal no longer lists the content of version {}: it was pruned",
                            e.sequence
                        ),
                    }),
                }
            }
            out
        }
    };
    if let Some(to) = to {
        for t in &mut targets {
            t.path = t.path.rebase(path, to).ok_or_else(|| {
                RestoreError::NoVersion(format!("{} cannot go below {to}", t.path))
            })?;
        }
    }
    // Parents before children (order by path).
    targets.sort_by(|a, b| a.path.cmp(&b.path));
    Ok((targets, unlisted))
}

/// The version a journal row names, to restore by its sequence (the page's restore button):
/// its path and the sequence of the `versions` row that holds it — the row's own when that
/// version left the tree, else the newest past version of that path with the row's content (a
/// metadata change keeps content, so several rows may name one version's content).
pub fn version_of_row(
    j: &Journal,
    folder: &FolderId,
    sequence: u64,
) -> Result<(RelPath, u64), RestoreError> {
    if let Some(v) = j.version_at_sequence(folder, sequence)? {
        return Ok((v.record.path, sequence));
    }
    let row = j
        .history(
            folder,
            &crate::journal::HistoryQuery {
                since_sequence: Some(sequence.saturating_sub(1)),
                limit: Some(1),
                bookkeeping: true,
                ..Default::default()
            },
        )?
        .into_iter()
        .find(|e| e.sequence == sequence)
        .ok_or_else(|| {
            RestoreError::NoVersion(format!(
                "the journal has no row {sequence} in folder {folder}"
            ))
        })?;
    let unkept = || {
        RestoreError::NoVersion(format!(
            "row {sequence} ({} of {}) names no past version this device lists",
            row.op.as_str(),
            row.path
        ))
    };
    if row.deleted || row.kind == FileKind::Dir {
        return Err(unkept());
    }
    if let Some(now) = j.get(folder, &row.path)? {
        if !now.record.deleted && now.record.kind == row.kind && now.record.hash == row.hash {
            return Err(RestoreError::NoVersion(format!(
                "row {sequence} is {} as it is now; nothing to restore",
                row.path
            )));
        }
    }
    let v = j
        .version_with_content(folder, &row.path, &row.hash)?
        .ok_or_else(unkept)?;
    Ok((row.path, v.record.sequence))
}

/// The full record of the version a history row names: a directory from the row itself, a
/// file's or symlink's from the current record (same content) or the `versions` row; `None`
/// when the journal no longer lists it.
pub(super) fn version_of(
    j: &Journal,
    folder: &FolderId,
    e: &HistoryEntry,
) -> Result<Option<FileRecord>, RestoreError> {
    if e.kind == FileKind::Dir {
        return Ok(Some(FileRecord {
            path: e.path.clone(),
            kind: FileKind::Dir,
            deleted: false,
            mode: e.mode,
            mtime_ns: e.time_ns,
            size: 0,
            hash: Hash::ZERO,
            chunks: Vec::new(),
            target: String::new(),
            version: e.version.clone(),
            modified_by: e.modified_by,
            sequence: e.sequence,
        }));
    }
    if let Some(StoredRecord { record, .. }) = j.get(folder, &e.path)? {
        if !record.deleted && record.kind == e.kind && record.hash == e.hash {
            return Ok(Some(FileRecord {
                sequence: e.sequence,
                mode: e.mode,
                ..record
            }));
        }
    }
    Ok(j.version_with_content(folder, &e.path, &e.hash)?
        .map(|v| FileRecord {
            sequence: e.sequence,
            mode: e.mode,
            ..v.record
        }))
}

/// Steps 3 and 4: builds and installs every target; returns the report and the paths written
/// (to capture).
fn write(
    folders: &Folders,
    rt: &FolderRt,
    targets: Vec<Target>,
    mut report: RestoreReport,
) -> (RestoreReport, Vec<RelPath>) {
    let folder = &rt.id;
    let mut written = Vec::new();
    let mut dirs = DirCache::default();
    // 3. build the files' temp files, off the lock.
    let mut temps: Vec<(Target, TempFile)> = Vec::new();
    let mut others: Vec<Target> = Vec::new();
    for t in targets {
        let current = folders
            .journal()
            .ok()
            .and_then(|j| j.get(folder, &t.path).ok().flatten());
        if current
            .as_ref()
            .is_some_and(|c| !c.record.deleted && c.record.same_content(&t.version))
        {
            report.unchanged += 1;
            continue;
        }
        if t.version.kind != FileKind::File {
            others.push(t);
            continue;
        }
        match content::fill(folders, rt, &mut dirs, &t.path, &t.version) {
            Ok(temp) => temps.push((t, temp)),
            Err(e) => report.failed.push(failed(&t.path, &e)),
        }
    }
    crate::failpoint::hit("restore.built", "");
    let Ok(_guard) = rt.op_lock.lock() else {
        for (_, temp) in temps {
            rt.store.discard_temp(temp);
        }
        return (report, written);
    };
    // Directories and symlinks, parents first, before the files that go into them.
    for t in others {
        let expect = expect_of(folders, folder, &t.path);
        let made = match t.version.kind {
            FileKind::Dir => rt.store.make_dir(&t.path, t.version.mode).map(|_| ()),
            _ => expect.and_then(|e| {
                rt.store
                    .make_symlink(&t.path, &t.version.target, t.version.mtime_ns, e)
                    .map(|_| ())
            }),
        };
        match made {
            Ok(()) => {
                report.restored.push(restored(&t));
                written.push(t.path);
            }
            Err(e) => report.failed.push(failed(&t.path, &e)),
        }
    }
    // 4. install the files, each against what the journal says is at its path.
    let mut batch = Vec::new();
    let mut meta = Vec::new();
    for (t, temp) in temps {
        match expect_of(folders, folder, &t.path) {
            Ok(e) => {
                batch.push((temp, e));
                meta.push(t);
            }
            Err(e) => {
                rt.store.discard_temp(temp);
                report.failed.push(failed(&t.path, &e));
            }
        }
    }
    let results = rt.store.install_in(&mut dirs, batch);
    crate::failpoint::hit("restore.installed", "");
    for (t, r) in meta.into_iter().zip(results) {
        match r {
            Ok(_) => {
                report.restored.push(restored(&t));
                written.push(t.path);
            }
            Err(StoreError::Changed(p)) => report.failed.push(FailedPath {
                path: p.to_string(),
                error: "changed on disk since it was last scanned; nothing was replaced (run the restore again)".into(),
            }),
            Err(e) => report.failed.push(failed(&t.path, &e)),
        }
    }
    (report, written)
}

/// What an install must find at `path`: the file the journal knows, or nothing. A directory
/// there is not replaced by a file or symlink.
fn expect_of(folders: &Folders, folder: &FolderId, path: &RelPath) -> Result<Expect, StoreError> {
    let current = folders
        .journal()
        .ok()
        .and_then(|j| j.get(folder, path).ok().flatten());
    match current {
        Some(c) if !c.record.deleted && c.record.kind == FileKind::Dir => Err(StoreError::Io {
            path: path.to_string(),
            source: std::io::Error::other("a directory is there now; restore with --to NEWPATH"),
        }),
        Some(c) if !c.record.deleted => match c.local {
            Some(l) => Ok(Expect::Matches(l)),
            None => Err(StoreError::Changed(path.clone())),
        },
        _ => Ok(Expect::Absent),
    }
}

fn restored(t: &Target) -> RestoredPath {
    RestoredPath {
        path: t.path.to_string(),
        kind: t.version.kind.as_str(),
        from_sequence: t.version.sequence,
        size: t.version.size,
    }
}

fn failed(path: &RelPath, e: &dyn std::fmt::Display) -> FailedPath {
    FailedPath {
        path: path.to_string(),
        error: e.to_string(),
    }
}
