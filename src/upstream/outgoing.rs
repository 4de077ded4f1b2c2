//! A request as one attempt sends it. The caller's fields, as this hop
//! forwards them, are kept once for all of a request's attempts and shared;
//! an attempt adds only what is its own (`Host` for its endpoint, its
//! number, the time left, its trace context). herdguard's own exchange
//! writes both from where they are; hyper's client gets them merged into
//! one map.

use std::sync::Arc;

use http::{HeaderMap, HeaderValue, Method, Request, Version};

use super::body::RequestBody;
use crate::wire::headers::X_HERDGUARD_ATTEMPT;

/// The request of one attempt.
pub struct Outgoing {
    pub method: Method,
    pub fields: Fields,
    pub body: RequestBody,
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
    /// The request's fields, the same for every attempt, without the ones
    /// an attempt sets.
    pub kept: Arc<HeaderMap>,
}

impl Fields {
    /// Whether `name` is among the fields (of the attempt or the kept).
    pub fn contains(&self, name: http::header::HeaderName) -> bool {
        self.extra.contains_key(&name) || self.kept.contains_key(name)
    }

    /// Every field, the attempt's first, as written on the wire.
    pub fn iter(&self) -> impl Iterator<Item = (&http::header::HeaderName, &HeaderValue)> {
        let own = [
            Some((&http::header::HOST, &self.host)),
            self.attempt.as_ref().map(|v| (&X_HERDGUARD_ATTEMPT, v)),
        ];
        own.into_iter()
            .flatten()
            .chain(self.extra.iter())
            .chain(self.kept.iter())
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
        let mut map = Arc::try_unwrap(kept).unwrap_or_else(|kept| (*kept).clone());
        map.reserve(2 + extra.len());
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

    fn fields(kept: HeaderMap) -> Fields {
        let mut extra = HeaderMap::new();
        extra.insert("grpc-timeout", HeaderValue::from_static("5m"));
        Fields {
            host: HeaderValue::from_static("up:80"),
            attempt: Some(HeaderValue::from_static("2")),
            extra,
            kept: Arc::new(kept),
        }
    }

    #[test]
    fn the_attempts_fields_come_first_and_the_kept_after_in_their_order() {
        let mut kept = HeaderMap::new();
        kept.append("b", HeaderValue::from_static("1"));
        kept.append("a", HeaderValue::from_static("2"));
        kept.append("b", HeaderValue::from_static("3"));
        let f = fields(kept);
        let seen: Vec<_> = f
            .iter()
            .map(|(n, v)| format!("{n}={}", v.to_str().unwrap()))
            .collect();
        assert_eq!(
            seen,
            [
                "host=up:80",
                "x-herdguard-attempt=2",
                "grpc-timeout=5m",
                "b=1",
                "b=3",
                "a=2"
            ]
        );
        assert!(f.contains(http::header::HeaderName::from_static("a")));
        assert!(f.contains(http::header::HeaderName::from_static("grpc-timeout")));
        assert!(!f.contains(http::header::UPGRADE));
    }

    #[test]
    fn merged_the_kept_map_is_copied_only_while_shared() {
        let mut kept = HeaderMap::new();
        kept.append("b", HeaderValue::from_static("1"));
        kept.append("b", HeaderValue::from_static("3"));
        let f = fields(kept);
        let other = f.kept.clone();
        let map = f.into_map();
        assert_eq!(map.get_all("b").iter().count(), 2);
        assert_eq!(map["host"], "up:80");
        assert_eq!(map[&X_HERDGUARD_ATTEMPT], "2");
        assert_eq!(map["grpc-timeout"], "5m");
        // The other attempt's copy is untouched.
        assert_eq!(other.len(), 2);
        assert!(!other.contains_key("host"));
    }
}
