//! Arbitrary bytes from a peer, through everything that decodes them: a frame payload
//! (`decode_payload`), a stream of frames (`FrameDecoder`) and a bare `FileRecord`.
//!
//! Whatever decodes must re-encode to a frame that decodes to the same message, the encoding
//! must be canonical after one round (vectors are sorted and deduplicated on decode), and
//! every record it carries must validate. Nothing may panic, whatever the bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use meshfs_protocol::{
    decode_payload, encode_frame, FileRecord, FrameDecoder, Message, FRAME_HEADER_LEN,
};

fuzz_target!(|data: &[u8]| {
    if let Ok(msg) = decode_payload(data) {
        round_trips(&msg);
    }
    let mut frames = FrameDecoder::new();
    frames.push(data);
    while let Ok(Some(msg)) = frames.next_message() {
        round_trips(&msg);
    }
    // A record the decoder refuses never reaches a message: validate it on its own.
    if let Ok(record) = postcard::from_bytes::<FileRecord>(data) {
        if record.validate().is_ok() {
            let bytes = postcard::to_allocvec(&record).expect("a record encodes");
            let back: FileRecord = postcard::from_bytes(&bytes).expect("a valid record decodes");
            assert_eq!(back, record);
        }
    }
});

fn round_trips(msg: &Message) {
    let frame = encode_frame(msg).expect("a decoded message re-encodes within the frame limit");
    let back = decode_payload(&frame[FRAME_HEADER_LEN..]).expect("a re-encoded message decodes");
    assert_eq!(&back, msg);
    assert_eq!(
        encode_frame(&back).expect("it encodes again"),
        frame,
        "the encoding is canonical after one round"
    );
    if let Message::Index(batch) = msg {
        for r in &batch.records {
            assert_eq!(r.validate(), Ok(()));
        }
    }
}
