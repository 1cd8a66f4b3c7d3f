//! Output types of the compiler: the per-pod, per-direction rule model.
//!
//! The shapes are chosen to map onto BPF maps: pods are keyed by IP, rules
//! reference selector-based peer sets by [`PodSetKey`] (a shared table in
//! [`CompiledModel::pod_sets`]) so a pod label change only edits set
//! membership, not the rule lists of every pod that talks to it.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;

use super::selector::Selector;

/// Traffic direction relative to the pod a rule list belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Direction {
    Ingress,
    Egress,
}

impl Direction {
    pub const ALL: [Direction; 2] = [Direction::Ingress, Direction::Egress];
}

/// L4 protocols NetworkPolicy can name (the API layer's: a Pod's container ports name them too).
pub use crate::k8s::labels::Protocol;

/// Inclusive destination-port range for one protocol. `0..=65535` means
/// "every port of this protocol" (a `ports` entry with only `protocol`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PortRange {
    pub protocol: Protocol,
    pub start: u16,
    pub end: u16,
}

impl PortRange {
    pub fn single(protocol: Protocol, port: u16) -> PortRange {
        PortRange { protocol, start: port, end: port }
    }

    pub fn all_of(protocol: Protocol) -> PortRange {
        PortRange { protocol, start: 0, end: u16::MAX }
    }

    pub fn contains(&self, protocol: Protocol, port: u16) -> bool {
        self.protocol == protocol && self.start <= port && port <= self.end
    }
}

/// Destination ports a rule allows.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Ports {
    /// The rule had no `ports`: every protocol and port (ICMP included).
    All,
    /// Only these ranges. Never empty in a compiled model: a rule whose named
    /// ports resolved to nothing is dropped instead (it allows nothing).
    Ranges(Vec<PortRange>),
}

impl Ports {
    pub fn allows(&self, protocol: Protocol, port: u16) -> bool {
        match self {
            Ports::All => true,
            Ports::Ranges(ranges) => ranges.iter().any(|r| r.contains(protocol, port)),
        }
    }
}

/// An ipBlock: `cidr` minus every `except` prefix (each strictly inside `cidr`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CidrBlock {
    pub cidr: IpNet,
    pub except: Vec<IpNet>,
}

impl CidrBlock {
    pub fn contains(&self, ip: IpAddr) -> bool {
        cidr_contains(&self.cidr, &self.except, ip)
    }
}

pub(crate) fn cidr_contains(cidr: &IpNet, except: &[IpNet], ip: IpAddr) -> bool {
    cidr.contains(&ip) && !except.iter().any(|e| e.contains(&ip))
}

/// Which namespaces a pod set draws its pods from.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum NamespaceScope {
    /// Exactly this namespace (a peer with only `podSelector`: the policy's own).
    Named(String),
    /// Namespaces whose labels match (an empty selector matches all).
    Selected(Selector),
}

/// Restricts a pod set to pods whose container port `name`/`protocol` is
/// `port`; used to turn an egress named port into concrete per-destination rules.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NamedPortFilter {
    pub protocol: Protocol,
    pub name: String,
    pub port: u16,
}

/// Definition of a selector-based peer set. Its current members (pod IPs)
/// live in [`CompiledModel::pod_sets`]; identical definitions share one entry.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PodSetKey {
    pub namespaces: NamespaceScope,
    /// Pod label selector; empty selects every pod in scope.
    pub pods: Selector,
    /// Only pods whose IP falls in this block (egress named port to an ipBlock).
    pub within: Option<CidrBlock>,
    /// Only pods exposing this named port as this number.
    pub named_port: Option<NamedPortFilter>,
}

impl PodSetKey {
    /// Every pod of every namespace.
    pub fn all_pods() -> PodSetKey {
        PodSetKey {
            namespaces: NamespaceScope::Selected(Selector::everything()),
            pods: Selector::everything(),
            within: None,
            named_port: None,
        }
    }
}

/// The peers (remote ends) a rule allows.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PeerSet {
    /// Empty or missing `from`/`to`: any address, in or outside the cluster.
    Any,
    /// Pod IPs of a selector-based set, resolved through [`CompiledModel::pod_sets`].
    Pods(PodSetKey),
    /// An ipBlock.
    Cidr { cidr: IpNet, except: Vec<IpNet> },
}

/// One allowed (peers x ports) combination.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Rule {
    pub peers: PeerSet,
    pub ports: Ports,
}

/// Whether a pod is isolated for one direction, and if so what is allowed.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Isolation {
    /// No policy with this policyType selects the pod: everything is allowed.
    NotIsolated,
    /// Only traffic matching one of the rules is allowed (empty = deny all).
    /// Rules are sorted and deduplicated so equal inputs give equal output.
    Isolated(Vec<Rule>),
}

impl Isolation {
    pub fn rules(&self) -> &[Rule] {
        match self {
            Isolation::NotIsolated => &[],
            Isolation::Isolated(rules) => rules,
        }
    }
}

/// Identity of the pod a compiled entry came from (for logs and errors). The strings are the
/// store's own, shared.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PodRef {
    pub namespace: Arc<str>,
    pub name: Arc<str>,
}

impl fmt::Display for PodRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Compiled policy of one pod IP.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PodRules {
    pub pod: PodRef,
    pub ingress: Isolation,
    pub egress: Isolation,
}

impl PodRules {
    pub fn direction(&self, direction: Direction) -> &Isolation {
        match direction {
            Direction::Ingress => &self.ingress,
            Direction::Egress => &self.egress,
        }
    }

    /// Pod sets referenced by any rule of this pod.
    pub fn referenced_pod_sets(&self) -> impl Iterator<Item = &PodSetKey> {
        self.ingress.rules().iter().chain(self.egress.rules()).filter_map(|rule| match &rule.peers {
            PeerSet::Pods(key) => Some(key),
            _ => None,
        })
    }
}

/// The whole compiled state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CompiledModel {
    /// Every cluster pod IP known to the compiler (isolated or not). An IP that
    /// is absent is treated as outside the cluster.
    pub pods: BTreeMap<IpAddr, PodRules>,
    /// Members of every pod set referenced by some rule (possibly empty).
    pub pod_sets: BTreeMap<PodSetKey, BTreeSet<IpAddr>>,
}

impl CompiledModel {
    /// Whether `ip` belongs to `peers`.
    pub fn peer_matches(&self, peers: &PeerSet, ip: IpAddr) -> bool {
        match peers {
            PeerSet::Any => true,
            PeerSet::Pods(key) => self.pod_sets.get(key).is_some_and(|members| members.contains(&ip)),
            PeerSet::Cidr { cidr, except } => cidr_contains(cidr, except, ip),
        }
    }
}
