//! Graceful shutdown: stop accepting, finish what is in flight, then exit.

mod common;

use common::*;
use http::{Request, StatusCode};
use tokio::sync::oneshot;

#[tokio::test]
async fn in_flight_request_finishes_after_shutdown() {
    let Held {
        upstream: up,
        arrived,
        release,
    } = held_upstream("finished").await;
    let server = proxy_to(&up.url()).await;
    let addr = server.proxy_addr();

    let (tx, rx) = oneshot::channel();
    tokio::spawn(async move {
        let req = Request::get(format!("http://{addr}/slow"))
            .body(empty())
            .unwrap();
        let _ = tx.send(send(&client(), req).await);
    });
    arrived.notified().await;

    server.shutdown();
    // Readiness turns 503 while draining.
    let mut ready = admin(&server, "/readyz").await;
    for _ in 0..1000 {
        if ready.0 != StatusCode::OK {
            break;
        }
        tokio::task::yield_now().await;
        ready = admin(&server, "/readyz").await;
    }
    assert_eq!(
        ready,
        (StatusCode::SERVICE_UNAVAILABLE, "draining\n".to_owned())
    );
    // New connections are no longer accepted.
    let mut refused = false;
    for _ in 0..1000 {
        if tokio::net::TcpStream::connect(addr).await.is_err() {
            refused = true;
            break;
        }
        tokio::task::yield_now().await;
    }
    assert!(refused, "the listener still accepts after shutdown");

    release.notify_one();
    let (status, _, body) = rx.await.unwrap();
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"finished"[..]));
    server.wait().await;
}
