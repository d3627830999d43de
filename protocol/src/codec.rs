//! The frame codec: `u32` big-endian payload length, then the payload (a postcard-encoded
//! [`Message`]). Decoding checks the length against [`MAX_FRAME_LEN`] before allocating, never
//! panics, refuses any list over its cap before reading it, and checks every limit
//! ([`Message::check_limits`]) and every record it carries ([`crate::FileRecord::validate`]).

use crate::limits::MAX_FRAME_LEN;
use crate::message::Message;

/// Bytes of the length prefix.
pub const FRAME_HEADER_LEN: usize = 4;

/// Why bytes are not a frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    /// The length prefix announces more than [`MAX_FRAME_LEN`].
    #[error("frame of {0} bytes exceeds the {MAX_FRAME_LEN}-byte limit")]
    TooLarge(usize),
    /// The payload is not a valid message.
    #[error("malformed frame: {0}")]
    Malformed(String),
}

/// Encodes `msg` as one frame (header + payload).
pub fn encode_frame(msg: &Message) -> Result<Vec<u8>, CodecError> {
    // Sized for the chunk bytes a frame carries, so a 4 MiB chunk is not copied again and
    // again as the buffer doubles.
    let data = |c: &crate::ChunkResponse| c.data.as_ref().map_or(0, Vec::len);
    let payload = match msg {
        Message::Response(c) => data(c),
        Message::Index(b) => b.inline.iter().map(data).sum::<usize>() + b.records.len() * 128,
        _ => 0,
    };
    let mut out = Vec::with_capacity(FRAME_HEADER_LEN + 256 + payload);
    out.resize(FRAME_HEADER_LEN, 0);
    let mut out =
        postcard::to_extend(msg, out).map_err(|e| CodecError::Malformed(e.to_string()))?;
    let len = out.len() - FRAME_HEADER_LEN;
    if len > MAX_FRAME_LEN {
        return Err(CodecError::TooLarge(len));
    }
    out[..FRAME_HEADER_LEN].copy_from_slice(&(len as u32).to_be_bytes());
    Ok(out)
}

/// The frame of `Message::Response { hash, data: Some(data), compressed }` in three parts:
/// the bytes before `data`, `data` itself (not copied) and the bytes after it, so a sender can
/// hand the chunk to its stream as it was read. Concatenated, they are exactly
/// [`encode_frame`]'s output for the same message.
pub fn encode_response_frame(
    hash: crate::Hash,
    data: &[u8],
    compressed: bool,
) -> Result<(Vec<u8>, [u8; 1]), CodecError> {
    let mut prefix = response_head(hash, data.len())?;
    let len = prefix.len() - FRAME_HEADER_LEN + data.len() + 1;
    if len > MAX_FRAME_LEN {
        return Err(CodecError::TooLarge(len));
    }
    prefix[..FRAME_HEADER_LEN].copy_from_slice(&(len as u32).to_be_bytes());
    Ok((prefix, [u8::from(compressed)]))
}

/// The frame header's room and the payload of a response carrying a chunk of `data_len`
/// bytes for `hash`, up to the chunk: the message without its data ends `.., 0 (None),
/// compressed`; with it, the `0` becomes `1 (Some), varint(len)`, then the bytes, then
/// `compressed`. The header's four bytes are left zero.
fn response_head(hash: crate::Hash, data_len: usize) -> Result<Vec<u8>, CodecError> {
    let bare = encode_frame(&Message::Response(crate::ChunkResponse {
        hash,
        data: None,
        compressed: false,
    }))?;
    let [.., none, _compressed] = bare[..] else {
        return Err(CodecError::Malformed(
            "a response frame without fields".into(),
        ));
    };
    if none != 0 {
        return Err(CodecError::Malformed("unexpected response layout".into()));
    }
    let mut prefix = bare[..bare.len() - 2].to_vec();
    prefix.push(1);
    // A byte string's length is the varint postcard writes for a `usize`.
    postcard::to_extend(&data_len, prefix).map_err(|e| CodecError::Malformed(e.to_string()))
}

/// Where the chunk would lie in a frame of payload length `len` that answers a request for
/// `hash` with its chunk: the payload bytes before the chunk and the chunk's length. `None` when
/// no such response has that length (then the frame is something else: read it whole).
///
/// A receiver that finds the payload beginning with exactly these bytes can read the chunk
/// straight into a buffer of its own and end with [`finish_response`], instead of reading the
/// whole payload and having [`decode_payload`] copy the chunk out of it; the result is the
/// same message (proptest `a_response_read_in_place_is_the_message_decode_payload_gives`).
pub fn response_layout(hash: crate::Hash, len: usize) -> Option<(Vec<u8>, usize)> {
    let base = response_head(hash, 0).ok()?.len() - FRAME_HEADER_LEN - 1;
    // The varint of the chunk's length takes 1 to 4 bytes for any chunk a frame can hold; at
    // most one of these splits is consistent.
    (1..=4usize).find_map(|width| {
        let data_len = len.checked_sub(base + width + 1)?;
        let head = response_head(hash, data_len).ok()?;
        (head.len() - FRAME_HEADER_LEN == base + width)
            .then(|| (head[FRAME_HEADER_LEN..].to_vec(), data_len))
    })
}

/// The response whose payload was the head [`response_layout`] gave, then `data`, then `tail`
/// (the `compressed` flag), checked as [`decode_payload`] checks it.
pub fn finish_response(hash: crate::Hash, data: Vec<u8>, tail: u8) -> Result<Message, CodecError> {
    let compressed = match tail {
        0 => false,
        1 => true,
        b => {
            return Err(CodecError::Malformed(format!(
                "a response's compressed flag is {b}"
            )))
        }
    };
    let msg = Message::Response(crate::ChunkResponse {
        hash,
        data: Some(data),
        compressed,
    });
    msg.check_limits()
        .map_err(|e| CodecError::Malformed(e.to_string()))?;
    Ok(msg)
}

/// Reads the payload length from a frame header, refusing lengths over the limit.
pub fn frame_len(header: [u8; FRAME_HEADER_LEN]) -> Result<usize, CodecError> {
    let len = u32::from_be_bytes(header) as usize;
    if len > MAX_FRAME_LEN {
        return Err(CodecError::TooLarge(len));
    }
    Ok(len)
}

/// Decodes one payload (without its header).
pub fn decode_payload(payload: &[u8]) -> Result<Message, CodecError> {
    if payload.len() > MAX_FRAME_LEN {
        return Err(CodecError::TooLarge(payload.len()));
    }
    let (msg, rest): (Message, &[u8]) = postcard::take_from_bytes(payload).map_err(|e| {
        CodecError::Malformed(match e {
            // postcard drops the text of errors raised by the types themselves.
            postcard::Error::SerdeDeCustom => format!(
                "{e}: an invalid path or folder id, or a list or version vector over its limit"
            ),
            e => e.to_string(),
        })
    })?;
    if !rest.is_empty() {
        return Err(CodecError::Malformed(format!(
            "{} trailing bytes after the message",
            rest.len()
        )));
    }
    msg.check_limits()
        .map_err(|e| CodecError::Malformed(e.to_string()))?;
    if let Message::Index(batch) = &msg {
        for r in &batch.records {
            r.validate()
                .map_err(|e| CodecError::Malformed(e.to_string()))?;
        }
    }
    Ok(msg)
}

/// Decodes the first frame in `buf`: `Ok(None)` when more bytes are needed, otherwise the
/// message and how many bytes it used.
pub fn decode_frame(buf: &[u8]) -> Result<Option<(Message, usize)>, CodecError> {
    if buf.len() < FRAME_HEADER_LEN {
        return Ok(None);
    }
    let mut header = [0u8; FRAME_HEADER_LEN];
    header.copy_from_slice(&buf[..FRAME_HEADER_LEN]);
    let len = frame_len(header)?;
    let Some(payload) = buf.get(FRAME_HEADER_LEN..FRAME_HEADER_LEN + len) else {
        return Ok(None);
    };
    Ok(Some((decode_payload(payload)?, FRAME_HEADER_LEN + len)))
}

/// Splits a byte stream into messages.
#[derive(Default, Debug)]
pub struct FrameDecoder {
    buf: Vec<u8>,
}

impl FrameDecoder {
    /// An empty decoder.
    pub fn new() -> FrameDecoder {
        FrameDecoder::default()
    }

    /// Appends received bytes.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next complete message, if any.
    pub fn next_message(&mut self) -> Result<Option<Message>, CodecError> {
        match decode_frame(&self.buf)? {
            Some((msg, used)) => {
                self.buf.drain(..used);
                Ok(Some(msg))
            }
            None => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::*;
    use proptest::prelude::*;

    fn hash() -> impl Strategy<Value = Hash> {
        any::<[u8; 32]>().prop_map(Hash)
    }

    fn relpath() -> impl Strategy<Value = RelPath> {
        prop::collection::vec("[a-z0-9_]{1,8}", 1..4)
            .prop_map(|c| RelPath::new(&c.join("/")).unwrap())
    }

    fn vv() -> impl Strategy<Value = VersionVector> {
        prop::collection::vec((any::<u64>(), 1u64..1000), 1..4)
            .prop_map(|p| VersionVector::from_pairs(p.into_iter().map(|(d, c)| (ShortId(d), c))))
    }

    fn record() -> impl Strategy<Value = FileRecord> {
        (
            relpath(),
            0u8..4,
            any::<u32>(),
            any::<i64>(),
            prop::collection::vec((1u32..100_000, hash()), 0..5),
            vv(),
            any::<u64>(),
            any::<u64>(),
        )
            .prop_map(|(path, k, mode, mtime_ns, chunks, version, by, sequence)| {
                let chunks: Vec<Chunk> = chunks
                    .into_iter()
                    .map(|(len, hash)| Chunk { len, hash })
                    .collect();
                let (kind, deleted) = match k {
                    0 => (FileKind::File, false),
                    1 => (FileKind::Dir, false),
                    2 => (FileKind::Symlink, false),
                    _ => (FileKind::File, true),
                };
                let live_file = kind == FileKind::File && !deleted;
                FileRecord {
                    path,
                    kind,
                    deleted,
                    mode: mode & MODE_SYNC_MASK,
                    mtime_ns,
                    size: if live_file {
                        chunks.iter().map(|c| c.len as u64).sum()
                    } else {
                        0
                    },
                    hash: if live_file {
                        Hash::of_chunks(&chunks)
                    } else if kind == FileKind::Symlink && !deleted {
                        Hash::of(b"../t")
                    } else {
                        Hash::ZERO
                    },
                    chunks: if live_file { chunks } else { vec![] },
                    target: if kind == FileKind::Symlink && !deleted {
                        "../t".into()
                    } else {
                        String::new()
                    },
                    version,
                    modified_by: ShortId(by),
                    sequence,
                }
            })
    }

    fn message() -> impl Strategy<Value = Message> {
        let folder = "[a-z]{1,10}".prop_map(|s| FolderId::new(&s).unwrap());
        prop_oneof![
            (
                any::<u32>(),
                ".{0,20}",
                prop::collection::vec(
                    (
                        folder.clone(),
                        any::<u64>(),
                        any::<u64>(),
                        any::<u64>(),
                        any::<u64>()
                    ),
                    0..4
                )
            )
                .prop_map(|(v, n, f)| Message::Hello(Hello {
                    protocol_version: v,
                    device_name: n,
                    folders: f
                        .into_iter()
                        .map(
                            |(folder, index_id, your_index_id, your_sequence, max_sequence)| {
                                HelloFolder {
                                    folder,
                                    index_id,
                                    your_index_id,
                                    your_sequence,
                                    max_sequence,
                                    scanning: max_sequence % 2 == 1,
                                    partial: false,
                                }
                            }
                        )
                        .collect()
                })),
            (
                folder.clone(),
                prop::collection::vec(record(), 0..5),
                any::<u64>(),
                prop::collection::vec(
                    (
                        hash(),
                        prop::option::of(prop::collection::vec(any::<u8>(), 0..300)),
                        any::<bool>()
                    ),
                    0..3
                )
            )
                .prop_map(|(folder, records, up_to, inline)| Message::Index(
                    IndexBatch {
                        folder,
                        up_to,
                        // At most one inline chunk per record.
                        inline: inline
                            .into_iter()
                            .take(records.len())
                            .map(|(hash, data, compressed)| ChunkResponse {
                                hash,
                                data,
                                compressed
                            })
                            .collect(),
                        records,
                    }
                )),
            (folder.clone(), any::<u64>())
                .prop_map(|(folder, sequence)| Message::IndexAck(IndexAck { folder, sequence })),
            (folder.clone(), prop::collection::vec(hash(), 0..10))
                .prop_map(|(folder, hashes)| Message::Request(ChunkRequest { folder, hashes })),
            (
                hash(),
                prop::option::of(prop::collection::vec(any::<u8>(), 0..300)),
                any::<bool>()
            )
                .prop_map(|(hash, data, compressed)| Message::Response(
                    ChunkResponse {
                        hash,
                        data,
                        compressed
                    }
                )),
            ".{0,30}".prop_map(|m| Message::Error {
                code: ErrorCode::NotShared,
                message: m
            }),
            (folder.clone(), prop::collection::vec(any::<u64>(), 0..6)).prop_map(|(folder, c)| {
                Message::Peers(PeerList {
                    folder,
                    connected: c.into_iter().map(ShortId).collect(),
                })
            }),
            prop::collection::vec(any::<[u8; 32]>(), 0..6).prop_map(|ids| {
                Message::Seek(SeekList {
                    devices: ids.into_iter().map(DeviceId::from_bytes).collect(),
                })
            }),
            (
                any::<[u8; 32]>(),
                prop::collection::vec((any::<[u8; 16]>(), any::<u16>(), any::<bool>()), 0..5)
            )
                .prop_map(|(id, addrs)| {
                    Message::Addresses(AddressList {
                        device: DeviceId::from_bytes(id),
                        addrs: addrs
                            .into_iter()
                            .map(|(ip, port, v6)| match v6 {
                                true => WireAddr::V6 { ip, port },
                                false => WireAddr::V4 {
                                    ip: [ip[0], ip[1], ip[2], ip[3]],
                                    port,
                                },
                            })
                            .collect(),
                    })
                }),
        ]
    }

    proptest! {
        #[test]
        fn every_message_round_trips(msg in message()) {
            let frame = encode_frame(&msg).unwrap();
            let (back, used) = decode_frame(&frame).unwrap().unwrap();
            prop_assert_eq!(used, frame.len());
            prop_assert_eq!(back, msg);
        }

        #[test]
        fn decoding_arbitrary_bytes_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..2000)) {
            let _ = decode_frame(&bytes);
            let _ = decode_payload(&bytes);
        }

        #[test]
        fn truncated_frames_ask_for_more(msg in message(), cut in 0usize..64) {
            let frame = encode_frame(&msg).unwrap();
            let cut = cut.min(frame.len().saturating_sub(1));
            prop_assert_eq!(decode_frame(&frame[..cut]), Ok(None));
        }

        #[test]
        fn stream_decoder_splits_frames(msgs in prop::collection::vec(message(), 1..5), step in 1usize..50) {
            let bytes: Vec<u8> = msgs.iter().flat_map(|m| encode_frame(m).unwrap()).collect();
            let mut dec = FrameDecoder::new();
            let mut out = Vec::new();
            for piece in bytes.chunks(step) {
                dec.push(piece);
                while let Some(m) = dec.next_message().unwrap() {
                    out.push(m);
                }
            }
            prop_assert_eq!(out, msgs);
        }

        #[test]
        fn a_response_frame_in_parts_is_the_whole_frame(
            hash in any::<[u8; 32]>(),
            // Lengths across every varint width a chunk can have, up to the largest chunk.
            len in prop_oneof![0usize..300, 16_000usize..17_000, (crate::MAX_CHUNK_LEN as usize - 70_000)..=crate::MAX_CHUNK_LEN as usize],
            compressed in any::<bool>(),
        ) {
            let data: Vec<u8> = (0..len).map(|i| (i * 7) as u8).collect();
            let whole = encode_frame(&Message::Response(crate::ChunkResponse {
                hash: crate::Hash(hash),
                data: Some(data.clone()),
                compressed,
            }))
            .unwrap();
            let (prefix, suffix) = encode_response_frame(crate::Hash(hash), &data, compressed).unwrap();
            let parts = [&prefix[..], &data[..], &suffix[..]].concat();
            prop_assert!(parts == whole, "{} bytes of data", len);
        }
        #[test]
        fn a_response_read_in_place_is_the_message_decode_payload_gives(
            hash in any::<[u8; 32]>(),
            other in any::<[u8; 32]>(),
            len in prop_oneof![0usize..300, 16_000usize..17_000, (crate::MAX_CHUNK_LEN as usize - 300)..=crate::MAX_CHUNK_LEN as usize + 300],
            compressed in any::<bool>(),
            flip in prop::option::of((any::<prop::sample::Index>(), 1u8..=255)),
        ) {
            // A response for the hash asked for, one for another hash, an error, a response
            // without data; each maybe with one byte changed.
            let want = crate::Hash(hash);
            let data: Vec<u8> = (0..len).map(|i| (i * 7) as u8).collect();
            let resp = |hash, data| Message::Response(crate::ChunkResponse { hash, data, compressed });
            let candidates = [
                resp(want, Some(data.clone())),
                resp(crate::Hash(other), Some(data.clone())),
                resp(want, None),
                Message::Error { code: crate::ErrorCode::NotShared, message: "x".repeat(len % 200) },
            ];
            for msg in candidates {
                let mut payload = if len > crate::MAX_CHUNK_LEN as usize {
                    // Over the limit: built by hand, as encode_frame refuses it.
                    let mut p = response_head(want, len).unwrap()[FRAME_HEADER_LEN..].to_vec();
                    p.extend_from_slice(&data);
                    p.push(u8::from(compressed));
                    p
                } else {
                    encode_frame(&msg).unwrap()[FRAME_HEADER_LEN..].to_vec()
                };
                if let Some((i, x)) = flip {
                    let i = i.index(payload.len());
                    payload[i] ^= x;
                }
                let whole = decode_payload(&payload);
                match response_layout(want, payload.len()) {
                    Some((head, data_len)) if payload.starts_with(&head) => {
                        prop_assert_eq!(head.len() + data_len + 1, payload.len());
                        let data = payload[head.len()..head.len() + data_len].to_vec();
                        let fast = finish_response(want, data, payload[payload.len() - 1]);
                        prop_assert_eq!(fast.is_ok(), whole.is_ok(), "{:?} / {:?}", fast, whole);
                        if let (Ok(a), Ok(b)) = (fast, whole) {
                            prop_assert_eq!(a, b);
                        }
                    }
                    // Not read in place: only a frame that is not this response's.
                    _ => {
                        let in_place = matches!(
                            whole,
                            Ok(Message::Response(crate::ChunkResponse { hash, data: Some(_), .. })) if hash == want
                        );
                        prop_assert!(!in_place);
                    }
                }
            }
        }
    }

    #[test]
    fn oversized_length_is_refused_before_reading() {
        let mut frame = ((MAX_FRAME_LEN + 1) as u32).to_be_bytes().to_vec();
        frame.extend_from_slice(&[0; 16]);
        assert_eq!(
            decode_frame(&frame),
            Err(CodecError::TooLarge(MAX_FRAME_LEN + 1))
        );
    }

    #[test]
    fn a_path_with_dotdot_from_a_peer_is_malformed() {
        // Hand-build an Index frame whose record path is "../etc/passwd".
        let good = Message::Index(IndexBatch {
            folder: FolderId::new("f").unwrap(),
            records: vec![FileRecord {
                path: RelPath::new("aa/etc/passwd").unwrap(),
                kind: FileKind::Dir,
                deleted: false,
                mode: 0o755,
                mtime_ns: 0,
                size: 0,
                hash: Hash::ZERO,
                chunks: vec![],
                target: String::new(),
                version: VersionVector::from_pairs([(ShortId(1), 1)]),
                modified_by: ShortId(1),
                sequence: 1,
            }],
            up_to: 1,
            inline: Vec::new(),
        });
        let mut frame = encode_frame(&good).unwrap();
        let pos = frame.windows(2).position(|w| w == b"aa").unwrap();
        frame[pos] = b'.';
        frame[pos + 1] = b'.';
        assert!(matches!(
            decode_frame(&frame),
            Err(CodecError::Malformed(_))
        ));
    }

    #[test]
    fn a_setuid_mode_from_a_peer_is_malformed() {
        let batch = |mode| {
            Message::Index(IndexBatch {
                folder: FolderId::new("f").unwrap(),
                records: vec![FileRecord {
                    path: RelPath::new("bin").unwrap(),
                    kind: FileKind::Dir,
                    deleted: false,
                    mode,
                    mtime_ns: 0,
                    size: 0,
                    hash: Hash::ZERO,
                    chunks: vec![],
                    target: String::new(),
                    version: VersionVector::from_pairs([(ShortId(1), 1)]),
                    modified_by: ShortId(1),
                    sequence: 1,
                }],
                up_to: 1,
                inline: Vec::new(),
            })
        };
        assert!(decode_frame(&encode_frame(&batch(0o1777)).unwrap()).is_ok());
        match decode_frame(&encode_frame(&batch(0o4755)).unwrap()) {
            Err(CodecError::Malformed(m)) => assert!(m.contains("mode 0o4755"), "{m}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn inconsistent_chunk_list_is_malformed() {
        let msg = Message::Index(IndexBatch {
            folder: FolderId::new("f").unwrap(),
            records: vec![FileRecord {
                path: RelPath::new("x").unwrap(),
                kind: FileKind::File,
                deleted: false,
                mode: 0o644,
                mtime_ns: 0,
                size: 10,
                hash: Hash::ZERO,
                chunks: vec![Chunk {
                    len: 3,
                    hash: Hash::ZERO,
                }],
                target: String::new(),
                version: VersionVector::from_pairs([(ShortId(1), 1)]),
                modified_by: ShortId(1),
                sequence: 1,
            }],
            up_to: 1,
            inline: Vec::new(),
        });
        let frame = encode_frame(&msg).unwrap();
        assert!(matches!(
            decode_frame(&frame),
            Err(CodecError::Malformed(_))
        ));
    }

    #[test]
    fn a_file_hash_that_is_not_its_chunk_lists_is_malformed() {
        let chunks = vec![
            Chunk {
                len: 3,
                hash: Hash::of(b"abc"),
            },
            Chunk {
                len: 2,
                hash: Hash::of(b"de"),
            },
        ];
        let record = |hash| FileRecord {
            path: RelPath::new("x").unwrap(),
            kind: FileKind::File,
            deleted: false,
            mode: 0o644,
            mtime_ns: 0,
            size: 5,
            hash,
            chunks: chunks.clone(),
            target: String::new(),
            version: VersionVector::from_pairs([(ShortId(1), 1)]),
            modified_by: ShortId(1),
            sequence: 1,
        };
        let index = |r| {
            Message::Index(IndexBatch {
                folder: FolderId::new("f").unwrap(),
                records: vec![r],
                up_to: 1,
                inline: Vec::new(),
            })
        };
        let good = encode_frame(&index(record(Hash::of_chunks(&chunks)))).unwrap();
        assert!(decode_frame(&good).is_ok());
        // The whole content's blake3 is not a multi-chunk file's hash.
        let bad = encode_frame(&index(record(Hash::of(b"abcde")))).unwrap();
        assert!(matches!(decode_frame(&bad), Err(CodecError::Malformed(_))));
    }
}
