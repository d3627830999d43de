//! The network of a randomized run: one network namespace per device, joined pairwise by veth
//! pairs (a full mesh, one /30 per link, no forwarding), so that taking one link down cuts
//! exactly those two devices apart while every other path between them stays up — and a
//! partition is a set of links down. Never touches an interface or namespace it did not make;
//! everything it made goes away on drop, panics included.

use std::process::{Command, Stdio};

/// The port every daemon listens on, inside its own namespace.
pub const PORT: u16 = 7788;

/// `n` namespaces joined pairwise by veth links.
pub struct Mesh {
    /// The namespace of each device.
    pub ns: Vec<String>,
    n: usize,
    up: Vec<bool>,
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The namespaces of this harness are `mfchaos<PID>d<I>`: those of a process that no longer
/// runs are leftovers of a run that was killed before its drop (a test timeout), removed here.
fn remove_leftovers() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some(rest) = name.strip_prefix("mfchaos") else {
            continue;
        };
        let Some(pid) = rest.split('d').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if pid != std::process::id() && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = Command::new("ip")
                .args(["netns", "del", name])
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// The name, in a device's namespace, of its interface towards device `peer` (interface names
/// are per namespace, so every device's can be the same short ones).
fn ifname(peer: usize) -> String {
    format!("to{peer}")
}

impl Mesh {
    /// `n` namespaces (loopback up) and the n·(n-1)/2 links between them, all up.
    pub fn new(n: usize) -> Mesh {
        assert!((2..=16).contains(&n));
        remove_leftovers();
        let pid = std::process::id();
        let ns: Vec<String> = (0..n).map(|i| format!("mfchaos{pid}d{i}")).collect();
        let mesh = Mesh {
            ns,
            n,
            up: vec![true; n * n],
        };
        for name in &mesh.ns {
            let _ = Command::new("ip")
                .args(["netns", "del", name])
                .stderr(Stdio::null())
                .status();
            ip(&["netns", "add", name]);
            ip(&["-n", name, "link", "set", "lo", "up"]);
        }
        for a in 0..n {
            for b in a + 1..n {
                let (ia, ib) = (ifname(b), ifname(a));
                ip(&[
                    "link",
                    "add",
                    &ia,
                    "netns",
                    &mesh.ns[a],
                    "type",
                    "veth",
                    "peer",
                    "name",
                    &ib,
                    "netns",
                    &mesh.ns[b],
                ]);
                for (dev, ifn, peer) in [(a, &ia, b), (b, &ib, a)] {
                    let addr = format!("{}/30", mesh.addr(dev, peer));
                    ip(&["-n", &mesh.ns[dev], "addr", "add", &addr, "dev", ifn]);
                    ip(&["-n", &mesh.ns[dev], "link", "set", ifn, "up"]);
                }
            }
        }
        mesh
    }

    /// The link's number: one /30 each, `10.77.<k>.0`.
    fn link(&self, a: usize, b: usize) -> usize {
        let (lo, hi) = (a.min(b), a.max(b));
        lo * self.n + hi
    }

    /// Device `a`'s address on its link with `b`.
    pub fn addr(&self, a: usize, b: usize) -> String {
        let k = self.link(a, b);
        let host = if a < b { 1 } else { 2 };
        format!("10.77.{k}.{host}")
    }

    /// Whether the link between `a` and `b` is up.
    pub fn is_up(&self, a: usize, b: usize) -> bool {
        self.up[self.link(a, b)]
    }

    /// Takes the link between `a` and `b` down or up: always the lower-numbered device's end
    /// (the pair's carrier goes with it, and so does the route, so neither side reaches the
    /// other through it; bringing the other end up would leave it down).
    pub fn set(&mut self, a: usize, b: usize, up: bool) {
        if self.is_up(a, b) == up {
            return;
        }
        let (lo, hi) = (a.min(b), a.max(b));
        let ifn = ifname(hi);
        ip(&[
            "-n",
            &self.ns[lo],
            "link",
            "set",
            &ifn,
            if up { "up" } else { "down" },
        ]);
        let k = self.link(a, b);
        self.up[k] = up;
    }

    /// Every link up.
    pub fn heal(&mut self) {
        for a in 0..self.n {
            for b in a + 1..self.n {
                self.set(a, b, true);
            }
        }
    }
}

impl Drop for Mesh {
    fn drop(&mut self) {
        // The veth pairs go with their namespaces.
        for name in &self.ns {
            let _ = Command::new("ip")
                .args(["netns", "del", name])
                .stderr(Stdio::null())
                .status();
        }
    }
}
