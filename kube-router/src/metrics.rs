//! Prometheus text-format metrics and the health endpoints, served over plain HTTP/1.1.
use std::{
    collections::BTreeMap,
    fmt::Write as _,
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use tokio::net::TcpListener;

use crate::{http::Response, map_writes::SyncReport};

pub use crate::exposition::{family, Histogram, SYNC_BUCKETS};

/// Renders metric families into the exposition text.
pub type Family = Arc<dyn Fn(&mut String) + Send + Sync>;
/// Renders a status page.
pub type Page = Arc<dyn Fn() -> String + Send + Sync>;

#[derive(Clone, Default)]
pub struct MetricsState {
    /// (map, op) -> count, op in insert/update/delete/error/full.
    pub map_writes: BTreeMap<(&'static str, &'static str), u64>,
    pub map_entries: BTreeMap<&'static str, u64>,
    /// Maps that could not take every desired entry at the last sync.
    pub map_full: BTreeMap<&'static str, bool>,
    pub sync_duration: Histogram,
    pub syncs: u64,
    /// Service syncs from a complete desired state (every kind listed, or the service file).
    pub complete_syncs: u64,
    pub last_sync_unix: Option<f64>,
    pub rejected_objects: BTreeMap<&'static str, u64>,
    /// externalIPs and LoadBalancer IPs refused, by reason (once per Service and address).
    pub external_ips_refused: BTreeMap<&'static str, u64>,
    pub dropped_endpoints: u64,
    pub datapath_packets: Vec<(&'static str, u64)>,
    /// `xdp_stats`: the XDP fast path's packets by outcome (empty until it ever ran).
    pub xdp_packets: Vec<(&'static str, u64)>,
    /// `dsr_stats`: direct server return's packets and flows by event.
    pub dsr_packets: Vec<(&'static str, u64)>,
    /// `src_chk_stats`: source-address verification on pod veths, packets by outcome.
    pub pod_source_packets: Vec<(&'static str, u64)>,
    /// Pod veths with a `pod_src` entry, and of those the ones whose pod has no address yet.
    pub pod_source_veths: (usize, usize),
    pub conntrack_entries: u64,
    pub conntrack_gc_removed: u64,
    /// UDP flows whose entries the services controller removed: their backend left the flow's
    /// frontend while still backing another.
    pub conntrack_purged_flows: u64,
    /// Conntrack walks for such flows (one per sync that moved a UDP backend out of a frontend).
    pub conntrack_purge_scans: u64,
    pub api_reachable: bool,
    pub api_errors: u64,
    pub last_api_contact_unix: Option<f64>,
    pub checkpoint_errors: u64,
    /// How long the last checkpoint write took (it sets the wait before the next).
    pub checkpoint_write_seconds: Option<f64>,
    /// Restored checkpoints not programmed into a set of maps (`service`, `policy`) that
    /// already held newer API state.
    pub checkpoint_superseded: BTreeMap<&'static str, u64>,
    /// CNI configuration that could not be derived or written (`--enable-cni`).
    pub cni_errors: u64,
    pub checkpoint_age_at_start: Option<f64>,
    /// controller name -> last heartbeat.
    pub heartbeats: BTreeMap<&'static str, Instant>,
    /// `pol_stats` counters, summed over CPUs.
    pub policy_packets: Vec<(&'static str, u64)>,
    pub policy_conntrack_entries: u64,
    pub policy_sync_seconds: Option<f64>,
    /// `sock_stats` counters, summed over CPUs (empty while the socket LB never ran).
    pub socket_lb_events: Vec<(&'static str, u64)>,
    /// Failures to attach the socket load balancer.
    pub socket_lb_errors: u64,
    /// reason -> starts at which the agent's own cgroup could not be exempted from the socket
    /// load balancer (`socket_lb::NotExempt`).
    pub socket_lb_agent_not_exempt: BTreeMap<&'static str, u64>,
    /// Families rendered by the part of the agent that registered them, fresh on every
    /// scrape (BGP sessions), by name.
    pub families: BTreeMap<&'static str, Family>,
    /// Text pages served at `/<name>` (`/bgp`).
    pub pages: BTreeMap<&'static str, Page>,
    /// `ovl_stats` counters, summed over CPUs (once the overlay is in use).
    pub overlay_packets: Vec<(&'static str, u64)>,
    /// kube-router's names (per-Service counters, sync times), see `kr_metrics`.
    pub kr: crate::kr_metrics::KubeRouterMetrics,
    /// (server, reason) -> connections closed unanswered: over a limit, or too slow.
    pub http_rejected: BTreeMap<(&'static str, &'static str), u64>,
    /// (server, errno name) -> failed `accept()` calls.
    pub http_accept_errors: BTreeMap<(&'static str, &'static str), u64>,
    /// The controllers' liveness and the agent's readiness.
    pub health: Arc<crate::health::Health>,
}

impl MetricsState {
    /// Every write of one pass of the map writer, by map and operation.
    pub fn add_map_writes(&mut self, report: &SyncReport) {
        for (map, c) in &report.per_map {
            for (op, n) in [
                ("insert", c.inserts),
                ("update", c.updates),
                ("delete", c.deletes),
                ("error", c.errors),
                ("full", c.full),
                ("deferred", c.deferred),
            ] {
                if n > 0 {
                    *self.map_writes.entry((map, op)).or_default() += n;
                }
            }
        }
    }

    /// One Service sync: its writes, its duration and whether it ran from a `complete` desired
    /// state. Recorded under the caller's one lock with the rest of the sync's numbers, so a
    /// scrape sees all of a sync or none of it.
    pub fn record_sync(&mut self, report: &SyncReport, duration: Duration, complete: bool) {
        self.add_map_writes(report);
        self.sync_duration.observe(duration.as_secs_f64());
        self.kr.services_sync_time.observe(duration.as_secs_f64());
        self.syncs += 1;
        self.complete_syncs += u64::from(complete);
        self.last_sync_unix = Some(unix_now());
    }
}

#[derive(Clone, Default)]
pub struct Metrics(pub Arc<Mutex<MetricsState>>);

pub fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs_f64()
}

impl Metrics {
    pub fn with<R>(&self, f: impl FnOnce(&mut MetricsState) -> R) -> R {
        let mut state = self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        f(&mut state)
    }

    pub fn heartbeat(&self, controller: &'static str) {
        self.with(|m| {
            m.heartbeats.insert(controller, Instant::now());
        })
    }

    /// The exposition text. The state is copied under the lock and rendered without it: every
    /// controller records into it, and a scrape (or a slow client's many) must not stall them.
    pub fn render(&self) -> String {
        let snapshot = self.with(|m| m.clone());
        let m = &snapshot;
        {
            let mut out = String::new();
            family(
                &mut out,
                "kube_router_map_writes_total",
                "counter",
                "Writes to pinned BPF maps by map and operation.",
            );
            for ((map, op), n) in &m.map_writes {
                let _ = writeln!(out, "kube_router_map_writes_total{{map=\"{map}\",op=\"{op}\"}} {n}");
            }
            family(
                &mut out,
                "kube_router_map_full",
                "gauge",
                "1 while a pinned BPF map cannot take every desired entry (existing ones are kept).",
            );
            for (map, full) in &m.map_full {
                let _ = writeln!(out, "kube_router_map_full{{map=\"{map}\"}} {}", u8::from(*full));
            }
            family(&mut out, "kube_router_map_entries", "gauge", "Entries in each pinned BPF map as last programmed.");
            for (map, n) in &m.map_entries {
                let _ = writeln!(out, "kube_router_map_entries{{map=\"{map}\"}} {n}");
            }
            family(
                &mut out,
                "kube_router_sync_duration_seconds",
                "histogram",
                "Time to compute and apply one service map sync.",
            );
            for (bound, n) in SYNC_BUCKETS.iter().zip(m.sync_duration.counts) {
                let _ = writeln!(out, "kube_router_sync_duration_seconds_bucket{{le=\"{bound}\"}} {n}");
            }
            let h = &m.sync_duration;
            let _ = writeln!(out, "kube_router_sync_duration_seconds_bucket{{le=\"+Inf\"}} {}", h.count);
            let _ = writeln!(
                out,
                "kube_router_sync_duration_seconds_sum {}\nkube_router_sync_duration_seconds_count {}",
                h.sum, h.count
            );
            family(
                &mut out,
                "kube_router_last_sync_timestamp_seconds",
                "gauge",
                "Unix time of the last successful sync.",
            );
            let _ = writeln!(out, "kube_router_last_sync_timestamp_seconds {}", m.last_sync_unix.unwrap_or(0.0));
            family(
                &mut out,
                "kube_router_seconds_since_last_sync",
                "gauge",
                "Seconds since the last successful sync (-1 before the first).",
            );
            let since = m.last_sync_unix.map(|t| unix_now() - t).unwrap_or(-1.0);
            let _ = writeln!(out, "kube_router_seconds_since_last_sync {since:.3}");
            family(
                &mut out,
                "kube_router_service_complete_syncs_total",
                "counter",
                "Service syncs from a complete desired state; the others ran from a checkpoint or a partial listing.",
            );
            let _ = writeln!(out, "kube_router_service_complete_syncs_total {}", m.complete_syncs);
            family(
                &mut out,
                "kube_router_rejected_objects_total",
                "counter",
                "Objects rejected as invalid (their programmed state is kept).",
            );
            for (kind, n) in &m.rejected_objects {
                let _ = writeln!(out, "kube_router_rejected_objects_total{{kind=\"{kind}\"}} {n}");
            }
            family(
                &mut out,
                "kube_router_service_external_ips_refused_total",
                "counter",
                "Service externalIPs and LoadBalancer IPs refused (not programmed, not advertised), by reason.",
            );
            for (reason, n) in &m.external_ips_refused {
                let _ = writeln!(out, "kube_router_service_external_ips_refused_total{{reason=\"{reason}\"}} {n}");
            }
            family(
                &mut out,
                "kube_router_dropped_endpoints",
                "gauge",
                "Endpoints left out because a service exceeded --max-backends-per-service.",
            );
            let _ = writeln!(out, "kube_router_dropped_endpoints {}", m.dropped_endpoints);
            family(
                &mut out,
                "kube_router_datapath_packets_total",
                "counter",
                "Packets seen by the load-balancer program, by outcome (per-CPU counters summed).",
            );
            for (what, n) in &m.datapath_packets {
                let _ = writeln!(out, "kube_router_datapath_packets_total{{event=\"{what}\"}} {n}");
            }
            family(
                &mut out,
                "kube_router_xdp_packets_total",
                "counter",
                "Packets seen by the XDP fast path on node uplinks, by outcome (per-CPU counters summed).",
            );
            for (what, n) in &m.xdp_packets {
                let _ = writeln!(out, "kube_router_xdp_packets_total{{event=\"{what}\"}} {n}");
            }
            family(
                &mut out,
                "kube_router_dsr_packets_total",
                "counter",
                "Direct server return: packets tunnelled to and received from other nodes, and flows, by event.",
            );
            for (what, n) in &m.dsr_packets {
                let _ = writeln!(out, "kube_router_dsr_packets_total{{event=\"{what}\"}} {n}");
            }
            family(
                &mut out,
                "kube_router_pod_source_check_packets_total",
                "counter",
                "Packets from pod veths by source-address verification outcome (spoofed_*: dropped).",
            );
            for (what, n) in &m.pod_source_packets {
                let _ = writeln!(out, "kube_router_pod_source_check_packets_total{{event=\"{what}\"}} {n}");
            }
            family(
                &mut out,
                "kube_router_pod_source_veths",
                "gauge",
                "Pod veths whose source addresses are checked; unassigned: the pod has no address yet (its IP traffic is dropped).",
            );
            let (checked, unassigned) = m.pod_source_veths;
            let _ = writeln!(out, "kube_router_pod_source_veths{{state=\"checked\"}} {checked}");
            let _ = writeln!(out, "kube_router_pod_source_veths{{state=\"unassigned\"}} {unassigned}");
            family(
                &mut out,
                "kube_router_conntrack_entries",
                "gauge",
                "Entries in ct_v4 after the last garbage collection.",
            );
            let _ = writeln!(out, "kube_router_conntrack_entries {}", m.conntrack_entries);
            family(
                &mut out,
                "kube_router_conntrack_gc_removed_total",
                "counter",
                "Expired conntrack entries removed by garbage collection.",
            );
            let _ = writeln!(out, "kube_router_conntrack_gc_removed_total {}", m.conntrack_gc_removed);
            family(
                &mut out,
                "kube_router_conntrack_purged_flows_total",
                "counter",
                "UDP flows whose conntrack entries were removed because their backend left the flow's Service frontend while still backing another; the next datagram is balanced again.",
            );
            let _ = writeln!(out, "kube_router_conntrack_purged_flows_total {}", m.conntrack_purged_flows);
            family(
                &mut out,
                "kube_router_conntrack_purge_scans_total",
                "counter",
                "Walks of the Service conntrack for those flows: one per sync that took a still-programmed backend out of a UDP frontend.",
            );
            let _ = writeln!(out, "kube_router_conntrack_purge_scans_total {}", m.conntrack_purge_scans);
            family(
                &mut out,
                "kube_router_api_reachable",
                "gauge",
                "1 while the last API request succeeded, 0 after a failure.",
            );
            let _ = writeln!(out, "kube_router_api_reachable {}", u8::from(m.api_reachable));
            family(
                &mut out,
                "kube_router_api_errors_total",
                "counter",
                "Failed API list/watch requests (each retried with backoff).",
            );
            let _ = writeln!(out, "kube_router_api_errors_total {}", m.api_errors);
            family(
                &mut out,
                "kube_router_seconds_since_api_contact",
                "gauge",
                "Seconds since the API server last answered (-1 before it ever did).",
            );
            let since = m.last_api_contact_unix.map(|t| unix_now() - t).unwrap_or(-1.0);
            let _ = writeln!(out, "kube_router_seconds_since_api_contact {since:.3}");
            family(
                &mut out,
                "kube_router_checkpoint_errors_total",
                "counter",
                "Checkpoints that could not be written or read.",
            );
            let _ = writeln!(out, "kube_router_checkpoint_errors_total {}", m.checkpoint_errors);
            if let Some(seconds) = m.checkpoint_write_seconds {
                family(
                    &mut out,
                    "kube_router_checkpoint_write_duration_seconds",
                    "gauge",
                    "How long the last checkpoint write took; the next waits 20 times as long (at least 1 s).",
                );
                let _ = writeln!(out, "kube_router_checkpoint_write_duration_seconds {seconds:.6}");
            }
            family(
                &mut out,
                "kube_router_checkpoint_superseded_total",
                "counter",
                "Restored checkpoints not programmed because the maps already held newer API state (a restart within a second of a change).",
            );
            for maps in ["policy", "service"] {
                let count = m.checkpoint_superseded.get(maps).copied().unwrap_or(0);
                let _ = writeln!(out, "kube_router_checkpoint_superseded_total{{maps=\"{maps}\"}} {count}");
            }
            family(
                &mut out,
                "kube_router_cni_config_errors_total",
                "counter",
                "CNI configurations that could not be derived from the Node or written (the datapath is unaffected).",
            );
            let _ = writeln!(out, "kube_router_cni_config_errors_total {}", m.cni_errors);
            if !m.overlay_packets.is_empty() {
                family(
                    &mut out,
                    "kube_router_overlay_packets_total",
                    "counter",
                    "Pod overlay datapath events (ovl_stats), summed over CPUs.",
                );
                for (name, n) in &m.overlay_packets {
                    let _ = writeln!(out, "kube_router_overlay_packets_total{{event=\"{name}\"}} {n}");
                }
            }
            if !m.policy_packets.is_empty() {
                family(
                    &mut out,
                    "kube_router_policy_packets_total",
                    "counter",
                    "NetworkPolicy datapath verdicts, passes and drops before judging (pol_stats, pol_guard_stats), summed over CPUs.",
                );
                for (name, n) in &m.policy_packets {
                    let _ = writeln!(out, "kube_router_policy_packets_total{{result=\"{name}\"}} {n}");
                }
                family(
                    &mut out,
                    "kube_router_policy_conntrack_entries",
                    "gauge",
                    "Entries in pol_ct_v4 after the last GC.",
                );
                let _ = writeln!(out, "kube_router_policy_conntrack_entries {}", m.policy_conntrack_entries);
            }
            family(
                &mut out,
                "kube_router_socket_lb_errors_total",
                "counter",
                "Failures to attach the socket load balancer (cgroup programs).",
            );
            let _ = writeln!(out, "kube_router_socket_lb_errors_total {}", m.socket_lb_errors);
            family(
                &mut out,
                "kube_router_socket_lb_agent_not_exempt_total",
                "counter",
                "Starts at which the agent's own cgroup could not be exempted from the socket load balancer, by reason.",
            );
            for (reason, n) in &m.socket_lb_agent_not_exempt {
                let _ = writeln!(out, "kube_router_socket_lb_agent_not_exempt_total{{reason=\"{reason}\"}} {n}");
            }
            if !m.socket_lb_events.is_empty() {
                family(
                    &mut out,
                    "kube_router_socket_lb_events_total",
                    "counter",
                    "Socket load balancer calls by outcome (sock_stats), summed over CPUs.",
                );
                for (name, n) in &m.socket_lb_events {
                    let _ = writeln!(out, "kube_router_socket_lb_events_total{{event=\"{name}\"}} {n}");
                }
            }
            if let Some(seconds) = m.policy_sync_seconds {
                family(
                    &mut out,
                    "kube_router_policy_sync_seconds",
                    "gauge",
                    "Duration of the last policy compile and sync.",
                );
                let _ = writeln!(out, "kube_router_policy_sync_seconds {seconds}");
            }
            for render in m.families.values() {
                render(&mut out);
            }
            render_http_families(&mut out, m);
            render_kube_router_names(&mut out, m);
            crate::process_metrics::render_own(&mut out);
            out
        }
    }

    /// Adds (or replaces) the families `name` renders on every scrape.
    pub fn register_families(&self, name: &'static str, render: Family) {
        self.with(|m| m.families.insert(name, render));
    }

    /// Serves the page `render` writes at `/<name>`.
    pub fn register_page(&self, name: &'static str, render: Page) {
        self.with(|m| m.pages.insert(name, render));
    }

    /// The page registered as `name`, rendered now.
    pub fn page(&self, name: &str) -> Option<String> {
        let render = self.with(|m| m.pages.get(name).cloned())?;
        Some(render())
    }

    /// The health endpoints' answer: `/livez` and `/healthz` 503 when a controller task died or
    /// hangs, `/readyz` 503 also until the first complete sync (see `health`). Never because of
    /// the API server: its reachability is reported in the body only.
    pub fn health(&self, readiness: bool) -> (bool, String) {
        let (health, detail, api, api_contact) = self.with(|m| {
            let detail: BTreeMap<&str, f64> =
                m.heartbeats.iter().map(|(k, t)| (*k, t.elapsed().as_secs_f64())).collect();
            // "unknown" until the API has answered once (or with no API at all, --service-file).
            let api = match (m.api_reachable, m.last_api_contact_unix) {
                (true, _) => "reachable",
                (false, None) => "unknown",
                (false, Some(_)) => "unreachable",
            };
            (m.health.clone(), detail, api, m.last_api_contact_unix.map(|t| (unix_now() - t).round()))
        });
        let verdict = health.check();
        let ok = if readiness { verdict.ready } else { verdict.live };
        let status = match (ok, verdict.live) {
            (true, _) => "ok",
            (false, true) => "not ready",
            (false, false) => "failed",
        };
        let body = serde_json::json!({
            "status": status,
            "ready": verdict.ready,
            "problems": verdict.problems,
            "api": api,
            "seconds_since_api_contact": api_contact,
            "seconds_since_heartbeat": detail,
        })
        .to_string();
        (ok, body)
    }
}

/// The agent's HTTP servers' refused connections and failed accepts.
fn render_http_families(out: &mut String, m: &MetricsState) {
    family(
        out,
        "kube_router_http_connections_rejected_total",
        "counter",
        "Connections to the agent's HTTP servers closed unanswered, by server and reason (a limit, or a timeout).",
    );
    for ((server, reason), n) in &m.http_rejected {
        let _ =
            writeln!(out, "kube_router_http_connections_rejected_total{{server=\"{server}\",reason=\"{reason}\"}} {n}");
    }
    family(
        out,
        "kube_router_http_accept_errors_total",
        "counter",
        "Failed accept() calls of the agent's HTTP servers, by server and error (each followed by a short backoff).",
    );
    for ((server, error), n) in &m.http_accept_errors {
        let _ = writeln!(out, "kube_router_http_accept_errors_total{{server=\"{server}\",error=\"{error}\"}} {n}");
    }
}

/// The families under kube-router's own names (kube-router's dashboard reads these).
fn render_kube_router_names(out: &mut String, m: &MetricsState) {
    use crate::kr_metrics::{render_build_info, render_histogram};
    render_build_info(out);
    family(out, "kube_router_controller_ipvs_services", "gauge", "Number of ipvs services in the instance");
    let frontends = m.map_entries.get(kube_router_common::map_names::SERVICES).copied().unwrap_or(0);
    let _ = writeln!(out, "kube_router_controller_ipvs_services {frontends}");
    m.kr.render_services(out);
    for (name, help, h) in [
        (
            "kube_router_controller_ipvs_services_sync_time",
            "Time it took for controller to sync ipvs services",
            &m.kr.services_sync_time,
        ),
        ("kube_router_controller_ipvs_metrics_export_time", "Time it took to export metrics", &m.kr.stats_export_time),
        (
            "kube_router_controller_iptables_sync_time",
            "Time it took for controller to sync iptables",
            &m.kr.policy_sync_time,
        ),
        (
            "kube_router_controller_policy_chains_sync_time",
            "Time it took for controller to sync policy chains",
            &m.kr.policy_sync_time,
        ),
        (
            "kube_router_controller_bgp_internal_peers_sync_time",
            "Time it took to sync internal bgp peers",
            &m.kr.bgp_peers_sync_time,
        ),
        // One routing sync derives the peers and the routes together.
        (
            "kube_router_controller_routes_sync_time",
            "Time it took for controller to sync routes",
            &m.kr.bgp_peers_sync_time,
        ),
    ] {
        render_histogram(out, name, help, h);
    }
}

/// Serves the health endpoints (`/healthz`, `/livez`, `/readyz`) and nothing else: the
/// kubelet probes them on the node's address, where every pod reaches them too.
pub async fn serve_health(metrics: Metrics, listener: TcpListener) {
    let health = metrics.clone();
    let handler: crate::http::Handler = Arc::new(move |path| Some(health_response(&health, path)));
    crate::http::serve(listener, "health", crate::http::Limits::default(), metrics, handler).await
}

fn health_response(metrics: &Metrics, path: &str) -> Response {
    let readiness = match path {
        "/healthz" | "/livez" => false,
        "/readyz" => true,
        _ => return Response::new("404 Not Found", "text/plain", "not found\n".to_string()),
    };
    let (ok, body) = metrics.health(readiness);
    Response::new(if ok { "200 OK" } else { "503 Service Unavailable" }, "application/json", body)
}

/// Serves the metrics at `path`, the status pages (`/bgp`) and the health endpoints.
pub async fn serve_metrics(metrics: Metrics, listener: TcpListener, path: String) {
    let state = metrics.clone();
    let handler: crate::http::Handler = Arc::new(move |request| {
        Some(if request == path {
            Response::new("200 OK", "text/plain; version=0.0.4", state.render())
        } else if let Some(text) = state.page(request.trim_start_matches('/')) {
            Response::new("200 OK", "text/plain", text)
        } else {
            health_response(&state, request)
        })
    });
    crate::http::serve(listener, "metrics", crate::http::Limits::default(), metrics, handler).await
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::map_writes::OpCounts;

    /// A minimal Prometheus text-format reader: family -> type, and every sample's family.
    fn parse(text: &str) -> (BTreeMap<String, String>, Vec<(String, f64)>) {
        let mut types = BTreeMap::new();
        let mut samples = Vec::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').expect("TYPE name kind");
                types.insert(name.to_string(), kind.to_string());
            } else if !line.starts_with('#') && !line.is_empty() {
                let (series, value) = line.rsplit_once(' ').expect("sample value");
                let name = series.split('{').next().unwrap().to_string();
                samples.push((name, value.parse().expect("numeric value")));
            }
        }
        (types, samples)
    }

    #[test]
    fn every_sample_belongs_to_a_typed_family_with_the_documented_names() {
        let metrics = Metrics::default();
        let mut report = SyncReport::default();
        report.per_map.insert("svc_v4", OpCounts { inserts: 3, updates: 1, ..Default::default() });
        metrics.with(|m| m.record_sync(&report, Duration::from_millis(3), true));
        let (types, samples) = parse(&metrics.render());
        for (name, _) in &samples {
            let family = name.trim_end_matches("_bucket").trim_end_matches("_sum").trim_end_matches("_count");
            assert!(types.contains_key(name) || types.contains_key(family), "{name} has no TYPE");
        }
        assert_eq!(types["kube_router_map_writes_total"], "counter");
        assert_eq!(types["kube_router_sync_duration_seconds"], "histogram");
        assert_eq!(types["kube_router_api_reachable"], "gauge");
        assert_eq!(types["kube_router_seconds_since_last_sync"], "gauge");
        assert!(samples.contains(&("kube_router_map_writes_total".into(), 3.0)));
        assert!(samples.contains(&("kube_router_sync_duration_seconds_count".into(), 1.0)));
        assert!(samples.contains(&("kube_router_service_complete_syncs_total".into(), 1.0)));
        assert!(metrics.render().contains("kube_router_map_writes_total{map=\"svc_v4\",op=\"update\"} 1"));
    }

    /// Every family the agent can export, each rendered at least once.
    fn every_family() -> BTreeMap<String, String> {
        let metrics = Metrics::default();
        metrics.with(|m| {
            m.policy_packets = vec![("allowed", 1)];
            m.socket_lb_events = vec![("connect", 1)];
            m.overlay_packets = vec![("encapsulated", 1)];
            m.policy_sync_seconds = Some(0.1);
            m.checkpoint_write_seconds = Some(0.1);
        });
        let mut text = metrics.render();
        crate::router::render_bgp_families(&mut text, &crate::bgp::speaker::SpeakerStatus::default());
        let (_, status) = tokio::sync::watch::channel(crate::runtime::Status::default());
        crate::runtime::render_families(&mut text, &[("services", status)]);
        parse(&text).0
    }

    /// The names docs/metrics.md lists (first column of its tables), with its type.
    fn documented_names() -> BTreeMap<String, String> {
        let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/metrics.md")).unwrap();
        page.lines()
            .filter_map(|line| {
                let mut cells = line.strip_prefix("| `")?.split('|');
                let name = cells.next()?.trim().trim_end_matches('`');
                (name.starts_with("kube_router_") || name.starts_with("process_"))
                    .then(|| Some((name.to_string(), cells.next()?.trim().to_string())))?
            })
            .collect()
    }

    #[test]
    fn the_exported_names_and_types_are_exactly_the_ones_the_metrics_page_lists() {
        let (exported, listed) = (every_family(), documented_names());
        let missing: Vec<_> = exported.iter().filter(|(n, t)| listed.get(*n) != Some(t)).collect();
        let extra: Vec<_> = listed.keys().filter(|n| !exported.contains_key(*n)).collect();
        assert!(
            missing.is_empty() && extra.is_empty(),
            "not (or wrongly) in docs/metrics.md: {missing:?}; only there: {extra:?}"
        );
        // Every name kube-router's own dashboard (dashboard/kube-router.json) queries, and the
        // process families its alerts commonly use.
        for name in [
            "kube_router_build_info",
            "kube_router_controller_bgp_advertisements_received",
            "kube_router_controller_bgp_advertisements_sent",
            "kube_router_controller_bgp_internal_peers_sync_time",
            "kube_router_controller_bgp_peers",
            "kube_router_controller_iptables_sync_time",
            "kube_router_controller_ipvs_metrics_export_time",
            "kube_router_controller_ipvs_services",
            "kube_router_controller_ipvs_services_sync_time",
            "kube_router_controller_policy_chains_sync_time",
            "kube_router_controller_routes_sync_time",
            "kube_router_service_bps_in",
            "kube_router_service_bps_out",
            "kube_router_service_bytes_in",
            "kube_router_service_bytes_out",
            "kube_router_service_cps",
            "kube_router_service_packets_in",
            "kube_router_service_packets_out",
            "kube_router_service_pps_in",
            "kube_router_service_pps_out",
            "kube_router_service_total_connections",
            "process_cpu_seconds_total",
            "process_resident_memory_bytes",
            "process_open_fds",
            "process_max_fds",
        ] {
            assert!(exported.contains_key(name), "{name}");
        }
    }

    /// Rendering works on a copy: a family that records into the metrics while it renders (as
    /// any controller may at that moment) does not wait for the scrape to end.
    #[test]
    fn rendering_does_not_hold_the_lock_the_controllers_record_under() {
        let metrics = Metrics::default();
        let recorder = metrics.clone();
        metrics.register_families(
            "records-while-rendering",
            Arc::new(move |out: &mut String| {
                let syncs = recorder.with(|m| {
                    m.syncs += 1;
                    m.syncs
                });
                let _ = writeln!(out, "# recorded {syncs}");
            }),
        );
        let (done, rendered) = std::sync::mpsc::channel();
        std::thread::spawn(move || done.send(metrics.render()).unwrap());
        let text = rendered.recv_timeout(Duration::from_secs(5)).expect("the render finished (no deadlock)");
        assert!(text.contains("# recorded 1"));
    }

    #[test]
    fn health_is_ok_even_when_the_api_is_unreachable() {
        let metrics = Metrics::default();
        metrics.with(|m| {
            m.last_api_contact_unix = Some(unix_now() - 100.0);
            m.api_reachable = false;
        });
        let (live, health) = metrics.health(false);
        assert!(live);
        let health: serde_json::Value = serde_json::from_str(&health).unwrap();
        assert_eq!(health["status"], "ok");
        assert_eq!(health["api"], "unreachable");
        assert!(health["seconds_since_api_contact"].as_f64().unwrap() >= 100.0);
    }
}
