//! netdelay — a userspace WAN emulator for the meshfs benchmark.
//!
//! The kernel of the benchmark machine has no `sch_netem`, so delay cannot be added with
//! `tc`. Instead every benchmark host (a network namespace) gets a TUN device, and this
//! process moves IP packets between the TUN devices:
//!
//! ```text
//!   ns A: tun0 198.18.0.1/24 ─┐                      ┌─ ns B: tun0 198.18.0.2/24
//!                             ├── netdelay (this) ───┤
//!   ns C: tun0 198.18.0.3/24 ─┘                      └─ ...
//! ```
//!
//! * One TUN per namespace, opened after `setns(2)` into that namespace (the fd stays bound
//!   to the device after we switch back).
//! * `IFF_VNET_HDR` + `TUNSETOFFLOAD` (CSUM, TSO4/6, USO4/6 when the kernel has it): the
//!   kernel hands us GSO super-packets of up to 64 KiB, so one read/write moves ~45 TCP
//!   segments and 1 Gbit/s costs a few thousand syscalls per second, not ~85,000. The
//!   virtio-net header is passed through unchanged to the destination TUN, whose kernel
//!   side turns it back into a GSO skb.
//! * Each host has an egress link of `--rate-mbit` (token-bucket / serialization model):
//!   a packet leaves at `max(now, link_free) + wire_len / rate`, where `wire_len` counts the
//!   IP headers of every segment a GSO packet stands for. If the packet would wait longer
//!   than `--queue-bytes` worth of serialization time, it is tail-dropped (like a router
//!   buffer). Then it is delivered `--delay-ms` later (one-way propagation delay).
//! * Threads: one reader per TUN (owns that host's egress link state, no locks), one writer
//!   per directed link (src → dst) that sleeps until the head packet is due and writes
//!   everything that is due. Queues are unbounded channels (bounded in practice by
//!   rate × (delay + queue time) ≈ 18 MB per link at 1 Gbit/s / 45 ms).
//! * `SIGUSR1` writes counters (JSON, with a sequence number) to `--stats FILE`.

use std::collections::HashMap;
use std::ffi::CString;
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const TUNSETOFFLOAD: libc::c_ulong = 0x4004_54d0;
const TUNSETVNETHDRSZ: libc::c_ulong = 0x4004_54d8;
const IFF_TUN: libc::c_short = 0x0001;
const IFF_NO_PI: libc::c_short = 0x1000;
const IFF_VNET_HDR: libc::c_short = 0x4000;
const TUN_F_CSUM: libc::c_uint = 0x01;
const TUN_F_TSO4: libc::c_uint = 0x02;
const TUN_F_TSO6: libc::c_uint = 0x04;
const TUN_F_TSO_ECN: libc::c_uint = 0x08;
const TUN_F_USO4: libc::c_uint = 0x20;
const TUN_F_USO6: libc::c_uint = 0x40;
const VNET_HDR_LEN: usize = 10;
const GSO_NONE: u8 = 0;
const MAX_PKT: usize = VNET_HDR_LEN + 65_536;

static DUMP_STATS: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigusr1(_: libc::c_int) {
    DUMP_STATS.store(true, Relaxed);
}

struct Args {
    hosts: Vec<(String, [u8; 4])>,
    ifname: String,
    delay: Duration,
    rate_bps: f64,
    queue_bytes: u64,
    offload: bool,
    stats: Option<String>,
    ready: Option<String>,
}

fn usage() -> ! {
    eprintln!(
        "usage: netdelay --host NETNS=IPV4 [--host NETNS=IPV4 ...] [--ifname tun0]\n\
         \x20               [--delay-ms 45] [--rate-mbit 1000] [--queue-bytes 11250000]\n\
         \x20               [--no-offload] [--stats FILE] [--ready FILE]\n\
         Creates IFNAME (a TUN device) in every NETNS and forwards IPv4 packets between\n\
         them by destination address, each delayed by --delay-ms and limited per source\n\
         host to --rate-mbit (0 = unlimited). SIGUSR1 writes counters to --stats."
    );
    std::process::exit(2)
}

fn parse_args() -> Args {
    let mut a = Args {
        hosts: vec![],
        ifname: "tun0".into(),
        delay: Duration::from_millis(45),
        rate_bps: 1e9,
        queue_bytes: 11_250_000,
        offload: true,
        stats: None,
        ready: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut val = || it.next().unwrap_or_else(|| usage());
        match arg.as_str() {
            "--host" => {
                let v = val();
                let (ns, ip) = v.split_once('=').unwrap_or_else(|| usage());
                let ip: std::net::Ipv4Addr = ip.parse().unwrap_or_else(|_| usage());
                a.hosts.push((ns.to_string(), ip.octets()));
            }
            "--ifname" => a.ifname = val(),
            "--delay-ms" => {
                let ms: f64 = val().parse().unwrap_or_else(|_| usage());
                a.delay = Duration::from_secs_f64(ms / 1000.0);
            }
            "--rate-mbit" => a.rate_bps = val().parse::<f64>().unwrap_or_else(|_| usage()) * 1e6,
            "--queue-bytes" => a.queue_bytes = val().parse().unwrap_or_else(|_| usage()),
            "--no-offload" => a.offload = false,
            "--stats" => a.stats = Some(val()),
            "--ready" => a.ready = Some(val()),
            _ => usage(),
        }
    }
    if a.hosts.len() < 2 || a.ifname.len() >= 16 {
        usage();
    }
    a
}

fn last_os_error(what: &str) -> String {
    format!("{what}: {}", std::io::Error::last_os_error())
}

fn setns_path(path: &str) -> Result<(), String> {
    let f = File::open(path).map_err(|e| format!("open {path}: {e}"))?;
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(last_os_error(&format!("setns {path}")));
    }
    Ok(())
}

/// Open a TUN device named `ifname` in the current network namespace.
fn open_tun(ifname: &str, offload: bool) -> Result<(OwnedFd, bool), String> {
    let path = CString::new("/dev/net/tun").unwrap();
    let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(last_os_error("open /dev/net/tun"));
    }
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // struct ifreq: 16 bytes name, then a union whose first member is short ifr_flags.
    let mut ifr = [0u8; 40];
    ifr[..ifname.len()].copy_from_slice(ifname.as_bytes());
    let mut flags = IFF_TUN | IFF_NO_PI;
    if offload {
        flags |= IFF_VNET_HDR;
    }
    ifr[16..18].copy_from_slice(&flags.to_ne_bytes());
    if unsafe { libc::ioctl(fd.as_raw_fd(), TUNSETIFF, ifr.as_mut_ptr()) } != 0 {
        return Err(last_os_error("TUNSETIFF"));
    }
    let mut uso = false;
    if offload {
        let hdr: libc::c_int = VNET_HDR_LEN as libc::c_int;
        if unsafe { libc::ioctl(fd.as_raw_fd(), TUNSETVNETHDRSZ, &hdr) } != 0 {
            return Err(last_os_error("TUNSETVNETHDRSZ"));
        }
        let base = TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6 | TUN_F_TSO_ECN;
        let with_uso = base | TUN_F_USO4 | TUN_F_USO6;
        if unsafe { libc::ioctl(fd.as_raw_fd(), TUNSETOFFLOAD, with_uso as libc::c_ulong) } == 0 {
            uso = true;
        } else if unsafe { libc::ioctl(fd.as_raw_fd(), TUNSETOFFLOAD, base as libc::c_ulong) } != 0
        {
            return Err(last_os_error("TUNSETOFFLOAD"));
        }
    }
    Ok((fd, uso))
}

#[derive(Default)]
struct HostStats {
    rx_pkts: AtomicU64,     // packets read from this host's TUN (sent by the host)
    rx_gso_pkts: AtomicU64, // of which GSO super-packets
    rx_bytes: AtomicU64,    // IP bytes as read (GSO packets counted once)
    wire_bytes: AtomicU64,  // IP bytes with every GSO segment's headers counted
    drop_queue: AtomicU64,  // tail drops: egress queue full
    drop_queue_wire_bytes: AtomicU64, // their wire bytes (every GSO segment's headers counted)
    drop_noroute: AtomicU64,
    tx_pkts: AtomicU64, // packets written into this host's TUN (received by the host)
    tx_bytes: AtomicU64,
    write_errs: AtomicU64,
    max_queue_us: AtomicU64, // longest egress queueing delay since the last dump
    max_late_us: AtomicU64,  // worst lateness of a delivery since the last dump
    late_over_1ms: AtomicU64, // deliveries more than 1 ms late
}

fn fetch_max(a: &AtomicU64, v: u64) {
    let mut cur = a.load(Relaxed);
    while v > cur {
        match a.compare_exchange_weak(cur, v, Relaxed, Relaxed) {
            Ok(_) => return,
            Err(c) => cur = c,
        }
    }
}

struct Pkt {
    due: Instant,
    data: Vec<u8>, // virtio-net header (if offload) + IP packet
}

/// Returns (destination IPv4, bytes this packet occupies on a real wire, is_gso).
fn classify(buf: &[u8], offload: bool) -> Option<([u8; 4], u64, bool)> {
    let (vh, ip) = if offload {
        if buf.len() < VNET_HDR_LEN {
            return None;
        }
        buf.split_at(VNET_HDR_LEN)
    } else {
        (&buf[..0], buf)
    };
    if ip.len() < 20 || ip[0] >> 4 != 4 {
        return None; // IPv6 and junk are not routed (the bench uses IPv4 only)
    }
    let dst = [ip[16], ip[17], ip[18], ip[19]];
    let n = ip.len() as u64;
    if !offload || vh[1] & 0x7f == GSO_NONE {
        return Some((dst, n, false));
    }
    let gso_size = u16::from_ne_bytes([vh[4], vh[5]]) as u64;
    let ihl = ((ip[0] & 0x0f) as usize) * 4;
    let l4 = match ip[9] {
        6 if ip.len() >= ihl + 13 => ((ip[ihl + 12] >> 4) as usize) * 4,
        17 => 8,
        _ => 0,
    };
    let hl = (ihl + l4) as u64;
    if gso_size == 0 || n <= hl {
        return Some((dst, n, true));
    }
    let segs = (n - hl).div_ceil(gso_size);
    Some((dst, n + (segs.saturating_sub(1)) * hl, true))
}

/// The one-way shape of every link: delay, rate and the queue in front of the rate.
#[derive(Clone, Copy)]
struct Shape {
    delay: Duration,
    rate_bps: f64,
    queue_bytes: u64,
}

fn reader(
    src: usize,
    fd: RawFd,
    offload: bool,
    routes: Arc<HashMap<[u8; 4], usize>>,
    links: Vec<Option<mpsc::Sender<Pkt>>>,
    stats: Arc<Vec<HostStats>>,
    shape: Shape,
) {
    let Shape {
        delay,
        rate_bps,
        queue_bytes,
    } = shape;
    let st = &stats[src];
    let ns_per_byte = if rate_bps > 0.0 { 8e9 / rate_bps } else { 0.0 };
    let max_backlog = Duration::from_nanos((queue_bytes as f64 * ns_per_byte) as u64);
    let mut link_free = Instant::now();
    let mut buf = vec![0u8; MAX_PKT];
    loop {
        let n = unsafe { libc::read(fd, buf.as_mut_ptr() as *mut libc::c_void, buf.len()) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) || e.raw_os_error() == Some(libc::EAGAIN) {
                continue;
            }
            eprintln!("netdelay: read from host {src}: {e}; reader exits");
            return;
        }
        let now = Instant::now();
        let data = &buf[..n as usize];
        let Some((dst_ip, wire, gso)) = classify(data, offload) else {
            st.drop_noroute.fetch_add(1, Relaxed);
            continue;
        };
        st.rx_pkts.fetch_add(1, Relaxed);
        st.rx_bytes.fetch_add(
            (n as u64).saturating_sub(if offload { VNET_HDR_LEN as u64 } else { 0 }),
            Relaxed,
        );
        if gso {
            st.rx_gso_pkts.fetch_add(1, Relaxed);
        }
        let dst = match routes.get(&dst_ip) {
            Some(&d) if d != src && links[d].is_some() => d,
            _ => {
                st.drop_noroute.fetch_add(1, Relaxed);
                continue;
            }
        };
        let mut depart = now;
        if ns_per_byte > 0.0 {
            let start = if link_free > now { link_free } else { now };
            let waited = start - now;
            if waited > max_backlog {
                st.drop_queue.fetch_add(1, Relaxed);
                st.drop_queue_wire_bytes.fetch_add(wire, Relaxed);
                continue;
            }
            fetch_max(&st.max_queue_us, waited.as_micros() as u64);
            link_free = start + Duration::from_nanos((wire as f64 * ns_per_byte) as u64);
            depart = link_free;
        }
        st.wire_bytes.fetch_add(wire, Relaxed);
        let pkt = Pkt {
            due: depart + delay,
            data: data.to_vec(),
        };
        if links[dst].as_ref().unwrap().send(pkt).is_err() {
            return;
        }
    }
}

fn writer(dst: usize, fd: RawFd, rx: mpsc::Receiver<Pkt>, stats: Arc<Vec<HostStats>>) {
    // The writer never asks the reader to wake it up (a futex wake + context switch per
    // packet costs more than the packet itself at ~80k packets/s). Instead it drains the
    // channel without blocking and sleeps until the head packet is due; any packet that
    // arrives later is due later (per-link FIFO, same delay), so nothing can be missed.
    // While the link is idle it polls every TICK; after IDLE_BLOCK of idleness it blocks
    // in recv() so that an idle forwarder costs no CPU.
    const TICK: Duration = Duration::from_micros(500);
    const IDLE_BLOCK: Duration = Duration::from_millis(200);
    let st = &stats[dst];
    let mut q: std::collections::VecDeque<Pkt> = std::collections::VecDeque::new();
    let mut idle_since = Instant::now();
    loop {
        loop {
            match rx.try_recv() {
                Ok(p) => q.push_back(p),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => {
                    if q.is_empty() {
                        return;
                    }
                    break;
                }
            }
        }
        let now = Instant::now();
        let mut wrote = false;
        while let Some(p) = q.front() {
            if p.due > now {
                break;
            }
            let p = q.pop_front().unwrap();
            let late = now.saturating_duration_since(p.due);
            fetch_max(&st.max_late_us, late.as_micros() as u64);
            if late > Duration::from_millis(1) {
                st.late_over_1ms.fetch_add(1, Relaxed);
            }
            let r =
                unsafe { libc::write(fd, p.data.as_ptr() as *const libc::c_void, p.data.len()) };
            if r < 0 {
                st.write_errs.fetch_add(1, Relaxed);
            } else {
                st.tx_pkts.fetch_add(1, Relaxed);
                st.tx_bytes.fetch_add(p.data.len() as u64, Relaxed);
            }
            wrote = true;
        }
        if wrote {
            continue; // writing took time: re-check the clock and the channel
        }
        match q.front() {
            Some(p) => {
                let now = Instant::now();
                if p.due > now {
                    std::thread::sleep(p.due - now);
                }
                idle_since = Instant::now();
            }
            None if now.duration_since(idle_since) < IDLE_BLOCK => std::thread::sleep(TICK),
            None => match rx.recv() {
                Ok(p) => {
                    q.push_back(p);
                    idle_since = Instant::now();
                }
                Err(_) => return,
            },
        }
    }
}

fn stats_json(seq: u64, names: &[String], stats: &[HostStats], uso: bool) -> String {
    let mut s = format!("{{\"seq\":{seq},\"uso\":{uso},\"hosts\":{{");
    for (i, (name, h)) in names.iter().zip(stats).enumerate() {
        if i > 0 {
            s.push(',');
        }
        s += &format!(
            "\"{name}\":{{\"rx_pkts\":{},\"rx_gso_pkts\":{},\"rx_bytes\":{},\"wire_bytes\":{},\
             \"drop_queue\":{},\"drop_queue_wire_bytes\":{},\"drop_noroute\":{},\"tx_pkts\":{},\"tx_bytes\":{},\
             \"write_errs\":{},\"max_queue_us\":{},\"max_late_us\":{},\"late_over_1ms\":{}}}",
            h.rx_pkts.load(Relaxed),
            h.rx_gso_pkts.load(Relaxed),
            h.rx_bytes.load(Relaxed),
            h.wire_bytes.load(Relaxed),
            h.drop_queue.load(Relaxed),
            h.drop_queue_wire_bytes.load(Relaxed),
            h.drop_noroute.load(Relaxed),
            h.tx_pkts.load(Relaxed),
            h.tx_bytes.load(Relaxed),
            h.write_errs.load(Relaxed),
            h.max_queue_us.swap(0, Relaxed),
            h.max_late_us.swap(0, Relaxed),
            h.late_over_1ms.load(Relaxed),
        );
    }
    s + "}}\n"
}

fn write_atomic(path: &str, content: &str) {
    let tmp = format!("{path}.tmp");
    if let Ok(mut f) = File::create(&tmp) {
        let _ = f.write_all(content.as_bytes());
        let _ = std::fs::rename(&tmp, path);
    }
}

fn main() {
    let args = parse_args();
    let orig = File::open("/proc/self/ns/net").expect("open /proc/self/ns/net");
    let mut fds = vec![];
    let mut uso_all = true;
    for (ns, _) in &args.hosts {
        let path = if ns.contains('/') {
            ns.clone()
        } else {
            format!("/var/run/netns/{ns}")
        };
        let r = setns_path(&path).and_then(|_| open_tun(&args.ifname, args.offload));
        match r {
            Ok((fd, uso)) => {
                uso_all &= uso;
                fds.push(fd)
            }
            Err(e) => {
                eprintln!("netdelay: namespace {ns}: {e}");
                std::process::exit(1);
            }
        }
    }
    if unsafe { libc::setns(orig.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        eprintln!("netdelay: {}", last_os_error("setns back"));
        std::process::exit(1);
    }
    let n = args.hosts.len();
    let names: Vec<String> = args.hosts.iter().map(|h| h.0.clone()).collect();
    let routes: Arc<HashMap<[u8; 4], usize>> = Arc::new(
        args.hosts
            .iter()
            .enumerate()
            .map(|(i, h)| (h.1, i))
            .collect(),
    );
    let stats: Arc<Vec<HostStats>> = Arc::new((0..n).map(|_| HostStats::default()).collect());

    unsafe {
        libc::signal(libc::SIGUSR1, on_sigusr1 as *const () as libc::sighandler_t);
    }

    let mut handles = vec![];
    // senders[src][dst]
    let mut senders: Vec<Vec<Option<mpsc::Sender<Pkt>>>> = (0..n).map(|_| vec![None; n]).collect();
    for (src, row) in senders.iter_mut().enumerate() {
        for (dst, slot) in row.iter_mut().enumerate() {
            if src == dst {
                continue;
            }
            let (tx, rx) = mpsc::channel::<Pkt>();
            *slot = Some(tx);
            let fd = fds[dst].as_raw_fd();
            let st = stats.clone();
            handles.push(
                std::thread::Builder::new()
                    .name(format!("w{src}->{dst}"))
                    .spawn(move || writer(dst, fd, rx, st))
                    .unwrap(),
            );
        }
    }
    for (src, links) in senders.into_iter().enumerate() {
        let fd = fds[src].as_raw_fd();
        let (routes, st) = (routes.clone(), stats.clone());
        let shape = Shape {
            delay: args.delay,
            rate_bps: args.rate_bps,
            queue_bytes: args.queue_bytes,
        };
        let off = args.offload;
        handles.push(
            std::thread::Builder::new()
                .name(format!("r{src}"))
                .spawn(move || reader(src, fd, off, routes, links, st, shape))
                .unwrap(),
        );
    }
    eprintln!(
        "netdelay: {} hosts, delay {:?} one-way, rate {} Mbit/s per host egress, queue {} bytes, offload {} (uso {})",
        n,
        args.delay,
        args.rate_bps / 1e6,
        args.queue_bytes,
        args.offload,
        uso_all && args.offload
    );
    if let Some(r) = &args.ready {
        write_atomic(r, "ready\n");
    }
    let mut seq = 0u64;
    loop {
        std::thread::sleep(Duration::from_millis(2));
        if DUMP_STATS.swap(false, Relaxed) {
            seq += 1;
            if let Some(p) = &args.stats {
                write_atomic(p, &stats_json(seq, &names, &stats, uso_all && args.offload));
            }
        }
    }
}
