//! Who is at fault: how one attempt ended, and whose doing it was.
//!
//! Why one model: a proxy that cannot tell whose fault a failure is lets any
//! caller black out a route. A caller that hangs up, sends a malformed body
//! or stalls its upload would otherwise look like an upstream that failed,
//! and the breaker, the adaptive limit and the retries would punish every
//! other caller for it. So every attempt ends in one [`Outcome`] that names
//! its owner, and the breaker, the limit, the budget and the metrics each map
//! it in exactly one place. Only the upstream's faults count against it.
//!
//! This is a leaf: the label enums shared by the metrics, the breaker and the
//! retry loop live here, and this module imports nothing of the crate.

use http::StatusCode;

/// How one attempt ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The upstream answered. A 5xx is its fault; anything below is an answer.
    Response(StatusCode),
    /// A gRPC call answered "trailers-only" (its status in the response
    /// headers, no message) with a status other than OK: the HTTP status is
    /// 200, the verdict is the gRPC status's.
    Grpc(GrpcStatus),
    /// The upstream failed without answering.
    Upstream(UpstreamFault),
    /// The caller failed the attempt: it went away, or its body was
    /// malformed or stalled. Never the upstream's fault, never retried.
    Caller(CallerFault),
    /// The request's `timeout` ran out before the attempt could end: it was
    /// cut short, not given its per-try time, so the upstream is not blamed.
    Deadline,
    /// The proxy did not send the attempt at all.
    Refused(Refusal),
    /// A hedge race's other attempt answered first, and the proxy
    /// cancelled this one: nobody's failure, heard by no breaker, limit or
    /// endpoint health.
    Superseded,
}

/// A gRPC status code (`grpc-status`, 0 to 16).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GrpcStatus(u8);

impl GrpcStatus {
    pub const OK: GrpcStatus = GrpcStatus(0);
    pub const CANCELLED: GrpcStatus = GrpcStatus(1);
    pub const UNKNOWN: GrpcStatus = GrpcStatus(2);
    pub const INVALID_ARGUMENT: GrpcStatus = GrpcStatus(3);
    pub const DEADLINE_EXCEEDED: GrpcStatus = GrpcStatus(4);
    pub const RESOURCE_EXHAUSTED: GrpcStatus = GrpcStatus(8);
    pub const UNIMPLEMENTED: GrpcStatus = GrpcStatus(12);
    pub const INTERNAL: GrpcStatus = GrpcStatus(13);
    pub const UNAVAILABLE: GrpcStatus = GrpcStatus(14);

    /// Names as Envoy's `retry_on` spells them (and `grpc-` + name is the
    /// `reason` of `herdguard_retries_total`), by code.
    const NAMES: [&'static str; 17] = [
        "ok",
        "cancelled",
        "unknown",
        "invalid-argument",
        "deadline-exceeded",
        "not-found",
        "already-exists",
        "permission-denied",
        "resource-exhausted",
        "failed-precondition",
        "aborted",
        "out-of-range",
        "unimplemented",
        "internal",
        "unavailable",
        "data-loss",
        "unauthenticated",
    ];
    const CAUSES: [&'static str; 17] = [
        "grpc-ok",
        "grpc-cancelled",
        "grpc-unknown",
        "grpc-invalid-argument",
        "grpc-deadline-exceeded",
        "grpc-not-found",
        "grpc-already-exists",
        "grpc-permission-denied",
        "grpc-resource-exhausted",
        "grpc-failed-precondition",
        "grpc-aborted",
        "grpc-out-of-range",
        "grpc-unimplemented",
        "grpc-internal",
        "grpc-unavailable",
        "grpc-data-loss",
        "grpc-unauthenticated",
    ];

    /// The codes `retry_on` may name: those a retry can help.
    pub const RETRYABLE: [GrpcStatus; 5] = [
        GrpcStatus::CANCELLED,
        GrpcStatus::DEADLINE_EXCEEDED,
        GrpcStatus::INTERNAL,
        GrpcStatus::RESOURCE_EXHAUSTED,
        GrpcStatus::UNAVAILABLE,
    ];

    /// A `grpc-status` value: a decimal code. A code past 16 is UNKNOWN, as
    /// gRPC clients read it; anything else is no status.
    pub fn parse(value: &[u8]) -> Option<GrpcStatus> {
        if value.is_empty() || value.len() > 3 || !value.iter().all(u8::is_ascii_digit) {
            return None;
        }
        let code = value.iter().fold(0u16, |n, d| n * 10 + u16::from(d - b'0'));
        Some(match u8::try_from(code) {
            Ok(code) if code <= 16 => GrpcStatus(code),
            _ => GrpcStatus::UNKNOWN,
        })
    }

    /// The code named `name` in `retry_on`'s spelling, among [`RETRYABLE`](Self::RETRYABLE).
    pub fn retryable_named(name: &str) -> Option<GrpcStatus> {
        Self::RETRYABLE.into_iter().find(|s| s.name() == name)
    }

    pub fn code(self) -> u8 {
        self.0
    }

    pub fn name(self) -> &'static str {
        Self::NAMES
            .get(usize::from(self.0))
            .copied()
            .unwrap_or("unknown")
    }

    /// `grpc-unavailable`: the `reason` of a retry after this status.
    pub fn cause(self) -> &'static str {
        Self::CAUSES
            .get(usize::from(self.0))
            .copied()
            .unwrap_or("grpc-unknown")
    }

    /// The server failed, as a 5xx says: the upstream's fault. The others
    /// (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, ...) are answers.
    pub fn is_server_error(self) -> bool {
        matches!(self.0, 2 | 4 | 13 | 14 | 15)
    }
}

/// The upstream's failures, as `retry_on` names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UpstreamFault {
    /// No connection could be made, or the request was never written on a
    /// pooled connection that closed: the upstream did not see it.
    ConnectFailure,
    /// The upstream refused the HTTP/2 stream: it did not process the request.
    RefusedStream,
    /// The connection failed after the request was (perhaps) sent.
    Reset,
    /// No response headers within `per_try_timeout` of the request being sent.
    Timeout,
    /// A response that breaks HTTP: a status outside 100-599, a head too
    /// large or malformed. It would only fail again: never retried.
    BadResponse,
    /// A reused keep-alive connection closed before any byte of the answer:
    /// most likely the upstream closed it as the request went out (the
    /// keep-alive race of RFC 9112 §9.3.1), but a crash looks the same. A
    /// reset for `retry_on`, so idempotent requests are retried (and then
    /// succeed, which is what the breaker, counting requests, hears).
    StaleConnection,
}

/// The caller's failures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CallerFault {
    /// The caller went away: it hung up, or its body ended early.
    Gone,
    /// The caller's body broke the protocol (a bad chunk size, say).
    MalformedBody,
    /// The caller stopped sending its body until the request's `timeout` ran out.
    StalledBody,
}

/// Why the proxy did not send an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Refusal {
    /// The route's circuit breaker is open (or its probes are all out).
    CircuitOpen,
    /// The upstream is at its in-flight limit.
    Overloaded,
}

/// Whose fault an outcome was.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fault {
    /// Nobody's: the upstream answered below 500.
    None,
    Upstream,
    Caller,
    Deadline,
    /// The proxy's own refusal.
    Proxy,
}

impl Outcome {
    pub fn fault(self) -> Fault {
        match self {
            Outcome::Response(status) if status.is_server_error() => Fault::Upstream,
            Outcome::Response(_) => Fault::None,
            Outcome::Grpc(status) if status.is_server_error() => Fault::Upstream,
            Outcome::Grpc(_) => Fault::None,
            Outcome::Upstream(_) => Fault::Upstream,
            Outcome::Caller(_) => Fault::Caller,
            Outcome::Deadline => Fault::Deadline,
            Outcome::Refused(_) | Outcome::Superseded => Fault::Proxy,
        }
    }

    /// Whether the upstream may have acted on the request: false only when
    /// it certainly did not (never connected, stream refused, not sent).
    pub fn reached_upstream(self) -> bool {
        !matches!(
            self,
            Outcome::Upstream(UpstreamFault::ConnectFailure | UpstreamFault::RefusedStream)
                | Outcome::Refused(_)
        )
    }

    /// The `outcome` label of `herdguard_upstream_attempts_total`: the one
    /// mapping from an outcome to the metrics.
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Response(status) if status.is_server_error() => "5xx",
            Outcome::Response(_) => "ok",
            Outcome::Grpc(status) if status.is_server_error() => "grpc-error",
            Outcome::Grpc(_) => "ok",
            Outcome::Upstream(f) => f.label(),
            Outcome::Caller(CallerFault::Gone) => "cancelled",
            Outcome::Caller(CallerFault::MalformedBody) => "caller-malformed",
            Outcome::Caller(CallerFault::StalledBody) => "caller-stalled",
            Outcome::Deadline => "deadline",
            Outcome::Refused(Refusal::CircuitOpen) => "circuit-open",
            Outcome::Refused(Refusal::Overloaded) => "overloaded",
            Outcome::Superseded => "superseded",
        }
    }

    /// The `reason` label of `herdguard_retries_total` for a retry after this
    /// outcome: the status code of a response, else the outcome's label.
    pub fn cause(&self) -> &str {
        match self {
            Outcome::Response(status) => status.as_str(),
            Outcome::Grpc(status) => status.cause(),
            other => other.label(),
        }
    }

    /// Every label of an attempt that was sent (refusals are not attempts).
    pub const SENT: [Outcome; 14] = [
        Outcome::Response(StatusCode::OK),
        Outcome::Response(StatusCode::INTERNAL_SERVER_ERROR),
        Outcome::Upstream(UpstreamFault::ConnectFailure),
        Outcome::Upstream(UpstreamFault::RefusedStream),
        Outcome::Upstream(UpstreamFault::Reset),
        Outcome::Upstream(UpstreamFault::Timeout),
        Outcome::Upstream(UpstreamFault::BadResponse),
        Outcome::Upstream(UpstreamFault::StaleConnection),
        Outcome::Caller(CallerFault::Gone),
        Outcome::Caller(CallerFault::MalformedBody),
        Outcome::Caller(CallerFault::StalledBody),
        Outcome::Deadline,
        Outcome::Grpc(GrpcStatus::UNAVAILABLE),
        Outcome::Superseded,
    ];

    /// The position of this outcome's label in [`Outcome::SENT`], for
    /// pre-registered counters; `None` for refusals.
    pub fn sent_index(self) -> Option<usize> {
        Some(match self {
            Outcome::Response(status) if status.is_server_error() => 1,
            Outcome::Response(_) => 0,
            Outcome::Grpc(status) if status.is_server_error() => 12,
            Outcome::Grpc(_) => 0,
            Outcome::Upstream(UpstreamFault::ConnectFailure) => 2,
            Outcome::Upstream(UpstreamFault::RefusedStream) => 3,
            Outcome::Upstream(UpstreamFault::Reset) => 4,
            Outcome::Upstream(UpstreamFault::Timeout) => 5,
            Outcome::Upstream(UpstreamFault::BadResponse) => 6,
            Outcome::Upstream(UpstreamFault::StaleConnection) => 7,
            Outcome::Caller(CallerFault::Gone) => 8,
            Outcome::Caller(CallerFault::MalformedBody) => 9,
            Outcome::Caller(CallerFault::StalledBody) => 10,
            Outcome::Deadline => 11,
            Outcome::Superseded => 13,
            Outcome::Refused(_) => return None,
        })
    }
}

impl UpstreamFault {
    pub const ALL: [UpstreamFault; 6] = [
        UpstreamFault::ConnectFailure,
        UpstreamFault::RefusedStream,
        UpstreamFault::Reset,
        UpstreamFault::Timeout,
        UpstreamFault::BadResponse,
        UpstreamFault::StaleConnection,
    ];

    /// The name `retry_on` and the `reason` label of `herdguard_retries_total` use.
    pub fn label(self) -> &'static str {
        match self {
            UpstreamFault::ConnectFailure => "connect-failure",
            UpstreamFault::RefusedStream => "refused-stream",
            UpstreamFault::Reset => "reset",
            UpstreamFault::Timeout => "timeout",
            UpstreamFault::BadResponse => "bad-response",
            UpstreamFault::StaleConnection => "stale-connection",
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_upstreams_failures_are_its_fault() {
        let s = |c| Outcome::Response(StatusCode::from_u16(c).unwrap());
        assert_eq!(s(200).fault(), Fault::None);
        assert_eq!(s(404).fault(), Fault::None);
        assert_eq!(s(503).fault(), Fault::Upstream);
        for f in UpstreamFault::ALL {
            assert_eq!(Outcome::Upstream(f).fault(), Fault::Upstream);
        }
        for f in [
            CallerFault::Gone,
            CallerFault::MalformedBody,
            CallerFault::StalledBody,
        ] {
            assert_eq!(Outcome::Caller(f).fault(), Fault::Caller);
        }
        assert_eq!(Outcome::Deadline.fault(), Fault::Deadline);
        assert_eq!(Outcome::Refused(Refusal::Overloaded).fault(), Fault::Proxy);
    }

    #[test]
    fn sent_labels_line_up_with_their_index() {
        for (i, o) in Outcome::SENT.iter().enumerate() {
            assert_eq!(o.sent_index(), Some(i), "{o:?}");
        }
        let labels: std::collections::HashSet<_> =
            Outcome::SENT.iter().map(|o| o.label()).collect();
        assert_eq!(labels.len(), Outcome::SENT.len(), "labels are distinct");
        assert_eq!(Outcome::Refused(Refusal::CircuitOpen).sent_index(), None);
    }

    #[test]
    fn never_sent_means_never_reached() {
        assert!(!Outcome::Upstream(UpstreamFault::ConnectFailure).reached_upstream());
        assert!(!Outcome::Upstream(UpstreamFault::RefusedStream).reached_upstream());
        assert!(Outcome::Upstream(UpstreamFault::Reset).reached_upstream());
        assert!(Outcome::Upstream(UpstreamFault::Timeout).reached_upstream());
        assert!(Outcome::Response(StatusCode::BAD_GATEWAY).reached_upstream());
    }
}
