//! Traces in OpenTelemetry's format: a span per request and a child span
//! per attempt, exported in batches over OTLP/HTTP (protobuf) to a
//! collector.
//!
//! A request joins its caller's trace (W3C `traceparent`/`tracestate`) or
//! starts one; each attempt sends upstream its own span id, so that the
//! upstream's spans hang under the attempt that reached it. Sampling is
//! parent-based with a ratio for new traces, as OpenTelemetry's SDK
//! samples (`ParentBased(TraceIdRatioBased)`, the same bound on the trace
//! id's low bytes).
//!
//! Lean, because it runs on every request: a finished span is a small
//! record of fixed fields pushed on a queue of at most
//! [`MAX_QUEUED_SPANS`] (dropped past it, never waited for); a task of its
//! own turns them into an `ExportTraceServiceRequest` with prost's
//! encoding every 500 ms and posts it. The SDK's spans (their
//! attribute lists, names and contexts built per request, and the export
//! thread's conversion to OTLP messages) cost 72% more instructions per
//! request (docs/benchmarks.md). Off (no endpoint), nothing is made per
//! request.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request};
use prost::encoding::{encode_varint, encoded_len_varint, WireType};

use crate::config::TracingConfig;

const TRACEPARENT: http::HeaderName = http::HeaderName::from_static("traceparent");
const TRACESTATE: http::HeaderName = http::HeaderName::from_static("tracestate");

/// Spans waiting for export; past this, new spans are dropped.
pub const MAX_QUEUED_SPANS: usize = 2048;

/// How long finished spans wait before they are sent in a batch.
const BATCH_DELAY: Duration = Duration::from_millis(500);

/// Spans sent in one export at most; as many waiting send at once.
const MAX_BATCH: usize = 512;

/// How long one export may take before it is given up.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// The longest `tracestate` joined; a longer one is dropped.
const MAX_TRACESTATE: usize = 512;

/// The method's name, if HTTP registers it, else `_OTHER`.
fn known_method(method: &http::Method) -> &'static str {
    use http::Method as M;
    match *method {
        M::GET => "GET",
        M::HEAD => "HEAD",
        M::POST => "POST",
        M::PUT => "PUT",
        M::DELETE => "DELETE",
        M::CONNECT => "CONNECT",
        M::OPTIONS => "OPTIONS",
        M::TRACE => "TRACE",
        M::PATCH => "PATCH",
        _ => "_OTHER",
    }
}

/// The tracer of one running proxy, when tracing is on.
pub struct Tracing {
    /// New traces are sampled when their id's low 63 bits are below this.
    ratio_bound: u64,
    queue: Mutex<Vec<Record>>,
    /// Spans dropped because the queue was full.
    dropped: AtomicU64,
    /// Wakes the export task: a batch is full, or the process exits.
    wake: tokio::sync::Notify,
    /// Set at exit: the export task sends what is left, then says so.
    exiting: Mutex<Option<std::sync::mpsc::Sender<()>>>,
}

/// Where spans are sent: the config's `otlp_endpoint` (with `/v1/traces`
/// appended, as OpenTelemetry's convention has it), else the standard
/// environment (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, used as it is, or
/// `OTEL_EXPORTER_OTLP_ENDPOINT` with `/v1/traces`); none: tracing is off.
pub fn endpoint(config: &TracingConfig) -> Option<String> {
    if std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.eq_ignore_ascii_case("true")) {
        return None;
    }
    let env = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    if let Some(configured) = &config.otlp_endpoint {
        return Some(traces_path(configured));
    }
    env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        .or_else(|| env("OTEL_EXPORTER_OTLP_ENDPOINT").map(|base| traces_path(&base)))
}

/// `base` with `/v1/traces` after its path.
fn traces_path(base: &str) -> String {
    let base = base.trim_end_matches('/');
    match base.ends_with("/v1/traces") {
        true => base.to_owned(),
        false => format!("{base}/v1/traces"),
    }
}

impl Tracing {
    /// Starts the exporter `config` asks for, or `None` when tracing is off.
    /// Call inside the tokio runtime: exports run on it.
    pub fn start(config: &TracingConfig) -> Result<Option<Arc<Tracing>>, String> {
        let Some(endpoint) = endpoint(config) else {
            return Ok(None);
        };
        let uri: http::Uri = endpoint
            .parse()
            .map_err(|e| format!("tracing.otlp_endpoint {endpoint:?}: {e}"))?;
        let client = Exporter::new(uri, service_name(config), export_headers()?)
            .map_err(|e| format!("tracing: {e}"))?;
        // OpenTelemetry's TraceIdRatioBased: the trace id's low 8 bytes,
        // shifted right once, below the ratio of 2^63.
        let ratio_bound = (config.sample_ratio.clamp(0.0, 1.0) * (1u64 << 63) as f64) as u64;
        let tracing = Arc::new(Tracing {
            ratio_bound,
            queue: Mutex::new(Vec::new()),
            dropped: AtomicU64::new(0),
            wake: tokio::sync::Notify::new(),
            exiting: Mutex::new(None),
        });
        client
            .runtime
            .spawn(exports(Arc::downgrade(&tracing), client.clone()));
        tracing::info!(
            endpoint,
            sample_ratio = config.sample_ratio,
            "tracing: spans exported over OTLP/HTTP"
        );
        Ok(Some(tracing))
    }

    /// The span of a request with these `headers`: a child of the caller's
    /// span if it sent a valid `traceparent`, else the root of a new trace.
    pub fn request(
        self: &Arc<Self>,
        method: &http::Method,
        headers: &HeaderMap,
    ) -> Box<RequestTrace> {
        let caller = headers
            .get(&TRACEPARENT)
            .and_then(|v| parse_traceparent(v.as_bytes()));
        let (trace_id, parent, sampled) = match caller {
            Some(c) => (c.trace_id, Some(c.span_id), c.sampled),
            None => {
                let id: [u8; 16] = random();
                let mut low = [0u8; 8];
                low.copy_from_slice(&id[8..]);
                (id, None, u64::from_be_bytes(low) >> 1 < self.ratio_bound)
            }
        };
        // A tracestate longer than W3C asks vendors to pass on (512) is
        // dropped (a caller's 16 KB of it would go with every attempt), and
        // one without the trace it belongs to. A kept one goes upstream
        // with the caller's other fields.
        let drop_tracestate = headers
            .get(&TRACESTATE)
            .is_some_and(|v| caller.is_none() || v.len() > MAX_TRACESTATE);
        Box::new(RequestTrace {
            tracing: self.clone(),
            trace_id,
            span_id: random(),
            parent,
            sampled,
            drop_tracestate,
            // A method no one registered is `_OTHER`, as OpenTelemetry's
            // conventions say: a caller's 60 KB method would be in every span.
            method: known_method(method),
            start: unix_nanos(),
            answer: OnceLock::new(),
            skip: OnceLock::new(),
        })
    }

    /// Queues a finished span, or drops it if the queue is full.
    fn finished(&self, record: Record) {
        let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        if queue.len() >= MAX_QUEUED_SPANS {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        queue.push(record);
        let full = queue.len() == MAX_BATCH;
        drop(queue);
        if full {
            self.wake.notify_one();
        }
    }

    /// Spans dropped so far because the queue was full.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Sends every span finished so far, waiting up to a few seconds: at
    /// exit, off the runtime's threads.
    pub fn shutdown(&self) {
        let (tx, rx) = std::sync::mpsc::channel();
        *self.exiting.lock().unwrap_or_else(|e| e.into_inner()) = Some(tx);
        self.wake.notify_one();
        if rx.recv_timeout(Duration::from_secs(5)).is_err() {
            tracing::debug!("tracing: spans could not all be sent at exit");
        }
    }
}

/// The service's name: the config's, else `OTEL_SERVICE_NAME`, else
/// `herdguard`.
fn service_name(config: &TracingConfig) -> String {
    if !config.service_name.is_empty() {
        return config.service_name.clone();
    }
    std::env::var("OTEL_SERVICE_NAME")
        .ok()
        .filter(|v| !v.trim().is_empty())
        .unwrap_or_else(|| "herdguard".to_owned())
}

/// Headers sent with every export, from `OTEL_EXPORTER_OTLP_HEADERS` and
/// `OTEL_EXPORTER_OTLP_TRACES_HEADERS` (`key=value,...`, values
/// percent-encoded), as OpenTelemetry's exporters read them.
fn export_headers() -> Result<HeaderMap, String> {
    let mut headers = HeaderMap::new();
    for var in [
        "OTEL_EXPORTER_OTLP_HEADERS",
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
    ] {
        let Ok(list) = std::env::var(var) else {
            continue;
        };
        for pair in list.split(',').filter(|p| !p.trim().is_empty()) {
            let key = pair.split('=').next().unwrap_or("").trim();
            let bad = || format!("{var}: {key:?} is not a header as key=value");
            let (_, value) = pair.split_once('=').ok_or_else(bad)?;
            let value = percent_encoding::percent_decode_str(value.trim()).decode_utf8_lossy();
            let name = http::HeaderName::from_bytes(key.as_bytes()).map_err(|_| bad())?;
            let mut value = HeaderValue::from_str(&value).map_err(|_| bad())?;
            value.set_sensitive(true);
            headers.insert(name, value);
        }
    }
    Ok(headers)
}

/// A caller's `traceparent`, when it is one.
#[derive(Clone, Copy)]
struct Parent {
    trace_id: [u8; 16],
    span_id: [u8; 8],
    sampled: bool,
}

/// W3C Trace Context: `vv-<32 hex>-<16 hex>-<2 hex>`, version 00 exactly
/// so, a later one possibly with more after a `-`; never version ff, nor
/// ids all zeros.
fn parse_traceparent(field: &[u8]) -> Option<Parent> {
    let field = field.trim_ascii();
    if field.len() < 55 || (field.len() > 55 && field[55] != b'-') {
        return None;
    }
    let version = unhex::<1>(&field[..2])?;
    if version == [0xff] || (version == [0] && field.len() != 55) {
        return None;
    }
    if field[2] != b'-' || field[35] != b'-' || field[52] != b'-' {
        return None;
    }
    let trace_id: [u8; 16] = unhex(&field[3..35])?;
    let span_id: [u8; 8] = unhex(&field[36..52])?;
    let [flags] = unhex::<1>(&field[53..55])?;
    let zero = |b: &[u8]| b.iter().all(|&x| x == 0);
    if zero(&trace_id) || zero(&span_id) {
        return None;
    }
    Some(Parent {
        trace_id,
        span_id,
        sampled: flags & 1 == 1,
    })
}

/// `N` bytes of lowercase hex.
fn unhex<const N: usize>(text: &[u8]) -> Option<[u8; N]> {
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    if text.len() != 2 * N {
        return None;
    }
    let mut out = [0u8; N];
    for (o, pair) in out.iter_mut().zip(text.chunks_exact(2)) {
        *o = (digit(pair[0])? << 4) | digit(pair[1])?;
    }
    Some(out)
}

/// `00-<trace>-<span>-<flags>`: a slice of a per-thread block of them (no
/// allocation per attempt, and an attempt's copy of the headers shares it).
fn traceparent(trace_id: &[u8; 16], span_id: &[u8; 8], sampled: bool) -> HeaderValue {
    const BLOCK: usize = 64;
    const LEN: usize = 55;
    const HEX: &[u8; 16] = b"0123456789abcdef";
    thread_local! {
        static FIELDS: std::cell::RefCell<bytes::BytesMut> =
            std::cell::RefCell::new(bytes::BytesMut::new());
    }
    let mut text = [b'-'; LEN];
    text[..2].copy_from_slice(b"00");
    let digits = trace_id
        .iter()
        .map(|b| (3, b))
        .chain(span_id.iter().map(|b| (4, b)));
    for (i, (skip, b)) in digits.enumerate() {
        let at = skip + 2 * i;
        text[at] = HEX[usize::from(b >> 4)];
        text[at + 1] = HEX[usize::from(b & 0xF)];
    }
    text[53..].copy_from_slice(if sampled { b"01" } else { b"00" });
    let field = FIELDS.with(|fields| {
        let mut block = fields.borrow_mut();
        // Each field is split off the block it was written into; a new
        // block once this one has no room left.
        if block.capacity() < LEN {
            *block = bytes::BytesMut::with_capacity(BLOCK * LEN);
        }
        block.extend_from_slice(&text);
        block.split().freeze()
    });
    HeaderValue::from_maybe_shared(field).unwrap_or(HeaderValue::from_static("-"))
}

/// Random bytes from the thread's own small generator.
fn random<const N: usize>() -> [u8; N] {
    use rand::{Rng as _, SeedableRng as _};
    thread_local! {
        static IDS: std::cell::RefCell<rand::rngs::SmallRng> =
            std::cell::RefCell::new(rand::rngs::SmallRng::from_rng(&mut rand::rng()));
    }
    let mut out = [0u8; N];
    IDS.with(|rng| rng.borrow_mut().fill(&mut out[..]));
    out
}

fn unix_nanos() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// How a request was answered.
struct Answer {
    status: u16,
    attempts: Option<u32>,
    error: Option<Box<str>>,
}

/// A request's span, ended when this is dropped (once its response has
/// gone, whole or not).
pub struct RequestTrace {
    tracing: Arc<Tracing>,
    trace_id: [u8; 16],
    span_id: [u8; 8],
    /// The caller's span, if it sent one.
    parent: Option<[u8; 8]>,
    sampled: bool,
    /// The caller's `tracestate` is not to go upstream.
    drop_tracestate: bool,
    method: &'static str,
    start: u64,
    /// Told how the request was answered: else its caller left first.
    answer: OnceLock<Answer>,
    /// Why a retry was not made, when one was not.
    skip: OnceLock<&'static str>,
}

impl RequestTrace {
    /// The trace's id.
    pub fn trace_id(&self) -> u128 {
        u128::from_be_bytes(self.trace_id)
    }

    /// Starts attempt `n`'s span, to `endpoint`, and puts its context in
    /// `headers` (`traceparent`, `tracestate`): the upstream's spans are
    /// its children.
    pub fn attempt(
        &self,
        n: u32,
        endpoint: &Arc<str>,
        backoff: Option<Duration>,
        headers: &mut HeaderMap,
    ) -> Box<AttemptTrace> {
        let span_id = random();
        headers.insert(
            TRACEPARENT,
            traceparent(&self.trace_id, &span_id, self.sampled),
        );
        if self.drop_tracestate {
            headers.remove(&TRACESTATE);
        }
        Box::new(AttemptTrace {
            tracing: self.sampled.then(|| self.tracing.clone()),
            record: Record {
                trace_id: self.trace_id,
                span_id,
                parent: Some(self.span_id),
                name: Name::Attempt(n),
                start: unix_nanos(),
                address: self.sampled.then(|| endpoint.clone()),
                backoff_ms: backoff.map(|b| u64::try_from(b.as_millis()).unwrap_or(u64::MAX)),
                ..Record::default()
            },
        })
    }

    /// Notes why a retry was not made.
    pub fn skipped(&self, reason: &'static str) {
        let _ = self.skip.set(reason);
    }

    /// Notes how the request was answered: its status, the attempts sent,
    /// and the proxy's own error, if it made the answer.
    pub fn answered(&self, status: u16, attempts: Option<u32>, error: Option<&str>) {
        let _ = self.answer.set(Answer {
            status,
            attempts,
            error: error.filter(|_| self.sampled).map(Into::into),
        });
    }
}

impl Drop for RequestTrace {
    fn drop(&mut self) {
        if !self.sampled {
            return;
        }
        // The caller left before its answer: 499, as the access log has it.
        let answer = self.answer.take().unwrap_or(Answer {
            status: 499,
            attempts: None,
            error: None,
        });
        let failure = match answer.status {
            499 => Some(Failure::CallerLeft),
            500.. => Some(Failure::Status(answer.status)),
            _ => None,
        };
        self.tracing.finished(Record {
            trace_id: self.trace_id,
            span_id: self.span_id,
            parent: self.parent,
            name: Name::Request(self.method),
            start: self.start,
            end: unix_nanos(),
            status: Some(answer.status),
            attempts: answer.attempts,
            skip: self.skip.get().copied(),
            error: answer.error,
            failure,
            ..Record::default()
        });
    }
}

/// One attempt's span, ended with its outcome.
pub struct AttemptTrace {
    /// Where it goes once ended; none when not sampled.
    tracing: Option<Arc<Tracing>>,
    record: Record,
}

impl Drop for AttemptTrace {
    fn drop(&mut self) {
        // Dropped before it ended: a hedge race's loser, or its caller left.
        self.end("cancelled", None);
    }
}

impl AttemptTrace {
    /// Ends the span: how the attempt ended (an outcome of
    /// `herdguard_upstream_attempts_total`), and the status it answered.
    pub fn ended(mut self, outcome: &'static str, status: Option<u16>) {
        self.end(outcome, status);
    }

    fn end(&mut self, outcome: &'static str, status: Option<u16>) {
        if let Some(tracing) = self.tracing.take() {
            let mut record = std::mem::take(&mut self.record);
            record.outcome = Some(outcome);
            record.status = status;
            record.failure = (outcome != "ok").then_some(Failure::Outcome(outcome));
            record.end = unix_nanos();
            tracing.finished(record);
        }
    }
}

/// A span's name.
#[derive(Default)]
enum Name {
    /// A request's span: its method.
    Request(&'static str),
    /// Attempt `n`.
    Attempt(u32),
    #[default]
    Unnamed,
}

/// Why a span ended in error.
enum Failure {
    Status(u16),
    CallerLeft,
    Outcome(&'static str),
}

/// A finished span: fixed fields, turned into OTLP only when exported.
#[derive(Default)]
struct Record {
    trace_id: [u8; 16],
    span_id: [u8; 8],
    parent: Option<[u8; 8]>,
    name: Name,
    start: u64,
    end: u64,
    status: Option<u16>,
    attempts: Option<u32>,
    skip: Option<&'static str>,
    error: Option<Box<str>>,
    address: Option<Arc<str>>,
    backoff_ms: Option<u64>,
    outcome: Option<&'static str>,
    failure: Option<Failure>,
}

/// Sends the queued spans every [`BATCH_DELAY`] (at once while a batch is
/// full) until the tracer is gone, or all of them once the process exits.
async fn exports(tracing: Weak<Tracing>, client: Exporter) {
    loop {
        let Some(t) = tracing.upgrade() else {
            return;
        };
        let exiting = t.exiting.lock().unwrap_or_else(|e| e.into_inner()).take();
        // Taken whole, a new queue made with room for a batch: spans are
        // not moved again, nor the queue grown a push at a time.
        let batch = std::mem::replace(
            &mut *t.queue.lock().unwrap_or_else(|e| e.into_inner()),
            Vec::with_capacity(MAX_BATCH),
        );
        for chunk in batch.chunks(MAX_BATCH) {
            client.send(chunk).await;
        }
        let more = !t.queue.lock().unwrap_or_else(|e| e.into_inner()).is_empty();
        match exiting {
            Some(done) if more => {
                *t.exiting.lock().unwrap_or_else(|e| e.into_inner()) = Some(done);
            }
            Some(done) => {
                let _ = done.send(());
                return;
            }
            None if more => {}
            None => {
                let _ = tokio::time::timeout(BATCH_DELAY, t.wake.notified()).await;
            }
        }
    }
}

/// Appends `v` as a varint: one byte, almost always.
#[inline]
fn varint(buf: &mut Vec<u8>, v: u64) {
    match v < 0x80 {
        true => buf.push(v as u8),
        false => encode_varint(v, buf),
    }
}

/// Appends the key of field `tag`.
#[inline]
fn field_key(buf: &mut Vec<u8>, tag: u32, wire: WireType) {
    varint(buf, u64::from((tag << 3) | wire as u32));
}

/// Appends field `tag` of length-delimited `bytes`.
fn put_bytes(buf: &mut Vec<u8>, tag: u32, bytes: &[u8]) {
    field_key(buf, tag, WireType::LengthDelimited);
    varint(buf, bytes.len() as u64);
    buf.extend_from_slice(bytes);
}

/// What field `tag` (under 16) of `len` bytes takes, key and length included.
fn field_len(len: usize) -> usize {
    1 + encoded_len_varint(len as u64) + len
}

/// Appends an attribute (a `KeyValue` as field `tag`) with a string value.
fn put_text(buf: &mut Vec<u8>, tag: u32, key: &str, value: &str) {
    let any = field_len(value.len());
    field_key(buf, tag, WireType::LengthDelimited);
    varint(buf, (field_len(key.len()) + field_len(any)) as u64);
    put_bytes(buf, 1, key.as_bytes());
    field_key(buf, 2, WireType::LengthDelimited);
    varint(buf, any as u64);
    put_bytes(buf, 1, value.as_bytes());
}

/// Appends an attribute (a `KeyValue` as field `tag`) with an integer value.
fn put_int(buf: &mut Vec<u8>, tag: u32, key: &str, value: i64) {
    let any = 1 + encoded_len_varint(value as u64);
    field_key(buf, tag, WireType::LengthDelimited);
    varint(buf, (field_len(key.len()) + field_len(any)) as u64);
    put_bytes(buf, 1, key.as_bytes());
    field_key(buf, 2, WireType::LengthDelimited);
    varint(buf, any as u64);
    field_key(buf, 3, WireType::Varint);
    varint(buf, value as u64);
}

/// The fields of one OTLP `Span` (opentelemetry/proto/trace/v1/trace.proto).
fn put_span(span: &mut Vec<u8>, r: &Record) {
    put_bytes(span, 1, &r.trace_id);
    put_bytes(span, 2, &r.span_id);
    if let Some(parent) = &r.parent {
        put_bytes(span, 4, parent);
    }
    let mut attempt = [0u8; 24];
    let (name, kind): (&[u8], u64) = match r.name {
        Name::Request(method) => (method.as_bytes(), 2),
        Name::Attempt(n) => {
            use std::io::Write as _;
            let mut at = &mut attempt[..];
            let _ = write!(at, "attempt {n}");
            let len = 24 - at.len();
            (&attempt[..len], 3)
        }
        Name::Unnamed => (b"span", 0),
    };
    put_bytes(span, 5, name);
    field_key(span, 6, WireType::Varint);
    varint(span, kind);
    for (tag, time) in [(7, r.start), (8, r.end)] {
        field_key(span, tag, WireType::SixtyFourBit);
        span.extend_from_slice(&time.to_le_bytes());
    }
    put_attributes(span, r);
    if let Some(failure) = &r.failure {
        let message = match failure {
            Failure::Status(s) => std::borrow::Cow::Owned(s.to_string()),
            Failure::CallerLeft => "the caller left before its answer".into(),
            Failure::Outcome(o) => (*o).into(),
        };
        // Status: its message (2), and code ERROR (3 = 2).
        field_key(span, 15, WireType::LengthDelimited);
        varint(span, (field_len(message.len()) + 2) as u64);
        put_bytes(span, 2, message.as_bytes());
        field_key(span, 3, WireType::Varint);
        varint(span, 2);
    }
}

/// A span's attributes (field 9 of a `Span`).
fn put_attributes(span: &mut Vec<u8>, r: &Record) {
    match r.name {
        Name::Request(method) => put_text(span, 9, "http.request.method", method),
        Name::Attempt(n) => put_int(span, 9, "herdguard.attempt", i64::from(n)),
        Name::Unnamed => {}
    }
    if let Some(address) = &r.address {
        put_text(span, 9, "server.address", address);
    }
    if let Some(ms) = r.backoff_ms {
        let ms = i64::try_from(ms).unwrap_or(i64::MAX);
        put_int(span, 9, "herdguard.backoff_ms", ms);
    }
    if let Some(outcome) = r.outcome {
        put_text(span, 9, "herdguard.outcome", outcome);
    }
    if let Some(status) = r.status {
        put_int(span, 9, "http.response.status_code", i64::from(status));
    }
    if let Some(attempts) = r.attempts {
        put_int(span, 9, "herdguard.attempts", i64::from(attempts));
    }
    if let Some(skip) = r.skip {
        put_text(span, 9, "herdguard.skip_reason", skip);
    }
    if let Some(error) = &r.error {
        put_text(span, 9, "herdguard.error", error);
    }
}

/// An `ExportTraceServiceRequest` of `spans`, from `service`: each span
/// written once into a scratch buffer and copied after its length, the
/// messages around them given their lengths from what they hold.
fn encode(service: &str, spans: &[Record]) -> Vec<u8> {
    let mut all = Vec::with_capacity(spans.len() * 320);
    let mut scratch = Vec::with_capacity(512);
    for span in spans {
        scratch.clear();
        put_span(&mut scratch, span);
        put_bytes(&mut all, 2, &scratch);
    }
    let mut scope = Vec::new();
    put_bytes(&mut scope, 1, b"herdguard");
    put_bytes(&mut scope, 2, env!("CARGO_PKG_VERSION").as_bytes());
    let mut resource = Vec::new();
    put_text(&mut resource, 1, "service.name", service);
    let scope_spans = field_len(scope.len()) + all.len();
    let resource_spans = field_len(resource.len()) + field_len(scope_spans);
    let mut out = Vec::with_capacity(field_len(resource_spans));
    field_key(&mut out, 1, WireType::LengthDelimited);
    varint(&mut out, resource_spans as u64);
    put_bytes(&mut out, 1, &resource);
    field_key(&mut out, 2, WireType::LengthDelimited);
    varint(&mut out, scope_spans as u64);
    put_bytes(&mut out, 1, &scope);
    out.extend_from_slice(&all);
    out
}

/// The OTLP exporter: hyper, run on the proxy's runtime.
#[derive(Debug, Clone)]
struct Exporter {
    client: hyper_util::client::legacy::Client<
        hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
        http_body_util::Full<Bytes>,
    >,
    runtime: tokio::runtime::Handle,
    endpoint: http::Uri,
    service: Arc<str>,
    headers: Arc<HeaderMap>,
}

impl Exporter {
    fn new(endpoint: http::Uri, service: String, headers: HeaderMap) -> Result<Self, String> {
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|_| "tracing starts inside the runtime".to_owned())?;
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_native_roots()
            .map_err(|e| format!("no CA certificates for https collectors: {e}"))?
            .https_or_http()
            .enable_http1()
            .build();
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .pool_idle_timeout(Duration::from_secs(30))
                .build(https);
        Ok(Self {
            client,
            runtime,
            endpoint,
            service: service.into(),
            headers: Arc::new(headers),
        })
    }

    /// Posts `spans`; a failure is logged (at debug: a collector that is
    /// down must not fill the logs) and the spans are let go.
    async fn send(&self, spans: &[Record]) {
        let body = Bytes::from(encode(&self.service, spans));
        let mut request = Request::post(self.endpoint.clone())
            .header(http::header::CONTENT_TYPE, "application/x-protobuf")
            .body(http_body_util::Full::new(body))
            .unwrap_or_default();
        for (name, value) in self.headers.iter() {
            request.headers_mut().insert(name, value.clone());
        }
        let sent = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|e| e.to_string())?;
            let status = response.status();
            let limited = http_body_util::Limited::new(response.into_body(), MAX_ANSWER);
            let _ = http_body_util::BodyExt::collect(limited).await;
            match status.is_success() {
                true => Ok(()),
                false => Err(format!("the collector answered {status}")),
            }
        };
        match tokio::time::timeout(EXPORT_TIMEOUT, sent).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::debug!(error = %e, spans = spans.len(), "tracing: export failed")
            }
            Err(_) => tracing::debug!(spans = spans.len(), "tracing: export timed out"),
        }
    }
}

/// The most of a collector's answer read.
const MAX_ANSWER: usize = 64 * 1024;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_is_read_and_written_as_w3c_says() {
        let tp = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let p = parse_traceparent(tp).expect("valid");
        assert!(p.sampled);
        assert_eq!(traceparent(&p.trace_id, &p.span_id, true).as_bytes(), tp);
        for bad in [
            &b"00-00000000000000000000000000000000-00f067aa0ba902b7-01"[..],
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            b"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            b"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            b"",
        ] {
            let shown = String::from_utf8_lossy(bad);
            assert!(parse_traceparent(bad).is_none(), "{shown}");
        }
        // A later version may carry more after the flags.
        let later = b"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-more";
        assert!(parse_traceparent(later).is_some_and(|p| !p.sampled));
    }

    #[test]
    fn nothing_from_the_wire_panics_the_parser() {
        let mut rng = <rand::rngs::SmallRng as rand::SeedableRng>::seed_from_u64(7);
        let base = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x";
        for _ in 0..20_000 {
            use rand::Rng as _;
            let len = rng.random_range(0..=base.len() + 4);
            let mut field: Vec<u8> = base.iter().copied().cycle().take(len).collect();
            for _ in 0..rng.random_range(0..4) {
                if let Some(i) = (!field.is_empty()).then(|| rng.random_range(0..field.len())) {
                    field[i] = rng.random();
                }
            }
            let _ = parse_traceparent(&field);
        }
    }
}
