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
    let desired_copy = desired.clone();
    let started = Instant::now();
    memory_sync.sync(&mut memory, desired_copy, true);
    let memory_time = started.elapsed();

    let started = Instant::now();
    let report = sync.sync(&mut maps, desired, true);
    let kernel_time = started.elapsed();
    let writes = report.total();
    assert_eq!(writes.errors, 0, "map writes failed: {report:?}");

    let started = Instant::now();
    let again = assign_ids(&plan(&big, &node, Limits::default()), sync.programmed());
    let resync = sync.sync(&mut maps, again, true);
    let resync_time = started.elapsed();
    assert_eq!(resync.total().writes(), 0);

    let mut changed = big.clone();
    changed.slices.get_mut(&("bench".to_string(), "svc-5000-1".to_string())).unwrap().endpoints.pop();
    let started = Instant::now();
    let one = assign_ids(&plan(&changed, &node, Limits::default()), sync.programmed());
    let delta = sync.sync(&mut maps, one, true);
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
    let report_v6 = sync_v6.sync(&mut maps_v6, desired_v6, true);
    assert_eq!(report_v6.total().errors, 0, "IPv6 map writes failed: {report_v6:?}");

    println!("\n== per-packet cost, BPF_PROG_TEST_RUN (10,000 services programmed)");
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
    drop(node);
    drop(datapath);
    let _ = datapath::remove_all(pin_dir);
}
