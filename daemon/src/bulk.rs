//! The bulk lane as the daemon uses it (D105): a fetch of at least [`LANE_MIN_BYTES`] on a
//! path shorter than [`LANE_MAX_RTT`] sends its chunk requests over the session's TCP lane
//! (`transport::lane`) instead of QUIC request streams, and the peer answers them there.
//!
//! Each device dials its own lane to each peer it fetches from, at the start of the session
//! ([`register`]); a lane carries one fetch at a time (another fetch meanwhile takes QUIC), and
//! whatever a lane could not carry (it broke, its port is closed, the dial failed) goes on QUIC
//! request streams as every fetch did before it. A failed lane is dialed again after
//! [`LANE_RETRY`].
//!
//! **Architecture invariant:** a lane carries only what a QUIC request stream would, checked
//! the same way: requests for folders shared with the device the lane is bound to (checked on
//! every request), responses verified by hash and length before anything is written
//! (`chunks::open_chunk`). A lane is bound to one live QUIC connection and ends with it.

use crate::chunks::{self, Asked, FetchError, FetchItem};
use crate::folder::Folders;
use crate::transport::{self, LaneStream};
use meshfs_protocol::{ChunkRequest, ChunkResponse, DeviceId, ErrorCode, FolderId, Hash, Message};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;

/// A fetch takes the lane only if it asks at least this many bytes: below, QUIC's parallel
/// streams were as fast (`bench/README.md`, small files).
pub const LANE_MIN_BYTES: u64 = 1 << 20;
/// A fetch takes the lane only if the connection's minimum RTT (the path's length, not its
/// load) is below this: over 90 ms QUIC was faster (its congestion control,
/// `transport::congestion`, holds a long path full).
pub const LANE_MAX_RTT: Duration = Duration::from_millis(5);
/// After a lane failed, how long fetches go on QUIC before it is dialed again.
pub const LANE_RETRY: Duration = Duration::from_secs(60);
/// Chunk requests written on a lane ahead of the one being answered.
const LANE_AHEAD: usize = 8;

/// One session's lane to its peer.
pub struct Lane {
    endpoint: quinn::Endpoint,
    conn: quinn::Connection,
    peer: DeviceId,
    state: Arc<tokio::sync::Mutex<State>>,
    /// Set while a dial holds `state`: a fetch then waits for it instead of taking QUIC.
    dialing: AtomicBool,
}

enum State {
    /// Not dialed, or its last fetch was given up in the middle (the stream went with it).
    Idle,
    Up(LaneStream),
    /// Failed: dialed again after this instant.
    Down(Instant),
}

/// What `status` shows of this device's lanes to a peer: the state of its current lane, and
/// what its lanes carried since the daemon started (a connection that replaces another, as
/// when both devices dialed, takes a lane of its own).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LaneFigures {
    /// Bound and idle, or carrying a fetch.
    pub up: bool,
    /// Why it is not up, when it failed.
    pub down: Option<String>,
    /// Fetches they carried whole, and their bytes (as the records count them).
    pub fetches: u64,
    /// See [`LaneFigures::fetches`].
    pub bytes: u64,
}

fn lanes() -> &'static Mutex<HashMap<usize, Arc<Lane>>> {
    static LANES: OnceLock<Mutex<HashMap<usize, Arc<Lane>>>> = OnceLock::new();
    LANES.get_or_init(Default::default)
}

/// The lane of `conn` while its session runs; dropping it drops the lane.
pub struct Registered(usize);

impl Drop for Registered {
    fn drop(&mut self) {
        lanes()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.0);
    }
}

/// Gives `conn` (to `peer`, made by `endpoint`) a lane for its session, and dials it now when
/// the path is short, so that the session's first large fetch finds it up.
pub fn register(
    endpoint: &quinn::Endpoint,
    conn: &quinn::Connection,
    peer: DeviceId,
) -> Registered {
    let lane = Arc::new(Lane {
        endpoint: endpoint.clone(),
        conn: conn.clone(),
        peer,
        state: Arc::new(tokio::sync::Mutex::new(State::Idle)),
        dialing: AtomicBool::new(false),
    });
    let id = conn.stable_id();
    let short = short_path(conn);
    // Said before the dial holds the lane: a fetch meanwhile waits for it.
    lane.dialing.store(short, Ordering::Relaxed);
    let rtt = conn.stats().path.min_rtt;
    lane.show(|f| {
        f.up = false;
        f.down = (!short).then(|| {
            format!(
                "not used on this path: its round trip is {:.1} ms, the lane is for paths under {} ms",
                rtt.as_secs_f64() * 1e3,
                LANE_MAX_RTT.as_millis()
            )
        });
    });
    lanes()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(id, lane.clone());
    if short {
        tokio::spawn(async move {
            if let Ok(mut state) = lane.state.clone().try_lock_owned() {
                lane.ready(&mut state).await;
            }
        });
    }
    Registered(id)
}

fn shown() -> &'static Mutex<HashMap<DeviceId, LaneFigures>> {
    static SHOWN: OnceLock<Mutex<HashMap<DeviceId, LaneFigures>>> = OnceLock::new();
    SHOWN.get_or_init(Default::default)
}

/// What `status` shows of this device's lanes to `peer`: `None` before the first session with
/// it registered one.
pub fn figures(peer: &DeviceId) -> Option<LaneFigures> {
    shown()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(peer)
        .cloned()
}

/// The lane a fetch of `bytes` from `conn` takes, held for it: `None` to take QUIC (a small
/// fetch, a long path, no lane, a lane busy with another fetch or down).
pub(crate) async fn lane_for(conn: &quinn::Connection, bytes: u64) -> Option<Turn> {
    if bytes < LANE_MIN_BYTES || !short_path(conn) {
        return None;
    }
    let lane = lanes()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&conn.stable_id())
        .cloned();
    tracing::debug!(bytes, registered = lane.is_some(), "a large fetch on a short path");
    let lane = lane?;
    let mut state = match lane.state.clone().try_lock_owned() {
        Ok(state) => state,
        Err(_) if lane.dialing.load(Ordering::Relaxed) => lane.state.clone().lock_owned().await,
        Err(_) => return None,
    };
    lane.ready(&mut state).await.then_some(Turn { lane, state })
}

/// Whether `conn`'s path is short enough for the lane ([`LANE_MAX_RTT`]).
fn short_path(conn: &quinn::Connection) -> bool {
    conn.stats().path.min_rtt < LANE_MAX_RTT
}

/// A lane held by one fetch.
pub(crate) struct Turn {
    lane: Arc<Lane>,
    state: tokio::sync::OwnedMutexGuard<State>,
}

impl Lane {
    /// Whether the lane is up, dialing it first if it is idle or its retry time has come.
    async fn ready(&self, state: &mut State) -> bool {
        match state {
            State::Up(_) => return true,
            State::Down(until) if Instant::now() < *until => return false,
            State::Idle | State::Down(_) => {}
        }
        self.dialing.store(true, Ordering::Relaxed);
        let dialed = transport::dial_lane(&self.endpoint, &self.conn, self.peer).await;
        self.dialing.store(false, Ordering::Relaxed);
        match dialed {
            Ok(stream) => {
                tracing::debug!(peer = %self.peer.short(), "bulk lane bound");
                *state = State::Up(stream);
                self.show(|f| {
                    f.up = true;
                    f.down = None;
                });
                true
            }
            Err(e) => {
                self.failed(state, e.to_string());
                false
            }
        }
    }

    fn failed(&self, state: &mut State, why: String) {
        tracing::info!(peer = %self.peer.short(), %why, "bulk lane down; large fetches take QUIC streams until it is dialed again");
        *state = State::Down(Instant::now() + LANE_RETRY);
        self.show(|f| {
            f.up = false;
            f.down = Some(why);
        });
    }

    fn show(&self, change: impl FnOnce(&mut LaneFigures)) {
        change(
            shown()
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .entry(self.peer)
                .or_default(),
        );
    }
}

/// Asks for `groups` (each one chunk request's worth) of `folder` over the held lane, several
/// requests written ahead of the one being answered, each chunk's response sent to `tx` as on a
/// QUIC request stream. Returns what the lane did not carry because it failed (for QUIC
/// streams); a refusal or a bad response is sent to `tx` and ends the fetch as on QUIC.
pub(crate) async fn over_lane(
    mut turn: Turn,
    folder: &FolderId,
    groups: Vec<Vec<(Hash, u32)>>,
    tx: &mpsc::Sender<FetchItem>,
) -> Vec<Vec<(Hash, u32)>> {
    let State::Up(stream) = std::mem::replace(&mut *turn.state, State::Idle) else {
        return groups;
    };
    let (mut rd, mut wr) = tokio::io::split(stream);
    let ahead = tokio::sync::Semaphore::new(LANE_AHEAD);
    // Where the answers are: the group being read and the chunk in it.
    let (at_group, at_chunk) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let requests = async {
        for g in &groups {
            ahead.acquire().await.map_err(|e| e.to_string())?.forget();
            let req = Message::Request(ChunkRequest {
                folder: folder.clone(),
                hashes: g.iter().map(|w| w.0).collect(),
            });
            transport::write_message(&mut wr, &req)
                .await
                .map_err(|e| e.to_string())?;
            wr.flush().await.map_err(|e| e.to_string())?;
        }
        // All asked: the answers decide the end.
        std::future::pending::<Result<(), String>>().await
    };
    let answers = async {
        for (i, g) in groups.iter().enumerate() {
            at_group.store(i, Ordering::Relaxed);
            for (j, &(want, want_len)) in g.iter().enumerate() {
                at_chunk.store(j, Ordering::Relaxed);
                let msg = transport::read_response_within(
                    &mut rd,
                    chunks::RESPONSE_WAIT,
                    chunks::MAX_RESPONSE_FRAME,
                    want,
                )
                .await
                .map_err(|e| Ended::Lane(e.to_string()))?;
                match chunks::arrived(msg, want, want_len) {
                    Ok(a) => tx.send(Ok(a)).await.map_err(|_| Ended::GivenUp)?,
                    Err(FetchError::Link(why)) => return Err(Ended::Lane(why)),
                    Err(e) => {
                        let _ = tx.send(Err(e)).await;
                        return Err(Ended::GivenUp);
                    }
                }
            }
            ahead.add_permits(1);
        }
        Ok(())
    };
    let ended = tokio::select! {
        ended = answers => ended,
        Err(why) = requests => Err(Ended::Lane(why)),
    };
    match ended {
        Ok(()) => {
            let bytes = groups.iter().flatten().map(|w| w.1 as u64).sum::<u64>();
            turn.lane.show(|f| {
                f.fetches += 1;
                f.bytes += bytes;
            });
            *turn.state = State::Up(rd.unsplit(wr));
            Vec::new()
        }
        // Nothing more is wanted (the fetch failed or was given up): the lane, in the middle
        // of a request, goes with it; the next fetch dials again.
        Err(Ended::GivenUp) => Vec::new(),
        Err(Ended::Lane(why)) => {
            turn.lane.failed(&mut turn.state, why);
            let (i, j) = (
                at_group.load(Ordering::Relaxed),
                at_chunk.load(Ordering::Relaxed),
            );
            let mut rest = groups;
            let tail = rest.split_off(i);
            let mut tail = tail.into_iter();
            tail.next()
                .map(|g| g[j.min(g.len())..].to_vec())
                .into_iter()
                .filter(|g| !g.is_empty())
                .chain(tail)
                .collect()
        }
    }
}

/// How a fetch over a lane ended early.
enum Ended {
    /// The lane failed: what it did not carry goes to QUIC.
    Lane(String),
    /// The fetch needs nothing more (given up, or failed on a refusal or a bad response).
    GivenUp,
}

/// What the reading thread of a served lane is given.
enum Job {
    Read(Arc<crate::folder::FolderRt>, ChunkRequest),
    Refuse(ErrorCode, String),
}

/// What the writing half of a served lane is given.
enum Out {
    Chunk(ChunkResponse),
    Refuse(ErrorCode, String),
}

/// Serves the chunk requests `peer` sends on `stream`, a lane bound to `conn`, until it closes
/// it, a request is refused, or `conn` ends. `shared`: the folders shared with `peer` now,
/// asked for each request.
pub async fn serve_lane(
    folders: Arc<Folders>,
    peer: DeviceId,
    shared: impl Fn() -> Vec<FolderId>,
    conn: quinn::Connection,
    stream: LaneStream,
) -> Result<(), chunks::ServeError> {
    let link = |e: &dyn std::fmt::Display| chunks::ServeError::Link(e.to_string());
    let (mut rd, mut wr) = tokio::io::split(stream);
    let (jobs, mut jobs_rx) = mpsc::channel::<Job>(LANE_AHEAD);
    let (out, mut out_rx) = mpsc::channel::<Out>(4);
    // One blocking thread reads the chunks of the requests in turn, a few responses ahead of
    // the stream.
    let reading = folders.clone();
    tokio::task::spawn_blocking(move || {
        while let Some(job) = jobs_rx.blocking_recv() {
            match job {
                Job::Read(rt, req) => {
                    let mut taken = true;
                    chunks::read_chunks(&reading, &rt, req, |r| {
                        taken = out.blocking_send(Out::Chunk(r)).is_ok();
                        taken
                    });
                    if !taken {
                        return;
                    }
                }
                Job::Refuse(code, message) => {
                    let _ = out.blocking_send(Out::Refuse(code, message));
                    return;
                }
            }
        }
    });
    let requests = async move {
        loop {
            let req = match transport::read_message(&mut rd)
                .await
                .map_err(|e| link(&e))?
            {
                None => return Ok(()),
                Some(Message::Request(r)) => r,
                Some(_) => {
                    let why = "expected a chunk request".to_string();
                    let _ = jobs.send(Job::Refuse(ErrorCode::BadFrame, why)).await;
                    return Err(chunks::ServeError::Refused(
                        "a lane message that is not a chunk request".into(),
                    ));
                }
            };
            let asked = Asked::Chunks(req);
            match chunks::check_request(&folders, peer, &shared(), &asked) {
                Ok(rt) => {
                    let Asked::Chunks(req) = asked else {
                        unreachable!("built as a chunk request above")
                    };
                    if jobs.send(Job::Read(rt, req)).await.is_err() {
                        return Ok(());
                    }
                }
                Err((told, e)) => {
                    if let Some((code, message)) = told {
                        let _ = jobs.send(Job::Refuse(code, message)).await;
                    }
                    return Err(e);
                }
            }
        }
    };
    let responses = async {
        while let Some(o) = out_rx.recv().await {
            let write = async {
                match o {
                    Out::Chunk(r) => transport::write_response(&mut wr, r).await.map(|_| true),
                    Out::Refuse(code, message) => {
                        let msg = Message::Error { code, message };
                        transport::write_message(&mut wr, &msg).await.map(|_| false)
                    }
                }
            };
            let more = tokio::time::timeout(chunks::RESPONSE_WRITE_TIMEOUT, write)
                .await
                .map_err(|_| link(&"the requester stopped reading"))?
                .map_err(|e| link(&e))?;
            if !more || out_rx.is_empty() {
                wr.flush().await.map_err(|e| link(&e))?;
            }
            if !more {
                break;
            }
        }
        Ok(())
    };
    // The requests may end first (the requester closed its side, or a request was refused):
    // the responses queued before then are still written.
    tokio::pin!(requests, responses);
    let (mut reading, mut refused) = (true, Ok(()));
    loop {
        tokio::select! {
            r = &mut requests, if reading => {
                reading = false;
                refused = r;
            }
            r = &mut responses => return r.and(refused),
            _ = conn.closed() => return Ok(()),
        }
    }
}
