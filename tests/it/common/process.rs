//! The real binary, run as a child process: started, read from its JSON log
//! lines, and stopped with SIGTERM.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

pub const BIN: &str = env!("CARGO_BIN_EXE_herdguard");

/// A started binary: the child, its parsed JSON "herdguard serving" line, and
/// the log lines that follow.
pub struct Running {
    pub child: std::process::Child,
    pub serving: serde_json::Value,
    /// The proxy's address, from the start-up line.
    pub listen: String,
    pub rest: std::sync::mpsc::Receiver<String>,
}

impl Running {
    /// Sends SIGTERM, checks the exit status is 0, and gives back the log lines left.
    pub async fn terminate(self) -> Vec<String> {
        let Running { child, rest, .. } = self;
        let killed = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .unwrap();
        assert!(killed.success());
        Running::exited(child, rest).await
    }

    /// Waits for `child` to end, checks the exit is 0, and gives back the
    /// log lines left.
    async fn exited(
        mut child: std::process::Child,
        rest: std::sync::mpsc::Receiver<String>,
    ) -> Vec<String> {
        let status = tokio::task::spawn_blocking(move || child.wait())
            .await
            .unwrap()
            .unwrap();
        assert!(status.success(), "exit status {status:?}");
        rest.iter().collect()
    }
}

/// `herdguard --upstream URL` on ephemeral ports with JSON logs, started.
pub async fn quick_mode(url: &str, extra: &[&str]) -> Running {
    let mut cmd = Command::new(BIN);
    cmd.args([
        "--upstream",
        url,
        "--listen",
        "127.0.0.1:0",
        "--admin",
        "127.0.0.1:0",
    ])
    .args(["--log-format", "json"])
    .args(extra);
    start(cmd).await
}

/// Spawns `cmd` with its stderr read line by line on a thread of its own.
pub fn spawn_reading_stderr(
    mut cmd: Command,
) -> (std::process::Child, std::sync::mpsc::Receiver<String>) {
    let mut child = cmd.stderr(Stdio::piped()).spawn().unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    (child, rx)
}

/// Starts `cmd` (which must log JSON) and waits for its start-up line.
pub async fn start(cmd: Command) -> Running {
    let (child, rx) = spawn_reading_stderr(cmd);
    let (line, rest) = line_with(rx, "herdguard serving").await;
    let serving: serde_json::Value = serde_json::from_str(&line).expect("JSON log lines");
    let listen = serving["listen"]
        .as_str()
        .expect("a listen address")
        .to_owned();
    Running {
        child,
        serving,
        listen,
        rest,
    }
}

/// Waits for the next log line that contains `text`; gives back the lines after it.
pub async fn line_with(
    lines: std::sync::mpsc::Receiver<String>,
    text: &'static str,
) -> (String, std::sync::mpsc::Receiver<String>) {
    tokio::task::spawn_blocking(move || {
        let mut seen = Vec::new();
        for line in lines.iter() {
            if line.contains(text) {
                return (line, lines);
            }
            seen.push(line);
        }
        panic!("no log line with {text:?}; the process wrote: {seen:#?}")
    })
    .await
    .unwrap()
}

/// The real binary started on a config file, on ephemeral ports; killed if
/// a test fails before it is terminated.
pub struct Binary {
    running: Option<Running>,
    pub listen: String,
    pub admin: String,
    _config: tempfile::NamedTempFile,
}

impl Binary {
    /// Starts `herdguard --config FILE` with `toml` after a `[listen]` and
    /// `[admin]` on 127.0.0.1:0 (so `toml` must not have them).
    pub async fn start(toml: &str) -> Binary {
        Self::start_with("", toml).await
    }

    /// Like [`start`](Self::start), with more keys of `[listen]`.
    pub async fn start_with(listen: &str, toml: &str) -> Binary {
        Self::start_adjusted(listen, toml, |_| {}).await
    }

    /// Like [`start_with`](Self::start_with), with the command changed by
    /// `adjust` before it runs (its stdout, say).
    pub async fn start_adjusted(
        listen: &str,
        toml: &str,
        adjust: impl FnOnce(&mut Command),
    ) -> Binary {
        use std::io::Write as _;
        let mut config = tempfile::NamedTempFile::new().unwrap();
        write!(
            config,
            "[listen]\naddress = \"127.0.0.1:0\"\n{listen}\n[admin]\naddress = \"127.0.0.1:0\"\n{toml}"
        )
        .unwrap();
        let mut cmd = Command::new(BIN);
        cmd.arg("--config")
            .arg(config.path())
            .args(["--log-format", "json", "--threads", "2"]);
        adjust(&mut cmd);
        let running = start(cmd).await;
        let admin = running.serving["admin"]
            .as_str()
            .expect("an admin address")
            .to_owned();
        Binary {
            listen: running.listen.clone(),
            admin,
            running: Some(running),
            _config: config,
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.running.as_ref().expect("running").child.id()
    }

    /// Writes `toml` as the config file (after the same `[listen]` and
    /// `[admin]` as at start) and sends SIGHUP.
    pub fn reload(&self, toml: &str) {
        self.reload_with("", toml)
    }

    /// The config file it was started on (watched for changes).
    pub fn config_path(&self) -> &std::path::Path {
        self._config.path()
    }

    /// Like [`reload`](Self::reload), with more keys of `[listen]`.
    pub fn reload_with(&self, listen: &str, toml: &str) {
        let text = format!(
            "[listen]\naddress = \"127.0.0.1:0\"\n{listen}\n[admin]\naddress = \"127.0.0.1:0\"\n{toml}"
        );
        std::fs::write(self._config.path(), text).unwrap();
        let sent = Command::new("kill")
            .args(["-HUP", &self.pid().to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
    }

    /// Resident memory, in KiB, from /proc.
    pub fn rss_kib(&self) -> u64 {
        self.status_kib("VmRSS:")
    }

    /// The most it was ever resident, in KiB.
    /// Bytes the process has read with read(2) and its kin, files and
    /// sockets alike (`rchar` in /proc/PID/io).
    pub fn bytes_read(&self) -> u64 {
        let io = std::fs::read_to_string(format!("/proc/{}/io", self.pid())).unwrap();
        io.lines()
            .find_map(|l| l.strip_prefix("rchar:"))
            .and_then(|v| v.trim().parse().ok())
            .expect("rchar in /proc/PID/io")
    }

    pub fn peak_rss_kib(&self) -> u64 {
        self.status_kib("VmHWM:")
    }

    fn status_kib(&self, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or_else(|| panic!("{field} in /proc/PID/status"))
    }

    /// The admin listener's `/metrics` text.
    pub async fn metrics(&self) -> String {
        let req = http::Request::get(format!("http://{}/metrics", self.admin))
            .body(super::empty())
            .unwrap();
        let (_, _, body) = super::send(&super::client(), req).await;
        String::from_utf8(body.to_vec()).unwrap()
    }

    /// One series of `/metrics`, 0 when it is not there yet.
    pub async fn metric(&self, series: &str) -> f64 {
        super::metric(&self.metrics().await, series).unwrap_or(0.0)
    }

    /// Sends SIGTERM and returns at once.
    pub fn sigterm(&self) {
        let sent = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
    }

    /// Waits for the process to end by itself (after [`sigterm`](Self::sigterm)),
    /// checks the exit is 0, and gives back the log lines left.
    pub async fn exited(mut self) -> Vec<String> {
        let Running { child, rest, .. } = self.running.take().expect("running");
        Running::exited(child, rest).await
    }

    /// Sends SIGTERM and checks the exit.
    pub async fn terminate(mut self) -> Vec<String> {
        let running = self.running.take().expect("running");
        running.terminate().await
    }
}

impl Drop for Binary {
    fn drop(&mut self) {
        if let Some(running) = &mut self.running {
            let _ = running.child.kill();
            let _ = running.child.wait();
        }
    }
}
