//! Config loading: inheritance, defaults, and errors that name key and line.

use std::time::Duration;

use herdguard::config::{Config, Jitter, RetryOn};

/// Each of `expect` begins one of the errors reported.
fn assert_reported(errs: &[String], expect: &[&str]) {
    for e in expect {
        assert!(
            errs.iter().any(|got| got.starts_with(e)),
            "missing {e:?} in {errs:#?}"
        );
    }
}

fn errors(src: &str) -> Vec<String> {
    match Config::parse(src) {
        Ok(_) => panic!("config was accepted:\n{src}"),
        Err(e) => e.0.iter().map(ToString::to_string).collect(),
    }
}

const BASE: &str = r#"
[upstreams.api]
endpoints = ["http://127.0.0.1:3000"]
"#;

/// Routes, upstreams and endpoints are bounded in number (each costs
/// memory while loaded): the first past a bound is named, with its line.
#[test]
fn route_upstream_and_endpoint_counts_are_bounded() {
    let route = |i: usize| format!("[[routes]]\nname = \"r{i}\"\nupstream = \"api\"\n");
    let many_routes: String = std::iter::once(BASE.to_string())
        .chain((0..1001).map(route))
        .collect();
    let errs = errors(&many_routes);
    // BASE is 3 lines (a blank first), then 3 lines per route from line 4.
    assert_reported(
        &errs,
        &["routes[1000] (line 3004): at most 1000 routes (this file has 1001)"],
    );
    let fits: String = std::iter::once(BASE.to_string())
        .chain((0..1000).map(route))
        .collect();
    Config::parse(&fits).expect("1,000 routes are taken");

    let many_upstreams: String = (0..1001)
        .map(|i| format!("[upstreams.u{i:04}]\nendpoints = [\"http://127.0.0.1:3000\"]\n"))
        .chain(std::iter::once(
            "[[routes]]\nname = \"r\"\nupstream = \"u0000\"\n".to_string(),
        ))
        .collect();
    let errs = errors(&many_upstreams);
    assert_reported(
        &errs,
        &["upstreams.u1000 (line 2001): at most 1000 upstreams"],
    );

    let endpoints: Vec<String> = (0..257)
        .map(|i| format!("\"http://127.0.0.1:{}\"", 3000 + i))
        .collect();
    let many_endpoints = format!(
        "[upstreams.api]\nendpoints = [{}]\n[[routes]]\nname = \"r\"\nupstream = \"api\"\n",
        endpoints.join(", ")
    );
    let errs = errors(&many_endpoints);
    assert_reported(
        &errs,
        &["upstreams.api.endpoints[256] (line 2): at most 256 endpoints"],
    );

    // Endpoints over all upstreams: 16 x 256 static and 1 found by DNS.
    let full: Vec<String> = (0..256)
        .map(|i| format!("\"http://127.0.0.1:{}\"", 3000 + i))
        .collect();
    let mut many_in_all: String = (0..16)
        .map(|u| format!("[upstreams.u{u:02}]\nendpoints = [{}]\n", full.join(", ")))
        .collect();
    many_in_all.push_str(
        "[upstreams.pods]\nendpoints = [\"http://pods.test:80\"]\ndiscovery = \"dns\"\n\
         [[routes]]\nname = \"r\"\nupstream = \"u00\"\n",
    );
    let errs = errors(&many_in_all);
    assert_reported(&errs, &["upstreams (line 1): 4224 endpoints in all"]);
}

#[test]
fn empty_file_is_builtin_defaults() {
    let c = Config::parse("").unwrap();
    assert_eq!(c, Config::default());
    assert_eq!(c.admin.address.to_string(), "127.0.0.1:9901");
    assert_eq!(c.defaults.retry.attempts, 3);
    assert_eq!(c.defaults.retry.backoff.jitter, Jitter::Full);
}

#[test]
fn routes_inherit_defaults_key_by_key() {
    let src = format!(
        r#"{BASE}
[defaults.retry]
attempts = 4
retry_on = ["5xx"]
[defaults.retry.backoff]
base = "20ms"
cap = "1s"

[[routes]]
name = "a"
upstream = "api"
retry = {{ attempts = 2, backoff = {{ cap = "500ms" }} }}

[[routes]]
name = "b"
upstream = "api"
"#
    );
    let c = Config::parse(&src).unwrap();
    let a = &c.routes[0].retry;
    assert_eq!(a.attempts, 2, "route's own key wins");
    assert_eq!(
        a.retry_on,
        vec![RetryOn::Status5xx],
        "inherited from defaults"
    );
    assert_eq!(
        a.backoff.base,
        Duration::from_millis(20),
        "nested key inherited"
    );
    assert_eq!(
        a.backoff.cap,
        Duration::from_millis(500),
        "nested key overridden"
    );
    assert_eq!(
        a.per_try_timeout,
        Duration::from_secs(2),
        "built-in default"
    );
    let b = &c.routes[1].retry;
    assert_eq!(b.attempts, 4);
    assert_eq!(b.backoff.cap, Duration::from_secs(1));
}

#[test]
fn bad_duration_names_key_and_line() {
    let src = format!(
        "{BASE}\n[[routes]]\nname = \"a\"\nupstream = \"api\"\n[routes.retry.backoff]\ncap = \"ten seconds\"\n"
    );
    let errs = errors(&src);
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert!(
        errs[0].starts_with("routes[0].retry.backoff.cap (line 9):"),
        "{errs:?}"
    );
    assert!(errs[0].contains("not a duration"), "{errs:?}");
}

#[test]
fn unknown_keys_are_rejected_with_their_path() {
    let errs = errors(&format!("{BASE}connect_timeot = \"1s\"\n"));
    assert!(errs[0].contains("upstreams.api"), "{errs:?}");
    assert!(errs[0].contains("connect_timeot"), "{errs:?}");
    assert!(errs[0].contains("line 4"), "{errs:?}");

    let errs = errors("[lisen]\naddress = \"127.0.0.1:1\"\n");
    assert!(errs[0].starts_with("lisen (line"), "{errs:?}");
}

#[test]
fn every_semantic_error_is_reported_with_its_line() {
    let src = r#"
[upstreams.api]
endpoints = []

[upstreams.web]
endpoints = ["ftp://example.com"]

[defaults.retry.backoff]
base = "2s"
cap = "1s"

[defaults.retry.budget]
ratio = 1.5

[[routes]]
name = "a"
upstream = "nope"

[[routes]]
name = "a"
upstream = "api"
match = { path_prefix = "v1" }
"#;
    let errs = errors(src);
    let expect = [
        "upstreams.api.endpoints (line 3): needs at least one endpoint",
        "upstreams.web.endpoints[0] (line 6): \"ftp://example.com\" must start with http:// or https://",
        "defaults.retry.backoff.cap (line 10): 1s is below base (2s)",
        "defaults.retry.budget.ratio (line 13): 1.5 is out of range",
        "routes[0].upstream (line 17): no upstream is named \"nope\" (known: \"api\", \"web\")",
        "routes[1].name (line 20): \"a\" names another route too",
        "routes[1].match.path_prefix (line 22): \"v1\" must start with '/'",
    ];
    assert_reported(&errs, &expect);
    // Inherited bad values are reported once, at the defaults, not once per route.
    assert_eq!(errs.len(), expect.len(), "{errs:#?}");
}

#[test]
fn syntax_error_has_a_line() {
    let errs = errors("[listen]\naddress = \n");
    assert!(errs[0].starts_with("line 2:"), "{errs:?}");
}

#[test]
fn effective_config_round_trips() {
    let src = format!("{BASE}\n[[routes]]\nname = \"a\"\nupstream = \"api\"\nmatch = {{ methods = [\"GET\"], headers = {{ x-env = \"dev\" }} }}\n[upstreams.api2]\nendpoints = [\"https://127.0.0.1:1\"]\nhttp2 = true\n");
    let c = Config::parse(&src).unwrap();
    let printed = c.to_toml();
    let again = Config::parse(&printed).unwrap_or_else(|e| panic!("{e}\n{printed}"));
    assert_eq!(c, again);
    assert!(printed.contains("per_try_timeout = \"2s\""), "{printed}");
}

#[test]
fn for_upstream_builds_one_catch_all_route() {
    let c = Config::for_upstream("https://api.example.com/", None, None).unwrap();
    assert_eq!(
        c.upstreams["upstream"].endpoints,
        ["https://api.example.com"]
    );
    assert_eq!(c.routes.len(), 1);
    let err = Config::for_upstream("api.example.com", None, None).unwrap_err();
    assert!(err.to_string().contains("http:// or https://"), "{err}");
}

#[test]
fn every_shipped_config_file_is_valid() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/config");
    let mut seen = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let checked = Config::check_file(&path).unwrap_or_else(|e| panic!("{e}"));
            assert!(
                checked.warnings.is_empty(),
                "{}: {:?}",
                path.display(),
                checked.warnings
            );
            seen += 1;
        }
    }
    assert!(seen >= 3, "expected the example configs in {dir}");
}

#[test]
fn check_warns_that_no_body_memory_keeps_no_body() {
    let src = format!("[listen]\nmax_body_memory = \"0\"\n{BASE}");
    let checked = Config::check_str(&src).unwrap();
    let w: Vec<String> = checked.warnings.iter().map(ToString::to_string).collect();
    assert!(
        w.iter().any(|w| w.starts_with(
            "listen.max_body_memory (line 2): 0 keeps no request body: none is retried"
        )),
        "{w:#?}"
    );
    let checked = Config::check_str(BASE).unwrap();
    assert!(
        !checked
            .warnings
            .iter()
            .any(|w| w.to_string().contains("max_body_memory")),
        "the default warns of nothing"
    );
}

#[test]
fn check_warns_about_risky_but_valid_settings() {
    let src = format!(
        "{BASE}
[[routes]]
name = \"a\"
upstream = \"api\"
[routes.retry]
methods = [\"GET\", \"POST\"]
retry_on = [\"503\", \"404\", \"429\", \"408\"]
attempts = 4
per_try_timeout = \"3s\"
timeout = \"10s\"
idempotency_header = \"Content-Type\"
"
    );
    let checked = Config::check_str(&src).unwrap();
    let w: Vec<String> = checked.warnings.iter().map(ToString::to_string).collect();
    assert!(
        w.iter()
            .any(|w| w.starts_with("routes[0].retry.methods[1] (line 9): POST is not idempotent")),
        "{w:#?}"
    );
    assert!(
        w.iter()
            .any(|w| w.starts_with("routes[0].retry.retry_on[1] (line 10): 404 is a client error")),
        "{w:#?}"
    );
    assert!(
        !w.iter()
            .any(|w| w.contains("429 is") || w.contains("408 is")),
        "{w:#?}"
    );
    assert!(
        w.iter().any(|w| w.starts_with(
            "routes[0].retry.timeout (line 13): 4 attempts of per_try_timeout 3s plus up to 700ms"
        )),
        "{w:#?}"
    );
    assert!(
        w.iter().any(|w| w.starts_with(
            "routes[0].retry.idempotency_header (line 14): \"content-type\" is a standard field"
        )),
        "{w:#?}"
    );
    assert_eq!(w.len(), 4, "{w:#?}");
    let routed = format!("{BASE}[[routes]]\nname = \"a\"\nupstream = \"api\"\n");
    assert!(
        Config::check_str(&routed).unwrap().warnings.is_empty(),
        "the defaults raise no warning"
    );
    let unrouted = Config::check_str(BASE).unwrap().warnings;
    assert!(
        unrouted[0]
            .to_string()
            .contains("every request is answered 404"),
        "{unrouted:?}"
    );
}

#[test]
fn policy_tables_are_checked_by_the_constructors_that_build_them() {
    let src = r#"
[upstreams.api]
endpoints = ["http://127.0.0.1:3000"]
adaptive_concurrency = { tolerance = 0.5 }

[[routes]]
name = "a"
upstream = "api"
match = { methods = ["get"] }
retry = { attempts = 0, methods = ["GET", "bad method"] }
breaker = { failure_rate = 2.0 }
"#;
    let errs = errors(src);
    let expect = [
        "upstreams.api.adaptive_concurrency.tolerance (line 4): 0.5 must be at least 1.0",
        "routes[0].match.methods[0] (line 9): \"get\" is not a method (write it in capitals",
        // Parsed as the file is read: reported beside the table's other errors.
        "routes[0].retry.methods[1] (line 10): \"bad method\" is not a method",
        "routes[0].retry.attempts (line 10): 0 is out of range 1..=100",
        "routes[0].breaker.failure_rate (line 11): 2 is out of range (0.0, 1.0]",
    ];
    assert_reported(&errs, &expect);
    assert_eq!(errs.len(), expect.len(), "{errs:#?}");
}

#[test]
fn an_endpoint_listed_twice_is_named() {
    let src = "[upstreams.api]\nendpoints = [\"http://127.0.0.1:1\", \"http://127.0.0.1:1\"]\n\
               [[routes]]\nname = \"a\"\nupstream = \"api\"\n";
    let err = Config::check_str(src).unwrap_err().to_string();
    assert!(err.contains("upstreams.api.endpoints[1]"), "{err}");
    assert!(err.contains("listed twice"), "{err}");
}

/// The files an upstream's TLS names are loaded by `check` as the upstream
/// loads them, bounded and without waiting: a "file" that is endless
/// (`/dev/zero`), a FIFO, garbage or a key that does not match its
/// certificate is an error with its key, never an outage at start or reload.
#[test]
fn upstream_tls_files_are_loaded_by_check_bounded_and_without_waiting() {
    let dir = tempfile::tempdir().unwrap();
    let garbage = dir.path().join("garbage.pem");
    std::fs::write(&garbage, "bm90IGEgY2VydGlmaWNhdGU=\n").unwrap();
    let fifo = crate::common::fifo(&dir.path().join("fifo"));
    let pair = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let other = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let (cert, key, wrong_key) = (
        dir.path().join("cert.pem"),
        dir.path().join("key.pem"),
        dir.path().join("other-key.pem"),
    );
    std::fs::write(&cert, pair.cert.pem()).unwrap();
    std::fs::write(&key, pair.signing_key.serialize_pem()).unwrap();
    std::fs::write(&wrong_key, other.signing_key.serialize_pem()).unwrap();
    let upstream = |tls: &str| {
        format!(
            "[upstreams.t]\nendpoints = [\"https://127.0.0.1:9\"]\n{tls}\n\
             [[routes]]\nname = \"r\"\nupstream = \"t\"\n"
        )
    };
    for (tls, key_path, why) in [
        (
            format!("ca_file = {:?}", "/dev/zero"),
            "upstreams.t.ca_file",
            "regular file",
        ),
        (
            format!("ca_file = {fifo:?}"),
            "upstreams.t.ca_file",
            "regular file",
        ),
        (
            format!("ca_file = {garbage:?}"),
            "upstreams.t.ca_file",
            "no certificate",
        ),
        (
            format!("client_cert = {cert:?}\nclient_key = {wrong_key:?}"),
            "upstreams.t.client_key",
            "does not match",
        ),
        (
            format!("client_cert = {garbage:?}\nclient_key = {key:?}"),
            "upstreams.t.client_cert",
            "no certificate",
        ),
    ] {
        let errs = errors(&upstream(&tls));
        assert!(
            errs.iter()
                .any(|e| e.starts_with(key_path) && e.contains(why)),
            "{tls}: {errs:#?}"
        );
    }
    let good = upstream(&format!(
        "ca_file = {cert:?}\nclient_cert = {cert:?}\nclient_key = {key:?}"
    ));
    assert!(Config::check_str(&good).is_ok());
}

/// Every problem of one retry or breaker table is listed, not only the
/// first its policy's constructor met.
#[test]
fn every_problem_of_one_table_is_listed() {
    let src = r#"
[upstreams.api]
endpoints = ["http://127.0.0.1:3000"]

[[routes]]
name = "a"
upstream = "api"
retry = { attempts = 0, max_replay_body = "1GiB", timeout = "0s" }
breaker = { failure_rate = 2.0, consecutive_failures = 0, min_requests = 0 }
"#;
    let errs = errors(src);
    let expect = [
        "routes[0].retry.attempts (line 8)",
        "routes[0].retry.max_replay_body (line 8)",
        "routes[0].retry.timeout (line 8)",
        "routes[0].breaker.failure_rate (line 9)",
        "routes[0].breaker.consecutive_failures (line 9)",
        "routes[0].breaker.min_requests (line 9)",
    ];
    assert_reported(&errs, &expect);
    assert_eq!(errs.len(), 6, "{errs:#?}");
}

#[test]
fn a_request_id_header_must_be_a_free_header_name() {
    for (header, why) in [
        ("bad header", "is not a header name"),
        ("Host", "does not name an id"),
        ("authorization", "does not name an id"),
        ("x-forwarded-for", "does not name an id"),
        ("idempotency-key", "is an idempotency header"),
        ("x-herdguard-id", "or is herdguard's own"),
    ] {
        let errs = errors(&format!("[request_id]\nheader = \"{header}\"\n"));
        assert!(
            errs.iter()
                .any(|e| e.starts_with("request_id.header (line 2):") && e.contains(why)),
            "{header}: {errs:?}"
        );
    }
}

/// What a sidecar's config may say but not mean: `check` warns of it,
/// naming key and line, and still accepts the file.
#[test]
fn check_warns_of_sidecar_settings_that_do_not_do_what_they_say() {
    let warnings = |toml: &str| {
        Config::check_str(toml)
            .unwrap()
            .warnings
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
    };
    let open = warnings("[listen]\naddress = \"0.0.0.0:8080\"\nunrouted = \"passthrough\"\n");
    assert_reported(
        &open,
        &[
            "listen.unrouted (line 3): \"passthrough\" on 0.0.0.0:8080: anyone who reaches",
            "routes: none: every request is passed through",
        ],
    );
    let dns = warnings(
        "[dns]\nservers = [\"127.0.0.1:53\"]\n\
         [upstreams.a]\nendpoints = [\"http://10.0.0.1:80\"]\ndiscovery = \"dns\"\n",
    );
    assert_reported(
        &dns,
        &["upstreams.a.endpoints[0] (line 4): \"http://10.0.0.1:80\" is an address"],
    );
    let unused = warnings(
        "[dns]\nservers = [\"127.0.0.1:53\"]\n[upstreams.a]\nendpoints = [\"http://a:80\"]\n",
    );
    assert_reported(
        &unused,
        &["dns.servers (line 2): no upstream has discovery"],
    );
    let hosts = warnings(
        "[upstreams.u]\nendpoints = [\"http://127.0.0.1:3000\"]\n\
         [[routes]]\nname = \"all\"\nupstream = \"u\"\nmatch = { host = \"*.example.com\" }\n\
         [[routes]]\nname = \"api\"\nupstream = \"u\"\nmatch = { host = [\"api.example.com\", \"API.example.com\"] }\n",
    );
    assert_reported(
        &hosts,
        &[
            "routes[1].match.host[1] (line 10): \"API.example.com\" is in the list twice",
            "routes[1].match.host (line 10): route \"all\" comes first",
        ],
    );
    // A narrower earlier route shadows nothing.
    let narrow = warnings(
        "[upstreams.u]\nendpoints = [\"http://127.0.0.1:3000\"]\n\
         [[routes]]\nname = \"all\"\nupstream = \"u\"\nmatch = { host = \"*.example.com\", path_prefix = \"/v1/\" }\n\
         [[routes]]\nname = \"api\"\nupstream = \"u\"\nmatch = { host = \"api.example.com\" }\n",
    );
    assert!(
        !narrow.iter().any(|w| w.contains("never reached")),
        "{narrow:?}"
    );
}

#[test]
fn hosts_that_could_never_match_are_errors() {
    for bad in ["user@host", "x.*", "*.*.com", "*example.com"] {
        let errs = errors(&format!(
            "[upstreams.u]\nendpoints = [\"http://127.0.0.1:3000\"]\n\
             [[routes]]\nname = \"r\"\nupstream = \"u\"\nmatch = {{ host = \"{bad}\" }}\n"
        ));
        assert!(
            errs.iter()
                .any(|e| e.starts_with("routes[0].match.host (line 6)")),
            "{bad}: {errs:?}"
        );
    }
}
