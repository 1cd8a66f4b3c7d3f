//! NetworkPolicy conformance in the style of the upstream e2e "truth tables": pods a, b, c in
//! namespaces x, y, z, each its own network namespace behind a veth of one node; the agent (API
//! mode, the real kube-rs client against the fake API server) enforces policy on those veths.
//! For every scenario the test probes every pod from every other pod on TCP 80, TCP 81 and
//! UDP 53 with real connections, prints the matrix and compares it with the expected one,
//! written down here from the NetworkPolicy semantics (not computed by our compiler).
//! Then: the same matrix through an API black-hole, with the agent killed, and with a broken
//! policy added. As root.
use std::{
    collections::BTreeMap,
    fmt::Write as _,
    sync::Arc,
    thread,
    time::{Duration, Instant},
};

use kube_router_tests::{
    apiserver::{FakeApiServer, FakeApiServerConfig, FaultMode},
    netprobe_bin, remove_bpf_root, veth, wait_until, Agent, Netns, NetnsRuntime, Writes,
};
use serde_json::{json, Value};

const NAMESPACES: [&str; 3] = ["x", "y", "z"];
const PODS: [&str; 3] = ["a", "b", "c"];
const PORTS: [Port; 3] = [Port::Tcp(80), Port::Tcp(81), Port::Udp(53)];
const HEALTH_PORT: &str = "20263";
const METRICS_PORT: &str = "20264";
const BPF_ROOT: &str = "/sys/fs/bpf/krt-np";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Port {
    Tcp(u16),
    Udp(u16),
}

impl Port {
    fn label(self) -> String {
        match self {
            Port::Tcp(p) => format!("tcp/{p}"),
            Port::Udp(p) => format!("udp/{p}"),
        }
    }
    fn target(self, ip: &str) -> String {
        let ip = if ip.contains(':') { format!("[{ip}]") } else { ip.to_string() };
        match self {
            Port::Tcp(p) => format!("tcp:{ip}:{p}"),
            Port::Udp(p) => format!("udp:{ip}:{p}"),
        }
    }
}

#[derive(Clone, PartialEq, Eq, Debug)]
struct PodId {
    ns: &'static str,
    pod: &'static str,
    index: usize,
}

impl PodId {
    fn ip(&self) -> String {
        format!("10.1.{}.2", self.index)
    }
    fn ip6(&self) -> String {
        format!("fd00:1:{}::2", self.index)
    }
    /// The pod's address of one family.
    fn addr(&self, ipv6: bool) -> String {
        if ipv6 {
            self.ip6()
        } else {
            self.ip()
        }
    }
    fn is(&self, name: &str) -> bool {
        format!("{}/{}", self.ns, self.pod) == name
    }
}

fn all_pods() -> Vec<PodId> {
    let mut pods = Vec::new();
    for ns in NAMESPACES {
        for pod in PODS {
            pods.push(PodId { ns, pod, index: pods.len() + 1 });
        }
    }
    pods
}

struct Cluster {
    node: Netns,
    pods: Vec<(PodId, Netns)>,
    runtime: NetnsRuntime,
    server: Arc<FakeApiServer>,
    state_dir: std::path::PathBuf,
}

impl Cluster {
    fn new() -> Self {
        let node = Netns::new("krt-np-node").unwrap();
        node.sysctl("net.ipv4.ip_forward", "1").unwrap();
        node.sysctl("net.ipv6.conf.all.forwarding", "1").unwrap();
        let mut pods = Vec::new();
        for id in all_pods() {
            let ns = Netns::new(&format!("krt-np-{}-{}", id.ns, id.pod)).unwrap();
            let k = id.index;
            veth(&node, &format!("pod{k}"), &format!("10.1.{k}.1/24"), &ns, "eth0", &format!("10.1.{k}.2/24")).unwrap();
            ns.run(&["ip", "route", "add", "default", "via", &format!("10.1.{k}.1")]).unwrap();
            // Dual-stack pods: every scenario is probed over IPv6 too.
            node.run(&["ip", "addr", "add", &format!("fd00:1:{k}::1/48"), "dev", &format!("pod{k}"), "nodad"]).unwrap();
            ns.run(&["ip", "addr", "add", &format!("fd00:1:{k}::2/48"), "dev", "eth0", "nodad"]).unwrap();
            ns.run(&["ip", "-6", "route", "add", "default", "via", &format!("fd00:1:{k}::1")]).unwrap();
            for port in ["80", "81", "53"] {
                ns.spawn(&[netprobe_bin().to_str().unwrap(), "serve", &format!("{}/{}", id.ns, id.pod), port]).unwrap();
            }
            pods.push((id, ns));
        }
        remove_bpf_root(std::path::Path::new(BPF_ROOT));
        let runtime = NetnsRuntime::new(&node).unwrap();
        let server =
            Arc::new(runtime.run(async { FakeApiServer::spawn(FakeApiServerConfig::default()).await.unwrap() }));
        for ns in NAMESPACES {
            server
                .apply(json!({"apiVersion": "v1", "kind": "Namespace",
                    "metadata": {"name": ns, "labels": {"ns": ns, "kubernetes.io/metadata.name": ns}}}))
                .unwrap();
        }
        for (id, _) in &pods {
            server.apply(pod_object(id)).unwrap();
        }
        let state_dir = std::env::temp_dir().join("krt-np-state");
        let _ = std::fs::remove_dir_all(&state_dir);
        Cluster { node, pods, runtime, server, state_dir }
    }

    fn start_agent(&self) -> Agent {
        let interfaces: Vec<String> = self.pods.iter().map(|(id, _)| format!("pod{}", id.index)).collect();
        let args = [
            "--enable-cni=false",
            "--master",
            &self.server.url(),
            "--hostname-override",
            "node-1",
            "--run-service-proxy=false",
            "--run-router=false",
            "--interfaces",
            &interfaces.join(","),
            "--state-dir",
            self.state_dir.to_str().unwrap(),
            "--health-port",
            HEALTH_PORT,
            "--metrics-port",
            METRICS_PORT,
        ];
        Agent::start(&self.node, std::path::Path::new(BPF_ROOT), &args).unwrap()
    }

    /// The body of the agent's /healthz (what it knows of the API).
    fn health(&self) -> String {
        let address = format!("127.0.0.1:{HEALTH_PORT}");
        self.node.run(&[netprobe_bin().to_str().unwrap(), "http", &address, "/healthz"]).unwrap_or_default()
    }

    fn set_mode(&self, mode: FaultMode) {
        let server = self.server.clone();
        self.runtime.run(async move { server.set_mode(mode).await.unwrap() });
    }

    /// Replaces every NetworkPolicy with `policies`.
    fn set_policies(&self, policies: &[Value]) {
        for ns in NAMESPACES {
            for name in ["p1", "p2", "p3", "broken"] {
                let _ = self.server.delete("NetworkPolicy", Some(ns), name);
            }
        }
        for policy in policies {
            self.server.apply(policy.clone()).unwrap();
        }
    }

    /// allowed[(src, dst, port)] from real connections over one address family. Every source
    /// at once: a denied probe waits out its 500 ms, once per matrix rather than once per pod.
    fn probe(&self, ipv6: bool) -> BTreeMap<(usize, usize, usize), bool> {
        let handles: Vec<(usize, String)> = thread::scope(|scope| {
            let running: Vec<_> = self
                .pods
                .iter()
                .map(|(src, ns)| {
                    let targets: Vec<String> = self
                        .pods
                        .iter()
                        .filter(|(dst, _)| dst != src)
                        .flat_map(|(dst, _)| PORTS.iter().map(move |p| p.target(&dst.addr(ipv6))))
                        .collect();
                    let mut args = vec![netprobe_bin().to_string_lossy().into_owned(), "matrix".into(), "500".into()];
                    args.extend(targets);
                    let probe = scope.spawn(move || ns.run(&args.iter().map(String::as_str).collect::<Vec<_>>()));
                    (src.index, probe)
                })
                .collect();
            running.into_iter().map(|(src, probe)| (src, probe.join().unwrap().unwrap())).collect()
        });
        let mut result = BTreeMap::new();
        for (src, output) in handles {
            for line in output.lines() {
                let mut fields = line.split_whitespace();
                let target = fields.next().unwrap();
                let ok = fields.next() == Some("OK");
                let (proto, rest) = target.split_once(':').unwrap();
                let (ip, port) = rest.rsplit_once(':').unwrap();
                let ip = ip.trim_start_matches('[').trim_end_matches(']');
                let dst = self.pods.iter().find(|(id, _)| id.addr(ipv6) == ip).unwrap().0.index;
                let port: u16 = port.parse().unwrap();
                let port_index = PORTS
                    .iter()
                    .position(|p| *p == if proto == "tcp" { Port::Tcp(port) } else { Port::Udp(port) })
                    .unwrap();
                result.insert((src, dst, port_index), ok);
            }
        }
        result
    }
}

fn pod_object(id: &PodId) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"namespace": id.ns, "name": id.pod, "labels": {"pod": id.pod}},
        "spec": {"nodeName": "node-1", "containers": [{"name": "server", "image": "krt-netprobe", "ports": [
            {"name": "serve-80", "containerPort": 80, "protocol": "TCP"},
            {"name": "serve-81", "containerPort": 81, "protocol": "TCP"},
            {"name": "dns", "containerPort": 53, "protocol": "UDP"}]}]},
        "status": {"phase": "Running", "podIP": id.ip(), "podIPs": [{"ip": id.ip()}, {"ip": id.ip6()}]}
    })
}

fn policy(ns: &str, name: &str, spec: Value) -> Value {
    json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
           "metadata": {"namespace": ns, "name": name}, "spec": spec})
}

type Expectation = fn(&PodId, &PodId, Port) -> bool;

/// The probe matrix as upstream prints it: one table per port, rows = from, columns = to.
fn render(matrix: &BTreeMap<(usize, usize, usize), bool>, expected: Option<Expectation>) -> String {
    let pods = all_pods();
    let mut out = String::new();
    for (pi, port) in PORTS.iter().enumerate() {
        let _ = writeln!(
            out,
            "{:<6} {}",
            port.label(),
            pods.iter().map(|p| format!("{}/{}", p.ns, p.pod)).collect::<Vec<_>>().join(" ")
        );
        for src in &pods {
            let cells: Vec<String> = pods
                .iter()
                .map(|dst| {
                    if src == dst {
                        return " - ".to_string();
                    }
                    let got = matrix[&(src.index, dst.index, pi)];
                    let mark = if got { "." } else { "X" };
                    match expected {
                        Some(f) if f(src, dst, *port) != got => format!("!{mark}!"),
                        _ => format!(" {mark} "),
                    }
                })
                .collect();
            let _ = writeln!(out, "{:<6} {}", format!("{}/{}", src.ns, src.pod), cells.join(""));
        }
    }
    out
}

/// The truth table of one scenario holds over IPv4 and over IPv6; the IPv4 matrix.
fn check(cluster: &Cluster, title: &str, expected: Expectation) -> BTreeMap<(usize, usize, usize), bool> {
    let matrix = check_family(cluster, title, expected, false);
    let matrix6 = check_family(cluster, &format!("{title} (IPv6)"), expected, true);
    assert_eq!(matrix6, matrix, "{title}: the IPv6 verdicts differ from the IPv4 ones");
    matrix
}

fn check_family(
    cluster: &Cluster,
    title: &str,
    expected: Expectation,
    ipv6: bool,
) -> BTreeMap<(usize, usize, usize), bool> {
    let pods = all_pods();
    // A change reaches the maps within a sync tick; probe until the matrix is right or 15 s pass.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let matrix = cluster.probe(ipv6);
        let wrong: Vec<String> = pods
            .iter()
            .flat_map(|s| pods.iter().map(move |d| (s, d)))
            .filter(|(s, d)| s != d)
            .flat_map(|(s, d)| PORTS.iter().enumerate().map(move |(pi, p)| (s, d, pi, *p)))
            .filter(|(s, d, pi, p)| matrix[&(s.index, d.index, *pi)] != expected(s, d, *p))
            .map(|(s, d, _, p)| format!("{}/{} -> {}/{} {}", s.ns, s.pod, d.ns, d.pod, p.label()))
            .collect();
        if wrong.is_empty() {
            println!("=== {title}: matrix as expected (. allowed, X denied)\n{}", render(&matrix, Some(expected)));
            return matrix;
        }
        if Instant::now() > deadline {
            panic!("=== {title}: {} probes wrong ({wrong:?})\n{}", wrong.len(), render(&matrix, Some(expected)));
        }
        thread::sleep(Duration::from_millis(500));
    }
}

fn deny_ingress_x(_s: &PodId, d: &PodId, _p: Port) -> bool {
    d.ns != "x"
}

fn deny_egress_x(s: &PodId, _d: &PodId, _p: Port) -> bool {
    s.ns != "x"
}

fn xa_from_namespace_y(s: &PodId, d: &PodId, _p: Port) -> bool {
    !d.is("x/a") || s.ns == "y"
}

fn xa_from_y_pod_b(s: &PodId, d: &PodId, _p: Port) -> bool {
    !d.is("x/a") || s.is("y/b")
}

fn xa_from_cidr_except_yb(s: &PodId, d: &PodId, _p: Port) -> bool {
    !d.is("x/a") || !s.is("y/b")
}

fn xa_named_port_81(_s: &PodId, d: &PodId, p: Port) -> bool {
    !d.is("x/a") || p == Port::Tcp(81)
}

fn xa_port_range_81_to_90(_s: &PodId, d: &PodId, p: Port) -> bool {
    !d.is("x/a") || p == Port::Tcp(81)
}

fn xa_egress_dns_only(s: &PodId, _d: &PodId, p: Port) -> bool {
    !s.is("x/a") || p == Port::Udp(53)
}

fn xa_union_y_and_zc(s: &PodId, d: &PodId, _p: Port) -> bool {
    !d.is("x/a") || s.ns == "y" || s.is("z/c")
}

fn union_policies() -> Vec<Value> {
    vec![
        policy(
            "x",
            "p1",
            json!({"podSelector": {"matchLabels": {"pod": "a"}}, "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"ns": "y"}}}]}]}),
        ),
        policy(
            "x",
            "p2",
            json!({"podSelector": {"matchLabels": {"pod": "a"}},
            "ingress": [{"from": [{"namespaceSelector": {"matchExpressions": [{"key": "ns", "operator": "In", "values": ["z"]}]},
                                   "podSelector": {"matchLabels": {"pod": "c"}}}]}]}),
        ),
    ]
}

#[test]
fn the_policy_truth_tables_hold_with_real_connections_and_survive_outage_restart_and_bad_input() {
    let cluster = Cluster::new();
    let mut agent = cluster.start_agent();
    agent.wait_for_policy_syncs(1, Duration::from_secs(30)).unwrap();
    check(&cluster, "no policies: everything allowed", |_, _, _| true);

    let yb = all_pods().into_iter().find(|p| p.is("y/b")).unwrap();
    let scenarios: Vec<(&str, Vec<Value>, Expectation)> = vec![
        (
            "default deny ingress in x",
            vec![policy("x", "p1", json!({"podSelector": {}, "policyTypes": ["Ingress"]}))],
            deny_ingress_x,
        ),
        (
            "default deny egress in x",
            vec![policy("x", "p1", json!({"podSelector": {}, "policyTypes": ["Egress"]}))],
            deny_egress_x,
        ),
        (
            "x/a allows ingress from namespace y",
            vec![policy(
                "x",
                "p1",
                json!({"podSelector": {"matchLabels": {"pod": "a"}},
                "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"ns": "y"}}}]}]}),
            )],
            xa_from_namespace_y,
        ),
        (
            "x/a allows ingress from pods b in namespace y (namespaceSelector AND podSelector)",
            vec![policy(
                "x",
                "p1",
                json!({"podSelector": {"matchLabels": {"pod": "a"}},
                "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"ns": "y"}}, "podSelector": {"matchLabels": {"pod": "b"}}}]}]}),
            )],
            xa_from_y_pod_b,
        ),
        (
            "x/a allows ingress from ipBlock 10.1.0.0/16 except y/b's /24 (and the IPv6 twins)",
            vec![policy(
                "x",
                "p1",
                json!({"podSelector": {"matchLabels": {"pod": "a"}},
                "ingress": [{"from": [
                    {"ipBlock": {"cidr": "10.1.0.0/16", "except": [format!("10.1.{}.0/24", yb.index)]}},
                    {"ipBlock": {"cidr": "fd00:1::/32", "except": [format!("fd00:1:{}::/48", yb.index)]}}
                ]}]}),
            )],
            xa_from_cidr_except_yb,
        ),
        (
            "x/a allows ingress to named port serve-81 only",
            vec![policy(
                "x",
                "p1",
                json!({"podSelector": {"matchLabels": {"pod": "a"}},
                "ingress": [{"ports": [{"port": "serve-81", "protocol": "TCP"}]}]}),
            )],
            xa_named_port_81,
        ),
        (
            "x/a allows ingress to TCP 81-90 (endPort)",
            vec![policy(
                "x",
                "p1",
                json!({"podSelector": {"matchLabels": {"pod": "a"}},
                "ingress": [{"ports": [{"port": 81, "endPort": 90, "protocol": "TCP"}]}]}),
            )],
            xa_port_range_81_to_90,
        ),
        (
            "x/a allows egress to DNS (UDP 53) only",
            vec![policy(
                "x",
                "p1",
                json!({"podSelector": {"matchLabels": {"pod": "a"}}, "policyTypes": ["Egress"],
                "egress": [{"ports": [{"port": 53, "protocol": "UDP"}]}]}),
            )],
            xa_egress_dns_only,
        ),
        ("two policies on x/a are unioned: from namespace y, and from z/c", union_policies(), xa_union_y_and_zc),
    ];
    for (title, policies, expected) in &scenarios {
        cluster.set_policies(policies);
        check(&cluster, title, *expected);
    }

    // A broken policy is rejected on its own; the others keep being enforced.
    let mut with_broken = union_policies();
    with_broken.push(policy(
        "x",
        "broken",
        json!({"podSelector": {},
        "ingress": [{"from": [{"ipBlock": {"cidr": "10.1.0.0/99"}}]}]}),
    ));
    cluster.set_policies(&with_broken);
    agent.wait_for_rejected("NetworkPolicy", 1, Duration::from_secs(15)).unwrap();
    let before = check(&cluster, "union + a policy with an invalid CIDR (rejected)", xa_union_y_and_zc);

    // The API black-holed, and the agent knows it: enforcement unchanged.
    cluster.set_mode(FaultMode::BlackHole);
    wait_until("the agent to report the API unreachable", Duration::from_secs(30), || {
        Ok(cluster.health().contains("\"api\":\"unreachable\""))
    })
    .unwrap();
    assert_eq!(check(&cluster, "API black-holed", xa_union_y_and_zc), before);

    // The agent killed: the pinned programs and maps keep enforcing.
    agent.kill();
    assert_eq!(check(&cluster, "agent killed, API still black-holed", xa_union_y_and_zc), before);

    // Restarted with the API still down: restores from its checkpoint, writes nothing.
    let mut agent = cluster.start_agent();
    let synced = agent.wait_for_policy_syncs(1, Duration::from_secs(30)).unwrap();
    assert_eq!(synced.writes, Writes::default(), "restart rewrote policy: {synced:?}");
    assert_eq!(check(&cluster, "agent restarted from its checkpoint", xa_union_y_and_zc), before);
    cluster.set_mode(FaultMode::Normal);
    agent.stop().unwrap();
    remove_bpf_root(std::path::Path::new(BPF_ROOT));
}
