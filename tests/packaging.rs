//! What the Debian package ships, checked the way a packager would: man pages and completions
//! from the binary, systemd units that `systemd-analyze verify` accepts, a daemon that tells
//! systemd when it is ready and stops on SIGTERM, and (where cargo-deb is installed, as
//! `.ci/run` does) a `.deb` that dpkg installs into a clean directory root, where it runs.

use crate::common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn has(cmd: &str, arg: &str) -> bool {
    Command::new(cmd)
        .arg(arg)
        .output()
        .is_ok_and(|o| o.status.success())
}

#[test]
fn package_assets_are_a_man_page_per_subcommand_and_bash_zsh_fish_completions() {
    let t = tmp();
    let out = t.path().join("assets");
    let listed = ok(t.path(), &["package-assets", out.to_str().unwrap()]);
    for page in [
        "meshfs.1",
        "meshfs-status.1",
        "meshfs-folder-add.1",
        "meshfs-config-check.1",
        "meshfs-daemon.1",
    ] {
        let text = std::fs::read_to_string(out.join("man").join(page)).unwrap();
        assert!(text.starts_with(".ie") || text.contains(".TH"), "{page}");
        assert!(listed.contains(page), "{listed}");
    }
    // The daemon's page says what it sends on the LAN, exactly (docs/protocol.md).
    let daemon = std::fs::read_to_string(out.join("man/meshfs-daemon.1")).unwrap();
    for needle in [
        "21788",
        "ff12::6d65:7368",
        "MFSA",
        "instance nonce",
        "At most 320 bytes",
    ] {
        assert!(daemon.contains(needle), "meshfs-daemon.1 lacks {needle}");
    }
    let status = std::fs::read_to_string(out.join("man/meshfs-status.1")).unwrap();
    assert!(status.contains("wait\\-synced"), "{status}");
    // The hidden packager's command documents nothing.
    assert!(!out.join("man/meshfs-package-assets.1").exists());
    for (file, needle) in [
        ("meshfs.bash", "wait-synced"),
        ("_meshfs", "wait-synced"),
        ("meshfs.fish", "wait-synced"),
    ] {
        let text = std::fs::read_to_string(out.join("completions").join(file)).unwrap();
        assert!(text.contains(needle), "{file}");
    }
}

/// A copy of `unit` in `dir`, named `name`, whose commands run the binary under test.
fn unit_copy(dir: &Path, unit: &str, name: &str) -> PathBuf {
    let text = std::fs::read_to_string(repo().join("packaging").join(unit)).unwrap();
    assert!(text.contains("ExecStart=/usr/bin/meshfs daemon"), "{unit}");
    let path = dir.join(name);
    std::fs::write(&path, text.replace("/usr/bin/meshfs", bin())).unwrap();
    path
}

#[test]
fn both_systemd_units_pass_systemd_analyze_verify() {
    if !has("systemd-analyze", "--version") {
        eprintln!("skipped: no systemd-analyze on this machine");
        return;
    }
    let t = tmp();
    let user = unit_copy(t.path(), "meshfs.service", "meshfs.service");
    let system = unit_copy(t.path(), "meshfs@.service", "meshfs@root.service");
    let system_copy = system.clone();
    let runtime = t.path().join("runtime");
    std::fs::create_dir(&runtime).unwrap();
    for (unit, user_mode) in [(&user, true), (&system, false)] {
        let mut cmd = Command::new("systemd-analyze");
        if user_mode {
            cmd.arg("--user").env("XDG_RUNTIME_DIR", &runtime);
        }
        let out = cmd.args(["verify", "--man=no"]).arg(unit).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{}: {err}", unit.display());
        // verify exits 0 on unknown keys and bad values too; it only warns.
        assert!(err.trim().is_empty(), "{}: {err}", unit.display());
    }
    for unit in ["meshfs.service", "meshfs@.service"] {
        let text = std::fs::read_to_string(repo().join("packaging").join(unit)).unwrap();
        for line in [
            "Type=notify",
            "Restart=on-failure",
            "ExecStartPre=/usr/bin/meshfs config check",
        ] {
            assert!(text.lines().any(|l| l == line), "{unit}: {line}");
        }
        // fusermount3 is setuid: nothing may set no_new_privs or give a mount namespace.
        for key in [
            "NoNewPrivileges=",
            "SystemCallFilter=",
            "ProtectSystem=",
            "PrivateTmp=",
        ] {
            assert!(!text.lines().any(|l| l.starts_with(key)), "{unit}: {key}");
        }
    }
    let system = std::fs::read_to_string(repo().join("packaging/meshfs@.service")).unwrap();
    assert!(system.contains("\nUser=%i\n") && system.contains("\nDeviceAllow=/dev/fuse rw\n"));
    assert!(system.contains("\nCapabilityBoundingSet=CAP_SYS_ADMIN\n"));
    for unit in ["meshfs.service", "meshfs@.service"] {
        let text = std::fs::read_to_string(repo().join("packaging").join(unit)).unwrap();
        for line in ["MemoryHigh=2G", "MemoryMax=4G", "TasksMax=4096"] {
            assert!(text.lines().any(|l| l == line), "{unit}: {line}");
        }
    }
    // The drop-in for a device that never mounts, applied to the system unit: it verifies.
    let drop_in = std::fs::read_to_string(repo().join("packaging/no-mount.conf")).unwrap();
    assert!(drop_in.lines().any(|l| l == "NoNewPrivileges=yes"));
    let hardened = t.path().join("hardened");
    std::fs::create_dir(&hardened).unwrap();
    let unit = hardened.join("meshfs@root.service");
    let text = std::fs::read_to_string(&system_copy).unwrap();
    std::fs::write(&unit, format!("{text}\n{drop_in}")).unwrap();
    let out = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&unit)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.trim().is_empty(), "{err}");
}

#[test]
fn the_daemon_tells_systemd_when_it_is_ready_and_when_it_stops_on_sigterm() {
    let t = tmp();
    let a = Device::new(&t, "a");
    let socket = t.path().join("notify.sock");
    let listener = std::os::unix::net::UnixDatagram::bind(&socket).unwrap();
    listener
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut child = Command::new(bin())
        .arg("--home")
        .arg(&a.home)
        .arg("daemon")
        .env("NOTIFY_SOCKET", &socket)
        .stderr(std::fs::File::create(t.path().join("daemon.log")).unwrap())
        .spawn()
        .unwrap();
    let mut buf = [0u8; 256];
    let n = listener.recv(&mut buf).expect("READY=1 within 30 s");
    let msg = String::from_utf8_lossy(&buf[..n]).to_string();
    assert!(msg.lines().any(|l| l == "READY=1"), "{msg}");
    // Ready means `meshfs status` answers at once.
    ok(&a.home, &["status", "--json"]);
    // SAFETY: kill takes two integers and touches no memory. The child has not been waited for,
    // so its pid cannot have been reused by another process.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let n = listener.recv(&mut buf).expect("STOPPING=1");
    assert_eq!(&buf[..n], b"STOPPING=1");
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "still running 10 s after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status:?}");
    assert!(!a.home.join("state/control.sock").exists());
}

/// Installs `deb` with dpkg into `root`, a directory with only dpkg's own database, and
/// returns true; without root privileges (dpkg wants them to set owners) it only unpacks the
/// package there with `dpkg-deb -x` and returns false.
fn install_into(root: &Path, deb: &Path) -> bool {
    // SAFETY: geteuid takes no arguments and cannot fail.
    let is_root = unsafe { libc::geteuid() } == 0;
    if !is_root {
        let x = Command::new("dpkg-deb")
            .arg("-x")
            .arg(deb)
            .arg(root)
            .status()
            .unwrap();
        assert!(x.success());
        return false;
    }
    let admin = root.join("var/lib/dpkg");
    for dir in ["info", "updates"] {
        std::fs::create_dir_all(admin.join(dir)).unwrap();
    }
    std::fs::write(admin.join("status"), "").unwrap();
    // The clean root has no libc6 or fuse3 package: the dependencies are the host's.
    let out = Command::new("dpkg")
        .arg(format!("--root={}", root.display()))
        .args(["--install", "--force-depends"])
        .arg(deb)
        .output()
        .unwrap();
    assert!(out.status.success(), "dpkg --install: {out:?}");
    true
}

#[test]
fn cargo_deb_builds_a_package_that_installs_and_runs() {
    if !has("cargo-deb", "--version") {
        eprintln!("skipped: cargo-deb is not installed (`cargo install cargo-deb`; .ci/run does)");
        return;
    }
    // The debug binary `cargo test` has just built: a release build of the workspace would
    // add ~6 minutes to CI on two cores. What is packaged around it is the same.
    let build = Command::new(repo().join("packaging/build-deb"))
        .current_dir(repo())
        .env("MESHFS_DEB_PROFILE", "dev")
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&build.stderr).to_string()
        + &String::from_utf8_lossy(&build.stdout);
    assert!(build.status.success(), "{log}");
    let deb = log
        .split_whitespace()
        .rev()
        .find(|w| w.ends_with(".deb"))
        .map(PathBuf::from)
        .unwrap_or_else(|| panic!("no .deb named in:\n{log}"));
    let deb = if deb.is_absolute() {
        deb
    } else {
        repo().join(deb)
    };
    let out = Command::new("dpkg-deb")
        .arg("-c")
        .arg(&deb)
        .output()
        .unwrap();
    assert!(out.status.success());
    let listing = String::from_utf8_lossy(&out.stdout);
    for path in [
        "usr/bin/meshfs",
        "usr/lib/systemd/user/meshfs.service",
        "usr/lib/systemd/system/meshfs@.service",
        "usr/share/bash-completion/completions/meshfs",
        "usr/share/zsh/vendor-completions/_meshfs",
        "usr/share/fish/vendor_completions.d/meshfs.fish",
        "usr/share/man/man1/meshfs.1.gz",
        "usr/share/man/man1/meshfs-status.1.gz",
        "usr/share/doc/meshfs/examples/no-mount.conf",
    ] {
        // cargo-deb 3 writes `./usr/...` into the archive, 2.0 (.ci/run's wheel) `usr/...`.
        assert!(
            listing
                .lines()
                .any(|l| l.ends_with(&format!(" {path}")) || l.ends_with(&format!(" ./{path}"))),
            "{path} in:\n{listing}"
        );
    }
    let depends = Command::new("dpkg-deb")
        .args(["-f"])
        .arg(&deb)
        .arg("Depends")
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&depends.stdout).contains("fuse3"));
    // Installed by dpkg into a clean directory root (no container needed), it runs.
    let t = tmp();
    let root = t.path().join("root");
    let installed = install_into(&root, &deb);
    let v = Command::new(root.join("usr/bin/meshfs"))
        .arg("--version")
        .output()
        .unwrap();
    assert!(v.status.success());
    assert!(String::from_utf8_lossy(&v.stdout).starts_with("meshfs "));
    if installed {
        let dpkg = |args: &[&str]| {
            let out = Command::new("dpkg")
                .arg(format!("--root={}", root.display()))
                .args(args)
                .output()
                .unwrap();
            assert!(out.status.success(), "dpkg {args:?}: {out:?}");
            String::from_utf8_lossy(&out.stdout).to_string()
        };
        assert!(dpkg(&["-s", "meshfs"]).contains("Status: install ok installed"));
        let files = dpkg(&["-L", "meshfs"]);
        for path in ["/usr/bin/meshfs", "/usr/lib/systemd/user/meshfs.service"] {
            assert!(files.lines().any(|l| l == path), "{path} in:\n{files}");
        }
        // One paragraph, wrapped by cargo-deb, not broken where Cargo.toml's lines end.
        let description = dpkg(&["-s", "meshfs"]);
        assert!(
            description.contains(" between peers, every change journaled,"),
            "{description}"
        );
        // And it uninstalls cleanly.
        dpkg(&["--remove", "meshfs"]);
        assert!(!root.join("usr/bin/meshfs").exists());
        assert!(!root.join("usr/lib/systemd/user/meshfs.service").exists());
        dpkg(&["--install", "--force-depends", deb.to_str().unwrap()]);
    }
    // Stripped: a fraction of the size of a binary with debug info.
    let size = std::fs::metadata(root.join("usr/bin/meshfs"))
        .unwrap()
        .len();
    assert!(size < 40 << 20, "{size} bytes");
}
