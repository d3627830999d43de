//! The peer transport and device identity, exercised with real certificates and real QUIC
//! connections on 127.0.0.1.

use meshfs_daemon::identity::{device_id_of_cert, Identity, IdentityError};
use meshfs_daemon::transport::{
    accept, accept_lane, dial, dial_lane, endpoint, lane_bytes, lane_listener, link_stats,
    read_message, read_message_capped, read_message_within, remote_device, tls_client_config,
    write_message, TransportError, TrustStore, FRAME_STALL, LANE_BOUND, LANE_HELLO,
};
use meshfs_protocol::{
    ChunkResponse, CodecError, DeviceId, Hash, Hello, Message, MAX_FRAME_LEN, PROTOCOL_VERSION,
};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::time::Duration;
use tokio::sync::mpsc;

// ---------------------------------------------------------------------------------------
// An allocator that remembers the largest allocation made on the current thread, so a test
// can show that a frame header announcing a huge payload does not allocate it.

struct LargestAllocation;

thread_local! {
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note_allocation(size: usize) {
    let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
}

// SAFETY: every call is forwarded unchanged to the system allocator.
unsafe impl GlobalAlloc for LargestAllocation {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note_allocation(layout.size());
        // SAFETY: our caller meets GlobalAlloc's contract for `layout`, which is System's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note_allocation(layout.size());
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note_allocation(new_size);
        // SAFETY: `ptr` came from this allocator, that is from System, with `layout`; the
        // rest of the contract is our caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator, that is from System, with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: LargestAllocation = LargestAllocation;

// ---------------------------------------------------------------------------------------

/// One device: identity, trust store and endpoint on 127.0.0.1.
struct Device {
    identity: Identity,
    trust: TrustStore,
    endpoint: quinn::Endpoint,
}

impl Device {
    fn new() -> Device {
        let identity = Identity::generate().unwrap();
        let trust = TrustStore::default();
        let endpoint = endpoint(&identity, localhost(), trust.clone()).unwrap();
        Device {
            identity,
            trust,
            endpoint,
        }
    }

    fn id(&self) -> DeviceId {
        self.identity.device_id
    }

    fn addr(&self) -> SocketAddr {
        self.endpoint.local_addr().unwrap()
    }

    /// Runs an accept loop; every outcome of [`accept`] arrives on the returned channel.
    fn serve(
        &self,
    ) -> mpsc::UnboundedReceiver<Result<(quinn::Connection, DeviceId), TransportError>> {
        let endpoint = self.endpoint.clone();
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Some(incoming) = endpoint.accept().await {
                let tx = tx.clone();
                let endpoint = endpoint.clone();
                tokio::spawn(async move {
                    let _ = tx.send(accept(&endpoint, incoming).await);
                });
            }
        });
        rx
    }
}

fn localhost() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

fn trust_each_other(a: &Device, b: &Device) {
    a.trust.add(b.id());
    b.trust.add(a.id());
}

fn hello(name: &str) -> Message {
    Message::Hello(Hello {
        protocol_version: PROTOCOL_VERSION,
        device_name: name.into(),
        folders: vec![],
    })
}

/// The next accepted connection, failing the test on an accept error or a timeout.
async fn next_connection(
    rx: &mut mpsc::UnboundedReceiver<Result<(quinn::Connection, DeviceId), TransportError>>,
) -> (quinn::Connection, DeviceId) {
    tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("no connection accepted within 10 s")
        .expect("accept loop ended")
        .expect("accept failed")
}

/// Asserts the accept loop yields no connection for a while.
async fn assert_no_connection(
    rx: &mut mpsc::UnboundedReceiver<Result<(quinn::Connection, DeviceId), TransportError>>,
) {
    let deadline = tokio::time::sleep(Duration::from_millis(500));
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            _ = &mut deadline => return,
            outcome = rx.recv() => match outcome {
                Some(Ok((_, id))) => panic!("the listener accepted device {id}"),
                Some(Err(_)) => continue,
                None => return,
            },
        }
    }
}

/// The dialer sends a message on a new bidirectional stream; the listener answers.
async fn exchange(dialer: &quinn::Connection, listener: &quinn::Connection) {
    let (mut send, mut recv) = dialer.open_bi().await.unwrap();
    let sent = write_message(&mut send, &hello("dialer")).await.unwrap();
    assert!(sent > 4);
    send.finish().unwrap();

    let (mut their_send, mut their_recv) = listener.accept_bi().await.unwrap();
    assert_eq!(
        read_message(&mut their_recv).await.unwrap(),
        Some(hello("dialer"))
    );
    assert_eq!(
        read_message(&mut their_recv).await.unwrap(),
        None,
        "clean end of stream"
    );
    write_message(&mut their_send, &hello("listener"))
        .await
        .unwrap();
    their_send.finish().unwrap();

    assert_eq!(
        read_message(&mut recv).await.unwrap(),
        Some(hello("listener"))
    );
    assert_eq!(read_message(&mut recv).await.unwrap(), None);
}

#[tokio::test]
async fn trusted_devices_connect_both_ways_and_exchange_messages() {
    let a = Device::new();
    let b = Device::new();
    trust_each_other(&a, &b);
    let mut a_incoming = a.serve();
    let mut b_incoming = b.serve();

    let a_to_b = dial(&a.endpoint, b.addr(), b.id()).await.unwrap();
    let (b_from_a, dialer) = next_connection(&mut b_incoming).await;
    assert_eq!(dialer, a.id());
    assert_eq!(remote_device(&a_to_b), Some(b.id()));
    assert_eq!(remote_device(&b_from_a), Some(a.id()));
    exchange(&a_to_b, &b_from_a).await;

    let b_to_a = dial(&b.endpoint, a.addr(), a.id()).await.unwrap();
    let (a_from_b, dialer) = next_connection(&mut a_incoming).await;
    assert_eq!(dialer, b.id());
    assert_eq!(remote_device(&b_to_a), Some(a.id()));
    exchange(&b_to_a, &a_from_b).await;

    let stats = link_stats(&a_to_b);
    assert!(stats.bytes_sent > 0 && stats.bytes_received > 0);
    assert!(stats.rtt < Duration::from_secs(1));
}

#[tokio::test]
async fn an_unknown_device_is_refused_in_the_handshake_and_told_what_to_run() {
    let server = Device::new();
    let stranger = Device::new();
    stranger.trust.add(server.id()); // the stranger knows the server, not the reverse
    let mut incoming = server.serve();

    let err = dial(&stranger.endpoint, server.addr(), server.id())
        .await
        .expect_err("an unknown device must not get a connection");
    match &err {
        TransportError::Refused {
            addr,
            our_id,
            our_addr,
        } => {
            assert_eq!(*addr, server.addr());
            assert_eq!(*our_id, stranger.id());
            assert_eq!(*our_addr, stranger.addr());
        }
        other => panic!("expected Refused, got {other:?}"),
    }
    let message = err.to_string();
    assert!(
        message.contains(&format!(
            "refused our certificate: on that device run `meshfs peer add {} --addr {}`",
            stranger.id(),
            stranger.addr()
        )),
        "{message}"
    );

    // The listener's side: the handshake failed naming the device; no connection came out.
    match tokio::time::timeout(Duration::from_secs(5), incoming.recv()).await {
        Ok(Some(Err(TransportError::UnknownDevice(id)))) => assert_eq!(id, stranger.id()),
        other => panic!("expected UnknownDevice from accept, got {other:?}"),
    }
    assert_no_connection(&mut incoming).await;
    let refused: Vec<DeviceId> = server
        .trust
        .refused()
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    assert_eq!(refused, vec![stranger.id()]);

    // Adding the device at runtime lets it in, and takes it off the refused list.
    server.trust.add(stranger.id());
    let conn = dial(&stranger.endpoint, server.addr(), server.id())
        .await
        .unwrap();
    let (theirs, id) = next_connection(&mut incoming).await;
    assert_eq!(id, stranger.id());
    exchange(&conn, &theirs).await;
    assert!(server.trust.refused().is_empty());

    // Removing it refuses it again.
    server.trust.remove(&stranger.id());
    let err = dial(&stranger.endpoint, server.addr(), server.id())
        .await
        .unwrap_err();
    assert!(matches!(err, TransportError::Refused { .. }), "{err:?}");
}

/// The bulk lane (D105): TLS over TCP at the listener's QUIC address, bound by the first bytes
/// to the dialer's own live QUIC connection. A trusted device whose lane names a connection
/// the listener does not hold live is refused; a device not trusted gets no lane at all.
#[tokio::test]
async fn a_lane_is_bound_to_its_own_connection_and_refused_to_strangers_and_to_the_unbound() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let server = Device::new();
    let a = Device::new();
    let c = Device::new();
    trust_each_other(&server, &a);
    trust_each_other(&server, &c);
    let mut incoming = server.serve();
    let a_conn = dial(&a.endpoint, server.addr(), server.id()).await.unwrap();
    let (server_a, _) = next_connection(&mut incoming).await;
    let c_conn = dial(&c.endpoint, server.addr(), server.id()).await.unwrap();
    let _server_c = next_connection(&mut incoming).await;
    // The connections the server counts live: a's (c's as if it had ended).
    let (listener, acceptor) =
        lane_listener(&server.endpoint, &server.identity, server.trust.clone())
            .await
            .unwrap();
    let (tx, mut bound) = mpsc::unbounded_channel();
    let (live, a_id) = (server_a.clone(), a.id());
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (acceptor, live, tx) = (acceptor.clone(), live.clone(), tx.clone());
            tokio::spawn(async move {
                let links = |d: &DeviceId| {
                    if *d == a_id {
                        vec![live.clone()]
                    } else {
                        vec![]
                    }
                };
                let _ = tx.send(accept_lane(&acceptor, tcp, links).await);
            });
        }
    });
    // a's lane is bound to a's connection and carries frames both ways, counted as its bytes.
    let lane = dial_lane(&a.endpoint, &a_conn, server.id()).await.unwrap();
    let (device, conn, served) = bound.recv().await.unwrap().unwrap();
    assert_eq!(device, a.id());
    assert_eq!(conn.stable_id(), server_a.stable_id());
    let (mut a_rd, mut a_wr) = tokio::io::split(lane);
    let (mut s_rd, mut s_wr) = tokio::io::split(served);
    write_message(&mut a_wr, &hello("lane dialer"))
        .await
        .unwrap();
    a_wr.flush().await.unwrap();
    assert_eq!(
        read_message(&mut s_rd).await.unwrap(),
        Some(hello("lane dialer"))
    );
    write_message(&mut s_wr, &hello("lane listener"))
        .await
        .unwrap();
    s_wr.flush().await.unwrap();
    assert_eq!(
        read_message(&mut a_rd).await.unwrap(),
        Some(hello("lane listener"))
    );
    let (sent, received) = lane_bytes(&a_conn);
    assert!(sent > 33 && received > 1, "{sent} / {received}");
    assert!(link_stats(&a_conn).bytes_sent >= sent);

    // c is trusted, but its lane names a connection the server does not hold live.
    let err = dial_lane(&c.endpoint, &c_conn, server.id())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("bulk lane"), "{err}");
    let refused = bound.recv().await.unwrap().unwrap_err();
    assert!(
        refused.to_string().contains("bound to no live connection"),
        "{refused}"
    );

    // A stranger's TLS to the same port: its certificate is refused, and no binding it sends
    // is answered.
    let stranger = Device::new();
    let tls = tls_client_config(&stranger.identity, server.id()).unwrap();
    let tcp = tokio::net::TcpStream::connect(server.addr()).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("meshfs").unwrap();
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(tls));
    if let Ok(mut s) = connector.connect(name, tcp).await {
        let mut hello = [0u8; 33];
        hello[0] = LANE_HELLO;
        let _ = s.write_all(&hello).await;
        let _ = s.flush().await;
        let mut answer = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut answer)).await;
        assert!(
            !matches!(read, Ok(Ok(_)) if answer[0] == LANE_BOUND),
            "a stranger's lane was bound"
        );
    }
    let stranger_refused = bound.recv().await.unwrap().unwrap_err();
    assert!(
        stranger_refused.to_string().contains("certificate")
            || stranger_refused.to_string().contains("unknown"),
        "{stranger_refused}"
    );
}

/// On a byte stream (a bulk lane's) frames read as on QUIC, and a frame declaring more than the
/// reader's cap is refused from its header, before its body is read.
#[tokio::test]
async fn a_byte_stream_carries_frames_and_refuses_one_over_the_cap_from_its_header() {
    use tokio::io::AsyncWriteExt;
    let (near, far) = tokio::io::duplex(1 << 20);
    let (_, mut w) = tokio::io::split(near);
    let (mut r, _) = tokio::io::split(far);
    write_message(&mut w, &hello("over a byte stream"))
        .await
        .unwrap();
    assert_eq!(
        read_message_capped(&mut r, 1024).await.unwrap(),
        Some(hello("over a byte stream"))
    );
    // A header declaring 100 KiB where at most 40 KiB may come; no body follows.
    w.write_all(&(100u32 << 10).to_be_bytes()).await.unwrap();
    let err = read_message_capped(&mut r, 40 << 10).await.unwrap_err();
    assert!(matches!(err, TransportError::Frame(_)), "{err:?}");
    drop(w);
}

#[tokio::test]
async fn a_dialer_refuses_a_listener_that_is_not_the_expected_device() {
    let server = Device::new();
    let client = Device::new();
    let impostor_of = Identity::generate().unwrap().device_id;
    trust_each_other(&server, &client);
    let mut incoming = server.serve();

    let err = dial(&client.endpoint, server.addr(), impostor_of)
        .await
        .unwrap_err();
    match &err {
        TransportError::WrongDevice {
            addr,
            expected,
            presented,
        } => {
            assert_eq!(*addr, server.addr());
            assert_eq!(*expected, impostor_of);
            assert_eq!(*presented, server.id());
        }
        other => panic!("expected WrongDevice, got {other:?}"),
    }
    assert!(err.to_string().contains(&server.id().to_string()));
    assert_no_connection(&mut incoming).await;

    // The same endpoints connect when the client expects the right device.
    dial(&client.endpoint, server.addr(), server.id())
        .await
        .unwrap();
    next_connection(&mut incoming).await;
}

#[tokio::test]
async fn a_frame_longer_than_the_limit_is_refused_before_its_body_is_allocated() {
    let server = Device::new();
    let client = Device::new();
    trust_each_other(&server, &client);
    let mut incoming = server.serve();
    let conn = dial(&client.endpoint, server.addr(), server.id())
        .await
        .unwrap();
    let (theirs, _) = next_connection(&mut incoming).await;

    let (mut send, _recv) = conn.open_bi().await.unwrap();
    let announced = MAX_FRAME_LEN + 1;
    send.write_all(&(announced as u32).to_be_bytes())
        .await
        .unwrap();
    send.write_all(&[0xab; 1024]).await.unwrap();

    let (_their_send, mut their_recv) = theirs.accept_bi().await.unwrap();
    // This test runs on a current-thread runtime: every allocation while reading (quinn's
    // included) is made on this thread.
    LARGEST.with(|l| l.set(0));
    let err = read_message(&mut their_recv).await.unwrap_err();
    let largest = LARGEST.with(|l| l.get());
    assert!(
        matches!(err, TransportError::Frame(CodecError::TooLarge(n)) if n == announced),
        "{err:?}"
    );
    assert!(
        largest < MAX_FRAME_LEN,
        "read_message allocated {largest} bytes"
    );

    // The sender learns that its stream was stopped.
    let stopped = tokio::time::timeout(Duration::from_secs(5), send.stopped())
        .await
        .expect("stream not stopped");
    assert!(stopped.unwrap().is_some());
}

#[tokio::test]
async fn a_malformed_frame_is_an_error_and_the_endpoint_keeps_serving_other_connections() {
    let server = Device::new();
    let rogue = Device::new();
    let honest = Device::new();
    trust_each_other(&server, &rogue);
    trust_each_other(&server, &honest);
    let mut incoming = server.serve();

    let conn = dial(&rogue.endpoint, server.addr(), server.id())
        .await
        .unwrap();
    let (theirs, _) = next_connection(&mut incoming).await;
    let (mut send, _recv) = conn.open_bi().await.unwrap();
    send.write_all(&5u32.to_be_bytes()).await.unwrap();
    send.write_all(&[0xff; 5]).await.unwrap();
    send.finish().unwrap();
    let (_their_send, mut their_recv) = theirs.accept_bi().await.unwrap();
    let err = read_message(&mut their_recv).await.unwrap_err();
    assert!(
        matches!(err, TransportError::Frame(CodecError::Malformed(_))),
        "{err:?}"
    );

    // A stream that ends inside a frame is malformed too.
    let (mut send, _recv) = conn.open_bi().await.unwrap();
    send.write_all(&100u32.to_be_bytes()).await.unwrap();
    send.write_all(&[1, 2, 3]).await.unwrap();
    send.finish().unwrap();
    let (_their_send, mut their_recv) = theirs.accept_bi().await.unwrap();
    let err = read_message(&mut their_recv).await.unwrap_err();
    assert!(
        matches!(err, TransportError::Frame(CodecError::Malformed(_))),
        "{err:?}"
    );

    let good = dial(&honest.endpoint, server.addr(), server.id())
        .await
        .unwrap();
    let (theirs, id) = next_connection(&mut incoming).await;
    assert_eq!(id, honest.id());
    exchange(&good, &theirs).await;
}

#[tokio::test]
async fn a_peer_that_stalls_in_a_frame_is_given_up_on_and_an_idle_stream_is_not() {
    let server = Device::new();
    let rogue = Device::new();
    trust_each_other(&server, &rogue);
    let mut incoming = server.serve();
    let conn = dial(&rogue.endpoint, server.addr(), server.id())
        .await
        .unwrap();
    let (theirs, _) = next_connection(&mut incoming).await;

    // One stream carries a whole message, then nothing: idle between frames.
    let (mut idle, _idle_recv) = conn.open_bi().await.unwrap();
    write_message(&mut idle, &hello("first")).await.unwrap();
    let (_s, mut idle_theirs) = theirs.accept_bi().await.unwrap();
    assert_eq!(
        read_message(&mut idle_theirs).await.unwrap(),
        Some(hello("first"))
    );
    // Another carries half a frame, then nothing.
    let (mut half, _half_recv) = conn.open_bi().await.unwrap();
    half.write_all(&100u32.to_be_bytes()).await.unwrap();
    half.write_all(&[7; 50]).await.unwrap();
    let (_s, mut half_theirs) = theirs.accept_bi().await.unwrap();

    let t0 = std::time::Instant::now();
    let err = {
        let idle_read = read_message(&mut idle_theirs);
        tokio::pin!(idle_read);
        tokio::select! {
            r = &mut idle_read => panic!("a read on an idle stream ended: {r:?}"),
            r = read_message(&mut half_theirs) => r.unwrap_err(),
        }
    };
    let waited = t0.elapsed();
    assert!(
        matches!(
            err,
            TransportError::Stalled {
                got: 54,
                len: Some(100),
                ..
            }
        ),
        "{err:?}"
    );
    assert!(
        waited >= FRAME_STALL - Duration::from_millis(100) && waited < FRAME_STALL * 2,
        "given up after {waited:?}"
    );
    assert!(err.to_string().contains("50 of 100 bytes"), "{err}");
    // The stalled sender is told: its stream was stopped.
    let stopped = tokio::time::timeout(Duration::from_secs(5), half.stopped()).await;
    assert!(matches!(stopped, Ok(Ok(Some(_)))), "{stopped:?}");

    // Where a message is due, its first byte has a deadline too.
    let err = read_message_within(&mut idle_theirs, Duration::from_millis(300), 1 << 10)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            TransportError::Stalled {
                got: 0,
                len: None,
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn identity_save_then_load_round_trips_the_device_id() {
    let dir = tempfile::tempdir().unwrap();
    let home = dir.path().join("keys");
    assert!(!Identity::exists(&home));
    let identity = Identity::generate().unwrap();
    identity.save(&home).unwrap();
    assert!(Identity::exists(&home));

    let loaded = Identity::load(&home).unwrap();
    assert_eq!(loaded.device_id, identity.device_id);
    assert_eq!(loaded.cert_der, identity.cert_der);
    assert_eq!(loaded.key_der, identity.key_der);
    assert_eq!(
        device_id_of_cert(&loaded.cert_der).unwrap(),
        identity.device_id
    );
    let shown = identity.device_id.to_string();
    assert_eq!(shown.parse::<DeviceId>().unwrap(), identity.device_id);
}

#[test]
fn identity_key_file_is_readable_only_by_its_owner() {
    let dir = tempfile::tempdir().unwrap();
    Identity::generate().unwrap().save(dir.path()).unwrap();
    let mode = |f: &str| {
        std::fs::metadata(dir.path().join(f))
            .unwrap()
            .permissions()
            .mode()
            & 0o777
    };
    assert_eq!(mode("key.der"), 0o600);
    assert_eq!(mode("cert.der"), 0o644);
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n != "key.der" && n != "cert.der")
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn identity_save_refuses_to_overwrite_an_existing_identity() {
    let dir = tempfile::tempdir().unwrap();
    let first = Identity::generate().unwrap();
    first.save(dir.path()).unwrap();
    let second = Identity::generate().unwrap();
    let err = second.save(dir.path()).unwrap_err();
    assert!(matches!(err, IdentityError::Exists(_)), "{err:?}");
    assert!(err.to_string().contains("refusing to overwrite"), "{err}");
    assert_eq!(
        Identity::load(dir.path()).unwrap().device_id,
        first.device_id
    );

    // A lone key (say, the certificate was deleted) is still refused, not replaced.
    std::fs::remove_file(dir.path().join("cert.der")).unwrap();
    assert!(Identity::exists(dir.path()));
    assert!(matches!(
        second.save(dir.path()),
        Err(IdentityError::Exists(_))
    ));
    let err = Identity::load(dir.path()).unwrap_err();
    assert!(
        matches!(err, IdentityError::Missing(ref p) if p.ends_with("cert.der")),
        "{err:?}"
    );
}

#[test]
fn identity_load_names_a_damaged_file() {
    let dir = tempfile::tempdir().unwrap();
    Identity::generate().unwrap().save(dir.path()).unwrap();
    let other = tempfile::tempdir().unwrap();
    Identity::generate().unwrap().save(other.path()).unwrap();
    std::fs::copy(other.path().join("key.der"), dir.path().join("key.der")).unwrap();
    let err = Identity::load(dir.path()).unwrap_err();
    assert!(err.to_string().contains("key.der"), "{err}");

    std::fs::write(dir.path().join("cert.der"), b"garbage").unwrap();
    let err = Identity::load(dir.path()).unwrap_err();
    assert!(err.to_string().contains("cert.der"), "{err}");
}

// ---------------------------------------------------------------------------------------
// File content in flight. Its rate is measured apart, in a release build:
// `cargo run --release -p meshfs-daemon --example transport_rate` (bench/README.md).

/// What stream `s` sends as frame `f`: different bytes everywhere, so a frame that arrives
/// torn, twice, on the wrong stream or out of order shows.
fn payload(s: usize, f: usize, len: usize) -> Vec<u8> {
    let mut x = ((s * 1000 + f + 1) as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunk_responses_sent_on_parallel_streams_arrive_intact_and_in_order() {
    const STREAMS: usize = 4;
    const FRAMES: usize = 4;
    const LEN: usize = 256 << 10;
    let sink = Device::new();
    let source = Device::new();
    trust_each_other(&sink, &source);
    let mut incoming = sink.serve();
    let conn = dial(&source.endpoint, sink.addr(), sink.id())
        .await
        .unwrap();
    let (theirs, _) = next_connection(&mut incoming).await;

    // The sink reads each stream to its end and answers with the hash of every frame it got,
    // in the order it got them.
    tokio::spawn(async move {
        while let Ok((mut send, mut recv)) = theirs.accept_bi().await {
            tokio::spawn(async move {
                let mut got = Vec::new();
                while let Some(msg) = read_message(&mut recv).await.unwrap() {
                    let Message::Response(ChunkResponse { data: Some(d), .. }) = msg else {
                        panic!("the sink got {msg:?}");
                    };
                    got.push(Hash::of(&d));
                }
                for hash in got {
                    let echo = Message::Response(ChunkResponse {
                        hash,
                        data: None,
                        compressed: false,
                    });
                    write_message(&mut send, &echo).await.unwrap();
                }
                send.finish().unwrap();
            });
        }
    });

    let mut tasks = Vec::new();
    for s in 0..STREAMS {
        let conn = conn.clone();
        tasks.push(tokio::spawn(async move {
            let (mut send, mut recv) = conn.open_bi().await.unwrap();
            let mut sent = Vec::new();
            for f in 0..FRAMES {
                let data = payload(s, f, LEN);
                sent.push(Hash::of(&data));
                let chunk = Message::Response(ChunkResponse {
                    hash: Hash::of(&data),
                    data: Some(data),
                    compressed: false,
                });
                write_message(&mut send, &chunk).await.unwrap();
            }
            send.finish().unwrap();
            let mut echoed = Vec::new();
            while let Some(msg) = read_message(&mut recv).await.unwrap() {
                let Message::Response(ChunkResponse {
                    hash, data: None, ..
                }) = msg
                else {
                    panic!("the source got {msg:?}");
                };
                echoed.push(hash);
            }
            assert_eq!(echoed, sent, "stream {s}");
        }));
    }
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(60), t)
            .await
            .expect("the transfer did not finish within 60 s")
            .unwrap();
    }
}
