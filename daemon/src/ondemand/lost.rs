//! A placeholder whose content no device holds any more (D103).
//!
//! An on-demand device evicts a file once a peer says it holds the content (D101), but the
//! peer may overwrite it a moment later; and a conflict this device resolved while the file
//! was a placeholder here makes a version with that same content. When a remote version then
//! conflicts with it, the conflict would keep it as a sibling, which needs its content
//! (`apply::decide`): fetched first, and if no device can give it, the remote version would
//! wait for good. [`held_nowhere`] tells that case from a holder being away: only when every
//! device sharing the folder is connected and, asked, none of them (nor this one) holds some
//! chunk of it.

use crate::folder::{FolderRt, Folders};
use meshfs_protocol::{DeviceId, FileKind, Hash, RelPath, VersionVector, MAX_HASHES_PER_PROBE};
use std::collections::HashSet;
use std::sync::Arc;

/// The version of the placeholder at `path` when its content is held nowhere: `links` are
/// the connected devices sharing the folder, `sharing` how many devices share it with this
/// one (the config's), and some chunk of the version is held neither here nor by any of them,
/// asked with a `Probe`. `None` when it is held, or when that cannot be told (a device away,
/// a probe unanswered, the journal unreadable).
pub async fn held_nowhere(
    folders: &Arc<Folders>,
    rt: &Arc<FolderRt>,
    links: Vec<(DeviceId, quinn::Connection)>,
    sharing: usize,
    path: &RelPath,
) -> Option<VersionVector> {
    if links.len() < sharing {
        return None;
    }
    let here = {
        let (folders, rt, path) = (folders.clone(), rt.clone(), path.clone());
        tokio::task::spawn_blocking(move || {
            let stored = folders.reader().ok()?.get(&rt.id, &path).ok()??;
            let record = stored.record;
            if record.deleted || record.kind != FileKind::File {
                return None;
            }
            let hashes: Vec<Hash> = record.chunks.iter().map(|c| c.hash).collect();
            let held = crate::chunks::held_here(&folders, &rt, &hashes);
            let missing: Vec<Hash> = hashes
                .into_iter()
                .zip(held)
                .filter(|(_, h)| !h)
                .map(|(c, _)| c)
                .collect();
            Some((record.version, missing))
        })
        .await
        .ok()??
    };
    let (version, mut missing) = here;
    missing.sort_unstable();
    missing.dedup();
    // A chunk held by any device can be fetched from it; the content is gone only if some
    // chunk is held by none.
    let mut unheld: HashSet<Hash> = missing.iter().copied().collect();
    for (_, conn) in &links {
        let asked: Vec<Hash> = unheld.iter().copied().collect();
        for part in asked.chunks(MAX_HASHES_PER_PROBE) {
            let flags = crate::chunks::probe(conn, &rt.id, part.to_vec())
                .await
                .ok()?;
            for (h, held) in part.iter().zip(flags) {
                if held {
                    unheld.remove(h);
                }
            }
        }
    }
    (!unheld.is_empty()).then_some(version)
}
