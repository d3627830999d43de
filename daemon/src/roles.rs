//! What a folder's role leaves to the user: `meshfs override` (send-only: this device's state
//! wins everywhere) and `meshfs revert` (receive-only: the shared state comes back, the local
//! edits stay as past versions). The rules are the sync core's (`meshfs_sync::role`); this
//! module carries them out with the store and the journal.
//!
//! **Override.** For each peer version a send-only folder holds (the `held` table), a new
//! version of this device's state at that path (its content, or a deletion where the path does
//! not exist here) whose vector dominates both: every peer takes it as the newer one, by the
//! usual rules. Nothing on disk changes here.
//!
//! **Revert.** For each path a receive-only folder changed here (the `local_only` table), the
//! record it held before its first local change comes back exactly (its vector too, so peers
//! see nothing new), through the store's safe path: its content rebuilt from the vault, the live
//! tree or a peer, installed with the checks an apply makes (the local file swapped out and
//! kept as a past version), or the path removed where it did not exist in the shared state.
//! Everything happens under the folder's lock and is journaled before the lock is let go, so
//! the capture path never takes the restored files for local edits.

use crate::folder::{FolderError, FolderRt, Folders};
use crate::journal::{Change, JournalError, Op};
use crate::store::{DirCache, Expect, StoreError};
use crate::versions::content;
use meshfs_protocol::{DeviceId, FileKind, FileRecord, FolderId, Hash, RelPath, ShortId};
use meshfs_sync::role::{self, Role};
use serde::Serialize;
use std::sync::Arc;

/// What an override or a revert did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RoleReport {
    /// Paths done.
    pub done: Vec<String>,
    /// Paths that could not be done, and why.
    pub failed: Vec<(String, String)>,
    /// Chunks fetched from peers (revert).
    pub fetched_chunks: usize,
}

/// Why an override or revert could not run.
#[derive(Debug, thiserror::Error)]
pub enum RoleError {
    /// The folder does not run here.
    #[error(transparent)]
    Folder(#[from] FolderError),
    /// The journal failed.
    #[error(transparent)]
    Journal(#[from] JournalError),
    /// The folder does not have the role the command is for.
    #[error("folder {folder} is {role}; `meshfs {command}` is for a {wants} folder")]
    WrongRole {
        /// The folder.
        folder: FolderId,
        /// Its role.
        role: &'static str,
        /// The command.
        command: &'static str,
        /// The role it needs.
        wants: &'static str,
    },
    /// A blocking step failed to run.
    #[error("task failed: {0}")]
    Task(String),
}

fn check_role(rt: &FolderRt, want: Role, command: &'static str) -> Result<(), RoleError> {
    let role = rt.role();
    if role == want {
        return Ok(());
    }
    Err(RoleError::WrongRole {
        folder: rt.id.clone(),
        role: role.as_str(),
        command,
        wants: want.as_str(),
    })
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `meshfs override`: this send-only device's state wins over every peer version it holds.
pub fn override_held(
    folders: &Folders,
    folder: &FolderId,
    local: ShortId,
) -> Result<RoleReport, RoleError> {
    let rt = folders.running(folder)?;
    check_role(&rt, Role::SendOnly, "override")?;
    let _guard = rt
        .op_lock
        .lock()
        .map_err(|_| FolderError::Poisoned("folder"))?;
    let mut j = folders.journal()?;
    let held = j.held(folder)?;
    let mut changes = Vec::new();
    let mut report = RoleReport::default();
    for (theirs, from) in &held {
        let ours = j.get(folder, &theirs.path)?;
        let version = role::overriding(
            ours.as_ref().map(|o| &o.record.version),
            &theirs.version,
            local,
            now_secs(),
        );
        let (record, local_stat) = match &ours {
            Some(o) => (
                FileRecord {
                    version,
                    modified_by: local,
                    sequence: 0,
                    ..o.record.clone()
                },
                o.local,
            ),
            // The path does not exist here: this device's state is its absence.
            None => (
                FileRecord {
                    path: theirs.path.clone(),
                    kind: theirs.kind,
                    deleted: true,
                    mode: theirs.mode,
                    mtime_ns: theirs.mtime_ns,
                    size: 0,
                    hash: Hash::ZERO,
                    chunks: Vec::new(),
                    target: String::new(),
                    version,
                    modified_by: local,
                    sequence: 0,
                },
                None,
            ),
        };
        let detail = serde_json::json!({
            "override": true,
            "over": from.short().display7(),
            "their_version": theirs.version.to_string(),
        })
        .to_string();
        report.done.push(record.path.to_string());
        changes.push(Change {
            record,
            op: Op::Conflict,
            local: local_stat,
            source: None,
            detail: Some(detail),
        });
    }
    let paths: Vec<RelPath> = held.iter().map(|(r, _)| r.path.clone()).collect();
    j.commit(folder, changes)?;
    j.clear_held(folder, &paths)?;
    drop(j);
    folders.changes_notify(folder);
    tracing::info!(%folder, paths = paths.len(), "override: this device's state sent as the newer version of every path that differed");
    Ok(report)
}

/// A path to put back, with the shared record it goes back to (`None`: it did not exist).
type Shared = (RelPath, Option<(FileRecord, Option<DeviceId>)>);

/// `meshfs revert`: a receive-only folder's local changes give way to the shared state; what
/// they wrote stays as past versions. Fetches from `peers` what no local source has.
pub async fn revert(
    folders: Arc<Folders>,
    folder: FolderId,
    local: ShortId,
    peers: Vec<quinn::Connection>,
) -> Result<RoleReport, RoleError> {
    let rt = folders.running(&folder)?;
    check_role(&rt, Role::ReceiveOnly, "revert")?;
    let f = folders.clone();
    let id = folder.clone();
    let items: Vec<Shared> =
        tokio::task::spawn_blocking(move || Ok::<_, FolderError>(f.journal()?.local_only(&id)?))
            .await
            .map_err(|e| RoleError::Task(e.to_string()))??;
    let mut report = RoleReport::default();
    // Content no local source has comes from the peers first, into the vault.
    let wanted: Vec<(Hash, u32)> = items
        .iter()
        .filter_map(|(_, s)| s.as_ref())
        .filter(|(r, _)| !r.deleted && r.kind == FileKind::File)
        .flat_map(|(r, _)| r.chunks.iter().map(|c| (c.hash, c.len)))
        .collect();
    let (f, r) = (folders.clone(), rt.clone());
    let missing = tokio::task::spawn_blocking(move || content::missing(&f, &r, &wanted))
        .await
        .map_err(|e| RoleError::Task(e.to_string()))?;
    if !missing.is_empty() {
        report.fetched_chunks = content::fetch_into_vault(&rt, &folder, missing, &peers)
            .await
            .0;
    }
    let f = folders.clone();
    let report = tokio::task::spawn_blocking(move || put_back(&f, &rt, items, local, report))
        .await
        .map_err(|e| RoleError::Task(e.to_string()))??;
    folders.changes_notify(&folder);
    Ok(report)
}

/// The blocking half of [`revert`].
fn put_back(
    folders: &Folders,
    rt: &FolderRt,
    mut items: Vec<Shared>,
    local: ShortId,
    mut report: RoleReport,
) -> Result<RoleReport, RoleError> {
    let folder = &rt.id;
    let mut dirs = DirCache::default();
    // Contents built off the lock.
    let mut temps = std::collections::HashMap::new();
    for (path, shared) in &items {
        if let Some((r, _)) = shared {
            if !r.deleted && r.kind == FileKind::File {
                match content::fill(folders, rt, &mut dirs, path, r) {
                    Ok(t) => {
                        temps.insert(path.clone(), t);
                    }
                    Err(e) => report.failed.push((path.to_string(), e.to_string())),
                }
            }
        }
    }
    let _guard = rt
        .op_lock
        .lock()
        .map_err(|_| FolderError::Poisoned("folder"))?;
    // Removals deepest first; creations and contents parents first.
    items.sort_by(|a, b| a.0.cmp(&b.0));
    let (gone, back): (Vec<Shared>, Vec<Shared>) = items
        .into_iter()
        .partition(|(_, s)| s.as_ref().is_none_or(|(r, _)| r.deleted));
    let mut changes = Vec::new();
    let mut cleared = Vec::new();
    for (path, shared) in gone.into_iter().rev() {
        let current = folders.journal()?.get(folder, &path)?;
        let removed = match current.as_ref().filter(|c| !c.record.deleted) {
            None => Ok(()),
            Some(c) if c.record.kind == FileKind::Dir => rt.store.remove_dir(&path),
            Some(c) => match c.local {
                Some(l) => rt.store.remove_file(&path, Expect::Matches(l)),
                None => Err(StoreError::Changed(path.clone())),
            },
        };
        if let Err(e) = removed {
            report.failed.push((path.to_string(), e.to_string()));
            continue;
        }
        let (record, source) = match shared {
            Some((r, source)) => (r, source),
            None => {
                // It never existed in the shared state: a tombstone only this device has.
                let Some(c) = &current else {
                    cleared.push(path);
                    continue;
                };
                let mut r = c.record.clone();
                r.deleted = true;
                r.size = 0;
                r.hash = Hash::ZERO;
                r.chunks.clear();
                r.target.clear();
                r.version = r.version.incremented(local, now_secs());
                r.modified_by = local;
                (r, None)
            }
        };
        changes.push(reverted(
            current.as_ref().map(|c| &c.record),
            record,
            None,
            source,
        ));
        report.done.push(path.to_string());
        cleared.push(path);
    }
    let mut batch = Vec::new();
    let mut pending = Vec::new();
    for (path, shared) in back {
        let Some((record, source)) = shared else {
            continue;
        };
        let current = folders.journal()?.get(folder, &path)?;
        let live = current.as_ref().filter(|c| !c.record.deleted);
        let expect = match live {
            None => Expect::Absent,
            Some(c) => match c.local {
                Some(l) => Expect::Matches(l),
                None => Expect::Anything,
            },
        };
        match record.kind {
            FileKind::Dir => match rt.store.make_dir(&path, record.mode) {
                Ok(l) => {
                    changes.push(reverted(live.map(|c| &c.record), record, Some(l), source));
                    report.done.push(path.to_string());
                    cleared.push(path);
                }
                Err(e) => report.failed.push((path.to_string(), e.to_string())),
            },
            FileKind::Symlink => {
                match rt
                    .store
                    .make_symlink(&path, &record.target, record.mtime_ns, expect)
                {
                    Ok(l) => {
                        changes.push(reverted(live.map(|c| &c.record), record, Some(l), source));
                        report.done.push(path.to_string());
                        cleared.push(path);
                    }
                    Err(e) => report.failed.push((path.to_string(), e.to_string())),
                }
            }
            FileKind::File => {
                if let Some(t) = temps.remove(&path) {
                    batch.push((t, expect));
                    pending.push((path, record, source, live.map(|c| c.record.clone())));
                }
            }
        }
    }
    for (_, t) in temps {
        rt.store.discard_temp(t);
    }
    let results = rt.store.install_in(&mut dirs, batch);
    for ((path, record, source, before), r) in pending.into_iter().zip(results) {
        match r {
            Ok(l) => {
                rt.echoes.expect(path.clone(), Some(l));
                changes.push(reverted(before.as_ref(), record, Some(l), source));
                report.done.push(path.to_string());
                cleared.push(path);
            }
            Err(e) => report.failed.push((path.to_string(), e.to_string())),
        }
    }
    let mut j = folders.journal()?;
    j.commit(folder, changes)?;
    j.clear_local_only(folder, &cleared)?;
    tracing::info!(%folder, done = report.done.len(), failed = report.failed.len(), "revert: the shared state is back");
    Ok(report)
}

/// The journal change that puts `record` back.
fn reverted(
    before: Option<&FileRecord>,
    record: FileRecord,
    local: Option<crate::store::LocalStat>,
    source: Option<DeviceId>,
) -> Change {
    Change {
        op: Op::between(before, &record),
        record: FileRecord {
            sequence: 0,
            ..record
        },
        local,
        source,
        detail: Some("reverted to the shared version".into()),
    }
}
