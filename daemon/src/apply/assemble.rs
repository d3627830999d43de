//! Steps 2 and 3: file contents assembled in temp files from the chunks this device has and
//! those fetched from the peer (each verified by its hash and length), then checked to be
//! covered exactly and made durable together. No lock is held: local edits go on, and the
//! batch before this one installs meanwhile.

use super::transfer::{skip_or_fail, ApplyError, Meta, Sources, Transfer, MAX_OPEN_TEMPS};
use crate::chunks;
use crate::failpoint;
use crate::folder::FolderRt;
use crate::store::{DirCache, StoreError, TempFile};
use meshfs_protocol::{ChunkResponse, Hash};
use std::collections::HashMap;
use std::sync::Arc;

/// Chunks wanted by a batch: each hash's length and where it goes (file index, offset).
pub(super) type Wanted = HashMap<Hash, (u32, Vec<(usize, u64)>)>;

/// What [`assemble`] leaves for the network.
pub(super) struct Assembled {
    /// One temp file per transfer (`None` once skipped).
    pub(super) temps: Vec<Option<TempFile>>,
    pub(super) metas: Vec<Meta>,
    pub(super) missing: Wanted,
    /// The chunks to ask the peer for.
    pub(super) wanted: Vec<(Hash, u32)>,
    pub(super) dirs: DirCache,
    /// Transfers that cannot be assembled here (shown in `status` as skipped).
    pub(super) skipped: Vec<usize>,
}

/// Step 2 without the network, outside the folder lock: a temp file for each transfer, the
/// chunks this device has copied into it from the files its decision opened (or opens now),
/// and the chunks the peer attached written into it. A temp file that cannot be made for one
/// transfer (its directory refuses it) skips that transfer; only a full disk fails the batch.
pub(super) fn assemble(
    rt: &FolderRt,
    mut dirs: DirCache,
    work: Vec<Transfer>,
    sources: &Sources,
    mut attached: HashMap<Hash, ChunkResponse>,
) -> Result<Assembled, ApplyError> {
    let mut temps: Vec<Option<TempFile>> = Vec::with_capacity(work.len());
    let mut metas = Vec::with_capacity(work.len());
    let mut missing: Wanted = HashMap::new();
    let mut skipped = Vec::new();
    for (i, t) in work.into_iter().enumerate() {
        let Transfer {
            meta,
            copies,
            missing: absent,
        } = t;
        let kept = temps.len() < MAX_OPEN_TEMPS;
        let made = rt
            .store
            .create_temp_in(&mut dirs, &meta.record.path, kept)
            .and_then(|mut temp| {
                if let Some(c) = &meta.content_room {
                    temp.set_claim(c.clone());
                }
                if meta.placeholder {
                    let r = &meta.record;
                    rt.store.make_placeholder(&mut temp, r.size, &r.hash)?;
                    return Ok((temp, Vec::new()));
                }
                if let Err(e) = rt.store.preallocate_temp(&mut temp, meta.record.size) {
                    rt.store.discard_temp(temp);
                    return Err(e);
                }
                if copies.is_empty() {
                    return Ok((temp, Vec::new()));
                }
                // For tests: the copying of a record's local chunks is under way (no lock held).
                failpoint::hit("apply.copying", meta.remote.path.as_str());
                let not_here =
                    rt.store
                        .copy_chunks_in(&mut dirs, &mut temp, &copies, &sources.held)?;
                Ok((temp, not_here))
            });
        let (mut temp, not_here) = match made {
            Ok(t) => t,
            Err(e) if e.is_disk_full() => {
                discard_all(rt, temps.into_iter().flatten());
                return Err(e.into());
            }
            Err(e) => {
                if let Err(e) = skip_or_fail(rt, &meta.remote, e) {
                    discard_all(rt, temps.into_iter().flatten());
                    return Err(e);
                }
                temps.push(None);
                metas.push(meta);
                skipped.push(i);
                continue;
            }
        };
        if !kept {
            rt.store.close_temp(&mut temp);
        }
        let stale = not_here.into_iter().map(|j| {
            let c = &copies[j];
            (c.hash, c.len, c.offset)
        });
        for (h, len, off) in absent.into_iter().chain(stale) {
            missing
                .entry(h)
                .or_insert((len, Vec::new()))
                .1
                .push((i, off));
        }
        temps.push(Some(temp));
        metas.push(meta);
    }
    // Chunks the peer attached to the index need no request; a bad one is asked for.
    let mut wanted: Vec<(Hash, u32)> = Vec::new();
    for (h, (len, _)) in &missing {
        let data = attached.remove(h).and_then(|c| {
            let data = c.data?;
            chunks::open_chunk(h, data, c.compressed).ok()
        });
        match data {
            Some(data) if data.len() == *len as usize => {
                if let Err(e) = write_chunk(&rt.store, &missing, &mut temps, *h, &data) {
                    discard_all(rt, temps.into_iter().flatten());
                    return Err(e.into());
                }
            }
            _ => wanted.push((*h, *len)),
        }
    }
    Ok(Assembled {
        temps,
        metas,
        missing,
        wanted,
        dirs,
        skipped,
    })
}

/// Drops a failed batch's temp files.
pub(super) fn discard_all(rt: &FolderRt, temps: impl IntoIterator<Item = TempFile>) {
    for t in temps {
        rt.store.discard_temp(t);
    }
}

/// The temp files of a batch while their chunks arrive from a peer ([`chunks::fetch`]).
pub(super) struct TempWriter {
    pub(super) rt: Arc<FolderRt>,
    /// Where each chunk goes.
    pub(super) missing: Wanted,
    pub(super) temps: Vec<Option<TempFile>>,
    /// Counts the bytes written, if set (a fetch someone waits for: `status` shows it).
    pub(super) progress: Option<Arc<std::sync::atomic::AtomicU64>>,
}

impl chunks::ChunkSink for TempWriter {
    fn put(&mut self, hash: Hash, data: &[u8]) -> Result<(), StoreError> {
        write_chunk(&self.rt.store, &self.missing, &mut self.temps, hash, data)?;
        if let Some(p) = &self.progress {
            let places = self.missing.get(&hash).map_or(0, |(_, at)| at.len()) as u64;
            p.fetch_add(
                places * data.len() as u64,
                std::sync::atomic::Ordering::Relaxed,
            );
        }
        Ok(())
    }
}

/// Writes a verified chunk everywhere a batch wants it.
fn write_chunk(
    store: &crate::store::Store,
    missing: &Wanted,
    temps: &mut [Option<TempFile>],
    hash: Hash,
    data: &[u8],
) -> Result<(), StoreError> {
    if let Some((_, places)) = missing.get(&hash) {
        for (i, off) in places {
            if let Some(Some(t)) = temps.get_mut(*i) {
                store.write_temp(t, *off, data)?;
            }
        }
    }
    Ok(())
}

/// Step 3: checks every file is covered by its verified chunks and makes the batch durable.
/// Returns each ready file with its index among `metas` (a skipped one has no temp file).
pub(super) fn finish_all(
    rt: &FolderRt,
    metas: Vec<Meta>,
    temps: Vec<Option<TempFile>>,
) -> Result<Vec<(usize, Meta, TempFile)>, ApplyError> {
    let mut ready: Vec<(usize, Meta, TempFile)> = Vec::with_capacity(metas.len());
    for (i, (t, temp)) in metas.into_iter().zip(temps).enumerate() {
        let Some(mut temp) = temp else { continue };
        match rt
            .store
            .finish_temp(&mut temp, t.record.size, t.record.mode, t.record.mtime_ns)
        {
            Ok(()) => ready.push((i, t, temp)),
            Err(e) => {
                let rest = ready.into_iter().map(|(_, _, t)| t);
                discard_all(rt, std::iter::once(temp).chain(rest));
                return Err(e.into());
            }
        }
    }
    let temps: Vec<&TempFile> = ready.iter().map(|(_, _, t)| t).collect();
    rt.store.sync_temps(&temps);
    Ok(ready)
}
