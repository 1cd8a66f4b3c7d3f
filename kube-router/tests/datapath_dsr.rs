//! Direct server return (`kube-router.io/service.dsr: tunnel`) packet by packet, run in the
//! kernel with BPF_PROG_TEST_RUN: the node the client reached tunnels the untranslated packet to
//! the backend (outer header checked byte by byte), answers a packet too big for the tunnel with
//! the MTU less the outer header, tunnels a NodePort flow from outside the cluster and
//! source-NATs one from inside; the backend's node takes the tunnel apart, delivers the inner
//! packet to the backend the tunnel names (another node's NodePort through its own) and restores
//! the reply to the frontend. Needs root. (End to end: tests/tests/cluster_dsr.rs.)
use common::test_run::{packet, TC_ACT_REDIRECT, TC_ACT_SHOT, TC_ACT_UNSPEC};
use std::{collections::BTreeMap, net::Ipv4Addr};

use kube_router::node::cluster_nets::sync_cluster_nets;
use kube_router::pinned::counters::read_pinned_if_exists;
use kube_router::{
    bpf::datapath::Hook,
    services::{compile::addr_be, model::NodeContext},
};
use kube_router_common::{dsr_stat, lb_stat, map_names, LbConfig, CLUSTER_NET_NODE, CLUSTER_NET_POD};

mod common;
use common::{load_node, Loaded, CLIENT, EXTERNAL_IP, LOCAL_POD, NODE_IP, REMOTE_POD, VIP};

const IPIP: u8 = 4;
const OTHER_NODE: Ipv4Addr = Ipv4Addr::new(10, 100, 0, 2);
/// An address of this node's that serves NodePorts but is not in its Node object (no
/// `cluster_nets_v4` entry): another node would refuse a tunnel for it.
const UNLISTED_NODE_IP: Ipv4Addr = Ipv4Addr::new(10, 100, 9, 1);

/// Service `web` with DSR: ClusterIP VIP, NodePort 30080/30053, ExternalIP, TCP 80 -> 8080 and
/// UDP 53 -> 5353, over one endpoint.
fn service_yaml(endpoint: (Ipv4Addr, &str)) -> String {
    let (addr, node) = endpoint;
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{namespace: default, name: web, annotations: {{kube-router.io/service.dsr: tunnel}}}}\n\
         spec:\n  type: NodePort\n  clusterIP: {VIP}\n  externalIPs: [{EXTERNAL_IP}]\n  ports:\n  - {{name: http, protocol: TCP, port: 80, nodePort: 30080}}\n  - {{name: dns, protocol: UDP, port: 53, nodePort: 30053}}\n---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  namespace: default\n  name: web-1\n  labels: {{kubernetes.io/service-name: web}}\naddressType: IPv4\n\
         ports:\n- {{name: http, protocol: TCP, port: 8080}}\n- {{name: dns, protocol: UDP, port: 5353}}\nendpoints:\n- addresses: [\"{addr}\"]\n  nodeName: {node}\n  conditions: {{ready: true}}\n"
    )
}

/// This node (`node-a`, NODE_IP on `up0`, pods 10.244.1.0/24) with `endpoint` behind `web`.
fn load(test: &str, endpoint: (Ipv4Addr, &str)) -> Loaded {
    let node_context = NodeContext {
        name: "node-a".into(),
        node_port_addrs: vec![NODE_IP.into(), UNLISTED_NODE_IP.into()],
        ..Default::default()
    };
    let config = LbConfig { snat_addr: addr_be(NODE_IP), ..Default::default() };
    let lb = load_node(&format!("krt-dsr-unit-{test}"), &[], &service_yaml(endpoint), &node_context, &config);
    // As the agent writes them from the Node objects.
    let nets = BTreeMap::from([
        ("10.244.1.0/24".parse().unwrap(), CLUSTER_NET_POD),
        ("10.244.2.0/24".parse().unwrap(), CLUSTER_NET_POD),
        ("10.100.0.1/32".parse().unwrap(), CLUSTER_NET_NODE),
        ("10.100.0.2/32".parse().unwrap(), CLUSTER_NET_NODE),
    ]);
    sync_cluster_nets(&lb.pin_dir, &nets).unwrap();
    lb
}

impl Loaded {
    /// Direct server return's counter `index` (`dsr_stat`), summed over the CPUs.
    fn dsr_stat(&self, index: u32) -> u64 {
        read_pinned_if_exists(&self.pin_dir, map_names::DSR_STATS, dsr_stat::COUNT).unwrap().expect("dsr_stats")
            [index as usize]
    }
}

/// `inner` (a frame) in an IPIP packet from `src` to `dst` with DF and IP ID `id`.
fn tunnelled(src: Ipv4Addr, dst: Ipv4Addr, id: u16, inner: &[u8]) -> Vec<u8> {
    let mut frame = packet::ipv4_frame(IPIP, src, dst, 0x4000, &inner[14..]);
    frame[18..20].copy_from_slice(&id.to_be_bytes());
    frame[24..26].copy_from_slice(&[0, 0]);
    let sum = frame[14..34].chunks(2).map(|w| u32::from(u16::from_be_bytes([w[0], w[1]]))).sum::<u32>();
    let sum = (sum & 0xffff) + (sum >> 16);
    let sum = !(((sum & 0xffff) + (sum >> 16)) as u16);
    frame[24..26].copy_from_slice(&sum.to_be_bytes());
    frame
}

#[test]
fn a_flow_to_a_backend_on_another_node_is_tunnelled_untranslated() {
    let lb = load("encap", (REMOTE_POD, "node-b"));
    for (proto, frontend, backend_port) in [(packet::TCP, 80, 8080u16), (packet::UDP, 53, 5353)] {
        for (n, flags) in [packet::TCP_SYN, packet::TCP_ACK].into_iter().enumerate() {
            let sent = packet::ipv4(proto, (CLIENT, 40000 + n as u16), (EXTERNAL_IP, frontend), flags, b"hi");
            let (verdict, out) = lb.run(Hook::Ingress, &sent);
            assert_eq!(verdict, TC_ACT_REDIRECT, "routed by the program");
            assert_eq!(out.len(), sent.len() + 20);
            let outer = &out[14..34];
            assert!(packet::ip_header_valid(outer));
            assert_eq!(outer[9], IPIP);
            assert_eq!(&outer[12..20], &[NODE_IP.octets(), REMOTE_POD.octets()].concat()[..], "node -> backend");
            assert_eq!(u16::from_be_bytes([outer[4], outer[5]]), backend_port, "the backend port in the IP ID");
            assert_eq!(u16::from_be_bytes([outer[6], outer[7]]), 0x4000, "DF");
            assert_eq!(u16::from_be_bytes([outer[2], outer[3]]) as usize, sent.len() - 14 + 20);
            assert_eq!(&out[34..], &sent[14..], "the client's packet, untranslated");
        }
    }
    // Later packets of a flow follow its entry.
    let later = packet::ipv4(packet::TCP, (CLIENT, 40000), (EXTERNAL_IP, 80), packet::TCP_ACK, b"more");
    let (verdict, out) = lb.run(Hook::Ingress, &later);
    assert_eq!((verdict, &out[34..]), (TC_ACT_REDIRECT, &later[14..]));
    assert_eq!((lb.dsr_stat(dsr_stat::NEW_FLOW), lb.dsr_stat(dsr_stat::ENCAPSULATED)), (4, 5));
    assert_eq!(lb.lb_stat(lb_stat::SNAT_NEW_FLOW), 0);

    // The NodePort, from outside the cluster: tunnelled too, the node's address as it was.
    for (proto, node_port, backend_port) in [(packet::TCP, 30080, 8080u16), (packet::UDP, 30053, 5353)] {
        let sent = packet::ipv4(proto, (CLIENT, 40100), (NODE_IP, node_port), packet::TCP_SYN, b"np");
        let (verdict, out) = lb.run(Hook::Ingress, &sent);
        assert_eq!(verdict, TC_ACT_REDIRECT);
        assert_eq!(out[14 + 9], IPIP, "tunnelled");
        assert_eq!(&out[26..34], &[NODE_IP.octets(), REMOTE_POD.octets()].concat()[..], "node -> backend");
        assert_eq!(u16::from_be_bytes([out[18], out[19]]), backend_port, "the backend port in the IP ID");
        assert_eq!(&out[34..], &sent[14..], "the client's packet, untranslated");
    }
    assert_eq!(lb.dsr_stat(dsr_stat::NEW_FLOW), 6);
    // From a pod or a node of the cluster (a reply from this node's own address would not reach
    // them), or to a node address the other nodes do not know: source-NATed as always.
    let not_tunnelled = [(LOCAL_POD, NODE_IP), (OTHER_NODE, NODE_IP), (CLIENT, UNLISTED_NODE_IP)];
    for (n, (client, node_ip)) in not_tunnelled.into_iter().enumerate() {
        let client = (client, 40102 + n as u16);
        let (verdict, out) =
            lb.run(Hook::Ingress, &packet::ipv4(packet::TCP, client, (node_ip, 30080), packet::TCP_SYN, b""));
        assert_eq!(verdict, TC_ACT_REDIRECT, "{client:?} -> {node_ip}");
        assert_eq!(out[14 + 9], packet::TCP, "{client:?} -> {node_ip}: not tunnelled");
        assert_eq!(packet::endpoints(&out).0 .0, NODE_IP, "source-NATed");
        assert_eq!(packet::endpoints(&out).1, (REMOTE_POD, 8080));
    }
    assert_eq!(lb.lb_stat(lb_stat::SNAT_NEW_FLOW), 3);
    // The ClusterIP of the same Service: translated as always.
    let (_, out) =
        lb.run(Hook::Ingress, &packet::ipv4(packet::TCP, (LOCAL_POD, 40101), (VIP, 80), packet::TCP_SYN, b""));
    assert_eq!(packet::endpoints(&out), ((LOCAL_POD, 40101), (REMOTE_POD, 8080)));
    assert_eq!(lb.dsr_stat(dsr_stat::NEW_FLOW), 6);
}

#[test]
fn a_packet_too_big_for_the_tunnel_is_answered_with_the_mtu_less_the_outer_header() {
    let lb = load("mtu", (REMOTE_POD, "node-b"));
    let client = (CLIENT, 40000);
    let (verdict, _) =
        lb.run(Hook::Ingress, &packet::ipv4(packet::TCP, client, (EXTERNAL_IP, 80), packet::TCP_SYN, b""));
    assert_eq!(verdict, TC_ACT_REDIRECT);
    // 1,500 bytes: 1,520 with the outer header, over the 1,500-byte link.
    let l4 = packet::l4_segment(packet::TCP, client, (EXTERNAL_IP, 80), packet::TCP_ACK, &[7u8; 1460]);
    let full = packet::ipv4_frame(packet::TCP, CLIENT, EXTERNAL_IP, 0x4000, &l4);
    let (verdict, out) = lb.run(Hook::Ingress, &full);
    assert_eq!(verdict, TC_ACT_REDIRECT, "answered out of the interface it came in on");
    assert_eq!(out[14 + 9], packet::ICMP);
    assert_eq!(&out[34..36], &[3, 4], "fragmentation needed");
    assert_eq!(u16::from_be_bytes([out[40], out[41]]), 1480, "the link's MTU less the outer header");
    assert_eq!(&out[42..], &full[14..14 + 28], "quoting the packet as the client sent it");
    assert!(packet::icmp_checksums_valid(&out));
    assert_eq!(lb.dsr_stat(dsr_stat::FRAG_NEEDED_SENT), 1);
    // 1,480 bytes fit.
    let l4 = packet::l4_segment(packet::TCP, client, (EXTERNAL_IP, 80), packet::TCP_ACK, &[7u8; 1440]);
    let fits = packet::ipv4_frame(packet::TCP, CLIENT, EXTERNAL_IP, 0x4000, &l4);
    let (verdict, out) = lb.run(Hook::Ingress, &fits);
    assert_eq!((verdict, out.len()), (TC_ACT_REDIRECT, fits.len() + 20));
    assert_eq!(lb.dsr_stat(dsr_stat::ENCAP_FAILED), 0);
}

#[test]
fn a_tunnelled_packet_is_delivered_to_the_backend_it_names_and_answered_from_the_frontend() {
    let lb = load("deliver", (LOCAL_POD, "node-a"));
    for (proto, frontend, backend_port) in [(packet::TCP, 80, 8080u16), (packet::UDP, 53, 5353)] {
        let client = (CLIENT, 41000);
        let inner = packet::ipv4(proto, client, (EXTERNAL_IP, frontend), packet::TCP_SYN, b"hi");
        let (verdict, out) = lb.run(Hook::Ingress, &tunnelled(OTHER_NODE, LOCAL_POD, backend_port, &inner));
        assert_eq!(verdict, TC_ACT_UNSPEC, "on to the stack, which routes it to the pod");
        assert_eq!(out.len(), inner.len(), "the outer header is gone");
        assert_eq!(packet::endpoints(&out), (client, (LOCAL_POD, backend_port)), "translated to the named backend");
        assert!(packet::checksums_valid(&out));
        // A later packet: the same, from the entry.
        let again = packet::ipv4(proto, client, (EXTERNAL_IP, frontend), packet::TCP_ACK, b"more");
        let (_, out) = lb.run(Hook::Ingress, &tunnelled(OTHER_NODE, LOCAL_POD, backend_port, &again));
        assert_eq!(packet::endpoints(&out), (client, (LOCAL_POD, backend_port)));
        // Segments of a GSO packet tunnelled whole get consecutive IDs: the entry decides.
        let (_, out) = lb.run(Hook::Ingress, &tunnelled(OTHER_NODE, LOCAL_POD, backend_port + 3, &again));
        assert_eq!(packet::endpoints(&out), (client, (LOCAL_POD, backend_port)));
        // The pod's reply leaves as the frontend's, to the client itself.
        let reply = packet::ipv4(proto, (LOCAL_POD, backend_port), client, packet::TCP_ACK, b"hello");
        assert_eq!(lb.run(Hook::Ingress, &reply).0, TC_ACT_UNSPEC, "not translated where it enters");
        let (verdict, out) = lb.run(Hook::Egress, &reply);
        assert_eq!(verdict, TC_ACT_UNSPEC);
        assert_eq!(packet::endpoints(&out), ((EXTERNAL_IP, frontend), client));
        assert!(packet::checksums_valid(&out));
    }
    assert_eq!((lb.dsr_stat(dsr_stat::DECAPSULATED), lb.dsr_stat(dsr_stat::DELIVER_NEW_FLOW)), (6, 2));
    // The same flows reaching this node directly (the network moved them here): they stay on the
    // tunnel's backend, which is no slot's id here and must not count as gone (UDP would move).
    for (proto, frontend, backend_port) in [(packet::TCP, 80, 8080u16), (packet::UDP, 53, 5353)] {
        let direct = packet::ipv4(proto, (CLIENT, 41000), (EXTERNAL_IP, frontend), packet::TCP_ACK, b"direct");
        let (_, out) = lb.run(Hook::Ingress, &direct);
        assert_eq!(packet::endpoints(&out), ((CLIENT, 41000), (LOCAL_POD, backend_port)));
    }
    assert_eq!(lb.lb_stat(lb_stat::CT_RESELECTED), 0);

    // Another node's NodePort: admitted by this node's own (the same port), the reply restored
    // to come from the other node's address, which the client connected to.
    for (proto, node_port, backend_port) in [(packet::TCP, 30080, 8080u16), (packet::UDP, 30053, 5353)] {
        let client = (CLIENT, 41010);
        let inner = packet::ipv4(proto, client, (OTHER_NODE, node_port), packet::TCP_SYN, b"np");
        let (verdict, out) = lb.run(Hook::Ingress, &tunnelled(OTHER_NODE, LOCAL_POD, backend_port, &inner));
        assert_eq!(verdict, TC_ACT_UNSPEC);
        assert_eq!(packet::endpoints(&out), (client, (LOCAL_POD, backend_port)));
        assert!(packet::checksums_valid(&out));
        let reply = packet::ipv4(proto, (LOCAL_POD, backend_port), client, packet::TCP_ACK, b"hello");
        let (verdict, out) = lb.run(Hook::Egress, &reply);
        assert_eq!(verdict, TC_ACT_UNSPEC);
        assert_eq!(packet::endpoints(&out), ((OTHER_NODE, node_port), client));
        assert!(packet::checksums_valid(&out));
    }
    assert_eq!((lb.dsr_stat(dsr_stat::DECAPSULATED), lb.dsr_stat(dsr_stat::DELIVER_NEW_FLOW)), (8, 4));
    // A port that is no NodePort here, or a node address that is not the cluster's: refused.
    for frontend in [(OTHER_NODE, 30099), (Ipv4Addr::new(192, 0, 2, 98), 30080)] {
        let inner = packet::ipv4(packet::TCP, (CLIENT, 41011), frontend, packet::TCP_SYN, b"");
        assert_eq!(lb.run(Hook::Ingress, &tunnelled(OTHER_NODE, LOCAL_POD, 8080, &inner)).0, TC_ACT_SHOT);
    }
    assert_eq!(lb.dsr_stat(dsr_stat::DECAP_REFUSED), 2);

    // Not from a node, or not to a pod: not ours, untouched.
    let inner = packet::ipv4(packet::TCP, (CLIENT, 41001), (EXTERNAL_IP, 80), packet::TCP_SYN, b"");
    for (src, dst) in [(CLIENT, LOCAL_POD), (OTHER_NODE, NODE_IP)] {
        let frame = tunnelled(src, dst, 8080, &inner);
        assert_eq!(lb.run(Hook::Ingress, &frame), (TC_ACT_UNSPEC, frame.clone()));
    }
    // From a node to a pod, but for no frontend here: dropped.
    let stray = packet::ipv4(packet::TCP, (CLIENT, 41002), (Ipv4Addr::new(192, 0, 2, 99), 80), packet::TCP_SYN, b"");
    assert_eq!(lb.run(Hook::Ingress, &tunnelled(OTHER_NODE, LOCAL_POD, 8080, &stray)).0, TC_ACT_SHOT);
    assert_eq!(lb.dsr_stat(dsr_stat::DECAP_REFUSED), 3);
    assert_eq!(lb.dsr_stat(dsr_stat::DECAPSULATED), 11);
}
