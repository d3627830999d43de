//! The encodings of a few valid messages, pinned byte for byte in `protocol/fuzz/seeds/`.
//!
//! They are the fuzzer's seed corpus (`protocol/fuzz/README.md`) and a check that the wire
//! encoding of valid messages does not change by accident: a limit or a rule added to the
//! decoder must still accept every one of them, and re-encode it to the same bytes.
//!
//! After a deliberate wire change, rewrite them with
//! `MESHFS_BLESS_FUZZ_SEEDS=1 cargo test -p meshfs-protocol --test wire_seeds`.

use meshfs_protocol::{
    decode_payload, encode_frame, AddressList, Chunk, ChunkRequest, ChunkResponse, DeviceId,
    ErrorCode, FileKind, FileRecord, FolderId, Hash, Held, Hello, HelloFolder, IndexAck,
    IndexBatch, Message, PeerList, Probe, RelPath, ScanState, SeekList, ShortId, VersionVector,
    WireAddr, FRAME_HEADER_LEN, PROTOCOL_VERSION,
};
use std::path::PathBuf;

fn seeds_dir(target: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/seeds")
        .join(target)
}

fn folder() -> FolderId {
    FolderId::new("photos").unwrap()
}

fn vv(pairs: &[(u64, u64)]) -> VersionVector {
    VersionVector::from_pairs(pairs.iter().map(|&(d, c)| (ShortId(d), c)))
}

fn base(path: &str, kind: FileKind) -> FileRecord {
    FileRecord {
        path: RelPath::new(path).unwrap(),
        kind,
        deleted: false,
        mode: 0o644,
        mtime_ns: 1_795_356_903_000_000_001,
        size: 0,
        hash: Hash::ZERO,
        chunks: Vec::new(),
        target: String::new(),
        version: vv(&[(0x1111, 1_795_356_903), (0x2222, 3)]),
        modified_by: ShortId(0x1111),
        sequence: 7,
    }
}

fn two_chunk_file() -> FileRecord {
    let chunks = vec![
        Chunk {
            len: 5,
            hash: Hash::of(b"hello"),
        },
        Chunk {
            len: 6,
            hash: Hash::of(b" world"),
        },
    ];
    FileRecord {
        size: 11,
        hash: Hash::of_chunks(&chunks),
        chunks,
        ..base("docs/greeting.txt", FileKind::File)
    }
}

fn one_chunk_file() -> FileRecord {
    FileRecord {
        size: 3,
        hash: Hash::of(b"abc"),
        chunks: vec![Chunk {
            len: 3,
            hash: Hash::of(b"abc"),
        }],
        mode: 0o1755,
        sequence: 8,
        ..base("caf\u{e9}/small", FileKind::File)
    }
}

/// One of each message, and of each kind of record.
fn messages() -> Vec<(&'static str, Message)> {
    let link = FileRecord {
        hash: Hash::of(b"../docs"),
        target: "../docs".into(),
        mode: 0o777,
        sequence: 9,
        ..base("links/docs", FileKind::Symlink)
    };
    let tombstone = FileRecord {
        deleted: true,
        sequence: 10,
        ..base("old.txt", FileKind::File)
    };
    vec![
        (
            "hello",
            Message::Hello(Hello {
                protocol_version: PROTOCOL_VERSION,
                device_name: "laptop".into(),
                folders: vec![
                    HelloFolder {
                        folder: folder(),
                        index_id: 0x0123_4567_89ab_cdef,
                        your_index_id: 42,
                        your_sequence: 1000,
                        max_sequence: 1234,
                        scanning: false,
                        partial: false,
                    },
                    HelloFolder {
                        folder: FolderId::new("work.2026").unwrap(),
                        index_id: 1,
                        your_index_id: 0,
                        your_sequence: 0,
                        max_sequence: 0,
                        scanning: true,
                        partial: true,
                    },
                ],
            }),
        ),
        (
            "index",
            Message::Index(IndexBatch {
                folder: folder(),
                records: vec![
                    base("docs", FileKind::Dir),
                    two_chunk_file(),
                    one_chunk_file(),
                    link,
                    tombstone,
                ],
                up_to: 12,
                inline: vec![ChunkResponse {
                    hash: Hash::of(b"abc"),
                    data: Some(b"abc".to_vec()),
                    compressed: false,
                }],
            }),
        ),
        (
            "index-empty",
            Message::Index(IndexBatch {
                folder: folder(),
                records: Vec::new(),
                up_to: 99,
                inline: Vec::new(),
            }),
        ),
        (
            "ack",
            Message::IndexAck(IndexAck {
                folder: folder(),
                sequence: 12,
            }),
        ),
        (
            "scan",
            Message::Scan(ScanState {
                folder: FolderId::new("work.2026").unwrap(),
                scanning: true,
                max_sequence: 1001,
                files_hashed: 1000,
                bytes_hashed: 262_144_000,
                files_left: 1400,
            }),
        ),
        (
            "scan-finished",
            Message::Scan(ScanState {
                folder: FolderId::new("work.2026").unwrap(),
                scanning: false,
                max_sequence: 2401,
                files_hashed: 2400,
                bytes_hashed: 629_145_600,
                files_left: 0,
            }),
        ),
        (
            "request",
            Message::Request(ChunkRequest {
                folder: folder(),
                hashes: vec![Hash::of(b"hello"), Hash::of(b" world"), Hash::of(b"abc")],
            }),
        ),
        (
            "response",
            Message::Response(ChunkResponse {
                hash: Hash::of(b"hello"),
                data: Some(b"hello".to_vec()),
                compressed: false,
            }),
        ),
        (
            "response-none",
            Message::Response(ChunkResponse {
                hash: Hash::of(b"gone"),
                data: None,
                compressed: false,
            }),
        ),
        (
            "probe",
            Message::Probe(Probe {
                folder: folder(),
                hashes: vec![Hash::of(b"hello"), Hash::of(b"abc")],
            }),
        ),
        (
            "held",
            Message::Held(Held {
                held: vec![true, false],
            }),
        ),
        (
            "peers",
            Message::Peers(PeerList {
                folder: folder(),
                connected: vec![ShortId(0x1234_5678_9abc_def0), ShortId(7)],
            }),
        ),
        (
            "seek",
            Message::Seek(SeekList {
                devices: vec![
                    DeviceId::from_bytes([0x5a; 32]),
                    DeviceId::from_bytes([7; 32]),
                ],
            }),
        ),
        (
            "addresses",
            Message::Addresses(AddressList {
                device: DeviceId::from_bytes([0x5a; 32]),
                addrs: vec![
                    WireAddr::V4 {
                        ip: [10, 211, 7, 3],
                        port: 7788,
                    },
                    WireAddr::V6 {
                        ip: [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
                        port: 7788,
                    },
                ],
            }),
        ),
        (
            "error",
            Message::Error {
                code: ErrorCode::NotShared,
                message: "folder photos is not shared with you".into(),
            },
        ),
    ]
}

/// Payloads (without the frame header), as `decode_payload` takes them.
fn decode_seeds() -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = messages()
        .into_iter()
        .map(|(name, m)| {
            let frame = encode_frame(&m).unwrap();
            (format!("{name}.bin"), frame[FRAME_HEADER_LEN..].to_vec())
        })
        .collect();
    // A bare record, for the target's direct `FileRecord::validate` check.
    out.push((
        "record.bin".into(),
        postcard::to_allocvec(&two_chunk_file()).unwrap(),
    ));
    out
}

fn relpath_seeds() -> Vec<(String, Vec<u8>)> {
    [
        ("plain", "docs/greeting.txt"),
        ("nfc", "caf\u{e9}/r\u{e9}sum\u{e9}.txt"),
        ("nfd", "cafe\u{301}"),
        ("dotdot", "a/../b"),
        ("internal", "a/.meshfs-tmp-1"),
        ("meshignore", ".meshignore"),
    ]
    .into_iter()
    .map(|(name, s)| (format!("{name}.txt"), s.as_bytes().to_vec()))
    .collect()
}

fn check_or_bless(target: &str, seeds: Vec<(String, Vec<u8>)>) {
    let dir = seeds_dir(target);
    if std::env::var_os("MESHFS_BLESS_FUZZ_SEEDS").is_some() {
        std::fs::create_dir_all(&dir).unwrap();
        for (name, bytes) in &seeds {
            std::fs::write(dir.join(name), bytes).unwrap();
        }
    }
    for (name, bytes) in seeds {
        let path = dir.join(&name);
        let pinned = std::fs::read(&path).unwrap_or_else(|e| {
            panic!(
                "{}: {e}; write the seeds with MESHFS_BLESS_FUZZ_SEEDS=1",
                path.display()
            )
        });
        assert!(
            pinned == bytes,
            "{} no longer matches its message's encoding: the wire format changed",
            path.display()
        );
    }
}

#[test]
fn the_pinned_messages_decode_to_what_encoded_them() {
    for (name, msg) in messages() {
        let frame = encode_frame(&msg).unwrap();
        assert_eq!(
            decode_payload(&frame[FRAME_HEADER_LEN..]).as_ref(),
            Ok(&msg),
            "{name}"
        );
    }
}

#[test]
fn the_wire_encoding_of_valid_messages_is_unchanged() {
    check_or_bless("decode", decode_seeds());
    check_or_bless("relpath", relpath_seeds());
}
