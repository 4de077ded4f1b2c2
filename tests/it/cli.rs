//! The real binary: `check`, `--version`, and a run with `--upstream` that
//! serves and exits 0 on SIGTERM.

use crate::common;

use std::process::Command;

use common::process::{line_with, quick_mode, spawn_reading_stderr, start, BIN};
use common::*;

fn write(dir: &tempfile::TempDir, name: &str, text: &str) -> std::path::PathBuf {
    let path = dir.path().join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// `herdguard check --config PATH`.
fn check(path: &std::path::Path) -> std::process::Output {
    Command::new(BIN)
        .args(["check", "--config"])
        .arg(path)
        .output()
        .unwrap()
}

#[test]
fn check_prints_the_effective_config() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        &dir,
        "ok.toml",
        "[upstreams.api]\nendpoints = [\"http://127.0.0.1:3000\"]\n[[routes]]\nname = \"a\"\nupstream = \"api\"\n",
    );
    let out = check(&path);
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(stdout.contains("[routes.retry.backoff]"), "{stdout}");
    assert!(stdout.contains("jitter = \"full\""), "{stdout}");
}

#[test]
fn check_refuses_absurd_durations_and_sizes_with_key_and_line_and_never_aborts() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (
            "[defaults.retry]\nper_try_timeout = \"500000000000y\"",
            "defaults.retry.per_try_timeout (line 5)",
        ),
        (
            "[defaults.retry]\ntimeout = \"18446744073709551615s\"",
            "defaults.retry.timeout (line 5)",
        ),
        (
            "[defaults.retry]\nmax_replay_body = \"9000TiB\"",
            "defaults.retry.max_replay_body (line 5)",
        ),
        (
            "[defaults.retry.backoff]\ncap = \"100000h\"",
            "defaults.retry.backoff.cap (line 5)",
        ),
        (
            "[defaults.breaker]\nmax_open_for = \"1000000000h\"",
            "defaults.breaker.max_open_for (line 5)",
        ),
    ];
    for (table, key) in cases {
        let path = write(
            &dir,
            "absurd.toml",
            &format!(
                "[upstreams.api]\nendpoints = [\"http://127.0.0.1:3000\"]\n\n{table}\n\n[[routes]]\nname = \"a\"\nupstream = \"api\"\n"
            ),
        );
        let out = check(&path);
        assert_eq!(out.status.code(), Some(1), "{table}: {out:?}");
        let stderr = String::from_utf8(out.stderr).unwrap();
        assert!(stderr.contains(key), "{key} not named:\n{stderr}");
    }
}

#[test]
fn check_reports_every_error_with_key_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        &dir,
        "bad.toml",
        "[upstreams.api]\nendpoints = [\"http://127.0.0.1:3000\"]\n\n[[routes]]\nname = \"a\"\nupstream = \"nope\"\n\n[[routes]]\nname = \"b\"\nupstream = \"api\"\nretry = { attempts = 0 }\n",
    );
    let out = check(&path);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.contains("routes[0].upstream (line 6): no upstream is named \"nope\""),
        "{stderr}"
    );
    assert!(
        stderr.contains("routes[1].retry.attempts (line 11): 0 is out of range"),
        "{stderr}"
    );
}

#[test]
fn version_and_help() {
    let out = Command::new(BIN).arg("--version").output().unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("herdguard "));
    let out = Command::new(BIN).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--config",
        "--upstream",
        "--listen",
        "--admin",
        "--threads",
        "--log-format",
        "check",
    ] {
        assert!(help.contains(flag), "{flag} missing from --help");
    }
    let out = Command::new(BIN).output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(2),
        "no config and no upstream is a usage error"
    );
}

#[test]
fn counts_of_zero_are_usage_errors() {
    let args = ["demo", "--callers", "0"];
    let out = Command::new(BIN).args(args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
    assert!(err.contains("must be at least 1"), "{args:?}: {err}");
}

#[tokio::test]
async fn upstream_mode_serves_and_exits_cleanly_on_sigterm() {
    let up = ok_upstream("from upstream").await;
    let running = quick_mode(&up.url(), &["--threads", "1"]).await;

    let req = http::Request::get(format!("http://{}/hello", running.listen))
        .body(empty())
        .unwrap();
    let (status, _, body) = send(&client(), req).await;
    assert_eq!(
        (status, &body[..]),
        (http::StatusCode::OK, &b"from upstream"[..])
    );

    let rest = running.terminate().await;
    assert!(rest.iter().any(|l| l.contains("SIGTERM")), "{rest:?}");
}

#[tokio::test]
async fn text_logs_written_to_a_pipe_are_plain() {
    let mut cmd = Command::new(BIN);
    cmd.args([
        "--upstream",
        "http://127.0.0.1:9",
        "--listen",
        "127.0.0.1:0",
    ])
    .args(["--admin", "127.0.0.1:0", "--threads", "1"])
    .env_remove("NO_COLOR");
    let (mut child, rx) = spawn_reading_stderr(cmd);
    let (line, _) = line_with(rx, "herdguard serving").await;
    let _ = child.kill();
    let _ = child.wait();
    assert!(!line.contains('\x1b'), "colour codes in {line:?}");
    assert!(line.contains(" listen=127.0.0.1:"), "{line}");
}

#[tokio::test]
async fn sighup_reloads_the_config_file() {
    let up = ok_upstream("reloaded").await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("herdguard.toml");
    let base = format!(
        "[listen]\naddress = \"127.0.0.1:0\"\n[admin]\naddress = \"127.0.0.1:0\"\n[upstreams.u]\nendpoints = [\"{}\"]\n[[routes]]\nname = \"a\"\nupstream = \"u\"\nmatch = {{ path = \"/a\" }}\n",
        up.url()
    );
    std::fs::write(&path, &base).unwrap();
    let mut cmd = Command::new(BIN);
    cmd.arg("--config")
        .arg(&path)
        .args(["--log-format", "json"]);
    let mut running = start(cmd).await;
    let listen = running.listen.clone();
    assert_eq!(get_at(&listen, "/b").await.0, http::StatusCode::NOT_FOUND);

    std::fs::write(
        &path,
        format!("{base}[[routes]]\nname = \"b\"\nupstream = \"u\"\nmatch = {{ path = \"/b\" }}\n"),
    )
    .unwrap();
    assert!(Command::new("kill")
        .args(["-HUP", &running.child.id().to_string()])
        .status()
        .unwrap()
        .success());
    let (reloaded, rest) = line_with(running.rest, "config reloaded").await;
    running.rest = rest;
    assert!(reloaded.contains("\"routes\":2"), "{reloaded}");
    let (status, _, body) = get_at(&listen, "/b").await;
    assert_eq!(
        (status, &body[..]),
        (http::StatusCode::OK, &b"reloaded"[..])
    );

    let rest = running.terminate().await;
    assert!(rest.iter().any(|l| l.contains("SIGTERM")), "{rest:?}");
}

/// Without `--threads`: a thread per core given to the process (a CPU set
/// narrower than the machine, or a CPU limit), one per two of a machine's
/// cores it shares with everything else (see `app::threads`).
#[tokio::test]
async fn the_default_runtime_has_a_thread_per_core_given_and_one_per_two_shared() {
    let up = ok_upstream("x").await;
    let args = |cmd: &mut Command| {
        cmd.args(["--upstream", &up.url(), "--listen", "127.0.0.1:0"])
            .args(["--admin", "127.0.0.1:0", "--log-format", "json"]);
    };
    // Counted as the kernel lists them: `0-3,6`.
    let count = |list: &str| -> usize {
        list.trim()
            .split(',')
            .map(|part| match part.split_once('-') {
                Some((a, b)) => b.parse::<usize>().unwrap() - a.parse::<usize>().unwrap() + 1,
                None => 1,
            })
            .sum()
    };
    let online = count(&std::fs::read_to_string("/sys/devices/system/cpu/online").unwrap());
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let allowed = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .map(count)
        .unwrap();
    let given = std::thread::available_parallelism().unwrap().get();
    let taskset = |cpus: &str| {
        let mut cmd = Command::new("taskset");
        cmd.args(["-c", cpus, BIN]);
        args(&mut cmd);
        cmd
    };
    let mut free = Command::new(BIN);
    args(&mut free);
    // As this test runs (on the whole of a machine it shares: one thread
    // per two cores). Held to one core (as a sidecar with a CPU limit of
    // one or less): one, and the single-threaded scheduler. Held to two of
    // three or more: two.
    let mut cases = vec![
        (
            free,
            herdguard::app::threads::default_threads(given, allowed, online),
        ),
        (taskset("0"), 1),
    ];
    if online >= 3 && allowed == online && given >= 2 {
        cases.push((taskset("0,1"), 2));
    }
    if allowed == online && given == online {
        assert_eq!(cases[0].1, (online / 2).max(1));
    }
    let scheduler = |threads| match threads {
        1 => "current-thread",
        _ => "multi-thread",
    };
    for (cmd, threads) in cases {
        let running = start(cmd).await;
        let serving = running.serving.clone();
        running.terminate().await;
        assert_eq!(serving["threads"], threads, "{serving}");
        assert_eq!(serving["scheduler"], scheduler(threads), "{serving}");
    }
}

#[test]
fn endpoint_ports_out_of_range_and_credentials_are_refused_without_echoing_them() {
    let dir = tempfile::tempdir().unwrap();
    for (endpoint, says) in [
        ("http://127.0.0.1:99999", "port \"99999\""),
        ("http://127.0.0.1:0", "port \"0\""),
        ("http://[::1]:70000", "port \"70000\""),
        ("http://127.0.0.1:-1", "port \"-1\""),
        (
            "http://user:hunter2@127.0.0.1:3000",
            "user name or password",
        ),
        ("https://token@example.com", "user name or password"),
        // A password with the characters that end an authority.
        (
            "http://user:hunter2?x@127.0.0.1:8080",
            "user name or password",
        ),
        (
            "http://user:hunter2#x@127.0.0.1:8080",
            "user name or password",
        ),
        (
            "http://user:hunter2/x@127.0.0.1:8080",
            "user name or password",
        ),
        ("http://127.0.0.1:+3000", "port \"+3000\""),
        ("http://127.0.0.1:03000", "port \"03000\""),
    ] {
        let path = write(
            &dir,
            "bad.toml",
            &format!(
                "[upstreams.api]\nendpoints = [\n  \"http://127.0.0.1:3000\",\n  \"{endpoint}\",\n]\n\
                 [[routes]]\nname = \"a\"\nupstream = \"api\"\n"
            ),
        );
        let out = check(&path);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{endpoint}: {err}");
        assert!(
            err.contains("upstreams.api.endpoints[1]"),
            "{endpoint}: {err}"
        );
        assert!(err.contains("line 4"), "{endpoint}: {err}");
        assert!(err.contains(says), "{endpoint}: {err}");
        assert!(!err.contains("hunter2") && !err.contains("token@"), "{err}");
        // The same URL given on the command line.
        let out = Command::new(BIN)
            .args(["--upstream", endpoint])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "--upstream {endpoint}: {err}");
        assert!(!err.contains("hunter2") && !err.contains("token@"), "{err}");
    }
    // The highest port and an IPv6 host with one are fine.
    let path = write(
        &dir,
        "ok.toml",
        "[upstreams.api]\nendpoints = [\"http://127.0.0.1:65535\", \"http://[::1]:8080\"]\n\
         [[routes]]\nname = \"a\"\nupstream = \"api\"\n",
    );
    let out = check(&path);
    assert!(out.status.success(), "{out:?}");
}

/// `check` reports every error, each at its own key path and line: several
/// in one route, a route after one that did not parse (its index is the
/// file's), and an upstream with a bad key without a false "no upstream is
/// named" on the routes that use it.
#[test]
fn check_reports_every_error_without_shifts_or_cascades() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        &dir,
        "bad.toml",
        "[upstreams.api]\n\
         endpoints = [\"http://127.0.0.1:3000\"]\n\
         bogus = 1\n\
         \n\
         [[routes]]\n\
         name = \"a\"\n\
         upstream = \"api\"\n\
         typo = true\n\
         retry = { backoff = { jitter = \"sometimes\" }, attempts = \"x\" }\n\
         \n\
         [[routes]]\n\
         name = \"b\"\n\
         upstream = \"api\"\n\
         retry = { attempts = 0 }\n",
    );
    let out = check(&path);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8(out.stderr).unwrap();
    let errors: Vec<&str> = stderr.lines().skip(1).collect();
    assert_eq!(
        errors
            .iter()
            .map(|e| e.split(':').next().unwrap())
            .collect::<Vec<_>>(),
        [
            "upstreams.api.bogus (line 3)",
            "routes[0].typo (line 8)",
            "routes[0].retry.attempts (line 9)",
            "routes[0].retry.backoff.jitter (line 9)",
            "routes[1].retry.attempts (line 14)",
        ],
        "{stderr}"
    );
    assert!(!stderr.contains("no upstream is named"), "{stderr}");
}

#[test]
fn check_quiet_prints_nothing_for_a_valid_config_but_warnings_and_errors() {
    let dir = tempfile::tempdir().unwrap();
    let quiet = |path: &std::path::Path| {
        Command::new(BIN)
            .args(["check", "--quiet", "--config"])
            .arg(path)
            .output()
            .unwrap()
    };
    let ok = write(
        &dir,
        "ok.toml",
        "[upstreams.api]\nendpoints = [\"http://127.0.0.1:3000\"]\n[[routes]]\nname = \"a\"\nupstream = \"api\"\n",
    );
    let out = quiet(&ok);
    assert!(out.status.success());
    assert!(out.stdout.is_empty() && out.stderr.is_empty(), "{out:?}");
    // A warning (idempotency_header set to a field most requests carry).
    let warned = write(
        &dir,
        "warned.toml",
        "[upstreams.api]\nendpoints = [\"http://127.0.0.1:3000\"]\n[[routes]]\nname = \"a\"\nupstream = \"api\"\nretry = { idempotency_header = \"content-type\" }\n",
    );
    let out = quiet(&warned);
    assert!(out.status.success(), "{out:?}");
    assert!(out.stdout.is_empty());
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("warning: routes[0].retry.idempotency_header"),
        "{out:?}"
    );
    let bad = write(&dir, "bad.toml", "[[routes]]\nname = 1\n");
    let out = quiet(&bad);
    assert_eq!(out.status.code(), Some(1));
    assert!(!out.stderr.is_empty());
}

/// `check` never aborts on its own output: stdout closed early (`| head`)
/// or full (`> /dev/full`); and a "file" without end (`/dev/zero`) is
/// refused before it fills memory.
#[test]
fn check_survives_a_closed_or_full_stdout_and_refuses_an_endless_file() {
    use std::process::Stdio;
    let mut child = Command::new(BIN)
        .args(["check", "--config"])
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/config/herdguard.toml"
        ))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let status = child.wait().unwrap();
    assert!(status.success(), "closed stdout: {status:?}");
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap();
    let status = Command::new(BIN)
        .args(["check", "--config"])
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/config/herdguard.toml"
        ))
        .stdout(full)
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success(), "full stdout: {status:?}");
    let out = Command::new(BIN)
        .args(["check", "--config", "/dev/zero"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not a regular file"),
        "{out:?}"
    );
    // A regular file too large to be a config (sparse: nothing is written).
    let dir = tempfile::tempdir().unwrap();
    let big = dir.path().join("big.toml");
    std::fs::File::create(&big)
        .unwrap()
        .set_len(2 << 20)
        .unwrap();
    let out = Command::new(BIN)
        .args(["check", "--config"])
        .arg(&big)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("larger than 1 MiB"),
        "{out:?}"
    );
}

/// What one error hides is still checked: a typo'd key in an upstream does
/// not hide its endpoints' errors, one in a route not the rest of the route,
/// a bad default not every route's own errors; a route naming an upstream
/// that did not parse is not told it does not exist, and the names listed
/// as known are quoted.
#[test]
fn check_reports_what_a_first_error_would_hide() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        &dir,
        "hidden.toml",
        "[upstreams.a]\n\
         endpoints = [\"http://127.0.0.1:99999\"]\n\
         conect_timeout = \"1s\"\n\
         [upstreams.\"b\\nc\"]\n\
         endpoints = 3\n\
         [defaults.retry.backoff]\n\
         jitter = \"maybe\"\n\
         [[routes]]\n\
         name = \"r\"\n\
         upstream = \"zzz\"\n\
         typo = 1\n\
         fault = { abort = 2.0 }\n\
         host_rewrite = \"a b\"\n\
         [[routes]]\n\
         name = \"s\"\n\
         upstream = \"b\\nc\"\n",
    );
    let out = check(&path);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8(out.stderr).unwrap();
    for (key, says) in [
        ("upstreams.a.endpoints[0] (line 2)", "port \"99999\""),
        ("upstreams.a.conect_timeout (line 3)", "unknown field"),
        ("defaults.retry.backoff.jitter (line 7)", "unknown variant"),
        ("routes[0].upstream (line 10)", "(known: \"a\", \"b\\nc\")"),
        ("routes[0].typo (line 11)", "unknown field"),
        ("routes[0].fault.abort (line 12)", "out of range"),
        ("routes[0].host_rewrite (line 13)", "not a host"),
    ] {
        assert!(
            stderr
                .lines()
                .any(|l| l.starts_with(key) && l.contains(says)),
            "{key}: {says}\n{stderr}"
        );
    }
    assert!(!stderr.contains("routes[1].upstream"), "{stderr}");
}

/// A replay limit is memory held per request in flight: a huge one is a
/// config error, not an invitation to exhaust memory.
#[test]
fn a_huge_max_replay_body_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        &dir,
        "huge.toml",
        "[upstreams.api]\nendpoints = [\"http://127.0.0.1:3000\"]\n[defaults.retry]\nmax_replay_body = \"1TiB\"\n[[routes]]\nname = \"a\"\nupstream = \"api\"\n",
    );
    let out = check(&path);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("defaults.retry.max_replay_body (line 4)") && err.contains("64MiB"),
        "{err}"
    );
}

/// `check` warns of values no one means, naming each key: a window or
/// timeout under a millisecond, a count over a billion.
#[test]
fn check_warns_of_absurd_durations_and_counts() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        &dir,
        "absurd.toml",
        "[upstreams.api]\nendpoints = [\"http://127.0.0.1:3000\"]\nmax_in_flight = 9000000000000\n\
         [[routes]]\nname = \"a\"\nupstream = \"api\"\n\
         [routes.retry]\nper_try_timeout = \"1ns\"\n[routes.breaker]\nwindow = \"500us\"\n",
    );
    let out = check(&path);
    let stderr = String::from_utf8_lossy(&out.stderr);
    for key in [
        "upstreams.api.max_in_flight",
        "routes[0].retry.per_try_timeout",
        "routes[0].breaker.window",
    ] {
        assert!(
            stderr.contains(&format!("warning: {key}")),
            "{key}: {stderr}"
        );
    }
    // Adaptive limits that cannot do what they say.
    let limits = write(
        &dir,
        "limits.toml",
        "[upstreams.api]\nendpoints = [\"http://127.0.0.1:3000\"]\nmax_in_flight = 4\n\
         [upstreams.api.adaptive_concurrency]\ntolerance = 1.0\nmin_limit = 50\ninitial_limit = 50\n\
         [[routes]]\nname = \"a\"\nupstream = \"api\"\n",
    );
    let out = check(&limits);
    assert!(out.status.success(), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    for key in ["tolerance", "min_limit", "initial_limit"] {
        let key = format!("warning: upstreams.api.adaptive_concurrency.{key}");
        assert!(stderr.contains(&key), "{key}: {stderr}");
    }
    // A tolerance so loose that latency never moves the limit.
    let loose = write(
        &dir,
        "loose.toml",
        "[upstreams.api]\nendpoints = [\"http://127.0.0.1:3000\"]\n\
         [upstreams.api.adaptive_concurrency]\ntolerance = 1e9\n\
         [[routes]]\nname = \"a\"\nupstream = \"api\"\n",
    );
    let out = check(&loose);
    assert!(out.status.success(), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("warning: upstreams.api.adaptive_concurrency.tolerance"),
        "{stderr}"
    );
    // Sensible values warn of nothing.
    let fine = write(
        &dir,
        "fine.toml",
        "[upstreams.api]\nendpoints = [\"http://127.0.0.1:3000\"]\n[[routes]]\nname = \"a\"\nupstream = \"api\"\n[routes.retry]\nper_try_timeout = \"1ms\"\n",
    );
    let out = check(&fine);
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("warning:"),
        "{out:?}"
    );
}
