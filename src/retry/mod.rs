//! Retries: the one async loop that sleeps and resends.
//!
//! Every decision it acts on is made in `policy/`: [`decide()`] says whether
//! another attempt follows and after how long, the breaker whether an
//! attempt may go at all, the outcome model whose fault a failure was. This
//! loop only asks, waits, sends through an [`Attempts`], and counts and logs
//! what it did and did not do. It knows nothing of hyper or sockets: the
//! proxy implements [`Attempts`] over its connections, and the tests over a
//! script, with paused time.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::units::clock;
use tokio::time::Instant;
use tracing::debug;

use crate::observe::metrics::RouteMetrics;
use crate::policy::breaker::{
    Admit, Outcome as BreakerOutcome, SharedBreaker, Snapshot, State as BreakerState, Transition,
};
use crate::policy::paths::{PathBreakers, PathKey};
use crate::policy::{
    decide, decide::Gates, BackoffState, Budget, CallerFault, Decision, Ended, Fault, Outcome,
    Policy, Refusal, RequestFacts, SkipReason, Stop, UpstreamFault,
};

/// What every attempt on a route passes through: its retry policy, budget,
/// breaker and metrics. Shared by the route's requests.
pub struct Guards {
    pub route: Arc<str>,
    pub upstream: Arc<str>,
    pub policy: Policy,
    /// Shared with the runtime this one replaced, when the config kept it.
    pub budget: Arc<Budget>,
    pub breaker: Arc<SharedBreaker>,
    pub metrics: RouteMetrics,
    /// Raised when the breaker closes after an outage: the upstream's
    /// adaptive limit then brings the held-back traffic back by slow start.
    pub closed_after_outage: Arc<AtomicBool>,
    /// A breaker per failing path: one path failing alone is refused alone.
    pub paths: Arc<PathBreakers>,
}

/// Which breakers let an attempt through as a probe: the route's, its
/// path's. Each must hear how the attempt ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Probe {
    pub route: bool,
    pub path: bool,
}

impl Probe {
    pub const NONE: Probe = Probe {
        route: false,
        path: false,
    };

    fn any(self) -> bool {
        self.route || self.path
    }
}

/// An attempt the breakers refused: for how long, and whether it was the
/// path's breaker (else the route's).
#[derive(Debug, Clone, Copy)]
pub struct Refused {
    pub retry_after: Duration,
    pub path: bool,
}

/// Sends one attempt at a time. The proxy implements it over its upstream
/// connections; tests implement it over a script.
pub trait Attempts {
    /// A response to pass on, with what it holds upstream.
    type Answer;

    /// Takes an in-flight slot for the next attempt, or says why not (the
    /// upstream is at its limit). Nothing is sent yet. `may_wait`: the
    /// attempt may wait for a slot when the upstream allows it (a first
    /// attempt or a retry; not a hedge, which only goes where there is room).
    fn reserve(&mut self, may_wait: bool) -> Result<(), String>;

    /// Sends attempt `n` (1-based) on the slot [`reserve`](Self::reserve)
    /// took. Its per-try time starts once the request is sent whole; the
    /// attempt never outlives `deadline`. `probe`: the breaker let it
    /// through as a probe of an upstream it holds failing. The attempt
    /// borrows nothing of `self` while it runs: a hedge may be sent beside it.
    fn send(
        &mut self,
        n: u32,
        per_try: Duration,
        deadline: Instant,
        probe: bool,
    ) -> impl Future<Output = Attempt<Self::Answer>> + use<Self>;

    /// Whether the request body is empty or held whole, so that a second
    /// attempt can send it while the first still runs (a hedge).
    fn body_whole(&self) -> bool {
        false
    }

    /// Whether the request may be hedged at all (an upgrade may not).
    fn hedgeable(&self) -> bool {
        true
    }

    /// Attempt `n` is the one whose end is used (after a hedge race, the
    /// winner): whatever was told of the attempts may say so.
    fn ended_with(&mut self, _n: u32) {}

    /// The next attempt is a retry, sent after `delay`.
    fn backing_off(&mut self, _delay: Duration) {}

    /// Whether the request body can be sent whole again. May wait, until
    /// `deadline` at most, for an earlier attempt to let go of it.
    fn replayable(&mut self, deadline: Instant) -> impl Future<Output = bool>;

    /// `answer` is kept while a retry is tried, in case the retry is refused:
    /// the upstream is done with it, so let go of its in-flight slot.
    fn park(&self, answer: &mut Self::Answer);

    /// Whether `answer` still has a body to come: then the request's
    /// success is the breaker's to hear only once that body ends whole (an
    /// upstream that breaks its bodies off is failing).
    fn body_pending(&self, _answer: &Self::Answer) -> bool {
        false
    }
}

/// How one attempt ended.
#[derive(Debug)]
pub struct Attempt<A> {
    pub outcome: Outcome,
    /// The response, when the upstream answered.
    pub answer: Option<A>,
    /// The response's `Retry-After`, parsed.
    pub retry_after: Option<Duration>,
    /// What went wrong, for the caller and the logs, when no answer came.
    pub detail: String,
    pub elapsed: Duration,
    /// How the endpoint was picked, when it was not plainly (`probe`,
    /// `panic`): shown in the explain trace.
    pub note: Option<&'static str>,
}

/// How the request ended.
pub struct Sent<A> {
    /// Attempts sent upstream.
    pub attempts: u32,
    pub end: End<A>,
    /// `1=503@12ms;backoff=40ms;2=200@9ms`, when asked for.
    pub trace: Option<String>,
    /// The request's success is left for the answer's body to settle with
    /// the breaker ([`Guards::record`]) when it ends: whole, a success;
    /// broken off, a failure.
    pub settle_on_body: bool,
    /// Why a retry was not made, when one was not.
    pub skipped: Option<SkipReason>,
}

/// What goes back to the caller.
#[derive(Debug)]
pub enum End<A> {
    /// The upstream's response.
    Answer(A),
    /// No response: the proxy answers for this outcome.
    Failed {
        outcome: Outcome,
        detail: String,
        /// When the caller may come back (circuit open).
        retry_after: Option<Duration>,
    },
}

/// Sends a request through `attempts`, retrying as the route's policy
/// allows. Every attempt — first, retry, probe — asks the breaker, takes an
/// in-flight slot, and is counted; every retry is paid for by the budget.
pub async fn run<T: Attempts>(
    guards: &Guards,
    facts: RequestFacts,
    attempts: &mut T,
    start: Instant,
    explain: bool,
) -> Sent<T::Answer> {
    let end = deadline(start, guards.policy.timeout);
    run_until(guards, facts, attempts, start, end, explain).await
}

/// [`run`], with the request over at `deadline` (which the caller may have
/// brought forward from the route's `timeout`: a gRPC caller's own
/// `grpc-timeout`, say).
pub async fn run_until<T: Attempts>(
    guards: &Guards,
    facts: RequestFacts,
    attempts: &mut T,
    start: Instant,
    deadline: Instant,
    explain: bool,
) -> Sent<T::Answer> {
    let mut backoff = BackoffState::default();
    // The previous attempt's end, while a retry it paid for is tried, with
    // the retry's cause and delay, counted once the retry is sent.
    let mut kept: Option<Kept<T::Answer>> = None;
    // The budget token of the retry being waited for, until it is sent.
    let mut token: Option<Token<'_>> = None;
    let mut books = Books {
        guards,
        path: facts.path,
        start,
        counted: false,
        deposited: false,
        trace: explain.then(String::new),
    };
    // A caller's own deadline may be over before anything is sent (a
    // gRPC `grpc-timeout` of 0, or a wait before the attempts: an injected
    // delay, the body taken in): nothing goes upstream.
    if deadline <= clock::now() {
        note(&mut books.trace, format_args!("1=deadline"));
        let over = End::Failed {
            outcome: Outcome::Deadline,
            detail: "the request's deadline had passed before an attempt could be sent".into(),
            retry_after: None,
        };
        return done(0, over, books.trace);
    }
    let mut n = 0u32;
    loop {
        n += 1;
        // The retry goes, or is refused: either way its token is settled
        // (kept, or given back by `refuse`). Matched where it is made: kept
        // in a local, a refusal (an attempt's end) would take room in this
        // future for as long as it runs.
        let probe = match admit(attempts, n, &kept, &mut books) {
            Ok(probe) => {
                spend(&mut token);
                probe
            }
            Err(refused) => {
                spend(&mut token);
                return refuse(guards, n, kept, refused, books.trace);
            }
        };
        // The retry goes: count it, and let go of the answer kept in case
        // it could not.
        if let Some((_, cause, delay)) = kept.take() {
            guards.metrics.retry(cause, delay);
        }
        // Should the caller go away mid-attempt, this whole future is
        // dropped, and the guard tells the breaker and the metrics.
        let unanswered = Unanswered::new(guards, probe, facts.path);
        let per_try = guards.policy.per_try_timeout;
        let raced = match guards.policy.hedge_after {
            // Awaited where it is made, in this future's own state: an
            // attempt's future is large, each move of it is a copy, and a
            // function of its own around it kept room for both.
            None => {
                let attempt = attempts.send(n, per_try, deadline, probe.any()).await;
                unanswered.disarm();
                Raced::alone(attempt, n)
            }
            Some(after) => {
                let first = (
                    Box::pin(attempts.send(n, per_try, deadline, probe.any())),
                    unanswered,
                );
                race(
                    guards, &facts, attempts, first, n, after, deadline, &mut books,
                )
                .await
            }
        };
        n = raced.sent;
        let attempt = raced.attempt;
        let outcome = attempt.outcome;
        books.ended(&attempt, raced.number, probe);
        if let Some(loser) = raced.superseded {
            attempts.ended_with(raced.number);
            books.superseded(loser);
        }
        // Only a retry that could be made needs to know about the body.
        let wanted = n < guards.policy.attempts && guards.policy.names(outcome);
        let replayable = !wanted || attempts.replayable(deadline).await;
        let decision = next(
            guards,
            &facts,
            &attempt,
            n,
            wanted,
            replayable,
            deadline,
            &mut backoff,
        );
        let delay = match decision {
            Decision::Retry { delay } => delay,
            Decision::Stop(stop) => return stopped(attempts, stop, attempt, n, books),
        };
        kept = Some(retrying(attempts, &mut books, attempt, n, delay));
        attempts.backing_off(delay);
        // Should the caller go away during the wait, the token goes back.
        token = Some(Token::new(&guards.budget));
        tokio::time::sleep(delay).await;
    }
}

/// Attempt `n` is to be retried after `delay`: logged and traced, and its
/// end kept (an answer parked) in case the retry cannot go.
fn retrying<T: Attempts>(
    attempts: &mut T,
    books: &mut Books<'_>,
    attempt: Attempt<T::Answer>,
    n: u32,
    delay: Duration,
) -> Kept<T::Answer> {
    let outcome = attempt.outcome;
    debug!(
        route = %books.guards.route,
        retry.attempt = n + 1,
        delay_ms = delay.as_millis() as u64,
        cause = outcome.cause(),
        "retrying"
    );
    note(
        &mut books.trace,
        format_args!("backoff={}ms", delay.as_millis()),
    );
    let mut last = end(attempt);
    if let End::Answer(answer) = &mut last {
        attempts.park(answer);
    }
    (last, outcome, delay)
}

/// The end of the attempt before a retry, kept while the retry is tried,
/// with the retry's cause and delay.
type Kept<A> = (End<A>, Outcome, Duration);

/// Whether attempt `n` may be sent: the breaker's admission (`Ok(true)`
/// for a probe), then the upstream's in-flight limit. Refused, the
/// breaker hears how the request ended before it (the previous attempt,
/// if any) and a probe slot taken is freed.
fn admit<T: Attempts>(
    attempts: &mut T,
    n: u32,
    kept: &Option<Kept<T::Answer>>,
    books: &mut Books<'_>,
) -> Result<Probe, End<T::Answer>> {
    let guards = books.guards;
    let refused = match guards.admit(books.path) {
        Err(Refused { retry_after, path }) => {
            note(&mut books.trace, format_args!("{n}=circuit-open"));
            let detail = match path {
                false => format!("the circuit breaker of route {} is open", guards.route),
                true => format!(
                    "the circuit breaker of this path on route {} is open: its requests keep failing",
                    guards.route
                ),
            };
            End::Failed {
                outcome: Outcome::Refused(Refusal::CircuitOpen),
                detail,
                retry_after: Some(retry_after),
            }
        }
        Ok(probe) => match attempts.reserve(true) {
            Ok(()) => return Ok(probe),
            Err(detail) => {
                if probe.any() {
                    guards.record(probe, BreakerOutcome::Unknown, books.path);
                }
                note(&mut books.trace, format_args!("{n}=overloaded"));
                End::Failed {
                    outcome: Outcome::Refused(Refusal::Overloaded),
                    detail,
                    retry_after: None,
                }
            }
        },
    };
    if let Some((_, previous, _)) = kept {
        books.settle(*previous);
    }
    Err(refused)
}

/// What follows attempt `n`'s end: [`decide()`] over the facts the loop
/// gathered (whether a retry could be `wanted` at all, and then whether the
/// body is `replayable`; a budget token is looked for only when one could
/// be wanted), and the token taken for a retry.
#[allow(clippy::too_many_arguments)]
fn next<A>(
    guards: &Guards,
    facts: &RequestFacts,
    attempt: &Attempt<A>,
    n: u32,
    wanted: bool,
    replayable: bool,
    deadline: Instant,
    backoff: &mut BackoffState,
) -> Decision {
    let policy = &guards.policy;
    let outcome = attempt.outcome;
    let ended = Ended {
        attempt: n,
        outcome,
        retry_after: attempt.retry_after,
        replayable,
    };
    // The time is needed only where a retry could follow: an answer that
    // ends the request never looks at what is left (see `decide`).
    let now = wanted.then(Instant::now);
    let gates = Gates {
        breaker_open: guards.breaker_open(),
        budget_has_token: now.is_some_and(|now| guards.budget.has_token(now)),
    };
    let left = now.map_or(Duration::ZERO, |now| {
        deadline.saturating_duration_since(now)
    });
    match decide(
        policy,
        facts,
        &ended,
        left,
        gates,
        backoff,
        &mut rand::rng(),
    ) {
        // Another request may have taken the last token since.
        Decision::Retry { .. } if !now.is_some_and(|now| guards.budget.withdraw(now)) => {
            Decision::Stop(Stop::Skip(SkipReason::Budget))
        }
        decision => decision,
    }
}

/// The request ends with attempt `n`, for `stop`. The breaker hears of it
/// now, or, for an answer whose body is still coming, when the body ends.
fn stopped<T: Attempts>(
    attempts: &T,
    stop: Stop,
    attempt: Attempt<T::Answer>,
    n: u32,
    mut books: Books<'_>,
) -> Sent<T::Answer> {
    let guards = books.guards;
    let outcome = attempt.outcome;
    match stop {
        Stop::Skip(reason) => {
            skip(guards, n, reason);
            note(&mut books.trace, format_args!("skip={}", reason.as_str()));
        }
        Stop::Caller => {
            debug!(route = %guards.route, attempt = n, outcome = outcome.label(), "the caller failed the request")
        }
        Stop::Answer | Stop::Refused => {}
    }
    let deferred = !books.counted
        && BreakerOutcome::of(outcome) == BreakerOutcome::Success
        && attempt
            .answer
            .as_ref()
            .is_some_and(|a| attempts.body_pending(a));
    if !deferred {
        books.settle(outcome);
    }
    if n > 1 {
        guards
            .metrics
            .retried(BreakerOutcome::of(outcome) == BreakerOutcome::Success);
    }
    let mut sent = done(n, end(attempt), books.trace);
    sent.settle_on_body = deferred;
    if let Stop::Skip(reason) = stop {
        sent.skipped = Some(reason);
    }
    sent
}

/// What the loop keeps of the attempts that ended: whether the breaker
/// heard of the request yet, whether it paid into the budget, the trace.
struct Books<'g> {
    guards: &'g Guards,
    /// The request's path, for its own breaker.
    path: PathKey,
    start: Instant,
    /// The breaker heard of this request already (a probe's end, a timeout).
    counted: bool,
    /// The request paid its share into the budget.
    deposited: bool,
    trace: Option<String>,
}

impl Books<'_> {
    /// The breaker counts requests, not attempts: a request's retries are
    /// not so many independent failures, and random errors its retries
    /// absorb are no failure at all. It hears how the request ended, once;
    /// or earlier, when an attempt was a probe, or timed out (see
    /// [`Books::ended`]): a request held by an upstream that stopped
    /// answering is counted as failed at its first per-try timeout, since
    /// waiting for its last one (or for its caller to give up, which counts
    /// for nothing) lets a pile-up grow.
    /// Attempt `loser` lost a hedge race: cancelled, and counted so.
    fn superseded(&mut self, loser: u32) {
        self.guards.metrics.attempt(Outcome::Superseded, None);
        note(
            &mut self.trace,
            format_args!("{loser}={}", Outcome::Superseded.label()),
        );
    }

    fn settle(&self, outcome: Outcome) {
        if !self.counted {
            self.guards
                .record(Probe::NONE, BreakerOutcome::of(outcome), self.path);
        }
    }

    /// Attempt `number` ended: count it, tell the breaker what it must hear
    /// at once, and note it in the trace.
    fn ended<A>(&mut self, attempt: &Attempt<A>, number: u32, probe: Probe) {
        let guards = self.guards;
        let outcome = attempt.outcome;
        // A request earns its share of retries once it was sent and the
        // caller did its part: one the breaker or the limits refused never
        // reached the upstream, and a caller's bad or stalled body must not
        // pay for retries against it.
        if !std::mem::replace(&mut self.deposited, true) && outcome.fault() != Fault::Caller {
            guards.budget.deposit(self.start);
        }
        guards.metrics.attempt(outcome, Some(attempt.elapsed));
        if probe.any() {
            guards.record(probe, BreakerOutcome::of(outcome), self.path);
            self.counted = true;
        } else if outcome == Outcome::Upstream(UpstreamFault::Timeout) && !self.counted {
            guards.record(Probe::NONE, BreakerOutcome::Failure, self.path);
            self.counted = true;
        }
        if self.trace.is_some() {
            let ms = attempt.elapsed.as_millis();
            let how = attempt.note.map_or(String::new(), |n| format!("({n})"));
            match outcome {
                Outcome::Response(status) => note(
                    &mut self.trace,
                    format_args!("{number}={}@{ms}ms{how}", status.as_u16()),
                ),
                other => note(
                    &mut self.trace,
                    format_args!("{number}={}@{ms}ms{how}", other.label()),
                ),
            }
        }
    }
}

/// How an attempt, raced or not, ended.
struct Raced<A> {
    attempt: Attempt<A>,
    /// The number of the attempt whose end this is.
    number: u32,
    /// Attempts sent so far: one more than before when a hedge went.
    sent: u32,
    /// The attempt the winner's answer cancelled.
    superseded: Option<u32>,
}

impl<A> Raced<A> {
    /// Attempt `n`, with no race.
    fn alone(attempt: Attempt<A>, n: u32) -> Self {
        Raced {
            attempt,
            number: n,
            sent: n,
            superseded: None,
        }
    }
}

/// Waits for attempt `n`, and races a hedge against it if the route hedges
/// and it has no answer after `hedge_after`. [`decide::hedge`] says whether
/// a hedge may go (and the budget's token is taken here); it passes the in-flight
/// limit like any attempt, and goes to another endpoint.
///
/// The first attempt to end with an answer or a failure no retry could fix
/// wins: the other is cancelled (its future dropped, which closes its
/// connection) and counted as `superseded`. One that ends with a failure
/// `retry_on` names is counted, and the other is waited for: its end is
/// the one the loop decides on.
#[allow(clippy::too_many_arguments)]
async fn race<T: Attempts, F>(
    guards: &Guards,
    facts: &RequestFacts,
    attempts: &mut T,
    (mut first, unanswered): (F, Unanswered<'_>),
    n: u32,
    after: Duration,
    deadline: Instant,
    books: &mut Books<'_>,
) -> Raced<T::Answer>
where
    F: Future<Output = Attempt<T::Answer>> + Unpin,
{
    let policy = &guards.policy;
    let alone = |attempt, unanswered: Unanswered<'_>| {
        unanswered.disarm();
        Raced::alone(attempt, n)
    };
    tokio::select! {
        biased;
        attempt = &mut first => return alone(attempt, unanswered),
        () = tokio::time::sleep(after) => {}
    }
    let slow = decide::Slow {
        sent: n,
        probe: unanswered.probe.any(),
        body_whole: attempts.body_whole(),
    };
    let skipped = match hedge_gates(guards, facts, attempts, &slow, deadline) {
        None => return alone(first.await, unanswered),
        Some(skipped) => skipped,
    };
    if let Some(reason) = skipped {
        guards.metrics.hedge_skipped(reason);
        note(
            &mut books.trace,
            format_args!("hedge-skip={}", reason.as_str()),
        );
        debug!(route = %guards.route, attempt = n, reason = reason.as_str(), "hedge skipped");
        return alone(first.await, unanswered);
    }
    let m = n + 1;
    debug!(route = %guards.route, attempt = m, after_ms = after.as_millis() as u64, "hedging");
    note(
        &mut books.trace,
        format_args!("hedge@{}ms", after.as_millis()),
    );
    let hedged = Unanswered::new(guards, Probe::NONE, facts.path);
    let mut second = Box::pin(attempts.send(m, policy.per_try_timeout, deadline, false));
    let (first_ended, early) = tokio::select! {
        attempt = &mut first => (true, attempt),
        attempt = &mut second => (false, attempt),
    };
    let (early_number, late_number) = if first_ended { (n, m) } else { (m, n) };
    if !policy.names(early.outcome) {
        // It ends the request; the other is cancelled on return.
        unanswered.disarm();
        hedged.disarm();
        guards.metrics.hedge(!first_ended);
        return Raced {
            attempt: early,
            number: early_number,
            sent: m,
            superseded: Some(late_number),
        };
    }
    // A failure a retry could fix: the other attempt may yet answer. The
    // guard of the one that ended goes; the other's stays, should the
    // caller leave while it runs.
    books.ended(&early, early_number, Probe::NONE);
    drop(early);
    let late = match first_ended {
        true => {
            unanswered.disarm();
            let late = second.await;
            hedged.disarm();
            late
        }
        false => {
            hedged.disarm();
            let late = first.await;
            unanswered.disarm();
            late
        }
    };
    guards.metrics.hedge(first_ended);
    attempts.ended_with(late_number);
    Raced {
        attempt: late,
        number: late_number,
        sent: m,
        superseded: None,
    }
}

/// Whether a hedge may go now (`Some(None)`), with its budget token taken
/// and its in-flight slot reserved, or why not; `None` when the request is
/// never hedged.
fn hedge_gates<T: Attempts>(
    guards: &Guards,
    facts: &RequestFacts,
    attempts: &mut T,
    slow: &decide::Slow,
    deadline: Instant,
) -> Option<Option<SkipReason>> {
    if !attempts.hedgeable() {
        return None;
    }
    let now = clock::now();
    let gates = Gates {
        breaker_open: !guards.breaker.is_closed(),
        budget_has_token: guards.budget.has_token(now),
    };
    let left = deadline.saturating_duration_since(now);
    Some(
        match decide::hedge(&guards.policy, facts, slow, left, gates)? {
            // Another request may have taken the last token since.
            Ok(()) if !guards.budget.withdraw(now) => Some(SkipReason::Budget),
            Ok(()) => match attempts.reserve(false) {
                Ok(()) => None,
                Err(_) => {
                    guards.budget.refund(clock::now());
                    Some(SkipReason::Overloaded)
                }
            },
            Err(reason) => Some(reason),
        },
    )
}

/// When a request that started at `start` must be over.
pub fn deadline(start: Instant, timeout: Duration) -> Instant {
    // A `timeout` too long to add to a clock reading is as good as none.
    start
        .checked_add(timeout)
        .unwrap_or_else(|| start + Duration::from_secs(365 * 24 * 3600))
}

/// Attempt `n` was refused before it was sent. A first attempt answers for
/// itself; a retry that was paid for gives its token back, is counted as
/// skipped, and the caller gets what the attempt before it ended in.
fn refuse<A>(
    guards: &Guards,
    n: u32,
    kept: Option<(End<A>, Outcome, Duration)>,
    refused: End<A>,
    trace: Option<String>,
) -> Sent<A> {
    let Some((previous, _, _)) = kept else {
        if let End::Failed { outcome, .. } = &refused {
            debug!(route = %guards.route, outcome = outcome.label(), "request refused before an attempt");
        }
        return done(n - 1, refused, trace);
    };
    guards.budget.refund(clock::now());
    let reason = match refused {
        End::Failed {
            outcome: Outcome::Refused(Refusal::Overloaded),
            ..
        } => SkipReason::Overloaded,
        _ => SkipReason::BreakerOpen,
    };
    skip(guards, n - 1, reason);
    if n > 2 {
        guards.metrics.retried(false);
    }
    let mut trace = trace;
    note(&mut trace, format_args!("skip={}", reason.as_str()));
    let mut sent = done(n - 1, previous, trace);
    sent.skipped = Some(reason);
    sent
}

fn end<A>(attempt: Attempt<A>) -> End<A> {
    match attempt.answer {
        Some(answer) => End::Answer(answer),
        None => End::Failed {
            outcome: attempt.outcome,
            detail: attempt.detail,
            retry_after: None,
        },
    }
}

/// The budget token a retry took, while the retry waits to be sent: given
/// back if the request is dropped first (its caller went away).
struct Token<'a> {
    budget: &'a Budget,
    armed: bool,
}

impl<'a> Token<'a> {
    fn new(budget: &'a Budget) -> Self {
        Self {
            budget,
            armed: true,
        }
    }

    /// Sent, or refunded by [`refuse`]: nothing more to do.
    fn spent(mut self) {
        self.armed = false;
    }
}

fn spend(token: &mut Option<Token<'_>>) {
    if let Some(token) = token.take() {
        token.spent();
    }
}

impl Drop for Token<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.budget.refund(clock::now());
        }
    }
}

/// Held while an attempt waits for its end; dropped only when the caller
/// went away mid-attempt. That is the caller's doing: it counts against
/// nobody, but frees a probe slot and is counted as `cancelled`.
struct Unanswered<'a> {
    guards: &'a Guards,
    probe: Probe,
    path: PathKey,
    armed: bool,
}

impl<'a> Unanswered<'a> {
    fn new(guards: &'a Guards, probe: Probe, path: PathKey) -> Self {
        Self {
            guards,
            probe,
            path,
            armed: true,
        }
    }

    /// The attempt ended (answered, failed or given up by the loop): its
    /// outcome is booked where it ended, not here.
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let gone = Outcome::Caller(CallerFault::Gone);
        if self.probe.any() {
            self.guards
                .record(self.probe, BreakerOutcome::of(gone), self.path);
        }
        self.guards.metrics.attempt(gone, None);
    }
}

fn done<A>(attempts: u32, end: End<A>, trace: Option<String>) -> Sent<A> {
    Sent {
        attempts,
        end,
        trace,
        settle_on_body: false,
        skipped: None,
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

fn skip(guards: &Guards, attempt: u32, reason: SkipReason) {
    guards.metrics.skipped(reason);
    debug!(route = %guards.route, attempt, reason = reason.as_str(), "retry skipped");
}

// === impl Guards ===

impl Guards {
    /// Asks the route's breaker, then the breaker of the request's `path`,
    /// whether an attempt may go now.
    pub fn admit(&self, path: PathKey) -> Result<Probe, Refused> {
        let route = match self.breaker.is_closed() {
            true => Admit::Yes { probe: false },
            false => {
                let (admit, transition) = self
                    .breaker
                    .with(|b| b.admit(clock::now(), &mut rand::rng()));
                self.transitioned(transition);
                admit
            }
        };
        let route = match route {
            Admit::Yes { probe } => probe,
            Admit::No { retry_after } => {
                return Err(Refused {
                    retry_after,
                    path: false,
                })
            }
        };
        // The route's own probe goes whatever its path's breaker says: the
        // route's recovery is found at the route's pace, and forgets the
        // paths' breakers.
        if route {
            return Ok(Probe { route, path: false });
        }
        match self.paths.admit(path, clock::now(), &mut rand::rng()) {
            (Admit::Yes { probe }, _) => Ok(Probe { route, path: probe }),
            (Admit::No { retry_after }, _) => Err(Refused {
                retry_after,
                path: true,
            }),
        }
    }

    /// Tells the breakers how an admitted attempt on `path` ended: the
    /// path's, and the route's unless the path's holds it failing alone.
    pub fn record(&self, probe: Probe, outcome: BreakerOutcome, path: PathKey) {
        // One clock read and one handle on the thread's generator for both
        // breakers.
        let (now, rng) = (clock::now(), &mut rand::rng());
        let (for_route, transition) = self.paths.record(path, probe.path, outcome, now, rng);
        if let Some(t) = transition {
            self.metrics.path_breaker(t.to);
            tracing::info!(route = %self.route, upstream = %self.upstream, to = t.to.as_str(), "circuit breaker of a path");
        }
        let outcome = match for_route {
            true => outcome,
            false => BreakerOutcome::Unknown,
        };
        if for_route || probe.route {
            let transition = self
                .breaker
                .with(|b| b.record(now, probe.route, outcome, rng));
            self.transitioned(transition);
        }
    }

    /// Whether the breaker is open now (without admitting anything).
    pub fn breaker_open(&self) -> bool {
        !self.breaker.is_closed() && self.breaker.with(|b| b.state()) == BreakerState::Open
    }

    /// Operator override from the admin endpoint: open, close, or `None` to reset.
    pub fn force_breaker(&self, state: Option<BreakerState>) -> Snapshot {
        let now = Instant::now();
        let (transition, snapshot) = self
            .breaker
            .with(|b| (b.force(now, state), b.snapshot(now)));
        self.transitioned(transition);
        snapshot
    }

    pub fn breaker_snapshot(&self) -> Snapshot {
        self.breaker.with(|b| b.snapshot(Instant::now()))
    }

    fn transitioned(&self, transition: Option<Transition>) {
        if let Some(t) = transition {
            self.metrics.breaker(t.to);
            if t.to == BreakerState::Closed {
                self.closed_after_outage.store(true, Ordering::Relaxed);
                self.paths.clear();
            }
            tracing::info!(route = %self.route, upstream = %self.upstream, to = t.to.as_str(), "circuit breaker");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use http::StatusCode;

    use super::*;
    use crate::config::schema::{BreakerConfig, Jitter, RetryConfig};
    use crate::observe::metrics::Metrics;
    use crate::policy::UpstreamFault;

    /// Attempts that end as scripted, answering with their number: each
    /// after its delay (none: at once, said to take 1 ms).
    struct Script {
        outcomes: VecDeque<(Outcome, Duration)>,
        /// What `body_whole` says.
        whole: bool,
        /// `reserve` refuses the attempt with this number.
        full_at: Option<u32>,
        reserved: u32,
        sent: u32,
    }

    impl Attempts for Script {
        type Answer = u32;

        fn reserve(&mut self, _may_wait: bool) -> Result<(), String> {
            self.reserved += 1;
            match self.full_at == Some(self.reserved) {
                true => Err("full".into()),
                false => Ok(()),
            }
        }

        fn send(
            &mut self,
            n: u32,
            _: Duration,
            _: Instant,
            _: bool,
        ) -> impl Future<Output = Attempt<u32>> + use<> {
            self.sent += 1;
            let (outcome, delay) = self.outcomes.pop_front().expect("scripted");
            async move {
                tokio::time::sleep(delay).await;
                Attempt {
                    outcome,
                    answer: matches!(outcome, Outcome::Response(_)).then_some(n),
                    retry_after: None,
                    detail: outcome.label().to_owned(),
                    elapsed: delay.max(Duration::from_millis(1)),
                    note: None,
                }
            }
        }

        fn body_whole(&self) -> bool {
            self.whole
        }

        async fn replayable(&mut self, _: Instant) -> bool {
            true
        }

        fn park(&self, _: &mut u32) {}
    }

    fn script(outcomes: &[Outcome]) -> Script {
        Script {
            outcomes: outcomes.iter().map(|o| (*o, Duration::ZERO)).collect(),
            whole: true,
            full_at: None,
            reserved: 0,
            sent: 0,
        }
    }

    fn guards(registry: &Arc<Metrics>) -> Guards {
        let now = Instant::now();
        let mut retry = RetryConfig {
            attempts: 3,
            ..RetryConfig::default()
        };
        retry.backoff.base = Duration::from_millis(100);
        retry.backoff.jitter = Jitter::None;
        // Room for every retry these tests script (the default floor is 1/s).
        retry.budget.min_per_second = 10;
        let breaker = BreakerConfig {
            consecutive_failures: 2,
            ..BreakerConfig::default()
        };
        Guards {
            route: "r".into(),
            upstream: "u".into(),
            policy: Policy::from_config(&retry).unwrap(),
            budget: Arc::new(Budget::from_config(&retry.budget, now).unwrap()),
            breaker: Arc::new(SharedBreaker::new(Breaker::try_new(&breaker, now).unwrap())),
            metrics: RouteMetrics::new(registry, "r", "u"),
            closed_after_outage: Arc::default(),
            paths: Arc::new(PathBreakers::new(&breaker)),
        }
    }

    const S503: Outcome = Outcome::Response(StatusCode::SERVICE_UNAVAILABLE);
    const S200: Outcome = Outcome::Response(StatusCode::OK);

    fn series(registry: &Metrics, series: &str) -> f64 {
        let text = registry.render();
        text.lines()
            .find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok()))
            .unwrap_or(0.0)
    }

    use crate::policy::breaker::Breaker;

    #[tokio::test(start_paused = true)]
    async fn retries_until_an_answer() {
        let registry = Metrics::new();
        let g = guards(&registry);
        let mut attempts = script(&[S503, S200]);
        let sent = run(&g, facts(), &mut attempts, Instant::now(), true).await;
        assert_eq!(sent.attempts, 2);
        assert!(matches!(sent.end, End::Answer(2)));
        assert_eq!(
            sent.trace.as_deref(),
            Some("1=503@1ms;backoff=100ms;2=200@1ms")
        );
        let retries = r#"herdguard_retries_total{route="r",reason="503"}"#;
        assert_eq!(series(&registry, retries), 1.0);
    }

    fn facts() -> RequestFacts {
        RequestFacts {
            idempotent: true,
            inner_hop: false,
            path: PathKey::NONE,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_retry_refused_by_the_limit_refunds_its_token_and_passes_the_answer_on() {
        let registry = Metrics::new();
        let g = guards(&registry);
        let before = g.budget.available(Instant::now());
        let mut attempts = Script {
            full_at: Some(2),
            ..script(&[S503])
        };
        let sent = run(&g, facts(), &mut attempts, Instant::now(), true).await;
        assert_eq!(sent.attempts, 1, "one attempt was sent");
        assert!(
            matches!(sent.end, End::Answer(1)),
            "the upstream's own answer"
        );
        assert_eq!(attempts.sent, 1);
        let now = Instant::now();
        // The request's own deposit is all that changed.
        let deposit = 0.2;
        assert_eq!(g.budget.available(now), before + deposit, "refunded");
        let skipped = r#"herdguard_retries_skipped_total{route="r",reason="overloaded"}"#;
        assert_eq!(series(&registry, skipped), 1.0);
        let retries = r#"herdguard_retries_total{route="r",reason="503"}"#;
        assert_eq!(series(&registry, retries), 0.0, "not counted as made");
        assert_eq!(
            sent.trace.as_deref(),
            Some("1=503@1ms;backoff=100ms;2=overloaded;skip=overloaded")
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_breaker_that_opens_during_the_backoff_refunds_and_passes_the_answer_on() {
        let registry = Metrics::new();
        let g = Arc::new(guards(&registry));
        let before = g.budget.available(Instant::now());
        // Another request trips the breaker while this one waits to retry.
        let other = g.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            other.force_breaker(Some(BreakerState::Open));
        });
        let mut attempts = script(&[S503]);
        let sent = run(&g, facts(), &mut attempts, Instant::now(), false).await;
        assert_eq!(sent.attempts, 1);
        assert!(matches!(sent.end, End::Answer(1)));
        assert_eq!(g.budget.available(Instant::now()), before + 0.2, "refunded");
        let skipped = r#"herdguard_retries_skipped_total{route="r",reason="breaker_open"}"#;
        assert_eq!(series(&registry, skipped), 1.0);
    }

    #[tokio::test(start_paused = true)]
    async fn the_callers_faults_stop_at_once_and_never_open_the_breaker() {
        let registry = Metrics::new();
        let g = guards(&registry);
        for _ in 0..10 {
            let mut attempts = script(&[Outcome::Caller(CallerFault::MalformedBody)]);
            let sent = run(&g, facts(), &mut attempts, Instant::now(), false).await;
            assert_eq!(sent.attempts, 1);
            assert!(matches!(
                sent.end,
                End::Failed {
                    outcome: Outcome::Caller(CallerFault::MalformedBody),
                    ..
                }
            ));
        }
        assert!(g.breaker.is_closed());
        // While two requests that fail in a row open it.
        let timeout = Outcome::Upstream(UpstreamFault::Timeout);
        for _ in 0..2 {
            let mut attempts = script(&[timeout, timeout, timeout]);
            run(&g, facts(), &mut attempts, Instant::now(), false).await;
        }
        assert!(!g.breaker.is_closed());
    }

    #[tokio::test(start_paused = true)]
    async fn the_breaker_counts_requests_not_their_retries() {
        let registry = Metrics::new();
        let g = guards(&registry);
        // Each request fails twice and then succeeds: 40 failed attempts in
        // all, with consecutive_failures = 2, and the breaker never opens.
        for _ in 0..20 {
            let mut attempts = script(&[S503, S503, S200]);
            let sent = run(&g, facts(), &mut attempts, Instant::now(), false).await;
            assert!(matches!(sent.end, End::Answer(3)));
        }
        assert!(g.breaker.is_closed());
    }

    #[tokio::test(start_paused = true)]
    async fn a_caller_gone_during_the_backoff_gives_the_token_back() {
        let registry = Metrics::new();
        let g = guards(&registry);
        let before = g.budget.available(Instant::now());
        let mut attempts = script(&[S503, S200]);
        let run = run(&g, facts(), &mut attempts, Instant::now(), false);
        // The retry waits 100 ms; the caller leaves after 50.
        let left = tokio::time::timeout(Duration::from_millis(50), run).await;
        assert!(left.is_err());
        assert_eq!(attempts.sent, 1);
        assert_eq!(g.budget.available(Instant::now()), before + 0.2, "refunded");
    }

    #[tokio::test(start_paused = true)]
    async fn a_callers_fault_deposits_nothing() {
        let registry = Metrics::new();
        let g = guards(&registry);
        let before = g.budget.available(Instant::now());
        for _ in 0..20 {
            let mut attempts = script(&[Outcome::Caller(CallerFault::StalledBody)]);
            run(&g, facts(), &mut attempts, Instant::now(), false).await;
        }
        assert_eq!(g.budget.available(Instant::now()), before);
    }

    #[tokio::test(start_paused = true)]
    async fn a_caller_gone_mid_attempt_counts_for_nothing() {
        struct Never;
        impl Attempts for Never {
            type Answer = ();
            fn reserve(&mut self, _may_wait: bool) -> Result<(), String> {
                Ok(())
            }
            fn send(
                &mut self,
                _: u32,
                _: Duration,
                _: Instant,
                _: bool,
            ) -> impl Future<Output = Attempt<()>> + use<> {
                std::future::pending()
            }
            async fn replayable(&mut self, _: Instant) -> bool {
                true
            }
            fn park(&self, _: &mut ()) {}
        }
        let registry = Metrics::new();
        let g = guards(&registry);
        for _ in 0..5 {
            let mut never = Never;
            let run = run(&g, facts(), &mut never, Instant::now(), false);
            // The caller gives up after a while: the request's future is dropped.
            let gave_up = tokio::time::timeout(Duration::from_secs(1), run).await;
            assert!(gave_up.is_err());
        }
        assert!(g.breaker.is_closed());
        let cancelled =
            r#"herdguard_upstream_attempts_total{route="r",upstream="u",outcome="cancelled"}"#;
        assert_eq!(series(&registry, cancelled), 5.0);
    }

    /// Guards of a route that hedges after 50 ms.
    fn hedging(registry: &Arc<Metrics>) -> Guards {
        let mut g = guards(registry);
        g.policy.hedge_after = Some(Duration::from_millis(50));
        g
    }

    fn timed(outcomes: &[(Outcome, u64)]) -> Script {
        Script {
            outcomes: outcomes
                .iter()
                .map(|(o, ms)| (*o, Duration::from_millis(*ms)))
                .collect(),
            ..script(&[])
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_hedge_answers_for_a_slow_first_attempt_which_is_cancelled() {
        let registry = Metrics::new();
        let g = hedging(&registry);
        let before = g.budget.available(Instant::now());
        // The first attempt would answer after 400 ms; the hedge, sent at 50, after 10.
        let mut attempts = timed(&[(S200, 400), (S200, 10)]);
        let start = Instant::now();
        let sent = run(&g, facts(), &mut attempts, start, true).await;
        assert_eq!(start.elapsed(), Duration::from_millis(60));
        assert_eq!(sent.attempts, 2);
        assert!(matches!(sent.end, End::Answer(2)), "the hedge's answer");
        assert_eq!(
            sent.trace.as_deref(),
            Some("hedge@50ms;2=200@10ms;1=superseded")
        );
        let won = r#"herdguard_hedges_total{route="r",result="won"}"#;
        assert_eq!(series(&registry, won), 1.0);
        let superseded =
            r#"herdguard_upstream_attempts_total{route="r",upstream="u",outcome="superseded"}"#;
        assert_eq!(series(&registry, superseded), 1.0);
        // The hedge took a token; the request deposited its share.
        assert_eq!(g.budget.available(Instant::now()), before + 0.2 - 1.0);
        assert!(g.breaker.is_closed());
    }

    #[tokio::test(start_paused = true)]
    async fn a_first_attempt_that_answers_before_its_hedge_wins() {
        let registry = Metrics::new();
        let g = hedging(&registry);
        let mut attempts = timed(&[(S200, 70), (S200, 100)]);
        let sent = run(&g, facts(), &mut attempts, Instant::now(), true).await;
        assert!(matches!(sent.end, End::Answer(1)));
        assert_eq!(sent.attempts, 2);
        assert_eq!(
            sent.trace.as_deref(),
            Some("hedge@50ms;1=200@70ms;2=superseded")
        );
        let lost = r#"herdguard_hedges_total{route="r",result="lost"}"#;
        assert_eq!(series(&registry, lost), 1.0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_hedge_that_fails_retryably_leaves_the_first_attempt_running() {
        let registry = Metrics::new();
        let g = hedging(&registry);
        // The hedge gets a 503 at once; the first attempt's 200 comes later.
        let mut attempts = timed(&[(S200, 300), (S503, 5)]);
        let sent = run(&g, facts(), &mut attempts, Instant::now(), true).await;
        assert!(matches!(sent.end, End::Answer(1)), "the first's answer");
        assert_eq!(
            sent.trace.as_deref(),
            Some("hedge@50ms;2=503@5ms;1=200@300ms")
        );
        let lost = r#"herdguard_hedges_total{route="r",result="lost"}"#;
        assert_eq!(series(&registry, lost), 1.0);
        let superseded =
            r#"herdguard_upstream_attempts_total{route="r",upstream="u",outcome="superseded"}"#;
        assert_eq!(series(&registry, superseded), 0.0);
    }

    #[tokio::test(start_paused = true)]
    async fn no_hedge_without_budget_safety_a_whole_body_or_a_free_slot() {
        let skipped = |reason: &str| {
            format!(r#"herdguard_hedges_skipped_total{{route="r",reason="{reason}"}}"#)
        };
        // An empty budget: the slow attempt is waited for, alone.
        let registry = Metrics::new();
        let g = hedging(&registry);
        let now = Instant::now();
        while g.budget.withdraw(now) {}
        let mut attempts = timed(&[(S200, 400)]);
        let sent = run(&g, facts(), &mut attempts, now, true).await;
        assert_eq!((sent.attempts, attempts.sent), (1, 1));
        assert_eq!(sent.trace.as_deref(), Some("hedge-skip=budget;1=200@400ms"));
        assert_eq!(series(&registry, &skipped("budget")), 1.0);

        // A request that is not safe to repeat is never hedged, nor counted.
        let registry = Metrics::new();
        let g = hedging(&registry);
        let mut attempts = timed(&[(S200, 400)]);
        let unsafe_facts = RequestFacts {
            idempotent: false,
            inner_hop: false,
            path: PathKey::NONE,
        };
        let sent = run(&g, unsafe_facts, &mut attempts, Instant::now(), true).await;
        assert_eq!(attempts.sent, 1);
        assert_eq!(sent.trace.as_deref(), Some("1=200@400ms"));

        // A body still streaming cannot be sent twice at once.
        let registry = Metrics::new();
        let g = hedging(&registry);
        let mut attempts = Script {
            whole: false,
            ..timed(&[(S200, 400)])
        };
        run(&g, facts(), &mut attempts, Instant::now(), false).await;
        assert_eq!(attempts.sent, 1);
        assert_eq!(series(&registry, &skipped("body_too_large")), 1.0);

        // The upstream at its limit: the token goes back.
        let registry = Metrics::new();
        let g = hedging(&registry);
        let before = g.budget.available(Instant::now());
        let mut attempts = Script {
            full_at: Some(2),
            ..timed(&[(S200, 400)])
        };
        run(&g, facts(), &mut attempts, Instant::now(), false).await;
        assert_eq!(attempts.sent, 1);
        assert_eq!(series(&registry, &skipped("overloaded")), 1.0);
        assert_eq!(g.budget.available(Instant::now()), before + 0.2);

        // A breaker not closed: nothing extra for a failing upstream, and
        // a probe is never raced. Two failed requests open it; once it lets
        // a probe through, the probe is slow.
        let registry = Metrics::new();
        let g = hedging(&registry);
        let timeout = Outcome::Upstream(UpstreamFault::Timeout);
        for _ in 0..2 {
            let mut failing = timed(&[(timeout, 0), (timeout, 0), (timeout, 0)]);
            run(&g, facts(), &mut failing, Instant::now(), false).await;
        }
        assert!(g.breaker_open());
        tokio::time::sleep(Duration::from_secs(3600)).await;
        let mut attempts = timed(&[(S200, 400)]);
        run(&g, facts(), &mut attempts, Instant::now(), false).await;
        assert_eq!(attempts.sent, 1);
        assert_eq!(series(&registry, &skipped("breaker_open")), 1.0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_caller_gone_mid_race_cancels_both_attempts() {
        let registry = Metrics::new();
        let g = hedging(&registry);
        let mut attempts = timed(&[(S200, 400), (S200, 400)]);
        let run = run(&g, facts(), &mut attempts, Instant::now(), false);
        let gave_up = tokio::time::timeout(Duration::from_millis(100), run).await;
        assert!(gave_up.is_err());
        let cancelled =
            r#"herdguard_upstream_attempts_total{route="r",upstream="u",outcome="cancelled"}"#;
        assert_eq!(series(&registry, cancelled), 2.0);
        assert!(g.breaker.is_closed());
    }
}
