//! `herdguard-lab train`: a herdguard binary run as a child, in front of an
//! upstream on loopback, under a fixed mix of requests, then stopped as an
//! operator stops it (SIGINT). It is the training run of the profile-guided
//! build (deploy/release-build.sh): a binary built with
//! `-Cprofile-generate` writes where its time went when it exits.
//!
//! The mix is what a sidecar sees most: small GETs answered whole, and
//! beside them POSTs with a body, answers in chunked coding, answers a retry
//! follows (503), and ones never retried (404). Paths it does not take (TLS,
//! HTTP/2, the access log) are compiled as code that rarely runs.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

/// What a training run sends.
#[derive(Debug, Clone)]
pub struct Params {
    pub requests: u64,
    pub callers: usize,
    /// The run stops at this even if not all requests were sent.
    pub limit: Duration,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            requests: 60_000,
            callers: 16,
            limit: Duration::from_secs(120),
        }
    }
}

/// How the requests were answered: count by status.
pub type Summary = BTreeMap<u16, u64>;

/// How long one request may take, head and body: an answer that does not
/// come counts as none, and the run goes on (it is bounded by its limit).
const ANSWER_WITHIN: Duration = Duration::from_secs(5);

/// The answer's body of the usual GET: about the size of nginx's index page.
const PAGE: &[u8] = &[b'x'; 612];

/// Runs `binary` under the mix and stops it.
pub async fn run(binary: &Path, params: &Params) -> Result<Summary, String> {
    let upstream = start_upstream().await?;
    let dir = std::env::temp_dir().join(format!("herdguard-train-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let [listen, admin] = free_ports()?;
    let config = dir.join("herdguard.toml");
    std::fs::write(
        &config,
        format!(
            "[listen]\naddress = \"{listen}\"\n[admin]\naddress = \"{admin}\"\n\
             [upstreams.up]\nendpoints = [\"http://{upstream}\"]\n\
             [[routes]]\nname = \"all\"\nupstream = \"up\"\n"
        ),
    )
    .map_err(|e| format!("{}: {e}", config.display()))?;
    let mut child = Command::new(binary)
        .arg("--config")
        .arg(&config)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .map_err(|e| format!("{}: {e}", binary.display()))?;
    let result = match ready(&mut child, admin, listen).await {
        Ok(()) => send(listen, params).await,
        Err(e) => Err(e),
    };
    let stopped = stop(&mut child).await;
    let _ = std::fs::remove_dir_all(&dir);
    let summary = result?;
    stopped?;
    Ok(summary)
}

/// Two ports nothing listens on now, held together so that they differ.
/// Another process may take one before the child binds it: the child then
/// fails to start, or [`ready`] does not hear herdguard there.
fn free_ports() -> Result<[SocketAddr; 2], String> {
    let bind = || std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string());
    let (a, b) = (bind()?, bind()?);
    let addr = |s: &std::net::TcpListener| s.local_addr().map_err(|e| e.to_string());
    Ok([addr(&a)?, addr(&b)?])
}

/// Waits (at most 10 s) until herdguard's admin listener at `admin`
/// answers its health check (a listener that is not herdguard's, or does
/// not answer, is not taken for it), and its proxy listener takes
/// connections; or until `child` exits (a config it refuses, a port
/// taken), which it says at once.
async fn ready(child: &mut Child, admin: SocketAddr, listen: SocketAddr) -> Result<(), String> {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let healthy = || async {
        let req = Request::get(format!("http://{admin}/healthz"))
            .body(Full::new(Bytes::new()))
            .ok()?;
        let resp = tokio::time::timeout(ANSWER_WITHIN, client.request(req))
            .await
            .ok()?
            .ok()?;
        let body = tokio::time::timeout(ANSWER_WITHIN, resp.into_body().collect())
            .await
            .ok()?
            .ok()?;
        (body.to_bytes().as_ref() == b"ok\n").then_some(())
    };
    for _ in 0..100 {
        if healthy().await.is_some() && tokio::net::TcpStream::connect(listen).await.is_ok() {
            return Ok(());
        }
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!("herdguard exited before it was ready: {status}"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(format!(
        "herdguard did not answer its health check at {admin} within 10 s"
    ))
}

/// SIGINT, as an operator stops it, and its exit (at most 30 s): the
/// profile is written as the process exits.
async fn stop(child: &mut Child) -> Result<(), String> {
    let pid = i32::try_from(child.id())
        .ok()
        .and_then(rustix::process::Pid::from_raw);
    let signalled = pid.map(|pid| rustix::process::kill_process(pid, rustix::process::Signal::INT));
    if !matches!(signalled, Some(Ok(()))) {
        let _ = child.kill();
        return Err(format!("could not signal herdguard: {signalled:?}"));
    }
    for _ in 0..300 {
        match child.try_wait() {
            Ok(Some(status)) if status.success() => return Ok(()),
            Ok(Some(status)) => return Err(format!("herdguard exited with {status}")),
            Ok(None) => tokio::time::sleep(Duration::from_millis(100)).await,
            Err(e) => return Err(e.to_string()),
        }
    }
    let _ = child.kill();
    Err("herdguard did not exit within 30 s of SIGINT".into())
}

/// The upstream: `/` a page, `/post` the length of what came, `/chunked`
/// a page in chunked coding, `/flaky` every other answer 503, anything
/// else 404.
async fn start_upstream() -> Result<SocketAddr, String> {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let flaky = Arc::new(AtomicU64::new(0));
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let flaky = flaky.clone();
            let service = service_fn(move |req: Request<Incoming>| {
                let flaky = flaky.clone();
                async move { Ok::<_, hyper::Error>(answer(req, &flaky).await) }
            });
            tokio::spawn(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service),
            );
        }
    });
    Ok(addr)
}

async fn answer(req: Request<Incoming>, flaky: &AtomicU64) -> Response<Page> {
    let page = |status: StatusCode, body: Page| {
        let mut resp = Response::new(body);
        *resp.status_mut() = status;
        let h = resp.headers_mut();
        h.insert("server", http::HeaderValue::from_static("train"));
        h.insert("content-type", http::HeaderValue::from_static("text/html"));
        h.insert(
            "last-modified",
            http::HeaderValue::from_static("Sat, 28 Nov 2026 12:00:00 GMT"),
        );
        h.insert("etag", http::HeaderValue::from_static("\"6929c3c0-264\""));
        h.insert("accept-ranges", http::HeaderValue::from_static("bytes"));
        resp
    };
    match req.uri().path() {
        "/" => page(StatusCode::OK, Page::whole(PAGE)),
        "/chunked" => page(StatusCode::OK, Page::chunked(PAGE)),
        "/post" => {
            let len = match req.into_body().collect().await {
                Ok(body) => body.to_bytes().len(),
                Err(_) => 0,
            };
            page(StatusCode::OK, Page::whole(len.to_string().as_bytes()))
        }
        "/flaky" if flaky.fetch_add(1, Ordering::Relaxed).is_multiple_of(2) => {
            page(StatusCode::SERVICE_UNAVAILABLE, Page::whole(b"busy"))
        }
        "/flaky" => page(StatusCode::OK, Page::whole(PAGE)),
        _ => page(StatusCode::NOT_FOUND, Page::whole(b"not found")),
    }
}

/// A body of known length, or one whose length is not told (sent in
/// chunked coding).
struct Page {
    data: Option<Bytes>,
    told: bool,
}

impl Page {
    fn whole(data: &[u8]) -> Self {
        Self {
            data: Some(Bytes::copy_from_slice(data)),
            told: true,
        }
    }

    fn chunked(data: &[u8]) -> Self {
        Self {
            data: Some(Bytes::copy_from_slice(data)),
            told: false,
        }
    }
}

impl Body for Page {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Poll::Ready(self.data.take().map(|d| Ok(Frame::data(d))))
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        match (&self.data, self.told) {
            (Some(d), true) => SizeHint::with_exact(d.len() as u64),
            (None, _) => SizeHint::with_exact(0),
            (Some(_), false) => SizeHint::default(),
        }
    }
}

/// The request of number `n`: of every 20, 14 GETs of the page, 2 POSTs
/// of 1 KiB, and one each of chunked, flaky, missing and a HEAD.
fn request(listen: SocketAddr, n: u64) -> Request<Full<Bytes>> {
    let (method, path, body): (&str, &str, &[u8]) = match n % 20 {
        0 | 10 => ("POST", "/post", &[b'p'; 1024]),
        5 => ("GET", "/chunked", b""),
        15 => ("GET", "/flaky", b""),
        17 => ("GET", "/missing", b""),
        19 => ("HEAD", "/", b""),
        _ => ("GET", "/", b""),
    };
    let mut req = Request::new(Full::new(Bytes::from_static(body)));
    *req.method_mut() = method.parse().unwrap_or(http::Method::GET);
    *req.uri_mut() = format!("http://{listen}{path}").parse().unwrap_or_default();
    req.headers_mut()
        .insert("accept", http::HeaderValue::from_static("*/*"));
    req.headers_mut().insert(
        "user-agent",
        http::HeaderValue::from_static("herdguard-lab"),
    );
    req
}

/// Sends the mix from `params.callers` callers on keep-alive connections.
async fn send(listen: SocketAddr, params: &Params) -> Result<Summary, String> {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let next = Arc::new(AtomicU64::new(0));
    let summary = Arc::new(Mutex::new(Summary::new()));
    let deadline = tokio::time::Instant::now() + params.limit;
    let mut callers = tokio::task::JoinSet::new();
    for _ in 0..params.callers {
        let (client, next, summary) = (client.clone(), next.clone(), summary.clone());
        let requests = params.requests;
        callers.spawn(async move {
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= requests || tokio::time::Instant::now() >= deadline {
                    return;
                }
                let exchange = async {
                    let resp = client.request(request(listen, n)).await.ok()?;
                    let status = resp.status().as_u16();
                    resp.into_body().collect().await.ok()?;
                    Some(status)
                };
                // An answer that does not come is counted as none.
                let status = tokio::time::timeout(ANSWER_WITHIN, exchange)
                    .await
                    .ok()
                    .flatten()
                    .unwrap_or(0);
                let mut summary = summary.lock().unwrap_or_else(|e| e.into_inner());
                *summary.entry(status).or_default() += 1;
            }
        });
    }
    while callers.join_next().await.is_some() {}
    let summary = summary.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let answered: u64 = summary
        .iter()
        .filter(|(s, _)| **s != 0)
        .map(|(_, n)| n)
        .sum();
    if answered * 10 < params.requests.min(next.load(Ordering::Relaxed)) * 9 {
        return Err(format!("most requests were not answered: {summary:?}"));
    }
    Ok(summary)
}
