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
        assert!(after.contains("herdguard_requests_total{route=\"r1\",code=\"200\"} 1"));
        assert_eq!(series(&after), before, "{after}");
        eprintln!(
            "round {round}: RSS {rss_before} KiB with 2 routes, {} KiB with 10,000, {} KiB with 2 again",
            peaks[peaks.len() - 1],
            hg.rss_kib()
        );
    }
    // What the allocator keeps of a big config it reuses for the next one:
    // nothing leaks from round to round. (How much it gives back to the
    // system varies with which threads freed what: see the README.)
    let (first, second) = (peaks[0], peaks[1]);
    assert!(
        second <= first + first / 4,
        "the second round took more: {first} KiB, then {second} KiB"
    );
    hg.terminate().await;
}
