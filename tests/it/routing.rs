//! Route matching through the real proxy: each matcher, and first match wins.

use crate::common;

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

/// Proxy-style requests (`curl -x`, `HTTP_PROXY`): the absolute-form
/// request's host picks the route, `host_rewrite` sets the Host the
/// upstream sees, and an endpoint's base path prefixes every forwarded path.
/// Through the binary.
#[tokio::test]
async fn proxy_style_routing_host_rewrite_and_a_base_path() {
    use common::process::Binary;
    let up = ok_upstream("ok").await;
    let hg = Binary::start(&format!(
        "[upstreams.inventory]\nendpoints = [\"{url}\"]\n\
         [upstreams.api]\nendpoints = [\"{url}/api/v1/\"]\n\
         [[routes]]\nname = \"inventory\"\nupstream = \"inventory\"\n\
         host_rewrite = \"inventory.internal\"\nmatch = {{ host = \"inventory\" }}\n\
         [[routes]]\nname = \"api\"\nupstream = \"api\"\n",
        url = up.url()
    ))
    .await;
    let exchange = |request: &'static str| raw_exchange(hg.listen.clone(), request.as_bytes());
    let out = exchange(
        "GET http://inventory/items?x=1 HTTP/1.1\r\nHost: inventory\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    let seen = up.last();
    assert_eq!(seen.uri, "/items?x=1");
    assert_eq!(seen.headers["host"], "inventory.internal");

    for (request, path) in [
        (
            "GET /items?x=1 HTTP/1.1\r\nHost: shop\r\nConnection: close\r\n\r\n",
            "/api/v1/items?x=1",
        ),
        (
            "GET / HTTP/1.1\r\nHost: shop\r\nConnection: close\r\n\r\n",
            "/api/v1/",
        ),
        (
            "GET http://shop/a/b HTTP/1.1\r\nHost: shop\r\nConnection: close\r\n\r\n",
            "/api/v1/a/b",
        ),
        // Dot segments, plain or encoded, never climb out of the base.
        (
            "GET /a/../../etc HTTP/1.1\r\nHost: shop\r\nConnection: close\r\n\r\n",
            "/api/v1/etc",
        ),
        (
            "GET /a/%2e%2e/%2E%2E/x HTTP/1.1\r\nHost: shop\r\nConnection: close\r\n\r\n",
            "/api/v1/x",
        ),
        // No path, a query: the base's root with the query.
        (
            "GET http://shop?x=1 HTTP/1.1\r\nHost: shop\r\nConnection: close\r\n\r\n",
            "/api/v1/?x=1",
        ),
    ] {
        let out = exchange(request).await;
        assert!(out.starts_with("HTTP/1.1 200"), "{out}");
        let seen = up.last();
        assert_eq!(seen.uri, path, "{request}");
        assert_eq!(
            seen.headers["host"],
            up.addr.to_string(),
            "the endpoint's own"
        );
    }
    // A fully qualified name (trailing dot) is the same host.
    let out = exchange(
        "GET http://inventory./items HTTP/1.1\r\nHost: inventory.\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    assert_eq!(up.last().headers["host"], "inventory.internal");
    let hits = up.hits();
    let out = exchange(
        "GET ftp://inventory/items HTTP/1.1\r\nHost: inventory\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(out.starts_with("HTTP/1.1 400"), "{out}");
    assert_eq!(up.hits(), hits, "another scheme is never forwarded");
    hg.terminate().await;

    // `--upstream` takes a base path too.
    let quick = common::process::quick_mode(&format!("{}/base", up.url()), &[]).await;
    let out = raw_exchange(
        quick.listen.clone(),
        b"GET /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    assert_eq!(up.last().uri, "/base/x");
    quick.terminate().await;
}

/// A host_rewrite that is no host, and an endpoint with a query, are
/// config errors naming key and line.
#[test]
fn a_bad_host_rewrite_or_an_endpoint_query_is_refused() {
    let upstream = "[upstreams.u]\nendpoints = [\"http://127.0.0.1:3000\"]\n";
    for (table, key) in [
        (
            "host_rewrite = \"user@host\"",
            "routes[0].host_rewrite (line 7)",
        ),
        ("host_rewrite = \"\"", "routes[0].host_rewrite (line 7)"),
        ("host_rewrite = \"a/b\"", "routes[0].host_rewrite (line 7)"),
        (
            "host_rewrite = \"a:99999\"",
            "routes[0].host_rewrite (line 7)",
        ),
    ] {
        let src = format!("{upstream}[[routes]]\nname = \"r\"\nupstream = \"u\"\n\n{table}\n");
        let err = herdguard::config::Config::parse(&src)
            .unwrap_err()
            .to_string();
        assert!(err.contains(key), "{table}: {err}");
    }
    let src = "[upstreams.u]\nendpoints = [\"http://127.0.0.1:3000/api/../admin\"]\n[[routes]]\nname = \"r\"\nupstream = \"u\"\n";
    let err = herdguard::config::Config::parse(src)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("upstreams.u.endpoints[0] (line 2)") && err.contains("`..`"),
        "{err}"
    );
    let src = "[upstreams.u]\nendpoints = [\"http://127.0.0.1:3000/a?b=1\"]\n[[routes]]\nname = \"r\"\nupstream = \"u\"\n";
    let err = herdguard::config::Config::parse(src)
        .unwrap_err()
        .to_string();
    assert!(err.contains("upstreams.u.endpoints[0] (line 2)"), "{err}");
    assert!(err.contains("query"), "{err}");
}

/// Routes match the path as the upstream will resolve it: dot segments,
/// plain or encoded, cannot carry a request past a route that would take it.
#[tokio::test]
async fn routes_match_the_path_without_dot_segments() {
    let private = ok_upstream("private").await;
    let public = ok_upstream("public").await;
    let server = proxy(&format!(
        "[upstreams.private]\nendpoints = [\"{}\"]\n[upstreams.public]\nendpoints = [\"{}\"]\n\
         [[routes]]\nname = \"private\"\nupstream = \"private\"\nmatch = {{ path_prefix = \"/private\" }}\n\
         [[routes]]\nname = \"public\"\nupstream = \"public\"\n",
        private.url(),
        public.url()
    ))
    .await;
    for path in [
        "/public/../private/x",
        "/public/%2E%2e/private/x",
        "/./private/x",
    ] {
        let out = raw_exchange(
            server.proxy_addr(),
            format!("GET {path} HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await;
        assert!(out.ends_with("private"), "{path}: {out}");
    }
    assert_eq!(public.hits(), 0);
}
