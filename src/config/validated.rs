//! A config that passed every check, with what its checks compiled: the
//! only thing a runtime is built from. It is made by [`Config::validate`]
//! or by loading a file; its fields are private, so a config that fails
//! validation can never reach the runtime, and nothing the checks built is
//! built again.

use std::net::SocketAddr;
use std::sync::Arc;

use http::HeaderValue;

use super::load::{ConfigError, ConfigErrors, KeyPath};
use super::Config;
use crate::policy::breaker::Breaker;
use crate::policy::route::Matcher;
use crate::policy::{Budget, Policy};

/// A checked config and its routes' compiled policies, in route order.
#[derive(Debug)]
pub struct Validated {
    config: Arc<Config>,
    routes: Vec<CompiledRoute>,
}

/// What a route's checks built. The budget and breaker are fresh: a reload
/// that keeps a route's state keeps the running ones instead (the
/// breaker taking this one's thresholds).
#[derive(Debug)]
pub struct CompiledRoute {
    pub(crate) policy: Policy,
    pub(crate) matcher: Matcher,
    pub(crate) budget: Budget,
    pub(crate) breaker: Breaker,
    pub(crate) host_rewrite: Option<HeaderValue>,
}

impl Validated {
    pub(super) fn new(config: Config, routes: Vec<CompiledRoute>) -> Self {
        Self {
            config: Arc::new(config),
            routes,
        }
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn into_config(self) -> Config {
        Arc::unwrap_or_clone(self.config)
    }

    /// The config, shared, and its compiled routes.
    pub(crate) fn into_parts(self) -> (Arc<Config>, Vec<CompiledRoute>) {
        (self.config, self.routes)
    }

    /// The same config listening where `running` does, with its TLS
    /// settings: a reload cannot move a bound listener. The running pair of
    /// addresses passed the checks together, so this one does too.
    pub fn keep_listeners(mut self, running: &Config) -> Self {
        let config = Arc::make_mut(&mut self.config);
        config.listen.address = running.listen.address;
        config.admin.address = running.admin.address;
        config.listen.tls = running.listen.tls.clone();
        // Read at start only: the running exporter and buckets stay, and
        // `/config` shows them, not the file's.
        config.tracing = running.tracing.clone();
        config.metrics = running.metrics.clone();
        self
    }

    /// The same config with the listen and admin addresses given on the
    /// command line, checked again where addresses are concerned.
    pub fn with_addresses(
        mut self,
        listen: Option<SocketAddr>,
        admin: Option<SocketAddr>,
    ) -> Result<Self, ConfigErrors> {
        let config = Arc::make_mut(&mut self.config);
        if let Some(listen) = listen {
            config.listen.address = listen;
        }
        if let Some(admin) = admin {
            config.admin.address = admin;
        }
        match super::validate::addresses(config) {
            None => Ok(self),
            Some(message) => Err(ConfigErrors(vec![ConfigError {
                path: KeyPath::root().key("admin").key("address"),
                line: None,
                message,
            }])),
        }
    }
}
