//! Pod routing: runs the BGP speaker from this node's configuration (Node objects or flags)
//! and keeps the kernel routes it learned.
//!
//! The speaker starts once this node's configuration is known (from the API, from the
//! checkpoint while the API is down, or from flags) and is then only ever *updated*: an API
//! outage leaves the last configuration, the sessions, the RIB and the kernel routes alone.
use std::{
    fmt::Write as _,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::PathBuf,
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
        fsm::State,
        message::{Family, Prefix},
        peers::{node_bgp_config, ExternalPeerFlag, GlobalSettings, NodeBgpConfig, PeerConfig},
        speaker::{run_fib, GracefulRestartSettings, Speaker, SpeakerConfig, SpeakerStatus},
    },
    fib::netlink::NetlinkRoutes,
    metrics::Metrics,
};

#[derive(Debug, Clone)]
pub struct RouterOptions {
    pub node_name: String,
    pub cluster_asn: u32,
    /// Overrides the Node-derived router id (needed without the API).
    pub router_id: Option<Ipv4Addr>,
    /// Overrides the Node's spec.podCIDRs (needed without the API).
    pub pod_cidrs: Option<Vec<IpNet>>,
    pub external_peers: Vec<ExternalPeerFlag>,
    pub ibgp_mesh: bool,
    pub bgp_port: u16,
    pub hold_time: Duration,
    pub graceful_restart: bool,
    pub graceful_restart_time: Duration,
    pub graceful_restart_deferral: Duration,
    pub route_protocol: u8,
    pub route_table: u32,
    pub state_dir: PathBuf,
    pub advertise: AdvertiseServices,
}

/// Which Service addresses every node advertises as host routes (kube-router's
/// `--advertise-cluster-ip`, `--advertise-external-ip`, `--advertise-loadbalancer-ip`). A
/// Service can override each with the annotation `kube-router.io/service.advertise.<kind>`
/// set to "true" or "false".
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AdvertiseServices {
    pub cluster_ip: bool,
    pub external_ip: bool,
    pub load_balancer_ip: bool,
}

impl AdvertiseServices {
    pub fn any(&self) -> bool {
        self.cluster_ip || self.external_ip || self.load_balancer_ip
    }
}

/// Services with at least one ready endpoint on `node` ((namespace, name)).
pub fn services_with_local_endpoints<'a>(
    slices: impl Iterator<Item = &'a EndpointSlice>,
    node: &str,
) -> std::collections::BTreeSet<(String, String)> {
    let mut local = std::collections::BTreeSet::new();
    for slice in slices {
        let labels = slice.metadata.labels.as_ref();
        let Some(service) = labels.and_then(|l| l.get(crate::services::from_k8s::SERVICE_NAME_LABEL)) else {
            continue;
        };
        let ready_here = slice.endpoints.iter().any(|e| {
            e.node_name.as_deref() == Some(node) && e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true)
        });
        if ready_here {
            local.insert((slice.metadata.namespace.clone().unwrap_or_default(), service.clone()));
        }
    }
    local
}

/// Host prefixes (/32, /128) of the Service addresses to advertise, sorted, without duplicates.
/// Headless Services (clusterIP None) and unparsable addresses contribute nothing. As
/// kube-router does, the externalIPs and LoadBalancer IPs of a Service with
/// `externalTrafficPolicy: Local` (and the ClusterIPs of one with `internalTrafficPolicy: Local`)
/// are advertised only by nodes with a ready endpoint of it (`local`): the network then sends
/// traffic only where it can be served without leaving the node.
pub fn service_prefixes<'a>(
    services: impl Iterator<Item = &'a Service>,
    advertise: AdvertiseServices,
    local: &std::collections::BTreeSet<(String, String)>,
) -> Vec<IpNet> {
    let mut out = std::collections::BTreeSet::new();
    for service in services {
        let id =
            (service.metadata.namespace.clone().unwrap_or_default(), service.metadata.name.clone().unwrap_or_default());
        let served_here = local.contains(&id);
        let annotations = service.metadata.annotations.as_ref();
        let wants = |kind: &str, default: bool| {
            let key = format!("kube-router.io/service.advertise.{kind}");
            match annotations.and_then(|a| a.get(&key)).map(String::as_str) {
                Some("true") => true,
                Some("false") => false,
                _ => default,
            }
        };
        let spec = service.spec.as_ref();
        let external_local = spec.and_then(|s| s.external_traffic_policy.as_deref()) == Some("Local");
        let internal_local = spec.and_then(|s| s.internal_traffic_policy.as_deref()) == Some("Local");
        let mut addresses: Vec<&String> = Vec::new();
        if wants("clusterip", advertise.cluster_ip) && (served_here || !internal_local) {
            addresses.extend(spec.and_then(|s| s.cluster_ips.as_ref()).into_iter().flatten());
            addresses.extend(spec.and_then(|s| s.cluster_ip.as_ref()));
        }
        if wants("externalip", advertise.external_ip) && (served_here || !external_local) {
            addresses.extend(spec.and_then(|s| s.external_ips.as_ref()).into_iter().flatten());
        }
        if wants("loadbalancerip", advertise.load_balancer_ip) && (served_here || !external_local) {
            let ingress =
                service.status.as_ref().and_then(|s| s.load_balancer.as_ref()).and_then(|l| l.ingress.as_ref());
            addresses.extend(ingress.into_iter().flatten().filter_map(|i| i.ip.as_ref()));
        }
        out.extend(addresses.into_iter().filter_map(|a| a.parse::<IpAddr>().ok()).map(IpNet::from));
    }
    out.into_iter().collect()
}

pub struct RouterController {
    options: RouterOptions,
    speaker: Option<Speaker>,
    applied: Option<(Vec<PeerConfig>, Vec<Prefix>)>,
    last_problem: Option<String>,
    metrics: Metrics,
}

impl RouterController {
    pub fn new(options: RouterOptions, metrics: Metrics) -> Self {
        Self { options, speaker: None, applied: None, last_problem: None, metrics }
    }

    fn settings(&self) -> GlobalSettings {
        GlobalSettings {
            node_name: self.options.node_name.clone(),
            cluster_asn: self.options.cluster_asn,
            enable_ibgp_mesh: self.options.ibgp_mesh,
            external_peers: self.options.external_peers.clone(),
            peer_port: self.options.bgp_port,
            advertise_pod_cidr: true,
        }
    }

    /// Configuration from flags alone, for running without the API server.
    pub fn static_config(&self) -> Result<NodeBgpConfig> {
        let router_id = self.options.router_id.context("--router-id is needed to run BGP without the API server")?;
        let peers = self.options.external_peers.iter().map(|p| p.peer_config(self.options.bgp_port)).collect();
        Ok(NodeBgpConfig {
            router_id,
            local_asn: self.options.cluster_asn,
            local_address: Some(IpAddr::V4(router_id)),
            pod_cidrs: self.options.pod_cidrs.clone().unwrap_or_default(),
            peers,
            route_reflector: crate::bgp::peers::RrRole::None,
            warnings: Vec::new(),
        })
    }

    /// Re-derives the configuration from the Node objects we know. A problem (this node not
    /// found yet, a broken annotation on it) is logged once and changes nothing.
    pub async fn update_from_nodes<'a>(
        &mut self,
        nodes: impl Iterator<Item = &'a Node>,
        services: impl Iterator<Item = &'a Service>,
        slices: impl Iterator<Item = &'a EndpointSlice>,
    ) {
        let nodes: Vec<Node> = nodes.cloned().collect();
        let local = services_with_local_endpoints(slices, &self.options.node_name);
        let service_prefixes = service_prefixes(services, self.options.advertise, &local);
        match node_bgp_config(&nodes, &self.settings()) {
            Ok(mut config) => {
                self.last_problem = None;
                for warning in &config.warnings {
                    tracing::warn!(%warning, "BGP peer configuration");
                }
                if let Some(router_id) = self.options.router_id {
                    config.router_id = router_id;
                }
                if let Some(cidrs) = &self.options.pod_cidrs {
                    config.pod_cidrs = cidrs.clone();
                }
                config.pod_cidrs.extend(service_prefixes);
                self.apply(config).await;
            }
            Err(e) => {
                let problem = e.to_string();
                if self.last_problem.as_ref() != Some(&problem) {
                    tracing::warn!(error = %problem, "BGP configuration from Node objects unavailable; routing left as it is");
                    self.metrics.with(|m| *m.rejected_objects.entry("Node").or_default() += 1);
                    self.last_problem = Some(problem);
                }
            }
        }
    }

    pub async fn apply(&mut self, config: NodeBgpConfig) {
        let prefixes: Vec<Prefix> =
            config.pod_cidrs.iter().filter_map(|net| Prefix::new(net.addr(), net.prefix_len()).ok()).collect();
        let wanted = (config.peers.clone(), prefixes.clone());
        if self.applied.as_ref() == Some(&wanted) {
            return;
        }
        match &self.speaker {
            Some(speaker) => {
                speaker.set_peers(config.peers.clone());
                speaker.set_prefixes(prefixes);
            }
            None => match self.start(&config, prefixes).await {
                Ok(speaker) => self.speaker = Some(speaker),
                Err(e) => {
                    tracing::error!(error = format!("{e:#}"), "cannot start the BGP speaker; will retry");
                    return;
                }
            },
        }
        self.applied = Some(wanted);
    }

    async fn start(&self, config: &NodeBgpConfig, prefixes: Vec<Prefix>) -> Result<Speaker> {
        let o = &self.options;
        let routes = NetlinkRoutes::connect(o.route_protocol, o.route_table)?;
        let installed = routes.list().await.context("listing our kernel routes")?;
        let mut speaker_config = SpeakerConfig::new(config.local_asn, config.router_id);
        speaker_config.listen = Some(SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), o.bgp_port));
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
            _ => first_global_ipv6(),
        };
        speaker_config.state_dir = Some(o.state_dir.clone());
        std::fs::create_dir_all(&o.state_dir).ok();
        tracing::info!(asn = config.local_asn, router_id = %config.router_id, peers = config.peers.len(),
            kept_routes = installed.len(), "starting BGP speaker");
        let (speaker, fib) = Speaker::start(speaker_config, config.peers.clone(), prefixes, installed).await?;
        tokio::spawn(run_fib(routes, fib));
        Ok(speaker)
    }

    pub fn status(&self) -> Option<SpeakerStatus> {
        self.speaker.as_ref().map(Speaker::status)
    }

    pub fn publish_metrics(&self) {
        if let Some(speaker) = &self.speaker {
            self.metrics.with(|m| {
                m.bgp.get_or_insert_with(|| speaker.clone());
            });
            self.metrics.heartbeat("bgp");
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
        "{:<40} {:>10} {:<12} {:>8} {:>8} {:>6} {:>8}",
        "neighbor", "AS", "state", "up(s)", "recv", "stale", "sent"
    );
    for p in &status.peers {
        let _ = writeln!(
            out,
            "{:<40} {:>10} {:<12} {:>8} {:>8} {:>6} {:>8}{}",
            p.address,
            p.asn,
            format!("{:?}", p.state),
            p.established_at.map(|t| t.elapsed().as_secs().to_string()).unwrap_or_else(|| "-".into()),
            p.prefixes_received,
            p.prefixes_stale,
            p.prefixes_advertised,
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
        let text = |v: Vec<IpNet>| v.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        let none = Default::default();
        assert!(
            service_prefixes(services.iter(), AdvertiseServices::default(), &none)
                == vec!["192.0.2.30/32".parse::<IpNet>().unwrap()]
        );
        let cluster = AdvertiseServices { cluster_ip: true, ..Default::default() };
        assert_eq!(
            text(service_prefixes(services.iter(), cluster, &none)),
            ["10.96.0.10/32", "10.96.0.30/32", "192.0.2.30/32", "fd00:96::10/128"]
        );
        let all = AdvertiseServices { cluster_ip: true, external_ip: true, load_balancer_ip: true };
        assert_eq!(
            text(service_prefixes(services.iter(), all, &none)),
            ["10.96.0.10/32", "10.96.0.30/32", "192.0.2.7/32", "192.0.2.30/32", "198.51.100.1/32", "fd00:96::10/128"]
        );
    }

    #[test]
    fn local_policy_addresses_are_advertised_only_by_nodes_with_a_ready_local_endpoint() {
        let services = [service(serde_json::json!({"metadata": {"namespace": "default", "name": "web"},
            "spec": {"clusterIP": "10.96.0.10", "externalIPs": ["192.0.2.7"], "externalTrafficPolicy": "Local"},
            "status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.1"}]}}}))];
        let slice: EndpointSlice = serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": "default", "name": "web-1", "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4",
            "endpoints": [
                {"addresses": ["10.244.1.5"], "nodeName": "node-1", "conditions": {"ready": true}},
                {"addresses": ["10.244.2.5"], "nodeName": "node-2", "conditions": {"ready": false}}
            ]
        }))
        .unwrap();
        let all = AdvertiseServices { cluster_ip: true, external_ip: true, load_balancer_ip: true };
        let on = |node: &str| {
            let local = services_with_local_endpoints(std::iter::once(&slice), node);
            service_prefixes(services.iter(), all, &local).iter().map(|n| n.to_string()).collect::<Vec<_>>()
        };
        assert_eq!(on("node-1"), ["10.96.0.10/32", "192.0.2.7/32", "198.51.100.1/32"]);
        // node-2's endpoint is not ready; the ClusterIP (internal policy Cluster) is still advertised.
        assert_eq!(on("node-2"), ["10.96.0.10/32"]);
    }
}
