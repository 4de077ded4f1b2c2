//! The retry policy of a route, compiled: pure decisions over an attempt's
//! outcome and the request. Nothing here sleeps, sends or reads a clock of its
//! own; the one loop in `retry/mod.rs` asks and acts.

use std::time::{Duration, SystemTime};

use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode};

use crate::config::{RetryConfig, RetryOn};

use super::backoff::{Backoff, InvalidBackoff};

/// How an attempt failed, as far as retrying is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// No connection could be made, or the request was never written on a
    /// pooled connection that closed: the upstream did not see it.
    ConnectFailure,
    /// The upstream refused the HTTP/2 stream: it did not process the request.
    RefusedStream,
    /// The connection failed after the request was (perhaps) sent.
    Reset,
    /// No response headers within the per-try timeout.
    Timeout,
    /// A response whose status `retry_on` names.
    Status(StatusCode),
}

impl Failure {
    /// Whether the upstream may have acted on the request.
    pub fn reached_upstream(self) -> bool {
        !matches!(self, Failure::ConnectFailure | Failure::RefusedStream)
    }

    /// The `reason` label of `herdguard_retries_total`.
    pub fn label(&self) -> &str {
        match self {
            Failure::ConnectFailure => "connect-failure",
            Failure::RefusedStream => "refused-stream",
            Failure::Reset => "reset",
            Failure::Timeout => "timeout",
            Failure::Status(code) => code.as_str(),
        }
    }
}

/// Why a retry was not made: the `reason` label of `herdguard_retries_skipped_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SkipReason {
    Budget,
    BreakerOpen,
    NonIdempotent,
    BodyTooLarge,
    Deadline,
    InnerHop,
    RetryAfterTooLong,
    AttemptsExhausted,
    /// The upstream was at its in-flight limit when the retry would have gone.
    Overloaded,
}

impl SkipReason {
    pub const ALL: [SkipReason; 9] = [
        SkipReason::Budget,
        SkipReason::BreakerOpen,
        SkipReason::NonIdempotent,
        SkipReason::BodyTooLarge,
        SkipReason::Deadline,
        SkipReason::InnerHop,
        SkipReason::RetryAfterTooLong,
        SkipReason::AttemptsExhausted,
        SkipReason::Overloaded,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            SkipReason::Budget => "budget",
            SkipReason::BreakerOpen => "breaker_open",
            SkipReason::NonIdempotent => "non_idempotent",
            SkipReason::BodyTooLarge => "body_too_large",
            SkipReason::Deadline => "deadline",
            SkipReason::InnerHop => "inner_hop",
            SkipReason::RetryAfterTooLong => "retry_after_too_long",
            SkipReason::AttemptsExhausted => "attempts_exhausted",
            SkipReason::Overloaded => "overloaded",
        }
    }
}

/// What to do after an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Pass the outcome on: it succeeded, or its failure is not one `retry_on` names.
    Done,
    /// Another attempt is allowed, if time and the budget permit.
    Retry(Failure),
    /// A retry was wanted but is not allowed.
    Skip(Failure, SkipReason),
}

/// What the policy needs to know about the request, computed once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestFacts {
    /// The method is in `methods`, or the request carries the idempotency header.
    pub idempotent: bool,
    /// The request came through an outer herdguard that retries for it.
    pub inner_hop: bool,
}

/// A compiled `[retry]` table. A `Policy` that exists is valid.
#[derive(Debug, Clone)]
pub struct Policy {
    pub attempts: u32,
    pub per_try_timeout: Duration,
    pub timeout: Duration,
    pub max_replay_body: u64,
    conditions: Conditions,
    methods: Vec<Method>,
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
}

#[derive(Debug, thiserror::Error)]
pub enum InvalidPolicy {
    #[error("backoff: {0}")]
    Backoff(#[from] InvalidBackoff),
    #[error("{0:?} is not a method")]
    Method(String),
    #[error("{0:?} is not a header name")]
    Header(String),
    #[error("attempts must be at least 1")]
    Attempts,
}

impl Policy {
    pub fn from_config(c: &RetryConfig) -> Result<Self, InvalidPolicy> {
        if c.attempts == 0 {
            return Err(InvalidPolicy::Attempts);
        }
        let mut conditions = Conditions::default();
        for r in &c.retry_on {
            match r {
                RetryOn::ConnectFailure => conditions.connect_failure = true,
                RetryOn::RefusedStream => conditions.refused_stream = true,
                RetryOn::Reset => conditions.reset = true,
                RetryOn::Timeout => conditions.timeout = true,
                RetryOn::Status5xx => conditions.any_5xx = true,
                RetryOn::Status(code) => conditions
                    .codes
                    .push(StatusCode::from_u16(*code).expect("validated status code")),
            }
        }
        let methods = c
            .methods
            .iter()
            .map(|m| Method::from_bytes(m.as_bytes()).map_err(|_| InvalidPolicy::Method(m.clone())))
            .collect::<Result<_, _>>()?;
        let idempotency_header = HeaderName::from_bytes(c.idempotency_header.as_bytes())
            .map_err(|_| InvalidPolicy::Header(c.idempotency_header.clone()))?;
        Ok(Self {
            attempts: c.attempts,
            per_try_timeout: c.per_try_timeout,
            timeout: c.timeout,
            max_replay_body: c.max_replay_body,
            conditions,
            methods,
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

    pub fn facts(&self, method: &Method, headers: &HeaderMap, inner_hop: bool) -> RequestFacts {
        RequestFacts {
            idempotent: self.methods.contains(method)
                || headers.contains_key(&self.idempotency_header),
            inner_hop,
        }
    }

    /// The failure a response stands for, if `retry_on` names its status.
    pub fn status_failure(&self, status: StatusCode) -> Option<Failure> {
        let c = &self.conditions;
        let named = (c.any_5xx && status.is_server_error()) || c.codes.contains(&status);
        named.then_some(Failure::Status(status))
    }

    fn names(&self, failure: Failure) -> bool {
        let c = &self.conditions;
        match failure {
            Failure::ConnectFailure => c.connect_failure,
            Failure::RefusedStream => c.refused_stream,
            Failure::Reset => c.reset,
            Failure::Timeout => c.timeout,
            Failure::Status(status) => self.status_failure(status).is_some(),
        }
    }

    /// After attempt number `attempt` (1-based) ended in `failure`: may another follow?
    /// `body_replayable` says whether the request body can be sent again.
    pub fn verdict(
        &self,
        failure: Option<Failure>,
        attempt: u32,
        facts: &RequestFacts,
        body_replayable: bool,
    ) -> Verdict {
        let Some(failure) = failure.filter(|f| self.names(*f)) else {
            return Verdict::Done;
        };
        let skip = |reason| Verdict::Skip(failure, reason);
        if facts.inner_hop {
            return skip(SkipReason::InnerHop);
        }
        if attempt >= self.attempts {
            return skip(SkipReason::AttemptsExhausted);
        }
        if failure.reached_upstream() && !facts.idempotent {
            return skip(SkipReason::NonIdempotent);
        }
        if !body_replayable {
            return skip(SkipReason::BodyTooLarge);
        }
        Verdict::Retry(failure)
    }

    /// The server's own delay, when it gave one and we honour it.
    /// `Err` when it asks for longer than `max_retry_after`.
    pub fn retry_after(
        &self,
        headers: &HeaderMap,
        now: SystemTime,
    ) -> Result<Option<Duration>, SkipReason> {
        if !self.respect_retry_after {
            return Ok(None);
        }
        match headers
            .get(http::header::RETRY_AFTER)
            .and_then(|v| parse_retry_after(v, now))
        {
            Some(d) if d > self.max_retry_after => Err(SkipReason::RetryAfterTooLong),
            other => Ok(other),
        }
    }
}

/// `Retry-After` as delta-seconds or an HTTP-date (RFC 9110 §10.2.3).
/// A date in the past means "now".
pub fn parse_retry_after(value: &HeaderValue, now: SystemTime) -> Option<Duration> {
    let text = value.to_str().ok()?.trim();
    if let Ok(secs) = text.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = httpdate::parse_http_date(text).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(f: impl FnOnce(&mut RetryConfig)) -> Policy {
        let mut c = RetryConfig::default();
        f(&mut c);
        Policy::from_config(&c).unwrap()
    }

    const IDEMPOTENT: RequestFacts = RequestFacts {
        idempotent: true,
        inner_hop: false,
    };
    const UNSAFE: RequestFacts = RequestFacts {
        idempotent: false,
        inner_hop: false,
    };

    #[test]
    fn retries_only_what_retry_on_names() {
        let p = policy(|_| {});
        let s = |code| p.status_failure(StatusCode::from_u16(code).unwrap());
        assert_eq!(
            s(503),
            Some(Failure::Status(StatusCode::SERVICE_UNAVAILABLE))
        );
        assert_eq!(s(500), None, "500 is not in the default list");
        for code in [400, 401, 403, 404, 429] {
            assert_eq!(s(code), None, "{code} is never retried by default");
        }
        assert_eq!(p.verdict(None, 1, &IDEMPOTENT, true), Verdict::Done);
        assert_eq!(
            p.verdict(Some(Failure::Timeout), 1, &IDEMPOTENT, true),
            Verdict::Retry(Failure::Timeout)
        );

        let p = policy(|c| c.retry_on = vec![RetryOn::Status5xx, RetryOn::Status(429)]);
        assert!(p
            .status_failure(StatusCode::INTERNAL_SERVER_ERROR)
            .is_some());
        assert!(p.status_failure(StatusCode::TOO_MANY_REQUESTS).is_some());
        assert!(p.status_failure(StatusCode::NOT_FOUND).is_none());
        assert_eq!(
            p.verdict(Some(Failure::Reset), 1, &IDEMPOTENT, true),
            Verdict::Done,
            "reset not named"
        );
    }

    #[test]
    fn non_idempotent_requests_retry_only_when_never_sent() {
        let p = policy(|_| {});
        let reset = Some(Failure::Reset);
        assert_eq!(
            p.verdict(reset, 1, &UNSAFE, true),
            Verdict::Skip(Failure::Reset, SkipReason::NonIdempotent)
        );
        let refused = Some(Failure::ConnectFailure);
        assert_eq!(
            p.verdict(refused, 1, &UNSAFE, true),
            Verdict::Retry(Failure::ConnectFailure)
        );

        let mut h = HeaderMap::new();
        assert!(!p.facts(&Method::POST, &h, false).idempotent);
        h.insert("idempotency-key", HeaderValue::from_static("k1"));
        assert!(p.facts(&Method::POST, &h, false).idempotent);
        assert!(p.facts(&Method::PUT, &HeaderMap::new(), false).idempotent);
    }

    #[test]
    fn skip_reasons() {
        let p = policy(|c| c.attempts = 2);
        let f = Some(Failure::Status(StatusCode::BAD_GATEWAY));
        let fail = Failure::Status(StatusCode::BAD_GATEWAY);
        assert_eq!(
            p.verdict(f, 2, &IDEMPOTENT, true),
            Verdict::Skip(fail, SkipReason::AttemptsExhausted)
        );
        assert_eq!(
            p.verdict(f, 1, &IDEMPOTENT, false),
            Verdict::Skip(fail, SkipReason::BodyTooLarge)
        );
        let inner = RequestFacts {
            idempotent: true,
            inner_hop: true,
        };
        assert_eq!(
            p.verdict(f, 1, &inner, true),
            Verdict::Skip(fail, SkipReason::InnerHop)
        );
        assert!(!p.may_retry(&inner));
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

        let p = policy(|c| c.max_retry_after = Duration::from_secs(5));
        let mut h = HeaderMap::new();
        assert_eq!(p.retry_after(&h, now), Ok(None));
        h.insert("retry-after", HeaderValue::from_static("2"));
        assert_eq!(p.retry_after(&h, now), Ok(Some(Duration::from_secs(2))));
        h.insert("retry-after", HeaderValue::from_static("60"));
        assert_eq!(p.retry_after(&h, now), Err(SkipReason::RetryAfterTooLong));
        let p = policy(|c| c.respect_retry_after = false);
        assert_eq!(p.retry_after(&h, now), Ok(None));
    }
}
