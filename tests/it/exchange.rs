//! herdguard's own HTTP/1.1 exchange with plain-HTTP upstreams (requests
//! with no body): every framing of an answer read whole, a connection used
//! again only when its answer ended cleanly, nothing after an answer ever
//! taken for the next one, and what breaks HTTP cut and blamed on the
//! upstream. Against an upstream on a raw socket that writes what the test
//! says, byte for byte.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use http::{Method, StatusCode};
use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What the raw upstream writes for a request's path: the bytes, whether
/// it closes the connection after them, and a pause between bytes (to
/// trickle them).
type Script = fn(&str) -> (Vec<u8>, bool, Option<Duration>);

/// A raw upstream: reads request heads one after the other on each
/// connection and writes what `script` says for each. Counts connections.
async fn raw_upstream(script: Script) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(serve(stream, script));
        }
    });
    (url, accepted)
}

async fn serve(mut stream: TcpStream, script: Script) {
    let mut pending = Vec::new();
    loop {
        let end = loop {
            if let Some(end) = pending.windows(4).position(|w| w == b"\r\n\r\n") {
                break end + 4;
            }
            let mut buf = [0u8; 4096];
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => pending.extend_from_slice(&buf[..n]),
            }
        };
        let head: Vec<u8> = pending.drain(..end).collect();
        let head = String::from_utf8_lossy(&head).into_owned();
        let path = head.split(' ').nth(1).unwrap_or("/").to_owned();
        let (bytes, close, pause) = script(&path);
        match pause {
            None => {
                let _ = stream.write_all(&bytes).await;
            }
            Some(pause) => {
                for byte in bytes {
                    let _ = stream.write_all(&[byte]).await;
                    tokio::time::sleep(pause).await;
                }
            }
        }
        if path == "/until-reset" {
            // A reset, not an end: the body is cut, whatever its framing.
            tokio::time::sleep(Duration::from_millis(50)).await;
            let _ = socket2::SockRef::from(&stream).set_linger(Some(Duration::ZERO));
            return;
        }
        if close {
            let _ = stream.shutdown().await;
            return;
        }
    }
}

fn answers(path: &str) -> (Vec<u8>, bool, Option<Duration>) {
    let keep = |bytes: &[u8]| (bytes.to_vec(), false, None);
    match path {
        "/length" => keep(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"),
        "/chunked" => keep(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: x-t\r\n\r\n\
              5;ext=\"1\"\r\nhello\r\n6\r\n world\r\n0\r\nx-t: v\r\n\r\n",
        ),
        "/head" => keep(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n"),
        "/empty" => keep(b"HTTP/1.1 204 No Content\r\n\r\n"),
        "/until-close" => (b"HTTP/1.1 200 OK\r\n\r\nuntil the end".to_vec(), true, None),
        "/smuggle" => keep(
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi\
              HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nevil",
        ),
        "/both" => keep(
            b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n\
              2\r\nhi\r\n0\r\n\r\n",
        ),
        "/closing" => keep(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nhi"),
        "/http10" => keep(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nhi"),
        "/broken-chunk" => {
            keep(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhelloXX\r\n0\r\n\r\n")
        }
        "/short" => (
            b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhello".to_vec(),
            true,
            None,
        ),
        "/huge-head" => {
            let mut head = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nx-big: ".to_vec();
            head.extend_from_slice(&[b'a'; 17 * 1024]);
            head.extend_from_slice(b"\r\n\r\nhi");
            keep(&head)
        }
        "/trickle" => (
            b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\nx-a: b\r\n\r\ntrickle".to_vec(),
            false,
            Some(Duration::from_millis(1)),
        ),
        "/early-hints" => keep(
            b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n\
              HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello",
        ),
        "/until-reset" => keep(b"HTTP/1.1 200 OK\r\n\r\nhel"),
        "/bad-trailers" => keep(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\
              X A: b\r\n\r\nX-Ok: 1\r\n\r\n",
        ),
        "/folded-trailers" => keep(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\
              X-A: b\r\n c\r\n\r\n",
        ),
        "/unavailable" => {
            keep(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\nbusy")
        }
        _ => keep(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"),
    }
}

fn config(url: &str) -> String {
    format!(
        "[upstreams.u]\nendpoints = [\"{url}\"]\n[[routes]]\nname = \"r\"\nupstream = \"u\"\n\
         retry = {{ retry_on = [\"5xx\", \"reset\", \"connect-failure\"] }}\n"
    )
}

async fn call(
    client: &TestClient,
    server: &herdguard::app::Server,
    method: Method,
    path: &str,
) -> (
    StatusCode,
    http::HeaderMap,
    Result<http_body_util::Collected<bytes::Bytes>, hyper::Error>,
) {
    let req = http::Request::builder()
        .method(method)
        .uri(format!("http://{}{path}", server.proxy_addr()))
        .header("te", "trailers")
        .body(empty())
        .unwrap();
    let resp = client.request(req).await.expect("the proxy answered");
    let (parts, body) = resp.into_parts();
    (parts.status, parts.headers, body.collect().await)
}

/// The status and whole body of `method path`.
async fn whole(
    client: &TestClient,
    server: &herdguard::app::Server,
    method: Method,
    path: &str,
) -> (StatusCode, bytes::Bytes) {
    let (status, _, body) = call(client, server, method, path).await;
    (status, body.expect("a whole body").to_bytes())
}

#[tokio::test]
async fn every_framing_is_read_whole_and_only_a_clean_end_reuses_the_connection() {
    let (url, accepted) = raw_upstream(answers).await;
    let hg = proxy(&config(&url)).await;
    let c = client();
    let ok = |body: &'static [u8]| (StatusCode::OK, bytes::Bytes::from_static(body));
    assert_eq!(whole(&c, &hg, Method::GET, "/length").await, ok(b"hello"));
    let (status, _, body) = call(&c, &hg, Method::GET, "/chunked").await;
    let body = body.expect("a whole body");
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        body.trailers().map(|t| t["x-t"].clone()),
        Some("v".parse().unwrap())
    );
    assert_eq!(body.to_bytes(), "hello world");
    assert_eq!(whole(&c, &hg, Method::HEAD, "/head").await, ok(b""));
    assert_eq!(
        whole(&c, &hg, Method::GET, "/empty").await,
        (StatusCode::NO_CONTENT, bytes::Bytes::new())
    );
    assert_eq!(
        whole(&c, &hg, Method::GET, "/early-hints").await,
        ok(b"hello")
    );
    assert_eq!(
        whole(&c, &hg, Method::GET, "/trickle").await,
        ok(b"trickle")
    );
    assert_eq!(whole(&c, &hg, Method::GET, "/length").await, ok(b"hello"));
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        1,
        "one connection carried them all"
    );

    // Answers after which the connection is not used again: read to their
    // end, each, and the next request goes on a new connection.
    let cases: [(&str, &[u8]); 4] = [
        ("/until-close", b"until the end"),
        ("/closing", b"hi"),
        ("/http10", b"hi"),
        ("/both", b"hi"),
    ];
    for (n, (path, body)) in cases.into_iter().enumerate() {
        assert_eq!(whole(&c, &hg, Method::GET, path).await, ok(body), "{path}");
        assert_eq!(whole(&c, &hg, Method::GET, "/length").await, ok(b"hello"));
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            n + 2,
            "after {path}: a new connection"
        );
    }
}

#[tokio::test]
async fn bytes_after_an_answer_never_answer_the_next_request() {
    let (url, accepted) = raw_upstream(answers).await;
    let hg = proxy(&config(&url)).await;
    let c = client();
    for _ in 0..3 {
        let (status, body) = whole(&c, &hg, Method::GET, "/smuggle").await;
        assert_eq!((status, &body[..]), (StatusCode::OK, &b"hi"[..]));
        let (status, body) = whole(&c, &hg, Method::GET, "/length").await;
        assert_eq!(
            (status, &body[..]),
            (StatusCode::OK, &b"hello"[..]),
            "never \"evil\""
        );
    }
    // Each answer with bytes after it closed its connection.
    assert_eq!(accepted.load(Ordering::SeqCst), 4);
}

#[tokio::test]
async fn a_body_broken_off_or_malformed_is_cut_and_its_connection_closed() {
    let (url, accepted) = raw_upstream(answers).await;
    // Each cut body counts against the route: its breaker, at its default,
    // would open before the last.
    let config = config(&url) + "breaker = { consecutive_failures = 100 }\n";
    let hg = proxy(&config).await;
    let c = client();
    for path in [
        "/broken-chunk",
        "/short",
        "/until-reset",
        "/bad-trailers",
        "/folded-trailers",
    ] {
        let (status, _, body) = call(&c, &hg, Method::GET, path).await;
        assert_eq!(status, StatusCode::OK, "{path}: the head was good");
        assert!(
            body.is_err(),
            "{path}: the caller sees the body cut, not a short one"
        );
    }
    let (status, body) = whole(&client(), &hg, Method::GET, "/length").await;
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"hello"[..]));
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        6,
        "neither broken connection was reused"
    );
}

#[tokio::test]
async fn an_answer_head_past_16_kib_is_a_bad_response_not_retried() {
    let (url, accepted) = raw_upstream(answers).await;
    let hg = proxy(&config(&url)).await;
    let (status, headers, _) = call(&client(), &hg, Method::GET, "/huge-head").await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    assert_eq!(headers["x-herdguard-error"], "bad-response");
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn an_answer_not_forwarded_leaves_its_connection_for_the_next_attempt() {
    let (url, accepted) = raw_upstream(answers).await;
    let hg = proxy(&config(&url)).await;
    let (status, headers, body) = call(&client(), &hg, Method::GET, "/unavailable").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(body.unwrap().to_bytes(), "busy");
    assert_eq!(headers["x-herdguard-attempts"], "3");
    // Each 503 came whole with its head: let go when the retry loop
    // moved on, its connection carried the next attempt.
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
}

/// Answers that are valid, and the same with bytes flipped, inserted,
/// dropped or cut off, served one per connection to the real binary
/// (built with `panic = "abort"`): whatever comes, the process answers
/// something and stays up, and a good answer after them all is passed on
/// whole. Seeded, so a failure repeats.
#[tokio::test]
async fn mangled_answers_never_crash_the_proxy() {
    use rand::{Rng, SeedableRng};
    use std::collections::VecDeque;
    use std::sync::Mutex;
    let queue: Arc<Mutex<VecDeque<Vec<u8>>>> = Arc::default();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let answers = queue.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let answers = answers.clone();
            tokio::spawn(async move {
                if !read_head(&mut stream).await {
                    return;
                }
                let answer = answers.lock().unwrap().pop_front();
                let answer = answer
                    .unwrap_or_else(|| b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok".to_vec());
                let _ = stream.write_all(&answer).await;
                let _ = stream.shutdown().await;
            });
        }
    });
    // The breaker left closed: the last request must reach the upstream.
    let config = config(&url) + "breaker = { consecutive_failures = 100000, failure_rate = 1.0 }\n";
    let hg = common::process::Binary::start(&config).await;
    let valid: [&[u8]; 5] = [
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: b\r\n\r\nhello",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;e=1\r\nhello\r\n0\r\nX-T: v\r\n\r\n",
        b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\n\r\nuntil the end",
        b"HTTP/1.0 404 Not Found\r\nContent-Length: 0\r\n\r\n",
    ];
    let mut rng = rand::rngs::SmallRng::seed_from_u64(0x5eed);
    let c = client();
    for case in 0..300 {
        let mut answer = valid[case % valid.len()].to_vec();
        for _ in 0..rng.random_range(1..4) {
            if answer.is_empty() {
                break;
            }
            let at = rng.random_range(0..answer.len());
            match rng.random_range(0..4) {
                0 => answer[at] = rng.random(),
                1 => answer.insert(at, *b"\r\n:;0 \x00".get(rng.random_range(0..7)).unwrap()),
                2 => {
                    answer.remove(at);
                }
                _ => answer.truncate(at.max(1)),
            }
        }
        queue.lock().unwrap().push_back(answer);
        let req = http::Request::get(format!("http://{}/m/{case}", hg.listen))
            .body(empty())
            .unwrap();
        let sent = tokio::time::timeout(Duration::from_secs(10), async {
            let resp = c.request(req).await?;
            let _ = resp.into_body().collect().await;
            Ok::<_, hyper_util::client::legacy::Error>(())
        });
        // An answer cut short may end the caller's connection: that is
        // an honest answer too. Only a hang or a crash fails.
        let _ = sent.await.expect("answered within 10 s");
        queue.lock().unwrap().clear();
    }
    let req = http::Request::get(format!("http://{}/last", hg.listen))
        .body(empty())
        .unwrap();
    let (status, _, body) = send(&client(), req).await;
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"ok"[..]));
    // Exits cleanly, and nothing panicked on the way (tests build with
    // unwinding: a panic would end one connection's task, not the process).
    let lines = hg.terminate().await;
    let panics: Vec<_> = lines.iter().filter(|l| l.contains("panicked")).collect();
    assert!(panics.is_empty(), "{panics:?}");
}
