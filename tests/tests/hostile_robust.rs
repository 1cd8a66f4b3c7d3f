//! The agent's own robustness against a hostile pod (docs/security/robust.md): a pod floods the
//! node's health and metrics ports with thousands of idle connections; the kubelet's probe is
//! still answered at once, the agent keeps running and still attaches and polices new pods, and
//! the metrics (every Service, VIP, BGP peer and route) are not served to pods at all.
//!
//! The agents start with the soft open-files limit of 1,024 a Rust binary gets by default (the
//! test lowers its own before starting them); the flooding pod raises its own to the hard limit.
//! As root, in network namespaces `krt-hr*`.

use std::time::{Duration, Instant};

use kube_router_tests::cluster::{ingress_policy, netprobe, wait_denied, wait_for, Cluster};

const HEALTH_PORT: u16 = 20244;
const METRICS_PORT: u16 = 20241;
const FLOOD: &str = "2000";

/// The agents inherit this process's soft limit: the 1,024 of a default container runtime.
fn lower_soft_fd_limit_to_1024() {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit with a valid pointer to an rlimit we own; lowering is allowed.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit);
        limit.rlim_cur = limit.rlim_cur.min(1024);
        libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
    }
}

/// `netprobe http` from `ns`: (status, body, how long it took).
fn http(ns: &kube_router_tests::Netns, addr: &str, path: &str) -> (String, String, Duration) {
    let started = Instant::now();
    let out = netprobe(ns, &["http", addr, path]);
    let (status, body) = out.split_once('\n').unwrap_or((&out, ""));
    (status.to_string(), body.to_string(), started.elapsed())
}

/// Starts a flood of `FLOOD` idle connections from `pod` to `target` and waits until its first
/// round of connection attempts is done (under a second), 20 s at most: a server that stopped
/// accepting makes each attempt wait, and then the assertions that follow say what broke.
fn flood(pod: &kube_router_tests::Netns, target: &str) -> std::sync::Arc<std::sync::Mutex<Vec<String>>> {
    let bin = kube_router_tests::netprobe_bin();
    let lines = pod.spawn_collecting(&[bin.to_str().unwrap(), "flood", target, FLOOD]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while lines.lock().unwrap().is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    lines
}

/// Guards: the health server's per-peer and total connection limits with the node's own pool
/// (`http::Pools`), its request deadline, and the raised open-files limit. A pod holding 2,000
/// connections to the probe port: the kubelet's probe (from the node's address) is answered
/// within a second every time, the excess is refused and counted, the agent does not restart,
/// and a pod created during the flood gets its veth attached and a policy isolating it enforced.
#[test]
fn a_pod_flooding_the_probe_port_blinds_neither_the_kubelet_nor_the_policy() {
    lower_soft_fd_limit_to_1024();
    let c = Cluster::builder("krt-hr-fl").build().unwrap();
    let node = c.node(0);
    let pid = c.agent_pid(0);
    let probe_target = format!("{}:{HEALTH_PORT}", node.ip);
    let lines = flood(&c.pod(0, 0).ns, &probe_target);

    let mut slowest = Duration::ZERO;
    for _ in 0..10 {
        let (status, body, took) = http(&node.ns, &probe_target, "/healthz");
        assert_eq!(status, "200", "the kubelet's probe during the flood: {body}");
        assert!(took < Duration::from_secs(1), "the probe took {took:?}");
        slowest = slowest.max(took);
    }
    let refused = node.metric("kube_router_http_connections_rejected_total", "reason=\"peer_limit\"");
    assert!(refused > 1000.0, "the flood's excess connections are refused and counted: {refused}");
    let agent_fds = pid.and_then(|pid| std::fs::read_dir(format!("/proc/{pid}/fd")).ok()).map(Iterator::count);
    eprintln!("during the flood: slowest probe {slowest:?}, {refused} refused, agent fds {agent_fds:?}");

    // A pod created during the flood: attached (reachable), then isolated by a policy.
    let new_pod = c.spawn_pod(0, 1).unwrap();
    let target = format!("{}:8080", new_pod.ip);
    let client = &c.pod(1, 0).ns;
    wait_for("the new pod to answer", || netprobe(client, &["ask", "tcp", &target, "who"]).starts_with("pod-1-1 "));
    c.server.apply(ingress_policy("isolate-pod-1-1", "pod-1-1", None)).unwrap();
    wait_denied(client, &target).unwrap();

    assert!(c.agents_running(), "the agent survived the flood");
    assert_eq!(c.agent_pid(0), pid, "the same agent process");
    let last = lines.lock().unwrap().last().cloned().unwrap_or_default();
    assert!(last.starts_with("open "), "the flood ran throughout: {last}");
}

/// Guard: the metrics listener is on 127.0.0.1 by default and the health port serves health
/// only. From a pod, the metrics port refuses every connection (a 2,000-connection flood
/// included) and the health port has no /metrics nor /bgp; the node itself reads them.
#[test]
fn metrics_and_bgp_are_not_served_to_pods() {
    let c = Cluster::builder("krt-hr-mt").build().unwrap();
    let node = c.node(0);
    let pod = &c.pod(0, 0).ns;
    let lines = flood(pod, &format!("{}:{METRICS_PORT}", node.ip));
    let last = lines.lock().unwrap().last().cloned().unwrap_or_default();
    assert!(last.starts_with("open 0 "), "no connection to the metrics port from a pod: {last}");

    let (status, _, _) = http(pod, &format!("{}:{METRICS_PORT}", node.ip), "/metrics");
    assert!(status.starts_with("ERR connect"), "metrics port from a pod: {status}");
    for path in ["/metrics", "/bgp"] {
        let (status, _, _) = http(pod, &format!("{}:{HEALTH_PORT}", node.ip), path);
        assert_eq!(status, "404", "{path} on the health port");
    }
    // The pod still gets health answers (the kubelet's path), and the node its metrics.
    let (status, body, _) = http(pod, &format!("{}:{HEALTH_PORT}", node.ip), "/readyz");
    assert_eq!(status, "200", "{body}");
    assert!(node.metrics().contains("kube_router_http_connections_rejected_total"));
}
