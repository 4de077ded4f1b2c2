//! SVG plots of the lab's results, drawn with plotters. The output depends on
//! the data alone, so plots regenerated from the committed CSV files are
//! byte-for-byte the committed plots.

use plotters::coord::Shift;
use plotters::prelude::*;

use crate::backoff::{Row, Strategy};
use crate::outage::Second;

#[derive(Debug, thiserror::Error)]
#[error("cannot draw the plot: {0}")]
pub struct PlotError(String);

fn drawing(e: impl std::fmt::Display) -> PlotError {
    PlotError(e.to_string())
}

/// One line per setup, in a fixed order of colours.
const PALETTE: [RGBColor; 5] = [
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0x94, 0x67, 0xbd),
];

const FONT: &str = "sans-serif";

/// Upstream concurrency (log scale) and goodput over time, one line per run,
/// the stall shaded. `runs` pairs a setup's name with its seconds.
pub fn outage(runs: &[(&str, &[Second])]) -> Result<String, PlotError> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (960, 720)).into_drawing_area();
        root.fill(&WHITE).map_err(drawing)?;
        let (top, bottom) = root.split_vertically(360);
        let seconds = runs
            .iter()
            .flat_map(|(_, s)| s.iter().map(|s| s.t))
            .max()
            .unwrap_or(1);
        let stall = stall_span(runs);
        let peak = runs
            .iter()
            .flat_map(|(_, s)| s.iter().map(|s| s.upstream_peak))
            .max()
            .unwrap_or(1)
            .max(10) as f64;
        let y_top = peak * 2.0;
        outage_panel(
            &top,
            runs,
            OutagePanel {
                caption:
                    "Requests in flight at the upstream (peak each second, log scale, 0 drawn as 1)",
                y_desc: "in flight",
                seconds,
                stall,
                log_y: Some(y_top),
                y_max: y_top,
                legend: None,
                value: |s| s.upstream_peak.max(1) as f64,
            },
        )?;
        let goodput = runs
            .iter()
            .flat_map(|(_, s)| s.iter().map(|s| s.goodput))
            .max()
            .unwrap_or(1)
            .max(1) as f64;
        outage_panel(
            &bottom,
            runs,
            OutagePanel {
                caption: "Goodput: successful answers to callers per second",
                y_desc: "answers/s",
                seconds,
                stall,
                log_y: None,
                y_max: (goodput * 1.15).ceil(),
                legend: Some(SeriesLabelPosition::MiddleRight),
                value: |s| s.goodput as f64,
            },
        )?;
        root.present().map_err(drawing)?;
    }
    Ok(svg)
}

struct OutagePanel {
    caption: &'static str,
    y_desc: &'static str,
    seconds: u32,
    stall: Option<(u32, u32)>,
    /// Log scale from 1 to this value.
    log_y: Option<f64>,
    y_max: f64,
    /// Where the legend goes; both panels share colours, so one suffices.
    legend: Option<SeriesLabelPosition>,
    value: fn(&Second) -> f64,
}

/// The first and last second the upstream was stalled, in any run.
fn stall_span(runs: &[(&str, &[Second])]) -> Option<(u32, u32)> {
    let stalled = runs
        .iter()
        .flat_map(|(_, s)| s.iter().filter(|s| s.stalled).map(|s| s.t));
    let (mut first, mut last) = (None::<u32>, None::<u32>);
    for t in stalled {
        first = Some(first.map_or(t, |f| f.min(t)));
        last = Some(last.map_or(t, |l| l.max(t)));
    }
    // A second is plotted at its end: the stall covers (first - 1, last].
    Some((first?.saturating_sub(1), last?))
}

fn outage_panel(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    runs: &[(&str, &[Second])],
    p: OutagePanel,
) -> Result<(), PlotError> {
    let mut builder = ChartBuilder::on(area);
    builder
        .caption(p.caption, (FONT, 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(64);
    let x = 0u32..p.seconds;
    // The two scales give the chart different types: one body, two calls.
    macro_rules! draw {
        ($chart:expr, $y_min:expr) => {{
            let mut chart = $chart;
            chart
                .configure_mesh()
                .x_desc("seconds")
                .y_desc(p.y_desc)
                .y_label_formatter(&|v| format!("{v:.0}"))
                .light_line_style(WHITE)
                .draw()
                .map_err(drawing)?;
            if let Some((from, to)) = p.stall {
                chart
                    .draw_series(std::iter::once(Rectangle::new(
                        [(from, $y_min), (to, p.y_max)],
                        BLACK.mix(0.08).filled(),
                    )))
                    .map_err(drawing)?
                    .label("upstream stalled")
                    .legend(|(x, y)| {
                        Rectangle::new([(x, y - 5), (x + 18, y + 5)], BLACK.mix(0.08).filled())
                    });
            }
            for (i, (name, seconds)) in runs.iter().enumerate() {
                let color = PALETTE[i % PALETTE.len()];
                // The first line is drawn wide, so that a run which follows
                // it exactly (a proxy that only passes a storm on) still
                // shows both.
                let width = if i == 0 { 6 } else { 2 };
                chart
                    .draw_series(LineSeries::new(
                        seconds.iter().map(|s| (s.t, (p.value)(s))),
                        color.stroke_width(width),
                    ))
                    .map_err(drawing)?
                    .label(*name)
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(width))
                    });
            }
            if let Some(position) = p.legend {
                chart
                    .configure_series_labels()
                    .position(position)
                    .background_style(WHITE.mix(0.85))
                    .border_style(BLACK.mix(0.3))
                    .label_font((FONT, 13))
                    .draw()
                    .map_err(drawing)?;
            }
        }};
    }
    match p.log_y {
        Some(top) => draw!(
            builder
                .build_cartesian_2d(x, (1f64..top).log_scale())
                .map_err(drawing)?,
            1f64
        ),
        None => draw!(
            builder
                .build_cartesian_2d(x, 0f64..p.y_max)
                .map_err(drawing)?,
            0f64
        ),
    }
    Ok(())
}

/// Work (calls) and completion time (log scale) against clients, one line per
/// strategy.
pub fn backoff(rows: &[Row]) -> Result<String, PlotError> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (1100, 460)).into_drawing_area();
        root.fill(&WHITE).map_err(drawing)?;
        let (left, right) = root.split_horizontally(550);
        let clients = rows.iter().map(|r| r.clients).max().unwrap_or(1).max(1);
        let strategies: Vec<Strategy> = Strategy::ALL
            .into_iter()
            .filter(|s| rows.iter().any(|r| r.strategy == *s))
            .collect();
        let line = |s: Strategy, value: fn(&Row) -> f64| -> Vec<(usize, f64)> {
            rows.iter()
                .filter(|r| r.strategy == s)
                .map(|r| (r.clients, value(r)))
                .collect()
        };

        let work_max = rows.iter().map(|r| r.work).fold(1.0, f64::max) * 1.1;
        let mut work = ChartBuilder::on(&left)
            .caption("Work: calls until every client succeeded", (FONT, 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(64)
            .build_cartesian_2d(0..clients, 0f64..work_max)
            .map_err(drawing)?;
        work.configure_mesh()
            .x_desc("clients")
            .y_desc("calls")
            .y_label_formatter(&|v| format!("{v:.0}"))
            .light_line_style(WHITE)
            .draw()
            .map_err(drawing)?;
        for (i, s) in strategies.iter().enumerate() {
            let color = PALETTE[i % PALETTE.len()];
            work.draw_series(LineSeries::new(line(*s, |r| r.work), color.stroke_width(2)))
                .map_err(drawing)?
                .label(s.name())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                });
        }
        work.configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.3))
            .label_font((FONT, 13))
            .draw()
            .map_err(drawing)?;

        let time_max = rows.iter().map(|r| r.time_ms).fold(10.0, f64::max);
        let time_top = time_max * 2.0;
        let time_min = rows
            .iter()
            .map(|r| r.time_ms)
            .fold(f64::INFINITY, f64::min)
            .max(1.0);
        let time_bottom = time_min / 2.0;
        let mut time = ChartBuilder::on(&right)
            .caption(
                "Time until the last client succeeded (log scale)",
                (FONT, 18),
            )
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(64)
            .build_cartesian_2d(0..clients, (time_bottom..time_top).log_scale())
            .map_err(drawing)?;
        time.configure_mesh()
            .x_desc("clients")
            .y_desc("time")
            .y_label_formatter(&|ms| {
                if *ms >= 1000.0 {
                    format!("{} s", ms / 1000.0)
                } else {
                    format!("{ms} ms")
                }
            })
            .light_line_style(WHITE)
            .draw()
            .map_err(drawing)?;
        for (i, s) in strategies.iter().enumerate() {
            let color = PALETTE[i % PALETTE.len()];
            time.draw_series(LineSeries::new(
                line(*s, |r| r.time_ms),
                color.stroke_width(2),
            ))
            .map_err(drawing)?;
        }
        root.present().map_err(drawing)?;
    }
    Ok(svg)
}
