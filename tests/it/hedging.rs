//! Hedging through the binary: `retry.hedge_after` sends a second attempt
//! when the first has no answer after that long; the first answer wins and
//! the other is cancelled, its connection closed. Hedges are paid for by
//! the retry budget, and never sent for a request that is not safe to
//! repeat or when the budget is empty.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::process::Binary;
use common::*;
use http::{Request, Response};
use tokio::io::AsyncReadExt;

/// How long a slow answer takes.
const SLOW: Duration = Duration::from_millis(400);

/// Two endpoints sharing one count of requests: every tenth request they
/// get (the 10th, the 20th…) is answered after [`SLOW`] and marked
/// `x-slow`; `/slow` always is.
async fn tail_upstreams() -> (Upstream, Upstream, Arc<AtomicUsize>) {
    let count = Arc::new(AtomicUsize::new(0));
    let serve = |count: Arc<AtomicUsize>| {
        move |req: Request<hyper::body::Incoming>| {
            let count = count.clone();
            async move {
                let n = count.fetch_add(1, Ordering::SeqCst) + 1;
                let slow = n.is_multiple_of(10) || req.uri().path() == "/slow";
                let mut resp = Response::builder();
                if slow {
                    tokio::time::sleep(SLOW).await;
                    resp = resp.header("x-slow", "1");
                }
                resp.body(full("ok")).unwrap()
            }
        }
    };
    let a = upstream(serve(count.clone())).await;
    let b = upstream(serve(count.clone())).await;
    (a, b, count)
}

fn config(a: &Upstream, b: &Upstream, retry: &str) -> String {
    format!(
        "[upstreams.api]\nendpoints = [\"{}\", \"{}\"]\n\
         [[routes]]\nname = \"api\"\nupstream = \"api\"\n\
         retry = {{ hedge_after = \"50ms\", {retry} }}\n",
        a.url(),
        b.url()
    )
}

async fn call(hg: &Binary, method: &str, path: &str) -> (http::HeaderMap, Duration) {
    let req = Request::builder()
        .method(method)
        .uri(format!("http://{}{path}", hg.listen))
        .header("x-herdguard-explain", "1")
        .body(empty())
        .unwrap();
    let began = Instant::now();
    let (status, headers, _) = send(&client(), req).await;
    assert_eq!(status, http::StatusCode::OK);
    (headers, began.elapsed())
}

/// Every tenth answer takes 400 ms: with `hedge_after = "50ms"` no caller
/// waits for one (a hedge answers first), and the upstream sees one extra
/// request per slow answer, 10% more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hedge_cuts_the_slow_tail_for_a_tenth_more_requests() {
    let (a, b, count) = tail_upstreams().await;
    let hg = Binary::start_with("explain = true", &config(&a, &b, "")).await;
    // A route that hedges shows its hedge counts from the start, at zero.
    let text = hg.metrics().await;
    for result in ["won", "lost"] {
        let series = format!(r#"herdguard_hedges_total{{route="api",result="{result}"}}"#);
        assert_eq!(metric(&text, &series), Some(0.0), "{series}");
    }
    let mut latencies = Vec::new();
    for _ in 0..100 {
        let (headers, took) = call(&hg, "GET", "/").await;
        assert!(
            !headers.contains_key("x-slow"),
            "a slow answer reached the caller: {:?}",
            headers.get("x-herdguard-explain")
        );
        latencies.push(took);
    }
    latencies.sort();
    let slowest = latencies[latencies.len() - 1];
    eprintln!("100 calls: median {:?}, slowest {slowest:?}", latencies[50]);
    // Waiting for a slow answer takes 400 ms by construction.
    assert!(
        slowest < SLOW,
        "a caller waited for a slow answer: {slowest:?}"
    );

    let sent = count.load(Ordering::SeqCst);
    assert!(sent <= 115, "{sent} requests upstream for 100 calls");
    let won = hg
        .metric(r#"herdguard_hedges_total{route="api",result="won"}"#)
        .await;
    let superseded = hg
        .metric(
            r#"herdguard_upstream_attempts_total{route="api",upstream="api",outcome="superseded"}"#,
        )
        .await;
    assert_eq!(won as usize, sent - 100, "one hedge per extra request");
    assert_eq!(superseded, won, "each won hedge cancelled a slow attempt");
    assert!(won >= 9.0, "{won} hedges for 10 slow answers");
    // Every family in the exposition, the hedges' included, says what it is.
    let text = hg.metrics().await;
    for family in text.lines().filter_map(|l| l.strip_prefix("# TYPE ")) {
        let name = family.split_whitespace().next().unwrap();
        assert!(
            text.contains(&format!("# HELP {name} ")),
            "{name} has no HELP line"
        );
    }
    hg.terminate().await;
}

/// A hedge is paid from the retry budget: with nothing in it, the slow
/// answer is waited for and nothing more is sent. And a request that is
/// not safe to repeat is never hedged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_hedge_from_an_empty_budget_or_for_an_unsafe_request() {
    let (a, b, count) = tail_upstreams().await;
    let retry = "budget = { ratio = 0.0, min_per_second = 0 }";
    let hg = Binary::start_with("explain = true", &config(&a, &b, retry)).await;
    let mut slow = 0;
    for _ in 0..20 {
        let (headers, _) = call(&hg, "GET", "/").await;
        if headers.contains_key("x-slow") {
            slow += 1;
            let trace = &explained(&headers);
            assert!(trace.contains("hedge-skip=budget"), "{trace}");
        }
    }
    assert_eq!(slow, 2, "the slow answers were waited for");
    assert_eq!(count.load(Ordering::SeqCst), 20, "no hedge was sent");
    let skipped = hg
        .metric(r#"herdguard_hedges_skipped_total{route="api",reason="budget"}"#)
        .await;
    assert_eq!(skipped, 2.0);
    hg.terminate().await;

    // A POST without an idempotency key: sent once, however slow.
    let (a, b, count) = tail_upstreams().await;
    let hg = Binary::start_with("explain = true", &config(&a, &b, "")).await;
    let (headers, _) = call(&hg, "POST", "/slow").await;
    assert_eq!(headers["x-herdguard-attempts"], "1");
    assert_eq!(count.load(Ordering::SeqCst), 1);
    // The same path by GET is hedged (both answers are slow here: the
    // first one sent wins).
    let (headers, _) = call(&hg, "GET", "/slow").await;
    assert_eq!(headers["x-herdguard-attempts"], "2");
    let trace = &explained(&headers);
    assert!(trace.starts_with("hedge@50ms;1=200@"), "{trace}");
    assert!(trace.ends_with(";2=superseded"), "{trace}");
    hg.terminate().await;
}

/// The losing attempt is cancelled and its connection closed: an upstream
/// that never answers sees its connection end once the hedge has answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_losers_connection_is_closed() {
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_addr = silent.local_addr().unwrap();
    let (closed_tx, mut closed_rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = silent.accept().await else {
                return;
            };
            let closed = closed_tx.clone();
            tokio::spawn(async move {
                // Read the request, answer nothing, and report the end.
                let mut buf = vec![0u8; 4096];
                let mut got = 0;
                loop {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => got += n,
                    }
                }
                let _ = closed.send(got);
            });
        }
    });
    let fast = ok_upstream("fast").await;
    let toml = format!(
        "[upstreams.api]\nendpoints = [\"http://{silent_addr}\", \"{}\"]\noutlier = {{ enabled = false }}\n\
         [[routes]]\nname = \"api\"\nupstream = \"api\"\n\
         retry = {{ hedge_after = \"50ms\", per_try_timeout = \"10s\", timeout = \"20s\" }}\n",
        fast.url()
    );
    let hg = Binary::start_with("explain = true", &toml).await;
    // Endpoints are taken in turn: within two calls one starts on the silent one.
    let mut hedged = false;
    for _ in 0..2 {
        let (headers, _) = call(&hg, "GET", "/").await;
        let trace = explained(&headers);
        if trace.contains("hedge@") {
            assert!(trace.starts_with("hedge@50ms;2=200@"), "{trace}");
            assert!(trace.ends_with(";1=superseded"), "{trace}");
            hedged = true;
        }
    }
    assert!(hedged, "one call started on the silent endpoint");
    let got = tokio::time::timeout(Duration::from_secs(5), closed_rx.recv())
        .await
        .expect("the silent endpoint's connection was closed")
        .expect("a report");
    assert!(got > 0, "it had the request");
    hg.terminate().await;
}

/// `check` warns about a `hedge_after` that can never fire, and refuses zero.
#[test]
fn check_warns_about_a_hedge_that_never_goes() {
    let upstream = "[upstreams.u]\nendpoints = [\"http://127.0.0.1:3000\"]\n";
    let warnings = |retry: &str| {
        herdguard::config::Config::check_str(&format!(
            "{upstream}[[routes]]\nname = \"r\"\nupstream = \"u\"\nretry = {{ {retry} }}\n"
        ))
        .unwrap()
        .warnings
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
    };
    assert!(warnings("hedge_after = \"50ms\"").is_empty());
    let late = warnings("hedge_after = \"2s\", per_try_timeout = \"1s\"");
    assert!(
        late.iter()
            .any(|w| w.starts_with("routes[0].retry.hedge_after (line 6)")
                && w.contains("per_try_timeout")),
        "{late:?}"
    );
    let single = warnings("hedge_after = \"50ms\", attempts = 1");
    assert!(
        single.iter().any(|w| w.contains("attempts = 1")),
        "{single:?}"
    );
    let zero = herdguard::config::Config::check_str(&format!(
        "{upstream}[[routes]]\nname = \"r\"\nupstream = \"u\"\nretry = {{ hedge_after = \"0s\" }}\n"
    ))
    .err()
    .map(|e| e.to_string())
    .unwrap_or_default();
    assert!(zero.contains("hedge_after"), "{zero}");
}

/// An upgrade is a connection to keep, not an answer to race for: a slow
/// WebSocket handshake is never hedged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_is_never_hedged() {
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let handshakes = Arc::new(AtomicUsize::new(0));
    let counted = handshakes.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let counted = counted.clone();
            tokio::spawn(async move {
                if !read_head(&mut stream).await {
                    return;
                }
                counted.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(200)).await;
                let _ = stream
                    .write_all(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
                    .await;
                tokio::time::sleep(Duration::from_secs(2)).await;
            });
        }
    });
    let toml = format!(
        "[upstreams.ws]\nendpoints = [\"http://{addr}\"]\n\
         [[routes]]\nname = \"ws\"\nupstream = \"ws\"\nretry = {{ hedge_after = \"50ms\" }}\n"
    );
    let hg = Binary::start_with("explain = true", &toml).await;
    let mut caller = tokio::net::TcpStream::connect(&hg.listen).await.unwrap();
    caller
        .write_all(
            b"GET /chat HTTP/1.1\r\nHost: a\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
              Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
        )
        .await
        .unwrap();
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = tokio::time::timeout(
            Duration::from_secs(5),
            tokio::io::AsyncReadExt::read(&mut caller, &mut buf),
        )
        .await
        .expect("an answer")
        .unwrap();
        assert!(n > 0);
        head.extend_from_slice(&buf[..n]);
    }
    assert!(
        head.starts_with(b"HTTP/1.1 101"),
        "{}",
        String::from_utf8_lossy(&head)
    );
    assert_eq!(
        handshakes.load(Ordering::SeqCst),
        1,
        "one handshake upstream"
    );
    hg.terminate().await;
}
