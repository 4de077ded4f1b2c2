//! Graceful shutdown: stop accepting, finish what is in flight, then exit.

use crate::common;

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

#[tokio::test]
async fn idle_connections_close_when_draining_and_the_drain_ends_with_them() {
    use tokio::io::AsyncReadExt;

    let up = ok_upstream("hi").await;
    // A drain that waited for its timeout would take a minute, and so would
    // an idle connection closing on its own.
    let config = herdguard::config::Config::parse(&format!(
        "[listen]\naddress = \"127.0.0.1:0\"\ndrain_timeout = \"60s\"\nheader_read_timeout = \"60s\"\n\
         [admin]\naddress = \"127.0.0.1:0\"\n\
         [upstreams.u]\nendpoints = [\"{}\"]\n[[routes]]\nname = \"all\"\nupstream = \"u\"\n",
        up.url()
    ))
    .unwrap();
    let server = herdguard::app::Server::start(config).await.unwrap();

    // Two keep-alive connections, each left idle after one answered request.
    let mut idle = Vec::new();
    for _ in 0..2 {
        let mut conn = tokio::net::TcpStream::connect(server.proxy_addr())
            .await
            .unwrap();
        let head = answered(&mut conn, b"GET /a HTTP/1.1\r\nhost: x\r\n\r\n", b"hi").await;
        assert!(head.starts_with(b"HTTP/1.1 200"));
        idle.push(conn);
    }
    // And one that has sent nothing yet: with no request, nothing to finish.
    idle.push(
        tokio::net::TcpStream::connect(server.proxy_addr())
            .await
            .unwrap(),
    );
    // And an h2c connection, which the client keeps in its pool for 90 s.
    let h2c = h2c_client();
    let req = Request::get(format!("http://{}/a", server.proxy_addr()))
        .version(http::Version::HTTP_2)
        .body(empty())
        .unwrap();
    assert_eq!(send(&h2c, req).await.0, StatusCode::OK);

    server.shutdown();
    for mut conn in idle {
        let mut buf = [0u8; 64];
        let n = tokio::time::timeout(std::time::Duration::from_secs(20), conn.read(&mut buf))
            .await
            .expect("an idle connection was left open while draining")
            .unwrap_or(0);
        assert_eq!(n, 0, "expected the proxy to close the idle connection");
    }
    tokio::time::timeout(std::time::Duration::from_secs(20), server.wait())
        .await
        .expect("the drain waited for connections that had closed, or an h2c one it did not close");
    drop(h2c);
}

/// An h2c connection to `listen` that has sent one request and read its
/// answer; its connection task reports when the connection ends.
async fn h2_after_one_request(
    listen: &str,
) -> (h2::client::SendRequest<bytes::Bytes>, oneshot::Receiver<()>) {
    let tcp = tokio::net::TcpStream::connect(listen).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    let (ended_tx, ended) = oneshot::channel();
    tokio::spawn(async move {
        let _ = conn.await;
        let _ = ended_tx.send(());
    });
    let mut client = client.ready().await.unwrap();
    let (resp, _) = client
        .send_request(Request::get("http://a/one").body(()).unwrap(), true)
        .unwrap();
    let mut body = resp.await.unwrap().into_body();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.unwrap();
        let _ = body.flow_control().release_capacity(chunk.len());
    }
    (client, ended)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_h2_connection_is_closed_after_idle_timeout() {
    let up = ok_upstream("fine").await;
    let hg = common::process::Binary::start_with(
        "idle_timeout = \"400ms\"",
        &format!(
            "[upstreams.u]\nendpoints = [\"{}\"]\n[[routes]]\nname = \"r\"\nupstream = \"u\"\n",
            up.url()
        ),
    )
    .await;
    let (_client, ended) = h2_after_one_request(&hg.listen).await;
    tokio::time::timeout(std::time::Duration::from_secs(5), ended)
        .await
        .expect("the idle connection was closed")
        .unwrap();
    hg.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_still_answering_outlives_idle_timeout() {
    use http_body_util::StreamBody;
    // The upstream sends its body in 6 pieces, 250 ms apart: 1.5 s, well
    // past the 400 ms idle timeout of a connection with no new request.
    let slow = upstream(|_| async {
        let pieces = futures_util::stream::unfold(0u8, |i| async move {
            if i == 6 {
                return None;
            }
            tokio::time::sleep(std::time::Duration::from_millis(250)).await;
            Some((
                Ok::<_, BoxError>(hyper::body::Frame::data(bytes::Bytes::from(vec![
                    b'a' + i;
                    10
                ]))),
                i + 1,
            ))
        });
        http::Response::new(http_body_util::BodyExt::boxed(StreamBody::new(pieces)))
    })
    .await;
    let hg = common::process::Binary::start_with(
        "idle_timeout = \"400ms\"",
        &format!(
            "[upstreams.u]\nendpoints = [\"{}\"]\n[[routes]]\nname = \"r\"\nupstream = \"u\"\n",
            slow.url()
        ),
    )
    .await;
    let (status, _, body) = send(
        &h2c_client(),
        Request::get(format!("http://{}/slow", hg.listen))
            .body(empty())
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body.len(), 60, "the whole body came");
    hg.terminate().await;
}

/// `listen.drain_delay`: after SIGTERM, /readyz is 503 at once but new
/// connections are still accepted and served until the delay has passed;
/// then the drain proceeds and the process exits by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_delay_keeps_serving_new_callers_with_readiness_off() {
    use common::process::Binary;
    let up = ok_upstream("fine").await;
    let hg = Binary::start_with(
        "drain_delay = \"5s\"",
        &format!(
            "[upstreams.u]\nendpoints = [\"{}\"]\n[[routes]]\nname = \"r\"\nupstream = \"u\"\n",
            up.url()
        ),
    )
    .await;
    let readyz = || async {
        let req = http::Request::get(format!("http://{}/readyz", hg.admin))
            .body(empty())
            .unwrap();
        send(&client(), req).await.0
    };
    assert_eq!(readyz().await, http::StatusCode::OK);
    let started = std::time::Instant::now();
    hg.sigterm();
    eventually(
        std::time::Duration::from_secs(2),
        "/readyz turns 503",
        || async { readyz().await == http::StatusCode::SERVICE_UNAVAILABLE },
    )
    .await;
    // A caller that connects now (a fresh client: a new connection) is served.
    let req = http::Request::get(format!("http://{}/x", hg.listen))
        .body(empty())
        .unwrap();
    let (status, _, body) = send(&client(), req).await;
    assert!(
        started.elapsed() < std::time::Duration::from_secs(5),
        "the request came within the delay"
    );
    assert_eq!((status, &body[..]), (http::StatusCode::OK, &b"fine"[..]));
    let lines = hg.exited().await;
    assert!(
        started.elapsed() >= std::time::Duration::from_secs(5),
        "it waited for the delay before it stopped"
    );
    assert!(
        lines.iter().any(|l| l.contains("drain delay")),
        "{lines:#?}"
    );
}

/// A drain that runs out of time says so, with how many connections it
/// cut, and the process still exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_timeout_that_cuts_connections_logs_how_many() {
    use common::process::Binary;
    let Held {
        upstream: up,
        arrived,
        release: _release,
    } = held_upstream("never").await;
    let hg = Binary::start_with(
        "drain_timeout = \"300ms\"",
        &format!(
            "[upstreams.u]\nendpoints = [\"{}\"]\n[[routes]]\nname = \"r\"\nupstream = \"u\"\n\
             retry = {{ per_try_timeout = \"30s\", timeout = \"30s\" }}\n",
            up.url()
        ),
    )
    .await;
    let mut callers = Vec::new();
    for _ in 0..2 {
        let req = http::Request::get(format!("http://{}/held", hg.listen))
            .body(empty())
            .unwrap();
        callers.push(tokio::spawn(async move { send(&client(), req).await }));
        arrived.notified().await;
    }
    hg.sigterm();
    let lines = hg.exited().await;
    let cut = lines
        .iter()
        .find(|l| l.contains("drain timeout passed"))
        .unwrap_or_else(|| panic!("{lines:#?}"));
    let cut: serde_json::Value = serde_json::from_str(cut).unwrap();
    assert_eq!(cut["connections"], 2, "{cut}");
    assert_eq!(cut["level"], "WARN");
    for caller in callers {
        caller.abort();
    }
}

/// A caller that reads nothing of its answer until the drain runs out of
/// time is reset: what was queued for it is dropped with the connection,
/// not sent on after the process is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_timeout_resets_a_caller_that_reads_nothing() {
    use common::process::Binary;
    let big = upstream(|_| async { http::Response::new(full(vec![b'x'; 32 << 20])) }).await;
    let hg = Binary::start_with(
        "drain_timeout = \"300ms\"",
        &format!(
            "[upstreams.u]\nendpoints = [\"{}\"]\n[[routes]]\nname = \"r\"\nupstream = \"u\"\n",
            big.url()
        ),
    )
    .await;
    let mut stuck = stuck_caller(&hg).await;
    hg.sigterm();
    hg.exited().await;
    let (got, end) = read_to_end(&mut stuck).await;
    assert_eq!(
        end,
        Err(std::io::ErrorKind::ConnectionReset),
        "after {got} bytes"
    );
    assert!(got < 32 << 20, "{got}");
}
