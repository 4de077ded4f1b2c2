//! The backoff simulation's invariants. Deterministic for a seed, and fast:
//! this is the lab's short mode.

use herdguard_lab::backoff::{self, Strategy};

#[test]
fn the_same_seed_gives_the_same_result() {
    for s in Strategy::ALL {
        assert_eq!(
            backoff::trial(s, 50, 7),
            backoff::trial(s, 50, 7),
            "{}",
            s.name()
        );
    }
    assert_ne!(
        backoff::trial(Strategy::Full, 50, 7),
        backoff::trial(Strategy::Full, 50, 8)
    );
}

#[test]
fn every_client_finishes_and_work_is_at_least_one_call_each() {
    for s in Strategy::ALL {
        for clients in [1, 10, 100] {
            let t = backoff::trial(s, clients, 3);
            assert_eq!(t.finished, clients, "{} with {clients}", s.name());
            assert!(
                t.work >= clients as u64,
                "{} with {clients}: {}",
                s.name(),
                t.work
            );
        }
    }
}

#[test]
fn without_backoff_work_grows_faster_than_linearly() {
    let rows = backoff::run(&[25, 100], 5, 11);
    let work = |n| {
        rows.iter()
            .find(|r| r.strategy == Strategy::NoBackoff && r.clients == n)
            .unwrap()
            .work
    };
    // Four times the clients, far more than four times the calls.
    assert!(work(100) > 8.0 * work(25), "{} vs {}", work(100), work(25));
}

#[test]
fn full_jitter_does_less_work_than_unjittered_exponential_at_100_clients() {
    let rows = backoff::run(&[100], 10, 5);
    let get = |s| rows.iter().find(|r| r.strategy == s).unwrap();
    let (full, exp) = (get(Strategy::Full), get(Strategy::Exponential));
    assert!(
        full.work < exp.work,
        "work: full {} vs exponential {}",
        full.work,
        exp.work
    );
    assert!(
        full.time_ms < exp.time_ms,
        "time: full {} vs exponential {}",
        full.time_ms,
        exp.time_ms
    );
    let csv = backoff::csv(&rows);
    assert_eq!(csv.lines().count(), 1 + Strategy::ALL.len());
    assert!(csv.starts_with("strategy,clients,work,time_ms\n"));
}
