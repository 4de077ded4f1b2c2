//! Tracing with OpenTelemetry, through the binary, against an OTLP/HTTP
//! receiver the test starts: a request retried twice is one trace with
//! three attempt spans under the request's span, each upstream request
//! carrying its own attempt's span id, and the retry log lines carry the
//! request's id and trace id.

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::process::Binary;
use common::*;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt as _;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message as _;

/// An OTLP/HTTP receiver: every span posted to `/v1/traces`.
async fn receiver() -> (Upstream, Arc<Mutex<Vec<Span>>>) {
    let spans = Arc::new(Mutex::new(Vec::new()));
    let kept = spans.clone();
    let up = upstream(move |req: Request<hyper::body::Incoming>| {
        let kept = kept.clone();
        async move {
            assert_eq!(req.uri().path(), "/v1/traces");
            assert_eq!(req.headers()["content-type"], "application/x-protobuf");
            let body = req.into_body().collect().await.unwrap().to_bytes();
            let export = ExportTraceServiceRequest::decode(body).expect("OTLP protobuf");
            for resource in export.resource_spans {
                for scope in resource.scope_spans {
                    kept.lock().unwrap().extend(scope.spans);
                }
            }
            Response::builder()
                .header("content-type", "application/x-protobuf")
                .body(empty())
                .unwrap()
        }
    })
    .await;
    (up, spans)
}

fn attribute<'a>(span: &'a Span, key: &str) -> Option<&'a Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref()?.value.as_ref())
}

fn int(span: &Span, key: &str) -> Option<i64> {
    match attribute(span, key)? {
        Value::IntValue(v) => Some(*v),
        _ => None,
    }
}

fn text<'a>(span: &'a Span, key: &str) -> Option<&'a str> {
    match attribute(span, key)? {
        Value::StringValue(v) => Some(v),
        _ => None,
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_retried_twice_is_one_trace_with_three_attempt_spans() {
    let (collector, spans) = receiver().await;
    // 503, 503, then 200; each traceparent the upstream got is kept.
    let parents = Arc::new(Mutex::new(Vec::new()));
    let up = {
        let parents = parents.clone();
        upstream(move |req: Request<hyper::body::Incoming>| {
            let parents = parents.clone();
            async move {
                let mut seen = parents.lock().unwrap();
                seen.push(req.headers()["traceparent"].to_str().unwrap().to_owned());
                let status = if seen.len() < 3 { 503 } else { 200 };
                Response::builder().status(status).body(full("x")).unwrap()
            }
        })
        .await
    };
    let toml = format!(
        "[tracing]\notlp_endpoint = \"{}\"\nservice_name = \"checkout-sidecar\"\n\
         [upstreams.api]\nendpoints = [\"{}\"]\n\
         [[routes]]\nname = \"api\"\nupstream = \"api\"\n\
         retry = {{ attempts = 3, backoff = {{ base = \"5ms\", cap = \"10ms\" }} }}\n",
        collector.url(),
        up.url()
    );
    let hg = Binary::start_adjusted("", &toml, |cmd| {
        cmd.env("RUST_LOG", "info,herdguard::retry=debug");
    })
    .await;
    let req = Request::get(format!("http://{}/pay", hg.listen))
        .header("traceparent", format!("00-{TRACE}-{CALLER_SPAN}-01"))
        .header("x-request-id", "pay-42")
        .body(empty())
        .unwrap();
    let (status, headers, _) = send(&client(), req).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["x-herdguard-attempts"], "3");

    // Each attempt went with its own span id, in the caller's trace.
    let sent: Vec<(String, String)> = parents
        .lock()
        .unwrap()
        .iter()
        .map(|p| {
            let parts: Vec<&str> = p.split('-').collect();
            assert_eq!(parts.len(), 4, "{p}");
            assert_eq!(parts[1], TRACE, "the caller's trace: {p}");
            assert_eq!(parts[3], "01", "sampled: {p}");
            (parts[2].to_owned(), p.clone())
        })
        .collect();
    assert_eq!(sent.len(), 3);
    let ids: std::collections::HashSet<&str> = sent.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(ids.len(), 3, "a span id per attempt: {sent:?}");
    assert!(!ids.contains(CALLER_SPAN), "never the caller's own span");

    // Ended: the last spans are sent before the process exits.
    let logged = hg.terminate().await;
    let spans = spans.lock().unwrap().clone();
    assert_eq!(
        spans.len(),
        4,
        "a request span and three attempts: {spans:#?}"
    );
    let request = spans
        .iter()
        .find(|s| hex(&s.parent_span_id) == CALLER_SPAN)
        .expect("the request's span, a child of the caller's");
    assert_eq!(hex(&request.trace_id), TRACE);
    assert_eq!(int(request, "http.response.status_code"), Some(200));
    assert_eq!(int(request, "herdguard.attempts"), Some(3));
    let mut attempts: Vec<&Span> = spans
        .iter()
        .filter(|s| s.parent_span_id == request.span_id)
        .collect();
    attempts.sort_by_key(|s| int(s, "herdguard.attempt"));
    assert_eq!(attempts.len(), 3);
    for (i, (attempt, (sent_id, _))) in attempts.iter().zip(&sent).enumerate() {
        let n = i as i64 + 1;
        assert_eq!(int(attempt, "herdguard.attempt"), Some(n));
        assert_eq!(hex(&attempt.trace_id), TRACE);
        assert_eq!(
            &hex(&attempt.span_id),
            sent_id,
            "attempt {n}'s id went upstream"
        );
        assert_eq!(text(attempt, "server.address"), Some(up.url().as_str()));
        let (outcome, status) = if n < 3 { ("5xx", 503) } else { ("ok", 200) };
        assert_eq!(text(attempt, "herdguard.outcome"), Some(outcome));
        assert_eq!(int(attempt, "http.response.status_code"), Some(status));
        assert_eq!(
            int(attempt, "herdguard.backoff_ms").is_some(),
            n > 1,
            "a retry's backoff"
        );
        assert!(attempt.start_time_unix_nano >= request.start_time_unix_nano);
        assert!(attempt.end_time_unix_nano <= request.end_time_unix_nano);
    }

    // The retry lines name the request and its trace.
    let retrying: Vec<&String> = logged.iter().filter(|l| l.contains("retrying")).collect();
    assert_eq!(retrying.len(), 2, "{logged:#?}");
    for line in retrying {
        assert!(line.contains("\"request_id\":\"pay-42\""), "{line}");
        assert!(
            line.contains(&format!("\"trace_id\":\"{TRACE}\"")),
            "{line}"
        );
    }
}

/// A request with no `traceparent` starts a trace; with `sample_ratio = 0`
/// nothing is exported, yet each attempt still sends a context of its
/// own, unsampled, and a caller's sampled flag is followed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traces_start_here_and_the_sample_ratio_is_kept() {
    let (collector, spans) = receiver().await;
    let up = echo_upstream().await;
    let config = |ratio: &str| {
        format!(
            "[tracing]\notlp_endpoint = \"{}\"\nsample_ratio = {ratio}\n\
             [upstreams.api]\nendpoints = [\"{}\"]\n[[routes]]\nname = \"api\"\nupstream = \"api\"\n",
            collector.url(),
            up.url()
        )
    };
    let hg = Binary::start(&config("1.0")).await;
    let (status, _, _) = get_via(&hg, None).await;
    assert_eq!(status, StatusCode::OK);
    let started = up.last().headers["traceparent"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(
        started.starts_with("00-") && started.ends_with("-01"),
        "{started}"
    );
    hg.terminate().await;
    let exported = spans.lock().unwrap().len();
    assert_eq!(exported, 2, "a new trace: its request and its attempt");

    let hg = Binary::start(&config("0.0")).await;
    get_via(&hg, None).await;
    let unsampled = up.last().headers["traceparent"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(unsampled.ends_with("-00"), "not sampled: {unsampled}");
    // The caller's sampled flag wins over the ratio.
    get_via(&hg, Some(&format!("00-{TRACE}-{CALLER_SPAN}-01"))).await;
    let followed = up.last().headers["traceparent"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(
        followed.contains(TRACE) && followed.ends_with("-01"),
        "{followed}"
    );
    hg.terminate().await;
    let spans = spans.lock().unwrap();
    assert_eq!(spans.len(), exported + 2, "only the caller's sampled trace");
}

async fn get_via(
    hg: &Binary,
    traceparent: Option<&str>,
) -> (StatusCode, http::HeaderMap, bytes::Bytes) {
    let mut req = Request::get(format!("http://{}/", hg.listen));
    if let Some(tp) = traceparent {
        req = req.header("traceparent", tp);
    }
    send(&client(), req.body(empty()).unwrap()).await
}

/// A collector that does not answer slows no request: spans wait in a
/// bounded queue and are dropped past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_collector_slows_nothing() {
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dead = silent.local_addr().unwrap();
    let up = ok_upstream("fine").await;
    let hg = Binary::start(&format!(
        "[tracing]\notlp_endpoint = \"http://{dead}\"\n\
         [upstreams.api]\nendpoints = [\"{}\"]\n[[routes]]\nname = \"api\"\nupstream = \"api\"\n",
        up.url()
    ))
    .await;
    // Two spans a request: past 2,048 waiting (and a batch stuck in its
    // export), spans are dropped and counted.
    for _ in 0..1_600 {
        // Bounded only so that a request stuck behind the export fails
        // the test rather than hanging it.
        let answered = tokio::time::timeout(Duration::from_secs(10), get_via(&hg, None)).await;
        assert_eq!(answered.expect("answered").0, StatusCode::OK);
    }
    let dropped = hg.metric("herdguard_trace_spans_dropped_total").await;
    assert!(dropped >= 1.0, "dropped {dropped}");
    drop(silent);
    hg.terminate().await;
}

/// What a caller sends cannot make spans large: a method no one registered
/// is `_OTHER`, and a `tracestate` past 512 bytes is not carried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callers_huge_method_or_tracestate_stays_out_of_spans() {
    let (collector, spans) = receiver().await;
    let up = echo_upstream().await;
    let hg = Binary::start(&format!(
        "[tracing]\notlp_endpoint = \"{}\"\n\
         [upstreams.api]\nendpoints = [\"{}\"]\n[[routes]]\nname = \"api\"\nupstream = \"api\"\n",
        collector.url(),
        up.url()
    ))
    .await;
    let method = "M".repeat(20_000);
    let state = format!("k={}", "v".repeat(2_000));
    let req = Request::builder()
        .method(method.as_str())
        .uri(format!("http://{}/", hg.listen))
        .header("traceparent", format!("00-{TRACE}-{CALLER_SPAN}-01"))
        .header("tracestate", &state)
        .body(empty())
        .unwrap();
    send(&client(), req).await;
    let sent = up.last().headers;
    assert!(
        sent["traceparent"].to_str().unwrap().contains(TRACE),
        "joined"
    );
    assert!(
        sent.get("tracestate").is_none_or(|v| v.len() < 512),
        "the long tracestate is not passed on"
    );
    // Split over many fields, each short: the same, once joined.
    let mut req = Request::get(format!("http://{}/", hg.listen))
        .header("traceparent", format!("00-{TRACE}-{CALLER_SPAN}-01"));
    for i in 0..40 {
        req = req.header("tracestate", format!("k{i}={}", "v".repeat(40)));
    }
    send(&client(), req.body(empty()).unwrap()).await;
    let sent = up.last().headers;
    assert!(
        sent.get("tracestate").is_none(),
        "{:?}",
        sent.get_all("tracestate")
    );
    // Two `traceparent` fields are no valid one: a new trace.
    let req = Request::get(format!("http://{}/", hg.listen))
        .header("traceparent", format!("00-{TRACE}-{CALLER_SPAN}-01"))
        .header("traceparent", format!("00-{TRACE}-{CALLER_SPAN}-01"))
        .body(empty())
        .unwrap();
    send(&client(), req).await;
    let sent = up.last().headers;
    assert!(
        !sent["traceparent"].to_str().unwrap().contains(TRACE),
        "a new trace"
    );
    hg.terminate().await;
    let spans = spans.lock().unwrap();
    assert_eq!(spans.len(), 6);
    // The first request's span: its method was the caller's own.
    let request = spans.iter().find(|s| s.kind == 2).expect("a server span");
    assert_eq!(request.name, "_OTHER");
    assert_eq!(text(request, "http.request.method"), Some("_OTHER"));
    for span in spans.iter() {
        assert!(span.trace_state.len() < 512, "{}", span.trace_state.len());
    }
}

/// An OTLP endpoint that is not a plain `http(s)://host[:port][/path]` is
/// refused with its key, credentials masked.
#[test]
fn an_otlp_endpoint_with_credentials_a_query_or_a_bad_port_is_refused() {
    for (endpoint, says) in [
        ("http://user:secret@collector:4318", "credentials"),
        ("http://collector:4318/?x=1", "query"),
        ("http://collector:4318/#f", "fragment"),
        ("http://collector:99999", "port"),
        ("http://collector:0", "port"),
        ("collector:4318", "http://"),
        ("ftp://collector", "http://"),
    ] {
        let err = herdguard::config::Config::parse(&format!(
            "[tracing]\notlp_endpoint = \"{endpoint}\"\n"
        ))
        .unwrap_err()
        .to_string();
        assert!(err.contains("tracing.otlp_endpoint"), "{endpoint}: {err}");
        assert!(err.contains(says), "{endpoint}: {err}");
        assert!(!err.contains("secret"), "{endpoint}: {err}");
    }
    for fine in [
        "http://collector:4318",
        "https://collector",
        "http://[::1]:4318/otlp",
    ] {
        herdguard::config::Config::parse(&format!("[tracing]\notlp_endpoint = \"{fine}\"\n"))
            .unwrap_or_else(|e| panic!("{fine}: {e}"));
    }
}

/// A collector that answers 500 loses every span it is sent: they are
/// counted, and the log says so (once a minute at most, not per export).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_a_failing_collector_loses_are_counted_and_told() {
    let refusing = upstream(|_req: Request<hyper::body::Incoming>| async {
        let mut resp = Response::new(full("no"));
        *resp.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
        resp
    })
    .await;
    let up = ok_upstream("fine").await;
    let hg = Binary::start(&format!(
        "[tracing]\notlp_endpoint = \"{}\"\n\
         [upstreams.api]\nendpoints = [\"{}\"]\n[[routes]]\nname = \"api\"\nupstream = \"api\"\n",
        refusing.url(),
        up.url()
    ))
    .await;
    for _ in 0..20 {
        assert_eq!(get_via(&hg, None).await.0, StatusCode::OK);
    }
    eventually(
        Duration::from_secs(10),
        "the lost spans counted",
        || async { hg.metric("herdguard_trace_spans_failed_total").await >= 40.0 },
    )
    .await;
    let lines = hg.terminate().await;
    let told: Vec<&String> = lines
        .iter()
        .filter(|l| l.contains("spans could not be exported"))
        .collect();
    assert_eq!(told.len(), 1, "{told:?}");
    assert!(told[0].contains("500"), "{}", told[0]);
}
