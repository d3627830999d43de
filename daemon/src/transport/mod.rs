//! The peer transport: QUIC (quinn) with mutual TLS 1.3 (rustls, ring provider) where each
//! end pins the other's [`DeviceId`], plus reading and writing framed [`Message`]s on streams.
//!
//! This module owns the endpoint (its UDP socket, TLS and transport tuning), the trust check
//! during the handshake, the welcome that tells a dialer it was accepted, and the frame IO.
//! It never decides what to say to a peer (that is the session) and never touches files.
//!
//! The modules: [`trust`] (who may connect), [`endpoint`] (socket, tuning, instance),
//! [`handshake`] (dial, accept, welcome, hello), [`frames`] (messages on streams),
//! [`congestion`] (the controllers), [`lane`] (the bulk lane over TCP, D105); this file holds the wire constants, the error and the
//! connection's figures.
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

mod congestion;
mod endpoint;
mod frames;
mod handshake;
mod lane;
mod trust;

pub use congestion::*;
pub use endpoint::*;
pub use frames::*;
pub use handshake::*;
pub use lane::*;
pub use trust::*;

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
    /// Reading from or writing to the bulk lane's byte stream failed.
    #[error("bulk lane to the peer failed: {0}")]
    Stream(std::io::Error),
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

/// Traffic and path figures of a connection, for `status` and benchmarks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkStats {
    /// UDP payload bytes sent (QUIC overhead included), and TCP payload bytes on the
    /// connection's bulk lanes ([`lane_bytes`]).
    pub bytes_sent: u64,
    /// UDP payload bytes received, and TCP payload bytes on its bulk lanes.
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

/// The [`LinkStats`] of `conn` now, its bulk lanes' bytes included.
pub fn link_stats(conn: &quinn::Connection) -> LinkStats {
    let s = conn.stats();
    let (lane_sent, lane_received) = lane_bytes(conn);
    LinkStats {
        bytes_sent: s.udp_tx.bytes + lane_sent,
        bytes_received: s.udp_rx.bytes + lane_received,
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
