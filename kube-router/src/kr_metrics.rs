//! kube-router's own metric names, so its Grafana dashboard and alerts work unchanged: build
//! info, per-Service counters (from `svc_stats_v4` / `_v6`, kube-router reads them from IPVS), controller
//! sync times and BGP peers. Our own `kube_router_*` names stay beside them (see docs/metrics.md,
//! "Metrics").
use std::{
    collections::BTreeMap,
    fmt,
    sync::{Arc, Mutex},
    time::Instant,
};

use kube_router_common::{ServiceKey, ServiceStats, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP};
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeLabelKey, EncodeLabelSet, LabelSetEncoder},
    metrics::{counter::ConstCounter, gauge::ConstGauge, histogram::Histogram, MetricType},
    registry::Registry,
};

use crate::{
    exposition::{self, register, single, sync_histogram, Value, UPSTREAM_COUNTER},
    metrics::Subsystem,
    services::family::AddressFamily,
};

/// A frontend of either family, as its metric labels name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct FrontendId {
    pub addr: std::net::IpAddr,
    /// Host byte order.
    pub port: u16,
    pub proto: u8,
}

impl FrontendId {
    pub fn of<F: AddressFamily>(key: &ServiceKey<F::Words>) -> Self {
        Self { addr: F::addr_from_words(key.addr).into(), port: u16::from_be(key.port), proto: key.proto }
    }
}

/// The Service a frontend belongs to: its names shared with the services catalog's
/// (`ServiceName`), so the owners of 20,000 frontends, and a scrape's copy of them, are
/// pointers rather than strings of their own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FrontendOwner {
    pub namespace: Arc<str>,
    pub name: Arc<str>,
}

/// Rates between the last two samples, per second.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Rates {
    pub cps: f64,
    pub pps_in: f64,
    pub pps_out: f64,
    pub bps_in: f64,
    pub bps_out: f64,
}

#[derive(Clone, Copy, Debug)]
struct Sample {
    at: Instant,
    stats: ServiceStats,
    rates: Rates,
    /// The reading that last saw the frontend.
    reading: u64,
}

/// Every frontend's Service and counters.
#[derive(Clone, Default)]
pub struct KubeRouterMetrics {
    /// Every programmed frontend and its Service, from the last compile.
    pub frontends: BTreeMap<FrontendId, FrontendOwner>,
    samples: BTreeMap<FrontendId, Sample>,
    /// Readings taken so far.
    readings: u64,
}

/// The per-Service families (the services controller names the frontends, the datapath
/// counters controller reads their counters every second), and how long that reading takes.
#[derive(Debug, Default)]
pub struct ServiceCounters {
    state: Mutex<KubeRouterMetrics>,
    /// Reading `svc_stats_v4` and `svc_stats_v6` (kube-router: IPVS metrics export).
    pub export_time: ExportTime,
}

/// [`ServiceCounters::export_time`]'s histogram (a newtype for its `Default`).
#[derive(Debug, Clone)]
pub struct ExportTime(pub Histogram);

impl Default for ExportTime {
    fn default() -> Self {
        Self(sync_histogram())
    }
}

impl fmt::Debug for KubeRouterMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KubeRouterMetrics").field("frontends", &self.frontends.len()).finish()
    }
}

impl ServiceCounters {
    pub fn with<R>(&self, f: impl FnOnce(&mut KubeRouterMetrics) -> R) -> R {
        f(&mut self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner()))
    }
}

impl Subsystem for ServiceCounters {
    fn register(this: &Arc<Self>, registry: &mut Registry) {
        register(
            registry,
            "kube_router_controller_ipvs_metrics_export_time",
            "Time it took to export metrics",
            this.export_time.0.clone(),
        );
        registry.register_collector(Box::new(this.clone()));
    }
}

impl Collector for ServiceCounters {
    /// The series are listed under the lock and encoded without it (10,000 Services are
    /// 100,000 lines; the datapath counters controller takes a reading every second). The list
    /// holds each frontend's key, shared names and counters; the labels are written from them
    /// line by line (a list of every frontend's labels as strings was a scrape's ~4 MiB at
    /// 10,000 Services, issue 29).
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        let series = self.with(|m| m.series());
        type Pick = fn(&Sample) -> Value;
        let families: [(&str, MetricType, &str, Pick); 10] = [
            ("service_total_connections", UPSTREAM_COUNTER, "Total incoming connections made", |s| {
                Value::Counter(s.stats.connections)
            }),
            ("service_packets_in", UPSTREAM_COUNTER, "Total incoming packets", |s| Value::Counter(s.stats.packets_in)),
            ("service_packets_out", UPSTREAM_COUNTER, "Total outgoing packets", |s| {
                Value::Counter(s.stats.packets_out)
            }),
            ("service_bytes_in", UPSTREAM_COUNTER, "Total incoming bytes", |s| Value::Counter(s.stats.bytes_in)),
            ("service_bytes_out", UPSTREAM_COUNTER, "Total outgoing bytes", |s| Value::Counter(s.stats.bytes_out)),
            ("service_pps_in", MetricType::Gauge, "Incoming packets per second", |s| Value::Gauge(s.rates.pps_in)),
            ("service_pps_out", MetricType::Gauge, "Outgoing packets per second", |s| Value::Gauge(s.rates.pps_out)),
            ("service_cps", MetricType::Gauge, "Service connections per second", |s| Value::Gauge(s.rates.cps)),
            ("service_bps_in", MetricType::Gauge, "Incoming bytes per second", |s| Value::Gauge(s.rates.bps_in)),
            ("service_bps_out", MetricType::Gauge, "Outgoing bytes per second", |s| Value::Gauge(s.rates.bps_out)),
        ];
        for (name, metric_type, help, pick) in families {
            let name = format!("kube_router_{name}");
            let of_family = series.iter().map(|(key, owner, sample)| (Some(labels(key, owner)), pick(sample)));
            exposition::series(&mut encoder, &name, help, metric_type, of_family)?;
        }
        Ok(())
    }
}

/// kube-router's Service labels: `svc_namespace`, `service_name`, `service_vip`, `protocol`
/// (lower case), `port`. A NodePort's VIP is the node address, as in IPVS. The encoder escapes
/// the values (a Service's name is user input and must not break or forge a sample line).
struct ServiceLabels<'a> {
    svc_namespace: &'a str,
    service_name: &'a str,
    service_vip: std::net::IpAddr,
    protocol: &'static str,
    port: u16,
}

/// As `#[derive(EncodeLabelSet)]` writes a struct of these fields, the address written as
/// text in place (no string of its own per line).
impl EncodeLabelSet for ServiceLabels<'_> {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> fmt::Result {
        fn label(encoder: &mut LabelSetEncoder, key: &str, value: impl fmt::Display) -> fmt::Result {
            let mut label = encoder.encode_label();
            let mut key_encoder = label.encode_label_key()?;
            EncodeLabelKey::encode(&key, &mut key_encoder)?;
            let mut value_encoder = key_encoder.encode_label_value()?;
            fmt::Write::write_fmt(&mut value_encoder, format_args!("{value}"))?;
            value_encoder.finish()
        }
        label(encoder, "svc_namespace", self.svc_namespace)?;
        label(encoder, "service_name", self.service_name)?;
        label(encoder, "service_vip", self.service_vip)?;
        label(encoder, "protocol", self.protocol)?;
        label(encoder, "port", self.port)
    }
}

/// A counter's increase per second; a counter that went down was reset (a new frontend).
fn rate(now: u64, before: u64, seconds: f64) -> f64 {
    let delta = if now >= before { now - before } else { now };
    delta as f64 / seconds
}

impl KubeRouterMetrics {
    /// Takes a new reading of every frontend's counters; rates are its difference from the
    /// previous one (kube-router takes them from IPVS's own estimator).
    /// Frontends not in the reading are dropped. Updated in place: a second map of every
    /// frontend each second was a few MiB of transient memory at 10,000 Services.
    pub fn sample(&mut self, now: Instant, stats: impl IntoIterator<Item = (FrontendId, ServiceStats)>) {
        self.readings += 1;
        let reading = self.readings;
        for (key, stats) in stats {
            let fresh = Sample { at: now, stats, rates: Rates::default(), reading };
            let sample = self.samples.entry(key).or_insert(fresh);
            if sample.reading == reading {
                continue;
            }
            if now > sample.at {
                let s = (now - sample.at).as_secs_f64();
                let b = &sample.stats;
                sample.rates = Rates {
                    cps: rate(stats.connections, b.connections, s),
                    pps_in: rate(stats.packets_in, b.packets_in, s),
                    pps_out: rate(stats.packets_out, b.packets_out, s),
                    bps_in: rate(stats.bytes_in, b.bytes_in, s),
                    bps_out: rate(stats.bytes_out, b.bytes_out, s),
                };
            }
            *sample = Sample { at: now, stats, rates: sample.rates, reading };
        }
        self.samples.retain(|_, sample| sample.reading == reading);
    }

    /// One series per programmed frontend (with an owner). One without counters has seen no
    /// packet yet (the datapath creates them with the first): zero.
    fn series(&self) -> Vec<(FrontendId, FrontendOwner, Sample)> {
        let unseen = Sample { at: Instant::now(), stats: ServiceStats::default(), rates: Rates::default(), reading: 0 };
        self.frontends
            .iter()
            .map(|(key, owner)| (*key, owner.clone(), *self.samples.get(key).unwrap_or(&unseen)))
            .collect()
    }
}

/// A programmed frontend and its Service, as the agent's `frontends` status page lists it
/// (`kube-router services` names frontends with it).
#[derive(serde::Serialize, serde::Deserialize, Clone, Debug, PartialEq)]
pub struct NamedFrontend {
    pub address: std::net::SocketAddr,
    pub protocol: String,
    pub namespace: String,
    pub name: String,
}

/// The `frontends` page: every programmed frontend with an owner, as JSON.
pub fn frontends_page(frontends: &BTreeMap<FrontendId, FrontendOwner>) -> String {
    let list: Vec<NamedFrontend> = frontends
        .iter()
        .map(|(key, owner)| NamedFrontend {
            address: std::net::SocketAddr::new(key.addr, key.port),
            protocol: protocol_name(key.proto).to_string(),
            namespace: owner.namespace.to_string(),
            name: owner.name.to_string(),
        })
        .collect();
    serde_json::to_string(&list).unwrap_or_default()
}

fn protocol_name(proto: u8) -> &'static str {
    match proto {
        IPPROTO_TCP => "tcp",
        IPPROTO_UDP => "udp",
        IPPROTO_SCTP => "sctp",
        _ => "unknown",
    }
}

fn labels<'a>(key: &FrontendId, owner: &'a FrontendOwner) -> ServiceLabels<'a> {
    ServiceLabels {
        svc_namespace: &owner.namespace,
        service_name: &owner.name,
        service_vip: key.addr,
        protocol: protocol_name(key.proto),
        port: key.port,
    }
}

/// `kube_router_build_info`: kube-router's labels; `goversion` holds the Rust compiler version.
#[derive(Debug, Default)]
pub struct BuildInfo;

impl Subsystem for BuildInfo {
    fn register(this: &Arc<Self>, registry: &mut Registry) {
        registry.register_collector(Box::new(this.clone()));
    }
}

impl Collector for BuildInfo {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        let labels = [("goversion", env!("KUBE_ROUTER_RUSTC_VERSION")), ("version", env!("CARGO_PKG_VERSION"))];
        exposition::series(
            &mut encoder,
            "kube_router_build_info",
            "Expose version and other build information",
            MetricType::Gauge,
            [(Some(labels), ConstGauge::new(1i64))],
        )
    }
}

/// kube-router's BGP families that we have an equivalent for, and the FIB task's host routes.
pub fn encode_bgp(encoder: &mut DescriptorEncoder, bgp: &crate::routing::bgp::speaker::SpeakerStatus) -> fmt::Result {
    single(
        encoder,
        "kube_router_controller_bgp_peers",
        "BGP peers in the runtime configuration",
        &ConstGauge::new(bgp.peers.len() as i64),
    )?;
    let peers = bgp.peers.iter().map(|p| {
        let kind = if p.asn == bgp.local_asn { "internal" } else { "external" };
        let state = format!("{:?}", p.state).to_lowercase();
        let labels =
            [("address", p.address.to_string()), ("type", kind.into()), ("asn", p.asn.to_string()), ("state", state)];
        (Some(labels), ConstGauge::new(1i64))
    });
    exposition::series(encoder, "kube_router_bgp_peer_info", "BGP peer information", MetricType::Gauge, peers)?;
    let received: u64 = bgp.peers.iter().map(|p| p.updates_received).sum();
    exposition::series(
        encoder,
        "kube_router_controller_bgp_advertisements_received",
        "BGP advertisements received (UPDATE messages, all peers)",
        UPSTREAM_COUNTER,
        [(None::<[(&str, &str); 0]>, ConstCounter::new(received))],
    )?;
    let sent = &bgp.advertisements;
    let sent =
        [("pod-route", sent.pod_route), ("advertise-vip", sent.advertise_vip), ("withdraw-vip", sent.withdraw_vip)]
            .map(|(kind, n)| (Some([("type", kind)]), ConstCounter::new(n)));
    exposition::series(
        encoder,
        "kube_router_controller_bgp_advertisements_sent",
        "BGP advertisements sent",
        UPSTREAM_COUNTER,
        sent,
    )?;
    bgp.fib.encode(encoder)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// The per-Service families of `m`, as scraped.
    fn rendered(m: KubeRouterMetrics) -> String {
        let counters = Arc::new(ServiceCounters { state: Mutex::new(m), ..Default::default() });
        let mut registry = Registry::default();
        registry.register_collector(Box::new(counters));
        crate::exposition::encode(&registry)
    }

    #[test]
    fn label_values_are_escaped_so_a_service_name_cannot_forge_a_sample() {
        let mut m = KubeRouterMetrics::default();
        let forged = "web\"} 1\nkube_router_service_total_connections{svc_namespace=\"x\\";
        m.frontends.insert(key(10, 80), FrontendOwner { namespace: "default".into(), name: forged.into() });
        let out = rendered(m);
        let escaped = "service_name=\"web\\\"} 1\\nkube_router_service_total_connections{svc_namespace=\\\"x\\\\\"";
        assert!(
            out.contains(&format!("kube_router_service_total_connections{{svc_namespace=\"default\",{escaped},")),
            "{out}"
        );
        let samples = out.lines().filter(|l| l.starts_with("kube_router_service_total_connections")).count();
        assert_eq!(samples, 1, "no forged sample line:\n{out}");
    }

    fn key(last: u8, port: u16) -> FrontendId {
        FrontendId { addr: [10, 96, 0, last].into(), port, proto: IPPROTO_TCP }
    }

    #[test]
    fn rates_are_the_difference_between_two_samples_and_a_reset_starts_over() {
        let mut m = KubeRouterMetrics::default();
        let k = key(10, 80);
        m.frontends.insert(k, FrontendOwner { namespace: "default".into(), name: "web".into() });
        let t0 = Instant::now();
        let at = |connections, bytes_in| ServiceStats { connections, bytes_in, ..Default::default() };
        m.sample(t0, BTreeMap::from([(k, at(10, 1000))]));
        assert_eq!(m.samples[&k].rates, Rates::default());
        m.sample(t0 + Duration::from_secs(2), BTreeMap::from([(k, at(30, 5000))]));
        assert_eq!(m.samples[&k].rates.cps, 10.0);
        assert_eq!(m.samples[&k].rates.bps_in, 2000.0);
        // The frontend was removed and programmed again: its counters restarted from zero.
        m.sample(t0 + Duration::from_secs(3), BTreeMap::from([(k, at(4, 0))]));
        assert_eq!(m.samples[&k].rates.cps, 4.0);
        let out = rendered(m);
        let labels =
            "svc_namespace=\"default\",service_name=\"web\",service_vip=\"10.96.0.10\",protocol=\"tcp\",port=\"80\"";
        assert!(out.contains(&format!("kube_router_service_total_connections{{{labels}}} 4\n")), "{out}");
        assert!(out.contains(&format!("kube_router_service_cps{{{labels}}} 4.0\n")), "{out}");
        assert!(out.contains("# TYPE kube_router_service_total_connections counter\n"), "{out}");
    }

    #[test]
    fn a_programmed_frontend_without_counters_is_exported_at_zero() {
        let mut m = KubeRouterMetrics::default();
        let (seen, unseen) = (key(10, 80), key(10, 443));
        for k in [seen, unseen] {
            m.frontends.insert(k, FrontendOwner { namespace: "default".into(), name: "web".into() });
        }
        m.sample(Instant::now(), BTreeMap::from([(seen, ServiceStats { connections: 2, ..Default::default() })]));
        let out = rendered(m);
        let labels = |port| {
            format!("svc_namespace=\"default\",service_name=\"web\",service_vip=\"10.96.0.10\",protocol=\"tcp\",port=\"{port}\"")
        };
        assert!(out.contains(&format!("kube_router_service_total_connections{{{}}} 2\n", labels(80))), "{out}");
        assert!(out.contains(&format!("kube_router_service_total_connections{{{}}} 0\n", labels(443))), "{out}");
        assert!(out.contains(&format!("kube_router_service_cps{{{}}} 0.0\n", labels(443))), "{out}");
    }

    #[test]
    fn frontends_without_an_owner_are_not_exported() {
        let mut m = KubeRouterMetrics::default();
        m.sample(
            Instant::now(),
            BTreeMap::from([(key(11, 53), ServiceStats { connections: 1, ..Default::default() })]),
        );
        let out = rendered(m);
        assert!(!out.contains("10.96.0.11"), "{out}");
    }

    #[test]
    fn an_ipv6_frontend_is_labelled_with_its_address() {
        let mut m = KubeRouterMetrics::default();
        let k = FrontendId::of::<crate::services::family::V6>(&kube_router_common::ServiceKeyV6 {
            addr: kube_router_common::Ipv6Words::from_octets(
                "fd00:96::10".parse::<std::net::Ipv6Addr>().unwrap().octets(),
            ),
            port: 80u16.to_be(),
            proto: IPPROTO_UDP,
            pad: 0,
        });
        m.frontends.insert(k, FrontendOwner { namespace: "default".into(), name: "web".into() });
        m.sample(Instant::now(), BTreeMap::from([(k, ServiceStats { connections: 3, ..Default::default() })]));
        let out = rendered(m);
        let labels =
            "svc_namespace=\"default\",service_name=\"web\",service_vip=\"fd00:96::10\",protocol=\"udp\",port=\"80\"";
        assert!(out.contains(&format!("kube_router_service_total_connections{{{labels}}} 3\n")), "{out}");
    }

    #[test]
    fn the_frontends_page_lists_each_frontend_with_its_service_for_the_cli() {
        let owner = FrontendOwner { namespace: "shop".into(), name: "web".into() };
        let v6 = FrontendId { addr: "fd00:96::10".parse().unwrap(), port: 443, proto: IPPROTO_TCP };
        let frontends = BTreeMap::from([(key(10, 80), owner.clone()), (v6, owner)]);
        let listed: Vec<NamedFrontend> = serde_json::from_str(&frontends_page(&frontends)).unwrap();
        let addresses: Vec<String> = listed.iter().map(|f| format!("{} {}", f.protocol, f.address)).collect();
        assert_eq!(addresses, ["tcp 10.96.0.10:80", "tcp [fd00:96::10]:443"]);
        assert!(listed.iter().all(|f| f.namespace == "shop" && f.name == "web"));
    }
}
