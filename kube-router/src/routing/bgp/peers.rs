//! Derivation of this node's BGP configuration from Kubernetes `Node` objects plus command-line flags.
//!
//! Size (about 1,240 lines before its tests): one pure derivation whose parsers (flags,
//! `peer.*` lists, the `peers` YAML, route-reflector roles, the mesh model) share their error
//! and warning types; splitting parsing from derivation is left for its own change.
//!
//! This module is pure: it performs no I/O and holds no state. The caller feeds it the current list of
//! `Node` objects (e.g. from an informer cache) and the agent's [`GlobalSettings`], and gets back a fully
//! resolved [`NodeBgpConfig`] (router id, local ASN, prefixes to advertise, and a sorted, de-duplicated
//! peer list) together with non-fatal [`PeerConfigWarning`]s the caller should log.
//!
//! Semantics follow kube-router's documented annotations (`docs/bgp.md`):
//!
//! | annotation                       | meaning                                                     |
//! |----------------------------------|-------------------------------------------------------------|
//! | `kube-router.io/node.asn`        | the node's own ASN (default: cluster ASN)                   |
//! | `kube-router.io/bgp-router-id`   | explicit IPv4 router id for the node                        |
//! | `kube-router.io/rr.server`       | node is a route-reflector server for the given cluster id  |
//! | `kube-router.io/rr.client`       | node is a route-reflector client of the given cluster id   |
//! | `kube-router.io/peer.ips`        | per-node external peers (comma-separated IPs)               |
//! | `kube-router.io/peer.asns`       | their ASNs (comma-separated)                                |
//! | `kube-router.io/peer.passwords`  | their TCP-MD5 passwords, base64, comma-separated (optional) |
//! | `kube-router.io/peer.ports`      | their ports, comma-separated (optional)                     |
//! | `kube-router.io/peer.localips`   | local address of each session, comma-separated (optional)   |
//! | `kube-router.io/peers`           | YAML list of `{remoteip, remoteasn, localip?, password?, port?, acceptdefault?}`; wins over the `peer.*` lists |
//! | `kube-router.io/bgp-local-addresses` | addresses the BGP listener binds to (default: all)      |
//! | `kube-router.io/path-prepend.as`, `.repeat-n` | AS-path prepend towards external peers         |
//! | `kube-router.io/node.bgp.communities` | communities added towards external peers               |
//! | `kube-router.io/node.bgp.customimportreject` | prefixes never imported                         |
//!
//! Peering model (kube-router's): with `--nodes-full-mesh` (default) every node runs the
//! cluster ASN and peers with every other node; with `--nodes-full-mesh=false` each node takes
//! its ASN from `kube-router.io/node.asn` (required) and peers only with nodes of the same ASN
//! (per-rack designs). Route-reflector roles apply in both modes; `--enable-ibgp=false` drops
//! node peers altogether.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr};

use base64::Engine as _;
use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node;

use super::{
    bfd::BfdConfig,
    policy::{parse_community, AsPrepend},
};

/// Annotation holding a node's own ASN.
pub const NODE_ASN_ANNOTATION: &str = "kube-router.io/node.asn";
/// Annotation holding an explicit IPv4 BGP router id.
pub const ROUTER_ID_ANNOTATION: &str = "kube-router.io/bgp-router-id";
/// Annotation marking a node as route-reflector server; value is the cluster id.
pub const RR_SERVER_ANNOTATION: &str = "kube-router.io/rr.server";
/// Annotation marking a node as route-reflector client; value is the cluster id.
pub const RR_CLIENT_ANNOTATION: &str = "kube-router.io/rr.client";
/// Annotation listing per-node external peer IPs.
pub const PEER_IPS_ANNOTATION: &str = "kube-router.io/peer.ips";
/// Annotation listing per-node external peer ASNs.
pub const PEER_ASNS_ANNOTATION: &str = "kube-router.io/peer.asns";
/// Annotation listing per-node external peer passwords (base64). Named where the checkpoint
/// strips it (the API layer knows which annotations carry secrets).
pub use crate::k8s::checkpoint::PEER_PASSWORDS_ANNOTATION;
/// Annotation listing per-node external peer ports.
pub const PEER_PORTS_ANNOTATION: &str = "kube-router.io/peer.ports";
/// Annotation listing the local address of each per-node external peer session.
pub const PEER_LOCAL_IPS_ANNOTATION: &str = "kube-router.io/peer.localips";
/// The consolidated per-node peer annotation (YAML), kube-router's recommended form.
pub use crate::k8s::checkpoint::PEERS_ANNOTATION;
/// Addresses the BGP listener binds to.
pub const LOCAL_ADDRESSES_ANNOTATION: &str = "kube-router.io/bgp-local-addresses";
/// AS prepended towards external peers...
pub const PATH_PREPEND_AS_ANNOTATION: &str = "kube-router.io/path-prepend.as";
/// ...this many times.
pub const PATH_PREPEND_REPEAT_ANNOTATION: &str = "kube-router.io/path-prepend.repeat-n";
/// Communities added to what external peers receive.
pub const COMMUNITIES_ANNOTATION: &str = "kube-router.io/node.bgp.communities";
/// Prefixes (and anything inside them) never imported from any peer.
pub const CUSTOM_IMPORT_REJECT_ANNOTATION: &str = "kube-router.io/node.bgp.customimportreject";

/// Flag names used in error messages for [`parse_external_peer_flags`].
pub const PEER_IPS_FLAG: &str = "--peer-router-ips";
/// See [`PEER_IPS_FLAG`].
pub const PEER_ASNS_FLAG: &str = "--peer-router-asns";
/// See [`PEER_IPS_FLAG`].
pub const PEER_PASSWORDS_FLAG: &str = "--peer-router-passwords";

/// Default BGP port.
pub const DEFAULT_BGP_PORT: u16 = 179;
/// kube-router's default cluster ASN.
pub const DEFAULT_CLUSTER_ASN: u32 = 64512;
/// Maximum TCP-MD5 key length (`TCP_MD5SIG_MAXKEYLEN` in Linux).
pub const MAX_PASSWORD_LEN: usize = 80;

/// `--bgp-max-prefixes` default, per peer and family. A node peer of a route reflector in a
/// 5,000-node cluster learns every pod CIDR and Service VIP (a few tens of thousands at most);
/// a full Internet table (about a million IPv4 prefixes) sent by mistake is stopped.
pub const DEFAULT_MAX_PREFIXES: u32 = 100_000;

const MIN_ASN: u32 = 1;
const MAX_ASN: u32 = 4_294_967_294;

/// What kind of peer a [`PeerConfig`] is.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum PeerKind {
    /// Another cluster node (iBGP mesh or route reflection).
    Node { name: String },
    /// A router outside the cluster (from flags or per-node annotations).
    External,
}

/// One BGP neighbor of this node.
#[derive(Clone, PartialEq, Eq)]
pub struct PeerConfig {
    pub address: IpAddr,
    pub asn: u32,
    /// TCP-MD5 password, already base64-decoded.
    pub password: Option<String>,
    pub port: u16,
    /// Never initiate the session. Nothing in kube-router's flags/annotations sets this; always `false` here.
    pub passive: bool,
    /// This node is an RR server and the peer is one of its clients.
    pub route_reflector_client: bool,
    pub kind: PeerKind,
    /// Our address for the session (the outgoing connection binds to it).
    pub local_address: Option<IpAddr>,
    /// IP TTL of an eBGP session's packets (`--peer-router-multihop-ttl`); None: 1 for eBGP
    /// (directly connected), the system default for iBGP.
    pub multihop_ttl: Option<u8>,
    /// Default routes from this peer are accepted (`acceptdefault` in `kube-router.io/peers`).
    pub accept_default: bool,
    /// BFD watches the session (`--enable-bfd` for external peers, `bfd` in `kube-router.io/peers`).
    pub bfd: Option<BfdConfig>,
    /// Most prefixes per family the peer may send (`--bgp-max-prefixes`, `maxprefixes` in
    /// `kube-router.io/peers`); one more ends the session with Cease 1 (RFC 4486). None: no limit.
    pub max_prefixes: Option<u32>,
    /// GTSM (RFC 5082, `--peer-router-ttl-security`, `ttlsecurity` in `kube-router.io/peers`):
    /// send with TTL 255 and drop the session's packets that arrive with less than 255 minus
    /// the allowed hops (`multihop_ttl` - 1).
    pub ttl_security: bool,
}

// Hand-written so that passwords never end up in logs via `{:?}`.
impl fmt::Debug for PeerConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PeerConfig")
            .field("address", &self.address)
            .field("asn", &self.asn)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("port", &self.port)
            .field("passive", &self.passive)
            .field("route_reflector_client", &self.route_reflector_client)
            .field("kind", &self.kind)
            .field("local_address", &self.local_address)
            .field("multihop_ttl", &self.multihop_ttl)
            .field("accept_default", &self.accept_default)
            .field("bfd", &self.bfd)
            .field("max_prefixes", &self.max_prefixes)
            .field("ttl_security", &self.ttl_security)
            .finish()
    }
}

/// An external peer given on the command line.
#[derive(Clone, PartialEq, Eq)]
pub struct ExternalPeerFlag {
    pub address: IpAddr,
    pub asn: u32,
    /// Already base64-decoded.
    pub password: Option<String>,
    /// `--peer-router-ports`; None: the default port.
    pub port: Option<u16>,
}

impl ExternalPeerFlag {
    /// The session configuration for this peer (`port` unless it has its own).
    pub fn peer_config(&self, port: u16) -> PeerConfig {
        external_peer(self.address, self.asn, self.password.clone(), self.port.unwrap_or(port))
    }

    /// The session configuration with the agent-wide settings for external peers applied.
    pub fn external_peer_config(&self, settings: &GlobalSettings) -> PeerConfig {
        let mut peer = self.peer_config(settings.peer_port);
        peer.multihop_ttl = settings.multihop_ttl;
        peer.bfd = settings.bfd;
        peer.max_prefixes = settings.max_prefixes;
        peer.ttl_security = settings.ttl_security;
        peer
    }
}

impl fmt::Debug for ExternalPeerFlag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExternalPeerFlag")
            .field("address", &self.address)
            .field("asn", &self.asn)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("port", &self.port)
            .finish()
    }
}

/// Agent-wide settings (from flags).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GlobalSettings {
    /// Name of the node this agent runs on.
    pub node_name: String,
    /// `--cluster-asn`, default 64512.
    pub cluster_asn: u32,
    /// `--enable-ibgp`, default true. When false no node peers (mesh or RR) are configured.
    pub enable_ibgp: bool,
    /// `--nodes-full-mesh`, default true: every node runs the cluster ASN and peers with every
    /// other node. When false each node's ASN comes from its `kube-router.io/node.asn` and it
    /// peers only with nodes of the same ASN.
    pub full_mesh: bool,
    /// `--peer-router-multihop-ttl` for external eBGP peers (>= 2 enables multihop).
    pub multihop_ttl: Option<u8>,
    /// `--enable-bfd` (with its timers): BFD for every external peer.
    pub bfd: Option<BfdConfig>,
    /// `--bgp-max-prefixes` (0 there: None): the prefix limit of every peer without its own.
    pub max_prefixes: Option<u32>,
    /// `--peer-router-ttl-security`: GTSM for every external peer without its own setting.
    pub ttl_security: bool,
    /// Parsed `--peer-router-ips/--peer-router-asns/--peer-router-passwords`.
    pub external_peers: Vec<ExternalPeerFlag>,
    /// Port used for node peers and for external peers without an explicit port. Default 179.
    pub peer_port: u16,
    /// `--advertise-pod-cidr`, default true. When false, [`NodeBgpConfig::pod_cidrs`] is empty.
    pub advertise_pod_cidr: bool,
    /// `--router-id`.
    pub router_id: RouterIdSetting,
}

/// `--router-id`: where this node's BGP router id comes from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum RouterIdSetting {
    /// The `kube-router.io/bgp-router-id` annotation, else the node's first IPv4 InternalIP,
    /// else its first IPv4 ExternalIP.
    #[default]
    Auto,
    /// This id (an IPv6 `--router-id` is hashed to one: [`hashed_router_id`]).
    Fixed(Ipv4Addr),
    /// `generate`: hashed from the node IP (first InternalIP, else ExternalIP, either family), as
    /// upstream does; what an IPv6-only node needs.
    Generate,
}

/// A 32-bit router id from an address: FNV-1a over its 16-byte form (an IPv4 address
/// IPv4-mapped), the bytes Go's `net.IP` holds, so `generate` yields upstream's id.
pub fn hashed_router_id(ip: IpAddr) -> Ipv4Addr {
    let bytes = match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    };
    let hash = bytes.iter().fold(0x811c_9dc5_u32, |h, b| (h ^ u32::from(*b)).wrapping_mul(0x0100_0193));
    Ipv4Addr::from(hash)
}

impl Default for GlobalSettings {
    fn default() -> Self {
        Self {
            node_name: String::new(),
            cluster_asn: DEFAULT_CLUSTER_ASN,
            enable_ibgp: true,
            full_mesh: true,
            multihop_ttl: None,
            bfd: None,
            max_prefixes: Some(DEFAULT_MAX_PREFIXES),
            ttl_security: false,
            external_peers: Vec::new(),
            peer_port: DEFAULT_BGP_PORT,
            advertise_pod_cidr: true,
            router_id: RouterIdSetting::Auto,
        }
    }
}

/// This node's route-reflector role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RrRole {
    None,
    Server { cluster_id: Ipv4Addr },
    Client { cluster_id: Ipv4Addr },
}

/// The resolved BGP configuration of this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeBgpConfig {
    pub router_id: Ipv4Addr,
    pub local_asn: u32,
    /// This node's primary IP (first InternalIP, else first ExternalIP).
    pub local_address: Option<IpAddr>,
    /// This node's first IPv6 InternalIP (else ExternalIP): the next hop of the IPv6 prefixes it
    /// advertises over IPv4 sessions (a dual-stack node's primary address is usually IPv4).
    pub ipv6_address: Option<std::net::Ipv6Addr>,
    /// Pod CIDRs to advertise (empty when `advertise_pod_cidr` is false).
    pub pod_cidrs: Vec<IpNet>,
    /// Sorted by address, at most one entry per address.
    pub peers: Vec<PeerConfig>,
    pub route_reflector: RrRole,
    /// `kube-router.io/bgp-local-addresses`: where the listener binds (empty: everywhere).
    pub listen_addresses: Vec<IpAddr>,
    /// `kube-router.io/path-prepend.*`.
    pub prepend: Option<AsPrepend>,
    /// `kube-router.io/node.bgp.communities`.
    pub communities: Vec<u32>,
    /// `kube-router.io/node.bgp.customimportreject`.
    pub custom_import_reject: Vec<IpNet>,
    /// Non-fatal problems; the caller should log them.
    pub warnings: Vec<PeerConfigWarning>,
}

/// Fatal problems: no usable configuration can be produced.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PeerConfigError {
    #[error("this node {node_name:?} was not found among the {node_count} known Node objects")]
    ThisNodeNotFound { node_name: String, node_count: usize },
    #[error(
        "node {node:?} has no usable BGP router id: annotation {ROUTER_ID_ANNOTATION} is unset or invalid and the node has no IPv4 InternalIP/ExternalIP"
    )]
    NoRouterId { node: String },
    #[error("node {node:?} has invalid annotation {NODE_ASN_ANNOTATION}={value:?}: expected an ASN in 1..=4294967294")]
    InvalidLocalAsn { node: String, value: String },
    #[error("invalid cluster ASN {0}: expected an ASN in 1..=4294967294")]
    InvalidClusterAsn(u32),
    #[error(
        "node {node:?} has no {NODE_ASN_ANNOTATION} annotation; with --nodes-full-mesh=false every node needs its ASN there"
    )]
    MissingLocalAsn { node: String },
    #[error("{0}; BGP configuration left as it was")]
    InvalidPodCidrAnnotation(#[from] crate::node::pod_cidrs::PodCidrAnnotationError),
    #[error("invalid peer port 0 in settings")]
    InvalidPeerPort,
    #[error(
        "node {node:?} has invalid annotation {annotation}={value:?}: expected a route-reflector cluster id (IPv4 address or non-zero 32-bit number)"
    )]
    InvalidRrClusterId { node: String, annotation: &'static str, value: String },
    #[error("{field} has {got} entries but {reference} has {expected}; they must have the same length")]
    LengthMismatch { field: &'static str, got: usize, reference: &'static str, expected: usize },
    #[error("{field} entry #{index} ({value:?}) is invalid: {reason}")]
    InvalidValue { field: &'static str, index: usize, value: String, reason: String },
}

/// Non-fatal problems found while building the configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerConfigWarning {
    /// Another node's ASN annotation is broken; that node is not peered with.
    InvalidNodeAsn { node: String, value: String },
    /// Another node has no InternalIP/ExternalIP; it is not peered with.
    NodeWithoutAddress { node: String },
    /// Another node's RR annotation is broken; that node is not peered with.
    InvalidRrAnnotation { node: String, annotation: &'static str, value: String },
    /// A node has both RR annotations; the server role is used.
    ConflictingRrAnnotations { node: String },
    /// This node's router-id annotation is not an IPv4 address; the node IP is used instead.
    InvalidRouterIdAnnotation { node: String, value: String },
    /// This node has an unparsable `spec.podCIDRs` entry; it is not advertised.
    InvalidPodCidr { node: String, value: String },
    /// This node's per-node peer annotations are broken; all per-node peers are skipped.
    InvalidPeerAnnotations { node: String, reason: String },
    /// Two sources configured the same peer address; only `kept` is used.
    DuplicatePeer { address: IpAddr, kept: String, dropped: String },
    /// A configured peer address belongs to this node; it is skipped.
    SelfPeer { address: IpAddr, source: String },
    /// One of this node's routing annotations is broken; it is ignored (the rest applies).
    InvalidAnnotation { node: String, annotation: &'static str, value: String, reason: String },
    /// Both `kube-router.io/peers` and the `kube-router.io/peer.*` lists are set: the YAML wins.
    PeersAnnotationWins { node: String },
    /// In full-mesh mode every node runs the cluster ASN; this node's annotation is ignored.
    NodeAsnIgnoredInFullMesh { node: String, value: String },
}

impl fmt::Display for PeerConfigWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::InvalidNodeAsn { node, value } => write!(
                f,
                "node {node:?} has invalid annotation {NODE_ASN_ANNOTATION}={value:?} (expected 1..=4294967294); not peering with it"
            ),
            Self::NodeWithoutAddress { node } => {
                write!(
                    f,
                    "node {node:?} has no InternalIP or ExternalIP address; not peering with it"
                )
            }
            Self::InvalidRrAnnotation {
                node,
                annotation,
                value,
            } => write!(
                f,
                "node {node:?} has invalid annotation {annotation}={value:?} (expected IPv4 address or non-zero 32-bit number); not peering with it"
            ),
            Self::ConflictingRrAnnotations { node } => write!(
                f,
                "node {node:?} has both {RR_SERVER_ANNOTATION} and {RR_CLIENT_ANNOTATION}; treating it as a route-reflector server"
            ),
            Self::InvalidRouterIdAnnotation { node, value } => write!(
                f,
                "node {node:?} has invalid annotation {ROUTER_ID_ANNOTATION}={value:?} (expected IPv4 address); using the node IP instead"
            ),
            Self::InvalidPodCidr { node, value } => {
                write!(f, "node {node:?} has unparsable pod CIDR {value:?}; not advertising it")
            }
            Self::InvalidPeerAnnotations { node, reason } => {
                write!(
                    f,
                    "node {node:?} has invalid per-node peer annotations, ignoring all of them: {reason}"
                )
            }
            Self::DuplicatePeer { address, kept, dropped } => {
                write!(
                    f,
                    "peer {address} is configured more than once; using {kept}, ignoring {dropped}"
                )
            }
            Self::SelfPeer { address, source } => {
                write!(
                    f,
                    "peer {address} from {source} is an address of this node; not peering with ourselves"
                )
            }
            Self::InvalidAnnotation { node, annotation, value, reason } => {
                write!(f, "node {node:?} has invalid annotation {annotation}={value:?} ({reason}); ignoring it")
            }
            Self::PeersAnnotationWins { node } => write!(
                f,
                "node {node:?} has both {PEERS_ANNOTATION} and the deprecated kube-router.io/peer.* annotations; using {PEERS_ANNOTATION}"
            ),
            Self::NodeAsnIgnoredInFullMesh { node, value } => write!(
                f,
                "node {node:?} has {NODE_ASN_ANNOTATION}={value:?}, which only applies with --nodes-full-mesh=false; the cluster ASN is used"
            ),
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// Flag / annotation list parsing
// ---------------------------------------------------------------------------------------------------------

/// Field names used in messages for one "family" of peer lists (flags or annotations).
struct ListFields {
    ips: &'static str,
    asns: &'static str,
    passwords: &'static str,
    ports: &'static str,
    local_ips: &'static str,
}

const FLAG_FIELDS: ListFields = ListFields {
    ips: PEER_IPS_FLAG,
    asns: PEER_ASNS_FLAG,
    passwords: PEER_PASSWORDS_FLAG,
    ports: "--peer-router-ports",
    local_ips: "(no flag)",
};

const ANNOTATION_FIELDS: ListFields = ListFields {
    ips: PEER_IPS_ANNOTATION,
    asns: PEER_ASNS_ANNOTATION,
    passwords: PEER_PASSWORDS_ANNOTATION,
    ports: PEER_PORTS_ANNOTATION,
    local_ips: PEER_LOCAL_IPS_ANNOTATION,
};

struct ParsedPeer {
    address: IpAddr,
    asn: u32,
    password: Option<String>,
    port: Option<u16>,
    local_address: Option<IpAddr>,
    accept_default: bool,
    /// The peer's own `bfd` settings (None: the `--enable-bfd` default).
    bfd: Option<Option<BfdConfig>>,
    /// The peer's own `maxprefixes` (Some(None): 0, no limit; None: `--bgp-max-prefixes`).
    max_prefixes: Option<Option<u32>>,
    /// The peer's own `ttlsecurity` (None: `--peer-router-ttl-security`).
    ttl_security: Option<bool>,
}

impl ParsedPeer {
    fn peer_config(self, settings: &GlobalSettings) -> PeerConfig {
        let mut peer = external_peer(self.address, self.asn, self.password, self.port.unwrap_or(settings.peer_port));
        peer.local_address = self.local_address;
        peer.accept_default = self.accept_default;
        peer.bfd = self.bfd.unwrap_or(settings.bfd);
        peer.max_prefixes = self.max_prefixes.unwrap_or(settings.max_prefixes);
        peer.ttl_security = self.ttl_security.unwrap_or(settings.ttl_security);
        peer
    }
}

fn parse_asn(s: &str) -> Option<u32> {
    s.trim().parse::<u32>().ok().filter(|a| (MIN_ASN..=MAX_ASN).contains(a))
}

/// Decodes a base64 password. An empty entry means "no password".
fn decode_password(s: &str) -> Result<Option<String>, String> {
    let s = s.trim();
    if s.is_empty() {
        return Ok(None);
    }
    let bytes = base64::engine::general_purpose::STANDARD.decode(s).map_err(|e| format!("not valid base64: {e}"))?;
    if bytes.len() > MAX_PASSWORD_LEN {
        return Err(format!("decoded password is {} bytes, the TCP-MD5 maximum is {MAX_PASSWORD_LEN}", bytes.len()));
    }
    let pw = String::from_utf8(bytes).map_err(|_| "decoded password is not valid UTF-8".to_string())?;
    Ok(if pw.is_empty() { None } else { Some(pw) })
}

fn check_len(
    fields: &'static str,
    got: usize,
    reference: &'static str,
    expected: usize,
) -> Result<(), PeerConfigError> {
    if got == expected {
        Ok(())
    } else {
        Err(PeerConfigError::LengthMismatch { field: fields, got, reference, expected })
    }
}

fn invalid(field: &'static str, index: usize, value: &str, reason: impl Into<String>) -> PeerConfigError {
    PeerConfigError::InvalidValue { field, index, value: value.to_string(), reason: reason.into() }
}

/// Shared parser for `ips`/`asns`/`passwords`/`ports` lists. `passwords` and `ports` may be empty.
fn parse_peer_lists<S: AsRef<str>>(
    fields: &ListFields,
    ips: &[S],
    asns: &[S],
    passwords: &[S],
    ports: &[S],
    local_ips: &[S],
) -> Result<Vec<ParsedPeer>, PeerConfigError> {
    check_len(fields.asns, asns.len(), fields.ips, ips.len())?;
    if !passwords.is_empty() {
        check_len(fields.passwords, passwords.len(), fields.ips, ips.len())?;
    }
    if !ports.is_empty() {
        check_len(fields.ports, ports.len(), fields.ips, ips.len())?;
    }
    if !local_ips.is_empty() {
        check_len(fields.local_ips, local_ips.len(), fields.ips, ips.len())?;
    }
    let mut out = Vec::with_capacity(ips.len());
    for (i, (ip, asn)) in ips.iter().zip(asns).enumerate() {
        let (ip, asn) = (ip.as_ref(), asn.as_ref());
        let address: IpAddr =
            ip.trim().parse().map_err(|_| invalid(fields.ips, i, ip, "not an IPv4 or IPv6 address"))?;
        let asn = parse_asn(asn).ok_or_else(|| invalid(fields.asns, i, asn, "expected an ASN in 1..=4294967294"))?;
        let password = match passwords.get(i) {
            // The value itself is deliberately not echoed back: it is a secret.
            Some(p) => {
                decode_password(p.as_ref()).map_err(|reason| invalid(fields.passwords, i, "<redacted>", reason))?
            }
            None => None,
        };
        let port = match ports.get(i).map(|p| p.as_ref()) {
            // An empty entry means the default port (kube-router: "port,,port").
            Some(p) if !p.trim().is_empty() => Some(
                p.trim()
                    .parse::<u16>()
                    .ok()
                    .filter(|&n| n != 0)
                    .ok_or_else(|| invalid(fields.ports, i, p, "expected a port in 1..=65535"))?,
            ),
            _ => None,
        };
        let local_address = match local_ips.get(i).map(|p| p.as_ref()) {
            Some(l) if !l.trim().is_empty() => {
                Some(l.trim().parse().map_err(|_| invalid(fields.local_ips, i, l, "not an IPv4 or IPv6 address"))?)
            }
            _ => None,
        };
        out.push(ParsedPeer {
            address,
            asn,
            password,
            port,
            local_address,
            accept_default: false,
            bfd: None,
            max_prefixes: None,
            ttl_security: None,
        });
    }
    Ok(out)
}

/// Parses kube-router's `--peer-router-ips`, `--peer-router-asns`, `--peer-router-passwords`
/// and `--peer-router-ports` flags (each element is one entry; the flag library has already
/// split on commas).
///
/// `ips` and `asns` must have the same length; `passwords` and `ports` must be empty or have
/// that length too. Passwords are base64-encoded; an empty entry means "no password" (or the
/// default port).
pub fn parse_external_peer_flags(
    ips: &[String],
    asns: &[String],
    passwords: &[String],
    ports: &[String],
) -> Result<Vec<ExternalPeerFlag>, PeerConfigError> {
    Ok(parse_peer_lists(&FLAG_FIELDS, ips, asns, passwords, ports, &[])?
        .into_iter()
        .map(|p| ExternalPeerFlag { address: p.address, asn: p.asn, password: p.password, port: p.port })
        .collect())
}

/// `--peer-router-passwords-file`: the passwords as `--peer-router-passwords` takes them
/// (base64, comma-separated, on one line).
pub fn parse_passwords_file(text: &str) -> Vec<String> {
    let line = text.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("");
    if line.is_empty() {
        return Vec::new();
    }
    line.split(',').map(|p| p.trim().to_string()).collect()
}

/// One entry of the `kube-router.io/peers` YAML list.
#[derive(serde::Deserialize)]
struct PeerEntry {
    remoteip: String,
    remoteasn: u64,
    #[serde(default)]
    localip: Option<String>,
    #[serde(default)]
    password: Option<String>,
    #[serde(default)]
    port: Option<u64>,
    /// Ours, not kube-router's: accept a default route from this peer.
    #[serde(default)]
    acceptdefault: bool,
    #[serde(default)]
    bfd: Option<BfdEntry>,
    /// Ours: this peer's prefix limit per family (0: none), instead of `--bgp-max-prefixes`.
    #[serde(default)]
    maxprefixes: Option<u64>,
    /// Ours: GTSM for this peer, instead of `--peer-router-ttl-security`.
    #[serde(default)]
    ttlsecurity: Option<bool>,
}

/// The `bfd` of a `kube-router.io/peers` entry (intervals in milliseconds, as kube-router).
#[derive(serde::Deserialize)]
struct BfdEntry {
    #[serde(default)]
    enabled: bool,
    desired_min_tx_interval: Option<u64>,
    required_min_rx_interval: Option<u64>,
    detection_multiplier: Option<u64>,
}

/// Parses the `kube-router.io/peers` annotation.
fn parse_peers_yaml(text: &str) -> Result<Vec<ParsedPeer>, PeerConfigError> {
    let field = PEERS_ANNOTATION;
    let entries: Vec<PeerEntry> = serde_norway::from_str(text)
        .map_err(|e| invalid(field, 0, "<yaml>", format!("expected a YAML list of peers: {e}")))?;
    entries
        .into_iter()
        .enumerate()
        .map(|(i, e)| {
            let address = e
                .remoteip
                .trim()
                .parse()
                .map_err(|_| invalid(field, i, &e.remoteip, "remoteip is not an IP address"))?;
            let asn = u32::try_from(e.remoteasn)
                .ok()
                .filter(|a| (MIN_ASN..=MAX_ASN).contains(a))
                .ok_or_else(|| invalid(field, i, &e.remoteasn.to_string(), "remoteasn must be in 1..=4294967294"))?;
            let password = match &e.password {
                Some(p) => decode_password(p).map_err(|reason| invalid(field, i, "<redacted>", reason))?,
                None => None,
            };
            let port = match e.port {
                Some(p) => Some(
                    u16::try_from(p)
                        .ok()
                        .filter(|p| *p != 0)
                        .ok_or_else(|| invalid(field, i, &p.to_string(), "port must be in 1..=65535"))?,
                ),
                None => None,
            };
            let local_address = match &e.localip {
                Some(l) if !l.trim().is_empty() => {
                    Some(l.trim().parse().map_err(|_| invalid(field, i, l, "localip is not an IP address"))?)
                }
                _ => None,
            };
            let bfd = match &e.bfd {
                None => None,
                Some(b) if !b.enabled => Some(None),
                Some(b) => {
                    let defaults = BfdConfig::default();
                    let interval = |ms: Option<u64>, default: std::time::Duration, what: &str| match ms {
                        None => Ok(default),
                        Some(ms) if (1..=4_294_967).contains(&ms) => Ok(std::time::Duration::from_millis(ms)),
                        Some(ms) => {
                            Err(invalid(field, i, &ms.to_string(), format!("bfd {what} must be 1..=4294967 ms")))
                        }
                    };
                    let multiplier = match b.detection_multiplier {
                        None => defaults.multiplier,
                        Some(m) => u8::try_from(m).ok().filter(|m| *m > 0).ok_or_else(|| {
                            invalid(field, i, &m.to_string(), "bfd detection_multiplier must be 1..=255")
                        })?,
                    };
                    Some(Some(BfdConfig {
                        desired_min_tx: interval(
                            b.desired_min_tx_interval,
                            defaults.desired_min_tx,
                            "desired_min_tx_interval",
                        )?,
                        required_min_rx: interval(
                            b.required_min_rx_interval,
                            defaults.required_min_rx,
                            "required_min_rx_interval",
                        )?,
                        multiplier,
                    }))
                }
            };
            let max_prefixes = match e.maxprefixes {
                None => None,
                Some(0) => Some(None),
                Some(n) => Some(Some(u32::try_from(n).map_err(|_| {
                    invalid(field, i, &n.to_string(), "maxprefixes must be in 0..=4294967295 (0: no limit)")
                })?)),
            };
            Ok(ParsedPeer {
                address,
                asn,
                password,
                port,
                local_address,
                accept_default: e.acceptdefault,
                bfd,
                max_prefixes,
                ttl_security: e.ttlsecurity,
            })
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------------------
// Node accessors
// ---------------------------------------------------------------------------------------------------------

fn node_name(node: &Node) -> &str {
    node.metadata.name.as_deref().unwrap_or("")
}

fn annotation<'a>(node: &'a Node, key: &str) -> Option<&'a str> {
    node.metadata.annotations.as_ref()?.get(key).map(String::as_str)
}

/// Parsed `status.addresses` of the given type, in order.
fn addresses_of_type<'a>(node: &'a Node, type_: &'a str) -> impl Iterator<Item = IpAddr> + 'a {
    node.status
        .iter()
        .flat_map(|s| s.addresses.iter().flatten())
        .filter(move |a| a.type_ == type_)
        .filter_map(|a| a.address.trim().parse().ok())
}

/// kube-router's node IP: first InternalIP, else first ExternalIP.
fn node_ip(node: &Node) -> Option<IpAddr> {
    addresses_of_type(node, "InternalIP").next().or_else(|| addresses_of_type(node, "ExternalIP").next())
}

fn node_ipv6(node: &Node) -> Option<std::net::Ipv6Addr> {
    let v6 = |ip: IpAddr| match ip {
        IpAddr::V6(v6) => Some(v6),
        IpAddr::V4(_) => None,
    };
    addresses_of_type(node, "InternalIP").find_map(v6).or_else(|| addresses_of_type(node, "ExternalIP").find_map(v6))
}

/// Every IP address the node reports (any type).
fn all_node_ips(node: &Node) -> BTreeSet<IpAddr> {
    node.status
        .iter()
        .flat_map(|s| s.addresses.iter().flatten())
        .filter_map(|a| a.address.trim().parse().ok())
        .collect()
}

fn parse_cluster_id(s: &str) -> Option<Ipv4Addr> {
    let s = s.trim();
    let id = s.parse::<Ipv4Addr>().ok().or_else(|| s.parse::<u32>().ok().map(Ipv4Addr::from))?;
    (!id.is_unspecified()).then_some(id)
}

/// A node's route-reflector role. `Err` carries the offending annotation and value.
fn rr_role(node: &Node, warnings: &mut Vec<PeerConfigWarning>) -> Result<RrRole, (&'static str, String)> {
    let server = annotation(node, RR_SERVER_ANNOTATION);
    let client = annotation(node, RR_CLIENT_ANNOTATION);
    if server.is_some() && client.is_some() {
        warnings.push(PeerConfigWarning::ConflictingRrAnnotations { node: node_name(node).to_string() });
    }
    match (server, client) {
        (Some(v), _) => parse_cluster_id(v)
            .map(|cluster_id| RrRole::Server { cluster_id })
            .ok_or((RR_SERVER_ANNOTATION, v.to_string())),
        (None, Some(v)) => parse_cluster_id(v)
            .map(|cluster_id| RrRole::Client { cluster_id })
            .ok_or((RR_CLIENT_ANNOTATION, v.to_string())),
        (None, None) => Ok(RrRole::None),
    }
}

/// A node's `kube-router.io/node.asn`: the text, and the ASN if it is one.
fn annotated_asn(node: &Node) -> Option<(&str, Option<u32>)> {
    annotation(node, NODE_ASN_ANNOTATION).map(|v| (v, parse_asn(v)))
}

/// Whether a node with role `me` should peer with a node with role `other`, and if so whether `other`
/// is our route-reflector client. The relation is symmetric so that both sides configure the session.
fn rr_peering(me: RrRole, other: RrRole) -> Option<bool> {
    use RrRole::{Client, Server};
    match (me, other) {
        (Server { cluster_id: a }, Client { cluster_id: b }) => (a == b).then_some(true),
        (Client { cluster_id: a }, Server { cluster_id: b }) => (a == b).then_some(false),
        // Clients only talk to their reflectors.
        (Client { .. }, _) | (_, Client { .. }) => Option::None,
        // Server<->server, server<->plain and plain<->plain are ordinary iBGP sessions.
        _ => Some(false),
    }
}

// ---------------------------------------------------------------------------------------------------------
// Peer collection with precedence
// ---------------------------------------------------------------------------------------------------------

/// Where a peer came from; declaration order is precedence order (lowest first).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Source {
    Mesh(String),
    Flag,
    Annotation(String),
}

impl Source {
    fn rank(&self) -> u8 {
        match self {
            Source::Mesh(_) => 0,
            Source::Flag => 1,
            Source::Annotation(_) => 2,
        }
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Mesh(n) => write!(f, "iBGP peer node {n:?}"),
            Source::Flag => write!(f, "flag {PEER_IPS_FLAG}"),
            Source::Annotation(n) => write!(f, "annotation {PEER_IPS_ANNOTATION} on node {n:?}"),
        }
    }
}

struct PeerSet<'a> {
    own_ips: &'a BTreeSet<IpAddr>,
    peers: BTreeMap<IpAddr, (Source, PeerConfig)>,
    warnings: &'a mut Vec<PeerConfigWarning>,
}

impl PeerSet<'_> {
    /// Adds a peer. Higher-precedence sources replace lower ones; within a source the first entry wins.
    fn add(&mut self, source: Source, peer: PeerConfig) {
        if self.own_ips.contains(&peer.address) {
            self.warnings.push(PeerConfigWarning::SelfPeer { address: peer.address, source: source.to_string() });
            return;
        }
        let address = peer.address;
        match self.peers.get(&address) {
            None => {
                self.peers.insert(address, (source, peer));
            }
            Some((existing, _)) => {
                let (kept, dropped) = if source.rank() > existing.rank() {
                    let dropped = existing.to_string();
                    let kept = source.to_string();
                    self.peers.insert(address, (source, peer));
                    (kept, dropped)
                } else {
                    (existing.to_string(), source.to_string())
                };
                self.warnings.push(PeerConfigWarning::DuplicatePeer { address, kept, dropped });
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// Entry point
// ---------------------------------------------------------------------------------------------------------

/// Computes the BGP configuration of `settings.node_name` from all known `nodes`.
///
/// Fails only for problems with this node itself (missing, no router id, invalid own ASN or RR
/// annotation) or invalid settings; problems with other nodes or with this node's per-node peer
/// annotations become [`PeerConfigWarning`]s. A caller that follows Node changes one at a time
/// keeps a [`NodeBgpView`] instead: the same result without a walk of every Node per change.
pub fn node_bgp_config<N: std::borrow::Borrow<Node>>(
    nodes: &[N],
    settings: &GlobalSettings,
) -> Result<NodeBgpConfig, PeerConfigError> {
    check_settings(settings)?;
    let me = nodes.iter().map(N::borrow).find(|n| node_name(n) == settings.node_name).ok_or_else(|| {
        PeerConfigError::ThisNodeNotFound { node_name: settings.node_name.clone(), node_count: nodes.len() }
    })?;
    let own = own_part(me, settings)?;
    // In name order, so that duplicate-address warnings do not depend on list order.
    let mut others: Vec<&Node> = nodes.iter().map(N::borrow).filter(|n| node_name(n) != settings.node_name).collect();
    others.sort_by(|a, b| node_name(a).cmp(node_name(b)));
    let mesh: Vec<(String, MeshEntry)> = others
        .into_iter()
        .filter_map(|other| Some((node_name(other).to_string(), mesh_entry(other, own.mesh, settings)?)))
        .collect();
    Ok(assemble(me, settings, own, mesh.iter().map(|(name, entry)| (name.as_str(), entry))))
}

/// This node's BGP configuration kept up to date Node by Node: each other Node's part (the
/// session with it, its warnings) is derived when that Node changes, so a change costs the
/// changed Nodes plus the peers and warnings there are, not a walk of every Node. Only a change
/// of what this node's own Node decides about its peers (its ASN, its route-reflector role)
/// derives every other Node's part again. [`Self::config`] equals [`node_bgp_config`] of the
/// same Nodes.
#[derive(Debug, Clone)]
pub struct NodeBgpView {
    settings: GlobalSettings,
    /// Every Node by name: this one's parts are read on each [`Self::config`], the others' are
    /// derived again when `context` changes.
    nodes: BTreeMap<String, std::sync::Arc<Node>>,
    /// The other Nodes that bring a session or a warning, derived under `context`.
    mesh: BTreeMap<String, MeshEntry>,
    /// What `mesh` was derived under (`None`: nothing derived yet).
    context: Option<MeshContext>,
}

impl NodeBgpView {
    pub fn new(settings: GlobalSettings) -> Self {
        Self { settings, nodes: BTreeMap::new(), mesh: BTreeMap::new(), context: None }
    }

    /// Replaces every Node (the first listing, a checkpoint restore, a reader that fell behind).
    pub fn replace_all(&mut self, nodes: impl IntoIterator<Item = std::sync::Arc<Node>>) {
        self.nodes = nodes.into_iter().map(|node| (node_name(&node).to_string(), node)).collect();
        self.mesh.clear();
        self.context = None;
    }

    /// One Node changed (`None`: it is gone).
    pub fn set_node(&mut self, name: &str, node: Option<std::sync::Arc<Node>>) {
        match node {
            Some(node) => self.nodes.insert(name.to_string(), node),
            None => self.nodes.remove(name),
        };
        // This node's own change may move the context: `config` sees to that.
        if name == self.settings.node_name {
            return;
        }
        let entry = match (self.context, self.nodes.get(name)) {
            (Some(context), Some(node)) => mesh_entry(node, context, &self.settings),
            _ => None,
        };
        match entry {
            Some(entry) => self.mesh.insert(name.to_string(), entry),
            None => self.mesh.remove(name),
        };
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The configuration of this node from the Nodes as they are now.
    pub fn config(&mut self) -> Result<NodeBgpConfig, PeerConfigError> {
        let settings = &self.settings;
        check_settings(settings)?;
        let me = self.nodes.get(&settings.node_name).ok_or_else(|| PeerConfigError::ThisNodeNotFound {
            node_name: settings.node_name.clone(),
            node_count: self.nodes.len(),
        })?;
        let own = own_part(me, settings)?;
        if self.context != Some(own.mesh) {
            self.mesh = self
                .nodes
                .iter()
                .filter(|(name, _)| **name != settings.node_name)
                .filter_map(|(name, node)| Some((name.clone(), mesh_entry(node, own.mesh, settings)?)))
                .collect();
            self.context = Some(own.mesh);
        }
        Ok(assemble(me, settings, own, self.mesh.iter().map(|(name, entry)| (name.as_str(), entry))))
    }
}

fn check_settings(settings: &GlobalSettings) -> Result<(), PeerConfigError> {
    if !(MIN_ASN..=MAX_ASN).contains(&settings.cluster_asn) {
        return Err(PeerConfigError::InvalidClusterAsn(settings.cluster_asn));
    }
    if settings.peer_port == 0 {
        return Err(PeerConfigError::InvalidPeerPort);
    }
    Ok(())
}

/// What of this node decides which other nodes it peers with, and how.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct MeshContext {
    local_asn: u32,
    route_reflector: RrRole,
}

/// What another node brings to this node's configuration: the warnings it raises, in the order
/// they are raised, and the session with it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct MeshEntry {
    warnings: Vec<PeerConfigWarning>,
    peer: Option<PeerConfig>,
}

/// This node's own part of its configuration, from its own Node alone.
struct OwnPart {
    router_id: Ipv4Addr,
    mesh: MeshContext,
    pod_cidrs: Vec<IpNet>,
    warnings: Vec<PeerConfigWarning>,
}

fn own_part(me: &Node, settings: &GlobalSettings) -> Result<OwnPart, PeerConfigError> {
    let my_name = settings.node_name.as_str();
    let mut warnings = Vec::new();

    // Router id: annotation, else first IPv4 InternalIP, else first IPv4 ExternalIP.
    let annotated_router_id = annotation(me, ROUTER_ID_ANNOTATION).and_then(|v| match v.trim().parse::<Ipv4Addr>() {
        Ok(id) if !id.is_unspecified() => Some(id),
        _ => {
            warnings
                .push(PeerConfigWarning::InvalidRouterIdAnnotation { node: my_name.to_string(), value: v.to_string() });
            None
        }
    });
    let first_v4 = |type_| {
        addresses_of_type(me, type_).find_map(|ip| match ip {
            IpAddr::V4(v4) => Some(v4),
            IpAddr::V6(_) => None,
        })
    };
    // The flag wins over the annotation (it is the operator's, the annotation the node's).
    let router_id = match settings.router_id {
        RouterIdSetting::Fixed(id) => Some(id),
        RouterIdSetting::Generate => node_ip(me).map(hashed_router_id),
        RouterIdSetting::Auto => {
            annotated_router_id.or_else(|| first_v4("InternalIP")).or_else(|| first_v4("ExternalIP"))
        }
    }
    .ok_or_else(|| PeerConfigError::NoRouterId { node: my_name.to_string() })?;

    let local_asn = match (settings.full_mesh, annotated_asn(me)) {
        (true, Some((value, parsed))) => {
            if parsed != Some(settings.cluster_asn) {
                warnings.push(PeerConfigWarning::NodeAsnIgnoredInFullMesh {
                    node: my_name.to_string(),
                    value: value.to_string(),
                });
            }
            settings.cluster_asn
        }
        (true, None) => settings.cluster_asn,
        (false, Some((_, Some(asn)))) => asn,
        (false, Some((value, None))) => {
            return Err(PeerConfigError::InvalidLocalAsn { node: my_name.to_string(), value: value.to_string() })
        }
        (false, None) => return Err(PeerConfigError::MissingLocalAsn { node: my_name.to_string() }),
    };

    let route_reflector = rr_role(me, &mut warnings).map_err(|(annotation, value)| {
        PeerConfigError::InvalidRrClusterId { node: my_name.to_string(), annotation, value }
    })?;

    // A malformed pod-cidr annotation fails the whole configuration: the routes stay as they
    // were rather than the node withdrawing its pods' prefix.
    let pod_cidrs = match (settings.advertise_pod_cidr, crate::node::pod_cidrs::annotated_pod_cidrs(me)) {
        (false, _) => Vec::new(),
        (true, Some(annotated)) => annotated?,
        (true, None) => pod_cidrs(me, &mut warnings),
    };
    Ok(OwnPart { router_id, mesh: MeshContext { local_asn, route_reflector }, pod_cidrs, warnings })
}

/// What `other` brings under `context`; `None`: nothing (no session, no warning).
fn mesh_entry(other: &Node, context: MeshContext, settings: &GlobalSettings) -> Option<MeshEntry> {
    if !settings.enable_ibgp {
        return None;
    }
    let name = node_name(other).to_string();
    let mut warnings = Vec::new();
    let entry = |warnings: Vec<PeerConfigWarning>, peer: Option<PeerConfig>| {
        (!warnings.is_empty() || peer.is_some()).then_some(MeshEntry { warnings, peer })
    };
    if !settings.full_mesh {
        // kube-router only builds iBGP sessions between nodes of the same ASN; a node
        // without the annotation is not part of any rack.
        match annotated_asn(other) {
            Some((_, Some(asn))) if asn == context.local_asn => {}
            Some((value, None)) => {
                warnings.push(PeerConfigWarning::InvalidNodeAsn { node: name, value: value.to_string() });
                return entry(warnings, None);
            }
            _ => return None,
        }
    }
    let role = match rr_role(other, &mut warnings) {
        Ok(role) => role,
        Err((annotation, value)) => {
            warnings.push(PeerConfigWarning::InvalidRrAnnotation { node: name, annotation, value });
            return entry(warnings, None);
        }
    };
    // Note: nodes with metadata.deletionTimestamp set are deliberately still peered with. Deletion can
    // be slow (finalizers) or never complete, and the node may still be forwarding traffic; dropping the
    // session early would withdraw its pod routes while its pods may still be running. The peer goes
    // away when the Node object does.
    let Some(route_reflector_client) = rr_peering(context.route_reflector, role) else {
        return entry(warnings, None);
    };
    let Some(address) = node_ip(other) else {
        warnings.push(PeerConfigWarning::NodeWithoutAddress { node: name });
        return entry(warnings, None);
    };
    let peer = PeerConfig {
        address,
        asn: context.local_asn,
        password: None,
        port: settings.peer_port,
        passive: false,
        route_reflector_client,
        kind: PeerKind::Node { name },
        local_address: None,
        multihop_ttl: None,
        accept_default: false,
        bfd: None,
        max_prefixes: settings.max_prefixes,
        ttl_security: false,
    };
    entry(warnings, Some(peer))
}

/// The whole configuration: this node's part, the other nodes' (`mesh`, in name order), the
/// flags' peers and this node's per-node peers.
fn assemble<'a>(
    me: &Node,
    settings: &GlobalSettings,
    own: OwnPart,
    mesh: impl Iterator<Item = (&'a str, &'a MeshEntry)>,
) -> NodeBgpConfig {
    let my_name = settings.node_name.as_str();
    let OwnPart { router_id, mesh: MeshContext { local_asn, route_reflector }, pod_cidrs, mut warnings } = own;
    let own_ips = all_node_ips(me);
    let local_address = node_ip(me);
    let mut set = PeerSet { own_ips: &own_ips, peers: BTreeMap::new(), warnings: &mut warnings };

    for (name, entry) in mesh {
        set.warnings.extend(entry.warnings.iter().cloned());
        if let Some(peer) = &entry.peer {
            set.add(Source::Mesh(name.to_string()), peer.clone());
        }
    }

    for flag in &settings.external_peers {
        set.add(Source::Flag, flag.external_peer_config(settings));
    }

    match node_annotation_peers(me, set.warnings) {
        Ok(parsed) => {
            for p in parsed {
                let mut peer = p.peer_config(settings);
                peer.multihop_ttl = settings.multihop_ttl;
                set.add(Source::Annotation(my_name.to_string()), peer);
            }
        }
        Err(e) => set
            .warnings
            .push(PeerConfigWarning::InvalidPeerAnnotations { node: my_name.to_string(), reason: e.to_string() }),
    }

    let peers = set.peers.into_values().map(|(_, p)| p).collect();
    let listen_addresses = local_addresses(me, &mut warnings);
    let prepend = path_prepend(me, &mut warnings);
    let communities = communities(me, &mut warnings);
    let custom_import_reject = custom_import_reject(me, &mut warnings);
    let ipv6_address = node_ipv6(me);
    NodeBgpConfig {
        router_id,
        local_asn,
        local_address,
        ipv6_address,
        pod_cidrs,
        peers,
        route_reflector,
        listen_addresses,
        prepend,
        communities,
        custom_import_reject,
        warnings,
    }
}

fn external_peer(address: IpAddr, asn: u32, password: Option<String>, port: u16) -> PeerConfig {
    PeerConfig {
        address,
        asn,
        password,
        port,
        passive: false,
        route_reflector_client: false,
        kind: PeerKind::External,
        local_address: None,
        multihop_ttl: None,
        accept_default: false,
        bfd: None,
        max_prefixes: Some(DEFAULT_MAX_PREFIXES),
        ttl_security: false,
    }
}

fn invalid_annotation(
    node: &Node,
    annotation: &'static str,
    value: &str,
    reason: impl Into<String>,
) -> PeerConfigWarning {
    PeerConfigWarning::InvalidAnnotation {
        node: node_name(node).to_string(),
        annotation,
        value: value.to_string(),
        reason: reason.into(),
    }
}

/// Comma-separated, blanks dropped.
fn annotation_list<'a>(node: &'a Node, key: &str) -> Vec<&'a str> {
    annotation(node, key).map(|v| v.split(',').map(str::trim).filter(|e| !e.is_empty()).collect()).unwrap_or_default()
}

/// `kube-router.io/bgp-local-addresses`; a broken entry drops the whole list (listening
/// everywhere is the safe fallback).
fn local_addresses(node: &Node, warnings: &mut Vec<PeerConfigWarning>) -> Vec<IpAddr> {
    let entries = annotation_list(node, LOCAL_ADDRESSES_ANNOTATION);
    match entries.iter().map(|e| e.parse::<IpAddr>()).collect::<Result<Vec<_>, _>>() {
        Ok(addresses) => addresses,
        Err(_) => {
            let value = annotation(node, LOCAL_ADDRESSES_ANNOTATION).unwrap_or_default();
            warnings.push(invalid_annotation(node, LOCAL_ADDRESSES_ANNOTATION, value, "expected IP addresses"));
            Vec::new()
        }
    }
}

/// `kube-router.io/path-prepend.as` and `.repeat-n`, both or neither.
fn path_prepend(node: &Node, warnings: &mut Vec<PeerConfigWarning>) -> Option<AsPrepend> {
    let asn = annotation(node, PATH_PREPEND_AS_ANNOTATION);
    let repeat = annotation(node, PATH_PREPEND_REPEAT_ANNOTATION);
    match (asn, repeat) {
        (None, None) => None,
        (Some(a), None) => {
            let reason = format!("needs {PATH_PREPEND_REPEAT_ANNOTATION} too");
            warnings.push(invalid_annotation(node, PATH_PREPEND_AS_ANNOTATION, a, reason));
            None
        }
        (None, Some(r)) => {
            let reason = format!("needs {PATH_PREPEND_AS_ANNOTATION} too");
            warnings.push(invalid_annotation(node, PATH_PREPEND_REPEAT_ANNOTATION, r, reason));
            None
        }
        (Some(a), Some(r)) => {
            let Some(asn) = parse_asn(a) else {
                warnings.push(invalid_annotation(node, PATH_PREPEND_AS_ANNOTATION, a, "expected an ASN"));
                return None;
            };
            match r.trim().parse::<u8>() {
                Ok(repeat) if repeat > 0 => Some(AsPrepend { asn, repeat }),
                _ => {
                    warnings.push(invalid_annotation(node, PATH_PREPEND_REPEAT_ANNOTATION, r, "expected 1..=255"));
                    None
                }
            }
        }
    }
}

/// `kube-router.io/node.bgp.communities`; invalid entries are warned about and skipped.
fn communities(node: &Node, warnings: &mut Vec<PeerConfigWarning>) -> Vec<u32> {
    let mut out = Vec::new();
    for entry in annotation_list(node, COMMUNITIES_ANNOTATION) {
        match parse_community(entry) {
            Some(c) if !out.contains(&c) => out.push(c),
            Some(_) => {}
            None => warnings.push(invalid_annotation(
                node,
                COMMUNITIES_ANNOTATION,
                entry,
                "expected a 32-bit number, ASN:value or a well-known name like no-export",
            )),
        }
    }
    out
}

/// `kube-router.io/node.bgp.customimportreject`; like kube-router, a broken list is ignored whole.
fn custom_import_reject(node: &Node, warnings: &mut Vec<PeerConfigWarning>) -> Vec<IpNet> {
    let entries = annotation_list(node, CUSTOM_IMPORT_REJECT_ANNOTATION);
    match entries.iter().map(|e| e.parse::<IpNet>().map(|n| n.trunc())).collect::<Result<Vec<_>, _>>() {
        Ok(nets) => nets,
        Err(_) => {
            let value = annotation(node, CUSTOM_IMPORT_REJECT_ANNOTATION).unwrap_or_default();
            warnings.push(invalid_annotation(node, CUSTOM_IMPORT_REJECT_ANNOTATION, value, "expected CIDRs"));
            Vec::new()
        }
    }
}

/// `spec.podCIDRs`, falling back to `spec.podCIDR`; unparsable entries are warned about and skipped.
fn pod_cidrs(node: &Node, warnings: &mut Vec<PeerConfigWarning>) -> Vec<IpNet> {
    let spec = node.spec.as_ref();
    let raw: Vec<&str> = match spec.and_then(|s| s.pod_cidrs.as_ref()).filter(|v| !v.is_empty()) {
        Some(list) => list.iter().map(String::as_str).collect(),
        None => spec.and_then(|s| s.pod_cidr.as_deref()).into_iter().collect(),
    };
    let mut out: Vec<IpNet> = Vec::new();
    for value in raw {
        match value.trim().parse::<IpNet>() {
            Ok(net) if !out.contains(&net.trunc()) => out.push(net.trunc()),
            Ok(_) => {}
            Err(_) => warnings.push(PeerConfigWarning::InvalidPodCidr {
                node: node_name(node).to_string(),
                value: value.to_string(),
            }),
        }
    }
    out
}

/// This node's external peers: the `kube-router.io/peers` YAML if set (kube-router's
/// recommended form), else the `kube-router.io/peer.*` lists.
fn node_annotation_peers(
    node: &Node,
    warnings: &mut Vec<PeerConfigWarning>,
) -> Result<Vec<ParsedPeer>, PeerConfigError> {
    let list = |key| -> Vec<&str> {
        match annotation(node, key).map(str::trim) {
            Some(v) if !v.is_empty() => v.split(',').collect(),
            _ => Vec::new(),
        }
    };
    if let Some(yaml) = annotation(node, PEERS_ANNOTATION).filter(|v| !v.trim().is_empty()) {
        if annotation(node, PEER_IPS_ANNOTATION).is_some() {
            warnings.push(PeerConfigWarning::PeersAnnotationWins { node: node_name(node).to_string() });
        }
        return parse_peers_yaml(yaml);
    }
    parse_peer_lists(
        &ANNOTATION_FIELDS,
        &list(PEER_IPS_ANNOTATION),
        &list(PEER_ASNS_ANNOTATION),
        &list(PEER_PASSWORDS_ANNOTATION),
        &list(PEER_PORTS_ANNOTATION),
        &list(PEER_LOCAL_IPS_ANNOTATION),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{NodeAddress, NodeSpec, NodeStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
    use proptest::prelude::*;

    /// One Node as a random change leaves it: its rack, route-reflector role and address
    /// (another's, none or broken included), or gone.
    fn arb_node(index: usize) -> impl Strategy<Value = Option<Node>> {
        let asn = prop_oneof![Just(None), Just(Some("65001")), Just(Some("65002")), Just(Some("not-an-asn"))];
        let rr = prop_oneof![
            Just(None),
            Just(Some((RR_SERVER_ANNOTATION, "42"))),
            Just(Some((RR_CLIENT_ANNOTATION, "42"))),
            Just(Some((RR_CLIENT_ANNOTATION, "7"))),
            Just(Some((RR_SERVER_ANNOTATION, "0.0.0.0"))),
        ];
        let address = prop_oneof![Just(format!("10.0.0.{index}")), Just("10.0.0.99".to_string()), Just(String::new())];
        let node = (asn, rr, address, any::<bool>()).prop_map(move |(asn, rr, address, both_rr)| {
            let mut annotations: Vec<(&str, &str)> = asn.map(|a| (NODE_ASN_ANNOTATION, a)).into_iter().collect();
            annotations.extend(rr);
            if both_rr {
                annotations.push((RR_CLIENT_ANNOTATION, "42"));
            }
            node(&format!("node-{index}"), &address, &annotations, Some(&format!("10.244.{index}.0/24")))
        });
        prop_oneof![1 => Just(None), 4 => node.prop_map(Some)]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]
        /// Following Node changes one at a time gives what a derivation from every Node gives:
        /// sessions, warnings (their order too) and errors; this node's own changes included.
        #[test]
        fn following_node_changes_configures_what_every_node_does(
            full_mesh in any::<bool>(),
            enable_ibgp in prop_oneof![4 => Just(true), 1 => Just(false)],
            batches in proptest::collection::vec(
                proptest::collection::vec((0usize..8).prop_flat_map(|i| (Just(i), arb_node(i))), 1..4),
                1..30,
            ),
        ) {
            let settings = GlobalSettings { full_mesh, enable_ibgp, ..settings("node-1") };
            let mut view = NodeBgpView::new(settings.clone());
            let mut nodes: BTreeMap<String, Node> = BTreeMap::new();
            for (round, batch) in batches.into_iter().enumerate() {
                for (index, node) in batch {
                    let name = format!("node-{index}");
                    match node {
                        Some(node) => nodes.insert(name.clone(), node),
                        None => nodes.remove(&name),
                    };
                    view.set_node(&name, nodes.get(&name).cloned().map(std::sync::Arc::new));
                }
                let every: Vec<&Node> = nodes.values().collect();
                prop_assert_eq!(view.config(), node_bgp_config(&every, &settings), "round {}", round);
            }
            // A rebuild from every Node is the same again.
            let mut rebuilt = NodeBgpView::new(settings.clone());
            rebuilt.replace_all(nodes.values().cloned().map(std::sync::Arc::new));
            prop_assert_eq!(rebuilt.config(), view.config());
        }
    }

    #[test]
    fn another_node_leaving_or_moving_moves_its_session_alone() {
        let mut nodes = three_nodes();
        nodes.extend(
            (4..=5_000).map(|i| node(&format!("node-{i}"), &format!("10.1.{}.{}", i / 256, i % 256), &[], None)),
        );
        let mut view = NodeBgpView::new(settings("node-1"));
        view.replace_all(nodes.iter().cloned().map(std::sync::Arc::new));
        assert_eq!(view.config().unwrap().peers.len(), 4_999);
        // A node leaves, one comes back under another address: its session alone moves.
        view.set_node("node-2", None);
        let moved = node("node-3", "10.0.0.33", &[], None);
        view.set_node("node-3", Some(std::sync::Arc::new(moved)));
        let cfg = view.config().unwrap();
        assert_eq!(cfg.peers.len(), 4_998);
        assert!(cfg.peers.iter().any(|p| p.address == ip("10.0.0.33")));
        assert!(!cfg.peers.iter().any(|p| p.address == ip("10.0.0.2") || p.address == ip("10.0.0.3")));
        // This node becoming a route-reflector client of a cluster with no server: no node
        // sessions (every other node's part derived again under the new role).
        let client = node("node-1", "10.0.0.1", &[(RR_CLIENT_ANNOTATION, "42")], None);
        view.set_node("node-1", Some(std::sync::Arc::new(client)));
        assert!(view.config().unwrap().peers.is_empty());
    }

    fn b64(s: &str) -> String {
        base64::engine::general_purpose::STANDARD.encode(s)
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn node(name: &str, ip: &str, annotations: &[(&str, &str)], pod_cidr: Option<&str>) -> Node {
        Node {
            metadata: ObjectMeta {
                name: Some(name.to_string()),
                annotations: (!annotations.is_empty())
                    .then(|| annotations.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()),
                ..Default::default()
            },
            spec: Some(NodeSpec { pod_cidr: pod_cidr.map(str::to_string), ..Default::default() }),
            status: Some(NodeStatus {
                addresses: (!ip.is_empty()).then(|| {
                    vec![
                        NodeAddress { type_: "Hostname".into(), address: name.into() },
                        NodeAddress { type_: "InternalIP".into(), address: ip.into() },
                    ]
                }),
                ..Default::default()
            }),
        }
    }

    fn settings(name: &str) -> GlobalSettings {
        GlobalSettings { node_name: name.to_string(), ..Default::default() }
    }

    fn three_nodes() -> Vec<Node> {
        vec![
            node("node-1", "10.0.0.1", &[], Some("10.244.1.0/24")),
            node("node-2", "10.0.0.2", &[], Some("10.244.2.0/24")),
            node("node-3", "10.0.0.3", &[], Some("10.244.3.0/24")),
        ]
    }

    fn addrs(cfg: &NodeBgpConfig) -> Vec<IpAddr> {
        cfg.peers.iter().map(|p| p.address).collect()
    }

    fn peer<'a>(cfg: &'a NodeBgpConfig, a: &str) -> &'a PeerConfig {
        cfg.peers.iter().find(|p| p.address == ip(a)).expect("peer present")
    }

    #[test]
    fn three_node_mesh_from_node_1() {
        let cfg = node_bgp_config(&three_nodes(), &settings("node-1")).unwrap();
        assert_eq!(cfg.router_id, Ipv4Addr::new(10, 0, 0, 1));
        assert_eq!(cfg.local_asn, 64512);
        assert_eq!(cfg.local_address, Some(ip("10.0.0.1")));
        assert_eq!(cfg.pod_cidrs, vec!["10.244.1.0/24".parse::<IpNet>().unwrap()]);
        assert_eq!(cfg.route_reflector, RrRole::None);
        assert!(cfg.warnings.is_empty(), "{:?}", cfg.warnings);
        assert_eq!(
            cfg.peers,
            vec![
                PeerConfig {
                    address: ip("10.0.0.2"),
                    asn: 64512,
                    password: None,
                    port: 179,
                    passive: false,
                    route_reflector_client: false,
                    kind: PeerKind::Node { name: "node-2".into() },
                    local_address: None,
                    multihop_ttl: None,
                    accept_default: false,
                    bfd: None,
                    max_prefixes: Some(DEFAULT_MAX_PREFIXES),
                    ttl_security: false,
                },
                PeerConfig {
                    address: ip("10.0.0.3"),
                    asn: 64512,
                    password: None,
                    port: 179,
                    passive: false,
                    route_reflector_client: false,
                    kind: PeerKind::Node { name: "node-3".into() },
                    local_address: None,
                    multihop_ttl: None,
                    accept_default: false,
                    bfd: None,
                    max_prefixes: Some(DEFAULT_MAX_PREFIXES),
                    ttl_security: false,
                },
            ]
        );
    }

    #[test]
    fn mesh_disabled_yields_no_node_peers() {
        let s = GlobalSettings { enable_ibgp: false, ..settings("node-1") };
        let cfg = node_bgp_config(&three_nodes(), &s).unwrap();
        assert!(cfg.peers.is_empty());
    }

    #[test]
    fn advertise_pod_cidr_disabled() {
        let s = GlobalSettings { advertise_pod_cidr: false, ..settings("node-1") };
        assert!(node_bgp_config(&three_nodes(), &s).unwrap().pod_cidrs.is_empty());
    }

    fn rack_settings(name: &str) -> GlobalSettings {
        GlobalSettings { full_mesh: false, ..settings(name) }
    }

    #[test]
    fn without_full_mesh_nodes_peer_only_within_their_asn() {
        let nodes = vec![
            node("node-1", "10.0.0.1", &[(NODE_ASN_ANNOTATION, "65001")], None),
            node("node-2", "10.0.0.2", &[(NODE_ASN_ANNOTATION, "65001")], None),
            node("node-3", "10.0.0.3", &[(NODE_ASN_ANNOTATION, "65002")], None),
            node("node-4", "10.0.0.4", &[(NODE_ASN_ANNOTATION, "65002")], None),
            node("node-5", "10.0.0.5", &[], None), // no rack: nobody peers with it
        ];
        let cfg = node_bgp_config(&nodes, &rack_settings("node-1")).unwrap();
        assert_eq!(cfg.local_asn, 65001);
        assert_eq!(addrs(&cfg), vec![ip("10.0.0.2")]);
        assert_eq!(peer(&cfg, "10.0.0.2").asn, 65001);
        assert!(cfg.warnings.is_empty(), "other racks are skipped silently: {:?}", cfg.warnings);
        let cfg = node_bgp_config(&nodes, &rack_settings("node-3")).unwrap();
        assert_eq!((cfg.local_asn, addrs(&cfg)), (65002, vec![ip("10.0.0.4")]));
        // A node without an ASN cannot run BGP in this mode (as in kube-router).
        let err = node_bgp_config(&nodes, &rack_settings("node-5")).unwrap_err();
        assert_eq!(err, PeerConfigError::MissingLocalAsn { node: "node-5".into() });
        assert!(err.to_string().contains(NODE_ASN_ANNOTATION));
    }

    #[test]
    fn full_mesh_runs_the_cluster_asn_and_peers_with_every_node() {
        let nodes = vec![
            node("node-1", "10.0.0.1", &[(NODE_ASN_ANNOTATION, "65001")], None),
            node("node-2", "10.0.0.2", &[(NODE_ASN_ANNOTATION, "65002")], None),
            node("node-3", "10.0.0.3", &[], None),
        ];
        let cfg = node_bgp_config(&nodes, &settings("node-1")).unwrap();
        assert_eq!(cfg.local_asn, 64512);
        assert_eq!(addrs(&cfg), vec![ip("10.0.0.2"), ip("10.0.0.3")]);
        assert!(cfg.peers.iter().all(|p| p.asn == 64512));
        assert_eq!(
            cfg.warnings,
            vec![PeerConfigWarning::NodeAsnIgnoredInFullMesh { node: "node-1".into(), value: "65001".into() }]
        );
    }

    #[test]
    fn invalid_asn_on_other_node_is_a_warning() {
        let mut nodes: Vec<Node> = ["1", "2", "3"]
            .iter()
            .map(|i| node(&format!("node-{i}"), &format!("10.0.0.{i}"), &[(NODE_ASN_ANNOTATION, "65001")], None))
            .collect();
        nodes.push(node("node-4", "10.0.0.4", &[(NODE_ASN_ANNOTATION, "not-a-number")], None));
        nodes.push(node("node-5", "10.0.0.5", &[(NODE_ASN_ANNOTATION, "0")], None));
        let cfg = node_bgp_config(&nodes, &rack_settings("node-1")).unwrap();
        assert_eq!(addrs(&cfg), vec![ip("10.0.0.2"), ip("10.0.0.3")]);
        assert_eq!(
            cfg.warnings,
            vec![
                PeerConfigWarning::InvalidNodeAsn { node: "node-4".into(), value: "not-a-number".into() },
                PeerConfigWarning::InvalidNodeAsn { node: "node-5".into(), value: "0".into() },
            ]
        );
        let msg = cfg.warnings[0].to_string();
        assert!(msg.contains("node-4") && msg.contains(NODE_ASN_ANNOTATION) && msg.contains("not-a-number"));
    }

    #[test]
    fn invalid_asn_on_this_node_is_an_error() {
        let nodes = vec![node("node-1", "10.0.0.1", &[(NODE_ASN_ANNOTATION, "4294967295")], None)];
        let err = node_bgp_config(&nodes, &rack_settings("node-1")).unwrap_err();
        assert_eq!(err, PeerConfigError::InvalidLocalAsn { node: "node-1".into(), value: "4294967295".into() });
        assert!(err.to_string().contains("node-1"));
    }

    #[test]
    fn route_reflection_in_rack_mode_stays_within_the_asn() {
        let nodes = vec![
            node("rr", "10.0.0.1", &[(NODE_ASN_ANNOTATION, "65001"), (RR_SERVER_ANNOTATION, "1")], None),
            node("c1", "10.0.0.2", &[(NODE_ASN_ANNOTATION, "65001"), (RR_CLIENT_ANNOTATION, "1")], None),
            node("c2", "10.0.0.3", &[(NODE_ASN_ANNOTATION, "65002"), (RR_CLIENT_ANNOTATION, "1")], None),
        ];
        let cfg = node_bgp_config(&nodes, &rack_settings("rr")).unwrap();
        assert_eq!(addrs(&cfg), vec![ip("10.0.0.2")]);
        assert!(peer(&cfg, "10.0.0.2").route_reflector_client);
    }

    #[test]
    fn peers_yaml_annotation_wins_over_the_lists() {
        let yaml = format!(
            "- remoteip: 192.168.1.99\n  remoteasn: 65000\n  password: {}\n  localip: 10.0.0.1\n  port: 1790\n- remoteip: \"2001:db8::1\"\n  remoteasn: 4200000000\n  acceptdefault: true\n",
            b64("SecurePassword")
        );
        let nodes = vec![node(
            "node-1",
            "10.0.0.1",
            &[(PEERS_ANNOTATION, &yaml), (PEER_IPS_ANNOTATION, "192.168.1.1"), (PEER_ASNS_ANNOTATION, "65001")],
            None,
        )];
        let cfg = node_bgp_config(&nodes, &settings("node-1")).unwrap();
        assert_eq!(addrs(&cfg), vec![ip("192.168.1.99"), ip("2001:db8::1")]);
        let first = peer(&cfg, "192.168.1.99");
        assert_eq!((first.asn, first.port, first.local_address), (65000, 1790, Some(ip("10.0.0.1"))));
        assert_eq!(first.password.as_deref(), Some("SecurePassword"));
        assert!(!first.accept_default && peer(&cfg, "2001:db8::1").accept_default);
        assert_eq!(peer(&cfg, "2001:db8::1").port, 179);
        assert_eq!(cfg.warnings, vec![PeerConfigWarning::PeersAnnotationWins { node: "node-1".into() }]);

        for broken in [
            "- remoteip: nope\n  remoteasn: 1",
            "- remoteasn: 65000",
            "{not: a list}",
            "- remoteip: 192.0.2.1\n  remoteasn: 0",
        ] {
            let nodes = vec![node("node-1", "10.0.0.1", &[(PEERS_ANNOTATION, broken)], None)];
            let cfg = node_bgp_config(&nodes, &settings("node-1")).unwrap();
            assert!(cfg.peers.is_empty(), "{broken}");
            assert!(
                matches!(&cfg.warnings[..], [PeerConfigWarning::InvalidPeerAnnotations { reason, .. }] if reason.contains(PEERS_ANNOTATION)),
                "{broken}: {:?}",
                cfg.warnings
            );
        }
    }

    #[test]
    fn prefix_limit_and_ttl_security_per_peer_override_the_flags() {
        let yaml = "- remoteip: 192.168.1.1\n  remoteasn: 65000\n  maxprefixes: 500\n  ttlsecurity: true\n\
                    - remoteip: 192.168.1.2\n  remoteasn: 65000\n  maxprefixes: 0\n\
                    - remoteip: 192.168.1.3\n  remoteasn: 65000\n  ttlsecurity: false\n";
        let nodes = vec![node("node-1", "10.0.0.1", &[(PEERS_ANNOTATION, yaml)], None)];
        let s = GlobalSettings {
            max_prefixes: Some(1000),
            ttl_security: true,
            external_peers: parse_external_peer_flags(&["192.168.9.9".into()], &["65009".into()], &[], &[]).unwrap(),
            ..settings("node-1")
        };
        let cfg = node_bgp_config(&nodes, &s).unwrap();
        let got = |a: &str| (peer(&cfg, a).max_prefixes, peer(&cfg, a).ttl_security);
        assert_eq!(got("192.168.1.1"), (Some(500), true));
        assert_eq!(got("192.168.1.2"), (None, true), "0: no limit");
        assert_eq!(got("192.168.1.3"), (Some(1000), false));
        assert_eq!(got("192.168.9.9"), (Some(1000), true), "flag peers take the flags");
        assert_eq!(GlobalSettings::default().max_prefixes, Some(DEFAULT_MAX_PREFIXES));

        let broken = "- remoteip: 192.168.1.1\n  remoteasn: 65000\n  maxprefixes: 4294967296\n";
        let nodes = vec![node("node-1", "10.0.0.1", &[(PEERS_ANNOTATION, broken)], None)];
        let cfg = node_bgp_config(&nodes, &s).unwrap();
        assert_eq!(addrs(&cfg), vec![ip("192.168.9.9")], "only the flag peer is left");
        assert_eq!(cfg.warnings.len(), 1, "{:?}", cfg.warnings);
    }

    #[test]
    fn local_ips_ports_multihop_and_the_routing_annotations() {
        let nodes = vec![node(
            "node-1",
            "10.0.0.1",
            &[
                (PEER_IPS_ANNOTATION, "192.168.1.1,192.168.2.1"),
                (PEER_ASNS_ANNOTATION, "65000,65000"),
                (PEER_LOCAL_IPS_ANNOTATION, "10.0.0.1,"),
                (PEER_PORTS_ANNOTATION, ",1790"),
                (LOCAL_ADDRESSES_ANNOTATION, "10.0.0.1, 192.168.1.10"),
                (PATH_PREPEND_AS_ANNOTATION, "65000"),
                (PATH_PREPEND_REPEAT_ANNOTATION, "5"),
                (COMMUNITIES_ANNOTATION, "no-export,65535:1,bogus"),
                (CUSTOM_IMPORT_REJECT_ANNOTATION, "10.0.0.0/16, 192.168.1.0/24"),
            ],
            None,
        )];
        let s = GlobalSettings { multihop_ttl: Some(4), ..settings("node-1") };
        let cfg = node_bgp_config(&nodes, &s).unwrap();
        let (a, b) = (peer(&cfg, "192.168.1.1"), peer(&cfg, "192.168.2.1"));
        assert_eq!((a.local_address, a.port, a.multihop_ttl), (Some(ip("10.0.0.1")), 179, Some(4)));
        assert_eq!((b.local_address, b.port), (None, 1790));
        assert_eq!(cfg.listen_addresses, vec![ip("10.0.0.1"), ip("192.168.1.10")]);
        assert_eq!(cfg.prepend, Some(AsPrepend { asn: 65000, repeat: 5 }));
        assert_eq!(cfg.communities, vec![0xffff_ff01, 0xffff_0001]);
        assert_eq!(cfg.custom_import_reject.len(), 2);
        assert!(
            matches!(&cfg.warnings[..], [PeerConfigWarning::InvalidAnnotation { annotation: COMMUNITIES_ANNOTATION, value, .. }] if value == "bogus"),
            "{:?}",
            cfg.warnings
        );
        // Half a prepend, a broken reject list: warned about and ignored, the rest applies.
        let nodes = vec![node(
            "node-1",
            "10.0.0.1",
            &[(PATH_PREPEND_AS_ANNOTATION, "65000"), (CUSTOM_IMPORT_REJECT_ANNOTATION, "10.0.0.0/16,junk")],
            None,
        )];
        let cfg = node_bgp_config(&nodes, &settings("node-1")).unwrap();
        assert_eq!((cfg.prepend, cfg.custom_import_reject.len(), cfg.warnings.len()), (None, 0, 2));
    }

    #[test]
    fn passwords_file_and_port_flags() {
        assert_eq!(parse_passwords_file("U2VjdXJl,\n"), vec!["U2VjdXJl".to_string(), String::new()]);
        assert!(parse_passwords_file("\n").is_empty());
        let v = |xs: &[&str]| xs.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let peers =
            parse_external_peer_flags(&v(&["192.0.2.1", "192.0.2.2"]), &v(&["65000", "65000"]), &[], &v(&["", "1790"]))
                .unwrap();
        assert_eq!(peers[0].peer_config(179).port, 179);
        assert_eq!(peers[1].peer_config(179).port, 1790);
        let err = parse_external_peer_flags(&v(&["192.0.2.1"]), &v(&["65000"]), &[], &v(&["0"])).unwrap_err();
        assert!(err.to_string().contains("--peer-router-ports"), "{err}");
    }

    #[test]
    fn other_node_without_address_is_a_warning() {
        let mut nodes = three_nodes();
        nodes.push(node("node-4", "", &[], None));
        let cfg = node_bgp_config(&nodes, &settings("node-1")).unwrap();
        assert_eq!(addrs(&cfg), vec![ip("10.0.0.2"), ip("10.0.0.3")]);
        assert_eq!(cfg.warnings, vec![PeerConfigWarning::NodeWithoutAddress { node: "node-4".into() }]);
    }

    #[test]
    fn deleting_node_is_still_a_peer() {
        let mut nodes = three_nodes();
        nodes[2].metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
        let cfg = node_bgp_config(&nodes, &settings("node-1")).unwrap();
        assert_eq!(addrs(&cfg), vec![ip("10.0.0.2"), ip("10.0.0.3")]);
    }

    #[test]
    fn external_ip_fallback() {
        let mut n2 = node("node-2", "", &[], None);
        n2.status.as_mut().unwrap().addresses =
            Some(vec![NodeAddress { type_: "ExternalIP".into(), address: "203.0.113.2".into() }]);
        let nodes = vec![node("node-1", "10.0.0.1", &[], None), n2];
        let cfg = node_bgp_config(&nodes, &settings("node-1")).unwrap();
        assert_eq!(addrs(&cfg), vec![ip("203.0.113.2")]);
    }

    fn rr_cluster() -> Vec<Node> {
        vec![
            node("rr-1", "10.0.0.1", &[(RR_SERVER_ANNOTATION, "42")], None),
            node("rr-2", "10.0.0.2", &[(RR_SERVER_ANNOTATION, "0.0.0.42")], None),
            node("client-1", "10.0.1.1", &[(RR_CLIENT_ANNOTATION, "42")], None),
            node("client-2", "10.0.1.2", &[(RR_CLIENT_ANNOTATION, "0.0.0.42")], None),
            node("client-other", "10.0.1.3", &[(RR_CLIENT_ANNOTATION, "1.2.3.4")], None),
            node("plain", "10.0.2.1", &[], None),
        ]
    }

    #[test]
    fn rr_server_view() {
        let cfg = node_bgp_config(&rr_cluster(), &settings("rr-1")).unwrap();
        assert_eq!(cfg.route_reflector, RrRole::Server { cluster_id: Ipv4Addr::new(0, 0, 0, 42) });
        assert_eq!(addrs(&cfg), vec![ip("10.0.0.2"), ip("10.0.1.1"), ip("10.0.1.2"), ip("10.0.2.1")]);
        assert!(!peer(&cfg, "10.0.0.2").route_reflector_client, "other server is a normal iBGP peer");
        assert!(peer(&cfg, "10.0.1.1").route_reflector_client);
        assert!(peer(&cfg, "10.0.1.2").route_reflector_client);
        assert!(!peer(&cfg, "10.0.2.1").route_reflector_client);
        assert!(cfg.warnings.is_empty(), "{:?}", cfg.warnings);
    }

    #[test]
    fn rr_client_view() {
        let cfg = node_bgp_config(&rr_cluster(), &settings("client-1")).unwrap();
        assert_eq!(cfg.route_reflector, RrRole::Client { cluster_id: Ipv4Addr::new(0, 0, 0, 42) });
        assert_eq!(addrs(&cfg), vec![ip("10.0.0.1"), ip("10.0.0.2")]);
        assert!(cfg.peers.iter().all(|p| !p.route_reflector_client));

        // A client of a cluster with no servers has no node peers.
        let cfg = node_bgp_config(&rr_cluster(), &settings("client-other")).unwrap();
        assert!(cfg.peers.is_empty());
    }

    #[test]
    fn rr_plain_node_view_skips_clients() {
        let cfg = node_bgp_config(&rr_cluster(), &settings("plain")).unwrap();
        assert_eq!(addrs(&cfg), vec![ip("10.0.0.1"), ip("10.0.0.2")]);
    }

    #[test]
    fn rr_invalid_annotations() {
        let mut nodes = rr_cluster();
        nodes.push(node("bad", "10.0.3.1", &[(RR_CLIENT_ANNOTATION, "nope")], None));
        let cfg = node_bgp_config(&nodes, &settings("rr-1")).unwrap();
        assert!(!addrs(&cfg).contains(&ip("10.0.3.1")));
        assert_eq!(
            cfg.warnings,
            vec![PeerConfigWarning::InvalidRrAnnotation {
                node: "bad".into(),
                annotation: RR_CLIENT_ANNOTATION,
                value: "nope".into()
            }]
        );
        let err = node_bgp_config(&nodes, &settings("bad")).unwrap_err();
        assert!(matches!(err, PeerConfigError::InvalidRrClusterId { annotation: RR_CLIENT_ANNOTATION, .. }));
    }

    #[test]
    fn per_node_peer_annotations_with_passwords_and_ports() {
        let ips = "192.168.1.1, 2001:db8::1";
        let pws = format!("{},{}", b64("s3cret"), b64("other"));
        let nodes = vec![node(
            "node-1",
            "10.0.0.1",
            &[
                (PEER_IPS_ANNOTATION, ips),
                (PEER_ASNS_ANNOTATION, "65000,65010"),
                (PEER_PASSWORDS_ANNOTATION, &pws),
                (PEER_PORTS_ANNOTATION, "179,1790"),
            ],
            None,
        )];
        let cfg = node_bgp_config(&nodes, &settings("node-1")).unwrap();
        assert!(cfg.warnings.is_empty(), "{:?}", cfg.warnings);
        assert_eq!(
            cfg.peers,
            vec![
                external_peer(ip("192.168.1.1"), 65000, Some("s3cret".into()), 179),
                external_peer(ip("2001:db8::1"), 65010, Some("other".into()), 1790),
            ]
        );
        assert!(!format!("{:?}", cfg.peers).contains("s3cret"), "Debug must redact passwords");
    }

    #[test]
    fn per_node_peer_annotations_mismatch_is_warning_and_flags_still_apply() {
        let mut s = settings("node-1");
        s.external_peers = vec![ExternalPeerFlag { address: ip("172.16.0.1"), asn: 65100, password: None, port: None }];
        let nodes = vec![
            node(
                "node-1",
                "10.0.0.1",
                &[(PEER_IPS_ANNOTATION, "192.168.1.1,192.168.1.2"), (PEER_ASNS_ANNOTATION, "65000")],
                None,
            ),
            node("node-2", "10.0.0.2", &[], None),
        ];
        let cfg = node_bgp_config(&nodes, &s).unwrap();
        assert_eq!(addrs(&cfg), vec![ip("10.0.0.2"), ip("172.16.0.1")]);
        assert_eq!(cfg.warnings.len(), 1);
        let msg = cfg.warnings[0].to_string();
        assert!(msg.contains("node-1") && msg.contains(PEER_ASNS_ANNOTATION), "{msg}");
    }

    #[test]
    fn per_node_peer_annotations_bad_password_is_warning() {
        let long = b64(&"x".repeat(81));
        for (pw, needle) in [("%%%", "base64"), (long.as_str(), "80"), ("/w==", "UTF-8")] {
            let nodes = vec![node(
                "node-1",
                "10.0.0.1",
                &[
                    (PEER_IPS_ANNOTATION, "192.168.1.1"),
                    (PEER_ASNS_ANNOTATION, "65000"),
                    (PEER_PASSWORDS_ANNOTATION, pw),
                ],
                None,
            )];
            let cfg = node_bgp_config(&nodes, &settings("node-1")).unwrap();
            assert!(cfg.peers.is_empty());
            let [PeerConfigWarning::InvalidPeerAnnotations { reason, .. }] = &cfg.warnings[..] else {
                panic!("{pw}: {:?}", cfg.warnings);
            };
            assert!(reason.contains(needle), "{pw}: {reason}");
        }
    }

    #[test]
    fn global_external_peers_and_annotation_override() {
        let mut s = settings("node-1");
        s.external_peers = parse_external_peer_flags(
            &["192.168.1.1".into(), "192.168.1.2".into(), "10.0.0.2".into()],
            &["65000".into(), "65000".into(), "65099".into()],
            &[b64("flagpw"), String::new(), String::new()],
            &[],
        )
        .unwrap();
        let nodes = vec![
            node("node-1", "10.0.0.1", &[(PEER_IPS_ANNOTATION, "192.168.1.1"), (PEER_ASNS_ANNOTATION, "65005")], None),
            node("node-2", "10.0.0.2", &[], None),
        ];
        let cfg = node_bgp_config(&nodes, &s).unwrap();
        assert_eq!(addrs(&cfg), vec![ip("10.0.0.2"), ip("192.168.1.1"), ip("192.168.1.2")]);
        // Annotation beats flag (and its password).
        assert_eq!(*peer(&cfg, "192.168.1.1"), external_peer(ip("192.168.1.1"), 65005, None, 179));
        assert_eq!(*peer(&cfg, "192.168.1.2"), external_peer(ip("192.168.1.2"), 65000, None, 179));
        // Flag beats the mesh entry for node-2.
        assert_eq!(*peer(&cfg, "10.0.0.2"), external_peer(ip("10.0.0.2"), 65099, None, 179));
        assert_eq!(
            cfg.warnings,
            vec![
                PeerConfigWarning::DuplicatePeer {
                    address: ip("10.0.0.2"),
                    kept: Source::Flag.to_string(),
                    dropped: Source::Mesh("node-2".into()).to_string(),
                },
                PeerConfigWarning::DuplicatePeer {
                    address: ip("192.168.1.1"),
                    kept: Source::Annotation("node-1".into()).to_string(),
                    dropped: Source::Flag.to_string(),
                },
            ]
        );
    }

    #[test]
    fn self_is_excluded() {
        let mut me =
            node("node-1", "10.0.0.1", &[(PEER_IPS_ANNOTATION, "10.0.0.1"), (PEER_ASNS_ANNOTATION, "65000")], None);
        me.status
            .as_mut()
            .unwrap()
            .addresses
            .as_mut()
            .unwrap()
            .push(NodeAddress { type_: "ExternalIP".into(), address: "203.0.113.1".into() });
        let mut s = settings("node-1");
        s.external_peers =
            vec![ExternalPeerFlag { address: ip("203.0.113.1"), asn: 65000, password: None, port: None }];
        // A stale second Node object claiming our IP must not make us peer with ourselves either.
        let nodes = vec![me, node("node-2", "10.0.0.2", &[], None), node("ghost", "10.0.0.1", &[], None)];
        let cfg = node_bgp_config(&nodes, &s).unwrap();
        assert_eq!(addrs(&cfg), vec![ip("10.0.0.2")]);
        assert_eq!(cfg.warnings.len(), 3);
        assert!(cfg.warnings.iter().all(|w| matches!(w, PeerConfigWarning::SelfPeer { .. })));
    }

    #[test]
    fn missing_this_node_is_an_error() {
        let err = node_bgp_config(&three_nodes(), &settings("node-9")).unwrap_err();
        assert!(
            matches!(err, PeerConfigError::ThisNodeNotFound { ref node_name, node_count: 3 } if node_name == "node-9")
        );
        assert!(err.to_string().contains("node-9"));
    }

    #[test]
    fn router_id_annotation() {
        let nodes = vec![node("node-1", "10.0.0.1", &[(ROUTER_ID_ANNOTATION, "1.1.1.1")], None)];
        assert_eq!(node_bgp_config(&nodes, &settings("node-1")).unwrap().router_id, Ipv4Addr::new(1, 1, 1, 1));

        let nodes = vec![node("node-1", "10.0.0.1", &[(ROUTER_ID_ANNOTATION, "2001:db8::1")], None)];
        let cfg = node_bgp_config(&nodes, &settings("node-1")).unwrap();
        assert_eq!(cfg.router_id, Ipv4Addr::new(10, 0, 0, 1));
        assert!(matches!(&cfg.warnings[..], [PeerConfigWarning::InvalidRouterIdAnnotation { .. }]));

        // IPv6-only node: annotation required.
        let nodes = vec![node("node-1", "2001:db8::10", &[], None)];
        assert_eq!(
            node_bgp_config(&nodes, &settings("node-1")).unwrap_err(),
            PeerConfigError::NoRouterId { node: "node-1".into() }
        );
        let nodes = vec![node("node-1", "2001:db8::10", &[(ROUTER_ID_ANNOTATION, "10.9.9.9")], None)];
        let cfg = node_bgp_config(&nodes, &settings("node-1")).unwrap();
        assert_eq!(cfg.router_id, Ipv4Addr::new(10, 9, 9, 9));
        assert_eq!(cfg.local_address, Some(ip("2001:db8::10")));
    }

    #[test]
    fn router_id_prefers_ipv4_on_dual_stack() {
        let mut me = node("node-1", "fd00::1", &[], None);
        me.status
            .as_mut()
            .unwrap()
            .addresses
            .as_mut()
            .unwrap()
            .push(NodeAddress { type_: "InternalIP".into(), address: "10.0.0.1".into() });
        let cfg = node_bgp_config(&[me], &settings("node-1")).unwrap();
        assert_eq!(cfg.router_id, Ipv4Addr::new(10, 0, 0, 1));
        assert_eq!(cfg.local_address, Some(ip("fd00::1")), "node IP is the first InternalIP");
    }

    #[test]
    fn router_id_flag_generate_and_fixed() {
        // Expected values: FNV-1a 32 of the 16-byte address, computed apart (Python).
        assert_eq!(hashed_router_id(ip("10.0.0.1")), Ipv4Addr::new(0, 15, 248, 254));
        assert_eq!(hashed_router_id(ip("fd00::1")), Ipv4Addr::new(148, 2, 92, 203));
        let v6_only = node("node-1", "fd00::1", &[], None);
        assert!(matches!(
            node_bgp_config(std::slice::from_ref(&v6_only), &settings("node-1")),
            Err(PeerConfigError::NoRouterId { .. })
        ));
        let generate = GlobalSettings { router_id: RouterIdSetting::Generate, ..settings("node-1") };
        assert_eq!(node_bgp_config(&[v6_only], &generate).unwrap().router_id, Ipv4Addr::new(148, 2, 92, 203));
        let fixed =
            GlobalSettings { router_id: RouterIdSetting::Fixed(Ipv4Addr::new(1, 2, 3, 4)), ..settings("node-1") };
        let me = node("node-1", "10.0.0.1", &[], None);
        assert_eq!(node_bgp_config(&[me], &fixed).unwrap().router_id, Ipv4Addr::new(1, 2, 3, 4));
    }

    #[test]
    fn dual_stack_pod_cidrs() {
        let mut me = node("node-1", "10.0.0.1", &[], Some("10.244.1.0/24"));
        me.spec.as_mut().unwrap().pod_cidrs =
            Some(vec!["10.244.1.0/24".into(), "fd00:10:244:1::/64".into(), "garbage".into()]);
        let cfg = node_bgp_config(&[me], &settings("node-1")).unwrap();
        assert_eq!(
            cfg.pod_cidrs,
            vec!["10.244.1.0/24".parse::<IpNet>().unwrap(), "fd00:10:244:1::/64".parse().unwrap()]
        );
        assert_eq!(
            cfg.warnings,
            vec![PeerConfigWarning::InvalidPodCidr { node: "node-1".into(), value: "garbage".into() }]
        );
    }

    #[test]
    fn pod_cidr_annotations_override_the_spec_and_a_malformed_one_changes_nothing() {
        let me = node(
            "node-1",
            "10.0.0.1",
            &[("kube-router.io/pod-cidrs", "10.50.1.0/24,fd00:50:1::/64")],
            Some("10.244.1.0/24"),
        );
        let cfg = node_bgp_config(&[me], &settings("node-1")).unwrap();
        assert_eq!(cfg.pod_cidrs, vec!["10.50.1.0/24".parse::<IpNet>().unwrap(), "fd00:50:1::/64".parse().unwrap()]);
        let me = node("node-1", "10.0.0.1", &[("kube-router.io/pod-cidr", "10.50.1.0/33")], Some("10.244.1.0/24"));
        let error = node_bgp_config(&[me], &settings("node-1")).unwrap_err();
        assert!(matches!(error, PeerConfigError::InvalidPodCidrAnnotation(_)), "{error}");
        assert!(error.to_string().contains("kube-router.io/pod-cidr=\"10.50.1.0/33\""), "{error}");
    }

    #[test]
    fn deterministic_sorted_output() {
        let mut s = settings("node-1");
        s.external_peers = vec![
            ExternalPeerFlag { address: ip("2001:db8::5"), asn: 65000, password: None, port: None },
            ExternalPeerFlag { address: ip("1.1.1.1"), asn: 65000, password: None, port: None },
        ];
        let mut nodes = vec![
            node("node-1", "10.0.0.1", &[], None),
            node("node-c", "10.0.0.30", &[], None),
            node("node-a", "10.0.0.4", &[], None),
            node("node-b", "10.0.0.200", &[], None),
            node("dup-x", "10.0.0.9", &[], None),
            node("dup-y", "10.0.0.9", &[], None),
        ];
        let first = node_bgp_config(&nodes, &s).unwrap();
        nodes.reverse();
        let second = node_bgp_config(&nodes, &s).unwrap();
        assert_eq!(first, second);
        assert_eq!(
            addrs(&first),
            ["1.1.1.1", "10.0.0.4", "10.0.0.9", "10.0.0.30", "10.0.0.200", "2001:db8::5"].map(ip).to_vec()
        );
        assert_eq!(peer(&first, "10.0.0.9").kind, PeerKind::Node { name: "dup-x".into() });
    }

    #[test]
    fn parse_flags() {
        let v = |xs: &[&str]| xs.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(parse_external_peer_flags(&[], &[], &[], &[]).unwrap(), vec![]);
        let peers =
            parse_external_peer_flags(&v(&["192.0.2.1", "2001:db8::1"]), &v(&["65000", "4200000000"]), &[], &[])
                .unwrap();
        assert_eq!(peers.len(), 2);
        assert_eq!(peers[1].asn, 4_200_000_000);
        assert!(peers.iter().all(|p| p.password.is_none()));

        let err = parse_external_peer_flags(&v(&["192.0.2.1"]), &[], &[], &[]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "--peer-router-asns has 0 entries but --peer-router-ips has 1; they must have the same length"
        );
        let err = parse_external_peer_flags(&v(&["192.0.2.1"]), &v(&["1"]), &v(&["a", "b"]), &[]).unwrap_err();
        assert!(matches!(err, PeerConfigError::LengthMismatch { field: PEER_PASSWORDS_FLAG, .. }));
        let err = parse_external_peer_flags(&v(&["192.0.2.300"]), &v(&["1"]), &[], &[]).unwrap_err();
        assert!(err.to_string().contains("192.0.2.300"));
        let err = parse_external_peer_flags(&v(&["192.0.2.1"]), &v(&["0"]), &[], &[]).unwrap_err();
        assert!(matches!(err, PeerConfigError::InvalidValue { field: PEER_ASNS_FLAG, index: 0, .. }));
        let err = parse_external_peer_flags(&v(&["192.0.2.1"]), &v(&["1"]), &v(&["!!"]), &[]).unwrap_err();
        assert!(err.to_string().contains("base64") && !err.to_string().contains("!!"), "{err}");
        let ok = parse_external_peer_flags(&v(&["192.0.2.1"]), &v(&["1"]), &[b64(&"p".repeat(80))], &[]).unwrap();
        assert_eq!(ok[0].password.as_deref().map(str::len), Some(80));
    }

    #[test]
    fn invalid_settings() {
        let s = GlobalSettings { cluster_asn: 0, ..settings("node-1") };
        assert_eq!(node_bgp_config(&three_nodes(), &s).unwrap_err(), PeerConfigError::InvalidClusterAsn(0));
        let s = GlobalSettings { peer_port: 0, ..settings("node-1") };
        assert_eq!(node_bgp_config(&three_nodes(), &s).unwrap_err(), PeerConfigError::InvalidPeerPort);
    }
}
