//! Reloading a running server's config: a new runtime built whole from the
//! new file, or nothing changed.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tracing::{error, info, warn};

use crate::config::{Config, Validated};
use crate::proxy::{BuildError, Runtime};

use super::{on_own_thread, Shared};

/// Reloads a running server's config.
#[derive(Clone)]
pub struct Reloader {
    pub(super) shared: Arc<Shared>,
}

impl Reloader {
    /// Replaces routes and policies with those of `config`, at once, keeping
    /// connections, in-flight requests, and the state of breakers, budgets and
    /// upstreams the new config keeps (see `Runtime::rebuild`). Listener
    /// addresses cannot change without a restart: a change is logged and ignored.
    /// A config that fails its checks changes nothing.
    pub fn reload(&self, config: Config) -> Result<(), BuildError> {
        match config.validate() {
            Ok(config) => self.reload_validated(config),
            Err(e) => {
                self.shared.proxy.metrics().reloaded(false);
                error!(error = %e, "config reload failed; the running config stays");
                Err(e.into())
            }
        }
    }

    /// [`reload`](Self::reload) of a config already checked.
    pub fn reload_validated(&self, config: Validated) -> Result<(), BuildError> {
        let _one_at_a_time = self
            .shared
            .reloading
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let proxy = &self.shared.proxy;
        let current = proxy.runtime();
        let (max, own) = (
            config.config().listen.max_memory,
            config.config().own_memory(),
        );
        let built = if config.config().routes.is_empty() && !current.config.routes.is_empty() {
            Err(BuildError::NoRoutes)
        } else if max != 0 && own >= max / 4 * 3 {
            // What start refuses (measured there), refused before anything
            // is built: a build alone would put memory under pressure.
            Err(BuildError::NoRoom {
                max: max >> 20,
                in_use: own >> 20,
            })
        } else {
            warn_of_kept_listeners(&current.config, config.config());
            let config = config.keep_listeners(&current.config);
            Runtime::rebuild(config, proxy.metrics(), Some(&current))
        };
        match built {
            Ok(runtime) => {
                let routes = runtime.routes.len();
                let changes = Changes::between(&current.config, &runtime.config);
                proxy.swap(runtime);
                // The old runtime goes (with the series of what the new one
                // dropped) before the reload is counted as done, so that a
                // scrape that sees the count sees those series gone.
                drop(current);
                proxy.metrics().reloaded(true);
                info!(
                    routes,
                    routes.added = %changes.routes.added,
                    routes.removed = %changes.routes.removed,
                    routes.changed = %changes.routes.changed,
                    upstreams.added = %changes.upstreams.added,
                    upstreams.removed = %changes.upstreams.removed,
                    upstreams.changed = %changes.upstreams.changed,
                    "config reloaded"
                );
                Ok(())
            }
            Err(e) => {
                proxy.metrics().reloaded(false);
                error!(error = %e, "config reload failed; the running config stays");
                Err(e)
            }
        }
    }

    /// [`reload_file`](Self::reload_file) on a thread of its own: checking a
    /// large file (or one with thousands of errors) and building its routes
    /// takes a while, and a proxy with one worker thread must go on serving.
    pub async fn reload_file_in_background(&self, path: PathBuf) -> Result<(), String> {
        let reloader = self.clone();
        on_own_thread("herdguard-reload", move || reloader.reload_file(&path))
            .await
            .unwrap_or_else(|e| Err(format!("the reload did not finish: {e}")))
    }

    /// Reads, checks and applies a config file. A file with errors changes
    /// nothing: the running config keeps serving; the error is logged and counted.
    pub fn reload_file(&self, path: &Path) -> Result<(), String> {
        self.shared.reading(path);
        match Config::check_file_for_reload(path) {
            Ok(checked) => {
                for w in &checked.warnings {
                    warn!(warning = %w, "config");
                }
                self.reload_validated(checked.validated)
                    .map_err(|e| e.to_string())
            }
            Err(e) => {
                self.shared.proxy.metrics().reloaded(false);
                error!(error = %e, "config reload failed; the running config stays");
                Err(e.to_string())
            }
        }
    }
}

/// A reload cannot move a bound listener: a new address, TLS setting or
/// connection limit (what each connection took at its accept) is said, and
/// the running one kept.
fn warn_of_kept_listeners(running: &Config, new: &Config) {
    for (what, old, new) in [
        ("listen.address", running.listen.address, new.listen.address),
        ("admin.address", running.admin.address, new.admin.address),
    ] {
        if new != old {
            warn!(key = what, running = %old, configured = %new, "a new listen address needs a restart; keeping the running one");
        }
    }
    if new.tracing != running.tracing {
        warn!(
            key = "tracing",
            "a change to [tracing] needs a restart; keeping the running exporter"
        );
    }
    if new.metrics != running.metrics {
        warn!(
            key = "metrics",
            "a change to [metrics] needs a restart; keeping the running histogram buckets"
        );
    }
    let (old, fresh) = (&running.listen, &new.listen);
    for (key, changed) in [
        (
            "listen.max_connections",
            old.max_connections != fresh.max_connections,
        ),
        (
            "listen.header_read_timeout",
            old.header_read_timeout != fresh.header_read_timeout,
        ),
        (
            "listen.write_timeout",
            old.write_timeout != fresh.write_timeout,
        ),
        (
            "listen.idle_timeout",
            old.idle_timeout != fresh.idle_timeout,
        ),
        (
            "listen.drain_timeout",
            old.drain_timeout != fresh.drain_timeout,
        ),
        ("listen.send_buffer", old.send_buffer != fresh.send_buffer),
        ("listen.transparent", old.transparent != fresh.transparent),
    ] {
        if changed {
            warn!(
                key,
                "a change to {key} needs a restart: the listener keeps the one it started with"
            );
        }
    }
    if new.listen.tls != running.listen.tls {
        warn!(
            key = "listen.tls",
            "a change to listen.tls needs a restart (the certificate files themselves are reloaded as they change); keeping the running one"
        );
    }
}

/// What a reload added, removed and changed, by name.
struct Changes {
    routes: Diff,
    upstreams: Diff,
}

impl Changes {
    fn between(old: &Config, new: &Config) -> Self {
        let routes =
            |c: &Config| -> std::collections::BTreeMap<String, crate::config::RouteConfig> {
                c.routes
                    .iter()
                    .map(|r| (r.name.clone(), r.clone()))
                    .collect()
            };
        Self {
            routes: Diff::between(&routes(old), &routes(new)),
            upstreams: Diff::between(&old.upstreams, &new.upstreams),
        }
    }
}

/// Names added, removed and changed between two maps, for one log line.
struct Diff {
    added: Names,
    removed: Names,
    changed: Names,
}

impl Diff {
    fn between<V: PartialEq>(
        old: &std::collections::BTreeMap<String, V>,
        new: &std::collections::BTreeMap<String, V>,
    ) -> Self {
        let mut diff = Diff {
            added: Names::default(),
            removed: Names::default(),
            changed: Names::default(),
        };
        for (name, value) in new {
            match old.get(name) {
                None => diff.added.push(name),
                Some(before) if before != value => diff.changed.push(name),
                Some(_) => {}
            }
        }
        for name in old.keys().filter(|n| !new.contains_key(*n)) {
            diff.removed.push(name);
        }
        diff
    }
}

/// A list of names, shown as `a,b,c` (the first 20, then how many more),
/// or `-` when empty.
#[derive(Default)]
struct Names {
    shown: Vec<String>,
    more: usize,
}

impl Names {
    const SHOWN: usize = 20;

    fn push(&mut self, name: &str) {
        match self.shown.len() < Self::SHOWN {
            true => self.shown.push(name.to_owned()),
            false => self.more += 1,
        }
    }
}

impl std::fmt::Display for Names {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.shown.is_empty() {
            return f.write_str("-");
        }
        f.write_str(&self.shown.join(","))?;
        if self.more > 0 {
            write!(f, ",…+{}", self.more)?;
        }
        Ok(())
    }
}
