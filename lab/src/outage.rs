//! The outage experiment: an upstream whose latency grows with its own
//! concurrency stalls for a while under many callers that retry naively, then
//! resumes. Does it come back, and how soon?
//!
//! The upstream answers in about 100 ms below 30 requests in flight, and 8%
//! slower per request above that (capped at 20 s). It never notices a caller
//! hanging up: work it started, it finishes. Callers send a request, wait up
//! to `caller_timeout`, and on any failure send again after a fixed
//! `retry_interval` — the retry loop found in many clients. Between
//! successes a caller thinks for `think`: 200 callers offer about 200
//! requests/s, which the upstream serves at about 20 in flight.
//!
//! Each setup runs the same script against a fresh upstream: callers direct;
//! through herdguard with retries but no budget, breaker or limit; through
//! herdguard with its defaults; and with its defaults but no adaptive limit.
//! Every second is recorded: the upstream's peak concurrency, the callers'
//! goodput and their timeouts.

use std::convert::Infallible;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::time::Instant;

use herdguard::app::Server;
use herdguard::config::Config;

/// What to run.
#[derive(Debug, Clone)]
pub struct Params {
    pub callers: usize,
    pub warmup: Duration,
    pub stall: Duration,
    pub after: Duration,
    pub caller_timeout: Duration,
    pub retry_interval: Duration,
    /// Pause between a caller's successful requests.
    pub think: Duration,
    /// herdguard sidecars in front of the upstream, the callers split evenly
    /// over them (the setups without a proxy ignore it).
    pub sidecars: usize,
    /// What the upstream does with work whose caller hung up.
    pub abandoned: Abandoned,
}

/// What the upstream does with a request whose caller hung up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Abandoned {
    /// Works it to the end: the stalled backlog must be worked off.
    Kept,
    /// Notices and drops it, as hyper, Go's net/http (through the request's
    /// context) and most servers that watch the connection do.
    Dropped,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            callers: 200,
            warmup: Duration::from_secs(5),
            stall: Duration::from_secs(10),
            after: Duration::from_secs(20),
            caller_timeout: Duration::from_secs(3),
            retry_interval: Duration::from_millis(100),
            think: Duration::from_secs(1),
            sidecars: 1,
            abandoned: Abandoned::Kept,
        }
    }
}

impl Params {
    /// The fleet experiment: 1,000 callers with a 2 s timeout and fixed
    /// 100 ms retries, split over `sidecars` sidecars, in front of an
    /// upstream that freezes for 10 s and drops the work of callers who
    /// left. Each caller thinks 5 s between successes: 200 requests/s, about
    /// 20 in flight at the upstream, one or two per sidecar of ten.
    pub fn fleet(sidecars: usize) -> Self {
        Self {
            callers: 1000,
            warmup: Duration::from_secs(5),
            stall: Duration::from_secs(10),
            after: Duration::from_secs(10),
            caller_timeout: Duration::from_secs(2),
            retry_interval: Duration::from_millis(100),
            think: Duration::from_secs(5),
            sidecars,
            abandoned: Abandoned::Dropped,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Setup {
    /// Callers straight to the upstream.
    Direct,
    /// Through herdguard with retries, but no budget, breaker or limit.
    NaiveProxy,
    /// Through herdguard with its built-in defaults.
    Defaults,
    /// Through herdguard with its defaults, adaptive limit off.
    NoAdaptive,
}

impl Setup {
    pub const ALL: [Setup; 4] = [
        Setup::Direct,
        Setup::NaiveProxy,
        Setup::Defaults,
        Setup::NoAdaptive,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Setup::Direct => "direct",
            Setup::NaiveProxy => "herdguard-naive",
            Setup::Defaults => "herdguard-defaults",
            Setup::NoAdaptive => "herdguard-no-adaptive",
        }
    }

    pub fn parse(text: &str) -> Option<Setup> {
        Setup::ALL
            .into_iter()
            .find(|s| s.name() == text || s.name().trim_start_matches("herdguard-") == text)
    }

    fn config(self, upstream: SocketAddr) -> Option<String> {
        let base = format!(
            "[listen]\naddress = \"127.0.0.1:0\"\n[admin]\naddress = \"127.0.0.1:0\"\n[upstreams.u]\nendpoints = [\"http://{upstream}\"]\n"
        );
        let route = "[[routes]]\nname = \"r\"\nupstream = \"u\"\n";
        match self {
            Setup::Direct => None,
            Setup::Defaults => Some(format!("{base}{route}")),
            Setup::NoAdaptive => Some(format!("{base}adaptive_concurrency = {{ enabled = false }}\n{route}")),
            Setup::NaiveProxy => Some(format!(
                "{base}max_in_flight = 1000000\nadaptive_concurrency = {{ enabled = false }}\n{route}\
                 retry = {{ budget = {{ ratio = 1.0, min_per_second = 1000000 }} }}\n\
                 breaker = {{ consecutive_failures = 4000000000, min_requests = 4000000000 }}\n"
            )),
        }
    }
}

/// One second of a run.
#[derive(Debug, Clone, Copy, Default)]
pub struct Second {
    pub t: u32,
    pub stalled: bool,
    pub upstream_peak: usize,
    pub goodput: u64,
    pub timeouts: u64,
    pub errors: u64,
    /// Requests the upstream received this second (0 in data from before it was recorded).
    pub upstream_attempts: u64,
}

#[derive(Debug, Clone)]
pub struct Report {
    pub setup: Setup,
    pub seconds: Vec<Second>,
    /// Goodput per second before the stall (the mean of the warm-up's later half).
    pub baseline: f64,
    pub peak_concurrency: usize,
    /// From resume until three seconds in a row reach 90% of the baseline.
    /// From resume to the first second with half the baseline's goodput.
    pub serving: Option<Duration>,
    /// From resume to three seconds in a row with 90% of it.
    pub recovery: Option<Duration>,
    /// The upstream's peak concurrency from the second it resumed on.
    pub peak_after_resume: usize,
    /// Requests the upstream received from the stall's start to its end.
    pub attempts_in_stall: u64,
    /// How many sidecars ran (0: none).
    pub sidecars: usize,
}

/// The upstream's shared state.
#[derive(Default)]
struct Upstream {
    in_flight: AtomicUsize,
    peak: AtomicUsize,
    received: AtomicU64,
}

/// Counts one request in flight at the upstream until dropped, finished or not.
struct Working(Arc<Upstream>);

impl Working {
    fn start(state: &Arc<Upstream>) -> Self {
        state.received.fetch_add(1, Ordering::SeqCst);
        let n = state.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        state.peak.fetch_max(n, Ordering::SeqCst);
        Self(state.clone())
    }
}

impl Drop for Working {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The work of one request: wait out a stall, then take the time the
/// concurrency at that moment gives.
async fn work(state: Arc<Upstream>, mut stalled: watch::Receiver<bool>) {
    let _working = Working::start(&state);
    let _ = stalled.wait_for(|s| !*s).await;
    let now = state.in_flight.load(Ordering::SeqCst);
    tokio::time::sleep(latency(now)).await;
}

/// Service time for a request that arrives with `n` in flight (itself included).
pub fn latency(n: usize) -> Duration {
    let excess = n.saturating_sub(30) as i32;
    Duration::from_secs_f64((0.1 * 1.08f64.powi(excess)).min(20.0))
}

async fn start_upstream(
    stalled: watch::Receiver<bool>,
    abandoned: Abandoned,
) -> (SocketAddr, Arc<Upstream>) {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let addr = listener.local_addr().expect("bound");
    let state = Arc::new(Upstream::default());
    let shared = state.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let (state, stalled) = (shared.clone(), stalled.clone());
            tokio::spawn(async move {
                let service = service_fn(move |_req: Request<Incoming>| {
                    let (state, stalled) = (state.clone(), stalled.clone());
                    async move {
                        match abandoned {
                            // Work of its own: a caller hanging up does not stop it.
                            Abandoned::Kept => {
                                let _ = tokio::spawn(work(state, stalled)).await;
                            }
                            // Dropped with the connection when the caller hangs up.
                            Abandoned::Dropped => work(state, stalled).await,
                        }
                        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (addr, state)
}

#[derive(Default)]
struct Counters {
    goodput: AtomicU64,
    timeouts: AtomicU64,
    errors: AtomicU64,
}

/// Runs one setup through warm-up, stall and recovery.
pub async fn run(setup: Setup, p: &Params) -> Report {
    let (stall_tx, stall_rx) = watch::channel(false);
    let (upstream_addr, upstream) = start_upstream(stall_rx, p.abandoned).await;
    let mut servers = Vec::new();
    if let Some(toml) = setup.config(upstream_addr) {
        for _ in 0..p.sidecars.max(1) {
            let config = Config::parse(&toml).expect("the lab's configs are valid");
            servers.push(
                Server::start(config)
                    .await
                    .expect("the proxy starts on loopback"),
            );
        }
    }
    let targets: Vec<SocketAddr> = if servers.is_empty() {
        vec![upstream_addr]
    } else {
        servers.iter().map(Server::proxy_addr).collect()
    };
    let urls: Vec<http::Uri> = targets
        .iter()
        .map(|t| format!("http://{t}/work").parse().expect("a loopback URL"))
        .collect();

    let counters = Arc::new(Counters::default());
    let stop = Arc::new(AtomicBool::new(false));
    let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(p.callers)
        .build_http();
    let mut callers = Vec::with_capacity(p.callers);
    for i in 0..p.callers {
        let (client, url, counters, stop, p) = (
            client.clone(),
            urls[i % urls.len()].clone(),
            counters.clone(),
            stop.clone(),
            p.clone(),
        );
        // Callers start spread over one think time, as a steady population would be.
        let offset = p.think.mul_f64(i as f64 / p.callers as f64);
        callers.push(tokio::spawn(async move {
            tokio::time::sleep(offset).await;
            while !stop.load(Ordering::Relaxed) {
                let req = Request::get(url.clone())
                    .body(Empty::new())
                    .expect("a valid request");
                let answer = tokio::time::timeout(p.caller_timeout, async {
                    let resp = client.request(req).await.ok()?;
                    let ok = resp.status().is_success();
                    resp.into_body().collect().await.ok()?;
                    Some(ok)
                })
                .await;
                let pause = match answer {
                    Ok(Some(true)) => {
                        counters.goodput.fetch_add(1, Ordering::Relaxed);
                        p.think
                    }
                    Ok(_) => {
                        counters.errors.fetch_add(1, Ordering::Relaxed);
                        p.retry_interval
                    }
                    Err(_) => {
                        counters.timeouts.fetch_add(1, Ordering::Relaxed);
                        p.retry_interval
                    }
                };
                tokio::time::sleep(pause).await;
            }
        }));
    }

    let total = p.warmup + p.stall + p.after;
    let start = Instant::now();
    let stall_at = start + p.warmup;
    let resume_at = stall_at + p.stall;
    let stall = tokio::spawn(async move {
        tokio::time::sleep_until(stall_at).await;
        let _ = stall_tx.send(true);
        tokio::time::sleep_until(resume_at).await;
        let _ = stall_tx.send(false);
        stall_tx
    });
    let mut seconds = Vec::new();
    for t in 1..=total.as_secs() as u32 {
        let tick = start + Duration::from_secs(u64::from(t));
        tokio::time::sleep_until(tick).await;
        seconds.push(Second {
            t,
            stalled: tick > stall_at && tick <= resume_at,
            upstream_peak: upstream
                .peak
                .swap(upstream.in_flight.load(Ordering::SeqCst), Ordering::SeqCst),
            goodput: counters.goodput.swap(0, Ordering::Relaxed),
            timeouts: counters.timeouts.swap(0, Ordering::Relaxed),
            errors: counters.errors.swap(0, Ordering::Relaxed),
            upstream_attempts: upstream.received.swap(0, Ordering::SeqCst),
        });
    }
    stop.store(true, Ordering::Relaxed);
    if let Ok(stall_tx) = stall.await {
        let _ = stall_tx.send(false);
    }
    for c in callers {
        c.abort();
    }
    let sidecars = servers.len();
    for server in servers {
        server.shutdown();
    }
    let mut report = Report::from_seconds(setup, seconds, p);
    report.sidecars = sidecars;
    report
}

impl Report {
    /// The report of a run of `p` from its seconds (as read back from CSV).
    pub fn from_seconds(setup: Setup, seconds: Vec<Second>, p: &Params) -> Report {
        let warm = p.warmup.as_secs() as usize;
        let baseline_seconds = &seconds[(warm / 2).min(seconds.len())..warm.min(seconds.len())];
        let baseline = if baseline_seconds.is_empty() {
            0.0
        } else {
            baseline_seconds
                .iter()
                .map(|s| s.goodput as f64)
                .sum::<f64>()
                / baseline_seconds.len() as f64
        };
        let resume = (p.warmup + p.stall).as_secs() as usize;
        // Real traffic again: the first second after resume with at least half
        // the baseline's goodput.
        let serving = (resume..seconds.len())
            .find(|&i| seconds[i].goodput as f64 >= 0.5 * baseline)
            .map(|i| Duration::from_secs((i - resume) as u64));
        let recovery = (resume..seconds.len().saturating_sub(2))
            .find(|&i| {
                seconds[i..i + 3]
                    .iter()
                    .all(|s| s.goodput as f64 >= 0.9 * baseline)
            })
            .map(|i| Duration::from_secs((i - resume) as u64));
        let stall = warm..resume.min(seconds.len());
        Report {
            setup,
            peak_concurrency: seconds.iter().map(|s| s.upstream_peak).max().unwrap_or(0),
            peak_after_resume: seconds
                .iter()
                .skip(resume)
                .map(|s| s.upstream_peak)
                .max()
                .unwrap_or(0),
            attempts_in_stall: seconds
                .get(stall)
                .map_or(0, |s| s.iter().map(|s| s.upstream_attempts).sum()),
            sidecars: 0,
            seconds,
            baseline,
            serving,
            recovery,
        }
    }

    pub fn csv(&self) -> String {
        let mut out = String::from(
            "t,stalled,upstream_peak_concurrency,goodput,timeouts,errors,upstream_attempts\n",
        );
        for s in &self.seconds {
            let _ = writeln!(
                out,
                "{},{},{},{},{},{},{}",
                s.t,
                u8::from(s.stalled),
                s.upstream_peak,
                s.goodput,
                s.timeouts,
                s.errors,
                s.upstream_attempts
            );
        }
        out
    }
}

/// Reads back what [`Report::csv`] wrote.
pub fn parse_csv(text: &str) -> Result<Vec<Second>, String> {
    let mut seconds = Vec::new();
    for (i, line) in text.lines().enumerate().skip(1) {
        let bad = |what: &str| format!("line {}: {what}: {line:?}", i + 1);
        let fields: Result<Vec<u64>, _> = line.split(',').map(str::parse::<u64>).collect();
        let fields = fields.map_err(|_| bad("expected whole numbers"))?;
        let (t, stalled, peak, goodput, timeouts, errors, attempts) = match fields[..] {
            [t, stalled, peak, goodput, timeouts, errors] => {
                (t, stalled, peak, goodput, timeouts, errors, 0)
            }
            [t, stalled, peak, goodput, timeouts, errors, attempts] => {
                (t, stalled, peak, goodput, timeouts, errors, attempts)
            }
            _ => return Err(bad(
                "expected t,stalled,upstream_peak_concurrency,goodput,timeouts,errors[,upstream_attempts]",
            )),
        };
        seconds.push(Second {
            t: u32::try_from(t).map_err(|_| bad("t is too large"))?,
            stalled: stalled != 0,
            upstream_peak: usize::try_from(peak).map_err(|_| bad("peak is too large"))?,
            goodput,
            timeouts,
            errors,
            upstream_attempts: attempts,
        });
    }
    Ok(seconds)
}

/// The side-by-side table of several runs.
pub fn table(reports: &[Report]) -> String {
    let mut out = format!(
        "{:<24} {:>14} {:>18} {:>20} {:>22}\n",
        "setup",
        "baseline req/s",
        "peak upstream conc.",
        "serving (50%) after",
        "recovery (90%) after"
    );
    let secs = |d: Option<Duration>| {
        d.map_or_else(
            || "not within the run".to_owned(),
            |d| format!("{} s", d.as_secs()),
        )
    };
    for r in reports {
        let _ = writeln!(
            out,
            "{:<24} {:>14.0} {:>18} {:>20} {:>22}",
            r.setup.name(),
            r.baseline,
            r.peak_concurrency,
            secs(r.serving),
            secs(r.recovery)
        );
    }
    out
}

/// The fleet table: one row per sidecar count.
pub fn fleet_table(reports: &[Report]) -> String {
    let mut out = format!(
        "{:<10} {:>14} {:>24} {:>20} {:>22} {:>26}\n",
        "sidecars",
        "baseline req/s",
        "peak conc. after resume",
        "serving (50%) after",
        "recovery (90%) after",
        "upstream attempts in stall"
    );
    // A second of data ends a second after it starts: 0 is \"within 1 s\".
    let ms = |d: Option<Duration>| {
        d.map_or_else(
            || "not within the run".to_owned(),
            |d| format!("within {} s", d.as_secs() + 1),
        )
    };
    for r in reports {
        let _ = writeln!(
            out,
            "{:<10} {:>14.0} {:>24} {:>20} {:>22} {:>26}",
            r.sidecars,
            r.baseline,
            r.peak_after_resume,
            ms(r.serving),
            ms(r.recovery),
            r.attempts_in_stall
        );
    }
    out
}
