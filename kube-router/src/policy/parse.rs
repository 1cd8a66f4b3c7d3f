//! Turns Kubernetes objects into validated internal inputs.

use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use k8s_openapi::api::networking::v1::{IPBlock, NetworkPolicy, NetworkPolicyPeer, NetworkPolicyPort};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::error::{PolicyError, PolicyErrorKind};
use super::model::{CidrBlock, Direction, NamespaceScope, PodRef, PodSetKey, PortRange, Protocol};
use super::selector::{Labels, Selector};
use crate::k8s::{
    namespace::AsSlimNamespace,
    pod::{AsSlimPod, SlimPod},
};

/// Label the API server puts on every namespace; synthesised so selectors on
/// it work even before (or without) the Namespace object being known.
pub const NAMESPACE_NAME_LABEL: &str = "kubernetes.io/metadata.name";

/// The parts of a Pod the compiler needs: the store's own [`SlimPod`], shared, not a copy. Its
/// names are the object's ([`Self::pod`]): a copy of them beside it was 32 bytes a pod in each of
/// the compiler's two indexes (issue 29).
#[derive(Debug, Clone)]
pub(crate) struct PodInfo {
    object: Arc<SlimPod>,
}

/// Equal when the compiler would read the same: names, node, addresses, labels, named ports.
impl PartialEq for PodInfo {
    fn eq(&self, other: &Self) -> bool {
        self.is(&other.pod())
            && self.object.node_name == other.object.node_name
            && self.object.ips == other.object.ips
            && self.object.labels == other.object.labels
            && self.object.named_ports == other.object.named_ports
    }
}

impl Eq for PodInfo {}

impl PodInfo {
    /// `None` when the pod takes no part in policy: no parsable IP yet,
    /// terminal phase (its IP may already be reused), or host network (its IP
    /// is the node's and shared; policy does not apply to such pods).
    pub fn from_pod(pod: &impl AsSlimPod) -> Option<PodInfo> {
        let object = pod.slim_pod();
        if object.is_terminal() || object.host_network || object.ips.is_empty() {
            return None;
        }
        Some(PodInfo { object })
    }

    /// Namespace and name (the namespace `default` when the object has none).
    pub fn pod(&self) -> PodRef {
        pod_ref(&self.object)
    }

    /// The pod's namespace, as [`Self::pod`] names it.
    pub fn namespace(&self) -> &str {
        namespace_of(&self.object)
    }

    /// Whether both are the same pod (by name; not necessarily the same object).
    pub fn same_pod(&self, other: &PodInfo) -> bool {
        self.object.name == other.object.name && self.namespace() == other.namespace()
    }

    /// Whether this is the pod `pod` names.
    pub fn is(&self, pod: &PodRef) -> bool {
        *self.object.name == *pod.name && self.namespace() == &*pod.namespace
    }

    /// Whether both hold the one shared object (not merely equal ones).
    pub fn same_object(&self, other: &PodInfo) -> bool {
        Arc::ptr_eq(&self.object, &other.object)
    }

    /// The pod's addresses, sorted, each once.
    pub fn ips(&self) -> &[IpAddr] {
        &self.object.ips
    }

    pub fn labels(&self) -> &Labels {
        &self.object.labels
    }

    /// The node the pod runs on.
    pub fn node(&self) -> Option<&str> {
        self.object.node_name.as_deref()
    }

    /// Port numbers the named port resolves to for `protocol` on this pod.
    pub fn resolve_named_port<'a>(&'a self, name: &'a str, protocol: Protocol) -> impl Iterator<Item = u16> + 'a {
        self.object.named_ports.iter().filter(move |p| *p.name == *name && p.protocol == protocol).map(|p| p.port)
    }

    pub fn has_named_ports(&self) -> bool {
        !self.object.named_ports.is_empty()
    }
}

/// Namespace/name of a pod; missing namespace means `default`, as kubectl does.
pub(crate) fn pod_ref(pod: &SlimPod) -> PodRef {
    let namespace = if pod.namespace.is_empty() { Arc::from(DEFAULT_NAMESPACE) } else { pod.namespace.clone() };
    PodRef { namespace, name: pod.name.clone() }
}

const DEFAULT_NAMESPACE: &str = "default";

fn namespace_of(pod: &SlimPod) -> &str {
    if pod.namespace.is_empty() {
        DEFAULT_NAMESPACE
    } else {
        &pod.namespace
    }
}

/// Name and effective labels of a namespace, or `None` without a name.
pub(crate) fn namespace_labels(namespace: &impl AsSlimNamespace) -> Option<(String, Labels)> {
    let namespace = namespace.slim_namespace();
    if namespace.name.is_empty() {
        return None;
    }
    let name = namespace.name.to_string();
    let labels = namespace.labels.iter().chain([(NAMESPACE_NAME_LABEL, name.as_str())]).collect();
    Some((name, labels))
}

/// Labels assumed for a namespace whose object is not (yet) known.
pub(crate) fn implicit_namespace_labels(name: &str) -> Labels {
    Labels::from([(NAMESPACE_NAME_LABEL, name)])
}

/// A destination port spec of a rule, before named-port resolution.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PortSpec {
    Numbered(PortRange),
    Named { protocol: Protocol, name: String },
}

/// One peer of a rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PeerSpec {
    /// Selector peer; the key has neither `within` nor `named_port`.
    Pods(PodSetKey),
    Block(CidrBlock),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ValidatedRule {
    /// Empty means any peer (missing or empty `from`/`to`).
    pub peers: Vec<PeerSpec>,
    /// `None` means all ports (missing or empty `ports`).
    pub ports: Option<Vec<PortSpec>>,
}

/// A NetworkPolicy that passed validation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ValidatedPolicy {
    pub namespace: String,
    pub name: String,
    pub pod_selector: Selector,
    /// `Some` iff the policy has the Ingress policyType (rules may be empty:
    /// default deny).
    pub ingress: Option<Vec<ValidatedRule>>,
    pub egress: Option<Vec<ValidatedRule>>,
}

impl ValidatedPolicy {
    pub fn rules(&self, direction: Direction) -> Option<&[ValidatedRule]> {
        match direction {
            Direction::Ingress => self.ingress.as_deref(),
            Direction::Egress => self.egress.as_deref(),
        }
    }

    /// Egress named ports make a target's rules depend on other pods' ports.
    pub fn has_egress_named_ports(&self) -> bool {
        self.egress
            .iter()
            .flatten()
            .any(|rule| rule.ports.iter().flatten().any(|p| matches!(p, PortSpec::Named { .. })))
    }

    pub fn from_k8s(policy: &NetworkPolicy) -> Result<ValidatedPolicy, PolicyError> {
        let namespace = policy.metadata.namespace.clone();
        let name = policy.metadata.name.clone();
        let fail = |kind| PolicyError {
            namespace: namespace.clone().unwrap_or_default(),
            name: name.clone().unwrap_or_default(),
            kind,
        };
        let Some(ns) = namespace.clone() else {
            return Err(fail(PolicyErrorKind::MissingMetadata { field: "namespace" }));
        };
        let Some(policy_name) = name.clone() else {
            return Err(fail(PolicyErrorKind::MissingMetadata { field: "name" }));
        };
        let spec = policy.spec.clone().unwrap_or_default();
        let pod_selector = parse_selector(spec.pod_selector.as_ref(), "spec.podSelector").map_err(&fail)?;

        let ingress_rules = spec
            .ingress
            .iter()
            .flatten()
            .enumerate()
            .map(|(i, r)| parse_rule(&ns, r.from.as_deref(), r.ports.as_deref(), &format!("spec.ingress[{i}]"), "from"))
            .collect::<Result<Vec<_>, _>>()
            .map_err(&fail)?;
        let egress_rules = spec
            .egress
            .iter()
            .flatten()
            .enumerate()
            .map(|(i, r)| parse_rule(&ns, r.to.as_deref(), r.ports.as_deref(), &format!("spec.egress[{i}]"), "to"))
            .collect::<Result<Vec<_>, _>>()
            .map_err(&fail)?;

        // policyTypes missing/empty: Ingress always, Egress iff egress rules.
        let (has_ingress, has_egress) = match spec.policy_types.as_deref() {
            None | Some([]) => (true, !egress_rules.is_empty()),
            Some(types) => {
                let (mut ingress, mut egress) = (false, false);
                for (i, t) in types.iter().enumerate() {
                    match t.as_str() {
                        "Ingress" => ingress = true,
                        "Egress" => egress = true,
                        other => {
                            return Err(fail(PolicyErrorKind::UnknownPolicyType {
                                field: format!("spec.policyTypes[{i}]"),
                                value: other.to_string(),
                            }))
                        }
                    }
                }
                (ingress, egress)
            }
        };
        Ok(ValidatedPolicy {
            namespace: ns,
            name: policy_name,
            pod_selector,
            ingress: has_ingress.then_some(ingress_rules),
            egress: has_egress.then_some(egress_rules),
        })
    }
}

fn parse_selector(selector: Option<&LabelSelector>, field: &str) -> Result<Selector, PolicyErrorKind> {
    match selector {
        None => Ok(Selector::everything()),
        Some(s) => Selector::from_k8s(s)
            .map_err(|reason| PolicyErrorKind::InvalidSelector { field: field.to_string(), reason }),
    }
}

fn parse_rule(
    policy_namespace: &str,
    peers: Option<&[NetworkPolicyPeer]>,
    ports: Option<&[NetworkPolicyPort]>,
    field: &str,
    peers_field: &str,
) -> Result<ValidatedRule, PolicyErrorKind> {
    let peers = peers
        .unwrap_or_default()
        .iter()
        .enumerate()
        .map(|(i, p)| parse_peer(policy_namespace, p, &format!("{field}.{peers_field}[{i}]")))
        .collect::<Result<Vec<_>, _>>()?;
    let ports = ports
        .unwrap_or_default()
        .iter()
        .enumerate()
        .map(|(i, p)| parse_port(p, &format!("{field}.ports[{i}]")))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(ValidatedRule { peers, ports: (!ports.is_empty()).then_some(ports) })
}

fn parse_peer(policy_namespace: &str, peer: &NetworkPolicyPeer, field: &str) -> Result<PeerSpec, PolicyErrorKind> {
    let has_selector = peer.pod_selector.is_some() || peer.namespace_selector.is_some();
    match (&peer.ip_block, has_selector) {
        (Some(_), true) => Err(PolicyErrorKind::InvalidPeer {
            field: field.to_string(),
            reason: "ipBlock cannot be combined with podSelector or namespaceSelector".into(),
        }),
        (None, false) => Err(PolicyErrorKind::InvalidPeer {
            field: field.to_string(),
            reason: "must set podSelector, namespaceSelector or ipBlock".into(),
        }),
        (Some(block), false) => parse_ip_block(block, &format!("{field}.ipBlock")).map(PeerSpec::Block),
        (None, true) => {
            let pods = parse_selector(peer.pod_selector.as_ref(), &format!("{field}.podSelector"))?;
            let namespaces = match &peer.namespace_selector {
                None => NamespaceScope::Named(policy_namespace.to_string()),
                Some(sel) => {
                    NamespaceScope::Selected(parse_selector(Some(sel), &format!("{field}.namespaceSelector"))?)
                }
            };
            Ok(PeerSpec::Pods(PodSetKey { namespaces, pods, within: None, named_port: None }))
        }
    }
}

fn parse_cidr(value: &str, field: &str) -> Result<IpNet, PolicyErrorKind> {
    value
        .trim()
        .parse::<IpNet>()
        // Host bits are tolerated (the API server warns only) and cleared.
        .map(|net| net.trunc())
        .map_err(|_| PolicyErrorKind::InvalidCidr { field: field.to_string(), value: value.to_string() })
}

fn parse_ip_block(block: &IPBlock, field: &str) -> Result<CidrBlock, PolicyErrorKind> {
    let cidr = parse_cidr(&block.cidr, &format!("{field}.cidr"))?;
    let mut except = Vec::new();
    for (i, raw) in block.except.iter().flatten().enumerate() {
        let field = format!("{field}.except[{i}]");
        let net = parse_cidr(raw, &field)?;
        // Must be a strict subset (same family, longer prefix), as upstream validates.
        if !(cidr.contains(&net) && net.prefix_len() > cidr.prefix_len()) {
            return Err(PolicyErrorKind::ExceptOutsideCidr { field, cidr: block.cidr.clone(), except: raw.clone() });
        }
        except.push(net);
    }
    except.sort();
    except.dedup();
    Ok(CidrBlock { cidr, except })
}

fn port_number(value: i32, field: &str) -> Result<u16, PolicyErrorKind> {
    u16::try_from(value)
        .ok()
        .filter(|p| *p != 0)
        .ok_or(PolicyErrorKind::PortOutOfRange { field: field.to_string(), value: i64::from(value) })
}

/// IANA_SVC_NAME, the syntax Kubernetes requires of port names.
fn is_valid_port_name(name: &str) -> bool {
    let bytes = name.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 15
        && bytes.iter().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
        && bytes.iter().any(|b| b.is_ascii_lowercase())
        && !name.starts_with('-')
        && !name.ends_with('-')
        && !name.contains("--")
}

fn parse_port(port: &NetworkPolicyPort, field: &str) -> Result<PortSpec, PolicyErrorKind> {
    let protocol = match port.protocol.as_deref() {
        None => Protocol::Tcp,
        Some(value) => Protocol::from_k8s(value).ok_or_else(|| PolicyErrorKind::UnknownProtocol {
            field: format!("{field}.protocol"),
            value: value.to_string(),
        })?,
    };
    match (&port.port, port.end_port) {
        (None, None) => Ok(PortSpec::Numbered(PortRange::all_of(protocol))),
        (None, Some(_)) => Err(PolicyErrorKind::EndPortWithoutPort { field: format!("{field}.endPort") }),
        (Some(IntOrString::String(name)), end_port) => {
            if end_port.is_some() {
                return Err(PolicyErrorKind::EndPortWithNamedPort {
                    field: format!("{field}.endPort"),
                    name: name.clone(),
                });
            }
            if !is_valid_port_name(name) {
                return Err(PolicyErrorKind::InvalidPortName { field: format!("{field}.port"), name: name.clone() });
            }
            Ok(PortSpec::Named { protocol, name: name.clone() })
        }
        (Some(IntOrString::Int(start)), end_port) => {
            let start = port_number(*start, &format!("{field}.port"))?;
            let end = match end_port {
                None => start,
                Some(end) => {
                    let end = port_number(end, &format!("{field}.endPort"))?;
                    if end < start {
                        return Err(PolicyErrorKind::EndPortBeforePort {
                            field: format!("{field}.endPort"),
                            port: start,
                            end_port: end,
                        });
                    }
                    end
                }
            };
            Ok(PortSpec::Numbered(PortRange { protocol, start, end }))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_name_syntax() {
        for ok in ["http", "dns-tcp", "a1", "serve-80-tcp", "abcdefghijklmno"] {
            assert!(is_valid_port_name(ok), "{ok}");
        }
        for bad in ["", "80", "-http", "http-", "a--b", "HTTP", "abcdefghijklmnop", "a_b"] {
            assert!(!is_valid_port_name(bad), "{bad}");
        }
    }
}
