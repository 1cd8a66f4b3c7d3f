//! The agent's configuration, from the command line.
use std::{
    net::{IpAddr, Ipv4Addr},
    path::PathBuf,
    time::Duration,
};

use crate::{
    bpf::socket_lb::SocketLbOptions, k8s::watch::ApiOptions, routing::router::RouterOptions, services::compile::Limits,
};

pub enum DesiredSource {
    /// A YAML/JSON file of Service and EndpointSlice objects, re-read when it changes.
    File(PathBuf),
    /// The API server.
    Api(ApiOptions),
}

pub struct AgentConfig {
    pub pin_dir: PathBuf,
    pub source: DesiredSource,
    pub state_dir: PathBuf,
    /// Warn when the desired state is older than this while the API is unreachable.
    pub max_stale: Option<Duration>,
    pub interfaces: Option<Vec<String>>,
    pub node_name: String,
    pub nodeport_addresses: Option<Vec<IpAddr>>,
    pub limits: Limits,
    /// The metrics and health listeners.
    pub listeners: ListenerOptions,
    /// Address families whose Services are not programmed (`--enable-ipv4=false`,
    /// `--enable-ipv6=false`).
    pub disabled_families: std::collections::BTreeSet<crate::services::family::IpFamily>,
    pub conntrack_gc_interval: Duration,
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
    /// `--node-ip`: the address source-NATed flows leave with.
    pub node_ip: Option<Ipv4Addr>,
    /// `--enable-pod-egress`: masquerade pod traffic leaving the cluster.
    pub pod_egress: bool,
    /// `--enable-pod-source-check`: drop packets from pods with a source not their own.
    pub pod_source_check: bool,
    /// `--tc-mode`: node interfaces.
    pub attach_mode: crate::bpf::datapath::AttachMode,
    /// `--tc-mode`: pod veths (classic under `auto`).
    pub pod_attach_mode: crate::bpf::datapath::AttachMode,
    /// `--xdp`: the XDP fast path on node uplinks, and in which mode.
    pub xdp: crate::bpf::xdp::XdpSetting,
    /// Netlink link and address notifications (else only the periodic rescan).
    pub link_events: bool,
    /// `--bpf-lb-map-max`, `--bpf-ct-global-max`.
    pub map_sizes: crate::bpf::layout::MapSizes,
    /// `--enable-cni`: write the node's CNI configuration.
    pub cni: Option<CniOptions>,
    /// `--cluster-cidr`.
    pub cluster_cidrs: Vec<ipnet::IpNet>,
    /// `--service-cluster-ip-range`.
    pub service_ranges: Vec<ipnet::IpNet>,
    /// `--service-external-ip-range`.
    pub external_ip_ranges: Vec<ipnet::IpNet>,
    /// `--loadbalancer-ip-range`.
    pub load_balancer_ip_ranges: Vec<ipnet::IpNet>,
    /// `--strict-external-ip-validation`.
    pub strict_external_ip_validation: bool,
    /// The API server's addresses from `--kubeconfig`/`--master` (filled in at start).
    pub api_server_addresses: std::collections::BTreeSet<IpAddr>,
    /// Program the service load balancer (`--run-service-proxy`).
    pub run_service_proxy: bool,
    /// Enforce NetworkPolicy (`--run-firewall`).
    pub run_firewall: bool,
    /// Socket-level load balancing for the node's own sockets (`--bpf-lb-sock`, `--cgroup-root`).
    pub socket_lb: SocketLbOptions,
    /// BGP pod routing (`--run-router`), when enabled.
    pub router: Option<RouterOptions>,
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

#[derive(Clone, Debug)]
pub struct CniOptions {
    /// `--cni-conf-file`.
    pub conf_file: PathBuf,
    /// `--auto-mtu`.
    pub auto_mtu: bool,
}

impl AgentConfig {
    /// The external IP validation from the flags; every Node's and the API server's
    /// endpoints' addresses are added by the controllers as they learn them.
    pub fn external_ip_policy(&self) -> crate::services::model::ExternalIpPolicy {
        crate::services::model::ExternalIpPolicy {
            external_ip_ranges: self.external_ip_ranges.clone(),
            strict: self.strict_external_ip_validation,
            load_balancer_ranges: self.load_balancer_ip_ranges.clone(),
            forbidden: self.cluster_cidrs.iter().chain(&self.service_ranges).copied().collect(),
            node_addresses: Default::default(),
            cluster_node_addresses: Default::default(),
            api_server_addresses: self.api_server_addresses.clone(),
        }
    }
}
