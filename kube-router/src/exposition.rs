//! What the subsystems register their metrics with: `prometheus-client`'s registry and encoder,
//! plus what the crate does not have: a family under its exact exported name and help
//! ([`register`]), upstream kube-router's counters without `_total` ([`UPSTREAM_COUNTER`]), a
//! gauge absent until first set, an age computed at scrape time, and a histogram kept as plain
//! data (the FIB task's, copied into status snapshots). A leaf module.
use std::{
    fmt::{self, Debug},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::{SystemTime, UNIX_EPOCH},
};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric, MetricEncoder, NoLabelSet},
    metrics::{counter::ConstCounter, gauge::Gauge, MetricType},
    registry::Registry,
};

pub use prometheus_client::metrics::{counter::Counter, family::Family, gauge::Gauge as IntGauge};

/// Upper bounds (seconds) of the sync-duration histogram buckets.
pub const SYNC_BUCKETS: [f64; 10] = [0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0];

/// A gauge of seconds (or any fraction).
pub type FloatGauge = Gauge<f64, AtomicU64>;

/// A duration histogram over [`SYNC_BUCKETS`], recorded into by a controller.
pub fn sync_histogram() -> prometheus_client::metrics::histogram::Histogram {
    prometheus_client::metrics::histogram::Histogram::new(SYNC_BUCKETS)
}

pub fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs_f64()
}

/// The metric type to describe upstream kube-router's counters with. Their names have no
/// `_total` (`kube_router_service_total_connections`, `..._bgp_advertisements_sent`), and the
/// crate's text encoder appends `_total` to every counter: they are encoded as untyped, and
/// [`restore_upstream_counter_types`] turns their TYPE line back to `counter` (the agent has
/// no untyped family of its own).
pub const UPSTREAM_COUNTER: MetricType = MetricType::Unknown;

/// Rewrites every `# TYPE <name> untyped` line of `text` to `counter`, in place.
pub fn restore_upstream_counter_types(text: &mut String) {
    const UNTYPED: &str = " untyped\n";
    let found: Vec<usize> = text
        .match_indices(UNTYPED)
        .map(|(at, _)| at)
        .filter(|at| text[..*at].rsplit('\n').next().is_some_and(|line| line.starts_with("# TYPE ")))
        .collect();
    for at in found {
        // Same length: no byte after it moves.
        text.replace_range(at..at + UNTYPED.len(), " counter\n");
    }
}

/// `metric` under the exported `name` and `help` exactly as given: `Registry::register` would
/// end the help with a period of its own. Counters' names end in `_total` here, as exported; the
/// encoder appends that suffix itself. Listed even without a series yet (a family nothing was
/// recorded in), as the agent always has: the crate's registry would leave it out.
pub fn register(registry: &mut Registry, name: &'static str, help: &'static str, metric: impl Exportable) {
    let name = exported_stem(name, metric.metric_type());
    registry.register_collector(Box::new(Exported { name, help, metric, hidden_while_empty: false }));
}

/// As [`register`], but left out while [`EncodeMetric::is_empty`] (an [`OptionalGauge`] not
/// set yet).
pub fn register_optional(registry: &mut Registry, name: &'static str, help: &'static str, metric: impl Exportable) {
    let name = exported_stem(name, metric.metric_type());
    registry.register_collector(Box::new(Exported { name, help, metric, hidden_while_empty: true }));
}

/// What [`register`] takes: any of the crate's metrics, or this module's.
pub trait Exportable: EncodeMetric + Debug + Send + Sync + 'static {}
impl<T: EncodeMetric + Debug + Send + Sync + 'static> Exportable for T {}

#[derive(Debug)]
struct Exported<M> {
    name: &'static str,
    help: &'static str,
    metric: M,
    hidden_while_empty: bool,
}

impl<M: Exportable> Collector for Exported<M> {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        if self.hidden_while_empty && self.metric.is_empty() {
            return Ok(());
        }
        let metric = encoder.encode_descriptor(self.name, self.help, None, self.metric.metric_type())?;
        self.metric.encode(metric)
    }
}

/// For collectors: one family of one series. `name` as exported (a counter's `_total` is
/// stripped for the encoder, which appends it).
pub fn single(encoder: &mut DescriptorEncoder, name: &str, help: &str, metric: &impl EncodeMetric) -> fmt::Result {
    let metric_type = metric.metric_type();
    metric.encode(encoder.encode_descriptor(exported_stem(name, metric_type), help, None, metric_type)?)
}

/// The name to give the encoder: a counter's without the `_total` it appends.
fn exported_stem(name: &str, metric_type: MetricType) -> &str {
    match metric_type {
        MetricType::Counter => name.strip_suffix("_total").unwrap_or(name),
        _ => name,
    }
}

/// For collectors: a family of `metric_type` with one series per labels and value (`None`:
/// no labels).
pub fn series<L: EncodeLabelSet, M: EncodeMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    metric_type: MetricType,
    series: impl IntoIterator<Item = (Option<L>, M)>,
) -> fmt::Result {
    let mut family = encoder.encode_descriptor(exported_stem(name, metric_type), help, None, metric_type)?;
    for (labels, metric) in series {
        match &labels {
            Some(labels) => metric.encode(family.encode_family(labels)?)?,
            None => metric.encode(family.encode_family(&NoLabels)?)?,
        }
    }
    Ok(())
}

/// For collectors: counters by one label (`event="redirected"`), in the order given.
pub fn counters_by(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    label: &'static str,
    values: &[(&'static str, u64)],
) -> fmt::Result {
    let series_of = values.iter().map(|(value, n)| (Some([(label, *value)]), ConstCounter::new(*n)));
    series(encoder, name, help, MetricType::Counter, series_of)
}

/// A label set by reference (the crate encodes owned ones), so that a set shared by several
/// families is not copied for each.
pub struct ByRef<'a, L>(pub &'a L);

impl<L: EncodeLabelSet> EncodeLabelSet for ByRef<'_, L> {
    fn encode(&self, encoder: &mut prometheus_client::encoding::LabelSetEncoder) -> fmt::Result {
        self.0.encode(encoder)
    }
}

/// No labels: a family's series that has none (an empty label set encodes to nothing).
struct NoLabels;

impl EncodeLabelSet for NoLabels {
    fn encode(&self, _: &mut prometheus_client::encoding::LabelSetEncoder) -> fmt::Result {
        Ok(())
    }
}

/// A series of one value in a collector (`ConstGauge` / `ConstCounter` take owned values; this
/// one any of either kind).
#[derive(Debug, Clone, Copy)]
pub enum Value {
    Gauge(f64),
    IntGauge(i64),
    Counter(u64),
    /// A counter of seconds (`process_cpu_seconds_total`).
    FloatCounter(f64),
}

impl EncodeMetric for Value {
    fn encode(&self, mut encoder: MetricEncoder) -> fmt::Result {
        match *self {
            Value::Gauge(v) => encoder.encode_gauge(&v),
            Value::IntGauge(v) => encoder.encode_gauge(&v),
            Value::Counter(v) => encoder.encode_counter::<NoLabelSet, _, u64>(&v, None),
            Value::FloatCounter(v) => encoder.encode_counter::<NoLabelSet, _, f64>(&v, None),
        }
    }

    fn metric_type(&self) -> MetricType {
        match self {
            Value::Gauge(_) | Value::IntGauge(_) => MetricType::Gauge,
            Value::Counter(_) | Value::FloatCounter(_) => MetricType::Counter,
        }
    }
}

/// A gauge left out until it is first set (the last checkpoint write's duration).
#[derive(Debug, Clone, Default)]
pub struct OptionalGauge {
    value: FloatGauge,
    set: Arc<AtomicBool>,
}

impl OptionalGauge {
    pub fn set(&self, value: f64) {
        self.value.set(value);
        self.set.store(true, Ordering::Release);
    }

    pub fn get(&self) -> Option<f64> {
        self.set.load(Ordering::Acquire).then(|| self.value.get())
    }
}

impl EncodeMetric for OptionalGauge {
    fn encode(&self, encoder: MetricEncoder) -> fmt::Result {
        self.value.encode(encoder)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Gauge
    }

    fn is_empty(&self) -> bool {
        !self.set.load(Ordering::Acquire)
    }
}

/// Seconds since the Unix time a [`OptionalGauge`] holds, at scrape time; -1 before it was set.
#[derive(Debug, Clone)]
pub struct SecondsSince(pub OptionalGauge);

impl EncodeMetric for SecondsSince {
    fn encode(&self, mut encoder: MetricEncoder) -> fmt::Result {
        let since = self.0.get().map(|t| unix_now() - t).unwrap_or(-1.0);
        encoder.encode_gauge(&since)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Gauge
    }
}

/// A Unix time as a gauge: 0 before it was set.
#[derive(Debug, Clone)]
pub struct Timestamp(pub OptionalGauge);

impl EncodeMetric for Timestamp {
    fn encode(&self, mut encoder: MetricEncoder) -> fmt::Result {
        encoder.encode_gauge(&self.0.get().unwrap_or(0.0))
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Gauge
    }
}

/// A duration histogram over [`SYNC_BUCKETS`] as plain data: the FIB task's, copied into every
/// status snapshot and compared in tests.
#[derive(Clone, Default, Debug, PartialEq)]
pub struct Histogram {
    /// Observations at or below each bound.
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
}

impl EncodeMetric for Histogram {
    fn encode(&self, mut encoder: MetricEncoder) -> fmt::Result {
        // The encoder takes each bucket's own observations and accumulates them.
        let mut below = 0;
        let buckets: Vec<(f64, u64)> = SYNC_BUCKETS
            .iter()
            .zip(self.counts)
            .map(|(bound, at_or_below)| {
                let own = at_or_below - below;
                below = at_or_below;
                (*bound, own)
            })
            .collect();
        encoder.encode_histogram::<NoLabelSet>(self.sum, self.count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// The registry's text, as Prometheus scrapes it (text format 0.0.4).
pub fn encode(registry: &Registry) -> String {
    encode_all(&[registry])
}

/// The registries' texts one after the other, whole.
pub fn encode_all(registries: &[&Registry]) -> String {
    let mut text = String::new();
    // Appending to a String cannot fail; a collector's error ends the text where it was.
    let _ = encode_chunks(registries, usize::MAX, |chunk| {
        text.push_str(&chunk);
        Ok(())
    });
    text
}

/// Bytes of text a scrape hands to its connection at a time ([`encode_chunks`]).
pub const CHUNK: usize = 64 * 1024;

/// The registries' texts, in pieces of whole lines of about `chunk` bytes (the last may be
/// shorter), each given to `sink` as soon as it is complete: a 10,000-Service page is some
/// 60 MiB, which a scrape then never holds at once. An error of `sink` (the client went away)
/// or of a collector ends the encoding there.
pub fn encode_chunks(registries: &[&Registry], chunk: usize, sink: impl FnMut(String) -> fmt::Result) -> fmt::Result {
    let mut lines = LineChunks { pending: String::new(), chunk, sink };
    for registry in registries {
        prometheus_client::encoding::prometheus_text::encode(&mut lines, registry)?;
    }
    lines.finish()
}

/// A `fmt::Write` that hands on whole lines once `chunk` bytes are pending, each piece with
/// its upstream counters' TYPE lines restored: a piece of whole lines holds each TYPE line
/// entire, so the rewrite sees what it would see in the whole text.
struct LineChunks<F> {
    pending: String,
    chunk: usize,
    sink: F,
}

impl<F: FnMut(String) -> fmt::Result> LineChunks<F> {
    fn finish(mut self) -> fmt::Result {
        if self.pending.is_empty() {
            return Ok(());
        }
        let mut last = std::mem::take(&mut self.pending);
        restore_upstream_counter_types(&mut last);
        (self.sink)(last)
    }
}

impl<F: FnMut(String) -> fmt::Result> fmt::Write for LineChunks<F> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        self.pending.push_str(s);
        if self.pending.len() < self.chunk {
            return Ok(());
        }
        let Some(end) = self.pending.rfind('\n') else { return Ok(()) };
        let rest = self.pending.split_off(end + 1);
        let mut ready = std::mem::replace(&mut self.pending, String::with_capacity(self.chunk + rest.len()));
        self.pending.push_str(&rest);
        restore_upstream_counter_types(&mut ready);
        (self.sink)(ready)
    }
}

pub use prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// A collector of what `encode` writes on every scrape.
pub struct FnCollector<F>(pub F);

impl<F> Debug for FnCollector<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FnCollector")
    }
}

impl<F: Fn(&mut DescriptorEncoder) -> fmt::Result + Send + Sync + 'static> Collector for FnCollector<F> {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        (self.0)(&mut encoder)
    }
}

/// The text of the families `encode` writes (for tests).
pub fn encode_with(encode: impl Fn(&mut DescriptorEncoder) -> fmt::Result + Send + Sync + 'static) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(FnCollector(encode)));
    self::encode(&registry)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_counters_keep_their_name_and_are_typed_counter() {
        #[derive(Debug)]
        struct Upstream;
        impl Collector for Upstream {
            fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
                series(
                    &mut encoder,
                    "kube_router_host_routes_added",
                    "Total count of host routes added to the system",
                    UPSTREAM_COUNTER,
                    [(None::<NoLabelSet>, ConstCounter::new(3u64))],
                )
            }
        }
        let mut registry = Registry::default();
        registry.register_collector(Box::new(Upstream));
        let counter = Counter::<u64>::default();
        counter.inc();
        register(&mut registry, "kube_router_api_errors_total", "Failed API requests.", counter);
        assert_eq!(
            encode(&registry),
            "# HELP kube_router_host_routes_added Total count of host routes added to the system\n\
             # TYPE kube_router_host_routes_added counter\n\
             kube_router_host_routes_added 3\n\
             # HELP kube_router_api_errors_total Failed API requests.\n\
             # TYPE kube_router_api_errors_total counter\n\
             kube_router_api_errors_total 1\n"
        );
    }

    /// A family nothing was recorded in yet is listed (HELP and TYPE), as the agent always did
    /// (`hostile_robust` looks for the HTTP servers' refusals before any).
    #[test]
    fn a_family_without_series_is_listed() {
        let mut registry = Registry::default();
        register(&mut registry, "t_refused_total", "T.", Family::<[(&str, &str); 1], Counter>::default());
        assert_eq!(encode(&registry), "# HELP t_refused_total T.\n# TYPE t_refused_total counter\n");
    }

    #[test]
    fn a_plain_histogram_encodes_cumulative_buckets() {
        let mut h = Histogram::default();
        h.observe(0.003);
        h.observe(2.0);
        let mut registry = Registry::default();
        register(&mut registry, "t_seconds", "T.", h);
        let text = encode(&registry);
        assert!(text.contains("t_seconds_bucket{le=\"0.001\"} 0\nt_seconds_bucket{le=\"0.005\"} 1\n"), "{text}");
        assert!(text.contains("t_seconds_bucket{le=\"5\"} 2\n"), "{text}");
        assert!(text.contains("t_seconds_bucket{le=\"+Inf\"} 2\nt_seconds_sum 2.003\nt_seconds_count 2\n"), "{text}");
    }

    #[test]
    fn an_optional_gauge_is_absent_until_set_and_ages_count_from_it() {
        let (gauge, mut registry) = (OptionalGauge::default(), Registry::default());
        register_optional(&mut registry, "t_write_seconds", "T.", gauge.clone());
        register(&mut registry, "t_since", "T.", SecondsSince(gauge.clone()));
        let before = encode(&registry);
        assert!(!before.contains("t_write_seconds") && before.contains("t_since -1"), "{before}");
        gauge.set(unix_now() - 10.0);
        let after = encode(&registry);
        assert!(after.contains("\nt_write_seconds 1"), "{after}");
        let since: f64 = after.lines().find_map(|l| l.strip_prefix("t_since ")).unwrap().parse().unwrap();
        assert!((10.0..20.0).contains(&since), "{after}");
    }
}
