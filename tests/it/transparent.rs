//! Transparent capture, through the binary, in a network namespace the test
//! makes itself (`unshare --net`, so nothing of the machine's network is
//! touched): the shipped capture rules (deploy/kubernetes/capture.sh)
//! redirect an unmodified app's plain HTTP calls to herdguard, which reads
//! each connection's original destination. A call to a service a route
//! names is retried per its route (the service sees `Via`); a call to an
//! address no route names still succeeds, passed through to where it was
//! going. Needs root and iptables (`.ci/test-tools` installs it).

use std::path::Path;
use std::process::Command;

use crate::common::process::BIN;

#[test]
fn an_unmodified_app_is_captured_retried_and_passed_through() {
    crate::common::test_tools();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    assert!(
        rustix::process::geteuid().is_root(),
        "the capture test makes a network namespace and iptables rules: run as root"
    );
    // Readable by the proxy's own user (uid 1337).
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let config = dir.path().join("herdguard.toml");
    std::fs::write(
        &config,
        "[listen]\naddress = \"127.0.0.1:15001\"\ntransparent = true\nunrouted = \"passthrough\"\n\
         [admin]\naddress = \"127.0.0.1:15002\"\n\
         [upstreams.flaky]\nendpoints = [\"http://127.0.0.2:8080\"]\n\
         [[routes]]\nname = \"flaky\"\nupstream = \"flaky\"\nmatch = { host = \"127.0.0.2\" }\n",
    )
    .unwrap();
    let log = dir.path().join("herdguard.log");
    let out = Command::new("timeout")
        .args(["60", "unshare", "--net", "bash"])
        .arg(root.join("tests/transparent/run.sh"))
        .env("BIN", BIN)
        .env("CONFIG", &config)
        .env("CAPTURE", root.join("deploy/kubernetes/capture.sh"))
        .env("HERE", root.join("tests/transparent"))
        .env("LOG", &log)
        .output()
        .expect("unshare runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report = format!(
        "stdout:\n{stdout}\nstderr:\n{}\nherdguard:\n{}",
        String::from_utf8_lossy(&out.stderr),
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    assert!(out.status.success(), "{report}");
    let line = |url: &str| {
        stdout
            .lines()
            .find(|l| l.starts_with(url))
            .unwrap_or_else(|| panic!("no line for {url}\n{report}"))
            .to_owned()
    };
    // Routed: the first attempt got 503, the retry 200, through herdguard.
    let flaky = line("http://127.0.0.2:8080/flaky");
    assert!(
        flaky.contains("status=200")
            && flaky.contains("attempts=2")
            && flaky.contains("attempt=2 via=1.1 herdguard"),
        "{report}"
    );
    // Unrouted: passed through to its original destination, once.
    let other = line("http://127.0.0.3:8080/other");
    assert!(
        other.contains("status=200") && other.contains("other via=1.1 herdguard"),
        "{report}"
    );
}
