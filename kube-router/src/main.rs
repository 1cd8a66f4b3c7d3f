//! kube-router: service proxy, network policy and BGP routing for Kubernetes, on eBPF.
use std::{net::Ipv4Addr, path::PathBuf, process::ExitCode, time::Duration};

use anyhow::Result;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use kube_router::{
    agent::{self, AgentConfig, DesiredSource},
    bgp::peers::{parse_external_peer_flags, RouterIdSetting, DEFAULT_CLUSTER_ASN},
    bpf::{
        datapath::{self, AttachMode},
        layout::MapSizes,
        socket_lb::SocketLbOptions,
    },
    cli,
    flags::{parse_go_duration, Upstream},
    k8s::watch::ApiOptions,
    netif,
    overlay::{Encap, OverlayConfig, OverlayType},
    router::{AdvertiseServices, RouterOptions},
    services::{compile::Limits, family::IpFamily},
};
use kube_router_common::DEFAULT_PIN_DIR;

#[derive(Parser)]
#[command(
    name = "kube-router",
    version,
    about = "Kubernetes service proxy, network policy and BGP routing on an eBPF datapath",
    // As Go's flag package: a repeated flag's last value wins (lists append).
    args_override_self = true
)]
struct Cli {
    /// bpffs directory holding the pinned maps and links.
    #[arg(long, env = "KUBE_ROUTER_BPF_ROOT", default_value = DEFAULT_PIN_DIR, global = true)]
    bpf_root: PathBuf,
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(clap::Args)]
struct RunArgs {
    /// Path to a kubeconfig file. Without it (and without --master) the in-cluster config is used.
    #[arg(long, env = "KUBE_ROUTER_KUBECONFIG", value_parser = path_or_empty())]
    kubeconfig: Option<PathBuf>,
    /// The API server URL (overrides the kubeconfig's), e.g. https://10.0.0.1:6443.
    #[arg(long, env = "KUBE_ROUTER_MASTER")]
    master: Option<String>,
    /// Load Services and EndpointSlices from this YAML/JSON file of Kubernetes objects (re-read
    /// when it changes) instead of the API server.
    #[arg(long, env = "KUBE_ROUTER_SERVICE_FILE", conflicts_with_all = ["kubeconfig", "master"])]
    service_file: Option<PathBuf>,
    /// Directory for the checkpoint of the last synced desired state.
    #[arg(long, env = "KUBE_ROUTER_STATE_DIR", default_value = "/var/lib/kube-router")]
    state_dir: PathBuf,
    /// Warn (only warn) once the desired state is older than this (e.g. 10m, or seconds) because
    /// the API server is unreachable. Default: never.
    #[arg(long, env = "KUBE_ROUTER_MAX_STALE", value_parser = parse_go_duration)]
    max_stale: Option<Duration>,
    /// Interfaces to attach the load balancer to (comma-separated). Default: every interface
    /// but lo, re-scanned every 5 s.
    #[arg(long, env = "KUBE_ROUTER_INTERFACES", value_delimiter = ',')]
    interfaces: Option<Vec<String>>,
    /// This node's name (its Node object; externalTrafficPolicy: Local). Default: the NODE_NAME
    /// environment variable (upstream's manifests set it from spec.nodeName), else the hostname.
    #[arg(long, env = "KUBE_ROUTER_HOSTNAME_OVERRIDE")]
    hostname_override: Option<String>,
    /// Addresses NodePorts listen on (comma-separated, either family). Default: every address
    /// of the node (IPv6: global ones).
    #[arg(long, env = "KUBE_ROUTER_NODEPORT_ADDRESSES", value_delimiter = ',')]
    nodeport_addresses: Option<Vec<std::net::IpAddr>>,
    /// NodePorts on every node address; false: only on the node IP of each family (--node-ip,
    /// else the default route's source address). --nodeport-addresses wins over both.
    #[arg(long, env = "KUBE_ROUTER_NODEPORT_BINDON_ALL_IP", default_value_t = true, action = clap::ArgAction::Set)]
    nodeport_bindon_all_ip: bool,
    /// Serve IPv4. Unset: wherever the node has an IPv4 address. true: refuse to start without
    /// one. false: IPv4 Services are not programmed.
    #[arg(long, env = "KUBE_ROUTER_ENABLE_IPV4", action = clap::ArgAction::Set)]
    enable_ipv4: Option<bool>,
    /// Serve IPv6. Unset: wherever the node has a global IPv6 address. true: refuse to start
    /// without one. false: IPv6 Services are not programmed.
    #[arg(long, env = "KUBE_ROUTER_ENABLE_IPV6", action = clap::ArgAction::Set)]
    enable_ipv6: Option<bool>,
    /// Endpoints per service port beyond this are left out (the first N by address are kept).
    #[arg(long, env = "KUBE_ROUTER_MAX_BACKENDS_PER_SERVICE", default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..=65536))]
    max_backends_per_service: u32,
    /// Port of the metrics listener: Prometheus metrics at --metrics-path, the /bgp status page
    /// (`kube-router bgp` reads it) and the health endpoints (0 disables).
    #[arg(long, env = "KUBE_ROUTER_METRICS_PORT", default_value_t = 0)]
    metrics_port: u16,
    /// Address of the metrics listener. The default keeps the metrics (every Service, VIP, BGP
    /// peer and route) from the pods: set the node's InternalIP (or 0.0.0.0) to scrape it from
    /// elsewhere, behind a firewall rule or NetworkPolicy for the node.
    /// Empty: every address.
    #[arg(long, env = "KUBE_ROUTER_METRICS_ADDR", default_value = "127.0.0.1", value_parser = parse_listen_addr)]
    metrics_addr: std::net::IpAddr,
    /// Path of the Prometheus metrics on the metrics listener.
    #[arg(long, env = "KUBE_ROUTER_METRICS_PATH", default_value = "/metrics", value_parser = parse_metrics_path)]
    metrics_path: String,
    /// Port for the health endpoints /healthz, /livez and /readyz, on every address (0 disables).
    #[arg(long, env = "KUBE_ROUTER_HEALTH_PORT", default_value_t = 20244)]
    health_port: u16,
    /// Address of the health endpoints (empty or 0.0.0.0: every IPv4 address; the kubelet probes
    /// the node's, so a livenessProbe needs the same address).
    #[arg(long, env = "KUBE_ROUTER_HEALTH_ADDR", default_value = "0.0.0.0", value_parser = parse_listen_addr)]
    health_addr: std::net::IpAddr,
    /// Program the eBPF service load balancer (ClusterIP, NodePort, ExternalIP, LoadBalancer).
    #[arg(long, env = "KUBE_ROUTER_RUN_SERVICE_PROXY", default_value_t = true, action = clap::ArgAction::Set)]
    run_service_proxy: bool,
    /// Socket-level load balancing (cgroup connect/sendmsg/recvmsg/getpeername programs): the
    /// node and hostNetwork pods reach ClusterIPs, ExternalIPs, LoadBalancer IPs and
    /// localhost/node-IP NodePorts. Needs --run-service-proxy.
    #[arg(long, env = "KUBE_ROUTER_BPF_LB_SOCK", default_value_t = true, action = clap::ArgAction::Set)]
    bpf_lb_sock: bool,
    /// cgroup v2 directory the socket load balancer attaches to. Default: the cgroup v2 root
    /// (found in /proc/self/mountinfo), which covers every process on the node.
    #[arg(long, env = "KUBE_ROUTER_CGROUP_ROOT")]
    cgroup_root: Option<PathBuf>,
    /// Enforce Kubernetes NetworkPolicy in the eBPF datapath (needs the API server).
    #[arg(long, env = "KUBE_ROUTER_RUN_FIREWALL", default_value_t = true, action = clap::ArgAction::Set)]
    run_firewall: bool,
    /// Advertise this node's pod CIDR over BGP and install the routes learned from peers.
    #[arg(long, env = "KUBE_ROUTER_RUN_ROUTER", default_value_t = true, action = clap::ArgAction::Set)]
    run_router: bool,
    /// ASN of the cluster's nodes (a node's `kube-router.io/node.asn` annotation overrides it);
    /// 0 is upstream's "unset": 64512.
    #[arg(long, env = "KUBE_ROUTER_CLUSTER_ASN", default_value_t = 64512, value_parser = clap::value_parser!(u32).range(0..=4_294_967_294))]
    cluster_asn: u32,
    /// BGP router id: an IPv4 address; an IPv6 address (hashed to 32 bits, FNV-1a); or
    /// "generate" (the node IP hashed so, as upstream: for IPv6-only nodes). Default: the node's
    /// `kube-router.io/bgp-router-id` annotation, else its IPv4 InternalIP. A fixed one is needed
    /// without the API server.
    #[arg(long, env = "KUBE_ROUTER_ROUTER_ID", value_parser = kube_router::flags::parse_router_id)]
    router_id: Option<RouterIdSetting>,
    /// Prefixes to advertise instead of the Node's spec.podCIDRs (comma-separated).
    #[arg(long, env = "KUBE_ROUTER_POD_CIDRS", value_delimiter = ',')]
    pod_cidrs: Option<Vec<ipnet::IpNet>>,
    /// External BGP peers every node peers with (comma-separated addresses).
    #[arg(long, env = "KUBE_ROUTER_PEER_ROUTER_IPS", value_delimiter = ',')]
    peer_router_ips: Vec<String>,
    /// ASN of each --peer-router-ips entry, in the same order.
    #[arg(long, env = "KUBE_ROUTER_PEER_ROUTER_ASNS", value_delimiter = ',')]
    peer_router_asns: Vec<String>,
    /// Base64-encoded TCP MD5 password of each --peer-router-ips entry (empty for none).
    #[arg(long, env = "KUBE_ROUTER_PEER_ROUTER_PASSWORDS", value_delimiter = ',', hide_env_values = true)]
    peer_router_passwords: Vec<String>,
    /// Every node runs --cluster-asn and peers with every other node (iBGP full mesh). When
    /// false, each node's ASN is its kube-router.io/node.asn annotation and it peers only with
    /// nodes of the same ASN (per-rack designs); route-reflector annotations apply either way.
    #[arg(long, env = "KUBE_ROUTER_NODES_FULL_MESH", default_value_t = true, action = clap::ArgAction::Set)]
    nodes_full_mesh: bool,
    /// Peer with the other nodes at all (mesh, same-ASN rack or route reflection); when false
    /// only external peers are configured.
    #[arg(long, env = "KUBE_ROUTER_ENABLE_IBGP", default_value_t = true, action = clap::ArgAction::Set)]
    enable_ibgp: bool,
    /// Port of each --peer-router-ips entry (empty entries: --bgp-port).
    #[arg(long, env = "KUBE_ROUTER_PEER_ROUTER_PORTS", value_delimiter = ',')]
    peer_router_ports: Vec<String>,
    /// File with the --peer-router-passwords (base64, comma-separated, one line); the flag wins
    /// if both are set.
    #[arg(long, env = "KUBE_ROUTER_PEER_ROUTER_PASSWORDS_FILE", value_parser = path_or_empty())]
    peer_router_passwords_file: Option<PathBuf>,
    /// IP TTL for eBGP sessions with external peers (2 or more enables multihop; 0 or unset: 1).
    #[arg(long, env = "KUBE_ROUTER_PEER_ROUTER_MULTIHOP_TTL")]
    peer_router_multihop_ttl: Option<u8>,
    /// GTSM (RFC 5082) with external peers: send with TTL 255, drop their packets that arrive
    /// with less (less 255 - (--peer-router-multihop-ttl - 1) with multihop); per peer:
    /// `ttlsecurity` in the kube-router.io/peers annotation.
    #[arg(long, env = "KUBE_ROUTER_PEER_ROUTER_TTL_SECURITY", default_value_t = false, action = clap::ArgAction::Set)]
    peer_router_ttl_security: bool,
    /// Most prefixes per address family a BGP peer may send; one more closes the session
    /// (Cease, RFC 4486) and holds it down for 30 s, doubling per repeat up to 15 min. 0: no
    /// limit. Per peer: `maxprefixes` in the kube-router.io/peers annotation.
    #[arg(long, env = "KUBE_ROUTER_BGP_MAX_PREFIXES", default_value_t = kube_router::bgp::peers::DEFAULT_MAX_PREFIXES)]
    bgp_max_prefixes: u32,
    /// External peers get the session's own address as next hop instead of the node IP.
    #[arg(long, env = "KUBE_ROUTER_OVERRIDE_NEXTHOP", default_value_t = false, action = clap::ArgAction::Set)]
    override_nexthop: bool,
    /// Advertise the node's pod CIDRs to external peers (node peers always get them).
    #[arg(long, env = "KUBE_ROUTER_ADVERTISE_POD_CIDR", default_value_t = true, action = clap::ArgAction::Set)]
    advertise_pod_cidr: bool,
    /// Accept default routes (0.0.0.0/0, ::/0) from every peer; per peer: `acceptdefault: true`
    /// in the kube-router.io/peers annotation. A default route never replaces the node's own.
    #[arg(long, env = "KUBE_ROUTER_BGP_ACCEPT_DEFAULT", default_value_t = false, action = clap::ArgAction::Set)]
    bgp_accept_default: bool,
    /// Tunnel pod traffic to nodes on other subnets (see --overlay-type, --overlay-encap).
    #[arg(long, env = "KUBE_ROUTER_ENABLE_OVERLAY", default_value_t = true, action = clap::ArgAction::Set)]
    enable_overlay: bool,
    /// "subnet": tunnel only to nodes on other subnets; "full": to every node.
    #[arg(long, env = "KUBE_ROUTER_OVERLAY_TYPE", default_value = "subnet", value_parser = ["subnet", "full"])]
    overlay_type: String,
    /// "ipip", or "fou" (IPIP in UDP with a GUE header on --overlay-encap-port).
    #[arg(long, env = "KUBE_ROUTER_OVERLAY_ENCAP", default_value = "ipip", value_parser = ["ipip", "fou"])]
    overlay_encap: String,
    /// UDP port for --overlay-encap=fou.
    #[arg(long, env = "KUBE_ROUTER_OVERLAY_ENCAP_PORT", default_value_t = 5555, value_parser = clap::value_parser!(u16).range(1..))]
    overlay_encap_port: u16,
    /// BFD (RFC 5880/5881) on the sessions with external peers: a dead link takes the BGP
    /// session down within --bfd-detection-multiplier x the negotiated interval.
    #[arg(long, env = "KUBE_ROUTER_ENABLE_BFD", default_value_t = false, action = clap::ArgAction::Set)]
    enable_bfd: bool,
    /// UDP port of BFD control packets.
    #[arg(long, env = "KUBE_ROUTER_BFD_PORT", default_value_t = 3784, value_parser = clap::value_parser!(u16).range(1..))]
    bfd_port: u16,
    /// Milliseconds between our BFD packets (the peer may ask for fewer).
    #[arg(long, env = "KUBE_ROUTER_BFD_DESIRED_MIN_TX_INTERVAL", default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=4_294_967))]
    bfd_desired_min_tx_interval: u32,
    /// Milliseconds: the fastest rate we accept BFD packets at.
    #[arg(long, env = "KUBE_ROUTER_BFD_REQUIRED_MIN_RX_INTERVAL", default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=4_294_967))]
    bfd_required_min_rx_interval: u32,
    /// Missed BFD intervals before the peer is declared down (1-255).
    #[arg(long, env = "KUBE_ROUTER_BFD_DETECTION_MULTIPLIER", default_value_t = 3, value_parser = clap::value_parser!(u8).range(1..))]
    bfd_detection_multiplier: u8,
    /// TCP port for BGP, listened on and connected to.
    #[arg(long, env = "KUBE_ROUTER_BGP_PORT", default_value_t = 179, value_parser = clap::value_parser!(u16).range(1..))]
    bgp_port: u16,
    /// BGP hold time proposed to peers (e.g. 90s; 0 disables keepalives, else at least 3s).
    #[arg(long, env = "KUBE_ROUTER_BGP_HOLDTIME", default_value = "90s", value_parser = parse_hold_time)]
    bgp_holdtime: Duration,
    /// BGP graceful restart (RFC 4724): peers keep our routes while the agent restarts, and we
    /// keep theirs while they do.
    #[arg(long, env = "KUBE_ROUTER_BGP_GRACEFUL_RESTART", default_value_t = true, action = clap::ArgAction::Set)]
    bgp_graceful_restart: bool,
    /// Restart time advertised to peers: how long they keep our routes (at most 4095s).
    #[arg(long, env = "KUBE_ROUTER_BGP_GRACEFUL_RESTART_TIME", default_value = "90s", value_parser = parse_restart_time)]
    bgp_graceful_restart_time: Duration,
    /// After a start, the longest wait for peers' End-of-RIB before stale kernel routes go.
    #[arg(long, env = "KUBE_ROUTER_BGP_GRACEFUL_RESTART_DEFERRAL_TIME", default_value = "360s", value_parser = parse_go_duration)]
    bgp_graceful_restart_deferral_time: Duration,
    /// Advertise every Service's ClusterIP(s) over BGP as host routes.
    #[arg(long, env = "KUBE_ROUTER_ADVERTISE_CLUSTER_IP", default_value_t = false, action = clap::ArgAction::Set)]
    advertise_cluster_ip: bool,
    /// Advertise every Service's externalIPs over BGP as host routes.
    #[arg(long, env = "KUBE_ROUTER_ADVERTISE_EXTERNAL_IP", default_value_t = false, action = clap::ArgAction::Set)]
    advertise_external_ip: bool,
    /// Advertise every Service's LoadBalancer ingress IPs over BGP as host routes.
    #[arg(long, env = "KUBE_ROUTER_ADVERTISE_LOADBALANCER_IP", default_value_t = false, action = clap::ArgAction::Set)]
    advertise_loadbalancer_ip: bool,
    /// Let a Service's kube-router.io/service.advertise.<kind>: "true" annotation advertise
    /// what the --advertise-* flags leave out. Default: the annotations can only narrow them
    /// ("false"), so a namespace user cannot make every node announce prefixes.
    #[arg(long, env = "KUBE_ROUTER_SERVICE_ADVERTISE_ANNOTATIONS_OVERRIDE", default_value_t = false, action = clap::ArgAction::Set)]
    service_advertise_annotations_override: bool,
    /// Routing protocol number on the kernel routes we install (`ip route show proto N`).
    #[arg(long, env = "KUBE_ROUTER_ROUTE_PROTOCOL", default_value_t = kube_router::fib::DEFAULT_ROUTE_PROTOCOL)]
    route_protocol: u8,
    /// Let a Service's backends reach themselves through it (source-NATed to the Service
    /// address). kube-router's flag; on by default here because the eBPF datapath needs no
    /// per-endpoint rules for it. Per Service: the `kube-router.io/service.hairpin` annotation.
    #[arg(long, env = "KUBE_ROUTER_HAIRPIN_MODE", default_value_t = true, action = clap::ArgAction::Set)]
    hairpin_mode: bool,
    /// Source-NAT every Service flow to the node address, not only those that need it.
    #[arg(long, env = "KUBE_ROUTER_MASQUERADE_ALL", default_value_t = false, action = clap::ArgAction::Set)]
    masquerade_all: bool,
    /// Source ports for source-NATed flows (north-south to another node, hairpin, masquerade).
    /// Keep it clear of the kernel's ephemeral range (net.ipv4.ip_local_port_range) and NodePorts.
    #[arg(long, env = "KUBE_ROUTER_SNAT_PORT_RANGE", default_value = "10000-29999", value_parser = parse_port_range)]
    snat_port_range: (u16, u16),
    /// How long an answered Service TCP flow lives idle in the datapath's conntrack, in whole
    /// seconds (1s to 7 days; 0s: 6h). Upstream: the IPVS TCP timeout.
    #[arg(long, env = "KUBE_ROUTER_SERVICE_TCP_TIMEOUT", default_value = "0s", value_parser = kube_router::flags::parse_ct_timeout)]
    service_tcp_timeout: Duration,
    /// How long a Service TCP flow lives after a FIN or RST, in whole seconds (1s to 7 days;
    /// 0s: 10s). Upstream: the IPVS TCP FIN timeout.
    #[arg(long, env = "KUBE_ROUTER_SERVICE_TCPFIN_TIMEOUT", default_value = "0s", value_parser = kube_router::flags::parse_ct_timeout)]
    service_tcpfin_timeout: Duration,
    /// How long an answered Service UDP flow lives idle, in whole seconds (1s to 7 days; 0s:
    /// 60s). Upstream: the IPVS UDP timeout.
    #[arg(long, env = "KUBE_ROUTER_SERVICE_UDP_TIMEOUT", default_value = "0s", value_parser = kube_router::flags::parse_ct_timeout)]
    service_udp_timeout: Duration,
    /// Address source-NATed flows leave with. Default: the source address of the node's default
    /// route (else its first address).
    #[arg(long, env = "KUBE_ROUTER_NODE_IP")]
    node_ip: Option<Ipv4Addr>,
    /// externalIPs must be inside one of these CIDRs (comma-separated); others are refused.
    /// Without it, --strict-external-ip-validation decides. Never accepted whatever the range:
    /// node and API server addresses, the cluster's own ranges, link-local, loopback, multicast.
    #[arg(long, env = "KUBE_ROUTER_SERVICE_EXTERNAL_IP_RANGE", value_delimiter = ',')]
    service_external_ip_range: Vec<ipnet::IpNet>,
    /// Refuse every externalIP when no --service-external-ip-range is configured, and every
    /// LoadBalancer ingress IP when no --loadbalancer-ip-range is (kube-router 2.8's flag and
    /// default); false accepts any address the other checks let through.
    #[arg(long, env = "KUBE_ROUTER_STRICT_EXTERNAL_IP_VALIDATION", default_value_t = true, action = clap::ArgAction::Set)]
    strict_external_ip_validation: bool,
    /// LoadBalancer ingress IPs must be inside one of these CIDRs (comma-separated); others are
    /// refused. Without it, --strict-external-ip-validation decides.
    #[arg(long, env = "KUBE_ROUTER_LOADBALANCER_IP_RANGE", value_delimiter = ',')]
    loadbalancer_ip_range: Vec<ipnet::IpNet>,
    /// Write the node's CNI configuration from its Node object (pod CIDRs) and create the pod
    /// bridge, as kube-router's CNI role does.
    #[arg(long, env = "KUBE_ROUTER_ENABLE_CNI", default_value_t = true, action = clap::ArgAction::Set)]
    enable_cni: bool,
    /// Where the CNI configuration is written (an existing file there is the template).
    #[arg(long, env = "KUBE_ROUTER_CNI_CONF_FILE", default_value = kube_router::cni::DEFAULT_CONF_FILE)]
    cni_conf_file: PathBuf,
    /// Set the pod network's MTU from the node's uplink.
    #[arg(long, env = "KUBE_ROUTER_AUTO_MTU", default_value_t = true, action = clap::ArgAction::Set)]
    auto_mtu: bool,
    /// How new flows choose a backend when a Service does not say (Cilium's flag): random, or
    /// maglev (consistent hashing of the client's address and port: every node picks the same
    /// backend for a flow). Per Service: `kube-router.io/service.scheduler: mh`.
    #[arg(long, env = "KUBE_ROUTER_BPF_LB_ALGORITHM", default_value = "random", value_parser = ["random", "maglev"])]
    bpf_lb_algorithm: String,
    /// Service frontends the load balancer's maps hold, per family (Cilium's flag name);
    /// backends and backend slots get four times as many. Changing it re-creates those maps at
    /// the new size on start, carrying their entries over.
    #[arg(long, env = "KUBE_ROUTER_BPF_LB_MAP_MAX", default_value_t = kube_router_common::SERVICES_MAX_ENTRIES)]
    bpf_lb_map_max: u32,
    /// Connections tracked per family, by the load balancer and by NetworkPolicy each. Changing
    /// it re-creates the conntrack maps at the new size on start, keeping every connection.
    #[arg(long, env = "KUBE_ROUTER_BPF_CT_GLOBAL_MAX", default_value_t = kube_router_common::CONNTRACK_MAX_ENTRIES)]
    bpf_ct_global_max: u32,
    /// How programs attach to interfaces: tcx (Linux 6.6+), classic (tc clsact + cls_bpf, any
    /// supported kernel), or auto (node interfaces through TCX where the kernel has it; pod veths
    /// through classic tc, which attaches in ~2 ms where TCX waits ~15 ms per program for an RCU
    /// grace period, so a new pod is policed and load-balanced sooner).
    #[arg(long, env = "KUBE_ROUTER_TC_MODE", default_value = "auto", value_parser = ["auto", "tcx", "classic"])]
    tc_mode: String,
    /// The XDP fast path on node uplinks for north-south Service flows to backends on other
    /// nodes: auto (native where the driver has it, else generic; generic on veths, whose peer
    /// must run NAPI to receive native XDP_TX frames), native, generic, or off (TC alone;
    /// removes the XDP program an earlier run attached, never another's).
    #[arg(long, env = "KUBE_ROUTER_XDP", default_value = "auto", value_parser = ["auto", "native", "generic", "off"])]
    xdp: String,
    /// Find new interfaces (pod veths) and node addresses through netlink notifications as they
    /// appear; false leaves only the 5 s rescan (a baseline for the attach-latency benchmark).
    #[arg(long, env = "KUBE_ROUTER_LINK_EVENTS", default_value_t = true, action = clap::ArgAction::Set, hide = true)]
    link_events: bool,
    /// Masquerade pod traffic to destinations outside the cluster to the node address.
    #[arg(long, env = "KUBE_ROUTER_ENABLE_POD_EGRESS", default_value_t = true, action = clap::ArgAction::Set)]
    enable_pod_egress: bool,
    /// Drop packets from a pod whose source address is not one of that pod's own (read from its
    /// network namespace), as Cilium's source IP verification and Calico's RPF check on workload
    /// interfaces do. Checked on pod veths the agent finds itself (not an --interfaces list).
    #[arg(long, env = "KUBE_ROUTER_ENABLE_POD_SOURCE_CHECK", default_value_t = true, action = clap::ArgAction::Set)]
    enable_pod_source_check: bool,
    /// CIDR range(s) of the cluster's pods (comma-separated), besides every Node's podCIDRs:
    /// traffic to them is never masqueraded.
    #[arg(long, env = "KUBE_ROUTER_CLUSTER_CIDR", value_delimiter = ',')]
    cluster_cidr: Vec<ipnet::IpNet>,
    /// The Service ClusterIP range(s) (comma-separated): inside the cluster, never masqueraded.
    #[arg(long, env = "KUBE_ROUTER_SERVICE_CLUSTER_IP_RANGE", value_delimiter = ',', default_value = "10.96.0.0/12")]
    service_cluster_ip_range: Vec<ipnet::IpNet>,
    /// Time between conntrack garbage collections (e.g. 30s, or seconds).
    #[arg(long, env = "KUBE_ROUTER_CONNTRACK_GC_INTERVAL", default_value = "30s", value_parser = parse_gc_interval)]
    conntrack_gc_interval: Duration,
    /// Log verbosity as upstream's klog `-v` (used only when RUST_LOG is unset): 0-1 info for
    /// the agent and warn for its libraries, 2-3 info, 4-5 debug for the agent, 6+ debug.
    #[arg(short = 'v', long = "v", value_name = "N")]
    v: Option<u32>,
    /// Remove this agent's pinned maps and links, its kernel routes and the graceful-restart
    /// marker, then exit (as `kube-router cleanup`; upstream removes its iptables, IPVS and ipset
    /// rules).
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    cleanup_config: bool,
    /// At start, before anything is attached, remove what upstream kube-router and kube-proxy
    /// left on the node (as `kube-router cleanup --legacy`; docs/migrating.md).
    #[arg(long, env = "KUBE_ROUTER_CLEANUP_LEGACY_ON_START", default_value_t = false, action = clap::ArgAction::Set)]
    cleanup_legacy_on_start: bool,
    #[command(flatten)]
    upstream: UpstreamOnly,
}

/// Upstream kube-router's flags that mean nothing here (docs/flags.md says why for each): they
/// parse so that upstream's DaemonSets run unchanged; given with an effect upstream, one warning
/// at start. `--run-loadbalancer` and `--netpol-default-deny` stop the agent when enabled.
#[derive(clap::Args)]
#[command(next_help_heading = "Upstream kube-router flags (no effect here, see docs/flags.md)")]
struct UpstreamOnly {
    /// Upstream: deadline for the informer caches' first sync.
    #[arg(long, value_parser = parse_go_duration)]
    cache_sync_timeout: Option<Duration>,
    /// Upstream: disable the AWS EC2 source/destination check through the AWS API.
    #[arg(long, action = clap::ArgAction::Set)]
    disable_source_dest_check: Option<bool>,
    /// Upstream: Go's pprof on port 6060.
    #[arg(long, action = clap::ArgAction::Set)]
    enable_pprof: Option<bool>,
    /// Upstream: CIDRs whose IPVS services are never deleted.
    #[arg(long, value_delimiter = ',')]
    excluded_cidrs: Option<Vec<String>>,
    /// Upstream: address of GoBGP's gRPC API.
    #[arg(long)]
    gobgp_admin_address: Option<String>,
    /// Upstream: port of GoBGP's gRPC API (0: off, which is what happens here).
    #[arg(long)]
    gobgp_admin_port: Option<u16>,
    /// Upstream: period of the injected routes' sync.
    #[arg(long, value_parser = parse_go_duration)]
    injected_routes_sync_period: Option<Duration>,
    /// Upstream: period of the iptables rules' sync.
    #[arg(long, value_parser = parse_go_duration)]
    iptables_sync_period: Option<Duration>,
    /// Upstream: how long IPVS keeps a removed destination.
    #[arg(long, value_parser = parse_go_duration)]
    ipvs_graceful_period: Option<Duration>,
    /// Upstream: IPVS graceful termination of removed destinations.
    #[arg(long, action = clap::ArgAction::Set)]
    ipvs_graceful_termination: Option<bool>,
    /// Upstream: an iptables rule accepting all traffic to Service addresses.
    #[arg(long, action = clap::ArgAction::Set)]
    ipvs_permit_all: Option<bool>,
    /// Upstream: period of the IPVS sync.
    #[arg(long, value_parser = parse_go_duration)]
    ipvs_sync_period: Option<Duration>,
    /// Upstream: the LoadBalancer address allocator takes Services without a class.
    #[arg(long, action = clap::ArgAction::Set)]
    loadbalancer_default_class: Option<bool>,
    /// Upstream: period of the LoadBalancer address allocator's check.
    #[arg(long, value_parser = parse_go_duration)]
    loadbalancer_sync_period: Option<Duration>,
    /// Upstream: pods without a policy applied yet are denied (refused when true).
    #[arg(long, action = clap::ArgAction::Set)]
    netpol_default_deny: Option<bool>,
    /// Upstream: period of the route and advertisement sync.
    #[arg(long, value_parser = parse_go_duration)]
    routes_sync_period: Option<Duration>,
    /// Upstream: the LoadBalancer address allocator (refused when true).
    #[arg(long, action = clap::ArgAction::Set)]
    run_loadbalancer: Option<bool>,
    /// Upstream: the container runtime's socket, for DSR.
    #[arg(long)]
    runtime_endpoint: Option<String>,
    /// Upstream: the NodePort range its iptables input rules admit.
    #[arg(long)]
    service_node_port_range: Option<String>,
    /// Upstream: nftables instead of iptables for NetworkPolicy.
    #[arg(long, action = clap::ArgAction::Set)]
    use_nftables_for_netpol: Option<bool>,
}

impl UpstreamOnly {
    /// The flags given with an effect upstream (so worth a warning here): set at all, except
    /// booleans and durations given their "off" value and the gRPC port given 0.
    fn given(&self) -> Vec<&'static str> {
        let on = |b: Option<bool>| b == Some(true);
        [
            ("cache-sync-timeout", self.cache_sync_timeout.is_some()),
            ("disable-source-dest-check", on(self.disable_source_dest_check)),
            ("enable-pprof", on(self.enable_pprof)),
            ("excluded-cidrs", self.excluded_cidrs.is_some()),
            ("gobgp-admin-address", self.gobgp_admin_address.is_some()),
            ("gobgp-admin-port", self.gobgp_admin_port.is_some_and(|p| p != 0)),
            ("injected-routes-sync-period", self.injected_routes_sync_period.is_some()),
            ("iptables-sync-period", self.iptables_sync_period.is_some()),
            ("ipvs-graceful-period", self.ipvs_graceful_period.is_some()),
            ("ipvs-graceful-termination", on(self.ipvs_graceful_termination)),
            ("ipvs-permit-all", self.ipvs_permit_all.is_some()),
            ("ipvs-sync-period", self.ipvs_sync_period.is_some()),
            ("loadbalancer-default-class", self.loadbalancer_default_class.is_some()),
            ("loadbalancer-sync-period", self.loadbalancer_sync_period.is_some()),
            ("netpol-default-deny", on(self.netpol_default_deny)),
            ("routes-sync-period", self.routes_sync_period.is_some()),
            ("run-loadbalancer", on(self.run_loadbalancer)),
            ("runtime-endpoint", self.runtime_endpoint.is_some()),
            ("service-node-port-range", self.service_node_port_range.is_some()),
            ("use-nftables-for-netpol", on(self.use_nftables_for_netpol)),
        ]
        .into_iter()
        .filter_map(|(flag, given)| given.then_some(flag))
        .collect()
    }

    /// Err: a refused flag was enabled (the message says why and what instead). Ok: the
    /// warnings to log, one per flag.
    fn check(&self) -> Result<Vec<String>, String> {
        let mut warnings = Vec::new();
        for flag in self.given() {
            match kube_router::flags::upstream_status(flag) {
                Some(Upstream::Refused(why)) => return Err(format!("--{flag}: {why}")),
                Some(Upstream::Obsolete(why)) => warnings.push(format!("--{flag} has no effect: {why}")),
                other => unreachable!("--{flag} is not an upstream-only flag: {other:?}"),
            }
        }
        Ok(warnings)
    }
}

#[derive(Subcommand)]
enum Command {
    /// Run the agent (the default).
    Run,
    /// Show service frontends and their backends, read from the pinned maps.
    Services {
        /// Report format: table (text) or json (docs/usage.md).
        #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
        output: kube_router::cli::Output,
    },
    /// Show conntrack entries.
    Conntrack {
        /// Report format: table (text) or json (docs/usage.md).
        #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
        output: kube_router::cli::Output,
    },
    /// Show the datapath packet counters.
    Stats {
        /// Report format: table (text) or json (docs/usage.md).
        #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
        output: kube_router::cli::Output,
    },
    /// Show BGP neighbors and routes of the running agent (asks its socket in --state-dir, else its
    /// metrics port).
    Bgp {
        /// Report format: table (text) or json (docs/usage.md).
        #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
        output: kube_router::cli::Output,
    },
    /// Show NetworkPolicy verdict counters and what the policy maps hold.
    Policy {
        /// Report format: table (text) or json (docs/usage.md).
        #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
        output: kube_router::cli::Output,
    },
    /// Show, per interface, which of our programs are attached and how (TCX or classic tc).
    Interfaces {
        /// Report format: table (text) or json (docs/usage.md).
        #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
        output: kube_router::cli::Output,
    },
    /// Show the age and contents of the checkpoint in --state-dir.
    Checkpoint {
        /// Report format: table (text) or json (docs/usage.md).
        #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
        output: kube_router::cli::Output,
    },
    /// Stream NetworkPolicy drops and new Service flows from the datapath, with pod, namespace
    /// and Service names from the checkpoint in --state-dir. Events flow only while this runs.
    Monitor {
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
        /// Which events.
        #[arg(long = "type", value_enum, default_value = "all")]
        filter: kube_router::monitor::EventFilter,
        /// Events per second per CPU the datapath may write (more are counted, not written).
        #[arg(long, default_value_t = 1000)]
        rate: u64,
    },
    /// Uninstall: remove every pinned map and link (TC and cgroup), the kernel routes of our
    /// protocol and the graceful-restart marker. Traffic to services and across nodes stops.
    /// With --legacy: instead remove what upstream kube-router and kube-proxy left behind
    /// (docs/migrating.md), only that, by its known names.
    Cleanup {
        /// Remove upstream kube-router's and kube-proxy's leftovers (their iptables chains,
        /// ipsets, nftables tables, IPVS services, kube-dummy-if, tun-* tunnels, protocol-17 pod
        /// routes), not ours.
        #[arg(long)]
        legacy: bool,
        /// With --legacy: the nodes' pod CIDRs whose protocol-17 routes are taken away (our BGP
        /// installs its own). Default: every Node's, from the API server with
        /// --master/--kubeconfig, else from the checkpoint in --state-dir.
        #[arg(long, value_delimiter = ',', requires = "legacy")]
        node_pod_cidrs: Vec<ipnet::IpNet>,
        /// Report format.
        #[arg(short = 'o', long = "output", default_value = "text", value_parser = ["text", "json"])]
        output: String,
    },
    /// Install the CNI plugins (bridge, host-local, portmap, loopback) from this image into the
    /// host's plugin directory where missing, and kube-router's CNI configuration at
    /// --cni-conf-file where there is none: the DaemonSet's init container (upstream's
    /// install-cni). Nothing already there is replaced.
    InstallCni {
        /// The host's CNI plugin directory.
        #[arg(long, default_value = kube_router::cni_install::DEFAULT_BIN_DIR)]
        cni_bin_dir: PathBuf,
        /// Where the plugins to install are (the image's copy).
        #[arg(long, default_value = kube_router::cni_install::IMAGE_PLUGIN_DIR)]
        plugin_source: PathBuf,
    },
    /// Parse and check the flags (and KUBE_ROUTER_* variables) given before it, as the agent
    /// would at start, and exit: 0 when it would start (warnings printed), 2 when it would refuse
    /// them. E.g. an upstream DaemonSet's args: `kube-router --run-router=true ... check-flags`.
    CheckFlags,
    /// Print docs/flags.md, the flag reference, generated from this command line.
    #[command(hide = true)]
    FlagsMarkdown,
}

/// A path, or empty (upstream's "unset"; dropped after parsing).
fn path_or_empty() -> impl clap::builder::TypedValueParser<Value = PathBuf> {
    clap::builder::TypedValueParser::map(clap::builder::OsStringValueParser::new(), PathBuf::from)
}

fn parse_gc_interval(text: &str) -> Result<Duration, String> {
    match parse_go_duration(text)? {
        d if d.is_zero() => Err("the interval must be more than 0".to_string()),
        d => Ok(d),
    }
}

/// A listening address; empty is upstream's "every address".
fn parse_listen_addr(text: &str) -> Result<std::net::IpAddr, String> {
    if text.is_empty() {
        return Ok(std::net::IpAddr::V4(Ipv4Addr::UNSPECIFIED));
    }
    text.parse().map_err(|_| format!("{text:?} is not an IP address"))
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

fn parse_hold_time(text: &str) -> Result<Duration, String> {
    let d = parse_go_duration(text)?;
    match d.as_secs() {
        0 | 3..=65535 => Ok(d),
        _ => Err(format!("{text}: a BGP hold time is 0 or 3s to 65535s (RFC 4271)")),
    }
}

fn parse_restart_time(text: &str) -> Result<Duration, String> {
    let d = parse_go_duration(text)?;
    if d.as_secs() > 4095 {
        return Err(format!("{text}: the graceful restart time field holds at most 4095s (RFC 4724)"));
    }
    Ok(d)
}

/// Uninstall: pinned programs, links and maps, our kernel routes and the graceful-restart marker.
fn cleanup(cli: &Cli) -> Result<()> {
    let removed = datapath::remove_all(&cli.bpf_root)?;
    println!("removed {removed} pinned objects from {}", cli.bpf_root.display());
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let routes = runtime.block_on(async {
        let fib = kube_router::fib::netlink::NetlinkRoutes::connect(cli.run.route_protocol, 254)?;
        // Reconciling towards nothing deletes exactly our routes (default routes included).
        let ops = kube_router::fib::reconcile(&fib.list().await?, &Default::default(), true).ops;
        for op in &ops {
            fib.apply(op).await.map_err(|e| anyhow::anyhow!("deleting {:?}: {}", op, e.describe()))?;
        }
        anyhow::Ok(ops.len())
    })?;
    println!("removed {routes} kernel routes with protocol {}", cli.run.route_protocol);
    let marker = cli.run.state_dir.join("bgp-graceful-restart");
    if std::fs::remove_file(&marker).is_ok() {
        println!("removed {}", marker.display());
    }
    Ok(())
}

/// `cleanup --legacy`: upstream kube-router's and kube-proxy's leftovers, reported per kind.
fn cleanup_legacy(cli: &Cli, node_pod_cidrs: &[ipnet::IpNet], json: bool) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let report = runtime.block_on(async {
        let cidrs = if node_pod_cidrs.is_empty() {
            let api = (cli.run.master.is_some() || cli.run.kubeconfig.is_some())
                .then(|| ApiOptions { kubeconfig: cli.run.kubeconfig.clone(), master: cli.run.master.clone() });
            let (cidrs, from) =
                kube_router::legacy::exec::node_pod_cidrs(api.as_ref(), &cli.run.state_dir, Duration::from_secs(10))
                    .await;
            tracing::info!(?cidrs, %from, "node pod CIDRs");
            cidrs
        } else {
            node_pod_cidrs.iter().map(|c| c.trunc()).collect()
        };
        kube_router::legacy::exec::cleanup(&cidrs).await
    })?;
    if json {
        println!("{}", report.to_json());
    } else {
        print!("{}", report.render_text());
    }
    if !report.failed.is_empty() {
        anyhow::bail!("{} removals failed", report.failed.len());
    }
    Ok(())
}

fn parse_metrics_path(path: &str) -> Result<String, String> {
    if path.starts_with('/') && !path.contains(char::is_whitespace) {
        Ok(path.to_string())
    } else {
        Err("a path starting with / without spaces".to_string())
    }
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// glibc gives each thread that allocates under contention an arena of its own (up to 8 per
/// core) and keeps what is freed in each: the watchers decode objects on tokio's workers, the
/// agent loop converts and compiles them elsewhere, and the freed memory stays spread over the
/// arenas. One arena: 10 MiB less peak RSS at 10,000 Services (`api_sync` bench), no change in
/// its change latency (the agent's allocations are not contended). The image's musl allocator
/// has no per-thread arenas.
fn limit_malloc_arenas() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only changes malloc's tunables; called before any thread is started.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}

/// The command line with pflag's boolean syntax (kube_router::flags::go_bool_flags), and the
/// boolean flags' names.
fn cli_command() -> (clap::Command, Vec<String>) {
    kube_router::flags::go_bool_flags(Cli::command())
}

fn parse_cli_from(args: impl IntoIterator<Item = std::ffi::OsString>) -> Result<Cli, clap::Error> {
    let (command, bool_flags) = cli_command();
    let matches = command.try_get_matches_from(kube_router::flags::join_bool_values(args, &bool_flags))?;
    let mut cli = Cli::from_arg_matches(&matches)?;
    cli.run.drop_empty_values();
    Ok(cli)
}

impl RunArgs {
    /// An empty string is how upstream's flags say "unset" (their defaults): read it so.
    fn drop_empty_values(&mut self) {
        fn keep<T: AsRef<std::ffi::OsStr>>(value: &mut Option<T>) {
            if value.as_ref().is_some_and(|v| v.as_ref().is_empty()) {
                *value = None;
            }
        }
        keep(&mut self.kubeconfig);
        keep(&mut self.master);
        keep(&mut self.hostname_override);
        keep(&mut self.peer_router_passwords_file);
        keep(&mut self.upstream.gobgp_admin_address);
        keep(&mut self.upstream.runtime_endpoint);
        keep(&mut self.upstream.service_node_port_range);
    }
}

/// `--hostname-override`, else `NODE_NAME` (upstream's manifests set it), else the hostname.
fn node_name(hostname_override: Option<&str>, node_name_env: Option<String>) -> String {
    hostname_override.map(str::to_string).or_else(|| node_name_env.filter(|n| !n.is_empty())).unwrap_or_else(hostname)
}

fn main() -> ExitCode {
    limit_malloc_arenas();
    let cli = parse_cli_from(std::env::args_os()).unwrap_or_else(|e| e.exit());
    // RUST_LOG wins; upstream's -v only picks the default.
    let default_filter = cli.run.v.map_or("info", kube_router::flags::log_filter_for_verbosity);
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| default_filter.into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let result = match cli.command.as_ref().unwrap_or(&Command::Run) {
        Command::Run if cli.run.cleanup_config => cleanup(&cli),
        Command::Run => run(&cli),
        Command::InstallCni { cni_bin_dir, plugin_source } => install_cni(&kube_router::cni_install::InstallOptions {
            plugin_source: plugin_source.clone(),
            bin_dir: cni_bin_dir.clone(),
            conf_file: cli.run.cni_conf_file.clone(),
        }),
        Command::CheckFlags => {
            let checked = checked_flags(&cli.run).unwrap_or_else(|message| {
                Cli::command().error(clap::error::ErrorKind::ValueValidation, message).exit()
            });
            checked.warnings.iter().for_each(|w| println!("warning: {w}"));
            println!("flags accepted ({} external peers)", checked.external_peers.len());
            Ok(())
        }
        Command::FlagsMarkdown => {
            print!("{}", kube_router::flags::markdown(&cli_command().0));
            Ok(())
        }
        Command::Services { output } => {
            cli::services::collect(&cli.bpf_root, &cli.run.state_dir).and_then(|r| cli::print(&r, *output))
        }
        Command::Conntrack { output } => cli::conntrack::collect(&cli.bpf_root).and_then(|r| cli::print(&r, *output)),
        Command::Bgp { output } => {
            cli::bgp::show(&cli.run.state_dir, cli.run.metrics_addr, cli.run.metrics_port, *output)
                .map(|page| print!("{page}"))
        }
        Command::Policy { output } => cli::policy::collect(&cli.bpf_root).and_then(|r| cli::print(&r, *output)),
        Command::Interfaces { output } => cli::interfaces::collect(&cli.bpf_root).and_then(|r| cli::print(&r, *output)),
        Command::Checkpoint { output } => {
            cli::checkpoint::collect(&cli.run.state_dir).and_then(|r| cli::print(&r, *output))
        }
        Command::Monitor { json, filter, rate } => kube_router::monitor::run(&kube_router::monitor::Options {
            pin_dir: cli.bpf_root.clone(),
            state_dir: cli.run.state_dir.clone(),
            json: *json,
            filter: *filter,
            rate_per_cpu: *rate,
        }),
        Command::Stats { output } => cli::stats::collect(&cli.bpf_root).and_then(|r| cli::print(&r, *output)),
        Command::Cleanup { legacy: false, .. } => cleanup(&cli),
        Command::Cleanup { legacy: true, node_pod_cidrs, output } => {
            cleanup_legacy(&cli, node_pod_cidrs, output == "json")
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            ExitCode::FAILURE
        }
    }
}

/// What the flags say beyond clap's parsing, checked before anything runs.
struct CheckedFlags {
    external_peers: Vec<kube_router::bgp::peers::ExternalPeerFlag>,
    /// Flags without effect here, each said once.
    warnings: Vec<String>,
}

/// The checks `run` makes before it touches anything (`check-flags` makes only these): the
/// external peer lists agree, and no upstream flag asks for what this agent cannot do.
fn checked_flags(args: &RunArgs) -> Result<CheckedFlags, String> {
    let passwords = match (&args.peer_router_passwords_file, args.peer_router_passwords.is_empty()) {
        (Some(path), true) => match std::fs::read_to_string(path) {
            Ok(text) => kube_router::bgp::peers::parse_passwords_file(&text),
            Err(e) => return Err(format!("--peer-router-passwords-file {}: {e}", path.display())),
        },
        _ => args.peer_router_passwords.clone(),
    };
    let external_peers =
        parse_external_peer_flags(&args.peer_router_ips, &args.peer_router_asns, &passwords, &args.peer_router_ports)
            .map_err(|e| e.to_string())?;
    let warnings = args.upstream.check()?;
    Ok(CheckedFlags { external_peers, warnings })
}

fn install_cni(options: &kube_router::cni_install::InstallOptions) -> Result<()> {
    let report = kube_router::cni_install::install(options)?;
    if !report.shadowing_configs.is_empty() {
        tracing::warn!(
            configs = ?report.shadowing_configs,
            "another CNI configuration sorts before {}: the container runtime uses that one (left as it is)",
            options.conf_file.display()
        );
    }
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

fn run(cli: &Cli) -> Result<()> {
    use clap::CommandFactory;
    let args = &cli.run;
    fn invalid(message: String) -> ! {
        Cli::command().error(clap::error::ErrorKind::ValueValidation, message).exit()
    }
    let CheckedFlags { external_peers, warnings } = checked_flags(args).unwrap_or_else(|message| invalid(message));
    warnings.iter().for_each(|w| tracing::warn!("{w}"));
    let node_addresses = netif::node_addresses();
    let mut disabled_families = std::collections::BTreeSet::new();
    for (flag, family, setting) in
        [("--enable-ipv4", IpFamily::IPv4, args.enable_ipv4), ("--enable-ipv6", IpFamily::IPv6, args.enable_ipv6)]
    {
        match setting {
            Some(true) if !node_addresses.iter().any(|a| IpFamily::of(a) == family) => invalid(format!(
                "{flag}: this node has no {family:?} address (loopback and link-local ones do not count): \
                 give it one, or leave the flag out to serve only the families the node has"
            )),
            Some(false) => {
                disabled_families.insert(family);
            }
            _ => {}
        }
    }
    if disabled_families.len() == 2 {
        invalid("--enable-ipv4=false and --enable-ipv6=false leave no address family to serve".to_string());
    }
    let nodeport_addresses = match (&args.nodeport_addresses, args.nodeport_bindon_all_ip) {
        (Some(list), _) => Some(list.clone()),
        (None, true) => None,
        (None, false) => {
            let v4 = args
                .node_ip
                .or_else(netif::default_route_source)
                .or_else(|| netif::ipv4_addresses().first().copied())
                .map(std::net::IpAddr::V4);
            let node_ips: Vec<std::net::IpAddr> =
                v4.into_iter().chain(netif::default_route_source_v6().map(Into::into)).collect();
            if node_ips.is_empty() {
                tracing::warn!("--nodeport-bindon-all-ip=false: the node has no address yet; NodePorts follow every address it gets");
                None
            } else {
                tracing::info!(addresses = ?node_ips, "NodePorts on the node IP only (--nodeport-bindon-all-ip=false)");
                Some(node_ips)
            }
        }
    };
    let overlay = args.enable_overlay.then(|| OverlayConfig {
        overlay_type: if args.overlay_type == "full" { OverlayType::Full } else { OverlayType::Subnet },
        encap: if args.overlay_encap == "fou" { Encap::Fou { port: args.overlay_encap_port } } else { Encap::Ipip },
    });
    let node_name = node_name(args.hostname_override.as_deref(), std::env::var("NODE_NAME").ok());
    let router = args.run_router.then(|| RouterOptions {
        node_name: node_name.clone(),
        cluster_asn: if args.cluster_asn == 0 { DEFAULT_CLUSTER_ASN } else { args.cluster_asn },
        router_id: args.router_id.unwrap_or_default(),
        pod_cidrs: args.pod_cidrs.clone(),
        external_peers,
        full_mesh: args.nodes_full_mesh,
        enable_ibgp: args.enable_ibgp,
        multihop_ttl: args.peer_router_multihop_ttl.filter(|ttl| *ttl > 0),
        max_prefixes: (args.bgp_max_prefixes > 0).then_some(args.bgp_max_prefixes),
        ttl_security: args.peer_router_ttl_security,
        advertise_pod_cidr: args.advertise_pod_cidr,
        override_next_hop: args.override_nexthop,
        accept_default: args.bgp_accept_default,
        overlay,
        bfd: args.enable_bfd.then(|| kube_router::bgp::bfd::BfdConfig {
            desired_min_tx: Duration::from_millis(u64::from(args.bfd_desired_min_tx_interval)),
            required_min_rx: Duration::from_millis(u64::from(args.bfd_required_min_rx_interval)),
            multiplier: args.bfd_detection_multiplier,
        }),
        bfd_port: args.bfd_port,
        bgp_port: args.bgp_port,
        hold_time: args.bgp_holdtime,
        graceful_restart: args.bgp_graceful_restart,
        graceful_restart_time: args.bgp_graceful_restart_time,
        graceful_restart_deferral: args.bgp_graceful_restart_deferral_time,
        route_protocol: args.route_protocol,
        route_table: 254,
        state_dir: args.state_dir.clone(),
        bpf_root: cli.bpf_root.clone(),
        advertise: AdvertiseServices {
            cluster_ip: args.advertise_cluster_ip,
            external_ip: args.advertise_external_ip,
            load_balancer_ip: args.advertise_loadbalancer_ip,
            annotations_override: args.service_advertise_annotations_override,
        },
    });
    let map_sizes = MapSizes { lb_frontends: args.bpf_lb_map_max, conntrack: args.bpf_ct_global_max };
    map_sizes.validate().map_err(anyhow::Error::msg)?;
    let config = AgentConfig {
        pin_dir: cli.bpf_root.clone(),
        source: match &args.service_file {
            Some(path) => DesiredSource::File(path.clone()),
            None => DesiredSource::Api(ApiOptions { kubeconfig: args.kubeconfig.clone(), master: args.master.clone() }),
        },
        state_dir: args.state_dir.clone(),
        max_stale: args.max_stale,
        interfaces: args.interfaces.clone(),
        node_name,
        nodeport_addresses,
        limits: Limits { max_backends_per_service: args.max_backends_per_service as usize },
        metrics_port: args.metrics_port,
        metrics_addr: args.metrics_addr,
        metrics_path: args.metrics_path.clone(),
        health_port: args.health_port,
        health_addr: args.health_addr,
        disabled_families,
        conntrack_gc_interval: args.conntrack_gc_interval,
        hairpin_mode: args.hairpin_mode,
        masquerade_all: args.masquerade_all,
        maglev_all: args.bpf_lb_algorithm == "maglev",
        snat_port_range: args.snat_port_range,
        ct_lifetimes: kube_router::flags::ct_lifetimes(
            args.service_tcp_timeout,
            args.service_tcpfin_timeout,
            args.service_udp_timeout,
        ),
        node_ip: args.node_ip,
        pod_egress: args.enable_pod_egress,
        pod_source_check: args.enable_pod_source_check,
        attach_mode: match args.tc_mode.as_str() {
            "tcx" => AttachMode::Tcx,
            "classic" => AttachMode::Classic,
            _ => AttachMode::detect(),
        },
        pod_attach_mode: match args.tc_mode.as_str() {
            "tcx" => AttachMode::Tcx,
            _ => AttachMode::Classic,
        },
        xdp: args.xdp.parse().map_err(anyhow::Error::msg)?,
        link_events: args.link_events,
        map_sizes,
        cni: args
            .enable_cni
            .then(|| agent::CniOptions { conf_file: args.cni_conf_file.clone(), auto_mtu: args.auto_mtu }),
        external_ip_ranges: args.service_external_ip_range.clone(),
        load_balancer_ip_ranges: args.loadbalancer_ip_range.clone(),
        strict_external_ip_validation: args.strict_external_ip_validation,
        api_server_addresses: Default::default(),
        cluster_cidrs: args.cluster_cidr.clone(),
        service_ranges: args.service_cluster_ip_range.clone(),
        run_service_proxy: args.run_service_proxy,
        run_firewall: args.run_firewall,
        socket_lb: SocketLbOptions {
            enabled: args.bpf_lb_sock && args.run_service_proxy,
            cgroup_root: args.cgroup_root.clone(),
        },
        router,
    };
    raise_fd_limit();
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    if args.cleanup_legacy_on_start {
        runtime.block_on(cleanup_legacy_on_start(&config));
    }
    runtime.block_on(agent::run(config))
}

/// `--cleanup-legacy-on-start`: never fatal (the agent is what repairs the node), each removal
/// and failure logged.
async fn cleanup_legacy_on_start(config: &AgentConfig) {
    let api = match &config.source {
        DesiredSource::Api(options) => Some(options),
        DesiredSource::File(_) => None,
    };
    let (cidrs, from) =
        kube_router::legacy::exec::node_pod_cidrs(api, &config.state_dir, Duration::from_secs(10)).await;
    tracing::info!(?cidrs, %from, "legacy cleanup: node pod CIDRs");
    match kube_router::legacy::exec::cleanup(&cidrs).await {
        Ok(report) => {
            for kind in kube_router::legacy::KINDS {
                let items = report.removed.get(kind).cloned().unwrap_or_default();
                tracing::info!(kind, count = items.len(), ?items, "legacy cleanup: removed");
            }
            for failure in &report.failed {
                tracing::warn!(%failure, "legacy cleanup: a removal failed");
            }
            for note in &report.notes {
                tracing::info!(%note, "legacy cleanup");
            }
        }
        Err(e) => tracing::warn!("legacy cleanup failed: {e:#}"),
    }
}

/// Raises the soft limit of open files to the hard limit, as the Go runtime does for every Go
/// program (kube-router upstream included): the soft default of 1,024 is used up by a few
/// hundred connections to the agent's servers plus its maps, links and sockets.
fn raise_fd_limit() {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit with a valid pointer to an rlimit we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(), "cannot read the open files limit");
        return;
    }
    if limit.rlim_cur >= limit.rlim_max {
        tracing::info!(soft = limit.rlim_cur, "open files limit already at its hard limit");
        return;
    }
    let before = limit.rlim_cur;
    limit.rlim_cur = limit.rlim_max;
    // SAFETY: as above.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } != 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(), soft = before, "cannot raise the open files limit");
        return;
    }
    tracing::info!(from = before, to = limit.rlim_cur, "raised the open files soft limit to the hard limit");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        parse_cli_from(std::iter::once("kube-router").chain(args.iter().copied()).map(Into::into))
    }

    fn ok(args: &[&str]) -> Cli {
        parse(args).unwrap_or_else(|e| panic!("{args:?}: {e}"))
    }

    /// Upstream's flags with their Go type and default as its `--help` prints them, transcribed
    /// from cloudnativelabs/kube-router `pkg/options/options.go` (v2.x, `AddFlags`). Slices get a
    /// sample value (their default is empty).
    const UPSTREAM_WITH_DEFAULTS: &[(&str, &str, &str)] = &[
        ("advertise-cluster-ip", "bool", "false"),
        ("advertise-external-ip", "bool", "false"),
        ("advertise-loadbalancer-ip", "bool", "false"),
        ("advertise-pod-cidr", "bool", "true"),
        ("auto-mtu", "bool", "true"),
        ("bfd-desired-min-tx-interval", "uint32", "1000"),
        ("bfd-detection-multiplier", "uint32", "3"),
        ("bfd-port", "uint32", "3784"),
        ("bfd-required-min-rx-interval", "uint32", "1000"),
        ("bgp-graceful-restart", "bool", "false"),
        ("bgp-graceful-restart-deferral-time", "duration", "6m0s"),
        ("bgp-graceful-restart-time", "duration", "1m30s"),
        ("bgp-holdtime", "duration", "1m30s"),
        ("bgp-port", "uint32", "179"),
        ("cache-sync-timeout", "duration", "1m0s"),
        ("cleanup-config", "bool", "false"),
        ("cluster-asn", "uint", "0"),
        ("disable-source-dest-check", "bool", "true"),
        ("enable-bfd", "bool", "false"),
        ("enable-cni", "bool", "true"),
        ("enable-ibgp", "bool", "true"),
        ("enable-ipv4", "bool", "true"),
        ("enable-ipv6", "bool", "false"),
        ("enable-overlay", "bool", "true"),
        ("enable-pod-egress", "bool", "true"),
        ("enable-pprof", "bool", "false"),
        ("excluded-cidrs", "strings", "10.0.0.0/8,192.168.0.0/16"),
        ("hairpin-mode", "bool", "false"),
        ("gobgp-admin-address", "string", "127.0.0.1"),
        ("gobgp-admin-port", "uint16", "50051"),
        ("health-addr", "string", ""),
        ("health-port", "uint16", "20244"),
        ("help", "bool", ""),
        ("hostname-override", "string", ""),
        ("injected-routes-sync-period", "duration", "1m0s"),
        ("iptables-sync-period", "duration", "5m0s"),
        ("ipvs-graceful-period", "duration", "30s"),
        ("ipvs-graceful-termination", "bool", "false"),
        ("ipvs-permit-all", "bool", "true"),
        ("ipvs-sync-period", "duration", "5m0s"),
        ("kubeconfig", "string", ""),
        ("loadbalancer-default-class", "bool", "true"),
        ("loadbalancer-ip-range", "strings", "192.0.2.0/24,2001:db8::/64"),
        ("loadbalancer-sync-period", "duration", "1m0s"),
        ("masquerade-all", "bool", "false"),
        ("master", "string", ""),
        ("metrics-path", "string", "/metrics"),
        ("metrics-port", "uint16", "0"),
        ("metrics-addr", "string", ""),
        ("netpol-default-deny", "bool", "false"),
        ("nodeport-bindon-all-ip", "bool", "false"),
        ("nodes-full-mesh", "bool", "true"),
        ("overlay-encap", "string", "ipip"),
        ("overlay-encap-port", "uint16", "5555"),
        ("overlay-type", "string", "subnet"),
        ("override-nexthop", "bool", "false"),
        ("peer-router-asns", "uints", "65000,65001"),
        ("peer-router-ips", "ipSlice", "192.0.2.1,192.0.2.2"),
        ("peer-router-multihop-ttl", "uint8", "0"),
        ("peer-router-passwords", "strings", "cGFzcw==,"),
        ("peer-router-passwords-file", "string", ""),
        ("peer-router-ports", "uints", "179,1179"),
        ("router-id", "string", ""),
        ("routes-sync-period", "duration", "5m0s"),
        ("run-firewall", "bool", "true"),
        ("run-loadbalancer", "bool", "false"),
        ("run-router", "bool", "true"),
        ("run-service-proxy", "bool", "true"),
        ("runtime-endpoint", "string", ""),
        ("service-cluster-ip-range", "strings", "10.96.0.0/12"),
        ("strict-external-ip-validation", "bool", "true"),
        ("service-external-ip-range", "strings", "198.51.100.0/24"),
        ("service-node-port-range", "string", "30000-32767"),
        ("service-tcp-timeout", "duration", "0s"),
        ("service-tcpfin-timeout", "duration", "0s"),
        ("service-udp-timeout", "duration", "0s"),
        ("v", "string", "0"),
        ("use-nftables-for-netpol", "bool", "false"),
        ("version", "bool", ""),
    ];

    #[test]
    fn every_upstream_flag_parses_with_its_default_and_bare() {
        let names: Vec<&str> = UPSTREAM_WITH_DEFAULTS.iter().map(|(n, _, _)| *n).collect();
        assert_eq!(names, kube_router::flags::UPSTREAM_FLAGS, "the transcription and the flags module disagree");
        for (name, kind, default) in UPSTREAM_WITH_DEFAULTS {
            if matches!(*name, "help" | "version") {
                let kind = parse(&[&format!("--{name}")]).err().map(|e| e.kind());
                assert!(matches!(
                    kind,
                    Some(clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion)
                ));
                continue;
            }
            let with_value = format!("--{name}={default}");
            let cli = ok(&[&with_value]);
            // At its upstream default no flag refuses; one without effect here warns once.
            let warnings = cli.run.upstream.check().unwrap_or_else(|e| panic!("{with_value}: {e}"));
            assert!(warnings.len() <= 1, "{with_value}: {warnings:?}");
            if *kind == "bool" {
                ok(&[&format!("--{name}")]);
                ok(&[&format!("--{name}"), "--kubeconfig=/k"]);
                ok(&[&format!("--{name}=false")]);
            } else {
                // Go's flag package also takes the value as the next argument.
                ok(&[&format!("--{name}"), default]);
            }
        }
    }

    #[test]
    fn bare_booleans_and_go_spellings() {
        let cli = ok(&["--advertise-cluster-ip", "--enable-cni=false", "--run-router=F", "--auto-mtu=0"]);
        assert!(cli.run.advertise_cluster_ip);
        assert!(!cli.run.enable_cni && !cli.run.run_router && !cli.run.auto_mtu);
        // The word after a space is the value (as this agent always read it)...
        assert!(!ok(&["--bpf-lb-sock", "false"]).run.bpf_lb_sock);
        // ...but a subcommand after a bare boolean stays a subcommand.
        let cli = ok(&["--enable-cni", "checkpoint"]);
        assert!(cli.run.enable_cni && matches!(cli.command, Some(Command::Checkpoint { .. })));
        assert!(parse(&["--enable-cni=maybe"]).is_err());
        // A repeated flag: the last wins; a repeated list appends.
        let cli = ok(&[
            "--run-firewall=false",
            "--run-firewall",
            "--service-cluster-ip-range=10.96.0.0/12",
            "--service-cluster-ip-range=fd00::/108",
        ]);
        assert!(cli.run.run_firewall);
        assert_eq!(cli.run.service_cluster_ip_range.len(), 2);
    }

    #[test]
    fn go_durations_everywhere_a_duration_is_taken() {
        let cli = ok(&[
            "--bgp-holdtime=1m30s",
            "--bgp-graceful-restart-time=2m",
            "--bgp-graceful-restart-deferral-time=2h",
            "--conntrack-gc-interval=300ms",
            "--max-stale=90",
        ]);
        assert_eq!(cli.run.bgp_holdtime, Duration::from_secs(90));
        assert_eq!(cli.run.bgp_graceful_restart_time, Duration::from_secs(120));
        assert_eq!(cli.run.bgp_graceful_restart_deferral_time, Duration::from_secs(7200));
        assert_eq!(cli.run.conntrack_gc_interval, Duration::from_millis(300));
        assert_eq!(cli.run.max_stale, Some(Duration::from_secs(90)));
        assert_eq!(ok(&["--conntrack-gc-interval", "30"]).run.conntrack_gc_interval, Duration::from_secs(30));
        assert!(parse(&["--conntrack-gc-interval=0s"]).is_err());
        assert!(parse(&["--bgp-graceful-restart-time=2h"]).is_err(), "over RFC 4724's 4095 s");
    }

    #[test]
    fn verbosity_forms() {
        for args in [&["-v", "3"][..], &["-v3"], &["-v=3"], &["--v=3"], &["--v", "3"], &["--v=1", "-v", "3"]] {
            assert_eq!(ok(args).run.v, Some(3), "{args:?}");
        }
        assert!(parse(&["--v=high"]).is_err());
    }

    #[test]
    fn router_ids_and_node_names() {
        assert_eq!(ok(&["--router-id=generate"]).run.router_id, Some(RouterIdSetting::Generate));
        assert_eq!(
            ok(&["--router-id=10.1.2.3"]).run.router_id,
            Some(RouterIdSetting::Fixed(Ipv4Addr::new(10, 1, 2, 3)))
        );
        assert!(matches!(ok(&["--router-id=2001:db8::1"]).run.router_id, Some(RouterIdSetting::Fixed(_))));
        assert_eq!(node_name(Some("a"), Some("b".into())), "a");
        assert_eq!(node_name(None, Some("b".into())), "b");
        assert_eq!(node_name(None, Some(String::new())), hostname());
        assert_eq!(ok(&["--hostname-override="]).run.hostname_override, None);
        assert_eq!(ok(&["--metrics-addr="]).run.metrics_addr, std::net::IpAddr::V4(Ipv4Addr::UNSPECIFIED));
    }

    #[test]
    fn obsolete_flags_warn_once_each_and_refused_ones_refuse() {
        let cli = ok(&[
            "--iptables-sync-period=5m",
            "--ipvs-sync-period",
            "1m",
            "--service-tcp-timeout=0s",
            "--gobgp-admin-port=0",
            "--enable-pprof=false",
            "--runtime-endpoint=unix:///run/containerd/containerd.sock",
            "--run-loadbalancer=false",
        ]);
        let warnings = cli.run.upstream.check().unwrap();
        assert_eq!(warnings.len(), 3, "{warnings:#?}");
        assert!(warnings[0].starts_with("--iptables-sync-period has no effect: "), "{warnings:?}");
        assert!(warnings[2].starts_with("--runtime-endpoint has no effect: "), "{warnings:?}");
        // Honoured now (issue 28): no warning, and the value reaches the agent's settings.
        let udp = ok(&["--service-udp-timeout=5m"]);
        assert!(udp.run.upstream.check().unwrap().is_empty());
        assert_eq!(udp.run.service_udp_timeout, Duration::from_secs(300));
        assert_eq!(ok(&[]).run.service_tcp_timeout, Duration::ZERO, "0s: the built-in lifetime");
        for refused in ["--service-tcp-timeout=100ms", "--service-tcpfin-timeout=169h", "--service-udp-timeout=200h"] {
            assert!(parse(&[refused]).is_err(), "{refused} accepted");
        }
        for refused in ["--run-loadbalancer", "--netpol-default-deny=true"] {
            let message = ok(&[refused]).run.upstream.check().unwrap_err();
            assert!(message.starts_with(refused.split('=').next().unwrap()), "{message}");
        }
    }

    include!("../tests/data/upstream_daemon_set_args.rs");

    /// The args of the upstream DaemonSet file `file`.
    fn upstream_args(file: &str) -> &'static [&'static str] {
        UPSTREAM_DAEMON_SET_ARGS.iter().find(|(files, ..)| files.contains(file)).map(|(_, args, _)| *args).unwrap()
    }

    #[test]
    fn upstream_daemon_sets_run_unchanged() {
        // Every one is accepted as `run` checks flags at start, with the peers it names.
        for (files, args, peers) in UPSTREAM_DAEMON_SET_ARGS {
            let checked = checked_flags(&ok(args).run).unwrap_or_else(|e| panic!("{files}: {e}"));
            assert_eq!(checked.external_peers.len(), *peers, "{files}");
        }
        let generic_all_features = upstream_args("generic-kuberouter-all-features.yaml");
        let kubeadm_all_features_dsr = upstream_args("kubeadm-kuberouter-all-features-dsr.yaml");
        for args in [generic_all_features, kubeadm_all_features_dsr] {
            let run = ok(args).run;
            assert!(run.run_router && run.run_firewall && run.run_service_proxy && run.bgp_graceful_restart);
            assert_eq!(run.kubeconfig.as_deref(), Some(std::path::Path::new("/var/lib/kube-router/kubeconfig")));
            assert!(run.enable_cni && run.enable_overlay && run.strict_external_ip_validation);
            assert!(!run.cleanup_config && run.nodeport_bindon_all_ip);
            assert_eq!((run.enable_ipv4, run.enable_ipv6), (None, None));
        }
        assert_eq!(ok(generic_all_features).run.upstream.check(), Ok(vec![]));
        let dsr = ok(kubeadm_all_features_dsr).run;
        assert_eq!(dsr.upstream.runtime_endpoint.as_deref(), Some("unix:///run/containerd/containerd.sock"));
        let warnings = dsr.upstream.check().unwrap();
        assert_eq!(warnings.len(), 1);
        assert!(warnings[0].starts_with("--runtime-endpoint has no effect"), "{warnings:?}");

        let run = ok(upstream_args("generic-kuberouter-only-advertise-routes.yaml")).run;
        assert!(run.run_router && !run.run_firewall && !run.run_service_proxy);
        assert!(!run.enable_cni && !run.enable_ibgp && !run.enable_overlay && run.bgp_graceful_restart);
        assert!(run.advertise_cluster_ip && run.advertise_external_ip && run.advertise_loadbalancer_ip);
        assert_eq!(run.cluster_asn, 65001);
        let peers = parse_external_peer_flags(
            &run.peer_router_ips,
            &run.peer_router_asns,
            &run.peer_router_passwords,
            &run.peer_router_ports,
        )
        .unwrap();
        assert_eq!(peers.len(), 1);
        assert_eq!(run.upstream.check(), Ok(vec![]));
    }

    /// docs/flags.md is what `kube-router flags-markdown` prints.
    #[test]
    fn docs_flags_md_is_current() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/flags.md");
        let generated = kube_router::flags::markdown(&cli_command().0);
        let written = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            written == generated,
            "docs/flags.md is out of date: run `cargo run -p kube-router -- flags-markdown > docs/flags.md`"
        );
    }
}
