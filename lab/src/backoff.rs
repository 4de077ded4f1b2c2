//! The backoff simulation: N clients contend on one resource with optimistic
//! concurrency, as in the well-known "Exponential Backoff And Jitter"
//! analysis. Each client reads the resource's version, then writes; the write
//! succeeds only if nobody wrote since the read. On failure the client backs
//! off — with herdguard's own `retry::backoff` — and tries again.
//!
//! Every network hop takes |N(10 ms, 2 ms)|. "Work" is the number of write
//! attempts (calls) until every client succeeded; "time" is when the last one
//! did. A discrete-event simulation: deterministic for a seed, no sockets.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fmt::Write as _;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use herdguard::config::Jitter;
use herdguard::policy::{Backoff, BackoffState};

/// How a client waits before trying again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// Try again at once.
    NoBackoff,
    /// min(cap, base * 2^n), no jitter.
    Exponential,
    Full,
    Equal,
    Decorrelated,
}

impl Strategy {
    pub const ALL: [Strategy; 5] = [
        Strategy::NoBackoff,
        Strategy::Exponential,
        Strategy::Full,
        Strategy::Equal,
        Strategy::Decorrelated,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Strategy::NoBackoff => "no-backoff",
            Strategy::Exponential => "exponential",
            Strategy::Full => "full-jitter",
            Strategy::Equal => "equal-jitter",
            Strategy::Decorrelated => "decorrelated-jitter",
        }
    }

    pub fn parse(name: &str) -> Option<Strategy> {
        Strategy::ALL.into_iter().find(|s| s.name() == name)
    }

    fn backoff(self) -> Option<Backoff> {
        let jitter = match self {
            Strategy::NoBackoff => return None,
            Strategy::Exponential => Jitter::None,
            Strategy::Full => Jitter::Full,
            Strategy::Equal => Jitter::Equal,
            Strategy::Decorrelated => Jitter::Decorrelated,
        };
        Some(
            Backoff::try_new(
                Duration::from_millis(5),
                Duration::from_millis(2000),
                2.0,
                jitter,
            )
            .expect("valid"),
        )
    }
}

/// The result of one trial.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Trial {
    /// Write attempts, successful or not.
    pub work: u64,
    /// When the last client succeeded.
    pub time: Duration,
    /// Clients that succeeded (all of them, unless the safety bound stopped the run).
    pub finished: usize,
}

/// Events, ordered by time (nanoseconds), then by sequence for determinism.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// A read reaches the resource.
    Read { client: usize },
    /// A write, made after reading `version`, reaches the resource.
    Write { client: usize, version: u64 },
    /// The client learns its write failed, and backs off.
    Failed { client: usize },
}

/// A safety bound on write attempts per trial; far above what any strategy needs.
const MAX_WORK: u64 = 50_000_000;

/// One trial with `clients` clients all starting at time zero.
pub fn trial(strategy: Strategy, clients: usize, seed: u64) -> Trial {
    let mut rng = SmallRng::seed_from_u64(seed);
    let backoff = strategy.backoff();
    let mut states = vec![BackoffState::default(); clients];
    let mut queue: BinaryHeap<Reverse<(u64, u64, Event)>> = BinaryHeap::new();
    let mut seq = 0u64;
    let mut push = |queue: &mut BinaryHeap<Reverse<(u64, u64, Event)>>, at: u64, e: Event| {
        seq += 1;
        queue.push(Reverse((at, seq, e)));
    };
    for client in 0..clients {
        let at = hop(&mut rng);
        push(&mut queue, at, Event::Read { client });
    }
    let (mut version, mut work, mut finished, mut last) = (0u64, 0u64, 0usize, 0u64);
    while let Some(Reverse((now, _, event))) = queue.pop() {
        match event {
            Event::Read { client } => {
                // The answer goes back, then the write comes in.
                let at = now + hop(&mut rng) + hop(&mut rng);
                push(&mut queue, at, Event::Write { client, version });
            }
            Event::Write {
                client,
                version: read,
            } => {
                work += 1;
                if read == version {
                    version += 1;
                    finished += 1;
                    last = now;
                } else if work < MAX_WORK {
                    let at = now + hop(&mut rng);
                    push(&mut queue, at, Event::Failed { client });
                }
            }
            Event::Failed { client } => {
                let wait = backoff.as_ref().map_or(Duration::ZERO, |b| {
                    b.next_delay(&mut states[client], &mut rng)
                });
                let at = now + wait.as_nanos() as u64 + hop(&mut rng);
                push(&mut queue, at, Event::Read { client });
            }
        }
    }
    Trial {
        work,
        time: Duration::from_nanos(last),
        finished,
    }
}

/// One network hop: |N(10 ms, 2 ms)|, in nanoseconds (Box–Muller).
fn hop(rng: &mut SmallRng) -> u64 {
    let u1: f64 = rng.random_range(f64::EPSILON..1.0);
    let u2: f64 = rng.random();
    let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
    ((10.0 + 2.0 * z).abs() * 1e6) as u64
}

/// Averages over `trials` trials, seeded `seed`, `seed + 1`, ...
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Row {
    pub strategy: Strategy,
    pub clients: usize,
    pub work: f64,
    pub time_ms: f64,
}

pub fn run(clients: &[usize], trials: u64, seed: u64) -> Vec<Row> {
    let mut rows = Vec::new();
    for &n in clients {
        for strategy in Strategy::ALL {
            let (mut work, mut time) = (0.0, 0.0);
            for t in 0..trials {
                let r = trial(strategy, n, seed.wrapping_add(t));
                work += r.work as f64;
                time += r.time.as_secs_f64() * 1000.0;
            }
            rows.push(Row {
                strategy,
                clients: n,
                work: work / trials as f64,
                time_ms: time / trials as f64,
            });
        }
    }
    rows
}

pub fn csv(rows: &[Row]) -> String {
    let mut out = String::from("strategy,clients,work,time_ms\n");
    for r in rows {
        let _ = writeln!(
            out,
            "{},{},{:.1},{:.1}",
            r.strategy.name(),
            r.clients,
            r.work,
            r.time_ms
        );
    }
    out
}

/// Reads back what [`csv`] wrote.
pub fn parse_csv(text: &str) -> Result<Vec<Row>, String> {
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate().skip(1) {
        let bad = |what: &str| format!("line {}: {what}: {line:?}", i + 1);
        let fields: Vec<&str> = line.split(',').collect();
        let [strategy, clients, work, time_ms] = fields[..] else {
            return Err(bad("expected strategy,clients,work,time_ms"));
        };
        rows.push(Row {
            strategy: Strategy::parse(strategy).ok_or_else(|| bad("unknown strategy"))?,
            clients: clients.parse().map_err(|_| bad("clients is not a count"))?,
            work: work.parse().map_err(|_| bad("work is not a number"))?,
            time_ms: time_ms
                .parse()
                .map_err(|_| bad("time_ms is not a number"))?,
        });
    }
    Ok(rows)
}

pub fn table(rows: &[Row]) -> String {
    let mut out = format!(
        "{:<20} {:>8} {:>12} {:>12}\n",
        "strategy", "clients", "work (calls)", "time (ms)"
    );
    for r in rows {
        let _ = writeln!(
            out,
            "{:<20} {:>8} {:>12.0} {:>12.0}",
            r.strategy.name(),
            r.clients,
            r.work,
            r.time_ms
        );
    }
    out
}
