//! `herdguard-lab plot`, and the plots the other lab commands write: drawn
//! from the data alone, so the committed plots must be what the committed
//! CSV files give.

use std::path::Path;
use std::process::Command;

use herdguard_lab::backoff::{self, Strategy};
use herdguard_lab::{outage, plot};

fn lab() -> Command {
    Command::new(env!("CARGO_BIN_EXE_herdguard-lab"))
}

/// (stroke colour, number of points) of each polyline with more than two
/// points: the data lines, not the legend's samples or the axes.
fn data_lines(svg: &str) -> Vec<(String, usize)> {
    svg.lines()
        .filter(|l| l.starts_with("<polyline"))
        .filter_map(|l| {
            let stroke = l.split("stroke=\"").nth(1)?.split('"').next()?;
            let points = l.split("points=\"").nth(1)?.split('"').next()?;
            let n = points.split_whitespace().count();
            (n > 2).then(|| (stroke.to_owned(), n))
        })
        .collect()
}

fn legend_has(svg: &str, label: &str) -> bool {
    svg.contains(&format!("\n{label}\n</text>"))
}

fn docs_lab() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/lab"))
}

#[test]
fn committed_plots_are_what_the_committed_data_gives() {
    let out = tempfile::tempdir().unwrap();
    let status = lab()
        .args(["plot", "--from"])
        .arg(docs_lab())
        .arg("--out")
        .arg(out.path())
        .status()
        .unwrap();
    assert!(status.success());
    for name in ["backoff.svg", "outage.svg", "fleet.svg"] {
        let drawn = std::fs::read_to_string(out.path().join(name)).unwrap();
        let committed = std::fs::read_to_string(docs_lab().join(name)).unwrap();
        assert!(
            drawn == committed,
            "docs/lab/{name} is stale: run `cargo run -p herdguard-lab -- plot --from docs/lab`"
        );
    }
}

#[test]
fn the_outage_plot_has_a_line_and_a_legend_entry_per_setup_and_shades_the_stall() {
    let mut runs = Vec::new();
    for setup in outage::Setup::ALL {
        let path = docs_lab().join(format!("outage-{}.csv", setup.name()));
        let seconds = outage::parse_csv(&std::fs::read_to_string(path).unwrap()).unwrap();
        runs.push((setup.name(), seconds));
    }
    let runs: Vec<(&str, &[outage::Second])> =
        runs.iter().map(|(n, s)| (*n, s.as_slice())).collect();
    let svg = plot::outage(&runs).unwrap();
    assert!(svg.starts_with("<svg"), "{}", &svg[..80]);
    // Two panels, one line per setup in each, a point per second, each
    // setup in its own colour.
    let lines = data_lines(&svg);
    assert_eq!(lines.len(), 2 * runs.len(), "{lines:?}");
    for (i, (name, seconds)) in runs.iter().enumerate() {
        assert_eq!(lines[i].1, seconds.len(), "{name}");
        assert_eq!(lines[i], lines[runs.len() + i], "{name}");
        assert!(legend_has(&svg, name), "no legend for {name}");
    }
    let mut colours: Vec<&String> = lines.iter().map(|(c, _)| c).collect();
    colours.dedup();
    colours.sort();
    colours.dedup();
    assert_eq!(colours.len(), runs.len());
    assert!(legend_has(&svg, "upstream stalled"));
}

#[test]
fn the_backoff_plot_has_two_lines_per_strategy() {
    let rows = backoff::run(&[10, 20, 40], 2, 1);
    let svg = plot::backoff(&rows).unwrap();
    let lines = data_lines(&svg);
    assert_eq!(lines.len(), 2 * Strategy::ALL.len(), "{lines:?}");
    // A point per client count.
    assert!(lines.iter().all(|(_, n)| *n == 3), "{lines:?}");
    for s in Strategy::ALL {
        assert!(legend_has(&svg, s.name()), "{}", s.name());
    }
}

#[test]
fn csv_files_read_back_as_written() {
    let rows = backoff::run(&[10, 30], 2, 9);
    let csv = backoff::csv(&rows);
    assert_eq!(backoff::csv(&backoff::parse_csv(&csv).unwrap()), csv);

    let text = std::fs::read_to_string(docs_lab().join("outage-direct.csv")).unwrap();
    let seconds = outage::parse_csv(&text).unwrap();
    assert!(seconds.iter().any(|s| s.stalled));
    assert_eq!(seconds.len() + 1, text.lines().count());

    // The fleet's files carry the upstream's attempts as a seventh column.
    let text = std::fs::read_to_string(docs_lab().join("fleet-10.csv")).unwrap();
    let seconds = outage::parse_csv(&text).unwrap();
    assert!(seconds.iter().any(|s| s.stalled));
    assert!(seconds.iter().any(|s| s.upstream_attempts > 0));
    let report = outage::Report::from_seconds(
        outage::Setup::Defaults,
        seconds.clone(),
        &outage::Params::fleet(10),
    );
    assert_eq!(report.csv(), text);
}

#[test]
fn a_broken_csv_file_names_its_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("backoff.csv"),
        "strategy,clients,work,time_ms\nfull-jitter,10,41.8,445.7\nfull-jitter,ten,1,1\n",
    )
    .unwrap();
    let out = lab()
        .args(["plot", "--from"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("backoff.csv: line 3: clients is not a count"),
        "{stderr}"
    );
    assert!(!dir.path().join("backoff.svg").exists());

    let empty = tempfile::tempdir().unwrap();
    let out = lab()
        .args(["plot", "--from"])
        .arg(empty.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("holds none of"));
}

#[test]
fn lab_backoff_writes_its_table_csv_and_plot() {
    let dir = tempfile::tempdir().unwrap();
    let out = lab()
        .args(["backoff", "--clients", "5,10", "--trials", "2", "--out"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("full-jitter"));
    let csv = std::fs::read_to_string(dir.path().join("backoff.csv")).unwrap();
    assert_eq!(csv.lines().count(), 1 + 2 * Strategy::ALL.len());
    let svg = std::fs::read_to_string(dir.path().join("backoff.svg")).unwrap();
    assert_eq!(
        svg,
        plot::backoff(&backoff::parse_csv(&csv).unwrap()).unwrap()
    );
}

#[test]
fn counts_of_zero_are_usage_errors() {
    for args in [
        &["outage", "--callers", "0"][..],
        &["backoff", "--clients", "10,0"],
        &["backoff", "--trials", "0"],
        &["fleet", "--sidecars", "3,0"],
        &["fleet", "--callers", "0"],
    ] {
        let out = lab().args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains("must be at least 1"), "{args:?}: {err}");
    }
}
