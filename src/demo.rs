//! `herdguard demo`: a flaky API, herdguard with its default policies in
//! front of it, and a bounded load of callers — then what the proxy absorbed.
//!
//! The upstream fails like a real flaky API: some 503s (a third of them with
//! `Retry-After: 1`), some connections reset before any answer, and an outage
//! of a few seconds in the middle of the run in which it resets everything.

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
use tokio::time::Instant;

use crate::app::Server;
use crate::config::Config;

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
    /// Pause between a caller's requests. Callers do not retry: herdguard does.
    pub think: Duration,
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
            think: Duration::from_millis(50),
        }
    }
}

/// What the upstream saw.
#[derive(Debug, Default)]
pub struct UpstreamCounts {
    pub requests: AtomicU64,
    pub ok: AtomicU64,
}

/// What one second, or the whole run, looked like to the callers.
#[derive(Debug, Clone, Default)]
pub struct CallerCounts {
    pub requests: u64,
    pub ok: u64,
    /// Latencies in microseconds, for percentiles.
    pub latencies_us: Vec<u64>,
}

#[derive(Debug, Clone)]
pub struct Summary {
    pub callers: CallerCounts,
    pub upstream_requests: u64,
    pub upstream_ok: u64,
    /// Metrics of the proxy, by series (`name{labels}`), as it reported them.
    pub metrics: BTreeMap<String, f64>,
}

impl Summary {
    pub fn caller_success(&self) -> f64 {
        ratio(self.callers.ok, self.callers.requests)
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

    pub fn percentile_ms(&self, p: f64) -> f64 {
        let mut l = self.callers.latencies_us.clone();
        if l.is_empty() {
            return 0.0;
        }
        l.sort_unstable();
        let i = ((l.len() as f64 * p).ceil() as usize).clamp(1, l.len()) - 1;
        l[i] as f64 / 1000.0
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        let c = &self.callers;
        out += &format!(
            "callers:  {} requests, {:.1}% succeeded (p50 {:.1} ms, p99 {:.1} ms)\n",
            c.requests,
            100.0 * self.caller_success(),
            self.percentile_ms(0.50),
            self.percentile_ms(0.99)
        );
        out += &format!(
            "upstream: {} attempts, {:.1}% succeeded\n",
            self.upstream_requests,
            100.0 * self.upstream_success()
        );
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
            "retry budget left: {}\n",
            self.sum("herdguard_retry_budget_available", "")
        );
        out += &format!(
            "breaker transitions: {}\n",
            list(self.by_label("herdguard_breaker_transitions_total", "to"))
        );
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
    let (outage_start, outage_end) = (start + p.outage_at, start + p.outage_at + p.outage_for);
    let (error_rate, reset_rate) = (p.error_rate, p.reset_rate);
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let counts = counts.clone();
            tokio::spawn(async move {
                let service = service_fn(move |_req: Request<Incoming>| {
                    let counts = counts.clone();
                    async move {
                        counts.requests.fetch_add(1, Ordering::Relaxed);
                        let now = Instant::now();
                        let in_outage = now >= outage_start && now < outage_end;
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
                            counts.ok.fetch_add(1, Ordering::Relaxed);
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
    let config = Config::for_upstream(&format!("http://{upstream}"), localhost, localhost)
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    let server = Server::start(config).await.map_err(std::io::Error::other)?;
    let url: http::Uri = format!("http://{}/demo", server.proxy_addr())
        .parse()
        .map_err(std::io::Error::other)?;

    let window = Arc::new(Mutex::new(CallerCounts::default()));
    let total = Arc::new(Mutex::new(CallerCounts::default()));
    let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let end = start + p.duration;
    let mut callers = Vec::new();
    for _ in 0..p.callers {
        let (client, url, window, total) =
            (client.clone(), url.clone(), window.clone(), total.clone());
        let think = p.think;
        callers.push(tokio::spawn(async move {
            // Bounded in time and in count.
            for _ in 0..1_000_000 {
                if Instant::now() >= end {
                    break;
                }
                let sent = Instant::now();
                let req = Request::get(url.clone())
                    .body(Empty::new())
                    .expect("a valid request");
                let ok = match client.request(req).await {
                    Ok(resp) => {
                        let ok = resp.status().is_success();
                        ok && resp.into_body().collect().await.is_ok()
                    }
                    Err(_) => false,
                };
                let us = sent.elapsed().as_micros() as u64;
                for counts in [&window, &total] {
                    let mut c = counts.lock().unwrap_or_else(|e| e.into_inner());
                    c.requests += 1;
                    c.ok += u64::from(ok);
                    c.latencies_us.push(us);
                }
                tokio::time::sleep(think).await;
            }
        }));
    }
    let mut tick = tokio::time::interval_at(start + Duration::from_secs(1), Duration::from_secs(1));
    while Instant::now() < end {
        tick.tick().await;
        let second = std::mem::take(&mut *window.lock().unwrap_or_else(|e| e.into_inner()));
        let metrics = server.proxy().metrics().render();
        progress(start.elapsed(), &second, &upstream_counts, &metrics);
    }
    for c in callers {
        let _ = c.await;
    }
    server.proxy().runtime().refresh_gauges();
    let metrics = parse_metrics(&server.proxy().metrics().render());
    server.shutdown();
    server.wait().await;
    let callers = std::mem::take(&mut *total.lock().unwrap_or_else(|e| e.into_inner()));
    Ok(Summary {
        callers,
        upstream_requests: upstream_counts.requests.load(Ordering::Relaxed),
        upstream_ok: upstream_counts.ok.load(Ordering::Relaxed),
        metrics,
    })
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
        100.0 * ratio(upstream.ok.load(Ordering::Relaxed), upstream.requests.load(Ordering::Relaxed)),
        sum("herdguard_retries_total{"),
        sum("herdguard_retries_skipped_total{"),
        state,
    )
}
