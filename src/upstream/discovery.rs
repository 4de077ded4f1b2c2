//! Endpoints found by DNS (`discovery = "dns"`): every address an
//! endpoint's name resolves to (A and AAAA; a headless Service gives one
//! per pod) is an endpoint of its own. Names are resolved again every
//! `dns_refresh`, sooner when the answer's TTL runs out first; a set that
//! changed replaces the old one whole, each address that stays keeping its
//! health, pool and series. An address that leaves is drained: the
//! requests in flight to it hold it until they end, then its pooled
//! connections close and its series go.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hickory_resolver::config::{LookupIpStrategy, NameServerConfig, ResolverConfig};
use hickory_resolver::name_server::TokioConnectionProvider;
use hickory_resolver::proto::xfer::Protocol;
use hickory_resolver::TokioResolver;
use http::{HeaderValue, Uri};
use tokio::time::Instant;

use super::{Endpoint, HttpClient, Members, Upstream, UpstreamError};
use crate::config::{DnsConfig, UpstreamConfig, MAX_DNS_ENDPOINTS};
use crate::observe::metrics::{EndpointMetrics, Metrics};

/// The soonest a name is asked again, whatever its TTL: a TTL of 0 must
/// not make a query per second of every sidecar of a fleet.
const MIN_REFRESH: Duration = Duration::from_secs(1);
/// How long one resolution may take before it counts as failed.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(5);

/// The resolver for upstreams with `discovery = "dns"`: the servers the
/// config names, or those of /etc/resolv.conf.
pub fn resolver(config: &DnsConfig) -> Result<TokioResolver, String> {
    let mut builder = if config.servers.is_empty() {
        TokioResolver::builder_tokio()
            .map_err(|e| format!("dns: /etc/resolv.conf could not be read: {e}"))?
    } else {
        let mut servers = ResolverConfig::new();
        for server in &config.servers {
            let addr: SocketAddr = server
                .parse()
                .map_err(|_| format!("dns.servers: {server:?} is not IP:port"))?;
            servers.add_name_server(NameServerConfig::new(addr, Protocol::Udp));
            servers.add_name_server(NameServerConfig::new(addr, Protocol::Tcp));
        }
        TokioResolver::builder_with_config(servers, TokioConnectionProvider::default())
    };
    let options = builder.options_mut();
    options.ip_strategy = LookupIpStrategy::Ipv4AndIpv6;
    options.timeout = Duration::from_secs(2);
    options.attempts = 2;
    // Cleared at each refresh (see `resolve`).
    options.cache_size = 64;
    Ok(builder.build())
}

/// One endpoint URL whose name is resolved.
struct Target {
    /// `http` or `https`.
    scheme: &'static str,
    /// The name, as asked (no brackets).
    name: String,
    port: u16,
    /// The URL's path, sent before each request's.
    base: String,
    /// The `Host` sent: the URL's authority, not an address.
    host: HeaderValue,
}

impl Target {
    fn parse(url: &str) -> Option<Self> {
        let uri: Uri = url.parse().ok()?;
        let scheme = match uri.scheme_str()? {
            "http" => "http",
            "https" => "https",
            _ => return None,
        };
        let authority = uri.authority()?;
        let port = authority
            .port_u16()
            .unwrap_or(if scheme == "https" { 443 } else { 80 });
        Some(Self {
            scheme,
            name: uri.host()?.trim_matches(['[', ']']).to_owned(),
            port,
            base: uri.path().trim_end_matches('/').to_owned(),
            host: HeaderValue::from_str(authority.as_str()).ok()?,
        })
    }

    /// The endpoint URL of `ip`: its label, and what is connected to.
    fn url(&self, ip: IpAddr) -> String {
        format!(
            "{}://{}{}",
            self.scheme,
            SocketAddr::new(ip, self.port),
            self.base
        )
    }
}

/// What an upstream with `discovery = "dns"` needs to find its endpoints.
pub(crate) struct Names {
    targets: Box<[Target]>,
    config: UpstreamConfig,
    client: Option<Arc<HttpClient>>,
    registry: Arc<Metrics>,
    /// When the names are to be asked again.
    due: Mutex<Instant>,
    resolving: AtomicBool,
    /// The last resolution found the name gone: a second in a row puts
    /// the endpoints as written in place (one NXDOMAIN may be a server's
    /// passing mistake, and would drop every endpoint known good).
    gone_once: AtomicBool,
}

impl Names {
    pub(crate) fn new(
        config: &UpstreamConfig,
        client: Option<Arc<HttpClient>>,
        registry: Arc<Metrics>,
    ) -> Self {
        Self {
            targets: config
                .endpoints
                .iter()
                .filter_map(|e| Target::parse(e))
                .collect(),
            config: config.clone(),
            client,
            registry,
            due: Mutex::new(Instant::now()),
            resolving: AtomicBool::new(false),
            gone_once: AtomicBool::new(false),
        }
    }
}

/// What one round of resolution found.
enum Found {
    /// The addresses of every name (each with the target it is for), and
    /// when the soonest of their answers expires.
    Addresses(Vec<(usize, IpAddr)>, Instant),
    /// Some name is not known to DNS (NXDOMAIN) and no other resolved.
    Gone,
    /// A resolution failed, or answered nothing: the set stays as it is.
    Failed(String),
}

impl Upstream {
    /// Whether this upstream's names are due to be resolved again (and
    /// none is being resolved); marks them as being resolved if so.
    pub fn begin_discovery(&self, now: Instant) -> bool {
        let Some(names) = &self.names else {
            return false;
        };
        let due = *names.due.lock().unwrap_or_else(|e| e.into_inner());
        now >= due && !names.resolving.swap(true, Ordering::AcqRel)
    }

    /// Resolves this upstream's names and, if the addresses changed, puts
    /// the new set in place. A failed resolution keeps the last good set
    /// (logged and counted); a name that is gone leaves the endpoints as
    /// written in the config (each resolved when a connection is made, so
    /// requests fail as connection failures).
    pub async fn discover(self: Arc<Self>, resolver: Arc<TokioResolver>) {
        let Some(names) = &self.names else {
            return;
        };
        let found = resolve(&resolver, &names.targets).await;
        let refresh = names.config.dns_refresh;
        let mut next = Instant::now() + refresh;
        let dns = self.metrics.dns.as_ref();
        match found {
            Found::Addresses(addresses, expires) => {
                names.gone_once.store(false, Ordering::Relaxed);
                next = next.min(expires.max(Instant::now() + MIN_REFRESH));
                if let Some(m) = dns {
                    m.ok.increment(1);
                }
                self.replace_members(names, &addresses);
            }
            Found::Gone => {
                if let Some(m) = dns {
                    m.gone.increment(1);
                }
                if names.gone_once.swap(true, Ordering::Relaxed) {
                    tracing::warn!(upstream = %self.name, "no DNS name of the upstream exists; its endpoints are the names as written");
                    self.replace_members(names, &[]);
                } else {
                    tracing::warn!(upstream = %self.name, "no DNS name of the upstream exists; the last endpoints found stay until the next resolution says so too");
                    next = Instant::now() + refresh.min(MIN_REFRESH * 5);
                }
            }
            Found::Failed(why) => {
                if let Some(m) = dns {
                    m.error.increment(1);
                }
                tracing::warn!(upstream = %self.name, error = %why, "DNS resolution failed; the last endpoints found stay");
                next = Instant::now() + refresh.min(MIN_REFRESH * 5);
            }
        }
        *names.due.lock().unwrap_or_else(|e| e.into_inner()) = next;
        names.resolving.store(false, Ordering::Release);
    }

    /// Puts the endpoints of `addresses` in place, unless they are the
    /// ones there now; none: the URLs as written.
    fn replace_members(&self, names: &Names, addresses: &[(usize, IpAddr)]) {
        let current = self.members.load_full();
        let mut urls: Vec<(String, Option<&HeaderValue>)> = addresses
            .iter()
            .filter_map(|&(t, ip)| names.targets.get(t).map(|t| (t.url(ip), Some(&t.host))))
            .collect();
        if urls.is_empty() {
            urls = names
                .config
                .endpoints
                .iter()
                .map(|e| (e.clone(), None))
                .collect();
        }
        urls.sort();
        urls.dedup_by(|a, b| a.0 == b.0);
        if urls.len() > MAX_DNS_ENDPOINTS {
            // Each sidecar keeps a subset of its own (by a seed of the
            // process), so that a fleet spreads over every address.
            tracing::warn!(upstream = %self.name, found = urls.len(), kept = MAX_DNS_ENDPOINTS, "more addresses than an upstream balances over; a subset of them is used");
            urls.sort_by_cached_key(|(url, _)| subset_rank(url));
            urls.truncate(MAX_DNS_ENDPOINTS);
            urls.sort();
        }
        let unchanged = urls.len() == current.endpoints.len()
            && urls
                .iter()
                .all(|(url, _)| current.endpoints.iter().any(|e| *e.label == **url));
        if unchanged {
            return;
        }
        let endpoints: Result<Box<[Arc<Endpoint>]>, UpstreamError> = urls
            .iter()
            .map(|(url, host)| {
                if let Some(kept) = current.endpoints.iter().find(|e| *e.label == **url) {
                    return Ok(kept.clone());
                }
                let mut shared = || {
                    names.client.clone().ok_or_else(|| UpstreamError::Endpoint {
                        upstream: self.name.to_string(),
                        endpoint: url.clone(),
                    })
                };
                let mut e = Endpoint::parse(&self.name, url, &names.config, &mut shared, *host)?;
                e.metrics = Some(EndpointMetrics::new(&names.registry, &self.name, url));
                Ok(Arc::new(e))
            })
            .collect();
        let built = endpoints.and_then(|endpoints| {
            Members::new(endpoints, &names.config.outlier, Some(&current)).map_err(|e| {
                UpstreamError::Outlier {
                    upstream: self.name.to_string(),
                    key: e.key(),
                    message: e.to_string(),
                }
            })
        });
        match built {
            Ok(members) => {
                let labels: Vec<&str> = members.endpoints.iter().map(|e| &*e.label).collect();
                tracing::info!(upstream = %self.name, endpoints = ?labels, "endpoints changed");
                self.members.store(Arc::new(members));
            }
            Err(e) => {
                tracing::warn!(upstream = %self.name, error = %e, "endpoints found by DNS could not be used")
            }
        }
    }
}

/// Where `url` falls in this process's own order of addresses.
fn subset_rank(url: &str) -> u64 {
    use std::hash::BuildHasher as _;
    static SEED: std::sync::OnceLock<std::collections::hash_map::RandomState> =
        std::sync::OnceLock::new();
    SEED.get_or_init(Default::default).hash_one(url)
}

/// Every target's name, resolved.
async fn resolve(resolver: &TokioResolver, targets: &[Target]) -> Found {
    let mut addresses = Vec::new();
    let mut expires = Instant::now() + Duration::from_secs(3600);
    let mut gone = false;
    // Asked afresh at each refresh: `dns_refresh` bounds how stale the
    // endpoints may be, whatever the records' TTL (which only brings the
    // next refresh sooner). The cache serves the names the targets share.
    resolver.clear_cache();
    for (i, target) in targets.iter().enumerate() {
        if let Ok(ip) = target.name.parse::<IpAddr>() {
            addresses.push((i, ip));
            continue;
        }
        let lookup = tokio::time::timeout(LOOKUP_TIMEOUT, resolver.lookup_ip(&*target.name)).await;
        match lookup {
            Ok(Ok(found)) => {
                expires = expires.min(Instant::from_std(found.valid_until()));
                addresses.extend(found.iter().map(|ip| (i, ip)));
            }
            Ok(Err(e)) if e.is_nx_domain() => gone = true,
            Ok(Err(e)) => return Found::Failed(format!("{}: {e}", target.name)),
            Err(_) => {
                return Found::Failed(format!(
                    "{}: no answer within {LOOKUP_TIMEOUT:?}",
                    target.name
                ))
            }
        }
    }
    match (addresses.is_empty(), gone) {
        (false, _) => Found::Addresses(addresses, expires),
        (true, true) => Found::Gone,
        (true, false) => Found::Failed("no address in the answer".into()),
    }
}
