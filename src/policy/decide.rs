//! The one retry decision: after an attempt, retry after a delay, or stop
//! with a reason.
//!
//! Why one function: every gate a retry must pass (is the outcome one
//! `retry_on` names, is the request safe to repeat, can its body be sent
//! again, did the server ask us to wait, is there time left, is the breaker
//! closed, can the budget afford it) used to sit in different places, some
//! of them inline in the async loop where no test reached them. Here they
//! are in one order, over plain inputs, and a table test covers each stop.
//!
//! The functions here are pure: they are told the time left and whether
//! the budget has a token, and they take nothing. The budget is the last
//! gate: the loop takes a token only for a retry (or hedge) that passed
//! every other one, and one it cannot take after all (another request took
//! the last) is a `budget` skip. A retry refused after that (its attempt
//! found the breaker open or the upstream full) gives the token back; the
//! loop does that with [`Budget::refund`](super::budget::Budget::refund).

use std::time::Duration;

use rand::Rng;

use super::backoff::BackoffState;
use super::outcome::{Fault, Outcome, SkipReason};
use super::retry::{Policy, RequestFacts};

/// What is known once an attempt has ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ended {
    /// 1-based: the attempt that just ended.
    pub attempt: u32,
    pub outcome: Outcome,
    /// The response's `Retry-After`, parsed, if it had one.
    pub retry_after: Option<Duration>,
    /// Whether the request body can be sent whole again.
    pub replayable: bool,
}

/// The state of the route's guards when the decision is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gates {
    pub breaker_open: bool,
    /// The budget has a token for one more attempt (the loop takes it).
    pub budget_has_token: bool,
}

/// What to do after an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Wait this long, then send the next attempt, paid with a budget
    /// token the loop takes.
    Retry {
        delay: Duration,
    },
    Stop(Stop),
}

/// Why no retry follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// The attempt succeeded, or failed in a way `retry_on` does not name:
    /// its answer goes to the caller.
    Answer,
    /// The caller failed the attempt: its fault, not something to repeat.
    Caller,
    /// The proxy refused to send the attempt (the first one: later ones are
    /// the loop's to handle).
    Refused,
    /// A retry was wanted and is not allowed, for this reason (counted).
    Skip(SkipReason),
}

/// Decides what follows the attempt that `ended` describes, with `left`
/// before the request's deadline.
///
/// The gates, in order: the outcome (only what `retry_on` names; the
/// deadline's cut is a `deadline` skip), an outer hop that retries for us,
/// then those of `another_attempt`: `attempts`, idempotency (a request
/// that never reached the upstream is always safe), a replayable body,
/// `Retry-After` against `max_retry_after`, time (after its delay, a retry
/// must have [`Policy::min_retry_time`] left), the breaker, and last the
/// budget.
pub fn decide<R: Rng + ?Sized>(
    policy: &Policy,
    request: &RequestFacts,
    ended: &Ended,
    left: Duration,
    gates: Gates,
    backoff: &mut BackoffState,
    rng: &mut R,
) -> Decision {
    let outcome = ended.outcome;
    match outcome.fault() {
        Fault::Caller => return Decision::Stop(Stop::Caller),
        Fault::Proxy => return Decision::Stop(Stop::Refused),
        Fault::Deadline => return Decision::Stop(Stop::Skip(SkipReason::Deadline)),
        Fault::None | Fault::Upstream if !policy.names(outcome) => {
            return Decision::Stop(Stop::Answer)
        }
        Fault::None | Fault::Upstream => {}
    }
    if request.inner_hop {
        return Decision::Stop(Stop::Skip(SkipReason::InnerHop));
    }
    let next = Next {
        sent: ended.attempt,
        safe: !outcome.reached_upstream() || request.idempotent,
        body: ended.replayable,
        left,
    };
    let delay = || match policy.server_delay(ended.retry_after)? {
        // The server's delay, plus up to a tenth more, so that callers told
        // the same Retry-After do not all come back at once; never less than
        // our own jittered backoff, so `Retry-After: 0` (or a date in the
        // past) does not bring every caller back at the same instant.
        Some(d) => {
            let server = d.saturating_add(rng.random_range(Duration::ZERO..=d / 10));
            Ok(server.max(policy.backoff.next_delay(backoff, rng)))
        }
        None => Ok(policy.backoff.next_delay(backoff, rng)),
    };
    match another_attempt(policy, &next, delay, gates) {
        Ok(delay) => Decision::Retry { delay },
        Err(reason) => Decision::Stop(Stop::Skip(reason)),
    }
}

/// What a further attempt of a request would be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Next {
    /// Attempts sent so far.
    sent: u32,
    /// The request may be repeated.
    safe: bool,
    /// Its body can be sent whole again.
    body: bool,
    /// Time left before the request's deadline.
    left: Duration,
}

/// The gates every further attempt passes, a retry or a hedge alike, in
/// order: `attempts`, a request safe to repeat, its body, the delay before
/// it (a retry's backoff or the server's `Retry-After`; none for a hedge),
/// time for it to be useful ([`Policy::min_retry_time`] left after the
/// delay), a closed breaker, and last a budget token. `Ok`: the delay.
fn another_attempt(
    policy: &Policy,
    next: &Next,
    delay: impl FnOnce() -> Result<Duration, SkipReason>,
    gates: Gates,
) -> Result<Duration, SkipReason> {
    if next.sent >= policy.attempts {
        return Err(SkipReason::AttemptsExhausted);
    }
    if !next.safe {
        return Err(SkipReason::NonIdempotent);
    }
    if !next.body {
        return Err(SkipReason::BodyTooLarge);
    }
    let delay = delay()?;
    if next.left < delay.saturating_add(policy.min_retry_time()) || next.left.is_zero() {
        return Err(SkipReason::Deadline);
    }
    if gates.breaker_open {
        return Err(SkipReason::BreakerOpen);
    }
    if !gates.budget_has_token {
        return Err(SkipReason::Budget);
    }
    Ok(delay)
}

/// What is known when an attempt has had no answer for `hedge_after`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slow {
    /// Attempts sent so far, the slow one included.
    pub sent: u32,
    /// The slow attempt is a breaker probe.
    pub probe: bool,
    /// The request body is empty or held whole, so a second attempt can
    /// send it while the first still runs.
    pub body_whole: bool,
}

/// Whether a hedge may be sent now, with `left` before the deadline, or
/// why not. Only for requests where hedging is on and that are safe to
/// repeat (idempotent, first hop): `None` for others, which are never
/// hedged and never counted as skipped. The gates are a retry's
/// (`another_attempt`) with no delay; a probe is never raced, as if the
/// breaker were open. A hedge pays its token like a retry.
pub fn hedge(
    policy: &Policy,
    request: &RequestFacts,
    slow: &Slow,
    left: Duration,
    gates: Gates,
) -> Option<Result<(), SkipReason>> {
    if policy.hedge_after.is_none() || !request.idempotent || !policy.may_retry(request) {
        return None;
    }
    let next = Next {
        sent: slow.sent,
        safe: true,
        body: slow.body_whole,
        left,
    };
    let gates = Gates {
        breaker_open: gates.breaker_open || slow.probe,
        ..gates
    };
    Some(another_attempt(policy, &next, || Ok(Duration::ZERO), gates).map(drop))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::outcome::{CallerFault, Refusal, UpstreamFault};
    use crate::policy::settings::{Jitter, RetryConfig};
    use http::StatusCode;
    use rand::rngs::SmallRng;
    use rand::SeedableRng;

    const SAFE: RequestFacts = RequestFacts {
        idempotent: true,
        inner_hop: false,
        path: crate::policy::paths::PathKey::NONE,
    };
    const UNSAFE: RequestFacts = RequestFacts {
        idempotent: false,
        inner_hop: false,
        path: crate::policy::paths::PathKey::NONE,
    };
    const INNER: RequestFacts = RequestFacts {
        idempotent: true,
        inner_hop: true,
        path: crate::policy::paths::PathKey::NONE,
    };

    fn policy() -> Policy {
        let mut c = RetryConfig {
            attempts: 3,
            per_try_timeout: Duration::from_secs(2),
            timeout: Duration::from_secs(10),
            ..RetryConfig::default()
        };
        c.backoff.base = Duration::from_millis(100);
        c.backoff.jitter = Jitter::None;
        c.max_retry_after = Duration::from_secs(5);
        Policy::from_config(&c).unwrap()
    }

    fn s(code: u16) -> Outcome {
        Outcome::Response(StatusCode::from_u16(code).unwrap())
    }

    fn ended(outcome: Outcome) -> Ended {
        Ended {
            attempt: 1,
            outcome,
            retry_after: None,
            replayable: true,
        }
    }

    /// One row: the inputs that differ from a plain first attempt, and the decision.
    struct Row {
        name: &'static str,
        request: RequestFacts,
        ended: Ended,
        /// Time left before the deadline.
        left: Duration,
        breaker_open: bool,
        /// Budget tokens available.
        tokens: u32,
        want: Decision,
    }

    fn row(name: &'static str, outcome: Outcome, want: Decision) -> Row {
        Row {
            name,
            request: SAFE,
            ended: ended(outcome),
            left: Duration::from_secs(10),
            breaker_open: false,
            tokens: 1,
            want,
        }
    }

    const OPEN_GATES: Gates = Gates {
        breaker_open: false,
        budget_has_token: true,
    };

    const fn skip(reason: SkipReason) -> Decision {
        Decision::Stop(Stop::Skip(reason))
    }

    const fn retry(ms: u64) -> Decision {
        Decision::Retry {
            delay: Duration::from_millis(ms),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn every_stop_reason_and_the_retry() {
        let timeout = Outcome::Upstream(UpstreamFault::Timeout);
        let refused = Outcome::Upstream(UpstreamFault::ConnectFailure);
        let rows = vec![
            row(
                "a success is passed on",
                s(200),
                Decision::Stop(Stop::Answer),
            ),
            row("404 is an answer", s(404), Decision::Stop(Stop::Answer)),
            row("500 is not named", s(500), Decision::Stop(Stop::Answer)),
            row("a 503 is retried", s(503), retry(100)),
            row("a timeout is retried", timeout, retry(100)),
            row(
                "a malformed body is the caller's",
                Outcome::Caller(CallerFault::MalformedBody),
                Decision::Stop(Stop::Caller),
            ),
            row(
                "a hang-up is the caller's",
                Outcome::Caller(CallerFault::Gone),
                Decision::Stop(Stop::Caller),
            ),
            row(
                "a stalled upload is the caller's",
                Outcome::Caller(CallerFault::StalledBody),
                Decision::Stop(Stop::Caller),
            ),
            row(
                "a refused first attempt",
                Outcome::Refused(Refusal::CircuitOpen),
                Decision::Stop(Stop::Refused),
            ),
            row(
                "cut short by the deadline",
                Outcome::Deadline,
                skip(SkipReason::Deadline),
            ),
            Row {
                request: INNER,
                ..row("an outer hop retries", s(503), skip(SkipReason::InnerHop))
            },
            Row {
                ended: Ended {
                    attempt: 3,
                    ..ended(s(503))
                },
                ..row(
                    "out of attempts",
                    s(503),
                    skip(SkipReason::AttemptsExhausted),
                )
            },
            Row {
                request: UNSAFE,
                ..row("POST reached it", s(503), skip(SkipReason::NonIdempotent))
            },
            Row {
                request: UNSAFE,
                ..row("POST never sent", refused, retry(100))
            },
            Row {
                ended: Ended {
                    replayable: false,
                    ..ended(s(503))
                },
                ..row("body not kept", s(503), skip(SkipReason::BodyTooLarge))
            },
            Row {
                ended: Ended {
                    retry_after: Some(Duration::from_secs(60)),
                    ..ended(s(503))
                },
                ..row("asks too long", s(503), skip(SkipReason::RetryAfterTooLong))
            },
            Row {
                ended: Ended {
                    retry_after: Some(Duration::ZERO),
                    ..ended(s(503))
                },
                ..row("Retry-After: 0 is our backoff at least", s(503), retry(100))
            },
            Row {
                left: Duration::from_millis(50),
                ..row(
                    "delay passes the deadline",
                    s(503),
                    skip(SkipReason::Deadline),
                )
            },
            Row {
                // 100 ms of backoff + 1 s (half of per_try_timeout) > 1.05 s.
                left: Duration::from_millis(1050),
                ..row(
                    "too little left after it",
                    s(503),
                    skip(SkipReason::Deadline),
                )
            },
            Row {
                left: Duration::from_millis(1100),
                ..row("just enough left", s(503), retry(100))
            },
            Row {
                breaker_open: true,
                ..row("breaker open", s(503), skip(SkipReason::BreakerOpen))
            },
            Row {
                tokens: 0,
                ..row("budget spent", s(503), skip(SkipReason::Budget))
            },
        ];
        let p = policy();
        let mut rng = SmallRng::seed_from_u64(7);
        for r in rows {
            let got = decide(
                &p,
                &r.request,
                &r.ended,
                r.left,
                Gates {
                    breaker_open: r.breaker_open,
                    budget_has_token: r.tokens > 0,
                },
                &mut BackoffState::default(),
                &mut rng,
            );
            assert_eq!(got, r.want, "{}", r.name);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_server_delay_is_jittered_upward_by_at_most_a_tenth() {
        let p = policy();
        let mut rng = SmallRng::seed_from_u64(1);
        for _ in 0..50 {
            let e = Ended {
                retry_after: Some(Duration::from_secs(2)),
                ..ended(s(503))
            };
            let d = match decide(
                &p,
                &SAFE,
                &e,
                Duration::from_secs(10),
                OPEN_GATES,
                &mut BackoffState::default(),
                &mut rng,
            ) {
                Decision::Retry { delay } => delay,
                other => panic!("{other:?}"),
            };
            assert!(
                (Duration::from_secs(2)..=Duration::from_millis(2200)).contains(&d),
                "{d:?}"
            );
        }
    }

    #[test]
    fn no_time_left_is_a_deadline_skip() {
        let p = policy();
        let got = decide(
            &p,
            &SAFE,
            &ended(s(503)),
            Duration::ZERO,
            OPEN_GATES,
            &mut BackoffState::default(),
            &mut SmallRng::seed_from_u64(0),
        );
        assert_eq!(got, skip(SkipReason::Deadline));
    }

    #[test]
    fn a_hedge_passes_the_same_gates_as_a_retry() {
        let mut c = RetryConfig {
            attempts: 3,
            per_try_timeout: Duration::from_secs(2),
            hedge_after: Some(Duration::from_millis(50)),
            ..RetryConfig::default()
        };
        c.backoff.jitter = Jitter::None;
        let p = Policy::from_config(&c).unwrap();
        let slow = Slow {
            sent: 1,
            probe: false,
            body_whole: true,
        };
        let left = Duration::from_secs(10);
        let hedge = |request: &RequestFacts, slow: Slow, left, gates| {
            hedge(&p, request, &slow, left, gates)
        };
        assert_eq!(
            hedge(&UNSAFE, slow, left, OPEN_GATES),
            None,
            "never for an unsafe request"
        );
        assert_eq!(
            hedge(&INNER, slow, left, OPEN_GATES),
            None,
            "never behind another retrying hop"
        );
        assert_eq!(hedge(&SAFE, slow, left, OPEN_GATES), Some(Ok(())));
        let rows = [
            (
                Slow { sent: 3, ..slow },
                left,
                OPEN_GATES,
                SkipReason::AttemptsExhausted,
            ),
            (
                Slow {
                    body_whole: false,
                    ..slow
                },
                left,
                OPEN_GATES,
                SkipReason::BodyTooLarge,
            ),
            (
                slow,
                Duration::from_millis(900),
                OPEN_GATES,
                SkipReason::Deadline,
            ),
            (
                Slow {
                    probe: true,
                    ..slow
                },
                left,
                OPEN_GATES,
                SkipReason::BreakerOpen,
            ),
            (
                slow,
                left,
                Gates {
                    breaker_open: true,
                    ..OPEN_GATES
                },
                SkipReason::BreakerOpen,
            ),
            (
                slow,
                left,
                Gates {
                    budget_has_token: false,
                    ..OPEN_GATES
                },
                SkipReason::Budget,
            ),
        ];
        for (slow, left, gates, reason) in rows {
            assert_eq!(
                hedge(&SAFE, slow, left, gates),
                Some(Err(reason)),
                "{reason:?}"
            );
        }
    }
}
