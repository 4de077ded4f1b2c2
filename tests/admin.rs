//! The admin listener: /metrics, /healthz, /readyz, /config.

mod common;

use common::*;
use http::StatusCode;

#[tokio::test]
async fn admin_endpoints() {
    let up = ok_upstream("ok").await;
    let server = proxy_to(&up.url()).await;
    assert!(server.admin_addr().ip().is_loopback());

    let (status, body) = admin(&server, "/healthz").await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "ok\n"));
    let (status, body) = admin(&server, "/readyz").await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "ready\n"));

    let (status, body) = admin(&server, "/config").await;
    assert_eq!(status, StatusCode::OK);
    let effective = herdguard::config::Config::parse(&body).expect("/config is a valid config");
    assert_eq!(effective.routes[0].name, "all");
    assert_eq!(
        effective.routes[0].retry.attempts, 3,
        "defaults are merged in"
    );

    for _ in 0..3 {
        assert_eq!(get(&server, "/x").await.0, StatusCode::OK);
    }
    assert_eq!(get(&server, "/x").await.0, StatusCode::OK);
    let (status, text) = admin(&server, "/metrics").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        metric(
            &text,
            "herdguard_requests_total{route=\"all\",code=\"200\"}"
        ),
        Some(4.0),
        "{text}"
    );
    assert_eq!(
        metric(
            &text,
            "herdguard_upstream_attempts_total{route=\"all\",upstream=\"u\",outcome=\"ok\"}"
        ),
        Some(4.0)
    );
    assert_eq!(
        metric(
            &text,
            "herdguard_request_duration_seconds_count{route=\"all\"}"
        ),
        Some(4.0)
    );
    assert!(
        text.contains("herdguard_request_duration_seconds_bucket{route=\"all\",le=\"0.005\"}"),
        "buckets set"
    );
    assert_eq!(
        metric(&text, "herdguard_in_flight{upstream=\"u\"}"),
        Some(0.0)
    );
    assert!(text.contains("# HELP herdguard_requests_total"));

    let (status, _) = admin(&server, "/nope").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn unrouted_requests_are_counted() {
    let up = ok_upstream("ok").await;
    let server = proxy(&format!(
        "[upstreams.u]\nendpoints = [\"{}\"]\n[[routes]]\nname = \"a\"\nupstream = \"u\"\nmatch = {{ path = \"/a\" }}\n",
        up.url()
    ))
    .await;
    assert_eq!(get(&server, "/b").await.0, StatusCode::NOT_FOUND);
    let (_, text) = admin(&server, "/metrics").await;
    assert_eq!(
        metric(
            &text,
            "herdguard_requests_total{route=\"none\",code=\"404\"}"
        ),
        Some(1.0),
        "{text}"
    );
}
