//! The endpoint: its UDP socket (buffers, rebinding when the network changes), the transport
//! [`Tuning`], the per-endpoint context the handshake needs, and this process's instance nonce.
//! It never authenticates a peer (the handshake and the trust module do) nor frames a message.

use super::*;

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
pub(super) struct DialContext {
    pub(super) cert: CertificateDer<'static>,
    pub(super) key_der: Vec<u8>,
    pub(super) device_id: DeviceId,
    pub(super) transport: Arc<TransportConfig>,
    /// Another descriptor of the endpoint's socket, for [`rebind`].
    pub(super) socket: std::net::UdpSocket,
    /// What an accepted connection is opened to once its hello is read: its receive window and
    /// the bidirectional streams its dialer may open ([`Tuning`]; before: [`GREETING_WINDOW`]
    /// and none).
    pub(super) opened: (u32, u32),
    /// Accepted connections waiting for their hello, [`MAX_WAITING_PER_DEVICE`] per device.
    pub(super) waiting: Arc<DeviceSlots>,
}

pub(super) fn dial_contexts() -> &'static Mutex<HashMap<SocketAddr, Arc<DialContext>>> {
    static CONTEXTS: OnceLock<Mutex<HashMap<SocketAddr, Arc<DialContext>>>> = OnceLock::new();
    CONTEXTS.get_or_init(Default::default)
}

/// The context [`endpoint_with`] registered for `endpoint`.
pub(super) fn context_of(endpoint: &quinn::Endpoint) -> Option<Arc<DialContext>> {
    let local = endpoint.local_addr().ok()?;
    dial_contexts()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&local)
        .cloned()
}

/// Things of each device counted against a cap (connections waiting for their hello, bulk lanes
/// served), each held by a [`DeviceSlot`] until it is dropped.
pub struct DeviceSlots {
    max: usize,
    counts: Mutex<HashMap<DeviceId, usize>>,
}

/// One of a device's [`DeviceSlots`], given back when dropped.
pub struct DeviceSlot {
    slots: Arc<DeviceSlots>,
    device: DeviceId,
}

impl DeviceSlots {
    /// At most `max` of each device at once.
    pub fn new(max: usize) -> Arc<DeviceSlots> {
        Arc::new(DeviceSlots {
            max,
            counts: Mutex::new(HashMap::new()),
        })
    }

    /// A slot of `device`'s, unless it holds `max` already.
    pub fn enter(self: &Arc<Self>, device: DeviceId) -> Option<DeviceSlot> {
        let mut counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        let n = counts.entry(device).or_insert(0);
        if *n >= self.max {
            return None;
        }
        *n += 1;
        drop(counts);
        Some(DeviceSlot {
            slots: self.clone(),
            device,
        })
    }
}

impl Drop for DeviceSlot {
    fn drop(&mut self) {
        let mut counts = self.slots.counts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = counts.get_mut(&self.device) {
            *n -= 1;
            if *n == 0 {
                counts.remove(&self.device);
            }
        }
    }
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
    let crypto =
        QuicServerConfig::try_from(tls_server_config(identity, trust)?).map_err(tls_err)?;
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
        waiting: DeviceSlots::new(MAX_WAITING_PER_DEVICE),
    });
    dial_contexts()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(local, context);
    Ok(endpoint)
}

/// The listener's TLS: this device's certificate, TLS 1.3 only, a dialer admitted only if its
/// device id is in `trust`, no resumption. The QUIC endpoint is built on it, and so can a
/// listener on another carrier be (`daemon/examples/wire_copy.rs --tcp`).
pub fn tls_server_config(
    identity: &Identity,
    trust: TrustStore,
) -> Result<rustls::ServerConfig, TransportError> {
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
        .with_single_cert(vec![cert], key)
        .map_err(tls_err)?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    // No session resumption: a resumed session restores the client certificate without
    // asking the verifier, so a peer removed from the trust store could come back with a
    // ticket. Every connection does the full handshake and the trust check.
    tls.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    tls.send_tls13_tickets = 0;
    Ok(tls)
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
pub(super) fn udp_socket(
    addr: SocketAddr,
    buffer: usize,
) -> Result<std::net::UdpSocket, TransportError> {
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
pub(super) fn force_buffer(socket: &socket2::Socket, option: libc::c_int, bytes: usize) -> bool {
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

pub(super) static INSTANCE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

pub(super) fn random_nonce() -> u64 {
    loop {
        let n: u64 = rand::random();
        if n != 0 {
            break n;
        }
    }
}
