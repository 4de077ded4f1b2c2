//! An upstream: its endpoints, round-robin balancing, the in-flight count
//! that sheds load above `max_in_flight`, and two ways to send: plain HTTP/1.1
//! endpoints get their own lean connection pool (`pool.rs`); TLS (rustls,
//! ring provider) and HTTP/2 go through hyper-util's pooled client.

pub(crate) mod attempt;
pub(crate) mod body;
pub(crate) mod classify;
pub(crate) mod discovery;
pub(crate) mod framing;
pub(crate) mod heads;
pub(crate) mod outgoing;
pub(crate) mod plain;
pub(crate) mod pool;
pub mod replay;
pub(crate) mod tunnel;

pub use body::{caller_fault, BoxError, Progress, RequestBody, UpstreamBody};
pub use pool::{PoolError, Pooled};
pub use replay::{BodyMemory, ReplayBody, BODY_MEMORY_HELD, BODY_MEMORY_REFUSED};

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use crate::units::clock;
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{HeaderValue, Response, Uri};
use hyper_rustls::{FixedServerNameResolver, HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use rustls::pki_types::ServerName;
use rustls::{ClientConfig, RootCertStore};
use tokio::time::Instant;

use crate::config::tls::{read_certs, read_key};
use crate::config::{Discovery, Http2Mode, OutlierConfig, UpstreamConfig};
use crate::observe::metrics::{EndpointMetrics, Metrics, UpstreamMetrics};
use crate::policy::limit::{Limiter, Sample};
use crate::policy::outlier::{Event, Outliers, Pick, PickKind, State as OutlierState, Verdict};
use crate::policy::paths::PathKey;
use crate::policy::{Outcome, UpstreamFault};

use self::pool::H1Pool;
use self::tunnel::Tunnels;

pub type HttpClient = Client<HttpsConnector<HttpConnector>, RequestBody>;

/// Why an upstream could not be built from its (validated) config.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("upstreams.{upstream}.endpoints: needs at least one endpoint")]
    NoEndpoints { upstream: String },
    #[error("upstreams.{upstream}.endpoints: {endpoint:?} is not scheme://host[:port]")]
    Endpoint { upstream: String, endpoint: String },
    #[error("upstreams.{upstream}.adaptive_concurrency: {message}")]
    Limit { upstream: String, message: String },
    #[error("upstreams.{upstream}.outlier.{key}: {message}")]
    Outlier {
        upstream: String,
        key: &'static str,
        message: String,
    },
    #[error("upstreams.{upstream}.{key}: {message}")]
    Tls {
        upstream: String,
        key: &'static str,
        message: String,
    },
}

/// Why an attempt got no response.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    #[error(transparent)]
    Pool(PoolError),
    #[error(transparent)]
    Client(hyper_util::client::legacy::Error),
}

impl SendError {
    /// No connection was made: nothing reached the upstream.
    pub fn is_connect(&self) -> bool {
        match self {
            SendError::Pool(e) => e.is_connect(),
            SendError::Client(e) => e.is_connect(),
        }
    }

    /// Which of the upstream's failures this is, as `retry_on` names them.
    /// (A failure of the caller's body is told apart before this is asked:
    /// see `Progress::caller_fault`.)
    pub fn fault(&self) -> UpstreamFault {
        if self.is_connect() {
            return UpstreamFault::ConnectFailure;
        }
        if let SendError::Pool(PoolError::Stale { .. }) = self {
            return UpstreamFault::StaleConnection;
        }
        let mut source: Option<&(dyn std::error::Error + 'static)> = match self {
            SendError::Pool(e) => Some(e),
            SendError::Client(e) => Some(e),
        };
        while let Some(s) = source {
            // Informational answers without end: it would only send them again.
            let broke_http = s
                .downcast_ref::<plain::ExchangeError>()
                .is_some_and(plain::ExchangeError::broke_http);
            if heads::EndlessInformational::is(s) || broke_http {
                return UpstreamFault::BadResponse;
            }
            if let Some(h) = s.downcast_ref::<hyper::Error>() {
                // The request was never written: its pooled connection closed first.
                if h.is_canceled() {
                    return UpstreamFault::ConnectFailure;
                }
                // The response's head broke HTTP: it would only break again.
                if h.is_parse() || h.is_parse_too_large() || h.is_parse_status() {
                    return UpstreamFault::BadResponse;
                }
            }
            if let Some(h2) = s.downcast_ref::<h2::Error>() {
                if h2.reason() == Some(h2::Reason::REFUSED_STREAM) {
                    return UpstreamFault::RefusedStream;
                }
            }
            source = s.source();
        }
        UpstreamFault::Reset
    }
}

/// One `scheme://host:port` of an upstream, pre-parsed.
pub struct Endpoint {
    /// As the config writes it: the `endpoint` label of its metrics.
    pub label: Arc<str>,
    scheme: Scheme,
    authority: Authority,
    /// The `Host` header sent to this endpoint.
    pub host: HeaderValue,
    /// The endpoint's path (`http://host/api/v1` → `/api/v1`), prefixed
    /// to every path forwarded to it; `None` for `/` or none.
    base: Option<Box<str>>,
    transport: Transport,
    /// Its ejection series, when it can be ejected (one of several, or
    /// found by DNS): they go with it.
    metrics: Option<EndpointMetrics>,
}

/// How requests reach an endpoint.
enum Transport {
    /// Plain HTTP/1.1: its own connection pool.
    Pool(H1Pool),
    /// TLS or HTTP/2: hyper-util's client, shared by the upstream's endpoints.
    Client(Arc<HttpClient>),
}

impl Endpoint {
    /// Plain HTTP/1.1 endpoints get their own pool; the others share the
    /// upstream's TLS/HTTP/2 client, built (system roots loaded) only for them.
    /// `host`: the `Host` sent, when it is not `url`'s authority (an
    /// address found by DNS for a name).
    fn parse(
        name: &str,
        url: &str,
        config: &UpstreamConfig,
        client: &mut dyn FnMut() -> Result<Arc<HttpClient>, UpstreamError>,
        host: Option<&HeaderValue>,
    ) -> Result<Self, UpstreamError> {
        let bad = || UpstreamError::Endpoint {
            upstream: name.to_owned(),
            endpoint: url.to_owned(),
        };
        let uri: Uri = url.parse().map_err(|_| bad())?;
        let (Some(authority), Some(scheme)) = (uri.authority().cloned(), uri.scheme().cloned())
        else {
            return Err(bad());
        };
        let transport = if scheme == Scheme::HTTP && config.http2 != Http2Mode::Always {
            Transport::Pool(H1Pool::new(authority.clone(), config))
        } else {
            Transport::Client(client()?)
        };
        let base = uri.path().trim_end_matches('/');
        Ok(Self {
            label: url.into(),
            scheme,
            base: (!base.is_empty()).then(|| base.into()),
            host: match host {
                Some(host) => host.clone(),
                None => HeaderValue::from_str(authority.as_str()).map_err(|_| bad())?,
            },
            authority,
            transport,
            metrics: None,
        })
    }

    /// Sends one attempt to this endpoint. A pooled connection comes back
    /// with the response, to be held until its body is done with. (Not an
    /// `async fn`: one would keep the request twice, as its argument and
    /// as a local, for as long as the attempt lasts.)
    /// `careful`: the request cannot be repeated should it be lost in the
    /// close of an idle connection (see `pool.rs`). `own`: herdguard's own
    /// exchange may carry it (see `plain.rs`).
    pub fn send<'a>(
        &'a self,
        path_and_query: Option<&'a PathAndQuery>,
        req: outgoing::Outgoing,
        careful: bool,
        own: bool,
    ) -> Sending<impl Future<Output = pool::Sent> + 'a> {
        use std::borrow::Cow;
        let path_and_query = match (&self.base, path_and_query) {
            (Some(base), Some(pq)) if pq.path().starts_with('/') => {
                Some(with_base(base, pq).map_or(Cow::Borrowed(pq), Cow::Owned))
            }
            (Some(base), None) => with_base(base, &PathAndQuery::from_static("/")).map(Cow::Owned),
            // `OPTIONS *` asks about the server, not a path: no base.
            _ => path_and_query.map(Cow::Borrowed),
        };
        match &self.transport {
            Transport::Pool(pool) => Sending::Pool {
                send: pool.send(req, path_and_query, careful, own),
            },
            Transport::Client(client) => {
                let mut req = req.into_request();
                *req.uri_mut() = self.uri(path_and_query.as_deref());
                Sending::Client {
                    send: client.request(req),
                }
            }
        }
    }

    /// The absolute URI of `path_and_query` on this endpoint.
    fn uri(&self, path_and_query: Option<&PathAndQuery>) -> Uri {
        let mut parts = http::uri::Parts::default();
        parts.scheme = Some(self.scheme.clone());
        parts.authority = Some(self.authority.clone());
        parts.path_and_query = Some(
            path_and_query
                .cloned()
                .unwrap_or_else(|| PathAndQuery::from_static("/")),
        );
        Uri::from_parts(parts).expect("scheme, authority and path are all set")
    }
}
pin_project_lite::pin_project! {
    /// One attempt on its way: through herdguard's HTTP/1.1 pool, or
    /// hyper-util's client (TLS, HTTP/2).
    #[project = SendingProj]
    pub enum Sending<P> {
        Pool { #[pin] send: P },
        Client { #[pin] send: hyper_util::client::legacy::ResponseFuture },
    }
}

impl<P> Future for Sending<P>
where
    P: Future<Output = pool::Sent>,
{
    type Output = Result<(Response<UpstreamBody>, Option<Pooled>), SendError>;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        match self.project() {
            SendingProj::Pool { send } => send.poll(cx).map(|sent| sent.map_err(SendError::Pool)),
            SendingProj::Client { send } => send.poll(cx).map(|sent| {
                sent.map(|resp| (resp.map(UpstreamBody::hyper), None))
                    .map_err(SendError::Client)
            }),
        }
    }
}

/// `base` and the request's path, joined: `/api/v1` and `/items?x=1` give
/// `/api/v1/items?x=1`, and `?x=1` (an empty path) gives `/api/v1/?x=1`. `None` only if the join is not a valid path, which
/// two valid parts cannot make (the path is then sent as it came).
fn with_base(base: &str, pq: &PathAndQuery) -> Option<PathAndQuery> {
    // Dot segments resolved first: `/a/../../etc` must not climb out of the base.
    let path = crate::policy::route::without_dot_segments(pq.path());
    let mut joined = String::with_capacity(base.len() + pq.as_str().len() + 1);
    joined.push_str(base);
    joined.push_str(&path);
    if let Some(query) = pq.query() {
        joined.push('?');
        joined.push_str(query);
    }
    PathAndQuery::try_from(joined).ok()
}

/// The least and the most a request may wait for a slot.
const MIN_WAIT: Duration = Duration::from_millis(50);
const MAX_WAIT: Duration = Duration::from_secs(5);

pub struct Upstream {
    pub name: Arc<str>,
    /// The endpoints now, and their health: replaced whole when DNS
    /// gives another set of addresses.
    members: arc_swap::ArcSwap<Members>,
    /// The names to resolve, for `discovery = "dns"`.
    names: Option<discovery::Names>,
    next: AtomicUsize,
    /// Shared with the upstream of the same name a reload replaced, so
    /// that requests still in flight there count here too.
    in_flight: Arc<InFlightCounts>,
    max_in_flight: usize,
    /// The adaptive limit, when on; `limit` mirrors it for lock-free admission.
    limiter: Option<Mutex<Limiter>>,
    limit: AtomicUsize,
    /// Requests waiting for a slot (see [`Upstream::wait_for_slot`]), woken
    /// through `freed` as slots free up or the limit grows.
    waiting: AtomicUsize,
    freed: tokio::sync::Notify,
    /// A request was shed since the limiter last heard: the limit is what
    /// holds requests back, and may grow.
    pressed: AtomicBool,
    /// Raised by a route's breaker closing after an outage (see
    /// [`Limiter::after_outage`]); taken by the next sample or sweep.
    closed_after_outage: Arc<AtomicBool>,
    /// How long a request may wait for a slot, in nanoseconds (from the
    /// limiter's baseline latency).
    wait_nanos: std::sync::atomic::AtomicU64,
    /// The limiter's counts as last added to the metrics (untracked
    /// answers, excused windows): a reload builds a new limiter, counting
    /// from zero again, while the series go on.
    counted: Mutex<(u64, u64)>,
    pub metrics: UpstreamMetrics,
    /// Upgraded connections: counted apart from requests in flight.
    pub tunnels: Arc<Tunnels>,
    /// `mesh_retries = false`: every attempt asks a mesh's sidecar
    /// (Envoy) not to retry it.
    pub mesh_retries_off: bool,
}

impl Upstream {
    pub fn new(
        name: &str,
        config: &UpstreamConfig,
        registry: &Arc<Metrics>,
        in_flight: Option<Arc<InFlightCounts>>,
    ) -> Result<Arc<Self>, UpstreamError> {
        let limiter = match &config.adaptive_concurrency {
            a if a.enabled => Some(
                Limiter::try_new(a, config.max_in_flight)
                    .map_err(|e| UpstreamError::Limit {
                        upstream: name.to_owned(),
                        message: e.to_string(),
                    })?
                    .with_own_wait(crate::observe::cpu_wait::waits),
            ),
            _ => None,
        };
        let mut shared = None;
        let mut shared_client = || match &shared {
            Some(c) => Ok(Arc::clone(c)),
            None => Ok(shared.insert(Arc::new(client(name, config)?)).clone()),
        };
        let dns = config.discovery == Discovery::Dns;
        let several = dns || config.endpoints.len() > 1;
        let endpoints = config
            .endpoints
            .iter()
            .map(|e| {
                let mut endpoint = Endpoint::parse(name, e, config, &mut shared_client, None)?;
                endpoint.metrics = several.then(|| EndpointMetrics::new(registry, name, e));
                Ok(Arc::new(endpoint))
            })
            .collect::<Result<Box<[_]>, UpstreamError>>()?;
        if endpoints.is_empty() {
            return Err(UpstreamError::NoEndpoints {
                upstream: name.to_owned(),
            });
        }
        let members =
            Members::new(endpoints, &config.outlier, None).map_err(|e| UpstreamError::Outlier {
                upstream: name.to_owned(),
                key: e.key(),
                message: e.to_string(),
            })?;
        let names = dns.then(|| discovery::Names::new(config, shared.clone(), registry.clone()));
        Ok(Arc::new(Self {
            name: name.into(),
            members: arc_swap::ArcSwap::from_pointee(members),
            names,
            next: AtomicUsize::new(0),
            in_flight: in_flight.unwrap_or_default(),
            max_in_flight: config.max_in_flight,
            limit: AtomicUsize::new(
                limiter
                    .as_ref()
                    .map_or(config.max_in_flight, Limiter::limit),
            ),
            limiter: limiter.map(Mutex::new),
            waiting: AtomicUsize::new(0),
            freed: tokio::sync::Notify::new(),
            pressed: AtomicBool::new(false),
            counted: Mutex::new((0, 0)),
            closed_after_outage: Arc::default(),
            wait_nanos: std::sync::atomic::AtomicU64::new(MAX_WAIT.as_nanos() as u64),
            metrics: UpstreamMetrics::new(registry, name, dns),
            tunnels: Tunnels::new(config.max_tunnels, config.tunnel_idle_timeout),
            mesh_retries_off: !config.mesh_retries,
        }))
    }

    /// The endpoint for an attempt: round robin over the endpoints in
    /// rotation; a retry takes the one after the endpoint that failed, so
    /// it goes elsewhere when it can without shifting the rotation of first
    /// attempts. An ejected endpoint whose time is up gets one probe (see
    /// [`Outliers::pick`]). `retryable`: whether this request may be
    /// retried elsewhere if the attempt fails.
    /// `breaker_probe`: the route's breaker holds the upstream failing and
    /// lets this request through to find out: it goes to the endpoints in
    /// turn, ejected or not, so a healed endpoint that was ejected is found.
    pub fn pick(
        &self,
        previous: Option<usize>,
        retryable: bool,
        breaker_probe: bool,
    ) -> Picked<'_> {
        let members = self.members.load_full();
        let len = members.endpoints.len();
        let turn = match previous {
            Some(_) => 0,
            None => self.next.fetch_add(1, Ordering::Relaxed),
        };
        let pick = match &members.outliers {
            Some(o) if members.any_out.load(Ordering::Acquire) => {
                let mut o = o.lock().unwrap_or_else(|e| e.into_inner());
                let pick = o.pick(clock::now(), turn, previous, retryable, breaker_probe);
                members.any_out.store(o.any_out(), Ordering::Release);
                pick
            }
            _ => Pick {
                index: match previous {
                    Some(p) => (p + 1) % len,
                    None => turn % len,
                },
                kind: PickKind::Serving,
            },
        };
        Picked {
            upstream: self,
            members,
            index: pick.index,
            kind: pick.kind,
            settled: false,
        }
    }

    /// Each endpoint's label and health, for /breakers.
    pub fn endpoints_snapshot(&self) -> Vec<serde_json::Value> {
        let members = self.members.load();
        let health = members.outliers.as_ref().map(|o| {
            o.lock()
                .unwrap_or_else(|e| e.into_inner())
                .snapshot(Instant::now())
        });
        members
            .endpoints
            .iter()
            .enumerate()
            .map(|(i, e)| {
                let mut v = match health.as_ref().and_then(|h| h.get(i)) {
                    Some(s) => serde_json::to_value(s).unwrap_or_default(),
                    None => serde_json::json!({ "state": "serving" }),
                };
                v["endpoint"] = e.label.as_ref().into();
                v
            })
            .collect()
    }

    /// The label of endpoint `index` (as written in `endpoints`).
    pub fn endpoint_label(&self, index: usize) -> Arc<str> {
        self.members
            .load()
            .endpoints
            .get(index)
            .map_or_else(|| Arc::from("?"), |e| e.label.clone())
    }

    /// The in-flight counts, for the upstream that replaces this one.
    pub fn in_flight_counter(&self) -> Arc<InFlightCounts> {
        self.in_flight.clone()
    }

    /// Slots held: requests from admission to the end of their answers.
    pub fn in_flight(&self) -> usize {
        self.in_flight.slots.load(Ordering::Relaxed)
    }

    /// Attempts sent and not yet answered: what the adaptive limit holds.
    pub fn unanswered(&self) -> usize {
        self.in_flight.unanswered.load(Ordering::Relaxed)
    }

    /// Requests allowed in flight now: the adaptive limit, or `max_in_flight`.
    pub fn limit(&self) -> usize {
        self.limit.load(Ordering::Relaxed)
    }

    pub fn max_in_flight(&self) -> usize {
        self.max_in_flight
    }

    /// Feeds an attempt's outcome on `path` to the adaptive limit, as
    /// [`Sample::of`] maps it.
    fn observe(&self, outcome: Outcome, elapsed: std::time::Duration, path: PathKey) {
        let Some(sample) = Sample::of(outcome, elapsed) else {
            return;
        };
        if let Some(limiter) = &self.limiter {
            let shed =
                self.pressed.load(Ordering::Relaxed) && self.pressed.swap(false, Ordering::Relaxed);
            let queued = self.waiting.load(Ordering::Relaxed).max(usize::from(shed));
            let (before, after, wait) = {
                let mut limiter = limiter.lock().unwrap_or_else(|e| e.into_inner());
                let before = limiter.limit();
                let now = clock::now();
                self.take_outage_end(&mut limiter, now);
                limiter.update(sample, path, self.unanswered(), queued, now);
                (before, limiter.limit(), limiter.wait())
            };
            self.limit.store(after, Ordering::Relaxed);
            self.wait_nanos.store(
                wait.map_or(MAX_WAIT, |w| w.clamp(MIN_WAIT, MAX_WAIT))
                    .as_nanos() as u64,
                Ordering::Relaxed,
            );
            if after > before && self.waiting.load(Ordering::Relaxed) > 0 {
                self.freed.notify_waiters();
            }
        }
    }

    /// Closes connections that closed or idled out (once a second).
    /// Also brings the limit down to what the traffic uses (see
    /// [`Limiter::relax`]).
    pub fn sweep(&self) {
        for e in self.members.load().endpoints.iter() {
            if let Transport::Pool(pool) = &e.transport {
                pool.sweep();
            }
        }
        if let Some(limiter) = &self.limiter {
            let mut limiter = limiter.lock().unwrap_or_else(|e| e.into_inner());
            let now = clock::now();
            self.take_outage_end(&mut limiter, now);
            limiter.relax(self.unanswered(), now);
            self.limit.store(limiter.limit(), Ordering::Relaxed);
        }
    }

    /// Sets the gauges from live values (at scrape time, not per request).
    pub fn refresh_gauges(&self) {
        self.metrics.in_flight.set(self.in_flight() as f64);
        self.metrics.unanswered.set(self.unanswered() as f64);
        self.metrics.limit.set(self.limit() as f64);
        if let Some(limiter) = &self.limiter {
            let limiter = limiter.lock().unwrap_or_else(|e| e.into_inner());
            let (paths, untracked) = limiter.paths();
            let excused = limiter.excused();
            drop(limiter);
            self.metrics.limit_paths.set(paths as f64);
            let mut counted = self.counted.lock().unwrap_or_else(|e| e.into_inner());
            let (was_untracked, was_excused) =
                std::mem::replace(&mut *counted, (untracked, excused));
            let m = &self.metrics;
            m.limit_paths_untracked
                .increment(untracked.saturating_sub(was_untracked));
            m.limit_own_wait
                .increment(excused.saturating_sub(was_excused));
        }
        self.metrics.tunnels.set(self.tunnels.open() as f64);
        let members = self.members.load();
        self.metrics.endpoints.set(members.endpoints.len() as f64);
        let outliers = members
            .outliers
            .as_ref()
            .map(|o| o.lock().unwrap_or_else(|e| e.into_inner()));
        for (i, e) in members.endpoints.iter().enumerate() {
            if let Some(m) = &e.metrics {
                let state = outliers.as_ref().and_then(|o| o.state(i));
                let out = !matches!(state, Some(OutlierState::Serving) | None);
                m.ejected.set(if out { 1.0 } else { 0.0 });
            }
        }
    }

    /// The flag a route's breaker raises when it closes after an outage.
    pub fn closed_after_outage(&self) -> Arc<AtomicBool> {
        self.closed_after_outage.clone()
    }

    fn take_outage_end(&self, limiter: &mut Limiter, now: Instant) {
        if self.closed_after_outage.load(Ordering::Relaxed)
            && self.closed_after_outage.swap(false, Ordering::Relaxed)
        {
            limiter.after_outage(now);
        }
    }

    /// Takes a slot for one request, or `None` (counted as shed) when the
    /// upstream is full.
    pub fn try_acquire(self: &Arc<Self>) -> Option<InFlight> {
        let slot = self.take_slot();
        if slot.is_none() {
            self.refuse();
        }
        slot
    }

    /// A request refused for the limit: counted, and the limit may grow.
    fn refuse(&self) {
        self.pressed.store(true, Ordering::Relaxed);
        self.metrics.shed.increment(1);
    }

    /// A slot, if `max_in_flight` has room and, under the adaptive limit,
    /// the limit has room for one more attempt not yet answered. An answer
    /// being read by its caller holds a slot but is no longer the
    /// upstream's work: the limit, learnt from the time to an answer's
    /// head, holds only what waits for one, so that callers reading long
    /// answers slowly shut nobody else out.
    fn take_slot(self: &Arc<Self>) -> Option<InFlight> {
        let counts = &*self.in_flight;
        let prior = counts.slots.fetch_add(1, Ordering::AcqRel);
        if prior >= self.max_in_flight {
            counts.slots.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        let unanswered = counts.unanswered.fetch_add(1, Ordering::AcqRel);
        if unanswered >= self.limit.load(Ordering::Relaxed) {
            counts.unanswered.fetch_sub(1, Ordering::AcqRel);
            counts.slots.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(InFlight {
            upstream: self.clone(),
            conn: None,
            endpoint: None,
            counted: true,
            unanswered: true,
            path: PathKey::NONE,
        })
    }

    /// Wakes a request waiting for a slot, if one waits.
    fn wake_one(&self) {
        if self.waiting.load(Ordering::Relaxed) > 0 {
            self.freed.notify_one();
        }
    }

    /// Whether a request that finds the upstream full may wait for a slot
    /// ([`wait_for_slot`](Self::wait_for_slot)) rather than be shed at once:
    /// under the adaptive limit, while fewer than `max_in_flight` wait, and
    /// only when it is the limit that is full. Slots held to `max_in_flight`
    /// are answers being read (long streams): they free no sooner for a wait.
    pub fn may_wait(&self) -> bool {
        self.limiter.is_some()
            && self.waiting.load(Ordering::Relaxed) < self.max_in_flight
            && self.in_flight() < self.max_in_flight
    }

    /// Waits for a slot, for at most four times the tolerated latency
    /// (between 50 ms and 5 s) and never past `deadline`; `None`, counted as
    /// shed, when none came. A burst onto an idle sidecar thus waits the few
    /// round trips its limit takes to grow, instead of being shed, and no
    /// request reaches the upstream beyond the limit. The slot is for an
    /// attempt on `path`.
    pub async fn wait_for_slot(
        self: &Arc<Self>,
        deadline: Instant,
        path: PathKey,
    ) -> Option<InFlight> {
        let wait = Duration::from_nanos(self.wait_nanos.load(Ordering::Relaxed));
        let until = deadline.min(clock::now() + wait);
        self.waiting.fetch_add(1, Ordering::Relaxed);
        let slot = loop {
            let notified = self.freed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(slot) = self.take_slot() {
                break Some(slot);
            }
            if tokio::time::timeout_at(until, notified).await.is_err() {
                break self.take_slot();
            }
        };
        self.waiting.fetch_sub(1, Ordering::Relaxed);
        if slot.is_none() {
            self.refuse();
        }
        slot.map(|mut slot| {
            slot.on_path(path);
            slot
        })
    }
}

/// The endpoint picked for one attempt. Settle it with the attempt's
/// outcome; a probe dropped unsettled (its caller went away) tells nothing,
/// and leaves the endpoint due for another probe.
pub struct Picked<'a> {
    upstream: &'a Upstream,
    /// The set it was picked from: its health is settled there.
    members: Arc<Members>,
    pub index: usize,
    pub kind: PickKind,
    settled: bool,
}

impl Picked<'_> {
    pub fn endpoint(&self) -> &Endpoint {
        &self.members.endpoints[self.index]
    }

    /// The endpoint, to hold its pooled connection past this pick.
    pub fn endpoint_arc(&self) -> Arc<Endpoint> {
        self.members.endpoints[self.index].clone()
    }

    /// Leaves the verdict to whoever reads the answer's body: the set, the
    /// index and the kind of pick, to settle later.
    fn defer(mut self, latency: Duration) -> Deferred {
        self.settled = true;
        Deferred {
            members: self.members.clone(),
            index: self.index,
            kind: self.kind,
            latency,
        }
    }

    /// `latency`: from the request sent whole to the response's head.
    pub fn settle(mut self, outcome: Outcome, latency: Duration) {
        self.settled = true;
        self.members.settle(
            &self.upstream.name,
            self.index,
            self.kind,
            Verdict::of(outcome),
            Some(latency),
        );
    }
}

impl Drop for Picked<'_> {
    fn drop(&mut self) {
        if !self.settled {
            self.members.settle(
                &self.upstream.name,
                self.index,
                self.kind,
                Verdict::Neutral,
                None,
            );
        }
    }
}

/// An endpoint's answer whose verdict waits for the end of its body.
struct Deferred {
    members: Arc<Members>,
    index: usize,
    kind: PickKind,
    latency: Duration,
}

impl Deferred {
    fn settle(self, upstream: &str, verdict: Verdict, latency: Option<Duration>) {
        self.members
            .settle(upstream, self.index, self.kind, verdict, latency);
    }
}

/// The endpoints an upstream balances over now, and their health; `None`
/// when there is one endpoint or ejection is off. `any_out` mirrors it for
/// a lock-free pick while every endpoint serves.
pub(crate) struct Members {
    endpoints: Box<[Arc<Endpoint>]>,
    outliers: Option<Mutex<Outliers>>,
    any_out: AtomicBool,
}

impl Members {
    /// `endpoints`, each keeping the health it had in `previous` (by label).
    fn new(
        endpoints: Box<[Arc<Endpoint>]>,
        config: &OutlierConfig,
        previous: Option<&Members>,
    ) -> Result<Self, crate::policy::outlier::InvalidOutlier> {
        let kept: Vec<Option<usize>> = endpoints
            .iter()
            .map(|e| previous.and_then(|p| p.endpoints.iter().position(|o| o.label == e.label)))
            .collect();
        let before = previous.and_then(|p| p.outliers.as_ref());
        let before = before.map(|o| o.lock().unwrap_or_else(|e| e.into_inner()));
        let outliers = Outliers::carried(config, &kept, before.as_deref(), Instant::now())?;
        let any_out = outliers.any_out();
        Ok(Self {
            outliers: (config.enabled && endpoints.len() > 1).then(|| Mutex::new(outliers)),
            endpoints,
            any_out: AtomicBool::new(any_out),
        })
    }

    /// Feeds how an attempt to an endpoint ended to its health; counts and
    /// logs an ejection or a return.
    fn settle(
        &self,
        upstream: &str,
        index: usize,
        kind: PickKind,
        verdict: Verdict,
        latency: Option<Duration>,
    ) {
        let Some(outliers) = &self.outliers else {
            return;
        };
        if verdict == Verdict::Neutral && kind != PickKind::Probe {
            return;
        }
        let event = {
            let mut o = outliers.lock().unwrap_or_else(|e| e.into_inner());
            let event = o.record(
                Instant::now(),
                index,
                kind,
                verdict,
                latency,
                &mut rand::rng(),
            );
            self.any_out.store(o.any_out(), Ordering::Release);
            event
        };
        let endpoint = |i: usize| self.endpoints.get(i).map_or("?", |e| e.label.as_ref());
        match event {
            Some(Event::Ejected { index, length, why }) => {
                // The `ejected` gauge is set from the state at scrape time.
                if let Some(m) = self.endpoints.get(index).and_then(|e| e.metrics.as_ref()) {
                    m.ejections.increment(1);
                }
                tracing::warn!(
                    upstream,
                    endpoint = endpoint(index),
                    why = why.as_str(),
                    for_ms = length.as_millis() as u64,
                    "endpoint ejected"
                );
            }
            Some(Event::Returned { index }) => {
                tracing::info!(
                    upstream,
                    endpoint = endpoint(index),
                    "endpoint back in rotation"
                );
            }
            None => {}
        }
    }
}

/// A slot held while a request is in flight to its upstream, response body
/// included, with the pooled connection the response came on.
pub struct InFlight {
    upstream: Arc<Upstream>,
    conn: Option<(Arc<Endpoint>, Pooled)>,
    /// The endpoint that answered and how it was picked, while its answer
    /// is not yet settled: that waits for the end of the body.
    endpoint: Option<Deferred>,
    /// Whether it still counts toward the upstream's in-flight requests.
    counted: bool,
    /// Whether it still counts toward the attempts not yet answered.
    unanswered: bool,
    /// The attempt's path (see [`InFlight::on_path`]).
    path: PathKey,
}

/// An upstream's requests in flight, shared with the upstream of the same
/// name a reload replaced.
#[derive(Debug, Default)]
pub struct InFlightCounts {
    /// Slots held: from admission to the end of the answer's body, against
    /// `max_in_flight`.
    slots: AtomicUsize,
    /// Of those, the attempts with no answer's head yet, against the
    /// adaptive limit (without it, the limit is `max_in_flight`).
    unanswered: AtomicUsize,
}

impl InFlight {
    /// Keeps `conn`, the connection of `endpoint`, until the slot is let
    /// go; then it goes back to its pool.
    pub fn hold(&mut self, endpoint: Arc<Endpoint>, conn: Pooled) {
        self.conn = Some((endpoint, conn));
    }

    /// The endpoint of `picked` answered the request this slot is for; its
    /// health hears how when the body ends.
    pub fn answered_by(&mut self, picked: Picked<'_>, latency: Duration) {
        self.endpoint = Some(picked.defer(latency));
    }

    /// The body came whole: a success of the endpoint that sent it.
    pub fn body_done(&mut self) {
        if let Some(deferred) = self.endpoint.take() {
            let latency = deferred.latency;
            deferred.settle(&self.upstream.name, Verdict::Success, Some(latency));
        }
    }

    /// The endpoint broke its answer off mid-body: a failure of that
    /// endpoint, as if it had failed before answering.
    pub fn broken(&mut self) {
        if let Some(deferred) = self.endpoint.take() {
            deferred.settle(&self.upstream.name, Verdict::Failure, None);
        }
    }

    /// Lets the slot go and closes the connection instead of pooling it:
    /// its response was left half read.
    pub fn abandon(&mut self) {
        drop(self.conn.take());
        self.park();
    }

    /// The upstream is done with this request (it answered, and the answer
    /// is kept while a retry is tried): stop counting it in flight. The
    /// connection stays held until the slot is dropped.
    pub fn park(&mut self) {
        self.answered();
        if std::mem::replace(&mut self.counted, false) {
            self.upstream.in_flight.slots.fetch_sub(1, Ordering::AcqRel);
            self.upstream.wake_one();
        }
    }

    /// The slot is for an attempt on `path`: the limit holds its latency
    /// against the path's own.
    pub fn on_path(&mut self, path: PathKey) {
        self.path = path;
    }

    /// The attempt ended in `outcome` after `latency`, with its answer's
    /// head or without one: the limit hears of it (counting this attempt
    /// in flight), and the slot no longer counts against it.
    pub fn ended(&mut self, outcome: Outcome, latency: Duration) {
        self.upstream.observe(outcome, latency, self.path);
        self.answered();
    }

    /// The slot no longer counts against the adaptive limit.
    fn answered(&mut self) {
        if std::mem::replace(&mut self.unanswered, false) {
            (self.upstream.in_flight.unanswered).fetch_sub(1, Ordering::AcqRel);
            self.upstream.wake_one();
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        // The caller left before the body ended: the endpoint answered
        // well as far as anyone saw.
        if let Some(deferred) = self.endpoint.take() {
            let latency = deferred.latency;
            deferred.settle(&self.upstream.name, Verdict::Success, Some(latency));
        }
        if let Some((endpoint, conn)) = self.conn.take() {
            if let Transport::Pool(pool) = &endpoint.transport {
                pool.put_back(conn);
            }
        }
        self.park();
    }
}

fn client(name: &str, config: &UpstreamConfig) -> Result<HttpClient, UpstreamError> {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(config.connect_timeout));
    http.set_keepalive(Some(std::time::Duration::from_secs(60)));
    http.set_recv_buffer_size(pool::receive_buffer(config));

    let tls = tls_config(name, config)?;
    let builder = HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http();
    // An endpoint found by DNS is connected to by address: its
    // certificate is checked against the name it was found by.
    let dns_name = (config.discovery == Discovery::Dns)
        .then(|| {
            config
                .endpoints
                .iter()
                .find_map(|e| e.parse::<Uri>().ok()?.host().map(str::to_owned))
        })
        .flatten();
    let builder = match config.server_name.as_ref().or(dns_name.as_ref()) {
        Some(server_name) => {
            let server_name =
                ServerName::try_from(server_name.clone()).map_err(|e| UpstreamError::Tls {
                    upstream: name.to_owned(),
                    key: "server_name",
                    message: e.to_string(),
                })?;
            builder.with_server_name_resolver(FixedServerNameResolver::new(server_name))
        }
        None => builder,
    };
    let connector = match config.http2 {
        Http2Mode::Auto => builder.enable_all_versions().wrap_connector(http),
        Http2Mode::Always => builder.enable_http2().wrap_connector(http),
        Http2Mode::Never => builder.enable_http1().wrap_connector(http),
    };

    let mut client = Client::builder(TokioExecutor::new());
    client
        .pool_idle_timeout(config.pool_idle_timeout)
        .pool_max_idle_per_host(config.pool_max_idle)
        .pool_timer(TokioTimer::new())
        .timer(TokioTimer::new())
        // Every attempt must pass through our budget and metrics: no hidden retries.
        .retry_canceled_requests(false)
        .http1_max_buf_size(pool::UPSTREAM_BUFFER)
        .http2_max_send_buf_size(pool::UPSTREAM_BUFFER)
        // Host is set per endpoint by the proxy.
        .set_host(false)
        .http2_only(config.http2 == Http2Mode::Always);
    Ok(client.build(connector))
}

/// System roots, plus `ca_file`, plus a client certificate for mTLS.
fn tls_config(name: &str, config: &UpstreamConfig) -> Result<ClientConfig, UpstreamError> {
    let err = |key: &'static str, message: String| UpstreamError::Tls {
        upstream: name.to_owned(),
        key,
        message,
    };
    let mut roots = system_roots().clone();
    if let Some(ca_file) = &config.ca_file {
        let certs = read_certs(ca_file).map_err(|e| err("ca_file", e.to_string()))?;
        if certs.is_empty() {
            return Err(err(
                "ca_file",
                format!("{}: no certificate found", ca_file.display()),
            ));
        }
        for cert in certs {
            roots
                .add(cert)
                .map_err(|e| err("ca_file", format!("{}: {e}", ca_file.display())))?;
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| err("endpoints", e.to_string()))?
        .with_root_certificates(roots);
    match (&config.client_cert, &config.client_key) {
        (Some(cert), Some(key)) => {
            let chain = read_certs(cert).map_err(|e| err("client_cert", e.to_string()))?;
            let key = read_key(key).map_err(|e| err("client_key", e.to_string()))?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| err("client_key", e.to_string()))
        }
        _ => Ok(builder.with_no_client_auth()),
    }
}

/// The platform's trusted roots, loaded once per process.
fn system_roots() -> &'static RootCertStore {
    static ROOTS: OnceLock<RootCertStore> = OnceLock::new();
    ROOTS.get_or_init(|| {
        let found = rustls_native_certs::load_native_certs();
        for e in &found.errors {
            tracing::warn!(error = %e, "could not load some system CA certificates");
        }
        let mut roots = RootCertStore::empty();
        let (added, ignored) = roots.add_parsable_certificates(found.certs);
        tracing::debug!(added, ignored, "loaded system CA certificates");
        roots
    })
}
