//! The page's HTTP/1.1, as little of it as a browser needs: one request per connection, read
//! with a bounded head ([`MAX_HEAD`]) and body ([`MAX_BODY`]) within [`READ_TIMEOUT`], parsed
//! by `httparse` (D43); the answer written with `Connection: close` and the headers every
//! answer carries ([`SECURITY_HEADERS`]). Knows nothing of tokens or pages: `guard` and `site`
//! decide what to answer.

use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The longest request head (request line and headers) read; a browser's is under 2 KiB.
pub const MAX_HEAD: usize = 16 << 10;
/// The longest request body read: the page's one form sends none.
pub const MAX_BODY: usize = 4 << 10;
/// Most headers a request may have.
const MAX_HEADERS: usize = 64;
/// How long a client has to send its whole request.
pub const READ_TIMEOUT: Duration = Duration::from_secs(10);
/// How long one write to a client may take (a stalled reader is dropped).
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// Headers on every answer: nothing is cached, framed or sniffed, no address of the page goes
/// to another site as a referrer (a login address carries the token), and the page runs only
/// its own script and style. `same-origin`, not `no-referrer`: under `no-referrer` a browser
/// sends `Origin: null` with the page's own form, and `guard` could not tell it from a
/// stranger's.
pub const SECURITY_HEADERS: &str = "Cache-Control: no-store\r\n\
X-Content-Type-Options: nosniff\r\n\
X-Frame-Options: DENY\r\n\
Referrer-Policy: same-origin\r\n\
Cross-Origin-Resource-Policy: same-origin\r\n\
Content-Security-Policy: default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'\r\n";

/// One request as read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// `GET`, `POST`, …
    pub method: String,
    /// The path of the target, percent-decoded, without the query.
    pub path: String,
    /// The query's `name=value` pairs, decoded (`+` is a space).
    pub query: Vec<(String, String)>,
    /// The headers, names in lower case, values as sent (invalid UTF-8 replaced).
    pub headers: Vec<(String, String)>,
}

impl Request {
    /// The first header called `name` (lower case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// How many headers are called `name` (lower case).
    pub fn header_count(&self, name: &str) -> usize {
        self.headers.iter().filter(|(n, _)| n == name).count()
    }

    /// The first query parameter called `name`.
    pub fn param(&self, name: &str) -> Option<&str> {
        self.query
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Why a request was not read; each is answered with its status and the connection closed.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReadError {
    /// The client closed the connection before a whole head.
    #[error("the connection closed before a whole request")]
    Closed,
    /// Reading failed.
    #[error("reading the request failed: {0}")]
    Io(String),
    /// Not all of it came within [`READ_TIMEOUT`].
    #[error("the request did not come within {READ_TIMEOUT:?}")]
    Timeout,
    /// The head is longer than [`MAX_HEAD`], or has more than 64 headers.
    #[error("the request head is too large")]
    HeadTooLarge,
    /// The body is longer than [`MAX_BODY`].
    #[error("the request body is too large")]
    BodyTooLarge,
    /// `Transfer-Encoding`, or a malformed or repeated `Content-Length`.
    #[error("the request's body length is not one plain Content-Length")]
    BodyFraming,
    /// Not HTTP/1.x, or a target that is not an absolute path.
    #[error("malformed request: {0}")]
    Malformed(String),
}

impl ReadError {
    /// The status it is answered with; `None`: nothing to answer (the client is gone).
    pub fn status(&self) -> Option<u16> {
        match self {
            ReadError::Closed | ReadError::Io(_) => None,
            ReadError::Timeout => Some(408),
            ReadError::HeadTooLarge => Some(431),
            ReadError::BodyTooLarge => Some(413),
            ReadError::BodyFraming | ReadError::Malformed(_) => Some(400),
        }
    }
}

/// Reads one request within [`READ_TIMEOUT`]; its body, if any, is read and dropped (the page
/// takes no body), so that closing the connection after the answer does not reset it.
pub async fn read_request<R: AsyncRead + Unpin>(r: &mut R) -> Result<Request, ReadError> {
    read_request_within(r, READ_TIMEOUT).await
}

/// [`read_request`] with another time limit.
async fn read_request_within<R: AsyncRead + Unpin>(
    r: &mut R,
    limit: Duration,
) -> Result<Request, ReadError> {
    tokio::time::timeout(limit, read_inner(r))
        .await
        .unwrap_or(Err(ReadError::Timeout))
}

async fn read_inner<R: AsyncRead + Unpin>(r: &mut R) -> Result<Request, ReadError> {
    let mut buf = Vec::with_capacity(2048);
    let mut chunk = [0u8; 2048];
    loop {
        let n = r
            .read(&mut chunk)
            .await
            .map_err(|e| ReadError::Io(e.to_string()))?;
        if n == 0 {
            return Err(ReadError::Closed);
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some((req, head_len, body_len)) = parse_head(&buf)? {
            let have = buf.len() - head_len;
            if have < body_len {
                let mut rest = vec![0u8; body_len - have];
                r.read_exact(&mut rest)
                    .await
                    .map_err(|e| ReadError::Io(e.to_string()))?;
            }
            return Ok(req);
        }
        if buf.len() > MAX_HEAD {
            return Err(ReadError::HeadTooLarge);
        }
    }
}

/// Parses a request head from the start of `buf`: `None` while it is incomplete; else the
/// request, the head's length and the body's (never more than [`MAX_BODY`]).
pub fn parse_head(buf: &[u8]) -> Result<Option<(Request, usize, usize)>, ReadError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    let head_len = match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => return Err(ReadError::HeadTooLarge),
        Err(e) => return Err(ReadError::Malformed(e.to_string())),
    };
    if head_len > MAX_HEAD {
        return Err(ReadError::HeadTooLarge);
    }
    let method = req.method.unwrap_or_default().to_string();
    let target = req.path.unwrap_or_default();
    let headers: Vec<(String, String)> = req
        .headers
        .iter()
        .map(|h| {
            (
                h.name.to_ascii_lowercase(),
                String::from_utf8_lossy(h.value).trim().to_string(),
            )
        })
        .collect();
    if headers.iter().any(|(n, _)| n == "transfer-encoding") {
        return Err(ReadError::BodyFraming);
    }
    let lengths: Vec<&str> = headers
        .iter()
        .filter(|(n, _)| n == "content-length")
        .map(|(_, v)| v.as_str())
        .collect();
    let body_len = match lengths.as_slice() {
        [] => 0,
        [one] => one.parse::<usize>().map_err(|_| ReadError::BodyFraming)?,
        _ => return Err(ReadError::BodyFraming),
    };
    if body_len > MAX_BODY {
        return Err(ReadError::BodyTooLarge);
    }
    if !target.starts_with('/') {
        return Err(ReadError::Malformed(
            "the target is not an absolute path".into(),
        ));
    }
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p, q),
        None => (target, ""),
    };
    Ok(Some((
        Request {
            method,
            path: decode(path, false),
            query: form_pairs(query),
            headers,
        },
        head_len,
        body_len,
    )))
}

/// The `name=value` pairs of a query string or form, decoded.
pub fn form_pairs(q: &str) -> Vec<(String, String)> {
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((n, v)) => (decode(n, true), decode(v, true)),
            None => (decode(p, true), String::new()),
        })
        .collect()
}

/// Percent-decodes `s` (and `+` as a space in a form); a malformed escape stays as it is,
/// bytes that are not UTF-8 are replaced.
fn decode(s: &str, form: bool) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let escaped = match (b[i], b.get(i + 1), b.get(i + 2)) {
            (b'%', Some(&h), Some(&l)) => hex(h).zip(hex(l)),
            _ => None,
        };
        match (escaped, b[i]) {
            (Some((h, l)), _) => {
                out.push(h << 4 | l);
                i += 3;
            }
            (None, b'+') if form => {
                out.push(b' ');
                i += 1;
            }
            (None, c) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn hex(c: u8) -> Option<u8> {
    (c as char).to_digit(16).map(|d| d as u8)
}

/// Percent-encodes `s` for a query string.
pub fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// An answer to write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Response {
    /// The status code.
    pub status: u16,
    /// Extra headers, each `Name: value`.
    pub headers: Vec<String>,
    /// The `Content-Type`.
    pub content_type: &'static str,
    /// The body.
    pub body: Vec<u8>,
}

impl Response {
    /// A body of `content_type`.
    pub fn new(status: u16, content_type: &'static str, body: impl Into<Vec<u8>>) -> Response {
        Response {
            status,
            headers: Vec::new(),
            content_type,
            body: body.into(),
        }
    }

    /// A short plain-text answer that says only its status: what every refusal answers, so
    /// that it tells nothing of what is behind it.
    pub fn bare(status: u16) -> Response {
        Response::new(
            status,
            "text/plain; charset=utf-8",
            format!("{status} {}\n", reason(status)),
        )
    }

    /// `303 See Other` to `location` (a path on this server).
    pub fn see_other(location: &str) -> Response {
        let mut r = Response::bare(303);
        r.headers.push(format!("Location: {location}"));
        r
    }

    /// With one more header.
    pub fn with_header(mut self, header: String) -> Response {
        self.headers.push(header);
        self
    }

    /// The bytes on the wire.
    pub fn to_bytes(&self, head_only: bool) -> Vec<u8> {
        let mut out = format!(
            "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n{SECURITY_HEADERS}",
            self.status,
            reason(self.status),
            self.content_type,
            self.body.len()
        );
        for h in &self.headers {
            out.push_str(h);
            out.push_str("\r\n");
        }
        out.push_str("\r\n");
        let mut out = out.into_bytes();
        if !head_only {
            out.extend_from_slice(&self.body);
        }
        out
    }
}

/// The head of an event stream (`text/event-stream`), which stays open.
pub fn event_stream_head() -> Vec<u8> {
    format!(
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\nConnection: close\r\n{SECURITY_HEADERS}\r\n"
    )
    .into_bytes()
}

/// Writes `bytes` within [`WRITE_TIMEOUT`].
pub async fn write_all<W: AsyncWrite + Unpin>(w: &mut W, bytes: &[u8]) -> std::io::Result<()> {
    match tokio::time::timeout(WRITE_TIMEOUT, w.write_all(bytes)).await {
        Ok(r) => r,
        Err(_) => Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "the client did not read the answer",
        )),
    }
}

/// The reason phrase of the statuses the page uses.
fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        303 => "See Other",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        413 => "Content Too Large",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parse(s: &str) -> Result<Option<(Request, usize, usize)>, ReadError> {
        parse_head(s.as_bytes())
    }

    #[test]
    fn a_browser_request_is_read_with_its_decoded_path_query_and_headers() {
        let (req, head, body) = parse(
            "GET /events?folder=work&path=docs%2Fa+b.txt&since=2h HTTP/1.1\r\nHost: 127.0.0.1:8384\r\nCookie: a=b\r\n\r\n",
        )
        .unwrap()
        .unwrap();
        assert_eq!(req.method, "GET");
        assert_eq!(req.path, "/events");
        assert_eq!(req.param("path"), Some("docs/a b.txt"));
        assert_eq!(req.param("since"), Some("2h"));
        assert_eq!(req.header("host"), Some("127.0.0.1:8384"));
        assert_eq!(req.header("cookie"), Some("a=b"));
        assert_eq!((head, body), (head, 0));
    }

    #[test]
    fn an_incomplete_head_asks_for_more() {
        assert_eq!(parse("GET / HTTP/1.1\r\nHost: x\r\n"), Ok(None));
    }

    #[test]
    fn bodies_are_bounded_and_framed_only_by_one_content_length() {
        let (_, _, body) = parse("POST /scan HTTP/1.1\r\nContent-Length: 12\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!(body, 12);
        assert_eq!(
            parse("POST / HTTP/1.1\r\nContent-Length: 99999\r\n\r\n").unwrap_err(),
            ReadError::BodyTooLarge
        );
        for bad in [
            "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
            "POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
            "POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
        ] {
            assert_eq!(parse(bad).unwrap_err(), ReadError::BodyFraming, "{bad}");
        }
    }

    #[test]
    fn a_target_that_is_not_a_path_is_refused() {
        assert!(matches!(
            parse("GET http://evil.example/ HTTP/1.1\r\n\r\n"),
            Err(ReadError::Malformed(_))
        ));
        assert!(matches!(
            parse("GET / SPDY/3\r\n\r\n"),
            Err(ReadError::Malformed(_))
        ));
    }

    #[test]
    fn too_many_headers_are_refused_as_too_large() {
        let mut s = "GET / HTTP/1.1\r\n".to_string();
        for i in 0..100 {
            s.push_str(&format!("X-{i}: y\r\n"));
        }
        s.push_str("\r\n");
        assert_eq!(parse(&s).unwrap_err(), ReadError::HeadTooLarge);
    }

    #[test]
    fn reading_stops_at_the_head_limit_and_at_the_deadline() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            let endless = format!("GET / HTTP/1.1\r\nX: {}", "y".repeat(MAX_HEAD * 4));
            let mut r = endless.as_bytes();
            assert_eq!(
                read_request(&mut r).await.unwrap_err(),
                ReadError::HeadTooLarge
            );
            // A client that sends half a head and then nothing.
            let (mut client, mut server) = tokio::io::duplex(64);
            client.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
            assert_eq!(
                read_request_within(&mut server, Duration::from_millis(50))
                    .await
                    .unwrap_err(),
                ReadError::Timeout
            );
            drop(client);
        });
    }

    #[test]
    fn a_body_is_read_and_dropped_so_the_answer_is_not_reset() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            let mut r: &[u8] = b"POST /scan HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello";
            let req = read_request(&mut r).await.unwrap();
            assert_eq!(req.path, "/scan");
            assert!(r.is_empty(), "the body was read");
        });
    }

    #[test]
    fn every_answer_carries_the_security_headers_and_closes() {
        let text = String::from_utf8(Response::bare(401).to_bytes(false)).unwrap();
        assert!(text.starts_with("HTTP/1.1 401 Unauthorized\r\n"), "{text}");
        for h in [
            "Connection: close",
            "Cache-Control: no-store",
            "X-Frame-Options: DENY",
            "Referrer-Policy: same-origin",
            "frame-ancestors 'none'",
        ] {
            assert!(text.contains(h), "{h}: {text}");
        }
        assert!(text.ends_with("\r\n\r\n401 Unauthorized\n"), "{text}");
    }

    #[test]
    fn encoding_and_decoding_a_query_value_round_trip() {
        let v = "docs/a b&c=d%é+";
        let pairs = form_pairs(&format!("path={}&x", encode(v)));
        assert_eq!(pairs, [("path".into(), v.into()), ("x".into(), "".into())]);
        assert_eq!(decode("%zz%4", true), "%zz%4");
    }

    proptest! {
        #[test]
        fn any_bytes_are_a_request_an_error_or_a_wait_never_a_panic(
            bytes in proptest::collection::vec(any::<u8>(), 0..600)
        ) {
            let _ = parse_head(&bytes);
        }

        #[test]
        fn any_text_survives_encoding(s in ".{0,40}") {
            let pairs = form_pairs(&format!("v={}", encode(&s)));
            prop_assert_eq!(&pairs[0].1, &s);
        }
    }
}
