//! One simulated replica's state: an in-memory filesystem and an in-memory journal.
//!
//! The journal model implements the two read interfaces the real journal gives the pure
//! modules ([`ReplicaView`] for the reconciler, [`IndexSource`] for sessions), keeps the
//! per-peer progress a session resumes from, and the pending/applied bracket of docs/design.md, "Safe apply".

use super::truth::{EventInfo, RecTruth};
use crate::reconcile::{ReadError, ReplicaView};
use crate::session::IndexSource;
use meshfs_protocol::{
    Chunk, DeviceId, FileKind, FileRecord, FolderId, Hash, RelPath, VersionVector,
};
use std::collections::{BTreeMap, BTreeSet};

/// What a filesystem node holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Content {
    File(Vec<u8>),
    Dir,
    Symlink(String),
}

/// A node of the filesystem model. Files are written whole (atomically, as the store does).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Node {
    pub content: Content,
    pub mode: u32,
    pub mtime_ns: i64,
}

impl Node {
    pub fn kind(&self) -> FileKind {
        match self.content {
            Content::File(_) => FileKind::File,
            Content::Dir => FileKind::Dir,
            Content::Symlink(_) => FileKind::Symlink,
        }
    }

    pub fn hash(&self) -> Hash {
        match &self.content {
            Content::File(b) => Hash::of(b),
            Content::Dir => Hash::ZERO,
            Content::Symlink(t) => Hash::of(t.as_bytes()),
        }
    }

    /// Same content as the record (kind, hash, target).
    pub fn same_content(&self, r: &FileRecord) -> bool {
        !r.deleted
            && self.kind() == r.kind
            && self.hash() == r.hash
            && match &self.content {
                Content::Symlink(t) => *t == r.target,
                _ => true,
            }
    }

    /// Same content and replicated metadata (mode; mtime of files).
    pub fn matches(&self, r: &FileRecord) -> bool {
        self.same_content(r)
            && self.mode == r.mode
            && (r.kind != FileKind::File || self.mtime_ns == r.mtime_ns)
    }

    /// The node a live record describes, with file bytes supplied by the caller.
    pub fn from_record(r: &FileRecord, bytes: Option<Vec<u8>>) -> Node {
        let content = match r.kind {
            FileKind::File => Content::File(bytes.unwrap_or_default()),
            FileKind::Dir => Content::Dir,
            FileKind::Symlink => Content::Symlink(r.target.clone()),
        };
        Node {
            content,
            mode: r.mode,
            mtime_ns: r.mtime_ns,
        }
    }
}

/// The filesystem of one replica: path → node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Fs {
    pub nodes: BTreeMap<RelPath, Node>,
}

impl Fs {
    /// Bytes of any file with this content hash (the model's chunk index).
    pub fn find_content(&self, h: &Hash) -> Option<&[u8]> {
        self.nodes.values().find_map(|n| match &n.content {
            Content::File(b) if Hash::of(b) == *h => Some(b.as_slice()),
            _ => None,
        })
    }

    pub fn has_children(&self, dir: &RelPath) -> bool {
        below(&self.nodes, dir).next().is_some()
    }

    /// Whether the path is in the state `r` describes (absent for a tombstone).
    pub fn matches(&self, r: &FileRecord) -> bool {
        match self.nodes.get(&r.path) {
            None => r.deleted,
            Some(n) => n.matches(r),
        }
    }

    pub fn parent_is_dir(&self, p: &RelPath) -> bool {
        match p.parent() {
            None => true,
            Some(d) => self
                .nodes
                .get(&d)
                .is_some_and(|n| n.content == Content::Dir),
        }
    }
}

/// Entries of `map` strictly below `dir`.
pub(crate) fn below<'a, V>(
    map: &'a BTreeMap<RelPath, V>,
    dir: &'a RelPath,
) -> impl Iterator<Item = (&'a RelPath, &'a V)> + 'a {
    let prefix = dir.as_str();
    map.range(dir.clone()..)
        .take_while(move |(k, _)| k.as_str().starts_with(prefix))
        .filter(move |(k, _)| {
            k.as_str().len() > prefix.len() && k.as_str().as_bytes()[prefix.len()] == b'/'
        })
}

/// A current record and where it came from (None: made here).
#[derive(Clone, Debug)]
pub(crate) struct Entry {
    pub record: FileRecord,
    pub source: Option<DeviceId>,
}

/// What the journal remembers about one peer.
#[derive(Clone, Debug, Default)]
pub(crate) struct Progress {
    pub their_index_id: u64,
    pub their_sequence: u64,
    pub our_acked: u64,
}

/// A record written as pending before the files are touched (docs/design.md, "Safe apply").
#[derive(Clone, Debug)]
pub(crate) struct Pending {
    pub record: FileRecord,
    pub source: Option<DeviceId>,
    pub truth: RecTruth,
    /// Content events this step moves aside (a conflict sibling now carries them).
    pub transfers: BTreeSet<u32>,
    /// The event this step makes, if it is a new version made here.
    pub event: Option<(u32, EventInfo)>,
}

/// The journal of one replica for the one simulated folder.
#[derive(Clone, Debug, Default)]
pub(crate) struct Journal {
    pub current: BTreeMap<RelPath, Entry>,
    by_seq: BTreeMap<u64, RelPath>,
    next_seq: u64,
    pub index_id: u64,
    pub peers: BTreeMap<DeviceId, Progress>,
    pub pending: Vec<Pending>,
}

impl Journal {
    pub fn new(index_id: u64) -> Journal {
        Journal {
            next_seq: 1,
            index_id,
            ..Journal::default()
        }
    }

    pub fn max_seq(&self) -> u64 {
        self.next_seq - 1
    }

    /// Stores `record` as the current record of its path with the next sequence. The vector
    /// must not move backwards (invariant (d)).
    pub fn commit(
        &mut self,
        mut record: FileRecord,
        source: Option<DeviceId>,
    ) -> Result<u64, String> {
        if let Some(old) = self.current.get(&record.path) {
            if !record.version.dominates(&old.record.version) {
                return Err(format!(
                    "(d) version vector of {} moved backwards: {} -> {}",
                    record.path, old.record.version, record.version
                ));
            }
            self.by_seq.remove(&old.record.sequence);
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        record.sequence = seq;
        self.by_seq.insert(seq, record.path.clone());
        self.current
            .insert(record.path.clone(), Entry { record, source });
        Ok(seq)
    }

    pub fn record(&self, p: &RelPath) -> Option<&FileRecord> {
        self.current.get(p).map(|e| &e.record)
    }
}

impl ReplicaView for Journal {
    fn get(&self, path: &RelPath) -> Result<Option<FileRecord>, ReadError> {
        Ok(self.record(path).cloned())
    }

    fn has_live_below(&self, dir: &RelPath) -> Result<bool, ReadError> {
        Ok(below(&self.current, dir).any(|(_, e)| !e.record.deleted))
    }
}

impl IndexSource for Journal {
    fn records_since(
        &mut self,
        _folder: &FolderId,
        peer: &DeviceId,
        after: u64,
        limit: usize,
    ) -> Result<(Vec<FileRecord>, u64), ReadError> {
        let mut out = Vec::new();
        for (&seq, path) in self.by_seq.range(after + 1..) {
            let Some(e) = self.current.get(path) else {
                continue;
            };
            if e.source.as_ref() != Some(peer) {
                out.push(e.record.clone());
                if out.len() == limit {
                    return Ok((out, seq));
                }
            }
        }
        Ok((out, self.max_seq().max(after)))
    }

    fn max_sequence(&mut self, _folder: &FolderId) -> Result<u64, ReadError> {
        Ok(self.max_seq())
    }
}

/// The record a local capture makes for the node now at `path` (or its deletion).
pub(crate) fn captured_record(
    path: &RelPath,
    node: Option<&Node>,
    prev: Option<&FileRecord>,
    version: VersionVector,
    by: meshfs_protocol::ShortId,
    now_ns: i64,
) -> FileRecord {
    match node {
        Some(n) => {
            let (size, chunks, target) = match &n.content {
                Content::File(b) if b.is_empty() => (0, vec![], String::new()),
                Content::File(b) => (
                    b.len() as u64,
                    vec![Chunk {
                        len: b.len() as u32,
                        hash: Hash::of(b),
                    }],
                    String::new(),
                ),
                Content::Dir => (0, vec![], String::new()),
                Content::Symlink(t) => (0, vec![], t.clone()),
            };
            FileRecord {
                path: path.clone(),
                kind: n.kind(),
                deleted: false,
                mode: n.mode,
                mtime_ns: n.mtime_ns,
                size,
                hash: n.hash(),
                chunks,
                target,
                version,
                modified_by: by,
                sequence: 0,
            }
        }
        None => FileRecord {
            path: path.clone(),
            kind: prev.map(|p| p.kind).unwrap_or(FileKind::File),
            deleted: true,
            mode: prev.map(|p| p.mode).unwrap_or(0o644),
            mtime_ns: now_ns,
            size: 0,
            hash: Hash::ZERO,
            chunks: vec![],
            target: String::new(),
            version,
            modified_by: by,
            sequence: 0,
        },
    }
}
