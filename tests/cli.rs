//! The CLI contract for a user at a terminal: init/id, refusals that change nothing, clear
//! errors with meaningful exit codes.

mod common;
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
    let (code, err) = fails(&a.home, &["peer", "add", &typo, "--addr", &b.addr]);
    assert_eq!(code, 1);
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
    let (_, err) = fails(&a.home, &["peer", "add", &b.id, "--addr", "nope"]);
    assert!(err.contains("HOST:PORT"), "{err}");
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
fn a_port_in_use_is_reported_with_the_field_to_change() {
    let t = tmp();
    let mut a = Device::new(&t, "a");
    a.start();
    // A second device configured on the same address cannot start.
    let home = t.path().join("clash");
    ok(&home, &["init", "--name", "clash", "--listen", &a.addr]);
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
