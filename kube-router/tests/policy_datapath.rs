//! The real NetworkPolicy programs, loaded into the kernel and run with BPF_PROG_TEST_RUN over
//! maps written by `PolicyMaps` from the policy compiler's output. The verdict of the programs
//! must equal the compiler's reference decision (`policy::allows`, and `MapEntries::allows` over
//! the flattened maps) on every probe. Needs root; each test uses its own pin directory under
//! /sys/fs/bpf/krt-pol-test-*.
#[path = "common/test_run.rs"]
mod test_run;
use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::PathBuf,
};
use test_run::{packet, run, run_forwarded, TC_ACT_SHOT, TC_ACT_UNSPEC};

use k8s_openapi::api::{
    core::v1::{Namespace, Pod},
    networking::v1::NetworkPolicy,
};
use kube_router::policy::maps::{apply_diff, decode, BpfPolicyMaps, PolicyConntrack, PolicyMaps, PolicyWriteReport};
use kube_router::{
    bpf::datapath::{self, Datapath, Hook},
    policy::{
        allows, compile,
        flatten::{MapEntries, MapFlattener},
        CompileOutput, Protocol,
    },
};
use kube_router_common::{map_names, plain_map_names, plain_stat, pol_guard_stat, pol_stat};
use serde_json::{json, Value};

const SCTP: u8 = 132;
const ICMP: u8 = 1;

// ---- cluster objects ------------------------------------------------------------------------

fn labels(pairs: &[(&str, &str)]) -> Value {
    Value::Object(pairs.iter().map(|(k, v)| (k.to_string(), Value::String(v.to_string()))).collect())
}

/// A pod with an IPv4 and an IPv6 address (a dual-stack cluster).
fn pod(namespace: &str, name: &str, ip: &str, ip6: &str, pod_labels: &[(&str, &str)]) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"namespace": namespace, "name": name, "labels": labels(pod_labels)},
        "spec": {"containers": [{"name": "c", "image": "agnhost",
            "ports": [{"name": "http", "containerPort": 80, "protocol": "TCP"}]}]},
        "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}, {"ip": ip6}]}
    }))
    .unwrap()
}

fn namespace(name: &str) -> Namespace {
    serde_json::from_value(json!({"apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": name, "labels": {"ns": name}}}))
    .unwrap()
}

fn policy(namespace: &str, name: &str, spec: Value) -> NetworkPolicy {
    serde_json::from_value(json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"namespace": namespace, "name": name}, "spec": spec}))
    .unwrap()
}

/// Namespaces x, y, z (label ns=<name>), pods a, b, c (label pod=<name>) at 10.0.<ns>.<pod>
/// and fd00::<ns>:<pod>.
struct Cluster {
    pods: Vec<Pod>,
    namespaces: Vec<Namespace>,
}

fn ip(ns: usize, pod: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 0, ns as u8 + 1, pod as u8 + 1)
}

fn ip6(ns: usize, pod: usize) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, ns as u16 + 1, pod as u16 + 1)
}

const OUTSIDE: Ipv4Addr = Ipv4Addr::new(192, 168, 7, 7);
const OUTSIDE6: Ipv6Addr = Ipv6Addr::new(0xfd99, 0, 0, 0, 0, 0, 7, 7);

impl Cluster {
    fn xyz() -> Cluster {
        let mut cluster = Cluster { pods: Vec::new(), namespaces: Vec::new() };
        for (n, ns) in ["x", "y", "z"].into_iter().enumerate() {
            cluster.namespaces.push(namespace(ns));
            for (p, name) in ["a", "b", "c"].into_iter().enumerate() {
                cluster.pods.push(pod(ns, name, &ip(n, p).to_string(), &ip6(n, p).to_string(), &[("pod", name)]));
            }
        }
        cluster
    }

    fn compile(&self, policies: &[NetworkPolicy]) -> CompileOutput {
        let out = compile(&self.pods, &self.namespaces, policies);
        assert!(out.policy_errors.is_empty(), "{:?}", out.policy_errors);
        out
    }

    /// Every pod IP of one family and one address outside the cluster.
    fn endpoints(ipv6: bool) -> Vec<IpAddr> {
        let pod = |n, p| if ipv6 { IpAddr::V6(ip6(n, p)) } else { IpAddr::V4(ip(n, p)) };
        let mut all: Vec<IpAddr> = (0..3).flat_map(|n| (0..3).map(move |p| pod(n, p))).collect();
        all.push(if ipv6 { IpAddr::V6(OUTSIDE6) } else { IpAddr::V4(OUTSIDE) });
        all
    }
}

// ---- the loaded datapath ----------------------------------------------------------------------

struct Loaded {
    datapath: Datapath,
    pin_dir: PathBuf,
    flattener: MapFlattener,
    programmed: MapEntries,
    next_port: u16,
}

impl Drop for Loaded {
    fn drop(&mut self) {
        let _ = datapath::remove_all(&self.pin_dir);
    }
}

fn load(test: &str) -> Loaded {
    let pin_dir = PathBuf::from(format!("/sys/fs/bpf/krt-pol-test-{test}"));
    let _ = datapath::remove_all(&pin_dir);
    let datapath = Datapath::load(&pin_dir).expect("load datapath (run as root)");
    Loaded { datapath, pin_dir, flattener: MapFlattener::new(), programmed: MapEntries::default(), next_port: 20000 }
}

impl Loaded {
    /// Flattens `output` and writes only the difference to what was programmed before.
    fn program(&mut self, output: &CompileOutput) -> PolicyWriteReport {
        let entries = self.flattener.flatten(&output.model);
        let mut maps = BpfPolicyMaps::open_pinned(&self.pin_dir).unwrap();
        let report = apply_diff(&mut maps, &self.programmed.diff(&entries), &self.programmed);
        assert_eq!(report.errors, 0, "{report:?}");
        self.programmed = entries;
        report
    }

    fn stats(&self) -> Vec<u64> {
        kube_router::policy::maps::read_policy_stats(&self.pin_dir).unwrap()
    }

    fn plain_hits(&self) -> u64 {
        let stats =
            kube_router::pinned::counters::read_pinned(&self.pin_dir, plain_map_names::PLAIN_STATS, plain_stat::COUNT);
        stats.unwrap()[plain_stat::HIT as usize]
    }

    fn fd(&self, hook: Hook) -> i32 {
        self.datapath.program_fd(hook).unwrap()
    }

    /// The hook verdicts for one packet of a same-node connection: it passes the source pod's
    /// veth at TC ingress (`kr_pol_ingress`), then the destination pod's veth at TC egress
    /// (`kr_pol_egress`), unless the first dropped it. An address outside the cluster has no
    /// pod and no policy, so its hook passes everything: the same program does for it.
    fn send(&self, frame: &[u8]) -> bool {
        let from_pod = run(self.fd(Hook::PolicyIngress), frame, 1).unwrap();
        assert!(from_pod.retval == TC_ACT_UNSPEC || from_pod.retval == TC_ACT_SHOT, "{}", from_pod.retval);
        assert_eq!(from_pod.packet, frame, "policy never rewrites packets");
        if from_pod.retval == TC_ACT_SHOT {
            return false;
        }
        // Forwarded to the destination pod (from the source pod's veth, another node, ...).
        let to_pod = run_forwarded(self.fd(Hook::PolicyEgress), frame, 1, 1).unwrap();
        assert!(to_pod.retval == TC_ACT_UNSPEC || to_pod.retval == TC_ACT_SHOT, "{}", to_pod.retval);
        to_pod.retval == TC_ACT_UNSPEC
    }

    /// A new connection (fresh source port): whether its first packet gets through.
    fn connect(&mut self, proto: u8, src: impl Into<IpAddr>, dst: impl Into<IpAddr>, port: u16) -> (u16, bool) {
        self.next_port += 1;
        let sport = self.next_port;
        let frame = match (src.into(), dst.into()) {
            (IpAddr::V4(src), IpAddr::V4(dst)) => {
                packet::ipv4(proto, (src, sport), (dst, port), packet::TCP_SYN, b"probe")
            }
            (IpAddr::V6(src), IpAddr::V6(dst)) => {
                packet::ipv6(proto, (src, sport), (dst, port), packet::TCP_SYN, b"probe")
            }
            (src, dst) => panic!("{src} -> {dst}: one family per packet"),
        };
        (sport, self.send(&frame))
    }
}

fn protocol(proto: u8) -> Protocol {
    match proto {
        packet::TCP => Protocol::Tcp,
        packet::UDP => Protocol::Udp,
        SCTP => Protocol::Sctp,
        other => panic!("no NetworkPolicy protocol {other}"),
    }
}

/// Probes every (source, destination) pair of cluster pods and the outside address of one
/// family on each (protocol, port), asserting datapath == compiler reference == flattened-map
/// reference. Returns (allowed, denied) counts so a scenario can check it is not trivially all
/// one way.
fn assert_matrix(loaded: &mut Loaded, output: &CompileOutput, ports: &[(u8, u16)], ipv6: bool) -> (usize, usize) {
    let (mut allowed, mut denied) = (0, 0);
    let mut mismatches = Vec::new();
    for &(proto, port) in ports {
        for src in Cluster::endpoints(ipv6) {
            for dst in Cluster::endpoints(ipv6) {
                if src == dst {
                    continue;
                }
                let expected = allows(&output.model, src, dst, protocol(proto), port);
                let flattened = loaded.programmed.allows(src, dst, protocol(proto), port);
                assert_eq!(expected, flattened, "reference lookups disagree: {src} -> {dst}:{port}/{proto}");
                let (_, got) = loaded.connect(proto, src, dst, port);
                if got != expected {
                    mismatches.push(format!("{src} -> {dst}:{port}/{proto}: datapath {got}, expected {expected}"));
                }
                if expected {
                    allowed += 1;
                } else {
                    denied += 1;
                }
            }
        }
    }
    assert!(mismatches.is_empty(), "{} mismatches:\n{}", mismatches.len(), mismatches.join("\n"));
    (allowed, denied)
}

const COMMON_PORTS: [(u8, u16); 5] =
    [(packet::TCP, 80), (packet::TCP, 81), (packet::UDP, 53), (packet::UDP, 80), (SCTP, 80)];

fn scenario(test: &str, policies: &[NetworkPolicy], extra_ports: &[(u8, u16)]) -> (Loaded, CompileOutput) {
    let cluster = Cluster::xyz();
    let output = cluster.compile(policies);
    let mut loaded = load(test);
    loaded.program(&output);
    let mut ports = COMMON_PORTS.to_vec();
    ports.extend_from_slice(extra_ports);
    // The same matrix once per family: an IPv6 packet is judged exactly like an IPv4 one.
    for ipv6 in [false, true] {
        let (allowed, denied) = assert_matrix(&mut loaded, &output, &ports, ipv6);
        assert!(
            allowed > 0 && denied > 0,
            "scenario {test} (IPv6 {ipv6}) is trivial: {allowed} allowed, {denied} denied"
        );
    }
    (loaded, output)
}

// ---- scenarios: datapath verdict == compiler reference --------------------------------------

#[test]
fn default_deny_ingress() {
    let (loaded, _) = scenario("deny-in", &[policy("x", "deny", json!({"podSelector": {}}))], &[]);
    let stats = loaded.stats();
    assert!(stats[pol_stat::DENIED_INGRESS as usize] > 0);
    assert_eq!(stats[pol_stat::DENIED_EGRESS as usize], 0, "no pod is egress-isolated");
}

#[test]
fn allow_from_a_namespace() {
    let np = policy(
        "x",
        "from-y",
        json!({"podSelector": {}, "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"ns": "y"}}}]}]}),
    );
    scenario("from-ns", &[np], &[]);
}

#[test]
fn ip_block_with_except() {
    let np = policy(
        "x",
        "block",
        json!({"podSelector": {"matchLabels": {"pod": "a"}}, "ingress": [{"from": [
            {"ipBlock": {"cidr": "10.0.0.0/16", "except": ["10.0.2.0/24", "10.0.3.3/32"]}},
            {"ipBlock": {"cidr": "192.168.0.0/16"}}
        ]}]}),
    );
    let (mut loaded, _) = scenario("ipblock", &[np], &[]);
    // Spot checks of the LPM semantics (the matrix already compared them all).
    assert!(loaded.connect(packet::TCP, ip(2, 0), ip(0, 0), 80).1, "z/a is inside the cidr");
    assert!(!loaded.connect(packet::TCP, ip(1, 0), ip(0, 0), 80).1, "y is an except range");
    assert!(!loaded.connect(packet::TCP, ip(2, 2), ip(0, 0), 80).1, "z/c is a /32 except");
    assert!(loaded.connect(packet::TCP, OUTSIDE, ip(0, 0), 80).1, "second ipBlock");
    assert!(!loaded.connect(packet::TCP, Ipv4Addr::new(172, 16, 0, 1), ip(0, 0), 80).1);
}

#[test]
fn port_ranges_and_end_port() {
    let np = policy(
        "x",
        "ports",
        json!({"podSelector": {}, "ingress": [{"ports": [
            {"protocol": "TCP", "port": 8000, "endPort": 8080},
            {"protocol": "UDP", "port": 53},
            {"protocol": "SCTP", "port": 9000, "endPort": 9001},
            {"port": "http"}
        ]}]}),
    );
    let edges = [
        (packet::TCP, 7999),
        (packet::TCP, 8000),
        (packet::TCP, 8040),
        (packet::TCP, 8080),
        (packet::TCP, 8081),
        (packet::UDP, 52),
        (packet::UDP, 8000),
        (SCTP, 9000),
        (SCTP, 9001),
        (SCTP, 9002),
        (SCTP, 8000),
    ];
    let (mut loaded, _) = scenario("ports", &[np], &edges);
    assert!(loaded.connect(packet::TCP, ip(1, 0), ip(0, 1), 8080).1);
    assert!(!loaded.connect(packet::TCP, ip(1, 0), ip(0, 1), 8081).1);
    // Named port "http" resolves to 80 on the target pods.
    assert!(loaded.connect(packet::TCP, ip(1, 0), ip(0, 1), 80).1);
}

#[test]
fn egress_deny_with_one_allowed_destination() {
    let np = policy(
        "y",
        "egress",
        json!({"podSelector": {}, "policyTypes": ["Egress"], "egress": [
            {"to": [{"namespaceSelector": {"matchLabels": {"ns": "x"}}, "podSelector": {"matchLabels": {"pod": "a"}}}],
             "ports": [{"protocol": "TCP", "port": 80}]}
        ]}),
    );
    let (mut loaded, _) = scenario("deny-out", &[np], &[]);
    let before = loaded.stats();
    assert!(loaded.connect(packet::TCP, ip(1, 1), ip(0, 0), 80).1);
    assert!(!loaded.connect(packet::TCP, ip(1, 1), ip(0, 1), 80).1);
    assert!(!loaded.connect(packet::UDP, ip(1, 1), OUTSIDE, 53).1);
    let after = loaded.stats();
    let delta = |i: u32| after[i as usize] - before[i as usize];
    assert_eq!(delta(pol_stat::DENIED_EGRESS), 2, "each denied flow is counted once, at the source's veth");
    assert_eq!(delta(pol_stat::DENIED_INGRESS), 0);
    assert_eq!(delta(pol_stat::ALLOWED), 1, "y/b's egress rule allowed one flow");
    assert_eq!(delta(pol_stat::NOT_ISOLATED), 1, "x/a's ingress is not isolated");
}

#[test]
fn multiple_policies_are_a_union_per_side_and_both_sides_must_allow() {
    let policies = [
        policy("x", "deny-all", json!({"podSelector": {}, "policyTypes": ["Ingress", "Egress"]})),
        policy(
            "x",
            "from-y-80",
            json!({"podSelector": {"matchLabels": {"pod": "a"}},
                "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"ns": "y"}}}], "ports": [{"port": 80}]}]}),
        ),
        policy(
            "x",
            "from-z-b",
            json!({"podSelector": {}, "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"ns": "z"}},
                "podSelector": {"matchLabels": {"pod": "b"}}}]}]}),
        ),
        policy(
            "x",
            "to-z",
            json!({"podSelector": {"matchLabels": {"pod": "b"}}, "policyTypes": ["Egress"],
                "egress": [{"to": [{"namespaceSelector": {"matchLabels": {"ns": "z"}}}]}]}),
        ),
        policy("z", "deny-in", json!({"podSelector": {"matchLabels": {"pod": "c"}}})),
    ];
    let (mut loaded, _) = scenario("multi", &policies, &[(packet::TCP, 443)]);
    // x/b may send to z, but z/c denies all ingress: both sides are checked.
    assert!(loaded.connect(packet::TCP, ip(0, 1), ip(2, 0), 443).1);
    assert!(!loaded.connect(packet::TCP, ip(0, 1), ip(2, 2), 443).1);
}

// ---- conntrack -------------------------------------------------------------------------------

#[test]
fn replies_of_an_allowed_connection_pass_both_hooks_through_conntrack() {
    // y/a may connect to x/a:80. Every other flow between them is denied in both directions,
    // so a reply can only get through on the connection's conntrack entries.
    let policies = [
        policy(
            "x",
            "in",
            json!({"podSelector": {}, "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"ns": "y"}}}], "ports": [{"port": 80}]}]}),
        ),
        policy(
            "y",
            "out",
            json!({"podSelector": {}, "policyTypes": ["Ingress", "Egress"],
            "egress": [{"to": [{"namespaceSelector": {"matchLabels": {"ns": "x"}}}], "ports": [{"port": 80}]}]}),
        ),
    ];
    let cluster = Cluster::xyz();
    let output = cluster.compile(&policies);
    let mut loaded = load("ct");
    loaded.program(&output);
    let (client, server) = (ip(1, 0), ip(0, 0));

    let (sport, opened) = loaded.connect(packet::TCP, client, server, 80);
    assert!(opened);
    let before = loaded.stats();
    let reply = packet::ipv4(packet::TCP, (server, 80), (client, sport), packet::TCP_SYN | packet::TCP_ACK, b"");
    assert!(!allows(&output.model, IpAddr::V4(server), IpAddr::V4(client), Protocol::Tcp, sport));
    assert!(loaded.send(&reply), "the reply passes x/a's veth ingress and y/a's veth egress");
    let more = packet::ipv4(packet::TCP, (client, sport), (server, 80), packet::TCP_ACK, b"data");
    assert!(loaded.send(&more), "later packets of the connection are established");
    let after = loaded.stats();
    assert_eq!(after[pol_stat::CT_ESTABLISHED as usize] - before[pol_stat::CT_ESTABLISHED as usize], 4);
    assert_eq!(after[pol_stat::ALLOWED as usize], before[pol_stat::ALLOWED as usize], "nothing re-evaluated");

    // Not a reply: another client port, and the reverse direction as a new connection.
    let stray = packet::ipv4(packet::TCP, (server, 80), (client, sport + 1), packet::TCP_ACK, b"");
    assert!(!loaded.send(&stray));
    assert!(!loaded.connect(packet::TCP, server, client, 80).1);

    // One entry per pod veth the connection crosses, keyed to that pod.
    let entries = PolicyConntrack::open_pinned(&loaded.pin_dir).unwrap().entries().unwrap();
    let pods: std::collections::BTreeSet<_> = entries
        .iter()
        .filter(|(k, _)| k.pod_port == sport.to_be() || k.peer_port == sport.to_be())
        .map(|(k, _)| Ipv4Addr::from(k.pod_addr.to_ne_bytes()))
        .collect();
    assert_eq!(pods, [client, server].into_iter().collect());
}

/// The gate in front of policy conntrack: a pod isolated in neither direction is not tracked
/// (`pol_ct_v4` gets no entry for it, its packets pass as `not_isolated`), a pod isolated in one
/// direction is tracked in both: the replies of a flow it started through its open side still
/// pass its isolated one. `POLICY_CT_TRACK_ALL` (`pol_cfg`) brings back tracking for every pod.
#[test]
fn only_pods_a_policy_isolates_are_tracked_and_their_replies_pass() {
    use kube_router::policy::maps::write_policy_ct_gate;
    // x/a admits only namespace y (ingress-isolated); its egress, and every other pod, is open.
    let np = policy(
        "x",
        "from-y",
        json!({"podSelector": {"matchLabels": {"pod": "a"}},
            "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"ns": "y"}}}]}]}),
    );
    let output = Cluster::xyz().compile(&[np]);
    let mut loaded = load("ct-gate");
    loaded.program(&output);
    let addr = |ip: Ipv4Addr| u32::from_ne_bytes(ip.octets());
    let tracked_pods = |loaded: &Loaded| -> std::collections::BTreeSet<Ipv4Addr> {
        PolicyConntrack::open_pinned(&loaded.pin_dir)
            .unwrap()
            .entries()
            .unwrap()
            .into_iter()
            .map(|(key, _)| Ipv4Addr::from(key.pod_addr.to_ne_bytes()))
            .collect()
    };
    let tcp = |src: (Ipv4Addr, u16), dst: (Ipv4Addr, u16), flags: u8| packet::ipv4(packet::TCP, src, dst, flags, b"");

    // Unisolated pods, a whole exchange: no entry, every hook run counted `not_isolated`.
    let (yb, zc) = (ip(1, 1), ip(2, 2));
    let before = loaded.stats();
    let (sport, opened) = loaded.connect(packet::TCP, yb, zc, 80);
    assert!(opened);
    assert!(loaded.send(&tcp((zc, 80), (yb, sport), packet::TCP_SYN | packet::TCP_ACK)));
    assert!(loaded.send(&tcp((yb, sport), (zc, 80), packet::TCP_ACK)));
    let after = loaded.stats();
    let delta = |i: u32| after[i as usize] - before[i as usize];
    assert_eq!(delta(pol_stat::NOT_ISOLATED), 6, "3 packets x 2 hooks, none tracked");
    assert_eq!(delta(pol_stat::CT_ESTABLISHED), 0, "no lookup found anything: none was made");
    assert!(tracked_pods(&loaded).is_empty(), "no pol_ct_v4 entry for unisolated pods: {:?}", tracked_pods(&loaded));

    // The isolated pod's allowed flow (y/a -> x/a): an entry at x/a only, and its reply passes.
    let (xa, ya) = (ip(0, 0), ip(1, 0));
    let (sport, opened) = loaded.connect(packet::TCP, ya, xa, 80);
    assert!(opened);
    assert!(loaded.send(&tcp((xa, 80), (ya, sport), packet::TCP_SYN | packet::TCP_ACK)), "x/a's reply");
    assert_eq!(tracked_pods(&loaded), [xa].into_iter().collect());

    // A flow x/a starts through its open egress, to a peer its ingress does not admit: tracked
    // at x/a (its ingress judges the reply), so the reply passes; another port does not.
    let before = loaded.stats();
    let (sport, opened) = loaded.connect(packet::TCP, xa, zc, 443);
    assert!(opened);
    assert!(loaded.send(&tcp((zc, 443), (xa, sport), packet::TCP_SYN | packet::TCP_ACK)), "the reply to x/a");
    assert!(!loaded.send(&tcp((zc, 443), (xa, sport + 1), packet::TCP_ACK)), "not a reply: judged, denied");
    let after = loaded.stats();
    let delta = |i: u32| after[i as usize] - before[i as usize];
    assert_eq!(delta(pol_stat::CT_ESTABLISHED), 1, "the reply, at x/a's veth");
    assert_eq!(delta(pol_stat::DENIED_INGRESS), 1);
    let entries = PolicyConntrack::open_pinned(&loaded.pin_dir).unwrap().entries().unwrap();
    assert!(entries.iter().any(|(k, _)| k.pod_addr == addr(xa) && k.peer_addr == addr(zc)), "{entries:?}");
    assert!(entries.iter().all(|(k, _)| k.pod_addr == addr(xa)), "only x/a is tracked: {entries:?}");

    // Without the gate (`pol_cfg` = track all), as before it: the unisolated pods' flow is tracked
    // at both ends, and a flow z/c had before x/a's policy would keep passing.
    write_policy_ct_gate(&loaded.pin_dir, true).unwrap();
    let (sport, opened) = loaded.connect(packet::TCP, yb, zc, 80);
    assert!(opened);
    let entries = PolicyConntrack::open_pinned(&loaded.pin_dir).unwrap().entries().unwrap();
    for pod in [yb, zc] {
        assert!(entries.iter().any(|(k, _)| k.pod_addr == addr(pod) && k.pod_port != 0), "{pod} tracked: {entries:?}");
    }
    assert!(entries.iter().any(|(k, _)| k.pod_addr == addr(yb) && k.pod_port == sport.to_be()));
    write_policy_ct_gate(&loaded.pin_dir, false).unwrap();
}

/// The gate's one change of behaviour, fail closed: a flow a pod had while no policy isolated
/// it was never tracked, so once a policy isolates the pod its next packet is judged like a
/// new flow's (the gate passed nothing the policy would not have passed at the time). With
/// `POLICY_CT_TRACK_ALL` the flow keeps passing, as before the gate.
#[test]
fn a_flow_from_before_the_first_isolating_policy_is_judged_unless_every_pod_is_tracked() {
    use kube_router::policy::maps::write_policy_ct_gate;
    let isolate =
        policy("x", "deny-in", json!({"podSelector": {"matchLabels": {"pod": "b"}}, "policyTypes": ["Ingress"]}));
    let cluster = Cluster::xyz();
    let (xb, zc) = (ip(0, 1), ip(2, 2));
    for track_all in [false, true] {
        let mut loaded = load(if track_all { "ct-gate-all" } else { "ct-gate-on" });
        write_policy_ct_gate(&loaded.pin_dir, track_all).unwrap();
        loaded.program(&cluster.compile(&[]));
        let (sport, opened) = loaded.connect(packet::UDP, zc, xb, 53);
        assert!(opened, "no policy yet");
        let again = packet::ipv4(packet::UDP, (zc, sport), (xb, 53), 0, b"again");
        if !track_all {
            // Both pods' verdicts are in the plain-traffic cache now: the isolation written
            // next must still reach the flow's next packet.
            let hits = loaded.plain_hits();
            assert!(loaded.send(&again));
            assert_eq!(loaded.plain_hits(), hits + 2, "z/c's and x/b's verdicts from the cache");
        }
        loaded.program(&cluster.compile(std::slice::from_ref(&isolate)));
        assert_eq!(loaded.send(&again), track_all, "track all {track_all}: the flow's next packet");
        assert!(!loaded.connect(packet::UDP, zc, xb, 53).1, "a new flow is denied either way");
    }
}

#[test]
fn the_node_reaches_its_isolated_pods_and_their_replies_come_back() {
    // x/a denies every ingress and every egress; its node still probes it (kubelet), as
    // kube-router accepts traffic from the local node in every pod chain.
    let np = policy("x", "isolate", json!({"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}));
    let (mut loaded, _) = scenario("node-exempt", &[np], &[]);
    let (node, pod) = (Ipv4Addr::new(192, 168, 0, 1), ip(0, 0));
    let probe = packet::ipv4(packet::TCP, (node, 40000), (pod, 8080), packet::TCP_SYN, b"");
    let before = loaded.stats();
    // Sent by the node's own stack (input interface 0): passes, counted, tracked.
    assert_eq!(run(loaded.fd(Hook::PolicyEgress), &probe, 1).unwrap().retval, TC_ACT_UNSPEC);
    let reply = packet::ipv4(packet::TCP, (pod, 8080), (node, 40000), packet::TCP_SYN | packet::TCP_ACK, b"");
    assert_eq!(run(loaded.fd(Hook::PolicyIngress), &reply, 1).unwrap().retval, TC_ACT_UNSPEC, "the reply");
    let after = loaded.stats();
    assert_eq!(after[pol_stat::NODE_EXEMPT as usize] - before[pol_stat::NODE_EXEMPT as usize], 1);
    // The same packet forwarded from elsewhere (another node at that address, say) is judged.
    let other = packet::ipv4(packet::TCP, (node, 40001), (pod, 8080), packet::TCP_SYN, b"");
    assert_eq!(run_forwarded(loaded.fd(Hook::PolicyEgress), &other, 1, 1).unwrap().retval, TC_ACT_SHOT);
    // And the pod's own new connections to the node stay denied by its egress policy.
    assert!(!loaded.connect(packet::TCP, pod, node, 10250).1);
}

fn icmp_echo(src: Ipv4Addr, dst: Ipv4Addr, icmp_type: u8, id: u16) -> Vec<u8> {
    let mut frame = vec![0x02, 0, 0, 0, 0, 2, 0x02, 0, 0, 0, 0, 1, 0x08, 0x00];
    frame.extend_from_slice(&[0x45, 0, 0, 28, 0, 1, 0x40, 0, 64, ICMP, 0, 0]);
    frame.extend_from_slice(&src.octets());
    frame.extend_from_slice(&dst.octets());
    frame.extend_from_slice(&[icmp_type, 0, 0, 0]);
    frame.extend_from_slice(&id.to_be_bytes());
    frame.extend_from_slice(&[0, 1]);
    frame
}

#[test]
fn icmp_is_allowed_only_by_rules_without_ports_and_echo_replies_are_tracked() {
    let policies = [
        policy(
            "x",
            "from-y",
            json!({"podSelector": {}, "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"ns": "y"}}}]}]}),
        ),
        policy("x", "from-z-80", json!({"podSelector": {}, "ingress": [{"ports": [{"port": 80}]}]})),
    ];
    let mut loaded = load("icmp");
    loaded.program(&Cluster::xyz().compile(&policies));
    assert!(loaded.send(&icmp_echo(ip(1, 0), ip(0, 0), 8, 77)), "y -> x, rule without ports");
    assert!(loaded.send(&icmp_echo(ip(0, 0), ip(1, 0), 0, 77)), "the echo reply, although x's egress denies all");
    assert!(!loaded.send(&icmp_echo(ip(0, 0), ip(1, 0), 0, 78)), "a reply to nothing");
    assert!(!loaded.send(&icmp_echo(ip(2, 0), ip(0, 0), 8, 79)), "z is only allowed TCP 80, not ICMP");
}

// ---- limits, stats and diffs -----------------------------------------------------------------

/// Peer `j` of policy `i` in the scale model: 10,000 distinct addresses outside the pods' range.
fn scale_peer(i: usize, j: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 100 + (i / 250) as u8, (i % 250) as u8, j as u8 + 1)
}

/// Ports of policy `i`: one of 100 ranges of 5 ports.
fn scale_ports(i: usize) -> (u16, u16) {
    let start = 1000 + (i % 100) as u16 * 10;
    (start, start + 4)
}

/// A pod selected by 1,000 policies of 10 peers each on 100 port ranges (layout 2 allowed 64
/// rules per pod and denied everything beyond): the kernel's verdicts equal the compiler's on a
/// probe matrix, with no limit.
#[test]
fn a_pod_under_a_thousand_policies_is_judged_exactly() {
    let policies: Vec<NetworkPolicy> = (0..1000)
        .map(|i| {
            let from: Vec<Value> =
                (0..10).map(|j| json!({"ipBlock": {"cidr": format!("{}/32", scale_peer(i, j))}})).collect();
            let (start, end) = scale_ports(i);
            policy(
                "x",
                &format!("p{i}"),
                json!({"podSelector": {"matchLabels": {"pod": "a"}},
                       "ingress": [{"from": from, "ports": [{"port": start, "endPort": end}]}]}),
            )
        })
        .collect();
    let mut loaded = load("scale");
    let output = Cluster::xyz().compile(&policies);
    let report = loaded.program(&output);
    assert_eq!(report.errors, 0);
    let pod = ip(0, 0);
    let before = loaded.stats();
    let (mut allowed, mut denied, mut probes) = (0, 0, 0);
    for i in (0..1000).step_by(37) {
        for j in [0, 9] {
            let peer = scale_peer(i, j);
            let (own, _) = scale_ports(i);
            let (other, _) = scale_ports(i + 1);
            for port in [own, own + 4, own + 5, other, 999, 2000] {
                let expected = allows(&output.model, IpAddr::V4(peer), IpAddr::V4(pod), Protocol::Tcp, port);
                assert_eq!(
                    loaded.connect(packet::TCP, peer, pod, port).1,
                    expected,
                    "policy {i} peer {peer} port {port}"
                );
                assert_eq!(expected, port == own || port == own + 4, "the model itself: {peer}:{port}");
                if expected {
                    allowed += 1;
                } else {
                    denied += 1;
                }
                probes += 1;
            }
        }
    }
    // A pod address outside every peer list, on an admitted port; and x/b is not selected.
    assert!(!loaded.connect(packet::TCP, Ipv4Addr::new(10, 99, 0, 1), pod, 1000).1);
    assert!(loaded.connect(packet::TCP, scale_peer(0, 0), ip(0, 1), 2000).1);
    let sampled = (0..1000).step_by(37).count();
    assert_eq!((probes, allowed, denied), (sampled * 2 * 6, sampled * 2 * 2, sampled * 2 * 4));
    let after = loaded.stats();
    let delta = |stat: u32| after[stat as usize] - before[stat as usize];
    // Ports 999 and 2000 (and own + 5 for the last range) are admitted by no rule.
    assert_eq!(delta(pol_stat::DENIED_INGRESS), (sampled * 2 * 4 + 1) as u64);
    assert!(delta(pol_stat::NO_PORT_MATCH) >= (sampled * 2 * 2) as u64, "{}", delta(pol_stat::NO_PORT_MATCH));
}

#[test]
fn a_change_to_one_pod_writes_only_its_entries() {
    let cluster = Cluster::xyz();
    let base = policy(
        "x",
        "from-y",
        json!({"podSelector": {}, "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"ns": "y"}}}]}]}),
    );
    let mut loaded = load("diff");
    let first = loaded.program(&cluster.compile(std::slice::from_ref(&base)));
    // 3 pods x 2 families (one shared slot), 1 rule, 3 + 3 prefixes (y's pods, both families).
    assert_eq!((first.puts, first.deletes), (13, 0));
    let maps = BpfPolicyMaps::open_pinned(&loaded.pin_dir).unwrap();
    let before = maps.read_all().unwrap();

    // A second policy selects only x/a: it gets a slot of its own; nobody else changes.
    let only_a = policy(
        "x",
        "a-from-z-80",
        json!({"podSelector": {"matchLabels": {"pod": "a"}},
            "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"ns": "z"}}}], "ports": [{"port": 80}]}]}),
    );
    let output = cluster.compile(&[base, only_a]);
    let report = loaded.program(&output);
    // x/a's pod entries (both families), its new slot's 2 port entries (every port: y; TCP 80: y
    // and z, merged into one set), the merged set's 6 + 6 prefixes (y's and z's pods, both
    // families).
    assert_eq!((report.puts, report.deletes), (16, 0), "{report:?}");
    let after = maps.read_all().unwrap();
    let x_a = kube_router_common::PolicyPodKeyV4 {
        addr: u32::from_ne_bytes(ip(0, 0).octets()),
        direction: kube_router_common::POLICY_DIR_INGRESS,
        pad: [0; 3],
    };
    let mut untouched = after.pods.clone();
    untouched.remove(&x_a);
    let mut expected = before.pods.clone();
    expected.remove(&x_a);
    assert_eq!(untouched, expected, "other pods' entries are byte-identical");
    assert!(before.ports.iter().all(|(k, v)| after.ports.get(k) == Some(v)), "old port entries untouched");
    assert!(before.peers.iter().all(|(k, v)| after.peers.get(k) == Some(v)), "old prefixes untouched");
    assert_eq!(decode(&after).unwrap(), loaded.programmed, "the maps hold exactly the flattened entries");
    for ipv6 in [false, true] {
        assert_matrix(&mut loaded, &output, &[(packet::TCP, 80), (packet::TCP, 81)], ipv6);
    }

    // Re-programming the same model writes nothing.
    let again = loaded.program(&output);
    assert_eq!(again.writes(), 0);
}

#[test]
fn traffic_that_is_not_judged_passes_and_is_counted() {
    let mut loaded = load("other");
    loaded.program(&Cluster::xyz().compile(&[policy("x", "deny", json!({"podSelector": {}}))]));
    let mut arp = packet::ipv4(packet::TCP, (ip(1, 0), 1), (ip(0, 0), 80), packet::TCP_SYN, b"");
    arp[12..14].copy_from_slice(&[0x08, 0x06]);
    assert!(loaded.send(&arp));
    // A later fragment carries no ports: passed; its first fragment is judged (and denied here).
    let mut tail = packet::ipv4(packet::UDP, (ip(1, 0), 1), (ip(0, 0), 53), 0, b"12345678");
    tail[14 + 6..14 + 8].copy_from_slice(&0x0001u16.to_be_bytes());
    assert!(loaded.send(&tail));
    let mut first = packet::ipv4(packet::UDP, (ip(1, 0), 1), (ip(0, 0), 53), 0, b"12345678");
    first[14 + 6..14 + 8].copy_from_slice(&0x2000u16.to_be_bytes());
    assert!(!loaded.send(&first));
    let stats = loaded.stats();
    assert_eq!(stats[pol_stat::NOT_EVALUATED as usize], 2, "arp, at both hooks");
    // The tail at x's hook; at y's (isolated in neither direction) the two fragments pass
    // unparsed, as every packet of y does.
    assert_eq!(stats[pol_stat::FRAGMENT_PASS as usize], 1);
    assert_eq!(stats[pol_stat::NOT_ISOLATED as usize], 2, "y's hook, both fragments");
    assert_eq!(stats[pol_stat::DENIED_INGRESS as usize], 1);
}

// ---- fail closed: protocols, ethertypes, unreadable headers, ICMP errors ---------------------

fn guard_stats(loaded: &Loaded) -> Vec<u64> {
    kube_router::pinned::counters::read_pinned(&loaded.pin_dir, map_names::POLICY_GUARD_STATS, pol_guard_stat::COUNT)
        .unwrap()
}

/// A packet of IP protocol `proto` (no ports: GRE, IPIP, 253 ...) carrying `payload`.
fn portless(proto: u8, src: IpAddr, dst: IpAddr) -> Vec<u8> {
    let payload = [0u8, 0, 0x08, 0, b'p', b'r', b'o', b'b', b'e', 0, 0, 0];
    match (src, dst) {
        (IpAddr::V4(src), IpAddr::V4(dst)) => packet::ipv4_frame(proto, src, dst, 0, &payload),
        (IpAddr::V6(src), IpAddr::V6(dst)) => packet::ipv6_frame(proto, src, dst, &payload),
        (src, dst) => panic!("{src} -> {dst}: one family per packet"),
    }
}

const GRE: u8 = 47;
const IPIP: u8 = 4;
const EXPERIMENTAL: u8 = 253;

/// Guard: every IP protocol of a new flow is judged (parse_for_policy, evaluate). x's pods admit
/// y on every port (a rule without ports) and z on TCP 80 only; their egress admits y on TCP 80
/// only. GRE, IPIP and protocol 253 pass from y, are denied from z and from outside, in both
/// families; x's own GRE to y is denied by its egress, unless it answers y's.
#[test]
fn every_ip_protocol_is_judged_and_only_rules_without_ports_admit_those_without_ports() {
    let policies = [
        policy(
            "x",
            "in",
            json!({"podSelector": {}, "ingress": [
                {"from": [{"namespaceSelector": {"matchLabels": {"ns": "y"}}}]},
                {"from": [{"namespaceSelector": {"matchLabels": {"ns": "z"}}}], "ports": [{"port": 80}]}]}),
        ),
        policy(
            "x",
            "out",
            json!({"podSelector": {}, "policyTypes": ["Egress"], "egress": [
                {"to": [{"namespaceSelector": {"matchLabels": {"ns": "y"}}}], "ports": [{"port": 80}]}]}),
        ),
    ];
    let mut loaded = load("protocols");
    loaded.program(&Cluster::xyz().compile(&policies));
    for ipv6 in [false, true] {
        let addr = |n, p| if ipv6 { IpAddr::V6(ip6(n, p)) } else { IpAddr::V4(ip(n, p)) };
        let outside = if ipv6 { IpAddr::V6(OUTSIDE6) } else { IpAddr::V4(OUTSIDE) };
        for proto in [GRE, IPIP, EXPERIMENTAL] {
            assert!(loaded.send(&portless(proto, addr(1, 1), addr(0, 1))), "y -> x proto {proto} (IPv6 {ipv6})");
            assert!(
                loaded.send(&portless(proto, addr(0, 1), addr(1, 1))),
                "x answers y: tracked, although x's egress admits only TCP 80 (proto {proto}, IPv6 {ipv6})"
            );
            assert!(!loaded.send(&portless(proto, addr(2, 1), addr(0, 1))), "z -> x proto {proto} (IPv6 {ipv6})");
            assert!(!loaded.send(&portless(proto, outside, addr(0, 1))), "outside -> x proto {proto}");
            assert!(!loaded.send(&portless(proto, addr(0, 2), addr(1, 2))), "x -> y proto {proto} (IPv6 {ipv6})");
        }
    }
    let stats = loaded.stats();
    // Per family and protocol: z and the outside are outside the peers of x's rule without ports;
    // x's egress has no rule without ports at all.
    assert_eq!(stats[pol_stat::DENIED_INGRESS as usize], 2 * 3 * 2);
    assert_eq!((stats[pol_stat::DENIED_EGRESS as usize], stats[pol_stat::NO_PORT_MATCH as usize]), (2 * 3, 2 * 3));
    // Per family and protocol: y -> x, z -> x, outside -> x, x -> y (x's answer was tracked).
    assert_eq!(guard_stats(&loaded)[pol_guard_stat::OTHER_PROTOCOL_JUDGED as usize], 2 * 3 * 4);
}

/// 802.1ad outer tag, 802.1Q inner tag (VLAN ids `outer`, `inner`) around the IPv4 packet of
/// `frame`.
fn double_tagged(frame: &[u8], outer: u16, inner: u16) -> Vec<u8> {
    let mut tagged = frame[..12].to_vec();
    tagged.extend_from_slice(&[0x88, 0xa8]);
    tagged.extend_from_slice(&outer.to_be_bytes());
    tagged.extend_from_slice(&[0x81, 0x00]);
    tagged.extend_from_slice(&inner.to_be_bytes());
    tagged.extend_from_slice(&frame[12..]);
    tagged
}

/// Guard: frames of an ethertype other than IPv4, IPv6 and ARP, VLAN tags included, are dropped
/// at both hooks of every pod veth, isolated or not (enforce's ethertype match).
#[test]
fn frames_other_than_ip_and_arp_are_dropped_at_both_hooks_isolated_or_not() {
    let loaded = load("ethertypes");
    let syn = packet::ipv4(packet::TCP, (ip(1, 0), 1000), (ip(0, 0), 80), packet::TCP_SYN, b"");
    let mut unknown = syn.clone();
    unknown[12..14].copy_from_slice(&0x88b5u16.to_be_bytes()); // IEEE local experimental
    let mut single = syn[..12].to_vec();
    single.extend_from_slice(&[0x81, 0x00, 0x00, 0x00]);
    single.extend_from_slice(&syn[12..]);
    let stacked = double_tagged(&syn, 0, 0);
    for frame in [&unknown, &single, &stacked] {
        assert_eq!(run(loaded.fd(Hook::PolicyIngress), frame, 1).unwrap().retval, TC_ACT_SHOT);
        assert_eq!(run_forwarded(loaded.fd(Hook::PolicyEgress), frame, 1, 1).unwrap().retval, TC_ACT_SHOT);
    }
    let mut arp = syn.clone();
    arp[12..14].copy_from_slice(&[0x08, 0x06]);
    assert!(loaded.send(&arp));
    assert!(loaded.send(&syn), "no policy: the untagged packet passes");
    let guard = guard_stats(&loaded);
    assert_eq!((guard[pol_guard_stat::DROP_UNKNOWN_L3 as usize], guard[pol_guard_stat::DROP_VLAN as usize]), (2, 4));
}

/// Guard: a packet whose headers cannot be read is dropped at an isolated pod's hooks
/// (`policy::malformed`), not handed on unjudged: a tiny first fragment whose TCP flags are cut
/// off (its later fragments would follow it through), an IPv6 TCP header cut short
/// (BPF_PROG_TEST_RUN itself refuses frames shorter than their IP header). A pod isolated in
/// neither direction admits every packet, so its hooks read nothing past the address (the
/// gate): they pass these. An IP header of the wrong version (an IPv4 ethertype over an IPv6
/// header) has no address to gate on and is dropped at every pod's hooks.
#[test]
fn packets_whose_headers_cannot_be_read_are_dropped_at_an_isolated_pod() {
    let mut loaded = load("malformed");
    loaded.program(&Cluster::xyz().compile(&[policy("x", "deny", json!({"podSelector": {}}))]));
    // Between x (isolated both ways) and z (not isolated), each way.
    let unreadable = |(from, to): (usize, usize)| {
        let segment = packet::l4_segment(packet::TCP, (ip(from, 0), 1000), (ip(to, 0), 80), packet::TCP_SYN, b"");
        let tiny_first_fragment = packet::ipv4_frame(packet::TCP, ip(from, 0), ip(to, 0), 0x2000, &segment[..8]);
        let v6 = packet::ipv6(packet::TCP, (ip6(from, 0), 1000), (ip6(to, 0), 80), packet::TCP_SYN, b"");
        [tiny_first_fragment, v6[..14 + 40 + 10].to_vec()]
    };
    let (x, z) = (0, 2);
    for frame in unreadable((x, z)) {
        assert_eq!(run(loaded.fd(Hook::PolicyIngress), &frame, 1).unwrap().retval, TC_ACT_SHOT, "from x");
        assert_eq!(run_forwarded(loaded.fd(Hook::PolicyEgress), &frame, 1, 1).unwrap().retval, TC_ACT_UNSPEC, "to z");
    }
    for frame in unreadable((z, x)) {
        assert_eq!(run(loaded.fd(Hook::PolicyIngress), &frame, 1).unwrap().retval, TC_ACT_UNSPEC, "from z");
        assert_eq!(run_forwarded(loaded.fd(Hook::PolicyEgress), &frame, 1, 1).unwrap().retval, TC_ACT_SHOT, "to x");
    }
    assert_eq!(guard_stats(&loaded)[pol_guard_stat::DROP_MALFORMED as usize], 4);
    let mut wrong_version = packet::ipv6(packet::TCP, (ip6(z, 0), 1000), (ip6(x, 0), 80), packet::TCP_SYN, b"");
    wrong_version[12..14].copy_from_slice(&[0x08, 0x00]);
    let mut wrong_version_to_z = packet::ipv6(packet::TCP, (ip6(x, 0), 1000), (ip6(z, 0), 80), packet::TCP_SYN, b"");
    wrong_version_to_z[12..14].copy_from_slice(&[0x08, 0x00]);
    for frame in [&wrong_version, &wrong_version_to_z] {
        assert_eq!(run(loaded.fd(Hook::PolicyIngress), frame, 1).unwrap().retval, TC_ACT_SHOT);
        assert_eq!(run_forwarded(loaded.fd(Hook::PolicyEgress), frame, 1, 1).unwrap().retval, TC_ACT_SHOT);
    }
    assert_eq!(guard_stats(&loaded)[pol_guard_stat::DROP_MALFORMED as usize], 4 + 4);
}

/// Guard: an ICMP error passes an isolated pod when it quotes one of the pod's live connections
/// (`policy::related`): "fragmentation needed" / "packet too big" for a connection x opened
/// (path MTU discovery keeps working), x's own "port unreachable" for a datagram y was allowed
/// to send it. An error quoting no connection of the pod is judged as ICMP without ports.
#[test]
fn icmp_errors_pass_for_a_live_connection_and_are_judged_as_icmp_otherwise() {
    let policies = [policy(
        "x",
        "in-out",
        json!({"podSelector": {}, "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"ns": "y"}}}], "ports": [{"port": 53, "protocol": "UDP"}]}],
            "egress": [{"to": [{"namespaceSelector": {"matchLabels": {"ns": "z"}}}], "ports": [{"port": 443}]}]}),
    )];
    let mut loaded = load("icmp-errors");
    loaded.program(&Cluster::xyz().compile(&policies));
    let router = Ipv4Addr::new(10, 0, 0, 254);
    // x opens TCP to z:443; a router on the way answers "fragmentation needed".
    let to_z = packet::ipv4(packet::TCP, (ip(0, 0), 40000), (ip(2, 0), 443), packet::TCP_ACK, b"big");
    assert!(loaded.send(&to_z));
    assert!(loaded.send(&packet::icmp_error(3, 4, router, ip(0, 0), &to_z)), "frag needed for x's connection");
    let never_sent = packet::ipv4(packet::TCP, (ip(0, 0), 40001), (ip(2, 0), 443), packet::TCP_ACK, b"big");
    assert!(!loaded.send(&packet::icmp_error(3, 4, router, ip(0, 0), &never_sent)), "quotes no connection");
    // y sends x a datagram on an allowed port; x answers "port unreachable" through its egress.
    let from_y = packet::ipv4(packet::UDP, (ip(1, 0), 5353), (ip(0, 0), 53), 0, b"query");
    assert!(loaded.send(&from_y));
    assert!(loaded.send(&packet::icmp_error(3, 3, ip(0, 0), ip(1, 0), &from_y)), "x's error about y's datagram");
    let not_received = packet::ipv4(packet::UDP, (ip(1, 0), 5354), (ip(0, 0), 53), 0, b"query");
    assert!(!loaded.send(&packet::icmp_error(3, 3, ip(0, 0), ip(1, 0), &not_received)));
    // IPv6: "packet too big" for x's connection.
    let to_z6 = packet::ipv6(packet::TCP, (ip6(0, 0), 40000), (ip6(2, 0), 443), packet::TCP_ACK, b"big");
    assert!(loaded.send(&to_z6));
    let router6 = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0xfe);
    assert!(loaded.send(&packet::icmpv6_error(2, 0, router6, ip6(0, 0), &to_z6)), "packet too big");
    let never_sent6 = packet::ipv6(packet::TCP, (ip6(0, 0), 40001), (ip6(2, 0), 443), packet::TCP_ACK, b"big");
    assert!(!loaded.send(&packet::icmpv6_error(2, 0, router6, ip6(0, 0), &never_sent6)));
    // Each passes x's end of `send` as related; the other end (a router, a pod of y or z) is
    // isolated in neither direction and not tracked (the gate): it passes `not_isolated`.
    assert_eq!(guard_stats(&loaded)[pol_guard_stat::ICMP_ERROR_RELATED as usize], 3);
}

/// Guard: a new flow's policy conntrack entry is marked unreplied and lives a minute
/// (`POLICY_CT_UNREPLIED`), so unanswered SYNs cannot hold `pol_ct_v4` for six hours; the first
/// reply clears the mark and the connection keeps its hours. Clock: the GC's, set by the test.
#[test]
fn an_unanswered_flow_is_tracked_for_a_minute_and_an_answered_one_for_hours() {
    use kube_router::pinned::conntrack_gc::monotonic_now_ns;
    use kube_router_common::{POLICY_CT_LIFETIME_UNREPLIED_SECS, POLICY_CT_UNREPLIED};
    let mut loaded = load("unreplied");
    loaded.program(&Cluster::xyz().compile(&[policy(
        "x",
        "from-y",
        json!({"podSelector": {}, "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"ns": "y"}}}]}]}),
    )]));
    let syn = |sport| packet::ipv4(packet::TCP, (ip(1, 0), sport), (ip(0, 0), 80), packet::TCP_SYN, b"");
    assert!(loaded.send(&syn(41000)), "unanswered");
    assert!(loaded.send(&syn(41001)));
    let reply = packet::ipv4(packet::TCP, (ip(0, 0), 80), (ip(1, 0), 41001), packet::TCP_SYN | packet::TCP_ACK, b"");
    assert!(loaded.send(&reply));
    let mut conntrack = PolicyConntrack::open_pinned(&loaded.pin_dir).unwrap();
    let unreplied = |conntrack: &PolicyConntrack| -> Vec<(u16, bool)> {
        let mut entries: Vec<(u16, bool)> = conntrack
            .entries()
            .unwrap()
            .into_iter()
            .filter(|(key, _)| key.pod_addr == u32::from_ne_bytes(ip(0, 0).octets()))
            .map(|(key, value)| (u16::from_be(key.peer_port), value.flags & POLICY_CT_UNREPLIED != 0))
            .collect();
        entries.sort();
        entries
    };
    assert_eq!(unreplied(&conntrack), [(41000, true), (41001, false)], "x's entries: the reply cleared the mark");
    let later = monotonic_now_ns() + (POLICY_CT_LIFETIME_UNREPLIED_SECS + 1) * 1_000_000_000;
    conntrack.collect_garbage_at(later).unwrap();
    assert_eq!(unreplied(&conntrack), [(41001, false)], "a minute later only the answered connection is left");
}

// ---- layout check and attachment -------------------------------------------------------------

#[test]
fn a_policy_map_with_another_layout_is_refused() {
    let pin_dir = PathBuf::from("/sys/fs/bpf/krt-pol-test-layout");
    let _ = datapath::remove_all(&pin_dir);
    let path = kube_router::pinned::pinned_map(&pin_dir, "pol_pods_v4");
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let created = std::process::Command::new("bpftool")
        .args(["map", "create", path.to_str().unwrap(), "type", "hash", "key", "8", "value", "40"])
        .args(["entries", "16", "name", "pol_pods_v4"])
        .status()
        .unwrap();
    assert!(created.success());
    let message = format!("{:#}", Datapath::load(&pin_dir).err().expect("must refuse"));
    assert!(
        message.contains("pol_pods_v4") && message.contains("value=40B") && message.contains("value=8B"),
        "{message}"
    );
    let _ = datapath::remove_all(&pin_dir);
}

/// A veth pair in the test's namespace (the kernel here has no dummy driver), like a pod's.
struct VethPair(&'static str);

impl VethPair {
    fn create(name: &'static str) -> VethPair {
        let _ =
            std::process::Command::new("ip").args(["link", "del", name]).stderr(std::process::Stdio::null()).status();
        let peer = format!("{name}p");
        let ok = std::process::Command::new("ip")
            .args(["link", "add", name, "type", "veth", "peer", "name", &peer])
            .status()
            .unwrap();
        assert!(ok.success(), "ip link add {name}");
        VethPair(name)
    }
}

impl Drop for VethPair {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip").args(["link", "del", self.0]).status();
    }
}

fn chain(interface: &str, attach_type: aya::programs::TcAttachType) -> Vec<String> {
    let (_, programs) = aya::programs::SchedClassifier::query_tcx(interface, attach_type).unwrap();
    programs.iter().map(|p| p.name_as_str().unwrap_or("?").to_string()).collect()
}

#[test]
fn policy_and_lb_on_one_interface_run_in_the_right_order_whichever_is_attached_first() {
    use aya::programs::TcAttachType::{Egress, Ingress};
    let mut loaded = load("attach");
    for (name, lb_first) in [("krpoltest0", true), ("krpoltest1", false)] {
        let _interface = VethPair::create(name);
        if lb_first {
            loaded.datapath.attach(name).unwrap();
            loaded.datapath.attach_policy(name).unwrap();
        } else {
            loaded.datapath.attach_policy(name).unwrap();
            loaded.datapath.attach(name).unwrap();
        }
        assert_eq!(chain(name, Ingress), ["kr_lb_ingress", "kr_pol_ingress"], "{name}: DNAT, then the check");
        assert_eq!(chain(name, Egress), ["kr_pol_egress", "kr_lb_egress"], "{name}: the check, then reverse NAT");
        assert!(Datapath::link_path(&loaded.pin_dir, Hook::PolicyIngress, name).exists());
        assert!(loaded.pin_dir.join("links").join(format!("pol_egress_{name}")).exists());
        // Attaching again adopts the pinned links.
        let again = loaded.datapath.attach_policy(name).unwrap();
        assert_eq!(again, [datapath::AttachOutcome::Adopted; 2]);
    }
}

#[test]
fn ipv6_neighbour_discovery_passes_an_isolated_pod_and_extension_headers_are_looked_past() {
    let mut loaded = load("v6-nd");
    let allow_y = policy(
        "x",
        "from-y",
        json!({"podSelector": {}, "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"ns": "y"}}}]}]}),
    );
    loaded.program(&Cluster::xyz().compile(&[allow_y]));
    let (x_a, y_a, z_a) = (ip6(0, 0), ip6(1, 0), ip6(2, 0));
    let before = loaded.stats();
    // Neighbour discovery, router advertisements and multicast listener messages from a denied
    // peer pass: without them the isolated pod could not even reach its allowed peers.
    for control in [130, 131, 133, 134, 135, 136, 143] {
        assert!(loaded.send(&packet::icmpv6_echo(control, z_a, x_a, 0)), "ICMPv6 type {control}");
    }
    let after = loaded.stats();
    // At x's hook; z's (isolated in neither direction) passes them unparsed.
    assert_eq!(after[pol_stat::NOT_EVALUATED as usize] - before[pol_stat::NOT_EVALUATED as usize], 7);
    assert_eq!(after[pol_stat::NOT_ISOLATED as usize] - before[pol_stat::NOT_ISOLATED as usize], 7);
    let tracked = PolicyConntrack::open_pinned(&loaded.pin_dir).unwrap().entries_v6().unwrap();
    assert!(tracked.is_empty(), "control messages open no connection: {tracked:?}");
    // Echo is judged like IPv4's: denied from z, and only a rule without ports admits it.
    assert!(!loaded.send(&packet::icmpv6_echo(128, z_a, x_a, 7)));
    assert!(loaded.send(&packet::icmpv6_echo(128, y_a, x_a, 8)));
    // A TCP SYN behind a hop-by-hop options header is judged on its real ports.
    let with_hop_by_hop = |src: Ipv6Addr, sport: u16| {
        let tcp = packet::l4_segment_v6(packet::TCP, (src, sport), (x_a, 80), packet::TCP_SYN, b"");
        let mut payload = vec![packet::TCP, 0, 1, 4, 0, 0, 0, 0]; // next TCP, 8 bytes, PadN
        payload.extend_from_slice(&tcp);
        packet::ipv6_frame(0, src, x_a, &payload)
    };
    assert!(!loaded.send(&with_hop_by_hop(z_a, 30001)), "z is denied behind an extension header too");
    assert!(loaded.send(&with_hop_by_hop(y_a, 30002)));
    let denied = loaded.stats()[pol_stat::DENIED_INGRESS as usize] - before[pol_stat::DENIED_INGRESS as usize];
    assert_eq!(denied, 2);
}

// ---- upgrade from layout 2 --------------------------------------------------------------------

/// Layout 2's policy rule map, as a layout-2 agent left it.
mod layout2 {
    #[repr(C)]
    #[derive(Clone, Copy)]
    pub struct RuleKey {
        pub slot: u32,
        pub rule_index: u32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    pub struct PortRange {
        pub proto: u8,
        pub pad: u8,
        pub start: u16,
        pub end: u16,
    }
    #[repr(C)]
    #[derive(Clone, Copy)]
    pub struct RuleValue {
        pub peer_set: u32,
        pub range_count: u8,
        pub pad: [u8; 3],
        pub ranges: [PortRange; 8],
    }
    // SAFETY: repr(C), integers only, explicit padding.
    unsafe impl aya::Pod for RuleKey {}
    unsafe impl aya::Pod for RuleValue {}
}

/// Maps a layout-2 agent pinned in `v2/`: a pod isolated by two rules (peers 10.0.2.0/24 on TCP
/// 80-90, peer 10.0.3.1 on every port). The upgrade builds the port index from them before the
/// programs swap, and the new programs judge every probe as the old rules did.
#[test]
fn a_layout_2_policy_is_judged_alike_after_the_upgrade() {
    use aya::maps::{lpm_trie::Key, HashMap, LpmTrie, Map, MapData};
    use kube_router_common::{PeerPrefixV4, PolicyPodKeyV4, PolicyPodValue, PEER_ALLOW, POLICY_DIR_INGRESS};
    let pin_dir = PathBuf::from("/sys/fs/bpf/krt-pol-test-upgrade");
    let _ = datapath::remove_all(&pin_dir);
    let _ = std::fs::remove_dir_all(pin_dir.join("v2"));
    let old = pin_dir.join("v2");
    std::fs::create_dir_all(&old).unwrap();
    let create = |name: &str, kind: &str, key: &str, value: &str, flags: &[&str]| {
        let path = old.join(name);
        let status = std::process::Command::new("bpftool")
            .args(["map", "create", path.to_str().unwrap(), "type", kind, "key", key, "value", value])
            .args(["entries", "64", "name", name])
            .args(flags)
            .status()
            .unwrap();
        assert!(status.success(), "bpftool map create {name}");
        MapData::from_pin(path).unwrap()
    };
    let mut pods: HashMap<MapData, PolicyPodKeyV4, PolicyPodValue> =
        HashMap::try_from(Map::HashMap(create("pol_pods_v4", "hash", "8", "8", &[]))).unwrap();
    let mut rules: HashMap<MapData, layout2::RuleKey, layout2::RuleValue> =
        HashMap::try_from(Map::HashMap(create("pol_rules", "hash", "8", "56", &[]))).unwrap();
    let mut peers: LpmTrie<MapData, PeerPrefixV4, u8> =
        LpmTrie::try_from(Map::LpmTrie(create("pol_peers_v4", "lpm_trie", "12", "1", &["flags", "1"]))).unwrap();
    let pod = ip(0, 0);
    let key = PolicyPodKeyV4 { addr: u32::from_ne_bytes(pod.octets()), direction: POLICY_DIR_INGRESS, pad: [0; 3] };
    pods.insert(key, PolicyPodValue { slot: 5, rule_count: 2 }, 0).unwrap();
    let mut tcp_80_90 = layout2::RuleValue { peer_set: 3, range_count: 1, pad: [0; 3], ranges: Default::default() };
    tcp_80_90.ranges[0] = layout2::PortRange { proto: packet::TCP, pad: 0, start: 80, end: 90 };
    rules.insert(layout2::RuleKey { slot: 5, rule_index: 0 }, tcp_80_90, 0).unwrap();
    let everything = layout2::RuleValue { peer_set: 4, range_count: 0xff, pad: [0; 3], ranges: Default::default() };
    rules.insert(layout2::RuleKey { slot: 5, rule_index: 1 }, everything, 0).unwrap();
    let prefix = |set: u32, addr: [u8; 4], bits: u32| {
        Key::new(32 + bits, PeerPrefixV4 { peer_set_be: set.to_be(), addr: u32::from_ne_bytes(addr) })
    };
    peers.insert(&prefix(3, [10, 0, 2, 0], 24), PEER_ALLOW, 0).unwrap();
    peers.insert(&prefix(4, [10, 0, 3, 1], 32), PEER_ALLOW, 0).unwrap();
    drop((pods, rules, peers));

    let datapath = Datapath::load(&pin_dir).expect("load over layout 2");
    let mut loaded = Loaded {
        datapath,
        pin_dir,
        flattener: MapFlattener::new(),
        programmed: MapEntries::default(),
        next_port: 30000,
    };
    let (in_set_3, in_set_4, outside) = (ip(1, 6), ip(2, 0), ip(2, 1));
    assert_eq!(in_set_3, Ipv4Addr::new(10, 0, 2, 7));
    for (peer, port, admitted) in [
        (in_set_3, 80, true),
        (in_set_3, 90, true),
        (in_set_3, 91, false),
        (in_set_4, 91, true),
        (in_set_4, 85, true),
        (outside, 85, false),
        (outside, 1, false),
    ] {
        assert_eq!(loaded.connect(packet::TCP, peer, pod, port).1, admitted, "{peer}:{port}");
    }
    assert!(loaded.connect(packet::UDP, in_set_4, pod, 53).1, "the rule without ports admits UDP");
    assert!(!loaded.connect(packet::UDP, in_set_3, pod, 85).1, "TCP ports only");
    // Once the programs run over our maps, the old layout goes.
    loaded.datapath.finish_upgrade().unwrap();
    assert!(!old.exists());
}
