//! The load balancer on IPv6, run in the kernel with BPF_PROG_TEST_RUN: DNAT and reverse NAT
//! with valid pseudo-header checksums, north-south source NAT routed by the program, refusals
//! (TCP RST, ICMPv6 port unreachable), ICMPv6 errors and fragments of translated flows, pod
//! egress masquerade, extension headers, neighbour discovery passing untouched, and direct
//! server return in IPv6-in-IPv6. Needs root.
#[path = "common/test_run.rs"]
mod test_run;
use std::{collections::BTreeMap, net::Ipv6Addr, path::PathBuf};
use test_run::{packet, run_on, NodeNetns, TC_ACT_REDIRECT, TC_ACT_SHOT, TC_ACT_UNSPEC};

use aya::maps::{lpm_trie::Key, HashMap, LpmTrie, Map, MapData};
use kube_router::pinned::counters::read_pinned_if_exists;
use kube_router::{
    bpf::datapath::{self, Datapath, Hook},
    services::family::V6,
};
use kube_router::{
    node::cluster_nets::sync_cluster_nets_of,
    services::maps::{read_lb_stats, write_lb_config},
};
use kube_router_common::*;

fn ip(text: &str) -> Ipv6Addr {
    text.parse().unwrap()
}

fn words(addr: Ipv6Addr) -> Ipv6Words {
    Ipv6Words::from_octets(addr.octets())
}

const SNAT_PORTS: (u16, u16) = (20_000, 20_999);

struct Lb {
    datapath: Datapath,
    pin_dir: PathBuf,
    ifindex: u32,
    _node: NodeNetns,
}

impl Drop for Lb {
    fn drop(&mut self) {
        let _ = datapath::remove_all(&self.pin_dir);
    }
}

fn node_ip() -> Ipv6Addr {
    ip("fd00:100::1")
}
fn client() -> Ipv6Addr {
    ip("fd00:192::2")
}
fn vip() -> Ipv6Addr {
    ip("fd00:96::10")
}
fn local_pod() -> Ipv6Addr {
    ip("fd00:244:1::5")
}
fn remote_pod() -> Ipv6Addr {
    ip("fd00:244:2::5")
}

fn open_hash<K: aya::Pod, V: aya::Pod>(pin_dir: &std::path::Path, name: &str) -> HashMap<MapData, K, V> {
    HashMap::try_from(Map::HashMap(MapData::from_pin(kube_router::pinned::pinned_map(pin_dir, name)).unwrap())).unwrap()
}

impl Lb {
    fn load(test: &str) -> Self {
        let node = NodeNetns::enter(
            &format!("krt-unit-v6-{test}"),
            &[
                &["link", "add", "up0", "type", "veth", "peer", "name", "up1"],
                &["addr", "add", "fd00:100::1/64", "dev", "up0", "nodad"],
                &["link", "set", "up0", "up"],
                &["link", "set", "up1", "up"],
                &["route", "add", "fd00:244:2::/64", "via", "fd00:100::2"],
                &["route", "add", "fd00:192::/64", "via", "fd00:100::fe"],
                &["link", "add", "pod0", "type", "veth", "peer", "name", "pod1"],
                &["addr", "add", "fd00:244:1::1/64", "dev", "pod0", "nodad"],
                &["link", "set", "pod0", "up"],
                &["link", "set", "pod1", "up"],
            ],
        )
        .expect("node netns");
        let ifindex = node.ifindex("up0");
        let pin_dir = PathBuf::from(format!("/sys/fs/bpf/krt-unit-v6-{test}"));
        let _ = datapath::remove_all(&pin_dir);
        let datapath = Datapath::load(&pin_dir).expect("load datapath (run as root)");
        let config = LbConfig {
            snat_addr: 0,
            snat_addr_v6: words(node_ip()),
            snat_port_min: SNAT_PORTS.0,
            snat_port_max: SNAT_PORTS.1,
            flags: LB_CONFIG_POD_EGRESS,
            pad: 0,
        };
        write_lb_config(&pin_dir, &config).unwrap();
        Lb { datapath, pin_dir, ifindex, _node: node }
    }

    /// A frontend (`flags` SVC_FLAG_*) over backends (address, port, local to this node).
    fn service(&self, service_id: u32, frontend: (Ipv6Addr, u16, u8), flags: u32, backends: &[(Ipv6Addr, u16, bool)]) {
        let mut services: HashMap<_, ServiceKeyV6, ServiceValue> = open_hash(&self.pin_dir, map_names::SERVICES_V6);
        let mut slots: HashMap<_, BackendSlotKey, BackendSlotValue> =
            open_hash(&self.pin_dir, map_names::BACKEND_SLOTS_V6);
        let mut stored: HashMap<_, u32, BackendV6> = open_hash(&self.pin_dir, map_names::BACKENDS_V6);
        for (slot, (addr, port, local)) in backends.iter().enumerate() {
            let backend_id = service_id * 100 + slot as u32;
            let flags = if *local { BACKEND_FLAG_LOCAL } else { 0 };
            stored.insert(backend_id, BackendV6 { addr: words(*addr), port: port.to_be(), flags }, 0).unwrap();
            slots.insert(BackendSlotKey { service_id, slot: slot as u32 }, BackendSlotValue { backend_id }, 0).unwrap();
        }
        let key = ServiceKeyV6 { addr: words(frontend.0), port: frontend.1.to_be(), proto: frontend.2, pad: 0 };
        let value = ServiceValue { service_id, backend_count: backends.len() as u32, flags, affinity_timeout_secs: 0 };
        services.insert(key, value, 0).unwrap();
    }

    fn run(&self, hook: Hook, frame: &[u8]) -> (i32, Vec<u8>) {
        let out = run_on(self.datapath.program_fd(hook).unwrap(), frame, 1, Some(self.ifindex)).unwrap();
        (out.retval, out.packet)
    }
    fn ingress(&self, frame: &[u8]) -> (i32, Vec<u8>) {
        self.run(Hook::Ingress, frame)
    }
    fn egress(&self, frame: &[u8]) -> (i32, Vec<u8>) {
        self.run(Hook::Egress, frame)
    }
    fn stat(&self, index: u32) -> u64 {
        read_lb_stats(&self.pin_dir).unwrap()[index as usize]
    }
    /// Direct server return's counter `index` (`dsr_stat`), summed over the CPUs.
    fn dsr_stat(&self, index: u32) -> u64 {
        read_pinned_if_exists(&self.pin_dir, map_names::DSR_STATS, dsr_stat::COUNT).unwrap().expect("dsr_stats")
            [index as usize]
    }
    /// The pod prefixes and node addresses, as the agent writes them from the Node objects.
    fn cluster_nets(&self) {
        let nets = BTreeMap::from([
            ("fd00:244:1::/64".parse().unwrap(), CLUSTER_NET_POD),
            ("fd00:244:2::/64".parse().unwrap(), CLUSTER_NET_POD),
            ("fd00:100::1/128".parse().unwrap(), CLUSTER_NET_NODE),
            ("fd00:100::2/128".parse().unwrap(), CLUSTER_NET_NODE),
        ]);
        sync_cluster_nets_of::<V6>(&self.pin_dir, &nets).unwrap();
    }
}

#[test]
fn cluster_ip_dnat_and_reverse_nat_with_valid_checksums() {
    let lb = Lb::load("dnat");
    for (proto, port, backend_port) in [(packet::TCP, 80, 8080), (packet::UDP, 53, 5353)] {
        lb.service(proto.into(), (vip(), port, proto), 0, &[(remote_pod(), backend_port, false)]);
        let request = packet::ipv6(proto, (local_pod(), 40000), (vip(), port), packet::TCP_SYN, b"hello");
        let (verdict, out) = lb.ingress(&request);
        assert_eq!(verdict, TC_ACT_UNSPEC);
        assert_eq!(packet::endpoints_v6(&out), ((local_pod(), 40000), (remote_pod(), backend_port)));
        assert!(packet::checksums_valid_v6(&out), "checksum after DNAT");
        let reply = packet::ipv6(proto, (remote_pod(), backend_port), (local_pod(), 40000), packet::TCP_ACK, b"hi");
        assert_eq!(lb.ingress(&reply).1, reply, "replies are left alone on ingress");
        let (_, out) = lb.egress(&reply);
        assert_eq!(packet::endpoints_v6(&out), ((vip(), port), (local_pod(), 40000)));
        assert!(packet::checksums_valid_v6(&out), "checksum after reverse NAT");
    }
    assert_eq!(lb.stat(lb_stat::NEW_FLOW), 2);
    assert_eq!(lb.stat(lb_stat::REVERSE_NAT), 2);

    // A hop-by-hop options header in front of TCP is looked past.
    let segment = packet::l4_segment_v6(packet::TCP, (local_pod(), 41000), (vip(), 80), packet::TCP_SYN, b"");
    let mut with_options = vec![packet::TCP, 0, 1, 4, 0, 0, 0, 0]; // next TCP, len 0, PadN
    with_options.extend_from_slice(&segment);
    let (_, out) = lb.ingress(&packet::ipv6_frame(0, local_pod(), vip(), &with_options));
    assert_eq!(&out[14 + 40 + 8 + 2..14 + 40 + 8 + 4], &8080u16.to_be_bytes(), "DNATed past the extension header");
}

#[test]
fn north_south_to_another_node_is_source_natted_and_routed() {
    let lb = Lb::load("ns");
    let flags = SVC_FLAG_EXTERNAL | SVC_FLAG_NODEPORT;
    lb.service(1, (node_ip(), 30080, packet::TCP), flags, &[(remote_pod(), 8080, false)]);
    let (verdict, out) =
        lb.ingress(&packet::ipv6(packet::TCP, (client(), 40000), (node_ip(), 30080), packet::TCP_SYN, b""));
    assert_eq!(verdict, TC_ACT_REDIRECT);
    let (src, dst) = packet::endpoints_v6(&out);
    assert_eq!((src.0, dst), (node_ip(), (remote_pod(), 8080)));
    assert!((SNAT_PORTS.0..=SNAT_PORTS.1).contains(&src.1));
    assert_eq!(out[14 + 7], 63, "hop limit decremented");
    assert!(packet::checksums_valid_v6(&out));
    let (verdict, back) = lb.ingress(&packet::ipv6(packet::TCP, dst, src, packet::TCP_ACK, b""));
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!(packet::endpoints_v6(&back), ((node_ip(), 30080), (client(), 40000)));
    assert!(packet::checksums_valid_v6(&back));
    assert_eq!(lb.stat(lb_stat::SNAT_NEW_FLOW), 1);
}

/// A full-size packet of a north-south flow we route, on a path with a smaller MTU, is answered
/// with "packet too big" quoting it as the client sent it (before NAT).
#[test]
fn a_packet_too_big_for_the_route_is_answered_with_packet_too_big() {
    let lb = Lb::load("mtu");
    let route =
        ["-n", "krt-unit-v6-mtu", "route", "replace", "fd00:244:2::/64", "via", "fd00:100::2", "mtu", "lock", "1400"];
    assert!(std::process::Command::new("ip").args(route).status().unwrap().success());
    let flags = SVC_FLAG_EXTERNAL | SVC_FLAG_NODEPORT;
    lb.service(1, (node_ip(), 30080, packet::TCP), flags, &[(remote_pod(), 8080, false)]);
    lb.service(2, (node_ip(), 30053, packet::UDP), flags, &[(remote_pod(), 5353, false)]);
    for (sent, (proto, port, payload)) in
        [(packet::TCP, 30080, 1440), (packet::UDP, 30053, 1452)].into_iter().enumerate()
    {
        let (client, frontend) = ((client(), 40000), (node_ip(), port));
        assert_eq!(lb.ingress(&packet::ipv6(proto, client, frontend, packet::TCP_SYN, b"")).0, TC_ACT_REDIRECT);
        let full = packet::ipv6(proto, client, frontend, packet::TCP_ACK, &vec![7u8; payload]);
        assert_eq!(full.len(), 14 + 1500);
        let (verdict, out) = lb.ingress(&full);
        assert_eq!(verdict, TC_ACT_REDIRECT, "sent back out of the interface it came in on");
        assert_eq!(out.len(), 14 + 40 + 8 + 48);
        assert_eq!(&out[..6], &packet::SRC_MAC, "MACs swapped");
        assert_eq!(out[14 + 6], packet::ICMPV6);
        assert_eq!(&out[14 + 8..14 + 40], &[node_ip().octets(), client.0.octets()].concat()[..]);
        assert_eq!(&out[54..58], &[2, 0, out[56], out[57]], "packet too big");
        assert_eq!(&out[58..62], &1400u32.to_be_bytes(), "the route's MTU");
        assert_eq!(&out[62..], &full[14..14 + 48], "quotes the header and 8 bytes exactly as the client sent them");
        assert_eq!(packet::quoted_endpoints_v6(&out), (client, frontend));
        assert!(packet::checksums_valid_v6(&out));
        assert_eq!(lb.stat(lb_stat::FRAG_NEEDED_SENT), sent as u64 + 1);
    }
    assert_eq!(lb.stat(lb_stat::REDIRECT_FAILED), 0);
}

#[test]
fn a_service_without_endpoints_answers_with_a_reset_or_port_unreachable() {
    let lb = Lb::load("reject");
    lb.service(1, (vip(), 80, packet::TCP), 0, &[]);
    lb.service(2, (vip(), 53, packet::UDP), 0, &[]);
    let (verdict, rst) = lb.ingress(&packet::ipv6(packet::TCP, (client(), 40000), (vip(), 80), packet::TCP_SYN, b""));
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!(rst.len(), 14 + 40 + 20);
    assert_eq!(packet::endpoints_v6(&rst), ((vip(), 80), (client(), 40000)));
    assert_eq!(rst[14 + 40 + 13], packet::TCP_RST | packet::TCP_ACK);
    assert!(packet::checksums_valid_v6(&rst));
    let query = packet::ipv6(packet::UDP, (client(), 40001), (vip(), 53), 0, b"query");
    let (verdict, icmp) = lb.ingress(&query);
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!(icmp[14 + 6], packet::ICMPV6);
    assert_eq!(&icmp[14 + 40..14 + 42], &[1, 4], "destination unreachable, port unreachable");
    assert_eq!(&icmp[14 + 48..14 + 48 + 48], &query[14..14 + 48], "quotes the header and 8 bytes");
    assert!(packet::checksums_valid_v6(&icmp));
    assert_eq!(lb.stat(lb_stat::REJECT_SENT), 2);
}

#[test]
fn icmpv6_errors_and_fragments_of_translated_flows_are_translated() {
    let lb = Lb::load("icmp");
    lb.service(1, (vip(), 80, packet::TCP), 0, &[(remote_pod(), 8080, false)]);
    lb.service(2, (vip(), 53, packet::UDP), 0, &[(remote_pod(), 5353, false)]);
    let (_, sent) =
        lb.ingress(&packet::ipv6(packet::TCP, (local_pod(), 42000), (vip(), 80), packet::TCP_SYN, &[0; 32]));
    let error = packet::icmpv6_error(2, 0, ip("fd00:100::fe"), local_pod(), &sent);
    let (verdict, out) = lb.ingress(&error);
    assert_eq!(verdict, TC_ACT_UNSPEC);
    assert_eq!(packet::quoted_endpoints_v6(&out), ((local_pod(), 42000), (vip(), 80)), "packet too big, translated");
    assert!(packet::checksums_valid_v6(&out));

    let (_, sent) = lb.ingress(&packet::ipv6(packet::UDP, (local_pod(), 42001), (vip(), 53), 0, b"q"));
    assert_eq!(packet::endpoints_v6(&sent).1, (remote_pod(), 5353));
    let udp = packet::l4_segment_v6(packet::UDP, (remote_pod(), 5353), (local_pod(), 42001), 0, &[7u8; 2000]);
    let first = packet::ipv6_fragment(packet::UDP, remote_pod(), local_pod(), &udp, 0, 1448, 0x77);
    let second = packet::ipv6_fragment(packet::UDP, remote_pod(), local_pod(), &udp, 1448, udp.len() - 1448, 0x77);
    let (_, first_out) = lb.egress(&first);
    let (_, second_out) = lb.egress(&second);
    for out in [&first_out, &second_out] {
        assert_eq!(&out[14 + 8..14 + 24], &vip().octets(), "every fragment from the VIP");
    }
    // Reassembled, the UDP checksum (in the first fragment) verifies against the new addresses.
    let mut datagram = first_out[14 + 48..].to_vec();
    datagram.extend_from_slice(&second_out[14 + 48..]);
    let whole = packet::ipv6_frame(packet::UDP, vip(), local_pod(), &datagram);
    assert_eq!(packet::endpoints_v6(&whole), ((vip(), 53), (local_pod(), 42001)));
    assert!(packet::checksums_valid_v6(&whole));
    assert_eq!(lb.stat(lb_stat::FRAGMENT_NAT), 1);
    assert_eq!(lb.stat(lb_stat::ICMP_ERROR_NAT), 1);

    // Neighbour discovery passes untouched, whatever its addresses.
    let mut solicitation = vec![135, 0, 0, 0, 0, 0, 0, 0];
    solicitation.extend_from_slice(&vip().octets());
    let ns = packet::ipv6_frame(packet::ICMPV6, local_pod(), ip("ff02::1:ff00:10"), &solicitation);
    assert_eq!(lb.ingress(&ns), (TC_ACT_UNSPEC, ns.clone()));
    assert_eq!(lb.egress(&ns), (TC_ACT_UNSPEC, ns));
}

#[test]
fn pod_traffic_leaving_the_cluster_is_masqueraded() {
    let lb = Lb::load("egress");
    let mut nets: LpmTrie<MapData, Ipv6Words, u32> = LpmTrie::try_from(Map::LpmTrie(
        MapData::from_pin(kube_router::pinned::pinned_map(&lb.pin_dir, map_names::CLUSTER_NETS_V6)).unwrap(),
    ))
    .unwrap();
    // Every node's pod CIDR lies in fd00:244::/32.
    nets.insert(&Key::new(32, words(ip("fd00:244::"))), CLUSTER_NET_POD, 0).unwrap();
    let internet = ip("2001:db8::10");
    let (_, out) = lb.egress(&packet::ipv6(packet::TCP, (local_pod(), 40000), (internet, 443), packet::TCP_SYN, b""));
    let (src, dst) = packet::endpoints_v6(&out);
    assert_eq!((src.0, dst), (node_ip(), (internet, 443)));
    assert!(packet::checksums_valid_v6(&out));
    let (verdict, back) = lb.ingress(&packet::ipv6(packet::TCP, (internet, 443), src, packet::TCP_ACK, b""));
    assert_eq!(verdict, TC_ACT_UNSPEC);
    assert_eq!(packet::endpoints_v6(&back), ((internet, 443), (local_pod(), 40000)));
    assert!(packet::checksums_valid_v6(&back));

    let (_, out) = lb.egress(&packet::icmpv6_echo(128, local_pod(), internet, 0x42));
    let ((src, id), _) = packet::endpoints_v6(&out);
    assert_eq!(src, node_ip());
    assert!(packet::checksums_valid_v6(&out), "ICMPv6 checksum covers the new source");
    let (_, back) = lb.ingress(&packet::icmpv6_echo(129, internet, node_ip(), id));
    assert_eq!(packet::endpoints_v6(&back), ((internet, 0x42), (local_pod(), 0x42)));
    assert!(packet::checksums_valid_v6(&back));

    // Between pods: untouched.
    let inside = packet::ipv6(packet::UDP, (local_pod(), 5000), (remote_pod(), 53), 0, b"");
    assert_eq!(lb.egress(&inside).1, inside);
    assert_eq!(lb.stat(lb_stat::EGRESS_MASQUERADE_NEW_FLOW), 2);
}

fn external_ip() -> Ipv6Addr {
    ip("fd00:203::7")
}
fn other_node() -> Ipv6Addr {
    ip("fd00:100::2")
}
const IPV6_IN_IPV6: u8 = 41;

/// `inner` (a frame) in an IPv6 packet from `src` to `dst` with flow label `label`.
fn tunnelled_v6(src: Ipv6Addr, dst: Ipv6Addr, label: u32, inner: &[u8]) -> Vec<u8> {
    let mut frame = packet::ipv6_frame(IPV6_IN_IPV6, src, dst, &inner[14..]);
    frame[15] |= (label >> 16) as u8 & 0x0f;
    frame[16..18].copy_from_slice(&(label as u16).to_be_bytes());
    frame
}

/// The flow label of an IPv6 frame's (outer) header.
fn flow_label(frame: &[u8]) -> u32 {
    u32::from_be_bytes(frame[14..18].try_into().unwrap()) & 0x000f_ffff
}

/// An ExternalIP frontend with direct server return (TCP 80 -> 8080, UDP 53 -> 5353) over `backend`.
fn dsr_services(lb: &Lb, backend: Ipv6Addr, local: bool) {
    let flags = SVC_FLAG_EXTERNAL | SVC_FLAG_DSR;
    lb.service(1, (external_ip(), 80, packet::TCP), flags, &[(backend, 8080, local)]);
    lb.service(2, (external_ip(), 53, packet::UDP), flags, &[(backend, 5353, local)]);
}

#[test]
fn dsr_a_flow_to_a_backend_on_another_node_is_tunnelled_in_ipv6_untranslated() {
    let lb = Lb::load("dsr-encap");
    lb.cluster_nets();
    dsr_services(&lb, remote_pod(), false);
    for (proto, frontend, backend_port) in [(packet::TCP, 80, 8080u16), (packet::UDP, 53, 5353)] {
        for (n, flags) in [packet::TCP_SYN, packet::TCP_ACK].into_iter().enumerate() {
            let mut sent = packet::ipv6(proto, (client(), 40000 + n as u16), (external_ip(), frontend), flags, b"hi");
            // Traffic class 0xb8 (EF), flow label 0x12345: the class is copied out, the label not.
            sent[14..18].copy_from_slice(&(6u32 << 28 | 0xb8 << 20 | 0x12345).to_be_bytes());
            let (verdict, out) = lb.ingress(&sent);
            assert_eq!(verdict, TC_ACT_REDIRECT, "routed by the program");
            assert_eq!(out.len(), sent.len() + 40);
            let outer = &out[14..54];
            assert_eq!(outer[0] >> 4, 6);
            assert_eq!(u32::from_be_bytes(outer[0..4].try_into().unwrap()) >> 20 & 0xff, 0xb8, "traffic class");
            assert_eq!(flow_label(&out), u32::from(backend_port), "the backend port in the flow label");
            assert_eq!(
                usize::from(u16::from_be_bytes([outer[4], outer[5]])),
                sent.len() - 14,
                "payload: the inner packet"
            );
            assert_eq!((outer[6], outer[7]), (IPV6_IN_IPV6, 64), "next header, hop limit");
            assert_eq!(&outer[8..40], &[node_ip().octets(), remote_pod().octets()].concat()[..], "node -> backend");
            assert_eq!(&out[54..], &sent[14..], "the client's packet, untranslated (hop limit too)");
            assert!(packet::checksums_valid_v6(&out[40..]), "the inner checksum untouched");
        }
    }
    // Later packets of a flow follow its entry.
    let later = packet::ipv6(packet::TCP, (client(), 40000), (external_ip(), 80), packet::TCP_ACK, b"more");
    let (verdict, out) = lb.ingress(&later);
    assert_eq!((verdict, &out[54..]), (TC_ACT_REDIRECT, &later[14..]));
    assert_eq!(flow_label(&out), 8080);
    assert_eq!((lb.dsr_stat(dsr_stat::NEW_FLOW), lb.dsr_stat(dsr_stat::ENCAPSULATED)), (4, 5));
    assert_eq!(lb.stat(lb_stat::SNAT_NEW_FLOW), 0);

    // A frontend without the flag: source-NATed and routed as always.
    lb.service(3, (external_ip(), 81, packet::TCP), SVC_FLAG_EXTERNAL, &[(remote_pod(), 8080, false)]);
    let (verdict, out) =
        lb.ingress(&packet::ipv6(packet::TCP, (client(), 40100), (external_ip(), 81), packet::TCP_SYN, b""));
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!(out[14 + 6], packet::TCP, "not tunnelled");
    assert_eq!(packet::endpoints_v6(&out).0 .0, node_ip(), "source-NATed");
    assert_eq!(lb.dsr_stat(dsr_stat::NEW_FLOW), 4);
}

#[test]
fn dsr_a_packet_too_big_for_the_ipv6_tunnel_is_answered_with_the_mtu_less_the_outer_header() {
    let lb = Lb::load("dsr-mtu");
    lb.cluster_nets();
    let route = [
        "-n",
        "krt-unit-v6-dsr-mtu",
        "route",
        "replace",
        "fd00:244:2::/64",
        "via",
        "fd00:100::2",
        "mtu",
        "lock",
        "1400",
    ];
    assert!(std::process::Command::new("ip").args(route).status().unwrap().success());
    dsr_services(&lb, remote_pod(), false);
    let (client, frontend) = ((client(), 40000), (external_ip(), 80));
    assert_eq!(lb.ingress(&packet::ipv6(packet::TCP, client, frontend, packet::TCP_SYN, b"")).0, TC_ACT_REDIRECT);
    // 1,400 bytes: fits the route, not with the 40-byte outer header.
    let full = packet::ipv6(packet::TCP, client, frontend, packet::TCP_ACK, &vec![7u8; 1340]);
    assert_eq!(full.len(), 14 + 1400);
    let (verdict, out) = lb.ingress(&full);
    assert_eq!(verdict, TC_ACT_REDIRECT, "answered out of the interface it came in on");
    assert_eq!(out[14 + 6], packet::ICMPV6);
    assert_eq!(&out[14 + 8..14 + 40], &[external_ip().octets(), client.0.octets()].concat()[..], "from the frontend");
    assert_eq!(out[54], 2, "packet too big");
    assert_eq!(&out[58..62], &1360u32.to_be_bytes(), "the route's MTU less the outer header");
    assert_eq!(&out[62..], &full[14..14 + 48], "quoting the packet as the client sent it");
    assert!(packet::checksums_valid_v6(&out));
    assert_eq!(lb.dsr_stat(dsr_stat::FRAG_NEEDED_SENT), 1);
    // 1,360 bytes fit.
    let fits = packet::ipv6(packet::TCP, client, frontend, packet::TCP_ACK, &vec![7u8; 1300]);
    let (verdict, out) = lb.ingress(&fits);
    assert_eq!((verdict, out.len()), (TC_ACT_REDIRECT, fits.len() + 40));
    assert_eq!(lb.dsr_stat(dsr_stat::ENCAP_FAILED), 0);
}

#[test]
fn dsr_an_ipv6_tunnel_packet_is_delivered_to_the_backend_it_names_and_answered_from_the_frontend() {
    let lb = Lb::load("dsr-deliver");
    lb.cluster_nets();
    dsr_services(&lb, local_pod(), true);
    for (proto, frontend, backend_port) in [(packet::TCP, 80, 8080u16), (packet::UDP, 53, 5353)] {
        let client = (client(), 41000);
        let inner = packet::ipv6(proto, client, (external_ip(), frontend), packet::TCP_SYN, b"hi");
        let (verdict, out) = lb.ingress(&tunnelled_v6(other_node(), local_pod(), backend_port.into(), &inner));
        assert_eq!(verdict, TC_ACT_UNSPEC, "on to the stack, which routes it to the pod");
        assert_eq!(out.len(), inner.len(), "the outer header is gone");
        assert_eq!(&out[12..14], &[0x86, 0xdd]);
        assert_eq!(
            packet::endpoints_v6(&out),
            (client, (local_pod(), backend_port)),
            "translated to the named backend"
        );
        assert!(packet::checksums_valid_v6(&out));
        // A later packet: the same, from the entry.
        let again = packet::ipv6(proto, client, (external_ip(), frontend), packet::TCP_ACK, b"more");
        let (_, out) = lb.ingress(&tunnelled_v6(other_node(), local_pod(), backend_port.into(), &again));
        assert_eq!(packet::endpoints_v6(&out), (client, (local_pod(), backend_port)));
        // The pod's reply leaves as the frontend's, to the client itself.
        let reply = packet::ipv6(proto, (local_pod(), backend_port), client, packet::TCP_ACK, b"hello");
        assert_eq!(lb.ingress(&reply).0, TC_ACT_UNSPEC, "not translated where it enters");
        let (verdict, out) = lb.egress(&reply);
        assert_eq!(verdict, TC_ACT_UNSPEC);
        assert_eq!(packet::endpoints_v6(&out), ((external_ip(), frontend), client));
        assert!(packet::checksums_valid_v6(&out));
    }
    assert_eq!((lb.dsr_stat(dsr_stat::DECAPSULATED), lb.dsr_stat(dsr_stat::DELIVER_NEW_FLOW)), (4, 2));
    assert_eq!(lb.stat(lb_stat::CT_RESELECTED), 0);

    // Not from a node, not to a pod, or a label that is no port: not ours, untouched.
    let inner = packet::ipv6(packet::TCP, (client(), 41001), (external_ip(), 80), packet::TCP_SYN, b"");
    for (src, dst, label) in
        [(client(), local_pod(), 8080), (other_node(), node_ip(), 8080), (other_node(), local_pod(), 0x1_0000)]
    {
        let frame = tunnelled_v6(src, dst, label, &inner);
        assert_eq!(lb.ingress(&frame), (TC_ACT_UNSPEC, frame.clone()));
    }
    // From a node to a pod, but for no frontend here: dropped.
    let stray = packet::ipv6(packet::TCP, (client(), 41002), (ip("fd00:203::99"), 80), packet::TCP_SYN, b"");
    assert_eq!(lb.ingress(&tunnelled_v6(other_node(), local_pod(), 8080, &stray)).0, TC_ACT_SHOT);
    assert_eq!(lb.dsr_stat(dsr_stat::DECAP_REFUSED), 1);
    assert_eq!(lb.dsr_stat(dsr_stat::DECAPSULATED), 5);
}
