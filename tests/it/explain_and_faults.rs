//! The opt-in explain trace, and fault injection per route.

use crate::common;

use common::scripted::*;
use common::*;
use http::{Request, StatusCode};

fn with(url: &str, route_extra: &str) -> String {
    format!(
        "[upstreams.u]\nendpoints = [\"{url}\"]\n[defaults.retry.backoff]\nbase = \"5ms\"\ncap = \"20ms\"\n[[routes]]\nname = \"r\"\nupstream = \"u\"\n{route_extra}\n"
    )
}

async fn explain_proxy(script: &[Act], enabled: bool) -> (Scripted, herdguard::app::Server) {
    let up = scripted(script).await;
    let config = herdguard::config::Config::parse(&format!(
        "[listen]\naddress = \"127.0.0.1:0\"\nexplain = {enabled}\n[admin]\naddress = \"127.0.0.1:0\"\n{}",
        with(&up.upstream.url(), "")
    ))
    .unwrap();
    let server = herdguard::app::Server::start(config).await.unwrap();
    (up, server)
}

#[tokio::test]
async fn explain_trace_on_opt_in() {
    let (up, server) = explain_proxy(&[Act::Status(503)], true).await;
    let req = Request::get(format!("http://{}/x", server.proxy_addr()))
        .header("x-herdguard-explain", "1")
        .body(empty())
        .unwrap();
    let (status, headers, _) = send(&client(), req).await;
    assert_eq!(status, StatusCode::OK);
    let trace = &explained(&headers);
    let steps: Vec<&str> = trace.split(';').collect();
    assert_eq!(steps.len(), 3, "{trace}");
    assert!(
        steps[0].starts_with("1=503@") && steps[0].ends_with("ms"),
        "{trace}"
    );
    assert!(
        steps[1].starts_with("backoff=") && steps[1].ends_with("ms"),
        "{trace}"
    );
    assert!(steps[2].starts_with("2=200@"), "{trace}");
    assert!(
        up.upstream
            .seen
            .lock()
            .unwrap()
            .iter()
            .all(|s| !s.headers.contains_key("x-herdguard-explain")),
        "the explain header is not forwarded"
    );
    // Without the request header, no trace.
    let (_, headers, _) = get(&server, "/x").await;
    assert!(!headers.contains_key("x-herdguard-explain"));
}

#[tokio::test]
async fn explain_is_off_unless_configured() {
    let (_up, server) = explain_proxy(&[], false).await;
    let req = Request::get(format!("http://{}/x", server.proxy_addr()))
        .header("x-herdguard-explain", "1")
        .body(empty())
        .unwrap();
    let (_, headers, _) = send(&client(), req).await;
    assert!(!headers.contains_key("x-herdguard-explain"));
}

#[tokio::test]
async fn explain_shows_a_skipped_retry() {
    let (_up, server) = explain_proxy(&[Act::Status(503)], true).await;
    let req = Request::post(format!("http://{}/x", server.proxy_addr()))
        .header("x-herdguard-explain", "1")
        .body(full("order"))
        .unwrap();
    let (status, headers, _) = send(&client(), req).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let trace = &explained(&headers);
    assert!(
        trace.starts_with("1=503@") && trace.ends_with(";skip=non_idempotent"),
        "{trace}"
    );
}

#[tokio::test]
async fn injected_aborts_come_at_their_rate_and_never_reach_the_upstream() {
    let up = ok_upstream("ok").await;
    let server = proxy(&with(
        &up.url(),
        "fault = { abort = 0.3, abort_status = 418 }",
    ))
    .await;
    let n = 400;
    let mut aborted = 0;
    for _ in 0..n {
        let (status, headers, _) = get(&server, "/").await;
        if status == StatusCode::IM_A_TEAPOT {
            assert_eq!(headers["x-herdguard-fault"], "abort");
            aborted += 1;
        } else {
            assert_eq!(status, StatusCode::OK);
        }
    }
    // Binomial(400, 0.3): mean 120, sd 9.2; five sd either way.
    assert!((74..=166).contains(&aborted), "{aborted} aborted of {n}");
    assert_eq!(up.hits(), n - aborted);
}

#[tokio::test]
async fn injected_delays_come_at_their_rate() {
    let up = ok_upstream("ok").await;
    let server = proxy(&with(
        &up.url(),
        "fault = { delay = \"20ms\", delay_ratio = 0.25 }",
    ))
    .await;
    let n = 200;
    let mut delayed = 0;
    for _ in 0..n {
        let started = std::time::Instant::now();
        let (status, headers, _) = get(&server, "/").await;
        assert_eq!(status, StatusCode::OK);
        if headers
            .get("x-herdguard-fault")
            .is_some_and(|v| v == "delay")
        {
            delayed += 1;
            assert!(
                started.elapsed() >= std::time::Duration::from_millis(20),
                "a delayed answer came early"
            );
        }
    }
    // Binomial(200, 0.25): mean 50, sd 6.1; five sd either way.
    assert!((19..=81).contains(&delayed), "{delayed} delayed of {n}");
    assert_eq!(up.hits(), n);
}

/// An injected delay that outlasts the route's timeout leaves the request
/// nothing: no attempt is sent, picked or counted (the retry budget earns
/// nothing for it), and the caller hears of its deadline.
#[tokio::test]
async fn a_delay_past_the_timeout_sends_no_attempt() {
    let up = ok_upstream("ok").await;
    let server = proxy(&with(
        &up.url(),
        "fault = { delay = \"1100ms\", delay_ratio = 1.0 }\nretry = { timeout = \"1s\" }",
    ))
    .await;
    let (status, headers, _) = get(&server, "/").await;
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(headers["x-herdguard-attempts"], "0", "{headers:?}");
    assert_eq!(up.hits(), 0);
    let (_, metrics) = admin(&server, "/metrics").await;
    let deadline =
        r#"herdguard_upstream_attempts_total{route="r",upstream="u",outcome="deadline"}"#;
    assert_eq!(
        metric(&metrics, deadline).unwrap_or(0.0),
        0.0,
        "no attempt was counted"
    );
}

#[test]
fn fault_keys_are_validated() {
    let src = "[upstreams.u]\nendpoints = [\"http://127.0.0.1:1\"]\n[[routes]]\nname = \"r\"\nupstream = \"u\"\nfault = { abort = 1.5, abort_status = 42 }\n";
    let errs = herdguard::config::Config::parse(src)
        .unwrap_err()
        .to_string();
    assert!(
        errs.contains("routes[0].fault.abort (line 6): 1.5 is out of range"),
        "{errs}"
    );
    assert!(
        errs.contains("routes[0].fault.abort_status (line 6): 42 is not a status"),
        "{errs}"
    );
}
