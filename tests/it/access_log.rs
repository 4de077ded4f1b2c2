//! The access log, through the binary: one line per request on stdout once
//! it has ended, in JSON or text, with attempts, the last endpoint, the
//! proxy's error and the skip reason; unrouted and malformed requests get a
//! line too; many callers at once lose no line; off, nothing is written.

use crate::common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc::Receiver;
use std::time::Duration;

use common::process::{line_with, BIN};
use common::*;
use http::{Request, Response, StatusCode};

/// The binary on `toml` (after `[listen]`/`[admin]` on ephemeral ports),
/// its stdout read line by line.
struct Logged {
    child: std::process::Child,
    listen: String,
    stdout: Receiver<String>,
    _config: tempfile::NamedTempFile,
}

impl Logged {
    async fn start(toml: &str) -> Logged {
        Self::start_with("", toml).await
    }

    /// [`Logged::start`], with `listen` added to `[listen]`.
    async fn start_with(listen: &str, toml: &str) -> Logged {
        use std::io::Write as _;
        let mut config = tempfile::NamedTempFile::new().unwrap();
        write!(
            config,
            "[listen]\naddress = \"127.0.0.1:0\"\n{listen}\n[admin]\naddress = \"127.0.0.1:0\"\n{toml}"
        )
        .unwrap();
        let mut cmd = Command::new(BIN);
        cmd.arg("--config")
            .arg(config.path())
            .args(["--log-format", "json"])
            .stdout(Stdio::piped());
        let (mut child, stderr) = common::process::spawn_reading_stderr(cmd);
        let out = child.stdout.take().unwrap();
        let (tx, stdout) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let (line, _) = line_with(stderr, "herdguard serving").await;
        let serving: serde_json::Value = serde_json::from_str(&line).unwrap();
        Logged {
            child,
            listen: serving["listen"].as_str().unwrap().to_owned(),
            stdout,
            _config: config,
        }
    }

    /// The next access log line, waiting up to 5 s.
    fn next(&self) -> String {
        self.stdout
            .recv_timeout(Duration::from_secs(5))
            .expect("an access log line")
    }

    fn next_json(&self) -> serde_json::Value {
        let line = self.next();
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"))
    }

    async fn send(&self, req: Request<Body>) -> StatusCode {
        send(&client(), req).await.0
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.listen)
    }
}

impl Drop for Logged {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn flaky_upstream() -> Upstream {
    upstream(|req| async move {
        match req.uri().path() {
            "/ok" => Response::new(full("fine")),
            "/hang" => {
                tokio::time::sleep(Duration::from_secs(30)).await;
                Response::new(full("late"))
            }
            _ => Response::builder().status(503).body(full("down")).unwrap(),
        }
    })
    .await
}

fn routes(url: &str) -> String {
    format!(
        "[upstreams.u]\nendpoints = [\"{url}\"]\n\
         [[routes]]\nname = \"r\"\nupstream = \"u\"\nmatch = {{ host = \"app\" }}\n\
         retry = {{ attempts = 2, retry_on = [\"503\"], backoff = {{ base = \"1ms\", cap = \"2ms\" }} }}\n"
    )
}

fn get(log: &Logged, path: &str) -> Request<Body> {
    Request::get(log.url(path))
        .header("host", "app")
        .body(empty())
        .unwrap()
}

#[tokio::test]
async fn json_lines_say_attempts_endpoint_error_and_skip() {
    let up = flaky_upstream().await;
    let log = Logged::start(&format!(
        "[access_log]\nenabled = true\nformat = \"json\"\n{}",
        routes(&up.url())
    ))
    .await;

    assert_eq!(log.send(get(&log, "/ok?q=1")).await, StatusCode::OK);
    let line = log.next_json();
    assert_eq!(line["route"], "r");
    assert_eq!(line["method"], "GET");
    assert_eq!(line["path"], "/ok", "the path, not the query");
    assert_eq!(line["status"], 200);
    assert_eq!(line["attempts"], 1);
    assert_eq!(line["bytes"], 4);
    assert_eq!(line["endpoint"], up.url());
    assert!(line["error"].is_null() && line["skip"].is_null(), "{line}");
    assert!(line["duration_ms"].as_f64().unwrap() >= 0.0);
    assert!(line["time"].as_str().unwrap().ends_with('Z'), "{line}");

    // Retried once, then out of attempts: the upstream's own 503.
    assert_eq!(
        log.send(get(&log, "/down")).await,
        StatusCode::SERVICE_UNAVAILABLE
    );
    let line = log.next_json();
    assert_eq!(
        (&line["status"], &line["attempts"], &line["skip"]),
        (&503.into(), &2.into(), &"attempts_exhausted".into()),
        "{line}"
    );
    assert!(line["error"].is_null(), "the upstream's answer: {line}");

    // A POST without a key is not repeated.
    let post = Request::post(log.url("/down"))
        .header("host", "app")
        .body(full("x"))
        .unwrap();
    assert_eq!(log.send(post).await, StatusCode::SERVICE_UNAVAILABLE);
    let line = log.next_json();
    assert_eq!(
        (&line["method"], &line["attempts"], &line["skip"]),
        (&"POST".into(), &1.into(), &"non_idempotent".into()),
        "{line}"
    );

    // A caller's own method of 8 KB: the line keeps its first 32 bytes.
    let method = "X".repeat(8 * 1024);
    let long = Request::builder()
        .method(method.as_str())
        .uri(log.url("/ok"))
        .header("host", "app")
        .body(empty())
        .unwrap();
    log.send(long).await;
    let line = log.next_json();
    assert_eq!(line["method"], format!("{}...", &method[..32]), "{line}");

    // No route: the proxy's 404, no route, no endpoint.
    let other = Request::get(log.url("/x"))
        .header("host", "elsewhere")
        .body(empty())
        .unwrap();
    assert_eq!(log.send(other).await, StatusCode::NOT_FOUND);
    let line = log.next_json();
    assert_eq!(line["error"], "no-route", "{line}");
    assert!(line["route"].is_null() && line["endpoint"].is_null());
    assert_eq!(line["attempts"], 0);

    // The caller leaves while the upstream is still at it: how far the
    // request got (its route, attempt, endpoint), status 499.
    let hits = up.hits();
    let mut stream = tokio::net::TcpStream::connect(&log.listen).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut stream, b"GET /hang HTTP/1.1\r\nHost: app\r\n\r\n")
        .await
        .unwrap();
    eventually(Duration::from_secs(5), "the upstream has it", || async {
        up.hits() > hits
    })
    .await;
    drop(stream);
    let line = log.next_json();
    assert_eq!(
        (
            &line["status"],
            &line["route"],
            &line["attempts"],
            &line["endpoint"]
        ),
        (&499.into(), &"r".into(), &1.into(), &up.url().into()),
        "{line}"
    );

    // Malformed: two Host headers, answered 400 by the proxy, logged too.
    let out = raw_exchange(
        log.listen.clone(),
        b"GET /ok HTTP/1.1\r\nHost: app\r\nHost: app2\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(out.starts_with("HTTP/1.1 400"), "{out}");
    let line = log.next_json();
    assert_eq!(
        (&line["status"], &line["error"]),
        (&400.into(), &"bad-request".into())
    );
}

/// Text lines are logfmt, one per request whatever the path holds; 200
/// callers at once get 200 lines, answered or shed; a caller that leaves mid-response still
/// gets its line.
#[tokio::test]
async fn text_lines_stay_whole_under_concurrency_and_abandonment() {
    let up = upstream(|req| async move {
        if req.uri().path() == "/slow" {
            // Headers at once, then a body that never ends.
            let never =
                futures_util::stream::pending::<Result<http_body::Frame<bytes::Bytes>, BoxError>>();
            return Response::new(http_body_util::BodyExt::boxed(
                http_body_util::StreamBody::new(never),
            ));
        }
        Response::new(full("fine"))
    })
    .await;
    let log = Logged::start(&format!(
        "[access_log]\nenabled = true\n{}",
        routes(&up.url())
    ))
    .await;

    // A path with a quote and an encoded space.
    let out = raw_exchange(
        log.listen.clone(),
        b"GET /a%20b\"c HTTP/1.1\r\nHost: app\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    let line = log.next();
    assert!(line.starts_with("time="), "{line}");
    assert!(line.contains(r#" path="/a%20b\"c" "#), "{line}");
    assert!(
        line.contains(" route=r ") && line.contains(" status=200 "),
        "{line}"
    );
    assert!(line.contains(" error=- skip=-"), "{line}");

    let calls = (0..200).map(|i| {
        let req = get(&log, &format!("/n{i}"));
        async move { send(&client(), req).await.0 }
    });
    // Answered or shed by the adaptive limit (503 overloaded): logged either way.
    let statuses = futures_util::future::join_all(calls).await;
    assert!(
        statuses
            .iter()
            .all(|s| *s == StatusCode::OK || *s == StatusCode::SERVICE_UNAVAILABLE),
        "{statuses:?}"
    );
    let mut paths: Vec<String> = (0..200)
        .map(|_| {
            let line = log.next();
            assert_eq!(
                line.matches("time=").count(),
                1,
                "one request a line: {line}"
            );
            line.split(" path=")
                .nth(1)
                .unwrap()
                .split(' ')
                .next()
                .unwrap()
                .to_owned()
        })
        .collect();
    paths.sort();
    paths.dedup();
    assert_eq!(paths.len(), 200, "every request, once");

    // The caller reads the head, then goes away: the line comes then.
    let mut stream = tokio::net::TcpStream::connect(&log.listen).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut stream, b"GET /slow HTTP/1.1\r\nHost: app\r\n\r\n")
        .await
        .unwrap();
    assert!(read_head(&mut stream).await);
    drop(stream);
    let line = log.next();
    assert!(
        line.contains(" path=/slow ") && line.contains(" status=200 "),
        "{line}"
    );
}

/// Off (the default), nothing reaches stdout; on, the last request's line
/// is written before the process exits.
#[tokio::test]
async fn off_by_default_it_writes_nothing_and_on_it_flushes_at_exit() {
    let up = flaky_upstream().await;
    for (enabled, lines) in [("", 0), ("[access_log]\nenabled = true\n", 3)] {
        let mut log = Logged::start(&format!("{enabled}{}", routes(&up.url()))).await;
        for _ in 0..3 {
            assert_eq!(log.send(get(&log, "/ok")).await, StatusCode::OK);
        }
        let sent = Command::new("kill")
            .args(["-TERM", &log.child.id().to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
        assert!(log.child.wait().unwrap().success());
        // The reader ends at the end of stdout: every line is in.
        let written: Vec<String> = log.stdout.iter().collect();
        assert_eq!(written.len(), lines, "{enabled:?}: {written:#?}");
    }
}

/// After a hedge race, the line names the endpoint whose answer the caller
/// got, not the last one an attempt went to.
#[tokio::test]
async fn a_hedged_requests_line_names_the_endpoint_that_answered() {
    // The first endpoint answers after 200 ms; the second never in time.
    let first = upstream(|_req| async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        Response::new(full("first"))
    })
    .await;
    let second = upstream(|_req| async {
        tokio::time::sleep(Duration::from_secs(5)).await;
        Response::new(full("second"))
    })
    .await;
    let log = Logged::start(&format!(
        "[access_log]\nenabled = true\nformat = \"json\"\n\
         [upstreams.u]\nendpoints = [\"{}\", \"{}\"]\n\
         [[routes]]\nname = \"r\"\nupstream = \"u\"\nretry = {{ hedge_after = \"50ms\" }}\n",
        first.url(),
        second.url()
    ))
    .await;
    // Endpoints are taken in turn: the first request starts on the first.
    let req = Request::get(log.url("/")).body(empty()).unwrap();
    assert_eq!(log.send(req).await, StatusCode::OK);
    let line = log.next_json();
    assert_eq!(line["attempts"], 2, "{line}");
    assert_eq!(line["endpoint"], first.url(), "{line}");
    assert_eq!(second.hits(), 1, "the hedge went to the second");
}

/// An upstream that answers 503 to everything, and the heads of the
/// requests it was sent.
async fn busy_upstream() -> (
    Upstream,
    std::sync::Arc<std::sync::Mutex<Vec<http::HeaderMap>>>,
) {
    let heads = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = heads.clone();
    let up = upstream(move |req: Request<hyper::body::Incoming>| {
        seen.lock().unwrap().push(req.headers().clone());
        async { Response::builder().status(503).body(full("down")).unwrap() }
    })
    .await;
    (up, heads)
}

/// Every request carries an id: the caller's `x-request-id`, or one made
/// here. It goes upstream on every attempt, the same each time, and is
/// written in the access log line (with the trace of a `traceparent`) and
/// the explain header. `[request_id] header` names another field;
/// `enabled = false` leaves requests as they came.
#[tokio::test]
async fn the_request_id_is_kept_or_made_and_sent_on_every_attempt() {
    let (up, heads) = busy_upstream().await;
    // The ids of each attempt's request: `x-request-id`, `x-correlation-id`.
    let seen = || {
        let mut heads = heads.lock().unwrap();
        let ids = |h: &http::HeaderMap| {
            (
                h.get("x-request-id").cloned(),
                h.get("x-correlation-id").cloned(),
            )
        };
        heads.drain(..).map(|h| ids(&h)).collect::<Vec<_>>()
    };
    let log = Logged::start_with(
        "explain = true",
        &format!(
            "[access_log]\nenabled = true\nformat = \"json\"\n{}",
            routes(&up.url())
        ),
    )
    .await;
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let req = Request::get(log.url("/x"))
        .header("host", "app")
        .header("x-request-id", "caller-7")
        .header("x-herdguard-explain", "1")
        .header("traceparent", format!("00-{trace}-00f067aa0ba902b7-01"))
        .body(empty())
        .unwrap();
    let (status, headers, _) = send(&client(), req).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let explain = headers["x-herdguard-explain"].to_str().unwrap();
    assert!(explain.ends_with(";request_id=caller-7"), "{explain}");
    let line = log.next_json();
    assert_eq!(line["request_id"], "caller-7");
    assert_eq!(line["trace_id"], trace);
    let ids: Vec<_> = seen().into_iter().map(|(id, _)| id).collect();
    assert_eq!(ids.len(), 2, "retried once");
    assert!(ids.iter().all(|id| id.as_ref().unwrap() == "caller-7"));

    // No id sent: one is made, the same on both attempts, and logged.
    assert_eq!(
        log.send(get(&log, "/y")).await,
        StatusCode::SERVICE_UNAVAILABLE
    );
    let line = log.next_json();
    assert!(line["trace_id"].is_null(), "no traceparent: {line}");
    let made = line["request_id"].as_str().unwrap().to_owned();
    assert_eq!(made.len(), 36, "{made}");
    let ids: Vec<_> = seen().into_iter().map(|(id, _)| id).collect();
    assert_eq!(ids.len(), 2);
    assert!(ids.iter().all(|id| id.as_ref().unwrap() == made.as_str()));
    drop(log);

    // Another header, or none at all.
    for (section, corr, plain) in [
        ("[request_id]\nheader = \"x-correlation-id\"", true, false),
        ("[request_id]\nenabled = false", false, false),
    ] {
        let log = Logged::start(&format!(
            "[access_log]\nenabled = true\nformat = \"json\"\n{section}\n{}",
            routes(&up.url())
        ))
        .await;
        log.send(get(&log, "/z")).await;
        let line = log.next_json();
        let seen = seen();
        assert_eq!(seen.len(), 2);
        for (id, correlation) in &seen {
            assert!(id.is_none() || plain, "{section}: no x-request-id is made");
            assert_eq!(correlation.is_some(), corr, "{section}");
        }
        assert_eq!(line["request_id"].is_string(), corr, "{section}: {line}");
    }
}

/// With nothing here writing the id down (no access log, no explain), an id
/// made for a caller that sent none goes upstream with this hop's own
/// fields rather than in the caller's map: still one field, the same on
/// every attempt, on herdguard's own exchange (a GET) and hyper's (a POST,
/// the fields merged into one map), and a new one per request.
#[tokio::test]
async fn a_request_id_made_for_the_upstream_alone_is_sent_once_on_every_attempt() {
    let (up, heads) = busy_upstream().await;
    // The `x-request-id` fields of each attempt's request.
    let seen = || {
        let mut heads = heads.lock().unwrap();
        let ids = |h: &http::HeaderMap| h.get_all("x-request-id").iter().cloned().collect();
        heads.drain(..).map(|h| ids(&h)).collect::<Vec<Vec<_>>>()
    };
    let server = proxy(&routes(&up.url())).await;
    let mut made = Vec::new();
    for post in [false, true, false] {
        let req = Request::builder()
            .method(if post { "POST" } else { "GET" })
            .uri(format!("http://{}/x", server.proxy_addr()))
            .header("host", "app")
            .header("idempotency-key", "k-1")
            .body(if post { full("body") } else { empty() })
            .unwrap();
        let (status, _, _) = send(&client(), req).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        let attempts = seen();
        assert_eq!(attempts.len(), 2, "post {post}: retried once: {attempts:?}");
        for ids in &attempts {
            assert_eq!(ids.len(), 1, "post {post}: one id field: {ids:?}");
            assert_eq!(
                ids[0], attempts[0][0],
                "post {post}: the same on each attempt"
            );
            assert_eq!(ids[0].len(), 36, "{:?}", ids[0]);
        }
        made.push(attempts[0][0].clone());
    }
    assert!(made[0] != made[1] && made[1] != made[2], "{made:?}");

    // The caller's own id goes on as it came.
    let req = Request::get(format!("http://{}/x", server.proxy_addr()))
        .header("host", "app")
        .header("x-request-id", "caller-8")
        .body(empty())
        .unwrap();
    send(&client(), req).await;
    let attempts = seen();
    assert!(
        attempts
            .iter()
            .all(|ids| ids.len() == 1 && ids[0] == "caller-8"),
        "{attempts:?}"
    );
}
