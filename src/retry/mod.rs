//! Retries: the one async loop that sleeps and resends.
//!
//! Every decision it acts on is made elsewhere, by plain functions:
//! [`policy`] says whether an outcome may be retried, [`backoff`] how long to
//! wait, [`budget`] whether the route can afford it. This loop only measures
//! time, sends attempts, and counts and logs what it did and did not do.

pub mod backoff;
pub mod budget;
pub mod policy;

use std::time::{Duration, SystemTime};

use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderValue, Method, Request, Response, Version};
use http_body::Body as _;
use hyper::body::Incoming;
use rand::Rng;
use tokio::time::Instant;
use tracing::debug;

pub use backoff::{Backoff, BackoffState};
pub use budget::Budget;
pub use policy::{Failure, Policy, RequestFacts, SkipReason, Verdict};

use crate::breaker::{Admit, Outcome as BreakerOutcome};
use crate::limit::Sample;
use crate::metrics::Outcome;
use crate::proxy::headers::X_HERDGUARD_ATTEMPT;
use crate::proxy::{
    error_chain, InFlight, LocalError, Pooled, ReplayBody, RequestBody, Route, SendError,
};

/// A request ready to go upstream, headers already rewritten for the hop.
pub struct Outgoing {
    pub method: Method,
    pub path_and_query: Option<PathAndQuery>,
    pub headers: HeaderMap,
    pub body: Incoming,
    pub facts: RequestFacts,
    /// Keep a trace of the attempts for `x-herdguard-explain`.
    pub explain: bool,
}

/// The proxy's own answer when it does not pass an upstream response on.
#[derive(Debug)]
pub struct Refusal {
    pub error: LocalError,
    pub detail: String,
    /// When the caller may come back (circuit open, shed).
    pub retry_after: Option<Duration>,
}

/// The response to pass on with the upstream slot it holds, or the proxy's own answer.
pub type Answer = Result<(Response<Incoming>, InFlight), Refusal>;

/// How the request ended.
pub struct Sent {
    pub attempts: u32,
    pub result: Answer,
    /// `1=503@12ms;backoff=40ms;2=200@9ms`, when asked for.
    pub trace: Option<String>,
}

/// Sends `out` to the route's upstream, retrying as the route's policy allows.
/// Every attempt asks the breaker, takes an in-flight slot under the
/// upstream's limits, and is counted, whether it is a first try, a retry or a probe.
pub async fn send(route: &Route, out: Outgoing, start: Instant) -> Sent {
    let policy = &route.policy;
    let upstream = &route.upstream;
    let facts = out.facts;
    let deadline = start + policy.timeout;

    let retrying = policy.may_retry(&facts);
    let mut body = if out.body.is_end_stream() {
        AttemptBody::Empty
    } else if retrying {
        AttemptBody::Replay(ReplayBody::new(out.body, policy.max_replay_body))
    } else {
        AttemptBody::Once(Some(out.body))
    };
    // Without retries the headers are moved into the one attempt, not copied.
    let mut headers = Some(out.headers);
    let mut backoff = BackoffState::default();
    let mut endpoint = None;
    let mut attempt = 0u32;
    let mut trace = out.explain.then(String::new);

    loop {
        attempt += 1;
        let probe = match route.admit() {
            Admit::Yes { probe } => probe,
            Admit::No { retry_after } => {
                if attempt > 1 {
                    skip(route, attempt - 1, SkipReason::BreakerOpen);
                }
                let detail = format!("the circuit breaker of route {} is open", route.name);
                note(&mut trace, format_args!("{attempt}=circuit-open"));
                return done(
                    attempt - 1,
                    Err(refusal(LocalError::CircuitOpen, detail, Some(retry_after))),
                    trace,
                );
            }
        };
        let Some(slot) = upstream.try_acquire() else {
            route.record(probe, BreakerOutcome::Unknown);
            if attempt > 1 {
                skip(route, attempt - 1, SkipReason::Overloaded);
            }
            let detail = format!(
                "upstream {} is at its in-flight limit ({})",
                upstream.name,
                upstream.limit()
            );
            note(&mut trace, format_args!("{attempt}=overloaded"));
            return done(
                attempt - 1,
                Err(refusal(LocalError::Overloaded, detail, None)),
                trace,
            );
        };
        // A request earns its share of retries when it is sent: one the
        // breaker or the limits refused never reached the upstream, and must
        // not make room for more retries against it.
        if attempt == 1 {
            route.budget.deposit(start);
        }
        let (index, target) = upstream.pick_after(endpoint);
        endpoint = Some(index);

        let mut req = Request::new(match &mut body {
            AttemptBody::Empty => RequestBody::Empty,
            AttemptBody::Replay(replay) => RequestBody::Replay {
                body: Box::pin(replay.replay()),
            },
            AttemptBody::Once(once) => once
                .take()
                .map_or(RequestBody::Empty, |body| RequestBody::Stream { body }),
        });
        *req.method_mut() = out.method.clone();
        *req.version_mut() = Version::HTTP_11;
        // Set on the kept headers before they are copied: a copy has no
        // room to spare, and adding a field to it would reallocate.
        let h = headers.as_mut().expect("kept until the last attempt");
        h.insert(http::header::HOST, target.host.clone());
        if !facts.inner_hop {
            h.insert(&X_HERDGUARD_ATTEMPT, attempt_value(attempt));
        }
        *req.headers_mut() = if retrying {
            h.clone()
        } else {
            headers.take().expect("one attempt")
        };

        let sent_at = Instant::now();
        let per_try = policy
            .per_try_timeout
            .min(deadline.saturating_duration_since(sent_at));
        // A timed-out attempt is dropped here, which closes its connection:
        // the upstream is not left working on a request nobody waits for.
        // Should the caller go away first, the whole loop is dropped, and the
        // guard still tells the breaker and the limiter.
        let guard = Unanswered {
            route,
            probe,
            sent_at,
            patience: (per_try / 2).min(Duration::from_millis(500)),
        };
        let sent =
            tokio::time::timeout(per_try, target.send(out.path_and_query.as_ref(), req)).await;
        std::mem::forget(guard);
        let elapsed = sent_at.elapsed();
        let (failure, outcome, result) = classify(route, sent, (index, slot), per_try);
        route.metrics.attempt(outcome);
        if trace.is_some() {
            let ms = elapsed.as_millis();
            match &result {
                Ok((resp, _)) => note(
                    &mut trace,
                    format_args!("{attempt}={}@{ms}ms", resp.status().as_u16()),
                ),
                Err(_) => note(
                    &mut trace,
                    format_args!("{attempt}={}@{ms}ms", outcome.as_str()),
                ),
            }
        }
        route.record(probe, breaker_outcome(outcome));
        match outcome {
            Outcome::Timeout => upstream.observe(Sample::Dropped),
            Outcome::Ok | Outcome::ServerError => upstream.observe(Sample::Latency(elapsed)),
            Outcome::ConnectFailure | Outcome::Reset | Outcome::Cancelled => {}
        }

        let replayable = match &body {
            AttemptBody::Replay(replay) => replay.is_replayable(),
            AttemptBody::Empty => true,
            AttemptBody::Once(_) => false,
        };
        let cause = match policy.verdict(failure, attempt, &facts, replayable) {
            Verdict::Done => return done(attempt, result, trace),
            Verdict::Skip(_, reason) => {
                skip(route, attempt, reason);
                note(&mut trace, format_args!("skip={}", reason.as_str()));
                return done(attempt, result, trace);
            }
            Verdict::Retry(cause) => cause,
        };

        let server_delay = match &result {
            Ok((resp, _)) => policy.retry_after(resp.headers(), SystemTime::now()),
            Err(_) => Ok(None),
        };
        let delay = match server_delay {
            Err(reason) => {
                skip(route, attempt, reason);
                note(&mut trace, format_args!("skip={}", reason.as_str()));
                return done(attempt, result, trace);
            }
            // The server's delay, plus up to a tenth more so that callers told
            // the same Retry-After do not all come back at once.
            Ok(Some(d)) => d + rand::rng().random_range(Duration::ZERO..=d / 10),
            Ok(None) => policy.backoff.next_delay(&mut backoff, &mut rand::rng()),
        };
        let now = Instant::now();
        if now + delay >= deadline {
            skip(route, attempt, SkipReason::Deadline);
            note(
                &mut trace,
                format_args!("skip={}", SkipReason::Deadline.as_str()),
            );
            return done(attempt, result, trace);
        }
        if route.breaker_open() {
            skip(route, attempt, SkipReason::BreakerOpen);
            note(
                &mut trace,
                format_args!("skip={}", SkipReason::BreakerOpen.as_str()),
            );
            return done(attempt, result, trace);
        }
        if !route.budget.withdraw(now) {
            skip(route, attempt, SkipReason::Budget);
            note(
                &mut trace,
                format_args!("skip={}", SkipReason::Budget.as_str()),
            );
            return done(attempt, result, trace);
        }
        route.metrics.retry(cause, delay);
        debug!(
            route = %route.name,
            retry.attempt = attempt + 1,
            delay_ms = delay.as_millis() as u64,
            cause = cause.label(),
            "retrying"
        );
        // Let go of the failed attempt (and its connection) before waiting.
        drop(result);
        note(&mut trace, format_args!("backoff={}ms", delay.as_millis()));
        tokio::time::sleep(delay).await;
    }
}

/// Held while an attempt waits for its answer. Dropped only when the caller
/// went away mid-attempt. A caller that waited long (half the per-try
/// timeout, at most 500 ms) and gave up is a caller the upstream was too
/// slow for: the breaker counts a failure and the limiter a drop. A quick
/// hang-up counts for nothing, but still frees a probe slot.
struct Unanswered<'a> {
    route: &'a Route,
    probe: bool,
    sent_at: Instant,
    patience: Duration,
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        let slow = self.sent_at.elapsed() >= self.patience;
        let outcome = if slow {
            BreakerOutcome::Failure
        } else {
            BreakerOutcome::Unknown
        };
        self.route.record(self.probe, outcome);
        if slow {
            self.route.upstream.observe(Sample::Dropped);
        }
        self.route.metrics.attempt(Outcome::Cancelled);
    }
}

fn done(attempts: u32, result: Answer, trace: Option<String>) -> Sent {
    Sent {
        attempts,
        result,
        trace,
    }
}

/// Appends one step to the explain trace, if one is kept.
fn note(trace: &mut Option<String>, step: std::fmt::Arguments<'_>) {
    use std::fmt::Write as _;
    if let Some(t) = trace {
        if !t.is_empty() {
            t.push(';');
        }
        let _ = t.write_fmt(step);
    }
}

fn refusal(error: LocalError, detail: String, retry_after: Option<Duration>) -> Refusal {
    Refusal {
        error,
        detail,
        retry_after,
    }
}

/// What the breaker counts: 4xx are answers, not the upstream failing.
fn breaker_outcome(outcome: Outcome) -> BreakerOutcome {
    match outcome {
        Outcome::Ok => BreakerOutcome::Success,
        Outcome::Cancelled => BreakerOutcome::Unknown,
        Outcome::ServerError | Outcome::ConnectFailure | Outcome::Reset | Outcome::Timeout => {
            BreakerOutcome::Failure
        }
    }
}

enum AttemptBody {
    Empty,
    Replay(ReplayBody),
    /// Sent once, never retried: taken by the first attempt.
    Once(Option<Incoming>),
}

fn skip(route: &Route, attempt: u32, reason: SkipReason) {
    route.metrics.skipped(reason);
    debug!(route = %route.name, attempt, reason = reason.as_str(), "retry skipped");
}

type Attempted =
    Result<Result<(Response<Incoming>, Option<Pooled>), SendError>, tokio::time::error::Elapsed>;

/// What an attempt's outcome means: the failure (if `retry_on` could name
/// it), the metric outcome, and what to pass on if no retry follows.
fn classify(
    route: &Route,
    sent: Attempted,
    (endpoint, mut slot): (usize, InFlight),
    per_try: std::time::Duration,
) -> (Option<Failure>, Outcome, Answer) {
    let upstream = &route.upstream.name;
    match sent {
        Ok(Ok((resp, conn))) => {
            if let Some(conn) = conn {
                slot.hold(endpoint, conn);
            }
            let failure = route.policy.status_failure(resp.status());
            let outcome = if resp.status().is_server_error() {
                Outcome::ServerError
            } else {
                Outcome::Ok
            };
            (failure, outcome, Ok((resp, slot)))
        }
        Err(_) => (
            Some(Failure::Timeout),
            Outcome::Timeout,
            Err(refusal(
                LocalError::Timeout,
                format!("upstream {upstream} sent no response headers within {per_try:?}"),
                None,
            )),
        ),
        Ok(Err(e)) => {
            let failure = client_failure(&e);
            let (outcome, local) = match failure {
                Failure::ConnectFailure => (Outcome::ConnectFailure, LocalError::ConnectFailure),
                _ => (Outcome::Reset, LocalError::Reset),
            };
            let detail = format!("upstream {upstream} failed: {}", error_chain(&e));
            debug!(route = %route.name, upstream = %upstream, error = %detail, "upstream attempt failed");
            (Some(failure), outcome, Err(refusal(local, detail, None)))
        }
    }
}

/// Sorts a client error into what retrying needs to know.
fn client_failure(e: &SendError) -> Failure {
    if e.is_connect() {
        return Failure::ConnectFailure;
    }
    let mut source: Option<&(dyn std::error::Error + 'static)> = match e {
        SendError::Pool(e) => Some(e),
        SendError::Client(e) => Some(e),
    };
    while let Some(s) = source {
        if let Some(h) = s.downcast_ref::<hyper::Error>() {
            // The request was never written: its pooled connection closed first.
            if h.is_canceled() {
                return Failure::ConnectFailure;
            }
        }
        if let Some(h2) = s.downcast_ref::<h2::Error>() {
            if h2.reason() == Some(h2::Reason::REFUSED_STREAM) {
                return Failure::RefusedStream;
            }
        }
        source = s.source();
    }
    Failure::Reset
}

/// `x-herdguard-attempt: N`, without formatting for the usual small N.
pub(crate) fn attempt_value(n: u32) -> HeaderValue {
    const SMALL: [&str; 10] = ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"];
    match SMALL.get(n as usize) {
        Some(s) => HeaderValue::from_static(s),
        None => HeaderValue::from(n),
    }
}
