//! Hot reload: new routes serve, broken files change nothing, in-flight
//! requests and breaker and budget state survive.

use crate::common;

use std::time::Duration;

use common::*;
use herdguard::config::Config;
use http::{Request, Response, StatusCode};
use tokio::sync::oneshot;

fn toml(routes: &[(&str, &str, &str)], upstream: &str) -> String {
    let mut s = format!(
        "[listen]\naddress = \"127.0.0.1:0\"\n[admin]\naddress = \"127.0.0.1:0\"\n[upstreams.u]\nendpoints = [\"{upstream}\"]\n"
    );
    for (name, prefix, extra) in routes {
        s.push_str(&format!(
            "[[routes]]\nname = \"{name}\"\nupstream = \"u\"\nmatch = {{ path_prefix = \"{prefix}\" }}\n{extra}\n"
        ));
    }
    s
}

async fn start(src: &str) -> herdguard::app::Server {
    herdguard::app::Server::start(Config::parse(src).unwrap())
        .await
        .unwrap()
}

fn reloads(text: &str, result: &str) -> f64 {
    metric(
        text,
        &format!("herdguard_config_reloads_total{{result=\"{result}\"}}"),
    )
    .unwrap()
}

#[tokio::test]
async fn a_route_added_by_reload_serves() {
    let up = ok_upstream("ok").await;
    let server = start(&toml(&[("a", "/a", "")], &up.url())).await;
    assert_eq!(get(&server, "/b").await.0, StatusCode::NOT_FOUND);
    let mut config = Config::parse(&toml(&[("a", "/a", ""), ("b", "/b", "")], &up.url())).unwrap();
    // Listen addresses, tracing and the histogram buckets cannot change on
    // reload; the running ones stay, and `/config` shows them.
    config.listen.address = "127.0.0.1:1".parse().unwrap();
    config.tracing.otlp_endpoint = Some("http://127.0.0.1:9/".into());
    config.metrics.latency_buckets = vec![0.5, 1.0];
    server.reload(config).unwrap();
    assert_eq!(get(&server, "/b").await.0, StatusCode::OK);
    assert_eq!(get(&server, "/a").await.0, StatusCode::OK);
    let text = admin(&server, "/metrics").await.1;
    assert_eq!(reloads(&text, "ok"), 1.0);
    let shown = Config::parse(&admin(&server, "/config").await.1).unwrap();
    assert!(shown.routes.iter().any(|r| r.name == "b"));
    assert_eq!(shown.listen.address, "127.0.0.1:0".parse().unwrap());
    assert_eq!(shown.tracing.otlp_endpoint, None);
    assert!(shown.metrics.latency_buckets.is_empty());
}

#[tokio::test]
async fn a_broken_file_keeps_the_old_config_and_counts_an_error() {
    let up = ok_upstream("ok").await;
    let server = start(&toml(&[("a", "/a", "")], &up.url())).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("herdguard.toml");
    std::fs::write(&path, "[[routes]]\nname = \"x\"\nupstream = \"missing\"\n").unwrap();
    let err = server.reload_file(&path).unwrap_err();
    assert!(err.contains("routes[0].upstream (line 3)"), "{err}");
    std::fs::write(&path, "this is not toml").unwrap();
    assert!(server.reload_file(&path).is_err());
    // A truncated file is valid TOML with no routes: refused too.
    std::fs::write(&path, "").unwrap();
    let err = server.reload_file(&path).unwrap_err();
    assert!(err.contains("no routes"), "{err}");
    assert_eq!(
        get(&server, "/a").await.0,
        StatusCode::OK,
        "the old config still serves"
    );
    let text = admin(&server, "/metrics").await.1;
    assert_eq!((reloads(&text, "ok"), reloads(&text, "error")), (0.0, 3.0));
    let last = "herdguard_config_last_reload_successful";
    assert_eq!(metric(&text, last), Some(0.0), "refused until one succeeds");
    std::fs::write(&path, toml(&[("a", "/a", "")], &up.url())).unwrap();
    server.reload_file(&path).unwrap();
    let text = admin(&server, "/metrics").await.1;
    assert_eq!(metric(&text, last), Some(1.0));
}

/// A server started from a file with route `a`, its watcher on, and the
/// file's path.
async fn watched(
    dir: &std::path::Path,
    upstream: &str,
) -> (herdguard::app::Server, std::path::PathBuf) {
    let path = dir.join("herdguard.toml");
    std::fs::write(&path, toml(&[("a", "/a", "")], upstream)).unwrap();
    let stamp = herdguard::app::FileStamp::of(&path);
    let server = herdguard::app::Server::start(Config::from_file(&path).unwrap())
        .await
        .unwrap();
    server.watch(path.clone(), Duration::from_millis(20), stamp);
    (server, path)
}

/// Writes a file that adds route `c`, and waits for it to serve.
async fn adds_route_c(server: &herdguard::app::Server, path: &std::path::Path, upstream: &str) {
    std::fs::write(path, toml(&[("a", "/a", ""), ("c", "/c", "")], upstream)).unwrap();
    eventually(
        Duration::from_secs(5),
        "the new route serves",
        || async move { get(server, "/c").await.0 == StatusCode::OK },
    )
    .await;
}

#[tokio::test]
async fn a_changed_file_is_reloaded_by_the_watcher() {
    let up = ok_upstream("ok").await;
    let dir = tempfile::tempdir().unwrap();
    let (server, path) = watched(dir.path(), &up.url()).await;
    adds_route_c(&server, &path, &up.url()).await;
}

/// A file changed after it was read for the starting config, but before
/// the watcher started: the change is loaded, not taken for what runs.
#[tokio::test]
async fn a_change_made_while_the_server_starts_is_loaded() {
    let up = ok_upstream("ok").await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("herdguard.toml");
    std::fs::write(&path, toml(&[("a", "/a", "")], &up.url())).unwrap();
    let stamp = herdguard::app::FileStamp::of(&path);
    let config = Config::from_file(&path).unwrap();
    // Swapped whole (a new inode, as a ConfigMap's update is).
    let staged = dir.path().join("staged");
    std::fs::write(
        &staged,
        toml(&[("a", "/a", ""), ("c", "/c", "")], &up.url()),
    )
    .unwrap();
    std::fs::rename(&staged, &path).unwrap();
    let server = herdguard::app::Server::start(config).await.unwrap();
    assert_eq!(get(&server, "/c").await.0, StatusCode::NOT_FOUND);
    server.watch(path.clone(), Duration::from_millis(20), stamp);
    let server = &server;
    eventually(
        Duration::from_secs(5),
        "the change made during start-up serves",
        || async move { get(server, "/c").await.0 == StatusCode::OK },
    )
    .await;
}

/// A config path that becomes a FIFO (or a file too large to be a config)
/// is a reload refused with its reason, not a watcher that waits forever
/// for a writer: the next good file is applied.
#[tokio::test]
async fn a_fifo_in_place_of_the_file_does_not_wedge_the_watcher() {
    let up = ok_upstream("ok").await;
    let dir = tempfile::tempdir().unwrap();
    let (server, path) = watched(dir.path(), &up.url()).await;
    let fifo = common::fifo(&dir.path().join("fifo"));
    std::fs::rename(&fifo, &path).unwrap();
    let server_ref = &server;
    eventually(
        Duration::from_secs(5),
        "the FIFO's reload is refused",
        || async move { reloads(&admin(server_ref, "/metrics").await.1, "error") >= 1.0 },
    )
    .await;
    std::fs::remove_file(&path).unwrap();
    adds_route_c(&server, &path, &up.url()).await;
}

#[tokio::test]
async fn an_in_flight_request_survives_a_reload() {
    let Held {
        upstream: up,
        arrived,
        release,
    } = held_upstream("slow but fine").await;
    let server = start(&toml(&[("a", "/a", "")], &up.url())).await;
    let addr = server.proxy_addr();
    let (tx, rx) = oneshot::channel();
    tokio::spawn(async move {
        let req = Request::get(format!("http://{addr}/a"))
            .body(empty())
            .unwrap();
        let _ = tx.send(send(&client(), req).await);
    });
    arrived.notified().await;
    // The new config drops the route the request came through.
    server
        .reload(Config::parse(&toml(&[("z", "/z", "")], &up.url())).unwrap())
        .unwrap();
    release.notify_one();
    let (status, _, body) = rx.await.unwrap();
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"slow but fine"[..]));
    assert_eq!(
        get(&server, "/a").await.0,
        StatusCode::NOT_FOUND,
        "new requests see the new routes"
    );
}

#[tokio::test]
async fn breaker_and_budget_state_survive_a_reload() {
    let up = upstream(|_| async { Response::builder().status(503).body(empty()).unwrap() }).await;
    let before =
        "retry = { attempts = 2 }\nbreaker = { consecutive_failures = 2, open_for = \"1m\", probe_interval = \"1h\" }";
    let server = start(&toml(&[("a", "/a", before)], &up.url())).await;
    for _ in 0..2 {
        get(&server, "/a").await; // 2 requests fail, each after its retry: it trips
    }
    let budget_before = metric(
        &admin(&server, "/metrics").await.1,
        "herdguard_retry_budget_available{route=\"a\"}",
    )
    .unwrap();
    let view: serde_json::Value =
        serde_json::from_str(&admin(&server, "/breakers").await.1).unwrap();
    assert_eq!(view["routes"]["a"]["state"], "open");

    // Same route name, other retry and breaker thresholds, one more route.
    let after =
        "retry = { attempts = 3 }\nbreaker = { consecutive_failures = 9, open_for = \"1m\", probe_interval = \"1h\" }";
    server
        .reload(Config::parse(&toml(&[("a", "/a", after), ("b", "/b", "")], &up.url())).unwrap())
        .unwrap();
    let view: serde_json::Value =
        serde_json::from_str(&admin(&server, "/breakers").await.1).unwrap();
    assert_eq!(view["routes"]["a"]["state"], "open", "{view}");
    assert_eq!(view["routes"]["a"]["trips"], 1);
    assert_eq!(view["routes"]["b"]["state"], "closed");
    assert_eq!(
        get(&server, "/a").await.1["x-herdguard-error"],
        "circuit-open"
    );
    let budget_after = metric(
        &admin(&server, "/metrics").await.1,
        "herdguard_retry_budget_available{route=\"a\"}",
    )
    .unwrap();
    // The request refused by the open breaker deposited nothing; a fresh
    // budget would hold its whole floor, 100.
    assert!(budget_before < 100.0, "{budget_before}");
    assert!(
        (budget_after - budget_before).abs() < 1e-9,
        "the budget's spending is remembered: {budget_before} -> {budget_after}"
    );
    assert_eq!(up.hits(), 4);
}

#[tokio::test]
async fn requests_in_flight_count_toward_a_replaced_upstreams_limit() {
    let Held {
        upstream: up,
        arrived,
        release,
    } = held_upstream("held").await;
    let limit = |n: usize| {
        format!(
            "[listen]\naddress = \"127.0.0.1:0\"\n[admin]\naddress = \"127.0.0.1:0\"\n\
             [upstreams.u]\nendpoints = [\"{}\"]\nmax_in_flight = {n}\nadaptive_concurrency = {{ enabled = false }}\n\
             [[routes]]\nname = \"a\"\nupstream = \"u\"\n",
            up.url()
        )
    };
    let server = start(&limit(1)).await;
    let addr = server.proxy_addr();
    let (tx, rx) = oneshot::channel();
    tokio::spawn(async move {
        let req = Request::get(format!("http://{addr}/held"))
            .body(empty())
            .unwrap();
        let _ = tx.send(send(&client(), req).await);
    });
    arrived.notified().await;
    // Changed keys build a new upstream; the held request still counts.
    server
        .reload(
            Config::parse(
                &limit(1).replace("\n[[routes]]", "\nconnect_timeout = \"2s\"\n[[routes]]"),
            )
            .unwrap(),
        )
        .unwrap();
    let (status, headers, _) = get(&server, "/more").await;
    assert_eq!(
        status,
        StatusCode::SERVICE_UNAVAILABLE,
        "the one slot is still taken"
    );
    assert_eq!(headers["x-herdguard-error"], "overloaded");
    release.notify_one();
    assert_eq!(rx.await.unwrap().0, StatusCode::OK);
    let (_, text) = admin(&server, "/metrics").await;
    assert_eq!(
        metric(&text, "herdguard_in_flight{upstream=\"u\"}"),
        Some(0.0),
        "and it came back"
    );
}

/// Through the binary, logging text: a reload that fails with several
/// errors logs them on one line (line-based shippers take a line for an
/// event), and a reload that succeeds says which routes and upstreams it
/// added, removed and changed.
#[tokio::test]
async fn reload_log_lines_are_single_and_say_what_changed() {
    use common::process::{line_with, spawn_reading_stderr, BIN};
    let up = ok_upstream("ok").await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("herdguard.toml");
    let routes = |list: &[(&str, &str, &str)]| toml(list, &up.url());
    std::fs::write(&path, routes(&[("a", "/a", ""), ("gone", "/g", "")])).unwrap();
    let mut cmd = std::process::Command::new(BIN);
    cmd.arg("--config")
        .arg(&path)
        .args(["--log-format", "text"])
        .env("NO_COLOR", "1");
    let (mut child, lines) = spawn_reading_stderr(cmd);
    let hup = |pid: u32| {
        let sent = std::process::Command::new("kill")
            .args(["-HUP", &pid.to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
    };
    let (_, lines) = line_with(lines, "herdguard serving").await;

    // Two errors in two routes.
    std::fs::write(
        &path,
        routes(&[
            ("a", "/a", "retry = { attempts = 0 }"),
            ("b", "/b", "typo = 1"),
        ]),
    )
    .unwrap();
    hup(child.id());
    let (failed, lines) = line_with(lines, "config reload failed").await;
    assert!(
        failed.contains("routes[0].retry.attempts") && failed.contains("routes[1].typo"),
        "both errors on the one line: {failed}"
    );

    // a changed, b added, gone removed, an upstream added.
    let mut text = routes(&[("a", "/a", "retry = { attempts = 2 }"), ("b", "/b", "")]);
    text.push_str(&format!("[upstreams.v]\nendpoints = [\"{}\"]\n", up.url()));
    std::fs::write(&path, text).unwrap();
    hup(child.id());
    let (reloaded, _) = line_with(lines, "config reloaded").await;
    for field in [
        "routes.added=b",
        "routes.removed=gone",
        "routes.changed=a",
        "upstreams.added=v",
        "upstreams.removed=-",
        "upstreams.changed=-",
    ] {
        assert!(reloaded.contains(field), "{field}: {reloaded}");
    }
    child.kill().unwrap();
    child.wait().unwrap();
}

/// A reload is checked and built off the proxy's worker threads: with one
/// worker, a file with 10,000 errors is still being checked while the
/// admin listener answers, and the old config keeps serving after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_big_broken_reload_does_not_stall_a_one_thread_proxy() {
    use common::process::{line_with, spawn_reading_stderr, BIN};
    let up = ok_upstream("ok").await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("herdguard.toml");
    std::fs::write(&path, toml(&[("a", "/", "")], &up.url())).unwrap();
    let mut cmd = std::process::Command::new(BIN);
    cmd.arg("--config")
        .arg(&path)
        .args(["--log-format", "json", "--threads", "1"]);
    let (mut child, lines) = spawn_reading_stderr(cmd);
    let (serving, lines) = line_with(lines, "herdguard serving").await;
    let serving: serde_json::Value = serde_json::from_str(&serving).unwrap();
    let admin = serving["admin"].as_str().unwrap().to_owned();
    let listen = serving["listen"].as_str().unwrap().to_owned();

    let mut bad = toml(&[], &up.url());
    for i in 0..10_000 {
        bad.push_str(&format!(
            "[[routes]]\nname = \"r{i}\"\nupstream = \"u\"\ntypo = 1\n"
        ));
    }
    std::fs::write(&path, bad).unwrap();
    let sent = std::process::Command::new("kill")
        .args(["-HUP", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    // Answered while the reload is under way: its end is not logged yet.
    let healthz = http::Request::get(format!("http://{admin}/healthz"))
        .body(empty())
        .unwrap();
    assert_eq!(send(&client(), healthz).await.0, StatusCode::OK);
    let so_far: Vec<String> = lines.try_iter().collect();
    assert!(
        !so_far.iter().any(|l| l.contains("config reload failed")),
        "the admin listener waited for the reload: {so_far:#?}"
    );
    let (failed, _) = line_with(lines, "config reload failed").await;
    assert!(failed.contains("routes[9999].typo"), "{failed}");
    let req = http::Request::get(format!("http://{listen}/x"))
        .body(empty())
        .unwrap();
    assert_eq!(
        send(&client(), req).await.0,
        StatusCode::OK,
        "the old config serves"
    );
    child.kill().unwrap();
    child.wait().unwrap();
}

/// A config whose CA file stops holding a certificate between its parse
/// and its reload changes nothing: breakers, limits and pools are as they
/// were, as `/breakers` shows them, and the failure is counted.
#[tokio::test]
async fn a_reload_that_cannot_be_built_touches_no_live_state() {
    let up = ok_upstream("ok").await;
    let server = start(&toml(
        &[("a", "/a", "breaker = { consecutive_failures = 2 }")],
        &up.url(),
    ))
    .await;
    assert_eq!(get(&server, "/a").await.0, StatusCode::OK);
    // What /breakers shows, but for the clock.
    let breakers = |text: String| {
        let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
        v["routes"]["a"]
            .as_object_mut()
            .unwrap()
            .remove("since_seconds");
        v
    };
    let before = breakers(admin(&server, "/breakers").await.1);

    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    std::fs::write(&ca, cert.cert.pem()).unwrap();
    let broken = format!(
        "{}[upstreams.t]\nendpoints = [\"https://127.0.0.1:9\"]\nca_file = {:?}\n\
         [[routes]]\nname = \"t\"\nupstream = \"t\"\nmatch = {{ path_prefix = \"/t\" }}\n",
        toml(
            &[(
                "a",
                "/a",
                "breaker = { consecutive_failures = 50 }\nretry = { budget = { ratio = 0.5 } }"
            )],
            &up.url()
        ),
        ca.display()
    );
    let broken = Config::parse(&broken).unwrap();
    std::fs::write(&ca, "not a certificate\n").unwrap();
    let err = server.reload(broken).unwrap_err();
    assert!(err.to_string().contains("upstreams.t.ca_file"), "{err}");
    assert_eq!(breakers(admin(&server, "/breakers").await.1), before);
    assert_eq!(get(&server, "/t").await.0, StatusCode::NOT_FOUND);
    let text = admin(&server, "/metrics").await.1;
    assert_eq!(reloads(&text, "error"), 1.0);
}

/// A config built in code that fails its checks is refused by start and by
/// reload alike: it never reaches a runtime.
#[tokio::test]
async fn a_config_that_fails_its_checks_never_reaches_the_runtime() {
    let up = ok_upstream("ok").await;
    let mut bad = Config::parse(&toml(&[("a", "/a", "")], &up.url())).unwrap();
    bad.routes[0].upstream = "nowhere".to_owned();
    let err = match herdguard::app::Server::start(bad.clone()).await {
        Err(e) => e.to_string(),
        Ok(_) => panic!("started with a route to no upstream"),
    };
    assert!(err.contains("routes[0].upstream"), "{err}");
    let server = start(&toml(&[("a", "/a", "")], &up.url())).await;
    let err = server.reload(bad).unwrap_err().to_string();
    assert!(err.contains("routes[0].upstream"), "{err}");
    assert_eq!(get(&server, "/a").await.0, StatusCode::OK);
}

/// A file edited and then signalled (SIGHUP) is reloaded once: the
/// watcher, which looks every second, does not reload again what the
/// signal's reload read (it once did, so every edit and signal rebuilt
/// the config twice).
#[tokio::test]
async fn an_edit_and_a_sighup_reload_once() {
    let up = ok_upstream("ok").await;
    let routes = |n: usize| {
        let mut toml = format!("[upstreams.u]\nendpoints = [\"{}\"]\n", up.url());
        for i in 0..n {
            toml.push_str(&format!(
                "[[routes]]\nname = \"r{i}\"\nupstream = \"u\"\nmatch = {{ path_prefix = \"/r{i}/\" }}\n"
            ));
        }
        toml
    };
    let hg = crate::common::process::Binary::start(&routes(1)).await;
    let ok = r#"herdguard_config_reloads_total{result="ok"}"#;
    hg.reload(&routes(2));
    eventually(Duration::from_secs(10), "reloaded", || async {
        hg.metric(ok).await >= 1.0
    })
    .await;
    // The watcher's two looks (changed, then unchanged for a second)
    // come within two and a half seconds: the window to see a second
    // reload, not a wait for one.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(hg.metric(ok).await, 1.0, "reloaded again");
    hg.terminate().await;
}

/// The listener's connection settings are taken at its start: a reload
/// that changes one says it needs a restart, naming it, and the running
/// config's other changes are applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_changes_a_connection_setting_says_it_needs_a_restart() {
    let up = ok_upstream("ok").await;
    let routes = |name: &str| {
        format!(
            "[upstreams.u]\nendpoints = [\"{}\"]\n[[routes]]\nname = \"{name}\"\nupstream = \"u\"\n",
            up.url()
        )
    };
    let hg = process::Binary::start_with("write_timeout = \"30s\"", &routes("a")).await;
    hg.reload_with(
        "write_timeout = \"1s\"\nidle_timeout = \"5s\"",
        &routes("b"),
    );
    eventually(Duration::from_secs(10), "the reload applied", || async {
        hg.metric(r#"herdguard_config_reloads_total{result="ok"}"#)
            .await
            >= 1.0
    })
    .await;
    let lines = hg.terminate().await;
    let said = |key: &str| {
        lines
            .iter()
            .any(|l| l.contains(&format!("a change to {key} needs a restart")))
    };
    assert!(said("listen.write_timeout"), "{lines:#?}");
    assert!(said("listen.idle_timeout"), "{lines:#?}");
    assert!(!said("listen.send_buffer"), "{lines:#?}");
}
