//! Benchmark (root): per-packet cost of `kr_pol_ingress` (a pod's egress policy, judged at the
//! TC ingress of its veth) with BPF_PROG_TEST_RUN, for models of 1, 100 and 10,000 rules. Each
//! figure is also given as a ratio against the conntrack-hit baseline measured in the same run.
//!
//! What scales how — read this before the numbers:
//! * A packet of an established connection costs one `pol_ct_v4` lookup whatever the model.
//! * A new flow costs one `pol_pods_v4` lookup, one `pol_ports` LPM lookup (the pod's slot,
//!   protocol and port: which peers those ports admit, all rules merged) and one `pol_peers_v4`
//!   LPM lookup, whatever the number of policies, rules, peers and port ranges (layout 2 scanned
//!   up to 64 rules, and denied pods with more). The model size enters only through the LPM walk
//!   (the kernel's trie descends one node per branching point on the key's path, about log2 of
//!   the prefixes for dense /32s) and cache misses in bigger maps. "10,000 rules" is 200 pods x
//!   50 rules (10,000 /32 peer prefixes), "100 rules" 2 pods x 50 rules, "1 rule" one pod with
//!   one rule; "1,000 policies" is one pod selected by 1,000 policies of 10 peers each on 100
//!   port ranges (10,000 peers), the shape the issue asked to stay within 2x of one rule.
//! * The allow probe's peer is in the pod's last rule, the deny probe's peer in none; with the
//!   port index both cost the same two lookups (the columns keep their layout-2 names).
//! * Allowed new flows also insert a `pol_ct_v4` entry, so every allow probe must be a new flow:
//!   they are timed one run per packet (distinct source ports), which includes the kernel's
//!   per-run timing overhead; the "established, one run per packet" line is measured the same way
//!   and is the fair baseline for them. Deny probes insert nothing and are repeated.
#[path = "../tests/common/test_run.rs"]
mod test_run;
use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::Path,
    time::Instant,
};
use test_run::{packet, run};

use k8s_openapi::api::{
    core::v1::{Namespace, Pod},
    networking::v1::NetworkPolicy,
};
use kube_router::policy::maps::{apply_diff, BpfPolicyMaps};
use kube_router::{
    bpf::datapath::{self, Datapath, Hook},
    policy::{
        compile,
        flatten::{MapEntries, MapFlattener},
    },
};
use serde_json::json;

const REPEAT: u32 = 200_000;
const NEW_FLOWS: u16 = 20_000;
const RULES_PER_POD: usize = 50;

/// Pod `index`'s address: 10.10.x.y, or fd00:10::index for the IPv6 model.
fn pod_ip(index: usize, ipv6: bool) -> IpAddr {
    if ipv6 {
        IpAddr::V6(Ipv6Addr::from((0xfd00_0010_u128 << 96) + index as u128))
    } else {
        IpAddr::V4(Ipv4Addr::new(10, 10, (index / 256) as u8, (index % 256) as u8))
    }
}

/// The peer address of rule `rule` of pod `pod`: one host prefix per rule in the whole model.
fn peer_ip(pod: usize, rule: usize, ipv6: bool) -> IpAddr {
    let n = pod * RULES_PER_POD + rule;
    if ipv6 {
        IpAddr::V6(Ipv6Addr::from((0xfd00_0172_u128 << 96) + n as u128))
    } else {
        IpAddr::V4(Ipv4Addr::from(u32::from(Ipv4Addr::new(172, 16, 0, 0)) + n as u32))
    }
}

fn host_prefix(ip: IpAddr) -> String {
    format!("{ip}/{}", if ip.is_ipv6() { 128 } else { 32 })
}

/// `pods` pods in namespace "bench", each egress-isolated by its own policy allowing
/// `rules_per_pod` ipBlock host-prefix peers (one compiled rule each); all IPv4 or all IPv6.
fn model(pods: usize, rules_per_pod: usize, ipv6: bool) -> (Vec<Pod>, Vec<Namespace>, Vec<NetworkPolicy>) {
    let namespace: Namespace = serde_json::from_value(json!({"apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": "bench", "labels": {"ns": "bench"}}}))
    .unwrap();
    let mut pod_objects = Vec::new();
    let mut policies = Vec::new();
    for i in 0..pods {
        pod_objects.push(
            serde_json::from_value(json!({"apiVersion": "v1", "kind": "Pod",
                "metadata": {"namespace": "bench", "name": format!("pod-{i}"), "labels": {"app": format!("pod-{i}")}},
                "spec": {"containers": [{"name": "c", "image": "agnhost"}]},
                "status": {"phase": "Running", "podIP": pod_ip(i, ipv6).to_string(), "podIPs": [{"ip": pod_ip(i, ipv6).to_string()}]}}))
            .unwrap(),
        );
        let to: Vec<_> =
            (0..rules_per_pod).map(|r| json!({"ipBlock": {"cidr": host_prefix(peer_ip(i, r, ipv6))}})).collect();
        policies.push(
            serde_json::from_value(json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                "metadata": {"namespace": "bench", "name": format!("egress-{i}")},
                "spec": {"podSelector": {"matchLabels": {"app": format!("pod-{i}")}},
                         "policyTypes": ["Egress"], "egress": [{"to": to}]}}))
            .unwrap(),
        );
    }
    (pod_objects, vec![namespace], policies)
}

/// One pod ("pod-0") egress-isolated by 1,000 policies, policy `i` allowing 10 host-prefix peers
/// on TCP ports `scale_port(i)..=+4` (100 distinct ranges). Returns the objects and the probe:
/// a peer of the last policy and its port.
fn thousand_policies(ipv6: bool) -> Model {
    let (pods, namespaces, _) = model(1, 1, ipv6);
    let scale_port = |i: usize| 80 + (i % 100) as u16 * 10;
    let peer = |i: usize, j: usize| peer_ip(i / 5, (i % 5) * 10 + j, ipv6);
    let policies = (0..1000)
        .map(|i| {
            let to: Vec<_> = (0..10).map(|j| json!({"ipBlock": {"cidr": host_prefix(peer(i, j))}})).collect();
            serde_json::from_value(json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                "metadata": {"namespace": "bench", "name": format!("scale-{i}")},
                "spec": {"podSelector": {"matchLabels": {"app": "pod-0"}}, "policyTypes": ["Egress"],
                         "egress": [{"to": to, "ports": [{"port": scale_port(i), "endPort": scale_port(i) + 4}]}]}}))
            .unwrap()
        })
        .collect();
    ((pods, namespaces, policies), peer(999, 9), scale_port(999) + 2)
}

struct Figures {
    established_repeat: f64,
    established_single: f64,
    deny: f64,
    /// `deny` with `kube-router monitor` listening.
    deny_monitored: f64,
    allow_new: f64,
}

fn single_runs(fd: i32, frame_for: impl Fn(u16) -> Vec<u8>) -> f64 {
    let mut total = 0u64;
    for i in 0..NEW_FLOWS {
        total += u64::from(run(fd, &frame_for(1000 + i), 1).expect("test run").duration_ns);
    }
    total as f64 / f64::from(NEW_FLOWS)
}

/// A model: its objects, the allowed probe's peer and the probes' destination port.
type Model = ((Vec<Pod>, Vec<Namespace>, Vec<NetworkPolicy>), IpAddr, u16);

fn rules_model(pods: usize, rules_per_pod: usize, ipv6: bool) -> Model {
    (model(pods, rules_per_pod, ipv6), peer_ip(0, rules_per_pod - 1, ipv6), 80)
}

fn measure(label: &str, (objects, last_rule, port): Model, ipv6: bool) -> Figures {
    let pin_dir = Path::new("/sys/fs/bpf/krt-pol-bench");
    let _ = datapath::remove_all(pin_dir);
    let datapath = Datapath::load(pin_dir).expect("load datapath (root needed)");
    let (pod_objects, namespaces, policies) = objects;
    let started = Instant::now();
    let output = compile(&pod_objects, &namespaces, &policies);
    let entries = MapFlattener::new().flatten(&output.model);
    let compiled = started.elapsed();
    let mut maps = BpfPolicyMaps::open_pinned(pin_dir).unwrap();
    let started = Instant::now();
    let report = apply_diff(&mut maps, &MapEntries::default().diff(&entries), &MapEntries::default());
    let written = started.elapsed();
    assert_eq!(report.errors, 0, "{report:?}");
    println!(
        "{label}: {} pods, {} policies; compile+flatten {:.1} ms, {} map writes in {:.1} ms",
        pod_objects.len(),
        policies.len(),
        compiled.as_secs_f64() * 1e3,
        report.writes(),
        written.as_secs_f64() * 1e3
    );

    let fd = datapath.program_fd(Hook::PolicyIngress).unwrap();
    let pod = pod_ip(0, ipv6);
    let nobody = if ipv6 {
        IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1))
    } else {
        IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1))
    };
    let tcp = |src_port: u16, dst: IpAddr, flags: u8| match (pod, dst) {
        (IpAddr::V4(pod), IpAddr::V4(dst)) => packet::ipv4(packet::TCP, (pod, src_port), (dst, port), flags, &[0; 64]),
        (IpAddr::V6(pod), IpAddr::V6(dst)) => packet::ipv6(packet::TCP, (pod, src_port), (dst, port), flags, &[0; 64]),
        _ => unreachable!("one family per model"),
    };

    let frame = tcp(40000, last_rule, packet::TCP_SYN);
    assert_eq!(run(fd, &frame, 1).unwrap().retval, -1, "the allow probe is allowed");
    assert_eq!(run(fd, &tcp(40001, nobody, packet::TCP_SYN), 1).unwrap().retval, 2, "the deny probe is denied");
    let established = tcp(40000, last_rule, packet::TCP_ACK);
    let established_repeat = run(fd, &established, REPEAT).unwrap().duration_ns as f64;
    let established_single = single_runs(fd, |_| established.clone());
    let deny = run(fd, &tcp(40001, nobody, packet::TCP_SYN), REPEAT).unwrap().duration_ns as f64;
    let allow_new = single_runs(fd, |port| tcp(port, last_rule, packet::TCP_SYN));
    // `kube-router monitor` listening (its default 1,000 events/s per CPU): the same denials.
    let monitor = |until: u64| {
        let map = aya::maps::MapData::from_pin(kube_router::pinned::pinned_map(pin_dir, "events_cfg")).unwrap();
        let mut config: aya::maps::Array<_, kube_router_common::MonitorConfig> =
            aya::maps::Array::try_from(aya::maps::Map::Array(map)).unwrap();
        config.set(0, kube_router_common::MonitorConfig { enabled_until_ns: until, rate_per_cpu: 1000 }, 0).unwrap();
    };
    monitor(u64::MAX);
    let deny_monitored = run(fd, &tcp(40001, nobody, packet::TCP_SYN), REPEAT).unwrap().duration_ns as f64;
    monitor(0);
    drop(datapath);
    let _ = datapath::remove_all(pin_dir);
    Figures { established_repeat, established_single, deny, allow_new, deny_monitored }
}

/// The gate in front of policy conntrack (`pol_cfg`): the packets of a pod no policy isolates,
/// with every pod tracked (as before the gate) and with only isolated pods tracked, rounds
/// alternated in one run; beside them an isolated pod's established packet, which pays the gate's
/// `pol_pods` lookups. Model: 200 egress-isolated pods x 50 rules (the "10,000 rules" one), the
/// unisolated pod an address it does not hold. ns per packet, min-max over the rounds.
fn gate_section() {
    use kube_router::policy::maps::write_policy_ct_gate;
    const ROUNDS: usize = 3;
    println!(
        "== policy conntrack gate: a pod no policy isolates, every pod tracked vs only isolated pods ({ROUNDS} rounds)"
    );
    let pin_dir = Path::new("/sys/fs/bpf/krt-pol-bench-gate");
    let _ = datapath::remove_all(pin_dir);
    let datapath = Datapath::load(pin_dir).expect("load datapath (root needed)");
    let ((pods, namespaces, policies), last_rule, port) = rules_model(200, RULES_PER_POD, false);
    let entries = MapFlattener::new().flatten(&compile(&pods, &namespaces, &policies).model);
    let mut maps = BpfPolicyMaps::open_pinned(pin_dir).unwrap();
    let report = apply_diff(&mut maps, &MapEntries::default().diff(&entries), &MapEntries::default());
    assert_eq!(report.errors, 0, "{report:?}");
    let (egress, ingress) =
        (datapath.program_fd(Hook::PolicyIngress).unwrap(), datapath.program_fd(Hook::PolicyEgress).unwrap());
    let (IpAddr::V4(isolated), IpAddr::V4(peer)) = (pod_ip(0, false), last_rule) else { unreachable!() };
    let open_pod = Ipv4Addr::new(10, 20, 0, 1);
    let other_pod = Ipv4Addr::new(10, 20, 0, 2);
    let tcp =
        |src: (Ipv4Addr, u16), dst: (Ipv4Addr, u16), flags: u8| packet::ipv4(packet::TCP, src, dst, flags, &[0; 64]);
    // (label, per round: [tracked all, gated])
    let mut rows: Vec<(&str, [Vec<f64>; 2])> = vec![
        ("unisolated pod, established (repeat), from the pod", Default::default()),
        ("unisolated pod, established (repeat), to the pod", Default::default()),
        ("unisolated pod, new flow (1/run), from the pod", Default::default()),
        ("isolated pod, established (repeat), from the pod", Default::default()),
    ];
    let mut sport = 30000u16;
    for round in 0..ROUNDS {
        for (mode, track_all) in [(0usize, true), (1usize, false)] {
            write_policy_ct_gate(pin_dir, track_all).unwrap();
            // Each mode opens its own flows first (tracked or not, as that mode would).
            sport += 1;
            let out = tcp((open_pod, sport), (other_pod, port), packet::TCP_SYN);
            let back = tcp((other_pod, port), (open_pod, sport), packet::TCP_SYN | packet::TCP_ACK);
            assert_eq!(run(egress, &out, 1).unwrap().retval, -1);
            assert_eq!(run(ingress, &back, 1).unwrap().retval, -1);
            let isolated_out = tcp((isolated, sport), (peer, port), packet::TCP_SYN);
            assert_eq!(run(egress, &isolated_out, 1).unwrap().retval, -1, "the isolated pod's allowed flow");
            let out_ack = tcp((open_pod, sport), (other_pod, port), packet::TCP_ACK);
            let back_ack = tcp((other_pod, port), (open_pod, sport), packet::TCP_ACK);
            let isolated_ack = tcp((isolated, sport), (peer, port), packet::TCP_ACK);
            rows[0].1[mode].push(run(egress, &out_ack, REPEAT).unwrap().duration_ns as f64);
            rows[1].1[mode].push(run(ingress, &back_ack, REPEAT).unwrap().duration_ns as f64);
            // New flows from an unisolated address of their own per round and mode (single_runs
            // numbers the source ports): none can find an entry an earlier round left.
            let new_flow_pod = Ipv4Addr::new(10, 21, round as u8, mode as u8);
            rows[2].1[mode].push(single_runs(egress, |i| tcp((new_flow_pod, i), (other_pod, port), packet::TCP_SYN)));
            rows[3].1[mode].push(run(egress, &isolated_ack, REPEAT).unwrap().duration_ns as f64);
        }
    }
    let range = |v: &[f64]| {
        let (lo, hi) = v.iter().fold((f64::MAX, 0.0f64), |(lo, hi), x| (lo.min(*x), hi.max(*x)));
        (lo, hi)
    };
    println!("{:<52} {:>18} {:>18} {:>14}", "ns/pkt", "every pod tracked", "isolated only", "ratio (mid)");
    for (label, [all, gated]) in &rows {
        let ((a0, a1), (g0, g1)) = (range(all), range(gated));
        println!(
            "{label:<52} {a0:>8.1}-{a1:<8.1} {g0:>8.1}-{g1:<8.1} {:>13.2}x",
            ((g0 + g1) / 2.0) / ((a0 + a1) / 2.0)
        );
    }
    write_policy_ct_gate(pin_dir, false).unwrap();
    drop(datapath);
    let _ = datapath::remove_all(pin_dir);
}

fn main() {
    gate_section();
    // KRT_BENCH_POLICY_GATE_ONLY=1: only the gate's figures above.
    if std::env::var("KRT_BENCH_POLICY_GATE_ONLY").is_ok_and(|v| v == "1") {
        return;
    }
    println!();
    println!("== kr_pol_ingress per-packet cost, BPF_PROG_TEST_RUN (repeats x {REPEAT}, single runs x {NEW_FLOWS})");
    let models = |ipv6: bool| -> [(&str, usize, Model); 4] {
        [
            ("1 rule", 1, rules_model(1, 1, ipv6)),
            ("100 rules", RULES_PER_POD, rules_model(2, RULES_PER_POD, ipv6)),
            ("10,000 rules", RULES_PER_POD, rules_model(200, RULES_PER_POD, ipv6)),
            ("1,000 policies", 1000, thousand_policies(ipv6)),
        ]
    };
    let results: Vec<(&str, usize, Figures)> =
        models(false).into_iter().map(|(label, rules, m)| (label, rules, measure(label, m, false))).collect();
    println!();
    println!(
        "{:<14} {:>10} {:>22} {:>22} {:>22} {:>22}",
        "model", "pod rules", "established (repeat)", "deny", "established (1/run)", "allow new"
    );
    for (label, rules, f) in &results {
        println!(
            "{label:<14} {rules:>10} {:>9.1} ns  1.00x    {:>9.1} ns {:>6.2}x    {:>9.1} ns  1.00x    {:>9.1} ns {:>6.2}x",
            f.established_repeat,
            f.deny,
            f.deny / f.established_repeat,
            f.established_single,
            f.allow_new,
            f.allow_new / f.established_single,
        );
    }
    let (one, thousand) = (&results[0].2, &results[3].2);
    println!(
        "\n1,000 policies / 1 rule: deny {:.2}x, allow new flow {:.2}x (goal: within 2x)",
        thousand.deny / one.deny,
        thousand.allow_new / one.allow_new
    );
    println!();
    for (label, _, f) in &results {
        println!(
            "{label:<14} deny with kube-router monitor off {:>7.1} ns, on {:>7.1} ns ({:.2}x; 1,000 events/s per CPU, the rest counted)",
            f.deny,
            f.deny_monitored,
            f.deny_monitored / f.deny
        );
    }

    println!();
    println!("== the same over IPv6 (an IPv6-only model of the same shape), as ratios to IPv4 above");
    for ((label, _, m), (_, _, v4)) in models(true).into_iter().zip(&results) {
        let v6 = measure(&format!("{label} (IPv6)"), m, true);
        println!(
            "{label:<14} established {:>7.1} ns {:.2}x   deny {:>7.1} ns {:.2}x   established (1/run) {:>7.1} ns {:.2}x   allow new {:>7.1} ns {:.2}x",
            v6.established_repeat,
            v6.established_repeat / v4.established_repeat,
            v6.deny,
            v6.deny / v4.deny,
            v6.established_single,
            v6.established_single / v4.established_single,
            v6.allow_new,
            v6.allow_new / v4.allow_new,
        );
    }
}
