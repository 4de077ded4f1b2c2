//! Responses the proxy makes itself. Each carries `x-herdguard-error` with a
//! machine-readable reason and a short text body for people.

use std::time::Duration;

use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderValue, Response, StatusCode};
use rand::Rng;

use crate::policy::{CallerFault, Outcome, Refusal, UpstreamFault};

use super::headers::X_HERDGUARD_ERROR;
use super::ResponseBody;
use crate::policy::GrpcStatus;

/// Why the proxy answered instead of the upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalError {
    /// No route matches the request (404).
    NoRoute,
    /// The request is malformed: its Host is missing, repeated or invalid (400).
    BadRequest,
    /// A method the proxy does not forward: `CONNECT` (405).
    NotProxied,
    /// A request the proxy cannot forward faithfully: a transfer coding other than chunked (501).
    NotImplemented,
    /// No connection to the upstream could be made (502).
    ConnectFailure,
    /// The connection failed after the request was sent (502).
    Reset,
    /// The upstream's response broke HTTP (502).
    BadResponse,
    /// No response headers in time (504).
    Timeout,
    /// The upstream is at its in-flight limit (503).
    Overloaded,
    /// The route's circuit breaker is open (503).
    CircuitOpen,
    /// The request body is larger than the proxy will take (413).
    BodyTooLarge,
    /// The caller did not send its whole body before the request's timeout (408).
    RequestTimeout,
}

impl LocalError {
    pub fn status(self) -> StatusCode {
        match self {
            LocalError::NoRoute => StatusCode::NOT_FOUND,
            LocalError::BadRequest => StatusCode::BAD_REQUEST,
            LocalError::NotProxied => StatusCode::METHOD_NOT_ALLOWED,
            LocalError::NotImplemented => StatusCode::NOT_IMPLEMENTED,
            LocalError::ConnectFailure | LocalError::Reset | LocalError::BadResponse => {
                StatusCode::BAD_GATEWAY
            }
            LocalError::Timeout => StatusCode::GATEWAY_TIMEOUT,
            LocalError::Overloaded | LocalError::CircuitOpen => StatusCode::SERVICE_UNAVAILABLE,
            LocalError::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            LocalError::RequestTimeout => StatusCode::REQUEST_TIMEOUT,
        }
    }

    /// The `x-herdguard-error` value.
    pub fn as_str(self) -> &'static str {
        match self {
            LocalError::NoRoute => "no-route",
            LocalError::BadRequest | LocalError::NotProxied | LocalError::NotImplemented => {
                "bad-request"
            }
            LocalError::ConnectFailure => "connect-failure",
            LocalError::Reset => "reset",
            LocalError::BadResponse => "bad-response",
            LocalError::Timeout => "timeout",
            LocalError::Overloaded => "overloaded",
            LocalError::CircuitOpen => "circuit-open",
            LocalError::BodyTooLarge => "body-too-large",
            LocalError::RequestTimeout => "request-timeout",
        }
    }

    /// The proxy's answer when a request ended in `outcome` without a
    /// response to pass on: the one mapping from an outcome to the caller's
    /// status. A caller's own fault gets a 4xx; the upstream's a 5xx.
    pub fn for_outcome(outcome: Outcome) -> Self {
        match outcome {
            Outcome::Upstream(UpstreamFault::ConnectFailure) => LocalError::ConnectFailure,
            Outcome::Upstream(
                UpstreamFault::Reset
                | UpstreamFault::RefusedStream
                | UpstreamFault::StaleConnection,
            ) => LocalError::Reset,
            Outcome::Upstream(UpstreamFault::Timeout) | Outcome::Deadline => LocalError::Timeout,
            Outcome::Upstream(UpstreamFault::BadResponse) => LocalError::BadResponse,
            Outcome::Caller(CallerFault::MalformedBody | CallerFault::Gone) => {
                LocalError::BadRequest
            }
            Outcome::Caller(CallerFault::StalledBody) => LocalError::RequestTimeout,
            Outcome::Refused(Refusal::CircuitOpen) => LocalError::CircuitOpen,
            Outcome::Refused(Refusal::Overloaded) => LocalError::Overloaded,
            // Not an end without a response; the nearest honest answer.
            Outcome::Response(_) | Outcome::Grpc(_) | Outcome::Superseded => LocalError::Reset,
        }
    }

    /// The response, with `detail` as the first line of its body.
    pub fn response(self, detail: &str) -> Response<ResponseBody> {
        self.response_with(detail, None)
    }

    /// The response, telling the caller when to come back when `retry_after` is known.
    pub fn response_with(
        self,
        detail: &str,
        retry_after: Option<Duration>,
    ) -> Response<ResponseBody> {
        let mut resp = Response::new(ResponseBody::local(format!("herdguard: {detail}\n")));
        *resp.status_mut() = self.status();
        let h = resp.headers_mut();
        h.insert(&X_HERDGUARD_ERROR, HeaderValue::from_static(self.as_str()));
        h.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        if let Some(after) = retry_after {
            // Whole seconds, rounded up: never sooner than asked.
            let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
            h.insert(RETRY_AFTER, HeaderValue::from(secs.max(1)));
        } else if matches!(self, LocalError::Overloaded | LocalError::CircuitOpen) {
            // Jittered, so that callers told to come back do not come back together.
            let secs: u32 = rand::rng().random_range(1..=3);
            h.insert(RETRY_AFTER, HeaderValue::from(secs));
        }
        resp
    }
}

/// The answer to a request a route's `fault.abort` picked: never forwarded.
pub fn fault_response(status: u16) -> Response<ResponseBody> {
    let mut resp = Response::new(ResponseBody::local(
        "herdguard: fault injected by the route's config\n",
    ));
    *resp.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
    let h = resp.headers_mut();
    h.insert(
        &super::headers::X_HERDGUARD_FAULT,
        HeaderValue::from_static("abort"),
    );
    h.insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp
}

/// A proxy-made answer to a gRPC call, as a gRPC client reads one: HTTP 200,
/// trailers-only, its `grpc-status` and `grpc-message` in the headers
/// (`x-herdguard-error` and `retry-after` kept). An answer the upstream
/// made is passed on as it is.
pub fn grpc_shaped(resp: Response<ResponseBody>) -> Response<ResponseBody> {
    let Some(kind) = resp.headers().get(&X_HERDGUARD_ERROR) else {
        return resp;
    };
    let status = match kind.as_bytes() {
        b"no-route" => GrpcStatus::UNIMPLEMENTED,
        b"timeout" => GrpcStatus::DEADLINE_EXCEEDED,
        b"body-too-large" => GrpcStatus::RESOURCE_EXHAUSTED,
        b"bad-request" | b"request-timeout" => GrpcStatus::INTERNAL,
        // circuit-open, overloaded, connect-failure, reset, bad-response:
        // the call may be tried again later, or elsewhere.
        _ => GrpcStatus::UNAVAILABLE,
    };
    let message = format!(
        "herdguard: {} (HTTP {})",
        kind.to_str().unwrap_or("error"),
        resp.status().as_u16()
    );
    let (mut parts, _) = resp.into_parts();
    parts.status = StatusCode::OK;
    let h = &mut parts.headers;
    h.remove(http::header::CONTENT_LENGTH);
    h.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    h.insert("grpc-status", HeaderValue::from(u16::from(status.code())));
    // Printable ASCII with no `%`: nothing to percent-encode.
    if let Ok(message) = HeaderValue::from_str(&message) {
        h.insert("grpc-message", message);
    }
    Response::from_parts(parts, ResponseBody::local(bytes::Bytes::new()))
}
/// The answer to an `OPTIONS` or `TRACE` with `Max-Forwards: 0`: this hop is
/// its final recipient, and answers itself. `OPTIONS` gets the methods the
/// proxy forwards; `TRACE` its own request head back as `message/http`,
/// without the fields that carry credentials.
pub fn max_forwards_reached<B>(req: &http::Request<B>) -> Option<http::Response<ResponseBody>> {
    if crate::wire::headers::max_forwards(req.method(), req.headers())? != 0 {
        return None;
    }
    let mut resp = if req.method() == http::Method::TRACE {
        let mut echo = format!("TRACE {} {:?}\r\n", req.uri(), req.version()).into_bytes();
        for (name, value) in req.headers() {
            if [
                http::header::AUTHORIZATION,
                http::header::COOKIE,
                http::header::PROXY_AUTHORIZATION,
            ]
            .contains(name)
            {
                continue;
            }
            echo.extend_from_slice(name.as_str().as_bytes());
            echo.extend_from_slice(b": ");
            echo.extend_from_slice(value.as_bytes());
            echo.extend_from_slice(b"\r\n");
        }
        let mut resp = http::Response::new(ResponseBody::local(echo));
        resp.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("message/http"),
        );
        resp
    } else {
        let mut resp = http::Response::new(ResponseBody::local(bytes::Bytes::new()));
        resp.headers_mut().insert(
            http::header::ALLOW,
            http::HeaderValue::from_static("GET, HEAD, POST, PUT, DELETE, PATCH, OPTIONS, TRACE"),
        );
        resp
    };
    crate::wire::headers::add_via(resp.headers_mut(), http::Version::HTTP_11);
    Some(resp)
}
