//! Semantic checks that types alone cannot express. Each problem is reported
//! with the key path it concerns; the loader adds the line. Policy tables
//! (retry, backoff, budget, breaker, adaptive limit, match) are checked by
//! compiling them with the constructors the proxy uses: a config that passes
//! here builds.

use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

use http::{HeaderValue, Uri};

use super::load::KeyPath;
use super::schema::{BreakerConfig, Config, MatchConfig, RetryConfig, RetryOn, UpstreamConfig};
use super::validated::CompiledRoute;
use crate::policy::breaker::Breaker;
use crate::policy::limit::Limiter;
use crate::policy::outlier::Outliers;
use crate::policy::retry::InvalidPolicy;
use crate::policy::route::{InvalidMatch, Matcher};
use crate::policy::{Budget, Policy};
use tokio::time::Instant;

type Report<'a> = dyn FnMut(KeyPath, String) + 'a;

/// Reads the files `listen.tls` names, so that a `check` that passes
/// starts. Not on a reload: a change to `listen.tls` is not applied then,
/// and the files, mid-rotation, may not match for a moment.
pub(super) fn tls_files(config: &Config, report: &mut Report<'_>) {
    if let Some(tls) = &config.listen.tls {
        if let Err(e) = crate::config::tls::Tls::new(&tls.cert, &tls.key, tls.client_ca.as_deref())
        {
            report(KeyPath::root().key("listen").key("tls"), e.to_string());
        }
    }
}

/// Why the admin listener's address will not do, if it will not.
pub(super) fn addresses(config: &Config) -> Option<String> {
    (config.admin.address == config.listen.address && config.admin.address.port() != 0).then(|| {
        format!(
            "{} is also listen.address; the admin listener needs its own",
            config.admin.address
        )
    })
}

/// The listener's memory settings: the bound, and each connection's send
/// buffer.
fn memory(config: &Config, listen: &KeyPath, report: &mut Report<'_>) {
    if config.listen.max_memory != 0 && config.listen.max_memory < MIN_MEMORY {
        report(
            listen.key("max_memory"),
            "must be 0 (no bound) or at least 16MiB: the process itself uses a few MiB".into(),
        );
    }
    socket_buffer(
        report,
        listen.key("send_buffer"),
        config.listen.send_buffer,
        (4 << 10, ""),
    );
}

/// A socket's buffer size: 0 (the kernel's autotuning) or from `least`
/// (`why` that floor) to 64 MiB.
fn socket_buffer(report: &mut Report<'_>, key: KeyPath, size: u64, (least, why): (u64, &str)) {
    if size != 0 && !(least..=64 << 20).contains(&size) {
        report(
            key,
            format!(
                "must be 0 (the kernel's autotuning) or from {}KiB to 64MiB{why}",
                least >> 10
            ),
        );
    }
}

/// The least `listen.max_memory` that is not a bound.
const MIN_MEMORY: u64 = 16 << 20;

/// Checks `config`, and compiles each route's policies as it goes: `Some`
/// for every route whose checks passed. `unparsed`: upstreams the file
/// names but that did not parse (reported already): a route naming one is
/// not told that no such upstream exists.
pub(super) fn validate(
    config: &Config,
    unparsed: &std::collections::BTreeSet<String>,
    report: &mut Report<'_>,
) -> Vec<Option<CompiledRoute>> {
    let root = KeyPath::root();
    let listen = root.key("listen");
    if config.listen.max_connections == 0 {
        report(listen.key("max_connections"), "must be at least 1".into());
    } else if u32::try_from(config.listen.max_connections).is_err() {
        report(
            listen.key("max_connections"),
            format!("must be at most {}", u32::MAX),
        );
    }
    memory(config, &listen, report);
    positive(
        report,
        &listen.key("drain_timeout"),
        config.listen.drain_timeout,
    );
    positive(
        report,
        &listen.key("header_read_timeout"),
        config.listen.header_read_timeout,
    );
    positive(
        report,
        &listen.key("write_timeout"),
        config.listen.write_timeout,
    );
    positive(
        report,
        &listen.key("idle_timeout"),
        config.listen.idle_timeout,
    );
    if let Some(token) = &config.admin.token {
        if token.len() < 16 || !token.bytes().all(|b| b.is_ascii_graphic()) {
            report(
                root.key("admin").key("token"),
                "must be at least 16 visible ASCII characters (no spaces); \
                 e.g. the output of `openssl rand -hex 16`"
                    .into(),
            );
        }
    }
    if let Some(message) = addresses(config) {
        report(root.key("admin").key("address"), message);
    }

    for (name, upstream) in &config.upstreams {
        upstream_config(report, &root.key("upstreams").key(name.clone()), upstream);
    }
    counts(config, report);
    for (i, server) in config.dns.servers.iter().enumerate() {
        if server.parse::<std::net::SocketAddr>().is_err() {
            report(
                root.key("dns").key("servers").index(i),
                format!("{server:?} is not IP:port, such as \"10.96.0.10:53\""),
            );
        }
    }

    buckets(report, &root, &config.metrics.latency_buckets);
    request_id(report, config);
    tracing_config(report, &root, &config.tracing);

    let defaults = root.key("defaults");
    retry(report, &defaults.key("retry"), &config.defaults.retry);
    breaker(report, &defaults.key("breaker"), &config.defaults.breaker);

    let mut names = HashSet::new();
    let mut compiled = Vec::with_capacity(config.routes.len());
    for (i, route) in config.routes.iter().enumerate() {
        let path = root.key("routes").index(i);
        if route.name.trim().is_empty() {
            report(path.key("name"), "must not be empty".into());
        } else if !names.insert(route.name.as_str()) {
            report(
                path.key("name"),
                format!(
                    "{:?} names another route too; names must be unique",
                    route.name
                ),
            );
        }
        upstream_named(config, unparsed, report, &path, &route.upstream);
        if let Some(f) = &route.fault {
            fault(report, &path.key("fault"), f);
        }
        let matcher = matcher(report, &path.key("match"), &route.matcher);
        let host_rewrite = host_rewrite(
            report,
            &path.key("host_rewrite"),
            route.host_rewrite.as_deref(),
        );
        let retry = retry(report, &path.key("retry"), &route.retry);
        let breaker = breaker(report, &path.key("breaker"), &route.breaker);
        compiled.push(match (retry, breaker, matcher, host_rewrite) {
            (Some((policy, budget)), Some(breaker), Some(matcher), Some(host_rewrite)) => {
                Some(CompiledRoute {
                    policy,
                    matcher,
                    budget,
                    breaker,
                    host_rewrite,
                })
            }
            _ => None,
        });
    }
    compiled
}

/// Routes, upstreams and endpoints a config may have: each costs memory
/// for as long as it is loaded (a route about 25 KiB, mostly its metric
/// series; twice that during a reload), so their number is bounded as
/// the file's size is: 1,000 routes take about 30 MiB.
pub(crate) const MAX_ROUTES: usize = 1000;
pub(crate) const MAX_UPSTREAMS: usize = 1000;
pub(crate) const MAX_ENDPOINTS: usize = 256;
/// Endpoints over all upstreams (each holds its pool, health and series,
/// about 6 KiB: 140 upstreams of 256 endpoints took 208 MiB); an upstream
/// with `discovery = "dns"` counts as the most addresses it takes.
pub(crate) const MAX_TOTAL_ENDPOINTS: usize = 4000;
/// The most addresses a `discovery = "dns"` upstream balances over.
pub const MAX_DNS_ENDPOINTS: usize = 128;

/// `[tracing]`: an OTLP endpoint that is a plain `http(s)://host[:port][/path]`
/// (credentials go in `OTEL_EXPORTER_OTLP_HEADERS`, never in a URL that
/// `/config` and the logs show), and a ratio.
fn tracing_config(report: &mut Report<'_>, root: &KeyPath, c: &crate::config::TracingConfig) {
    let key = root.key("tracing");
    if let Some(endpoint) = &c.otlp_endpoint {
        if let Err(why) = otlp_endpoint(endpoint) {
            let shown = without_userinfo(endpoint).unwrap_or_else(|| endpoint.clone());
            report(
                key.key("otlp_endpoint"),
                format!("{shown:?} {why}, such as \"http://otel-collector:4318\""),
            );
        }
    }
    if !(0.0..=1.0).contains(&c.sample_ratio) {
        report(
            key.key("sample_ratio"),
            format!("{} is out of range 0.0..=1.0", c.sample_ratio),
        );
    }
}

/// Fields a request id may not be carried in: they frame the message, route
/// it, or are the proxy's own.
const NOT_AN_ID: &[&str] = &[
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "te",
    "trailer",
    "upgrade",
    "keep-alive",
    "proxy-connection",
    "traceparent",
    "tracestate",
];

fn request_id(report: &mut Report<'_>, config: &Config) {
    let c = &config.request_id;
    let key = KeyPath::root().key("request_id").key("header");
    // A key that makes a POST repeatable is no id to make up.
    let idempotency = std::iter::once(&config.defaults.retry)
        .chain(config.routes.iter().map(|r| &r.retry))
        .any(|r| {
            r.idempotency_header
                .0
                .as_str()
                .eq_ignore_ascii_case(&c.header)
        });
    match http::HeaderName::from_bytes(c.header.as_bytes()) {
        Err(_) => report(key, format!("{:?} is not a header name", c.header)),
        Ok(_) if idempotency => report(
            key,
            format!(
                "{:?} is an idempotency header: an id made for every request would make every POST repeatable",
                c.header
            ),
        ),
        Ok(name) if !name.as_str().ends_with("-id") => report(
            key,
            format!(
                "{:?} does not name an id: a field whose name ends in \"-id\" (x-request-id, x-correlation-id), \
                 so that no field with a meaning of its own (authorization, cookie, x-forwarded-for) is overwritten",
                c.header
            ),
        ),
        Ok(name)
            if NOT_AN_ID.contains(&name.as_str()) || name.as_str().starts_with("x-herdguard-") =>
        {
            report(
                key,
                format!(
                    "{:?} frames, routes or traces the request, or is herdguard's own: name another header",
                    c.header
                ),
            )
        }
        Ok(_) => {}
    }
}

/// The most bucket bounds a latency histogram may have: each is a series
/// of every route's histograms.
const MAX_BUCKETS: usize = 50;

fn buckets(report: &mut Report<'_>, root: &KeyPath, bounds: &[f64]) {
    let key = root.key("metrics").key("latency_buckets");
    if bounds.len() > MAX_BUCKETS {
        report(
            key.index(MAX_BUCKETS),
            format!("at most {MAX_BUCKETS} bucket bounds: each is a series of every histogram"),
        );
    }
    for (i, pair) in bounds.windows(2).enumerate() {
        if pair[1] <= pair[0] {
            report(
                key.index(i + 1),
                format!(
                    "bounds must rise: {} comes after {} (seconds, ascending)",
                    pair[1], pair[0]
                ),
            );
        }
    }
    for (i, bound) in bounds.iter().enumerate() {
        if !bound.is_finite() || *bound <= 0.0 {
            report(
                key.index(i),
                format!("{bound} is not a time in seconds above 0"),
            );
        }
    }
}

fn counts(config: &Config, report: &mut Report<'_>) {
    let root = KeyPath::root();
    if config.routes.len() > MAX_ROUTES {
        report(
            root.key("routes").index(MAX_ROUTES),
            format!(
                "at most {MAX_ROUTES} routes (this file has {}): each holds about 25 KiB \
                 of state and metric series; match several paths with one route",
                config.routes.len()
            ),
        );
    }
    if let Some(name) = config.upstreams.keys().nth(MAX_UPSTREAMS) {
        report(
            root.key("upstreams").key(name.clone()),
            format!(
                "at most {MAX_UPSTREAMS} upstreams (this file has {})",
                config.upstreams.len()
            ),
        );
    }
    let total: usize = config
        .upstreams
        .values()
        .map(|u| match u.discovery {
            super::Discovery::Dns => MAX_DNS_ENDPOINTS,
            super::Discovery::Static => u.endpoints.len(),
        })
        .sum();
    if total > MAX_TOTAL_ENDPOINTS {
        report(
            root.key("upstreams"),
            format!(
                "{total} endpoints in all (each upstream with discovery = \"dns\" counts as \
                 {MAX_DNS_ENDPOINTS}); at most {MAX_TOTAL_ENDPOINTS}"
            ),
        );
    }
    for (name, u) in &config.upstreams {
        if u.endpoints.len() > MAX_ENDPOINTS {
            report(
                root.key("upstreams")
                    .key(name.clone())
                    .key("endpoints")
                    .index(MAX_ENDPOINTS),
                format!(
                    "at most {MAX_ENDPOINTS} endpoints per upstream (this one has {})",
                    u.endpoints.len()
                ),
            );
        }
    }
}

/// The different hosts an upstream's https endpoints name.
fn https_hosts(u: &UpstreamConfig) -> usize {
    u.endpoints
        .iter()
        .filter(|e| e.starts_with("https://"))
        .filter_map(|e| e.parse::<http::Uri>().ok())
        .filter_map(|uri| uri.host().map(str::to_ascii_lowercase))
        .collect::<HashSet<_>>()
        .len()
}

/// A route's `upstream` names one the file has.
fn upstream_named(
    config: &Config,
    unparsed: &std::collections::BTreeSet<String>,
    report: &mut Report<'_>,
    path: &KeyPath,
    upstream: &str,
) {
    if config.upstreams.contains_key(upstream) || unparsed.contains(upstream) {
        return;
    }
    let mut known: Vec<&str> = config
        .upstreams
        .keys()
        .chain(unparsed)
        .map(String::as_str)
        .collect();
    known.sort_unstable();
    report(
        path.key("upstream"),
        format!(
            "no upstream is named {upstream:?} (known: {})",
            list(&known)
        ),
    );
}

/// `routes[].fault`: shares and a status that can be answered.
fn fault(report: &mut Report<'_>, path: &KeyPath, f: &super::schema::FaultConfig) {
    for (key, share) in [("abort", f.abort), ("delay_ratio", f.delay_ratio)] {
        if !(0.0..=1.0).contains(&share) {
            report(path.key(key), format!("{share} is out of range 0.0..=1.0"));
        }
    }
    if !(200..=599).contains(&f.abort_status) {
        report(
            path.key("abort_status"),
            format!("{} is not a status from 200 to 599", f.abort_status),
        );
    }
}

/// `routes[].host_rewrite`, as the `Host` value sent: `Some(None)` when
/// there is none, `None` when it will not do.
fn host_rewrite(
    report: &mut Report<'_>,
    path: &KeyPath,
    host: Option<&str>,
) -> Option<Option<HeaderValue>> {
    let Some(host) = host else {
        return Some(None);
    };
    let value = check_host_rewrite(host).and_then(|()| {
        HeaderValue::from_str(host).map_err(|_| format!("{host:?} is not a header value"))
    });
    match value {
        Ok(value) => Some(Some(value)),
        Err(why) => {
            report(path.clone(), why);
            None
        }
    }
}

/// The files an upstream's TLS names, loaded as the upstream will load
/// them, so that a `check` that passes builds: `ca_file` must hold a
/// certificate, `client_cert` and `client_key` a matching pair.
fn upstream_tls_files(report: &mut Report<'_>, path: &KeyPath, u: &UpstreamConfig) {
    use super::tls::{load_pair, read_certs};
    if let Some(ca) = &u.ca_file {
        match read_certs(ca) {
            Ok(certs) if certs.is_empty() => report(
                path.key("ca_file"),
                format!("{}: holds no certificate", ca.display()),
            ),
            Ok(_) => {}
            Err(e) => report(path.key("ca_file"), e.to_string()),
        }
    }
    if let (Some(cert), Some(key)) = (&u.client_cert, &u.client_key) {
        if let Err(e) = load_pair(cert, key) {
            let at = match &e {
                super::tls::TlsError::File { path: file, .. } if Path::new(file) == cert => {
                    "client_cert"
                }
                _ => "client_key",
            };
            report(path.key(at), e.to_string());
        }
    }
}

fn upstream_config(report: &mut Report<'_>, path: &KeyPath, u: &UpstreamConfig) {
    if u.discovery == super::Discovery::Dns {
        if u.dns_refresh < Duration::from_millis(100) {
            report(
                path.key("dns_refresh"),
                format!("{:?} is below 100ms", u.dns_refresh),
            );
        }
        if u.server_name.is_none() && https_hosts(u) > 1 {
            report(
                path.key("server_name"),
                "needed with discovery = \"dns\" when https endpoints name different hosts: \
                 the name their certificates are checked against"
                    .into(),
            );
        }
    }
    if u.endpoints.is_empty() {
        report(
            path.key("endpoints"),
            "needs at least one endpoint such as \"http://127.0.0.1:3000\"".into(),
        );
    }
    for (i, endpoint) in u.endpoints.iter().enumerate() {
        if let Err(why) = check_endpoint(endpoint) {
            report(path.key("endpoints").index(i), why);
        } else if u.endpoints[..i].contains(endpoint) {
            // Two slots of one server: twice its share, and two health
            // records (and one set of metric series) for it.
            report(
                path.key("endpoints").index(i),
                format!("{endpoint:?} is listed twice"),
            );
        }
    }
    positive(report, &path.key("connect_timeout"), u.connect_timeout);
    // Under 16 KiB a loopback upstream's segments (64 KiB) no longer fit
    // the window, and data moves only on the kernel's probe timer.
    socket_buffer(
        report,
        path.key("receive_buffer"),
        u.receive_buffer,
        (
            16 << 10,
            ": a smaller window stalls a local upstream's answers",
        ),
    );
    positive(
        report,
        &path.key("tunnel_idle_timeout"),
        u.tunnel_idle_timeout,
    );
    if u.max_in_flight == 0 {
        report(path.key("max_in_flight"), "must be at least 1".into());
    }
    if let Err(e) = Limiter::try_new(&u.adaptive_concurrency, u.max_in_flight) {
        report(path.key("adaptive_concurrency").key(e.key()), e.to_string());
    }
    let now = tokio::time::Instant::now();
    if let Err(e) = Outliers::try_new(&u.outlier, u.endpoints.len(), now) {
        report(path.key("outlier").key(e.key()), e.to_string());
    }
    match (&u.client_cert, &u.client_key) {
        (Some(_), None) => report(
            path.key("client_key"),
            "client_cert needs client_key too".into(),
        ),
        (None, Some(_)) => report(
            path.key("client_cert"),
            "client_key needs client_cert too".into(),
        ),
        _ => {}
    }
    upstream_tls_files(report, path, u);
    if let Some(name) = &u.server_name {
        if rustls::pki_types::ServerName::try_from(name.as_str()).is_err() {
            report(
                path.key("server_name"),
                format!("{name:?} is not a DNS name or IP address"),
            );
        }
    }
}

/// An endpoint is `scheme://host[:port]`, with an optional base path: no credentials
/// (they would travel in the Host header and show in `/config`; errors
/// never repeat them) and a port in 1..=65535.
pub(crate) fn check_endpoint(endpoint: &str) -> Result<(), String> {
    if let Some(shown) = without_userinfo(endpoint) {
        return Err(format!(
            "{shown:?} has a user name or password (an `@`) before its host; an endpoint \
             carries no credentials (use client_cert for mutual TLS)"
        ));
    }
    let uri: Uri = endpoint
        .parse()
        .map_err(|e| format!("{endpoint:?} is not a URL: {e}"))?;
    match uri.scheme_str() {
        Some("http" | "https") => {}
        _ => return Err(format!("{endpoint:?} must start with http:// or https://")),
    }
    let Some(authority) = uri.authority().filter(|a| !a.host().is_empty()) else {
        return Err(format!("{endpoint:?} has no host"));
    };
    // What follows the host (an IPv6 host is bracketed) is the port.
    let host = authority.host();
    let after_host = authority
        .as_str()
        .rsplit_once(host)
        .map_or("", |(_, rest)| rest);
    if let Some(port) = after_host.strip_prefix(':') {
        if !valid_port(port) {
            return Err(format!(
                "{endpoint:?} has port {port:?}; a port is a number in 1..=65535"
            ));
        }
    }
    if crate::policy::route::without_dot_segments(uri.path()) != uri.path() {
        return Err(format!(
            "{endpoint:?} has `.` or `..` in its path; write the base path it means"
        ));
    }
    // A path is a base prefixed to every forwarded path; a query would
    // make every forwarded URL ambiguous.
    if uri.query().is_some() || endpoint.contains('#') {
        return Err(format!(
            "{endpoint:?} has a query or fragment; an endpoint is scheme://host[:port][/base/path]"
        ));
    }
    Ok(())
}

/// Why `endpoint` is not an OTLP endpoint URL, if it is not.
pub(crate) fn otlp_endpoint(endpoint: &str) -> Result<(), &'static str> {
    let uri = endpoint
        .parse::<Uri>()
        .map_err(|_| "is not an http:// or https:// URL")?;
    let authority = uri
        .authority()
        .filter(|_| matches!(uri.scheme_str(), Some("http" | "https")))
        .ok_or("is not an http:// or https:// URL")?;
    if authority.as_str().contains('@') {
        return Err("carries credentials (give them in OTEL_EXPORTER_OTLP_HEADERS)");
    }
    if uri.query().is_some() || endpoint.contains('#') {
        return Err("has a query or fragment (the path /v1/traces is appended)");
    }
    match authority.as_str().strip_prefix(authority.host()) {
        Some("") => Ok(()),
        Some(port) if port.strip_prefix(':').is_some_and(valid_port) => Ok(()),
        _ => Err("has a port that is not 1 to 65535"),
    }
}

/// A port as a Host header carries it: digits only (no sign, no leading
/// zero), 1 to 65535.
fn valid_port(port: &str) -> bool {
    port.bytes().all(|b| b.is_ascii_digit())
        && !port.starts_with('0')
        && matches!(port.parse::<u16>(), Ok(1..))
}

/// A `Host` value: `host[:port]`, nothing else.
pub(crate) fn check_host_rewrite(host: &str) -> Result<(), String> {
    let bad = || {
        format!("{host:?} is not a host[:port] (e.g. \"api.internal\" or \"api.internal:8080\")")
    };
    let authority: http::uri::Authority = host.parse().map_err(|_| bad())?;
    let port_ok = match authority.as_str().strip_prefix(authority.host()) {
        Some("") => true,
        Some(port) => port.strip_prefix(':').is_some_and(valid_port),
        None => false,
    };
    if host.contains('@') || authority.host().is_empty() || !port_ok {
        return Err(bad());
    }
    Ok(())
}

/// The endpoint with everything up to its last `@` masked, if it has
/// one: user information, however it is spelt (a password may hold `/`,
/// `?` or `#`, which would end the authority for a URL parser and leave the
/// rest of the password in view).
fn without_userinfo(endpoint: &str) -> Option<String> {
    let (scheme, rest) = endpoint.split_once("://").unwrap_or(("", endpoint));
    let (_, after) = rest.rsplit_once('@')?;
    Some(format!("{scheme}://***@{after}"))
}

// Validation is construction: each table is compiled by the constructor
// the proxy uses, and its error, which names its key, is reported at that
// key's path. Nothing here re-checks what a constructor checks.

fn matcher(report: &mut Report<'_>, path: &KeyPath, m: &MatchConfig) -> Option<Matcher> {
    let e = match Matcher::try_new(m) {
        Ok(matcher) => return Some(matcher),
        Err(e) => e,
    };
    let at = match &e {
        InvalidMatch::Path(key, _) => path.key(*key),
        InvalidMatch::Host(_) | InvalidMatch::Wildcard(_) => path.key("host"),
        InvalidMatch::HeaderName(name) | InvalidMatch::HeaderValue { name, .. } => {
            path.key("headers").key(name.clone())
        }
    };
    report(at, e.to_string());
    None
}

fn retry(report: &mut Report<'_>, path: &KeyPath, r: &RetryConfig) -> Option<(Policy, Budget)> {
    for e in Policy::problems(r) {
        let at = match (&e, e.key()) {
            (InvalidPolicy::Backoff(inner), _) => path.key("backoff").key(inner.key()),
            (_, (key, Some(index))) => path.key(key).index(index),
            (_, (key, None)) => path.key(key),
        };
        report(at, e.to_string());
    }
    let policy = Policy::from_config(r);
    let budget = Budget::from_config(&r.budget, Instant::now())
        .map_err(|e| report(path.key("budget").key(e.key()), e.to_string()));
    Some((policy.ok()?, budget.ok()?))
}

fn breaker(report: &mut Report<'_>, path: &KeyPath, b: &BreakerConfig) -> Option<Breaker> {
    for e in Breaker::problems(b) {
        report(path.key(e.key()), e.to_string());
    }
    Breaker::try_new(b, Instant::now()).ok()
}

fn positive(report: &mut Report<'_>, path: &KeyPath, d: Duration) {
    if d.is_zero() {
        report(path.clone(), "must be longer than zero".into());
    }
}

/// Names as a list, each quoted (a name may hold any character).
fn list(items: &[&str]) -> String {
    if items.is_empty() {
        return "none".to_owned();
    }
    let quoted: Vec<String> = items.iter().map(|i| format!("{i:?}")).collect();
    quoted.join(", ")
}

/// Things a config may say but probably does not mean. `check` prints them;
/// the proxy logs them at start-up; neither refuses the config.
pub(super) fn warnings(config: &Config, report: &mut Report<'_>) {
    let root = KeyPath::root();
    absurd_values(config, report);
    if config.listen.transparent && config.listen.unrouted == super::Unrouted::Refuse {
        report(
            root.key("listen").key("unrouted"),
            "\"refuse\" with transparent = true: every captured call to a host no route names \
             is answered 404; \"passthrough\" sends it on to where it was going"
                .into(),
        );
    }
    if config.routes.is_empty() {
        let what = match config.listen.unrouted {
            super::Unrouted::Refuse => "every request is answered 404 no-route",
            super::Unrouted::Passthrough => "every request is passed through, never retried",
        };
        report(
            root.key("routes"),
            format!("none: {what} (a hot reload to this file is refused)"),
        );
    }
    sidecar_warnings(config, report);
    retry_warnings(
        report,
        &root.key("defaults").key("retry"),
        &config.defaults.retry,
    );
    if config.defaults.retry.idempotent {
        report(
            root.key("defaults").key("retry").key("idempotent"),
            "true for every route: every POST on every route would be repeated on failure; \
             set it on the routes whose calls are idempotent"
                .into(),
        );
    }
    for (name, u) in &config.upstreams {
        limit_warnings(report, &root.key("upstreams").key(name.as_str()), u);
    }
    for (i, route) in config.routes.iter().enumerate() {
        retry_warnings(
            report,
            &root.key("routes").index(i).key("retry"),
            &route.retry,
        );
        let m = &route.matcher;
        let narrow = m.methods.is_some() || m.path.is_some() || m.path_prefix.is_some();
        if route.retry.idempotent && !config.defaults.retry.idempotent && !narrow {
            report(
                root.key("routes").index(i).key("retry").key("idempotent"),
                "true on a route that matches no method or path: every request it takes, \
                 any POST included, would be repeated on failure; narrow its match to the \
                 idempotent calls"
                    .into(),
            );
        }
    }
}

/// What a sidecar's setup may say but not mean: an open proxy, DNS
/// settings that do nothing, hosts written twice or never reached.
fn sidecar_warnings(config: &Config, report: &mut Report<'_>) {
    let root = KeyPath::root();
    let listen = &config.listen;
    if listen.unrouted == super::Unrouted::Passthrough && !listen.address.ip().is_loopback() {
        report(
            root.key("listen").key("unrouted"),
            format!(
                "\"passthrough\" on {}: anyone who reaches the listener can send requests and \
                 tunnels anywhere through it (an open proxy); listen on loopback, or keep \"refuse\"",
                listen.address
            ),
        );
    }
    let dns_upstreams = config
        .upstreams
        .values()
        .any(|u| u.discovery == super::Discovery::Dns);
    if !config.dns.servers.is_empty() && !dns_upstreams {
        report(
            root.key("dns").key("servers"),
            "no upstream has discovery = \"dns\": these servers are never asked".into(),
        );
    }
    for (name, u) in &config.upstreams {
        if u.discovery != super::Discovery::Dns {
            continue;
        }
        for (i, endpoint) in u.endpoints.iter().enumerate() {
            let literal = endpoint
                .parse::<http::Uri>()
                .ok()
                .and_then(|uri| uri.host().map(|h| h.trim_matches(['[', ']']).to_owned()))
                .is_some_and(|host| host.parse::<std::net::IpAddr>().is_ok());
            if literal {
                report(
                    root.key("upstreams").key(name.as_str()).key("endpoints").index(i),
                    format!("{endpoint:?} is an address: there is no name to resolve, it is one endpoint"),
                );
            }
        }
    }
    for (i, route) in config.routes.iter().enumerate() {
        let Some(hosts) = &route.matcher.host else {
            continue;
        };
        let mut seen = HashSet::new();
        for (j, host) in hosts.0.iter().enumerate() {
            if !seen.insert(host.to_ascii_lowercase()) {
                report(
                    root.key("routes")
                        .index(i)
                        .key("match")
                        .key("host")
                        .index(j),
                    format!("{host:?} is in the list twice"),
                );
            }
        }
        if let Some(earlier) = shadowed_by(config, i) {
            report(
                root.key("routes").index(i).key("match").key("host"),
                format!(
                    "route {:?} comes first and takes every request for these hosts: this route is never reached",
                    config.routes[earlier].name
                ),
            );
        }
    }
}

/// An earlier route that takes every request route `i` would (it looks at
/// the host alone, and each of route `i`'s hosts is one of its hosts or
/// under one of its wildcards).
fn shadowed_by(config: &Config, i: usize) -> Option<usize> {
    let hosts = config.routes[i].matcher.host.as_ref()?;
    let covers = |pattern: &str, host: &str| {
        let (p, h) = (pattern.to_ascii_lowercase(), host.to_ascii_lowercase());
        match p.strip_prefix('*') {
            Some(suffix) => h.ends_with(suffix) && h.len() > suffix.len() && !h.starts_with('*'),
            None => p == h,
        }
    };
    config.routes[..i].iter().position(|earlier| {
        let m = &earlier.matcher;
        let host_only = m.methods.is_none()
            && m.path.is_none()
            && m.path_prefix.is_none()
            && m.headers.is_empty();
        host_only
            && m.host.as_ref().is_some_and(|theirs| {
                hosts
                    .0
                    .iter()
                    .all(|h| theirs.0.iter().any(|p| covers(p, h)))
            })
    })
}

/// Counts above this are warned of: more than any sidecar holds or sends.
const HUGE_COUNT: i64 = 1_000_000_000;

/// Values no one means, whatever their key: a duration above zero and
/// under a millisecond (a `1ns` window or timeout), a count above a
/// billion. Found by walking the config as it would be written back.
fn absurd_values(config: &Config, report: &mut Report<'_>) {
    fn walk(value: &toml::Value, path: &KeyPath, report: &mut Report<'_>) {
        match value {
            toml::Value::Table(table) => {
                for (key, v) in table {
                    walk(v, &path.key(key.as_str()), report);
                }
            }
            toml::Value::Array(items) => {
                for (i, v) in items.iter().enumerate() {
                    walk(v, &path.index(i), report);
                }
            }
            toml::Value::String(text) => {
                let tiny = crate::units::parse_duration(text)
                    .is_ok_and(|d| d > Duration::ZERO && d < Duration::from_millis(1));
                if tiny {
                    report(
                        path.clone(),
                        format!("{text:?} is shorter than a millisecond: probably not what is meant (\"1ms\" is the least that means anything here)"),
                    );
                }
            }
            toml::Value::Integer(n) if *n > HUGE_COUNT => report(
                path.clone(),
                format!("{n} is more than a billion: larger than anything a sidecar holds; probably a typo"),
            ),
            _ => {}
        }
    }
    if let Ok(value) = toml::Value::try_from(config) {
        walk(&value, &KeyPath::root(), report);
    }
    memory_warnings(config, report);
}

/// A memory bound larger than any sidecar is given, or one the bodies kept
/// for retries alone would take most of.
fn memory_warnings(config: &Config, report: &mut Report<'_>) {
    let listen = KeyPath::root().key("listen");
    let (max, bodies) = (config.listen.max_memory, config.listen.max_body_memory);
    if max > 64 << 30 {
        report(
            listen.key("max_memory"),
            format!(
                "{} is more than a sidecar is given: probably a typo (\"0\" turns the bound off)",
                bytesize::ByteSize(max)
            ),
        );
    }
    let own = config.own_memory();
    if max != 0 && own >= max / 4 * 3 {
        report(
            listen.key("max_memory"),
            format!(
                "{}: the config's own state (its routes' and upstreams' series, about {}) takes three quarters of it or more; start and reload refuse it",
                bytesize::ByteSize(max),
                bytesize::ByteSize(own)
            ),
        );
    }
    if bodies == 0 {
        report(
            listen.key("max_body_memory"),
            "0 keeps no request body: none is retried or read whole, every body streams once (unlike listen.max_memory, 0 here is not \"no bound\")".to_owned(),
        );
    }
    if max != 0 && bodies >= max / 2 {
        report(
            listen.key("max_body_memory"),
            format!(
                "{} is half or more of listen.max_memory ({}): bodies kept for retries alone would put memory under pressure",
                bytesize::ByteSize(bodies),
                bytesize::ByteSize(max)
            ),
        );
    }
}

/// Above this `tolerance`, latency barely moves the adaptive limit.
const LOOSEST_TOLERANCE: f64 = 10.0;

/// Adaptive limits that cannot do what they say.
fn limit_warnings(report: &mut Report<'_>, path: &KeyPath, u: &UpstreamConfig) {
    let a = &u.adaptive_concurrency;
    if !a.enabled {
        return;
    }
    let path = path.key("adaptive_concurrency");
    if a.tolerance < 1.5 {
        report(
            path.key("tolerance"),
            format!(
                "{}: the limit grows only on answers within {:.2} x the baseline (their path's usual latency, the lowest of the last 30–60 s), which few answers come within; it will mostly fall (1.5 or more is sound; the default is 2.0)",
                a.tolerance,
                1.0 + (a.tolerance - 1.0) / 2.0
            ),
        );
    }
    if a.tolerance > LOOSEST_TOLERANCE {
        report(
            path.key("tolerance"),
            format!(
                "{}: the limit shrinks only once answers take {} x the baseline; an upstream that queues is held by timeouts alone (up to {LOOSEST_TOLERANCE} is sound; the default is 2.0)",
                a.tolerance, a.tolerance
            ),
        );
    }
    for (key, value) in [
        ("min_limit", a.min_limit),
        ("initial_limit", a.initial_limit),
    ] {
        if value > u.max_in_flight {
            report(
                path.key(key),
                format!(
                    "{value} is above max_in_flight ({}): it is taken down to it",
                    u.max_in_flight
                ),
            );
        }
    }
}

fn retry_warnings(report: &mut Report<'_>, path: &KeyPath, r: &RetryConfig) {
    for (i, m) in r.methods.iter().enumerate() {
        if matches!(m.as_str(), "POST" | "PATCH") {
            report(
                path.key("methods").index(i),
                format!(
                    "{} is not idempotent: a retry may repeat its effect; leave it out and let callers send {:?} instead",
                    m.as_str(),
                    r.idempotency_header.as_str()
                ),
            );
        }
    }
    // A field most requests carry makes every request look keyed, and a
    // hop-by-hop field never reaches the upstream.
    const COMMON: &[&str] = &[
        "accept",
        "accept-encoding",
        "accept-language",
        "authorization",
        "cache-control",
        "connection",
        "content-length",
        "content-type",
        "cookie",
        "date",
        "host",
        "keep-alive",
        "origin",
        "proxy-connection",
        "referer",
        "te",
        "traceparent",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "user-agent",
        "via",
        "x-forwarded-for",
        "x-forwarded-host",
        "x-forwarded-proto",
        "x-request-id",
    ];
    if COMMON.contains(&r.idempotency_header.as_str()) {
        report(
            path.key("idempotency_header"),
            format!(
                "{:?} is a standard field most requests carry (or one that never reaches the upstream): it would make requests that are not safe to repeat look keyed; use a field such as \"idempotency-key\"",
                r.idempotency_header.as_str()
            ),
        );
    }
    for (i, on) in r.retry_on.iter().enumerate() {
        if let RetryOn::Status(code @ 400..=499) = on {
            if !matches!(code, 408 | 429) {
                report(
                    path.key("retry_on").index(i),
                    format!(
                        "{code} is a client error: the same request will fail the same way again"
                    ),
                );
            }
        }
    }
    if let Some(after) = r.hedge_after {
        let why = if r.attempts < 2 {
            Some("attempts = 1 leaves no attempt for a hedge: it is never sent".to_owned())
        } else if after >= r.per_try_timeout {
            Some(format!(
                "{} is not less than per_try_timeout {}: an attempt times out before a hedge is due, so none is ever sent",
                crate::units::format_duration(after),
                crate::units::format_duration(r.per_try_timeout),
            ))
        } else {
            None
        };
        if let Some(why) = why {
            report(path.key("hedge_after"), why);
        }
    }
    if r.attempts > 1 {
        if let Ok(backoff) = crate::policy::Backoff::from_config(&r.backoff) {
            let waits: Duration = (1..r.attempts).map(|n| backoff.ceiling(n)).sum();
            let worst = r.per_try_timeout * r.attempts + waits;
            if worst > r.timeout {
                report(
                    path.key("timeout"),
                    format!(
                        "{} attempts of per_try_timeout {} plus up to {} of backoff come to {}, over timeout {}: late retries will be cut short or skipped",
                        r.attempts,
                        crate::units::format_duration(r.per_try_timeout),
                        crate::units::format_duration(waits),
                        crate::units::format_duration(worst),
                        crate::units::format_duration(r.timeout),
                    ),
                );
            }
        }
    }
}
