//! `meshfs mount FOLDER DIR --at TIME`: the folder as this device's journal had it at a past
//! time, mounted read-only (`meshfs_fuse::mount_snapshot`). The tree comes from the history
//! (each path's last row at or before the time), each file's chunk list from the current
//! record or its `versions` row, and its content, when opened, from the vault, the live tree or
//! a connected peer (fetched into the vault once, then read locally).

use super::content;
use super::restore::version_of;
use crate::folder::{FolderError, FolderRt, Folders};
use meshfs_fuse::{SnapshotContent, SnapshotEntry, SnapshotKind, SnapshotMount};
use meshfs_protocol::{Chunk, FileKind, FolderId, Hash};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The longest an open waits for a peer's chunks.
const FETCH_WAIT: Duration = Duration::from_secs(60);

/// The connections to ask for chunks, as they are at the moment of asking.
pub type Peers = Arc<dyn Fn() -> Vec<quinn::Connection> + Send + Sync>;

/// The tree of `folder` at `at_ns`, as the snapshot filesystem takes it.
pub fn tree_at(
    folders: &Folders,
    folder: &FolderId,
    at_ns: i64,
) -> Result<Vec<SnapshotEntry>, FolderError> {
    let j = folders.journal()?;
    let state = j.state_at(folder, None, at_ns)?;
    let mut out = Vec::with_capacity(state.len());
    for e in state.into_iter().filter(|e| !e.deleted) {
        let version = version_of(&j, folder, &e).ok().flatten();
        let kind = match (e.kind, &version) {
            (FileKind::Dir, _) => SnapshotKind::Dir,
            (FileKind::Symlink, Some(v)) => SnapshotKind::Symlink(v.target.clone()),
            // A symlink whose target the journal no longer knows cannot be shown as one.
            (FileKind::Symlink, None) => continue,
            (FileKind::File, v) => SnapshotKind::File {
                size: e.size,
                chunks: v.as_ref().map(|v| v.chunks.clone()),
            },
        };
        out.push(SnapshotEntry {
            mtime_ns: version.as_ref().map_or(e.time_ns, |v| v.mtime_ns),
            path: e.path,
            kind,
            mode: e.mode,
        });
    }
    Ok(out)
}

/// A snapshot's content: the folder's vault and live files, and its connected peers.
struct Content {
    folders: Arc<Folders>,
    rt: Arc<FolderRt>,
    peers: Peers,
    runtime: tokio::runtime::Handle,
}

impl SnapshotContent for Content {
    fn prepare(&self, chunks: &[Chunk]) -> bool {
        let wanted: Vec<(Hash, u32)> = chunks.iter().map(|c| (c.hash, c.len)).collect();
        let missing = content::missing(&self.folders, &self.rt, &wanted);
        if missing.is_empty() {
            return true;
        }
        let peers = (self.peers)();
        if peers.is_empty() {
            return false;
        }
        let (rt, folder) = (self.rt.clone(), self.rt.id.clone());
        let fetched = self.runtime.block_on(async move {
            tokio::time::timeout(
                FETCH_WAIT,
                content::fetch_into_vault(&rt, &folder, missing, &peers),
            )
            .await
        });
        matches!(fetched, Ok((_, left)) if left.is_empty())
    }

    fn chunk(&self, hash: &Hash, len: u32) -> Option<Vec<u8>> {
        content::local_chunk(&self.folders, &self.rt, hash, len)
    }
}

/// The snapshots this daemon serves, by mount point.
#[derive(Default)]
pub struct Snapshots {
    mounted: Mutex<Vec<(FolderId, SnapshotMount)>>,
}

impl std::fmt::Debug for Snapshots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Snapshots").finish_non_exhaustive()
    }
}

impl Snapshots {
    /// Mounts `folder` as it was at `at_ns` at `mountpoint`. Blocking (the kernel's mount);
    /// call it from a blocking thread of the runtime (its chunk fetches run there).
    /// Returns the number of paths the snapshot shows.
    pub fn mount(
        &self,
        folders: Arc<Folders>,
        folder: &FolderId,
        at_ns: i64,
        mountpoint: &Path,
        peers: Peers,
    ) -> Result<(PathBuf, usize), SnapshotError> {
        let rt = folders.running(folder)?;
        let entries = tree_at(&folders, folder, at_ns)?;
        let n = entries.len();
        let content = Arc::new(Content {
            folders,
            rt,
            peers,
            runtime: tokio::runtime::Handle::try_current()
                .map_err(|e| SnapshotError::Runtime(e.to_string()))?,
        });
        let point = mountpoint.to_path_buf();
        let m = crate::priority::in_foreground(move || {
            meshfs_fuse::mount_snapshot(entries, at_ns, &point, content)
        })?;
        let point = m.mountpoint().to_path_buf();
        self.mounted
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((folder.clone(), m));
        Ok((point, n))
    }

    /// Unmounts the snapshot of `folder` at `mountpoint` (any of the folder's when `None`,
    /// if there is exactly one). Returns where it was mounted, or `None` if nothing matched.
    pub fn unmount(
        &self,
        folder: &FolderId,
        mountpoint: Option<&Path>,
    ) -> Result<Option<PathBuf>, SnapshotError> {
        let real = mountpoint.map(|p| p.canonicalize().unwrap_or_else(|_| p.to_path_buf()));
        let taken = {
            let mut m = self.mounted.lock().unwrap_or_else(|p| p.into_inner());
            let matches: Vec<usize> = m
                .iter()
                .enumerate()
                .filter(|(_, (f, s))| {
                    f == folder && real.as_deref().is_none_or(|r| s.mountpoint() == r)
                })
                .map(|(i, _)| i)
                .collect();
            match matches.as_slice() {
                [i] => Some(m.remove(*i).1),
                _ => None,
            }
        };
        let Some(s) = taken else {
            return Ok(None);
        };
        let point = s.mountpoint().to_path_buf();
        s.unmount()?;
        Ok(Some(point))
    }

    /// Unmounts every snapshot (the daemon is stopping, or the folder went away when `only`).
    pub fn unmount_all(&self, only: Option<&FolderId>) {
        let all: Vec<(FolderId, SnapshotMount)> = {
            let mut m = self.mounted.lock().unwrap_or_else(|p| p.into_inner());
            let (gone, kept) = std::mem::take(&mut *m)
                .into_iter()
                .partition(|(f, _)| only.is_none_or(|o| o == f));
            *m = kept;
            gone
        };
        for (folder, s) in all {
            let point = s.mountpoint().to_path_buf();
            if let Err(e) = s.unmount() {
                tracing::warn!(%folder, mountpoint = %point.display(), error = %e, "unmounting a snapshot failed");
            }
        }
    }

    /// The snapshots mounted: (folder, mount point).
    pub fn list(&self) -> Vec<(FolderId, PathBuf)> {
        self.mounted
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(f, s)| (f.clone(), s.mountpoint().to_path_buf()))
            .collect()
    }
}

/// Why a snapshot could not be mounted or unmounted.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// The folder does not run here, or the journal failed.
    #[error(transparent)]
    Folder(#[from] FolderError),
    /// The mount point or the kernel refused.
    #[error(transparent)]
    Mount(#[from] meshfs_fuse::MountError),
    /// Not called where a runtime is (a bug in the caller).
    #[error("no async runtime to fetch chunks with: {0}")]
    Runtime(String),
}
