//! Proxy header rules of RFC 9110 §7.6: hop-by-hop fields are dropped both
//! ways, `Via` is added, and `X-Forwarded-For/-Proto/-Host` tell the upstream
//! who asked.

use std::net::IpAddr;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::Version;

/// Fields that describe one connection, never forwarded (RFC 9110 §7.6.1).
/// `Trailer` is not one (RFC 9110 drops it from RFC 2616's list): it says
/// which trailer fields follow, and hyper sends to an HTTP/1.1 caller only
/// the trailers it declares.
const HOPS: usize = 7;
/// Where `Connection` and `TE` are in [`HOP_BY_HOP`].
const CONNECTION_AT: usize = 0;
const PROXY_CONNECTION_AT: usize = 2;
const TE_AT: usize = 3;
const TRANSFER_ENCODING_AT: usize = 4;
const HOP_BY_HOP: [HeaderName; HOPS] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TE,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    // Belongs to an h2c upgrade, which is never passed on (RFC 9113 §3.2
    // made it connection-specific).
    HeaderName::from_static("http2-settings"),
];

/// Fields a trailer section must not carry (RFC 9110 §6.5.1: framing,
/// routing, content metadata, the proxy's own), besides the hop-by-hop ones.
/// HTTP/2 refuses connection-specific fields outright: passed on from an
/// HTTP/1 peer, one would reset the stream.
const NOT_IN_TRAILERS: [HeaderName; 9] = [
    header::CONTENT_LENGTH,
    header::CONTENT_TYPE,
    header::CONTENT_ENCODING,
    header::CONTENT_RANGE,
    header::HOST,
    header::TRAILER,
    header::AUTHORIZATION,
    HeaderName::from_static("x-herdguard-error"),
    HeaderName::from_static("x-herdguard-attempts"),
];

/// A map given back for reuse holds room for at most this many fields:
/// a field's slot is 104 bytes and its index 4, so a spare map is at most
/// about 7 KiB, one a thread.
const SPARE_FIELDS: usize = 64;

thread_local! {
    static SPARE: std::cell::Cell<Option<HeaderMap>> = const { std::cell::Cell::new(None) };
}

/// A map with room for `fields` more: the one last given back on this
/// thread ([`give_back`]), or a new one. hyper makes each request's map
/// from the last answer's it wrote; with the request's map given back when
/// the request ends and the next answer's head parsed into it, a busy
/// connection's plain GETs allocate no map.
pub fn spare_map(fields: usize) -> HeaderMap {
    let mut map = SPARE
        .try_with(std::cell::Cell::take)
        .ok()
        .flatten()
        .unwrap_or_default();
    map.reserve(fields);
    map
}

/// Keeps `map`, emptied, for this thread's next [`spare_map`], in place of
/// any kept before; one with room for more than 64 fields is dropped, and
/// so is one that held more than 64 values (a name's further values are
/// kept apart, in room an emptied map keeps too).
pub fn give_back(mut map: HeaderMap) {
    if map.capacity() == 0 || map.capacity() > SPARE_FIELDS || map.len() > SPARE_FIELDS {
        return;
    }
    map.clear();
    let _ = SPARE.try_with(|spare| spare.set(Some(map)));
}

/// Drops from a trailer section what may not be there, in either direction.
pub fn clean_trailers(trailers: &mut HeaderMap) {
    for name in HOP_BY_HOP.iter().chain(NOT_IN_TRAILERS.iter()) {
        if trailers.contains_key(name) {
            trailers.remove(name);
        }
    }
}

pub static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
pub static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
pub static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
pub static X_HERDGUARD_ATTEMPT: HeaderName = HeaderName::from_static("x-herdguard-attempt");
pub static X_HERDGUARD_ATTEMPTS: HeaderName = HeaderName::from_static("x-herdguard-attempts");
pub static X_HERDGUARD_ERROR: HeaderName = HeaderName::from_static("x-herdguard-error");
pub static X_HERDGUARD_EXPLAIN: HeaderName = HeaderName::from_static("x-herdguard-explain");
pub static X_HERDGUARD_FAULT: HeaderName = HeaderName::from_static("x-herdguard-fault");
/// Envoy's (Istio's sidecar's) retry count for the request, set to 0: one
/// layer of retries.
pub static X_ENVOY_MAX_RETRIES: HeaderName = HeaderName::from_static("x-envoy-max-retries");

/// Which of the fields the proxy reads a message carries, found in one pass
/// over its names. Most messages carry none of them, and a look-up hashes
/// its name (a custom one byte by byte) where the pass looks at each name's
/// length and compares only names of a length it knows: a field that is
/// absent is not looked up at all. Four bytes, as every request's future
/// keeps it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Present(u32);

impl Present {
    pub const CONNECTION: u32 = 1;
    pub const KEEP_ALIVE: u32 = 1 << 1;
    pub const PROXY_CONNECTION: u32 = 1 << 2;
    pub const TE: u32 = 1 << 3;
    pub const TRANSFER_ENCODING: u32 = 1 << 4;
    pub const UPGRADE: u32 = 1 << 5;
    pub const HTTP2_SETTINGS: u32 = 1 << 6;
    pub const TRAILER: u32 = 1 << 7;
    pub const CONTENT_TYPE: u32 = 1 << 8;
    /// `x-herdguard-explain`.
    pub const EXPLAIN: u32 = 1 << 9;
    /// `x-herdguard-attempt`: an outer hop numbers its attempts.
    pub const ATTEMPT: u32 = 1 << 10;
    /// `x-herdguard-error`.
    pub const ERROR: u32 = 1 << 11;
    /// `x-herdguard-fault`.
    pub const FAULT: u32 = 1 << 12;
    pub const X_FORWARDED_FOR: u32 = 1 << 13;
    pub const X_FORWARDED_PROTO: u32 = 1 << 14;
    pub const X_FORWARDED_HOST: u32 = 1 << 15;
    /// Not a field: the request's id is to be made where it is forwarded
    /// (see [`HopFields`]), not put in the caller's map.
    pub const MAKE_ID: u32 = 1 << 16;
    pub const CONTENT_LENGTH: u32 = 1 << 17;
    /// A name like a framing field's with `_` for `-`
    /// (`transfer_encoding`), see [`check_look_alikes`].
    pub const LOOK_ALIKE: u32 = 1 << 18;
    /// The hop-by-hop fields, in the order of [`HOP_BY_HOP`].
    const HOPS: [u32; HOPS] = [
        Self::CONNECTION,
        Self::KEEP_ALIVE,
        Self::PROXY_CONNECTION,
        Self::TE,
        Self::TRANSFER_ENCODING,
        Self::UPGRADE,
        Self::HTTP2_SETTINGS,
    ];

    pub fn of(headers: &HeaderMap) -> Self {
        Self(headers.keys().fold(0, |found, name| found | bit_of(name)))
    }

    /// Whether any of `fields` (bits of this type) is there.
    pub fn any(self, fields: u32) -> bool {
        self.0 & fields != 0
    }

    /// These, and `bits` besides.
    pub fn with(self, bits: u32) -> Self {
        Self(self.0 | bits)
    }
}

/// The bit of [`Present`] that stands for `name`, or 0.
fn bit_of(name: &HeaderName) -> u32 {
    // Names come lower-case; each length known has one or two candidates.
    let name = name.as_str();
    match (name.len(), name) {
        (2, "te") => Present::TE,
        (7, "upgrade") => Present::UPGRADE,
        (7, "trailer") => Present::TRAILER,
        (10, "connection") => Present::CONNECTION,
        (10, "keep-alive") => Present::KEEP_ALIVE,
        (12, "content-type") => Present::CONTENT_TYPE,
        (14, "content-length") => Present::CONTENT_LENGTH,
        (14, "http2-settings") => Present::HTTP2_SETTINGS,
        (15, "x-forwarded-for") => Present::X_FORWARDED_FOR,
        (16, "x-forwarded-host") => Present::X_FORWARDED_HOST,
        (17, "x-forwarded-proto") => Present::X_FORWARDED_PROTO,
        (16, "proxy-connection") => Present::PROXY_CONNECTION,
        (17, "transfer-encoding") => Present::TRANSFER_ENCODING,
        (17, "x-herdguard-error") => Present::ERROR,
        (17, "x-herdguard-fault") => Present::FAULT,
        (19, "x-herdguard-explain") => Present::EXPLAIN,
        (19, "x-herdguard-attempt") => Present::ATTEMPT,
        // Only a name as long as one of the two can pass for it.
        (14 | 17, _) if name.contains('_') && framing_look_alike(name) => Present::LOOK_ALIKE,
        _ => 0,
    }
}

/// `transfer_encoding` or `content_length`, and the like with only some
/// `-` written `_`: CGI, WSGI and PHP stacks fold `_` and `-` into one.
fn framing_look_alike(name: &str) -> bool {
    let dashed = |framing: &str| {
        name.len() == framing.len()
            && name
                .bytes()
                .zip(framing.bytes())
                .all(|(n, f)| n == f || (n == b'_' && f == b'-'))
    };
    dashed("transfer-encoding") || dashed("content-length")
}

/// Removes hop-by-hop fields and every field the `Connection` header names.
/// With `upgrade`, the `Connection: upgrade` and `Upgrade` pair is kept so an
/// HTTP/1.1 upgrade can pass through.
pub fn strip_hop_by_hop(headers: &mut HeaderMap, upgrade: bool) {
    strip_hop_by_hop_found(headers, upgrade, Present::of(headers));
}

/// [`strip_hop_by_hop_found`] for an answer: `TE` says what a request's
/// sender accepts, and is never passed back, not even as `TE: trailers`.
pub fn strip_answer_hop_by_hop_found(headers: &mut HeaderMap, upgrade: bool, found: Present) {
    strip_hop_by_hop_found(headers, upgrade, found);
    if found.any(Present::TE) {
        headers.remove(header::TE);
    }
}

/// [`strip_hop_by_hop`], for a message whose fields were looked for
/// already (`found`, taken since nothing but fields outside [`Present`]
/// changed).
pub fn strip_hop_by_hop_found(headers: &mut HeaderMap, upgrade: bool, found: Present) {
    // Each removal hashes its name, and most messages carry one hop-by-hop
    // field or none: look at the few fields there are first.
    let present = Present::HOPS.map(|bit| found.any(bit));
    if present == [false; HOPS] {
        if upgrade {
            headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        }
        return;
    }
    // The usual case after that: a lone `Connection: keep-alive` (or `close`),
    // which names no other field.
    let lone_connection = present
        .iter()
        .enumerate()
        .all(|(i, p)| *p == (i == CONNECTION_AT));
    if lone_connection && !upgrade {
        if let header::Entry::Occupied(connection) = headers.entry(header::CONNECTION) {
            let value = connection.get().as_bytes().trim_ascii();
            let one_line = connection.iter().nth(1).is_none();
            if one_line
                && (value.eq_ignore_ascii_case(b"keep-alive")
                    || value.eq_ignore_ascii_case(b"close"))
            {
                connection.remove();
                return;
            }
        }
    }
    if present[CONNECTION_AT] || present[PROXY_CONNECTION_AT] {
        // The options may come on several lines: each names fields to drop.
        // The old `Proxy-Connection` is read as `Connection` is: what it
        // names is for this hop only too.
        let named: Vec<HeaderName> = headers
            .get_all(header::CONNECTION)
            .iter()
            .chain(headers.get_all(&HOP_BY_HOP[PROXY_CONNECTION_AT]).iter())
            .filter_map(|v| v.to_str().ok())
            .flat_map(|text| text.split(','))
            .map(|t| t.trim())
            // The usual options, `keep-alive` and `close`, name no other field
            // (a `Keep-Alive` field is hop-by-hop anyway: removed below).
            .filter(|t| !t.eq_ignore_ascii_case("keep-alive") && !t.eq_ignore_ascii_case("close"))
            .filter_map(|t| HeaderName::from_bytes(t.as_bytes()).ok())
            .collect();
        for name in named {
            if !(upgrade && (name == header::UPGRADE || name == header::CONNECTION)) {
                headers.remove(&name);
            }
        }
    }
    // `TE: trailers` says the client accepts trailers; the proxy relays them, so
    // it may say the same to the upstream (gRPC needs it).
    let te_trailers = present[TE_AT] && lists(headers, &header::TE, "trailers");
    for (name, present) in HOP_BY_HOP.iter().zip(present) {
        if !present || (upgrade && (name == header::CONNECTION || name == header::UPGRADE)) {
            continue;
        }
        headers.remove(name);
    }
    // A message with both framed itself by `Transfer-Encoding`; its
    // `Content-Length` is wrong, and this hop frames the body anew
    // (RFC 9112 §6.3: a proxy removes it).
    if present[TRANSFER_ENCODING_AT] {
        headers.remove(header::CONTENT_LENGTH);
    }
    if upgrade {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    }
    if te_trailers {
        headers.insert(header::TE, HeaderValue::from_static("trailers"));
    }
}

/// Whether an HTTP/1.1 request asks to upgrade to a protocol the proxy
/// tunnels (WebSocket and the like). An upgrade to `h2c` is never tunnelled:
/// the caller would then speak HTTP/2 straight to the upstream, past every
/// header rule ("h2c smuggling"); it is forwarded as a plain request.
pub fn requested_upgrade(version: Version, headers: &HeaderMap) -> bool {
    version == Version::HTTP_11
        && only_websocket(headers)
        && lists(headers, &header::CONNECTION, "upgrade")
}

/// [`requested_upgrade`], looked into only when the scan `found` both
/// fields it needs.
pub fn requested_upgrade_found(version: Version, headers: &HeaderMap, found: Present) -> bool {
    found.any(Present::UPGRADE)
        && found.any(Present::CONNECTION)
        && requested_upgrade(version, headers)
}

/// Whether `Upgrade` asks for WebSocket and nothing else: the one upgrade
/// tunnelled. Any other token (`h2c`, `h2c-14`, `HTTP/2.0`, `h2`) would let
/// the caller speak a protocol the header rules never see.
fn only_websocket(headers: &HeaderMap) -> bool {
    let mut tokens = headers
        .get_all(header::UPGRADE)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|t| !t.is_empty())
        .peekable();
    tokens.peek().is_some() && tokens.all(|t| t.eq_ignore_ascii_case(b"websocket"))
}

/// Appends this hop to `Via`, as `1.1 herdguard` (or `2 herdguard`).
pub fn add_via(headers: &mut HeaderMap, version: Version) {
    headers.append(header::VIA, HeaderValue::from_static(via_of(version)));
}

/// This hop's `Via` entry for a message of `version`.
fn via_of(version: Version) -> &'static str {
    match version {
        Version::HTTP_2 => "2 herdguard",
        Version::HTTP_10 => "1.0 herdguard",
        _ => "1.1 herdguard",
    }
}

/// This hop's own fields of a request, kept beside its map rather than put
/// in it: `Via` (after the earlier hops' lines), `X-Forwarded-For` (the
/// earlier hops' list with the caller at its end), `-Proto` and `-Host`.
/// herdguard's own exchange writes them after the map's fields; a request
/// sent by hyper gets them added to its map ([`HopFields::add_to`]), as
/// [`add_via`] and [`add_forwarded`] would have.
#[derive(Debug, Clone)]
pub struct HopFields {
    /// The request's id, made here (`[request_id]`; see [`Present::MAKE_ID`]),
    /// as its text: checked as a header value only if put in a map.
    id: Option<(HeaderName, bytes::Bytes)>,
    via: HeaderValue,
    forwarded_for: HeaderValue,
    proto: HeaderValue,
    host: Option<HeaderValue>,
}

impl HopFields {
    /// This hop's fields for a request of `version` from `caller` (its IP
    /// as a header value) over `proto`, for `host` if any. The caller's own
    /// `X-Forwarded-For` lines are taken out of `headers` (they are joined
    /// into this hop's), and its `-Proto` (and `-Host`, when this hop sets
    /// one): `present` says which of them are there, so that a request with
    /// none is not looked up.
    pub fn new(
        headers: &mut HeaderMap,
        present: Present,
        (version, caller, proto): (Version, &HeaderValue, &'static str),
        host: Option<HeaderValue>,
    ) -> Self {
        let forwarded_for = match present.any(Present::X_FORWARDED_FOR) {
            true => match headers.entry(&X_FORWARDED_FOR) {
                header::Entry::Occupied(prior) => {
                    let (_, earlier) = prior.remove_entry_mult();
                    joined_forwarded_for(earlier, caller)
                }
                header::Entry::Vacant(_) => caller.clone(),
            },
            false => caller.clone(),
        };
        if present.any(Present::X_FORWARDED_PROTO) {
            headers.remove(&X_FORWARDED_PROTO);
        }
        // Only this hop says which host was asked for: with none (an
        // HTTP/1.0 request without `Host`, or an empty one), none is said.
        if present.any(Present::X_FORWARDED_HOST) {
            headers.remove(&X_FORWARDED_HOST);
        }
        let host = host.filter(|h| !h.is_empty());
        Self {
            id: None,
            via: HeaderValue::from_static(via_of(version)),
            forwarded_for,
            proto: HeaderValue::from_static(proto),
            host,
        }
    }

    /// With the request's id `name` made here.
    pub fn with_id(mut self, name: &HeaderName) -> Self {
        self.id = Some((name.clone(), crate::wire::identity::made_text()));
        self
    }

    /// The fields, in the order they are written, as bytes.
    pub fn iter(&self) -> impl Iterator<Item = (&HeaderName, &[u8])> {
        [
            self.id.as_ref().map(|(name, id)| (name, &id[..])),
            Some((&header::VIA, self.via.as_bytes())),
            Some((&X_FORWARDED_FOR, self.forwarded_for.as_bytes())),
            Some((&X_FORWARDED_PROTO, self.proto.as_bytes())),
            self.host
                .as_ref()
                .map(|host| (&X_FORWARDED_HOST, host.as_bytes())),
        ]
        .into_iter()
        .flatten()
    }

    /// How many fields [`HopFields::add_to`] adds.
    pub fn count(&self) -> usize {
        3 + usize::from(self.host.is_some()) + usize::from(self.id.is_some())
    }

    /// Adds them to `headers`, from which [`HopFields::new`] took the
    /// caller's.
    pub fn add_to(self, headers: &mut HeaderMap) {
        if let Some((name, id)) = self.id {
            if let Ok(id) = HeaderValue::from_maybe_shared(id) {
                headers.insert(name, id);
            }
        }
        headers.append(header::VIA, self.via);
        headers.insert(&X_FORWARDED_FOR, self.forwarded_for);
        headers.insert(&X_FORWARDED_PROTO, self.proto);
        if let Some(host) = self.host {
            headers.insert(&X_FORWARDED_HOST, host);
        }
    }
}

/// Earlier hops' `X-Forwarded-For` lines as one list, `caller` at its end.
fn joined_forwarded_for(
    earlier: impl Iterator<Item = HeaderValue>,
    caller: &HeaderValue,
) -> HeaderValue {
    let mut joined = Vec::new();
    for line in earlier {
        // Empty list elements (`a, , b`) are none (RFC 9110 §5.6.1).
        for hop in line.as_bytes().split(|b| *b == b',') {
            let hop = hop.trim_ascii();
            if !hop.is_empty() {
                joined.extend_from_slice(hop);
                joined.extend_from_slice(b", ");
            }
        }
    }
    joined.extend_from_slice(caller.as_bytes());
    HeaderValue::from_bytes(&joined).unwrap_or_else(|_| caller.clone())
}

/// Sets `X-Forwarded-For` (appending the caller), `-Proto` and `-Host`.
/// `caller` is the caller's IP as a header value, made once per connection.
pub fn add_forwarded(
    headers: &mut HeaderMap,
    caller: &HeaderValue,
    proto: &'static str,
    host: Option<HeaderValue>,
) {
    // One lookup for the read and the write. Earlier hops may have sent the
    // list on several lines: it is one list, and the caller goes at its end.
    match headers.entry(&X_FORWARDED_FOR) {
        header::Entry::Vacant(slot) => {
            slot.insert(caller.clone());
        }
        header::Entry::Occupied(mut prior) => {
            let joined = joined_forwarded_for(prior.iter().cloned(), caller);
            prior.insert(joined);
        }
    }
    headers.insert(&X_FORWARDED_PROTO, HeaderValue::from_static(proto));
    match host.filter(|h| !h.is_empty()) {
        Some(host) => headers.insert(&X_FORWARDED_HOST, host),
        None => headers.remove(&X_FORWARDED_HOST),
    };
}

/// The bytes a `Host` value may hold (RFC 3986 `host [ ":" port ]`): letters,
/// digits, `-._~`, sub-delims, `%` escapes, and `:[]` for ports and IPv6
/// literals. No `/`, `?`, `#`, `@`, space or control byte.
const HOST_BYTE: [bool; 256] = {
    let mut ok = [false; 256];
    let allowed = b"-._~%!$&'()*+,;=:[]";
    let mut i = 0;
    while i < allowed.len() {
        ok[allowed[i] as usize] = true;
        i += 1;
    }
    let mut b = 0;
    while b < 256 {
        ok[b] = ok[b] || (b as u8).is_ascii_alphanumeric();
        b += 1;
    }
    ok
};

/// Checks `Host` as RFC 9112 §3.2 asks of a server: an HTTP/1.1 request has
/// exactly one, and it is a valid `host[:port]` (or empty). Two that disagree
/// could route a request one way and reach the upstream another.
///
/// Gives back the one `Host` field, if there is one.
pub fn check_host(
    version: Version,
    headers: &HeaderMap,
) -> Result<Option<&HeaderValue>, &'static str> {
    let mut hosts = headers.get_all(header::HOST).iter();
    match (hosts.next(), hosts.next()) {
        (_, Some(_)) => Err("more than one Host header"),
        (None, None) if version == Version::HTTP_11 => {
            Err("an HTTP/1.1 request needs a Host header")
        }
        (Some(host), None)
            if !host.as_bytes().iter().all(|b| HOST_BYTE[*b as usize])
                || !host_and_port(host.as_bytes()) =>
        {
            Err("the Host header is not a valid host[:port]")
        }
        (host, _) => Ok(host),
    }
}

/// Whether the comma-separated lists of field `field`, over all its lines,
/// hold `token` (ASCII case aside): `Connection: keep-alive, Upgrade`.
pub fn lists(headers: &HeaderMap, field: &HeaderName, token: &str) -> bool {
    headers
        .get_all(field)
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(token.as_bytes()))
}

/// The transfer codings of a message, in order, over all its
/// `Transfer-Encoding` lines (empty list elements are none).
pub fn transfer_codings(headers: &HeaderMap) -> impl Iterator<Item = &[u8]> {
    headers
        .get_all(header::TRANSFER_ENCODING)
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|t| !t.is_empty())
}

/// Checks a request's framing: a `Transfer-Encoding` must be `chunked`,
/// once, and nothing else (RFC 9112 §6.1). `chunked` twice is malformed
/// (400); another coding is one the proxy does not implement (501), and
/// forwarding its bytes without it would hand the upstream a body it
/// cannot read.
pub fn check_framing(headers: &HeaderMap) -> Result<(), (http::StatusCode, &'static str)> {
    let mut codings = transfer_codings(headers);
    let Some(first) = codings.next() else {
        return Ok(());
    };
    let chunked = |t: &[u8]| t.eq_ignore_ascii_case(b"chunked");
    match codings.next() {
        None if chunked(first) => Ok(()),
        None => Err((
            http::StatusCode::NOT_IMPLEMENTED,
            "transfer codings other than chunked are not supported",
        )),
        Some(_) if chunked(first) => Err((
            http::StatusCode::BAD_REQUEST,
            "chunked must be the only and last transfer coding, applied once",
        )),
        Some(_) => Err((
            http::StatusCode::NOT_IMPLEMENTED,
            "transfer codings other than chunked are not supported",
        )),
    }
}

/// Refuses what an upstream could read differently from the proxy: a field
/// named like a framing field with `_` for `-` (`transfer_encoding`: CGI,
/// WSGI and PHP stacks fold the two into one), a `Content-Length` not in
/// its plain decimal form (`000035`, `+35`), and an authority carrying
/// userinfo (`:authority: a@b`, as `Host: a@b` is).
///
/// `present` is [`Present::of`] the same fields: a field it did not find
/// is not looked up.
pub fn check_look_alikes(
    uri: &http::Uri,
    headers: &HeaderMap,
    present: Present,
) -> Result<(), &'static str> {
    if uri.authority().is_some_and(|a| a.as_str().contains('@')) {
        return Err("the request's authority carries userinfo (user@host)");
    }
    if present.any(Present::LOOK_ALIKE) {
        return Err("a field named like a framing field, with '_' for '-'");
    }
    if !present.any(Present::CONTENT_LENGTH) {
        return Ok(());
    }
    let plain = |v: &HeaderValue| {
        let b = v.as_bytes();
        !b.is_empty() && b.iter().all(u8::is_ascii_digit) && (b == b"0" || b[0] != b'0')
    };
    if !headers.get_all(header::CONTENT_LENGTH).iter().all(plain) {
        return Err("Content-Length is not a plain decimal number");
    }
    Ok(())
}

/// `Max-Forwards` of an `OPTIONS` or `TRACE` request (RFC 9110 §7.6.2);
/// other methods ignore it.
pub fn max_forwards(method: &http::Method, headers: &HeaderMap) -> Option<u64> {
    if method != http::Method::OPTIONS && method != http::Method::TRACE {
        return None;
    }
    // One value is allowed; of several (fields or a list), the fewest hops
    // count. Digits only; too many to count is as many as there can be.
    headers
        .get_all(header::MAX_FORWARDS)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|v| !v.is_empty() && v.iter().all(u8::is_ascii_digit))
        .map(|v| {
            v.iter()
                .try_fold(0u64, |n, d| {
                    n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
                })
                .unwrap_or(u64::MAX)
        })
        .min()
}

/// Takes one from `Max-Forwards` of an `OPTIONS` or `TRACE` on its way on.
pub fn decrement_max_forwards(method: &http::Method, headers: &mut HeaderMap) {
    if let Some(n @ 1..) = max_forwards(method, headers) {
        headers.insert(header::MAX_FORWARDS, HeaderValue::from(n - 1));
    }
}

/// `host[:port]`: one `[IPv6]` literal or a host without `:`, then at most
/// one `:` and a port of up to five digits no larger than 65535.
fn host_and_port(value: &[u8]) -> bool {
    let (host, rest) = match value.strip_prefix(b"[") {
        Some(literal) => match literal.iter().position(|b| *b == b']') {
            Some(end) => (&literal[..end], &literal[end + 1..]),
            None => return false,
        },
        None => match value.iter().position(|b| *b == b':') {
            Some(colon) => (&value[..colon], &value[colon..]),
            None => (value, &b""[..]),
        },
    };
    if host.iter().any(|b| matches!(b, b'[' | b']')) {
        return false;
    }
    match rest.strip_prefix(b":") {
        None => rest.is_empty(),
        Some(port) => {
            port.len() <= 5
                && port.iter().all(u8::is_ascii_digit)
                && (port.is_empty()
                    || std::str::from_utf8(port)
                        .ok()
                        .and_then(|p| p.parse::<u32>().ok())
                        .is_some_and(|n| n <= 65535))
        }
    }
}

/// The caller's IP as a header value, for `X-Forwarded-For`.
///
/// Shared from the start: a value made from a `Vec` is made shared on its
/// first clone, by an allocation made then, at the connection's first
/// request, in the middle of other connections' requests, and kept for the
/// connection's life: each kept a page of theirs resident once they were
/// freed.
pub fn ip_value(ip: IpAddr) -> HeaderValue {
    // An address's text is digits, dots, colons and hex letters: always a
    // valid value; were it not, `unknown` (RFC 7239's word) stands in.
    let text = bytes::Bytes::from_owner(ip.to_string().into_bytes());
    HeaderValue::from_maybe_shared(text).unwrap_or_else(|_| HeaderValue::from_static("unknown"))
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// The one pass finds a field exactly when a look-up would: over
        /// maps of the fields it looks for, look-alikes (`x-herdguard-`
        /// names it does not know, names that only begin alike) and others,
        /// each on one line or several.
        #[test]
        fn present_finds_what_a_look_up_finds(
            picks in proptest::collection::vec((0usize..20, 1usize..3), 0..12)
        ) {
            let names = [
                "connection", "upgrade", "transfer-encoding", "te", "trailer",
                "content-type", "x-herdguard-explain", "x-herdguard-attempt",
                "x-herdguard-error", "x-herdguard-fault", "x-herdguard-attempts",
                "x-herdguard-", "x-herdguard-errors", "host", "tea",
                "x-request-id", "content-length", "keep-alive", "proxy-connection",
                "http2-settings",
            ];
            let mut h = HeaderMap::new();
            for (i, lines) in picks {
                for _ in 0..lines {
                    h.append(HeaderName::from_static(names[i]), HeaderValue::from_static("v"));
                }
            }
            let present = Present::of(&h);
            for (name, bit) in [
                (header::CONNECTION, Present::CONNECTION),
                (header::UPGRADE, Present::UPGRADE),
                (header::TRANSFER_ENCODING, Present::TRANSFER_ENCODING),
                (header::TE, Present::TE),
                (header::TRAILER, Present::TRAILER),
                (header::CONTENT_TYPE, Present::CONTENT_TYPE),
                (X_HERDGUARD_EXPLAIN.clone(), Present::EXPLAIN),
                (X_HERDGUARD_ATTEMPT.clone(), Present::ATTEMPT),
                (X_HERDGUARD_ERROR.clone(), Present::ERROR),
                (X_HERDGUARD_FAULT.clone(), Present::FAULT),
                (HOP_BY_HOP[1].clone(), Present::KEEP_ALIVE),
                (HOP_BY_HOP[2].clone(), Present::PROXY_CONNECTION),
                (HOP_BY_HOP[6].clone(), Present::HTTP2_SETTINGS),
            ] {
                proptest::prop_assert_eq!(present.any(bit), h.contains_key(&name), "{}", name);
            }
        }
    }

    #[test]
    fn a_map_given_back_comes_out_empty_with_its_room_and_an_oversized_one_is_not_kept() {
        // Each test runs on a thread of its own: the spare is this one's.
        assert_eq!(spare_map(0).capacity(), 0, "nothing given back yet");
        let mut map = HeaderMap::with_capacity(11);
        map.append("a", HeaderValue::from_static("1"));
        map.append("a", HeaderValue::from_static("2"));
        map.append("b", HeaderValue::from_static("3"));
        let room = map.capacity();
        give_back(map);
        let again = spare_map(4);
        assert!(again.is_empty() && again.get("a").is_none());
        assert_eq!(again.capacity(), room);
        assert_eq!(spare_map(0).capacity(), 0, "taken once");

        give_back(HeaderMap::with_capacity(SPARE_FIELDS + 1));
        assert_eq!(spare_map(0).capacity(), 0, "too large to keep");
        // One name said a thousand times: few slots, many values.
        let mut repeated = HeaderMap::with_capacity(4);
        for _ in 0..1000 {
            repeated.append("a", HeaderValue::from_static("1"));
        }
        assert!(repeated.capacity() <= SPARE_FIELDS);
        give_back(repeated);
        assert_eq!(spare_map(0).capacity(), 0, "its values' room is not kept");
    }

    #[test]
    fn host_is_checked_as_rfc_9112_asks() {
        let cases: [(Version, &[&str], Result<(), &str>); 9] = [
            (Version::HTTP_11, &["api.example.com"], Ok(())),
            (Version::HTTP_11, &["127.0.0.1:8080"], Ok(())),
            (Version::HTTP_11, &["[::1]:8080"], Ok(())),
            (Version::HTTP_11, &[""], Ok(())),
            (Version::HTTP_10, &[], Ok(())),
            (
                Version::HTTP_11,
                &[],
                Err("an HTTP/1.1 request needs a Host header"),
            ),
            (
                Version::HTTP_11,
                &["a", "b"],
                Err("more than one Host header"),
            ),
            (
                Version::HTTP_11,
                &["a b/c"],
                Err("the Host header is not a valid host[:port]"),
            ),
            (
                Version::HTTP_11,
                &["user@a.example"],
                Err("the Host header is not a valid host[:port]"),
            ),
        ];
        for (version, hosts, want) in cases {
            let mut h = HeaderMap::new();
            for host in hosts {
                h.append(header::HOST, HeaderValue::from_str(host).unwrap());
            }
            assert_eq!(
                check_host(version, &h).map(|host| host.map(|v| v.to_str().unwrap())),
                want.map(|()| hosts.first().copied()),
                "{version:?} {hosts:?}"
            );
        }
        let port_games = [
            "x:80:80", "x:-1", "[::1", "x:+80", "x:0x50", "x:65536", "x:123456", "a]:1", "[::1]x",
        ];
        for host in port_games {
            let mut h = HeaderMap::new();
            h.insert(header::HOST, HeaderValue::from_str(host).unwrap());
            assert!(check_host(Version::HTTP_11, &h).is_err(), "{host}");
        }
        for host in [
            "x:",
            "x:65535",
            "[::1]",
            "[fe80::1%25eth0]:8",
            "xn--bcher-kva.example:1",
        ] {
            let mut h = HeaderMap::new();
            h.insert(header::HOST, HeaderValue::from_str(host).unwrap());
            assert!(check_host(Version::HTTP_11, &h).is_ok(), "{host}");
        }
    }

    #[test]
    fn this_hops_fields_join_the_callers_list_and_replace_what_it_says_of_itself() {
        let caller = HeaderValue::from_static("10.0.0.9");
        let hop_of = |pairs: &[(&str, &str)], host: Option<&'static str>| {
            let mut h = map(pairs);
            let present = Present::of(&h);
            let host = host.map(HeaderValue::from_static);
            let hop = HopFields::new(&mut h, present, (Version::HTTP_11, &caller, "http"), host);
            let written: Vec<String> = hop
                .iter()
                .map(|(n, v)| format!("{n}: {}", std::str::from_utf8(v).unwrap()))
                .collect();
            (h, written)
        };
        // Empty list elements, within a line or a line of their own, are none.
        let (h, written) = hop_of(
            &[
                ("x-forwarded-for", "1.1.1.1"),
                ("x-forwarded-for", ""),
                ("x-forwarded-for", " 2.2.2.2, ,3.3.3.3 "),
                ("x-forwarded-for", " ,  "),
                ("x-forwarded-proto", "ftp"),
                ("x-forwarded-host", "evil"),
                ("x-keep", "1"),
            ],
            Some("app"),
        );
        assert_eq!(h, map(&[("x-keep", "1")]));
        assert_eq!(
            written,
            [
                "via: 1.1 herdguard",
                "x-forwarded-for: 1.1.1.1, 2.2.2.2, 3.3.3.3, 10.0.0.9",
                "x-forwarded-proto: http",
                "x-forwarded-host: app"
            ]
        );
        // No host of its own (or an empty one): the caller's claim goes too.
        for host in [None, Some("")] {
            let (h, written) = hop_of(&[("x-forwarded-host", "evil")], host);
            assert!(h.is_empty(), "{host:?}");
            assert!(
                !written.iter().any(|w| w.starts_with("x-forwarded-host")),
                "{written:?}"
            );
        }
    }

    #[test]
    fn an_answers_te_is_never_passed_back() {
        let mut h = map(&[("te", "trailers"), ("x-keep", "1")]);
        let found = Present::of(&h);
        strip_answer_hop_by_hop_found(&mut h, false, found);
        assert_eq!(h, map(&[("x-keep", "1")]));
        // A request's is kept as `trailers`.
        let mut h = map(&[("te", "trailers, gzip")]);
        strip_hop_by_hop(&mut h, false);
        assert_eq!(h, map(&[("te", "trailers")]));
    }

    fn map(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    #[test]
    fn strips_hop_by_hop_and_connection_named_fields() {
        let mut h = map(&[
            ("connection", "keep-alive, x-secret"),
            ("keep-alive", "timeout=5"),
            ("x-secret", "1"),
            ("proxy-connection", "keep-alive"),
            ("transfer-encoding", "chunked"),
            ("upgrade", "websocket"),
            ("trailer", "x-sum"),
            ("te", "gzip"),
            ("x-keep", "yes"),
        ]);
        strip_hop_by_hop(&mut h, false);
        assert_eq!(h, map(&[("trailer", "x-sum"), ("x-keep", "yes")]));
    }

    #[test]
    fn common_messages_lose_only_their_hop_by_hop_fields() {
        type Fields<'a> = &'a [(&'a str, &'a str)];
        let cases: [(&str, Fields, Fields); 5] = [
            (
                "no hop-by-hop field",
                &[("host", "a"), ("accept", "*/*"), ("x-request-id", "7")],
                &[("host", "a"), ("accept", "*/*"), ("x-request-id", "7")],
            ),
            (
                "a lone keep-alive",
                &[
                    ("content-length", "2"),
                    ("connection", "keep-alive"),
                    ("date", "x"),
                ],
                &[("content-length", "2"), ("date", "x")],
            ),
            (
                "a lone close, any case and spacing",
                &[("connection", " Close "), ("x-a", "1")],
                &[("x-a", "1")],
            ),
            (
                "options on two lines: the fields both name go",
                &[
                    ("connection", "keep-alive"),
                    ("connection", "x-a"),
                    ("x-a", "1"),
                    ("x-b", "2"),
                ],
                &[("x-b", "2")],
            ),
            (
                "alone, but naming another field: that field goes too",
                &[("connection", "x-a"), ("x-a", "1"), ("x-b", "2")],
                &[("x-b", "2")],
            ),
        ];
        for (what, before, after) in cases {
            let mut h = map(before);
            strip_hop_by_hop(&mut h, false);
            assert_eq!(h, map(after), "{what}");
        }
    }

    #[test]
    fn max_forwards_reads_the_fewest_hops_and_never_overflows() {
        let trace = http::Method::TRACE;
        let mut h = map(&[("max-forwards", "5"), ("max-forwards", "0")]);
        assert_eq!(max_forwards(&trace, &h), Some(0), "two fields: the fewer");
        h = map(&[("max-forwards", "3, 7")]);
        assert_eq!(max_forwards(&trace, &h), Some(3));
        h = map(&[("max-forwards", "99999999999999999999999")]);
        assert_eq!(max_forwards(&trace, &h), Some(u64::MAX));
        decrement_max_forwards(&trace, &mut h);
        assert_eq!(h["max-forwards"], (u64::MAX - 1).to_string().as_str());
        for bad in ["-1", "x", "", "+3", "1.5"] {
            h = map(&[("max-forwards", bad)]);
            assert_eq!(max_forwards(&trace, &h), None, "{bad:?}");
        }
        h = map(&[("max-forwards", "5"), ("max-forwards", "2")]);
        decrement_max_forwards(&trace, &mut h);
        assert_eq!(h.get_all("max-forwards").iter().count(), 1);
        assert_eq!(h["max-forwards"], "1");
    }

    #[test]
    fn keeps_te_trailers_and_upgrade_pair() {
        let mut h = map(&[("te", "trailers, deflate")]);
        strip_hop_by_hop(&mut h, false);
        assert_eq!(h, map(&[("te", "trailers")]));

        let mut h = map(&[
            ("connection", "Upgrade, x-a"),
            ("upgrade", "websocket"),
            ("x-a", "1"),
        ]);
        assert!(requested_upgrade(Version::HTTP_11, &h));
        assert!(!requested_upgrade(Version::HTTP_2, &h));
        strip_hop_by_hop(&mut h, true);
        assert_eq!(
            h,
            map(&[("upgrade", "websocket"), ("connection", "upgrade")])
        );
    }

    #[test]
    fn an_ip_value_is_the_address_text_for_every_kind_of_address() {
        for text in [
            "127.0.0.1",
            "0.0.0.0",
            "255.255.255.255",
            "::1",
            "::",
            "fe80::1",
            "::ffff:10.1.2.3",
            "2001:db8:ffff:ffff:ffff:ffff:ffff:ffff",
        ] {
            let ip: IpAddr = text.parse().unwrap();
            let value = ip_value(ip);
            assert_eq!(value.to_str().unwrap(), ip.to_string(), "{text}");
            assert_eq!(value.clone(), value, "{text}: a clone says the same");
        }
    }

    #[test]
    fn forwarded_headers_append_the_caller() {
        let mut h = map(&[
            ("x-forwarded-for", "10.0.0.1"),
            ("x-forwarded-proto", "https"),
        ]);
        let caller = ip_value("127.0.0.2".parse().unwrap());
        add_forwarded(
            &mut h,
            &caller,
            "http",
            Some(HeaderValue::from_static("api.local")),
        );
        assert_eq!(h["x-forwarded-for"], "10.0.0.1, 127.0.0.2");
        assert_eq!(h["x-forwarded-proto"], "http");
        assert_eq!(h["x-forwarded-host"], "api.local");
        add_via(&mut h, Version::HTTP_11);
        add_via(&mut h, Version::HTTP_2);
        let via: Vec<_> = h.get_all("via").iter().collect();
        assert_eq!(via, ["1.1 herdguard", "2 herdguard"]);

        // A list sent on several lines is one list; an empty one is no list.
        let mut h = map(&[
            ("x-forwarded-for", "10.0.0.1"),
            ("x-forwarded-for", " 10.0.0.2 "),
        ]);
        add_forwarded(&mut h, &caller, "http", None);
        let xff: Vec<_> = h.get_all("x-forwarded-for").iter().collect();
        assert_eq!(xff, ["10.0.0.1, 10.0.0.2, 127.0.0.2"]);
        let mut h = map(&[("x-forwarded-for", " ")]);
        add_forwarded(&mut h, &caller, "http", None);
        assert_eq!(h["x-forwarded-for"], "127.0.0.2");
    }
}

// === gRPC ===

/// Whether a request is a gRPC call: `content-type: application/grpc`, or
/// `application/grpc+proto` and the like.
pub fn is_grpc(headers: &HeaderMap) -> bool {
    const GRPC: &[u8] = b"application/grpc";
    // A media type is case-insensitive (RFC 9110 §8.3.1).
    headers
        .get(http::header::CONTENT_TYPE)
        .map(HeaderValue::as_bytes)
        .is_some_and(|v| {
            v.get(..GRPC.len())
                .is_some_and(|head| head.eq_ignore_ascii_case(GRPC))
                && matches!(v.get(GRPC.len()), None | Some(b'+' | b';'))
        })
}

/// A `grpc-timeout` value: up to 8 digits and a unit (`H`, `M`, `S`, `m`,
/// `u`, `n`). Anything else is no timeout, as gRPC servers read it.
pub fn parse_grpc_timeout(value: &HeaderValue) -> Option<std::time::Duration> {
    use std::time::Duration;
    let (digits, unit) = value.as_bytes().split_at(value.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let n = digits
        .iter()
        .fold(0u64, |n, d| n * 10 + u64::from(d - b'0'));
    Some(match unit {
        b"H" => Duration::from_secs(n * 3600),
        b"M" => Duration::from_secs(n * 60),
        b"S" => Duration::from_secs(n),
        b"m" => Duration::from_millis(n),
        b"u" => Duration::from_micros(n),
        b"n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// `left` as a `grpc-timeout` value: milliseconds (rounded up, at least
/// one), or seconds when that many milliseconds need more than 8 digits.
pub fn grpc_timeout_value(left: std::time::Duration) -> HeaderValue {
    let ms = left.as_nanos().div_ceil(1_000_000).max(1);
    let text = if ms <= 99_999_999 {
        format!("{ms}m")
    } else {
        format!("{}S", left.as_secs().min(99_999_999))
    };
    HeaderValue::from_str(&text).unwrap_or(HeaderValue::from_static("99999999S"))
}

/// `grpc-retry-pushback-ms`, as the delay it asks for: `None` when absent;
/// a negative or malformed value means "do not retry" (gRPC's retry
/// design, A6), given as [`DO_NOT_RETRY`](crate::policy::retry::DO_NOT_RETRY).
pub fn grpc_pushback(headers: &HeaderMap) -> Option<std::time::Duration> {
    let value = headers.get("grpc-retry-pushback-ms")?.as_bytes();
    let valid = !value.is_empty() && value.len() <= 10 && value.iter().all(u8::is_ascii_digit);
    Some(match valid {
        true => std::time::Duration::from_millis(
            value.iter().fold(0u64, |n, d| n * 10 + u64::from(d - b'0')),
        ),
        false => crate::policy::retry::DO_NOT_RETRY,
    })
}

#[cfg(test)]
mod grpc_tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn grpc_requests_and_timeouts() {
        let mut h = HeaderMap::new();
        for (ct, grpc) in [
            ("application/grpc", true),
            ("application/grpc+proto", true),
            ("application/grpc;charset=utf-8", true),
            ("Application/GRPC+proto", true),
            ("application/grpc-web", false),
            ("application/grp", false),
            ("application/json", false),
        ] {
            h.insert(http::header::CONTENT_TYPE, HeaderValue::from_static(ct));
            assert_eq!(is_grpc(&h), grpc, "{ct}");
        }
        let t = |s: &str| parse_grpc_timeout(&HeaderValue::from_str(s).unwrap());
        assert_eq!(t("100m"), Some(Duration::from_millis(100)));
        assert_eq!(t("2S"), Some(Duration::from_secs(2)));
        assert_eq!(t("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(t("99999999n"), Some(Duration::from_nanos(99_999_999)));
        for bad in ["", "m", "100", "123456789m", "-1m", "1x", "1.5S", "1 m"] {
            assert_eq!(t(bad), None, "{bad:?}");
        }
        assert_eq!(grpc_timeout_value(Duration::from_micros(1)), "1m");
        assert_eq!(grpc_timeout_value(Duration::from_millis(250)), "250m");
        assert_eq!(grpc_timeout_value(Duration::from_secs(200_000)), "200000S");
        assert_eq!(grpc_timeout_value(Duration::MAX), "99999999S");
        let mut h = HeaderMap::new();
        assert_eq!(grpc_pushback(&h), None);
        h.insert("grpc-retry-pushback-ms", HeaderValue::from_static("250"));
        assert_eq!(grpc_pushback(&h), Some(Duration::from_millis(250)));
        for bad in ["-1", "soon", "", "99999999999"] {
            h.insert(
                "grpc-retry-pushback-ms",
                HeaderValue::from_str(bad).unwrap(),
            );
            assert_eq!(grpc_pushback(&h), Some(Duration::MAX), "{bad:?}");
        }
    }

    #[test]
    fn framing_look_alikes_are_refused_and_other_underscored_names_are_not() {
        let uri: http::Uri = "/".parse().unwrap();
        for (name, refused) in [
            ("transfer_encoding", true),
            ("Content_Length", true),
            ("content_length", true),
            ("transfer-encoding_", false),
            ("x_transfer_encoding", false),
            ("content_lengths", false),
            ("my_field", false),
            ("content-length", false),
        ] {
            let mut h = HeaderMap::new();
            h.insert(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_static("5"),
            );
            assert_eq!(
                check_look_alikes(&uri, &h, Present::of(&h)).is_err(),
                refused,
                "{name}"
            );
        }
    }
}
