//! `herdguard-lab train`, the training run of the profile-guided release
//! build: the real herdguard binary, under the whole mix, stopped with
//! SIGINT and exiting cleanly (a binary built to be profiled writes its
//! profile only then).

use std::path::PathBuf;
use std::process::Command;

/// The workspace's herdguard binary, built beside this test's own.
fn herdguard() -> PathBuf {
    let lab = PathBuf::from(env!("CARGO_BIN_EXE_herdguard-lab"));
    let binary = lab.with_file_name("herdguard");
    assert!(
        binary.exists(),
        "{} is missing: the workspace's tests build it",
        binary.display()
    );
    binary
}

#[test]
fn the_training_run_sends_the_whole_mix_and_stops_the_proxy_cleanly() {
    let out = Command::new(env!("CARGO_BIN_EXE_herdguard-lab"))
        .args(["train", "--requests", "2000"])
        .arg(herdguard())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Of every 20 requests: one to a path the upstream does not have, one
    // answered 503 and retried (a retry that meets a 503 again is allowed
    // by the budget only now and then), the rest 200.
    assert_eq!(count(&stdout, 404), Some(100), "{stdout}");
    let ok = count(&stdout, 200).unwrap_or(0);
    assert!((1800..=1900).contains(&ok), "{stdout}");
    assert_eq!(count(&stdout, 0), None, "{stdout}");
}

/// The count of `status` in the run's summary (`{200: 1850, 404: 100}`).
fn count(summary: &str, status: u16) -> Option<u64> {
    let (_, after) = summary
        .split_once(&format!("{{{status}: "))
        .or_else(|| summary.split_once(&format!(" {status}: ")))?;
    after.split([',', '}']).next()?.trim().parse().ok()
}

#[test]
fn a_binary_that_does_not_start_is_an_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_herdguard-lab"))
        .args(["train", "--requests", "10", "/nonexistent/herdguard"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/herdguard"));
}

/// A binary that starts and never answers (here: one that sleeps) does not
/// hang the build that trains it: the run gives up at its readiness bound,
/// stops it, and says so.
#[test]
fn a_binary_that_never_answers_is_given_up_on() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = tempfile::tempdir().unwrap();
    let fake = dir.path().join("silent");
    std::fs::write(&fake, "#!/bin/sh\nexec sleep 600\n").unwrap();
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let started = std::time::Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_herdguard-lab"))
        .args(["train", "--requests", "10"])
        .arg(&fake)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("health check"), "{stderr}");
    // Readiness is bounded at 10 s and the stop at 30 s.
    assert!(started.elapsed() < std::time::Duration::from_secs(45));
}

/// A binary that exits at once (a config it refuses, a port taken) is
/// reported as such, not waited for until the readiness bound.
#[test]
fn a_binary_that_exits_at_once_is_reported_as_exited() {
    let out = Command::new(env!("CARGO_BIN_EXE_herdguard-lab"))
        .args(["train", "--requests", "10", "/bin/false"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("exited before it was ready"), "{stderr}");
}
