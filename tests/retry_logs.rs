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
    call(&server, Request::get("/"), empty()).await; // retried once, then attempts exhausted
    call(&server, Request::post("/"), full("x")).await; // non-idempotent
    call(&server, Request::get("/"), empty()).await; // Retry-After too long

    let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let has = |needle: &[&str]| lines.iter().any(|l| needle.iter().all(|n| l.contains(n)));
    assert!(
        has(&[
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
}
