//! The access log: one line per request on stdout, once its response has
//! ended (sent whole, cut, or abandoned by its caller), with what a retry
//! proxy's operator asks first: how many attempts, which endpoint answered
//! last, the proxy's own error, and why a retry was not made.
//!
//! Lines go through a queue bounded in bytes ([`QUEUE_BYTES`]) to a writer
//! thread of their own: a worker never waits on stdout (a slow pipe or a
//! full disk). When the queue is full a line is dropped and counted
//! (`herdguard_access_log_dropped_total`) rather than slowing the proxy or
//! growing. A path longer than [`MAX_PATH`] is cut there (ending in `...`),
//! and a method longer than [`MAX_METHOD`].
//! Off, it costs nothing per request: no entry is made.

use std::io::Write;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

use crate::units::clock;
use bytes::Bytes;
use http::{HeaderValue, Method};
use http_body::{Body, Frame, SizeHint};
use metrics::Counter;
use tokio::time::Instant;

use crate::config::{AccessLogConfig, AccessLogFormat};

/// Lines that may wait for the writer; past this they are dropped.
const QUEUE: usize = 16 * 1024;

/// Bytes of lines that may wait for the writer; past this they are dropped.
pub const QUEUE_BYTES: usize = 4 << 20;

/// The longest path a line holds; a longer one is cut and ends in `...`.
pub const MAX_PATH: usize = 2048;

/// The longest method written; a longer one is cut there (ending in `...`).
pub const MAX_METHOD: usize = 32;

/// Bytes of lines queued and not yet written.
static QUEUED_BYTES: AtomicUsize = AtomicUsize::new(0);

/// How long the writer lets lines gather before it writes them.
const BATCH: std::time::Duration = std::time::Duration::from_millis(50);

pub const DROPPED: &str = "herdguard_access_log_dropped_total";

/// The access log of one config: its format and where its lines go.
pub struct AccessLog {
    format: AccessLogFormat,
    lines: SyncSender<Message>,
    dropped: Counter,
}

/// What the writer thread is sent.
enum Message {
    Line(Vec<u8>),
    /// Answer once every line queued before this one is written.
    Flush(std::sync::mpsc::Sender<()>),
}

impl AccessLog {
    /// The log `config` asks for, or `None` when it is off (or its writer
    /// thread could not start, which is logged).
    pub fn new(config: &AccessLogConfig, dropped: Counter) -> Option<Arc<Self>> {
        if !config.enabled {
            return None;
        }
        Some(Arc::new(Self {
            format: config.format,
            lines: writer()?,
            dropped,
        }))
    }

    /// Starts the entry of a request received at `start`.
    pub fn entry(self: &Arc<Self>, method: &Method, path: &str, start: Instant) -> Box<Entry> {
        Box::new(Entry {
            log: self.clone(),
            start,
            method: method.clone(),
            path: cut(path, MAX_PATH),
            route: None,
            // Until an answer is made: a caller that leaves first gets
            // nginx's "client closed request".
            status: 499,
            attempts: 0,
            endpoint: None,
            error: None,
            skip: None,
            bytes: 0,
            request_id: None,
            trace_id: None,
        })
    }
}

static LINES: OnceLock<Option<SyncSender<Message>>> = OnceLock::new();

/// Where the lines go instead of stdout, if set before the log starts.
static FILE: OnceLock<std::fs::File> = OnceLock::new();

/// Sends this process's access log to `path` (created or emptied) instead of
/// stdout: for the demo, whose own report is on stdout. Call it before any
/// config with the log on is loaded; later it changes nothing (`false`).
pub fn write_to(path: &std::path::Path) -> std::io::Result<bool> {
    if LINES.get().is_some() {
        return Ok(false);
    }
    Ok(FILE.set(std::fs::File::create(path)?).is_ok())
}

/// The one writer thread of the process, started on first use.
fn writer() -> Option<SyncSender<Message>> {
    LINES
        .get_or_init(|| {
            let (tx, rx) = sync_channel::<Message>(QUEUE);
            let write = move || {
                let stdout = std::io::stdout();
                let mut acks = Vec::new();
                while let Ok(first) = rx.recv() {
                    // Let a burst gather: a writer that slept on every line
                    // would be woken (a futex call and a context switch on
                    // the proxy's core) for nearly every request. Lines wait
                    // at most this long; Envoy flushes once a second.
                    #[allow(clippy::disallowed_methods)] // the writer's own thread
                    std::thread::sleep(BATCH);
                    // One write for a burst of lines: stdout is line-buffered
                    // (a write per line), a file not buffered at all.
                    let sink: Box<dyn Write> = match FILE.get() {
                        Some(file) => Box::new(file),
                        None => Box::new(stdout.lock()),
                    };
                    let mut out = std::io::BufWriter::with_capacity(64 * 1024, sink);
                    // Whatever queued meanwhile goes in the same write burst.
                    for message in std::iter::once(first).chain(rx.try_iter()) {
                        match message {
                            Message::Line(line) => {
                                let _ = out.write_all(&line);
                                QUEUED_BYTES.fetch_sub(line.len(), Ordering::Relaxed);
                            }
                            Message::Flush(ack) => acks.push(ack),
                        }
                    }
                    let _ = out.flush();
                    for ack in acks.drain(..) {
                        let _ = ack.send(());
                    }
                }
            };
            match std::thread::Builder::new()
                .name("herdguard-access-log".into())
                .spawn(write)
            {
                Ok(_) => Some(tx),
                Err(e) => {
                    tracing::error!(error = %e, "cannot start the access log writer; no access log");
                    None
                }
            }
        })
        .clone()
}

/// Waits, up to `limit`, for every line logged so far to be written: at
/// exit, so the last requests' lines are not lost.
pub fn flush(limit: std::time::Duration) {
    let Some(Some(lines)) = LINES.get() else {
        return;
    };
    let deadline = std::time::Instant::now() + limit;
    let (ack, done) = std::sync::mpsc::channel();
    let mut message = Message::Flush(ack);
    loop {
        match lines.try_send(message) {
            Ok(()) => break,
            Err(TrySendError::Full(m)) if std::time::Instant::now() < deadline => {
                message = m;
                #[allow(clippy::disallowed_methods)] // at exit, off the runtime
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            Err(_) => return,
        }
    }
    let _ = done.recv_timeout(deadline.saturating_duration_since(std::time::Instant::now()));
}

/// One request's line, filled in as the request goes, written when the
/// response body is dropped (sent whole, cut, or left by the caller).
pub struct Entry {
    log: Arc<AccessLog>,
    start: Instant,
    method: Method,
    path: Box<str>,
    /// `None` when no route took the request.
    pub route: Option<Arc<str>>,
    /// 499 when the caller left before the answer.
    pub status: u16,
    pub attempts: u32,
    /// The endpoint of the last attempt, as the config writes it.
    pub endpoint: Option<Arc<str>>,
    /// The proxy's own `x-herdguard-error`.
    pub error: Option<HeaderValue>,
    /// Why a retry was not made, when one was not.
    pub skip: Option<&'static str>,
    /// Response body bytes sent.
    bytes: u64,
    /// The request's id (`[request_id]`).
    pub request_id: Option<HeaderValue>,
    /// The trace it belongs to: 32 hex digits.
    pub trace_id: Option<u128>,
}

impl Entry {
    fn line(&self) -> Vec<u8> {
        let time = humantime::format_rfc3339_millis(std::time::SystemTime::now());
        let duration_ms = clock::now()
            .saturating_duration_since(self.start)
            .as_secs_f64()
            * 1000.0;
        let duration_ms = (duration_ms * 1000.0).round() / 1000.0;
        let error = self.error.as_ref().and_then(|e| e.to_str().ok());
        let request_id = self.request_id.as_ref().and_then(|e| e.to_str().ok());
        let trace_id = self.trace_id.map(|t| format!("{t:032x}"));
        // A caller's own method may be as long as a head allows: cut, as
        // the path is (the registered ones are short).
        let method = match self.method.as_str() {
            m if m.len() <= MAX_METHOD => std::borrow::Cow::Borrowed(m),
            m => std::borrow::Cow::Owned(cut(m, MAX_METHOD).into_string()),
        };
        let mut out = Vec::with_capacity(256);
        match self.log.format {
            AccessLogFormat::Json => {
                let line = serde_json::json!({
                    "time": time.to_string(),
                    "route": self.route.as_deref(),
                    "method": &*method,
                    "path": &*self.path,
                    "status": self.status,
                    "attempts": self.attempts,
                    "duration_ms": duration_ms,
                    "bytes": self.bytes,
                    "endpoint": self.endpoint.as_deref(),
                    "error": error,
                    "skip": self.skip,
                    "request_id": request_id,
                    "trace_id": trace_id,
                });
                let _ = serde_json::to_writer(&mut out, &line);
            }
            AccessLogFormat::Text => {
                let _ = write!(out, "time={time}");
                for (key, value) in [
                    ("route", self.route.as_deref()),
                    ("method", Some(&*method)),
                    ("path", Some(&*self.path)),
                ] {
                    field(&mut out, key, value);
                }
                let _ = write!(
                    out,
                    " status={} attempts={} duration_ms={duration_ms} bytes={}",
                    self.status, self.attempts, self.bytes
                );
                for (key, value) in [
                    ("endpoint", self.endpoint.as_deref()),
                    ("error", error),
                    ("skip", self.skip),
                    ("request_id", request_id),
                    ("trace_id", trace_id.as_deref()),
                ] {
                    field(&mut out, key, value);
                }
            }
        }
        out.push(b'\n');
        out
    }
}

/// ` key=value` in logfmt: `-` for none, quoted (escaped) when the value
/// holds a space, a quote, an `=`, a control character, or nothing, or is
/// `-` itself.
fn field(out: &mut Vec<u8>, key: &str, value: Option<&str>) {
    let _ = match value {
        None => write!(out, " {key}=-"),
        Some(v)
            if v.is_empty()
                || v == "-"
                || v.chars()
                    .any(|c| c == ' ' || c == '"' || c == '=' || c.is_control()) =>
        {
            write!(out, " {key}={v:?}")
        }
        Some(v) => write!(out, " {key}={v}"),
    };
}

/// `path`, or its first `max` bytes (at a character's edge) and `...`.
fn cut(path: &str, max: usize) -> Box<str> {
    if path.len() <= max {
        return path.into();
    }
    let mut end = max;
    while !path.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &path[..end]).into()
}

impl Drop for Entry {
    fn drop(&mut self) {
        let line = self.line();
        let len = line.len();
        if QUEUED_BYTES.fetch_add(len, Ordering::Relaxed) + len > QUEUE_BYTES {
            QUEUED_BYTES.fetch_sub(len, Ordering::Relaxed);
            self.log.dropped.increment(1);
            return;
        }
        match self.log.lines.try_send(Message::Line(line)) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                QUEUED_BYTES.fetch_sub(len, Ordering::Relaxed);
                self.log.dropped.increment(1)
            }
        }
    }
}

pin_project_lite::pin_project! {
    /// A response body that writes its request's access log line when it
    /// is dropped; with no entry (the log is off), just the body.
    pub struct Logged<B> {
        #[pin]
        body: B,
        entry: Option<Box<Entry>>,
        // The request's span (tracing on): ended when this is dropped.
        trace: Option<Box<crate::observe::trace::RequestTrace>>,
    }
}

impl<B> Logged<B> {
    pub fn new(body: B, entry: Option<Box<Entry>>) -> Self {
        Self {
            body,
            entry,
            trace: None,
        }
    }

    /// Keeps the request's span until the response is over.
    pub fn traced(mut self, trace: Option<Box<crate::observe::trace::RequestTrace>>) -> Self {
        self.trace = trace;
        self
    }
}

impl<B: Body<Data = Bytes>> Body for Logged<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.project();
        let polled = this.body.poll_frame(cx);
        if let (Some(entry), Poll::Ready(Some(Ok(frame)))) = (this.entry.as_mut(), &polled) {
            if let Some(data) = frame.data_ref() {
                entry.bytes = entry.bytes.saturating_add(data.len() as u64);
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::{cut, field};

    #[test]
    fn a_long_path_is_cut_at_a_character_edge() {
        assert_eq!(&*cut("/short", 10), "/short");
        assert_eq!(&*cut("/abcdefghij", 4), "/abc...");
        // 'é' is two bytes: a cut inside it moves back to its start.
        assert_eq!(&*cut("/aé", 3), "/a...");
        assert_eq!(
            cut(&"x".repeat(100_000), super::MAX_PATH).len(),
            super::MAX_PATH + 3
        );
    }

    #[test]
    fn text_values_are_quoted_only_when_they_must_be() {
        let mut out = Vec::new();
        for (key, value) in [
            ("a", Some("/plain/path")),
            ("b", None),
            ("c", Some("has space")),
            ("d", Some("")),
            ("f", Some("-")),
            ("e", Some("x=\"y\"\n")),
        ] {
            field(&mut out, key, value);
        }
        assert_eq!(
            String::from_utf8(out).unwrap(),
            r#" a=/plain/path b=- c="has space" d="" f="-" e="x=\"y\"\n""#
        );
    }
}
