//! Source-address verification on pod veths (`source_check`), in the kernel: the real programs run
//! with BPF_PROG_TEST_RUN on crafted frames over `pod_src` entries as the agent writes them. Needs
//! root; the pin directory is /sys/fs/bpf/krt-src-test.
#[path = "common/test_run.rs"]
mod test_run;
use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::PathBuf,
};
use test_run::{packet, run, TC_ACT_SHOT, TC_ACT_UNSPEC};

use aya::maps::{HashMap, Map, MapData};
use kube_router::bpf::datapath::{self, Datapath, Hook};
use kube_router::node::pod_sources::PodAddresses;
use kube_router::pinned::counters::read_pinned;
use kube_router::pinned::pinned_map;
use kube_router_common::{
    plain_map_names, plain_stat, source_check_map_names, src_stat, PodSources, SOURCE_CHECK_BY_LB,
    SOURCE_CHECK_BY_POLICY,
};

/// A test run without an interface arrives on the loopback device, index 1.
const IFINDEX: u32 = 1;
const POD: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 2);
const PEER: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 3);
const POD6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x244, 1, 0, 0, 0, 0, 2);
const POD_LINK_LOCAL: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 2);
const PEER6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x244, 1, 0, 0, 0, 0, 3);
const OTHER_LINK_LOCAL: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 0x99);

struct Loaded {
    datapath: Datapath,
    pin_dir: PathBuf,
}

impl Drop for Loaded {
    fn drop(&mut self) {
        let _ = datapath::remove_all(&self.pin_dir);
    }
}

impl Loaded {
    fn new(test: &str) -> Self {
        let pin_dir = PathBuf::from(format!("/sys/fs/bpf/krt-src-test-{test}"));
        let _ = datapath::remove_all(&pin_dir);
        let datapath = Datapath::load(&pin_dir).expect("load datapath (run as root)");
        Self { datapath, pin_dir }
    }

    fn sources(&self) -> HashMap<MapData, u32, PodSources> {
        let path = pinned_map(&self.pin_dir, source_check_map_names::POD_SOURCES);
        HashMap::try_from(Map::HashMap(MapData::from_pin(path).unwrap())).unwrap()
    }

    /// The veth's entry as the agent writes it for a pod with `addresses`.
    fn set(&self, addresses: &[IpAddr], checked_by: u8) {
        self.set_on(IFINDEX, addresses, checked_by);
    }

    /// Veth `ifindex`'s entry, as the agent writes it: then a change of the plain-traffic
    /// cache's generation.
    fn set_on(&self, ifindex: u32, addresses: &[IpAddr], checked_by: u8) {
        let addresses = PodAddresses(addresses.iter().copied().collect::<BTreeSet<_>>());
        self.sources().insert(ifindex, addresses.entry(checked_by), 0).unwrap();
        kube_router::pinned::plain::forget_all(&self.pin_dir);
    }

    fn plain_hits(&self) -> u64 {
        read_pinned(&self.pin_dir, plain_map_names::PLAIN_STATS, plain_stat::COUNT).unwrap()[plain_stat::HIT as usize]
    }

    fn verdict(&self, hook: Hook, frame: &[u8]) -> i32 {
        let result = run(self.datapath.program_fd(hook).unwrap(), frame, 1)
            .unwrap_or_else(|e| panic!("{} bytes: {e}", frame.len()));
        result.retval
    }

    fn stats(&self) -> Vec<u64> {
        read_pinned(&self.pin_dir, source_check_map_names::SOURCE_CHECK_STATS, src_stat::COUNT).unwrap()
    }
}

fn udp(src: Ipv4Addr) -> Vec<u8> {
    packet::ipv4(packet::UDP, (src, 40000), (PEER, 53), 0, b"q")
}

fn udp6(src: Ipv6Addr) -> Vec<u8> {
    packet::ipv6(packet::UDP, (src, 40000), (PEER6, 53), 0, b"q")
}

/// A neighbour solicitation-like ICMPv6 message (only the next header matters to the check).
fn icmp6(src: Ipv6Addr) -> Vec<u8> {
    packet::icmpv6_echo(128, src, PEER6, 1)
}

/// An ARP request for IPv4 from `sender`.
fn arp(sender: Ipv4Addr) -> Vec<u8> {
    let mut frame = vec![0xff; 6];
    frame.extend([0x02, 0, 0, 0, 0, 1, 0x08, 0x06, 0, 1, 0x08, 0x00, 6, 4, 0, 1]);
    frame.extend([0x02, 0, 0, 0, 0, 1]);
    frame.extend(sender.octets());
    frame.extend([0; 6]);
    frame.extend(PEER.octets());
    frame
}

/// Every kind of source against a resolved pod: its own addresses pass, others are dropped and
/// counted by family; `::` and link-local sources pass for ICMPv6 (neighbour discovery) only;
/// ARP must name the pod (or nobody: a probe); a frame cut short is dropped.
#[test]
fn only_the_pods_own_sources_pass() {
    let dp = Loaded::new("own");
    dp.set(&[POD.into(), POD6.into(), POD_LINK_LOCAL.into()], SOURCE_CHECK_BY_POLICY);
    let from_pod = |frame: &[u8]| dp.verdict(Hook::PolicyIngress, frame);
    let cases: [(&str, Vec<u8>, i32); 14] = [
        ("own IPv4", udp(POD), TC_ACT_UNSPEC),
        ("another pod's IPv4", udp(PEER), TC_ACT_SHOT),
        ("a random IPv4", udp(Ipv4Addr::new(198, 51, 100, 7)), TC_ACT_SHOT),
        ("own IPv6", udp6(POD6), TC_ACT_UNSPEC),
        ("own link-local, UDP", udp6(POD_LINK_LOCAL), TC_ACT_UNSPEC),
        ("another pod's IPv6", udp6(PEER6), TC_ACT_SHOT),
        ("another link-local, UDP", udp6(OTHER_LINK_LOCAL), TC_ACT_SHOT),
        ("another link-local, ICMPv6", icmp6(OTHER_LINK_LOCAL), TC_ACT_UNSPEC),
        ("unspecified, ICMPv6", icmp6(Ipv6Addr::UNSPECIFIED), TC_ACT_UNSPEC),
        ("unspecified, UDP", udp6(Ipv6Addr::UNSPECIFIED), TC_ACT_SHOT),
        ("ARP from the pod", arp(POD), TC_ACT_UNSPEC),
        ("ARP probe", arp(Ipv4Addr::UNSPECIFIED), TC_ACT_UNSPEC),
        ("ARP claiming another pod", arp(PEER), TC_ACT_SHOT),
        // (The kernel's test run refuses IP frames shorter than their header.)
        ("ARP cut before its sender", arp(POD)[..26].to_vec(), TC_ACT_SHOT),
    ];
    for (what, frame, expected) in &cases {
        assert_eq!(from_pod(frame), *expected, "{what}");
    }
    let stats = dp.stats();
    assert_eq!(stats[src_stat::PACKETS as usize], cases.len() as u64);
    assert_eq!(stats[src_stat::PASSED as usize], 7);
    assert_eq!(stats[src_stat::SPOOFED_V4 as usize], 2);
    assert_eq!(stats[src_stat::SPOOFED_V6 as usize], 3);
    assert_eq!(stats[src_stat::SPOOFED_ARP as usize], 2, "a forged sender, a truncated frame");
    assert_eq!(stats[src_stat::UNRESOLVED as usize], 0);
}

/// A veth whose pod has no address yet (the CNI has not configured it): IPv4 and ARP are dropped
/// and counted unresolved, IPv6 neighbour discovery passes. Fail closed.
#[test]
fn a_veth_without_addresses_fails_closed() {
    let dp = Loaded::new("unresolved");
    dp.set(&[], SOURCE_CHECK_BY_POLICY);
    assert_eq!(dp.verdict(Hook::PolicyIngress, &udp(POD)), TC_ACT_SHOT);
    assert_eq!(dp.verdict(Hook::PolicyIngress, &arp(POD)), TC_ACT_SHOT);
    assert_eq!(dp.verdict(Hook::PolicyIngress, &udp6(POD6)), TC_ACT_SHOT);
    assert_eq!(dp.verdict(Hook::PolicyIngress, &icmp6(Ipv6Addr::UNSPECIFIED)), TC_ACT_UNSPEC);
    assert_eq!(dp.stats()[src_stat::UNRESOLVED as usize], 3);
}

/// Only the program named in the entry checks (the first at the veth's TC ingress: the load
/// balancer's source NAT would look like a forged source to the policy program after it); a
/// veth without an entry is not checked at all.
#[test]
fn the_first_program_checks_and_a_veth_without_entry_is_not_checked() {
    let dp = Loaded::new("order");
    let forged = udp(PEER);
    assert_eq!(dp.verdict(Hook::Ingress, &forged), TC_ACT_UNSPEC, "no entry");
    assert_eq!(dp.verdict(Hook::PolicyIngress, &forged), TC_ACT_UNSPEC, "no entry");
    dp.set(&[POD.into()], SOURCE_CHECK_BY_LB);
    assert_eq!(dp.verdict(Hook::Ingress, &forged), TC_ACT_SHOT, "the load balancer checks");
    assert_eq!(dp.verdict(Hook::PolicyIngress, &forged), TC_ACT_UNSPEC, "not checked twice");
    dp.set(&[POD.into()], SOURCE_CHECK_BY_POLICY);
    assert_eq!(dp.verdict(Hook::Ingress, &forged), TC_ACT_UNSPEC);
    assert_eq!(dp.verdict(Hook::PolicyIngress, &forged), TC_ACT_SHOT, "the policy program checks");
}

/// What the check costs a genuine packet at `kr_pol_ingress` (kernel-measured, 100,000 runs):
/// printed, and bounded loosely so a pathological slowdown shows.
#[test]
fn the_check_costs_one_lookup() {
    let dp = Loaded::new("cost");
    let frame = udp(POD);
    let fd = dp.datapath.program_fd(Hook::PolicyIngress).unwrap();
    let unchecked = run(fd, &frame, 100_000).unwrap().duration_ns;
    dp.set(&[POD.into(), POD6.into(), POD_LINK_LOCAL.into()], SOURCE_CHECK_BY_POLICY);
    let checked = run(fd, &frame, 100_000).unwrap().duration_ns;
    eprintln!("kr_pol_ingress, genuine UDP: {unchecked} ns unchecked, {checked} ns checked");
    assert!(checked < unchecked + 200, "{checked} ns checked against {unchecked} ns");
}

/// The plain-traffic cache remembers a source that passed per interface: the same tuple from a
/// pod on another veth (spoofing the first pod's address) is checked there and dropped, and a
/// veth whose pod's addresses change is checked against the new ones from its next packet.
#[test]
fn a_source_remembered_as_passing_is_the_interface_s_and_forgotten_when_its_addresses_change() {
    let dp = Loaded::new("plain");
    let node = test_run::NodeNetns::enter(
        "krt-src-plain",
        &[&["link", "add", "krt-pa", "type", "veth", "peer", "name", "krt-pb"]],
    )
    .expect("netns");
    let (a, b) = (node.ifindex("krt-pa"), node.ifindex("krt-pb"));
    // As the agent runs it: the load balancer's gate open, so plain traffic is remembered.
    kube_router::services::maps::gate::open(&dp.pin_dir).unwrap();
    dp.set_on(a, &[POD.into()], SOURCE_CHECK_BY_LB);
    dp.set_on(b, &[PEER.into()], SOURCE_CHECK_BY_LB);
    let lb_on = |ifindex: u32, frame: &[u8]| {
        test_run::run_on(dp.datapath.program_fd(Hook::Ingress).unwrap(), frame, 1, Some(ifindex)).unwrap().retval
    };
    let frame = udp(POD);
    assert_eq!(lb_on(a, &frame), TC_ACT_UNSPEC, "the pod's own address");
    let hits = dp.plain_hits();
    assert_eq!(lb_on(a, &frame), TC_ACT_UNSPEC, "again");
    assert_eq!(dp.plain_hits(), hits + 2, "the source and the tuple found in the cache");
    assert_eq!(lb_on(b, &frame), TC_ACT_SHOT, "the same tuple from the other veth's pod: spoofed");
    let stats = dp.stats();
    assert_eq!(stats[src_stat::PASSED as usize], 2, "counted on the hit as on the check");
    assert_eq!(stats[src_stat::SPOOFED_V4 as usize], 1);
    dp.set_on(a, &[PEER.into()], SOURCE_CHECK_BY_LB);
    assert_eq!(lb_on(a, &frame), TC_ACT_SHOT, "the veth's pod has another address now");
    drop(node);
}
