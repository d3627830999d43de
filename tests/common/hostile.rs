//! A trusted peer turned hostile, for tests: a device the victim trusts with folder `work`,
//! built on the protocol crate and the daemon's transport, that sends whatever it likes; and
//! what an attack costs the victim, read from `/proc`.

use super::*;
use meshfs_daemon::identity::Identity;
use meshfs_daemon::transport::{self, TransportError, TrustStore};
use meshfs_protocol::*;
use std::time::{Duration, Instant};

/// The `Hello` a hostile peer opens its control stream with, sharing `folder`.
pub fn hello(folder: &str) -> Message {
    hello_sharing(&[folder])
}

/// The `Hello` of a hostile peer sharing `folders`.
pub fn hello_sharing(folders: &[&str]) -> Message {
    Message::Hello(Hello {
        protocol_version: PROTOCOL_VERSION,
        device_name: "mallory".into(),
        folders: folders
            .iter()
            .map(|f| HelloFolder {
                folder: FolderId::new(f).unwrap(),
                index_id: 7,
                your_index_id: 0,
                your_sequence: 0,
                max_sequence: 0,
                scanning: false,
                partial: false,
            })
            .collect(),
    })
}

/// A new identity that `a` trusts with folder `work` (before `a` starts, or then reloaded).
pub fn trusted_mallory(a: &Device) -> Identity {
    let mallory = Identity::generate().unwrap();
    let id = mallory.device_id.to_string();
    ok(&a.home, &["peer", "add", &id, "--share", "work"]);
    mallory
}

/// A version vector from (device, counter) pairs.
pub fn version(pairs: &[(ShortId, u64)]) -> VersionVector {
    VersionVector::from_pairs(pairs.iter().copied())
}

/// A live file record holding `content` as one chunk (none when empty).
pub fn file_record(path: &str, content: &[u8], v: VersionVector, by: ShortId) -> FileRecord {
    let chunks = match content.len() {
        0 => Vec::new(),
        n => vec![Chunk {
            len: n as u32,
            hash: Hash::of(content),
        }],
    };
    FileRecord {
        path: RelPath::new(path).unwrap(),
        kind: FileKind::File,
        deleted: false,
        mode: 0o644,
        mtime_ns: 1_700_000_000_000_000_000,
        size: content.len() as u64,
        hash: Hash::of_chunks(&chunks),
        chunks,
        target: String::new(),
        version: v,
        modified_by: by,
        sequence: 0,
    }
}

/// A live symlink record `path -> target`.
pub fn symlink_record(path: &str, target: &str, v: VersionVector, by: ShortId) -> FileRecord {
    FileRecord {
        kind: FileKind::Symlink,
        mode: 0o777,
        size: 0,
        hash: Hash::of(target.as_bytes()),
        chunks: Vec::new(),
        target: target.into(),
        ..file_record(path, b"", v, by)
    }
}

/// One inline chunk: `data` as it is, uncompressed.
pub fn inline(data: &[u8]) -> ChunkResponse {
    ChunkResponse {
        hash: Hash::of(data),
        data: Some(data.to_vec()),
        compressed: false,
    }
}

/// A hostile peer's connection to a victim, with its control stream open and its `Hello`
/// sent.
pub struct Mallory {
    /// Its identity.
    pub identity: Identity,
    /// The connection to the victim.
    pub conn: quinn::Connection,
    /// The control stream's send side.
    pub ctl: quinn::SendStream,
    /// The control stream's receive side: what the victim says is never read.
    pub ctl_recv: quinn::RecvStream,
    /// The last sequence sent.
    pub seq: u64,
    /// The last sequence sent in each other folder ([`Mallory::send_batch_to`]).
    pub seqs: std::collections::HashMap<String, u64>,
    _endpoint: quinn::Endpoint,
}

impl Mallory {
    /// Dials `victim` as `identity` (which the victim trusts) and says hello for `work`.
    pub async fn connect(victim: &Device, identity: &Identity) -> Mallory {
        Mallory::connect_sharing(victim, identity, &["work"]).await
    }

    /// Dials `victim` as `identity` and says hello for `folders` (which the victim shares
    /// with it).
    pub async fn connect_sharing(
        victim: &Device,
        identity: &Identity,
        folders: &[&str],
    ) -> Mallory {
        let conn_ep = connect_raw(victim, identity).await;
        let (endpoint, conn) = conn_ep.expect("mallory is trusted");
        let (mut ctl, ctl_recv) = conn.open_bi().await.unwrap();
        transport::write_message(&mut ctl, &hello_sharing(folders))
            .await
            .unwrap();
        Mallory {
            identity: identity.clone(),
            conn,
            ctl,
            ctl_recv,
            seq: 0,
            seqs: Default::default(),
            _endpoint: endpoint,
        }
    }

    /// Dials `victim` as `identity` with a receive window of `window` bytes on each stream
    /// and on the connection (the daemon's own dialer has 16 and 64 MiB), greets it and says
    /// hello for `work`: what the victim sends it backs up after `window` bytes unless
    /// mallory reads.
    pub async fn connect_with_window(victim: &Device, identity: &Identity, window: u32) -> Mallory {
        let addr: std::net::SocketAddr = victim.addr.parse().unwrap();
        let mut config = resuming_client(identity, CountingTickets::new());
        let mut t = quinn::TransportConfig::default();
        t.stream_receive_window(quinn::VarInt::from_u32(window))
            .receive_window(quinn::VarInt::from_u32(window));
        config.transport_config(std::sync::Arc::new(t));
        let endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
        let conn = endpoint
            .connect_with(config, addr, transport::SERVER_NAME)
            .unwrap()
            .await
            .expect("mallory is trusted");
        // The transport's hello (its tag and an instance nonce), then the victim's welcome.
        let mut greeting = conn.open_uni().await.unwrap();
        let mut hello_bytes = [0u8; 9];
        hello_bytes[0] = transport::HELLO;
        hello_bytes[1..].copy_from_slice(&0x6d61_6c6c_6f72_7921u64.to_be_bytes());
        greeting.write_all(&hello_bytes).await.unwrap();
        greeting.finish().unwrap();
        let mut welcome = conn.accept_uni().await.expect("welcomed");
        let _ = welcome.read_to_end(64).await;
        let (mut ctl, ctl_recv) = conn.open_bi().await.unwrap();
        transport::write_message(&mut ctl, &hello("work"))
            .await
            .unwrap();
        Mallory {
            identity: identity.clone(),
            conn,
            ctl,
            ctl_recv,
            seq: 0,
            seqs: Default::default(),
            _endpoint: endpoint,
        }
    }

    /// Sends `records` in one index batch of `folder` (not `work`: its sequences are
    /// [`Mallory::send_batch`]'s), without inline chunks.
    pub async fn send_batch_to(
        &mut self,
        folder: &str,
        mut records: Vec<FileRecord>,
    ) -> Result<usize, TransportError> {
        let seq = self.seqs.entry(folder.to_string()).or_insert(0);
        for r in &mut records {
            *seq += 1;
            r.sequence = *seq;
        }
        let batch = Message::Index(IndexBatch {
            folder: FolderId::new(folder).unwrap(),
            records,
            up_to: *seq,
            inline: Vec::new(),
        });
        transport::write_message(&mut self.ctl, &batch).await
    }

    /// Its short id, as its versions name it.
    pub fn short(&self) -> ShortId {
        self.identity.device_id.short()
    }

    /// Sends `records` in one index batch of `work` (their sequences assigned in order) with
    /// `inline` chunks.
    pub async fn send_batch(
        &mut self,
        mut records: Vec<FileRecord>,
        inline: Vec<ChunkResponse>,
    ) -> Result<usize, TransportError> {
        for r in &mut records {
            self.seq += 1;
            r.sequence = self.seq;
        }
        let batch = Message::Index(IndexBatch {
            folder: FolderId::new("work").unwrap(),
            records,
            up_to: self.seq,
            inline,
        });
        transport::write_message(&mut self.ctl, &batch).await
    }

    /// Whether the victim closes the connection within `secs`.
    pub async fn closed_within(&self, secs: u64) -> bool {
        tokio::time::timeout(Duration::from_secs(secs), self.conn.closed())
            .await
            .is_ok()
    }
}

/// Dials `victim` as `identity`: the endpoint (keep it) and the connection, or why not.
pub async fn connect_raw(
    victim: &Device,
    identity: &Identity,
) -> Result<(quinn::Endpoint, quinn::Connection), TransportError> {
    let victim_id: DeviceId = victim.id.parse().unwrap();
    let addr: std::net::SocketAddr = victim.addr.parse().unwrap();
    let endpoint = transport::endpoint(
        identity,
        "127.0.0.1:0".parse().unwrap(),
        TrustStore::new([victim_id]),
    )
    .unwrap();
    let conn = transport::dial(&endpoint, addr, victim_id).await?;
    Ok((endpoint, conn))
}

/// What a daemon process costs at one moment.
#[derive(Clone, Copy, Debug)]
pub struct Usage {
    /// Resident memory now (`VmRSS`), KiB.
    pub rss_kib: u64,
    /// Peak resident memory since the last [`Device::reset_peak_rss`] (`VmHWM`), KiB.
    pub peak_kib: u64,
    /// User and system CPU time so far.
    pub cpu: Duration,
    /// Bytes allocated on disk under its replica and its home.
    pub disk: u64,
}

/// What an attack may cost the victim at most.
#[derive(Clone, Copy, Debug)]
pub struct Bounds {
    /// Growth of the peak resident memory over the resident memory before, MiB.
    pub peak_growth_mib: u64,
    /// CPU time spent, seconds.
    pub cpu_secs: f64,
    /// Growth of the disk space used, MiB.
    pub disk_growth_mib: u64,
}

impl Bounds {
    /// For attacks that carry little data.
    pub const SMALL: Bounds = Bounds {
        peak_growth_mib: 64,
        cpu_secs: 5.0,
        disk_growth_mib: 16,
    };
}

impl Device {
    /// What the running daemon costs now.
    pub fn usage(&self) -> Usage {
        let pid = self.pid().expect("the daemon runs");
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let kib = |key: &str| -> u64 {
            status
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
                .unwrap_or(0)
        };
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        // The fields after the command name, which is in parentheses and may hold spaces:
        // state is the first, utime the 12th and stime the 13th.
        let after = &stat[stat.rfind(')').unwrap() + 2..];
        let fields: Vec<&str> = after.split_whitespace().collect();
        let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
        // SAFETY: sysconf reads a constant of the system; it touches no memory of ours.
        let per_sec = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
        Usage {
            rss_kib: kib("VmRSS:"),
            peak_kib: kib("VmHWM:"),
            cpu: Duration::from_millis(ticks * 1000 / per_sec),
            disk: disk_used(&self.dir) + disk_used(&self.home),
        }
    }

    /// The write system calls the daemon made so far, and the bytes they wrote (files and
    /// pipes: its journal, its log; not its UDP socket): `/proc/PID/io`'s `syscw`, `wchar`.
    pub fn writes(&self) -> (u64, u64) {
        let pid = self.pid().expect("the daemon runs");
        let io = std::fs::read_to_string(format!("/proc/{pid}/io")).unwrap();
        let field = |key: &str| -> u64 {
            io.lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0)
        };
        (field("syscw:"), field("wchar:"))
    }

    /// Resets the daemon's peak resident memory to what it holds now, so that the next
    /// [`Device::usage`] shows the peak since this moment.
    pub fn reset_peak_rss(&self) {
        let pid = self.pid().expect("the daemon runs");
        std::fs::write(format!("/proc/{pid}/clear_refs"), "5").unwrap();
    }
}

/// Bytes allocated on disk to everything under `root` (not following symlinks).
pub fn disk_used(root: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let Ok(md) = std::fs::symlink_metadata(e.path()) else {
                continue;
            };
            total += md.blocks() * 512;
            if md.is_dir() {
                stack.push(e.path());
            }
        }
    }
    total
}

/// A victim `a` and an honest peer `b` sharing `work`, and `mallory`, whom `a` trusts with
/// `work`. Built stopped, so a test can set files up first; [`Scene::start`] starts both and
/// waits for them to be in sync.
pub struct Scene {
    /// The victim.
    pub a: Device,
    /// The honest peer.
    pub b: Device,
    /// The hostile peer's identity.
    pub mallory: Identity,
    /// The runtime the hostile peer runs on.
    pub rt: tokio::runtime::Runtime,
    /// The victim's usage once started and in sync.
    pub before: Option<Usage>,
    /// The temporary directory everything lives in.
    pub t: std::sync::Arc<tempfile::TempDir>,
    rounds: u32,
}

impl Scene {
    /// Both devices made and paired, mallory trusted by `a`; nothing running.
    pub fn new() -> Scene {
        Scene::named("a")
    }

    /// [`Scene::new`], the victim's device named `victim`.
    pub fn named(victim: &str) -> Scene {
        let t = tmp();
        let a = Device::new(&t, victim);
        let b = Device::new(&t, "b");
        pair(&a, &b);
        let mallory = trusted_mallory(&a);
        Scene {
            a,
            b,
            mallory,
            rt: tokio::runtime::Runtime::new().unwrap(),
            before: None,
            t,
            rounds: 0,
        }
    }

    /// Starts both, waits until they are in sync, and notes the victim's usage.
    pub fn start(&mut self) {
        Device::start_together(&mut [&mut self.a, &mut self.b]);
        wait_synced(&[&self.a, &self.b], 60);
        self.a.reset_peak_rss();
        self.before = Some(self.a.usage());
    }

    /// Restarts the victim (an attack may wait for the next start) and waits until it is in
    /// sync again. The new process is held to the old one's memory and disk before the
    /// attack, and its CPU time counts from its start.
    pub fn restart_victim(&mut self) {
        self.a.stop();
        self.a.start();
        wait_synced(&[&self.a, &self.b], 60);
        if let Some(before) = &mut self.before {
            before.cpu = Duration::ZERO;
        }
    }

    /// Mallory, connected to the victim.
    pub fn connect(&self) -> Mallory {
        self.rt.block_on(Mallory::connect(&self.a, &self.mallory))
    }

    /// The honest peer still syncs with the victim, both ways: a new file on each side
    /// arrives on the other within 30 s.
    pub fn honest_peer_syncs(&mut self, when: &str) {
        self.rounds += 1;
        let from_b = format!("honest/{when}-{}-from-b.txt", self.rounds);
        let from_a = format!("honest/{when}-{}-from-a.txt", self.rounds);
        write(&self.b.path(&from_b), when.as_bytes());
        write(&self.a.path(&from_a), when.as_bytes());
        let t0 = Instant::now();
        while std::fs::read(self.a.path(&from_b)).ok().as_deref() != Some(when.as_bytes())
            || std::fs::read(self.b.path(&from_a)).ok().as_deref() != Some(when.as_bytes())
        {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "the honest peer stopped syncing {when} the attack:\n{}",
                self.a.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Asserts what the attack `item` cost the victim since [`Scene::start`] is within
    /// `bounds`, and prints the figures.
    pub fn assert_bounded(&self, item: &str, bounds: Bounds) -> Usage {
        let before = self.before.expect("the scene was started");
        let after = self.a.usage();
        let peak_growth = after.peak_kib.saturating_sub(before.rss_kib);
        let cpu = after.cpu.saturating_sub(before.cpu);
        let disk_growth = after.disk.saturating_sub(before.disk);
        eprintln!(
            "{item}: victim RSS {} -> {} KiB, peak +{peak_growth} KiB (bound {} MiB); CPU {:.2} s (bound {} s); disk +{} KiB (bound {} MiB)",
            before.rss_kib,
            after.rss_kib,
            bounds.peak_growth_mib,
            cpu.as_secs_f64(),
            bounds.cpu_secs,
            disk_growth / 1024,
            bounds.disk_growth_mib
        );
        assert!(
            peak_growth <= bounds.peak_growth_mib << 10,
            "{item}: peak RSS grew by {peak_growth} KiB"
        );
        assert!(
            cpu.as_secs_f64() <= bounds.cpu_secs,
            "{item}: the victim spent {cpu:?} of CPU"
        );
        assert!(
            disk_growth <= bounds.disk_growth_mib << 20,
            "{item}: the victim's disk use grew by {disk_growth} bytes"
        );
        after
    }
}

/// Waits until `cond` holds, for at most `secs`; fails with `what` and the victim's log.
pub fn wait_until(secs: u64, what: &str, dev: &Device, mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(
            t0.elapsed() < Duration::from_secs(secs),
            "{what} within {secs} s:\n{}",
            dev.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A client's TLS session cache that counts the resumption tickets servers give it.
#[derive(Debug)]
pub struct CountingTickets {
    inner: rustls::client::ClientSessionMemoryCache,
    /// Tickets given so far.
    pub given: std::sync::atomic::AtomicUsize,
    /// Tickets offered back to a server so far (each an attempt to resume).
    pub offered: std::sync::atomic::AtomicUsize,
}

impl CountingTickets {
    /// An empty cache.
    pub fn new() -> std::sync::Arc<CountingTickets> {
        std::sync::Arc::new(CountingTickets {
            inner: rustls::client::ClientSessionMemoryCache::new(32),
            given: Default::default(),
            offered: Default::default(),
        })
    }
}

impl rustls::client::ClientSessionStore for CountingTickets {
    fn set_kx_hint(
        &self,
        server_name: rustls::pki_types::ServerName<'static>,
        group: rustls::NamedGroup,
    ) {
        self.inner.set_kx_hint(server_name, group)
    }
    fn kx_hint(
        &self,
        server_name: &rustls::pki_types::ServerName<'_>,
    ) -> Option<rustls::NamedGroup> {
        self.inner.kx_hint(server_name)
    }
    fn set_tls12_session(
        &self,
        server_name: rustls::pki_types::ServerName<'static>,
        value: rustls::client::Tls12ClientSessionValue,
    ) {
        self.inner.set_tls12_session(server_name, value)
    }
    fn tls12_session(
        &self,
        server_name: &rustls::pki_types::ServerName<'_>,
    ) -> Option<rustls::client::Tls12ClientSessionValue> {
        self.inner.tls12_session(server_name)
    }
    fn remove_tls12_session(&self, server_name: &rustls::pki_types::ServerName<'static>) {
        self.inner.remove_tls12_session(server_name)
    }
    fn insert_tls13_ticket(
        &self,
        server_name: rustls::pki_types::ServerName<'static>,
        value: rustls::client::Tls13ClientSessionValue,
    ) {
        self.given.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.insert_tls13_ticket(server_name, value)
    }
    fn take_tls13_ticket(
        &self,
        server_name: &rustls::pki_types::ServerName<'static>,
    ) -> Option<rustls::client::Tls13ClientSessionValue> {
        let t = self.inner.take_tls13_ticket(server_name);
        if t.is_some() {
            self.offered
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        t
    }
}

/// Accepts whatever certificate the server shows (signatures still checked): the hostile
/// client cares about getting in, not about whom it talks to.
#[derive(Debug)]
struct AnyServer(std::sync::Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AnyServer {
    fn verify_server_cert(
        &self,
        _end_entity: &rustls::pki_types::CertificateDer<'_>,
        _intermediates: &[rustls::pki_types::CertificateDer<'_>],
        _server_name: &rustls::pki_types::ServerName<'_>,
        _ocsp: &[u8],
        _now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }
    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// A QUIC client config for `identity` that keeps and offers TLS resumption tickets in
/// `tickets` (the daemon's own dialer never resumes: `transport::handshake::client_config`).
pub fn resuming_client(
    identity: &Identity,
    tickets: std::sync::Arc<CountingTickets>,
) -> quinn::ClientConfig {
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(rustls::pki_types::PrivatePkcs8KeyDer::from(
        identity.key_der.clone(),
    ));
    let cert = rustls::pki_types::CertificateDer::from(identity.cert_der.clone());
    let mut tls = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(std::sync::Arc::new(AnyServer(provider)))
        .with_client_auth_cert(vec![cert], key)
        .unwrap();
    tls.alpn_protocols = vec![transport::ALPN.to_vec()];
    tls.resumption = rustls::client::Resumption::store(tickets);
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls).unwrap();
    quinn::ClientConfig::new(std::sync::Arc::new(crypto))
}
