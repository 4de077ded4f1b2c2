//! Admission through the real binary: the adaptive limit follows what the
//! traffic uses, and healthy traffic is served, not shed, when it grows.

use crate::common;

use std::time::Duration;

use common::process::Binary;
use common::*;

/// herdguard with one route to `up`, its upstream `u` given `keys`.
async fn one_route(up: &Upstream, keys: &str) -> Binary {
    Binary::start(&format!(
        "[upstreams.u]\nendpoints = [\"{}\"]\n{keys}\n\
         [[routes]]\nname = \"r\"\nupstream = \"u\"\n",
        up.url()
    ))
    .await
}

/// Sixteen callers asking `hg` one after another until `until`, each
/// request for one of `paths` at random; gives back (answered, refused).
async fn sixteen_callers(hg: &Binary, paths: &[&str], until: tokio::time::Instant) -> (u32, u32) {
    let each = futures_util::future::join_all((0..16u64).map(|c| {
        let client = client();
        async move {
            let mut seed = 0x9e37_79b9_7f4a_7c15 ^ (c + 1);
            let (mut ok, mut refused) = (0, 0);
            while tokio::time::Instant::now() < until {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                let path = paths[seed as usize % paths.len()];
                match get(client.clone(), format!("http://{}{path}", hg.listen)).await {
                    Some(http::StatusCode::OK) => ok += 1,
                    _ => refused += 1,
                }
            }
            (ok, refused)
        }
    }))
    .await;
    each.into_iter().fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
}

/// A GET's status, or `None` when it failed.
async fn get(client: TestClient, url: String) -> Option<http::StatusCode> {
    let req = http::Request::get(url).body(empty()).unwrap();
    client.request(req).await.map(|r| r.status()).ok()
}

/// A burst onto a sidecar whose limit stands at what light traffic used
/// (about 2 x 2 + 2), in front of a slow but healthy upstream (1 s): the burst
/// waits for the limit to grow by slow start (a round trip per tripling)
/// and is served whole; nothing is shed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_onto_a_lightly_used_sidecar_is_served_not_shed() {
    let up = upstream(|_req| async {
        tokio::time::sleep(Duration::from_secs(1)).await;
        http::Response::new(full("ok"))
    })
    .await;
    let hg = one_route(&up, "").await;
    let url = format!("http://{}/", hg.listen);
    // Light use for six seconds: two callers, one request at a time each.
    let light = tokio::time::Instant::now() + Duration::from_secs(6);
    let one = |client: TestClient, url: String| async move {
        while tokio::time::Instant::now() < light {
            assert_eq!(
                get(client.clone(), url.clone()).await,
                Some(http::StatusCode::OK)
            );
        }
    };
    tokio::join!(one(client(), url.clone()), one(client(), url.clone()));
    let limit = hg
        .metric(r#"herdguard_concurrency_limit{upstream="u"}"#)
        .await;
    assert!(limit <= 8.0, "the limit follows the use: {limit}");
    // Then 64 callers at once, each sending two requests in a row.
    let burst = (0..64).map(|_| {
        let (client, url) = (client(), url.clone());
        async move {
            let mut ok = 0;
            for _ in 0..2 {
                ok += usize::from(
                    get(client.clone(), url.clone()).await == Some(http::StatusCode::OK),
                );
            }
            ok
        }
    });
    let ok: usize = futures_util::future::join_all(burst)
        .await
        .into_iter()
        .sum();
    let shed = hg.metric(r#"herdguard_shed_total{upstream="u"}"#).await;
    eprintln!("limit {limit} before the burst; {ok}/128 answered, {shed} shed");
    assert_eq!(shed, 0.0, "nothing shed");
    assert_eq!(ok, 128, "every request of the burst answered");
}

/// Callers that take their time reading long answers hold their slots
/// until their bodies are out, though the upstream answered them at once:
/// the adaptive limit, which measures the time to an answer's head, must
/// not count them as requests the upstream is working on. Before, the
/// limit came down to what the quiet seconds used (2) under the six
/// answers being read, and every other caller was shed until they ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_reading_long_answers_do_not_shut_others_out() {
    use tokio::io::AsyncWriteExt as _;
    const READERS: usize = 6;
    let big = bytes::Bytes::from(vec![b'x'; 4 << 20]);
    let up = upstream(move |req| {
        let body = match req.uri().path() {
            "/big" => big.clone(),
            _ => bytes::Bytes::from_static(b"ok"),
        };
        async move { http::Response::new(full(body)) }
    })
    .await;
    let hg = one_route(&up, "").await;
    let small = format!("http://{}/small", hg.listen);
    let client = client();
    assert_eq!(
        get(client.clone(), small.clone()).await,
        Some(http::StatusCode::OK)
    );
    // Six callers ask for 4 MiB each and read it at 80 KB/s, 4 KiB at a
    // time: their answers take about 50 s.
    let stop = std::sync::Arc::new(tokio::sync::Notify::new());
    let mut readers = Vec::new();
    for _ in 0..READERS {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(4096).unwrap();
        let mut s = socket.connect(hg.listen.parse().unwrap()).await.unwrap();
        s.write_all(b"GET /big HTTP/1.1\r\nHost: a\r\n\r\n")
            .await
            .unwrap();
        let stop = stop.clone();
        readers.push(tokio::spawn(async move {
            use tokio::io::AsyncReadExt as _;
            let mut buf = vec![0; 4096];
            let read = async {
                let mut total = 0;
                while let Ok(n @ 1..) = s.read(&mut buf).await {
                    total += n;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                total
            };
            tokio::select! {
                total = read => Some(total),
                _ = stop.notified() => None,
            }
        }));
    }
    eventually(
        Duration::from_secs(10),
        "the answers are under way",
        || async { hg.metric(r#"herdguard_in_flight{upstream="u"}"#).await == READERS as f64 },
    )
    .await;
    // Quiet, but for the readers, over two of the limit's use periods.
    let quiet = tokio::time::Instant::now() + Duration::from_secs(11);
    let mut limit = f64::MAX;
    while tokio::time::Instant::now() < quiet {
        let now = hg
            .metric(r#"herdguard_concurrency_limit{upstream="u"}"#)
            .await;
        limit = limit.min(now);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // Then another caller, a request at a time: served, nothing shed.
    let mut ok = 0;
    for _ in 0..20 {
        ok += usize::from(get(client.clone(), small.clone()).await == Some(http::StatusCode::OK));
    }
    let shed = hg.metric(r#"herdguard_shed_total{upstream="u"}"#).await;
    let in_flight = hg.metric(r#"herdguard_in_flight{upstream="u"}"#).await;
    eprintln!("lowest limit {limit}; {ok}/20 answered, {shed} shed, {in_flight} in flight");
    assert_eq!(in_flight, READERS as f64, "the readers' answers still read");
    assert_eq!(
        (ok, shed),
        (20, 0.0),
        "the other caller served, nothing shed"
    );
    stop.notify_waiters();
    for reader in readers {
        assert_eq!(reader.await.unwrap(), None, "a reader's answer ended early");
    }
}

/// Long answers (streams) holding every slot of `max_in_flight`: a request
/// beside them is shed at once, not after waiting for a slot as long as
/// the adaptive limit lets one wait (here the 5 s most, after heads that
/// take a second), since a wait frees none of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_beside_streams_holding_max_in_flight_is_shed_at_once() {
    use tokio::io::AsyncWriteExt as _;
    let up = upstream(|req: http::Request<hyper::body::Incoming>| async move {
        tokio::time::sleep(Duration::from_secs(1)).await;
        if req.uri().path() == "/stream" {
            // A head and a byte, then a body that never ends.
            use futures_util::StreamExt as _;
            use http_body_util::BodyExt as _;
            let first = hyper::body::Frame::data(bytes::Bytes::from_static(b"x"));
            let frames = futures_util::stream::iter([Ok::<_, std::convert::Infallible>(first)])
                .chain(futures_util::stream::pending());
            let body = http_body_util::StreamBody::new(frames);
            return http::Response::new(body.map_err(|never| match never {}).boxed());
        }
        http::Response::new(full("ok"))
    })
    .await;
    let hg = one_route(&up, "max_in_flight = 2").await;
    let url = format!("http://{}/", hg.listen);
    assert_eq!(get(client(), url.clone()).await, Some(http::StatusCode::OK));
    let mut streams = Vec::new();
    for _ in 0..2 {
        let mut s = tokio::net::TcpStream::connect(&hg.listen).await.unwrap();
        s.write_all(b"GET /stream HTTP/1.1\r\nHost: a\r\n\r\n")
            .await
            .unwrap();
        assert!(read_head(&mut s).await, "the stream's head");
        streams.push(s);
    }
    let started = tokio::time::Instant::now();
    let status = get(client(), url).await;
    let waited = started.elapsed();
    assert_eq!(status, Some(http::StatusCode::SERVICE_UNAVAILABLE));
    assert!(waited < Duration::from_secs(2), "shed after {waited:?}");
    drop(streams);
}

/// An upstream with a fast path (5 ms) and a slow one (100 ms), sixteen
/// callers each asking one or the other at random, that gets five times
/// slower on both, not queueing (a deploy, a cold cache). Each answer is
/// held against its own path's latency: the limit shrinks at first, then
/// follows within seconds, and the callers are served, none shed. Held
/// against one latency for the whole upstream, the fast path's answers,
/// five times slower, were still within the tolerance of the mix's and grew
/// the limit back: it stayed under the callers, shedding, until the old
/// latency aged out a minute later. (Milliseconds, not one: on a machine
/// whose cores the test shares, the scheduler's own delays are a
/// millisecond or more, and the upstream here shares them.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mixed_path_upstream_that_got_slower_is_followed() {
    use std::sync::atomic::{AtomicU64, Ordering};
    let _heavy = heavy().await;
    let slower = std::sync::Arc::new(AtomicU64::new(1));
    let times = slower.clone();
    let up = upstream(move |req| {
        let ms = match req.uri().path().starts_with("/api/v1/fast/") {
            true => 5,
            false => 100,
        };
        let ms = ms * times.load(Ordering::Relaxed);
        async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            http::Response::new(full("ok"))
        }
    })
    .await;
    let hg = one_route(&up, "").await;
    // One versioned API: the paths are told apart past it.
    let callers = |until| sixteen_callers(&hg, &["/api/v1/fast/1", "/api/v1/slow/2"], until);
    let now = tokio::time::Instant::now;
    // Seven seconds as usual: each path's latency is known (a span of 3 s).
    let (ok, refused) = callers(now() + Duration::from_secs(7)).await;
    assert_eq!(refused, 0, "{ok} answered as usual");
    slower.store(5, Ordering::Relaxed);
    // The limit follows: all sixteen let through and nothing shed for two
    // seconds running, within 30 s.
    let shed_total = || hg.metric(r#"herdguard_shed_total{upstream="u"}"#);
    let limit = || hg.metric(r#"herdguard_concurrency_limit{upstream="u"}"#);
    let settled_by = now() + Duration::from_secs(30);
    let (mut settling, mut calm) = ((0, 0), 0);
    while calm < 2 {
        assert!(
            now() < settled_by,
            "not followed 30 s on: {settling:?} (answered, refused)"
        );
        let before = shed_total().await;
        let (ok, refused) = callers(now() + Duration::from_secs(1)).await;
        settling = (settling.0 + ok, settling.1 + refused);
        let held = shed_total().await > before || limit().await < 16.0;
        calm = if held { 0 } else { calm + 1 };
    }
    // Then six seconds watched.
    let shed_before = shed_total().await;
    let watched = callers(now() + Duration::from_secs(6)).await;
    let shed = shed_total().await - shed_before;
    let limit = limit().await;
    eprintln!(
        "while it settled: {settling:?} (answered, refused); then {watched:?}, {shed} shed, limit {limit}"
    );
    assert_eq!(
        (watched.1, shed),
        (0, 0.0),
        "callers served, none shed, once it followed (limit {limit})"
    );
    assert!(limit >= 16.0, "the limit lets all sixteen through: {limit}");
    let paths = hg.metric(r#"herdguard_limit_paths{upstream="u"}"#).await;
    assert_eq!(paths, 2.0, "each path's latency tracked");
    let untracked = hg
        .metric(r#"herdguard_limit_paths_untracked_total{upstream="u"}"#)
        .await;
    assert_eq!(untracked, 0.0, "every answer found room");
}

/// A caller asking for many paths fills the adaptive limit's table of
/// paths, never past its 64; answers on a path that then finds no room are
/// counted, and that path, with more traffic than the trickle to the 64,
/// is given room within a span or two (3 s each).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_limits_table_of_paths_is_bounded_and_makes_room_for_real_traffic() {
    let _heavy = heavy().await;
    let up = upstream(|_req| async { http::Response::new(full("ok")) }).await;
    let hg = one_route(&up, "").await;
    let base = format!("http://{}", hg.listen);
    let client = client();
    let paths = || hg.metric(r#"herdguard_limit_paths{upstream="u"}"#);
    let untracked = || hg.metric(r#"herdguard_limit_paths_untracked_total{upstream="u"}"#);
    let ask = |path: String, n: usize| {
        let client = client.clone();
        async move {
            for _ in 0..n {
                let status = get(client.clone(), path.clone()).await;
                assert_eq!(status, Some(http::StatusCode::OK));
            }
        }
    };
    let start = tokio::time::Instant::now();
    let deadline = start + Duration::from_secs(30);
    // 64 paths, 20 answers each, then a trickle to them past the first
    // span (3 s): each has a baseline.
    let mut round = 0;
    while round == 0 || start.elapsed() < Duration::from_millis(3500) {
        for p in 0..64 {
            ask(format!("{base}/p{p}/x"), if round == 0 { 20 } else { 1 }).await;
        }
        round += 1;
    }
    assert_eq!(paths().await, 64.0, "all 64 tracked");
    // A path with real traffic beside the trickle (eight in nine answers):
    // no room at first, its answers counted; then room is made for it, and
    // they are no longer.
    let mut before = untracked().await;
    let mut grew = false;
    loop {
        assert!(tokio::time::Instant::now() < deadline, "no room made");
        ask(format!("{base}/heavy/y"), 512).await;
        for p in 0..64 {
            ask(format!("{base}/p{p}/x"), 1).await;
        }
        let now = paths().await;
        assert!(now <= 64.0, "{now} paths");
        let after = untracked().await;
        match after > before {
            true => grew = true,
            false if grew => break,
            false => {}
        }
        before = after;
    }
}

/// A sidecar kept from its CPU by a CPU limit (a cgroup quota of 5 ms each
/// 100 ms: a sidecar given `cpu: 50m`, as Kubernetes sets it) while
/// sixteen callers ask more of it, in front of a healthy 5 ms upstream:
/// its answers look slower by the time its own threads waited to run (up
/// to 95 ms each period), which is not the upstream's latency. The limit
/// holds; callers are slower, none is shed. Held against the upstream, the
/// same wait shrank the limit under the callers (20 to 11-13) and shed
/// 18-29 of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sidecar_kept_from_its_cpu_does_not_shed_for_its_own_wait() {
    let _heavy = heavy().await;
    let up = upstream(|_req| async {
        tokio::time::sleep(Duration::from_millis(5)).await;
        http::Response::new(full("ok"))
    })
    .await;
    let hg = one_route(&up, "").await;
    let callers = |for_| sixteen_callers(&hg, &["/a/b"], tokio::time::Instant::now() + for_);
    // The upstream's latency is known (a span of 3 s).
    let (ok, refused) = callers(Duration::from_secs(5)).await;
    assert_eq!(refused, 0, "{ok} answered as usual");
    let limit = || hg.metric(r#"herdguard_concurrency_limit{upstream="u"}"#);
    let before = limit().await;
    let shed_total = || hg.metric(r#"herdguard_shed_total{upstream="u"}"#);
    let shed_before = shed_total().await;
    let quota = CpuQuota::set(hg.pid(), 5_000, 100_000);
    let starved = callers(Duration::from_secs(8)).await;
    let throttled = quota.throttled();
    drop(quota);
    let shed = shed_total().await - shed_before;
    let excused = hg
        .metric(r#"herdguard_limit_own_wait_windows_total{upstream="u"}"#)
        .await;
    let after = limit().await;
    eprintln!(
        "kept from its CPU ({throttled} periods throttled): {starved:?} (answered, refused), {shed} shed, limit {before} then {after}, {excused} windows its own wait"
    );
    assert!(throttled > 0, "the quota held the sidecar back");
    assert!(excused > 0.0, "the sidecar's wait was seen");
    assert_eq!((starved.1, shed), (0, 0.0), "none shed (limit {after})");
}

/// A process held to a CPU quota in a cgroup of its own (cgroup v1's `cpu`
/// controller or v2's), put back and the cgroup removed on drop.
struct CpuQuota {
    dir: std::path::PathBuf,
    parent: std::path::PathBuf,
    v2: bool,
}

impl CpuQuota {
    fn set(pid: u32, quota_us: u32, period_us: u32) -> CpuQuota {
        let root = std::path::Path::new("/sys/fs/cgroup");
        let v2 = root.join("cgroup.controllers").exists();
        let parent = match v2 {
            true => root.to_path_buf(),
            false => root.join("cpu"),
        };
        let write = |file: &std::path::Path, what: &str| {
            std::fs::write(file, what).unwrap_or_else(|e| panic!("{}: {e}", file.display()))
        };
        if v2 {
            write(&parent.join("cgroup.subtree_control"), "+cpu");
        }
        let dir = parent.join(format!("herdguard-test-{pid}"));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        match v2 {
            true => write(&dir.join("cpu.max"), &format!("{quota_us} {period_us}")),
            false => {
                write(&dir.join("cpu.cfs_period_us"), &period_us.to_string());
                write(&dir.join("cpu.cfs_quota_us"), &quota_us.to_string());
            }
        }
        write(&dir.join("cgroup.procs"), &pid.to_string());
        CpuQuota { dir, parent, v2 }
    }

    /// Periods in which the quota ran out.
    fn throttled(&self) -> u64 {
        let stat = std::fs::read_to_string(self.dir.join("cpu.stat")).unwrap();
        stat.lines()
            .find_map(|l| l.strip_prefix("nr_throttled "))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for CpuQuota {
    fn drop(&mut self) {
        let procs = std::fs::read_to_string(self.dir.join("cgroup.procs")).unwrap_or_default();
        for pid in procs.lines() {
            let _ = std::fs::write(self.parent.join("cgroup.procs"), pid);
        }
        let _ = std::fs::remove_dir(&self.dir);
        let _ = self.v2;
    }
}
