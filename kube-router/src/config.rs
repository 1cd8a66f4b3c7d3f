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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flags::command_line::{parse_from, RunArgs};

    fn run(args: &[&str]) -> RunArgs {
        let args = std::iter::once("kube-router").chain(args.iter().copied()).map(Into::into);
        parse_from(args).expect("the flags parse").run
    }

    /// Each subsystem's options carry its own flags, each read once, and the external IP policy
    /// joins the groups it needs (the node's cluster ranges, the load balancer's).
    #[test]
    fn each_subsystem_gets_its_flags_and_the_external_ip_policy_joins_them() {
        let args = run(&[
            "--node-ip=192.0.2.7",
            "--cluster-cidr=10.244.0.0/16",
            "--service-cluster-ip-range=10.96.0.0/12",
            "--enable-pod-egress=false",
            "--enable-cni=false",
            "--run-firewall=false",
            "--max-stale=10m",
            "--service-file=/services.yaml",
            "--interfaces=eth1,eth2",
            "--bpf-ct-global-max=300000",
            "--conntrack-gc-interval=45s",
            "--run-service-proxy=false",
            "--masquerade-all",
            "--snat-port-range=20000-20999",
            "--service-external-ip-range=198.51.100.0/24",
            "--strict-external-ip-validation=false",
        ]);
        let node = NodeOptions::from(&args.node);
        assert_eq!(node.node_ip, Some("192.0.2.7".parse().unwrap()));
        assert_eq!(node.cluster_cidrs, vec!["10.244.0.0/16".parse::<ipnet::IpNet>().unwrap()]);
        assert_eq!(node.service_ranges, vec!["10.96.0.0/12".parse::<ipnet::IpNet>().unwrap()]);
        assert!(!node.pod_egress && node.cni.is_none());

        let policy = PolicyOptions::from(&args.policy);
        assert!(!policy.run && policy.pod_source_check, "the source check is on by default");

        let source = SourceOptions::from(&args.api);
        assert_eq!(source.max_stale, Some(Duration::from_secs(600)));
        assert!(matches!(&source.source, DesiredSource::File(path) if path == std::path::Path::new("/services.yaml")));

        let datapath = DatapathOptions::try_from(&args.datapath).unwrap();
        assert_eq!(datapath.interfaces, Some(vec!["eth1".to_string(), "eth2".to_string()]));
        assert_eq!((datapath.map_sizes.conntrack, datapath.conntrack_gc_interval), (300_000, Duration::from_secs(45)));

        let services = args.service_proxy.service_options(|| unreachable!("every address by default"), BTreeSet::new());
        assert!(!services.run && !services.socket_lb.enabled, "no socket load balancer without the service proxy");
        assert!(services.masquerade_all && services.hairpin_mode, "--hairpin-mode is on by default");
        assert_eq!(services.snat_port_range, (20000, 20999));

        let config = AgentConfig {
            pin_dir: "/bpf".into(),
            state_dir: "/state".into(),
            node_name: "node-1".into(),
            source,
            node,
            datapath,
            services,
            policy,
            router: None,
            listeners: (&args.metrics).into(),
        };
        let external = config.external_ip_policy();
        assert_eq!(external.external_ip_ranges, vec!["198.51.100.0/24".parse::<ipnet::IpNet>().unwrap()]);
        assert!(!external.strict);
        assert_eq!(external.forbidden.len(), 2, "the cluster and Service ranges: {:?}", external.forbidden);
    }

    /// A datapath flag the parser takes but its subsystem cannot use is the conversion's error.
    #[test]
    fn a_datapath_flag_out_of_range_is_refused_by_the_conversion() {
        let error = DatapathOptions::try_from(&run(&["--bpf-lb-map-max=1"]).datapath).err().expect("refused");
        assert!(error.contains("--bpf-lb-map-max"), "{error}");
    }
}
