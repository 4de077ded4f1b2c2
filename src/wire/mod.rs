//! What goes over the wire on both sides of the proxy: the header rules,
//! the caller's body and upgraded connection as the listener hands them
//! over, and streams that note when they were last active.

pub(crate) mod caller;
pub mod headers;
pub mod identity;
pub(crate) mod stamp;

pub use caller::{BodyEnd, CallerBody, CallerUpgrade, Io, Upgraded};

/// Marks a request the proxy answers 503 at once, before any other work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Crowded {
    /// It came on an HTTP/2 stream past its listener's bound on open
    /// streams, or with a large head past the bound on large heads held.
    Held,
    /// The process's memory is past `listen.max_memory`.
    Memory,
}

/// An error and its causes on one line.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let message = s.to_string();
        if !text.contains(&message) {
            text.push_str(": ");
            text.push_str(&message);
        }
        source = s.source();
    }
    text
}
