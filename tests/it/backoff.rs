//! Property tests for backoff bounds, and a statistical check of full jitter.

use std::time::Duration;

use herdguard::config::Jitter;
use herdguard::policy::{Backoff, BackoffState};
use proptest::prelude::*;
use rand::rngs::SmallRng;
use rand::SeedableRng;

fn jitter() -> impl Strategy<Value = Jitter> {
    prop_oneof![
        Just(Jitter::None),
        Just(Jitter::Full),
        Just(Jitter::Equal),
        Just(Jitter::Decorrelated)
    ]
}

fn backoff() -> impl Strategy<Value = Backoff> {
    (1u64..5_000, 1u64..100_000, 1.0f64..10.0, jitter()).prop_map(|(base, extra, mult, jitter)| {
        let base = Duration::from_millis(base);
        Backoff::try_new(base, base + Duration::from_millis(extra), mult, jitter).unwrap()
    })
}

proptest! {
    #[test]
    fn every_delay_is_within_its_strategy_bounds(b in backoff(), seed in any::<u64>(), retries in 1usize..60) {
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut state = BackoffState::default();
        let mut prev = b.base();
        for n in 1..=retries as u32 {
            let ceiling = b.ceiling(n);
            prop_assert!(ceiling <= b.cap());
            prop_assert!(ceiling >= b.base().min(b.cap()));
            let d = b.next_delay(&mut state, &mut rng);
            prop_assert!(d <= b.cap(), "delay {d:?} above cap {:?}", b.cap());
            match b.jitter() {
                Jitter::None => prop_assert_eq!(d, ceiling),
                Jitter::Full => prop_assert!(d <= ceiling),
                Jitter::Equal => prop_assert!(d >= ceiling / 2 && d <= ceiling),
                Jitter::Decorrelated => {
                    prop_assert!(d >= b.base().min(b.cap()));
                    prop_assert!(d <= (prev * 3).min(b.cap()).max(b.base()));
                }
            }
            prev = d;
        }
    }

    #[test]
    fn ceiling_is_monotonic_and_never_overflows(b in backoff(), n in 1u32..20_000) {
        prop_assert!(b.ceiling(n) <= b.ceiling(n + 1));
        prop_assert!(b.ceiling(u32::MAX) <= b.cap());
    }

    #[test]
    fn ceiling_is_base_times_multiplier_to_the_retry_capped(
        base in 1u64..5_000,
        extra in 1u64..100_000,
        multiplier in 1.0f64..10.0,
        n in 1u32..20_000,
    ) {
        let base = Duration::from_millis(base);
        let cap = base + Duration::from_millis(extra);
        let b = Backoff::try_new(base, cap, multiplier, Jitter::None).unwrap();
        // A multiplier close to 1 may never reach the cap, even after thousands of retries.
        let grown = base.as_secs_f64() * multiplier.powi(n as i32 - 1);
        if grown >= cap.as_secs_f64() {
            prop_assert_eq!(b.ceiling(n), cap);
        } else {
            let expected = Duration::from_secs_f64(grown);
            let error = b.ceiling(n).abs_diff(expected);
            prop_assert!(error <= Duration::from_micros(1), "{:?} vs {expected:?}", b.ceiling(n));
        }
    }
}

#[test]
fn no_overflow_at_attempt_ten_thousand() {
    for jitter in [
        Jitter::None,
        Jitter::Full,
        Jitter::Equal,
        Jitter::Decorrelated,
    ] {
        let b = Backoff::try_new(
            Duration::from_millis(100),
            Duration::from_secs(30),
            100.0,
            jitter,
        )
        .unwrap();
        let mut rng = SmallRng::seed_from_u64(7);
        let mut state = BackoffState::default();
        for _ in 0..10_000 {
            assert!(b.next_delay(&mut state, &mut rng) <= Duration::from_secs(30));
        }
    }
}

#[test]
fn a_multiplier_of_one_keeps_the_delay_at_base() {
    let b = Backoff::try_new(
        Duration::from_millis(1),
        Duration::from_millis(168),
        1.0,
        Jitter::None,
    )
    .unwrap();
    for n in [1, 2, 10_000, u32::MAX] {
        assert_eq!(b.ceiling(n), Duration::from_millis(1), "retry {n}");
    }
}

#[test]
fn decorrelated_state_carries_the_previous_delay() {
    // With base = cap/3, decorrelated draws stay in [base, cap] and depend on the previous draw.
    let b = Backoff::try_new(
        Duration::from_millis(10),
        Duration::from_secs(10),
        2.0,
        Jitter::Decorrelated,
    )
    .unwrap();
    let mut rng = SmallRng::seed_from_u64(42);
    let mut state = BackoffState::default();
    let first = b.next_delay(&mut state, &mut rng);
    assert!(first >= Duration::from_millis(10) && first < Duration::from_millis(30));
    let mut prev = first;
    for _ in 0..50 {
        let d = b.next_delay(&mut state, &mut rng);
        assert!(
            d < prev * 3 || d == Duration::from_secs(10),
            "{d:?} after {prev:?}"
        );
        prev = d;
    }
}

#[test]
fn full_jitter_spreads_draws_evenly() {
    // Chi-square test over 20 equal bins of [0, ceiling): 100k draws with a
    // fixed seed. The 0.999 quantile of chi-square with 19 degrees of freedom is 43.8.
    let b = Backoff::try_new(
        Duration::from_secs(1),
        Duration::from_secs(1),
        2.0,
        Jitter::Full,
    )
    .unwrap();
    let mut rng = SmallRng::seed_from_u64(2024);
    let bins = 20usize;
    let draws = 100_000usize;
    let mut counts = vec![0usize; bins];
    for _ in 0..draws {
        let d = b.next_delay(&mut BackoffState::default(), &mut rng);
        assert!(d < Duration::from_secs(1));
        counts[(d.as_secs_f64() * bins as f64) as usize] += 1;
    }
    let expected = draws as f64 / bins as f64;
    let chi2: f64 = counts
        .iter()
        .map(|&c| (c as f64 - expected).powi(2) / expected)
        .sum();
    assert!(chi2 < 43.8, "chi-square {chi2:.1} over {counts:?}");
}
