//! Carries out a script on real daemons and records what each step actually did: every write
//! that happened with its exact bytes, and every local operation that changed a path (the
//! "touches" that decide which write was a device's last one at a path), in the order the
//! harness did them. A step whose file was not there (a delete of a file a peer already
//! removed) changes nothing and is traced as such.
//!
//! An on-demand device (`od`) is worked on through its mount only (`mount =` in its folder's
//! config, so every start of its daemon mounts it again); its daemon runs in the network
//! namespace of its device but in this process's mount namespace (`nsenter --net`, where the
//! others use `ip netns exec`, which makes a mount namespace of its own), so that the mount is
//! visible here. Its folder's budget is small, so the budget evicts while the script runs.

use super::mesh::{Mesh, PORT};
use super::ondemand::Watch;
use super::plan::{Op, Step, FILES};
use crate::common::{ok, Device};
use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How long a race waits for the first device's content to show on the second.
const RACE_DEADLINE: Duration = Duration::from_secs(20);

/// The on-demand device's budget (`--cache-max`): less than the larger files the script writes
/// on such a run, so that the budget evicts as they are read and written.
pub const CACHE_MAX: &str = "192KiB";

/// Lazily detaches a mount point left mounted (its daemon SIGKILLed and never started again,
/// a panic): dropped after the devices, whose drop stops their daemons (which unmounts).
struct Detach(Option<PathBuf>);

impl Drop for Detach {
    fn drop(&mut self) {
        if let Some(m) = &self.0 {
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(m)
                .stderr(std::process::Stdio::null())
                .status();
        }
    }
}

/// Whether `p` is a live mount point (listed in this process's mount table and answering).
fn mounted(p: &Path) -> bool {
    let table = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let target = p.to_string_lossy();
    table
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(target.as_ref()))
        && fs::read_dir(p).is_ok()
}

/// A write that happened: `content` is exactly what `dev`'s file at `path` held once it
/// was done.
#[derive(Clone, Debug)]
pub struct Written {
    pub tick: u64,
    pub step: usize,
    pub dev: usize,
    pub path: String,
    pub content: Vec<u8>,
}

/// A local operation that changed `path` on `dev` (a write, a delete, either end of a
/// rename, a removal of a directory above it).
#[derive(Clone, Debug)]
pub struct Touch {
    pub tick: u64,
    pub dev: usize,
    pub path: String,
}

/// Counts for the seed's summary line.
#[derive(Clone, Debug, Default)]
pub struct Counts {
    pub writes: usize,
    pub offline_writes: usize,
    pub kills: usize,
    pub partitions: usize,
    pub races: usize,
    pub race_overwrites: usize,
    pub holds: usize,
}

/// The devices, their network and everything the script did to them.
pub struct Run {
    pub seed: u64,
    pub devs: Vec<Device>,
    pub mesh: Mesh,
    pub written: Vec<Written>,
    pub touches: Vec<Touch>,
    pub trace: Vec<String>,
    pub counts: Counts,
    /// The on-demand device, if any, and its mount point.
    pub od: Option<(usize, PathBuf)>,
    /// What was seen of the on-demand device as the script ran.
    pub watch: Watch,
    held: BTreeMap<(usize, String), File>,
    tick: u64,
    /// Daemon starts so far (numbers the logs kept).
    restarts: usize,
    started: Instant,
    /// `trace.txt` in the run's directory: the trace as it happens, kept if the run fails.
    log: File,
    /// Declared after `devs`: dropped after them.
    _detach: Detach,
}

/// Writes `data` to `p`, creating its directories; `tmp`: through that temporary file renamed
/// over `p`. A directory a peer's deletion removed between the two is made again (a few times).
fn put(p: &Path, data: &[u8], tmp: Option<&Path>) -> io::Result<()> {
    let mut last = None;
    for _ in 0..5 {
        if let Some(parent) = p.parent() {
            let _ = fs::create_dir_all(parent);
        }
        let r = match tmp {
            None => fs::write(p, data),
            Some(t) => fs::write(t, data).and_then(|()| fs::rename(t, p)),
        };
        match r {
            Err(e) if e.kind() == io::ErrorKind::NotFound => last = Some(e),
            r => return r,
        }
    }
    if let Some(t) = tmp {
        let _ = fs::remove_file(t);
    }
    Err(last.unwrap_or_else(|| io::Error::other("no attempt")))
}

impl Run {
    /// `n` devices `r0`… in a full mesh, all started and in sync with each other; `od`: the
    /// one on demand.
    pub fn new(
        seed: u64,
        n: usize,
        od: Option<usize>,
        tmp: &std::sync::Arc<tempfile::TempDir>,
    ) -> Run {
        let mesh = Mesh::new(n);
        let mut devs: Vec<Device> = (0..n)
            .map(|i| {
                Device::in_netns(
                    tmp,
                    &format!("r{i}"),
                    &mesh.ns[i],
                    &format!("0.0.0.0:{PORT}"),
                )
            })
            .collect();
        for a in 0..n {
            for b in 0..n {
                if a != b {
                    let addr = format!("{}:{PORT}", mesh.addr(b, a));
                    let (id, name) = (&devs[b].id, &devs[b].name);
                    ok(
                        &devs[a].home,
                        &[
                            "peer", "add", id, "--addr", &addr, "--name", name, "--share", "work",
                        ],
                    );
                }
            }
        }
        let od = od.map(|o| {
            let d = &mut devs[o];
            let mnt = tmp.path().join(&d.name).join("mnt");
            fs::create_dir_all(&mnt).expect("mount point");
            ok(
                &d.home,
                &[
                    "folder",
                    "set",
                    "work",
                    "--on-demand",
                    "--cache-max",
                    CACHE_MAX,
                    "--min-free",
                    "0",
                ],
            );
            let cfg = d.home.join("config.toml");
            let text = fs::read_to_string(&cfg).expect("config");
            assert!(text.contains("watch = true"), "{text}");
            fs::write(
                &cfg,
                text.replacen(
                    "watch = true",
                    &format!("watch = true\nmount = {:?}", mnt.to_string_lossy()),
                    1,
                ),
            )
            .expect("config");
            let ns = d.netns.take().expect("a namespace");
            d.under = vec![
                "nsenter".into(),
                format!("--net=/run/netns/{ns}"),
                "--".into(),
            ];
            (o, mnt)
        });
        let detach = Detach(od.as_ref().map(|(_, m)| m.clone()));
        Device::start_together(&mut devs.iter_mut().collect::<Vec<_>>());
        let run = Run {
            seed,
            devs,
            mesh,
            written: Vec::new(),
            touches: Vec::new(),
            trace: Vec::new(),
            counts: Counts::default(),
            od,
            watch: Watch::default(),
            held: BTreeMap::new(),
            tick: 0,
            restarts: 0,
            started: Instant::now(),
            log: File::create(tmp.path().join("trace.txt")).expect("trace file"),
            _detach: detach,
        };
        run.wait_mount();
        run
    }

    /// Where the harness works on `dev`'s copy of `rel`: its replica, or for the on-demand
    /// device its mount.
    pub fn at(&self, dev: usize, rel: &str) -> PathBuf {
        match &self.od {
            Some((o, mnt)) if *o == dev => mnt.join(rel),
            _ => self.devs[dev].path(rel),
        }
    }

    /// The on-demand device's mount point (`dev` must be it).
    pub fn mount_of(&self, dev: usize) -> PathBuf {
        match &self.od {
            Some((o, mnt)) if *o == dev => mnt.clone(),
            _ => panic!("r{dev} is not on demand"),
        }
    }

    /// `dev`'s replica as `common::tree` sees it but with meshfs's content hashes; for the on-demand
    /// device, its backing with each placeholder taken for the content it stands for (nothing
    /// fetched).
    pub fn tree(&self, dev: usize) -> BTreeMap<String, String> {
        super::ondemand::backing_tree(&self.devs[dev].dir)
    }

    /// Waits until the on-demand device's daemon, if it runs, serves its mount (a start mounts
    /// it after the control socket answers).
    fn wait_mount(&self) {
        let Some((o, mnt)) = &self.od else {
            return;
        };
        if self.devs[*o].pid().is_none() {
            return;
        }
        let t0 = Instant::now();
        while !mounted(mnt) {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "r{o}'s mount never came up:\n{}",
                self.devs[*o].log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Looks at the on-demand device's backing after step `step` (evictions since the last).
    pub fn look(&mut self, step: usize) {
        if let Some((o, _)) = &self.od {
            let backing = self.devs[*o].dir.clone();
            self.watch.look(step, &backing);
        }
    }

    pub fn note(&mut self, step: usize, what: String) {
        let ms = self.started.elapsed().as_millis();
        let line = format!("{ms:>7} ms  #{step:<3} {what}");
        let _ = writeln!(self.log, "{line}");
        self.trace.push(line);
    }

    fn touch(&mut self, dev: usize, path: &str) {
        self.tick += 1;
        self.touches.push(Touch {
            tick: self.tick,
            dev,
            path: path.to_string(),
        });
    }

    /// What `dev` writes to `path` at `step`: one line of text; on a run with an on-demand
    /// device, one write in two is 16–400 KiB of numbered lines (several chunks: a read
    /// through the mount is served chunk by chunk). Never a NUL byte.
    fn content(&self, step: usize, dev: usize, path: &str, how: &str) -> Vec<u8> {
        let n = self.devs.len();
        let line = format!("seed {} n {n} step {step} r{dev} {path} {how}\n", self.seed);
        let h = blake3::hash(line.as_bytes());
        let b = h.as_bytes();
        if self.od.is_none() || !b[0].is_multiple_of(2) {
            return line.into_bytes();
        }
        let size = (16 << 10) + (u32::from_le_bytes([b[1], b[2], b[3], 0]) as usize % (384 << 10));
        let mut out = Vec::with_capacity(size + 128);
        let mut k = 0u64;
        while out.len() < size {
            out.extend_from_slice(format!("{k:08} {line}").as_bytes());
            k += 1;
        }
        out
    }

    /// Writes a new content to `path` on `dev`; whether it happened.
    fn write(&mut self, step: usize, dev: usize, path: &str, atomic: bool, how: &str) -> bool {
        let data = self.content(step, dev, path, how);
        let p = self.at(dev, path);
        let tmp = atomic.then(|| {
            let name = Path::new(path).file_name().unwrap().to_string_lossy();
            p.with_file_name(format!(".{name}.{step}.tmp"))
        });
        let r = put(&p, &data, tmp.as_deref());
        match r {
            Ok(()) => {
                self.touch(dev, path);
                self.counts.writes += 1;
                if self.devs[dev].pid().is_none() {
                    self.counts.offline_writes += 1;
                }
                self.written.push(Written {
                    tick: self.tick,
                    step,
                    dev,
                    path: path.to_string(),
                    content: data,
                });
                self.note(step, format!("r{dev} wrote {path} ({how})"));
                true
            }
            Err(e) => {
                // An error after the open (none expected) may have emptied the file.
                self.touch(dev, path);
                self.note(step, format!("r{dev} write {path} failed: {e}"));
                false
            }
        }
    }

    /// Carries out one step.
    pub fn step(&mut self, i: usize, step: &Step) {
        match &step.op {
            Op::Write { dev, path, atomic } => {
                let how = if *atomic { "atomic" } else { "in place" };
                self.write(i, *dev, path, *atomic, how);
            }
            Op::Delete { dev, path } => match fs::remove_file(self.at(*dev, path)) {
                Ok(()) => {
                    self.touch(*dev, path);
                    self.note(i, format!("r{dev} deleted {path}"));
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    self.note(i, format!("r{dev} delete {path}: not there"))
                }
                Err(e) => {
                    self.touch(*dev, path);
                    self.note(i, format!("r{dev} delete {path}: {e}"));
                }
            },
            Op::RemoveDir { dev, dir } => {
                let p = self.at(*dev, dir);
                if fs::symlink_metadata(&p).is_err() {
                    self.note(i, format!("r{dev} remove {dir}/: not there"));
                } else {
                    // Peers' files may land in it meanwhile: a few tries.
                    let mut r = Ok(());
                    for _ in 0..5 {
                        r = fs::remove_dir_all(&p);
                        if r.is_ok() {
                            break;
                        }
                    }
                    for f in FILES.iter().filter(|f| f.starts_with(&format!("{dir}/"))) {
                        self.touch(*dev, f);
                    }
                    self.note(i, format!("r{dev} removed {dir}/: {r:?}"));
                }
            }
            Op::Rename { dev, from, to } => {
                let (a, b) = (self.at(*dev, from), self.at(*dev, to));
                if let Some(parent) = b.parent() {
                    let _ = fs::create_dir_all(parent);
                }
                match fs::rename(&a, &b) {
                    Ok(()) => {
                        self.touch(*dev, from);
                        self.touch(*dev, to);
                        self.note(i, format!("r{dev} renamed {from} -> {to}"));
                    }
                    Err(e) => self.note(i, format!("r{dev} rename {from} -> {to}: {e}")),
                }
            }
            Op::Race { from, to, paths } => self.race(i, *from, *to, paths),
            Op::Hold { dev, path } => self.hold(i, *dev, path),
            Op::Release { dev, path } => self.release(i, *dev, path),
            Op::Cut { a, b } => {
                self.mesh.set(*a, *b, false);
                self.counts.partitions += 1;
                self.note(i, format!("cut r{a} | r{b}"));
            }
            Op::Mend { a, b } => {
                self.mesh.set(*a, *b, true);
                self.note(i, format!("mend r{a} - r{b}"));
            }
            Op::Split { side } => {
                let n = side.len();
                for a in 0..n {
                    for b in a + 1..n {
                        if side[a] != side[b] {
                            self.mesh.set(a, b, false);
                        }
                    }
                }
                self.counts.partitions += 1;
                let group = |s: bool| -> Vec<String> {
                    (0..n)
                        .filter(|&d| side[d] == s)
                        .map(|d| format!("r{d}"))
                        .collect()
                };
                self.note(i, format!("split {:?} | {:?}", group(true), group(false)));
            }
            Op::Heal => {
                self.mesh.heal();
                self.note(i, "heal: every link up".into());
            }
            Op::Kill { dev } => {
                self.devs[*dev].kill();
                self.counts.kills += 1;
                self.note(i, format!("SIGKILL r{dev}"));
            }
            Op::Restart { dev } => {
                self.start(*dev);
                self.note(i, format!("restarted r{dev}"));
            }
            Op::Read { dev, path } => match fs::read(self.at(*dev, path)) {
                Ok(data) => {
                    self.watch.read(i, path, &data);
                    self.note(i, format!("r{dev} read {path}: {} bytes", data.len()));
                }
                Err(e) => {
                    if e.kind() != io::ErrorKind::NotFound {
                        self.watch.read_failures += 1;
                    }
                    self.note(i, format!("r{dev} read {path}: {e}"));
                }
            },
            Op::Evict { dev, path } => self.evict(i, *dev, path),
        }
        std::thread::sleep(Duration::from_millis(step.pause_ms));
        self.look(i);
    }

    /// `meshfs evict work PATH --json` on the on-demand device.
    fn evict(&mut self, i: usize, dev: usize, path: &str) {
        let out = self.devs[dev].cli(&["evict", "work", path, "--json"]);
        if !out.status.success() {
            let why = String::from_utf8_lossy(&out.stderr).trim().to_string();
            self.note(i, format!("r{dev} evict {path}: {why}"));
            return;
        }
        self.watch.evict_calls += 1;
        let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        let list = |k: &str| r[k].as_array().map(Vec::len).unwrap_or(0);
        self.watch.evict_kept += list("kept");
        let kept: Vec<String> = r["kept"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|k| {
                format!(
                    "{} ({})",
                    k["path"].as_str().unwrap_or(""),
                    k["why"].as_str().unwrap_or("")
                )
            })
            .collect();
        self.note(
            i,
            format!(
                "r{dev} evict {path}: evicted {} {}, kept {kept:?}",
                list("evicted"),
                r["evicted"]
            ),
        );
    }

    /// `from` writes each path; `to` overwrites each the moment `from`'s bytes are readable
    /// there (polled every 100 µs).
    fn race(&mut self, i: usize, from: usize, to: usize, paths: &[&'static str]) {
        self.counts.races += 1;
        let mut waiting: Vec<(&str, Vec<u8>)> = Vec::new();
        for p in paths {
            if self.write(i, from, p, false, "race, first") {
                waiting.push((p, self.content(i, from, p, "race, first")));
            }
        }
        let deadline = Instant::now() + RACE_DEADLINE;
        while !waiting.is_empty() && Instant::now() < deadline {
            let mut arrived = Vec::new();
            waiting.retain(|(p, want)| {
                let here = fs::read(self.at(to, p)).unwrap_or_default();
                if &here == want {
                    arrived.push(*p);
                    false
                } else {
                    true
                }
            });
            for p in arrived {
                if self.write(i, to, p, false, "race, second") {
                    self.counts.race_overwrites += 1;
                }
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        for (p, _) in waiting {
            self.note(i, format!("race: r{from}'s {p} never showed on r{to}"));
        }
    }

    fn hold(&mut self, i: usize, dev: usize, path: &str) {
        let p = self.at(dev, path);
        let line = self.content(i, dev, path, "held open");
        let mut r = Err(io::Error::other("no attempt"));
        for _ in 0..5 {
            if let Some(parent) = p.parent() {
                let _ = fs::create_dir_all(parent);
            }
            r = OpenOptions::new()
                .read(true)
                .append(true)
                .create(true)
                .open(&p);
            if !matches!(&r, Err(e) if e.kind() == io::ErrorKind::NotFound) {
                break;
            }
        }
        match r.and_then(|mut f| f.write_all(&line).map(|()| f)) {
            Ok(f) => {
                self.touch(dev, path);
                self.counts.holds += 1;
                self.held.insert((dev, path.to_string()), f);
                self.note(i, format!("r{dev} holds {path} open for writing"));
            }
            Err(e) => self.note(i, format!("r{dev} hold {path}: {e}")),
        }
    }

    fn release(&mut self, i: usize, dev: usize, path: &str) {
        let Some(mut f) = self.held.remove(&(dev, path.to_string())) else {
            self.note(i, format!("r{dev} release {path}: was not held"));
            return;
        };
        let line = self.content(i, dev, path, "before close");
        let mut content = Vec::new();
        let r = f
            .write_all(&line)
            .and_then(|()| f.rewind())
            .and_then(|()| f.read_to_end(&mut content));
        drop(f);
        self.touch(dev, path);
        match r {
            Ok(_) => {
                self.counts.writes += 1;
                self.written.push(Written {
                    tick: self.tick,
                    step: i,
                    dev,
                    path: path.to_string(),
                    content,
                });
                self.note(i, format!("r{dev} wrote and closed held {path}"));
            }
            Err(e) => self.note(i, format!("r{dev} release {path}: {e}")),
        }
    }

    /// Starts `dev`'s daemon, its log so far kept as `daemon.log.N` (a start truncates it).
    fn start(&mut self, dev: usize) {
        self.keep_log(dev);
        self.devs[dev].start();
        self.wait_mount();
    }

    fn keep_log(&mut self, dev: usize) {
        self.restarts += 1;
        let home = &self.devs[dev].home;
        let _ = fs::rename(
            home.join("daemon.log"),
            home.join(format!("daemon.log.{}", self.restarts)),
        );
    }

    /// Stops every daemon (SIGTERM) and starts them all again.
    pub fn restart_all(&mut self) {
        for d in 0..self.devs.len() {
            self.devs[d].stop();
            self.keep_log(d);
        }
        Device::start_together(&mut self.devs.iter_mut().collect::<Vec<_>>());
        self.wait_mount();
    }

    /// Closes every held file, brings every link up and every daemon back.
    pub fn settle(&mut self, last_step: usize) {
        let held: Vec<(usize, String)> = self.held.keys().cloned().collect();
        for (dev, path) in held {
            self.release(last_step, dev, &path);
        }
        self.mesh.heal();
        for d in 0..self.devs.len() {
            if self.devs[d].pid().is_none() {
                self.start(d);
                self.note(last_step, format!("restarted r{d} to settle"));
            }
        }
    }
}
