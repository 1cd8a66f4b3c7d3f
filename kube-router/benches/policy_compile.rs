//! Benchmark (root): control-plane cost of NetworkPolicy — 1,000 policies over 10,000 pods in
//! 100 namespaces — ours (compile, flatten, write the pinned BPF maps) against the way
//! kube-router does it (ipset + iptables, loaded with `ipset restore` / `iptables-restore` in a
//! throw-away network namespace), in the same run, from the same generated policy set.
//!
//! The policy set (see [`cluster`]). Namespace `ns-<i>` has labels `team=team-<i % 10>` (ns-0
//! also `purpose=monitoring`) and 100 pods labelled `app=app-<j % 10>`, `tier=web|api|db`.
//! Its 10 policies:
//! * `default-deny`: every pod, ingress, no rules (isolates every pod of the cluster);
//! * `allow-monitoring`: every pod, ingress from every pod of `purpose=monitoring` namespaces,
//!   TCP 9090;
//! * `app-0`..`app-7`, selecting `app=app-<k>` (10 pods), ingress from
//!   - same-namespace `app=app-<k+1>` on TCP 8080, 8443,
//!   - `app=app-<k>` pods of the `team=team-<(i+k) % 10>` namespaces (100 pods) on TCP 8080,
//!   - for one policy in five, an ipBlock /24 with two `except` ranges on TCP 443 and UDP 53,
//!   - for `app-3` and `app-7`, same-namespace `tier=web` on TCP 30000-30999 and UDP 5000-5100
//!     (endPort ranges);
//! * `app-0` and `app-4` are also egress policies: to same-namespace `tier=db` on TCP 5432, to
//!   every pod of ns-0 on UDP/TCP 53, and to 0.0.0.0/0 except 10.0.0.0/8 on TCP 443.
//!
//! An isolated pod has at most 5 ingress rules and 3 egress rules, 10,000 ingress + 2,000
//! egress `pol_pods_v4` entries (65,536 max), and the number of `pol_ports`/`pol_peers_v4`
//! entries is printed and asserted against their maxima (the only bounds: there is no rule limit). Every pod is programmed, as if all 10,000 were on
//! this node (the agent programs only its node's pods; the iptables baseline below does the same,
//! with a firewall chain for every pod), so both sides carry the cluster-wide worst case.
//!
//! The iptables layout is a simplified but faithful version of kube-router's (v1.x/v2.x
//! `network_policy_controller`), in the filter table:
//! * ipsets: one hash:ip per policy holding its target pods (`KRT-P<n>-TGT`), one hash:ip per
//!   (policy, rule, pod peer) holding the peer pods (`KRT-P<n>-<I|E>R<r>E<e>`; kube-router also
//!   keeps one set per policy rule, not shared between policies), one hash:net per ipBlock with
//!   the cidr and its `except` ranges as `nomatch` entries;
//! * a chain per policy, `KUBE-NWPLCY-<n>`: per rule, peer and port, `-m set --match-set PEER src
//!   -m set --match-set TGT dst -p tcp --dport X -j MARK --set-xmark 0x10000/0x10000` followed by
//!   `-m mark --mark 0x10000/0x10000 -j RETURN` (egress: src and dst swapped);
//! * a chain per pod, `KUBE-POD-FW-<g>`: conntrack RELATED,ESTABLISHED accept, `-d pod -j
//!   KUBE-NWPLCY-<n>` for each ingress policy selecting it (`-s pod` for egress), `-m mark !
//!   --mark 0x10000/0x10000 -j REJECT`, then clear the mark and accept;
//! * `KUBE-ROUTER-FORWARD`, jumped to from FORWARD, sends `-d pod` / `-s pod` (isolated
//!   directions) to the pod's chain.
//!
//! Not modelled: kube-router's INPUT/OUTPUT chains for locally originated traffic, NFLOG rules,
//! the KUBE-ROUTER-* service and pod-CIDR accept chains, and its Go selector evaluation: the
//! baseline's "render" step is this file's Rust label matching, a lower bound for that work.
use std::{
    collections::BTreeMap,
    fmt::Write as _,
    io::Write as _,
    net::Ipv4Addr,
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use ipnet::Ipv4Net;
use k8s_openapi::api::{
    core::v1::{Namespace, Pod},
    networking::v1::NetworkPolicy,
};
use kube_router::policy::maps::{apply_diff, BpfPolicyMaps};
use kube_router::{
    bpf::datapath::{self, Datapath},
    policy::{
        compile,
        flatten::{MapEntries, MapFlattener},
        CompileOutput, Direction, PolicyCompiler,
    },
};
use kube_router_common::{POLICY_PEERS_MAX_ENTRIES, POLICY_PODS_MAX_ENTRIES, POLICY_PORTS_MAX_ENTRIES};
use serde_json::{json, Value};

const NAMESPACES: usize = 100;
const PODS_PER_NAMESPACE: usize = 100;
const APPS_PER_NAMESPACE: usize = 10;
/// `app-0`..`app-7` get their own policy; with `default-deny` and `allow-monitoring` that is 10
/// policies per namespace.
const APP_POLICIES_PER_NAMESPACE: usize = 8;
const TIERS: [&str; 3] = ["web", "api", "db"];
const PIN_DIR: &str = "/sys/fs/bpf/krt-polbench";
const NETNS: &str = "krt-polbench";

type Labels = BTreeMap<String, String>;

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

struct PodSpec {
    namespace: usize,
    name: String,
    ip: Ipv4Addr,
    labels: Labels,
}

enum Peer {
    /// Pods matching `pods` (all labels) in the policy's own namespace (`namespaces: None`) or in
    /// every namespace carrying the `namespaces` label.
    Pods {
        namespaces: Option<(String, String)>,
        pods: Labels,
    },
    Block {
        cidr: Ipv4Net,
        except: Vec<Ipv4Net>,
    },
}

struct PortSpec {
    tcp: bool,
    port: u16,
    end_port: Option<u16>,
}

fn tcp(port: u16) -> PortSpec {
    PortSpec { tcp: true, port, end_port: None }
}

fn udp(port: u16) -> PortSpec {
    PortSpec { tcp: false, port, end_port: None }
}

struct RuleSpec {
    peers: Vec<Peer>,
    ports: Vec<PortSpec>,
}

struct PolicySpec {
    namespace: usize,
    name: String,
    /// Pod labels the policy selects in its namespace; empty selects every pod.
    target: Labels,
    /// `Some` = the policy has this policyType (an empty list isolates and allows nothing).
    ingress: Option<Vec<RuleSpec>>,
    egress: Option<Vec<RuleSpec>>,
}

/// The one source both sides are generated from.
struct Cluster {
    namespace_labels: Vec<Labels>,
    pods: Vec<PodSpec>,
    policies: Vec<PolicySpec>,
}

fn namespace_name(index: usize) -> String {
    format!("ns-{index}")
}

fn pod_ip(global_index: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 244, 0, 0)) + global_index as u32)
}

fn app_labels(app: usize) -> Labels {
    labels(&[("app", &format!("app-{app}"))])
}

fn same_namespace(pods: Labels) -> Peer {
    Peer::Pods { namespaces: None, pods }
}

fn cluster() -> Cluster {
    let namespace_labels = (0..NAMESPACES)
        .map(|i| {
            let mut l =
                labels(&[("team", &format!("team-{}", i % 10)), ("kubernetes.io/metadata.name", &namespace_name(i))]);
            if i == 0 {
                l.insert("purpose".into(), "monitoring".into());
            }
            l
        })
        .collect();
    let mut pods = Vec::new();
    for namespace in 0..NAMESPACES {
        for j in 0..PODS_PER_NAMESPACE {
            let global = namespace * PODS_PER_NAMESPACE + j;
            pods.push(PodSpec {
                namespace,
                name: format!("pod-{j}"),
                ip: pod_ip(global),
                labels: labels(&[("app", &format!("app-{}", j % APPS_PER_NAMESPACE)), ("tier", TIERS[j % 3])]),
            });
        }
    }
    let mut policies = Vec::new();
    for namespace in 0..NAMESPACES {
        policies.push(PolicySpec {
            namespace,
            name: "default-deny".into(),
            target: Labels::new(),
            ingress: Some(vec![]),
            egress: None,
        });
        policies.push(PolicySpec {
            namespace,
            name: "allow-monitoring".into(),
            target: Labels::new(),
            ingress: Some(vec![RuleSpec {
                peers: vec![Peer::Pods {
                    namespaces: Some(("purpose".into(), "monitoring".into())),
                    pods: Labels::new(),
                }],
                ports: vec![tcp(9090)],
            }]),
            egress: None,
        });
        for app in 0..APP_POLICIES_PER_NAMESPACE {
            let index = namespace * APP_POLICIES_PER_NAMESPACE + app;
            let mut ingress = vec![
                RuleSpec {
                    peers: vec![same_namespace(app_labels((app + 1) % APPS_PER_NAMESPACE))],
                    ports: vec![tcp(8080), tcp(8443)],
                },
                RuleSpec {
                    peers: vec![Peer::Pods {
                        namespaces: Some(("team".into(), format!("team-{}", (namespace + app) % 10))),
                        pods: app_labels(app),
                    }],
                    ports: vec![tcp(8080)],
                },
            ];
            if index.is_multiple_of(5) {
                // A distinct /24 per policy out of 172.16.0.0/14, minus its top half and one /30.
                let base = u32::from(Ipv4Addr::new(172, 16, 0, 0)) + (index as u32) * 256;
                let net = |offset: u32, len: u8| Ipv4Net::new(Ipv4Addr::from(base + offset), len).unwrap();
                ingress.push(RuleSpec {
                    peers: vec![Peer::Block { cidr: net(0, 24), except: vec![net(128, 25), net(4, 30)] }],
                    ports: vec![tcp(443), udp(53)],
                });
            }
            if app % 4 == 3 {
                ingress.push(RuleSpec {
                    peers: vec![same_namespace(labels(&[("tier", "web")]))],
                    ports: vec![
                        PortSpec { tcp: true, port: 30000, end_port: Some(30999) },
                        PortSpec { tcp: false, port: 5000, end_port: Some(5100) },
                    ],
                });
            }
            let egress = (app % 4 == 0).then(|| {
                vec![
                    RuleSpec { peers: vec![same_namespace(labels(&[("tier", "db")]))], ports: vec![tcp(5432)] },
                    RuleSpec {
                        peers: vec![Peer::Pods {
                            namespaces: Some(("kubernetes.io/metadata.name".into(), namespace_name(0))),
                            pods: Labels::new(),
                        }],
                        ports: vec![udp(53), tcp(53)],
                    },
                    RuleSpec {
                        peers: vec![Peer::Block {
                            cidr: "0.0.0.0/0".parse().unwrap(),
                            except: vec!["10.0.0.0/8".parse().unwrap()],
                        }],
                        ports: vec![tcp(443)],
                    },
                ]
            });
            policies.push(PolicySpec {
                namespace,
                name: format!("app-{app}"),
                target: app_labels(app),
                ingress: Some(ingress),
                egress,
            });
        }
    }
    Cluster { namespace_labels, pods, policies }
}

// ---- the Kubernetes objects (ours) -----------------------------------------------------------

fn k8s_pod(pod: &PodSpec) -> Pod {
    serde_json::from_value(json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"namespace": namespace_name(pod.namespace), "name": pod.name, "labels": pod.labels},
        "spec": {"containers": [{"name": "c", "image": "agnhost"}]},
        "status": {"phase": "Running", "podIP": pod.ip.to_string(), "podIPs": [{"ip": pod.ip.to_string()}]}}))
    .unwrap()
}

fn k8s_rules(rules: &[RuleSpec], peer_field: &str) -> Value {
    let rules: Vec<Value> = rules
        .iter()
        .map(|rule| {
            let peers: Vec<Value> = rule
                .peers
                .iter()
                .map(|peer| match peer {
                    Peer::Pods { namespaces: None, pods } => json!({"podSelector": {"matchLabels": pods}}),
                    Peer::Pods { namespaces: Some((k, v)), pods } => json!({
                        "namespaceSelector": {"matchLabels": {k: v}}, "podSelector": {"matchLabels": pods}}),
                    Peer::Block { cidr, except } => json!({"ipBlock": {"cidr": cidr.to_string(),
                        "except": except.iter().map(|e| e.to_string()).collect::<Vec<_>>()}}),
                })
                .collect();
            let ports: Vec<Value> = rule
                .ports
                .iter()
                .map(|p| {
                    let mut port = json!({"protocol": if p.tcp { "TCP" } else { "UDP" }, "port": p.port});
                    if let Some(end) = p.end_port {
                        port["endPort"] = json!(end);
                    }
                    port
                })
                .collect();
            json!({peer_field: peers, "ports": ports})
        })
        .collect();
    Value::Array(rules)
}

fn k8s_policy(policy: &PolicySpec) -> NetworkPolicy {
    let mut spec = json!({"podSelector": {"matchLabels": policy.target}});
    let mut types = Vec::new();
    if let Some(rules) = &policy.ingress {
        types.push("Ingress");
        spec["ingress"] = k8s_rules(rules, "from");
    }
    if let Some(rules) = &policy.egress {
        types.push("Egress");
        spec["egress"] = k8s_rules(rules, "to");
    }
    spec["policyTypes"] = json!(types);
    serde_json::from_value(json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"namespace": namespace_name(policy.namespace), "name": policy.name}, "spec": spec}))
    .unwrap()
}

fn k8s_objects(cluster: &Cluster) -> (Vec<Pod>, Vec<Namespace>, Vec<NetworkPolicy>) {
    let namespaces = cluster
        .namespace_labels
        .iter()
        .enumerate()
        .map(|(i, l)| {
            serde_json::from_value(json!({"apiVersion": "v1", "kind": "Namespace",
                "metadata": {"name": namespace_name(i), "labels": l}}))
            .unwrap()
        })
        .collect();
    (cluster.pods.iter().map(k8s_pod).collect(), namespaces, cluster.policies.iter().map(k8s_policy).collect())
}

// ---- ipset + iptables (baseline) -------------------------------------------------------------

fn contains_all(have: &Labels, wanted: &Labels) -> bool {
    wanted.iter().all(|(k, v)| have.get(k) == Some(v))
}

fn policy_targets<'a>(cluster: &'a Cluster, policy: &PolicySpec) -> Vec<&'a PodSpec> {
    cluster.pods.iter().filter(|p| p.namespace == policy.namespace && contains_all(&p.labels, &policy.target)).collect()
}

fn peer_members(
    cluster: &Cluster,
    policy_namespace: usize,
    namespaces: &Option<(String, String)>,
    pods: &Labels,
) -> Vec<Ipv4Addr> {
    cluster
        .pods
        .iter()
        .filter(|p| match namespaces {
            None => p.namespace == policy_namespace,
            Some((k, v)) => cluster.namespace_labels[p.namespace].get(k) == Some(v),
        })
        .filter(|p| contains_all(&p.labels, pods))
        .map(|p| p.ip)
        .collect()
}

fn rule(rules: &mut String, line: String) {
    rules.push_str(&line);
    rules.push('\n');
}

#[derive(Default)]
struct Rendered {
    ipset: String,
    iptables: String,
    sets: usize,
    set_entries: usize,
    rules: usize,
    ingress_isolated: usize,
    egress_isolated: usize,
}

/// How the ipset text creates a set's contents.
#[derive(Clone, Copy, PartialEq)]
enum SetLoad {
    /// Fresh namespace: create each set and add its members.
    Create,
    /// A resync as kube-router does it: fill a temporary set, swap it with the live one.
    Swap,
}

struct IpsetWriter<'a> {
    out: &'a mut Rendered,
    load: SetLoad,
}

impl IpsetWriter<'_> {
    fn set(&mut self, name: &str, kind: &str, members: impl IntoIterator<Item = String>) {
        let target = match self.load {
            SetLoad::Create => name.to_string(),
            SetLoad::Swap => {
                let tmp = if kind == "hash:ip" { "KRT-TMP-IP" } else { "KRT-TMP-NET" };
                writeln!(self.out.ipset, "create {tmp} {kind} family inet hashsize 1024 maxelem 65536 -exist").unwrap();
                writeln!(self.out.ipset, "flush {tmp}").unwrap();
                tmp.to_string()
            }
        };
        if self.load == SetLoad::Create {
            writeln!(self.out.ipset, "create {name} {kind} family inet hashsize 1024 maxelem 65536").unwrap();
        }
        for member in members {
            writeln!(self.out.ipset, "add {target} {member}").unwrap();
            self.out.set_entries += 1;
        }
        if self.load == SetLoad::Swap {
            writeln!(self.out.ipset, "swap {target} {name}").unwrap();
        }
        self.out.sets += 1;
    }
}

/// hash:net takes prefix lengths 1..=32 only: like kube-router, store a /0 as its two /1 halves.
fn hash_net_entries(cidr: &Ipv4Net) -> impl Iterator<Item = String> {
    let halves = if cidr.prefix_len() == 0 { cidr.subnets(1).unwrap().collect() } else { vec![*cidr] };
    halves.into_iter().map(|net| net.to_string())
}

fn render_baseline(cluster: &Cluster, load: SetLoad) -> Rendered {
    let mut out = Rendered::default();
    let mut chains = String::new();
    let mut rules = String::new();
    // Policies selecting each pod, per direction, for its firewall chain.
    let mut ingress_of: Vec<Vec<usize>> = vec![Vec::new(); cluster.pods.len()];
    let mut egress_of: Vec<Vec<usize>> = vec![Vec::new(); cluster.pods.len()];
    let pod_index: BTreeMap<Ipv4Addr, usize> = cluster.pods.iter().enumerate().map(|(i, p)| (p.ip, i)).collect();
    let mut rule_count = 0;
    {
        let mut sets = IpsetWriter { out: &mut out, load };
        for (n, policy) in cluster.policies.iter().enumerate() {
            let targets = policy_targets(cluster, policy);
            let target_set = format!("KRT-P{n}-TGT");
            sets.set(&target_set, "hash:ip", targets.iter().map(|p| p.ip.to_string()));
            for pod in &targets {
                if policy.ingress.is_some() {
                    ingress_of[pod_index[&pod.ip]].push(n);
                }
                if policy.egress.is_some() {
                    egress_of[pod_index[&pod.ip]].push(n);
                }
            }
            let chain = format!("KUBE-NWPLCY-{n}");
            writeln!(chains, ":{chain} - [0:0]").unwrap();
            for (direction, policy_rules) in [("I", &policy.ingress), ("E", &policy.egress)] {
                for (r, spec) in policy_rules.iter().flatten().enumerate() {
                    for (e, peer) in spec.peers.iter().enumerate() {
                        let peer_set = format!("KRT-P{n}-{direction}R{r}E{e}");
                        match peer {
                            Peer::Pods { namespaces, pods } => sets.set(
                                &peer_set,
                                "hash:ip",
                                peer_members(cluster, policy.namespace, namespaces, pods)
                                    .iter()
                                    .map(|ip| ip.to_string()),
                            ),
                            Peer::Block { cidr, except } => sets.set(
                                &peer_set,
                                "hash:net",
                                hash_net_entries(cidr).chain(except.iter().map(|e| format!("{e} nomatch"))),
                            ),
                        }
                        let (src, dst) =
                            if direction == "I" { (&peer_set, &target_set) } else { (&target_set, &peer_set) };
                        for port in &spec.ports {
                            let protocol = if port.tcp { "tcp" } else { "udp" };
                            let dport = match port.end_port {
                                Some(end) => format!("{}:{end}", port.port),
                                None => port.port.to_string(),
                            };
                            rule(&mut rules, format!("-A {chain} -m set --match-set {src} src -m set --match-set {dst} dst -p {protocol} -m {protocol} --dport {dport} -j MARK --set-xmark 0x10000/0x10000"));
                            rule(&mut rules, format!("-A {chain} -m mark --mark 0x10000/0x10000 -j RETURN"));
                            rule_count += 2;
                        }
                    }
                }
            }
        }
    }
    writeln!(chains, ":KUBE-ROUTER-FORWARD - [0:0]").unwrap();
    rule(&mut rules, "-A FORWARD -j KUBE-ROUTER-FORWARD".into());
    rule_count += 1;
    for (g, pod) in cluster.pods.iter().enumerate() {
        if ingress_of[g].is_empty() && egress_of[g].is_empty() {
            continue;
        }
        let chain = format!("KUBE-POD-FW-{g}");
        writeln!(chains, ":{chain} - [0:0]").unwrap();
        let ip = pod.ip;
        rule(&mut rules, format!("-A {chain} -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT"));
        rule_count += 1;
        for (flag, policies) in [("-d", &ingress_of[g]), ("-s", &egress_of[g])] {
            if !policies.is_empty() {
                rule(&mut rules, format!("-A KUBE-ROUTER-FORWARD {flag} {ip}/32 -j {chain}"));
                rule_count += 1;
            }
            for n in policies.iter() {
                rule(&mut rules, format!("-A {chain} {flag} {ip}/32 -j KUBE-NWPLCY-{n}"));
                rule_count += 1;
            }
        }
        rule(
            &mut rules,
            format!("-A {chain} -m mark ! --mark 0x10000/0x10000 -j REJECT --reject-with icmp-port-unreachable"),
        );
        rule(&mut rules, format!("-A {chain} -j MARK --set-xmark 0x0/0x10000"));
        rule(&mut rules, format!("-A {chain} -j ACCEPT"));
        rule_count += 3;
    }
    out.ingress_isolated = ingress_of.iter().filter(|p| !p.is_empty()).count();
    out.egress_isolated = egress_of.iter().filter(|p| !p.is_empty()).count();
    if load == SetLoad::Swap {
        out.ipset.push_str("destroy KRT-TMP-IP\ndestroy KRT-TMP-NET\n");
    }
    out.rules = rule_count;
    out.iptables =
        format!("*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n{chains}{rules}COMMIT\n");
    out
}

/// Runs `command` inside the benchmark's network namespace with `input` on stdin; returns the
/// wall time including process start (a few ms, measured separately as `netns exec overhead`).
fn in_netns(command: &[&str], input: &str) -> Duration {
    let started = Instant::now();
    let mut child = Command::new("ip")
        .args(["netns", "exec", NETNS])
        .args(command)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("ip netns exec");
    // A broken pipe means the command stopped reading: its exit status says why.
    let _ = child.stdin.take().unwrap().write_all(input.as_bytes());
    let status = child.wait().unwrap();
    let elapsed = started.elapsed();
    assert!(status.success(), "{command:?} failed: {status}");
    elapsed
}

fn netns_output(command: &[&str]) -> String {
    let output = Command::new("ip").args(["netns", "exec", NETNS]).args(command).output().expect("ip netns exec");
    assert!(output.status.success(), "{command:?} failed: {}", output.status);
    String::from_utf8(output.stdout).unwrap()
}

/// The network namespace the baseline writes into; deleted (with its ipsets and rules) on drop.
struct Netns;

impl Netns {
    fn create() -> Netns {
        let _ = Command::new("ip").args(["netns", "del", NETNS]).status();
        assert!(Command::new("ip").args(["netns", "add", NETNS]).status().unwrap().success(), "ip netns add");
        Netns
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", NETNS]).status();
    }
}

/// The benchmark's private pin directory; removed (with its maps) on drop, after the datapath.
struct PinDir(&'static Path);

impl Drop for PinDir {
    fn drop(&mut self) {
        let _ = datapath::remove_all(self.0);
    }
}

// ---- measurement ----------------------------------------------------------------------------

fn timed<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let started = Instant::now();
    let value = f();
    (value, started.elapsed())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn check_fits(output: &CompileOutput, entries: &MapEntries) {
    assert!(output.policy_errors.is_empty(), "{:?}", output.policy_errors);
    assert!(entries.pod_slots.len() <= POLICY_PODS_MAX_ENTRIES as usize);
    assert!(entries.slot_ports.len() <= POLICY_PORTS_MAX_ENTRIES as usize);
    assert!(entries.peer_prefixes.len() <= POLICY_PEERS_MAX_ENTRIES as usize);
}

/// The pod whose label changes in the incremental step: ns-5/pod-1 goes from app-1 to app-2, so
/// it leaves one policy's targets and three peer sets and joins as many others.
const CHANGED_POD: usize = 5 * PODS_PER_NAMESPACE + 1;

struct Row {
    step: String,
    ours: Option<Duration>,
    baseline: Option<Duration>,
}

fn row(step: impl Into<String>, ours: Option<Duration>, baseline: Option<Duration>) -> Row {
    Row { step: step.into(), ours, baseline }
}

/// `POLICY_COMPILE_PROFILE=<rounds>`: compile and flatten that many times, without maps or a
/// baseline (no root needed), printing each round: steady numbers for a profiler.
fn profile(rounds: usize) {
    let (pods, namespaces, policies) = k8s_objects(&cluster());
    for round in 0..rounds {
        let (output, compile_time) = timed(|| compile(&pods, &namespaces, &policies));
        let (entries, flatten_time) = timed(|| MapFlattener::new().flatten(&output.model));
        let (_, encode_time) = timed(|| kube_router::policy::maps::encode_diff(&MapEntries::default().diff(&entries)));
        println!(
            "round {round}: compile {:.1} ms, flatten {:.1} ms, diff+encode {:.1} ms",
            ms(compile_time),
            ms(flatten_time),
            ms(encode_time)
        );
    }
}

/// Every pod on this node, as the bench programs every pod.
const BENCH_NODE: &str = "krt-polbench-node";

struct ControllerRun {
    first: Duration,
    first_writes: u64,
    change: Duration,
    change_writes: u64,
    /// Objects the compiler was fed for the change.
    fed: usize,
}

/// The policy controller on the pinned maps holding `pods`: its first sync, then one reconcile
/// after `changed` arrives as a watch event.
fn through_the_controller(
    pin_dir: &Path,
    pods: &[Pod],
    namespaces: &[Namespace],
    policies: &[NetworkPolicy],
    changed: &Pod,
) -> ControllerRun {
    use kube::runtime::watcher::Event;
    use kube_router::{
        controllers::policy::PolicyController,
        k8s::{
            cache::Cache,
            watch::{ClusterObjects, WatchUpdate},
        },
        metrics::Metrics,
        policy::engine::PolicyProgrammer,
        runtime::Controller,
    };
    fn here(pod: &Pod) -> kube_router::k8s::pod::PodFields {
        let mut pod = pod.clone();
        pod.spec.get_or_insert_default().node_name = Some(BENCH_NODE.into());
        (&pod).into()
    }
    fn list<K: Clone>(cache: &Cache, wrap: fn(Event<K>) -> WatchUpdate, objects: impl IntoIterator<Item = K>) {
        cache.apply(wrap(Event::Init));
        for object in objects {
            cache.apply(wrap(Event::InitApply(object)));
        }
        cache.apply(wrap(Event::InitDone));
    }
    let cache = Cache::new(ClusterObjects::default(), None);
    list(
        &cache,
        WatchUpdate::Namespaces,
        namespaces.iter().map(|n| kube_router::k8s::namespace::NamespaceFields { metadata: n.metadata.clone() }),
    );
    list(&cache, WatchUpdate::Pods, pods.iter().map(here));
    list(&cache, WatchUpdate::NetworkPolicies, policies.iter().cloned());
    let maps = BpfPolicyMaps::open_pinned(pin_dir).expect("policy maps");
    let metrics = Metrics::default();
    let writes = || {
        use kube_router::map_writes::MapMetrics;
        use kube_router_common::map_names::POLICY_PODS;
        let maps = metrics.of::<MapMetrics>();
        MapMetrics::WRITE_OPS.iter().filter_map(|op| maps.writes(POLICY_PODS, op)).sum::<u64>()
    };
    let firewall = PolicyProgrammer::with_maps(maps, BENCH_NODE, metrics.clone()).expect("adopt the maps");
    let mut controller = PolicyController::new(firewall, cache.clone());
    let runtime = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
    let (first, first_time) = timed(|| runtime.block_on(controller.reconcile()));
    first.expect("first policy sync");
    let first_writes = writes();
    cache.apply(WatchUpdate::Pods(Event::Apply(here(changed))));
    let (change, change_time) = timed(|| runtime.block_on(controller.reconcile()));
    change.expect("policy sync after one change");
    ControllerRun {
        first: first_time,
        first_writes,
        change: change_time,
        change_writes: writes() - first_writes,
        fed: controller.firewall().last_sync().objects_fed,
    }
}

fn main() {
    if let Some(rounds) = std::env::var("POLICY_COMPILE_PROFILE").ok().and_then(|r| r.parse().ok()) {
        return profile(rounds);
    }
    let pin_dir = Path::new(PIN_DIR);
    let mut cluster = cluster();
    println!(
        "== NetworkPolicy sync: {} policies, {} pods, {} namespaces (every pod programmed)",
        cluster.policies.len(),
        cluster.pods.len(),
        NAMESPACES
    );
    let (pods, namespaces, policies) = k8s_objects(&cluster);

    // Ours: compile, flatten, write into freshly created pinned maps.
    let _ = datapath::remove_all(pin_dir);
    let _pin_dir_guard = PinDir(pin_dir);
    // Loading creates and pins the maps; it must outlive the writes.
    let _datapath = Datapath::load(pin_dir).expect("load datapath (root needed)");
    let mut maps = BpfPolicyMaps::open_pinned(pin_dir).expect("policy maps");
    let (output, compile_time) = timed(|| compile(&pods, &namespaces, &policies));
    let mut flattener = MapFlattener::new();
    let (entries, flatten_time) = timed(|| flattener.flatten(&output.model));
    check_fits(&output, &entries);
    let (report, write_time) =
        timed(|| apply_diff(&mut maps, &MapEntries::default().diff(&entries), &MapEntries::default()));
    assert_eq!(report.errors, 0, "{report:?}");
    let ingress_slots = entries.pod_slots.keys().filter(|k| k.direction == Direction::Ingress).count();
    let egress_slots = entries.pod_slots.len() - ingress_slots;
    let most_rules = entries.pod_slots.values().map(|v| v.rule_count).max().unwrap_or(0);

    // Baseline: the same policy set as ipsets + iptables in a fresh network namespace.
    let netns = Netns::create();
    let netns_overhead = in_netns(&["true"], "");
    let (initial, render_time) = timed(|| render_baseline(&cluster, SetLoad::Create));
    assert_eq!(initial.ingress_isolated, ingress_slots, "both sides isolate the same pods for ingress");
    assert_eq!(initial.egress_isolated, egress_slots, "both sides isolate the same pods for egress");
    let ipset_time = in_netns(&["ipset", "restore"], &initial.ipset);
    let iptables_time = in_netns(&["iptables-restore", "-w"], &initial.iptables);
    // Not timed: the kernel holds what was rendered.
    assert_eq!(netns_output(&["iptables-save"]).lines().filter(|l| l.starts_with("-A ")).count(), initial.rules);
    assert_eq!(netns_output(&["ipset", "list", "-n"]).lines().count(), initial.sets);

    // One pod's label changes. Ours: the agent's path — full recompile, flatten with the same
    // flattener (stable ids), diff against what is programmed, write the difference.
    // The ids as they were before the change, for the incremental compiler below.
    let flattener_before_change = flattener.clone();
    cluster.pods[CHANGED_POD].labels.insert("app".into(), "app-2".into());
    let mut changed_pods = pods.clone();
    changed_pods[CHANGED_POD] = k8s_pod(&cluster.pods[CHANGED_POD]);
    let ((changed_output, changed_entries, diff), recompile_time) = timed(|| {
        let output = compile(&changed_pods, &namespaces, &policies);
        let changed = flattener.flatten(&output.model);
        let diff = entries.diff(&changed);
        (output, changed, diff)
    });
    check_fits(&changed_output, &changed_entries);
    let (change_report, change_write_time) = timed(|| apply_diff(&mut maps, &diff, &entries));
    assert_eq!(change_report.errors, 0, "{change_report:?}");
    // What the agent does: the incremental compiler recomputes only the changed pod's entries
    // and sets, and the flattener rewrites only what its delta names. It must reach the same
    // maps with the same writes.
    let mut incremental = PolicyCompiler::from_snapshot(&pods, &namespaces, &policies);
    let mut flattener = flattener_before_change;
    let (incremental_diff, incremental_time) = timed(|| {
        let delta = incremental.upsert_pod(&changed_pods[CHANGED_POD]);
        let sets = delta.pod_sets.keys().cloned().collect();
        flattener.update(incremental.model(), &delta.pods, &sets)
    });
    assert_eq!(incremental_diff, diff, "the incremental path writes what a full compile writes");
    // The agent's own path: the policy controller over the same pinned maps, fed by the object
    // stores. Its first sync adopts what is programmed (the cluster as changed above); then the
    // pod's label goes back, one watch event, and one reconcile takes it to the maps.
    let controller = through_the_controller(pin_dir, &changed_pods, &namespaces, &policies, &pods[CHANGED_POD]);
    // Baseline: kube-router re-renders everything, swaps every ipset and re-runs a full
    // iptables-restore on every sync.
    let (resync, rerender_time) = timed(|| render_baseline(&cluster, SetLoad::Swap));
    let reipset_time = in_netns(&["ipset", "restore"], &resync.ipset);
    let reiptables_time = in_netns(&["iptables-restore", "-w"], &resync.iptables);
    drop(netns);

    let rows = [
        row("compile (policy::compile)", Some(compile_time), None),
        row("flatten (MapFlattener::flatten)", Some(flatten_time), None),
        row("render ipset/iptables-restore text", None, Some(render_time)),
        row("write: BPF maps | ipset restore", Some(write_time), Some(ipset_time)),
        row("write: iptables-restore -w", None, Some(iptables_time)),
        row("kernel write total", Some(write_time), Some(ipset_time + iptables_time)),
        row(
            "full sync total",
            Some(compile_time + flatten_time + write_time),
            Some(render_time + ipset_time + iptables_time),
        ),
        row("1 label: recompile+flatten+diff | render", Some(recompile_time), Some(rerender_time)),
        row("1 label: PolicyCompiler::upsert_pod+flattener update", Some(incremental_time), None),
        row("1 label: BPF map writes | ipset restore (swap)", Some(change_write_time), Some(reipset_time)),
        row("1 label: iptables-restore -w (full)", None, Some(reiptables_time)),
        row(
            "1 label: total",
            Some(recompile_time + change_write_time),
            Some(rerender_time + reipset_time + reiptables_time),
        ),
        row(
            format!("agent restart: controller's first sync ({} writes)", controller.first_writes),
            Some(controller.first),
            None,
        ),
        row(
            format!("1 label: controller reconcile ({} fed, {} writes)", controller.fed, controller.change_writes),
            Some(controller.change),
            Some(rerender_time + reipset_time + reiptables_time),
        ),
        row(
            "1 label: total, incremental compiler",
            Some(incremental_time + change_write_time),
            Some(rerender_time + reipset_time + reiptables_time),
        ),
    ];
    let cell = |d: Option<Duration>| d.map_or_else(|| "-".to_string(), |d| format!("{:.1}", ms(d)));
    println!("\n{:<48} {:>12} {:>14} {:>16}", "step", "ours (ms)", "baseline (ms)", "baseline/ours");
    for r in &rows {
        let ratio = match (r.ours, r.baseline) {
            (Some(o), Some(b)) => {
                let ratio = b.as_secs_f64() / o.as_secs_f64();
                if ratio < 10.0 {
                    format!("{ratio:.2}x")
                } else {
                    format!("{ratio:.0}x")
                }
            }
            _ => "-".into(),
        };
        println!("{:<48} {:>12} {:>14} {:>16}", r.step, cell(r.ours), cell(r.baseline), ratio);
    }
    println!("(each baseline process start includes `ip netns exec`: {:.1} ms)", ms(netns_overhead));

    println!("\nours: pol_pods_v4 {} ({ingress_slots} ingress + {egress_slots} egress, max {POLICY_PODS_MAX_ENTRIES}), pol_ports {} (max {POLICY_PORTS_MAX_ENTRIES}), pol_peers_v4 {} (max {POLICY_PEERS_MAX_ENTRIES}); most rules in one pod direction {most_rules}; {} map writes",
        entries.pod_slots.len(), entries.slot_ports.len(), entries.peer_prefixes.len(), report.writes());
    // Why compile costs what it does: each referenced pod set is resolved against every pod.
    println!("ours: compile resolved {} distinct pod sets against {} pods", output.model.pod_sets.len(), pods.len());
    println!(
        "ours, 1 label changed: {} map writes ({} puts, {} deletes)",
        change_report.writes(),
        change_report.puts,
        change_report.deletes
    );
    println!(
        "baseline: {} ipsets with {} entries, {} iptables rules ({} ingress- and {} egress-isolated pods); 1 label changed: the same {} sets swapped and {} rules reloaded",
        initial.sets, initial.set_entries, initial.rules, initial.ingress_isolated, initial.egress_isolated, resync.sets, resync.rules
    );
}
