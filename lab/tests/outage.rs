//! The outage experiment's short mode: the same story as `herdguard-lab
//! outage`, small enough for every CI run (about 19 s).

use std::time::Duration;

use herdguard_lab::outage::{self, Params, Report, Setup};

fn goodput(r: &Report, seconds: std::ops::Range<usize>) -> f64 {
    let s = &r.seconds[seconds];
    s.iter().map(|s| s.goodput as f64).sum::<f64>() / s.len() as f64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn herdguard_defaults_bound_the_pile_up_and_recover_where_direct_callers_do_not() {
    let p = Params {
        callers: 60,
        warmup: Duration::from_secs(3),
        stall: Duration::from_secs(5),
        after: Duration::from_secs(11),
        ..Params::default()
    };
    let (direct, defaults) = tokio::join!(
        outage::run(Setup::Direct, &p),
        outage::run(Setup::Defaults, &p)
    );
    let report = outage::table(&[direct.clone(), defaults.clone()]);
    eprintln!("{report}");

    for r in [&direct, &defaults] {
        assert_eq!(r.seconds.len(), 19, "{report}");
        assert!(
            r.baseline > 40.0,
            "{}: a healthy baseline first\n{report}",
            r.setup.name()
        );
    }
    assert!(
        defaults.peak_concurrency * 2 < direct.peak_concurrency,
        "herdguard bounds what piles up on the upstream\n{report}"
    );
    let end = 16..19;
    assert!(
        goodput(&direct, end.clone()) < 0.5 * direct.baseline,
        "direct callers keep it down\n{report}"
    );
    assert!(
        goodput(&defaults, end) >= 0.7 * defaults.baseline,
        "through herdguard it recovered\n{report}"
    );
    assert!(
        defaults
            .serving
            .is_some_and(|d| d <= Duration::from_secs(3)),
        "through herdguard real traffic is back within seconds of the resume\n{report}"
    );
}
