//! The admin listener: /metrics, /healthz, /readyz, /config. Loopback by
//! default; it tells operators and orchestrators what the proxy is doing.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::Full;
use subtle::ConstantTimeEq;

use super::Shared;
use crate::policy::breaker::State as BreakerState;

/// A rendered `/metrics` page, shared by the scrapes it is sent to.
pub(crate) struct Page(String);

/// A page as one response's body.
struct SharedPage(Arc<Page>);

impl AsRef<[u8]> for SharedPage {
    fn as_ref(&self) -> &[u8] {
        self.0 .0.as_bytes()
    }
}

/// The last page rendered, while some scrape still holds it.
pub(crate) type PageRef = std::sync::Weak<Page>;

/// How long a rendered `/metrics` page may be sent again to other scrapes
/// while one is still reading it.
const REUSE_PAGE: std::time::Duration = std::time::Duration::from_secs(1);

/// Answers one admin request. `/metrics` is rendered on a thread of its own:
/// with thousands of routes it takes a while, and the proxy's workers must
/// not wait on it.
pub async fn serve<B>(
    shared: &Shared,
    peer: SocketAddr,
    req: &Request<B>,
) -> Response<Full<Bytes>> {
    let get = req.method() == Method::GET || req.method() == Method::HEAD;
    let known = known_host(req, &shared.proxy.runtime().config.admin.hosts).is_ok();
    if get && known && req.uri().path() == "/metrics" {
        let proxy = shared.proxy.clone();
        // One render at a time: each has a thread of its own (see
        // `on_own_thread`), and a scrape does not wait on a worker. The
        // turn goes with the thread, so a scrape abandoned mid-render (an
        // HTTP/2 stream reset) does not let the next one start beside it.
        //
        // A page still being sent to another scraper, rendered less than
        // [`REUSE_PAGE`] ago, is sent again, the same bytes: scrapers that
        // read slowly (or many at once) share one page rather than hold one
        // each (with a thousand routes, a page is 6 MB). Once no one holds
        // it, the next scrape renders afresh.
        //
        // And at most two pages are held at once: while the last two are
        // both still being sent, a scrape gets the newer, however old.
        let mut turn = shared.rendering.clone().lock_owned().await;
        let reused = turn.as_ref().and_then(|(at, newest, older)| {
            let young = at.elapsed() < REUSE_PAGE;
            let page = newest.upgrade()?;
            (young || older.strong_count() > 0).then_some(page)
        });
        let rendered = match reused {
            Some(page) => Ok(Bytes::from_owner(SharedPage(page))),
            None => {
                super::on_own_thread("herdguard-metrics", move || {
                    proxy.refresh_gauges();
                    let page = Arc::new(Page(proxy.metrics().render()));
                    let older = turn.take().map(|(_, newest, _)| newest).unwrap_or_default();
                    *turn = Some((std::time::Instant::now(), Arc::downgrade(&page), older));
                    drop(turn);
                    Bytes::from_owner(SharedPage(page))
                })
                .await
            }
        };
        return match rendered {
            Ok(body) => {
                let mut resp = Response::new(Full::new(body));
                resp.headers_mut().insert(
                    CONTENT_TYPE,
                    HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
                );
                resp
            }
            Err(e) => text(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("rendering the metrics failed: {e}\n"),
            ),
        };
    }
    handle(shared, peer, req)
}

fn handle<B>(shared: &Shared, peer: SocketAddr, req: &Request<B>) -> Response<Full<Bytes>> {
    let runtime = shared.proxy.runtime();
    if let Err(host) = known_host(req, &runtime.config.admin.hosts) {
        tracing::warn!(%peer, host, "admin request for a host it does not answer to");
        return text(
            StatusCode::MISDIRECTED_REQUEST,
            format!("the admin listener does not answer to host {host:?}; add it to admin.hosts\n"),
        );
    }
    if let Some(rest) = req.uri().path().strip_prefix("/breakers/") {
        if req.method() != Method::POST {
            return text(
                StatusCode::METHOD_NOT_ALLOWED,
                "use POST /breakers/ROUTE/open|close|reset\n".into(),
            );
        }
        if let Err(why) = may_change(peer, req.headers(), runtime.config.admin.token.as_deref()) {
            tracing::warn!(%peer, path = req.uri().path(), why, "admin change refused");
            return text(StatusCode::FORBIDDEN, format!("{why}\n"));
        }
        return force_breaker(shared, rest);
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, "use GET\n".into());
    }
    match req.uri().path() {
        "/healthz" => text(StatusCode::OK, "ok\n".into()),
        "/readyz" => {
            if shared.draining.load(Ordering::Acquire) {
                text(StatusCode::SERVICE_UNAVAILABLE, "draining\n".into())
            } else {
                text(StatusCode::OK, "ready\n".into())
            }
        }
        "/config" => {
            let mut resp = Response::new(Full::new(shared.proxy.runtime().config_toml()));
            resp.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static("application/toml; charset=utf-8"),
            );
            resp
        }
        "/breakers" => json(StatusCode::OK, &breakers(shared)),
        _ => text(
            StatusCode::NOT_FOUND,
            "not found; try /metrics, /healthz, /readyz, /config or /breakers\n".into(),
        ),
    }
}

/// The request's host (`:authority` or `Host`, without its port), if it is
/// one the admin listener answers to: an IP address, `localhost`, a name
/// in the cluster (`*.svc`, `*.svc.cluster.local`, `*.cluster.local`,
/// `*.localhost`), one of `admin.hosts`, or none at all (HTTP/1.0). A web
/// page whose name an attacker rebinds to 127.0.0.1 sends its own name, and
/// is refused: DNS rebinding cannot read `/config` or `/metrics`.
fn known_host<'a, B>(req: &'a Request<B>, hosts: &[String]) -> Result<(), &'a str> {
    // The URI's authority (absolute form, HTTP/2) and every Host field must
    // each be known: the proxy listener refuses two Host fields outright.
    if let Some(authority) = req.uri().authority() {
        check_host(authority.host(), hosts).map_err(|()| authority.as_str())?;
    }
    let mut fields = req.headers().get_all(http::header::HOST).iter();
    if let (Some(_), Some(second)) = (fields.next(), fields.next()) {
        return Err(second.to_str().unwrap_or("(not text)"));
    }
    let Some(value) = req.headers().get(http::header::HOST) else {
        return Ok(());
    };
    let value = value.to_str().map_err(|_| "(not text)")?;
    match value.parse::<http::uri::Authority>() {
        Ok(authority) if !authority.as_str().contains('@') => {
            check_host(authority.host(), hosts).map_err(|()| value)
        }
        _ => Err(value),
    }
}

fn check_host(host: &str, hosts: &[String]) -> Result<(), ()> {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let name = host.trim_end_matches('.').to_ascii_lowercase();
    let known = bare.parse::<std::net::IpAddr>().is_ok()
        || name == "localhost"
        || [".localhost", ".svc", ".svc.cluster.local", ".cluster.local"]
            .iter()
            .any(|suffix| name.ends_with(suffix))
        || hosts.iter().any(|h| h.eq_ignore_ascii_case(&name));
    if known {
        Ok(())
    } else {
        Err(())
    }
}

/// Whether a caller may change state (force a breaker): one on loopback
/// (the pod's own containers) may; one elsewhere only with the configured
/// token, compared in constant time.
fn may_change(
    peer: SocketAddr,
    headers: &http::HeaderMap,
    token: Option<&str>,
) -> Result<(), &'static str> {
    // A browser sends Origin (or Sec-Fetch-Site) with a cross-site POST:
    // any web page a developer opens could otherwise force the breakers of
    // a proxy on their machine's loopback. Operators' tools send neither.
    if headers.contains_key(http::header::ORIGIN)
        || headers
            .get_all("sec-fetch-site")
            .iter()
            .any(|v| v != "same-origin" && v != "none")
    {
        return Err("changes are not taken from web pages (the request carries Origin)");
    }
    if peer.ip().to_canonical().is_loopback() {
        return Ok(());
    }
    let Some(token) = token else {
        return Err("changes are taken from loopback only (set admin.token to allow others)");
    };
    // `Bearer TOKEN`: the scheme is case-insensitive (RFC 9110 §11.1).
    let given = headers
        .get(http::header::AUTHORIZATION)
        .map(|v| v.as_bytes())
        .and_then(|v| {
            let (scheme, rest) = v.split_at(v.iter().position(|&b| b == b' ')?);
            scheme
                .eq_ignore_ascii_case(b"bearer")
                .then(|| rest.trim_ascii_start())
        });
    match given {
        Some(given) if bool::from(given.ct_eq(token.as_bytes())) => Ok(()),
        Some(_) => Err("wrong admin token"),
        None => Err("changes from off loopback need Authorization: Bearer <admin.token>"),
    }
}

/// Every route's breaker and every upstream's limits.
fn breakers(shared: &Shared) -> serde_json::Value {
    let runtime = shared.proxy.runtime();
    let mut routes = serde_json::Map::new();
    let mut upstreams = serde_json::Map::new();
    for route in &runtime.routes {
        let mut entry = serde_json::to_value(route.guards.breaker_snapshot()).unwrap_or_default();
        entry["upstream"] = route.upstream.name.as_ref().into();
        // Paths whose own breaker is not closed: refused alone.
        let paths: serde_json::Map<_, _> = route
            .guards
            .paths
            .snapshot(tokio::time::Instant::now())
            .into_iter()
            .map(|(path, snapshot)| (path, serde_json::to_value(snapshot).unwrap_or_default()))
            .collect();
        entry["paths"] = paths.into();
        routes.insert(route.name.to_string(), entry);
        let u = &route.upstream;
        upstreams.insert(
            u.name.to_string(),
            serde_json::json!({
                "in_flight": u.in_flight(),
                "limit": u.limit(),
                "max_in_flight": u.max_in_flight(),
                "tunnels": u.tunnels.open(),
                "max_tunnels": u.tunnels.max(),
                "endpoints": u.endpoints_snapshot(),
            }),
        );
    }
    serde_json::json!({ "routes": routes, "upstreams": upstreams })
}

/// `POST /breakers/ROUTE/open|close|reset`: open or close a breaker and hold
/// it there, or hand it back to its automatic rules.
fn force_breaker(shared: &Shared, rest: &str) -> Response<Full<Bytes>> {
    let Some((name, action)) = rest.rsplit_once('/') else {
        return text(
            StatusCode::NOT_FOUND,
            "use /breakers/ROUTE/open|close|reset\n".into(),
        );
    };
    let state = match action {
        "open" => Some(BreakerState::Open),
        "close" => Some(BreakerState::Closed),
        "reset" => None,
        other => {
            return text(
                StatusCode::NOT_FOUND,
                format!("unknown action {other:?}; use open, close or reset\n"),
            );
        }
    };
    let runtime = shared.proxy.runtime();
    let Some(route) = runtime.routes.iter().find(|r| &*r.name == name) else {
        return text(StatusCode::NOT_FOUND, format!("no route named {name:?}\n"));
    };
    tracing::warn!(route = %route.name, action, "breaker forced by an operator");
    json(
        StatusCode::OK,
        &serde_json::to_value(route.guards.force_breaker(state)).unwrap_or_default(),
    )
}

fn json(status: StatusCode, value: &serde_json::Value) -> Response<Full<Bytes>> {
    let mut resp = text(status, format!("{value:#}\n"));
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(ip: &str) -> SocketAddr {
        SocketAddr::new(ip.parse().unwrap(), 40000)
    }

    fn bearer(token: &str) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        h.insert(
            http::header::AUTHORIZATION,
            HeaderValue::from_str(&format!("Bearer {token}")).unwrap(),
        );
        h
    }

    const TOKEN: &str = "0123456789abcdef0123";

    #[test]
    fn a_web_page_may_not_change_anything_even_from_loopback() {
        for (name, value) in [
            ("origin", "https://evil.example"),
            ("origin", "null"),
            ("sec-fetch-site", "cross-site"),
        ] {
            let mut h = bearer(TOKEN);
            h.insert(name, HeaderValue::from_static(value));
            assert!(
                may_change(peer("127.0.0.1"), &h, Some(TOKEN)).is_err(),
                "{name}: {value}"
            );
        }
    }

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        for form in ["bearer", "BEARER", "Bearer  "] {
            let mut h = http::HeaderMap::new();
            h.insert(
                http::header::AUTHORIZATION,
                HeaderValue::from_str(&format!("{form} {TOKEN}")).unwrap(),
            );
            assert_eq!(
                may_change(peer("10.0.0.1"), &h, Some(TOKEN)),
                Ok(()),
                "{form}"
            );
        }
    }

    #[test]
    fn loopback_may_change_without_a_token() {
        let none = http::HeaderMap::new();
        for ip in ["127.0.0.1", "::1", "::ffff:127.0.0.1"] {
            assert_eq!(may_change(peer(ip), &none, None), Ok(()), "{ip}");
            assert_eq!(may_change(peer(ip), &none, Some(TOKEN)), Ok(()), "{ip}");
        }
    }

    #[test]
    fn others_need_the_exact_token() {
        let none = http::HeaderMap::new();
        for ip in ["10.1.2.3", "::ffff:10.1.2.3", "fd00::1", "0.0.0.0"] {
            let p = peer(ip);
            assert!(may_change(p, &none, None).is_err(), "{ip}: no token set");
            assert!(may_change(p, &bearer(TOKEN), None).is_err(), "{ip}");
            assert!(
                may_change(p, &none, Some(TOKEN)).is_err(),
                "{ip}: none sent"
            );
            assert_eq!(may_change(p, &bearer(TOKEN), Some(TOKEN)), Ok(()), "{ip}");
            for wrong in ["", "0123456789abcdef012", "0123456789abcdef01234", "x"] {
                assert!(
                    may_change(p, &bearer(wrong), Some(TOKEN)).is_err(),
                    "{wrong:?}"
                );
            }
            let mut basic = http::HeaderMap::new();
            basic.insert(
                http::header::AUTHORIZATION,
                HeaderValue::from_str(&format!("Basic {TOKEN}")).unwrap(),
            );
            assert!(
                may_change(p, &basic, Some(TOKEN)).is_err(),
                "{ip}: not a bearer"
            );
        }
    }
}
