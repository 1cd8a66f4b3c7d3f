//! Benchmark (root): new TCP connections, one after another, through a NodePort to a backend on
//! the other node (source-NATed, TC only: `--xdp off`), with a small SNAT port range, for longer
//! than the closing lifetime of a conntrack entry (10 s). Closed flows keep their ports until
//! something frees them. Two phases, same cluster: the agent's conntrack GC not running (an
//! hour apart: the GC lagging behind the churn, as a 30 s GC does behind thousands of new
//! connections a second on the default range), against the GC every second (the baseline: ports
//! freed as soon as flows expire). The datapath taking over expired flows' ports itself keeps
//! the first phase level with the second; without it, the first stalls once the range is used.
use std::time::{Duration, Instant};

use kube_router_tests::{
    cluster::{request, Cluster, Svc},
    netprobe_bin,
};

const NODE_PORT: &str = "10.100.0.1:30080";
/// 1,000 ports: used up by the first second of connections.
const SNAT_PORTS: &str = "40000-40999";
const RUN: Duration = Duration::from_secs(30);
const WINDOW: Duration = Duration::from_secs(5);
const BATCH: usize = 100;

/// The client's TCP SYN retransmissions so far (a refused connection's SYN is retransmitted
/// after 1 s, and the client gives up after 2 s).
fn syn_retransmits(c: &Cluster) -> u64 {
    let netstat = c.client.run(&["cat", "/proc/net/netstat"]).unwrap();
    let lines: Vec<&str> = netstat.lines().filter(|l| l.starts_with("TcpExt:")).collect();
    let index = lines[0].split_whitespace().position(|n| n == "TCPSynRetrans").expect("TCPSynRetrans");
    lines[1].split_whitespace().nth(index).unwrap().parse().unwrap()
}

/// Restarts node-1's agent with `gc_secs` between conntrack collections and waits until it
/// has synced.
fn restart_with_gc(c: &Cluster, gc_secs: &str) {
    c.restart_agent_with(0, &["--conntrack-gc-interval", gc_secs]).unwrap();
    wait_for(c, "kube_router_sync_duration_seconds_count", |n| n >= 1.0);
}

fn wait_for(c: &Cluster, metric: &str, done: impl Fn(f64) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done(c.node(0).metric(metric, "")) {
        assert!(Instant::now() < deadline, "{metric} never got there");
        std::thread::sleep(Duration::from_millis(200));
    }
}

struct Phase {
    opened: usize,
    failed: usize,
    per_second: f64,
    /// (opened, failed) per WINDOW.
    windows: Vec<(usize, usize)>,
    exhausted: u64,
    syn_retransmits: u64,
}

fn churn(c: &Cluster) -> Phase {
    let before = c.node(0).stats();
    let retransmits_before = syn_retransmits(c);
    let started = Instant::now();
    let mut windows = vec![(0usize, 0usize)];
    while started.elapsed() < RUN {
        let replies = request(&c.client, "tcp", NODE_PORT, BATCH);
        let window = (started.elapsed().as_secs_f64() / WINDOW.as_secs_f64()) as usize;
        windows.resize(window + 1, (0, 0));
        let opened = replies.iter().filter(|r| *r == "pod-2-0").count();
        windows[window].0 += opened;
        windows[window].1 += replies.len() - opened;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let after = c.node(0).stats();
    let (opened, failed) = windows.iter().fold((0, 0), |(o, f), w| (o + w.0, f + w.1));
    Phase {
        opened,
        failed,
        per_second: opened as f64 / elapsed,
        windows,
        exhausted: after["snat_ports_exhausted"] - before["snat_ports_exhausted"],
        syn_retransmits: syn_retransmits(c) - retransmits_before,
    }
}

fn main() {
    assert!(netprobe_bin().exists(), "build the test binaries first");
    let c = Cluster::builder("krt-perf-churn")
        .agent_args(&["--snat-port-range", SNAT_PORTS, "--xdp", "off"])
        .build()
        .unwrap();
    c.add_service(Svc::node_port("web", "10.96.1.20", 30080).select("pod", "pod-2-0")).unwrap();
    // GC lagging first: what it leaves is then collected by the every-second GC before the
    // baseline runs (the other order would hand the first phase the baseline's closed flows).
    restart_with_gc(&c, "3600");
    let lagging = churn(&c);
    restart_with_gc(&c, "1");
    wait_for(&c, "kube_router_conntrack_entries", |n| n == 0.0);
    let collected = churn(&c);
    println!(
        "== new TCP connections for {RUN:?} through a NodePort to the other node, TC only, SNAT ports {SNAT_PORTS}"
    );
    println!(
        "{:<28} {:>10} {:>8} {:>11} {:>9}  per {WINDOW:?} (opened/failed)",
        "conntrack GC", "opened/s", "failed", "exhausted", "SYN rtx"
    );
    for (name, p) in [("every hour (lagging)", &lagging), ("every second (baseline)", &collected)] {
        let timeline: Vec<String> = p.windows.iter().map(|(o, f)| format!("{o}/{f}")).collect();
        println!(
            "{name:<28} {:>10.1} {:>8} {:>11} {:>9}  {}",
            p.per_second,
            p.failed,
            p.exhausted,
            p.syn_retransmits,
            timeline.join(" ")
        );
    }
    println!(
        "lagging / baseline: {:.2}x ({} / {} connections)",
        lagging.per_second / collected.per_second,
        lagging.opened,
        collected.opened
    );
}
