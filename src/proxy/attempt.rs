//! One attempt over the wire: the proxy's side of [`retry::Attempts`].
//!
//! It takes the in-flight slot, picks the endpoint, builds the request from
//! the kept head and a replay of the body, and times the attempt: per-try
//! time starts once the request is sent whole (as Envoy starts its timers
//! once the downstream request is complete), so a slow uploader is never an
//! upstream timeout; the request's `timeout` bounds it all. Then it tells
//! whose fault a failure was — the caller's body, the deadline or the
//! upstream — and feeds the adaptive limit.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use http::uri::PathAndQuery;
use http::{HeaderMap, Method, Request, Response, Version};
use hyper::body::Incoming;
use tokio::time::Instant;

use crate::policy::retry::retry_after;
use crate::policy::{CallerFault, Outcome, UpstreamFault};
use crate::retry::{self, Attempt};

use super::body::{Progress, RequestBody};
use super::error_chain;
use super::headers::X_HERDGUARD_ATTEMPT;
use super::replay::ReplayBody;
use super::upstream::{InFlight, Upstream};

/// The upstream's response, with the slot it holds until its body is done.
pub type Answer = (Response<Incoming>, InFlight);

/// A request on its way upstream: its head kept for every attempt.
pub struct Forward<'a> {
    upstream: &'a Arc<Upstream>,
    method: Method,
    path_and_query: Option<PathAndQuery>,
    /// Taken whole by the last attempt; copied for the others.
    headers: Option<HeaderMap>,
    /// Whether more than one attempt may be made.
    retrying: bool,
    /// An outer hop numbers the attempts: this one does not.
    inner_hop: bool,
    body: AttemptBody,
    /// The endpoint of the last attempt.
    endpoint: Option<usize>,
    /// The slot `reserve` took for the next attempt.
    slot: Option<InFlight>,
    timeout: Duration,
}

enum AttemptBody {
    Empty,
    Replay(ReplayBody),
    /// Sent once, never retried: taken by the first attempt.
    Once(Option<Incoming>),
}

impl<'a> Forward<'a> {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        upstream: &'a Arc<Upstream>,
        method: Method,
        path_and_query: Option<PathAndQuery>,
        headers: HeaderMap,
        body: Incoming,
        retrying: bool,
        inner_hop: bool,
        max_replay_body: u64,
        timeout: Duration,
    ) -> Self {
        use http_body::Body as _;
        let body = if body.is_end_stream() {
            AttemptBody::Empty
        } else if retrying {
            AttemptBody::Replay(ReplayBody::new(body, max_replay_body))
        } else {
            AttemptBody::Once(Some(body))
        };
        Self {
            upstream,
            method,
            path_and_query,
            headers: Some(headers),
            retrying,
            inner_hop,
            body,
            endpoint: None,
            slot: None,
            timeout,
        }
    }

    /// The request of attempt `n`, with the progress of its body if it has one.
    fn request(
        &mut self,
        n: u32,
        host: &http::HeaderValue,
    ) -> (Request<RequestBody>, Option<Arc<Progress>>) {
        let (body, progress) = match &mut self.body {
            AttemptBody::Empty => (RequestBody::empty(), None),
            AttemptBody::Replay(replay) => {
                let progress = Arc::new(Progress::default());
                (
                    RequestBody::replay(replay.replay(), progress.clone()),
                    Some(progress),
                )
            }
            AttemptBody::Once(once) => match once.take() {
                Some(body) => {
                    let progress = Arc::new(Progress::default());
                    (RequestBody::stream(body, progress.clone()), Some(progress))
                }
                None => (RequestBody::empty(), None),
            },
        };
        let mut req = Request::new(body);
        *req.method_mut() = self.method.clone();
        *req.version_mut() = Version::HTTP_11;
        // Set on the kept headers before they are copied: a copy has no
        // room to spare, and adding a field to it would reallocate.
        let mut headers = match self.headers.take() {
            Some(mut h) => {
                h.insert(http::header::HOST, host.clone());
                if !self.inner_hop {
                    h.insert(&X_HERDGUARD_ATTEMPT, attempt_value(n));
                }
                if self.retrying {
                    let copy = h.clone();
                    self.headers = Some(h);
                    copy
                } else {
                    h
                }
            }
            None => HeaderMap::new(),
        };
        std::mem::swap(req.headers_mut(), &mut headers);
        (req, progress)
    }
}

impl retry::Attempts for Forward<'_> {
    type Answer = Answer;

    fn reserve(&mut self) -> Result<(), String> {
        if self.slot.is_none() {
            self.slot = Some(self.upstream.try_acquire().ok_or_else(|| {
                format!(
                    "upstream {} is at its in-flight limit ({})",
                    self.upstream.name,
                    self.upstream.limit()
                )
            })?);
        }
        Ok(())
    }

    async fn send(&mut self, n: u32, per_try: Duration, deadline: Instant) -> Attempt<Answer> {
        let upstream = self.upstream;
        let slot = match self.slot.take() {
            Some(slot) => Some(slot),
            None => upstream.try_acquire(),
        };
        let Some(mut slot) = slot else {
            return Attempt {
                outcome: Outcome::Refused(crate::policy::Refusal::Overloaded),
                answer: None,
                retry_after: None,
                detail: format!("upstream {} is at its in-flight limit", upstream.name),
                elapsed: Duration::ZERO,
            };
        };
        let (index, target) = upstream.pick_after(self.endpoint);
        self.endpoint = Some(index);
        let (req, progress) = self.request(n, &target.host);

        let sent_at = Instant::now();
        // Should the caller go away mid-attempt, this future is dropped
        // and the watch tells the limiter: never as a drop.
        let watch = Watch {
            upstream,
            progress: progress.as_deref(),
            sent_at,
        };
        let timed = timed(
            target.send(self.path_and_query.as_ref(), req),
            progress.as_deref(),
            per_try,
            deadline,
        )
        .await;
        std::mem::forget(watch);
        let elapsed = sent_at.elapsed();
        let uploaded = progress.as_deref().is_none_or(Progress::is_sent);
        let name = &upstream.name;
        let (outcome, answer, detail) = match timed {
                Timed::Done(Ok((resp, conn))) => {
                    if let Some(conn) = conn {
                        slot.hold(index, conn);
                    }
                    (Outcome::Response(resp.status()), Some((resp, slot)), String::new())
                }
                Timed::Done(Err(e)) => {
                    let fault = progress.as_deref().and_then(Progress::caller_fault);
                    let outcome = match fault {
                        Some(fault) => Outcome::Caller(fault),
                        None => Outcome::Upstream(e.fault()),
                    };
                    let detail = match fault {
                        Some(CallerFault::MalformedBody) => {
                            format!("the request body is malformed: {}", error_chain(&e))
                        }
                        Some(_) => "the caller's request body ended before it was complete".to_owned(),
                        None => format!("upstream {name} failed: {}", error_chain(&e)),
                    };
                    (outcome, None, detail)
                }
                Timed::PerTry => (
                    Outcome::Upstream(UpstreamFault::Timeout),
                    None,
                    format!("upstream {name} sent no response headers within {per_try:?} of the request being sent"),
                ),
                Timed::Deadline => (
                    Outcome::Deadline,
                    None,
                    format!("the request's timeout ({:?}) ran out before upstream {name} answered", self.timeout),
                ),
                Timed::Stalled => (
                    Outcome::Caller(CallerFault::StalledBody),
                    None,
                    format!("the request body stalled: it was not complete when the request's timeout ({:?}) ran out", self.timeout),
                ),
            };
        upstream.observe(outcome, elapsed, uploaded);
        if answer.is_none() {
            tracing::debug!(upstream = %name, outcome = outcome.label(), error = %detail, "upstream attempt failed");
        }
        let retry_after = answer
            .as_ref()
            .and_then(|(resp, _)| retry_after(resp.headers(), SystemTime::now()));
        Attempt {
            outcome,
            answer,
            retry_after,
            detail,
            elapsed,
        }
    }

    async fn replayable(&mut self, deadline: Instant) -> bool {
        let replay = match &self.body {
            AttemptBody::Empty => return true,
            AttemptBody::Once(once) => return once.is_some(),
            AttemptBody::Replay(replay) => replay,
        };
        loop {
            if let Some(known) = replay.replayable() {
                return known;
            }
            // An earlier attempt's connection still holds the body: wait
            // for it to let go, but not past the deadline.
            let released = std::future::poll_fn(|cx| replay.poll_released(cx));
            if tokio::time::timeout_at(deadline, released).await.is_err() {
                return false;
            }
        }
    }

    fn park(&self, answer: &mut Answer) {
        answer.1.park();
    }
}

/// Held while an attempt is on the wire; dropped (not forgotten) only when
/// the caller went away mid-attempt.
struct Watch<'a> {
    upstream: &'a Upstream,
    progress: Option<&'a Progress>,
    sent_at: Instant,
}

impl Drop for Watch<'_> {
    fn drop(&mut self) {
        let uploaded = self.progress.is_none_or(Progress::is_sent);
        self.upstream.observe(
            Outcome::Caller(CallerFault::Gone),
            self.sent_at.elapsed(),
            uploaded,
        );
    }
}

/// How the timers ended an attempt.
enum Timed<T> {
    Done(T),
    /// No answer within the per-try time after the request was sent.
    PerTry,
    /// The request's deadline came first.
    Deadline,
    /// The deadline came while the body was waiting on the caller.
    Stalled,
}

/// Runs `send` under the attempt's timers: until the body is sent, only the
/// deadline; from then on, `per_try` too.
async fn timed<F: Future>(
    send: F,
    progress: Option<&Progress>,
    per_try: Duration,
    deadline: Instant,
) -> Timed<F::Output> {
    tokio::pin!(send);
    let sent = match progress {
        Some(p) if !p.is_sent() => {
            tokio::select! {
                biased;
                out = &mut send => return Timed::Done(out),
                () = p.sent() => Instant::now(),
                () = tokio::time::sleep_until(deadline) => {
                    return if p.waiting_on_caller() { Timed::Stalled } else { Timed::Deadline };
                }
            }
        }
        _ => Instant::now(),
    };
    let (until, late) = match sent.checked_add(per_try) {
        Some(end) if end < deadline => (end, Timed::PerTry),
        _ => (deadline, Timed::Deadline),
    };
    match tokio::time::timeout_at(until, send).await {
        Ok(out) => Timed::Done(out),
        Err(_) => late,
    }
}

/// `x-herdguard-attempt: N`, without formatting for the usual small N.
pub(crate) fn attempt_value(n: u32) -> http::HeaderValue {
    const SMALL: [&str; 10] = ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"];
    match SMALL.get(n as usize) {
        Some(s) => http::HeaderValue::from_static(s),
        None => http::HeaderValue::from(n),
    }
}
