//! Each path's own usual latency, for the adaptive limit.
//!
//! Why: one upstream answers some paths in a millisecond and others in
//! fifty. A window's average then moves with the mix of paths as much as
//! with the upstream's load: a shift toward the slow paths looks like a
//! slower upstream, and an upstream that got slower on every path still
//! answers its fast paths within the tolerance, so that they keep growing
//! the limit back. So each answer is held against its own path's baseline:
//! the window's latency is the mean of those ratios.
//!
//! A path's baseline is the lowest mean of its answers over a span (at
//! least [`MIN_SAMPLES`] of them, gathered until one of the upstream's
//! baseline spans closes), over the current period of the upstream's
//! baseline and the one before (30 to 60 s): a minimum, so that a long
//! overload does not become the norm. The mean of the span's windows (each
//! window's mean of the path's answers in it), not of its answers: fast
//! answers come as many times more often as they are faster, and a short
//! burst of them (ids a cache holds, beside the usual ones) would be most
//! of the answers, and make the path's usual answers look slow. Paths are
//! the breakers' (`/orders/42` is `/orders/*`, see [`crate::policy::paths`]).
//!
//! Bounded: at most [`MAX_PATHS`] paths per upstream (48 bytes each). When
//! all are taken, a new path takes the place of the one with the fewest
//! answers among those not yet with a baseline, or is not tracked; a path
//! not tracked, or not yet with a baseline, is held against the upstream's
//! own baseline, as every answer was before. While answers go untracked
//! for want of room, each span makes room: the paths that had less than a
//! quarter of an equal share of the span's answers are forgotten, so that a
//! caller cannot hold the table with a trickle to many paths; it would need
//! a quarter of all the traffic.

use crate::policy::paths::PathKey;

/// Paths tracked per upstream at most.
pub const MAX_PATHS: usize = 64;

/// A path's span holds at least this many answers.
pub const MIN_SAMPLES: u32 = 16;

/// Periods a path's answers may take to make a span before they are
/// dropped (too few to tell its latency; it is held against the upstream's
/// baseline meanwhile).
const SPARSE_PERIODS: u8 = 2;

/// The shortest baseline a path may have (a microsecond): a ratio against
/// it stays finite.
const LEAST: f64 = 1e-6;

/// The paths of one upstream and their baselines.
#[derive(Debug, Clone, Default)]
pub struct PathLatencies {
    entries: Vec<Entry>,
    /// Answers since the last span that found no room ...
    untracked: u32,
    /// ... and since the start.
    untracked_total: u64,
}

#[derive(Debug, Clone)]
struct Entry {
    key: PathKey,
    /// Answers of the window being gathered: their sum (seconds), their count.
    sum: f64,
    count: u32,
    /// The span being gathered: its windows' means added up (seconds), its
    /// windows, its answers.
    span_sum: f64,
    windows: u32,
    answers: u32,
    /// Periods the span has been gathered over.
    periods: u8,
    /// Answers since the upstream's last span closed.
    heard: u32,
    /// The lowest span mean of this period and of the last (0: none).
    current: f32,
    previous: f32,
}

impl Entry {
    fn new(key: PathKey) -> Self {
        Self {
            key,
            sum: 0.0,
            count: 0,
            span_sum: 0.0,
            windows: 0,
            answers: 0,
            periods: 0,
            heard: 0,
            current: 0.0,
            previous: 0.0,
        }
    }

    fn base(&self) -> Option<f64> {
        let low = match (self.current > 0.0, self.previous > 0.0) {
            (true, true) => self.current.min(self.previous),
            (true, false) => self.current,
            (false, true) => self.previous,
            (false, false) => return None,
        };
        Some(f64::from(low).max(LEAST))
    }

    /// Begins the span again, its answers dropped.
    fn drop_span(&mut self) {
        (self.sum, self.count) = (0.0, 0);
        (self.span_sum, self.windows, self.answers, self.periods) = (0.0, 0, 0, 0);
    }
}

impl PathLatencies {
    /// An answer on `key` after `latency` seconds: its ratio to the path's
    /// baseline (before this answer), when the path has one.
    pub fn answer(&mut self, key: PathKey, latency: f64) -> Option<f64> {
        if key == PathKey::NONE {
            return None;
        }
        let entry = match self.entries.iter().position(|e| e.key == key) {
            Some(i) => &mut self.entries[i],
            None => match self.insert(key) {
                Some(entry) => entry,
                None => {
                    self.untracked = self.untracked.saturating_add(1);
                    self.untracked_total += 1;
                    return None;
                }
            },
        };
        let ratio = entry.base().map(|b| latency / b);
        entry.sum += latency;
        entry.count = entry.count.saturating_add(1);
        entry.answers = entry.answers.saturating_add(1);
        entry.heard = entry.heard.saturating_add(1);
        ratio
    }

    /// `latency` seconds on `key` against the path's baseline, without
    /// counting it as an answer (a caller that left before one came).
    pub fn ratio(&self, key: PathKey, latency: f64) -> Option<f64> {
        if key == PathKey::NONE {
            return None;
        }
        let entry = self.entries.iter().find(|e| e.key == key)?;
        entry.base().map(|b| latency / b)
    }

    /// A new path's entry; when all are taken, in place of the one with
    /// the fewest answers among those with no baseline yet (none: the
    /// path is not tracked).
    fn insert(&mut self, key: PathKey) -> Option<&mut Entry> {
        if self.entries.len() < MAX_PATHS {
            self.entries.push(Entry::new(key));
            return self.entries.last_mut();
        }
        let slot = self
            .entries
            .iter_mut()
            .filter(|e| e.base().is_none())
            .min_by_key(|e| e.answers)?;
        *slot = Entry::new(key);
        Some(slot)
    }

    /// The limit's window closed: each path's answers in it make one mean
    /// of its span.
    pub fn window_closed(&mut self) {
        for e in &mut self.entries {
            if e.count > 0 {
                e.span_sum += e.sum / f64::from(e.count);
                e.windows += 1;
                (e.sum, e.count) = (0.0, 0);
            }
        }
    }

    /// The upstream's baseline closed a span (`rolled`: and began a new
    /// period), after the window it closed with: each path with enough
    /// answers closes its own, and its mean is its baseline if lower; at a
    /// new period the current lows become the last, and paths not heard
    /// from for a whole period are forgotten.
    pub fn span_closed(&mut self, rolled: bool) {
        for e in &mut self.entries {
            if e.answers >= MIN_SAMPLES && e.windows > 0 {
                let mean = (e.span_sum / f64::from(e.windows)).max(LEAST) as f32;
                e.current = match e.current > 0.0 {
                    true => e.current.min(mean),
                    false => mean,
                };
                e.drop_span();
            }
            if !rolled {
                continue;
            }
            e.previous = std::mem::take(&mut e.current);
            if e.answers > 0 {
                e.periods = e.periods.saturating_add(1);
                if e.periods >= SPARSE_PERIODS {
                    e.drop_span();
                }
            }
        }
        if rolled {
            self.entries.retain(|e| e.answers > 0 || e.previous > 0.0);
        }
        self.make_room();
    }

    /// While answers found no room, forgets the paths that had less than a
    /// quarter of an equal share of the span's answers; begins counting again.
    fn make_room(&mut self) {
        if self.untracked > 0 && self.entries.len() >= MAX_PATHS {
            let heard: u64 = self.entries.iter().map(|e| u64::from(e.heard)).sum();
            let total = heard + u64::from(self.untracked);
            // A quarter of an equal share: total / (4 × MAX_PATHS).
            self.entries
                .retain(|e| u64::from(e.heard) * 4 * MAX_PATHS as u64 >= total);
        }
        self.untracked = 0;
        for e in &mut self.entries {
            e.heard = 0;
        }
    }

    /// The upstream got slower by `factor` on every path, not queueing:
    /// each path's baseline is its lowest times `factor`, begun again, and
    /// the answers gathered before it are dropped.
    pub fn rebase(&mut self, factor: f64) {
        for e in &mut self.entries {
            e.current = e.base().map_or(0.0, |b| (b * factor) as f32);
            e.previous = 0.0;
            e.drop_span();
        }
    }

    /// Paths tracked now.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Answers that found no room in the table, since the start.
    pub fn untracked(&self) -> u64 {
        self.untracked_total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u32) -> PathKey {
        PathKey::from_raw(n)
    }

    /// A window closes, and with it a span of the upstream's.
    fn close(p: &mut PathLatencies, rolled: bool) {
        p.window_closed();
        p.span_closed(rolled);
    }

    /// Whether `latency` on `k` is its path's baseline.
    fn usual(p: &PathLatencies, k: PathKey, latency: f64) -> bool {
        p.ratio(k, latency).is_some_and(|r| (r - 1.0).abs() < 1e-3)
    }

    /// `n` answers on each of the table's [`MAX_PATHS`] paths, keys 1 up.
    fn fill_table(p: &mut PathLatencies, latency: f64, n: u32) {
        for k in 1..=MAX_PATHS as u32 {
            fill(p, key(k), latency, n);
        }
    }

    fn fill(p: &mut PathLatencies, k: PathKey, latency: f64, n: u32) {
        for _ in 0..n {
            p.answer(k, latency);
        }
    }

    #[test]
    fn a_path_has_a_baseline_once_a_span_of_enough_answers_closed() {
        let mut p = PathLatencies::default();
        assert_eq!(p.answer(key(1), 0.02), None);
        fill(&mut p, key(1), 0.02, MIN_SAMPLES - 2);
        close(&mut p, false);
        assert_eq!(p.ratio(key(1), 0.02), None, "one answer short");
        p.answer(key(1), 0.02);
        close(&mut p, false);
        let r = p.answer(key(1), 0.04).unwrap();
        assert!((r - 2.0).abs() < 1e-3, "{r}");
        assert_eq!(p.answer(PathKey::NONE, 0.04), None);
    }

    #[test]
    fn the_baseline_is_the_lowest_span_mean_of_two_periods() {
        let mut p = PathLatencies::default();
        fill(&mut p, key(1), 0.01, 20);
        close(&mut p, false);
        fill(&mut p, key(1), 0.05, 20);
        close(&mut p, false);
        assert!(usual(&p, key(1), 0.01));
        // A period on: the low is the last period's.
        close(&mut p, true);
        fill(&mut p, key(1), 0.05, 20);
        close(&mut p, false);
        assert!(usual(&p, key(1), 0.01));
        // Two on: only what the last period saw.
        close(&mut p, true);
        assert!(usual(&p, key(1), 0.05));
        // A path not heard from for a whole period is forgotten.
        close(&mut p, true);
        close(&mut p, true);
        assert_eq!(p.len(), 0);
    }

    #[test]
    fn answers_too_sparse_for_a_span_are_dropped_after_two_periods() {
        let mut p = PathLatencies::default();
        fill(&mut p, key(1), 0.5, MIN_SAMPLES - 1);
        close(&mut p, true);
        close(&mut p, true);
        // Dropped and forgotten: its slow old answers make no baseline.
        assert_eq!(p.len(), 0);
        fill(&mut p, key(1), 0.001, MIN_SAMPLES);
        close(&mut p, false);
        assert!(usual(&p, key(1), 0.001));
    }

    /// A caller spraying paths takes the places of paths with no baseline,
    /// never of those with one; the table never grows past its bound.
    #[test]
    fn a_spray_of_paths_never_displaces_one_with_a_baseline() {
        let mut p = PathLatencies::default();
        fill(&mut p, key(1), 0.02, MIN_SAMPLES);
        close(&mut p, false);
        for n in 2..100_000 {
            p.answer(key(n), 0.001);
            assert!(p.len() <= MAX_PATHS);
        }
        assert!(usual(&p, key(1), 0.02));
        // All taken by paths with a baseline: a new one is not tracked.
        let mut p = PathLatencies::default();
        fill_table(&mut p, 0.02, MIN_SAMPLES);
        close(&mut p, false);
        assert_eq!(p.answer(key(1000), 0.02), None);
        assert_eq!(p.len(), MAX_PATHS);
        assert_eq!(p.ratio(key(1000), 0.02), None);
    }

    #[test]
    fn a_rebase_scales_every_baseline_and_drops_the_answers_before_it() {
        let mut p = PathLatencies::default();
        fill(&mut p, key(1), 0.001, 20);
        fill(&mut p, key(2), 0.02, 20);
        close(&mut p, false);
        fill(&mut p, key(1), 0.004, 10);
        p.rebase(5.0);
        assert!(usual(&p, key(1), 0.005));
        assert!(usual(&p, key(2), 0.1));
        fill(&mut p, key(1), 0.005, MIN_SAMPLES);
        close(&mut p, false);
        // Had the 4 ms answers from before been kept, this span's mean
        // would be lower than 5 ms.
        assert!(usual(&p, key(1), 0.005));
    }

    /// Answers of any size, zero and huge included, give finite ratios.
    #[test]
    fn ratios_stay_finite() {
        let mut p = PathLatencies::default();
        fill(&mut p, key(1), 0.0, MIN_SAMPLES);
        close(&mut p, false);
        let r = p.answer(key(1), 1e9).unwrap();
        assert!(r.is_finite() && r > 0.0, "{r}");
        fill(&mut p, key(2), 1e30, MIN_SAMPLES);
        close(&mut p, false);
        assert!(p.answer(key(2), 0.0).unwrap().is_finite());
    }

    /// A burst of fast answers on a path (ids a cache holds), twenty times
    /// as many a window as its usual ones, for half a second of a 3 s span:
    /// the path's baseline stays near its usual latency, as its windows,
    /// not its answers, are what a span's mean is of.
    #[test]
    fn a_burst_of_fast_answers_on_a_path_is_not_its_norm() {
        let mut p = PathLatencies::default();
        for window in 0..30 {
            match window < 5 {
                true => fill(&mut p, key(1), 0.001, 200),
                false => fill(&mut p, key(1), 0.02, 10),
            }
            p.window_closed();
        }
        p.span_closed(false);
        let r = p.ratio(key(1), 0.02).unwrap();
        assert!(r < 1.25, "the usual answers are {r:.2} times the baseline");
    }

    /// A trickle of answers to 64 paths, each with a baseline, holds the
    /// table; a path with real traffic that finds no room gets it within a
    /// span, and the trickle alone cannot take it back.
    #[test]
    fn a_trickle_to_many_paths_cannot_hold_the_table() {
        let mut p = PathLatencies::default();
        fill_table(&mut p, 0.001, MIN_SAMPLES);
        close(&mut p, false);
        // Next span: one answer a path, and 1,000 on a path with no room.
        fill_table(&mut p, 0.001, 1);
        fill(&mut p, key(1000), 0.02, 1000);
        assert_eq!(p.ratio(key(1000), 0.02), None);
        assert_eq!(p.untracked(), 1000);
        close(&mut p, false);
        assert!(p.len() < MAX_PATHS, "room made: {}", p.len());
        fill(&mut p, key(1000), 0.02, MIN_SAMPLES);
        fill_table(&mut p, 0.001, 1);
        close(&mut p, false);
        assert!(usual(&p, key(1000), 0.02));
        // Full again of paths of equal traffic: none is forgotten.
        let mut p = PathLatencies::default();
        fill_table(&mut p, 0.001, MIN_SAMPLES);
        fill(&mut p, key(1000), 0.02, 10);
        close(&mut p, false);
        assert_eq!(p.len(), MAX_PATHS);
    }
}
