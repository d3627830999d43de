//! `meshfs demo`: a self-contained tour on one machine. It starts two devices on loopback in a
//! temporary directory (each a real `meshfs daemon` process with its own home), mounts each
//! folder where FUSE is usable (else it says so in one line and works in the replica
//! directories), edits files in one and shows them arrive in the other, commits a git
//! repository in one mount and shows it clean in the other, provokes a conflict while one
//! device is offline and shows how it resolves, prints the journal, and cleans up.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct DemoDevice {
    name: &'static str,
    home: PathBuf,
    files: PathBuf,
    addr: String,
    child: Option<Child>,
    /// Where the folder is mounted while the daemon runs (`None`: no FUSE here).
    mnt: Option<PathBuf>,
}

fn exe() -> anyhow::Result<PathBuf> {
    Ok(std::env::current_exe()?)
}

fn run(home: &Path, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(exe()?)
        .arg("--home")
        .arg(home)
        .args(args)
        .output()?;
    if !out.status.success() {
        anyhow::bail!(
            "meshfs {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).to_string())
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::UdpSocket::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

impl DemoDevice {
    fn start(&mut self) -> anyhow::Result<()> {
        let log = std::fs::File::create(self.home.join("daemon.log"))?;
        self.child = Some(
            Command::new(exe()?)
                .arg("--home")
                .arg(&self.home)
                .arg("daemon")
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()?,
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if run(&self.home, &["status", "--json"]).is_ok() {
                if let Some(m) = &self.mnt {
                    run(
                        &self.home,
                        &["mount", "demo", m.to_str().unwrap_or_default()],
                    )?;
                }
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        anyhow::bail!(
            "device {} did not start; see {}",
            self.name,
            self.home.join("daemon.log").display()
        )
    }

    /// Where the user works: the mount, or the replica directory without FUSE.
    fn work(&self) -> &Path {
        self.mnt.as_deref().unwrap_or(&self.files)
    }

    /// Mounts the folder; on failure, says why in one line and works without mounts.
    fn try_mount(&mut self, root: &Path) -> bool {
        let m = root.join(format!("{}-mount", self.name));
        let made = std::fs::create_dir_all(&m).map_err(anyhow::Error::from);
        match made.and_then(|_| {
            run(
                &self.home,
                &["mount", "demo", m.to_str().unwrap_or_default()],
            )
        }) {
            Ok(_) => {
                self.mnt = Some(m);
                true
            }
            Err(e) => {
                println!("no FUSE mount here ({e}); the tour works in the replica directories");
                false
            }
        }
    }

    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: kill takes two integers and touches no memory. The child has not been
            // waited for, so its pid cannot have been reused by another process.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline && matches!(c.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for DemoDevice {
    fn drop(&mut self) {
        self.stop();
    }
}

fn wait_for(path: &Path, content: &[u8]) -> anyhow::Result<Duration> {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(20) {
        if std::fs::read(path).is_ok_and(|c| c == content) {
            return Ok(t.elapsed());
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    anyhow::bail!("{} did not arrive", path.display())
}

fn step(s: &str) {
    println!("\n== {s}");
}

/// Runs the demo; `keep` leaves the temporary directory in place.
pub fn run_demo(keep: bool) -> anyhow::Result<u8> {
    let root = std::env::temp_dir().join(format!("meshfs-demo-{}", std::process::id()));
    std::fs::create_dir_all(&root)?;
    let result = demo(&root);
    if keep {
        println!("\nleft everything in {}", root.display());
    } else {
        let _ = std::fs::remove_dir_all(&root);
    }
    result
}

fn demo(root: &Path) -> anyhow::Result<u8> {
    let (mut a, mut b) = two_devices(root)?;
    a.start()?;
    b.start()?;
    println!("both daemons running; they found each other over QUIC with pinned ids");
    if a.try_mount(root) && b.try_mount(root) {
        println!(
            "each folder is mounted (FUSE, served by its daemon): laptop {}, server {}; changes made there are journaled from the operations themselves",
            a.work().display(),
            b.work().display()
        );
    } else {
        // The laptop may have mounted before the server could not: the tour then works in
        // the replica directories on both, with no mount left serving beside them.
        if a.mnt.take().is_some() {
            run(&a.home, &["unmount", "demo"])?;
        }
        b.mnt = None;
    }
    notes_arrive(&a, &b)?;
    many_files_and_a_rename(&a, &b)?;
    if a.mnt.is_some() && Command::new("git").arg("--version").output().is_ok() {
        git_in_the_mounts(&a, &b)?;
    }
    a_conflict(&a, &mut b)?;

    step("the journal: who changed what, when, on which device (last 8 entries on the server)");
    print!("{}", run(&b.home, &["journal", "demo", "--limit", "8"])?);

    step("status of the laptop");
    print!("{}", run(&a.home, &["status"])?);
    a.stop();
    b.stop();
    println!("\ndemo finished; both daemons stopped");
    Ok(0)
}

/// Two initialised devices, laptop and server, each with folder `demo`, peers of each other.
fn two_devices(root: &Path) -> anyhow::Result<(DemoDevice, DemoDevice)> {
    step("two devices, laptop and server, each with its own identity and a folder `demo`");
    let mut devs = Vec::new();
    for name in ["laptop", "server"] {
        let home = root.join(name);
        let files = root.join(format!("{name}-files"));
        let addr = format!("127.0.0.1:{}", free_port()?);
        // Loopback only: nothing announced on this machine's networks.
        let id = run(
            &home,
            &["init", "--name", name, "--listen", &addr, "--no-discovery"],
        )?
        .trim()
        .to_string();
        run(
            &home,
            &[
                "folder",
                "add",
                files.to_str().unwrap_or_default(),
                "--id",
                "demo",
            ],
        )?;
        println!(
            "{name:<7} {id}  listening on {addr}, folder {}",
            files.display()
        );
        devs.push((
            DemoDevice {
                name,
                home,
                files,
                addr,
                child: None,
                mnt: None,
            },
            id,
        ));
    }
    let (b_id, b_addr) = (devs[1].1.clone(), devs[1].0.addr.clone());
    let (a_id, a_addr) = (devs[0].1.clone(), devs[0].0.addr.clone());
    run(
        &devs[0].0.home,
        &[
            "peer", "add", &b_id, "--addr", &b_addr, "--name", "server", "--share", "demo",
        ],
    )?;
    run(
        &devs[1].0.home,
        &[
            "peer", "add", &a_id, "--addr", &a_addr, "--name", "laptop", "--share", "demo",
        ],
    )?;
    let mut it = devs.into_iter().map(|(d, _)| d);
    match (it.next(), it.next()) {
        (Some(a), Some(b)) => Ok((a, b)),
        _ => anyhow::bail!("demo setup failed"),
    }
}

/// Ten notes saved on the laptop, each timed until the server can read it.
fn notes_arrive(a: &DemoDevice, b: &DemoDevice) -> anyhow::Result<()> {
    step("a file saved on the laptop appears on the server");
    let mut samples = Vec::new();
    for i in 0..10 {
        let content = format!("note {i}: written on the laptop\n");
        std::fs::write(a.work().join(format!("note-{i}.txt")), &content)?;
        samples.push(wait_for(
            &b.work().join(format!("note-{i}.txt")),
            content.as_bytes(),
        )?);
    }
    samples.sort();
    println!(
        "10 new files, save → readable on the server: median {:.1} ms, worst {:.1} ms",
        samples[5].as_secs_f64() * 1e3,
        samples[9].as_secs_f64() * 1e3
    );
    Ok(())
}

/// 1,000 small files, then their directory renamed: the bytes a rename sends.
fn many_files_and_a_rename(a: &DemoDevice, b: &DemoDevice) -> anyhow::Result<()> {
    step("a directory of 1,000 small files, then renamed (a rename moves no data)");
    let t = Instant::now();
    for i in 0..1000 {
        let d = a.work().join(format!("project/src{}", i % 10));
        std::fs::create_dir_all(&d)?;
        std::fs::write(
            d.join(format!("file{i}.rs")),
            format!("// file {i}\nfn f{i}() {{}}\n"),
        )?;
    }
    run(&a.home, &["status", "--wait-synced", "--timeout", "60"])?;
    println!(
        "1,000 files in sync after {:.2} s",
        t.elapsed().as_secs_f64()
    );
    let before: serde_json::Value = serde_json::from_str(&run(&a.home, &["status", "--json"])?)?;
    std::fs::rename(a.work().join("project"), a.work().join("renamed-project"))?;
    run(&a.home, &["status", "--wait-synced", "--timeout", "60"])?;
    let after: serde_json::Value = serde_json::from_str(&run(&a.home, &["status", "--json"])?)?;
    let moved = after["bytes_sent"]
        .as_u64()
        .unwrap_or(0)
        .saturating_sub(before["bytes_sent"].as_u64().unwrap_or(0));
    println!("renamed on the laptop; the server has renamed-project/ with {} files; {moved} bytes sent (index records only)", count_files(&b.work().join("renamed-project")));
    Ok(())
}

/// A git commit in the laptop's mount; the server's mount has the same clean repository.
fn git_in_the_mounts(a: &DemoDevice, b: &DemoDevice) -> anyhow::Result<()> {
    step("git in the laptop's mount; the server's mount has the same clean repository");
    let repo = a.work().join("repo");
    std::fs::create_dir_all(repo.join("src"))?;
    std::fs::write(repo.join("src/main.rs"), "fn main() {}\n")?;
    std::fs::write(repo.join("README"), "demo repository\n")?;
    let git = |dir: &Path, args: &[&str]| -> anyhow::Result<String> {
        let out = Command::new("git")
            .args([
                "-c",
                "user.name=laptop",
                "-c",
                "user.email=laptop@demo.invalid",
            ])
            .args(args)
            .current_dir(dir)
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "git {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    };
    git(&repo, &["init", "-q"])?;
    git(&repo, &["add", "-A"])?;
    git(
        &repo,
        &["commit", "-q", "-m", "first commit, made on the laptop"],
    )?;
    run(&a.home, &["status", "--wait-synced", "--timeout", "60"])?;
    let theirs = b.work().join("repo");
    println!(
        "server: git log = {:?}",
        git(&theirs, &["log", "--format=%s"])?
    );
    let status = git(&theirs, &["status", "--porcelain"])?;
    println!(
        "server: git status = {}",
        if status.is_empty() {
            "clean".to_string()
        } else {
            status
        }
    );
    Ok(())
}

/// Both devices edit one file while the server is offline; how it resolves.
fn a_conflict(a: &DemoDevice, b: &mut DemoDevice) -> anyhow::Result<()> {
    step("a conflict: both devices edit report.txt while the server is offline");
    std::fs::write(a.work().join("report.txt"), "draft\n")?;
    wait_for(&b.work().join("report.txt"), b"draft\n")?;
    b.stop();
    std::fs::write(a.work().join("report.txt"), "laptop's version\n")?;
    std::thread::sleep(Duration::from_millis(1100));
    std::fs::write(
        b.files.join("report.txt"),
        "server's version (saved later)\n",
    )?;
    b.start()?;
    run(&a.home, &["status", "--wait-synced", "--timeout", "60"])?;
    run(&b.home, &["status", "--wait-synced", "--timeout", "60"])?;
    println!(
        "back online; on the laptop:\n  report.txt = {:?}",
        std::fs::read_to_string(a.work().join("report.txt"))?.trim()
    );
    for e in std::fs::read_dir(a.work())?.flatten() {
        let n = e.file_name().to_string_lossy().to_string();
        if n.contains(".sync-conflict-") {
            println!("  {n} = {:?}", std::fs::read_to_string(e.path())?.trim());
        }
    }
    print!("{}", run(&b.home, &["conflicts", "demo"])?);
    Ok(())
}

fn count_files(dir: &Path) -> usize {
    let mut n = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(e.path());
            } else {
                n += 1;
            }
        }
    }
    n
}
