//! # meshfs-protocol: the vocabulary of meshfs and its wire format
//!
//! Every other meshfs crate speaks in these types: [`DeviceId`], [`FolderId`], [`RelPath`],
//! [`VersionVector`], [`FileRecord`] and the wire [`Message`]s with their frame codec.
//!
//! **Architecture invariant:** this crate is pure. It does no IO, spawns no tasks and reads no
//! clock; time and randomness come in as arguments. That is what lets the deterministic
//! simulation run many replicas in one thread with the same code the daemon runs.
//!
//! **Architecture invariant:** values are valid by construction. A `RelPath`, `DeviceId` or
//! `FolderId` can only be built through a constructor that checks every rule (also when
//! decoded from the wire), so a function that receives one never re-checks it.
#![deny(missing_docs)]

mod announce;
mod capped;
pub mod cdc;
mod codec;
mod ids;
mod limits;
mod message;
mod path;
mod record;
mod vv;

pub use announce::{
    AnnounceError, Announcement, WireAddr, ANNOUNCE_MAGIC, ANNOUNCE_VERSION, DISCOVERY_GROUP_V6,
    DISCOVERY_PORT, MAX_ANNOUNCED_ADDRS, MAX_ANNOUNCEMENT_LEN,
};
pub use codec::{
    decode_frame, decode_payload, encode_frame, encode_response_frame, finish_response, frame_len,
    response_layout, CodecError, FrameDecoder, FRAME_HEADER_LEN,
};
pub use ids::{DeviceId, DeviceIdError, FolderId, FolderIdError, ShortId};
pub use limits::{MAX_CHUNK_LEN, MAX_FRAME_LEN};
pub use message::{
    AddressList, ChunkRequest, ChunkResponse, ErrorCode, Held, Hello, HelloFolder, IndexAck,
    IndexBatch, LimitError, Message, PeerList, Probe, ScanState, SeekList,
    MAX_ADDRESSES_PER_DEVICE, MAX_DEVICE_NAME_LEN, MAX_ERROR_MESSAGE_LEN, MAX_FOLDERS_PER_HELLO,
    MAX_HASHES_PER_PROBE, MAX_HASHES_PER_REQUEST, MAX_PEERS_PER_LIST, MAX_RECORDS_PER_BATCH,
    MAX_SOUGHT_DEVICES, MAX_VV_ENTRIES_PER_BATCH, PROTOCOL_VERSION,
};
pub use path::{PathError, RelPath, INTERNAL_PREFIX, MAX_NAME_LEN, MAX_PATH_LEN};
pub use record::{
    Chunk, FileKind, FileRecord, Hash, RecordError, FILE_HASH_CONTEXT, MAX_CHUNKS_PER_RECORD,
    MAX_FILE_SIZE, MAX_KEPT_RECORD_LEN, MAX_LINK_TARGET, MIN_CHUNK_LEN, MODE_SYNC_MASK,
};
pub use vv::{
    spill_id, VersionVector, VvOrdering, MAX_VV_COUNTER, MAX_VV_ENTRIES, MAX_VV_ENTRIES_KEPT,
};
