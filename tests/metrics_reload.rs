//! Metric series follow the config: a reload that removes routes removes
//! their series and gives their memory back.

mod common;

use std::time::Duration;

use common::process::Binary;
use common::*;

fn routes(upstream: &str, n: usize) -> String {
    let mut toml = format!("[upstreams.u]\nendpoints = [\"{upstream}\"]\n");
    for i in 0..n {
        toml.push_str(&format!(
            "[[routes]]\nname = \"r{i}\"\nupstream = \"u\"\nmatch = {{ path_prefix = \"/r{i}/\" }}\n"
        ));
    }
    toml
}

fn series(text: &str) -> usize {
    text.lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .count()
}

async fn reloaded(hg: &Binary, count: f64) {
    eventually(Duration::from_secs(60), "the reload is applied", || async {
        hg.metric("herdguard_config_reloads_total{result=\"ok\"}")
            .await
            >= count
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_to_fewer_routes_drops_their_series_and_memory() {
    let up = ok_upstream("fine").await;
    let hg = Binary::start(&routes(&up.url(), 2)).await;
    let hit = |path: &'static str| {
        let req = http::Request::get(format!("http://{}{path}", hg.listen))
            .body(empty())
            .unwrap();
        async move { send(&client(), req).await.0 }
    };
    assert_eq!(hit("/r1/x").await, http::StatusCode::OK);
    let before = series(&hg.metrics().await);
    let rss_before = hg.rss_kib();

    hg.reload(&routes(&up.url(), 10_000));
    reloaded(&hg, 1.0).await;
    let big = hg.metrics().await;
    assert!(
        series(&big) > 100 * before,
        "{} series with 10,000 routes",
        series(&big)
    );
    assert!(big.contains("route=\"r9999\""));
    let rss_big = hg.rss_kib();

    hg.reload(&routes(&up.url(), 2));
    reloaded(&hg, 2.0).await;
    let after = hg.metrics().await;
    assert!(
        !after.contains("route=\"r9999\""),
        "a removed route's series are gone"
    );
    // The routes that stayed kept their counts.
    assert!(after.contains("herdguard_requests_total{route=\"r1\",code=\"200\"} 1"));
    assert_eq!(series(&after), before, "{after}");
    // Freed memory goes back to the system as the allocator gets to it:
    // give it a few requests and a few seconds. What the allocator keeps
    // for reuse stays (see the README's memory figures): at least 80% of
    // what the 10,000 routes took must be back.
    let given_back = |rss: u64| (rss_big - rss) * 5 >= (rss_big - rss_before) * 4;
    let mut rss_after = hg.rss_kib();
    for _ in 0..50 {
        if given_back(rss_after) {
            break;
        }
        assert_eq!(hit("/r1/x").await, http::StatusCode::OK);
        tokio::time::sleep(Duration::from_millis(100)).await;
        rss_after = hg.rss_kib();
    }
    eprintln!("RSS: {rss_before} KiB with 2 routes, {rss_big} KiB with 10,000, {rss_after} KiB with 2 again");
    assert!(
        given_back(rss_after),
        "RSS {rss_before} KiB -> {rss_big} KiB -> {rss_after} KiB"
    );
    hg.terminate().await;
}
