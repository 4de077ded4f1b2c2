//! A request's identity: its id (`x-request-id`, kept from the caller or
//! made here) and the trace it belongs to (W3C `traceparent`), for the
//! access log and the log lines about it.

use http::{HeaderMap, HeaderName, HeaderValue};
use rand::Rng as _;

/// The longest id kept from a caller; a longer one is replaced.
pub const MAX_ID: usize = 200;

/// Gives the request an id in `name`: the caller's, if it sent one that
/// is printable and at most [`MAX_ID`] bytes, else one made here (a random
/// UUID), set in `headers` so that every attempt carries it upstream.
pub fn keep_or_make(name: &HeaderName, headers: &mut HeaderMap) {
    use http::header::Entry;
    match headers.entry(name) {
        // One field: the one logged is the one sent.
        Entry::Occupied(mut field) if usable(field.get().as_bytes()) => {
            if field.iter().nth(1).is_some() {
                let first = field.get().clone();
                field.insert(first);
            }
        }
        // One field, never a list of ids (a second one was sent, or an
        // unusable one).
        Entry::Occupied(mut field) => {
            field.insert(made());
        }
        Entry::Vacant(field) => {
            field.insert(made());
        }
    }
}

/// Printable, at most [`MAX_ID`] bytes, and no list or explain-trace
/// separator (`,` `;`): one id, that reads as one.
fn usable(id: &[u8]) -> bool {
    !id.is_empty()
        && id.len() <= MAX_ID
        && id
            .iter()
            .all(|b| b.is_ascii_graphic() && *b != b',' && *b != b';')
}

/// A random (version 4) UUID, as Envoy makes them: 128 bits from the
/// thread's own small generator (seeded from the system's; ids must be
/// unique, not unguessable), written two digits a byte. Made for every
/// request: no formatting machinery, no shared state.
pub(crate) fn made() -> HeaderValue {
    HeaderValue::from_maybe_shared(made_text()).unwrap_or(HeaderValue::from_static("-"))
}

/// [`made`]'s id as its text (hexadecimal digits and dashes), not checked
/// again as a header value: for a writer that needs its bytes alone.
pub(crate) fn made_text() -> bytes::Bytes {
    use rand::SeedableRng as _;
    /// Ids made at once per thread, in one buffer that each id is a slice
    /// of: no allocation per id, and copying a request's headers for an
    /// attempt shares the buffer rather than copying the id.
    const BLOCK: usize = 64;
    const LEN: usize = 36;
    struct Ids {
        rng: rand::rngs::SmallRng,
        block: bytes::Bytes,
        next: usize,
    }
    thread_local! {
        static IDS: std::cell::RefCell<Ids> = std::cell::RefCell::new(Ids {
            rng: rand::rngs::SmallRng::from_rng(&mut rand::rng()),
            block: bytes::Bytes::new(),
            next: BLOCK,
        });
    }
    IDS.with(|ids| {
        let mut ids = ids.borrow_mut();
        if ids.next == BLOCK {
            let mut block = Vec::with_capacity(BLOCK * LEN);
            for _ in 0..BLOCK {
                block.extend_from_slice(&uuid_text(ids.rng.random::<u128>().to_le_bytes()));
            }
            // Its first slice makes it shared (one allocation a block);
            // the others are counted references.
            ids.block = bytes::Bytes::from(block);
            ids.next = 0;
        }
        let at = ids.next * LEN;
        ids.next += 1;
        ids.block.slice(at..at + LEN)
    })
}

/// A version 4 UUID (RFC 9562) of 16 random bytes, as text, two digits
/// a byte: each byte's pair looked up, at its fixed place between the
/// dashes (an unrolled copy, no branch per digit).
fn uuid_text(mut bytes: [u8; 16]) -> [u8; 36] {
    /// Where each byte's two digits go.
    const AT: [usize; 16] = [0, 2, 4, 6, 9, 11, 14, 16, 19, 21, 24, 26, 28, 30, 32, 34];
    /// Every byte's two lowercase hexadecimal digits.
    const PAIRS: [[u8; 2]; 256] = {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut pairs = [[0; 2]; 256];
        let mut b = 0;
        while b < 256 {
            pairs[b] = [HEX[b >> 4], HEX[b & 0xF]];
            b += 1;
        }
        pairs
    };
    bytes[6] = (bytes[6] & 0x0F) | 0x40;
    bytes[8] = (bytes[8] & 0x3F) | 0x80;
    let mut text = [b'-'; 36];
    for (byte, at) in bytes.iter().zip(AT) {
        text[at..at + 2].copy_from_slice(&PAIRS[usize::from(*byte)]);
    }
    text
}

/// The trace id of a W3C `traceparent` (`00-<32 hex>-<16 hex>-<2 hex>`),
/// when the field is one and the id is not all zeros.
pub fn trace_id(headers: &HeaderMap) -> Option<TraceId> {
    let field = headers.get("traceparent")?.as_bytes();
    let mut parts = field.split(|b| *b == b'-');
    let (version, id, parent, flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let hex = |p: &[u8], n: usize| {
        p.len() == n
            && p.iter()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b))
    };
    let well_formed = hex(version, 2)
        && version != b"ff"
        && hex(id, 32)
        && hex(parent, 16)
        && hex(flags, 2)
        && (version != b"00" || parts.next().is_none());
    let id = u128::from_str_radix(std::str::from_utf8(id).ok()?, 16).ok()?;
    // A parent id of zeros makes the whole field invalid (W3C), as the
    // tracer reads it.
    let parent_zero = parent.iter().all(|b| *b == b'0');
    (well_formed && id != 0 && !parent_zero).then_some(TraceId(id))
}

/// A trace id (128 bits), written as 32 lowercase hex digits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceId(pub u128);

impl std::fmt::Display for TraceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_usable_id_is_kept_and_any_other_replaced() {
        let name = HeaderName::from_static("x-request-id");
        let mut h = HeaderMap::new();
        h.insert(&name, HeaderValue::from_static("abc-123"));
        keep_or_make(&name, &mut h);
        assert_eq!(h[&name], "abc-123");
        for bad in [
            "",
            "has space",
            "a;request_id=evil",
            "a,b",
            &"x".repeat(MAX_ID + 1),
        ] {
            let mut h = HeaderMap::new();
            h.insert(&name, HeaderValue::from_str(bad).unwrap());
            keep_or_make(&name, &mut h);
            assert_ne!(h[&name], bad);
            assert_eq!(h.get_all(&name).iter().count(), 1);
        }
    }

    #[test]
    fn of_several_ids_the_first_usable_one_alone_goes_on() {
        let name = HeaderName::from_static("x-request-id");
        let mut h = HeaderMap::new();
        h.append(&name, HeaderValue::from_static("one"));
        h.append(&name, HeaderValue::from_static("two"));
        keep_or_make(&name, &mut h);
        let ids: Vec<_> = h.get_all(&name).iter().collect();
        assert_eq!(ids, ["one"]);
    }

    #[test]
    fn made_ids_are_version_4_uuids_and_differ() {
        let name = HeaderName::from_static("x-request-id");
        let ids: std::collections::HashSet<String> = (0..1000)
            .map(|_| {
                let mut h = HeaderMap::new();
                keep_or_make(&name, &mut h);
                h[&name].to_str().unwrap().to_owned()
            })
            .collect();
        assert_eq!(ids.len(), 1000);
        for id in ids.iter().take(20) {
            let b = id.as_bytes();
            assert_eq!(b.len(), 36, "{id}");
            assert_eq!([b[8], b[13], b[18], b[23]], [b'-'; 4], "{id}");
            assert_eq!(b[14], b'4', "version 4: {id}");
            assert!(b"89ab".contains(&b[19]), "variant 1: {id}");
        }
    }

    #[test]
    fn a_uuid_is_its_bytes_in_hex_with_version_and_variant_set() {
        let bytes: [u8; 16] = std::array::from_fn(|i| (i as u8) * 0x11);
        assert_eq!(&uuid_text(bytes), b"00112233-4455-4677-8899-aabbccddeeff");
        assert_eq!(
            &uuid_text([0xFF; 16]),
            b"ffffffff-ffff-4fff-bfff-ffffffffffff"
        );
    }

    #[test]
    fn trace_ids_are_read_from_well_formed_traceparents_only() {
        let with = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert("traceparent", HeaderValue::from_str(v).unwrap());
            trace_id(&h)
        };
        let id = "4bf92f3577b34da6a3ce929d0e0e4736";
        assert_eq!(
            with(&format!("00-{id}-00f067aa0ba902b7-01")).map(|t| t.to_string()),
            Some(id.to_owned())
        );
        for bad in [
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e4736",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "garbage",
        ] {
            assert_eq!(with(bad), None, "{bad}");
        }
        // A later version may add fields.
        assert!(with(&format!("01-{id}-00f067aa0ba902b7-01-later")).is_some());
    }
}
