//! Outlier ejection: one failing endpoint is taken out of rotation, not the
//! whole upstream.
//!
//! Why: with two endpoints and one of them answering 503 to everything,
//! round robin sends it every other request; the route's failure rate
//! passes the breaker's threshold and the breaker blacks out the healthy
//! endpoint too. So each endpoint keeps its own count, and one that fails
//! `consecutive_failures` times in a row, or `failure_rate` of its attempts
//! in `window` once it has seen `min_requests`, is ejected: no first attempt
//! and no retry goes to it for `ejection_time`, doubled per ejection in a row
//! up to `max_ejection_time`, times a random factor in [0.5, 1.5) so that a
//! fleet of sidecars does not probe in lockstep. Then one probe goes to it;
//! it serves again when the probe succeeds and is ejected for longer when
//! the probe fails. A probe is a request that may be retried on another
//! endpoint if it fails; only when no such request has come for another
//! ejection time does a request that cannot be retried probe.
//!
//! Narrow: at most `max_ejected` (a share, at least one endpoint) of an
//! upstream's endpoints are out at once; when every endpoint is out (a share
//! of 1.0 allows it) traffic goes to all of them ("panic mode") rather than
//! nowhere, and the route's breaker is what protects the upstream. An
//! upstream with one endpoint never ejects it.
//!
//! Failures are the upstream's own, as the breaker counts them (5xx,
//! connect failures, resets, per-try timeouts, bad responses); a stale
//! pooled connection, the caller's faults and the deadline's cut count for
//! nothing. A pure state machine: the clock and the randomness are passed in.

use std::time::Duration;

use rand::Rng;
use tokio::time::Instant;

use crate::policy::settings::OutlierConfig;

use super::outcome::{Fault, Outcome, UpstreamFault};

/// Answers an endpoint must have given before its latency is compared.
const SLOW_SAMPLES: u32 = 10;

/// An endpoint is never slow below this: at loopback latencies a factor
/// of five is noise.
const SLOW_FLOOR: f64 = 0.025;

/// Why outlier rules could not be built; [`key`](InvalidOutlier::key) names
/// the config key at fault.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InvalidOutlier {
    #[error("must be at least 1")]
    Zero(&'static str),
    #[error("{1} is out of range (0.0, 1.0]")]
    Share(&'static str, f64),
    #[error("must be longer than zero")]
    ZeroDuration(&'static str),
    #[error("must not be below ejection_time")]
    MaxEjectionTime,
    #[error("{0} must be 0 (off) or from 1.5")]
    SlowFactor(f64),
}

impl InvalidOutlier {
    pub fn key(&self) -> &'static str {
        match self {
            InvalidOutlier::Zero(key)
            | InvalidOutlier::Share(key, _)
            | InvalidOutlier::ZeroDuration(key) => key,
            InvalidOutlier::MaxEjectionTime => "max_ejection_time",
            InvalidOutlier::SlowFactor(_) => "slow_factor",
        }
    }
}

/// What an attempt's outcome counts for in its endpoint's health.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Success,
    Failure,
    /// Nobody learnt anything about the endpoint.
    Neutral,
}

impl Verdict {
    /// The one mapping from an outcome to an endpoint's health: the
    /// upstream's faults fail it, an answer below 500 clears it, and what
    /// is not the endpoint's doing — the caller's faults, the deadline, the
    /// proxy's refusals, a pooled connection found stale (the keep-alive
    /// race, retried on a fresh connection) — counts for nothing.
    pub fn of(outcome: Outcome) -> Self {
        match (outcome, outcome.fault()) {
            (Outcome::Upstream(UpstreamFault::StaleConnection), _) => Verdict::Neutral,
            (_, Fault::None) => Verdict::Success,
            (_, Fault::Upstream) => Verdict::Failure,
            (_, Fault::Caller | Fault::Deadline | Fault::Proxy) => Verdict::Neutral,
        }
    }
}

/// The state of one endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Serving,
    /// Out of rotation until `until`; `length` is how long it was out for.
    Ejected {
        until: Instant,
        length: Duration,
    },
    /// One probe is in flight to it.
    Probing,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::Serving => "serving",
            State::Ejected { .. } => "ejected",
            State::Probing => "probing",
        }
    }
}

#[derive(Debug, Clone)]
struct Health {
    state: State,
    consecutive: u32,
    window_start: Instant,
    requests: u32,
    failures: u32,
    /// Ejections in a row: each doubles the next ejection's length.
    strikes: u32,
    /// When it last came back into rotation.
    returned: Option<Instant>,
    ejections: u64,
    /// Time to answer, moving average (seconds), and answers it is made of.
    latency: f64,
    samples: u32,
}

impl Health {
    fn new(now: Instant) -> Self {
        Self {
            state: State::Serving,
            consecutive: 0,
            window_start: now,
            requests: 0,
            failures: 0,
            strikes: 0,
            returned: None,
            ejections: 0,
            latency: 0.0,
            samples: 0,
        }
    }

    fn reset_counts(&mut self, now: Instant) {
        self.consecutive = 0;
        self.window_start = now;
        self.requests = 0;
        self.failures = 0;
    }
}

/// Which endpoint an attempt goes to, and as what.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pick {
    pub index: usize,
    pub kind: PickKind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PickKind {
    /// An endpoint in rotation.
    Serving,
    /// The one probe of an ejected endpoint whose time is up: its outcome
    /// brings the endpoint back or ejects it for longer.
    Probe,
    /// Every endpoint is out: any of them, rather than none.
    Panic,
}

impl PickKind {
    /// The mark in the explain trace, if any.
    pub fn note(self) -> Option<&'static str> {
        match self {
            PickKind::Serving => None,
            PickKind::Probe => Some("probe"),
            PickKind::Panic => Some("panic"),
        }
    }
}

/// An endpoint going out of or back into rotation, to count and log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    Ejected {
        index: usize,
        length: Duration,
        why: Why,
    },
    Returned {
        index: usize,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    Consecutive,
    FailureRate,
    ProbeFailed,
    /// Its answers take `slow_factor` times as long as the others'.
    Slow,
}

impl Why {
    pub fn as_str(self) -> &'static str {
        match self {
            Why::Consecutive => "consecutive failures",
            Why::FailureRate => "failure rate",
            Why::ProbeFailed => "probe failed",
            Why::Slow => "slow",
        }
    }
}

/// What /breakers shows of one endpoint.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Snapshot {
    pub state: &'static str,
    pub consecutive_failures: u32,
    pub window_requests: u32,
    pub window_failures: u32,
    pub ejections: u64,
    /// While ejected: seconds until it is probed.
    pub ejected_remaining_seconds: f64,
}

/// The endpoints of one upstream and their health.
#[derive(Debug)]
pub struct Outliers {
    enabled: bool,
    consecutive_limit: u32,
    failure_rate: f64,
    min_requests: u32,
    window: Duration,
    ejection_time: Duration,
    max_ejection_time: Duration,
    /// Endpoints that may be out at once.
    max_out: usize,
    /// An endpoint this many times slower than the others' median is out.
    slow_factor: f64,
    endpoints: Box<[Health]>,
    /// Endpoints out of rotation now (ejected or probing).
    out: usize,
}

impl Outliers {
    pub fn try_new(
        c: &OutlierConfig,
        endpoints: usize,
        now: Instant,
    ) -> Result<Self, InvalidOutlier> {
        for (key, n) in [
            ("consecutive_failures", c.consecutive_failures),
            ("min_requests", c.min_requests),
        ] {
            if n == 0 {
                return Err(InvalidOutlier::Zero(key));
            }
        }
        for (key, share) in [
            ("failure_rate", c.failure_rate),
            ("max_ejected", c.max_ejected),
        ] {
            if !(share > 0.0 && share <= 1.0) {
                return Err(InvalidOutlier::Share(key, share));
            }
        }
        for (key, d) in [("window", c.window), ("ejection_time", c.ejection_time)] {
            if d.is_zero() {
                return Err(InvalidOutlier::ZeroDuration(key));
            }
        }
        if c.max_ejection_time < c.ejection_time {
            return Err(InvalidOutlier::MaxEjectionTime);
        }
        if !(c.slow_factor == 0.0 || (c.slow_factor >= 1.5 && c.slow_factor.is_finite())) {
            return Err(InvalidOutlier::SlowFactor(c.slow_factor));
        }
        // The share is of at most a few thousand endpoints: exact in f64.
        let max_out =
            ((endpoints as f64 * c.max_ejected).floor() as usize).clamp(1, endpoints.max(1));
        Ok(Self {
            // One endpoint has nowhere else to send its traffic.
            enabled: c.enabled && endpoints > 1,
            consecutive_limit: c.consecutive_failures,
            failure_rate: c.failure_rate,
            min_requests: c.min_requests,
            window: c.window,
            ejection_time: c.ejection_time,
            max_ejection_time: c.max_ejection_time,
            max_out,
            slow_factor: c.slow_factor,
            endpoints: (0..endpoints).map(|_| Health::new(now)).collect(),
            out: 0,
        })
    }

    /// As [`try_new`](Self::try_new) for a new set of endpoints, each
    /// keeping the health it had in `previous` at the index `kept` gives
    /// (an address still resolved), the others new.
    pub fn carried(
        c: &OutlierConfig,
        kept: &[Option<usize>],
        previous: Option<&Outliers>,
        now: Instant,
    ) -> Result<Self, InvalidOutlier> {
        let mut o = Self::try_new(c, kept.len(), now)?;
        if let Some(previous) = previous {
            for (health, k) in o.endpoints.iter_mut().zip(kept) {
                if let Some(h) = k.and_then(|k| previous.endpoints.get(k)) {
                    *health = h.clone();
                }
            }
        }
        o.out = o
            .endpoints
            .iter()
            .filter(|h| h.state != State::Serving)
            .count();
        Ok(o)
    }

    /// Whether any endpoint is out of rotation (a fast path for the pick).
    pub fn any_out(&self) -> bool {
        self.out > 0
    }

    pub fn state(&self, index: usize) -> Option<State> {
        self.endpoints.get(index).map(|h| h.state)
    }

    /// The endpoint for an attempt. `turn` is the upstream's round-robin
    /// counter; `previous` the endpoint of the request's last attempt (a
    /// retry goes elsewhere when it can); `retryable` whether the request
    /// may be retried if this attempt fails (only such requests probe, but
    /// see the module's doc).
    pub fn pick(
        &mut self,
        now: Instant,
        turn: usize,
        previous: Option<usize>,
        retryable: bool,
        breaker_probe: bool,
    ) -> Pick {
        let len = self.endpoints.len();
        if len <= 1 {
            return Pick {
                index: 0,
                kind: PickKind::Serving,
            };
        }
        // A first attempt takes its turn; a retry the endpoint after the one
        // that failed, so the rotation of first attempts does not shift.
        let start = match previous {
            Some(p) => (p % len) + 1,
            None => turn,
        };
        let order = (0..len).map(|k| (start + k) % len);
        // The route's breaker probes an upstream it holds failing: every
        // endpoint in turn, ejected or not. After an outage of them all, the
        // one that healed first may be one that was ejected.
        if breaker_probe && self.out > 0 {
            let index = order
                .clone()
                .find(|&i| Some(i) != previous && self.endpoints[i].state != State::Probing)
                .unwrap_or(start % len);
            let h = &mut self.endpoints[index];
            let kind = match h.state {
                State::Serving => PickKind::Serving,
                State::Probing => PickKind::Panic,
                State::Ejected { .. } => {
                    h.state = State::Probing;
                    PickKind::Probe
                }
            };
            return Pick { index, kind };
        }
        if self.out > 0 {
            let due = order.clone().find(|&i| {
                Some(i) != previous
                    && match self.endpoints[i].state {
                        State::Ejected { until, length } => {
                            // Requests that cannot be retried probe only
                            // when no retryable one came for another
                            // ejection time.
                            now >= until && (retryable || now >= until + length)
                        }
                        _ => false,
                    }
            });
            if let Some(index) = due {
                self.endpoints[index].state = State::Probing;
                return Pick {
                    index,
                    kind: PickKind::Probe,
                };
            }
        }
        // Round robin over the endpoints in rotation, so that an ejected
        // endpoint's share is spread over all of them, not handed to the
        // next in line.
        let serving = |i: &usize| self.endpoints[*i].state == State::Serving;
        let count = (0..len).filter(serving).count();
        if count > 0 {
            let index = match previous {
                // A retry: the serving endpoint after the one that failed
                // (never it, when another serves).
                Some(_) => order.clone().find(|i| serving(i)),
                None => (0..len).filter(serving).nth(turn % count),
            };
            if let Some(index) = index {
                return Pick {
                    index,
                    kind: PickKind::Serving,
                };
            }
        }
        let index = order
            .clone()
            .find(|&i| Some(i) != previous)
            .unwrap_or(start % len);
        Pick {
            index,
            kind: PickKind::Panic,
        }
    }

    /// Records how an attempt to endpoint `index`, picked as `kind`, ended.
    pub fn record<R: Rng + ?Sized>(
        &mut self,
        now: Instant,
        index: usize,
        kind: PickKind,
        verdict: Verdict,
        latency: Option<Duration>,
        rng: &mut R,
    ) -> Option<Event> {
        if !self.enabled {
            return None;
        }
        let latency = latency.map(|l| l.as_secs_f64());
        // A probe answered, but as slowly as what got the endpoint out.
        let slow_probe = kind == PickKind::Probe
            && verdict == Verdict::Success
            && latency.is_some_and(|l| self.slower_than_the_rest(index, l));
        let h = self.endpoints.get_mut(index)?;
        match (h.state, kind) {
            (State::Probing, PickKind::Probe) if slow_probe => {
                Some(self.eject(now, index, Why::Slow, rng))
            }
            (State::Probing, PickKind::Probe) => match verdict {
                Verdict::Success => {
                    h.state = State::Serving;
                    h.returned = Some(now);
                    h.reset_counts(now);
                    h.samples = 0;
                    self.out = self.out.saturating_sub(1);
                    Some(Event::Returned { index })
                }
                Verdict::Failure => Some(self.eject(now, index, Why::ProbeFailed, rng)),
                // The probe told nothing: the endpoint is due again.
                Verdict::Neutral => {
                    h.state = State::Ejected {
                        until: now,
                        length: Duration::ZERO,
                    };
                    None
                }
            },
            (State::Serving, _) => {
                if now.saturating_duration_since(h.window_start) >= self.window {
                    h.reset_counts(now);
                }
                match verdict {
                    Verdict::Neutral => return None,
                    Verdict::Success => {
                        h.consecutive = 0;
                        h.requests = h.requests.saturating_add(1);
                        let l = latency?;
                        h.latency = match h.samples {
                            0 => l,
                            _ => h.latency * 0.9 + l * 0.1,
                        };
                        h.samples = h.samples.saturating_add(1);
                        let average = h.latency;
                        if h.samples < SLOW_SAMPLES
                            || self.out >= self.max_out
                            || !self.slower_than_the_rest(index, average)
                        {
                            return None;
                        }
                        self.out += 1;
                        return Some(self.eject(now, index, Why::Slow, rng));
                    }
                    Verdict::Failure => {
                        h.consecutive = h.consecutive.saturating_add(1);
                        h.requests = h.requests.saturating_add(1);
                        h.failures = h.failures.saturating_add(1);
                    }
                }
                let why = if h.consecutive >= self.consecutive_limit {
                    Why::Consecutive
                } else if h.requests >= self.min_requests
                    && f64::from(h.failures) >= self.failure_rate * f64::from(h.requests)
                {
                    Why::FailureRate
                } else {
                    return None;
                };
                if self.out >= self.max_out {
                    return None;
                }
                self.out += 1;
                Some(self.eject(now, index, why, rng))
            }
            // An attempt sent before the endpoint went out, or in panic
            // mode: only its probe decides when it comes back.
            _ => None,
        }
    }

    /// Whether `latency` (seconds) is `slow_factor` times the median of
    /// the other serving endpoints' averages (those with enough answers).
    fn slower_than_the_rest(&self, index: usize, latency: f64) -> bool {
        if self.slow_factor == 0.0 || latency < SLOW_FLOOR {
            return false;
        }
        // latency > factor × median of the others ⟺ more than half of the
        // others are below latency / factor: counted, not sorted (this
        // runs under the upstream's lock, for every answer).
        let (mut others, mut below) = (0usize, 0usize);
        for (i, h) in self.endpoints.iter().enumerate() {
            if i != index && h.state == State::Serving && h.samples >= SLOW_SAMPLES {
                others += 1;
                below += usize::from(self.slow_factor * h.latency < latency);
            }
        }
        others > 0 && below > others / 2
    }

    /// Takes endpoint `index` out (it is counted in `out` already), for
    /// longer the more times in a row it was.
    fn eject<R: Rng + ?Sized>(
        &mut self,
        now: Instant,
        index: usize,
        why: Why,
        rng: &mut R,
    ) -> Event {
        let (base, max, window) = (self.ejection_time, self.max_ejection_time, self.window);
        let h = &mut self.endpoints[index];
        // An endpoint that came back and served for a window since starts
        // over: a blip now and then is not a growing record.
        if h.state == State::Serving
            && h.returned
                .is_some_and(|r| now.saturating_duration_since(r) >= window)
        {
            h.strikes = 0;
        }
        let doubled = base.saturating_mul(1u32 << h.strikes.min(20)).min(max);
        let length = doubled.mul_f64(rng.random_range(0.5..1.5)).min(max);
        h.strikes = h.strikes.saturating_add(1);
        h.ejections = h.ejections.saturating_add(1);
        h.reset_counts(now);
        h.samples = 0;
        h.state = State::Ejected {
            until: now.checked_add(length).unwrap_or(now),
            length,
        };
        Event::Ejected { index, length, why }
    }

    pub fn snapshot(&self, now: Instant) -> Vec<Snapshot> {
        self.endpoints
            .iter()
            .map(|h| Snapshot {
                state: h.state.as_str(),
                consecutive_failures: h.consecutive,
                window_requests: h.requests,
                window_failures: h.failures,
                ejections: h.ejections,
                ejected_remaining_seconds: match h.state {
                    State::Ejected { until, .. } => {
                        until.saturating_duration_since(now).as_secs_f64()
                    }
                    _ => 0.0,
                },
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::StatusCode;
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    const MS: Duration = Duration::from_millis(1);

    fn config() -> OutlierConfig {
        OutlierConfig::default()
    }

    fn fail() -> Verdict {
        Verdict::of(Outcome::Response(StatusCode::SERVICE_UNAVAILABLE))
    }

    fn ok() -> Verdict {
        Verdict::of(Outcome::Response(StatusCode::OK))
    }

    /// Sends `n` attempts through `o`, endpoint `bad` failing every one,
    /// and returns how many reached `bad`.
    fn traffic(
        o: &mut Outliers,
        now: Instant,
        n: usize,
        bad: usize,
        retryable: bool,
        rng: &mut StdRng,
    ) -> usize {
        let mut hits = 0;
        for turn in 0..n {
            let pick = o.pick(now, turn, None, retryable, false);
            let verdict = if pick.index == bad {
                hits += 1;
                fail()
            } else {
                ok()
            };
            o.record(now, pick.index, pick.kind, verdict, None, rng);
        }
        hits
    }

    #[test]
    fn verdicts_blame_only_the_upstream() {
        use super::super::outcome::{CallerFault, Refusal};
        assert_eq!(
            Verdict::of(Outcome::Response(StatusCode::NOT_FOUND)),
            Verdict::Success
        );
        assert_eq!(
            Verdict::of(Outcome::Response(StatusCode::BAD_GATEWAY)),
            Verdict::Failure
        );
        assert_eq!(
            Verdict::of(Outcome::Upstream(UpstreamFault::ConnectFailure)),
            Verdict::Failure
        );
        assert_eq!(
            Verdict::of(Outcome::Upstream(UpstreamFault::Timeout)),
            Verdict::Failure
        );
        assert_eq!(
            Verdict::of(Outcome::Upstream(UpstreamFault::StaleConnection)),
            Verdict::Neutral
        );
        assert_eq!(
            Verdict::of(Outcome::Caller(CallerFault::Gone)),
            Verdict::Neutral
        );
        assert_eq!(Verdict::of(Outcome::Deadline), Verdict::Neutral);
        assert_eq!(
            Verdict::of(Outcome::Refused(Refusal::Overloaded)),
            Verdict::Neutral
        );
    }

    #[test]
    fn a_failing_endpoint_is_ejected_and_probed_back() {
        let mut rng = StdRng::seed_from_u64(7);
        let t0 = Instant::now();
        let mut o = Outliers::try_new(&config(), 2, t0).unwrap();
        // Endpoint 1 fails everything: after 5 of its attempts it is out.
        let hits = traffic(&mut o, t0, 100, 1, true, &mut rng);
        assert_eq!(hits, 5, "ejected after consecutive_failures");
        assert!(matches!(o.state(1), Some(State::Ejected { .. })));
        // Its time is up (at most 1.5 × ejection_time): the next retryable
        // request probes it; a failed probe ejects it for longer.
        let later = t0 + 1500 * MS;
        let pick = o.pick(later, 0, None, true, false);
        assert_eq!(
            pick,
            Pick {
                index: 1,
                kind: PickKind::Probe
            }
        );
        // Only one probe at a time.
        assert_eq!(o.pick(later, 1, None, true, false).index, 0);
        let event = o.record(later, 1, PickKind::Probe, fail(), None, &mut rng);
        let Some(Event::Ejected {
            length,
            why: Why::ProbeFailed,
            ..
        }) = event
        else {
            panic!("{event:?}")
        };
        assert!(
            length >= 1000 * MS && length < 3000 * MS,
            "{length:?}: doubled, jittered"
        );
        // Now it recovers: the next probe brings it back.
        let later = later + 3000 * MS;
        let pick = o.pick(later, 0, None, true, false);
        assert_eq!(pick.kind, PickKind::Probe);
        assert_eq!(
            o.record(later, 1, PickKind::Probe, ok(), None, &mut rng),
            Some(Event::Returned { index: 1 })
        );
        assert!(!o.any_out());
        assert_eq!(
            o.pick(later, 1, None, true, false),
            Pick {
                index: 1,
                kind: PickKind::Serving
            }
        );
    }

    #[test]
    fn requests_that_cannot_be_retried_probe_only_when_no_other_comes() {
        let mut rng = StdRng::seed_from_u64(1);
        let t0 = Instant::now();
        let mut o = Outliers::try_new(&config(), 2, t0).unwrap();
        traffic(&mut o, t0, 20, 1, false, &mut rng);
        let State::Ejected { until, length } = o.state(1).unwrap() else {
            panic!()
        };
        // Due, but a POST does not probe it yet...
        assert_eq!(o.pick(until, 1, None, false, false).index, 0);
        // ...until another ejection time went by with no retryable request.
        assert_eq!(
            o.pick(until + length, 1, None, false, false).kind,
            PickKind::Probe
        );
    }

    #[test]
    fn a_probe_that_tells_nothing_leaves_it_due() {
        let mut rng = StdRng::seed_from_u64(2);
        let t0 = Instant::now();
        let mut o = Outliers::try_new(&config(), 2, t0).unwrap();
        traffic(&mut o, t0, 20, 1, true, &mut rng);
        let later = t0 + 2000 * MS;
        assert_eq!(o.pick(later, 0, None, true, false).kind, PickKind::Probe);
        o.record(later, 1, PickKind::Probe, Verdict::Neutral, None, &mut rng);
        assert_eq!(o.pick(later, 0, None, true, false).kind, PickKind::Probe);
    }

    #[test]
    fn at_most_the_share_is_out_and_all_out_is_panic() {
        let mut rng = StdRng::seed_from_u64(3);
        let t0 = Instant::now();
        // Default share 0.5 of 2: only one endpoint may go, however both fail.
        let mut o = Outliers::try_new(&config(), 2, t0).unwrap();
        for turn in 0..50 {
            let pick = o.pick(t0, turn, None, true, false);
            o.record(t0, pick.index, pick.kind, fail(), None, &mut rng);
        }
        assert_eq!(o.out, 1);
        // A share of 1.0 lets both go: then traffic goes to all of them.
        let mut all = config();
        all.max_ejected = 1.0;
        let mut o = Outliers::try_new(&all, 2, t0).unwrap();
        for turn in 0..50 {
            let pick = o.pick(t0, turn, None, true, false);
            o.record(t0, pick.index, pick.kind, fail(), None, &mut rng);
        }
        assert_eq!(o.out, 2);
        let picks: Vec<_> = (0..4).map(|t| o.pick(t0, t, None, true, false)).collect();
        assert!(picks.iter().all(|p| p.kind == PickKind::Panic));
        assert_eq!(
            picks.iter().filter(|p| p.index == 0).count(),
            2,
            "{picks:?}"
        );
    }

    #[test]
    fn retries_go_to_another_serving_endpoint() {
        let mut rng = StdRng::seed_from_u64(4);
        let t0 = Instant::now();
        let mut o = Outliers::try_new(&config(), 3, t0).unwrap();
        // Endpoint 2 out.
        traffic(&mut o, t0, 30, 2, true, &mut rng);
        assert!(o.any_out());
        for turn in 0..6 {
            for previous in [0, 1] {
                let pick = o.pick(t0, turn, Some(previous), true, false);
                assert_eq!(pick.index, 1 - previous, "a retry after {previous}");
            }
        }
    }

    #[test]
    fn one_endpoint_is_never_ejected() {
        let mut rng = StdRng::seed_from_u64(5);
        let t0 = Instant::now();
        let mut o = Outliers::try_new(&config(), 1, t0).unwrap();
        assert_eq!(traffic(&mut o, t0, 50, 0, true, &mut rng), 50);
        assert!(!o.any_out());
    }

    #[test]
    fn a_failure_rate_ejects_an_endpoint_that_is_never_five_in_a_row() {
        let mut rng = StdRng::seed_from_u64(6);
        let t0 = Instant::now();
        let mut o = Outliers::try_new(&config(), 2, t0).unwrap();
        // Endpoint 0 fails two of every three attempts; 1 is healthy.
        let mut event = None;
        for k in 0..60u32 {
            let verdict = if k % 3 == 0 { ok() } else { fail() };
            event = event.or(o.record(t0, 0, PickKind::Serving, verdict, None, &mut rng));
        }
        assert!(
            matches!(
                event,
                Some(Event::Ejected {
                    index: 0,
                    why: Why::FailureRate,
                    ..
                })
            ),
            "{event:?}"
        );
    }

    #[test]
    fn ejection_time_grows_and_is_capped() {
        let mut rng = StdRng::seed_from_u64(8);
        let t0 = Instant::now();
        let mut o = Outliers::try_new(&config(), 2, t0).unwrap();
        traffic(&mut o, t0, 20, 1, true, &mut rng);
        let mut now = t0;
        let mut longest = Duration::ZERO;
        for _ in 0..30 {
            now += Duration::from_secs(100);
            assert_eq!(o.pick(now, 0, None, true, false).kind, PickKind::Probe);
            if let Some(Event::Ejected { length, .. }) =
                o.record(now, 1, PickKind::Probe, fail(), None, &mut rng)
            {
                longest = longest.max(length);
            }
        }
        assert!(longest <= config().max_ejection_time);
        assert!(longest >= config().max_ejection_time / 2, "{longest:?}");
    }

    #[test]
    fn rules_are_checked() {
        let t0 = Instant::now();
        let mut c = config();
        c.failure_rate = 1.5;
        assert_eq!(
            Outliers::try_new(&c, 2, t0).unwrap_err().key(),
            "failure_rate"
        );
        let mut c = config();
        c.max_ejection_time = Duration::from_millis(1);
        assert_eq!(
            Outliers::try_new(&c, 2, t0).unwrap_err().key(),
            "max_ejection_time"
        );
        for bad in [1.0, -2.0, f64::NAN, f64::INFINITY] {
            let c = OutlierConfig {
                slow_factor: bad,
                ..config()
            };
            assert_eq!(
                Outliers::try_new(&c, 2, t0).unwrap_err().key(),
                "slow_factor",
                "{bad}"
            );
        }
        let mut c = config();
        c.consecutive_failures = 0;
        assert_eq!(
            Outliers::try_new(&c, 2, t0).unwrap_err().key(),
            "consecutive_failures"
        );
    }

    #[test]
    fn an_ejected_endpoints_share_is_spread_over_the_others() {
        let mut rng = StdRng::seed_from_u64(9);
        let t0 = Instant::now();
        let mut o = Outliers::try_new(&config(), 4, t0).unwrap();
        traffic(&mut o, t0, 40, 3, true, &mut rng);
        let mut counts = [0; 4];
        for turn in 0..300 {
            counts[o.pick(t0, turn, None, true, false).index] += 1;
        }
        assert_eq!(counts, [100, 100, 100, 0]);
    }

    #[test]
    fn breaker_probes_try_every_endpoint_ejected_or_not() {
        let mut rng = StdRng::seed_from_u64(10);
        let t0 = Instant::now();
        let mut o = Outliers::try_new(&config(), 2, t0).unwrap();
        traffic(&mut o, t0, 20, 1, true, &mut rng);
        assert!(matches!(o.state(1), Some(State::Ejected { .. })));
        // Long before its time is up, a breaker probe may find it healed.
        let picks: Vec<_> = (0..2).map(|t| o.pick(t0, t, None, true, true)).collect();
        let probe = picks
            .iter()
            .find(|p| p.index == 1)
            .expect("endpoint 1 probed");
        assert_eq!(probe.kind, PickKind::Probe);
        assert_eq!(
            o.record(t0, 1, PickKind::Probe, ok(), None, &mut rng),
            Some(Event::Returned { index: 1 })
        );
    }

    #[test]
    fn a_blip_now_and_then_is_not_a_growing_record() {
        let mut rng = StdRng::seed_from_u64(11);
        let t0 = Instant::now();
        let mut o = Outliers::try_new(&config(), 2, t0).unwrap();
        let mut now = t0;
        for _ in 0..6 {
            // A blip: ejected, probed back in at once, then healthy for a window.
            let mut event = None;
            for k in 0..5 {
                event = o
                    .record(now, 1, PickKind::Serving, fail(), None, &mut rng)
                    .or(event);
                assert!(k < 4 || event.is_some());
            }
            let Some(Event::Ejected { length, .. }) = event else {
                panic!("{event:?}")
            };
            assert!(length < 1500 * MS, "{length:?}: not doubled");
            now += 1500 * MS;
            assert_eq!(o.pick(now, 0, None, true, false).kind, PickKind::Probe);
            o.record(now, 1, PickKind::Probe, ok(), None, &mut rng);
            now += config().window;
        }
    }

    #[test]
    fn an_endpoint_far_slower_than_the_rest_is_out_until_a_probe_is_quick() {
        let mut rng = StdRng::seed_from_u64(12);
        let t0 = Instant::now();
        let mut o = Outliers::try_new(&config(), 3, t0).unwrap();
        let (quick, slow) = (Some(10 * MS), Some(1000 * MS));
        let mut event = None;
        for turn in 0..60 {
            let pick = o.pick(t0, turn, None, true, false);
            let latency = if pick.index == 2 { slow } else { quick };
            event = o
                .record(t0, pick.index, pick.kind, ok(), latency, &mut rng)
                .or(event);
        }
        assert!(
            matches!(
                event,
                Some(Event::Ejected {
                    index: 2,
                    why: Why::Slow,
                    ..
                })
            ),
            "{event:?}"
        );
        // A probe as slow keeps it out; a quick one brings it back.
        let later = t0 + 1500 * MS;
        assert_eq!(o.pick(later, 0, None, true, false).kind, PickKind::Probe);
        let again = o.record(later, 2, PickKind::Probe, ok(), slow, &mut rng);
        assert!(
            matches!(again, Some(Event::Ejected { why: Why::Slow, .. })),
            "{again:?}"
        );
        let later = later + 5000 * MS;
        assert_eq!(o.pick(later, 0, None, true, false).kind, PickKind::Probe);
        assert_eq!(
            o.record(later, 2, PickKind::Probe, ok(), quick, &mut rng),
            Some(Event::Returned { index: 2 })
        );
        // Even latencies, however high, eject nobody; nor does slow_factor 0.
        let mut o = Outliers::try_new(&config(), 3, t0).unwrap();
        for turn in 0..60 {
            let pick = o.pick(t0, turn, None, true, false);
            assert_eq!(
                o.record(t0, pick.index, pick.kind, ok(), slow, &mut rng),
                None
            );
        }
        let off = OutlierConfig {
            slow_factor: 0.0,
            ..config()
        };
        let mut o = Outliers::try_new(&off, 3, t0).unwrap();
        for turn in 0..60 {
            let pick = o.pick(t0, turn, None, true, false);
            let latency = if pick.index == 2 { slow } else { quick };
            assert_eq!(
                o.record(t0, pick.index, pick.kind, ok(), latency, &mut rng),
                None
            );
        }
    }
}
