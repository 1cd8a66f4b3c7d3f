//! The XDP fast path (`kr_xdp_lb`), run in the kernel with BPF_PROG_TEST_RUN on packets arriving
//! on a node uplink: north-south flows to a backend on another node are translated (DNAT + SNAT
//! to the node, as TC does) and sent back out (XDP_TX) with valid checksums and the next hop's
//! MAC; their replies are reverse-translated; the conntrack state is TC's own, whichever hook
//! made it; everything else passes untouched. Needs root.
use common::test_run::{packet, run_xdp, TC_ACT_REDIRECT, TC_ACT_UNSPEC, XDP_DROP, XDP_PASS, XDP_TX};
use std::net::Ipv4Addr;

use kube_router::pinned::conntrack_gc::monotonic_now_ns;
use kube_router::{
    bpf::xdp,
    services::{compile::addr_be, model::NodeContext},
};
use kube_router_common::{
    lb_stat, xdp_stat, CtKeyV4, CtValueV4, LbConfig, CT_FLAG_CLOSING, CT_FLAG_FORWARD, CT_FLAG_FULL_NAT,
    CT_FLAG_REDIRECT, CT_FLAG_REVERSE, CT_FLAG_SEEN_REPLY, CT_LIFETIME_CLOSING_SECS,
};

mod common;
use common::{load_node, ttl, Loaded, CLIENT, EXTERNAL_IP as LB_IP, LOCAL_POD, NODE_IP, REMOTE_POD};

const SNAT_PORTS: (u16, u16) = (20_000, 20_099);
/// The MACs of the other node (next hop to its pods) and of the fabric router (to the client).
const NODE_B_MAC: [u8; 6] = [0x02, 0, 0, 0, 0xb, 0xb];
const ROUTER_MAC: [u8; 6] = [0x02, 0, 0, 0, 0xf, 0xe];

/// A LoadBalancer Service `web` (NodePort 30080/TCP, 30053/UDP, LB IP) over the endpoints.
fn service_yaml(endpoints: &[(Ipv4Addr, &str)]) -> String {
    let endpoints: String = endpoints
        .iter()
        .map(|(addr, node)| format!("- addresses: [\"{addr}\"]\n  nodeName: {node}\n  conditions: {{ready: true}}\n"))
        .collect();
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{namespace: default, name: web}}\nspec:\n  type: LoadBalancer\n  clusterIP: 10.96.0.10\n  ports:\n  - {{name: http, protocol: TCP, port: 80, nodePort: 30080}}\n  - {{name: dns, protocol: UDP, port: 53, nodePort: 30053}}\nstatus:\n  loadBalancer:\n    ingress: [{{ip: {LB_IP}}}]\n---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  namespace: default\n  name: web-1\n  labels: {{kubernetes.io/service-name: web}}\naddressType: IPv4\n\
         ports:\n- {{name: http, protocol: TCP, port: 8080}}\n- {{name: dns, protocol: UDP, port: 5353}}\nendpoints:\n{endpoints}"
    )
}

fn mac(bytes: [u8; 6]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

/// The node ([`common::NODE_NETNS`]) with the other node's pods and the client routed via
/// neighbours whose MACs are known (`neighbours`: else resolved by the stack).
fn load(test: &str, endpoints: &[(Ipv4Addr, &str)], neighbours: bool) -> Loaded {
    load_named(&format!("krt-xdp-unit-{test}"), endpoints, neighbours)
}

/// `load` with the network namespace and pin directory named `name`.
fn load_named(name: &str, endpoints: &[(Ipv4Addr, &str)], neighbours: bool) -> Loaded {
    let (b_mac, router_mac) = (mac(NODE_B_MAC), mac(ROUTER_MAC));
    let neighbour_commands: &[&[&str]] = &[
        &["neigh", "add", "10.100.0.2", "lladdr", &b_mac, "dev", "up0", "nud", "permanent"],
        &["neigh", "add", "10.100.0.254", "lladdr", &router_mac, "dev", "up0", "nud", "permanent"],
    ];
    let extra = if neighbours { neighbour_commands } else { &[] };
    let context = NodeContext { name: "node-a".into(), node_port_addrs: vec![NODE_IP.into()], ..Default::default() };
    let config = LbConfig {
        snat_addr: addr_be(NODE_IP),
        snat_port_min: SNAT_PORTS.0,
        snat_port_max: SNAT_PORTS.1,
        ..Default::default()
    };
    load_node(name, extra, &service_yaml(endpoints), &context, &config)
}

impl Loaded {
    fn xdp(&mut self, frame: &[u8]) -> (i32, Vec<u8>) {
        let fd = xdp::program_fd(&mut self.datapath).unwrap();
        let out = run_xdp(fd, frame, 1, self.ifindex).unwrap();
        (out.retval, out.packet)
    }
    /// The XDP fast path's counter `index` (`xdp_stat`), summed over the CPUs.
    fn xdp_stat(&self, index: u32) -> u64 {
        xdp::read_stats(&self.pin_dir).unwrap().expect("xdp_stats pinned")[index as usize]
    }
}

fn macs(frame: &[u8]) -> ([u8; 6], [u8; 6]) {
    (frame[..6].try_into().unwrap(), frame[6..12].try_into().unwrap())
}

#[test]
fn a_new_flow_to_a_remote_backend_is_translated_and_sent_back_out_and_so_is_its_reply() {
    let mut lb = load("remote", &[(REMOTE_POD, "node-b")], true);
    // This thread's namespace (a child process inherits it; /sys shows another).
    let link = std::process::Command::new("ip").args(["-br", "link", "show", "up0"]).output().unwrap();
    let up0_mac = String::from_utf8(link.stdout).unwrap().split_whitespace().nth(2).unwrap().to_string();
    let mut flows = 0;
    for (proto, frontend, backend_port) in
        [(packet::TCP, (NODE_IP, 30080), 8080), (packet::UDP, (NODE_IP, 30053), 5353), (packet::TCP, (LB_IP, 80), 8080)]
    {
        flows += 1;
        let client = (CLIENT, 40000 + flows);
        let syn = packet::ipv4(proto, client, frontend, packet::TCP_SYN, b"hello");
        let (verdict, out) = lb.xdp(&syn);
        assert_eq!(verdict, XDP_TX, "sent back out of the uplink it came in on");
        let (src, dst) = packet::endpoints(&out);
        assert_eq!(dst, (REMOTE_POD, backend_port), "DNAT to the backend");
        assert_eq!(src.0, NODE_IP, "SNAT to this node, as at TC");
        assert!((SNAT_PORTS.0..=SNAT_PORTS.1).contains(&src.1), "port {} from the SNAT range", src.1);
        assert_eq!(ttl(&out), 63, "forwarded like a router: TTL decremented");
        assert!(packet::checksums_valid(&out), "IP and {proto} checksums valid after the rewrite");
        assert_eq!(macs(&out).0, NODE_B_MAC, "to the next hop");
        assert_eq!(mac(macs(&out).1), up0_mac.trim(), "from the uplink");

        // The backend node's reply comes back to the node address and leaves as the frontend's.
        let reply = packet::ipv4(proto, dst, src, packet::TCP_ACK, b"world");
        let (verdict, back) = lb.xdp(&reply);
        assert_eq!(verdict, XDP_TX);
        assert_eq!(packet::endpoints(&back), (frontend, client));
        assert!(packet::checksums_valid(&back));
        assert_eq!(macs(&back).0, ROUTER_MAC);

        // One conntrack state whichever hook sees the flow: TC translates the next packet alike.
        let next = packet::ipv4(proto, client, frontend, packet::TCP_ACK, b"again");
        let (verdict, at_tc) = lb.ingress(&next);
        assert_eq!(verdict, TC_ACT_REDIRECT);
        assert_eq!(packet::endpoints(&at_tc), (src, dst));
        let (verdict, at_xdp) = lb.xdp(&next);
        assert_eq!(verdict, XDP_TX);
        assert_eq!(packet::endpoints(&at_xdp), (src, dst));
    }
    assert_eq!(lb.xdp_stat(xdp_stat::NEW_FLOW), 3);
    assert_eq!(lb.xdp_stat(xdp_stat::REPLY), 3);
    assert_eq!(lb.xdp_stat(xdp_stat::FORWARD), 3);
    assert_eq!(lb.xdp_stat(xdp_stat::TX), 9);
    assert_eq!(lb.xdp_stat(xdp_stat::PACKETS), 9);
}

#[test]
fn a_flow_that_tc_started_is_served_by_xdp() {
    let mut lb = load("tcfirst", &[(REMOTE_POD, "node-b")], true);
    let syn = packet::ipv4(packet::TCP, (CLIENT, 41000), (NODE_IP, 30080), packet::TCP_SYN, b"");
    let (verdict, at_tc) = lb.ingress(&syn);
    assert_eq!(verdict, TC_ACT_REDIRECT);
    let ack = packet::ipv4(packet::TCP, (CLIENT, 41000), (NODE_IP, 30080), packet::TCP_ACK, b"data");
    let (verdict, at_xdp) = lb.xdp(&ack);
    assert_eq!(verdict, XDP_TX);
    assert_eq!(packet::endpoints(&at_xdp), packet::endpoints(&at_tc));
    assert_eq!(lb.xdp_stat(xdp_stat::NEW_FLOW), 0);
}

#[test]
fn non_service_traffic_fragments_and_unresolved_next_hops_pass_untouched() {
    let mut lb = load("pass", &[(REMOTE_POD, "node-b")], false);
    // Not to a frontend.
    let other = packet::ipv4(packet::TCP, (CLIENT, 40000), (NODE_IP, 22), packet::TCP_SYN, b"ssh");
    assert_eq!(lb.xdp(&other), (XDP_PASS, other.clone()));
    // A first fragment to the NodePort: fragments are TC's (it tracks their ports).
    let l4 = packet::l4_segment(packet::UDP, (CLIENT, 40001), (NODE_IP, 30053), 0, &[7; 64]);
    let first = packet::ipv4_frame(packet::UDP, CLIENT, NODE_IP, 0x2000, &l4);
    assert_eq!(lb.xdp(&first), (XDP_PASS, first.clone()));
    let later = packet::ipv4_frame(packet::UDP, CLIENT, NODE_IP, 0x0003, &[7; 24]);
    assert_eq!(lb.xdp(&later), (XDP_PASS, later.clone()));
    // ICMP is TC's too.
    let echo = packet::icmp_echo(8, CLIENT, NODE_IP, 7);
    assert_eq!(lb.xdp(&echo), (XDP_PASS, echo.clone()));
    // No neighbour entry for the next hop: the stack resolves it, through TC, from the flow
    // state XDP recorded.
    let syn = packet::ipv4(packet::TCP, (CLIENT, 40002), (NODE_IP, 30080), packet::TCP_SYN, b"");
    assert_eq!(lb.xdp(&syn), (XDP_PASS, syn.clone()));
    let (verdict, at_tc) = lb.ingress(&syn);
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!(packet::endpoints(&at_tc).1, (REMOTE_POD, 8080));
    assert_eq!(lb.xdp_stat(xdp_stat::PASS_NO_SERVICE), 1);
    assert_eq!(lb.xdp_stat(xdp_stat::PASS_FRAGMENT), 2);
    assert_eq!(lb.xdp_stat(xdp_stat::PASS_NOT_LB), 1);
    assert_eq!(lb.xdp_stat(xdp_stat::PASS_NO_ROUTE), 1);
    assert_eq!(lb.xdp_stat(xdp_stat::TX), 0);
}

#[test]
fn local_backends_and_partial_checksums_are_left_to_tc() {
    let mut lb = load("local", &[(LOCAL_POD, "node-a")], true);
    let syn = packet::ipv4(packet::TCP, (CLIENT, 40000), (NODE_IP, 30080), packet::TCP_SYN, b"");
    assert_eq!(lb.xdp(&syn), (XDP_PASS, syn.clone()));
    // TC translates it from the state XDP recorded (client address kept: local delivery).
    let (verdict, at_tc) = lb.ingress(&syn);
    assert_eq!(verdict, TC_ACT_UNSPEC);
    assert_eq!(packet::endpoints(&at_tc), ((CLIENT, 40000), (LOCAL_POD, 8080)));
    assert_eq!(lb.xdp_stat(xdp_stat::PASS_TO_TC), 1);

    // A checksum field holding only the pseudo-header sum (CHECKSUM_PARTIAL from a local veth
    // peer): XDP cannot complete it, TC can.
    let mut lb = load("partial", &[(REMOTE_POD, "node-b")], true);
    let mut partial = packet::ipv4(packet::TCP, (CLIENT, 40001), (NODE_IP, 30080), packet::TCP_SYN, b"");
    let l4_len = (partial.len() - 34) as u32;
    let mut sum: u32 = [CLIENT.octets(), NODE_IP.octets()]
        .iter()
        .flat_map(|a| [u32::from(u16::from_be_bytes([a[0], a[1]])), u32::from(u16::from_be_bytes([a[2], a[3]]))])
        .sum::<u32>()
        + u32::from(packet::TCP)
        + l4_len;
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    partial[34 + 16..34 + 18].copy_from_slice(&(sum as u16).to_be_bytes());
    assert_eq!(lb.xdp(&partial), (XDP_PASS, partial.clone()));
    assert_eq!(lb.xdp_stat(xdp_stat::PASS_CHECKSUM_PARTIAL), 1);
}

/// The NodePort of `service_yaml` and its backend on the other node.
const NODE_PORT: (Ipv4Addr, u16) = (NODE_IP, 30080);
const BACKEND: (Ipv4Addr, u16) = (REMOTE_POD, 8080);

/// Every port of `SNAT_PORTS` held by a TCP flow to [`NODE_PORT`] source-NATed towards
/// [`BACKEND`] (client port 30,000 + the port's place in the range), as TC or XDP make one: both
/// entries full NAT and routed by the program, last seen at `last_seen_ns`, with `flags` on both
/// and `forward_flags` on the forward one. Returns `ct_v4`.
fn hold_every_snat_port(
    lb: &Loaded,
    last_seen_ns: u64,
    flags: u16,
    forward_flags: u16,
) -> aya::maps::HashMap<aya::maps::MapData, CtKeyV4, CtValueV4> {
    let data = aya::maps::MapData::from_pin(kube_router::pinned::pinned_map(&lb.pin_dir, "ct_v4")).unwrap();
    let mut ct = aya::maps::HashMap::try_from(aya::maps::Map::LruHashMap(data)).unwrap();
    let entry = |nat_src: (Ipv4Addr, u16), nat_dst: (Ipv4Addr, u16), direction: u16| CtValueV4 {
        last_seen_ns,
        nat_src_addr: addr_be(nat_src.0),
        nat_dst_addr: addr_be(nat_dst.0),
        nat_src_port: nat_src.1.to_be(),
        nat_dst_port: nat_dst.1.to_be(),
        flags: direction | flags | CT_FLAG_FULL_NAT | CT_FLAG_REDIRECT,
        pad: 0,
        service_id: 1,
        backend_id: 1,
    };
    for port in SNAT_PORTS.0..=SNAT_PORTS.1 {
        let client = (CLIENT, 30_000 + port - SNAT_PORTS.0);
        let snat = (NODE_IP, port);
        let forward = entry(snat, BACKEND, CT_FLAG_FORWARD | forward_flags);
        ct.insert(packet::ct_key_v4(packet::TCP, client, NODE_PORT), forward, 0).unwrap();
        ct.insert(packet::ct_key_v4(packet::TCP, BACKEND, snat), entry(NODE_PORT, client, CT_FLAG_REVERSE), 0).unwrap();
    }
    ct
}

/// The XDP fast path allocates SNAT ports with TC's code: every port held by a closed NodePort
/// flow past its closing lifetime (entries as TC or XDP leave them, not yet collected), a new
/// flow served at XDP takes one, and the old flow's entries go.
#[test]
fn a_new_flow_at_xdp_takes_the_snat_port_of_a_closed_flow() {
    let mut lb = load_named("krt-perf-xdp-reclaim", &[(REMOTE_POD, "node-b")], true);
    let closed_at = monotonic_now_ns() - (CT_LIFETIME_CLOSING_SECS + 1) * 1_000_000_000;
    // The client's FIN or RST: its forward entry is closing; the reverse one is not.
    let ct = hold_every_snat_port(&lb, closed_at, 0, CT_FLAG_CLOSING);
    let (tcp, node_port, backend) = (packet::TCP, NODE_PORT, BACKEND);
    let exhausted = |lb: &Loaded| {
        kube_router::services::maps::read_lb_stats(&lb.pin_dir).unwrap()[lb_stat::SNAT_PORTS_EXHAUSTED as usize]
    };
    assert_eq!(exhausted(&lb), 0);

    let syn = packet::ipv4(tcp, (CLIENT, 40000), node_port, packet::TCP_SYN, b"");
    let (verdict, out) = lb.xdp(&syn);
    assert_eq!(verdict, XDP_TX, "served at XDP, not refused");
    let (src, dst) = packet::endpoints(&out);
    assert_eq!((src.0, dst), (NODE_IP, backend));
    assert!((SNAT_PORTS.0..=SNAT_PORTS.1).contains(&src.1));
    assert_eq!(exhausted(&lb), 0);
    // The port's old flow is gone, both ways; the new flow holds it; the other old flows stay.
    let old_client = (CLIENT, 30_000 + src.1 - SNAT_PORTS.0);
    assert!(ct.get(&packet::ct_key_v4(tcp, old_client, node_port), 0).is_err(), "old forward entry removed");
    let reverse = ct.get(&packet::ct_key_v4(tcp, backend, src), 0).unwrap();
    assert_eq!(u16::from_be(reverse.nat_dst_port), 40000, "the reverse entry is the new flow's");
    let range = usize::from(SNAT_PORTS.1 - SNAT_PORTS.0) + 1;
    assert_eq!(ct.keys().count(), 2 * range);
    assert_eq!(lb.xdp_stat(xdp_stat::NEW_FLOW), 1);
}

/// Every SNAT port held by an open flow: a new flow is refused at XDP itself, counted once
/// (`snat_ports_exhausted`), not passed to TC to be tried, counted and dropped a second time (a
/// SYN flood's every packet cost twice the probes).
#[test]
fn a_new_flow_refused_for_want_of_snat_ports_is_dropped_at_xdp_and_counted_once() {
    let mut lb = load_named("krt-perf-xdp-refuse", &[(REMOTE_POD, "node-b")], true);
    // Answered and open: nothing to reclaim.
    let ct = hold_every_snat_port(&lb, monotonic_now_ns(), CT_FLAG_SEEN_REPLY, 0);
    let (tcp, node_port) = (packet::TCP, NODE_PORT);
    let lb_stats = |lb: &Loaded| kube_router::services::maps::read_lb_stats(&lb.pin_dir).unwrap();

    let syn = packet::ipv4(tcp, (CLIENT, 40000), node_port, packet::TCP_SYN, b"");
    let (verdict, _) = lb.xdp(&syn);
    assert_eq!(verdict, XDP_DROP, "refused at XDP");
    assert_eq!(lb_stats(&lb)[lb_stat::SNAT_PORTS_EXHAUSTED as usize], 1);
    assert_eq!(lb.xdp_stat(xdp_stat::PASS_TO_TC), 0);
    assert_eq!(lb.xdp_stat(xdp_stat::NEW_FLOW), 0);
    // Nothing of it was recorded: the held flows are as they were.
    let range = usize::from(SNAT_PORTS.1 - SNAT_PORTS.0) + 1;
    assert_eq!(ct.keys().count(), 2 * range);
    // TC, as before: refused and dropped the same way.
    let (verdict, _) = lb.ingress(&syn);
    assert_eq!(verdict, common::test_run::TC_ACT_SHOT);
    assert_eq!(lb_stats(&lb)[lb_stat::SNAT_PORTS_EXHAUSTED as usize], 2);
}
