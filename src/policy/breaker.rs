//! The circuit breaker of a route: Closed -> Open -> HalfOpen -> Closed.
//!
//! Why: a retry layer must never be what keeps an upstream down. When a
//! route's upstream keeps failing, the breaker stops sending to it at all
//! for a while, answering callers at once with 503 and a jittered
//! Retry-After; then it lets a few probes through and closes only when they
//! succeed. Every attempt — first, retry, probe — asks it first.
//!
//! It trips on `consecutive_failures` in a row, or when `failure_rate` of the
//! attempts in `window` failed once `min_requests` were seen. It stays open
//! for `open_for`, doubled per consecutive trip up to `max_open_for`, times a
//! random factor in [0.75, 1.25) so that a fleet of sidecars does not probe in
//! lockstep. Then it lets `half_open_probes` requests through at a time: when
//! a majority of them succeed it closes, when a majority fail it opens again.
//! Failures are the upstream's own (see `outcome.rs`): 5xx, connect
//! failures, resets and per-try timeouts. A 4xx, a caller that hangs up or
//! sends a bad body, a request cut short by its deadline and the proxy's
//! own shedding are not the upstream failing.
//!
//! A pure state machine: the clock and the randomness are passed in; the
//! route keeps it behind a mutex held for a few instructions.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use rand::Rng;
use tokio::time::Instant;

use crate::policy::settings::BreakerConfig;

use super::outcome::{Fault, Outcome as AttemptOutcome, UpstreamFault};

const SLOTS: usize = 10;

/// How far the wait between trickle probes grows, in doublings of
/// `probe_interval`: to four times, after two `open_for` of outage.
const PROBE_DOUBLINGS: u32 = 2;

/// A trickle probe not heard of for this long no longer holds the next one
/// back (every admitted attempt is recorded; this is a safety net).
const PROBE_LOST: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Closed,
    Open,
    HalfOpen,
}

impl State {
    /// The `herdguard_breaker_state` value.
    pub fn gauge(self) -> f64 {
        match self {
            State::Closed => 0.0,
            State::HalfOpen => 1.0,
            State::Open => 2.0,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            State::Closed => "closed",
            State::Open => "open",
            State::HalfOpen => "half_open",
        }
    }
}

/// Why a breaker could not be built; [`key`](InvalidBreaker::key) names
/// the config key at fault.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InvalidBreaker {
    #[error("must be at least 1")]
    Zero(&'static str),
    #[error("must be at most 1000")]
    TooManyProbes,
    #[error("{0} is out of range (0.0, 1.0]")]
    Rate(f64),
    #[error("must be longer than zero")]
    ZeroDuration(&'static str),
    #[error("must not be below open_for")]
    MaxOpenFor,
}

impl InvalidBreaker {
    pub fn key(&self) -> &'static str {
        match self {
            InvalidBreaker::Zero(key) | InvalidBreaker::ZeroDuration(key) => key,
            InvalidBreaker::Rate(_) => "failure_rate",
            InvalidBreaker::MaxOpenFor => "max_open_for",
            InvalidBreaker::TooManyProbes => "half_open_probes",
        }
    }
}

/// What `admit` answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Go ahead; a half-open probe when `probe` is true.
    Yes { probe: bool },
    /// Open: try again after this long.
    No { retry_after: Duration },
}

/// What happened to an admitted attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Success,
    Failure,
    /// It ended without telling (cancelled, shed): frees a probe slot, counts nothing.
    Unknown,
}

impl Outcome {
    /// What an attempt's outcome counts for: the one mapping from an
    /// outcome to the breaker. Only the upstream's own failures count as
    /// failures; the caller's faults, the deadline's cut and the proxy's
    /// refusals count for nothing (but free a probe slot).
    pub fn of(outcome: AttemptOutcome) -> Self {
        // An upstream closing its keep-alive connections is within HTTP:
        // a request caught by one says nothing of the upstream's health
        // (the outlier state reads it the same way).
        if outcome == AttemptOutcome::Upstream(UpstreamFault::StaleConnection) {
            return Outcome::Unknown;
        }
        match outcome.fault() {
            Fault::None => Outcome::Success,
            Fault::Upstream => Outcome::Failure,
            Fault::Caller | Fault::Deadline | Fault::Proxy => Outcome::Unknown,
        }
    }
}

#[derive(Debug)]
pub struct Breaker {
    consecutive_limit: u32,
    failure_rate: f64,
    min_requests: u32,
    slot_width: Duration,
    open_for: Duration,
    max_open_for: Duration,
    half_open_probes: u32,
    probe_interval: Duration,

    state: State,
    /// While open: when the next trickle probe may go.
    next_probe: Instant,
    /// When the breaker last tripped from closed: the probes slow down as
    /// the outage lasts (see [`Breaker::probe_wait`]).
    outage_start: Instant,
    /// When the trickle probe in flight, if any, went: one at a time, so
    /// that a frozen upstream gets one probe per sidecar, not one per
    /// interval piling up.
    trickle_since: Option<Instant>,
    since: Instant,
    /// Until when the breaker stays open.
    open_until: Instant,
    /// Consecutive trips without closing in between.
    trips: u32,
    consecutive_failures: u32,
    /// Probes let through and not yet answered, and probe results, in HalfOpen.
    probes_in_flight: u32,
    probe_successes: u32,
    probe_failures: u32,
    /// (epoch, successes, failures) per slot of the window.
    slots: [(u64, u32, u32); SLOTS],
    start: Instant,
    /// Set when an operator forced the state; automatic transitions resume on reset.
    forced: bool,
}

/// A state change, to count and log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transition {
    pub to: State,
}

/// What /breakers shows.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Snapshot {
    pub state: &'static str,
    pub since_seconds: f64,
    pub consecutive_failures: u32,
    pub window_requests: u32,
    pub window_failures: u32,
    pub trips: u32,
    pub open_remaining_seconds: f64,
    pub forced: bool,
}

impl Breaker {
    /// Every problem of `c`, not only the first: `check` lists them all.
    pub fn problems(c: &BreakerConfig) -> Vec<InvalidBreaker> {
        let mut found = Vec::new();
        for (key, n) in [
            ("consecutive_failures", c.consecutive_failures),
            ("min_requests", c.min_requests),
            ("half_open_probes", c.half_open_probes),
        ] {
            if n == 0 {
                found.push(InvalidBreaker::Zero(key));
            }
        }
        // More probes than this is no half-open state at all.
        if c.half_open_probes > 1000 {
            found.push(InvalidBreaker::TooManyProbes);
        }
        if !(c.failure_rate > 0.0 && c.failure_rate <= 1.0) {
            found.push(InvalidBreaker::Rate(c.failure_rate));
        }
        for (key, d) in [
            ("window", c.window),
            ("open_for", c.open_for),
            ("probe_interval", c.probe_interval),
        ] {
            if d.is_zero() {
                found.push(InvalidBreaker::ZeroDuration(key));
            }
        }
        if c.max_open_for < c.open_for {
            found.push(InvalidBreaker::MaxOpenFor);
        }
        found
    }

    pub fn try_new(c: &BreakerConfig, now: Instant) -> Result<Self, InvalidBreaker> {
        if let Some(first) = Self::problems(c).into_iter().next() {
            return Err(first);
        }
        Ok(Self {
            consecutive_limit: c.consecutive_failures,
            failure_rate: c.failure_rate,
            min_requests: c.min_requests,
            slot_width: (c.window / SLOTS as u32).max(Duration::from_millis(1)),
            open_for: c.open_for,
            max_open_for: c.max_open_for,
            half_open_probes: c.half_open_probes,
            probe_interval: c.probe_interval,
            state: State::Closed,
            next_probe: now,
            outage_start: now,
            trickle_since: None,
            since: now,
            open_until: now,
            trips: 0,
            consecutive_failures: 0,
            probes_in_flight: 0,
            probe_successes: 0,
            probe_failures: 0,
            slots: [(0, 0, 0); SLOTS],
            start: now,
            forced: false,
        })
    }

    pub fn state(&self) -> State {
        self.state
    }

    /// Takes new thresholds from a reloaded config, keeping the state and
    /// counts (the window's counts are dropped if its length changed).
    pub fn reconfigure(&mut self, c: &BreakerConfig, now: Instant) -> Result<(), InvalidBreaker> {
        self.adopt(&Breaker::try_new(c, now)?, now);
        Ok(())
    }

    /// Takes `fresh`'s thresholds, keeping this breaker's state (its window
    /// starts over if its width changed).
    pub fn adopt(&mut self, fresh: &Breaker, now: Instant) {
        if fresh.slot_width != self.slot_width {
            self.slots = [(0, 0, 0); SLOTS];
            self.start = now;
            self.slot_width = fresh.slot_width;
        }
        self.consecutive_limit = fresh.consecutive_limit;
        self.failure_rate = fresh.failure_rate;
        self.min_requests = fresh.min_requests;
        self.open_for = fresh.open_for;
        self.max_open_for = fresh.max_open_for;
        self.half_open_probes = fresh.half_open_probes;
        self.probe_interval = fresh.probe_interval;
    }

    /// May an attempt go now? Moves Open to HalfOpen once the open time is over.
    pub fn admit<R: Rng + ?Sized>(
        &mut self,
        now: Instant,
        rng: &mut R,
    ) -> (Admit, Option<Transition>) {
        match self.state {
            State::Closed => (Admit::Yes { probe: false }, None),
            // While open, a trickle of probes: one at a time, one per
            // `probe_interval` at first, jittered, so that a recovered
            // upstream is found in about a second, not after the whole open
            // time.
            State::Open
                if !self.forced
                    && now < self.open_until
                    && now >= self.next_probe
                    && self
                        .trickle_since
                        .is_none_or(|at| now.saturating_duration_since(at) >= PROBE_LOST) =>
            {
                self.next_probe = now + self.probe_wait(now, rng);
                self.trickle_since = Some(now);
                (Admit::Yes { probe: true }, None)
            }
            State::Open if self.forced || now < self.open_until => {
                let remaining = self.open_until.saturating_duration_since(now);
                // Spread the callers we turn away, too.
                let spread = remaining + Duration::from_millis(rng.random_range(0..=1000));
                (
                    Admit::No {
                        retry_after: spread,
                    },
                    None,
                )
            }
            State::Open => {
                let t = self.enter(State::HalfOpen, now);
                let _ = self.admit_probe(now, rng);
                (Admit::Yes { probe: true }, t)
            }
            State::HalfOpen => self.admit_probe(now, rng),
        }
    }

    fn admit_probe<R: Rng + ?Sized>(
        &mut self,
        _now: Instant,
        rng: &mut R,
    ) -> (Admit, Option<Transition>) {
        if self.probes_in_flight < self.half_open_probes {
            self.probes_in_flight += 1;
            (Admit::Yes { probe: true }, None)
        } else {
            let retry_after = Duration::from_millis(rng.random_range(500..=1500));
            (Admit::No { retry_after }, None)
        }
    }

    /// Records how an admitted attempt ended.
    pub fn record<R: Rng + ?Sized>(
        &mut self,
        now: Instant,
        probe: bool,
        outcome: Outcome,
        rng: &mut R,
    ) -> Option<Transition> {
        if probe && self.state == State::HalfOpen {
            self.probes_in_flight = self.probes_in_flight.saturating_sub(1);
        }
        if probe && self.state == State::Open {
            self.trickle_since = None;
        }
        if outcome == Outcome::Unknown {
            return None;
        }
        let failed = outcome == Outcome::Failure;
        self.count(now, failed);
        if self.forced {
            return None;
        }
        match self.state {
            State::Closed => {
                if failed {
                    self.consecutive_failures += 1;
                    if self.consecutive_failures >= self.consecutive_limit
                        || self.rate_exceeded(now)
                    {
                        return self.trip(now, rng);
                    }
                } else {
                    self.consecutive_failures = 0;
                }
                None
            }
            // A trickle probe that succeeds half-opens the breaker at once
            // (and closes it, when one probe is a majority); one that fails
            // changes nothing: the breaker stays open.
            State::Open if probe && failed => None,
            State::Open if probe && !failed => {
                let t = self.enter(State::HalfOpen, now);
                self.probe_successes = 1;
                if self.probe_successes > self.half_open_probes / 2 {
                    self.trips = 0;
                    return self.enter(State::Closed, now);
                }
                t
            }
            // A majority of the probes decides: an upstream that is back but
            // still fails now and then is not sent back to Open by one failure.
            State::HalfOpen if probe => {
                let majority = self.half_open_probes / 2 + 1;
                if failed {
                    self.probe_failures += 1;
                    if self.probe_failures >= majority {
                        return self.trip(now, rng);
                    }
                } else {
                    self.probe_successes += 1;
                    if self.probe_successes >= majority {
                        self.trips = 0;
                        return self.enter(State::Closed, now);
                    }
                }
                None
            }
            // Late answers of attempts admitted before a state change.
            _ => None,
        }
    }

    /// Operator overrides: open (held until reset), close (held until reset), reset.
    pub fn force(&mut self, now: Instant, state: Option<State>) -> Option<Transition> {
        match state {
            Some(State::Open) => {
                self.forced = true;
                self.open_until = now;
                self.enter(State::Open, now)
            }
            Some(State::Closed) | Some(State::HalfOpen) => {
                self.forced = true;
                self.enter(State::Closed, now)
            }
            None => {
                self.forced = false;
                self.trips = 0;
                self.slots = [(0, 0, 0); SLOTS];
                self.enter(State::Closed, now)
            }
        }
    }

    pub fn snapshot(&self, now: Instant) -> Snapshot {
        let (requests, failures) = self.window(now);
        Snapshot {
            state: self.state.as_str(),
            since_seconds: now.saturating_duration_since(self.since).as_secs_f64(),
            consecutive_failures: self.consecutive_failures,
            window_requests: requests,
            window_failures: failures,
            trips: self.trips,
            open_remaining_seconds: match self.state {
                State::Open => self.open_until.saturating_duration_since(now).as_secs_f64(),
                _ => 0.0,
            },
            forced: self.forced,
        }
    }

    /// The wait before the next trickle probe, jittered ±50%:
    /// `probe_interval` for the first `open_for` of an outage (most are
    /// short: a resumed upstream is found within a few hundred ms), then
    /// doubled per `open_for` it lasts, up to four times (a long outage is
    /// fed one probe a second per route and sidecar, at the default 250 ms;
    /// with the jitter a fleet's probes do not line up).
    fn probe_wait<R: Rng + ?Sized>(&self, now: Instant, rng: &mut R) -> Duration {
        let lasted = now.saturating_duration_since(self.outage_start);
        let spells = lasted.as_nanos() / self.open_for.as_nanos().max(1);
        let doublings = u32::try_from(spells)
            .unwrap_or(u32::MAX)
            .min(PROBE_DOUBLINGS);
        self.probe_interval
            .saturating_mul(1 << doublings)
            .mul_f64(rng.random_range(0.5..1.5))
    }

    /// How long the next trip keeps the breaker open, before jitter.
    pub fn open_time(&self, trip: u32) -> Duration {
        let doublings = trip.saturating_sub(1).min(32);
        self.open_for
            .saturating_mul(1u32 << doublings.min(31))
            .min(self.max_open_for)
    }

    fn trip<R: Rng + ?Sized>(&mut self, now: Instant, rng: &mut R) -> Option<Transition> {
        self.trips = self.trips.saturating_add(1);
        let base = self.open_time(self.trips);
        let factor: f64 = rng.random_range(0.75..1.25);
        let open = base.mul_f64(factor).min(self.max_open_for.mul_f64(1.25));
        self.open_until = now + open;
        if self.trips == 1 {
            self.outage_start = now;
        }
        self.next_probe = now + self.probe_wait(now, rng);
        self.enter(State::Open, now)
    }

    fn enter(&mut self, state: State, now: Instant) -> Option<Transition> {
        self.consecutive_failures = 0;
        self.trickle_since = None;
        self.probes_in_flight = 0;
        self.probe_successes = 0;
        self.probe_failures = 0;
        if state == State::Closed {
            self.slots = [(0, 0, 0); SLOTS];
        }
        if self.state == state {
            return None;
        }
        self.state = state;
        self.since = now;
        Some(Transition { to: state })
    }

    fn index(&self, now: Instant) -> u64 {
        (now.saturating_duration_since(self.start).as_nanos() / self.slot_width.as_nanos()) as u64
    }

    fn count(&mut self, now: Instant, failed: bool) {
        let index = self.index(now);
        let slot = &mut self.slots[(index % SLOTS as u64) as usize];
        if slot.0 != index {
            *slot = (index, 0, 0);
        }
        if failed {
            slot.2 += 1;
        } else {
            slot.1 += 1;
        }
    }

    fn window(&self, now: Instant) -> (u32, u32) {
        let current = self.index(now);
        self.slots
            .iter()
            .filter(|(epoch, _, _)| *epoch <= current && epoch + SLOTS as u64 > current)
            .fold((0, 0), |(r, f), (_, s, fl)| (r + s + fl, f + fl))
    }

    fn rate_exceeded(&self, now: Instant) -> bool {
        let (requests, failures) = self.window(now);
        requests >= self.min_requests
            && f64::from(failures) >= self.failure_rate * f64::from(requests)
    }
}

/// A route's breaker, shared by its requests: the state machine behind a
/// mutex, plus whether it is closed, readable without the lock. The common
/// case — a closed breaker admitting an attempt — is one atomic load.
#[derive(Debug)]
pub struct SharedBreaker {
    inner: Mutex<Breaker>,
    closed: AtomicBool,
}

impl SharedBreaker {
    pub fn new(breaker: Breaker) -> Self {
        let closed = AtomicBool::new(breaker.state() == State::Closed);
        Self {
            inner: Mutex::new(breaker),
            closed,
        }
    }

    /// Runs `f` on the breaker under its lock, and keeps the closed flag current.
    pub fn with<R>(&self, f: impl FnOnce(&mut Breaker) -> R) -> R {
        // The state stays consistent even if a holder panicked.
        let mut breaker = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let result = f(&mut breaker);
        self.closed
            .store(breaker.state() == State::Closed, Ordering::Release);
        result
    }

    /// Closed admits every attempt: no lock, no clock, no randomness needed.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::SmallRng;
    use rand::SeedableRng;

    fn config() -> BreakerConfig {
        BreakerConfig {
            consecutive_failures: 3,
            failure_rate: 0.5,
            min_requests: 10,
            window: Duration::from_secs(10),
            open_for: Duration::from_secs(5),
            max_open_for: Duration::from_secs(60),
            half_open_probes: 2,
            // Out of the way of the open-time tests; see the trickle test.
            probe_interval: Duration::from_secs(3600),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_open_breaker_probes_often_at_first_then_slower_per_failed_probe_and_half_opens_on_success(
    ) {
        let c = BreakerConfig {
            probe_interval: Duration::from_millis(250),
            consecutive_failures: 1,
            open_for: Duration::from_secs(2),
            max_open_for: Duration::from_secs(60),
            ..config()
        };
        let (mut b, mut r) = (Breaker::try_new(&c, Instant::now()).unwrap(), rng());
        let t0 = Instant::now();
        b.record(t0, false, Outcome::Failure, &mut r);
        assert_eq!(b.state(), State::Open);
        // Callers every 10 ms for 12 s against an upstream that stays down:
        // every probe fails, and the breaker re-opens for longer each time.
        let mut trickle = Vec::new();
        for i in 0..1200 {
            let now = t0 + Duration::from_millis(10 * i);
            let before = b.state();
            if let (Admit::Yes { probe: true }, _) = b.admit(now, &mut r) {
                let is_trickle = before == State::Open && b.state() == State::Open;
                b.record(now, true, Outcome::Failure, &mut r);
                if is_trickle {
                    trickle.push(now - t0);
                    assert_eq!(b.state(), State::Open, "a failed probe keeps it open");
                }
            }
        }
        let within = |from: u64, to: u64| {
            trickle
                .iter()
                .filter(|t| **t >= Duration::from_secs(from) && **t < Duration::from_secs(to))
                .count()
        };
        // The first open_for: one probe per 250 ms ± 50%.
        let early = within(0, 2);
        assert!(
            (5..=16).contains(&early),
            "{early} probes in the first 2 s: {trickle:?}"
        );
        // After two open_for of outage: one per second ± 50%.
        let late = within(6, 12);
        assert!(
            (4..=12).contains(&late),
            "{late} probes from 6 s to 12 s: {trickle:?}"
        );
        assert!(
            trickle
                .windows(2)
                .all(|w| w[1] - w[0] >= Duration::from_millis(120)),
            "{trickle:?}"
        );
        // The upstream is back: the next probe half-opens, and with two
        // probes a majority, one more success closes it.
        let later = b.next_probe;
        assert_eq!(b.admit(later, &mut r).0, Admit::Yes { probe: true });
        assert_eq!(
            b.record(later, true, Outcome::Success, &mut r),
            Some(Transition {
                to: State::HalfOpen
            })
        );
        assert_eq!(b.admit(later, &mut r).0, Admit::Yes { probe: true });
        assert_eq!(
            b.record(later, true, Outcome::Success, &mut r),
            Some(Transition { to: State::Closed })
        );
    }

    fn rng() -> SmallRng {
        SmallRng::seed_from_u64(9)
    }

    #[tokio::test(start_paused = true)]
    async fn trips_on_consecutive_failures_and_recovers_through_half_open() {
        let (mut b, mut r) = (Breaker::try_new(&config(), Instant::now()).unwrap(), rng());
        let now = Instant::now();
        for _ in 0..2 {
            assert_eq!(b.record(now, false, Outcome::Failure, &mut r), None);
        }
        assert_eq!(
            b.record(now, false, Outcome::Success, &mut r),
            None,
            "a success breaks the run"
        );
        for _ in 0..2 {
            b.record(now, false, Outcome::Failure, &mut r);
        }
        assert_eq!(
            b.record(now, false, Outcome::Failure, &mut r),
            Some(Transition { to: State::Open })
        );
        let (admit, _) = b.admit(now, &mut r);
        let Admit::No { retry_after } = admit else {
            panic!("open admits nothing")
        };
        assert!(
            retry_after >= Duration::from_millis(3750)
                && retry_after <= Duration::from_millis(7250)
        );

        tokio::time::advance(Duration::from_secs(7)).await;
        let now = Instant::now();
        assert_eq!(
            b.admit(now, &mut r),
            (
                Admit::Yes { probe: true },
                Some(Transition {
                    to: State::HalfOpen
                })
            )
        );
        assert_eq!(b.admit(now, &mut r).0, Admit::Yes { probe: true });
        assert!(
            matches!(b.admit(now, &mut r).0, Admit::No { .. }),
            "only half_open_probes at once"
        );
        // Two probes: a majority is both.
        assert_eq!(
            b.record(now, true, Outcome::Failure, &mut r),
            None,
            "one failure of two is no majority"
        );
        assert_eq!(b.record(now, true, Outcome::Success, &mut r), None);
        assert_eq!(
            b.admit(now, &mut r).0,
            Admit::Yes { probe: true },
            "answered probe slots are free again"
        );
        assert_eq!(
            b.record(now, true, Outcome::Success, &mut r),
            Some(Transition { to: State::Closed })
        );
        assert_eq!(b.admit(now, &mut r).0, Admit::Yes { probe: false });
    }

    #[tokio::test(start_paused = true)]
    async fn one_trickle_probe_at_a_time() {
        let c = BreakerConfig {
            probe_interval: Duration::from_millis(250),
            consecutive_failures: 1,
            ..config()
        };
        let (mut b, mut r) = (Breaker::try_new(&c, Instant::now()).unwrap(), rng());
        let t0 = Instant::now();
        b.record(t0, false, Outcome::Failure, &mut r);
        let first = b.next_probe;
        assert_eq!(b.admit(first, &mut r).0, Admit::Yes { probe: true });
        // A frozen upstream: the probe hangs. Later callers are refused,
        // however long after the interval they come.
        for ms in [400, 1000, 3000] {
            let now = first + Duration::from_millis(ms);
            assert!(
                matches!(b.admit(now, &mut r).0, Admit::No { .. }),
                "{ms} ms"
            );
        }
        // Its timeout comes back: the next probe may go.
        let back = first + Duration::from_secs(3);
        b.record(back, true, Outcome::Failure, &mut r);
        let next = b.next_probe.max(back);
        assert_eq!(b.admit(next, &mut r).0, Admit::Yes { probe: true });
        // A probe that ends without telling (its caller left) frees the turn.
        b.record(next, true, Outcome::Unknown, &mut r);
        let after = b.next_probe.max(next);
        assert_eq!(b.admit(after, &mut r).0, Admit::Yes { probe: true });
        assert_eq!(b.state(), State::Open);
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_probe_reopens_for_longer() {
        let (mut b, mut r) = (Breaker::try_new(&config(), Instant::now()).unwrap(), rng());
        for _ in 0..3 {
            b.record(Instant::now(), false, Outcome::Failure, &mut r);
        }
        assert_eq!(b.state(), State::Open);
        tokio::time::advance(Duration::from_secs(7)).await;
        assert_eq!(
            b.admit(Instant::now(), &mut r).0,
            Admit::Yes { probe: true }
        );
        assert_eq!(
            b.record(Instant::now(), true, Outcome::Failure, &mut r),
            None
        );
        assert_eq!(
            b.record(Instant::now(), true, Outcome::Failure, &mut r),
            Some(Transition { to: State::Open })
        );
        let remaining = b.snapshot(Instant::now()).open_remaining_seconds;
        assert!(
            (7.5..12.5).contains(&remaining),
            "second trip opens for 10s +-25%: {remaining}"
        );
        assert_eq!(b.snapshot(Instant::now()).trips, 2);
    }

    #[tokio::test(start_paused = true)]
    async fn cancelled_probe_frees_its_slot() {
        let (mut b, mut r) = (Breaker::try_new(&config(), Instant::now()).unwrap(), rng());
        for _ in 0..3 {
            b.record(Instant::now(), false, Outcome::Failure, &mut r);
        }
        tokio::time::advance(Duration::from_secs(7)).await;
        let now = Instant::now();
        b.admit(now, &mut r);
        b.admit(now, &mut r);
        assert!(matches!(b.admit(now, &mut r).0, Admit::No { .. }));
        b.record(now, true, Outcome::Unknown, &mut r);
        assert_eq!(b.admit(now, &mut r).0, Admit::Yes { probe: true });
    }

    #[tokio::test(start_paused = true)]
    async fn trips_on_failure_rate_once_min_requests_seen() {
        let c = BreakerConfig {
            consecutive_failures: 100,
            ..config()
        };
        let (mut b, mut r) = (Breaker::try_new(&c, Instant::now()).unwrap(), rng());
        let now = Instant::now();
        // Alternate: 50% failures, never two in a row.
        for i in 0..9 {
            let outcome = if i % 2 == 0 {
                Outcome::Failure
            } else {
                Outcome::Success
            };
            assert_eq!(
                b.record(now, false, outcome, &mut r),
                None,
                "not before min_requests"
            );
        }
        assert_eq!(
            b.record(now, false, Outcome::Success, &mut r),
            None,
            "5 of 10 failed but this one succeeded"
        );
        assert_eq!(
            b.record(now, false, Outcome::Failure, &mut r),
            Some(Transition { to: State::Open })
        );
    }

    #[tokio::test(start_paused = true)]
    async fn old_failures_leave_the_window() {
        let c = BreakerConfig {
            consecutive_failures: 100,
            min_requests: 4,
            ..config()
        };
        let (mut b, mut r) = (Breaker::try_new(&c, Instant::now()).unwrap(), rng());
        for _ in 0..3 {
            b.record(Instant::now(), false, Outcome::Failure, &mut r);
        }
        tokio::time::advance(Duration::from_secs(11)).await;
        assert_eq!(
            b.record(Instant::now(), false, Outcome::Failure, &mut r),
            None,
            "the old three slid out"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn open_time_doubles_and_is_capped_and_jittered() {
        let b = Breaker::try_new(&config(), Instant::now()).unwrap();
        let secs: Vec<u64> = (1..=6).map(|t| b.open_time(t).as_secs()).collect();
        assert_eq!(secs, [5, 10, 20, 40, 60, 60]);
        assert_eq!(b.open_time(u32::MAX).as_secs(), 60);
        // The jittered open time stays within [0.75, 1.25) of the base and varies.
        let mut seen = std::collections::HashSet::new();
        for seed in 0..200 {
            let mut b = Breaker::try_new(&config(), Instant::now()).unwrap();
            let mut r = SmallRng::seed_from_u64(seed);
            for _ in 0..3 {
                b.record(Instant::now(), false, Outcome::Failure, &mut r);
            }
            let open = b.snapshot(Instant::now()).open_remaining_seconds;
            assert!((3.75..6.25).contains(&open), "{open}");
            seen.insert((open * 10.0) as u64);
        }
        assert!(
            seen.len() > 20,
            "open times are spread, not equal: {}",
            seen.len()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn forced_states_hold_until_reset() {
        let (mut b, mut r) = (Breaker::try_new(&config(), Instant::now()).unwrap(), rng());
        assert_eq!(
            b.force(Instant::now(), Some(State::Open)),
            Some(Transition { to: State::Open })
        );
        tokio::time::advance(Duration::from_secs(600)).await;
        assert!(
            matches!(b.admit(Instant::now(), &mut r).0, Admit::No { .. }),
            "forced open holds"
        );
        b.force(Instant::now(), Some(State::Closed));
        for _ in 0..10 {
            b.record(Instant::now(), false, Outcome::Failure, &mut r);
        }
        assert_eq!(b.state(), State::Closed, "forced closed holds");
        b.force(Instant::now(), None);
        for _ in 0..3 {
            b.record(Instant::now(), false, Outcome::Failure, &mut r);
        }
        assert_eq!(b.state(), State::Open, "automatic again after reset");
    }

    #[tokio::test(start_paused = true)]
    async fn the_closed_flag_follows_every_change() {
        let mut r = rng();
        let shared = SharedBreaker::new(Breaker::try_new(&config(), Instant::now()).unwrap());
        assert!(shared.is_closed());
        for _ in 0..3 {
            shared.with(|b| b.record(Instant::now(), false, Outcome::Failure, &mut r));
        }
        assert!(!shared.is_closed(), "tripped");
        tokio::time::advance(Duration::from_secs(7)).await;
        shared.with(|b| b.admit(Instant::now(), &mut r));
        assert!(!shared.is_closed(), "half-open is not closed");
        for _ in 0..2 {
            shared.with(|b| b.record(Instant::now(), true, Outcome::Success, &mut r));
        }
        assert!(shared.is_closed(), "closed again");
        shared.with(|b| b.force(Instant::now(), Some(State::Open)));
        assert!(!shared.is_closed(), "forced open");
        shared.with(|b| b.force(Instant::now(), None));
        assert!(shared.is_closed(), "reset");
    }
}
