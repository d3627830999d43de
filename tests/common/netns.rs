//! Network namespaces for tests that need a network of their own: a veth pair between two
//! namespaces ([`Link`]), or several namespaces on one bridge ([`Bridge`]). Every name holds
//! the test process's id, and everything is deleted on drop (deleting a namespace deletes its
//! interfaces), so tests run in parallel with other engineers' and leave nothing behind.
//! Traffic in them never reaches this machine's own interfaces. Needs root (`CAP_NET_ADMIN`).

use std::os::fd::AsRawFd;

/// Runs a command; panics with its stderr if it fails.
pub fn sh(args: &[&str]) {
    let out = std::process::Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A network namespace, deleted on drop.
pub struct Namespace {
    pub name: String,
}

impl Namespace {
    /// A fresh namespace (one of the same name left by a killed run is deleted first) with its
    /// loopback up, IPv6 off (tests speak of IPv4 addresses; nothing appears behind their back).
    pub fn new(name: String) -> Namespace {
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &name])
            .stderr(std::process::Stdio::null())
            .status();
        sh(&["ip", "netns", "add", &name]);
        let ns = Namespace { name };
        ns.sysctl("net.ipv6.conf.all.disable_ipv6=1");
        ns.sysctl("net.ipv6.conf.default.disable_ipv6=1");
        ns.ip(&["link", "set", "lo", "up"]);
        ns
    }

    /// `ip -n NAME ARGS…`.
    pub fn ip(&self, args: &[&str]) {
        let mut all = vec!["ip", "-n", &self.name];
        all.extend_from_slice(args);
        sh(&all);
    }

    /// `sysctl -w SETTING` inside the namespace.
    pub fn sysctl(&self, setting: &str) {
        sh(&["ip", "netns", "exec", &self.name, "sysctl", "-qw", setting]);
    }

    /// Runs `f` on a thread that has entered this namespace (sockets it opens live there).
    pub fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        self.spawn(f).join().unwrap()
    }

    /// Starts `f` on a thread that has entered this namespace, without waiting for it.
    pub fn spawn<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> std::thread::JoinHandle<T> {
        let path = format!("/run/netns/{}", self.name);
        std::thread::spawn(move || {
            let file = std::fs::File::open(&path).unwrap();
            // SAFETY: setns takes an open namespace descriptor and a flag; it changes only the
            // calling thread's network namespace (this fresh thread's), touching no memory.
            let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
            f()
        })
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

/// Two network namespaces joined by a veth pair (`ips[0]` and `ips[1]`, one /24).
pub struct Link {
    pub ns: [String; 2],
    pub ips: [String; 2],
    veth: [String; 2],
    _namespaces: [Namespace; 2],
}

impl Link {
    pub fn new(tag: &str) -> Link {
        let id = std::process::id() % 10_000;
        let ns = [format!("mf{tag}a{id}"), format!("mf{tag}b{id}")];
        let net = 100 + id % 100;
        let ips = [format!("10.211.{net}.1"), format!("10.211.{net}.2")];
        let veth = [format!("mv{tag}a{id}"), format!("mv{tag}b{id}")];
        let namespaces = [Namespace::new(ns[0].clone()), Namespace::new(ns[1].clone())];
        sh(&[
            "ip", "link", "add", &veth[0], "netns", &ns[0], "type", "veth", "peer", "name",
            &veth[1], "netns", &ns[1],
        ]);
        for i in 0..2 {
            namespaces[i].ip(&["addr", "add", &format!("{}/24", ips[i]), "dev", &veth[i]]);
            namespaces[i].ip(&["link", "set", &veth[i], "up"]);
        }
        Link {
            ns,
            ips,
            veth,
            _namespaces: namespaces,
        }
    }

    /// Takes side 0's interface down (`false`) or up.
    pub fn set_up(&self, up: bool) {
        sh(&[
            "ip",
            "-n",
            &self.ns[0],
            "link",
            "set",
            &self.veth[0],
            if up { "up" } else { "down" },
        ]);
    }
}

/// Network namespaces on one bridge: host `i` has `eth0` in its own namespace, plugged into a
/// bridge in a hub namespace. Addresses are the test's to give ([`Bridge::addr`]).
pub struct Bridge {
    pub hosts: Vec<Namespace>,
    hub: Namespace,
}

impl Bridge {
    /// `n` hosts, named `mf{tag}{i}{pid}`, on a bridge in `mf{tag}h{pid}`.
    pub fn new(tag: &str, n: usize) -> Bridge {
        let pid = std::process::id();
        let hub = Namespace::new(format!("mf{tag}h{pid}"));
        hub.ip(&["link", "add", "br0", "type", "bridge"]);
        hub.ip(&["link", "set", "br0", "up"]);
        let mut bridge = Bridge {
            hosts: Vec::new(),
            hub,
        };
        for i in 0..n {
            bridge.plug(&format!("mf{tag}{i}{pid}"));
        }
        bridge
    }

    /// Another host on the bridge; returns its index.
    pub fn plug(&mut self, name: &str) -> usize {
        let i = self.hosts.len();
        let host = Namespace::new(name.to_string());
        let port = format!("p{i}");
        sh(&[
            "ip",
            "link",
            "add",
            "eth0",
            "netns",
            &host.name,
            "type",
            "veth",
            "peer",
            "name",
            &port,
            "netns",
            &self.hub.name,
        ]);
        self.hub.ip(&["link", "set", &port, "master", "br0"]);
        self.hub.ip(&["link", "set", &port, "up"]);
        host.ip(&["link", "set", "eth0", "up"]);
        self.hosts.push(host);
        i
    }

    /// Turns IPv6 on for host `i`'s `eth0`, without duplicate address detection: it gets its
    /// link-local address at once.
    pub fn ipv6(&self, i: usize) {
        let h = &self.hosts[i];
        h.sysctl("net.ipv6.conf.eth0.accept_dad=0");
        h.sysctl("net.ipv6.conf.eth0.disable_ipv6=0");
    }

    /// Host `i`'s namespace name.
    pub fn ns(&self, i: usize) -> &str {
        &self.hosts[i].name
    }

    /// Gives host `i`'s `eth0` the address `cidr` (`10.77.0.2/24`).
    pub fn addr(&self, i: usize, cidr: &str) {
        self.hosts[i].ip(&["addr", "add", cidr, "dev", "eth0"]);
    }

    /// Takes the address `cidr` from host `i`'s `eth0`.
    pub fn addr_del(&self, i: usize, cidr: &str) {
        self.hosts[i].ip(&["addr", "del", cidr, "dev", "eth0"]);
    }
}
