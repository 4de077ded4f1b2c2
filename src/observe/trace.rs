//! Traces with OpenTelemetry: a span per request and a child span per
//! attempt, exported in batches over OTLP/HTTP (protobuf) to a collector.
//!
//! A request joins its caller's trace (W3C `traceparent`/`tracestate`) or
//! starts one; each attempt sends upstream its own span id, so that the
//! upstream's spans hang under the attempt that reached it. Spans go
//! through the SDK's batch processor: a queue of at most
//! [`MAX_QUEUED_SPANS`] (dropped past it, never waited for) and an export
//! thread of its own, so a slow collector never slows a request. Off (no
//! endpoint), nothing is made per request.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response};
use opentelemetry::propagation::TextMapPropagator as _;
use opentelemetry::trace::{
    Span as _, SpanKind, Status, TraceContextExt as _, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_http::{HeaderExtractor, HeaderInjector, HttpError};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracer, SdkTracerProvider,
};

use crate::config::TracingConfig;

/// Spans waiting for export; past this, new spans are dropped.
pub const MAX_QUEUED_SPANS: usize = 2048;

/// How long finished spans wait before they are sent in a batch.
const BATCH_DELAY: Duration = Duration::from_millis(500);

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
    provider: SdkTracerProvider,
    tracer: SdkTracer,
    propagator: TraceContextPropagator,
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
        use opentelemetry_otlp::{WithExportConfig as _, WithHttpConfig as _};
        let client = Exporter::new().map_err(|e| format!("tracing: {e}"))?;
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
            .with_endpoint(endpoint.clone())
            .with_timeout(EXPORT_TIMEOUT)
            .with_http_client(client)
            .build()
            .map_err(|e| format!("tracing.otlp_endpoint {endpoint:?}: {e}"))?;
        let batches = BatchConfigBuilder::default()
            .with_max_queue_size(MAX_QUEUED_SPANS)
            .with_max_export_batch_size(512)
            .with_scheduled_delay(BATCH_DELAY)
            .build();
        let processor = BatchSpanProcessor::builder(exporter)
            .with_batch_config(batches)
            .build();
        let service = std::env::var("OTEL_SERVICE_NAME")
            .ok()
            .filter(|_| config.service_name.is_empty())
            .unwrap_or_else(|| match config.service_name.is_empty() {
                true => "herdguard".to_owned(),
                false => config.service_name.clone(),
            });
        let resource = opentelemetry_sdk::Resource::builder()
            .with_service_name(service)
            .build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                config.sample_ratio,
            ))))
            .with_resource(resource)
            .build();
        let tracer = provider.tracer("herdguard");
        tracing::info!(
            endpoint,
            sample_ratio = config.sample_ratio,
            "tracing: spans exported over OTLP/HTTP"
        );
        Ok(Some(Arc::new(Tracing {
            provider,
            tracer,
            propagator: TraceContextPropagator::new(),
        })))
    }

    /// The span of a request with these `headers`: a child of the caller's
    /// span if it sent a `traceparent`, else the root of a new trace.
    pub fn request(
        self: &Arc<Self>,
        method: &http::Method,
        headers: &HeaderMap,
    ) -> Box<RequestTrace> {
        // A tracestate longer than W3C asks vendors to pass on (512) is
        // dropped: a caller's 16 KB of it would be copied into every span.
        let parent = match headers
            .get("tracestate")
            .is_some_and(|v| v.len() > MAX_TRACESTATE)
        {
            false => self.propagator.extract(&HeaderExtractor(headers)),
            true => {
                let mut trimmed = HeaderMap::new();
                if let Some(parent) = headers.get("traceparent") {
                    trimmed.insert("traceparent", parent.clone());
                }
                self.propagator.extract(&HeaderExtractor(&trimmed))
            }
        };
        // A method no one registered is `_OTHER`, as OpenTelemetry's
        // conventions say: a caller's 60 KB method would be in every span.
        let method = known_method(method);
        let span = self
            .tracer
            .span_builder(method)
            .with_kind(SpanKind::Server)
            .with_attributes([KeyValue::new("http.request.method", method)])
            .start_with_context(&self.tracer, &parent);
        Box::new(RequestTrace {
            answered: std::sync::atomic::AtomicBool::new(false),
            cx: parent.with_span(span),
            tracing: self.clone(),
            skip: OnceLock::new(),
        })
    }

    /// Sends every span finished so far, waiting up to a few seconds: at exit.
    pub fn shutdown(&self) {
        if let Err(e) = self.provider.shutdown() {
            tracing::debug!(error = %e, "tracing: spans could not all be sent at exit");
        }
    }
}

/// A request's span, ended when this is dropped (once its response has
/// gone, whole or not).
pub struct RequestTrace {
    cx: Context,
    /// Told how the request was answered: else its caller left first.
    answered: std::sync::atomic::AtomicBool,
    /// The tracer that made it, for its attempts' spans.
    tracing: Arc<Tracing>,
    /// Why a retry was not made, when one was not.
    skip: OnceLock<&'static str>,
}

impl RequestTrace {
    /// The trace's id.
    pub fn trace_id(&self) -> u128 {
        u128::from_be_bytes(self.cx.span().span_context().trace_id().to_bytes())
    }

    /// Starts attempt `n`'s span, to `endpoint`, and puts its context in
    /// `headers` (`traceparent`, `tracestate`): the upstream's spans are
    /// its children.
    pub fn attempt(
        &self,
        n: u32,
        endpoint: &str,
        backoff: Option<Duration>,
        headers: &mut HeaderMap,
    ) -> Box<AttemptTrace> {
        let tracing = &self.tracing;
        let mut attributes = vec![
            KeyValue::new("herdguard.attempt", i64::from(n)),
            KeyValue::new("server.address", endpoint.to_owned()),
        ];
        if let Some(backoff) = backoff {
            attributes.push(KeyValue::new(
                "herdguard.backoff_ms",
                i64::try_from(backoff.as_millis()).unwrap_or(i64::MAX),
            ));
        }
        let span = tracing
            .tracer
            .span_builder(format!("attempt {n}"))
            .with_kind(SpanKind::Client)
            .with_attributes(attributes)
            .start_with_context(&tracing.tracer, &self.cx);
        let cx = Context::new().with_remote_span_context(span.span_context().clone());
        tracing
            .propagator
            .inject_context(&cx, &mut HeaderInjector(headers));
        Box::new(AttemptTrace { span, ended: false })
    }

    /// Notes why a retry was not made.
    pub fn skipped(&self, reason: &'static str) {
        let _ = self.skip.set(reason);
    }

    /// Notes how the request was answered: its status, the attempts sent,
    /// and the proxy's own error, if it made the answer.
    pub fn answered(&self, status: u16, attempts: Option<u32>, error: Option<&str>) {
        self.answered
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let span = self.cx.span();
        span.set_attribute(KeyValue::new(
            "http.response.status_code",
            i64::from(status),
        ));
        if let Some(attempts) = attempts {
            span.set_attribute(KeyValue::new("herdguard.attempts", i64::from(attempts)));
        }
        if let Some(reason) = self.skip.get() {
            span.set_attribute(KeyValue::new("herdguard.skip_reason", *reason));
        }
        if let Some(error) = error {
            span.set_attribute(KeyValue::new("herdguard.error", error.to_owned()));
        }
        if status >= 500 {
            span.set_status(Status::error(format!("{status}")));
        }
    }
}

impl Drop for RequestTrace {
    fn drop(&mut self) {
        if !self.answered.load(std::sync::atomic::Ordering::Relaxed) {
            // The caller left before its answer: 499, as the access log has it.
            let span = self.cx.span();
            span.set_attribute(KeyValue::new("http.response.status_code", 499));
            span.set_status(Status::error("the caller left before its answer"));
        }
        self.cx.span().end();
    }
}

/// One attempt's span, ended with its outcome.
pub struct AttemptTrace {
    span: opentelemetry_sdk::trace::Span,
    ended: bool,
}

impl Drop for AttemptTrace {
    fn drop(&mut self) {
        if !self.ended {
            // Dropped before it ended: a hedge race's loser, or its caller left.
            self.span
                .set_attribute(KeyValue::new("herdguard.outcome", "cancelled"));
            self.span.end();
        }
    }
}

impl AttemptTrace {
    /// Ends the span: how the attempt ended (an outcome of
    /// `herdguard_upstream_attempts_total`), and the status it answered.
    pub fn ended(mut self, outcome: &'static str, status: Option<u16>) {
        self.span
            .set_attribute(KeyValue::new("herdguard.outcome", outcome));
        if let Some(status) = status {
            self.span.set_attribute(KeyValue::new(
                "http.response.status_code",
                i64::from(status),
            ));
        }
        if outcome != "ok" {
            self.span.set_status(Status::error(outcome));
        }
        self.ended = true;
        self.span.end();
    }
}

/// The OTLP exporter's HTTP client: hyper, run on the proxy's runtime
/// (the SDK exports from a thread of its own and waits on the answer).
#[derive(Debug, Clone)]
struct Exporter {
    client: hyper_util::client::legacy::Client<
        hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
        http_body_util::Full<Bytes>,
    >,
    runtime: tokio::runtime::Handle,
}

impl Exporter {
    fn new() -> Result<Self, String> {
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
        Ok(Self { client, runtime })
    }
}

/// The most of a collector's answer read.
const MAX_ANSWER: usize = 64 * 1024;

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for Exporter {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let client = self.client.clone();
        let sent = self.runtime.spawn(async move {
            let (parts, body) = request.into_parts();
            let request = Request::from_parts(parts, http_body_util::Full::new(body));
            let response = tokio::time::timeout(EXPORT_TIMEOUT, client.request(request)).await??;
            let (parts, body) = response.into_parts();
            let limited = http_body_util::Limited::new(body, MAX_ANSWER);
            let body = http_body_util::BodyExt::collect(limited).await?.to_bytes();
            Ok::<_, HttpError>(Response::from_parts(parts, body))
        });
        sent.await?
    }
}
