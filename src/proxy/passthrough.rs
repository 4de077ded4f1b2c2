//! Requests no route takes, with `listen.unrouted = "passthrough"`: each
//! is sent once to the host it names (its absolute form, or `Host`) and
//! never retried, under the route label `passthrough`; a `CONNECT` is
//! tunnelled (so `HTTPS_PROXY` works). Nothing here passes through a
//! budget or a breaker: no policy was written for these hosts, and one
//! attempt is all a request gets.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Request, Response, StatusCode, Uri, Version};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use super::error::LocalError;
use super::{Caller, ResponseBody};
use crate::upstream::tunnel::{OpenTunnels, Tunnels};
use crate::upstream::{Progress, RequestBody};
use crate::wire::headers;
use crate::wire::{CallerBody, CallerUpgrade};

/// Tunnels and their idle time: as an upstream's defaults.
const MAX_TUNNELS: usize = 1024;
const TUNNEL_IDLE: Duration = Duration::from_secs(300);
/// How long a connection to a passed-through host may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a passed-through request may wait for its response headers.
const HEADERS_TIMEOUT: Duration = Duration::from_secs(60);

/// Whether a request has passed through herdguard [`MAX_HOPS`] times: a
/// name that leads back to the proxy would otherwise loop until the head
/// is too large.
fn looped(h: &http::HeaderMap) -> bool {
    h.get_all(http::header::VIA)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .filter(|hop| hop.trim_ascii().ends_with(b"herdguard"))
        .nth(MAX_HOPS - 1)
        .is_some()
}

/// A captured connection that leads back to the proxy: its own requests
/// are being redirected to it, which is a setup mistake, said at most once
/// a minute.
fn captured_loop() {
    use std::sync::atomic::{AtomicU64, Ordering};
    static LAST: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let last = LAST.load(Ordering::Relaxed);
    if now >= last + 60
        && LAST
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    {
        tracing::warn!(
            "a redirected connection leads back to herdguard: its own outbound traffic is being captured. \
             The capture rules must exclude the user id herdguard runs as (HERDGUARD_UID for capture.sh, \
             runAsUser of the herdguard container)"
        );
    }
}

/// Hops through herdguard a passed-through request may have made.
const MAX_HOPS: usize = 8;

/// What passes requests through: a plain HTTP/1.1 client and the tunnels.
pub struct Passthrough {
    client: Client<HttpConnector, RequestBody>,
    pub tunnels: Arc<Tunnels>,
    /// The proxy's own listeners (callers', admin): a request for the
    /// first would loop, and one for the admin listener would reach it
    /// from loopback, with the rights of a local operator.
    own: [SocketAddr; 2],
}

impl Passthrough {
    pub fn new(own: [SocketAddr; 2]) -> Self {
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        http.set_connect_timeout(Some(CONNECT_TIMEOUT));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .pool_max_idle_per_host(8)
            .pool_timer(TokioTimer::new())
            .timer(TokioTimer::new())
            .retry_canceled_requests(false)
            .http1_max_buf_size(64 * 1024)
            .set_host(false)
            .build(http);
        Self {
            client,
            tunnels: Tunnels::new(MAX_TUNNELS, TUNNEL_IDLE),
            own,
        }
    }

    /// Whether `authority` names one of the proxy's own listeners.
    fn is_self(&self, authority: &Authority) -> bool {
        let port = authority.port_u16().unwrap_or(80);
        let host = authority.host().trim_matches(['[', ']']);
        self.own.iter().any(|own| {
            port == own.port()
                && (host.eq_ignore_ascii_case("localhost")
                    || host
                        .parse::<std::net::IpAddr>()
                        .is_ok_and(|ip| ip == own.ip() || ip.is_loopback()))
        })
    }

    /// Sends `req` once to `authority` and streams its answer back.
    pub async fn forward(
        &self,
        req: Box<Request<CallerBody>>,
        caller: &Caller,
        authority: Authority,
        write_timeout: Duration,
    ) -> Response<ResponseBody> {
        if self.is_self(&authority) || looped(req.headers()) {
            if caller.original.is_some() {
                captured_loop();
            }
            return LocalError::BadRequest.response(&format!(
                "{authority} is this proxy, or leads back to it: passing the request through would loop"
            ));
        }
        let (mut parts, body) = (*req).into_parts();
        // An absolute-form request names its host in its target: that is
        // the `Host` sent. A redirected one (origin form) keeps its own.
        let original_host = match parts.uri.authority() {
            Some(named) => http::HeaderValue::from_str(named.as_str()).ok(),
            None => parts.headers.get(http::header::HOST).cloned(),
        };
        let h = &mut parts.headers;
        headers::strip_hop_by_hop(h, false);
        headers::decrement_max_forwards(&parts.method, h);
        headers::add_via(h, parts.version);
        headers::add_forwarded(h, &caller.ip, caller.proto, original_host.clone());
        if let Some(host) = original_host {
            h.insert(http::header::HOST, host);
        }
        // Sent once: a mesh's proxy beside herdguard (Envoy) must not
        // repeat it either, whatever the caller asked.
        h.insert(
            &crate::wire::headers::X_ENVOY_MAX_RETRIES,
            http::HeaderValue::from_static("0"),
        );
        let path = parts
            .uri
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/"));
        let Ok(uri) = Uri::builder()
            .scheme(Scheme::HTTP)
            .authority(authority.clone())
            .path_and_query(path)
            .build()
        else {
            return LocalError::BadRequest
                .response("the request's target cannot be passed through");
        };
        let mut out = Request::new(RequestBody::stream(body, Arc::new(Progress::default())));
        *out.method_mut() = parts.method;
        *out.uri_mut() = uri;
        *out.version_mut() = Version::HTTP_11;
        *out.headers_mut() = parts.headers;
        let sent = tokio::time::timeout(HEADERS_TIMEOUT, self.client.request(out)).await;
        let mut resp = match sent {
            Ok(Ok(resp)) => {
                let (mut parts, body) = resp.into_parts();
                let found = headers::Present::of(&parts.headers);
                headers::strip_answer_hop_by_hop_found(&mut parts.headers, false, found);
                headers::add_via(&mut parts.headers, Version::HTTP_11);
                parts.headers.remove(&headers::X_HERDGUARD_ERROR);
                Response::from_parts(parts, ResponseBody::passthrough(body, write_timeout))
            }
            Ok(Err(e)) if e.is_connect() => LocalError::ConnectFailure.response(&format!(
                "could not connect to {authority} (passthrough): {}",
                crate::wire::error_chain(&e)
            )),
            Ok(Err(e)) => LocalError::Reset.response(&format!(
                "{authority} (passthrough): {}",
                crate::wire::error_chain(&e)
            )),
            Err(_) => LocalError::Timeout.response(&format!(
                "{authority} (passthrough) sent no response headers within {HEADERS_TIMEOUT:?}"
            )),
        };
        // One attempt, whatever came of it.
        resp.headers_mut().insert(
            &headers::X_HERDGUARD_ATTEMPTS,
            http::HeaderValue::from_static("1"),
        );
        resp
    }

    /// Answers a `CONNECT authority` with 200 once a connection to it is
    /// made, and relays bytes both ways from then on.
    pub async fn tunnel(
        &self,
        req: &mut Request<CallerBody>,
        authority: Authority,
        open: &Arc<OpenTunnels>,
    ) -> Response<ResponseBody> {
        let Some(caller) = req.extensions_mut().remove::<CallerUpgrade>() else {
            return LocalError::NotProxied
                .response("CONNECT is tunnelled over HTTP/1.1 only; this connection cannot be");
        };
        if authority.port_u16().is_none() {
            return LocalError::BadRequest.response("CONNECT needs host:port");
        }
        if self.is_self(&authority) {
            return LocalError::BadRequest.response(&format!(
                "{authority} is this proxy: a tunnel to it would loop"
            ));
        }
        let Some(place) = self.tunnels.try_reserve() else {
            return LocalError::Overloaded.response(&format!(
                "{MAX_TUNNELS} passthrough tunnels are open, the most there may be"
            ));
        };
        let connect = tokio::net::TcpStream::connect(authority.as_str());
        let upstream = match tokio::time::timeout(CONNECT_TIMEOUT, connect).await {
            Ok(Ok(stream)) => stream,
            Ok(Err(e)) => {
                return LocalError::ConnectFailure
                    .response(&format!("could not connect to {authority} (CONNECT): {e}"))
            }
            Err(_) => {
                return LocalError::ConnectFailure.response(&format!(
                    "could not connect to {authority} (CONNECT) within {CONNECT_TIMEOUT:?}"
                ))
            }
        };
        let _ = upstream.set_nodelay(true);
        tokio::spawn(crate::upstream::tunnel::relay_connect(
            caller,
            upstream,
            place,
            open.track(),
        ));
        let mut resp = Response::new(ResponseBody::local(bytes::Bytes::new()));
        *resp.status_mut() = StatusCode::OK;
        resp
    }
}
