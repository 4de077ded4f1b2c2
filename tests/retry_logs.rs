//! Retries and skipped retries are logged with their reasons. Alone in its
//! own test binary, outside `tests/it`: it installs a log subscriber for its
//! thread, and tracing's per-callsite interest cache must not race with other
//! tests' threads.

#[path = "it/common/mod.rs"]
mod common;

use std::sync::{Arc, Mutex};

use common::scripted::*;
use common::*;
use http::Request;

/// Captures the proxy's log lines: a current-thread test runtime runs every
/// task on this thread, so a thread-local subscriber sees them all.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn every_retry_and_skipped_retry_is_logged_with_its_reason() {
    let logs = Logs::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let up = scripted(&[
        Act::Status(503),
        Act::Status(503),
        Act::Status(503),
        Act::StatusRetryAfter(503, "600".into()),
    ])
    .await;
    let server = proxy_with(&[up.upstream.url()], "attempts = 2").await;
    // Retried once, then attempts exhausted: its lines name its id and trace.
    let first = Request::get("/")
        .header("x-request-id", "first-call")
        .header("traceparent", format!("00-{TRACE}-00f067aa0ba902b7-01"));
    call(&server, first, empty()).await;
    // Non-idempotent: an id is made for it.
    let (_, _, _) = call(&server, Request::post("/"), full("x")).await;
    call(&server, Request::get("/"), empty()).await; // Retry-After too long

    let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let has = |needle: &[&str]| lines.iter().any(|l| needle.iter().all(|n| l.contains(n)));
    assert!(
        has(&[
            "request{request_id=\"first-call\" trace_id=",
            TRACE,
            "retrying",
            "route=r",
            "retry.attempt=2",
            "delay_ms=",
            "cause=\"503\""
        ]),
        "{text}"
    );
    for reason in [
        "attempts_exhausted",
        "non_idempotent",
        "retry_after_too_long",
    ] {
        assert!(
            has(&["retry skipped", "route=r", &format!("reason=\"{reason}\"")]),
            "{reason} not logged:\n{text}"
        );
    }
    // Every line about a request names it: the POST's id was made here.
    let post = lines.iter().find(|l| l.contains("non_idempotent")).unwrap();
    let made = post
        .split("request_id=\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .unwrap_or_else(|| panic!("no request id in {post}"));
    assert_eq!(made.len(), 36, "a UUID: {post}");
}

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
