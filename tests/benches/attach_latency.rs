//! Benchmark (root): how long a new pod veth runs without its programs. A node namespace runs
//! the agent; 50 "pods" are created one after the other, each a veth pair with the far end moved
//! into its own namespace (as the CNI bridge plugin does). Latency: from the moment the pair
//! exists (`ip link add` returned) to the pinned link of the policy program on the host end
//! (polled every 200 µs). Measured with
//! netlink link notifications (the default) and, as the baseline in the same run, with only the
//! 5 s rescan (`--link-events=false`, the agent's behaviour before notifications), and with pod
//! veths attached through TCX (`--tc-mode tcx`) instead of classic tc (the default for pods).
use std::{
    path::Path,
    thread,
    time::{Duration, Instant},
};

use kube_router_tests::{remove_bpf_root, Agent, Netns, ServiceFile};

const PODS: usize = 50;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn measure(node: &Netns, root: &Path, link_events: bool, tc_mode: &str) -> Vec<Duration> {
    remove_bpf_root(root);
    let file = ServiceFile::new("krt-attach");
    file.write("").unwrap();
    let events = if link_events { "true" } else { "false" };
    let args = ["--service-file", &file.arg(), "--health-port", "0", "--link-events", events, "--tc-mode", tc_mode];
    let mut agent = Agent::start(node, root, &args).unwrap();
    agent.wait_for_log("agent running", 1, Duration::from_secs(20)).unwrap();
    let mut latencies = Vec::new();
    for i in 0..PODS {
        let pod = Netns::new(&format!("krt-attach-p{i}")).unwrap();
        let host_end = format!("vpod{i}");
        node.run(&["ip", "link", "add", &host_end, "type", "veth", "peer", "name", "eth0", "netns", &pod.path()])
            .unwrap();
        // From the moment the pair exists (not counting the `ip` process's own start-up).
        let started = Instant::now();
        node.run(&["ip", "link", "set", &host_end, "up"]).unwrap();
        let pinned = root.join("links").join(format!("pol_egress_{host_end}"));
        while !pinned.exists() {
            assert!(started.elapsed() < Duration::from_secs(30), "{host_end} never attached");
            thread::sleep(Duration::from_micros(200));
        }
        latencies.push(started.elapsed());
        node.run(&["ip", "link", "del", &host_end]).unwrap();
        drop(pod);
    }
    agent.stop().unwrap();
    remove_bpf_root(root);
    latencies.sort();
    latencies
}

fn main() {
    let node = Netns::new("krt-attach-node").unwrap();
    let root = Path::new("/sys/fs/bpf/krt-attach");
    println!("attach latency of a new pod veth (exists -> policy link pinned), {PODS} pods:");
    let with_events = measure(&node, root, true, "auto");
    let tcx_pods = measure(&node, root, true, "tcx");
    let rescan_only = measure(&node, root, false, "auto");
    for (name, latencies) in [
        ("link events (pods: classic tc)", &with_events),
        ("link events, pods on TCX", &tcx_pods),
        ("5 s rescan only (baseline)", &rescan_only),
    ] {
        println!(
            "  {name:<32} p50 {:>9.2?}  p99 {:>9.2?}  max {:>9.2?}",
            percentile(latencies, 0.5),
            percentile(latencies, 0.99),
            latencies.last().unwrap()
        );
    }
    let ratio = percentile(&rescan_only, 0.5).as_secs_f64() / percentile(&with_events, 0.5).as_secs_f64();
    println!("  p50 baseline / events: {ratio:.0}x");
}
