//! Latency histograms kept as a count per bucket, rendered in Prometheus's
//! text format beside the exporter's series.
//!
//! The exporter keeps each sample (8 bytes, and the time it came) until an
//! upkeep folds it into its buckets: about 900 instructions a plain GET for
//! its two samples, pushed, timed and folded later. Here a sample is a
//! search of the bounds and two atomic adds where it is recorded, and a
//! histogram's memory is its counts, whatever the request rate.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use metrics_exporter_prometheus::formatting::{sanitize_label_key, sanitize_label_value};

/// One histogram series: a metric's name and its labels.
pub(crate) struct Buckets {
    name: &'static str,
    /// Its labels as the exposition writes them: `route="a",outcome="ok"`.
    labels: String,
    /// Upper bounds, in seconds, ascending (checked by the config).
    bounds: Arc<[f64]>,
    /// Samples at or under each bound and above the one before it; the
    /// last, samples past every bound. Rendered cumulative.
    counts: Box<[AtomicU64]>,
    /// The samples' sum, an `f64`'s bits.
    sum: AtomicU64,
}

impl Buckets {
    pub(crate) fn new(
        name: &'static str,
        labels: &[(&'static str, &str)],
        bounds: Arc<[f64]>,
    ) -> Self {
        let labels = labels
            .iter()
            .map(|(k, v)| format!("{}=\"{}\"", sanitize_label_key(k), sanitize_label_value(v)))
            .collect::<Vec<_>>()
            .join(",");
        let counts = (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect();
        Self {
            name,
            labels,
            bounds,
            counts,
            sum: AtomicU64::new(0f64.to_bits()),
        }
    }

    /// This series is `name` with `labels` (as [`Buckets::new`] took them).
    pub(crate) fn is(&self, name: &str, labels: &str) -> bool {
        self.name == name && self.labels == labels
    }

    pub(crate) fn labels(&self) -> &str {
        &self.labels
    }

    /// Appends the series: `# TYPE`, each bucket with the samples at or
    /// under its bound, `+Inf`, the sum and the count.
    pub(crate) fn render(&self, out: &mut String) {
        let (name, labels) = (self.name, self.labels.as_str());
        let comma = if labels.is_empty() { "" } else { "," };
        let _ = writeln!(out, "# TYPE {name} histogram");
        let mut seen = 0u64;
        for (bound, count) in self.bounds.iter().zip(self.counts.iter()) {
            seen = seen.saturating_add(count.load(Ordering::Relaxed));
            let _ = writeln!(out, "{name}_bucket{{{labels}{comma}le=\"{bound}\"}} {seen}");
        }
        if let Some(past) = self.counts.last() {
            seen = seen.saturating_add(past.load(Ordering::Relaxed));
        }
        let _ = writeln!(out, "{name}_bucket{{{labels}{comma}le=\"+Inf\"}} {seen}");
        let sum = f64::from_bits(self.sum.load(Ordering::Relaxed));
        let braced = |labels: &str| match labels.is_empty() {
            true => String::new(),
            false => format!("{{{labels}}}"),
        };
        let _ = writeln!(out, "{name}_sum{} {sum}", braced(labels));
        let _ = writeln!(out, "{name}_count{} {seen}", braced(labels));
    }
}

impl metrics::HistogramFn for Buckets {
    /// Counts `value` in the first bucket whose bound it does not pass,
    /// looked for from the smallest: most latencies fall in the first few. A
    /// value that is not a number is not counted: it would make the sum one
    /// for good.
    fn record(&self, value: f64) {
        if value.is_nan() {
            return;
        }
        let at = self
            .bounds
            .iter()
            .take_while(|bound| **bound < value)
            .count();
        if let Some(count) = self.counts.get(at) {
            count.fetch_add(1, Ordering::Relaxed);
        }
        let _ = self
            .sum
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                Some((f64::from_bits(bits) + value).to_bits())
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use metrics::HistogramFn as _;

    fn rendered(b: &Buckets) -> String {
        let mut out = String::new();
        b.render(&mut out);
        out
    }

    #[test]
    fn a_sample_on_a_bound_counts_in_that_bucket_and_buckets_render_cumulative() {
        let b = Buckets::new("h", &[("route", "a\"b")], Arc::from([0.5, 1.0, 2.5]));
        for v in [0.125, 0.5, 0.75, 1.0, 1.0, 3.0] {
            b.record(v);
        }
        b.record(f64::NAN);
        assert_eq!(
            rendered(&b),
            "# TYPE h histogram\n\
             h_bucket{route=\"a\\\"b\",le=\"0.5\"} 2\n\
             h_bucket{route=\"a\\\"b\",le=\"1\"} 5\n\
             h_bucket{route=\"a\\\"b\",le=\"2.5\"} 5\n\
             h_bucket{route=\"a\\\"b\",le=\"+Inf\"} 6\n\
             h_sum{route=\"a\\\"b\"} 6.375\n\
             h_count{route=\"a\\\"b\"} 6\n"
        );
    }

    #[test]
    fn a_series_without_labels_renders_without_braces() {
        let b = Buckets::new("h", &[], Arc::from([1.0]));
        b.record(2.0);
        let text = rendered(&b);
        assert!(text.contains("h_bucket{le=\"1\"} 0\n"), "{text}");
        assert!(text.contains("h_sum 2\nh_count 1\n"), "{text}");
    }

    #[test]
    fn samples_recorded_at_once_on_several_threads_are_each_counted() {
        let b = Arc::new(Buckets::new("h", &[], Arc::from([0.001, 1.0])));
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let b = b.clone();
                std::thread::spawn(move || {
                    for i in 0..10_000u32 {
                        b.record(if (i + t) % 2 == 0 { 0.5 } else { 0.25 });
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let text = rendered(&b);
        assert!(text.contains("h_bucket{le=\"1\"} 40000\n"), "{text}");
        // Halves and quarters add up exactly in binary.
        assert!(text.contains("h_sum 15000\n"), "{text}");
    }
}
