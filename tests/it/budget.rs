//! The retry budget over time, with the tokio clock paused: exact and fast.

use std::time::Duration;

use herdguard::policy::Budget;
use tokio::time::{advance, Instant};

/// 100% failure for a minute at 50 requests/s, each request wanting two
/// retries: every window of the budget grants at most ratio x requests plus
/// the floor, so attempts <= requests x (1 + ratio) + floor per window.
#[tokio::test(start_paused = true)]
async fn attempts_stay_within_ratio_plus_floor_under_total_failure() {
    let (ratio, per_second, window) = (0.2, 2u32, Duration::from_secs(10));
    let budget = Budget::try_new(ratio, per_second, window, Instant::now()).unwrap();
    let floor = f64::from(per_second) * window.as_secs_f64();
    let tick = Duration::from_millis(20); // 50 requests/s

    let mut per_window = Vec::new();
    let (mut requests, mut attempts) = (0u64, 0u64);
    for i in 0..3000u64 {
        let now = Instant::now();
        budget.deposit(now);
        requests += 1;
        attempts += 1;
        for _ in 0..2 {
            if budget.withdraw(now) {
                attempts += 1;
            }
        }
        // Windows of the budget's own length, aligned to its start.
        if (i + 1) % 500 == 0 {
            per_window.push((requests, attempts));
            (requests, attempts) = (0, 0);
        }
        advance(tick).await;
    }
    for (n, (requests, attempts)) in per_window.iter().enumerate() {
        let bound = *requests as f64 * (1.0 + ratio) + floor;
        assert!(
            (*attempts as f64) <= bound,
            "window {n}: {attempts} attempts for {requests} requests (bound {bound})"
        );
        // It is a budget, not a ban: steady traffic keeps earning retries.
        assert!(*attempts > *requests, "window {n}: no retries at all");
    }
}

#[tokio::test(start_paused = true)]
async fn a_quiet_route_keeps_its_floor_and_recovers_after_a_burst() {
    let budget = Budget::try_new(0.1, 1, Duration::from_secs(10), Instant::now()).unwrap();
    let granted = (0..50).filter(|_| budget.withdraw(Instant::now())).count();
    assert_eq!(granted, 10, "floor: 1/s over a 10 s window");
    advance(Duration::from_secs(5)).await;
    assert!(
        !budget.withdraw(Instant::now()),
        "still spent within the window"
    );
    advance(Duration::from_secs(6)).await;
    assert!(
        budget.withdraw(Instant::now()),
        "the spent slots slid out of the window"
    );
}
