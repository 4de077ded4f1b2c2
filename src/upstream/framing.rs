//! An upstream's HTTP/1.1 answer read from bytes: its head, and its body by
//! the framing RFC 9112 §6.3 gives it (a length, chunked coding with
//! trailers, or the connection's end). Functions over a buffer, no I/O, so
//! that any input can be tried on them (see the property tests): whatever
//! the upstream sends is an error or a frame, never a panic, and never more
//! than the limits below is held.

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Version};

/// The largest answer head read (as hyper's, with its buffer at 16 KiB).
pub(crate) const MAX_HEAD: usize = 16 * 1024;

/// The most header fields in a head or a trailer block (hyper's default).
const MAX_FIELDS: usize = 100;

/// The most bytes of chunk extensions in one body (hyper's limit).
const MAX_EXTENSIONS: u64 = 16 * 1024;

/// The largest trailer block.
const MAX_TRAILERS: usize = 16 * 1024;

/// The longest chunk-size line: the extensions' limit and the size.
const MAX_SIZE_LINE: usize = MAX_EXTENSIONS as usize + 32;

/// What an upstream sent that HTTP/1.1 does not allow.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Malformed {
    #[error("the answer's head is malformed: {0}")]
    Head(httparse::Error),
    #[error("the answer's head is larger than {MAX_HEAD} bytes")]
    HeadTooLarge,
    #[error("the answer's status is outside 100-999")]
    Status,
    #[error("the answer's Content-Length is invalid")]
    ContentLength,
    #[error("an HTTP/1.0 answer has a Transfer-Encoding")]
    TransferEncoding,
    #[error("a chunk's size line is malformed")]
    ChunkSize,
    #[error("the chunk extensions are larger than {MAX_EXTENSIONS} bytes")]
    Extensions,
    #[error("a chunk's data does not end with CRLF")]
    ChunkEnd,
    #[error("the trailers are malformed or larger than {MAX_TRAILERS} bytes")]
    Trailers,
    #[error("the connection closed before the body was complete")]
    Incomplete,
}

/// How an answer's body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Framing {
    Length(u64),
    Chunked,
    /// Until the connection ends.
    Close,
}

/// An answer's head, parsed.
#[derive(Debug)]
pub(crate) struct Head {
    pub status: StatusCode,
    pub version: Version,
    pub headers: HeaderMap,
    /// The reason phrase, when it is not the status's usual one.
    pub reason: Option<Bytes>,
    pub framing: Framing,
    /// The connection may carry another request after this answer.
    pub keep_alive: bool,
}

/// What [`parse_head`] found at the start of a buffer.
#[derive(Debug)]
pub(crate) enum Parsed {
    /// More bytes are needed.
    Partial,
    /// An informational answer (1xx but 101), taken off the buffer:
    /// another head follows.
    Informational,
    Final(Head),
}

/// Parses the answer head at the start of `buf`, taking it off once whole.
/// `method`: the request's (a `HEAD`'s answer has no body).
pub(crate) fn parse_head(buf: &mut BytesMut, method: &Method) -> Result<Parsed, Malformed> {
    // Not filled in first: 3 KiB written for nothing on every answer.
    let mut fields = [const { std::mem::MaybeUninit::uninit() }; MAX_FIELDS];
    let mut response = httparse::Response::new(&mut []);
    let parsed = httparse::ParserConfig::default().parse_response_with_uninit_headers(
        &mut response,
        buf,
        &mut fields,
    );
    let len = match parsed {
        Ok(httparse::Status::Complete(len)) if len <= MAX_HEAD => len,
        Ok(httparse::Status::Complete(_)) => return Err(Malformed::HeadTooLarge),
        Ok(httparse::Status::Partial) if buf.len() >= MAX_HEAD => {
            return Err(Malformed::HeadTooLarge)
        }
        Ok(httparse::Status::Partial) => return Ok(Parsed::Partial),
        Err(e) => return Err(Malformed::Head(e)),
    };
    let code = response.code.unwrap_or(0);
    let status = StatusCode::from_u16(code).map_err(|_| Malformed::Status)?;
    if matches!(code, 100 | 102..=199) {
        let _ = buf.split_to(len);
        return Ok(Parsed::Informational);
    }
    let version = match response.version {
        Some(1) => Version::HTTP_11,
        _ => Version::HTTP_10,
    };
    let reason = response
        .reason
        .filter(|r| Some(*r) != status.canonical_reason())
        .map(|r| Bytes::copy_from_slice(r.as_bytes()));
    // Where each field sits in the head (offsets under MAX_HEAD fit in
    // 16 bits), to slice the values out of it without a copy once frozen.
    let start = buf.as_ptr() as usize;
    // (A slice outside the buffer, which httparse does not give, would
    // fail the bounds checks below, not panic.)
    let at = |part: &[u8]| (part.as_ptr() as usize).wrapping_sub(start) as u16;
    let mut spans = [[0u16; 4]; MAX_FIELDS];
    let count = response.headers.len();
    for (span, field) in spans.iter_mut().zip(response.headers.iter()) {
        let (name, value) = (field.name.as_bytes(), field.value);
        *span = [at(name), name.len() as u16, at(value), value.len() as u16];
    }
    let head = buf.split_to(len).freeze();
    // Room for what the proxy adds on the way back (Via, the attempt
    // count): a map grown later is rebuilt whole.
    let mut headers = crate::wire::headers::spare_map(count + 2);
    let mut seen = Seen::default();
    for (at, span) in spans[..count].iter().enumerate() {
        let [name, name_len, value, value_len] = span.map(usize::from);
        let (name, value) = (name..name + name_len, value..value + value_len);
        if name.end > head.len() || value.end > head.len() {
            return Err(Malformed::Head(httparse::Error::HeaderName));
        }
        let name = field_name(at, &head[name])
            .map_err(|_| Malformed::Head(httparse::Error::HeaderName))?;
        let value = HeaderValue::from_maybe_shared(head.slice(value))
            .map_err(|_| Malformed::Head(httparse::Error::HeaderValue))?;
        if seen.passes_on(&name, &value) {
            headers.append(name, value);
        }
    }
    let (framing, keep_alive) = framing_of(status, version, &mut headers, method, seen)?;
    Ok(Parsed::Final(Head {
        status,
        version,
        headers,
        reason,
        framing,
        keep_alive,
    }))
}

/// The name of an answer's field `at` that position, as `raw` spells it.
/// An upstream sends the same names in the same order answer after
/// answer: the last ones read at each position are kept (per thread, a
/// few dozen short ones), and a name compared costs less than one parsed.
fn field_name(at: usize, raw: &[u8]) -> Result<HeaderName, http::header::InvalidHeaderName> {
    const POSITIONS: usize = 24;
    const LONGEST: usize = 32;
    type Names = std::cell::RefCell<Vec<(Box<[u8]>, HeaderName)>>;
    thread_local! {
        static NAMES: Names = const { std::cell::RefCell::new(Vec::new()) };
    }
    if at >= POSITIONS || raw.len() > LONGEST {
        return HeaderName::from_bytes(raw);
    }
    NAMES.with(|names| {
        let Ok(mut names) = names.try_borrow_mut() else {
            return HeaderName::from_bytes(raw);
        };
        if let Some((seen, name)) = names.get(at) {
            if **seen == *raw {
                return Ok(name.clone());
            }
        }
        let name = HeaderName::from_bytes(raw)?;
        let entry = (Box::from(raw), name.clone());
        if at < names.len() {
            names[at] = entry;
        } else if at == names.len() {
            names.push(entry);
        }
        Ok(name)
    })
}

/// What the fields that frame an answer said, noted as the head is read:
/// no lookups after.
#[derive(Debug, Default, Clone, Copy)]
struct Seen {
    /// `Connection: close`.
    close: bool,
    transfer_encoding: bool,
    /// The length every `Content-Length` said, read as the head is.
    length: Option<u64>,
    /// How many lengths it was said in (one with leading zeros counts
    /// twice: it goes on said plainly).
    length_parts: u32,
    /// A `Content-Length` that is not a length, or that said another.
    bad_length: bool,
}

impl Seen {
    /// Notes `name` and whether it goes into the answer's map: a
    /// `Connection` that says only `keep-alive` or `close` is this hop's
    /// alone and names no other field (one that names others is kept, for
    /// the hop-by-hop rules to read).
    fn passes_on(&mut self, name: &HeaderName, value: &HeaderValue) -> bool {
        use http::header::{CONNECTION, CONTENT_LENGTH, TRANSFER_ENCODING};
        if *name == CONNECTION {
            let mut names_others = false;
            for option in value.as_bytes().split(|b| *b == b',') {
                let option = option.trim_ascii();
                if option.eq_ignore_ascii_case(b"close") {
                    self.close = true;
                } else if !option.eq_ignore_ascii_case(b"keep-alive") && !option.is_empty() {
                    names_others = true;
                }
            }
            return names_others;
        }
        self.transfer_encoding |= *name == TRANSFER_ENCODING;
        if *name == CONTENT_LENGTH {
            self.length_of(value.as_bytes());
        }
        true
    }

    /// Notes the lengths a `Content-Length` says (a list, `5, 5`, is
    /// allowed if they agree).
    fn length_of(&mut self, value: &[u8]) {
        for part in value.split(|b| *b == b',') {
            let part = part.trim_ascii();
            match parse_length(part) {
                Some(n) if self.length.is_none_or(|l| l == n) => {
                    self.length = Some(n);
                    let parts = match part.len() > 1 && part[0] == b'0' {
                        true => 2,
                        false => 1,
                    };
                    self.length_parts = self.length_parts.saturating_add(parts);
                }
                _ => self.bad_length = true,
            }
        }
    }
}

/// The body's framing of an answer (RFC 9112 §6.3), and whether its
/// connection may be used again.
fn framing_of(
    status: StatusCode,
    version: Version,
    headers: &mut HeaderMap,
    method: &Method,
    seen: Seen,
) -> Result<(Framing, bool), Malformed> {
    use http::header::CONTENT_LENGTH;
    let mut keep_alive = version == Version::HTTP_11 && !seen.close;
    // An answer the proxy will refuse as broken HTTP (see `classify`) is
    // read by its framing, and its connection not trusted again.
    if status.as_u16() > 599 {
        keep_alive = false;
    }
    if status == StatusCode::SWITCHING_PROTOCOLS {
        // Nobody asked (upgrades do not come this way): the connection is
        // no longer HTTP.
        return Ok((Framing::Length(0), false));
    }
    if matches!(status.as_u16(), 204 | 304) || method == Method::HEAD {
        return Ok((Framing::Length(0), keep_alive));
    }
    if seen.transfer_encoding {
        if version == Version::HTTP_10 {
            return Err(Malformed::TransferEncoding);
        }
        // Both: the coding wins, and the length is not passed on (RFC 9112
        // §6.3); a connection that carried such an answer is not trusted.
        if headers.remove(CONTENT_LENGTH).is_some() {
            keep_alive = false;
        }
        return match codings(headers) {
            (_, None) => Err(Malformed::TransferEncoding),
            (1, Some(true)) => Ok((Framing::Chunked, keep_alive)),
            (_, Some(true)) => Ok((Framing::Chunked, false)),
            (_, Some(false)) => Ok((Framing::Close, false)),
        };
    }
    if seen.bad_length {
        return Err(Malformed::ContentLength);
    }
    let length = seen.length;
    // A length said twice, or with leading zeros, goes on said once and
    // plainly: the caller's parser may not be as lenient.
    if let (Some(n), 2..) = (length, seen.length_parts) {
        headers.insert(CONTENT_LENGTH, HeaderValue::from(n));
    }
    Ok(match length {
        Some(n) => (Framing::Length(n), keep_alive),
        None => (Framing::Close, false),
    })
}

/// A decimal length: digits only, no sign, no overflow.
fn parse_length(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() || digits.len() > 19 {
        return None;
    }
    digits.iter().try_fold(0u64, |n, &d| {
        d.is_ascii_digit()
            .then(|| n.checked_mul(10)?.checked_add(u64::from(d - b'0')))
            .flatten()
    })
}

/// How many transfer codings there are, and whether the last is `chunked`
/// (`None`: there are none, only empty list elements).
fn codings(headers: &HeaderMap) -> (usize, Option<bool>) {
    let mut count = 0;
    let mut last = None;
    for coding in crate::wire::headers::transfer_codings(headers) {
        count += 1;
        last = Some(coding.eq_ignore_ascii_case(b"chunked"));
    }
    (count, last)
}

/// What [`Decoder::decode`] found.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Decoded {
    Data(Bytes),
    Trailers(HeaderMap),
    /// The body is over.
    End,
    /// More bytes are needed.
    More,
}

/// Where a body's reading stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// So many bytes left of a body of known length.
    Length(u64),
    /// A chunk-size line is next.
    Size,
    /// So many bytes left of a chunk's data.
    Data(u64),
    /// The CRLF after a chunk's data.
    DataEnd,
    /// The trailer section after the last chunk.
    Trailers,
    /// Everything until the connection ends.
    Close,
    Done,
}

/// A body's framing, read step by step off a buffer the connection fills.
#[derive(Debug)]
pub(crate) struct Decoder {
    state: State,
    /// Bytes of chunk extensions seen so far.
    extensions: u64,
    /// How far a line or section's end was looked for already: an
    /// upstream sending a byte at a time makes each byte looked at once,
    /// not once per read.
    scanned: usize,
}

impl Decoder {
    pub(crate) fn new(framing: Framing) -> Self {
        let state = match framing {
            Framing::Length(0) => State::Done,
            Framing::Length(n) => State::Length(n),
            Framing::Chunked => State::Size,
            Framing::Close => State::Close,
        };
        Self {
            state,
            extensions: 0,
            scanned: 0,
        }
    }

    /// The body is over (nothing more to read for it).
    pub(crate) fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// What is left of a body of known length.
    pub(crate) fn remaining(&self) -> Option<u64> {
        match self.state {
            State::Length(n) => Some(n),
            State::Done => Some(0),
            _ => None,
        }
    }

    /// One step over what `buf` holds, taking what it reads off it.
    pub(crate) fn decode(&mut self, buf: &mut BytesMut) -> Result<Decoded, Malformed> {
        match self.state {
            State::Done => Ok(Decoded::End),
            State::Length(_) | State::Data(_) if buf.is_empty() => Ok(Decoded::More),
            State::Length(left) => {
                let (data, left) = take(buf, left);
                self.state = match left {
                    0 => State::Done,
                    n => State::Length(n),
                };
                Ok(Decoded::Data(data))
            }
            State::Data(left) => {
                let (data, left) = take(buf, left);
                self.state = match left {
                    0 => State::DataEnd,
                    n => State::Data(n),
                };
                Ok(Decoded::Data(data))
            }
            State::Close if buf.is_empty() => Ok(Decoded::More),
            State::Close => Ok(Decoded::Data(buf.split().freeze())),
            State::DataEnd => self.data_end(buf),
            State::Size => self.size(buf),
            State::Trailers => self.trailers(buf),
        }
    }

    /// The connection ended: the body's end, if its framing says it may
    /// end so.
    pub(crate) fn eof(&mut self) -> Result<Decoded, Malformed> {
        match self.state {
            State::Close | State::Done => {
                self.state = State::Done;
                Ok(Decoded::End)
            }
            _ => Err(Malformed::Incomplete),
        }
    }

    fn data_end(&mut self, buf: &mut BytesMut) -> Result<Decoded, Malformed> {
        match buf.get(..2) {
            None if buf.first().is_none_or(|b| *b == b'\r') => Ok(Decoded::More),
            Some(b"\r\n") => {
                let _ = buf.split_to(2);
                self.state = State::Size;
                self.decode(buf)
            }
            _ => Err(Malformed::ChunkEnd),
        }
    }

    /// A chunk-size line: hex digits, optional extensions, CRLF.
    fn size(&mut self, buf: &mut BytesMut) -> Result<Decoded, Malformed> {
        let window = &buf[..buf.len().min(MAX_SIZE_LINE)];
        let from = self.scanned.min(window.len());
        let Some(lf) = window[from..].iter().position(|b| *b == b'\n') else {
            self.scanned = window.len();
            return match window.len() >= MAX_SIZE_LINE {
                true => Err(Malformed::Extensions),
                false => Ok(Decoded::More),
            };
        };
        let lf = from + lf;
        self.scanned = 0;
        let line = window[..lf]
            .strip_suffix(b"\r")
            .ok_or(Malformed::ChunkSize)?;
        let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
        // Leading zeros are allowed, and do not count toward 64 bits.
        let zeros = line[..digits].iter().take_while(|b| **b == b'0').count();
        if digits == 0 || digits - zeros > 16 {
            return Err(Malformed::ChunkSize);
        }
        let size = line[zeros..digits].iter().fold(0u64, |n, &d| {
            (n << 4) | u64::from((d as char).to_digit(16).unwrap_or(0))
        });
        let blank = line[digits..]
            .iter()
            .take_while(|b| matches!(b, b' ' | b'\t'))
            .count();
        let rest = &line[digits + blank..];
        match rest.first() {
            None => {}
            Some(b';')
                if rest
                    .iter()
                    .all(|&b| b == b'\t' || (b' '..0x7f).contains(&b)) =>
            {
                self.extensions += rest.len() as u64;
                if self.extensions > MAX_EXTENSIONS {
                    return Err(Malformed::Extensions);
                }
            }
            Some(_) => return Err(Malformed::ChunkSize),
        }
        let _ = buf.split_to(lf + 1);
        self.state = match size {
            0 => State::Trailers,
            n => State::Data(n),
        };
        self.decode(buf)
    }

    /// The trailer section: an empty line, or fields and an empty line.
    fn trailers(&mut self, buf: &mut BytesMut) -> Result<Decoded, Malformed> {
        if buf.starts_with(b"\r\n") {
            let _ = buf.split_to(2);
            self.state = State::Done;
            return Ok(Decoded::End);
        }
        let window = &buf[..buf.len().min(MAX_TRAILERS)];
        let from = self.scanned.saturating_sub(3).min(window.len());
        let Some(end) = window[from..].windows(4).position(|w| w == b"\r\n\r\n") else {
            self.scanned = window.len();
            return match window.len() >= MAX_TRAILERS {
                true => Err(Malformed::Trailers),
                false => Ok(Decoded::More),
            };
        };
        let end = from + end;
        let block = buf.split_to(end + 4);
        let mut fields = [httparse::EMPTY_HEADER; MAX_FIELDS];
        let Ok(httparse::Status::Complete((_, fields))) =
            httparse::parse_headers(&block, &mut fields)
        else {
            return Err(Malformed::Trailers);
        };
        let mut trailers = HeaderMap::with_capacity(fields.len());
        for field in fields.iter() {
            let name = HeaderName::from_bytes(field.name.as_bytes());
            let value = HeaderValue::from_bytes(field.value);
            let (Ok(name), Ok(value)) = (name, value) else {
                return Err(Malformed::Trailers);
            };
            trailers.append(name, value);
        }
        self.state = State::Done;
        Ok(Decoded::Trailers(trailers))
    }
}

/// Up to `left` bytes off the front of `buf`, and what is left after them.
fn take(buf: &mut BytesMut, left: u64) -> (Bytes, u64) {
    let n = usize::try_from(left).unwrap_or(usize::MAX).min(buf.len());
    (buf.split_to(n).freeze(), left - n as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn head(bytes: &[u8], method: &Method) -> Result<Parsed, Malformed> {
        parse_head(&mut BytesMut::from(bytes), method)
    }

    fn final_head(bytes: &[u8]) -> Head {
        match head(bytes, &Method::GET) {
            Ok(Parsed::Final(head)) => head,
            other => panic!("not a final head: {other:?}"),
        }
    }

    #[test]
    fn names_are_read_the_same_whether_kept_from_an_earlier_answer_or_not() {
        // Spelled differently at the same position, then the same spelling
        // again, then a custom name, a malformed one, one too long to keep.
        let long = "X-".repeat(20);
        for raw in [
            "Content-Length",
            "content-length",
            "CONTENT-LENGTH",
            "Content-Length",
            "X-Custom",
            "X-Custom",
            "Bad Name",
            long.as_str(),
            long.as_str(),
        ] {
            for at in [0, 1, 23, 24, 99] {
                let kept = field_name(at, raw.as_bytes()).ok();
                let parsed = HeaderName::from_bytes(raw.as_bytes()).ok();
                assert_eq!(kept, parsed, "{raw} at {at}");
            }
        }
        // An upstream that skips positions leaves none unkept in between.
        assert!(field_name(10, b"Date").is_ok());
    }

    #[test]
    fn a_connection_field_is_kept_only_when_it_names_other_fields() {
        let h =
            final_head(b"HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n");
        assert!(!h.headers.contains_key("connection"));
        assert!(h.keep_alive);
        let h = final_head(b"HTTP/1.1 200 OK\r\nConnection: , CLOSE \r\nContent-Length: 0\r\n\r\n");
        assert!(!h.headers.contains_key("connection"));
        assert!(!h.keep_alive);
        // Another line may name a field: that one stays, and the close
        // said on the first still counts.
        let h = final_head(
            b"HTTP/1.1 200 OK\r\nConnection: close\r\nConnection: x-secret, keep-alive\r\nX-Secret: 1\r\nContent-Length: 0\r\n\r\n",
        );
        let kept: Vec<_> = h.headers.get_all("connection").iter().collect();
        assert_eq!(kept, ["x-secret, keep-alive"]);
        assert!(!h.keep_alive);
    }

    #[test]
    fn a_head_and_its_framing() {
        let h = final_head(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: b\r\n\r\n");
        assert_eq!(h.status, StatusCode::OK);
        assert_eq!((h.framing, h.keep_alive), (Framing::Length(5), true));
        assert_eq!(h.headers["x-a"], "b");
        assert_eq!(h.reason, None);
        let h = final_head(b"HTTP/1.1 200 Fine\r\nTransfer-Encoding: chunked\r\n\r\n");
        assert_eq!((h.framing, h.keep_alive), (Framing::Chunked, true));
        assert_eq!(h.reason.as_deref(), Some(&b"Fine"[..]));
        // No length: until the connection ends, which is then not reused.
        let h = final_head(b"HTTP/1.1 200 OK\r\n\r\n");
        assert_eq!((h.framing, h.keep_alive), (Framing::Close, false));
        let h = final_head(
            b"HTTP/1.1 200 OK\r\nConnection: keep-alive, Close\r\nContent-Length: 0\r\n\r\n",
        );
        assert_eq!((h.framing, h.keep_alive), (Framing::Length(0), false));
        let h = final_head(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n");
        assert_eq!((h.framing, h.keep_alive), (Framing::Length(2), false));
        let h = final_head(b"HTTP/1.1 204 No Content\r\nContent-Length: 9\r\n\r\n");
        assert_eq!(h.framing, Framing::Length(0));
        let h = final_head(b"HTTP/1.1 304 Not Modified\r\nTransfer-Encoding: chunked\r\n\r\n");
        assert_eq!(h.framing, Framing::Length(0));
        let Ok(Parsed::Final(h)) = head(
            b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n",
            &Method::HEAD,
        ) else {
            panic!("a HEAD's answer");
        };
        assert_eq!(h.framing, Framing::Length(0));
        // A repeated length that agrees is one length, passed on once; so
        // is one with leading zeros.
        let h = final_head(b"HTTP/1.1 200 OK\r\nContent-Length: 3, 3\r\nContent-Length: 3\r\n\r\n");
        assert_eq!(h.framing, Framing::Length(3));
        let lengths: Vec<_> = h.headers.get_all("content-length").iter().collect();
        assert_eq!(lengths, ["3"]);
        let h = final_head(b"HTTP/1.1 200 OK\r\nContent-Length: 0005\r\n\r\n");
        assert_eq!(h.framing, Framing::Length(5));
        assert_eq!(h.headers["content-length"], "5");
        let h = final_head(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n");
        assert_eq!(h.headers["content-length"], "0");
    }

    #[test]
    fn a_coding_and_a_length_together_is_read_by_the_coding_and_never_reused() {
        let h = final_head(
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
        );
        assert_eq!((h.framing, h.keep_alive), (Framing::Chunked, false));
        assert!(!h.headers.contains_key("content-length"), "not passed on");
        // A coding other than chunked last: until the connection ends.
        let h = final_head(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, gzip\r\n\r\n");
        assert_eq!((h.framing, h.keep_alive), (Framing::Close, false));
    }

    #[test]
    fn informational_answers_are_taken_off_and_skipped() {
        let mut buf = BytesMut::from(
            &b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"[..],
        );
        assert!(matches!(
            parse_head(&mut buf, &Method::GET),
            Ok(Parsed::Informational)
        ));
        assert!(matches!(
            parse_head(&mut buf, &Method::GET),
            Ok(Parsed::Informational)
        ));
        assert!(
            matches!(parse_head(&mut buf, &Method::GET), Ok(Parsed::Final(h)) if h.status == 200)
        );
        assert!(buf.is_empty());
        // A 101 is final, with no body, and ends the connection's use.
        let h = final_head(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n");
        assert_eq!((h.framing, h.keep_alive), (Framing::Length(0), false));
    }

    #[test]
    fn malformed_heads_are_refused() {
        let bad = |bytes: &[u8]| head(bytes, &Method::GET).unwrap_err();
        assert_eq!(
            bad(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n"),
            Malformed::ContentLength
        );
        assert_eq!(
            bad(b"HTTP/1.1 200 OK\r\nContent-Length: +5\r\n\r\n"),
            Malformed::ContentLength
        );
        // Within one line too, and a bad part after a good one.
        assert_eq!(
            bad(b"HTTP/1.1 200 OK\r\nContent-Length: 5, 6\r\n\r\n"),
            Malformed::ContentLength
        );
        assert_eq!(
            bad(b"HTTP/1.1 200 OK\r\nContent-Length: 5, x\r\n\r\n"),
            Malformed::ContentLength
        );
        assert_eq!(
            bad(b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999\r\n\r\n"),
            Malformed::ContentLength
        );
        assert_eq!(
            bad(b"HTTP/1.1 200 OK\r\nContent-Length: \r\n\r\n"),
            Malformed::ContentLength
        );
        assert_eq!(
            bad(b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"),
            Malformed::TransferEncoding
        );
        assert!(matches!(
            bad(b"HTTP/1.1 2x0 OK\r\n\r\n"),
            Malformed::Head(_)
        ));
        assert!(matches!(
            bad(b"HTTP/1.1 200 OK\r\nA b: c\r\n\r\n"),
            Malformed::Head(_)
        ));
        assert!(matches!(
            bad(b"HTTP/1.1 200 OK\r\nA: b\rc\r\n\r\n"),
            Malformed::Head(_)
        ));
        let many: Vec<u8> = [
            &b"HTTP/1.1 200 OK\r\n"[..],
            &b"A: b\r\n".repeat(MAX_FIELDS + 1),
            b"\r\n",
        ]
        .concat();
        assert!(matches!(
            bad(&many),
            Malformed::Head(httparse::Error::TooManyHeaders)
        ));
        let large: Vec<u8> = [&b"HTTP/1.1 200 OK\r\nA: "[..], &vec![b'a'; MAX_HEAD]].concat();
        assert_eq!(bad(&large), Malformed::HeadTooLarge);
        // Short of the limit, and unfinished: more is needed.
        assert!(matches!(
            head(&large[..MAX_HEAD - 1], &Method::GET),
            Ok(Parsed::Partial)
        ));
    }

    /// Everything `decoder` gives for `bytes` fed `step` bytes at a time:
    /// the data, the trailers, and whether it ended (or its error).
    fn decode_all(
        framing: Framing,
        bytes: &[u8],
        step: usize,
    ) -> Result<(Vec<u8>, Option<HeaderMap>, bool), Malformed> {
        let mut decoder = Decoder::new(framing);
        let mut buf = BytesMut::new();
        let (mut data, mut trailers) = (Vec::new(), None);
        let mut chunks = bytes.chunks(step.max(1));
        loop {
            match decoder.decode(&mut buf)? {
                Decoded::Data(d) => {
                    assert!(!d.is_empty(), "no empty frames");
                    data.extend_from_slice(&d);
                }
                Decoded::Trailers(t) => trailers = Some(t),
                Decoded::End => return Ok((data, trailers, true)),
                Decoded::More => match chunks.next() {
                    Some(chunk) => buf.extend_from_slice(chunk),
                    None => {
                        return match decoder.eof()? {
                            Decoded::End => Ok((data, trailers, true)),
                            _ => Ok((data, trailers, false)),
                        }
                    }
                },
            }
            assert!(
                buf.len() <= MAX_SIZE_LINE + step.max(1) + MAX_TRAILERS,
                "bounded"
            );
        }
    }

    #[test]
    fn chunked_bodies_with_extensions_and_trailers() {
        let body =
            b"5;name=\"v\"\r\nhello\r\n6 ; a=b\r\n world\r\n0\r\nGrpc-Status: 0\r\nX-T: u\r\n\r\n";
        for step in [1, 2, 3, 7, body.len()] {
            let (data, trailers, ended) = decode_all(Framing::Chunked, body, step).unwrap();
            assert_eq!(data, b"hello world");
            let trailers = trailers.unwrap();
            assert_eq!(
                (
                    trailers["grpc-status"].as_bytes(),
                    trailers["x-t"].as_bytes()
                ),
                (&b"0"[..], &b"u"[..])
            );
            assert!(ended);
        }
        let (data, trailers, ended) =
            decode_all(Framing::Chunked, b"A\r\n0123456789\r\n0\r\n\r\n", 1).unwrap();
        assert_eq!((data.len(), trailers.is_none(), ended), (10, true, true));
    }

    #[test]
    fn transfer_codings_are_read_as_a_list() {
        let h = final_head(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked,\r\n\r\n");
        assert_eq!(
            (h.framing, h.keep_alive),
            (Framing::Chunked, true),
            "an empty element is none"
        );
        // Chunked, but not alone: read by it, the connection not used again
        // (the answer is refused as broken HTTP).
        let h = final_head(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n");
        assert_eq!((h.framing, h.keep_alive), (Framing::Chunked, false));
        let h = final_head(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n",
        );
        assert_eq!((h.framing, h.keep_alive), (Framing::Chunked, false));
        assert_eq!(
            head(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: ,\r\n\r\n",
                &Method::GET
            )
            .unwrap_err(),
            Malformed::TransferEncoding
        );
        let h = final_head(b"HTTP/1.1 600 Odd\r\nContent-Length: 0\r\n\r\n");
        assert!(!h.keep_alive, "a status the proxy refuses");
    }

    #[test]
    fn chunk_sizes_may_have_leading_zeros() {
        let body = b"00000000000000000000005\r\nhello\r\n0000\r\n\r\n";
        let (data, _, ended) = decode_all(Framing::Chunked, body, 3).unwrap();
        assert_eq!((&data[..], ended), (&b"hello"[..], true));
    }

    #[test]
    fn malformed_chunked_bodies_are_refused() {
        let bad = |bytes: &[u8]| decode_all(Framing::Chunked, bytes, 1).unwrap_err();
        assert_eq!(bad(b"g\r\n"), Malformed::ChunkSize);
        assert_eq!(bad(b"\r\n"), Malformed::ChunkSize);
        assert_eq!(
            bad(b"5\nhello\r\n0\r\n\r\n"),
            Malformed::ChunkSize,
            "a bare LF"
        );
        assert_eq!(bad(b"5\r\r\nhello\r\n"), Malformed::ChunkSize);
        assert_eq!(bad(b"-5\r\n"), Malformed::ChunkSize);
        assert_eq!(
            bad(b"10000000000000000\r\n"),
            Malformed::ChunkSize,
            "past 64 bits"
        );
        assert_eq!(bad(b"5;a\x00\r\nhello\r\n"), Malformed::ChunkSize);
        assert_eq!(bad(b"5\r\nhelloXX0\r\n\r\n"), Malformed::ChunkEnd);
        assert_eq!(
            bad(b"5\r\nhello\r\n0\r\nA b: c\r\n\r\n"),
            Malformed::Trailers
        );
        let long_ext = [&b"1;"[..], &vec![b'a'; MAX_SIZE_LINE]].concat();
        assert_eq!(bad(&long_ext), Malformed::Extensions);
        // Small extensions, many of them: their sum is bounded too.
        let many = b"1;aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\nx\r\n".repeat(400);
        assert_eq!(
            decode_all(Framing::Chunked, &many, 64).unwrap_err(),
            Malformed::Extensions
        );
        let trailers = [&b"0\r\nA: "[..], &vec![b'a'; MAX_TRAILERS]].concat();
        assert_eq!(bad(&trailers), Malformed::Trailers);
        // The connection ends inside the body.
        assert_eq!(bad(b"5\r\nhel"), Malformed::Incomplete);
        assert_eq!(bad(b"5\r\nhello\r\n"), Malformed::Incomplete);
    }

    #[test]
    fn bodies_by_length_and_by_the_connections_end() {
        let (data, _, ended) = decode_all(Framing::Length(5), b"hello", 2).unwrap();
        assert_eq!((&data[..], ended), (&b"hello"[..], true));
        assert_eq!(
            decode_all(Framing::Length(6), b"hello", 2).unwrap_err(),
            Malformed::Incomplete
        );
        // What comes after the length is not the body's.
        let mut decoder = Decoder::new(Framing::Length(2));
        let mut buf = BytesMut::from(&b"hiHTTP"[..]);
        assert_eq!(
            decoder.decode(&mut buf),
            Ok(Decoded::Data(Bytes::from_static(b"hi")))
        );
        assert!(decoder.is_done());
        assert_eq!(&buf[..], b"HTTP");
        let (data, _, ended) = decode_all(Framing::Close, b"until the end", 4).unwrap();
        assert_eq!((&data[..], ended), (&b"until the end"[..], true));
        assert!(Decoder::new(Framing::Length(0)).is_done());
    }

    /// `data` in chunks of the given sizes, with an extension on some.
    fn chunked(data: &[u8], sizes: &[usize]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut rest = data;
        for (i, &size) in sizes.iter().enumerate() {
            let n = size.min(rest.len());
            if n == 0 {
                break;
            }
            let ext = if i % 3 == 1 { ";k=v" } else { "" };
            out.extend_from_slice(format!("{n:X}{ext}\r\n").as_bytes());
            out.extend_from_slice(&rest[..n]);
            out.extend_from_slice(b"\r\n");
            rest = &rest[n..];
        }
        if !rest.is_empty() {
            out.extend_from_slice(format!("{:x}\r\n", rest.len()).as_bytes());
            out.extend_from_slice(rest);
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(b"0\r\n\r\n");
        out
    }

    proptest! {
        /// Whatever bytes come, as a head or as a body of any framing,
        /// the reading ends in frames or an error: no panic, and the
        /// buffer held stays within the limits.
        #[test]
        fn any_bytes_are_read_or_refused(
            bytes in proptest::collection::vec(any::<u8>(), 0..2048),
            step in 1usize..64,
            length in 0u64..4096,
        ) {
            let _ = head(&bytes, &Method::GET);
            let _ = head(&bytes, &Method::HEAD);
            for framing in [Framing::Chunked, Framing::Length(length), Framing::Close] {
                let _ = decode_all(framing, &bytes, step);
            }
        }

        /// Bytes that look like HTTP (digits, CRLFs, colons, hex): the
        /// same, nearer the paths that matter.
        #[test]
        fn http_like_bytes_are_read_or_refused(
            parts in proptest::collection::vec(prop_oneof![
                Just(&b"\r\n"[..]), Just(&b"HTTP/1.1 "[..]), Just(&b"200 OK"[..]), Just(&b"101"[..]),
                Just(&b"100"[..]), Just(&b"Content-Length: "[..]), Just(&b"Transfer-Encoding: chunked"[..]),
                Just(&b"0"[..]), Just(&b"5"[..]), Just(&b"ff"[..]), Just(&b";x=y"[..]), Just(&b": "[..]),
                Just(&b"a"[..]), Just(&b"\n"[..]), Just(&b" "[..]),
            ], 0..200),
            step in 1usize..32,
        ) {
            let bytes = parts.concat();
            let mut buf = BytesMut::from(&bytes[..]);
            while let Ok(Parsed::Informational) = parse_head(&mut buf, &Method::GET) {}
            let _ = decode_all(Framing::Chunked, &bytes, step);
        }

        /// A chunked body, however it is cut into chunks and however its
        /// bytes arrive, reads back as the data it carries.
        #[test]
        fn chunked_bodies_read_back_whole(
            data in proptest::collection::vec(any::<u8>(), 0..3000),
            sizes in proptest::collection::vec(1usize..700, 0..12),
            step in 1usize..200,
        ) {
            let encoded = chunked(&data, &sizes);
            let (decoded, trailers, ended) = decode_all(Framing::Chunked, &encoded, step).unwrap();
            prop_assert_eq!(decoded, data);
            prop_assert!(trailers.is_none());
            prop_assert!(ended);
        }
    }
}
