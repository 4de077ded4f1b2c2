//! `herdguard demo`: a flaky API, herdguard with its default policies in
//! front of it, and a bounded load of callers — then what the proxy absorbed.
//!
//! The upstream fails like a real flaky API: some 503s (a third of them with
//! `Retry-After: 1`), some connections reset before any answer, and an outage
//! of a few seconds in the middle of the run in which it resets everything.
//!
//! Callers send on a fixed schedule, answered or not, so a quick failure does
//! not bring the next request forward: every part of the run weighs by its
//! length, and the report gives the parts before, during and after the
//! outage apart.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rand::Rng;
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio::time::{Instant, MissedTickBehavior};

use crate::app::Server;
use crate::config::Config;
use crate::observe::access_log;

#[derive(Debug, Clone)]
pub struct Params {
    pub callers: usize,
    pub duration: Duration,
    /// When the outage starts, from the beginning of the run, and how long it lasts.
    pub outage_at: Duration,
    pub outage_for: Duration,
    /// Share of requests answered 503 outside the outage.
    pub error_rate: f64,
    /// Share of connections reset before an answer outside the outage.
    pub reset_rate: f64,
    /// How often each caller sends, whether or not its last request was
    /// answered: the load does not depend on how the proxy answers, so a quick
    /// failure does not bring the next request forward. Callers do not retry:
    /// herdguard does.
    pub interval: Duration,
    /// Turns the access log on, into this file (see [`access_log::write_to`]).
    pub access_log: Option<std::path::PathBuf>,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            callers: 16,
            duration: Duration::from_secs(15),
            outage_at: Duration::from_secs(6),
            outage_for: Duration::from_secs(3),
            error_rate: 0.10,
            reset_rate: 0.03,
            interval: Duration::from_millis(100),
            access_log: None,
        }
    }
}

/// A part of the run, as the outage divides it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Before,
    Outage,
    After,
}

impl Phase {
    pub const ALL: [Phase; 3] = [Phase::Before, Phase::Outage, Phase::After];

    /// The phase `since_start` into a run of `p`. Without an outage, the whole run is `Before`.
    pub fn at(p: &Params, since_start: Duration) -> Phase {
        if p.outage_for.is_zero() || since_start < p.outage_at {
            Phase::Before
        } else if since_start < p.outage_at + p.outage_for {
            Phase::Outage
        } else {
            Phase::After
        }
    }

    /// The phases a run of `p` has, in order.
    pub fn in_run(p: &Params) -> impl Iterator<Item = Phase> + '_ {
        let outage = !p.outage_for.is_zero();
        Phase::ALL.into_iter().filter(move |phase| match phase {
            Phase::Before => true,
            Phase::Outage => outage && p.outage_at < p.duration,
            Phase::After => outage && p.outage_at + p.outage_for < p.duration,
        })
    }

    fn index(self) -> usize {
        self as usize
    }

    fn describe(self, p: &Params) -> String {
        let (from, to) = (
            p.outage_at.as_secs_f64(),
            (p.outage_at + p.outage_for).as_secs_f64(),
        );
        let end = p.duration.as_secs_f64();
        match self {
            Phase::Before if p.outage_for.is_zero() => format!("whole run (0-{end}s)"),
            Phase::Before => format!("before the outage (0-{from}s)"),
            Phase::Outage => format!("outage ({from}-{to}s)"),
            Phase::After => format!("after the outage ({to}-{end}s)"),
        }
    }
}

/// What the upstream saw, by phase.
#[derive(Debug, Default)]
pub struct UpstreamCounts {
    requests: [AtomicU64; 3],
    ok: [AtomicU64; 3],
}

impl UpstreamCounts {
    pub fn requests(&self) -> u64 {
        self.requests
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .sum()
    }

    pub fn ok(&self) -> u64 {
        self.ok.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }
}

/// What one second, or the whole run, looked like to the callers.
#[derive(Debug, Clone, Default)]
pub struct CallerCounts {
    pub requests: u64,
    pub ok: u64,
    /// Latencies in microseconds, for percentiles.
    pub latencies_us: Vec<u64>,
}

impl CallerCounts {
    fn record(&mut self, ok: bool, us: u64) {
        self.requests += 1;
        self.ok += u64::from(ok);
        self.latencies_us.push(us);
    }

    fn add(&mut self, other: &CallerCounts) {
        self.requests += other.requests;
        self.ok += other.ok;
        self.latencies_us.extend_from_slice(&other.latencies_us);
    }

    pub fn success(&self) -> f64 {
        ratio(self.ok, self.requests)
    }

    pub fn percentile_ms(&self, p: f64) -> f64 {
        let mut l = self.latencies_us.clone();
        if l.is_empty() {
            return 0.0;
        }
        l.sort_unstable();
        let i = ((l.len() as f64 * p).ceil() as usize).clamp(1, l.len()) - 1;
        l[i] as f64 / 1000.0
    }
}

/// One part of the run, seen from both sides of the proxy.
#[derive(Debug, Clone)]
pub struct PhaseSummary {
    pub phase: Phase,
    /// `before the outage (0-6s)`.
    pub description: String,
    /// By when the callers sent.
    pub callers: CallerCounts,
    /// By when the attempts reached the upstream.
    pub upstream_requests: u64,
    pub upstream_ok: u64,
}

impl PhaseSummary {
    pub fn upstream_success(&self) -> f64 {
        ratio(self.upstream_ok, self.upstream_requests)
    }
}

#[derive(Debug, Clone)]
pub struct Summary {
    pub callers: CallerCounts,
    pub upstream_requests: u64,
    pub upstream_ok: u64,
    /// The phases the run had, in order.
    pub phases: Vec<PhaseSummary>,
    /// Metrics of the proxy, by series (`name{labels}`), as it reported them.
    pub metrics: BTreeMap<String, f64>,
}

impl Summary {
    pub fn caller_success(&self) -> f64 {
        self.callers.success()
    }

    pub fn upstream_success(&self) -> f64 {
        ratio(self.upstream_ok, self.upstream_requests)
    }

    /// Sum of every series of `name` whose labels contain `filter`.
    pub fn sum(&self, name: &str, filter: &str) -> f64 {
        self.metrics
            .iter()
            .filter(|(k, _)| k.starts_with(&format!("{name}{{")) && k.contains(filter))
            .map(|(_, v)| v)
            .sum()
    }

    /// `(label value, count)` of every nonzero series of `name` by `label`.
    pub fn by_label(&self, name: &str, label: &str) -> Vec<(String, f64)> {
        let key = format!("{label}=\"");
        self.metrics
            .iter()
            .filter(|(k, v)| k.starts_with(&format!("{name}{{")) && **v > 0.0)
            .filter_map(|(k, v)| {
                let start = k.find(&key)? + key.len();
                let end = start + k[start..].find('"')?;
                Some((k[start..end].to_owned(), *v))
            })
            .collect()
    }

    pub fn phase(&self, phase: Phase) -> Option<&PhaseSummary> {
        self.phases.iter().find(|s| s.phase == phase)
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        let c = &self.callers;
        out += &format!(
            "callers:  {} requests, {:.1}% succeeded (p50 {:.1} ms, p99 {:.1} ms)\n",
            c.requests,
            100.0 * self.caller_success(),
            c.percentile_ms(0.50),
            c.percentile_ms(0.99)
        );
        out += &format!(
            "upstream: {} attempts, {:.1}% succeeded\n",
            self.upstream_requests,
            100.0 * self.upstream_success()
        );
        out += &self.render_phases();
        let list = |pairs: Vec<(String, f64)>| {
            if pairs.is_empty() {
                "none".to_owned()
            } else {
                pairs
                    .iter()
                    .map(|(k, v)| format!("{k} {v}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        };
        let retries = self.sum("herdguard_retries_total", "");
        out += &format!(
            "retries made: {retries} ({})\n",
            list(self.by_label("herdguard_retries_total", "reason"))
        );
        out += &format!(
            "retries skipped: {}\n",
            list(self.by_label("herdguard_retries_skipped_total", "reason"))
        );
        out += &format!(
            "retry budget left: {:.0}\n",
            self.sum("herdguard_retry_budget_available", "")
        );
        out += &format!(
            "breaker transitions: {}\n",
            list(self.by_label("herdguard_breaker_transitions_total", "to"))
        );
        out
    }

    /// The table by phase: outside the outage retries absorb the upstream's
    /// failures; during it the breaker keeps attempts off the upstream.
    fn render_phases(&self) -> String {
        let width = self
            .phases
            .iter()
            .map(|s| s.description.len())
            .max()
            .unwrap_or(0);
        let mut out = format!(
            "\n{:width$}  {:>8} {:>9} {:>8} {:>8}   {:>8} {:>9}\n",
            "by phase", "callers", "succeeded", "p50 ms", "p99 ms", "upstream", "succeeded"
        );
        for s in &self.phases {
            out += &format!(
                "{:width$}  {:>8} {:>8.1}% {:>8.1} {:>8.1}   {:>8} {:>8.1}%\n",
                s.description,
                s.callers.requests,
                100.0 * s.callers.success(),
                s.callers.percentile_ms(0.50),
                s.callers.percentile_ms(0.99),
                s.upstream_requests,
                100.0 * s.upstream_success(),
            );
        }
        out.push('\n');
        out
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// The flaky upstream on 127.0.0.1:0.
async fn flaky_upstream(
    p: &Params,
    start: Instant,
    counts: Arc<UpstreamCounts>,
) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let p = Arc::new(p.clone());
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let (counts, p) = (counts.clone(), p.clone());
            tokio::spawn(async move {
                let service = service_fn(move |_req: Request<Incoming>| {
                    let (counts, p) = (counts.clone(), p.clone());
                    async move {
                        let phase = Phase::at(&p, start.elapsed()).index();
                        counts.requests[phase].fetch_add(1, Ordering::Relaxed);
                        let in_outage = phase == Phase::Outage.index();
                        let (error_rate, reset_rate) = (p.error_rate, p.reset_rate);
                        let (roll, work_ms) = {
                            let mut rng = rand::rng();
                            (rng.random::<f64>(), rng.random_range(2..=15))
                        };
                        tokio::time::sleep(Duration::from_millis(work_ms)).await;
                        if in_outage || roll < reset_rate {
                            return Err("flaky upstream resets the connection");
                        }
                        let mut resp = Response::new(Full::new(Bytes::from_static(
                            b"hello from the flaky API\n",
                        )));
                        if roll < reset_rate + error_rate {
                            *resp.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
                            if roll < reset_rate + error_rate / 3.0 {
                                resp.headers_mut().insert(
                                    http::header::RETRY_AFTER,
                                    http::HeaderValue::from_static("1"),
                                );
                            }
                        } else {
                            counts.ok[phase].fetch_add(1, Ordering::Relaxed);
                        }
                        Ok::<_, &'static str>(resp)
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok(addr)
}

/// Runs the demo; `progress` is called once a second with the elapsed time,
/// the last second's callers, the upstream's totals and the proxy's metrics.
pub async fn run(
    p: &Params,
    mut progress: impl FnMut(Duration, &CallerCounts, &UpstreamCounts, &str),
) -> std::io::Result<Summary> {
    let start = Instant::now();
    let upstream_counts = Arc::new(UpstreamCounts::default());
    let upstream = flaky_upstream(p, start, upstream_counts.clone()).await?;
    let localhost = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    let mut config = Config::for_upstream(&format!("http://{upstream}"), localhost, localhost)
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    if let Some(path) = &p.access_log {
        crate::observe::access_log::write_to(path)?;
        config.access_log.enabled = true;
    }
    let server = Server::start(config).await.map_err(std::io::Error::other)?;
    let url: http::Uri = format!("http://{}/demo", server.proxy_addr())
        .parse()
        .map_err(std::io::Error::other)?;

    let tally = Arc::new(Mutex::new(Tally::default()));
    let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let end = start + p.duration;
    let mut callers = Vec::new();
    let shared = Arc::new(p.clone());
    for i in 0..p.callers {
        let (client, url, tally, p) = (client.clone(), url.clone(), tally.clone(), shared.clone());
        // Spread over one interval, as a steady population of callers would be.
        let offset = p.interval.mul_f64(i as f64 / p.callers as f64);
        callers.push(tokio::spawn(async move {
            let mut pace = tokio::time::interval_at(start + offset, p.interval);
            // A tick the runtime was late for is sent at once and timed from
            // when it was due, so lateness shows as latency, not as fewer requests.
            pace.set_missed_tick_behavior(MissedTickBehavior::Burst);
            let mut requests = JoinSet::new();
            // Bounded in time and in count.
            for _ in 0..1_000_000 {
                let sent = pace.tick().await;
                if sent >= end {
                    break;
                }
                let (client, url, tally, p) =
                    (client.clone(), url.clone(), tally.clone(), p.clone());
                requests.spawn(async move {
                    let req = Request::get(url)
                        .body(Empty::new())
                        .expect("a valid request");
                    let ok = match client.request(req).await {
                        Ok(resp) => {
                            let ok = resp.status().is_success();
                            ok && resp.into_body().collect().await.is_ok()
                        }
                        Err(_) => false,
                    };
                    // From when the request was due: a late start counts as waiting.
                    let us = sent.elapsed().as_micros() as u64;
                    tally.lock().unwrap_or_else(|e| e.into_inner()).record(
                        Phase::at(&p, sent - start),
                        ok,
                        us,
                    );
                });
            }
            requests.join_all().await;
        }));
    }
    let mut tick = tokio::time::interval_at(start + Duration::from_secs(1), Duration::from_secs(1));
    while Instant::now() < end {
        tick.tick().await;
        let second = std::mem::take(&mut tally.lock().unwrap_or_else(|e| e.into_inner()).window);
        let metrics = server.proxy().metrics().render();
        progress(start.elapsed(), &second, &upstream_counts, &metrics);
    }
    for c in callers {
        let _ = c.await;
    }
    server.proxy().refresh_gauges();
    let metrics = parse_metrics(&server.proxy().metrics().render());
    server.shutdown();
    server.wait().await;
    access_log::flush(Duration::from_secs(2));
    let mut by_phase = std::mem::take(&mut tally.lock().unwrap_or_else(|e| e.into_inner()).phases);
    let phases: Vec<PhaseSummary> = Phase::in_run(p)
        .map(|phase| PhaseSummary {
            phase,
            description: phase.describe(p),
            callers: std::mem::take(&mut by_phase[phase.index()]),
            upstream_requests: upstream_counts.requests[phase.index()].load(Ordering::Relaxed),
            upstream_ok: upstream_counts.ok[phase.index()].load(Ordering::Relaxed),
        })
        .collect();
    let mut callers = CallerCounts::default();
    for s in &phases {
        callers.add(&s.callers);
    }
    Ok(Summary {
        callers,
        upstream_requests: upstream_counts.requests(),
        upstream_ok: upstream_counts.ok(),
        phases,
        metrics,
    })
}

/// What the callers saw: the last second (for the progress line), and each phase.
#[derive(Default)]
struct Tally {
    window: CallerCounts,
    phases: [CallerCounts; 3],
}

impl Tally {
    fn record(&mut self, phase: Phase, ok: bool, us: u64) {
        self.window.record(ok, us);
        self.phases[phase.index()].record(ok, us);
    }
}

/// Prometheus text to `series -> value` (comments and histograms' buckets included).
pub fn parse_metrics(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some((series.to_owned(), value.parse().ok()?))
        })
        .collect()
}

/// One line of live progress.
pub fn progress_line(
    elapsed: Duration,
    second: &CallerCounts,
    upstream: &UpstreamCounts,
    metrics: &str,
) -> String {
    let m = parse_metrics(metrics);
    let sum = |prefix: &str| -> f64 {
        m.iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(_, v)| v)
            .sum()
    };
    let state = m
        .iter()
        .find(|(k, _)| k.starts_with("herdguard_breaker_state{"))
        .map_or("closed", |(_, v)| match *v as u8 {
            2 => "open",
            1 => "half-open",
            _ => "closed",
        });
    format!(
        "t={:>2}s  callers {:>5.1}% ok ({:>4} req/s)  upstream {:>5.1}% ok so far  retries {:>5}  skipped {:>4}  breaker {}",
        elapsed.as_secs(),
        100.0 * ratio(second.ok, second.requests),
        second.requests,
        100.0 * ratio(upstream.ok(), upstream.requests()),
        sum("herdguard_retries_total{"),
        sum("herdguard_retries_skipped_total{"),
        state,
    )
}

/// The access log the demo wrote: how many lines, and one line of each
/// kind worth a look (a failure a retry absorbed, a retry not made and
/// why, an answer from the open breaker), as written.
pub fn access_log_samples(path: &std::path::Path) -> std::io::Result<(usize, Vec<String>)> {
    let text = std::fs::read_to_string(path)?;
    let kinds: [&dyn Fn(&str) -> bool; 3] = [
        &|l| l.contains(" status=200 ") && !l.contains(" attempts=1 "),
        &|l| !l.contains(" skip=-") && !l.contains("skip=attempts_exhausted"),
        &|l| l.contains(" error=circuit-open "),
    ];
    let samples = kinds
        .iter()
        .filter_map(|kind| text.lines().find(|l| kind(l)).map(str::to_owned))
        .collect();
    Ok((text.lines().count(), samples))
}
