//! Request bodies on herdguard's own HTTP/1.1 exchange: a body of a
//! declared length of at most 16 KiB is read whole before a connection is
//! taken, then written with its head; it reaches the upstream whole, with
//! its length, on a connection used again; a caller that is slow with it
//! or leaves mid-body reaches no upstream; larger bodies, and bodies the
//! body memory has no room for, stream by hyper's client as before. Against
//! an upstream on a raw socket that records what it read, byte for byte.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use http::{Method, StatusCode};
use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// One request as the upstream read it: its head and its body.
#[derive(Clone, Debug)]
struct Read {
    head: String,
    body: Vec<u8>,
}

/// A raw upstream: reads each request whole (its body by `Content-Length`
/// or chunked coding) and answers 200 with the body's length, or 503 to
/// the first request for `/unavailable-once`.
#[derive(Clone)]
struct Recorder {
    accepted: Arc<AtomicUsize>,
    heads: Arc<AtomicUsize>,
    read: Arc<Mutex<Vec<Read>>>,
    /// `/slow` is answered once a permit is added here.
    gate: Arc<tokio::sync::Semaphore>,
}

impl Recorder {
    async fn start() -> (String, Recorder) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let rec = Recorder {
            accepted: Arc::default(),
            heads: Arc::default(),
            read: Arc::default(),
            gate: Arc::new(tokio::sync::Semaphore::new(0)),
        };
        let r = rec.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                r.accepted.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(r.clone().serve(stream));
            }
        });
        (url, rec)
    }

    fn read(&self) -> Vec<Read> {
        self.read.lock().unwrap().clone()
    }

    async fn serve(self, mut stream: TcpStream) {
        let mut pending = Vec::new();
        let mut unavailable_once = true;
        loop {
            let Some(end) = fill_until(&mut stream, &mut pending, |p| {
                p.windows(4).position(|w| w == b"\r\n\r\n").map(|e| e + 4)
            })
            .await
            else {
                return;
            };
            self.heads.fetch_add(1, Ordering::SeqCst);
            let head = String::from_utf8_lossy(&pending[..end]).into_owned();
            pending.drain(..end);
            let lower = head.to_ascii_lowercase();
            let body = if lower.contains("transfer-encoding: chunked") {
                let Some(end) = fill_until(&mut stream, &mut pending, |p| {
                    p.windows(5).position(|w| w == b"0\r\n\r\n").map(|e| e + 5)
                })
                .await
                else {
                    return;
                };
                dechunk(&pending.drain(..end).collect::<Vec<_>>())
            } else {
                let len: usize = lower
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length: "))
                    .map_or(0, |v| v.trim().parse().unwrap());
                let Some(end) = fill_until(&mut stream, &mut pending, |p| {
                    (p.len() >= len).then_some(len)
                })
                .await
                else {
                    return;
                };
                pending.drain(..end).collect()
            };
            if head.contains(" /slow ") {
                self.gate.acquire().await.unwrap().forget();
            }
            let answer = if head.contains(" /unavailable-once ") && unavailable_once {
                unavailable_once = false;
                "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\nbusy".to_owned()
            } else {
                let text = body.len().to_string();
                format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{text}",
                    text.len()
                )
            };
            self.read.lock().unwrap().push(Read { head, body });
            if stream.write_all(answer.as_bytes()).await.is_err() {
                return;
            }
        }
    }
}

/// Reads into `pending` until `done` finds where what is wanted ends;
/// `None` once the connection ends first.
async fn fill_until(
    stream: &mut TcpStream,
    pending: &mut Vec<u8>,
    done: impl Fn(&[u8]) -> Option<usize>,
) -> Option<usize> {
    loop {
        if let Some(end) = done(pending) {
            return Some(end);
        }
        let mut buf = [0u8; 16 * 1024];
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => pending.extend_from_slice(&buf[..n]),
        }
    }
}

/// The data of a chunked body (no extensions, no trailers).
fn dechunk(mut coded: &[u8]) -> Vec<u8> {
    let mut data = Vec::new();
    loop {
        let line = coded.windows(2).position(|w| w == b"\r\n").unwrap();
        let size = usize::from_str_radix(std::str::from_utf8(&coded[..line]).unwrap(), 16).unwrap();
        if size == 0 {
            return data;
        }
        data.extend_from_slice(&coded[line + 2..line + 2 + size]);
        coded = &coded[line + 2 + size + 2..];
    }
}

/// A route that retries (its bodies kept for a retry, read whole before
/// the first attempt when they fit `max_replay_body`).
const RETRYING: &str = "retry = { retry_on = [\"5xx\", \"reset\", \"connect-failure\"] }";
/// A route that makes one attempt: its bodies are sent once.
const ONCE: &str = "retry = { attempts = 1 }";

fn config(url: &str, retry: &str) -> String {
    format!(
        "[upstreams.u]\nendpoints = [\"{url}\"]\n[[routes]]\nname = \"r\"\nupstream = \"u\"\n{retry}\n"
    )
}

/// A body of `len` bytes, no two neighbours alike over a long stretch.
fn body_of(len: usize) -> Vec<u8> {
    (0..len).map(|i| b'a' + (i % 23) as u8).collect()
}

/// `method path` with `body` (and `headers`): the status and the body
/// length the upstream answered with.
async fn send_body(
    c: &TestClient,
    hg: &herdguard::app::Server,
    method: Method,
    path: &str,
    body: &[u8],
    headers: &[(&str, &str)],
) -> (StatusCode, String) {
    let mut req = http::Request::builder()
        .method(method)
        .uri(format!("http://{}{path}", hg.proxy_addr()));
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let resp = c
        .request(req.body(full(body.to_vec())).unwrap())
        .await
        .expect("the proxy answered");
    let status = resp.status();
    let text = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&text).into_owned())
}

/// The `content-length` lines of a head, as written.
fn lengths(head: &str) -> Vec<String> {
    head.lines()
        .filter(|l| l.to_ascii_lowercase().starts_with("content-length:"))
        .map(|l| l.to_ascii_lowercase())
        .collect()
}

async fn body_memory_empties(hg: &herdguard::app::Server) {
    eventually(
        Duration::from_secs(5),
        "the body memory given back",
        || async {
            let (_, text) = admin(hg, "/metrics").await;
            metric(&text, "herdguard_body_memory_bytes") == Some(0.0)
        },
    )
    .await;
}

#[tokio::test]
async fn small_bodies_reach_the_upstream_whole_with_their_length_on_one_connection() {
    for retry in [RETRYING, ONCE] {
        small_bodies_on(retry).await;
    }
}

async fn small_bodies_on(retry: &str) {
    let (url, up) = Recorder::start().await;
    let hg = proxy(&config(&url, retry)).await;
    let c = client();
    // Sent once (a POST without a key), kept for a retry (a PUT), one
    // byte, and the largest read whole.
    let cases: [(Method, usize); 4] = [
        (Method::POST, 1024),
        (Method::PUT, 3000),
        (Method::POST, 1),
        (Method::POST, 16 * 1024),
    ];
    for (method, len) in &cases {
        let body = body_of(*len);
        let (status, answered) = send_body(&c, &hg, method.clone(), "/echo", &body, &[]).await;
        assert_eq!(
            (status, answered),
            (StatusCode::OK, len.to_string()),
            "{retry}"
        );
        let seen = up.read().pop().unwrap();
        assert_eq!(
            seen.body, body,
            "{retry} {method} {len}: the body, byte for byte"
        );
        assert_eq!(lengths(&seen.head), [format!("content-length: {len}")]);
        assert!(!seen.head.to_ascii_lowercase().contains("transfer-encoding"));
    }
    let (status, _, _) = get(&hg, "/echo").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        up.accepted.load(Ordering::SeqCst),
        1,
        "{retry}: one connection carried them all, the GET after them"
    );
    body_memory_empties(&hg).await;

    // One byte over: streamed by hyper's client, whole all the same.
    let body = body_of(16 * 1024 + 1);
    let (status, answered) = send_body(&c, &hg, Method::POST, "/echo", &body, &[]).await;
    assert_eq!((status, answered), (StatusCode::OK, body.len().to_string()));
    assert_eq!(up.read().pop().unwrap().body, body);
}

#[tokio::test]
async fn a_retried_body_is_read_whole_again_for_the_retry() {
    let (url, up) = Recorder::start().await;
    let hg = proxy(&config(&url, RETRYING)).await;
    let c = client();
    let body = body_of(5000);
    let key = [("idempotency-key", "k-1")];
    let (status, answered) =
        send_body(&c, &hg, Method::POST, "/unavailable-once", &body, &key).await;
    assert_eq!((status, answered), (StatusCode::OK, "5000".to_owned()));
    let read = up.read();
    assert_eq!(read.len(), 2, "the 503, then the retry");
    for seen in &read {
        assert_eq!(seen.body, body);
        assert_eq!(lengths(&seen.head), ["content-length: 5000"]);
    }
    assert_eq!(
        up.accepted.load(Ordering::SeqCst),
        1,
        "the 503 read through: its connection carried the retry"
    );
    body_memory_empties(&hg).await;
}

/// A caller's raw request head for a body of `len` bytes.
fn post_head(addr: std::net::SocketAddr, len: usize) -> String {
    format!("POST /echo HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {len}\r\n\r\n")
}

#[tokio::test]
async fn a_caller_slow_with_its_body_reaches_the_upstream_only_once_it_is_whole() {
    // A body sent once (one kept for a retry: see attribution.rs).
    let (url, up) = Recorder::start().await;
    let hg = proxy(&config(&url, ONCE)).await;
    let body = body_of(100);
    let mut caller = TcpStream::connect(hg.proxy_addr()).await.unwrap();
    caller
        .write_all(post_head(hg.proxy_addr(), 100).as_bytes())
        .await
        .unwrap();
    caller.write_all(&body[..50]).await.unwrap();
    // The caller's own pace: half its body, then a pause. Streamed, the
    // head would be upstream by now.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        up.heads.load(Ordering::SeqCst),
        0,
        "nothing sent upstream before the body is whole"
    );
    caller.write_all(&body[50..]).await.unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        let mut buf = [0u8; 1024];
        while !String::from_utf8_lossy(&answer).ends_with("\r\n\r\n100") {
            match caller.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => answer.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.ends_with("\r\n\r\n100"), "{answer}");
    assert_eq!(up.read().pop().unwrap().body, body);
    body_memory_empties(&hg).await;
}

#[tokio::test]
async fn a_caller_that_leaves_mid_body_reaches_no_upstream_and_no_attempt_is_made() {
    let (url, up) = Recorder::start().await;
    let hg = proxy(&config(&url, ONCE)).await;
    for _ in 0..3 {
        let mut caller = TcpStream::connect(hg.proxy_addr()).await.unwrap();
        caller
            .write_all(post_head(hg.proxy_addr(), 1000).as_bytes())
            .await
            .unwrap();
        caller.write_all(&body_of(400)).await.unwrap();
        drop(caller);
    }
    let bad = "herdguard_requests_total{route=\"r\",code=\"400\",source=\"proxy\"}";
    eventually(
        Duration::from_secs(10),
        "three cut-off uploads answered",
        || async {
            let (_, text) = admin(&hg, "/metrics").await;
            metric(&text, bad) == Some(3.0)
        },
    )
    .await;
    assert_eq!(
        up.heads.load(Ordering::SeqCst),
        0,
        "the upstream saw none of them"
    );
    assert_eq!(
        up.accepted.load(Ordering::SeqCst),
        0,
        "nor a connection for them"
    );
    let (_, text) = admin(&hg, "/metrics").await;
    // Read before any attempt: no attempt was made.
    let attempts: f64 = text
        .lines()
        .filter(|l| l.starts_with("herdguard_upstream_attempts_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(attempts, 0.0, "no attempt made:\n{text}");
    assert_eq!(
        metric(&text, "herdguard_breaker_state{route=\"r\"}"),
        Some(0.0),
        "nothing held against the route"
    );
    body_memory_empties(&hg).await;
    // And the route is none the worse: its breaker saw no failure.
    let (status, _, _) = get(&hg, "/echo").await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn with_no_room_in_the_body_memory_a_small_body_streams_and_nothing_is_refused() {
    let (url, up) = Recorder::start().await;
    let src = format!(
        "[listen]\naddress = \"127.0.0.1:0\"\nmax_body_memory = \"1KiB\"\n\
         [admin]\naddress = \"127.0.0.1:0\"\n{}",
        config(&url, ONCE)
    );
    let config = herdguard::config::Config::parse(&src).unwrap();
    let hg = herdguard::app::Server::start(config).await.unwrap();
    let c = client();
    // Room for this one, not for the next.
    for len in [1000, 4000] {
        let body = body_of(len);
        let (status, answered) = send_body(&c, &hg, Method::POST, "/echo", &body, &[]).await;
        assert_eq!((status, answered), (StatusCode::OK, len.to_string()));
        assert_eq!(up.read().pop().unwrap().body, body);
    }
    let (_, text) = admin(&hg, "/metrics").await;
    assert_eq!(
        metric(&text, "herdguard_body_memory_refused_total").unwrap_or(0.0),
        0.0,
        "a body sent once and streamed is not a refusal"
    );
    body_memory_empties(&hg).await;
}

/// The body memory's gauge, once it reads `bytes` (it is reported once a
/// second).
async fn body_memory_reads(hg: &herdguard::app::Server, bytes: f64, what: &str) {
    eventually(Duration::from_secs(5), what, || async {
        let (_, text) = admin(hg, "/metrics").await;
        metric(&text, "herdguard_body_memory_bytes") == Some(bytes)
    })
    .await;
}

#[tokio::test]
async fn the_body_memory_holds_a_body_once_and_a_body_sent_once_only_until_it_is_written() {
    let (url, up) = Recorder::start().await;
    let body = body_of(16 * 1024);
    for (retry, held) in [(RETRYING, 16384.0), (ONCE, 0.0)] {
        let hg = proxy(&config(&url, retry)).await;
        let heads = up.heads.load(Ordering::SeqCst);
        let (addr, sent) = (hg.proxy_addr(), body.clone());
        let call = tokio::spawn(async move {
            let req = http::Request::builder()
                .method(Method::PUT)
                .uri(format!("http://{addr}/slow"))
                .body(full(sent))
                .unwrap();
            client().request(req).await.map(|r| r.status())
        });
        eventually(Duration::from_secs(5), "the request upstream", || async {
            up.heads.load(Ordering::SeqCst) > heads
        })
        .await;
        // Kept for a retry: its copy, counted once (not again for the
        // attempt that sends it). Sent once: given back once written.
        let what = format!("{retry}: {held} bytes held while the answer is awaited");
        body_memory_reads(&hg, held, &what).await;
        up.gate.add_permits(1);
        assert_eq!(call.await.unwrap().unwrap(), StatusCode::OK);
        assert_eq!(up.read().pop().unwrap().body, body);
        body_memory_empties(&hg).await;
    }
}
