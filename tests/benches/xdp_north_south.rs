//! Benchmark (root): real north-south traffic through a NodePort to a backend on the other node,
//! with the XDP fast path, native (the harness's fabric-side peers run NAPI) and generic, against
//! TC alone (`--xdp off`), on the same cluster (`kube_router_tests::cluster`), switched by restarting
//! node-1's agent; rounds interleaved (alternating which goes first), averaged. New TCP
//! connections per second and new UDP flows per second (a fixed number of flows one after
//! another: latency-bound), one TCP upload's throughput. Packets carry complete checksums (`full_checksums`,
//! as from a NIC), so XDP serves them. Numbers from a loaded 2-core VM of veths: read the ratios.
use std::time::{Duration, Instant};

use kube_router_tests::{
    cluster::{netprobe, request, Cluster, Svc},
    netprobe_bin,
};

const NODE_PORT: &str = "10.100.0.1:30080";
const UDP_NODE_PORT: &str = "10.100.0.1:30081";
/// New flows per measurement: a fixed count, so each contender takes as many SNAT ports (they
/// stay taken for the conntrack lifetime, and a full range refuses flows).
const FLOWS: usize = 1000;
const SNAT_PORTS: &str = "33000-64999";
const UPLOAD_BYTES: u64 = 200 << 20;

#[derive(Default, Clone, Copy)]
struct Figures {
    tcp_per_s: f64,
    tcp_failed: f64,
    udp_per_s: f64,
    udp_failed: f64,
    upload_mbit_s: f64,
}

/// `FLOWS` new flows one after another (`netprobe request`: a connection or a socket each):
/// flows per second, and how many failed.
fn flows_per_second(c: &Cluster, proto: &str, addr: &str) -> (f64, f64) {
    let started = Instant::now();
    let replies = request(&c.client, proto, addr, FLOWS);
    let elapsed = started.elapsed().as_secs_f64();
    let failed = replies.iter().filter(|r| *r != "pod-2-0").count();
    assert_eq!(replies.len(), FLOWS, "{replies:?}");
    (FLOWS as f64 / elapsed, failed as f64)
}

/// The client's TCP retransmissions so far: (all segments, SYNs). A new connection whose SYN is
/// lost waits a whole second for its retransmission, which alone sinks a flows-per-second run.
fn client_retransmits(c: &Cluster) -> (u64, u64) {
    let snmp = c.client.run(&["cat", "/proc/net/snmp", "/proc/net/netstat"]).unwrap();
    (counter(&snmp, "Tcp:", "RetransSegs"), counter(&snmp, "TcpExt:", "TCPSynRetrans"))
}

/// A counter from /proc/net/snmp-style text: a header line of names, then a line of values.
fn counter(text: &str, section: &str, name: &str) -> u64 {
    let lines: Vec<&str> = text.lines().filter(|l| l.starts_with(section)).collect();
    let index = lines[0].split_whitespace().position(|n| n == name).unwrap_or_else(|| panic!("no {name}"));
    lines[1].split_whitespace().nth(index).unwrap().parse().unwrap()
}

fn measure(c: &Cluster) -> Figures {
    let started = Instant::now();
    let reply = netprobe(&c.client, &["bulk", NODE_PORT, &UPLOAD_BYTES.to_string()]);
    let elapsed = started.elapsed();
    assert_eq!(reply, format!("pod-2-0 {UPLOAD_BYTES}"));
    let (tcp_per_s, tcp_failed) = flows_per_second(c, "tcp", NODE_PORT);
    let (udp_per_s, udp_failed) = flows_per_second(c, "udp", UDP_NODE_PORT);
    Figures {
        tcp_per_s,
        tcp_failed,
        udp_per_s,
        udp_failed,
        upload_mbit_s: UPLOAD_BYTES as f64 * 8.0 / elapsed.as_secs_f64() / 1e6,
    }
}

/// Restarts node-1's agent with `--xdp <mode>` and waits until it has attached (or removed) the
/// XDP program and synced. Through `off` first: a restart re-adopts our link whatever its mode.
fn switch(c: &Cluster, mode: &str) {
    if mode != "off" && c.node(0).uplink_xdp().is_some() {
        switch(c, "off");
    }
    c.restart_agent_with(0, &["--xdp", mode]).unwrap();
    let want = match mode {
        "native" => Some("xdp"),
        "generic" => Some("xdpgeneric"),
        _ => None,
    };
    let deadline = Instant::now() + Duration::from_secs(15);
    while c.node(0).uplink_xdp().map(|(m, _)| m).as_deref() != want
        || c.node(0).metric("kube_router_sync_duration_seconds_count", "") < 1.0
    {
        assert!(Instant::now() < deadline, "node-1's agent did not come up with --xdp {mode}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn main() {
    assert!(netprobe_bin().exists(), "build the test binaries first");
    let c = Cluster::builder("krt-xdp-bench")
        .full_checksums()
        .agent_args(&["--snat-port-range", SNAT_PORTS])
        .build()
        .unwrap();
    c.add_service(Svc::node_port("web", "10.96.1.20", 30080).select("pod", "pod-2-0")).unwrap();
    const MODES: [&str; 3] = ["off", "native", "generic"];
    let rounds = 4;
    let mut sums = [Figures::default(); 3];
    let mut exhausted = [0u64; 3];
    // Client retransmissions (segments, SYNs) and node-1's drops of new flows, per mode.
    let mut retransmits = [(0u64, 0u64); 3];
    let mut dropped = [0u64; 3];
    for round in 0..rounds {
        // Rotating which goes first cancels what one leaves for the next (SNAT ports held).
        for k in 0..MODES.len() {
            let i = (round + k) % MODES.len();
            switch(&c, MODES[i]);
            let before = c.node(0).stats();
            let retransmits_before = client_retransmits(&c);
            let f = measure(&c);
            let retransmits_after = client_retransmits(&c);
            let after = c.node(0).stats();
            retransmits[i].0 += retransmits_after.0 - retransmits_before.0;
            retransmits[i].1 += retransmits_after.1 - retransmits_before.1;
            dropped[i] += ["redirect_failed", "ct_insert_failed", "rewrite_failed"]
                .iter()
                .map(|n| after[*n] - before[*n])
                .sum::<u64>();
            let served = after["xdp_tx"] - before["xdp_tx"];
            assert_eq!(served > 0, MODES[i] != "off", "XDP served {served} packets with --xdp {}", MODES[i]);
            exhausted[i] += after["snat_ports_exhausted"] - before["snat_ports_exhausted"];
            let sum = &mut sums[i];
            sum.tcp_per_s += f.tcp_per_s / rounds as f64;
            sum.udp_per_s += f.udp_per_s / rounds as f64;
            sum.upload_mbit_s += f.upload_mbit_s / rounds as f64;
            sum.tcp_failed += f.tcp_failed;
            sum.udp_failed += f.udp_failed;
        }
    }
    println!("== north-south through a NodePort to the other node ({rounds} rounds, rotated), --xdp:");
    println!("{:<34} {:>10} {:>10} {:>10} {:>8} {:>8}", "", "off (TC)", "native", "generic", "nat/TC", "gen/TC");
    let [tc, native, generic] = sums;
    for (what, get) in [
        ("new TCP connections / s", (|f: &Figures| f.tcp_per_s) as fn(&Figures) -> f64),
        ("new UDP flows / s", |f| f.udp_per_s),
        ("one TCP upload, Mbit/s", |f| f.upload_mbit_s),
    ] {
        let (t, n, g) = (get(&tc), get(&native), get(&generic));
        println!("{what:<34} {t:>10.1} {n:>10.1} {g:>10.1} {:>7.2}x {:>7.2}x", n / t, g / t);
    }
    println!(
        "{:<34} {:>10} {:>10} {:>10}",
        "failed flows (TCP + UDP, sum)",
        tc.tcp_failed + tc.udp_failed,
        native.tcp_failed + native.udp_failed,
        generic.tcp_failed + generic.udp_failed
    );
    println!("{:<34} {:>10} {:>10} {:>10}", "new flows refused: SNAT ports", exhausted[0], exhausted[1], exhausted[2]);
    println!("{:<34} {:>10} {:>10} {:>10}", "dropped: redirect/insert/rewrite", dropped[0], dropped[1], dropped[2]);
    let [r0, r1, r2] = retransmits.map(|(segments, syns)| format!("{segments}/{syns}"));
    println!("{:<34} {r0:>10} {r1:>10} {r2:>10}", "client TCP retransmits (all/SYN)");
    let stats = c.node(0).stats();
    let counters = ["xdp_pass_no_route", "xdp_pass_checksum_partial", "xdp_rewrite_failed"];
    println!("node-1: {}", counters.map(|n| format!("{n} {}", stats[n])).join(", "));
}
