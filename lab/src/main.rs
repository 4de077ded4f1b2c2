//! `herdguard-lab`: the experiments behind the README's figures, as a
//! command of its own so that the proxy binary carries neither them nor
//! their plotting.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use herdguard_lab::{backoff, outage, plot, train};

// Writing to stdout or stderr never panics: a closed pipe is not a reason to abort.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = write!(std::io::stdout(), $($arg)*);
    }};
}
macro_rules! err_line {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

/// Reproducible experiments on loopback: what herdguard's retry layer does
/// to an upstream in trouble.
#[derive(Debug, Parser)]
#[command(name = "herdguard-lab", version, about, long_about = None)]
enum Lab {
    /// Clients contending on one resource with optimistic concurrency, per
    /// backoff strategy: total calls and completion time (a simulation).
    Backoff {
        /// Client counts to simulate, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "10,25,50,100,150,200", value_parser = herdguard::units::at_least_one::<usize>)]
        clients: Vec<usize>,
        /// Trials per point, averaged.
        #[arg(long, default_value_t = 20, value_parser = herdguard::units::at_least_one::<u64>)]
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
        #[arg(long, default_value_t = 200, value_parser = herdguard::units::at_least_one::<usize>)]
        callers: usize,
        #[arg(long, default_value = "5s", value_parser = herdguard::units::parse_duration)]
        warmup: std::time::Duration,
        /// How long the upstream stalls.
        #[arg(long, default_value = "10s", value_parser = herdguard::units::parse_duration)]
        stall: std::time::Duration,
        /// How long the run goes on after the upstream resumes.
        #[arg(long, default_value = "20s", value_parser = herdguard::units::parse_duration)]
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
    /// A fleet of sidecars in front of one upstream that freezes: 1,000
    /// callers (2 s timeout, fixed 100 ms retries) split over N sidecars with
    /// default policies, per sidecar count.
    Fleet {
        /// Sidecar counts to run, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "1,3,10", value_parser = herdguard::units::at_least_one::<usize>)]
        sidecars: Vec<usize>,
        #[arg(long, default_value_t = 1000, value_parser = herdguard::units::at_least_one::<usize>)]
        callers: usize,
        /// How long the upstream freezes.
        #[arg(long, default_value = "10s", value_parser = herdguard::units::parse_duration)]
        stall: std::time::Duration,
        /// Directory for the CSV files, the summary and the plot.
        #[arg(long, default_value = "lab-results")]
        out: PathBuf,
    },
    /// Runs a herdguard binary in front of a local upstream under a fixed
    /// mix of requests, then stops it with SIGINT: the training run of the
    /// profile-guided release build (deploy/release-build.sh).
    Train {
        /// The herdguard binary to run.
        binary: PathBuf,
        #[arg(long, default_value_t = 60_000, value_parser = herdguard::units::at_least_one::<u64>)]
        requests: u64,
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

fn main() -> ExitCode {
    run_lab(Lab::parse())
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
        Lab::Fleet {
            sidecars,
            callers,
            stall,
            out,
        } => lab_fleet(&sidecars, callers, stall, &out),
        Lab::Train { binary, requests } => lab_train(&binary, requests),
        Lab::Plot { from, out } => lab_plot(&from, out.as_deref().unwrap_or(&from)),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(LabError::Usage(e)) => {
            err_line!("herdguard-lab: {e}");
            ExitCode::from(2)
        }
        Err(LabError::Failed(e)) => {
            err_line!("herdguard-lab: {e}");
            ExitCode::FAILURE
        }
    }
}

enum LabError {
    Usage(String),
    Failed(String),
}

impl From<plot::PlotError> for LabError {
    fn from(e: plot::PlotError) -> Self {
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

fn lab_train(binary: &std::path::Path, requests: u64) -> Result<(), LabError> {
    let params = train::Params {
        requests,
        ..train::Params::default()
    };
    let rt = tokio::runtime::Runtime::new()
        .map_err(|e| LabError::Failed(format!("cannot start the runtime: {e}")))?;
    let summary = rt
        .block_on(train::run(binary, &params))
        .map_err(LabError::Failed)?;
    out!("answered, by status (0: no answer): {summary:?}\n");
    Ok(())
}

fn lab_backoff(
    clients: &[usize],
    trials: u64,
    seed: u64,
    out: &std::path::Path,
) -> Result<(), LabError> {
    let rows = backoff::run(clients, trials.max(1), seed);
    out!("{}", backoff::table(&rows));
    create_dir(out)?;
    let csv = backoff::csv(&rows);
    write(&out.join("backoff.csv"), &csv)?;
    // Drawn from the CSV's rounded values, so that `lab plot` redraws it exactly.
    let rows = backoff::parse_csv(&csv).map_err(LabError::Failed)?;
    let svg = plot::backoff(&rows)?;
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
    let svg = plot::outage(&runs)?;
    write(&out.join("outage.svg"), &svg)
}

fn fleet_name(sidecars: usize) -> String {
    format!("{sidecars} sidecar{}", if sidecars == 1 { "" } else { "s" })
}

fn lab_fleet(
    counts: &[usize],
    callers: usize,
    stall: std::time::Duration,
    out: &std::path::Path,
) -> Result<(), LabError> {
    create_dir(out)?;
    let rt = tokio::runtime::Runtime::new()
        .map_err(|e| LabError::Failed(format!("cannot start the runtime: {e}")))?;
    let mut reports = Vec::new();
    for &n in counts {
        let params = outage::Params {
            callers,
            stall,
            ..outage::Params::fleet(n)
        };
        err_line!(
            "fleet: {} ({callers} callers, freeze {stall:?})...",
            fleet_name(n)
        );
        let report = rt.block_on(outage::run(outage::Setup::Defaults, &params));
        write(&out.join(format!("fleet-{n}.csv")), &report.csv())?;
        reports.push(report);
    }
    let table = outage::fleet_table(&reports);
    out!("{table}");
    write(&out.join("fleet-summary.txt"), &table)?;
    let names: Vec<String> = counts.iter().map(|&n| fleet_name(n)).collect();
    let runs: Vec<(&str, &[outage::Second])> = names
        .iter()
        .zip(&reports)
        .map(|(name, r)| (name.as_str(), r.seconds.as_slice()))
        .collect();
    write(&out.join("fleet.svg"), &plot::outage(&runs)?)
}

/// The fleet runs `from` holds (`fleet-N.csv`), by sidecar count.
fn fleet_runs(from: &std::path::Path) -> Result<Vec<(String, Vec<outage::Second>)>, LabError> {
    let entries = std::fs::read_dir(from)
        .map_err(|e| LabError::Failed(format!("cannot read {}: {e}", from.display())))?;
    let mut counts: Vec<usize> = entries
        .filter_map(|e| {
            let name = e.ok()?.file_name().into_string().ok()?;
            name.strip_prefix("fleet-")?
                .strip_suffix(".csv")?
                .parse()
                .ok()
        })
        .collect();
    counts.sort_unstable();
    counts
        .into_iter()
        .map(|n| {
            let path = from.join(format!("fleet-{n}.csv"));
            let seconds = outage::parse_csv(&read(&path)?)
                .map_err(|e| LabError::Failed(format!("{}: {e}", path.display())))?;
            Ok((fleet_name(n), seconds))
        })
        .collect()
}

/// Redraws the plots from whatever CSV files `from` holds.
fn lab_plot(from: &std::path::Path, out: &std::path::Path) -> Result<(), LabError> {
    let mut drawn = 0;
    create_dir(out)?;
    let backoff_csv = from.join("backoff.csv");
    if backoff_csv.exists() {
        let rows = backoff::parse_csv(&read(&backoff_csv)?)
            .map_err(|e| LabError::Failed(format!("{}: {e}", backoff_csv.display())))?;
        let svg = plot::backoff(&rows)?;
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
        let svg = plot::outage(&runs)?;
        write(&out.join("outage.svg"), &svg)?;
        drawn += 1;
    }
    let fleet = fleet_runs(from)?;
    if !fleet.is_empty() {
        let runs: Vec<(&str, &[outage::Second])> = fleet
            .iter()
            .map(|(n, s)| (n.as_str(), s.as_slice()))
            .collect();
        write(&out.join("fleet.svg"), &plot::outage(&runs)?)?;
        drawn += 1;
    }
    if drawn == 0 {
        return Err(LabError::Usage(format!(
            "{} holds none of backoff.csv, outage-*.csv and fleet-*.csv",
            from.display()
        )));
    }
    Ok(())
}
