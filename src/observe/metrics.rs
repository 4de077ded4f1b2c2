//! Metric names in one place, described and bucketed at start-up.
//!
//! Each running proxy owns its own Prometheus recorder (not the process-wide
//! one), so several proxies in one test process keep separate numbers. Hot
//! paths hold pre-registered handles: recording is an atomic add, with no
//! label formatting or map lookup per request.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use crate::policy::breaker::State as BreakerState;
use crate::policy::outcome::{GrpcStatus, Outcome, SkipReason, UpstreamFault};
use http::StatusCode;
use metrics::{Counter, Gauge, Histogram, Key, Label, Metadata, Recorder, SharedString};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle, PrometheusRecorder};

use super::histogram::Buckets;

pub const REQUESTS_TOTAL: &str = "herdguard_requests_total";
pub const REQUEST_DURATION: &str = "herdguard_request_duration_seconds";
pub const UPSTREAM_ATTEMPTS: &str = "herdguard_upstream_attempts_total";
pub const RETRIES_TOTAL: &str = "herdguard_retries_total";
pub const RETRIES_SKIPPED: &str = "herdguard_retries_skipped_total";
pub const RETRY_BUDGET_AVAILABLE: &str = "herdguard_retry_budget_available";
pub const BACKOFF_SECONDS: &str = "herdguard_backoff_seconds";
pub const BREAKER_STATE: &str = "herdguard_breaker_state";
pub const BREAKER_TRANSITIONS: &str = "herdguard_breaker_transitions_total";
pub const PATH_BREAKER_OPENS: &str = "herdguard_path_breaker_opens_total";
pub const IN_FLIGHT: &str = "herdguard_in_flight";
pub const UNANSWERED: &str = "herdguard_in_flight_unanswered";
pub const SHED_TOTAL: &str = "herdguard_shed_total";
pub const CONFIG_RELOADS: &str = "herdguard_config_reloads_total";
pub const LAST_RELOAD_OK: &str = "herdguard_config_last_reload_successful";
pub const CONCURRENCY_LIMIT: &str = "herdguard_concurrency_limit";
pub const LIMIT_PATHS: &str = "herdguard_limit_paths";
pub const LIMIT_PATHS_UNTRACKED: &str = "herdguard_limit_paths_untracked_total";
pub const LIMIT_OWN_WAIT: &str = "herdguard_limit_own_wait_windows_total";
pub const ENDPOINT_EJECTIONS: &str = "herdguard_endpoint_ejections_total";
pub const ENDPOINT_EJECTED: &str = "herdguard_endpoint_ejected";
pub const TUNNELS_OPEN: &str = "herdguard_tunnels_open";
pub const DNS_RESOLUTIONS: &str = "herdguard_dns_resolutions_total";
pub const ENDPOINTS: &str = "herdguard_endpoints";
pub const ATTEMPT_DURATION: &str = "herdguard_upstream_attempt_duration_seconds";
pub const BUILD_INFO: &str = "herdguard_build_info";
pub const HEDGES_TOTAL: &str = "herdguard_hedges_total";
pub const HEDGES_SKIPPED: &str = "herdguard_hedges_skipped_total";
pub const RETRIED_REQUESTS: &str = "herdguard_retried_requests_total";
pub const RETRY_BUDGET_CAPACITY: &str = "herdguard_retry_budget_capacity";
pub const CONNECTIONS_ACCEPTED: &str = "herdguard_connections_accepted_total";
pub const CONNECTIONS_OPEN: &str = "herdguard_connections_open";
pub const RECEIVED_BYTES: &str = "herdguard_received_bytes_total";
pub const SENT_BYTES: &str = "herdguard_sent_bytes_total";
pub const MEMORY_IN_USE: &str = "herdguard_memory_in_use_bytes";
pub const MEMORY_PRESSURE: &str = "herdguard_memory_pressure";
pub const MEMORY_CUT: &str = "herdguard_memory_cut_connections_total";
pub const MEMORY_REFUSED: &str = "herdguard_memory_refused_connections_total";
pub const SPANS_DROPPED: &str = "herdguard_trace_spans_dropped_total";
pub const SPANS_FAILED: &str = "herdguard_trace_spans_failed_total";

/// The latency histograms' bucket bounds, in seconds, unless
/// `[metrics] latency_buckets` says otherwise: fine below 100 ms, and
/// between 1 s and 5 s every second or so, so that a quantile of requests
/// that take seconds is read within half a second of the truth.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0,
    4.0, 5.0, 7.5, 10.0, 15.0, 30.0,
];

static METADATA: Metadata<'static> =
    Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));

/// The registry of one running proxy: its own series, and one scope per
/// route and per upstream, dropped with the last route or upstream that
/// uses it — so a reload that removes a route or an upstream removes its
/// series and gives their memory back.
pub struct Metrics {
    base: Scope,
    scopes: Mutex<BTreeMap<ScopeName, Weak<Scope>>>,
    /// The latency histograms' bucket bounds (`[metrics] latency_buckets`).
    buckets: Arc<[f64]>,
    /// The process's own series (`process_*`), read when scraped.
    /// The listeners' connection and byte counts, by listener name.
    listeners: Mutex<Vec<(&'static str, Arc<Traffic>)>>,
}

/// What one listener has seen: connections and bytes. Kept in plain
/// atomics by the listener and turned into series when scraped.
#[derive(Debug, Default)]
pub struct Traffic {
    accepted: AtomicU64,
    open: AtomicU64,
    received: AtomicU64,
    sent: AtomicU64,
}

impl Traffic {
    /// A connection was accepted (and is open until [`Traffic::closed`]).
    pub fn accepted(&self) {
        self.accepted.fetch_add(1, Ordering::Relaxed);
        self.open.fetch_add(1, Ordering::Relaxed);
    }

    pub fn closed(&self) {
        self.open.fetch_sub(1, Ordering::Relaxed);
    }

    /// Counts `bytes` received, or if `sent` sent.
    pub fn add(&self, sent: bool, bytes: u64) {
        let count = if sent { &self.sent } else { &self.received };
        count.fetch_add(bytes, Ordering::Relaxed);
    }
}

/// A scope's owner: a route or an upstream, by name.
type ScopeName = (ScopeKind, Box<str>);

/// What a scope holds the series of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ScopeKind {
    Route,
    Upstream,
    /// One endpoint of an upstream: its series go when a reload removes it.
    Endpoint,
}

/// One Prometheus recorder: the series of one route, one upstream, or the
/// proxy's own; its histograms are kept beside it (see `observe::histogram`).
pub struct Scope {
    recorder: PrometheusRecorder,
    handle: PrometheusHandle,
    /// The latency histograms' bounds, in seconds.
    bounds: Arc<[f64]>,
    histograms: Mutex<Vec<Arc<Buckets>>>,
}

impl Scope {
    fn new(bounds: Arc<[f64]>) -> Self {
        let recorder = PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        Self {
            recorder,
            handle,
            bounds,
            histograms: Mutex::new(Vec::new()),
        }
    }

    /// The exposition of this scope's series.
    fn render(&self) -> String {
        let mut text = self.handle.render();
        let histograms = self.histograms.lock().unwrap_or_else(|e| e.into_inner());
        for h in histograms.iter() {
            h.render(&mut text);
        }
        text
    }

    pub fn counter(&self, name: &'static str, labels: &[(&'static str, &str)]) -> Counter {
        self.recorder
            .register_counter(&key(name, labels), &METADATA)
    }

    pub fn gauge(&self, name: &'static str, labels: &[(&'static str, &str)]) -> Gauge {
        self.recorder.register_gauge(&key(name, labels), &METADATA)
    }

    /// The histogram `name` with `labels`: the one registered before under
    /// them, whose counts it shares, or a new one.
    pub fn histogram(&self, name: &'static str, labels: &[(&'static str, &str)]) -> Histogram {
        let new = Buckets::new(name, labels, self.bounds.clone());
        let mut histograms = self.histograms.lock().unwrap_or_else(|e| e.into_inner());
        let kept = match histograms.iter().find(|h| h.is(name, new.labels())) {
            Some(kept) => kept.clone(),
            None => {
                let new = Arc::new(new);
                histograms.push(new.clone());
                new
            }
        };
        Histogram::from_arc(kept)
    }
}

impl Metrics {
    pub fn new() -> Arc<Self> {
        Self::with_buckets(LATENCY_BUCKETS)
    }

    /// A registry whose latency histograms have these bucket bounds
    /// (seconds, ascending; checked by the config).
    pub fn with_buckets(buckets: &[f64]) -> Arc<Self> {
        let buckets: Arc<[f64]> = match buckets.is_empty() {
            true => LATENCY_BUCKETS.into(),
            false => buckets.into(),
        };
        let m = Self {
            base: Scope::new(buckets.clone()),
            scopes: Mutex::new(BTreeMap::new()),
            buckets,
            listeners: Mutex::new(Vec::new()),
        };
        for result in ["ok", "error"] {
            m.counter(CONFIG_RELOADS, &[("result", result)])
                .increment(0);
        }
        m.gauge(BUILD_INFO, &[("version", env!("CARGO_PKG_VERSION"))])
            .set(1.0);
        m.gauge(LAST_RELOAD_OK, &[]).set(1.0);
        m.counter(MEMORY_CUT, &[]).increment(0);
        m.counter(MEMORY_REFUSED, &[]).increment(0);
        Arc::new(m)
    }

    /// The scope of route or upstream `name`: the live one if there is
    /// one (a reload that keeps a name keeps its counts), else a new one.
    pub fn scope(&self, kind: ScopeKind, name: &str) -> Arc<Scope> {
        let mut scopes = self.scopes.lock().unwrap_or_else(|e| e.into_inner());
        let key = (kind, Box::<str>::from(name));
        if let Some(live) = scopes.get(&key).and_then(Weak::upgrade) {
            return live;
        }
        let scope = Arc::new(Scope::new(self.buckets.clone()));
        scopes.insert(key, Arc::downgrade(&scope));
        scope
    }

    /// The live scopes, forgetting the dropped ones.
    fn live(&self) -> Vec<Arc<Scope>> {
        let mut scopes = self.scopes.lock().unwrap_or_else(|e| e.into_inner());
        scopes.retain(|_, s| s.strong_count() > 0);
        scopes.values().filter_map(Weak::upgrade).collect()
    }

    /// The Prometheus text exposition of every metric: each scope rendered,
    /// and the series of each metric gathered under one `# HELP` and
    /// `# TYPE`, as the format asks.
    pub fn render(&self) -> String {
        self.traffic();
        let mut texts = vec![self.base.render(), process()];
        texts.extend(self.live().iter().map(|s| s.render()));
        merge(&texts)
    }

    /// Counts `traffic` as listener `name`'s, in the series from now on.
    pub fn listener(&self, name: &'static str, traffic: Arc<Traffic>) {
        let mut listeners = self.listeners.lock().unwrap_or_else(|e| e.into_inner());
        listeners.push((name, traffic));
    }

    /// Sets the listeners' series from their counts.
    fn traffic(&self) {
        let listeners = self.listeners.lock().unwrap_or_else(|e| e.into_inner());
        for (name, t) in listeners.iter() {
            let labels = [("listener", *name)];
            let read = |a: &AtomicU64| a.load(Ordering::Relaxed);
            self.counter(CONNECTIONS_ACCEPTED, &labels)
                .absolute(read(&t.accepted));
            self.gauge(CONNECTIONS_OPEN, &labels)
                .set(read(&t.open) as f64);
            self.counter(RECEIVED_BYTES, &labels)
                .absolute(read(&t.received));
            self.counter(SENT_BYTES, &labels).absolute(read(&t.sent));
        }
    }

    /// One look at the process's memory (see `listen::pressure`).
    pub fn memory(&self, in_use: usize, pressed: bool, cut: usize, refused: u64) {
        self.gauge(MEMORY_IN_USE, &[]).set(in_use as f64);
        self.gauge(MEMORY_PRESSURE, &[])
            .set(if pressed { 1.0 } else { 0.0 });
        if cut > 0 {
            self.counter(MEMORY_CUT, &[]).increment(cut as u64);
        }
        if refused > 0 {
            self.counter(MEMORY_REFUSED, &[]).increment(refused);
        }
    }

    /// Counts a config reload, by result.
    pub fn reloaded(&self, ok: bool) {
        let result = if ok { "ok" } else { "error" };
        self.counter(CONFIG_RELOADS, &[("result", result)])
            .increment(1);
        self.gauge(LAST_RELOAD_OK, &[])
            .set(if ok { 1.0 } else { 0.0 });
    }

    /// Live route and upstream scopes (for tests of what a reload frees).
    #[cfg(test)]
    fn scopes(&self) -> usize {
        self.live().len()
    }

    pub fn counter(&self, name: &'static str, labels: &[(&'static str, &str)]) -> Counter {
        self.base.counter(name, labels)
    }

    pub fn gauge(&self, name: &'static str, labels: &[(&'static str, &str)]) -> Gauge {
        self.base.gauge(name, labels)
    }

    pub fn histogram(&self, name: &'static str, labels: &[(&'static str, &str)]) -> Histogram {
        self.base.histogram(name, labels)
    }
}

/// What each metric is, for its `# HELP` line.
fn help(name: &str) -> Option<&'static str> {
    Some(match name {
        REQUESTS_TOTAL => {
            "Requests answered, by route, status code and source (upstream: its answer; proxy: herdguard's own)."
        }
        ATTEMPT_DURATION => {
            "Time from an attempt sent to its response headers (or its failure), per attempt, by outcome."
        }
        BUILD_INFO => "1, labelled with the running version.",
        crate::observe::access_log::DROPPED => {
            "Access log lines dropped because the writer fell 4 MiB or 16,384 lines behind (a stalled stdout)."
        }
        "herdguard_body_memory_bytes" => {
            "Bytes of request bodies kept for a retry now, all requests together (once a second)."
        }
        "herdguard_body_memory_refused_total" => {
            "Request bodies sent once, not kept for a retry, because listen.max_body_memory was full."
        }
        UPSTREAM_ATTEMPTS => "Attempts sent upstream (first tries and retries), by outcome.",
        RETRIES_TOTAL => "Retries made, by the cause of the failed attempt.",
        RETRIES_SKIPPED => "Retries that were not made, by reason.",
        BREAKER_TRANSITIONS => "Circuit breaker state changes, by new state.",
        PATH_BREAKER_OPENS => {
            "Breakers of single paths (their first two segments, api and version segments not counted) that opened: the path refused alone, the route not."
        }
        SHED_TOTAL => "Requests refused at once because the upstream was at its in-flight limit.",
        CONFIG_RELOADS => "Config reloads, by result.",
        SPANS_DROPPED => {
            "Finished spans dropped because 2,048 were already waiting for export (a slow or unreachable collector)."
        }
        SPANS_FAILED => {
            "Finished spans lost in exports that failed (the collector down, timing out after 10 s, or answering other than 2xx); never sent twice."
        }
        MEMORY_IN_USE => "Bytes in use as listen.max_memory counts them: allocated, the kernel buffers behind answers whose data waits to be written, and what connections closed with their answers still queued hold in the kernel (every 100 ms).",
        MEMORY_PRESSURE => {
            "1 while memory in use is past listen.max_memory: new requests refused, callers that read nothing cut."
        }
        MEMORY_CUT => {
            "Caller connections closed under memory pressure: answers waiting that their callers did not read, or idle."
        }
        MEMORY_REFUSED => {
            "New caller connections refused under memory pressure before anything was built for them (HTTP/1: 503; HTTP/2: GOAWAY with no stream processed; TLS: closed)."
        }
        LAST_RELOAD_OK => {
            "1 if the last config reload succeeded (or none was tried), 0 while the file last read is refused."
        }
        ENDPOINT_EJECTIONS => "Endpoints taken out of rotation for failing (outlier ejection).",
        RETRY_BUDGET_AVAILABLE => "Retries the budget would allow now.",
        BREAKER_STATE => "Circuit breaker state: 0 closed, 1 half-open, 2 open.",
        IN_FLIGHT => {
            "Requests in flight to the upstream, from admission to the end of their answers (against max_in_flight)."
        }
        UNANSWERED => {
            "Of the requests in flight, attempts sent and not yet answered (the adaptive limit holds these)."
        }
        ENDPOINT_EJECTED => {
            "1 while the endpoint is out of rotation (ejected or being probed), else 0."
        }
        CONCURRENCY_LIMIT => {
            "Attempts the upstream may have sent and not yet answered now (the adaptive limit; max_in_flight when it is off)."
        }
        LIMIT_PATHS_UNTRACKED => {
            "Answers on paths the adaptive limit had no room to track, held against the upstream's latency instead."
        }
        LIMIT_OWN_WAIT => {
            "Windows of the adaptive limit that were slow by no more than this proxy's own wait for a CPU (a busy node, a spent CPU quota): not held against the upstream."
        }
        LIMIT_PATHS => {
            "Paths whose own latency the adaptive limit tracks (at most 64; at 64, new paths are held against the upstream's latency until room is made)."
        }
        TUNNELS_OPEN => {
            "Upgraded connections (WebSockets) open to the upstream; for upstream=\"passthrough\", CONNECT tunnels passed through."
        }
        DNS_RESOLUTIONS => {
            "Resolutions of a discovery = \"dns\" upstream's names, by result (ok; error: the last good endpoints kept; gone: the name does not exist)."
        }
        ENDPOINTS => "Endpoints the upstream balances over now (for discovery = \"dns\": the addresses last resolved).",
        REQUEST_DURATION => {
            "Time from request received to response headers sent, retries included."
        }
        BACKOFF_SECONDS => "Delay waited before each retry.",
        HEDGES_TOTAL => {
            "Hedged attempts sent, by result (won: its answer went to the caller; lost: the attempt it raced answered first)."
        }
        HEDGES_SKIPPED => "Hedges that were due and not sent, by reason.",
        RETRIED_REQUESTS => {
            "Requests that took more than one attempt (retries and hedges), by result (succeeded: the last attempt was not a failure of the upstream; failed: it was)."
        }
        RETRY_BUDGET_CAPACITY => {
            "Retries the budget allowed over its window (its floor and its share of the requests), spent or not: available / capacity is the share left."
        }
        CONNECTIONS_ACCEPTED => "Connections accepted, by listener (listen: callers; admin).",
        CONNECTIONS_OPEN => "Connections open now, by listener.",
        RECEIVED_BYTES => "Bytes read from callers' connections, by listener (TLS records as received).",
        SENT_BYTES => "Bytes written to callers' connections, by listener (TLS records as sent).",
        "process_cpu_seconds_total" => "CPU time the process used, user and system, in seconds.",
        "process_open_fds" => "File descriptors the process has open.",
        "process_max_fds" => "The most file descriptors the process may open.",
        "process_virtual_memory_bytes" => "Virtual memory size of the process.",
        "process_virtual_memory_max_bytes" => "The most virtual memory the process may have.",
        "process_resident_memory_bytes" => "Resident memory of the process (RSS).",
        "process_start_time_seconds" => "When the process started, in seconds since the Unix epoch.",
        "process_threads" => "Threads of the process.",
        _ => return None,
    })
}

/// The standard process series (Prometheus's client libraries' set), as
/// `metrics_process` reads them: CPU time to the tick, which a counter of
/// the metrics crate would keep in whole seconds.
fn process() -> String {
    use std::fmt::Write as _;
    let m = metrics_process::collector::collect();
    let mut out = String::with_capacity(640);
    if let Some(cpu) = m.cpu_seconds_total {
        let name = "process_cpu_seconds_total";
        let _ = writeln!(out, "# TYPE {name} counter\n{name} {cpu}");
    }
    for (name, value) in [
        ("process_open_fds", m.open_fds),
        ("process_max_fds", m.max_fds),
        ("process_virtual_memory_bytes", m.virtual_memory_bytes),
        (
            "process_virtual_memory_max_bytes",
            m.virtual_memory_max_bytes,
        ),
        ("process_resident_memory_bytes", m.resident_memory_bytes),
        ("process_start_time_seconds", m.start_time_seconds),
        ("process_threads", m.threads),
    ] {
        if let Some(value) = value {
            let _ = writeln!(out, "# TYPE {name} gauge\n{name} {value}");
        }
    }
    out
}

/// Gathers the series of several expositions under one `# HELP` and
/// `# TYPE` per metric, in the order metrics first appear.
fn merge(texts: &[String]) -> String {
    let mut order: Vec<(&str, &str)> = Vec::new();
    let mut bodies: HashMap<&str, String> = HashMap::new();
    for text in texts {
        let mut current: Option<&str> = None;
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let name = rest.split_whitespace().next().unwrap_or(rest);
                if !bodies.contains_key(name) {
                    order.push((name, line));
                    bodies.insert(name, String::new());
                }
                current = Some(name);
            } else if line.is_empty() || line.starts_with('#') {
                continue;
            } else if let Some(body) = current.and_then(|name| bodies.get_mut(name)) {
                body.push_str(line);
                body.push('\n');
            }
        }
    }
    let mut out = String::with_capacity(bodies.values().map(String::len).sum::<usize>() * 2);
    for (name, type_line) in order {
        if let Some(help) = help(name) {
            out.push_str("# HELP ");
            out.push_str(name);
            out.push(' ');
            out.push_str(help);
            out.push('\n');
        }
        out.push_str(type_line);
        out.push('\n');
        if let Some(body) = bodies.get(name) {
            out.push_str(body);
        }
        out.push('\n');
    }
    out
}

fn key(name: &'static str, labels: &[(&'static str, &str)]) -> Key {
    let labels: Vec<Label> = labels
        .iter()
        .map(|(k, v)| Label::new(*k, SharedString::from(v.to_string())))
        .collect();
    Key::from_parts(name, labels)
}

/// Counters with a status-code label, registered on first use of each code.
/// The usual codes get a slot with a cached handle; any other is looked up
/// in the registry each time (a hash lookup). 500 slots, one per code, cost
/// 12 KB a route, most of a route's metrics.
struct ByStatus {
    registry: Arc<Scope>,
    name: &'static str,
    route: Arc<str>,
    label: &'static str,
    /// A label every series of this set carries (`source="proxy"`).
    fixed: Option<(&'static str, &'static str)>,
    counters: [OnceLock<Counter>; USUAL.len()],
}

/// The codes a route commonly answers or retries on.
const USUAL: [u16; 20] = [
    200, 201, 202, 204, 206, 301, 302, 304, 400, 401, 403, 404, 408, 409, 429, 499, 500, 502, 503,
    504,
];

impl ByStatus {
    fn new(
        registry: &Arc<Scope>,
        name: &'static str,
        route: &Arc<str>,
        label: &'static str,
        fixed: Option<(&'static str, &'static str)>,
    ) -> Self {
        Self {
            registry: registry.clone(),
            name,
            route: route.clone(),
            label,
            fixed,
            counters: Default::default(),
        }
    }

    /// Counts one for `status`.
    fn increment(&self, status: StatusCode) {
        let register = || {
            let labels = [("route", &*self.route), (self.label, status.as_str())];
            match self.fixed {
                Some(fixed) => self
                    .registry
                    .counter(self.name, &[labels[0], labels[1], fixed]),
                None => self.registry.counter(self.name, &labels),
            }
        };
        let slot = USUAL.binary_search(&status.as_u16()).ok();
        match slot.and_then(|i| self.counters.get(i)) {
            Some(cell) => cell.get_or_init(register).increment(1),
            None => register().increment(1),
        }
    }
}

/// Handles for one route, registered once when the route is built.
pub struct RouteMetrics {
    /// Kept while the route lives: its series go with it.
    _scope: Arc<Scope>,
    /// `herdguard_requests_total` by [`Source`].
    requests: [ByStatus; 2],
    duration: Histogram,
    /// `herdguard_upstream_attempt_duration_seconds` by [`Outcome::sent_index`],
    /// registered on first use.
    attempt_duration: [OnceLock<Histogram>; Outcome::SENT.len()],
    upstream: Arc<str>,
    /// `herdguard_retried_requests_total`: succeeded, failed.
    retried: [Counter; 2],
    pub budget_capacity: Gauge,
    /// By [`Outcome::sent_index`].
    attempts: [Counter; Outcome::SENT.len()],
    /// `herdguard_retries_total` for the upstream's failures that are not a status.
    retries: [Counter; UpstreamFault::ALL.len()],
    retries_by_status: ByStatus,
    /// `herdguard_retries_total` after the gRPC statuses `retry_on` may
    /// name, registered on first use (most routes carry no gRPC).
    retries_by_grpc: [OnceLock<Counter>; GrpcStatus::RETRYABLE.len()],
    /// `herdguard_hedges_total` won and lost, registered on first use
    /// (most routes do not hedge).
    hedges: OnceLock<[Counter; 2]>,
    /// `herdguard_hedges_skipped_total` by reason, registered on first use.
    hedges_skipped: [OnceLock<Counter>; SkipReason::ALL.len()],
    route: Arc<str>,
    skipped: [Counter; SkipReason::ALL.len()],
    backoff: Histogram,
    pub budget_available: Gauge,
    breaker_state: Gauge,
    /// `herdguard_breaker_transitions_total` by new state: closed, half_open, open.
    transitions: [Counter; 3],
    /// `herdguard_path_breaker_opens_total`, registered on first use.
    path_opens: OnceLock<Counter>,
}

impl RouteMetrics {
    pub fn new(metrics: &Metrics, route: &str, upstream: &str) -> Self {
        let registry = &metrics.scope(ScopeKind::Route, route);
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
            _scope: registry.clone(),
            requests: [Source::Upstream, Source::Proxy].map(|s| {
                ByStatus::new(
                    registry,
                    REQUESTS_TOTAL,
                    &name,
                    "code",
                    Some(("source", s.as_str())),
                )
            }),
            duration: registry.histogram(REQUEST_DURATION, &[("route", route)]),
            attempt_duration: Default::default(),
            upstream: upstream.into(),
            retried: ["succeeded", "failed"].map(|result| {
                registry.counter(RETRIED_REQUESTS, &[("route", route), ("result", result)])
            }),
            budget_capacity: registry.gauge(RETRY_BUDGET_CAPACITY, &[("route", route)]),
            attempts,
            retries,
            retries_by_status: ByStatus::new(registry, RETRIES_TOTAL, &name, "reason", None),
            retries_by_grpc: Default::default(),
            hedges: OnceLock::new(),
            hedges_skipped: Default::default(),
            route: name.clone(),
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
            path_opens: OnceLock::new(),
        }
    }

    /// Counts a path's breaker opening (its other changes are not counted).
    pub fn path_breaker(&self, to: BreakerState) {
        if to == BreakerState::Open {
            self.path_opens
                .get_or_init(|| {
                    self._scope
                        .counter(PATH_BREAKER_OPENS, &[("route", &self.route)])
                })
                .increment(1);
        }
    }

    /// Counts a request answered to the caller, and how long it took.
    pub fn request(&self, status: StatusCode, source: Source, elapsed: Duration) {
        self.requests[source as usize].increment(status);
        self.duration.record(elapsed.as_secs_f64());
    }

    /// Counts an attempt that was sent, by how it ended (refusals are not
    /// attempts), and how long it took, when it ran its course (an attempt
    /// its caller abandoned says nothing of the upstream's latency).
    pub fn attempt(&self, outcome: Outcome, elapsed: Option<Duration>) {
        if let Some(i) = outcome.sent_index() {
            self.attempts[i].increment(1);
            if let (Some(elapsed), Some(cell)) = (elapsed, self.attempt_duration.get(i)) {
                let register = || {
                    self._scope.histogram(
                        ATTEMPT_DURATION,
                        &[
                            ("route", &self.route),
                            ("upstream", &self.upstream),
                            ("outcome", outcome.label()),
                        ],
                    )
                };
                cell.get_or_init(register).record(elapsed.as_secs_f64());
            }
        }
    }

    /// Counts a request that was retried, by whether its answer was a
    /// success in the end.
    pub fn retried(&self, succeeded: bool) {
        self.retried[usize::from(!succeeded)].increment(1);
    }

    /// Counts a retry about to be made after `cause`, and its delay. Only
    /// the upstream's failures are retried; anything else is not counted.
    pub fn retry(&self, cause: Outcome, delay: Duration) {
        match cause {
            Outcome::Response(status) => self.retries_by_status.increment(status),
            Outcome::Grpc(status) => {
                let i = GrpcStatus::RETRYABLE.iter().position(|s| *s == status);
                if let Some(cell) = i.and_then(|i| self.retries_by_grpc.get(i)) {
                    let register = || {
                        self._scope.counter(
                            RETRIES_TOTAL,
                            &[("route", &self.route), ("reason", status.cause())],
                        )
                    };
                    cell.get_or_init(register).increment(1);
                }
            }
            Outcome::Upstream(fault) => {
                let i = UpstreamFault::ALL.iter().position(|f| *f == fault);
                if let Some(counter) = i.and_then(|i| self.retries.get(i)) {
                    counter.increment(1);
                }
            }
            Outcome::Caller(_) | Outcome::Deadline | Outcome::Refused(_) | Outcome::Superseded => {
                return
            }
        }
        self.backoff.record(delay.as_secs_f64());
    }

    /// Counts a hedge race that ended: `won` when the hedge's answer went
    /// to the caller, `lost` when the attempt it raced answered.
    pub fn hedge(&self, won: bool) {
        self.hedges()[usize::from(!won)].increment(1);
    }

    /// Registers the hedge counts at zero: the route hedges.
    pub fn hedging(&self) {
        self.hedges();
    }

    fn hedges(&self) -> &[Counter; 2] {
        self.hedges.get_or_init(|| {
            ["won", "lost"].map(|result| {
                self._scope
                    .counter(HEDGES_TOTAL, &[("route", &self.route), ("result", result)])
            })
        })
    }

    /// Counts a hedge that was due and not sent, and why.
    pub fn hedge_skipped(&self, reason: SkipReason) {
        let i = SkipReason::ALL.iter().position(|r| *r == reason);
        if let Some(cell) = i.and_then(|i| self.hedges_skipped.get(i)) {
            let register = || {
                self._scope.counter(
                    HEDGES_SKIPPED,
                    &[("route", &self.route), ("reason", reason.as_str())],
                )
            };
            cell.get_or_init(register).increment(1);
        }
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

/// Who made the answer a caller got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The upstream's response, passed on.
    Upstream = 0,
    /// herdguard's own (`x-herdguard-error`, or an injected fault).
    Proxy = 1,
}

impl Source {
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Upstream => "upstream",
            Source::Proxy => "proxy",
        }
    }
}

/// The route label of requests no route took that were passed through.
pub const PASSTHROUGH: &str = "passthrough";

/// `herdguard_requests_total` for a request passed through: the upstream's
/// answer, or the proxy's own when it could not pass it (`own`).
pub fn passthrough(registry: &Metrics, status: StatusCode, own: bool) {
    let source = match own {
        true => Source::Proxy,
        false => Source::Upstream,
    };
    registry
        .counter(
            REQUESTS_TOTAL,
            &[
                ("route", PASSTHROUGH),
                ("code", status.as_str()),
                ("source", source.as_str()),
            ],
        )
        .increment(1);
}

/// `herdguard_requests_total` for requests no route took: always the proxy's answer.
pub fn unrouted(registry: &Metrics, status: StatusCode) {
    registry
        .counter(
            REQUESTS_TOTAL,
            &[
                ("route", "none"),
                ("code", status.as_str()),
                ("source", Source::Proxy.as_str()),
            ],
        )
        .increment(1);
}

/// Handles for one upstream.
pub struct UpstreamMetrics {
    /// Kept while the upstream lives: its series go with it.
    _scope: Arc<Scope>,
    pub in_flight: Gauge,
    pub unanswered: Gauge,
    pub shed: Counter,
    pub limit: Gauge,
    /// Paths the adaptive limit tracks (0 when it is off), and answers
    /// that found no room among them.
    pub limit_paths: Gauge,
    pub limit_paths_untracked: Counter,
    /// Windows whose slowness was the proxy's own wait for a CPU.
    pub limit_own_wait: Counter,
    pub tunnels: Gauge,
    pub endpoints: Gauge,
    /// Resolutions, for an upstream with `discovery = "dns"`.
    pub dns: Option<DnsMetrics>,
}

/// Resolutions of a `discovery = "dns"` upstream's names, by result.
pub struct DnsMetrics {
    pub ok: Counter,
    pub error: Counter,
    pub gone: Counter,
}

/// Handles for one endpoint of an upstream.
pub struct EndpointMetrics {
    _scope: Arc<Scope>,
    pub ejections: Counter,
    pub ejected: Gauge,
}

impl EndpointMetrics {
    /// The series of endpoint `label` of `upstream`, kept while this lives.
    pub fn new(metrics: &Metrics, upstream: &str, label: &str) -> Self {
        let labels = [("upstream", upstream), ("endpoint", label)];
        let registry = metrics.scope(ScopeKind::Endpoint, &format!("{upstream}\0{label}"));
        let m = EndpointMetrics {
            _scope: registry.clone(),
            ejections: registry.counter(ENDPOINT_EJECTIONS, &labels),
            ejected: registry.gauge(ENDPOINT_EJECTED, &labels),
        };
        m.ejections.increment(0);
        m.ejected.set(0.0);
        m
    }
}

impl UpstreamMetrics {
    pub fn new(metrics: &Metrics, upstream: &str, dns: bool) -> Self {
        let registry = &metrics.scope(ScopeKind::Upstream, upstream);
        let resolutions = |result| {
            let c = registry.counter(
                DNS_RESOLUTIONS,
                &[("upstream", upstream), ("result", result)],
            );
            c.increment(0);
            c
        };
        Self {
            _scope: registry.clone(),
            in_flight: registry.gauge(IN_FLIGHT, &[("upstream", upstream)]),
            unanswered: registry.gauge(UNANSWERED, &[("upstream", upstream)]),
            shed: registry.counter(SHED_TOTAL, &[("upstream", upstream)]),
            limit: registry.gauge(CONCURRENCY_LIMIT, &[("upstream", upstream)]),
            limit_paths: registry.gauge(LIMIT_PATHS, &[("upstream", upstream)]),
            limit_paths_untracked: registry
                .counter(LIMIT_PATHS_UNTRACKED, &[("upstream", upstream)]),
            limit_own_wait: registry.counter(LIMIT_OWN_WAIT, &[("upstream", upstream)]),
            tunnels: registry.gauge(TUNNELS_OPEN, &[("upstream", upstream)]),
            endpoints: registry.gauge(ENDPOINTS, &[("upstream", upstream)]),
            dns: dns.then(|| DnsMetrics {
                ok: resolutions("ok"),
                error: resolutions("error"),
                gone: resolutions("gone"),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn process_cpu_time_is_kept_below_the_second() {
        let cpu = || {
            let text = process();
            let line = text
                .lines()
                .find(|l| l.starts_with("process_cpu_seconds_total "))
                .expect("a CPU line");
            line.split(' ').nth(1).unwrap().parse::<f64>().unwrap()
        };
        let before = cpu();
        // Work until the kernel has counted a few ticks (bounded).
        let mut x = 0u64;
        for i in 0..2_000_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(std::hint::black_box(i));
            if i % 1_000_000 == 0 && cpu() >= before + 0.05 {
                break;
            }
        }
        std::hint::black_box(x);
        let after = cpu();
        assert!(after >= before + 0.05, "{before} -> {after}");
        assert!(
            after.fract() != 0.0 || before.fract() != 0.0,
            "{before} -> {after}"
        );
    }

    #[test]
    fn a_routes_histograms_render_under_its_labels_and_a_second_handle_set_shares_them() {
        let m = Metrics::with_buckets(&[0.005, 0.5]);
        let route = RouteMetrics::new(&m, "busy", "u");
        route.request(StatusCode::OK, Source::Upstream, Duration::from_millis(3));
        route.attempt(
            Outcome::Response(StatusCode::OK),
            Some(Duration::from_millis(600)),
        );
        RouteMetrics::new(&m, "busy", "u").request(
            StatusCode::OK,
            Source::Upstream,
            Duration::from_millis(200),
        );
        let text = m.render();
        for line in [
            "herdguard_request_duration_seconds_bucket{route=\"busy\",le=\"0.005\"} 1",
            "herdguard_request_duration_seconds_bucket{route=\"busy\",le=\"0.5\"} 2",
            "herdguard_request_duration_seconds_count{route=\"busy\"} 2",
            "herdguard_upstream_attempt_duration_seconds_bucket{route=\"busy\",upstream=\"u\",outcome=\"ok\",le=\"0.5\"} 0",
            "herdguard_upstream_attempt_duration_seconds_bucket{route=\"busy\",upstream=\"u\",outcome=\"ok\",le=\"+Inf\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line}\n{text}");
        }
        assert_eq!(
            text.matches(&format!("# TYPE {REQUEST_DURATION} histogram"))
                .count(),
            1,
            "{text}"
        );
    }

    #[test]
    fn scopes_render_as_one_exposition_and_go_with_their_owner() {
        let m = Metrics::new();
        let a = RouteMetrics::new(&m, "a", "u");
        let b = RouteMetrics::new(&m, "b", "u");
        a.request(StatusCode::OK, Source::Upstream, Duration::from_millis(3));
        b.request(
            StatusCode::IM_A_TEAPOT,
            Source::Proxy,
            Duration::from_millis(3),
        );
        let text = m.render();
        // One HELP and one TYPE per metric, every route's series under it.
        for name in [REQUESTS_TOTAL, REQUEST_DURATION, CONFIG_RELOADS] {
            let ty = format!("# TYPE {name} ");
            assert_eq!(text.matches(&ty).count(), 1, "{name}: {text}");
            assert_eq!(
                text.matches(&format!("# HELP {name} ")).count(),
                1,
                "{name}"
            );
        }
        assert!(text
            .contains("herdguard_requests_total{route=\"a\",code=\"200\",source=\"upstream\"} 1"));
        assert!(
            text.contains("herdguard_requests_total{route=\"b\",code=\"418\",source=\"proxy\"} 1")
        );
        // A second handle set for a live name shares its counts.
        RouteMetrics::new(&m, "a", "u").request(StatusCode::OK, Source::Upstream, Duration::ZERO);
        assert!(m
            .render()
            .contains("herdguard_requests_total{route=\"a\",code=\"200\",source=\"upstream\"} 2"));
        // A dropped route takes its series with it.
        drop(b);
        let text = m.render();
        assert!(!text.contains("route=\"b\""), "{text}");
        assert_eq!(m.scopes(), 1);
        drop(a);
        assert!(!m.render().contains("route=\"a\""));
    }
}
