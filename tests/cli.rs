//! The CLI contract for a user at a terminal: init/id, refusals that change nothing, clear
//! errors with meaningful exit codes (0 ok, 1 error, 2 bad arguments, 3 no daemon, 4 timed
//! out), and a config that can be edited by hand as docs/config.md shows.

use crate::common;
use common::*;

fn fails(home: &std::path::Path, args: &[&str]) -> (i32, String) {
    let out = meshfs(home, args);
    assert!(!out.status.success(), "meshfs {args:?} should fail");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

#[test]
fn init_then_id_works_and_a_second_init_changes_nothing() {
    let t = tmp();
    let home = t.path().join("x");
    let printed = ok(
        &home,
        &["init", "--name", "x", "--listen", "127.0.0.1:7788"],
    );
    let id = ok(&home, &["id"]);
    assert_eq!(printed.trim(), id.trim());
    assert!(id.trim().parse::<meshfs_protocol::DeviceId>().is_ok());
    let key = home.join("state/key.der");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&key).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let before = (
        std::fs::read(&key).unwrap(),
        std::fs::read(home.join("config.toml")).unwrap(),
    );
    let (code, err) = fails(&home, &["init", "--name", "other"]);
    assert_eq!(code, 1);
    assert!(
        err.contains("already initialised") && err.contains("refusing to overwrite"),
        "{err}"
    );
    assert_eq!(
        before,
        (
            std::fs::read(&key).unwrap(),
            std::fs::read(home.join("config.toml")).unwrap()
        )
    );
    assert_eq!(ok(&home, &["id"]), id);
}

#[test]
fn a_mistyped_device_id_is_refused_with_the_position_of_the_typo() {
    let t = tmp();
    let a = Device::new(&t, "a");
    let b = Device::new(&t, "b");
    let mut typo: Vec<char> = b.id.chars().collect();
    typo[9] = if typo[9] == 'A' { 'B' } else { 'A' };
    let typo: String = typo.into_iter().collect();
    // A bad argument: exit 2, as docs/cli.md promises.
    let (code, err) = fails(&a.home, &["peer", "add", &typo, "--addr", &b.addr]);
    assert_eq!(code, 2);
    assert!(
        err.contains("mistyped") && err.contains("characters 1-14"),
        "{err}"
    );
    assert!(
        ok(&a.home, &["peer", "list", "--json"]).trim() == "[]",
        "nothing was added"
    );
    let (_, err) = fails(&a.home, &["peer", "add", &a.id, "--addr", &b.addr]);
    assert!(err.contains("own id"), "{err}");
    let (code, err) = fails(&a.home, &["peer", "add", &b.id, "--addr", "nope"]);
    assert!(err.contains("HOST:PORT"), "{err}");
    assert_eq!(code, 2);
}

#[test]
fn commands_that_need_the_daemon_say_it_is_not_running_and_unknown_folders_are_named() {
    let t = tmp();
    let a = Device::new(&t, "a");
    let (code, err) = fails(&a.home, &["status"]);
    assert_eq!(code, 3);
    assert!(err.contains("no daemon is running"), "{err}");
    let (_, err) = fails(&a.home, &["journal", "nope"]);
    assert!(err.contains("no folder \"nope\""), "{err}");
    let (_, err) = fails(&a.home, &["share", "nope", &a.id]);
    assert!(err.contains("no folder \"nope\""), "{err}");
    let (_, err) = fails(&t.path().join("empty"), &["id"]);
    assert!(err.contains("meshfs init"), "{err}");
    let listed: serde_json::Value =
        serde_json::from_str(&ok(&a.home, &["folder", "list", "--json"])).unwrap();
    assert_eq!(listed[0]["id"], "work");
}

#[test]
fn a_command_whose_reader_has_gone_ends_quietly_and_the_daemon_keeps_serving() {
    use std::os::unix::process::ExitStatusExt;
    let t = tmp();
    let mut a = Device::new(&t, "a");
    a.start();
    // `meshfs journal | head -1`: the reader is gone before the command writes. Before, the
    // command's next `print!` panicked (exit 101, a panic message and, with RUST_BACKTRACE
    // set, a backtrace symbolized on the spot).
    for args in [
        &["completions", "bash"][..],
        &["status", "--json"],
        &["folder", "list", "--json"],
        &["journal", "work"],
    ] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = std::process::Command::new(bin())
            .arg("--home")
            .arg(&a.home)
            .args(args)
            .stdout(writer)
            .output()
            .unwrap();
        assert_eq!(
            out.status.signal(),
            Some(libc::SIGPIPE),
            "meshfs {args:?}: {:?}, {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.stderr.is_empty(),
            "meshfs {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // The daemon writes to sockets: SIGPIPE never ends it.
    let st: serde_json::Value = serde_json::from_str(&ok(&a.home, &["status", "--json"])).unwrap();
    assert!(st["folders"].is_array(), "{st}");
}

#[test]
fn a_port_in_use_is_reported_with_the_field_to_change() {
    let t = tmp();
    let mut a = Device::new(&t, "a");
    a.start();
    // A second device configured on the same address cannot start.
    let home = t.path().join("clash");
    ok(
        &home,
        &[
            "init",
            "--name",
            "clash",
            "--listen",
            &a.addr,
            "--no-discovery",
        ],
    );
    let out = std::process::Command::new(bin())
        .arg("--home")
        .arg(&home)
        .arg("daemon")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("device.listen") && err.contains("in use"),
        "{err}"
    );
}

/// Every file and directory under `root`, for proving that a refused command created nothing.
fn listing(root: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            }
            out.push(e.path());
        }
    }
    out.sort();
    out
}

#[test]
fn folder_add_refuses_meshfs_own_directories_files_and_nesting_and_a_refusal_creates_nothing() {
    let t = tmp();
    let home = t.path().join("home");
    ok(
        &home,
        &["init", "--name", "x", "--listen", "127.0.0.1:7788"],
    );
    let work = t.path().join("work");
    ok(
        &home,
        &["folder", "add", work.to_str().unwrap(), "--id", "work"],
    );
    std::fs::write(t.path().join("notes.txt"), b"a file").unwrap();
    let config = std::fs::read(home.join("config.toml")).unwrap();
    let before = listing(t.path());
    let own = [
        home.clone(),
        home.join("state"),
        home.join("files"),
        home.join("state/new/deeper"),
        t.path().to_path_buf(),
    ];
    for p in &own {
        let (code, err) = fails(&home, &["folder", "add", p.to_str().unwrap()]);
        assert_eq!(code, 1);
        assert!(err.contains("meshfs's own directory"), "{p:?}: {err}");
    }
    // Through a symlink too.
    std::os::unix::fs::symlink(&home, t.path().join("link")).unwrap();
    let (_, err) = fails(
        &home,
        &["folder", "add", t.path().join("link/sub").to_str().unwrap()],
    );
    assert!(err.contains("meshfs's own directory"), "{err}");
    std::fs::remove_file(t.path().join("link")).unwrap();

    let (code, err) = fails(
        &home,
        &["folder", "add", work.join("a/b/c").to_str().unwrap()],
    );
    assert_eq!(code, 1);
    assert!(
        err.contains("overlaps folder \"work\"") && err.contains("must not nest"),
        "{err}"
    );
    let file = t.path().join("notes.txt");
    let (code, err) = fails(&home, &["folder", "add", file.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("is a file, not a directory"), "{err}");
    assert!(!err.contains("os error"), "{err}");
    let (_, err) = fails(
        &home,
        &["folder", "add", file.join("sub").to_str().unwrap()],
    );
    assert!(err.contains("is not a directory"), "{err}");
    let (_, err) = fails(
        &home,
        &[
            "folder",
            "add",
            t.path().join("new/dir").to_str().unwrap(),
            "--id",
            "work",
        ],
    );
    assert!(err.contains("already exists"), "{err}");

    assert_eq!(
        listing(t.path()),
        before,
        "a refused folder add created nothing"
    );
    assert_eq!(std::fs::read(home.join("config.toml")).unwrap(), config);
    // And an accepted one creates the whole missing path.
    let fresh = t.path().join("new/dir");
    assert_eq!(
        ok(
            &home,
            &["folder", "add", fresh.to_str().unwrap(), "--id", "new"]
        )
        .trim(),
        "new"
    );
    assert!(fresh.is_dir());
}

#[test]
fn bad_arguments_exit_2_and_change_nothing() {
    let t = tmp();
    let home = t.path().join("h");
    let (code, err) = fails(&home, &["init", "--listen", "nope"]);
    assert_eq!(code, 2);
    assert!(err.contains("HOST:PORT"), "{err}");
    assert!(!home.exists(), "a refused init created nothing");
    ok(
        &home,
        &["init", "--name", "h", "--listen", "127.0.0.1:7788"],
    );
    let config = std::fs::read(home.join("config.toml")).unwrap();
    let cases: [&[&str]; 6] = [
        &["--log-level", "bogus", "id"],
        &["peer", "remove", "not-a-device-id"],
        &["share", "work", "ABCDEFG"],
        &["folder", "add", "/tmp/x", "--id", "no/slash"],
        &["scan", "bad id"],
        &["status", "--connected"],
    ];
    for args in cases {
        let (code, err) = fails(&home, args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains("--help"), "{args:?}: {err}");
    }
    let (_, err) = fails(&home, &["--log-level", "bogus", "id"]);
    assert!(
        err.contains("possible values: error, warn, info, debug, trace"),
        "{err}"
    );
    assert_eq!(std::fs::read(home.join("config.toml")).unwrap(), config);
    // A known level is accepted.
    ok(&home, &["--log-level", "debug", "id"]);
}

#[test]
fn init_writes_a_config_that_takes_the_folder_table_appended_as_docs_config_md_shows() {
    let t = tmp();
    let home = t.path().join("h");
    ok(
        &home,
        &["init", "--name", "h", "--listen", "127.0.0.1:7788"],
    );
    let dir = t.path().join("work");
    std::fs::create_dir(&dir).unwrap();
    let mut text = std::fs::read_to_string(home.join("config.toml")).unwrap();
    assert!(!text.contains("folder = []"), "{text}");
    text.push_str(&format!(
        "\n[[folder]]\nid = \"work\"\npath = \"{}\"\nwatch = true\n",
        dir.display()
    ));
    std::fs::write(home.join("config.toml"), text).unwrap();
    let listed: serde_json::Value =
        serde_json::from_str(&ok(&home, &["folder", "list", "--json"])).unwrap();
    assert_eq!(listed[0]["id"], "work");
    assert_eq!(listed[0]["path"], dir.to_str().unwrap());
    let checked = ok(&home, &["config", "check"]);
    assert!(
        checked.contains("ok") && checked.contains("1 folder(s)"),
        "{checked}"
    );
}

#[test]
fn config_check_names_the_file_and_field_at_fault() {
    let t = tmp();
    let home = t.path().join("h");
    ok(
        &home,
        &["init", "--name", "h", "--listen", "127.0.0.1:7788"],
    );
    let dir = t.path().join("work");
    ok(
        &home,
        &["folder", "add", dir.to_str().unwrap(), "--id", "work"],
    );
    let good = std::fs::read_to_string(home.join("config.toml")).unwrap();
    let cfg = home.join("config.toml");
    let cases = [
        (good.replace("127.0.0.1:7788", "localhost"), "device.listen"),
        (
            good.replace("coalesce_ms", "coalesce"),
            "unknown field `coalesce`",
        ),
        (
            format!("{good}\n[[folder]]\nid = \"work\"\npath = \"/srv/other\"\n"),
            "folder[1].id",
        ),
        (
            format!(
                "{good}\n[[folder]]\nid = \"in\"\npath = \"{}/sub\"\n",
                dir.display()
            ),
            "folder[1].path",
        ),
        (
            format!(
                "{good}\n[[folder]]\nid = \"own\"\npath = \"{}/x\"\n",
                home.display()
            ),
            "meshfs's own directory",
        ),
    ];
    for (text, field) in cases {
        std::fs::write(&cfg, &text).unwrap();
        let (code, err) = fails(&home, &["config", "check"]);
        assert_eq!(code, 1);
        assert!(
            err.contains(cfg.to_str().unwrap()) && err.contains(field),
            "{field}: {err}"
        );
    }
    std::fs::write(&cfg, &good).unwrap();
    ok(&home, &["config", "check"]);
    // A folder path that vanished.
    std::fs::remove_dir(&dir).unwrap();
    let (code, err) = fails(&home, &["config", "check"]);
    assert_eq!(code, 1);
    assert!(
        err.contains("folder[0].path") && err.contains("folder remove work"),
        "{err}"
    );
}

#[test]
fn status_on_a_home_that_was_never_initialised_says_to_run_init() {
    let t = tmp();
    let home = t.path().join("never");
    for args in [
        &["status"][..],
        &["status", "--wait-synced", "--timeout", "30"],
    ] {
        let started = std::time::Instant::now();
        let (code, err) = fails(&home, args);
        assert_eq!(code, 1, "{err}");
        assert!(err.contains("run `meshfs init`"), "{err}");
        assert!(!err.contains("start the daemon"), "{err}");
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "it does not wait"
        );
    }
    assert!(!home.exists());
}

#[test]
fn the_daemon_answers_an_unknown_control_op_with_an_error_and_keeps_serving() {
    use std::io::{BufRead, BufReader, Write};
    let t = tmp();
    let mut a = Device::new(&t, "a");
    a.start();
    let sock = std::os::unix::net::UnixStream::connect(a.home.join("state/control.sock")).unwrap();
    let mut w = sock.try_clone().unwrap();
    let mut r = BufReader::new(sock);
    let mut ask = |line: &str| -> serde_json::Value {
        w.write_all(format!("{line}\n").as_bytes()).unwrap();
        let mut reply = String::new();
        r.read_line(&mut reply).unwrap();
        serde_json::from_str(&reply).unwrap()
    };
    let reply = ask(r#"{"op":"frobnicate"}"#);
    assert_eq!(reply["ok"], false);
    assert!(
        reply["error"]
            .as_str()
            .unwrap()
            .contains("unknown op \"frobnicate\""),
        "{reply}"
    );
    // The same connection still answers.
    let status = ask(r#"{"op":"status"}"#);
    assert_eq!(status["folders"][0]["id"], "work", "{status}");
    a.stop();
}

#[test]
fn journal_since_takes_ages_yesterday_and_iso_dates_and_refuses_anything_else() {
    let t = tmp();
    let mut a = Device::new(&t, "a");
    a.start();
    write(&a.path("today.txt"), b"made now");
    ok(&a.home, &["scan", "work"]);
    a.stop();
    let paths = |since: &str| -> Vec<String> {
        a.journal(&["--since", since])
            .iter()
            .map(|e| e["path"].as_str().unwrap().to_string())
            .collect()
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    // The test's clock and time zone: the dates of yesterday, today and tomorrow here.
    let date = |secs: u64| {
        let out = std::process::Command::new("date")
            .args(["-d", &format!("@{secs}"), "+%Y-%m-%d"])
            .output()
            .unwrap();
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    };
    let (today, tomorrow) = (date(now), date(now + 86_400));
    for since in ["10m", "2h", "yesterday", "today", today.as_str(), "0"] {
        assert!(
            paths(since).contains(&"today.txt".to_string()),
            "--since {since}"
        );
    }
    assert!(paths(&tomorrow).is_empty(), "--since {tomorrow}");
    assert!(paths(&format!("{tomorrow} 00:00")).is_empty());
    let (code, err) = fails(&a.home, &["journal", "work", "--since", "last tuesday"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("yesterday") && err.contains("2026-11-22"),
        "{err}"
    );
}

#[test]
fn a_second_daemon_on_the_same_home_is_refused_and_the_first_keeps_running() {
    let t = tmp();
    let mut a = Device::new(&t, "a");
    a.start();
    let out = std::process::Command::new(bin())
        .arg("--home")
        .arg(&a.home)
        .arg("daemon")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("already running for") && err.contains("stop it first"),
        "{err}"
    );
    // The first one still answers, on the socket the second did not take over.
    assert_eq!(a.status()["folders"][0]["id"], "work");
    a.stop();
}

#[test]
fn folder_remove_stops_syncing_the_folder_and_leaves_its_files_on_disk() {
    let t = tmp();
    let mut a = Device::new(&t, "a");
    write(&a.path("docs/report.txt"), b"kept on disk");
    a.start();
    assert_eq!(a.status()["folders"][0]["id"], "work");
    let staging = a.home.join("state/staging/work");
    assert!(
        staging.is_dir(),
        "the running folder has its staging directory"
    );
    let files = tree(&a.dir);
    let config = std::fs::read(a.home.join("config.toml")).unwrap();

    // The main error path: an unknown folder is named, exit 1, and nothing changes.
    let (code, err) = fails(&a.home, &["folder", "remove", "nope"]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("no folder \"nope\"") && err.contains("meshfs folder list"),
        "{err}"
    );
    assert_eq!(std::fs::read(a.home.join("config.toml")).unwrap(), config);
    assert_eq!(a.status()["folders"][0]["id"], "work");

    assert_eq!(ok(&a.home, &["folder", "remove", "work"]), "");
    // The running daemon let it go at once: no reload, no restart.
    assert_eq!(a.status()["folders"], serde_json::json!([]));
    assert!(ok(&a.home, &["status"]).contains("no folders"));
    assert_eq!(ok(&a.home, &["folder", "list"]), "");
    assert_eq!(ok(&a.home, &["folder", "list", "--json"]).trim(), "[]");
    let (code, err) = fails(&a.home, &["scan", "work"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("no folder \"work\""), "{err}");
    // The user's files are left exactly as they were; only meshfs's staging is gone.
    assert_eq!(tree(&a.dir), files);
    assert_eq!(
        std::fs::read(a.path("docs/report.txt")).unwrap(),
        b"kept on disk"
    );
    assert!(!staging.exists());
    let (code, _) = fails(&a.home, &["folder", "remove", "work"]);
    assert_eq!(code, 1, "a second remove finds nothing to remove");
    a.stop();
}

#[test]
fn peer_list_json_gives_each_field_and_peer_remove_forgets_the_peer_for_a_running_daemon() {
    let t = tmp();
    let mut a = Device::new(&t, "a");
    let mut b = Device::new(&t, "b");
    pair(&a, &b);
    let c = Device::new(&t, "c");
    // A peer found wherever it is (no --addr), sharing nothing.
    ok(&a.home, &["peer", "add", &c.id, "--name", "phone"]);

    let listed: serde_json::Value =
        serde_json::from_str(&ok(&a.home, &["peer", "list", "--json"])).unwrap();
    let peers = listed.as_array().unwrap();
    assert_eq!(peers.len(), 2, "{listed}");
    let pb = &peers[0];
    assert_eq!(pb["device_id"], b.id.as_str());
    assert_eq!(pb["name"], "b");
    assert_eq!(pb["addresses"], serde_json::json!([b.addr.as_str()]));
    assert_eq!(pb["folders"], serde_json::json!(["work"]));
    assert_eq!(pb.as_object().unwrap().len(), 4, "no other field: {pb}");
    let pc = &peers[1];
    assert_eq!(pc["device_id"], c.id.as_str());
    assert_eq!(pc["name"], "phone");
    assert_eq!(pc["addresses"], serde_json::json!(["dynamic"]));
    assert_eq!(pc["folders"], serde_json::json!([]));
    let text = ok(&a.home, &["peer", "list"]);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "{text}");
    let words = |l: &str| l.split_whitespace().map(String::from).collect::<Vec<_>>();
    assert_eq!(words(lines[0]), [&b.id, "b", &b.addr, "work"]);
    assert_eq!(words(lines[1]), [&c.id, "phone", "dynamic"]);
    // Several fixed addresses, and "dynamic" beside them.
    ok(
        &a.home,
        &[
            "peer",
            "add",
            &c.id,
            "--addr",
            "10.0.0.9:7788,dynamic",
            "--addr",
            "c.lan:7788",
        ],
    );
    let listed: serde_json::Value =
        serde_json::from_str(&ok(&a.home, &["peer", "list", "--json"])).unwrap();
    assert_eq!(
        listed[1]["addresses"],
        serde_json::json!(["10.0.0.9:7788", "dynamic", "c.lan:7788"])
    );
    let (code, err) = fails(&a.home, &["peer", "add", &c.id, "--addr", "nowhere"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("or \"dynamic\""), "{err}");

    // The folder's side of the same: who it is shared with.
    let folders: serde_json::Value =
        serde_json::from_str(&ok(&a.home, &["folder", "list", "--json"])).unwrap();
    assert_eq!(
        folders,
        serde_json::json!([{"id": "work", "path": a.dir.to_str().unwrap(), "watch": true,
                            "on_demand": false, "on_demand_under": [], "cache_max": null,
                            "shared_with": [b.id.as_str()]}])
    );
    // A subtree on demand is a path in the folder, never outside it nor the folder itself.
    for bad in ["../up", "."] {
        let (code, err) = fails(
            &a.home,
            &["folder", "set", "work", "--on-demand-under", bad],
        );
        assert_eq!(code, 2, "{bad}: {err}");
    }
    assert_eq!(
        words(&ok(&a.home, &["folder", "list"])),
        [
            "work",
            a.dir.to_str().unwrap(),
            "(shared",
            "with",
            "1",
            "peer)"
        ]
    );

    Device::start_together(&mut [&mut a, &mut b]);
    wait_synced(&[&a, &b], 30);
    // The main error path: a peer that is not known, exit 1, nothing changes.
    let config = std::fs::read(a.home.join("config.toml")).unwrap();
    let unknown = Device::new(&t, "d").id.clone();
    let (code, err) = fails(&a.home, &["peer", "remove", &unknown]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains(&format!("no peer {unknown}")) && err.contains("meshfs peer list"),
        "{err}"
    );
    assert_eq!(std::fs::read(a.home.join("config.toml")).unwrap(), config);

    assert_eq!(ok(&a.home, &["peer", "remove", &b.id]), "");
    let listed: serde_json::Value =
        serde_json::from_str(&ok(&a.home, &["peer", "list", "--json"])).unwrap();
    assert_eq!(listed.as_array().unwrap().len(), 1);
    assert_eq!(listed[0]["device_id"], c.id.as_str());
    // The running daemon dropped it: no longer a peer of the folder, and b, which still
    // dials, is refused as an unknown device. Once a has dropped it, b is restarted so that it
    // dials at once: the link a closed leaves b waiting out its redial backoff otherwise.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut restarted = false;
    loop {
        let s = a.status();
        let gone = s["peers"].as_array().unwrap().len() == 1
            && s["folders"][0]["peers"] == serde_json::json!([]);
        let refused = s["refused_devices"]
            .as_array()
            .unwrap()
            .iter()
            .any(|d| d == b.id.as_str());
        if gone && refused {
            break;
        }
        if gone && !restarted {
            b.stop();
            b.start();
            restarted = true;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "b was not refused after peer remove: {s}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    a.stop();
    b.stop();
}

/// Runs `meshfs demo` (under `under`, a command prefix; empty: none) with its temporary
/// directory in `tmp`, and checks the tour's key lines, exit 0, and that it leaves no
/// directory, mount or process behind. Returns what it printed.
fn run_demo(tmp: &std::path::Path, under: &[&str]) -> String {
    let mut cmd = match under.split_first() {
        Some((first, rest)) => {
            let mut c = std::process::Command::new(first);
            c.args(rest).arg(bin());
            c
        }
        None => std::process::Command::new(bin()),
    };
    let out = cmd
        .arg("demo")
        .env("TMPDIR", tmp)
        .env_remove("MESHFS_HOME")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for line in [
        "== two devices, laptop and server, each with its own identity and a folder `demo`",
        "both daemons running; they found each other over QUIC with pinned ids",
        "10 new files, save → readable on the server: median ",
        "renamed on the laptop; the server has renamed-project/ with 1000 files; ",
        "  report.txt = \"server's version (saved later)\"",
        "    belongs to report.txt; losing version by ",
        "conflict report.txt",
        "sync    in sync: every folder is up to date with every peer that shares it",
        "demo finished; both daemons stopped",
    ] {
        assert!(text.contains(line), "missing {line:?} in:\n{text}");
    }
    // The server's restart in the tour is an orderly stop, not an error of the peer.
    assert!(!text.contains("daemon stopping"), "{text}");
    let sibling = text
        .lines()
        .find(|l| l.contains(".sync-conflict-") && l.contains(" = "))
        .unwrap_or_else(|| panic!("no conflict sibling shown:\n{text}"));
    assert!(sibling.ends_with("= \"laptop's version\""), "{sibling}");
    // Everything it made is gone: its directory, so no mount point, and no daemon of it runs.
    assert_eq!(listing(tmp), Vec::<std::path::PathBuf>::new(), "{text}");
    let here = tmp.to_str().unwrap();
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains(here), "{mounts}");
    for p in std::fs::read_dir("/proc").unwrap().flatten() {
        let cmdline = std::fs::read(p.path().join("cmdline")).unwrap_or_default();
        assert!(
            !String::from_utf8_lossy(&cmdline).contains(here),
            "process {:?} of the demo is still running",
            p.file_name()
        );
    }
    text
}

#[test]
fn the_demo_tours_two_devices_and_leaves_nothing_behind() {
    let t = tmp();
    let text = run_demo(t.path(), &[]);
    // Mounted where FUSE is usable; elsewhere it says so once and tours the replicas.
    let mounted = text.contains("each folder is mounted (FUSE, served by its daemon)");
    assert!(mounted || text.contains("no FUSE mount here ("), "{text}");
    if mounted {
        assert!(text.contains("server: git status = clean"), "{text}");
    }
}

#[test]
fn the_demo_without_fuse_says_so_and_tours_the_replica_directories() {
    // Without CAP_SYS_ADMIN in its bounding set no process of the demo can mount, not even
    // through the setuid fusermount3: FUSE is unusable as on a machine without it.
    let probe = std::process::Command::new("setpriv")
        .args(["--bounding-set=-sys_admin", "--", "true"])
        .status();
    if !probe.is_ok_and(|s| s.success()) {
        eprintln!("skipped: setpriv cannot drop CAP_SYS_ADMIN here");
        return;
    }
    let t = tmp();
    let text = run_demo(t.path(), &["setpriv", "--bounding-set=-sys_admin", "--"]);
    assert!(
        text.contains("no FUSE mount here (")
            && text.contains("the tour works in the replica directories"),
        "{text}"
    );
    assert!(!text.contains("each folder is mounted"), "{text}");
    assert!(!text.contains("git status"), "{text}");
}

#[test]
fn a_peer_that_removed_the_folder_is_shown_as_not_sharing_it_not_as_syncing() {
    let t = tmp();
    let mut a = Device::new(&t, "a");
    let mut b = Device::new(&t, "b");
    pair(&a, &b);
    write(&a.path("x.txt"), b"from a");
    Device::start_together(&mut [&mut a, &mut b]);
    wait_synced(&[&a, &b], 30);
    ok(&b.home, &["folder", "remove", "work"]);
    // b reconnects with a hello that no longer offers work: a sees it soon.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let s = loop {
        let s = a.status();
        if s["folders"][0]["peers"][0]["not_shared"] == true {
            break s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "b still looks like it shares work: {s}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let p = &s["folders"][0]["peers"][0];
    assert_eq!(p["device_id"], b.id.as_str());
    assert_eq!(p["connected"], true);
    assert_eq!(p["in_sync"], false);
    assert_eq!(s["folders"][0]["in_sync"], false);
    let text = ok(&a.home, &["status"]);
    assert!(
        text.contains("up to date with 0 of 1 peer; b connected, but it does not share this folder with this device")
            && text.contains("with b: connected, but it does not share this folder with this device"),
        "{text}"
    );
    assert!(!text.contains("syncing"), "{text}");
    // b's files are still there, untouched by the removal.
    assert_eq!(std::fs::read(b.path("x.txt")).unwrap(), b"from a");
    a.stop();
    b.stop();
}

#[test]
fn folder_add_with_on_demand_under_sets_on_demand_for_those_subtrees_and_folder_set_changes_them() {
    let t = tmp();
    let home = t.path().join("home");
    ok(
        &home,
        &["init", "--name", "x", "--listen", "127.0.0.1:7788"],
    );
    let work = t.path().join("work");
    let list = |home: &std::path::Path| -> serde_json::Value {
        serde_json::from_str(&ok(home, &["folder", "list", "--json"])).unwrap()
    };
    // --cache-max needs on demand, whole or a subtree.
    let (code, err) = fails(
        &home,
        &[
            "folder",
            "add",
            work.to_str().unwrap(),
            "--cache-max",
            "1GiB",
        ],
    );
    assert_eq!(code, 2, "{err}");
    ok(
        &home,
        &[
            "folder",
            "add",
            work.to_str().unwrap(),
            "--id",
            "work",
            "--on-demand-under",
            "./videos/",
            "--on-demand-under",
            "archive/2019",
            "--cache-max",
            "1GiB",
        ],
    );
    let l = list(&home);
    assert_eq!(l[0]["on_demand"], true, "{l}");
    assert_eq!(
        l[0]["on_demand_under"],
        serde_json::json!(["videos", "archive/2019"]),
        "{l}"
    );
    ok(
        &home,
        &["folder", "set", "work", "--on-demand-under", "videos"],
    );
    assert_eq!(
        list(&home)[0]["on_demand_under"],
        serde_json::json!(["videos"])
    );
    ok(&home, &["folder", "set", "work", "--on-demand"]);
    assert_eq!(list(&home)[0]["on_demand_under"], serde_json::json!([]));
    assert_eq!(list(&home)[0]["on_demand"], true);
    ok(&home, &["folder", "set", "work", "--on-demand-under", "x"]);
    ok(&home, &["folder", "set", "work", "--no-on-demand"]);
    let l = list(&home);
    assert_eq!(l[0]["on_demand"], false, "{l}");
    assert_eq!(l[0]["on_demand_under"], serde_json::json!([]), "{l}");
    // A config that names subtrees without on demand is refused, naming the field.
    let config = home.join("config.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, text + "on_demand_under = [\"videos\"]\n").unwrap();
    let (_, err) = fails(&home, &["config", "check"]);
    assert!(err.contains("on_demand_under"), "{err}");
}
