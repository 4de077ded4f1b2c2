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

/// Waits until the running config has route `r9999` (or has not).
async fn reloaded(hg: &Binary, big: bool) {
    eventually(Duration::from_secs(60), "the reload is applied", || async {
        hg.metrics().await.contains("route=\"r9999\"") == big
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

    // Two rounds of 2 -> 10,000 -> 2 routes.
    let mut peaks = Vec::new();
    for round in 1..=2 {
        hg.reload(&routes(&up.url(), 10_000));
        reloaded(&hg, true).await;
        let big = hg.metrics().await;
        assert!(
            series(&big) > 100 * before,
            "{} series with 10,000 routes",
            series(&big)
        );
        assert!(big.contains("route=\"r9999\""));
        peaks.push(hg.rss_kib());

        hg.reload(&routes(&up.url(), 2));
        reloaded(&hg, false).await;
        let after = hg.metrics().await;
        assert!(
            !after.contains("route=\"r9999\""),
            "a removed route's series are gone"
        );
        // The routes that stayed kept their counts.
        assert!(after
            .contains("herdguard_requests_total{route=\"r1\",code=\"200\",source=\"upstream\"} 1"));
        assert_eq!(series(&after), before, "{after}");
        // What the big config took goes back to the system within seconds,
        // even with no traffic: RSS within 10% of where it started (glibc's
        // malloc untrimmed returned none of it; see the README).
        let peak = peaks[peaks.len() - 1];
        let bound = rss_before + rss_before / 10;
        let mut now = hg.rss_kib();
        let deadline = std::time::Instant::now() + Duration::from_secs(40);
        while now > bound && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(250)).await;
            now = hg.rss_kib();
        }
        eprintln!(
            "round {round}: RSS {rss_before} KiB with 2 routes, {peak} KiB with 10,000, {now} KiB with 2 again"
        );
        assert!(now <= bound, "{now} KiB kept, more than {bound} KiB");
    }
    hg.terminate().await;
}
