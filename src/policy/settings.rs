//! What each policy is told by the config: the settings of the retry rule,
//! backoff, budget, breaker, adaptive limit, outlier detection and route
//! matching, as the TOML file writes them. The config's schema embeds them;
//! the policies are built from them.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use http::{HeaderName, Method};
use serde::{de, Deserialize, Deserializer, Serialize, Serializer};

use crate::policy::GrpcStatus;
use crate::units::{duration, duration_opt, size};

/// `[upstreams.NAME.outlier]`: an endpoint that keeps failing is taken out
/// of rotation for a while, then probed back in (see `outlier.rs`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OutlierConfig {
    pub enabled: bool,
    /// This many of the upstream's failures in a row eject an endpoint.
    pub consecutive_failures: u32,
    /// Or this share of its attempts in `window` failed...
    pub failure_rate: f64,
    /// ...once it has seen this many in the window.
    pub min_requests: u32,
    #[serde(with = "duration")]
    pub window: Duration,
    /// How long the first ejection lasts; doubled per ejection in a row, jittered.
    #[serde(with = "duration")]
    pub ejection_time: Duration,
    #[serde(with = "duration")]
    pub max_ejection_time: Duration,
    /// The share of the upstream's endpoints that may be out at once (at least one).
    pub max_ejected: f64,
    /// An endpoint whose answers take this many times as long as the
    /// others' median is out too (0: off).
    pub slow_factor: f64,
}

impl Default for OutlierConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            consecutive_failures: 5,
            failure_rate: 0.5,
            min_requests: 20,
            window: Duration::from_secs(10),
            ejection_time: Duration::from_secs(1),
            max_ejection_time: Duration::from_secs(30),
            max_ejected: 0.5,
            slow_factor: 5.0,
        }
    }
}

/// `[upstreams.NAME.adaptive_concurrency]`: a limit on requests in flight
/// that follows the upstream's latency (see `limit/mod.rs`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdaptiveConfig {
    pub enabled: bool,
    /// The limit never falls below this. Per sidecar: a fleet of N holds
    /// at least N times this on an upstream, however it fares.
    pub min_limit: usize,
    /// The limit at start-up (at most `max_in_flight`); it grows while
    /// requests wait for it.
    pub initial_limit: usize,
    /// Latency up to this many times the baseline (the lowest of the last
    /// 30 to 60 s) counts as normal.
    pub tolerance: f64,
    /// How far each sample moves the limit toward its new value (0, 1].
    pub smoothing: f64,
}

impl Default for AdaptiveConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            min_limit: 1,
            initial_limit: 20,
            tolerance: 2.0,
            smoothing: 0.2,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryConfig {
    /// Total tries, the first included; 1 turns retries off.
    pub attempts: u32,
    /// Time allowed for one attempt to produce response headers.
    #[serde(with = "duration")]
    pub per_try_timeout: Duration,
    /// Time allowed for the whole request, backoff included.
    #[serde(with = "duration")]
    pub timeout: Duration,
    pub retry_on: Vec<RetryOn>,
    /// Methods that are retried after the request reached the upstream.
    pub methods: Vec<MethodName>,
    /// A request carrying this header may be retried whatever its method.
    pub idempotency_header: FieldName,
    /// Every request on the route is safe to repeat, whatever its method:
    /// for gRPC and POST-based APIs whose calls are idempotent.
    pub idempotent: bool,
    /// Bodies up to this size are kept for replay; larger ones are sent once.
    #[serde(with = "size")]
    pub max_replay_body: u64,
    pub respect_retry_after: bool,
    /// A longer Retry-After is not waited for: the response is passed on.
    #[serde(with = "duration")]
    pub max_retry_after: Duration,
    /// When an attempt has no response headers after this long, a second
    /// one goes to another endpoint (idempotent requests only, paid for by
    /// the budget); the first answer wins. Off unless set.
    #[serde(with = "duration_opt", skip_serializing_if = "Option::is_none")]
    pub hedge_after: Option<Duration>,
    pub backoff: BackoffConfig,
    pub budget: BudgetConfig,
}

impl Default for RetryConfig {
    fn default() -> Self {
        Self {
            attempts: 3,
            per_try_timeout: Duration::from_secs(2),
            timeout: Duration::from_secs(10),
            retry_on: vec![
                RetryOn::ConnectFailure,
                RetryOn::Reset,
                RetryOn::Timeout,
                RetryOn::Status(502),
                RetryOn::Status(503),
                RetryOn::Status(504),
                RetryOn::Grpc(GrpcStatus::UNAVAILABLE),
            ],
            methods: [
                Method::GET,
                Method::HEAD,
                Method::OPTIONS,
                Method::PUT,
                Method::DELETE,
                Method::TRACE,
            ]
            .map(MethodName)
            .to_vec(),
            idempotency_header: FieldName(HeaderName::from_static("idempotency-key")),
            idempotent: false,
            max_replay_body: 64 * 1024,
            respect_retry_after: true,
            max_retry_after: Duration::from_secs(30),
            hedge_after: None,
            backoff: BackoffConfig::default(),
            budget: BudgetConfig::default(),
        }
    }
}

/// A condition under which an attempt may be retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum RetryOn {
    /// The connection could not be made (refused, unreachable, connect timeout).
    ConnectFailure,
    /// The connection was reset or closed before response headers arrived.
    Reset,
    /// No response headers within `per_try_timeout`.
    Timeout,
    /// HTTP/2 REFUSED_STREAM: the upstream did not process the request.
    RefusedStream,
    /// Any 5xx status.
    Status5xx,
    /// This exact status code.
    Status(u16),
    /// This gRPC status, in a trailers-only answer to a gRPC call.
    Grpc(GrpcStatus),
}

impl TryFrom<String> for RetryOn {
    type Error = String;

    fn try_from(text: String) -> Result<Self, String> {
        if let Some(status) = GrpcStatus::retryable_named(&text) {
            return Ok(Self::Grpc(status));
        }
        Ok(match text.as_str() {
            "connect-failure" => Self::ConnectFailure,
            "reset" => Self::Reset,
            "timeout" => Self::Timeout,
            "refused-stream" => Self::RefusedStream,
            "5xx" => Self::Status5xx,
            code => match code.parse::<u16>() {
                Ok(code) if (100..=599).contains(&code) => Self::Status(code),
                _ => {
                    return Err(format!(
                        "{text:?} is not a retry condition (use connect-failure, reset, timeout, \
                         refused-stream, 5xx, a status code such as \"503\", or a gRPC status: \
                         cancelled, deadline-exceeded, internal, resource-exhausted, unavailable)"
                    ))
                }
            },
        })
    }
}

impl fmt::Display for RetryOn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ConnectFailure => f.write_str("connect-failure"),
            Self::Reset => f.write_str("reset"),
            Self::Timeout => f.write_str("timeout"),
            Self::RefusedStream => f.write_str("refused-stream"),
            Self::Status5xx => f.write_str("5xx"),
            Self::Status(code) => write!(f, "{code}"),
            Self::Grpc(status) => f.write_str(status.name()),
        }
    }
}

impl From<RetryOn> for String {
    fn from(r: RetryOn) -> String {
        r.to_string()
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BackoffConfig {
    #[serde(with = "duration")]
    pub base: Duration,
    #[serde(with = "duration")]
    pub cap: Duration,
    pub multiplier: f64,
    pub jitter: Jitter,
}

impl Default for BackoffConfig {
    fn default() -> Self {
        Self {
            base: Duration::from_millis(100),
            cap: Duration::from_secs(10),
            multiplier: 2.0,
            jitter: Jitter::Full,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Jitter {
    None,
    #[default]
    Full,
    Equal,
    Decorrelated,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BudgetConfig {
    /// Retries may add at most this share of requests (0.2 = 20%).
    pub ratio: f64,
    /// Retries always allowed per second, whatever the ratio.
    pub min_per_second: u32,
    #[serde(with = "duration")]
    pub window: Duration,
}

impl Default for BudgetConfig {
    fn default() -> Self {
        Self {
            ratio: 0.2,
            min_per_second: 1,
            window: Duration::from_secs(10),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BreakerConfig {
    pub consecutive_failures: u32,
    /// Trip when this share of requests fail over `window`, once `min_requests` were seen.
    pub failure_rate: f64,
    pub min_requests: u32,
    #[serde(with = "duration")]
    pub window: Duration,
    /// How long the breaker stays open after its first trip; doubles per consecutive trip.
    #[serde(with = "duration")]
    pub open_for: Duration,
    #[serde(with = "duration")]
    pub max_open_for: Duration,
    pub half_open_probes: u32,
    /// While open, one request this often (jittered ±50%) goes through as a
    /// probe; when it succeeds the breaker half-opens at once.
    #[serde(with = "duration")]
    pub probe_interval: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            consecutive_failures: 5,
            failure_rate: 0.5,
            min_requests: 20,
            window: Duration::from_secs(10),
            open_for: Duration::from_secs(5),
            max_open_for: Duration::from_secs(60),
            half_open_probes: 3,
            probe_interval: Duration::from_millis(250),
        }
    }
}

/// Every condition given must hold; an empty match takes every request.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MatchConfig {
    /// Host (or `*.suffix`), or a list of them (any one matches), compared
    /// without case; with a port only when written with one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host: Option<Hosts>,
    /// The exact path.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// A prefix of the path, compared byte by byte.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path_prefix: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub methods: Option<Vec<MethodName>>,
    /// Headers that must be present with exactly these values.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
}

/// `match.host`: one host, or a list of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hosts(pub Vec<String>);

impl From<&str> for Hosts {
    fn from(host: &str) -> Self {
        Hosts(vec![host.to_owned()])
    }
}

impl Serialize for Hosts {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0.as_slice() {
            [one] => s.serialize_str(one),
            many => many.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for Hosts {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged, expecting = "a host, or a list of hosts")]
        enum OneOrMany {
            One(String),
            Many(Vec<String>),
        }
        match OneOrMany::deserialize(d)? {
            OneOrMany::One(host) => Ok(Hosts(vec![host])),
            OneOrMany::Many(hosts) if hosts.is_empty() => Err(serde::de::Error::custom(
                "an empty list of hosts matches nothing",
            )),
            OneOrMany::Many(hosts) => Ok(Hosts(hosts)),
        }
    }
}

/// An HTTP method, parsed as the config is read: in capitals, as HTTP
/// writes it (a lower-case `get` is another method, which nobody sends).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MethodName(pub Method);

impl MethodName {
    pub fn parse(name: &str) -> Result<Self, String> {
        let bad = || format!("{name:?} is not a method (write it in capitals, e.g. \"GET\")");
        if name.bytes().any(|b| b.is_ascii_lowercase()) {
            return Err(bad());
        }
        Method::from_bytes(name.as_bytes())
            .map(Self)
            .map_err(|_| bad())
    }

    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }
}

impl Serialize for MethodName {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.0.as_str())
    }
}

impl<'de> Deserialize<'de> for MethodName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        MethodName::parse(&name).map_err(de::Error::custom)
    }
}

/// A header field name, parsed as the config is read (field names are
/// compared without case, and kept in lower case).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldName(pub HeaderName);

impl FieldName {
    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }
}

impl fmt::Display for FieldName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0.as_str())
    }
}

impl Serialize for FieldName {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.0.as_str())
    }
}

impl<'de> Deserialize<'de> for FieldName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        HeaderName::from_bytes(name.as_bytes())
            .map(FieldName)
            .map_err(|_| de::Error::custom(format!("{name:?} is not a header name")))
    }
}
