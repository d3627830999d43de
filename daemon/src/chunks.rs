//! Chunks between peers: serving a peer's chunk requests from this device's files, fetching
//! the chunks a batch needs from a peer (many requests in flight, each chunk verified by its
//! hash and length), and attaching small new files' content to the index batch that
//! announces them. zstd where it pays ([`Packer`]).
//!
//! **Architecture invariant:** a chunk is written nowhere before its hash and length are
//! checked ([`open_chunk`]); a request is served only for a folder shared with the requester,
//! checked on every request. A chunk is served from a live file of the folder, else from the
//! folder's vault of past versions (`crate::vault`): by hash only, never as a file.

use crate::folder::{FolderRt, Folders};
use crate::journal::Op;
use crate::store::{read_served_chunk, DirCache, StoreError};
use crate::transport;
use meshfs_protocol::{
    ChunkRequest, ChunkResponse, DeviceId, ErrorCode, FileKind, FileRecord, FolderId, Hash,
    IndexBatch, Message, RelPath,
};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

mod lane;
pub use lane::serve_lane;

/// Most hashes in one chunk request.
const REQUEST_HASHES: usize = meshfs_protocol::MAX_HASHES_PER_REQUEST;
/// Most bytes asked for in one chunk request.
const REQUEST_BYTES: u64 = 4 << 20;
/// Chunk requests in flight per fetch.
const REQUESTS_IN_FLIGHT: usize = 24;

/// Chunk requests served to one peer at once (each holds a blocking reader thread).
pub(crate) const SERVED_AT_ONCE: usize = 32;
/// Most hashes a peer may ask for in one chunk request (the decoder refuses more already).
const MAX_REQUEST_HASHES: usize = meshfs_protocol::MAX_HASHES_PER_REQUEST;
/// How long one response may wait for the requester to take it.
const RESPONSE_WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a request stream may go without its request: a peer that opens streams and says
/// nothing on them would otherwise hold its [`SERVED_AT_ONCE`] places for good.
const REQUEST_WAIT: Duration = Duration::from_secs(30);
/// How long the next response of a request may take to begin: the server reads the chunk
/// from its disk first (and its journal may be busy with a scan), so more than a frame stall.
const RESPONSE_WAIT: Duration = Duration::from_secs(60);
/// Longest request frame read: a probe of `MAX_HASHES_PER_PROBE` hashes for the longest folder
/// id takes about 34 KiB (a chunk request of [`MAX_REQUEST_HASHES`], 2.1 KiB). A request stream
/// holds no more than this, whatever its header says.
const MAX_REQUEST_FRAME: usize = 40 << 10;
/// Longest response frame read: a chunk of at most `MAX_CHUNK_LEN` and its fields, or an
/// `Error` of at most `MAX_ERROR_MESSAGE_LEN`.
const MAX_RESPONSE_FRAME: usize = meshfs_protocol::MAX_CHUNK_LEN as usize + (16 << 10);

/// Largest file whose content rides inside the index batch that announces it: the largest
/// whose bytes the scan keeps for it (D113).
pub const INLINE_FILE_BYTES: u64 = crate::store::Fresh::FILE_BYTES;
/// Most inline bytes (as sent, after compression) in one index batch: with the records'
/// 2 MiB this stays well under the frame limit.
pub const INLINE_BATCH_BYTES: usize = 8 << 20;

/// Why fetching chunks from a peer failed.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// The connection or a stream failed (the peer went away, the network broke).
    #[error("chunk transfer failed: {0}")]
    Link(String),
    /// The peer answered a request with an error.
    #[error("the peer refused a chunk request: {0}")]
    Refused(String),
    /// The peer broke the protocol: an answer out of order, a chunk that fails its hash or
    /// its length (a faulty or hostile peer).
    #[error("the peer sent a bad chunk response: {0}")]
    Protocol(String),
    /// A verified chunk could not be written here.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Why serving a peer's chunk request stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The stream failed or the requester stopped reading.
    #[error("chunk request stream failed: {0}")]
    Link(String),
    /// The request was refused (not shared, too many hashes, not a request).
    #[error("refused: {0}")]
    Refused(String),
}

/// Answers one chunk request stream, checking on every request that the folder is shared with
/// the requester.
/// `shared`: the folders shared with `peer` now.
pub async fn serve_request(
    folders: &Arc<Folders>,
    peer: DeviceId,
    shared: &[FolderId],
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
) -> Result<(), ServeError> {
    let (req, rt) = match read_request(folders, peer, shared, &mut send, &mut recv).await? {
        (Asked::Chunks(req), rt) => (req, rt),
        (Asked::Probe(probe), rt) => return answer_probe(folders, rt, probe, send).await,
    };
    // Reading is blocking work (journal, files, zstd): a blocking thread reads the chunks in
    // order and hands each response to this task, at most a few ahead of the stream.
    let (tx, mut rx) = mpsc::channel::<ChunkResponse>(4);
    let folders = folders.clone();
    let reader = tokio::task::spawn_blocking(move || {
        read_chunks(&folders, &rt, req, |r| tx.blocking_send(r).is_ok())
    });
    while let Some(resp) = rx.recv().await {
        // A requester that stops reading frees its reader after a while (dropping `rx`
        // ends the blocking thread's sends).
        tokio::time::timeout(
            RESPONSE_WRITE_TIMEOUT,
            transport::write_response(&mut send, resp),
        )
        .await
        .map_err(|_| ServeError::Link("the requester stopped reading".into()))?
        .map_err(|e| ServeError::Link(e.to_string()))?;
    }
    reader.await.map_err(|e| ServeError::Link(e.to_string()))?;
    let _ = send.finish();
    Ok(())
}

/// What a request stream asks.
enum Asked {
    /// Chunks, with their data.
    Chunks(ChunkRequest),
    /// Whether chunks are held (protocol 10).
    Probe(meshfs_protocol::Probe),
}

/// For each of `hashes` (chunks of `rt`'s folder), whether this device would answer a chunk
/// request for it with data now: a located chunk of a file whose content is local, or the
/// vault's. Blocking (the journal).
pub fn held_here(folders: &Folders, rt: &FolderRt, hashes: &[Hash]) -> Vec<bool> {
    let located = match folders.journal_lock() {
        Ok(mut j) => j.find_chunks(&rt.id, hashes),
        Err(_) => Vec::new(),
    };
    let kept = rt
        .vault()
        .and_then(|v| v.has(hashes).ok())
        .unwrap_or_default();
    (0..hashes.len())
        .map(|i| {
            located.get(i).is_some_and(|l| !l.is_empty()) || kept.get(i).copied().unwrap_or(false)
        })
        .collect()
}

/// Answers a probe: for each hash, whether a chunk request for it would be answered with data
/// now (a located chunk of a file whose content is local, or the vault's), without reading it.
async fn answer_probe(
    folders: &Arc<Folders>,
    rt: Arc<FolderRt>,
    probe: meshfs_protocol::Probe,
    mut send: quinn::SendStream,
) -> Result<(), ServeError> {
    let folders = folders.clone();
    let held = tokio::task::spawn_blocking(move || held_here(&folders, &rt, &probe.hashes))
        .await
        .map_err(|e| ServeError::Link(e.to_string()))?;
    tokio::time::timeout(
        RESPONSE_WRITE_TIMEOUT,
        transport::write_message(&mut send, &Message::Held(meshfs_protocol::Held { held })),
    )
    .await
    .map_err(|_| ServeError::Link("the requester stopped reading".into()))?
    .map_err(|e| ServeError::Link(e.to_string()))?;
    let _ = send.finish();
    Ok(())
}

/// Asks `conn`'s device which of `hashes` (chunks of `folder`, at most
/// `MAX_HASHES_PER_PROBE`) it holds (D101): one flag per hash, in order.
pub async fn probe(
    conn: &quinn::Connection,
    folder: &FolderId,
    hashes: Vec<Hash>,
) -> Result<Vec<bool>, FetchError> {
    let link = |e: &dyn std::fmt::Display| FetchError::Link(e.to_string());
    let n = hashes.len();
    let (mut send, mut recv) = conn.open_bi().await.map_err(|e| link(&e))?;
    let msg = Message::Probe(meshfs_protocol::Probe {
        folder: folder.clone(),
        hashes,
    });
    transport::write_message(&mut send, &msg)
        .await
        .map_err(|e| link(&e))?;
    let _ = send.finish();
    match transport::read_message_within(&mut recv, RESPONSE_WAIT, MAX_REQUEST_FRAME)
        .await
        .map_err(|e| link(&e))?
    {
        Some(Message::Held(h)) if h.held.len() == n => Ok(h.held),
        Some(Message::Error { message, .. }) => Err(FetchError::Refused(message)),
        Some(_) => Err(FetchError::Protocol("not an answer to a probe".into())),
        None => Err(FetchError::Link("probe stream ended early".into())),
    }
}

/// Reads a stream's request and checks it ([`check_request`]). A refusal is answered on the
/// stream with an `Error` before it is returned.
async fn read_request(
    folders: &Folders,
    peer: DeviceId,
    shared: &[FolderId],
    send: &mut quinn::SendStream,
    recv: &mut quinn::RecvStream,
) -> Result<(Asked, Arc<FolderRt>), ServeError> {
    let asked = match transport::read_message_within(recv, REQUEST_WAIT, MAX_REQUEST_FRAME)
        .await
        .map_err(|e| ServeError::Link(e.to_string()))?
    {
        Some(Message::Request(r)) => Asked::Chunks(r),
        Some(Message::Probe(p)) => Asked::Probe(p),
        Some(_) | None => {
            refuse(send, ErrorCode::BadFrame, "expected a chunk request".into()).await;
            return Err(ServeError::Refused(
                "request stream without a request".into(),
            ));
        }
    };
    match check_request(folders, peer, shared, &asked) {
        Ok(rt) => Ok((asked, rt)),
        Err((told, e)) => {
            if let Some((code, told)) = told {
                refuse(send, code, told).await;
            }
            Err(e)
        }
    }
}

/// What a refused request is told (if anything) and why it was refused.
type Refusal = (Option<(ErrorCode, String)>, ServeError);

/// Checks a request: a chunk request or a probe, for a folder shared with `peer` and running
/// here, of at most [`MAX_REQUEST_HASHES`] hashes (a chunk request).
fn check_request(
    folders: &Folders,
    peer: DeviceId,
    shared: &[FolderId],
    asked: &Asked,
) -> Result<Arc<FolderRt>, Refusal> {
    let (folder, hashes) = match asked {
        Asked::Chunks(r) => (&r.folder, r.hashes.len()),
        Asked::Probe(p) => (&p.folder, 0),
    };
    if !shared.contains(folder) {
        let told = format!("folder {folder} is not shared with you");
        return Err((
            Some((ErrorCode::NotShared, told)),
            ServeError::Refused(format!(
                "peer {} asked for unshared folder {folder}",
                peer.short(),
            )),
        ));
    }
    let Some(rt) = folders.get(folder) else {
        return Err((
            None,
            ServeError::Refused(format!("folder {folder} not running")),
        ));
    };
    if hashes > MAX_REQUEST_HASHES {
        let told = format!("{hashes} hashes in one request; at most {MAX_REQUEST_HASHES}");
        return Err((
            Some((ErrorCode::BadFrame, told)),
            ServeError::Refused(format!(
                "peer {} asked for {hashes} chunks in one request",
                peer.short(),
            )),
        ));
    }
    Ok(rt)
}

/// Tells the requester why its request is refused (best effort: the stream ends anyway).
async fn refuse(send: &mut quinn::SendStream, code: ErrorCode, message: String) {
    let _ = transport::write_message(send, &Message::Error { code, message }).await;
}

/// The blocking half of serving a request: reads each requested chunk (`None` where this
/// device no longer has it), packs it and hands it to `emit`, in order, until done or until
/// `emit` says the stream's task stopped taking them.
fn read_chunks(
    folders: &Folders,
    rt: &FolderRt,
    req: ChunkRequest,
    mut emit: impl FnMut(ChunkResponse) -> bool,
) {
    let mut dirs = DirCache::default();
    let mut packer = Packer::default();
    // Every location at once, under one lock of the journal; the chunks of a request mostly
    // come from one file, read through one descriptor.
    let located = match folders.journal_lock() {
        Ok(mut j) => j.find_chunks(&req.folder, &req.hashes),
        Err(_) => Vec::new(),
    };
    let mut located = located.into_iter();
    let mut open: Option<(RelPath, std::fs::File)> = None;
    for hash in req.hashes {
        let locs = located.next().unwrap_or_default();
        let data = locs.into_iter().find_map(|l| {
            if open.as_ref().is_none_or(|(p, _)| p != &l.path) {
                open = None;
                open = Some((
                    l.path.clone(),
                    rt.store.open_file_in(&mut dirs, &l.path).ok()?,
                ));
            }
            let (_, f) = open.as_ref()?;
            read_served_chunk(f, &l.path, l.offset, l.len, &hash, l.local.as_ref()).ok()
        });
        // Not in a live file: a past version this device keeps may hold it (`restore` on a
        // peer that applied no deletion asks for just that).
        let data = data.or_else(|| rt.vault().and_then(|v| v.get(&hash).ok().flatten()));
        let resp = match data {
            Some(d) => {
                let (data, compressed) = packer.pack(d);
                ChunkResponse {
                    hash,
                    data: Some(data),
                    compressed,
                }
            }
            None => ChunkResponse {
                hash,
                data: None,
                compressed: false,
            },
        };
        if !emit(resp) {
            return;
        }
    }
}

/// A chunk response as it arrived: not yet decompressed nor checked.
struct Arrived {
    hash: Hash,
    /// The length the record's chunk list gives it.
    len: u32,
    /// `None`: the peer no longer has it.
    data: Option<Vec<u8>>,
    compressed: bool,
}

/// One chunk response as it arrived, or why its request failed.
type FetchItem = Result<Arrived, FetchError>;

/// zstd when it saves at least an eighth; raw otherwise. A chunk over 16 KiB is first judged
/// by compressing 4 KiB from its middle: zstd gives up on incompressible input without
/// finding matches, but it still reads, histograms and copies every block, which was a tenth
/// of a sending daemon's CPU on already-compressed data (`perf`, 1.9 GB of mixed files).
/// Compression over one stream of chunks (a batch's inline contents, a request's responses)
/// that stops trying where it does not pay: after [`Packer::GIVE_UP`] chunks in a row that
/// zstd could not shrink (a tree of photos, archives, random data), only every
/// [`Packer::PROBE`]th chunk is tried, and one that pays turns it back on. For 4 KiB files zstd
/// cost a fifth of a sending daemon's CPU, to find out there was nothing to save.
#[derive(Default)]
pub(crate) struct Packer {
    misses: u32,
    skipped: u32,
}

impl Packer {
    const GIVE_UP: u32 = 8;
    const PROBE: u32 = 16;

    pub(crate) fn pack(&mut self, d: Vec<u8>) -> (Vec<u8>, bool) {
        if self.misses >= Self::GIVE_UP && self.skipped + 1 < Self::PROBE {
            self.skipped += 1;
            return (d, false);
        }
        self.skipped = 0;
        let (out, packed) = compress(d);
        if packed {
            self.misses = 0;
        } else {
            self.misses += 1;
        }
        (out, packed)
    }
}

fn compress(d: Vec<u8>) -> (Vec<u8>, bool) {
    thread_local! {
        // A compression context per thread: creating one per chunk cost more than
        // compressing a 4 KiB chunk.
        static ZSTD: std::cell::RefCell<Option<zstd::bulk::Compressor<'static>>> =
            std::cell::RefCell::new(zstd::bulk::Compressor::new(1).ok());
    }
    const SAMPLE: usize = 4096;
    let pays = |data: &[u8], need: usize| {
        ZSTD.with(|z| {
            let mut z = z.borrow_mut();
            let c = z.as_mut()?.compress(data).ok()?;
            (c.len() + need <= data.len()).then_some(c)
        })
    };
    if d.len() > 4 * SAMPLE {
        let mid = d.len() / 2 - SAMPLE / 2;
        // The sample must save a sixteenth: looser than the whole chunk's eighth, so a chunk
        // that would just pay is not turned away by its sample.
        if pays(&d[mid..mid + SAMPLE], SAMPLE / 16).is_none() {
            return (d, false);
        }
    }
    if d.len() >= 512 {
        if let Some(c) = pays(&d, d.len() / 8) {
            return (c, true);
        }
    }
    (d, false)
}

/// A chunk as it came from a peer (`compressed`: a zstd frame), decompressed and verified
/// against `hash`.
pub(crate) fn open_chunk(
    hash: &Hash,
    data: Vec<u8>,
    compressed: bool,
) -> Result<Vec<u8>, FetchError> {
    let data = if compressed {
        zstd::bulk::decompress(&data, meshfs_protocol::MAX_CHUNK_LEN as usize)
            .map_err(|e| FetchError::Protocol(format!("bad zstd chunk: {e}")))?
    } else {
        data
    };
    if &Hash::of(&data) != hash {
        return Err(FetchError::Protocol(format!(
            "chunk {} failed verification",
            hash.short()
        )));
    }
    Ok(data)
}

/// Where fetched chunks go: given each chunk once it is verified, on a blocking thread.
pub trait ChunkSink: Send + 'static {
    /// Writes the verified chunk `data` of `hash` wherever this fetch needs it.
    fn put(&mut self, hash: Hash, data: &[u8]) -> Result<(), StoreError>;
}

/// Fetches chunks of `folder` from `conn`, many requests in flight, and hands each verified
/// chunk to `sink`. Returns the hashes the peer did not have (or why the fetch failed) and the
/// sink, whatever happened, for its owner to finish or clean up.
///
/// The runtime's tasks only move bytes: each request's task reads its responses off the
/// stream, and one blocking thread decompresses, verifies and writes them. Verifying and
/// writing a 1 MiB chunk takes ~0.5 ms; done on the runtime's workers, it kept them from
/// the connection's packets, and the socket's receive buffer overflowed (10,625 packets lost
/// of one 512 MiB file on loopback, the sender's RTT estimate at 30 ms).
pub async fn fetch<S: ChunkSink>(
    conn: &quinn::Connection,
    folder: &FolderId,
    wanted: Vec<(Hash, u32)>,
    sink: S,
) -> (Result<Vec<Hash>, FetchError>, S) {
    let mut groups: Vec<Vec<(Hash, u32)>> = Vec::new();
    let mut cur: Vec<(Hash, u32)> = Vec::new();
    let mut bytes = 0u64;
    let mut total = 0u64;
    for (h, len) in wanted {
        if !cur.is_empty() && (cur.len() >= REQUEST_HASHES || bytes + len as u64 > REQUEST_BYTES) {
            groups.push(std::mem::take(&mut cur));
            bytes = 0;
        }
        bytes += len as u64;
        total += len as u64;
        cur.push((h, len));
    }
    if !cur.is_empty() {
        groups.push(cur);
    }
    // Bounded: a writer slower than the link holds the requests back, not memory.
    let (tx, rx) = mpsc::channel::<FetchItem>(32);
    // A large fetch on a short path goes over the session's bulk lane when it is free (D105);
    // what the lane could not carry goes on QUIC request streams.
    let (conn, folder, sender) = (conn.clone(), folder.clone(), tx.clone());
    tokio::spawn(async move {
        let rest = match crate::bulk::lane_for(&conn, total).await {
            Some(lane) => lane::over_lane(lane, &folder, groups, &sender).await,
            None => groups,
        };
        request_groups(&conn, &folder, rest, &sender);
    });
    drop(tx);
    // Dropped with this future (an apply given up): the writer stops at its next chunk.
    let stop = StopOnDrop(Arc::new(std::sync::atomic::AtomicBool::new(false)));
    let stopped = stop.0.clone();
    let writer = tokio::task::spawn_blocking(move || write_arrivals(rx, sink, &stopped));
    let out = writer.await;
    drop(stop);
    match out {
        Ok(done) => done,
        // The writer panicked: the sink went with it.
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

/// Asks `conn` for each of `groups` on a request stream of its own, [`REQUESTS_IN_FLIGHT`] at
/// once, each chunk's response (or the failure of its request) sent to `tx`.
fn request_groups(
    conn: &quinn::Connection,
    folder: &FolderId,
    groups: Vec<Vec<(Hash, u32)>>,
    tx: &mpsc::Sender<FetchItem>,
) {
    let sem = Arc::new(tokio::sync::Semaphore::new(REQUESTS_IN_FLIGHT));
    for g in groups {
        let conn = conn.clone();
        let folder = folder.clone();
        let tx = tx.clone();
        let sem = sem.clone();
        tokio::spawn(async move {
            let Ok(_permit) = sem.acquire_owned().await else {
                return;
            };
            if let Err(e) = request_group(&conn, folder, g, &tx).await {
                let _ = tx.send(Err(e)).await;
            }
        });
    }
}

/// Sets its flag when dropped.
struct StopOnDrop(Arc<std::sync::atomic::AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The blocking half of [`fetch`]: opens, checks and writes each arrived chunk in turn, until
/// every request is done, one fails, or `stopped` is set.
fn write_arrivals<S: ChunkSink>(
    mut rx: mpsc::Receiver<FetchItem>,
    mut sink: S,
    stopped: &std::sync::atomic::AtomicBool,
) -> (Result<Vec<Hash>, FetchError>, S) {
    let mut missing = Vec::new();
    let mut one = |item: FetchItem, sink: &mut S| -> Result<(), FetchError> {
        let a = item?;
        let Some(data) = a.data else {
            missing.push(a.hash);
            return Ok(());
        };
        let data = open_chunk(&a.hash, data, a.compressed)?;
        // The hash proves the bytes; the record's chunk list also states their length, and a
        // chunk of another length would shift every byte after it in the file.
        if data.len() != a.len as usize {
            return Err(FetchError::Protocol(format!(
                "chunk {} is {} bytes where its record says {}",
                a.hash.short(),
                data.len(),
                a.len
            )));
        }
        sink.put(a.hash, &data)?;
        Ok(())
    };
    while let Some(item) = rx.blocking_recv() {
        if stopped.load(std::sync::atomic::Ordering::Relaxed) {
            return (Err(FetchError::Link("the fetch was given up".into())), sink);
        }
        if let Err(e) = one(item, &mut sink) {
            return (Err(e), sink);
        }
    }
    (Ok(missing), sink)
}

async fn request_group(
    conn: &quinn::Connection,
    folder: FolderId,
    wanted: Vec<(Hash, u32)>,
    tx: &mpsc::Sender<FetchItem>,
) -> Result<(), FetchError> {
    let link = |e: &dyn std::fmt::Display| FetchError::Link(e.to_string());
    let (mut send, mut recv) = conn.open_bi().await.map_err(|e| link(&e))?;
    let hashes: Vec<Hash> = wanted.iter().map(|w| w.0).collect();
    let n = hashes.len();
    transport::write_message(
        &mut send,
        &Message::Request(ChunkRequest {
            folder,
            hashes: hashes.clone(),
        }),
    )
    .await
    .map_err(|e| link(&e))?;
    let _ = send.finish();
    for &(want, want_len) in wanted.iter().take(n) {
        // A peer that never answers, or stalls in a response, fails the request (and with it
        // the batch) instead of holding it for good.
        let msg =
            transport::read_response_within(&mut recv, RESPONSE_WAIT, MAX_RESPONSE_FRAME, want)
                .await
                .map_err(|e| link(&e))?;
        if tx.send(Ok(arrived(msg, want, want_len)?)).await.is_err() {
            return Ok(());
        }
    }
    Ok(())
}

/// The answer `msg` to a request for the chunk `want` of length `want_len`, as it arrived; an
/// error for anything but a response for that chunk.
fn arrived(msg: Option<Message>, want: Hash, want_len: u32) -> Result<Arrived, FetchError> {
    let resp = match msg {
        Some(Message::Response(r)) => r,
        Some(Message::Error { message, .. }) => return Err(FetchError::Refused(message)),
        Some(_) => {
            return Err(FetchError::Protocol(
                "a message other than a response on a chunk stream".into(),
            ))
        }
        None => return Err(FetchError::Link("chunk stream ended early".into())),
    };
    if resp.hash != want {
        return Err(FetchError::Protocol("chunk responses out of order".into()));
    }
    Ok(Arrived {
        hash: resp.hash,
        len: want_len,
        data: resp.data,
        compressed: resp.compressed,
    })
}

/// Which records of an outgoing index batch may carry their content ([`attach_inline`]).
pub(crate) struct Inline {
    /// Only records above this sequence (`Session::inline_after`).
    pub(crate) after: u64,
    /// Records made by a device the peer hears from directly, to leave out even above it
    /// (`Session::peer_hears`): that device sends the peer their content itself.
    pub(crate) relayed: std::collections::HashSet<meshfs_protocol::ShortId>,
}

impl Inline {
    /// Nothing inline.
    pub(crate) fn none() -> Inline {
        Inline {
            after: u64::MAX,
            relayed: Default::default(),
        }
    }
}

/// Attaches to `batch` the content of its small files journaled after sequence `inline.after`:
/// files of one chunk whose hash is the file's, up to [`INLINE_FILE_BYTES`] each and
/// [`INLINE_BATCH_BYTES`] in all, compressed as in responses, if journaled as a creation or a
/// modification, and not made by a device in `inline.relayed` (one the peer hears from
/// directly, which sends the peer that content itself).
/// Read as of now: a file changed since it was journaled fails its hash and is left out (the
/// receiver asks, as for any chunk).
pub(crate) fn attach_inline(folders: &Folders, batch: &mut IndexBatch, inline: &Inline) {
    let Some(rt) = folders.get(&batch.folder) else {
        return;
    };
    let candidates: Vec<&FileRecord> = batch
        .records
        .iter()
        .filter(|r| {
            r.sequence > inline.after
                && !r.deleted
                && r.kind == FileKind::File
                && r.size <= INLINE_FILE_BYTES
                && r.chunks.len() == 1
                && !inline.relayed.contains(&r.modified_by)
        })
        .collect();
    if candidates.is_empty() {
        return;
    }
    let sequences: Vec<u64> = candidates.iter().map(|r| r.sequence).collect();
    // Only content that is new at its path: a rename's content is on the peer under the old
    // name, a metadata change or a resolution (e.g. two devices that scanned the same tree
    // merging their versions) keeps content the peer sent or has. No history left (pruned):
    // an old file, attached like a creation.
    let ops = match folders.journal_lock() {
        Ok(j) => j.ops_of(&batch.folder, &sequences).unwrap_or_default(),
        Err(_) => return,
    };
    let mut dirs = DirCache::default();
    let mut seen = HashSet::new();
    let mut bytes = 0usize;
    let mut packer = Packer::default();
    for r in candidates {
        let fresh = ops
            .get(&r.sequence)
            .is_none_or(|op| matches!(op, Op::Create | Op::Modify));
        if !fresh || !seen.insert(r.hash) {
            tracing::debug!(path = %r.path, sequence = r.sequence, op = ?ops.get(&r.sequence), by = %r.modified_by, "not inline: not new or a duplicate");
            continue;
        }
        // What the scan read to hash it, if it kept it (D113); else read again.
        let read = match rt.store.fresh().take(&r.hash) {
            Some(kept) => Ok(kept),
            None => rt
                .store
                .read_chunk_in(&mut dirs, &r.path, 0, r.size as u32, &r.hash),
        };
        let d = match read {
            Ok(d) => d,
            Err(e) => {
                tracing::debug!(path = %r.path, sequence = r.sequence, error = %e, "not inline: unreadable");
                continue;
            }
        };
        let (data, compressed) = packer.pack(d);
        bytes += data.len();
        if bytes > INLINE_BATCH_BYTES {
            break;
        }
        batch.inline.push(ChunkResponse {
            hash: r.hash,
            data: Some(data),
            compressed,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_request_and_response_fit_the_frames_read_for_them() {
        let folder = FolderId::new(&"f".repeat(64)).unwrap();
        let request = Message::Request(ChunkRequest {
            folder,
            hashes: vec![Hash::ZERO; MAX_REQUEST_HASHES],
        });
        let len = meshfs_protocol::encode_frame(&request).unwrap().len();
        assert!(len <= MAX_REQUEST_FRAME, "{len}");
        let response = Message::Response(ChunkResponse {
            hash: Hash::ZERO,
            data: Some(vec![0; meshfs_protocol::MAX_CHUNK_LEN as usize]),
            compressed: true,
        });
        let len = meshfs_protocol::encode_frame(&response).unwrap().len();
        assert!(len <= MAX_RESPONSE_FRAME, "{len}");
        let error = Message::Error {
            code: ErrorCode::NotShared,
            message: "e".repeat(meshfs_protocol::MAX_ERROR_MESSAGE_LEN),
        };
        let len = meshfs_protocol::encode_frame(&error).unwrap().len();
        assert!(
            len <= MAX_RESPONSE_FRAME.min(MAX_REQUEST_FRAME * 2),
            "{len}"
        );
    }

    fn noise(n: usize) -> Vec<u8> {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    #[test]
    fn a_stream_of_incompressible_chunks_stops_trying_until_one_pays() {
        let text = b"meshfs keeps a folder identical on every device. ".repeat(100);
        let mut p = Packer::default();
        let packed: Vec<bool> = (0..64).map(|_| p.pack(noise(4096)).1).collect();
        assert!(!packed.iter().any(|&b| b));
        assert_eq!(
            p.misses,
            Packer::GIVE_UP + 56 / Packer::PROBE,
            "tried only every 16th"
        );
        // Compressible content again: found at the next probe, then every chunk is tried.
        let mut first = None;
        for i in 0..Packer::PROBE {
            let (sent, packed) = p.pack(text.clone());
            if packed {
                assert_eq!(open_chunk(&Hash::of(&text), sent, true).unwrap(), text);
                first = Some(i);
                break;
            }
        }
        assert!(first.is_some(), "a probe within 16 chunks");
        assert!((0..4).all(|_| p.pack(text.clone()).1));
    }

    #[test]
    fn compression_is_used_only_where_it_pays_and_round_trips() {
        let text: Vec<u8> = b"meshfs keeps a folder identical on every device. "
            .iter()
            .copied()
            .cycle()
            .take(1 << 20)
            .collect();
        for (data, want_packed) in [
            (text.clone(), true),
            (text[..4096].to_vec(), true),
            (noise(1 << 20), false),
            (noise(4096), false),
            (b"tiny".to_vec(), false),
        ] {
            let hash = Hash::of(&data);
            let (sent, packed) = compress(data.clone());
            assert_eq!(packed, want_packed, "{} bytes", data.len());
            assert_eq!(open_chunk(&hash, sent, packed).unwrap(), data);
        }
    }

    #[test]
    fn an_attached_chunk_that_does_not_match_its_hash_is_refused() {
        let data = b"the real content".to_vec();
        let hash = Hash::of(&data);
        assert!(open_chunk(&hash, b"something else".to_vec(), false).is_err());
        assert!(open_chunk(&hash, b"not zstd".to_vec(), true).is_err());
        assert_eq!(open_chunk(&hash, data.clone(), false).unwrap(), data);
    }
}
