//! The current inputs, indexed, plus the pure functions that derive one
//! compiled entry from them. Both the from-scratch compile and the
//! incremental compiler use these, so they cannot disagree on semantics;
//! they differ only in *which* entries they recompute.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use super::error::PolicyError;
use super::model::{
    Direction, Isolation, NamedPortFilter, NamespaceScope, PeerSet, PodRef, PodRules, PodSetKey, PortRange, Ports,
    Protocol, Rule,
};
use super::parse::{implicit_namespace_labels, PeerSpec, PodInfo, PortSpec, ValidatedPolicy, ValidatedRule};
use super::selector::{Labels, Selector};

#[derive(Debug, Clone, Default)]
pub(crate) struct Inputs {
    pods: BTreeMap<PodRef, PodInfo>,
    /// How many pods each namespace has (its pods are a range of `pods`, ordered by namespace).
    pods_per_namespace: BTreeMap<Arc<str>, usize>,
    /// Every pod claiming an IP. The smallest PodRef owns it, so conflicting
    /// claims (stale objects, misbehaving IPAM) resolve deterministically.
    ip_claims: BTreeMap<IpAddr, Claims>,
    /// Effective labels (including the metadata.name label).
    namespaces: BTreeMap<String, Labels>,
    /// namespace -> name -> policy.
    policies: BTreeMap<String, BTreeMap<String, ValidatedPolicy>>,
    policy_errors: BTreeMap<(String, String), PolicyError>,
    /// Only the IPs of this node's pods get compiled entries: the agent programs no other
    /// pod's rules, and 150,000 pods' rules (and the pod sets only they name) were most of the
    /// compiler's memory. `None`: every pod's (tests, tools).
    scope: Option<Arc<str>>,
    /// The pods on the scope's node (every pod's IPs are compiled without a scope).
    local_pods: BTreeSet<PodRef>,
}

impl Inputs {
    // ---- mutation -------------------------------------------------------

    pub fn insert_pod(&mut self, info: PodInfo) {
        for ip in info.ips() {
            match self.ip_claims.get_mut(ip) {
                Some(claims) => claims.insert(&info),
                None => {
                    self.ip_claims.insert(*ip, Claims::One(info.clone()));
                }
            }
        }
        // Callers remove a pod before inserting it again: a new key is a new pod.
        let pod = info.pod();
        if self.scope.as_deref().is_some_and(|node| info.node() == Some(node)) {
            self.local_pods.insert(pod.clone());
        }
        let namespace = pod.namespace.clone();
        if self.pods.insert(pod, info).is_none() {
            *self.pods_per_namespace.entry(namespace).or_default() += 1;
        }
    }

    /// The per-pod indexes rebuilt with full B-tree nodes, same contents. Filled one pod at a
    /// time in key order (a listing's), a B-tree's nodes split about half full: at 150,000
    /// pods that was some 12 MiB of the two indexes (issue 29, heap profile).
    pub fn pack(&mut self) {
        self.pods = std::mem::take(&mut self.pods).into_iter().collect();
        self.ip_claims = std::mem::take(&mut self.ip_claims).into_iter().collect();
    }

    pub fn remove_pod(&mut self, pod: &PodRef) -> Option<PodInfo> {
        let info = self.pods.remove(pod)?;
        self.local_pods.remove(pod);
        for ip in info.ips() {
            let Some(claims) = self.ip_claims.get_mut(ip) else { continue };
            match claims.remove(pod) {
                Left::Nothing => {
                    self.ip_claims.remove(ip);
                }
                Left::One(last) => match self.pods.get(&last) {
                    Some(last) => *claims = Claims::One(last.clone()),
                    None => debug_assert!(false, "a claim of {last} without its pod"),
                },
                Left::Others => {}
            }
        }
        if let Some(count) = self.pods_per_namespace.get_mut(&pod.namespace) {
            *count -= 1;
            if *count == 0 {
                self.pods_per_namespace.remove(&pod.namespace);
            }
        }
        Some(info)
    }

    /// Compiles entries only for the IPs of pods on `node` (`None`: every pod).
    pub fn set_scope(&mut self, node: Option<&str>) {
        self.scope = node.map(Arc::from);
        self.local_pods = match node {
            Some(node) => self.pods.values().filter(|info| info.node() == Some(node)).map(PodInfo::pod).collect(),
            None => BTreeSet::new(),
        };
    }

    /// Whether `ip`'s entry is compiled: some pod on the scope's node claims it. (Not only its
    /// owner: a local pod whose IP a remote pod also claims gets the owner's rules, as without
    /// a scope.)
    fn in_scope(&self, ip: IpAddr) -> bool {
        let Some(node) = self.scope.as_deref() else { return true };
        self.ip_claims.get(&ip).is_some_and(|claims| claims.pods(&self.pods).any(|info| info.node() == Some(node)))
    }

    pub fn set_namespace(&mut self, name: String, labels: Labels) {
        self.namespaces.insert(name, labels);
    }

    pub fn remove_namespace(&mut self, name: &str) {
        self.namespaces.remove(name);
    }

    /// Stores a policy (or its error), replacing any previous version.
    pub fn set_policy(&mut self, namespace: &str, name: &str, policy: Result<ValidatedPolicy, PolicyError>) {
        self.remove_policy(namespace, name);
        match policy {
            Ok(policy) => {
                self.policies.entry(namespace.to_string()).or_default().insert(name.to_string(), policy);
            }
            Err(error) => {
                self.policy_errors.insert((namespace.to_string(), name.to_string()), error);
            }
        }
    }

    pub fn remove_policy(&mut self, namespace: &str, name: &str) -> Option<ValidatedPolicy> {
        self.policy_errors.remove(&(namespace.to_string(), name.to_string()));
        let in_namespace = self.policies.get_mut(namespace)?;
        let removed = in_namespace.remove(name);
        if in_namespace.is_empty() {
            self.policies.remove(namespace);
        }
        removed
    }

    // ---- queries --------------------------------------------------------

    pub fn pod(&self, pod: &PodRef) -> Option<&PodInfo> {
        self.pods.get(pod)
    }

    pub fn policy(&self, namespace: &str, name: &str) -> Option<&ValidatedPolicy> {
        self.policies.get(namespace)?.get(name)
    }

    pub fn policy_count(&self) -> usize {
        self.policies.values().map(BTreeMap::len).sum::<usize>() + self.policy_errors.len()
    }

    pub fn policy_errors(&self) -> impl Iterator<Item = &PolicyError> {
        self.policy_errors.values()
    }

    /// IPs that currently have an owner pod.
    pub fn pod_ips(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.ip_claims.keys().copied()
    }

    pub fn is_contested(&self, ip: IpAddr) -> bool {
        matches!(self.ip_claims.get(&ip), Some(Claims::Contested(_)))
    }

    pub fn owner(&self, ip: IpAddr) -> Option<&PodInfo> {
        self.ip_claims.get(&ip)?.owner(&self.pods)
    }

    /// IPs owned by pods of `namespace`.
    pub fn ips_in_namespace(&self, namespace: &str) -> BTreeSet<IpAddr> {
        self.pods_of(namespace).flat_map(|info| info.ips().iter().copied()).collect()
    }

    fn namespace_matches(&self, selector: &Selector, namespace: &str) -> bool {
        match self.namespaces.get(namespace) {
            Some(labels) => selector.matches(labels),
            None => selector.matches(&implicit_namespace_labels(namespace)),
        }
    }

    /// Whether the pod owning `ip` belongs to the set `key`.
    pub fn pod_set_contains(&self, key: &PodSetKey, ip: IpAddr) -> bool {
        let Some(pod) = self.owner(ip) else {
            return false;
        };
        let in_scope = match &key.namespaces {
            NamespaceScope::Named(ns) => **ns == *pod.namespace(),
            NamespaceScope::Selected(sel) => self.namespace_matches(sel, pod.namespace()),
        };
        in_scope
            && key.pods.matches(pod.labels())
            && key.within.as_ref().is_none_or(|block| block.contains(ip))
            && key
                .named_port
                .as_ref()
                .is_none_or(|filter| pod.resolve_named_port(&filter.name, filter.protocol).any(|n| n == filter.port))
    }

    /// The pods of `namespace`: a range of `pods`, which is ordered by namespace first.
    fn pods_of<'a>(&'a self, namespace: &str) -> impl Iterator<Item = &'a PodInfo> + 'a {
        let first = PodRef { namespace: Arc::from(namespace), name: Arc::from("") };
        let namespace = first.namespace.clone();
        self.pods.range(first..).take_while(move |(pod, _)| pod.namespace == namespace).map(|(_, info)| info)
    }

    /// Whether `pod` owns `ip` (the smallest of the pods claiming it).
    fn owns(&self, pod: &PodInfo, ip: IpAddr) -> bool {
        self.owner(ip).is_some_and(|owner| owner.same_pod(pod))
    }

    /// Every IP in the set `key`: only the pods of the namespaces in its scope are looked at
    /// (one namespace, or those whose labels match, each judged once), so resolving all sets
    /// of a cluster is not (sets x pods). Same members as testing every pod IP with
    /// [`Self::pod_set_contains`].
    pub fn pod_set_members(&self, key: &PodSetKey) -> BTreeSet<IpAddr> {
        let in_scope: Vec<&str> = match &key.namespaces {
            NamespaceScope::Named(ns) => vec![ns.as_str()],
            NamespaceScope::Selected(sel) => {
                self.pods_per_namespace.keys().filter(|ns| self.namespace_matches(sel, ns)).map(|ns| &**ns).collect()
            }
        };
        let mut members = BTreeSet::new();
        for pod in in_scope.into_iter().flat_map(|ns| self.pods_of(ns)) {
            // Labels and named port are the pod's; ipBlock and ownership each IP's (an IP two
            // pods claim belongs to its owner only).
            if !key.pods.matches(pod.labels())
                || !key.named_port.as_ref().is_none_or(|filter| {
                    pod.resolve_named_port(&filter.name, filter.protocol).any(|n| n == filter.port)
                })
            {
                continue;
            }
            for ip in pod.ips() {
                if key.within.as_ref().is_none_or(|block| block.contains(*ip)) && self.owns(pod, *ip) {
                    members.insert(*ip);
                }
            }
        }
        members
    }

    /// IPs of the pods a policy selects (its targets).
    pub fn policy_targets(&self, policy: &ValidatedPolicy) -> BTreeSet<IpAddr> {
        self.pods_of(&policy.namespace)
            .filter(|info| policy.pod_selector.matches(info.labels()))
            .flat_map(|info| info.ips().iter().copied())
            .collect()
    }

    /// Targets of every policy whose egress uses named ports: their rules
    /// depend on the ports of other pods.
    ///
    /// With a scope, only those whose entries are compiled (IPs claimed by this node's pods):
    /// every target in the cluster, walked on each change of a pod with named ports, was a
    /// tenth of the agent's CPU in a 150,000-pod cluster's churn (issue 29).
    pub fn egress_named_port_targets(&self) -> BTreeSet<IpAddr> {
        if self.scope.is_some() {
            let targeted = |info: &PodInfo| {
                self.policies
                    .get(info.namespace())
                    .into_iter()
                    .flat_map(|by_name| by_name.values())
                    .any(|p| p.has_egress_named_ports() && p.pod_selector.matches(info.labels()))
            };
            // An IP is a target when any pod claiming it is, as below.
            let claimant_targeted =
                |ip: &IpAddr| self.ip_claims.get(ip).is_some_and(|claims| claims.pods(&self.pods).any(targeted));
            return self
                .local_pods
                .iter()
                .filter_map(|pod| self.pods.get(pod))
                .flat_map(|info| info.ips().iter().copied())
                .filter(claimant_targeted)
                .collect();
        }
        self.policies
            .values()
            .flat_map(|by_name| by_name.values())
            .filter(|p| p.has_egress_named_ports())
            .flat_map(|p| self.policy_targets(p))
            .collect()
    }

    /// Compiles the entry of one IP; `None` if no pod owns it or it is outside the scope.
    pub fn compute_pod(&self, ip: IpAddr) -> Option<PodRules> {
        let pod = self.owner(ip)?;
        if !self.in_scope(ip) {
            return None;
        }
        let selecting: Vec<&ValidatedPolicy> = self
            .policies
            .get(pod.namespace())
            .into_iter()
            .flat_map(|by_name| by_name.values())
            .filter(|p| p.pod_selector.matches(pod.labels()))
            .collect();
        let ingress = self.compute_isolation(pod, &selecting, Direction::Ingress);
        let egress = self.compute_isolation(pod, &selecting, Direction::Egress);
        Some(PodRules { pod: pod.pod(), ingress, egress })
    }

    fn compute_isolation(&self, pod: &PodInfo, selecting: &[&ValidatedPolicy], direction: Direction) -> Isolation {
        let mut isolated = false;
        let mut rules = Vec::new();
        for policy in selecting {
            if let Some(policy_rules) = policy.rules(direction) {
                isolated = true;
                for rule in policy_rules {
                    self.expand_rule(pod, rule, direction, &mut rules);
                }
            }
        }
        if !isolated {
            return Isolation::NotIsolated;
        }
        rules.sort();
        rules.dedup();
        Isolation::Isolated(rules)
    }

    /// One k8s rule becomes one compiled rule per peer (peers x ports), with
    /// named ports resolved to numbers.
    fn expand_rule(&self, target: &PodInfo, rule: &ValidatedRule, direction: Direction, out: &mut Vec<Rule>) {
        let peers: Vec<PeerSet> = if rule.peers.is_empty() {
            vec![PeerSet::Any]
        } else {
            rule.peers
                .iter()
                .map(|peer| match peer {
                    PeerSpec::Pods(key) => PeerSet::Pods(key.clone()),
                    PeerSpec::Block(block) => PeerSet::Cidr { cidr: block.cidr, except: block.except.clone() },
                })
                .collect()
        };
        let Some(port_specs) = &rule.ports else {
            out.extend(peers.into_iter().map(|peers| Rule { peers, ports: Ports::All }));
            return;
        };
        let mut ranges: Vec<PortRange> = Vec::new();
        let mut named: Vec<(Protocol, &str)> = Vec::new();
        for spec in port_specs {
            match spec {
                PortSpec::Numbered(range) => ranges.push(*range),
                PortSpec::Named { protocol, name } => named.push((*protocol, name)),
            }
        }
        match direction {
            // Ingress: the destination is the target pod itself.
            Direction::Ingress => {
                for (protocol, name) in named {
                    ranges.extend(target.resolve_named_port(name, protocol).map(|n| PortRange::single(protocol, n)));
                }
                push_ranges(out, peers, ranges);
            }
            // Egress: the destination is the peer; resolve against each one.
            Direction::Egress => {
                if named.is_empty() {
                    return push_ranges(out, peers, ranges);
                }
                push_ranges(out, peers.clone(), ranges);
                for (protocol, name) in named {
                    for peer in &peers {
                        self.expand_egress_named_port(peer, protocol, name, out);
                    }
                }
            }
        }
    }

    /// Splits the peer's pods by what `name` resolves to on each, giving one
    /// rule per distinct port number. Non-pod destinations cannot match a
    /// named port, so ipBlock/any peers are narrowed to the pods inside them.
    fn expand_egress_named_port(&self, peer: &PeerSet, protocol: Protocol, name: &str, out: &mut Vec<Rule>) {
        let base = match peer {
            PeerSet::Any => PodSetKey::all_pods(),
            PeerSet::Pods(key) => key.clone(),
            PeerSet::Cidr { cidr, except } => PodSetKey {
                within: Some(super::model::CidrBlock { cidr: *cidr, except: except.clone() }),
                ..PodSetKey::all_pods()
            },
        };
        let numbers: BTreeSet<u16> = self
            .pod_ips()
            .filter(|ip| self.pod_set_contains(&base, *ip))
            .filter_map(|ip| self.owner(ip))
            .flat_map(|pod| pod.resolve_named_port(name, protocol))
            .collect();
        for port in numbers {
            out.push(Rule {
                peers: PeerSet::Pods(PodSetKey {
                    named_port: Some(NamedPortFilter { protocol, name: name.to_string(), port }),
                    ..base.clone()
                }),
                ports: Ports::Ranges(vec![PortRange::single(protocol, port)]),
            });
        }
    }
}

fn push_ranges(out: &mut Vec<Rule>, peers: Vec<PeerSet>, mut ranges: Vec<PortRange>) {
    // A rule whose ports all failed to resolve allows nothing: drop it
    // rather than emitting an empty list that could be misread as "all".
    if ranges.is_empty() {
        return;
    }
    ranges.sort();
    ranges.dedup();
    out.extend(peers.into_iter().map(|peers| Rule { peers, ports: Ports::Ranges(ranges.clone()) }));
}

/// The pods claiming one IP: almost always one, kept as its [`PodInfo`] (a pointer, 150,000
/// times; the owner's lookups need no second search), several by name.
#[derive(Debug, Clone)]
enum Claims {
    One(PodInfo),
    /// Two or more, the smallest first: the owner. Boxed: a set inline made every claim 32
    /// bytes, not 16.
    #[allow(clippy::box_collection)]
    Contested(Box<BTreeSet<PodRef>>),
}

/// What [`Claims::remove`] left.
enum Left {
    Nothing,
    /// One claim left of several: the caller makes it [`Claims::One`] with that pod's info.
    One(PodRef),
    /// Other claims, as they were.
    Others,
}

impl Claims {
    fn owner<'a>(&'a self, pods: &'a BTreeMap<PodRef, PodInfo>) -> Option<&'a PodInfo> {
        match self {
            Claims::One(info) => Some(info),
            Claims::Contested(claims) => pods.get(claims.first().expect("a contested IP has claims")),
        }
    }

    fn insert(&mut self, info: &PodInfo) {
        match self {
            Claims::One(one) if one.same_pod(info) => *one = info.clone(),
            Claims::One(one) => *self = Claims::Contested(Box::new(BTreeSet::from([one.pod(), info.pod()]))),
            Claims::Contested(pods) => {
                pods.insert(info.pod());
            }
        }
    }

    /// Every claiming pod's info.
    fn pods<'a>(&'a self, pods: &'a BTreeMap<PodRef, PodInfo>) -> impl Iterator<Item = &'a PodInfo> + 'a {
        let (one, many) = match self {
            Claims::One(info) => (Some(info), None),
            Claims::Contested(claims) => (None, Some(claims.iter().filter_map(|pod| pods.get(pod)))),
        };
        one.into_iter().chain(many.into_iter().flatten())
    }

    /// Takes `pod`'s claim away.
    fn remove(&mut self, pod: &PodRef) -> Left {
        match self {
            Claims::One(one) if one.is(pod) => Left::Nothing,
            Claims::One(_) => Left::Others,
            Claims::Contested(pods) => {
                pods.remove(pod);
                match pods.len() {
                    0 => Left::Nothing,
                    1 => Left::One(pods.first().expect("one left").clone()),
                    _ => Left::Others,
                }
            }
        }
    }
}
