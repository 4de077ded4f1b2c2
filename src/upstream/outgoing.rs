//! A request as one attempt sends it. The caller's fields, as this hop
//! forwards them, are kept once for all of a request's attempts and shared,
//! with this hop's own (`Via`, `X-Forwarded-*`) beside them; an attempt adds
//! only what is its own (`Host` for its endpoint, its number, the time
//! left, its trace context). herdguard's own exchange writes them all from
//! where they are, and the caller's map is never added to (a map hyper made
//! has no room to spare: one field more rebuilds it); hyper's client gets
//! them merged into one map.

use std::sync::Arc;

use http::{HeaderMap, HeaderValue, Method, Request, Version};

use super::body::RequestBody;
use crate::wire::headers::{HopFields, X_HERDGUARD_ATTEMPT};

/// The request of one attempt.
pub struct Outgoing {
    pub method: Method,
    pub fields: Fields,
    pub body: RequestBody,
    /// The caller asked to upgrade, and its `Upgrade` field is among the
    /// fields (the hop-by-hop rules drop it otherwise).
    pub upgrade: bool,
}

/// An attempt's header fields: its own, then the request's kept ones.
pub struct Fields {
    /// `Host`, as this attempt's endpoint (or the route's rewrite) has it.
    pub host: HeaderValue,
    /// `X-Herdguard-Attempt`, unless an outer hop numbers the attempts.
    pub attempt: Option<HeaderValue>,
    /// Any other field of this attempt alone (`grpc-timeout`, trace
    /// context): empty, and unallocated, for most requests.
    pub extra: HeaderMap,
    /// The request's fields, the same for every attempt.
    pub kept: Arc<Kept>,
}

/// A request's fields, the same for every attempt: the caller's, without
/// the ones an attempt sets (but `Host`, which every attempt sets and which
/// is passed over where the fields are read), and this hop's.
#[derive(Default)]
pub struct Kept {
    pub map: HeaderMap,
    pub hop: Option<HopFields>,
}

/// The request's map, once its last attempt is done with it, is given
/// back for an answer's head to be parsed into.
impl Drop for Kept {
    fn drop(&mut self) {
        crate::wire::headers::give_back(std::mem::take(&mut self.map));
    }
}

impl Fields {
    /// Every field, the attempt's first, as written on the wire.
    pub fn iter(&self) -> impl Iterator<Item = (&http::header::HeaderName, &[u8])> {
        let own = [
            Some((&http::header::HOST, &self.host)),
            self.attempt.as_ref().map(|v| (&X_HERDGUARD_ATTEMPT, v)),
        ];
        own.into_iter()
            .flatten()
            .chain(self.extra.iter())
            .chain(
                self.kept
                    .map
                    .iter()
                    .filter(|(name, _)| **name != http::header::HOST),
            )
            .map(|(name, value)| (name, value.as_bytes()))
            .chain(self.kept.hop.iter().flat_map(HopFields::iter))
    }

    /// One map of them all. The kept map is taken as it is when no other
    /// attempt shares it, copied when one may.
    pub fn into_map(self) -> HeaderMap {
        let Fields {
            host,
            attempt,
            extra,
            kept,
        } = self;
        let more = 2 + extra.len() + kept.hop.as_ref().map_or(0, HopFields::count);
        let (mut map, hop) = match Arc::try_unwrap(kept) {
            Ok(mut kept) => (std::mem::take(&mut kept.map), kept.hop.take()),
            Err(kept) => (copied(&kept.map, more), kept.hop.clone()),
        };
        map.reserve(more);
        if let Some(hop) = hop {
            hop.add_to(&mut map);
        }
        map.insert(http::header::HOST, host);
        if let Some(attempt) = attempt {
            map.insert(&X_HERDGUARD_ATTEMPT, attempt);
        }
        // Each name once in `extra`: an attempt sets, never appends.
        for (name, value) in extra {
            if let Some(name) = name {
                map.insert(name, value);
            }
        }
        map
    }
}

/// `map`'s fields in a new map with room for `more`. A clone would keep no
/// room: its entries, copied to their length, would be reallocated twice
/// as the attempt's fields went in (1,400 instructions a request).
fn copied(map: &HeaderMap, more: usize) -> HeaderMap {
    let mut copy = HeaderMap::with_capacity(map.len() + more);
    for (name, value) in map {
        copy.append(name, value.clone());
    }
    copy
}

impl Outgoing {
    /// The request as hyper's client takes it (its target set by the caller).
    pub fn into_request(self) -> Request<RequestBody> {
        let mut req = Request::new(self.body);
        *req.method_mut() = self.method;
        *req.version_mut() = Version::HTTP_11;
        *req.headers_mut() = self.fields.into_map();
        req
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(mut map: HeaderMap) -> Fields {
        let mut extra = HeaderMap::new();
        extra.insert("grpc-timeout", HeaderValue::from_static("5m"));
        let present = crate::wire::headers::Present::of(&map);
        let caller = HeaderValue::from_static("10.0.0.1");
        let hop = HopFields::new(&mut map, present, (Version::HTTP_11, &caller, "http"), None);
        Fields {
            host: HeaderValue::from_static("up:80"),
            attempt: Some(HeaderValue::from_static("2")),
            extra,
            kept: Arc::new(Kept {
                map,
                hop: Some(hop),
            }),
        }
    }

    #[test]
    fn the_attempts_fields_come_first_and_the_kept_after_in_their_order() {
        let mut kept = HeaderMap::new();
        kept.append("b", HeaderValue::from_static("1"));
        // The caller's, which each attempt's own replaces.
        kept.append("host", HeaderValue::from_static("caller.example"));
        kept.append("via", HeaderValue::from_static("1.1 outer"));
        kept.append("x-forwarded-for", HeaderValue::from_static("10.9.9.9"));
        kept.append("a", HeaderValue::from_static("2"));
        kept.append("b", HeaderValue::from_static("3"));
        kept.append("x-forwarded-proto", HeaderValue::from_static("https"));
        let f = fields(kept);
        let seen: Vec<_> = f
            .iter()
            .map(|(n, v)| format!("{n}={}", std::str::from_utf8(v).unwrap()))
            .collect();
        assert_eq!(
            seen,
            [
                "host=up:80",
                "x-herdguard-attempt=2",
                "grpc-timeout=5m",
                "b=1",
                "b=3",
                "via=1.1 outer",
                "a=2",
                "via=1.1 herdguard",
                "x-forwarded-for=10.9.9.9, 10.0.0.1",
                "x-forwarded-proto=http",
            ]
        );
    }

    #[test]
    fn merged_the_kept_map_is_copied_only_while_shared() {
        let mut kept = HeaderMap::new();
        kept.append("b", HeaderValue::from_static("1"));
        kept.append("b", HeaderValue::from_static("3"));
        kept.append("host", HeaderValue::from_static("caller.example"));
        let f = fields(kept);
        let other = f.kept.clone();
        let map = f.into_map();
        assert_eq!(map.get_all("b").iter().collect::<Vec<_>>(), ["1", "3"]);
        assert_eq!(map.get_all("host").iter().collect::<Vec<_>>(), ["up:80"]);
        assert_eq!(map[&X_HERDGUARD_ATTEMPT], "2");
        assert_eq!(map["grpc-timeout"], "5m");
        assert_eq!(map["via"], "1.1 herdguard");
        assert_eq!(map["x-forwarded-for"], "10.0.0.1");
        // The other attempt's copy is untouched.
        assert_eq!(other.map.len(), 3);
        assert_eq!(other.map["host"], "caller.example");
        assert!(!other.map.contains_key("via"));
    }
}
