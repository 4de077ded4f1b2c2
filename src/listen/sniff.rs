//! The caller's first bytes: whether it speaks HTTP/2 or HTTP/1.1, read
//! before a connection is handed to either.

use super::h1::Rewind;

/// The caller's first bytes after the handshake, read by `deadline`: a
/// caller that completes a handshake and then says nothing must not hold
/// its connection slot any longer than one that says nothing at all. Read
/// until they tell the protocol (see [`speaks_h2`]). `None`: silent until
/// the deadline, or closed.
pub async fn first_bytes<S>(mut stream: S, deadline: tokio::time::Instant) -> Option<Rewind<S>>
where
    S: tokio::io::AsyncRead + Unpin,
{
    use tokio::io::AsyncReadExt as _;
    let mut buf = [0u8; 64];
    let mut n = 0;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf[n..])).await {
            Ok(Ok(read)) if read > 0 => n += read,
            _ => return None,
        }
        if speaks_h2(&buf[..n]).is_some() || n == buf.len() {
            return Some(Rewind::new(
                bytes::Bytes::copy_from_slice(&buf[..n]),
                stream,
            ));
        }
    }
}

/// Whether a caller whose first bytes are `first` speaks HTTP/2: they begin
/// the preface (`PRI ` is no HTTP/1 method anyone sends). `None` while
/// fewer than four bytes leave it open (`P` may begin `POST`).
pub fn speaks_h2(first: &[u8]) -> Option<bool> {
    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    let n = first.len().min(PREFACE.len());
    match first.get(..n) == PREFACE.get(..n) {
        true if n < 4 => None,
        like => Some(like),
    }
}

#[cfg(test)]
mod tests {
    fn first(bytes: &[u8]) -> Option<bool> {
        super::speaks_h2(bytes)
    }

    #[test]
    fn the_first_bytes_tell_the_protocol_once_there_are_four() {
        assert_eq!(first(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"), Some(true));
        assert_eq!(first(b"PRI "), Some(true));
        assert_eq!(first(b"POST / HTTP/1.1\r\n"), Some(false));
        assert_eq!(
            first(b"GET"),
            Some(false),
            "not a preface from the first byte"
        );
        assert_eq!(first(b"P"), None, "POST or PRI");
        assert_eq!(first(b"PRI"), None);
        assert_eq!(first(b""), None);
    }
}
