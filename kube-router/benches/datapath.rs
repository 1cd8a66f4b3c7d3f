//! Benchmarks (root): per-packet cost of the load-balancer programs with BPF_PROG_TEST_RUN,
//! and the time to sync 10,000 services x 10 endpoints into the pinned maps. Each figure is
//! also given as a ratio against a baseline measured in the same run.
#[path = "../tests/common/test_run.rs"]
mod test_run;
use std::{
    net::{Ipv4Addr, Ipv6Addr},
    path::Path,
    time::{Duration, Instant},
};
use test_run::{packet, run_on, run_xdp, NodeNetns, XDP_PASS, XDP_TX};

use kube_router::services::maps::write_lb_config;
use kube_router::services::maps::{BpfServiceMaps, BpfServiceMapsV6};
use kube_router::{
    bpf::{
        datapath::{self, Datapath, Hook},
        xdp,
    },
    services::{
        compile::{assign_ids, plan, plan_for, Limits, MapContents},
        family::V6,
        model::*,
        sync::ServiceSync,
    },
};

const SAMPLES: u16 = 20_000;
const NODE6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x100, 0, 0, 0, 0, 0, 1);

mod common;

use common::{state, state_v6};

fn peak_rss_mib() -> f64 {
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage fills the struct we pass.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    usage.ru_maxrss as f64 / 1024.0
}

/// Rounds of each gate setting, alternated (the machine may be shared).
const GATE_ROUNDS: u16 = 3;

fn main() {
    let pin_dir = Path::new("/sys/fs/bpf/krt-bench");
    let _ = datapath::remove_all(pin_dir);
    let mut datapath = Datapath::load(pin_dir).expect("load datapath (root needed)");
    let mut maps = BpfServiceMaps::open_pinned(pin_dir).expect("maps");
    let node = NodeContext {
        name: "node-a".into(),
        node_port_addrs: vec![Ipv4Addr::new(10, 100, 0, 1).into(), NODE6.into()],
        hairpin_all: true,
        ..Default::default()
    };
    write_lb_config(
        pin_dir,
        &kube_router_common::LbConfig {
            snat_addr: u32::from_ne_bytes([10, 100, 0, 1]),
            snat_addr_v6: kube_router_common::Ipv6Words::from_octets(NODE6.octets()),
            snat_port_min: 10_000,
            snat_port_max: 60_000,
            flags: 0,
            pad: 0,
        },
    )
    .unwrap();

    println!("== map sync: 10,000 services x 10 endpoints");
    let big = state(10_000, 10);
    let started = Instant::now();
    let mut sync = ServiceSync::adopt(&maps).unwrap();
    let lb_plan = plan(&big, &node, Limits::default());
    let desired = assign_ids(&lb_plan, sync.programmed());
    let compile_time = started.elapsed();

    let mut memory = MapContents::default();
    let mut memory_sync = ServiceSync::adopt(&memory).unwrap();
    let started = Instant::now();
    memory_sync.sync(&mut memory, &desired, true);
    let memory_time = started.elapsed();

    let started = Instant::now();
    let report = sync.sync(&mut maps, &desired, true);
    let kernel_time = started.elapsed();
    let writes = report.total();
    assert_eq!(writes.errors, 0, "map writes failed: {report:?}");

    let started = Instant::now();
    let again = assign_ids(&plan(&big, &node, Limits::default()), sync.programmed());
    let resync = sync.sync(&mut maps, &again, true);
    let resync_time = started.elapsed();
    assert_eq!(resync.total().writes(), 0);

    let mut changed = big.clone();
    changed.slices.get_mut(&("bench".to_string(), "svc-5000-1".to_string())).unwrap().endpoints.pop();
    let started = Instant::now();
    let one = assign_ids(&plan(&changed, &node, Limits::default()), sync.programmed());
    let delta = sync.sync(&mut maps, &one, true);
    let one_change = started.elapsed();

    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!("compile (plan + ids)            {:>9.1} ms", ms(compile_time));
    println!("initial sync, {} writes   {:>9.1} ms  ({:.2} us/write; {:.1}x the same sync into an in-memory model: {:.1} ms)",
        writes.writes(), ms(kernel_time), kernel_time.as_secs_f64() * 1e6 / writes.writes() as f64,
        kernel_time.as_secs_f64() / memory_time.as_secs_f64(), ms(memory_time));
    println!(
        "resync, nothing changed         {:>9.1} ms  (0 writes; {:.2}x the initial sync)",
        ms(resync_time),
        resync_time.as_secs_f64() / kernel_time.as_secs_f64()
    );
    println!(
        "one endpoint removed            {:>9.1} ms  ({} writes, full recompile)",
        ms(one_change),
        delta.total().writes()
    );
    println!("peak RSS                        {:>9.1} MiB", peak_rss_mib());

    // The same 10,000 Services over IPv6, for the per-family packet figures below.
    let mut maps_v6 = BpfServiceMapsV6::open_pinned(pin_dir).expect("v6 maps");
    let mut sync_v6 = ServiceSync::<V6>::adopt(&maps_v6).unwrap();
    let desired_v6 = assign_ids(&plan_for::<V6>(&state_v6(10_000, 10), &node, Limits::default()), sync_v6.programmed());
    let report_v6 = sync_v6.sync(&mut maps_v6, &desired_v6, true);
    assert_eq!(report_v6.total().errors, 0, "IPv6 map writes failed: {report_v6:?}");

    // One run per packet: a repeated run would keep rewriting the already rewritten packet (the
    // kernel does not restore it between repeats), so the conntrack-hit case would in fact time
    // a miss. Each figure is the kernel-timed average over SAMPLES single runs; that includes the
    // kernel's per-run timing overhead, equally for every case.
    let node = NodeNetns::enter(
        "krt-bench-node",
        &[
            &["link", "add", "up0", "type", "veth", "peer", "name", "up1"],
            &["addr", "add", "10.100.0.1/24", "dev", "up0"],
            &["link", "set", "up0", "up"],
            &["link", "set", "up1", "up"],
            &["route", "add", "10.244.0.0/16", "via", "10.100.0.2"],
            // The benchmark Services' backends (benches/common): without this route the NodePort
            // figures timed a failed FIB lookup (a drop).
            &["route", "add", "10.128.0.0/9", "via", "10.100.0.2"],
            &["route", "add", "10.1.0.0/16", "via", "10.100.0.254"],
            &["addr", "add", "fd00:100::1/64", "dev", "up0", "nodad"],
            &["-6", "route", "add", "fd00:128::/64", "via", "fd00:100::2"],
            &["-6", "route", "add", "fd00:1::/64", "via", "fd00:100::fe"],
            // Known next hops: XDP sends only with the neighbour's MAC in hand.
            &["neigh", "add", "10.100.0.2", "lladdr", "02:00:00:00:00:02", "dev", "up0", "nud", "permanent"],
            &["neigh", "add", "10.100.0.254", "lladdr", "02:00:00:00:00:fe", "dev", "up0", "nud", "permanent"],
        ],
    )
    .expect("bench netns");
    let uplink = node.ifindex("up0");
    let ifindex = Some(uplink);
    // `KRT_BENCH_POD_ONLY=1`: only the pod veth comparison and the load times (a few minutes less).
    if std::env::var("KRT_BENCH_POD_ONLY").is_ok_and(|v| v == "1") {
        pod_veth_section(&datapath, ifindex);
        load_times(pin_dir);
        drop(node);
        drop(datapath);
        let _ = datapath::remove_all(pin_dir);
        return;
    }
    println!("\n== per-packet cost, BPF_PROG_TEST_RUN (10,000 services programmed)");
    let ingress = datapath.program_fd(Hook::Ingress).unwrap();
    let egress = datapath.program_fd(Hook::Egress).unwrap();
    let avg = |fd: i32, frame: &dyn Fn(u16) -> Vec<u8>| -> f64 {
        let total: u64 =
            (0..SAMPLES).map(|i| u64::from(run_on(fd, &frame(i), 1, ifindex).expect("test run").duration_ns)).sum();
        total as f64 / f64::from(SAMPLES)
    };
    let client = (Ipv4Addr::new(10, 1, 0, 7), 40000);
    let vip = (Ipv4Addr::new(10, 96, 19, 136), 80); // svc-5000
    let tcp =
        |src: (Ipv4Addr, u16), dst: (Ipv4Addr, u16), flags: u8| packet::ipv4(packet::TCP, src, dst, flags, &[0; 64]);
    let miss = avg(ingress, &|_| tcp(client, (Ipv4Addr::new(10, 200, 0, 1), 80), packet::TCP_ACK));
    // The first packet creates the flow; every later one is a conntrack hit.
    let ct_hit = avg(ingress, &|_| tcp(client, vip, packet::TCP_ACK));
    let backend = packet::endpoints(&run_on(ingress, &tcp(client, vip, packet::TCP_ACK), 1, ifindex).unwrap().packet).1;
    let reverse = avg(egress, &|_| tcp(backend, client, packet::TCP_ACK));
    let egress_miss = avg(egress, &|_| tcp((Ipv4Addr::new(10, 200, 0, 1), 80), client, packet::TCP_ACK));
    // New flows: a distinct source port per packet.
    let new_flow = avg(ingress, &|i| tcp((client.0, 1000 + i), vip, packet::TCP_SYN));
    // North-south through a NodePort to a backend on another node: DNAT + SNAT + routed here.
    let node_port = (Ipv4Addr::new(10, 100, 0, 1), 30080);
    let outside = Ipv4Addr::new(10, 1, 1, 9);
    let snat_new = avg(ingress, &|i| tcp((outside, 1000 + i), node_port, packet::TCP_SYN));
    let snat_hit = avg(ingress, &|_| tcp((outside, 1000), node_port, packet::TCP_ACK));
    let natted = run_on(ingress, &tcp((outside, 1000), node_port, packet::TCP_ACK), 1, ifindex).unwrap().packet;
    let (snat_src, snat_dst) = packet::endpoints(&natted);
    assert_eq!(snat_src.0, node_port.0, "the NodePort flow is source-NATed");
    let snat_reply = avg(ingress, &|_| tcp(snat_dst, snat_src, packet::TCP_ACK));
    let row =
        |what: &str, ns: f64, base: f64, of: &str| println!("{what:<58} {ns:>7.1} ns/pkt   {:.2}x {of}", ns / base);
    row("ingress, not a service (baseline)", miss, miss, "");
    row("ingress, conntrack hit + DNAT", ct_hit, miss, "");
    row("ingress, new flow (select + 2 ct inserts + DNAT)", new_flow, miss, "");
    row("egress, not ours", egress_miss, miss, "");
    row("egress, reverse NAT", reverse, miss, "");
    row(
        "ingress, NodePort to another node, new flow (+ SNAT port, FIB, redirect)",
        snat_new,
        ct_hit,
        "of a conntrack hit",
    );
    row("ingress, NodePort to another node, established (DNAT + SNAT + FIB)", snat_hit, ct_hit, "of a conntrack hit");
    row("ingress, its reply (reverse SNAT + DNAT + FIB)", snat_reply, ct_hit, "of a conntrack hit");

    // The XDP fast path on the same packets: the established NodePort flow TC created above,
    // its reply, new NodePort flows, and a packet to no Service (XDP_PASS, the baseline).
    let xdp_fd = xdp::program_fd(&mut datapath).unwrap();
    let xavg = |frame: &dyn Fn(u16) -> Vec<u8>| -> f64 {
        let total: u64 =
            (0..SAMPLES).map(|i| u64::from(run_xdp(xdp_fd, &frame(i), 1, uplink).expect("test run").duration_ns)).sum();
        total as f64 / f64::from(SAMPLES)
    };
    let not_ours = tcp(client, (Ipv4Addr::new(10, 200, 0, 1), 80), packet::TCP_ACK);
    assert_eq!(run_xdp(xdp_fd, &not_ours, 1, uplink).unwrap().retval, XDP_PASS);
    let established = tcp((outside, 1000), node_port, packet::TCP_ACK);
    let sent = run_xdp(xdp_fd, &established, 1, uplink).unwrap();
    assert_eq!((sent.retval, packet::endpoints(&sent.packet)), (XDP_TX, (snat_src, snat_dst)), "XDP serves TC's flow");
    let xdp_pass = xavg(&|_| not_ours.clone());
    let xdp_hit = xavg(&|_| established.clone());
    let xdp_reply = xavg(&|_| tcp(snat_dst, snat_src, packet::TCP_ACK));
    let elsewhere = Ipv4Addr::new(10, 1, 2, 9);
    let xdp_new = xavg(&|i| tcp((elsewhere, 1000 + i), node_port, packet::TCP_SYN));
    println!("\n== XDP fast path (kr_xdp_lb) on the same NodePort packets: program time only (TEST_RUN");
    println!("   times the program, not the skb allocation and stack traversal XDP_TX saves)");
    row("XDP, not a service: XDP_PASS (baseline)", xdp_pass, miss, "of TC ingress, not a service");
    row("XDP, NodePort to another node, established -> XDP_TX", xdp_hit, snat_hit, "of TC (same packet)");
    row("", xdp_hit, xdp_pass, "of the XDP_PASS baseline");
    row("XDP, its reply -> XDP_TX", xdp_reply, snat_reply, "of TC (same packet)");
    row("XDP, NodePort to another node, new flow -> XDP_TX", xdp_new, snat_new, "of TC");

    println!("\n== IPv6, the same cases (10,000 IPv6 Services programmed), as ratios to IPv4 above");
    let client6 = (Ipv6Addr::new(0xfd00, 1, 0, 0, 0, 0, 0, 7), 40000);
    let vip6 = (Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 5000), 80); // svc-5000
    let tcp6 =
        |src: (Ipv6Addr, u16), dst: (Ipv6Addr, u16), flags: u8| packet::ipv6(packet::TCP, src, dst, flags, &[0; 64]);
    let miss6 = avg(ingress, &|_| tcp6(client6, (Ipv6Addr::new(0xfd00, 0x200, 0, 0, 0, 0, 0, 1), 80), packet::TCP_ACK));
    let ct_hit6 = avg(ingress, &|_| tcp6(client6, vip6, packet::TCP_ACK));
    let translated = run_on(ingress, &tcp6(client6, vip6, packet::TCP_ACK), 1, ifindex).unwrap().packet;
    let backend6 = packet::endpoints_v6(&translated).1;
    assert_ne!(backend6, vip6, "the IPv6 flow is translated");
    let reverse6 = avg(egress, &|_| tcp6(backend6, client6, packet::TCP_ACK));
    let new_flow6 = avg(ingress, &|i| tcp6((client6.0, 1000 + i), vip6, packet::TCP_SYN));
    let outside6 = Ipv6Addr::new(0xfd00, 1, 0, 0, 0, 0, 1, 9);
    let snat_new6 = avg(ingress, &|i| tcp6((outside6, 1000 + i), (NODE6, 30080), packet::TCP_SYN));
    let v6_row = |what: &str, ns: f64, v4: f64| println!("{what:<58} {ns:>7.1} ns/pkt   {:.2}x IPv4", ns / v4);
    v6_row("ingress, not a service", miss6, miss);
    v6_row("ingress, conntrack hit + DNAT", ct_hit6, ct_hit);
    v6_row("ingress, new flow", new_flow6, new_flow);
    v6_row("egress, reverse NAT", reverse6, reverse);
    v6_row("ingress, NodePort to another node, new flow", snat_new6, snat_new);

    // The gate in front of the conntrack lookup (services::maps::gate), closed (every packet looked up, as
    // before it) and open, on the same packets in alternating rounds; min-max of the rounds.
    println!(
        "\n== the load balancer's gate: closed (every packet looked up) vs open, {GATE_ROUNDS} rounds each, min-max"
    );
    let mut closed: Vec<[f64; 6]> = Vec::new();
    let mut open: Vec<[f64; 6]> = Vec::new();
    for round in 0..GATE_ROUNDS * 2 {
        let is_open = round % 2 == 1;
        if is_open {
            kube_router::services::maps::gate::open(pin_dir).expect("open the gate");
        } else {
            kube_router::services::maps::gate::close(pin_dir).expect("close the gate");
        }
        // New flows: a client address of its own per round, a distinct port per packet.
        let fresh = Ipv4Addr::new(10, 1, 100 + round as u8, 7);
        let figures = [
            avg(ingress, &|_| tcp(client, (Ipv4Addr::new(10, 200, 0, 1), 80), packet::TCP_ACK)),
            avg(egress, &|_| tcp((Ipv4Addr::new(10, 200, 0, 1), 80), client, packet::TCP_ACK)),
            avg(ingress, &|_| tcp6(client6, (Ipv6Addr::new(0xfd00, 0x200, 0, 0, 0, 0, 0, 1), 80), packet::TCP_ACK)),
            avg(ingress, &|_| tcp(client, vip, packet::TCP_ACK)),
            avg(egress, &|_| tcp(backend, client, packet::TCP_ACK)),
            avg(ingress, &|i| tcp((fresh, 1000 + i), vip, packet::TCP_SYN)),
        ];
        if is_open {
            open.push(figures)
        } else {
            closed.push(figures)
        }
    }
    let range = |rounds: &[[f64; 6]], i: usize| {
        let values = rounds.iter().map(|r| r[i]);
        (values.clone().fold(f64::MAX, f64::min), values.fold(0.0, f64::max))
    };
    for (i, what) in [
        "ingress, not a service (IPv4)",
        "egress, not a service (IPv4)",
        "ingress, not a service (IPv6)",
        "ingress, conntrack hit + DNAT",
        "egress, reverse NAT",
        "ingress, new flow",
    ]
    .iter()
    .enumerate()
    {
        let ((c0, c1), (o0, o1)) = (range(&closed, i), range(&open, i));
        println!("{what:<40} closed {c0:>6.1}-{c1:<6.1} open {o0:>6.1}-{o1:<6.1} ns/pkt");
    }
    pod_veth_section(&datapath, ifindex);
    load_times(pin_dir);
    drop(node);
    drop(datapath);
    let _ = datapath::remove_all(pin_dir);
}

/// A packet of the pod veth comparison: what it is, the pair's two programs (in the order they
/// run), the combined one, the frame.
type PodCase = (&'static str, (i32, i32), i32, Vec<u8>);

/// Rounds of the pod veth comparison, each measuring both ways on every packet, alternated.
const POD_ROUNDS: usize = 5;

/// A pod veth with the load balancer and the policy on: the two programs at each hook
/// (`kr_lb_ingress` then `kr_pol_ingress` from the pod, `kr_pol_egress` then `kr_lb_egress` to
/// it) against the one that does both (`kr_pod_ingress`, `kr_pod_egress`), on the same packets.
/// The pair's figure is the sum of its two runs (the second run on what the first left), which
/// leaves out the second program's dispatch by tc, in the pair's favour. No policy isolates the
/// pods; the gate is open and 10,000 Services per family are programmed, as on a node.
fn pod_veth_section(datapath: &Datapath, ifindex: Option<u32>) {
    let fd = |hook| datapath.program_fd(hook).unwrap();
    let (lb_in, pol_in, pod_in) = (fd(Hook::Ingress), fd(Hook::PolicyIngress), fd(Hook::PodIngress));
    let (lb_out, pol_out, pod_out) = (fd(Hook::Egress), fd(Hook::PolicyEgress), fd(Hook::PodEgress));
    kube_router::services::maps::gate::open(Path::new("/sys/fs/bpf/krt-bench")).expect("open the gate");
    // The pair on one packet: the first program's run, then the second's on what it left (the
    // second does not run after a verdict, as in the filter chain). The verdict and packet are
    // the pair's, to check the combined program against.
    let pair = |first: i32, second: i32, frame: &[u8]| -> (u64, i32, Vec<u8>) {
        let one = run_on(first, frame, 1, ifindex).expect("test run");
        if one.retval != test_run::TC_ACT_UNSPEC {
            return (u64::from(one.duration_ns), one.retval, one.packet);
        }
        let two = run_on(second, &one.packet, 1, ifindex).expect("test run");
        (u64::from(one.duration_ns) + u64::from(two.duration_ns), two.retval, two.packet)
    };
    let pod = Ipv4Addr::new(10, 244, 1, 5);
    let other_pod = Ipv4Addr::new(10, 244, 2, 7);
    let vip = (Ipv4Addr::new(10, 96, 19, 136), 80); // svc-5000
    let pod6 = Ipv6Addr::new(0xfd00, 0x244, 1, 0, 0, 0, 0, 5);
    let other_pod6 = Ipv6Addr::new(0xfd00, 0x244, 2, 0, 0, 0, 0, 7);
    let frame4 = |proto, src, dst| packet::ipv4(proto, src, dst, packet::TCP_ACK, &[0; 64]);
    let frame6 = |proto, src, dst| packet::ipv6(proto, src, dst, packet::TCP_ACK, &[0; 64]);
    // The Service flow the reverse-NAT case replies on: opened once from the pod.
    let opened =
        run_on(lb_in, &packet::ipv4(packet::TCP, (pod, 41000), vip, packet::TCP_SYN, &[]), 1, ifindex).unwrap();
    let backend = packet::endpoints(&opened.packet).1;
    assert_ne!(backend, vip, "the pod's Service flow is translated");
    let cases: Vec<PodCase> = vec![
        (
            "plain TCP, from the pod (ingress)",
            (lb_in, pol_in),
            pod_in,
            frame4(packet::TCP, (pod, 40000), (other_pod, 8080)),
        ),
        (
            "plain TCP, to the pod (egress)",
            (pol_out, lb_out),
            pod_out,
            frame4(packet::TCP, (other_pod, 8080), (pod, 40000)),
        ),
        (
            "plain UDP, from the pod (ingress)",
            (lb_in, pol_in),
            pod_in,
            frame4(packet::UDP, (pod, 40000), (other_pod, 53)),
        ),
        (
            "plain UDP, to the pod (egress)",
            (pol_out, lb_out),
            pod_out,
            frame4(packet::UDP, (other_pod, 53), (pod, 40000)),
        ),
        (
            "plain TCP over IPv6, from the pod",
            (lb_in, pol_in),
            pod_in,
            frame6(packet::TCP, (pod6, 40000), (other_pod6, 8080)),
        ),
        (
            "plain TCP over IPv6, to the pod",
            (pol_out, lb_out),
            pod_out,
            frame6(packet::TCP, (other_pod6, 8080), (pod6, 40000)),
        ),
        (
            "Service flow from the pod, conntrack hit + DNAT",
            (lb_in, pol_in),
            pod_in,
            frame4(packet::TCP, (pod, 41000), vip),
        ),
        (
            "Service reply to the pod, reverse NAT",
            (pol_out, lb_out),
            pod_out,
            frame4(packet::TCP, backend, (pod, 41000)),
        ),
    ];
    // Same verdict, same packet: the combined program does what the pair does.
    for (what, (first, second), combined, frame) in &cases {
        let (_, verdict, out) = pair(*first, *second, frame);
        let one = run_on(*combined, frame, 1, ifindex).unwrap();
        assert_eq!((one.retval, &one.packet), (verdict, &out), "{what}: the combined program differs from the pair");
    }
    let mut two: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
    let mut one: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
    for round in 0..POD_ROUNDS * 2 {
        for (i, (_, (first, second), combined, frame)) in cases.iter().enumerate() {
            let samples = u64::from(SAMPLES);
            if round % 2 == 0 {
                let total: u64 = (0..SAMPLES).map(|_| pair(*first, *second, frame).0).sum();
                two[i].push(total as f64 / samples as f64);
            } else {
                let total: u64 =
                    (0..SAMPLES).map(|_| u64::from(run_on(*combined, frame, 1, ifindex).unwrap().duration_ns)).sum();
                one[i].push(total as f64 / samples as f64);
            }
        }
    }
    let min_max = |v: &[f64]| (v.iter().copied().fold(f64::MAX, f64::min), v.iter().copied().fold(0.0, f64::max));
    println!(
        "\n== pod veth, load balancer + policy: the pair vs the combined program, ns/pkt, {POD_ROUNDS} alternated rounds of {SAMPLES} single runs, min-max"
    );
    for (i, (what, ..)) in cases.iter().enumerate() {
        let ((t0, t1), (o0, o1)) = (min_max(&two[i]), min_max(&one[i]));
        println!("{what:<50} pair {t0:>6.1}-{t1:<6.1} combined {o0:>6.1}-{o1:<6.1} ({:.2}-{:.2}x)", o0 / t1, o1 / t0);
    }
}

/// The verifier's time for each TC program of the object (thread CPU time of its load), what
/// an agent's start pays for every program it loads; and the instructions it processed.
fn load_times(pin_dir: &Path) {
    let thread_cpu = || {
        let mut now: libc::timespec = unsafe { std::mem::zeroed() };
        // SAFETY: clock_gettime fills the struct we pass.
        unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) };
        Duration::new(now.tv_sec as u64, now.tv_nsec as u32)
    };
    let mut loader = aya::EbpfLoader::new();
    loader.default_map_pin_directory(kube_router::pinned::maps_dir(pin_dir));
    let mut ebpf = loader.load(kube_router::bpf::DATAPATH_OBJECT).expect("the object");
    println!("\n== program load (verification) time, thread CPU, one load each");
    let mut total = Duration::ZERO;
    for hook in Hook::ALL {
        let program: &mut aya::programs::SchedClassifier =
            ebpf.program_mut(hook.program()).expect("in the object").try_into().expect("a classifier");
        let started = thread_cpu();
        program.load().expect("verified");
        let took = thread_cpu() - started;
        total += took;
        let insns = program.info().ok().and_then(|info| info.verified_instruction_count());
        println!(
            "{:<16} {:>7.1} ms  {:>8} instructions processed",
            hook.program(),
            took.as_secs_f64() * 1e3,
            insns.unwrap_or(0)
        );
    }
    println!("{:<16} {:>7.1} ms", "all TC programs", total.as_secs_f64() * 1e3);
}
