//! Logging: text or JSON lines on stderr, level from `RUST_LOG` (default `info`).
//! Text is coloured only on a terminal, and never when `NO_COLOR` is set: logs
//! read by a collector or written to a file stay plain.
//!
//! `RUST_LOG` takes `level` or `target=level` directives separated by commas
//! (`warn,herdguard::retry=debug`); a malformed value is reported and `info` used.

use std::io::IsTerminal;

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
    let ansi = colour(
        std::io::stderr().is_terminal(),
        std::env::var_os("NO_COLOR"),
    );
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
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

/// Colour on a terminal, unless `NO_COLOR` is set to anything but empty (no-color.org).
fn colour(terminal: bool, no_color: Option<std::ffi::OsString>) -> bool {
    terminal && no_color.is_none_or(|v| v.is_empty())
}

fn default_filter() -> Targets {
    Targets::new().with_default(tracing::Level::INFO)
}

#[cfg(test)]
mod tests {
    use super::colour;

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(colour(true, None));
        assert!(colour(true, Some("".into())));
        assert!(!colour(true, Some("1".into())));
        assert!(!colour(false, None));
    }
}
