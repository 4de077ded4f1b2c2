//! The admin listener: /metrics, /healthz, /readyz, /config.

use crate::common;

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
            "herdguard_requests_total{route=\"all\",code=\"200\",source=\"upstream\"}"
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
    // Each attempt's own latency, by route and upstream, and the version.
    assert_eq!(
        metric(
            &text,
            "herdguard_upstream_attempt_duration_seconds_count{route=\"all\",upstream=\"u\",outcome=\"ok\"}"
        ),
        Some(4.0),
        "{text}"
    );
    assert!(text.contains(
        "herdguard_upstream_attempt_duration_seconds_bucket{route=\"all\",upstream=\"u\",outcome=\"ok\",le=\"0.005\"}"
    ));
    let build = format!(
        "herdguard_build_info{{version=\"{}\"}}",
        env!("CARGO_PKG_VERSION")
    );
    assert_eq!(metric(&text, &build), Some(1.0), "{text}");
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
            "herdguard_requests_total{route=\"none\",code=\"404\",source=\"proxy\"}"
        ),
        Some(1.0),
        "{text}"
    );
}

/// `admin.token` opens the changing endpoints to callers off loopback (the
/// rule itself is unit-tested in `admin.rs`: tests talk over loopback only).
/// Through the binary: a loopback caller still may, the token is never shown
/// back, and a weak one is a config error with key and line.
#[tokio::test]
async fn the_admin_token_is_checked_and_never_shown() {
    use common::process::Binary;
    let up = ok_upstream("fine").await;
    let token = "s3cret-7f9a1c2e4b6d8f00";
    // The text after the harness's `[admin]` line: a token of its own.
    let hg = Binary::start(&format!(
        "token = \"{token}\"\n[upstreams.u]\nendpoints = [\"{}\"]\n\
         [[routes]]\nname = \"r\"\nupstream = \"u\"\n",
        up.url()
    ))
    .await;
    let post = |path: &str| {
        http::Request::post(format!("http://{}{path}", hg.admin))
            .body(empty())
            .unwrap()
    };
    let (status, _, _) = send(&client(), post("/breakers/r/open")).await;
    assert_eq!(status, StatusCode::OK, "loopback may, token or not");
    let (status, _, _) = send(&client(), post("/breakers/r/reset")).await;
    assert_eq!(status, StatusCode::OK);
    // A web page on the same machine (a cross-site form post) may not.
    let mut from_page = post("/breakers/r/open");
    from_page.headers_mut().insert(
        http::header::ORIGIN,
        http::HeaderValue::from_static("https://evil.example"),
    );
    let (status, _, body) = send(&client(), from_page).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{body:?}");
    let req = http::Request::get(format!("http://{}/config", hg.admin))
        .body(empty())
        .unwrap();
    let (status, _, shown) = send(&client(), req).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        !String::from_utf8_lossy(&shown).contains(token),
        "/config shows no token"
    );
    hg.terminate().await;

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.toml");
    let body = format!(
        "[upstreams.u]\nendpoints = [\"{}\"]\n[[routes]]\nname = \"r\"\nupstream = \"u\"\n",
        up.url()
    );
    for (value, ok) in [
        (token, true),
        ("short", false),
        ("has spaces in it, 16+", false),
    ] {
        std::fs::write(&path, format!("[admin]\ntoken = \"{value}\"\n{body}")).unwrap();
        let out = std::process::Command::new(common::process::BIN)
            .args(["check", "--config"])
            .arg(&path)
            .output()
            .unwrap();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert_eq!(out.status.success(), ok, "{value}: {stderr}");
        assert!(
            !stdout.contains(value) && !stderr.contains(value),
            "{value} shown"
        );
        if !ok {
            assert!(stderr.contains("admin.token (line 2)"), "{stderr}");
        }
    }
}
