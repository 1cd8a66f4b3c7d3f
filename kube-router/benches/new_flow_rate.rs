//! Benchmark (root): new flows per second that one CPU takes through a ClusterIP, the node's
//! datapath alone: this datapath's TC programs against kube-proxy's rules (iptables, legacy and
//! nft backends; nftables mode) and against plain kernel routing, at 1 and at 10,000 Services.
//!
//! Every frame is a new flow: a generator XDP program run with `BPF_PROG_TEST_RUN` in
//! live-frame mode sends UDP frames to the measured Service's ClusterIP with a random source
//! port and address (10.244.x.y) into veth `ga`; its peer `gb` is the node's interface, where the
//! contender translates the ClusterIP to the backend (on another node, reached back out of `gb`)
//! and the kernel forwards the frame; `ga` drops what comes back. A ClusterIP is not routed in
//! these namespaces (a blackhole route), so only a translated frame is forwarded. Plain routing gets the same frames
//! addressed to the backend itself. Generator, veth polls and contender share one pinned CPU:
//! what is measured is the node's cost of a new flow (translation, connection tracking,
//! forwarding) without the end hosts' TCP stacks, which dominate `service_datapath`'s
//! connections per second. Each contender has its own network namespace (and its own kernel
//! conntrack table, flushed after each measurement: the kernel hashes every namespace's entries
//! in one table); both connection tables hold 262,144 entries and are full after the warm-up,
//! so every new flow also evicts one, as under a flood of new flows.
#[path = "../tests/common/test_run.rs"]
mod test_run;
use std::{
    net::Ipv4Addr,
    os::fd::{AsRawFd, OwnedFd},
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};
use test_run::{packet, run_xdp_live, NodeNetns};

use kube_router::services::maps::{conntrack::Conntrack, write_lb_config, BpfServiceMaps};
use kube_router::{
    bpf::datapath::{self, Datapath, Hook},
    services::{
        compile::{addr_be, assign_ids, plan, Limits},
        model::NodeContext,
        source::parse_objects,
        sync::ServiceSync,
    },
};
use kube_router_common::{lb_stat, LbConfig};
use kube_router_tests::kube_proxy;

mod live_frames;
use live_frames::{netns_sysctls, pin_to_cpu, raw, received_at_ga};

const NODE_IP: Ipv4Addr = Ipv4Addr::new(10, 50, 0, 1);
/// The backend, on another node (next hop 10.50.0.2, out of `gb`).
const BACKEND: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 5);
/// Sources: 10.244.x.y, the last two bytes random per frame.
const SOURCE_BASE: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 0);
const CPU: usize = 1;
const ROUNDS: usize = 3;
/// New flows measured into emptied tables: ours then holds 200,000 entries (two per flow) of
/// 262,144, the kernel's 100,000 of 262,144. Fewer for a contender slower than this per second.
const FRESH_FLOWS: u32 = 100_000;
/// Frames that fill both tables before the "full" measurement (at most 5 s of the contender's).
const FILL_FLOWS: u32 = 400_000;
/// Seconds of frames per "full" measurement.
const MEASURE_SECONDS: f64 = 1.0;
/// Frames of the probe that sizes each contender's measurements.
const PROBE_FRAMES: u32 = 20_000;

/// The connection tables' state during a measurement.
#[derive(Clone, Copy, PartialEq)]
enum Tables {
    /// Emptied before: every new flow finds room (the agent's and the kernel's garbage
    /// collectors keep them so in normal operation).
    Fresh,
    /// Full: every new flow also evicts one (a flood of new flows).
    Full,
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    /// XDP_DROP at gb: the generator and veth alone.
    Floor,
    /// Frames to the backend itself, no translation.
    Plain,
    /// Our TC programs on gb.
    Ours,
    /// kube-proxy's rules, loaded with this tool (and its arguments).
    Rules(&'static str, &'static [&'static str]),
}

impl Kind {
    fn short_name(&self) -> &'static str {
        match self {
            Kind::Floor => "floor",
            Kind::Plain => "plain",
            Kind::Ours => "ours",
            Kind::Rules(tool, _) => tool,
        }
    }
}

struct Contender {
    name: &'static str,
    kind: Kind,
    netns: NodeNetns,
    ga: u32,
    generator: OwnedFd,
    frame: Vec<u8>,
    /// Frames per second it takes, from a probe: sizes its measurements.
    estimate: f64,
    _links: Vec<OwnedFd>,
}

fn main() {
    let pin_dir = PathBuf::from("/sys/fs/bpf/krt-perf-newflow");
    let _ = datapath::remove_all(&pin_dir);
    let mut datapath = Datapath::load(&pin_dir).expect("load datapath");
    let dir = std::env::temp_dir().join("krt-perf-newflow");
    std::fs::create_dir_all(&dir).unwrap();
    let (drop_prog, pass_prog) = (raw::verdict(raw::XDP_DROP), raw::verdict(raw::XDP_PASS));
    pin_to_cpu(CPU);
    println!("== new UDP flows per second through a ClusterIP (a random source per 64 B frame) to a backend on");
    println!("   another node; generator (XDP live frames) + veth + contender on CPU {CPU}; {ROUNDS} rounds, rotated;");
    println!(
        "   connection tables emptied ({FRESH_FLOWS} flows), then full ({MEASURE_SECONDS} s after {FILL_FLOWS} flows)"
    );
    let sizes: Vec<usize> = match std::env::var("KRT_BENCH_SERVICES") {
        Ok(n) => vec![n.parse().expect("KRT_BENCH_SERVICES: a number of Services")],
        Err(_) => vec![1, 10_000],
    };
    for n in sizes {
        program_services(&pin_dir, n);
        let vip: Ipv4Addr = kube_proxy::vip(n - 1).parse().unwrap();
        let mut kinds = vec![("XDP_DROP at gb (floor: generator + veth)", Kind::Floor)];
        kinds.extend([
            ("plain routing, no translation (baseline)", Kind::Plain),
            ("this datapath (TC kr_lb_ingress)", Kind::Ours),
            ("kube-proxy iptables (legacy)", Kind::Rules("iptables-legacy-restore", &[])),
            ("kube-proxy iptables (nft)", Kind::Rules("iptables-nft-restore", &[])),
            ("kube-proxy nftables", Kind::Rules("nft", &["-f"])),
        ]);
        // KRT_BENCH_CONTENDERS=floor,plain,nft,... keeps ours and the ones named (Kind::short_name).
        if let Ok(only) = std::env::var("KRT_BENCH_CONTENDERS") {
            kinds.retain(|(_, kind)| *kind == Kind::Ours || only.split(',').any(|name| name == kind.short_name()));
        }
        let contenders: Vec<Contender> = kinds
            .into_iter()
            .enumerate()
            .map(|(i, (name, kind))| setup(i, name, kind, n, vip, &dir, &mut datapath, &drop_prog, &pass_prog))
            .collect();
        // [fresh, full] per contender.
        let mut rates = vec![[0f64; 2]; contenders.len()];
        for round in 0..ROUNDS {
            for k in 0..contenders.len() {
                // Rotated order: what one leaves behind (caches, queues) falls on each in turn.
                let i = (round + k) % contenders.len();
                for (j, tables) in [Tables::Fresh, Tables::Full].into_iter().enumerate() {
                    rates[i][j] += measure(&contenders[i], &pin_dir, tables) / ROUNDS as f64;
                }
            }
        }
        // Where our time goes: the programs' own run time per run (kernel.bpf_stats), in a pass
        // of its own (the statistics cost two clock reads per run, which the rates do not pay).
        let program_ns: Vec<(&str, f64)> = {
            let _stats = aya::sys::enable_stats(aya::sys::Stats::RunTime).expect("BPF_ENABLE_STATS");
            let ours = contenders.iter().find(|c| c.kind == Kind::Ours).unwrap();
            let before = [Hook::Ingress, Hook::Egress].map(|h| run_stats(&mut datapath, h));
            measure(ours, &pin_dir, Tables::Full);
            let after = [Hook::Ingress, Hook::Egress].map(|h| run_stats(&mut datapath, h));
            [("ingress", 0), ("egress", 1)]
                .map(|(name, i)| (name, (after[i].0 - before[i].0) as f64 / (after[i].1 - before[i].1) as f64))
                .to_vec()
        };
        let rate_of = |kind: Kind| contenders.iter().position(|c| c.kind == kind).map(|i| rates[i]);
        let (plain, ours) =
            (rate_of(Kind::Plain).unwrap_or([f64::NAN; 2]), rate_of(Kind::Ours).unwrap_or([f64::NAN; 2]));
        println!("\n{n} Service(s), two ports each; the measured one generated last. Mpps, and ours / it:");
        println!("  {:<45} {:>22} {:>22}", "", "tables emptied", "tables full");
        for (c, rate) in contenders.iter().zip(&rates) {
            let cell = |j: usize| format!("{:>7.3} {:>7.2}x", rate[j] / 1e6, ours[j] / rate[j]);
            // Without tables the emptied case is not theirs, and its short call (100,000
            // frames) carries a fixed cost of the live test run that halves a 3 Mpps figure.
            let fresh = if matches!(c.kind, Kind::Floor | Kind::Plain) { "-".to_string() } else { cell(0) };
            println!("  {:<45} {:>22} {:>22}", c.name, fresh, cell(1));
        }
        println!("  plain routing / ours (tables full): {:.2}x", plain[1] / ours[1]);
        let programs: Vec<String> = program_ns.iter().map(|(hook, ns)| format!("{hook} {ns:.0} ns")).collect();
        println!("  our programs per run, tables full: {} (of {:.0} ns per frame)", programs.join(", "), 1e9 / ours[1]);
        drop_contenders(contenders, &mut datapath);
    }
    let _ = datapath::remove_all(&pin_dir);
}

/// Contender `i`'s namespace: `ga`–`gb`, a route to the backends' and the sources' network via
/// 10.50.0.2 (a permanent neighbour), the contender on `gb`.
#[allow(clippy::too_many_arguments)]
fn setup(
    i: usize,
    name: &'static str,
    kind: Kind,
    n: usize,
    vip: Ipv4Addr,
    dir: &Path,
    datapath: &mut Datapath,
    drop_prog: &OwnedFd,
    pass_prog: &OwnedFd,
) -> Contender {
    let netns = NodeNetns::enter(
        &format!("krt-perf-nf{i}"),
        &[
            &["link", "add", "ga", "type", "veth", "peer", "name", "gb"],
            // gb takes the frames' destination MAC, so the stack accepts them.
            &["link", "set", "ga", "address", "02:00:00:00:00:01"],
            &["link", "set", "gb", "address", "02:00:00:00:00:02"],
            &["addr", "add", "10.50.0.1/24", "dev", "gb"],
            &["link", "set", "ga", "up"],
            &["link", "set", "gb", "up"],
            &["route", "add", "10.244.0.0/16", "via", "10.50.0.2", "dev", "gb"],
            &["neigh", "add", "10.50.0.2", "lladdr", "02:00:00:00:00:fe", "dev", "gb", "nud", "permanent"],
            // The ClusterIPs: dropped unless translated (silently: no "unreachable" comes back
            // to ga to be counted as forwarded).
            &["route", "add", "blackhole", "10.100.0.0/16"],
        ],
    )
    .expect("bench netns (root needed)");
    // Forwarded back out of the interface it came in on: no redirects; sources are not checked
    // against routes; no IPv6 chatter on the counted link.
    netns_sysctls(
        netns.name(),
        &[
            "net.ipv4.conf.all.send_redirects=0",
            "net.ipv4.conf.gb.send_redirects=0",
            "net.ipv4.conf.all.rp_filter=0",
            "net.ipv4.conf.gb.rp_filter=0",
            "net.ipv6.conf.ga.disable_ipv6=1",
            "net.ipv6.conf.gb.disable_ipv6=1",
        ],
    );
    let (ga, gb) = (netns.ifindex("ga"), netns.ifindex("gb"));
    let mut links = vec![raw::attach(drop_prog, ga)];
    links.push(raw::attach(if kind == Kind::Floor { drop_prog } else { pass_prog }, gb));
    match kind {
        Kind::Ours => {
            datapath.attach("gb").expect("attach TC");
        }
        Kind::Rules(tool, args) => {
            let rules = if tool == "nft" {
                kube_proxy::nftables_rules(n, &BACKEND.to_string())
            } else {
                kube_proxy::iptables_rules(n, &BACKEND.to_string())
            };
            let file = dir.join(format!("{tool}.rules"));
            std::fs::write(&file, rules).unwrap();
            let out =
                Command::new("ip").args(["netns", "exec", netns.name(), tool]).args(args).arg(&file).output().unwrap();
            assert!(out.status.success(), "{tool}: {}", String::from_utf8_lossy(&out.stderr));
        }
        Kind::Floor | Kind::Plain => {}
    }
    let to = if kind == Kind::Plain { (BACKEND, 5353) } else { (vip, 53) };
    let mut frame = packet::ipv4(packet::UDP, (SOURCE_BASE, 40000), to, 0, &[7; 18]);
    // The generator's template: IP id 0xffff (its checksum follows), no UDP checksum (IPv4 allows
    // it, and the random source port would break one).
    frame[18..20].copy_from_slice(&[0xff, 0xff]);
    frame[24..26].copy_from_slice(&[0, 0]);
    let checksum = packet::ipv4_header_checksum(&frame[14..34]);
    frame[24..26].copy_from_slice(&checksum.to_be_bytes());
    frame[40..42].copy_from_slice(&[0, 0]);
    let header_len = 44; // Ethernet + IPv4 + UDP headers and 2 bytes, in whole words
    let generator = raw::new_flow_generator(&frame[..header_len], ga);
    let probe = run_xdp_live(generator.as_raw_fd(), &frame, PROBE_FRAMES, ga).expect("live test run");
    let estimate = f64::from(PROBE_FRAMES) / probe.as_secs_f64();
    Contender { name, kind, netns, ga, generator, frame, estimate, _links: links }
}

/// New flows `c` forwarded per second with its tables as `tables` says (frames dropped at the
/// veth when it is slower than the generator do not count). Checks that it translated (only
/// translated frames are forwarded) and, for ours, that our program did, as new flows.
fn measure(c: &Contender, pin_dir: &Path, tables: Tables) -> f64 {
    c.netns.join().unwrap();
    let send = |frames: u32| run_xdp_live(c.generator.as_raw_fd(), &c.frame, frames, c.ga).expect("live test run");
    // Caches, neighbours and the page pool warm (a cold first call measured plain routing at
    // 60 % of its rate), then the tables emptied.
    send(PROBE_FRAMES.min((c.estimate * 0.1) as u32).max(64));
    empty_tables(c, pin_dir);
    let frames = match tables {
        Tables::Fresh => FRESH_FLOWS.min(c.estimate as u32).max(PROBE_FRAMES),
        Tables::Full => {
            send(FILL_FLOWS.min((c.estimate * 5.0) as u32));
            ((c.estimate * MEASURE_SECONDS) as u32).max(PROBE_FRAMES)
        }
    };
    std::thread::sleep(Duration::from_millis(20));
    let (before, new_before) = (received_at_ga(c.netns.name()), new_flows(pin_dir));
    let elapsed = send(frames);
    // The last batch's polls run as the call returns; let them finish.
    std::thread::sleep(Duration::from_millis(20));
    let forwarded = received_at_ga(c.netns.name()) - before;
    let new = new_flows(pin_dir) - new_before;
    // The kernel's connection table is one hash for every namespace: a full table left behind
    // would lengthen the next contender's hash chains.
    empty_tables(c, pin_dir);
    if c.kind == Kind::Floor {
        return f64::from(frames) / elapsed.as_secs_f64();
    }
    assert!(forwarded >= u64::from(PROBE_FRAMES) / 10, "{}: forwarded {forwarded} of {frames}", c.name);
    match c.kind {
        // Each frame is its own flow (a random source repeats rarely among a second's frames).
        Kind::Ours => assert!(new as f64 >= 0.95 * forwarded as f64, "{}: {new} new flows, {forwarded} sent", c.name),
        _ => assert_eq!(new, 0, "{}: our programs are not on this link", c.name),
    }
    forwarded as f64 / elapsed.as_secs_f64()
}

/// Empties `c`'s connection table: ours (every entry expired at the end of time), or the
/// kernel's in its namespace.
fn empty_tables(c: &Contender, pin_dir: &Path) {
    match c.kind {
        Kind::Ours => {
            Conntrack::open_pinned(pin_dir).unwrap().collect_garbage_at(u64::MAX).unwrap();
        }
        Kind::Rules(..) => {
            let out = Command::new("ip").args(["netns", "exec", c.netns.name(), "conntrack", "-F"]).output().unwrap();
            assert!(out.status.success(), "conntrack -F: {}", String::from_utf8_lossy(&out.stderr));
        }
        Kind::Floor | Kind::Plain => {}
    }
}

/// (run time in ns, runs) of our TC program at `hook`, from kernel.bpf_stats.
fn run_stats(datapath: &mut Datapath, hook: Hook) -> (u64, u64) {
    let info = datapath.program_mut::<aya::programs::SchedClassifier>(hook.program()).unwrap().info().unwrap();
    (info.run_time().as_nanos() as u64, info.run_count())
}

fn new_flows(pin_dir: &Path) -> u64 {
    kube_router::services::maps::read_lb_stats(pin_dir).unwrap()[lb_stat::NEW_FLOW as usize]
}

/// Programs `n` Services (the last one's endpoint is [`BACKEND`]) into the pinned maps.
fn program_services(pin_dir: &Path, n: usize) {
    let mut maps = BpfServiceMaps::open_pinned(pin_dir).unwrap();
    let mut sync = ServiceSync::adopt(&maps).unwrap();
    let node = NodeContext { name: "node-a".into(), node_port_addrs: vec![NODE_IP.into()], ..Default::default() };
    let builder = parse_objects(&kube_proxy::service_yaml(n, &BACKEND.to_string())).unwrap();
    let desired = assign_ids(&plan(&builder.state, &node, Limits::default()), sync.programmed());
    assert_eq!(sync.sync(&mut maps, desired, true).total().errors, 0);
    let config =
        LbConfig { snat_addr: addr_be(NODE_IP), snat_port_min: 20_000, snat_port_max: 60_000, ..Default::default() };
    write_lb_config(pin_dir, &config).unwrap();
}

/// Our TC links are pinned by interface name: detached before the namespace goes, so the next
/// size's `gb` gets links of its own.
fn drop_contenders(contenders: Vec<Contender>, datapath: &mut Datapath) {
    for c in contenders {
        if c.kind == Kind::Ours {
            c.netns.join().unwrap();
            datapath.detach_hook(Hook::Ingress, "gb").unwrap();
            datapath.detach_hook(Hook::Egress, "gb").unwrap();
        }
    }
}
