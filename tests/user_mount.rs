//! The laptop case: meshfs run by an ordinary user (created for the test), mounting through
//! fusermount3 as Debian ships it (`/dev/fuse` 0666). The user mounts, works in the folder
//! (files, `git`), reads the journal and unmounts; the user service mounts its folders at start
//! and unmounts them at stop; a daemon killed again and again mounts again within 2 s and
//! loses nothing a program was told was written; with no_new_privs the mount fails, saying why.

use crate::common;
use common::user::TestUser;
use common::*;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

/// A device whose home, replica and mount point belong to `user`, whose daemon runs as it.
fn user_device(
    t: &std::sync::Arc<tempfile::TempDir>,
    user: &TestUser,
    name: &str,
) -> (Device, PathBuf) {
    let mut d = Device::new(t, name);
    let base = d.home.parent().unwrap().to_path_buf();
    let mnt = base.join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    user.own(&base, t.path());
    d.under = user.under();
    d.cli_under = user.under();
    (d, mnt)
}

/// `meshfs --home HOME ARGS` as `user`.
fn cli(user: &TestUser, d: &Device, args: &[&str]) -> Output {
    user.command(bin())
        .arg("--home")
        .arg(&d.home)
        .args(args)
        .output()
        .unwrap()
}

fn cli_ok(user: &TestUser, d: &Device, args: &[&str]) -> String {
    let out = cli(user, d, args);
    assert!(
        out.status.success(),
        "meshfs {args:?} as {}: {}{}",
        user.name,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `sh -c SCRIPT` as `user` in `dir` (entered as the user: root may not enter a user's mount).
fn sh(user: &TestUser, dir: &Path, script: &str) -> Output {
    user.command("sh")
        .arg("-c")
        .arg(format!("cd \"$0\" && {script}"))
        .arg(dir)
        .output()
        .unwrap()
}

fn sh_ok(user: &TestUser, dir: &Path, script: &str) -> String {
    let out = sh(user, dir, script);
    assert!(
        out.status.success(),
        "{script}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The mount options of the FUSE mount at `mnt`, if one is there.
fn mounted(mnt: &Path) -> Option<String> {
    let want = mnt.to_str().unwrap();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .find(|l| l.split(' ').nth(4) == Some(want) && l.contains(" - fuse.meshfs "))
        .map(str::to_string)
}

/// Whether the daemon started last has mounted its folder (its log, new at each start, says
/// so once the mount is up; root cannot ask the user's mount itself).
fn mounted_by_this_start(d: &Device, mnt: &Path) -> bool {
    d.log().contains("folder mounted") && mounted(mnt).is_some()
}

fn journaled(user: &TestUser, d: &Device) -> Vec<String> {
    cli_ok(user, d, &["journal", "work", "--json"])
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["path"].as_str().unwrap().to_string()
        })
        .collect()
}

/// Waits until `files` files are journaled in `work`.
fn wait_files(d: &Device, files: u64, secs: u64) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while d.status()["folders"][0]["files"].as_u64() != Some(files) {
        assert!(Instant::now() < deadline, "{}\n{}", d.status(), d.log());
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn an_ordinary_user_mounts_through_fusermount3_works_in_the_folder_with_git_and_unmounts() {
    let t = tmp();
    let user = TestUser::new();
    let (mut d, mnt) = user_device(&t, &user, "laptop");
    d.start();
    let line = cli_ok(&user, &d, &["mount", "work", mnt.to_str().unwrap()]);
    // The truth about the mount: no passthrough without CAP_SYS_ADMIN, and why.
    assert!(
        line.contains("kernel passthrough off: registering backing files needs CAP_SYS_ADMIN"),
        "{line}"
    );
    let info = mounted(&mnt).expect("mounted");
    assert!(info.contains(&format!("user_id={}", user.uid)), "{info}");
    let st: serde_json::Value =
        serde_json::from_str(&cli_ok(&user, &d, &["status", "--json"])).unwrap();
    let m = &st["folders"][0]["mount"];
    assert_eq!(m["passthrough"], false, "{m}");
    assert_eq!(m["passthrough_off"]["code"], "needs_cap_sys_admin", "{m}");
    assert_eq!(m["allow_other"], false, "{m}");
    let text = cli_ok(&user, &d, &["status"]);
    assert!(
        text.contains("kernel passthrough off: registering backing files needs CAP_SYS_ADMIN"),
        "{text}"
    );

    // Files, then git, as the user inside the mount.
    sh_ok(&user, &mnt, "printf 'written by the user\\n' > notes.txt && mkdir -p src && printf 'fn main() {}\\n' > src/main.rs");
    assert_eq!(sh_ok(&user, &mnt, "cat notes.txt"), "written by the user\n");
    let g = "git -c user.name=u -c user.email=u@example.invalid -c init.defaultBranch=main";
    sh_ok(
        &user,
        &mnt,
        &format!("{g} init -q && {g} add -A && {g} commit -qm first"),
    );
    assert_eq!(sh_ok(&user, &mnt, &format!("{g} status --porcelain")), "");
    sh_ok(&user, &mnt, "printf 'changed\\n' >> notes.txt");
    assert_eq!(
        sh_ok(&user, &mnt, &format!("{g} status --porcelain")),
        " M notes.txt\n"
    );
    assert!(sh_ok(&user, &mnt, &format!("{g} log --oneline")).contains("first"));
    // Nobody else gets in (no allow_other), root included.
    assert_eq!(
        std::fs::read_dir(&mnt)
            .map(|_| ())
            .unwrap_err()
            .raw_os_error(),
        Some(libc::EACCES)
    );

    // The journal has it all, read by the user.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let paths = journaled(&user, &d);
        if ["notes.txt", "src/main.rs", ".git/HEAD"]
            .iter()
            .all(|p| paths.iter().any(|q| q == p))
        {
            break;
        }
        assert!(Instant::now() < deadline, "{paths:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    cli_ok(&user, &d, &["unmount", "work"]);
    assert!(mounted(&mnt).is_none());
    assert_eq!(
        std::fs::read_to_string(d.path("notes.txt")).unwrap(),
        "written by the user\nchanged\n"
    );
    // Other users are let in only where /etc/fuse.conf says so, and the error says where.
    // (.ci/pjdfstest, beside the tests, adds `user_allow_other` for a moment: the attempt is
    // judged against the file as it was before and after it.)
    let read_conf = || std::fs::read_to_string("/etc/fuse.conf").unwrap_or_default();
    let (conf, out) = loop {
        let before = read_conf();
        let out = cli(
            &user,
            &d,
            &["mount", "work", mnt.to_str().unwrap(), "--allow-other"],
        );
        if read_conf() == before {
            break (before, out);
        }
        if mounted(&mnt).is_some() {
            cli_ok(&user, &d, &["unmount", "work"]);
        }
    };
    if meshfs_fuse_allows_other(&conf) {
        assert!(out.status.success(), "{out:?}");
    } else {
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(
            err.contains("user_allow_other") && err.contains("/etc/fuse.conf"),
            "{err}"
        );
        assert!(mounted(&mnt).is_none());
    }
    d.stop();
    assert!(mounted(&mnt).is_none());
}

/// Why neither unit sets `NoNewPrivileges=` (nor a seccomp option, which implies it for a
/// service run as a user): with `no_new_privs` the setuid helper fusermount3 runs without its
/// privileges, and an ordinary user cannot mount. The daemon says so, naming the setting;
/// everything but the mount goes on (`packaging/no-mount.conf` is for devices that never
/// mount).
#[test]
fn with_no_new_privs_an_ordinary_users_mount_fails_and_the_daemon_says_why() {
    let t = tmp();
    let user = TestUser::new();
    let (mut d, mnt) = user_device(&t, &user, "laptop");
    let mut under = user.under();
    under.insert(under.len() - 1, "--no-new-privs".into());
    d.under = under;
    d.start();
    let out = cli(&user, &d, &["mount", "work", mnt.to_str().unwrap()]);
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "mounted with no_new_privs: {said}");
    assert!(mounted(&mnt).is_none());
    assert!(
        said.contains("no_new_privs") && said.contains("NoNewPrivileges="),
        "{said}"
    );
    // The rest goes on.
    write(&d.path("after.txt"), b"still recorded");
    wait_files(&d, 1, 30);
    d.stop();
}

/// fuse.conf's `user_allow_other`, read as the mount reads it.
fn meshfs_fuse_allows_other(conf: &str) -> bool {
    conf.lines()
        .any(|l| l.split('#').next().unwrap_or("").trim() == "user_allow_other")
}

/// A datagram from the notify socket; a signal meant for another test of this binary can
/// interrupt the wait, which then goes on.
fn recv(l: &std::os::unix::net::UnixDatagram, buf: &mut [u8]) -> std::io::Result<usize> {
    loop {
        match l.recv(buf) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            r => return r,
        }
    }
}

/// The values of `key` in a systemd unit's text.
fn unit_values<'a>(unit: &'a str, key: &str) -> Vec<&'a str> {
    unit.lines()
        .filter_map(|l| l.strip_prefix(key)?.strip_prefix('='))
        .collect()
}

#[test]
fn the_user_service_mounts_its_folders_at_start_and_unmounts_them_at_stop() {
    // What `systemctl --user start meshfs` runs (systemd is not PID 1 here): the unit's
    // ExecStartPre, then ExecStart under its UMask with a notify socket, and SIGTERM to stop.
    let unit = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/meshfs.service"),
    )
    .unwrap();
    assert_eq!(
        unit_values(&unit, "ExecStartPre"),
        ["/usr/bin/meshfs config check"]
    );
    assert_eq!(unit_values(&unit, "ExecStart"), ["/usr/bin/meshfs daemon"]);
    assert_eq!(
        unit_values(&unit, "KillSignal"),
        Vec::<&str>::new(),
        "SIGTERM stops it"
    );
    let umask = unit_values(&unit, "UMask")[0];

    let t = tmp();
    let user = TestUser::new();
    let (d, mnt) = user_device(&t, &user, "laptop");
    let config = d.home.join("config.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    let text = text.replacen(
        "watch = true",
        &format!("watch = true\nmount = \"{}\"", mnt.display()),
        1,
    );
    std::fs::write(&config, text).unwrap();
    write(&d.path("before.txt"), b"there before the start");
    user.own(d.home.parent().unwrap(), t.path());
    for cmd in unit_values(&unit, "ExecStartPre") {
        let args: Vec<&str> = cmd.split_whitespace().skip(1).collect();
        cli_ok(&user, &d, &args);
    }

    let socket = t.path().join("notify.sock");
    let listener = std::os::unix::net::UnixDatagram::bind(&socket).unwrap();
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o777)).unwrap();
    listener
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    // The unit's UMask, set before the user is taken on (setpriv passes it on). Not through
    // `sh -c 'umask …; exec meshfs'`: the user's shell could not reach a binary below a 0700
    // directory (a fresh clone made by `mktemp -d`), which setpriv, still root when it execs,
    // can.
    let umask = u32::from_str_radix(umask.trim(), 8).expect("the unit's UMask is octal");
    let mut daemon = user.command(bin());
    // SAFETY: umask is async-signal-safe and touches no memory of the parent.
    unsafe {
        daemon.pre_exec(move || {
            libc::umask(umask as libc::mode_t);
            Ok(())
        });
    }
    let mut child = daemon
        .arg("--home")
        .arg(&d.home)
        .arg("daemon")
        .env("NOTIFY_SOCKET", &socket)
        .stderr(std::fs::File::create(t.path().join("daemon.log")).unwrap())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut buf = [0u8; 256];
    let n = recv(&listener, &mut buf).unwrap_or_else(|e| {
        let _ = child.kill();
        panic!(
            "READY=1 within 30 s: {e}; the daemon's log:\n{}",
            std::fs::read_to_string(t.path().join("daemon.log")).unwrap_or_default()
        )
    });
    assert!(
        String::from_utf8_lossy(&buf[..n])
            .lines()
            .any(|l| l == "READY=1"),
        "{}",
        String::from_utf8_lossy(&buf[..n])
    );
    // Ready means mounted, by the user, through fusermount3.
    let info = mounted(&mnt).expect("mounted at READY=1");
    assert!(info.contains(&format!("user_id={}", user.uid)), "{info}");
    assert_eq!(
        sh_ok(
            &user,
            &mnt,
            "cat before.txt && printf 'through the mount' > after.txt"
        ),
        "there before the start"
    );
    // SAFETY: kill takes two integers and touches no memory; the child was not waited for.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let n = recv(&listener, &mut buf).expect("STOPPING=1");
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
    assert!(mounted(&mnt).is_none(), "still mounted after the stop");
    assert_eq!(
        std::fs::read_to_string(d.path("after.txt")).unwrap(),
        "through the mount"
    );
}

#[test]
fn a_user_daemon_killed_again_and_again_mounts_again_within_2_s_and_loses_nothing_acknowledged() {
    let t = tmp();
    let user = TestUser::new();
    let (mut d, mnt) = user_device(&t, &user, "laptop");
    let config = d.home.join("config.toml");
    let text = std::fs::read_to_string(&config).unwrap().replacen(
        "watch = true",
        &format!("watch = true\nmount = \"{}\"", mnt.display()),
        1,
    );
    std::fs::write(&config, text).unwrap();
    let base = d.home.parent().unwrap().to_path_buf();
    user.own(&base, t.path());

    // A program writing through the mount: a file is acknowledged once dd's fsync and close
    // returned (exit 0); a failure (the daemon gone) is retried with the same file.
    // It writes into a directory of the folder, as programs do: in the few milliseconds
    // between the restart's detaching of the dead mount and the new mount, `mnt/w` does not
    // exist, where a file written straight into `mnt` would land in the bare mount point (and
    // the next start would refuse to mount over it: not empty).
    std::fs::create_dir(d.path("w")).unwrap();
    user.own(&d.path("w"), t.path());
    let mut writer = None;
    let mut times = Vec::new();
    for round in 0..8 {
        let t0 = Instant::now();
        d.start_detached();
        while !mounted_by_this_start(&d, &mnt) {
            assert!(
                t0.elapsed() < Duration::from_secs(2),
                "round {round}: not mounted again 2 s after the restart\n{}",
                d.log()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        times.push(t0.elapsed());
        writer.get_or_insert_with(|| {
            user.command("sh")
                .arg("-c")
                .arg(
                    "cd \"$0\"; i=1; while [ ! -e stop ]; do \
                       if printf 'file %s\\n' $i | dd of=mnt/w/f$i conv=fsync status=none 2>/dev/null; \
                       then echo $i >> acked; i=$((i+1)); else sleep 0.01; fi; \
                     done",
                )
                .arg(&base)
                .spawn()
                .unwrap()
        });
        // Let the writer get some files through this mount, then kill the daemon under it.
        let acked = |b: &Path| {
            std::fs::read_to_string(b.join("acked"))
                .unwrap_or_default()
                .lines()
                .count()
        };
        let before = acked(&base);
        let deadline = Instant::now() + Duration::from_secs(20);
        while acked(&base) < before + 5 {
            assert!(
                Instant::now() < deadline,
                "the writer is stuck\n{}",
                d.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        d.kill();
    }
    eprintln!(
        "mounted again after each restart in: {:?}",
        times
            .iter()
            .map(|t| format!("{:.0} ms", t.as_secs_f64() * 1000.0))
            .collect::<Vec<_>>()
    );
    d.start();
    let t0 = Instant::now();
    while !mounted_by_this_start(&d, &mnt) {
        assert!(t0.elapsed() < Duration::from_secs(2), "{}", d.log());
        std::thread::sleep(Duration::from_millis(5));
    }
    std::fs::write(base.join("stop"), b"").unwrap();
    assert!(writer.unwrap().wait().unwrap().success());
    // Every acknowledged file is there, whole, and journaled.
    let acked: Vec<u64> = std::fs::read_to_string(base.join("acked"))
        .unwrap()
        .lines()
        .map(|l| l.parse().unwrap())
        .collect();
    assert!(acked.len() >= 40, "{} files acknowledged", acked.len());
    for i in &acked {
        assert_eq!(
            std::fs::read_to_string(d.path(&format!("w/f{i}"))).unwrap(),
            format!("file {i}\n"),
            "f{i}"
        );
    }
    let on_disk = std::fs::read_dir(d.path("w")).unwrap().count() as u64;
    wait_files(&d, on_disk, 30);
    let paths = journaled(&user, &d);
    for i in &acked {
        assert!(paths.contains(&format!("w/f{i}")), "w/f{i} not journaled");
    }
    d.stop();
    assert!(mounted(&mnt).is_none());
}
