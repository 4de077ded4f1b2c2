//! Retries through the real proxy, against a scripted upstream that counts
//! what it saw.

use crate::common;

use std::time::Duration;

use bytes::Bytes;
use common::scripted::*;
use common::*;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;

async fn metrics(server: &herdguard::app::Server) -> String {
    admin(server, "/metrics").await.1
}

fn skipped(text: &str, reason: &str) -> f64 {
    metric(
        text,
        &format!("herdguard_retries_skipped_total{{route=\"r\",reason=\"{reason}\"}}"),
    )
    .unwrap_or(0.0)
}

#[tokio::test]
async fn get_is_retried_to_success() {
    let up = scripted(&[Act::Status(503), Act::Status(502)]).await;
    let server = proxy_with(&[up.upstream.url()], "attempts = 3").await;
    let (status, headers, body) = call(&server, Request::get("/"), empty()).await;
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"ok"[..]));
    assert_eq!(headers["x-herdguard-attempts"], "3");
    let attempts: Vec<_> = up.hits().into_iter().map(|h| h.attempt.unwrap()).collect();
    assert_eq!(attempts, ["1", "2", "3"]);
    let text = metrics(&server).await;
    assert_eq!(
        metric(&text, "herdguard_retries_total{route=\"r\",reason=\"503\"}"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        metric(&text, "herdguard_retries_total{route=\"r\",reason=\"502\"}"),
        Some(1.0)
    );
    assert_eq!(
        metric(
            &text,
            "herdguard_upstream_attempts_total{route=\"r\",upstream=\"u\",outcome=\"5xx\"}"
        ),
        Some(2.0)
    );
    assert_eq!(
        metric(
            &text,
            "herdguard_upstream_attempts_total{route=\"r\",upstream=\"u\",outcome=\"ok\"}"
        ),
        Some(1.0)
    );
    assert_eq!(
        metric(&text, "herdguard_backoff_seconds_count{route=\"r\"}"),
        Some(2.0)
    );
    assert_eq!(
        metric(
            &text,
            "herdguard_requests_total{route=\"r\",code=\"200\",source=\"upstream\"}"
        ),
        Some(1.0)
    );
}

#[tokio::test]
async fn gives_up_after_attempts() {
    let up = scripted(&vec![Act::Status(503); 5]).await;
    let server = proxy_with(&[up.upstream.url()], "attempts = 3").await;
    let (status, headers, _) = call(&server, Request::get("/"), empty()).await;
    assert_eq!(
        status,
        StatusCode::SERVICE_UNAVAILABLE,
        "the last upstream answer is passed on"
    );
    assert_eq!(headers["x-herdguard-attempts"], "3");
    assert!(!headers.contains_key("x-herdguard-error"));
    assert_eq!(up.hits().len(), 3);
    assert_eq!(skipped(&metrics(&server).await, "attempts_exhausted"), 1.0);
}

#[tokio::test]
async fn post_is_retried_only_with_an_idempotency_key() {
    let up = scripted(&[Act::Status(503), Act::Status(503)]).await;
    let server = proxy_with(&[up.upstream.url()], "attempts = 3").await;
    let (status, headers, _) = call(&server, Request::post("/"), full("order-1")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers["x-herdguard-attempts"], "1");
    assert_eq!(up.hits().len(), 1);
    assert_eq!(skipped(&metrics(&server).await, "non_idempotent"), 1.0);

    let (status, headers, _) = call(
        &server,
        Request::post("/").header("idempotency-key", "k-1"),
        full("order-2"),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["x-herdguard-attempts"], "2");
    let hits = up.hits();
    assert_eq!(hits.len(), 3);
    assert_eq!(
        (&hits[1].body[..], &hits[2].body[..]),
        (&b"order-2"[..], &b"order-2"[..]),
        "the body is replayed"
    );
}

#[tokio::test]
async fn a_key_that_promises_nothing_does_not_make_a_post_retryable() {
    let cases: [(&str, &[(&str, &str)]); 3] = [
        ("a list of keys", &[("idempotency-key", "a, b")]),
        (
            "a key named in Proxy-Connection (this hop's only)",
            &[
                ("idempotency-key", "k"),
                ("proxy-connection", "idempotency-key"),
            ],
        ),
        (
            "a key declared for the trailer section",
            &[("idempotency-key", "k"), ("trailer", "idempotency-key")],
        ),
    ];
    for (what, fields) in cases {
        let up = scripted(&[Act::Status(503), Act::Status(503)]).await;
        let server = proxy_with(&[up.upstream.url()], "attempts = 3").await;
        let mut req = Request::post("/");
        for (name, value) in fields {
            req = req.header(*name, *value);
        }
        let (status, headers, _) = call(&server, req, full("order")).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{what}");
        assert_eq!(headers["x-herdguard-attempts"], "1", "{what}");
        assert_eq!(up.hits().len(), 1, "{what}: sent once");
    }
}

#[tokio::test]
async fn post_after_a_refused_connection_is_retried_without_duplicates() {
    let up = scripted(&[]).await;
    let refused = format!("http://{}", closed_port().await);
    let server = proxy_with(&[refused, up.upstream.url()], "attempts = 2").await;
    let mut retried = 0;
    for i in 0..4 {
        let body = format!("payment-{i}");
        let (status, headers, _) = call(&server, Request::post("/"), full(body)).await;
        assert_eq!(status, StatusCode::OK);
        if headers["x-herdguard-attempts"] == "2" {
            retried += 1;
        }
    }
    let bodies: Vec<Bytes> = up.hits().into_iter().map(|h| h.body).collect();
    assert_eq!(
        bodies,
        ["payment-0", "payment-1", "payment-2", "payment-3"],
        "each POST reached the upstream once"
    );
    assert_eq!(
        retried, 2,
        "round robin sent every other first attempt to the refused endpoint"
    );
    let text = metrics(&server).await;
    assert_eq!(
        metric(
            &text,
            "herdguard_retries_total{route=\"r\",reason=\"connect-failure\"}"
        ),
        Some(2.0)
    );
}

#[tokio::test]
async fn client_errors_are_never_retried() {
    let up = scripted(&[Act::Status(404), Act::Status(400), Act::Status(429)]).await;
    let server = proxy_with(
        &[up.upstream.url()],
        "attempts = 3, retry_on = [\"5xx\", \"connect-failure\"]",
    )
    .await;
    for expect in [404, 400, 429] {
        let (status, headers, _) = call(&server, Request::get("/"), empty()).await;
        assert_eq!(status.as_u16(), expect);
        assert_eq!(headers["x-herdguard-attempts"], "1");
    }
    assert_eq!(up.hits().len(), 3);
}

#[tokio::test]
async fn retry_after_seconds_is_honoured() {
    let up = scripted(&[Act::StatusRetryAfter(503, "1".into())]).await;
    let server = proxy_with(&[up.upstream.url()], "attempts = 2").await;
    let (status, _, _) = call(&server, Request::get("/"), empty()).await;
    assert_eq!(status, StatusCode::OK);
    let hits = up.hits();
    let waited = hits[1].at - hits[0].at;
    assert!(
        waited >= Duration::from_secs(1),
        "retried after {waited:?}, before Retry-After"
    );
    let text = metrics(&server).await;
    assert!(
        metric(&text, "herdguard_backoff_seconds_sum{route=\"r\"}").unwrap() >= 1.0,
        "{text}"
    );
}

#[tokio::test]
async fn retry_after_http_date_is_honoured() {
    let at = httpdate::fmt_http_date(std::time::SystemTime::now() + Duration::from_secs(2));
    let up = scripted(&[Act::StatusRetryAfter(429, at)]).await;
    let server = proxy_with(&[up.upstream.url()], "attempts = 2, retry_on = [\"429\"]").await;
    let (status, _, _) = call(&server, Request::get("/"), empty()).await;
    assert_eq!(status, StatusCode::OK);
    let hits = up.hits();
    // The date has one-second resolution: two seconds ahead is at least one from now.
    assert!(hits[1].at - hits[0].at >= Duration::from_secs(1));
}

#[tokio::test]
async fn too_long_retry_after_is_passed_on() {
    let up = scripted(&[Act::StatusRetryAfter(503, "120".into())]).await;
    let server = proxy_with(
        &[up.upstream.url()],
        "attempts = 3, max_retry_after = \"30s\"",
    )
    .await;
    let (status, headers, _) = call(&server, Request::get("/"), empty()).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        headers["retry-after"], "120",
        "the caller learns when to come back"
    );
    assert_eq!(up.hits().len(), 1);
    assert_eq!(
        skipped(&metrics(&server).await, "retry_after_too_long"),
        1.0
    );
}

#[tokio::test]
async fn reset_before_response_headers_is_retried() {
    let up = scripted(&[Act::Reset]).await;
    let server = proxy_with(&[up.upstream.url()], "attempts = 2").await;
    let (status, headers, body) = call(&server, Request::get("/"), empty()).await;
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"ok"[..]));
    assert_eq!(headers["x-herdguard-attempts"], "2");
    let text = metrics(&server).await;
    assert_eq!(
        metric(
            &text,
            "herdguard_retries_total{route=\"r\",reason=\"reset\"}"
        ),
        Some(1.0),
        "{text}"
    );
}

#[tokio::test]
async fn body_over_max_replay_body_is_sent_once() {
    let up = scripted(&[Act::Status(503), Act::Status(503)]).await;
    let server = proxy_with(
        &[up.upstream.url()],
        "attempts = 3, max_replay_body = \"1KiB\"",
    )
    .await;
    let big = Bytes::from(vec![b'x'; 4096]);
    let (status, headers, _) = call(&server, Request::put("/"), full(big.clone())).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers["x-herdguard-attempts"], "1");
    assert_eq!(up.hits()[0].body, big, "sent whole, once");
    assert_eq!(skipped(&metrics(&server).await, "body_too_large"), 1.0);

    // A small body, streamed without a length, is kept and replayed.
    let chunks: Vec<Result<http_body::Frame<Bytes>, BoxError>> = vec![
        Ok(http_body::Frame::data(Bytes::from_static(b"small "))),
        Ok(http_body::Frame::data(Bytes::from_static(b"body"))),
    ];
    let stream = http_body_util::StreamBody::new(futures_util::stream::iter(chunks)).boxed();
    let (status, headers, _) = call(&server, Request::put("/"), stream).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["x-herdguard-attempts"], "2");
    let hits = up.hits();
    assert_eq!(
        (&hits[1].body[..], &hits[2].body[..]),
        (&b"small body"[..], &b"small body"[..])
    );
}

#[tokio::test]
async fn inner_hop_request_is_forwarded_once() {
    let up = scripted(&[Act::Status(503)]).await;
    let server = proxy_with(&[up.upstream.url()], "attempts = 3").await;
    let (status, headers, _) = call(
        &server,
        Request::get("/").header("x-herdguard-attempt", "2"),
        empty(),
    )
    .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers["x-herdguard-attempts"], "1");
    let hits = up.hits();
    assert_eq!(hits.len(), 1);
    assert_eq!(
        hits[0].attempt.as_deref(),
        Some("2"),
        "the outer hop's attempt number is kept"
    );
    assert_eq!(skipped(&metrics(&server).await, "inner_hop"), 1.0);
}

#[tokio::test]
async fn a_retry_that_would_pass_the_deadline_is_not_made() {
    let up = scripted(&[Act::Status(503)]).await;
    let server = proxy(&format!(
        "[upstreams.u]\nendpoints = [\"{}\"]\n[[routes]]\nname = \"r\"\nupstream = \"u\"\n[routes.retry]\ntimeout = \"300ms\"\n[routes.retry.backoff]\nbase = \"1s\"\ncap = \"1s\"\njitter = \"none\"\n",
        up.upstream.url()
    ))
    .await;
    let (status, _, _) = call(&server, Request::get("/"), empty()).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(up.hits().len(), 1);
    assert_eq!(skipped(&metrics(&server).await, "deadline"), 1.0);
}

#[tokio::test]
async fn the_budget_bounds_attempts_under_total_failure() {
    // Every request fails; without a budget, 200 requests would make 600 attempts.
    let up = upstream(|_| async { Response::builder().status(503).body(empty()).unwrap() }).await;
    let server = proxy(&format!(
        "[upstreams.u]\nendpoints = [\"{}\"]\n[[routes]]\nname = \"r\"\nupstream = \"u\"\n[routes.retry]\nattempts = 3\n[routes.retry.backoff]\nbase = \"1ms\"\ncap = \"2ms\"\n[routes.retry.budget]\nratio = 0.2\nmin_per_second = 1\nwindow = \"10s\"\n[routes.breaker]\nconsecutive_failures = 1000000\nmin_requests = 1000000\n",
        up.url()
    ))
    .await;
    let requests = 200;
    for _ in 0..requests {
        let (status, _, _) = call(&server, Request::get("/"), empty()).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    }
    let bound = requests as f64 * 1.2 + 10.0;
    let attempts = up.hits() as f64;
    assert!(
        attempts <= bound,
        "{attempts} attempts for {requests} requests, bound {bound}"
    );
    assert!(attempts > requests as f64, "some retries were made");
    let text = metrics(&server).await;
    assert!(
        skipped(&text, "budget") >= requests as f64 - (bound - requests as f64),
        "{text}"
    );
    let available = metric(&text, "herdguard_retry_budget_available{route=\"r\"}").unwrap();
    assert!(available < 1.0, "the budget is spent: {available}");
}
