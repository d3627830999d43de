//! An ordinary user for a test, as on a laptop: created with a unique name, removed afterwards,
//! and the machine set up the way Debian ships it for FUSE (`fusermount3` installed, `/dev/fuse`
//! mode 0666 while any test needs it).

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

static NEXT: AtomicU32 = AtomicU32::new(0);

/// A user created for one test, removed (with its processes) on drop.
pub struct TestUser {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    _fuse: DevFuseOpen,
}

impl TestUser {
    /// Creates a user with a name unique to this process and test; installs fuse3 if
    /// fusermount3 is missing; opens /dev/fuse to everyone for as long as it lives.
    pub fn new() -> TestUser {
        ensure_fusermount();
        let fuse = DevFuseOpen::new();
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let name = format!("mfst{}u{n}", std::process::id());
        let out = Command::new("useradd")
            .args(["-M", "-N", "-s", "/bin/sh", "-d", "/nonexistent", &name])
            .output()
            .expect("useradd");
        assert!(out.status.success(), "useradd {name}: {out:?}");
        let id = |flag: &str| -> u32 {
            let o = Command::new("id").arg(flag).arg(&name).output().unwrap();
            String::from_utf8_lossy(&o.stdout).trim().parse().unwrap()
        };
        TestUser {
            uid: id("-u"),
            gid: id("-g"),
            name,
            _fuse: fuse,
        }
    }

    /// The command `args` run as this user: no supplementary groups, a clean environment
    /// but for PATH and HOME.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("setpriv");
        c.arg(format!("--reuid={}", self.uid))
            .arg(format!("--regid={}", self.gid))
            .arg("--clear-groups")
            .arg("--")
            .arg(program)
            .env_clear()
            .env("PATH", "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin")
            .env("HOME", "/nonexistent");
        c
    }

    /// The wrapper (`Device::under`) that runs a daemon as this user.
    pub fn under(&self) -> Vec<String> {
        vec![
            "setpriv".into(),
            format!("--reuid={}", self.uid),
            format!("--regid={}", self.gid),
            "--clear-groups".into(),
            "--".into(),
        ]
    }

    /// Gives `path` (recursively) to this user, and lets it reach `path` through its parents
    /// up to and including `up_to` (a test's temp dir is 0700 root).
    pub fn own(&self, path: &Path, up_to: &Path) {
        let st = Command::new("chown")
            .arg("-R")
            .arg(format!("{}:{}", self.uid, self.gid))
            .arg(path)
            .status()
            .unwrap();
        assert!(st.success());
        let mut p = path.parent();
        while let Some(dir) = p {
            let mode = std::fs::metadata(dir).unwrap().mode() & 0o7777;
            if mode & 0o001 == 0 {
                std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode | 0o711))
                    .unwrap();
            }
            if dir == up_to {
                break;
            }
            p = dir.parent();
        }
    }
}

impl Drop for TestUser {
    fn drop(&mut self) {
        // Its processes first (every one was started by this test, the user being new): a
        // user with running processes cannot be deleted.
        for pid in processes_of(self.uid) {
            // SAFETY: kill takes two integers and touches no memory.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        // A mount its killed daemon left (a test that failed half-way) is detached, so the
        // test's temp dir can go.
        let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let owner = format!("user_id={}", self.uid);
        for l in info
            .lines()
            .filter(|l| l.contains(" - fuse.meshfs ") && l.contains(&owner))
        {
            if let Some(point) = l.split(' ').nth(4) {
                let _ = Command::new("umount").args(["-l", point]).status();
            }
        }
        for _ in 0..50 {
            let out = Command::new("userdel").arg(&self.name).output();
            if out.is_ok_and(|o| o.status.success()) {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        eprintln!("could not remove test user {}", self.name);
    }
}

/// The processes whose real user id is `uid`.
pub fn processes_of(uid: u32) -> Vec<i32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let status = std::fs::read_to_string(e.path().join("status")).unwrap_or_default();
        let real = status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<u32>().ok());
        if real == Some(uid) {
            out.push(pid);
        }
    }
    out
}

/// Installs fuse3 (fusermount3, the setuid helper an ordinary user mounts through) if it is
/// missing, as `.ci/run` does.
pub fn ensure_fusermount() {
    let has = || {
        Command::new("fusermount3")
            .arg("-V")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if has() {
        return;
    }
    let st = Command::new("apt-get")
        .args(["install", "-y", "-qq", "fuse3"])
        .env("DEBIAN_FRONTEND", "noninteractive")
        .status();
    assert!(
        st.is_ok_and(|s| s.success()) && has(),
        "fusermount3 is missing and `apt-get install fuse3` failed"
    );
}

/// `/dev/fuse` open to every user (mode 0666, as Debian ships it) while any test holds one;
/// the mode it had is restored when the last holder in any test process lets go. The holders
/// (one process id per guard) and the saved mode are kept under a lock in /run/lock; a holder
/// that died without letting go is dropped from the list by the next one.
pub struct DevFuseOpen;

const DEV_FUSE: &str = "/dev/fuse";

fn state_file() -> PathBuf {
    PathBuf::from("/run/lock/meshfs-tests-dev-fuse")
}

/// Runs `f` on (saved mode, holders) under an exclusive lock of the state file.
fn with_state(f: impl FnOnce(&mut u32, &mut Vec<u32>)) {
    use std::io::{Read, Seek, Write};
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(state_file())
        .unwrap();
    // SAFETY: flock on a descriptor this function owns; it touches no memory.
    let locked = unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&file), libc::LOCK_EX) };
    assert_eq!(locked, 0);
    let mut text = String::new();
    file.read_to_string(&mut text).unwrap();
    let mut words = text
        .split_whitespace()
        .map(|w| w.parse::<u32>().unwrap_or(0));
    let mut saved = words.next().unwrap_or(0);
    let mut holders: Vec<u32> = words.collect();
    // SAFETY: kill with signal 0 only checks that the process exists.
    holders.retain(|&pid| unsafe { libc::kill(pid as i32, 0) } == 0);
    f(&mut saved, &mut holders);
    file.set_len(0).unwrap();
    file.rewind().unwrap();
    let list: Vec<String> = holders.iter().map(|p| p.to_string()).collect();
    write!(file, "{saved} {}", list.join(" ")).unwrap();
    // The lock goes with the descriptor.
}

impl DevFuseOpen {
    pub fn new() -> DevFuseOpen {
        with_state(|saved, holders| {
            let mode = std::fs::metadata(DEV_FUSE).unwrap().mode() & 0o7777;
            if holders.is_empty() {
                *saved = mode;
            }
            holders.push(std::process::id());
            if mode != 0o666 {
                std::fs::set_permissions(DEV_FUSE, std::fs::Permissions::from_mode(0o666)).unwrap();
            }
        });
        DevFuseOpen
    }
}

impl Drop for DevFuseOpen {
    fn drop(&mut self) {
        with_state(|saved, holders| {
            if let Some(i) = holders.iter().position(|&p| p == std::process::id()) {
                holders.remove(i);
            }
            if holders.is_empty() && *saved != 0 {
                let _ = std::fs::set_permissions(DEV_FUSE, std::fs::Permissions::from_mode(*saved));
            }
        });
    }
}
