//! Probe-matrix scenarios in the style of the upstream network-policy e2e
//! suite: namespaces x, y, z with pods a, b, c; ports 80/TCP, 81/TCP and
//! 53/UDP. Rows are sources, columns destinations; `.` allowed, `X` blocked.
//! Run with `--nocapture` to see every matrix.

use serde_json::json;

use super::fixtures::{assert_matrix, ip, policy, policy_yaml, Cluster};
use crate::policy::{allows, Protocol};

const ALL_ALLOWED: &str = "
    x/a x/b x/c y/a y/b y/c z/a z/b z/c
x/a  .   .   .   .   .   .   .   .   .
x/b  .   .   .   .   .   .   .   .   .
x/c  .   .   .   .   .   .   .   .   .
y/a  .   .   .   .   .   .   .   .   .
y/b  .   .   .   .   .   .   .   .   .
y/c  .   .   .   .   .   .   .   .   .
z/a  .   .   .   .   .   .   .   .   .
z/b  .   .   .   .   .   .   .   .   .
z/c  .   .   .   .   .   .   .   .   .
";

#[test]
fn no_policies_allow_everything() {
    let cluster = Cluster::xyz();
    let out = cluster.compile(&[]);
    assert_matrix("no policies", &cluster, &out, Protocol::Tcp, 80, ALL_ALLOWED);
}

#[test]
fn default_deny_ingress() {
    let cluster = Cluster::xyz();
    let out = cluster.compile(&[policy("x", "deny-ingress", json!({"podSelector": {}, "policyTypes": ["Ingress"]}))]);
    let expected = "
        x/a x/b x/c y/a y/b y/c z/a z/b z/c
    x/a  X   X   X   .   .   .   .   .   .
    x/b  X   X   X   .   .   .   .   .   .
    x/c  X   X   X   .   .   .   .   .   .
    y/a  X   X   X   .   .   .   .   .   .
    y/b  X   X   X   .   .   .   .   .   .
    y/c  X   X   X   .   .   .   .   .   .
    z/a  X   X   X   .   .   .   .   .   .
    z/b  X   X   X   .   .   .   .   .   .
    z/c  X   X   X   .   .   .   .   .   .
    ";
    assert_matrix("default deny ingress", &cluster, &out, Protocol::Tcp, 80, expected);
    assert_matrix("default deny ingress", &cluster, &out, Protocol::Udp, 53, expected);
}

#[test]
fn default_deny_egress() {
    let cluster = Cluster::xyz();
    let out = cluster.compile(&[policy("x", "deny-egress", json!({"podSelector": {}, "policyTypes": ["Egress"]}))]);
    let expected = "
        x/a x/b x/c y/a y/b y/c z/a z/b z/c
    x/a  X   X   X   X   X   X   X   X   X
    x/b  X   X   X   X   X   X   X   X   X
    x/c  X   X   X   X   X   X   X   X   X
    y/a  .   .   .   .   .   .   .   .   .
    y/b  .   .   .   .   .   .   .   .   .
    y/c  .   .   .   .   .   .   .   .   .
    z/a  .   .   .   .   .   .   .   .   .
    z/b  .   .   .   .   .   .   .   .   .
    z/c  .   .   .   .   .   .   .   .   .
    ";
    assert_matrix("default deny egress", &cluster, &out, Protocol::Tcp, 80, expected);
    assert_matrix("default deny egress", &cluster, &out, Protocol::Udp, 53, expected);
}

#[test]
fn allow_from_namespace() {
    let cluster = Cluster::xyz();
    let out = cluster.compile(&[policy_yaml(
        r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  namespace: x
  name: allow-from-y
spec:
  podSelector:
    matchLabels:
      pod: a
  ingress:
  - from:
    - namespaceSelector:
        matchLabels:
          ns: y
"#,
    )]);
    let expected = "
        x/a x/b x/c y/a y/b y/c z/a z/b z/c
    x/a  X   .   .   .   .   .   .   .   .
    x/b  X   .   .   .   .   .   .   .   .
    x/c  X   .   .   .   .   .   .   .   .
    y/a  .   .   .   .   .   .   .   .   .
    y/b  .   .   .   .   .   .   .   .   .
    y/c  .   .   .   .   .   .   .   .   .
    z/a  X   .   .   .   .   .   .   .   .
    z/b  X   .   .   .   .   .   .   .   .
    z/c  X   .   .   .   .   .   .   .   .
    ";
    assert_matrix("allow from namespace", &cluster, &out, Protocol::Tcp, 80, expected);
}

#[test]
fn allow_from_pods_in_namespaces_is_and() {
    let cluster = Cluster::xyz();
    let out = cluster.compile(&[policy(
        "x",
        "allow-b-in-y-or-z",
        json!({
            "podSelector": {"matchLabels": {"pod": "a"}},
            "ingress": [{"from": [{
                "namespaceSelector": {"matchExpressions": [
                    {"key": "ns", "operator": "In", "values": ["y", "z"]}
                ]},
                "podSelector": {"matchLabels": {"pod": "b"}}
            }]}]
        }),
    )]);
    let expected = "
        x/a x/b x/c y/a y/b y/c z/a z/b z/c
    x/a  X   .   .   .   .   .   .   .   .
    x/b  X   .   .   .   .   .   .   .   .
    x/c  X   .   .   .   .   .   .   .   .
    y/a  X   .   .   .   .   .   .   .   .
    y/b  .   .   .   .   .   .   .   .   .
    y/c  X   .   .   .   .   .   .   .   .
    z/a  X   .   .   .   .   .   .   .   .
    z/b  .   .   .   .   .   .   .   .   .
    z/c  X   .   .   .   .   .   .   .   .
    ";
    assert_matrix("pods AND namespaces", &cluster, &out, Protocol::Tcp, 80, expected);
}

#[test]
fn allow_from_pods_or_namespace_two_peers() {
    let cluster = Cluster::xyz();
    let out = cluster.compile(&[policy(
        "x",
        "allow-y-or-local-b",
        json!({
            "podSelector": {"matchLabels": {"pod": "a"}},
            "ingress": [{"from": [
                {"namespaceSelector": {"matchLabels": {"ns": "y"}}},
                {"podSelector": {"matchLabels": {"pod": "b"}}}
            ]}]
        }),
    )]);
    let expected = "
        x/a x/b x/c y/a y/b y/c z/a z/b z/c
    x/a  X   .   .   .   .   .   .   .   .
    x/b  .   .   .   .   .   .   .   .   .
    x/c  X   .   .   .   .   .   .   .   .
    y/a  .   .   .   .   .   .   .   .   .
    y/b  .   .   .   .   .   .   .   .   .
    y/c  .   .   .   .   .   .   .   .   .
    z/a  X   .   .   .   .   .   .   .   .
    z/b  X   .   .   .   .   .   .   .   .
    z/c  X   .   .   .   .   .   .   .   .
    ";
    assert_matrix("pods OR namespace", &cluster, &out, Protocol::Tcp, 80, expected);
}

#[test]
fn ip_block_with_except() {
    let cluster = Cluster::xyz();
    let ingress = policy_yaml(
        r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {namespace: x, name: from-block}
spec:
  podSelector: {matchLabels: {pod: a}}
  ingress:
  - from:
    - ipBlock: {cidr: 10.0.0.0/16, except: [10.0.2.0/24]}
"#,
    );
    let egress = policy(
        "x",
        "b-to-z-block",
        json!({
            "podSelector": {"matchLabels": {"pod": "b"}},
            "policyTypes": ["Egress"],
            "egress": [{"to": [{"ipBlock": {"cidr": "10.0.3.0/24"}}]}]
        }),
    );
    let out = cluster.compile(&[ingress, egress]);
    let expected = "
        x/a x/b x/c y/a y/b y/c z/a z/b z/c
    x/a  .   .   .   .   .   .   .   .   .
    x/b  X   X   X   X   X   X   .   .   .
    x/c  .   .   .   .   .   .   .   .   .
    y/a  X   .   .   .   .   .   .   .   .
    y/b  X   .   .   .   .   .   .   .   .
    y/c  X   .   .   .   .   .   .   .   .
    z/a  .   .   .   .   .   .   .   .   .
    z/b  .   .   .   .   .   .   .   .   .
    z/c  .   .   .   .   .   .   .   .   .
    ";
    assert_matrix("ipBlock with except", &cluster, &out, Protocol::Tcp, 80, expected);
    // Outside the cluster only the pod's side applies.
    let x_a = cluster.ip_of("x/a");
    assert!(allows(&out.model, ip("10.0.200.7"), x_a, Protocol::Tcp, 80));
    assert!(!allows(&out.model, ip("192.168.1.1"), x_a, Protocol::Tcp, 80));
    assert!(!allows(&out.model, cluster.ip_of("x/b"), ip("8.8.8.8"), Protocol::Udp, 53));
    assert!(allows(&out.model, cluster.ip_of("x/b"), ip("10.0.3.200"), Protocol::Udp, 53));
}

#[test]
fn named_port() {
    let cluster = Cluster::xyz();
    let out = cluster.compile(&[policy(
        "x",
        "allow-81-by-name",
        json!({
            "podSelector": {"matchLabels": {"pod": "a"}},
            "ingress": [{"ports": [{"port": "serve-81-tcp"}]}]
        }),
    )]);
    let blocked_to_x_a = "
        x/a x/b x/c y/a y/b y/c z/a z/b z/c
    x/a  X   .   .   .   .   .   .   .   .
    x/b  X   .   .   .   .   .   .   .   .
    x/c  X   .   .   .   .   .   .   .   .
    y/a  X   .   .   .   .   .   .   .   .
    y/b  X   .   .   .   .   .   .   .   .
    y/c  X   .   .   .   .   .   .   .   .
    z/a  X   .   .   .   .   .   .   .   .
    z/b  X   .   .   .   .   .   .   .   .
    z/c  X   .   .   .   .   .   .   .   .
    ";
    assert_matrix("named port", &cluster, &out, Protocol::Tcp, 80, blocked_to_x_a);
    assert_matrix("named port", &cluster, &out, Protocol::Tcp, 81, ALL_ALLOWED);
    assert_matrix("named port", &cluster, &out, Protocol::Udp, 81, blocked_to_x_a);
}

#[test]
fn egress_named_port() {
    let cluster = Cluster::xyz();
    let out = cluster.compile(&[policy(
        "y",
        "egress-dns-by-name",
        json!({
            "podSelector": {},
            "policyTypes": ["Egress"],
            "egress": [{
                "to": [{"namespaceSelector": {}}],
                "ports": [{"port": "serve-53-udp", "protocol": "UDP"}]
            }]
        }),
    )]);
    let tcp_80 = "
        x/a x/b x/c y/a y/b y/c z/a z/b z/c
    x/a  .   .   .   .   .   .   .   .   .
    x/b  .   .   .   .   .   .   .   .   .
    x/c  .   .   .   .   .   .   .   .   .
    y/a  X   X   X   X   X   X   X   X   X
    y/b  X   X   X   X   X   X   X   X   X
    y/c  X   X   X   X   X   X   X   X   X
    z/a  .   .   .   .   .   .   .   .   .
    z/b  .   .   .   .   .   .   .   .   .
    z/c  .   .   .   .   .   .   .   .   .
    ";
    assert_matrix("egress named port", &cluster, &out, Protocol::Tcp, 80, tcp_80);
    assert_matrix("egress named port", &cluster, &out, Protocol::Udp, 53, ALL_ALLOWED);
    // The name only exists on pods: an external DNS server is not reachable.
    assert!(!allows(&out.model, cluster.ip_of("y/a"), ip("8.8.8.8"), Protocol::Udp, 53));
}

#[test]
fn end_port_range() {
    let cluster = Cluster::xyz();
    let out = cluster.compile(&[policy(
        "x",
        "allow-81-to-90",
        json!({
            "podSelector": {"matchLabels": {"pod": "a"}},
            "ingress": [{"ports": [{"port": 81, "endPort": 90, "protocol": "TCP"}]}]
        }),
    )]);
    let blocked_to_x_a = "
        x/a x/b x/c y/a y/b y/c z/a z/b z/c
    x/a  X   .   .   .   .   .   .   .   .
    x/b  X   .   .   .   .   .   .   .   .
    x/c  X   .   .   .   .   .   .   .   .
    y/a  X   .   .   .   .   .   .   .   .
    y/b  X   .   .   .   .   .   .   .   .
    y/c  X   .   .   .   .   .   .   .   .
    z/a  X   .   .   .   .   .   .   .   .
    z/b  X   .   .   .   .   .   .   .   .
    z/c  X   .   .   .   .   .   .   .   .
    ";
    assert_matrix("endPort", &cluster, &out, Protocol::Tcp, 80, blocked_to_x_a);
    assert_matrix("endPort", &cluster, &out, Protocol::Tcp, 81, ALL_ALLOWED);
    assert_matrix("endPort", &cluster, &out, Protocol::Tcp, 90, ALL_ALLOWED);
    assert_matrix("endPort", &cluster, &out, Protocol::Tcp, 91, blocked_to_x_a);
}

#[test]
fn egress_to_dns_only() {
    let cluster = Cluster::xyz();
    let out = cluster.compile(&[policy(
        "x",
        "dns-only",
        json!({
            "podSelector": {},
            "policyTypes": ["Egress"],
            "egress": [{"ports": [
                {"port": 53, "protocol": "UDP"},
                {"port": 53, "protocol": "TCP"}
            ]}]
        }),
    )]);
    let tcp_80 = "
        x/a x/b x/c y/a y/b y/c z/a z/b z/c
    x/a  X   X   X   X   X   X   X   X   X
    x/b  X   X   X   X   X   X   X   X   X
    x/c  X   X   X   X   X   X   X   X   X
    y/a  .   .   .   .   .   .   .   .   .
    y/b  .   .   .   .   .   .   .   .   .
    y/c  .   .   .   .   .   .   .   .   .
    z/a  .   .   .   .   .   .   .   .   .
    z/b  .   .   .   .   .   .   .   .   .
    z/c  .   .   .   .   .   .   .   .   .
    ";
    assert_matrix("egress DNS only", &cluster, &out, Protocol::Tcp, 80, tcp_80);
    assert_matrix("egress DNS only", &cluster, &out, Protocol::Udp, 53, ALL_ALLOWED);
    // `to` is missing: DNS outside the cluster is allowed too.
    assert!(allows(&out.model, cluster.ip_of("x/a"), ip("8.8.8.8"), Protocol::Udp, 53));
}

#[test]
fn multiple_policies_are_unioned() {
    let cluster = Cluster::xyz();
    let out = cluster.compile(&[
        policy("x", "deny-all", json!({"podSelector": {}})),
        policy(
            "x",
            "a-from-local-b",
            json!({
                "podSelector": {"matchLabels": {"pod": "a"}},
                "ingress": [{"from": [{"podSelector": {"matchLabels": {"pod": "b"}}}]}]
            }),
        ),
        policy(
            "x",
            "a-from-z-on-80",
            json!({
                "podSelector": {"matchLabels": {"pod": "a"}},
                "ingress": [{
                    "from": [{"namespaceSelector": {"matchLabels": {"ns": "z"}}}],
                    "ports": [{"port": 80}]
                }]
            }),
        ),
    ]);
    let tcp_80 = "
        x/a x/b x/c y/a y/b y/c z/a z/b z/c
    x/a  X   X   X   .   .   .   .   .   .
    x/b  .   X   X   .   .   .   .   .   .
    x/c  X   X   X   .   .   .   .   .   .
    y/a  X   X   X   .   .   .   .   .   .
    y/b  X   X   X   .   .   .   .   .   .
    y/c  X   X   X   .   .   .   .   .   .
    z/a  .   X   X   .   .   .   .   .   .
    z/b  .   X   X   .   .   .   .   .   .
    z/c  .   X   X   .   .   .   .   .   .
    ";
    let tcp_81 = "
        x/a x/b x/c y/a y/b y/c z/a z/b z/c
    x/a  X   X   X   .   .   .   .   .   .
    x/b  .   X   X   .   .   .   .   .   .
    x/c  X   X   X   .   .   .   .   .   .
    y/a  X   X   X   .   .   .   .   .   .
    y/b  X   X   X   .   .   .   .   .   .
    y/c  X   X   X   .   .   .   .   .   .
    z/a  X   X   X   .   .   .   .   .   .
    z/b  X   X   X   .   .   .   .   .   .
    z/c  X   X   X   .   .   .   .   .   .
    ";
    assert_matrix("union", &cluster, &out, Protocol::Tcp, 80, tcp_80);
    assert_matrix("union", &cluster, &out, Protocol::Tcp, 81, tcp_81);
}

#[test]
fn namespace_not_in_and_pod_does_not_exist() {
    let cluster = Cluster::xyz();
    let out = cluster.compile(&[policy(
        "x",
        "not-from-y",
        json!({
            "podSelector": {"matchLabels": {"pod": "a"}},
            "ingress": [{"from": [{
                "namespaceSelector": {"matchExpressions": [
                    {"key": "ns", "operator": "NotIn", "values": ["y"]}
                ]},
                "podSelector": {"matchExpressions": [
                    {"key": "tier", "operator": "DoesNotExist"}
                ]}
            }]}]
        }),
    )]);
    let expected = "
        x/a x/b x/c y/a y/b y/c z/a z/b z/c
    x/a  .   .   .   .   .   .   .   .   .
    x/b  .   .   .   .   .   .   .   .   .
    x/c  .   .   .   .   .   .   .   .   .
    y/a  X   .   .   .   .   .   .   .   .
    y/b  X   .   .   .   .   .   .   .   .
    y/c  X   .   .   .   .   .   .   .   .
    z/a  .   .   .   .   .   .   .   .   .
    z/b  .   .   .   .   .   .   .   .   .
    z/c  .   .   .   .   .   .   .   .   .
    ";
    assert_matrix("NotIn / DoesNotExist", &cluster, &out, Protocol::Tcp, 80, expected);
}
