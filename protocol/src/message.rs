//! The messages peers exchange. `docs/protocol.md` describes them field by field.
//!
//! A connection carries one *control stream* (the first bidirectional stream, opened by the
//! dialing side) with [`Message::Hello`], [`Message::Index`] and [`Message::IndexAck`], and any
//! number of *request streams* (bidirectional, opened by whichever side needs data), each
//! carrying one [`Message::Request`] answered by one [`Message::Response`] per requested chunk.

use crate::ids::FolderId;
use crate::record::{FileRecord, Hash};
use serde::{Deserialize, Serialize};

/// Version of the protocol described in `docs/protocol.md`; sent in [`Hello`].
pub const PROTOCOL_VERSION: u32 = 4;

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
}

/// Opening message of a session.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// [`PROTOCOL_VERSION`] of the sender.
    pub protocol_version: u32,
    /// The sender's human name for itself.
    pub device_name: String,
    /// The folders the sender shares with the receiver, with its resume points.
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
    /// in its journal yet, so its `max_sequence` says nothing about what content it has.
    pub scanning: bool,
}

/// A batch of one folder's records.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexBatch {
    /// The folder.
    pub folder: FolderId,
    /// Records with increasing `sequence` (the sender's journal sequence).
    pub records: Vec<FileRecord>,
    /// The sender's sequence this batch brings the receiver up to (≥ every record's sequence;
    /// records the receiver already has are skipped, so this may be larger).
    pub up_to: u64,
    /// Chunks the sender attaches so the receiver need not request them: the only chunk of
    /// small files among `records`. Unverified hints: the receiver checks each against its
    /// hash before use and requests anything missing or wrong as usual.
    pub inline: Vec<ChunkResponse>,
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
    /// The chunks wanted, answered in this order.
    pub hashes: Vec<Hash>,
}

/// One chunk, or why it is not there.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkResponse {
    /// Which chunk.
    pub hash: Hash,
    /// The bytes (possibly zstd-compressed), or `None` when the sender no longer has them.
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
