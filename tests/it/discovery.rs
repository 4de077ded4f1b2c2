//! Discovery by DNS, through the binary: every address a name resolves to
//! is an endpoint (a headless Service's pods), balanced and ejected one by
//! one; addresses that leave DNS are drained, new ones get traffic, and a
//! failed resolution keeps the last good set. The names are answered by a
//! DNS server the test starts on loopback.

use crate::common;

use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::dns::Dns;
use common::process::Binary;
use common::*;
use http::{Request, Response, StatusCode};

const OK: u8 = 0;
const FAILING: u8 = 1;
const HOLDING: u8 = 2;

/// One pod: answers 200 with its number, 503 while failing, or holds the
/// request until released while holding.
struct Pod {
    upstream: Upstream,
    mode: Arc<AtomicU8>,
    release: Arc<tokio::sync::Notify>,
}

async fn pod(ip: Ipv4Addr, port: u16) -> Pod {
    let mode = Arc::new(AtomicU8::new(OK));
    let release = Arc::new(tokio::sync::Notify::new());
    let (m, r) = (mode.clone(), release.clone());
    let upstream = upstream_at(&format!("{ip}:{port}"), move |_| {
        let (m, r) = (m.clone(), r.clone());
        async move {
            match m.load(Ordering::SeqCst) {
                FAILING => Response::builder().status(503).body(full("down")).unwrap(),
                HOLDING => {
                    r.notified().await;
                    Response::new(full(ip.to_string()))
                }
                _ => Response::new(full(ip.to_string())),
            }
        }
    })
    .await;
    Pod {
        upstream,
        mode,
        release,
    }
}

fn ip(last: u8) -> Ipv4Addr {
    Ipv4Addr::new(127, 0, 0, last)
}

/// GETs `n` times, one after another; how many were answered 200.
async fn gets(hg: &Binary, n: usize) -> usize {
    let client = client();
    let mut ok = 0;
    for i in 0..n {
        let req = Request::get(format!("http://{}/item/{i}", hg.listen))
            .body(empty())
            .unwrap();
        if client
            .request(req)
            .await
            .is_ok_and(|r| r.status() == StatusCode::OK)
        {
            ok += 1;
        }
    }
    ok
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_address_of_a_name_is_an_endpoint_of_its_own() {
    let dns = Dns::start().await;
    let first = pod(ip(1), 0).await;
    let port = first.upstream.addr.port();
    let mut pods = vec![first];
    for last in 2..=4 {
        pods.push(pod(ip(last), port).await);
    }
    dns.set("pods.test", &[ip(1), ip(2), ip(3)]);
    let toml = format!(
        "[dns]\nservers = [\"{}\"]\n\
         [upstreams.u]\nendpoints = [\"http://pods.test:{port}\"]\ndiscovery = \"dns\"\ndns_refresh = \"300ms\"\n\
         [[routes]]\nname = \"r\"\nupstream = \"u\"\n",
        dns.addr
    );
    let hg = Binary::start(&toml).await;
    let endpoints = r#"herdguard_endpoints{upstream="u"}"#;
    let have = |n: f64| {
        let hg = &hg;
        move || async move { hg.metric(endpoints).await == n }
    };
    eventually(Duration::from_secs(10), "three endpoints", have(3.0)).await;

    // Spread over all three.
    assert_eq!(gets(&hg, 60).await, 60);
    for pod in &pods[..3] {
        assert!(
            pod.upstream.hits() >= 10,
            "each pod had its share: {}",
            pod.upstream.hits()
        );
    }
    // The address, not the name, is the endpoint everywhere.
    let (_, breakers) = {
        let req = Request::get(format!("http://{}/breakers", hg.admin))
            .body(empty())
            .unwrap();
        let (status, _, body) = send(&client(), req).await;
        (status, String::from_utf8_lossy(&body).into_owned())
    };
    assert!(
        breakers.contains(&format!("http://127.0.0.2:{port}")),
        "{breakers}"
    );

    // One pod failing is ejected alone; the others keep serving.
    pods[1].mode.store(FAILING, Ordering::SeqCst);
    let ok = gets(&hg, 200).await;
    assert!(
        ok >= 196,
        "{ok}/200 answered 200 with one pod of three failing"
    );
    let ejected = format!(
        "herdguard_endpoint_ejections_total{{upstream=\"u\",endpoint=\"http://127.0.0.2:{port}\"}}"
    );
    assert!(
        hg.metric(&ejected).await >= 1.0,
        "the failing pod was ejected"
    );
    for last in [1, 3] {
        let other = format!(
            "herdguard_endpoint_ejections_total{{upstream=\"u\",endpoint=\"http://127.0.0.{last}:{port}\"}}"
        );
        assert_eq!(
            hg.metric(&other).await,
            0.0,
            "only the failing pod is ejected"
        );
    }
    pods[1].mode.store(OK, Ordering::SeqCst);

    // A pod that leaves DNS with a request in flight: that request
    // finishes; no new one reaches it.
    pods[2].mode.store(HOLDING, Ordering::SeqCst);
    let before = pods[2].upstream.hits();
    let listen = hg.listen.clone();
    let mut in_flight = Vec::new();
    // Round robin over three: one of the next few lands on it.
    while pods[2].upstream.hits() == before {
        assert!(in_flight.len() < 30, "no request reached the third pod");
        let listen = listen.clone();
        in_flight.push(tokio::spawn(async move {
            let req = Request::get(format!("http://{listen}/long"))
                .body(empty())
                .unwrap();
            client().request(req).await.map(|r| r.status())
        }));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    dns.set("pods.test", &[ip(1), ip(2)]);
    eventually(Duration::from_secs(10), "two endpoints", have(2.0)).await;
    let left = pods[2].upstream.hits();
    assert_eq!(gets(&hg, 30).await, 30);
    assert_eq!(
        pods[2].upstream.hits(),
        left,
        "no new request to a pod gone from DNS"
    );
    pods[2].release.notify_waiters();
    for request in in_flight {
        let status = tokio::time::timeout(Duration::from_secs(10), request)
            .await
            .expect("the drained request finished")
            .unwrap()
            .expect("answered");
        assert_eq!(
            status,
            StatusCode::OK,
            "a request in flight to a leaving pod finishes"
        );
    }
    // Its series went with it.
    let text = hg.metrics().await;
    assert!(!text.contains(&format!("127.0.0.3:{port}")), "{text}");

    // A pod added gets traffic without a reload.
    dns.set("pods.test", &[ip(1), ip(2), ip(4)]);
    eventually(Duration::from_secs(10), "three endpoints again", have(3.0)).await;
    assert_eq!(gets(&hg, 30).await, 30);
    assert!(pods[3].upstream.hits() >= 5, "the new pod had its share");

    // A resolution that answers nothing keeps the last good set.
    let errors = r#"herdguard_dns_resolutions_total{upstream="u",result="error"}"#;
    dns.set("pods.test", &[]);
    eventually(
        Duration::from_secs(10),
        "a failed resolution counted",
        || async { hg.metric(errors).await >= 1.0 },
    )
    .await;
    assert_eq!(hg.metric(endpoints).await, 3.0);
    assert_eq!(gets(&hg, 15).await, 15);
}

/// `dns_refresh` bounds how stale the endpoints may be: a record with a
/// long TTL is asked again at each refresh, not served from a cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_ttl_does_not_keep_endpoints_past_the_refresh() {
    let dns = Dns::start().await;
    dns.set_ttl(300);
    let first = pod(ip(1), 0).await;
    let port = first.upstream.addr.port();
    let second = pod(ip(2), port).await;
    dns.set("pods.test", &[ip(1)]);
    let toml = format!(
        "[dns]\nservers = [\"{}\"]\n\
         [upstreams.u]\nendpoints = [\"http://pods.test:{port}\"]\ndiscovery = \"dns\"\ndns_refresh = \"1s\"\n\
         [[routes]]\nname = \"r\"\nupstream = \"u\"\n",
        dns.addr
    );
    let hg = Binary::start(&toml).await;
    assert_eq!(gets(&hg, 10).await, 10);
    assert_eq!(first.upstream.hits(), 10);
    dns.set("pods.test", &[ip(2)]);
    let ejected = format!(
        "herdguard_endpoint_ejected{{upstream=\"u\",endpoint=\"http://127.0.0.2:{port}\"}}"
    );
    let (hg_ref, series) = (&hg, ejected.as_str());
    eventually(
        Duration::from_secs(10),
        "the new address within a few refreshes, though its TTL is 5 min",
        move || async move { hg_ref.metrics().await.contains(series) },
    )
    .await;
    assert_eq!(gets(&hg, 10).await, 10);
    assert_eq!(second.upstream.hits(), 10, "all to the new address");
    hg.terminate().await;
}

/// One NXDOMAIN is not taken at its word: the endpoints known good stay
/// until a second resolution in a row says the name is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_nxdomain_keeps_the_endpoints_known_good() {
    let dns = Dns::start().await;
    let only = pod(ip(1), 0).await;
    let port = only.upstream.addr.port();
    dns.set("pods.test", &[ip(1)]);
    let toml = format!(
        "[dns]\nservers = [\"{}\"]\n\
         [upstreams.u]\nendpoints = [\"http://pods.test:{port}\"]\ndiscovery = \"dns\"\ndns_refresh = \"1s\"\n\
         [[routes]]\nname = \"r\"\nupstream = \"u\"\n",
        dns.addr
    );
    let hg = Binary::start(&toml).await;
    assert_eq!(gets(&hg, 5).await, 5);
    dns.remove("pods.test");
    let gone = r#"herdguard_dns_resolutions_total{upstream="u",result="gone"}"#;
    let hg_ref = &hg;
    eventually(Duration::from_secs(10), "an NXDOMAIN", move || async move {
        hg_ref.metric(gone).await >= 1.0
    })
    .await;
    dns.set("pods.test", &[ip(1)]);
    assert_eq!(gets(&hg, 5).await, 5, "still served by the pod");
    let ok = r#"herdguard_dns_resolutions_total{upstream="u",result="ok"}"#;
    let before = hg.metric(ok).await;
    eventually(
        Duration::from_secs(10),
        "a good answer again",
        move || async move { hg_ref.metric(ok).await > before },
    )
    .await;
    assert_eq!(hg.metric(gone).await, 1.0);
    assert_eq!(gets(&hg, 5).await, 5);
    let logged = hg.terminate().await;
    assert!(
        logged
            .iter()
            .any(|l| l.contains("the last endpoints found stay")),
        "{logged:#?}"
    );
    assert!(
        !logged.iter().any(|l| l.contains("names as written")),
        "the pod's endpoint was never dropped: {logged:#?}"
    );
}
