//! A running daemon journals every local change exactly once, through the watcher, with no
//! peers at all; changes made while it was stopped are picked up once at the next start.

use crate::common;
use common::*;
use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

/// Waits until the daemon has captured everything, then returns journal entries after `after`.
fn settle(d: &Device, after: u64) -> Vec<serde_json::Value> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut last: Option<usize> = None;
    loop {
        std::thread::sleep(Duration::from_millis(60));
        let idle = d.status()["folders"][0]["capture_pending"].as_u64() == Some(0);
        let entries = d.journal(&["--since", &after.to_string()]);
        if idle && last == Some(entries.len()) {
            return entries;
        }
        last = Some(entries.len());
        assert!(Instant::now() < deadline, "capture never settled");
    }
}

fn ops(entries: &[serde_json::Value]) -> Vec<(String, String)> {
    entries
        .iter()
        .map(|e| {
            (
                e["op"].as_str().unwrap().to_string(),
                e["path"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

fn last_seq(d: &Device) -> u64 {
    d.journal(&["--limit", "1"])
        .last()
        .map_or(0, |e| e["sequence"].as_u64().unwrap())
}

fn pairs(v: &[(&str, &str)]) -> Vec<(String, String)> {
    v.iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect()
}

#[test]
fn each_local_operation_becomes_exactly_the_expected_journal_entries() {
    let t = tmp();
    let mut d = Device::new(&t, "solo");
    d.start();

    let s = last_seq(&d);
    write(&d.path("f.txt"), b"one");
    assert_eq!(ops(&settle(&d, s)), pairs(&[("create", "f.txt")]));

    let s = last_seq(&d);
    std::fs::OpenOptions::new()
        .append(true)
        .open(d.path("f.txt"))
        .and_then(|mut f| std::io::Write::write_all(&mut f, b" two"))
        .unwrap();
    assert_eq!(ops(&settle(&d, s)), pairs(&[("modify", "f.txt")]));

    let s = last_seq(&d);
    std::fs::write(d.path("f.txt"), b"overwritten").unwrap();
    assert_eq!(ops(&settle(&d, s)), pairs(&[("modify", "f.txt")]));

    let s = last_seq(&d);
    std::fs::OpenOptions::new()
        .write(true)
        .open(d.path("f.txt"))
        .unwrap()
        .set_len(4)
        .unwrap();
    let e = settle(&d, s);
    assert_eq!(ops(&e), pairs(&[("modify", "f.txt")]));
    assert_eq!(e[0]["size"], 4);

    let s = last_seq(&d);
    std::fs::set_permissions(d.path("f.txt"), std::fs::Permissions::from_mode(0o600)).unwrap();
    assert_eq!(ops(&settle(&d, s)), pairs(&[("metadata", "f.txt")]));

    let s = last_seq(&d);
    std::fs::rename(d.path("f.txt"), d.path("g.txt")).unwrap();
    assert_eq!(
        ops(&settle(&d, s)),
        pairs(&[("rename", "g.txt"), ("delete", "f.txt")])
    );

    let s = last_seq(&d);
    std::fs::create_dir(d.path("dir")).unwrap();
    assert_eq!(ops(&settle(&d, s)), pairs(&[("create", "dir")]));
    let s = last_seq(&d);
    std::fs::remove_dir(d.path("dir")).unwrap();
    assert_eq!(ops(&settle(&d, s)), pairs(&[("delete", "dir")]));

    let s = last_seq(&d);
    std::os::unix::fs::symlink("g.txt", d.path("ln")).unwrap();
    let e = settle(&d, s);
    assert_eq!(ops(&e), pairs(&[("create", "ln")]));
    assert_eq!(e[0]["kind"], "symlink");

    let s = last_seq(&d);
    std::fs::remove_file(d.path("g.txt")).unwrap();
    assert_eq!(ops(&settle(&d, s)), pairs(&[("delete", "g.txt")]));

    // A directory renamed with its contents: creates under the new name re-use the content.
    std::fs::create_dir_all(d.path("a/b")).unwrap();
    write(&d.path("a/b/x"), b"x");
    settle(&d, 0);
    let s = last_seq(&d);
    std::fs::rename(d.path("a"), d.path("z")).unwrap();
    let got = ops(&settle(&d, s));
    assert_eq!(
        got,
        pairs(&[
            ("create", "z"),
            ("create", "z/b"),
            ("rename", "z/b/x"),
            ("delete", "a/b/x"),
            ("delete", "a/b"),
            ("delete", "a")
        ])
    );

    // Moved in from outside the folder (the same filesystem): created here, contents and all,
    // with no pair to wait for (D114). Moved out: deleted.
    let outside = t.path().join("outside");
    std::fs::create_dir_all(outside.join("tree/sub")).unwrap();
    write(&outside.join("tree/sub/m"), b"moved in");
    write(&outside.join("n"), b"moved in too");
    let s = last_seq(&d);
    std::fs::rename(outside.join("tree"), d.path("tree")).unwrap();
    std::fs::rename(outside.join("n"), d.path("n")).unwrap();
    let mut got = ops(&settle(&d, s));
    got.sort();
    assert_eq!(
        got,
        pairs(&[
            ("create", "n"),
            ("create", "tree"),
            ("create", "tree/sub"),
            ("create", "tree/sub/m")
        ])
    );
    let s = last_seq(&d);
    std::fs::rename(d.path("n"), outside.join("n")).unwrap();
    assert_eq!(ops(&settle(&d, s)), pairs(&[("delete", "n")]));
}

#[test]
fn a_burst_in_new_directories_and_the_editor_save_pattern_are_captured_precisely() {
    let t = tmp();
    let mut d = Device::new(&t, "solo");
    write(&d.path("doc.txt"), b"v1");
    d.start();
    let s = last_seq(&d);
    // mkdir -p a/b/c && echo x > a/b/c/f, as fast as possible.
    std::fs::create_dir_all(d.path("a/b/c")).unwrap();
    std::fs::write(d.path("a/b/c/f"), b"x").unwrap();
    let got = ops(&settle(&d, s));
    assert_eq!(
        got,
        pairs(&[
            ("create", "a"),
            ("create", "a/b"),
            ("create", "a/b/c"),
            ("create", "a/b/c/f")
        ])
    );

    // vim-style: write a swap/temp file, rename it over the original.
    let s = last_seq(&d);
    std::fs::write(d.path(".doc.txt.swp"), b"v2").unwrap();
    std::fs::rename(d.path(".doc.txt.swp"), d.path("doc.txt")).unwrap();
    let got = ops(&settle(&d, s));
    let doc: Vec<_> = got.iter().filter(|(_, p)| p == "doc.txt").collect();
    assert_eq!(doc.len(), 1, "one new version of doc.txt: {got:?}");
    assert_eq!(std::fs::read(d.path("doc.txt")).unwrap(), b"v2");
    let last = d.journal(&["--path", "doc.txt"]);
    assert_eq!(last.last().unwrap()["size"], 2);

    // 100 rapid writes to one file: a few versions, not 100. Coalescing waits for a quiet
    // time, so on a loaded machine (CI beside other builds) the burst may be cut a few more
    // times; seven were seen with four builds running.
    let s = last_seq(&d);
    for i in 0..100 {
        std::fs::write(d.path("rapid.txt"), format!("write {i}")).unwrap();
    }
    let n = settle(&d, s)
        .iter()
        .filter(|e| e["path"] == "rapid.txt")
        .count();
    assert!((1..=20).contains(&n), "{n} versions for 100 rapid writes");
    assert_eq!(std::fs::read(d.path("rapid.txt")).unwrap(), b"write 99");
}

#[test]
fn git_inside_the_folder_is_journaled() {
    if std::process::Command::new("git")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("git not installed; skipping");
        return;
    }
    let t = tmp();
    let mut d = Device::new(&t, "solo");
    d.start();
    write(&d.path("src/main.c"), b"int main(void) { return 0; }\n");
    let run = |args: &[&str]| {
        let out = std::process::Command::new("git")
            .args(args)
            .current_dir(&d.dir)
            .env("GIT_AUTHOR_NAME", "t")
            .env("GIT_AUTHOR_EMAIL", "t@t")
            .env("GIT_COMMITTER_NAME", "t")
            .env("GIT_COMMITTER_EMAIL", "t@t")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(&["init", "-q"]);
    run(&["add", "."]);
    run(&["commit", "-q", "-m", "first"]);
    settle(&d, 0);
    // Every file git left behind is journaled as live, with the same content.
    let live: std::collections::BTreeMap<String, u64> = {
        let mut m = std::collections::BTreeMap::new();
        for e in d.journal(&[]) {
            let p = e["path"].as_str().unwrap().to_string();
            if e["deleted"] == true {
                m.remove(&p);
            } else {
                m.insert(p, e["size"].as_u64().unwrap());
            }
        }
        m
    };
    let on_disk = tree(&d.dir);
    assert_eq!(
        live.keys().collect::<Vec<_>>(),
        on_disk.keys().collect::<Vec<_>>()
    );
    assert!(live.contains_key(".git/HEAD"));
    assert!(
        !live.keys().any(|k| k.ends_with(".lock")),
        "lock files were transient"
    );
}

#[test]
fn changes_made_while_stopped_are_picked_up_once_and_an_unchanged_tree_gives_nothing() {
    let t = tmp();
    let mut d = Device::new(&t, "solo");
    write(&d.path("keep.txt"), b"keep");
    write(&d.path("edit.txt"), b"before");
    write(&d.path("gone.txt"), b"gone");
    d.start();
    settle(&d, 0);
    d.stop();
    std::fs::write(d.path("edit.txt"), b"after!").unwrap();
    std::fs::remove_file(d.path("gone.txt")).unwrap();
    write(&d.path("new.txt"), b"new");
    let s = last_seq(&d);
    d.start();
    let mut got = ops(&settle(&d, s));
    got.sort();
    assert_eq!(
        got,
        pairs(&[
            ("create", "new.txt"),
            ("delete", "gone.txt"),
            ("modify", "edit.txt")
        ])
    );
    // Restart with nothing changed: no entries.
    d.stop();
    let s = last_seq(&d);
    d.start();
    assert!(settle(&d, s).is_empty());
}

#[test]
fn ignored_paths_are_never_journaled_but_meshignore_is() {
    let t = tmp();
    let mut d = Device::new(&t, "solo");
    write(&d.path(".meshignore"), b"*.o\nbuild/\n");
    d.start();
    write(&d.path("main.o"), b"obj");
    write(&d.path("build/out"), b"bin");
    write(&d.path("main.c"), b"src");
    let paths: Vec<String> = settle(&d, 0)
        .iter()
        .map(|e| e["path"].as_str().unwrap().to_string())
        .collect();
    assert!(paths.contains(&".meshignore".to_string()));
    assert!(paths.contains(&"main.c".to_string()));
    assert!(
        !paths
            .iter()
            .any(|p| p.ends_with(".o") || p.starts_with("build")),
        "{paths:?}"
    );
}
