//! Random user operations on a replica's filesystem model.
//!
//! An operation changes the filesystem and reports the changed paths in the order the real
//! scanner journals them: parents created before children, children deleted before parents,
//! a rename as the create at the new path followed by the delete at the old one.

use super::replica::{below, Content, Fs, Node};
use meshfs_protocol::RelPath;
use rand::rngs::StdRng;
use rand::Rng;

/// Names are drawn from a small pool so that replicas collide on paths (files, directories
/// and symlinks alike) and conflicts happen.
const NAMES: [&str; 5] = ["a", "b.txt", ".c", "x", "y.md"];
/// Contents shared between replicas, so that equal concurrent edits happen too.
const POOL: [&[u8]; 3] = [b"", b"alpha", b"beta"];
const MAX_DEPTH: usize = 3;

/// Applies one random operation; returns its description and the changed paths in journal order.
pub(crate) fn random_op(
    rng: &mut StdRng,
    fs: &mut Fs,
    now_ns: i64,
    unique: &mut u64,
) -> (String, Vec<RelPath>) {
    for _ in 0..8 {
        let roll = rng.gen_range(0..100);
        let done = match roll {
            0..=21 => create(rng, fs, now_ns, unique),
            22..=44 => modify(rng, fs, now_ns, unique),
            45..=53 => delete(rng, fs),
            54..=61 => rename(rng, fs),
            62..=71 => mkdir(rng, fs, now_ns),
            72..=77 => rmtree(rng, fs),
            78..=87 => chmod(rng, fs),
            88..=93 => symlink(rng, fs, now_ns),
            _ => rename_dir(rng, fs),
        };
        if let Some(d) = done {
            return d;
        }
    }
    create(rng, fs, now_ns, unique).unwrap_or_else(|| ("nothing".into(), vec![]))
}

fn content(rng: &mut StdRng, unique: &mut u64) -> Vec<u8> {
    if rng.gen_bool(0.25) {
        POOL[rng.gen_range(0..POOL.len())].to_vec()
    } else {
        *unique += 1;
        format!("content-{}-{}", *unique, rng.gen::<u32>()).into_bytes()
    }
}

fn pick<'a>(rng: &mut StdRng, v: &'a [RelPath]) -> Option<&'a RelPath> {
    if v.is_empty() {
        None
    } else {
        Some(&v[rng.gen_range(0..v.len())])
    }
}

fn paths_where(fs: &Fs, f: impl Fn(&Node) -> bool) -> Vec<RelPath> {
    fs.nodes
        .iter()
        .filter(|(_, n)| f(n))
        .map(|(p, _)| p.clone())
        .collect()
}

/// A path that does not exist, in an existing directory (or the root).
fn free_path(rng: &mut StdRng, fs: &Fs) -> Option<RelPath> {
    let dirs: Vec<RelPath> = fs
        .nodes
        .iter()
        .filter(|(p, n)| n.content == Content::Dir && p.components().count() < MAX_DEPTH)
        .map(|(p, _)| p.clone())
        .collect();
    for _ in 0..6 {
        let name = NAMES[rng.gen_range(0..NAMES.len())];
        let parent = if dirs.is_empty() || rng.gen_bool(0.4) {
            None
        } else {
            pick(rng, &dirs)
        };
        let p = match parent {
            None => RelPath::new(name).ok()?,
            Some(d) => d.join(name).ok()?,
        };
        if !fs.nodes.contains_key(&p) {
            return Some(p);
        }
    }
    None
}

fn create(
    rng: &mut StdRng,
    fs: &mut Fs,
    now_ns: i64,
    unique: &mut u64,
) -> Option<(String, Vec<RelPath>)> {
    let p = free_path(rng, fs)?;
    let mode = if rng.gen_bool(0.8) { 0o644 } else { 0o600 };
    fs.nodes.insert(
        p.clone(),
        Node {
            content: Content::File(content(rng, unique)),
            mode,
            mtime_ns: now_ns,
        },
    );
    Some((format!("create {p}"), vec![p]))
}

fn modify(
    rng: &mut StdRng,
    fs: &mut Fs,
    now_ns: i64,
    unique: &mut u64,
) -> Option<(String, Vec<RelPath>)> {
    let files = paths_where(fs, |n| matches!(n.content, Content::File(_)));
    let p = pick(rng, &files)?.clone();
    let data = content(rng, unique);
    let node = fs.nodes.get_mut(&p)?;
    node.content = Content::File(data);
    node.mtime_ns = now_ns;
    Some((format!("modify {p}"), vec![p]))
}

fn delete(rng: &mut StdRng, fs: &mut Fs) -> Option<(String, Vec<RelPath>)> {
    let files = paths_where(fs, |n| n.content != Content::Dir);
    let p = pick(rng, &files)?.clone();
    fs.nodes.remove(&p);
    Some((format!("delete {p}"), vec![p]))
}

fn rename(rng: &mut StdRng, fs: &mut Fs) -> Option<(String, Vec<RelPath>)> {
    let files = paths_where(fs, |n| n.content != Content::Dir);
    let from = pick(rng, &files)?.clone();
    let to = free_path(rng, fs)?;
    let node = fs.nodes.remove(&from)?;
    fs.nodes.insert(to.clone(), node);
    Some((format!("rename {from} -> {to}"), vec![to, from]))
}

fn mkdir(rng: &mut StdRng, fs: &mut Fs, now_ns: i64) -> Option<(String, Vec<RelPath>)> {
    let p = free_path(rng, fs)?;
    fs.nodes.insert(
        p.clone(),
        Node {
            content: Content::Dir,
            mode: 0o755,
            mtime_ns: now_ns,
        },
    );
    Some((format!("mkdir {p}"), vec![p]))
}

/// `rm -r` of a directory (an empty one is `rmdir`): children first.
fn rmtree(rng: &mut StdRng, fs: &mut Fs) -> Option<(String, Vec<RelPath>)> {
    let dirs = paths_where(fs, |n| n.content == Content::Dir);
    let d = pick(rng, &dirs)?.clone();
    let mut gone: Vec<RelPath> = below(&fs.nodes, &d).map(|(p, _)| p.clone()).collect();
    // Deepest first, so every child goes before its parent.
    gone.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    gone.push(d.clone());
    for p in &gone {
        fs.nodes.remove(p);
    }
    Some((format!("rm -r {d}"), gone))
}

fn chmod(rng: &mut StdRng, fs: &mut Fs) -> Option<(String, Vec<RelPath>)> {
    let all = paths_where(fs, |n| !matches!(n.content, Content::Symlink(_)));
    let p = pick(rng, &all)?.clone();
    let node = fs.nodes.get_mut(&p)?;
    node.mode = match (&node.content, node.mode) {
        (Content::Dir, 0o755) => 0o700,
        (Content::Dir, _) => 0o755,
        (_, 0o644) => 0o600,
        _ => 0o644,
    };
    Some((format!("chmod {p} {:o}", node.mode), vec![p]))
}

fn symlink(rng: &mut StdRng, fs: &mut Fs, now_ns: i64) -> Option<(String, Vec<RelPath>)> {
    let p = free_path(rng, fs)?;
    let target = ["a", "../b.txt", "x/y.md"][rng.gen_range(0..3)].to_string();
    fs.nodes.insert(
        p.clone(),
        Node {
            content: Content::Symlink(target),
            mode: 0o777,
            mtime_ns: now_ns,
        },
    );
    Some((format!("symlink {p}"), vec![p]))
}

/// `mv` of a directory tree: the new tree (parents first), then the old one removed
/// (children first).
fn rename_dir(rng: &mut StdRng, fs: &mut Fs) -> Option<(String, Vec<RelPath>)> {
    let dirs = paths_where(fs, |n| n.content == Content::Dir);
    let from = pick(rng, &dirs)?.clone();
    let to = free_path(rng, fs)?;
    if to.is_within(&from) {
        return None;
    }
    let mut moved: Vec<(RelPath, Node)> = vec![(from.clone(), fs.nodes.get(&from)?.clone())];
    moved.extend(below(&fs.nodes, &from).map(|(p, n)| (p.clone(), n.clone())));
    let mut created = Vec::new();
    for (p, n) in &moved {
        let np = p.rebase(&from, &to)?;
        if np.components().count() > MAX_DEPTH + 1 {
            return None;
        }
        created.push((np, n.clone()));
    }
    created.sort_by_key(|(p, _)| p.components().count());
    let mut gone: Vec<RelPath> = moved.into_iter().map(|(p, _)| p).collect();
    gone.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for p in &gone {
        fs.nodes.remove(p);
    }
    let mut changed = Vec::new();
    for (p, n) in created {
        fs.nodes.insert(p.clone(), n);
        changed.push(p);
    }
    changed.extend(gone);
    Some((format!("mv {from} -> {to}"), changed))
}

/// Writes new content to the file at `path` (made if absent), as a user saving it would.
/// Returns `false` where no file can be written (a directory or symlink there, no parent).
pub(crate) fn write_at(
    rng: &mut StdRng,
    fs: &mut Fs,
    path: &RelPath,
    now_ns: i64,
    unique: &mut u64,
) -> bool {
    let mode = match fs.nodes.get(path) {
        Some(n) if matches!(n.content, Content::File(_)) => n.mode,
        Some(_) => return false,
        None if !fs.parent_is_dir(path) => return false,
        None => 0o644,
    };
    let data = content(rng, unique);
    fs.nodes.insert(
        path.clone(),
        Node {
            content: Content::File(data),
            mode,
            mtime_ns: now_ns,
        },
    );
    true
}
