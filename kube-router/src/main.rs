//! kube-router: service proxy, network policy and BGP routing for Kubernetes, on eBPF.
use std::{net::Ipv4Addr, path::PathBuf, process::ExitCode, time::Duration};

use anyhow::Result;
use clap::{Parser, Subcommand};
use kube_router::{
    agent::{self, AgentConfig, DesiredSource},
    bgp::peers::parse_external_peer_flags,
    bpf::{
        counters::read_pinned_if_exists,
        datapath::{self, AttachMode},
        layout::MapSizes,
        service_maps::{read_lb_stats, FamilyConntrack},
        socket_lb::{read_sock_stats, SocketLbOptions},
        xdp,
    },
    k8s::watch::ApiOptions,
    overlay::{Encap, OverlayConfig, OverlayType},
    router::{AdvertiseServices, RouterOptions},
    services::{
        compile::{Limits, MapContents},
        family::{AddressFamily, V4, V6},
    },
};
use kube_router_common::{
    dsr_stat, event_stat, lb_stat, map_names, sock_stat, source_check_map_names, src_stat, xdp_stat, DEFAULT_PIN_DIR,
};

#[derive(Parser)]
#[command(
    name = "kube-router",
    version,
    about = "Kubernetes service proxy, network policy and BGP routing on an eBPF datapath"
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
    #[arg(long, env = "KUBE_ROUTER_KUBECONFIG")]
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
    /// Warn (only warn) once the desired state is older than this many seconds because the API
    /// server is unreachable. Default: never.
    #[arg(long, env = "KUBE_ROUTER_MAX_STALE")]
    max_stale: Option<u64>,
    /// Interfaces to attach the load balancer to (comma-separated). Default: every interface
    /// but lo, re-scanned every 5 s.
    #[arg(long, env = "KUBE_ROUTER_INTERFACES", value_delimiter = ',')]
    interfaces: Option<Vec<String>>,
    /// Node name used for externalTrafficPolicy: Local. Default: the hostname.
    #[arg(long, env = "KUBE_ROUTER_HOSTNAME_OVERRIDE")]
    hostname_override: Option<String>,
    /// Addresses NodePorts listen on (comma-separated, either family). Default: every address
    /// of the node (IPv6: global ones).
    #[arg(long, env = "KUBE_ROUTER_NODEPORT_ADDRESSES", value_delimiter = ',')]
    nodeport_addresses: Option<Vec<std::net::IpAddr>>,
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
    #[arg(long, env = "KUBE_ROUTER_METRICS_ADDR", default_value = "127.0.0.1")]
    metrics_addr: std::net::IpAddr,
    /// Path of the Prometheus metrics on the metrics listener.
    #[arg(long, env = "KUBE_ROUTER_METRICS_PATH", default_value = "/metrics", value_parser = parse_metrics_path)]
    metrics_path: String,
    /// Port for the health endpoints /healthz, /livez and /readyz, on every address (0 disables).
    #[arg(long, env = "KUBE_ROUTER_HEALTH_PORT", default_value_t = 20244)]
    health_port: u16,
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
    /// ASN of the cluster's nodes (a node's `kube-router.io/node.asn` annotation overrides it).
    #[arg(long, env = "KUBE_ROUTER_CLUSTER_ASN", default_value_t = 64512, value_parser = clap::value_parser!(u32).range(1..=4_294_967_294))]
    cluster_asn: u32,
    /// BGP router id. Default: the node's IPv4 InternalIP (needed without the API server).
    #[arg(long, env = "KUBE_ROUTER_ROUTER_ID")]
    router_id: Option<Ipv4Addr>,
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
    #[arg(long, env = "KUBE_ROUTER_PEER_ROUTER_PASSWORDS_FILE")]
    peer_router_passwords_file: Option<PathBuf>,
    /// IP TTL for eBGP sessions with external peers (2 or more enables multihop; default 1).
    #[arg(long, env = "KUBE_ROUTER_PEER_ROUTER_MULTIHOP_TTL", value_parser = clap::value_parser!(u8).range(1..))]
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
    #[arg(long, env = "KUBE_ROUTER_BGP_GRACEFUL_RESTART_DEFERRAL_TIME", default_value = "360s", value_parser = parse_duration)]
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
    /// Address source-NATed flows leave with. Default: the source address of the node's default
    /// route (else its first address).
    #[arg(long, env = "KUBE_ROUTER_NODE_IP")]
    node_ip: Option<Ipv4Addr>,
    /// externalIPs must be inside one of these CIDRs (comma-separated); others are refused.
    /// Without it, --strict-external-ip-validation decides. Never accepted whatever the range:
    /// node and API server addresses, the cluster's own ranges, link-local, loopback, multicast.
    #[arg(long, env = "KUBE_ROUTER_SERVICE_EXTERNAL_IP_RANGE", value_delimiter = ',')]
    service_external_ip_range: Vec<ipnet::IpNet>,
    /// Refuse every externalIP when no --service-external-ip-range is configured (kube-router
    /// 2.8's flag and default); false accepts any address the other checks let through.
    #[arg(long, env = "KUBE_ROUTER_STRICT_EXTERNAL_IP_VALIDATION", default_value_t = true, action = clap::ArgAction::Set)]
    strict_external_ip_validation: bool,
    /// LoadBalancer ingress IPs must be inside one of these CIDRs (comma-separated).
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
    /// Seconds between conntrack garbage collections.
    #[arg(long, env = "KUBE_ROUTER_CONNTRACK_GC_INTERVAL", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    conntrack_gc_interval: u64,
    /// At start, before anything is attached, remove what upstream kube-router and kube-proxy
    /// left on the node (as `kube-router cleanup --legacy`; docs/migrating.md).
    #[arg(long, env = "KUBE_ROUTER_CLEANUP_LEGACY_ON_START", default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    cleanup_legacy_on_start: bool,
}

#[derive(Subcommand)]
enum Command {
    /// Run the agent (the default).
    Run,
    /// Show service frontends and their backends, read from the pinned maps.
    Services,
    /// Show conntrack entries.
    Conntrack,
    /// Show the datapath packet counters.
    Stats,
    /// Show BGP neighbors and routes of the running agent (asks its health port).
    Bgp,
    /// Show NetworkPolicy verdict counters and what the policy maps hold.
    Policy,
    /// Show, per interface, which of our programs are attached and how (TCX or classic tc).
    Interfaces,
    /// Show the age and contents of the checkpoint in --state-dir.
    Checkpoint,
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
}

/// "90", "90s", "5m", "1h" -> Duration.
fn parse_duration(text: &str) -> Result<Duration, String> {
    let (number, unit) = match text.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => text.split_at(i),
        None => (text, "s"),
    };
    let n: u64 = number.parse().map_err(|_| format!("{text:?} is not a duration like 90s, 5m or 1h"))?;
    let secs = match unit {
        "s" => n,
        "m" => n * 60,
        "h" => n * 3600,
        _ => return Err(format!("{text:?}: unknown unit {unit:?} (use s, m or h)")),
    };
    Ok(Duration::from_secs(secs))
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
    let d = parse_duration(text)?;
    match d.as_secs() {
        0 | 3..=65535 => Ok(d),
        _ => Err(format!("{text}: a BGP hold time is 0 or 3s to 65535s (RFC 4271)")),
    }
}

fn parse_restart_time(text: &str) -> Result<Duration, String> {
    let d = parse_duration(text)?;
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

fn show_policy(cli: &Cli) -> Result<()> {
    use kube_router::bpf::policy_maps::{decode, read_policy_stats, BpfPolicyMaps, PolicyMaps};
    use kube_router_common::{pol_guard_stat, pol_stat};
    for (name, n) in pol_stat::NAMES.iter().zip(read_policy_stats(&cli.bpf_root)?) {
        println!("{name} {n}");
    }
    let guard =
        read_pinned_if_exists(&cli.bpf_root, map_names::POLICY_GUARD_STATS, pol_guard_stat::COUNT)?.unwrap_or_default();
    for (name, n) in pol_guard_stat::NAMES.iter().zip(guard) {
        println!("{name} {n}");
    }
    let maps = BpfPolicyMaps::open_pinned(&cli.bpf_root)?;
    let contents = maps.read_all().map_err(|e| anyhow::anyhow!("{}: {}", e.map, e.message))?;
    let entries = decode(&contents)?;
    for (key, value) in &entries.pod_slots {
        println!(
            "pod {} {:?}: {} rule(s) in slot {}{}",
            key.pod_ip,
            key.direction,
            value.rule_count,
            value.slot.0,
            if value.rule_count == 0 { " (default deny)" } else { "" }
        );
    }
    println!(
        "{} isolated pod directions, {} port entries, {} peer prefixes",
        entries.pod_slots.len(),
        entries.slot_ports.len(),
        entries.peer_prefixes.len()
    );
    Ok(())
}

fn show_checkpoint(cli: &Cli) -> Result<()> {
    let saved = kube_router::k8s::checkpoint::read(&cli.run.state_dir)?;
    let age = kube_router::metrics::unix_now() - saved.written_unix;
    println!("checkpoint in {}: written {:.0} s ago", cli.run.state_dir.display(), age);
    println!(
        "services {}  endpointslices {}  pods {}  namespaces {}  nodes {}  networkpolicies {}",
        saved.services.len(),
        saved.endpoint_slices.len(),
        saved.pods.len(),
        saved.namespaces.len(),
        saved.nodes.len(),
        saved.network_policies.len()
    );
    Ok(())
}

fn parse_metrics_path(path: &str) -> Result<String, String> {
    if path.starts_with('/') && !path.contains(char::is_whitespace) {
        Ok(path.to_string())
    } else {
        Err("a path starting with / without spaces".to_string())
    }
}

fn show_bgp(cli: &Cli) -> Result<()> {
    use std::io::{Read, Write};
    let port = cli.run.metrics_port;
    anyhow::ensure!(port != 0, "the agent serves /bgp on its metrics listener: give its --metrics-port");
    let addr = match cli.run.metrics_addr {
        any if any.is_unspecified() => std::net::IpAddr::V4(Ipv4Addr::LOCALHOST),
        addr => addr,
    };
    let mut stream = std::net::TcpStream::connect((addr, port)).map_err(|e| {
        anyhow::anyhow!("cannot reach the agent on {addr}:{port} (--metrics-addr, --metrics-port): {e}")
    })?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.write_all(b"GET /bgp HTTP/1.0\r\n\r\n")?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let body = response.split_once("\r\n\r\n").map_or(response.as_str(), |(_, b)| b);
    print!("{body}");
    Ok(())
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

fn fmt_addr<F: AddressFamily>(addr: F::Words, port_be: u16) -> String {
    let ip: std::net::IpAddr = F::addr_from_words(addr).into();
    std::net::SocketAddr::new(ip, u16::from_be(port_be)).to_string()
}

fn show_services_of<F: AddressFamily>(contents: &MapContents<F>) {
    for (key, value) in &contents.services {
        let proto = if key.proto == 6 { "tcp" } else { "udp" };
        let backends: Vec<String> = (0..value.backend_count)
            .filter_map(|slot| {
                contents.slots.get(&kube_router_common::BackendSlotKey { service_id: value.service_id, slot })
            })
            .filter_map(|s| contents.backends.get(&s.backend_id))
            .map(|b| fmt_addr::<F>(b.addr, b.port))
            .collect();
        println!(
            "{proto} {} id={} flags={:#x} backends=[{}]",
            fmt_addr::<F>(key.addr, key.port),
            value.service_id,
            value.flags,
            backends.join(", ")
        );
    }
}

fn show_services(cli: &Cli) -> Result<()> {
    show_services_of(&agent::read_programmed(&cli.bpf_root)?);
    show_services_of(&agent::read_programmed_v6(&cli.bpf_root)?);
    Ok(())
}

fn show_conntrack<F: AddressFamily>(cli: &Cli) -> Result<()>
where
    kube_router_common::CtKey<F::Words>: aya::Pod,
    kube_router_common::CtValue<F::Words>: aya::Pod,
{
    use kube_router_common::{CT_FLAG_FULL_NAT, CT_FLAG_REVERSE};
    for (k, v) in FamilyConntrack::<F>::open_pinned(&cli.bpf_root)?.entries()? {
        let kind = if v.flags & CT_FLAG_REVERSE != 0 { "reverse" } else { "forward" };
        let nat = if v.flags & CT_FLAG_FULL_NAT != 0 { " snat" } else { "" };
        println!(
            "{}{} {} -> {} becomes {} -> {} flags={:#x} service={} backend={}",
            kind,
            nat,
            fmt_addr::<F>(k.src_addr, k.src_port),
            fmt_addr::<F>(k.dst_addr, k.dst_port),
            fmt_addr::<F>(v.nat_src_addr, v.nat_src_port),
            fmt_addr::<F>(v.nat_dst_addr, v.nat_dst_port),
            v.flags,
            v.service_id,
            v.backend_id
        );
    }
    Ok(())
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

fn main() -> ExitCode {
    limit_malloc_arenas();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    let result = match cli.command.as_ref().unwrap_or(&Command::Run) {
        Command::Run => run(&cli),
        Command::Services => show_services(&cli),
        Command::Conntrack => show_conntrack::<V4>(&cli).and_then(|()| show_conntrack::<V6>(&cli)),
        Command::Bgp => show_bgp(&cli),
        Command::Policy => show_policy(&cli),
        Command::Interfaces => datapath::attachments(&cli.bpf_root).map(|list| {
            for a in list {
                let how = match a.mode {
                    AttachMode::Tcx => "tcx",
                    AttachMode::Classic => "classic tc",
                };
                let state = if a.attached { "attached" } else { "NOT attached" };
                let id = a.program_id.map(|i| i.to_string()).unwrap_or_else(|| "?".into());
                println!("{:<16} {:<15} {how:<10} program {id:<6} {state}", a.interface, a.hook.program());
            }
            // The uplinks' XDP fast path (its mode, native or generic, is in `ip link show`).
            for a in xdp::attachments(&cli.bpf_root) {
                let state = if a.attached { "attached" } else { "NOT attached" };
                let id = a.program_id.map(|i| i.to_string()).unwrap_or_else(|| "?".into());
                println!("{:<16} {:<15} {:<10} program {id:<6} {state}", a.interface, xdp::PROGRAM, "xdp link");
            }
        }),
        Command::Checkpoint => show_checkpoint(&cli),
        Command::Monitor { json, filter, rate } => kube_router::monitor::run(&kube_router::monitor::Options {
            pin_dir: cli.bpf_root.clone(),
            state_dir: cli.run.state_dir.clone(),
            json: *json,
            filter: *filter,
            rate_per_cpu: *rate,
        }),
        Command::Stats => read_lb_stats(&cli.bpf_root).map(|stats| {
            for (name, n) in lb_stat::NAMES.iter().zip(stats) {
                println!("{name} {n}");
            }
            // The XDP fast path's counters, if it ever ran.
            for (name, n) in
                xdp_stat::NAMES.iter().zip(xdp::read_stats(&cli.bpf_root).ok().flatten().unwrap_or_default())
            {
                println!("xdp_{name} {n}");
            }
            // Direct server return's counters, if the datapath ever had them.
            let dsr = read_pinned_if_exists(&cli.bpf_root, map_names::DSR_STATS, dsr_stat::COUNT);
            for (name, n) in dsr_stat::NAMES.iter().zip(dsr.ok().flatten().unwrap_or_default()) {
                println!("dsr_{name} {n}");
            }
            let source_check =
                read_pinned_if_exists(&cli.bpf_root, source_check_map_names::SOURCE_CHECK_STATS, src_stat::COUNT);
            for (name, n) in src_stat::NAMES.iter().zip(source_check.ok().flatten().unwrap_or_default()) {
                println!("src_check_{name} {n}");
            }
            // The socket load balancer's counters, if it ever ran.
            for (name, n) in sock_stat::NAMES.iter().zip(read_sock_stats(&cli.bpf_root).unwrap_or_default()) {
                println!("sock_{name} {n}");
            }
            // `kube-router monitor`'s events: written, over the rate limit, lost to a full ring.
            for (name, n) in
                event_stat::NAMES.iter().zip(kube_router::monitor::read_stats(&cli.bpf_root).unwrap_or_default())
            {
                println!("monitor_{name} {n}");
            }
        }),
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

fn run(cli: &Cli) -> Result<()> {
    use clap::CommandFactory;
    let args = &cli.run;
    fn invalid(message: String) -> ! {
        Cli::command().error(clap::error::ErrorKind::ValueValidation, message).exit()
    }
    let passwords = match (&args.peer_router_passwords_file, args.peer_router_passwords.is_empty()) {
        (Some(path), true) => match std::fs::read_to_string(path) {
            Ok(text) => kube_router::bgp::peers::parse_passwords_file(&text),
            Err(e) => invalid(format!("--peer-router-passwords-file {}: {e}", path.display())),
        },
        _ => args.peer_router_passwords.clone(),
    };
    let external_peers = match parse_external_peer_flags(
        &args.peer_router_ips,
        &args.peer_router_asns,
        &passwords,
        &args.peer_router_ports,
    ) {
        Ok(peers) => peers,
        Err(e) => invalid(e.to_string()),
    };
    let overlay = args.enable_overlay.then(|| OverlayConfig {
        overlay_type: if args.overlay_type == "full" { OverlayType::Full } else { OverlayType::Subnet },
        encap: if args.overlay_encap == "fou" { Encap::Fou { port: args.overlay_encap_port } } else { Encap::Ipip },
    });
    let node_name = args.hostname_override.clone().unwrap_or_else(hostname);
    let router = args.run_router.then(|| RouterOptions {
        node_name: node_name.clone(),
        cluster_asn: args.cluster_asn,
        router_id: args.router_id,
        pod_cidrs: args.pod_cidrs.clone(),
        external_peers,
        full_mesh: args.nodes_full_mesh,
        enable_ibgp: args.enable_ibgp,
        multihop_ttl: args.peer_router_multihop_ttl,
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
        // Filled in by the agent from the same flags as the service proxy's.
        external_ips: Default::default(),
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
        max_stale: args.max_stale.map(Duration::from_secs),
        interfaces: args.interfaces.clone(),
        node_name,
        nodeport_addresses: args.nodeport_addresses.clone(),
        limits: Limits { max_backends_per_service: args.max_backends_per_service as usize },
        metrics_port: args.metrics_port,
        metrics_addr: args.metrics_addr,
        metrics_path: args.metrics_path.clone(),
        health_port: args.health_port,
        conntrack_gc_interval: Duration::from_secs(args.conntrack_gc_interval),
        hairpin_mode: args.hairpin_mode,
        masquerade_all: args.masquerade_all,
        maglev_all: args.bpf_lb_algorithm == "maglev",
        snat_port_range: args.snat_port_range,
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
