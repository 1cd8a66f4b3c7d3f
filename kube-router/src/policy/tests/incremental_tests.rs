//! Behaviour of the incremental compiler on single operations.

use serde_json::json;

use super::fixtures::{ip, namespace, pod, policy, Cluster};
use crate::k8s::pod::SlimPod;
use crate::policy::{allows, compile, Isolation, PodSetChange, PolicyCompiler, Protocol};

fn compiler_for(cluster: &Cluster, policies: &[k8s_openapi::api::networking::v1::NetworkPolicy]) -> PolicyCompiler {
    PolicyCompiler::from_snapshot(&cluster.pods, &cluster.namespaces, policies)
}

fn allow_from_b() -> k8s_openapi::api::networking::v1::NetworkPolicy {
    policy(
        "x",
        "from-b",
        json!({"podSelector": {}, "ingress": [{"from": [{"podSelector": {"matchLabels": {"pod": "b"}}}]}]}),
    )
}

#[test]
fn snapshot_matches_full_compile() {
    let cluster = Cluster::xyz();
    let policies = [allow_from_b()];
    let compiler = compiler_for(&cluster, &policies);
    assert_eq!(compiler.output(), cluster.compile(&policies));
}

/// An update of nothing the compiler reads (a newer version, a readiness flip) changes nothing,
/// yet the compiler lets go of its old copy for the caller's (the store's): one copy per pod.
#[test]
fn an_update_of_nothing_read_changes_nothing_but_shares_the_new_copy() {
    let cluster = Cluster::xyz();
    let mut compiler = compiler_for(&cluster, &[allow_from_b()]);
    let before = compiler.output();
    let first = std::sync::Arc::new(SlimPod::from(&pod("x", "c", "10.0.1.3", &[("pod", "c")])));
    compiler.upsert_pod(&first);
    let mut newer = pod("x", "c", "10.0.1.3", &[("pod", "c")]);
    newer.metadata.resource_version = Some("7".into());
    let second = std::sync::Arc::new(SlimPod::from(&newer));
    let delta = compiler.upsert_pod(&second);
    assert_eq!(delta.pods_recomputed, 0);
    assert!(delta.pods.is_empty() && delta.pod_sets.is_empty());
    assert_eq!(compiler.output(), before);
    assert_eq!(std::sync::Arc::strong_count(&first), 1, "the old copy let go");
    // Held here, in the compiler's pods and in its address's claim: pointers to the one copy.
    assert_eq!(std::sync::Arc::strong_count(&second), 3, "the new copy held");
}

#[test]
fn pod_label_change_touches_only_that_pod_and_set_membership() {
    let cluster = Cluster::xyz();
    let mut compiler = compiler_for(&cluster, &[allow_from_b()]);
    assert!(!allows(compiler.model(), ip("10.0.1.3"), ip("10.0.1.1"), Protocol::Tcp, 80));

    // x/c becomes a "b": it gains access to all of x, without recompiling x/a or x/b.
    let delta = compiler.upsert_pod(&pod("x", "c", "10.0.1.3", &[("pod", "b")]));
    assert_eq!(delta.pods_recomputed, 1);
    assert!(delta.pods.is_empty(), "x/c's own rules are unchanged: {:?}", delta.pods);
    assert_eq!(delta.pod_sets.len(), 1);
    let change = delta.pod_sets.values().next().cloned();
    assert_eq!(change, Some(PodSetChange::Updated { added: [ip("10.0.1.3")].into(), removed: Default::default() }));
    assert!(allows(compiler.model(), ip("10.0.1.3"), ip("10.0.1.1"), Protocol::Tcp, 80));
}

#[test]
fn pod_moving_into_a_selected_set_of_a_policy_recomputes_it() {
    let cluster = Cluster::xyz();
    let target_a = policy("y", "a", json!({"podSelector": {"matchLabels": {"pod": "a"}}}));
    let mut compiler = compiler_for(&cluster, &[target_a]);
    let delta = compiler.upsert_pod(&pod("y", "b", "10.0.2.2", &[("pod", "a")]));
    assert_eq!(delta.pods.len(), 1);
    assert!(matches!(&delta.pods[&ip("10.0.2.2")], Some(rules) if rules.ingress == Isolation::Isolated(vec![])));
}

#[test]
fn namespace_label_change_updates_membership_only() {
    let cluster = Cluster::xyz();
    let np = policy(
        "x",
        "from-prod",
        json!({"podSelector": {}, "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"env": "prod"}}}]}]}),
    );
    let mut compiler = compiler_for(&cluster, &[np]);
    assert!(!allows(compiler.model(), ip("10.0.3.1"), ip("10.0.1.1"), Protocol::Tcp, 80));
    let delta = compiler.upsert_namespace(&namespace("z", &[("ns", "z"), ("env", "prod")]));
    assert!(delta.pods.is_empty());
    assert_eq!(delta.pods_recomputed, 0);
    let Some(PodSetChange::Updated { added, removed }) = delta.pod_sets.values().next() else {
        panic!("expected a membership update, got {delta:?}");
    };
    assert_eq!(added.len(), 3);
    assert!(removed.is_empty());
    assert!(allows(compiler.model(), ip("10.0.3.1"), ip("10.0.1.1"), Protocol::Tcp, 80));
    let delta = compiler.delete_namespace("z");
    assert!(
        matches!(delta.pod_sets.values().next(), Some(PodSetChange::Updated { removed, .. }) if removed.len() == 3)
    );
}

#[test]
fn deleting_a_policy_unisolates_and_drops_its_sets() {
    let cluster = Cluster::xyz();
    let mut compiler = compiler_for(&cluster, &[allow_from_b()]);
    let delta = compiler.delete_policy("x", "from-b");
    assert_eq!(delta.pods.len(), 3);
    assert!(delta.pods.values().all(|rules| matches!(rules, Some(r) if r.ingress == Isolation::NotIsolated)));
    assert!(delta.pod_sets.values().all(|c| *c == PodSetChange::Removed));
    assert!(compiler.model().pod_sets.is_empty());
}

#[test]
fn invalid_policy_update_is_reported_and_the_policy_skipped() {
    let cluster = Cluster::xyz();
    let mut compiler = compiler_for(&cluster, &[allow_from_b()]);
    let broken = policy("x", "from-b", json!({"podSelector": {}, "ingress": [{"ports": [{"port": 0}]}]}));
    let delta = compiler.upsert_policy(&broken);
    assert_eq!(delta.policy_errors.len(), 1);
    assert_eq!(compiler.skipped_policy_count(), 1);
    // Same as compiling the final inputs from scratch.
    assert_eq!(compiler.output(), cluster.compile(&[broken]));
    // Fixing it clears the error.
    compiler.upsert_policy(&allow_from_b());
    assert_eq!(compiler.skipped_policy_count(), 0);
}

#[test]
fn deleting_a_pod_removes_its_entry_and_memberships() {
    let cluster = Cluster::xyz();
    let mut compiler = compiler_for(&cluster, &[allow_from_b()]);
    let delta = compiler.delete_pod("x", "b");
    assert_eq!(delta.pods.get(&ip("10.0.1.2")), Some(&None));
    assert!(
        matches!(delta.pod_sets.values().next(), Some(PodSetChange::Updated { removed, .. }) if removed.contains(&ip("10.0.1.2")))
    );
    assert!(!compiler.model().pods.contains_key(&ip("10.0.1.2")));
    // Re-sending an identical object is a no-op.
    let again = compiler.upsert_pod(&cluster.pods[0]);
    assert!(again.is_empty());
}

#[test]
fn deltas_applied_to_a_copy_reproduce_the_model() {
    let cluster = Cluster::xyz();
    let mut compiler = compiler_for(&cluster, &[]);
    let mut mirror = compiler.model().clone();
    for delta in [
        compiler.upsert_policy(&allow_from_b()),
        compiler.upsert_pod(&pod("x", "d", "10.0.1.4", &[("pod", "b")])),
        compiler.delete_pod("x", "b"),
    ] {
        delta.apply_to(&mut mirror);
    }
    assert_eq!(&mirror, compiler.model());
    let mut pods = cluster.pods.clone();
    pods.retain(|p| p.metadata.name.as_deref() != Some("b") || p.metadata.namespace.as_deref() != Some("x"));
    pods.push(pod("x", "d", "10.0.1.4", &[("pod", "b")]));
    assert_eq!(compiler.output(), compile(&pods, &cluster.namespaces, &[allow_from_b()]));
}

#[test]
fn ip_takeover_by_a_pod_without_named_ports_updates_egress_named_port_rules() {
    use super::fixtures::pod_with_ports;
    let client = pod_with_ports("x", "client", &["10.8.0.9"], &[("app", "client")], json!([]));
    let web = pod_with_ports("x", "z-web", &["10.8.0.1"], &[], json!([{"name": "http", "containerPort": 8080}]));
    let np = policy(
        "x",
        "to-http",
        json!({"podSelector": {"matchLabels": {"app": "client"}}, "policyTypes": ["Egress"],
               "egress": [{"ports": [{"port": "http"}]}]}),
    );
    let mut compiler = PolicyCompiler::from_snapshot(
        &[client.clone(), web.clone()],
        &[] as &[k8s_openapi::api::core::v1::Namespace],
        std::slice::from_ref(&np),
    );
    assert!(allows(compiler.model(), ip("10.8.0.9"), ip("10.8.0.1"), Protocol::Tcp, 8080));
    // A pod sorting before z-web claims the same IP and becomes its owner.
    let squatter = pod_with_ports("x", "a-plain", &["10.8.0.1"], &[], json!([]));
    compiler.upsert_pod(&squatter);
    let expected = compile(&[client, web, squatter], &[], &[np]);
    assert_eq!(compiler.output(), expected);
    assert!(!allows(compiler.model(), ip("10.8.0.9"), ip("10.8.0.1"), Protocol::Tcp, 8080));
}
