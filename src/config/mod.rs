//! Configuration: the TOML schema, loading with defaults inheritance, and
//! validation that names the key path and line of every problem.

pub mod files;
mod load;
pub mod schema;
pub mod tls;
pub use crate::units;
mod validate;
mod validated;

pub use load::{Checked, ConfigError, ConfigErrors, KeyPath, LoadError, MAX_CONFIG_BYTES};
pub use schema::*;
pub(crate) use validate::otlp_endpoint as check_otlp_endpoint;
pub use validate::MAX_DNS_ENDPOINTS;
pub use validated::{CompiledRoute, Validated};

use std::net::SocketAddr;

impl Config {
    /// About what the config's own state takes once built, as the memory
    /// bound counts it: its routes' breakers, budgets and metric series,
    /// its upstreams' and endpoints' (measured at start: 1,000 routes on
    /// one upstream 26 MiB; 100 routes each on an upstream of its own 3.6).
    /// Start and reload refuse a config this puts past three quarters of
    /// `listen.max_memory`; `check` warns of it.
    pub fn own_memory(&self) -> u64 {
        const BASE: u64 = 256 << 10;
        const ROUTE: u64 = 26 << 10;
        const UPSTREAM: u64 = 4 << 10;
        const ENDPOINT: u64 = 6 << 10;
        let endpoints: u64 = self
            .upstreams
            .values()
            .map(|u| match u.discovery {
                Discovery::Dns => MAX_DNS_ENDPOINTS as u64,
                Discovery::Static => u.endpoints.len() as u64,
            })
            .sum();
        BASE.saturating_add(ROUTE.saturating_mul(self.routes.len() as u64))
            .saturating_add(UPSTREAM.saturating_mul(self.upstreams.len() as u64))
            .saturating_add(ENDPOINT.saturating_mul(endpoints))
    }

    /// The built-in config of `herdguard --upstream URL`: one upstream, one
    /// catch-all route, every policy at its default.
    pub fn for_upstream(
        url: &str,
        listen: Option<SocketAddr>,
        admin: Option<SocketAddr>,
    ) -> Result<Config, ConfigErrors> {
        let url = url.trim_end_matches('/');
        let mut config = Config::default();
        if let Some(listen) = listen {
            config.listen.address = listen;
        }
        if let Some(admin) = admin {
            config.admin.address = admin;
        }
        config.upstreams.insert(
            "upstream".to_owned(),
            UpstreamConfig {
                endpoints: vec![url.to_owned()],
                ..UpstreamConfig::default()
            },
        );
        config.routes.push(RouteConfig {
            name: "default".to_owned(),
            upstream: "upstream".to_owned(),
            matcher: MatchConfig::default(),
            retry: config.defaults.retry.clone(),
            breaker: config.defaults.breaker.clone(),
            fault: None,
            host_rewrite: None,
        });
        config.check()?;
        Ok(config)
    }

    /// Runs the semantic checks on a config built in code.
    pub fn check(&self) -> Result<(), ConfigErrors> {
        self.compile(true).map(drop)
    }

    /// Checks a config built in code, and compiles it for a runtime. The
    /// files `listen.tls` names are read when the listener starts.
    pub fn validate(self) -> Result<Validated, ConfigErrors> {
        let routes = self.compile(false)?;
        Ok(Validated::new(self, routes))
    }

    fn compile(&self, tls_files: bool) -> Result<Vec<CompiledRoute>, ConfigErrors> {
        let mut errors = Vec::new();
        let mut report = |path, message| {
            errors.push(ConfigError {
                path,
                line: None,
                message,
            })
        };
        let compiled = validate::validate(self, &Default::default(), &mut report);
        if tls_files {
            validate::tls_files(self, &mut report);
        }
        load::compiled_or(compiled, errors)
    }

    /// The effective config as TOML, defaults merged into every route.
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_else(|e| format!("# cannot render config: {e}\n"))
    }
}
