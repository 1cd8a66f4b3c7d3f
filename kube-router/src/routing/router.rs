//! Pod routing: runs the BGP speaker from this node's configuration (Node objects or flags)
//! and keeps the kernel routes it learned.
//!
//! The speaker starts once this node's configuration is known (from the API, from the
//! checkpoint while the API is down, or from flags) and is then only ever *updated*: an API
//! outage leaves the last configuration, the sessions, the RIB and the kernel routes alone.
use std::{
    fmt::Write as _,
    net::{IpAddr, Ipv6Addr, SocketAddr},
    path::PathBuf,
    sync::Arc,
    time::Duration,
};

use anyhow::{Context, Result};
use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node;

use crate::{
    k8s::store::{Followed, ObjectKey},
    metrics::{AgentMetrics, Metrics, Subsystem},
    routing::bgp::{
        bfd::BfdConfig,
        fsm::State,
        message::{Family, Prefix},
        peers::{ExternalPeerFlag, GlobalSettings, NodeBgpConfig, NodeBgpView, PeerConfig, RouterIdSetting},
        policy::{ExportPolicy, ImportPolicy, OriginKind},
        speaker::{GracefulRestartSettings, Originated, PeerStatus, Policies, Speaker, SpeakerConfig, SpeakerStatus},
    },
    routing::fib::{netlink::NetlinkRoutes, resolve::Reachability, task::run_fib},
    routing::overlay::OverlayConfig,
};
use prometheus_client::encoding::DescriptorEncoder;

#[derive(Debug, Clone)]
pub struct RouterOptions {
    pub node_name: String,
    pub cluster_asn: u32,
    /// `--router-id`: overrides the Node-derived router id (a fixed one is needed without the API).
    pub router_id: RouterIdSetting,
    /// Overrides the Node's spec.podCIDRs (needed without the API).
    pub pod_cidrs: Option<Vec<IpNet>>,
    pub external_peers: Vec<ExternalPeerFlag>,
    /// `--nodes-full-mesh`.
    pub full_mesh: bool,
    /// `--enable-ibgp`.
    pub enable_ibgp: bool,
    /// `--peer-router-multihop-ttl`.
    pub multihop_ttl: Option<u8>,
    /// `--bgp-max-prefixes` (None: no limit).
    pub max_prefixes: Option<u32>,
    /// `--peer-router-ttl-security`.
    pub ttl_security: bool,
    /// `--advertise-pod-cidr` (to external peers; node peers always get it).
    pub advertise_pod_cidr: bool,
    /// `--override-nexthop`.
    pub override_next_hop: bool,
    /// `--bgp-accept-default`.
    pub accept_default: bool,
    /// `--enable-overlay` with `--overlay-type` and `--overlay-encap`.
    pub overlay: Option<OverlayConfig>,
    /// `--enable-bfd` with its timers: BFD for external peers.
    pub bfd: Option<BfdConfig>,
    /// `--bfd-port`.
    pub bfd_port: u16,
    pub bgp_port: u16,
    pub hold_time: Duration,
    pub graceful_restart: bool,
    pub graceful_restart_time: Duration,
    pub graceful_restart_deferral: Duration,
    pub route_protocol: u8,
    pub route_table: u32,
    pub state_dir: PathBuf,
    /// Which Service addresses to advertise: the VIPs come from `services::vips`, computed by
    /// whoever keeps the services catalog (`controllers::service_view`).
    pub advertise: AdvertiseServices,
    /// bpffs directory of the datapath (the overlay's programs and maps).
    pub bpf_root: PathBuf,
}

pub use crate::services::vips::{AdvertiseServices, ServiceVips};

fn prefixes_of(nets: &[IpNet], kind: OriginKind) -> impl Iterator<Item = Originated> + '_ {
    nets.iter().filter_map(move |net| Prefix::new(net.addr(), net.prefix_len()).ok().map(|p| (p, kind)))
}

/// Everything the speaker is told, compared as a whole so that an unchanged picture (an
/// unrelated Node or Service change) touches nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Applied {
    peers: Vec<PeerConfig>,
    prefixes: Vec<Originated>,
    policies: Policies,
}

pub struct BgpRouter {
    options: RouterOptions,
    /// The Nodes as far as BGP reads them, followed one change at a time.
    nodes: NodeBgpView,
    speaker: Option<Speaker>,
    applied: Option<Applied>,
    last_problem: Option<String>,
    last_warnings: Vec<String>,
    metrics: Metrics,
    routing_metrics: Arc<RoutingMetrics>,
    /// A speaker that failed to start: how often, and why (logged once per reason).
    failed_start: Option<FailedStart>,
    /// The speaker's families and page are registered with the metrics.
    registered: bool,
}

struct FailedStart {
    attempts: u32,
    error: String,
}

impl BgpRouter {
    pub fn new(options: RouterOptions, metrics: Metrics) -> Self {
        Self {
            nodes: NodeBgpView::new(settings_of(&options)),
            options,
            speaker: None,
            applied: None,
            last_problem: None,
            last_warnings: Vec::new(),
            routing_metrics: metrics.of(),
            metrics,
            failed_start: None,
            registered: false,
        }
    }

    fn policies(&self, config: &NodeBgpConfig, vips: &ServiceVips) -> Policies {
        Policies {
            import: ImportPolicy {
                accept_default: self.options.accept_default,
                service_vips: prefixes_of(&vips.all, OriginKind::ServiceVip).map(|(p, _)| p).collect(),
                custom_reject: config.custom_import_reject.clone(),
            },
            export: ExportPolicy {
                advertise_pod_cidr: self.options.advertise_pod_cidr,
                communities: config.communities.clone(),
                prepend: config.prepend,
                override_next_hop: self.options.override_next_hop,
            },
        }
    }

    /// Configuration from flags alone, for running without the API server.
    pub fn static_config(&self) -> Result<NodeBgpConfig> {
        let RouterIdSetting::Fixed(router_id) = self.options.router_id else {
            anyhow::bail!("an IPv4 or IPv6 --router-id is needed to run BGP without the API server");
        };
        let settings = settings_of(&self.options);
        let peers = self.options.external_peers.iter().map(|p| p.external_peer_config(&settings)).collect();
        Ok(NodeBgpConfig {
            router_id,
            local_asn: self.options.cluster_asn,
            local_address: Some(IpAddr::V4(router_id)),
            ipv6_address: None,
            pod_cidrs: self.options.pod_cidrs.clone().unwrap_or_default(),
            peers,
            route_reflector: crate::routing::bgp::peers::RrRole::None,
            listen_addresses: Vec::new(),
            prepend: None,
            communities: Vec::new(),
            custom_import_reject: Vec::new(),
            warnings: Vec::new(),
        })
    }

    /// Follows the Node changes and derives the configuration again, with the Service VIPs as
    /// the services catalog has them. A problem (this node not found yet, a broken annotation
    /// on it) is logged once and changes nothing. An error: the speaker could not start (to be
    /// tried again).
    pub async fn update_from_nodes(&mut self, nodes: Followed<Node>, vips: &ServiceVips) -> Result<()> {
        // The shared objects as they are: no copy of any Node, and only the changed ones read.
        match nodes {
            Followed::All(nodes) => self.nodes.replace_all(nodes),
            Followed::Changed(changed) => {
                for (ObjectKey { name, .. }, node) in changed {
                    self.nodes.set_node(&name, node);
                }
            }
        }
        match self.nodes.config() {
            Ok(mut config) => {
                self.last_problem = None;
                let warnings: Vec<String> = config.warnings.iter().map(ToString::to_string).collect();
                if warnings != self.last_warnings {
                    for warning in warnings.iter().filter(|w| !self.last_warnings.contains(w)) {
                        tracing::warn!(%warning, "BGP peer configuration");
                    }
                    self.last_warnings = warnings;
                }
                if let Some(cidrs) = &self.options.pod_cidrs {
                    config.pod_cidrs = cidrs.clone();
                }
                self.apply(config, vips.clone()).await
            }
            Err(e) => {
                let problem = e.to_string();
                if self.last_problem.as_ref() != Some(&problem) {
                    tracing::warn!(error = %problem, "BGP configuration from Node objects unavailable; routing left as it is");
                    self.metrics.of::<AgentMetrics>().reject("Node");
                    self.last_problem = Some(problem);
                }
                Ok(())
            }
        }
    }

    /// Tells the speaker, starting it first if needed. An error: it could not start; the
    /// caller tries again later (the controller's runner, with backoff).
    pub async fn apply(&mut self, config: NodeBgpConfig, vips: ServiceVips) -> Result<()> {
        let mut prefixes: Vec<Originated> = prefixes_of(&config.pod_cidrs, OriginKind::PodCidr).collect();
        prefixes.extend(prefixes_of(&vips.advertised, OriginKind::ServiceVip));
        let wanted = Applied { peers: config.peers.clone(), prefixes, policies: self.policies(&config, &vips) };
        if self.applied.as_ref() == Some(&wanted) {
            return Ok(());
        }
        match &self.speaker {
            Some(speaker) => {
                speaker.set_policies(wanted.policies.clone());
                speaker.set_peers(wanted.peers.clone());
                speaker.set_prefixes(wanted.prefixes.clone());
            }
            None => match self.start(&config, &wanted).await {
                Ok(speaker) => {
                    if let Some(failed) = self.failed_start.take() {
                        tracing::info!(attempts = failed.attempts + 1, "BGP speaker started after failed attempts");
                    }
                    self.speaker = Some(speaker);
                }
                Err(e) => {
                    let error = format!("{e:#}");
                    let attempts = self.failed_start.as_ref().map_or(0, |f| f.attempts) + 1;
                    // Logged when the reason changes, not on every attempt.
                    if self.failed_start.as_ref().is_none_or(|f| f.error != error) {
                        tracing::error!(error = %error, "cannot start the BGP speaker; will retry with backoff");
                    }
                    self.failed_start = Some(FailedStart { attempts, error: error.clone() });
                    anyhow::bail!("BGP speaker not started: {error}");
                }
            },
        }
        self.applied = Some(wanted);
        Ok(())
    }

    /// The last attempt to start the speaker failed.
    pub fn start_failed(&self) -> bool {
        self.speaker.is_none() && self.failed_start.is_some()
    }

    pub fn routing_metrics(&self) -> &RoutingMetrics {
        &self.routing_metrics
    }

    async fn start(&self, config: &NodeBgpConfig, wanted: &Applied) -> Result<Speaker> {
        let o = &self.options;
        let routes = NetlinkRoutes::connect(o.route_protocol, o.route_table)?;
        let table = routes.list().await.context("listing kernel routes")?;
        let local = routes.local_addresses().await.context("listing the node's addresses")?;
        let mut speaker_config = SpeakerConfig::new(config.local_asn, config.router_id);
        speaker_config.listen = if config.listen_addresses.is_empty() {
            vec![SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), o.bgp_port)]
        } else {
            config.listen_addresses.iter().map(|a| SocketAddr::new(*a, o.bgp_port)).collect()
        };
        speaker_config.hold_time_secs = o.hold_time.as_secs().min(u64::from(u16::MAX)) as u16;
        speaker_config.families = vec![Family::Ipv4Unicast, Family::Ipv6Unicast];
        speaker_config.graceful_restart = o.graceful_restart.then(|| GracefulRestartSettings {
            restart_time: o.graceful_restart_time,
            stale_path_time: Duration::from_secs(360),
            selection_deferral: o.graceful_restart_deferral,
        });
        speaker_config.ipv4_next_hop = match config.local_address {
            Some(IpAddr::V4(v4)) => Some(v4),
            _ => Some(config.router_id),
        };
        speaker_config.ipv6_next_hop = match config.local_address {
            Some(IpAddr::V6(v6)) => Some(v6),
            _ => config.ipv6_address.or_else(first_global_ipv6),
        };
        speaker_config.state_dir = Some(o.state_dir.clone());
        speaker_config.overlay = o.overlay;
        speaker_config.bfd_port = o.bfd_port;
        speaker_config.reach = Some(Reachability::new(&table, &local));
        speaker_config.import = wanted.policies.import.clone();
        speaker_config.export = wanted.policies.export.clone();
        std::fs::create_dir_all(&o.state_dir).ok();
        tracing::info!(asn = config.local_asn, router_id = %config.router_id, peers = config.peers.len(),
            kept_routes = table.ours.len(), "starting BGP speaker");
        let (speaker, fib) =
            Speaker::start(speaker_config, wanted.peers.clone(), wanted.prefixes.clone(), table.ours).await?;
        tokio::spawn(run_fib(routes, fib, o.bpf_root.clone(), self.metrics.of()));
        Ok(speaker)
    }

    pub fn status(&self) -> Option<SpeakerStatus> {
        self.speaker.as_ref().map(Speaker::status)
    }

    pub fn publish_metrics(&mut self) {
        if let Some(speaker) = &self.speaker {
            if !self.registered {
                // Read fresh on every scrape and every request of /bgp.
                self.metrics.register_collector(SpeakerMetrics(speaker.clone()));
                let shown = speaker.clone();
                self.metrics.register_page("bgp", Arc::new(move || render_status(Some(&shown.status()))));
                let reported = speaker.clone();
                self.metrics.register_page(
                    "bgp.json",
                    Arc::new(move || crate::routing::bgp::report::BgpReport::page(Some(&reported.status()))),
                );
                self.registered = true;
            }
            self.metrics.heartbeat("bgp");
        }
        if self.options.overlay.is_some() {
            if let Ok(stats) = crate::routing::overlay::maps::read_stats(&self.options.bpf_root) {
                let names = kube_router_common::ovl_stat::NAMES;
                self.routing_metrics.set_overlay_packets(names.iter().copied().zip(stats).collect());
            }
        }
    }

    /// SIGTERM: with graceful restart, peers keep our routes; kernel routes always stay.
    pub async fn shutdown(&self) {
        if let Some(speaker) = &self.speaker {
            speaker.shutdown(self.options.graceful_restart).await;
        }
    }
}

/// What the Node-derived configuration takes from the flags.
fn settings_of(options: &RouterOptions) -> GlobalSettings {
    GlobalSettings {
        node_name: options.node_name.clone(),
        cluster_asn: options.cluster_asn,
        enable_ibgp: options.enable_ibgp,
        full_mesh: options.full_mesh,
        multihop_ttl: options.multihop_ttl,
        bfd: options.bfd,
        max_prefixes: options.max_prefixes,
        ttl_security: options.ttl_security,
        external_peers: options.external_peers.clone(),
        peer_port: options.bgp_port,
        // Node peers always get the pod CIDRs; --advertise-pod-cidr is export policy.
        advertise_pod_cidr: true,
        router_id: options.router_id,
    }
}

fn first_global_ipv6() -> Option<Ipv6Addr> {
    let text = std::fs::read_to_string("/proc/net/if_inet6").ok()?;
    text.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let hex = fields.next()?;
        let scope = fields.nth(2)?;
        (scope == "00").then(|| u128::from_str_radix(hex, 16).ok().map(Ipv6Addr::from)).flatten()
    })
}

/// The routing controller's metrics: its sync time, and the overlay's counters. The BGP
/// speaker's families are a collector of its own ([`SpeakerMetrics`]), registered when it starts.
#[derive(Debug)]
pub struct RoutingMetrics {
    /// BGP peers and routes from Node objects (kube-router: internal peers sync, routes sync).
    pub sync_time: prometheus_client::metrics::histogram::Histogram,
    /// `ovl_stats` counters, summed over CPUs (once the overlay is in use).
    overlay_packets: std::sync::Mutex<Vec<(&'static str, u64)>>,
}

impl Default for RoutingMetrics {
    fn default() -> Self {
        Self { sync_time: crate::exposition::sync_histogram(), overlay_packets: Default::default() }
    }
}

impl RoutingMetrics {
    pub fn set_overlay_packets(&self, counters: Vec<(&'static str, u64)>) {
        *self.overlay_packets.lock().unwrap_or_else(|p| p.into_inner()) = counters;
    }
}

impl Subsystem for RoutingMetrics {
    fn register(this: &Arc<Self>, registry: &mut prometheus_client::registry::Registry) {
        use crate::exposition::register;
        register(
            registry,
            "kube_router_controller_bgp_internal_peers_sync_time",
            "Time it took to sync internal bgp peers",
            this.sync_time.clone(),
        );
        // One routing sync derives the peers and the routes together.
        register(
            registry,
            "kube_router_controller_routes_sync_time",
            "Time it took for controller to sync routes",
            this.sync_time.clone(),
        );
        registry.register_collector(Box::new(this.clone()));
    }
}

impl prometheus_client::collector::Collector for RoutingMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let overlay = self.overlay_packets.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if overlay.is_empty() {
            return Ok(());
        }
        crate::exposition::counters_by(
            &mut encoder,
            "kube_router_overlay_packets_total",
            "Pod overlay datapath events (ovl_stats), summed over CPUs.",
            "event",
            &overlay,
        )
    }
}

/// The speaker's families, read from its status on every scrape.
struct SpeakerMetrics(Speaker);

impl std::fmt::Debug for SpeakerMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SpeakerMetrics")
    }
}

impl prometheus_client::collector::Collector for SpeakerMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        encode_bgp_families(&mut encoder, &self.0.status())
    }
}

/// The BGP sessions' metric families, under our names and kube-router's, and the FIB task's.
pub fn encode_bgp_families(encoder: &mut DescriptorEncoder, status: &SpeakerStatus) -> std::fmt::Result {
    encode_session_families(encoder, status)?;
    crate::kr_metrics::encode_bgp(encoder, status)
}

fn encode_session_families(encoder: &mut DescriptorEncoder, bgp: &SpeakerStatus) -> std::fmt::Result {
    use crate::exposition::{series, single, Value};
    use prometheus_client::metrics::MetricType::{Counter, Gauge};
    let peer = |p: &PeerStatus| [("peer", p.address.to_string())];
    series(
        encoder,
        "kube_router_bgp_session_established",
        "1 if the BGP session with the peer is Established.",
        Gauge,
        bgp.peers.iter().map(|p| {
            let up = i64::from(p.state == State::Established);
            (Some([("peer", p.address.to_string()), ("asn", p.asn.to_string())]), Value::IntGauge(up))
        }),
    )?;
    series(
        encoder,
        "kube_router_bgp_session_state",
        "BGP FSM state of each peer (the current state has value 1).",
        Gauge,
        bgp.peers.iter().map(|p| {
            (Some([("peer", p.address.to_string()), ("state", format!("{:?}", p.state))]), Value::IntGauge(1))
        }),
    )?;
    type Pick = fn(&PeerStatus) -> Value;
    let per_peer: [(&str, &str, prometheus_client::metrics::MetricType, Pick); 11] = [
        ("kube_router_bgp_prefixes_received", "Prefixes in the peer's Adj-RIB-In.", Gauge, |p| {
            Value::IntGauge(p.prefixes_received as i64)
        }),
        ("kube_router_bgp_prefixes_stale", "Prefixes kept as stale while the peer restarts.", Gauge, |p| {
            Value::IntGauge(p.prefixes_stale as i64)
        }),
        ("kube_router_bgp_prefixes_advertised", "Prefixes in the peer's Adj-RIB-Out.", Gauge, |p| {
            Value::IntGauge(p.prefixes_advertised as i64)
        }),
        (
            "kube_router_bgp_prefixes_rejected",
            "Prefixes of the peer the import policy refuses (kept, unused).",
            Gauge,
            |p| Value::IntGauge(p.prefixes_rejected as i64),
        ),
        (
            "kube_router_bgp_prefixes_unresolved",
            "Prefixes of the peer whose next hop does not resolve (kept, unused).",
            Gauge,
            |p| Value::IntGauge(p.prefixes_unresolved as i64),
        ),
        ("kube_router_bgp_updates_received_total", "UPDATE messages received.", Counter, |p| {
            Value::Counter(p.updates_received)
        }),
        ("kube_router_bgp_notifications_received_total", "NOTIFICATION messages received.", Counter, |p| {
            Value::Counter(p.notifications_received)
        }),
        ("kube_router_bgp_notifications_sent_total", "NOTIFICATION messages sent.", Counter, |p| {
            Value::Counter(p.notifications_sent)
        }),
        (
            "kube_router_bgp_max_prefixes_exceeded_total",
            "Sessions closed because the peer sent more prefixes than its limit (Cease 1, RFC 4486).",
            Counter,
            |p| Value::Counter(u64::from(p.max_prefix_violations)),
        ),
        (
            "kube_router_bgp_updates_treated_as_withdraw_total",
            "UPDATEs with a malformed attribute whose prefixes were treated as withdrawn, the session kept (RFC 7606).",
            Counter,
            |p| Value::Counter(p.updates_treated_as_withdraw),
        ),
        (
            "kube_router_bgp_bfd_up",
            "1 if the BFD session watching the peer is Up (BFD peers only).",
            Gauge,
            // Filtered below: BFD peers only.
            |p| Value::IntGauge(i64::from(p.bfd_up == Some(true))),
        ),
    ];
    for (name, help, metric_type, pick) in per_peer {
        let bfd_only = name == "kube_router_bgp_bfd_up";
        let peers = bgp.peers.iter().filter(|p| !bfd_only || p.bfd_up.is_some());
        series(encoder, name, help, metric_type, peers.map(|p| (Some(peer(p)), pick(p))))?;
    }
    single(
        encoder,
        "kube_router_bgp_malformed_messages_total",
        "Malformed BGP messages received (RFC 7606 handling).",
        &Value::Counter(bgp.malformed_messages),
    )?;
    single(
        encoder,
        "kube_router_bgp_ignored_nlri_total",
        "UPDATE parts ignored with the session kept: NLRI of families we do not route, unrepresentable prefixes.",
        &Value::Counter(bgp.ignored_nlri),
    )?;
    series(
        encoder,
        "kube_router_bfd_packets_dropped_total",
        "BFD control packets dropped: reason ttl = IP TTL / hop limit not 255 (not from a directly connected neighbour).",
        Counter,
        [(Some([("reason", "ttl")]), Value::Counter(bgp.bfd_ttl_dropped))],
    )?;
    series(
        encoder,
        "kube_router_bgp_routes_rejected_total",
        "Paths refused by the import policy, per reason.",
        Counter,
        bgp.rejections.iter().map(|(peer, reason, n)| {
            (Some([("peer", peer.to_string()), ("reason", reason.label().to_string())]), Value::Counter(*n))
        }),
    )?;
    single(
        encoder,
        "kube_router_bgp_routes",
        "Prefixes in the Loc-RIB (best paths, local and learned).",
        &Value::IntGauge(bgp.loc_rib_size as i64),
    )
}

/// Human-readable neighbors and routes, served on /bgp and printed by `kube-router bgp`.
pub fn render_status(status: Option<&SpeakerStatus>) -> String {
    let Some(status) = status else {
        return "BGP speaker not running\n".to_string();
    };
    let mut out = String::new();
    let _ = writeln!(
        out,
        "local AS {} router-id {}{}",
        status.local_asn,
        status.router_id.map(|r| r.to_string()).unwrap_or_default(),
        if status.deferring { " (waiting for peers' End-of-RIB)" } else { "" }
    );
    let _ = writeln!(
        out,
        "{:<40} {:>10} {:<12} {:>8} {:>8} {:>6} {:>8} {:>8}",
        "neighbor", "AS", "state", "up(s)", "recv", "stale", "sent", "refused"
    );
    for p in &status.peers {
        let _ = writeln!(
            out,
            "{:<40} {:>10} {:<12} {:>8} {:>8} {:>6} {:>8} {:>8}{}",
            p.address,
            p.asn,
            format!("{:?}", p.state),
            p.established_at.map(|t| t.elapsed().as_secs().to_string()).unwrap_or_else(|| "-".into()),
            p.prefixes_received,
            p.prefixes_stale,
            p.prefixes_advertised,
            p.prefixes_rejected,
            p.last_error
                .as_ref()
                .filter(|_| p.state != State::Established)
                .map(|e| format!("  ({e})"))
                .unwrap_or_default()
        );
    }
    let _ = writeln!(out, "routes:");
    for route in status.loc_rib.iter() {
        let _ = writeln!(
            out,
            "  {:<43} via {:<39} {}",
            route.prefix,
            route.next_hop,
            route.from.map(|f| format!("from {f}")).unwrap_or_else(|| "local".into())
        );
    }
    out
}
