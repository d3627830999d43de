//! The on-demand device of a randomized run (`MESHFS_CHAOS_ON_DEMAND=1`): how its replica is
//! compared with its peers' without fetching anything, the evictions seen while the script runs,
//! and what must hold of its mount once every device is in sync. Never changes a file.
//!
//! - Its backing directory holds placeholders (D90): a file that is not local is compared by the
//!   hash its placeholder attribute names and its true size, so "the replicas are equal" means
//!   the same thing on it as on the others and costs no fetch ([`backing_tree`]).
//! - After every step its backing is looked at: a path whose content `H` was local and is now a
//!   placeholder of `H` was evicted (by `meshfs evict` or by the budget). The last-copy rule
//!   (D93): `H` must be held by another device, which a device that is not on demand shows by a
//!   history row with `H` (it journals a version only once its content is installed). Checked
//!   at the end, against every journal ([`check`]).
//! - Once in sync, through the mount: every path of the others' replicas is there with its
//!   kind, size and mode; every file reads back exactly the content the others hold — compared
//!   byte for byte, and a zero-filled range where the true content is not zero named as such —
//!   and every read made through the mount while the script ran held no NUL byte (the script
//!   writes only text: a NUL is a hole served as content).

use super::run::Run;
use super::verdict::Row;
use crate::common::tree;
use meshfs_daemon::chunker::chunk_bytes;
use std::collections::{BTreeMap, BTreeSet};
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

/// The placeholder attribute (`meshfs_fuse::PLACEHOLDER_XATTR`, D90).
const PLACEHOLDER: &std::ffi::CStr = c"user.meshfs.placeholder";

/// The content hash a placeholder stands for (hex), or `None` for a file with content.
pub fn placeholder_hash(p: &Path) -> Option<String> {
    let c = CString::new(p.as_os_str().as_bytes()).ok()?;
    let mut buf = [0u8; 64];
    // SAFETY: a NUL-terminated path and a buffer writable for its length, valid for the call.
    let n = unsafe {
        libc::lgetxattr(
            c.as_ptr(),
            PLACEHOLDER.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    (n == 32).then(|| buf[..32].iter().map(|b| format!("{b:02x}")).collect())
}

/// meshfs's content hash of `data` (hex), as journals show it: blake3 of the content for a file
/// of one chunk, a hash of its chunk list for more (`Hash::of_chunks`).
pub fn content_hash(data: &[u8]) -> String {
    chunk_bytes(data).hash.to_string()
}

/// [`tree`] of a replica with meshfs's content hash of each file (the journals'), and on an
/// on-demand device's backing directory each placeholder taken for the hash it stands for at
/// its true size (the bytes of a placeholder are zeros and never read).
pub fn backing_tree(root: &Path) -> BTreeMap<String, String> {
    let mut t = tree(root);
    for (rel, v) in t.iter_mut() {
        if !v.starts_with("file ") {
            continue;
        }
        let p = root.join(rel);
        let Ok(md) = std::fs::symlink_metadata(&p) else {
            continue;
        };
        let mode = md.permissions().mode() & 0o7777;
        let h = match placeholder_hash(&p) {
            Some(h) => h,
            None => content_hash(&std::fs::read(&p).unwrap_or_default()),
        };
        *v = format!("file {mode:o} {} {h}", md.len());
    }
    t
}

/// What the harness saw of the on-demand device while the script ran.
#[derive(Debug, Default)]
pub struct Watch {
    /// The content last seen local at each path (hash).
    local: BTreeMap<String, String>,
    /// Evictions seen: (step, path, hash).
    pub evicted: Vec<(usize, String, String)>,
    /// Reads through the mount: how many, their bytes, those that failed (offline).
    pub reads: usize,
    pub read_bytes: u64,
    pub read_failures: usize,
    /// Reads that returned a NUL byte: (step, path, offset of the first).
    pub zeros: Vec<(usize, String, usize)>,
    /// Files `meshfs evict` turned into placeholders, and the times it kept one.
    pub evict_calls: usize,
    pub evict_kept: usize,
}

impl Watch {
    /// Looks at the backing after step `step`: records the evictions since the last look.
    pub fn look(&mut self, step: usize, backing: &Path) {
        let t = tree(backing);
        let mut now = BTreeMap::new();
        for (rel, v) in &t {
            if !v.starts_with("file ") {
                continue;
            }
            let p = backing.join(rel);
            match placeholder_hash(&p) {
                Some(h) => {
                    if self.local.get(rel) == Some(&h) {
                        self.evicted.push((step, rel.clone(), h));
                    }
                }
                None => {
                    let data = std::fs::read(&p).unwrap_or_default();
                    now.insert(rel.clone(), content_hash(&data));
                }
            }
        }
        self.local = now;
    }

    /// A read through the mount that returned `data`.
    pub fn read(&mut self, step: usize, path: &str, data: &[u8]) {
        self.reads += 1;
        self.read_bytes += data.len() as u64;
        if let Some(at) = data.iter().position(|&b| b == 0) {
            self.zeros.push((step, path.to_string(), at));
        }
    }
}

/// Every file below `root` with its kind, size and mode (directories: size 0).
fn listing(root: &Path) -> BTreeMap<String, (String, u64, u32)> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with(".meshfs") {
                continue;
            }
            let p = e.path();
            let rel = p
                .strip_prefix(root)
                .map(|r| r.to_string_lossy().into_owned())
                .unwrap_or_default();
            let Ok(md) = std::fs::symlink_metadata(&p) else {
                continue;
            };
            let mode = md.permissions().mode() & 0o7777;
            let entry = if md.is_dir() {
                stack.push(p);
                ("dir".to_string(), 0, mode)
            } else if md.file_type().is_symlink() {
                ("link".to_string(), 0, 0)
            } else {
                ("file".to_string(), md.len(), mode)
            };
            out.insert(rel, entry);
        }
    }
    out
}

/// The first run of bytes where `got` is zero and `want` is not: (start, end).
fn zero_range(got: &[u8], want: &[u8]) -> Option<(usize, usize)> {
    let start = (0..got.len().min(want.len())).find(|&i| got[i] == 0 && want[i] != 0)?;
    let end = (start..got.len().min(want.len()))
        .find(|&i| got[i] != 0)
        .unwrap_or(got.len().min(want.len()));
    Some((start, end))
}

/// Figures of one check of the mount.
#[derive(Debug, Default)]
pub struct MountCheck {
    pub files: usize,
    pub bytes: u64,
}

/// Every violation, one line each, of what must hold of the on-demand device `od` once in
/// sync: its mount against device `other`'s replica, the reads and evictions `watch` saw
/// against every other device's journal.
pub fn check(
    run: &Run,
    od: usize,
    watch: &Watch,
    journals: &[Vec<Row>],
    figures: &mut MountCheck,
) -> Vec<String> {
    let mut bad = Vec::new();
    let other = (0..run.devs.len()).find(|&d| d != od).unwrap_or(0);
    let theirs_root = &run.devs[other].dir;
    let mnt = run.mount_of(od);
    let name = &run.devs[od].name;

    // Every path visible, with its kind, size and mode.
    let theirs = listing(theirs_root);
    let ours = listing(&mnt);
    let keys: BTreeSet<&String> = theirs.keys().chain(ours.keys()).collect();
    for k in keys {
        let (a, b) = (theirs.get(k), ours.get(k));
        if a != b {
            bad.push(format!(
                "(od) {name}'s mount shows {k} as {b:?}, {} holds {a:?}",
                run.devs[other].name
            ));
        }
    }

    // Every file reads back exactly what the others hold; never a zero-filled range.
    for (k, (kind, _, _)) in &theirs {
        if kind != "file" {
            continue;
        }
        let Ok(want) = std::fs::read(theirs_root.join(k)) else {
            continue;
        };
        match std::fs::read(mnt.join(k)) {
            Ok(got) => {
                figures.files += 1;
                figures.bytes += got.len() as u64;
                if let Some((s, e)) = zero_range(&got, &want) {
                    bad.push(format!(
                        "(od) zero-filled range: {name}'s mount gave zeros at {s}..{e} of {k} ({} bytes), where the content is not zero",
                        want.len()
                    ));
                } else if got != want {
                    bad.push(format!(
                        "(od) {name}'s mount gave {} bytes of {k} (hash {}), {} holds {} bytes (hash {})",
                        got.len(),
                        &content_hash(&got)[..16],
                        run.devs[other].name,
                        want.len(),
                        &content_hash(&want)[..16]
                    ));
                }
            }
            Err(e) => bad.push(format!("(od) {name}'s mount: reading {k} failed: {e}")),
        }
    }

    // While the script ran: never a NUL byte read through the mount.
    for (step, path, at) in &watch.zeros {
        bad.push(format!(
            "(od) zero-filled range: at step {step} a read of {path} through {name}'s mount returned a NUL byte at offset {at} (the script writes only text)"
        ));
    }

    // The last-copy rule: content evicted was held by a device that is not on demand.
    let held: BTreeSet<&str> = journals
        .iter()
        .enumerate()
        .filter(|(d, _)| *d != od)
        .flat_map(|(_, rows)| rows.iter())
        .filter(|r| !r.deleted && r.kind == "file")
        .map(|r| r.hash.as_str())
        .collect();
    for (step, path, h) in &watch.evicted {
        if !held.contains(h.as_str()) {
            bad.push(format!(
                "(od) last copy evicted: {path} (hash {}) became a placeholder on {name} after step {step}, and no other device ever journaled that content",
                &h[..16]
            ));
        }
    }
    bad
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_zero_range_is_found_only_where_the_true_content_is_not_zero() {
        assert_eq!(zero_range(b"ab\0\0e", b"abcde"), Some((2, 4)));
        assert_eq!(zero_range(b"a\0c", b"a\0c"), None);
        assert_eq!(zero_range(b"abc", b"abd"), None);
    }
}
