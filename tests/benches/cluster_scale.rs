//! Benchmark (root): one agent in a cluster of the size users outgrow (issue 29). The project's
//! API server holds 5,000 Nodes (pod CIDRs, addresses), 150,000 Pods over 5,000 Namespaces with
//! realistic labels and specs, 10,000 Services with 100,000 endpoints and 2,000
//! NetworkPolicies. The agent runs as one of the nodes (`node-0`, its own 30 pods) in API mode
//! with every controller on, and as a route-reflector client of a gobgpd that reflects the other
//! 4,999 nodes' pod routes (announced to it by a BIRD standing in for those nodes), the topology
//! of `--nodes-full-mesh=false`.
//!
//! Measured, one phase after the other:
//! 1. cold start from the API (process start → Services and policy synced, every frontend in
//!    the map), peak RSS, BGP session up and every learned route in the kernel;
//! 2. the checkpoint's size; the bpffs wiped and the API down, cold start from the checkpoint;
//! 3. churn: pods replaced with their EndpointSlices, label changes, readiness flips, nodes
//!    leaving and joining, at `KRT_SCALE_RATE` changes per second (200) for `KRT_SCALE_CHURN_SECS`
//!    (300), and on top kubelets' Node status heartbeats (`KRT_SCALE_NODE_HEARTBEATS` a second,
//!    one a node every 10 s; nothing the agent reads changes): the agent's CPU share, RSS, and
//!    change → map latency (a probe Service whose port moves every 100 ms, looked up in the
//!    pinned frontend map every 0.2 ms).
//!
//! `KRT_SCALE` (default 1.0) scales every object count, e.g. 0.05 for a quick look.
//! `KRT_SCALE_ONLY_API_START=1` stops after 1. (the cold start's figures alone, for an A/B of
//! the start); `KRT_SCALE_PERF=FILE` records the agent's start from the API with
//! `perf record -F 199 --call-graph dwarf,16384` into FILE (DWARF: the release build has no frame
//! pointers), `KRT_SCALE_PERF_SERVER=FILE` the API server's (this process) the same way.
use std::{
    collections::BTreeMap,
    fs,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::Arc,
    thread,
    time::{Duration, Instant},
};

use kube_router_common::ServiceKeyV4;
use kube_router_tests::{
    apiserver::{FakeApiServer, FakeApiServerConfig},
    *,
};
use serde_json::{json, Value};

const AGENT_ADDR: &str = "172.16.0.1";
const RR_ADDR: &str = "172.16.63.254";
const NODES_ADDR: &str = "172.16.63.253";
const ASN: u32 = 64512;
const METRICS_PORT: &str = "20290";
const HEALTH_PORT: &str = "20291";
const PODS_PER_NODE: usize = 30;
const ENDPOINTS_PER_SERVICE: usize = 10;
const PROBE_IP: [u8; 4] = [10, 111, 255, 250];
const PROBE_PORT_BASE: u16 = 20_000;

struct Sizes {
    nodes: usize,
    namespaces: usize,
    services: usize,
    policies: usize,
}

impl Sizes {
    fn pods(&self) -> usize {
        self.nodes * PODS_PER_NODE
    }
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Node `i`'s InternalIP: every node on the RR link's /18, so the reflected next hops resolve.
fn node_ip(i: usize) -> String {
    let n = i + 1;
    format!("172.16.{}.{}", n >> 8, n & 0xff)
}

fn pod_cidr(i: usize) -> String {
    format!("10.{}.{}.0/24", 64 + (i >> 8), i & 0xff)
}

/// Global pod `g` lives on node `g % nodes` in slot `g / nodes`: a Service's pods spread.
fn pod_ip(s: &Sizes, g: usize) -> String {
    let (node, slot) = (g % s.nodes, g / s.nodes);
    format!("10.{}.{}.{}", 64 + (node >> 8), node & 0xff, slot + 2)
}

fn namespace_of_pod(s: &Sizes, g: usize) -> String {
    format!("ns-{}", (g / ENDPOINTS_PER_SERVICE) % s.namespaces)
}

fn app_of_pod(s: &Sizes, g: usize) -> String {
    if g < s.services * ENDPOINTS_PER_SERVICE {
        format!("app-{}", g / ENDPOINTS_PER_SERVICE)
    } else {
        format!("batch-{}", g % 100)
    }
}

fn node(i: usize) -> Value {
    node_at(i, 0)
}

/// Node `i` as its kubelet reports it at heartbeat `beat`: the Ready condition's times (and the
/// TTL controller's annotation) move, nothing the agent reads does.
fn node_at(i: usize, beat: usize) -> Value {
    let time = format!("2026-12-06T{:02}:{:02}:{:02}Z", beat / 3600 % 24, beat / 60 % 60, beat % 60);
    json!({"apiVersion": "v1", "kind": "Node",
        // With --nodes-full-mesh=false every node names its ASN (kube-router's rule) and, in a
        // route-reflector topology, its role: every node here is a client of the reflector
        // (gobgpd, a --peer-router), so it peers with no other node.
        "metadata": {"name": format!("node-{i}"), "annotations": {"kube-router.io/node.asn": ASN.to_string(),
            "kube-router.io/rr.client": "1",
            "node.alpha.kubernetes.io/ttl": (beat % 2 * 15).to_string()}, "labels": {
            "kubernetes.io/hostname": format!("node-{i}"), "kubernetes.io/os": "linux",
            "node.kubernetes.io/instance-type": "m5.2xlarge", "topology.kubernetes.io/zone": format!("zone-{}", i % 3)}},
        "spec": {"podCIDR": pod_cidr(i), "podCIDRs": [pod_cidr(i)]},
        "status": {"addresses": [{"type": "InternalIP", "address": node_ip(i)}, {"type": "Hostname", "address": format!("node-{i}")}],
                   "conditions": [{"type": "Ready", "status": "True", "lastHeartbeatTime": time}]}})
}

const ENVIRONMENTS: [&str; 3] = ["prod", "staging", "dev"];

fn namespace(n: usize) -> Value {
    json!({"apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": format!("ns-{n}"), "labels": {
            "kubernetes.io/metadata.name": format!("ns-{n}"), "team": format!("team-{}", n % 50),
            "env": ENVIRONMENTS[n % 3]}}})
}

/// A pod as the API returns it, with the bulk a real one carries (a container spec with env,
/// resources and mounts, managedFields), since stores that keep whole objects pay for it.
fn pod(s: &Sizes, g: usize, generation: usize, tier: &str, ready: bool) -> Value {
    let node_index = g % s.nodes;
    let app = app_of_pod(s, g);
    let name = format!("{app}-{g}-{generation}");
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"namespace": namespace_of_pod(s, g), "name": name,
            "uid": format!("00000000-0000-0000-{:04x}-{:012x}", generation & 0xffff, g),
            "labels": {"app": app, "tier": tier, "pod-template-hash": format!("{:08x}", g * 2_654_435_761 % 0xffff_ffff),
                       "version": format!("v{}", g % 7)},
            "annotations": {"kubectl.kubernetes.io/restartedAt": "2026-12-01T10:00:00Z"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": format!("{app}-rs"), "uid": "x", "controller": true}],
            "managedFields": [{"manager": "kube-controller-manager", "operation": "Update", "apiVersion": "v1",
                               "fieldsType": "FieldsV1", "fieldsV1": {"f:metadata": {"f:labels": {"f:app": {}, "f:tier": {}}}, "f:spec": {"f:containers": {}}}}]},
        "spec": {"nodeName": format!("node-{node_index}"), "serviceAccountName": "default", "restartPolicy": "Always",
            "containers": [{"name": "main", "image": format!("registry.example/{app}:1.{}", g % 20),
                "ports": [{"containerPort": 8080, "protocol": "TCP", "name": "http"}],
                "env": [{"name": "LOG_LEVEL", "value": "info"}, {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                        {"name": "CONFIG", "value": "/etc/app/config.yaml"}],
                "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}},
                "volumeMounts": [{"name": "config", "mountPath": "/etc/app"}, {"name": "kube-api-access", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "readOnly": true}],
                "readinessProbe": {"httpGet": {"path": "/ready", "port": 8080}, "periodSeconds": 5}}],
            "volumes": [{"name": "config", "configMap": {"name": format!("{app}-config")}},
                        {"name": "kube-api-access", "projected": {"sources": [{"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}}]}}]},
        "status": {"phase": "Running", "hostIP": node_ip(node_index), "podIP": pod_ip(s, g), "podIPs": [{"ip": pod_ip(s, g)}],
            "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }},
                           {"type": "ContainersReady", "status": if ready { "True" } else { "False" }}],
            "containerStatuses": [{"name": "main", "ready": ready, "restartCount": 0, "image": format!("registry.example/{app}:1.{}", g % 20),
                                   "imageID": "sha256:0123456789abcdef", "containerID": format!("containerd://{g:064x}"),
                                   "state": {"running": {"startedAt": "2026-12-01T10:00:05Z"}}}]}})
}

fn cluster_ip(i: usize) -> String {
    format!("10.{}.{}.{}", 96 + (i >> 16), (i >> 8) & 0xff, i & 0xff)
}

/// Service `i`'s nodePort (4 in every 20 Services have one): each its own, as the API server
/// allocates them (2,000 at full size, in 30000–31999).
fn node_port(i: usize) -> usize {
    30000 + (i / 20) * 4 + (i % 20 - 16)
}

fn service(s: &Sizes, i: usize) -> Value {
    let namespace = format!("ns-{}", i % s.namespaces);
    let mut spec = json!({"clusterIP": cluster_ip(i), "clusterIPs": [cluster_ip(i)], "selector": {"app": format!("app-{i}")},
        "ports": [{"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080}]});
    let mut status = json!({});
    match i % 20 {
        0..=15 => spec["type"] = json!("ClusterIP"),
        16..=18 => {
            spec["type"] = json!("NodePort");
            spec["ports"][0]["nodePort"] = json!(node_port(i));
        }
        _ => {
            spec["type"] = json!("LoadBalancer");
            spec["ports"][0]["nodePort"] = json!(node_port(i));
            status = json!({"loadBalancer": {"ingress": [{"ip": format!("198.18.{}.{}", (i >> 8) & 0xff, i & 0xff)}]}});
        }
    }
    if i.is_multiple_of(4) {
        spec["ports"]
            .as_array_mut()
            .unwrap()
            .push(json!({"name": "metrics", "protocol": "TCP", "port": 9090, "targetPort": 9090}));
    }
    json!({"apiVersion": "v1", "kind": "Service", "metadata": {"namespace": namespace, "name": format!("app-{i}")},
           "spec": spec, "status": status})
}

/// Service `i`'s slice: its ten pods, `replaced` (pod index → generation) naming new ones.
fn slice(s: &Sizes, i: usize, ready: &dyn Fn(usize) -> bool) -> Value {
    let endpoints: Vec<Value> = (0..ENDPOINTS_PER_SERVICE)
        .map(|e| {
            let g = i * ENDPOINTS_PER_SERVICE + e;
            json!({"addresses": [pod_ip(s, g)], "conditions": {"ready": ready(g), "serving": ready(g), "terminating": false},
                   "nodeName": format!("node-{}", g % s.nodes),
                   "targetRef": {"kind": "Pod", "namespace": namespace_of_pod(s, g), "name": format!("app-{i}-{g}")}})
        })
        .collect();
    let mut ports = vec![json!({"name": "http", "protocol": "TCP", "port": 8080})];
    if i.is_multiple_of(4) {
        ports.push(json!({"name": "metrics", "protocol": "TCP", "port": 9090}));
    }
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"namespace": format!("ns-{}", i % s.namespaces), "name": format!("app-{i}-abcde"),
                     "labels": {"kubernetes.io/service-name": format!("app-{i}"), "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}},
        "addressType": "IPv4", "ports": ports, "endpoints": endpoints})
}

/// Policies of the kinds clusters carry: default deny, app-to-app with ports, namespace
/// selectors, ipBlocks with exceptions, egress to DNS.
fn policy(s: &Sizes, p: usize) -> Value {
    let namespace = format!("ns-{}", (p * 7) % s.namespaces);
    let app = format!("app-{}", (p * 13) % s.services);
    let spec = match p % 5 {
        0 => json!({"podSelector": {}, "policyTypes": ["Ingress"]}),
        1 => json!({"podSelector": {"matchLabels": {"app": app}}, "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": {"tier": "frontend"}}}], "ports": [{"protocol": "TCP", "port": 8080}]}]}),
        2 => json!({"podSelector": {"matchLabels": {"app": app}}, "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"team": format!("team-{}", p % 50)}},
                                   "podSelector": {"matchExpressions": [{"key": "tier", "operator": "In", "values": ["frontend", "backend"]}]}}]}]}),
        3 => json!({"podSelector": {"matchLabels": {"tier": "db"}}, "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": [{"ipBlock": {"cidr": "10.64.0.0/11", "except": [format!("10.{}.0.0/16", 64 + p % 20)]}}]}],
            "egress": [{"to": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
                        "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}]}),
        _ => json!({"podSelector": {"matchExpressions": [{"key": "version", "operator": "NotIn", "values": ["v0"]}]},
            "policyTypes": ["Ingress"], "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"env": "prod"}}}],
            "ports": [{"protocol": "TCP", "port": 8080}, {"protocol": "TCP", "port": 9090}]}]}),
    };
    json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
           "metadata": {"namespace": namespace, "name": format!("policy-{p}")}, "spec": spec})
}

fn probe_service(k: usize) -> Value {
    let ip = PROBE_IP.map(|b| b.to_string()).join(".");
    json!({"apiVersion": "v1", "kind": "Service", "metadata": {"namespace": "ns-0", "name": "probe"},
        "spec": {"type": "ClusterIP", "clusterIP": ip, "clusterIPs": [ip], "selector": {"app": "app-0"},
                 "ports": [{"name": "p", "protocol": "TCP", "port": PROBE_PORT_BASE + (k % 20_000) as u16, "targetPort": 8080}]}})
}

/// A pinned map opened with BPF_OBJ_GET, looked up with BPF_MAP_LOOKUP_ELEM: the frontend map
/// polled without a process per poll.
struct PinnedMap(OwnedFd);

#[repr(C)]
struct ObjGetAttr {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
}

#[repr(C)]
struct LookupAttr {
    map_fd: u32,
    pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

impl PinnedMap {
    fn open(path: &Path) -> Option<Self> {
        let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).ok()?;
        let attr = ObjGetAttr { pathname: c_path.as_ptr() as u64, bpf_fd: 0, file_flags: 0 };
        // SAFETY: BPF_OBJ_GET (7) reads the attribute, which outlives the call.
        let fd = unsafe { libc::syscall(libc::SYS_bpf, 7, &attr as *const _, std::mem::size_of::<ObjGetAttr>()) };
        // SAFETY: a successful BPF_OBJ_GET returns a new fd that we own.
        (fd >= 0).then(|| Self(unsafe { OwnedFd::from_raw_fd(fd as i32) }))
    }

    fn contains(&self, key: &ServiceKeyV4) -> bool {
        let mut value = [0u8; 256];
        let attr = LookupAttr {
            map_fd: self.0.as_raw_fd() as u32,
            pad: 0,
            key: key as *const _ as u64,
            value: value.as_mut_ptr() as u64,
            flags: 0,
        };
        // SAFETY: BPF_MAP_LOOKUP_ELEM (1) reads the key and writes at most the map's value size
        // (the service value is far smaller than the buffer).
        unsafe { libc::syscall(libc::SYS_bpf, 1, &attr as *const _, std::mem::size_of::<LookupAttr>()) == 0 }
    }
}

fn probe_key(k: usize) -> ServiceKeyV4 {
    ServiceKeyV4 {
        addr: u32::from_ne_bytes(PROBE_IP),
        port: (PROBE_PORT_BASE + (k % 20_000) as u16).to_be(),
        proto: libc::IPPROTO_TCP as u8,
        pad: 0,
    }
}

/// Ends a run: the agent, its pinned state and the BGP peers.
fn tear_down(agent: Agent, root: &Path, peers: [&mut Child; 2]) {
    agent.kill();
    remove_bpf_root(root);
    for peer in peers {
        let _ = peer.kill();
        let _ = peer.wait();
    }
}

fn spawn_in(ns: &Netns, args: &[&str], log: &Path) -> Child {
    let file = fs::File::create(log).unwrap();
    Command::new("nsenter")
        .arg(format!("--net={}", ns.path()))
        .args(args)
        .stdout(file.try_clone().unwrap())
        .stderr(file)
        .stdin(Stdio::null())
        .spawn()
        .unwrap()
}

fn scrape(ns: &Netns) -> String {
    let out = ns
        .run(&[netprobe_bin().to_str().unwrap(), "http", &format!("127.0.0.1:{METRICS_PORT}"), "/metrics"])
        .unwrap_or_default();
    out.split_once('\n').map(|(_, body)| body.to_string()).unwrap_or_default()
}

/// `/readyz` answers 200: every controller has reconciled once from a complete (or restored)
/// state. Cheap, unlike a scrape, which renders every Service's series (tens of MiB at full
/// size): polled every 20 ms while the agent starts, a scrape took a third of its CPU.
fn ready(ns: &Netns) -> bool {
    ns.run(&[netprobe_bin().to_str().unwrap(), "http", &format!("127.0.0.1:{HEALTH_PORT}"), "/readyz"])
        .is_ok_and(|out| out.starts_with("200"))
}

/// The sum of the samples of `series` (a name, or a name with the start of its labels).
fn sample(scrape: &str, series: &str) -> f64 {
    scrape
        .lines()
        .filter(|l| !l.starts_with('#') && l.starts_with(series))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

fn kernel_routes(ns: &Netns) -> usize {
    ns.run(&["ip", "-4", "route", "show", "proto", "186"]).map(|out| out.lines().count()).unwrap_or(0)
}

/// utime + stime of `pid`, in seconds.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command's closing parenthesis: state is field 3, utime 14, stime 15.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / hz
}

/// Bytes the process has passed to write(2) and its kin (`wchar` of /proc/PID/io): at the
/// agent, mostly its checkpoint.
fn written_bytes(pid: u32) -> f64 {
    let io = fs::read_to_string(format!("/proc/{pid}/io")).unwrap_or_default();
    io.lines().find_map(|l| l.strip_prefix("wchar: ")).and_then(|v| v.trim().parse().ok()).unwrap_or(0.0)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted.get(((sorted.len() as f64 - 1.0) * p).round() as usize).copied().unwrap_or_default()
}

fn dir_size(dir: &Path) -> u64 {
    fs::read_dir(dir)
        .map(|entries| {
            entries.flatten().filter_map(|e| e.metadata().ok()).filter(|m| m.is_file()).map(|m| m.len()).sum()
        })
        .unwrap_or(0)
}

struct Phase {
    started: Instant,
}

impl Phase {
    fn begin() -> Self {
        Self { started: Instant::now() }
    }

    /// Polls `done` every 20 ms; the time from `begin` until it held.
    fn until(&self, what: &str, timeout: Duration, mut done: impl FnMut() -> bool) -> Duration {
        while !done() {
            assert!(self.started.elapsed() < timeout, "{what} not done within {timeout:?}");
            thread::sleep(Duration::from_millis(20));
        }
        self.started.elapsed()
    }
}

fn main() {
    std::env::set_var("KRT_QUIET_AGENT", "1");
    let scale: f64 = env_or("KRT_SCALE", 1.0);
    let scaled = |n: usize| ((n as f64 * scale).round() as usize).max(2);
    let s =
        Sizes { nodes: scaled(5_000), namespaces: scaled(5_000), services: scaled(10_000), policies: scaled(2_000) };
    let rate: f64 = env_or("KRT_SCALE_RATE", 200.0);
    let churn_secs: u64 = env_or("KRT_SCALE_CHURN_SECS", 300);
    // Kubelets' Node status updates, on top of the changes: one a node every 10 s (kubelet's
    // nodeStatusUpdateFrequency), each of nothing the agent reads.
    let heartbeat_rate: f64 = env_or("KRT_SCALE_NODE_HEARTBEATS", s.nodes as f64 / 10.0);

    let dir = PathBuf::from("/tmp/krt-scale");
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    let node_ns = Netns::new("krt-scale-node").unwrap();
    let rr_ns = Netns::new("krt-scale-rr").unwrap();
    veth(&node_ns, "eth0", &format!("{AGENT_ADDR}/18"), &rr_ns, "eth0", &format!("{RR_ADDR}/18")).unwrap();
    rr_ns.run(&["ip", "addr", "add", &format!("{NODES_ADDR}/18"), "dev", "eth0"]).unwrap();
    node_ns.run(&["ip", "route", "add", "default", "via", RR_ADDR]).unwrap();
    node_ns.sysctl("net.ipv4.ip_forward", "1").unwrap();

    // The other nodes' pod routes: BIRD announces them (next hop: each node's address) to the
    // route reflector, which reflects them to the agent.
    let statics: String = (1..s.nodes).map(|i| format!("  route {} via {};\n", pod_cidr(i), node_ip(i))).collect();
    let bird_conf = format!(
        "router id {NODES_ADDR};\nprotocol device {{ }}\nprotocol static other_nodes {{ ipv4;\n{statics}}}\n\
         protocol bgp to_rr {{ local {NODES_ADDR} as {ASN}; neighbor {RR_ADDR} as {ASN}; connect retry time 1;\n  \
         strict bind on;\n  \
         ipv4 {{ import none; export where source = RTS_STATIC; next hop keep; }}; }}\n"
    );
    fs::write(dir.join("bird.conf"), bird_conf).unwrap();
    let socket = dir.join("bird.ctl");
    let mut bird = spawn_in(
        &rr_ns,
        &["bird", "-f", "-c", dir.join("bird.conf").to_str().unwrap(), "-s", socket.to_str().unwrap()],
        &dir.join("bird.log"),
    );
    let rr_conf = format!(
        "[global.config]\n  as = {ASN}\n  router-id = \"{RR_ADDR}\"\n  local-address-list = [\"{RR_ADDR}\"]\n{}",
        [AGENT_ADDR, NODES_ADDR]
            .iter()
            .map(|peer| format!(
                "[[neighbors]]\n  [neighbors.config]\n    neighbor-address = \"{peer}\"\n    peer-as = {ASN}\n  \
                 [neighbors.timers.config]\n    connect-retry = 1\n  [neighbors.route-reflector.config]\n    \
                 route-reflector-client = true\n    route-reflector-cluster-id = \"{RR_ADDR}\"\n"
            ))
            .collect::<String>()
    );
    fs::write(dir.join("gobgpd.toml"), rr_conf).unwrap();
    let mut gobgpd = spawn_in(
        &rr_ns,
        &["gobgpd", "-f", dir.join("gobgpd.toml").to_str().unwrap(), "--disable-stdlog"],
        &dir.join("gobgpd.log"),
    );

    // The API server, in the agent's namespace, filled before the agent starts.
    let runtime = NetnsRuntime::new(&node_ns).unwrap();
    let server = Arc::new(runtime.run(async { FakeApiServer::spawn(FakeApiServerConfig::default()).await.unwrap() }));
    let filled = Instant::now();
    const TIERS: [&str; 3] = ["frontend", "backend", "db"];
    let tier = |g: usize| TIERS[g % 3];
    for i in 0..s.nodes {
        server.apply(node(i)).unwrap();
    }
    for n in 0..s.namespaces {
        server.apply(namespace(n)).unwrap();
    }
    for g in 0..s.pods() {
        server.apply(pod(&s, g, 0, tier(g), true)).unwrap();
    }
    for i in 0..s.services {
        server.apply(service(&s, i)).unwrap();
        server.apply(slice(&s, i, &|_| true)).unwrap();
    }
    for p in 0..s.policies {
        server.apply(policy(&s, p)).unwrap();
    }
    server.apply(probe_service(0)).unwrap();
    eprintln!(
        "API server filled in {:.1} s: {} nodes, {} namespaces, {} pods, {} services, {} endpoints, {} policies",
        filled.elapsed().as_secs_f64(),
        s.nodes,
        s.namespaces,
        s.pods(),
        s.services,
        s.services * ENDPOINTS_PER_SERVICE,
        s.policies
    );

    let root = PathBuf::from("/sys/fs/bpf/krt-scale");
    let state = dir.join("state");
    let cni_conf = dir.join("cni/10-kuberouter.conflist");
    let url = server.url();
    let args_owned: Vec<String> = [
        "--master",
        &url,
        "--hostname-override",
        "node-0",
        "--state-dir",
        state.to_str().unwrap(),
        "--cni-conf-file",
        cni_conf.to_str().unwrap(),
        "--run-router=true",
        "--run-firewall=true",
        "--run-service-proxy=true",
        "--nodes-full-mesh=false",
        "--cluster-asn",
        &ASN.to_string(),
        "--peer-router-ips",
        RR_ADDR,
        "--peer-router-asns",
        &ASN.to_string(),
        "--service-cluster-ip-range",
        "10.96.0.0/12",
        "--loadbalancer-ip-range",
        "198.18.0.0/16",
        "--health-port",
        HEALTH_PORT,
        "--metrics-port",
        METRICS_PORT,
    ]
    .map(String::from)
    .to_vec();
    let args: Vec<&str> = args_owned.iter().map(String::as_str).collect();
    let frontends = |root: &Path| PinnedMap::open(&maps_dir(root).join(kube_router_common::map_names::SERVICES));
    let synced = |scrape: &str| {
        // The policy gauge appears with the first complete policy sync.
        sample(scrape, "kube_router_sync_duration_seconds_count") >= 1.0
            && scrape.lines().any(|l| l.starts_with("kube_router_policy_sync_seconds "))
    };

    // 1. Cold start from the API. The API server runs in this process: its CPU time during the
    // start (the harness's polling included, which is small) beside the agent's says how much
    // of the start is the server's on a machine where both share the cores.
    remove_bpf_root(&root);
    let server_cpu_before = cpu_seconds(std::process::id());
    let phase = Phase::begin();
    let agent = Agent::start(&node_ns, &root, &args).unwrap();
    let record = |out: String, pid: u32| {
        Command::new("perf")
            .args(["record", "-F", "199", "--call-graph", "dwarf,16384", "-o", &out, "-p", &pid.to_string()])
            .stdout(Stdio::null())
            .spawn()
            .expect("perf record")
    };
    let perfs: Vec<Child> = [("KRT_SCALE_PERF", agent.pid()), ("KRT_SCALE_PERF_SERVER", std::process::id())]
        .into_iter()
        .filter_map(|(variable, pid)| Some(record(std::env::var(variable).ok()?, pid)))
        .collect();
    let api_cold = phase.until("cold start from the API", Duration::from_secs(600), || {
        // Cheap checks first: a scrape renders every Service's series (tens of MiB at full size).
        frontends(&root).is_some_and(|m| m.contains(&probe_key(0))) && ready(&node_ns) && synced(&scrape(&node_ns))
    });
    let api_cold_rss = agent.peak_rss_kib().unwrap_or(0);
    let (api_cold_agent_cpu, api_cold_server_cpu) =
        (cpu_seconds(agent.pid()), cpu_seconds(std::process::id()) - server_cpu_before);
    let api_cold_load = fs::read_to_string("/proc/loadavg").unwrap_or_default();
    for mut perf in perfs {
        // SAFETY: signals a child of this process.
        unsafe { libc::kill(perf.id() as i32, libc::SIGINT) };
        let _ = perf.wait();
    }
    if std::env::var_os("KRT_SCALE_ONLY_API_START").is_some() {
        tear_down(agent, &root, [&mut gobgpd, &mut bird]);
        println!(
            "cold start from the API              {:>8.2} s    peak RSS {:>7.1} MiB   (goal < 5 s, < 250 MiB)",
            api_cold.as_secs_f64(),
            api_cold_rss as f64 / 1024.0
        );
        println!(
            "  CPU during it: agent {api_cold_agent_cpu:.2} s, API server {api_cold_server_cpu:.2} s (this process; 1-min load average {})",
            api_cold_load.split_whitespace().next().unwrap_or("?")
        );
        return;
    }
    let established = phase.until("the BGP session with the route reflector", Duration::from_secs(600), || {
        sample(&scrape(&node_ns), "kube_router_bgp_session_established") >= 1.0
    });
    let routes_in = phase.until("every reflected route in the kernel", Duration::from_secs(600), || {
        kernel_routes(&node_ns) >= s.nodes - 1
    });
    eprintln!(
        "cold start {:.2} s, session up at {:.2} s, {} routes in the kernel at {:.2} s",
        api_cold.as_secs_f64(),
        established.as_secs_f64(),
        kernel_routes(&node_ns),
        routes_in.as_secs_f64()
    );

    // 2. The checkpoint, then a cold start from it with the API down and the bpffs wiped.
    thread::sleep(Duration::from_secs(5));
    let checkpoint_bytes = dir_size(&state);
    agent.kill();
    runtime.run({
        let server = server.clone();
        async move { server.stop().await }
    });
    remove_bpf_root(&root);
    let phase = Phase::begin();
    let agent = Agent::start(&node_ns, &root, &args).unwrap();
    let checkpoint_cold = phase.until("cold start from the checkpoint", Duration::from_secs(600), || {
        // Cheap checks first: a scrape renders every Service's series (tens of MiB at full size).
        frontends(&root).is_some_and(|m| m.contains(&probe_key(0))) && ready(&node_ns) && synced(&scrape(&node_ns))
    });
    let checkpoint_rss = agent.peak_rss_kib().unwrap_or(0);
    let checkpoint_cold_agent_cpu = cpu_seconds(agent.pid());
    runtime.run({
        let server = server.clone();
        async move { server.start().await.unwrap() }
    });
    Phase::begin().until("the agent back on the API", Duration::from_secs(120), || {
        sample(&scrape(&node_ns), "kube_router_api_reachable") >= 1.0
    });
    // The relist after the outage ends in one complete sync that compiles everything; churn
    // starts after it, so the churn measures changes, not the catch-up.
    Phase::begin().until("the first complete services sync after the outage", Duration::from_secs(300), || {
        thread::sleep(Duration::from_millis(500));
        sample(&scrape(&node_ns), "kube_router_service_complete_syncs_total") >= 1.0
    });
    thread::sleep(Duration::from_secs(5));

    // 3. Churn at `rate` changes per second, with a probe change every 100 ms.
    let map = frontends(&root).expect("frontend map pinned");
    let pid = agent.pid();
    // For a profile of the churn from outside (`perf record -p PID`).
    eprintln!("churn starts: agent pid {pid}");
    let before_churn = scrape(&node_ns);
    let cpu_before = cpu_seconds(pid);
    let written_before = written_bytes(pid);
    let mut generation: BTreeMap<usize, usize> = BTreeMap::new();
    let mut unready: std::collections::BTreeSet<usize> = Default::default();
    let mut latencies = Vec::new();
    let mut rss_samples = Vec::new();
    let (mut changes, mut probes, mut heartbeats) = (0usize, 0usize, 0usize);
    let mut lcg: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = |n: usize| {
        lcg = lcg.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        ((lcg >> 33) as usize) % n
    };
    let churn = Instant::now();
    let mut next_probe = churn;
    while churn.elapsed() < Duration::from_secs(churn_secs) {
        // Changes due by now at `rate`.
        let due = (churn.elapsed().as_secs_f64() * rate) as usize;
        while changes < due {
            let g = next(s.pods());
            let service_of = |g: usize| (g < s.services * ENDPOINTS_PER_SERVICE).then_some(g / ENDPOINTS_PER_SERVICE);
            match next(10) {
                // A pod replaced: the old object goes, a new one comes (same address slot),
                // its slice updated.
                0..=3 => {
                    let old = *generation.get(&g).unwrap_or(&0);
                    let old_name = format!("{}-{g}-{old}", app_of_pod(&s, g));
                    let _ = server.delete("Pod", Some(&namespace_of_pod(&s, g)), &old_name);
                    generation.insert(g, old + 1);
                    server.apply(pod(&s, g, old + 1, tier(g), true)).unwrap();
                    changes += 2;
                    if let Some(i) = service_of(g) {
                        let unready = unready.clone();
                        server.apply(slice(&s, i, &|e| !unready.contains(&e))).unwrap();
                        changes += 1;
                    }
                }
                // A label change (the tier policies select on).
                4..=6 => {
                    let generation = *generation.get(&g).unwrap_or(&0);
                    server.apply(pod(&s, g, generation, tier(g + 1 + next(2)), !unready.contains(&g))).unwrap();
                    changes += 1;
                }
                // Readiness flips, seen by the pod and its slice.
                7..=8 => {
                    if !unready.remove(&g) {
                        unready.insert(g);
                    }
                    let generation = *generation.get(&g).unwrap_or(&0);
                    server.apply(pod(&s, g, generation, tier(g), !unready.contains(&g))).unwrap();
                    changes += 1;
                    if let Some(i) = service_of(g) {
                        let unready = unready.clone();
                        server.apply(slice(&s, i, &|e| !unready.contains(&e))).unwrap();
                        changes += 1;
                    }
                }
                // A node leaves and joins again (never this one).
                _ => {
                    let i = 1 + next(s.nodes - 1);
                    let _ = server.delete("Node", None, &format!("node-{i}"));
                    server.apply(node(i)).unwrap();
                    changes += 2;
                }
            }
        }
        let due = (churn.elapsed().as_secs_f64() * heartbeat_rate) as usize;
        while heartbeats < due {
            heartbeats += 1;
            let i = 1 + heartbeats % (s.nodes - 1);
            server.apply(node_at(i, heartbeats / (s.nodes - 1) + 1)).unwrap();
        }
        if Instant::now() >= next_probe {
            probes += 1;
            let started = Instant::now();
            server.apply(probe_service(probes)).unwrap();
            while !map.contains(&probe_key(probes)) && started.elapsed() < Duration::from_secs(30) {
                thread::sleep(Duration::from_micros(200));
            }
            latencies.push(started.elapsed());
            next_probe = started + Duration::from_millis(100);
            if probes.is_multiple_of(50) {
                rss_samples.push(agent.rss_kib().unwrap_or(0) / 1024);
            }
        }
        thread::sleep(Duration::from_micros(500));
    }
    let churn_time = churn.elapsed().as_secs_f64();
    let cpu_share = (cpu_seconds(pid) - cpu_before) / churn_time;
    let written_per_second = (written_bytes(pid) - written_before) / churn_time;
    let churn_load = fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let peak_rss = agent.peak_rss_kib().unwrap_or(0);
    let end = scrape(&node_ns);
    latencies.sort();
    tear_down(agent, &root, [&mut gobgpd, &mut bird]);

    let mib = |kib: u64| kib as f64 / 1024.0;
    println!(
        "== one agent, {} nodes / {} pods / {} namespaces / {} services ({} endpoints) / {} policies",
        s.nodes,
        s.pods(),
        s.namespaces,
        s.services,
        s.services * ENDPOINTS_PER_SERVICE,
        s.policies
    );
    println!(
        "cold start from the API              {:>8.2} s    peak RSS {:>7.1} MiB   (goal < 5 s, < 250 MiB)",
        api_cold.as_secs_f64(),
        mib(api_cold_rss)
    );
    println!(
        "  CPU during it: agent {api_cold_agent_cpu:.2} s, API server {api_cold_server_cpu:.2} s (this process; 1-min load average {})",
        api_cold_load.split_whitespace().next().unwrap_or("?")
    );
    println!(
        "cold start from the checkpoint       {:>8.2} s    peak RSS {:>7.1} MiB   (API down, bpffs wiped; goal < 3 s)",
        checkpoint_cold.as_secs_f64(),
        mib(checkpoint_rss)
    );
    println!("  CPU during it: agent {checkpoint_cold_agent_cpu:.2} s");
    println!("checkpoint on disk                   {:>8.1} MiB", checkpoint_bytes as f64 / (1 << 20) as f64);
    println!(
        "BGP: session up {:.2} s after start, {} routes in the kernel {:.2} s after it   (goal < 2 s)",
        established.as_secs_f64(),
        s.nodes - 1,
        routes_in.saturating_sub(established).as_secs_f64()
    );
    println!(
        "churn: {changes} changes and {heartbeats} Node heartbeats in {churn_time:.0} s ({:.0}/s, {:.0}/s): agent CPU {:.1} % of one core (goal < 10 %), peak RSS {:.1} MiB, RSS every 5 s {rss_samples:?} MiB",
        changes as f64 / churn_time,
        heartbeats as f64 / churn_time,
        cpu_share * 100.0,
        mib(peak_rss)
    );
    println!(
        "  agent writes during churn {:.2} MiB/s (mostly the checkpoint), checkpoint on disk after it {:.1} MiB, 1-min load average {}",
        written_per_second / (1 << 20) as f64,
        dir_size(&state) as f64 / (1 << 20) as f64,
        churn_load.split_whitespace().next().unwrap_or("?")
    );
    println!(
        "change -> map ({} probes): p50 {:.1} ms  p99 {:.1} ms  max {:.1} ms   (goal p99 < 10 ms)",
        latencies.len(),
        percentile(&latencies, 0.5).as_secs_f64() * 1e3,
        percentile(&latencies, 0.99).as_secs_f64() * 1e3,
        latencies.last().copied().unwrap_or_default().as_secs_f64() * 1e3
    );
    let during_churn = |series: &str| sample(&end, series) - sample(&before_churn, series);
    // Every reason a sync compiled every Service, with its count during the churn.
    let full_compiles: Vec<String> = end
        .lines()
        .filter_map(|l| l.strip_prefix("kube_router_service_full_compiles_total{reason=\""))
        .filter_map(|l| l.split_once('"'))
        .map(|(reason, _)| {
            let series = format!("kube_router_service_full_compiles_total{{reason=\"{reason}\"}}");
            format!("{reason} {:.0}", during_churn(&series))
        })
        .collect();
    println!(
        "service syncs during churn {:.0} ({:.0} complete), of which compiling every Service: {:.0} ({}); \
         last policy sync {:.3} s, API errors {:.0}",
        during_churn("kube_router_sync_duration_seconds_count"),
        during_churn("kube_router_service_complete_syncs_total"),
        during_churn("kube_router_service_full_compiles_total"),
        full_compiles.join(", "),
        sample(&end, "kube_router_policy_sync_seconds "),
        sample(&end, "kube_router_api_errors_total")
    );
}
