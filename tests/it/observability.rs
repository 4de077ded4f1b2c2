//! What operators read in Prometheus: a live exposition that
//! `promtool check metrics` accepts, requests whose caller hung up counted
//! as 499, and the series a dashboard needs (process, connections, bytes,
//! retries that succeeded, the budget's capacity, attempts by outcome).

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::process::Binary;
use common::*;
use http::{Request, Response, StatusCode};

/// `/flaky` fails its first request with 503 and answers the rest; `/slow`
/// answers after 3 s; anything else at once.
async fn flaky_upstream() -> Upstream {
    let flaky = Arc::new(AtomicUsize::new(0));
    upstream(move |req: Request<hyper::body::Incoming>| {
        let flaky = flaky.clone();
        async move {
            match req.uri().path() {
                "/flaky" if flaky.fetch_add(1, Ordering::SeqCst) == 0 => {
                    Response::builder().status(503).body(full("busy")).unwrap()
                }
                "/slow" => {
                    tokio::time::sleep(Duration::from_secs(3)).await;
                    Response::new(full("late"))
                }
                _ => Response::new(full("ok")),
            }
        }
    })
    .await
}

async fn call(hg: &Binary, path: &str) -> StatusCode {
    let req = Request::get(format!("http://{}{path}", hg.listen))
        .body(empty())
        .unwrap();
    send(&client(), req).await.0
}

fn config(up: &Upstream, extra: &str) -> String {
    format!(
        "{extra}\n[upstreams.api]\nendpoints = [\"{}\"]\n\
         [[routes]]\nname = \"api\"\nupstream = \"api\"\n\
         retry = {{ attempts = 3, backoff = {{ base = \"5ms\", cap = \"10ms\" }} }}\n",
        up.url()
    )
}

/// Runs `promtool check metrics` on `text`: its verdict and what it said.
fn promtool_check(text: &str) -> (bool, String) {
    use std::io::Write as _;
    test_tools();
    let mut child = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool runs (.ci/test-tools installs it: bash .ci/test-tools)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), said)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_exposition_is_lint_clean_and_counts_what_dashboards_need() {
    let up = flaky_upstream().await;
    let hg = Binary::start_with("", &config(&up, "")).await;
    for path in ["/a", "/b", "/flaky"] {
        assert_eq!(call(&hg, path).await, StatusCode::OK, "{path}");
    }
    // A caller that hangs up before the slow answer: 499, as the access log has it.
    let gone = tokio::time::timeout(Duration::from_millis(300), call(&hg, "/slow")).await;
    assert!(gone.is_err(), "the slow answer took 3 s");
    let series = r#"herdguard_requests_total{route="api",code="499",source="proxy"}"#;
    let mut text = String::new();
    for _ in 0..100 {
        text = hg.metrics().await;
        if metric(&text, series) == Some(1.0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(metric(&text, series), Some(1.0), "{text}");
    assert_eq!(
        metric(
            &text,
            r#"herdguard_request_duration_seconds_count{route="api"}"#
        ),
        Some(4.0),
        "the hung-up request is in the histogram too"
    );
    assert_eq!(
        metric(
            &text,
            r#"herdguard_retried_requests_total{route="api",result="succeeded"}"#
        ),
        Some(1.0)
    );
    assert_eq!(
        metric(
            &text,
            r#"herdguard_retried_requests_total{route="api",result="failed"}"#
        ),
        Some(0.0)
    );
    let attempts_ok = metric(
        &text,
        r#"herdguard_upstream_attempt_duration_seconds_count{route="api",upstream="api",outcome="ok"}"#,
    );
    assert_eq!(attempts_ok, Some(3.0), "{text}");
    let attempts_5xx = metric(
        &text,
        r#"herdguard_upstream_attempt_duration_seconds_count{route="api",upstream="api",outcome="5xx"}"#,
    );
    assert_eq!(attempts_5xx, Some(1.0));
    let capacity = metric(&text, r#"herdguard_retry_budget_capacity{route="api"}"#);
    let available = metric(&text, r#"herdguard_retry_budget_available{route="api"}"#);
    assert!(
        capacity.unwrap() >= available.unwrap() + 1.0,
        "one retry spent: capacity {capacity:?}, available {available:?}"
    );
    let positive = |series: &str| {
        let v = metric(&text, series);
        assert!(v.is_some_and(|v| v > 0.0), "{series} = {v:?}");
        v.unwrap()
    };
    positive("process_resident_memory_bytes");
    positive("process_open_fds");
    positive("process_max_fds");
    positive("process_threads");
    positive("process_start_time_seconds");
    assert!(positive(r#"herdguard_connections_accepted_total{listener="listen"}"#) >= 4.0);
    // The scrape's own connection is open.
    positive(r#"herdguard_connections_open{listener="admin"}"#);
    positive(r#"herdguard_received_bytes_total{listener="listen"}"#);
    positive(r#"herdguard_sent_bytes_total{listener="listen"}"#);
    // The default bounds tell a 3 s request from a 5 s one.
    for le in ["1", "2", "3", "4", "5"] {
        let bucket =
            format!(r#"herdguard_request_duration_seconds_bucket{{route="api",le="{le}"}}"#);
        assert!(metric(&text, &bucket).is_some(), "{bucket}");
    }
    let (ok, said) = promtool_check(&text);
    assert!(ok, "promtool check metrics: {said}");
    hg.terminate().await;
}

/// `[metrics] latency_buckets` sets the histograms' bounds.
#[tokio::test]
async fn latency_buckets_are_configurable_and_are_kept() {
    let up = flaky_upstream().await;
    let hg = Binary::start_with(
        "",
        &config(&up, "[metrics]\nlatency_buckets = [0.05, 0.2, 1.5]"),
    )
    .await;
    assert_eq!(call(&hg, "/a").await, StatusCode::OK);
    let text = hg.metrics().await;
    for le in ["0.05", "0.2", "1.5", "+Inf"] {
        let series =
            format!(r#"herdguard_request_duration_seconds_bucket{{route="api",le="{le}"}}"#);
        assert_eq!(metric(&text, &series), Some(1.0), "{series}");
    }
    assert!(!text.contains(r#"le="0.25""#), "only the configured bounds");
    hg.terminate().await;
}

#[test]
fn bad_latency_buckets_name_the_key_and_line() {
    let errs = match herdguard::config::Config::parse("[metrics]\nlatency_buckets = [1, 0.5, -2]\n")
    {
        Ok(_) => panic!("accepted"),
        Err(e) => {
            e.0.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("\n")
        }
    };
    let Err(empty) = herdguard::config::Config::parse("[metrics]\nlatency_buckets = []\n") else {
        panic!("an empty list is accepted")
    };
    let empty = empty.to_string();
    assert!(
        empty.contains("line 2") && empty.contains("leave latency_buckets out"),
        "{empty}"
    );
    for expect in [
        "metrics.latency_buckets[1] (line 2): bounds must rise: 0.5 comes after 1",
        "metrics.latency_buckets[2] (line 2): -2 is not a time in seconds above 0",
    ] {
        assert!(errs.contains(expect), "{expect:?} in {errs}");
    }
}

/// The metric names an expression queries: `herdguard_*` and `process_*`,
/// a histogram's `_bucket`, `_sum` and `_count` read as its family.
fn metric_names(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = expr;
    while let Some(at) = ["herdguard_", "process_"]
        .iter()
        .filter_map(|p| rest.find(p))
        .min()
    {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        let name = &tail[..end];
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(name);
        names.push(family.to_owned());
        rest = &tail[end..];
    }
    names
}

/// Every expression of the shipped Grafana dashboard and alerting rules.
fn shipped_queries() -> Vec<String> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("deploy/grafana/herdguard-dashboard.json")).unwrap(),
    )
    .unwrap();
    let mut exprs: Vec<String> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().unwrap().iter())
        .map(|t| t["expr"].as_str().unwrap().to_owned())
        .collect();
    let rules =
        std::fs::read_to_string(root.join("deploy/prometheus/herdguard-alerts.yaml")).unwrap();
    let rules = &yaml_rust2::YamlLoader::load_from_str(&rules).unwrap()[0];
    for group in rules["groups"].as_vec().unwrap() {
        for rule in group["rules"].as_vec().unwrap() {
            exprs.push(rule["expr"].as_str().unwrap().to_owned());
        }
    }
    exprs
}

#[test]
fn metric_names_are_read_from_expressions() {
    assert_eq!(
        metric_names(
            "histogram_quantile(0.9, sum by (le) (rate(herdguard_backoff_seconds_bucket[5m]))) / process_open_fds"
        ),
        ["herdguard_backoff_seconds", "process_open_fds"]
    );
}

/// The dashboard and the alerting rules query only metrics a live proxy
/// exposes, and promtool accepts the rules.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_and_alerts_query_metrics_that_exist() {
    test_tools();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let checked = std::process::Command::new("promtool")
        .args(["check", "rules"])
        .arg(root.join("deploy/prometheus/herdguard-alerts.yaml"))
        .output()
        .unwrap();
    assert!(
        checked.status.success(),
        "promtool check rules: {}{}",
        String::from_utf8_lossy(&checked.stdout),
        String::from_utf8_lossy(&checked.stderr)
    );

    // A proxy whose one route retries over two endpoints, with the access
    // log on, after a retried request: every family a panel reads is there.
    let a = flaky_upstream().await;
    let b = flaky_upstream().await;
    let toml = format!(
        "[access_log]\nenabled = true\n\
         [upstreams.api]\nendpoints = [\"{}\", \"{}\"]\n\
         [[routes]]\nname = \"api\"\nupstream = \"api\"\n\
         retry = {{ attempts = 3, backoff = {{ base = \"5ms\", cap = \"10ms\" }} }}\n",
        a.url(),
        b.url()
    );
    let hg = Binary::start_adjusted("", &toml, |cmd| {
        cmd.stdout(std::process::Stdio::null());
    })
    .await;
    for path in ["/flaky", "/flaky", "/a"] {
        call(&hg, path).await;
    }
    let text = hg.metrics().await;
    let queries = shipped_queries();
    assert!(queries.len() >= 20, "{} queries", queries.len());
    let mut missing = std::collections::BTreeSet::new();
    for expr in &queries {
        let names = metric_names(expr);
        assert!(!names.is_empty(), "no metric in {expr}");
        for name in names {
            if !text.contains(&format!("# TYPE {name} ")) {
                missing.insert(name);
            }
        }
    }
    assert!(missing.is_empty(), "queried, not exposed: {missing:?}");
    hg.terminate().await;
}
