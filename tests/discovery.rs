//! Devices find each other: local discovery on a LAN, addresses learned from connections and
//! from other peers, roaming. Real daemons in network namespaces of the test's own on one
//! bridge (real UDP, real QUIC): discovery is on only here, and nothing leaves the namespaces.
//! The times printed are behaviour checks with generous deadlines, not benchmarks.

use crate::common;
use common::netns::Bridge;
use common::*;
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

/// The QUIC listen address of every device here: every address, IPv4 and IPv6 (the default).
const LISTEN: &str = "[::]:7788";

/// A device in host `i` of `net`, sharing `work`, with local discovery on.
fn device(t: &std::sync::Arc<tempfile::TempDir>, net: &Bridge, i: usize, name: &str) -> Device {
    let d = Device::in_netns(t, name, net.ns(i), LISTEN);
    d.discovery(true);
    d
}

/// Makes every device of `devs` a peer of every other, by id alone (`peer add ID`), sharing
/// `work`.
fn befriend(devs: &[&Device]) {
    for a in devs {
        for b in devs {
            if a.id != b.id {
                ok(
                    &a.home,
                    &["peer", "add", &b.id, "--name", &b.name, "--share", "work"],
                );
            }
        }
    }
}

/// Waits until `cond` holds, up to `secs`; returns how long it took, or panics saying `what`
/// with the devices' logs.
fn until(secs: u64, what: &str, devs: &[&Device], mut cond: impl FnMut() -> bool) -> Duration {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(secs) {
        if cond() {
            return t0.elapsed();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for d in devs {
        eprintln!(
            "=== {} status\n{}\n=== {} log\n{}",
            d.name,
            String::from_utf8_lossy(&meshfs(&d.home, &["status"]).stdout),
            d.name,
            d.log()
        );
    }
    panic!("{what} not within {secs} s");
}

/// Every device of `devs` says in sync, and their trees are equal.
fn all_in_sync(devs: &[&Device]) -> bool {
    let first = tree(&devs[0].dir);
    devs.iter().all(|d| {
        tree(&d.dir) == first
            && serde_json::from_slice::<serde_json::Value>(
                &meshfs(&d.home, &["status", "--json"]).stdout,
            )
            .is_ok_and(|s| s["in_sync"] == true)
    })
}

/// `d`'s view of its peer `of`: the `peers` element.
fn peer_of(d: &Device, of: &Device) -> serde_json::Value {
    let s = d.status();
    s["peers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["device_id"] == of.id.as_str())
        .cloned()
        .unwrap()
}

/// Three devices on one bridge (10.77.0.1-3), peers of each other by id alone, each with a
/// file of its own; started together and in sync.
struct Lan {
    devs: Vec<Device>,
    net: Bridge,
    _t: std::sync::Arc<tempfile::TempDir>,
}

impl Lan {
    fn new(tag: &str) -> (Lan, Duration) {
        let net = Bridge::new(tag, 3);
        let t = tmp();
        let mut devs = Vec::new();
        for (i, name) in ["a", "b", "c"].into_iter().enumerate() {
            net.addr(i, &format!("10.77.0.{}/24", i + 1));
            let d = device(&t, &net, i, name);
            write(&d.path(&format!("from-{name}.txt")), name.as_bytes());
            devs.push(d);
        }
        befriend(&devs.iter().collect::<Vec<_>>());
        let t0 = Instant::now();
        Device::start_together(&mut devs.iter_mut().collect::<Vec<_>>());
        let all: Vec<&Device> = devs.iter().collect();
        until(60, "the three devices in sync", &all, || all_in_sync(&all));
        let took = t0.elapsed();
        drop(all);
        (Lan { devs, net, _t: t }, took)
    }

    fn all(&self) -> Vec<&Device> {
        self.devs.iter().collect()
    }
}

#[test]
fn devices_added_by_id_alone_find_each_other_on_a_lan_and_are_in_sync_within_seconds() {
    let (lan, took) = Lan::new("dl");
    eprintln!("three devices added by id alone: in sync {took:?} after their daemons were started");
    for d in lan.all() {
        for other in lan.all().into_iter().filter(|o| o.id != d.id) {
            let p = peer_of(d, other);
            assert_eq!(p["addresses"], serde_json::json!(["dynamic"]), "{p}");
            assert_eq!(p["connected"], true, "{p}");
            let source = p["address_source"].as_str().unwrap();
            assert!(["lan", "incoming"].contains(&source), "{p}");
        }
    }
    assert!(took < Duration::from_secs(30), "{took:?}");
}

#[test]
fn a_device_whose_address_changes_is_back_in_sync_at_once_without_a_config_edit() {
    let (lan, _) = Lan::new("dr");
    // Each device moves once: whichever side dialed each of its connections, both cases come
    // up (a connection it dialed migrates; one it accepted is replaced).
    for i in 0..3 {
        let d = &lan.devs[i];
        let (old, new) = (
            format!("10.77.0.{}/24", i + 1),
            format!("10.77.0.{}/24", i + 11),
        );
        lan.net.addr_del(i, &old);
        lan.net.addr(i, &new);
        let name = format!("after-move-{i}.txt");
        write(&d.path(&name), b"written after the address changed");
        let t0 = Instant::now();
        let took = until(30, &format!("{name} everywhere"), &lan.all(), || {
            lan.devs.iter().all(|o| {
                std::fs::read(o.path(&name))
                    .is_ok_and(|c| c == b"written after the address changed")
            })
        });
        eprintln!(
            "{} moved to {new}: a file written on it reached the others {took:?} later",
            d.name
        );
        assert!(t0.elapsed() < Duration::from_secs(30));
        // The others now reach it at its new address.
        let ip = format!("10.77.0.{}:", i + 11);
        for o in lan.devs.iter().filter(|o| o.id != d.id) {
            until(30, "the new address in status", &lan.all(), || {
                peer_of(o, d)["address"]
                    .as_str()
                    .is_some_and(|a| a.starts_with(&ip))
            });
        }
    }
    let all = lan.all();
    until(30, "in sync after the moves", &all, || all_in_sync(&all));
}

#[test]
fn two_laptops_that_share_no_network_sync_through_a_server_and_connect_directly_once_a_route_appears(
) {
    // The server (10.81.1.1 and 10.81.2.1) reaches both laptops; laptop 1 (10.81.1.2) and
    // laptop 2 (10.81.2.2) are on different subnets with no route between them. The laptops
    // know the server's fixed address; the server knows them by id alone; they know each
    // other by id alone.
    let net = Bridge::new("ds", 3);
    let t = tmp();
    net.addr(0, "10.81.1.1/24");
    net.addr(0, "10.81.2.1/24");
    net.addr(1, "10.81.1.2/24");
    net.addr(2, "10.81.2.2/24");
    let mut s = device(&t, &net, 0, "server");
    let mut l1 = device(&t, &net, 1, "laptop1");
    let mut l2 = device(&t, &net, 2, "laptop2");
    for (l, via) in [(&l1, "10.81.1.1:7788"), (&l2, "10.81.2.1:7788")] {
        ok(
            &l.home,
            &[
                "peer", "add", &s.id, "--name", "server", "--addr", via, "--share", "work",
            ],
        );
        ok(
            &s.home,
            &["peer", "add", &l.id, "--name", &l.name, "--share", "work"],
        );
    }
    ok(
        &l1.home,
        &[
            "peer", "add", &l2.id, "--name", "laptop2", "--share", "work",
        ],
    );
    ok(
        &l2.home,
        &[
            "peer", "add", &l1.id, "--name", "laptop1", "--share", "work",
        ],
    );
    Device::start_together(&mut [&mut s, &mut l1, &mut l2]);
    let all = [&s, &l1, &l2];
    // No route between the laptops: what laptop 1 writes reaches laptop 2 through the server.
    write(&l1.path("from-laptop1.txt"), b"relayed by the server");
    let took = until(30, "laptop 1's file on laptop 2", &all, || {
        std::fs::read(l2.path("from-laptop1.txt")).is_ok_and(|c| c == b"relayed by the server")
    });
    eprintln!(
        "no route between the laptops: a file reached laptop 2 through the server in {took:?}"
    );
    assert_eq!(peer_of(&l1, &l2)["connected"], false);
    // Each learned from the server where the other is.
    for (me, other, at) in [(&l1, &l2, "10.81.2.2:7788"), (&l2, &l1, "10.81.1.2:7788")] {
        until(30, "an address learned from the server", &all, || {
            peer_of(me, other)["known_addresses"]
                .as_array()
                .unwrap()
                .iter()
                .any(|k| k["addr"] == at && k["source"] == "peer")
        });
    }
    // A route appears: they connect directly, at the address the server told.
    net.hosts[1].ip(&["route", "add", "10.81.2.0/24", "dev", "eth0"]);
    net.hosts[2].ip(&["route", "add", "10.81.1.0/24", "dev", "eth0"]);
    let took = until(30, "the laptops connected to each other", &all, || {
        peer_of(&l1, &l2)["connected"] == true && peer_of(&l2, &l1)["connected"] == true
    });
    let sources = [
        peer_of(&l1, &l2)["address_source"].clone(),
        peer_of(&l2, &l1)["address_source"].clone(),
    ];
    eprintln!("a route appeared: the laptops connected directly {took:?} later (address sources {sources:?})");
    assert!(sources.iter().any(|s| s == "peer"), "{sources:?}");
    let all_devs = [&s, &l1, &l2];
    until(30, "in sync", &all_devs, || all_in_sync(&all_devs));
}

/// The destination connection ids of the QUIC Initial packets that reach a socket: one per
/// dial attempt (its retransmissions keep the id).
fn count_dials(
    ns: &common::netns::Namespace,
    at: &'static str,
) -> (
    std::sync::Arc<std::sync::atomic::AtomicBool>,
    std::thread::JoinHandle<BTreeSet<Vec<u8>>>,
) {
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let done = stop.clone();
    let (ready_tx, ready) = std::sync::mpsc::channel();
    let h = ns.spawn(move || {
        let s = std::net::UdpSocket::bind(at).unwrap();
        s.set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        ready_tx.send(()).unwrap();
        let mut ids = BTreeSet::new();
        let mut buf = [0u8; 2048];
        while !done.load(std::sync::atomic::Ordering::Relaxed) {
            if let Ok(n) = s.recv(&mut buf) {
                // A long header: form bit, 4 bytes of version, the DCID length, the DCID.
                if n > 6 && buf[0] & 0x80 != 0 {
                    let len = usize::from(buf[5]);
                    if 6 + len <= n {
                        ids.insert(buf[6..6 + len].to_vec());
                    }
                }
            }
        }
        ids
    });
    ready.recv().unwrap();
    (stop, h)
}

/// Sends `datagram` to the discovery port's broadcast address of 10.77.0.0/24, from `from`.
fn broadcast_from(ns: &common::netns::Namespace, from: &'static str, datagram: Vec<u8>) {
    ns.run(move || {
        let s = std::net::UdpSocket::bind(from).unwrap();
        s.set_broadcast(true).unwrap();
        s.send_to(&datagram, ("10.77.0.255", meshfs_protocol::DISCOVERY_PORT))
            .unwrap();
    });
}

#[test]
fn a_forged_announcement_costs_one_failed_dial_and_changes_nothing() {
    let mut net = Bridge::new("df", 2);
    let x = net.plug(&format!("mfdfx{}", std::process::id()));
    let t = tmp();
    net.addr(0, "10.77.0.1/24");
    net.addr(1, "10.77.0.2/24");
    net.addr(x, "10.77.0.66/24");
    let mut a = device(&t, &net, 0, "a");
    let mut b = device(&t, &net, 1, "b");
    befriend(&[&a, &b]);
    Device::start_together(&mut [&mut a, &mut b]);
    until(30, "a and b in sync", &[&a, &b], || all_in_sync(&[&a, &b]));
    let before = peer_of(&a, &b);
    // The attacker claims b's id at its own address, where it counts the dials it gets.
    let (stop, dials) = count_dials(&net.hosts[x], "10.77.0.66:7788");
    let forged = meshfs_protocol::Announcement {
        device: b.id.parse().unwrap(),
        instance: 0x5eed,
        port: 7788,
        addrs: vec!["10.77.0.66".parse().unwrap()],
    }
    .encode();
    broadcast_from(&net.hosts[x], "10.77.0.66:0", forged);
    // Connected: nothing changes, nothing is dialed.
    std::thread::sleep(Duration::from_secs(2));
    let after = peer_of(&a, &b);
    for field in ["connected", "address", "address_source", "last_seen_unix"] {
        assert_eq!(before[field], after[field], "{field}: {before} / {after}");
    }
    // b goes away: a tries its addresses, the forged one once, and forgets it.
    b.stop();
    std::thread::sleep(Duration::from_secs(8));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let dials = dials.join().unwrap();
    eprintln!(
        "a forged announcement of b: {} dial(s) to the attacker's address",
        dials.len()
    );
    assert_eq!(dials.len(), 1, "{dials:?}");
    let known = peer_of(&a, &b)["known_addresses"].clone();
    assert!(
        !known
            .as_array()
            .unwrap()
            .iter()
            .any(|k| k["addr"] == "10.77.0.66:7788"),
        "{known}"
    );
    // b comes back: in sync at its own address.
    b.start();
    write(&b.path("back.txt"), b"b is back");
    until(30, "b's file on a", &[&a, &b], || {
        std::fs::read(a.path("back.txt")).is_ok_and(|c| c == b"b is back")
    });
    assert!(peer_of(&a, &b)["address"]
        .as_str()
        .is_some_and(|s| s.starts_with("10.77.0.2:")));
}

#[test]
fn with_local_discovery_off_nothing_is_announced() {
    let net = Bridge::new("do", 3);
    let t = tmp();
    for i in 0..3 {
        net.addr(i, &format!("10.77.0.{}/24", i + 1));
    }
    // d has discovery off (the harness's default), e has it on: the capture must see e.
    let mut d = Device::in_netns(&t, "d", net.ns(0), LISTEN);
    let mut e = device(&t, &net, 1, "e");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let done = stop.clone();
    let (ready_tx, ready) = std::sync::mpsc::channel();
    let capture = net.hosts[2].spawn(move || {
        // Alone on the discovery port in its namespace: it gets every broadcast to it.
        let s = std::net::UdpSocket::bind(("0.0.0.0", meshfs_protocol::DISCOVERY_PORT)).unwrap();
        s.set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        ready_tx.send(()).unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 2048];
        while !done.load(std::sync::atomic::Ordering::Relaxed) {
            if let Ok((n, from)) = s.recv_from(&mut buf) {
                got.push((from, buf[..n].to_vec()));
            }
        }
        got
    });
    ready.recv().unwrap();
    Device::start_together(&mut [&mut d, &mut e]);
    // An address change would make a discovering daemon announce at once.
    net.addr(0, "10.77.0.11/24");
    std::thread::sleep(Duration::from_secs(3));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let got = capture.join().unwrap();
    let from_d: Vec<_> = got
        .iter()
        .filter(|(from, data)| {
            from.ip().to_string().starts_with("10.77.0.1")
                || meshfs_protocol::Announcement::decode(data)
                    .is_ok_and(|a| a.device.to_string() == d.id)
        })
        .collect();
    let from_e = got
        .iter()
        .filter(|(_, data)| {
            meshfs_protocol::Announcement::decode(data).is_ok_and(|a| a.device.to_string() == e.id)
        })
        .count();
    eprintln!(
        "captured {} datagrams: {from_e} announcements of e (discovery on), {} of d (off)",
        got.len(),
        from_d.len()
    );
    assert!(from_e >= 1, "the capture works: e's announcements are seen");
    assert!(from_d.is_empty(), "{from_d:?}");
    let status = d.status();
    assert_eq!(status["device"]["discovery"]["local"], false);
    assert_eq!(status["device"]["discovery"]["sent"], 0);
}

/// Two devices on one bridge (10.77.0.1 and .2), peers by id alone, started and in sync.
fn two(tag: &str) -> (Bridge, std::sync::Arc<tempfile::TempDir>, Device, Device) {
    let net = Bridge::new(tag, 2);
    let t = tmp();
    net.addr(0, "10.77.0.1/24");
    net.addr(1, "10.77.0.2/24");
    let mut a = device(&t, &net, 0, "a");
    let mut b = device(&t, &net, 1, "b");
    befriend(&[&a, &b]);
    Device::start_together(&mut [&mut a, &mut b]);
    until(30, "a and b in sync", &[&a, &b], || all_in_sync(&[&a, &b]));
    (net, t, a, b)
}

#[test]
fn a_laptop_suspended_for_longer_than_the_idle_timeout_and_resumed_at_a_new_address_is_in_sync_within_seconds(
) {
    let (net, _t, a, b) = two("dz");
    let pid = a.pid().unwrap() as i32;
    // SAFETY: kill takes two integers; the pid is our child's, not yet waited for.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    net.addr_del(0, "10.77.0.1/24");
    net.addr(0, "10.77.0.21/24");
    // Longer than the idle timeout: b gives the connection up meanwhile.
    std::thread::sleep(Duration::from_secs(7));
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    let t0 = Instant::now();
    write(&a.path("after-resume.txt"), b"written after the resume");
    write(&b.path("while-away.txt"), b"written on b after the resume");
    until(30, "both files on both devices", &[&a, &b], || {
        std::fs::read(b.path("after-resume.txt")).is_ok_and(|c| c == b"written after the resume")
            && std::fs::read(a.path("while-away.txt")).is_ok()
    });
    let took = t0.elapsed();
    eprintln!(
        "suspended 7 s, resumed at a new address: both ways in sync {took:?} after the resume"
    );
    assert!(took < Duration::from_secs(30));
    until(30, "in sync", &[&a, &b], || all_in_sync(&[&a, &b]));
}

#[test]
fn the_address_that_worked_is_remembered_across_a_restart() {
    let (_net, _t, mut a, mut b) = two("dm");
    a.stop();
    b.stop();
    // With discovery off nothing is announced: only what each remembered can bring them
    // together.
    a.discovery(false);
    b.discovery(false);
    Device::start_together(&mut [&mut a, &mut b]);
    until(30, "reconnected", &[&a, &b], || {
        peer_of(&a, &b)["connected"] == true && peer_of(&b, &a)["connected"] == true
    });
    let sources = [
        peer_of(&a, &b)["address_source"].clone(),
        peer_of(&b, &a)["address_source"].clone(),
    ];
    assert!(sources.iter().any(|s| s == "remembered"), "{sources:?}");
    write(&a.path("after-restart.txt"), b"x");
    until(30, "in sync", &[&a, &b], || all_in_sync(&[&a, &b]));
}

/// CPU ticks (user + system) of process `pid`.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name (which is in parentheses): utime is the 12th, stime the
    // 13th of them.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

/// Resident and peak resident memory of `pid`, in KiB.
fn memory_kib(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

#[test]
fn a_flood_of_announcements_keeps_the_daemon_bounded_and_status_answering() {
    let (mut net, _t, a, b) = two("dx");
    let x = net.plug(&format!("mfdxx{}", std::process::id()));
    const SOURCES: usize = 64;
    for i in 0..SOURCES {
        net.addr(x, &format!("10.77.0.{}/24", 100 + i));
    }
    let pid = a.pid().unwrap();
    assert_eq!(
        std::fs::read_to_string(format!("/proc/{pid}/comm"))
            .unwrap()
            .trim(),
        "meshfs"
    );
    let rate: u64 = std::env::var("MESHFS_FLOOD_RATE")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(10_000);
    let secs: u64 = 5;
    let b_id: meshfs_protocol::DeviceId = b.id.parse().unwrap();
    let (rss0, _) = memory_kib(pid);
    let cpu0 = cpu_ticks(pid);
    let t0 = Instant::now();
    // Half forge b (a trusted device) at random addresses, half name random unknown devices.
    let flood = net.hosts[x].spawn(move || {
        let sockets: Vec<std::net::UdpSocket> = (0..SOURCES)
            .map(|i| {
                let s = std::net::UdpSocket::bind(format!("10.77.0.{}:0", 100 + i)).unwrap();
                s.set_broadcast(true).unwrap();
                s
            })
            .collect();
        let to = ("10.77.0.255", meshfs_protocol::DISCOVERY_PORT);
        let start = Instant::now();
        let total = rate * secs;
        let mut sent = 0u64;
        while sent < total {
            // Paced in steps of a millisecond.
            let due = (start.elapsed().as_micros() as u64 * rate / 1_000_000).min(total);
            while sent < due {
                let n = sent as u32;
                let device = if n.is_multiple_of(2) {
                    b_id
                } else {
                    meshfs_protocol::DeviceId::from_bytes([(n % 251) as u8; 32])
                };
                let a = meshfs_protocol::Announcement {
                    device,
                    instance: u64::from(n),
                    port: 7788,
                    addrs: vec![std::net::IpAddr::from([10, 9, (n >> 8) as u8, n as u8])],
                };
                let _ = sockets[sent as usize % SOURCES].send_to(&a.encode(), to);
                sent += 1;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        (sent, start.elapsed())
    });
    // status answers throughout.
    let mut slowest = Duration::ZERO;
    let mut polls = 0;
    while !flood.is_finished() {
        let q = Instant::now();
        let s = a.status();
        slowest = slowest.max(q.elapsed());
        polls += 1;
        assert_eq!(s["device"]["discovery"]["local"], true);
        std::thread::sleep(Duration::from_millis(200));
    }
    let (sent, flooded) = flood.join().unwrap();
    let cpu = (cpu_ticks(pid) - cpu0) as f64 / 100.0;
    let wall = t0.elapsed().as_secs_f64();
    let (rss1, peak) = memory_kib(pid);
    let d = a.status()["device"]["discovery"].clone();
    eprintln!(
        "flood: {sent} announcements in {flooded:.1?} ({:.0}/s) from {SOURCES} sources; daemon CPU {:.1} % of a core \
         ({cpu:.2} s over {wall:.1} s), RSS {} -> {} KiB (peak {} KiB), slowest of {polls} status calls {slowest:.0?}; \
         daemon counted {d}",
        sent as f64 / flooded.as_secs_f64(),
        100.0 * cpu / wall,
        rss0,
        rss1,
        peak
    );
    assert!(sent >= rate * secs * 9 / 10, "{sent}");
    assert!(d["limited"].as_u64().unwrap() > 0, "{d}");
    assert!(rss1 < rss0 + 32 * 1024, "RSS {rss0} -> {rss1} KiB");
    assert!(slowest < Duration::from_secs(5), "{slowest:?}");
    let known = peer_of(&a, &b)["known_addresses"].as_array().unwrap().len();
    assert!(known <= 16, "{known}");
    // And the real b is still a's peer, in sync.
    assert_eq!(peer_of(&a, &b)["connected"], true);
    write(&b.path("after-the-flood.txt"), b"still here");
    until(30, "in sync after the flood", &[&a, &b], || {
        all_in_sync(&[&a, &b])
    });
}

#[test]
fn devices_on_an_ipv6_only_link_find_each_other_by_multicast() {
    // No IPv4 at all: only the link-local addresses IPv6 gives each interface.
    let net = Bridge::new("d6", 2);
    net.ipv6(0);
    net.ipv6(1);
    let t = tmp();
    let mut a = device(&t, &net, 0, "a");
    let mut b = device(&t, &net, 1, "b");
    befriend(&[&a, &b]);
    write(&a.path("over-ipv6.txt"), b"found by multicast");
    let t0 = Instant::now();
    Device::start_together(&mut [&mut a, &mut b]);
    until(30, "a and b in sync", &[&a, &b], || all_in_sync(&[&a, &b]));
    eprintln!(
        "two devices on an IPv6-only link: in sync {:?} after start",
        t0.elapsed()
    );
    let p = peer_of(&a, &b);
    assert!(
        p["address"]
            .as_str()
            .is_some_and(|s| s.starts_with("[fe80::")),
        "{p}"
    );
}
