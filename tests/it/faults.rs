//! Upstream faults from a raw socket: responses that break HTTP are the
//! upstream's fault, answered 502 `bad-response`, never retried (they could
//! only fail again), and never crash the proxy.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::process::Binary;
use common::*;
use http::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// An upstream on a raw socket: reads each request head, writes `response`
/// as it is, and closes. Counts the requests it saw.
async fn raw_upstream(response: Vec<u8>) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let seen = Arc::new(AtomicUsize::new(0));
    let count = seen.clone();
    let response = Arc::new(response);
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let (count, response) = (count.clone(), response.clone());
            tokio::spawn(async move {
                if !read_head(&mut stream).await {
                    return;
                }
                count.fetch_add(1, Ordering::SeqCst);
                let _ = stream.write_all(&response).await;
                let _ = stream.shutdown().await;
            });
        }
    });
    (url, seen)
}

async fn get(hg: &Binary, path: &str) -> (StatusCode, http::HeaderMap, bytes::Bytes) {
    let req = http::Request::get(format!("http://{}{path}", hg.listen))
        .body(empty())
        .unwrap();
    send(&client(), req).await
}

fn config(url: &str) -> String {
    format!(
        "[upstreams.u]\nendpoints = [\"{url}\"]\n[[routes]]\nname = \"r\"\nupstream = \"u\"\n\
         retry = {{ retry_on = [\"5xx\", \"reset\", \"connect-failure\", \"timeout\"] }}\n"
    )
}

#[tokio::test]
async fn responses_that_break_http_are_502_bad_response_and_not_retried() {
    let mut many_fields = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n".to_vec();
    for i in 0..150 {
        many_fields.extend_from_slice(format!("x-field-{i}: v\r\n").as_bytes());
    }
    many_fields.extend_from_slice(b"\r\nok");
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "status 600",
            b"HTTP/1.1 600 Odd\r\nContent-Length: 2\r\n\r\nok".to_vec(),
        ),
        (
            "status 999",
            b"HTTP/1.1 999 Odd\r\nContent-Length: 0\r\n\r\n".to_vec(),
        ),
        ("150 header fields", many_fields),
        ("garbage", b"NOT HTTP AT ALL\r\n\r\n".to_vec()),
        (
            "a transfer coding other than chunked",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"
                .to_vec(),
        ),
    ];
    for (what, response) in cases {
        let (url, seen) = raw_upstream(response).await;
        let hg = Binary::start(&config(&url)).await;
        let (status, headers, body) = get(&hg, "/x").await;
        assert_eq!(status, StatusCode::BAD_GATEWAY, "{what}: {body:?}");
        assert_eq!(
            headers.get("x-herdguard-error").unwrap(),
            "bad-response",
            "{what}"
        );
        assert_eq!(seen.load(Ordering::SeqCst), 1, "{what}: not retried");
        let attempts =
            r#"herdguard_upstream_attempts_total{route="r",upstream="u",outcome="bad-response"}"#;
        assert_eq!(hg.metric(attempts).await, 1.0, "{what}");
        // Still serving: the process did not abort.
        let (status, _, _) = get(&hg, "/again").await;
        assert_eq!(status, StatusCode::BAD_GATEWAY, "{what}");
        hg.terminate().await;
    }
}

#[tokio::test]
async fn a_retry_after_too_large_to_count_is_passed_on_not_retried_at_once() {
    use common::scripted::{scripted, Act};
    let up = scripted(&[Act::StatusRetryAfter(503, "99999999999999999999999".into())]).await;
    let hg = Binary::start(&config(&up.upstream.url())).await;
    let (status, headers, _) = get(&hg, "/x").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers.get("x-herdguard-attempts").unwrap(), "1");
    assert_eq!(up.hits().len(), 1);
    let skipped = r#"herdguard_retries_skipped_total{route="r",reason="retry_after_too_long"}"#;
    assert_eq!(hg.metric(skipped).await, 1.0);
    hg.terminate().await;
}

/// Writes `request` on a raw connection to the proxy and reads the answer.
async fn raw(hg: &Binary, request: &[u8]) -> String {
    raw_exchange(hg.listen.as_str(), request).await
}

#[tokio::test]
async fn a_response_framed_by_both_lengths_is_forwarded_whole() {
    // Transfer-Encoding wins (RFC 9112 §6.3); the Content-Length of 2 is a lie.
    let (url, _) = raw_upstream(
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
            .to_vec(),
    )
    .await;
    let hg = Binary::start(&config(&url)).await;
    let (status, headers, body) = get(&hg, "/x").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(&body[..], b"hello world");
    assert_ne!(
        headers.get("content-length").map(|v| v.as_bytes()),
        Some(&b"2"[..])
    );
    hg.terminate().await;
}

#[tokio::test]
async fn request_framing_the_proxy_cannot_forward_faithfully_is_refused() {
    let up = ok_upstream("ok").await;
    let hg = Binary::start(&config(&up.url())).await;
    let twice = raw(
        &hg,
        b"POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked, chunked\r\nConnection: close\r\n\r\n2\r\nhi\r\n0\r\n\r\n",
    )
    .await;
    assert!(twice.starts_with("HTTP/1.1 400"), "{twice}");
    assert!(twice.contains("x-herdguard-error: bad-request"), "{twice}");
    let gzip = raw(
        &hg,
        b"POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\nConnection: close\r\n\r\n2\r\nhi\r\n0\r\n\r\n",
    )
    .await;
    assert!(gzip.starts_with("HTTP/1.1 501"), "{gzip}");
    assert_eq!(up.hits(), 0, "nothing was forwarded");
    hg.terminate().await;
}

#[tokio::test]
async fn an_h2c_upgrade_is_never_tunnelled() {
    let up = ok_upstream("plain").await;
    let hg = Binary::start(&config(&up.url())).await;
    // Only WebSocket is tunnelled: h2c under any spelling, and any other
    // protocol, goes as a plain request, its upgrade fields dropped (an
    // HTTP2-Settings not named in Connection too).
    for (upgrade, connection) in [
        ("h2c", "Upgrade, HTTP2-Settings, close"),
        ("h2c-14", "Upgrade, close"),
        ("h2c-17", "Upgrade, close"),
        ("HTTP/2.0", "Upgrade, close"),
        ("h2", "Upgrade, close"),
        ("h2c;q=1", "Upgrade, close"),
        ("websocket, h2c", "Upgrade, close"),
        ("TLS/1.2", "Upgrade, close"),
    ] {
        let request = format!(
            "GET /x HTTP/1.1\r\nHost: a\r\nConnection: {connection}\r\nUpgrade: {upgrade}\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n"
        );
        let answer = raw(&hg, request.as_bytes()).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{upgrade}: {answer}");
        assert!(answer.ends_with("plain"), "{upgrade}: {answer}");
        let seen = up.last();
        assert!(
            seen.headers.get("upgrade").is_none(),
            "{upgrade}: {:?}",
            seen.headers
        );
        assert!(seen.headers.get("http2-settings").is_none(), "{upgrade}");
    }
    hg.terminate().await;
}

#[tokio::test]
async fn silent_connections_do_not_hold_their_slots() {
    let up = ok_upstream("served").await;
    let hg = Binary::start_with(
        "header_read_timeout = \"300ms\"\nmax_connections = 3",
        &config(&up.url()),
    )
    .await;
    // Three callers take every slot and say nothing, or half an HTTP/2 preface.
    let mut silent = Vec::new();
    for opening in [&b""[..], b"", b"PRI * HTTP/2.0\r\n"] {
        let mut s = tokio::net::TcpStream::connect(&hg.listen).await.unwrap();
        s.write_all(opening).await.unwrap();
        silent.push(s);
    }
    // Each is closed by the proxy once header_read_timeout has passed.
    for mut s in silent {
        let mut buf = [0u8; 16];
        let read = tokio::time::timeout(std::time::Duration::from_secs(5), s.read(&mut buf));
        assert!(matches!(read.await, Ok(Ok(0)) | Ok(Err(_))), "closed");
    }
    let (status, _, body) = get(&hg, "/x").await;
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"served"[..]));
    hg.terminate().await;
}

/// Whether the proxy has closed `s` (without waiting: a read that would
/// block means open).
fn closed(s: &tokio::net::TcpStream) -> bool {
    let mut buf = [0u8; 1];
    match s.try_read(&mut buf) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    }
}

#[tokio::test]
async fn a_full_listener_closes_its_oldest_silent_connection_for_a_new_caller() {
    let up = ok_upstream("served").await;
    // A header time far longer than the test: only eviction frees a slot.
    let hg = Binary::start_with(
        "header_read_timeout = \"60s\"\nmax_connections = 4",
        &config(&up.url()),
    )
    .await;
    let mut silent = Vec::new();
    for _ in 0..4 {
        silent.push(tokio::net::TcpStream::connect(&hg.listen).await.unwrap());
    }
    // Each new caller is served, each taking the slot of the oldest silent
    // one; they stay connected, so no slot frees itself.
    let mut callers = Vec::new();
    for round in 0..2 {
        let mut caller = tokio::net::TcpStream::connect(&hg.listen).await.unwrap();
        let answer = answered(
            &mut caller,
            b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n",
            b"served",
        )
        .await;
        assert!(answer.starts_with(b"HTTP/1.1 200"));
        callers.push(caller);
        let mut buf = [0u8; 1];
        let oldest = silent[round].read(&mut buf);
        let read = tokio::time::timeout(std::time::Duration::from_secs(5), oldest).await;
        assert!(
            matches!(read, Ok(Ok(0)) | Ok(Err(_))),
            "the oldest is closed"
        );
        assert!(!closed(&silent[3]), "the newest silent connection is kept");
    }
    // The admin listener too: more silent connections than it takes (256)
    // do not keep the kubelet's probe out until they time out (3 s), and
    // the newest of them is still open when it is answered.
    let mut on_admin = Vec::new();
    for _ in 0..300 {
        on_admin.push(tokio::net::TcpStream::connect(&hg.admin).await.unwrap());
    }
    let health = http::Request::get(format!("http://{}/healthz", hg.admin))
        .body(empty())
        .unwrap();
    assert_eq!(send(&client(), health).await.0, StatusCode::OK);
    assert!(
        !closed(&on_admin[255]),
        "silent slots were taken over, not timed out"
    );
    hg.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_the_upstream_closed_is_never_blamed_on_it() {
    // Closes every connection right after its response, without saying so.
    let (url, seen) =
        raw_upstream(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok".to_vec()).await;
    let hg = Binary::start(&config(&url)).await;
    let callers: Vec<_> = (0..20)
        .map(|c| {
            let listen = hg.listen.clone();
            tokio::spawn(async move {
                let client = client();
                let mut failed = Vec::new();
                for i in 0..30 {
                    let method = if (c + i) % 2 == 0 { "POST" } else { "GET" };
                    let req = http::Request::builder()
                        .method(method)
                        .uri(format!("http://{listen}/n/{c}/{i}"))
                        .body(full("{}"))
                        .unwrap();
                    let (status, _, body) = send(&client, req).await;
                    if (status, &body[..]) != (StatusCode::OK, &b"ok"[..]) {
                        failed.push(format!("{method} {c}/{i}: {status} {body:?}"));
                    }
                }
                failed
            })
        })
        .collect();
    let mut failed = Vec::new();
    for c in callers {
        failed.extend(c.await.unwrap());
    }
    // A POST caught in the keep-alive race (the upstream closes as it is
    // written) may fail: whether it was processed cannot be known, so it is
    // not repeated. A GET never fails, and nothing is processed twice.
    assert!(
        failed
            .iter()
            .all(|f| f.starts_with("POST") && f.contains("502")),
        "{failed:#?}"
    );
    assert!(failed.len() <= 30, "{} failed: {failed:#?}", failed.len());
    assert!(
        seen.load(Ordering::SeqCst) <= 600,
        "nothing processed twice"
    );
    let text = hg.metrics().await;
    let breaker = metric(&text, r#"herdguard_breaker_state{route="r"}"#);
    assert_eq!(breaker, Some(0.0), "{text}");
    for blamed in ["reset", "connect-failure"] {
        let series = format!(
            r#"herdguard_upstream_attempts_total{{route="r",upstream="u",outcome="{blamed}"}}"#
        );
        assert_eq!(metric(&text, &series), Some(0.0), "{blamed}\n{text}");
    }
}

#[tokio::test]
async fn max_forwards_zero_is_answered_here_and_counted_down_otherwise() {
    let up = ok_upstream("upstream").await;
    let hg = Binary::start(&config(&up.url())).await;
    let options = raw(
        &hg,
        b"OPTIONS /x HTTP/1.1\r\nHost: a\r\nMax-Forwards: 0\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(options.starts_with("HTTP/1.1 200"), "{options}");
    assert!(
        options.to_ascii_lowercase().contains("allow: get"),
        "{options}"
    );
    let trace = raw(
        &hg,
        b"TRACE /t HTTP/1.1\r\nHost: a\r\nMax-Forwards: 0\r\nCookie: secret=1\r\nX-Mine: yes\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(trace.starts_with("HTTP/1.1 200"), "{trace}");
    assert!(trace.contains("message/http"), "{trace}");
    assert!(trace.contains("TRACE /t HTTP/1.1"), "{trace}");
    assert!(trace.contains("x-mine: yes"), "{trace}");
    assert!(
        !trace.contains("secret"),
        "credentials are not echoed: {trace}"
    );
    assert_eq!(up.hits(), 0, "answered by this hop");

    let on = raw(
        &hg,
        b"OPTIONS /x HTTP/1.1\r\nHost: a\r\nMax-Forwards: 3\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(on.starts_with("HTTP/1.1 200"), "{on}");
    assert_eq!(up.last().headers.get("max-forwards").unwrap(), "2");

    // Two fields: the fewer hops count, so `5` and `0` is answered here.
    let hits = up.hits();
    let two = raw(
        &hg,
        b"OPTIONS /x HTTP/1.1\r\nHost: a\r\nMax-Forwards: 5\r\nMax-Forwards: 0\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(two.starts_with("HTTP/1.1 200"), "{two}");
    assert_eq!(up.hits(), hits, "answered by this hop");
    // Too many to count is still counted down.
    let huge = raw(
        &hg,
        b"OPTIONS /x HTTP/1.1\r\nHost: a\r\nMax-Forwards: 99999999999999999999999\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(huge.starts_with("HTTP/1.1 200"), "{huge}");
    assert_eq!(
        up.last().headers.get("max-forwards").unwrap(),
        (u64::MAX - 1).to_string().as_str()
    );
    hg.terminate().await;
}

/// An upstream that writes `response` on each connection and then holds it
/// open, sending nothing more.
async fn hanging_upstream(response: &'static [u8]) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                let _ = stream.read(&mut buf).await;
                let _ = stream.write_all(response).await;
                // Hold it: read until the proxy gives up on it.
                while matches!(stream.read(&mut buf).await, Ok(n) if n > 0) {}
            });
        }
    });
    url
}

const IN_FLIGHT: &str = r#"herdguard_in_flight{upstream="u"}"#;

#[tokio::test]
async fn a_caller_that_stops_reading_lets_go_of_its_upstream_slot() {
    let big = upstream(|_| async { http::Response::new(full(vec![b'x'; 32 << 20])) }).await;
    let hg = Binary::start_with(
        "write_timeout = \"500ms\"",
        &format!(
            "[upstreams.u]\nendpoints = [\"{}\"]\nmax_in_flight = 1\nadaptive_concurrency = {{ enabled = false }}\n\
             [[routes]]\nname = \"r\"\nupstream = \"u\"\n",
            big.url()
        ),
    )
    .await;
    // Asks for 32 MiB and reads none of it.
    let mut stuck = stuck_caller(&hg).await;
    eventually(
        std::time::Duration::from_secs(10),
        "the slot comes back",
        || async { hg.metric(IN_FLIGHT).await == 0.0 },
    )
    .await;
    // The only slot serves the next caller again.
    let (status, _, body) = get(&hg, "/next").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body.len(), 32 << 20);
    // The stuck connection was reset, not closed: what the kernel held for
    // it was dropped rather than kept to be sent for as long as it stays.
    let (got, end) = read_to_end(&mut stuck).await;
    assert_eq!(
        end,
        Err(std::io::ErrorKind::ConnectionReset),
        "after {got} bytes"
    );
    assert!(got < 32 << 20, "{got}");
    hg.terminate().await;
}

/// A caller that reads slowly but steadily is never cut by write_timeout,
/// though each write waits far longer than it for the kernel (which wakes
/// a waiting write only once a third of the send buffer is free): the
/// queue the caller takes from is what counts as progress. With a small
/// receive buffer (its window opens 2 KiB at a time), closed after the
/// answer, and with the usual one (it opens only once tens of KiB were
/// read), kept alive: on a closed connection the kernel's own rule takes
/// over (`TCP_USER_TIMEOUT`), which such a caller would not pass at 3 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_reads_slowly_but_steadily_gets_its_whole_answer() {
    const SIZE: usize = 256 << 10;
    let up = upstream(|_| async { http::Response::new(full(vec![b'x'; SIZE])) }).await;
    let routes = format!(
        "[upstreams.u]\nendpoints = [\"{}\"]\n[[routes]]\nname = \"r\"\nupstream = \"u\"\n",
        up.url()
    );
    // 8 KiB every 150 ms (53 KB/s) at write_timeout 300ms: 16 KiB a
    // write_timeout, less than the third of the send buffer that wakes a
    // waiting write. 8 KiB every 200 ms (40 KB/s) at 3s, kept alive: the
    // kernel's own count (TCP_USER_TIMEOUT) would cut it.
    let cases = [
        ("300ms", Some(4096), 150, "close"),
        ("3s", None, 200, "keep-alive"),
    ];
    for (write_timeout, receive_buffer, pause_ms, connection) in cases {
        let hg = Binary::start_with(
            &format!("write_timeout = \"{write_timeout}\"\nsend_buffer = \"64KiB\""),
            &routes,
        )
        .await;
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        if let Some(size) = receive_buffer {
            socket.set_recv_buffer_size(size).unwrap();
        }
        let mut slow = socket.connect(hg.listen.parse().unwrap()).await.unwrap();
        let request = format!("GET /slow HTTP/1.1\r\nHost: a\r\nConnection: {connection}\r\n\r\n");
        slow.write_all(request.as_bytes()).await.unwrap();
        let body_at = |got: &[u8]| {
            got.windows(4)
                .position(|w| w == b"\r\n\r\n")
                .map(|at| at + 4)
        };
        let mut got = Vec::new();
        let mut buf = vec![0u8; 8 << 10];
        let ended = tokio::time::timeout(std::time::Duration::from_secs(30), async {
            loop {
                tokio::time::sleep(std::time::Duration::from_millis(pause_ms)).await;
                match slow.read(&mut buf).await {
                    Ok(0) => break Ok(()),
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                    Err(e) => break Err(e.kind()),
                }
                // Kept alive: whole at its length.
                if body_at(&got).is_some_and(|at| got.len() - at == SIZE) {
                    break Ok(());
                }
            }
        })
        .await
        .expect("read within 30 s");
        let case = format!("write_timeout {write_timeout}, receive buffer {receive_buffer:?}");
        assert_eq!(ended, Ok(()), "{case}: after {} bytes", got.len());
        assert_eq!(body_at(&got).map(|at| got.len() - at), Some(SIZE), "{case}");
        hg.terminate().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_streams_given_no_window_let_go_of_their_upstream_slots() {
    let up = upstream(|_| async { http::Response::new(full(vec![b'x'; 64 << 10])) }).await;
    let hg = Binary::start_with(
        "write_timeout = \"500ms\"",
        &format!(
            "[upstreams.u]\nendpoints = [\"{}\"]\nmax_in_flight = 4\nadaptive_concurrency = {{ enabled = false }}\n\
             [[routes]]\nname = \"r\"\nupstream = \"u\"\nretry = {{ attempts = 1 }}\n\
             breaker = {{ consecutive_failures = 2, open_for = \"30s\" }}\n",
            up.url()
        ),
    )
    .await;
    // One HTTP/2 connection that gives each stream a window of 16 KiB and
    // then reads nothing: four streams take every slot of the upstream.
    let tcp = tokio::net::TcpStream::connect(&hg.listen).await.unwrap();
    let (mut client, conn) = h2::client::Builder::new()
        .initial_window_size(16 << 10)
        .handshake::<_, bytes::Bytes>(tcp)
        .await
        .unwrap();
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut held = Vec::new();
    for _ in 0..4 {
        let req = http::Request::get("http://a/stuck").body(()).unwrap();
        client = client.ready().await.unwrap();
        let (resp, _) = client.send_request(req, true).unwrap();
        let resp = resp.await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        held.push(resp);
    }
    assert_eq!(
        hg.metric(IN_FLIGHT).await,
        4.0,
        "the streams hold the slots"
    );
    // After write_timeout without a frame going out, the slots come back,
    // and other callers are served.
    eventually(
        std::time::Duration::from_secs(5),
        "the slots come back",
        || async { hg.metric(IN_FLIGHT).await == 0.0 },
    )
    .await;
    let (status, _, body) = get(&hg, "/next").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body.len(), 64 << 10);
    // The callers read on: their answers end broken off (the upstream
    // connections behind them were closed), which is the callers' doing,
    // not a failure of the upstream: the path's breaker stays closed.
    for resp in held {
        let mut body = resp.into_body();
        let mut got = 0;
        while let Some(Ok(chunk)) = body.data().await {
            got += chunk.len();
            let _ = body.flow_control().release_capacity(chunk.len());
        }
        assert!(got < 64 << 10, "{got}");
    }
    for _ in 0..3 {
        let (status, headers, _) = get(&hg, "/stuck").await;
        assert_eq!(status, StatusCode::OK, "{headers:?}");
    }
    hg.terminate().await;
}

#[tokio::test]
async fn an_upstream_that_stops_sending_its_body_is_cut_off() {
    let url = hanging_upstream(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nabc").await;
    let hg = Binary::start_with("write_timeout = \"500ms\"", &config(&url)).await;
    let answer = raw(
        &hg,
        b"GET /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        answer.ends_with("abc"),
        "the caller got what came, then the close: {answer}"
    );
    eventually(
        std::time::Duration::from_secs(5),
        "the slot comes back",
        || async { hg.metric(IN_FLIGHT).await == 0.0 },
    )
    .await;
    hg.terminate().await;
}

#[tokio::test]
async fn an_h2_connection_that_resets_what_it_asks_for_is_closed() {
    let held = held_upstream("never sent").await;
    let hg = Binary::start(&config(&held.upstream.url())).await;
    let tcp = tokio::net::TcpStream::connect(&hg.listen).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut reset = 0;
    for i in 0..400 {
        let Ok(mut ready) = client.clone().ready().await else {
            break;
        };
        let req = http::Request::get(format!("http://a/r/{i}"))
            .body(())
            .unwrap();
        let Ok((_resp, mut stream)) = ready.send_request(req, true) else {
            break;
        };
        // Reset only once the proxy has started the upstream's work.
        let arrived = held.arrived.notified();
        if tokio::time::timeout(std::time::Duration::from_secs(2), arrived)
            .await
            .is_err()
        {
            break;
        }
        stream.send_reset(h2::Reason::CANCEL);
        reset += 1;
    }
    let tolerated = 100;
    assert!(
        reset < 400,
        "the connection was closed after {reset} resets"
    );
    assert!(
        held.upstream.hits() <= tolerated + 5,
        "{} requests reached the upstream",
        held.upstream.hits()
    );
    hg.terminate().await;
}

#[tokio::test]
async fn a_switch_of_protocols_nobody_asked_for_is_a_bad_response() {
    let (url, _) = raw_upstream(
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: evil\r\nConnection: upgrade\r\n\r\n"
            .to_vec(),
    )
    .await;
    let hg = Binary::start(&config(&url)).await;
    let (status, headers, _) = get(&hg, "/plain").await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    assert_eq!(headers.get("x-herdguard-error").unwrap(), "bad-response");
    hg.terminate().await;
}

#[tokio::test]
async fn an_upstream_cannot_pose_as_the_proxy() {
    let (url, _) = raw_upstream(
        b"HTTP/1.1 503 Busy\r\nx-herdguard-error: circuit-open\r\nContent-Length: 0\r\n\r\n"
            .to_vec(),
    )
    .await;
    let hg = Binary::start(&format!(
        "[upstreams.u]\nendpoints = [\"{url}\"]\n[[routes]]\nname = \"r\"\nupstream = \"u\"\nretry = {{ attempts = 1 }}\n"
    ))
    .await;
    let (status, headers, _) = get(&hg, "/x").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(headers.get("x-herdguard-error").is_none(), "{headers:?}");
    hg.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_the_upstream_breaks_off_count_against_it() {
    // Headers, 3 of 100 bytes, then the connection closes.
    let broken = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nabc".to_vec();
    // One endpoint that always breaks off: the route's breaker opens.
    let (url, seen) = raw_upstream(broken.clone()).await;
    let hg = Binary::start(&config(&url)).await;
    for i in 0..5 {
        let answer = raw(
            &hg,
            format!("GET /b/{i} HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(
            !answer.contains("abc\r\n"),
            "the caller sees the body cut: {answer}"
        );
    }
    assert_eq!(seen.load(Ordering::SeqCst), 5);
    eventually(
        std::time::Duration::from_secs(5),
        "the breaker opens",
        || async {
            hg.metric(r#"herdguard_breaker_transitions_total{route="r",to="open"}"#)
                .await
                >= 1.0
        },
    )
    .await;
    hg.terminate().await;

    // Beside a healthy endpoint, the one that breaks off is ejected.
    let (url, _) = raw_upstream(broken).await;
    let good = ok_upstream("fine").await;
    let hg = Binary::start(&format!(
        "[upstreams.u]\nendpoints = [\"{}\", \"{url}\"]\n[[routes]]\nname = \"r\"\nupstream = \"u\"\n",
        good.url()
    ))
    .await;
    for i in 0..12 {
        let _ = raw(
            &hg,
            format!("GET /b/{i} HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await;
    }
    let ejected = format!("herdguard_endpoint_ejected{{upstream=\"u\",endpoint=\"{url}\"}}");
    eventually(
        std::time::Duration::from_secs(5),
        "the endpoint is ejected",
        || async { hg.metric(&ejected).await == 1.0 },
    )
    .await;
    hg.terminate().await;
}

#[tokio::test]
async fn an_invalid_http2_preface_gets_goaway() {
    use tokio::io::AsyncReadExt as _;
    let up = ok_upstream("fine").await;
    let hg = Binary::start(&config(&up.url())).await;
    let mut stream = tokio::net::TcpStream::connect(&hg.listen).await.unwrap();
    stream
        .write_all(b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(
        std::time::Duration::from_secs(5),
        stream.read_to_end(&mut answer),
    )
    .await
    .expect("closed")
    .unwrap();
    // One frame: GOAWAY (type 7) on stream 0, error PROTOCOL_ERROR (1).
    assert_eq!(answer.len(), 17, "{answer:?}");
    assert_eq!(answer[3], 0x7, "a GOAWAY frame");
    assert_eq!(&answer[13..17], &[0, 0, 0, 1], "PROTOCOL_ERROR");
    assert_eq!(up.hits(), 0);
    hg.terminate().await;
}

/// A raw upstream that answers `head` and then `body` one byte every
/// `every`, then closes.
async fn drip_upstream(
    head: &'static [u8],
    body: &'static [u8],
    every: std::time::Duration,
) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                if !read_head(&mut stream).await {
                    return;
                }
                let _ = stream.write_all(head).await;
                for b in body {
                    tokio::time::sleep(every).await;
                    if stream.write_all(&[*b]).await.is_err() {
                        return;
                    }
                }
                let _ = stream.shutdown().await;
            });
        }
    });
    url
}

/// A row of the fault matrix.
type Case = (
    &'static str,
    &'static str,
    Vec<u8>,
    u16,
    Option<&'static [u8]>,
    usize,
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_matrix_the_caller_gets_what_the_upstream_sent_or_an_honest_error() {
    // (what, request method, upstream's bytes, status the caller gets,
    //  body the caller gets (None: cut short), requests the upstream sees)
    let chunked_cut =
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n".to_vec();
    let cases: Vec<Case> = vec![
        (
            "1xx then 200",
            "GET",
            b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello".to_vec(),
            200,
            Some(b"hello"),
            1,
        ),
        (
            "204 with a body",
            "GET",
            b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\nhello".to_vec(),
            204,
            Some(b""),
            1,
        ),
        (
            "304 with a body",
            "GET",
            b"HTTP/1.1 304 Not Modified\r\nContent-Length: 5\r\n\r\nhello".to_vec(),
            304,
            Some(b""),
            1,
        ),
        (
            "HEAD answered with a body",
            "HEAD",
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello".to_vec(),
            200,
            Some(b""),
            1,
        ),
        (
            "closed before any byte of the answer (retried: GET)",
            "GET",
            Vec::new(),
            502,
            None,
            3,
        ),
        ("chunked body cut mid-way", "GET", chunked_cut, 200, None, 1),
        (
            "Content-Length body cut mid-way",
            "GET",
            b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhello".to_vec(),
            200,
            None,
            1,
        ),
    ];
    for (what, method, response, status, body, seen_want) in cases {
        let (url, seen) = raw_upstream(response).await;
        let hg = Binary::start(&config(&url)).await;
        let answer = raw(
            &hg,
            format!("{method} /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await;
        assert!(
            answer.starts_with(&format!("HTTP/1.1 {status}")),
            "{what}: {answer}"
        );
        let got = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b);
        if status < 500 {
            match body {
                Some(want) => assert_eq!(got.as_bytes(), want, "{what}: byte-exact: {answer}"),
                None => {
                    let whole = (answer.to_ascii_lowercase().contains("content-length: 10")
                        && got.len() == 10)
                        || got.ends_with("0\r\n\r\n");
                    assert!(!whole, "{what}: the cut shows: {answer:?}");
                }
            }
        }
        assert_eq!(
            seen.load(Ordering::SeqCst),
            seen_want,
            "{what}: requests upstream"
        );
        hg.terminate().await;
    }

    // A slow drip of 40 bytes over 2 s, under write_timeout: all of it, byte-exact.
    const BODY: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyz!@#$";
    let url = drip_upstream(
        b"HTTP/1.1 200 OK\r\nContent-Length: 40\r\n\r\n",
        BODY,
        std::time::Duration::from_millis(50),
    )
    .await;
    let hg = Binary::start(&config(&url)).await;
    let (status, _, body) = get(&hg, "/drip").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(&body[..], BODY, "a slow body comes whole");

    // A large body, byte for byte.
    let big: Vec<u8> = (0..(1u32 << 20))
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    let expected = big.clone();
    let up = upstream(move |_| {
        let big = big.clone();
        async move { http::Response::new(full(big)) }
    })
    .await;
    hg.terminate().await;
    let hg = Binary::start(&config(&up.url())).await;
    let (status, _, body) = get(&hg, "/big").await;
    assert_eq!(status, StatusCode::OK);
    assert!(body[..] == expected[..], "1 MiB byte for byte");
    hg.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_stalls_mid_body_for_an_h2_caller_is_blamed() {
    // Headers and 3 of 100 bytes, then nothing: beside a healthy endpoint.
    let url = hanging_upstream(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nabc").await;
    let good = ok_upstream("fine").await;
    let hg = Binary::start_with(
        "write_timeout = \"300ms\"",
        &format!(
            "[upstreams.u]\nendpoints = [\"{}\", \"{url}\"]\n[[routes]]\nname = \"r\"\nupstream = \"u\"\n",
            good.url()
        ),
    )
    .await;
    // HTTP/2 callers that read everything they are given.
    let calls: Vec<_> = (0..12)
        .map(|i| {
            let listen = hg.listen.clone();
            tokio::spawn(async move {
                let req = http::Request::get(format!("http://{listen}/s/{i}"))
                    .body(empty())
                    .unwrap();
                if let Ok(resp) = h2c_client().request(req).await {
                    let _ = http_body_util::BodyExt::collect(resp.into_body()).await;
                }
            })
        })
        .collect();
    for c in calls {
        c.await.unwrap();
    }
    let ejected = format!("herdguard_endpoint_ejected{{upstream=\"u\",endpoint=\"{url}\"}}");
    eventually(
        std::time::Duration::from_secs(5),
        "the stalling endpoint is ejected",
        || async { hg.metric(&ejected).await == 1.0 },
    )
    .await;
    hg.terminate().await;
}

/// An HTTP/2 connection whose streams get no flow-control window would
/// keep its connection slot for ever: closing it gracefully waits for
/// every stream. Asked to close (idle), it is closed outright once nothing
/// went out for write_timeout, and its slot serves another caller.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_gives_no_window_does_not_keep_its_slot() {
    let up = upstream(|_| async { http::Response::new(full(vec![b'x'; 64 << 10])) }).await;
    let hg = Binary::start_with(
        "write_timeout = \"300ms\"\nidle_timeout = \"300ms\"\nmax_connections = 2",
        &config(&up.url()),
    )
    .await;
    let mut closed = Vec::new();
    for _ in 0..2 {
        let tcp = tokio::net::TcpStream::connect(&hg.listen).await.unwrap();
        let (mut client, conn) = h2::client::Builder::new()
            .initial_window_size(0)
            .handshake::<_, bytes::Bytes>(tcp)
            .await
            .unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let _ = conn.await;
            let _ = tx.send(());
        });
        let req = http::Request::get("http://a/stuck").body(()).unwrap();
        client = client.ready().await.unwrap();
        let (resp, _) = client.send_request(req, true).unwrap();
        assert_eq!(resp.await.unwrap().status(), StatusCode::OK);
        closed.push((client, rx));
    }
    // Both slots taken; each connection is closed by the proxy.
    for (_client, rx) in closed {
        tokio::time::timeout(std::time::Duration::from_secs(10), rx)
            .await
            .expect("the proxy closed the connection")
            .unwrap();
    }
    let (status, _, body) = get(&hg, "/next").await;
    assert_eq!((status, body.len()), (StatusCode::OK, 64 << 10));
    hg.terminate().await;
}

/// Rapid reset against a full upstream: the streams the proxy sheds at once
/// (503 overloaded) are not "answered" credit for a connection that resets
/// every stream that did reach the upstream; it is still closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shed_streams_do_not_shield_a_rapid_reset() {
    let held = held_upstream("never sent").await;
    let hg = Binary::start(&format!(
        "[upstreams.u]\nendpoints = [\"{}\"]\nmax_in_flight = 4\nadaptive_concurrency = {{ enabled = false }}\n\
         [[routes]]\nname = \"r\"\nupstream = \"u\"\n",
        held.upstream.url()
    ))
    .await;
    let tcp = tokio::net::TcpStream::connect(&hg.listen).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut batches = 0;
    'attack: for batch in 0..100 {
        // Fifty streams at once: four reach the upstream, the rest are shed.
        let mut streams = Vec::new();
        for i in 0..50 {
            let Ok(mut ready) = client.clone().ready().await else {
                break 'attack;
            };
            let req = http::Request::get(format!("http://a/r/{batch}/{i}"))
                .body(())
                .unwrap();
            let Ok(pair) = ready.send_request(req, true) else {
                break 'attack;
            };
            streams.push(pair);
        }
        // Those answered at once are the shed ones; the rest are reset.
        for (resp, mut stream) in streams {
            let quick = tokio::time::timeout(std::time::Duration::from_millis(20), resp).await;
            if quick.is_err() {
                stream.send_reset(h2::Reason::CANCEL);
            }
        }
        batches += 1;
    }
    assert!(batches < 100, "the connection was never closed");
    assert!(
        held.upstream.hits() <= 100 + 8,
        "{} requests reached the upstream",
        held.upstream.hits()
    );
    hg.terminate().await;
}

/// An upstream that answers informational heads (`103 Early Hints`)
/// without end is cut once it has sent 64 KiB of them: 502
/// `bad-response`, not retried, well before the attempt's timeout; a few
/// of them before the answer are read past.
#[tokio::test]
async fn informational_answers_without_end_are_a_bad_response() {
    let hint = b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n";
    for (hints, answered) in [(10usize, true), (1_000_000, false)] {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let seen = Arc::new(AtomicUsize::new(0));
        let count = seen.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let count = count.clone();
                tokio::spawn(async move {
                    if !read_head(&mut stream).await {
                        return;
                    }
                    count.fetch_add(1, Ordering::SeqCst);
                    let many = hint.repeat(100);
                    for _ in 0..hints / 100 {
                        if stream.write_all(&many).await.is_err() {
                            return;
                        }
                    }
                    let _ = stream
                        .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                        .await;
                });
            }
        });
        let hg = Binary::start(&config(&url).replace(
            "retry = {",
            "retry = { timeout = \"120s\", per_try_timeout = \"60s\", ",
        ))
        .await;
        let (status, headers, body) = get(&hg, "/hints").await;
        match answered {
            true => assert_eq!((status, &body[..]), (StatusCode::OK, &b"ok"[..])),
            false => {
                assert_eq!(status, StatusCode::BAD_GATEWAY, "{body:?}");
                assert_eq!(headers.get("x-herdguard-error").unwrap(), "bad-response");
                assert_eq!(seen.load(Ordering::SeqCst), 1, "not retried");
            }
        }
        hg.terminate().await;
    }
}
