//! BGP pod routing: the speaker, its peers (nodes and external), what it advertises, graceful
//! restart, BFD, the overlay, and the kernel routes it installs.
use std::{path::PathBuf, time::Duration};

use super::{drop_if_empty, parse_go_duration, path_or_empty};
use crate::{
    routing::bgp::{
        bfd::BfdConfig,
        peers::{parse_external_peer_flags, ExternalPeerFlag, RouterIdSetting, DEFAULT_CLUSTER_ASN},
    },
    routing::overlay::{Encap, OverlayConfig, OverlayType},
    routing::router::{AdvertiseServices, RouterOptions},
};

/// `--run-router`, the peers, advertisements, graceful restart and kernel routes.
#[derive(clap::Args, Debug, Clone)]
#[command(next_help_heading = "BGP routing")]
pub struct RoutingFlags {
    /// Advertise this node's pod CIDR over BGP and install the routes learned from peers.
    #[arg(long, env = "KUBE_ROUTER_RUN_ROUTER", default_value_t = true, action = clap::ArgAction::Set)]
    pub run_router: bool,
    /// ASN of the cluster's nodes (a node's `kube-router.io/node.asn` annotation overrides it);
    /// 0 is upstream's "unset": 64512.
    #[arg(long, env = "KUBE_ROUTER_CLUSTER_ASN", default_value_t = 64512, value_parser = clap::value_parser!(u32).range(0..=4_294_967_294))]
    pub cluster_asn: u32,
    /// BGP router id: an IPv4 address; an IPv6 address (hashed to 32 bits, FNV-1a); or
    /// "generate" (the node IP hashed so, as upstream: for IPv6-only nodes). Default: the node's
    /// `kube-router.io/bgp-router-id` annotation, else its IPv4 InternalIP. A fixed one is needed
    /// without the API server.
    #[arg(long, env = "KUBE_ROUTER_ROUTER_ID", value_parser = crate::flags::parse_router_id)]
    pub router_id: Option<RouterIdSetting>,
    /// Prefixes to advertise instead of the Node's spec.podCIDRs (comma-separated).
    #[arg(long, env = "KUBE_ROUTER_POD_CIDRS", value_delimiter = ',')]
    pub pod_cidrs: Option<Vec<ipnet::IpNet>>,
    /// External BGP peers every node peers with (comma-separated addresses).
    #[arg(long, env = "KUBE_ROUTER_PEER_ROUTER_IPS", value_delimiter = ',')]
    pub peer_router_ips: Vec<String>,
    /// ASN of each --peer-router-ips entry, in the same order.
    #[arg(long, env = "KUBE_ROUTER_PEER_ROUTER_ASNS", value_delimiter = ',')]
    pub peer_router_asns: Vec<String>,
    /// Base64-encoded TCP MD5 password of each --peer-router-ips entry (empty for none).
    #[arg(long, env = "KUBE_ROUTER_PEER_ROUTER_PASSWORDS", value_delimiter = ',', hide_env_values = true)]
    pub peer_router_passwords: Vec<String>,
    /// Every node runs --cluster-asn and peers with every other node (iBGP full mesh). When
    /// false, each node's ASN is its kube-router.io/node.asn annotation and it peers only with
    /// nodes of the same ASN (per-rack designs); route-reflector annotations apply either way.
    #[arg(long, env = "KUBE_ROUTER_NODES_FULL_MESH", default_value_t = true, action = clap::ArgAction::Set)]
    pub nodes_full_mesh: bool,
    /// Peer with the other nodes at all (mesh, same-ASN rack or route reflection); when false
    /// only external peers are configured.
    #[arg(long, env = "KUBE_ROUTER_ENABLE_IBGP", default_value_t = true, action = clap::ArgAction::Set)]
    pub enable_ibgp: bool,
    /// Port of each --peer-router-ips entry (empty entries: --bgp-port).
    #[arg(long, env = "KUBE_ROUTER_PEER_ROUTER_PORTS", value_delimiter = ',')]
    pub peer_router_ports: Vec<String>,
    /// File with the --peer-router-passwords (base64, comma-separated, one line); the flag wins
    /// if both are set.
    #[arg(long, env = "KUBE_ROUTER_PEER_ROUTER_PASSWORDS_FILE", value_parser = path_or_empty())]
    pub peer_router_passwords_file: Option<PathBuf>,
    /// IP TTL for eBGP sessions with external peers (2 or more enables multihop; 0 or unset: 1).
    #[arg(long, env = "KUBE_ROUTER_PEER_ROUTER_MULTIHOP_TTL")]
    pub peer_router_multihop_ttl: Option<u8>,
    /// GTSM (RFC 5082) with external peers: send with TTL 255, drop their packets that arrive
    /// with less (less 255 - (--peer-router-multihop-ttl - 1) with multihop); per peer:
    /// `ttlsecurity` in the kube-router.io/peers annotation.
    #[arg(long, env = "KUBE_ROUTER_PEER_ROUTER_TTL_SECURITY", default_value_t = false, action = clap::ArgAction::Set)]
    pub peer_router_ttl_security: bool,
    /// Most prefixes per address family a BGP peer may send; one more closes the session
    /// (Cease, RFC 4486) and holds it down for 30 s, doubling per repeat up to 15 min. 0: no
    /// limit. Per peer: `maxprefixes` in the kube-router.io/peers annotation.
    #[arg(long, env = "KUBE_ROUTER_BGP_MAX_PREFIXES", default_value_t = crate::routing::bgp::peers::DEFAULT_MAX_PREFIXES)]
    pub bgp_max_prefixes: u32,
    /// External peers get the session's own address as next hop instead of the node IP.
    #[arg(long, env = "KUBE_ROUTER_OVERRIDE_NEXTHOP", default_value_t = false, action = clap::ArgAction::Set)]
    pub override_nexthop: bool,
    /// Advertise the node's pod CIDRs to external peers (node peers always get them).
    #[arg(long, env = "KUBE_ROUTER_ADVERTISE_POD_CIDR", default_value_t = true, action = clap::ArgAction::Set)]
    pub advertise_pod_cidr: bool,
    /// Accept default routes (0.0.0.0/0, ::/0) from every peer; per peer: `acceptdefault: true`
    /// in the kube-router.io/peers annotation. A default route never replaces the node's own.
    #[arg(long, env = "KUBE_ROUTER_BGP_ACCEPT_DEFAULT", default_value_t = false, action = clap::ArgAction::Set)]
    pub bgp_accept_default: bool,
    /// TCP port for BGP, listened on and connected to.
    #[arg(long, env = "KUBE_ROUTER_BGP_PORT", default_value_t = 179, value_parser = clap::value_parser!(u16).range(1..))]
    pub bgp_port: u16,
    /// BGP hold time proposed to peers (e.g. 90s; 0 disables keepalives, else at least 3s).
    #[arg(long, env = "KUBE_ROUTER_BGP_HOLDTIME", default_value = "90s", value_parser = parse_hold_time)]
    pub bgp_holdtime: Duration,
    /// BGP graceful restart (RFC 4724): peers keep our routes while the agent restarts, and we
    /// keep theirs while they do.
    #[arg(long, env = "KUBE_ROUTER_BGP_GRACEFUL_RESTART", default_value_t = true, action = clap::ArgAction::Set)]
    pub bgp_graceful_restart: bool,
    /// Restart time advertised to peers: how long they keep our routes (at most 4095s).
    #[arg(long, env = "KUBE_ROUTER_BGP_GRACEFUL_RESTART_TIME", default_value = "90s", value_parser = parse_restart_time)]
    pub bgp_graceful_restart_time: Duration,
    /// After a start, the longest wait for peers' End-of-RIB before stale kernel routes go.
    #[arg(long, env = "KUBE_ROUTER_BGP_GRACEFUL_RESTART_DEFERRAL_TIME", default_value = "360s", value_parser = parse_go_duration)]
    pub bgp_graceful_restart_deferral_time: Duration,
    /// Advertise every Service's ClusterIP(s) over BGP as host routes.
    #[arg(long, env = "KUBE_ROUTER_ADVERTISE_CLUSTER_IP", default_value_t = false, action = clap::ArgAction::Set)]
    pub advertise_cluster_ip: bool,
    /// Advertise every Service's externalIPs over BGP as host routes.
    #[arg(long, env = "KUBE_ROUTER_ADVERTISE_EXTERNAL_IP", default_value_t = false, action = clap::ArgAction::Set)]
    pub advertise_external_ip: bool,
    /// Advertise every Service's LoadBalancer ingress IPs over BGP as host routes.
    #[arg(long, env = "KUBE_ROUTER_ADVERTISE_LOADBALANCER_IP", default_value_t = false, action = clap::ArgAction::Set)]
    pub advertise_loadbalancer_ip: bool,
    /// Let a Service's kube-router.io/service.advertise.<kind>: "true" annotation advertise
    /// what the --advertise-* flags leave out. Default: the annotations can only narrow them
    /// ("false"), so a namespace user cannot make every node announce prefixes.
    #[arg(long, env = "KUBE_ROUTER_SERVICE_ADVERTISE_ANNOTATIONS_OVERRIDE", default_value_t = false, action = clap::ArgAction::Set)]
    pub service_advertise_annotations_override: bool,
    /// Routing protocol number on the kernel routes we install (`ip route show proto N`).
    #[arg(long, env = "KUBE_ROUTER_ROUTE_PROTOCOL", default_value_t = crate::routing::fib::DEFAULT_ROUTE_PROTOCOL)]
    pub route_protocol: u8,
}

/// `--enable-bfd` and its timers.
#[derive(clap::Args, Debug, Clone)]
#[command(next_help_heading = "BFD")]
pub struct BfdFlags {
    /// BFD (RFC 5880/5881) on the sessions with external peers: a dead link takes the BGP
    /// session down within --bfd-detection-multiplier x the negotiated interval.
    #[arg(long, env = "KUBE_ROUTER_ENABLE_BFD", default_value_t = false, action = clap::ArgAction::Set)]
    pub enable_bfd: bool,
    /// UDP port of BFD control packets.
    #[arg(long, env = "KUBE_ROUTER_BFD_PORT", default_value_t = 3784, value_parser = clap::value_parser!(u16).range(1..))]
    pub bfd_port: u16,
    /// Milliseconds between our BFD packets (the peer may ask for fewer).
    #[arg(long, env = "KUBE_ROUTER_BFD_DESIRED_MIN_TX_INTERVAL", default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=4_294_967))]
    pub bfd_desired_min_tx_interval: u32,
    /// Milliseconds: the fastest rate we accept BFD packets at.
    #[arg(long, env = "KUBE_ROUTER_BFD_REQUIRED_MIN_RX_INTERVAL", default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=4_294_967))]
    pub bfd_required_min_rx_interval: u32,
    /// Missed BFD intervals before the peer is declared down (1-255).
    #[arg(long, env = "KUBE_ROUTER_BFD_DETECTION_MULTIPLIER", default_value_t = 3, value_parser = clap::value_parser!(u8).range(1..))]
    pub bfd_detection_multiplier: u8,
}

/// `--enable-overlay` and its tunnels.
#[derive(clap::Args, Debug, Clone)]
#[command(next_help_heading = "Overlay")]
pub struct OverlayFlags {
    /// Tunnel pod traffic to nodes on other subnets (see --overlay-type, --overlay-encap).
    #[arg(long, env = "KUBE_ROUTER_ENABLE_OVERLAY", default_value_t = true, action = clap::ArgAction::Set)]
    pub enable_overlay: bool,
    /// "subnet": tunnel only to nodes on other subnets; "full": to every node.
    #[arg(long, env = "KUBE_ROUTER_OVERLAY_TYPE", default_value = "subnet", value_parser = ["subnet", "full"])]
    pub overlay_type: String,
    /// "ipip", or "fou" (IPIP in UDP with a GUE header on --overlay-encap-port).
    #[arg(long, env = "KUBE_ROUTER_OVERLAY_ENCAP", default_value = "ipip", value_parser = ["ipip", "fou"])]
    pub overlay_encap: String,
    /// UDP port for --overlay-encap=fou.
    #[arg(long, env = "KUBE_ROUTER_OVERLAY_ENCAP_PORT", default_value_t = 5555, value_parser = clap::value_parser!(u16).range(1..))]
    pub overlay_encap_port: u16,
}

/// What the router needs besides its own flags.
pub struct RouterContext {
    pub node_name: String,
    pub state_dir: PathBuf,
    pub bpf_root: PathBuf,
    /// The checked `--peer-router-*` lists ([`RoutingFlags::external_peers`]).
    pub external_peers: Vec<ExternalPeerFlag>,
}

impl RoutingFlags {
    /// The `--peer-router-*` lists, one peer per address; Err when they disagree or the
    /// passwords file cannot be read. The passwords flag wins over the file.
    pub fn external_peers(&self) -> Result<Vec<ExternalPeerFlag>, String> {
        let passwords = match (&self.peer_router_passwords_file, self.peer_router_passwords.is_empty()) {
            (Some(path), true) => match std::fs::read_to_string(path) {
                Ok(text) => crate::routing::bgp::peers::parse_passwords_file(&text),
                Err(e) => return Err(format!("--peer-router-passwords-file {}: {e}", path.display())),
            },
            _ => self.peer_router_passwords.clone(),
        };
        parse_external_peer_flags(&self.peer_router_ips, &self.peer_router_asns, &passwords, &self.peer_router_ports)
            .map_err(|e| e.to_string())
    }

    /// The router's options (`None` with `--run-router=false`).
    pub fn router_options(
        &self,
        bfd: &BfdFlags,
        overlay: &OverlayFlags,
        context: RouterContext,
    ) -> Option<RouterOptions> {
        self.run_router.then(|| RouterOptions {
            node_name: context.node_name,
            cluster_asn: if self.cluster_asn == 0 { DEFAULT_CLUSTER_ASN } else { self.cluster_asn },
            router_id: self.router_id.unwrap_or_default(),
            pod_cidrs: self.pod_cidrs.clone(),
            external_peers: context.external_peers,
            full_mesh: self.nodes_full_mesh,
            enable_ibgp: self.enable_ibgp,
            multihop_ttl: self.peer_router_multihop_ttl.filter(|ttl| *ttl > 0),
            max_prefixes: (self.bgp_max_prefixes > 0).then_some(self.bgp_max_prefixes),
            ttl_security: self.peer_router_ttl_security,
            advertise_pod_cidr: self.advertise_pod_cidr,
            override_next_hop: self.override_nexthop,
            accept_default: self.bgp_accept_default,
            overlay: overlay.into(),
            bfd: bfd.into(),
            bfd_port: bfd.bfd_port,
            bgp_port: self.bgp_port,
            hold_time: self.bgp_holdtime,
            graceful_restart: self.bgp_graceful_restart,
            graceful_restart_time: self.bgp_graceful_restart_time,
            graceful_restart_deferral: self.bgp_graceful_restart_deferral_time,
            route_protocol: self.route_protocol,
            route_table: 254,
            state_dir: context.state_dir,
            bpf_root: context.bpf_root,
            advertise: self.into(),
        })
    }

    pub(super) fn drop_empty_values(&mut self) {
        drop_if_empty(&mut self.peer_router_passwords_file);
    }
}

impl From<&RoutingFlags> for AdvertiseServices {
    fn from(flags: &RoutingFlags) -> Self {
        AdvertiseServices {
            cluster_ip: flags.advertise_cluster_ip,
            external_ip: flags.advertise_external_ip,
            load_balancer_ip: flags.advertise_loadbalancer_ip,
            annotations_override: flags.service_advertise_annotations_override,
        }
    }
}

impl From<&BfdFlags> for Option<BfdConfig> {
    /// `--enable-bfd`: BFD for the external peers, with the timers in milliseconds.
    fn from(flags: &BfdFlags) -> Self {
        flags.enable_bfd.then(|| BfdConfig {
            desired_min_tx: Duration::from_millis(u64::from(flags.bfd_desired_min_tx_interval)),
            required_min_rx: Duration::from_millis(u64::from(flags.bfd_required_min_rx_interval)),
            multiplier: flags.bfd_detection_multiplier,
        })
    }
}

impl From<&OverlayFlags> for Option<OverlayConfig> {
    fn from(flags: &OverlayFlags) -> Self {
        flags.enable_overlay.then(|| OverlayConfig {
            overlay_type: if flags.overlay_type == "full" { OverlayType::Full } else { OverlayType::Subnet },
            encap: if flags.overlay_encap == "fou" {
                Encap::Fou { port: flags.overlay_encap_port }
            } else {
                Encap::Ipip
            },
        })
    }
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
