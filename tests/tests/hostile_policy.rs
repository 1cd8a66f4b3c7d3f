//! Attacks on NetworkPolicy from inside the cluster: a pod crafting raw packets and frames (raw
//! IP and packet sockets, `krt-netprobe raw-ip` / `raw-frame`) at an isolated pod on the same
//! node, on the cluster harness (one node, three CNI-wired pods on its bridge). Each test is one
//! attack and its expected outcome; what arrives is counted by a raw or packet socket in the
//! receiving pod (`count-ip` / `count-frames`), so "0" means the receiving stack never got it.
//! As root, in network namespaces `krt-hp-*`.
use std::{
    thread,
    time::{Duration, Instant},
};

use kube_router_tests::cluster::{netprobe, wait_denied, wait_for, Cluster, Pod};
use serde_json::{json, Value};

const GRE: &str = "47";
const IPIP: &str = "4";
const EXPERIMENTAL: &str = "253";
/// How long a receiver listens: the packets are sent within its first half.
const LISTEN_SECONDS: &str = "1.5";

/// One node, pods pod-1-0 (the target), pod-1-1 (the attacker) and pod-1-2 (a peer some rules
/// admit on every port).
fn cluster(prefix: &str) -> Cluster {
    Cluster::builder(prefix).nodes(1).pods_per_node(3).build().unwrap()
}

fn policy(name: &str, spec: Value) -> Value {
    json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"namespace": "default", "name": name}, "spec": spec})
}

fn selector(pod: &str) -> Value {
    json!({"podSelector": {"matchLabels": {"pod": pod}}})
}

/// pod-1-0's ingress: TCP 8080 from pod-1-1, everything from pod-1-2 (a rule without ports).
/// Returns once pod-1-1's TCP 5353 is refused (the policy is programmed).
fn isolate_target_ingress(c: &Cluster) {
    c.server
        .apply(policy(
            "target-in",
            json!({"podSelector": {"matchLabels": {"pod": "pod-1-0"}}, "policyTypes": ["Ingress"],
                "ingress": [{"from": [selector("pod-1-1")], "ports": [{"port": 8080, "protocol": "TCP"}]},
                            {"from": [selector("pod-1-2")]}]}),
        ))
        .unwrap();
    wait_denied(&c.pod(0, 1).ns, &format!("{}:5353", c.pod(0, 0).ip)).unwrap();
}

/// Runs `count` (a `count-ip` or `count-frames` command) in `receiver` while `send` runs; what
/// it counted.
fn received(receiver: &Pod, count: &[&str], send: impl FnOnce()) -> usize {
    let netprobe_bin = kube_router_tests::netprobe_bin();
    let mut args = vec![netprobe_bin.to_str().unwrap()];
    args.extend_from_slice(count);
    let lines = receiver.ns.spawn_collecting(&args).unwrap();
    wait_for("the receiver's socket", || lines.lock().unwrap().iter().any(|l| l == "ready"));
    send();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(n) = lines.lock().unwrap().iter().find_map(|l| l.strip_prefix("count ")?.parse().ok()) {
            return n;
        }
        assert!(Instant::now() < deadline, "the receiver never reported: {:?}", lines.lock().unwrap());
        thread::sleep(Duration::from_millis(50));
    }
}

/// `proto` packets from `sender` to `receiver`'s address, counted in `receiver`.
fn raw_ip_received(sender: &Pod, receiver: &Pod, proto: &str) -> usize {
    received(receiver, &["count-ip", proto, LISTEN_SECONDS], || {
        let out = netprobe(&sender.ns, &["raw-ip", proto, &receiver.ip, "10"]);
        assert!(out.is_empty(), "raw-ip: {out}");
    })
}

/// The pod's eth0 MAC (`ip`: /sys/class/net would show the machine's own interfaces).
fn mac(pod: &Pod) -> String {
    let link = pod.ns.run(&["ip", "-o", "link", "show", "eth0"]).unwrap();
    link.split_once("link/ether ").and_then(|(_, rest)| rest.split_whitespace().next()).unwrap().to_string()
}

fn guard_metric(c: &Cluster, result: &str) -> f64 {
    c.node(0).metric("kube_router_policy_packets_total", &format!("result=\"{result}\""))
}

/// Guard: every IP protocol is judged for an isolated pod (parse_for_policy, evaluate). GRE,
/// IPIP and protocol 253 from a peer admitted on TCP 8080 only never reach pod-1-0; GRE from a
/// peer a rule without ports admits does.
#[test]
fn gre_ipip_and_protocol_253_do_not_reach_an_ingress_isolated_pod_but_a_rule_without_ports_admits_gre() {
    let c = cluster("krt-hp-in");
    let (target, attacker, admitted) = (c.pod(0, 0), c.pod(0, 1), c.pod(0, 2));
    // Not before the policy: a flow seen before it is tracked and goes on, as an established
    // connection does.
    isolate_target_ingress(&c);
    for proto in [GRE, IPIP, EXPERIMENTAL] {
        assert_eq!(raw_ip_received(attacker, target, proto), 0, "protocol {proto} reached the isolated pod");
    }
    assert!(raw_ip_received(admitted, target, GRE) > 0, "the rule without ports admits GRE");
    // 3 x 10 denied, and the first GRE packet of the admitted peer (the rest are tracked).
    wait_for("other_protocol_judged in /metrics", || guard_metric(&c, "other_protocol_judged") >= 31.0);
}

/// Guard: the same for an egress-isolated pod sending out. pod-1-1 may reach pod-1-0 on TCP 8080
/// only and pod-1-2 on every port: its GRE, IPIP and 253 to pod-1-0 never leave, GRE to pod-1-2
/// does.
#[test]
fn an_egress_isolated_pod_sends_no_gre_ipip_or_protocol_253_but_a_rule_without_ports_lets_gre_out() {
    let c = cluster("krt-hp-out");
    let (peer, isolated, admitted) = (c.pod(0, 0), c.pod(0, 1), c.pod(0, 2));
    c.server
        .apply(policy(
            "attacker-out",
            json!({"podSelector": {"matchLabels": {"pod": "pod-1-1"}}, "policyTypes": ["Egress"],
                "egress": [{"to": [selector("pod-1-0")], "ports": [{"port": 8080, "protocol": "TCP"}]},
                           {"to": [selector("pod-1-2")]}]}),
        ))
        .unwrap();
    wait_denied(&isolated.ns, &format!("{}:5353", peer.ip)).unwrap();
    for proto in [GRE, IPIP, EXPERIMENTAL] {
        assert_eq!(raw_ip_received(isolated, peer, proto), 0, "protocol {proto} left the egress-isolated pod");
    }
    assert!(raw_ip_received(isolated, admitted, GRE) > 0, "the rule without ports lets GRE out");
}

/// `tags` (see netprobe `raw-frame`) around IPv4 protocol 253 from `sender` to `receiver`,
/// counted by a raw socket in `receiver`.
fn tagged_received(sender: &Pod, receiver: &Pod, tags: &str) -> usize {
    received(receiver, &["count-ip", EXPERIMENTAL, LISTEN_SECONDS], || {
        let out = netprobe(
            &sender.ns,
            &["raw-frame", "eth0", &mac(receiver), tags, "0800", &sender.ip, &receiver.ip, EXPERIMENTAL, "10"],
        );
        assert!(out.is_empty(), "raw-frame: {out}");
    })
}

/// Guard: VLAN-tagged frames are dropped on pod veths (enforce: the skb's tag, 802.1Q/802.1ad
/// ethertypes). An 802.1ad + 802.1Q frame, both VLAN id 0, around IPv4: the host veth's receive
/// path takes the outer tag off before TC, leaving the inner tag's ethertype, and the receiving
/// pod's stack strips both priority tags and delivers the IPv4 packet; without the guard the
/// policy never judged it (checked: 10 of 10 delivered). A single priority tag from the admitted
/// peer is dropped as well: no pod has a VLAN.
#[test]
fn stacked_vlan_tags_around_ipv4_do_not_reach_an_isolated_pod() {
    let c = cluster("krt-hp-vlan");
    let (target, attacker, admitted) = (c.pod(0, 0), c.pod(0, 1), c.pod(0, 2));
    isolate_target_ingress(&c);
    assert!(tagged_received(admitted, target, "-") > 0, "untagged protocol 253 from the admitted peer");
    assert_eq!(tagged_received(attacker, target, "88a8,8100"), 0, "stacked VLAN tags around IPv4 got through");
    assert_eq!(tagged_received(admitted, target, "8100"), 0, "a priority-tagged frame got through");
    wait_for("drop_vlan in /metrics", || guard_metric(&c, "drop_vlan") >= 20.0);
}

/// Guard: frames of an ethertype other than IPv4, IPv6 and ARP never reach a pod (enforce's
/// DROP_UNKNOWN_L3), isolated or not: pod-1-2, under no policy, receives none either.
#[test]
fn frames_of_a_non_ip_ethertype_do_not_reach_a_pod() {
    let c = cluster("krt-hp-l3");
    let (target, attacker, bystander) = (c.pod(0, 0), c.pod(0, 1), c.pod(0, 2));
    isolate_target_ingress(&c);
    for receiver in [target, bystander] {
        let n = received(receiver, &["count-frames", "eth0", "88b5", LISTEN_SECONDS], || {
            let out = netprobe(&attacker.ns, &["raw-frame", "eth0", &mac(receiver), "-", "88b5", "-", "-", "-", "10"]);
            assert!(out.is_empty(), "raw-frame: {out}");
        });
        assert_eq!(n, 0, "ethertype 0x88b5 reached {}", receiver.name);
    }
    wait_for("drop_unknown_l3 in /metrics", || guard_metric(&c, "drop_unknown_l3") >= 20.0);
}
