//! The admin listener: /metrics, /healthz, /readyz, /config. Loopback by
//! default; it tells operators and orchestrators what the proxy is doing.

use std::sync::atomic::Ordering;

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::Full;

use crate::app::Shared;
use crate::policy::breaker::State as BreakerState;

/// Answers one admin request. `/metrics` is rendered on a blocking thread:
/// with thousands of routes it takes a while, and the proxy's workers must
/// not wait on it.
pub async fn serve<B>(shared: &Shared, req: &Request<B>) -> Response<Full<Bytes>> {
    let get = req.method() == Method::GET || req.method() == Method::HEAD;
    if get && req.uri().path() == "/metrics" {
        let proxy = shared.proxy.clone();
        let rendered = tokio::task::spawn_blocking(move || {
            proxy.runtime().refresh_gauges();
            proxy.metrics().render()
        })
        .await;
        return match rendered {
            Ok(body) => {
                let mut resp = text(StatusCode::OK, body);
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
    handle(shared, req)
}

fn handle<B>(shared: &Shared, req: &Request<B>) -> Response<Full<Bytes>> {
    if let Some(rest) = req.uri().path().strip_prefix("/breakers/") {
        if req.method() != Method::POST {
            return text(
                StatusCode::METHOD_NOT_ALLOWED,
                "use POST /breakers/ROUTE/open|close|reset\n".into(),
            );
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
            let mut resp = text(StatusCode::OK, shared.proxy.runtime().config.to_toml());
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

/// Every route's breaker and every upstream's limits.
fn breakers(shared: &Shared) -> serde_json::Value {
    let runtime = shared.proxy.runtime();
    let mut routes = serde_json::Map::new();
    let mut upstreams = serde_json::Map::new();
    for route in &runtime.routes {
        let mut entry = serde_json::to_value(route.guards.breaker_snapshot()).unwrap_or_default();
        entry["upstream"] = route.upstream.name.as_ref().into();
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
