//! Whose fault an attempt's end was: a pure function over what came back
//! (an answer's head, a transport failure, or a timer), table-tested like
//! [`decide`](crate::policy::decide()). The attempt does the I/O; this only
//! reads what it got.

use http::{HeaderMap, StatusCode};

use crate::policy::{CallerFault, GrpcStatus, Outcome, UpstreamFault};

/// What the caller's request asks of an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Judge {
    /// The caller asked to upgrade: only then is a 101 an answer.
    pub upgrade: bool,
    /// A gRPC call: judged by its `grpc-status`.
    pub grpc: bool,
    /// The gRPC caller set its own deadline, passed on upstream.
    pub grpc_deadline: bool,
}

/// How an attempt ended, as far as classification needs to know.
#[derive(Debug, Clone, Copy)]
pub enum Reply<'a> {
    /// An answer's head. `end_stream`: it has no body (a gRPC
    /// trailers-only answer carries its status in its head).
    Head {
        status: StatusCode,
        headers: &'a HeaderMap,
        end_stream: bool,
    },
    /// The exchange failed, as the transport classed it; `caller`: what the
    /// request body's progress says the caller did meanwhile.
    Failed {
        upstream: UpstreamFault,
        caller: Option<CallerFault>,
    },
    /// No answer's head within the per-try time after the request was sent.
    PerTry,
    /// The request's deadline cut the attempt short.
    Deadline,
    /// The deadline came while the body was waiting on the caller.
    Stalled,
}

/// Why an attempt has the outcome it has: what its message says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// An answer to pass on (or judge by its status).
    Answered,
    /// A 101 nobody asked for: it would break the caller's connection.
    UnaskedSwitch,
    /// A transfer coding other than chunked (gzip, say): hyper took the
    /// chunks off, and the caller would get coded bytes with nothing
    /// saying so.
    TransferCoding,
    /// A status from 600 up: HTTP allows three digits, and these mean nothing.
    StatusOutOfRange,
    /// The transport failed, and the upstream is to blame.
    Failed,
    /// The request body was malformed.
    MalformedBody,
    /// The body stopped coming, and the upstream gave up on it (its read
    /// timeout): right to, the stall is the caller's.
    UpstreamGaveUpOnBody,
    /// The caller's body ended before it was complete.
    CallerGone,
    PerTry,
    Deadline,
    Stalled,
}

/// The outcome of an attempt that ended with `reply`, and why.
pub fn classify(judge: &Judge, reply: &Reply<'_>) -> (Outcome, Why) {
    match *reply {
        Reply::Head {
            status,
            headers,
            end_stream,
        } => answer(judge, status, headers, end_stream),
        Reply::Failed {
            caller: Some(fault),
            ..
        } => (
            Outcome::Caller(fault),
            match fault {
                CallerFault::MalformedBody => Why::MalformedBody,
                CallerFault::StalledBody => Why::UpstreamGaveUpOnBody,
                CallerFault::Gone => Why::CallerGone,
            },
        ),
        Reply::Failed {
            upstream,
            caller: None,
        } => (Outcome::Upstream(upstream), Why::Failed),
        Reply::PerTry => (Outcome::Upstream(UpstreamFault::Timeout), Why::PerTry),
        Reply::Deadline => (Outcome::Deadline, Why::Deadline),
        Reply::Stalled => (Outcome::Caller(CallerFault::StalledBody), Why::Stalled),
    }
}

fn answer(
    judge: &Judge,
    status: StatusCode,
    headers: &HeaderMap,
    end_stream: bool,
) -> (Outcome, Why) {
    let bad = Outcome::Upstream(UpstreamFault::BadResponse);
    if status == StatusCode::SWITCHING_PROTOCOLS && !judge.upgrade {
        return (bad, Why::UnaskedSwitch);
    }
    use crate::wire::headers::check_framing;
    // One look-up: a pass over every name costs more.
    if headers.contains_key(http::header::TRANSFER_ENCODING) && check_framing(headers).is_err() {
        return (bad, Why::TransferCoding);
    }
    if status.as_u16() > 599 {
        return (bad, Why::StatusOutOfRange);
    }
    let grpc = match judge.grpc {
        true => trailers_only_status(status, headers, end_stream),
        false => None,
    };
    let outcome = match grpc {
        // The caller's own deadline, passed on, ran out: the caller set it,
        // the upstream is not to blame.
        Some(GrpcStatus::DEADLINE_EXCEEDED) if judge.grpc_deadline => Outcome::Deadline,
        Some(grpc) if grpc != GrpcStatus::OK => Outcome::Grpc(grpc),
        _ => Outcome::Response(status),
    };
    (outcome, Why::Answered)
}

/// The `grpc-status` of a trailers-only gRPC answer (a 200 with no body).
/// Missing, twice, or not a status: a broken answer, as a gRPC client
/// reads it (INTERNAL), never a success.
fn trailers_only_status(
    status: StatusCode,
    headers: &HeaderMap,
    end_stream: bool,
) -> Option<GrpcStatus> {
    if status != StatusCode::OK || !end_stream {
        return None;
    }
    let mut values = headers.get_all("grpc-status").iter();
    Some(match (values.next(), values.next()) {
        (Some(one), None) => GrpcStatus::parse(one.as_bytes()).unwrap_or(GrpcStatus::INTERNAL),
        _ => GrpcStatus::INTERNAL,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    const PLAIN: Judge = Judge {
        upgrade: false,
        grpc: false,
        grpc_deadline: false,
    };
    const GRPC: Judge = Judge {
        grpc: true,
        ..PLAIN
    };

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (name, value) in pairs {
            h.append(*name, HeaderValue::from_static(value));
        }
        h
    }

    fn head(code: u16, h: &HeaderMap, end_stream: bool) -> Reply<'_> {
        Reply::Head {
            status: StatusCode::from_u16(code).unwrap(),
            headers: h,
            end_stream,
        }
    }

    fn status(code: u16) -> Outcome {
        Outcome::Response(StatusCode::from_u16(code).unwrap())
    }

    #[test]
    fn every_outcome_and_its_reason() {
        let none = HeaderMap::new();
        let gzip = headers(&[("transfer-encoding", "gzip, chunked")]);
        let unavailable = headers(&[("grpc-status", "14")]);
        let deadline = headers(&[("grpc-status", "4")]);
        let ok = headers(&[("grpc-status", "0")]);
        let twice = headers(&[("grpc-status", "0"), ("grpc-status", "0")]);
        let garbage = headers(&[("grpc-status", "x")]);
        let bad = Outcome::Upstream(UpstreamFault::BadResponse);
        let with_deadline = Judge {
            grpc_deadline: true,
            ..GRPC
        };
        let upgrading = Judge {
            upgrade: true,
            ..PLAIN
        };
        let failed = |upstream, caller| Reply::Failed { upstream, caller };
        let rows: Vec<(&str, Judge, Reply<'_>, Outcome, Why)> = vec![
            (
                "a 200",
                PLAIN,
                head(200, &none, false),
                status(200),
                Why::Answered,
            ),
            (
                "a 503",
                PLAIN,
                head(503, &none, true),
                status(503),
                Why::Answered,
            ),
            (
                "an unasked 101",
                PLAIN,
                head(101, &none, true),
                bad,
                Why::UnaskedSwitch,
            ),
            (
                "an asked-for 101",
                upgrading,
                head(101, &none, true),
                status(101),
                Why::Answered,
            ),
            (
                "gzip framing",
                PLAIN,
                head(200, &gzip, false),
                bad,
                Why::TransferCoding,
            ),
            (
                "status 600",
                PLAIN,
                head(600, &none, true),
                bad,
                Why::StatusOutOfRange,
            ),
            (
                "status 999",
                PLAIN,
                head(999, &none, true),
                bad,
                Why::StatusOutOfRange,
            ),
            (
                "gRPC UNAVAILABLE",
                GRPC,
                head(200, &unavailable, true),
                Outcome::Grpc(GrpcStatus::UNAVAILABLE),
                Why::Answered,
            ),
            (
                "gRPC OK",
                GRPC,
                head(200, &ok, true),
                status(200),
                Why::Answered,
            ),
            (
                "gRPC status twice",
                GRPC,
                head(200, &twice, true),
                Outcome::Grpc(GrpcStatus::INTERNAL),
                Why::Answered,
            ),
            (
                "gRPC status garbage",
                GRPC,
                head(200, &garbage, true),
                Outcome::Grpc(GrpcStatus::INTERNAL),
                Why::Answered,
            ),
            (
                "gRPC status missing",
                GRPC,
                head(200, &none, true),
                Outcome::Grpc(GrpcStatus::INTERNAL),
                Why::Answered,
            ),
            (
                "gRPC with a body: its trailers tell",
                GRPC,
                head(200, &unavailable, false),
                status(200),
                Why::Answered,
            ),
            (
                "gRPC's own deadline",
                with_deadline,
                head(200, &deadline, true),
                Outcome::Deadline,
                Why::Answered,
            ),
            (
                "DEADLINE_EXCEEDED, no caller deadline",
                GRPC,
                head(200, &deadline, true),
                Outcome::Grpc(GrpcStatus::DEADLINE_EXCEEDED),
                Why::Answered,
            ),
            (
                "grpc-status outside gRPC",
                PLAIN,
                head(200, &unavailable, true),
                status(200),
                Why::Answered,
            ),
            (
                "a reset",
                PLAIN,
                failed(UpstreamFault::Reset, None),
                Outcome::Upstream(UpstreamFault::Reset),
                Why::Failed,
            ),
            (
                "a refused connection",
                PLAIN,
                failed(UpstreamFault::ConnectFailure, None),
                Outcome::Upstream(UpstreamFault::ConnectFailure),
                Why::Failed,
            ),
            (
                "a malformed body",
                PLAIN,
                failed(UpstreamFault::Reset, Some(CallerFault::MalformedBody)),
                Outcome::Caller(CallerFault::MalformedBody),
                Why::MalformedBody,
            ),
            (
                "the upstream gave up on a stalled body",
                PLAIN,
                failed(UpstreamFault::Reset, Some(CallerFault::StalledBody)),
                Outcome::Caller(CallerFault::StalledBody),
                Why::UpstreamGaveUpOnBody,
            ),
            (
                "the caller went away",
                PLAIN,
                failed(UpstreamFault::Reset, Some(CallerFault::Gone)),
                Outcome::Caller(CallerFault::Gone),
                Why::CallerGone,
            ),
            (
                "per-try timeout",
                PLAIN,
                Reply::PerTry,
                Outcome::Upstream(UpstreamFault::Timeout),
                Why::PerTry,
            ),
            (
                "the deadline",
                PLAIN,
                Reply::Deadline,
                Outcome::Deadline,
                Why::Deadline,
            ),
            (
                "a stalled upload",
                PLAIN,
                Reply::Stalled,
                Outcome::Caller(CallerFault::StalledBody),
                Why::Stalled,
            ),
        ];
        for (name, judge, reply, outcome, why) in rows {
            assert_eq!(classify(&judge, &reply), (outcome, why), "{name}");
        }
    }
}
