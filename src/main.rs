//! The herdguard command line: parse arguments, load the config, start logging, run.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use herdguard::app::{FileStamp, Server};
use herdguard::config::{Checked, Config, Validated};
use herdguard::demo;
use herdguard::observe::telemetry::{self, LogFormat};
use tokio::signal::unix::{signal, SignalKind};
use tracing::{error, info, warn};

// The modules with `unsafe`: calls into glibc's malloc interface, and the
// one `ioctl` that reads a socket's send queue.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
mod malloc;
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
mod sockets;

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[global_allocator]
static ALLOCATOR: malloc::Counted = malloc::Counted;

// Writing to stdout or stderr never panics: a closed pipe (`check | head`)
// or a full disk (`> /dev/full`) is not a reason to abort.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = write!(std::io::stdout(), $($arg)*);
    }};
}
macro_rules! out_line {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}
macro_rules! err_line {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

/// Raises the soft limit on open files to the hard one: each caller
/// connection is a descriptor (two, with its upstream side), and the usual
/// soft limit of 1,024 would refuse callers long before `max_connections`
/// (10,000 by default), as nginx's `worker_rlimit_nofile` does. Returns the
/// limit in force.
fn raise_open_file_limit() -> Option<u64> {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let limit = getrlimit(Resource::Nofile);
    let current = limit.current?;
    let wanted = limit.maximum.unwrap_or(u64::MAX).min(1 << 20);
    if wanted > current {
        let raised = Rlimit {
            current: Some(wanted),
            maximum: limit.maximum,
        };
        if setrlimit(Resource::Nofile, raised).is_ok() {
            return Some(wanted);
        }
    }
    Some(current)
}

/// A sidecar retrying HTTP reverse proxy: budgeted, jittered retries behind a
/// circuit breaker, at one layer.
#[derive(Debug, Parser)]
#[command(name = "herdguard", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,

    /// Run with this config file.
    #[arg(long, env = "HERDGUARD_CONFIG", conflicts_with = "upstream")]
    config: Option<PathBuf>,

    /// Run with built-in defaults and one catch-all route to this URL.
    #[arg(long, value_name = "URL")]
    upstream: Option<String>,

    /// Listen address for callers (overrides the config's).
    #[arg(long, value_name = "ADDR")]
    listen: Option<SocketAddr>,

    /// Admin address for /metrics, /healthz, /readyz, /config (overrides the config's).
    #[arg(long, value_name = "ADDR")]
    admin: Option<SocketAddr>,

    /// Tokio worker threads (default: one per core given to the process by a
    /// CPU limit or CPU set, else one per two of the machine's cores).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..))]
    threads: Option<u16>,

    /// Log format; the level comes from RUST_LOG (default info).
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Validate a config file and print the effective config (defaults merged),
    /// or every error with its key path and line.
    Check {
        /// The config file to check.
        #[arg(long, env = "HERDGUARD_CONFIG")]
        config: PathBuf,
        /// Print nothing when the config is valid (warnings and errors still go to stderr).
        #[arg(long, short)]
        quiet: bool,
    },
    /// Start a flaky API in-process, herdguard with default policies in front
    /// of it, send traffic for about 15 s, and show what the proxy absorbed.
    Demo {
        /// Callers, each sending a request every 100 ms, answered or not.
        #[arg(long, default_value_t = 16, value_parser = herdguard::units::at_least_one::<usize>)]
        callers: usize,
        /// How long the traffic runs.
        #[arg(long, default_value = "15s", value_parser = herdguard::units::parse_duration)]
        duration: std::time::Duration,
    },
}

fn main() -> ExitCode {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        malloc::trim_freed_memory();
        herdguard::listen::pressure::measure_with(malloc::counted);
    }
    #[cfg(target_os = "linux")]
    herdguard::listen::send_queue_with(sockets::send_queue);
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Check { config, quiet }) => check(&config, quiet),
        Some(Command::Demo { callers, duration }) => run_demo(callers, duration),
        None => run(cli),
    }
}

fn run_demo(callers: usize, duration: std::time::Duration) -> ExitCode {
    telemetry::init(LogFormat::Text);
    let outage_at = duration.mul_f64(0.4);
    let access_log = std::env::temp_dir().join("herdguard-demo-access.log");
    let params = demo::Params {
        callers,
        duration,
        outage_at,
        outage_for: duration.mul_f64(0.2),
        access_log: Some(access_log.clone()),
        ..demo::Params::default()
    };
    out_line!(
        "herdguard demo: a flaky API (10% 503s, a third with Retry-After; 3% connection resets; an outage \
         from {:.1}s to {:.1}s), herdguard with default policies in front, {} callers sending every {} ms for {}s.\n",
        params.outage_at.as_secs_f64(),
        (params.outage_at + params.outage_for).as_secs_f64(),
        params.callers,
        params.interval.as_millis(),
        params.duration.as_secs()
    );
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            err_line!("herdguard demo: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let summary = rt.block_on(demo::run(&params, |elapsed, second, upstream, metrics| {
        out_line!(
            "{}",
            demo::progress_line(elapsed, second, upstream, metrics)
        );
    }));
    match summary {
        Ok(summary) => {
            out_line!("\n{}", summary.render());
            if let Ok((lines, samples)) = demo::access_log_samples(&access_log) {
                out_line!(
                    "\nThe access log ([access_log] enabled = true; on stdout outside the demo) has \
                     {lines} lines in {}; a few:",
                    access_log.display()
                );
                for line in samples {
                    out_line!("  {line}");
                }
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            err_line!("herdguard demo: {e}");
            ExitCode::FAILURE
        }
    }
}

fn check(path: &std::path::Path, quiet: bool) -> ExitCode {
    match Config::check_file(path) {
        Ok(checked) => {
            if !quiet {
                out!("{}", checked.validated.config().to_toml());
            }
            for w in &checked.warnings {
                err_line!("warning: {w}");
            }
            if !quiet {
                err_line!(
                    "{}: ok ({} warnings)",
                    path.display(),
                    checked.warnings.len()
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            err_line!("{e}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> ExitCode {
    // Before the file is read: a change made from here on is seen.
    let stamp = cli.config.as_deref().map(FileStamp::of);
    let checked = match (&cli.config, &cli.upstream) {
        (Some(path), _) => Config::check_file(path)
            .map_err(|e| e.to_string())
            .and_then(
                |Checked {
                     validated,
                     warnings,
                 }| {
                    let validated = validated
                        .with_addresses(cli.listen, cli.admin)
                        .map_err(|e| format!("--listen/--admin: {e}"))?;
                    Ok((validated, warnings))
                },
            ),
        (None, Some(url)) => Config::for_upstream(url, cli.listen, cli.admin)
            .and_then(Config::validate)
            .map(|validated| (validated, Vec::new()))
            .map_err(|e| format!("--upstream: {e}")),
        (None, None) => Err("give --config FILE or --upstream URL (see --help)".to_owned()),
    };
    let (config, warnings) = match checked {
        Ok(c) => c,
        Err(e) => {
            err_line!("herdguard: {e}");
            return ExitCode::from(2);
        }
    };
    telemetry::init(cli.log_format);
    for w in &warnings {
        warn!(warning = %w, "config");
    }

    // A thread per core given to the process (its CPU affinity and cgroup
    // quota, so a sidecar limited to one core or less counts one), one per
    // two of a machine's cores it shares (see `app::threads`).
    let threads = cli
        .threads
        .map_or_else(herdguard::app::threads::for_this_process, usize::from);
    // One thread: the lighter current-thread scheduler does the same work
    // with no cross-thread queues.
    let mut rt = match threads {
        1 => tokio::runtime::Builder::new_current_thread(),
        n => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(n);
            b
        }
    };
    rt.enable_all();
    let rt = match rt.build() {
        Ok(rt) => rt,
        Err(e) => {
            err_line!("herdguard: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    rt.block_on(serve(config, cli.config.zip(stamp)))
}

/// Runs until SIGTERM or SIGINT. With a config file, SIGHUP and any change
/// of the file reload it.
async fn serve(config: Validated, file: Option<(PathBuf, FileStamp)>) -> ExitCode {
    // Handlers first: a signal that arrives once the server says it is
    // serving must find them (SIGHUP's default action would end the process).
    let (Ok(mut term), Ok(mut int), Ok(mut hup)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
        signal(SignalKind::hangup()),
    ) else {
        error!("cannot install signal handlers");
        return ExitCode::FAILURE;
    };
    if let Some(files) = raise_open_file_limit() {
        // One descriptor per caller, and room for upstream connections.
        let wanted = (config.config().listen.max_connections as u64).saturating_add(256);
        if files < wanted {
            warn!(
                open_files = files,
                max_connections = config.config().listen.max_connections,
                "the open-file limit is below max_connections (and room for upstream connections): callers past it are refused"
            );
        }
    }
    let server = match Server::start_validated(config).await {
        Ok(s) => s,
        Err(e) => {
            error!(error = %e, "cannot start");
            return ExitCode::FAILURE;
        }
    };
    if let Some((path, stamp)) = &file {
        server.watch(path.clone(), std::time::Duration::from_secs(1), *stamp);
    }
    let reloader = server.reloader();
    loop {
        tokio::select! {
            _ = term.recv() => {
                info!(signal = "SIGTERM", "shutting down");
                break;
            }
            _ = int.recv() => {
                info!(signal = "SIGINT", "shutting down");
                break;
            }
            _ = hup.recv() => match &file {
                Some((path, _)) => {
                    info!(signal = "SIGHUP", path = %path.display(), "reloading");
                    Server::settled(path).await;
                    let _ = reloader.reload_file_in_background(path.clone()).await;
                }
                None => warn!(signal = "SIGHUP", "no config file to reload (running with --upstream)"),
            },
        }
    }
    // Callers (the app beside a sidecar) may still be sending: serve them
    // for drain_delay with readiness off, unless a second signal cuts it short.
    let delay = server.drain_delay();
    if !delay.is_zero() {
        server.not_ready();
        info!(delay = ?delay, "readiness off; serving on until the drain delay passes");
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = term.recv() => info!(signal = "SIGTERM", "drain delay cut short"),
            _ = int.recv() => info!(signal = "SIGINT", "drain delay cut short"),
        }
    }
    server.shutdown();
    server.wait().await;
    herdguard::observe::access_log::flush(std::time::Duration::from_secs(2));
    info!("stopped");
    ExitCode::SUCCESS
}
