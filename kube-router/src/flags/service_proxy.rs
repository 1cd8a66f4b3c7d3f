//! The service load balancer: which Services and addresses it serves, how flows are balanced,
//! source-NATed and timed out, and the socket-level load balancer.
use std::{collections::BTreeSet, net::IpAddr, path::PathBuf, time::Duration};

use crate::{
    bpf::socket_lb::SocketLbOptions,
    config::ServiceOptions,
    services::{compile::Limits, family::IpFamily},
};

/// `--run-service-proxy` and what the load balancer serves and how.
#[derive(clap::Args, Debug, Clone)]
#[command(next_help_heading = "Service proxy")]
pub struct ServiceProxyFlags {
    /// Program the eBPF service load balancer (ClusterIP, NodePort, ExternalIP, LoadBalancer).
    #[arg(long, env = "KUBE_ROUTER_RUN_SERVICE_PROXY", default_value_t = true, action = clap::ArgAction::Set)]
    pub run_service_proxy: bool,
    /// Addresses NodePorts listen on (comma-separated, either family). Default: every address
    /// of the node (IPv6: global ones).
    #[arg(long, env = "KUBE_ROUTER_NODEPORT_ADDRESSES", value_delimiter = ',')]
    pub nodeport_addresses: Option<Vec<std::net::IpAddr>>,
    /// NodePorts on every node address; false: only on the node IP of each family (--node-ip,
    /// else the default route's source address). --nodeport-addresses wins over both.
    #[arg(long, env = "KUBE_ROUTER_NODEPORT_BINDON_ALL_IP", default_value_t = true, action = clap::ArgAction::Set)]
    pub nodeport_bindon_all_ip: bool,
    /// Endpoints per service port beyond this are left out (the first N by address are kept).
    #[arg(long, env = "KUBE_ROUTER_MAX_BACKENDS_PER_SERVICE", default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub max_backends_per_service: u32,
    /// Let a Service's backends reach themselves through it (source-NATed to the Service
    /// address). kube-router's flag; on by default here because the eBPF datapath needs no
    /// per-endpoint rules for it. Per Service: the `kube-router.io/service.hairpin` annotation.
    #[arg(long, env = "KUBE_ROUTER_HAIRPIN_MODE", default_value_t = true, action = clap::ArgAction::Set)]
    pub hairpin_mode: bool,
    /// Source-NAT every Service flow to the node address, not only those that need it.
    #[arg(long, env = "KUBE_ROUTER_MASQUERADE_ALL", default_value_t = false, action = clap::ArgAction::Set)]
    pub masquerade_all: bool,
    /// Source ports for source-NATed flows (north-south to another node, hairpin, masquerade).
    /// Keep it clear of the kernel's ephemeral range (net.ipv4.ip_local_port_range) and NodePorts.
    #[arg(long, env = "KUBE_ROUTER_SNAT_PORT_RANGE", default_value = "10000-29999", value_parser = parse_port_range)]
    pub snat_port_range: (u16, u16),
    /// How long an answered Service TCP flow lives idle in the datapath's conntrack, in whole
    /// seconds (1s to 7 days; 0s: 6h). Upstream: the IPVS TCP timeout.
    #[arg(long, env = "KUBE_ROUTER_SERVICE_TCP_TIMEOUT", default_value = "0s", value_parser = crate::flags::parse_ct_timeout)]
    pub service_tcp_timeout: Duration,
    /// How long a Service TCP flow lives after a FIN or RST, in whole seconds (1s to 7 days;
    /// 0s: 10s). Upstream: the IPVS TCP FIN timeout.
    #[arg(long, env = "KUBE_ROUTER_SERVICE_TCPFIN_TIMEOUT", default_value = "0s", value_parser = crate::flags::parse_ct_timeout)]
    pub service_tcpfin_timeout: Duration,
    /// How long an answered Service UDP flow lives idle, in whole seconds (1s to 7 days; 0s:
    /// 60s). Upstream: the IPVS UDP timeout.
    #[arg(long, env = "KUBE_ROUTER_SERVICE_UDP_TIMEOUT", default_value = "0s", value_parser = crate::flags::parse_ct_timeout)]
    pub service_udp_timeout: Duration,
    /// externalIPs must be inside one of these CIDRs (comma-separated); others are refused.
    /// Without it, --strict-external-ip-validation decides. Never accepted whatever the range:
    /// node and API server addresses, the cluster's own ranges, link-local, loopback, multicast.
    #[arg(long, env = "KUBE_ROUTER_SERVICE_EXTERNAL_IP_RANGE", value_delimiter = ',')]
    pub service_external_ip_range: Vec<ipnet::IpNet>,
    /// Refuse every externalIP when no --service-external-ip-range is configured, and every
    /// LoadBalancer ingress IP when no --loadbalancer-ip-range is (kube-router 2.8's flag and
    /// default); false accepts any address the other checks let through.
    #[arg(long, env = "KUBE_ROUTER_STRICT_EXTERNAL_IP_VALIDATION", default_value_t = true, action = clap::ArgAction::Set)]
    pub strict_external_ip_validation: bool,
    /// LoadBalancer ingress IPs must be inside one of these CIDRs (comma-separated); others are
    /// refused. Without it, --strict-external-ip-validation decides.
    #[arg(long, env = "KUBE_ROUTER_LOADBALANCER_IP_RANGE", value_delimiter = ',')]
    pub loadbalancer_ip_range: Vec<ipnet::IpNet>,
    /// How new flows choose a backend when a Service does not say (Cilium's flag): random, or
    /// maglev (consistent hashing of the client's address and port: every node picks the same
    /// backend for a flow). Per Service: `kube-router.io/service.scheduler: mh`.
    #[arg(long, env = "KUBE_ROUTER_BPF_LB_ALGORITHM", default_value = "random", value_parser = ["random", "maglev"])]
    pub bpf_lb_algorithm: String,
    /// Socket-level load balancing (cgroup connect/sendmsg/recvmsg/getpeername programs): the
    /// node and hostNetwork pods reach ClusterIPs, ExternalIPs, LoadBalancer IPs and
    /// localhost/node-IP NodePorts. Needs --run-service-proxy.
    #[arg(long, env = "KUBE_ROUTER_BPF_LB_SOCK", default_value_t = true, action = clap::ArgAction::Set)]
    pub bpf_lb_sock: bool,
    /// cgroup v2 directory the socket load balancer attaches to. Default: the cgroup v2 root
    /// (found in /proc/self/mountinfo), which covers every process on the node.
    #[arg(long, env = "KUBE_ROUTER_CGROUP_ROOT")]
    pub cgroup_root: Option<PathBuf>,
}

impl ServiceProxyFlags {
    /// The load balancer's options. What depends on the node is given: the node IPs
    /// (`--nodeport-bindon-all-ip=false`) and the families it does not serve (the node flags'
    /// `--enable-ipv4/6`, judged against its addresses). The API server's addresses are filled in
    /// at start.
    pub fn service_options(
        &self,
        node_ips: impl FnOnce() -> Vec<IpAddr>,
        disabled_families: BTreeSet<IpFamily>,
    ) -> ServiceOptions {
        ServiceOptions {
            run: self.run_service_proxy,
            nodeport_addresses: self.nodeport_addresses(node_ips),
            limits: self.limits(),
            disabled_families,
            hairpin_mode: self.hairpin_mode,
            maglev_all: self.maglev_all(),
            masquerade_all: self.masquerade_all,
            snat_port_range: self.snat_port_range,
            ct_lifetimes: self.ct_lifetimes(),
            external_ip_ranges: self.service_external_ip_range.clone(),
            load_balancer_ip_ranges: self.loadbalancer_ip_range.clone(),
            strict_external_ip_validation: self.strict_external_ip_validation,
            api_server_addresses: BTreeSet::new(),
            socket_lb: self.into(),
        }
    }

    pub fn limits(&self) -> Limits {
        Limits { max_backends_per_service: self.max_backends_per_service as usize }
    }

    /// `--bpf-lb-algorithm maglev`: every Service without a scheduler of its own.
    pub fn maglev_all(&self) -> bool {
        self.bpf_lb_algorithm == "maglev"
    }

    /// The conntrack lifetimes `ct_cfg` gets (zero: the datapath's built-in ones).
    pub fn ct_lifetimes(&self) -> kube_router_common::CtLifetimes {
        super::ct_lifetimes(self.service_tcp_timeout, self.service_tcpfin_timeout, self.service_udp_timeout)
    }

    /// The NodePort addresses: `--nodeport-addresses`; else every address (None), or with
    /// `--nodeport-bindon-all-ip=false` the node IPs `node_ips` finds (every address while the
    /// node has none yet).
    pub fn nodeport_addresses(&self, node_ips: impl FnOnce() -> Vec<IpAddr>) -> Option<Vec<IpAddr>> {
        match (&self.nodeport_addresses, self.nodeport_bindon_all_ip) {
            (Some(list), _) => Some(list.clone()),
            (None, true) => None,
            (None, false) => {
                let node_ips = node_ips();
                if node_ips.is_empty() {
                    tracing::warn!(
                        "--nodeport-bindon-all-ip=false: the node has no address yet; NodePorts follow every address it gets"
                    );
                    None
                } else {
                    tracing::info!(addresses = ?node_ips, "NodePorts on the node IP only (--nodeport-bindon-all-ip=false)");
                    Some(node_ips)
                }
            }
        }
    }
}

impl From<&ServiceProxyFlags> for SocketLbOptions {
    /// The socket load balancer serves only alongside the TC one.
    fn from(flags: &ServiceProxyFlags) -> Self {
        SocketLbOptions {
            enabled: flags.bpf_lb_sock && flags.run_service_proxy,
            cgroup_root: flags.cgroup_root.clone(),
        }
    }
}

/// "10000-29999" -> (10000, 29999).
fn parse_port_range(text: &str) -> Result<(u16, u16), String> {
    let bad = || format!("{text:?} is not a port range like 10000-29999");
    let (low, high) = text.split_once('-').ok_or_else(bad)?;
    let (low, high): (u16, u16) = (low.trim().parse().map_err(|_| bad())?, high.trim().parse().map_err(|_| bad())?);
    if low == 0 || high < low {
        return Err(bad());
    }
    Ok((low, high))
}
