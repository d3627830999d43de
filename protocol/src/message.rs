//! The messages peers exchange. `docs/protocol.md` describes them field by field.
//!
//! A connection carries one *control stream* (the first bidirectional stream, opened by the
//! dialing side) with [`Message::Hello`], [`Message::Index`], [`Message::IndexAck`],
//! [`Message::Scan`], [`Message::Peers`], [`Message::Seek`] and [`Message::Addresses`], and any
//! number of *request streams* (bidirectional, opened by whichever side needs data), each
//! carrying one [`Message::Request`] answered by one [`Message::Response`] per requested chunk.
//!
//! Every list and text a peer sends is bounded ([`Message::check_limits`], `docs/protocol.md`
//! "Limits"): the decoder refuses a list over its cap as soon as its count is read, so what a
//! peer makes us allocate per frame stays near the frame's own size.

use crate::announce::WireAddr;
use crate::ids::{DeviceId, FolderId};
use crate::limits::MAX_CHUNK_LEN;
use crate::record::{FileRecord, Hash};
use serde::{Deserialize, Serialize};

/// Version of the protocol described in `docs/protocol.md`; sent in [`Hello`].
pub const PROTOCOL_VERSION: u32 = 10;

/// Most records in one [`IndexBatch`]. Also bounds its inline chunks (at most one per record).
pub const MAX_RECORDS_PER_BATCH: usize = 1000;
/// Most version vector entries the records of one [`IndexBatch`] carry together (262,144). An
/// entry decodes to 16 bytes however few it takes on the wire (two small varints, 2 bytes), so
/// this keeps what a batch decodes to near the frame's own size: at most 4 MiB of vectors. A
/// meshfs sender cuts its batches at [`crate::MAX_FRAME_LEN`] / 8 bytes of records, counting
/// 20 bytes an entry, so it puts at most 104,858 entries in a batch besides its first record's
/// 4,096.
pub const MAX_VV_ENTRIES_PER_BATCH: usize = 1 << 18;
/// Most hashes in one [`ChunkRequest`]: each makes the server find, read and send a chunk of
/// up to [`MAX_CHUNK_LEN`] bytes.
pub const MAX_HASHES_PER_REQUEST: usize = 64;
/// Most hashes in one [`Probe`]: each costs the server one index lookup, no read.
pub const MAX_HASHES_PER_PROBE: usize = 1024;
/// Most folders one [`Hello`] may list.
pub const MAX_FOLDERS_PER_HELLO: usize = 4096;
/// Longest [`Hello::device_name`], in bytes: it is kept for the session and shown in status.
pub const MAX_DEVICE_NAME_LEN: usize = 1024;
/// Longest [`Message::Error`] message, in bytes: it is logged.
pub const MAX_ERROR_MESSAGE_LEN: usize = 8192;
/// Most devices one [`PeerList`] may name.
pub const MAX_PEERS_PER_LIST: usize = 4096;
/// Most devices one [`SeekList`] may name.
pub const MAX_SOUGHT_DEVICES: usize = 4096;
/// Most addresses one [`AddressList`] may give.
pub const MAX_ADDRESSES_PER_DEVICE: usize = 16;

/// A message over one of the limits a receiver enforces (`docs/protocol.md`, "Limits").
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitError {
    /// An index batch with more than [`MAX_RECORDS_PER_BATCH`] records.
    #[error("index batch for folder {0} has {1} records, more than {MAX_RECORDS_PER_BATCH}")]
    Records(FolderId, usize),
    /// An index batch with more inline chunks than records.
    #[error("index batch for folder {folder} attaches {inline} inline chunks to {records} records; at most one per record")]
    Inline {
        /// The batch's folder.
        folder: FolderId,
        /// Inline chunks attached.
        inline: usize,
        /// Records in the batch.
        records: usize,
    },
    /// An index batch whose records' version vectors hold more than
    /// [`MAX_VV_ENTRIES_PER_BATCH`] entries together.
    #[error("index batch for folder {0} carries {1} version vector entries, more than {MAX_VV_ENTRIES_PER_BATCH}")]
    VersionEntries(FolderId, usize),
    /// A chunk request with more than [`MAX_HASHES_PER_REQUEST`] hashes.
    #[error(
        "chunk request for folder {0} asks for {1} chunks, more than {MAX_HASHES_PER_REQUEST}"
    )]
    Hashes(FolderId, usize),
    /// A chunk (a response or an inline chunk) of more than [`MAX_CHUNK_LEN`] bytes.
    #[error("chunk {} carries {} bytes, more than {MAX_CHUNK_LEN}", .0.short(), .1)]
    ChunkData(Hash, usize),
    /// A hello listing more than [`MAX_FOLDERS_PER_HELLO`] folders.
    #[error("hello lists {0} folders, more than {MAX_FOLDERS_PER_HELLO}")]
    Folders(usize),
    /// A device name longer than [`MAX_DEVICE_NAME_LEN`] bytes.
    #[error("hello gives a device name of {0} bytes, more than {MAX_DEVICE_NAME_LEN}")]
    DeviceName(usize),
    /// An error message longer than [`MAX_ERROR_MESSAGE_LEN`] bytes.
    #[error("error message of {0} bytes, more than {MAX_ERROR_MESSAGE_LEN}")]
    ErrorMessage(usize),
    /// A peer list naming more than [`MAX_PEERS_PER_LIST`] devices.
    #[error("peer list names {0} devices, more than {MAX_PEERS_PER_LIST}")]
    Peers(usize),
    /// A seek list naming more than [`MAX_SOUGHT_DEVICES`] devices.
    #[error("seek list names {0} devices, more than {MAX_SOUGHT_DEVICES}")]
    Sought(usize),
    /// An address list with more than [`MAX_ADDRESSES_PER_DEVICE`] addresses.
    #[error("address list gives {0} addresses, more than {MAX_ADDRESSES_PER_DEVICE}")]
    Addresses(usize),
    /// A probe of more than [`MAX_HASHES_PER_PROBE`] hashes, or an answer of more.
    #[error("probe names {0} chunks, more than {MAX_HASHES_PER_PROBE}")]
    Probe(usize),
}

/// A frame's payload.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Message {
    /// First message on the control stream, from both sides.
    Hello(Hello),
    /// Records of one folder, in the sender's sequence order.
    Index(IndexBatch),
    /// The receiver has processed the sender's records up to a sequence.
    IndexAck(IndexAck),
    /// A request for chunks (first and only message the requester sends on a request stream).
    Request(ChunkRequest),
    /// One requested chunk (or its absence), in request order.
    Response(ChunkResponse),
    /// The sender refuses something; the stream (or, on the control stream, the connection)
    /// ends after it.
    Error {
        /// What went wrong.
        code: ErrorCode,
        /// For people and logs.
        message: String,
    },
    /// How far the sender's first scan of a folder got since its Hello said it was scanning,
    /// or that it has finished (control stream only; version 6).
    Scan(ScanState),
    /// The other devices the sender has a connection to now and shares a folder with (control
    /// stream only; version 7): the receiver need not relay them their own new files' content.
    Peers(PeerList),
    /// The devices the sender wants to hear the addresses of (control stream only; version 8):
    /// each replaces the one before.
    Seek(SeekList),
    /// Where the sender reaches one device the receiver sought (control stream only; version
    /// 8).
    Addresses(AddressList),
    /// Asks whether the receiver holds chunks, without their data (first and only message the
    /// requester sends on a request stream; version 10): what an on-demand device asks before
    /// it evicts a file whose content it would otherwise trust a peer to hold.
    Probe(Probe),
    /// The answer to a [`Probe`], one flag per hash in its order (version 10).
    Held(Held),
}

/// Asks whether the receiver holds the chunks `hashes` of `folder`: whether it would answer a
/// [`ChunkRequest`] for each with its data now (from a file whose content is local, or a past
/// version it keeps).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Probe {
    /// The folder (must be shared with the requester).
    pub folder: FolderId,
    /// The chunks asked about (at most [`MAX_HASHES_PER_PROBE`]).
    #[serde(deserialize_with = "crate::capped::vec::<_, _, MAX_HASHES_PER_PROBE>")]
    pub hashes: Vec<Hash>,
}

/// Which chunks of a [`Probe`] the sender holds, in the probe's order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Held {
    /// One flag per hash asked about (at most [`MAX_HASHES_PER_PROBE`]).
    #[serde(deserialize_with = "crate::capped::vec::<_, _, MAX_HASHES_PER_PROBE>")]
    pub held: Vec<bool>,
}

/// The devices whose addresses the sender asks the receiver for: those it trusts and dials
/// wherever they are found ("dynamic"), other than the two ends. The receiver answers, now and
/// whenever that changes, with an [`AddressList`] for each that it trusts too and is connected
/// to. A list replaces the one before; before the first the receiver takes it as empty.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SeekList {
    /// Their full device ids (at most [`MAX_SOUGHT_DEVICES`]): only a device that already
    /// knows an id can ask where it is.
    #[serde(deserialize_with = "crate::capped::vec::<_, _, MAX_SOUGHT_DEVICES>")]
    pub devices: Vec<DeviceId>,
}

/// Where the sender reaches `device`: the remote address of its authenticated connection to
/// it (the address that device's packets come from). A hint for the receiver's dials: the
/// handshake still proves who answers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AddressList {
    /// The device (one the receiver sought).
    pub device: DeviceId,
    /// Its addresses (at most [`MAX_ADDRESSES_PER_DEVICE`]).
    #[serde(deserialize_with = "crate::capped::vec::<_, _, MAX_ADDRESSES_PER_DEVICE>")]
    pub addrs: Vec<WireAddr>,
}

/// The devices other than the receiver that the sender is connected to and shares a folder
/// with, as of sending; each list of a folder replaces the one before.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerList {
    /// The folder.
    pub folder: FolderId,
    /// Their short ids (at most [`MAX_PEERS_PER_LIST`]).
    #[serde(deserialize_with = "crate::capped::vec::<_, _, MAX_PEERS_PER_LIST>")]
    pub connected: Vec<crate::ShortId>,
}

/// Opening message of a session.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// [`PROTOCOL_VERSION`] of the sender.
    pub protocol_version: u32,
    /// The sender's human name for itself.
    pub device_name: String,
    /// The folders the sender shares with the receiver, with its resume points (at most
    /// [`MAX_FOLDERS_PER_HELLO`]).
    #[serde(deserialize_with = "crate::capped::vec::<_, _, MAX_FOLDERS_PER_HELLO>")]
    pub folders: Vec<HelloFolder>,
}

/// One shared folder in a [`Hello`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HelloFolder {
    /// The folder.
    pub folder: FolderId,
    /// The sender's index epoch for this folder (new when its journal is recreated).
    pub index_id: u64,
    /// The receiver's index epoch that `your_sequence` refers to (0: none).
    pub your_index_id: u64,
    /// Highest sequence of the receiver's records that the sender has applied.
    pub your_sequence: u64,
    /// The sender's highest journal sequence for this folder when it said hello.
    pub max_sequence: u64,
    /// The sender's first scan of this folder is still running: files on its disk may not be
    /// in its journal yet, so its `max_sequence` says nothing about what content it has. While
    /// it is true the sender reports the scan's progress and its end in [`Message::Scan`].
    pub scanning: bool,
    /// The sender keeps only part of this folder's content (its files are on demand there):
    /// its records and acknowledgements say which versions it knows, not that it holds their
    /// content. The receiver attaches no content to the index it sends, and never counts the
    /// sender as a holder of content it would otherwise drop as held elsewhere.
    pub partial: bool,
}

/// The sender's first scan of a folder, after a [`Hello`] that said it was scanning: still
/// running (with its progress), or finished. A sender says `scanning = false` once, last; the
/// receiver is not caught up with the sender until that has come and everything up to its
/// `max_sequence` is applied.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScanState {
    /// The folder.
    pub folder: FolderId,
    /// The scan is still running; `false`: it has finished, and every file it found is in the
    /// sender's index at a sequence ≤ `max_sequence`.
    pub scanning: bool,
    /// The sender's highest journal sequence of the folder when it sent this.
    pub max_sequence: u64,
    /// Files the scan has hashed so far (journaled with them, or about to be).
    pub files_hashed: u64,
    /// Their bytes.
    pub bytes_hashed: u64,
    /// Files the scan found and has not hashed yet (0 until its walk of the tree is done).
    pub files_left: u64,
}

/// A batch of one folder's records.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexBatch {
    /// The folder.
    pub folder: FolderId,
    /// Records with increasing `sequence` (the sender's journal sequence); at most
    /// [`MAX_RECORDS_PER_BATCH`], with at most [`MAX_VV_ENTRIES_PER_BATCH`] version vector
    /// entries together (refused at the record that passes it, before the next is decoded).
    #[serde(deserialize_with = "records")]
    pub records: Vec<FileRecord>,
    /// The sender's sequence this batch brings the receiver up to (≥ every record's sequence;
    /// records the receiver already has are skipped, so this may be larger).
    pub up_to: u64,
    /// Chunks the sender attaches so the receiver need not request them: the only chunk of
    /// small files among `records`. Unverified hints: the receiver checks each against its
    /// hash before use and requests anything missing or wrong as usual. At most one per record.
    #[serde(deserialize_with = "crate::capped::vec::<_, _, MAX_RECORDS_PER_BATCH>")]
    pub inline: Vec<ChunkResponse>,
}

impl IndexBatch {
    /// About the memory this batch holds once decoded: its records (each with its path,
    /// chunk list, target and vector) and its inline chunks. A receiver counts the batches it
    /// holds against a budget with it.
    pub fn held_bytes(&self) -> usize {
        std::mem::size_of::<IndexBatch>()
            + self.folder.as_str().len()
            + self
                .records
                .iter()
                .map(FileRecord::held_bytes)
                .sum::<usize>()
            + self
                .inline
                .iter()
                .map(|c| {
                    std::mem::size_of::<ChunkResponse>() + c.data.as_ref().map_or(0, Vec::capacity)
                })
                .sum::<usize>()
    }

    /// Version vector entries of its records together.
    pub fn vector_entries(&self) -> usize {
        self.records.iter().map(|r| r.version.entries().len()).sum()
    }
}

/// Decodes [`IndexBatch::records`]: at most [`MAX_RECORDS_PER_BATCH`] records (refused on the
/// declared count), with at most [`MAX_VV_ENTRIES_PER_BATCH`] vector entries together
/// (refused at the record that passes it). Nothing is reserved beyond a few records up front.
fn records<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<FileRecord>, D::Error> {
    use serde::de::{Error, SeqAccess, Visitor};
    struct Records;
    impl<'de> Visitor<'de> for Records {
        type Value = Vec<FileRecord>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(
                f,
                "at most {MAX_RECORDS_PER_BATCH} records with at most {MAX_VV_ENTRIES_PER_BATCH} version vector entries together"
            )
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<FileRecord>, A::Error> {
            let declared = seq.size_hint();
            if let Some(n) = declared.filter(|&n| n > MAX_RECORDS_PER_BATCH) {
                return Err(A::Error::invalid_length(n, &self));
            }
            let mut out = Vec::with_capacity(declared.unwrap_or(0).min(16));
            let mut entries = 0usize;
            while let Some(r) = seq.next_element::<FileRecord>()? {
                if out.len() == MAX_RECORDS_PER_BATCH {
                    return Err(A::Error::invalid_length(MAX_RECORDS_PER_BATCH + 1, &self));
                }
                entries += r.version.entries().len();
                if entries > MAX_VV_ENTRIES_PER_BATCH {
                    return Err(A::Error::invalid_value(
                        serde::de::Unexpected::Unsigned(entries as u64),
                        &self,
                    ));
                }
                out.push(r);
            }
            Ok(out)
        }
    }
    d.deserialize_seq(Records)
}

/// Acknowledges a peer's index up to a sequence.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexAck {
    /// The folder.
    pub folder: FolderId,
    /// Every record of the receiver's with a sequence ≤ this has been processed by the sender.
    pub sequence: u64,
}

/// Asks for chunks of one folder by hash.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkRequest {
    /// The folder whose files hold the chunks (must be shared with the requester).
    pub folder: FolderId,
    /// The chunks wanted, answered in this order (at most [`MAX_HASHES_PER_REQUEST`]).
    #[serde(deserialize_with = "crate::capped::vec::<_, _, MAX_HASHES_PER_REQUEST>")]
    pub hashes: Vec<Hash>,
}

/// One chunk, or why it is not there.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkResponse {
    /// Which chunk.
    pub hash: Hash,
    /// The bytes (possibly zstd-compressed), or `None` when the sender no longer has them; at
    /// most [`MAX_CHUNK_LEN`] (compression is used only when it saves).
    #[serde(with = "opt_bytes")]
    pub data: Option<Vec<u8>>,
    /// `data` is a zstd frame of the chunk.
    pub compressed: bool,
}

/// Why a peer refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorCode {
    /// Incompatible [`PROTOCOL_VERSION`].
    Version,
    /// The folder is not shared with the requester.
    NotShared,
    /// A frame could not be decoded or broke the protocol.
    BadFrame,
    /// The sender is shutting down.
    Shutdown,
    /// Anything else; see the message.
    Internal,
}

impl Message {
    /// Checks every count and length a receiver bounds (`docs/protocol.md`, "Limits"), except
    /// those of records, which [`FileRecord::validate`] checks. The decoder runs it on every
    /// message; a sender may run it on what it is about to send.
    pub fn check_limits(&self) -> Result<(), LimitError> {
        let chunk = |c: &ChunkResponse| match &c.data {
            Some(d) if d.len() > MAX_CHUNK_LEN as usize => {
                Err(LimitError::ChunkData(c.hash, d.len()))
            }
            _ => Ok(()),
        };
        match self {
            Message::Hello(h) => {
                if h.folders.len() > MAX_FOLDERS_PER_HELLO {
                    return Err(LimitError::Folders(h.folders.len()));
                }
                if h.device_name.len() > MAX_DEVICE_NAME_LEN {
                    return Err(LimitError::DeviceName(h.device_name.len()));
                }
            }
            Message::Index(b) => {
                if b.records.len() > MAX_RECORDS_PER_BATCH {
                    return Err(LimitError::Records(b.folder.clone(), b.records.len()));
                }
                let entries = b.vector_entries();
                if entries > MAX_VV_ENTRIES_PER_BATCH {
                    return Err(LimitError::VersionEntries(b.folder.clone(), entries));
                }
                if b.inline.len() > b.records.len() {
                    return Err(LimitError::Inline {
                        folder: b.folder.clone(),
                        inline: b.inline.len(),
                        records: b.records.len(),
                    });
                }
                b.inline.iter().try_for_each(chunk)?;
            }
            Message::IndexAck(_) | Message::Scan(_) => {}
            Message::Peers(p) => {
                if p.connected.len() > MAX_PEERS_PER_LIST {
                    return Err(LimitError::Peers(p.connected.len()));
                }
            }
            Message::Seek(s) => {
                if s.devices.len() > MAX_SOUGHT_DEVICES {
                    return Err(LimitError::Sought(s.devices.len()));
                }
            }
            Message::Addresses(a) => {
                if a.addrs.len() > MAX_ADDRESSES_PER_DEVICE {
                    return Err(LimitError::Addresses(a.addrs.len()));
                }
            }
            Message::Request(r) => {
                if r.hashes.len() > MAX_HASHES_PER_REQUEST {
                    return Err(LimitError::Hashes(r.folder.clone(), r.hashes.len()));
                }
            }
            Message::Response(c) => chunk(c)?,
            Message::Probe(p) => {
                if p.hashes.len() > MAX_HASHES_PER_PROBE {
                    return Err(LimitError::Probe(p.hashes.len()));
                }
            }
            Message::Held(h) => {
                if h.held.len() > MAX_HASHES_PER_PROBE {
                    return Err(LimitError::Probe(h.held.len()));
                }
            }
            Message::Error { message, .. } => {
                if message.len() > MAX_ERROR_MESSAGE_LEN {
                    return Err(LimitError::ErrorMessage(message.len()));
                }
            }
        }
        Ok(())
    }
}

mod opt_bytes {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &Option<Vec<u8>>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(b) => s.serialize_some(serde_bytes::Bytes::new(b)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u8>>, D::Error> {
        Ok(Option::<serde_bytes::ByteBuf>::deserialize(d)?.map(|b| b.into_vec()))
    }
}

#[cfg(test)]
mod limits {
    use super::*;
    use crate::{decode_payload, encode_frame, CodecError, FileKind, RelPath, ShortId};
    use crate::{VersionVector, FRAME_HEADER_LEN};

    fn folder() -> FolderId {
        FolderId::new("f").unwrap()
    }

    fn dir(i: usize) -> FileRecord {
        FileRecord {
            path: RelPath::new(&format!("d{i}")).unwrap(),
            kind: FileKind::Dir,
            deleted: false,
            mode: 0o755,
            mtime_ns: 0,
            size: 0,
            hash: Hash::ZERO,
            chunks: Vec::new(),
            target: String::new(),
            version: VersionVector::from_pairs([(ShortId(1), 1)]),
            modified_by: ShortId(1),
            sequence: i as u64 + 1,
        }
    }

    fn batch(records: usize, inline: usize) -> Message {
        Message::Index(IndexBatch {
            folder: folder(),
            records: (0..records).map(dir).collect(),
            up_to: records as u64,
            inline: (0..inline)
                .map(|i| ChunkResponse {
                    hash: Hash::of(&i.to_le_bytes()),
                    data: None,
                    compressed: false,
                })
                .collect(),
        })
    }

    fn request(hashes: usize) -> Message {
        Message::Request(ChunkRequest {
            folder: folder(),
            hashes: (0..hashes).map(|i| Hash::of(&i.to_le_bytes())).collect(),
        })
    }

    fn response(len: usize) -> Message {
        Message::Response(ChunkResponse {
            hash: Hash::ZERO,
            data: Some(vec![7; len]),
            compressed: false,
        })
    }

    fn hello(folders: usize, name_len: usize) -> Message {
        Message::Hello(Hello {
            protocol_version: PROTOCOL_VERSION,
            device_name: "n".repeat(name_len),
            folders: (0..folders)
                .map(|i| HelloFolder {
                    folder: FolderId::new(&format!("f{i}")).unwrap(),
                    index_id: 1,
                    your_index_id: 0,
                    your_sequence: 0,
                    max_sequence: 0,
                    scanning: false,
                    partial: false,
                })
                .collect(),
        })
    }

    fn error(len: usize) -> Message {
        Message::Error {
            code: ErrorCode::Internal,
            message: "e".repeat(len),
        }
    }

    /// What a receiver makes of `msg` on the wire.
    fn received(msg: &Message) -> Result<Message, CodecError> {
        decode_payload(&encode_frame(msg).unwrap()[FRAME_HEADER_LEN..])
    }

    /// `at` is accepted (checked and received), one more is refused both ways.
    fn bounded(at: Message, over: Message, want: LimitError) {
        assert_eq!(at.check_limits(), Ok(()));
        assert_eq!(received(&at).as_ref(), Ok(&at));
        assert_eq!(over.check_limits(), Err(want));
        assert!(matches!(received(&over), Err(CodecError::Malformed(_))));
    }

    #[test]
    fn a_batch_holds_at_most_max_records_per_batch_records() {
        bounded(
            batch(MAX_RECORDS_PER_BATCH, 0),
            batch(MAX_RECORDS_PER_BATCH + 1, 0),
            LimitError::Records(folder(), MAX_RECORDS_PER_BATCH + 1),
        );
    }

    /// A batch of `records` directories whose vectors hold `entries` entries together (small
    /// device ids and counters: two bytes an entry on the wire, 16 decoded).
    fn long_vectors(records: usize, entries: usize) -> Message {
        let mut left = entries;
        let recs = (0..records)
            .map(|i| {
                let n = left.div_ceil(records - i).min(crate::MAX_VV_ENTRIES);
                left -= n;
                FileRecord {
                    version: VersionVector::from_pairs((1..=n as u64).map(|d| (ShortId(d), 1))),
                    ..dir(i)
                }
            })
            .collect();
        Message::Index(IndexBatch {
            folder: folder(),
            records: recs,
            up_to: records as u64,
            inline: Vec::new(),
        })
    }

    #[test]
    fn a_batch_carries_at_most_max_vv_entries_per_batch_vector_entries() {
        bounded(
            long_vectors(70, MAX_VV_ENTRIES_PER_BATCH),
            long_vectors(70, MAX_VV_ENTRIES_PER_BATCH + 1),
            LimitError::VersionEntries(folder(), MAX_VV_ENTRIES_PER_BATCH + 1),
        );
    }

    #[test]
    fn what_a_batch_decodes_to_stays_near_its_frame() {
        // Vectors of the smallest entries the wire allows: the most a frame decodes to.
        let msg = long_vectors(70, MAX_VV_ENTRIES_PER_BATCH);
        let wire = encode_frame(&msg).unwrap().len();
        let Ok(Message::Index(b)) = received(&msg) else {
            panic!("refused")
        };
        let held = b.held_bytes();
        assert!(held <= 5 << 20, "{held} bytes held for a frame of {wire}");
        assert!(held >= MAX_VV_ENTRIES_PER_BATCH * 16);
    }

    #[test]
    fn a_batch_attaches_at_most_one_inline_chunk_per_record() {
        bounded(
            batch(3, 3),
            batch(3, 4),
            LimitError::Inline {
                folder: folder(),
                inline: 4,
                records: 3,
            },
        );
    }

    #[test]
    fn a_request_asks_for_at_most_max_hashes_per_request_chunks() {
        bounded(
            request(MAX_HASHES_PER_REQUEST),
            request(MAX_HASHES_PER_REQUEST + 1),
            LimitError::Hashes(folder(), MAX_HASHES_PER_REQUEST + 1),
        );
    }

    #[test]
    fn a_chunk_carries_at_most_max_chunk_len_bytes() {
        let len = MAX_CHUNK_LEN as usize;
        bounded(
            response(len),
            response(len + 1),
            LimitError::ChunkData(Hash::ZERO, len + 1),
        );
        // Inline chunks too.
        let Message::Index(mut b) = batch(1, 0) else {
            unreachable!()
        };
        b.inline.push(ChunkResponse {
            hash: Hash::ZERO,
            data: Some(vec![0; len + 1]),
            compressed: true,
        });
        assert_eq!(
            Message::Index(b).check_limits(),
            Err(LimitError::ChunkData(Hash::ZERO, len + 1))
        );
    }

    #[test]
    fn a_peer_list_names_at_most_max_peers_per_list_devices() {
        let list = |n: u64| {
            Message::Peers(PeerList {
                folder: folder(),
                connected: (0..n).map(crate::ShortId).collect(),
            })
        };
        bounded(
            list(MAX_PEERS_PER_LIST as u64),
            list(MAX_PEERS_PER_LIST as u64 + 1),
            LimitError::Peers(MAX_PEERS_PER_LIST + 1),
        );
    }

    #[test]
    fn a_seek_list_names_at_most_max_sought_devices() {
        let list = |n: usize| {
            Message::Seek(SeekList {
                devices: (0..n)
                    .map(|i| DeviceId::from_bytes([(i % 251) as u8; 32]))
                    .collect(),
            })
        };
        bounded(
            list(MAX_SOUGHT_DEVICES),
            list(MAX_SOUGHT_DEVICES + 1),
            LimitError::Sought(MAX_SOUGHT_DEVICES + 1),
        );
    }

    #[test]
    fn an_address_list_gives_at_most_max_addresses_per_device() {
        let list = |n: u16| {
            Message::Addresses(AddressList {
                device: DeviceId::from_bytes([3; 32]),
                addrs: (0..n)
                    .map(|port| WireAddr::V4 {
                        ip: [10, 0, 0, 1],
                        port,
                    })
                    .collect(),
            })
        };
        bounded(
            list(MAX_ADDRESSES_PER_DEVICE as u16),
            list(MAX_ADDRESSES_PER_DEVICE as u16 + 1),
            LimitError::Addresses(MAX_ADDRESSES_PER_DEVICE + 1),
        );
    }

    #[test]
    fn a_hello_lists_at_most_max_folders_per_hello_folders() {
        bounded(
            hello(MAX_FOLDERS_PER_HELLO, 1),
            hello(MAX_FOLDERS_PER_HELLO + 1, 1),
            LimitError::Folders(MAX_FOLDERS_PER_HELLO + 1),
        );
    }

    #[test]
    fn a_device_name_is_at_most_max_device_name_len_bytes() {
        bounded(
            hello(1, MAX_DEVICE_NAME_LEN),
            hello(1, MAX_DEVICE_NAME_LEN + 1),
            LimitError::DeviceName(MAX_DEVICE_NAME_LEN + 1),
        );
    }

    #[test]
    fn an_error_message_is_at_most_max_error_message_len_bytes() {
        bounded(
            error(MAX_ERROR_MESSAGE_LEN),
            error(MAX_ERROR_MESSAGE_LEN + 1),
            LimitError::ErrorMessage(MAX_ERROR_MESSAGE_LEN + 1),
        );
    }

    #[test]
    fn a_list_declared_over_its_cap_is_refused_by_its_count() {
        // Request "f" declaring a million hashes, followed by a million bytes: refused for its
        // count, not read until the bytes run out.
        let mut payload = vec![3, 1, b'f', 0xc0, 0x84, 0x3d]; // varint 1,000,000
        payload.resize(payload.len() + 1_000_000, 0);
        match decode_payload(&payload) {
            Err(CodecError::Malformed(m)) => assert!(m.contains("over its limit"), "{m}"),
            other => panic!("{other:?}"),
        }
    }
}
