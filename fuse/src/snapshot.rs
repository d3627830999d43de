//! A read-only filesystem of a folder as it was at a past time (`meshfs mount FOLDER DIR
//! --at TIME`): the tree is given whole when it is mounted (the engine builds it from its
//! journal), file content comes chunk by chunk from a [`SnapshotContent`] (the engine's vault,
//! live files and peers). Nothing here touches a replica directory, SQLite or the network.
//!
//! It answers lookup, getattr, readdir, open, read, readlink and statfs; everything that would
//! change something fails with `EROFS` (the mount is read-only too). A file whose content is
//! not to be had anywhere reachable is listed with its size and fails to open with `ENODATA`
//! ("No data available"); a chunk that cannot be read later fails the read with `EIO`. The
//! tree never changes while mounted, so the kernel may cache entries, attributes and pages for
//! as long as it likes (an hour).

use crate::mount::prepare_mountpoint;
use crate::{lock, sys, MountError};
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    KernelConfig, LockOwner, OpenAccMode, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory,
    ReplyEntry, ReplyOpen, ReplyStatfs, Request,
};
use meshfs_protocol::{Chunk, Hash, RelPath};
use std::collections::{BTreeMap, HashSet, VecDeque};
use std::ffi::{OsStr, OsString};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tracing::{info, warn};

/// How long the kernel may keep what it learnt: the tree does not change.
const TTL: Duration = Duration::from_secs(3600);
/// Chunks kept in memory for reads that follow each other (a 256 KiB chunk read in 128 KiB
/// pieces is fetched once).
const CHUNK_CACHE: usize = 16;

/// What an entry of a snapshot is.
#[derive(Clone, Debug, PartialEq)]
pub enum SnapshotKind {
    /// A directory.
    Dir,
    /// A regular file of `size` bytes made of `chunks`, in order.
    File {
        /// Its size (the sum of the chunk lengths).
        size: u64,
        /// Its chunks; `None` when they are no longer known (the file is listed, and fails
        /// to open).
        chunks: Option<Vec<Chunk>>,
    },
    /// A symlink to `target`.
    Symlink(String),
}

/// One path of a snapshot.
#[derive(Clone, Debug, PartialEq)]
pub struct SnapshotEntry {
    /// Where.
    pub path: RelPath,
    /// What.
    pub kind: SnapshotKind,
    /// Permission bits.
    pub mode: u32,
    /// Modification time, ns since the epoch.
    pub mtime_ns: i64,
}

/// Where a snapshot's file content comes from. Called on FUSE request threads: it may take
/// time (a fetch from a peer) but must not call back into the mount.
pub trait SnapshotContent: Send + Sync {
    /// Makes every one of `chunks` readable through [`SnapshotContent::chunk`], fetching what
    /// is not here from wherever it can; `false` when some chunk is to be had nowhere.
    fn prepare(&self, chunks: &[Chunk]) -> bool;
    /// The chunk `hash` of `len` bytes, verified; `None` if it cannot be had.
    fn chunk(&self, hash: &Hash, len: u32) -> Option<Vec<u8>>;
}

/// A node of the tree: inode number = index + 1 (the root is 1, as FUSE wants).
struct Node {
    parent: u64,
    kind: NodeKind,
    mode: u32,
    mtime: SystemTime,
}

enum NodeKind {
    Dir(BTreeMap<OsString, u64>),
    File {
        size: u64,
        /// `None`: not to be had.
        chunks: Option<Vec<Chunk>>,
        /// Where each chunk starts.
        starts: Vec<u64>,
    },
    Symlink(String),
}

/// The filesystem a snapshot mount serves.
struct Snapshot {
    nodes: Vec<Node>,
    content: Arc<dyn SnapshotContent>,
    /// Files whose chunks are known to be readable (prepared once).
    ready: Mutex<HashSet<u64>>,
    cache: Mutex<VecDeque<(Hash, Arc<Vec<u8>>)>>,
    uid: u32,
    gid: u32,
    bytes: u64,
}

fn time_of(ns: i64) -> SystemTime {
    if ns >= 0 {
        UNIX_EPOCH + Duration::from_nanos(ns as u64)
    } else {
        UNIX_EPOCH
    }
}

impl Snapshot {
    /// The tree of `entries`; a directory the entries imply but do not list (its history was
    /// pruned) is made with mode 0755 and the snapshot's time `at_ns`.
    fn new(entries: Vec<SnapshotEntry>, at_ns: i64, content: Arc<dyn SnapshotContent>) -> Self {
        let (uid, gid) = sys::effective_ids();
        let dir = |parent, mode, mtime| Node {
            parent,
            kind: NodeKind::Dir(BTreeMap::new()),
            mode,
            mtime,
        };
        let mut nodes = vec![dir(1, 0o755, time_of(at_ns))];
        let mut by_path: BTreeMap<RelPath, u64> = BTreeMap::new();
        let mut sorted = entries;
        sorted.sort_by(|a, b| a.path.cmp(&b.path));
        let mut bytes = 0;
        for e in sorted {
            // Its parent, made if the entries did not list it.
            let mut parent = 1u64;
            let mut below_a_file = false;
            for a in e.path.ancestors().into_iter().rev() {
                parent = match by_path.get(&a) {
                    Some(&ino) => ino,
                    None => {
                        nodes.push(dir(parent, 0o755, time_of(at_ns)));
                        let ino = nodes.len() as u64;
                        link(&mut nodes, parent, a.file_name(), ino);
                        by_path.insert(a.clone(), ino);
                        ino
                    }
                };
                if !matches!(nodes[parent as usize - 1].kind, NodeKind::Dir(_)) {
                    below_a_file = true;
                    break;
                }
            }
            if below_a_file {
                // A path below a file: the history is inconsistent there; left out.
                continue;
            }
            let kind = match e.kind {
                SnapshotKind::Dir => {
                    if let Some(&ino) = by_path.get(&e.path) {
                        // Listed after a child made it: take its mode.
                        nodes[ino as usize - 1].mode = e.mode;
                        continue;
                    }
                    NodeKind::Dir(BTreeMap::new())
                }
                SnapshotKind::File { size, chunks } => {
                    bytes += size;
                    let mut at = 0;
                    let starts = chunks
                        .iter()
                        .flatten()
                        .map(|c| {
                            let s = at;
                            at += u64::from(c.len);
                            s
                        })
                        .collect();
                    NodeKind::File {
                        size,
                        chunks,
                        starts,
                    }
                }
                SnapshotKind::Symlink(t) => NodeKind::Symlink(t),
            };
            if by_path.contains_key(&e.path) {
                continue;
            }
            nodes.push(Node {
                parent,
                kind,
                mode: e.mode & 0o7777,
                mtime: time_of(e.mtime_ns),
            });
            let ino = nodes.len() as u64;
            link(&mut nodes, parent, e.path.file_name(), ino);
            by_path.insert(e.path, ino);
        }
        Snapshot {
            nodes,
            content,
            ready: Mutex::new(HashSet::new()),
            cache: Mutex::new(VecDeque::new()),
            uid,
            gid,
            bytes,
        }
    }

    fn node(&self, ino: INodeNo) -> Result<&Node, Errno> {
        ino.0
            .checked_sub(1)
            .and_then(|i| self.nodes.get(i as usize))
            .ok_or(Errno::ENOENT)
    }

    fn attr(&self, ino: u64, n: &Node) -> FileAttr {
        let (kind, size, nlink) = match &n.kind {
            NodeKind::Dir(children) => (FileType::Directory, 4096, 2 + children.len() as u32),
            NodeKind::File { size, .. } => (FileType::RegularFile, *size, 1),
            NodeKind::Symlink(t) => (FileType::Symlink, t.len() as u64, 1),
        };
        FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: size.div_ceil(512),
            atime: n.mtime,
            mtime: n.mtime,
            ctime: n.mtime,
            crtime: n.mtime,
            kind,
            perm: n.mode as u16,
            nlink,
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }

    /// A chunk through the small cache.
    fn chunk(&self, c: &Chunk) -> Option<Arc<Vec<u8>>> {
        if let Some((_, d)) = lock(&self.cache).iter().find(|(h, _)| *h == c.hash) {
            return Some(d.clone());
        }
        let d = Arc::new(self.content.chunk(&c.hash, c.len)?);
        if d.len() != c.len as usize {
            return None;
        }
        let mut cache = lock(&self.cache);
        if cache.len() >= CHUNK_CACHE {
            cache.pop_front();
        }
        cache.push_back((c.hash, d.clone()));
        Some(d)
    }
}

fn link(nodes: &mut [Node], parent: u64, name: &str, ino: u64) {
    if let NodeKind::Dir(children) = &mut nodes[parent as usize - 1].kind {
        children.insert(OsString::from(name), ino);
    }
}

impl Filesystem for Snapshot {
    fn init(&mut self, _req: &Request, _config: &mut KernelConfig) -> io::Result<()> {
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let found = self.node(parent).and_then(|p| match &p.kind {
            NodeKind::Dir(children) => children.get(name).copied().ok_or(Errno::ENOENT),
            _ => Err(Errno::ENOTDIR),
        });
        match found {
            Ok(ino) => match self.node(INodeNo(ino)) {
                Ok(n) => reply.entry(&TTL, &self.attr(ino, n), Generation(0)),
                Err(e) => reply.error(e),
            },
            Err(e) => reply.error(e),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.node(ino) {
            Ok(n) => reply.attr(&TTL, &self.attr(ino.0, n)),
            Err(e) => reply.error(e),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        match self.node(ino).map(|n| &n.kind) {
            Ok(NodeKind::Symlink(t)) => reply.data(t.as_bytes()),
            Ok(_) => reply.error(Errno::EINVAL),
            Err(e) => reply.error(e),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let n = match self.node(ino) {
            Ok(n) => n,
            Err(e) => return reply.error(e),
        };
        if flags.acc_mode() != OpenAccMode::O_RDONLY {
            return reply.error(Errno::EROFS);
        }
        let NodeKind::File { chunks, .. } = &n.kind else {
            return reply.error(Errno::EISDIR);
        };
        let Some(chunks) = chunks else {
            return reply.error(Errno::ENODATA);
        };
        let ready = lock(&self.ready).contains(&ino.0);
        if !ready {
            if !self.content.prepare(chunks) {
                return reply.error(Errno::ENODATA);
            }
            lock(&self.ready).insert(ino.0);
        }
        reply.opened(FileHandle(0), FopenFlags::FOPEN_KEEP_CACHE);
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let n = match self.node(ino) {
            Ok(n) => n,
            Err(e) => return reply.error(e),
        };
        let NodeKind::File {
            size: len,
            chunks: Some(chunks),
            starts,
        } = &n.kind
        else {
            return reply.error(Errno::EIO);
        };
        let end = (offset.saturating_add(u64::from(size))).min(*len);
        let mut out = Vec::with_capacity(end.saturating_sub(offset) as usize);
        let mut at = offset;
        let mut i = starts.partition_point(|&s| s <= offset).saturating_sub(1);
        while at < end && i < chunks.len() {
            let Some(data) = self.chunk(&chunks[i]) else {
                return reply.error(Errno::EIO);
            };
            let from = (at - starts[i]) as usize;
            let to = ((end - starts[i]) as usize).min(data.len());
            if from >= to {
                break;
            }
            out.extend_from_slice(&data[from..to]);
            at += (to - from) as u64;
            i += 1;
        }
        reply.data(&out);
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let n = match self.node(ino) {
            Ok(n) => n,
            Err(e) => return reply.error(e),
        };
        let NodeKind::Dir(children) = &n.kind else {
            return reply.error(Errno::ENOTDIR);
        };
        let dots = [
            (ino.0, FileType::Directory, OsStr::new(".")),
            (n.parent, FileType::Directory, OsStr::new("..")),
        ];
        let rest = children.iter().map(|(name, &c)| {
            let kind = match self.nodes.get(c as usize - 1).map(|n| &n.kind) {
                Some(NodeKind::Dir(_)) => FileType::Directory,
                Some(NodeKind::Symlink(_)) => FileType::Symlink,
                _ => FileType::RegularFile,
            };
            (c, kind, name.as_os_str())
        });
        for (i, (ino, kind, name)) in dots
            .into_iter()
            .chain(rest)
            .enumerate()
            .skip(offset as usize)
        {
            if reply.add(INodeNo(ino), i as u64 + 1, kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let blocks = self.bytes.div_ceil(4096);
        reply.statfs(blocks, 0, 0, self.nodes.len() as u64, 0, 4096, 255, 4096);
    }
}

/// A snapshot mounted read-only. Unmounts on [`SnapshotMount::unmount`] or drop.
pub struct SnapshotMount {
    mountpoint: PathBuf,
    unmounter: Option<fuser::SessionUnmounter>,
    thread: Option<JoinHandle<io::Result<()>>>,
}

impl std::fmt::Debug for SnapshotMount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SnapshotMount")
            .field("mountpoint", &self.mountpoint)
            .finish_non_exhaustive()
    }
}

/// Mounts the tree `entries` (a folder as it was at `at_ns`) read-only at `mountpoint` (an
/// existing empty directory), its files' content from `content`.
pub fn mount_snapshot(
    entries: Vec<SnapshotEntry>,
    at_ns: i64,
    mountpoint: &Path,
    content: Arc<dyn SnapshotContent>,
) -> Result<SnapshotMount, MountError> {
    let mp = prepare_mountpoint(mountpoint)?;
    let fs = Snapshot::new(entries, at_ns, content);
    let mut config = fuser::Config::default();
    config.mount_options = vec![
        fuser::MountOption::FSName("meshfs-snapshot".into()),
        fuser::MountOption::Subtype("meshfs".into()),
        fuser::MountOption::RO,
        fuser::MountOption::NoSuid,
        fuser::MountOption::NoDev,
    ];
    config.acl = fuser::SessionACL::Owner;
    config.n_threads = Some(2);
    config.clone_fd = true;
    let mount_err = |source| MountError::Mount {
        path: mp.clone(),
        source,
    };
    let mut session = fuser::Session::new(fs, &mp, &config).map_err(mount_err)?;
    let mut unmounter = session.unmount_callable();
    let thread = std::thread::Builder::new()
        .name("meshfs-snapshot".into())
        .spawn(move || session.run());
    let thread = match thread {
        Ok(t) => t,
        Err(e) => {
            let _ = unmounter.unmount();
            return Err(mount_err(e));
        }
    };
    info!(mountpoint = %mp.display(), at_ns, "snapshot mounted");
    Ok(SnapshotMount {
        mountpoint: mp,
        unmounter: Some(unmounter),
        thread: Some(thread),
    })
}

impl SnapshotMount {
    /// Where it is mounted.
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// Unmounts (a busy mount is detached and serves its last users until they leave).
    pub fn unmount(mut self) -> Result<(), MountError> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Result<(), MountError> {
        let Some(mut unmounter) = self.unmounter.take() else {
            return Ok(());
        };
        let mut joined = true;
        match unmounter.unmount() {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                let c = std::ffi::CString::new(self.mountpoint.as_os_str().as_bytes())
                    .unwrap_or_default();
                sys::umount2(&c, libc::MNT_DETACH).map_err(|e| MountError::Unmount {
                    path: self.mountpoint.clone(),
                    source: io::Error::from_raw_os_error(e),
                })?;
                joined = false;
            }
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
            Err(source) => {
                return Err(MountError::Unmount {
                    path: self.mountpoint.clone(),
                    source,
                })
            }
        }
        if let Some(t) = self.thread.take() {
            if joined {
                if let Ok(Err(e)) = t.join() {
                    warn!(error = %e, "snapshot session ended with an error");
                }
            }
        }
        Ok(())
    }
}

impl Drop for SnapshotMount {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            warn!(error = %e, "unmounting a snapshot on drop failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct NoContent;

    impl SnapshotContent for NoContent {
        fn prepare(&self, _: &[Chunk]) -> bool {
            false
        }
        fn chunk(&self, _: &Hash, _: u32) -> Option<Vec<u8>> {
            None
        }
    }

    fn entry(path: &str, kind: SnapshotKind) -> SnapshotEntry {
        SnapshotEntry {
            path: RelPath::new(path).unwrap(),
            kind,
            mode: 0o640,
            mtime_ns: 5,
        }
    }

    #[test]
    fn the_tree_gets_every_listed_path_and_the_directories_they_imply() {
        let s = Snapshot::new(
            vec![
                entry(
                    "a/b/file",
                    SnapshotKind::File {
                        size: 0,
                        chunks: Some(vec![]),
                    },
                ),
                entry("a", SnapshotKind::Dir),
                entry("link", SnapshotKind::Symlink("a/b/file".into())),
                entry("a/b/file/below", SnapshotKind::Dir),
            ],
            9,
            Arc::new(NoContent),
        );
        // root, a, a/b, a/b/file, link; nothing below a file.
        assert_eq!(s.nodes.len(), 5);
        let NodeKind::Dir(root) = &s.nodes[0].kind else {
            panic!()
        };
        assert_eq!(root.keys().collect::<Vec<_>>(), ["a", "link"]);
        let a = root[OsStr::new("a")];
        assert_eq!(s.nodes[a as usize - 1].mode, 0o640, "the listed mode wins");
    }
}
