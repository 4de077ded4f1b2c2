//! `herdguard demo` runs to completion, and what it reports agrees with the
//! proxy's own metrics.

use std::time::Duration;

use herdguard::demo::{self, Params, Phase, Summary};

fn agrees_with_metrics(summary: &Summary) {
    let requests = summary.sum("herdguard_requests_total", "");
    assert_eq!(
        requests, summary.callers.requests as f64,
        "every caller request was counted once"
    );
    let ok = summary.sum("herdguard_requests_total", "code=\"200\"");
    assert_eq!(ok, summary.callers.ok as f64, "successes agree");
    let reached: f64 = ["ok", "5xx", "reset", "stale-connection", "timeout"]
        .iter()
        .map(|o| {
            summary.sum(
                "herdguard_upstream_attempts_total",
                &format!("outcome=\"{o}\""),
            )
        })
        .sum();
    assert_eq!(
        reached, summary.upstream_requests as f64,
        "attempts that reached the upstream agree"
    );
    let text = summary.render();
    for line in [
        "callers:",
        "upstream:",
        "retries made:",
        "retries skipped:",
        "retry budget left:",
        "breaker transitions:",
    ] {
        assert!(text.contains(line), "{line} missing:\n{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_completes_and_agrees_with_the_metrics() {
    // Flaky, but not so flaky that five failures in a row (which trip the
    // breaker by default) come by chance in a short run: 0.07^5 per attempt.
    let flaky = Params {
        callers: 8,
        duration: Duration::from_secs(6),
        outage_for: Duration::ZERO,
        error_rate: 0.05,
        reset_rate: 0.02,
        ..Params::default()
    };
    // The access log is on in the demo, into a file.
    let dir = tempfile::tempdir().unwrap();
    let access_log = dir.path().join("access.log");
    let outage = Params {
        callers: 8,
        duration: Duration::from_secs(5),
        outage_at: Duration::from_secs(1),
        outage_for: Duration::from_secs(2),
        access_log: Some(access_log.clone()),
        ..Params::default()
    };
    let mut ticks = 0;
    let (flaky, outage) = tokio::join!(
        demo::run(&flaky, |_, _, _, _| ticks += 1),
        demo::run(&outage, |_, _, _, _| {})
    );
    let (flaky, outage) = (flaky.unwrap(), outage.unwrap());
    assert!(ticks >= 5, "live progress every second: {ticks}");

    agrees_with_metrics(&flaky);
    assert!(flaky.callers.requests > 100);
    // Outside an outage the proxy absorbs the flakiness: callers do better than the upstream.
    assert!(
        flaky.caller_success() > flaky.upstream_success(),
        "{}",
        flaky.render()
    );
    assert!(flaky.caller_success() > 0.95, "{}", flaky.render());
    // Without an outage the run is one phase.
    assert_eq!(flaky.phases.len(), 1, "{}", flaky.render());
    assert_eq!(flaky.phases[0].callers.requests, 8 * 60);
    assert!(flaky.sum("herdguard_retries_total", "") > 0.0);

    agrees_with_metrics(&outage);
    // Callers send on schedule whatever the answers: 8 callers every 100 ms,
    // so each phase has as many requests as its length gives, even the
    // outage, where the breaker answers at once.
    let requests = |phase| outage.phase(phase).map(|s| s.callers.requests);
    assert_eq!(requests(Phase::Before), Some(80), "{}", outage.render());
    assert_eq!(requests(Phase::Outage), Some(160), "{}", outage.render());
    assert_eq!(requests(Phase::After), Some(160), "{}", outage.render());
    let during = outage.phase(Phase::Outage).expect("an outage phase");
    // In the outage the breaker keeps attempts off the upstream. It counts
    // requests, not attempts, so the first requests of the outage each make
    // their retries before it hears that they failed, and it probes four
    // times a second: about a quarter, more on a busy machine.
    assert!(
        during.upstream_requests < during.callers.requests / 2,
        "{}",
        outage.render()
    );
    assert!(during.callers.success() < 0.2, "{}", outage.render());
    let text = outage.render();
    for line in [
        "before the outage (0-1s)",
        "outage (1-3s)",
        "after the outage (3-5s)",
    ] {
        assert!(text.contains(line), "{line} missing:\n{text}");
    }
    // In an outage the breaker opens rather than pile retries on the upstream.
    assert!(
        outage.sum("herdguard_breaker_transitions_total", "to=\"open\"") >= 1.0,
        "{}",
        outage.render()
    );
    // One access log line per request, and the breaker's answers among them.
    let (lines, samples) = demo::access_log_samples(&access_log).unwrap();
    assert_eq!(lines as u64, outage.callers.requests);
    assert!(
        samples.iter().any(|l| l.contains("error=circuit-open")),
        "{samples:#?}"
    );
}
