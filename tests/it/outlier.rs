//! Outlier ejection through the real binary: one broken endpoint is taken
//! out of rotation, not the route; it comes back when it recovers; only the
//! upstream's own failures count against an endpoint.

use crate::common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::process::Binary;
use common::*;
use http::{Method, Response, StatusCode};

const OPENED: &str = "herdguard_breaker_transitions_total{route=\"r\",to=\"open\"}";

fn two_endpoints(good: &str, bad: &str, outlier: &str) -> String {
    format!(
        "[upstreams.u]\nendpoints = [\"{good}\", \"{bad}\"]\n{outlier}\n\
         [[routes]]\nname = \"r\"\nupstream = \"u\"\n"
    )
}

fn ejections(bad: &str) -> String {
    format!("herdguard_endpoint_ejections_total{{upstream=\"u\",endpoint=\"{bad}\"}}")
}

fn ejected(endpoint: &str) -> String {
    format!("herdguard_endpoint_ejected{{upstream=\"u\",endpoint=\"{endpoint}\"}}")
}

/// An upstream that answers 503 to everything while `broken` is set.
async fn breakable(broken: Arc<AtomicBool>) -> Upstream {
    upstream(move |_| {
        let broken = broken.clone();
        async move {
            let mut resp = Response::new(full("here"));
            if broken.load(Ordering::SeqCst) {
                *resp.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            }
            resp
        }
    })
    .await
}

/// Sends `count` requests, `parallel` at a time; gives back how many got 200.
async fn load(listen: &str, method: Method, count: usize, parallel: usize) -> usize {
    let mut ok = 0;
    let mut sent = 0;
    while sent < count {
        let batch: Vec<_> = (sent..count.min(sent + parallel))
            .map(|i| {
                let req = http::Request::builder()
                    .method(method.clone())
                    .uri(format!("http://{listen}/orders/{i}"))
                    .body(full("{}"))
                    .unwrap();
                tokio::spawn(async move { send(&client(), req).await.0 })
            })
            .collect();
        sent += batch.len();
        for r in batch {
            ok += usize::from(r.await.unwrap() == StatusCode::OK);
        }
    }
    ok
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_broken_endpoint_is_ejected_not_the_route() {
    let good = ok_upstream("fine").await;
    let bad = breakable(Arc::new(AtomicBool::new(true))).await;
    let hg = Binary::start(&two_endpoints(&good.url(), &bad.url(), "")).await;

    // POSTs may not be retried: each one the broken endpoint gets fails.
    let posts = load(&hg.listen, Method::POST, 300, 4).await;
    let gets = load(&hg.listen, Method::GET, 300, 4).await;
    let ok = posts + gets;
    eprintln!(
        "{posts} POSTs and {gets} GETs of 300 each; the broken endpoint got {}",
        bad.hits()
    );
    assert!(
        ok >= 588,
        "{ok} of 600 succeeded ({posts} POSTs, {gets} GETs)"
    );
    assert!(
        bad.hits() <= 36,
        "the broken endpoint received {} requests",
        bad.hits()
    );
    let metrics = hg.metrics().await;
    assert!(metric(&metrics, &ejections(&bad.url())).unwrap_or(0.0) >= 1.0);
    assert_eq!(metric(&metrics, &ejections(&good.url())), Some(0.0));
    assert_eq!(metric(&metrics, &ejected(&good.url())), Some(0.0));
    assert_eq!(
        metric(&metrics, OPENED),
        Some(0.0),
        "the route's breaker stayed closed"
    );

    // /breakers shows each endpoint's state.
    let req = http::Request::get(format!("http://{}/breakers", hg.admin))
        .body(empty())
        .unwrap();
    let (_, _, body) = send(&client(), req).await;
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let endpoints = v["upstreams"]["u"]["endpoints"].as_array().unwrap();
    assert_eq!(endpoints.len(), 2);
    assert_eq!(endpoints[0]["endpoint"], good.url());
    assert_eq!(endpoints[0]["state"], "serving");
    assert!(endpoints[1]["ejections"].as_u64().unwrap() >= 1, "{v:#}");
    hg.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ejected_endpoint_that_recovers_is_probed_back_in() {
    let good = ok_upstream("fine").await;
    let broken = Arc::new(AtomicBool::new(true));
    let bad = breakable(broken.clone()).await;
    let hg = Binary::start_with(
        "explain = true",
        &two_endpoints(&good.url(), &bad.url(), ""),
    )
    .await;
    assert_eq!(load(&hg.listen, Method::GET, 20, 1).await, 20);
    assert_eq!(hg.metric(&ejected(&bad.url())).await, 1.0);

    broken.store(false, Ordering::SeqCst);
    let before = bad.hits();
    // Steady traffic: within the longest first ejection (1.5 s) plus a
    // margin, a probe succeeds and the endpoint takes its share again.
    let mut probe_seen = false;
    let give_up = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let req = http::Request::get(format!("http://{}/x", hg.listen))
            .header("x-herdguard-explain", "1")
            .body(empty())
            .unwrap();
        let (status, headers, _) = send(&client(), req).await;
        assert_eq!(status, StatusCode::OK);
        let trace = &explained(&headers);
        probe_seen |= trace.contains("(probe)");
        if hg.metric(&ejected(&bad.url())).await == 0.0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < give_up,
            "never probed back in"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(probe_seen, "the probe is marked in the explain trace");
    let after = bad.hits();
    assert_eq!(load(&hg.listen, Method::GET, 20, 1).await, 20);
    assert!(
        bad.hits() >= after + 9,
        "back in rotation: {before} {after} {}",
        bad.hits()
    );
    hg.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_most_the_share_is_ejected_and_all_out_means_all_serve() {
    // Both endpoints broken (and the route's breaker, which would open
    // for an upstream failing as a whole, held off). By default at most
    // half of them go out.
    let lenient = "[defaults.breaker]\nconsecutive_failures = 1000\nmin_requests = 1000\n";
    let a = breakable(Arc::new(AtomicBool::new(true))).await;
    let b = breakable(Arc::new(AtomicBool::new(true))).await;
    let hg = Binary::start(&two_endpoints(&a.url(), &b.url(), lenient)).await;
    load(&hg.listen, Method::POST, 30, 1).await;
    let metrics = hg.metrics().await;
    let out = metric(&metrics, &ejected(&a.url())).unwrap()
        + metric(&metrics, &ejected(&b.url())).unwrap();
    assert_eq!(out, 1.0, "one of two may be out");
    hg.terminate().await;

    // A share of 1.0 lets both go out: then both still get traffic (panic
    // mode), not none.
    let a = breakable(Arc::new(AtomicBool::new(true))).await;
    let b = breakable(Arc::new(AtomicBool::new(true))).await;
    let outlier = format!("[upstreams.u.outlier]\nmax_ejected = 1.0\n{lenient}");
    let hg = Binary::start(&two_endpoints(&a.url(), &b.url(), &outlier)).await;
    load(&hg.listen, Method::POST, 20, 1).await;
    assert_eq!(hg.metric(&ejected(&a.url())).await, 1.0);
    assert_eq!(hg.metric(&ejected(&b.url())).await, 1.0);
    let (a0, b0) = (a.hits(), b.hits());
    load(&hg.listen, Method::POST, 20, 1).await;
    assert!(
        a.hits() >= a0 + 5 && b.hits() >= b0 + 5,
        "panic mode sends to all"
    );
    hg.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_that_hang_up_do_not_eject_an_endpoint() {
    // A slow endpoint: every caller gives up on it before it answers.
    let slow = upstream(|_| async {
        tokio::time::sleep(Duration::from_secs(2)).await;
        Response::new(full("late"))
    })
    .await;
    let good = ok_upstream("fine").await;
    let hg = Binary::start(&two_endpoints(&good.url(), &slow.url(), "")).await;
    for i in 0..40 {
        let req = http::Request::get(format!("http://{}/{i}", hg.listen))
            .body(empty())
            .unwrap();
        let _ = tokio::time::timeout(Duration::from_millis(50), client().request(req)).await;
    }
    let metrics = hg.metrics().await;
    assert_eq!(metric(&metrics, &ejections(&slow.url())), Some(0.0));
    assert_eq!(metric(&metrics, &ejected(&slow.url())), Some(0.0));
    hg.terminate().await;
}

#[tokio::test]
async fn bad_outlier_keys_are_named() {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        file.path(),
        "[upstreams.u]\nendpoints = [\"http://127.0.0.1:1\", \"http://127.0.0.1:2\"]\n\
         [upstreams.u.outlier]\nmax_ejected = 0\nejection_time = \"0s\"\n\
         [[routes]]\nname = \"r\"\nupstream = \"u\"\n",
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_herdguard"))
        .args(["check", "--config"])
        .arg(file.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("upstreams.u.outlier.max_ejected"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unkeyed_posts_are_not_spent_as_probes_while_gets_come() {
    let good = ok_upstream("fine").await;
    let posts = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = posts.clone();
    let bad = upstream(move |req| {
        let seen = seen.clone();
        async move {
            if req.method() == Method::POST {
                seen.fetch_add(1, Ordering::SeqCst);
            }
            let mut resp = Response::new(full("down"));
            *resp.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            resp
        }
    })
    .await;
    let hg = Binary::start(&two_endpoints(&good.url(), &bad.url(), "")).await;
    // A POST and a GET every 20 ms for 3 s: the endpoint's ejections run out
    // several times, and each time a GET should be the probe.
    let mut failed_posts = 0;
    for _ in 0..150 {
        failed_posts += 1 - load(&hg.listen, Method::POST, 1, 1).await;
        load(&hg.listen, Method::GET, 1, 1).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        hg.metric(&ejections(&bad.url())).await >= 2.0,
        "probed and ejected again"
    );
    let posts = posts.load(Ordering::SeqCst);
    assert!(posts <= 5, "{posts} POSTs reached the broken endpoint");
    assert_eq!(failed_posts, posts);
    hg.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_an_outage_of_all_endpoints_the_breaker_finds_a_healed_ejected_one() {
    let flags = [
        Arc::new(AtomicBool::new(true)),
        Arc::new(AtomicBool::new(true)),
    ];
    let a = breakable(flags[0].clone()).await;
    let b = breakable(flags[1].clone()).await;
    let hg = Binary::start(&two_endpoints(
        &a.url(),
        &b.url(),
        "[upstreams.u.outlier]\nejection_time = \"10s\"\nmax_ejection_time = \"20s\"\n",
    ))
    .await;
    // Both fail: one is ejected (at most half), then the route's breaker opens.
    load(&hg.listen, Method::GET, 40, 1).await;
    let which = if hg.metric(&ejected(&a.url())).await == 1.0 {
        0
    } else {
        1
    };
    let urls = [a.url(), b.url()];
    assert_eq!(
        hg.metric(&ejected(&urls[which])).await,
        1.0,
        "one is ejected"
    );
    assert!(hg.metric(OPENED).await >= 1.0);
    // The ejected one heals, the other stays broken: the breaker's probes
    // find it long before its 10 s ejection is over.
    flags[which].store(false, Ordering::SeqCst);
    let healed = tokio::time::Instant::now();
    loop {
        if load(&hg.listen, Method::GET, 1, 1).await == 1 {
            break;
        }
        assert!(healed.elapsed() < Duration::from_secs(5), "still dark");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    hg.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_a_reload_removes_takes_its_series_with_it() {
    let good = ok_upstream("fine").await;
    let bad = breakable(Arc::new(AtomicBool::new(true))).await;
    let other = ok_upstream("other").await;
    let hg = Binary::start(&two_endpoints(&good.url(), &bad.url(), "")).await;
    load(&hg.listen, Method::GET, 20, 1).await;
    assert_eq!(hg.metric(&ejected(&bad.url())).await, 1.0);
    hg.reload(&two_endpoints(&good.url(), &other.url(), ""));
    eventually(Duration::from_secs(10), "the reload is applied", || async {
        hg.metric("herdguard_config_reloads_total{result=\"ok\"}")
            .await
            == 1.0
    })
    .await;
    let text = hg.metrics().await;
    assert!(
        !text.contains(&bad.url()),
        "the removed endpoint's series are gone: {text}"
    );
    assert_eq!(metric(&text, &ejected(&other.url())), Some(0.0));
    assert_eq!(metric(&text, &ejected(&good.url())), Some(0.0));
    hg.terminate().await;
}

/// Three endpoints, the third answering everything in 1 s (within
/// per_try_timeout); `outlier` keys added to the upstream.
async fn one_slow_of_three(outlier: &str) -> (Binary, Upstream, usize, [Upstream; 2]) {
    let a = ok_upstream("a").await;
    let b = ok_upstream("b").await;
    let slow = upstream(|_| async {
        tokio::time::sleep(Duration::from_secs(1)).await;
        Response::new(full("slow"))
    })
    .await;
    let hg = Binary::start(&format!(
        "[upstreams.u]\nendpoints = [\"{}\", \"{}\", \"{}\"]\n{outlier}\n[[routes]]\nname = \"r\"\nupstream = \"u\"\n",
        a.url(),
        b.url(),
        slow.url()
    ))
    .await;
    // 600 GETs, 10 at a time.
    let ok = load(&hg.listen, Method::GET, 600, 10).await;
    (hg, slow, ok, [a, b])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_slow_endpoint_does_not_get_the_others_shed() {
    let (hg, slow, ok, _fast) = one_slow_of_three("").await;
    let shed = hg.metric("herdguard_shed_total{upstream=\"u\"}").await;
    eprintln!(
        "{ok} of 600 succeeded, {shed} shed, the slow endpoint got {}",
        slow.hits()
    );
    assert!(ok >= 590, "{ok} of 600 succeeded ({shed} shed)");
    assert!(
        hg.metric(&ejections(&slow.url())).await >= 1.0,
        "the slow endpoint is out"
    );
    assert!(slow.hits() <= 60, "the slow endpoint got {}", slow.hits());
    hg.terminate().await;
}
