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
use std::time::Duration;

use crate::upstream::UpstreamBody;
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderValue, Method, Response};

use crate::units::clock;
use crate::wire::CallerBody;
use tokio::time::Instant;

use crate::observe::access_log::Entry;
use crate::observe::trace::{AttemptTrace, RequestTrace};
use crate::policy::outlier::Verdict;
use crate::policy::paths::PathKey;
use crate::policy::retry::retry_after;
use crate::policy::{CallerFault, Outcome};
use crate::retry::{self, Attempt};

use super::body::{Progress, RequestBody, Whole, READ_WHOLE_MAX};
use super::classify::{classify, Judge, Reply, Why};
use super::outgoing::{Fields, Kept, Outgoing};
use super::replay::{BodyMemory, ReplayBody};
use super::{InFlight, Picked, Upstream};
use crate::wire::error_chain;
use crate::wire::headers::HopFields;

/// The upstream's response, with the slot it holds until its body is done.
/// An upstream's answer and the in-flight slot it holds, on the heap: an
/// attempt's end is moved a few times on its way to the caller, and one
/// pointer moves where some 300 bytes would be copied.
pub type Answer = Box<(Response<UpstreamBody>, InFlight)>;

/// An attempt ready to go: its in-flight slot, endpoint, request, and the
/// progress of its body.
type Ready<'a> = (
    Option<InFlight>,
    Picked<'a>,
    Outgoing,
    Option<Arc<Progress>>,
    Option<Box<AttemptTrace<'a>>>,
);

/// What the request path hands the upstream side: the request, as this
/// hop forwards it, and how it may be retried.
pub struct Outbound<'a> {
    pub upstream: &'a Arc<Upstream>,
    pub method: Method,
    pub path_and_query: Option<&'a PathAndQuery>,
    pub headers: HeaderMap,
    /// This hop's own fields (`Via`, `X-Forwarded-*`).
    pub hop: HopFields,
    pub body: CallerBody,
    /// More than one attempt may be made.
    pub retrying: bool,
    /// A failed attempt may be repeated once it reached the upstream
    /// (idempotent or keyed).
    pub repeatable: bool,
    /// An outer hop numbers the attempts.
    pub inner_hop: bool,
    /// The most of the body kept for a retry.
    pub max_replay_body: u64,
    /// What all requests' kept bodies may hold together.
    pub body_memory: &'a Arc<BodyMemory>,
    /// The request's `timeout`.
    pub timeout: Duration,
    /// The caller asked to upgrade.
    pub upgrade: bool,
    /// The caller's connection carries many streams (HTTP/2).
    pub multiplexed: bool,
    /// The request's path, as blame and the adaptive limit know it.
    pub path: PathKey,
}

/// A request on its way upstream: its head kept for every attempt.
pub struct Forward<'a> {
    upstream: &'a Arc<Upstream>,
    method: Method,
    path_and_query: Option<&'a PathAndQuery>,
    /// The caller's fields as this hop forwards them, and this hop's own,
    /// shared by the attempts (see [`super::outgoing`]); on the heap from
    /// the start, so that the request's future does not keep them. Taken
    /// by the first attempt when no other may follow.
    kept: Option<Arc<Kept>>,
    /// The fields an attempt sets were taken out of `kept`.
    stripped: bool,
    /// Whether more than one attempt may be made.
    retrying: bool,
    /// Whether a failed attempt may be repeated once it reached the
    /// upstream (idempotent or keyed): such requests probe ejected endpoints.
    repeatable: bool,
    /// An outer hop numbers the attempts: this one does not.
    inner_hop: bool,
    body: AttemptBody,
    /// The endpoint of the last attempt.
    endpoint: Option<usize>,
    /// The last two attempts and their endpoints: a hedge race's two.
    racing: [(u32, usize); 2],
    /// The slot `reserve` took for the next attempt.
    slot: Option<InFlight>,
    timeout: Duration,
    /// The caller asked to upgrade: only then is a 101 an answer.
    upgrade: bool,
    /// The caller's connection carries many streams: an answer's body may
    /// go unpolled there for long (no flow-control window), so it stays on
    /// hyper's connection, which the slot's watchdog can close.
    multiplexed: bool,
    /// The request's path: each attempt's latency is held against its own.
    path: PathKey,
    /// The route's `host_rewrite`: sent as `Host` instead of the endpoint's.
    host: Option<HeaderValue>,
    /// The access log line, when the log is on.
    log: Option<&'a mut Entry>,
    /// The request's span, when tracing is on: each attempt is a child.
    trace: Option<&'a RequestTrace>,
    /// The wait before the next attempt (a retry's backoff), for its span,
    /// in milliseconds (0: none).
    backoff_ms: u32,
    /// A gRPC call: judged by its `grpc-status`.
    grpc: bool,
    /// The gRPC caller's own deadline (its `grpc-timeout`): each attempt
    /// passes on the time left to it. None: no deadline is invented (the
    /// upstream would end a long stream at it).
    grpc_deadline: Option<Instant>,
}

enum AttemptBody {
    Empty,
    Replay(ReplayBody),
    /// Sent once, never retried: taken by the first attempt. `memory`:
    /// where it is held once read whole (see [`Forward::prefetch`]).
    Once {
        body: Option<CallerBody>,
        memory: Arc<BodyMemory>,
    },
    /// Sent once, read whole before the first attempt, which takes it.
    Whole(Option<Box<Whole>>),
}

impl<'a> Forward<'a> {
    pub fn new(out: Outbound<'a>) -> Self {
        let Outbound {
            upstream,
            method,
            path_and_query,
            headers,
            hop,
            body,
            retrying,
            repeatable,
            inner_hop,
            max_replay_body,
            body_memory,
            timeout,
            upgrade,
            multiplexed,
            path,
        } = out;
        use http_body::Body as _;
        let body = if body.is_end_stream() {
            AttemptBody::Empty
        } else if retrying {
            AttemptBody::Replay(ReplayBody::new(body, max_replay_body, body_memory))
        } else {
            AttemptBody::Once {
                body: Some(body),
                memory: body_memory.clone(),
            }
        };
        Self {
            upstream,
            method,
            path_and_query,
            kept: Some(Arc::new(Kept {
                map: headers,
                hop: Some(hop),
            })),
            stripped: false,
            retrying,
            repeatable: retrying && repeatable,
            inner_hop,
            body,
            endpoint: None,
            racing: [(0, 0); 2],
            slot: None,
            timeout,
            upgrade,
            multiplexed,
            path,
            host: None,
            log: None,
            trace: None,
            backoff_ms: 0,
            grpc: false,
            grpc_deadline: None,
        }
    }

    /// Treats the request as a gRPC call: a trailers-only answer is judged
    /// by its `grpc-status` and its pushback honoured; with the caller's own
    /// `deadline`, each attempt sends upstream the time left to it as
    /// `grpc-timeout` (never `per_try_timeout`, which bounds only the wait
    /// for response headers: a stream goes on long after).
    pub fn grpc(&mut self, on: bool, deadline: Option<Instant>) {
        self.grpc = on;
        self.grpc_deadline = deadline.filter(|_| on);
    }

    /// Keeps `entry` (the request's access log line) told of each attempt
    /// and its endpoint as they are made.
    pub fn log_into(&mut self, entry: Option<&'a mut Entry>) {
        self.log = entry;
    }

    /// Makes each attempt a span under `trace` (tracing on), its context
    /// sent upstream.
    pub fn trace_into(&mut self, trace: Option<&'a RequestTrace>) {
        self.trace = trace;
    }

    /// Sends `host` as every attempt's `Host`, whatever the endpoint.
    pub fn host_rewrite(&mut self, host: Option<HeaderValue>) {
        self.host = host;
    }

    /// Reads a body the caller declared small enough to keep whole before
    /// any attempt is made, as nginx buffers request bodies: then no
    /// upstream slot or breaker probe waits on the caller's upload, and
    /// every attempt's time is the upstream's alone. A body kept for a
    /// retry, when it fits `max_replay_body`, into its copy; one sent once,
    /// when it is at most [`READ_WHOLE_MAX`] and has room in the body
    /// memory, into a [`Whole`] of its own. Larger bodies, and bodies of
    /// unknown length, stream as they come.
    pub async fn prefetch(&mut self, deadline: Instant) -> Result<(), (CallerFault, String)> {
        use http_body_util::BodyExt as _;
        let read = match &mut self.body {
            AttemptBody::Replay(replay) if replay.fits() => {
                let mut reader = replay.replay();
                let read = async move {
                    while let Some(frame) = reader.frame().await {
                        frame?;
                    }
                    Ok(None)
                };
                tokio::time::timeout_at(deadline, read).await
            }
            AttemptBody::Once { body, memory } => {
                let len = body
                    .as_ref()
                    .and_then(|b| http_body::Body::size_hint(b).exact());
                let Some(held) = len
                    .filter(|&n| n <= READ_WHOLE_MAX)
                    .and_then(|n| memory.hold(n))
                else {
                    return Ok(());
                };
                let Some(body) = body.as_mut() else {
                    return Ok(());
                };
                let read = async move { Whole::read(body, held).await.map(Some) };
                tokio::time::timeout_at(deadline, read).await
            }
            _ => return Ok(()),
        };
        match read {
            Ok(Ok(whole)) => {
                if let Some(whole) = whole {
                    self.body = AttemptBody::Whole(Some(whole));
                }
                Ok(())
            }
            Ok(Err(e)) => {
                let fault = super::body::caller_fault(&*e);
                Err((
                    fault,
                    match fault {
                        CallerFault::MalformedBody => format!("the request body is malformed: {e}"),
                        _ => "the caller's request body ended before it was complete".to_owned(),
                    },
                ))
            }
            Err(_) => Err((
                CallerFault::StalledBody,
                format!(
                    "the request body stalled: it was not complete when the request's timeout ({:?}) ran out",
                    self.timeout
                ),
            )),
        }
    }

    /// Attempt `n` made ready to go: the in-flight slot `reserve` took (none:
    /// the attempt waits for one), an endpoint picked, noted for the access
    /// log, and the request. Done before the attempt goes, so that it
    /// borrows nothing of `self` and a hedge can be sent while it runs.
    fn prepare(&mut self, n: u32, probe: bool) -> Ready<'a> {
        let upstream = self.upstream;
        let slot = self.slot.take();
        let picked = upstream.pick(self.endpoint, self.repeatable, probe);
        self.endpoint = Some(picked.index);
        self.racing = [self.racing[1], (n, picked.index)];
        if let Some(log) = self.log.as_deref_mut() {
            log.attempts = n;
            log.endpoint = Some(picked.endpoint().label.clone());
        }
        let grpc_left = self
            .grpc_deadline
            .map(|d| d.saturating_duration_since(clock::now()));
        let (mut req, progress) = self.request(n, &picked.endpoint().host, grpc_left);
        let traced = self.trace.map(|trace| {
            let label = &picked.endpoint().label;
            let backoff = std::mem::take(&mut self.backoff_ms);
            let backoff = (backoff > 0).then(|| Duration::from_millis(u64::from(backoff)));
            trace.attempt(n, label, backoff, &mut req.fields.extra)
        });
        let traced = traced.flatten();
        (slot, picked, req, progress, traced)
    }

    /// The request of attempt `n`, with the progress of its body if it has one.
    fn request(
        &mut self,
        n: u32,
        host: &HeaderValue,
        grpc_left: Option<Duration>,
    ) -> (Outgoing, Option<Arc<Progress>>) {
        let (body, progress) = match &mut self.body {
            AttemptBody::Empty => (RequestBody::empty(), None),
            AttemptBody::Replay(replay) => {
                let progress = Arc::new(Progress::default());
                (
                    RequestBody::replay(replay.replay(), progress.clone()),
                    Some(progress),
                )
            }
            AttemptBody::Once { body, .. } => match body.take() {
                Some(body) => {
                    let progress = Arc::new(Progress::default());
                    (RequestBody::stream(body, progress.clone()), Some(progress))
                }
                None => (RequestBody::empty(), None),
            },
            AttemptBody::Whole(whole) => match whole.take() {
                Some(whole) => (RequestBody::whole(whole), None),
                None => (RequestBody::empty(), None),
            },
        };
        let mut extra = HeaderMap::new();
        if let Some(left) = grpc_left {
            extra.insert(
                "grpc-timeout",
                crate::wire::headers::grpc_timeout_value(left),
            );
        }
        if self.upstream.mesh_retries_off {
            // Envoy (Istio's sidecar) honours it from its own pod:
            // one layer of retries, this one.
            extra.insert(
                &crate::wire::headers::X_ENVOY_MAX_RETRIES,
                HeaderValue::from_static("0"),
            );
        }
        let fields = Fields {
            host: self.host.as_ref().unwrap_or(host).clone(),
            attempt: (!self.inner_hop).then(|| attempt_value(n)),
            extra,
            kept: self.kept(),
        };
        let method = self.method.clone();
        (
            Outgoing {
                method,
                fields,
                body,
                upgrade: self.upgrade,
            },
            progress,
        )
    }

    /// The request's fields without those an attempt sets, kept for the
    /// next attempt while one may follow.
    fn kept(&mut self) -> Arc<Kept> {
        let Some(kept) = self.kept.as_mut() else {
            return Arc::default();
        };
        if !self.stripped {
            self.stripped = true;
            // No attempt has a share of it yet: it is this one's to change.
            // The caller's `Host` stays: passed over where the fields are
            // written (see `Fields::iter`), replaced in hyper's map; a
            // removal from the map cost more than the look past it.
            if let Some(Kept { map: h, .. }) = Arc::get_mut(kept) {
                if self.grpc_deadline.is_some() {
                    h.remove("grpc-timeout");
                }
                if self.upstream.mesh_retries_off {
                    h.remove(&crate::wire::headers::X_ENVOY_MAX_RETRIES);
                }
                if let Some(trace) = self.trace {
                    trace.strip(h);
                }
            }
        }
        match self.retrying {
            true => kept.clone(),
            false => self.kept.take().unwrap_or_default(),
        }
    }
}

/// An attempt that found no slot: the upstream is at its in-flight limit.
fn overloaded(upstream: &Upstream, traced: Option<Box<AttemptTrace<'_>>>) -> Attempt<Answer> {
    let outcome = Outcome::Refused(crate::policy::Refusal::Overloaded);
    if let Some(traced) = traced {
        traced.ended(outcome.label(), None);
    }
    Attempt {
        outcome,
        answer: None,
        retry_after: None,
        detail: format!("upstream {} is at its in-flight limit", upstream.name),
        elapsed: Duration::ZERO,
        note: None,
    }
}

impl<'a> retry::Attempts for Forward<'a> {
    type Answer = Answer;

    fn reserve(&mut self, may_wait: bool) -> Result<(), String> {
        if self.slot.is_none() {
            self.slot = self.upstream.take_slot();
        }
        if self.slot.is_some() || (may_wait && self.upstream.may_wait()) {
            return Ok(());
        }
        self.slot = Some(self.upstream.try_acquire().ok_or_else(|| {
            format!(
                "upstream {} is at its in-flight limit ({})",
                self.upstream.name,
                self.upstream.limit()
            )
        })?);
        Ok(())
    }

    fn send(
        &mut self,
        n: u32,
        per_try: Duration,
        deadline: Instant,
        probe: bool,
    ) -> impl Future<Output = Attempt<Answer>> + use<'a> {
        let upstream: &'a Arc<Upstream> = self.upstream;
        let (slot, picked, req, progress, traced) = self.prepare(n, probe);
        let slot = slot_on(upstream, slot, self.path, deadline);
        let judge = Judged {
            judge: Judge {
                upgrade: self.upgrade,
                grpc: self.grpc,
                grpc_deadline: self.grpc_deadline.is_some(),
            },
            timeout: self.timeout,
        };
        let path_and_query = self.path_and_query;
        // A request that cannot be repeated, and a retry, avoid connections
        // the upstream may be closing (once it was seen to).
        let (careful, own) = (n > 1 || !self.repeatable, !self.multiplexed);
        async move {
            let mut slot = match slot {
                Ok(slot) => slot,
                Err(wait) => match wait.await {
                    Some(slot) => slot,
                    None => return overloaded(upstream, traced),
                },
            };
            let target = picked.endpoint();
            // Pinned where it is made: moved into `timed`, the request's
            // future would keep room for it twice.
            let (timed, sent_whole, sent_at) = timed(
                std::pin::pin!(target.send(path_and_query, req, careful, own)),
                progress.as_deref(),
                per_try,
                deadline,
            )
            .await;
            // One look at the clock for both: the attempt's time, and the
            // upstream's latency from when it had the whole request (a slow
            // upload is the caller's time, not the upstream's).
            let (elapsed, latency) = since(clock::now(), sent_at, sent_whole);
            let caller = |p: &Progress| {
                // An upstream that gives up on a body that stopped coming
                // (its read timeout) is right to: the stall is the caller's.
                p.caller_fault()
                    .or(p.waiting_on_caller().then_some(CallerFault::StalledBody))
            };
            let reply = match &timed {
                Timed::Done(Ok((resp, _))) => Reply::Head {
                    status: resp.status(),
                    headers: resp.headers(),
                    end_stream: http_body::Body::is_end_stream(resp.body()),
                },
                Timed::Done(Err(e)) => Reply::Failed {
                    upstream: e.fault(),
                    caller: progress.as_deref().and_then(caller),
                },
                Timed::PerTry => Reply::PerTry,
                Timed::Deadline => Reply::Deadline,
                Timed::Stalled => Reply::Stalled,
            };
            let (outcome, why) = classify(&judge.judge, &reply);
            slot.ended(outcome, latency);
            let name = &upstream.name;
            let (mut answer, detail) = match timed {
                Timed::Done(Ok((resp, conn))) if why == Why::Answered => {
                    if let Some(conn) = conn {
                        slot.hold(picked.endpoint_arc(), conn);
                    }
                    (Some(Box::new((resp, slot))), String::new())
                }
                Timed::Done(Ok((resp, _))) => (
                    None,
                    detail(why, name, &judge, per_try, Some(resp.status()), None),
                ),
                Timed::Done(Err(e)) => (None, detail(why, name, &judge, per_try, None, Some(&e))),
                _ => (None, detail(why, name, &judge, per_try, None, None)),
            };
            let note = picked.kind.note();
            // An answer whose body is still to come is the endpoint's success
            // only once the body ends whole: that is settled by the body.
            match answer.as_deref_mut() {
                Some((resp, slot))
                    if Verdict::of(outcome) == Verdict::Success
                        && !http_body::Body::is_end_stream(resp.body()) =>
                {
                    slot.answered_by(picked, latency)
                }
                _ => picked.settle(outcome, latency),
            }
            if answer.is_none() {
                tracing::debug!(upstream = %name, outcome = outcome.label(), error = %detail, "upstream attempt failed");
            }
            if let Some(traced) = traced {
                let status = answer.as_deref().map(|(resp, _)| resp.status().as_u16());
                traced.ended(outcome.label(), status);
            }
            let retry_after = answer
                .as_deref()
                .and_then(|(resp, _)| match judge.judge.grpc {
                    true => crate::wire::headers::grpc_pushback(resp.headers()),
                    false => retry_after(resp.headers()),
                });
            Attempt {
                outcome,
                answer,
                retry_after,
                detail,
                elapsed,
                note,
            }
        }
    }

    fn backing_off(&mut self, delay: Duration) {
        self.backoff_ms = u32::try_from(delay.as_millis()).unwrap_or(u32::MAX).max(1);
    }

    fn ended_with(&mut self, n: u32) {
        // After a hedge race, the log names the endpoint that answered.
        let Some(&(_, index)) = self.racing.iter().find(|(m, _)| *m == n) else {
            return;
        };
        if let Some(log) = self.log.as_deref_mut() {
            log.endpoint = Some(self.upstream.endpoint_label(index));
        }
    }

    fn hedgeable(&self) -> bool {
        // An upgrade is a connection to keep, not an answer to race for.
        !self.upgrade
    }

    fn body_whole(&self) -> bool {
        match &self.body {
            AttemptBody::Empty => true,
            AttemptBody::Once { .. } | AttemptBody::Whole(_) => false,
            AttemptBody::Replay(replay) => replay.whole(),
        }
    }

    async fn replayable(&mut self, deadline: Instant) -> bool {
        let replay = match &self.body {
            AttemptBody::Empty => return true,
            AttemptBody::Once { body, .. } => return body.is_some(),
            AttemptBody::Whole(whole) => return whole.is_some(),
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

    fn body_pending(&self, answer: &Answer) -> bool {
        !http_body::Body::is_end_stream(answer.0.body())
    }
}

/// What an attempt's messages need besides the verdict: the request's
/// `timeout`.
struct Judged {
    judge: Judge,
    timeout: Duration,
}

/// The message of an attempt that did not end with an answer to pass on.
fn detail(
    why: Why,
    name: &str,
    judged: &Judged,
    per_try: Duration,
    status: Option<http::StatusCode>,
    error: Option<&(dyn std::error::Error + 'static)>,
) -> String {
    let chain = || error.map_or_else(String::new, error_chain);
    let timeout = judged.timeout;
    match why {
        Why::Answered => String::new(),
        Why::UnaskedSwitch => format!("upstream {name} switched protocols unasked (101)"),
        Why::TransferCoding => {
            format!("upstream {name} answered with a transfer coding other than chunked")
        }
        Why::StatusOutOfRange => format!(
            "upstream {name} answered with status {}, outside 100-599",
            status.map_or(0, |s| s.as_u16())
        ),
        Why::Failed => format!("upstream {name} failed: {}", chain()),
        Why::MalformedBody => format!("the request body is malformed: {}", chain()),
        Why::UpstreamGaveUpOnBody => format!(
            "the request body stopped coming, and upstream {name} gave up on it: {}",
            chain()
        ),
        Why::CallerGone => "the caller's request body ended before it was complete".to_owned(),
        Why::PerTry => format!(
            "upstream {name} sent no response headers within {per_try:?} of the request being sent"
        ),
        Why::Deadline => {
            format!("the request's timeout ({timeout:?}) ran out before upstream {name} answered")
        }
        Why::Stalled => format!(
            "the request body stalled: it was not complete when the request's timeout ({timeout:?}) ran out"
        ),
    }
}

/// How the timers ended an attempt.
enum Timed<T> {
    Done(T),
    /// No answer within the per-try time after the request was sent.
    PerTry,
    /// The request's deadline cut the attempt short: it had less than half
    /// its per-try time (what [`Policy::min_retry_time`] asks of a retry).
    ///
    /// [`Policy::min_retry_time`]: crate::policy::Policy::min_retry_time
    Deadline,
    /// The deadline came while the body was waiting on the caller.
    Stalled,
}

/// Runs `send` under the attempt's timers: until the body is sent, only the
/// deadline; from then on, `per_try` too.
///
/// When the deadline ends an attempt, whose fault that was: the caller's,
/// if its body was still waiting on the caller (a stalled upload); the
/// upstream's (a timeout), if the attempt had at least half its per-try
/// time; otherwise the deadline's, which cut it short.
///
/// Gives back how it ended, when the body was all sent, and when it began.
async fn timed<F: Future>(
    mut send: std::pin::Pin<&mut F>,
    progress: Option<&Progress>,
    per_try: Duration,
    deadline: Instant,
) -> (Timed<F::Output>, Instant, Instant) {
    let start = clock::now();
    let fair = per_try / 2;
    let sent = match progress {
        Some(p) if !p.is_sent() => {
            tokio::select! {
                biased;
                out = &mut send => return (Timed::Done(out), start, start),
                () = p.sent() => clock::now(),
                () = tokio::time::sleep_until(deadline) => {
                    let late = if p.waiting_on_caller() {
                        Timed::Stalled
                    } else if deadline.saturating_duration_since(start) >= fair {
                        Timed::PerTry
                    } else {
                        Timed::Deadline
                    };
                    return (late, start, start);
                }
            }
        }
        _ => start,
    };
    let (until, late) = match sent.checked_add(per_try) {
        Some(end) if end < deadline => (end, Timed::PerTry),
        _ if deadline.saturating_duration_since(sent) >= fair => (deadline, Timed::PerTry),
        _ => (deadline, Timed::Deadline),
    };
    match tokio::time::timeout_at(until, send).await {
        Ok(out) => (Timed::Done(out), sent, start),
        Err(_) => (late, sent, start),
    }
}

/// The times from `sent_at` and from `sent_whole` to `ended`: one
/// subtraction when the request went whole at once, as most do.
fn since(ended: Instant, sent_at: Instant, sent_whole: Instant) -> (Duration, Duration) {
    let elapsed = ended.saturating_duration_since(sent_at);
    match sent_whole == sent_at {
        true => (elapsed, elapsed),
        false => (elapsed, ended.saturating_duration_since(sent_whole)),
    }
}

/// The attempt's slot, for its `path`: the one reserved, or else the wait
/// for one, boxed, so that only a request that waits pays for its room.
fn slot_on(
    upstream: &Arc<Upstream>,
    slot: Option<InFlight>,
    path: PathKey,
    deadline: Instant,
) -> Result<InFlight, std::pin::Pin<Box<impl Future<Output = Option<InFlight>> + '_>>> {
    match slot {
        Some(mut slot) => {
            slot.on_path(path);
            Ok(slot)
        }
        None => Err(Box::pin(upstream.wait_for_slot(deadline, path))),
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

#[cfg(test)]
mod tests {
    use super::super::body::{SENT, WAITING};
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// How `timed` ends an attempt that never answers, given the upload's
    /// state when the timers fire.
    async fn ends(progress: Option<&Progress>, per_try: Duration, left: Duration) -> &'static str {
        let deadline = Instant::now() + left;
        match timed(
            std::pin::pin!(std::future::pending::<()>()),
            progress,
            per_try,
            deadline,
        )
        .await
        .0
        {
            Timed::Done(()) => "done",
            Timed::PerTry => "per-try",
            Timed::Deadline => "deadline",
            Timed::Stalled => "stalled",
        }
    }

    #[tokio::test(start_paused = true)]
    async fn whose_fault_the_timers_make_it() {
        let per_try = 400 * MS;
        // No body: per-try time runs from the start.
        assert_eq!(ends(None, per_try, 1000 * MS).await, "per-try");
        // Cut short by the deadline, with less than half of per-try: the deadline's.
        assert_eq!(ends(None, per_try, 150 * MS).await, "deadline");
        // Half or more of it: the upstream had its fair chance.
        assert_eq!(ends(None, per_try, 250 * MS).await, "per-try");

        // A body still waiting on its caller when the deadline comes: a stall.
        let waiting = Progress::default();
        waiting.set(WAITING);
        assert_eq!(ends(Some(&waiting), per_try, 1000 * MS).await, "stalled");
        // A body the upstream does not take (not waiting on the caller).
        let pushing = Progress::default();
        assert_eq!(ends(Some(&pushing), per_try, 1000 * MS).await, "per-try");
        assert_eq!(ends(Some(&pushing), per_try, 100 * MS).await, "deadline");
    }

    #[tokio::test(start_paused = true)]
    async fn per_try_time_starts_once_the_body_is_sent() {
        let progress = Arc::new(Progress::default());
        progress.set(WAITING);
        let uploader = progress.clone();
        // The caller uploads for 900 ms; per-try time is 400 ms.
        tokio::spawn(async move {
            tokio::time::sleep(900 * MS).await;
            uploader.set(SENT);
        });
        let answer = async {
            // The upstream answers 300 ms after the upload ends.
            progress.sent().await;
            tokio::time::sleep(300 * MS).await;
        };
        let deadline = Instant::now() + 10_000 * MS;
        let (got, sent, _) =
            timed(std::pin::pin!(answer), Some(&progress), 400 * MS, deadline).await;
        assert_eq!(
            sent.elapsed(),
            300 * MS,
            "the upstream's time is from the upload's end"
        );
        assert!(matches!(got, Timed::Done(())), "not a timeout");
    }
}
