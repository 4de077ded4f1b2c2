//! The admin listener: /metrics, /healthz, /readyz, /config. Loopback by
//! default; it tells operators and orchestrators what the proxy is doing.

use std::sync::atomic::Ordering;

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::Full;

use crate::app::Shared;

pub fn handle<B>(shared: &Shared, req: &Request<B>) -> Response<Full<Bytes>> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, "use GET\n".into());
    }
    match req.uri().path() {
        "/metrics" => {
            shared.proxy.runtime().refresh_gauges();
            let mut resp = text(StatusCode::OK, shared.proxy.metrics().render());
            resp.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            resp
        }
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
        _ => text(
            StatusCode::NOT_FOUND,
            "not found; try /metrics, /healthz, /readyz or /config\n".into(),
        ),
    }
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
