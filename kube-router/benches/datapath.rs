//! Benchmarks (root): per-packet cost of the load-balancer programs with BPF_PROG_TEST_RUN,
//! and the time to sync 10,000 services x 10 endpoints into the pinned maps. Each figure is
//! also given as a ratio against a baseline measured in the same run.
use std::{
    net::Ipv4Addr,
    path::Path,
    time::{Duration, Instant},
};

use kube_router::{
    bpf::{
        datapath::{self, Datapath, Hook},
        service_maps::BpfServiceMaps,
        test_run::{packet, run},
    },
    services::{
        compile::{assign_ids, plan, Limits, MapContents},
        model::*,
        sync::ServiceSync,
    },
};

mod common;

use common::state;

const REPEAT: u32 = 200_000;

fn peak_rss_mib() -> f64 {
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage fills the struct we pass.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    usage.ru_maxrss as f64 / 1024.0
}

fn per_packet(fd: i32, frame: &[u8]) -> f64 {
    run(fd, frame, REPEAT).expect("test run").duration_ns as f64
}

fn main() {
    let pin_dir = Path::new("/sys/fs/bpf/krt-bench");
    let _ = datapath::remove_all(pin_dir);
    let datapath = Datapath::load(pin_dir).expect("load datapath (root needed)");
    let mut maps = BpfServiceMaps::open_pinned(pin_dir).expect("maps");
    let node = NodeContext::default();

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

    println!("\n== per-packet cost, BPF_PROG_TEST_RUN x {REPEAT} (10,000 services programmed)");
    let ingress = datapath.program_fd(Hook::Ingress).unwrap();
    let egress = datapath.program_fd(Hook::Egress).unwrap();
    let client = (Ipv4Addr::new(10, 1, 0, 7), 40000);
    let vip = (Ipv4Addr::new(10, 96, 19, 136), 80); // svc-5000
    let miss = per_packet(
        ingress,
        &packet::ipv4(packet::TCP, client, (Ipv4Addr::new(10, 200, 0, 1), 80), packet::TCP_ACK, &[0; 64]),
    );
    // First packet creates the flow; the repeats are conntrack hits.
    let established = packet::ipv4(packet::TCP, client, vip, packet::TCP_ACK, &[0; 64]);
    let ct_hit = per_packet(ingress, &established);
    let dnat = run(ingress, &established, 1).unwrap().packet;
    let backend = packet::endpoints(&dnat).1;
    let reply = packet::ipv4(packet::TCP, backend, client, packet::TCP_ACK, &[0; 64]);
    let reverse = per_packet(egress, &reply);
    let egress_miss = per_packet(
        egress,
        &packet::ipv4(packet::TCP, (Ipv4Addr::new(10, 200, 0, 1), 80), client, packet::TCP_ACK, &[0; 64]),
    );
    // New flows: a distinct source port per packet, one run each (kernel-timed, no syscall cost).
    let mut total = 0u64;
    let flows = 20_000u16;
    for port in 0..flows {
        let syn = packet::ipv4(packet::TCP, (client.0, 1000 + port), vip, packet::TCP_SYN, &[]);
        total += u64::from(run(ingress, &syn, 1).unwrap().duration_ns);
    }
    let new_flow = total as f64 / f64::from(flows);
    println!("ingress, not a service (baseline) {miss:>7.1} ns/pkt   1.00x");
    println!("ingress, conntrack hit + DNAT     {ct_hit:>7.1} ns/pkt   {:.2}x", ct_hit / miss);
    println!("ingress, new flow (select + 2 ct inserts + DNAT) {new_flow:>7.1} ns/pkt   {:.2}x", new_flow / miss);
    println!("egress, not ours                  {egress_miss:>7.1} ns/pkt   {:.2}x", egress_miss / miss);
    println!("egress, reverse NAT               {reverse:>7.1} ns/pkt   {:.2}x", reverse / miss);
    drop(datapath);
    let _ = datapath::remove_all(pin_dir);
}
