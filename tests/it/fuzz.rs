//! Property tests over what comes from the wire and from config files: the
//! request-head rules, `Retry-After`, the retry decision, the replay body and
//! the config loader never panic, and keep their documented promises.
//!
//! CI runs proptest's default number of cases; for a longer run set
//! `PROPTEST_CASES`, e.g. `PROPTEST_CASES=100000 cargo test --test fuzz`.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, StatusCode, Version};
use http_body_util::BodyExt;
use proptest::prelude::*;

use herdguard::config::Config;
use herdguard::policy::decide::Gates;
use herdguard::policy::outcome::{CallerFault, Refusal, UpstreamFault};
use herdguard::policy::retry::parse_retry_after;
use herdguard::policy::{decide, BackoffState, Decision, Ended, Outcome, Policy, RequestFacts};
use herdguard::upstream::{BodyMemory, ReplayBody};
use herdguard::wire::headers;

/// Header names a caller might send: the ones the rules look at, and others.
fn name() -> impl Strategy<Value = HeaderName> {
    prop_oneof![
        prop::sample::select(vec![
            "host",
            "connection",
            "keep-alive",
            "te",
            "transfer-encoding",
            "content-length",
            "upgrade",
            "proxy-connection",
            "trailer",
            "http2-settings",
            "x-forwarded-for",
            "max-forwards",
            "idempotency-key",
            "x-herdguard-attempt",
        ])
        .prop_map(HeaderName::from_static),
        "[a-z][a-z0-9-]{0,12}".prop_map(|n| HeaderName::from_bytes(n.as_bytes()).unwrap()),
    ]
}

/// Header values: lists, tokens, numbers, and any visible bytes.
fn value() -> impl Strategy<Value = HeaderValue> {
    prop_oneof![
        "(chunked|gzip|close|keep-alive|upgrade|h2c|trailers|websocket|te|host|[0-9]{1,25})(, ?(chunked|gzip|close|upgrade|h2c|x-a|[0-9]{1,3}))*",
        "[ -~]{0,40}",
    ]
    .prop_map(|v| HeaderValue::from_str(&v).unwrap())
}

fn head() -> impl Strategy<Value = HeaderMap> {
    prop::collection::vec((name(), value()), 0..12).prop_map(|fields| {
        let mut h = HeaderMap::new();
        for (n, v) in fields {
            h.append(n, v);
        }
        h
    })
}

fn version() -> impl Strategy<Value = Version> {
    prop::sample::select(vec![Version::HTTP_10, Version::HTTP_11, Version::HTTP_2])
}

fn method() -> impl Strategy<Value = Method> {
    prop::sample::select(vec![
        Method::GET,
        Method::POST,
        Method::OPTIONS,
        Method::TRACE,
        Method::PUT,
    ])
}

proptest! {
    /// The request-head rules never panic, and what they promise holds.
    #[test]
    fn request_head_rules(mut h in head(), v in version(), m in method(), upgrade in any::<bool>()) {
        let _ = headers::check_host(v, &h);
        let framing = headers::check_framing(&h);
        if let Err((status, _)) = framing {
            prop_assert!(status == StatusCode::BAD_REQUEST || status == StatusCode::NOT_IMPLEMENTED);
        }
        let asked = headers::requested_upgrade(v, &h);
        if asked {
            prop_assert!(!h.get_all("upgrade").iter().any(|u| u.to_str().is_ok_and(|u| u.to_ascii_lowercase().contains("h2c"))));
        }
        let mut req = Request::new(());
        *req.method_mut() = m.clone();
        *req.headers_mut() = h.clone();
        let _ = herdguard::proxy::max_forwards_reached(&req);

        let named: Vec<String> = h
            .get_all("connection")
            .iter()
            .filter_map(|c| c.to_str().ok())
            .flat_map(|c| c.split(',').map(|t| t.trim().to_ascii_lowercase()).collect::<Vec<_>>())
            .collect();
        headers::strip_hop_by_hop(&mut h, upgrade);
        headers::decrement_max_forwards(&m, &mut h);
        headers::add_via(&mut h, v);
        headers::add_forwarded(&mut h, &HeaderValue::from_static("127.0.0.1"), "http", None);
        for gone in ["keep-alive", "proxy-connection", "transfer-encoding", "http2-settings"] {
            prop_assert!(!h.contains_key(gone), "{gone} left in {h:?}");
        }
        for field in named {
            let upgrade_pair = upgrade && (field == "upgrade" || field == "connection");
            let kept_by_rule = field == "te" || field.is_empty() || upgrade_pair;
            if !kept_by_rule && HeaderName::from_bytes(field.as_bytes()).is_ok() && !["via", "x-forwarded-for", "x-forwarded-proto"].contains(&field.as_str()) {
                prop_assert!(!h.contains_key(field.as_str()), "{field} named in Connection was kept: {h:?}");
            }
        }
        prop_assert!(h.get_all("x-forwarded-for").iter().count() == 1);
    }

    /// `Retry-After` parses to a delay or to nothing, never panics.
    #[test]
    fn retry_after_never_panics(text in "[ -~]{0,40}", secs in any::<u64>()) {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        if let Ok(v) = HeaderValue::from_str(&text) {
            let _ = parse_retry_after(&v, now);
        }
        let v = HeaderValue::from(secs);
        prop_assert_eq!(parse_retry_after(&v, now), Some(Duration::from_secs(secs)));
    }

    /// The retry decision never panics and never retries what it must not.
    #[test]
    fn decide_keeps_its_promises(
        outcome in outcome(),
        attempt in 0u32..200,
        idempotent in any::<bool>(),
        inner_hop in any::<bool>(),
        replayable in any::<bool>(),
        retry_after in prop::option::of(any::<u64>().prop_map(Duration::from_nanos)),
        left_ms in 0u64..30_000,
        breaker_open in any::<bool>(),
        tokens in 0u32..3,
        seed in any::<u64>(),
    ) {
        use rand::SeedableRng;
        let policy = Policy::from_config(&Default::default()).unwrap();
        let facts = RequestFacts { idempotent, inner_hop, path: herdguard::policy::paths::PathKey::NONE };
        let ended = Ended { attempt, outcome, retry_after, replayable };
        let left = Duration::from_millis(left_ms);
        let gates = Gates { breaker_open, budget_has_token: tokens > 0 };
        let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
        let got = decide(&policy, &facts, &ended, left, gates, &mut BackoffState::default(), &mut rng);
        if let Decision::Retry { delay } = got {
            prop_assert!(policy.names(outcome));
            prop_assert!(!inner_hop && !breaker_open && replayable && tokens > 0);
            prop_assert!(attempt < policy.attempts);
            prop_assert!(idempotent || !outcome.reached_upstream());
            prop_assert!(delay + policy.min_retry_time() <= Duration::from_millis(left_ms));
        }
    }

    /// A replay is the original body, byte for byte, or it is reported as
    /// not replayable; never a part of it. What the copy took from the
    /// shared memory comes back whole when the body is done with.
    #[test]
    fn a_replay_is_whole_or_refused(chunks in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..64), 0..12), max in 0u64..400, room in 0u64..400, held in 0u64..200) {
        let whole: Vec<u8> = chunks.concat();
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        rt.block_on(async {
            let body = http_body_util::StreamBody::new(futures_util::stream::iter(
                chunks.iter().map(|c| Ok::<_, std::convert::Infallible>(http_body::Frame::data(Bytes::from(c.clone())))).collect::<Vec<_>>(),
            ));
            let memory = Arc::new(BodyMemory::new(room, metrics::Counter::noop()));
            // Another request's body holds some of the room already.
            let other = ReplayBody::new(http_body_util::Full::new(Bytes::from(vec![0u8; held as usize])), 400, &memory);
            let before = memory.held();
            let source = ReplayBody::new(body, max, &memory);
            let first = source.replay().collect().await.unwrap().to_bytes();
            prop_assert_eq!(&first[..], &whole[..]);
            match source.replayable() {
                Some(true) => {
                    let again = source.replay().collect().await.unwrap().to_bytes();
                    prop_assert_eq!(&again[..], &whole[..]);
                }
                Some(false) => prop_assert!(whole.len() as u64 > max.min(room - before)),
                None => prop_assert!(false, "no clone holds it"),
            }
            prop_assert!(memory.held() <= room);
            drop(source);
            prop_assert_eq!(memory.held(), before);
            drop(other);
            prop_assert_eq!(memory.held(), 0);
            Ok(())
        })?;
    }

    /// The config loader answers every text with a config or with errors.
    #[test]
    fn the_config_loader_never_panics(text in config_text()) {
        let _ = Config::parse(&text);
    }
}

fn outcome() -> impl Strategy<Value = Outcome> {
    prop_oneof![
        (100u16..1000).prop_map(|s| Outcome::Response(StatusCode::from_u16(s).unwrap())),
        prop::sample::select(UpstreamFault::ALL.to_vec()).prop_map(Outcome::Upstream),
        prop::sample::select(vec![
            CallerFault::Gone,
            CallerFault::MalformedBody,
            CallerFault::StalledBody
        ])
        .prop_map(Outcome::Caller),
        Just(Outcome::Deadline),
        Just(Outcome::Refused(Refusal::CircuitOpen)),
    ]
}

/// Config-like text: real tables and keys with values of every kind, often wrong.
fn config_text() -> impl Strategy<Value = String> {
    let table = prop::sample::select(vec![
        "[listen]",
        "[admin]",
        "[upstreams.u]",
        "[upstreams.u.adaptive_concurrency]",
        "[upstreams.u.outlier]",
        "[defaults.retry]",
        "[defaults.retry.backoff]",
        "[defaults.retry.budget]",
        "[defaults.breaker]",
        "[[routes]]",
    ]);
    let key = prop::sample::select(vec![
        "address",
        "drain_timeout",
        "header_read_timeout",
        "max_connections",
        "endpoints",
        "connect_timeout",
        "max_in_flight",
        "attempts",
        "per_try_timeout",
        "timeout",
        "retry_on",
        "methods",
        "max_replay_body",
        "base",
        "cap",
        "multiplier",
        "jitter",
        "ratio",
        "min_per_second",
        "window",
        "consecutive_failures",
        "failure_rate",
        "open_for",
        "max_open_for",
        "half_open_probes",
        "name",
        "upstream",
        "match",
        "min_limit",
        "initial_limit",
        "tolerance",
        "smoothing",
        "idempotency_header",
        "ejection_time",
        "max_ejection_time",
        "max_ejected",
        "slow_factor",
        "max_tunnels",
        "tunnel_idle_timeout",
        "idle_timeout",
        "min_requests",
    ]);
    let value = prop_oneof![
        "\"[0-9]{1,25}(ms|s|m|h|d|y|KiB|MiB|TiB)?\"",
        "-?[0-9]{1,22}(\\.[0-9]{1,4})?",
        Just("\"u\"".to_owned()),
        Just("[\"http://127.0.0.1:1\"]".to_owned()),
        Just("[\"http://127.0.0.1:1\", \"http://127.0.0.1:2\"]".to_owned()),
        Just("[\"GET\", \"get\", \"\"]".to_owned()),
        Just("[\"5xx\", \"600\", \"reset\"]".to_owned()),
        Just("{ path_prefix = \"v\", host = \"*\" }".to_owned()),
        Just("nan".to_owned()),
        Just("inf".to_owned()),
        Just("true".to_owned()),
        "\"[ -~]{0,12}\"",
    ];
    prop::collection::vec((table, prop::collection::vec((key, value), 0..5)), 0..6).prop_map(
        |tables| {
            let mut text = String::new();
            for (t, keys) in tables {
                text.push_str(t);
                text.push('\n');
                for (k, v) in keys {
                    text.push_str(&format!("{k} = {v}\n"));
                }
            }
            text
        },
    )
}
