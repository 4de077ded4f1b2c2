//! Logging: text or JSON lines on stderr, level from `RUST_LOG` (default `info`).
//!
//! `RUST_LOG` takes `level` or `target=level` directives separated by commas
//! (`warn,herdguard::retry=debug`); a malformed value is reported and `info` used.

use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// Installs the global subscriber. Call once, before anything logs.
pub fn init(format: LogFormat) {
    let (filter, bad) = match std::env::var("RUST_LOG") {
        Ok(text) if !text.trim().is_empty() => match text.parse::<Targets>() {
            Ok(targets) => (targets, None),
            Err(e) => (
                default_filter(),
                Some(format!("RUST_LOG={text:?}: {e}; logging at info")),
            ),
        },
        _ => (default_filter(), None),
    };
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let registry = tracing_subscriber::registry().with(filter);
    match format {
        LogFormat::Text => registry.with(fmt).init(),
        LogFormat::Json => registry
            .with(fmt.json().flatten_event(true).with_current_span(false))
            .init(),
    }
    if let Some(bad) = bad {
        tracing::warn!("{bad}");
    }
}

fn default_filter() -> Targets {
    Targets::new().with_default(tracing::Level::INFO)
}
