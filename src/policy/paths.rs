//! Blame narrowed to a path: a breaker per path of a route, beside the
//! route's own.
//!
//! Why: one caller hammering one path the upstream fails (a bad id, a
//! broken endpoint) must not open the breaker of the whole route and black
//! out every other caller's healthy requests. So each path (its first
//! [`SEGMENTS`] segments: `/orders/42/items` is `/orders/42`) that fails
//! gets a breaker of its own, with the route's settings; when it opens, that
//! path alone is refused. The route's breaker does not hear a failure that
//! is the path's alone: the route's last success was on another path (or,
//! while the route has no recent success, another path's attempt started),
//! and no other path failed since. A path that is all of a route's traffic,
//! and failures spread over several paths (an upstream that is down), still
//! open the route as before.
//!
//! Bounded: at most [`MAX_PATHS`] paths are tracked per route, the least
//! recently failing forgotten first; a path is tracked only from its first
//! failure, and forgotten once its breaker is closed with no failure in its
//! window. A healthy route costs a hash of the path and an atomic load per
//! request.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use rand::Rng;
use tokio::time::Instant;

use super::breaker::{Admit, Breaker, Outcome, Snapshot, State, Transition};
use crate::policy::settings::BreakerConfig;

/// Segments of the path that name it: `/orders/42/items` is `/orders/42`.
pub const SEGMENTS: usize = 2;

/// Paths tracked per route at most.
pub const MAX_PATHS: usize = 256;

/// The longest path name kept for `/breakers`.
const MAX_NAME: usize = 128;

/// A path, by the hash of its first [`SEGMENTS`] segments (0: none).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct PathKey(u32);

impl PathKey {
    /// No path: blame goes to the route alone.
    pub const NONE: PathKey = PathKey(0);

    /// A key of the given value (0 is [`PathKey::NONE`]).
    #[cfg(test)]
    pub const fn from_raw(n: u32) -> PathKey {
        PathKey(n)
    }
}

/// Segments taken at most, those that do not count included.
pub const MAX_SEGMENTS: usize = 4;

/// The first [`SEGMENTS`] segments of `path` (without its query), not
/// counting `api` or a version (`v1`, `v2beta1`) among them: the endpoints
/// of `/api/v1/orders` and `/api/v1/users` are told apart. At most
/// [`MAX_SEGMENTS`] in all.
fn prefix(path: &str) -> &str {
    let bytes = path.as_bytes();
    let (mut named, mut taken) = (0, 0);
    let mut start = usize::from(bytes.first() == Some(&b'/'));
    for (i, b) in bytes.iter().enumerate() {
        match b {
            // (Each is ASCII: `i` is a character boundary.)
            b'?' | b'#' => return &path[..i],
            b'/' if i > 0 => {
                taken += 1;
                named += usize::from(!is_prefix_segment(&bytes[start.min(i)..i]));
                if named == SEGMENTS || taken == MAX_SEGMENTS {
                    return &path[..i];
                }
                start = i + 1;
            }
            _ => {}
        }
    }
    path
}

/// Whether a segment only says which API or version a path is of.
fn is_prefix_segment(s: &[u8]) -> bool {
    let version = s.len() >= 2
        && s.len() <= 12
        && s[0].eq_ignore_ascii_case(&b'v')
        && s[1].is_ascii_digit()
        && s.iter().all(u8::is_ascii_alphanumeric);
    version || s.eq_ignore_ascii_case(b"api")
}

/// The segments that name a path, an id among them as `*`: `/orders/42`
/// and `/orders/43` are one path, `/orders/*`, so that a caller cannot
/// spread one broken endpoint's failures over a path per id (and have them
/// taken for an outage of the route).
/// Split as bytes: a `str` split on a `char` cost about 200 instructions a
/// request in its searcher's setup.
fn segments(path: &str) -> impl Iterator<Item = &[u8]> {
    prefix(path)
        .as_bytes()
        .split(|b| *b == b'/')
        .skip(1)
        .map(|s| if is_id(s) { b"*" } else { s })
}

/// Whether a segment reads as an id: digits, a UUID or long hex, or long.
fn is_id(b: &[u8]) -> bool {
    let digits = b.iter().filter(|c| c.is_ascii_digit()).count();
    (!b.is_empty() && digits == b.len())
        || (b.len() >= 8 && digits > 0 && b.iter().all(|c| c.is_ascii_hexdigit() || *c == b'-'))
        || b.len() > 24
}

struct Tracked {
    breaker: Breaker,
    /// When it last failed: the least recent is forgotten first.
    failed_at: Instant,
    name: Option<Box<str>>,
}

/// The path breakers of one route.
pub struct PathBreakers {
    config: BreakerConfig,
    /// Seeded at random per route: callers choose paths. foldhash, not
    /// std's SipHash: a path's key is made for every request, and a short
    /// path hashed cost SipHash about 150 instructions.
    hasher: foldhash::quality::RandomState,
    paths: Mutex<HashMap<PathKey, Tracked>>,
    /// Paths tracked now: none, and nothing is locked per request.
    tracked: AtomicUsize,
    /// The route's last success and last failure, each as [`Self::stamp`]
    /// (0: none yet).
    last_success: AtomicU64,
    last_failure: AtomicU64,
    /// The two paths whose attempts last started while the route had no
    /// success within the window (the most recent first), as stamps: before
    /// any answer (a route's first second, or after a quiet spell), that
    /// other paths are being asked is the only sign that a failing path is
    /// not all the traffic.
    started: [AtomicU64; 2],
    /// What the stamps count from.
    epoch: Instant,
}

impl PathBreakers {
    /// With the route's breaker settings, already checked: a `Breaker` of
    /// them builds.
    pub fn new(config: &BreakerConfig) -> Self {
        Self {
            config: config.clone(),
            hasher: Default::default(),
            paths: Mutex::new(HashMap::new()),
            tracked: AtomicUsize::new(0),
            last_success: AtomicU64::new(0),
            last_failure: AtomicU64::new(0),
            started: [AtomicU64::new(0), AtomicU64::new(0)],
            epoch: Instant::now(),
        }
    }

    /// The key of a request's `path`.
    pub fn key(&self, path: &str) -> PathKey {
        use std::hash::{Hash as _, Hasher as _};
        let mut h = self.hasher.build_hasher();
        for segment in segments(path) {
            segment.hash(&mut h);
        }
        // 32 bits are plenty for at most MAX_PATHS paths; 0 is no path.
        PathKey((h.finish() as u32).max(1))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<PathKey, Tracked>> {
        self.paths.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// May an attempt on `key` go now, as far as its path is concerned?
    pub fn admit<R: Rng + ?Sized>(
        &self,
        key: PathKey,
        now: Instant,
        rng: &mut R,
    ) -> (Admit, Option<Transition>) {
        if key == PathKey::NONE {
            return (Admit::Yes { probe: false }, None);
        }
        self.note_start(key, now);
        if self.tracked.load(Ordering::Acquire) == 0 {
            return (Admit::Yes { probe: false }, None);
        }
        match self.lock().get_mut(&key) {
            Some(t) => t.breaker.admit(now, rng),
            None => (Admit::Yes { probe: false }, None),
        }
    }

    /// Records how an attempt on `key` ended (`probe`: its path's breaker
    /// let it through as a probe). Gives back whether the route's breaker
    /// should hear it too, and the path breaker's change of state, if any.
    ///
    /// A failure is the path's alone, kept from the route's breaker, when
    /// the route's last success was on another path within the breaker's
    /// `window` and no other path has failed since: the rest of the route
    /// is answering. Otherwise (the failing path is all the traffic, or
    /// failures are spread) the route hears it as well.
    pub fn record<R: Rng + ?Sized>(
        &self,
        key: PathKey,
        probe: bool,
        outcome: Outcome,
        now: Instant,
        rng: &mut R,
    ) -> (bool, Option<Transition>) {
        if key == PathKey::NONE {
            return (true, None);
        }
        let stamp = self.stamp(key, now);
        let alone = match outcome {
            Outcome::Failure => {
                let alone = self.failing_alone(key, stamp);
                self.last_failure.store(stamp, Ordering::Relaxed);
                alone
            }
            Outcome::Success => {
                // Written only when it changes (a new path, or a new
                // millisecond): at thousands of requests a second on one
                // route, a store each would bounce its cache line between
                // the workers.
                if self.last_success.load(Ordering::Relaxed) != stamp {
                    self.last_success.store(stamp, Ordering::Relaxed);
                }
                false
            }
            Outcome::Unknown => false,
        };
        if outcome != Outcome::Failure && self.tracked.load(Ordering::Acquire) == 0 {
            return (true, None);
        }
        let transition = self.record_tracked(key, probe, outcome, now, rng);
        (!alone, transition)
    }

    fn record_tracked<R: Rng + ?Sized>(
        &self,
        key: PathKey,
        probe: bool,
        outcome: Outcome,
        now: Instant,
        rng: &mut R,
    ) -> Option<Transition> {
        let mut paths = self.lock();
        if !paths.contains_key(&key) {
            if outcome != Outcome::Failure {
                return None;
            }
            let breaker = Breaker::try_new(&self.config, now).ok()?;
            if paths.len() >= MAX_PATHS {
                forget_least_recent(&mut paths);
            }
            let name = None;
            paths.insert(
                key,
                Tracked {
                    breaker,
                    failed_at: now,
                    name,
                },
            );
        }
        let t = paths.get_mut(&key)?;
        if outcome == Outcome::Failure {
            t.failed_at = now;
        }
        let transition = t.breaker.record(now, probe, outcome, rng);
        let closed = t.breaker.state() == State::Closed;
        if closed && outcome != Outcome::Failure && t.breaker.snapshot(now).window_failures == 0 {
            paths.remove(&key);
        }
        self.tracked.store(paths.len(), Ordering::Release);
        transition
    }

    /// Notes that an attempt on `key` starts, while the route has had no
    /// success within the window; otherwise (a healthy route) one load.
    fn note_start(&self, key: PathKey, now: Instant) {
        let success = self.last_success.load(Ordering::Relaxed);
        let stamp = self.stamp(key, now);
        if success != 0 && ms_of(stamp).wrapping_sub(ms_of(success)) <= self.window_ms() {
            return;
        }
        let first = self.started[0].load(Ordering::Relaxed);
        if first == stamp {
            return;
        }
        if first != 0 && key_of(first) != key.0 {
            self.started[1].store(first, Ordering::Relaxed);
        }
        self.started[0].store(stamp, Ordering::Relaxed);
    }

    fn window_ms(&self) -> u32 {
        u32::try_from(self.config.window.as_millis()).unwrap_or(u32::MAX)
    }

    /// `key` and the time (milliseconds since the epoch, wrapping) packed.
    fn stamp(&self, key: PathKey, now: Instant) -> u64 {
        let ms = now.saturating_duration_since(self.epoch).as_millis() as u32;
        (u64::from(key.0) << 32) | u64::from(ms)
    }

    /// Whether a failure on `key` (stamped `now`) is the path's alone:
    /// another path succeeded (or started) within the window, and no other
    /// path has failed since.
    fn failing_alone(&self, key: PathKey, now: u64) -> bool {
        let window = self.window_ms();
        // How long ago the latest sign of another path's traffic was.
        let since = [
            self.last_success.load(Ordering::Relaxed),
            self.started[0].load(Ordering::Relaxed),
            self.started[1].load(Ordering::Relaxed),
        ]
        .into_iter()
        .filter(|&s| s != 0 && key_of(s) != key.0)
        .map(|s| ms_of(now).wrapping_sub(ms_of(s)))
        .filter(|&age| age <= window)
        .min();
        let Some(since) = since else {
            return false;
        };
        let failure = self.last_failure.load(Ordering::Relaxed);
        let other_failed_since = failure != 0
            && key_of(failure) != key.0
            && ms_of(now).wrapping_sub(ms_of(failure)) <= since;
        !other_failed_since
    }

    /// Forgets every path (the route's breaker closed after an outage: the
    /// upstream answers again, and a path failing alone trips anew).
    pub fn clear(&self) {
        if self.tracked.load(Ordering::Acquire) > 0 {
            self.lock().clear();
            self.tracked.store(0, Ordering::Release);
        }
    }

    /// Names `key` by `path`, for `/breakers`, if it is tracked unnamed.
    pub fn name(&self, key: PathKey, path: &str) {
        if key == PathKey::NONE || self.tracked.load(Ordering::Acquire) == 0 {
            return;
        }
        if let Some(t) = self.lock().get_mut(&key) {
            if t.name.is_none() {
                let name: Vec<u8> = segments(path)
                    .flat_map(|s| [&b"/"[..], s])
                    .flatten()
                    .copied()
                    .collect();
                // Whole segments of a `str`, split at `/`: UTF-8 still.
                let name = String::from_utf8_lossy(&name);
                let mut end = name.len().min(MAX_NAME);
                while !name.is_char_boundary(end) {
                    end -= 1;
                }
                t.name = Some(name[..end].into());
            }
        }
    }

    /// The paths whose breaker is not closed, by name, for `/breakers`.
    pub fn snapshot(&self, now: Instant) -> Vec<(String, Snapshot)> {
        if self.tracked.load(Ordering::Acquire) == 0 {
            return Vec::new();
        }
        let mut open: Vec<_> = self
            .lock()
            .values()
            .filter(|t| t.breaker.state() != State::Closed)
            .map(|t| {
                let name = t.name.as_deref().unwrap_or("(unnamed)").to_owned();
                (name, t.breaker.snapshot(now))
            })
            .collect();
        open.sort_by(|a, b| a.0.cmp(&b.0));
        open
    }

    /// Paths tracked now.
    pub fn tracked(&self) -> usize {
        self.tracked.load(Ordering::Acquire)
    }
}

/// The path of a stamp.
fn key_of(stamp: u64) -> u32 {
    (stamp >> 32) as u32
}

/// The time of a stamp, in milliseconds since the epoch (wrapping).
fn ms_of(stamp: u64) -> u32 {
    stamp as u32
}

/// Drops the path that failed least recently, closed ones first.
fn forget_least_recent(paths: &mut HashMap<PathKey, Tracked>) {
    let oldest = paths
        .iter()
        .min_by_key(|(_, t)| (t.breaker.state() != State::Closed, t.failed_at))
        .map(|(k, _)| *k);
    if let Some(k) = oldest {
        paths.remove(&k);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::SmallRng;
    use rand::SeedableRng;
    use std::time::Duration;

    fn config() -> BreakerConfig {
        BreakerConfig {
            consecutive_failures: 3,
            ..BreakerConfig::default()
        }
    }

    #[test]
    fn a_path_is_named_by_its_first_two_segments() {
        assert_eq!(prefix("/orders/42/items"), "/orders/42");
        assert_eq!(prefix("/orders/42"), "/orders/42");
        assert_eq!(prefix("/fail"), "/fail");
        assert_eq!(prefix("/"), "/");
        assert_eq!(prefix(""), "");
        assert_eq!(prefix("/a/b?x=/c/d"), "/a/b");
        // `api` and versions do not count; at most four segments.
        assert_eq!(prefix("/api/v1/orders/42/items"), "/api/v1/orders/42");
        assert_eq!(prefix("/v2beta1/users/7/x"), "/v2beta1/users/7");
        assert_eq!(prefix("/API/V3/a"), "/API/V3/a");
        assert_eq!(prefix("/api/v1/v2/v3/v4/v5"), "/api/v1/v2/v3");
        assert_eq!(prefix("/vault/x/y"), "/vault/x");
        assert_eq!(prefix("/v/x/y"), "/v/x");
        assert_eq!(prefix("//a/b"), "//a");
        assert_eq!(prefix("a/b/c"), "a/b");
        let paths = PathBreakers::new(&config());
        assert_eq!(paths.key("/a/b/c"), paths.key("/a/b/d"));
        assert_ne!(paths.key("/a/b"), paths.key("/a/c"));
        // Ids are one path.
        assert_eq!(paths.key("/orders/42"), paths.key("/orders/43/items"));
        assert_eq!(
            paths.key("/u/3f2504e0-4f89-11d3-9a0c-0305e82c3301"),
            paths.key("/u/deadbeef01")
        );
        assert_eq!(
            paths.key(&("/t/".to_owned() + &"x".repeat(30))),
            paths.key("/t/7")
        );
        assert_ne!(paths.key("/orders/list"), paths.key("/orders/42"));
    }

    #[test]
    fn a_path_failing_alone_opens_alone_and_stops_counting_for_the_route() {
        let paths = PathBreakers::new(&config());
        let mut rng = SmallRng::seed_from_u64(1);
        let now = Instant::now();
        let (bad, good) = (paths.key("/fail"), paths.key("/ok"));
        // Healthy traffic is not tracked: nothing to lock.
        assert_eq!(
            paths.record(good, false, Outcome::Success, now, &mut rng),
            (true, None)
        );
        assert_eq!(paths.tracked(), 0);
        // Another path answered lately, and no other failed: this path's
        // failures are its alone; it trips, the route hears none of them.
        let mut for_route = 0;
        for _ in 0..10 {
            if let (Admit::Yes { probe }, _) = paths.admit(bad, now, &mut rng) {
                let (counts, _) = paths.record(bad, probe, Outcome::Failure, now, &mut rng);
                for_route += usize::from(counts);
            }
        }
        assert_eq!(for_route, 0, "the route hears none");
        assert!(matches!(
            paths.admit(bad, now, &mut rng).0,
            Admit::No { .. }
        ));
        assert_eq!(
            paths.admit(good, now, &mut rng).0,
            Admit::Yes { probe: false }
        );
        paths.name(bad, "/fail?id=1");
        let open = paths.snapshot(now);
        assert_eq!(open.len(), 1);
        assert_eq!(open[0].0, "/fail");
        assert_eq!(open[0].1.state, "open");
    }

    #[test]
    fn a_path_that_is_all_the_traffic_or_failures_spread_still_reach_the_route() {
        let paths = PathBreakers::new(&config());
        let mut rng = SmallRng::seed_from_u64(3);
        let now = Instant::now();
        let (a, b) = (paths.key("/a"), paths.key("/b"));
        // All the traffic on one path: its last success was its own.
        paths.record(a, false, Outcome::Success, now, &mut rng);
        assert!(paths.record(a, false, Outcome::Failure, now, &mut rng).0);
        // Failures spread: /b succeeded last, but /a failed since.
        paths.record(b, false, Outcome::Success, now, &mut rng);
        assert!(
            !paths.record(a, false, Outcome::Failure, now, &mut rng).0,
            "alone so far"
        );
        assert!(
            paths.record(b, false, Outcome::Failure, now, &mut rng).0,
            "spread"
        );
        // A success elsewhere longer ago than the window proves nothing.
        let paths = PathBreakers::new(&config());
        paths.record(b, false, Outcome::Success, now, &mut rng);
        let later = now + config().window + Duration::from_secs(1);
        assert!(paths.record(a, false, Outcome::Failure, later, &mut rng).0);
        // Forgotten when the route recovers.
        paths.clear();
        assert_eq!(paths.tracked(), 0);
    }

    #[test]
    fn before_any_answer_another_path_started_is_enough_to_keep_a_failure_alone() {
        let paths = PathBreakers::new(&config());
        let mut rng = SmallRng::seed_from_u64(4);
        let now = Instant::now();
        let (bad, good, third) = (paths.key("/fail"), paths.key("/ok"), paths.key("/c"));
        // A fresh route: the good path's attempt has started, none has
        // answered; the bad path's failures are its alone.
        let _ = paths.admit(good, now, &mut rng);
        for _ in 0..3 {
            let _ = paths.admit(bad, now, &mut rng);
        }
        assert!(!paths.record(bad, false, Outcome::Failure, now, &mut rng).0);
        assert!(!paths.record(bad, false, Outcome::Failure, now, &mut rng).0);
        // The other path fails too: spread, the route hears it.
        let _ = paths.admit(third, now, &mut rng);
        assert!(paths.record(good, false, Outcome::Failure, now, &mut rng).0);
        // Starts long past are no sign of traffic now.
        let paths = PathBreakers::new(&config());
        let _ = paths.admit(good, now, &mut rng);
        let later = now + config().window + Duration::from_secs(1);
        assert!(
            paths
                .record(bad, false, Outcome::Failure, later, &mut rng)
                .0
        );
        // Nor are starts noted while the route answers: a healthy route
        // writes nothing per attempt.
        let paths = PathBreakers::new(&config());
        paths.record(good, false, Outcome::Success, now, &mut rng);
        let _ = paths.admit(third, now, &mut rng);
        assert_eq!(paths.started[0].load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_recovered_path_is_forgotten_and_the_tracked_paths_stay_bounded() {
        let paths = PathBreakers::new(&config());
        let mut rng = SmallRng::seed_from_u64(2);
        let mut now = Instant::now();
        for i in 0..(MAX_PATHS * 4) {
            let key = paths.key(&format!("/p{i}"));
            paths.record(key, false, Outcome::Failure, now, &mut rng);
            now += Duration::from_millis(1);
        }
        assert_eq!(paths.tracked(), MAX_PATHS);
        // One failure, then successes once the window has passed: gone.
        let key = paths.key("/q");
        paths.record(key, false, Outcome::Failure, now, &mut rng);
        let later = now + Duration::from_secs(60);
        paths.record(key, false, Outcome::Success, later, &mut rng);
        assert!(paths.lock().get(&key).is_none());
    }
}
