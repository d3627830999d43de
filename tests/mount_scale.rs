//! The mount's file-descriptor budget: a tree of five times as many files as the daemon may
//! have descriptors, walked, stat'ed and `git status`-ed through the mount, never runs it out of
//! descriptors, and the daemon's own count stays under a fixed bound. The daemon runs under
//! `prlimit` with a limit of 2,048 and the tree has 10,000 files: the same proof as 100,000
//! files under this machine's limit of 20,000 (which cannot be raised), at a tenth of the time.

use crate::common;
use common::*;
use std::path::Path;
use std::process::Command;

/// The daemon's open-file limit (soft and hard) in this test.
const NOFILE: usize = 2_048;
const FILES: usize = 10_000;
/// The daemon's descriptors after the walk, stat and `git status` of the tree: sockets,
/// the journal, the watcher, the mount's root, its directory cache (at most 1,024), the
/// read-ahead's (at most 5) and the FUSE device clones. Known inodes cost memory, not descriptors.
const FD_BOUND: usize = 1_500;

fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        // No background `git gc --auto` (10,000 loose objects exceed its threshold): it
        // would pack and delete .git/objects/XX while the walk runs.
        .args([
            "-c",
            "gc.auto=0",
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@example.invalid",
        ])
        .args(args)
        .current_dir(dir)
        .output()
        .expect("git is installed (CI installs it)");
    assert!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn a_tree_of_five_times_the_daemons_fd_limit_is_walked_stated_and_git_statused_through_the_mount_within_the_fd_budget(
) {
    const { assert!(FD_BOUND < NOFILE && FILES > 4 * NOFILE) };
    let t = tmp();
    let mut a = Device::new(&t, "a");
    a.under = vec![
        "prlimit".into(),
        format!("--nofile={NOFILE}:{NOFILE}"),
        "--".into(),
    ];
    // The tree and its git index are made in the replica directly (fast), then used through
    // the mount.
    let repo = a.dir.join("repo");
    for i in 0..FILES {
        let d = repo.join(format!("d{:03}/e{:02}", i % 100, i / 100 % 20));
        if i < 100 * 20 {
            std::fs::create_dir_all(&d).unwrap();
        }
        std::fs::write(d.join(format!("f{i}.txt")), i.to_string()).unwrap();
    }
    git(&repo, &["init", "-q"]);
    git(&repo, &["add", "-A"]);
    git(&repo, &["commit", "-q", "-m", "tree"]);
    a.start();
    let mnt = t.path().join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    ok(&a.home, &["mount", "work", mnt.to_str().unwrap()]);
    let pid = a.pid().unwrap();
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    assert!(
        limits
            .lines()
            .any(|l| l.starts_with("Max open files") && l.contains(&format!(" {NOFILE} "))),
        "the daemon runs under the lowered limit:\n{limits}"
    );
    // Walk and stat everything through the mount.
    let out = Command::new("find")
        .arg(mnt.join("repo"))
        .args(["-type", "f", "-printf", "%s\n"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let seen = String::from_utf8_lossy(&out.stdout).lines().count();
    assert!(seen > FILES, "{seen} files seen (the tree and .git)");
    let after_walk = fds(pid);
    // git status reads the index and stats every file.
    let status = git(&mnt.join("repo"), &["status", "--porcelain"]);
    assert_eq!(status, "", "a clean tree through the mount");
    let after_git = fds(pid);
    eprintln!(
        "daemon descriptors: {after_walk} after walking {seen} files, {after_git} after git status"
    );
    assert!(
        after_walk < FD_BOUND && after_git < FD_BOUND,
        "{after_walk} / {after_git}"
    );
}
