//! Transfer rate of the peer transport: two devices on 127.0.0.1, the source sending 1 MiB
//! chunk responses over 8 streams of one QUIC connection (as a peer sends file content), the
//! sink reading every stream to its end and acknowledging the bytes it got. A measurement for
//! choosing the transport tuning, not a check; the numbers mean something only in a release
//! build:
//!
//! `cargo run --release -p meshfs-daemon --example transport_rate [-- --relay]`
//!
//! - by default over loopback: 256 MiB (`MESHFS_THROUGHPUT_MIB`) with the default congestion
//!   controller (`MESHFS_COMPARE_CONGESTION=1`: the rate window, quinn's BBR, CUBIC);
//! - `--relay`: through a userspace UDP relay on 127.0.0.1 that adds 45 ms each way behind a
//!   rate-limited drop-tail queue of one bandwidth-delay product (tc netem is not available
//!   everywhere): 400 Mbit/s (`MESHFS_RELAY_MBIT`), 256 MiB (`MESHFS_RELAY_MIB`), no random
//!   loss (`MESHFS_RELAY_LOSS_PPM`, packets per million), CUBIC, quinn's BBR, then
//!   the window from the delivery rate (meshfs's default).
//!
//! One line per controller: MB/s of payload (10^6 bytes a second), UDP bytes sent per byte of
//! payload, round-trip time and lost packets (and, through the relay, congestion events).

use anyhow::{bail, Context};
use meshfs_daemon::identity::Identity;
use meshfs_daemon::transport::{
    accept, dial, endpoint_with, link_stats, read_message, write_message, CongestionControl,
    LinkStats, TrustStore, Tuning,
};
use meshfs_protocol::{ChunkResponse, FolderId, Hash, IndexAck, Message};
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

const STREAMS: usize = 8;
const FRAME_DATA: usize = 1 << 20;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    match std::env::args().nth(1).as_deref() {
        None => loopback().await,
        Some("--relay") => through_relay().await,
        Some(other) => bail!("unknown argument {other:?}; usage: transport_rate [--relay]"),
    }
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

async fn loopback() -> anyhow::Result<()> {
    let mib: usize = env_or("MESHFS_THROUGHPUT_MIB", 256);
    let mut controllers = vec![Tuning::default().congestion];
    if std::env::var_os("MESHFS_COMPARE_CONGESTION").is_some() {
        controllers = vec![
            CongestionControl::Rate,
            CongestionControl::Bbr,
            CongestionControl::Cubic,
        ];
    }
    for congestion in controllers {
        let tuning = Tuning {
            congestion,
            ..Tuning::default()
        };
        let (mb_s, stats) = measure(&tuning, mib << 20, None).await?;
        println!(
            "loopback, {mib} MiB, {congestion:?}: {mb_s:.0} MB/s over {STREAMS} streams (UDP bytes sent / payload {:.3}, rtt {:?}, {} lost packets)",
            stats.bytes_sent as f64 / (mib << 20) as f64,
            stats.rtt,
            stats.lost_packets
        );
    }
    Ok(())
}

async fn through_relay() -> anyhow::Result<()> {
    let mbit: u64 = env_or("MESHFS_RELAY_MBIT", 400);
    let mib: usize = env_or("MESHFS_RELAY_MIB", 256);
    let link = RelayLink {
        one_way_delay: Duration::from_millis(45),
        bits_per_second: mbit * 1_000_000,
        // One bandwidth-delay product of queue.
        queue_bytes: (mbit * 1_000_000 / 8 * 90 / 1000) as usize,
        loss_per_million: env_or("MESHFS_RELAY_LOSS_PPM", 0),
    };
    let variants = [
        CongestionControl::Cubic,
        CongestionControl::Bbr,
        CongestionControl::Rate,
    ];
    for congestion in variants {
        let tuning = Tuning {
            congestion,
            ..Tuning::default()
        };
        let (mb_s, stats) = measure(&tuning, mib << 20, Some(link)).await?;
        println!(
            "relay {mbit} Mbit/s x 90 ms, {} ppm random loss, {congestion:?}: {mb_s:.1} MB/s (UDP bytes sent / payload {:.2}, {} lost packets, {:.1} % of the payload lost, {} congestion events, rtt {:?})",
            link.loss_per_million,
            stats.bytes_sent as f64 / (mib << 20) as f64,
            stats.lost_packets,
            100.0 * stats.lost_bytes as f64 / (mib << 20) as f64,
            stats.congestion_events,
            stats.rtt
        );
    }
    Ok(())
}

/// One device: identity, trust store and endpoint on 127.0.0.1.
struct Device {
    identity: Identity,
    trust: TrustStore,
    endpoint: quinn::Endpoint,
}

impl Device {
    fn new(tuning: &Tuning) -> anyhow::Result<Device> {
        let identity = Identity::generate()?;
        let trust = TrustStore::default();
        let endpoint = endpoint_with(&identity, localhost(), trust.clone(), tuning)?;
        Ok(Device {
            identity,
            trust,
            endpoint,
        })
    }
}

fn localhost() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// Sends `total` bytes as 1 MiB chunk responses over [`STREAMS`] streams of one connection;
/// returns MB/s (10^6 bytes per second of payload) and the dialer's link stats.
async fn measure(
    tuning: &Tuning,
    total: usize,
    via_relay: Option<RelayLink>,
) -> anyhow::Result<(f64, LinkStats)> {
    let server = Device::new(tuning)?;
    let client = Device::new(tuning)?;
    server.trust.add(client.identity.device_id);
    client.trust.add(server.identity.device_id);
    let listener = server.endpoint.clone();
    let accepted = tokio::spawn(async move {
        let incoming = listener
            .accept()
            .await
            .context("the sink's endpoint closed")?;
        anyhow::Ok(accept(&listener, incoming).await?)
    });
    let server_addr = server.endpoint.local_addr()?;
    let target = match via_relay {
        Some(link) => relay(server_addr, link).await?,
        None => server_addr,
    };
    let conn = dial(&client.endpoint, target, server.identity.device_id).await?;
    let (theirs, _) = accepted.await??;

    // The sink reads every stream to its end and acknowledges the bytes it got.
    tokio::spawn(async move {
        while let Ok((mut send, mut recv)) = theirs.accept_bi().await {
            tokio::spawn(async move {
                let mut got = 0u64;
                while let Ok(Some(msg)) = read_message(&mut recv).await {
                    if let Message::Response(ChunkResponse { data: Some(d), .. }) = msg {
                        got += d.len() as u64;
                    }
                }
                let Ok(folder) = FolderId::new("bench") else {
                    return;
                };
                let ack = Message::IndexAck(IndexAck {
                    folder,
                    sequence: got,
                });
                if write_message(&mut send, &ack).await.is_ok() {
                    let _ = send.finish();
                }
            });
        }
    });

    let per_stream = total / STREAMS;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..STREAMS {
        let conn = conn.clone();
        tasks.push(tokio::spawn(async move {
            let (mut send, mut recv) = conn.open_bi().await?;
            let chunk = Message::Response(ChunkResponse {
                hash: Hash::ZERO,
                data: Some(vec![0x5a; FRAME_DATA]),
                compressed: false,
            });
            for _ in 0..per_stream / FRAME_DATA {
                write_message(&mut send, &chunk).await?;
            }
            send.finish()?;
            match read_message(&mut recv).await? {
                Some(Message::IndexAck(ack)) => anyhow::Ok(ack.sequence),
                other => bail!("the sink answered {other:?} instead of an acknowledgement"),
            }
        }));
    }
    let mut received = 0u64;
    for t in tasks {
        received += t.await??;
    }
    let secs = started.elapsed().as_secs_f64();
    let sent = (per_stream / FRAME_DATA * FRAME_DATA * STREAMS) as u64;
    if received != sent {
        bail!("the sink acknowledged {received} bytes of {sent}");
    }
    Ok((received as f64 / secs / 1e6, link_stats(&conn)))
}

/// A bottleneck emulated by [`relay`]: one-way delay, rate, and a drop-tail queue.
#[derive(Clone, Copy)]
struct RelayLink {
    one_way_delay: Duration,
    bits_per_second: u64,
    queue_bytes: usize,
    /// Random (non-congestion) loss, in packets per million.
    loss_per_million: u32,
}

/// One direction of the relay's link: when its queue drains, and what is in flight.
#[derive(Default)]
struct Direction {
    busy_until: Option<Instant>,
    queue: VecDeque<(Instant, Vec<u8>)>,
}

/// The relay's state, even if a thread panicked while holding it (the measurement then
/// fails on its own).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A UDP relay in front of `server`: returns the address to dial instead. Datagrams from the
/// server go back to the last client address seen.
async fn relay(server: SocketAddr, link: RelayLink) -> anyhow::Result<SocketAddr> {
    let raw = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::DGRAM, None)?;
    let _ = raw.set_recv_buffer_size(16 << 20);
    let _ = raw.set_send_buffer_size(16 << 20);
    raw.bind(&localhost().into())?;
    raw.set_nonblocking(true)?;
    let socket = Arc::new(tokio::net::UdpSocket::from_std(raw.into())?);
    let addr = socket.local_addr()?;

    let directions = Arc::new(Mutex::new([Direction::default(), Direction::default()]));
    let client: Arc<Mutex<Option<SocketAddr>>> = Arc::default();
    let notify = Arc::new(tokio::sync::Notify::new());

    {
        let (socket, directions, client, notify) = (
            socket.clone(),
            directions.clone(),
            client.clone(),
            notify.clone(),
        );
        tokio::spawn(async move {
            let mut buf = vec![0u8; 65536];
            let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
            loop {
                let Ok((n, from)) = socket.recv_from(&mut buf).await else {
                    return;
                };
                let now = Instant::now();
                // xorshift64: a fixed, reproducible loss pattern.
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                if seed % 1_000_000 < u64::from(link.loss_per_million) {
                    continue;
                }
                let dir = if from == server {
                    1
                } else {
                    *lock(&client) = Some(from);
                    0
                };
                let mut dirs = lock(&directions);
                let d = &mut dirs[dir];
                // Bytes still waiting to be serialized onto the link.
                let backlog = d
                    .busy_until
                    .map_or(0.0, |t| t.saturating_duration_since(now).as_secs_f64())
                    * link.bits_per_second as f64
                    / 8.0;
                if backlog as usize + n > link.queue_bytes {
                    continue; // drop-tail
                }
                let start = d.busy_until.map_or(now, |t| t.max(now));
                let done =
                    start + Duration::from_secs_f64(n as f64 * 8.0 / link.bits_per_second as f64);
                d.busy_until = Some(done);
                d.queue
                    .push_back((done + link.one_way_delay, buf[..n].to_vec()));
                drop(dirs);
                notify.notify_one();
            }
        });
    }
    tokio::spawn(async move {
        loop {
            let (due, next_at) = {
                let mut dirs = lock(&directions);
                let now = Instant::now();
                let mut due = Vec::new();
                let mut next_at: Option<Instant> = None;
                for (i, d) in dirs.iter_mut().enumerate() {
                    while let Some((at, _)) = d.queue.front() {
                        if *at > now {
                            next_at = Some(next_at.map_or(*at, |n| n.min(*at)));
                            break;
                        }
                        if let Some((_, packet)) = d.queue.pop_front() {
                            due.push((i, packet));
                        }
                    }
                }
                (due, next_at)
            };
            for (dir, packet) in due {
                let to = if dir == 0 {
                    Some(server)
                } else {
                    *lock(&client)
                };
                if let Some(to) = to {
                    let _ = socket.send_to(&packet, to).await;
                }
            }
            match next_at {
                Some(at) => {
                    tokio::select! {
                        _ = tokio::time::sleep_until(at.into()) => {}
                        _ = notify.notified() => {}
                    }
                }
                None => notify.notified().await,
            }
        }
    });
    Ok(addr)
}
