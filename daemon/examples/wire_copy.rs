//! A plain copy of a directory tree over meshfs's peer transport: the floor under the
//! benchmark's transfer rows (`bench/run --tools wire-copy`, `bench/README.md`).
//!
//! It moves files the way the simplest tool on meshfs's wire could: the same QUIC endpoint,
//! TLS 1.3 with the devices' certificates, [`Tuning::default`] (congestion window, flow-control
//! windows, segmentation offload) as the daemon, and nothing else. No chunking, no hashing, no
//! journal, no index exchange, no fsync, no staging: the sender reads each file and streams it,
//! the receiver writes what arrives straight into place. What a sync of meshfs's costs above
//! this is meshfs's own work; what this costs above rsync's daemon is the transport's.
//!
//! ```text
//! wire_copy id HOME                          create HOME's identity if absent, print its id
//! wire_copy serve [--tcp] HOME LISTEN ROOT PEER_ID   write the copies PEER_ID sends under ROOT
//! wire_copy send [--tcp] HOME ADDR PEER_ID ROOT      copy ROOT to the server PEER_ID at ADDR
//! ```
//!
//! `--tcp` (both ends) carries the same entries over one TCP connection with TLS 1.3 in
//! userspace (rustls, no kernel TLS), the same certificates and the same checks of the other
//! end as the QUIC endpoint's ([`tls_server_config`], [`tls_client_config`]): the measurement
//! behind the choice of meshfs's transport (issue #46, `docs/decisions.md`).
//!
//! `WIRE_COPY_CC=rate|bbr|cubic` picks the congestion controller on both ends (default: the
//! daemon's, `rate`), to tell the controller's share of the time from the transport's;
//! `WIRE_COPY_THREADS=N` the runtime's worker threads (default 2, the daemon's on two cores).
//!
//! The sender cuts files into pieces of at most [`PIECE`] bytes and sends them over
//! [`STREAMS`] streams of one connection, each stream taking the next piece when it is done
//! with one (so a large file is spread over every stream, and many small files too). On each
//! stream, an entry is `kind: u8`, `path: u16 length + bytes` (relative, `/`-separated),
//! `mode: u32`, then for a file piece `mtime: u64 seconds + u32 nanoseconds, offset: u64,
//! len: u64` and the bytes (the receiver sets the time after each piece), for a symbolic link
//! `target: u16 length + bytes`; a kind of 0 ends the stream, and the receiver answers with the
//! file bytes it wrote on that stream (`u64`). The sender exits 0 once every stream's answer
//! matches what it sent. All integers are big-endian. Over TCP there is one stream, the
//! connection, and every entry goes over it in turn, as rsync's do.

use anyhow::{bail, ensure, Context};
use bytes::Bytes;
use meshfs_daemon::identity::Identity;
use meshfs_daemon::transport::{
    accept, dial, endpoint_with, tls_client_config, tls_server_config, CongestionControl,
    TrustStore, Tuning, SERVER_NAME,
};
use meshfs_protocol::DeviceId;
use std::collections::VecDeque;
use std::fs::{self, File, OpenOptions};
use std::net::SocketAddr;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Streams of the one connection (the daemon's content fetch uses as many).
const STREAMS: usize = 8;
/// The largest piece of a file one entry carries.
const PIECE: u64 = 8 << 20;
/// Bytes read from a file at a time.
const READ: usize = 1 << 20;

const END: u8 = 0;
const FILE: u8 = 1;
const DIR: u8 = 2;
const SYMLINK: u8 = 3;

fn main() -> anyhow::Result<()> {
    // The daemon's runtime has a worker per core; `WIRE_COPY_THREADS` measures other counts.
    let workers = match std::env::var("WIRE_COPY_THREADS") {
        Ok(n) => n
            .parse::<usize>()
            .ok()
            .filter(|n| *n > 0)
            .with_context(|| format!("WIRE_COPY_THREADS={n:?}: expected a positive count"))?,
        Err(_) => 2,
    };
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()?
        .block_on(run())
}

async fn run() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let tcp = args.iter().any(|a| a == "--tcp");
    let args: Vec<&str> = args
        .iter()
        .map(String::as_str)
        .filter(|a| *a != "--tcp")
        .collect();
    match args.as_slice() {
        ["id", home] => {
            println!("{}", identity(Path::new(home))?.device_id);
            Ok(())
        }
        ["serve", home, listen, root, peer] => {
            let (home, root) = (Path::new(home), Path::new(root));
            if tcp {
                serve_tcp(home, listen.parse()?, root, peer.parse()?).await
            } else {
                serve(home, listen.parse()?, root, peer.parse()?).await
            }
        }
        ["send", home, addr, peer, root] => {
            let (home, root) = (Path::new(home), Path::new(root));
            if tcp {
                send_tcp(home, addr.parse()?, peer.parse()?, root).await
            } else {
                send(home, addr.parse()?, peer.parse()?, root).await
            }
        }
        _ => bail!(
            "usage: wire_copy id HOME | serve [--tcp] HOME LISTEN ROOT PEER_ID | send [--tcp] HOME ADDR PEER_ID ROOT"
        ),
    }
}

/// The daemon's tuning, with the controller of `WIRE_COPY_CC` if set.
fn tuning() -> anyhow::Result<Tuning> {
    let congestion = match std::env::var("WIRE_COPY_CC").as_deref() {
        Err(_) | Ok("rate") => CongestionControl::Rate,
        Ok("bbr") => CongestionControl::Bbr,
        Ok("cubic") => CongestionControl::Cubic,
        Ok(other) => bail!("WIRE_COPY_CC={other:?}: expected rate, bbr or cubic"),
    };
    Ok(Tuning {
        congestion,
        ..Tuning::default()
    })
}

/// HOME's identity, made on first use.
fn identity(home: &Path) -> anyhow::Result<Identity> {
    if !Identity::exists(home) {
        Identity::generate()?.save(home)?;
    }
    Ok(Identity::load(home)?)
}

// ---------------------------------------------------------------------------------------
// Sender

/// One entry the sender owes the receiver.
enum Entry {
    Dir {
        path: PathBuf,
        mode: u32,
    },
    Symlink {
        path: PathBuf,
        target: PathBuf,
    },
    Piece {
        path: PathBuf,
        mode: u32,
        mtime: SystemTime,
        offset: u64,
        len: u64,
    },
}

async fn send(home: &Path, addr: SocketAddr, peer: DeviceId, root: &Path) -> anyhow::Result<()> {
    let started = Instant::now();
    let cpu0 = cpu_seconds();
    let me = identity(home)?;
    let trust = TrustStore::new([peer]);
    let endpoint = endpoint_with(&me, SocketAddr::from(([0, 0, 0, 0], 0)), trust, &tuning()?)?;
    let conn = dial(&endpoint, addr, peer).await?;
    let root = Arc::new(root.to_path_buf());
    let walk_root = root.clone();
    let entries = tokio::task::spawn_blocking(move || walk(&walk_root)).await??;
    let sent = file_bytes(&entries);
    let queue = Arc::new(Mutex::new(VecDeque::from(entries)));
    let mut streams = Vec::new();
    for _ in 0..STREAMS {
        let (conn, queue, root) = (conn.clone(), queue.clone(), root.clone());
        streams.push(tokio::spawn(async move {
            let (mut tx, mut rx) = conn.open_bi().await?;
            let mut buf = Vec::new();
            loop {
                let next = queue.lock().unwrap_or_else(|p| p.into_inner()).pop_front();
                let Some(entry) = next else { break };
                send_entry(&mut tx, &root, entry, &mut buf).await?;
            }
            tx.write_all(&[END]).await?;
            tx.finish()?;
            let mut answer = [0u8; 8];
            rx.read_exact(&mut answer)
                .await
                .context("the receiver did not answer")?;
            anyhow::Ok(u64::from_be_bytes(answer))
        }));
    }
    let mut written = 0;
    for s in streams {
        written += s.await??;
    }
    done(addr, started, sent, written, || {
        transport_report("sender", &conn, cpu_seconds() - cpu0, sent)
    })?;
    conn.close(0u32.into(), b"done");
    // Long enough for the close to leave; not its draining period (three probe timeouts, over
    // half a second on a 90 ms path), which would count in the copy's time where rsync's exit
    // waits for nothing of the kind.
    let _ = tokio::time::timeout(Duration::from_millis(20), endpoint.wait_idle()).await;
    Ok(())
}

/// The file bytes the entries carry.
fn file_bytes(entries: &[Entry]) -> u64 {
    entries
        .iter()
        .map(|e| match e {
            Entry::Piece { len, .. } => *len,
            _ => 0,
        })
        .sum()
}

/// Checks that the receiver wrote what was sent, then prints the copy's time and the carrier's
/// `report`.
fn done(
    addr: SocketAddr,
    started: Instant,
    sent: u64,
    written: u64,
    report: impl FnOnce() -> String,
) -> anyhow::Result<()> {
    ensure!(
        written == sent,
        "the receiver wrote {written} bytes of {sent}"
    );
    eprintln!(
        "wire_copy: {sent} bytes to {addr} in {:.3} s",
        started.elapsed().as_secs_f64()
    );
    eprintln!("{}", report());
    Ok(())
}

/// What the transport did on one side of a copy of `bytes` file bytes, on one line: datagrams
/// per send call (segmentation offload at work), ACK frames per
/// data packet, packets lost, the path's MTU, and this process's CPU per GB (user + system).
fn transport_report(side: &str, conn: &quinn::Connection, cpu: f64, bytes: u64) -> String {
    let s = conn.stats();
    let per = |n: u64, d: u64| if d == 0 { 0.0 } else { n as f64 / d as f64 };
    let gb = bytes as f64 / 1e9;
    format!(
        "wire_copy: {side}: datagrams {} sent in {} calls ({:.1} per call), {} received; ACK \
         frames {} sent, {} received ({:.3} per data packet); {} of {} packets lost; MTU {}; \
         CPU {:.2} s ({:.2} s per GB)",
        s.udp_tx.datagrams,
        s.udp_tx.ios,
        per(s.udp_tx.datagrams, s.udp_tx.ios),
        // (quinn counts a receive "io" per packet handled, not per system call: the receive
        // calls are counted outside, `perf stat -e 'syscalls:sys_enter_recv*'`.)
        s.udp_rx.datagrams,
        s.frame_tx.acks,
        s.frame_rx.acks,
        // The data flows one way: the ACKs that count are those of the receiving side.
        if side == "sender" {
            per(s.frame_rx.acks, s.udp_tx.datagrams)
        } else {
            per(s.frame_tx.acks, s.udp_rx.datagrams)
        },
        s.path.lost_packets,
        s.path.sent_packets,
        s.path.current_mtu,
        cpu,
        if gb > 0.0 { cpu / gb } else { 0.0 },
    )
}

/// User and system CPU this process has used, in seconds.
fn cpu_seconds() -> f64 {
    let mut u = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage fills the struct it is given; RUSAGE_SELF is always valid.
    let u = unsafe {
        libc::getrusage(libc::RUSAGE_SELF, u.as_mut_ptr());
        u.assume_init()
    };
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}

/// Every directory, symbolic link and file piece under `root`, directories first.
fn walk(root: &Path) -> anyhow::Result<Vec<Entry>> {
    let (mut dirs, mut rest) = (Vec::new(), Vec::new());
    let mut todo = vec![PathBuf::new()];
    while let Some(rel) = todo.pop() {
        for item in fs::read_dir(root.join(&rel)).with_context(|| format!("reading {rel:?}"))? {
            let item = item?;
            let path = rel.join(item.file_name());
            let meta = item.metadata()?;
            let mode = meta.permissions().mode() & 0o7777;
            if meta.is_dir() {
                dirs.push(Entry::Dir {
                    path: path.clone(),
                    mode,
                });
                todo.push(path);
            } else if meta.is_symlink() {
                let target = fs::read_link(item.path())?;
                rest.push(Entry::Symlink { path, target });
            } else if meta.is_file() {
                let size = meta.len();
                let mtime = meta.modified()?;
                let mut offset = 0;
                loop {
                    let len = PIECE.min(size - offset);
                    rest.push(Entry::Piece {
                        path: path.clone(),
                        mode,
                        mtime,
                        offset,
                        len,
                    });
                    offset += len;
                    if offset >= size {
                        break;
                    }
                }
            }
        }
    }
    dirs.append(&mut rest);
    Ok(dirs)
}

/// Where the sender's entries go: a QUIC stream, or the TLS stream over TCP.
trait Out: AsyncWrite + Unpin {
    /// Sends `buf`'s bytes; gives the buffer back where the carrier copied them.
    async fn put(&mut self, buf: Vec<u8>) -> anyhow::Result<Option<Vec<u8>>>;
}

impl Out for quinn::SendStream {
    /// Hands the buffer over: quinn keeps it until the peer acknowledges it, no copy.
    async fn put(&mut self, buf: Vec<u8>) -> anyhow::Result<Option<Vec<u8>>> {
        self.write_chunk(Bytes::from(buf)).await?;
        Ok(None)
    }
}

impl Out for tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    /// rustls encrypts from the buffer into its records: the buffer serves again.
    async fn put(&mut self, buf: Vec<u8>) -> anyhow::Result<Option<Vec<u8>>> {
        self.write_all(&buf).await?;
        Ok(Some(buf))
    }
}

/// Sends one entry; `spare` is a read buffer a carrier gave back, for the next read.
async fn send_entry(
    tx: &mut impl Out,
    root: &Path,
    entry: Entry,
    spare: &mut Vec<u8>,
) -> anyhow::Result<()> {
    let mut head = Vec::with_capacity(64);
    match entry {
        Entry::Dir { path, mode } => {
            head_of(&mut head, DIR, &path, mode)?;
            tx.write_all(&head).await?;
        }
        Entry::Symlink { path, target } => {
            head_of(&mut head, SYMLINK, &path, 0o777)?;
            put_path(&mut head, &target)?;
            tx.write_all(&head).await?;
        }
        Entry::Piece {
            path,
            mode,
            mtime,
            offset,
            len,
        } => {
            head_of(&mut head, FILE, &path, mode)?;
            let since = mtime.duration_since(UNIX_EPOCH).unwrap_or_default();
            head.extend_from_slice(&since.as_secs().to_be_bytes());
            head.extend_from_slice(&since.subsec_nanos().to_be_bytes());
            head.extend_from_slice(&offset.to_be_bytes());
            head.extend_from_slice(&len.to_be_bytes());
            tx.write_all(&head).await?;
            let file = File::open(root.join(&path)).with_context(|| format!("opening {path:?}"))?;
            let mut at = offset;
            while at < offset + len {
                let want = READ.min((offset + len - at) as usize);
                let mut buf = std::mem::take(spare);
                buf.resize(want, 0);
                tokio::task::block_in_place(|| file.read_exact_at(&mut buf, at))
                    .with_context(|| format!("reading {path:?} (did it shrink?)"))?;
                if let Some(back) = tx.put(buf).await? {
                    *spare = back;
                }
                at += want as u64;
            }
        }
    }
    Ok(())
}

fn head_of(head: &mut Vec<u8>, kind: u8, path: &Path, mode: u32) -> anyhow::Result<()> {
    head.push(kind);
    put_path(head, path)?;
    head.extend_from_slice(&mode.to_be_bytes());
    Ok(())
}

fn put_path(head: &mut Vec<u8>, path: &Path) -> anyhow::Result<()> {
    let bytes = path.as_os_str().as_bytes();
    let len = u16::try_from(bytes.len()).with_context(|| format!("{path:?} is too long"))?;
    head.extend_from_slice(&len.to_be_bytes());
    head.extend_from_slice(bytes);
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Receiver

async fn serve(home: &Path, listen: SocketAddr, root: &Path, peer: DeviceId) -> anyhow::Result<()> {
    let me = identity(home)?;
    let endpoint = endpoint_with(&me, listen, TrustStore::new([peer]), &tuning()?)?;
    eprintln!(
        "wire_copy: {} listening on {}",
        me.device_id,
        endpoint.local_addr()?
    );
    serve_on(endpoint, root).await
}

/// Accepts connections on `endpoint` and writes what they send under `root`, until the
/// endpoint closes.
async fn serve_on(endpoint: quinn::Endpoint, root: &Path) -> anyhow::Result<()> {
    fs::create_dir_all(root)?;
    let root = Arc::new(root.to_path_buf());
    while let Some(incoming) = endpoint.accept().await {
        let root = root.clone();
        let endpoint = endpoint.clone();
        tokio::spawn(async move {
            let conn = match accept(&endpoint, incoming).await {
                Ok((conn, _)) => conn,
                Err(e) => return eprintln!("wire_copy: refused a connection: {e}"),
            };
            let cpu0 = cpu_seconds();
            let written = Arc::new(std::sync::atomic::AtomicU64::new(0));
            while let Ok((mut tx, mut rx)) = conn.accept_bi().await {
                let (root, written) = (root.clone(), written.clone());
                tokio::spawn(async move {
                    let done = async {
                        receive(&mut rx, &mut tx, &root, &written).await?;
                        tx.finish()?;
                        // Keep the stream until the sender has the answer (it closes the
                        // connection then).
                        let _ = tx.stopped().await;
                        anyhow::Ok(())
                    };
                    if let Err(e) = done.await {
                        eprintln!("wire_copy: a stream failed: {e:#}");
                    }
                });
            }
            let written = written.load(std::sync::atomic::Ordering::Relaxed);
            eprintln!(
                "{}",
                transport_report("receiver", &conn, cpu_seconds() - cpu0, written)
            );
        });
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Over TCP (`--tcp`)

async fn send_tcp(
    home: &Path,
    addr: SocketAddr,
    peer: DeviceId,
    root: &Path,
) -> anyhow::Result<()> {
    let started = Instant::now();
    let cpu0 = cpu_seconds();
    let me = identity(home)?;
    let connector = tokio_rustls::TlsConnector::from(Arc::new(tls_client_config(&me, peer)?));
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .with_context(|| format!("cannot connect to {addr}"))?;
    tcp.set_nodelay(true)?;
    let name = rustls::pki_types::ServerName::try_from(SERVER_NAME)?;
    let mut tls = connector
        .connect(name, tcp)
        .await
        .with_context(|| format!("the TLS handshake with {addr} failed: refused"))?;
    let walk_root = root.to_path_buf();
    let entries = tokio::task::spawn_blocking(move || walk(&walk_root)).await??;
    let sent = file_bytes(&entries);
    let transfer = async {
        let mut buf = Vec::new();
        for entry in entries {
            send_entry(&mut tls, root, entry, &mut buf).await?;
        }
        tls.write_all(&[END]).await?;
        tls.flush().await?;
        let mut answer = [0u8; 8];
        tls.read_exact(&mut answer).await?;
        anyhow::Ok(u64::from_be_bytes(answer))
    };
    // TLS 1.3 lets the dialer write before the listener has checked its certificate: a
    // refusal shows here, as the connection ending.
    let written = transfer.await.with_context(|| {
        format!(
            "{addr} ended the connection before answering (it refuses devices it does not trust)"
        )
    })?;
    done(addr, started, sent, written, || {
        tcp_report("sender", tls.get_ref().0, cpu_seconds() - cpu0, sent)
    })?;
    let _ = tls.shutdown().await;
    Ok(())
}

async fn serve_tcp(
    home: &Path,
    listen: SocketAddr,
    root: &Path,
    peer: DeviceId,
) -> anyhow::Result<()> {
    let me = identity(home)?;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen}"))?;
    eprintln!(
        "wire_copy: {} listening on {} (TCP)",
        me.device_id,
        listener.local_addr()?
    );
    serve_tcp_on(
        listener,
        tls_server_config(&me, TrustStore::new([peer]))?,
        root,
    )
    .await
}

/// Accepts TLS connections on `listener` and writes what they send under `root`.
async fn serve_tcp_on(
    listener: tokio::net::TcpListener,
    config: rustls::ServerConfig,
    root: &Path,
) -> anyhow::Result<()> {
    fs::create_dir_all(root)?;
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let root = Arc::new(root.to_path_buf());
    loop {
        let (tcp, from) = listener.accept().await?;
        let (acceptor, root) = (acceptor.clone(), root.clone());
        tokio::spawn(async move {
            let done = async {
                tcp.set_nodelay(true)?;
                let tls = acceptor.accept(tcp).await.context("TLS handshake")?;
                let cpu0 = cpu_seconds();
                let written = std::sync::atomic::AtomicU64::new(0);
                let (mut rx, mut tx) = tokio::io::split(tls);
                receive(&mut rx, &mut tx, &root, &written).await?;
                let mut tls = rx.unsplit(tx);
                let written = written.load(std::sync::atomic::Ordering::Relaxed);
                eprintln!(
                    "{}",
                    tcp_report("receiver", tls.get_ref().0, cpu_seconds() - cpu0, written)
                );
                // The sender closes once it has the answer.
                let mut rest = Vec::new();
                let _ = tls.read_to_end(&mut rest).await;
                anyhow::Ok(())
            };
            if let Err(e) = done.await {
                eprintln!("wire_copy: the connection from {from} failed: {e:#}");
            }
        });
    }
}

/// What TCP did on one side of a copy of `bytes` file bytes, on one line: the segment size
/// both ways, retransmitted segments, and this process's CPU per GB (user + system).
fn tcp_report(side: &str, tcp: &tokio::net::TcpStream, cpu: f64, bytes: u64) -> String {
    use std::os::fd::AsRawFd;
    let mut info = std::mem::MaybeUninit::<libc::tcp_info>::zeroed();
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: TCP_INFO fills at most `len` bytes of the struct it is given, on a TCP socket.
    let info = unsafe {
        libc::getsockopt(
            tcp.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            info.as_mut_ptr().cast(),
            &mut len,
        );
        info.assume_init()
    };
    let gb = bytes as f64 / 1e9;
    format!(
        "wire_copy: {side}: TCP segments of {} B sent, {} B received; {} retransmitted; CPU \
         {cpu:.2} s ({:.2} s per GB)",
        info.tcpi_snd_mss,
        info.tcpi_rcv_mss,
        info.tcpi_total_retrans,
        if gb > 0.0 { cpu / gb } else { 0.0 },
    )
}

/// Writes the entries of one stream under `root` until its end, then answers with the file
/// bytes written (the caller closes the stream).
async fn receive(
    rx: &mut (impl AsyncRead + Unpin),
    tx: &mut (impl AsyncWrite + Unpin),
    root: &Path,
    total: &std::sync::atomic::AtomicU64,
) -> anyhow::Result<()> {
    let mut written = 0u64;
    let mut buf = Vec::with_capacity(READ);
    loop {
        let kind = read_bytes::<1>(rx).await?[0];
        if kind == END {
            break;
        }
        let path = root.join(read_path(rx).await?);
        let mode = u32::from_be_bytes(read_bytes(rx).await?);
        match kind {
            DIR => tokio::task::block_in_place(|| {
                fs::create_dir_all(&path)?;
                fs::set_permissions(&path, fs::Permissions::from_mode(mode))
            })
            .with_context(|| format!("making {path:?}"))?,
            SYMLINK => {
                let target = read_path_raw(rx).await?;
                tokio::task::block_in_place(|| {
                    make_parent(&path)?;
                    std::os::unix::fs::symlink(&target, &path)
                })
                .with_context(|| format!("linking {path:?}"))?;
            }
            FILE => {
                let secs = u64::from_be_bytes(read_bytes(rx).await?);
                let nanos = u32::from_be_bytes(read_bytes(rx).await?);
                let mtime = UNIX_EPOCH + Duration::new(secs, nanos.min(999_999_999));
                let offset = u64::from_be_bytes(read_bytes(rx).await?);
                let len = u64::from_be_bytes(read_bytes(rx).await?);
                let file = tokio::task::block_in_place(|| {
                    make_parent(&path)?;
                    OpenOptions::new()
                        .write(true)
                        .create(true)
                        .truncate(false)
                        .mode(mode)
                        .open(&path)
                })
                .with_context(|| format!("creating {path:?}"))?;
                // Gathered into READ-sized writes: quinn hands data over a packet's frame at
                // a time, and a write per frame costs more than the copy.
                let mut at = offset;
                while at < offset + len {
                    let want = READ.min((offset + len - at) as usize);
                    buf.resize(want, 0);
                    rx.read_exact(&mut buf)
                        .await
                        .context("the stream ended inside a file")?;
                    tokio::task::block_in_place(|| file.write_all_at(&buf, at))
                        .with_context(|| format!("writing {path:?}"))?;
                    at += want as u64;
                }
                // Every piece sets the time after its write, so the last one leaves it right.
                tokio::task::block_in_place(|| {
                    file.set_times(std::fs::FileTimes::new().set_modified(mtime))
                })
                .with_context(|| format!("setting the time of {path:?}"))?;
                written += len;
            }
            other => bail!("unknown entry kind {other}"),
        }
    }
    total.fetch_add(written, std::sync::atomic::Ordering::Relaxed);
    tx.write_all(&written.to_be_bytes()).await?;
    tx.flush().await?;
    Ok(())
}

fn make_parent(path: &Path) -> std::io::Result<()> {
    match path.parent() {
        Some(p) if !p.is_dir() => fs::create_dir_all(p),
        _ => Ok(()),
    }
}

/// The next `N` bytes of the stream.
async fn read_bytes<const N: usize>(rx: &mut (impl AsyncRead + Unpin)) -> anyhow::Result<[u8; N]> {
    let mut b = [0u8; N];
    rx.read_exact(&mut b).await?;
    Ok(b)
}

async fn read_path_raw(rx: &mut (impl AsyncRead + Unpin)) -> anyhow::Result<PathBuf> {
    let len = u16::from_be_bytes(read_bytes(rx).await?);
    let mut bytes = vec![0u8; len as usize];
    rx.read_exact(&mut bytes).await?;
    Ok(PathBuf::from(std::ffi::OsStr::from_bytes(&bytes)))
}

async fn read_path(rx: &mut (impl AsyncRead + Unpin)) -> anyhow::Result<PathBuf> {
    plain_relative(read_path_raw(rx).await?)
}

/// `path` if it stays under the root: no `..`, no `.`, not absolute, not empty.
fn plain_relative(path: PathBuf) -> anyhow::Result<PathBuf> {
    ensure!(
        path.components().next().is_some()
            && path.components().all(|c| matches!(c, Component::Normal(_))),
        "refusing the path {path:?}: not a plain relative path"
    );
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(path: &Path, bytes: &[u8]) {
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, bytes).unwrap();
    }

    /// Every file's bytes, mode and modification time, every directory and link, by path.
    fn tree(root: &Path) -> Vec<(PathBuf, String)> {
        let mut out = Vec::new();
        let mut todo = vec![root.to_path_buf()];
        while let Some(dir) = todo.pop() {
            for item in fs::read_dir(&dir).unwrap() {
                let path = item.unwrap().path();
                let rel = path.strip_prefix(root).unwrap().to_path_buf();
                let meta = fs::symlink_metadata(&path).unwrap();
                let what = if meta.is_dir() {
                    todo.push(path.clone());
                    format!("dir {:o}", meta.permissions().mode() & 0o7777)
                } else if meta.is_symlink() {
                    format!("link {:?}", fs::read_link(&path).unwrap())
                } else {
                    let bytes = fs::read(&path).unwrap();
                    format!(
                        "file {:o} {:?} {}",
                        meta.permissions().mode() & 0o7777,
                        meta.modified().unwrap(),
                        blake3::hash(&bytes)
                    )
                };
                out.push((rel, what));
            }
        }
        out.sort();
        out
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_tree_arrives_whole_over_the_peer_transport() {
        let tmp = tempfile::tempdir().unwrap();
        let (src, dst) = (tmp.path().join("src"), tmp.path().join("dst"));
        sample_tree(&src);

        let (home_a, home_b) = (tmp.path().join("a"), tmp.path().join("b"));
        let (a, b) = (identity(&home_a).unwrap(), identity(&home_b).unwrap());
        let trust = TrustStore::new([a.device_id]);
        let listen = SocketAddr::from(([127, 0, 0, 1], 0));
        let endpoint = endpoint_with(&b, listen, trust, &tuning().unwrap()).unwrap();
        let addr = endpoint.local_addr().unwrap();
        let server = tokio::spawn({
            let dst = dst.clone();
            async move { serve_on(endpoint, &dst).await }
        });
        send(&home_a, addr, b.device_id, &src).await.unwrap();
        server.abort();
        assert_eq!(tree(&src), tree(&dst));
        // The identities persist: the same device on the next run.
        assert_eq!(identity(&home_a).unwrap().device_id, a.device_id);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_sender_the_server_does_not_trust_gets_an_error_and_writes_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let (src, dst) = (tmp.path().join("src"), tmp.path().join("dst"));
        write(&src.join("f"), b"content");
        let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
        let b_id = identity(&b).unwrap();
        identity(&a).unwrap();
        let stranger = Identity::generate().unwrap().device_id;
        let listen = SocketAddr::from(([127, 0, 0, 1], 0));
        let endpoint = endpoint_with(
            &b_id,
            listen,
            TrustStore::new([stranger]),
            &tuning().unwrap(),
        )
        .unwrap();
        let addr = endpoint.local_addr().unwrap();
        let server = tokio::spawn({
            let dst = dst.clone();
            async move { serve_on(endpoint, &dst).await }
        });
        let err = send(&a, addr, b_id.device_id, &src).await.unwrap_err();
        server.abort();
        assert!(format!("{err:#}").contains("refused"), "{err:#}");
        assert!(!dst.join("f").exists());
    }

    /// A tree like the one above, for both carriers: a file of three pieces, one of exactly
    /// one piece, an empty one, small ones in nested directories, an empty directory with its
    /// own mode, a symbolic link.
    fn sample_tree(src: &Path) {
        let big: Vec<u8> = (0..(2 * PIECE + 12_345))
            .map(|i| (i * 7 % 251) as u8)
            .collect();
        write(&src.join("big.bin"), &big);
        write(&src.join("exact.bin"), &big[..PIECE as usize]);
        write(&src.join("empty.txt"), b"");
        for i in 0..50 {
            write(
                &src.join(format!("d{}/e/f{i}.txt", i % 3)),
                format!("file {i}").as_bytes(),
            );
        }
        fs::set_permissions(src.join("d1/e/f1.txt"), fs::Permissions::from_mode(0o640)).unwrap();
        fs::create_dir(src.join("hollow")).unwrap();
        fs::set_permissions(src.join("hollow"), fs::Permissions::from_mode(0o711)).unwrap();
        std::os::unix::fs::symlink("big.bin", src.join("link")).unwrap();
    }

    /// A TCP listener on 127.0.0.1 writing under `dst`, trusting `trusted`, as `b`.
    async fn tcp_server(
        b: &Identity,
        trusted: DeviceId,
        dst: &Path,
    ) -> (SocketAddr, tokio::task::JoinHandle<anyhow::Result<()>>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let config = tls_server_config(b, TrustStore::new([trusted])).unwrap();
        let dst = dst.to_path_buf();
        let server = tokio::spawn(async move { serve_tcp_on(listener, config, &dst).await });
        (addr, server)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_tree_arrives_whole_over_tcp_with_the_same_identities() {
        let tmp = tempfile::tempdir().unwrap();
        let (src, dst) = (tmp.path().join("src"), tmp.path().join("dst"));
        sample_tree(&src);
        let (home_a, home_b) = (tmp.path().join("a"), tmp.path().join("b"));
        let (a, b) = (identity(&home_a).unwrap(), identity(&home_b).unwrap());
        let (addr, server) = tcp_server(&b, a.device_id, &dst).await;
        send_tcp(&home_a, addr, b.device_id, &src).await.unwrap();
        server.abort();
        assert_eq!(tree(&src), tree(&dst));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn over_tcp_a_stranger_is_refused_and_a_listener_not_the_one_dialed_too() {
        let tmp = tempfile::tempdir().unwrap();
        let (src, dst) = (tmp.path().join("src"), tmp.path().join("dst"));
        write(&src.join("f"), b"content");
        let (home_a, home_b) = (tmp.path().join("a"), tmp.path().join("b"));
        let (a, b) = (identity(&home_a).unwrap(), identity(&home_b).unwrap());
        // The listener trusts someone else.
        let stranger = Identity::generate().unwrap();
        let (addr, server) = tcp_server(&b, stranger.device_id, &dst).await;
        let err = send_tcp(&home_a, addr, b.device_id, &src)
            .await
            .unwrap_err();
        assert!(format!("{err:#}").contains("refuses"), "{err:#}");
        server.abort();
        // The listener trusts us, but is not the device we meant to reach.
        let (addr, server) = tcp_server(&b, a.device_id, &dst).await;
        let err = send_tcp(&home_a, addr, stranger.device_id, &src)
            .await
            .unwrap_err();
        assert!(format!("{err:#}").contains("refused"), "{err:#}");
        server.abort();
        assert!(!dst.join("f").exists());
    }

    #[test]
    fn only_plain_relative_paths_are_written() {
        for bad in ["", "/etc/passwd", "../x", "a/../../x", "./a"] {
            assert!(
                plain_relative(PathBuf::from(bad)).is_err(),
                "{bad:?} accepted"
            );
        }
        for good in ["a", "a/b/c.txt", "..a/b..", "with space"] {
            assert_eq!(
                plain_relative(PathBuf::from(good)).unwrap(),
                Path::new(good)
            );
        }
    }
}
