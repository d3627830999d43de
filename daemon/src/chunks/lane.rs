//! Chunk requests and responses on a bulk lane (D105, `transport::lane`): the fetching end
//! writes its requests one after another and reads the answers in order; the serving end reads
//! each request's chunks on a blocking thread, a few responses ahead of the stream. The same
//! frames and checks as on QUIC request streams.

use super::{Asked, FetchError, FetchItem};
use crate::bulk::Turn;
use crate::folder::Folders;
use crate::transport::{self, LaneStream};
use meshfs_protocol::{ChunkRequest, ChunkResponse, DeviceId, ErrorCode, FolderId, Hash, Message};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;

/// Chunk requests written on a lane ahead of the one being answered.
const LANE_AHEAD: usize = 8;

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
    let Some(stream) = turn.take() else {
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
                    super::RESPONSE_WAIT,
                    super::MAX_RESPONSE_FRAME,
                    want,
                )
                .await
                .map_err(|e| Ended::Lane(e.to_string()))?;
                match super::arrived(msg, want, want_len) {
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
            turn.done(rd.unsplit(wr), bytes);
            Vec::new()
        }
        // Nothing more is wanted (the fetch failed or was given up): the lane, in the middle
        // of a request, goes with it; the next fetch dials again.
        Err(Ended::GivenUp) => {
            turn.given_up();
            Vec::new()
        }
        Err(Ended::Lane(why)) => {
            turn.failed(why);
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
) -> Result<(), super::ServeError> {
    let link = |e: &dyn std::fmt::Display| super::ServeError::Link(e.to_string());
    let (mut rd, mut wr) = tokio::io::split(stream);
    let (jobs, mut jobs_rx) = mpsc::channel::<Job>(LANE_AHEAD);
    let (out, mut out_rx) = mpsc::channel::<Out>(4);
    // The requests' chunks are read in turn, each request's on a blocking thread of its own, a
    // few responses ahead of the stream; an idle lane holds no thread.
    let reading = folders.clone();
    tokio::spawn(async move {
        while let Some(job) = jobs_rx.recv().await {
            let (folders, out) = (reading.clone(), out.clone());
            let read = tokio::task::spawn_blocking(move || match job {
                Job::Read(rt, req) => {
                    let mut taken = true;
                    super::read_chunks(&folders, &rt, req, |r| {
                        taken = out.blocking_send(Out::Chunk(r)).is_ok();
                        taken
                    });
                    // A request answered, the next not begun (for tests: a lane that breaks
                    // in the middle of a fetch).
                    crate::failpoint::hit("lane.answered", "");
                    taken
                }
                Job::Refuse(code, message) => {
                    let _ = out.blocking_send(Out::Refuse(code, message));
                    false
                }
            });
            if !matches!(read.await, Ok(true)) {
                return;
            }
        }
    });
    let requests = async move {
        loop {
            // No wait for a request on an idle lane, but a request's size, as on QUIC.
            let req = match transport::read_message_capped(&mut rd, super::MAX_REQUEST_FRAME)
                .await
                .map_err(|e| link(&e))?
            {
                None => return Ok(()),
                Some(Message::Request(r)) => r,
                Some(_) => {
                    let why = "expected a chunk request".to_string();
                    let _ = jobs.send(Job::Refuse(ErrorCode::BadFrame, why)).await;
                    return Err(super::ServeError::Refused(
                        "a lane message that is not a chunk request".into(),
                    ));
                }
            };
            let asked = Asked::Chunks(req);
            match super::check_request(&folders, peer, &shared(), &asked) {
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
            let more = tokio::time::timeout(super::RESPONSE_WRITE_TIMEOUT, write)
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
