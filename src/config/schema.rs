//! The TOML schema. Every struct rejects keys it does not know, and every field
//! has a built-in default, so an empty file is a valid (if useless) config.
//!
//! Routes inherit `[defaults.retry]` and `[defaults.breaker]` key by key: the
//! loader merges the tables before these structs see them (see `load.rs`).

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::units::{duration, size};

pub use crate::policy::settings::{
    AdaptiveConfig, BackoffConfig, BreakerConfig, BudgetConfig, Jitter, MatchConfig, OutlierConfig,
    RetryConfig, RetryOn,
};

/// The whole configuration, defaults merged into every route.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub listen: ListenConfig,
    #[serde(default)]
    pub admin: AdminConfig,
    #[serde(default)]
    pub access_log: AccessLogConfig,
    #[serde(default)]
    pub upstreams: BTreeMap<String, UpstreamConfig>,
    #[serde(default)]
    pub defaults: Defaults,
    #[serde(default)]
    pub routes: Vec<RouteConfig>,
    /// The DNS servers upstreams with `discovery = "dns"` ask.
    #[serde(default)]
    pub dns: DnsConfig,
    #[serde(default)]
    pub metrics: MetricsConfig,
    #[serde(default)]
    pub request_id: RequestIdConfig,
    #[serde(default)]
    pub tracing: TracingConfig,
}

/// `[tracing]`: spans exported with OpenTelemetry over OTLP/HTTP. Off
/// unless an endpoint is set here or in `OTEL_EXPORTER_OTLP_ENDPOINT`.
/// Read at start (a reload that changes it says so).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TracingConfig {
    /// The collector's OTLP/HTTP address (`http://HOST:4318`); spans go
    /// to its `/v1/traces`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub otlp_endpoint: Option<String>,
    /// The share of new traces kept (0.0–1.0); a caller's sampled flag is
    /// followed.
    pub sample_ratio: f64,
    /// The `service.name` of the spans; empty: `OTEL_SERVICE_NAME`, else
    /// `herdguard`.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub service_name: String,
}

impl Default for TracingConfig {
    fn default() -> Self {
        Self {
            otlp_endpoint: None,
            sample_ratio: 1.0,
            service_name: String::new(),
        }
    }
}

/// `[request_id]`: every request carries an id, the caller's or one made
/// here, sent upstream on every attempt and written in the access log and
/// in every log line about the request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RequestIdConfig {
    pub enabled: bool,
    /// The header that carries it.
    pub header: String,
}

impl Default for RequestIdConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            header: "x-request-id".into(),
        }
    }
}

/// How the metrics are kept.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// The latency histograms' bucket bounds, in seconds, ascending; left
    /// out: the built-in ones (an empty list is refused). Read at start (a
    /// reload that changes it says so).
    #[serde(
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "some_buckets"
    )]
    pub latency_buckets: Vec<f64>,
}

/// A written list of bucket bounds has at least one: `[]` would read as
/// "no buckets" and silently be the built-in ones.
fn some_buckets<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<f64>, D::Error> {
    let buckets = Vec::<f64>::deserialize(d)?;
    match buckets.is_empty() {
        true => Err(serde::de::Error::custom(
            "an empty list: leave latency_buckets out for the built-in buckets",
        )),
        false => Ok(buckets),
    }
}

/// Where names of upstreams with `discovery = "dns"` are resolved.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DnsConfig {
    /// `IP:port` of DNS servers, asked over UDP (TCP for long answers);
    /// empty: those of /etc/resolv.conf, with its search domains.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub servers: Vec<String>,
}

/// What happens to a request no route takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Unrouted {
    /// 404 `no-route`, and CONNECT 405: herdguard is no open proxy.
    #[default]
    Refuse,
    /// Sent once, never retried, to the host it names (absolute form or
    /// `Host`); CONNECT is tunnelled.
    Passthrough,
}

/// How an upstream's endpoints are found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Discovery {
    /// Each URL in `endpoints` is one endpoint; its host is resolved when
    /// a connection is made.
    #[default]
    Static,
    /// Every address an endpoint's host resolves to (A and AAAA) is an
    /// endpoint of its own, re-resolved every `dns_refresh`.
    Dns,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ListenConfig {
    /// Where callers connect (HTTP/1.1 and h2c).
    pub address: SocketAddr,
    /// After SIGTERM, how long to go on accepting and serving (with
    /// `/readyz` at 503) before the drain: a sidecar's app gets SIGTERM at
    /// the same time and may still make calls while it shuts down.
    #[serde(with = "duration")]
    pub drain_delay: Duration,
    /// How long in-flight requests may take to finish after SIGTERM.
    #[serde(with = "duration")]
    pub drain_timeout: Duration,
    /// How long a client may take to send a request's headers (HTTP/1).
    #[serde(with = "duration")]
    pub header_read_timeout: Duration,
    /// Open client connections at most; more wait in the kernel's accept queue.
    pub max_connections: usize,
    /// Request bodies kept for a retry, all requests together: a body that
    /// does not fit what is left is sent once and never retried.
    #[serde(with = "size")]
    pub max_body_memory: u64,
    /// The process's memory in use (its allocator's count) past which
    /// new requests are refused (503 `overloaded`) and callers that read
    /// nothing are cut, until it is back under nine tenths of it; `0`: no
    /// bound. The container's memory limit less a quarter.
    #[serde(with = "size")]
    pub max_memory: u64,
    /// The kernel's send buffer for each caller connection (`SO_SNDBUF`,
    /// which the kernel doubles for its bookkeeping): what a caller that
    /// reads slowly or not at all holds in kernel memory, outside
    /// `max_memory`'s count; `0`: the kernel's autotuning (up to
    /// `net.ipv4.tcp_wmem`'s largest, 4 MiB by default).
    #[serde(with = "size")]
    pub send_buffer: u64,
    /// A response that makes no progress this long is aborted and what it
    /// holds upstream let go: a caller that reads nothing, or an upstream
    /// that sends nothing more of its body.
    #[serde(with = "duration")]
    pub write_timeout: Duration,
    /// A caller connection with no request open and none begun this long
    /// is closed (HTTP/2: GOAWAY); streams still answering finish first.
    #[serde(with = "duration")]
    pub idle_timeout: Duration,
    /// Answer `x-herdguard-explain: 1` with the request's attempt trace.
    pub explain: bool,
    /// What happens to a request no route takes.
    pub unrouted: Unrouted,
    /// Connections come redirected by iptables (`REDIRECT`): each one's
    /// original destination is read, and an unrouted request goes there.
    pub transparent: bool,
    /// Serve callers over TLS (off unless written).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls: Option<TlsConfig>,
}

impl Default for ListenConfig {
    fn default() -> Self {
        Self {
            address: SocketAddr::from(([127, 0, 0, 1], 8080)),
            drain_delay: Duration::ZERO,
            drain_timeout: Duration::from_secs(15),
            header_read_timeout: Duration::from_secs(10),
            max_connections: 10_000,
            max_body_memory: 16 << 20,
            max_memory: 96 << 20,
            send_buffer: 128 << 10,
            write_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
            explain: false,
            unrouted: Unrouted::Refuse,
            transparent: false,
            tls: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// /metrics, /healthz, /readyz, /config. Loopback unless the user writes otherwise.
    pub address: SocketAddr,
    /// Lets a caller off loopback use the mutating endpoints (`POST
    /// /breakers/...`) with `Authorization: Bearer TOKEN`. Never shown
    /// back (`/config`, `check`).
    #[serde(skip_serializing)]
    pub token: Option<String>,
    /// Host names the admin listener answers to, beside IP addresses,
    /// `localhost` and cluster names (`*.svc`, `*.cluster.local`): a web
    /// page whose name was rebound to this address cannot read it.
    pub hosts: Vec<String>,
}

impl Default for AdminConfig {
    fn default() -> Self {
        Self {
            address: SocketAddr::from(([127, 0, 0, 1], 9901)),
            token: None,
            hosts: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct UpstreamConfig {
    /// `http://host:port` or `https://host:port`; requests are balanced over them.
    pub endpoints: Vec<String>,
    /// `"static"`: each URL is an endpoint; `"dns"`: each address its host
    /// resolves to is (a headless Service: one per pod).
    pub discovery: Discovery,
    /// How often a `"dns"` upstream's names are resolved again (sooner
    /// when the answer's TTL runs out first).
    #[serde(with = "duration")]
    pub dns_refresh: Duration,
    /// `false`: every attempt carries `x-envoy-max-retries: 0`, so that a
    /// mesh's sidecar (Istio's Envoy) does not retry what herdguard retries.
    pub mesh_retries: bool,
    #[serde(with = "duration")]
    pub connect_timeout: Duration,
    /// More requests than this in flight to the upstream are shed with 503 at once.
    pub max_in_flight: usize,
    /// Idle pooled connections are closed after this long.
    #[serde(with = "duration")]
    pub pool_idle_timeout: Duration,
    /// Idle pooled connections kept per endpoint at most; more are closed
    /// as they come back (as nginx's `keepalive`).
    pub pool_max_idle: usize,
    /// Extra CA certificates (PEM) trusted for https endpoints, beside the system roots.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    /// The name verified in the server's certificate, when it is not the endpoint's host.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub server_name: Option<String>,
    /// Client certificate chain (PEM) for mutual TLS; needs `client_key`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_cert: Option<PathBuf>,
    /// Client private key (PEM) for mutual TLS; needs `client_cert`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_key: Option<PathBuf>,
    pub http2: Http2Mode,
    /// The adaptive concurrency limit, on top of `max_in_flight`.
    pub adaptive_concurrency: AdaptiveConfig,
    /// Per-endpoint ejection of an endpoint that keeps failing.
    pub outlier: OutlierConfig,
    /// Upgraded connections (WebSockets) open to this upstream at most;
    /// counted apart from `max_in_flight`. More are refused with 503.
    pub max_tunnels: usize,
    /// An upgraded connection that carries no byte either way this long is closed.
    #[serde(with = "duration")]
    pub tunnel_idle_timeout: Duration,
    /// The kernel's receive buffer for each connection to the upstream
    /// (`SO_RCVBUF`, which the kernel doubles for its bookkeeping): what
    /// an answer whose caller reads slowly or not at all holds in kernel
    /// memory, and the most in flight on one connection (a connection
    /// gets about this per round trip); `0`: the kernel's autotuning (up to
    /// `net.ipv4.tcp_rmem`'s largest, 6 MiB by default).
    #[serde(with = "size")]
    pub receive_buffer: u64,
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        Self {
            endpoints: Vec::new(),
            discovery: Discovery::Static,
            dns_refresh: Duration::from_secs(5),
            mesh_retries: true,
            connect_timeout: Duration::from_secs(1),
            max_in_flight: 1024,
            pool_idle_timeout: Duration::from_secs(90),
            pool_max_idle: 128,
            ca_file: None,
            server_name: None,
            client_cert: None,
            client_key: None,
            http2: Http2Mode::Auto,
            adaptive_concurrency: AdaptiveConfig::default(),
            outlier: OutlierConfig::default(),
            max_tunnels: 1024,
            tunnel_idle_timeout: Duration::from_secs(300),
            receive_buffer: 64 << 10,
        }
    }
}

/// `"auto"` negotiates HTTP/2 by ALPN on https and speaks HTTP/1.1 on http;
/// `true` always speaks HTTP/2 (h2c with prior knowledge on http); `false` never.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Http2Mode {
    #[default]
    Auto,
    Always,
    Never,
}

impl Serialize for Http2Mode {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Auto => s.serialize_str("auto"),
            Self::Always => s.serialize_bool(true),
            Self::Never => s.serialize_bool(false),
        }
    }
}

impl<'de> Deserialize<'de> for Http2Mode {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;

        impl serde::de::Visitor<'_> for Visitor {
            type Value = Http2Mode;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("\"auto\", true or false")
            }

            fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Http2Mode, E> {
                Ok(if v {
                    Http2Mode::Always
                } else {
                    Http2Mode::Never
                })
            }

            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Http2Mode, E> {
                match v {
                    "auto" => Ok(Http2Mode::Auto),
                    other => Err(E::custom(format!(
                        "{other:?} is not an http2 mode (use \"auto\", true or false)"
                    ))),
                }
            }
        }

        d.deserialize_any(Visitor)
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Defaults {
    pub retry: RetryConfig,
    pub breaker: BreakerConfig,
}

/// `listen.tls`: serve callers over TLS.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// PEM certificate chain, leaf first.
    pub cert: std::path::PathBuf,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub key: std::path::PathBuf,
    /// PEM CA certificates: callers must present a certificate they sign.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_ca: Option<std::path::PathBuf>,
}

/// `[access_log]`: one line per request on stdout, after it ends.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AccessLogConfig {
    pub enabled: bool,
    pub format: AccessLogFormat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AccessLogFormat {
    /// `key=value` pairs (logfmt).
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    pub name: String,
    pub upstream: String,
    #[serde(rename = "match", default)]
    pub matcher: MatchConfig,
    #[serde(default)]
    pub retry: RetryConfig,
    #[serde(default)]
    pub breaker: BreakerConfig,
    /// Faults injected into this route's answers, for testing callers. Off unless written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fault: Option<FaultConfig>,
    /// The `Host` the upstream sees (`host[:port]`), instead of the
    /// endpoint's own: for an upstream that serves several names.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_rewrite: Option<String>,
}

/// `fault = { abort = 0.1, abort_status = 503, delay = "200ms", delay_ratio = 0.05 }`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FaultConfig {
    /// Share of requests answered by the proxy with `abort_status`, not forwarded.
    pub abort: f64,
    pub abort_status: u16,
    /// Extra delay before forwarding, for `delay_ratio` of the requests.
    #[serde(with = "duration")]
    pub delay: Duration,
    pub delay_ratio: f64,
}

impl Default for FaultConfig {
    fn default() -> Self {
        Self {
            abort: 0.0,
            abort_status: 503,
            delay: Duration::ZERO,
            delay_ratio: 0.0,
        }
    }
}
