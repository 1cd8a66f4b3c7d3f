//! The load balancer's translations beyond plain DNAT, run in the kernel with BPF_PROG_TEST_RUN:
//! source NAT of north-south flows to another node and of hairpin flows (with the program routing
//! the packet itself), refusals for Services without endpoints, ICMP errors and fragments of
//! translated flows, and flows moving off a removed backend. Needs root.
//!
//! Packets that the program routes (FIB lookup + redirect) are run "arriving" on an interface of
//! a network namespace made for the test, so the lookup sees that namespace's routes.
use common::test_run::{packet, run_gso, TC_ACT_REDIRECT, TC_ACT_SHOT, TC_ACT_UNSPEC};
use std::net::Ipv4Addr;

use kube_router::pinned::conntrack_gc::monotonic_now_ns;
use kube_router::{
    bpf::datapath::Hook,
    services::{compile::addr_be, model::NodeContext},
};
use kube_router::{
    node::cluster_nets::sync_cluster_nets,
    services::maps::{conntrack::Conntrack, write_lb_config},
};
use kube_router_common::{
    lb_stat, CtKeyV4, CtValueV4, LbConfig, CT_FLAG_CLOSING, CT_FLAG_SEEN_REPLY, CT_FLAG_UNTRANSLATED,
    CT_LIFETIME_CLOSING_SECS, CT_LIFETIME_NON_TCP_SECS, CT_LIFETIME_UNREPLIED_SECS, LB_CONFIG_POD_EGRESS,
};

mod common;
use common::{load_node, program_services, ttl, Loaded, CLIENT, EXTERNAL_IP, LOCAL_POD, NODE_IP, REMOTE_POD, VIP};

const SNAT_PORTS: (u16, u16) = (20_000, 20_003);

/// A Service `web`: ClusterIP VIP:80/TCP and :53/UDP, NodePort 30080/TCP and 30053/UDP, an
/// ExternalIP, over the given endpoints (address, node).
fn service_yaml(endpoints: &[(Ipv4Addr, &str)], annotations: &str) -> String {
    let endpoints: String = endpoints
        .iter()
        .map(|(addr, node)| format!("- addresses: [\"{addr}\"]\n  nodeName: {node}\n  conditions: {{ready: true}}\n"))
        .collect();
    let endpoints = if endpoints.is_empty() { " []\n".to_string() } else { format!("\n{endpoints}") };
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{namespace: default, name: web{annotations}}}\nspec:\n  type: NodePort\n  clusterIP: {VIP}\n  externalIPs: [{EXTERNAL_IP}]\n  ports:\n  - {{name: http, protocol: TCP, port: 80, nodePort: 30080}}\n  - {{name: dns, protocol: UDP, port: 53, nodePort: 30053}}\n---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  namespace: default\n  name: web-1\n  labels: {{kubernetes.io/service-name: web}}\naddressType: IPv4\n\
         ports:\n- {{name: http, protocol: TCP, port: 8080}}\n- {{name: dns, protocol: UDP, port: 5353}}\nendpoints:{endpoints}"
    )
}

fn node_context() -> NodeContext {
    NodeContext {
        name: "node-a".into(),
        node_port_addrs: vec![NODE_IP.into()],
        hairpin_all: true,
        ..Default::default()
    }
}

fn program(pin_dir: &std::path::Path, yaml: &str) {
    program_services(pin_dir, yaml, &node_context());
}

fn load(test: &str, yaml: &str) -> Loaded {
    load_named(&format!("krt-unit-nat-{test}"), yaml)
}

/// `load` with the network namespace and pin directory named `name`.
fn load_named(name: &str, yaml: &str) -> Loaded {
    let config = LbConfig {
        snat_addr: addr_be(NODE_IP),
        snat_port_min: SNAT_PORTS.0,
        snat_port_max: SNAT_PORTS.1,
        ..Default::default()
    };
    load_node(name, &[], yaml, &node_context(), &config)
}

#[test]
fn north_south_to_another_node_is_source_natted_and_routed_both_ways() {
    let lb = load("ns", &service_yaml(&[(REMOTE_POD, "node-b")], ""));
    for (proto, node_port, backend_port) in [(packet::TCP, 30080, 8080), (packet::UDP, 30053, 5353)] {
        let syn = packet::ipv4(proto, (CLIENT, 40000), (NODE_IP, node_port), packet::TCP_SYN, b"hi");
        let (verdict, out) = lb.ingress(&syn);
        assert_eq!(verdict, TC_ACT_REDIRECT, "routed by the program (its new source is a node address)");
        let (src, dst) = packet::endpoints(&out);
        assert_eq!(dst, (REMOTE_POD, backend_port));
        assert_eq!(src.0, NODE_IP, "source-NATed to this node");
        assert!((SNAT_PORTS.0..=SNAT_PORTS.1).contains(&src.1), "port {} from the SNAT range", src.1);
        assert_eq!(ttl(&out), 63, "forwarded like a router: TTL decremented");
        assert!(packet::checksums_valid(&out));

        // The backend's reply comes back to the node's address and leaves as the NodePort's.
        let reply = packet::ipv4(proto, dst, src, packet::TCP_ACK, b"hello");
        let (verdict, back) = lb.ingress(&reply);
        assert_eq!(verdict, TC_ACT_REDIRECT);
        assert_eq!(packet::endpoints(&back), ((NODE_IP, node_port), (CLIENT, 40000)));
        assert!(packet::checksums_valid(&back));
        // Later packets of the flow keep port and backend.
        let (_, again) = lb.ingress(&packet::ipv4(proto, (CLIENT, 40000), (NODE_IP, node_port), packet::TCP_ACK, b"x"));
        assert_eq!(packet::endpoints(&again), (src, dst));
    }
    // An ExternalIP is not a node address: the reply goes back through the stack untouched by
    // routing, only translated.
    let syn = packet::ipv4(packet::TCP, (CLIENT, 40001), (EXTERNAL_IP, 80), packet::TCP_SYN, b"");
    let (verdict, out) = lb.ingress(&syn);
    assert_eq!(verdict, TC_ACT_REDIRECT);
    let (src, dst) = packet::endpoints(&out);
    assert_eq!((src.0, dst), (NODE_IP, (REMOTE_POD, 8080)));
    let (verdict, back) = lb.ingress(&packet::ipv4(packet::TCP, dst, src, packet::TCP_ACK, b""));
    assert_eq!(verdict, TC_ACT_UNSPEC);
    assert_eq!(packet::endpoints(&back), ((EXTERNAL_IP, 80), (CLIENT, 40001)));
    assert_eq!(lb.lb_stat(lb_stat::SNAT_NEW_FLOW), 3);
    // Every packet of the NodePort flows both ways, and the ExternalIP flow's first packet.
    assert_eq!(lb.lb_stat(lb_stat::REDIRECTED), 7);

    // A ClusterIP flow from a pod keeps the pod's address (no source NAT for east-west).
    let (verdict, out) = lb.ingress(&packet::ipv4(packet::TCP, (LOCAL_POD, 41000), (VIP, 80), packet::TCP_SYN, b""));
    assert_eq!(verdict, TC_ACT_UNSPEC);
    assert_eq!(packet::endpoints(&out), ((LOCAL_POD, 41000), (REMOTE_POD, 8080)));
}

/// An upload arrives as GSO packets (the client's TSO, this node's GRO) longer than the route's
/// MTU: routed when its segments fit, as the kernel forwards them (they were all dropped).
#[test]
fn merged_segments_are_routed_by_their_segment_size() {
    let lb = load("gso", &service_yaml(&[(REMOTE_POD, "node-b")], ""));
    let fd = lb.datapath.program_fd(Hook::Ingress).unwrap();
    let client = (CLIENT, 40000);
    let syn = packet::ipv4(packet::TCP, client, (NODE_IP, 30080), packet::TCP_SYN, b"");
    assert_eq!(lb.ingress(&syn).0, TC_ACT_REDIRECT);
    // Two 1,448-byte segments in one 2,936-byte packet: each 1,488 bytes on a 1,500-byte link.
    let merged = packet::ipv4(packet::TCP, client, (NODE_IP, 30080), packet::TCP_ACK, &[7u8; 2 * 1448]);
    let out = run_gso(fd, &merged, lb.ifindex, (2, 1448)).unwrap();
    assert_eq!(out.retval, TC_ACT_REDIRECT, "a GSO packet whose segments fit is routed");
    assert_eq!(packet::endpoints(&out.packet).1, (REMOTE_POD, 8080));
    // Segments that do not fit, and the same length unmerged, are not: the client is told the MTU.
    let big = packet::ipv4(packet::TCP, client, (NODE_IP, 30080), packet::TCP_ACK, &[7u8; 2 * 1500]);
    let out = run_gso(fd, &big, lb.ifindex, (2, 1500)).unwrap();
    assert_eq!((out.retval, frag_needed_mtu(&out.packet)), (TC_ACT_REDIRECT, Some(1500)));
    let (verdict, out) = lb.ingress(&merged);
    assert_eq!((verdict, frag_needed_mtu(&out)), (TC_ACT_REDIRECT, Some(1500)));
    assert_eq!(lb.lb_stat(lb_stat::FRAG_NEEDED_SENT), 2);
    assert_eq!(lb.lb_stat(lb_stat::REDIRECT_FAILED), 0);
}

/// The next-hop MTU of an ICMP "fragmentation needed" (3/4) frame, `None` for anything else.
fn frag_needed_mtu(frame: &[u8]) -> Option<u16> {
    (frame.len() >= 42 && frame[14 + 9] == packet::ICMP && frame[34..36] == [3, 4])
        .then(|| u16::from_be_bytes([frame[40], frame[41]]))
}

/// A full-size packet of a north-south flow we route, on a path with a smaller MTU (a tunnel,
/// an overlay), is answered with "fragmentation needed" quoting it as the client sent it (before
/// NAT), as the kernel's forwarding does; it was dropped silently (a PMTU black hole).
#[test]
fn a_packet_too_big_for_the_route_is_answered_with_fragmentation_needed() {
    let lb = load("mtu", &service_yaml(&[(REMOTE_POD, "node-b")], ""));
    // Locked: forwarding honours a route's MTU only then (or with ip_forward_use_pmtu).
    let route =
        ["-n", "krt-unit-nat-mtu", "route", "replace", "10.244.2.0/24", "via", "10.100.0.2", "mtu", "lock", "1400"];
    assert!(std::process::Command::new("ip").args(route).status().unwrap().success());
    let cases = [
        (packet::TCP, (CLIENT, 40000), (NODE_IP, 30080), 1460, 0x4000),
        (packet::UDP, (CLIENT, 40001), (NODE_IP, 30053), 1472, 0x4000),
        // The frontend, not the node address the flow is source-NATed to, is quoted.
        (packet::TCP, (CLIENT, 40002), (EXTERNAL_IP, 80), 1460, 0x4000),
        // Without DF the kernel would fragment; TC cannot, so the sender is told too.
        (packet::UDP, (CLIENT, 40003), (NODE_IP, 30053), 1472, 0),
    ];
    let mut translated = Vec::new();
    for (sent, (proto, client, frontend, payload, df)) in cases.into_iter().enumerate() {
        // The flow's first packet fits (and creates it); a full-size one (1,500 bytes) does not.
        let first = packet::ipv4(proto, client, frontend, packet::TCP_SYN, b"");
        let (verdict, out) = lb.ingress(&first);
        assert_eq!(verdict, TC_ACT_REDIRECT);
        translated.push(packet::endpoints(&out));
        let l4 = packet::l4_segment(proto, client, frontend, packet::TCP_ACK, &vec![7u8; payload]);
        let full = packet::ipv4_frame(proto, client.0, frontend.0, df, &l4);
        let (verdict, out) = lb.ingress(&full);
        assert_eq!(verdict, TC_ACT_REDIRECT, "sent back out of the interface it came in on");
        assert_eq!(out.len(), 14 + 20 + 8 + 28);
        assert_eq!(&out[..6], &packet::SRC_MAC, "MACs swapped");
        assert_eq!(frag_needed_mtu(&out), Some(1400), "destination unreachable, fragmentation needed, MTU 1400");
        assert_eq!(&out[14 + 12..14 + 20], &[frontend.0.octets(), client.0.octets()].concat()[..]);
        assert_eq!(&out[42..], &full[14..14 + 28], "quotes the header and 8 bytes exactly as the client sent them");
        assert_eq!(packet::quoted_endpoints(&out), (client, frontend));
        assert!(packet::icmp_checksums_valid(&out));
        assert_eq!(lb.lb_stat(lb_stat::FRAG_NEEDED_SENT), sent as u64 + 1);
    }
    // The other way: the backend's full-size reply to the NodePort flow, routed by us towards the
    // client over a smaller path, is answered to the backend, quoted as the backend sent it.
    let route = [
        "-n",
        "krt-unit-nat-mtu",
        "route",
        "replace",
        "192.168.100.0/24",
        "via",
        "10.100.0.254",
        "mtu",
        "lock",
        "1280",
    ];
    assert!(std::process::Command::new("ip").args(route).status().unwrap().success());
    let (node_side, backend) = translated[0];
    let reply = packet::ipv4(packet::TCP, backend, node_side, packet::TCP_ACK, &[7u8; 1460]);
    let (verdict, out) = lb.ingress(&reply);
    assert_eq!((verdict, frag_needed_mtu(&out)), (TC_ACT_REDIRECT, Some(1280)));
    assert_eq!(&out[14 + 12..14 + 20], &[NODE_IP.octets(), REMOTE_POD.octets()].concat()[..]);
    assert_eq!(&out[42..], &reply[14..14 + 28]);
    assert!(packet::icmp_checksums_valid(&out));
    assert_eq!(lb.lb_stat(lb_stat::FRAG_NEEDED_SENT), 5);
    assert_eq!(lb.lb_stat(lb_stat::REDIRECT_FAILED), 0);
    // What fits the route still goes: 1,400 bytes.
    let l4 = packet::l4_segment(packet::TCP, (CLIENT, 40000), (NODE_IP, 30080), packet::TCP_ACK, &[7u8; 1360]);
    let (verdict, out) = lb.ingress(&packet::ipv4_frame(packet::TCP, CLIENT, NODE_IP, 0x4000, &l4));
    assert_eq!((verdict, packet::endpoints(&out).1), (TC_ACT_REDIRECT, (REMOTE_POD, 8080)));
}

#[test]
fn local_backends_and_traffic_policy_local_keep_the_client_address() {
    let lb = load("local", &service_yaml(&[(LOCAL_POD, "node-a")], ""));
    let (verdict, out) =
        lb.ingress(&packet::ipv4(packet::TCP, (CLIENT, 40000), (NODE_IP, 30080), packet::TCP_SYN, b""));
    assert_eq!(verdict, TC_ACT_UNSPEC);
    assert_eq!(packet::endpoints(&out), ((CLIENT, 40000), (LOCAL_POD, 8080)));

    let local_policy = service_yaml(&[(REMOTE_POD, "node-b"), (LOCAL_POD, "node-a")], "")
        .replace("  type: NodePort\n", "  type: NodePort\n  externalTrafficPolicy: Local\n");
    program(&lb.pin_dir, &local_policy);
    for port in 40100..40120 {
        let (verdict, out) =
            lb.ingress(&packet::ipv4(packet::TCP, (CLIENT, port), (NODE_IP, 30080), packet::TCP_SYN, b""));
        assert_eq!(verdict, TC_ACT_UNSPEC);
        assert_eq!(packet::endpoints(&out), ((CLIENT, port), (LOCAL_POD, 8080)), "only the local endpoint");
    }
    assert_eq!(lb.lb_stat(lb_stat::SNAT_NEW_FLOW), 0);
}

#[test]
fn a_backend_reaching_itself_through_its_service_is_answered_from_the_vip() {
    let lb = load("hairpin", &service_yaml(&[(LOCAL_POD, "node-a")], ""));
    let (verdict, out) = lb.ingress(&packet::ipv4(packet::TCP, (LOCAL_POD, 45000), (VIP, 80), packet::TCP_SYN, b""));
    assert_eq!(verdict, TC_ACT_UNSPEC, "the VIP is not a node address: the stack routes it");
    let (src, dst) = packet::endpoints(&out);
    assert_eq!(dst, (LOCAL_POD, 8080));
    assert_eq!(src.0, VIP, "seen from the VIP, not from itself");
    assert!(packet::checksums_valid(&out));
    let (verdict, back) = lb.ingress(&packet::ipv4(packet::TCP, dst, src, packet::TCP_ACK, b""));
    assert_eq!(verdict, TC_ACT_UNSPEC);
    assert_eq!(packet::endpoints(&back), ((VIP, 80), (LOCAL_POD, 45000)));

    // Through the NodePort the new source is a node address: routed by the program.
    let (verdict, out) =
        lb.ingress(&packet::ipv4(packet::TCP, (LOCAL_POD, 45001), (NODE_IP, 30080), packet::TCP_SYN, b""));
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!(packet::endpoints(&out).0 .0, NODE_IP);

    // Without hairpin (flag and annotation off) the packet is only DNATed.
    let node = NodeContext { hairpin_all: false, ..node_context() };
    program_services(&lb.pin_dir, &service_yaml(&[(LOCAL_POD, "node-a")], ""), &node);
    let (_, out) = lb.ingress(&packet::ipv4(packet::TCP, (LOCAL_POD, 45002), (VIP, 80), packet::TCP_SYN, b""));
    assert_eq!(packet::endpoints(&out), ((LOCAL_POD, 45002), (LOCAL_POD, 8080)));
}

#[test]
fn snat_ports_run_out_new_flows_are_refused_and_existing_ones_kept() {
    let lb = load("exhaust", &service_yaml(&[(REMOTE_POD, "node-b")], ""));
    let range = usize::from(SNAT_PORTS.1 - SNAT_PORTS.0) + 1;
    let mut flows = Vec::new();
    let mut refused = 0;
    // Probing is random: try until every port of the tiny range is taken.
    for client_port in 0..64u16 {
        let syn = packet::ipv4(packet::TCP, (CLIENT, 50000 + client_port), (NODE_IP, 30080), packet::TCP_SYN, b"");
        match lb.ingress(&syn) {
            (TC_ACT_REDIRECT, out) => flows.push((50000 + client_port, packet::endpoints(&out).0 .1)),
            (TC_ACT_SHOT, _) => refused += 1,
            other => panic!("unexpected verdict {}", other.0),
        }
    }
    assert_eq!(flows.len(), range, "exactly one flow per port: {flows:?}");
    let mut ports: Vec<u16> = flows.iter().map(|f| f.1).collect();
    ports.sort_unstable();
    ports.dedup();
    assert_eq!(ports.len(), range, "no port given twice");
    assert_eq!(lb.lb_stat(lb_stat::SNAT_PORTS_EXHAUSTED), refused);
    for (client_port, snat_port) in flows {
        let (verdict, out) =
            lb.ingress(&packet::ipv4(packet::TCP, (CLIENT, client_port), (NODE_IP, 30080), packet::TCP_ACK, b""));
        assert_eq!(verdict, TC_ACT_REDIRECT);
        assert_eq!(packet::endpoints(&out).0, (NODE_IP, snat_port), "established flows untouched");
    }
}

/// `ct_v4` opened for writing: the tests age entries as time would.
fn conntrack_map(pin_dir: &std::path::Path) -> aya::maps::HashMap<aya::maps::MapData, CtKeyV4, CtValueV4> {
    let data = aya::maps::MapData::from_pin(kube_router::pinned::pinned_map(pin_dir, "ct_v4")).unwrap();
    aya::maps::HashMap::try_from(aya::maps::Map::LruHashMap(data)).unwrap()
}

/// One NodePort flow from `CLIENT:client_port` to REMOTE_POD, as the program recorded it.
struct Flow {
    client_port: u16,
    snat_port: u16,
}

impl Flow {
    fn forward_key(&self, proto: u8, node_port: u16) -> CtKeyV4 {
        packet::ct_key_v4(proto, (CLIENT, self.client_port), (NODE_IP, node_port))
    }
    fn reverse_key(&self, proto: u8, backend_port: u16) -> CtKeyV4 {
        packet::ct_key_v4(proto, (REMOTE_POD, backend_port), (NODE_IP, self.snat_port))
    }
}

/// Opens new NodePort flows from client ports `from..` until one is refused; the flows opened.
fn open_until_refused(lb: &Loaded, proto: u8, node_port: u16, from: u16) -> Vec<Flow> {
    let mut flows = Vec::new();
    for client_port in from..from + 64 {
        let syn = packet::ipv4(proto, (CLIENT, client_port), (NODE_IP, node_port), packet::TCP_SYN, b"");
        match lb.ingress(&syn) {
            (TC_ACT_REDIRECT, out) => flows.push(Flow { client_port, snat_port: packet::endpoints(&out).0 .1 }),
            (TC_ACT_SHOT, _) => return flows,
            other => panic!("unexpected verdict {}", other.0),
        }
    }
    panic!("never refused after {} flows", flows.len())
}

/// Sets the entry's last packet `idle_secs` ago, and marks it closing if asked.
fn age(
    ct: &mut aya::maps::HashMap<aya::maps::MapData, CtKeyV4, CtValueV4>,
    key: &CtKeyV4,
    idle_secs: u64,
    closing: bool,
) {
    let mut value = ct.get(key, 0).expect("the entry exists");
    value.last_seen_ns = monotonic_now_ns() - idle_secs * 1_000_000_000;
    if closing {
        value.flags |= CT_FLAG_CLOSING;
    }
    ct.insert(key, value, 0).unwrap();
}

/// Every entry's opposite entry exists and points back at it: no entry translates to a port
/// that another flow now holds.
fn assert_pairs_consistent(ct: &aya::maps::HashMap<aya::maps::MapData, CtKeyV4, CtValueV4>) {
    let entries: std::collections::HashMap<CtKeyV4, CtValueV4> = ct.iter().map(Result::unwrap).collect();
    for (key, value) in &entries {
        let opposite = value.reverse_key(key.proto);
        let back = entries.get(&opposite).unwrap_or_else(|| panic!("{key:?} has no opposite entry"));
        assert_eq!(back.reverse_key(key.proto), *key, "{key:?} and {opposite:?} are not one flow's");
    }
}

/// At a high rate of new flows, closed and expired flows hold their SNAT ports until the agent's
/// conntrack GC runs; a new flow takes such a port (and removes both entries of the old flow)
/// instead of being refused. Ports of live flows are never taken.
#[test]
fn a_new_flow_takes_the_snat_port_of_an_expired_flow_never_a_live_ones() {
    let lb = load_named("krt-perf-nat-reclaim", &service_yaml(&[(REMOTE_POD, "node-b")], ""));
    let mut ct = conntrack_map(&lb.pin_dir);
    let range = usize::from(SNAT_PORTS.1 - SNAT_PORTS.0) + 1;
    let (tcp, udp) = ((packet::TCP, 30080, 8080), (packet::UDP, 30053, 5353));

    // The whole range held by flows that are over: closed ones (either side's FIN or RST, idle
    // past the closing lifetime) and, for UDP, idle past its lifetime.
    let closed = open_until_refused(&lb, tcp.0, tcp.1, 50000);
    assert_eq!(closed.len(), range);
    let refused = lb.lb_stat(lb_stat::SNAT_PORTS_EXHAUSTED);
    for (i, flow) in closed.iter().enumerate() {
        // Alternately the client's and the backend's side saw the FIN / RST.
        let (closing_forward, closing_reverse) = (i % 2 == 0, i % 2 == 1);
        age(&mut ct, &flow.forward_key(tcp.0, tcp.1), CT_LIFETIME_CLOSING_SECS + 1, closing_forward);
        age(&mut ct, &flow.reverse_key(tcp.0, tcp.2), CT_LIFETIME_CLOSING_SECS + 1, closing_reverse);
    }
    let silent = open_until_refused(&lb, udp.0, udp.1, 50000);
    assert_eq!(silent.len(), range);
    for flow in &silent {
        age(&mut ct, &flow.forward_key(udp.0, udp.1), CT_LIFETIME_NON_TCP_SECS + 1, false);
        age(&mut ct, &flow.reverse_key(udp.0, udp.2), CT_LIFETIME_NON_TCP_SECS + 1, false);
    }
    let refused = refused + 1; // the UDP fill's last attempt
    assert_eq!(lb.lb_stat(lb_stat::SNAT_PORTS_EXHAUSTED), refused);

    // New flows get every one of those ports, and nothing is refused.
    for (proto, node_port, _) in [tcp, udp] {
        let new = open_until_refused(&lb, proto, node_port, 51000);
        let mut ports: Vec<u16> = new.iter().map(|f| f.snat_port).collect();
        ports.sort_unstable();
        ports.dedup();
        assert_eq!(ports.len(), range, "every port of the expired flows given again, once");
    }
    // Only the attempt after each range filled up again is refused.
    assert_eq!(lb.lb_stat(lb_stat::SNAT_PORTS_EXHAUSTED), refused + 2);
    // The old flows' entries went with their ports: 2 entries for each new flow only.
    for flow in &closed {
        assert!(ct.get(&flow.forward_key(tcp.0, tcp.1), 0).is_err(), "old forward entry removed");
    }
    assert_eq!(ct.keys().count(), 2 * 2 * range);
    assert_pairs_consistent(&ct);

    // Live flows keep their ports: idle but within the TCP lifetime, closed on one side but
    // still sending on the other, or just open. The TCP flows opened above hold the range.
    let holders: Vec<(CtKeyV4, CtValueV4)> = ct.iter().map(Result::unwrap).filter(|(k, _)| k.proto == tcp.0).collect();
    let reverse_keys: Vec<CtKeyV4> =
        holders.iter().filter(|(k, _)| k.src_addr == addr_be(REMOTE_POD)).map(|(k, _)| *k).collect();
    assert_eq!(reverse_keys.len(), range);
    for (i, reverse) in reverse_keys.iter().enumerate() {
        let forward = ct.get(reverse, 0).unwrap().reverse_key(tcp.0);
        match i % 3 {
            // Idle 11 s, not closed: TCP lives 6 hours.
            0 => {
                age(&mut ct, &forward, CT_LIFETIME_CLOSING_SECS + 1, false);
                age(&mut ct, reverse, CT_LIFETIME_CLOSING_SECS + 1, false);
            }
            // The backend closed long ago; the client is still sending.
            1 => {
                age(&mut ct, reverse, CT_LIFETIME_CLOSING_SECS + 1, true);
                age(&mut ct, &forward, 0, false);
            }
            // Just open.
            _ => {}
        }
    }
    let before: std::collections::HashMap<CtKeyV4, CtValueV4> = ct.iter().map(Result::unwrap).collect();
    let refused = lb.lb_stat(lb_stat::SNAT_PORTS_EXHAUSTED);
    assert!(open_until_refused(&lb, tcp.0, tcp.1, 53000).is_empty(), "no live flow's port taken");
    assert_eq!(lb.lb_stat(lb_stat::SNAT_PORTS_EXHAUSTED), refused + 1);
    let after: std::collections::HashMap<CtKeyV4, CtValueV4> = ct.iter().map(Result::unwrap).collect();
    assert_eq!(after, before, "live flows' entries untouched");
}

#[test]
fn a_service_without_endpoints_answers_with_a_reset_or_port_unreachable() {
    let lb = load("reject", &service_yaml(&[], ""));
    let syn = packet::ipv4(packet::TCP, (CLIENT, 40000), (VIP, 80), packet::TCP_SYN, b"");
    let (verdict, rst) = lb.ingress(&syn);
    assert_eq!(verdict, TC_ACT_REDIRECT, "sent back out of the interface it came in on");
    assert_eq!(rst.len(), 14 + 20 + 20);
    assert_eq!(&rst[..6], &packet::SRC_MAC, "MACs swapped");
    assert_eq!(packet::endpoints(&rst), ((VIP, 80), (CLIENT, 40000)));
    let tcp = &rst[34..];
    assert_eq!(tcp[13], packet::TCP_RST | packet::TCP_ACK);
    assert_eq!(u32::from_be_bytes(tcp[8..12].try_into().unwrap()), 2, "acknowledges the SYN (seq 1)");
    assert!(packet::checksums_valid(&rst));

    let query = packet::ipv4(packet::UDP, (CLIENT, 40001), (VIP, 53), 0, b"query");
    let (verdict, icmp) = lb.ingress(&query);
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!(&icmp[14 + 12..14 + 20], &[VIP.octets(), CLIENT.octets()].concat()[..]);
    assert_eq!(icmp[14 + 9], packet::ICMP);
    assert_eq!(&icmp[34..36], &[3, 3], "destination unreachable, port unreachable");
    assert_eq!(&icmp[42..42 + 28], &query[14..14 + 28], "quotes the datagram's header and 8 bytes");
    assert!(packet::icmp_checksums_valid(&icmp));
    assert_eq!(lb.lb_stat(lb_stat::REJECT_SENT), 2);

    // A RST is never answered.
    let (verdict, _) = lb.ingress(&packet::ipv4(packet::TCP, (CLIENT, 40002), (VIP, 80), packet::TCP_RST, b""));
    assert_eq!(verdict, TC_ACT_SHOT);
}

#[test]
fn icmp_errors_about_translated_flows_are_translated_back() {
    let lb = load("icmp", &service_yaml(&[(REMOTE_POD, "node-b")], ""));
    let router = Ipv4Addr::new(10, 100, 0, 254);
    // Client pod -> ClusterIP, DNATed to the backend; a router on the way cannot forward it.
    let request = packet::ipv4(packet::TCP, (LOCAL_POD, 42000), (VIP, 80), packet::TCP_SYN, &[0u8; 64]);
    let (_, sent) = lb.ingress(&request);
    let error = packet::icmp_error(3, 4, router, LOCAL_POD, &sent);
    let (verdict, out) = lb.ingress(&error);
    assert_eq!(verdict, TC_ACT_UNSPEC);
    assert_eq!(packet::quoted_endpoints(&out), ((LOCAL_POD, 42000), (VIP, 80)), "quotes what the pod sent");
    assert_eq!(packet::endpoints(&out).1 .0, LOCAL_POD);
    assert!(packet::icmp_checksums_valid(&out));
    // Also when it reaches the pod through egress (the node itself sent the error).
    let (_, out) = lb.egress(&packet::icmp_error(3, 4, NODE_IP, LOCAL_POD, &sent));
    assert_eq!(packet::quoted_endpoints(&out), ((LOCAL_POD, 42000), (VIP, 80)));
    assert!(packet::icmp_checksums_valid(&out));

    // North-south, source-NATed: the error comes back to the node and goes on to the client.
    let (_, sent) = lb.ingress(&packet::ipv4(packet::TCP, (CLIENT, 43000), (NODE_IP, 30080), packet::TCP_SYN, b""));
    let (snat_src, _) = packet::endpoints(&sent);
    let (verdict, out) = lb.ingress(&packet::icmp_error(3, 4, router, snat_src.0, &sent));
    assert_eq!(verdict, TC_ACT_UNSPEC);
    assert_eq!(packet::endpoints(&out).1 .0, CLIENT, "sent on to the client");
    assert_eq!(packet::quoted_endpoints(&out), ((CLIENT, 43000), (NODE_IP, 30080)));
    assert!(packet::icmp_checksums_valid(&out));

    // The reply direction: the backend's reply (after reverse NAT) did not fit somewhere on the
    // way to the client; the error, addressed to the VIP, must reach the backend.
    let reply = packet::ipv4(packet::TCP, (REMOTE_POD, 8080), (LOCAL_POD, 42000), packet::TCP_ACK, b"");
    let (_, replied) = lb.egress(&reply);
    assert_eq!(packet::endpoints(&replied).0, (VIP, 80));
    let (_, out) = lb.ingress(&packet::icmp_error(3, 4, router, VIP, &replied));
    assert_eq!(packet::endpoints(&out).1 .0, REMOTE_POD);
    assert_eq!(packet::quoted_endpoints(&out), ((REMOTE_POD, 8080), (LOCAL_POD, 42000)));
    assert!(packet::icmp_checksums_valid(&out));
    assert_eq!(lb.lb_stat(lb_stat::ICMP_ERROR_NAT), 4);

    // Errors about flows we never saw pass untouched.
    let stranger = packet::ipv4(packet::UDP, (LOCAL_POD, 1), (Ipv4Addr::new(8, 8, 8, 8), 53), 0, b"");
    let unrelated = packet::icmp_error(3, 3, router, LOCAL_POD, &stranger);
    assert_eq!(lb.ingress(&unrelated).1, unrelated);
}

#[test]
fn fragments_of_a_translated_datagram_are_translated_with_the_first_ones_ports() {
    let lb = load("frag", &service_yaml(&[(REMOTE_POD, "node-b")], ""));
    let (_, sent) = lb.ingress(&packet::ipv4(packet::UDP, (LOCAL_POD, 42000), (VIP, 53), 0, b"q"));
    assert_eq!(packet::endpoints(&sent).1, (REMOTE_POD, 5353));
    // A 2,000-byte reply in two fragments: the UDP header (and checksum) in the first only.
    let udp = packet::l4_segment(packet::UDP, (REMOTE_POD, 5353), (LOCAL_POD, 42000), 0, &[7u8; 2000]);
    let first = packet::ipv4_frame(packet::UDP, REMOTE_POD, LOCAL_POD, 0x2000, &udp[..1480]);
    let second = packet::ipv4_frame(packet::UDP, REMOTE_POD, LOCAL_POD, 1480 / 8, &udp[1480..]);
    let (_, first_out) = lb.egress(&first);
    assert_eq!(packet::endpoints(&first_out).0, (VIP, 53));
    let (verdict, second_out) = lb.egress(&second);
    assert_eq!(verdict, TC_ACT_UNSPEC);
    assert_eq!(&second_out[14 + 12..14 + 16], &VIP.octets(), "later fragment from the VIP too");
    assert!(packet::ip_header_valid(&second_out[14..]));
    assert_eq!(&second_out[34..], &second[34..], "its payload untouched");
    // Reassembled, the datagram's UDP checksum (carried by the first fragment) still verifies.
    let mut whole = first_out.clone();
    whole.extend_from_slice(&second_out[34..]);
    let total = (whole.len() - 14) as u16;
    whole[16..18].copy_from_slice(&total.to_be_bytes());
    whole[20..22].copy_from_slice(&[0, 0]);
    whole[24..26].copy_from_slice(&[0, 0]);
    let mut sum: u32 = whole[14..34].chunks(2).map(|c| u32::from(u16::from_be_bytes([c[0], c[1]]))).sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    whole[24..26].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    assert!(packet::checksums_valid(&whole), "UDP checksum over the reassembled datagram");
    assert_eq!(lb.lb_stat(lb_stat::FRAGMENT_NAT), 1);

    // A later fragment whose first fragment never passed: untouched, counted.
    let mut orphan = second.clone();
    orphan[18..20].copy_from_slice(&[0x99, 0x99]); // another datagram id
    let (verdict, _) = lb.egress(&orphan);
    assert_eq!(verdict, TC_ACT_UNSPEC);
    assert_eq!(lb.lb_stat(lb_stat::FRAGMENT_PASS), 1);
}

#[test]
fn flows_leave_a_removed_backend_unless_established_tcp() {
    let other = Ipv4Addr::new(10, 244, 3, 7);
    let lb = load("moved", &service_yaml(&[(REMOTE_POD, "node-b"), (other, "node-c")], ""));
    // Find a UDP flow, an answered TCP flow and an unanswered TCP flow on REMOTE_POD.
    let on_remote = |proto: u8, vport: u16, from: u16| -> u16 {
        (from..from + 1000)
            .find(|port| {
                let (_, out) = lb.ingress(&packet::ipv4(proto, (LOCAL_POD, *port), (VIP, vport), packet::TCP_SYN, b""));
                packet::endpoints(&out).1 .0 == REMOTE_POD
            })
            .expect("some flow lands on REMOTE_POD")
    };
    let udp = on_remote(packet::UDP, 53, 30000);
    let answered = on_remote(packet::TCP, 80, 31000);
    let unanswered = on_remote(packet::TCP, 80, 32000);
    let (_, _) = lb.egress(&packet::ipv4(packet::TCP, (REMOTE_POD, 8080), (LOCAL_POD, answered), packet::TCP_ACK, b""));
    let ct = Conntrack::open_pinned(&lb.pin_dir).unwrap();
    let seen = ct.entries().unwrap().iter().filter(|(_, v)| v.flags & CT_FLAG_SEEN_REPLY != 0).count();
    assert_eq!(seen, 2, "both entries of the answered flow are marked");

    program(&lb.pin_dir, &service_yaml(&[(other, "node-c")], ""));
    let (_, out) = lb.ingress(&packet::ipv4(packet::UDP, (LOCAL_POD, udp), (VIP, 53), 0, b""));
    assert_eq!(packet::endpoints(&out).1 .0, other, "UDP moves to a remaining backend");
    let (_, out) = lb.ingress(&packet::ipv4(packet::TCP, (LOCAL_POD, unanswered), (VIP, 80), packet::TCP_SYN, b""));
    assert_eq!(packet::endpoints(&out).1 .0, other, "an unanswered TCP flow moves too");
    let (_, out) = lb.ingress(&packet::ipv4(packet::TCP, (LOCAL_POD, answered), (VIP, 80), packet::TCP_ACK, b""));
    assert_eq!(packet::endpoints(&out).1 .0, REMOTE_POD, "an established TCP flow stays");
    assert_eq!(lb.lb_stat(lb_stat::CT_RESELECTED), 2);
}

/// Turns pod egress masquerade on, with pods in 10.244.0.0/16 and Services in 10.96.0.0/12;
/// returns how many cluster prefixes were written.
fn enable_pod_egress(lb: &Loaded) -> usize {
    let config = LbConfig {
        snat_addr: addr_be(NODE_IP),
        snat_port_min: SNAT_PORTS.0,
        snat_port_max: SNAT_PORTS.1,
        flags: LB_CONFIG_POD_EGRESS,
        ..Default::default()
    };
    write_lb_config(&lb.pin_dir, &config).unwrap();
    let nets = kube_router::node::egress::cluster_nets(
        &[],
        &["10.244.0.0/16".parse().unwrap()],
        &["10.96.0.0/12".parse().unwrap()],
    );
    sync_cluster_nets(&lb.pin_dir, &nets).unwrap()
}

#[test]
fn pod_traffic_leaving_the_cluster_is_masqueraded_and_its_replies_restored() {
    let lb = load("egress", &service_yaml(&[(REMOTE_POD, "node-b")], ""));
    assert_eq!(enable_pod_egress(&lb), 2);
    assert_eq!(enable_pod_egress(&lb), 0, "only differences are written");
    let internet = Ipv4Addr::new(203, 0, 113, 10);

    // Judged at the pod's interface untranslated (ingress leaves it alone), masqueraded as it leaves.
    let syn = packet::ipv4(packet::TCP, (LOCAL_POD, 40000), (internet, 80), packet::TCP_SYN, b"");
    let (verdict, at_pod) = lb.ingress(&syn);
    assert_eq!((verdict, &at_pod), (TC_ACT_UNSPEC, &syn));
    let (verdict, out) = lb.egress(&syn);
    assert_eq!(verdict, TC_ACT_UNSPEC);
    let (src, dst) = packet::endpoints(&out);
    assert_eq!((src.0, dst), (NODE_IP, (internet, 80)));
    assert!((SNAT_PORTS.0..=SNAT_PORTS.1).contains(&src.1));
    assert!(packet::checksums_valid(&out));
    assert_eq!(lb.ingress(&syn).1, syn, "still untouched at the pod's interface once tracked");
    let (verdict, back) = lb.ingress(&packet::ipv4(packet::TCP, (internet, 80), src, packet::TCP_ACK, b"ok"));
    assert_eq!(verdict, TC_ACT_UNSPEC, "the pod is not a node address: the stack routes it");
    assert_eq!(packet::endpoints(&back), ((internet, 80), (LOCAL_POD, 40000)));
    assert!(packet::checksums_valid(&back));

    // Ping: the identifier is translated like a port.
    let ping = packet::icmp_echo(8, LOCAL_POD, internet, 0x77);
    let (_, out) = lb.egress(&ping);
    let (src, dst, id, valid) = packet::echo_of(&out);
    assert!(
        valid && src == NODE_IP && dst == internet && (SNAT_PORTS.0..=SNAT_PORTS.1).contains(&id),
        "{src} {dst} {id}"
    );
    let (_, back) = lb.ingress(&packet::icmp_echo(0, internet, NODE_IP, id));
    assert_eq!(packet::echo_of(&back), (internet, LOCAL_POD, 0x77, true));

    // Inside the cluster, and traffic that is not a pod's, keep their addresses.
    for (from, to) in [(LOCAL_POD, REMOTE_POD), (LOCAL_POD, NODE_IP), (LOCAL_POD, VIP), (NODE_IP, internet)] {
        let packet = packet::ipv4(packet::UDP, (from, 5000), (to, 53), 0, b"");
        assert_eq!(lb.egress(&packet).1, packet, "{from} -> {to}");
    }
    assert_eq!(lb.lb_stat(lb_stat::EGRESS_MASQUERADE_NEW_FLOW), 2);
}

/// Keeps the calling thread on the CPU it runs on: per-CPU state that one program run leaves
/// for the next (TC ingress's note of what it forwarded, read by TC egress) is then seen.
fn stay_on_this_cpu() {
    // SAFETY: a zeroed cpu_set_t with one bit set, applied to the calling thread.
    unsafe {
        let cpu = libc::sched_getcpu();
        assert!(cpu >= 0);
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu as usize, &mut set);
        assert_eq!(libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set), 0);
    }
}

/// TC ingress's note of a tuple it found no entry for outlives its packet. A client port that a
/// direct connection to a backend used is free again for a connection to a Service (another
/// peer), whose backend may be that same backend: the new flow's replies then have the tuple the
/// note names. Ingress finds their entry, so egress must not skip its lookup on the old note, or
/// the client gets the backend's own address back and answers the reply with a reset (seen as
/// connections timing out through an IPv6 ClusterIP in dual_stack's outage test).
#[test]
fn a_reply_is_translated_when_its_tuple_was_noted_without_an_entry_before_the_flow() {
    let lb = load("stale-note", &service_yaml(&[(REMOTE_POD, "node-b")], ""));
    stay_on_this_cpu();
    let reply = |flags| packet::ipv4(packet::TCP, (REMOTE_POD, 8080), (LOCAL_POD, 41000), flags, b"");
    // The direct connection's last packet from the backend: no Service, no entry, noted.
    let direct = reply(packet::TCP_ACK);
    assert_eq!(lb.ingress(&direct), (TC_ACT_UNSPEC, direct.clone()));
    // The same client port towards the ClusterIP, balanced to the same backend.
    let syn = packet::ipv4(packet::TCP, (LOCAL_POD, 41000), (VIP, 80), packet::TCP_SYN, b"");
    let (verdict, out) = lb.ingress(&syn);
    assert_eq!(verdict, TC_ACT_UNSPEC);
    assert_eq!(packet::endpoints(&out).1, (REMOTE_POD, 8080));
    // Its SYN-ACK: ingress finds the reverse entry, egress restores the ClusterIP.
    let syn_ack = reply(packet::TCP_SYN | packet::TCP_ACK);
    assert_eq!(lb.ingress(&syn_ack), (TC_ACT_UNSPEC, syn_ack.clone()));
    let (verdict, out) = lb.egress(&syn_ack);
    assert_eq!(verdict, TC_ACT_UNSPEC);
    assert_eq!(packet::endpoints(&out), ((VIP, 80), (LOCAL_POD, 41000)), "reply restored to the ClusterIP");
}

/// A TCP connection from the local pod's `port` to the ClusterIP, balanced to the remote pod:
/// its SYN, the backend's SYN-ACK, and the keys of its two conntrack entries.
struct ClusterIpFlow {
    syn: Vec<u8>,
    syn_ack: Vec<u8>,
    forward: CtKeyV4,
    reverse: CtKeyV4,
}

impl ClusterIpFlow {
    fn from_port(port: u16) -> Self {
        Self {
            syn: packet::ipv4(packet::TCP, (LOCAL_POD, port), (VIP, 80), packet::TCP_SYN, b""),
            syn_ack: packet::ipv4(
                packet::TCP,
                (REMOTE_POD, 8080),
                (LOCAL_POD, port),
                packet::TCP_SYN | packet::TCP_ACK,
                b"",
            ),
            forward: packet::ct_key_v4(packet::TCP, (LOCAL_POD, port), (VIP, 80)),
            reverse: packet::ct_key_v4(packet::TCP, (REMOTE_POD, 8080), (LOCAL_POD, port)),
        }
    }
}

/// The agent's conntrack GC walks the table, then removes what the walk found expired. A client
/// reusing its port meanwhile (a new connection on the tuple of a closed flow not yet collected)
/// gets its flow's entries written in place of the expired ones, and the removals must leave
/// them: removed by key, the reverse entry of the new flow went (its replies left untranslated,
/// answered by the client with a reset), and when its forward entry survived, every later SYN
/// from that port was translated again towards replies nothing restored (TCP exchanges through
/// a ClusterIP timing out in the service_datapath bench's TC rows).
#[test]
fn a_flow_opened_on_a_reused_tuple_between_the_gcs_walk_and_its_removals_keeps_its_entries() {
    let lb = load("gc-reuse", &service_yaml(&[(REMOTE_POD, "node-b")], ""));
    stay_on_this_cpu();
    let mut ct = conntrack_map(&lb.pin_dir);
    let ClusterIpFlow { syn, syn_ack, forward, reverse } = ClusterIpFlow::from_port(41000);
    // The first connection from port 41000, closed and idle past the closing lifetime.
    let (_, out) = lb.ingress(&syn);
    assert_eq!(packet::endpoints(&out).1, (REMOTE_POD, 8080));
    for key in [&forward, &reverse] {
        age(&mut ct, key, CT_LIFETIME_CLOSING_SECS + 1, true);
    }
    let mut gc = Conntrack::open_pinned(&lb.pin_dir).unwrap();
    let now = monotonic_now_ns();
    let (_, walked) = gc.expired_keys_at(now).unwrap();
    assert_eq!(walked.len(), 2, "the walk finds the closed flow's two entries");

    // Between the walk and the removals the client reuses the port: the datapath finds the
    // entries expired and writes the new flow's in their place.
    let new_flows = lb.lb_stat(lb_stat::NEW_FLOW);
    let (verdict, out) = lb.ingress(&syn);
    assert_eq!(verdict, TC_ACT_UNSPEC);
    assert_eq!(packet::endpoints(&out).1, (REMOTE_POD, 8080));
    assert_eq!(lb.lb_stat(lb_stat::NEW_FLOW), new_flows + 1, "a new flow on the expired tuple");

    assert_eq!(gc.remove_expired_at(&walked, now).unwrap(), 0, "nothing the walk saw is expired now");
    assert!(ct.get(&forward, 0).is_ok() && ct.get(&reverse, 0).is_ok(), "the new flow keeps both entries");
    assert_pairs_consistent(&ct);
    // Its SYN-ACK is restored to the ClusterIP.
    assert_eq!(lb.ingress(&syn_ack), (TC_ACT_UNSPEC, syn_ack.clone()));
    let (verdict, out) = lb.egress(&syn_ack);
    assert_eq!(verdict, TC_ACT_UNSPEC);
    assert_eq!(packet::endpoints(&out), ((VIP, 80), (LOCAL_POD, 41000)), "reply restored to the ClusterIP");

    // Once that flow is over too, the GC removes it as before.
    for key in [&forward, &reverse] {
        age(&mut ct, key, CT_LIFETIME_CLOSING_SECS + 1, true);
    }
    let (_, removed) = gc.collect_garbage_at(monotonic_now_ns()).unwrap();
    assert_eq!(removed, 2);
    assert_eq!(ct.keys().count(), 0);
}

/// A flow nothing has answered yet whose reverse entry is gone (evicted by the LRU from a full
/// table, or removed): the client's retried SYN opens it again with both entries, so its SYN-ACK
/// is restored to the ClusterIP. Translated by the lone forward entry, every retry's SYN-ACK
/// left untranslated and was reset by the client, for as long as the retries kept that entry.
/// An answered flow's forward entry is used as it is.
#[test]
fn a_retried_syn_whose_flow_lost_its_reverse_entry_opens_the_flow_again() {
    let lb = load("lost-reverse", &service_yaml(&[(REMOTE_POD, "node-b")], ""));
    stay_on_this_cpu();
    let mut ct = conntrack_map(&lb.pin_dir);
    let ClusterIpFlow { syn, syn_ack, forward, reverse } = ClusterIpFlow::from_port(41000);
    lb.ingress(&syn);
    ct.remove(&reverse).unwrap();
    let reselected = lb.lb_stat(lb_stat::CT_RESELECTED);
    let (verdict, out) = lb.ingress(&syn);
    assert_eq!(verdict, TC_ACT_UNSPEC);
    assert_eq!(packet::endpoints(&out).1, (REMOTE_POD, 8080));
    assert_eq!(lb.lb_stat(lb_stat::CT_RESELECTED), reselected + 1, "opened again");
    assert!(ct.get(&forward, 0).is_ok() && ct.get(&reverse, 0).is_ok(), "with both entries");
    assert_pairs_consistent(&ct);
    assert_eq!(lb.ingress(&syn_ack), (TC_ACT_UNSPEC, syn_ack.clone()));
    let (_, out) = lb.egress(&syn_ack);
    assert_eq!(packet::endpoints(&out), ((VIP, 80), (LOCAL_POD, 41000)), "SYN-ACK restored to the ClusterIP");

    // Answered (the backend's ACK passed), then its reverse entry lost: a segment of the
    // connection is translated as before, nothing opened again.
    let ack = packet::ipv4(packet::TCP, (REMOTE_POD, 8080), (LOCAL_POD, 41000), packet::TCP_ACK, b"x");
    lb.ingress(&ack);
    lb.egress(&ack);
    assert_eq!(ct.get(&forward, 0).unwrap().flags & CT_FLAG_SEEN_REPLY, CT_FLAG_SEEN_REPLY);
    ct.remove(&reverse).unwrap();
    let data = packet::ipv4(packet::TCP, (LOCAL_POD, 41000), (VIP, 80), packet::TCP_ACK, b"y");
    let (_, out) = lb.ingress(&data);
    assert_eq!(packet::endpoints(&out).1, (REMOTE_POD, 8080));
    assert_eq!(lb.lb_stat(lb_stat::CT_RESELECTED), reselected + 1);
}

/// A Service whose endpoint is outside the cluster (a Service without a selector, its
/// EndpointSlice naming an external database): a pod's packets to it are DNATed at TC ingress and
/// then masqueraded at TC egress, every one of them on the port its flow got first. TC egress
/// skips its conntrack lookup for packets TC ingress just translated, but not for these.
#[test]
fn a_pods_flow_to_a_backend_outside_the_cluster_is_masqueraded_on_every_packet() {
    let database = Ipv4Addr::new(203, 0, 113, 20);
    let lb = load("external-endpoint", &service_yaml(&[(database, "node-x")], ""));
    enable_pod_egress(&lb);
    stay_on_this_cpu();

    let mut source = None;
    for flags in [packet::TCP_SYN, packet::TCP_ACK, packet::TCP_ACK] {
        let (verdict, translated) =
            lb.ingress(&packet::ipv4(packet::TCP, (LOCAL_POD, 41000), (VIP, 80), flags, b"query"));
        assert_eq!(verdict, TC_ACT_UNSPEC);
        assert_eq!(packet::endpoints(&translated), ((LOCAL_POD, 41000), (database, 8080)));
        let (verdict, out) = lb.egress(&translated);
        assert_eq!(verdict, TC_ACT_UNSPEC);
        let (src, dst) = packet::endpoints(&out);
        assert_eq!((src.0, dst), (NODE_IP, (database, 8080)), "masqueraded (TCP flags {flags:#x})");
        assert_eq!(*source.get_or_insert(src), src, "on the port the flow got first");
        assert!(packet::checksums_valid(&out));
    }
    assert_eq!(lb.lb_stat(lb_stat::EGRESS_MASQUERADE_NEW_FLOW), 1);
    assert_eq!(lb.lb_stat(lb_stat::EGRESS_MASQUERADE), 2);

    // A pod's flow to an in-cluster backend is left alone at egress, as before.
    program(&lb.pin_dir, &service_yaml(&[(REMOTE_POD, "node-b")], ""));
    for flags in [packet::TCP_SYN, packet::TCP_ACK] {
        let (_, translated) = lb.ingress(&packet::ipv4(packet::TCP, (LOCAL_POD, 42000), (VIP, 80), flags, b""));
        assert_eq!(packet::endpoints(&translated).1, (REMOTE_POD, 8080));
        assert_eq!(lb.egress(&translated), (TC_ACT_UNSPEC, translated));
    }
    assert_eq!(lb.lb_stat(lb_stat::EGRESS_MASQUERADE_NEW_FLOW), 1);
}

/// TC ingress notes the tuple of a packet it found no entry for (no Service, no flow), so that
/// TC egress skips its own lookup of that tuple. Pod egress masquerade still applies: a pod's
/// flow to the internet is masqueraded on every packet, on the port it got first, and pod to pod
/// traffic keeps its addresses.
#[test]
fn a_pods_flow_to_the_internet_is_masqueraded_after_ingress_found_no_entry() {
    let lb = load("ingress-found-nothing", &service_yaml(&[(REMOTE_POD, "node-b")], ""));
    enable_pod_egress(&lb);
    stay_on_this_cpu();
    let internet = Ipv4Addr::new(198, 51, 100, 7);

    let mut source = None;
    for flags in [packet::TCP_SYN, packet::TCP_ACK, packet::TCP_ACK] {
        let sent = packet::ipv4(packet::TCP, (LOCAL_POD, 43000), (internet, 443), flags, b"");
        assert_eq!(lb.ingress(&sent), (TC_ACT_UNSPEC, sent.clone()), "not service traffic");
        let (verdict, out) = lb.egress(&sent);
        assert_eq!(verdict, TC_ACT_UNSPEC);
        let (src, dst) = packet::endpoints(&out);
        assert_eq!((src.0, dst), (NODE_IP, (internet, 443)), "masqueraded (TCP flags {flags:#x})");
        assert_eq!(*source.get_or_insert(src), src, "on the port the flow got first");
    }
    assert_eq!(lb.lb_stat(lb_stat::EGRESS_MASQUERADE_NEW_FLOW), 1);
    assert_eq!(lb.lb_stat(lb_stat::EGRESS_MASQUERADE), 2);

    let pod_to_pod = packet::ipv4(packet::UDP, (LOCAL_POD, 5000), (REMOTE_POD, 53), 0, b"");
    assert_eq!(lb.ingress(&pod_to_pod), (TC_ACT_UNSPEC, pod_to_pod.clone()));
    assert_eq!(lb.egress(&pod_to_pod), (TC_ACT_UNSPEC, pod_to_pod));
    assert_eq!(lb.lb_stat(lb_stat::EGRESS_MASQUERADE_NEW_FLOW), 1);
}

/// Defect "an outside client cannot reach a pod by its own IP": with pod egress masquerade on, a
/// client outside the cluster (pod CIDRs routed to the node) opens TCP, UDP and ping flows to a
/// pod's own address. Ingress records each as an untranslated pair of entries, so the pod's
/// replies leave from the pod's address, not masqueraded to the node's. Guards:
/// `opened_from_outside_to_pod` + `create_untranslated` (UDP), `opens_flow` in `masquerade`
/// (TCP's SYN-ACK, the echo reply).
#[test]
fn an_outside_clients_flows_to_a_pods_own_address_are_answered_from_the_pod() {
    let lb = load("direct-to-pod", &service_yaml(&[(REMOTE_POD, "node-b")], ""));
    enable_pod_egress(&lb);
    stay_on_this_cpu();
    let outside = Ipv4Addr::new(198, 51, 100, 9);

    for (proto, opening, answer) in
        [(packet::TCP, packet::TCP_SYN, packet::TCP_SYN | packet::TCP_ACK), (packet::UDP, 0, 0)]
    {
        // Arrives at the node's uplink (TC ingress), leaves towards the pod (TC egress).
        let request = packet::ipv4(proto, (outside, 40001), (LOCAL_POD, 8080), opening, b"hello");
        assert_eq!(lb.ingress(&request), (TC_ACT_UNSPEC, request.clone()));
        assert_eq!(lb.egress(&request), (TC_ACT_UNSPEC, request.clone()));
        // The reply: from the pod's interface (TC ingress), out of the uplink (TC egress).
        for flags in [answer, packet::TCP_ACK] {
            let reply = packet::ipv4(proto, (LOCAL_POD, 8080), (outside, 40001), flags, b"hi");
            assert_eq!(lb.ingress(&reply), (TC_ACT_UNSPEC, reply.clone()), "proto {proto}");
            assert_eq!(lb.egress(&reply), (TC_ACT_UNSPEC, reply.clone()), "proto {proto}: not masqueraded");
        }
        let ct = conntrack_map(&lb.pin_dir);
        for key in [
            packet::ct_key_v4(proto, (outside, 40001), (LOCAL_POD, 8080)),
            packet::ct_key_v4(proto, (LOCAL_POD, 8080), (outside, 40001)),
        ] {
            let entry = ct.get(&key, 0).expect("the direct flow is recorded, both ways");
            assert_eq!(entry.flags & CT_FLAG_UNTRANSLATED, CT_FLAG_UNTRANSLATED);
            assert_eq!(entry.flags & CT_FLAG_SEEN_REPLY, CT_FLAG_SEEN_REPLY, "answered: the long lifetime");
        }
    }
    let ping = packet::icmp_echo(8, outside, LOCAL_POD, 0x42);
    assert_eq!(lb.ingress(&ping), (TC_ACT_UNSPEC, ping.clone()));
    let pong = packet::icmp_echo(0, LOCAL_POD, outside, 0x42);
    assert_eq!(lb.egress(&pong), (TC_ACT_UNSPEC, pong.clone()), "echo reply not masqueraded");
    assert_eq!(lb.lb_stat(lb_stat::EGRESS_MASQUERADE_NEW_FLOW), 0);

    // The pod's own new flows to the outside are still masqueraded.
    let syn = packet::ipv4(packet::TCP, (LOCAL_POD, 45000), (outside, 443), packet::TCP_SYN, b"");
    let (_, out) = lb.egress(&syn);
    assert_eq!(packet::endpoints(&out).0 .0, NODE_IP);
    let (_, out) = lb.egress(&packet::icmp_echo(8, LOCAL_POD, outside, 0x43));
    assert_eq!(packet::echo_of(&out).0, NODE_IP);
    assert_eq!(lb.lb_stat(lb_stat::EGRESS_MASQUERADE_NEW_FLOW), 2);
}

/// A pod's TCP segment that opens nothing (a SYN-ACK, an ACK, a FIN of a connection this node
/// has no entry for) never starts a masqueraded flow: it leaves untranslated and takes no SNAT
/// port, as iptables' MASQUERADE applies to NEW connections only. Guard: `opens_flow` in
/// `masquerade`.
#[test]
fn a_pods_tcp_segment_without_an_entry_that_is_no_syn_is_not_masqueraded() {
    let lb = load("reply-no-entry", &service_yaml(&[(REMOTE_POD, "node-b")], ""));
    enable_pod_egress(&lb);
    let outside = Ipv4Addr::new(198, 51, 100, 10);
    for flags in [packet::TCP_SYN | packet::TCP_ACK, packet::TCP_ACK, packet::TCP_RST] {
        let segment = packet::ipv4(packet::TCP, (LOCAL_POD, 8080), (outside, 40002), flags, b"");
        assert_eq!(lb.egress(&segment), (TC_ACT_UNSPEC, segment.clone()), "flags {flags:#x}");
    }
    assert_eq!(lb.lb_stat(lb_stat::EGRESS_MASQUERADE_NEW_FLOW), 0);
    assert_eq!(conntrack_map(&lb.pin_dir).keys().count(), 0, "no entry, no SNAT port taken");
    let syn = packet::ipv4(packet::TCP, (LOCAL_POD, 8081), (outside, 40002), packet::TCP_SYN, b"");
    assert_eq!(packet::endpoints(&lb.egress(&syn).1).0 .0, NODE_IP, "a SYN still opens one");
}

/// Defect "one client can exhaust conntrack and SNAT ports for hours": a TCP flow nothing has
/// answered (a SYN-ACK is no answer) lives CT_LIFETIME_UNREPLIED_SECS (60 s), not the 6 h of an
/// answered one, and the SNAT
/// port allocator takes its port back as soon as it has expired (no wait for the agent's GC).
/// Answered flows idle as long keep theirs. Guards: the unreplied rule of `CtValue::lifetime_ns`,
/// a SYN-ACK not counted as an answer (`conntrack::mark_seen_reply`).
#[test]
fn an_unanswered_flow_expires_after_the_unreplied_lifetime_and_frees_its_snat_port() {
    let lb = load("unanswered", &service_yaml(&[(REMOTE_POD, "node-b")], ""));
    let mut ct = conntrack_map(&lb.pin_dir);
    let range = usize::from(SNAT_PORTS.1 - SNAT_PORTS.0) + 1;
    let tcp = (packet::TCP, 30080, 8080);
    let flows = open_until_refused(&lb, tcp.0, tcp.1, 50000);
    assert_eq!(flows.len(), range);
    // The backend answers every SYN (as it does a flood of spoofed ones): a SYN-ACK alone does
    // not make a flow answered. Half the flows complete: the backend's next segment comes back.
    let answered: Vec<&Flow> = flows.iter().step_by(2).collect();
    for (i, flow) in flows.iter().enumerate() {
        let mut replies = vec![packet::TCP_SYN | packet::TCP_ACK];
        if i % 2 == 0 {
            replies.push(packet::TCP_ACK);
        }
        for flags in replies {
            let reply = packet::ipv4(tcp.0, (REMOTE_POD, tcp.2), (NODE_IP, flow.snat_port), flags, b"");
            let (_, back) = lb.ingress(&reply);
            assert_eq!(packet::endpoints(&back).1, (CLIENT, flow.client_port));
        }
    }
    // Everything idle just past the unreplied lifetime.
    for flow in &flows {
        age(&mut ct, &flow.forward_key(tcp.0, tcp.1), CT_LIFETIME_UNREPLIED_SECS + 1, false);
        age(&mut ct, &flow.reverse_key(tcp.0, tcp.2), CT_LIFETIME_UNREPLIED_SECS + 1, false);
    }
    let refused = lb.lb_stat(lb_stat::SNAT_PORTS_EXHAUSTED);
    let new = open_until_refused(&lb, tcp.0, tcp.1, 51000);
    let mut ports: Vec<u16> = new.iter().map(|f| f.snat_port).collect();
    ports.sort_unstable();
    let mut unanswered_ports: Vec<u16> = flows.iter().skip(1).step_by(2).map(|f| f.snat_port).collect();
    unanswered_ports.sort_unstable();
    assert_eq!(ports, unanswered_ports, "exactly the unanswered flows' ports are given again");
    assert_eq!(lb.lb_stat(lb_stat::SNAT_PORTS_EXHAUSTED), refused + 1);
    for flow in &answered {
        let entry = ct.get(&flow.forward_key(tcp.0, tcp.1), 0).expect("an answered flow stays");
        assert_eq!(entry.flags & CT_FLAG_SEEN_REPLY, CT_FLAG_SEEN_REPLY);
    }
    assert_pairs_consistent(&ct);
}

/// Issue 28: `--service-tcp-timeout`, `--service-tcpfin-timeout` and `--service-udp-timeout` set
/// the lifetimes of answered flows (`ct_cfg`). With short ones configured, a flow idle past its
/// configured lifetime (though well within the built-in one) is over: its next packet opens a
/// new flow (balanced again, a new SNAT port), while a flow idle less keeps its entries. The
/// agent's GC judges entries by the same lifetimes. Guards: `CtValue::lifetime_ns` reading
/// `ct_cfg` in the datapath, the closing lifetime of `conntrack::reclaim_stale`, and
/// `FamilyConntrack::collect_garbage_at`.
#[test]
fn configured_lifetimes_expire_flows_in_the_datapath_and_the_gc() {
    use kube_router::services::maps::conntrack::write_ct_lifetimes;
    use kube_router_common::CtLifetimes;
    let lb = load("lifetimes", &service_yaml(&[(REMOTE_POD, "node-b")], ""));
    let lifetimes = CtLifetimes { tcp_secs: 30, closing_secs: 3, udp_secs: 5, pad: 0 };
    write_ct_lifetimes(&lb.pin_dir, &lifetimes).unwrap();
    let mut ct = conntrack_map(&lb.pin_dir);
    let (tcp, udp) = ((packet::TCP, 30080, 8080), (packet::UDP, 30053, 5353));
    // Opens an answered flow (the backend's reply passed) and ages both its entries.
    let open = |lb: &Loaded, (proto, node_port, backend_port): (u8, u16, u16), client_port: u16| {
        let syn = packet::ipv4(proto, (CLIENT, client_port), (NODE_IP, node_port), packet::TCP_SYN, b"");
        let (verdict, out) = lb.ingress(&syn);
        assert_eq!(verdict, TC_ACT_REDIRECT);
        let flow = Flow { client_port, snat_port: packet::endpoints(&out).0 .1 };
        let reply = packet::ipv4(proto, (REMOTE_POD, backend_port), (NODE_IP, flow.snat_port), packet::TCP_ACK, b"");
        lb.ingress(&reply);
        flow
    };
    // (protocol, client port, idle seconds, closing, over): each idle past, or within, its
    // configured lifetime; every one of them within the built-in lifetime (6 h, 10 s, 60 s).
    let cases = [
        (udp, 40000, 6, false, true),
        (udp, 40001, 3, false, false),
        (tcp, 40000, 31, false, true),
        (tcp, 40001, 20, false, false),
        (tcp, 40002, 4, true, true),
    ];
    let flows: Vec<Flow> = cases.iter().map(|&(p, port, ..)| open(&lb, p, port)).collect();
    for (flow, &(p, _, idle, closing, _)) in flows.iter().zip(&cases) {
        let forward = ct.get(&flow.forward_key(p.0, p.1), 0).unwrap();
        assert_eq!(forward.flags & CT_FLAG_SEEN_REPLY, CT_FLAG_SEEN_REPLY, "answered");
        age(&mut ct, &flow.forward_key(p.0, p.1), idle, closing);
        age(&mut ct, &flow.reverse_key(p.0, p.2), idle, closing);
    }

    // The GC, at the same moment, removes exactly the flows that are over, and nothing else.
    // Its verdicts are checked on a copy of the entries, then the entries are put back so the
    // datapath judges the same ones.
    let before: Vec<(CtKeyV4, CtValueV4)> = ct.iter().map(Result::unwrap).collect();
    let (left, removed) = Conntrack::open_pinned(&lb.pin_dir).unwrap().collect_garbage_at(monotonic_now_ns()).unwrap();
    assert_eq!((left, removed), (4, 6), "the GC removes the three flows over their configured lifetime");
    for (flow, &(p, _, _, _, over)) in flows.iter().zip(&cases) {
        assert_eq!(ct.get(&flow.forward_key(p.0, p.1), 0).is_err(), over, "GC on {:?}", (p.0, flow.client_port));
    }
    for (key, value) in &before {
        ct.insert(key, value, 0).unwrap();
    }

    // The datapath: the next packet of each flow.
    let new_flows = lb.lb_stat(lb_stat::SNAT_NEW_FLOW);
    for (flow, &(p, _, _, _, over)) in flows.iter().zip(&cases) {
        let flags = if p.0 == packet::TCP && over { packet::TCP_SYN } else { packet::TCP_ACK };
        let next = packet::ipv4(p.0, (CLIENT, flow.client_port), (NODE_IP, p.1), flags, b"x");
        let (verdict, _) = lb.ingress(&next);
        assert_eq!(verdict, TC_ACT_REDIRECT);
        let entry = ct.get(&flow.forward_key(p.0, p.1), 0).expect("an entry for the flow");
        assert_eq!(
            entry.flags & CT_FLAG_SEEN_REPLY == 0,
            over,
            "{:?}: over means a new, unanswered flow; within, the answered one kept",
            (p.0, flow.client_port)
        );
    }
    assert_eq!(lb.lb_stat(lb_stat::SNAT_NEW_FLOW) - new_flows, 3, "the three flows over were balanced again");
    // The flows over left their reverse entries behind (the new flows took other ports): the GC
    // takes exactly those, and every flow left is a consistent pair.
    let (_, removed) = Conntrack::open_pinned(&lb.pin_dir).unwrap().collect_garbage_at(monotonic_now_ns()).unwrap();
    assert!(removed <= 3, "only the old flows' leftovers: {removed}");
    assert_pairs_consistent(&ct);
    assert_eq!(ct.keys().count(), 2 * cases.len());

    // All zero (what the agent writes without the flags) is the built-in lifetimes again: an
    // answered UDP flow idle 6 s lives on, in the datapath and the GC.
    write_ct_lifetimes(&lb.pin_dir, &CtLifetimes::default()).unwrap();
    let flow = open(&lb, udp, 40010);
    age(&mut ct, &flow.forward_key(udp.0, udp.1), 6, false);
    age(&mut ct, &flow.reverse_key(udp.0, udp.2), 6, false);
    let (_, removed) = Conntrack::open_pinned(&lb.pin_dir).unwrap().collect_garbage_at(monotonic_now_ns()).unwrap();
    assert_eq!(removed, 0);
    let new_flows = lb.lb_stat(lb_stat::SNAT_NEW_FLOW);
    lb.ingress(&packet::ipv4(udp.0, (CLIENT, 40010), (NODE_IP, udp.1), 0, b"x"));
    assert_eq!(lb.lb_stat(lb_stat::SNAT_NEW_FLOW), new_flows, "kept");
}
