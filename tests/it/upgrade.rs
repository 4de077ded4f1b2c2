//! WebSocket (HTTP/1.1 Upgrade) through the proxy: 101, then bytes both ways.

use crate::common;

use common::*;
use futures_util::{SinkExt, StreamExt};
use tokio::net::TcpListener;
use tokio_tungstenite::tungstenite::Message;

/// A WebSocket server on 127.0.0.1:0 that echoes every message.
async fn ws_echo_upstream() -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let Ok(mut ws) = tokio_tungstenite::accept_async(stream).await else {
                    return;
                };
                while let Some(Ok(msg)) = ws.next().await {
                    if msg.is_close() {
                        break;
                    }
                    if ws.send(msg).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    addr
}

#[tokio::test]
async fn websocket_echo_through_the_proxy() {
    let upstream = ws_echo_upstream().await;
    let server = proxy_to(&format!("http://{upstream}")).await;
    let (mut ws, resp) =
        tokio_tungstenite::connect_async(format!("ws://{}/socket", server.proxy_addr()))
            .await
            .expect("the upgrade passed through");
    assert_eq!(resp.status(), http::StatusCode::SWITCHING_PROTOCOLS);
    assert_eq!(resp.headers()["via"], "1.1 herdguard");

    for text in ["hello", "through", "herdguard"] {
        ws.send(Message::text(text)).await.unwrap();
        let echoed = ws.next().await.unwrap().unwrap();
        assert_eq!(echoed, Message::text(text));
    }
    let big = vec![7u8; 256 * 1024];
    ws.send(Message::binary(big.clone())).await.unwrap();
    assert_eq!(ws.next().await.unwrap().unwrap(), Message::binary(big));
    ws.close(None).await.unwrap();
}

#[tokio::test]
async fn a_websocket_talking_past_header_read_timeout_stays_open() {
    // Once switched, the connection carries the new protocol: no head is
    // timed on it.
    let upstream = ws_echo_upstream().await;
    let hg = common::process::Binary::start_with(
        "header_read_timeout = \"300ms\"",
        &tunnel_config(upstream, ""),
    )
    .await;
    let (mut ws, _) = tokio_tungstenite::connect_async(format!("ws://{}/socket", hg.listen))
        .await
        .expect("upgraded");
    // A message every 150 ms for 1.5 s: five header_read_timeouts.
    for i in 0..10 {
        ws.send(Message::text(format!("{i}"))).await.unwrap();
        let echoed = tokio::time::timeout(std::time::Duration::from_secs(2), ws.next())
            .await
            .unwrap_or_else(|_| panic!("message {i}: no echo"))
            .unwrap_or_else(|| panic!("message {i}: the tunnel closed"))
            .unwrap_or_else(|e| panic!("message {i}: {e}"));
        assert_eq!(echoed, Message::text(format!("{i}")));
        tokio::time::sleep(std::time::Duration::from_millis(150)).await;
    }
    ws.close(None).await.unwrap();
    hg.terminate().await;
}

/// An upstream on 127.0.0.1:0 that echoes WebSocket messages and answers
/// any other request `200 ok`.
async fn ws_or_plain_upstream() -> std::net::SocketAddr {
    use tokio::io::AsyncWriteExt;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                // Look at the head without taking it.
                let mut buf = vec![0u8; 4096];
                let head = loop {
                    let Ok(n) = stream.peek(&mut buf).await else {
                        return;
                    };
                    let text = String::from_utf8_lossy(&buf[..n]).to_ascii_lowercase();
                    if text.contains("\r\n\r\n") || n == 0 {
                        break text;
                    }
                    tokio::task::yield_now().await;
                };
                if head.contains("upgrade: websocket") {
                    let Ok(mut ws) = tokio_tungstenite::accept_async(stream).await else {
                        return;
                    };
                    while let Some(Ok(msg)) = ws.next().await {
                        if msg.is_close() || ws.send(msg).await.is_err() {
                            break;
                        }
                    }
                } else {
                    let end = head.find("\r\n\r\n").map_or(0, |i| i + 4);
                    let mut taken = vec![0u8; end];
                    let _ = tokio::io::AsyncReadExt::read_exact(&mut stream, &mut taken).await;
                    let _ = stream
                        .write_all(
                            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok",
                        )
                        .await;
                }
            });
        }
    });
    addr
}

fn tunnel_config(upstream: std::net::SocketAddr, keys: &str) -> String {
    format!(
        "[upstreams.u]\nendpoints = [\"http://{upstream}\"]\nmax_in_flight = 4\n\
         adaptive_concurrency = {{ enabled = false }}\n{keys}\n\
         [[routes]]\nname = \"r\"\nupstream = \"u\"\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_tunnels_do_not_hold_request_slots_and_have_their_own_limit() {
    let upstream = ws_or_plain_upstream().await;
    let hg = common::process::Binary::start(&tunnel_config(upstream, "max_tunnels = 10")).await;
    // Ten idle WebSockets against an upstream that takes 4 requests at a time.
    let mut sockets = Vec::new();
    for i in 0..10 {
        let (ws, resp) = tokio_tungstenite::connect_async(format!("ws://{}/s/{i}", hg.listen))
            .await
            .expect("upgraded");
        assert_eq!(resp.status(), http::StatusCode::SWITCHING_PROTOCOLS);
        sockets.push(ws);
    }
    // Plain requests are still served: the tunnels hold no request slot.
    for i in 0..8 {
        let req = http::Request::get(format!("http://{}/plain/{i}", hg.listen))
            .body(empty())
            .unwrap();
        assert_eq!(
            send(&client(), req).await.0,
            http::StatusCode::OK,
            "request {i}"
        );
    }
    // The eleventh tunnel is refused: 503 overloaded, from the proxy.
    let refused = tokio_tungstenite::connect_async(format!("ws://{}/s/11", hg.listen)).await;
    match refused {
        Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => {
            assert_eq!(resp.status(), http::StatusCode::SERVICE_UNAVAILABLE);
            assert_eq!(resp.headers()["x-herdguard-error"], "overloaded");
        }
        other => panic!("the eleventh tunnel was not refused: {other:?}"),
    }
    assert_eq!(
        hg.metric("herdguard_tunnels_open{upstream=\"u\"}").await,
        10.0
    );
    assert_eq!(hg.metric("herdguard_in_flight{upstream=\"u\"}").await, 0.0);
    // A closed tunnel gives its place back.
    let mut first = sockets.remove(0);
    first.close(None).await.unwrap();
    while first.next().await.is_some() {}
    drop(first);
    common::eventually(
        std::time::Duration::from_secs(5),
        "the place is free",
        || async { hg.metric("herdguard_tunnels_open{upstream=\"u\"}").await == 9.0 },
    )
    .await;
    let (again, _) = tokio_tungstenite::connect_async(format!("ws://{}/s/again", hg.listen))
        .await
        .expect("a place was free");
    drop(again);
    drop(sockets);
    hg.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_tunnel_is_closed_and_a_busy_one_is_not() {
    use std::time::Duration;
    let upstream = ws_or_plain_upstream().await;
    let hg =
        common::process::Binary::start(&tunnel_config(upstream, "tunnel_idle_timeout = \"400ms\""))
            .await;
    let url = format!("ws://{}/s", hg.listen);
    let (mut busy, _) = tokio_tungstenite::connect_async(&url).await.unwrap();
    let (mut idle, _) = tokio_tungstenite::connect_async(&url).await.unwrap();
    // The busy one talks every 100 ms for 1.2 s, three idle timeouts.
    for i in 0..12 {
        busy.send(Message::text(format!("{i}"))).await.unwrap();
        let echoed = tokio::time::timeout(Duration::from_secs(2), busy.next())
            .await
            .expect("the busy tunnel answers")
            .unwrap()
            .unwrap();
        assert_eq!(echoed, Message::text(format!("{i}")));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The idle one was closed by the proxy by then: its stream ends.
    let ended = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match idle.next().await {
                None | Some(Err(_)) => break,
                Some(Ok(m)) if m.is_close() => break,
                Some(Ok(_)) => {}
            }
        }
    })
    .await;
    assert!(ended.is_ok(), "the idle tunnel was not closed");
    common::eventually(Duration::from_secs(5), "its place is free", || async {
        hg.metric("herdguard_tunnels_open{upstream=\"u\"}").await == 1.0
    })
    .await;
    drop(busy);
    hg.terminate().await;
}

/// A drain waits for open tunnels as for connections: one still open after
/// SIGTERM goes on relaying and the process exits once it closes; one that
/// outlives `drain_timeout` is cut, and the log says how many were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_waits_for_tunnels_then_says_how_many_it_cut() {
    use std::time::Duration;
    let upstream = ws_or_plain_upstream().await;
    let hg = common::process::Binary::start_with(
        "drain_timeout = \"20s\"",
        &tunnel_config(upstream, ""),
    )
    .await;
    let (mut ws, _) = tokio_tungstenite::connect_async(format!("ws://{}/s", hg.listen))
        .await
        .unwrap();
    let admin = hg.admin.clone();
    hg.sigterm();
    eventually(Duration::from_secs(5), "draining", || async {
        let req = http::Request::get(format!("http://{admin}/readyz"))
            .body(empty())
            .unwrap();
        send(&client(), req).await.0 == http::StatusCode::SERVICE_UNAVAILABLE
    })
    .await;
    for i in 0..3 {
        ws.send(Message::text(format!("{i}"))).await.unwrap();
        let echoed = ws.next().await.unwrap().unwrap();
        assert_eq!(
            echoed,
            Message::text(format!("{i}")),
            "relayed while draining"
        );
    }
    ws.close(None).await.unwrap();
    drop(ws);
    let started = std::time::Instant::now();
    let lines = hg.exited().await;
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "exited once it closed"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains("draining upgraded connections")),
        "{lines:#?}"
    );
    assert!(
        !lines.iter().any(|l| l.contains("closing them")),
        "{lines:#?}"
    );

    let hg = common::process::Binary::start_with(
        "drain_timeout = \"300ms\"",
        &tunnel_config(upstream, ""),
    )
    .await;
    let (_ws, _) = tokio_tungstenite::connect_async(format!("ws://{}/s", hg.listen))
        .await
        .unwrap();
    hg.sigterm();
    let lines = hg.exited().await;
    let cut = lines
        .iter()
        .find(|l| l.contains("upgraded connections still open"))
        .unwrap_or_else(|| panic!("{lines:#?}"));
    let cut: serde_json::Value = serde_json::from_str(cut).unwrap();
    assert_eq!(cut["tunnels"], 1, "{cut}");
}
