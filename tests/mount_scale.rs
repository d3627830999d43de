//! The mount's file-descriptor budget: a tree of 100,000 files walked, stat'ed and
//! `git status`-ed through the mount never runs out of descriptors (the limit here is 20,000
//! and cannot be raised), and the daemon's own count stays under a fixed bound.

mod common;
use common::*;
use std::path::Path;
use std::process::Command;

const FILES: usize = 100_000;
/// The daemon's descriptors after the walk, stat and `git status` of 100,000 files: sockets,
/// the journal, the watcher, the mount's root, its directory cache (at most 1,024), the
/// read-ahead's (at most 5) and the FUSE device clones. Known inodes cost memory, not descriptors.
const FD_BOUND: usize = 1_500;

fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        // No background `git gc --auto` (100,000 loose objects exceed its threshold): it
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
fn a_tree_of_100000_files_is_walked_stated_and_git_statused_through_the_mount_within_the_fd_budget()
{
    let t = tmp();
    let mut a = Device::new(&t, "a");
    // The tree and its git index are made in the replica directly (fast), then used through
    // the mount.
    let repo = a.dir.join("repo");
    for i in 0..FILES {
        let d = repo.join(format!("d{:03}/e{:02}", i % 500, i / 500 % 40));
        if i < 500 * 40 {
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
