//! Pod routing: runs the BGP speaker from this node's configuration (Node objects or flags)
//! and keeps the kernel routes it learned.
//!
//! The speaker starts once this node's configuration is known (from the API, from the
//! checkpoint while the API is down, or from flags) and is then only ever *updated*: an API
//! outage leaves the last configuration, the sessions, the RIB and the kernel routes alone.
use std::{
    collections::BTreeSet,
    fmt::Write as _,
    net::{IpAddr, Ipv6Addr, SocketAddr},
    path::PathBuf,
    sync::Arc,
    time::Duration,
};

use anyhow::{Context, Result};
use ipnet::IpNet;
use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};

use crate::{
    bgp::{
        bfd::BfdConfig,
        fsm::State,
        message::{Family, Prefix},
        peers::{node_bgp_config, ExternalPeerFlag, GlobalSettings, NodeBgpConfig, PeerConfig, RouterIdSetting},
        policy::{ExportPolicy, ImportPolicy, OriginKind},
        speaker::{run_fib, GracefulRestartSettings, Originated, Policies, Speaker, SpeakerConfig, SpeakerStatus},
    },
    fib::{netlink::NetlinkRoutes, resolve::Reachability},
    metrics::{family, Metrics},
    overlay::OverlayConfig,
    services::model::ExternalIpPolicy,
};

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
    pub advertise: AdvertiseServices,
    /// The service proxy's external IP validation: an externalIP or LoadBalancer IP it refuses
    /// is never advertised (nor kept from import as a VIP). Every Node's addresses and the API
    /// server's endpoints are added as the objects come.
    pub external_ips: ExternalIpPolicy,
    /// bpffs directory of the datapath (the overlay's programs and maps).
    pub bpf_root: PathBuf,
}

/// Which Service addresses every node advertises as host routes (kube-router's
/// `--advertise-cluster-ip`, `--advertise-external-ip`, `--advertise-loadbalancer-ip`). A
/// Service can turn each off with the annotation `kube-router.io/service.advertise.<kind>:
/// "false"`; "true" turns one on only with `annotations_override`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AdvertiseServices {
    pub cluster_ip: bool,
    pub external_ip: bool,
    pub load_balancer_ip: bool,
    /// `--service-advertise-annotations-override`: "true" annotations widen the flags.
    pub annotations_override: bool,
}

impl AdvertiseServices {
    /// Some Service address may be advertised (the Services are worth watching).
    pub fn any(&self) -> bool {
        self.cluster_ip || self.external_ip || self.load_balancer_ip || self.annotations_override
    }
}

/// Service VIPs as host prefixes (/32, /128), sorted, without duplicates.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServiceVips {
    /// What this node advertises.
    pub advertised: Vec<IpNet>,
    /// Every VIP the cluster advertises from some node (never imported from a peer).
    pub all: Vec<IpNet>,
}

/// Where this node stands for Services with a local traffic policy.
pub struct LocalEndpoints<'a> {
    pub node_name: &'a str,
    /// The node's own addresses (an endpoint without nodeName is local if it is one of them).
    pub node_addresses: &'a BTreeSet<IpAddr>,
    /// The EndpointSlices of a Service (namespace, name); more are ignored. Asked only for the
    /// Services with a local traffic policy: the agent keeps the slices packed and decodes
    /// those alone.
    pub slices_of: &'a (dyn Fn(&str, &str) -> Vec<EndpointSlice> + Sync),
}

impl LocalEndpoints<'_> {
    /// A ready endpoint of the Service runs on this node.
    fn has_ready(&self, service: &Service) -> bool {
        let namespace = service.metadata.namespace.as_deref().unwrap_or("default");
        let name = service.metadata.name.as_deref().unwrap_or("");
        (self.slices_of)(namespace, name)
            .iter()
            .filter(|slice| slice.metadata.namespace.as_deref().unwrap_or("default") == namespace)
            .filter(|slice| {
                slice.metadata.labels.as_ref().and_then(|l| l.get("kubernetes.io/service-name")).map(String::as_str)
                    == Some(name)
            })
            .flat_map(|slice| slice.endpoints.iter())
            // An unset ready condition means ready (the API's documented default).
            .filter(|endpoint| endpoint.conditions.as_ref().and_then(|c| c.ready) != Some(false))
            .any(|endpoint| match &endpoint.node_name {
                Some(node) => node == self.node_name,
                None => endpoint
                    .addresses
                    .iter()
                    .any(|a| a.parse::<IpAddr>().is_ok_and(|a| self.node_addresses.contains(&a))),
            })
    }
}

/// The Service addresses to advertise. With `externalTrafficPolicy: Local` (or kube-router's
/// `kube-router.io/service.local: "true"`) a Service's external and LoadBalancer IPs, and with
/// `internalTrafficPolicy: Local` its ClusterIPs, come only from nodes running a ready endpoint
/// of it: a node without one would drop or forward the traffic (kube-router does the same).
/// Headless Services (clusterIP None) and unparsable addresses contribute nothing, nor do
/// externalIPs and LoadBalancer IPs `external_ips` refuses (the service proxy's own check).
pub fn service_vips<'a>(
    services: impl Iterator<Item = &'a Service>,
    advertise: AdvertiseServices,
    external_ips: &ExternalIpPolicy,
    local: &LocalEndpoints<'_>,
) -> ServiceVips {
    let mut advertised = BTreeSet::new();
    let mut all = BTreeSet::new();
    for service in services {
        let annotations = service.metadata.annotations.as_ref();
        let annotation = |key: &str| annotations.and_then(|a| a.get(key)).map(String::as_str);
        let wants = |kind: &str, default: bool| match annotation(&format!("kube-router.io/service.advertise.{kind}")) {
            Some("true") => default || advertise.annotations_override,
            Some("false") => false,
            _ => default,
        };
        let spec = service.spec.as_ref();
        let external_local = spec.and_then(|s| s.external_traffic_policy.as_deref()) == Some("Local")
            || annotation("kube-router.io/service.local") == Some("true");
        let internal_local = spec.and_then(|s| s.internal_traffic_policy.as_deref()) == Some("Local");
        let mut has_local = None;
        let mut local_ready = || *has_local.get_or_insert_with(|| local.has_ready(service));
        let parse = |a: &String| a.parse::<IpAddr>().ok().map(IpNet::from);
        let accepted =
            |load_balancer: bool| move |net: &IpNet| external_ips.refusal(net.addr(), load_balancer).is_none();
        let mut add = |addresses: Vec<IpNet>, needs_local: bool, local_ready: &mut dyn FnMut() -> bool| {
            if addresses.is_empty() {
                return;
            }
            all.extend(addresses.iter().copied());
            if !needs_local || local_ready() {
                advertised.extend(addresses);
            }
        };
        if wants("clusterip", advertise.cluster_ip) {
            let mut ips: Vec<IpNet> =
                spec.and_then(|s| s.cluster_ips.as_ref()).into_iter().flatten().filter_map(parse).collect();
            ips.extend(spec.and_then(|s| s.cluster_ip.as_ref()).and_then(parse));
            add(ips, internal_local, &mut local_ready);
        }
        if wants("externalip", advertise.external_ip) {
            let ips = spec
                .and_then(|s| s.external_ips.as_ref())
                .into_iter()
                .flatten()
                .filter_map(parse)
                .filter(accepted(false))
                .collect();
            add(ips, external_local, &mut local_ready);
        }
        // skiplbips: the LoadBalancer IPs are not served here, so not advertised (as upstream).
        let skip_lb_ips = annotation(crate::services::from_k8s::SKIP_LB_IPS_ANNOTATION).is_some();
        if wants("loadbalancerip", advertise.load_balancer_ip) && !skip_lb_ips {
            let ingress =
                service.status.as_ref().and_then(|s| s.load_balancer.as_ref()).and_then(|l| l.ingress.as_ref());
            let ips = ingress
                .into_iter()
                .flatten()
                .filter_map(|i| i.ip.as_ref())
                .filter_map(parse)
                .filter(accepted(true))
                .collect();
            add(ips, external_local, &mut local_ready);
        }
    }
    ServiceVips { advertised: advertised.into_iter().collect(), all: all.into_iter().collect() }
}

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

pub struct RouterController {
    options: RouterOptions,
    speaker: Option<Speaker>,
    applied: Option<Applied>,
    last_problem: Option<String>,
    last_warnings: Vec<String>,
    metrics: Metrics,
    /// A speaker that failed to start: how often, and why (logged once per reason).
    failed_start: Option<FailedStart>,
    /// The speaker's families and page are registered with the metrics.
    registered: bool,
}

struct FailedStart {
    attempts: u32,
    error: String,
}

impl RouterController {
    pub fn new(options: RouterOptions, metrics: Metrics) -> Self {
        Self {
            options,
            speaker: None,
            applied: None,
            last_problem: None,
            last_warnings: Vec::new(),
            metrics,
            failed_start: None,
            registered: false,
        }
    }

    fn settings(&self) -> GlobalSettings {
        GlobalSettings {
            node_name: self.options.node_name.clone(),
            cluster_asn: self.options.cluster_asn,
            enable_ibgp: self.options.enable_ibgp,
            full_mesh: self.options.full_mesh,
            multihop_ttl: self.options.multihop_ttl,
            bfd: self.options.bfd,
            max_prefixes: self.options.max_prefixes,
            ttl_security: self.options.ttl_security,
            external_peers: self.options.external_peers.clone(),
            peer_port: self.options.bgp_port,
            // Node peers always get the pod CIDRs; --advertise-pod-cidr is export policy.
            advertise_pod_cidr: true,
            router_id: self.options.router_id,
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
        let settings = self.settings();
        let peers = self.options.external_peers.iter().map(|p| p.external_peer_config(&settings)).collect();
        Ok(NodeBgpConfig {
            router_id,
            local_asn: self.options.cluster_asn,
            local_address: Some(IpAddr::V4(router_id)),
            ipv6_address: None,
            pod_cidrs: self.options.pod_cidrs.clone().unwrap_or_default(),
            peers,
            route_reflector: crate::bgp::peers::RrRole::None,
            listen_addresses: Vec::new(),
            prepend: None,
            communities: Vec::new(),
            custom_import_reject: Vec::new(),
            warnings: Vec::new(),
        })
    }

    /// Re-derives the configuration from the Node, Service and EndpointSlice objects we know.
    /// A problem (this node not found yet, a broken annotation on it) is logged once and
    /// changes nothing. An error: the speaker could not start (to be tried again).
    pub async fn update_from_nodes<'a>(
        &mut self,
        nodes: impl Iterator<Item = &'a Node>,
        services: impl Iterator<Item = &'a Service>,
        slices_of: &(dyn Fn(&str, &str) -> Vec<EndpointSlice> + Sync),
    ) -> Result<()> {
        let nodes: Vec<Node> = nodes.cloned().collect();
        match node_bgp_config(&nodes, &self.settings()) {
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
                let me = nodes.iter().find(|n| n.metadata.name.as_deref() == Some(self.options.node_name.as_str()));
                let node_addresses: BTreeSet<IpAddr> = me
                    .and_then(|n| n.status.as_ref())
                    .and_then(|s| s.addresses.as_ref())
                    .into_iter()
                    .flatten()
                    .filter_map(|a| a.address.parse().ok())
                    .collect();
                let local =
                    LocalEndpoints { node_name: &self.options.node_name, node_addresses: &node_addresses, slices_of };
                let external_ips = self.options.external_ips.with_cluster_addresses(
                    nodes.iter().flat_map(crate::services::from_k8s::node_object_addresses),
                    crate::services::from_k8s::endpoint_addresses(&slices_of("default", "kubernetes")),
                );
                let vips = service_vips(services, self.options.advertise, &external_ips, &local);
                self.apply(config, vips).await
            }
            Err(e) => {
                let problem = e.to_string();
                if self.last_problem.as_ref() != Some(&problem) {
                    tracing::warn!(error = %problem, "BGP configuration from Node objects unavailable; routing left as it is");
                    self.metrics.with(|m| *m.rejected_objects.entry("Node").or_default() += 1);
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

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
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
        tokio::spawn(run_fib(routes, fib, o.bpf_root.clone()));
        Ok(speaker)
    }

    pub fn status(&self) -> Option<SpeakerStatus> {
        self.speaker.as_ref().map(Speaker::status)
    }

    pub fn publish_metrics(&mut self) {
        if let Some(speaker) = &self.speaker {
            if !self.registered {
                // Read fresh on every scrape and every request of /bgp.
                let scraped = speaker.clone();
                self.metrics.register_families(
                    "bgp",
                    Arc::new(move |out: &mut String| render_bgp_families(out, &scraped.status())),
                );
                let shown = speaker.clone();
                self.metrics.register_page("bgp", Arc::new(move || render_status(Some(&shown.status()))));
                let reported = speaker.clone();
                self.metrics.register_page(
                    "bgp.json",
                    Arc::new(move || crate::bgp::report::BgpReport::page(Some(&reported.status()))),
                );
                self.registered = true;
            }
            self.metrics.heartbeat("bgp");
        }
        if self.options.overlay.is_some() {
            if let Ok(stats) = crate::overlay::maps::read_stats(&self.options.bpf_root) {
                let names = kube_router_common::ovl_stat::NAMES;
                self.metrics.with(|m| m.overlay_packets = names.iter().copied().zip(stats).collect());
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

fn first_global_ipv6() -> Option<Ipv6Addr> {
    let text = std::fs::read_to_string("/proc/net/if_inet6").ok()?;
    text.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let hex = fields.next()?;
        let scope = fields.nth(2)?;
        (scope == "00").then(|| u128::from_str_radix(hex, 16).ok().map(Ipv6Addr::from)).flatten()
    })
}

/// The BGP sessions' metric families, under our names and kube-router's.
pub fn render_bgp_families(out: &mut String, status: &SpeakerStatus) {
    render_session_families(out, status);
    crate::kr_metrics::render_bgp(out, status);
}

fn render_session_families(out: &mut String, bgp: &SpeakerStatus) {
    family(out, "kube_router_bgp_session_established", "gauge", "1 if the BGP session with the peer is Established.");
    for p in &bgp.peers {
        let up = u8::from(p.state == State::Established);
        let _ = writeln!(out, "kube_router_bgp_session_established{{peer=\"{}\",asn=\"{}\"}} {up}", p.address, p.asn);
    }
    family(
        out,
        "kube_router_bgp_session_state",
        "gauge",
        "BGP FSM state of each peer (the current state has value 1).",
    );
    for p in &bgp.peers {
        let _ = writeln!(out, "kube_router_bgp_session_state{{peer=\"{}\",state=\"{:?}\"}} 1", p.address, p.state);
    }
    for (name, help, pick) in [
        ("kube_router_bgp_prefixes_received", "Prefixes in the peer's Adj-RIB-In.", 0),
        ("kube_router_bgp_prefixes_stale", "Prefixes kept as stale while the peer restarts.", 1),
        ("kube_router_bgp_prefixes_advertised", "Prefixes in the peer's Adj-RIB-Out.", 2),
        ("kube_router_bgp_prefixes_rejected", "Prefixes of the peer the import policy refuses (kept, unused).", 3),
        (
            "kube_router_bgp_prefixes_unresolved",
            "Prefixes of the peer whose next hop does not resolve (kept, unused).",
            4,
        ),
    ] {
        family(out, name, "gauge", help);
        for p in &bgp.peers {
            let n = [
                p.prefixes_received,
                p.prefixes_stale,
                p.prefixes_advertised,
                p.prefixes_rejected,
                p.prefixes_unresolved,
            ][pick];
            let _ = writeln!(out, "{name}{{peer=\"{}\"}} {n}", p.address);
        }
    }
    family(out, "kube_router_bgp_bfd_up", "gauge", "1 if the BFD session watching the peer is Up (BFD peers only).");
    for p in &bgp.peers {
        if let Some(up) = p.bfd_up {
            let _ = writeln!(out, "kube_router_bgp_bfd_up{{peer=\"{}\"}} {}", p.address, u8::from(up));
        }
    }
    for (name, help, pick) in [
        ("kube_router_bgp_updates_received_total", "UPDATE messages received.", 0),
        ("kube_router_bgp_notifications_received_total", "NOTIFICATION messages received.", 1),
        ("kube_router_bgp_notifications_sent_total", "NOTIFICATION messages sent.", 2),
        (
            "kube_router_bgp_max_prefixes_exceeded_total",
            "Sessions closed because the peer sent more prefixes than its limit (Cease 1, RFC 4486).",
            3,
        ),
    ] {
        family(out, name, "counter", help);
        for p in &bgp.peers {
            let n = [
                p.updates_received,
                p.notifications_received,
                p.notifications_sent,
                u64::from(p.max_prefix_violations),
            ][pick];
            let _ = writeln!(out, "{name}{{peer=\"{}\"}} {n}", p.address);
        }
    }
    family(
        out,
        "kube_router_bgp_malformed_messages_total",
        "counter",
        "Malformed BGP messages received (RFC 7606 handling).",
    );
    let _ = writeln!(out, "kube_router_bgp_malformed_messages_total {}", bgp.malformed_messages);
    family(
        out,
        "kube_router_bgp_ignored_nlri_total",
        "counter",
        "UPDATE parts ignored with the session kept: NLRI of families we do not route, unrepresentable prefixes.",
    );
    let _ = writeln!(out, "kube_router_bgp_ignored_nlri_total {}", bgp.ignored_nlri);
    family(
        out,
        "kube_router_bfd_packets_dropped_total",
        "counter",
        "BFD control packets dropped: reason ttl = IP TTL / hop limit not 255 (not from a directly connected neighbour).",
    );
    let _ = writeln!(out, "kube_router_bfd_packets_dropped_total{{reason=\"ttl\"}} {}", bgp.bfd_ttl_dropped);
    family(out, "kube_router_bgp_routes_rejected_total", "counter", "Paths refused by the import policy, per reason.");
    for (peer, reason, n) in &bgp.rejections {
        let _ =
            writeln!(out, "kube_router_bgp_routes_rejected_total{{peer=\"{peer}\",reason=\"{}\"}} {n}", reason.label());
    }
    family(out, "kube_router_bgp_routes", "gauge", "Prefixes in the Loc-RIB (best paths, local and learned).");
    let _ = writeln!(out, "kube_router_bgp_routes {}", bgp.loc_rib_size);
    let fib = &bgp.fib;
    for (name, kind, help, n) in [
        (
            "kube_router_bgp_route_conflicts",
            "gauge",
            "Learned destinations not installed because another route (not ours) already claims them.",
            fib.conflicts as u64,
        ),
        ("kube_router_bgp_route_conflicts_total", "counter", "Route conflicts seen (each once).", fib.conflicts_total),
        (
            "kube_router_bgp_routes_refused",
            "gauge",
            "Learned routes the kernel refused, waiting for a retry.",
            fib.refused as u64,
        ),
        ("kube_router_bgp_route_refusals_total", "counter", "Kernel route writes refused.", fib.refusals_total),
    ] {
        family(out, name, kind, help);
        let _ = writeln!(out, "{name} {n}");
    }
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
    for (prefix, next_hop, from) in &status.loc_rib {
        let _ = writeln!(
            out,
            "  {prefix:<43} via {next_hop:<39} {}",
            from.map(|f| format!("from {f}")).unwrap_or_else(|| "local".into())
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service(value: serde_json::Value) -> Service {
        serde_json::from_value(value).unwrap()
    }

    fn slice(value: serde_json::Value) -> EndpointSlice {
        serde_json::from_value(value).unwrap()
    }

    fn advertised(services: &[Service], advertise: AdvertiseServices, slices: &[EndpointSlice]) -> Vec<String> {
        let addresses = BTreeSet::from(["192.168.0.1".parse().unwrap()]);
        let local =
            LocalEndpoints { node_name: "node-1", node_addresses: &addresses, slices_of: &|_, _| slices.to_vec() };
        service_vips(services.iter(), advertise, &ExternalIpPolicy::default(), &local)
            .advertised
            .iter()
            .map(|n| n.to_string())
            .collect()
    }

    #[test]
    fn service_addresses_follow_the_flags_and_the_per_service_annotations() {
        let services = [
            service(serde_json::json!({"metadata": {"name": "web"},
                "spec": {"clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10", "fd00:96::10"], "externalIPs": ["192.0.2.7"]},
                "status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.1"}, {"hostname": "lb.example"}]}}})),
            service(serde_json::json!({"metadata": {"name": "headless"}, "spec": {"clusterIP": "None"}})),
            service(serde_json::json!({"metadata": {"name": "private",
                    "annotations": {"kube-router.io/service.advertise.clusterip": "false"}},
                "spec": {"clusterIP": "10.96.0.20"}})),
            service(serde_json::json!({"metadata": {"name": "opt-in",
                    "annotations": {"kube-router.io/service.advertise.externalip": "true"}},
                "spec": {"clusterIP": "10.96.0.30", "externalIPs": ["192.0.2.30"]}})),
        ];
        // "true" annotations widen the flags only when the operator lets them.
        assert!(advertised(&services, AdvertiseServices::default(), &[]).is_empty());
        let override_on = AdvertiseServices { annotations_override: true, ..Default::default() };
        assert_eq!(advertised(&services, override_on, &[]), ["192.0.2.30/32"]);
        let cluster = AdvertiseServices { cluster_ip: true, annotations_override: true, ..Default::default() };
        assert_eq!(
            advertised(&services, cluster, &[]),
            ["10.96.0.10/32", "10.96.0.30/32", "192.0.2.30/32", "fd00:96::10/128"]
        );
        let all =
            AdvertiseServices { cluster_ip: true, external_ip: true, load_balancer_ip: true, ..Default::default() };
        assert_eq!(
            advertised(&services, all, &[]),
            ["10.96.0.10/32", "10.96.0.30/32", "192.0.2.7/32", "192.0.2.30/32", "198.51.100.1/32", "fd00:96::10/128"]
        );
    }

    #[test]
    fn local_traffic_policy_vips_come_only_from_nodes_with_a_ready_local_endpoint() {
        let services = [service(serde_json::json!({"metadata": {"namespace": "shop", "name": "web"},
            "spec": {"clusterIP": "10.96.0.10", "externalIPs": ["192.0.2.7"], "externalTrafficPolicy": "Local"},
            "status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.1"}]}}}))];
        let all =
            AdvertiseServices { cluster_ip: true, external_ip: true, load_balancer_ip: true, ..Default::default() };
        let endpoints = |node: &str, ready: bool| {
            slice(serde_json::json!({"metadata": {"namespace": "shop", "name": "web-1",
                    "labels": {"kubernetes.io/service-name": "web"}},
                "addressType": "IPv4",
                "endpoints": [{"addresses": ["10.244.1.5"], "nodeName": node, "conditions": {"ready": ready}}]}))
        };
        // No endpoint here: only the ClusterIP (cluster-wide policy) is advertised.
        assert_eq!(advertised(&services, all, &[endpoints("node-2", true)]), ["10.96.0.10/32"]);
        assert_eq!(advertised(&services, all, &[endpoints("node-1", false)]), ["10.96.0.10/32"], "not ready");
        assert_eq!(
            advertised(&services, all, &[endpoints("node-1", true)]),
            ["10.96.0.10/32", "192.0.2.7/32", "198.51.100.1/32"]
        );
        // A slice of another namespace's Service of the same name does not count.
        let mut other = endpoints("node-1", true);
        other.metadata.namespace = Some("default".into());
        assert_eq!(advertised(&services, all, &[other]), ["10.96.0.10/32"]);
        // Without nodeName, an endpoint on one of the node's addresses (hostNetwork) is local.
        let host = slice(serde_json::json!({"metadata": {"namespace": "shop", "name": "web-2",
                "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4", "endpoints": [{"addresses": ["192.168.0.1"]}]}));
        assert_eq!(advertised(&services, all, &[host]).len(), 3);
        // Every VIP stays known to the import policy either way.
        let addresses = BTreeSet::new();
        let local = LocalEndpoints { node_name: "node-1", node_addresses: &addresses, slices_of: &|_, _| Vec::new() };
        assert_eq!(service_vips(services.iter(), all, &ExternalIpPolicy::default(), &local).all.len(), 3);
    }

    #[test]
    fn bgp_advertises_only_the_external_and_load_balancer_ips_the_service_proxy_accepts() {
        // The same refusal the datapath applies (ExternalIpPolicy::refusal), not a copy of it.
        let many: Vec<String> = (0..5000u32).map(|i| std::net::Ipv4Addr::from(0xc633_0000 + i).to_string()).collect();
        let services = [
            service(serde_json::json!({"metadata": {"name": "capture",
                    "annotations": {"kube-router.io/service.advertise.externalip": "true"}},
                "spec": {"clusterIP": "10.96.0.10",
                    "externalIPs": ["192.168.0.1", "192.168.0.100", "169.254.169.254", "192.0.2.7", "10.244.0.9"]},
                "status": {"loadBalancer": {"ingress": [{"ip": "192.168.0.1"}, {"ip": "203.0.113.5"}]}}})),
            service(serde_json::json!({"metadata": {"name": "flood",
                    "annotations": {"kube-router.io/service.advertise.externalip": "true"}},
                "spec": {"clusterIP": "10.96.0.11", "externalIPs": many}})),
        ];
        let policy = ExternalIpPolicy {
            external_ip_ranges: vec!["192.0.2.0/24".parse().unwrap()],
            strict: true,
            forbidden: vec!["10.244.0.0/16".parse().unwrap()],
            ..Default::default()
        };
        let policy =
            policy.with_cluster_addresses(["192.168.0.1".parse().unwrap()], ["192.168.0.100".parse().unwrap()]);
        let addresses = BTreeSet::new();
        let local = LocalEndpoints { node_name: "node-1", node_addresses: &addresses, slices_of: &|_, _| Vec::new() };
        let all = AdvertiseServices { external_ip: true, load_balancer_ip: true, ..Default::default() };
        let vips = service_vips(services.iter(), all, &policy, &local);
        let advertised: Vec<String> = vips.advertised.iter().map(|n| n.to_string()).collect();
        assert_eq!(advertised, ["192.0.2.7/32", "203.0.113.5/32"]);
        assert_eq!(vips.all, vips.advertised, "refused addresses are not kept from import either");
        // The annotation alone (flags off) advertises nothing without the operator's opt-in.
        let annotation_only = service_vips(services.iter(), AdvertiseServices::default(), &policy, &local);
        assert!(annotation_only.advertised.is_empty());
    }

    #[test]
    fn load_balancer_ips_of_a_skiplbips_service_are_neither_served_nor_advertised() {
        let lb = |annotations: serde_json::Value| {
            service(serde_json::json!({"metadata": {"name": "lb", "annotations": annotations},
                "spec": {"clusterIP": "10.96.0.10", "type": "LoadBalancer"},
                "status": {"loadBalancer": {"ingress": [{"ip": "203.0.113.5"}]}}}))
        };
        let addresses = BTreeSet::new();
        let local = LocalEndpoints { node_name: "node-1", node_addresses: &addresses, slices_of: &|_, _| Vec::new() };
        let flags = AdvertiseServices { load_balancer_ip: true, ..Default::default() };
        let policy = ExternalIpPolicy::default();
        let plain = [lb(serde_json::json!({}))];
        assert_eq!(service_vips(plain.iter(), flags, &policy, &local).advertised.len(), 1);
        let skipped = [lb(serde_json::json!({"kube-router.io/service.skiplbips": "true"}))];
        assert!(service_vips(skipped.iter(), flags, &policy, &local).advertised.is_empty());
    }
}
