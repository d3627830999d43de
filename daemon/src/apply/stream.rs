//! A placeholder's content streamed to its readers while it is assembled (docs/decisions.md,
//! D95): the temp file is made as a batch makes one (`super::fill::start`, `assemble`), the
//! chunks this device holds elsewhere copied into it once the first request is out (D98),
//! handed to the flight's readers, and then
//! filled with what they want — the chunks under each read first, a sequential reader's
//! read-ahead after them, the whole file for a writer or a pin — fetched from the connected
//! peers that share the folder, several at once (each piece begins with the next peer in turn,
//! the version's source first; a chunk one peer lacks is asked of the next), each chunk verified by blake3 and its length before it is written and marked
//! present. Once every chunk is present the file is finished, made durable and installed over
//! the placeholder exactly as before (D92). When every reader left before that, the fetches
//! stop and what was fetched is kept for [`LINGER`] for a reader that comes back, then
//! dropped (D100).
//!
//! What it never does: mark a chunk present before its verified bytes are written (a reader
//! is served a range only once every chunk under it is present), or install a file that is
//! not covered exactly (`Store::finish_temp` checks).

use super::assemble::{assemble, discard_all, finish_all, Assembled};
use super::fill::{install, start, watched, FillError, STALL};
use super::on_blocking;
use super::transfer::{local_copies, ApplyError, Sources};
use crate::assembly::Assembly;
use crate::chunks::{self, FetchError};
use crate::demand::{Failure, Flight};
use crate::folder::{FolderRt, Folders};
use crate::store::{DirCache, LocalCopy, LocalStat, StoreError, TempFile};
use meshfs_protocol::{FolderId, Hash, RelPath};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

/// The connections to ask, in order (asked again for each fetch: a peer that came back is
/// used).
pub type Conns = Arc<dyn Fn() -> Vec<quinn::Connection> + Send + Sync>;

/// What [`drive`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Streamed {
    /// The content is local now, in this file.
    Local(LocalStat),
    /// It was local already (another fetch, or a peer's version installed meanwhile).
    Already,
    /// Every reader left before it was whole: nothing was installed.
    Abandoned,
}

/// How long a stream whose every reader left keeps what it fetched, fetching nothing, for a
/// reader that comes back (an opener that probes a file and closes it, then opens it again);
/// then it is dropped (D100).
pub const LINGER: std::time::Duration = std::time::Duration::from_secs(10);

/// Bytes written into a stream's temp file between two checks of its disk's free floor (D97).
const FLOOR_CHECK: u64 = 64 << 20;

/// The temp file a stream fills, shared by its fetches' writers (`None` once it is taken to
/// be installed or dropped).
type Shared = Arc<Mutex<Option<TempFile>>>;

/// Assembles the file at `path` for `flight`'s readers and installs it once whole. A fetch
/// that fails tells the readers waiting for its chunks (`failure` says with which errno) and
/// lists the path as unavailable; a later read asks again.
pub async fn drive(
    folders: Arc<Folders>,
    rt: Arc<FolderRt>,
    path: RelPath,
    flight: Arc<Flight>,
    conns: Conns,
    failure: fn(&FillError) -> Failure,
) -> Result<Streamed, FillError> {
    let (f, r, p) = (folders.clone(), rt.clone(), path.clone());
    let Some((seen, transfer, sources, dirs)) =
        on_blocking(move || Ok(start(&f, &r, &p))).await??
    else {
        return Ok(Streamed::Already);
    };
    let chunk_list = seen.record.chunks.clone();
    let r = rt.clone();
    let Assembled {
        mut temps,
        metas,
        missing,
        skipped,
        ..
    } = on_blocking(move || assemble(&r, dirs, vec![transfer], &sources, HashMap::new())).await?;
    let Some(Some(temp)) = temps.pop().filter(|_| skipped.is_empty()) else {
        discard_all(&rt, temps.into_iter().flatten());
        return Err(FillError::Apply(ApplyError::Task(format!(
            "{path}: no temp file could be made for it"
        ))));
    };
    let file = match rt.store.temp_descriptor(&temp) {
        Ok(f) => f,
        Err(e) => {
            rt.store.discard_temp(temp);
            return Err(FillError::Apply(e.into()));
        }
    };
    let places: HashMap<Hash, Vec<u64>> = missing
        .into_iter()
        .map(|(h, (_, at))| (h, at.into_iter().map(|(_, off)| off).collect()))
        .collect();
    flight.started(
        Assembly::new(&chunk_list, places.keys().copied()).looking(),
        file,
    );
    let temp: Shared = Arc::new(Mutex::new(Some(temp)));
    let sink = StreamSink {
        rt: rt.clone(),
        flight: flight.clone(),
        temp: temp.clone(),
        places: Arc::new(places),
    };
    // The first request goes out first; then what this device holds elsewhere is found and
    // copied (for a GiB, 16,384 lookups: tens of milliseconds the first read does not wait).
    let copier = {
        let (f, r, fl, t) = (folders.clone(), rt.clone(), flight.clone(), temp.clone());
        let record = seen.record.clone();
        tokio::task::spawn_blocking(move || copy_local(&f, &r, &record, &fl, &t))
    };
    let mut fetches = tokio::task::JoinSet::new();
    let mut turn = 0usize;
    // Since when no one holds the file (its fetches stopped, what they fetched kept).
    let mut idle: Option<tokio::time::Instant> = None;
    loop {
        let (pieces, complete, held) = flight.take();
        if complete {
            break;
        }
        if held {
            idle = None;
        } else {
            // Every holder left: what was asked for (and what was taken just now) is absent
            // again and the fetches stop, unless a holder came back meanwhile. (A chunk a fetch
            // brings between the two is verified and kept.)
            if !flight.pause() {
                continue;
            }
            fetches.abort_all();
            let since = *idle.get_or_insert_with(tokio::time::Instant::now);
            if since.elapsed() >= LINGER && flight.abandon() {
                if let Some(t) = take(&temp) {
                    rt.store.discard_temp(t);
                }
                return Ok(Streamed::Abandoned);
            }
            tokio::select! {
                _ = flight.wake.notified() => {}
                _ = tokio::time::sleep_until(since + LINGER) => {}
                Some(_) = fetches.join_next() => {}
            }
            continue;
        }
        for piece in pieces {
            // Each piece begins with the next peer in turn: pieces in flight together (a
            // whole file's, a reader's read-ahead after its own range) come from every
            // connected peer at once.
            let mut order = conns();
            if !order.is_empty() {
                let first = turn % order.len();
                order.rotate_left(first);
            }
            turn += 1;
            fetches.spawn(fetch_piece(
                order,
                conns.clone(),
                rt.id.clone(),
                piece,
                sink.clone(),
            ));
        }
        tokio::select! {
            _ = flight.wake.notified() => {}
            Some(done) = fetches.join_next() => {
                if let Ok(Err((asked, e))) = done {
                    let f = failure(&e);
                    tracing::info!(folder = %rt.id, %path, chunks = asked.len(), error = %e, "chunks of a file being read could not be fetched");
                    rt.demand.note(&path, &f, crate::folder::now_secs());
                    flight.failed(&asked, f);
                }
            }
        }
    }
    // Whole: the fetches left have nothing to do (a chunk is written once).
    fetches.abort_all();
    while fetches.join_next().await.is_some() {}
    let _ = copier.await;
    let Some(temp) = take(&temp) else {
        return Err(FillError::Changed(path));
    };
    let r = rt.clone();
    let mut ready = on_blocking(move || finish_all(&r, metas, vec![Some(temp)])).await?;
    let Some((_, _, temp)) = ready.pop() else {
        return Err(FillError::Changed(path));
    };
    let (f, r, p) = (folders.clone(), rt.clone(), path.clone());
    let local = on_blocking(move || Ok(install(&f, &r, &p, seen, temp))).await??;
    Ok(Streamed::Local(local))
}

fn take(temp: &Shared) -> Option<TempFile> {
    temp.lock().unwrap_or_else(|p| p.into_inner()).take()
}

/// The chunks of `record` this device holds in other files of the folder, looked up once
/// the stream's first request is out and copied into its temp file (each verified by
/// `Store::copy_chunks_in`); a chunk whose copy turns out stale is asked of a peer instead.
/// Until this ends the flight hands the network only the first read's chunks (D98).
fn copy_local(
    folders: &Folders,
    rt: &FolderRt,
    record: &meshfs_protocol::FileRecord,
    flight: &Flight,
    temp: &Shared,
) {
    let mut sources = Sources::default();
    let mut dirs = DirCache::default();
    let copies = match folders.reader() {
        Ok(mut reader) => {
            // One read transaction for every lookup: the WAL's locks are taken once.
            reader.begin_reads();
            local_copies(&reader, rt, record, &mut sources, &mut dirs).0
        }
        Err(e) => {
            tracing::info!(folder = %rt.id, path = %record.path, error = %e, "cannot look up local copies of a file being read; fetching all of it");
            Vec::new()
        }
    };
    let claimed: HashSet<Hash> = flight
        .looked(copies.iter().map(|c| c.hash))
        .into_iter()
        .collect();
    let copies: Vec<LocalCopy> = copies
        .into_iter()
        .filter(|c| claimed.contains(&c.hash))
        .collect();
    if copies.is_empty() {
        return;
    }
    let copied = {
        let mut t = temp.lock().unwrap_or_else(|p| p.into_inner());
        let Some(t) = t.as_mut() else { return };
        rt.store
            .copy_chunks_in(&mut dirs, t, &copies, &sources.held)
    };
    let stale: HashSet<Hash> = match copied {
        Ok(stale) => stale.into_iter().map(|i| copies[i].hash).collect(),
        Err(e) => {
            tracing::info!(folder = %rt.id, path = %record.path, error = %e, "cannot copy local chunks of a file being read; fetching them");
            claimed.clone()
        }
    };
    let mut bytes: HashMap<Hash, u64> = HashMap::new();
    for c in &copies {
        *bytes.entry(c.hash).or_default() += c.len as u64;
    }
    for h in &claimed {
        if stale.contains(h) {
            flight.not_local(h);
        } else {
            flight.arrived(h, bytes.get(h).copied().unwrap_or(0));
        }
    }
}

/// Fetches `piece` from `order` in turn (each asked only for what the ones before it did not
/// give), then from the links that came up meanwhile (`conns` asked again: a peer that came
/// back dials while it is dialed, and the connection of the two that loses is closed, maybe
/// under this fetch); on failure, the chunks asked and why.
async fn fetch_piece(
    order: Vec<quinn::Connection>,
    conns: Conns,
    folder: FolderId,
    piece: Vec<(Hash, u32)>,
    sink: StreamSink,
) -> Result<(), (Vec<(Hash, u32)>, FillError)> {
    let mut asked: Vec<usize> = order.iter().map(|c| c.stable_id()).collect();
    let mut next = order;
    let mut left = piece.clone();
    let mut failures: Vec<String> = Vec::new();
    let mut bad = false;
    loop {
        for conn in next {
            let why = match watched(
                &conn,
                chunks::fetch(&conn, &folder, left.clone(), sink.clone()),
            )
            .await
            {
                None => format!("its connection carried nothing for {} s", STALL.as_secs()),
                Some((Ok(absent), _)) if absent.is_empty() => return Ok(()),
                Some((Ok(absent), _)) => format!("it does not have {} of the chunks", absent.len()),
                Some((Err(FetchError::Store(e)), _)) => {
                    return Err((piece, FillError::Apply(ApplyError::from(e))))
                }
                Some((Err(e), _)) => {
                    bad |= matches!(e, FetchError::Protocol(_));
                    e.to_string()
                }
            };
            tracing::info!(%folder, peer = %conn.remote_address(), %why, "a peer could not give chunks of a file being read; asking the next");
            failures.push(why);
            left = sink.flight.not_present(&left);
            if left.is_empty() {
                return Ok(());
            }
        }
        if bad {
            break;
        }
        let fresh: Vec<quinn::Connection> = conns()
            .into_iter()
            .filter(|c| !asked.contains(&c.stable_id()))
            .collect();
        if fresh.is_empty() {
            break;
        }
        asked.extend(fresh.iter().map(|c| c.stable_id()));
        tracing::info!(%folder, links = fresh.len(), "asking the links that came up during the fetch");
        next = fresh;
    }
    if failures.is_empty() {
        return Err((piece, FillError::NoPeer));
    }
    Err((
        piece,
        FillError::NotHeld {
            why: failures.join("; "),
            bad,
        },
    ))
}

/// Writes each verified chunk into the stream's temp file, everywhere the file holds it, once,
/// then marks it present.
#[derive(Clone)]
struct StreamSink {
    rt: Arc<FolderRt>,
    flight: Arc<Flight>,
    temp: Shared,
    places: Arc<HashMap<Hash, Vec<u64>>>,
}

impl chunks::ChunkSink for StreamSink {
    fn put(&mut self, hash: Hash, data: &[u8]) -> Result<(), StoreError> {
        if !self.flight.claim(&hash) {
            return Ok(());
        }
        let at = self.places.get(&hash).map_or(&[][..], |v| v.as_slice());
        {
            let mut t = self.temp.lock().unwrap_or_else(|p| p.into_inner());
            let Some(t) = t.as_mut() else {
                return Err(StoreError::Io {
                    path: self.rt.id.to_string(),
                    source: std::io::Error::other("the stream's temp file is gone"),
                });
            };
            for &off in at {
                self.rt.store.write_temp(t, off, data)?;
            }
        }
        let bytes = (at.len() * data.len()) as u64;
        let before = self.flight.done.load(std::sync::atomic::Ordering::Relaxed);
        self.flight.arrived(&hash, bytes);
        // The disk's free floor is checked as the temp file grows, not only at its install.
        if (before + bytes) / FLOOR_CHECK != before / FLOOR_CHECK {
            self.rt.demand.arrived.notify_one();
        }
        Ok(())
    }
}
