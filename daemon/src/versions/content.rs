//! Where a past version's content comes from: the vault, the live tree (a chunk the version
//! shares with a file of the folder now), or a connected peer that keeps it.
//!
//! Chunks fetched from a peer go into the vault (they are a past version's, which this device
//! now keeps too), so everything after the fetch is local: [`fill`] builds temp files from the
//! vault and the live tree alone, each chunk verified by blake3 before it is written.

use crate::chunks::{self, ChunkSink};
use crate::folder::{FolderRt, Folders};
use crate::store::{DirCache, StoreError, TempFile};
use crate::vault::Vault;
use meshfs_protocol::{FileRecord, FolderId, Hash};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// A chunk of the folder: from the vault, else from a live file the chunk index names (read and
/// verified); `None` when neither has it.
pub fn local_chunk(folders: &Folders, rt: &FolderRt, hash: &Hash, len: u32) -> Option<Vec<u8>> {
    if let Some(v) = rt.vault() {
        if let Ok(Some(d)) = v.get(hash) {
            return Some(d);
        }
    }
    let locations = folders.journal().ok()?.find_chunk(&rt.id, hash).ok()?;
    let mut dirs = DirCache::default();
    locations.into_iter().find_map(|l| {
        (l.len == len)
            .then(|| {
                rt.store
                    .read_chunk_in(&mut dirs, &l.path, l.offset, l.len, hash)
                    .ok()
            })
            .flatten()
    })
}

/// Of `chunks` (hash, length), those neither the vault nor the live tree holds.
pub fn missing(folders: &Folders, rt: &FolderRt, chunks: &[(Hash, u32)]) -> Vec<(Hash, u32)> {
    let mut seen = HashSet::new();
    let unique: Vec<(Hash, u32)> = chunks
        .iter()
        .copied()
        .filter(|(h, _)| seen.insert(*h))
        .collect();
    let hashes: Vec<Hash> = unique.iter().map(|c| c.0).collect();
    let live = match folders.journal() {
        Ok(mut j) => j.find_chunks(&rt.id, &hashes),
        Err(_) => vec![Vec::new(); hashes.len()],
    };
    let in_vault = rt
        .vault()
        .and_then(|v| v.has(&hashes).ok())
        .unwrap_or_else(|| vec![false; hashes.len()]);
    unique
        .into_iter()
        .zip(live.into_iter().zip(in_vault))
        .filter(|(_, (l, v))| l.is_empty() && !v)
        .map(|(c, _)| c)
        .collect()
}

/// Verified chunks from a peer, into the vault in batches.
struct IntoVault {
    vault: Arc<Vault>,
    batch: Vec<(Hash, Vec<u8>)>,
    got: usize,
}

impl IntoVault {
    fn flush(&mut self) -> Result<(), StoreError> {
        let batch = std::mem::take(&mut self.batch);
        self.vault.put(&batch).map_err(|e| StoreError::Io {
            path: self.vault.path().display().to_string(),
            source: std::io::Error::other(e.to_string()),
        })?;
        Ok(())
    }
}

impl ChunkSink for IntoVault {
    fn put(&mut self, hash: Hash, data: &[u8]) -> Result<(), StoreError> {
        self.got += 1;
        self.batch.push((hash, data.to_vec()));
        if self.batch.len() >= 64 {
            self.flush()?;
        }
        Ok(())
    }
}

/// Fetches `wanted` chunks of `folder` from `peers` in turn (each asked only for what the ones
/// before it did not have) into the folder's vault. Returns the chunks fetched and those no
/// peer had.
pub async fn fetch_into_vault(
    rt: &FolderRt,
    folder: &FolderId,
    wanted: Vec<(Hash, u32)>,
    peers: &[quinn::Connection],
) -> (usize, Vec<(Hash, u32)>) {
    let Some(vault) = rt.vault().cloned() else {
        return (0, wanted);
    };
    let mut left = wanted;
    let mut fetched = 0;
    for conn in peers {
        if left.is_empty() {
            break;
        }
        let lens: HashMap<Hash, u32> = left.iter().copied().collect();
        let sink = IntoVault {
            vault: vault.clone(),
            batch: Vec::new(),
            got: 0,
        };
        let (result, mut sink) = chunks::fetch(conn, folder, left.clone(), sink).await;
        let flushed = tokio::task::spawn_blocking(move || {
            let r = sink.flush();
            (sink.got, r)
        })
        .await;
        match (result, flushed) {
            (Ok(not_there), Ok((got, Ok(())))) => {
                fetched += got;
                left = not_there
                    .into_iter()
                    .filter_map(|h| lens.get(&h).map(|&l| (h, l)))
                    .collect();
            }
            (r, f) => {
                tracing::debug!(%folder, peer = %conn.remote_address(), error = ?r.err(), flushed = ?f.map(|x| x.1.err()), "fetching past content from a peer failed; trying the next");
                // What arrived before the failure is in the vault: ask again only for the rest.
                let held = vault
                    .has(&left.iter().map(|c| c.0).collect::<Vec<_>>())
                    .unwrap_or_default();
                left = left
                    .into_iter()
                    .zip(held.into_iter().chain(std::iter::repeat(false)))
                    .filter(|(_, h)| !h)
                    .map(|(c, _)| c)
                    .collect();
            }
        }
    }
    (fetched, left)
}

/// Builds the content of `version` (a live file record) in a new temp file for `target`, from
/// the vault and the live tree; the temp file is finished (covered exactly, mode and mtime
/// set). The caller installs or discards it.
pub fn fill(
    folders: &Folders,
    rt: &FolderRt,
    dirs: &mut DirCache,
    target: &meshfs_protocol::RelPath,
    version: &FileRecord,
) -> Result<TempFile, FillError> {
    let mut t = rt.store.create_temp_in(dirs, target, false)?;
    let mut cache: HashMap<Hash, Vec<u8>> = HashMap::new();
    for (offset, c) in version.chunk_offsets() {
        let data = match cache.get(&c.hash) {
            Some(d) => d.clone(),
            None => match local_chunk(folders, rt, &c.hash, c.len) {
                Some(d) => d,
                None => {
                    rt.store.discard_temp(t);
                    return Err(FillError::Missing(c.hash));
                }
            },
        };
        if let Err(e) = rt.store.write_temp(&mut t, offset, &data) {
            rt.store.discard_temp(t);
            return Err(e.into());
        }
        // A chunk repeated in the file (runs of zeros) is read once.
        if version.chunks.len() > 1 && cache.len() < 64 {
            cache.insert(c.hash, data);
        }
    }
    rt.store.close_temp(&mut t);
    if let Err(e) = rt
        .store
        .finish_temp(&mut t, version.size, version.mode, version.mtime_ns)
    {
        rt.store.discard_temp(t);
        return Err(e.into());
    }
    Ok(t)
}

/// Why a version's content could not be built.
#[derive(Debug, thiserror::Error)]
pub enum FillError {
    /// A chunk is neither in the vault nor in the live tree.
    #[error("chunk {0} is kept neither here nor by a connected peer")]
    Missing(Hash),
    /// Writing the temp file failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}
