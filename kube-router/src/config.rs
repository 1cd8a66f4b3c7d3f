//! The agent's configuration, from the command line: one group of options per subsystem, each
//! built from its group of flags (`crate::flags`), so a flag is read in one place. What needs
//! the node (its addresses, its name) or the API server is filled in by `launch` and `agent`.
use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr},
    path::PathBuf,
    time::Duration,
};

use crate::{
    bpf::{datapath::AttachMode, layout::MapSizes, socket_lb::SocketLbOptions, xdp::XdpSetting},
    k8s::watch::ApiOptions,
    routing::router::RouterOptions,
    services::{compile::Limits, family::IpFamily},
};

pub enum DesiredSource {
    /// A YAML/JSON file of Service and EndpointSlice objects, re-read when it changes.
    File(PathBuf),
    /// The API server.
    Api(ApiOptions),
}

pub struct AgentConfig {
    /// The bpffs directory of the pinned maps and links (`--bpf-root`).
    pub pin_dir: PathBuf,
    /// The checkpoint's directory (`--state-dir`).
    pub state_dir: PathBuf,
    pub node_name: String,
    /// Where the desired state comes from.
    pub source: SourceOptions,
    /// This node's networks, CNI configuration and egress.
    pub node: NodeOptions,
    /// How the programs are attached and the maps sized.
    pub datapath: DatapathOptions,
    /// The service load balancer.
    pub services: ServiceOptions,
    /// NetworkPolicy enforcement.
    pub policy: PolicyOptions,
    /// BGP pod routing (`--run-router`), when enabled.
    pub router: Option<RouterOptions>,
    /// The metrics and health listeners.
    pub listeners: ListenerOptions,
}

/// `--kubeconfig`/`--master` or `--service-file`, and `--max-stale`.
pub struct SourceOptions {
    pub source: DesiredSource,
    /// Warn when the desired state is older than this while the API is unreachable.
    pub max_stale: Option<Duration>,
}

/// This node's networks (`--node-ip`, `--cluster-cidr`, `--service-cluster-ip-range`), pod
/// egress masquerade and the CNI configuration.
pub struct NodeOptions {
    /// `--node-ip`: the address source-NATed flows leave with.
    pub node_ip: Option<Ipv4Addr>,
    /// `--cluster-cidr`.
    pub cluster_cidrs: Vec<ipnet::IpNet>,
    /// `--service-cluster-ip-range`.
    pub service_ranges: Vec<ipnet::IpNet>,
    /// `--enable-pod-egress`: masquerade pod traffic leaving the cluster.
    pub pod_egress: bool,
    /// `--enable-cni`: write the node's CNI configuration.
    pub cni: Option<CniOptions>,
}

#[derive(Clone, Debug)]
pub struct CniOptions {
    /// `--cni-conf-file`.
    pub conf_file: PathBuf,
    /// `--auto-mtu`.
    pub auto_mtu: bool,
}

/// Attaching the programs and sizing the maps (`--interfaces`, `--tc-mode`, `--xdp`,
/// `--bpf-*-max`, `--conntrack-gc-interval`).
pub struct DatapathOptions {
    pub interfaces: Option<Vec<String>>,
    pub conntrack_gc_interval: Duration,
    /// `--tc-mode`: node interfaces.
    pub attach_mode: AttachMode,
    /// `--tc-mode`: pod veths (classic under `auto`).
    pub pod_attach_mode: AttachMode,
    /// `--xdp`: the XDP fast path on node uplinks, and in which mode.
    pub xdp: XdpSetting,
    /// Netlink link and address notifications (else only the periodic rescan).
    pub link_events: bool,
    /// `--bpf-lb-map-max`, `--bpf-ct-global-max`.
    pub map_sizes: MapSizes,
}

/// The service load balancer (`--run-service-proxy` and the Service proxy flags).
pub struct ServiceOptions {
    /// Program the service load balancer (`--run-service-proxy`).
    pub run: bool,
    pub nodeport_addresses: Option<Vec<IpAddr>>,
    pub limits: Limits,
    /// Address families whose Services are not programmed (`--enable-ipv4=false`,
    /// `--enable-ipv6=false`).
    pub disabled_families: BTreeSet<IpFamily>,
    /// `--hairpin-mode`.
    pub hairpin_mode: bool,
    /// `--bpf-lb-algorithm maglev`.
    pub maglev_all: bool,
    /// `--masquerade-all`.
    pub masquerade_all: bool,
    /// `--snat-port-range`, inclusive.
    pub snat_port_range: (u16, u16),
    /// `--service-tcp-timeout`, `--service-tcpfin-timeout`, `--service-udp-timeout` (zero
    /// fields: the built-in lifetimes), written to `ct_cfg` at start.
    pub ct_lifetimes: kube_router_common::CtLifetimes,
    /// `--service-external-ip-range`.
    pub external_ip_ranges: Vec<ipnet::IpNet>,
    /// `--loadbalancer-ip-range`.
    pub load_balancer_ip_ranges: Vec<ipnet::IpNet>,
    /// `--strict-external-ip-validation`.
    pub strict_external_ip_validation: bool,
    /// The API server's addresses from `--kubeconfig`/`--master` (filled in at start): never a
    /// Service's.
    pub api_server_addresses: BTreeSet<IpAddr>,
    /// Socket-level load balancing for the node's own sockets (`--bpf-lb-sock`, `--cgroup-root`).
    pub socket_lb: SocketLbOptions,
}

/// NetworkPolicy enforcement (`--run-firewall`) and the pod source check.
#[derive(Clone, Copy, Debug)]
pub struct PolicyOptions {
    /// Enforce NetworkPolicy (`--run-firewall`).
    pub run: bool,
    /// `--enable-pod-source-check`: drop packets from pods with a source not their own.
    pub pod_source_check: bool,
}

/// The agent's HTTP listeners (`--metrics-*`, `--health-*`).
#[derive(Clone, Debug)]
pub struct ListenerOptions {
    /// The metrics listener (0: none): metrics at `metrics_path`, `/bgp`, health.
    pub metrics_port: u16,
    pub metrics_addr: IpAddr,
    pub metrics_path: String,
    /// The health endpoints alone (0: none), on `health_addr` (`--health-addr`; unspecified:
    /// every address).
    pub health_port: u16,
    pub health_addr: IpAddr,
}

impl AgentConfig {
    /// The external IP validation from the flags; every Node's and the API server's
    /// endpoints' addresses are added by the controllers as they learn them.
    pub fn external_ip_policy(&self) -> crate::services::model::ExternalIpPolicy {
        crate::services::model::ExternalIpPolicy {
            external_ip_ranges: self.services.external_ip_ranges.clone(),
            strict: self.services.strict_external_ip_validation,
            load_balancer_ranges: self.services.load_balancer_ip_ranges.clone(),
            forbidden: self.node.cluster_cidrs.iter().chain(&self.node.service_ranges).copied().collect(),
            node_addresses: Default::default(),
            cluster_node_addresses: Default::default(),
            api_server_addresses: self.services.api_server_addresses.clone(),
        }
    }
}
