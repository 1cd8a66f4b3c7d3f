//! One test per semantic point of networking.k8s.io/v1.

use k8s_openapi::api::core::v1::Pod;
use serde_json::json;

use super::fixtures::{ip, namespace, pod, pod_with_ports, policy, Cluster};
use crate::policy::{allows, compile, Direction, Isolation, PeerSet, PortRange, Ports, Protocol};

fn isolation(out: &crate::policy::CompileOutput, address: &str, direction: Direction) -> Isolation {
    out.model.pods[&ip(address)].direction(direction).clone()
}

#[test]
fn pods_without_ip_terminal_or_host_network_are_skipped() {
    let mut no_ip = pod("x", "pending", "10.9.0.1", &[]);
    if let Some(status) = no_ip.status.as_mut() {
        status.pod_ip = None;
        status.pod_ips = None;
    }
    let mut finished = pod("x", "done", "10.9.0.2", &[]);
    if let Some(status) = finished.status.as_mut() {
        status.phase = Some("Succeeded".into());
    }
    let mut failed = pod("x", "failed", "10.9.0.3", &[]);
    if let Some(status) = failed.status.as_mut() {
        status.phase = Some("Failed".into());
    }
    let mut host = pod("x", "host", "10.9.0.4", &[]);
    if let Some(spec) = host.spec.as_mut() {
        spec.host_network = Some(true);
    }
    let garbage_ip = pod("x", "garbage", "not-an-ip", &[]);
    let no_status = Pod { status: None, ..pod("x", "nostatus", "10.9.0.5", &[]) };
    let running = pod("x", "running", "10.9.0.6", &[]);
    let out = compile(&[no_ip, finished, failed, host, garbage_ip, no_status, running], &[], &[]);
    assert_eq!(out.model.pods.keys().copied().collect::<Vec<_>>(), vec![ip("10.9.0.6")]);
}

#[test]
fn dual_stack_pod_gets_an_entry_per_ip() {
    let dual = pod_with_ports("x", "a", &["10.1.0.1", "fd00::1"], &[("pod", "a")], json!([]));
    let peer = pod_with_ports("x", "b", &["10.1.0.2", "fd00::2"], &[("pod", "b")], json!([]));
    let deny_from_others = policy(
        "x",
        "a-from-b",
        json!({"podSelector": {"matchLabels": {"pod": "a"}},
               "ingress": [{"from": [{"podSelector": {"matchLabels": {"pod": "b"}}}]}]}),
    );
    let out = compile(&[dual, peer], &[], &[deny_from_others]);
    assert_eq!(out.model.pods.len(), 4);
    assert!(allows(&out.model, ip("fd00::2"), ip("fd00::1"), Protocol::Tcp, 80));
    assert!(allows(&out.model, ip("10.1.0.2"), ip("10.1.0.1"), Protocol::Tcp, 80));
    assert!(!allows(&out.model, ip("fd00::99"), ip("fd00::1"), Protocol::Tcp, 80));
}

#[test]
fn unselected_pods_are_not_isolated() {
    let cluster = Cluster::xyz();
    let out = cluster.compile(&[policy("x", "only-a", json!({"podSelector": {"matchLabels": {"pod": "a"}}}))]);
    assert_eq!(isolation(&out, "10.0.1.2", Direction::Ingress), Isolation::NotIsolated);
    assert_eq!(isolation(&out, "10.0.1.1", Direction::Ingress), Isolation::Isolated(vec![]));
}

#[test]
fn implied_policy_types_ingress_always_egress_only_with_rules() {
    let cluster = Cluster::xyz();
    let ingress_only = cluster.compile(&[policy("x", "p", json!({"podSelector": {}, "egress": []}))]);
    assert_eq!(isolation(&ingress_only, "10.0.1.1", Direction::Ingress), Isolation::Isolated(vec![]));
    assert_eq!(isolation(&ingress_only, "10.0.1.1", Direction::Egress), Isolation::NotIsolated);

    let both = cluster.compile(&[policy(
        "x",
        "p",
        json!({"podSelector": {}, "egress": [{"ports": [{"port": 53, "protocol": "UDP"}]}]}),
    )]);
    assert_eq!(isolation(&both, "10.0.1.1", Direction::Ingress), Isolation::Isolated(vec![]));
    assert!(matches!(isolation(&both, "10.0.1.1", Direction::Egress), Isolation::Isolated(r) if r.len() == 1));
}

#[test]
fn explicit_policy_types_ignore_rules_of_the_other_direction() {
    let cluster = Cluster::xyz();
    let out = cluster.compile(&[policy(
        "x",
        "egress-typed",
        json!({"podSelector": {}, "policyTypes": ["Egress"],
               "ingress": [{}], "egress": [{"to": [{"podSelector": {}}]}]}),
    )]);
    assert_eq!(isolation(&out, "10.0.1.1", Direction::Ingress), Isolation::NotIsolated);
    assert!(matches!(isolation(&out, "10.0.1.1", Direction::Egress), Isolation::Isolated(_)));
}

#[test]
fn empty_pod_selector_selects_only_the_policy_namespace() {
    let cluster = Cluster::xyz();
    let out = cluster.compile(&[policy("y", "deny", json!({"podSelector": {}}))]);
    for (name, address) in &cluster.probes {
        let isolated = matches!(out.model.pods[address].ingress, Isolation::Isolated(_));
        assert_eq!(isolated, name.starts_with("y/"), "{name}");
    }
}

#[test]
fn missing_pod_selector_is_treated_as_empty() {
    let cluster = Cluster::xyz();
    let out = cluster.compile(&[policy("y", "deny", json!({}))]);
    assert_eq!(isolation(&out, "10.0.2.3", Direction::Ingress), Isolation::Isolated(vec![]));
}

#[test]
fn empty_or_missing_from_allows_all_sources_and_missing_ports_all_ports() {
    let cluster = Cluster::xyz();
    for rule in [json!({}), json!({"from": []}), json!({"from": [], "ports": []})] {
        let out = cluster.compile(&[policy("x", "allow-all", json!({"podSelector": {}, "ingress": [rule]}))]);
        assert_eq!(
            isolation(&out, "10.0.1.1", Direction::Ingress),
            Isolation::Isolated(vec![crate::policy::Rule { peers: PeerSet::Any, ports: Ports::All }])
        );
        assert!(allows(&out.model, ip("203.0.113.5"), ip("10.0.1.1"), Protocol::Sctp, 9));
    }
}

#[test]
fn protocol_without_port_allows_every_port_of_that_protocol() {
    let cluster = Cluster::xyz();
    let out = cluster.compile(&[policy(
        "x",
        "udp-only",
        json!({"podSelector": {}, "ingress": [{"ports": [{"protocol": "UDP"}]}]}),
    )]);
    assert!(allows(&out.model, ip("10.0.2.1"), ip("10.0.1.1"), Protocol::Udp, 1));
    assert!(allows(&out.model, ip("10.0.2.1"), ip("10.0.1.1"), Protocol::Udp, 65535));
    assert!(!allows(&out.model, ip("10.0.2.1"), ip("10.0.1.1"), Protocol::Tcp, 80));
}

#[test]
fn default_protocol_is_tcp() {
    let cluster = Cluster::xyz();
    let out = cluster.compile(&[policy("x", "p", json!({"podSelector": {}, "ingress": [{"ports": [{"port": 80}]}]}))]);
    assert_eq!(
        isolation(&out, "10.0.1.1", Direction::Ingress).rules()[0].ports,
        Ports::Ranges(vec![PortRange::single(Protocol::Tcp, 80)])
    );
}

#[test]
fn pod_selector_peer_is_limited_to_the_policy_namespace() {
    let cluster = Cluster::xyz();
    let out = cluster.compile(&[policy(
        "x",
        "from-any-b",
        json!({"podSelector": {}, "ingress": [{"from": [{"podSelector": {"matchLabels": {"pod": "b"}}}]}]}),
    )]);
    assert!(allows(&out.model, ip("10.0.1.2"), ip("10.0.1.1"), Protocol::Tcp, 80));
    assert!(!allows(&out.model, ip("10.0.2.2"), ip("10.0.1.1"), Protocol::Tcp, 80));
}

#[test]
fn empty_namespace_selector_selects_all_namespaces() {
    let cluster = Cluster::xyz();
    let out = cluster.compile(&[policy(
        "x",
        "from-cluster",
        json!({"podSelector": {}, "ingress": [{"from": [{"namespaceSelector": {}}]}]}),
    )]);
    for (_, src) in &cluster.probes {
        assert!(allows(&out.model, *src, ip("10.0.1.1"), Protocol::Tcp, 80));
    }
    assert!(!allows(&out.model, ip("10.0.9.9"), ip("10.0.1.1"), Protocol::Tcp, 80));
}

#[test]
fn namespace_name_label_is_implicit() {
    // Namespace objects without labels (or not yet known) still carry
    // kubernetes.io/metadata.name, as the API server guarantees.
    let pods = [pod("x", "a", "10.0.1.1", &[]), pod("y", "a", "10.0.2.1", &[]), pod("q", "a", "10.0.4.1", &[])];
    let namespaces = [namespace("x", &[]), namespace("y", &[])];
    let np = policy(
        "x",
        "from-y-and-q",
        json!({"podSelector": {}, "ingress": [{"from": [{"namespaceSelector": {"matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["y", "q"]}]}}]}]}),
    );
    let out = compile(&pods, &namespaces, &[np]);
    assert!(allows(&out.model, ip("10.0.2.1"), ip("10.0.1.1"), Protocol::Tcp, 80));
    assert!(allows(&out.model, ip("10.0.4.1"), ip("10.0.1.1"), Protocol::Tcp, 80));
}

#[test]
fn ip_block_except_carves_out_ranges() {
    let cluster = Cluster::xyz();
    let out = cluster.compile(&[policy(
        "x",
        "block",
        json!({"podSelector": {}, "ingress": [{"from": [{"ipBlock": {
            "cidr": "192.168.0.0/16", "except": ["192.168.1.0/24", "192.168.2.128/25"]}}]}]}),
    )]);
    let dst = ip("10.0.1.1");
    assert!(allows(&out.model, ip("192.168.0.1"), dst, Protocol::Tcp, 80));
    assert!(!allows(&out.model, ip("192.168.1.1"), dst, Protocol::Tcp, 80));
    assert!(allows(&out.model, ip("192.168.2.1"), dst, Protocol::Tcp, 80));
    assert!(!allows(&out.model, ip("192.168.2.200"), dst, Protocol::Tcp, 80));
    assert!(!allows(&out.model, ip("10.0.2.1"), dst, Protocol::Tcp, 80));
}

#[test]
fn ipv6_ip_block() {
    let pods = [pod_with_ports("x", "a", &["fd00::1"], &[], json!([]))];
    let np = policy(
        "x",
        "v6",
        json!({"podSelector": {}, "ingress": [{"from": [{"ipBlock": {"cidr": "2001:db8::/32", "except": ["2001:db8:1::/48"]}}]}]}),
    );
    let out = compile(&pods, &[], &[np]);
    assert!(allows(&out.model, ip("2001:db8::5"), ip("fd00::1"), Protocol::Tcp, 1));
    assert!(!allows(&out.model, ip("2001:db8:1::5"), ip("fd00::1"), Protocol::Tcp, 1));
    assert!(!allows(&out.model, ip("10.0.0.1"), ip("fd00::1"), Protocol::Tcp, 1));
}

fn web_pod(name: &str, address: &str, http_port: u16) -> Pod {
    pod_with_ports("x", name, &[address], &[("app", "web")], json!([{"name": "http", "containerPort": http_port}]))
}

#[test]
fn ingress_named_port_resolves_per_target_pod() {
    let pods = [web_pod("w1", "10.2.0.1", 8080), web_pod("w2", "10.2.0.2", 9090)];
    let np = policy(
        "x",
        "http",
        json!({"podSelector": {"matchLabels": {"app": "web"}}, "ingress": [{"ports": [{"port": "http"}]}]}),
    );
    let out = compile(&pods, &[], &[np]);
    let src = ip("10.9.9.9");
    assert!(allows(&out.model, src, ip("10.2.0.1"), Protocol::Tcp, 8080));
    assert!(!allows(&out.model, src, ip("10.2.0.1"), Protocol::Tcp, 9090));
    assert!(allows(&out.model, src, ip("10.2.0.2"), Protocol::Tcp, 9090));
    assert!(!allows(&out.model, src, ip("10.2.0.2"), Protocol::Tcp, 8080));
    // The protocol must match too.
    assert!(!allows(&out.model, src, ip("10.2.0.1"), Protocol::Udp, 8080));
}

#[test]
fn unresolvable_named_port_allows_nothing_but_keeps_isolation() {
    let pods = [web_pod("w1", "10.2.0.1", 8080)];
    let np = policy("x", "metrics", json!({"podSelector": {}, "ingress": [{"ports": [{"port": "metrics"}]}]}));
    let out = compile(&pods, &[], &[np]);
    assert_eq!(isolation(&out, "10.2.0.1", Direction::Ingress), Isolation::Isolated(vec![]));
}

#[test]
fn egress_named_port_resolves_per_destination_pod() {
    let client = pod_with_ports("x", "client", &["10.2.0.9"], &[("app", "client")], json!([]));
    let pods = [client, web_pod("w1", "10.2.0.1", 8080), web_pod("w2", "10.2.0.2", 9090)];
    let np = policy(
        "x",
        "client-to-http",
        json!({"podSelector": {"matchLabels": {"app": "client"}}, "policyTypes": ["Egress"],
               "egress": [{"to": [{"podSelector": {"matchLabels": {"app": "web"}}}],
                           "ports": [{"port": "http"}, {"port": 443}]}]}),
    );
    let out = compile(&pods, &[], &[np]);
    let client_ip = ip("10.2.0.9");
    assert!(allows(&out.model, client_ip, ip("10.2.0.1"), Protocol::Tcp, 8080));
    assert!(!allows(&out.model, client_ip, ip("10.2.0.1"), Protocol::Tcp, 9090));
    assert!(allows(&out.model, client_ip, ip("10.2.0.2"), Protocol::Tcp, 9090));
    assert!(!allows(&out.model, client_ip, ip("10.2.0.2"), Protocol::Tcp, 8080));
    assert!(allows(&out.model, client_ip, ip("10.2.0.2"), Protocol::Tcp, 443));
    // One rule for 443, one per distinct resolved number.
    assert_eq!(isolation(&out, "10.2.0.9", Direction::Egress).rules().len(), 3);
}

#[test]
fn egress_named_port_to_ip_block_only_reaches_pods_inside_it() {
    let client = pod_with_ports("x", "client", &["10.2.0.9"], &[], json!([]));
    let pods = [client, web_pod("w1", "10.2.0.1", 8080), web_pod("w2", "10.3.0.1", 8080)];
    let np = policy(
        "x",
        "client-to-block",
        json!({"podSelector": {}, "policyTypes": ["Egress"],
               "egress": [{"to": [{"ipBlock": {"cidr": "10.2.0.0/16"}}], "ports": [{"port": "http"}]}]}),
    );
    let out = compile(&pods, &[], &[np]);
    assert!(allows(&out.model, ip("10.2.0.9"), ip("10.2.0.1"), Protocol::Tcp, 8080));
    assert!(!allows(&out.model, ip("10.2.0.9"), ip("10.3.0.1"), Protocol::Tcp, 8080));
    assert!(!allows(&out.model, ip("10.2.0.9"), ip("10.2.0.77"), Protocol::Tcp, 8080));
}

#[test]
fn policies_union_isolation_across_directions() {
    let cluster = Cluster::xyz();
    let out = cluster.compile(&[
        policy("x", "in", json!({"podSelector": {"matchLabels": {"pod": "a"}}, "policyTypes": ["Ingress"]})),
        policy(
            "x",
            "out",
            json!({"podSelector": {}, "policyTypes": ["Egress"], "egress": [{"to": [{"podSelector": {}}]}]}),
        ),
    ]);
    assert_eq!(isolation(&out, "10.0.1.1", Direction::Ingress), Isolation::Isolated(vec![]));
    assert!(matches!(isolation(&out, "10.0.1.2", Direction::Egress), Isolation::Isolated(r) if r.len() == 1));
    assert_eq!(isolation(&out, "10.0.1.2", Direction::Ingress), Isolation::NotIsolated);
    assert!(allows(&out.model, ip("10.0.1.2"), ip("10.0.1.3"), Protocol::Tcp, 80));
    assert!(!allows(&out.model, ip("10.0.1.2"), ip("10.0.2.1"), Protocol::Tcp, 80));
}

#[test]
fn identical_rules_from_different_policies_are_deduplicated() {
    let cluster = Cluster::xyz();
    let rule = json!({"podSelector": {}, "ingress": [{"from": [{"namespaceSelector": {}}]}]});
    let out = cluster.compile(&[policy("x", "p1", rule.clone()), policy("x", "p2", rule)]);
    assert_eq!(isolation(&out, "10.0.1.1", Direction::Ingress).rules().len(), 1);
}

#[test]
fn conflicting_ip_claims_resolve_to_the_smallest_pod_name() {
    let np = policy("x", "deny-b", json!({"podSelector": {"matchLabels": {"pod": "b"}}}));
    let first = pod("x", "b-new", "10.5.0.1", &[("pod", "b")]);
    let second = pod("x", "a-old", "10.5.0.1", &[("pod", "a")]);
    let out = compile(&[first, second], &[], &[np]);
    assert_eq!(&*out.model.pods[&ip("10.5.0.1")].pod.name, "a-old");
    assert_eq!(out.model.pods[&ip("10.5.0.1")].ingress, Isolation::NotIsolated);
}

#[test]
fn sidecar_init_container_ports_count_for_named_ports() {
    let mut with_sidecar = pod_with_ports("x", "a", &["10.6.0.1"], &[], json!([]));
    let sidecar = serde_json::from_value(json!({
        "name": "proxy", "restartPolicy": "Always",
        "ports": [{"name": "proxy", "containerPort": 15001}]
    }))
    .expect("container JSON");
    if let Some(spec) = with_sidecar.spec.as_mut() {
        spec.init_containers = Some(vec![sidecar]);
    }
    let np = policy("x", "p", json!({"podSelector": {}, "ingress": [{"ports": [{"port": "proxy"}]}]}));
    let out = compile(&[with_sidecar], &[], &[np]);
    assert!(allows(&out.model, ip("10.7.0.1"), ip("10.6.0.1"), Protocol::Tcp, 15001));
}
