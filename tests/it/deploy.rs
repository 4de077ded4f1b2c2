//! The deploy/ files, checked offline: the manifests parse, and the fields
//! that matter agree with each other and with the config they carry.

use crate::common;

use std::path::Path;
use std::process::Command;

use common::process::{start, BIN};

use herdguard::config::Config;
use yaml_rust2::{Yaml, YamlLoader};

fn load(name: &str) -> Yaml {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy/kubernetes")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap();
    let mut docs =
        YamlLoader::load_from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(docs.len(), 1, "{name}: one document");
    docs.remove(0)
}

fn str_of<'a>(y: &'a Yaml, what: &str) -> &'a str {
    y.as_str()
        .unwrap_or_else(|| panic!("{what} is not a string: {y:?}"))
}

/// The config the ConfigMap carries.
fn sidecar_config() -> Config {
    let cm = load("configmap.yaml");
    assert_eq!(str_of(&cm["kind"], "kind"), "ConfigMap");
    assert_eq!(str_of(&cm["metadata"]["name"], "name"), "herdguard-config");
    let toml = str_of(&cm["data"]["herdguard.toml"], "data");
    let checked = Config::check_str(toml).unwrap_or_else(|e| panic!("the ConfigMap's config: {e}"));
    assert!(checked.warnings.is_empty(), "{:?}", checked.warnings);
    checked.validated.into_config()
}

/// The herdguard container of a Deployment: an init container with
/// `restartPolicy: Always` (a native sidecar), or one of the containers.
fn herdguard_container(d: &Yaml, native: bool) -> &Yaml {
    let spec = &d["spec"]["template"]["spec"];
    let list = if native {
        &spec["initContainers"]
    } else {
        &spec["containers"]
    };
    list.as_vec()
        .unwrap()
        .iter()
        .find(|c| c["name"].as_str() == Some("herdguard"))
        .expect("a herdguard container")
}

fn container_args(c: &Yaml) -> Vec<&str> {
    c["args"]
        .as_vec()
        .unwrap()
        .iter()
        .map(|a| str_of(a, "an arg"))
        .collect()
}

/// The value of a flag in `args`.
fn after<'a>(args: &[&'a str], flag: &str) -> &'a str {
    let i = args.iter().position(|a| *a == flag);
    args[i.unwrap_or_else(|| panic!("no {flag} in {args:?}")) + 1]
}

fn check_deployment(name: &str, native: bool) {
    let config = sidecar_config();
    let d = load(name);
    assert_eq!(str_of(&d["kind"], "kind"), "Deployment");
    let pod = &d["spec"]["template"];
    let spec = &pod["spec"];
    let labels = &pod["metadata"]["labels"];
    assert_eq!(
        d["spec"]["selector"]["matchLabels"], *labels,
        "{name}: selector matches the pod"
    );

    let herdguard = herdguard_container(&d, native);
    if native {
        assert_eq!(
            herdguard["restartPolicy"].as_str(),
            Some("Always"),
            "a native sidecar"
        );
    } else {
        assert!(herdguard["restartPolicy"].is_badvalue());
    }

    // Probes on the admin port, the port the config's admin listener uses.
    let port = herdguard["ports"]
        .as_vec()
        .unwrap()
        .iter()
        .find(|p| p["name"].as_str() == Some("admin"))
        .unwrap();
    assert_eq!(
        port["containerPort"].as_i64(),
        Some(i64::from(config.admin.address.port()))
    );
    assert!(
        !config.admin.address.ip().is_loopback(),
        "the kubelet must reach the admin port"
    );
    for (probe, path) in [
        ("readinessProbe", "/readyz"),
        ("livenessProbe", "/healthz"),
        ("startupProbe", "/readyz"),
    ] {
        let get = &herdguard[probe]["httpGet"];
        assert_eq!(
            (get["path"].as_str(), get["port"].as_str()),
            (Some(path), Some("admin")),
            "{name}: {probe}"
        );
    }
    // Prometheus scraping by annotation.
    let ann = &pod["metadata"]["annotations"];
    assert_eq!(ann["prometheus.io/scrape"].as_str(), Some("true"));
    assert_eq!(
        ann["prometheus.io/port"].as_str(),
        Some(config.admin.address.port().to_string().as_str())
    );
    assert_eq!(ann["prometheus.io/path"].as_str(), Some("/metrics"));

    // Kubernetes waits longer than herdguard drains.
    let grace = spec["terminationGracePeriodSeconds"].as_i64().unwrap();
    assert!(
        grace as u64 > (config.listen.drain_delay + config.listen.drain_timeout).as_secs(),
        "{name}: grace {grace}s <= drain_delay + drain_timeout"
    );

    // Non-root, read-only, no privileges.
    let sc = &herdguard["securityContext"];
    assert_eq!(sc["runAsNonRoot"].as_bool(), Some(true));
    assert_eq!(sc["readOnlyRootFilesystem"].as_bool(), Some(true));
    assert_eq!(sc["allowPrivilegeEscalation"].as_bool(), Some(false));
    restricted(name, spec, native);

    // The config comes from the ConfigMap, where the args say it is.
    let args = container_args(herdguard);
    let file = after(&args, "--config");
    let mount = herdguard["volumeMounts"].as_vec().unwrap()[0].clone();
    assert_eq!(
        Path::new(file).parent().unwrap(),
        Path::new(mount["mountPath"].as_str().unwrap())
    );
    assert_eq!(mounted_config_map(spec, &mount), Some("herdguard-config"));
    assert!(file.ends_with("herdguard.toml"));

    // The app uses the sidecar as its HTTP proxy and calls each dependency
    // by a name some route matches on (proxy-style requests carry it).
    let app = spec["containers"]
        .as_vec()
        .unwrap()
        .iter()
        .find(|c| c["name"].as_str() == Some("app"))
        .unwrap();
    let env = |key: &str| {
        app["env"]
            .as_vec()
            .unwrap()
            .iter()
            .find(|e| e["name"].as_str() == Some(key))
            .and_then(|e| e["value"].as_str())
    };
    let listen = format!("http://{}", config.listen.address);
    for proxy in ["HTTP_PROXY", "http_proxy"] {
        match native {
            // Captured: the app needs no proxy setting.
            true => assert_eq!(env(proxy), None, "{name}: {proxy}"),
            false => assert_eq!(env(proxy), Some(listen.as_str()), "{name}: {proxy}"),
        }
    }
    if native {
        check_capture(name, spec, herdguard, &config);
    }
    for dependency in ["INVENTORY_URL", "PAYMENTS_URL"] {
        let url: http::Uri = env(dependency).unwrap().parse().unwrap();
        let host = url.host().unwrap();
        assert!(
            config.routes.iter().any(|r| r
                .matcher
                .host
                .as_ref()
                .is_some_and(|h| h.0.iter().any(|h| h == host))),
            "{name}: {dependency} names {host}, which no route matches"
        );
        assert!(
            !url.host().unwrap().starts_with("127."),
            "{name}: {dependency}"
        );
    }
}

/// The capture init container: first, before herdguard; it redirects to
/// the port herdguard listens on (with `transparent`), lets herdguard's
/// own user through, and runs the script the capture ConfigMap carries.
fn check_capture(name: &str, spec: &Yaml, herdguard: &Yaml, config: &Config) {
    let inits = spec["initContainers"].as_vec().unwrap();
    let capture = &inits[0];
    assert_eq!(
        capture["name"].as_str(),
        Some(CAPTURE),
        "{name}: capture first"
    );
    let env = |key: &str| {
        capture["env"]
            .as_vec()
            .unwrap()
            .iter()
            .find(|e| e["name"].as_str() == Some(key))
            .and_then(|e| e["value"].as_str())
            .unwrap_or_else(|| panic!("{name}: capture {key}"))
    };
    assert_eq!(
        env("HERDGUARD_PORT"),
        config.listen.address.port().to_string()
    );
    assert_eq!(
        env("HERDGUARD_UID"),
        herdguard["securityContext"]["runAsUser"]
            .as_i64()
            .unwrap()
            .to_string(),
        "{name}: herdguard's own calls are not captured"
    );
    assert!(
        config.listen.transparent,
        "the listener reads original destinations"
    );
    assert_eq!(
        config.listen.unrouted,
        herdguard::config::Unrouted::Passthrough,
        "what no route names still works"
    );
    let mount = &capture["volumeMounts"].as_vec().unwrap()[0];
    let script = str_of(&capture["command"].as_vec().unwrap()[1], "script");
    assert!(script.starts_with(mount["mountPath"].as_str().unwrap()));
    assert_eq!(mounted_config_map(spec, mount), Some("herdguard-capture"));
}

/// The ConfigMap behind the pod's volume that `mount` mounts.
fn mounted_config_map<'a>(spec: &'a Yaml, mount: &Yaml) -> Option<&'a str> {
    let volume = spec["volumes"]
        .as_vec()?
        .iter()
        .find(|v| v["name"] == mount["name"])?;
    volume["configMap"]["name"].as_str()
}

/// The capture init container's name.
const CAPTURE: &str = "herdguard-capture";

/// The capture ConfigMap carries the script as it is in deploy/.
#[test]
fn the_capture_configmap_carries_the_script() {
    let cm = load("capture-configmap.yaml");
    assert_eq!(str_of(&cm["metadata"]["name"], "name"), "herdguard-capture");
    let script = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/kubernetes/capture.sh"),
    )
    .unwrap();
    assert_eq!(str_of(&cm["data"]["capture.sh"], "capture.sh"), script);
}

/// The Pod Security Standards' "restricted" profile, for every container of
/// the pod: no privilege escalation, every capability dropped, non-root,
/// a seccomp profile, no host namespaces or paths; and no service-account
/// token mounted (nothing in the pod calls the Kubernetes API). The one
/// exception, with `capture`: the capture init container, root with
/// NET_ADMIN and NET_RAW and nothing more.
fn restricted(name: &str, spec: &Yaml, capture: bool) {
    let pod = &spec["securityContext"];
    assert_eq!(
        spec["automountServiceAccountToken"].as_bool(),
        Some(false),
        "{name}"
    );
    for host in ["hostNetwork", "hostPID", "hostIPC"] {
        assert_ne!(spec[host].as_bool(), Some(true), "{name}: {host}");
    }
    for volume in spec["volumes"].as_vec().unwrap() {
        assert!(volume["hostPath"].is_badvalue(), "{name}: hostPath");
    }
    let containers = ["initContainers", "containers"]
        .iter()
        .filter_map(|list| spec[*list].as_vec())
        .flatten();
    let mut seen = 0;
    for c in containers {
        seen += 1;
        let who = format!("{name}: {}", c["name"].as_str().unwrap());
        let sc = &c["securityContext"];
        // A container's own setting wins over the pod's.
        let either = |key: &str| match &sc[key] {
            Yaml::BadValue => &pod[key],
            own => own,
        };
        assert_eq!(
            sc["allowPrivilegeEscalation"].as_bool(),
            Some(false),
            "{who}"
        );
        assert_ne!(sc["privileged"].as_bool(), Some(true), "{who}");
        let drop = sc["capabilities"]["drop"].as_vec().expect("drops");
        assert!(drop.iter().any(|d| d.as_str() == Some("ALL")), "{who}");
        if capture && c["name"].as_str() == Some(CAPTURE) {
            let add = sc["capabilities"]["add"].as_vec().expect("adds");
            assert!(
                add.iter()
                    .all(|a| matches!(a.as_str(), Some("NET_ADMIN" | "NET_RAW"))),
                "{who}"
            );
            assert!(c["restartPolicy"].is_badvalue(), "{who}: runs once");
            continue;
        }
        if let Some(add) = sc["capabilities"]["add"].as_vec() {
            assert!(
                add.iter().all(|a| a.as_str() == Some("NET_BIND_SERVICE")),
                "{who}"
            );
        }
        assert_eq!(either("runAsNonRoot").as_bool(), Some(true), "{who}");
        assert_ne!(either("runAsUser").as_i64(), Some(0), "{who}");
        let seccomp = either("seccompProfile")["type"].as_str();
        assert!(
            matches!(seccomp, Some("RuntimeDefault" | "Localhost")),
            "{who}: seccompProfile {seccomp:?}"
        );
    }
    assert_eq!(
        seen,
        2 + usize::from(capture),
        "{name}: the app and herdguard (and the capture)"
    );
}

#[test]
fn native_sidecar_deployment() {
    check_deployment("deployment-native-sidecar.yaml", true);
}

#[test]
fn classic_sidecar_deployment() {
    check_deployment("deployment-classic-sidecar.yaml", false);
}

/// The sidecar's args, as the manifests give them, start the real binary
/// with the ConfigMap's config (on loopback ports for the test), and give it
/// the threads they name rather than one per core of the node.
#[tokio::test]
async fn the_sidecar_args_start_the_binary() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("herdguard.toml");
    let cm = load("configmap.yaml");
    std::fs::write(&config, str_of(&cm["data"]["herdguard.toml"], "data")).unwrap();
    for (name, native) in [
        ("deployment-native-sidecar.yaml", true),
        ("deployment-classic-sidecar.yaml", false),
    ] {
        let d = load(name);
        let args = container_args(herdguard_container(&d, native));
        let threads: usize = after(&args, "--threads").parse().unwrap();
        let mut cmd = Command::new(BIN);
        // The same args, but the config file is the test's copy of the ConfigMap's.
        for (i, arg) in args.iter().enumerate() {
            if i > 0 && args[i - 1] == "--config" {
                cmd.arg(&config);
            } else {
                cmd.arg(arg);
            }
        }
        cmd.args(["--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"]);
        let running = start(cmd).await;
        assert_eq!(running.serving["threads"], threads, "{name}");
        running.terminate().await;
    }
}

#[test]
fn pod_monitor_scrapes_the_admin_port() {
    let pm = load("podmonitor.yaml");
    assert_eq!(str_of(&pm["kind"], "kind"), "PodMonitor");
    let endpoint = &pm["spec"]["podMetricsEndpoints"][0];
    assert_eq!(
        (endpoint["port"].as_str(), endpoint["path"].as_str()),
        (Some("admin"), Some("/metrics"))
    );
    let deployment = load("deployment-native-sidecar.yaml");
    assert_eq!(
        pm["spec"]["selector"]["matchLabels"],
        deployment["spec"]["template"]["metadata"]["labels"]
    );
}

#[test]
fn dockerfile_is_multi_stage_and_runs_as_non_root() {
    let text =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/Dockerfile"))
            .unwrap();
    let froms: Vec<&str> = text.lines().filter(|l| l.starts_with("FROM ")).collect();
    assert_eq!(froms.len(), 2, "build and runtime stages");
    assert!(
        froms[1].contains("distroless") && froms[1].contains("nonroot"),
        "{}",
        froms[1]
    );
    let user = text
        .lines()
        .find(|l| l.starts_with("USER "))
        .expect("a USER line");
    assert!(!user.contains("root") || user.contains("nonroot"));
    assert!(user.contains("65532"), "{user}");
    // The release step the image runs builds from the lock file.
    assert!(text.contains("RUN deploy/release-build.sh"), "{text}");
    let script = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/release-build.sh"),
    )
    .unwrap();
    assert!(script.contains("cargo rustc --release --locked --bin herdguard"));
}
