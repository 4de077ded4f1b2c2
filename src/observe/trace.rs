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
//! encoding every 500 ms, or at once while a batch of 512 is full, and
//! posts it. At 100% sampling that costs about a tenth more instructions
//! per request (docs/benchmarks.md). Off (no endpoint), nothing is made per
//! request.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
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
    /// Spans lost in exports that failed.
    failed: AtomicU64,
    /// Wakes the export task: a batch is full, or the process exits.
    wake: tokio::sync::Notify,
    /// Set at exit: the export task sends what is left, then says so.
    exiting: Mutex<Option<std::sync::mpsc::Sender<()>>>,
}

/// Where spans are sent: the config's `otlp_endpoint` (with `/v1/traces`
/// appended, as OpenTelemetry's convention has it), else the standard
/// environment (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, used as it is, or
/// `OTEL_EXPORTER_OTLP_ENDPOINT` with `/v1/traces`); none: tracing is off.
/// An endpoint from the environment is held to the config's checks (no
/// credentials, query or fragment; a valid port), and named in an error
/// by its variable only.
pub fn endpoint(config: &TracingConfig) -> Result<Option<String>, String> {
    if std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.eq_ignore_ascii_case("true")) {
        return Ok(None);
    }
    if let Some(configured) = &config.otlp_endpoint {
        return Ok(Some(traces_path(configured)));
    }
    for (var, append) in [
        ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", false),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", true),
    ] {
        let Some(value) = std::env::var(var).ok().filter(|v| !v.trim().is_empty()) else {
            continue;
        };
        return env_endpoint(var, &value, append).map(Some);
    }
    Ok(None)
}

/// The endpoint environment variable `var` names, checked as the config's
/// is; `append`: with `/v1/traces` after its path.
fn env_endpoint(var: &str, value: &str, append: bool) -> Result<String, String> {
    let value = value.trim();
    crate::config::check_otlp_endpoint(value).map_err(|why| format!("{var} {why}"))?;
    Ok(match append {
        true => traces_path(value),
        false => value.to_owned(),
    })
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
        let Some(endpoint) = endpoint(config)? else {
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
            failed: AtomicU64::new(0),
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
        // Several `traceparent` fields are no valid one: W3C asks for a
        // new trace, as for a malformed field.
        let mut parents = headers.get_all(&TRACEPARENT).iter();
        let caller = match (parents.next(), parents.next()) {
            (Some(field), None) => parse_traceparent(field.as_bytes()),
            _ => None,
        };
        let (trace_id, parent, sampled) = match caller {
            Some(c) => (c.trace_id, Some(c.span_id), c.sampled),
            None => {
                let id: [u8; 16] = random();
                let mut low = [0u8; 8];
                low.copy_from_slice(&id[8..]);
                (id, None, u64::from_be_bytes(low) >> 1 < self.ratio_bound)
            }
        };
        // A tracestate longer than W3C asks vendors to pass on (512), its
        // fields joined with commas as W3C joins them, is dropped (a
        // caller's 16 KB of it would go with every attempt), and one
        // without the trace it belongs to. A kept one goes upstream with
        // the caller's other fields.
        let (fields, joined) = headers
            .get_all(&TRACESTATE)
            .iter()
            .fold((0, 0), |(n, len), v| {
                (n + 1, len + v.len() + usize::from(n > 0))
            });
        let drop_tracestate = fields > 0 && (caller.is_none() || joined > MAX_TRACESTATE);
        Box::new(RequestTrace {
            tracing: self.clone(),
            trace_id,
            span_id: random(),
            parent: parent.unwrap_or_default(),
            sampled,
            drop_tracestate,
            // A method no one registered is `_OTHER`, as OpenTelemetry's
            // conventions say: a caller's 60 KB method would be in every span.
            method: known_method(method),
            start: unix_nanos(),
            attempts: AtomicU32::new(0),
            status: 0,
            error: None,
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

    /// Spans lost so far in exports that failed.
    pub fn failed(&self) -> u64 {
        self.failed.load(Ordering::Relaxed)
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

/// Each byte's two lowercase hex digits.
const HEX_PAIRS: [[u8; 2]; 256] = {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut pairs = [[0u8; 2]; 256];
    let mut i = 0;
    while i < 256 {
        pairs[i] = [HEX[i >> 4], HEX[i & 0xF]];
        i += 1;
    }
    pairs
};

/// `00-<trace>-<span>-<flags>`: a slice of a per-thread block of them (no
/// allocation per attempt, and an attempt's copy of the headers shares it).
fn traceparent(trace_id: &[u8; 16], span_id: &[u8; 8], sampled: bool) -> HeaderValue {
    const BLOCK: usize = 64;
    const LEN: usize = 55;
    thread_local! {
        static FIELDS: std::cell::RefCell<bytes::BytesMut> =
            std::cell::RefCell::new(bytes::BytesMut::new());
    }
    let mut text = [b'-'; LEN];
    text[..2].copy_from_slice(b"00");
    for (out, b) in text[3..35].chunks_exact_mut(2).zip(trace_id) {
        out.copy_from_slice(&HEX_PAIRS[usize::from(*b)]);
    }
    for (out, b) in text[36..52].chunks_exact_mut(2).zip(span_id) {
        out.copy_from_slice(&HEX_PAIRS[usize::from(*b)]);
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

/// A request's span, ended when this is dropped (once its response has
/// gone, whole or not).
pub struct RequestTrace {
    tracing: Arc<Tracing>,
    trace_id: [u8; 16],
    span_id: [u8; 8],
    /// The caller's span, if it sent one (else zeros).
    parent: [u8; 8],
    sampled: bool,
    /// The caller's `tracestate` is not to go upstream.
    drop_tracestate: bool,
    method: &'static str,
    start: u64,
    /// The attempts started so far (the highest attempt number).
    attempts: AtomicU32,
    /// The status it was answered with: 0 while its caller has had none.
    status: u16,
    /// The proxy's own error, when it made the answer.
    error: Option<Box<str>>,
    /// Why a retry was not made, when one was not.
    skip: OnceLock<&'static str>,
}

impl RequestTrace {
    /// The trace's id.
    pub fn trace_id(&self) -> u128 {
        u128::from_be_bytes(self.trace_id)
    }

    /// Takes out of `headers` the trace context each attempt sets (and a
    /// `tracestate` not passed on): done once for the fields all attempts
    /// share.
    pub fn strip(&self, headers: &mut HeaderMap) {
        headers.remove(&TRACEPARENT);
        if self.drop_tracestate {
            headers.remove(&TRACESTATE);
        }
    }

    /// Starts attempt `n`'s span, to `endpoint`, and puts its context in
    /// `headers` (`traceparent`, `tracestate`): the upstream's spans are
    /// its children. No span is kept when the trace is not sampled.
    pub fn attempt(
        &self,
        n: u32,
        endpoint: &Arc<str>,
        backoff: Option<Duration>,
        headers: &mut HeaderMap,
    ) -> Option<Box<AttemptTrace<'_>>> {
        let span_id = random();
        headers.insert(
            TRACEPARENT,
            traceparent(&self.trace_id, &span_id, self.sampled),
        );
        if self.drop_tracestate {
            headers.remove(&TRACESTATE);
        }
        self.attempts.fetch_max(n, Ordering::Relaxed);
        // Boxed: the attempt's future keeps room for it, traced or not.
        self.sampled.then(|| {
            Box::new(AttemptTrace {
                request: self,
                span_id,
                n,
                backoff_ms: backoff.map(|b| u32::try_from(b.as_millis()).unwrap_or(u32::MAX)),
                start: unix_nanos(),
                address: Some(endpoint.clone()),
            })
        })
    }

    /// Notes why a retry was not made.
    pub fn skipped(&self, reason: &'static str) {
        let _ = self.skip.set(reason);
    }

    /// Notes how the request was answered: its status, and the proxy's own
    /// error, if it made the answer.
    pub fn answered(&mut self, status: u16, error: Option<&str>) {
        self.status = status;
        self.error = error.filter(|_| self.sampled).map(Into::into);
    }
}

impl Drop for RequestTrace {
    fn drop(&mut self) {
        if !self.sampled {
            return;
        }
        self.tracing.finished(Record {
            trace_id: self.trace_id,
            span_id: self.span_id,
            parent: self.parent,
            start: self.start,
            end: unix_nanos(),
            span: Span::Request {
                method: self.method,
                // The caller left before its answer: 499, as the access
                // log has it.
                status: match self.status {
                    0 => 499,
                    s => s,
                },
                attempts: *self.attempts.get_mut(),
                skip: self.skip.get().copied(),
                error: self.error.take(),
            },
        });
    }
}

/// One sampled attempt's span, ended with its outcome.
pub struct AttemptTrace<'a> {
    request: &'a RequestTrace,
    span_id: [u8; 8],
    n: u32,
    backoff_ms: Option<u32>,
    start: u64,
    /// Taken when the span ends.
    address: Option<Arc<str>>,
}

impl Drop for AttemptTrace<'_> {
    fn drop(&mut self) {
        // Dropped before it ended: a hedge race's loser, or its caller left.
        self.end("cancelled", 0);
    }
}

impl AttemptTrace<'_> {
    /// Ends the span: how the attempt ended (an outcome of
    /// `herdguard_upstream_attempts_total`), and the status it answered.
    pub fn ended(mut self, outcome: &'static str, status: Option<u16>) {
        self.end(outcome, status.unwrap_or(0));
    }

    fn end(&mut self, outcome: &'static str, status: u16) {
        // Taken: ended once, by `ended` or else when dropped.
        let Some(address) = self.address.take() else {
            return;
        };
        let request = self.request;
        request.tracing.finished(Record {
            trace_id: request.trace_id,
            span_id: self.span_id,
            parent: request.span_id,
            start: self.start,
            end: unix_nanos(),
            span: Span::Attempt {
                n: self.n,
                backoff_ms: self.backoff_ms,
                outcome,
                status,
                address,
            },
        });
    }
}

/// What a span was, with the attributes of its kind.
enum Span {
    Request {
        method: &'static str,
        status: u16,
        attempts: u32,
        skip: Option<&'static str>,
        error: Option<Box<str>>,
    },
    Attempt {
        n: u32,
        backoff_ms: Option<u32>,
        /// An outcome of `herdguard_upstream_attempts_total`.
        outcome: &'static str,
        /// The status answered; 0: none.
        status: u16,
        address: Arc<str>,
    },
}

/// A finished span: fixed fields, turned into OTLP only when exported.
struct Record {
    trace_id: [u8; 16],
    span_id: [u8; 8],
    /// Zeros: none.
    parent: [u8; 8],
    start: u64,
    end: u64,
    span: Span,
}

/// Sends the queued spans every [`BATCH_DELAY`] (at once while a batch is
/// full) until the tracer is gone, or all of them once the process exits.
async fn exports(tracing: Weak<Tracing>, client: Exporter) {
    // The queue is taken whole and this one, sent and emptied, put in its
    // place: spans are not moved again, nor a queue made for each batch.
    let mut spare = Vec::with_capacity(MAX_BATCH);
    let mut failures = Failures::default();
    loop {
        let Some(t) = tracing.upgrade() else {
            return;
        };
        let exiting = t.exiting.lock().unwrap_or_else(|e| e.into_inner()).take();
        let mut batch = std::mem::replace(
            &mut *t.queue.lock().unwrap_or_else(|e| e.into_inner()),
            spare,
        );
        for chunk in batch.chunks(MAX_BATCH) {
            if let Err(e) = client.send(chunk).await {
                failures.failed(&t, chunk.len(), &e);
            }
        }
        batch.clear();
        // A burst's room is let go once it has passed.
        batch.shrink_to(MAX_BATCH);
        spare = batch;
        // Sent at once only while a batch is full: spans that came in
        // during an export wait for the next, not each export for a few.
        let waiting = t.queue.lock().unwrap_or_else(|e| e.into_inner()).len();
        match exiting {
            Some(done) if waiting > 0 => {
                *t.exiting.lock().unwrap_or_else(|e| e.into_inner()) = Some(done);
            }
            Some(done) => {
                let _ = done.send(());
                return;
            }
            None if waiting >= MAX_BATCH => {}
            None => {
                let _ = tokio::time::timeout(BATCH_DELAY, t.wake.notified()).await;
            }
        }
    }
}

/// Exports that failed, told in the log at most once a minute: a
/// collector that is down must not fill the logs, nor go unseen.
#[derive(Default)]
struct Failures {
    /// When the log last told of one, and spans lost since.
    told: Option<std::time::Instant>,
    untold: u64,
}

impl Failures {
    fn failed(&mut self, tracing: &Tracing, spans: usize, error: &str) {
        tracing.failed.fetch_add(spans as u64, Ordering::Relaxed);
        self.untold += spans as u64;
        if self
            .told
            .is_some_and(|t| t.elapsed() < Duration::from_secs(60))
        {
            tracing::debug!(error, spans, "tracing: export failed");
            return;
        }
        tracing::warn!(
            error,
            spans_lost = self.untold,
            "tracing: spans could not be exported (said at most once a minute; herdguard_trace_spans_failed_total counts them)"
        );
        self.told = Some(std::time::Instant::now());
        self.untold = 0;
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

/// The key of field `tag` (under 16) of wire type `wire`: one byte.
const fn key(tag: u8, wire: WireType) -> u8 {
    (tag << 3) | wire as u8
}

const SPAN_ATTRIBUTE: u8 = key(9, WireType::LengthDelimited);
const RESOURCE_ATTRIBUTE: u8 = key(1, WireType::LengthDelimited);

/// Appends field `tag` (under 16) of length-delimited `bytes`.
#[inline]
fn put_bytes(buf: &mut Vec<u8>, tag: u8, bytes: &[u8]) {
    buf.push(key(tag, WireType::LengthDelimited));
    varint(buf, bytes.len() as u64);
    buf.extend_from_slice(bytes);
}

/// What a field (under 16) of `len` bytes takes, key and length included.
fn field_len(len: usize) -> usize {
    1 + encoded_len_varint(len as u64) + len
}

/// A `KeyValue`'s key (field 1, a string under 128 bytes), encoded once.
const fn key_field<const N: usize>(name: &str) -> [u8; N] {
    let name = name.as_bytes();
    assert!(N == name.len() + 2 && name.len() < 0x80);
    let mut out = [0u8; N];
    out[0] = key(1, WireType::LengthDelimited);
    out[1] = name.len() as u8;
    let mut i = 0;
    while i < name.len() {
        out[2 + i] = name[i];
        i += 1;
    }
    out
}

/// An attribute's key, encoded at compile time.
macro_rules! attribute {
    ($name:literal) => {{
        const FIELD: [u8; $name.len() + 2] = key_field($name);
        &FIELD
    }};
}

/// Appends an attribute (a `KeyValue` as the field `tag` byte says) of
/// the encoded key `name` with a string value.
fn put_text(buf: &mut Vec<u8>, tag: u8, name: &[u8], value: &str) {
    // AnyValue { string_value (1) }
    let any = field_len(value.len());
    buf.push(tag);
    varint(buf, (name.len() + field_len(any)) as u64);
    buf.extend_from_slice(name);
    buf.push(key(2, WireType::LengthDelimited));
    varint(buf, any as u64);
    put_bytes(buf, 1, value.as_bytes());
}

/// Appends a span attribute of the encoded key `name` with an integer value.
fn put_int(buf: &mut Vec<u8>, name: &[u8], value: u64) {
    // AnyValue { int_value (3) }
    let any = 1 + encoded_len_varint(value);
    buf.push(SPAN_ATTRIBUTE);
    varint(buf, (name.len() + 2 + any) as u64);
    buf.extend_from_slice(name);
    buf.extend_from_slice(&[key(2, WireType::LengthDelimited), any as u8]);
    buf.push(key(3, WireType::Varint));
    varint(buf, value);
}

/// "attempt N" in `out`.
fn attempt_name(n: u32, out: &mut [u8; 18]) -> &[u8] {
    out[..8].copy_from_slice(b"attempt ");
    let mut digits = [0u8; 10];
    let mut at = digits.len();
    let mut n = n;
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    let len = 8 + digits.len() - at;
    out[8..len].copy_from_slice(&digits[at..]);
    &out[..len]
}

/// The fields of one OTLP `Span` (opentelemetry/proto/trace/v1/trace.proto).
fn put_span(span: &mut Vec<u8>, r: &Record) {
    put_bytes(span, 1, &r.trace_id);
    put_bytes(span, 2, &r.span_id);
    if r.parent != [0; 8] {
        put_bytes(span, 4, &r.parent);
    }
    let mut name = [0u8; 18];
    // Its name (5) and kind (6): SERVER (2) for the request, CLIENT (3)
    // for an attempt.
    let (name, kind) = match &r.span {
        Span::Request { method, .. } => (method.as_bytes(), 2),
        Span::Attempt { n, .. } => (attempt_name(*n, &mut name), 3),
    };
    put_bytes(span, 5, name);
    span.extend_from_slice(&[key(6, WireType::Varint), kind]);
    for (tag, time) in [(7, r.start), (8, r.end)] {
        span.push(key(tag, WireType::SixtyFourBit));
        span.extend_from_slice(&time.to_le_bytes());
    }
    let failure = put_attributes(span, &r.span);
    if let Some(message) = failure {
        // Status (15): its message (2), and code ERROR (3 = 2).
        span.push(key(15, WireType::LengthDelimited));
        varint(span, (field_len(message.len()) + 2) as u64);
        put_bytes(span, 2, message.as_bytes());
        span.extend_from_slice(&[key(3, WireType::Varint), 2]);
    }
}

/// A span's attributes (field 9 of a `Span`); the message of its error
/// status, if it failed.
fn put_attributes(span: &mut Vec<u8>, kind: &Span) -> Option<std::borrow::Cow<'static, str>> {
    match kind {
        Span::Request {
            method,
            status,
            attempts,
            skip,
            error,
        } => {
            put_text(
                span,
                SPAN_ATTRIBUTE,
                attribute!("http.request.method"),
                method,
            );
            put_int(
                span,
                attribute!("http.response.status_code"),
                u64::from(*status),
            );
            put_int(span, attribute!("herdguard.attempts"), u64::from(*attempts));
            if let Some(skip) = skip {
                put_text(
                    span,
                    SPAN_ATTRIBUTE,
                    attribute!("herdguard.skip_reason"),
                    skip,
                );
            }
            if let Some(error) = error {
                put_text(span, SPAN_ATTRIBUTE, attribute!("herdguard.error"), error);
            }
            match status {
                499 => Some("the caller left before its answer".into()),
                500.. => Some(status.to_string().into()),
                _ => None,
            }
        }
        Span::Attempt {
            n,
            backoff_ms,
            outcome,
            status,
            address,
        } => {
            put_int(span, attribute!("herdguard.attempt"), u64::from(*n));
            put_text(span, SPAN_ATTRIBUTE, attribute!("server.address"), address);
            if let Some(ms) = backoff_ms {
                put_int(span, attribute!("herdguard.backoff_ms"), u64::from(*ms));
            }
            put_text(
                span,
                SPAN_ATTRIBUTE,
                attribute!("herdguard.outcome"),
                outcome,
            );
            if *status != 0 {
                put_int(
                    span,
                    attribute!("http.response.status_code"),
                    u64::from(*status),
                );
            }
            (*outcome != "ok").then_some((*outcome).into())
        }
    }
}

/// An `ExportTraceServiceRequest` of `spans`, from `service`: each span
/// written once into a scratch buffer and copied after its length, the
/// messages around them given their lengths from what they hold.
fn encode(service: &str, spans: &[Record]) -> Vec<u8> {
    let mut all = Vec::with_capacity(spans.len() * 256);
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
    put_text(
        &mut resource,
        RESOURCE_ATTRIBUTE,
        attribute!("service.name"),
        service,
    );
    let scope_spans = field_len(scope.len()) + all.len();
    let resource_spans = field_len(resource.len()) + field_len(scope_spans);
    let mut out = Vec::with_capacity(field_len(resource_spans));
    out.push(key(1, WireType::LengthDelimited));
    varint(&mut out, resource_spans as u64);
    put_bytes(&mut out, 1, &resource);
    out.push(key(2, WireType::LengthDelimited));
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

    /// Posts `spans`; on failure, why (the spans are let go: never sent
    /// twice).
    async fn send(&self, spans: &[Record]) -> Result<(), String> {
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
            Ok(result) => result,
            Err(_) => Err(format!("no answer within {EXPORT_TIMEOUT:?}")),
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
    fn spans_are_encoded_as_otlp_decodes_them() {
        use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
        use opentelemetry_proto::tonic::common::v1::any_value::Value;
        use prost::Message as _;
        let long = "x".repeat(300);
        let records = [
            Record {
                trace_id: [1; 16],
                span_id: [2; 8],
                parent: [0; 8],
                start: 10,
                end: 20,
                span: Span::Request {
                    method: "POST",
                    status: 499,
                    attempts: 0,
                    skip: Some("budget"),
                    error: Some(long.clone().into()),
                },
            },
            Record {
                trace_id: [1; 16],
                span_id: [3; 8],
                parent: [2; 8],
                start: 11,
                end: 19,
                span: Span::Attempt {
                    n: 1234,
                    backoff_ms: Some(u32::MAX),
                    outcome: "timeout",
                    status: 0,
                    address: "10.0.0.1:8080".into(),
                },
            },
        ];
        let bytes = encode(&"s".repeat(200), &records);
        let export = ExportTraceServiceRequest::decode(&bytes[..]).expect("decodes");
        let resource = &export.resource_spans[0];
        let service = &resource.resource.as_ref().unwrap().attributes[0];
        assert_eq!(service.key, "service.name");
        let spans = &resource.scope_spans[0].spans;
        let attr = |i: usize, key: &str| {
            spans[i]
                .attributes
                .iter()
                .find(|a| a.key == key)
                .and_then(|a| a.value.as_ref()?.value.clone())
        };
        let (request, attempt) = (&spans[0], &spans[1]);
        assert_eq!((request.name.as_str(), request.kind), ("POST", 2));
        assert!(request.parent_span_id.is_empty());
        assert_eq!(
            (request.start_time_unix_nano, request.end_time_unix_nano),
            (10, 20)
        );
        assert_eq!(
            attr(0, "http.response.status_code"),
            Some(Value::IntValue(499))
        );
        assert_eq!(attr(0, "herdguard.attempts"), Some(Value::IntValue(0)));
        assert_eq!(
            attr(0, "herdguard.skip_reason"),
            Some(Value::StringValue("budget".into()))
        );
        assert_eq!(attr(0, "herdguard.error"), Some(Value::StringValue(long)));
        let status = request.status.as_ref().unwrap();
        assert_eq!(
            (status.code, status.message.as_str()),
            (2, "the caller left before its answer")
        );
        assert_eq!((attempt.name.as_str(), attempt.kind), ("attempt 1234", 3));
        assert_eq!(attempt.parent_span_id, vec![2; 8]);
        assert_eq!(attr(1, "herdguard.attempt"), Some(Value::IntValue(1234)));
        assert_eq!(
            attr(1, "herdguard.backoff_ms"),
            Some(Value::IntValue(i64::from(u32::MAX)))
        );
        assert_eq!(
            attr(1, "herdguard.outcome"),
            Some(Value::StringValue("timeout".into()))
        );
        assert_eq!(attr(1, "http.response.status_code"), None);
        assert_eq!(attempt.status.as_ref().unwrap().message, "timeout");
    }

    #[test]
    fn an_endpoint_from_the_environment_is_checked_like_the_configs() {
        let var = "OTEL_EXPORTER_OTLP_ENDPOINT";
        for (value, why) in [
            ("http://user:s3cret@127.0.0.1:4318", "credentials"),
            ("http://127.0.0.1:4318/base?token=abc", "query"),
            ("http://127.0.0.1:0", "port"),
        ] {
            let err = env_endpoint(var, value, true).unwrap_err();
            assert!(err.contains(var) && err.contains(why), "{err}");
            assert!(!err.contains("s3cret") && !err.contains("abc"), "{err}");
        }
        let ok = env_endpoint(var, " http://127.0.0.1:4318/ ", true).unwrap();
        assert_eq!(ok, "http://127.0.0.1:4318/v1/traces");
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
