//! Forwarding through the real proxy: bodies byte-exact both ways, header
//! rules, h2c, and the errors the proxy makes itself.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use http::{Request, Response, StatusCode, Version};
use http_body_util::{BodyExt, StreamBody};
use rand::RngCore;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn random(len: usize) -> Vec<u8> {
    let mut data = vec![0u8; len];
    rand::rng().fill_bytes(&mut data);
    data
}

#[tokio::test]
async fn one_mib_bodies_are_byte_exact_with_content_length() {
    let up = echo_upstream().await;
    let server = proxy_to(&up.url()).await;
    let data = random(1 << 20);
    let req = Request::post(format!("http://{}/echo", server.proxy_addr()))
        .body(full(data.clone()))
        .unwrap();
    let (status, headers, body) = send(&client(), req).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body.len(), data.len());
    assert!(body == data, "body changed on the way");
    assert_eq!(up.last().headers["content-length"], "1048576");
    assert_eq!(headers["x-herdguard-attempts"], "1");
}

#[tokio::test]
async fn one_mib_bodies_are_byte_exact_chunked() {
    let up = echo_upstream().await;
    let server = proxy_to(&up.url()).await;
    let data = random(1 << 20);
    let chunks: Vec<Result<http_body::Frame<Bytes>, Box<dyn std::error::Error + Send + Sync>>> =
        data.chunks(10_000)
            .map(|c| Ok(http_body::Frame::data(Bytes::copy_from_slice(c))))
            .collect();
    let body = StreamBody::new(futures_util::stream::iter(chunks)).boxed();
    let req = Request::put(format!("http://{}/echo", server.proxy_addr()))
        .body(body)
        .unwrap();
    let (status, headers, body) = send(&client(), req).await;
    assert_eq!(status, StatusCode::OK);
    assert!(body == data, "body changed on the way");
    let seen = up.last();
    assert_eq!(seen.headers["transfer-encoding"], "chunked");
    assert!(!seen.headers.contains_key("content-length"));
    // The upstream echoed it chunked; the caller gets a framed body either way.
    assert!(!headers.contains_key("content-length") || headers["content-length"] == "1048576");
}

#[tokio::test]
async fn hop_by_hop_fields_are_dropped_both_ways() {
    let up = upstream(|_| async {
        Response::builder()
            .header("connection", "x-upstream-private")
            .header("x-upstream-private", "secret")
            .header("keep-alive", "timeout=5")
            .header("proxy-connection", "keep-alive")
            .header("x-upstream-public", "yes")
            .body(full("ok"))
            .unwrap()
    })
    .await;
    let server = proxy_to(&up.url()).await;
    let req = Request::get(format!("http://{}/h", server.proxy_addr()))
        .header("connection", "x-caller-private, keep-alive")
        .header("x-caller-private", "secret")
        .header("keep-alive", "timeout=5")
        .header("proxy-connection", "keep-alive")
        .header("te", "gzip")
        .header("trailer", "x-sum")
        .header("x-caller-public", "yes")
        .body(empty())
        .unwrap();
    let (status, headers, _) = send(&client(), req).await;
    assert_eq!(status, StatusCode::OK);
    let seen = up.last().headers;
    for name in [
        "x-caller-private",
        "keep-alive",
        "proxy-connection",
        "te",
        "upgrade",
    ] {
        assert!(
            !seen.contains_key(name),
            "{name} reached the upstream: {seen:?}"
        );
    }
    // `Trailer` is end to end (RFC 9110 no longer lists it as hop-by-hop):
    // it says which trailer fields the message carries.
    assert_eq!(seen["trailer"], "x-sum");
    assert!(
        seen.get("connection").is_none_or(|v| v == "keep-alive"),
        "{seen:?}"
    );
    assert_eq!(seen["x-caller-public"], "yes");
    for name in ["x-upstream-private", "keep-alive", "proxy-connection"] {
        assert!(
            !headers.contains_key(name),
            "{name} reached the caller: {headers:?}"
        );
    }
    assert_eq!(headers["x-upstream-public"], "yes");
}

#[tokio::test]
async fn via_and_forwarded_headers_are_set() {
    let up = ok_upstream("ok").await;
    let server = proxy_to(&up.url()).await;
    let req = Request::get(format!("http://{}/p?q=1", server.proxy_addr()))
        .header("host", "api.example.test")
        .header("x-forwarded-for", "192.0.2.7")
        .header("x-forwarded-for", "192.0.2.8")
        .header("x-forwarded-proto", "https")
        .header("x-forwarded-host", "elsewhere.test")
        .header("via", "1.1 edge")
        .body(empty())
        .unwrap();
    let (_, headers, _) = send(&client(), req).await;
    let seen = up.last();
    assert_eq!(seen.uri, "/p?q=1");
    // One line each: the caller's list joined with this hop's entry, and
    // the caller's own proto and host replaced by what this hop saw.
    let one = |name: &str| -> Vec<_> { seen.headers.get_all(name).iter().collect() };
    assert_eq!(one("x-forwarded-for"), ["192.0.2.7, 192.0.2.8, 127.0.0.1"]);
    assert_eq!(one("x-forwarded-proto"), ["http"]);
    assert_eq!(one("x-forwarded-host"), ["api.example.test"]);
    assert_eq!(
        seen.headers["host"],
        up.addr.to_string(),
        "Host is the endpoint's"
    );
    let via: Vec<_> = seen.headers.get_all("via").iter().collect();
    assert_eq!(via, ["1.1 edge", "1.1 herdguard"]);
    assert_eq!(seen.headers["x-herdguard-attempt"], "1");
    assert_eq!(headers["via"], "1.1 herdguard");
}

#[tokio::test]
async fn h2c_callers_are_served() {
    let up = echo_upstream().await;
    let server = proxy_to(&up.url()).await;
    let req = Request::post(format!("http://{}/h2", server.proxy_addr()))
        .version(Version::HTTP_2)
        .body(full("over h2c"))
        .unwrap();
    let resp = h2c_client().request(req).await.unwrap();
    assert_eq!(resp.version(), Version::HTTP_2);
    assert_eq!(resp.status(), StatusCode::OK);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "over h2c");
    let seen = up.last();
    assert_eq!(
        seen.version,
        Version::HTTP_11,
        "HTTP/1.1 upstream by default"
    );
    assert_eq!(
        seen.headers.get_all("via").iter().collect::<Vec<_>>(),
        ["2 herdguard"]
    );
    assert_eq!(
        seen.headers["x-forwarded-host"],
        server.proxy_addr().to_string()
    );
}

#[tokio::test]
async fn h2c_upstream_when_http2_is_true() {
    let up = ok_upstream("h2 upstream").await;
    let server = proxy(&format!(
        "[upstreams.u]\nendpoints = [\"{}\"]\nhttp2 = true\n[[routes]]\nname = \"all\"\nupstream = \"u\"\n",
        up.url()
    ))
    .await;
    let (status, _, body) = get(&server, "/").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, "h2 upstream");
    assert_eq!(up.last().version, Version::HTTP_2);
}

#[tokio::test]
async fn no_route_is_404_with_reason() {
    let up = ok_upstream("ok").await;
    let server = proxy(&format!(
        "[upstreams.u]\nendpoints = [\"{}\"]\n[[routes]]\nname = \"api\"\nupstream = \"u\"\nmatch = {{ path_prefix = \"/api\" }}\n",
        up.url()
    ))
    .await;
    let (status, headers, body) = get(&server, "/other").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(headers["x-herdguard-error"], "no-route");
    assert!(
        String::from_utf8_lossy(&body).contains("no route for GET"),
        "{body:?}"
    );
    assert_eq!(up.hits(), 0);
}

#[tokio::test]
async fn absolute_form_and_connect_never_reach_other_hosts() {
    let up = ok_upstream("ok").await;
    let server = proxy_to(&up.url()).await;
    // A forward-proxy style request names another host: it still goes only to
    // the configured upstream.
    let out = raw(
        &server,
        b"GET http://203.0.113.9/x HTTP/1.1\r\nHost: 203.0.113.9\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    assert_eq!(up.last().headers["host"], up.addr.to_string());

    let out = raw(
        &server,
        b"CONNECT 203.0.113.9:443 HTTP/1.1\r\nHost: 203.0.113.9:443\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(out.starts_with("HTTP/1.1 405"), "{out}");
    assert!(out.contains("x-herdguard-error: bad-request"), "{out}");
}

/// Sends raw bytes on a new connection and reads until the proxy closes it.
async fn raw(server: &herdguard::app::Server, request: &[u8]) -> String {
    raw_exchange(server.proxy_addr(), request).await
}

#[tokio::test]
async fn a_missing_repeated_or_invalid_host_is_400_and_never_forwarded() {
    let up = ok_upstream("ok").await;
    let server = proxy_to(&up.url()).await;
    for (request, reason) in [
        (
            &b"GET / HTTP/1.1\r\nHost: a.example\r\nHost: b.example\r\nConnection: close\r\n\r\n"[..],
            "more than one Host header",
        ),
        (
            b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n",
            "an HTTP/1.1 request needs a Host header",
        ),
        (
            b"GET / HTTP/1.1\r\nHost: a b/c\r\nConnection: close\r\n\r\n",
            "the Host header is not a valid host[:port]",
        ),
    ] {
        let out = raw(&server, request).await;
        assert!(out.starts_with("HTTP/1.1 400"), "{out}");
        assert!(out.contains("x-herdguard-error: bad-request"), "{out}");
        assert!(out.contains(reason), "{reason}: {out}");
    }
    assert_eq!(up.hits(), 0, "no malformed request reached the upstream");

    // HTTP/1.0 has no Host requirement.
    let out = raw(&server, b"GET / HTTP/1.0\r\n\r\n").await;
    assert!(out.starts_with("HTTP/1.0 200"), "{out}");
    assert_eq!(up.hits(), 1);
}

#[tokio::test]
async fn a_request_head_over_the_limit_is_431_and_never_forwarded() {
    let up = ok_upstream("ok").await;
    let server = proxy_to(&up.url()).await;
    let head = |value_len: usize| {
        format!(
            "GET / HTTP/1.1\r\nHost: a\r\nX-Big: {}\r\nConnection: close\r\n\r\n",
            "v".repeat(value_len)
        )
    };
    // Over the limit: in one piece, and sent in pieces that never end the
    // head (the proxy answers without waiting for the rest). hyper checks
    // the limit when a read leaves the head unfinished, so a head read in
    // large pieces may pass up to twice the limit: 200 KB is over in any case.
    let out = raw(&server, head(200 * 1000).as_bytes()).await;
    assert!(out.starts_with("HTTP/1.1 431"), "{out}");
    let mut slow = tokio::net::TcpStream::connect(server.proxy_addr())
        .await
        .unwrap();
    slow.write_all(b"GET / HTTP/1.1\r\nHost: a\r\nX-Big: ")
        .await
        .unwrap();
    let piece = vec![b'v'; 16 * 1024];
    let mut answer = Vec::new();
    for _ in 0..8 {
        if slow.write_all(&piece).await.is_err() {
            break;
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(10), slow.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");
    assert_eq!(up.hits(), 0, "no head over the limit reached the upstream");

    // Under it, the head reaches the upstream whole.
    let out = raw(&server, head(48 * 1024).as_bytes()).await;
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    assert_eq!(up.hits(), 1);
    assert_eq!(up.last().headers["x-big"].len(), 48 * 1024);
}

#[tokio::test]
async fn connect_failure_is_502_with_reason() {
    let port = closed_port().await;
    let server = proxy_to(&format!("http://{port}")).await;
    let (status, headers, body) = get(&server, "/").await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    assert_eq!(headers["x-herdguard-error"], "connect-failure");
    assert!(
        String::from_utf8_lossy(&body).contains("upstream u failed"),
        "{body:?}"
    );
}

#[tokio::test]
async fn slow_upstream_is_504_with_reason() {
    // The upstream never answers: it waits on a future that never resolves.
    let up = upstream(|_| async {
        std::future::pending::<()>().await;
        unreachable!()
    })
    .await;
    let server = proxy(&format!(
        "[upstreams.u]\nendpoints = [\"{}\"]\n[[routes]]\nname = \"all\"\nupstream = \"u\"\nretry = {{ attempts = 1, per_try_timeout = \"200ms\" }}\n",
        up.url()
    ))
    .await;
    let (status, headers, body) = get(&server, "/").await;
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(headers["x-herdguard-error"], "timeout");
    assert!(
        String::from_utf8_lossy(&body).contains("no response headers within"),
        "{body:?}"
    );
}

#[tokio::test]
async fn endpoints_are_balanced_round_robin() {
    let a = ok_upstream("a").await;
    let b = ok_upstream("b").await;
    let server = proxy(&format!(
        "[upstreams.u]\nendpoints = [\"{}\", \"{}\"]\n[[routes]]\nname = \"all\"\nupstream = \"u\"\n",
        a.url(),
        b.url()
    ))
    .await;
    for _ in 0..10 {
        let (status, _, _) = get(&server, "/").await;
        assert_eq!(status, StatusCode::OK);
    }
    assert_eq!((a.hits(), b.hits()), (5, 5));
}

/// HTTP/1.1 trailers reach a caller that asked for them (`TE: trailers`),
/// byte for byte, with the `Trailer` field that declares them; the
/// upstream is told the caller accepts trailers.
#[tokio::test]
async fn http1_trailers_reach_the_caller_byte_exact() {
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (seen_tx, seen_rx) = tokio::sync::oneshot::channel::<String>();
    tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        let mut head = Vec::new();
        let mut buf = [0u8; 4096];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = tokio::io::AsyncReadExt::read(&mut stream, &mut buf)
                .await
                .unwrap();
            assert!(n > 0);
            head.extend_from_slice(&buf[..n]);
        }
        let _ = seen_tx.send(String::from_utf8_lossy(&head).to_lowercase());
        stream
            .write_all(
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntrailer: x-checksum, x-count\r\n\r\n\
                  5\r\nhello\r\n6\r\n world\r\n0\r\nx-checksum: sha256=abc123\r\nx-count: 2\r\n\r\n",
            )
            .await
            .unwrap();
        let _ = stream.shutdown().await;
    });
    let server = proxy_to(&format!("http://{addr}")).await;
    let out = raw(
        &server,
        b"GET /t HTTP/1.1\r\nHost: a\r\nTE: trailers\r\nConnection: close\r\n\r\n",
    )
    .await;
    let seen = seen_rx.await.unwrap();
    assert!(seen.contains("\r\nte: trailers\r\n"), "{seen}");
    let lower = out.to_lowercase();
    assert!(
        lower.contains("\r\ntrailer: x-checksum, x-count\r\n"),
        "{out}"
    );
    assert!(
        out.ends_with(
            "5\r\nhello\r\n6\r\n world\r\n0\r\nx-checksum: sha256=abc123\r\nx-count: 2\r\n\r\n"
        ),
        "{out:?}"
    );
}

/// An HTTP/1 upstream's trailer section may carry what HTTP/2 forbids
/// (connection-specific fields) and what no trailer may (framing, routing,
/// the proxy's own error): passed on to an HTTP/2 caller, the first reset
/// its stream. They are dropped; the rest arrives.
#[tokio::test]
async fn trailers_lose_what_no_trailer_may_carry() {
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        assert!(read_head(&mut stream).await);
        stream
            .write_all(
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\
                  trailer: x-checksum, connection, keep-alive, transfer-encoding, content-length, host, x-herdguard-error\r\n\r\n\
                  5\r\nhello\r\n0\r\nx-checksum: abc\r\nconnection: close\r\nkeep-alive: 5\r\n\
                  transfer-encoding: chunked\r\ncontent-length: 5\r\nhost: elsewhere\r\nx-herdguard-error: forged\r\n\r\n",
            )
            .await
            .unwrap();
        let _ = stream.shutdown().await;
    });
    let server = proxy_to(&format!("http://{addr}")).await;
    let req = Request::get(format!("http://{}/t", server.proxy_addr()))
        .header("te", "trailers")
        .body(empty())
        .unwrap();
    let resp = h2c_client().request(req).await.expect("an answer");
    let collected = resp
        .into_body()
        .collect()
        .await
        .expect("the stream ends whole, not reset");
    let trailers = collected.trailers().cloned().expect("trailers");
    assert_eq!(trailers["x-checksum"], "abc");
    let names: Vec<_> = trailers.keys().map(|k| k.as_str()).collect();
    assert_eq!(names, ["x-checksum"], "{trailers:?}");
    assert_eq!(collected.to_bytes(), "hello");
}

#[tokio::test]
async fn a_huge_head_reaches_the_upstream_whole_on_every_attempt() {
    // The proxy copies a request's target and header values out of hyper's
    // read buffer as it takes the request: many values, repeated
    // names, bytes past ASCII and a long query must come out the same, on
    // the first attempt and on the retry made from the kept copy.
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let up = upstream(move |_| {
        let first = c.fetch_add(1, Ordering::SeqCst) == 0;
        async move {
            let mut resp = Response::new(full(if first { "again" } else { "ok" }));
            if first {
                *resp.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            }
            resp
        }
    })
    .await;
    let server = proxy_to(&up.url()).await;
    let query: String = (0..600).map(|i| format!("k{i}=v{i}&")).collect();
    let target = format!("/path/%E2%9C%93?{query}");
    let mut req = Request::get(format!("http://{}{target}", server.proxy_addr()));
    let mut sent = Vec::new();
    // 80 of 20 names: hyper takes at most 100 fields per head.
    for i in 0..80 {
        let name = format!("x-field-{}", i % 20);
        let value =
            http::HeaderValue::from_bytes(format!("value {i} caf\u{e9}").as_bytes()).unwrap();
        req = req.header(name.as_str(), value.clone());
        sent.push((name, value));
    }
    let (status, _, body) = send(&client(), req.body(empty()).unwrap()).await;
    assert_eq!((status, body), (StatusCode::OK, Bytes::from("ok")));
    assert_eq!(up.hits(), 2, "one retry");
    let seen = up.last();
    assert_eq!(seen.uri, target.as_str());
    for i in 0..20 {
        let name = format!("x-field-{i}");
        let want: Vec<_> = sent
            .iter()
            .filter(|(n, _)| *n == name)
            .map(|(_, v)| v)
            .collect();
        let got: Vec<_> = seen.headers.get_all(name.as_str()).iter().collect();
        assert_eq!(got, want, "{name}");
    }
}

/// Beside a mesh: with `mesh_retries = false`, every attempt asks Envoy
/// (Istio's sidecar) not to retry it; by default nothing is added.
#[tokio::test]
async fn mesh_retries_off_asks_envoy_not_to_retry() {
    for (setting, expected) in [("", None), ("mesh_retries = false\n", Some("0"))] {
        let up = ok_upstream("ok").await;
        let server = proxy(&format!(
            "[upstreams.u]\nendpoints = [\"{}\"]\n{setting}[[routes]]\nname = \"r\"\nupstream = \"u\"\n",
            up.url()
        ))
        .await;
        let (status, _, _) = get(&server, "/").await;
        assert_eq!(status, 200);
        let seen = up.last();
        assert_eq!(
            seen.headers
                .get("x-envoy-max-retries")
                .map(|v| v.to_str().unwrap()),
            expected,
            "{setting:?}"
        );
    }
}
