//! A small cluster in network namespaces, for every multi-node test and the demo.
//!
//! ```text
//!  client 192.168.100.2 ─┐                      ┌─ node-1 10.100.0.1 ── kube-bridge 10.244.1.1 ── pods
//!                        ├── fabric (router) ───┤
//!  internet 203.0.113.10 ┘   10.100.0.254       └─ node-2 10.100.0.2 ── kube-bridge 10.244.2.1 ── pods
//! ```
//!
//! The fabric namespace routes between the node subnet (a bridge), an external client's subnet
//! and an "internet" host outside the cluster; it does not know the pod CIDRs (pods reach the
//! internet through the nodes' masquerade). It also holds the fake API server. Each node runs a
//! real kube-router agent in API mode; pod routes between nodes come from the agents' own BGP.
//! Pods are network namespaces wired by the real CNI plugins (`bridge` + `host-local`, then
//! `portmap`) from kube-router's CNI configuration, each running `krt-netprobe serve` on TCP and
//! UDP ports 8080 and 5353. The harness plays the endpoint controller: Services declared with a
//! selector get their EndpointSlice from the ready pods that match.
//!
//! With [`ClusterBuilder::dual_stack`] every link also carries IPv6 (nodes `fd00:100::N`, pod
//! CIDRs `fd00:244:N::/64` in the Node's `spec.podCIDRs`, routed between nodes by the agents'
//! MP-BGP with the node's IPv6 address as next hop; client `fd00:c::2`), pods get an address of
//! each family from the CNI plugins, and Services declared dual-stack get both ClusterIPs and an
//! EndpointSlice per address type.
//!
//! With [`ClusterBuilder::only_agent_args`] the agents run with a given arg list and the
//! harness's plumbing alone, as a DaemonSet would start them (upstream's, in
//! `tests/tests/upstream_daemonsets.rs`).
//!
//! Everything is torn down on drop. Waits poll real state (routes, pinned maps), never logs.
use std::{
    collections::BTreeMap,
    fs,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{Arc, Mutex},
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use crate::{
    apiserver::{FakeApiServer, FakeApiServerConfig, FaultMode},
    dump_maps, kube_router_bin, netprobe_bin, remove_bpf_root, Agent, Netns, NetnsRuntime, TestCgroup,
};

pub const FABRIC_ADDR: &str = "10.100.0.254";
pub const CLIENT_ADDR: &str = "192.168.100.2";
pub const INTERNET_ADDR: &str = "203.0.113.10";
pub const FABRIC_ADDR6: &str = "fd00:100::fe";
pub const CLIENT_ADDR6: &str = "fd00:c::2";
/// The "internet" host's IPv6 address (documentation range: outside the cluster, routed by the
/// fabric, which knows no pod CIDR of either family).
pub const INTERNET_ADDR6: &str = "2001:db8:113::10";
/// Ports every pod (and the internet host) serves on, TCP and UDP.
pub const POD_PORTS: [u16; 2] = [8080, 5353];
pub const CNI_PLUGIN_DIR: &str = "/usr/lib/cni";
/// The `--service-external-ip-range` every cluster agent runs with.
pub const EXTERNAL_IP_RANGES: &str = "192.0.2.0/24,198.51.100.64/28,2001:db8:2::/64";
/// The `--loadbalancer-ip-range` every cluster agent runs with: the LoadBalancer IPs tests use.
pub const LOAD_BALANCER_IP_RANGES: &str = "198.51.100.0/24,2001:db8:51::/64";
const HEALTH_PORT: &str = "20244";
const METRICS_PORT: &str = "20241";

pub fn node_ip(node: usize) -> String {
    format!("10.100.0.{}", node + 1)
}

pub fn pod_cidr(node: usize) -> String {
    format!("10.244.{}.0/24", node + 1)
}

pub fn node_ip6(node: usize) -> String {
    format!("fd00:100::{}", node + 1)
}

pub fn pod_cidr6(node: usize) -> String {
    format!("fd00:244:{}::/64", node + 1)
}

/// Lets IPv6 addresses be used at once: duplicate address detection would keep each new address
/// tentative (unusable) for about a second, on links no other host can claim anyway.
fn ipv6_without_dad(ns: &Netns) -> Result<()> {
    for conf in ["all", "default"] {
        ns.sysctl(&format!("net.ipv6.conf.{conf}.accept_dad"), "0")?;
    }
    Ok(())
}

/// The CNI configuration template a DaemonSet installs (kube-router's ConfigMap shape, no pod
/// ranges yet), with host-local's state in `data_dir`. The agent fills in the node's ranges.
pub fn cni_template(data_dir: &Path) -> Value {
    json!({
        "cniVersion": "0.3.0",
        "name": "mynet",
        "plugins": [
            {
                "name": "kubernetes",
                "type": "bridge",
                "bridge": "kube-bridge",
                "isDefaultGateway": true,
                "hairpinMode": true,
                "ipam": {"type": "host-local", "dataDir": data_dir}
            },
            {"type": "portmap", "capabilities": {"snat": true, "portMappings": true}}
        ]
    })
}

/// The CNI configuration another CNI would give a node's pods when the agent writes none
/// (`--enable-cni=false`): the template with the node's pod CIDRs as its ranges.
fn operator_conflist(node: &ClusterNode, data_dir: &Path) -> Value {
    let mut conflist = cni_template(data_dir);
    let cidrs = [Some(&node.pod_cidr), node.pod_cidr6.as_ref()].into_iter().flatten();
    let ranges: Vec<Value> = cidrs.map(|cidr| json!([{"subnet": cidr}])).collect();
    conflist["plugins"][0]["ipam"]["ranges"] = json!(ranges);
    conflist
}

/// The kubeconfig the cluster named `prefix` writes for its API server (see
/// [`ClusterBuilder::only_agent_args`]): known before the cluster is built.
pub fn kubeconfig_path(prefix: &str) -> PathBuf {
    std::env::temp_dir().join(prefix).join("kubeconfig")
}

/// `args` turn boolean flag `--<name>` off (`--name=false`, or `--name false`).
fn flag_off(args: &[String], name: &str) -> bool {
    let flag = format!("--{name}");
    let joined = format!("{flag}=false");
    args.iter().enumerate().any(|(k, a)| *a == joined || (*a == flag && args.get(k + 1).is_some_and(|v| v == "false")))
}

/// Waits until the agent has written the node's CNI configuration (its pod ranges filled in),
/// giving up 5 s after `errors` (the agent's CNI error count) turns nonzero rather than after
/// 30 s: the retry after a transient error has come by then.
fn wait_conflist_or_errors(path: &Path, mut errors: impl FnMut() -> f64) -> Result<Value> {
    let mut deadline = Instant::now() + Duration::from_secs(30);
    let mut counted = false;
    let mut next_scrape = Instant::now();
    loop {
        let written: Option<Value> = fs::read(path).ok().and_then(|b| serde_json::from_slice(&b).ok());
        if let Some(conflist) = written.filter(|c| c["plugins"][0]["ipam"]["ranges"].is_array()) {
            return Ok(conflist);
        }
        if Instant::now() > deadline {
            let reported = if counted { " (it counts CNI configuration errors)" } else { "" };
            bail!("the agent did not write its CNI configuration to {}{reported}", path.display());
        }
        if !counted && Instant::now() >= next_scrape {
            next_scrape = Instant::now() + Duration::from_millis(500);
            if errors() > 0.0 {
                counted = true;
                deadline = deadline.min(Instant::now() + Duration::from_secs(5));
            }
        }
        thread::sleep(Duration::from_millis(50));
    }
}

/// Runs a CNI configuration list's plugins in order (CNI_COMMAND=ADD), inside `node`'s network
/// namespace, for the pod namespace `pod`; returns the last plugin's result.
pub fn cni_add(node: &Netns, conflist: &Value, pod: &Netns, container_id: &str) -> Result<Value> {
    let version = conflist["cniVersion"].clone();
    let name = conflist["name"].clone();
    let mut previous: Option<Value> = None;
    for plugin in conflist["plugins"].as_array().context("conflist has no plugins")? {
        let mut config = plugin.clone();
        config["cniVersion"] = version.clone();
        config["name"] = name.clone();
        if let Some(result) = &previous {
            config["prevResult"] = result.clone();
        }
        let kind = plugin["type"].as_str().context("plugin without a type")?;
        let mut child = Command::new("nsenter")
            .arg(format!("--net={}", node.path()))
            .arg(Path::new(CNI_PLUGIN_DIR).join(kind))
            .env("CNI_COMMAND", "ADD")
            .env("CNI_CONTAINERID", container_id)
            .env("CNI_NETNS", pod.path())
            .env("CNI_IFNAME", "eth0")
            .env("CNI_PATH", CNI_PLUGIN_DIR)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("running CNI plugin {kind} (is containernetworking-plugins installed?)"))?;
        serde_json::to_writer(child.stdin.take().context("stdin")?, &config)?;
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!(
                "CNI plugin {kind} failed: {} {}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        previous = Some(serde_json::from_slice(&out.stdout).with_context(|| format!("CNI plugin {kind}'s result"))?);
    }
    previous.context("no plugin ran")
}

/// The address (without prefix length) a CNI result gave interface eth0, of one family.
fn result_address(result: &Value, ipv6: bool) -> Option<String> {
    result["ips"].as_array()?.iter().find_map(|ip| {
        let address = ip["address"].as_str()?.split('/').next()?.to_string();
        (address.contains(':') == ipv6).then_some(address)
    })
}

pub struct Pod {
    pub ns: Netns,
    /// Pod (and netprobe server) name, e.g. `pod-1-0`.
    pub name: String,
    pub node: usize,
    pub ip: String,
    /// The pod's IPv6 address (dual-stack clusters).
    pub ip6: Option<String>,
    pub labels: BTreeMap<String, String>,
}

impl Pod {
    /// `count` requests from this pod (netprobe `request`): the replies, or "ERR ...".
    pub fn request(&self, proto: &str, addr: &str, count: usize) -> Vec<String> {
        request(&self.ns, proto, addr, count)
    }
}

pub struct ClusterNode {
    pub ns: Netns,
    pub name: String,
    pub ip: String,
    pub pod_cidr: String,
    /// Dual-stack clusters: the node's IPv6 address and pod CIDR.
    pub ip6: Option<String>,
    pub pod_cidr6: Option<String>,
    pub bpf_root: PathBuf,
    pub state_dir: PathBuf,
    pub cni_dir: PathBuf,
    /// With [`ClusterBuilder::socket_lb`]: the cgroup standing in for this node's cgroup root,
    /// which its agent's socket load balancer is attached to.
    pub cgroup: Option<TestCgroup>,
}

impl ClusterNode {
    /// `args` run as a process of the node itself (its namespace; with the socket load
    /// balancer, inside the node's cgroup); its stdout.
    pub fn run_as_host_process(&self, args: &[&str]) -> Result<String> {
        match &self.cgroup {
            Some(cgroup) => TestCgroup::run(&self.ns, &cgroup.path, args),
            None => self.ns.run(args),
        }
    }

    /// Sets the MTU of the pod bridge and of every pod veth on it: a smaller hop in front of
    /// this node's pods.
    pub fn set_pod_bridge_mtu(&self, mtu: u32) -> Result<()> {
        let mtu = mtu.to_string();
        let host_veths = self.ns.run(&["ip", "-o", "link", "show", "master", "kube-bridge"])?;
        for line in host_veths.lines() {
            let name = line.split(':').nth(1).context("ip -o link output")?.trim().split('@').next().unwrap_or("");
            self.ns.run(&["ip", "link", "set", name, "mtu", &mtu])?;
        }
        self.ns.run(&["ip", "link", "set", "kube-bridge", "mtu", &mtu])?;
        Ok(())
    }

    /// Where the agent writes this node's CNI configuration (`--cni-conf-file`).
    pub fn cni_conf_file(&self) -> PathBuf {
        self.cni_dir.join("10-kuberouter.conflist")
    }

    /// What `kube-router services` prints on this node (read from its pinned maps).
    pub fn services(&self) -> String {
        let out = Command::new(kube_router_bin()).arg("--bpf-root").arg(&self.bpf_root).arg("services").output();
        out.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default()
    }

    /// The routes our BGP installed (protocol 186), IPv4 then IPv6, trimmed, one per line.
    pub fn bgp_routes(&self) -> String {
        let mut routes = self.ns.run(&["ip", "route", "show", "proto", "186"]).unwrap_or_default();
        if self.ip6.is_some() {
            routes += &self.ns.run(&["ip", "-6", "route", "show", "proto", "186"]).unwrap_or_default();
        }
        routes.lines().map(str::trim).collect::<Vec<_>>().join("\n")
    }

    /// The agent's /metrics, as text.
    pub fn metrics(&self) -> String {
        let out = self.ns.scrape_metrics(METRICS_PORT).unwrap_or_default();
        out.split_once('\n').map(|(_, body)| body.to_string()).unwrap_or_default()
    }

    /// A counter or gauge from /metrics (the sum over its series matching `labels`).
    pub fn metric(&self, name: &str, labels: &str) -> f64 {
        self.metrics()
            .lines()
            .filter(|l| l.starts_with(name) && l.contains(labels) && !l.starts_with('#'))
            .filter(|l| l[name.len()..].starts_with(['{', ' ']))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// The XDP mode `eth0` runs a program in ("xdp": native, "xdpgeneric", ...), if any, and
    /// that program's id.
    pub fn uplink_xdp(&self) -> Option<(String, u32)> {
        let out = self.ns.run(&["ip", "-d", "link", "show", "eth0"]).ok()?;
        let mode = out.lines().next()?.split_whitespace().find(|w| w.starts_with("xdp"))?.to_string();
        let id = out.split_once("prog/xdp id ")?.1.split_whitespace().next()?.parse().ok()?;
        Some((mode, id))
    }

    /// `kube-router services -o json` on this node: its maps, named by its agent (`--state-dir`).
    pub fn services_json(&self) -> Option<serde_json::Value> {
        let out = Command::new(kube_router_bin())
            .arg("--bpf-root")
            .arg(&self.bpf_root)
            .arg("--state-dir")
            .arg(&self.state_dir)
            .args(["services", "-o", "json"])
            .output()
            .ok()?;
        serde_json::from_slice(&out.stdout).ok()
    }

    /// `kube-router bgp -o json` on this node (its agent's status socket in `--state-dir`).
    pub fn bgp_report(&self) -> Value {
        let out = Command::new(kube_router_bin())
            .arg("--state-dir")
            .arg(&self.state_dir)
            .args(["bgp", "-o", "json"])
            .output();
        out.ok().and_then(|o| serde_json::from_slice(&o.stdout).ok()).unwrap_or_default()
    }

    /// The datapath counters (`kube-router stats`) by name.
    pub fn stats(&self) -> BTreeMap<String, u64> {
        let out = Command::new(kube_router_bin()).arg("--bpf-root").arg(&self.bpf_root).arg("stats").output();
        let text = out.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default();
        text.lines()
            .filter_map(|l| {
                let (name, n) = l.split_once(' ')?;
                Some((name.to_string(), n.trim().parse().ok()?))
            })
            .collect()
    }

    /// `count` requests from the node itself.
    pub fn request(&self, proto: &str, addr: &str, count: usize) -> Vec<String> {
        request(&self.ns, proto, addr, count)
    }
}

/// `count` requests (netprobe `request`) from a namespace.
pub fn request(ns: &Netns, proto: &str, addr: &str, count: usize) -> Vec<String> {
    let out = ns.run(&[netprobe_bin().to_str().unwrap(), "request", proto, addr, &count.to_string()]);
    match out {
        Ok(out) => out.lines().map(str::to_string).collect(),
        Err(e) => vec![format!("ERR {e}")],
    }
}

/// A NetworkPolicy `name` isolating the ingress of the pod labelled `pod=<pod>`, admitting only
/// the pod labelled `pod=<from>` (`None`: nothing, default deny).
pub fn ingress_policy(name: &str, pod: &str, from: Option<&str>) -> Value {
    let mut spec = json!({"podSelector": {"matchLabels": {"pod": pod}}, "policyTypes": ["Ingress"]});
    if let Some(from) = from {
        spec["ingress"] = json!([{"from": [{"podSelector": {"matchLabels": {"pod": from}}}]}]);
    }
    json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"namespace": "default", "name": name},
        "spec": spec
    })
}

/// Waits until a new TCP connection from `ns` to `target` fails (a policy denying it is
/// programmed); an error after 20 s.
pub fn wait_denied(ns: &Netns, target: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while netprobe(ns, &["timed", "tcp", target]).starts_with("OK") {
        if Instant::now() > deadline {
            bail!("the policy never took effect: {target} still connects");
        }
        thread::sleep(Duration::from_millis(200));
    }
    Ok(())
}

/// One netprobe command in a namespace, its output trimmed.
pub fn netprobe(ns: &Netns, args: &[&str]) -> String {
    let mut full = vec![netprobe_bin().to_str().unwrap().to_string()];
    full.extend(args.iter().map(|a| a.to_string()));
    let refs: Vec<&str> = full.iter().map(String::as_str).collect();
    ns.run(&refs).map(|o| o.trim().to_string()).unwrap_or_else(|e| format!("ERR {e}"))
}

/// Some replies came, all from `backend` (each reply names the pod that answered).
pub fn assert_all_from(replies: &[String], backend: &str) {
    assert!(
        !replies.is_empty() && replies.iter().all(|r| r == backend),
        "expected every reply from {backend}: {replies:?}"
    );
}

/// Polls `done` for up to 15 s (the agent samples its counters and metrics every second).
pub fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        thread::sleep(Duration::from_millis(100));
    }
}

/// The growth of counter `name` between two [`ClusterNode::stats`] readings (a counter a
/// reading lacks counts as 0).
pub fn stats_growth(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>, name: &str) -> u64 {
    after.get(name).copied().unwrap_or(0) - before.get(name).copied().unwrap_or(0)
}

/// A Service the harness publishes (with its EndpointSlice from the selected ready pods).
#[derive(Clone, Debug)]
pub struct Svc {
    pub name: String,
    pub kind: &'static str,
    pub cluster_ip: String,
    /// A dual-stack Service's IPv6 ClusterIP (`ipFamilyPolicy: RequireDualStack`).
    pub cluster_ip6: Option<String>,
    pub selector: BTreeMap<String, String>,
    /// (name, protocol, port, target port, node port)
    pub ports: Vec<(String, &'static str, u16, u16, Option<u16>)>,
    pub external_traffic_local: bool,
    pub external_ips: Vec<String>,
    pub load_balancer_ips: Vec<String>,
    pub annotations: BTreeMap<String, String>,
    pub health_check_node_port: Option<u16>,
    pub session_affinity: bool,
    pub source_ranges: Vec<String>,
}

impl Svc {
    /// A ClusterIP Service `name` at `cluster_ip` (TCP 80 -> 8080 "http", UDP 53 -> 5353 "dns")
    /// selecting pods labelled `app=<name>`.
    pub fn cluster_ip(name: &str, cluster_ip: &str) -> Self {
        Svc {
            name: name.to_string(),
            kind: "ClusterIP",
            cluster_ip: cluster_ip.to_string(),
            cluster_ip6: None,
            selector: [("app".to_string(), name.to_string())].into(),
            ports: vec![("http".into(), "TCP", 80, 8080, None), ("dns".into(), "UDP", 53, 5353, None)],
            external_traffic_local: false,
            external_ips: vec![],
            load_balancer_ips: vec![],
            annotations: BTreeMap::new(),
            health_check_node_port: None,
            session_affinity: false,
            source_ranges: vec![],
        }
    }

    /// The same, as a NodePort Service (TCP `node_port`, UDP `node_port + 1`).
    pub fn node_port(name: &str, cluster_ip: &str, node_port: u16) -> Self {
        let mut svc = Self::cluster_ip(name, cluster_ip);
        svc.kind = "NodePort";
        svc.ports[0].4 = Some(node_port);
        svc.ports[1].4 = Some(node_port + 1);
        svc
    }

    /// The same, as a LoadBalancer Service with ingress IP `lb_ip`.
    pub fn load_balancer(name: &str, cluster_ip: &str, node_port: u16, lb_ip: &str) -> Self {
        let mut svc = Self::node_port(name, cluster_ip, node_port);
        svc.kind = "LoadBalancer";
        svc.load_balancer_ips = vec![lb_ip.to_string()];
        svc
    }

    /// Dual-stack, with `cluster_ip6` as the IPv6 ClusterIP; its pods' IPv6 addresses get an
    /// EndpointSlice of their own, as the EndpointSlice controller publishes one per family.
    pub fn dual_stack(mut self, cluster_ip6: &str) -> Self {
        self.cluster_ip6 = Some(cluster_ip6.to_string());
        self
    }
    /// One more LoadBalancer ingress IP (of either family).
    pub fn load_balancer_ip(mut self, ip: &str) -> Self {
        self.load_balancer_ips.push(ip.to_string());
        self
    }
    pub fn select(mut self, key: &str, value: &str) -> Self {
        self.selector = [(key.to_string(), value.to_string())].into();
        self
    }
    pub fn local(mut self) -> Self {
        self.external_traffic_local = true;
        self
    }
    pub fn external_ip(mut self, ip: &str) -> Self {
        self.external_ips.push(ip.to_string());
        self
    }
    pub fn annotate(mut self, key: &str, value: &str) -> Self {
        self.annotations.insert(key.to_string(), value.to_string());
        self
    }
    pub fn health_check_node_port(mut self, port: u16) -> Self {
        self.health_check_node_port = Some(port);
        self
    }
    /// `spec.loadBalancerSourceRanges`.
    pub fn source_range(mut self, cidr: &str) -> Self {
        self.source_ranges.push(cidr.to_string());
        self
    }

    fn object(&self) -> Value {
        let ports: Vec<Value> = self
            .ports
            .iter()
            .map(|(name, protocol, port, target, node_port)| {
                let mut p = json!({"name": name, "protocol": protocol, "port": port, "targetPort": target});
                if let Some(n) = node_port {
                    p["nodePort"] = json!(n);
                }
                p
            })
            .collect();
        let mut spec = json!({
            "type": self.kind,
            "clusterIP": self.cluster_ip,
            "clusterIPs": [self.cluster_ip],
            "ports": ports,
            "selector": self.selector,
            "sessionAffinity": if self.session_affinity { "ClientIP" } else { "None" },
        });
        if let Some(ip6) = &self.cluster_ip6 {
            spec["clusterIPs"] = json!([self.cluster_ip, ip6]);
            spec["ipFamilies"] = json!(["IPv4", "IPv6"]);
            spec["ipFamilyPolicy"] = json!("RequireDualStack");
        }
        if self.kind != "ClusterIP" {
            spec["externalTrafficPolicy"] = json!(if self.external_traffic_local { "Local" } else { "Cluster" });
        }
        if !self.external_ips.is_empty() {
            spec["externalIPs"] = json!(self.external_ips);
        }
        if let Some(port) = self.health_check_node_port {
            spec["healthCheckNodePort"] = json!(port);
        }
        if !self.source_ranges.is_empty() {
            spec["loadBalancerSourceRanges"] = json!(self.source_ranges);
        }
        let mut object = json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"namespace": "default", "name": self.name, "annotations": self.annotations},
            "spec": spec,
        });
        if !self.load_balancer_ips.is_empty() {
            let ingress: Vec<Value> = self.load_balancer_ips.iter().map(|ip| json!({"ip": ip})).collect();
            object["status"] = json!({"loadBalancer": {"ingress": ingress}});
        }
        object
    }
}

pub struct ClusterBuilder {
    prefix: String,
    nodes: usize,
    pods_per_node: usize,
    agent_args: Vec<String>,
    tor: bool,
    socket_lb: bool,
    dual_stack: bool,
    full_checksums: bool,
    plumbing_only: bool,
    cluster_asn: u32,
}

/// The top-of-rack BGP speaker's ASN (gobgpd in the fabric, `ClusterBuilder::tor_bgp`).
pub const TOR_ASN: u32 = 64513;

impl ClusterBuilder {
    pub fn nodes(mut self, n: usize) -> Self {
        self.nodes = n;
        self
    }
    pub fn pods_per_node(mut self, n: usize) -> Self {
        self.pods_per_node = n;
        self
    }
    /// A real gobgpd in the fabric as every node's top-of-rack BGP peer (eBGP, ASN
    /// [`TOR_ASN`]); read what each node advertised with [`Cluster::tor_received`].
    pub fn tor_bgp(mut self) -> Self {
        self.tor = true;
        self
    }
    /// The socket load balancer on every node, each attached to a cgroup of the test's own
    /// (never the machine's root); run node processes with [`ClusterNode::run_as_host_process`].
    pub fn socket_lb(mut self) -> Self {
        self.socket_lb = true;
        self
    }
    /// IPv6 beside IPv4 on every link, node and pod (see the module documentation).
    pub fn dual_stack(mut self) -> Self {
        self.dual_stack = true;
        self
    }
    /// Packets from the client, the internet host and the pods carry complete checksums, as
    /// packets from a physical NIC do (their eth0's transmit checksum offload is off). Over a
    /// veth an offloaded checksum stays incomplete (CHECKSUM_PARTIAL) up to the receiver, which
    /// XDP cannot complete: the XDP fast path leaves such packets to TC.
    pub fn full_checksums(mut self) -> Self {
        self.full_checksums = true;
        self
    }
    /// Extra flags for every agent.
    pub fn agent_args(mut self, args: &[&str]) -> Self {
        self.agent_args.extend(args.iter().map(|a| a.to_string()));
        self
    }
    /// Every agent runs with `args` and the harness's plumbing alone: the node's name and where
    /// its CNI configuration goes as upstream's DaemonSets give them (`NODE_NAME`,
    /// `KUBE_ROUTER_CNI_CONF_FILE`), its `--state-dir`, `--bpf-root`, the `--metrics-port` the
    /// harness reads, and where the socket load balancer attaches (never the machine's root
    /// cgroup: off, or a test cgroup with [`Self::socket_lb`]). Not the flags the harness adds
    /// for its other tests (`--master`, BGP timers, externalIP ranges, the ToR as a peer): `args`
    /// reach the API server ([`kubeconfig_path`]) and name the peers themselves. The harness
    /// waits only for what `args` make the agents do: pod routes with an iBGP mesh, pod source
    /// addresses with a datapath; with `--enable-cni=false` it wires pods from a configuration of
    /// its own, as another CNI would, and writes no template for the agent.
    pub fn only_agent_args(mut self, args: &[&str]) -> Self {
        self.plumbing_only = true;
        self.agent_args = args.iter().map(|a| a.to_string()).collect();
        self
    }
    /// The ASN the top-of-rack peer expects the nodes in (their `--cluster-asn`; 64512 unless set).
    pub fn cluster_asn(mut self, asn: u32) -> Self {
        self.cluster_asn = asn;
        self
    }
    pub fn build(self) -> Result<Cluster> {
        Cluster::build(self)
    }
}

pub struct Cluster {
    pub prefix: String,
    pub fabric: Netns,
    pub client: Netns,
    pub internet: Netns,
    pub nodes: Vec<ClusterNode>,
    pub pods: Vec<Pod>,
    pub runtime: NetnsRuntime,
    pub server: Arc<FakeApiServer>,
    agents: Mutex<Vec<Option<Agent>>>,
    agent_args: Vec<String>,
    /// Flags of one node's agent beyond `agent_args` (see [`Cluster::restart_agent_with`]).
    node_agent_args: Mutex<Vec<Vec<String>>>,
    services: Mutex<BTreeMap<String, Svc>>,
    /// Pods marked not ready (left out of EndpointSlices).
    unready: Mutex<Vec<String>>,
    /// [`ClusterBuilder::only_agent_args`].
    plumbing_only: bool,
    pub dir: PathBuf,
}

fn link(a: &Netns, a_if: &str, b: &Netns, b_if: &str) -> Result<()> {
    a.run(&["ip", "link", "add", a_if, "type", "veth", "peer", "name", b_if, "netns", &b.path()])?;
    a.run(&["ip", "link", "set", a_if, "up"])?;
    b.run(&["ip", "link", "set", b_if, "up"])?;
    Ok(())
}

impl Cluster {
    /// `prefix` names every namespace (`<prefix>-fab`, `<prefix>-n1`, ...) and bpffs directory.
    pub fn builder(prefix: &str) -> ClusterBuilder {
        ClusterBuilder {
            prefix: prefix.to_string(),
            nodes: 2,
            pods_per_node: 1,
            agent_args: Vec::new(),
            tor: false,
            socket_lb: false,
            dual_stack: false,
            full_checksums: false,
            plumbing_only: false,
            cluster_asn: 64512,
        }
    }

    fn build(b: ClusterBuilder) -> Result<Cluster> {
        let p = &b.prefix;
        let dir = std::env::temp_dir().join(p);
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir)?;

        let dual = b.dual_stack;
        let fabric = Netns::new(&format!("{p}-fab"))?;
        fabric.sysctl("net.ipv4.ip_forward", "1")?;
        if dual {
            ipv6_without_dad(&fabric)?;
            fabric.sysctl("net.ipv6.conf.all.forwarding", "1")?;
        }
        fabric.run(&["ip", "link", "add", "fab0", "type", "bridge"])?;
        fabric.run(&["ip", "addr", "add", &format!("{FABRIC_ADDR}/24"), "dev", "fab0"])?;
        if dual {
            fabric.run(&["ip", "addr", "add", &format!("{FABRIC_ADDR6}/64"), "dev", "fab0"])?;
        }
        fabric.run(&["ip", "link", "set", "fab0", "up"])?;

        let client = Netns::new(&format!("{p}-cli"))?;
        let full_checksums = |ns: &Netns| -> Result<()> {
            if b.full_checksums {
                ns.run(&[netprobe_bin().to_str().unwrap(), "feature", "eth0", "tx-checksum", "off"])?;
            }
            Ok(())
        };
        if dual {
            ipv6_without_dad(&client)?;
        }
        link(&fabric, "cli0", &client, "eth0")?;
        fabric.run(&["ip", "addr", "add", "192.168.100.1/24", "dev", "cli0"])?;
        client.run(&["ip", "addr", "add", &format!("{CLIENT_ADDR}/24"), "dev", "eth0"])?;
        client.run(&["ip", "route", "add", "default", "via", "192.168.100.1"])?;
        full_checksums(&client)?;
        if dual {
            fabric.run(&["ip", "addr", "add", "fd00:c::1/64", "dev", "cli0"])?;
            client.run(&["ip", "addr", "add", &format!("{CLIENT_ADDR6}/64"), "dev", "eth0"])?;
            client.run(&["ip", "-6", "route", "add", "default", "via", "fd00:c::1"])?;
        }

        let internet = Netns::new(&format!("{p}-net"))?;
        if dual {
            ipv6_without_dad(&internet)?;
        }
        link(&fabric, "net0", &internet, "eth0")?;
        fabric.run(&["ip", "addr", "add", "203.0.113.1/24", "dev", "net0"])?;
        internet.run(&["ip", "addr", "add", &format!("{INTERNET_ADDR}/24"), "dev", "eth0"])?;
        internet.run(&["ip", "route", "add", "default", "via", "203.0.113.1"])?;
        full_checksums(&internet)?;
        if dual {
            fabric.run(&["ip", "addr", "add", "2001:db8:113::1/64", "dev", "net0"])?;
            internet.run(&["ip", "addr", "add", &format!("{INTERNET_ADDR6}/64"), "dev", "eth0"])?;
            internet.run(&["ip", "-6", "route", "add", "default", "via", "2001:db8:113::1"])?;
        }
        for port in POD_PORTS {
            internet.spawn(&[netprobe_bin().to_str().unwrap(), "serve", "internet", &port.to_string()])?;
        }

        let mut agent_args = b.agent_args.clone();
        if b.tor {
            let neighbors: String = (0..b.nodes)
                .map(|i| {
                    format!(
                        "\n[[neighbors]]\n  [neighbors.config]\n    neighbor-address = \"{}\"\n    peer-as = {}\n  \
                         [neighbors.timers.config]\n    connect-retry = 1\n    hold-time = 9\n    keepalive-interval = 3\n",
                        node_ip(i),
                        b.cluster_asn
                    )
                })
                .collect();
            let config = format!("[global.config]\n  as = {TOR_ASN}\n  router-id = \"{FABRIC_ADDR}\"\n{neighbors}");
            let path = dir.join("gobgpd.toml");
            fs::write(&path, config)?;
            fabric.spawn(&["gobgpd", "-f", path.to_str().unwrap(), "--disable-stdlog"])?;
        }
        if b.tor && !b.plumbing_only {
            agent_args.extend(
                ["--peer-router-ips", FABRIC_ADDR, "--peer-router-asns", &TOR_ASN.to_string()].map(String::from),
            );
        }
        let runtime = NetnsRuntime::new(&fabric)?;
        let config = FakeApiServerConfig {
            bind_address: SocketAddr::from(([10, 100, 0, 254], 0)),
            ..FakeApiServerConfig::default()
        };
        let server = Arc::new(runtime.run(async { FakeApiServer::spawn(config).await })?);
        fs::write(kubeconfig_path(p), server.kubeconfig_yaml())?;
        let agents_write_cni = !flag_off(&agent_args, "enable-cni");

        let mut nodes = Vec::new();
        let mut pods = Vec::new();
        for i in 0..b.nodes {
            let ns = Netns::new(&format!("{p}-n{}", i + 1))?;
            ns.sysctl("net.ipv4.ip_forward", "1")?;
            if dual {
                ipv6_without_dad(&ns)?;
                ns.sysctl("net.ipv6.conf.all.forwarding", "1")?;
            }
            link(&fabric, &format!("n{}", i + 1), &ns, "eth0")?;
            // Frames a native XDP program sends back out of a veth (XDP_TX) reach its peer only
            // if the peer runs NAPI, which it does with an XDP program of its own (a NIC needs
            // nothing): an XDP_PASS one, attached the legacy way and held by the interface.
            let pin = format!("/sys/fs/bpf/{p}-xdp-pass-n{}", i + 1);
            fabric.run(&[netprobe_bin().to_str().unwrap(), "xdp-pass", &pin])?;
            fabric.run(&["ip", "link", "set", "dev", &format!("n{}", i + 1), "xdpdrv", "pinned", &pin])?;
            fs::remove_file(&pin)?;
            fabric.run(&["ip", "link", "set", &format!("n{}", i + 1), "master", "fab0"])?;
            ns.run(&["ip", "addr", "add", &format!("{}/24", node_ip(i)), "dev", "eth0"])?;
            ns.run(&["ip", "route", "add", "default", "via", FABRIC_ADDR])?;
            if dual {
                ns.run(&["ip", "addr", "add", &format!("{}/64", node_ip6(i)), "dev", "eth0"])?;
                ns.run(&["ip", "-6", "route", "add", "default", "via", FABRIC_ADDR6])?;
            }
            let node_dir = dir.join(format!("n{}", i + 1));
            let node = ClusterNode {
                ns,
                name: format!("node-{}", i + 1),
                ip: node_ip(i),
                pod_cidr: pod_cidr(i),
                ip6: dual.then(|| node_ip6(i)),
                pod_cidr6: dual.then(|| pod_cidr6(i)),
                bpf_root: PathBuf::from(format!("/sys/fs/bpf/{p}-n{}", i + 1)),
                state_dir: node_dir.join("state"),
                cni_dir: node_dir.join("cni"),
                cgroup: if b.socket_lb { Some(TestCgroup::new(&format!("{p}-n{}", i + 1))?) } else { None },
            };
            remove_bpf_root(&node.bpf_root);
            fs::create_dir_all(&node.cni_dir)?;
            if agents_write_cni {
                let template = cni_template(&node_dir.join("ipam"));
                fs::write(node.cni_conf_file(), serde_json::to_vec_pretty(&template)?)?;
            }
            let mut pod_cidrs = vec![node.pod_cidr.clone()];
            let mut addresses = vec![json!({"type": "InternalIP", "address": node.ip})];
            if let (Some(ip6), Some(cidr6)) = (&node.ip6, &node.pod_cidr6) {
                pod_cidrs.push(cidr6.clone());
                addresses.push(json!({"type": "InternalIP", "address": ip6}));
            }
            addresses.push(json!({"type": "Hostname", "address": node.name}));
            server.apply(json!({
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": node.name, "labels": {"kubernetes.io/hostname": node.name}},
                "spec": {"podCIDR": node.pod_cidr, "podCIDRs": pod_cidrs},
                "status": {"addresses": addresses}
            }))?;
            nodes.push(node);
        }

        let cluster = Cluster {
            prefix: p.clone(),
            fabric,
            client,
            internet,
            nodes,
            pods: Vec::new(),
            runtime,
            server,
            agents: Mutex::new(Vec::new()),
            agent_args,
            node_agent_args: Mutex::new(vec![Vec::new(); b.nodes]),
            services: Mutex::new(BTreeMap::new()),
            unready: Mutex::new(Vec::new()),
            plumbing_only: b.plumbing_only,
            dir,
        };
        let agents = (0..cluster.nodes.len()).map(|i| cluster.start_agent(i).map(Some)).collect::<Result<Vec<_>>>()?;
        *cluster.agents.lock().unwrap() = agents;
        // Pods are wired with the configuration each agent wrote from its Node object.
        let mut cluster = cluster;
        for (i, node) in cluster.nodes.iter().enumerate() {
            let conflist = cluster.pod_conflist(i, || node.metric("kube_router_cni_config_errors_total", ""))?;
            for j in 0..b.pods_per_node {
                let pod = Self::new_pod(p, node, &conflist, i, j)?;
                full_checksums(&pod.ns)?;
                pods.push(pod);
            }
        }
        cluster.pods = pods;
        for pod in &cluster.pods {
            cluster.server.apply(cluster.pod_object(pod))?;
        }
        let nodes_peer = (0..cluster.nodes.len())
            .all(|i| !flag_off(&cluster.args_of(i), "run-router") && !flag_off(&cluster.args_of(i), "enable-ibgp"));
        if nodes_peer {
            cluster.wait_routes(Duration::from_secs(60))?;
        }
        cluster.wait_pod_sources()?;
        Ok(cluster)
    }

    /// The flags of node `i`'s agent beyond the harness's own: the cluster's, then the node's.
    fn args_of(&self, i: usize) -> Vec<String> {
        let node_args = self.node_agent_args.lock().unwrap()[i].clone();
        self.agent_args.iter().cloned().chain(node_args).collect()
    }

    /// The CNI configuration node `i`'s pods are wired with: the one its agent wrote (`errors`,
    /// its CNI error count, ends the wait early), else the harness's own.
    fn pod_conflist(&self, i: usize, errors: impl FnMut() -> f64) -> Result<Value> {
        let node = &self.nodes[i];
        if flag_off(&self.args_of(i), "enable-cni") {
            return Ok(operator_conflist(node, &self.dir.join(format!("n{}", i + 1)).join("ipam")));
        }
        wait_conflist_or_errors(&node.cni_conf_file(), errors)
    }

    /// Every agent knows the addresses of its pods (else their traffic is dropped as spoofed
    /// until it does: the source check fails closed).
    pub fn wait_pod_sources(&self) -> Result<()> {
        let checking: Vec<bool> = (0..self.nodes.len())
            .map(|i| {
                let args = self.args_of(i);
                let datapath = !flag_off(&args, "run-service-proxy") || !flag_off(&args, "run-firewall");
                datapath && !flag_off(&args, "enable-pod-source-check")
            })
            .collect();
        crate::wait_until("every pod veth's source addresses known", Duration::from_secs(20), || {
            Ok(self.nodes.iter().enumerate().all(|(i, n)| {
                let disabled = !checking[i];
                let pods = self.pods.iter().filter(|p| p.node == i).count() as f64;
                let metrics = n.metrics();
                let gauge = |state: &str| {
                    let series = format!("kube_router_pod_source_veths{{state=\"{state}\"}} ");
                    metrics.lines().find_map(|l| l.strip_prefix(&series)?.parse::<f64>().ok())
                };
                disabled || (gauge("checked").is_some_and(|n| n >= pods) && gauge("unassigned") == Some(0.0))
            }))
        })
    }

    /// A pod wired on node `i` now (the agent running), published, its addresses known to the
    /// agent: the next `pod(i, _)`.
    pub fn add_pod(&mut self, i: usize) -> Result<&Pod> {
        let j = self.pods.iter().filter(|p| p.node == i).count();
        let node = &self.nodes[i];
        let conflist = self.pod_conflist(i, || 0.0)?;
        let pod = Self::new_pod(&self.prefix, node, &conflist, i, j)?;
        self.server.apply(self.pod_object(&pod))?;
        self.pods.push(pod);
        self.wait_pod_sources()?;
        Ok(self.pods.last().expect("just added"))
    }

    fn new_pod(prefix: &str, node: &ClusterNode, conflist: &Value, i: usize, j: usize) -> Result<Pod> {
        let name = format!("pod-{}-{j}", i + 1);
        let ns = Netns::new(&format!("{prefix}-n{}-p{j}", i + 1))?;
        if node.ip6.is_some() {
            ipv6_without_dad(&ns)?;
        }
        let result = cni_add(&node.ns, conflist, &ns, &name)?;
        let ip =
            result_address(&result, false).with_context(|| format!("CNI gave {name} no IPv4 address: {result}"))?;
        let ip6 = match node.ip6 {
            Some(_) => Some(
                result_address(&result, true).with_context(|| format!("CNI gave {name} no IPv6 address: {result}"))?,
            ),
            None => None,
        };
        for port in POD_PORTS {
            ns.spawn(&[netprobe_bin().to_str().unwrap(), "serve", &name, &port.to_string()])?;
        }
        let labels = [
            ("app".to_string(), "web".to_string()),
            ("pod".to_string(), name.clone()),
            ("node".to_string(), node.name.clone()),
        ]
        .into();
        Ok(Pod { ns, name, node: i, ip, ip6, labels })
    }

    fn pod_object(&self, pod: &Pod) -> Value {
        let ready = !self.unready.lock().unwrap().contains(&pod.name);
        let pod_ips: Vec<Value> =
            [Some(&pod.ip), pod.ip6.as_ref()].into_iter().flatten().map(|ip| json!({"ip": ip})).collect();
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"namespace": "default", "name": pod.name, "labels": pod.labels},
            "spec": {"nodeName": self.nodes[pod.node].name, "containers": [{"name": "netprobe", "image": "krt-netprobe"}]},
            "status": {
                "phase": "Running",
                "podIP": pod.ip,
                "podIPs": pod_ips,
                "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]
            }
        })
    }

    fn start_agent(&self, i: usize) -> Result<Agent> {
        let node = &self.nodes[i];
        let state = node.state_dir.display().to_string();
        let cni_conf = node.cni_conf_file().display().to_string();
        if self.plumbing_only {
            let mut args: Vec<&str> = vec!["--state-dir", &state, "--metrics-port", METRICS_PORT];
            let cgroup = node.cgroup.as_ref().map(|c| c.path.display().to_string());
            if let Some(cgroup) = &cgroup {
                args.extend(["--cgroup-root", cgroup]);
            }
            let given = self.args_of(i);
            args.extend(given.iter().map(String::as_str));
            let env = [("NODE_NAME", node.name.as_str()), ("KUBE_ROUTER_CNI_CONF_FILE", cni_conf.as_str())];
            return Agent::start_with_env(&node.ns, &node.bpf_root, &args, &env);
        }
        let master = self.server.url();
        let mut args: Vec<&str> = vec![
            "--master",
            &master,
            "--hostname-override",
            &node.name,
            "--state-dir",
            &state,
            "--health-port",
            HEALTH_PORT,
            "--metrics-port",
            METRICS_PORT,
            "--bgp-holdtime",
            "9s",
            "--bgp-graceful-restart-deferral-time",
            "30s",
            "--cni-conf-file",
            &cni_conf,
            // The externalIPs and LoadBalancer IPs tests use, allowed as an operator would
            // (strict validation refuses every one of them without a range).
            "--service-external-ip-range",
            EXTERNAL_IP_RANGES,
            "--loadbalancer-ip-range",
            LOAD_BALANCER_IP_RANGES,
        ];
        let cgroup = node.cgroup.as_ref().map(|c| c.path.display().to_string());
        if let Some(cgroup) = &cgroup {
            args.extend(["--bpf-lb-sock=true", "--cgroup-root", cgroup]);
        }
        args.extend(self.agent_args.iter().map(String::as_str));
        let node_args = self.node_agent_args.lock().unwrap()[i].clone();
        args.extend(node_args.iter().map(String::as_str));
        Agent::start(&node.ns, &node.bpf_root, &args)
    }

    /// Kills node `i`'s agent and starts it again with `args` beyond the cluster's (in place of
    /// those of an earlier call): a restart with other flags.
    pub fn restart_agent_with(&self, i: usize, args: &[&str]) -> Result<()> {
        self.node_agent_args.lock().unwrap()[i] = args.iter().map(|a| a.to_string()).collect();
        self.restart_agent(i)
    }

    /// Kills node `i`'s agent and leaves it stopped; [`Cluster::restart_agent`] (or
    /// [`Cluster::restart_agent_with`]) starts it again.
    pub fn stop_agent(&self, i: usize) {
        if let Some(agent) = self.agents.lock().unwrap()[i].take() {
            agent.kill();
        }
    }

    /// Kills node `i`'s agent (a crash) and starts it again.
    pub fn restart_agent(&self, i: usize) -> Result<()> {
        if let Some(agent) = self.agents.lock().unwrap()[i].take() {
            agent.kill();
        }
        let agent = self.start_agent(i)?;
        self.agents.lock().unwrap()[i] = Some(agent);
        Ok(())
    }

    /// Wires a new pod `pod-<i+1>-<j>` on node `i` of the running cluster and publishes it:
    /// a pod created while the agents run, without waiting for the agent to know it (`add_pod`
    /// waits). The caller owns it (its namespace goes with it).
    pub fn spawn_pod(&self, i: usize, j: usize) -> Result<Pod> {
        let node = &self.nodes[i];
        let conflist = self.pod_conflist(i, || 0.0)?;
        let pod = Self::new_pod(&self.prefix, node, &conflist, i, j)?;
        self.server.apply(self.pod_object(&pod))?;
        Ok(pod)
    }

    /// The process id of node `i`'s agent.
    pub fn agent_pid(&self, i: usize) -> Option<u32> {
        self.agents.lock().unwrap()[i].as_ref().map(Agent::pid)
    }

    /// Every agent is still running.
    pub fn agents_running(&self) -> bool {
        self.agents.lock().unwrap().iter_mut().all(|a| a.as_mut().is_some_and(Agent::is_running))
    }

    pub fn node(&self, i: usize) -> &ClusterNode {
        &self.nodes[i]
    }

    /// The `j`th pod of node `i`.
    pub fn pod(&self, i: usize, j: usize) -> &Pod {
        self.pods.iter().filter(|p| p.node == i).nth(j).expect("no such pod")
    }

    /// Every node routes every other node's pod CIDR via that node (our BGP).
    pub fn wait_routes(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let converged = self.nodes.iter().enumerate().all(|(i, node)| {
                let routes = node.bgp_routes();
                self.nodes.iter().enumerate().filter(|(j, _)| *j != i).all(|(_, other)| {
                    let v6 = match (&other.pod_cidr6, &other.ip6) {
                        (Some(cidr), Some(ip)) => routes.contains(&format!("{cidr} via {ip}")),
                        _ => true,
                    };
                    v6 && routes.contains(&format!("{} via {}", other.pod_cidr, other.ip))
                })
            });
            if converged {
                return Ok(());
            }
            if Instant::now() > deadline {
                let detail: Vec<String> =
                    self.nodes.iter().map(|n| format!("{}:\n{}", n.name, n.bgp_routes())).collect();
                bail!("pod routes not converged within {timeout:?}:\n{}", detail.join("\n"));
            }
            thread::sleep(Duration::from_millis(200));
        }
    }

    /// Publishes (or updates) a Service and its EndpointSlice, then waits until every node has
    /// programmed its frontends.
    pub fn add_service(&self, svc: Svc) -> Result<()> {
        self.publish_service(&svc)?;
        self.wait_programmed(&format!("{}:{}", svc.cluster_ip, svc.ports[0].2), true)
    }

    /// Publishes (or updates) a Service and its EndpointSlice, without waiting for any node.
    pub fn publish_service(&self, svc: &Svc) -> Result<()> {
        self.server.apply(svc.object())?;
        self.services.lock().unwrap().insert(svc.name.clone(), svc.clone());
        self.publish_endpoints(svc)
    }

    fn publish_endpoints(&self, svc: &Svc) -> Result<()> {
        self.publish_slice(svc, false)?;
        if svc.cluster_ip6.is_some() {
            self.publish_slice(svc, true)?;
        }
        Ok(())
    }

    /// The Service's EndpointSlice of one address type, from the selected pods.
    fn publish_slice(&self, svc: &Svc, ipv6: bool) -> Result<()> {
        let unready = self.unready.lock().unwrap().clone();
        let endpoints: Vec<Value> = self
            .pods
            .iter()
            .filter(|pod| svc.selector.iter().all(|(k, v)| pod.labels.get(k) == Some(v)))
            .filter_map(|pod| {
                let ready = !unready.contains(&pod.name);
                let address = if ipv6 { pod.ip6.as_ref()? } else { &pod.ip };
                Some(json!({
                    "addresses": [address],
                    "nodeName": self.nodes[pod.node].name,
                    "targetRef": {"kind": "Pod", "namespace": "default", "name": pod.name},
                    "conditions": {"ready": ready, "serving": ready, "terminating": false}
                }))
            })
            .collect();
        let ports: Vec<Value> = svc
            .ports
            .iter()
            .map(|(name, protocol, _, target, _)| json!({"name": name, "protocol": protocol, "port": target}))
            .collect();
        let (suffix, address_type) = if ipv6 { ("v6", "IPv6") } else { ("1", "IPv4") };
        self.server.apply(json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"namespace": "default", "name": format!("{}-{suffix}", svc.name),
                         "labels": {"kubernetes.io/service-name": svc.name}},
            "addressType": address_type,
            "ports": ports,
            "endpoints": endpoints,
        }))?;
        Ok(())
    }

    /// Marks a pod ready or not and republishes the EndpointSlices that select it.
    pub fn set_ready(&self, pod_name: &str, ready: bool) -> Result<()> {
        {
            let mut unready = self.unready.lock().unwrap();
            unready.retain(|p| p != pod_name);
            if !ready {
                unready.push(pod_name.to_string());
            }
        }
        let pod = self.pods.iter().find(|p| p.name == pod_name).context("no such pod")?;
        self.server.apply(self.pod_object(pod))?;
        let services: Vec<Svc> = self.services.lock().unwrap().values().cloned().collect();
        for svc in services.iter().filter(|s| s.selector.iter().all(|(k, v)| pod.labels.get(k) == Some(v))) {
            self.publish_endpoints(svc)?;
        }
        Ok(())
    }

    /// Waits until every node's maps hold (or no longer hold) the frontend `addr:port`.
    pub fn wait_programmed(&self, frontend: &str, present: bool) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if self.nodes.iter().all(|n| n.services().contains(&format!(" {frontend} ")) == present) {
                return Ok(());
            }
            if Instant::now() > deadline {
                let detail: Vec<String> = self.nodes.iter().map(|n| format!("{}:\n{}", n.name, n.services())).collect();
                bail!("frontend {frontend} present={present} not reached on every node:\n{}", detail.join("\n"));
            }
            thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits until every node's maps show `frontend` with exactly `backends` backends.
    pub fn wait_backends(&self, frontend: &str, backends: usize) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        // `kube-router services -o json`: the frontend's distinct backends.
        let count = |node: &ClusterNode| {
            let listing = node.services_json()?;
            let found = listing["frontends"].as_array()?.iter().find(|f| f["address"] == frontend)?;
            found["backends"].as_array().map(Vec::len)
        };
        loop {
            if self.nodes.iter().all(|n| count(n) == Some(backends)) {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("{frontend} does not have {backends} backends on every node");
            }
            thread::sleep(Duration::from_millis(100));
        }
    }

    /// The IPv4 prefixes the top-of-rack peer received from node `i` (gobgp adj-in).
    pub fn tor_received(&self, i: usize) -> String {
        let out = self.fabric.run(&["gobgp", "neighbor", &self.nodes[i].ip, "adj-in", "-a", "ipv4"]);
        out.unwrap_or_default()
    }

    /// The fabric routes `addr` (an ExternalIP or LoadBalancer IP, of either family) to node `i`.
    pub fn route_via(&self, addr: &str, i: usize) -> Result<()> {
        let node = &self.nodes[i];
        if addr.contains(':') {
            let via = node.ip6.as_deref().context("an IPv6 route needs a dual-stack cluster")?;
            self.fabric.run(&["ip", "-6", "route", "replace", &format!("{addr}/128"), "via", via])?;
        } else {
            self.fabric.run(&["ip", "route", "replace", &format!("{addr}/32"), "via", &node.ip])?;
        }
        Ok(())
    }

    pub fn set_api(&self, mode: FaultMode) {
        let server = self.server.clone();
        self.runtime.run(async move { server.set_mode(mode).await.expect("fault mode") });
    }

    /// The maps each agent writes (not conntrack or counters), as bpftool dumps.
    pub fn agent_maps(&self) -> Vec<BTreeMap<String, String>> {
        const WRITTEN: [&str; 9] = [
            "svc_v4",
            "svc_slots_v4",
            "backends_v4",
            "svc_v6",
            "svc_slots_v6",
            "backends_v6",
            "lb_config",
            "cluster_nets_v4",
            "lb_src_v4",
        ];
        self.nodes
            .iter()
            .map(|n| {
                let dumps = dump_maps(&n.bpf_root).unwrap_or_default();
                dumps
                    .into_iter()
                    .filter(|(name, _)| {
                        WRITTEN.contains(&name.as_str())
                            || (name.starts_with("pol_") && !name.starts_with("pol_ct") && name != "pol_stats")
                    })
                    .collect()
            })
            .collect()
    }

    /// Every node's kernel routing table (all tables).
    pub fn routes(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.ns.run(&["ip", "route", "show", "table", "all"]).unwrap_or_default()).collect()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for agent in self.agents.lock().unwrap().iter_mut().filter_map(Option::take) {
            agent.kill();
        }
        for node in &self.nodes {
            remove_bpf_root(&node.bpf_root);
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}
