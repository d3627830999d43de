//! [`FileRecord`]: what a device knows about one path, and the chunk list of its content.
//!
//! [`FileRecord::validate`] holds every rule a record from a peer or the journal must keep
//! beyond its field types, including the bounds on what it may declare
//! ([`MAX_CHUNKS_PER_RECORD`], [`MAX_FILE_SIZE`]).

use crate::ids::ShortId;
use crate::limits::{MAX_CHUNK_LEN, MAX_FRAME_LEN};
use crate::path::RelPath;
use crate::vv::{VersionVector, MAX_VV_ENTRIES_KEPT};
use serde::{Deserialize, Serialize};
use std::fmt;

/// Mode bits that are replicated: permissions and the sticky bit; setuid/setgid never are.
pub const MODE_SYNC_MASK: u32 = 0o1777;
/// Longest symlink target accepted, in bytes.
pub const MAX_LINK_TARGET: usize = 4095;
/// Most chunks one record may list (524,288). No frame can carry more, since each chunk takes
/// at least its 32-byte hash; the bound is stated so that a record is refused for it on its
/// own, before its chunks are held, hashed or planned as transfers, wherever it came from.
pub const MAX_CHUNKS_PER_RECORD: usize = MAX_FRAME_LEN / 32;
/// Largest size a file record may declare (2 TiB): [`MAX_CHUNKS_PER_RECORD`] chunks of
/// [`MAX_CHUNK_LEN`]. Files chunk to about 1 MiB on average above 16 GiB, so in practice a
/// record describes files up to about 450 GiB before its chunk list outgrows a frame.
pub const MAX_FILE_SIZE: u64 = MAX_CHUNKS_PER_RECORD as u64 * MAX_CHUNK_LEN as u64;
/// The shortest chunk meshfs's chunker cuts anywhere but at a file's end (16 KiB: the least of
/// its minimum sizes, D8). A record listing a shorter chunk elsewhere was not made by it, and a
/// receiver refuses to apply it ([`FileRecord::check_chunking`]): the work a chunk costs it
/// (looking it up, asking for it, writing it) then stays proportional to the bytes the record
/// declares, which it must have room for.
pub const MIN_CHUNK_LEN: u32 = 16 << 10;
/// Largest encoded record a device keeps: an index batch holding it alone still fits in a
/// frame after one more local edit (its vector one entry longer, its sequence a full varint),
/// with room to spare for the batch's own fields.
pub const MAX_KEPT_RECORD_LEN: usize = MAX_FRAME_LEN - 4096;
/// Wire bytes of a record beyond its path, target, chunks and vector entries, at most: the
/// length prefixes and every fixed or varint field at its longest.
const RECORD_FIXED_MAX: usize = 96;
/// Wire bytes of one chunk at most (a `u32` varint and the hash).
const CHUNK_MAX: usize = 5 + 32;
/// Wire bytes of one version vector entry at most (two `u64` varints).
const VV_ENTRY_MAX: usize = 10 + 10;
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
    /// The chunk list is longer than [`MAX_CHUNKS_PER_RECORD`].
    #[error("record for {0}: {1} chunks, more than the {MAX_CHUNKS_PER_RECORD} a record may list")]
    TooManyChunks(RelPath, usize),
    /// A file declares more than [`MAX_FILE_SIZE`] bytes.
    #[error(
        "record for {0}: declares {1} bytes, more than the {MAX_FILE_SIZE} a record may describe"
    )]
    TooLarge(RelPath, u64),
    /// Mode bits outside [`MODE_SYNC_MASK`] (setuid, setgid, file type bits).
    #[error("record for {0}: mode {1:#o} has bits outside {MODE_SYNC_MASK:#o}")]
    Mode(RelPath, u32),
    /// A symlink target is empty, too long or contains NUL; or a non-symlink has a target.
    #[error("record for {0}: invalid symlink target")]
    Target(RelPath),
    /// A file's hash is not the one its chunk list gives ([`Hash::of_chunks`]), or a
    /// symlink's is not blake3 of its target.
    #[error("record for {0}: hash does not match its chunk list or symlink target")]
    Hash(RelPath),
    /// The version vector is empty (every version has at least one edit).
    #[error("record for {0}: empty version vector")]
    NoVersion(RelPath),
    /// A version vector longer than a device keeps ([`MAX_VV_ENTRIES_KEPT`]): after this
    /// device's next edit no peer would accept it.
    #[error("record for {0}: its version vector would have {1} entries, more than the {MAX_VV_ENTRIES_KEPT} a device keeps so that its edits stay sendable")]
    VersionTooLong(RelPath, usize),
    /// A chunk shorter than [`MIN_CHUNK_LEN`] that is not the file's last: no meshfs chunker
    /// cuts one, and a receiver does not apply the record.
    #[error("record for {0}: chunk {1} of its list is {2} bytes, shorter than the {MIN_CHUNK_LEN} meshfs cuts anywhere but at a file's end; not applied here")]
    ShortChunk(RelPath, usize, u32),
    /// A record whose encoding is longer than a device keeps ([`MAX_KEPT_RECORD_LEN`]): it
    /// could not be sent on in a frame.
    #[error("record for {0}: {1} bytes encoded, more than the {MAX_KEPT_RECORD_LEN} a device keeps so that it stays sendable")]
    TooLongToSend(RelPath, usize),
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
    /// Content-defined chunks of a file (empty otherwise); at most [`MAX_CHUNKS_PER_RECORD`].
    #[serde(deserialize_with = "crate::capped::vec::<_, _, MAX_CHUNKS_PER_RECORD>")]
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

    /// Checks the rules a record must satisfy beyond its field types. Linear in the chunk
    /// list, which is at most [`MAX_CHUNKS_PER_RECORD`] long.
    pub fn validate(&self) -> Result<(), RecordError> {
        if self.version.is_empty() {
            return Err(RecordError::NoVersion(self.path.clone()));
        }
        if self.mode & !MODE_SYNC_MASK != 0 {
            return Err(RecordError::Mode(self.path.clone(), self.mode));
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
        if is_link && self.hash != Hash::of(self.target.as_bytes()) {
            return Err(RecordError::Hash(self.path.clone()));
        }
        if self.kind == FileKind::File && !self.deleted {
            if self.chunks.len() > MAX_CHUNKS_PER_RECORD {
                return Err(RecordError::TooManyChunks(
                    self.path.clone(),
                    self.chunks.len(),
                ));
            }
            if self.size > MAX_FILE_SIZE {
                return Err(RecordError::TooLarge(self.path.clone(), self.size));
            }
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

    /// Bytes of this record's wire encoding.
    pub fn encoded_len(&self) -> usize {
        // The `Size` flavor only counts: it cannot fail, and allocates nothing.
        postcard::serialize_with_flavor(self, postcard::ser_flavors::Size::default())
            .unwrap_or(usize::MAX)
    }

    /// Checks that a device may keep this record: every peer accepts it, also after one more
    /// local edit. A received record passed the decoder, but the records a device makes from
    /// it (a merge of two histories, a revived parent) can outgrow what a peer accepts; kept,
    /// such a record would be refused by every peer, after every edit, for good. Costs little
    /// unless the record is close to the frame limit (then one pass that counts its bytes).
    pub fn check_sendable(&self) -> Result<(), RecordError> {
        let entries = self.version.entries().len();
        if entries > MAX_VV_ENTRIES_KEPT {
            return Err(RecordError::VersionTooLong(self.path.clone(), entries));
        }
        let at_most = RECORD_FIXED_MAX
            + self.path.as_str().len()
            + self.target.len()
            + self.chunks.len() * CHUNK_MAX
            + entries * VV_ENTRY_MAX;
        if at_most <= MAX_KEPT_RECORD_LEN {
            return Ok(());
        }
        match self.encoded_len() {
            len if len > MAX_KEPT_RECORD_LEN => {
                Err(RecordError::TooLongToSend(self.path.clone(), len))
            }
            _ => Ok(()),
        }
    }

    /// About the memory this record holds: the struct, its path, target, chunk list and vector.
    pub fn held_bytes(&self) -> usize {
        std::mem::size_of::<FileRecord>()
            + self.path.as_str().len()
            + self.target.capacity()
            + self.chunks.capacity() * std::mem::size_of::<Chunk>()
            + self.version.held_bytes()
    }

    /// Checks that the chunk list is one meshfs's chunker makes: no chunk shorter than
    /// [`MIN_CHUNK_LEN`] but the last, so a file of `size` bytes lists at most
    /// `size / MIN_CHUNK_LEN + 1` chunks. Not a wire rule (the frame stays valid, and a record
    /// kept by an older receiver can still be relayed): a receiver checks it before applying.
    pub fn check_chunking(&self) -> Result<(), RecordError> {
        let last = self.chunks.len().saturating_sub(1);
        match self.chunks[..last]
            .iter()
            .position(|c| c.len < MIN_CHUNK_LEN)
        {
            Some(i) => Err(RecordError::ShortChunk(
                self.path.clone(),
                i,
                self.chunks[i].len,
            )),
            None => Ok(()),
        }
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
    use crate::vv::VersionVector;

    fn chunk(data: &[u8]) -> Chunk {
        Chunk {
            len: data.len() as u32,
            hash: Hash::of(data),
        }
    }

    #[test]
    fn short_chunks_are_a_files_last_or_the_record_is_not_one_meshfs_makes() {
        let min = |n: u8| Chunk {
            len: MIN_CHUNK_LEN,
            hash: Hash::of(&[n]),
        };
        assert_eq!(file(vec![]).check_chunking(), Ok(()));
        assert_eq!(file(vec![chunk(b"one byte")]).check_chunking(), Ok(()));
        assert_eq!(
            file(vec![min(1), min(2), chunk(b"tail")]).check_chunking(),
            Ok(())
        );
        assert_eq!(
            file(vec![min(1), chunk(b"x"), min(2)]).check_chunking(),
            Err(RecordError::ShortChunk(RelPath::new("f").unwrap(), 1, 1))
        );
        // Half a million one-byte chunks: refused at the first.
        let tiny = vec![chunk(b"y"); 500_000];
        assert!(matches!(
            file(tiny).check_chunking(),
            Err(RecordError::ShortChunk(_, 0, 1))
        ));
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

    fn file(chunks: Vec<Chunk>) -> FileRecord {
        FileRecord {
            path: RelPath::new("f").unwrap(),
            kind: FileKind::File,
            deleted: false,
            mode: 0o644,
            mtime_ns: 0,
            size: chunks.iter().map(|c| c.len as u64).sum(),
            hash: Hash::of_chunks(&chunks),
            chunks,
            target: String::new(),
            version: VersionVector::from_pairs([(ShortId(1), 1)]),
            modified_by: ShortId(1),
            sequence: 1,
        }
    }

    fn link(target: &str) -> FileRecord {
        FileRecord {
            kind: FileKind::Symlink,
            mode: 0o777,
            size: 0,
            hash: Hash::of(target.as_bytes()),
            chunks: Vec::new(),
            target: target.into(),
            ..file(Vec::new())
        }
    }

    #[test]
    fn mode_bits_outside_the_sync_mask_are_refused() {
        for mode in [0o644, 0o1777, 0o000] {
            assert_eq!(
                FileRecord {
                    mode,
                    ..file(vec![])
                }
                .validate(),
                Ok(())
            );
        }
        let path = RelPath::new("f").unwrap();
        // setuid, setgid, and a file type that a stat mode would carry.
        for mode in [0o4755, 0o2755, 0o100644, u32::MAX] {
            assert_eq!(
                FileRecord {
                    mode,
                    ..file(vec![])
                }
                .validate(),
                Err(RecordError::Mode(path.clone(), mode))
            );
        }
    }

    #[test]
    fn a_record_lists_at_most_max_chunks_per_record_chunks() {
        let c = chunk(b"x");
        assert_eq!(file(vec![c; MAX_CHUNKS_PER_RECORD]).validate(), Ok(()));
        assert_eq!(
            file(vec![c; MAX_CHUNKS_PER_RECORD + 1]).validate(),
            Err(RecordError::TooManyChunks(
                RelPath::new("f").unwrap(),
                MAX_CHUNKS_PER_RECORD + 1
            ))
        );
    }

    #[test]
    fn a_chunk_count_over_the_cap_is_refused_when_decoded() {
        // Encode a record with no chunks and patch its chunk count (the first byte that
        // differs from the same record with a chunk) to the cap plus one, with as many
        // chunks' worth of bytes after it: refused for the count, before reading them.
        let empty = postcard::to_allocvec(&file(vec![])).unwrap();
        let one = postcard::to_allocvec(&FileRecord {
            chunks: vec![chunk(b"x")],
            ..file(vec![])
        })
        .unwrap();
        let at = empty.iter().zip(&one).position(|(a, b)| a != b).unwrap();
        let mut bytes = empty[..at].to_vec();
        bytes.extend_from_slice(&[0x81, 0x80, 0x20]); // varint 524,289
        bytes.resize(bytes.len() + 33 * (MAX_CHUNKS_PER_RECORD + 1), 1);
        assert_eq!(
            postcard::from_bytes::<FileRecord>(&bytes),
            Err(postcard::Error::SerdeDeCustom)
        );
    }

    #[test]
    fn a_file_declares_at_most_max_file_size_bytes() {
        let max = file(vec![
            Chunk {
                len: MAX_CHUNK_LEN,
                hash: Hash::ZERO,
            };
            MAX_CHUNKS_PER_RECORD
        ]);
        assert_eq!(max.size, MAX_FILE_SIZE);
        assert_eq!(max.validate(), Ok(()));
        let over = FileRecord {
            size: MAX_FILE_SIZE + 1,
            ..file(vec![chunk(b"x")])
        };
        assert_eq!(
            over.validate(),
            Err(RecordError::TooLarge(
                RelPath::new("f").unwrap(),
                MAX_FILE_SIZE + 1
            ))
        );
    }

    #[test]
    fn a_symlinks_hash_is_blake3_of_its_target() {
        assert_eq!(link("../t").validate(), Ok(()));
        let wrong = FileRecord {
            hash: Hash::of(b"elsewhere"),
            ..link("../t")
        };
        assert_eq!(
            wrong.validate(),
            Err(RecordError::Hash(RelPath::new("f").unwrap()))
        );
    }

    #[test]
    fn a_symlink_target_is_at_most_max_link_target_bytes() {
        assert_eq!(link(&"t".repeat(MAX_LINK_TARGET)).validate(), Ok(()));
        assert_eq!(
            link(&"t".repeat(MAX_LINK_TARGET + 1)).validate(),
            Err(RecordError::Target(RelPath::new("f").unwrap()))
        );
    }

    /// A record with every field at its longest: the bound the cheap check uses must hold.
    fn longest(chunks: usize, entries: usize) -> FileRecord {
        // Two-byte characters: 127 of them make a 254-byte component.
        let component = "\u{e9}".repeat(127);
        let mut path = vec![component.as_str(); 13].join("/");
        while path.len() > crate::MAX_PATH_LEN {
            path.pop();
        }
        FileRecord {
            path: RelPath::new(&path).unwrap(),
            mode: MODE_SYNC_MASK,
            mtime_ns: i64::MIN,
            size: u64::MAX,
            chunks: vec![
                Chunk {
                    len: u32::MAX,
                    hash: Hash::ZERO
                };
                chunks
            ],
            version: VersionVector::from_pairs(
                (0..entries as u64).map(|i| (ShortId(u64::MAX - i), u64::MAX)),
            ),
            modified_by: ShortId(u64::MAX),
            sequence: u64::MAX,
            ..file(Vec::new())
        }
    }

    #[test]
    fn the_cheap_length_bound_is_never_below_the_encoding() {
        for (chunks, entries) in [(0, 0), (1, 1), (3, 4096), (1000, 10)] {
            let r = longest(chunks, entries);
            let bound = RECORD_FIXED_MAX
                + r.path.as_str().len()
                + r.target.len()
                + chunks * CHUNK_MAX
                + entries * VV_ENTRY_MAX;
            assert!(
                r.encoded_len() <= bound,
                "{chunks} chunks, {entries} entries"
            );
            assert_eq!(r.encoded_len(), postcard::to_allocvec(&r).unwrap().len());
        }
        let link = FileRecord {
            target: "t".repeat(MAX_LINK_TARGET),
            ..longest(0, 1)
        };
        let bound = RECORD_FIXED_MAX + link.path.as_str().len() + MAX_LINK_TARGET + VV_ENTRY_MAX;
        assert!(link.encoded_len() <= bound);
    }

    #[test]
    fn a_record_is_kept_only_if_it_stays_sendable() {
        let entries = |n: u64| VersionVector::from_pairs((1..=n).map(|d| (ShortId(d), 1)));
        let kept = FileRecord {
            version: entries(MAX_VV_ENTRIES_KEPT as u64),
            ..file(vec![])
        };
        assert_eq!(kept.check_sendable(), Ok(()));
        let long = FileRecord {
            version: entries(MAX_VV_ENTRIES_KEPT as u64 + 1),
            ..file(vec![])
        };
        assert_eq!(
            long.check_sendable(),
            Err(RecordError::VersionTooLong(
                long.path.clone(),
                MAX_VV_ENTRIES_KEPT + 1
            ))
        );
        // One-byte chunks take 33 bytes each, less than the cheap bound counts: a record the
        // bound alone would refuse is measured, and kept when it fits.
        let c = chunk(b"x");
        let fits = file(vec![c; MAX_KEPT_RECORD_LEN / 35]);
        assert!(fits.chunks.len() * CHUNK_MAX > MAX_KEPT_RECORD_LEN);
        assert_eq!(fits.check_sendable(), Ok(()));
        let over = file(vec![c; MAX_KEPT_RECORD_LEN / 33 + 1]);
        assert!(matches!(
            over.check_sendable(),
            Err(RecordError::TooLongToSend(_, n)) if n > MAX_KEPT_RECORD_LEN
        ));
    }
}
