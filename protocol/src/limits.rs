//! The two sizes the wire's other bounds are derived from: a frame's payload and a chunk.
//!
//! They live apart from the codec and the record so that both (and the messages between them)
//! can depend on them without depending on each other: the codec frames messages, messages
//! carry records, and a record's chunk list is bounded by what one frame can carry.

/// Largest payload accepted or produced (16 MiB).
pub const MAX_FRAME_LEN: usize = 16 << 20;
/// Largest chunk accepted on the wire, in bytes.
pub const MAX_CHUNK_LEN: u32 = 4 << 20;
