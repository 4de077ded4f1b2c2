//! The proxy service: route a request, forward it upstream under the header
//! rules, and stream the response back.

mod error;
mod passthrough;
mod response;

use std::net::SocketAddr;
use std::sync::Arc;

use crate::observe::trace::{RequestTrace, Tracing};
use crate::units::clock;
use crate::wire::identity;
use crate::wire::{CallerBody, CallerUpgrade};
use arc_swap::ArcSwap;
use http::header::HOST;
use http::{HeaderValue, Method, Request, Response, StatusCode, Version};
use tokio::time::Instant;

pub use error::{max_forwards_reached, LocalError};
pub use response::ResponseBody;

use crate::upstream::{
    attempt, BodyMemory, Upstream, UpstreamError, BODY_MEMORY_HELD, BODY_MEMORY_REFUSED,
};
use crate::wire::headers::{self, Present};

use crate::config::{CompiledRoute, Config, RouteConfig, Validated};
use crate::observe::access_log::{AccessLog, Entry, Logged};
use crate::observe::metrics::{self, Metrics, RouteMetrics};
use crate::policy::breaker::{Breaker, SharedBreaker};
use crate::policy::paths::PathBreakers;
use crate::policy::route::{Matcher, RequestInfo};
use crate::policy::{CallerFault, RequestFacts};
use crate::retry::{self, End, Guards};
use rand::Rng;

/// Why a runtime could not be built from a (validated) config.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    #[error("routes.{route}.{message}")]
    Route { route: String, message: String },
    #[error(transparent)]
    Invalid(#[from] crate::config::ConfigErrors),
    #[error("the new config has no routes: every request would be answered 404 (a truncated file?); the running config stays")]
    NoRoutes,
    #[error("{0}")]
    Dns(String),
    #[error("listen.max_memory ({max} MiB) leaves no room: the new config's own state takes about {in_use} MiB, past three quarters of the bound (every request would be refused); the running config stays")]
    NoRoom { max: u64, in_use: u64 },
}

/// Everything built from one config: swapped whole on reload.
pub struct Runtime {
    pub config: Arc<Config>,
    pub routes: Vec<Arc<Route>>,
    /// `[access_log]`, when on.
    access_log: Option<Arc<AccessLog>>,
    /// The header of requests' ids (`[request_id]`), when on.
    request_id: Option<http::HeaderName>,
    /// For upstreams with `discovery = "dns"`, when there are any.
    resolver: Option<Arc<hickory_resolver::TokioResolver>>,
    /// The effective config as TOML, made once (for `/config`).
    toml: std::sync::OnceLock<bytes::Bytes>,
    /// Some route matches on the request's host.
    by_host: bool,
}

/// A route, compiled.
pub struct Route {
    pub name: Arc<str>,
    matcher: Matcher,
    pub upstream: Arc<Upstream>,
    /// What every attempt passes through: policy, budget, breaker, metrics.
    pub guards: Guards,
    /// `listen.explain`: answer `x-herdguard-explain: 1` with a trace.
    explain: bool,
    /// `listen.write_timeout`: how long a response body may make no progress.
    write_timeout: std::time::Duration,
    fault: Option<crate::config::FaultConfig>,
    /// `host_rewrite`: the `Host` the upstream sees instead of the endpoint's.
    host_rewrite: Option<HeaderValue>,
    /// The header of requests' ids (`[request_id]`), when on.
    request_id: Option<http::HeaderName>,
}

impl Runtime {
    pub fn build(config: Validated, registry: &Arc<Metrics>) -> Result<Self, BuildError> {
        Self::rebuild(config, registry, None)
    }

    /// Builds the runtime of a new config, keeping from `previous` what the
    /// new config does not change: an upstream with the same name and keys
    /// keeps its connections, in-flight count and adaptive limit; a route with
    /// the same name keeps its breaker state (with new thresholds, if any) and
    /// its retry budget (unless the budget's own keys changed).
    ///
    /// Nothing of `previous` changes unless the whole build succeeds: only
    /// the upstreams can fail to build (their files), and they are built
    /// first; a kept breaker takes its new thresholds last.
    pub fn rebuild(
        config: Validated,
        registry: &Arc<Metrics>,
        previous: Option<&Runtime>,
    ) -> Result<Self, BuildError> {
        let (config, compiled) = config.into_parts();
        let resolver = resolver(&config, previous)?;
        let upstreams = build_upstreams(&config, registry, previous)?;
        let request_id = config
            .request_id
            .enabled
            .then(|| http::HeaderName::from_bytes(config.request_id.header.as_bytes()).ok())
            .flatten();
        let mut adopt = Vec::new();
        let mut routes = Vec::with_capacity(compiled.len());
        for (r, compiled) in config.routes.iter().zip(compiled) {
            let upstream =
                upstreams
                    .get(r.upstream.as_str())
                    .cloned()
                    .ok_or_else(|| BuildError::Route {
                        route: r.name.clone(),
                        message: format!("upstream: no upstream is named {:?}", r.upstream),
                    })?;
            let before = previous.and_then(|p| {
                let old = p.routes.iter().find(|o| *o.name == r.name)?;
                let old_config = p.config.routes.iter().find(|o| o.name == r.name)?;
                Some((&**old, old_config))
            });
            let (mut route, kept_breaker) =
                Route::new(r, compiled, upstream, registry, before, &config.listen);
            route.request_id = request_id.clone();
            adopt.extend(kept_breaker);
            routes.push(Arc::new(route));
        }
        let access_log = AccessLog::new(
            &config.access_log,
            registry.counter(crate::observe::access_log::DROPPED, &[]),
        );
        // The build has succeeded: kept breakers take their new thresholds.
        let now = Instant::now();
        for (shared, fresh) in adopt {
            shared.with(|b| b.adopt(&fresh, now));
        }
        Ok(Self {
            by_host: routes.iter().any(|r| r.matcher.by_host()),
            config,
            routes,
            access_log,
            request_id,
            resolver,
            toml: std::sync::OnceLock::new(),
        })
    }

    /// The effective config as TOML, rendered once per runtime: many
    /// readers of a large config share one copy.
    pub fn config_toml(&self) -> bytes::Bytes {
        self.toml
            .get_or_init(|| bytes::Bytes::from(self.config.to_toml()))
            .clone()
    }

    /// Starts resolving the names of each upstream with `discovery = "dns"`
    /// that is due (on the runtime of the caller).
    pub fn discover(&self) {
        let Some(resolver) = &self.resolver else {
            return;
        };
        let now = tokio::time::Instant::now();
        for route in &self.routes {
            if route.upstream.begin_discovery(now) {
                tokio::spawn(route.upstream.clone().discover(resolver.clone()));
            }
        }
    }

    /// Sets the gauges that are cheaper to compute when scraped than on every request.
    pub fn refresh_gauges(&self) {
        let now = Instant::now();
        for route in &self.routes {
            let guards = &route.guards;
            let (available, capacity) = guards.budget.levels(now);
            guards.metrics.budget_available.set(available);
            guards.metrics.budget_capacity.set(capacity);
            route.upstream.refresh_gauges();
        }
    }

    /// Closes upstream connections that closed or idled out.
    pub fn sweep(&self) {
        for route in &self.routes {
            route.upstream.sweep();
        }
    }

    fn route(&self, req: &RequestInfo<'_>) -> Option<&Arc<Route>> {
        crate::policy::route::first_match(&self.routes, |r| &r.matcher, req)
    }
}

/// The resolver of `config`'s `[dns]`, when an upstream needs one: the
/// previous runtime's while `[dns]` is the same.
fn resolver(
    config: &Config,
    previous: Option<&Runtime>,
) -> Result<Option<Arc<hickory_resolver::TokioResolver>>, BuildError> {
    let dns = config
        .upstreams
        .values()
        .any(|u| u.discovery == crate::config::Discovery::Dns);
    if !dns {
        return Ok(None);
    }
    if let Some(kept) = previous
        .filter(|p| p.config.dns == config.dns)
        .and_then(|p| p.resolver.clone())
    {
        return Ok(Some(kept));
    }
    crate::upstream::discovery::resolver(&config.dns)
        .map(|r| Some(Arc::new(r)))
        .map_err(BuildError::Dns)
}

/// The upstreams of `config` by name: those the previous runtime has with
/// the same keys are kept whole; the others are new, counting the requests
/// still in flight on the one they replace.
fn build_upstreams<'c>(
    config: &'c Config,
    registry: &Arc<Metrics>,
    previous: Option<&Runtime>,
) -> Result<std::collections::BTreeMap<&'c str, Arc<Upstream>>, BuildError> {
    let mut upstreams = std::collections::BTreeMap::new();
    for (name, u) in &config.upstreams {
        let running = previous.and_then(|p| {
            p.routes
                .iter()
                .find(|r| &*r.upstream.name == name)
                .map(|r| &r.upstream)
        });
        let same = previous.is_some_and(|p| p.config.upstreams.get(name) == Some(u));
        let upstream = match running {
            Some(upstream) if same => upstream.clone(),
            _ => Upstream::new(name, u, registry, running.map(|r| r.in_flight_counter()))?,
        };
        upstreams.insert(name.as_str(), upstream);
    }
    Ok(upstreams)
}

impl Route {
    /// The route of `config`, from what its checks compiled. A route the
    /// previous runtime has keeps its breaker (returned with the fresh one
    /// whose thresholds it is to take once the whole build succeeded) and,
    /// unless the budget's keys changed, its budget.
    fn new(
        config: &RouteConfig,
        compiled: CompiledRoute,
        upstream: Arc<Upstream>,
        registry: &Arc<Metrics>,
        before: Option<(&Route, &RouteConfig)>,
        listen: &crate::config::ListenConfig,
    ) -> (Self, Option<(Arc<SharedBreaker>, Breaker)>) {
        let CompiledRoute {
            policy,
            matcher,
            budget,
            breaker,
            host_rewrite,
        } = compiled;
        let budget = match before {
            Some((old, old_config)) if old_config.retry.budget == config.retry.budget => {
                old.guards.budget.clone()
            }
            _ => Arc::new(budget),
        };
        let (breaker, adopt) = match before {
            Some((old, _)) => {
                let kept = old.guards.breaker.clone();
                (kept.clone(), Some((kept, breaker)))
            }
            None => (Arc::new(SharedBreaker::new(breaker)), None),
        };
        // Kept with the breaker; new settings apply to paths tracked anew.
        let paths = match before {
            Some((old, old_config)) if old_config.breaker == config.breaker => {
                old.guards.paths.clone()
            }
            _ => Arc::new(PathBreakers::new(&config.breaker)),
        };
        let name: Arc<str> = config.name.as_str().into();
        let metrics = RouteMetrics::new(registry, &config.name, &upstream.name);
        if policy.hedge_after.is_some() {
            // A route that hedges shows its hedge counts before the first.
            metrics.hedging();
        }
        let route = Self {
            guards: Guards {
                route: name.clone(),
                upstream: upstream.name.clone(),
                policy,
                budget,
                breaker,
                metrics,
                closed_after_outage: upstream.closed_after_outage(),
                paths,
            },
            explain: listen.explain,
            write_timeout: listen.write_timeout,
            fault: config.fault.clone(),
            host_rewrite,
            request_id: None,
            name,
            matcher,
            upstream,
        };
        (route, adopt)
    }
}

/// Who is calling: one per caller connection.
#[derive(Debug, Clone)]
pub struct Caller {
    pub addr: SocketAddr,
    /// The caller's IP as a header value, for `X-Forwarded-For`.
    ip: HeaderValue,
    /// `X-Forwarded-Proto`: `https` when the caller came over TLS.
    proto: &'static str,
    /// Where the connection was going before iptables redirected it here
    /// (`listen.transparent`).
    original: Option<SocketAddr>,
}

impl Caller {
    pub fn new(addr: SocketAddr, tls: bool) -> Self {
        Self {
            addr,
            ip: headers::ip_value(addr.ip()),
            proto: if tls { "https" } else { "http" },
            original: None,
        }
    }

    /// The caller, whose connection was redirected from `original`.
    pub fn redirected_from(mut self, original: Option<SocketAddr>) -> Self {
        self.original = original;
        self
    }
}

/// The proxy: shared by every connection.
pub struct Proxy {
    runtime: ArcSwap<Runtime>,
    metrics: Arc<Metrics>,
    /// Upgraded connections open, for the drain.
    tunnels: Arc<crate::upstream::tunnel::OpenTunnels>,
    /// Request bodies held for replay, all routes together.
    body_memory: Arc<BodyMemory>,
    /// `herdguard_body_memory_bytes`, set once a second.
    body_memory_held: ::metrics::Gauge,
    /// Woken when a new runtime is in place: its new upstreams' names are
    /// resolved at once, not at the next tick.
    pub swapped: tokio::sync::Notify,
    /// For `listen.unrouted = "passthrough"`.
    passthrough: std::sync::OnceLock<passthrough::Passthrough>,
    /// The addresses the callers' and the admin listener are bound to.
    listen: std::sync::OnceLock<[SocketAddr; 2]>,
    /// `[tracing]`, when on.
    tracing: Option<Arc<Tracing>>,
}

impl Proxy {
    /// Traces its requests with `tracing` (OpenTelemetry), when on.
    pub fn traced(mut self, tracing: Option<Arc<Tracing>>) -> Self {
        self.tracing = tracing;
        self
    }

    /// The tracer, when tracing is on.
    pub fn tracing(&self) -> Option<&Arc<Tracing>> {
        self.tracing.as_ref()
    }

    pub fn new(runtime: Runtime, metrics: Arc<Metrics>) -> Self {
        let body_memory = Arc::new(BodyMemory::new(
            runtime.config.listen.max_body_memory,
            metrics.counter(BODY_MEMORY_REFUSED, &[]),
        ));
        Self {
            runtime: ArcSwap::from_pointee(runtime),
            body_memory_held: metrics.gauge(BODY_MEMORY_HELD, &[]),
            metrics,
            tunnels: Arc::default(),
            body_memory,
            swapped: tokio::sync::Notify::new(),
            passthrough: std::sync::OnceLock::new(),
            listen: std::sync::OnceLock::new(),
            tracing: None,
        }
    }

    /// Once a second: upstream connections swept, limits relaxed, and the
    /// bytes of bodies held for replay reported.
    pub fn sweep(&self) {
        self.runtime().sweep();
        self.body_memory_held.set(self.body_memory.held() as f64);
    }

    pub fn runtime(&self) -> Arc<Runtime> {
        self.runtime.load_full()
    }

    /// Replaces routes and policies at once. Requests already routed finish
    /// on the runtime they started with; connections are not touched.
    pub fn swap(&self, runtime: Runtime) {
        self.body_memory
            .set_limit(runtime.config.listen.max_body_memory);
        self.runtime.store(Arc::new(runtime));
        self.swapped.notify_one();
    }

    /// The address callers reach the proxy at, once bound: a request
    /// passed through to it would loop.
    pub fn listening_on(&self, addr: SocketAddr, admin: SocketAddr) {
        let _ = self.listen.set([addr, admin]);
    }

    /// A request no route takes, passed through: to where its connection
    /// was going (redirected here), else to the host it names.
    async fn pass_through(
        &self,
        req: Box<Request<CallerBody>>,
        caller: &Caller,
        entry: &mut Option<Box<Entry>>,
    ) -> Response<ResponseBody> {
        let authority = match caller.original {
            Some(original) => original.to_string().parse().ok(),
            None => request_host(req.uri(), req.headers().get(HOST))
                .and_then(|h| h.parse::<http::uri::Authority>().ok()),
        };
        let https = req
            .uri()
            .scheme_str()
            .is_some_and(|s| s.eq_ignore_ascii_case("https"));
        let gone = PassedGone(Some(&self.metrics));
        let resp = match authority {
            Some(authority) if !https => {
                let write_timeout = self.runtime.load().config.listen.write_timeout;
                self.passthrough()
                    .forward(req, caller, authority, write_timeout)
                    .await
            }
            Some(_) => LocalError::BadRequest.response(
                "https:// is passed through with CONNECT (HTTPS_PROXY), not as a request",
            ),
            None => LocalError::BadRequest
                .response("no host to pass the request through to (absolute form or Host)"),
        };
        gone.disarm();
        passed_through(&self.metrics, entry, &resp);
        resp
    }

    /// A CONNECT, passed through: tunnelled to the host and port it names.
    async fn tunnel(
        &self,
        mut req: Box<Request<CallerBody>>,
        entry: &mut Option<Box<Entry>>,
    ) -> Response<ResponseBody> {
        let resp = match req.uri().authority().cloned() {
            Some(authority) => {
                self.passthrough()
                    .tunnel(&mut req, authority, &self.tunnels)
                    .await
            }
            None => LocalError::BadRequest.response("CONNECT needs host:port"),
        };
        let mut resp = resp;
        if !resp.status().is_success() {
            // What the caller sends next may be the tunnel's first bytes
            // (a TLS hello), never a request.
            resp.headers_mut()
                .insert(http::header::CONNECTION, HeaderValue::from_static("close"));
        }
        passed_through(&self.metrics, entry, &resp);
        resp
    }

    /// Whether requests no route takes are passed through.
    fn passes_through(&self) -> bool {
        self.runtime.load().config.listen.unrouted == crate::config::Unrouted::Passthrough
    }

    /// What passes unrouted requests through, made when first needed.
    fn passthrough(&self) -> &passthrough::Passthrough {
        self.passthrough.get_or_init(|| {
            let own = self.listen.get().copied().unwrap_or_else(|| {
                let config = &self.runtime.load().config;
                [config.listen.address, config.admin.address]
            });
            passthrough::Passthrough::new(own)
        })
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Sets the gauges that are cheaper to compute when scraped: the
    /// runtime's, and the passthrough tunnels open (once any was made).
    pub fn refresh_gauges(&self) {
        self.runtime.load().refresh_gauges();
        if let Some(passthrough) = self.passthrough.get() {
            self.metrics
                .gauge(metrics::TUNNELS_OPEN, &[("upstream", metrics::PASSTHROUGH)])
                .set(passthrough.tunnels.open() as f64);
        }
        if let Some(tracing) = self.tracing() {
            self.metrics
                .counter(metrics::SPANS_DROPPED, &[])
                .absolute(tracing.dropped());
            self.metrics
                .counter(metrics::SPANS_FAILED, &[])
                .absolute(tracing.failed());
        }
    }

    /// Upgraded connections (WebSockets) open now, under any config.
    pub fn tunnels(&self) -> &Arc<crate::upstream::tunnel::OpenTunnels> {
        &self.tunnels
    }

    /// Answers one request from `caller`; its access log line, if the log
    /// is on, is written when the response body is done with.
    ///
    /// The request comes boxed, and goes down boxed until it is taken
    /// apart: an `async fn` keeps room for each argument twice (the
    /// argument, and the local it is moved into) for as long as it runs,
    /// and a request's future is what every request in flight costs (its
    /// budget is a test below).
    pub async fn handle(
        &self,
        mut req: Box<Request<CallerBody>>,
        caller: &Caller,
    ) -> Response<Logged<ResponseBody>> {
        let start = clock::now();
        let mut present = Present::of(req.headers());
        let grpc = present.any(Present::CONTENT_TYPE) && headers::is_grpc(req.headers());
        // Made in a block of its own, so that what is only needed before
        // the answer takes no room in the future while the answer is awaited.
        let (mut entry, explain_id, span, mut trace) = {
            let runtime = self.runtime.load();
            // Read back only when something writes it down: a copy costs
            // an allocation.
            let explain = present.any(Present::EXPLAIN);
            let wanted = explain || runtime.access_log.is_some() || logs_requests();
            if let Some(name) = &runtime.request_id {
                // An id nothing here reads, for a caller that sent none, is
                // made where the request is forwarded, with this hop's own
                // fields: put in the caller's map, it would grow the map.
                // (No route can be told apart by it: it is random.)
                let later = !wanted && !self.passes_through() && !req.headers().contains_key(name);
                match later {
                    true => present = present.with(Present::MAKE_ID),
                    false => identity::keep_or_make(name, req.headers_mut()),
                }
            }
            let id = match (&runtime.request_id, wanted) {
                (Some(name), true) => req.headers().get(name).cloned(),
                _ => None,
            };
            let trace = self
                .tracing
                .as_ref()
                .map(|t| t.request(req.method(), req.headers()));
            // Filled in as the request goes: should its caller leave before
            // the answer (this future dropped), the line says how far it got.
            let entry = runtime.access_log.as_ref().map(|log| {
                let mut entry = log.entry(req.method(), req.uri().path(), start);
                entry.request_id = id.clone();
                entry.trace_id = match &trace {
                    Some(trace) => Some(trace.trace_id()),
                    None => identity::trace_id(req.headers()).map(|t| t.0),
                };
                entry
            });
            // Kept for the explain header when asked for, on the heap.
            let explain_id = match explain {
                true => id.clone().map(Box::new),
                false => None,
            };
            let span = request_span(id.as_ref(), trace.as_deref(), &req);
            (entry, explain_id, span, trace)
        };
        let mut resp = match span {
            // Every log line about the request names it.
            Some(span) => {
                use tracing::Instrument as _;
                let answer = self.answer(req, present, caller, start, &mut entry, trace.as_deref());
                Box::pin(answer.instrument(span)).await
            }
            None => {
                // Moved out: the future keeps no room for it.
                drop(span);
                self.answer(req, present, caller, start, &mut entry, trace.as_deref())
                    .await
            }
        };
        if grpc {
            resp = error::grpc_shaped(resp);
        }
        if let Some(id) = explain_id {
            explained(&mut resp, &id);
        }
        if let Some(entry) = entry.as_mut() {
            entry.status = resp.status().as_u16();
            entry.error = resp.headers().get(&headers::X_HERDGUARD_ERROR).cloned();
        }
        if let Some(trace) = &mut trace {
            traced_answer(trace, &resp);
        }
        let (parts, body) = resp.into_parts();
        Response::from_parts(parts, Logged::new(body, entry).traced(trace))
    }

    async fn answer(
        &self,
        req: Box<Request<CallerBody>>,
        present: Present,
        caller: &Caller,
        start: Instant,
        entry: &mut Option<Box<Entry>>,
        trace: Option<&RequestTrace>,
    ) -> Response<ResponseBody> {
        if req.method() == Method::CONNECT && self.passes_through() {
            // Boxed: the request's future keeps no room for it.
            return Box::pin(self.tunnel(req, entry)).await;
        }
        if let Some(resp) = refused_at_once(&req) {
            metrics::unrouted(&self.metrics, resp.status());
            return resp;
        }
        let host_field = match checked_head(&req, present) {
            Ok(field) => field,
            Err(resp) => {
                metrics::unrouted(&self.metrics, resp.status());
                return *resp;
            }
        };
        let route = {
            let runtime = self.runtime.load();
            // Routes see the path as the upstream will resolve it:
            // `/public/../admin` is `/admin`.
            let path = crate::policy::route::without_dot_segments(req.uri().path());
            let info = RequestInfo {
                // Read only where a route matches on it.
                host: match runtime.by_host {
                    true => request_host(req.uri(), host_field),
                    false => None,
                },
                method: req.method(),
                path: &path,
                headers: req.headers(),
            };
            runtime.route(&info).cloned()
        };
        let Some(route) = route else {
            if self.passes_through() {
                // Boxed: the request's future keeps no room for it.
                return Box::pin(self.pass_through(req, caller, entry)).await;
            }
            let resp = LocalError::NoRoute.response(&format!(
                "no route for {} {}{}",
                req.method(),
                request_host(req.uri(), host_field).unwrap_or(""),
                req.uri().path()
            ));
            metrics::unrouted(&self.metrics, resp.status());
            return resp;
        };
        if let Some(entry) = entry.as_mut() {
            entry.route = Some(route.name.clone());
        }
        let counted = Counted {
            route: Some(&route.guards.metrics),
            start: &start,
        };
        let resp = forward(
            &route,
            req,
            present,
            caller,
            start,
            entry.as_deref_mut(),
            &self.tunnels,
            &self.body_memory,
            trace,
        )
        .await;
        let source = answered_by(&resp);
        counted.disarm();
        route.guards.metrics.request(
            resp.status(),
            source,
            clock::now().saturating_duration_since(start),
        );
        resp
    }
}

/// Who made a routed request's answer, for its metrics: an answer with the
/// upstream's body is the upstream's (an inner hop's `x-herdguard-error`
/// or `x-herdguard-fault` included: that hop is upstream of this one);
/// one the proxy made says so in its fields. The upstream's own
/// `x-herdguard-error` was dropped from them: one left is ours.
fn answered_by(resp: &Response<ResponseBody>) -> metrics::Source {
    if resp.body().is_upstream() {
        return metrics::Source::Upstream;
    }
    let h = resp.headers();
    let marked = Present::of(h);
    match marked.any(Present::ERROR)
        || (marked.any(Present::FAULT)
            && h.get(&headers::X_HERDGUARD_FAULT)
                .is_some_and(|v| v == "abort"))
    {
        true => metrics::Source::Proxy,
        false => metrics::Source::Upstream,
    }
}

/// The status of a request whose caller left before its answer (nginx's
/// "client closed request"), as the access log has it.
fn gone() -> StatusCode {
    StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST)
}

/// A routed request taken in hand: counted as 499 should it be dropped
/// unanswered. Two references: every request in flight keeps it.
struct Counted<'a> {
    route: Option<&'a metrics::RouteMetrics>,
    start: &'a Instant,
}

impl Counted<'_> {
    fn disarm(mut self) {
        self.route = None;
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        if let Some(route) = self.route {
            route.request(
                gone(),
                metrics::Source::Proxy,
                clock::now().saturating_duration_since(*self.start),
            );
        }
    }
}

/// A request being passed through: counted as 499 should it be dropped
/// unanswered.
struct PassedGone<'a>(Option<&'a Metrics>);

impl PassedGone<'_> {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for PassedGone<'_> {
    fn drop(&mut self) {
        if let Some(registry) = self.0 {
            metrics::passthrough(registry, gone(), true);
        }
    }
}

/// Whether lines about single requests are logged (debug and finer).
fn logs_requests() -> bool {
    tracing::level_filters::LevelFilter::current() >= tracing::level_filters::LevelFilter::DEBUG
}

/// The span of a request's log lines, naming its id and trace; only while
/// debug lines are logged (no line about a request is logged above debug).
fn request_span(
    id: Option<&HeaderValue>,
    trace: Option<&RequestTrace>,
    req: &Request<CallerBody>,
) -> Option<tracing::Span> {
    if !logs_requests() {
        return None;
    }
    let trace = match trace {
        Some(trace) => Some(identity::TraceId(trace.trace_id())),
        None => identity::trace_id(req.headers()),
    };
    Some(tracing::info_span!(
        "request",
        request_id = id.and_then(|v| v.to_str().ok()),
        trace_id = trace.map(tracing::field::display),
    ))
}

/// Tells the request's span how it was answered.
fn traced_answer(trace: &mut RequestTrace, resp: &Response<ResponseBody>) {
    // The proxy's own errors are never successes: a 2xx is not looked into.
    let error = match resp.status().is_success() {
        true => None,
        false => resp
            .headers()
            .get(&headers::X_HERDGUARD_ERROR)
            .and_then(|v| v.to_str().ok()),
    };
    trace.answered(resp.status().as_u16(), error);
}

/// Names the request's id in its explain trace (`…;request_id=ID`).
fn explained(resp: &mut Response<ResponseBody>, id: &HeaderValue) {
    let h = resp.headers_mut();
    let Some(trace) = h.get(&headers::X_HERDGUARD_EXPLAIN) else {
        return;
    };
    let mut value = trace.as_bytes().to_vec();
    value.extend_from_slice(b";request_id=");
    value.extend_from_slice(id.as_bytes());
    if let Ok(value) = HeaderValue::from_bytes(&value) {
        h.insert(&headers::X_HERDGUARD_EXPLAIN, value);
    }
}

/// The request's head checked before anything is routed: one `Host`,
/// plain framing, no look-alike fields, hops left, an http scheme. Its
/// `Host` field, or the proxy's answer.
fn checked_head(
    req: &Request<CallerBody>,
    present: Present,
) -> Result<Option<&HeaderValue>, Box<Response<ResponseBody>>> {
    let checked = headers::check_host(req.version(), req.headers())
        .map_err(|problem| (LocalError::BadRequest, problem))
        .and_then(|host| {
            // Without a `Transfer-Encoding`, the framing is hyper's alone.
            if !present.any(Present::TRANSFER_ENCODING) {
                return Ok(host);
            }
            headers::check_framing(req.headers())
                .map(|()| host)
                .map_err(|(status, problem)| match status {
                    StatusCode::NOT_IMPLEMENTED => (LocalError::NotImplemented, problem),
                    _ => (LocalError::BadRequest, problem),
                })
        })
        .and_then(|host| {
            headers::check_look_alikes(req.uri(), req.headers(), present)
                .map(|()| host)
                .map_err(|problem| (LocalError::BadRequest, problem))
        });
    let host_field = match checked {
        Ok(field) => field,
        Err((error, problem)) => {
            let mut resp = error.response(problem);
            // Its framing (or its head) is in doubt: what follows on an
            // HTTP/1 connection may be its body, never a new request.
            if req.version() < Version::HTTP_2 {
                resp.headers_mut()
                    .insert(http::header::CONNECTION, HeaderValue::from_static("close"));
            }
            return Err(Box::new(resp));
        }
    };
    if let Some(resp) = error::max_forwards_reached(req) {
        return Err(Box::new(resp));
    }
    // An absolute-form request names a scheme: only http (https
    // callers would use CONNECT, which is refused).
    if let Some(scheme) = req.uri().scheme_str() {
        if !scheme.eq_ignore_ascii_case("http") && !scheme.eq_ignore_ascii_case("https") {
            return Err(Box::new(LocalError::BadRequest.response(&format!(
                "{scheme}:// requests are not proxied; only http://"
            ))));
        }
    }
    Ok(host_field)
}

/// The request's authority: from the URI (absolute-form or HTTP/2) or `Host`.
fn request_host<'a>(uri: &'a http::Uri, host: Option<&'a HeaderValue>) -> Option<&'a str> {
    // `Host` was checked to be host characters alone (ASCII): read as
    // UTF-8, a word at a time, rather than byte by byte as `to_str` does.
    uri.authority()
        .map(|a| a.as_str())
        .or_else(|| host.and_then(|h| std::str::from_utf8(h.as_bytes()).ok()))
}

/// The answer to a request refused before anything is looked at: one past
/// the bounds on requests held at once, or a CONNECT where nothing is
/// passed through.
fn refused_at_once(req: &Request<CallerBody>) -> Option<Response<ResponseBody>> {
    match req.extensions().get::<crate::wire::Crowded>() {
        Some(crate::wire::Crowded::Held) => return Some(LocalError::Overloaded.response(
            "too many requests held at once (HTTP/2 streams on this listener, or large request heads); try again shortly",
        )),
        Some(crate::wire::Crowded::Memory) => return Some(LocalError::Overloaded.response(
            "memory is short (listen.max_memory): callers that read nothing are being cut; try again shortly",
        )),
        None => {}
    }
    if req.method() != Method::CONNECT {
        return None;
    }
    let mut resp = LocalError::NotProxied.response(
        "CONNECT is not proxied here (listen.unrouted = \"refuse\"); herdguard is a reverse proxy",
    );
    // What the caller sends next may be the tunnel's first bytes (a TLS
    // hello), never a request.
    resp.headers_mut()
        .insert(http::header::CONNECTION, HeaderValue::from_static("close"));
    Some(resp)
}

/// Counts a request passed through (route `passthrough`), in the metrics
/// and its access log line.
fn passed_through(
    registry: &Metrics,
    entry: &mut Option<Box<Entry>>,
    resp: &Response<ResponseBody>,
) {
    let own = resp.headers().contains_key(&headers::X_HERDGUARD_ERROR);
    metrics::passthrough(registry, resp.status(), own);
    if let Some(entry) = entry.as_mut() {
        entry.route = Some(Arc::from(metrics::PASSTHROUGH));
        entry.attempts = u32::from(resp.headers().contains_key(&headers::X_HERDGUARD_ATTEMPTS));
    }
}

#[allow(clippy::too_many_arguments)]
async fn forward(
    route: &Arc<Route>,
    mut req: Box<Request<CallerBody>>,
    present: Present,
    caller: &Caller,
    start: Instant,
    mut log: Option<&mut Entry>,
    tunnels: &Arc<crate::upstream::tunnel::OpenTunnels>,
    body_memory: &Arc<BodyMemory>,
    trace: Option<&RequestTrace>,
) -> Response<ResponseBody> {
    // Only a connection that can hand its caller's side over is upgraded.
    let upgrade = headers::requested_upgrade_found(req.version(), req.headers(), present)
        && req.extensions().get::<CallerUpgrade>().is_some();
    let multiplexed = req.version() == Version::HTTP_2;
    // A request that asks to upgrade takes a tunnel place first: tunnels
    // are counted apart from requests in flight.
    let tunnel_place = match upgrade {
        true => match route.upstream.tunnels.try_reserve() {
            Some(place) => Some(place),
            None => return tunnels_full(route),
        },
        false => None,
    };
    let caller_upgrade = match upgrade {
        true => req.extensions_mut().remove::<CallerUpgrade>(),
        false => None,
    };

    let (mut parts, body) = (*req).into_parts();
    let original_host = match parts.uri.authority() {
        Some(authority) => HeaderValue::from_str(authority.as_str()).ok(),
        None => parts.headers.get(HOST).cloned(),
    };
    let explain = present.any(Present::EXPLAIN)
        && parts
            .headers
            .remove(&headers::X_HERDGUARD_EXPLAIN)
            .is_some_and(|v| v == "1")
        && route.explain;
    let fault_note = match &route.fault {
        Some(fault) => match inject_fault(fault).await {
            Ok(note) => note,
            Err(resp) => return resp,
        },
        None => None,
    };
    let HeadRules {
        hop,
        facts,
        inner_hop,
        grpc,
        grpc_timeout,
        declare_grpc_trailers,
    } = head_rules(route, &mut parts, present, caller, (upgrade, original_host));
    let policy = &route.guards.policy;
    // In a block of its own, so that the attempts are dropped where they
    // are (a `drop` call would first copy them, a few hundred bytes).
    let sent = {
        let mut attempts = attempt::Forward::new(attempt::Outbound {
            upstream: &route.upstream,
            method: parts.method,
            path_and_query: parts.uri.path_and_query(),
            headers: parts.headers,
            hop,
            body,
            retrying: policy.may_retry(&facts),
            repeatable: facts.idempotent,
            inner_hop,
            max_replay_body: policy.max_replay_body,
            body_memory,
            timeout: policy.timeout,
            upgrade,
            multiplexed,
            path: facts.path,
        });
        attempts.host_rewrite(route.host_rewrite.clone());
        attempts.log_into(log.as_deref_mut());
        attempts.trace_into(trace);
        attempts.grpc(grpc, grpc_timeout.and_then(|t| start.checked_add(t)));
        // A gRPC caller's own deadline, when sooner than the route's.
        let deadline = match grpc_timeout {
            Some(t) => retry::deadline(start, policy.timeout.min(t)),
            None => retry::deadline(start, policy.timeout),
        };
        // The caller's own deadline (`grpc-timeout`) binds: when it runs out
        // before the body is in, that is the deadline, not a stalled upload.
        let callers_deadline = grpc_timeout.is_some_and(|t| t < policy.timeout);
        if let Err((fault, detail)) = attempts.prefetch(deadline).await {
            return body_not_in(fault, detail, callers_deadline);
        }
        retry::run_until(
            &route.guards,
            facts,
            &mut attempts,
            start,
            deadline,
            explain,
        )
        .await
    };
    if let (Some(trace), Some(skipped)) = (trace, sent.skipped) {
        trace.skipped(skipped.as_str());
    }
    // A path its breaker tracks is named for `/breakers`.
    route.guards.paths.name(facts.path, parts.uri.path());
    let answer = Answer {
        caller_upgrade,
        tunnel_place,
        declare_grpc_trailers,
        fault_note,
        multiplexed,
        path: facts.path,
    };
    respond(route, sent, answer, log, tunnels)
}

/// What the request's head tells, read as the upstream will see it.
struct HeadRules {
    /// This hop's own fields (`Via`, `X-Forwarded-*`).
    hop: headers::HopFields,
    facts: RequestFacts,
    /// An outer hop numbers the attempts: it retries, this one does not.
    inner_hop: bool,
    grpc: bool,
    /// The gRPC caller's own deadline.
    grpc_timeout: Option<std::time::Duration>,
    /// An HTTP/1.1 gRPC caller is told of the status trailers to come.
    declare_grpc_trailers: bool,
}

/// Applies this hop's rules to the request's head (hop-by-hop fields out,
/// `Max-Forwards` down, `Via` and `X-Forwarded-*` added), and reads what
/// makes it safe to repeat and whether it is gRPC.
fn head_rules(
    route: &Route,
    parts: &mut http::request::Parts,
    present: Present,
    caller: &Caller,
    (upgrade, original_host): (bool, Option<HeaderValue>),
) -> HeadRules {
    let h = &mut parts.headers;
    // A key the caller declares it will send in the trailer section may
    // differ from the one here: it promises nothing.
    let key_in_trailer = present.any(Present::TRAILER)
        && headers::lists(
            h,
            &http::header::TRAILER,
            route.guards.policy.idempotency_header().as_str(),
        );
    // An HTTP/1.1 caller gets only the trailers a response declares in
    // `Trailer`; gRPC over HTTP/2 never declares its status trailers.
    let declare_grpc_trailers = parts.version != Version::HTTP_2
        && present.any(Present::TE)
        && present.any(Present::CONTENT_TYPE)
        && headers::is_grpc(h)
        && headers::lists(h, &http::header::TE, "trailers");
    headers::strip_hop_by_hop_found(h, upgrade, present);
    headers::decrement_max_forwards(&parts.method, h);
    // What makes a request safe to repeat is read from what the upstream
    // will see: a key named in `Connection` was just dropped, and counts not.
    let inner_hop = present.any(Present::ATTEMPT) && h.contains_key(&headers::X_HERDGUARD_ATTEMPT);
    let policy = &route.guards.policy;
    let mut facts = match key_in_trailer {
        true => policy.facts(&parts.method, &http::HeaderMap::new(), inner_hop),
        false => policy.facts(&parts.method, h, inner_hop),
    };
    // Blame is kept per path too, as routing reads it: `/a/./b` is `/a/b`.
    facts.path = route
        .guards
        .paths
        .key(&crate::policy::route::without_dot_segments(
            parts.uri.path(),
        ));
    let grpc = present.any(Present::CONTENT_TYPE) && headers::is_grpc(h);
    let grpc_timeout = grpc
        .then(|| h.get("grpc-timeout").and_then(headers::parse_grpc_timeout))
        .flatten();
    // Kept beside the map, not put in it (see `upstream::outgoing`).
    let mut hop = headers::HopFields::new(
        h,
        present,
        (parts.version, &caller.ip, caller.proto),
        original_host,
    );
    if let (true, Some(name)) = (present.any(Present::MAKE_ID), &route.request_id) {
        hop = hop.with_id(name);
    }
    HeadRules {
        hop,
        facts,
        inner_hop,
        grpc,
        grpc_timeout,
        declare_grpc_trailers,
    }
}

/// What the request's preparation left for its answer.
struct Answer {
    caller_upgrade: Option<CallerUpgrade>,
    tunnel_place: Option<crate::upstream::tunnel::TunnelSlot>,
    declare_grpc_trailers: bool,
    fault_note: Option<HeaderValue>,
    multiplexed: bool,
    /// The request's path, for its breaker (see `policy::paths`).
    path: crate::policy::paths::PathKey,
}

/// The caller's answer from how the attempts ended: the upstream's answer
/// with this hop's headers (and, for a switch of protocols, the tunnel
/// started), or the proxy's own.
fn respond(
    route: &Arc<Route>,
    sent: retry::Sent<attempt::Answer>,
    answer: Answer,
    log: Option<&mut Entry>,
    tunnels: &Arc<crate::upstream::tunnel::OpenTunnels>,
) -> Response<ResponseBody> {
    let Answer {
        caller_upgrade,
        tunnel_place,
        declare_grpc_trailers,
        fault_note,
        multiplexed,
        path,
    } = answer;
    if let (Some(log), Some(skipped)) = (log, sent.skipped) {
        log.skip = Some(skipped.as_str());
    }
    let attempts = attempt::attempt_value(sent.attempts);
    // What the caller is told besides the answer: the trace, an injected delay.
    let notes = |h: &mut http::HeaderMap| {
        if let Some(trace) = sent
            .trace
            .as_deref()
            .and_then(|t| HeaderValue::from_str(t).ok())
        {
            h.insert(&headers::X_HERDGUARD_EXPLAIN, trace);
        }
        if let Some(note) = fault_note.clone() {
            h.insert(&headers::X_HERDGUARD_FAULT, note);
        }
    };
    let (mut resp, slot) = match sent.end {
        End::Answer(pair) => *pair,
        End::Failed {
            outcome,
            detail,
            retry_after,
        } => {
            let mut resp = LocalError::for_outcome(outcome).response_with(&detail, retry_after);
            resp.headers_mut()
                .insert(&headers::X_HERDGUARD_ATTEMPTS, attempts);
            notes(resp.headers_mut());
            return resp;
        }
    };

    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        if let (Some(caller), Some(place)) = (caller_upgrade, tunnel_place) {
            let upstream_side = hyper::upgrade::on(&mut resp);
            let tracked = tunnels.track();
            tokio::spawn(crate::upstream::tunnel::relay(
                caller,
                upstream_side,
                slot,
                place,
                tracked,
            ));
            let (mut parts, _) = resp.into_parts();
            finish_headers(&mut parts.headers, true, attempts);
            return Response::from_parts(parts, ResponseBody::local(bytes::Bytes::new()));
        }
    }
    let (mut parts, body) = resp.into_parts();
    let settle = sent.settle_on_body.then(|| (route.clone(), path));
    finish_headers(&mut parts.headers, false, attempts);
    if declare_grpc_trailers
        && !parts.headers.contains_key(http::header::TRAILER)
        && headers::is_grpc(&parts.headers)
    {
        parts.headers.insert(
            http::header::TRAILER,
            HeaderValue::from_static("grpc-status, grpc-message, grpc-status-details-bin"),
        );
    }
    notes(&mut parts.headers);
    Response::from_parts(
        parts,
        match multiplexed {
            true => ResponseBody::watched(body, slot, route.write_timeout, settle),
            false => ResponseBody::upstream(body, slot, route.write_timeout, settle),
        },
    )
}

/// The 503 when the upstream has `max_tunnels` upgraded connections open.
fn tunnels_full(route: &Route) -> Response<ResponseBody> {
    LocalError::Overloaded.response(&format!(
        "upstream {} has {} upgraded connections open, its max_tunnels",
        route.upstream.name,
        route.upstream.tunnels.max()
    ))
}

/// The route's injected faults, drawn for this request: a delay (slept
/// here, and noted for the caller) or an abort (answered at once).
async fn inject_fault(
    fault: &crate::config::FaultConfig,
) -> Result<Option<HeaderValue>, Response<ResponseBody>> {
    let (delay, abort) = {
        let mut rng = rand::rng();
        (
            rng.random::<f64>() < fault.delay_ratio,
            rng.random::<f64>() < fault.abort,
        )
    };
    let mut note = None;
    if delay {
        tokio::time::sleep(fault.delay).await;
        note = Some(HeaderValue::from_static("delay"));
    }
    match abort {
        true => Err(error::fault_response(fault.abort_status)),
        false => Ok(note),
    }
}

/// The answer when the request's body could not be read before the first
/// attempt: the caller's fault, or its own deadline (`callers_deadline`)
/// that ran out first.
fn body_not_in(
    fault: CallerFault,
    detail: String,
    callers_deadline: bool,
) -> Response<ResponseBody> {
    let outcome = match fault {
        CallerFault::StalledBody if callers_deadline => crate::policy::Outcome::Deadline,
        fault => crate::policy::Outcome::Caller(fault),
    };
    let detail = match outcome {
        crate::policy::Outcome::Deadline => {
            "the caller's grpc-timeout ran out before its request body was in".to_owned()
        }
        _ => detail,
    };
    let mut resp = LocalError::for_outcome(outcome).response(&detail);
    resp.headers_mut()
        .insert(&headers::X_HERDGUARD_ATTEMPTS, attempt::attempt_value(0));
    resp
}

fn finish_headers(h: &mut http::HeaderMap, upgrade: bool, attempts: HeaderValue) {
    // Via and the attempt count: grow once.
    h.reserve(2);
    // Only the proxy speaks for itself: an upstream's own copy would pose
    // as the proxy's error.
    let found = Present::of(h);
    if found.any(Present::ERROR) {
        h.remove(&headers::X_HERDGUARD_ERROR);
    }
    headers::strip_answer_hop_by_hop_found(h, upgrade, found);
    headers::add_via(h, Version::HTTP_11);
    h.insert(&headers::X_HERDGUARD_ATTEMPTS, attempts);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::breaker::Outcome as BreakerOutcome;

    fn config(ca_file: Option<&std::path::Path>, failures: u32) -> Validated {
        let mut src = format!(
            "[upstreams.u]\nendpoints = [\"http://127.0.0.1:9\"]\n\
             [[routes]]\nname = \"r\"\nupstream = \"u\"\n\
             breaker = {{ consecutive_failures = {failures} }}\n\
             retry = {{ budget = {{ min_per_second = {failures} }} }}\n"
        );
        if let Some(ca) = ca_file {
            src.push_str(&format!(
                "[upstreams.t]\nendpoints = [\"https://127.0.0.1:9\"]\nca_file = {:?}\n\
                 [[routes]]\nname = \"s\"\nupstream = \"t\"\nmatch = {{ path_prefix = \"/s\" }}\n",
                ca.display()
            ));
        }
        crate::config::Config::check_str(&src).unwrap().validated
    }

    /// Everything of a runtime's live state a reload could touch.
    fn state(runtime: &Runtime) -> (String, f64, usize, *const Upstream) {
        let route = &runtime.routes[0];
        let now = Instant::now();
        (
            route.guards.breaker.with(|b| format!("{b:?}")),
            route.guards.budget.available(now),
            route.upstream.limit(),
            Arc::as_ptr(&route.upstream),
        )
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_rebuild_leaves_the_running_state_as_it_was() {
        let registry = Metrics::new();
        let running = Runtime::build(config(None, 2), &registry).unwrap();
        let route = &running.routes[0];
        route.guards.record(
            crate::retry::Probe::NONE,
            BreakerOutcome::Failure,
            crate::policy::paths::PathKey::NONE,
        );
        route.guards.budget.deposit(Instant::now());
        let before = state(&running);

        // Passes the checks, then the CA file is replaced before the build
        // (a rotation caught half way): the build fails at the new upstream,
        // after the kept one, with the kept route's breaker and budget changed.
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
        std::fs::write(&ca, cert.cert.pem()).unwrap();
        let broken = config(Some(&ca), 50);
        std::fs::write(&ca, "not a certificate\n").unwrap();
        match Runtime::rebuild(broken, &registry, Some(&running)) {
            Err(BuildError::Upstream(_)) => {}
            Err(e) => panic!("failed, but not at the upstream: {e}"),
            Ok(_) => panic!("a CA file with no certificate built"),
        }
        assert_eq!(state(&running), before);

        // The same change without the broken upstream applies it.
        let rebuilt = Runtime::rebuild(config(None, 50), &registry, Some(&running)).unwrap();
        assert!(Arc::ptr_eq(&rebuilt.routes[0].upstream, &route.upstream));
        assert!(Arc::ptr_eq(
            &rebuilt.routes[0].guards.breaker,
            &route.guards.breaker
        ));
        assert_ne!(
            state(&running).0,
            before.0,
            "the kept breaker took the new thresholds"
        );
    }

    /// The size of the future `make` would return, without making it.
    fn size_of_future<F: std::future::Future>(_make: impl FnOnce() -> F) -> usize {
        std::mem::size_of::<F>()
    }

    /// What each request in flight costs before it allocates anything: the
    /// request goes down boxed (an `async fn` keeps room for each argument
    /// twice, the argument and the local it is moved into, for as long as
    /// it runs), and the future stays within a budget of its own (raised
    /// by 64 bytes for the pooled connection's count of what comes before
    /// a response's head: eight bytes in each state that holds one; and by
    /// 8 for the fields found in the request's one pass over its names,
    /// which spares it about 800 instructions of look-ups; then lowered by
    /// 504 when an attempt's answer went on the heap, and by 160 when the
    /// request's fields went on the heap once, shared by its attempts).
    #[test]
    #[allow(unreachable_code)]
    fn a_request_in_flight_fits_its_budget() {
        let registry = Metrics::new();
        let proxy = Proxy::new(
            Runtime::build(config(None, 2), &registry).unwrap(),
            registry,
        );
        let caller = Caller::new("127.0.0.1:1".parse().unwrap(), false);
        let size =
            size_of_future(|| proxy.handle(unreachable!("only its type is needed"), &caller));
        eprintln!("a request's future: {size} bytes");
        assert!(size <= 3_760, "a request's future grew to {size} bytes");
    }
}
