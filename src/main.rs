//! The herdguard command line: parse arguments, load the config, start logging, run.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use herdguard::app::Server;
use herdguard::config::{Checked, Config};
use herdguard::demo;
use herdguard::lab::{self, outage};
use herdguard::telemetry::{self, LogFormat};
use tokio::signal::unix::{signal, SignalKind};
use tracing::{error, info, warn};

#[cfg(all(not(feature = "mimalloc"), target_os = "linux", target_env = "gnu"))]
mod malloc;

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

/// With the `mimalloc` feature, mimalloc instead of glibc's malloc. The
/// default is glibc's, trimmed (see [`malloc`]): measured with
/// 3,000 idle connections and with a reload from 10,000 routes to 2, it
/// holds less per connection and gives back what was freed, where mimalloc
/// kept most of it (README, "Memory").
#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Freed memory goes back to the system at once: mimalloc purges what is
/// freed after a delay (10 ms), but only when the thread that owns it next
/// allocates or collects, so a mostly idle sidecar kept most of a big
/// config's memory after a reload to a small one (86 MB of a 596 MB peak,
/// from 14 MB). Purged at once: a peak of 304-343 MB and 31-84 MB after,
/// for 2.5% of throughput (README, "Memory follows the config"). An operator's
/// `MIMALLOC_PURGE_DELAY` wins.
#[cfg(feature = "mimalloc")]
fn purge_freed_memory_at_once() {
    /// `mi_option_purge_delay` in mimalloc v2's `mimalloc.h` (the crate
    /// exports no constant for it).
    const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: mi_option_set only stores the value; any thread, any time.
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, 0) };
    }
}

/// Raises the soft limit on open files to the hard one: each caller
/// connection is a descriptor (two, with its upstream side), and the usual
/// soft limit of 1,024 would refuse callers long before `max_connections`
/// (10,000 by default), as nginx's `worker_rlimit_nofile` does. Returns the
/// limit in force.
#[cfg(target_os = "linux")]
fn raise_open_file_limit() -> Option<u64> {
    #[repr(C)]
    struct Rlimit {
        cur: u64,
        max: u64,
    }
    const RLIMIT_NOFILE: std::ffi::c_int = 7;
    extern "C" {
        fn getrlimit(resource: std::ffi::c_int, rlim: *mut Rlimit) -> std::ffi::c_int;
        fn setrlimit(resource: std::ffi::c_int, rlim: *const Rlimit) -> std::ffi::c_int;
    }
    let mut limit = Rlimit { cur: 0, max: 0 };
    // SAFETY: getrlimit writes the struct it is given, of the C layout.
    if unsafe { getrlimit(RLIMIT_NOFILE, &mut limit) } != 0 {
        return None;
    }
    let wanted = limit.max.min(1 << 20);
    if wanted > limit.cur {
        let raised = Rlimit {
            cur: wanted,
            max: limit.max,
        };
        // SAFETY: setrlimit reads the struct it is given.
        if unsafe { setrlimit(RLIMIT_NOFILE, &raised) } == 0 {
            return Some(wanted);
        }
    }
    Some(limit.cur)
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

    /// Tokio worker threads (default: the cores this process may use).
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
        #[arg(long, default_value_t = 16, value_parser = at_least_one::<usize>)]
        callers: usize,
        /// How long the traffic runs.
        #[arg(long, default_value = "15s", value_parser = duration)]
        duration: std::time::Duration,
    },
    /// Reproducible experiments on loopback.
    #[command(subcommand)]
    Lab(Lab),
}

#[derive(Debug, Subcommand)]
enum Lab {
    /// Clients contending on one resource with optimistic concurrency, per
    /// backoff strategy: total calls and completion time (a simulation).
    Backoff {
        /// Client counts to simulate, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "10,25,50,100,150,200", value_parser = at_least_one::<usize>)]
        clients: Vec<usize>,
        /// Trials per point, averaged.
        #[arg(long, default_value_t = 20, value_parser = at_least_one::<u64>)]
        trials: u64,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Directory for the CSV file and the plot.
        #[arg(long, default_value = "lab-results")]
        out: PathBuf,
    },
    /// An upstream that slows with load stalls under naive retrying callers,
    /// then resumes: peak concurrency and time to recovery, per setup.
    Outage {
        /// Concurrent callers.
        #[arg(long, default_value_t = 200, value_parser = at_least_one::<usize>)]
        callers: usize,
        #[arg(long, default_value = "5s", value_parser = duration)]
        warmup: std::time::Duration,
        /// How long the upstream stalls.
        #[arg(long, default_value = "10s", value_parser = duration)]
        stall: std::time::Duration,
        /// How long the run goes on after the upstream resumes.
        #[arg(long, default_value = "20s", value_parser = duration)]
        after: std::time::Duration,
        /// Setups to run, comma-separated: direct, naive, defaults, no-adaptive.
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "direct,naive,defaults,no-adaptive"
        )]
        setups: Vec<String>,
        /// Directory for the CSV files, the summary and the plot.
        #[arg(long, default_value = "lab-results")]
        out: PathBuf,
    },
    /// Draws the SVG plots again from the CSV files of earlier runs.
    Plot {
        /// Directory holding backoff.csv and outage-*.csv.
        #[arg(long, default_value = "lab-results")]
        from: PathBuf,
        /// Directory for backoff.svg and outage.svg (default: --from).
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

/// A count of one or more.
fn at_least_one<T>(text: &str) -> Result<T, String>
where
    T: std::str::FromStr + Default + PartialEq,
    T::Err: std::fmt::Display,
{
    match text.parse::<T>() {
        Ok(n) if n == T::default() => Err("must be at least 1".to_owned()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

fn duration(text: &str) -> Result<std::time::Duration, String> {
    herdguard::config::units::parse_duration(text)
}

fn main() -> ExitCode {
    #[cfg(feature = "mimalloc")]
    purge_freed_memory_at_once();
    #[cfg(all(not(feature = "mimalloc"), target_os = "linux", target_env = "gnu"))]
    malloc::trim_freed_memory();
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Check { config, quiet }) => check(&config, quiet),
        Some(Command::Lab(lab)) => run_lab(lab),
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
         from {}s to {}s), herdguard with default policies in front, {} callers sending every {} ms for {}s.\n",
        params.outage_at.as_secs(),
        (params.outage_at + params.outage_for).as_secs(),
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

fn run_lab(lab: Lab) -> ExitCode {
    let result = match lab {
        Lab::Backoff {
            clients,
            trials,
            seed,
            out,
        } => lab_backoff(&clients, trials, seed, &out),
        Lab::Outage {
            callers,
            warmup,
            stall,
            after,
            setups,
            out,
        } => {
            let params = outage::Params {
                callers,
                warmup,
                stall,
                after,
                ..outage::Params::default()
            };
            lab_outage(&setups, &params, &out)
        }
        Lab::Plot { from, out } => lab_plot(&from, out.as_deref().unwrap_or(&from)),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(LabError::Usage(e)) => {
            err_line!("herdguard lab: {e}");
            ExitCode::from(2)
        }
        Err(LabError::Failed(e)) => {
            err_line!("herdguard lab: {e}");
            ExitCode::FAILURE
        }
    }
}

enum LabError {
    Usage(String),
    Failed(String),
}

impl From<lab::plot::PlotError> for LabError {
    fn from(e: lab::plot::PlotError) -> Self {
        LabError::Failed(e.to_string())
    }
}

fn write(path: &std::path::Path, contents: &str) -> Result<(), LabError> {
    std::fs::write(path, contents)
        .map_err(|e| LabError::Failed(format!("cannot write {}: {e}", path.display())))
}

fn read(path: &std::path::Path) -> Result<String, LabError> {
    std::fs::read_to_string(path)
        .map_err(|e| LabError::Failed(format!("cannot read {}: {e}", path.display())))
}

fn create_dir(dir: &std::path::Path) -> Result<(), LabError> {
    std::fs::create_dir_all(dir)
        .map_err(|e| LabError::Failed(format!("cannot create {}: {e}", dir.display())))
}

fn lab_backoff(
    clients: &[usize],
    trials: u64,
    seed: u64,
    out: &std::path::Path,
) -> Result<(), LabError> {
    let rows = lab::backoff::run(clients, trials.max(1), seed);
    out!("{}", lab::backoff::table(&rows));
    create_dir(out)?;
    let csv = lab::backoff::csv(&rows);
    write(&out.join("backoff.csv"), &csv)?;
    // Drawn from the CSV's rounded values, so that `lab plot` redraws it exactly.
    let rows = lab::backoff::parse_csv(&csv).map_err(LabError::Failed)?;
    let svg = lab::plot::backoff(&rows)?;
    write(&out.join("backoff.svg"), &svg)
}

fn lab_outage(
    setups: &[String],
    params: &outage::Params,
    out: &std::path::Path,
) -> Result<(), LabError> {
    let chosen = setups
        .iter()
        .map(|name| {
            outage::Setup::parse(name).ok_or_else(|| {
                LabError::Usage(format!(
                    "unknown outage setup {name:?} (use direct, naive, defaults, no-adaptive)"
                ))
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    create_dir(out)?;
    let rt = tokio::runtime::Runtime::new()
        .map_err(|e| LabError::Failed(format!("cannot start the runtime: {e}")))?;
    let mut reports = Vec::new();
    for setup in chosen {
        err_line!(
            "outage: {} ({} callers, stall {:?})...",
            setup.name(),
            params.callers,
            params.stall
        );
        let report = rt.block_on(outage::run(setup, params));
        write(
            &out.join(format!("outage-{}.csv", setup.name())),
            &report.csv(),
        )?;
        reports.push(report);
    }
    let table = outage::table(&reports);
    out!("{table}");
    write(&out.join("outage-summary.txt"), &table)?;
    let runs: Vec<(&str, &[outage::Second])> = reports
        .iter()
        .map(|r| (r.setup.name(), r.seconds.as_slice()))
        .collect();
    let svg = lab::plot::outage(&runs)?;
    write(&out.join("outage.svg"), &svg)
}

/// Redraws the plots from whatever CSV files `from` holds.
fn lab_plot(from: &std::path::Path, out: &std::path::Path) -> Result<(), LabError> {
    let mut drawn = 0;
    create_dir(out)?;
    let backoff_csv = from.join("backoff.csv");
    if backoff_csv.exists() {
        let rows = lab::backoff::parse_csv(&read(&backoff_csv)?)
            .map_err(|e| LabError::Failed(format!("{}: {e}", backoff_csv.display())))?;
        let svg = lab::plot::backoff(&rows)?;
        write(&out.join("backoff.svg"), &svg)?;
        drawn += 1;
    }
    let mut runs = Vec::new();
    for setup in outage::Setup::ALL {
        let path = from.join(format!("outage-{}.csv", setup.name()));
        if path.exists() {
            let seconds = outage::parse_csv(&read(&path)?)
                .map_err(|e| LabError::Failed(format!("{}: {e}", path.display())))?;
            runs.push((setup.name(), seconds));
        }
    }
    if !runs.is_empty() {
        let runs: Vec<(&str, &[outage::Second])> =
            runs.iter().map(|(n, s)| (*n, s.as_slice())).collect();
        let svg = lab::plot::outage(&runs)?;
        write(&out.join("outage.svg"), &svg)?;
        drawn += 1;
    }
    if drawn == 0 {
        return Err(LabError::Usage(format!(
            "{} holds neither backoff.csv nor outage-*.csv",
            from.display()
        )));
    }
    Ok(())
}

fn check(path: &std::path::Path, quiet: bool) -> ExitCode {
    match Config::check_file(path) {
        Ok(checked) => {
            if !quiet {
                out!("{}", checked.config.to_toml());
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
    let checked = match (&cli.config, &cli.upstream) {
        (Some(path), _) => Config::check_file(path).map_err(|e| e.to_string()),
        (None, Some(url)) => Config::for_upstream(url, None, None)
            .map(|config| Checked {
                config,
                warnings: Vec::new(),
            })
            .map_err(|e| format!("--upstream: {e}")),
        (None, None) => Err("give --config FILE or --upstream URL (see --help)".to_owned()),
    };
    let Checked {
        mut config,
        warnings,
    } = match checked {
        Ok(c) => c,
        Err(e) => {
            err_line!("herdguard: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(listen) = cli.listen {
        config.listen.address = listen;
    }
    if let Some(admin) = cli.admin {
        config.admin.address = admin;
    }
    telemetry::init(cli.log_format);
    for w in &warnings {
        warn!(warning = %w, "config");
    }

    // The cores this process may use: its CPU affinity and cgroup quota, so a
    // sidecar limited to one core or less counts one.
    let threads = cli.threads.map_or_else(
        || std::thread::available_parallelism().map_or(1, |n| n.get()),
        usize::from,
    );
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
    // Before a trim, each thread hands back the blocks its malloc cache holds.
    #[cfg(all(not(feature = "mimalloc"), target_os = "linux", target_env = "gnu"))]
    rt.on_thread_park(malloc::flush_cache_when_asked);
    let rt = match rt.build() {
        Ok(rt) => rt,
        Err(e) => {
            err_line!("herdguard: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    rt.block_on(serve(config, cli.config))
}

/// Runs until SIGTERM or SIGINT. With a config file, SIGHUP and any change
/// of the file reload it.
async fn serve(config: Config, path: Option<PathBuf>) -> ExitCode {
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
    #[cfg(target_os = "linux")]
    if let Some(files) = raise_open_file_limit() {
        // One descriptor per caller, and room for upstream connections.
        let wanted = (config.listen.max_connections as u64).saturating_add(256);
        if files < wanted {
            warn!(
                open_files = files,
                max_connections = config.listen.max_connections,
                "the open-file limit is below max_connections (and room for upstream connections): callers past it are refused"
            );
        }
    }
    let server = match Server::start(config).await {
        Ok(s) => s,
        Err(e) => {
            error!(error = %e, "cannot start");
            return ExitCode::FAILURE;
        }
    };
    if let Some(path) = &path {
        server.watch(path.clone(), std::time::Duration::from_secs(1));
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
            _ = hup.recv() => match &path {
                Some(path) => {
                    info!(signal = "SIGHUP", path = %path.display(), "reloading");
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
    herdguard::access_log::flush(std::time::Duration::from_secs(2));
    info!("stopped");
    ExitCode::SUCCESS
}
