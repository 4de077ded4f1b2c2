//! The bound on the process's memory (`listen.max_memory`): callers that
//! ask for large answers and read none of them, spread over upstreams so
//! that no upstream's own limit holds them, are cut once memory runs
//! short; new requests meanwhile get 503 at once; and once memory is back
//! the proxy answers as before. Without the bound, the first round of each
//! test held 246 MB (HTTP/1) and 98 MB (HTTP/2) in use.

use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;

use crate::common::process::Binary;
use crate::common::*;

const PRESSURE: &str = "herdguard_memory_pressure";
const CUT: &str = "herdguard_memory_cut_connections_total";

/// An upstream answering every request with `size` bytes, and a config
/// of `routes` routes (`/r{i}/...`) each to an upstream of its own at that
/// address, with no admission limit that would hold the callers first.
async fn big_answers(size: usize, routes: usize) -> (Upstream, String) {
    // In chunks of 64 KiB (chunked): what the proxy holds of each is what
    // its caller has not read.
    let chunk = Bytes::from(vec![b'x'; 64 << 10]);
    let up = upstream(move |_| {
        let chunk = chunk.clone();
        async move {
            use http_body_util::BodyExt as _;
            let frames = (0..size / chunk.len()).map(move |_| {
                Ok::<_, std::convert::Infallible>(hyper::body::Frame::data(chunk.clone()))
            });
            let body = http_body_util::StreamBody::new(futures_util::stream::iter(frames));
            http::Response::new(body.map_err(|never| match never {}).boxed())
        }
    })
    .await;
    let mut toml = String::new();
    for i in 0..routes {
        toml.push_str(&format!(
            "[upstreams.u{i}]\nendpoints = [\"{}\"]\nmax_in_flight = 4000\n\
             adaptive_concurrency = {{ enabled = false }}\n\
             [[routes]]\nname = \"r{i}\"\nupstream = \"u{i}\"\nmatch = {{ path_prefix = \"/r{i}/\" }}\n",
            up.url()
        ));
    }
    (up, toml)
}

/// A GET of `path` on a connection whose receive buffer is small, never
/// read: the proxy's writes to it block once a few KiB are out.
async fn unread_get(listen: &str, path: &str) -> Option<tokio::net::TcpStream> {
    use tokio::io::AsyncWriteExt as _;
    let socket = tokio::net::TcpSocket::new_v4().ok()?;
    socket.set_recv_buffer_size(4096).ok()?;
    let mut s = socket.connect(listen.parse().ok()?).await.ok()?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: a\r\n\r\n");
    s.write_all(req.as_bytes()).await.ok()?;
    Some(s)
}

/// Waits until memory pressure has come and gone, connections were cut,
/// and a new request is answered by the upstream.
async fn pressure_came_and_went(hg: &Binary, path: &str) {
    eventually(Duration::from_secs(20), "connections cut", || async {
        hg.metric(CUT).await >= 1.0
    })
    .await;
    eventually(Duration::from_secs(20), "the pressure over", || async {
        hg.metric(PRESSURE).await == 0.0
    })
    .await;
    let (status, _, _) = get_at(&hg.listen, path).await;
    assert_eq!(status, StatusCode::OK, "answered once memory is back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http1_callers_that_read_nothing_are_cut_when_memory_runs_short() {
    let _heavy = heavy().await;
    for (callers, size, routes) in [(1500usize, 2usize << 20, 3usize), (2000, 1 << 20, 9)] {
        let (_up, toml) = big_answers(size, routes).await;
        let hg = Binary::start_with("max_memory = \"24MiB\"", &toml).await;
        let mut held = Vec::new();
        let mut refused = 0usize;
        // Callers come over three seconds, as a fleet's would, not in
        // one burst that lands between two looks at memory.
        let mut every = tokio::time::interval(Duration::from_millis(3000 / callers as u64 + 1));
        for i in 0..callers {
            every.tick().await;
            if let Some(s) = unread_get(&hg.listen, &format!("/r{}/big", i % routes)).await {
                held.push(s);
            }
            if i % 100 == 99 && hg.metric(PRESSURE).await == 1.0 {
                let (status, headers, _) = get_at(&hg.listen, "/r0/one").await;
                if status == StatusCode::SERVICE_UNAVAILABLE {
                    assert_eq!(headers["x-herdguard-error"], "overloaded");
                    refused += 1;
                }
            }
        }
        pressure_came_and_went(&hg, "/r0/after").await;
        let peak_mib = hg.peak_rss_kib() / 1024;
        eprintln!(
            "{callers} callers of {size} B: peak RSS {peak_mib} MiB, {} cut, {refused} refused under pressure",
            hg.metric(CUT).await
        );
        assert!(peak_mib <= 64, "peak RSS {peak_mib} MiB");
        drop(held);
        hg.terminate().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_streams_given_no_window_are_cut_when_memory_runs_short() {
    let _heavy = heavy().await;
    for (connections, streams, size) in [(100usize, 20usize, 1usize << 20), (200, 10, 512 << 10)] {
        let (_up, toml) = big_answers(size, 4).await;
        let hg = Binary::start_with("max_memory = \"24MiB\"", &toml).await;
        let mut held = Vec::new();
        for c in 0..connections {
            let Ok(tcp) = tokio::net::TcpStream::connect(&hg.listen).await else {
                continue;
            };
            let Ok((mut client, conn)) = h2::client::Builder::new()
                .initial_window_size(0)
                .handshake::<_, Bytes>(tcp)
                .await
            else {
                continue;
            };
            tokio::spawn(async move {
                let _ = conn.await;
            });
            for s in 0..streams {
                let req = http::Request::get(format!("http://a/r{}/h2/{s}", c % 4))
                    .body(())
                    .unwrap();
                let Ok(ready) = client.ready().await else {
                    break;
                };
                client = ready;
                if let Ok((resp, _)) = client.send_request(req, true) {
                    held.push(resp);
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        pressure_came_and_went(&hg, "/r0/after").await;
        let peak_mib = hg.peak_rss_kib() / 1024;
        eprintln!(
            "{connections}x{streams} streams of {size} B: peak RSS {peak_mib} MiB, {} cut",
            hg.metric(CUT).await
        );
        assert!(peak_mib <= 64, "peak RSS {peak_mib} MiB");
        drop(held);
        hg.terminate().await;
    }
}

/// The bound is checked: too small to leave the process room is refused
/// with its key, `0` turns it off.
#[test]
fn a_bound_too_small_is_refused_and_zero_is_none() {
    let err = herdguard::config::Config::parse("[listen]\nmax_memory = \"4MiB\"\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("listen.max_memory"), "{err}");
    assert!(err.contains("line 2"), "{err}");
    herdguard::config::Config::parse("[listen]\nmax_memory = \"0\"\n").unwrap();
}

/// Callers that behave (each asks once and reads its answer) but keep many
/// HTTP/2 connections open and idle: their buffers alone hold memory past
/// the bound, and refusing their requests would free none of it. The
/// longest idle are asked to close (GOAWAY) until memory is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_past_the_bound_are_asked_to_close() {
    let _heavy = heavy().await;
    let (_up, toml) = big_answers(64 << 10, 1).await;
    let hg = Binary::start_with("max_memory = \"24MiB\"", &toml).await;
    let mut held = Vec::new();
    for _ in 0..1_200 {
        let Ok(tcp) = tokio::net::TcpStream::connect(&hg.listen).await else {
            continue;
        };
        let Ok((client, conn)) = h2::client::handshake(tcp).await else {
            continue;
        };
        let task = tokio::spawn(async move {
            let _ = conn.await;
        });
        let req = http::Request::get("http://a/r0/one").body(()).unwrap();
        if let Ok(mut client) = client.ready().await {
            if let Ok((resp, _)) = client.send_request(req, true) {
                if let Ok(resp) = resp.await {
                    let mut body = resp.into_body();
                    while let Some(Ok(chunk)) = body.data().await {
                        let _ = body.flow_control().release_capacity(chunk.len());
                    }
                }
            }
            held.push((client, task));
        }
    }
    pressure_came_and_went(&hg, "/r0/after").await;
    let closed = held.iter().filter(|(_, task)| task.is_finished()).count();
    assert!(closed >= 1, "idle connections asked to close: {closed}");
    drop(held);
    hg.terminate().await;
}

/// A bound larger than any sidecar is given, or one the bodies kept for
/// retries would fill half of, is warned of by `check`.
#[test]
fn check_warns_of_a_memory_bound_out_of_proportion() {
    let warnings = |toml: &str| -> Vec<String> {
        herdguard::config::Config::check_str(toml)
            .unwrap()
            .warnings
            .iter()
            .map(ToString::to_string)
            .collect()
    };
    let huge = warnings("[listen]\nmax_memory = \"100GiB\"\n");
    assert!(
        huge.iter()
            .any(|w| w.contains("listen.max_memory") && w.contains("typo")),
        "{huge:?}"
    );
    let bodies = warnings("[listen]\nmax_memory = \"24MiB\"\nmax_body_memory = \"16MiB\"\n");
    assert!(
        bodies.iter().any(|w| w.contains("listen.max_body_memory")),
        "{bodies:?}"
    );
    let fine = warnings("[listen]\nmax_memory = \"96MiB\"\n");
    assert!(!fine.iter().any(|w| w.contains("memory")), "{fine:?}");
}
