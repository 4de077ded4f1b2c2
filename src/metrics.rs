//! Metric names in one place, described and bucketed at start-up.
//!
//! Each running proxy owns its own Prometheus recorder (not the process-wide
//! one), so several proxies in one test process keep separate numbers. Hot
//! paths hold pre-registered handles: recording is an atomic add, with no
//! label formatting or map lookup per request.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crate::policy::breaker::State as BreakerState;
use crate::policy::outcome::{Outcome, SkipReason, UpstreamFault};
use http::StatusCode;
use metrics::{Counter, Gauge, Histogram, Key, Label, Metadata, Recorder, SharedString, Unit};
use metrics_exporter_prometheus::{
    Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder,
};

pub const REQUESTS_TOTAL: &str = "herdguard_requests_total";
pub const REQUEST_DURATION: &str = "herdguard_request_duration_seconds";
pub const UPSTREAM_ATTEMPTS: &str = "herdguard_upstream_attempts_total";
pub const RETRIES_TOTAL: &str = "herdguard_retries_total";
pub const RETRIES_SKIPPED: &str = "herdguard_retries_skipped_total";
pub const RETRY_BUDGET_AVAILABLE: &str = "herdguard_retry_budget_available";
pub const BACKOFF_SECONDS: &str = "herdguard_backoff_seconds";
pub const BREAKER_STATE: &str = "herdguard_breaker_state";
pub const BREAKER_TRANSITIONS: &str = "herdguard_breaker_transitions_total";
pub const IN_FLIGHT: &str = "herdguard_in_flight";
pub const SHED_TOTAL: &str = "herdguard_shed_total";
pub const CONFIG_RELOADS: &str = "herdguard_config_reloads_total";
pub const CONCURRENCY_LIMIT: &str = "herdguard_concurrency_limit";
pub const ENDPOINT_EJECTIONS: &str = "herdguard_endpoint_ejections_total";
pub const ENDPOINT_EJECTED: &str = "herdguard_endpoint_ejected";

const LATENCY_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

static METADATA: Metadata<'static> =
    Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));

/// The registry of one running proxy.
pub struct Metrics {
    recorder: PrometheusRecorder,
    handle: PrometheusHandle,
}

impl Metrics {
    pub fn new() -> Arc<Self> {
        let builder = PrometheusBuilder::new();
        let builder = [REQUEST_DURATION, BACKOFF_SECONDS]
            .into_iter()
            .fold(builder, |b, name| {
                b.set_buckets_for_metric(Matcher::Full(name.to_owned()), LATENCY_BUCKETS)
                    .expect("bucket list is not empty")
            });
        let recorder = builder.build_recorder();
        let handle = recorder.handle();
        let m = Self { recorder, handle };
        m.describe();
        Arc::new(m)
    }

    fn describe(&self) {
        use Unit::*;
        let r = &self.recorder;
        let counters = [
            (
                REQUESTS_TOTAL,
                Count,
                "Requests answered, by route and status code.",
            ),
            (
                UPSTREAM_ATTEMPTS,
                Count,
                "Attempts sent upstream (first tries and retries), by outcome.",
            ),
            (
                RETRIES_TOTAL,
                Count,
                "Retries made, by the cause of the failed attempt.",
            ),
            (
                RETRIES_SKIPPED,
                Count,
                "Retries that were not made, by reason.",
            ),
            (
                BREAKER_TRANSITIONS,
                Count,
                "Circuit breaker state changes, by new state.",
            ),
            (
                SHED_TOTAL,
                Count,
                "Requests refused at once because the upstream was at its in-flight limit.",
            ),
            (CONFIG_RELOADS, Count, "Config reloads, by result."),
            (
                ENDPOINT_EJECTIONS,
                Count,
                "Endpoints taken out of rotation for failing (outlier ejection).",
            ),
        ];
        for (name, unit, help) in counters {
            r.describe_counter(name.into(), Some(unit), help.into());
        }
        let gauges = [
            (
                RETRY_BUDGET_AVAILABLE,
                Count,
                "Retries the budget would allow now.",
            ),
            (
                BREAKER_STATE,
                Count,
                "Circuit breaker state: 0 closed, 1 half-open, 2 open.",
            ),
            (IN_FLIGHT, Count, "Requests in flight to the upstream."),
            (
                ENDPOINT_EJECTED,
                Count,
                "1 while the endpoint is out of rotation (ejected or being probed), else 0.",
            ),
            (
                CONCURRENCY_LIMIT,
                Count,
                "Requests the upstream may have in flight now (adaptive limit).",
            ),
        ];
        for (name, unit, help) in gauges {
            r.describe_gauge(name.into(), Some(unit), help.into());
        }
        r.describe_histogram(
            REQUEST_DURATION.into(),
            Some(Seconds),
            "Time from request received to response headers sent, retries included.".into(),
        );
        r.describe_histogram(
            BACKOFF_SECONDS.into(),
            Some(Seconds),
            "Delay waited before each retry.".into(),
        );
        for result in ["ok", "error"] {
            self.counter(CONFIG_RELOADS, &[("result", result)])
                .increment(0);
        }
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        self.handle.render()
    }

    /// Counts a config reload, by result.
    pub fn reloaded(&self, ok: bool) {
        let result = if ok { "ok" } else { "error" };
        self.counter(CONFIG_RELOADS, &[("result", result)])
            .increment(1);
    }

    /// Folds recorded histogram samples into their buckets, freeing them.
    pub fn upkeep(&self) {
        self.handle.run_upkeep();
    }

    pub fn counter(&self, name: &'static str, labels: &[(&'static str, &str)]) -> Counter {
        self.recorder
            .register_counter(&key(name, labels), &METADATA)
    }

    pub fn gauge(&self, name: &'static str, labels: &[(&'static str, &str)]) -> Gauge {
        self.recorder.register_gauge(&key(name, labels), &METADATA)
    }

    pub fn histogram(&self, name: &'static str, labels: &[(&'static str, &str)]) -> Histogram {
        self.recorder
            .register_histogram(&key(name, labels), &METADATA)
    }
}

fn key(name: &'static str, labels: &[(&'static str, &str)]) -> Key {
    let labels: Vec<Label> = labels
        .iter()
        .map(|(k, v)| Label::new(*k, SharedString::from(v.to_string())))
        .collect();
    Key::from_parts(name, labels)
}

/// Counters with a status-code label, registered on first use of each code.
struct ByStatus {
    registry: Arc<Metrics>,
    name: &'static str,
    route: Arc<str>,
    label: &'static str,
    counters: Box<[OnceLock<Counter>]>,
}

impl ByStatus {
    fn new(
        registry: &Arc<Metrics>,
        name: &'static str,
        route: &Arc<str>,
        label: &'static str,
    ) -> Self {
        Self {
            registry: registry.clone(),
            name,
            route: route.clone(),
            label,
            counters: (100..600).map(|_| OnceLock::new()).collect(),
        }
    }

    /// Counts one for `status`. The usual codes (100-599) have a cached
    /// handle; an odd one (600-999, which HTTP allows) is looked up each time.
    fn increment(&self, status: StatusCode) {
        let register = || {
            self.registry.counter(
                self.name,
                &[("route", &self.route), (self.label, status.as_str())],
            )
        };
        let slot = usize::from(status.as_u16()).checked_sub(100);
        match slot.and_then(|i| self.counters.get(i)) {
            Some(cell) => cell.get_or_init(register).increment(1),
            None => register().increment(1),
        }
    }
}

/// Handles for one route, registered once when the route is built.
pub struct RouteMetrics {
    requests: ByStatus,
    duration: Histogram,
    /// By [`Outcome::sent_index`].
    attempts: [Counter; Outcome::SENT.len()],
    /// `herdguard_retries_total` for the upstream's failures that are not a status.
    retries: [Counter; UpstreamFault::ALL.len()],
    retries_by_status: ByStatus,
    skipped: [Counter; SkipReason::ALL.len()],
    backoff: Histogram,
    pub budget_available: Gauge,
    breaker_state: Gauge,
    /// `herdguard_breaker_transitions_total` by new state: closed, half_open, open.
    transitions: [Counter; 3],
}

impl RouteMetrics {
    pub fn new(registry: &Arc<Metrics>, route: &str, upstream: &str) -> Self {
        let name: Arc<str> = route.into();
        let attempts = Outcome::SENT.map(|o| {
            registry.counter(
                UPSTREAM_ATTEMPTS,
                &[
                    ("route", route),
                    ("upstream", upstream),
                    ("outcome", o.label()),
                ],
            )
        });
        let retries = UpstreamFault::ALL
            .map(|f| registry.counter(RETRIES_TOTAL, &[("route", route), ("reason", f.label())]));
        let skipped = SkipReason::ALL.map(|r| {
            registry.counter(RETRIES_SKIPPED, &[("route", route), ("reason", r.as_str())])
        });
        Self {
            requests: ByStatus::new(registry, REQUESTS_TOTAL, &name, "code"),
            duration: registry.histogram(REQUEST_DURATION, &[("route", route)]),
            attempts,
            retries,
            retries_by_status: ByStatus::new(registry, RETRIES_TOTAL, &name, "reason"),
            skipped,
            backoff: registry.histogram(BACKOFF_SECONDS, &[("route", route)]),
            budget_available: registry.gauge(RETRY_BUDGET_AVAILABLE, &[("route", route)]),
            breaker_state: registry.gauge(BREAKER_STATE, &[("route", route)]),
            transitions: [
                BreakerState::Closed,
                BreakerState::HalfOpen,
                BreakerState::Open,
            ]
            .map(|s| {
                registry.counter(BREAKER_TRANSITIONS, &[("route", route), ("to", s.as_str())])
            }),
        }
    }

    /// Counts a request answered to the caller, and how long it took.
    pub fn request(&self, status: StatusCode, elapsed: Duration) {
        self.requests.increment(status);
        self.duration.record(elapsed.as_secs_f64());
    }

    /// Counts an attempt that was sent, by how it ended (refusals are not attempts).
    pub fn attempt(&self, outcome: Outcome) {
        if let Some(i) = outcome.sent_index() {
            self.attempts[i].increment(1);
        }
    }

    /// Counts a retry about to be made after `cause`, and its delay. Only
    /// the upstream's failures are retried; anything else is not counted.
    pub fn retry(&self, cause: Outcome, delay: Duration) {
        match cause {
            Outcome::Response(status) => self.retries_by_status.increment(status),
            Outcome::Upstream(fault) => {
                let i = UpstreamFault::ALL.iter().position(|f| *f == fault);
                if let Some(counter) = i.and_then(|i| self.retries.get(i)) {
                    counter.increment(1);
                }
            }
            Outcome::Caller(_) | Outcome::Deadline | Outcome::Refused(_) => return,
        }
        self.backoff.record(delay.as_secs_f64());
    }

    /// Counts a breaker state change and sets the state gauge.
    pub fn breaker(&self, to: BreakerState) {
        let i = match to {
            BreakerState::Closed => 0,
            BreakerState::HalfOpen => 1,
            BreakerState::Open => 2,
        };
        self.transitions[i].increment(1);
        self.breaker_state.set(to.gauge());
    }

    pub fn skipped(&self, reason: SkipReason) {
        self.skipped[reason as usize].increment(1);
    }
}

/// `herdguard_requests_total` for requests no route took.
pub fn unrouted(registry: &Metrics, status: StatusCode) {
    registry
        .counter(
            REQUESTS_TOTAL,
            &[("route", "none"), ("code", status.as_str())],
        )
        .increment(1);
}

/// Handles for one upstream.
pub struct UpstreamMetrics {
    pub in_flight: Gauge,
    pub shed: Counter,
    pub limit: Gauge,
    /// By endpoint index; empty when the upstream has one endpoint (it is
    /// never ejected).
    pub endpoints: Box<[EndpointMetrics]>,
}

/// Handles for one endpoint of an upstream.
pub struct EndpointMetrics {
    pub ejections: Counter,
    pub ejected: Gauge,
}

impl UpstreamMetrics {
    pub fn new(registry: &Metrics, upstream: &str, endpoints: &[&str]) -> Self {
        let endpoints = match endpoints.len() {
            0 | 1 => Box::default(),
            _ => endpoints
                .iter()
                .map(|e| {
                    let labels = [("upstream", upstream), ("endpoint", *e)];
                    let m = EndpointMetrics {
                        ejections: registry.counter(ENDPOINT_EJECTIONS, &labels),
                        ejected: registry.gauge(ENDPOINT_EJECTED, &labels),
                    };
                    m.ejections.increment(0);
                    m.ejected.set(0.0);
                    m
                })
                .collect(),
        };
        Self {
            in_flight: registry.gauge(IN_FLIGHT, &[("upstream", upstream)]),
            shed: registry.counter(SHED_TOTAL, &[("upstream", upstream)]),
            limit: registry.gauge(CONCURRENCY_LIMIT, &[("upstream", upstream)]),
            endpoints,
        }
    }
}
