//! The fault matrix for requests that must never run twice: a POST with a
//! 64 KiB body through every upstream fault. Each row checks what the caller
//! gets, how many times the upstream saw the request (never twice), that
//! what it saw is byte for byte what the caller sent (sha256), and whom the
//! breaker blamed: the upstream's faults count against it, the caller's and
//! a connection the upstream had already closed count nothing.

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::process::Binary;
use common::*;
use http_body_util::BodyExt;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What the raw upstream does once it has read a whole request.
#[derive(Clone, Copy, Debug)]
enum Then {
    /// Closes without a byte of answer.
    Close,
    /// Resets the connection without a byte of answer.
    Reset,
    /// Writes these bytes, then resets the connection.
    WriteThenReset(&'static [u8]),
    /// Writes these bytes and keeps the connection open, sending nothing more.
    WriteThenHang(&'static [u8]),
    /// Answers whole and keeps the connection alive for the next request.
    Answer(&'static [u8]),
    /// Answers whole (no `Connection: close`), then closes.
    AnswerThenClose(&'static [u8]),
}

/// What the upstream saw: the sha256 of each request body it read whole.
#[derive(Clone, Default)]
struct Seen(Arc<Mutex<Vec<[u8; 32]>>>);

impl Seen {
    fn bodies(&self) -> Vec<[u8; 32]> {
        self.0.lock().unwrap().clone()
    }
}

/// Reads one request (head and a Content-Length body) and returns the
/// body's digest; None if the connection ended first.
async fn read_request(stream: &mut TcpStream) -> Option<[u8; 32]> {
    let mut data = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    let end = loop {
        if let Some(i) = data.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => data.extend_from_slice(&buf[..n]),
        }
    };
    let head = String::from_utf8_lossy(&data[..end]).to_ascii_lowercase();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    while data.len() < end + length {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => data.extend_from_slice(&buf[..n]),
        }
    }
    Some(Sha256::digest(&data[end..end + length]).into())
}

/// Closes with a RST: a zero linger time does not block, it discards.
#[allow(deprecated)]
fn reset(stream: TcpStream) {
    let _ = stream.set_linger(Some(Duration::ZERO));
}

async fn raw_upstream(then: Then) -> (String, Seen) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let seen = Seen::default();
    let record = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let record = record.clone();
            tokio::spawn(async move {
                while let Some(digest) = read_request(&mut stream).await {
                    record.0.lock().unwrap().push(digest);
                    match then {
                        Then::Close => return,
                        Then::Reset => return reset(stream),
                        Then::WriteThenReset(bytes) => {
                            let _ = stream.write_all(bytes).await;
                            let _ = stream.flush().await;
                            return reset(stream);
                        }
                        Then::WriteThenHang(bytes) => {
                            let _ = stream.write_all(bytes).await;
                            let _ = stream.read(&mut [0u8; 1]).await;
                            return;
                        }
                        Then::Answer(bytes) => {
                            if stream.write_all(bytes).await.is_err() {
                                return;
                            }
                        }
                        Then::AnswerThenClose(bytes) => {
                            let _ = stream.write_all(bytes).await;
                            return;
                        }
                    }
                }
            });
        }
    });
    (url, seen)
}

fn config(url: &str) -> String {
    format!(
        "[upstreams.u]\nendpoints = [\"{url}\"]\n\
         [[routes]]\nname = \"r\"\nupstream = \"u\"\n\
         retry = {{ retry_on = [\"5xx\", \"reset\", \"connect-failure\", \"timeout\"], \
         per_try_timeout = \"1s\" }}\n"
    )
}

/// 64 KiB that differ from request to request.
fn payload(seed: u32) -> Bytes {
    (0..64 * 1024u32)
        .map(|i| (i.wrapping_add(seed).wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect::<Vec<u8>>()
        .into()
}

/// Status and, if it came whole, the body.
async fn post(
    client: &TestClient,
    hg: &Binary,
    body: Bytes,
) -> (http::StatusCode, Option<Bytes>, http::HeaderMap) {
    let req = http::Request::post(format!("http://{}/orders", hg.listen))
        .header("host", "a")
        .body(full(body))
        .unwrap();
    let resp = client.request(req).await.expect("an answer");
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.ok().map(|b| b.to_bytes());
    (parts.status, body, parts.headers)
}

/// The route's breaker counts, from `/breakers`.
async fn breaker(hg: &Binary) -> (u64, u64) {
    let req = http::Request::get(format!("http://{}/breakers", hg.admin))
        .body(empty())
        .unwrap();
    let (_, _, body) = send(&client(), req).await;
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let r = &v["routes"]["r"];
    (
        r["consecutive_failures"].as_u64().unwrap(),
        r["window_failures"].as_u64().unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_post_through_every_upstream_fault_runs_at_most_once_and_byte_exact() {
    const OK: &[u8] = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
    // (what, upstream's conduct, status, body whole?, times seen, blamed?)
    let rows: Vec<(&str, Then, u16, bool, usize, bool)> = vec![
        ("closed before any answer", Then::Close, 502, true, 1, true),
        ("reset before any answer", Then::Reset, 502, true, 1, true),
        (
            "reset after part of the head",
            Then::WriteThenReset(b"HTTP/1.1 200 OK\r\nContent-Le"),
            502,
            true,
            1,
            true,
        ),
        (
            "reset mid-body (Content-Length)",
            Then::WriteThenReset(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhello"),
            200,
            false,
            1,
            true,
        ),
        (
            "reset mid-body (chunked)",
            Then::WriteThenReset(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
            ),
            200,
            false,
            1,
            true,
        ),
        (
            "no answer at all (per-try timeout)",
            Then::WriteThenHang(b""),
            504,
            true,
            1,
            true,
        ),
        (
            "headers then nothing",
            Then::WriteThenHang(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhel"),
            200,
            false,
            1,
            true,
        ),
        (
            "a 503 (not retried: a POST without a key)",
            Then::Answer(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n"),
            503,
            true,
            1,
            true,
        ),
        (
            "1xx then 200",
            Then::Answer(
                b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
            ),
            200,
            true,
            1,
            false,
        ),
        ("a whole answer", Then::Answer(OK), 200, true, 1, false),
    ];
    for (what, then, status, whole, times, blamed) in rows {
        let (url, seen) = raw_upstream(then).await;
        let hg = Binary::start_with("write_timeout = \"500ms\"", &config(&url)).await;
        let body = payload(times as u32);
        let want: [u8; 32] = Sha256::digest(&body).into();
        let (got, answer, headers) = post(&client(), &hg, body).await;
        assert_eq!(got.as_u16(), status, "{what}: {headers:?}");
        assert_eq!(answer.is_some(), whole, "{what}: the body came whole");
        let bodies = seen.bodies();
        assert_eq!(bodies.len(), times, "{what}: times the upstream saw it");
        assert!(
            bodies.iter().all(|d| *d == want),
            "{what}: the upstream got the body byte for byte"
        );
        let (consecutive, window) = breaker(&hg).await;
        if blamed {
            assert_eq!(
                (consecutive, window),
                (1, 1),
                "{what}: blamed on the upstream"
            );
        } else {
            assert_eq!((consecutive, window), (0, 0), "{what}: nobody blamed");
        }
        hg.terminate().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn posts_to_an_upstream_that_closes_after_every_answer_each_arrive_once() {
    // No `Connection: close`: the proxy learns of each close only when it
    // next looks at the pooled connection.
    let (url, seen) = raw_upstream(Then::AnswerThenClose(
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
    ))
    .await;
    let hg = Binary::start(&config(&url)).await;
    let client = client();
    let mut delivered = Vec::new();
    let mut cut = 0;
    for i in 0..40u32 {
        let body = payload(i);
        let digest = <[u8; 32]>::from(Sha256::digest(&body));
        let (status, answer, headers) = post(&client, &hg, body).await;
        if status == 200 {
            assert_eq!(answer.as_deref(), Some(&b"ok"[..]));
            delivered.push(digest);
        } else {
            // The one race no proxy can close: the upstream's close and the
            // next request cross on the wire. The upstream never read it, and
            // an unkeyed POST is not repeated on a guess: the caller hears.
            assert_eq!(status, 502, "POST {i}: {headers:?}");
            assert_eq!(headers["x-herdguard-error"], "reset", "POST {i}");
            cut += 1;
        }
    }
    assert_eq!(
        seen.bodies(),
        delivered,
        "each answered POST arrived once, in order, byte for byte; no cut one arrived"
    );
    assert!(
        cut <= 4,
        "{cut} of 40 crossed a close: the pool keeps connections the upstream closed"
    );
    hg.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connection_is_never_reached_so_even_a_post_is_retried() {
    let port = closed_port().await;
    let (url, seen) = raw_upstream(Then::Answer(
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
    ))
    .await;
    // The first endpoint refuses; the retry goes to the second.
    let hg = Binary::start(&format!(
        "[upstreams.u]\nendpoints = [\"http://{port}\", \"{url}\"]\n\
         outlier = {{ enabled = false }}\n\
         [[routes]]\nname = \"r\"\nupstream = \"u\"\n"
    ))
    .await;
    let client = client();
    for i in 0..6u32 {
        let body = payload(i);
        let want: [u8; 32] = Sha256::digest(&body).into();
        let (status, answer, _) = post(&client, &hg, body).await;
        assert_eq!(status, 200);
        assert_eq!(answer.as_deref(), Some(&b"ok"[..]));
        assert_eq!(seen.bodies().last(), Some(&want));
    }
    assert_eq!(seen.bodies().len(), 6, "each POST once");
    hg.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_leaves_mid_upload_costs_the_upstream_nothing() {
    let (url, seen) = raw_upstream(Then::Answer(
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
    ))
    .await;
    let hg = Binary::start(&config(&url)).await;
    for _ in 0..5 {
        let mut stream = TcpStream::connect(&hg.listen).await.unwrap();
        stream
            .write_all(b"POST /orders HTTP/1.1\r\nHost: a\r\nContent-Length: 65536\r\n\r\n")
            .await
            .unwrap();
        stream.write_all(&[b'x'; 1000]).await.unwrap();
        drop(stream);
    }
    // Then a whole one: it arrives, and the breaker has counted nothing.
    let body = payload(7);
    let want: [u8; 32] = Sha256::digest(&body).into();
    let (status, _, _) = post(&client(), &hg, body).await;
    assert_eq!(status, 200);
    assert_eq!(
        seen.bodies(),
        vec![want],
        "no cut-off upload was taken as whole"
    );
    assert_eq!(breaker(&hg).await, (0, 0));
    hg.terminate().await;
}

/// Many callers at once against an upstream that closes after every answer
/// (without saying so): its connections cross requests on the wire, but
/// none of that is the upstream failing. The breaker never opens, every
/// answered POST arrived once, a cut one never arrived, and a cut is booked
/// as a stale connection, not as the upstream resetting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closing_upstream_under_concurrency_never_trips_the_breaker() {
    let (url, seen) = raw_upstream(Then::AnswerThenClose(
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
    ))
    .await;
    let hg = Binary::start(&config(&url)).await;
    let callers = (0..10u32).map(|c| {
        let listen = hg.listen.clone();
        tokio::spawn(async move {
            let client = client();
            let mut answered = Vec::new();
            let mut statuses = Vec::new();
            for i in 0..30u32 {
                let body = payload(c * 1000 + i);
                let digest = <[u8; 32]>::from(Sha256::digest(&body));
                let req = http::Request::post(format!("http://{listen}/orders"))
                    .header("host", "a")
                    .body(full(body))
                    .unwrap();
                let resp = client.request(req).await.expect("an answer");
                let (status, headers) = (resp.status(), resp.headers().clone());
                let _ = resp.into_body().collect().await;
                if status == 200 {
                    answered.push(digest);
                }
                statuses.push((status, headers.get("x-herdguard-error").cloned()));
            }
            (answered, statuses)
        })
    });
    let mut answered = Vec::new();
    for caller in futures_util::future::join_all(callers).await {
        let (mine, statuses) = caller.unwrap();
        answered.extend(mine);
        for (status, error) in statuses {
            assert!(
                status == 200 || (status == 502 && error.as_ref().is_some_and(|e| e == "reset")),
                "{status} {error:?}: only a crossed close may cut a POST"
            );
        }
    }
    let mut delivered = seen.bodies();
    delivered.sort();
    answered.sort();
    assert_eq!(
        delivered, answered,
        "each answered POST arrived once; no cut one arrived"
    );
    let metrics = hg.metrics().await;
    assert_eq!(
        metric(
            &metrics,
            "herdguard_breaker_transitions_total{route=\"r\",to=\"open\"}"
        ),
        Some(0.0),
        "{metrics}"
    );
    assert_eq!(
        metric(
            &metrics,
            "herdguard_upstream_attempts_total{route=\"r\",upstream=\"u\",outcome=\"reset\"}"
        ),
        Some(0.0),
        "a crossed close is a stale connection: {metrics}"
    );
    hg.terminate().await;
}
