//! The limit before an upstream whose paths answer at different speeds:
//! callers that each send again as soon as answered, each to its own path,
//! through the limit, as on the wire (fast answers come as many times more
//! often as they are faster).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::time::Duration;

use tokio::time::Instant;

use super::{Limiter, Sample};
use crate::policy::paths::PathKey;
use crate::policy::settings::AdaptiveConfig;

/// `callers` callers, each request to one of `paths` at random: (the
/// path, 0 for none; the milliseconds it is answered in).
struct Group {
    callers: usize,
    paths: Vec<(u32, f64)>,
}

/// `callers` callers, each asking `path` (0: none), answered in `ms`.
fn group(callers: usize, path: u32, ms: f64) -> Group {
    mixed(callers, vec![(path, ms)])
}

fn mixed(callers: usize, paths: Vec<(u32, f64)>) -> Group {
    Group { callers, paths }
}

/// A stretch of `seconds` of `groups`' traffic, the upstream `slower` times
/// as slow as their `ms` on every path; serving `knee` at a time and
/// queueing above (0: never queueing).
struct Phase<'a> {
    seconds: f64,
    groups: &'a [Group],
    slower: f64,
    knee: usize,
}

fn phase(seconds: f64, groups: &[Group]) -> Phase<'_> {
    Phase {
        seconds,
        groups,
        slower: 1.0,
        knee: 0,
    }
}

/// What the callers of the last phase met over its last `tail` seconds.
#[derive(Debug, Default)]
struct Met {
    /// Seconds a caller waited for a slot, on average over the callers.
    waited: f64,
    /// The mean of attempts in flight.
    in_flight: f64,
    /// The lowest limit.
    lowest: usize,
}

/// An attempt in flight: when it is answered, the phase and group of its
/// caller, its path and latency.
type Flying = (Instant, usize, usize, u32, Duration);

/// Drives `l` through `phases` (an event per answer), and gives back what
/// the last phase's callers met in its last `tail` seconds.
fn drive(l: &mut Limiter, clock: &mut Instant, phases: &[Phase], tail: f64) -> Met {
    let mut flying: BinaryHeap<Reverse<Flying>> = BinaryHeap::new();
    // xorshift: the same mix every run.
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let mut met = Met {
        lowest: usize::MAX,
        ..Met::default()
    };
    for (p, ph) in phases.iter().enumerate() {
        let mut waiting: VecDeque<usize> = (0..ph.groups.len())
            .flat_map(|g| std::iter::repeat_n(g, ph.groups[g].callers))
            .collect();
        let end = *clock + Duration::from_secs_f64(ph.seconds);
        let from = end - Duration::from_secs_f64(tail.min(ph.seconds));
        let last = p + 1 == phases.len();
        loop {
            // Start what the limit lets, each at the upstream's speed now.
            while flying.len() < l.limit().max(1) {
                let Some(g) = waiting.pop_front() else { break };
                let queueing = match ph.knee {
                    0 => 1.0,
                    knee => ((flying.len() + 1) as f64 / knee as f64).max(1.0),
                };
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                let paths = &ph.groups[g].paths;
                let (path, ms) = paths[seed as usize % paths.len()];
                let ms = ms * ph.slower * queueing;
                let took = Duration::from_secs_f64(ms / 1000.0);
                flying.push(Reverse((*clock + took, p, g, path, took)));
            }
            let Some(&Reverse((at, ..))) = flying.peek() else {
                break;
            };
            if at > end {
                break;
            }
            if last && at > from {
                let dt = at
                    .saturating_duration_since((*clock).max(from))
                    .as_secs_f64();
                met.waited += waiting.len() as f64 * dt;
                met.in_flight += flying.len() as f64 * dt;
            }
            let Some(Reverse((at, from_phase, g, path, took))) = flying.pop() else {
                break;
            };
            *clock = at;
            let path = PathKey::from_raw(path);
            let in_flight = flying.len() + 1;
            l.update(Sample::Latency(took), path, in_flight, waiting.len(), at);
            if last && at > from {
                met.lowest = met.lowest.min(l.limit());
            }
            // The caller asks again; one of an earlier phase has left.
            if from_phase == p {
                waiting.push_back(g);
            }
        }
        *clock = end;
        if last {
            let callers: usize = ph.groups.iter().map(|g| g.callers).sum();
            let seconds = tail.min(ph.seconds);
            met.waited /= callers.max(1) as f64;
            met.in_flight /= seconds;
        }
    }
    met
}

/// Asserts that `callers` callers were not held back (`what` the case).
fn served(met: &Met, callers: usize, what: &str) {
    assert!(
        met.waited < 0.05 && met.lowest >= callers,
        "{what}: callers waited {:.2} s, the limit down to {} ({callers} callers)",
        met.waited,
        met.lowest
    );
}

fn limiter() -> Limiter {
    let config = AdaptiveConfig {
        enabled: true,
        min_limit: 1,
        initial_limit: 20,
        tolerance: 2.0,
        smoothing: 0.2,
    };
    Limiter::try_new(&config, 1000).unwrap()
}

/// Sixteen callers, each request to a fast path (1 ms) or a slow one (20
/// ms) at random; then the upstream gets five times slower on both, not
/// queueing (a deploy, a cold cache): within seconds the limit lets all
/// sixteen through again. Held against one baseline for the upstream (the
/// paths unknown), fast answers five times slower are still within the
/// tolerance of the mix's baseline and keep growing the limit back, so
/// in-flight never halves and the limit stays under the callers until the
/// old baseline ages out.
#[test]
fn a_mixed_upstream_that_got_slower_is_followed() {
    for (fast, slow) in [(1, 2), (0, 0)] {
        let groups = [mixed(16, vec![(fast, 1.0), (slow, 20.0)])];
        let mut l = limiter();
        let mut clock = Instant::now();
        drive(&mut l, &mut clock, &[phase(20.0, &groups)], 1.0);
        let slower = Phase {
            slower: 5.0,
            ..phase(15.0, &groups)
        };
        let met = drive(&mut l, &mut clock, &[slower], 10.0);
        match fast {
            // On their own paths: followed.
            1 => served(&met, 16, "the last 10 s"),
            // Paths unknown: held back.
            _ => assert!(met.waited > 1.0 && met.lowest < 16, "{met:?}"),
        }
    }
}

/// Traffic that moves from nine tenths fast answers (1 ms) to nine tenths
/// slow ones (20 ms), the upstream as fast as ever on each path: not a
/// slower upstream, and no caller is held back.
#[test]
fn a_shift_of_the_mix_toward_slow_paths_is_not_a_slower_upstream() {
    let mut l = limiter();
    let mut clock = Instant::now();
    let before = [group(18, 1, 1.0), group(2, 2, 20.0)];
    let after = [group(2, 1, 1.0), group(18, 2, 20.0)];
    let met = drive(
        &mut l,
        &mut clock,
        &[phase(20.0, &before), phase(15.0, &after)],
        14.0,
    );
    served(&met, 20, "after the shift");
}

/// A burst of a fast path (16 callers at 1 ms) for three seconds, long
/// enough to fill a whole span of the upstream's baseline, beside the usual
/// traffic (8 callers at 20 ms on another path): the usual callers are not
/// held back after it.
#[test]
fn a_long_burst_of_a_fast_path_does_not_hold_back_the_usual_traffic() {
    let mut l = limiter();
    let mut clock = Instant::now();
    let usual = [group(8, 1, 20.0), group(2, 2, 1.0)];
    let burst = [group(8, 1, 20.0), group(16, 2, 1.0)];
    let met = drive(
        &mut l,
        &mut clock,
        &[phase(10.0, &usual), phase(3.0, &burst), phase(10.0, &usual)],
        10.0,
    );
    served(&met, 10, "after a 3 s burst");
}

/// A burst of fast answers on the usual traffic's own path (16 callers
/// at 1 ms: ids a cache holds, or a caller asking for ones that do not
/// exist) for up to a second: the path's baseline is of its windows, not
/// its answers, and the usual callers are not held back after it.
#[test]
fn a_burst_of_fast_answers_on_the_usual_path_does_not_hold_it_back() {
    for burst in [0.3, 0.6, 1.0] {
        let mut l = limiter();
        let mut clock = Instant::now();
        let usual = [group(8, 1, 20.0)];
        let with_burst = [group(8, 1, 20.0), group(16, 1, 1.0)];
        let met = drive(
            &mut l,
            &mut clock,
            &[
                phase(10.0, &usual),
                phase(burst, &with_burst),
                phase(10.0, &usual),
            ],
            10.0,
        );
        served(&met, 8, &format!("after a {burst} s burst"));
    }
}

/// Per-path baselines still see queueing: an upstream that serves 8 at a
/// time and queues above, before 32 callers of two paths, has the limit
/// brought down toward what it serves, not to the callers.
#[test]
fn a_mixed_upstream_that_queues_is_still_protected() {
    let mut l = limiter();
    let mut clock = Instant::now();
    let groups = [group(16, 1, 2.0), group(16, 2, 20.0)];
    let calm = [group(2, 1, 2.0), group(2, 2, 20.0)];
    let queueing = Phase {
        knee: 8,
        ..phase(20.0, &groups)
    };
    let met = drive(&mut l, &mut clock, &[phase(10.0, &calm), queueing], 10.0);
    assert!(
        met.in_flight <= 20.0,
        "{:.1} in flight on average before an upstream that serves 8",
        met.in_flight
    );
}
