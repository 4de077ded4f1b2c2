//! Bounded under hostile load, through the real binary: what a caller, an
//! upstream or a file can make the sidecar hold stays within its bounds, and
//! past them it sheds and counts rather than grows.

use crate::common;

use std::process::Stdio;
use std::time::Duration;

use common::process::Binary;
use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn one_route(url: &str) -> String {
    format!("[upstreams.u]\nendpoints = [\"{url}\"]\n[[routes]]\nname = \"r\"\nupstream = \"u\"\n")
}

/// Sends `GET path` on a connection of its own and reads the answer's head.
async fn get_path(listen: &str, path: &str) -> bool {
    let Ok(mut s) = tokio::net::TcpStream::connect(listen).await else {
        return false;
    };
    let request = format!("GET {path} HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n");
    if s.write_all(request.as_bytes()).await.is_err() {
        return false;
    }
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut got)).await;
    got.starts_with(b"HTTP/1.1 200")
}

/// stdout stalled (a pipe nobody reads) and requests with long paths: the
/// access log's queue is bounded in bytes, so memory stays put and the lines
/// past the bound are dropped and counted, whatever the path's length.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_access_log_holds_its_bound_in_bytes() {
    let up = ok_upstream("ok").await;
    let toml = format!(
        "[access_log]\nenabled = true\nformat = \"json\"\n{}",
        one_route(&up.url())
    );
    for (path_len, requests) in [(60_000, 2_500), (5_000, 5_000)] {
        let hg = Binary::start_adjusted("", &toml, |cmd| {
            cmd.stdout(Stdio::piped());
        })
        .await;
        let start = hg.rss_kib();
        let path = format!("/{}", "p".repeat(path_len));
        let mut answered = 0;
        for _ in 0..requests / 50 {
            let gets = (0..50).map(|_| get_path(&hg.listen, &path));
            answered += futures_util::future::join_all(gets)
                .await
                .into_iter()
                .filter(|ok| *ok)
                .count();
        }
        assert_eq!(answered, requests, "every request answered");
        let dropped = hg.metric("herdguard_access_log_dropped_total").await;
        assert!(dropped > 0.0, "lines past the bound are counted as dropped");
        let peak_mib = hg.peak_rss_kib() / 1024;
        let grown_mib = peak_mib.saturating_sub(start / 1024);
        eprintln!("{path_len}-byte paths: RSS {start} KiB at start, peak {peak_mib} MiB, {dropped} lines dropped");
        // The queue holds 4 MiB of lines, each path cut to 2 KiB; the rest
        // is the requests themselves, 50 at a time. Unbounded, the lines
        // alone would be 2,500 x 60 KB = 150 MB.
        assert!(
            grown_mib <= 40 && peak_mib <= 64,
            "{path_len}-byte paths: peak RSS {peak_mib} MiB, grown by {grown_mib} MiB"
        );
    }
}
