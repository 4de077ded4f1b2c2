//! Requests no route takes, through the binary: refused by default (no
//! open proxy); with `listen.unrouted = "passthrough"`, sent once to the
//! host they name and counted under `passthrough`, and CONNECT tunnelled.
//! Also `match.host` as a list with a wildcard.

use crate::common;

use std::time::Duration;

use http::{Response, StatusCode};

use common::process::Binary;
use common::*;

fn routes(known: &str) -> String {
    format!(
        "[upstreams.u]\nendpoints = [\"{known}\"]\n\
         [[routes]]\nname = \"known\"\nupstream = \"u\"\nmatch = {{ host = [\"known.test\", \"*.apps.test\"] }}\n"
    )
}

/// An upstream that always answers 503.
async fn failing() -> Upstream {
    upstream(|_| async { Response::builder().status(503).body(full("down")).unwrap() }).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passthrough_sends_unrouted_requests_once_and_tunnels_connect() {
    let known = ok_upstream("known").await;
    let other = ok_upstream("other").await;
    let down = failing().await;
    let hg = Binary::start_with("unrouted = \"passthrough\"", &routes(&known.url())).await;

    // Hosts a route names (one of a list, or under its wildcard) are routed.
    for host in ["known.test", "api.apps.test"] {
        let answer = raw_exchange(
            &hg.listen,
            format!("GET http://{host}/x HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await;
        assert!(
            answer.starts_with("HTTP/1.1 200") && answer.ends_with("known"),
            "{answer}"
        );
    }

    // Another host is passed through: the absolute form names it.
    let target = other.addr;
    let answer = raw_exchange(
        &hg.listen,
        format!(
            "GET http://{target}/p?q=1 HTTP/1.1\r\nHost: {target}\r\nConnection: close\r\n\r\n"
        )
        .as_bytes(),
    )
    .await;
    assert!(
        answer.starts_with("HTTP/1.1 200") && answer.ends_with("other"),
        "{answer}"
    );
    let seen = other.last();
    assert_eq!(seen.uri.path_and_query().unwrap().as_str(), "/p?q=1");
    assert!(seen.headers.get("via").is_some(), "passed through this hop");
    assert_eq!(
        seen.headers["x-envoy-max-retries"], "0",
        "a mesh beside herdguard is told not to repeat it either"
    );

    // Once, never retried, even a GET answered 503.
    let target = down.addr;
    let answer = raw_exchange(
        &hg.listen,
        format!("GET http://{target}/ HTTP/1.1\r\nHost: {target}\r\nConnection: close\r\n\r\n")
            .as_bytes(),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(
        answer
            .to_ascii_lowercase()
            .contains("x-herdguard-attempts: 1\r\n"),
        "{answer}"
    );
    assert_eq!(down.hits(), 1, "a passed-through request is sent once");
    let passed = r#"herdguard_requests_total{route="passthrough",code="200",source="upstream"}"#;
    assert_eq!(hg.metric(passed).await, 1.0);

    // CONNECT: a tunnel to the host, bytes both ways.
    let mut tunnel = tokio::net::TcpStream::connect(&hg.listen).await.unwrap();
    let target = other.addr;
    let head = answered(
        &mut tunnel,
        format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes(),
        b"\r\n\r\n",
    )
    .await;
    assert!(
        head.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&head)
    );
    let inside = answered(
        &mut tunnel,
        b"GET /inside HTTP/1.1\r\nHost: other\r\n\r\n",
        b"other",
    )
    .await;
    assert!(inside.starts_with(b"HTTP/1.1 200"));
    assert_eq!(other.last().uri.path(), "/inside");
    assert!(
        other.last().headers.get("via").is_none(),
        "a tunnel's bytes are not read"
    );
    // The tunnel is counted with the passed-through request, not as the
    // proxy's own answer.
    assert_eq!(hg.metric(passed).await, 2.0, "the tunnel counted");
    let open = r#"herdguard_tunnels_open{upstream="passthrough"}"#;
    assert_eq!(hg.metric(open).await, 1.0, "the tunnel is open");
    drop(tunnel);
    let hg_ref = &hg;
    eventually(
        Duration::from_secs(5),
        "the tunnel closed",
        move || async move { hg_ref.metric(open).await == 0.0 },
    )
    .await;
    let own = r#"herdguard_requests_total{route="passthrough",code="200",source="proxy"}"#;
    assert_eq!(hg.metric(own).await, 0.0, "a tunnel opened is no error");

    // A request naming the proxy itself would loop: refused.
    let answer = raw_exchange(
        &hg.listen,
        format!(
            "GET http://{0}/ HTTP/1.1\r\nHost: {0}\r\nConnection: close\r\n\r\n",
            hg.listen
        )
        .as_bytes(),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    // Nor does it reach the admin listener from loopback (a local
    // operator's rights, past `admin.token`): not as a request, nor as a tunnel.
    let admin = raw_exchange(
        &hg.listen,
        format!(
            "POST http://{0}/breakers/r/open HTTP/1.1\r\nHost: {0}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            hg.admin
        )
        .as_bytes(),
    )
    .await;
    assert!(admin.starts_with("HTTP/1.1 400"), "{admin}");
    let tunnel = raw_exchange(
        &hg.listen,
        format!("CONNECT {0} HTTP/1.1\r\nHost: {0}\r\n\r\n", hg.admin).as_bytes(),
    )
    .await;
    assert!(!tunnel.starts_with("HTTP/1.1 200"), "{tunnel}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_default_unrouted_requests_and_connect_are_refused() {
    let known = ok_upstream("known").await;
    let other = ok_upstream("other").await;
    let hg = Binary::start(&routes(&known.url())).await;
    let target = other.addr;
    let answer = raw_exchange(
        &hg.listen,
        format!("GET http://{target}/ HTTP/1.1\r\nHost: {target}\r\nConnection: close\r\n\r\n")
            .as_bytes(),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 404"), "{answer}");
    let answer = raw_exchange(
        &hg.listen,
        format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes(),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 405"), "{answer}");
    assert_eq!(other.hits(), 0, "no open proxy");
    let answer = raw_exchange(
        &hg.listen,
        b"GET http://c.test/ HTTP/1.1\r\nHost: c.test\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(
        answer.contains(&StatusCode::NOT_FOUND.as_u16().to_string()),
        "{answer}"
    );
}
