//! Object builders and probe helpers shared by the tests.

use std::net::IpAddr;

use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use serde_json::{json, Value};

use crate::policy::flatten::MapFlattener;
use crate::policy::{allows, compile, CompileOutput, Protocol};

pub fn ip(text: &str) -> IpAddr {
    text.parse().expect("test IP literal")
}

fn labels_json(labels: &[(&str, &str)]) -> Value {
    Value::Object(labels.iter().map(|(k, v)| (k.to_string(), Value::String(v.to_string()))).collect())
}

/// Ports every test pod serves, named like the upstream e2e pods.
pub fn standard_ports() -> Value {
    json!([
        {"name": "serve-80-tcp", "containerPort": 80, "protocol": "TCP"},
        {"name": "serve-81-tcp", "containerPort": 81},
        {"name": "serve-53-udp", "containerPort": 53, "protocol": "UDP"}
    ])
}

/// A running pod with the given IPs (first is `podIP`), labels and ports.
pub fn pod_with_ports(namespace: &str, name: &str, ips: &[&str], labels: &[(&str, &str)], ports: Value) -> Pod {
    let pod_ips: Vec<Value> = ips.iter().map(|ip| json!({"ip": ip})).collect();
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"namespace": namespace, "name": name, "labels": labels_json(labels)},
        "spec": {"containers": [{"name": "c", "image": "agnhost", "ports": ports}]},
        "status": {"phase": "Running", "podIP": ips.first(), "podIPs": pod_ips}
    }))
    .expect("valid Pod JSON")
}

pub fn pod(namespace: &str, name: &str, ip: &str, labels: &[(&str, &str)]) -> Pod {
    pod_with_ports(namespace, name, &[ip], labels, standard_ports())
}

pub fn namespace(name: &str, labels: &[(&str, &str)]) -> Namespace {
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": name, "labels": labels_json(labels)}
    }))
    .expect("valid Namespace JSON")
}

/// A NetworkPolicy from its `spec` as JSON.
pub fn policy(namespace: &str, name: &str, spec: Value) -> NetworkPolicy {
    serde_json::from_value(json!({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"namespace": namespace, "name": name},
        "spec": spec
    }))
    .expect("valid NetworkPolicy JSON")
}

pub fn policy_yaml(yaml: &str) -> NetworkPolicy {
    serde_norway::from_str(yaml).expect("valid NetworkPolicy YAML")
}

/// The upstream e2e layout: namespaces x, y, z (label ns=<name>), each with
/// pods a, b, c (label pod=<name>), at 10.0.<1|2|3>.<1|2|3>.
pub struct Cluster {
    pub pods: Vec<Pod>,
    pub namespaces: Vec<Namespace>,
    /// (name "x/a", IP) in matrix order.
    pub probes: Vec<(String, IpAddr)>,
}

impl Cluster {
    pub fn xyz() -> Cluster {
        let mut cluster = Cluster { pods: Vec::new(), namespaces: Vec::new(), probes: Vec::new() };
        for (ns_index, ns) in ["x", "y", "z"].into_iter().enumerate() {
            cluster.namespaces.push(namespace(ns, &[("ns", ns)]));
            for (pod_index, name) in ["a", "b", "c"].into_iter().enumerate() {
                let address = format!("10.0.{}.{}", ns_index + 1, pod_index + 1);
                cluster.pods.push(pod(ns, name, &address, &[("pod", name)]));
                cluster.probes.push((format!("{ns}/{name}"), ip(&address)));
            }
        }
        cluster
    }

    pub fn compile(&self, policies: &[NetworkPolicy]) -> CompileOutput {
        compile(&self.pods, &self.namespaces, policies)
    }

    pub fn ip_of(&self, name: &str) -> IpAddr {
        self.probes.iter().find(|(n, _)| n == name).map(|(_, ip)| *ip).expect("known probe name")
    }
}

/// Renders the matrix of `allows` (rows: source, columns: destination;
/// `.` allowed, `X` blocked), the same notation as upstream's reachability.
pub fn probe_matrix(cluster: &Cluster, output: &CompileOutput, protocol: Protocol, port: u16) -> String {
    let mut text = String::from("   ");
    for (name, _) in &cluster.probes {
        text.push_str(&format!(" {name}"));
    }
    text.push('\n');
    for (src_name, src) in &cluster.probes {
        text.push_str(src_name);
        for (_, dst) in &cluster.probes {
            let mark = if allows(&output.model, *src, *dst, protocol, port) { '.' } else { 'X' };
            text.push_str(&format!("   {mark}"));
        }
        text.push('\n');
    }
    text
}

fn tokens(matrix: &str) -> Vec<Vec<String>> {
    matrix
        .lines()
        .map(|line| line.split_whitespace().map(str::to_string).collect::<Vec<_>>())
        .filter(|row| !row.is_empty())
        .collect()
}

/// Prints the probe matrix and asserts it equals `expected` (whitespace
/// insensitive). Also checks the flattened BPF maps decide identically.
pub fn assert_matrix(
    scenario: &str,
    cluster: &Cluster,
    output: &CompileOutput,
    protocol: Protocol,
    port: u16,
    expected: &str,
) {
    assert!(output.policy_errors.is_empty(), "{:?}", output.policy_errors);
    let actual = probe_matrix(cluster, output, protocol, port);
    println!("{scenario} {protocol}/{port}:\n{actual}");
    assert_eq!(
        tokens(&actual),
        tokens(expected),
        "{scenario} {protocol}/{port}: probe matrix differs.\nactual:\n{actual}\nexpected:\n{expected}"
    );
    let maps = MapFlattener::new().flatten(&output.model);
    for (src_name, src) in &cluster.probes {
        for (dst_name, dst) in &cluster.probes {
            assert_eq!(
                maps.allows(*src, *dst, protocol, port),
                allows(&output.model, *src, *dst, protocol, port),
                "{scenario}: flattened maps disagree on {src_name} -> {dst_name}"
            );
        }
    }
}
