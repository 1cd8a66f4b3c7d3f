//! Property: any sequence of incremental operations ends in exactly the
//! state a from-scratch compile of the final inputs gives, and the deltas,
//! applied in order, reproduce that state.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use proptest::prelude::*;
use serde_json::{json, Value};

use super::fixtures::{namespace, pod_with_ports, policy};
use crate::policy::{compile, Delta, PolicyCompiler};

const NAMESPACES: [&str; 3] = ["x", "y", "z"];
const POD_NAMES: [&str; 4] = ["a", "b", "c", "d"];
const POLICY_NAMES: [&str; 3] = ["p1", "p2", "p3"];

/// Small deterministic generator so one random seed describes one object.
struct Dice(u64);

impl Dice {
    fn roll(&mut self, sides: u64) -> u64 {
        // splitmix64
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)) % sides.max(1)
    }

    fn pick<T: Clone>(&mut self, items: &[T]) -> T {
        items[self.roll(items.len() as u64) as usize].clone()
    }
}

fn make_pod(namespace: &str, name: &str, seed: u64) -> Pod {
    let mut dice = Dice(seed);
    // A small IP pool so pods collide and move between IPs.
    let v4 = format!("10.0.0.{}", dice.roll(8) + 1);
    let mut ips = vec![v4];
    if dice.roll(3) == 0 {
        ips.push(format!("fd00::{}", dice.roll(3) + 1));
    }
    let mut labels = Vec::new();
    if let Some(v) = dice.pick(&[Some("a"), Some("b"), Some("c"), None]) {
        labels.push(("pod", v));
    }
    if let Some(v) = dice.pick(&[Some("fe"), Some("be"), None]) {
        labels.push(("tier", v));
    }
    let ports = dice.pick(&[
        json!([]),
        json!([{"name": "http", "containerPort": 81}]),
        json!([{"name": "http", "containerPort": 80}]),
        json!([{"name": "http", "containerPort": 8080}, {"name": "dns", "containerPort": 53, "protocol": "UDP"}]),
        json!([{"name": "dns", "containerPort": 5353, "protocol": "UDP"}]),
    ]);
    let ip_refs: Vec<&str> = ips.iter().map(String::as_str).collect();
    let mut pod = pod_with_ports(namespace, name, &ip_refs, &labels, ports);
    if dice.roll(8) == 0 {
        if let Some(status) = pod.status.as_mut() {
            status.phase = Some("Succeeded".into());
        }
    }
    pod.spec.get_or_insert_default().node_name = Some(dice.pick(&[NODE, "node-b"]).to_string());
    pod
}

/// The node of the compilers scoped to one node's pods.
const NODE: &str = "node-a";

fn make_namespace(name: &str, seed: u64) -> Namespace {
    let mut dice = Dice(seed);
    let mut labels = vec![("ns", name)];
    if let Some(env) = dice.pick(&[Some("prod"), Some("dev"), None]) {
        labels.push(("env", env));
    }
    namespace(name, &labels)
}

fn selector(dice: &mut Dice) -> Value {
    dice.pick(&[
        json!({}),
        json!({"matchLabels": {"pod": "a"}}),
        json!({"matchLabels": {"pod": "b"}}),
        json!({"matchExpressions": [{"key": "tier", "operator": "In", "values": ["fe"]}]}),
        json!({"matchExpressions": [{"key": "pod", "operator": "NotIn", "values": ["a"]}]}),
        json!({"matchExpressions": [{"key": "tier", "operator": "DoesNotExist"}]}),
    ])
}

fn namespace_selector(dice: &mut Dice) -> Value {
    dice.pick(&[
        json!({}),
        json!({"matchLabels": {"env": "prod"}}),
        json!({"matchLabels": {"ns": "y"}}),
        json!({"matchExpressions": [{"key": "env", "operator": "Exists"}]}),
    ])
}

fn peer(dice: &mut Dice) -> Value {
    match dice.roll(5) {
        0 => json!({"podSelector": selector(dice)}),
        1 => json!({"namespaceSelector": namespace_selector(dice)}),
        2 => json!({"podSelector": selector(dice), "namespaceSelector": namespace_selector(dice)}),
        3 => dice.pick(&[
            json!({"ipBlock": {"cidr": "10.0.0.0/29", "except": ["10.0.0.4/30"]}}),
            json!({"ipBlock": {"cidr": "fd00::/126"}}),
            json!({"ipBlock": {"cidr": "10.0.0.0/24", "except": ["10.1.0.0/24"]}}), // invalid
        ]),
        _ => json!({"namespaceSelector": {}}),
    }
}

fn port(dice: &mut Dice) -> Value {
    dice.pick(&[
        json!({"port": 80}),
        json!({"port": "http"}),
        json!({"port": "http"}),
        json!({"port": "dns", "protocol": "UDP"}),
        json!({"port": "dns", "protocol": "UDP"}),
        json!({"port": 81, "endPort": 90}),
        json!({"protocol": "UDP"}),
        json!({"port": 0}), // invalid
    ])
}

fn rules(dice: &mut Dice, peers_field: &str) -> Value {
    let count = dice.roll(3);
    let mut rules = Vec::new();
    for _ in 0..count {
        let mut rule = serde_json::Map::new();
        let peer_count = dice.roll(3);
        if peer_count > 0 || dice.roll(2) == 0 {
            rule.insert(peers_field.into(), Value::Array((0..peer_count).map(|_| peer(dice)).collect()));
        }
        let port_count = dice.roll(3);
        if port_count > 0 {
            rule.insert("ports".into(), Value::Array((0..port_count).map(|_| port(dice)).collect()));
        }
        rules.push(Value::Object(rule));
    }
    Value::Array(rules)
}

fn make_policy(namespace: &str, name: &str, seed: u64) -> NetworkPolicy {
    let mut dice = Dice(seed);
    let mut spec = serde_json::Map::new();
    spec.insert("podSelector".into(), selector(&mut dice));
    match dice.roll(4) {
        0 => {}
        1 => {
            spec.insert("policyTypes".into(), json!(["Ingress"]));
        }
        2 => {
            spec.insert("policyTypes".into(), json!(["Egress"]));
        }
        _ => {
            spec.insert("policyTypes".into(), json!(["Ingress", "Egress"]));
        }
    }
    if dice.roll(4) != 0 {
        spec.insert("ingress".into(), rules(&mut dice, "from"));
    }
    if dice.roll(3) != 0 {
        spec.insert("egress".into(), rules(&mut dice, "to"));
    }
    policy(namespace, name, Value::Object(spec))
}

#[derive(Debug, Clone)]
enum Op {
    UpsertPod(usize, usize, u64),
    DeletePod(usize, usize),
    UpsertNamespace(usize, u64),
    DeleteNamespace(usize),
    UpsertPolicy(usize, usize, u64),
    DeletePolicy(usize, usize),
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..3usize, 0..4usize, any::<u64>()).prop_map(|(n, p, s)| Op::UpsertPod(n, p, s)),
        1 => (0..3usize, 0..4usize).prop_map(|(n, p)| Op::DeletePod(n, p)),
        2 => (0..3usize, any::<u64>()).prop_map(|(n, s)| Op::UpsertNamespace(n, s)),
        1 => (0..3usize).prop_map(Op::DeleteNamespace),
        3 => (0..3usize, 0..3usize, any::<u64>()).prop_map(|(n, p, s)| Op::UpsertPolicy(n, p, s)),
        1 => (0..3usize, 0..3usize).prop_map(|(n, p)| Op::DeletePolicy(n, p)),
    ]
}

/// The objects the operations so far leave: what a compile from scratch is given.
#[derive(Default)]
struct Inputs {
    pods: BTreeMap<(usize, usize), Pod>,
    namespaces: BTreeMap<usize, Namespace>,
    policies: BTreeMap<(usize, usize), NetworkPolicy>,
}

impl Inputs {
    /// Records `op` and applies it to each compiler; returns each compiler's delta.
    fn apply<const N: usize>(&mut self, op: &Op, compilers: [&mut PolicyCompiler; N]) -> [Delta; N] {
        match *op {
            Op::UpsertPod(n, p, seed) => {
                let pod = make_pod(NAMESPACES[n], POD_NAMES[p], seed);
                self.pods.insert((n, p), pod.clone());
                compilers.map(|c| c.upsert_pod(&pod))
            }
            Op::DeletePod(n, p) => {
                self.pods.remove(&(n, p));
                compilers.map(|c| c.delete_pod(NAMESPACES[n], POD_NAMES[p]))
            }
            Op::UpsertNamespace(n, seed) => {
                let ns = make_namespace(NAMESPACES[n], seed);
                self.namespaces.insert(n, ns.clone());
                compilers.map(|c| c.upsert_namespace(&ns))
            }
            Op::DeleteNamespace(n) => {
                self.namespaces.remove(&n);
                compilers.map(|c| c.delete_namespace(NAMESPACES[n]))
            }
            Op::UpsertPolicy(n, p, seed) => {
                let np = make_policy(NAMESPACES[n], POLICY_NAMES[p], seed);
                self.policies.insert((n, p), np.clone());
                compilers.map(|c| c.upsert_policy(&np))
            }
            Op::DeletePolicy(n, p) => {
                self.policies.remove(&(n, p));
                compilers.map(|c| c.delete_policy(NAMESPACES[n], POLICY_NAMES[p]))
            }
        }
    }

    /// Pods, Namespaces and NetworkPolicies, as lists.
    fn lists(self) -> (Vec<Pod>, Vec<Namespace>, Vec<NetworkPolicy>) {
        (
            self.pods.into_values().collect(),
            self.namespaces.into_values().collect(),
            self.policies.into_values().collect(),
        )
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn incremental_equals_from_scratch(ops in prop::collection::vec(op_strategy(), 1..40)) {
        let mut compiler = PolicyCompiler::new();
        let mut mirror = compiler.model().clone();
        let mut inputs = Inputs::default();
        for op in &ops {
            let [delta] = inputs.apply(op, [&mut compiler]);
            delta.apply_to(&mut mirror);
            prop_assert_eq!(&mirror, compiler.model(), "deltas diverged after {:?}", op);
        }
        let (pods, namespaces, policies) = inputs.lists();
        let expected = compile(&pods, &namespaces, &policies);
        prop_assert_eq!(compiler.output(), expected);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// The flattener fed only each operation's changed pods and pod sets holds what a full
    /// flattening of the model decides, and the diffs it returns, applied in order, reproduce
    /// its entries exactly.
    #[test]
    fn incremental_flattening_equals_a_full_flattening(ops in prop::collection::vec(op_strategy(), 1..40)) {
        use std::collections::BTreeSet;
        use std::net::IpAddr;
        use crate::policy::flatten::{MapEntries, MapFlattener};
        use crate::policy::Protocol;
        let mut compiler = PolicyCompiler::new();
        let mut flattener = MapFlattener::new();
        let mut programmed = MapEntries::default();
        for op in &ops {
            let [delta] = Inputs::default().apply(op, [&mut compiler]);
            let sets: BTreeSet<_> = delta.pod_sets.keys().cloned().collect();
            let diff = flattener.update(compiler.model(), &delta.pods, &sets);
            for key in &diff.pod_slots.deletes { programmed.pod_slots.remove(key); }
            for key in &diff.slot_ports.deletes { programmed.slot_ports.remove(key); }
            for key in &diff.peer_prefixes.deletes { programmed.peer_prefixes.remove(key); }
            programmed.pod_slots.extend(diff.pod_slots.upserts);
            programmed.slot_ports.extend(diff.slot_ports.upserts);
            programmed.peer_prefixes.extend(diff.peer_prefixes.upserts);
            prop_assert_eq!(&programmed, flattener.entries(), "diffs diverged after {:?}", op);

            let full = MapFlattener::new().flatten(compiler.model());
            let mut addresses: Vec<IpAddr> = compiler.model().pods.keys().copied().collect();
            addresses.extend(["10.0.0.2", "10.0.0.5", "192.0.2.1", "fd00::1"].map(|a| a.parse::<IpAddr>().unwrap()));
            for src in &addresses {
                for dst in &addresses {
                    for (protocol, port) in [(Protocol::Tcp, 80), (Protocol::Tcp, 85), (Protocol::Udp, 53), (Protocol::Udp, 9), (Protocol::Tcp, 8080)] {
                        prop_assert_eq!(
                            programmed.allows(*src, *dst, protocol, port),
                            full.allows(*src, *dst, protocol, port),
                            "{} -> {}:{} {} after {:?}", src, dst, port, protocol, op
                        );
                    }
                }
            }
        }
        // A full flattening by the same flattener keeps every id: nothing to write.
        let mut again = flattener.clone();
        prop_assert!(programmed.diff(&again.flatten(compiler.model())).is_empty());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// A compiler scoped to one node's pods (what the agent runs) holds exactly the entries of
    /// the IPs those pods claim, as an unscoped compiler computes them, and exactly the pod
    /// sets these entries name, with the same members; its deltas reproduce its model; and it
    /// ends where a scoped compile of the final inputs does.
    #[test]
    fn a_compiler_scoped_to_one_node_holds_that_nodes_part_of_the_whole(ops in prop::collection::vec(op_strategy(), 1..40)) {
        use std::collections::BTreeSet;
        use std::net::IpAddr;
        use crate::policy::parse::PodInfo;
        let mut whole = PolicyCompiler::new();
        let mut scoped = PolicyCompiler::on_node(NODE);
        let mut mirror = scoped.model().clone();
        let mut inputs = Inputs::default();
        for op in &ops {
            let [_, delta] = inputs.apply(op, [&mut whole, &mut scoped]);
            delta.apply_to(&mut mirror);
            prop_assert_eq!(&mirror, scoped.model(), "deltas diverged after {:?}", op);
            let local: BTreeSet<IpAddr> = inputs
                .pods
                .values()
                .filter_map(PodInfo::from_pod)
                .filter(|info| info.node() == Some(NODE))
                .flat_map(|info| info.ips().to_vec())
                .collect();
            let mut expected = whole.model().clone();
            expected.pods.retain(|ip, _| local.contains(ip));
            let named: BTreeSet<_> = expected.pods.values().flat_map(|rules| rules.referenced_pod_sets()).cloned().collect();
            expected.pod_sets.retain(|key, _| named.contains(key));
            prop_assert_eq!(&expected, scoped.model(), "not the node's part after {:?}", op);
        }
        let (pods, namespaces, policies) = inputs.lists();
        let fresh = PolicyCompiler::from_snapshot_on(Some(NODE), &pods, &namespaces, &policies);
        prop_assert_eq!(scoped.output(), fresh.output());
    }
}
