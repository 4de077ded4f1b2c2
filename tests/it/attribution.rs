//! Whose fault a failure is, through the real binary: what a caller does
//! (a malformed body, hanging up, a slow upload) never counts against the
//! upstream; the deadline's cut is not the upstream's timeout; a retry
//! refused after it was paid for gives its token back and passes the
//! upstream's answer on; and what makes a request safe to repeat is read
//! from what the upstream will see.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::process::Binary;
use common::*;
use http::{Response, StatusCode};
use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// One upstream `u` and one catch-all route `r` with these `retry` and
/// `breaker` tables (inline TOML, without braces).
fn route(url: &str, retry: &str, breaker: &str) -> String {
    format!(
        "[upstreams.u]\nendpoints = [\"{url}\"]\n[[routes]]\nname = \"r\"\nupstream = \"u\"\n\
         retry = {{ {retry} }}\nbreaker = {{ {breaker} }}\n"
    )
}

/// An answer read off a raw connection.
#[derive(Debug)]
struct Answer {
    status: u16,
    head: String,
    body: String,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }
}

/// Sends `head`, then `chunks` in chunked framing, one every `pace`, and
/// reads the whole answer (the request says `Connection: close`).
async fn exchange(addr: &str, head: &str, chunks: Vec<Vec<u8>>, pace: Duration) -> Answer {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(head.as_bytes()).await.unwrap();
    let chunked = !chunks.is_empty();
    for chunk in chunks {
        stream
            .write_all(format!("{:x}\r\n", chunk.len()).as_bytes())
            .await
            .unwrap();
        stream.write_all(&chunk).await.unwrap();
        stream.write_all(b"\r\n").await.unwrap();
        tokio::time::sleep(pace).await;
    }
    if chunked {
        stream.write_all(b"0\r\n\r\n").await.unwrap();
    }
    let mut out = Vec::new();
    stream.read_to_end(&mut out).await.unwrap();
    parse(&out)
}

/// Sends one request with no body (or one written into `head`).
async fn request(addr: &str, head: &str) -> Answer {
    exchange(addr, head, vec![], Duration::ZERO).await
}

/// PUTs `count` chunks of `size` bytes to `path`, one every `pace`.
async fn slow_put(addr: &str, path: &str, size: usize, count: usize, pace: Duration) -> Answer {
    let head = format!(
        "PUT {path} HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    );
    exchange(addr, &head, vec![vec![b'x'; size]; count], pace).await
}

fn parse(raw: &[u8]) -> Answer {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    Answer {
        status,
        head: head.to_owned(),
        body: body.to_owned(),
    }
}

/// The sum of every series that starts with `prefix`.
fn sum(text: &str, prefix: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

const BREAKER_CLOSED: &str = r#"herdguard_breaker_state{route="r"}"#;
const LIMIT: &str = r#"herdguard_concurrency_limit{upstream="u"}"#;

fn attempts_with(outcome: &str) -> String {
    format!(r#"herdguard_upstream_attempts_total{{route="r",upstream="u",outcome="{outcome}"}}"#)
}

fn skipped(reason: &str) -> String {
    format!(r#"herdguard_retries_skipped_total{{route="r",reason="{reason}"}}"#)
}

fn retries(reason: &str) -> String {
    format!(r#"herdguard_retries_total{{route="r",reason="{reason}"}}"#)
}

#[tokio::test]
async fn a_malformed_body_is_the_callers_400_and_never_opens_the_breaker() {
    let up = echo_upstream().await;
    let hg = Binary::start(&route(&up.url(), "", "")).await;
    for _ in 0..30 {
        let answer = request(&hg.listen, "PUT /things/1 HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\nZZ\r\nhello\r\n0\r\n\r\n")
        .await;
        assert_eq!(answer.status, 400, "{answer:?}");
        assert_eq!(answer.header("x-herdguard-error"), Some("bad-request"));
        assert!(answer.body.contains("malformed"), "{answer:?}");
        assert_eq!(answer.header("x-herdguard-attempts"), Some("1"));
    }
    let text = hg.metrics().await;
    assert_eq!(metric(&text, BREAKER_CLOSED), Some(0.0), "{text}");
    assert_eq!(
        metric(&text, &attempts_with("caller-malformed")),
        Some(30.0)
    );
    for blamed in ["5xx", "reset", "timeout"] {
        assert_eq!(metric(&text, &attempts_with(blamed)), Some(0.0), "{blamed}");
    }
    assert_eq!(
        sum(&text, "herdguard_retries_total{"),
        0.0,
        "no retry:\n{text}"
    );
    assert_eq!(metric(&text, LIMIT), Some(20.0), "the initial limit");
    // Everyone else is still served.
    let req = http::Request::get(format!("http://{}/", hg.listen))
        .body(empty())
        .unwrap();
    assert_eq!(send(&client(), req).await.0, StatusCode::OK);
    hg.terminate().await;
}

#[tokio::test]
async fn callers_who_hang_up_cost_the_upstream_nothing() {
    let up = upstream(|_| async {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        Response::new(full("slow but fine"))
    })
    .await;
    let hg = Binary::start(&route(&up.url(), "", "")).await;
    let callers: Vec<_> = (0..80)
        .map(|_| {
            let addr = hg.listen.clone();
            tokio::spawn(async move {
                let mut stream = TcpStream::connect(&addr).await.unwrap();
                stream
                    .write_all(b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\n")
                    .await
                    .unwrap();
                let mut buf = [0u8; 64];
                // The caller gives up after 700 ms and hangs up.
                let read = tokio::time::timeout(Duration::from_millis(700), stream.read(&mut buf));
                assert!(read.await.is_err(), "no answer within 700 ms");
            })
        })
        .collect();
    for c in callers {
        c.await.unwrap();
    }
    let cancelled = attempts_with("cancelled");
    eventually(Duration::from_secs(10), "every hang-up is seen", || async {
        hg.metric(&cancelled).await == 80.0
    })
    .await;
    let text = hg.metrics().await;
    assert_eq!(metric(&text, BREAKER_CLOSED), Some(0.0), "{text}");
    assert_eq!(metric(&text, LIMIT), Some(20.0), "{text}");
    assert_eq!(metric(&text, &attempts_with("timeout")), Some(0.0));
    let req = http::Request::get(format!("http://{}/", hg.listen))
        .body(empty())
        .unwrap();
    assert_eq!(send(&client(), req).await.0, StatusCode::OK);
    hg.terminate().await;
}

/// An upstream that reads each request body whole, records its length, and
/// answers `status`.
async fn reading_upstream(status: u16) -> (Upstream, Arc<std::sync::Mutex<Vec<usize>>>) {
    let lengths = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = lengths.clone();
    let up = upstream(move |req| {
        let seen = seen.clone();
        async move {
            let body = req.into_body().collect().await.map(|b| b.to_bytes());
            seen.lock()
                .unwrap()
                .push(body.as_ref().map_or(0, Bytes::len));
            let mut resp = Response::new(full("read"));
            *resp.status_mut() = StatusCode::from_u16(status).unwrap();
            resp
        }
    })
    .await;
    (up, lengths)
}

#[tokio::test]
async fn a_body_over_max_replay_body_is_sent_once_however_slow_its_upload() {
    let (up, lengths) = reading_upstream(503).await;
    let hg = Binary::start(&route(&up.url(), r#"per_try_timeout = "1s""#, "")).await;
    // 3 MiB at about 2 MiB/s: the upload alone outlasts the per-try timeout.
    let pace = Duration::from_millis(31);
    let answer = slow_put(&hg.listen, "/blob", 64 * 1024, 48, pace).await;
    assert_eq!(answer.status, 503, "the upstream's answer: {answer:?}");
    assert_eq!(answer.header("x-herdguard-attempts"), Some("1"));
    assert_eq!(answer.header("x-herdguard-error"), None);
    assert_eq!(
        *lengths.lock().unwrap(),
        vec![3 * 1024 * 1024],
        "sent once, whole"
    );
    let text = hg.metrics().await;
    assert_eq!(
        metric(&text, &skipped("body_too_large")),
        Some(1.0),
        "{text}"
    );
    assert_eq!(metric(&text, &retries("timeout")), Some(0.0), "{text}");
    assert_eq!(metric(&text, &attempts_with("timeout")), Some(0.0));
    hg.terminate().await;
}

#[tokio::test]
async fn per_try_time_starts_when_the_upload_ends() {
    let (up, lengths) = reading_upstream(200).await;
    let hg = Binary::start(&route(&up.url(), r#"per_try_timeout = "500ms""#, "")).await;
    // 32 KiB, well under max_replay_body, uploaded over about 1.2 s.
    let pace = Duration::from_millis(150);
    let answer = slow_put(&hg.listen, "/doc", 4 * 1024, 8, pace).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(answer.header("x-herdguard-attempts"), Some("1"));
    assert_eq!(*lengths.lock().unwrap(), vec![32 * 1024]);
    let text = hg.metrics().await;
    assert_eq!(
        metric(&text, &attempts_with("timeout")),
        Some(0.0),
        "{text}"
    );
    assert_eq!(metric(&text, &attempts_with("ok")), Some(1.0));
    assert_eq!(metric(&text, BREAKER_CLOSED), Some(0.0));
    hg.terminate().await;
}

#[tokio::test]
async fn a_retry_needs_time_left_and_the_deadline_is_not_the_upstreams_timeout() {
    let hung = held_upstream("too late").await;
    let hg = Binary::start(&route(
        &hung.upstream.url(),
        r#"attempts = 5, timeout = "1s", per_try_timeout = "400ms", backoff = { base = "10ms", jitter = "none" }"#,
        "",
    ))
    .await;
    let answer = request(
        &hg.listen,
        "GET /hangs HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(answer.status, 504, "{answer:?}");
    // Two attempts of 400 ms; a third would start with under 200 ms left.
    assert_eq!(answer.header("x-herdguard-attempts"), Some("2"));
    let text = hg.metrics().await;
    assert_eq!(
        metric(&text, &attempts_with("timeout")),
        Some(2.0),
        "{text}"
    );
    assert_eq!(metric(&text, &skipped("deadline")), Some(1.0), "{text}");
    assert_eq!(metric(&text, &retries("timeout")), Some(1.0));
    hung.release.notify_waiters();
    hg.terminate().await;
}

#[tokio::test]
async fn a_retry_refused_after_it_was_paid_for_refunds_and_passes_the_upstreams_answer_on() {
    let arrived = Arc::new(AtomicUsize::new(0));
    let count = arrived.clone();
    let up = upstream(move |_| {
        count.fetch_add(1, Ordering::SeqCst);
        async {
            Response::builder()
                .status(503)
                .header("x-from", "upstream")
                .body(full("upstream says no"))
                .unwrap()
        }
    })
    .await;
    let hg = Binary::start(&route(
        &up.url(),
        r#"attempts = 2, backoff = { base = "1s", jitter = "none" }"#,
        "consecutive_failures = 1, probe_interval = \"1h\"",
    ))
    .await;
    let addr = hg.listen.clone();
    let first = tokio::spawn(async move {
        request(
            &addr,
            "GET /a HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
        )
        .await
    });
    eventually(
        Duration::from_secs(5),
        "the first request reached the upstream",
        || {
            let arrived = arrived.clone();
            async move { arrived.load(Ordering::SeqCst) == 1 }
        },
    )
    .await;
    // While the first waits out its 1 s backoff, a POST on the same path
    // fails (it may not be retried): a failed request, and the breaker
    // trips (on another path, the GET still under way would be a sign that
    // the rest of the route answers: the path's breaker alone would trip).
    let second = request(
        &hg.listen,
        "POST /a HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(second.status, 503);
    let first = first.await.unwrap();
    assert_eq!(first.status, 503, "{first:?}");
    assert_eq!(
        first.header("x-from"),
        Some("upstream"),
        "the upstream's own answer"
    );
    assert_eq!(first.header("x-herdguard-error"), None);
    assert!(first.body.contains("upstream says no"));
    assert_eq!(first.header("x-herdguard-attempts"), Some("1"));
    assert_eq!(
        arrived.load(Ordering::SeqCst),
        2,
        "the retry was never sent"
    );
    let text = hg.metrics().await;
    assert_eq!(
        metric(&text, &retries("503")),
        None,
        "no retry was made:\n{text}"
    );
    assert_eq!(metric(&text, &skipped("breaker_open")), Some(1.0), "{text}");
    assert_eq!(
        metric(&text, &skipped("non_idempotent")),
        Some(1.0),
        "{text}"
    );
    // The floor (1/s over 10 s) and two deposits of 0.2: the token came back.
    let budget = metric(&text, r#"herdguard_retry_budget_available{route="r"}"#).unwrap();
    assert!((budget - 10.4).abs() < 1e-9, "{budget}\n{text}");
    hg.terminate().await;
}

#[tokio::test]
async fn retry_safety_is_read_from_what_the_upstream_sees() {
    let up = upstream(|_| async {
        let mut resp = Response::new(full("busy"));
        *resp.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
        resp
    })
    .await;
    let hg = Binary::start(&route(&up.url(), r#"backoff = { base = "10ms" }"#, "")).await;
    let post = |extra: &str| {
        format!(
            "POST /orders HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nConnection: close{extra}\r\n\r\n{{}}"
        )
    };
    // A key that is hop-by-hop never reaches the upstream: no promise made.
    let hop = request(
        &hg.listen,
        &post(", idempotency-key\r\nIdempotency-Key: k1"),
    )
    .await;
    assert_eq!(hop.status, 503);
    assert_eq!(hop.header("x-herdguard-attempts"), Some("1"), "{hop:?}");
    assert!(!up.last().headers.contains_key("idempotency-key"));
    // An empty key promises nothing.
    let empty = request(&hg.listen, &post("\r\nIdempotency-Key: ")).await;
    assert_eq!(empty.header("x-herdguard-attempts"), Some("1"), "{empty:?}");
    // A real key does.
    let keyed = request(&hg.listen, &post("\r\nIdempotency-Key: k2")).await;
    assert_eq!(keyed.header("x-herdguard-attempts"), Some("3"), "{keyed:?}");
    let text = hg.metrics().await;
    assert_eq!(
        metric(&text, &skipped("non_idempotent")),
        Some(2.0),
        "{text}"
    );
    hg.terminate().await;
}

/// Sends `request` and then nothing more, and reads the answer.
async fn stall(addr: &str, request: &[u8]) -> Answer {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(request).await.unwrap();
    let mut out = Vec::new();
    stream.read_to_end(&mut out).await.unwrap();
    parse(&out)
}

#[tokio::test]
async fn a_stalled_upload_is_the_callers_408_and_a_cut_off_one_costs_nothing() {
    let (up, lengths) = reading_upstream(200).await;
    let hg = Binary::start(&route(&up.url(), r#"timeout = "1s""#, "")).await;
    // Promises 100 bytes, sends 10, then waits: a body small enough to keep
    // is read whole before any attempt, so the upstream never sees it.
    let kept = stall(
        &hg.listen,
        b"PUT /doc HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\nConnection: close\r\n\r\n0123456789",
    )
    .await;
    assert_eq!(kept.status, 408, "{kept:?}");
    assert_eq!(kept.header("x-herdguard-error"), Some("request-timeout"));
    assert_eq!(kept.header("x-herdguard-attempts"), Some("0"));
    assert_eq!(up.hits(), 0, "no attempt waited on the caller");

    // Chunked, so of unknown length: it streams, and stalls mid-attempt.
    let streamed = stall(
        &hg.listen,
        b"PUT /doc HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\na\r\n0123456789\r\n",
    )
    .await;
    assert_eq!(streamed.status, 408, "{streamed:?}");
    assert_eq!(
        streamed.header("x-herdguard-error"),
        Some("request-timeout")
    );

    // Promises 100 bytes, sends 10, then hangs up its side.
    let mut cut = TcpStream::connect(&hg.listen).await.unwrap();
    cut.write_all(b"PUT /doc HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\n0123456789")
        .await
        .unwrap();
    cut.shutdown().await.unwrap();
    let mut out = Vec::new();
    let _ = cut.read_to_end(&mut out).await;
    let bad = r#"herdguard_requests_total{route="r",code="400",source="proxy"}"#;
    eventually(
        Duration::from_secs(5),
        "the cut-off upload is answered",
        || async { hg.metric(bad).await == 1.0 },
    )
    .await;

    let text = hg.metrics().await;
    assert_eq!(
        metric(&text, &attempts_with("caller-stalled")),
        Some(1.0),
        "only the streamed one was an attempt:\n{text}"
    );
    assert_eq!(metric(&text, BREAKER_CLOSED), Some(0.0));
    assert_eq!(sum(&text, "herdguard_retries_total{"), 0.0);
    assert!(
        lengths.lock().unwrap().iter().all(|&n| n < 100),
        "nothing whole reached it"
    );
    hg.terminate().await;
}

#[tokio::test]
async fn an_upstream_that_gives_up_on_a_stalled_upload_is_not_blamed() {
    // Like many servers' read timeouts: waits 300 ms for the body, then closes.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let _ = tokio::time::timeout(Duration::from_millis(300), async {
                    while matches!(s.read(&mut buf).await, Ok(n) if n > 0) {}
                })
                .await;
            });
        }
    });
    let hg = Binary::start(&route(
        &url,
        r#"timeout = "3s""#,
        "consecutive_failures = 2",
    ))
    .await;
    for _ in 0..3 {
        let answer = stall(
            &hg.listen,
            b"PUT /doc HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n3\r\nabc\r\n",
        )
        .await;
        assert_eq!(answer.status, 408, "{answer:?}");
    }
    let text = hg.metrics().await;
    assert_eq!(metric(&text, BREAKER_CLOSED), Some(0.0), "{text}");
    assert_eq!(metric(&text, &attempts_with("caller-stalled")), Some(3.0));
    assert_eq!(metric(&text, &attempts_with("reset")), Some(0.0));
    assert_eq!(sum(&text, "herdguard_retries_total{"), 0.0);
    hg.terminate().await;
}

/// An HTTP/2 caller that cancels its stream mid-upload (`RST_STREAM`
/// `CANCEL`, which hyper reads as the body's end) is the caller's doing:
/// the short body never goes upstream as if it were whole, and the upstream
/// is never blamed for breaking off, however the race between the cancel
/// and the upload goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_caller_that_cancels_mid_upload_is_never_the_upstreams_fault() {
    let arrived = Arc::new(tokio::sync::Notify::new());
    let whole = Arc::new(AtomicUsize::new(0));
    let (arrived_up, whole_up) = (arrived.clone(), whole.clone());
    let up = upstream(move |req| {
        let (arrived, whole) = (arrived_up.clone(), whole_up.clone());
        async move {
            arrived.notify_one();
            if req.into_body().collect().await.is_ok() {
                whole.fetch_add(1, Ordering::SeqCst);
            }
            http::Response::new(full("ok"))
        }
    })
    .await;
    let hg = proxy(&route(&up.url(), "", "consecutive_failures = 3")).await;
    const CALLERS: usize = 10;
    for _ in 0..CALLERS {
        let tcp = TcpStream::connect(hg.proxy_addr()).await.unwrap();
        let (client, conn) = h2::client::handshake(tcp).await.unwrap();
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let mut client = client.ready().await.unwrap();
        // Larger than max_replay_body: streamed through as it comes.
        let req = http::Request::put("http://a/upload")
            .header("content-length", "200000")
            .body(())
            .unwrap();
        let (resp, mut body) = client.send_request(req, false).unwrap();
        body.send_data(Bytes::from(vec![b'q'; 100]), false).unwrap();
        arrived.notified().await;
        // A caller that pauses mid-upload, then gives up.
        tokio::time::sleep(Duration::from_millis(100)).await;
        body.send_reset(h2::Reason::CANCEL);
        drop(resp);
    }
    let text = || async { admin(&hg, "/metrics").await.1 };
    eventually(
        Duration::from_secs(5),
        "every upload is accounted for",
        || async {
            let t = text().await;
            sum(&t, "herdguard_upstream_attempts_total{") >= CALLERS as f64
                || sum(&t, "herdguard_requests_total{") >= CALLERS as f64
        },
    )
    .await;
    let t = text().await;
    assert_eq!(
        whole.load(Ordering::SeqCst),
        0,
        "a short body reached the upstream whole"
    );
    // Every attempt is the caller's: cancelled, none booked against the
    // upstream.
    assert_eq!(
        metric(&t, &attempts_with("cancelled")),
        Some(CALLERS as f64),
        "{t}"
    );
    assert_eq!(
        sum(&t, "herdguard_upstream_attempts_total{"),
        CALLERS as f64,
        "{t}"
    );
    assert_eq!(
        metric(&t, BREAKER_CLOSED),
        Some(0.0),
        "the breaker stays closed:\n{t}"
    );
}

/// An inner hop's own marks (another herdguard upstream of this one, which
/// aborted a request by its fault config or answered its own error) are
/// the upstream's answer here: counted `source="upstream"`, never as this
/// proxy's. The upstream's `x-herdguard-error` is not passed on.
#[tokio::test]
async fn an_inner_hops_error_and_fault_marks_count_as_the_upstreams() {
    let up = upstream(|req| async move {
        let mut resp = Response::new(full("inner"));
        *resp.status_mut() = StatusCode::from_u16(418).unwrap();
        let mark = match req.uri().path() {
            "/fault" => ("x-herdguard-fault", "abort"),
            _ => ("x-herdguard-error", "overloaded"),
        };
        resp.headers_mut()
            .insert(mark.0, http::HeaderValue::from_static(mark.1));
        resp
    })
    .await;
    let hg = Binary::start(&route(&up.url(), "", "")).await;
    for path in ["/fault", "/error"] {
        let head = format!("GET {path} HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n");
        let answer = request(&hg.listen, &head).await;
        assert_eq!(answer.status, 418, "{answer:?}");
        assert_eq!(answer.header("x-herdguard-error"), None, "{answer:?}");
    }
    let text = hg.metrics().await;
    let series = |source: &str| {
        format!(r#"herdguard_requests_total{{route="r",code="418",source="{source}"}}"#)
    };
    assert_eq!(metric(&text, &series("upstream")), Some(2.0), "{text}");
    assert_eq!(metric(&text, &series("proxy")), None, "{text}");
}
