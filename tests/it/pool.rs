//! Upstream connections of plain-HTTP endpoints: reused while they are
//! healthy and idle, never shared by two requests at once, closed after
//! `pool_idle_timeout`, and never trusted once the upstream closed them.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use http_body_util::BodyExt;
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;

/// An upstream that counts the connections it accepted and still has open;
/// `handler` answers each request.
struct Counted {
    addr: std::net::SocketAddr,
    accepted: Arc<AtomicUsize>,
    open: Arc<AtomicUsize>,
}

impl Counted {
    fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }
    fn open(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }
}

async fn counted<F, Fut>(handler: F) -> Counted
where
    F: Fn(Request<Incoming>) -> Fut + Send + Sync + Clone + 'static,
    Fut: std::future::Future<Output = Response<Body>> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let open = Arc::new(AtomicUsize::new(0));
    let (a, o) = (accepted.clone(), open.clone());
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            a.fetch_add(1, Ordering::SeqCst);
            o.fetch_add(1, Ordering::SeqCst);
            let (o, handler) = (o.clone(), handler.clone());
            tokio::spawn(async move {
                let service = service_fn(move |req| {
                    let fut = handler(req);
                    async move { Ok::<_, std::convert::Infallible>(fut.await) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
                o.fetch_sub(1, Ordering::SeqCst);
            });
        }
    });
    Counted {
        addr,
        accepted,
        open,
    }
}

fn config(addr: std::net::SocketAddr, extra: &str) -> String {
    format!(
        "[upstreams.u]\nendpoints = [\"http://{addr}\"]\n{extra}\n[[routes]]\nname = \"r\"\nupstream = \"u\"\n"
    )
}

#[tokio::test]
async fn sequential_requests_reuse_one_connection() {
    let up = counted(|_| async { Response::new(full("ok")) }).await;
    let server = proxy(&config(up.addr, "")).await;
    for _ in 0..20 {
        let (status, _, body) = get(&server, "/").await;
        assert_eq!(status, 200);
        assert_eq!(body, "ok");
    }
    assert_eq!(up.accepted(), 1);
}

#[tokio::test]
async fn a_connection_carries_one_request_at_a_time() {
    // The first answer streams its body until told to finish; meanwhile a
    // second request needs a second connection.
    let (finish_tx, finish_rx) = tokio::sync::mpsc::channel::<()>(1);
    let finish_rx = Arc::new(tokio::sync::Mutex::new(finish_rx));
    let calls = Arc::new(AtomicUsize::new(0));
    let up = counted(move |_| {
        let (finish_rx, calls) = (finish_rx.clone(), calls.clone());
        async move {
            if calls.fetch_add(1, Ordering::SeqCst) > 0 {
                return Response::new(full("quick"));
            }
            let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(1);
            tokio::spawn(async move {
                let _ = tx.send(Ok(Frame::data(Bytes::from("slow ")))).await;
                finish_rx.lock().await.recv().await;
                let _ = tx.send(Ok(Frame::data(Bytes::from("done")))).await;
            });
            Response::new(http_body_util::StreamBody::new(tokio_stream(rx)).boxed())
        }
    })
    .await;
    let server = proxy(&config(up.addr, "")).await;
    let url = format!("http://{}/slow", server.proxy_addr());
    let slow = client().get(url.parse().unwrap()).await.unwrap();
    assert_eq!(slow.status(), 200);
    let (status, _, body) = get(&server, "/quick").await;
    assert_eq!((status, body), (http::StatusCode::OK, Bytes::from("quick")));
    assert_eq!(up.accepted(), 2, "the busy connection was not shared");
    finish_tx.send(()).await.unwrap();
    let body = slow.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "slow done");
    // Both connections are idle again: later requests open no more.
    for _ in 0..10 {
        assert_eq!(get(&server, "/").await.0, 200);
    }
    assert_eq!(up.accepted(), 2);
}

/// A receiver as a stream of frames.
fn tokio_stream(
    mut rx: tokio::sync::mpsc::Receiver<Result<Frame<Bytes>, BoxError>>,
) -> impl futures_util::Stream<Item = Result<Frame<Bytes>, BoxError>> {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

#[tokio::test]
async fn idle_connections_close_after_pool_idle_timeout() {
    let up = counted(|_| async { Response::new(full("ok")) }).await;
    let server = proxy(&config(up.addr, "pool_idle_timeout = \"1s\"")).await;
    assert_eq!(get(&server, "/").await.0, 200);
    assert_eq!(up.open(), 1);
    eventually(
        Duration::from_secs(5),
        "the idle connection closed",
        || async { up.open() == 0 },
    )
    .await;
    assert_eq!(get(&server, "/").await.0, 200);
    assert_eq!(up.accepted(), 2);
}

#[tokio::test]
async fn a_busy_connection_is_not_closed_as_idle() {
    // The first request is held; the second, on a second connection, is not.
    let held = Arc::new(tokio::sync::Notify::new());
    let calls = Arc::new(AtomicUsize::new(0));
    let (h, c) = (held.clone(), calls.clone());
    let up = counted(move |_| {
        let (h, c) = (h.clone(), c.clone());
        async move {
            if c.fetch_add(1, Ordering::SeqCst) == 0 {
                h.notified().await;
            }
            Response::new(full("ok"))
        }
    })
    .await;
    let server = proxy(&config(up.addr, "pool_idle_timeout = \"1s\"")).await;
    let pending = tokio::spawn({
        let url = format!("http://{}/", server.proxy_addr());
        async move { client().get(url.parse().unwrap()).await.unwrap() }
    });
    eventually(
        Duration::from_secs(5),
        "the first request arrived",
        || async { calls.load(Ordering::SeqCst) == 1 },
    )
    .await;
    assert_eq!(get(&server, "/").await.0, 200);
    assert_eq!(up.open(), 2);
    // The idle one goes once its timeout has passed; the busy one, used
    // before it, stays.
    eventually(
        Duration::from_secs(5),
        "the idle connection closed",
        || async { up.open() == 1 },
    )
    .await;
    held.notify_one();
    let resp = pending.await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.into_body().collect().await.unwrap().to_bytes(), "ok");
}

/// GET / answers `body` with 200 at the first attempt (request number `i`).
async fn answered_at_first_try(server: &herdguard::app::Server, body: &'static str, i: usize) {
    let (status, headers, got) = get(server, "/").await;
    assert_eq!(
        (status, got),
        (http::StatusCode::OK, Bytes::from(body)),
        "request {i}"
    );
    assert_eq!(headers["x-herdguard-attempts"], "1", "request {i}");
}

/// An upstream that answers one request per connection, then closes it
/// without saying so (no `Connection: close`), as servers with short idle
/// timeouts do.
async fn one_shot_upstream() -> (std::net::SocketAddr, Arc<AtomicUsize>) {
    let up = answering_then(b"", true).await;
    (up.addr, up.accepted)
}

/// An upstream that answers the first request on each connection and then,
/// once told (`go`), closes the connection (`then` empty) or sends `then`
/// on it unasked and keeps it open; it says on `done` when it has.
struct AnsweringThen {
    addr: std::net::SocketAddr,
    accepted: Arc<AtomicUsize>,
    go: tokio::sync::watch::Sender<bool>,
    done: tokio::sync::mpsc::UnboundedReceiver<()>,
}

async fn answering_then(then: &'static [u8], at_once: bool) -> AnsweringThen {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let (go, go_rx) = tokio::sync::watch::channel(at_once);
    let (done, done_rx) = tokio::sync::mpsc::unbounded_channel();
    let a = accepted.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            a.fetch_add(1, Ordering::SeqCst);
            let (mut go, done) = (go_rx.clone(), done.clone());
            tokio::spawn(async move {
                if !read_head(&mut stream).await {
                    return;
                }
                let _ = stream
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                    .await;
                // Told to go, or no one left to tell it.
                let _ = go.wait_for(|go| *go).await;
                if !then.is_empty() {
                    let _ = stream.write_all(then).await;
                }
                let _ = done.send(());
                if !then.is_empty() {
                    // Kept open: only the stray bytes tell.
                    std::future::pending::<()>().await;
                }
            });
        }
    });
    AnsweringThen {
        addr,
        accepted,
        go,
        done: done_rx,
    }
}

#[tokio::test]
async fn connections_the_upstream_closed_are_not_used_again() {
    let (addr, accepted) = one_shot_upstream().await;
    let server = proxy(&config(addr, "")).await;
    // Had a closed connection been picked, a request would have needed a
    // second attempt.
    for i in 0..10 {
        answered_at_first_try(&server, "ok", i).await;
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 10);
}

/// The upstream closes an idle connection, or sends on it unasked, some
/// time after its answer (not with it): the proxy's next request goes on
/// a new connection at its first attempt. (The pool looks at the socket
/// itself before it reuses one: trusting the reactor's readiness alone,
/// which hears of a close or of stray bytes only at its next turn, a busy
/// proxy reused such connections, and took stray bytes for answers; see
/// docs/request-path.md.)
#[tokio::test]
async fn an_idle_connection_the_upstream_closed_or_spoke_on_later_is_not_used_again() {
    for then in [
        &b""[..],
        &b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nstray"[..],
    ] {
        let mut up = answering_then(then, false).await;
        let server = proxy(&config(up.addr, "")).await;
        answered_at_first_try(&server, "ok", 0).await;
        up.go.send_replace(true);
        up.done.recv().await.unwrap();
        answered_at_first_try(&server, "ok", 1).await;
        assert_eq!(up.accepted.load(Ordering::SeqCst), 2, "{then:?}");
    }
}

/// Longer than a connection stays idle before it is parked (1 s) plus
/// the upkeep's tick that parks it (1 s): the wait is the behaviour
/// tested, nothing to synchronise on.
const PARKED: Duration = Duration::from_millis(3000);

#[tokio::test]
async fn a_parked_connection_is_used_again_and_one_closed_while_parked_is_not() {
    // Parked, only the socket stays (out of the reactor); the next request
    // starts a new hyper connection over the same socket.
    let up = counted(|_| async { Response::new(full("ok")) }).await;
    let server = proxy(&config(up.addr, "")).await;
    for i in 0..3 {
        if i > 0 {
            tokio::time::sleep(PARKED).await;
        }
        answered_at_first_try(&server, "ok", i).await;
    }
    assert_eq!(up.accepted(), 1, "one socket, parked and taken back twice");
    assert_eq!(up.open(), 1);

    // An upstream that closed the socket while it was parked: the next
    // request takes a new connection, at its first attempt.
    let (addr, accepted) = one_shot_upstream().await;
    let server = proxy(&config(addr, "")).await;
    answered_at_first_try(&server, "ok", 0).await;
    tokio::time::sleep(PARKED).await;
    answered_at_first_try(&server, "ok", 1).await;
    assert_eq!(accepted.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn endpoints_named_by_host_name_are_resolved() {
    let up = counted(|_| async { Response::new(full("by name")) }).await;
    let url = format!("http://localhost:{}", up.addr.port());
    let server = proxy(&format!(
        "[upstreams.u]\nendpoints = [\"{url}\"]\n[[routes]]\nname = \"r\"\nupstream = \"u\"\n"
    ))
    .await;
    for _ in 0..3 {
        let (status, _, body) = get(&server, "/").await;
        assert_eq!(
            (status, body),
            (http::StatusCode::OK, Bytes::from("by name"))
        );
    }
    assert_eq!(up.accepted(), 1);
}

#[tokio::test]
async fn a_connection_whose_response_was_abandoned_is_not_reused() {
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let up = counted(move |_| {
        let c = c.clone();
        async move {
            if c.fetch_add(1, Ordering::SeqCst) > 0 {
                return Response::new(full("whole"));
            }
            // The first answer sends a part of its body, then never ends.
            let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(1);
            tokio::spawn(async move {
                let _ = tx.send(Ok(Frame::data(Bytes::from("part")))).await;
                tx.closed().await;
            });
            Response::new(http_body_util::StreamBody::new(tokio_stream(rx)).boxed())
        }
    })
    .await;
    let server = proxy(&config(up.addr, "")).await;
    let url = format!("http://{}/", server.proxy_addr());
    let resp = client().get(url.parse().unwrap()).await.unwrap();
    let mut body = resp.into_body();
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(first, "part");
    drop(body);
    for i in 0..5 {
        answered_at_first_try(&server, "whole", i).await;
    }
    assert_eq!(
        up.accepted(),
        2,
        "one connection for the abandoned answer, one for the rest"
    );
}

/// A burst opens as many connections as it has requests at once; when it
/// is over, only `pool_max_idle` of them stay, the rest closed as they come
/// back (each idle connection holds its buffers), as nginx's `keepalive`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_leaves_at_most_pool_max_idle_connections() {
    let release = Arc::new(tokio::sync::Semaphore::new(0));
    let waiting = Arc::new(AtomicUsize::new(0));
    let (r, w) = (release.clone(), waiting.clone());
    let up = counted(move |_| {
        let (r, w) = (r.clone(), w.clone());
        async move {
            // Every request waits until all of the burst has arrived.
            w.fetch_add(1, Ordering::SeqCst);
            let _ = r.acquire().await.map(|p| p.forget());
            Response::new(full("ok"))
        }
    })
    .await;
    let server = Arc::new(proxy(&config(up.addr, "pool_max_idle = 3")).await);
    let burst: Vec<_> = (0..12)
        .map(|_| {
            let server = server.clone();
            tokio::spawn(async move { get(&server, "/").await.0 })
        })
        .collect();
    eventually(
        Duration::from_secs(10),
        "the whole burst arrived",
        || async { waiting.load(Ordering::SeqCst) == 12 },
    )
    .await;
    assert_eq!(up.open(), 12, "one connection per request in flight");
    release.add_permits(12 + 5);
    for request in burst {
        assert_eq!(request.await.unwrap(), 200);
    }
    eventually(Duration::from_secs(10), "all but 3 closed", || async {
        up.open() == 3
    })
    .await;
    // The 3 kept are reused.
    for _ in 0..5 {
        assert_eq!(get(&server, "/").await.0, 200);
    }
    assert_eq!(up.accepted(), 12);
}
