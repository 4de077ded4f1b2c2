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
    let fmt = tracing_subscriber::fmt::layer().with_ansi(ansi);
    let registry = tracing_subscriber::registry().with(filter);
    match format {
        LogFormat::Text => registry
            .with(fmt.with_writer(|| OneLine(std::io::stderr())))
            .init(),
        LogFormat::Json => registry
            .with(
                fmt.with_writer(std::io::stderr)
                    .json()
                    .flatten_event(true)
                    // The request's id and trace (`"span":{"request_id":…}`).
                    .with_current_span(true)
                    .with_span_list(false),
            )
            .init(),
    }
    if let Some(bad) = bad {
        tracing::warn!("{bad}");
    }
}

/// Keeps each text event on one line, whatever its fields hold (an error
/// listing several config problems, a value with a line break): line-based
/// log shippers take a line for an event. A break inside the event is
/// written `\n`. The formatter hands over each event whole, in one write.
struct OneLine<W>(W);

impl<W: std::io::Write> std::io::Write for OneLine<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let body = buf.strip_suffix(b"\n").unwrap_or(buf);
        if !body.iter().any(|&b| b == b'\n' || b == b'\r') {
            self.0.write_all(buf)?;
            return Ok(buf.len());
        }
        let mut line = Vec::with_capacity(buf.len() + 16);
        for &b in body {
            match b {
                b'\n' => line.extend_from_slice(b"\\n"),
                b'\r' => line.extend_from_slice(b"\\r"),
                b => line.push(b),
            }
        }
        if body.len() < buf.len() {
            line.push(b'\n');
        }
        self.0.write_all(&line)?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
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
    use super::{colour, OneLine};
    use std::io::Write;

    #[test]
    fn an_event_stays_on_one_line() {
        let mut out = OneLine(Vec::new());
        out.write_all(b"a error=first\nsecond\r\n").unwrap();
        out.write_all(b"b plain\n").unwrap();
        out.write_all(b"c no end").unwrap();
        assert_eq!(
            String::from_utf8(out.0).unwrap(),
            "a error=first\\nsecond\\r\nb plain\nc no end"
        );
    }

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(colour(true, None));
        assert!(colour(true, Some("".into())));
        assert!(!colour(true, Some("1".into())));
        assert!(!colour(false, None));
    }
}
