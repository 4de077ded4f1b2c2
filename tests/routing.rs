//! Route matching through the real proxy: each matcher, and first match wins.

mod common;

use common::*;
use http::{Request, StatusCode};

async fn routed(req: Request<Body>) -> String {
    let (status, _, body) = send(&client(), req).await;
    if status == StatusCode::NOT_FOUND {
        return "404".into();
    }
    String::from_utf8(body.to_vec()).unwrap()
}

#[tokio::test]
async fn each_matcher_and_file_order() {
    let names = ["exact", "host", "method", "header", "prefix", "fallback"];
    let mut ups = Vec::new();
    for name in names {
        ups.push(ok_upstream(name).await);
    }
    let mut toml = String::new();
    for (name, up) in names.iter().zip(&ups) {
        toml.push_str(&format!(
            "[upstreams.{name}]\nendpoints = [\"{}\"]\n",
            up.url()
        ));
    }
    toml.push_str(
        r#"
[[routes]]
name = "exact"
upstream = "exact"
match = { path = "/v1/status" }

[[routes]]
name = "host"
upstream = "host"
match = { host = "*.internal.test", path_prefix = "/v1" }

[[routes]]
name = "method"
upstream = "method"
match = { methods = ["POST", "PUT"], path_prefix = "/v1" }

[[routes]]
name = "header"
upstream = "header"
match = { headers = { x-canary = "1" }, path_prefix = "/v1" }

[[routes]]
name = "prefix"
upstream = "prefix"
match = { path_prefix = "/v1" }

[[routes]]
name = "fallback"
upstream = "fallback"
match = { path_prefix = "/static", host = "cdn.test" }
"#,
    );
    let server = proxy(&toml).await;
    let url = |path: &str| format!("http://{}{path}", server.proxy_addr());
    let get = |path: &str| Request::get(url(path)).body(empty()).unwrap();

    assert_eq!(routed(get("/v1/status")).await, "exact");
    assert_eq!(
        routed(get("/v1/status/x")).await,
        "prefix",
        "path is exact, not a prefix"
    );
    let req = Request::get(url("/v1/status"))
        .header("host", "a.internal.test")
        .body(empty())
        .unwrap();
    assert_eq!(routed(req).await, "exact", "earlier route wins");
    let req = Request::get(url("/v1/x"))
        .header("host", "a.internal.test:8080")
        .body(empty())
        .unwrap();
    assert_eq!(routed(req).await, "host");
    let req = Request::post(url("/v1/x")).body(empty()).unwrap();
    assert_eq!(routed(req).await, "method");
    let req = Request::get(url("/v1/x"))
        .header("x-canary", "1")
        .body(empty())
        .unwrap();
    assert_eq!(routed(req).await, "header");
    let req = Request::get(url("/v1/x"))
        .header("x-canary", "2")
        .body(empty())
        .unwrap();
    assert_eq!(routed(req).await, "prefix", "header value must be equal");
    let req = Request::get(url("/static/a.css"))
        .header("host", "CDN.test")
        .body(empty())
        .unwrap();
    assert_eq!(routed(req).await, "fallback");
    let req = Request::get(url("/static/a.css"))
        .header("host", "other.test")
        .body(empty())
        .unwrap();
    assert_eq!(routed(req).await, "404", "every condition must hold");

    let hits: Vec<usize> = ups.iter().map(|u| u.hits()).collect();
    assert_eq!(hits, [2, 1, 1, 1, 2, 1]);
}
