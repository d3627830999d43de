//! Test harness: real `meshfs` daemons (separate homes, 127.0.0.x addresses, real QUIC and
//! SQLite), driven through the CLI exactly as a user or script would.
#![allow(dead_code)]

pub mod browser;
pub mod clock;
pub mod hostile;
pub mod netns;
pub mod user;

use std::collections::BTreeMap;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

static NEXT: AtomicU32 = AtomicU32::new(0);

/// The `meshfs` binary the tests run: `$MESHFS_BIN` if set (e.g. `target/release/meshfs` for a
/// long randomized run), else the one cargo built for this test.
pub fn bin() -> &'static str {
    static BIN: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    BIN.get_or_init(|| {
        std::env::var("MESHFS_BIN")
            .ok()
            .filter(|b| !b.is_empty())
            .map(|b| {
                std::fs::canonicalize(&b)
                    .unwrap_or_else(|e| panic!("MESHFS_BIN={b}: {e}"))
                    .display()
                    .to_string()
            })
            .unwrap_or_else(|| env!("CARGO_BIN_EXE_meshfs").to_string())
    })
}

/// A free UDP port on `ip`.
fn free_port(ip: &str) -> u16 {
    let s = std::net::UdpSocket::bind((ip, 0)).expect("bind");
    s.local_addr().unwrap().port()
}

/// One device: a home, a replica directory, an address, maybe a running daemon.
pub struct Device {
    pub name: String,
    pub home: PathBuf,
    pub dir: PathBuf,
    pub addr: String,
    pub id: String,
    /// The network namespace the daemon runs in, if not the test's own.
    pub netns: Option<String>,
    /// A command the daemon runs under (e.g. `setpriv` with fewer capabilities); empty: none.
    pub under: Vec<String>,
    /// Environment for the daemon (e.g. fault-injection points, [`Device::arm`]).
    pub env: Vec<(String, String)>,
    /// A command the CLI calls of this device's own methods (`status`, `journal`) run under
    /// (a daemon run as another user answers only that user); empty: none.
    pub cli_under: Vec<String>,
    child: Option<Child>,
    _tmp: std::sync::Arc<tempfile::TempDir>,
}

pub fn meshfs(home: &Path, args: &[&str]) -> std::process::Output {
    Command::new(bin())
        .arg("--home")
        .arg(home)
        .args(args)
        .output()
        .expect("run meshfs")
}

pub fn ok(home: &Path, args: &[&str]) -> String {
    let out = meshfs(home, args);
    assert!(
        out.status.success(),
        "meshfs {:?} failed: {}{}",
        args,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).to_string()
}

impl Device {
    /// A new device with folder `work` at `<tmp>/<name>/replica`.
    pub fn new(tmp: &std::sync::Arc<tempfile::TempDir>, name: &str) -> Device {
        Device::with_replica(tmp, name, tmp.path().join(name).join("replica"))
    }

    /// A new device whose replica directory is `dir` (for example on a small filesystem).
    pub fn with_replica(
        tmp: &std::sync::Arc<tempfile::TempDir>,
        name: &str,
        dir: PathBuf,
    ) -> Device {
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let ip = format!("127.0.{}.{}", 1 + (std::process::id() % 200), 2 + (n % 250));
        let port = free_port(&ip);
        Device::at(tmp, name, dir, format!("{ip}:{port}"), None)
    }

    /// A device listening on `addr` whose daemon runs in network namespace `netns`.
    pub fn in_netns(
        tmp: &std::sync::Arc<tempfile::TempDir>,
        name: &str,
        netns: &str,
        addr: &str,
    ) -> Device {
        let dir = tmp.path().join(name).join("replica");
        Device::at(tmp, name, dir, addr.to_string(), Some(netns.to_string()))
    }

    fn at(
        tmp: &std::sync::Arc<tempfile::TempDir>,
        name: &str,
        dir: PathBuf,
        addr: String,
        netns: Option<String>,
    ) -> Device {
        let base = tmp.path().join(name);
        let home = base.join("home");
        std::fs::create_dir_all(&dir).unwrap();
        // Local discovery off: a daemon in the test's own network namespace must never
        // broadcast on this machine's interfaces (the discovery tests switch it on, inside
        // namespaces of their own: `Device::discovery`).
        let id = ok(
            &home,
            &["init", "--name", name, "--listen", &addr, "--no-discovery"],
        )
        .trim()
        .to_string();
        ok(
            &home,
            &["folder", "add", dir.to_str().unwrap(), "--id", "work"],
        );
        Device {
            name: name.into(),
            home,
            dir,
            addr,
            id,
            netns,
            under: Vec::new(),
            env: Vec::new(),
            cli_under: Vec::new(),
            child: None,
            _tmp: tmp.clone(),
        }
    }

    /// Switches local discovery on or off in the config (`[discovery] local`). Only for a
    /// device whose daemon runs in a network namespace of the test's own: in the test's
    /// namespace it would broadcast on this machine's interfaces.
    pub fn discovery(&self, on: bool) {
        assert!(
            !on || self.netns.is_some(),
            "local discovery only inside a test's own network namespace"
        );
        let file = self.home.join("config.toml");
        let text = std::fs::read_to_string(&file).unwrap();
        let (from, to) = if on {
            ("[discovery]\nlocal = false", "[discovery]\nlocal = true")
        } else {
            ("[discovery]\nlocal = true", "[discovery]\nlocal = false")
        };
        assert!(text.contains(from) || text.contains(to), "{text}");
        std::fs::write(&file, text.replace(from, to)).unwrap();
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.join(rel)
    }

    pub fn start(&mut self) {
        self.spawn();
        self.wait_up();
    }

    /// Starts the daemon without waiting for it to answer.
    pub fn start_detached(&mut self) {
        self.spawn();
    }

    /// Starts every device before waiting for any: they come up, and dial, at once.
    pub fn start_together(devices: &mut [&mut Device]) {
        for d in devices.iter_mut() {
            d.spawn();
        }
        for d in devices.iter() {
            d.wait_up();
        }
    }

    fn spawn(&mut self) {
        assert!(self.child.is_none());
        let log = std::fs::File::create(self.home.join("daemon.log")).unwrap();
        let mut cmd = match (&self.netns, self.under.split_first()) {
            (Some(ns), _) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, bin()]);
                c
            }
            (None, Some((first, rest))) => {
                let mut c = Command::new(first);
                c.args(rest).arg(bin());
                c
            }
            (None, None) => Command::new(bin()),
        };
        let child = cmd
            .arg("--home")
            .arg(&self.home)
            .arg("daemon")
            .env(
                "RUST_LOG",
                std::env::var("MESHFS_TEST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
    }

    /// Starts the daemon and waits up to `secs` for it to end by itself (a failpoint, a
    /// refusal); its exit status.
    pub fn run_to_exit(&mut self, secs: u64) -> std::process::ExitStatus {
        self.spawn();
        let mut c = self.child.take().unwrap();
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            if let Some(s) = c.try_wait().unwrap() {
                return s;
            }
            if Instant::now() > deadline {
                let _ = c.kill();
                let _ = c.wait();
                panic!(
                    "daemon {} still running after {secs} s:\n{}",
                    self.name,
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits up to `secs` for the running daemon to end by itself (an armed failpoint); its
    /// exit status, or `None` while it still runs (it is left running).
    pub fn wait_exit(&mut self, secs: f64) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + Duration::from_secs_f64(secs);
        loop {
            let c = self.child.as_mut()?;
            if let Some(s) = c.try_wait().unwrap() {
                self.child = None;
                return Some(s);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGTERM, and the exit status (`None`: it had to be killed after 10 s, or was not
    /// running).
    pub fn stop_status(&mut self) -> Option<std::process::ExitStatus> {
        let mut c = self.child.take()?;
        // SAFETY: kill takes two integers and touches no memory. The child has not been
        // waited for, so its pid cannot have been reused by another process.
        unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(s)) = c.try_wait() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = c.kill();
        let _ = c.wait();
        None
    }

    /// Arms fault-injection points for the daemon's next start (`daemon/src/failpoint.rs`):
    /// `spec` is `POINT=ACTION,…`, e.g. `install.after_rename@f=pause`.
    pub fn arm(&mut self, spec: &str) {
        let dir = self.home.join("failpoints");
        std::fs::create_dir_all(&dir).unwrap();
        self.env.retain(|(k, _)| !k.starts_with("MESHFS_FAILPOINT"));
        self.env.push(("MESHFS_FAILPOINTS".into(), spec.into()));
        self.env
            .push(("MESHFS_FAILPOINT_DIR".into(), dir.display().to_string()));
    }

    /// Waits until the daemon is paused at `point` (as armed, `name@detail`).
    pub fn wait_paused(&self, point: &str, secs: u64) {
        let reached = self
            .home
            .join("failpoints")
            .join(format!("{}.reached", point.replace('/', "%")));
        let deadline = Instant::now() + Duration::from_secs(secs);
        while !reached.exists() {
            assert!(
                Instant::now() < deadline,
                "{} never reached {point}:\n{}",
                self.name,
                tail(&self.log(), 40)
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Lets the daemon paused at `point` go on.
    pub fn resume(&self, point: &str) {
        let go = self
            .home
            .join("failpoints")
            .join(format!("{}.go", point.replace('/', "%")));
        std::fs::write(go, b"").unwrap();
    }

    fn wait_up(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if self.cli(&["status", "--json"]).status.success() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("daemon {} did not start:\n{}", self.name, self.log());
    }

    /// SIGTERM and wait.
    pub fn stop(&mut self) {
        self.stop_status();
    }

    /// SIGKILL.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The running daemon's process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// The running daemon's resident memory, in KiB.
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid().unwrap()))
            .unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    }

    /// `meshfs --home HOME ARGS`, under `cli_under`.
    pub fn cli(&self, args: &[&str]) -> std::process::Output {
        let mut cmd = match self.cli_under.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(bin());
                c
            }
            None => Command::new(bin()),
        };
        cmd.arg("--home")
            .arg(&self.home)
            .args(args)
            .output()
            .expect("run meshfs")
    }

    /// As [`Device::cli`], asserting success; its stdout.
    pub fn cli_ok(&self, args: &[&str]) -> String {
        let out = self.cli(args);
        assert!(
            out.status.success(),
            "meshfs {:?} failed: {}{}",
            args,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).to_string()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.home.join("daemon.log")).unwrap_or_default()
    }

    pub fn status(&self) -> serde_json::Value {
        serde_json::from_str(&self.cli_ok(&["status", "--json"])).unwrap()
    }

    /// Bytes sent + received over all connections so far.
    /// The UDP bytes this device sent, each once: a packet declared lost (under load, on
    /// loopback too) is sent again, and that is the transport's doing, not the protocol's.
    pub fn sent_once(&self) -> u64 {
        let s = self.status();
        s["bytes_sent"].as_u64().unwrap() - s["bytes_resent"].as_u64().unwrap()
    }

    pub fn wire_bytes(&self) -> u64 {
        let s = self.status();
        s["bytes_sent"].as_u64().unwrap() + s["bytes_received"].as_u64().unwrap()
    }

    pub fn journal(&self, args: &[&str]) -> Vec<serde_json::Value> {
        let mut a = vec!["journal", "work", "--json"];
        a.extend_from_slice(args);
        self.cli_ok(&a)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SIGTERM first: a daemon that serves a mount unmounts it on the way out, so a test
        // leaves no dead mount point behind.
        self.stop();
    }
}

/// Makes `a` and `b` peers sharing `work`, both dialing.
pub fn pair(a: &Device, b: &Device) {
    ok(
        &a.home,
        &[
            "peer", "add", &b.id, "--addr", &b.addr, "--name", &b.name, "--share", "work",
        ],
    );
    ok(
        &b.home,
        &[
            "peer", "add", &a.id, "--addr", &a.addr, "--name", &a.name, "--share", "work",
        ],
    );
}

pub fn tmp() -> std::sync::Arc<tempfile::TempDir> {
    clock::start();
    std::sync::Arc::new(tempfile::tempdir().unwrap())
}

/// Waits until `done` holds, checked every 10 ms; fails naming `what` after `secs`.
pub fn until(what: &str, secs: u64, mut done: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !done() {
        assert!(t0.elapsed() < Duration::from_secs(secs), "{what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits until every device reports in sync with its connected peers (three times in a row)
/// and their trees are equal. `--connected`: a peer configured but not among `devs` (one that
/// never runs, or is stopped) is not waited for; the trees compared prove convergence.
///
/// Each `status --wait-synced` may take up to 5 s: it returns as soon as three polls in a row
/// say in sync, but a debug daemon on a loaded machine can take over 150 ms to answer one
/// poll, and a shorter timeout then never sees three in a row (a CI run failed so: both
/// daemons in sync, the trees equal, and this loop still waiting after 60 s).
pub fn wait_synced(devs: &[&Device], secs: u64) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let all = devs.iter().all(|d| {
            meshfs(
                &d.home,
                &["status", "--wait-synced", "--connected", "--timeout", "5"],
            )
            .status
            .success()
        });
        if all {
            let first = tree(&devs[0].dir);
            if devs.iter().all(|d| tree(&d.dir) == first) {
                return;
            }
        }
        if Instant::now() > deadline {
            for d in devs {
                eprintln!(
                    "=== {} status\n{}\n=== tree {:#?}\n=== log tail\n{}",
                    d.name,
                    String::from_utf8_lossy(&d.cli(&["status", "--json"]).stdout),
                    tree(&d.dir).keys().take(30).collect::<Vec<_>>(),
                    tail(&d.log(), 40)
                );
            }
            panic!("devices did not converge within {secs} s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The last `n` lines of `s` (a device's log, for a failing test's message).
pub fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Kind, content hash (or link target) and permission bits of everything in a replica.
pub fn tree(root: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            let rel = p.strip_prefix(root).unwrap().to_string_lossy().to_string();
            if rel.starts_with(".meshfs") || e.file_name().to_string_lossy().starts_with(".meshfs")
            {
                continue;
            }
            // Gone since the listing (a daemon's temp file, a file replaced meanwhile): a
            // caller that compares trees looks again.
            let Ok(md) = std::fs::symlink_metadata(&p) else {
                continue;
            };
            let mode = md.permissions().mode() & 0o7777;
            let v = if md.file_type().is_symlink() {
                let target = std::fs::read_link(&p).unwrap_or_default();
                format!("link {}", target.display())
            } else if md.is_dir() {
                stack.push(p.clone());
                format!("dir {mode:o}")
            } else {
                let data = std::fs::read(&p).unwrap_or_default();
                format!(
                    "file {mode:o} {} {}",
                    data.len(),
                    blake3::hash(&data).to_hex()
                )
            };
            out.insert(rel, v);
        }
    }
    out
}

pub fn write(p: &Path, data: &[u8]) {
    if let Some(parent) = p.parent() {
        std::fs::create_dir_all(parent).unwrap();
    }
    std::fs::write(p, data).unwrap();
}

pub fn inode(p: &Path) -> u64 {
    std::fs::metadata(p).unwrap().ino()
}

/// Deterministic pseudo-random bytes.
pub fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 32);
    let mut ctr = 0u64;
    while out.len() < len {
        let mut h = blake3::Hasher::new();
        h.update(&seed.to_le_bytes());
        h.update(&ctr.to_le_bytes());
        let mut r = h.finalize_xof();
        let mut buf = [0u8; 65536];
        r.fill(&mut buf);
        out.extend_from_slice(&buf);
        ctr += 1;
    }
    out.truncate(len);
    out
}

/// A tmpfs of `mib` MiB at `dir`, unmounted on drop.
pub struct SmallDisk(std::path::PathBuf);

impl SmallDisk {
    /// Mounts it (the tests run as root).
    pub fn mount(dir: &std::path::Path, mib: u64) -> SmallDisk {
        std::fs::create_dir_all(dir).unwrap();
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
            .arg(dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "mounting a tmpfs (the tests run as root): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        SmallDisk(dir.to_path_buf())
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}
