//! Coming back after trouble: the adaptive limit is cut once for timeouts
//! that come together, and a healthy upstream is not shed afterwards.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::process::Binary;
use common::*;
use http::{Response, StatusCode};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_after_timeouts_is_served_not_shed() {
    // The first 30 requests hang; every later one is answered at once.
    let seen = Arc::new(AtomicUsize::new(0));
    let count = seen.clone();
    let up = upstream(move |_| {
        let n = count.fetch_add(1, Ordering::SeqCst);
        async move {
            if n < 30 {
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
            Response::new(full("ok"))
        }
    })
    .await;
    let hg = Binary::start(&format!(
        "[upstreams.u]\nendpoints = [\"{}\"]\n[[routes]]\nname = \"r\"\nupstream = \"u\"\n\
         retry = {{ attempts = 1, per_try_timeout = \"300ms\" }}\n\
         breaker = {{ consecutive_failures = 1000, min_requests = 1000 }}\n",
        up.url()
    ))
    .await;
    let get = |path: String| {
        let url = format!("http://{}{path}", hg.listen);
        async move {
            let req = http::Request::get(url).body(empty()).unwrap();
            send(&client(), req).await.0
        }
    };
    // 30 attempts time out together.
    let timeouts: Vec<_> = (0..30)
        .map(|i| tokio::spawn(get(format!("/slow/{i}"))))
        .collect();
    for t in timeouts {
        assert_eq!(t.await.unwrap(), StatusCode::GATEWAY_TIMEOUT);
    }
    // A little healthy traffic.
    for i in 0..4 {
        assert_eq!(get(format!("/light/{i}")).await, StatusCode::OK);
    }
    let limit = hg
        .metric(r#"herdguard_concurrency_limit{upstream="u"}"#)
        .await;
    assert!(limit >= 80.0, "cut once, not 30 times: {limit}");
    // Then a burst of 40.
    let burst: Vec<_> = (0..40)
        .map(|i| tokio::spawn(get(format!("/burst/{i}"))))
        .collect();
    for b in burst {
        assert_eq!(b.await.unwrap(), StatusCode::OK);
    }
    assert_eq!(
        hg.metric(r#"herdguard_shed_total{upstream="u"}"#).await,
        0.0
    );
    hg.terminate().await;
}
