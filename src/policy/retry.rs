//! The retry policy of a route, compiled from its `[retry]` table: what
//! `retry_on` names, which requests are safe to repeat, and how long a
//! server may ask us to wait. Nothing here sleeps, sends or reads a clock;
//! [`super::decide()`] puts it together with the other gates.

use std::time::{Duration, SystemTime};

use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode};

use crate::policy::settings::{RetryConfig, RetryOn};

use super::backoff::{Backoff, InvalidBackoff};
use super::outcome::{GrpcStatus, Outcome, SkipReason, UpstreamFault};
use super::paths::PathKey;

/// What the policy needs to know about the request, computed once, from
/// the headers as they go upstream (after hop-by-hop fields are dropped).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestFacts {
    /// The method is in `methods`, or the request carries a non-empty idempotency header.
    pub idempotent: bool,
    /// The request came through an outer herdguard that retries for it.
    pub inner_hop: bool,
    /// Its path, for the path's own breaker (`NONE`: the route's alone).
    pub path: PathKey,
}

/// A compiled `[retry]` table. A `Policy` that exists is valid.
#[derive(Debug, Clone)]
pub struct Policy {
    pub attempts: u32,
    pub per_try_timeout: Duration,
    pub timeout: Duration,
    pub max_replay_body: u64,
    /// `hedge_after`: when a second attempt races a slow first one.
    pub hedge_after: Option<Duration>,
    conditions: Conditions,
    methods: Vec<Method>,
    /// `idempotent`: every request on the route is safe to repeat.
    all_idempotent: bool,
    idempotency_header: HeaderName,
    respect_retry_after: bool,
    max_retry_after: Duration,
    pub backoff: Backoff,
}

#[derive(Debug, Clone, Default)]
struct Conditions {
    connect_failure: bool,
    refused_stream: bool,
    reset: bool,
    timeout: bool,
    any_5xx: bool,
    codes: Vec<StatusCode>,
    grpc: Vec<GrpcStatus>,
}

/// Why a `[retry]` table could not be compiled; [`key`](InvalidPolicy::key)
/// names the key at fault.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InvalidPolicy {
    #[error("{0} is out of range 1..=100 (1 turns retries off)")]
    Attempts(u32),
    #[error("must be longer than zero")]
    ZeroDuration(&'static str),
    #[error("{code} is not an HTTP status")]
    Status { index: usize, code: u16 },
    #[error(transparent)]
    Backoff(#[from] InvalidBackoff),
    #[error("{0} bytes is more than {MAX_REPLAY_BODY} (64MiB): a body this size is held in memory per request, for every request at once")]
    ReplayBody(u64),
}

/// The most `max_replay_body` may be: bodies up to it are held whole, once
/// per request in flight, so a larger limit hands any caller the memory.
pub const MAX_REPLAY_BODY: u64 = 64 * 1024 * 1024;

impl InvalidPolicy {
    /// The key of the `[retry]` table at fault, and the position in its list
    /// when it is one. For `backoff`, the key inside it is the inner error's.
    pub fn key(&self) -> (&'static str, Option<usize>) {
        match self {
            InvalidPolicy::Attempts(_) => ("attempts", None),
            InvalidPolicy::ZeroDuration(key) => (key, None),
            InvalidPolicy::Status { index, .. } => ("retry_on", Some(*index)),
            InvalidPolicy::Backoff(_) => ("backoff", None),
            InvalidPolicy::ReplayBody(_) => ("max_replay_body", None),
        }
    }
}

impl Policy {
    /// Every problem of `c`, not only the first: `check` lists them all.
    pub fn problems(c: &RetryConfig) -> Vec<InvalidPolicy> {
        let mut found = Vec::new();
        if !(1..=100).contains(&c.attempts) {
            found.push(InvalidPolicy::Attempts(c.attempts));
        }
        for (key, d) in [
            ("per_try_timeout", Some(c.per_try_timeout)),
            ("timeout", Some(c.timeout)),
            ("hedge_after", c.hedge_after),
        ] {
            if d.is_some_and(|d| d.is_zero()) {
                found.push(InvalidPolicy::ZeroDuration(key));
            }
        }
        if c.max_replay_body > MAX_REPLAY_BODY {
            found.push(InvalidPolicy::ReplayBody(c.max_replay_body));
        }
        for (index, r) in c.retry_on.iter().enumerate() {
            if let RetryOn::Status(code) = r {
                if StatusCode::from_u16(*code).is_err() {
                    found.push(InvalidPolicy::Status { index, code: *code });
                }
            }
        }
        if let Err(e) = Backoff::from_config(&c.backoff) {
            found.push(e.into());
        }
        found
    }

    pub fn from_config(c: &RetryConfig) -> Result<Self, InvalidPolicy> {
        if let Some(first) = Self::problems(c).into_iter().next() {
            return Err(first);
        }
        let mut conditions = Conditions::default();
        for (index, r) in c.retry_on.iter().enumerate() {
            match r {
                RetryOn::ConnectFailure => conditions.connect_failure = true,
                RetryOn::RefusedStream => conditions.refused_stream = true,
                RetryOn::Reset => conditions.reset = true,
                RetryOn::Timeout => conditions.timeout = true,
                RetryOn::Status5xx => conditions.any_5xx = true,
                RetryOn::Status(code) => conditions.codes.push(
                    StatusCode::from_u16(*code)
                        .map_err(|_| InvalidPolicy::Status { index, code: *code })?,
                ),
                RetryOn::Grpc(status) => conditions.grpc.push(*status),
            }
        }
        let methods = c.methods.iter().map(|m| m.0.clone()).collect();
        let idempotency_header = c.idempotency_header.0.clone();
        Ok(Self {
            attempts: c.attempts,
            per_try_timeout: c.per_try_timeout,
            timeout: c.timeout,
            max_replay_body: c.max_replay_body,
            hedge_after: c.hedge_after,
            conditions,
            methods,
            all_idempotent: c.idempotent,
            idempotency_header,
            respect_retry_after: c.respect_retry_after,
            max_retry_after: c.max_retry_after,
            backoff: Backoff::from_config(&c.backoff)?,
        })
    }

    /// Whether more than one attempt could ever be made for a request with these facts.
    pub fn may_retry(&self, facts: &RequestFacts) -> bool {
        self.attempts > 1 && !facts.inner_hop
    }

    /// The facts of a request whose headers are as they go upstream: read
    /// them after hop-by-hop stripping, so that a key named in `Connection`
    /// (which never reaches the upstream) does not count. An empty key
    /// promises nothing and does not count either.
    pub fn facts(&self, method: &Method, headers: &HeaderMap, inner_hop: bool) -> RequestFacts {
        // One key, and not blank: with two (two fields, or a list in one),
        // the upstream may read either.
        // Looked up only for a method not safe to repeat by itself.
        let keyed = || {
            let mut keys = headers.get_all(&self.idempotency_header).iter();
            match (keys.next(), keys.next()) {
                (Some(key), None) => one_key(key.as_bytes()),
                _ => false,
            }
        };
        RequestFacts {
            idempotent: self.all_idempotent || self.methods.contains(method) || keyed(),
            inner_hop,
            path: PathKey::NONE,
        }
    }

    /// The header that makes a request safe to repeat.
    pub fn idempotency_header(&self) -> &HeaderName {
        &self.idempotency_header
    }

    /// Whether `retry_on` names this outcome. Only the upstream's failures
    /// can be named: a caller's fault, the deadline and the proxy's own
    /// refusals never are.
    pub fn names(&self, outcome: Outcome) -> bool {
        let c = &self.conditions;
        match outcome {
            Outcome::Response(status) => {
                (c.any_5xx && status.is_server_error()) || c.codes.contains(&status)
            }
            Outcome::Grpc(status) => c.grpc.contains(&status),
            Outcome::Upstream(UpstreamFault::ConnectFailure) => c.connect_failure,
            Outcome::Upstream(UpstreamFault::RefusedStream) => c.refused_stream,
            Outcome::Upstream(UpstreamFault::Reset | UpstreamFault::StaleConnection) => c.reset,
            Outcome::Upstream(UpstreamFault::Timeout) => c.timeout,
            Outcome::Upstream(UpstreamFault::BadResponse) => false,
            Outcome::Caller(_) | Outcome::Deadline | Outcome::Refused(_) | Outcome::Superseded => {
                false
            }
        }
    }

    /// The server's own delay (a parsed `Retry-After`), when we honour it.
    /// `Err` when it asks for longer than `max_retry_after`.
    pub fn server_delay(
        &self,
        retry_after: Option<Duration>,
    ) -> Result<Option<Duration>, SkipReason> {
        match retry_after {
            // Not a delay but a refusal, whatever `respect_retry_after` says.
            Some(DO_NOT_RETRY) => Err(SkipReason::RetryAfterTooLong),
            _ if !self.respect_retry_after => Ok(None),
            Some(d) if d > self.max_retry_after => Err(SkipReason::RetryAfterTooLong),
            other => Ok(other),
        }
    }

    /// The least time a retry must have left before `timeout` to be worth
    /// making: half of `per_try_timeout`. A retry with less would most
    /// likely be cut short, and only add load.
    pub fn min_retry_time(&self) -> Duration {
        self.per_try_timeout / 2
    }
}

/// A server's "do not retry" (gRPC's negative or malformed
/// `grpc-retry-pushback-ms`), given where a delay would be.
pub const DO_NOT_RETRY: Duration = Duration::MAX;

/// A response's `Retry-After`, if it has one that parses. The clock is
/// read only for a response that carries one.
pub fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    parse_retry_after(headers.get(http::header::RETRY_AFTER)?, SystemTime::now())
}

/// `Retry-After` as delta-seconds or an HTTP-date (RFC 9110 §10.2.3).
/// A date in the past means "now".
pub fn parse_retry_after(value: &HeaderValue, now: SystemTime) -> Option<Duration> {
    let text = value.to_str().ok()?.trim();
    if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
        // Too many seconds to count is simply "a very long time".
        return Some(
            text.parse()
                .map_or(Duration::from_secs(u64::MAX), Duration::from_secs),
        );
    }
    let at = httpdate::parse_http_date(text).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// Whether a key's value is one key: not blank, and not a list. A comma
/// outside a quoted string (`a, b`) makes a list; the draft standard's
/// key is one quoted string (`"8e03978e-…"`), which may hold commas.
fn one_key(value: &[u8]) -> bool {
    let value = value.trim_ascii();
    if value.is_empty() {
        return false;
    }
    let quoted = value.len() >= 2
        && value.first() == Some(&b'"')
        && value.last() == Some(&b'"')
        && !value[1..value.len() - 1].contains(&b'"');
    quoted || !value.contains(&b',')
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::outcome::CallerFault;

    fn policy(f: impl FnOnce(&mut RetryConfig)) -> Policy {
        let mut c = RetryConfig::default();
        f(&mut c);
        Policy::from_config(&c).unwrap()
    }

    fn status(code: u16) -> Outcome {
        Outcome::Response(StatusCode::from_u16(code).unwrap())
    }

    #[test]
    fn names_only_what_retry_on_names() {
        let p = policy(|_| {});
        assert!(p.names(status(503)));
        assert!(!p.names(status(500)), "500 is not in the default list");
        for code in [200, 400, 401, 403, 404, 429] {
            assert!(!p.names(status(code)), "{code} is never retried by default");
        }
        assert!(p.names(Outcome::Upstream(UpstreamFault::Timeout)));
        assert!(!p.names(Outcome::Upstream(UpstreamFault::RefusedStream)));
        // Never the upstream's failure, whatever retry_on says.
        assert!(!p.names(Outcome::Caller(CallerFault::MalformedBody)));
        assert!(!p.names(Outcome::Deadline));

        let p = policy(|c| c.retry_on = vec![RetryOn::Status5xx, RetryOn::Status(429)]);
        assert!(p.names(status(500)));
        assert!(p.names(status(429)));
        assert!(!p.names(status(404)));
        assert!(!p.names(Outcome::Upstream(UpstreamFault::Reset)));
    }

    #[test]
    fn idempotency_key_counts_only_when_it_says_something() {
        let p = policy(|_| {});
        let mut h = HeaderMap::new();
        assert!(!p.facts(&Method::POST, &h, false).idempotent);
        h.insert("idempotency-key", HeaderValue::from_static(""));
        assert!(!p.facts(&Method::POST, &h, false).idempotent, "empty");
        h.insert("idempotency-key", HeaderValue::from_static("  "));
        assert!(!p.facts(&Method::POST, &h, false).idempotent, "blank");
        h.append("idempotency-key", HeaderValue::from_static("k1"));
        assert!(!p.facts(&Method::POST, &h, false).idempotent, "two keys");
        h.insert("idempotency-key", HeaderValue::from_static("a, b"));
        assert!(!p.facts(&Method::POST, &h, false).idempotent, "a list");
        h.insert("idempotency-key", HeaderValue::from_static("\"a,b\""));
        assert!(
            p.facts(&Method::POST, &h, false).idempotent,
            "one quoted key"
        );
        h.insert("idempotency-key", HeaderValue::from_static("\"a\", \"b\""));
        assert!(
            !p.facts(&Method::POST, &h, false).idempotent,
            "two quoted keys"
        );
        h.insert("idempotency-key", HeaderValue::from_static("k1"));
        assert!(p.facts(&Method::POST, &h, false).idempotent);
        assert!(p.facts(&Method::PUT, &HeaderMap::new(), false).idempotent);
    }

    #[test]
    fn retry_after_forms() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let v = |s: &str| parse_retry_after(&HeaderValue::from_str(s).unwrap(), now);
        assert_eq!(v("3"), Some(Duration::from_secs(3)));
        let later = httpdate::fmt_http_date(now + Duration::from_secs(7));
        assert_eq!(v(&later), Some(Duration::from_secs(7)));
        let earlier = httpdate::fmt_http_date(now - Duration::from_secs(7));
        assert_eq!(v(&earlier), Some(Duration::ZERO));
        assert_eq!(v("soon"), None);
        assert_eq!(
            v("99999999999999999999999"),
            Some(Duration::from_secs(u64::MAX)),
            "longer than any limit"
        );
        assert_eq!(v("-5"), None);
        assert_eq!(v(""), None);

        let p = policy(|c| c.max_retry_after = Duration::from_secs(5));
        let secs = |n| Some(Duration::from_secs(n));
        assert_eq!(p.server_delay(None), Ok(None));
        assert_eq!(p.server_delay(secs(2)), Ok(secs(2)));
        assert_eq!(p.server_delay(secs(60)), Err(SkipReason::RetryAfterTooLong));
        let p = policy(|c| c.respect_retry_after = false);
        assert_eq!(p.server_delay(secs(60)), Ok(None));
        assert_eq!(
            p.server_delay(Some(Duration::from_secs(u64::MAX))),
            Ok(None),
            "an HTTP Retry-After, however long, is ignored"
        );
        // gRPC's "do not retry" is a refusal, not a delay to ignore.
        assert_eq!(
            p.server_delay(Some(DO_NOT_RETRY)),
            Err(SkipReason::RetryAfterTooLong)
        );
    }
}
