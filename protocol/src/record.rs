//! [`FileRecord`]: what a device knows about one path, and the chunk list of its content.

use crate::ids::ShortId;
use crate::path::RelPath;
use crate::vv::VersionVector;
use serde::{Deserialize, Serialize};
use std::fmt;

/// Mode bits that are replicated: permissions and the sticky bit; setuid/setgid never are.
pub const MODE_SYNC_MASK: u32 = 0o1777;
/// Longest symlink target accepted, in bytes.
pub const MAX_LINK_TARGET: usize = 4095;
/// Largest chunk accepted on the wire, in bytes.
pub const MAX_CHUNK_LEN: u32 = 4 << 20;
/// The blake3 derive-key context of a multi-chunk file's content hash ([`Hash::of_chunks`]).
pub const FILE_HASH_CONTEXT: &str = "meshfs 2026-11-23 file content hash from its chunk list";

/// A blake3 hash: of a chunk, of a symlink target, or a file's content hash
/// ([`Hash::of_chunks`]).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Default)]
pub struct Hash(pub [u8; 32]);

impl Hash {
    /// The all-zero hash: directories and tombstones carry it.
    pub const ZERO: Hash = Hash([0; 32]);

    /// blake3 of `data`.
    pub fn of(data: &[u8]) -> Hash {
        Hash(*blake3::hash(data).as_bytes())
    }

    /// A file's content hash, from its chunk list: blake3 of nothing for an empty file; the
    /// chunk's hash (blake3 of the content) for a one-chunk file; otherwise blake3 in derive-key
    /// mode with context [`FILE_HASH_CONTEXT`] over each chunk's length (u32, little-endian)
    /// and hash, in order. The chunking is deterministic (FastCDC with sizes chosen by file
    /// size), so this is a function of the content; and a file rebuilt from chunks that each
    /// verified has it without being read again.
    pub fn of_chunks(chunks: &[Chunk]) -> Hash {
        match chunks {
            [] => Hash::of(b""),
            [c] => c.hash,
            _ => {
                let mut h = blake3::Hasher::new_derive_key(FILE_HASH_CONTEXT);
                for c in chunks {
                    h.update(&c.len.to_le_bytes());
                    h.update(&c.hash.0);
                }
                Hash(*h.finalize().as_bytes())
            }
        }
    }

    /// The first 8 hex digits, for people.
    pub fn short(&self) -> String {
        self.to_string()[..8].to_string()
    }

    /// Parses 64 hex digits.
    pub fn from_hex(s: &str) -> Option<Hash> {
        let bytes = data_encoding::HEXLOWER_PERMISSIVE
            .decode(s.as_bytes())
            .ok()?;
        Some(Hash(bytes.try_into().ok()?))
    }
}

impl fmt::Display for Hash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&data_encoding::HEXLOWER.encode(&self.0))
    }
}

impl fmt::Debug for Hash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Hash({})", self.short())
    }
}

/// What a path is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum FileKind {
    /// A regular file.
    File,
    /// A directory.
    Dir,
    /// A symbolic link (stored as its target text, never followed).
    Symlink,
}

impl FileKind {
    /// Lower-case name, as in the journal and `--json` output.
    pub fn as_str(&self) -> &'static str {
        match self {
            FileKind::File => "file",
            FileKind::Dir => "dir",
            FileKind::Symlink => "symlink",
        }
    }

    /// Inverse of [`FileKind::as_str`].
    pub fn parse(s: &str) -> Option<FileKind> {
        match s {
            "file" => Some(FileKind::File),
            "dir" => Some(FileKind::Dir),
            "symlink" => Some(FileKind::Symlink),
            _ => None,
        }
    }
}

/// One content-defined chunk of a file: its length and blake3. Offsets are the running sum.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Chunk {
    /// Length in bytes.
    pub len: u32,
    /// blake3 of the chunk's bytes.
    pub hash: Hash,
}

/// Why a record from the wire or the journal is not acceptable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    /// The chunk lengths do not add up to the size, or a chunk is empty or too large.
    #[error("record for {0}: chunk list does not describe {1} bytes")]
    Chunks(RelPath, u64),
    /// A symlink target is empty, too long or contains NUL; or a non-symlink has a target.
    #[error("record for {0}: invalid symlink target")]
    Target(RelPath),
    /// A file's hash is not the one its chunk list gives ([`Hash::of_chunks`]).
    #[error("record for {0}: hash does not match its chunk list")]
    Hash(RelPath),
    /// The version vector is empty (every version has at least one edit).
    #[error("record for {0}: empty version vector")]
    NoVersion(RelPath),
}

/// Everything a device knows about one path's current version (or its deletion).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileRecord {
    /// Where it is.
    pub path: RelPath,
    /// What it is.
    pub kind: FileKind,
    /// A tombstone: the path was deleted in this version (the vector is kept).
    pub deleted: bool,
    /// Permission bits (masked by [`MODE_SYNC_MASK`]).
    pub mode: u32,
    /// Modification time, nanoseconds since the Unix epoch.
    pub mtime_ns: i64,
    /// Size in bytes (files), 0 otherwise.
    pub size: u64,
    /// The content hash ([`Hash::of_chunks`]) of a file, blake3 of a symlink's target; zero
    /// otherwise.
    pub hash: Hash,
    /// Content-defined chunks of a file (empty otherwise).
    pub chunks: Vec<Chunk>,
    /// A symlink's target (empty otherwise).
    pub target: String,
    /// The version's causal history.
    pub version: VersionVector,
    /// The device that made this version.
    pub modified_by: ShortId,
    /// The sending device's local journal sequence of this record (0 if not yet journaled).
    pub sequence: u64,
}

impl FileRecord {
    /// Whether two records describe the same content (kind, deletion, hash, target), ignoring
    /// metadata and history.
    pub fn same_content(&self, other: &FileRecord) -> bool {
        self.deleted == other.deleted
            && (self.deleted
                || (self.kind == other.kind
                    && self.hash == other.hash
                    && self.size == other.size
                    && self.target == other.target))
    }

    /// Whether content and replicated metadata (mode; mtime for files) are the same.
    pub fn same_state(&self, other: &FileRecord) -> bool {
        self.same_content(other)
            && (self.deleted
                || (self.mode == other.mode
                    && (self.kind != FileKind::File || self.mtime_ns == other.mtime_ns)))
    }

    /// Checks the rules a record must satisfy beyond its field types.
    pub fn validate(&self) -> Result<(), RecordError> {
        if self.version.is_empty() {
            return Err(RecordError::NoVersion(self.path.clone()));
        }
        let is_link = self.kind == FileKind::Symlink && !self.deleted;
        if is_link
            && (self.target.is_empty()
                || self.target.len() > MAX_LINK_TARGET
                || self.target.contains('\0'))
        {
            return Err(RecordError::Target(self.path.clone()));
        }
        if !is_link && !self.target.is_empty() {
            return Err(RecordError::Target(self.path.clone()));
        }
        if self.kind == FileKind::File && !self.deleted {
            let mut total: u64 = 0;
            for c in &self.chunks {
                if c.len == 0 || c.len > MAX_CHUNK_LEN {
                    return Err(RecordError::Chunks(self.path.clone(), self.size));
                }
                total += c.len as u64;
            }
            if total != self.size {
                return Err(RecordError::Chunks(self.path.clone(), self.size));
            }
            if Hash::of_chunks(&self.chunks) != self.hash {
                return Err(RecordError::Hash(self.path.clone()));
            }
        } else if !self.chunks.is_empty() {
            return Err(RecordError::Chunks(self.path.clone(), self.size));
        }
        Ok(())
    }

    /// The chunks with their byte offsets.
    pub fn chunk_offsets(&self) -> impl Iterator<Item = (u64, &Chunk)> {
        let mut off = 0u64;
        self.chunks.iter().map(move |c| {
            let o = off;
            off += c.len as u64;
            (o, c)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(data: &[u8]) -> Chunk {
        Chunk {
            len: data.len() as u32,
            hash: Hash::of(data),
        }
    }

    #[test]
    fn small_files_hash_as_their_content() {
        assert_eq!(Hash::of_chunks(&[]), Hash::of(b""));
        assert_eq!(Hash::of_chunks(&[chunk(b"hello")]), Hash::of(b"hello"));
    }

    #[test]
    fn a_chunk_list_hash_depends_on_order_and_lengths() {
        let (a, b) = (chunk(b"one"), chunk(b"two"));
        let ab = Hash::of_chunks(&[a, b]);
        assert_ne!(ab, Hash::of_chunks(&[b, a]));
        assert_ne!(ab, Hash::of(b"onetwo"));
        let longer = Chunk { len: 4, ..b };
        assert_ne!(ab, Hash::of_chunks(&[a, longer]));
        assert_eq!(ab, Hash::of_chunks(&[chunk(b"one"), chunk(b"two")]));
    }
}
