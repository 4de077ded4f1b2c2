//! Admission through the real binary: the adaptive limit follows what the
//! traffic uses, and healthy traffic is served, not shed, when it grows.

use crate::common;

use std::time::Duration;

use common::process::Binary;
use common::*;

/// A burst onto a sidecar whose limit stands at what light traffic used
/// (about 2 x 2 + 2), in front of a slow but healthy upstream (1 s): the burst
/// waits for the limit to grow by slow start (a round trip per tripling)
/// and is served whole; nothing is shed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_onto_a_lightly_used_sidecar_is_served_not_shed() {
    let up = upstream(|_req| async {
        tokio::time::sleep(Duration::from_secs(1)).await;
        http::Response::new(full("ok"))
    })
    .await;
    let hg = Binary::start(&format!(
        "[upstreams.u]\nendpoints = [\"{}\"]\n[[routes]]\nname = \"r\"\nupstream = \"u\"\n",
        up.url()
    ))
    .await;
    let url = format!("http://{}/", hg.listen);
    let get = |client: TestClient, url: String| async move {
        let req = http::Request::get(url).body(empty()).unwrap();
        client.request(req).await.map(|r| r.status()).ok()
    };
    // Light use for six seconds: two callers, one request at a time each.
    let light = tokio::time::Instant::now() + Duration::from_secs(6);
    let one = |client: TestClient, url: String| async move {
        while tokio::time::Instant::now() < light {
            assert_eq!(
                get(client.clone(), url.clone()).await,
                Some(http::StatusCode::OK)
            );
        }
    };
    tokio::join!(one(client(), url.clone()), one(client(), url.clone()));
    let limit = hg
        .metric(r#"herdguard_concurrency_limit{upstream="u"}"#)
        .await;
    assert!(limit <= 8.0, "the limit follows the use: {limit}");
    // Then 64 callers at once, each sending two requests in a row.
    let burst = (0..64).map(|_| {
        let (client, url) = (client(), url.clone());
        async move {
            let mut ok = 0;
            for _ in 0..2 {
                ok += usize::from(
                    get(client.clone(), url.clone()).await == Some(http::StatusCode::OK),
                );
            }
            ok
        }
    });
    let ok: usize = futures_util::future::join_all(burst)
        .await
        .into_iter()
        .sum();
    let shed = hg.metric(r#"herdguard_shed_total{upstream="u"}"#).await;
    eprintln!("limit {limit} before the burst; {ok}/128 answered, {shed} shed");
    assert_eq!(shed, 0.0, "nothing shed");
    assert_eq!(ok, 128, "every request of the burst answered");
}
