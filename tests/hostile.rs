//! A trusted but hostile peer: crafted requests for a folder it does not share, an oversized
//! frame and a path escaping the folder are refused and logged, it gets no data it may not
//! see, and the daemon keeps serving an honest peer.

use crate::common;
use common::hostile::{hello, trusted_mallory};
use common::*;
use meshfs_daemon::identity::Identity;
use meshfs_daemon::transport::{self, TrustStore};
use meshfs_protocol::*;
use std::time::Duration;

#[test]
fn a_hostile_peer_gets_nothing_unshared_and_cannot_disturb_others() {
    let t = tmp();
    let mut a = Device::new(&t, "a");
    let mut b = Device::new(&t, "b");
    pair(&a, &b);
    let private_dir = t.path().join("a-private");
    ok(
        &a.home,
        &[
            "folder",
            "add",
            private_dir.to_str().unwrap(),
            "--id",
            "private",
        ],
    );
    write(&private_dir.join("secret.txt"), b"top secret");
    write(&a.path("public.txt"), b"public");
    let mallory = trusted_mallory(&a);
    a.start();
    b.start();
    wait_synced(&[&a, &b], 30);

    let a_id: DeviceId = a.id.parse().unwrap();
    let a_addr: std::net::SocketAddr = a.addr.parse().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let ep = transport::endpoint(&mallory, "127.0.0.1:0".parse().unwrap(), TrustStore::new([a_id])).unwrap();
        let conn = transport::dial(&ep, a_addr, a_id).await.expect("mallory is trusted for `work`");
        let (mut ctl, _ctl_recv) = conn.open_bi().await.unwrap();
        transport::write_message(&mut ctl, &hello("work")).await.unwrap();

        // 1. A crafted request for a folder that is not shared with mallory.
        let secret = Hash::of(b"top secret");
        let (mut s, mut r) = conn.open_bi().await.unwrap();
        transport::write_message(&mut s, &Message::Request(ChunkRequest { folder: FolderId::new("private").unwrap(), hashes: vec![secret] })).await.unwrap();
        let _ = s.finish();
        match transport::read_message(&mut r).await {
            Ok(Some(Message::Error { code, .. })) => assert_eq!(code, ErrorCode::NotShared),
            other => panic!("expected NotShared, got {other:?}"),
        }
        // 2. The same chunk asked for through the shared folder: it is not there, so nothing.
        let (mut s, mut r) = conn.open_bi().await.unwrap();
        transport::write_message(&mut s, &Message::Request(ChunkRequest { folder: FolderId::new("work").unwrap(), hashes: vec![secret, Hash::of(b"public")] })).await.unwrap();
        let _ = s.finish();
        let first = transport::read_message(&mut r).await.unwrap();
        assert!(matches!(first, Some(Message::Response(ChunkResponse { data: None, .. }))), "{first:?}");
        let second = transport::read_message(&mut r).await.unwrap();
        assert!(matches!(second, Some(Message::Response(ChunkResponse { data: Some(ref d), .. })) if d == b"public"), "{second:?}");

        // 3. A frame announcing more than the limit.
        let (mut s, mut r) = conn.open_bi().await.unwrap();
        s.write_all(&((MAX_FRAME_LEN as u32) + 1).to_be_bytes()).await.unwrap();
        // The daemon may stop the stream as soon as it has read the header: this write can
        // fail, and either way it gets no data back.
        let _ = s.write_all(&[0u8; 64]).await;
        let _ = s.finish();
        let got = tokio::time::timeout(Duration::from_secs(5), transport::read_message(&mut r)).await.expect("the daemon answers or closes the stream");
        assert!(!matches!(got, Ok(Some(Message::Response(_)))), "an oversized frame got data: {got:?}");

        // 4. An index record whose path climbs out of the folder ("../x"), patched into a valid frame.
        let rec = FileRecord {
            path: RelPath::new("QQ/escape.txt").unwrap(),
            kind: FileKind::File,
            deleted: false,
            mode: 0o644,
            mtime_ns: 0,
            size: 0,
            hash: Hash::of(b""),
            chunks: vec![],
            target: String::new(),
            version: VersionVector::from_pairs([(mallory.device_id.short(), 1)]),
            modified_by: mallory.device_id.short(),
            sequence: 1,
        };
        let mut frame = encode_frame(&Message::Index(IndexBatch { folder: FolderId::new("work").unwrap(), records: vec![rec], up_to: 1, inline: Vec::new() })).unwrap();
        let at = frame.windows(2).position(|w| w == b"QQ").unwrap();
        frame[at] = b'.';
        frame[at + 1] = b'.';
        let _ = ctl.write_all(&frame).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
    });
    assert!(!t.path().join("a").join("escape.txt").exists());
    assert!(!a.dir.parent().unwrap().join("escape.txt").exists());

    // The daemon logged what it refused and still serves the honest peer.
    let log = a.log();
    assert!(
        log.contains("unshared folder private") || log.contains("not shared"),
        "refusal of the crafted request is logged"
    );
    assert!(
        log.contains("exceeds") || log.contains("malformed") || log.contains("frame"),
        "bad frames are logged:\n{log}"
    );
    write(&b.path("after-attack.txt"), b"still syncing");
    wait_synced(&[&a, &b], 30);
    assert_eq!(
        std::fs::read(a.path("after-attack.txt")).unwrap(),
        b"still syncing"
    );
    assert!(!b.path("secret.txt").exists());
}

#[test]
fn a_homes_state_is_the_owners_alone() {
    use std::os::unix::fs::PermissionsExt;
    let t = tmp();
    let mut a = Device::new(&t, "a");
    // Whatever modes an older meshfs (or the user) left.
    let state = a.home.join("state");
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o755)).unwrap();
    a.start();
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&state), 0o700, "state dir");
    assert_eq!(mode(&state.join("journal.db")), 0o600, "journal");
    assert_eq!(mode(&a.home.join("config.toml")), 0o600, "config");
    assert_eq!(mode(&state.join("key.der")), 0o600, "key");
}

#[test]
fn a_record_that_cannot_apply_is_skipped_and_shown_while_the_rest_keeps_syncing() {
    let t = tmp();
    let mut a = Device::new(&t, "a");
    let mut b = Device::new(&t, "b");
    pair(&a, &b);
    // On a, `x` is a local file kept out of sync by a local ignore rule; on b, `x` is a
    // directory. b's `x/y` has nowhere to go on a.
    let local_ignore = a.home.join("ignore").join("work");
    write(&local_ignore, b"x\n");
    write(&a.path("x"), b"a's private file");
    write(&b.path("x/y"), b"b's file");
    write(&b.path("z.txt"), b"arrives anyway");
    a.start();
    b.start();
    let t0 = std::time::Instant::now();
    loop {
        let st = a.status();
        let skipped = st["folders"][0]["skipped"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if a.path("z.txt").exists() && !skipped.is_empty() {
            assert!(
                skipped
                    .iter()
                    .any(|s| s["path"].as_str().unwrap().starts_with('x')),
                "{skipped:?}"
            );
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "status: {st}\n{}",
            a.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(std::fs::read(a.path("x")).unwrap(), b"a's private file");
    // Later changes from b still arrive.
    write(&b.path("later.txt"), b"still syncing");
    let t0 = std::time::Instant::now();
    while std::fs::read(a.path("later.txt")).ok().as_deref() != Some(b"still syncing".as_slice()) {
        assert!(t0.elapsed() < Duration::from_secs(30), "{}", a.log());
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_hostile_peer_cannot_exhaust_memory_or_threads_and_an_honest_peer_keeps_syncing() {
    let t = tmp();
    let mut a = Device::new(&t, "a");
    let mut b = Device::new(&t, "b");
    pair(&a, &b);
    for i in 0..40 {
        write(&a.path(&format!("data/{i}.bin")), &noise(1 << 20, i));
    }
    let mallory = trusted_mallory(&a);
    a.start();
    b.start();
    // mallory is configured but not connected yet: `wait_synced` counts connected peers only.
    wait_synced(&[&a, &b], 60);
    a.reset_peak_rss();
    let before = a.usage();
    let a_id: DeviceId = a.id.parse().unwrap();
    let a_addr: std::net::SocketAddr = a.addr.parse().unwrap();
    let hashes: Vec<Hash> = (0..40).map(|i| Hash::of(&noise(1 << 20, i))).collect();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (closed_for_flood, served_past_limit) = rt.block_on(async {
        let ep = transport::endpoint(
            &mallory,
            "127.0.0.1:0".parse().unwrap(),
            TrustStore::new([a_id]),
        )
        .unwrap();
        let conn = transport::dial(&ep, a_addr, a_id).await.unwrap();
        let (mut ctl, _ctl_recv) = conn.open_bi().await.unwrap();
        transport::write_message(&mut ctl, &hello("work"))
            .await
            .unwrap();
        // 1. Hundreds of streams announcing 16 MiB frames that never come.
        let mut held = Vec::new();
        for _ in 0..500 {
            let Ok((mut s, r)) = conn.open_bi().await else {
                break;
            };
            let _ = s
                .write_all(&((MAX_FRAME_LEN as u32) - 1).to_be_bytes())
                .await;
            held.push((s, r));
        }
        // 2. Chunk requests for real content, never read: each would hold a reader thread.
        let mut stalled = 0;
        for _ in 0..300 {
            let Ok((mut s, r)) = conn.open_bi().await else {
                break;
            };
            let req = Message::Request(ChunkRequest {
                folder: FolderId::new("work").unwrap(),
                hashes: hashes.clone(),
            });
            if transport::write_message(&mut s, &req).await.is_ok() {
                stalled += 1;
            }
            let _ = s.finish();
            held.push((s, r));
        }
        // 3. Index batches beyond the window, without waiting for acknowledgements.
        for i in 0..20u64 {
            let rec = FileRecord {
                path: RelPath::new(&format!("flood-{i}")).unwrap(),
                kind: FileKind::File,
                deleted: false,
                mode: 0o644,
                mtime_ns: 0,
                size: 0,
                hash: Hash::of_chunks(&[]),
                chunks: vec![],
                target: String::new(),
                version: VersionVector::from_pairs([(mallory.device_id.short(), i + 1)]),
                modified_by: mallory.device_id.short(),
                sequence: i + 1,
            };
            let m = Message::Index(IndexBatch {
                folder: FolderId::new("work").unwrap(),
                records: vec![rec],
                up_to: i + 1,
                inline: Vec::new(),
            });
            if transport::write_message(&mut ctl, &m).await.is_err() {
                break;
            }
        }
        let closed = tokio::time::timeout(Duration::from_secs(10), conn.closed())
            .await
            .is_ok();
        drop(held);
        (closed, stalled)
    });
    assert!(served_past_limit > 0);
    assert!(
        closed_for_flood,
        "the session of a peer ignoring the batch window is closed"
    );
    let after = a.usage();
    let cpu = after.cpu - before.cpu;
    eprintln!(
        "victim RSS: {} KiB before, {} KiB after the attack, peak {} KiB; CPU {cpu:?} (of {:?}); disk {} -> {} KiB",
        before.rss_kib,
        after.rss_kib,
        after.peak_kib,
        after.cpu,
        before.disk / 1024,
        after.disk / 1024
    );
    assert!(
        after.peak_kib < before.rss_kib + 200 * 1024,
        "peak RSS grew from {} to {} KiB",
        before.rss_kib,
        after.peak_kib
    );
    assert!(cpu < Duration::from_secs(20), "{cpu:?} of CPU");
    assert!(after.disk < before.disk + (16 << 20));
    // The daemon still answers and the honest peer still syncs.
    write(&b.path("after-attack.txt"), b"still syncing");
    let t0 = std::time::Instant::now();
    while std::fs::read(a.path("after-attack.txt")).ok().as_deref()
        != Some(b"still syncing".as_slice())
    {
        assert!(t0.elapsed() < Duration::from_secs(30), "{}", a.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        a.log().contains("unacknowledged index batches"),
        "{}",
        a.log()
    );
}

/// The removed peer dials with a client that keeps every resumption ticket the daemon gives it
/// and offers it back (the daemon's own dialer never does), so a server that issued tickets
/// would let it resume past the trust check: a resumed TLS 1.3 session restores the client's
/// certificate without asking the verifier.
#[test]
fn a_removed_peer_is_refused_even_after_a_session_it_could_resume() {
    use common::hostile::{resuming_client, CountingTickets};
    use std::sync::atomic::Ordering::SeqCst;
    let t = tmp();
    let mut a = Device::new(&t, "a");
    let mallory = Identity::generate().unwrap();
    let m_id = mallory.device_id.to_string();
    ok(&a.home, &["peer", "add", &m_id, "--share", "work"]);
    a.start();
    let a_addr: std::net::SocketAddr = a.addr.parse().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let tickets = CountingTickets::new();
    let config = resuming_client(&mallory, tickets.clone());
    let ep = rt.block_on(async {
        let mut ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
        ep.set_default_client_config(config);
        ep
    });
    // A full session first: with resumption on, the server now gives tickets for it.
    rt.block_on(async {
        let conn = ep
            .connect(a_addr, transport::SERVER_NAME)
            .unwrap()
            .await
            .expect("trusted");
        // Tickets come right after the handshake, with the daemon's welcome.
        let _ = tokio::time::timeout(Duration::from_secs(2), conn.accept_uni()).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        conn.close(0u32.into(), b"bye");
    });
    ok(&a.home, &["peer", "remove", &m_id]);
    // Under TLS 1.3 the dialer's side of the handshake completes before the listener has
    // checked its certificate (`transport`, step 5): a connection is in only once the
    // listener welcomes it on its first unidirectional stream; a refused one is closed with a
    // certificate alert.
    let again = rt.block_on(async {
        let conn = ep.connect(a_addr, transport::SERVER_NAME).unwrap().await?;
        match tokio::time::timeout(Duration::from_secs(5), conn.accept_uni()).await {
            Ok(Ok(_welcome)) => Ok(true),
            Ok(Err(e)) => Err(e),
            Err(_) => Ok(false),
        }
    });
    eprintln!(
        "resumption tickets given by the daemon: {}, offered back: {}; second dial: {again:?}",
        tickets.given.load(SeqCst),
        tickets.offered.load(SeqCst)
    );
    match again {
        Err(quinn::ConnectionError::ConnectionClosed(c)) => assert!(
            (0x100 + 42..=0x100 + 49).contains(&u64::from(c.error_code))
                || u64::from(c.error_code) == 0x100 + 116,
            "closed, but not with a certificate alert: {c}"
        ),
        other => panic!(
            "a removed peer got back in or was not refused ({} ticket(s) offered): {other:?}",
            tickets.offered.load(SeqCst)
        ),
    }
    assert_eq!(tickets.given.load(SeqCst), 0, "the daemon gives no tickets");
}
