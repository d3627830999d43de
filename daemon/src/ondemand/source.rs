//! The mount's [`ContentSource`] for a folder: an open of a placeholder waits here, on the
//! FUSE request thread, for its first chunk ([`super::open_stream`], D95) or, to write it, for
//! [`super::make_local`] on the engine's runtime (D92); an open of a
//! local file notes its use (D93); `user.meshfs.state` is answered from the folder's demand
//! (D94).

use super::{make_local, now_ns, open_stream, Peers};
use crate::folder::Folders;
use meshfs_fuse::{ContentSource, Opened};
use meshfs_protocol::{FolderId, RelPath};
use std::sync::{Arc, Weak};

/// A folder's content source for its mount.
pub struct MountContent {
    /// Weak: the mount lives in the folder, which the folders hold.
    folders: Weak<Folders>,
    folder: FolderId,
    peers: Peers,
    runtime: tokio::runtime::Handle,
}

impl std::fmt::Debug for MountContent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MountContent")
            .field("folder", &self.folder)
            .finish_non_exhaustive()
    }
}

impl MountContent {
    /// The source of `folder`'s mount: content from `peers`, fetched on `runtime`.
    pub fn new(
        folders: &Arc<Folders>,
        folder: FolderId,
        peers: Peers,
        runtime: tokio::runtime::Handle,
    ) -> MountContent {
        MountContent {
            folders: Arc::downgrade(folders),
            folder,
            peers,
            runtime,
        }
    }
}

impl ContentSource for MountContent {
    fn fetch(&self, path: &RelPath, pid: u32) -> Result<(), i32> {
        let folders = self.folders.upgrade().ok_or(libc::EIO)?;
        let rt = folders.running(&self.folder).map_err(|_| libc::EIO)?;
        self.runtime
            .block_on(make_local(&folders, &rt, &self.peers, path, pid))
            .map_err(|f| f.errno)
    }

    fn open(&self, path: &RelPath, pid: u32) -> Result<Opened, i32> {
        let folders = self.folders.upgrade().ok_or(libc::EIO)?;
        let rt = folders.running(&self.folder).map_err(|_| libc::EIO)?;
        match open_stream(&folders, &rt, &self.peers, path, pid, &self.runtime) {
            Ok(Some(reader)) => Ok(Opened::Stream(Box::new(reader))),
            Ok(None) => Ok(Opened::Local),
            Err(f) => Err(f.errno),
        }
    }

    fn used(&self, path: &RelPath) {
        let Some(rt) = self.folders.upgrade().and_then(|f| f.get(&self.folder)) else {
            return;
        };
        if rt.policy().on_demand {
            rt.demand.used(path, now_ns());
        }
    }

    fn active(&self) -> bool {
        self.folders
            .upgrade()
            .and_then(|f| f.get(&self.folder))
            .is_some_and(|rt| rt.policy().on_demand)
    }

    fn state(&self, path: &RelPath, local: bool) -> &'static str {
        let rt = self.folders.upgrade().and_then(|f| f.get(&self.folder));
        let demand = rt.as_ref().map(|rt| &rt.demand);
        match (local, demand) {
            (false, Some(d)) if d.fetching(path) => "fetching",
            (false, _) => "online",
            (true, Some(d)) if d.pinned(path) => "pinned",
            (true, _) => "local",
        }
    }
}
