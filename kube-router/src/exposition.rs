//! The Prometheus text format's building blocks: a family's HELP and TYPE lines, and a histogram
//! of durations. A leaf module: the FIB task, the controllers and every renderer use it.
use std::fmt::Write as _;

/// Upper bounds (seconds) of the sync-duration histogram buckets.
pub const SYNC_BUCKETS: [f64; 10] = [0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0];

#[derive(Clone, Default, Debug, PartialEq)]
pub struct Histogram {
    pub(crate) counts: [u64; SYNC_BUCKETS.len()],
    pub(crate) count: u64,
    pub(crate) sum: f64,
}

/// Observations are durations, never NaN: equality is total.
impl Eq for Histogram {}

impl Histogram {
    pub fn observe(&mut self, value: f64) {
        for (bucket, bound) in self.counts.iter_mut().zip(SYNC_BUCKETS) {
            if value <= bound {
                *bucket += 1;
            }
        }
        self.count += 1;
        self.sum += value;
    }

    /// The `_bucket`, `_sum` and `_count` samples of family `name`.
    pub fn write_samples(&self, out: &mut String, name: &str) {
        for (bound, n) in SYNC_BUCKETS.iter().zip(self.counts) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {n}");
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}",
            self.count, self.sum, self.count
        );
    }
}

/// The HELP and TYPE lines that open a metric family.
pub fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// Families of one unlabelled sample each: (name, type, help, value).
pub fn single_samples(out: &mut String, families: &[(&str, &str, &str, u64)]) {
    for (name, kind, help, value) in families {
        family(out, name, kind, help);
        let _ = writeln!(out, "{name} {value}");
    }
}
