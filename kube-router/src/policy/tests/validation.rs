//! Invalid policies are reported per policy and skipped; others still compile.

use serde_json::{json, Value};

use super::fixtures::{ip, policy, Cluster};
use crate::policy::{allows, PolicyErrorKind, Protocol};

fn error_of(spec: Value) -> PolicyErrorKind {
    let cluster = Cluster::xyz();
    let out = cluster.compile(&[policy("x", "bad", spec), policy("y", "good", json!({"podSelector": {}}))]);
    assert_eq!(out.skipped_policy_count(), 1, "{:?}", out.policy_errors);
    let error = &out.policy_errors[0];
    assert_eq!((error.namespace.as_str(), error.name.as_str()), ("x", "bad"));
    assert!(error.to_string().starts_with("NetworkPolicy x/bad: "), "{error}");
    // The valid policy compiled, the invalid one did not isolate anything.
    assert!(!allows(&out.model, ip("10.0.1.1"), ip("10.0.2.1"), Protocol::Tcp, 80));
    assert!(allows(&out.model, ip("10.0.2.1"), ip("10.0.1.1"), Protocol::Tcp, 80));
    error.kind.clone()
}

fn ingress_from(peer: Value) -> Value {
    json!({"podSelector": {}, "ingress": [{"from": [peer]}]})
}

fn ingress_port(port: Value) -> Value {
    json!({"podSelector": {}, "ingress": [{"ports": [port]}]})
}

#[test]
fn bad_cidr() {
    for cidr in ["10.0.0.0/33", "banana", "10.0.0.1", ""] {
        let kind = error_of(ingress_from(json!({"ipBlock": {"cidr": cidr}})));
        assert!(
            matches!(kind, PolicyErrorKind::InvalidCidr { ref field, .. } if field == "spec.ingress[0].from[0].ipBlock.cidr"),
            "{kind}"
        );
    }
    let kind = error_of(ingress_from(json!({"ipBlock": {"cidr": "10.0.0.0/8", "except": ["nope"]}})));
    assert!(matches!(kind, PolicyErrorKind::InvalidCidr { ref field, .. } if field.ends_with("except[0]")), "{kind}");
}

#[test]
fn except_must_be_strictly_inside_cidr() {
    for except in ["11.0.0.0/16", "10.0.0.0/8", "10.0.0.0/7", "fd00::/64"] {
        let kind = error_of(ingress_from(json!({"ipBlock": {"cidr": "10.0.0.0/8", "except": [except]}})));
        assert!(matches!(kind, PolicyErrorKind::ExceptOutsideCidr { .. }), "{except}: {kind}");
    }
}

#[test]
fn port_out_of_range() {
    for port in [0, -1, 65536, 100000] {
        let kind = error_of(ingress_port(json!({"port": port})));
        assert!(matches!(kind, PolicyErrorKind::PortOutOfRange { .. }), "{kind}");
    }
    let kind = error_of(ingress_port(json!({"port": 80, "endPort": 70000})));
    assert!(matches!(kind, PolicyErrorKind::PortOutOfRange { ref field, .. } if field.ends_with("endPort")), "{kind}");
}

#[test]
fn end_port_before_port() {
    let kind = error_of(ingress_port(json!({"port": 90, "endPort": 80})));
    assert_eq!(
        kind,
        PolicyErrorKind::EndPortBeforePort { field: "spec.ingress[0].ports[0].endPort".into(), port: 90, end_port: 80 }
    );
}

#[test]
fn end_port_with_named_port_or_without_port() {
    let kind = error_of(ingress_port(json!({"port": "http", "endPort": 90})));
    assert!(matches!(kind, PolicyErrorKind::EndPortWithNamedPort { .. }), "{kind}");
    let kind = error_of(ingress_port(json!({"endPort": 90})));
    assert!(matches!(kind, PolicyErrorKind::EndPortWithoutPort { .. }), "{kind}");
}

#[test]
fn unknown_protocol() {
    for protocol in ["ICMP", "tcp", ""] {
        let kind = error_of(ingress_port(json!({"port": 80, "protocol": protocol})));
        assert!(matches!(kind, PolicyErrorKind::UnknownProtocol { .. }), "{kind}");
    }
}

#[test]
fn invalid_port_name() {
    let kind = error_of(ingress_port(json!({"port": "Not_Valid"})));
    assert!(matches!(kind, PolicyErrorKind::InvalidPortName { .. }), "{kind}");
}

#[test]
fn invalid_peers_and_selectors() {
    let kind = error_of(ingress_from(json!({"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}})));
    assert!(matches!(kind, PolicyErrorKind::InvalidPeer { .. }), "{kind}");
    let kind = error_of(ingress_from(json!({})));
    assert!(matches!(kind, PolicyErrorKind::InvalidPeer { .. }), "{kind}");
    let kind = error_of(ingress_from(json!({"podSelector": {"matchExpressions": [{"key": "a", "operator": "Near"}]}})));
    assert!(matches!(kind, PolicyErrorKind::InvalidSelector { .. }), "{kind}");
    let kind = error_of(json!({"podSelector": {"matchExpressions": [{"key": "a", "operator": "In"}]}}));
    assert!(
        matches!(kind, PolicyErrorKind::InvalidSelector { ref field, .. } if field == "spec.podSelector"),
        "{kind}"
    );
}

#[test]
fn unknown_policy_type_and_errors_in_egress() {
    let kind = error_of(json!({"podSelector": {}, "policyTypes": ["Ingress", "Sideways"]}));
    assert!(matches!(kind, PolicyErrorKind::UnknownPolicyType { .. }), "{kind}");
    let kind = error_of(json!({"podSelector": {}, "egress": [{"to": [{"ipBlock": {"cidr": "x"}}]}]}));
    assert!(
        matches!(kind, PolicyErrorKind::InvalidCidr { ref field, .. } if field.starts_with("spec.egress[0].to[0]")),
        "{kind}"
    );
}

#[test]
fn missing_metadata_is_an_error_not_a_panic() {
    let cluster = Cluster::xyz();
    let mut np = policy("x", "p", json!({"podSelector": {}}));
    np.metadata.namespace = None;
    let out = cluster.compile(&[np]);
    assert!(matches!(out.policy_errors[0].kind, PolicyErrorKind::MissingMetadata { field: "namespace" }));
    assert!(out.model.pods.values().all(|p| p.ingress == crate::policy::Isolation::NotIsolated));
}

#[test]
fn cidr_with_host_bits_is_normalised() {
    let cluster = Cluster::xyz();
    let out = cluster.compile(&[policy("x", "p", ingress_from(json!({"ipBlock": {"cidr": "10.0.2.7/24"}})))]);
    assert!(out.policy_errors.is_empty());
    assert!(allows(&out.model, ip("10.0.2.1"), ip("10.0.1.1"), Protocol::Tcp, 80));
}
