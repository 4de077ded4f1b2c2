//! WebSocket (HTTP/1.1 Upgrade) through the proxy: 101, then bytes both ways.

mod common;

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
