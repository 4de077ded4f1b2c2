//! Metric series follow the config: a reload that removes routes removes
//! their series and gives their memory back.

use crate::common;

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

/// Waits until the running config has route `r999` (or has not).
async fn reloaded(hg: &Binary, big: bool) {
    eventually(Duration::from_secs(60), "the reload is applied", || async {
        hg.metrics().await.contains("route=\"r999\"") == big
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

    // Two rounds of 2 -> 1,000 -> 2 routes.
    let mut peaks = Vec::new();
    for round in 1..=2 {
        hg.reload(&routes(&up.url(), 1_000));
        reloaded(&hg, true).await;
        let big = hg.metrics().await;
        assert!(
            series(&big) > 100 * before,
            "{} series with 1,000 routes",
            series(&big)
        );
        assert!(big.contains("route=\"r999\""));
        peaks.push(hg.rss_kib());

        hg.reload(&routes(&up.url(), 2));
        reloaded(&hg, false).await;
        let after = hg.metrics().await;
        assert!(
            !after.contains("route=\"r999\""),
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
            "round {round}: RSS {rss_before} KiB with 2 routes, {peak} KiB with 1,000, {now} KiB with 2 again"
        );
        assert!(now <= bound, "{now} KiB kept, more than {bound} KiB");
    }
    hg.terminate().await;
}

/// Threads rendering `/metrics` in the process now.
fn renders(pid: u32) -> usize {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        // A thread's name is cut to 15 bytes there.
        .filter(|name| "herdguard-metrics".starts_with(name.trim()) && name.trim().len() == 15)
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_scrapes_do_not_render_side_by_side() {
    let up = ok_upstream("fine").await;
    let hg = Binary::start(&routes(&up.url(), 1_000)).await;
    // Twenty HTTP/2 scrapes, each reset soon after it is sent: each
    // render goes on, and the next must wait for it.
    let h2 = h2c_client();
    let (mut most, mut abandoned) = (0, 0);
    for _ in 0..20 {
        let req = http::Request::get(format!("http://{}/metrics", hg.admin))
            .body(empty())
            .unwrap();
        // A page still being sent may be shared at once; a render takes longer.
        let scrape = tokio::time::timeout(Duration::from_millis(20), h2.request(req)).await;
        abandoned += usize::from(scrape.is_err());
        most = most.max(renders(hg.pid()));
    }
    assert!(abandoned >= 10, "{abandoned} scrapes abandoned mid-render");
    assert!(most <= 2, "{most} renders at once");
    // And a scrape that waits gets its answer.
    assert!(hg.metrics().await.contains("route=\"r999\""));
    hg.terminate().await;
}

/// Slow scrapers each spaced past the second a page is shared for hold at
/// most two pages between them: once the last two are both still being
/// sent, a new scrape gets the newer. A page of 1,000 routes is megabytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_scrapers_hold_at_most_two_pages() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let up = ok_upstream("fine").await;
    let hg = Binary::start(&routes(&up.url(), 1_000)).await;
    // The admin connections counted when each page was rendered: one
    // more for each page rendered afresh.
    let mut seen = Vec::new();
    let mut held = Vec::new();
    for _ in 0..4 {
        // A small receive window: the page cannot all go into the kernel.
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(16 * 1024).unwrap();
        let mut conn = socket.connect(hg.admin.parse().unwrap()).await.unwrap();
        conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
            .await
            .unwrap();
        // The first 64 KiB, then nothing more read: the rest waits unsent.
        let mut head = vec![0u8; 64 * 1024];
        let mut got = 0;
        while got < head.len() {
            let n = conn.read(&mut head[got..]).await.unwrap();
            assert!(n > 0, "the page is longer");
            got += n;
        }
        let text = String::from_utf8_lossy(&head);
        let accepted = metric(
            &text,
            r#"herdguard_connections_accepted_total{listener="admin"}"#,
        )
        .expect("the listeners' series come first");
        seen.push(accepted);
        held.push(conn);
        // Past the second a page is shared for regardless.
        tokio::time::sleep(Duration::from_millis(1_200)).await;
    }
    assert_eq!(seen[0] + 1.0, seen[1], "a second page, rendered afresh");
    assert_eq!(&seen[2..], &[seen[1], seen[1]], "then the newer is shared");
    drop(held);
    hg.terminate().await;
}
