//! The adaptive concurrency limit of an upstream, in the spirit of Netflix's
//! concurrency-limits (Gradient2) and Envoy's adaptive concurrency filter.
//!
//! Why: a static `max_in_flight` is either too high to protect a slow
//! upstream or too low for a fast one, and a sidecar is one of a fleet: a
//! limit that stands far above what its own traffic uses lets every replica
//! pile that many requests onto an upstream that freezes, before any of
//! them learns anything. So the limit follows two things:
//!
//! - **the upstream's latency**: each window's average latency is compared
//!   with a baseline, each answer against its own path's (the lowest
//!   three-second mean of the path's windows over the last 30 to 60 s, see
//!   `paths.rs`; an upstream's paths may differ twentyfold), or, for a path
//!   not yet known, the upstream's (the lowest three-second median window
//!   of the last 30 to 60 s), less what the proxy's own threads waited
//!   for a CPU meanwhile (`own_wait.rs`). Above `tolerance` times the
//!   baseline the limit shrinks in proportion; a per-try timeout halves it
//!   at once. An upstream that got slower without queueing is followed:
//!   the baseline becomes its latency when half as many in flight take as
//!   long, or, at the floor where nothing is left to halve, when latency
//!   holds steady there;
//! - **the traffic's own use**: the limit never stands above twice the
//!   peak in flight of the last 5 to 10 s plus two ([`USE_MULTIPLE`],
//!   [`USE_HEADROOM`]), and grows only while it is what holds requests back
//!   (requests wait for a slot or were shed), on answers within half the
//!   tolerance: by two per answer (tripling per round trip, a slow start as
//!   TCP's). For 30 s after trouble (a cut, an outage) slow start
//!   stops at the level it held while latency was calm (or where a cut left
//!   it, if higher), and above that it grows by one per round trip on
//!   answers within a quarter of the tolerance; never past the requests in
//!   flight and waiting.
//!
//! "In flight" here is what the latency is measured over: attempts sent
//! and not yet answered. An answer being read by its caller is done with
//! as far as the limit goes (it holds a slot of `max_in_flight` until its
//! body ends), so that callers reading long answers slowly, which no
//! sample shows, neither starve the others nor look like the upstream's
//! load.
//!
//! An idle sidecar thus adds at most two requests to an upstream that
//! freezes; after an outage each sidecar of a fleet comes back quickly to
//! its own calm share, and the fleet grows past what it sent before by one
//! request per sidecar per round trip.
//!
//! Pure: latencies come in as numbers; the upstream keeps it behind a mutex
//! taken once per completed attempt.

use std::time::Duration;

use tokio::time::Instant;

use crate::policy::paths::PathKey;
use crate::policy::settings::AdaptiveConfig;

use super::outcome::{CallerFault, Outcome, UpstreamFault};

#[cfg(test)]
mod mixed_tests;
mod own_wait;
mod paths;
pub use own_wait::Waits;
use own_wait::{OwnWait, Since};
use paths::PathLatencies;

#[derive(Debug, Clone)]
pub struct Limiter {
    limit: f64,
    min_limit: f64,
    max_limit: f64,
    tolerance: f64,
    smoothing: f64,
    baseline: Baseline,
    /// Each path's own baseline: an answer is held against its path's.
    paths: PathLatencies,
    /// [`Limiter::wait`], worked out again only as the baseline moves (once
    /// a window): read at every sample.
    wait: Option<Duration>,
    window: Option<Window>,
    use_: Use,
    /// Where the limit was last cut, or the calm level if higher: slow
    /// start below it, one per round trip above it, for [`FORGET`] after
    /// the trouble that set it (`troubled`); slow start up to the demand
    /// after that, as at start-up.
    threshold: f64,
    troubled: Option<Instant>,
    /// The highest mean in flight of a window whose latency was calm,
    /// halving every [`CALM_HALF_LIFE`] (`calm_at`: when it was last
    /// decayed): remembered through an outage, it is each sidecar's share
    /// of what the upstream served well.
    calm: f64,
    calm_at: Option<Instant>,
    /// When a timeout last cut the limit: it is cut at most once per window.
    last_cut: Option<Instant>,
    /// Where latency stood (mean in flight, window average) when the limit
    /// began to shrink, until a window is calm again or attempts time out:
    /// if halving what is in flight does not bring latency down, the
    /// upstream is not queueing but slower, and the baseline follows it.
    shrink_from: Option<(f64, f64)>,
    /// Since when every window has said so (see [`SLOWER_FOR`]).
    slower_since: Option<Instant>,
    /// When attempts last timed out or an outage ended: for [`FORGET`]
    /// after, slow answers are the outage's backlog, never a new baseline.
    outage_at: Option<Instant>,
    /// The proxy's own wait for a CPU, taken off the windows' latency.
    own: OwnWait,
}

/// Why a limiter could not be built; [`key`](InvalidLimiter::key) names
/// the key of `adaptive_concurrency` at fault.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InvalidLimiter {
    #[error("must be at least 1")]
    MinLimit,
    #[error("must not be below min_limit")]
    InitialLimit,
    #[error("{0} must be at least 1.0")]
    Tolerance(f64),
    #[error("{0} is out of range (0.0, 1.0]")]
    Smoothing(f64),
}

impl InvalidLimiter {
    pub fn key(&self) -> &'static str {
        match self {
            InvalidLimiter::MinLimit => "min_limit",
            InvalidLimiter::InitialLimit => "initial_limit",
            InvalidLimiter::Tolerance(_) => "tolerance",
            InvalidLimiter::Smoothing(_) => "smoothing",
        }
    }
}

/// How an attempt went, as the limiter sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sample {
    /// Response headers after this long.
    Latency(Duration),
    /// No answer yet after this long, when the caller left or the request's
    /// deadline ended the attempt: the latency was at least this.
    Unanswered(Duration),
    /// Timed out in a way that says the upstream is struggling.
    Dropped,
}

impl Sample {
    /// What an attempt that ended in `outcome` after `elapsed` teaches the
    /// limit: the one mapping from an outcome to the limiter.
    ///
    /// An answer is a latency. A per-try timeout is a drop: the upstream is
    /// struggling now. An attempt cut short by its caller leaving or by its
    /// deadline is a lower bound of the latency, which counts only when it
    /// is already above what the limit tolerates (see [`Limiter::update`]):
    /// a caller who gives up early cannot move the limit, but a thousand
    /// callers who gave up after waiting far longer than the upstream
    /// usually takes do tell that it is slow. A caller's bad or stalled
    /// body and connection failures (which the breaker counts) are nothing.
    pub fn of(outcome: Outcome, elapsed: Duration) -> Option<Sample> {
        match outcome {
            Outcome::Response(_) | Outcome::Grpc(_) => Some(Sample::Latency(elapsed)),
            Outcome::Upstream(UpstreamFault::Timeout) => Some(Sample::Dropped),
            Outcome::Caller(CallerFault::Gone) | Outcome::Deadline => {
                Some(Sample::Unanswered(elapsed))
            }
            _ => None,
        }
    }
}

/// The limit never stands above `USE_MULTIPLE` times the recent peak in
/// flight plus `USE_HEADROOM`.
pub const USE_MULTIPLE: f64 = 2.0;
pub const USE_HEADROOM: f64 = 2.0;
/// The recent peak is the larger of this period's and the last one's.
const USE_PERIOD: Duration = Duration::from_secs(5);
/// The first period, before which the use is not known.
const FIRST_USE_PERIOD: Duration = Duration::from_secs(1);
/// The baseline is the lowest three-second median of this period and the last.
const BASELINE_PERIOD: Duration = Duration::from_secs(30);

/// Below the threshold the limit grows by this per answer: three times
/// itself per round trip, so that a sidecar is back where it was calm a few
/// round trips after an outage (a fleet is: each sidecar's calm level is its
/// share).
const SLOW_START_STEP: f64 = 2.0;

/// How long latency must stay up with half as many in flight before the
/// baseline follows it.
const SLOWER_FOR: Duration = Duration::from_secs(2);

/// How long latency must hold steady with the limit at its floor before
/// the baseline follows it, outage or not.
const FLOOR_SLOWER_FOR: Duration = Duration::from_secs(5);

/// How long trouble (a cut, an outage) keeps slow start to the calm level.
const FORGET: Duration = Duration::from_secs(30);
/// The calm level halves in this long.
const CALM_HALF_LIFE: Duration = Duration::from_secs(30);

/// The limit moves at most once per window of samples this long ...
const WINDOW: Duration = Duration::from_millis(100);
/// ... holding at least this many samples (or a timeout).
const MIN_SAMPLES: u32 = 10;

impl Limiter {
    /// The initial and minimum limits are taken down to `max_in_flight` when
    /// above it (and `max_in_flight` up to 1, its least).
    pub fn try_new(c: &AdaptiveConfig, max_in_flight: usize) -> Result<Self, InvalidLimiter> {
        let max = max_in_flight.max(1) as f64;
        if c.min_limit == 0 {
            return Err(InvalidLimiter::MinLimit);
        }
        if c.initial_limit < c.min_limit {
            return Err(InvalidLimiter::InitialLimit);
        }
        if !(c.tolerance.is_finite() && c.tolerance >= 1.0) {
            return Err(InvalidLimiter::Tolerance(c.tolerance));
        }
        if !(c.smoothing > 0.0 && c.smoothing <= 1.0) {
            return Err(InvalidLimiter::Smoothing(c.smoothing));
        }
        Ok(Self {
            limit: (c.initial_limit as f64).min(max),
            min_limit: (c.min_limit as f64).min(max),
            max_limit: max,
            tolerance: c.tolerance,
            smoothing: c.smoothing,
            baseline: Baseline::default(),
            paths: PathLatencies::default(),
            wait: None,
            window: None,
            use_: Use::default(),
            threshold: max,
            troubled: None,
            calm: 0.0,
            calm_at: None,
            last_cut: None,
            shrink_from: None,
            slower_since: None,
            outage_at: None,
            own: OwnWait::new(own_wait::not_known),
        })
    }

    /// The limiter, taking off the latency it holds against the upstream
    /// the time the proxy's own threads waited for a CPU, as `read` says
    /// (see `limit/own_wait.rs`).
    pub fn with_own_wait(mut self, read: own_wait::Reader) -> Self {
        self.own = OwnWait::new(read);
        self
    }

    /// Windows whose slowness was the proxy's own wait for a CPU, not the
    /// upstream's, since the start.
    pub fn excused(&self) -> u64 {
        self.own.excused()
    }

    /// Requests allowed in flight now.
    pub fn limit(&self) -> usize {
        self.limit as usize
    }

    /// Paths whose own latency is tracked, and the answers since the
    /// start that found no room among them.
    pub fn paths(&self) -> (usize, u64) {
        (self.paths.len(), self.paths.untracked())
    }

    /// Records an attempt's outcome at `now`, on `path`; `in_flight`
    /// counts it too; `queued`: requests waiting for a slot now, or 1 when
    /// none waits but one was shed since the last sample.
    ///
    /// Samples are gathered over a window (100 ms, and at least 10 samples,
    /// as Netflix's `WindowedLimit` does) and the limit moves once per window
    /// on the window's average latency, each sample as many times its
    /// path's baseline as it took (see `limit/paths.rs`): a burst of slow answers
    /// caused by a hiccup of the proxy itself does not collapse the limit.
    pub fn update(
        &mut self,
        sample: Sample,
        path: PathKey,
        in_flight: usize,
        queued: usize,
        now: Instant,
    ) {
        self.use_.record(in_flight, now);
        // A caller that left after waiting four times the tolerated latency
        // of its path (or, unknown, the upstream's: as long as a request may
        // wait for a slot) met an upstream that is stuck, as a timeout does: its per-try timeout and the caller's
        // own often end together, and the caller's may come first.
        let (sample, ratio) = match sample {
            Sample::Unanswered(waited) => {
                let ratio = self.paths.ratio(path, waited.as_secs_f64());
                let stuck = match ratio {
                    Some(r) => r > self.tolerance * 4.0,
                    None => self.wait().is_some_and(|stuck| waited > stuck),
                };
                match stuck {
                    true => (Sample::Dropped, None),
                    false => (sample, ratio),
                }
            }
            Sample::Latency(rtt) => (sample, self.paths.answer(path, rtt.as_secs_f64())),
            Sample::Dropped => (sample, None),
        };
        let latency = match sample {
            Sample::Dropped => {
                // A timeout says the upstream is struggling now: halve at
                // once, but once per window, however many time out together.
                let cut_lately = self
                    .last_cut
                    .is_some_and(|at| now.saturating_duration_since(at) < WINDOW);
                if !cut_lately {
                    self.limit = (self.limit * 0.5).clamp(self.min_limit, self.max_limit);
                    self.trouble(now);
                    self.last_cut = Some(now);
                }
                self.shrink_from = None;
                self.slower_since = None;
                self.outage_at = Some(now);
                self.window = None;
                return;
            }
            Sample::Latency(rtt) => {
                let rtt = rtt.as_secs_f64();
                if queued > 0 {
                    self.grow(rtt, ratio, in_flight + queued, now);
                }
                rtt
            }
            Sample::Unanswered(waited) => {
                let waited = waited.as_secs_f64();
                if !self.above(waited, ratio, self.tolerance) {
                    return;
                }
                waited
            }
        };
        let w = self.window.get_or_insert(Window {
            start: now,
            sum: 0.0,
            ratios: 0.0,
            inverse: 0.0,
            unknown: 0.0,
            unknowns: 0,
            count: 0,
            in_flight: 0,
            unanswered: false,
        });
        w.sum += latency;
        match ratio {
            Some(r) => {
                w.ratios += r;
                w.inverse += r / latency.max(1e-9);
            }
            None => {
                w.unknown += latency;
                w.unknowns += 1;
            }
        }
        w.count += 1;
        w.unanswered |= matches!(sample, Sample::Unanswered(_));
        w.in_flight = w.in_flight.saturating_add(in_flight);
        let age = now.saturating_duration_since(w.start);
        // Light traffic fills no window of MIN_SAMPLES: after ten windows'
        // time, what came is enough.
        let ripe = age >= WINDOW && (w.count >= MIN_SAMPLES || age >= WINDOW * 10);
        if !ripe {
            return;
        }
        let Some(w) = self.window.take() else {
            return;
        };
        self.apply(&w, now);
        self.wait = self.wait_now();
    }

    /// Whether `latency` (seconds; `ratio`: its path's baseline's multiple,
    /// if known) is above `times` the baseline; false before there is one.
    fn above(&self, latency: f64, ratio: Option<f64>, times: f64) -> bool {
        match ratio {
            Some(r) => r > times,
            None => self.baseline.get().is_some_and(|b| latency > b * times),
        }
    }

    /// Once a second: the limit of a sidecar whose traffic fell comes down
    /// to what the traffic uses, samples or not; `in_flight`: attempts not
    /// yet answered now (long ones, that no sample shows, are use too).
    pub fn relax(&mut self, in_flight: usize, now: Instant) {
        self.use_.record(in_flight, now);
        self.limit = self.limit.min(self.use_bound()).max(self.min_limit);
    }

    /// One answer that came while the limit held requests back: if it came
    /// within half the tolerance (1.5 times the baseline at the default
    /// 2.0: a band between growing and shrinking, so that the limit settles
    /// instead of swinging; a quarter, 1.25 times, past the threshold while
    /// the trouble is recent), the limit grows by two below the threshold (not
    /// past it), by one over the limit above it (one per round trip); never past
    /// `demand`, the requests in flight and waiting, so that a backlog
    /// cleared at once does not leave it far above the traffic.
    fn grow(&mut self, rtt: f64, ratio: Option<f64>, demand: usize, now: Instant) {
        let troubled = self
            .troubled
            .is_some_and(|at| now.saturating_duration_since(at) < FORGET);
        let threshold = if troubled {
            self.threshold
        } else {
            self.max_limit
        };
        // Past the calm level soon after trouble, only answers within a
        // quarter of the tolerance count: every sidecar of a fleet grows
        // by one per round trip, and the fleet must stop before the
        // upstream queues, not after.
        let part = if self.limit >= threshold { 4.0 } else { 2.0 };
        if self.above(rtt, ratio, self.calm_band(part)) {
            return;
        }
        let step = if self.limit < threshold {
            SLOW_START_STEP
        } else {
            1.0 / self.limit
        };
        self.limit = (self.limit + step)
            .min(threshold.max(self.limit + 1.0 / self.limit))
            .min((demand as f64).max(self.limit))
            .min(self.max_limit);
    }

    /// The multiple of the baseline within `1 / part` of the tolerance's
    /// excess: answers below it are calm enough to grow on (1.5 times the
    /// baseline at the default 2.0 and `part` 2).
    fn calm_band(&self, part: f64) -> f64 {
        1.0 + (self.tolerance - 1.0) / part
    }

    /// Trouble now (a cut, or the upstream's breaker closing after an
    /// outage): for [`FORGET`], slow start goes no further than the calm
    /// level (or the limit now, if higher), and one per round trip past it.
    fn trouble(&mut self, now: Instant) {
        self.threshold = self.limit.max(self.calm_now(now));
        self.troubled = Some(now);
    }

    /// A breaker in front of this upstream closed after an outage: the
    /// requests held back during it come back by slow start to the calm
    /// level, not at once, however little the limit learnt during it (an
    /// upstream that failed fast cut nothing).
    pub fn after_outage(&mut self, now: Instant) {
        self.trouble(now);
        self.outage_at = Some(now);
    }

    /// A slow window while the limit shrinks: if half as many in flight as
    /// when it began to shrink still take as long (within 20%), latency is
    /// not queueing but the upstream's own (a deploy, a cold cache, a
    /// failover): the baseline becomes the latency now (`raw`, the
    /// window's plain average; each path's, as many times higher as
    /// `short` is than the baseline) and the limit goes back to where it
    /// stood. True when that was the case.
    fn slower_not_queueing(
        &mut self,
        (short, raw): (f64, f64),
        mean_in_flight: f64,
        answered: bool,
        now: Instant,
    ) -> bool {
        let Some((from_in_flight, from_latency)) = self.shrink_from else {
            self.shrink_from = Some((mean_in_flight, short));
            return false;
        };
        let halved = mean_in_flight <= 0.5 * from_in_flight;
        let after_outage = self
            .outage_at
            .is_some_and(|at| now.saturating_duration_since(at) < FORGET);
        // At the floor, with no more in flight than it lets, nothing is
        // left to halve: latency that holds steady there (an outage's
        // backlog drains, and its latency falls) is the upstream's own,
        // once it has held for FLOOR_SLOWER_FOR. Else a short spike of
        // timeouts before an upstream that stays slower would hold the
        // limit at the floor until the old baseline aged out (a minute).
        let at_floor = self.limit <= self.min_limit && mean_in_flight <= self.min_limit + 0.5;
        let steady = short >= 0.8 * from_latency && short <= 1.25 * from_latency;
        let (evidence, hold) = match at_floor {
            true => (answered && steady, FLOOR_SLOWER_FOR),
            false => (
                !after_outage && answered && halved && short >= 0.8 * from_latency,
                SLOWER_FOR,
            ),
        };
        if !evidence {
            self.slower_since = None;
            return false;
        }
        // Said by every window for a while: a fleet that overloads an
        // upstream together sees latency fall as all its sidecars shrink;
        // latency that stays is the upstream's.
        let since = *self.slower_since.get_or_insert(now);
        if now.saturating_duration_since(since) < hold {
            return false;
        }
        self.slower_since = None;
        let factor = short / self.baseline.get().unwrap_or(short);
        self.baseline = Baseline::starting_at(raw);
        self.paths.rebase(factor);
        self.limit = self
            .limit
            .max(from_in_flight.ceil())
            .clamp(self.min_limit, self.max_limit);
        self.shrink_from = None;
        true
    }

    /// The calm level, decayed to `now`.
    fn calm_now(&mut self, now: Instant) -> f64 {
        if let Some(at) = self.calm_at {
            let age = now.saturating_duration_since(at).as_secs_f64();
            self.calm *= 0.5f64.powf(age / CALM_HALF_LIFE.as_secs_f64());
        }
        self.calm_at = Some(now);
        self.calm
    }

    /// How long a request may wait for a slot: four times the tolerated
    /// latency (`None` before there is a baseline; the caller bounds it).
    pub fn wait(&self) -> Option<Duration> {
        self.wait
    }

    fn wait_now(&self) -> Option<Duration> {
        let tolerated = self.baseline.get()? * self.tolerance * 4.0;
        Some(Duration::try_from_secs_f64(tolerated).unwrap_or(Duration::MAX))
    }

    /// The most the recent use allows (no bound until it is known).
    fn use_bound(&self) -> f64 {
        self.use_
            .peak()
            .map_or(f64::INFINITY, |p| USE_MULTIPLE * p as f64 + USE_HEADROOM)
    }

    /// A window closed: its average latency `short`, each answer on a path
    /// with a baseline of its own counted as that many times the
    /// upstream's baseline as it took of its path's. Above the tolerance,
    /// the limit shrinks toward `tolerance × baseline / short` of itself,
    /// smoothly (one slow window is not a trend), and slow start ends there.
    fn apply(&mut self, w: &Window, now: Instant) {
        let count = f64::from(w.count.max(1));
        let raw = (w.sum / count).max(1e-6);
        self.paths.window_closed();
        if let Some(rolled) = self.baseline.record(raw, now) {
            self.paths.span_closed(rolled);
        }
        let base = self.baseline.get().unwrap_or(raw);
        let short = ((w.ratios * base + w.unknown) / count).max(1e-6);
        let gradient = |short: f64| (self.tolerance * base / short).clamp(0.5, 1.0);
        let warm = short > base * self.calm_band(2.0) && self.limit > self.min_limit;
        let short = match self.own.at_close(warm, now) {
            Since::Unread => short,
            // A window is not a trend: the next one is measured.
            Since::Unknown if gradient(short) < 1.0 => return,
            Since::Unknown => short,
            // Slow by no more than the proxy's own wait: neither the
            // upstream's trouble nor its calm (what was in flight then was
            // held up by the proxy).
            Since::Waited(waited) => {
                let mine = w.own_share(waited, base, count);
                if gradient(short) < 1.0 && gradient(mine) >= 1.0 {
                    self.own.excuse();
                    return;
                }
                mine
            }
        };
        let gradient = gradient(short);
        let mean_in_flight = w.in_flight as f64 / count;
        // Every sample of the window was an answer (no caller that left).
        let answered = !w.unanswered;
        if gradient < 1.0 && self.slower_not_queueing((short, raw), mean_in_flight, answered, now) {
            return;
        }
        if gradient < 1.0 {
            let target = self.limit * gradient;
            self.limit = (self.limit * (1.0 - self.smoothing) + target * self.smoothing)
                .clamp(self.min_limit, self.max_limit);
            self.trouble(now);
        } else {
            self.calm = self.calm_now(now).max(mean_in_flight);
            self.shrink_from = None;
        }
        self.limit = self
            .limit
            .min(self.use_bound())
            .clamp(self.min_limit, self.max_limit);
    }
}

/// Samples gathered since the limit last moved.
#[derive(Debug, Clone)]
struct Window {
    start: Instant,
    /// The samples' latencies added up (seconds) ...
    sum: f64,
    /// ... those of samples on paths with a baseline, as multiples of it ...
    ratios: f64,
    /// ... with the sum of those baselines' inverses ...
    inverse: f64,
    /// ... and those of the others (seconds), and how many.
    unknown: f64,
    unknowns: u32,
    count: u32,
    /// The sum of the in-flight counts the samples came with.
    in_flight: usize,
    /// A sample was a caller that left, not an answer.
    unanswered: bool,
}

impl Window {
    /// The window's average latency as `apply` has it (`base`: the
    /// upstream's baseline; `count`: samples, at least 1), with `waited`
    /// seconds of the proxy's own wait for a CPU taken off each sample
    /// (no answer waited on the proxy longer than the proxy's threads
    /// waited in all), and never below nothing.
    fn own_share(&self, waited: f64, base: f64, count: f64) -> f64 {
        let waited = waited.max(0.0);
        let ratios = (self.ratios - waited * self.inverse).max(0.0);
        let unknown = (self.unknown - waited * f64::from(self.unknowns)).max(0.0);
        ((ratios * base + unknown) / count).max(1e-6)
    }
}

/// The peak in flight over the current [`USE_PERIOD`] and the one before.
#[derive(Debug, Clone, Default)]
struct Use {
    since: Option<Instant>,
    current: usize,
    /// `None` until a whole period has passed: a sidecar just started has
    /// its initial limit until its use is known.
    previous: Option<usize>,
}

impl Use {
    fn record(&mut self, in_flight: usize, now: Instant) {
        let since = *self.since.get_or_insert(now);
        // The first period is short: a sidecar started in a fleet (a
        // rollout, a restart mid-outage) holds its initial limit for a
        // second only.
        let period = match self.previous {
            Some(_) => USE_PERIOD,
            None => FIRST_USE_PERIOD,
        };
        let periods = now.saturating_duration_since(since).as_nanos() / period.as_nanos();
        if periods >= 1 {
            self.previous = Some(if periods == 1 { self.current } else { 0 });
            self.current = 0;
            self.since = Some(now);
        }
        self.current = self.current.max(in_flight);
    }

    fn peak(&self) -> Option<usize> {
        Some(self.current.max(self.previous?))
    }
}

/// The lowest median window of [`BASELINE_SPAN`] over the current
/// [`BASELINE_PERIOD`] and the one before: what the upstream takes when it
/// is not queueing. A minimum, not an average, so that a long overload does
/// not become the norm; it expires, so that an upstream that really became
/// slower is followed. Of a span's median window, not of single windows: a
/// window may hold only requests of one kind (a burst to a cached path
/// answering in a millisecond beside others that take twenty), and the
/// lowest such window would make every usual one look many times slower;
/// a median, not a mean, as fast answers come as many times more often as
/// they are faster. A burst sets it only once it fills more than half of a
/// span's windows (1.5 s). Until a whole span is in, the median window so
/// far.
#[derive(Debug, Clone, Default)]
struct Baseline {
    since: Option<Instant>,
    current: Option<f64>,
    previous: Option<f64>,
    /// The span being gathered: when it began, and its windows.
    span: Option<Instant>,
    windows: [f64; SPAN_WINDOWS],
    gathered: usize,
    /// Before a whole span: the median window so far.
    first: Option<f64>,
}

/// The baseline's medians are of this long ...
const BASELINE_SPAN: Duration = Duration::from_secs(3);
/// ... or of this many windows (a window lasts at least [`WINDOW`]: ten a
/// second at most, and one more at its edge).
const SPAN_WINDOWS: usize = 32;

impl Baseline {
    /// A baseline begun again at `latency`, until a whole span is in.
    fn starting_at(latency: f64) -> Self {
        Self {
            first: Some(latency),
            ..Self::default()
        }
    }

    /// A window whose average was `latency`. Gives back whether a span
    /// closed with it (`Some`), and whether a new period began.
    fn record(&mut self, latency: f64, now: Instant) -> Option<bool> {
        let start = *self.span.get_or_insert(now);
        if let Some(slot) = self.windows.get_mut(self.gathered) {
            *slot = latency;
            self.gathered += 1;
        }
        let median = upper_median(&mut self.windows[..self.gathered]);
        let whole =
            now.saturating_duration_since(start) >= BASELINE_SPAN || self.gathered == SPAN_WINDOWS;
        if !whole {
            if self.current.is_none() && self.previous.is_none() {
                self.first = Some(median);
            }
            return None;
        }
        self.span = None;
        self.gathered = 0;
        self.first = None;
        let since = *self.since.get_or_insert(now);
        let rolled = now.saturating_duration_since(since) >= BASELINE_PERIOD;
        if rolled {
            self.previous = self.current.take();
            self.since = Some(now);
        }
        self.current = Some(self.current.map_or(median, |c| c.min(median)));
        Some(rolled)
    }

    fn get(&self) -> Option<f64> {
        match (self.current, self.previous) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (None, None) => self.first,
            (a, b) => a.or(b),
        }
    }
}

/// The upper median of `values` (sorted in place): of an even count, the
/// higher of the middle two, so that windows of fast answers count only
/// once they are more than half.
fn upper_median(values: &mut [f64]) -> f64 {
    values.sort_unstable_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> AdaptiveConfig {
        AdaptiveConfig {
            enabled: true,
            min_limit: 1,
            initial_limit: 20,
            tolerance: 2.0,
            smoothing: 0.2,
        }
    }

    fn limiter() -> Limiter {
        Limiter::try_new(&config(), 1000).unwrap()
    }

    fn ms(n: u64) -> Sample {
        Sample::Latency(Duration::from_millis(n))
    }

    /// Feeds `n` windows of `sample`, each 10 samples over 100 ms, with
    /// `in_flight` and `queued` as the limiter stands.
    fn feed(
        l: &mut Limiter,
        clock: &mut Instant,
        n: usize,
        sample: Sample,
        load: impl Fn(&Limiter) -> (usize, usize),
    ) {
        for _ in 0..n {
            for _ in 0..10 {
                *clock += Duration::from_millis(10);
                let (in_flight, queued) = load(l);
                l.update(sample, PathKey::NONE, in_flight, queued, *clock);
            }
        }
    }

    /// Every slot taken and `n` more waiting.
    fn pressed(n: usize) -> impl Fn(&Limiter) -> (usize, usize) {
        move |l| (l.limit(), n)
    }

    /// `demand` requests: as many in flight as the limit lets, the rest waiting.
    fn demand(n: usize) -> impl Fn(&Limiter) -> (usize, usize) {
        move |l| (l.limit().min(n), n.saturating_sub(l.limit()))
    }

    /// Feeds `windows` windows from an upstream that queues: `base` up to
    /// `knee` in flight, in proportion above (a saturated server), with
    /// `demand` requests.
    fn queueing(
        l: &mut Limiter,
        clock: &mut Instant,
        windows: usize,
        base: u64,
        knee: usize,
        n: usize,
    ) {
        for _ in 0..windows {
            let in_flight = l.limit().min(n).max(1);
            let latency = base * in_flight.max(knee) as u64 / knee as u64;
            feed(l, clock, 1, ms(latency), demand(n));
        }
    }

    /// An upstream that becomes five times slower and stays so, whatever
    /// is in flight (a deploy, a cold cache): the limit shrinks at first,
    /// then, as half as many in flight take as long, the baseline follows
    /// and the limit goes back, within seconds, not the baseline's minute.
    #[test]
    fn an_upstream_that_got_slower_is_followed_within_seconds() {
        let mut l = limiter();
        let mut clock = Instant::now();
        feed(&mut l, &mut clock, 100, ms(20), demand(64));
        let before = l.limit();
        assert!(before >= 60, "grown to the demand: {before}");
        let mut lowest = before;
        let mut back_after = None;
        for window in 0..100 {
            feed(&mut l, &mut clock, 1, ms(100), demand(64));
            lowest = lowest.min(l.limit());
            if l.limit() >= before && lowest < before {
                back_after = Some(window);
                break;
            }
        }
        let back_after = back_after.expect("back within 10 s");
        assert!(back_after <= 60, "back after {back_after} windows");
        assert!(lowest < before / 2, "it did shrink first: {lowest}");
    }

    /// After timeouts (an outage), slow answers are its backlog draining:
    /// never taken for a slower upstream, however long they stay slow.
    #[test]
    fn an_outages_backlog_is_not_taken_for_a_slower_upstream() {
        let mut l = limiter();
        let mut clock = Instant::now();
        feed(&mut l, &mut clock, 100, ms(20), demand(64));
        for _ in 0..20 {
            clock += Duration::from_millis(100);
            l.update(Sample::Dropped, PathKey::NONE, l.limit(), 64, clock);
        }
        // The breaker closes: slow start back, on answers as fast as before.
        l.after_outage(clock);
        feed(&mut l, &mut clock, 10, ms(20), demand(64));
        assert!(l.limit() >= 32, "back by slow start: {}", l.limit());
        // Then answers ten times slower, whatever is in flight, for 5 s:
        // the backlog the other sidecars left, not a new normal.
        feed(&mut l, &mut clock, 50, ms(200), demand(64));
        assert!(l.limit() <= 16, "stays down: {}", l.limit());
    }

    /// A few attempts time out, then the upstream answers, slower than
    /// before but steadily, a request every half second: the limit went to
    /// its floor, and latency that holds there is the upstream's own. The
    /// baseline follows within seconds, and the limit grows to the demand,
    /// rather than staying at the floor until the old baseline ages out.
    #[test]
    fn a_slower_upstream_after_a_few_timeouts_is_followed_from_the_floor() {
        let mut l = limiter();
        let mut clock = Instant::now();
        feed(&mut l, &mut clock, 20, ms(5), demand(2));
        for _ in 0..3 {
            clock += Duration::from_millis(200);
            l.update(Sample::Dropped, PathKey::NONE, 3, 0, clock);
        }
        // One answer every 500 ms taking 1.2 s: about three in flight are
        // wanted; the limit lets one and the others wait.
        let mut grown_after = None;
        for i in 0..60 {
            clock += Duration::from_millis(500);
            let (in_flight, queued) = (l.limit().min(3), 3usize.saturating_sub(l.limit()));
            l.update(ms(1200), PathKey::NONE, in_flight, queued, clock);
            if l.limit() >= 2 && grown_after.is_none() && i > 0 {
                grown_after = Some(i);
            }
        }
        let grown_after = grown_after.expect("grown off the floor within 30 s");
        assert!(
            grown_after <= 24,
            "off the floor after {grown_after} answers (12 s)"
        );
        assert!(l.limit() >= 3, "grown to the demand: {}", l.limit());
        assert!(
            l.wait().is_some_and(|w| w >= Duration::from_secs(1)),
            "the wait follows the new baseline: {:?}",
            l.wait()
        );
    }

    /// An upstream that queues: latency falls as what is in flight falls.
    /// The baseline stays, and the limit stays down.
    #[test]
    fn an_upstream_that_queues_is_not_taken_for_a_slower_one() {
        let mut l = limiter();
        let mut clock = Instant::now();
        // 20 ms up to 64 in flight: the limit grows to the demand.
        queueing(&mut l, &mut clock, 100, 20, 64, 64);
        assert!(l.limit() >= 60, "{}", l.limit());
        // Then it serves well only up to 16 (another client took the rest):
        // 80 ms at 64 in flight, 20 ms at 16.
        queueing(&mut l, &mut clock, 200, 20, 16, 64);
        assert!(
            l.limit() <= 40,
            "stays near what the upstream serves: {}",
            l.limit()
        );
    }

    #[test]
    fn grows_while_requests_wait_and_never_past_the_demand() {
        let (mut l, mut clock) = (limiter(), Instant::now());
        feed(&mut l, &mut clock, 5, ms(10), pressed(1000));
        assert!(l.limit() > 60, "slow start: {}", l.limit());
        // 30 in flight and 5 waiting: no further than 35.
        let mut l = limiter();
        feed(&mut l, &mut clock, 50, ms(10), |l| (l.limit().min(30), 5));
        assert_eq!(l.limit(), 35);
        // Nobody waiting: no growth at all.
        let mut l = limiter();
        feed(&mut l, &mut clock, 50, ms(10), |l| (l.limit(), 0));
        assert_eq!(l.limit(), 20);
    }

    #[test]
    fn an_idle_sidecar_comes_down_to_what_its_traffic_uses() {
        let (mut l, mut clock) = (limiter(), Instant::now());
        // Two in flight for a while: the limit falls to 2 * 2 + 2.
        for _ in 0..300 {
            clock += Duration::from_millis(50);
            l.update(ms(10), PathKey::NONE, 2, 0, clock);
            l.relax(0, clock);
        }
        assert_eq!(l.limit(), 6);
        // No traffic at all for two periods: 2, the headroom.
        for _ in 0..11 {
            clock += Duration::from_secs(1);
            l.relax(0, clock);
        }
        assert_eq!(l.limit(), 2);
        // Three attempts that take long to answer, and no sample meanwhile:
        // they are the use, and the limit leaves room beside them.
        for _ in 0..11 {
            clock += Duration::from_secs(1);
            l.relax(3, clock);
        }
        assert_eq!(l.limit(), 2, "never raised by relaxing");
        let mut held = limiter();
        for _ in 0..11 {
            clock += Duration::from_secs(1);
            held.relax(3, clock);
        }
        assert_eq!(held.limit(), 8, "2 x 3 + 2");
        // A sidecar just started keeps its initial limit until its use is known.
        let mut fresh = limiter();
        fresh.relax(0, Instant::now());
        assert_eq!(fresh.limit(), 20);
    }

    #[test]
    fn falls_as_latency_rises_and_recovers_when_it_drops() {
        let (mut l, mut clock) = (limiter(), Instant::now());
        feed(&mut l, &mut clock, 20, ms(10), pressed(100));
        let healthy = l.limit();
        assert!(healthy > 100, "{healthy}");
        // It queues past 8 in flight: 10 ms at 8, 200 ms at 160.
        queueing(&mut l, &mut clock, 30, 10, 8, 400);
        let slow = l.limit();
        assert!(slow < healthy / 4, "{slow} vs {healthy}");
        feed(&mut l, &mut clock, 20, ms(10), pressed(100));
        assert!(
            l.limit() > slow * 2,
            "recovered to {} from {slow}",
            l.limit()
        );
    }

    #[test]
    fn a_single_slow_window_is_not_a_collapse() {
        let (mut l, mut clock) = (limiter(), Instant::now());
        feed(&mut l, &mut clock, 10, ms(1), pressed(1000));
        let healthy = l.limit();
        feed(&mut l, &mut clock, 1, ms(5), |l| (l.limit(), 0));
        assert!(
            l.limit() as f64 > healthy as f64 * 0.85,
            "{} after a hiccup from {healthy}",
            l.limit()
        );
    }

    #[test]
    fn a_long_overload_does_not_become_the_baseline() {
        let (mut l, mut clock) = (limiter(), Instant::now());
        feed(&mut l, &mut clock, 20, ms(100), pressed(100));
        // Twenty seconds of an upstream that queues past 4 in flight: the
        // limit stays down, where an average would have come to take four
        // times the latency for normal.
        queueing(&mut l, &mut clock, 200, 100, 4, 400);
        assert!(l.limit() <= 8, "{}", l.limit());
    }

    #[test]
    fn timeouts_shrink_it_to_the_floor_and_no_further() {
        let (mut l, mut clock) = (limiter(), Instant::now());
        for _ in 0..100 {
            clock += Duration::from_millis(100);
            l.update(Sample::Dropped, PathKey::NONE, 0, 0, clock);
        }
        assert_eq!(l.limit(), 1);
    }

    #[test]
    fn timeouts_together_cut_it_once() {
        let (mut l, clock) = (limiter(), Instant::now());
        for _ in 0..30 {
            l.update(Sample::Dropped, PathKey::NONE, 20, 0, clock);
        }
        assert_eq!(l.limit(), 10, "one cut by half from 20");
    }

    /// Answers within the tolerance with everybody waiting, one every
    /// 5 ms, until the limit reaches `to` or `most` answers came; how many.
    fn answers_until(l: &mut Limiter, clock: &mut Instant, to: usize, most: usize) -> usize {
        let mut answers = 0;
        while l.limit() < to && answers < most {
            *clock += Duration::from_millis(5);
            l.update(ms(100), PathKey::NONE, l.limit(), 1000, *clock);
            answers += 1;
        }
        answers
    }

    #[test]
    fn after_an_outage_it_comes_back_fast_to_the_calm_level_then_slowly() {
        let (mut l, mut clock) = (limiter(), Instant::now());
        // Calm at 20 in flight, nobody waiting.
        feed(&mut l, &mut clock, 20, ms(100), |_| (20, 0));
        for _ in 0..100 {
            clock += Duration::from_millis(100);
            l.update(Sample::Dropped, PathKey::NONE, 1, 0, clock);
        }
        assert_eq!(l.limit(), 1);
        // The upstream is back and everybody waits: two per answer up to
        // the calm level, which ten seconds of outage took down by a fifth ...
        let fast = answers_until(&mut l, &mut clock, 15, 100);
        assert!(fast <= 8, "{fast} answers to get back to 15");
        // ... then one per limit's worth of answers.
        let slow = answers_until(&mut l, &mut clock, 20, 1000);
        assert!((60..=120).contains(&slow), "{slow} answers from 15 to 20");
    }

    #[test]
    fn a_breaker_closing_after_an_outage_brings_traffic_back_by_slow_start_to_the_calm_level() {
        let (mut l, mut clock) = (limiter(), Instant::now());
        // Calm at 4 in flight: the use bound takes the limit to 10.
        for _ in 0..400 {
            clock += Duration::from_millis(25);
            l.update(ms(100), PathKey::NONE, 4, 0, clock);
            l.relax(0, clock);
        }
        assert_eq!(l.limit(), 10);
        // An outage that failed fast cut nothing; the breaker closes and
        // every caller's retry waits: slow start stops at the limit now
        // (above the calm level), then one per round trip.
        l.after_outage(clock);
        let answers = answers_until(&mut l, &mut clock, 12, 1000);
        assert!(answers >= 15, "{answers} answers from 10 to 12");
        // Trouble is forgotten after 30 s: a burst then grows by slow start.
        clock += FORGET;
        let answers = answers_until(&mut l, &mut clock, 30, 1000);
        assert!(answers <= 10, "{answers} answers to 30");
    }

    #[test]
    fn a_caller_who_gives_up_early_moves_nothing_one_who_waited_long_does() {
        let (mut l, mut clock) = (limiter(), Instant::now());
        feed(&mut l, &mut clock, 20, ms(100), pressed(10));
        let before = l.limit();
        let early = Sample::Unanswered(Duration::from_millis(150));
        feed(&mut l, &mut clock, 20, early, |l| (l.limit(), 0));
        assert_eq!(l.limit(), before, "150 ms is within the tolerance");
        let late = Sample::Unanswered(Duration::from_secs(2));
        feed(&mut l, &mut clock, 20, late, |l| (l.limit(), 0));
        assert!(l.limit() < before / 2, "{} from {before}", l.limit());
    }

    #[test]
    fn only_answers_timeouts_and_waits_cut_short_are_samples() {
        use crate::policy::outcome::Refusal;
        let second = Duration::from_secs(1);
        let ok = Outcome::Response(http::StatusCode::OK);
        assert_eq!(Sample::of(ok, second), Some(Sample::Latency(second)));
        let timeout = Outcome::Upstream(UpstreamFault::Timeout);
        assert_eq!(Sample::of(timeout, second), Some(Sample::Dropped));
        for o in [Outcome::Caller(CallerFault::Gone), Outcome::Deadline] {
            assert_eq!(Sample::of(o, second), Some(Sample::Unanswered(second)));
        }
        for o in [
            Outcome::Caller(CallerFault::MalformedBody),
            Outcome::Caller(CallerFault::StalledBody),
            Outcome::Upstream(UpstreamFault::ConnectFailure),
            Outcome::Refused(Refusal::Overloaded),
        ] {
            assert_eq!(Sample::of(o, second), None, "{o:?}");
        }
    }

    #[test]
    fn never_above_max_in_flight() {
        let (mut l, mut clock) = (limiter(), Instant::now());
        feed(&mut l, &mut clock, 200, ms(1), pressed(100_000));
        assert_eq!(l.limit(), 1000);
    }

    #[test]
    fn the_wait_for_a_slot_follows_the_baseline() {
        let (mut l, mut clock) = (limiter(), Instant::now());
        assert_eq!(l.wait(), None);
        feed(&mut l, &mut clock, 2, ms(100), |_| (1, 0));
        assert_eq!(l.wait(), Some(Duration::from_millis(800)));
    }

    /// A short run of fast answers (a few requests to a cached or trivial
    /// path), then the upstream's usual traffic, twenty times slower and
    /// not queueing (as slow with one in flight as with four): the fast run
    /// is not the upstream's norm, and the usual traffic is not held back
    /// for it.
    #[test]
    fn a_short_run_of_fast_answers_does_not_hold_back_the_usual_traffic() {
        let mut l = limiter();
        let mut clock = Instant::now();
        feed(&mut l, &mut clock, 3, ms(1), demand(2));
        let mut held = 0;
        let mut lowest = usize::MAX;
        for _ in 0..100 {
            feed(&mut l, &mut clock, 1, ms(20), demand(4));
            lowest = lowest.min(l.limit());
            held += usize::from(l.limit() < 4);
        }
        assert!(
            held <= 5,
            "held back for {held} windows of 100, lowest {lowest}"
        );
    }

    /// Steady traffic of two kinds, a millisecond and twenty, mixed at
    /// random (a tenth of a second holds ten of them, so its average moves
    /// between a few milliseconds and fifteen), not queueing: over a minute,
    /// the mix's luckiest windows do not become the norm.
    #[test]
    fn a_steady_mix_of_fast_and_slow_answers_is_not_held_back() {
        let mut l = limiter();
        let mut clock = Instant::now();
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        let mut held = 0;
        for _ in 0..600 {
            for _ in 0..10 {
                // xorshift: the same mix every run.
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                let latency = if seed & 1 == 0 { ms(1) } else { ms(20) };
                clock += Duration::from_millis(10);
                let (in_flight, queued) = demand(4)(&l);
                l.update(latency, PathKey::NONE, in_flight, queued, clock);
            }
            held += usize::from(l.limit() < 4);
        }
        assert!(held <= 6, "held back for {held} windows of 600");
    }

    /// Callers that each send again as soon as answered, through the limit:
    /// `phases` of (seconds, callers, latency in ms), the upstream not
    /// queueing (as fast with one in flight as with all). Fast answers come
    /// as many times more often as they are faster, as they do on the wire.
    /// Gives back the seconds of the last phase in which a caller waited.
    fn closed_loop(l: &mut Limiter, clock: &mut Instant, phases: &[(f64, usize, u64)]) -> f64 {
        let mut waited = 0.0;
        for (i, &(seconds, callers, latency)) in phases.iter().enumerate() {
            let end = *clock + Duration::from_secs_f64(seconds);
            while *clock < end {
                let served = l.limit().min(callers).max(1);
                let step = Duration::from_secs_f64(latency as f64 / 1000.0 / served as f64);
                *clock += step;
                if i + 1 == phases.len() && served < callers {
                    waited += step.as_secs_f64();
                }
                l.update(ms(latency), PathKey::NONE, served, callers - served, *clock);
            }
        }
        waited
    }

    /// A burst of a fast path (16 callers at 1 ms, 0.3 s of it 4,800
    /// answers) on a fresh limiter, then the usual traffic (16 callers at
    /// 20 ms): the burst is not the norm. Before a whole span is in, the
    /// baseline is the median window so far, so that callers wait at most
    /// as long as the burst lasted.
    #[test]
    fn a_burst_of_fast_answers_at_their_own_rate_does_not_hold_back_the_usual_traffic() {
        for burst in [0.1, 0.3, 0.45, 0.8, 1.2] {
            let mut l = limiter();
            let mut clock = Instant::now();
            let waited = closed_loop(&mut l, &mut clock, &[(burst, 16, 1), (12.0, 16, 20)]);
            assert!(
                waited <= burst,
                "after {burst} s of fast answers, callers waited {waited:.2} s of 12"
            );
            assert!(l.limit() >= 16, "{}", l.limit());
        }
    }

    /// The same burst in the middle of the usual traffic (8 callers at 20
    /// ms), from 16 callers of its own: the usual callers are not held back
    /// after it.
    #[test]
    fn a_burst_of_fast_answers_amid_usual_traffic_does_not_hold_it_back() {
        for burst in [0.4, 0.8, 1.2] {
            let mut l = limiter();
            let mut clock = Instant::now();
            closed_loop(&mut l, &mut clock, &[(10.0, 8, 20)]);
            // The burst's windows are its own: mixed ones average to a few ms.
            let waited = closed_loop(&mut l, &mut clock, &[(burst, 24, 2), (10.0, 8, 20)]);
            assert!(
                waited < 0.5,
                "after a burst of {burst} s, callers waited {waited:.2} s of 10"
            );
        }
    }
}
