//! Benchmark (root): packets per second that one CPU forwards through a NodePort to a backend on
//! another node, with the XDP fast path (`kr_xdp_lb`, XDP_TX) against TC alone (`kr_lb_ingress`,
//! `bpf_redirect_neigh`), against plain kernel routing, and against an XDP_DROP floor.
//!
//! Real frames: a generator XDP program run with `BPF_PROG_TEST_RUN` in live-frame mode
//! redirects copies of one UDP packet of an established NodePort flow into veth `ga`; they
//! arrive on its peer `gb`, the node's uplink, where the contender handles them; what it
//! forwards goes back out of `gb` to `ga`, whose XDP program drops it. Generator, both veth
//! NAPI polls and the contender all run on one CPU (this thread is pinned and the kernel runs
//! the veth polls in the softirq of the CPU that queued the frames), so the figure is what one
//! core forwards, generator and veth included. Contenders are interleaved over several rounds.
#[path = "../tests/common/test_run.rs"]
mod test_run;
use std::{
    net::Ipv4Addr,
    os::fd::{AsRawFd, OwnedFd},
    path::{Path, PathBuf},
    time::Duration,
};
use test_run::{packet, run_xdp, run_xdp_live, NodeNetns};

use kube_router::services::maps::{write_lb_config, BpfServiceMaps};
use kube_router::{
    bpf::{
        datapath::{self, Datapath, Hook},
        xdp::{self, XdpSetting},
    },
    services::{
        compile::{addr_be, assign_ids, plan, Limits},
        model::NodeContext,
        source::parse_objects,
        sync::ServiceSync,
    },
};
use kube_router_common::{lb_stat, xdp_stat, LbConfig};

const NODE_IP: Ipv4Addr = Ipv4Addr::new(10, 100, 0, 1);
const CLIENT: Ipv4Addr = Ipv4Addr::new(192, 168, 100, 2);
const REMOTE_POD: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 5);
/// Frames per measurement, and rounds of all contenders.
const FRAMES: u32 = 2_000_000;
const ROUNDS: usize = 3;
const CPU: usize = 1;
/// Packets the kernel itself may send on the link during a measurement.
const STRAY: u64 = 10;

/// A NodePort Service whose one endpoint is on another node (so its flows are source-NATed to
/// this node and sent back out of the uplink).
const SERVICE: &str = "apiVersion: v1\nkind: Service\nmetadata: {namespace: default, name: web}\nspec:\n  type: NodePort\n  clusterIP: 10.96.0.10\n  ports:\n  - {name: dns, protocol: UDP, port: 53, nodePort: 30053}\n---\n\
apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  namespace: default\n  name: web-1\n  labels: {kubernetes.io/service-name: web}\naddressType: IPv4\n\
ports:\n- {name: dns, protocol: UDP, port: 5353}\nendpoints:\n- addresses: [\"10.244.2.5\"]\n  nodeName: node-b\n  conditions: {ready: true}\n";

mod live_frames;
use live_frames::{netns_sysctls, pin_to_cpu, raw, received_at_ga};

enum Receiver {
    /// A trivial program returning this verdict (XDP_DROP: the floor; XDP_PASS: the stack, and
    /// TC behind it; on a veth it also turns on the NAPI a redirected frame needs).
    Trivial(i32),
    /// `kr_xdp_lb`, native.
    FastPath,
}

struct Contender {
    name: &'static str,
    receiver: Receiver,
    /// Our TC programs on `gb`.
    tc: bool,
    /// Frames to the NodePort (translated by us), or straight to the backend (plain routing).
    to_node_port: bool,
}

fn main() {
    let netns = "krt-perf-xdprate";
    let node = NodeNetns::enter(
        netns,
        &[
            &["link", "add", "ga", "type", "veth", "peer", "name", "gb"],
            // gb takes the frames' destination MAC, so the stack accepts them too.
            &["link", "set", "ga", "address", "02:00:00:00:00:01"],
            &["link", "set", "gb", "address", "02:00:00:00:00:02"],
            &["addr", "add", "10.100.0.1/24", "dev", "gb"],
            &["link", "set", "ga", "up"],
            &["link", "set", "gb", "up"],
            &["route", "add", "10.244.2.0/24", "via", "10.100.0.2", "dev", "gb"],
            &["route", "add", "192.168.100.0/24", "via", "10.100.0.254", "dev", "gb"],
            // Known next hops: XDP sends only with the neighbour's MAC in hand.
            &["neigh", "add", "10.100.0.2", "lladdr", "02:00:00:00:00:fe", "dev", "gb", "nud", "permanent"],
            &["neigh", "add", "10.100.0.254", "lladdr", "02:00:00:00:00:fe", "dev", "gb", "nud", "permanent"],
        ],
    )
    .expect("bench netns (root needed)");
    // No IPv6 chatter (router solicitations, MLD) on the link whose received packets are counted.
    netns_sysctls(
        netns,
        &[
            "net.ipv4.conf.all.send_redirects=0",
            "net.ipv4.conf.gb.send_redirects=0",
            "net.ipv6.conf.ga.disable_ipv6=1",
            "net.ipv6.conf.gb.disable_ipv6=1",
        ],
    );
    let (ga, gb) = (node.ifindex("ga"), node.ifindex("gb"));

    let pin_dir = PathBuf::from("/sys/fs/bpf/krt-perf-xdprate");
    let _ = datapath::remove_all(&pin_dir);
    let mut datapath = Datapath::load(&pin_dir).expect("load datapath");
    program_service(&pin_dir);

    // The flow: the first packet (run once, not live) records it; every frame after is a
    // conntrack hit, which is what a forwarding rate is made of.
    let node_port_frame = packet::ipv4(packet::UDP, (CLIENT, 40000), (NODE_IP, 30053), 0, &[7; 18]);
    let direct_frame = packet::ipv4(packet::UDP, (CLIENT, 40000), (REMOTE_POD, 5353), 0, &[7; 18]);
    let xdp_fd = xdp::program_fd(&mut datapath).unwrap();
    let first = run_xdp(xdp_fd, &node_port_frame, 1, gb).unwrap();
    assert_eq!((first.retval, packet::endpoints(&first.packet).1), (3, (REMOTE_POD, 5353)), "XDP_TX to the backend");

    let header_len = 44; // Ethernet + IPv4 + UDP headers and 2 bytes, in whole words
    let generators =
        [raw::generator(&node_port_frame[..header_len], ga), raw::generator(&direct_frame[..header_len], ga)];
    let (drop, pass) = (raw::verdict(raw::XDP_DROP), raw::verdict(raw::XDP_PASS));
    // What comes back out of gb is dropped at ga (this also gives ga the NAPI XDP_TX needs).
    let _sink = raw::attach(&drop, ga);

    let contenders = [
        Contender {
            name: "XDP_DROP at gb (floor: generator + veth)",
            receiver: Receiver::Trivial(raw::XDP_DROP),
            tc: false,
            to_node_port: true,
        },
        Contender {
            name: "XDP_PASS, kernel routing, no NAT (baseline)",
            receiver: Receiver::Trivial(raw::XDP_PASS),
            tc: false,
            to_node_port: false,
        },
        Contender {
            name: "TC kr_lb_ingress: NodePort, DNAT+SNAT, redirect",
            receiver: Receiver::Trivial(raw::XDP_PASS),
            tc: true,
            to_node_port: true,
        },
        Contender {
            name: "XDP kr_xdp_lb: NodePort, DNAT+SNAT, XDP_TX",
            receiver: Receiver::FastPath,
            tc: true,
            to_node_port: true,
        },
    ];
    pin_to_cpu(CPU);
    let mut bench = Bench { netns, pin_dir: &pin_dir, datapath: &mut datapath, ga, gb, drop, pass, generators };
    let mut rates = vec![0f64; contenders.len()];
    let mut forwarded_share = vec![0f64; contenders.len()];
    for round in 0..ROUNDS {
        for k in 0..contenders.len() {
            // Rotated order: what one leaves behind (caches, queues) falls on each in turn.
            let i = (round + k) % contenders.len();
            let (rate, share) = bench.measure(&contenders[i], &node_port_frame, &direct_frame);
            rates[i] += rate / ROUNDS as f64;
            forwarded_share[i] += share / ROUNDS as f64;
        }
    }
    // Where the time goes: the programs' own run time (kernel.bpf_stats), in a pass of its own
    // (the statistics cost two clock reads per run, which the rates above do not pay).
    let program_ns: Vec<Option<f64>> = {
        let _stats = aya::sys::enable_stats(aya::sys::Stats::RunTime).expect("BPF_ENABLE_STATS");
        contenders
            .iter()
            .map(|c| {
                let program = if matches!(c.receiver, Receiver::FastPath) {
                    xdp::PROGRAM
                } else if c.tc {
                    Hook::Ingress.program()
                } else {
                    return None;
                };
                let before = bench.run_stats(program);
                bench.measure(c, &node_port_frame, &direct_frame);
                let after = bench.run_stats(program);
                Some((after.0 - before.0) as f64 / (after.1 - before.1) as f64)
            })
            .collect()
    };
    println!("== one CPU forwarding UDP frames (64 B) of one established NodePort flow to a backend on another");
    println!("   node; generator (XDP live frames) + veth + contender on CPU {CPU}; {ROUNDS} rounds x {FRAMES} frames, rotated");
    let (baseline, tc) = (rates[1], rates[2]);
    for (i, c) in contenders.iter().enumerate() {
        let program =
            program_ns[i].map(|ns| format!("program {ns:.0} ns of {:.0} ns/pkt", 1e9 / rates[i])).unwrap_or_default();
        println!(
            "{:<50} {:>5.2} Mpps {:>5.2}x routing {:>5.2}x TC  fwd {:>3.0} %  {program}",
            c.name,
            rates[i] / 1e6,
            rates[i] / baseline,
            rates[i] / tc,
            forwarded_share[i] * 100.0
        );
    }
    let _ = datapath::remove_all(&pin_dir);
}

struct Bench<'a> {
    netns: &'a str,
    pin_dir: &'a Path,
    datapath: &'a mut Datapath,
    ga: u32,
    gb: u32,
    drop: OwnedFd,
    pass: OwnedFd,
    /// To the NodePort, and straight to the backend.
    generators: [OwnedFd; 2],
}

impl Bench<'_> {
    /// Sets up `c` on gb, sends FRAMES frames; packets handled per second and the share of
    /// frames forwarded back out of gb. Checks that the contender itself forwarded them.
    fn measure(&mut self, c: &Contender, node_port_frame: &[u8], direct_frame: &[u8]) -> (f64, f64) {
        let _trivial_link = match c.receiver {
            Receiver::Trivial(action) => {
                Some(raw::attach(if action == raw::XDP_DROP { &self.drop } else { &self.pass }, self.gb))
            }
            Receiver::FastPath => {
                xdp::attach(self.datapath, "gb", XdpSetting::Native).expect("attach kr_xdp_lb");
                None
            }
        };
        if c.tc {
            self.datapath.attach("gb").expect("attach TC");
        }
        let generator = self.generators[usize::from(!c.to_node_port)].as_raw_fd();
        let frame = if c.to_node_port { node_port_frame } else { direct_frame };
        // Warm-up: neighbour, caches, page pool.
        run_xdp_live(generator, frame, FRAMES / 10, self.ga).expect("live test run");
        std::thread::sleep(Duration::from_millis(20));
        let (before, lb_before, xdp_before) = (received_at_ga(self.netns), lb(self.pin_dir), xdp_stats(self.pin_dir));
        let elapsed = run_xdp_live(generator, frame, FRAMES, self.ga).expect("live test run");
        // The last batch's polls run as the call returns; let them finish.
        std::thread::sleep(Duration::from_millis(20));
        let forwarded = received_at_ga(self.netns) - before;
        let (lb_after, xdp_after) = (lb(self.pin_dir), xdp_stats(self.pin_dir));
        // Who forwarded: TC's redirects, or XDP's transmissions (give or take a stray packet of
        // the kernel's own on the link).
        let served_tc = lb_after[lb_stat::REDIRECTED as usize] - lb_before[lb_stat::REDIRECTED as usize];
        let served_xdp = xdp_after[xdp_stat::TX as usize] - xdp_before[xdp_stat::TX as usize];
        match (&c.receiver, c.tc) {
            (Receiver::FastPath, _) => {
                assert!(
                    served_xdp + STRAY >= forwarded && served_tc == 0,
                    "{}: XDP {served_xdp}, TC {served_tc}",
                    c.name
                )
            }
            (_, true) => assert!(served_tc + STRAY >= forwarded && served_xdp == 0, "{}: TC {served_tc}", c.name),
            _ => assert_eq!(served_tc + served_xdp, 0, "{}", c.name),
        }
        if c.tc {
            self.datapath.detach_hook(Hook::Ingress, "gb").unwrap();
            self.datapath.detach_hook(Hook::Egress, "gb").unwrap();
        }
        if matches!(c.receiver, Receiver::FastPath) {
            xdp::detach(self.pin_dir, "gb").unwrap();
        }
        // The floor forwards nothing: its figure is frames dropped at gb per second.
        let handled =
            if matches!(c.receiver, Receiver::Trivial(raw::XDP_DROP)) { u64::from(FRAMES) } else { forwarded };
        (handled as f64 / elapsed.as_secs_f64(), forwarded as f64 / f64::from(FRAMES))
    }

    /// (run time in ns, runs) of our program `name`, from kernel.bpf_stats.
    fn run_stats(&mut self, name: &str) -> (u64, u64) {
        let info = if name == xdp::PROGRAM {
            self.datapath.program_mut::<aya::programs::Xdp>(name).unwrap().info()
        } else {
            self.datapath.program_mut::<aya::programs::SchedClassifier>(name).unwrap().info()
        }
        .unwrap();
        (info.run_time().as_nanos() as u64, info.run_count())
    }
}

fn program_service(pin_dir: &Path) {
    let mut maps = BpfServiceMaps::open_pinned(pin_dir).unwrap();
    let mut sync = ServiceSync::adopt(&maps).unwrap();
    let node = NodeContext { name: "node-a".into(), node_port_addrs: vec![NODE_IP.into()], ..Default::default() };
    let builder = parse_objects(SERVICE).unwrap();
    let desired = assign_ids(&plan(&builder.state, &node, Limits::default()), sync.programmed());
    assert_eq!(sync.sync(&mut maps, desired, true).total().errors, 0);
    let config =
        LbConfig { snat_addr: addr_be(NODE_IP), snat_port_min: 20_000, snat_port_max: 60_000, ..Default::default() };
    write_lb_config(pin_dir, &config).unwrap();
}

fn lb(pin_dir: &Path) -> Vec<u64> {
    kube_router::services::maps::read_lb_stats(pin_dir).unwrap()
}

fn xdp_stats(pin_dir: &Path) -> Vec<u64> {
    xdp::read_stats(pin_dir).unwrap().expect("xdp_stats")
}
