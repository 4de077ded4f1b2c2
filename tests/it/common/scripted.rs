//! An upstream that answers from a script and records what it saw.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;

use super::*;

/// One scripted answer.
#[derive(Clone, Debug)]
pub enum Act {
    Status(u16),
    StatusRetryAfter(u16, String),
    /// Close the connection without answering.
    Reset,
}

/// What a scripted upstream saw of one request.
#[derive(Debug, Clone)]
pub struct Hit {
    pub at: Instant,
    pub attempt: Option<String>,
    pub body: Bytes,
}

pub struct Scripted {
    pub upstream: Upstream,
    hits: Arc<Mutex<Vec<Hit>>>,
}

impl Scripted {
    pub fn hits(&self) -> Vec<Hit> {
        self.hits.lock().unwrap().clone()
    }
}

/// An upstream that answers with `script` in order, then 200 "ok" forever.
pub async fn scripted(script: &[Act]) -> Scripted {
    let script = Arc::new(Mutex::new(script.iter().cloned().collect::<VecDeque<_>>()));
    let hits = Arc::new(Mutex::new(Vec::new()));
    let log = hits.clone();
    let upstream = fallible_upstream(move |req: Request<Incoming>| {
        let script = script.clone();
        let log = log.clone();
        async move {
            let attempt = req
                .headers()
                .get("x-herdguard-attempt")
                .map(|v| v.to_str().unwrap().to_owned());
            let body = req.into_body().collect().await?.to_bytes();
            log.lock().unwrap().push(Hit {
                at: Instant::now(),
                attempt,
                body,
            });
            let act = script.lock().unwrap().pop_front();
            match act {
                None => Ok(Response::new(full("ok"))),
                Some(Act::Status(code)) => Ok(Response::builder()
                    .status(code)
                    .body(full("scripted"))
                    .unwrap()),
                Some(Act::StatusRetryAfter(code, after)) => Ok(Response::builder()
                    .status(code)
                    .header("retry-after", after)
                    .body(full("scripted"))
                    .unwrap()),
                Some(Act::Reset) => Err("scripted reset".into()),
            }
        }
    })
    .await;
    Scripted { upstream, hits }
}

/// A proxy with one route `r` to `url` and `retry` as its inline retry table.
pub async fn proxy_with(urls: &[String], retry: &str) -> herdguard::app::Server {
    let endpoints: Vec<String> = urls.iter().map(|u| format!("\"{u}\"")).collect();
    proxy(&format!(
        "[upstreams.u]\nendpoints = [{}]\n[defaults.retry.backoff]\nbase = \"5ms\"\ncap = \"20ms\"\n[[routes]]\nname = \"r\"\nupstream = \"u\"\nretry = {{ {retry} }}\n",
        endpoints.join(", ")
    ))
    .await
}

pub async fn call(
    server: &herdguard::app::Server,
    req: http::request::Builder,
    body: Body,
) -> (StatusCode, http::HeaderMap, Bytes) {
    let req = req
        .uri(format!("http://{}/r", server.proxy_addr()))
        .body(body)
        .unwrap();
    send(&client(), req).await
}
