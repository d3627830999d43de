//! Frames on streams: writing a message or a chunk response as one frame, and reading one
//! within its deadlines (a peer that stalls mid-frame, or trickles, is stopped with
//! [`STOP_BAD_FRAME`]). It never knows what a message means.
//!
//! The same frames go on QUIC streams and on the bulk lane's TLS byte stream
//! ([`super::lane`]): [`FrameSend`] and [`FrameRecv`] are what each carrier provides.

use super::*;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Where frames are written: a QUIC send stream, or one half of a byte stream.
pub trait FrameSend: Send {
    /// Sends `parts` in order, as one run of bytes. Handed over, not copied, where the carrier
    /// can keep them (QUIC keeps each buffer until the peer acknowledges it).
    fn send_parts(
        &mut self,
        parts: &mut [bytes::Bytes],
    ) -> impl std::future::Future<Output = Result<(), TransportError>> + Send;
}

impl FrameSend for quinn::SendStream {
    async fn send_parts(&mut self, parts: &mut [bytes::Bytes]) -> Result<(), TransportError> {
        self.write_all_chunks(parts).await?;
        Ok(())
    }
}

impl<T: AsyncWrite + Send> FrameSend for tokio::io::WriteHalf<T> {
    async fn send_parts(&mut self, parts: &mut [bytes::Bytes]) -> Result<(), TransportError> {
        for p in parts.iter() {
            self.write_all(p).await.map_err(TransportError::Stream)?;
        }
        Ok(())
    }
}

/// Where frames are read from: a QUIC receive stream, or one half of a byte stream.
pub trait FrameRecv: AsyncRead + Unpin + Send {
    /// Tells the sender a frame was refused: on QUIC, STOP_SENDING with [`STOP_BAD_FRAME`]. A
    /// byte stream has no such signal: its reader gives the whole stream up.
    fn refuse(&mut self) {}
}

impl FrameRecv for quinn::RecvStream {
    fn refuse(&mut self) {
        // Fails only if the stream is already finished or stopped: nothing left to stop.
        let _ = self.stop(STOP_BAD_FRAME);
    }
}

impl<T: AsyncRead + Send> FrameRecv for tokio::io::ReadHalf<T> {}

/// Bytes reserved for a frame's payload before any of it has arrived.
pub(super) const FRAME_PREALLOC: usize = 64 << 10;
/// Bytes reserved for a chunk read in place ([`read_response_within`]) before any of it has
/// arrived: all of a chunk of a file up to 1 GiB (D8), so it is never copied as its buffer
/// grows. Only on streams this device opened for its own requests
/// ([`crate::chunks`]'s requests in flight), so a peer cannot make it reserve more by opening
/// streams.
pub(super) const CHUNK_PREALLOC: usize = 256 << 10;
/// STOP_SENDING code: a frame on this stream was oversized or malformed, or its peer stalled
/// in the middle of it.
pub const STOP_BAD_FRAME: VarInt = VarInt::from_u32(1);
/// Once a frame has begun, how long the peer may send nothing more of it. A live connection
/// carries a started frame on at once: only a peer that stalls on purpose, or a path dead for
/// longer than the idle timeout, waits this long.
pub const FRAME_STALL: Duration = Duration::from_secs(10);
/// A frame must be complete within this time after its first byte, plus a second per
/// [`FRAME_MIN_RATE`] bytes it declares, however it trickles in (a 16 MiB frame: 35 minutes).
pub(super) const FRAME_TIME_BASE: Duration = Duration::from_secs(30);
/// See [`FRAME_TIME_BASE`].
pub(super) const FRAME_MIN_RATE: u64 = 8 << 10;

/// Writes `msg` as one frame; returns the bytes written (header included).
pub async fn write_message(
    send: &mut impl FrameSend,
    msg: &Message,
) -> Result<usize, TransportError> {
    let frame = encode_frame(msg)?;
    let len = frame.len();
    send.send_parts(&mut [bytes::Bytes::from(frame)]).await?;
    Ok(len)
}

/// Writes a chunk response as one frame without copying its bytes: the frame's head and tail
/// go around the chunk as it was read ([`meshfs_protocol::encode_response_frame`]).
pub async fn write_response(
    send: &mut impl FrameSend,
    resp: ChunkResponse,
) -> Result<usize, TransportError> {
    let ChunkResponse {
        hash,
        data: Some(data),
        compressed,
    } = resp
    else {
        return write_message(send, &Message::Response(resp)).await;
    };
    let (head, tail) = meshfs_protocol::encode_response_frame(hash, &data, compressed)?;
    let len = head.len() + data.len() + tail.len();
    let mut parts = [
        bytes::Bytes::from(head),
        bytes::Bytes::from(data),
        bytes::Bytes::copy_from_slice(&tail),
    ];
    send.send_parts(&mut parts).await?;
    Ok(len)
}

/// Reads the next frame from `recv`: `Ok(None)` when the stream ended cleanly between
/// frames. A length over [`MAX_FRAME_LEN`] is refused before anything is allocated or read
/// for it; such a stream, or one with a malformed or truncated frame, is stopped with
/// [`STOP_BAD_FRAME`] and yields [`TransportError::Frame`].
///
/// The first byte may take as long as it takes (an idle control stream; keep-alives watch
/// the connection). Once it has come, the frame must go on within [`FRAME_STALL`] and be
/// complete by [`frame_deadline`], or the stream is stopped with [`STOP_BAD_FRAME`] and this
/// yields [`TransportError::Stalled`].
pub async fn read_message(recv: &mut impl FrameRecv) -> Result<Option<Message>, TransportError> {
    read_frame(recv, None, MAX_FRAME_LEN).await
}

/// [`read_message`] of a frame that may declare at most `max_len` bytes (refused from the
/// header otherwise, like one over [`MAX_FRAME_LEN`]), however long its first byte takes: the
/// next request on an idle bulk lane.
pub async fn read_message_capped(
    recv: &mut impl FrameRecv,
    max_len: usize,
) -> Result<Option<Message>, TransportError> {
    read_frame(recv, None, max_len).await
}

/// [`read_message`] on a stream where a message of a known kind is due: its first byte too
/// must come within `wait`, and its frame declare at most `max_len` bytes (refused from the
/// header otherwise, like one over [`MAX_FRAME_LEN`]).
pub async fn read_message_within(
    recv: &mut impl FrameRecv,
    wait: Duration,
    max_len: usize,
) -> Result<Option<Message>, TransportError> {
    read_frame(recv, Some(wait), max_len).await
}

/// How long a frame declaring `len` payload bytes may take from its first byte to its last.
pub fn frame_deadline(len: usize) -> Duration {
    FRAME_TIME_BASE + Duration::from_secs(len as u64 / FRAME_MIN_RATE)
}

/// Reads one frame of at most `max_len` bytes; `wait`: how long its first byte may take, when a
/// message of a known kind is due.
pub(super) async fn read_frame(
    recv: &mut impl FrameRecv,
    wait: Option<Duration>,
    max_len: usize,
) -> Result<Option<Message>, TransportError> {
    let Some((len, mut clock)) = read_header(recv, wait, max_len).await? else {
        return Ok(None);
    };
    decode_rest(recv, &mut clock, Vec::new(), len).await
}

/// Reads the rest of a frame of payload length `len` after the `payload` bytes read so far, and
/// decodes it whole.
pub(super) async fn decode_rest(
    recv: &mut impl FrameRecv,
    clock: &mut FrameClock,
    mut payload: Vec<u8>,
    len: usize,
) -> Result<Option<Message>, TransportError> {
    let at = payload.len();
    read_into(recv, clock, &mut payload, len - at, at, len, FRAME_PREALLOC).await?;
    decode_payload(&payload)
        .map(Some)
        .map_err(|e| bad_frame(recv, e))
}

/// [`read_message_within`] for the answer to a request for `want`'s chunk. A response carrying
/// that chunk (nearly every frame on a request stream) has its chunk read straight into a
/// buffer of its own ([`meshfs_protocol::response_layout`]), not read into the payload and
/// copied out of it by the decoder; any other frame is read and decoded whole. The message is
/// the same either way.
pub async fn read_response_within(
    recv: &mut impl FrameRecv,
    wait: Duration,
    max_len: usize,
    want: Hash,
) -> Result<Option<Message>, TransportError> {
    let Some((len, mut clock)) = read_header(recv, Some(wait), max_len).await? else {
        return Ok(None);
    };
    let Some((head, data_len)) = meshfs_protocol::response_layout(want, len) else {
        return decode_rest(recv, &mut clock, Vec::new(), len).await;
    };
    let mut payload = Vec::new();
    let n = head.len();
    read_into(recv, &mut clock, &mut payload, n, 0, len, FRAME_PREALLOC).await?;
    if payload != head {
        return decode_rest(recv, &mut clock, payload, len).await;
    }
    let mut data = Vec::new();
    read_into(
        recv,
        &mut clock,
        &mut data,
        data_len,
        head.len(),
        len,
        CHUNK_PREALLOC,
    )
    .await?;
    let mut tail = Vec::with_capacity(1);
    read_into(recv, &mut clock, &mut tail, 1, len - 1, len, 1).await?;
    meshfs_protocol::finish_response(want, data, tail[0])
        .map(Some)
        .map_err(|e| bad_frame(recv, e))
}

/// Reads a frame's header within `wait` (see [`read_frame`]): its payload length (at most
/// `max_len`) and the clock of the rest, or `None` when the stream ended cleanly between frames.
pub(super) async fn read_header(
    recv: &mut impl FrameRecv,
    wait: Option<Duration>,
    max_len: usize,
) -> Result<Option<(usize, FrameClock)>, TransportError> {
    let mut header = [0u8; FRAME_HEADER_LEN];
    let first = recv.read(&mut header);
    let first = match wait {
        None => first.await,
        Some(wait) => match tokio::time::timeout(wait, first).await {
            Ok(read) => read,
            Err(_) => return Err(stall(recv, 0, None, wait)),
        },
    };
    let mut filled = first.map_err(stream_error)?;
    if filled == 0 {
        return Ok(None);
    }
    let mut clock = FrameClock::new();
    while filled < FRAME_HEADER_LEN {
        match clock.next(recv.read(&mut header[filled..])).await {
            Some(read) => match read.map_err(stream_error)? {
                n @ 1.. => filled += n,
                0 => {
                    return Err(bad_frame(
                        recv,
                        CodecError::Malformed(format!(
                            "stream ended after {filled} bytes of a frame header"
                        )),
                    ))
                }
            },
            None => return Err(stall(recv, filled, None, clock.waited())),
        }
    }
    let len = frame_len(header).map_err(|e| bad_frame(recv, e))?;
    debug_assert!(len <= MAX_FRAME_LEN);
    if len > max_len {
        let e = format!("a frame of {len} bytes where at most {max_len} are expected");
        return Err(bad_frame(recv, CodecError::Malformed(e)));
    }
    clock.declared(len);
    Ok(Some((len, clock)))
}

/// Appends the next `n` bytes of a frame of payload length `len` to `buf`, of which `at` bytes
/// were read before.
///
/// `buf` grows with what arrives instead of being given the declared length up front: a peer
/// that announces 16 MiB frames on a thousand streams and sends nothing costs at most
/// [`FRAME_PREALLOC`] for each stream being read. What it does send is held only for the
/// streams read at once: its control stream, the request streams being served (each frame a
/// few KiB at most) and the responses to this device's own requests.
pub(super) async fn read_into(
    recv: &mut impl FrameRecv,
    clock: &mut FrameClock,
    buf: &mut Vec<u8>,
    n: usize,
    at: usize,
    len: usize,
    prealloc: usize,
) -> Result<(), TransportError> {
    let start = buf.len();
    buf.reserve_exact(n.min(prealloc));
    while buf.len() < start + n {
        let got = at + buf.len() - start;
        let left = (start + n - buf.len()) as u64;
        match clock.next((&mut *recv).take(left).read_buf(buf)).await {
            Some(read) => match read.map_err(stream_error)? {
                1.. => {}
                0 => {
                    return Err(bad_frame(
                        recv,
                        CodecError::Malformed(format!(
                            "stream ended after {got} of {len} bytes of a frame"
                        )),
                    ))
                }
            },
            None => {
                return Err(stall(
                    recv,
                    FRAME_HEADER_LEN + got,
                    Some(len),
                    clock.waited(),
                ))
            }
        }
    }
    Ok(())
}

/// The deadlines of one frame being read: each read within [`FRAME_STALL`] of the last
/// progress, all of it within [`frame_deadline`] of its first byte.
pub(super) struct FrameClock {
    started: tokio::time::Instant,
    progress: tokio::time::Instant,
    /// Until the header is complete, the deadline of a frame of unknown length.
    end: tokio::time::Instant,
}

impl FrameClock {
    fn new() -> FrameClock {
        let now = tokio::time::Instant::now();
        FrameClock {
            started: now,
            progress: now,
            end: now + FRAME_TIME_BASE,
        }
    }

    /// The header said how long the frame is.
    fn declared(&mut self, len: usize) {
        self.end = self.started + frame_deadline(len);
    }

    /// Runs one read of the frame; `None` if it missed a deadline.
    async fn next<T>(&mut self, read: impl std::future::Future<Output = T>) -> Option<T> {
        let by = (self.progress + FRAME_STALL).min(self.end);
        let out = tokio::time::timeout_at(by, read).await.ok()?;
        self.progress = tokio::time::Instant::now();
        Some(out)
    }

    fn waited(&self) -> Duration {
        self.started.elapsed()
    }
}

/// Stops a stream whose peer stalled (see [`TransportError::Stalled`]).
pub(super) fn stall(
    recv: &mut impl FrameRecv,
    got: usize,
    len: Option<usize>,
    waited: Duration,
) -> TransportError {
    recv.refuse();
    TransportError::Stalled { got, len, waited }
}

pub(super) fn bad_frame(recv: &mut impl FrameRecv, e: CodecError) -> TransportError {
    recv.refuse();
    TransportError::Frame(e)
}

/// A read that failed: QUIC's own error where the carrier is a QUIC stream (its reset and
/// connection-lost cases stay distinct), the byte stream's otherwise.
fn stream_error(e: std::io::Error) -> TransportError {
    match e.downcast::<quinn::ReadError>() {
        Ok(read) => TransportError::Read(read),
        Err(e) => TransportError::Stream(e),
    }
}
