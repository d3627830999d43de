//! The peer transport: QUIC (quinn) with mutual TLS 1.3 (rustls, ring provider) where each
//! end pins the other's [`DeviceId`], plus reading and writing framed [`Message`]s on streams.
//!
//! This module owns the endpoint (its UDP socket, TLS and transport tuning), the trust check
//! during the handshake, the welcome that tells a dialer it was accepted, and the frame IO.
//! It never decides what to say to a peer (that is the session) and never touches files.
//!
//! # Wire protocol: handshake, pinning and the welcome
//!
//! 1. QUIC v1 with TLS 1.3 only, ALPN [`ALPN`] (`meshfs/1`). The dialer sends the SNI
//!    [`SERVER_NAME`] (`meshfs`), which the listener ignores. No 0-RTT.
//! 2. Both ends present one self-signed X.509 certificate. An end's device id is blake3 of
//!    its certificate's SubjectPublicKeyInfo DER; nothing else in the certificate (names,
//!    validity, issuer, extensions) is checked. Possession of the key is proved by the TLS 1.3
//!    CertificateVerify signature.
//! 3. The dialer accepts the listener only if its id equals the id the dialer expects;
//!    otherwise it aborts the handshake with the TLS alert `access_denied` (49) (QUIC
//!    transport error `0x131`).
//! 4. The listener requires a client certificate and accepts the dialer only if its id is
//!    in the listener's trust store; otherwise it aborts the handshake with the TLS alert
//!    `certificate_unknown` (46) (QUIC transport error `0x12e`), before any stream exists.
//! 5. **Welcome.** Under TLS 1.3 the dialer finishes its side of the handshake before the
//!    listener has checked the dialer's certificate, so the dialer cannot tell "accepted"
//!    from "not yet refused". Therefore, once the listener has accepted a connection, it opens
//!    its first unidirectional stream (stream id 3), writes exactly nine bytes — [`WELCOME`]
//!    (`0x01`) and its [`instance`] nonce as a big-endian `u64` — and finishes the stream.
//!    The dialer considers the connection established only when it has read exactly those
//!    nine bytes followed by the end of that stream, within [`WELCOME_TIMEOUT`]. As soon as
//!    its handshake completes, the dialer likewise opens its first unidirectional stream
//!    (stream id 2) and writes its *hello*: [`HELLO`] (`0x02`) and its own instance nonce,
//!    then finishes it; the listener closes a connection whose hello is missing or wrong
//!    after [`WELCOME_TIMEOUT`] with [`CLOSE_BAD_HELLO`]. Until the hello is read, the
//!    listener lets the dialer send [`GREETING_WINDOW`] bytes and open no bidirectional
//!    stream, and keeps at most [`MAX_WAITING_PER_DEVICE`] connections of one device waiting
//!    (one more is closed with [`CLOSE_BUSY`]). The instance nonce is drawn at
//!    random when the daemon starts and again when one of its addresses goes away
//!    ([`new_instance`]): a connection from a new instance proves every older connection
//!    from the same device dead (its process is gone, or it moved), so the peer replaces it
//!    at once instead of waiting for an idle timeout. If instead the connection is closed by the listener with a QUIC
//!    transport error `0x100 + alert` for a certificate alert (42–46, 48, 49 or 116), the
//!    listener refused the dialer's certificate ([`TransportError::Refused`]). Any other
//!    outcome (another byte, more bytes, timeout) is a failed connect; the dialer closes the
//!    connection with application error code [`CLOSE_BAD_WELCOME`].
//! 6. After the welcome, streams carry frames (`u32` big-endian payload length, then a
//!    postcard [`Message`]; see `meshfs-protocol`). A receiver that gets a frame it cannot
//!    accept (over [`MAX_FRAME_LEN`] or malformed) stops that stream with STOP_SENDING code
//!    [`STOP_BAD_FRAME`]. So does one whose peer stalls in the middle of a frame: once a
//!    frame's first byte has arrived, the next must follow within [`FRAME_STALL`] and the
//!    whole frame within [`frame_deadline`] (an idle stream between frames is not a stall).
//!
//! # Tuning
//!
//! Links of 1 Gbit/s × 90 ms hold ≈ 11 MB in flight, so the windows are well above that: a
//! stream may have 16 MiB unacknowledged, a connection 64 MiB each way, with 1024 concurrent
//! bidirectional streams (chunk requests). Keep-alive every 1 s, idle timeout 5 s (a dead path
//! is noticed within seconds; a restarted peer is noticed at once by its instance nonce), initial
//! RTT guess 100 ms. The congestion window is gain × the delivery rate measured from ACKs × min
//! RTT ([`RateWindowConfig`]: BBR's model, loss-tolerant like BBR; see [`CongestionControl`]),
//! held to at least 256 KiB: on a LAN's tens of microseconds of RTT the product is a few
//! packets. UDP segmentation offload (GSO) stays on. The UDP socket gets 8 MiB kernel
//! buffers (forced past `net.core.rmem_max` when we may) so bursts are not dropped.

use crate::identity::{device_id_of_cert, Identity};
use meshfs_protocol::{
    decode_payload, encode_frame, frame_len, ChunkResponse, CodecError, DeviceId, Hash, Message,
    FRAME_HEADER_LEN, MAX_FRAME_LEN,
};
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{ConnectionError, TransportConfig, VarInt};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{verify_tls13_signature, CryptoProvider};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{CertificateError, DigitallySignedStruct, DistinguishedName, SignatureScheme};
use std::collections::{HashMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::{Duration, Instant, SystemTime};

/// The ALPN protocol id of meshfs protocol version 1.
pub const ALPN: &[u8] = b"meshfs/1";
/// The SNI a dialer sends (identities are pinned by key, not by name).
pub const SERVER_NAME: &str = "meshfs";
/// The first byte a listener sends on its first unidirectional stream to say "accepted"
/// (followed by its 8-byte [`instance`] nonce).
pub const WELCOME: u8 = 0x01;
/// The first byte a dialer sends on its first unidirectional stream (followed by its 8-byte
/// [`instance`] nonce).
pub const HELLO: u8 = 0x02;
/// Length of the welcome and of the hello: the tag byte and a big-endian `u64` nonce.
const GREETING_LEN: usize = 9;
/// How long a dialer waits for the welcome after its side of the handshake completed.
pub const WELCOME_TIMEOUT: Duration = Duration::from_secs(10);
/// Application close code: the daemon is stopping, or the session on the connection ended; an
/// orderly close, not a failure.
pub const CLOSE_STOPPING: VarInt = VarInt::from_u32(0);
/// Application close code: the welcome was missing or wrong.
pub const CLOSE_BAD_WELCOME: VarInt = VarInt::from_u32(1);
/// Application close code: the handshake completed with a device other than the expected one.
pub const CLOSE_WRONG_DEVICE: VarInt = VarInt::from_u32(2);
/// Application close code: both devices dialed, and this connection is the one not kept (see
/// `peers`). The same value as [`CLOSE_BAD_WELCOME`], which only a dialer sends: a dialer
/// that receives it was told its connection is the duplicate.
pub const CLOSE_DUPLICATE: VarInt = VarInt::from_u32(1);
/// Application close code (listener): the dialer's hello was missing or wrong.
pub const CLOSE_BAD_HELLO: VarInt = VarInt::from_u32(3);
/// Application close code (listener): [`MAX_WAITING_PER_DEVICE`] connections of the dialer's
/// device already wait for their hello.
pub const CLOSE_BUSY: VarInt = VarInt::from_u32(4);
/// Connections of one device that may wait for their hello at once; one more is closed with
/// [`CLOSE_BUSY`]. A dialer greets its connection as soon as its handshake is done (and drops
/// at once the candidates that lost a race, `discovery::dial`), so only a device that means
/// harm keeps more waiting.
pub const MAX_WAITING_PER_DEVICE: usize = 4;
/// Bytes a dialer may send on all its streams of a connection before the listener has read
/// its hello (nine bytes), and no bidirectional stream: then the connection gets its window
/// ([`Tuning::receive_window`]) and its streams. A device opening connections that never say
/// hello makes the listener hold this, not a window, for each.
pub const GREETING_WINDOW: u32 = 4 << 10;
/// Bytes reserved for a frame's payload before any of it has arrived.
const FRAME_PREALLOC: usize = 64 << 10;
/// Bytes reserved for a chunk read in place ([`read_response_within`]) before any of it has
/// arrived: all of a chunk of a file up to 1 GiB (D8), so it is never copied as its buffer
/// grows. Only on streams this device opened for its own requests
/// ([`crate::chunks`]'s requests in flight), so a peer cannot make it reserve more by opening
/// streams.
const CHUNK_PREALLOC: usize = 256 << 10;
/// STOP_SENDING code: a frame on this stream was oversized or malformed, or its peer stalled
/// in the middle of it.
pub const STOP_BAD_FRAME: VarInt = VarInt::from_u32(1);
/// Once a frame has begun, how long the peer may send nothing more of it. A live connection
/// carries a started frame on at once: only a peer that stalls on purpose, or a path dead for
/// longer than the idle timeout, waits this long.
pub const FRAME_STALL: Duration = Duration::from_secs(10);
/// A frame must be complete within this time after its first byte, plus a second per
/// [`FRAME_MIN_RATE`] bytes it declares, however it trickles in (a 16 MiB frame: 35 minutes).
const FRAME_TIME_BASE: Duration = Duration::from_secs(30);
/// See [`FRAME_TIME_BASE`].
const FRAME_MIN_RATE: u64 = 8 << 10;

/// How many recently refused devices [`TrustStore::refused`] remembers.
const REFUSED_CAPACITY: usize = 32;
/// A device refused again within this time is logged at debug level, not as a warning.
const REFUSAL_WARN_INTERVAL: Duration = Duration::from_secs(300);
/// Most refusal warnings in one [`REFUSAL_LOG_WINDOW`]: a device that makes a new key for
/// every attempt is news every time. Refusals past it are counted, and one line at the end of
/// the window says how many.
const REFUSAL_WARNINGS_PER_WINDOW: u32 = 5;
/// See [`REFUSAL_WARNINGS_PER_WINDOW`].
const REFUSAL_LOG_WINDOW: Duration = Duration::from_secs(60);
/// Marker in the TLS error text by which [`accept`] recognizes our own refusal.
const UNTRUSTED_MARKER: &str = "untrusted device ";

/// The set of device ids this daemon accepts; cheap to clone (all clones share one set),
/// updated at runtime when peers are added or removed. Removing a device refuses its next
/// handshake; closing its open connections is the caller's job.
#[derive(Clone, Default)]
pub struct TrustStore {
    inner: Arc<RwLock<TrustInner>>,
}

#[derive(Default)]
struct TrustInner {
    trusted: HashSet<DeviceId>,
    /// Most recent first, at most one entry per device.
    refused: VecDeque<(DeviceId, SystemTime)>,
    log: RefusalLog,
}

/// How refusals are being logged in the current window.
#[derive(Default)]
struct RefusalLog {
    /// When the current window began (`None`: no refusal yet).
    window: Option<Instant>,
    /// Warnings written in it.
    warned: u32,
    /// Refusals of new devices in it that got no warning of their own.
    unlogged: u64,
}

/// What to log about one refusal ([`TrustStore::record_refusal`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RefusalNote {
    /// A warning naming the device.
    Warn,
    /// The device was refused a moment ago: nothing to tell.
    Again,
    /// News, but the window's warnings are spent: counted. `summary_at`: the first such in
    /// its window, whose count is to be logged then ([`TrustStore::take_unlogged`]).
    Counted {
        /// When to log the window's count, if this refusal is the first one counted.
        summary_at: Option<Instant>,
    },
}

impl TrustStore {
    /// A store trusting exactly `ids`.
    pub fn new(ids: impl IntoIterator<Item = DeviceId>) -> Self {
        let store = TrustStore::default();
        store.write().trusted.extend(ids);
        store
    }

    /// Trusts `id` from now on (and forgets that it was refused).
    pub fn add(&self, id: DeviceId) {
        let mut inner = self.write();
        inner.trusted.insert(id);
        inner.refused.retain(|(r, _)| *r != id);
    }

    /// Stops trusting `id` for new connections.
    pub fn remove(&self, id: &DeviceId) {
        self.write().trusted.remove(id);
    }

    /// Whether `id` is trusted.
    pub fn contains(&self, id: &DeviceId) -> bool {
        self.read().trusted.contains(id)
    }

    /// Devices refused recently because they are not trusted, most recent first, with the
    /// time of their last attempt (bounded list, one entry per device).
    pub fn refused(&self) -> Vec<(DeviceId, SystemTime)> {
        self.read().refused.iter().copied().collect()
    }

    /// Records a refusal of `id` at `now` (`wall`: the same moment, as shown to people) and
    /// says what to log: a warning when it is news (not refused in the last
    /// [`REFUSAL_WARN_INTERVAL`]) and the window has warnings left, else a count.
    fn record_refusal(&self, id: DeviceId, now: Instant, wall: SystemTime) -> RefusalNote {
        let mut inner = self.write();
        let previous = inner
            .refused
            .iter()
            .position(|(r, _)| *r == id)
            .and_then(|i| inner.refused.remove(i))
            .map(|(_, at)| at);
        inner.refused.push_front((id, wall));
        inner.refused.truncate(REFUSED_CAPACITY);
        let news = previous.is_none_or(|at| {
            wall.duration_since(at)
                .map_or(true, |d| d >= REFUSAL_WARN_INTERVAL)
        });
        if !news {
            return RefusalNote::Again;
        }
        let log = &mut inner.log;
        let start = match log.window {
            Some(start) if now.saturating_duration_since(start) < REFUSAL_LOG_WINDOW => start,
            _ => {
                // A new window; a count left in the old one is logged by its own summary.
                log.window = Some(now);
                log.warned = 0;
                now
            }
        };
        if log.warned < REFUSAL_WARNINGS_PER_WINDOW {
            log.warned += 1;
            return RefusalNote::Warn;
        }
        log.unlogged += 1;
        RefusalNote::Counted {
            summary_at: (log.unlogged == 1).then_some(start + REFUSAL_LOG_WINDOW),
        }
    }

    /// The refusals counted without a warning since the last call, and resets the count.
    fn take_unlogged(&self) -> u64 {
        std::mem::take(&mut self.write().log.unlogged)
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, TrustInner> {
        // A panic while holding the lock cannot leave a set half-updated.
        self.inner.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, TrustInner> {
        self.inner.write().unwrap_or_else(|e| e.into_inner())
    }
}

impl std::fmt::Debug for TrustStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = self.read();
        f.debug_struct("TrustStore")
            .field("trusted", &inner.trusted)
            .field("refused", &inner.refused.len())
            .finish()
    }
}

/// Why a transport operation failed.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// The peer we dialed refused our certificate: we are not in its trust store.
    #[error("peer {addr} refused our certificate: on that device run `meshfs peer add {our_id} --addr {our_addr}`")]
    Refused {
        /// The peer's address.
        addr: SocketAddr,
        /// Our device id.
        our_id: DeviceId,
        /// Our address as the peer should dial it (our local IP on that path, our port).
        our_addr: SocketAddr,
    },
    /// A device that is not in our trust store tried to connect and was refused.
    #[error("refused unknown device {0}: to accept it run `meshfs peer add {0} --addr HOST:PORT`")]
    UnknownDevice(DeviceId),
    /// The peer at the dialed address is another device than the one expected.
    #[error("peer {addr} is device {presented}, not the expected {expected}: check the address and the id given to `meshfs peer add`")]
    WrongDevice {
        /// The dialed address.
        addr: SocketAddr,
        /// The id we dialed.
        expected: DeviceId,
        /// The id its certificate has.
        presented: DeviceId,
    },
    /// A frame could not be accepted.
    #[error("bad frame from peer: {0}")]
    Frame(#[from] CodecError),
    /// Local socket IO failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The cause.
        source: std::io::Error,
    },
    /// Building the TLS or QUIC configuration failed.
    #[error("cannot configure TLS for this device's identity: {0}")]
    Tls(String),
    /// The peer closed our dial because it keeps the connection it dialed to us at the same
    /// moment (both dialed; see `peers`). Not a failure: the pair is connected.
    #[error("peer {addr} kept the connection it dialed to us at the same moment")]
    Duplicate {
        /// The dialed address.
        addr: SocketAddr,
    },
    /// The peer closed our dial because its daemon is stopping ([`CLOSE_STOPPING`]), or its
    /// endpoint refused a new connection (QUIC's `CONNECTION_REFUSED`: it does so while it
    /// closes). Not a failure of either device: it is going offline, and it is dialed again.
    #[error("peer {addr} is stopping")]
    Stopping {
        /// The dialed address.
        addr: SocketAddr,
    },
    /// Connecting to a peer failed (unreachable, timeout, handshake or welcome failure).
    #[error("cannot connect to peer {addr}: {reason}")]
    Connect {
        /// The dialed address.
        addr: SocketAddr,
        /// What happened.
        reason: String,
    },
    /// An established connection failed (or a handshake on the listening side).
    #[error("connection lost: {0}")]
    Connection(#[from] ConnectionError),
    /// Writing to a stream failed.
    #[error("cannot write to peer stream: {0}")]
    Write(#[from] quinn::WriteError),
    /// Reading from a stream failed.
    #[error("cannot read from peer stream: {0}")]
    Read(#[from] quinn::ReadError),
    /// The peer did not send in time: no message within the wait given to
    /// [`read_message_within`], or a frame it began went quiet for [`FRAME_STALL`] or was not
    /// complete by [`frame_deadline`].
    #[error("the peer stalled: {}", stalled_text(*got, *len, *waited))]
    Stalled {
        /// Bytes of the frame received (header included); 0: none.
        got: usize,
        /// The payload length the frame declared, if its header had arrived.
        len: Option<usize>,
        /// How long it was waited for.
        waited: Duration,
    },
}

fn stalled_text(got: usize, len: Option<usize>, waited: Duration) -> String {
    let secs = waited.as_secs_f32();
    match (got, len) {
        (0, _) => format!("no message within {secs:.1} s"),
        (got, None) => format!("{got} bytes of a frame header, then nothing for {secs:.1} s"),
        (got, Some(len)) => format!(
            "{} of {len} bytes of a frame after {secs:.1} s",
            got - FRAME_HEADER_LEN
        ),
    }
}

/// Congestion controller of an endpoint's connections.
///
/// Chosen by measurement (`daemon/tests/transport.rs`, release build, 2 loaded cores, 8
/// streams of 1 MiB frames, through a userspace relay on 127.0.0.1 that adds 45 ms each way
/// behind a rate-limited drop-tail queue of one bandwidth-delay product, like `bench/netdelay`):
///
/// | link | Cubic | BBR |
/// |---|---|---|
/// | 100 Mbit/s, no random loss | 10.5 MB/s, 1.08× bytes sent | 11.0 MB/s, 1.95× bytes sent |
/// | 250 Mbit/s, no random loss | 19.0 MB/s | 19.5 MB/s |
/// | 1 Gbit/s, no random loss (CPU-bound) | 43–46 MB/s | 36–58 MB/s |
/// | 100 Mbit/s, 0.01 % random loss | 8.6 MB/s | 9.7 MB/s |
/// | 100 Mbit/s, 0.1 % random loss | 0.6–0.7 MB/s | 10.8 MB/s |
/// | 100 Mbit/s, 0.5 % random loss | 0.3 MB/s | 10.2 MB/s |
///
/// Without random loss the two deliver the same; with the small random loss of Wi-Fi and long
/// paths Cubic collapses at 90 ms (as loss-based control must: rate ∝ 1/(RTT·√p)) while BBR
/// keeps the link full. BBR's cost is retransmission overhead when it overfills a shallow
/// queue (up to 2× the bytes on the wire at 100 Mbit/s). quinn marks its BBR experimental,
/// so Cubic stays one setting away.
///
/// The window from the delivery rate ([`CongestionControl::Rate`], D29) keeps BBR's loss
/// tolerance without that cost (`transport_rate --relay`, 64 MiB, 100 Mbit/s × 90 ms):
///
/// | link | Cubic | BBR | Rate |
/// |---|---|---|---|
/// | no random loss | 10.8 MB/s, 5.9 % of the payload lost | 10.6 MB/s, 101 % lost | 11.5 MB/s, 0.0 % |
/// | 0.1 % random loss | 0.7 MB/s | 10.5 MB/s, 103 % lost | 11.5 MB/s, 0.1 % |
///
/// and on the bench's wan (1 Gbit/s × 90 ms through `bench/netdelay`) one 512 MiB file dropped
/// 0.3 % of its bytes against quinn's BBR's 57 % (`bench/README.md`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CongestionControl {
    /// RFC 8312 Cubic (quinn's default controller).
    Cubic,
    /// quinn's BBR (v1, marked experimental by quinn) held to a least window
    /// ([`FlooredBbr`]): the default until the window from the delivery rate replaced it.
    Bbr,
    /// A window of gain × the measured delivery rate × min RTT ([`RateWindowConfig`]): BBR's
    /// model, loss-tolerant like BBR, without quinn's BBR's overshoot. meshfs's default.
    #[default]
    Rate,
}

/// The knobs of an endpoint; [`Tuning::default`] is what [`endpoint`] uses.
#[derive(Clone, Debug)]
pub struct Tuning {
    /// Congestion controller.
    pub congestion: CongestionControl,
    /// Bytes a peer may send on one stream beyond what we have read.
    pub stream_receive_window: u32,
    /// Bytes a peer may send on all streams of a connection beyond what we have read.
    pub receive_window: u32,
    /// Bytes we buffer for sending on a connection.
    pub send_window: u64,
    /// Bidirectional streams a peer may have open at once.
    pub max_concurrent_bidi_streams: u32,
    /// Unidirectional streams a peer may have open at once.
    pub max_concurrent_uni_streams: u32,
    /// Ping interval that keeps an idle connection (and NAT mappings) alive.
    pub keep_alive_interval: Duration,
    /// A connection without any packet from the peer for this long is dead.
    pub max_idle_timeout: Duration,
    /// RTT assumed before the first measurement.
    pub initial_rtt: Duration,
    /// Kernel send and receive buffer of the UDP socket, in bytes.
    pub socket_buffer: usize,
    /// Least congestion window of [`CongestionControl::Rate`] and [`CongestionControl::Bbr`],
    /// in bytes.
    pub cwnd_floor: u64,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            congestion: CongestionControl::Rate,
            stream_receive_window: 16 << 20,
            receive_window: 64 << 20,
            send_window: 64 << 20,
            max_concurrent_bidi_streams: 1024,
            max_concurrent_uni_streams: 16,
            keep_alive_interval: Duration::from_secs(1),
            max_idle_timeout: Duration::from_secs(5),
            initial_rtt: Duration::from_millis(100),
            socket_buffer: 32 << 20,
            cwnd_floor: 256 << 10,
        }
    }
}

impl Tuning {
    /// The quinn transport configuration of these knobs.
    pub fn transport_config(&self) -> Result<TransportConfig, TransportError> {
        let mut t = TransportConfig::default();
        t.stream_receive_window(VarInt::from_u32(self.stream_receive_window))
            .receive_window(VarInt::from_u32(self.receive_window))
            .send_window(self.send_window)
            .max_concurrent_bidi_streams(VarInt::from_u32(self.max_concurrent_bidi_streams))
            .max_concurrent_uni_streams(VarInt::from_u32(self.max_concurrent_uni_streams))
            .keep_alive_interval(Some(self.keep_alive_interval))
            .max_idle_timeout(Some(self.max_idle_timeout.try_into().map_err(|_| {
                TransportError::Tls(format!(
                    "idle timeout {:?} is out of range",
                    self.max_idle_timeout
                ))
            })?))
            .initial_rtt(self.initial_rtt)
            .enable_segmentation_offload(true);
        match self.congestion {
            CongestionControl::Cubic => {
                t.congestion_controller_factory(Arc::new(quinn::congestion::CubicConfig::default()))
            }
            CongestionControl::Rate => {
                t.congestion_controller_factory(Arc::new(RateWindowConfig {
                    floor: self.cwnd_floor,
                }))
            }
            CongestionControl::Bbr => t.congestion_controller_factory(Arc::new(FlooredBbr {
                floor: self.cwnd_floor,
                inner: Arc::new(quinn::congestion::BbrConfig::default()),
            })),
        };
        Ok(t)
    }
}

/// What [`dial`] and [`accept`] need besides the endpoint: our certificate and key, the
/// transport configuration, and the connections waiting for their hello. Their signatures name
/// only the endpoint, and quinn endpoints carry no user data, so [`endpoint_with`] registers
/// this under the endpoint's local address (unique among live sockets; a new endpoint on a
/// reused address replaces the entry).
struct DialContext {
    cert: CertificateDer<'static>,
    key_der: Vec<u8>,
    device_id: DeviceId,
    transport: Arc<TransportConfig>,
    /// Another descriptor of the endpoint's socket, for [`rebind`].
    socket: std::net::UdpSocket,
    /// What an accepted connection is opened to once its hello is read: its receive window and
    /// the bidirectional streams its dialer may open ([`Tuning`]; before: [`GREETING_WINDOW`]
    /// and none).
    opened: (u32, u32),
    /// Accepted connections waiting for their hello, by device.
    waiting: Mutex<HashMap<DeviceId, usize>>,
}

fn dial_contexts() -> &'static Mutex<HashMap<SocketAddr, Arc<DialContext>>> {
    static CONTEXTS: OnceLock<Mutex<HashMap<SocketAddr, Arc<DialContext>>>> = OnceLock::new();
    CONTEXTS.get_or_init(Default::default)
}

/// The context [`endpoint_with`] registered for `endpoint`.
fn context_of(endpoint: &quinn::Endpoint) -> Option<Arc<DialContext>> {
    let local = endpoint.local_addr().ok()?;
    dial_contexts()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&local)
        .cloned()
}

/// One connection of a device counted among those waiting for their hello, until dropped.
struct Waiting {
    context: Arc<DialContext>,
    device: DeviceId,
}

impl Waiting {
    /// Counts a connection of `device`, unless [`MAX_WAITING_PER_DEVICE`] already wait.
    fn enter(context: Arc<DialContext>, device: DeviceId) -> Option<Waiting> {
        let mut waiting = context.waiting.lock().unwrap_or_else(|e| e.into_inner());
        let n = waiting.entry(device).or_insert(0);
        if *n >= MAX_WAITING_PER_DEVICE {
            return None;
        }
        *n += 1;
        drop(waiting);
        Some(Waiting { context, device })
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        let mut waiting = self
            .context
            .waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(n) = waiting.get_mut(&self.device) {
            *n -= 1;
            if *n == 0 {
                waiting.remove(&self.device);
            }
        }
    }
}

fn provider() -> Arc<CryptoProvider> {
    static PROVIDER: OnceLock<Arc<CryptoProvider>> = OnceLock::new();
    PROVIDER
        .get_or_init(|| Arc::new(rustls::crypto::ring::default_provider()))
        .clone()
}

fn tls_err(e: impl std::fmt::Display) -> TransportError {
    TransportError::Tls(e.to_string())
}

/// An endpoint listening on `listen` (UDP) with [`Tuning::default`], accepting devices in
/// `trust`, and able to [`dial`]. Must be called inside a tokio runtime.
pub fn endpoint(
    identity: &Identity,
    listen: SocketAddr,
    trust: TrustStore,
) -> Result<quinn::Endpoint, TransportError> {
    endpoint_with(identity, listen, trust, &Tuning::default())
}

/// [`endpoint`] with explicit tuning.
pub fn endpoint_with(
    identity: &Identity,
    listen: SocketAddr,
    trust: TrustStore,
    tuning: &Tuning,
) -> Result<quinn::Endpoint, TransportError> {
    let transport = Arc::new(tuning.transport_config()?);
    // Until its hello is read, an accepted connection may send little and open no
    // bidirectional stream: a device can open many connections, and each would otherwise hold
    // a receive window of unread data for as long as its hello is waited for.
    let mut greeting = tuning.transport_config()?;
    greeting
        .receive_window(VarInt::from_u32(GREETING_WINDOW))
        .max_concurrent_bidi_streams(VarInt::from_u32(0));
    let cert = CertificateDer::from(identity.cert_der.clone());
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(identity.key_der.clone()));

    let verifier = Arc::new(TrustedClients {
        trust,
        provider: provider(),
    });
    let mut tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_err)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(vec![cert.clone()], key)
        .map_err(tls_err)?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    // No session resumption: a resumed session restores the client certificate without
    // asking the verifier, so a peer removed from the trust store could come back with a
    // ticket. Every connection does the full handshake and the trust check.
    tls.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    tls.send_tls13_tickets = 0;
    let crypto = QuicServerConfig::try_from(tls).map_err(tls_err)?;
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    server.transport_config(Arc::new(greeting));

    let socket = udp_socket(listen, tuning.socket_buffer)?;
    let spare = socket.try_clone().map_err(|source| TransportError::Io {
        context: format!("cannot duplicate the UDP socket of {listen}"),
        source,
    })?;
    let endpoint = quinn::Endpoint::new(
        quinn::EndpointConfig::default(),
        Some(server),
        socket,
        Arc::new(quinn::TokioRuntime),
    )
    .map_err(|source| TransportError::Io {
        context: format!("cannot start QUIC on {listen}"),
        source,
    })?;
    let local = endpoint.local_addr().map_err(|source| TransportError::Io {
        context: format!("cannot read the local address of the socket bound to {listen}"),
        source,
    })?;
    let context = Arc::new(DialContext {
        cert,
        key_der: identity.key_der.clone(),
        device_id: identity.device_id,
        transport,
        socket: spare,
        opened: (tuning.receive_window, tuning.max_concurrent_bidi_streams),
        waiting: Mutex::new(HashMap::new()),
    });
    dial_contexts()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(local, context);
    Ok(endpoint)
}

/// Hands `endpoint` (made by [`endpoint`]) its own socket again, as if it had moved: every
/// connection switches to a new connection id and sends a ping at once. After this host's
/// address changed, the connections it dialed so migrate to its new address within a round
/// trip instead of at the next keep-alive (QUIC connection migration: the listening end follows
/// a dialer that moves; a listener cannot move, see `peers`).
pub fn rebind(endpoint: &quinn::Endpoint) -> std::io::Result<()> {
    let local = endpoint.local_addr()?;
    let socket = dial_contexts()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&local)
        .map(|c| c.socket.try_clone())
        .ok_or_else(|| {
            std::io::Error::other("the endpoint was not made by transport::endpoint")
        })??;
    endpoint.rebind(socket)
}

/// A UDP socket bound to `addr` with `buffer` bytes of kernel send and receive buffer. An
/// IPv6 wildcard address is dual-stack: it takes IPv4 too.
fn udp_socket(addr: SocketAddr, buffer: usize) -> Result<std::net::UdpSocket, TransportError> {
    use socket2::{Domain, Protocol, Socket, Type};
    let io = |context: String| move |source| TransportError::Io { context, source };
    let socket = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))
        .map_err(io(format!("cannot create a UDP socket for {addr}")))?;
    for (name, set, force) in [
        (
            "receive",
            Socket::set_recv_buffer_size as fn(&Socket, usize) -> _,
            libc::SO_RCVBUFFORCE,
        ),
        ("send", Socket::set_send_buffer_size, libc::SO_SNDBUFFORCE),
    ] {
        // The kernel caps the plain option at net.core.[rw]mem_max; the FORCE variant ignores
        // the cap where we have CAP_NET_ADMIN. Either way a smaller buffer only costs speed.
        if !force_buffer(&socket, force, buffer) {
            if let Err(e) = set(&socket, buffer) {
                tracing::debug!("cannot set the UDP {name} buffer of {addr} to {buffer}: {e}");
            }
        }
    }
    tracing::debug!(
        "UDP socket {addr}: receive buffer {:?}, send buffer {:?}",
        socket.recv_buffer_size().ok(),
        socket.send_buffer_size().ok()
    );
    if addr.is_ipv6() && addr.ip().is_unspecified() {
        socket
            .set_only_v6(false)
            .map_err(io(format!("cannot make the UDP socket {addr} dual-stack")))?;
    }
    socket.bind(&addr.into()).map_err(io(format!(
        "cannot listen on UDP {addr} (is another daemon using it?)"
    )))?;
    socket.set_nonblocking(true).map_err(io(format!(
        "cannot make the UDP socket {addr} non-blocking"
    )))?;
    Ok(socket.into())
}

/// `setsockopt(SOL_SOCKET, option, bytes)`; whether it succeeded.
fn force_buffer(socket: &socket2::Socket, option: libc::c_int, bytes: usize) -> bool {
    use std::os::fd::AsRawFd;
    let Ok(value) = libc::c_int::try_from(bytes / 2) else {
        return false;
    };
    // The kernel doubles the requested value (bookkeeping overhead), hence bytes / 2 above.
    // SAFETY: the fd is open for the lifetime of `socket`; the option value is a c_int
    // living on the stack for the duration of the call, and its size is passed along.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            option,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    rc == 0
}

/// This process's instance nonce: random, drawn when the daemon starts and again when one of
/// its addresses goes away ([`new_instance`]). A peer that sees a new nonce from a device
/// knows that every older connection from it is dead even if no timeout has said so yet
/// (module docs, step 5): the device restarted, or moved and left behind the connections it
/// cannot carry to its new address.
pub fn instance() -> u64 {
    let n = INSTANCE.load(std::sync::atomic::Ordering::Relaxed);
    if n != 0 {
        return n;
    }
    let fresh = random_nonce();
    match INSTANCE.compare_exchange(
        0,
        fresh,
        std::sync::atomic::Ordering::Relaxed,
        std::sync::atomic::Ordering::Relaxed,
    ) {
        Ok(_) => fresh,
        Err(set) => set,
    }
}

/// Draws a new instance nonce (see [`instance`]): the connections made from now on replace,
/// at the peer, every older connection of this device.
pub fn new_instance() -> u64 {
    let fresh = random_nonce();
    INSTANCE.store(fresh, std::sync::atomic::Ordering::Relaxed);
    fresh
}

static INSTANCE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn random_nonce() -> u64 {
    loop {
        let n: u64 = rand::random();
        if n != 0 {
            break n;
        }
    }
}

/// An established, welcomed connection to a peer.
#[derive(Clone)]
pub struct Established {
    /// The connection.
    pub conn: quinn::Connection,
    /// The peer's device id (from its certificate).
    pub peer: DeviceId,
    /// The peer process's [`instance`] nonce.
    pub instance: u64,
}

/// Why a peer's greeting was not read: the connection ended ([`GreetingError::Lost`], a
/// connection failure like any other), or the peer sent something else (it is closed as a
/// bad hello or welcome).
#[derive(Debug, thiserror::Error)]
enum GreetingError {
    /// The connection ended.
    #[error(transparent)]
    Lost(#[from] ConnectionError),
    /// The peer reset or stopped the stream.
    #[error("{0}")]
    Stream(quinn::ReadError),
    /// Other bytes than the greeting.
    #[error("it sent {got:02x?} instead of the meshfs/1 greeting {tag:02x}")]
    Unexpected {
        /// What came, up to one byte more than a greeting.
        got: Vec<u8>,
        /// The greeting's tag.
        tag: u8,
    },
}

/// Reads a greeting (`tag` then a `u64`) from `recv`: exactly [`GREETING_LEN`] bytes, then
/// the end of the stream.
async fn read_greeting(recv: &mut quinn::RecvStream, tag: u8) -> Result<u64, GreetingError> {
    let mut got = Vec::with_capacity(GREETING_LEN + 1);
    let mut buf = [0u8; GREETING_LEN + 1];
    while got.len() <= GREETING_LEN {
        match recv.read(&mut buf[..GREETING_LEN + 1 - got.len()]).await {
            Ok(Some(n)) => got.extend_from_slice(&buf[..n]),
            Ok(None) => break,
            Err(quinn::ReadError::ConnectionLost(e)) => return Err(GreetingError::Lost(e)),
            Err(e) => return Err(GreetingError::Stream(e)),
        }
    }
    if got.len() == GREETING_LEN && got[0] == tag {
        let mut n = [0u8; 8];
        n.copy_from_slice(&got[1..]);
        Ok(u64::from_be_bytes(n))
    } else {
        Err(GreetingError::Unexpected { got, tag })
    }
}

/// Sends this process's greeting (`tag`, then [`instance`]) on a new unidirectional stream.
async fn send_greeting(conn: &quinn::Connection, tag: u8) -> Result<(), TransportError> {
    let mut send = conn.open_uni().await?;
    let mut g = [0u8; GREETING_LEN];
    g[0] = tag;
    g[1..].copy_from_slice(&instance().to_be_bytes());
    send.write_all(&g).await?;
    // Finishing only fails if the stream was already reset or finished: neither happened.
    let _ = send.finish();
    Ok(())
}

/// Dials the device `expected` at `addr` from `endpoint` (made by [`endpoint`]) and returns
/// the connection once the listener has welcomed us (see the module docs, step 5).
///
/// Fails with [`TransportError::Refused`] if the peer does not trust us,
/// [`TransportError::WrongDevice`] if another device answers at `addr`,
/// [`TransportError::Duplicate`] if it keeps the connection it dialed to us at the same moment,
/// [`TransportError::Stopping`] if its daemon is stopping, and [`TransportError::Connect`]
/// otherwise.
pub async fn dial(
    endpoint: &quinn::Endpoint,
    addr: SocketAddr,
    expected: DeviceId,
) -> Result<quinn::Connection, TransportError> {
    dial_peer(endpoint, addr, expected).await.map(|e| e.conn)
}

/// [`dial`], also returning the listener's instance nonce.
pub async fn dial_peer(
    endpoint: &quinn::Endpoint,
    addr: SocketAddr,
    expected: DeviceId,
) -> Result<Established, TransportError> {
    handshake(endpoint, addr, expected).await?.greet().await
}

/// A dial whose TLS handshake completed with the expected device, before the greetings: the
/// listener does not count it as a connection until [`Handshaken::greet`] sends our hello, so a
/// dialer racing several addresses of one device (`discovery::dial`) drops the losers here and
/// the listener never registers them.
pub struct Handshaken {
    conn: quinn::Connection,
    dial: Dial,
}

impl Handshaken {
    /// Sends our hello and waits for the welcome (module docs, step 5).
    pub async fn greet(self) -> Result<Established, TransportError> {
        let Handshaken { conn, dial } = self;
        // Our hello goes out at once, beside the listener's welcome: no extra round trip.
        if let Err(e) = send_greeting(&conn, HELLO).await {
            // The listener may refuse our certificate while the hello is being written: the
            // write then fails with the refusal.
            return Err(match e {
                TransportError::Connection(c)
                | TransportError::Write(quinn::WriteError::ConnectionLost(c)) => dial.failed(c),
                other => dial.connect_err(other.to_string()),
            });
        }
        let instance = dial.welcome(&conn).await?;
        dial.established(conn, instance)
    }

    /// The address dialed.
    pub fn addr(&self) -> SocketAddr {
        self.dial.addr
    }

    /// Drops the dial without a greeting (another address won the race).
    pub fn abandon(self) {
        self.conn
            .close(CLOSE_STOPPING, b"another address answered first");
    }
}

/// The TLS handshake of a dial to `expected` at `addr` (see [`Handshaken`]).
pub async fn handshake(
    endpoint: &quinn::Endpoint,
    addr: SocketAddr,
    expected: DeviceId,
) -> Result<Handshaken, TransportError> {
    let connect_err = |reason: String| TransportError::Connect { addr, reason };
    let local = endpoint
        .local_addr()
        .map_err(|e| connect_err(format!("the local endpoint is gone ({e})")))?;
    let context = dial_contexts()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&local)
        .cloned()
        .ok_or_else(|| {
            connect_err("the endpoint was not created by meshfs_daemon::transport::endpoint".into())
        })?;
    let pin = Arc::new(PinnedServer {
        expected,
        presented: Mutex::new(None),
        provider: provider(),
    });
    let config = client_config(&context, pin.clone())?;
    let connecting = endpoint
        .connect_with(config, addr, SERVER_NAME)
        .map_err(|e| connect_err(e.to_string()))?;
    let dial = Dial {
        addr,
        expected,
        our_id: context.device_id,
        our_addr: SocketAddr::new(connecting.local_ip().unwrap_or(local.ip()), local.port()),
        pin,
    };
    let conn = connecting.await.map_err(|e| dial.failed(e))?;
    Ok(Handshaken { conn, dial })
}

/// The TLS and QUIC configuration of one dial: our certificate and key, TLS 1.3 only, no
/// resumption (every connection passes the trust check), and `pin` as the listener's check.
fn client_config(
    context: &DialContext,
    pin: Arc<PinnedServer>,
) -> Result<quinn::ClientConfig, TransportError> {
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(context.key_der.clone()));
    let mut tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_err)?
        .dangerous()
        .with_custom_certificate_verifier(pin)
        .with_client_auth_cert(vec![context.cert.clone()], key)
        .map_err(tls_err)?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    tls.resumption = rustls::client::Resumption::disabled();
    let crypto = QuicClientConfig::try_from(tls).map_err(tls_err)?;
    let mut config = quinn::ClientConfig::new(Arc::new(crypto));
    config.transport_config(context.transport.clone());
    Ok(config)
}

/// One dial under way: what its failures are told with.
struct Dial {
    addr: SocketAddr,
    expected: DeviceId,
    our_id: DeviceId,
    /// Our address as the peer should dial it (our local IP on that path, our port).
    our_addr: SocketAddr,
    pin: Arc<PinnedServer>,
}

impl Dial {
    fn connect_err(&self, reason: String) -> TransportError {
        TransportError::Connect {
            addr: self.addr,
            reason,
        }
    }

    /// What a failed handshake or connection means: refused, a crossed dial, another device,
    /// or a plain connect failure.
    fn failed(&self, e: ConnectionError) -> TransportError {
        if let ConnectionError::ConnectionClosed(close) = &e {
            if is_certificate_alert(u64::from(close.error_code)) {
                return TransportError::Refused {
                    addr: self.addr,
                    our_id: self.our_id,
                    our_addr: self.our_addr,
                };
            }
        }
        if closed_as_duplicate(&e) {
            return TransportError::Duplicate { addr: self.addr };
        }
        // Its daemon is going down: it says so, or its endpoint, closing, refuses new connections.
        if matches!(&e, ConnectionError::ApplicationClosed(close) if close.error_code == CLOSE_STOPPING)
            || matches!(&e, ConnectionError::ConnectionClosed(close)
                if close.error_code == quinn::TransportErrorCode::CONNECTION_REFUSED)
        {
            return TransportError::Stopping { addr: self.addr };
        }
        match self.pin.presented() {
            Some(presented) if presented != self.expected => TransportError::WrongDevice {
                addr: self.addr,
                expected: self.expected,
                presented,
            },
            _ => self.connect_err(match e {
                ConnectionError::TimedOut => {
                    "no answer (is its daemon running and UDP reachable?)".into()
                }
                other => other.to_string(),
            }),
        }
    }

    /// Reads the listener's welcome within [`WELCOME_TIMEOUT`] and returns its instance nonce;
    /// a missing or wrong welcome closes the connection.
    async fn welcome(&self, conn: &quinn::Connection) -> Result<u64, TransportError> {
        let welcome = async {
            let mut recv = conn.accept_uni().await?;
            read_greeting(&mut recv, WELCOME).await
        };
        let outcome = tokio::time::timeout(WELCOME_TIMEOUT, welcome).await;
        let bad_welcome = |reason: String| {
            conn.close(CLOSE_BAD_WELCOME, b"bad welcome");
            Err(self.connect_err(reason))
        };
        match outcome {
            Err(_) => bad_welcome(format!(
                "no welcome within {} s after the handshake",
                WELCOME_TIMEOUT.as_secs()
            )),
            Ok(Err(GreetingError::Lost(e))) => Err(self.failed(e)),
            Ok(Err(bad)) => bad_welcome(bad.to_string()),
            Ok(Ok(n)) => Ok(n),
        }
    }

    /// The welcomed connection, once its certificate is checked again: the verifier pinned
    /// the expected device, and the finished connection must say the same.
    fn established(
        &self,
        conn: quinn::Connection,
        instance: u64,
    ) -> Result<Established, TransportError> {
        match remote_device(&conn) {
            Some(id) if id == self.expected => Ok(Established {
                conn,
                peer: id,
                instance,
            }),
            other => {
                conn.close(CLOSE_WRONG_DEVICE, b"wrong device");
                Err(match other {
                    Some(presented) => TransportError::WrongDevice {
                        addr: self.addr,
                        expected: self.expected,
                        presented,
                    },
                    None => self.connect_err("the peer presented no usable certificate".into()),
                })
            }
        }
    }
}

/// Completes the handshake of a connection coming in on `endpoint` (made by [`endpoint`]) and
/// welcomes the peer (module docs, step 5). Returns the connection and the peer's device id.
///
/// A device not in the trust store fails here with [`TransportError::UnknownDevice`]; the
/// refusal has already been logged and recorded in [`TrustStore::refused`] by then, so the
/// caller's accept loop should just continue. The handshake takes a round trip or more, so
/// run each `accept` in its own task rather than in the loop that calls `Endpoint::accept`.
pub async fn accept(
    endpoint: &quinn::Endpoint,
    incoming: quinn::Incoming,
) -> Result<(quinn::Connection, DeviceId), TransportError> {
    accept_peer(endpoint, incoming)
        .await
        .map(|e| (e.conn, e.peer))
}

/// [`accept`], also returning the dialer's instance nonce (read from its hello within
/// [`WELCOME_TIMEOUT`]). Until the hello is read the connection holds at most
/// [`GREETING_WINDOW`] bytes of the dialer's and no bidirectional stream, and at most
/// [`MAX_WAITING_PER_DEVICE`] connections of one device wait (one more is closed with
/// [`CLOSE_BUSY`]); then it is opened to the endpoint's [`Tuning`].
pub async fn accept_peer(
    endpoint: &quinn::Endpoint,
    incoming: quinn::Incoming,
) -> Result<Established, TransportError> {
    let context = context_of(endpoint).ok_or_else(|| TransportError::Connect {
        addr: incoming.remote_address(),
        reason: "the endpoint was not created by meshfs_daemon::transport::endpoint".into(),
    })?;
    let conn = match incoming.accept()?.await {
        Ok(conn) => conn,
        Err(ConnectionError::TransportError(e)) => {
            return Err(match refused_device_in(&e.reason) {
                Some(id) => TransportError::UnknownDevice(id),
                None => TransportError::Connection(ConnectionError::TransportError(e)),
            })
        }
        Err(e) => return Err(e.into()),
    };
    let Some(id) = remote_device(&conn) else {
        conn.close(CLOSE_WRONG_DEVICE, b"no certificate");
        return Err(TransportError::Connect {
            addr: conn.remote_address(),
            reason: "the peer presented no usable certificate".into(),
        });
    };
    let (window, streams) = context.opened;
    let Some(_waiting) = Waiting::enter(context, id) else {
        conn.close(CLOSE_BUSY, b"too many connections waiting for their hello");
        return Err(TransportError::Connect {
            addr: conn.remote_address(),
            reason: format!(
                "device {id} already has {MAX_WAITING_PER_DEVICE} connections waiting for their hello"
            ),
        });
    };
    send_greeting(&conn, WELCOME).await?;
    let hello = async {
        let mut recv = conn.accept_uni().await?;
        read_greeting(&mut recv, HELLO).await
    };
    let bad = |reason: String| {
        conn.close(CLOSE_BAD_HELLO, b"bad hello");
        TransportError::Connect {
            addr: conn.remote_address(),
            reason,
        }
    };
    match tokio::time::timeout(WELCOME_TIMEOUT, hello).await {
        Err(_) => Err(bad(format!(
            "no hello within {} s after the handshake",
            WELCOME_TIMEOUT.as_secs()
        ))),
        Ok(Err(GreetingError::Lost(e))) => Err(e.into()),
        Ok(Err(other)) => Err(bad(other.to_string())),
        Ok(Ok(instance)) => {
            conn.set_receive_window(VarInt::from_u32(window));
            conn.set_max_concurrent_bi_streams(VarInt::from_u32(streams));
            Ok(Established {
                conn,
                peer: id,
                instance,
            })
        }
    }
}

/// The device id of the peer of `conn` (from its TLS certificate).
pub fn remote_device(conn: &quinn::Connection) -> Option<DeviceId> {
    let certs = conn
        .peer_identity()?
        .downcast::<Vec<CertificateDer<'static>>>()
        .ok()?;
    device_id_of_cert(certs.first()?).ok()
}

/// Writes `msg` as one frame; returns the bytes written (header included).
pub async fn write_message(
    send: &mut quinn::SendStream,
    msg: &Message,
) -> Result<usize, TransportError> {
    let frame = encode_frame(msg)?;
    let len = frame.len();
    // Handed over, not copied: quinn keeps the buffer until the peer acknowledges it.
    send.write_chunk(bytes::Bytes::from(frame)).await?;
    Ok(len)
}

/// Writes a chunk response as one frame without copying its bytes: the frame's head and tail
/// go around the chunk as it was read ([`meshfs_protocol::encode_response_frame`]).
pub async fn write_response(
    send: &mut quinn::SendStream,
    resp: ChunkResponse,
) -> Result<usize, TransportError> {
    let ChunkResponse {
        hash,
        data: Some(data),
        compressed,
    } = resp
    else {
        return write_message(send, &Message::Response(resp)).await;
    };
    let (head, tail) = meshfs_protocol::encode_response_frame(hash, &data, compressed)?;
    let len = head.len() + data.len() + tail.len();
    let mut parts = [
        bytes::Bytes::from(head),
        bytes::Bytes::from(data),
        bytes::Bytes::copy_from_slice(&tail),
    ];
    send.write_all_chunks(&mut parts).await?;
    Ok(len)
}

/// Reads the next frame from `recv`: `Ok(None)` when the stream ended cleanly between
/// frames. A length over [`MAX_FRAME_LEN`] is refused before anything is allocated or read
/// for it; such a stream, or one with a malformed or truncated frame, is stopped with
/// [`STOP_BAD_FRAME`] and yields [`TransportError::Frame`].
///
/// The first byte may take as long as it takes (an idle control stream; keep-alives watch
/// the connection). Once it has come, the frame must go on within [`FRAME_STALL`] and be
/// complete by [`frame_deadline`], or the stream is stopped with [`STOP_BAD_FRAME`] and this
/// yields [`TransportError::Stalled`].
pub async fn read_message(recv: &mut quinn::RecvStream) -> Result<Option<Message>, TransportError> {
    read_frame(recv, None).await
}

/// [`read_message`] on a stream where a message of a known kind is due: its first byte too
/// must come within `wait`, and its frame declare at most `max_len` bytes (refused from the
/// header otherwise, like one over [`MAX_FRAME_LEN`]).
pub async fn read_message_within(
    recv: &mut quinn::RecvStream,
    wait: Duration,
    max_len: usize,
) -> Result<Option<Message>, TransportError> {
    read_frame(recv, Some((wait, max_len))).await
}

/// How long a frame declaring `len` payload bytes may take from its first byte to its last.
pub fn frame_deadline(len: usize) -> Duration {
    FRAME_TIME_BASE + Duration::from_secs(len as u64 / FRAME_MIN_RATE)
}

/// Reads one frame; `due`: the wait for its first byte and its longest length, when a
/// message of a known kind is due.
async fn read_frame(
    recv: &mut quinn::RecvStream,
    due: Option<(Duration, usize)>,
) -> Result<Option<Message>, TransportError> {
    let Some((len, mut clock)) = read_header(recv, due).await? else {
        return Ok(None);
    };
    decode_rest(recv, &mut clock, Vec::new(), len).await
}

/// Reads the rest of a frame of payload length `len` after the `payload` bytes read so far, and
/// decodes it whole.
async fn decode_rest(
    recv: &mut quinn::RecvStream,
    clock: &mut FrameClock,
    mut payload: Vec<u8>,
    len: usize,
) -> Result<Option<Message>, TransportError> {
    let at = payload.len();
    read_into(recv, clock, &mut payload, len - at, at, len, FRAME_PREALLOC).await?;
    decode_payload(&payload)
        .map(Some)
        .map_err(|e| bad_frame(recv, e))
}

/// [`read_message_within`] for the answer to a request for `want`'s chunk. A response carrying
/// that chunk (nearly every frame on a request stream) has its chunk read straight into a
/// buffer of its own ([`meshfs_protocol::response_layout`]), not read into the payload and
/// copied out of it by the decoder; any other frame is read and decoded whole. The message is
/// the same either way.
pub async fn read_response_within(
    recv: &mut quinn::RecvStream,
    wait: Duration,
    max_len: usize,
    want: Hash,
) -> Result<Option<Message>, TransportError> {
    let Some((len, mut clock)) = read_header(recv, Some((wait, max_len))).await? else {
        return Ok(None);
    };
    let Some((head, data_len)) = meshfs_protocol::response_layout(want, len) else {
        return decode_rest(recv, &mut clock, Vec::new(), len).await;
    };
    let mut payload = Vec::new();
    let n = head.len();
    read_into(recv, &mut clock, &mut payload, n, 0, len, FRAME_PREALLOC).await?;
    if payload != head {
        return decode_rest(recv, &mut clock, payload, len).await;
    }
    let mut data = Vec::new();
    read_into(
        recv,
        &mut clock,
        &mut data,
        data_len,
        head.len(),
        len,
        CHUNK_PREALLOC,
    )
    .await?;
    let mut tail = Vec::with_capacity(1);
    read_into(recv, &mut clock, &mut tail, 1, len - 1, len, 1).await?;
    meshfs_protocol::finish_response(want, data, tail[0])
        .map(Some)
        .map_err(|e| bad_frame(recv, e))
}

/// Reads a frame's header within `due` (see [`read_frame`]): its payload length and the clock
/// of the rest, or `None` when the stream ended cleanly between frames.
async fn read_header(
    recv: &mut quinn::RecvStream,
    due: Option<(Duration, usize)>,
) -> Result<Option<(usize, FrameClock)>, TransportError> {
    let mut header = [0u8; FRAME_HEADER_LEN];
    let first = recv.read(&mut header);
    let first = match due {
        None => first.await?,
        Some((wait, _)) => match tokio::time::timeout(wait, first).await {
            Ok(read) => read?,
            Err(_) => return Err(stall(recv, 0, None, wait)),
        },
    };
    let Some(mut filled) = first else {
        return Ok(None);
    };
    let mut clock = FrameClock::new();
    while filled < FRAME_HEADER_LEN {
        match clock.next(recv.read(&mut header[filled..])).await {
            Some(read) => match read? {
                Some(n) => filled += n,
                None => {
                    return Err(bad_frame(
                        recv,
                        CodecError::Malformed(format!(
                            "stream ended after {filled} bytes of a frame header"
                        )),
                    ))
                }
            },
            None => return Err(stall(recv, filled, None, clock.waited())),
        }
    }
    let len = frame_len(header).map_err(|e| bad_frame(recv, e))?;
    debug_assert!(len <= MAX_FRAME_LEN);
    if let Some((_, max_len)) = due.filter(|&(_, max_len)| len > max_len) {
        let e = format!("a frame of {len} bytes where at most {max_len} are expected");
        return Err(bad_frame(recv, CodecError::Malformed(e)));
    }
    clock.declared(len);
    Ok(Some((len, clock)))
}

/// Appends the next `n` bytes of a frame of payload length `len` to `buf`, of which `at` bytes
/// were read before.
///
/// `buf` grows with what arrives instead of being given the declared length up front: a peer
/// that announces 16 MiB frames on a thousand streams and sends nothing costs at most
/// [`FRAME_PREALLOC`] for each stream being read. What it does send is held only for the
/// streams read at once: its control stream, the request streams being served (each frame a
/// few KiB at most) and the responses to this device's own requests.
async fn read_into(
    recv: &mut quinn::RecvStream,
    clock: &mut FrameClock,
    buf: &mut Vec<u8>,
    n: usize,
    at: usize,
    len: usize,
    prealloc: usize,
) -> Result<(), TransportError> {
    let start = buf.len();
    buf.reserve_exact(n.min(prealloc));
    while buf.len() < start + n {
        let got = at + buf.len() - start;
        match clock
            .next(recv.read_chunk(start + n - buf.len(), true))
            .await
        {
            Some(read) => match read? {
                Some(chunk) => buf.extend_from_slice(&chunk.bytes),
                None => {
                    return Err(bad_frame(
                        recv,
                        CodecError::Malformed(format!(
                            "stream ended after {got} of {len} bytes of a frame"
                        )),
                    ))
                }
            },
            None => {
                return Err(stall(
                    recv,
                    FRAME_HEADER_LEN + got,
                    Some(len),
                    clock.waited(),
                ))
            }
        }
    }
    Ok(())
}

/// The deadlines of one frame being read: each read within [`FRAME_STALL`] of the last
/// progress, all of it within [`frame_deadline`] of its first byte.
struct FrameClock {
    started: tokio::time::Instant,
    progress: tokio::time::Instant,
    /// Until the header is complete, the deadline of a frame of unknown length.
    end: tokio::time::Instant,
}

impl FrameClock {
    fn new() -> FrameClock {
        let now = tokio::time::Instant::now();
        FrameClock {
            started: now,
            progress: now,
            end: now + FRAME_TIME_BASE,
        }
    }

    /// The header said how long the frame is.
    fn declared(&mut self, len: usize) {
        self.end = self.started + frame_deadline(len);
    }

    /// Runs one read of the frame; `None` if it missed a deadline.
    async fn next<T>(&mut self, read: impl std::future::Future<Output = T>) -> Option<T> {
        let by = (self.progress + FRAME_STALL).min(self.end);
        let out = tokio::time::timeout_at(by, read).await.ok()?;
        self.progress = tokio::time::Instant::now();
        Some(out)
    }

    fn waited(&self) -> Duration {
        self.started.elapsed()
    }
}

/// Stops a stream whose peer stalled (see [`TransportError::Stalled`]).
fn stall(
    recv: &mut quinn::RecvStream,
    got: usize,
    len: Option<usize>,
    waited: Duration,
) -> TransportError {
    // Fails only if the stream is already finished or stopped: nothing left to stop.
    let _ = recv.stop(STOP_BAD_FRAME);
    TransportError::Stalled { got, len, waited }
}

fn bad_frame(recv: &mut quinn::RecvStream, e: CodecError) -> TransportError {
    // Fails only if the stream is already finished or stopped: nothing left to stop.
    let _ = recv.stop(STOP_BAD_FRAME);
    TransportError::Frame(e)
}

/// Traffic and path figures of a connection, for `status` and benchmarks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkStats {
    /// UDP payload bytes sent (QUIC overhead included).
    pub bytes_sent: u64,
    /// UDP payload bytes received.
    pub bytes_received: u64,
    /// Smoothed round-trip time.
    pub rtt: Duration,
    /// Congestion window, bytes.
    pub cwnd: u64,
    /// Packets declared lost.
    pub lost_packets: u64,
    /// Bytes declared lost (each sent again).
    pub lost_bytes: u64,
    /// Congestion events (loss or ECN) so far.
    pub congestion_events: u64,
}

/// The [`LinkStats`] of `conn` now.
pub fn link_stats(conn: &quinn::Connection) -> LinkStats {
    let s = conn.stats();
    LinkStats {
        bytes_sent: s.udp_tx.bytes,
        bytes_received: s.udp_rx.bytes,
        rtt: s.path.rtt,
        cwnd: s.path.cwnd,
        lost_packets: s.path.lost_packets,
        lost_bytes: s.path.lost_bytes,
        congestion_events: s.path.congestion_events,
    }
}

/// Whether the listener closed a dial as the duplicate of a connection it dialed itself.
pub(crate) fn closed_as_duplicate(e: &ConnectionError) -> bool {
    matches!(e, ConnectionError::ApplicationClosed(close) if close.error_code == CLOSE_DUPLICATE)
}

/// QUIC `0x100 + alert` codes by which a TLS stack says it rejected our certificate.
fn is_certificate_alert(code: u64) -> bool {
    // bad_certificate 42, unsupported_certificate 43, certificate_revoked 44,
    // certificate_expired 45, certificate_unknown 46, unknown_ca 48, access_denied 49,
    // certificate_required 116.
    matches!(code.checked_sub(0x100), Some(42..=46 | 48 | 49 | 116))
}

/// The device id our [`TrustedClients`] verifier named in a handshake error text.
fn refused_device_in(reason: &str) -> Option<DeviceId> {
    let start = reason.find(UNTRUSTED_MARKER)? + UNTRUSTED_MARKER.len();
    let rest = reason.get(start..)?;
    let end = rest
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

/// The error a verifier returns to refuse a device; its text names the device. rustls puts
/// the `Debug` form into the handshake error, so both forms are the same text.
struct Untrusted(DeviceId);

impl std::fmt::Debug for Untrusted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

impl std::fmt::Display for Untrusted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{UNTRUSTED_MARKER}{} (not in this device's peer list)",
            self.0
        )
    }
}

impl std::error::Error for Untrusted {}

fn unparseable_cert(e: impl std::fmt::Display) -> rustls::Error {
    tracing::debug!("peer certificate rejected: {e}");
    rustls::Error::InvalidCertificate(CertificateError::BadEncoding)
}

fn tls13_only() -> Result<HandshakeSignatureValid, rustls::Error> {
    Err(rustls::Error::PeerIncompatible(
        rustls::PeerIncompatible::Tls12NotOffered,
    ))
}

/// The listener's check of a dialer: its device id must be in the trust store.
#[derive(Debug)]
struct TrustedClients {
    trust: TrustStore,
    provider: Arc<CryptoProvider>,
}

impl ClientCertVerifier for TrustedClients {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let id = device_id_of_cert(end_entity).map_err(unparseable_cert)?;
        if self.trust.contains(&id) {
            return Ok(ClientCertVerified::assertion());
        }
        match self
            .trust
            .record_refusal(id, Instant::now(), SystemTime::now())
        {
            RefusalNote::Warn => tracing::warn!(
                "refused a connection from unknown device {id}: if it is yours, run `meshfs peer add {id} --addr HOST:PORT` (its address)"
            ),
            RefusalNote::Again => tracing::debug!("refused unknown device {id} again"),
            RefusalNote::Counted { summary_at } => {
                tracing::debug!("refused unknown device {id}");
                if let Some(at) = summary_at {
                    log_unlogged_refusals(self.trust.clone(), at);
                }
            }
        }
        Err(rustls::Error::InvalidCertificate(CertificateError::Other(
            rustls::OtherError(Arc::new(Untrusted(id))),
        )))
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        tls13_only()
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// At `at`, logs in one line how many refusals went without a warning of their own.
fn log_unlogged_refusals(trust: TrustStore, at: Instant) {
    // Verifiers run on quinn's tasks, inside the runtime; without one there is no log to
    // keep tidy.
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(async move {
        tokio::time::sleep_until(at.into()).await;
        let n = trust.take_unlogged();
        if n > 0 {
            tracing::warn!(
                "refused {n} more connections from unknown devices in the last {} s without a line each (a device making a new key for every attempt?); `meshfs status` lists the most recent",
                REFUSAL_LOG_WINDOW.as_secs()
            );
        }
    });
}

/// The dialer's check of a listener: its device id must be the one dialed.
#[derive(Debug)]
struct PinnedServer {
    expected: DeviceId,
    /// The id the listener presented, for the error message.
    presented: Mutex<Option<DeviceId>>,
    provider: Arc<CryptoProvider>,
}

impl PinnedServer {
    fn presented(&self) -> Option<DeviceId> {
        *self.presented.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl ServerCertVerifier for PinnedServer {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let id = device_id_of_cert(end_entity).map_err(unparseable_cert)?;
        *self.presented.lock().unwrap_or_else(|e| e.into_inner()) = Some(id);
        if id == self.expected {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::ApplicationVerificationFailure,
            ))
        }
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        tls13_only()
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// quinn's BBR with a least congestion window. BBR sets its window to gain × bandwidth × min
/// RTT; where the min RTT is tens of microseconds (a LAN, loopback) that is a few packets, and
/// quinn's bandwidth samples, clocked by the peer's ACKs, then barely grow it. Measured on
/// loopback, the window fell from 240 KB to 5,808 bytes (four packets) as the first index batch
/// went out and stayed there ~200 ms: 3.6 MB took 230–270 ms to arrive, 50–90 ms with a 256 KiB
/// floor. Wherever bandwidth × RTT is above the floor (1 Gbit/s × 90 ms is 11 MB) BBR's own
/// window rules; on a slow long path the floor may queue up to itself at the bottleneck.
struct FlooredBbr {
    floor: u64,
    inner: Arc<quinn::congestion::BbrConfig>,
}

impl quinn::congestion::ControllerFactory for FlooredBbr {
    fn build(
        self: Arc<Self>,
        now: std::time::Instant,
        current_mtu: u16,
    ) -> Box<dyn quinn::congestion::Controller> {
        Box::new(Floored {
            floor: self.floor,
            inner: self.inner.clone().build(now, current_mtu),
        })
    }
}

/// One connection's [`FlooredBbr`] controller.
struct Floored {
    floor: u64,
    inner: Box<dyn quinn::congestion::Controller>,
}

impl quinn::congestion::Controller for Floored {
    fn on_sent(&mut self, now: std::time::Instant, bytes: u64, last_packet_number: u64) {
        self.inner.on_sent(now, bytes, last_packet_number)
    }
    fn on_ack(
        &mut self,
        now: std::time::Instant,
        sent: std::time::Instant,
        bytes: u64,
        app_limited: bool,
        rtt: &quinn_proto::RttEstimator,
    ) {
        self.inner.on_ack(now, sent, bytes, app_limited, rtt)
    }
    fn on_end_acks(
        &mut self,
        now: std::time::Instant,
        in_flight: u64,
        app_limited: bool,
        largest_packet_num_acked: Option<u64>,
    ) {
        self.inner
            .on_end_acks(now, in_flight, app_limited, largest_packet_num_acked)
    }
    fn on_congestion_event(
        &mut self,
        now: std::time::Instant,
        sent: std::time::Instant,
        is_persistent_congestion: bool,
        lost_bytes: u64,
    ) {
        self.inner
            .on_congestion_event(now, sent, is_persistent_congestion, lost_bytes)
    }
    fn on_mtu_update(&mut self, new_mtu: u16) {
        self.inner.on_mtu_update(new_mtu)
    }
    fn window(&self) -> u64 {
        self.inner.window().max(self.floor)
    }
    fn clone_box(&self) -> Box<dyn quinn::congestion::Controller> {
        Box::new(Floored {
            floor: self.floor,
            inner: self.inner.clone_box(),
        })
    }
    fn initial_window(&self) -> u64 {
        self.inner.initial_window()
    }
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any> {
        self
    }
}

/// A congestion window from the delivery rate: gain × the most the path delivered in the last
/// ten round trips × min RTT (at least [`BDP_LEAST_RTT`]), never below a floor. BBR's model (v1) without its pacing gains,
/// which quinn does not apply anyway: quinn paces by window ÷ smoothed RTT.
///
/// Why not quinn's BBR ([`FlooredBbr`], still selectable): its bandwidth samples are the rate
/// between two consecutive sends or ACKs, so the max filter takes the fastest burst for the
/// path; its window is 2.885 × that in startup (which goes on for three rounds after the link
/// is full) and 2 × plus the ACK aggregation it saw after, with no reduction on loss outside
/// recovery. Through the bench's 1 Gbit/s × 90 ms drop-tail queue of one bandwidth-delay
/// product it overfilled the queue all along (57 % of the bytes it delivered were dropped and
/// sent again, run `2026-11-25_213643`); and a window held at the floor for a few rounds made
/// it end startup early and creep up for a second.
///
/// Here each acknowledged packet gives a sample as BBR's do (bytes delivered while it was in
/// flight over the longer of its send and ACK intervals, at least a min RTT; see
/// [`DeliveryRate`]). While the rate grows by 25 % a round the window is [`STARTUP_GAIN`] × BDP
/// (slow start: it doubles each round, but never past twice what the path delivers); after
/// three rounds without, or at the first loss, [`STEADY_GAIN`] × BDP, which keeps a link full
/// with half a BDP queued, and still grows by half a round when the path allows more. Loss
/// alone does not shrink the window (random loss on long paths would starve a loss-based
/// controller, see [`CongestionControl`]); persistent congestion starts the measurement over.
/// The floor: where the min RTT is tens of microseconds (a LAN, loopback) gain × BDP is a few
/// packets; quinn's BBR, held there, took 230–270 ms to move a 3.6 MB index batch on loopback
/// (50–90 ms with a 256 KiB floor, D20).
struct RateWindowConfig {
    floor: u64,
}

/// Window gain over the measured bandwidth-delay product while the delivery rate still grows.
pub const STARTUP_GAIN: f64 = 2.0;
/// Window gain once the delivery rate stopped growing.
pub const STEADY_GAIN: f64 = 1.5;

impl quinn::congestion::ControllerFactory for RateWindowConfig {
    fn build(
        self: Arc<Self>,
        _now: std::time::Instant,
        _current_mtu: u16,
    ) -> Box<dyn quinn::congestion::Controller> {
        Box::new(RateWindow {
            floor: self.floor,
            rate: DeliveryRate::default(),
        })
    }
}

/// One connection's [`RateWindowConfig`] controller.
#[derive(Clone)]
struct RateWindow {
    floor: u64,
    rate: DeliveryRate,
}

impl quinn::congestion::Controller for RateWindow {
    fn on_sent(&mut self, now: std::time::Instant, _bytes: u64, _last_packet_number: u64) {
        self.rate.on_sent(now);
    }
    fn on_ack(
        &mut self,
        now: std::time::Instant,
        sent: std::time::Instant,
        bytes: u64,
        app_limited: bool,
        rtt: &quinn_proto::RttEstimator,
    ) {
        self.rate.on_ack(now, sent, bytes, app_limited, rtt.min());
    }
    fn on_congestion_event(
        &mut self,
        _now: std::time::Instant,
        _sent: std::time::Instant,
        is_persistent_congestion: bool,
        _lost_bytes: u64,
    ) {
        if is_persistent_congestion {
            // Nothing got through for several RTOs: the path is not the one measured.
            self.rate = DeliveryRate::default();
        } else {
            self.rate.on_loss();
        }
    }
    fn on_mtu_update(&mut self, _new_mtu: u16) {}
    fn window(&self) -> u64 {
        self.rate.window().unwrap_or(0).max(self.floor)
    }
    fn clone_box(&self) -> Box<dyn quinn::congestion::Controller> {
        Box::new(self.clone())
    }
    fn initial_window(&self) -> u64 {
        self.floor
    }
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any> {
        self
    }
}

/// Rounds the delivery rate's maximum is kept over (BBR's bandwidth filter: ten rounds).
const RATE_ROUNDS: usize = 10;
/// Rounds without 25 % more delivery rate after which the rate counts as found (BBR's
/// startup exit).
const RATE_FLAT_ROUNDS: u32 = 3;
/// Least RTT the bandwidth-delay product is taken over. A LAN's idle min RTT (tens of
/// microseconds) is not what a loaded transfer sees: the receiver's ACK delay and processing add
/// milliseconds, and a window of gain × rate × 60 µs sat at the floor. With this, one 512 MiB
/// file on the bench's lan took 1.75 s (1.68–1.76) instead of 1.96 s (1.89–1.97), as with
/// quinn's BBR (1.74 s; runs `2026-11-25_224238`, `_223442`, `_223655`); 2 ms gave 1.81 s. Paths
/// whose min RTT is above it (any WAN) are not affected.
const BDP_LEAST_RTT: Duration = Duration::from_millis(5);
/// Sends closer together than this share one snapshot of the delivery state.
const SNAPSHOT_EVERY: Duration = Duration::from_micros(100);
/// Most snapshots kept (at [`SNAPSHOT_EVERY`], 0.8 s of sending: longer flights give no sample).
const MAX_SNAPSHOTS: usize = 8192;

/// The delivery state when a packet was sent (BBR's per-packet `delivered`,
/// `delivered_time` and `first_sent_time`), kept per [`SNAPSHOT_EVERY`] of sending.
#[derive(Clone, Copy)]
struct Snapshot {
    at: std::time::Instant,
    delivered: u64,
    delivered_at: std::time::Instant,
    first_sent: std::time::Instant,
}

/// The delivery rate of a connection, sampled per acknowledged packet as BBR does (bytes
/// delivered while the packet was in flight, over the longer of its send and ACK intervals, so
/// a burst of late ACKs does not look like a faster path), the most of the last
/// [`RATE_ROUNDS`] round trips; a sample taken while the sender ran out of data counts only if
/// it raises the maximum.
#[derive(Clone, Default)]
struct DeliveryRate {
    /// Bytes acknowledged so far, when the last was, and when the packet it acknowledged was
    /// sent.
    delivered: u64,
    delivered_at: Option<std::time::Instant>,
    first_sent: Option<std::time::Instant>,
    sends: std::collections::VecDeque<Snapshot>,
    min_rtt: Duration,
    /// The current round trip ends with the ACK of a packet sent at or after this.
    round_start: Option<std::time::Instant>,
    /// Most of the current round, and whether the sender ran out of data in it.
    round_max: u64,
    round_app_limited: bool,
    /// Most of each of the last rounds, a ring.
    rounds: [u64; RATE_ROUNDS],
    next: usize,
    /// The rate the growth check compares with, and rounds since it last grew by 25 %.
    grown_to: u64,
    flat: u32,
}

impl DeliveryRate {
    fn on_sent(&mut self, now: std::time::Instant) {
        if self
            .sends
            .back()
            .is_some_and(|b| now.saturating_duration_since(b.at) < SNAPSHOT_EVERY)
        {
            return;
        }
        if self.sends.len() >= MAX_SNAPSHOTS {
            self.sends.pop_front();
        }
        self.sends.push_back(Snapshot {
            at: now,
            delivered: self.delivered,
            delivered_at: self.delivered_at.unwrap_or(now),
            first_sent: self.first_sent.unwrap_or(now),
        });
    }

    fn on_ack(
        &mut self,
        now: std::time::Instant,
        sent: std::time::Instant,
        bytes: u64,
        app_limited: bool,
        min_rtt: Duration,
    ) {
        self.min_rtt = min_rtt;
        self.delivered += bytes;
        self.delivered_at = Some(now);
        self.first_sent = Some(sent);
        self.round_app_limited |= app_limited;
        // The newest snapshot taken at or before this packet's send.
        while self.sends.len() >= 2 && self.sends[1].at <= sent {
            self.sends.pop_front();
        }
        if let Some(snap) = self.sends.front().filter(|s| s.at <= sent) {
            let interval = sent
                .saturating_duration_since(snap.first_sent)
                .max(now.saturating_duration_since(snap.delivered_at));
            // Shorter than a round trip, a sample measures a burst, not the path.
            if !min_rtt.is_zero() && interval >= min_rtt {
                let rate =
                    ((self.delivered - snap.delivered) as f64 / interval.as_secs_f64()) as u64;
                if !app_limited || rate > self.max() {
                    self.round_max = self.round_max.max(rate);
                }
            }
        }
        match self.round_start {
            None => self.round_start = Some(now),
            Some(start) if sent >= start => self.end_round(now),
            Some(_) => {}
        }
    }

    fn end_round(&mut self, now: std::time::Instant) {
        // A round in which the sender ran short of data says nothing of the path unless it
        // delivered more: the filter ages only with rounds that measured it (as BBR's does, so
        // an idle connection keeps its estimate).
        if !self.round_app_limited
            || self.round_max > self.rounds.iter().copied().max().unwrap_or(0)
        {
            self.rounds[self.next] = self.round_max;
            self.next = (self.next + 1) % RATE_ROUNDS;
        }
        if !self.round_app_limited {
            let max = self.max();
            if max as f64 >= self.grown_to as f64 * 1.25 {
                self.grown_to = max;
                self.flat = 0;
            } else {
                self.flat = self.flat.saturating_add(1);
            }
        }
        self.round_max = 0;
        self.round_app_limited = false;
        self.round_start = Some(now);
    }

    /// Bytes per second (0: not measured yet).
    fn max(&self) -> u64 {
        self.rounds
            .iter()
            .copied()
            .max()
            .unwrap_or(0)
            .max(self.round_max)
    }

    /// Whether the rate still grows (startup).
    fn growing(&self) -> bool {
        self.flat < RATE_FLAT_ROUNDS
    }

    /// A loss ends startup (as it does BBR's): the window had outgrown the path's queue.
    fn on_loss(&mut self) {
        self.flat = self.flat.max(RATE_FLAT_ROUNDS);
    }

    /// The window: [`STARTUP_GAIN`] × the measured bandwidth-delay product while the rate
    /// grows, [`STEADY_GAIN`] × once it stopped (`None`: no measurement yet).
    fn window(&self) -> Option<u64> {
        let max = self.max();
        if max == 0 {
            return None;
        }
        let gain = if self.growing() {
            STARTUP_GAIN
        } else {
            STEADY_GAIN
        };
        let rtt = self.min_rtt.max(BDP_LEAST_RTT);
        Some((max as f64 * rtt.as_secs_f64() * gain) as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Drives `rate` with 1,000-byte packets every `gap`, each acknowledged `rtt` after it was
    /// sent, from `from` for `dur`; `app_limited` as quinn would report it. Returns the end.
    fn drive(
        rate: &mut DeliveryRate,
        from: std::time::Instant,
        dur: Duration,
        gap: Duration,
        rtt: Duration,
        app_limited: bool,
    ) -> std::time::Instant {
        let mut now = from;
        while now < from + dur {
            rate.on_sent(now);
            if now >= from + rtt {
                rate.on_ack(now, now - rtt, 1000, app_limited, rtt);
            }
            now += gap;
        }
        now
    }

    #[test]
    fn the_rate_window_is_one_and_a_half_measured_bdps_once_the_rate_stops_growing() {
        let t0 = std::time::Instant::now();
        let rtt = Duration::from_millis(50);
        let mut rate = DeliveryRate::default();
        assert_eq!(rate.window(), None, "nothing measured yet");
        // 1,000 bytes every 100 µs: 10 MB/s, a BDP of 500,000 bytes.
        let now = drive(
            &mut rate,
            t0,
            rtt * 2,
            Duration::from_micros(100),
            rtt,
            false,
        );
        assert!(
            rate.growing(),
            "one round in, the rate has not stopped growing"
        );
        let w = rate.window().expect("measured") as f64;
        assert!(
            (w - 1_000_000.0).abs() < 50_000.0,
            "startup: 2 BDPs, got {w}"
        );
        drive(
            &mut rate,
            now,
            rtt * 10,
            Duration::from_micros(100),
            rtt,
            false,
        );
        assert!(!rate.growing());
        let w = rate.window().expect("measured") as f64;
        assert!(
            (w - 750_000.0).abs() < 37_500.0,
            "steady: 1.5 BDPs, got {w}"
        );
    }

    #[test]
    fn on_a_lan_the_bdp_is_taken_over_at_least_five_milliseconds() {
        let t0 = std::time::Instant::now();
        let rtt = Duration::from_micros(100);
        let mut rate = DeliveryRate::default();
        // 1,000 bytes every 10 µs (100 MB/s) for 100 round trips: steady.
        drive(
            &mut rate,
            t0,
            rtt * 100,
            Duration::from_micros(10),
            rtt,
            false,
        );
        assert!(!rate.growing());
        let w = rate.window().expect("measured") as f64;
        // 1.5 × 100 MB/s × 5 ms, not × 100 µs.
        assert!((w - 750_000.0).abs() < 75_000.0, "got {w}");
    }

    #[test]
    fn a_loss_ends_startup_and_a_slower_idle_sender_keeps_the_estimate() {
        let t0 = std::time::Instant::now();
        let rtt = Duration::from_millis(50);
        let mut rate = DeliveryRate::default();
        let now = drive(
            &mut rate,
            t0,
            rtt * 2,
            Duration::from_micros(100),
            rtt,
            false,
        );
        assert!(rate.growing());
        rate.on_loss();
        assert!(!rate.growing());
        let steady = rate.window().expect("measured");
        // Twenty round trips at a tenth of the rate, short of data: the estimate stays.
        drive(
            &mut rate,
            now,
            rtt * 20,
            Duration::from_millis(1),
            rtt,
            true,
        );
        assert_eq!(rate.window(), Some(steady));
    }

    #[test]
    fn the_rate_window_never_falls_below_the_floor() {
        use quinn::congestion::ControllerFactory;
        let now = std::time::Instant::now();
        let c = Arc::new(RateWindowConfig { floor: 256 << 10 }).build(now, 1200);
        assert_eq!(c.window(), 256 << 10);
        assert_eq!(c.initial_window(), 256 << 10);
        assert_eq!(c.clone_box().window(), 256 << 10);
    }

    #[test]
    fn bbr_window_never_falls_below_the_floor() {
        use quinn::congestion::{Controller, ControllerFactory};
        let now = std::time::Instant::now();
        let bbr = |floor| {
            Arc::new(FlooredBbr {
                floor,
                inner: Arc::new(quinn::congestion::BbrConfig::default()),
            })
            .build(now, 1200)
        };
        let plain: Box<dyn Controller> = bbr(0);
        let initial = plain.window();
        assert!(initial > 0 && initial < 1 << 20);
        assert_eq!(bbr(1 << 20).window(), 1 << 20, "a floor above BBR's window");
        assert_eq!(bbr(1).window(), initial, "BBR's window above the floor");
        assert_eq!(bbr(1 << 20).clone_box().window(), 1 << 20);
    }

    #[test]
    fn a_close_with_the_duplicate_code_is_a_crossed_dial_not_a_failure() {
        let closed = |code: VarInt| {
            ConnectionError::ApplicationClosed(quinn::ApplicationClose {
                error_code: code,
                reason: bytes::Bytes::from_static(b"duplicate connection"),
            })
        };
        assert!(closed_as_duplicate(&closed(CLOSE_DUPLICATE)));
        assert!(!closed_as_duplicate(&closed(CLOSE_WRONG_DEVICE)));
        assert!(!closed_as_duplicate(&closed(VarInt::from_u32(0))));
        assert!(!closed_as_duplicate(&ConnectionError::TimedOut));
    }

    #[test]
    fn a_wrong_greeting_is_reported_with_the_bytes_the_peer_sent() {
        let bad = GreetingError::Unexpected {
            got: vec![0x47, 0x45, 0x54],
            tag: HELLO,
        };
        assert_eq!(
            bad.to_string(),
            format!("it sent [47, 45, 54] instead of the meshfs/1 greeting {HELLO:02x}")
        );
    }

    #[test]
    fn certificate_alerts_are_recognized_as_refusals() {
        assert!(is_certificate_alert(0x12e));
        assert!(is_certificate_alert(0x131));
        assert!(!is_certificate_alert(0x178)); // no_application_protocol
        assert!(!is_certificate_alert(0x0a));
    }

    #[test]
    fn our_refusal_text_names_the_device() {
        let id = DeviceId::from_bytes([9; 32]);
        let text = format!("invalid peer certificate: {}", Untrusted(id));
        assert_eq!(refused_device_in(&text), Some(id));
        let text = format!(
            "invalid peer certificate: Other(OtherError({:?}))",
            Untrusted(id)
        );
        assert_eq!(refused_device_in(&text), Some(id));
        assert_eq!(
            refused_device_in("invalid peer certificate: BadEncoding"),
            None
        );
    }

    #[test]
    fn refusals_are_bounded_and_most_recent_first() {
        let trust = TrustStore::default();
        let (now, wall) = (Instant::now(), SystemTime::now());
        for i in 0..40u8 {
            let note = trust.record_refusal(DeviceId::from_bytes([i; 32]), now, wall);
            assert_ne!(note, RefusalNote::Again);
        }
        assert_eq!(
            trust.record_refusal(DeviceId::from_bytes([39; 32]), now, wall),
            RefusalNote::Again
        );
        let refused = trust.refused();
        assert_eq!(refused.len(), REFUSED_CAPACITY);
        assert_eq!(refused[0].0, DeviceId::from_bytes([39; 32]));
        trust.add(DeviceId::from_bytes([39; 32]));
        assert_eq!(trust.refused().len(), REFUSED_CAPACITY - 1);
    }

    #[test]
    fn a_device_with_a_new_key_every_time_gets_a_few_warnings_and_a_count() {
        let trust = TrustStore::default();
        let start = Instant::now();
        let wall = SystemTime::now();
        let refuse = |i: u32, at: Duration| {
            let mut id = [0u8; 32];
            id[..4].copy_from_slice(&i.to_be_bytes());
            trust.record_refusal(DeviceId::from_bytes(id), start + at, wall + at)
        };
        let notes: Vec<RefusalNote> = (0..10_000)
            .map(|i| refuse(i, Duration::from_millis(u64::from(i))))
            .collect();
        let warned = notes.iter().filter(|n| **n == RefusalNote::Warn).count();
        assert_eq!(warned, REFUSAL_WARNINGS_PER_WINDOW as usize);
        let summaries: Vec<Instant> = notes
            .iter()
            .filter_map(|n| match n {
                RefusalNote::Counted { summary_at } => *summary_at,
                _ => None,
            })
            .collect();
        // One summary for the window, at its end, counting everything past the warnings.
        assert_eq!(summaries, vec![start + REFUSAL_LOG_WINDOW]);
        assert_eq!(trust.take_unlogged(), 10_000 - warned as u64);
        assert_eq!(trust.take_unlogged(), 0);
        assert_eq!(trust.refused().len(), REFUSED_CAPACITY);
        // The next window may warn again.
        assert_eq!(refuse(20_000, REFUSAL_LOG_WINDOW * 2), RefusalNote::Warn);
    }
}
