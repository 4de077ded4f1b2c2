//! The circuit breaker, shedding and the adaptive limit, through the real proxy.

use crate::common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use http::{Response, StatusCode};
use tokio::sync::Notify;

/// Counts requests in flight at the upstream and the most seen at once.
#[derive(Default)]
struct Gauge {
    now: AtomicUsize,
    peak: AtomicUsize,
}

impl Gauge {
    fn enter(self: &Arc<Self>) -> impl Drop {
        let n = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.peak.fetch_max(n, Ordering::SeqCst);
        Leave(self.clone())
    }
}

struct Leave(Arc<Gauge>);

impl Drop for Leave {
    fn drop(&mut self) {
        self.0.now.fetch_sub(1, Ordering::SeqCst);
    }
}

fn route(url: &str, upstream_extra: &str, route_extra: &str) -> String {
    format!("[upstreams.u]\nendpoints = [\"{url}\"]\n{upstream_extra}\n[[routes]]\nname = \"r\"\nupstream = \"u\"\n{route_extra}\n")
}

#[tokio::test]
async fn opens_after_failures_and_the_upstream_sees_nothing_while_open() {
    let up =
        upstream(|_| async { Response::builder().status(503).body(full("down")).unwrap() }).await;
    let server = proxy(&route(
        &up.url(),
        "",
        "retry = { attempts = 1 }\nbreaker = { consecutive_failures = 3, open_for = \"30s\" }",
    ))
    .await;
    for _ in 0..3 {
        let (status, headers, _) = get(&server, "/").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(
            !headers.contains_key("x-herdguard-error"),
            "the upstream's own 503"
        );
    }
    for _ in 0..20 {
        let (status, headers, body) = get(&server, "/").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(headers["x-herdguard-error"], "circuit-open");
        let after: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
        assert!(
            (22..=39).contains(&after),
            "retry-after {after}: the remaining open time, jittered"
        );
        assert!(String::from_utf8_lossy(&body).contains("circuit breaker"));
    }
    assert_eq!(up.hits(), 3, "nothing reached the upstream while open");
    let text = admin(&server, "/metrics").await.1;
    assert_eq!(
        metric(&text, "herdguard_breaker_state{route=\"r\"}"),
        Some(2.0),
        "{text}"
    );
    assert_eq!(
        metric(
            &text,
            "herdguard_breaker_transitions_total{route=\"r\",to=\"open\"}"
        ),
        Some(1.0)
    );
    // The upstream's three 503s and the breaker's twenty, told apart.
    for (source, count) in [("upstream", 3.0), ("proxy", 20.0)] {
        let series =
            format!("herdguard_requests_total{{route=\"r\",code=\"503\",source=\"{source}\"}}");
        assert_eq!(metric(&text, &series), Some(count), "{series}");
    }
}

#[tokio::test]
async fn a_half_open_probe_closes_it() {
    let healthy = Arc::new(AtomicBool::new(false));
    let up = {
        let healthy = healthy.clone();
        upstream(move |_| {
            let ok = healthy.load(Ordering::SeqCst);
            async move {
                let status = if ok { 200 } else { 503 };
                Response::builder().status(status).body(full("x")).unwrap()
            }
        })
        .await
    };
    let server = proxy(&route(
        &up.url(),
        "",
        "retry = { attempts = 1 }\nbreaker = { consecutive_failures = 2, open_for = \"200ms\", half_open_probes = 1, probe_interval = \"1h\" }",
    ))
    .await;
    for _ in 0..2 {
        get(&server, "/").await;
    }
    assert_eq!(
        get(&server, "/").await.1["x-herdguard-error"],
        "circuit-open"
    );
    healthy.store(true, Ordering::SeqCst);
    let server = &server;
    eventually(
        Duration::from_secs(5),
        "a probe got through after open_for",
        || async move { get(server, "/").await.0 == StatusCode::OK },
    )
    .await;
    // Closed again: every request goes through.
    for _ in 0..5 {
        assert_eq!(get(server, "/").await.0, StatusCode::OK);
    }
    let text = admin(server, "/metrics").await.1;
    assert_eq!(
        metric(&text, "herdguard_breaker_state{route=\"r\"}"),
        Some(0.0)
    );
    for to in ["open", "half_open", "closed"] {
        let series = format!("herdguard_breaker_transitions_total{{route=\"r\",to=\"{to}\"}}");
        assert_eq!(metric(&text, &series), Some(1.0), "{series}\n{text}");
    }
}

#[tokio::test]
async fn shedding_answers_at_once_and_caps_upstream_concurrency() {
    let gauge = Arc::new(Gauge::default());
    let release = Arc::new(Notify::new());
    let up = {
        let (gauge, release) = (gauge.clone(), release.clone());
        upstream(move |_| {
            let (gauge, release) = (gauge.clone(), release.clone());
            async move {
                let _inside = gauge.enter();
                release.notified().await;
                Response::new(full("done"))
            }
        })
        .await
    };
    let server = proxy(&route(
        &up.url(),
        "max_in_flight = 4\nadaptive_concurrency = { enabled = false }",
        "retry = { attempts = 1, per_try_timeout = \"10s\" }",
    ))
    .await;
    let mut waiting = Vec::new();
    for _ in 0..4 {
        let addr = server.proxy_addr();
        waiting.push(tokio::spawn(async move {
            let req = http::Request::get(format!("http://{addr}/"))
                .body(empty())
                .unwrap();
            send(&client(), req).await.0
        }));
    }
    let g = &gauge;
    eventually(
        Duration::from_secs(5),
        "four requests held upstream",
        || async move { g.now.load(Ordering::SeqCst) == 4 },
    )
    .await;
    for _ in 0..6 {
        let (status, headers, _) = get(&server, "/").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(headers["x-herdguard-error"], "overloaded");
        assert!(headers.contains_key("retry-after"));
    }
    assert_eq!(
        gauge.peak.load(Ordering::SeqCst),
        4,
        "the upstream never had more than the limit"
    );
    let text = admin(&server, "/metrics").await.1;
    assert_eq!(
        metric(&text, "herdguard_shed_total{upstream=\"u\"}"),
        Some(6.0)
    );
    assert_eq!(
        metric(&text, "herdguard_in_flight{upstream=\"u\"}"),
        Some(4.0)
    );
    // Shedding is not the upstream failing: the breaker stays closed.
    assert_eq!(
        metric(&text, "herdguard_breaker_state{route=\"r\"}"),
        Some(0.0)
    );
    for _ in 0..4 {
        release.notify_one();
    }
    for w in waiting {
        assert_eq!(w.await.unwrap(), StatusCode::OK);
    }
}

#[tokio::test]
async fn abandoned_attempts_are_cancelled_upstream() {
    let gauge = Arc::new(Gauge::default());
    let up = {
        let gauge = gauge.clone();
        upstream(move |_| {
            let gauge = gauge.clone();
            async move {
                let _inside = gauge.enter();
                std::future::pending::<()>().await;
                unreachable!()
            }
        })
        .await
    };
    let server = proxy(&route(
        &up.url(),
        "",
        "retry = { attempts = 1, per_try_timeout = \"100ms\" }",
    ))
    .await;
    let (status, headers, _) = get(&server, "/").await;
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(headers["x-herdguard-error"], "timeout");
    assert_eq!(gauge.peak.load(Ordering::SeqCst), 1);
    // The proxy closed the connection: the upstream dropped its handler.
    let g = &gauge;
    eventually(
        Duration::from_secs(5),
        "the upstream saw the attempt cancelled",
        || async move { g.now.load(Ordering::SeqCst) == 0 },
    )
    .await;
}

#[tokio::test]
async fn operators_force_the_breaker_open_and_closed() {
    let up = ok_upstream("fine").await;
    let server = proxy(&route(&up.url(), "", "")).await;
    let (status, body) = admin(&server, "/breakers").await;
    assert_eq!(status, StatusCode::OK);
    let view: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(view["routes"]["r"]["state"], "closed");
    assert_eq!(view["routes"]["r"]["upstream"], "u");
    assert_eq!(view["upstreams"]["u"]["limit"], 20, "{view}");
    assert_eq!(view["upstreams"]["u"]["max_in_flight"], 1024);

    let (status, body) = admin_post(&server, "/breakers/r/open").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(
        get(&server, "/").await.1["x-herdguard-error"],
        "circuit-open"
    );
    assert_eq!(up.hits(), 0);
    let view: serde_json::Value =
        serde_json::from_str(&admin(&server, "/breakers").await.1).unwrap();
    assert_eq!(
        (
            view["routes"]["r"]["state"].as_str(),
            view["routes"]["r"]["forced"].as_bool()
        ),
        (Some("open"), Some(true))
    );

    assert_eq!(
        admin_post(&server, "/breakers/r/close").await.0,
        StatusCode::OK
    );
    assert_eq!(get(&server, "/").await.0, StatusCode::OK);
    assert_eq!(
        admin_post(&server, "/breakers/r/reset").await.0,
        StatusCode::OK
    );
    let view: serde_json::Value =
        serde_json::from_str(&admin(&server, "/breakers").await.1).unwrap();
    assert_eq!(view["routes"]["r"]["forced"], false);

    assert_eq!(
        admin_post(&server, "/breakers/nope/open").await.0,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        admin_post(&server, "/breakers/r/explode").await.0,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        admin(&server, "/breakers/r/open").await.0,
        StatusCode::METHOD_NOT_ALLOWED,
        "GET does not change state"
    );
    let text = admin(&server, "/metrics").await.1;
    assert_eq!(
        metric(
            &text,
            "herdguard_breaker_transitions_total{route=\"r\",to=\"open\"}"
        ),
        Some(1.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_upstream_gets_bounded_load_and_service_recovers_after_it_resumes() {
    let stalled = Arc::new(AtomicBool::new(true));
    let resume = Arc::new(Notify::new());
    let up = {
        let (stalled, resume) = (stalled.clone(), resume.clone());
        upstream(move |_| {
            let (stalled, resume) = (stalled.clone(), resume.clone());
            async move {
                if stalled.load(Ordering::SeqCst) {
                    resume.notified().await;
                }
                Response::new(full("ok"))
            }
        })
        .await
    };
    let server = proxy(&route(
        &up.url(),
        "",
        "retry = { per_try_timeout = \"200ms\", timeout = \"1s\" }\nbreaker = { open_for = \"1s\" }",
    ))
    .await;

    // 40 callers, each retrying naively on top: a new request as soon as one fails.
    let stop = Arc::new(AtomicBool::new(false));
    let mut callers = Vec::new();
    for _ in 0..40 {
        let (stop, addr) = (stop.clone(), server.proxy_addr());
        callers.push(tokio::spawn(async move {
            let client = client();
            let mut sent = 0;
            while !stop.load(Ordering::SeqCst) && sent < 2000 {
                let req = http::Request::get(format!("http://{addr}/"))
                    .body(empty())
                    .unwrap();
                let _ = client.request(req).await;
                sent += 1;
            }
            sent
        }));
    }
    // Stalled for about 1.5 s of the callers' traffic.
    let started = tokio::time::Instant::now();
    let server_ref = &server;
    eventually(
        Duration::from_secs(10),
        "the breaker opened on the stall",
        || async move {
            let text = admin(server_ref, "/metrics").await.1;
            metric(
                &text,
                "herdguard_breaker_transitions_total{route=\"r\",to=\"open\"}",
            )
            .unwrap_or(0.0)
                >= 1.0
        },
    )
    .await;
    tokio::time::sleep_until(started + Duration::from_millis(1500)).await;
    let during_stall = up.hits();

    stalled.store(false, Ordering::SeqCst);
    resume.notify_waiters();
    let resumed = tokio::time::Instant::now();
    // Recovered: 45 of 50 requests in a row succeed, while the 40 callers go on.
    eventually(
        Duration::from_secs(10),
        "45 of 50 requests in a row succeed",
        || async move {
            let mut ok = 0;
            for _ in 0..50 {
                if get(server_ref, "/").await.0 == StatusCode::OK {
                    ok += 1;
                }
            }
            ok >= 45
        },
    )
    .await;
    let recovery = resumed.elapsed();
    stop.store(true, Ordering::SeqCst);
    let mut requests = 0;
    for c in callers {
        requests += c.await.unwrap();
    }
    // Without protection: 40 callers x 1.5 s / 200 ms x 3 attempts = 900 attempts.
    assert!(
        during_stall <= 200,
        "{during_stall} attempts reached the stalled upstream ({requests} caller requests)"
    );
    eprintln!("stall: {during_stall} upstream attempts; recovery after {recovery:?}; {requests} caller requests");
}

#[tokio::test]
async fn a_probe_whose_caller_hangs_up_frees_its_slot() {
    // 0: fail, 1: hang (and say so), 2: succeed.
    let mode = Arc::new(AtomicUsize::new(0));
    let hanging = Arc::new(Notify::new());
    let up = {
        let (mode, hanging) = (mode.clone(), hanging.clone());
        upstream(move |_| {
            let (mode, hanging) = (mode.clone(), hanging.clone());
            async move {
                match mode.load(Ordering::SeqCst) {
                    0 => Response::builder().status(503).body(full("down")).unwrap(),
                    1 => {
                        hanging.notify_one();
                        std::future::pending::<()>().await;
                        unreachable!()
                    }
                    _ => Response::new(full("up")),
                }
            }
        })
        .await
    };
    let server = proxy(&route(
        &up.url(),
        "",
        "retry = { attempts = 1, per_try_timeout = \"30s\" }\nbreaker = { consecutive_failures = 1, open_for = \"100ms\", half_open_probes = 1 }",
    ))
    .await;
    assert_eq!(get(&server, "/").await.0, StatusCode::SERVICE_UNAVAILABLE);
    mode.store(1, Ordering::SeqCst);
    // Once half-open, the one probe hangs upstream; its caller gives up.
    let addr = server.proxy_addr();
    let server_ref = &server;
    let hanging_ref = &hanging;
    eventually(
        Duration::from_secs(5),
        "a probe reached the hanging upstream",
        || async move {
            let probe = tokio::spawn(async move {
                let req = http::Request::get(format!("http://{addr}/"))
                    .body(empty())
                    .unwrap();
                send(&client(), req).await
            });
            let reached = tokio::select! {
                _ = hanging_ref.notified() => true,
                _ = tokio::time::sleep(Duration::from_millis(50)) => false,
            };
            probe.abort();
            let _ = probe.await;
            let _ = server_ref;
            reached
        },
    )
    .await;
    mode.store(2, Ordering::SeqCst);
    eventually(
        Duration::from_secs(5),
        "a new probe is admitted and closes the breaker",
        || async move { get(server_ref, "/").await.0 == StatusCode::OK },
    )
    .await;
    let text = admin(&server, "/metrics").await.1;
    assert_eq!(
        metric(
            &text,
            "herdguard_upstream_attempts_total{route=\"r\",upstream=\"u\",outcome=\"cancelled\"}"
        ),
        Some(1.0),
        "{text}"
    );
}

#[tokio::test]
async fn refused_requests_earn_no_retry_budget() {
    let up = ok_upstream("fine").await;
    let server = proxy(&route(&up.url(), "", "")).await;
    let available = |server| async move {
        let (_, text) = admin(server, "/metrics").await;
        metric(&text, "herdguard_retry_budget_available{route=\"r\"}").expect("budget gauge")
    };
    let floor = available(&server).await;

    assert_eq!(
        admin_post(&server, "/breakers/r/open").await.0,
        StatusCode::OK
    );
    for _ in 0..50 {
        assert_eq!(get(&server, "/").await.0, StatusCode::SERVICE_UNAVAILABLE);
    }
    assert_eq!(
        available(&server).await,
        floor,
        "refused requests deposited"
    );

    assert_eq!(
        admin_post(&server, "/breakers/r/reset").await.0,
        StatusCode::OK
    );
    for _ in 0..50 {
        assert_eq!(get(&server, "/").await.0, StatusCode::OK);
    }
    assert!(available(&server).await > floor, "sent requests deposit");
    assert_eq!(up.hits(), 50);
}
