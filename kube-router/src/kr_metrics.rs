//! kube-router's own metric names, so its Grafana dashboard and alerts work unchanged: build
//! info, per-Service counters (from `svc_stats_v4` / `_v6`, kube-router reads them from IPVS), controller
//! sync times and BGP peers. Our own `kube_router_*` names stay beside them (see docs/metrics.md,
//! "Metrics").
use std::{collections::BTreeMap, fmt::Write as _, time::Instant};

use kube_router_common::{ServiceKey, ServiceStats, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP};

use crate::{
    metrics::{family, Histogram},
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

/// The Service a frontend belongs to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FrontendOwner {
    pub namespace: String,
    pub name: String,
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

#[derive(Clone, Default)]
pub struct KubeRouterMetrics {
    /// Every programmed frontend and its Service, from the last compile.
    pub frontends: BTreeMap<FrontendId, FrontendOwner>,
    samples: BTreeMap<FrontendId, Sample>,
    /// Readings taken so far.
    readings: u64,
    /// Services sync (kube-router: IPVS services sync).
    pub services_sync_time: Histogram,
    /// NetworkPolicy compile + map writes (kube-router: iptables / policy chains sync).
    pub policy_sync_time: Histogram,
    /// BGP peers from Node objects (kube-router: internal peers sync).
    pub bgp_peers_sync_time: Histogram,
    /// Reading `svc_stats_v4` and `svc_stats_v6` (kube-router: IPVS metrics export).
    pub stats_export_time: Histogram,
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

    /// The per-Service families, one series per programmed frontend (with an owner). One
    /// without counters has seen no packet yet (the datapath creates them with the first): zero.
    pub fn render_services(&self, out: &mut String) {
        let unseen = Sample { at: Instant::now(), stats: ServiceStats::default(), rates: Rates::default(), reading: 0 };
        let series: Vec<(String, &Sample)> = self
            .frontends
            .iter()
            .map(|(key, owner)| (labels(key, owner), self.samples.get(key).unwrap_or(&unseen)))
            .collect();
        type Pick = fn(&Sample) -> f64;
        let families: [(&str, &str, &str, Pick); 10] = [
            ("service_total_connections", "counter", "Total incoming connections made", |s| s.stats.connections as f64),
            ("service_packets_in", "counter", "Total incoming packets", |s| s.stats.packets_in as f64),
            ("service_packets_out", "counter", "Total outgoing packets", |s| s.stats.packets_out as f64),
            ("service_bytes_in", "counter", "Total incoming bytes", |s| s.stats.bytes_in as f64),
            ("service_bytes_out", "counter", "Total outgoing bytes", |s| s.stats.bytes_out as f64),
            ("service_pps_in", "gauge", "Incoming packets per second", |s| s.rates.pps_in),
            ("service_pps_out", "gauge", "Outgoing packets per second", |s| s.rates.pps_out),
            ("service_cps", "gauge", "Service connections per second", |s| s.rates.cps),
            ("service_bps_in", "gauge", "Incoming bytes per second", |s| s.rates.bps_in),
            ("service_bps_out", "gauge", "Outgoing bytes per second", |s| s.rates.bps_out),
        ];
        for (name, kind, help, pick) in families {
            family(out, &format!("kube_router_{name}"), kind, help);
            for (labels, sample) in &series {
                let _ = writeln!(out, "kube_router_{name}{{{labels}}} {}", pick(sample));
            }
        }
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
            namespace: owner.namespace.clone(),
            name: owner.name.clone(),
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

/// kube-router's Service labels: `svc_namespace`, `service_name`, `service_vip`, `protocol`
/// (lower case), `port`. A NodePort's VIP is the node address, as in IPVS.
fn labels(key: &FrontendId, owner: &FrontendOwner) -> String {
    let vip = key.addr;
    let protocol = protocol_name(key.proto);
    format!(
        "svc_namespace=\"{}\",service_name=\"{}\",service_vip=\"{vip}\",protocol=\"{protocol}\",port=\"{}\"",
        escape_label_value(&owner.namespace),
        escape_label_value(&owner.name),
        key.port
    )
}

/// The text format's label-value escaping (`\` → `\\`, `"` → `\"`, newline → `\n`): a Service
/// name is user input and must not be able to break or forge a sample line.
pub fn escape_label_value(value: &str) -> std::borrow::Cow<'_, str> {
    if !value.contains(['\\', '"', '\n']) {
        return std::borrow::Cow::Borrowed(value);
    }
    let mut out = String::with_capacity(value.len() + 8);
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    std::borrow::Cow::Owned(out)
}

/// A histogram family (kube-router's sync times are histograms in seconds).
pub fn render_histogram(out: &mut String, name: &str, help: &str, h: &Histogram) {
    family(out, name, "histogram", help);
    h.write_samples(out, name);
}

/// `kube_router_build_info`: kube-router's labels; `goversion` holds the Rust compiler version.
pub fn render_build_info(out: &mut String) {
    family(out, "kube_router_build_info", "gauge", "Expose version and other build information");
    let _ = writeln!(
        out,
        "kube_router_build_info{{goversion=\"{}\",version=\"{}\"}} 1",
        env!("KUBE_ROUTER_RUSTC_VERSION"),
        env!("CARGO_PKG_VERSION")
    );
}

/// kube-router's BGP families that we have an equivalent for.
pub fn render_bgp(out: &mut String, bgp: &crate::bgp::speaker::SpeakerStatus) {
    family(out, "kube_router_controller_bgp_peers", "gauge", "BGP peers in the runtime configuration");
    let _ = writeln!(out, "kube_router_controller_bgp_peers {}", bgp.peers.len());
    family(out, "kube_router_bgp_peer_info", "gauge", "BGP peer information");
    for p in &bgp.peers {
        let kind = if p.asn == bgp.local_asn { "internal" } else { "external" };
        let state = format!("{:?}", p.state).to_lowercase();
        let _ = writeln!(
            out,
            "kube_router_bgp_peer_info{{address=\"{}\",type=\"{kind}\",asn=\"{}\",state=\"{state}\"}} 1",
            p.address, p.asn
        );
    }
    family(
        out,
        "kube_router_controller_bgp_advertisements_received",
        "counter",
        "BGP advertisements received (UPDATE messages, all peers)",
    );
    let received: u64 = bgp.peers.iter().map(|p| p.updates_received).sum();
    let _ = writeln!(out, "kube_router_controller_bgp_advertisements_received {received}");
    family(out, "kube_router_controller_bgp_advertisements_sent", "counter", "BGP advertisements sent");
    let sent = &bgp.advertisements;
    for (kind, n) in
        [("pod-route", sent.pod_route), ("advertise-vip", sent.advertise_vip), ("withdraw-vip", sent.withdraw_vip)]
    {
        let _ = writeln!(out, "kube_router_controller_bgp_advertisements_sent{{type=\"{kind}\"}} {n}");
    }
    // kube-router's host routes: the routes learned over BGP that the agent keeps in the kernel
    // (its injected routes), from the FIB task's passes.
    let fib = &bgp.fib;
    crate::exposition::single_samples(
        out,
        &[
            (
                "kube_router_host_routes_synced",
                "gauge",
                "Count of host routes currently synced to the system",
                fib.installed as u64,
            ),
            (
                "kube_router_host_routes_added",
                "counter",
                "Total count of host routes added to the system",
                fib.added_total,
            ),
            (
                "kube_router_host_routes_removed",
                "counter",
                "Total count of host routes removed to the system",
                fib.removed_total,
            ),
        ],
    );
    render_histogram(
        out,
        "kube_router_host_routes_sync_time",
        "Time it took for the host routes controller to sync to the system",
        &fib.pass_time,
    );
}

#[cfg(test)]
mod tests {
    #[test]
    fn label_values_are_escaped_so_a_service_name_cannot_forge_a_sample() {
        assert_eq!(super::escape_label_value("plain"), "plain");
        assert_eq!(super::escape_label_value("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }

    use std::time::Duration;

    use super::*;

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
        let mut out = String::new();
        m.render_services(&mut out);
        let labels =
            "svc_namespace=\"default\",service_name=\"web\",service_vip=\"10.96.0.10\",protocol=\"tcp\",port=\"80\"";
        assert!(out.contains(&format!("kube_router_service_total_connections{{{labels}}} 4\n")), "{out}");
        assert!(out.contains(&format!("kube_router_service_cps{{{labels}}} 4\n")), "{out}");
    }

    #[test]
    fn a_programmed_frontend_without_counters_is_exported_at_zero() {
        let mut m = KubeRouterMetrics::default();
        let (seen, unseen) = (key(10, 80), key(10, 443));
        for k in [seen, unseen] {
            m.frontends.insert(k, FrontendOwner { namespace: "default".into(), name: "web".into() });
        }
        m.sample(Instant::now(), BTreeMap::from([(seen, ServiceStats { connections: 2, ..Default::default() })]));
        let mut out = String::new();
        m.render_services(&mut out);
        let labels = |port| {
            format!("svc_namespace=\"default\",service_name=\"web\",service_vip=\"10.96.0.10\",protocol=\"tcp\",port=\"{port}\"")
        };
        assert!(out.contains(&format!("kube_router_service_total_connections{{{}}} 2\n", labels(80))), "{out}");
        assert!(out.contains(&format!("kube_router_service_total_connections{{{}}} 0\n", labels(443))), "{out}");
        assert!(out.contains(&format!("kube_router_service_cps{{{}}} 0\n", labels(443))), "{out}");
    }

    #[test]
    fn frontends_without_an_owner_are_not_exported() {
        let mut m = KubeRouterMetrics::default();
        m.sample(
            Instant::now(),
            BTreeMap::from([(key(11, 53), ServiceStats { connections: 1, ..Default::default() })]),
        );
        let mut out = String::new();
        m.render_services(&mut out);
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
        let mut out = String::new();
        m.render_services(&mut out);
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
