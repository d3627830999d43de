//! The bulk lane (D105): a TCP connection with TLS 1.3 beside a QUIC connection, carrying
//! chunk requests and their responses when a fetch is large and the path short. On a LAN, TCP
//! with TLS in userspace moved the same bytes in 0.40–0.64× QUIC's time at under half its CPU
//! (`bench/README.md`, "The transport decision"); on a long path QUIC was faster, and QUIC
//! stays the carrier of everything else.
//!
//! This module owns the lane's connection: its listener (TCP, on the QUIC socket's address and
//! port), the dial, the TLS (the QUIC endpoint's own: the same certificates, pins and trust
//! store), and the binding that ties a lane to one live QUIC connection. What goes over a bound
//! lane (frames of chunk requests and responses) is `chunks`'s.
//!
//! # Wire protocol
//!
//! 1. The fetching device dials TCP to the address and port its QUIC connection's peer sends
//!    from, and runs TLS 1.3 over it exactly as a QUIC dial's: ALPN `meshfs/1`, SNI `meshfs`,
//!    both certificates checked as in [`super`]'s handshake (the dialer pins the expected
//!    device, the listener admits only devices in its trust store).
//! 2. The dialer writes [`LANE_HELLO`] (`0x03`) and 32 bytes of keying material exported from
//!    the QUIC connection's TLS session with the label [`LANE_LABEL`] (`meshfs bulk lane`) and
//!    an empty context (RFC 8446 §7.5). Both ends of that QUIC connection, and only they, can
//!    compute it.
//! 3. The listener reads those 33 bytes within [`LANE_HELLO_TIMEOUT`] (10 s) and looks for a live QUIC
//!    connection of the TLS peer's device whose exported material is the same. Found: it writes
//!    [`LANE_BOUND`] (`0x01`) and the lane belongs to that connection's session. Not found (a
//!    stranger cannot get this far; a lane of a connection already gone, or of another
//!    device's connection): it closes the TCP connection without a byte.
//! 4. On a bound lane the dialer writes chunk request frames (the same frames as on a QUIC
//!    request stream) one after another without waiting, and the listener answers them in
//!    order: every response of a request before any of the next. An `Error` frame answers a
//!    refused request and is the lane's last. Either end closes the lane when the QUIC
//!    connection it is bound to ends.

use super::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The exporter label that binds a lane to its QUIC connection.
pub const LANE_LABEL: &[u8] = b"meshfs bulk lane";
/// The first byte a lane's dialer writes, followed by the 32-byte binding.
pub const LANE_HELLO: u8 = 0x03;
/// The byte a lane's listener answers a binding it found with.
pub const LANE_BOUND: u8 = 0x01;
/// How long a dialer waits for the lane's TCP connection.
pub const LANE_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a dialer waits for the lane's TLS handshake and [`LANE_BOUND`]: a lane is dialed
/// only on a short path (a few ms of round trip), and a fetch may be waiting for it.
pub const LANE_DIAL_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a listener looks for the connection a lane names before it refuses the lane.
pub const LANE_BIND_WAIT: Duration = Duration::from_secs(1);
/// How long a listener waits for a dialer's TLS handshake and hello.
pub const LANE_HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// A lane's byte stream, either end.
pub type LaneStream = tokio_rustls::TlsStream<Counted>;

/// A lane's TCP connection, its bytes counted (TLS records and all, as QUIC's are counted as
/// UDP payload) into the figures of the QUIC connection it is bound to ([`lane_bytes`]).
#[derive(Debug)]
pub struct Counted {
    tcp: tokio::net::TcpStream,
    bytes: Arc<LaneBytes>,
}

/// Bytes (sent, received) on the lanes of one QUIC connection, both directions' lanes summed.
#[derive(Default, Debug)]
pub struct LaneBytes {
    sent: std::sync::atomic::AtomicU64,
    received: std::sync::atomic::AtomicU64,
}

impl LaneBytes {
    fn add(&self, sent: u64, received: u64) {
        use std::sync::atomic::Ordering::Relaxed;
        self.sent.fetch_add(sent, Relaxed);
        self.received.fetch_add(received, Relaxed);
    }

    fn get(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (self.sent.load(Relaxed), self.received.load(Relaxed))
    }
}

/// The lanes' bytes by the binding of the QUIC connection they are bound to (unique to that
/// connection, unlike its `stable_id`, which a later connection may reuse).
fn lane_counters() -> &'static Mutex<HashMap<[u8; 32], Arc<LaneBytes>>> {
    static COUNTERS: OnceLock<Mutex<HashMap<[u8; 32], Arc<LaneBytes>>>> = OnceLock::new();
    COUNTERS.get_or_init(Default::default)
}

impl Counted {
    fn new(tcp: tokio::net::TcpStream) -> Counted {
        Counted {
            tcp,
            bytes: Arc::default(),
        }
    }

    /// From now on counts into `conn`'s lane figures, with what was counted so far.
    fn bound_to(&mut self, binding: [u8; 32]) {
        let shared = lane_counters()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(binding)
            .or_default()
            .clone();
        let (sent, received) = self.bytes.get();
        shared.add(sent, received);
        self.bytes = shared;
    }

    /// The TCP connection.
    pub fn tcp(&self) -> &tokio::net::TcpStream {
        &self.tcp
    }
}

impl tokio::io::AsyncRead for Counted {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = std::pin::Pin::new(&mut self.tcp).poll_read(cx, buf);
        let n = buf.filled().len() - before;
        self.bytes.add(0, n as u64);
        polled
    }
}

impl tokio::io::AsyncWrite for Counted {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let polled = std::pin::Pin::new(&mut self.tcp).poll_write(cx, buf);
        if let std::task::Poll::Ready(Ok(n)) = polled {
            self.bytes.add(n as u64, 0);
        }
        polled
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.tcp).poll_shutdown(cx)
    }
}

/// Bytes (sent, received) so far on the lanes bound to `conn`, both directions' (TCP payload:
/// TLS records, as [`link_stats`] counts QUIC's UDP payload).
pub fn lane_bytes(conn: &quinn::Connection) -> (u64, u64) {
    let Ok(binding) = lane_binding(conn) else {
        return (0, 0);
    };
    lane_counters()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&binding)
        .map_or((0, 0), |b| b.get())
}

/// Forgets the lane figures of `conn`, a connection that has ended and been read a last time.
pub fn forget_lanes(conn: &quinn::Connection) {
    if let Ok(binding) = lane_binding(conn) {
        lane_counters()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&binding);
    }
}

/// The 32 bytes that bind a lane to `conn` (both ends compute the same).
pub fn lane_binding(conn: &quinn::Connection) -> Result<[u8; 32], TransportError> {
    let mut out = [0u8; 32];
    conn.export_keying_material(&mut out, LANE_LABEL, b"")
        .map_err(|_| TransportError::Tls("cannot export keying material for the lane".into()))?;
    Ok(out)
}

/// Listens for lanes on TCP at `endpoint`'s address and port, with the endpoint's TLS
/// (`identity`'s certificate, devices in `trust` admitted).
pub async fn lane_listener(
    endpoint: &quinn::Endpoint,
    identity: &Identity,
    trust: TrustStore,
) -> Result<(tokio::net::TcpListener, tokio_rustls::TlsAcceptor), TransportError> {
    let io = |context: String| move |source| TransportError::Io { context, source };
    let at = endpoint
        .local_addr()
        .map_err(io("cannot read the QUIC endpoint's address".into()))?;
    let listener = tokio::net::TcpListener::bind(at)
        .await
        .map_err(io(format!("cannot listen for bulk lanes on TCP {at}")))?;
    let config = tls_server_config(identity, trust)?;
    Ok((listener, tokio_rustls::TlsAcceptor::from(Arc::new(config))))
}

/// Dials a lane to `conn`'s peer (`expected`) from `endpoint` and binds it to `conn`.
pub async fn dial_lane(
    endpoint: &quinn::Endpoint,
    conn: &quinn::Connection,
    expected: DeviceId,
) -> Result<LaneStream, TransportError> {
    let addr = conn.remote_address();
    let fail = |reason: String| TransportError::Connect { addr, reason };
    let context = context_of(endpoint)
        .ok_or_else(|| fail("the endpoint was not made by transport::endpoint".into()))?;
    let pin = Arc::new(PinnedServer {
        expected,
        presented: Mutex::new(None),
        provider: provider(),
    });
    let tls = client_tls(context.cert.clone(), &context.key_der, pin)?;
    let binding = lane_binding(conn)?;
    let tcp = tokio::time::timeout(LANE_CONNECT_TIMEOUT, tokio::net::TcpStream::connect(addr))
        .await
        .map_err(|_| fail("no TCP connection for the bulk lane in time".into()))?
        .map_err(|e| fail(format!("no TCP connection for the bulk lane: {e}")))?;
    let _ = tcp.set_nodelay(true);
    let mut tcp = Counted::new(tcp);
    tcp.bound_to(binding);
    let name = ServerName::try_from(SERVER_NAME).map_err(tls_err)?;
    let greet = async {
        let mut tls = tokio_rustls::TlsConnector::from(Arc::new(tls))
            .connect(name, tcp)
            .await?;
        let mut hello = [0u8; 33];
        hello[0] = LANE_HELLO;
        hello[1..].copy_from_slice(&binding);
        tls.write_all(&hello).await?;
        tls.flush().await?;
        let mut answer = [0u8; 1];
        tls.read_exact(&mut answer).await?;
        std::io::Result::Ok((tls, answer[0]))
    };
    match tokio::time::timeout(LANE_DIAL_TIMEOUT, greet).await {
        Err(_) => Err(fail("the bulk lane was not bound in time".into())),
        Ok(Err(e)) => Err(fail(format!(
            "the bulk lane was refused or broke while it was bound: {e}"
        ))),
        Ok(Ok((tls, LANE_BOUND))) => Ok(tls.into()),
        Ok(Ok((_, other))) => Err(fail(format!(
            "the bulk lane's listener answered {other:#04x}, not {LANE_BOUND:#04x}"
        ))),
    }
}

/// Runs the listening end of a lane on `tcp`: TLS, then the binding. `links` gives the live
/// QUIC connections of a device. Returns the device, the connection the lane is bound to, and
/// the lane; an error when the dialer was refused, was not bound, or was too slow.
pub async fn accept_lane(
    acceptor: &tokio_rustls::TlsAcceptor,
    tcp: tokio::net::TcpStream,
    links: impl Fn(&DeviceId) -> Vec<quinn::Connection>,
) -> Result<(DeviceId, quinn::Connection, LaneStream), TransportError> {
    let _ = tcp.set_nodelay(true);
    let greet = async {
        let mut tls = acceptor
            .accept(Counted::new(tcp))
            .await
            .map_err(TransportError::Stream)?;
        let device = tls
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .and_then(|c| device_id_of_cert(c.as_ref()).ok())
            .ok_or_else(|| TransportError::Tls("a lane without a client certificate".into()))?;
        let mut hello = [0u8; 33];
        tls.read_exact(&mut hello)
            .await
            .map_err(TransportError::Stream)?;
        Ok::<_, TransportError>((device, tls, hello))
    };
    let (device, mut tls, hello) = tokio::time::timeout(LANE_HELLO_TIMEOUT, greet)
        .await
        .map_err(|_| TransportError::Stalled {
            got: 0,
            len: None,
            waited: LANE_HELLO_TIMEOUT,
        })??;
    // Both ends take a new connection in at about the same time, and a lane may be dialed a
    // moment before this end has: it is looked for a while before the lane is refused.
    let waiting = tokio::time::Instant::now() + LANE_BIND_WAIT;
    let bound = loop {
        let found = (hello[0] == LANE_HELLO)
            .then(|| {
                links(&device)
                    .into_iter()
                    .find(|c| lane_binding(c).is_ok_and(|b| b == hello[1..]))
            })
            .flatten();
        if found.is_some() || hello[0] != LANE_HELLO || tokio::time::Instant::now() >= waiting {
            break found;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let Some(conn) = bound else {
        let _ = tls.shutdown().await;
        return Err(TransportError::Connect {
            addr: tls
                .get_ref()
                .0
                .tcp()
                .peer_addr()
                .map_err(TransportError::Stream)?,
            reason: format!(
                "device {} opened a bulk lane bound to no live connection of it",
                device.short()
            ),
        });
    };
    if let Ok(binding) = lane_binding(&conn) {
        tls.get_mut().0.bound_to(binding);
    }
    tls.write_all(&[LANE_BOUND])
        .await
        .map_err(TransportError::Stream)?;
    tls.flush().await.map_err(TransportError::Stream)?;
    Ok((device, conn, tls.into()))
}
