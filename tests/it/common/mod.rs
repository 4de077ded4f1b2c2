//! Helpers shared by the integration tests: in-process upstreams on
//! 127.0.0.1:0, the whole proxy started in-process, and a plain client.
#![allow(dead_code)]

pub mod dns;
pub mod process;
pub mod scripted;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;

use herdguard::app::Server;
use herdguard::config::Config;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub type Body = BoxBody<Bytes, BoxError>;

pub fn full(data: impl Into<Bytes>) -> Body {
    Full::new(data.into())
        .map_err(|never| match never {})
        .boxed()
}

pub fn empty() -> Body {
    full(Bytes::new())
}

/// What an upstream saw of one request.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: http::Method,
    pub uri: http::Uri,
    pub version: http::Version,
    pub headers: http::HeaderMap,
}

/// An in-process upstream on 127.0.0.1:0 that records every request it gets.
pub struct Upstream {
    pub addr: SocketAddr,
    pub seen: Arc<Mutex<Vec<Seen>>>,
    pub hits: Arc<AtomicUsize>,
}

impl Upstream {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }

    pub fn last(&self) -> Seen {
        self.seen
            .lock()
            .unwrap()
            .last()
            .cloned()
            .expect("the upstream saw a request")
    }
}

/// Starts an upstream whose answers come from `handler`.
pub async fn upstream<F, Fut>(handler: F) -> Upstream
where
    F: Fn(Request<Incoming>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Response<Body>> + Send + 'static,
{
    fallible_upstream(move |req| {
        let fut = handler(req);
        async move { Ok(fut.await) }
    })
    .await
}

/// Starts an upstream whose `handler` may fail: the connection is then
/// closed without a response (a reset before response headers).
pub async fn fallible_upstream<F, Fut>(handler: F) -> Upstream
where
    F: Fn(Request<Incoming>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Response<Body>, BoxError>> + Send + 'static,
{
    fallible_upstream_at("127.0.0.1:0", handler).await
}

/// An upstream whose answers come from `handler`, on `addr`.
pub async fn upstream_at<F, Fut>(addr: &str, handler: F) -> Upstream
where
    F: Fn(Request<Incoming>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Response<Body>> + Send + 'static,
{
    fallible_upstream_at(addr, move |req| {
        let fut = handler(req);
        async move { Ok(fut.await) }
    })
    .await
}

async fn fallible_upstream_at<F, Fut>(addr: &str, handler: F) -> Upstream
where
    F: Fn(Request<Incoming>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Response<Body>, BoxError>> + Send + 'static,
{
    let listener = TcpListener::bind(addr).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let hits = Arc::new(AtomicUsize::new(0));
    let handler = Arc::new(handler);
    {
        let seen = seen.clone();
        let hits = hits.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let handler = handler.clone();
                let seen = seen.clone();
                let hits = hits.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |req: Request<Incoming>| {
                        seen.lock().unwrap().push(Seen {
                            method: req.method().clone(),
                            uri: req.uri().clone(),
                            version: req.version(),
                            headers: req.headers().clone(),
                        });
                        hits.fetch_add(1, Ordering::SeqCst);
                        handler(req)
                    });
                    let _ = auto::Builder::new(TokioExecutor::new())
                        .serve_connection_with_upgrades(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
    }
    Upstream { addr, seen, hits }
}

/// An upstream that answers every request with 200 and `body`.
pub async fn ok_upstream(body: &'static str) -> Upstream {
    upstream(move |_| async move { Response::new(full(body)) }).await
}

/// An upstream that streams each request body back as the response body.
pub async fn echo_upstream() -> Upstream {
    upstream(|req: Request<Incoming>| async move {
        let (_, body) = req.into_parts();
        Response::new(body.map_err(Into::into).boxed())
    })
    .await
}

/// A loopback address nobody listens on.
pub async fn closed_port() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    l.local_addr().unwrap()
}

/// Starts the proxy from TOML; `listen` and `admin` are set to ephemeral ports.
pub async fn proxy(toml: &str) -> Server {
    let src = format!(
        "[listen]\naddress = \"127.0.0.1:0\"\ndrain_timeout = \"5s\"\n[admin]\naddress = \"127.0.0.1:0\"\n{toml}"
    );
    let config = Config::parse(&src).unwrap_or_else(|e| panic!("{e}\n{src}"));
    Server::start(config).await.unwrap()
}

/// A proxy with one catch-all route to `url`.
pub async fn proxy_to(url: &str) -> Server {
    proxy(&format!(
        "[upstreams.u]\nendpoints = [\"{url}\"]\n[[routes]]\nname = \"all\"\nupstream = \"u\"\n"
    ))
    .await
}

pub type TestClient = Client<HttpConnector, Body>;

/// An HTTP/1.1 client.
pub fn client() -> TestClient {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

/// An HTTP/2 client with prior knowledge (h2c).
pub fn h2c_client() -> TestClient {
    Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build(HttpConnector::new())
}

/// Sends a GET to the proxy and returns status, headers and the whole body.
pub async fn get(server: &Server, path: &str) -> (http::StatusCode, http::HeaderMap, Bytes) {
    send(
        &client(),
        Request::get(format!("http://{}{path}", server.proxy_addr()))
            .body(empty())
            .unwrap(),
    )
    .await
}

/// `GET path` on the listener at `listen` (a binary's): status, headers, body.
pub async fn get_at(listen: &str, path: &str) -> (http::StatusCode, http::HeaderMap, Bytes) {
    let req = Request::get(format!("http://{listen}{path}"))
        .body(empty())
        .unwrap();
    send(&client(), req).await
}

pub async fn send(
    client: &TestClient,
    req: Request<Body>,
) -> (http::StatusCode, http::HeaderMap, Bytes) {
    let resp = client.request(req).await.expect("the proxy answered");
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.expect("a whole body").to_bytes();
    (parts.status, parts.headers, body)
}

/// GETs a path on the admin listener and returns status and body text.
pub async fn admin(server: &Server, path: &str) -> (http::StatusCode, String) {
    let req = Request::get(format!("http://{}{path}", server.admin_addr()))
        .body(empty())
        .unwrap();
    let (status, _, body) = send(&client(), req).await;
    (status, String::from_utf8(body.to_vec()).unwrap())
}

/// The value of one series in Prometheus text, e.g.
/// `metric(&text, "herdguard_shed_total{upstream=\"u\"}")`.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        l.strip_prefix(series)
            .and_then(|rest| rest.trim().parse().ok())
    })
}

/// POSTs to a path on the admin listener and returns status and body text.
pub async fn admin_post(server: &Server, path: &str) -> (http::StatusCode, String) {
    let req = Request::post(format!("http://{}{path}", server.admin_addr()))
        .body(empty())
        .unwrap();
    let (status, _, body) = send(&client(), req).await;
    (status, String::from_utf8(body.to_vec()).unwrap())
}

/// Polls `check` every 10 ms until it holds, for at most `limit`; panics after.
pub async fn eventually<F, Fut>(limit: std::time::Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    while tokio::time::Instant::now() < deadline {
        if check().await {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("not within {limit:?}: {what}");
}

/// A caller that asks `hg` for `GET /big` and reads none of it, once its
/// request holds upstream `u`'s slot.
pub async fn stuck_caller(hg: &process::Binary) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt as _;
    let mut stuck = tokio::net::TcpStream::connect(&hg.listen).await.unwrap();
    stuck
        .write_all(b"GET /big HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .unwrap();
    eventually(
        std::time::Duration::from_secs(5),
        "the answer is under way",
        || async { hg.metric(r#"herdguard_in_flight{upstream="u"}"#).await == 1.0 },
    )
    .await;
    stuck
}

/// Reads `stream` to its end, for at most 10 s: the bytes read, and how it
/// ended (`Ok`: a clean end; else the error's kind, such as a reset).
pub async fn read_to_end(
    stream: &mut tokio::net::TcpStream,
) -> (usize, Result<(), std::io::ErrorKind>) {
    use tokio::io::AsyncReadExt as _;
    let mut buf = vec![0u8; 1 << 16];
    let mut got = 0;
    let end = tokio::time::timeout(std::time::Duration::from_secs(10), async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) => break Ok(()),
                Ok(n) => got += n,
                Err(e) => break Err(e.kind()),
            }
        }
    })
    .await
    .expect("the connection ends within 10 s");
    (got, end)
}

/// An upstream that holds every request until released, and says when one arrived.
pub struct Held {
    pub upstream: Upstream,
    pub arrived: Arc<tokio::sync::Notify>,
    pub release: Arc<tokio::sync::Notify>,
}

/// Starts a [`Held`] upstream that answers 200 with `body` once released.
pub async fn held_upstream(body: &'static str) -> Held {
    let release = Arc::new(tokio::sync::Notify::new());
    let arrived = Arc::new(tokio::sync::Notify::new());
    let (r, a) = (release.clone(), arrived.clone());
    let upstream = upstream(move |_| {
        let (release, arrived) = (r.clone(), a.clone());
        async move {
            arrived.notify_one();
            release.notified().await;
            Response::new(full(body))
        }
    })
    .await;
    Held {
        upstream,
        arrived,
        release,
    }
}

/// Reads a request head off a raw upstream connection; false if the
/// connection ended first.
pub async fn read_head(stream: &mut tokio::net::TcpStream) -> bool {
    use tokio::io::AsyncReadExt;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    true
}

/// Writes `request` on `stream`, a connection kept open after it, and reads
/// its answer up to `body_end` (each read within 10 s); panics on a close,
/// an error or a silence first. The answer, head and body.
pub async fn answered(
    stream: &mut (impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin),
    request: &[u8],
    body_end: &[u8],
) -> Vec<u8> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    stream.write_all(request).await.unwrap();
    let mut answer = Vec::new();
    while !answer.ends_with(body_end) {
        let mut chunk = [0u8; 1024];
        let read =
            tokio::time::timeout(std::time::Duration::from_secs(10), stream.read(&mut chunk));
        match read.await {
            Ok(Ok(n)) if n > 0 => answer.extend_from_slice(&chunk[..n]),
            other => panic!(
                "no answer: {other:?} after {:?}",
                String::from_utf8_lossy(&answer)
            ),
        }
    }
    answer
}

/// Sends raw bytes on a new connection to `addr` and reads until it closes.
pub async fn raw_exchange(addr: impl tokio::net::ToSocketAddrs, request: &[u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.write_all(request).await.unwrap();
    let mut out = Vec::new();
    let _ = stream.read_to_end(&mut out).await;
    String::from_utf8_lossy(&out).into_owned()
}

/// A FIFO made at `path` (with `mkfifo`), for tests of what must not wait
/// for a writer.
pub fn fifo(path: &std::path::Path) -> std::path::PathBuf {
    let made = std::process::Command::new("mkfifo").arg(path).status();
    assert!(made.is_ok_and(|s| s.success()), "mkfifo {}", path.display());
    path.to_owned()
}

/// Raises this process's soft open-file limit to the hard one: the test
/// holds one descriptor per connection it opens.
pub fn raise_open_files() -> u64 {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let limit = getrlimit(Resource::Nofile);
    let raised = Rlimit {
        current: limit.maximum,
        maximum: limit.maximum,
    };
    match setrlimit(Resource::Nofile, raised) {
        Ok(()) => limit.maximum.unwrap_or(u64::MAX),
        Err(_) => limit.current.unwrap_or(u64::MAX),
    }
}

/// Taken by the tests that flood the proxy with thousands of connections
/// (and those that measure what others' floods would blur): one at a
/// time, so that neither runs the test process out of descriptors nor the
/// machine out of CPU for the other.
pub async fn heavy() -> tokio::sync::MutexGuard<'static, ()> {
    static HEAVY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    HEAVY.lock().await
}

/// Installs what tests need beyond cargo (iptables, promtool) when it is
/// missing, once per test process: `.ci/test-tools`.
pub fn test_tools() {
    static DONE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let ok = *DONE.get_or_init(|| {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        std::process::Command::new("bash")
            .arg(root.join(".ci/test-tools"))
            .status()
            .is_ok_and(|s| s.success())
    });
    assert!(
        ok,
        "the test tools could not be installed: bash .ci/test-tools"
    );
}

/// The explain trace of a response, without the request id it ends with
/// (`…;request_id=ID`, checked present).
pub fn explained(headers: &http::HeaderMap) -> String {
    let trace = headers["x-herdguard-explain"].to_str().unwrap();
    let (steps, id) = trace
        .rsplit_once(";request_id=")
        .unwrap_or_else(|| panic!("no request id in {trace}"));
    assert!(!id.is_empty(), "{trace}");
    steps.to_owned()
}
