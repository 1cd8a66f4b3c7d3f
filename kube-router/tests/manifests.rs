//! The manifests parse as real Kubernetes objects and grant exactly what the agent needs.
use std::collections::BTreeSet;

use k8s_openapi::api::{
    apps::v1::DaemonSet,
    core::v1::{ConfigMap, ServiceAccount},
    rbac::v1::{ClusterRole, ClusterRoleBinding},
};
use kube_router::k8s::watch::WATCHED_RESOURCES;
use serde::Deserialize;

#[derive(Default)]
struct Manifests {
    daemon_sets: Vec<DaemonSet>,
    roles: Vec<ClusterRole>,
    bindings: Vec<ClusterRoleBinding>,
    service_accounts: Vec<ServiceAccount>,
    config_maps: Vec<ConfigMap>,
}

fn load() -> Manifests {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../manifests/kube-router.yaml")).unwrap();
    let mut m = Manifests::default();
    for doc in serde_yaml::Deserializer::from_str(&text) {
        let value = serde_json::to_value(serde_yaml::Value::deserialize(doc).unwrap()).unwrap();
        let kind = value["kind"].as_str().unwrap().to_string();
        match kind.as_str() {
            "DaemonSet" => m.daemon_sets.push(serde_json::from_value(value).unwrap()),
            "ClusterRole" => m.roles.push(serde_json::from_value(value).unwrap()),
            "ClusterRoleBinding" => m.bindings.push(serde_json::from_value(value).unwrap()),
            "ServiceAccount" => m.service_accounts.push(serde_json::from_value(value).unwrap()),
            "ConfigMap" => m.config_maps.push(serde_json::from_value(value).unwrap()),
            other => panic!("unexpected kind {other}"),
        }
    }
    m
}

#[test]
fn rbac_grants_list_and_watch_on_exactly_the_watched_resources() {
    let m = load();
    assert_eq!(m.roles.len(), 1);
    let mut granted = BTreeSet::new();
    for rule in m.roles[0].rules.iter().flatten() {
        let verbs: BTreeSet<&str> = rule.verbs.iter().map(String::as_str).collect();
        assert_eq!(verbs, BTreeSet::from(["list", "watch"]), "only read access: {rule:?}");
        for group in rule.api_groups.iter().flatten() {
            for resource in rule.resources.iter().flatten() {
                granted.insert((group.clone(), resource.clone()));
            }
        }
    }
    let watched: BTreeSet<(String, String)> =
        WATCHED_RESOURCES.iter().map(|(g, r)| (g.to_string(), r.to_string())).collect();
    assert_eq!(granted, watched);
    let binding = &m.bindings[0];
    assert_eq!(binding.role_ref.name, "kube-router");
    let subject = &binding.subjects.as_ref().unwrap()[0];
    assert_eq!(Some(subject.name.as_str()), m.service_accounts[0].metadata.name.as_deref());
}

#[test]
fn daemonset_runs_on_every_node_with_pinned_state_that_outlives_the_pod() {
    let m = load();
    let spec = m.daemon_sets[0].spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    assert_eq!(spec.host_network, Some(true));
    assert!(spec.tolerations.iter().flatten().any(|t| t.operator.as_deref() == Some("Exists") && t.key.is_none()));
    let container = &spec.containers[0];
    assert_eq!(container.security_context.as_ref().unwrap().privileged, Some(true));
    let mounts = container.volume_mounts.as_ref().unwrap();
    let bpffs = mounts.iter().find(|v| v.mount_path == "/sys/fs/bpf").expect("bpffs mounted");
    assert_eq!(bpffs.mount_propagation.as_deref(), Some("Bidirectional"));
    assert!(mounts.iter().any(|v| v.mount_path == "/var/lib/kube-router"), "checkpoint directory");
    assert!(mounts.iter().any(|v| v.mount_path == "/lib/modules" && v.read_only == Some(true)));
    let liveness = container.liveness_probe.as_ref().unwrap().http_get.as_ref().unwrap();
    assert_eq!(liveness.path.as_deref(), Some("/healthz"));
    let config = m.config_maps[0].data.as_ref().unwrap();
    assert!(config.keys().all(|k| k.starts_with("KUBE_ROUTER_")));
}
