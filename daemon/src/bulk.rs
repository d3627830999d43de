//! The bulk lanes of this device's sessions (D105): a fetch of at least [`LANE_MIN_BYTES`] on
//! a path shorter than [`LANE_MAX_RTT`] sends its chunk requests over the session's TCP lane
//! (`transport::lane`) instead of QUIC request streams, and the peer answers them there. This
//! module keeps the lanes (dialed, held by one fetch at a time, dialed again after a failure)
//! and what `status` shows of them; what goes over a lane is `chunks`'s.
//!
//! Each device dials its own lane to each peer it fetches from, at the start of the session
//! ([`register`]); a lane carries one fetch at a time (another fetch meanwhile takes QUIC), and
//! whatever a lane could not carry (it broke, its port is closed, the dial failed) goes on QUIC
//! request streams as every fetch did before it. A lane not yet up is dialed again a second
//! after each failure (doubling) while its session lasts; one that failed later is dialed again
//! by the first large fetch a second later, then twice as long after each failure in a row, up to
//! [`LANE_RETRY`]; that fetch takes QUIC while the dial goes on. Only the session's first dial
//! is waited for (at most `transport::LANE_CONNECT_TIMEOUT` and `LANE_DIAL_TIMEOUT`), so that
//! the first large fetch of a session finds its lane.
//!
//! **Architecture invariant:** a lane carries only what a QUIC request stream would, checked
//! the same way: requests for folders shared with the device the lane is bound to (checked on
//! every request), responses verified by hash and length before anything is written
//! (`chunks::open_chunk`). A lane is bound to one live QUIC connection and ends with it.

use crate::transport::{self, LaneStream};
use meshfs_protocol::DeviceId;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// A fetch takes the lane only if it asks at least this many bytes: below, QUIC's parallel
/// streams were as fast (`bench/README.md`, small files).
pub const LANE_MIN_BYTES: u64 = 1 << 20;
/// A fetch takes the lane only if the connection's minimum RTT (the path's length, not its
/// load) is below this: over 90 ms QUIC was faster (its congestion control,
/// `transport::congestion`, holds a long path full).
pub const LANE_MAX_RTT: Duration = Duration::from_millis(5);
/// After a lane failed, how long fetches go on QUIC before it is dialed again, at most (a
/// second after its first failure, doubled after each one in a row).
pub const LANE_RETRY: Duration = Duration::from_secs(60);
/// How long after a session starts a path that looked too long for a lane is looked at again.
pub const SHORT_PATH_LOOK: Duration = Duration::from_secs(30);

/// One session's lane to its peer.
pub struct Lane {
    endpoint: quinn::Endpoint,
    conn: quinn::Connection,
    peer: DeviceId,
    state: Arc<tokio::sync::Mutex<State>>,
    /// Set while the session's first dial holds `state`: a fetch then waits for it instead of
    /// taking QUIC (later dials go on while fetches take QUIC).
    dialing: AtomicBool,
    /// Failures in a row (dials or fetches), for the time before the next dial.
    failures: std::sync::atomic::AtomicU32,
}

enum State {
    /// Not dialed, or its last fetch was given up in the middle (the stream went with it).
    Idle,
    Up(Box<LaneStream>),
    /// Failed: dialed again after this instant.
    Down(Instant),
}

/// What `status` shows of this device's lanes to a peer: the state of its current lane, and
/// what its lanes carried since the daemon started (a connection that replaces another, as
/// when both devices dialed, takes a lane of its own).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
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
        failures: Default::default(),
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
    // Dialed until it is first up, a failed dial again when its retry time comes, while the
    // session lasts (a lane that fails later is dialed again by the next large fetch). A path
    // that looks long at first is looked at again for the session's first
    // [`SHORT_PATH_LOOK`]: its minimum RTT only falls, and one handshake on a busy machine
    // can put a loopback's first samples above the bound.
    let started = Instant::now();
    // This session's lane is still the registered one, and its connection open.
    let live = move |lane: &Arc<Lane>| {
        let ours = lanes()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .is_some_and(|l| Arc::ptr_eq(l, lane));
        ours && lane.conn.close_reason().is_none()
    };
    tokio::spawn(async move {
        while !short_path(&lane.conn) {
            if !live(&lane) || started.elapsed() > SHORT_PATH_LOOK {
                return;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        if !short {
            lane.show(|f| f.down = None);
        }
        loop {
            let mut state = lane.state.clone().lock_owned().await;
            let up = match &*state {
                State::Up(_) => true,
                // A fetch's own dial failed meanwhile: its retry time holds.
                State::Down(until) if Instant::now() < *until => false,
                _ => lane.dial(&mut state).await,
            };
            let retry = match &*state {
                State::Down(until) => *until,
                _ => Instant::now(),
            };
            drop(state);
            lane.dialing.store(false, Ordering::Relaxed);
            if up || !live(&lane) {
                return;
            }
            tokio::time::sleep_until(retry.into()).await;
        }
    });
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
        .cloned()?;
    let state = match lane.state.clone().try_lock_owned() {
        Ok(state) => state,
        // The session's first dial: the fetch that comes before it is done waits for it.
        Err(_) if lane.dialing.load(Ordering::Relaxed) => lane.state.clone().lock_owned().await,
        Err(_) => return None,
    };
    match &*state {
        State::Up(_) => Some(Turn { lane, state }),
        State::Down(until) if Instant::now() < *until => None,
        // Idle (a fetch was given up in the middle of it) or its retry time has come: dialed
        // again meanwhile, this fetch takes QUIC.
        State::Idle | State::Down(_) => {
            let mut state = state;
            tokio::spawn(async move { lane.dial(&mut state).await });
            None
        }
    }
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

impl Turn {
    /// The lane's stream, for the fetch to use; the lane is idle (dialed again at the next
    /// large fetch) unless it is given back whole ([`Turn::done`]).
    pub(crate) fn take(&mut self) -> Option<LaneStream> {
        match std::mem::replace(&mut *self.state, State::Idle) {
            State::Up(stream) => Some(*stream),
            other => {
                *self.state = other;
                None
            }
        }
    }

    /// The fetch carried `bytes` whole and gives the lane back, between two requests.
    pub(crate) fn done(mut self, stream: LaneStream, bytes: u64) {
        self.lane.show(|f| {
            f.fetches += 1;
            f.bytes += bytes;
        });
        self.lane.failures.store(0, Ordering::Relaxed);
        *self.state = State::Up(Box::new(stream));
    }

    /// The lane broke in the middle of the fetch.
    pub(crate) fn failed(mut self, why: String) {
        self.lane.failed(&mut self.state, why);
    }

    /// The fetch was given up in the middle of a request: the lane, its stream gone with it,
    /// is dialed again at the next large fetch.
    pub(crate) fn given_up(self) {
        self.lane.show(|f| f.up = false);
    }
}

impl Lane {
    /// Dials the lane, and says whether it is up.
    async fn dial(&self, state: &mut State) -> bool {
        match transport::dial_lane(&self.endpoint, &self.conn, self.peer).await {
            Ok(stream) => {
                tracing::debug!(peer = %self.peer.short(), "bulk lane bound");
                *state = State::Up(Box::new(stream));
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
        if self.replaced() {
            // The lane of a connection already replaced (one of two crossed first dials): the
            // session's own lane is another, and it is not down.
            tracing::debug!(peer = %self.peer.short(), %why, "the bulk lane of a closed connection was not bound");
        } else {
            tracing::info!(peer = %self.peer.short(), %why, "bulk lane down; large fetches take QUIC streams until it is dialed again");
        }
        let n = self.failures.fetch_add(1, Ordering::Relaxed).min(6);
        *state = State::Down(Instant::now() + Duration::from_secs(1 << n).min(LANE_RETRY));
        self.show(|f| {
            f.up = false;
            f.down = Some(why);
        });
    }

    /// Its connection is closed: one of two first connections, replaced by the other.
    fn replaced(&self) -> bool {
        self.conn.close_reason().is_some()
    }

    fn show(&self, change: impl FnOnce(&mut LaneFigures)) {
        // A replaced connection's lane says nothing: status shows the session's own lane.
        if self.replaced() {
            return;
        }
        change(
            shown()
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .entry(self.peer)
                .or_default(),
        );
    }
}
