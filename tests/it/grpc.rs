//! gRPC through the binary, against a gRPC server over h2c (hyper, with
//! gRPC's framing and trailers): trailers-only UNAVAILABLE is retried on a
//! route that declares its calls idempotent and not on another;
//! INVALID_ARGUMENT never; a call whose message already went out never;
//! pushback is honoured; `grpc-timeout` bounds the attempts and is passed
//! on as the time left; the proxy's own errors reach the client as gRPC
//! statuses.

use crate::common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::process::Binary;
use common::*;
use http::{HeaderMap, Request, Response};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};

/// One gRPC message: uncompressed, length-prefixed.
fn message(payload: &[u8]) -> Bytes {
    let mut m = vec![0u8];
    m.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    m.extend_from_slice(payload);
    m.into()
}

/// A trailers-only answer: the status in the headers, nothing else.
fn trailers_only(status: u8, extra: &[(&'static str, &'static str)]) -> Response<Body> {
    let mut resp = Response::builder()
        .header("content-type", "application/grpc")
        .header("grpc-status", status.to_string());
    for (k, v) in extra {
        resp = resp.header(*k, *v);
    }
    resp.body(empty()).unwrap()
}

/// An answer with one message and then the status in trailers.
fn with_message(payload: &'static [u8], status: u8) -> Response<Body> {
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", status.to_string().parse().unwrap());
    let frames: Vec<Result<Frame<Bytes>, BoxError>> = vec![
        Ok(Frame::data(message(payload))),
        Ok(Frame::trailers(trailers)),
    ];
    Response::builder()
        .header("content-type", "application/grpc")
        .body(StreamBody::new(futures_util::stream::iter(frames)).boxed())
        .unwrap()
}

/// Calls by method path, and the `grpc-timeout` each call carried.
#[derive(Clone, Default)]
struct Calls {
    count: Arc<Mutex<HashMap<String, usize>>>,
    timeouts: Arc<Mutex<Vec<String>>>,
}

impl Calls {
    fn of(&self, path: &str) -> usize {
        self.count.lock().unwrap().get(path).copied().unwrap_or(0)
    }
}

/// The gRPC server: each method misbehaves in its own way.
async fn grpc_server(calls: Calls) -> Upstream {
    let flaky = Arc::new(AtomicUsize::new(0));
    upstream(move |req: Request<hyper::body::Incoming>| {
        let calls = calls.clone();
        let flaky = flaky.clone();
        async move {
            let path = req.uri().path().to_owned();
            *calls.count.lock().unwrap().entry(path.clone()).or_default() += 1;
            if let Some(t) = req.headers().get("grpc-timeout") {
                calls
                    .timeouts
                    .lock()
                    .unwrap()
                    .push(t.to_str().unwrap().to_owned());
            }
            let method = path.rsplit('/').next().unwrap_or("");
            match method {
                // UNAVAILABLE twice, then an answer.
                "Flaky" if flaky.fetch_add(1, Ordering::SeqCst) < 2 => trailers_only(14, &[]),
                "Flaky" => with_message(b"hello", 0),
                "Unavailable" => trailers_only(14, &[]),
                "Invalid" => trailers_only(3, &[]),
                // A server passing the caller's deadline on to its own backends.
                "Deadline" => trailers_only(4, &[]),
                // A message went out, then the call failed.
                "Streamed" => with_message(b"partial", 14),
                "NoPushback" => trailers_only(14, &[("grpc-retry-pushback-ms", "-1")]),
                "Pushback" => trailers_only(14, &[("grpc-retry-pushback-ms", "300")]),
                "Slow" => {
                    tokio::time::sleep(Duration::from_secs(10)).await;
                    with_message(b"late", 0)
                }
                _ => trailers_only(12, &[]),
            }
        }
    })
    .await
}

struct Answer {
    http: http::StatusCode,
    headers: HeaderMap,
    /// `grpc-status` from the trailers, or from the headers (trailers-only).
    status: Option<String>,
    body: Bytes,
}

async fn call(hg: &Binary, path: &str, extra: &[(&str, &str)]) -> Answer {
    let mut req = Request::post(format!("http://{}{path}", hg.listen))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    for (k, v) in extra {
        req = req.header(*k, *v);
    }
    let req = req.body(full(message(b"request"))).unwrap();
    let resp = h2c_client().request(req).await.expect("an answer");
    let (parts, body) = resp.into_parts();
    let collected = body.collect().await.expect("a whole body");
    let trailers = collected.trailers().cloned();
    let status = trailers
        .as_ref()
        .and_then(|t| t.get("grpc-status"))
        .or_else(|| parts.headers.get("grpc-status"))
        .map(|v| v.to_str().unwrap().to_owned());
    Answer {
        http: parts.status,
        headers: parts.headers,
        status,
        body: collected.to_bytes(),
    }
}

fn config(url: &str) -> String {
    format!(
        "[upstreams.grpc]\nendpoints = [\"{url}\"]\nhttp2 = true\n\
         [[routes]]\nname = \"idempotent\"\nupstream = \"grpc\"\n\
         match = {{ path_prefix = \"/safe.Svc/\" }}\n\
         retry = {{ idempotent = true, backoff = {{ base = \"1ms\", cap = \"2ms\" }} }}\n\
         [[routes]]\nname = \"plain\"\nupstream = \"grpc\"\n\
         match = {{ path_prefix = \"/plain.Svc/\" }}\n\
         retry = {{ backoff = {{ base = \"1ms\", cap = \"2ms\" }} }}\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_calls_are_judged_by_their_grpc_status() {
    let calls = Calls::default();
    let up = grpc_server(calls.clone()).await;
    let hg = Binary::start_with("explain = true", &config(&up.url())).await;

    // UNAVAILABLE, trailers-only, on a route of idempotent calls: retried
    // (the default retry_on has `unavailable`) until it answers.
    let a = call(&hg, "/safe.Svc/Flaky", &[]).await;
    assert_eq!(
        (a.http, a.status.as_deref()),
        (http::StatusCode::OK, Some("0"))
    );
    assert_eq!(&a.body[5..], b"hello");
    assert_eq!(a.headers["x-herdguard-attempts"], "3");
    assert_eq!(calls.of("/safe.Svc/Flaky"), 3);

    // The same on a route that does not declare its calls idempotent: a
    // gRPC call is a POST, so it is not repeated.
    let a = call(&hg, "/plain.Svc/Unavailable", &[]).await;
    assert_eq!(a.status.as_deref(), Some("14"));
    assert_eq!(calls.of("/plain.Svc/Unavailable"), 1);
    // ... unless the call carries an idempotency key.
    let a = call(&hg, "/plain.Svc/Unavailable", &[("idempotency-key", "k-1")]).await;
    assert_eq!(a.status.as_deref(), Some("14"));
    assert_eq!(calls.of("/plain.Svc/Unavailable"), 1 + 3);

    // INVALID_ARGUMENT: an answer, never retried.
    let a = call(&hg, "/safe.Svc/Invalid", &[]).await;
    assert_eq!(a.status.as_deref(), Some("3"));
    assert_eq!(calls.of("/safe.Svc/Invalid"), 1);

    // A message already went to the caller: the failure in the trailers
    // is passed on, never retried.
    let a = call(&hg, "/safe.Svc/Streamed", &[]).await;
    assert_eq!(a.status.as_deref(), Some("14"));
    assert_eq!(&a.body[5..], b"partial");
    assert_eq!(calls.of("/safe.Svc/Streamed"), 1);

    // Pushback: a negative value says do not retry; a delay is waited.
    let a = call(&hg, "/safe.Svc/NoPushback", &[]).await;
    assert_eq!(a.status.as_deref(), Some("14"));
    assert_eq!(calls.of("/safe.Svc/NoPushback"), 1);
    let a = call(&hg, "/safe.Svc/Pushback", &[("x-herdguard-explain", "1")]).await;
    assert_eq!(calls.of("/safe.Svc/Pushback"), 3);
    let trace = explained(&a.headers);
    // Each wait at least the pushback (jitter may add to it, never take).
    let waits: Vec<u64> = trace
        .split(';')
        .filter_map(|s| s.strip_prefix("backoff=")?.strip_suffix("ms")?.parse().ok())
        .collect();
    assert_eq!(waits.len(), 2, "{trace}");
    assert!(waits.iter().all(|w| (300..1000).contains(w)), "{trace}");
    assert!(trace.starts_with("1=grpc-error"), "{trace}");

    // No caller deadline: none is invented for the upstream (it would end
    // a long stream there; per_try_timeout bounds only the wait for headers).
    assert!(calls.timeouts.lock().unwrap().is_empty());

    // Retries are counted by the gRPC status.
    let metrics = hg.metrics().await;
    assert_eq!(
        metric(
            &metrics,
            "herdguard_retries_total{route=\"idempotent\",reason=\"grpc-unavailable\"}"
        ),
        Some(4.0),
        "{metrics}"
    );
    hg.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_timeout_bounds_the_call_and_proxy_errors_are_grpc_statuses() {
    let calls = Calls::default();
    let up = grpc_server(calls.clone()).await;
    let hg = Binary::start(&config(&up.url())).await;

    // The caller's 300 ms: DEADLINE_EXCEEDED long before the route's 10 s,
    // and the upstream was told the time left, not more.
    let a = call(&hg, "/safe.Svc/Slow", &[("grpc-timeout", "300m")]).await;
    assert_eq!(
        (a.http, a.status.as_deref()),
        (http::StatusCode::OK, Some("4")),
        "{:?}",
        a.headers
    );
    assert_eq!(a.headers["x-herdguard-error"], "timeout");
    assert!(a.headers.contains_key("grpc-message"));
    let told = std::mem::take(&mut *calls.timeouts.lock().unwrap());
    assert!(!told.is_empty());
    for t in &told {
        let ms: u64 = t
            .strip_suffix('m')
            .expect("in milliseconds")
            .parse()
            .unwrap();
        assert!((1..=300).contains(&ms), "{t}");
    }
    // A deadline already over: nothing is sent upstream.
    let before = calls.of("/safe.Svc/Slow");
    let a = call(&hg, "/safe.Svc/Slow", &[("grpc-timeout", "0m")]).await;
    assert_eq!(a.status.as_deref(), Some("4"));
    assert_eq!(a.headers["x-herdguard-attempts"], "0");
    assert_eq!(calls.of("/safe.Svc/Slow"), before, "never sent");

    // A long deadline is passed on as it is, not cut to per_try_timeout.
    let a = call(&hg, "/safe.Svc/Invalid", &[("grpc-timeout", "30S")]).await;
    assert_eq!(a.status.as_deref(), Some("3"));
    let told = std::mem::take(&mut *calls.timeouts.lock().unwrap());
    let ms: u64 = told[0].strip_suffix('m').unwrap().parse().unwrap();
    assert!((25_000..=30_000).contains(&ms), "{told:?}");

    // The caller's short deadline, passed on, runs out upstream: that is
    // the caller's doing, and never opens the breaker for the others.
    for _ in 0..8 {
        let a = call(&hg, "/safe.Svc/Deadline", &[("grpc-timeout", "100m")]).await;
        assert_eq!(a.status.as_deref(), Some("4"));
    }
    let a = call(&hg, "/safe.Svc/Invalid", &[]).await;
    assert_eq!(a.status.as_deref(), Some("3"), "served, not circuit-open");
    assert!(!a.headers.contains_key("x-herdguard-error"));

    // No route: UNIMPLEMENTED.
    let a = call(&hg, "/other.Svc/Call", &[]).await;
    assert_eq!(
        (a.http, a.status.as_deref()),
        (http::StatusCode::OK, Some("12"))
    );
    assert_eq!(a.headers["x-herdguard-error"], "no-route");
    assert_eq!(a.headers["content-type"], "application/grpc");

    // The breaker open: UNAVAILABLE, with when to come back.
    let open = Request::post(format!("http://{}/breakers/idempotent/open", hg.admin))
        .body(empty())
        .unwrap();
    assert_eq!(send(&client(), open).await.0, http::StatusCode::OK);
    let a = call(&hg, "/safe.Svc/Flaky", &[]).await;
    assert_eq!(
        (a.http, a.status.as_deref()),
        (http::StatusCode::OK, Some("14"))
    );
    assert_eq!(a.headers["x-herdguard-error"], "circuit-open");
    assert!(a.body.is_empty(), "trailers-only");
    // A call that is not gRPC still gets the plain HTTP error.
    let plain = Request::post(format!("http://{}/safe.Svc/Flaky", hg.listen))
        .body(empty())
        .unwrap();
    assert_eq!(
        send(&client(), plain).await.0,
        http::StatusCode::SERVICE_UNAVAILABLE
    );
    hg.terminate().await;
}

/// Malformed gRPC headers from a caller or an upstream change nothing for
/// the worse: a bad `grpc-timeout` is no timeout; a bad `grpc-status` is
/// passed on as it is, and counted as the broken answer it is (INTERNAL,
/// the upstream's failure), never as a success.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_grpc_headers_are_ignored() {
    let up = upstream(|_req| async move {
        Response::builder()
            .header("content-type", "application/grpc")
            .header("grpc-status", "fourteen")
            .body(empty())
            .unwrap()
    })
    .await;
    let hg = Binary::start(&config(&up.url())).await;
    for timeout in ["", "-1m", "999999999m", "1x", "1.5S"] {
        let a = call(&hg, "/safe.Svc/Any", &[("grpc-timeout", timeout)]).await;
        assert_eq!(a.http, http::StatusCode::OK, "{timeout:?}");
        assert_eq!(
            a.status.as_deref(),
            Some("fourteen"),
            "passed on as it came"
        );
        assert_eq!(a.headers["x-herdguard-attempts"], "1", "not retried");
    }
    let failed = hg
        .metric(r#"herdguard_upstream_attempts_total{route="idempotent",upstream="grpc",outcome="grpc-error"}"#)
        .await;
    assert_eq!(failed, 5.0, "a broken status is no success");
    hg.terminate().await;
}

/// `retry.idempotent = true` repeats every request a route takes: `check`
/// warns when that route matches no method or path, or when it is a default.
#[test]
fn check_warns_about_idempotent_on_a_broad_route() {
    let upstream = "[upstreams.u]\nendpoints = [\"http://127.0.0.1:3000\"]\n";
    let warnings = |routes: &str| {
        herdguard::config::Config::check_str(&format!("{upstream}{routes}"))
            .unwrap()
            .warnings
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
    };
    let broad =
        warnings("[[routes]]\nname = \"r\"\nupstream = \"u\"\nretry = { idempotent = true }\n");
    assert!(
        broad
            .iter()
            .any(|w| w.starts_with("routes[0].retry.idempotent (line 6)")),
        "{broad:?}"
    );
    let narrow = warnings(
        "[[routes]]\nname = \"r\"\nupstream = \"u\"\nmatch = { path_prefix = \"/pkg.Svc/\" }\nretry = { idempotent = true }\n",
    );
    assert!(narrow.is_empty(), "{narrow:?}");
    let default = warnings(
        "[defaults.retry]\nidempotent = true\n[[routes]]\nname = \"r\"\nupstream = \"u\"\nmatch = { path_prefix = \"/a/\" }\n",
    );
    assert!(
        default
            .iter()
            .any(|w| w.starts_with("defaults.retry.idempotent")),
        "{default:?}"
    );
}

/// An HTTP/1.1 caller that accepts trailers gets a gRPC call's status,
/// which an HTTP/2 upstream sends in trailers it never declares (HTTP/1.1
/// passes on only declared trailers): the proxy declares gRPC's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http1_caller_gets_the_grpc_status_trailers() {
    let calls = Calls::default();
    let up = grpc_server(calls.clone()).await;
    let hg = Binary::start(&config(&up.url())).await;
    let mut request = b"POST /safe.Svc/Streamed HTTP/1.1\r\nHost: x\r\nTE: trailers\r\n\
        content-type: application/grpc\r\ncontent-length: 12\r\nConnection: close\r\n\r\n"
        .to_vec();
    request.extend_from_slice(&message(b"request"));
    let out = raw_exchange(hg.listen.as_str(), &request).await;
    let lower = out.to_lowercase();
    assert!(lower.starts_with("http/1.1 200"), "{out}");
    assert!(
        lower.contains("\r\ntrailer: grpc-status, grpc-message, grpc-status-details-bin\r\n"),
        "{out}"
    );
    assert!(lower.ends_with("0\r\ngrpc-status: 14\r\n\r\n"), "{out:?}");
    hg.terminate().await;
}
