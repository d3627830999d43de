//! Dialing and accepting: the QUIC handshake with a pinned peer, then the welcome and the
//! hello (the module's top, steps 1–5). It never decides whom to trust (the trust module does)
//! nor what to say once connected (the session does).

use super::*;

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
pub(super) enum GreetingError {
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
pub(super) async fn read_greeting(
    recv: &mut quinn::RecvStream,
    tag: u8,
) -> Result<u64, GreetingError> {
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
pub(super) async fn send_greeting(conn: &quinn::Connection, tag: u8) -> Result<(), TransportError> {
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
pub(super) fn client_config(
    context: &DialContext,
    pin: Arc<PinnedServer>,
) -> Result<quinn::ClientConfig, TransportError> {
    let tls = client_tls(context.cert.clone(), &context.key_der, pin)?;
    let crypto = QuicClientConfig::try_from(tls).map_err(tls_err)?;
    let mut config = quinn::ClientConfig::new(Arc::new(crypto));
    config.transport_config(context.transport.clone());
    Ok(config)
}

/// The dialer's TLS for a dial to `expected` on another carrier than QUIC
/// (`daemon/examples/wire_copy.rs --tcp`): as a QUIC dial's, the listener must present
/// `expected`'s certificate, and [`SERVER_NAME`] is the name to give.
pub fn tls_client_config(
    identity: &Identity,
    expected: DeviceId,
) -> Result<rustls::ClientConfig, TransportError> {
    let pin = Arc::new(PinnedServer {
        expected,
        presented: Mutex::new(None),
        provider: provider(),
    });
    client_tls(
        CertificateDer::from(identity.cert_der.clone()),
        &identity.key_der,
        pin,
    )
}

/// Our certificate and key, TLS 1.3 only, no resumption, `pin` as the check of the listener.
pub(super) fn client_tls(
    cert: CertificateDer<'static>,
    key_der: &[u8],
    pin: Arc<PinnedServer>,
) -> Result<rustls::ClientConfig, TransportError> {
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key_der.to_vec()));
    let mut tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_err)?
        .dangerous()
        .with_custom_certificate_verifier(pin)
        .with_client_auth_cert(vec![cert], key)
        .map_err(tls_err)?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    tls.resumption = rustls::client::Resumption::disabled();
    Ok(tls)
}

/// One dial under way: what its failures are told with.
pub(super) struct Dial {
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
    let Some(_waiting) = context.waiting.enter(id) else {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
