//! Derivation of this node's BGP configuration from Kubernetes `Node` objects plus command-line flags.
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

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr};

use base64::Engine as _;
use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node;

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
/// Annotation listing per-node external peer passwords (base64).
pub const PEER_PASSWORDS_ANNOTATION: &str = "kube-router.io/peer.passwords";
/// Annotation listing per-node external peer ports.
pub const PEER_PORTS_ANNOTATION: &str = "kube-router.io/peer.ports";

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
}

impl ExternalPeerFlag {
    /// The session configuration for this peer on `port`.
    pub fn peer_config(&self, port: u16) -> PeerConfig {
        external_peer(self.address, self.asn, self.password.clone(), port)
    }
}

impl fmt::Debug for ExternalPeerFlag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExternalPeerFlag")
            .field("address", &self.address)
            .field("asn", &self.asn)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
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
    pub enable_ibgp_mesh: bool,
    /// Parsed `--peer-router-ips/--peer-router-asns/--peer-router-passwords`.
    pub external_peers: Vec<ExternalPeerFlag>,
    /// Port used for node peers and for external peers without an explicit port. Default 179.
    pub peer_port: u16,
    /// `--advertise-pod-cidr`, default true. When false, [`NodeBgpConfig::pod_cidrs`] is empty.
    pub advertise_pod_cidr: bool,
}

impl Default for GlobalSettings {
    fn default() -> Self {
        Self {
            node_name: String::new(),
            cluster_asn: DEFAULT_CLUSTER_ASN,
            enable_ibgp_mesh: true,
            external_peers: Vec::new(),
            peer_port: DEFAULT_BGP_PORT,
            advertise_pod_cidr: true,
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
    /// Pod CIDRs to advertise (empty when `advertise_pod_cidr` is false).
    pub pod_cidrs: Vec<IpNet>,
    /// Sorted by address, at most one entry per address.
    pub peers: Vec<PeerConfig>,
    pub route_reflector: RrRole,
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
    /// This node has an unparsable pod CIDR; it is not advertised.
    InvalidPodCidr { node: String, value: String },
    /// This node's per-node peer annotations are broken; all per-node peers are skipped.
    InvalidPeerAnnotations { node: String, reason: String },
    /// Two sources configured the same peer address; only `kept` is used.
    DuplicatePeer { address: IpAddr, kept: String, dropped: String },
    /// A configured peer address belongs to this node; it is skipped.
    SelfPeer { address: IpAddr, source: String },
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
}

const FLAG_FIELDS: ListFields = ListFields {
    ips: PEER_IPS_FLAG,
    asns: PEER_ASNS_FLAG,
    passwords: PEER_PASSWORDS_FLAG,
    ports: "--peer-router-ports",
};

const ANNOTATION_FIELDS: ListFields = ListFields {
    ips: PEER_IPS_ANNOTATION,
    asns: PEER_ASNS_ANNOTATION,
    passwords: PEER_PASSWORDS_ANNOTATION,
    ports: PEER_PORTS_ANNOTATION,
};

struct ParsedPeer {
    address: IpAddr,
    asn: u32,
    password: Option<String>,
    port: Option<u16>,
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
) -> Result<Vec<ParsedPeer>, PeerConfigError> {
    check_len(fields.asns, asns.len(), fields.ips, ips.len())?;
    if !passwords.is_empty() {
        check_len(fields.passwords, passwords.len(), fields.ips, ips.len())?;
    }
    if !ports.is_empty() {
        check_len(fields.ports, ports.len(), fields.ips, ips.len())?;
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
        let port = match ports.get(i) {
            Some(p) => {
                let p = p.as_ref();
                Some(
                    p.trim()
                        .parse::<u16>()
                        .ok()
                        .filter(|&n| n != 0)
                        .ok_or_else(|| invalid(fields.ports, i, p, "expected a port in 1..=65535"))?,
                )
            }
            None => None,
        };
        out.push(ParsedPeer { address, asn, password, port });
    }
    Ok(out)
}

/// Parses kube-router's `--peer-router-ips`, `--peer-router-asns` and `--peer-router-passwords` flags
/// (each element is one entry; the flag library has already split on commas).
///
/// `ips` and `asns` must have the same length; `passwords` must be empty or have that length too. Passwords
/// are base64-encoded; an empty entry means "no password".
pub fn parse_external_peer_flags(
    ips: &[String],
    asns: &[String],
    passwords: &[String],
) -> Result<Vec<ExternalPeerFlag>, PeerConfigError> {
    Ok(parse_peer_lists(&FLAG_FIELDS, ips, asns, passwords, &[])?
        .into_iter()
        .map(|p| ExternalPeerFlag { address: p.address, asn: p.asn, password: p.password })
        .collect())
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
/// annotations become [`PeerConfigWarning`]s.
pub fn node_bgp_config(nodes: &[Node], settings: &GlobalSettings) -> Result<NodeBgpConfig, PeerConfigError> {
    if !(MIN_ASN..=MAX_ASN).contains(&settings.cluster_asn) {
        return Err(PeerConfigError::InvalidClusterAsn(settings.cluster_asn));
    }
    if settings.peer_port == 0 {
        return Err(PeerConfigError::InvalidPeerPort);
    }
    let me = nodes.iter().find(|n| node_name(n) == settings.node_name).ok_or_else(|| {
        PeerConfigError::ThisNodeNotFound { node_name: settings.node_name.clone(), node_count: nodes.len() }
    })?;
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
    let router_id = annotated_router_id
        .or_else(|| first_v4("InternalIP"))
        .or_else(|| first_v4("ExternalIP"))
        .ok_or_else(|| PeerConfigError::NoRouterId { node: my_name.to_string() })?;

    let local_asn = match annotation(me, NODE_ASN_ANNOTATION) {
        Some(v) => parse_asn(v)
            .ok_or_else(|| PeerConfigError::InvalidLocalAsn { node: my_name.to_string(), value: v.to_string() })?,
        None => settings.cluster_asn,
    };

    let route_reflector = rr_role(me, &mut warnings).map_err(|(annotation, value)| {
        PeerConfigError::InvalidRrClusterId { node: my_name.to_string(), annotation, value }
    })?;

    let pod_cidrs = if settings.advertise_pod_cidr { pod_cidrs(me, &mut warnings) } else { Vec::new() };

    let own_ips = all_node_ips(me);
    let local_address = node_ip(me);
    let mut set = PeerSet { own_ips: &own_ips, peers: BTreeMap::new(), warnings: &mut warnings };

    if settings.enable_ibgp_mesh {
        // Iterate in name order so duplicate-address warnings do not depend on list order.
        let mut others: Vec<&Node> = nodes.iter().filter(|n| node_name(n) != my_name).collect();
        others.sort_by(|a, b| node_name(a).cmp(node_name(b)));
        // Note: nodes with metadata.deletionTimestamp set are deliberately still peered with. Deletion can
        // be slow (finalizers) or never complete, and the node may still be forwarding traffic; dropping the
        // session early would withdraw its pod routes while its pods may still be running. The peer goes
        // away when the Node object does.
        for other in others {
            let name = node_name(other).to_string();
            let asn = match annotation(other, NODE_ASN_ANNOTATION) {
                Some(v) => match parse_asn(v) {
                    Some(asn) => asn,
                    None => {
                        set.warnings.push(PeerConfigWarning::InvalidNodeAsn { node: name, value: v.to_string() });
                        continue;
                    }
                },
                None => settings.cluster_asn,
            };
            // kube-router only builds iBGP sessions between nodes of the same ASN.
            if asn != local_asn {
                continue;
            }
            let role = match rr_role(other, set.warnings) {
                Ok(role) => role,
                Err((annotation, value)) => {
                    set.warnings.push(PeerConfigWarning::InvalidRrAnnotation { node: name, annotation, value });
                    continue;
                }
            };
            let Some(route_reflector_client) = rr_peering(route_reflector, role) else {
                continue;
            };
            let Some(address) = node_ip(other) else {
                set.warnings.push(PeerConfigWarning::NodeWithoutAddress { node: name });
                continue;
            };
            set.add(
                Source::Mesh(name.clone()),
                PeerConfig {
                    address,
                    asn,
                    password: None,
                    port: settings.peer_port,
                    passive: false,
                    route_reflector_client,
                    kind: PeerKind::Node { name },
                },
            );
        }
    }

    for flag in &settings.external_peers {
        set.add(Source::Flag, flag.peer_config(settings.peer_port));
    }

    match node_annotation_peers(me) {
        Ok(parsed) => {
            for p in parsed {
                let port = p.port.unwrap_or(settings.peer_port);
                set.add(Source::Annotation(my_name.to_string()), external_peer(p.address, p.asn, p.password, port));
            }
        }
        Err(e) => set
            .warnings
            .push(PeerConfigWarning::InvalidPeerAnnotations { node: my_name.to_string(), reason: e.to_string() }),
    }

    let peers = set.peers.into_values().map(|(_, p)| p).collect();
    Ok(NodeBgpConfig { router_id, local_asn, local_address, pod_cidrs, peers, route_reflector, warnings })
}

fn external_peer(address: IpAddr, asn: u32, password: Option<String>, port: u16) -> PeerConfig {
    PeerConfig { address, asn, password, port, passive: false, route_reflector_client: false, kind: PeerKind::External }
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

/// Parses this node's `kube-router.io/peer.*` annotations.
fn node_annotation_peers(node: &Node) -> Result<Vec<ParsedPeer>, PeerConfigError> {
    let list = |key| -> Vec<&str> {
        match annotation(node, key).map(str::trim) {
            Some(v) if !v.is_empty() => v.split(',').collect(),
            _ => Vec::new(),
        }
    };
    parse_peer_lists(
        &ANNOTATION_FIELDS,
        &list(PEER_IPS_ANNOTATION),
        &list(PEER_ASNS_ANNOTATION),
        &list(PEER_PASSWORDS_ANNOTATION),
        &list(PEER_PORTS_ANNOTATION),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{NodeAddress, NodeSpec, NodeStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

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
                },
                PeerConfig {
                    address: ip("10.0.0.3"),
                    asn: 64512,
                    password: None,
                    port: 179,
                    passive: false,
                    route_reflector_client: false,
                    kind: PeerKind::Node { name: "node-3".into() },
                },
            ]
        );
    }

    #[test]
    fn mesh_disabled_yields_no_node_peers() {
        let s = GlobalSettings { enable_ibgp_mesh: false, ..settings("node-1") };
        let cfg = node_bgp_config(&three_nodes(), &s).unwrap();
        assert!(cfg.peers.is_empty());
    }

    #[test]
    fn advertise_pod_cidr_disabled() {
        let s = GlobalSettings { advertise_pod_cidr: false, ..settings("node-1") };
        assert!(node_bgp_config(&three_nodes(), &s).unwrap().pod_cidrs.is_empty());
    }

    #[test]
    fn per_node_asn_same_and_different() {
        let nodes = vec![
            node("node-1", "10.0.0.1", &[(NODE_ASN_ANNOTATION, "65001")], None),
            node("node-2", "10.0.0.2", &[(NODE_ASN_ANNOTATION, "65001")], None),
            node("node-3", "10.0.0.3", &[(NODE_ASN_ANNOTATION, "65002")], None),
            node("node-4", "10.0.0.4", &[], None), // cluster ASN 64512
        ];
        let cfg = node_bgp_config(&nodes, &settings("node-1")).unwrap();
        assert_eq!(cfg.local_asn, 65001);
        assert_eq!(addrs(&cfg), vec![ip("10.0.0.2")]);
        assert_eq!(peer(&cfg, "10.0.0.2").asn, 65001);
        assert!(cfg.warnings.is_empty(), "different ASNs are skipped silently: {:?}", cfg.warnings);

        // From node-4's view (cluster ASN) only unannotated nodes match: none.
        let cfg = node_bgp_config(&nodes, &settings("node-4")).unwrap();
        assert_eq!(cfg.local_asn, 64512);
        assert!(cfg.peers.is_empty());
    }

    #[test]
    fn invalid_asn_on_other_node_is_a_warning() {
        let mut nodes = three_nodes();
        nodes.push(node("node-4", "10.0.0.4", &[(NODE_ASN_ANNOTATION, "not-a-number")], None));
        nodes.push(node("node-5", "10.0.0.5", &[(NODE_ASN_ANNOTATION, "0")], None));
        let cfg = node_bgp_config(&nodes, &settings("node-1")).unwrap();
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
        let err = node_bgp_config(&nodes, &settings("node-1")).unwrap_err();
        assert_eq!(err, PeerConfigError::InvalidLocalAsn { node: "node-1".into(), value: "4294967295".into() });
        assert!(err.to_string().contains("node-1"));
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
        s.external_peers = vec![ExternalPeerFlag { address: ip("172.16.0.1"), asn: 65100, password: None }];
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
        s.external_peers = vec![ExternalPeerFlag { address: ip("203.0.113.1"), asn: 65000, password: None }];
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
    fn deterministic_sorted_output() {
        let mut s = settings("node-1");
        s.external_peers = vec![
            ExternalPeerFlag { address: ip("2001:db8::5"), asn: 65000, password: None },
            ExternalPeerFlag { address: ip("1.1.1.1"), asn: 65000, password: None },
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
        assert_eq!(parse_external_peer_flags(&[], &[], &[]).unwrap(), vec![]);
        let peers =
            parse_external_peer_flags(&v(&["192.0.2.1", "2001:db8::1"]), &v(&["65000", "4200000000"]), &[]).unwrap();
        assert_eq!(peers.len(), 2);
        assert_eq!(peers[1].asn, 4_200_000_000);
        assert!(peers.iter().all(|p| p.password.is_none()));

        let err = parse_external_peer_flags(&v(&["192.0.2.1"]), &[], &[]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "--peer-router-asns has 0 entries but --peer-router-ips has 1; they must have the same length"
        );
        let err = parse_external_peer_flags(&v(&["192.0.2.1"]), &v(&["1"]), &v(&["a", "b"])).unwrap_err();
        assert!(matches!(err, PeerConfigError::LengthMismatch { field: PEER_PASSWORDS_FLAG, .. }));
        let err = parse_external_peer_flags(&v(&["192.0.2.300"]), &v(&["1"]), &[]).unwrap_err();
        assert!(err.to_string().contains("192.0.2.300"));
        let err = parse_external_peer_flags(&v(&["192.0.2.1"]), &v(&["0"]), &[]).unwrap_err();
        assert!(matches!(err, PeerConfigError::InvalidValue { field: PEER_ASNS_FLAG, index: 0, .. }));
        let err = parse_external_peer_flags(&v(&["192.0.2.1"]), &v(&["1"]), &v(&["!!"])).unwrap_err();
        assert!(err.to_string().contains("base64") && !err.to_string().contains("!!"), "{err}");
        let ok = parse_external_peer_flags(&v(&["192.0.2.1"]), &v(&["1"]), &[b64(&"p".repeat(80))]).unwrap();
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
