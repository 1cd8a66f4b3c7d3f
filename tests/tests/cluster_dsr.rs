//! Direct server return (`kube-router.io/service.dsr: tunnel`) on the multi-node harness: an
//! external client's flows to a LoadBalancer IP or ExternalIP that the fabric routes to node-1,
//! or to node-1's NodePort, with the backend on node-2, are tunnelled (IPIP) untranslated to
//! node-2, which hands them to the pod and sends its replies straight to the client from the
//! frontend address (node-1's, for the NodePort). The client's own address reaches the backend,
//! the counters of both nodes show the tunnel, and node-1's uplink does not carry the replies. A
//! local backend, the Local traffic policy, clients inside the cluster (NodePort) and a Service
//! without the annotation are served as before. The same over IPv6 (IPv6-in-IPv6) on a
//! dual-stack cluster, for the LoadBalancer IP, ExternalIP and NodePort. Real TCP and UDP, as
//! root, in network namespaces.

use kube_router_tests::{
    cluster::{
        assert_all_from, netprobe, node_ip6, request, stats_growth, wait_for, Cluster, Svc, CLIENT_ADDR, CLIENT_ADDR6,
    },
    netprobe_bin, Netns,
};

const DSR: (&str, &str) = ("kube-router.io/service.dsr", "tunnel");

/// A node's datapath counters (`NodeHandle::stats`).
type NodeStats = std::collections::BTreeMap<String, u64>;

/// Bytes sent out of the namespace's `eth0` so far (its uplink to the fabric).
fn uplink_tx_bytes(ns: &Netns) -> u64 {
    let out = ns.run(&["ip", "-j", "-s", "link", "show", "dev", "eth0"]).unwrap();
    let links: serde_json::Value = serde_json::from_str(&out).unwrap();
    links[0]["stats64"]["tx"]["bytes"].as_u64().expect("tx bytes")
}

/// node-1 chose the backend of each of `flows` new flows and tunnelled it, translating nothing
/// itself (XDP, `--xdp auto`, records each flow and leaves the encapsulation to TC; no reply came
/// back through it); node-2 took each out of the tunnel and recorded it once.
fn assert_tunnelled(before: &(NodeStats, NodeStats), after: &(NodeStats, NodeStats), flows: u64) {
    let first = |name| stats_growth(&before.0, &after.0, name);
    let second = |name| stats_growth(&before.1, &after.1, name);
    assert_eq!(first("dsr_new_flow"), flows, "{:?}", after.0);
    assert!(first("dsr_encapsulated") >= flows, "{:?}", after.0);
    assert_eq!(first("snat_new_flow"), 0, "{:?}", after.0);
    assert_eq!(first("xdp_new_flow"), flows, "{:?}", after.0);
    assert_eq!(first("xdp_tx") + first("xdp_redirect"), 0, "{:?}", after.0);
    assert_eq!(first("reverse_nat"), 0, "{:?}", after.0);
    assert_eq!(first("xdp_reply"), 0, "{:?}", after.0);
    assert!(second("dsr_decapsulated") >= first("dsr_encapsulated"), "{:?}", after.1);
    assert_eq!(second("dsr_deliver_new_flow"), flows, "{:?}", after.1);
    assert_eq!(second("dsr_decap_refused"), 0, "{:?}", after.1);
}

/// A 1 MB answer from `frontend` (TCP) leaves through node-2's uplink, not node-1's.
fn assert_reply_leaves_node_2(c: &Cluster, frontend: &str) {
    let (ingress, backend) = (c.node(0), c.node(1));
    let sent = (uplink_tx_bytes(&ingress.ns), uplink_tx_bytes(&backend.ns));
    let reply = netprobe(&c.client, &["ask", "tcp", frontend, "big 1000000"]);
    assert!(reply.starts_with("pod-2-0 ") && reply.len() == 999_999, "reply of {} bytes", reply.len());
    let sent = (uplink_tx_bytes(&ingress.ns) - sent.0, uplink_tx_bytes(&backend.ns) - sent.1);
    eprintln!("uplink bytes sent during a 1 MB reply from {frontend}: node-1 {}, node-2 {}", sent.0, sent.1);
    assert!(sent.1 >= 1_000_000, "node-2 sent {} bytes", sent.1);
    assert!(sent.0 < 100_000, "node-1 sent {} bytes: the reply went through it", sent.0);
}

/// A LoadBalancer Service (TCP 80, UDP 53) at `lb_ip` plus ExternalIP `external_ip`, both routed
/// by the fabric to node-1, selecting `pod`.
fn service(c: &Cluster, name: &str, cluster_ip: &str, node_port: u16, ips: (&str, &str), pod: &str, dsr: bool) {
    let mut svc = Svc::load_balancer(name, cluster_ip, node_port, ips.0).external_ip(ips.1).select("pod", pod);
    if dsr {
        svc = svc.annotate(DSR.0, DSR.1);
    }
    c.add_service(svc).unwrap();
    for ip in [ips.0, ips.1] {
        c.wait_backends(&format!("{ip}:80"), 1).unwrap();
        c.route_via(ip, 0).unwrap();
    }
}

/// Checksum offload on at the client (its veth sends TSO aggregates with partial checksums,
/// segmented after the tunnel header goes on) or off (complete checksums, MTU-sized packets).
#[test]
fn external_flows_to_a_remote_backend_are_tunnelled_and_answered_directly() {
    tunnelled_and_answered_directly(&Cluster::builder("krt-dsr-v4").build().unwrap());
}

#[test]
fn external_flows_with_complete_checksums_are_tunnelled_and_answered_directly() {
    tunnelled_and_answered_directly(&Cluster::builder("krt-dsr-v4-csum").full_checksums().build().unwrap());
}

fn tunnelled_and_answered_directly(c: &Cluster) {
    service(c, "dsr", "10.96.1.70", 30170, ("198.51.100.70", "198.51.100.71"), "pod-2-0", true);
    let (ingress, backend) = (c.node(0), c.node(1));
    let before = (ingress.stats(), backend.stats());
    let mut flows = 0;
    for frontend in ["198.51.100.70:80", "198.51.100.71:80"] {
        assert_all_from(&request(&c.client, "tcp", frontend, 10), "pod-2-0");
        // No source NAT anywhere: the backend sees the client itself.
        assert_eq!(netprobe(&c.client, &["ask", "tcp", frontend, "who"]), format!("pod-2-0 {CLIENT_ADDR}"));
        flows += 11;
    }
    assert_all_from(&request(&c.client, "udp", "198.51.100.70:53", 10), "pod-2-0");
    assert_eq!(netprobe(&c.client, &["ask", "udp", "198.51.100.70:53", "who"]), format!("pod-2-0 {CLIENT_ADDR}"));
    flows += 11;
    assert_tunnelled(&before, &(ingress.stats(), backend.stats()), flows);

    assert_reply_leaves_node_2(c, "198.51.100.70:80");

    // An upload of full-size segments: the tunnel's 20 bytes are found by path MTU discovery
    // (or taken off GSO segments), nothing is lost.
    let upload = netprobe(&c.client, &["bulk", "198.51.100.70:80", "2000000"]);
    let last = ingress.stats();
    assert_eq!(upload, "pod-2-0 2000000", "node-1: {last:?}\nnode-2: {:?}", backend.stats());
    assert_eq!(last["dsr_encap_failed"], 0, "{last:?}");
    eprintln!("frag_needed_sent on node-1 after the upload: {}", last["dsr_frag_needed_sent"]);
    wait_for("the DSR counters in /metrics", || {
        backend.metric("kube_router_dsr_packets_total", "event=\"decapsulated\"") > 0.0
    });
}

/// IPv6: an ExternalIP and a LoadBalancer IP routed to node-1, the backend on node-2; checksum
/// offload on or off at the client, as for IPv4.
#[test]
fn ipv6_external_flows_to_a_remote_backend_are_tunnelled_and_answered_directly() {
    ipv6_tunnelled_and_answered_directly(&Cluster::builder("krt-dsr-v6").dual_stack().build().unwrap());
}

#[test]
fn ipv6_external_flows_with_complete_checksums_are_tunnelled_and_answered_directly() {
    ipv6_tunnelled_and_answered_directly(
        &Cluster::builder("krt-dsr-v6-csum").dual_stack().full_checksums().build().unwrap(),
    );
}

/// A dual-stack LoadBalancer Service with DSR (TCP 80, UDP 53; NodePorts 30178 and 30179) over
/// pod-2-0, its IPv6 LoadBalancer IP and ExternalIP routed by the fabric to node-1: those two.
fn ipv6_dsr_service(c: &Cluster) -> (&'static str, &'static str) {
    let (lb_ip, external_ip) = ("2001:db8:51::78", "2001:db8:2::78");
    let svc = Svc::load_balancer("dsr6", "10.96.1.78", 30178, "198.51.100.78")
        .dual_stack("fd00:96::78")
        .load_balancer_ip(lb_ip)
        .external_ip(external_ip)
        .select("pod", "pod-2-0")
        .annotate(DSR.0, DSR.1);
    c.add_service(svc).unwrap();
    for ip in [lb_ip, external_ip] {
        c.wait_backends(&format!("[{ip}]:80"), 1).unwrap();
        c.route_via(ip, 0).unwrap();
    }
    (lb_ip, external_ip)
}

fn ipv6_tunnelled_and_answered_directly(c: &Cluster) {
    let (lb_ip, external_ip) = ipv6_dsr_service(c);
    let (ingress, backend) = (c.node(0), c.node(1));
    let before = (ingress.stats(), backend.stats());
    let mut flows = 0;
    for ip in [lb_ip, external_ip] {
        let frontend = format!("[{ip}]:80");
        assert_all_from(&request(&c.client, "tcp", &frontend, 10), "pod-2-0");
        // No source NAT anywhere: the backend sees the client itself.
        assert_eq!(netprobe(&c.client, &["ask", "tcp", &frontend, "who"]), format!("pod-2-0 {CLIENT_ADDR6}"));
        flows += 11;
    }
    let udp = format!("[{lb_ip}]:53");
    assert_all_from(&request(&c.client, "udp", &udp, 10), "pod-2-0");
    assert_eq!(netprobe(&c.client, &["ask", "udp", &udp, "who"]), format!("pod-2-0 {CLIENT_ADDR6}"));
    flows += 11;
    // node-1's IPv6 NodePorts: tunnelled alike, each UDP reply from node-1's address and port,
    // though node-2 sent it.
    let node_port = format!("[{}]:30178", node_ip6(0));
    assert_all_from(&request(&c.client, "tcp", &node_port, 10), "pod-2-0");
    assert_eq!(netprobe(&c.client, &["ask", "tcp", &node_port, "who"]), format!("pod-2-0 {CLIENT_ADDR6}"));
    let udp_node_port = format!("[{}]:30179", node_ip6(0));
    assert_eq!(netprobe(&c.client, &["ask", "udp", &udp_node_port, "who"]), format!("pod-2-0 {CLIENT_ADDR6}"));
    assert_udp_replies_from(c, &udp_node_port);
    flows += 17;
    assert_tunnelled(&before, &(ingress.stats(), backend.stats()), flows);
    assert_reply_leaves_node_2(c, &node_port);
    // Clients inside the cluster stay source-NATed: a pod on node-1, and node-2 itself.
    let inside = ingress.stats();
    assert_all_from(&c.pod(0, 0).request("tcp", &node_port, 5), "pod-2-0");
    assert_all_from(&backend.request("tcp", &node_port, 5), "pod-2-0");
    let after = ingress.stats();
    assert_eq!(stats_growth(&inside, &after, "dsr_new_flow"), 0, "{after:?}");
    assert_eq!(stats_growth(&inside, &after, "snat_new_flow"), 10, "{after:?}");

    assert_reply_leaves_node_2(c, &format!("[{lb_ip}]:80"));

    // An upload of full-size segments: the tunnel's 40 bytes are found by path MTU discovery
    // ("packet too big") or taken off GSO segments; nothing is lost.
    let upload = netprobe(&c.client, &["bulk", &format!("[{lb_ip}]:80"), "2000000"]);
    let last = ingress.stats();
    assert_eq!(upload, "pod-2-0 2000000", "node-1: {last:?}\nnode-2: {:?}", backend.stats());
    assert_eq!(last["dsr_encap_failed"], 0, "{last:?}");
    eprintln!("frag_needed_sent on node-1 after the IPv6 upload: {}", last["dsr_frag_needed_sent"]);
    wait_for("the DSR counters in /metrics", || {
        backend.metric("kube_router_dsr_packets_total", "event=\"deliver_new_flow\"") >= flows as f64
    });
}

#[test]
fn local_backends_and_services_without_the_annotation_are_served_as_before() {
    let c = Cluster::builder("krt-dsr-as-before").full_checksums().build().unwrap();
    // DSR asked for, but the backend is on node-1 itself: plain DNAT there.
    service(&c, "local", "10.96.1.72", 30172, ("198.51.100.72", "198.51.100.73"), "pod-1-0", true);
    // No annotation: node-1 source-NATs the flow to node-2's backend, as always.
    service(&c, "snat", "10.96.1.74", 30174, ("198.51.100.74", "198.51.100.75"), "pod-2-0", false);
    let (ingress, backend) = (c.node(0), c.node(1));
    let before = (ingress.stats(), backend.stats());
    assert_all_from(&request(&c.client, "tcp", "198.51.100.72:80", 5), "pod-1-0");
    assert_eq!(netprobe(&c.client, &["ask", "tcp", "198.51.100.73:80", "who"]), format!("pod-1-0 {CLIENT_ADDR}"));
    assert_all_from(&request(&c.client, "udp", "198.51.100.72:53", 5), "pod-1-0");
    assert_all_from(&request(&c.client, "tcp", "198.51.100.74:80", 5), "pod-2-0");
    assert_eq!(netprobe(&c.client, &["ask", "tcp", "198.51.100.75:80", "who"]), "pod-2-0 10.100.0.1");
    assert_all_from(&request(&c.client, "udp", "198.51.100.74:53", 5), "pod-2-0");
    let after = (ingress.stats(), backend.stats());
    for name in ["dsr_new_flow", "dsr_encapsulated"] {
        assert_eq!(stats_growth(&before.0, &after.0, name), 0, "{name}: {:?}", after.0);
    }
    for name in ["dsr_decapsulated", "dsr_deliver_new_flow"] {
        assert_eq!(stats_growth(&before.1, &after.1, name), 0, "{name}: {:?}", after.1);
    }
    assert_eq!(stats_growth(&before.0, &after.0, "snat_new_flow"), 11, "{:?}", after.0);
}

/// Five UDP exchanges with `frontend`, each answered by pod-2-0 from `frontend` itself as the
/// client's `recvfrom` reports it (not from the node or pod that sent the reply).
fn assert_udp_replies_from(c: &Cluster, frontend: &str) {
    let peers = udp_peers(c, frontend, 5);
    assert!(peers.iter().all(|(name, peer)| name == "pod-2-0" && peer == frontend), "{peers:?}");
}

/// The UDP replies' source as the client's `recvfrom` reports it, `count` exchanges with `target`
/// (each from a new socket): (backend name, peer address) per reply.
fn udp_peers(c: &Cluster, target: &str, count: usize) -> Vec<(String, String)> {
    let out = netprobe(&c.client, &["peer", "udp", target, &count.to_string()]);
    let peers: Vec<(String, String)> = out
        .lines()
        .map(|l| {
            let fields: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(fields.first(), Some(&"OK"), "{target}: {l}");
            (fields[1].to_string(), fields[2].to_string())
        })
        .collect();
    assert_eq!(peers.len(), count, "{out}");
    peers
}

#[test]
fn external_flows_to_a_node_port_are_tunnelled_and_answered_from_that_node_address() {
    let c = Cluster::builder("krt-dsr-np").build().unwrap();
    // NodePorts of node-1 (10.100.0.1), which the client reaches directly on the fabric.
    let dsr = |svc: Svc| svc.annotate(DSR.0, DSR.1);
    c.add_service(dsr(Svc::node_port("remote", "10.96.1.78", 30178).select("pod", "pod-2-0"))).unwrap();
    c.add_service(dsr(Svc::node_port("here", "10.96.1.79", 30180).select("pod", "pod-1-0"))).unwrap();
    c.add_service(dsr(Svc::node_port("local", "10.96.1.80", 30182).select("pod", "pod-1-0").local())).unwrap();
    // Every node has the ClusterIPs (the NodePorts are each node's own), programmed alike.
    for frontend in ["10.96.1.78:80", "10.96.1.79:80", "10.96.1.80:80"] {
        c.wait_backends(frontend, 1).unwrap();
    }
    let (ingress, backend) = (c.node(0), c.node(1));
    let before = (ingress.stats(), backend.stats());
    let mut flows = 0;
    assert_all_from(&request(&c.client, "tcp", "10.100.0.1:30178", 10), "pod-2-0");
    // No source NAT anywhere: the backend sees the client itself.
    assert_eq!(netprobe(&c.client, &["ask", "tcp", "10.100.0.1:30178", "who"]), format!("pod-2-0 {CLIENT_ADDR}"));
    assert_all_from(&request(&c.client, "udp", "10.100.0.1:30179", 10), "pod-2-0");
    assert_eq!(netprobe(&c.client, &["ask", "udp", "10.100.0.1:30179", "who"]), format!("pod-2-0 {CLIENT_ADDR}"));
    flows += 22;
    // Each UDP reply comes from node-1's address and NodePort, though node-2 sent it.
    assert_udp_replies_from(&c, "10.100.0.1:30179");
    flows += 5;
    assert_tunnelled(&before, &(ingress.stats(), backend.stats()), flows);

    assert_reply_leaves_node_2(&c, "10.100.0.1:30178");
    // Full-size segments up the tunnel (path MTU discovery, or GSO segments made smaller).
    assert_eq!(netprobe(&c.client, &["bulk", "10.100.0.1:30178", "2000000"]), "pod-2-0 2000000");
    assert_eq!(ingress.stats()["dsr_encap_failed"], 0);

    // Served as before: a backend on node-1 itself (plain DNAT there), the Local traffic policy
    // (node-1's endpoint only; node-2 has none and refuses), and clients inside the cluster,
    // whose replies from node-1's own address would not reach them (source-NATed).
    let before = (ingress.stats(), backend.stats());
    for frontend in ["10.100.0.1:30180", "10.100.0.1:30182"] {
        assert_all_from(&request(&c.client, "tcp", frontend, 5), "pod-1-0");
        assert_eq!(netprobe(&c.client, &["ask", "tcp", frontend, "who"]), format!("pod-1-0 {CLIENT_ADDR}"));
    }
    for frontend in ["10.100.0.1:30181", "10.100.0.1:30183"] {
        assert_eq!(netprobe(&c.client, &["ask", "udp", frontend, "who"]), format!("pod-1-0 {CLIENT_ADDR}"));
    }
    let refused = netprobe(&c.client, &["timed", "tcp", "10.100.0.2:30182"]);
    assert!(refused.starts_with("ERR connect: Connection refused"), "{refused}");
    // pod-1-0 (a pod on node-1) and node-2 itself, to node-1's NodePort whose backend is on node-2.
    assert_all_from(&c.pod(0, 0).request("tcp", "10.100.0.1:30178", 5), "pod-2-0");
    assert_all_from(&c.pod(0, 0).request("udp", "10.100.0.1:30179", 5), "pod-2-0");
    assert_all_from(&backend.request("tcp", "10.100.0.1:30178", 5), "pod-2-0");
    let after = (ingress.stats(), backend.stats());
    for name in ["dsr_new_flow", "dsr_encapsulated"] {
        assert_eq!(stats_growth(&before.0, &after.0, name), 0, "{name}: {:?}", after.0);
    }
    for name in ["dsr_decapsulated", "dsr_deliver_new_flow"] {
        assert_eq!(stats_growth(&before.1, &after.1, name), 0, "{name}: {:?}", after.1);
    }
    assert_eq!(stats_growth(&before.0, &after.0, "snat_new_flow"), 15, "{:?}", after.0);
    assert_eq!(stats_growth(&before.1, &after.1, "snat_new_flow"), 0, "node-2 forwarded no Local flow");
}

fn restarted_and_synced(c: &Cluster, i: usize) {
    c.restart_agent(i).unwrap();
    wait_for("the restarted agent's first sync", || {
        c.node(i).metric("kube_router_sync_duration_seconds_count", "") >= 1.0
    });
}

#[test]
fn an_established_dsr_connection_survives_agent_restarts_on_both_nodes() {
    // Checksum offload left on: the client's packets travel with partial checksums
    // (CHECKSUM_PARTIAL) through the tunnel, as from a local sender.
    let c = Cluster::builder("krt-dsr-restart").build().unwrap();
    service(&c, "dsr", "10.96.1.76", 30176, ("198.51.100.76", "198.51.100.77"), "pod-2-0", true);
    survives_agent_restarts_on_both_nodes(&c, "198.51.100.76:80");
}

#[test]
fn an_established_ipv6_dsr_connection_survives_agent_restarts_on_both_nodes() {
    let c = Cluster::builder("krt-dsr-rst6").dual_stack().build().unwrap();
    let (lb_ip, _) = ipv6_dsr_service(&c);
    survives_agent_restarts_on_both_nodes(&c, &format!("[{lb_ip}]:80"));
}

/// A connection held open to `frontend` (answered by pod-2-0 through the tunnel) goes on
/// through a restart of node-1's agent and then node-2's, which leave the maps as they were.
fn survives_agent_restarts_on_both_nodes(c: &Cluster, frontend: &str) {
    let held = c.client.spawn_collecting(&[netprobe_bin().to_str().unwrap(), "hold", frontend, "50"]).unwrap();
    let replies = || held.lock().unwrap().len();
    let rising = |node: usize, counter: &str| {
        let start = c.node(node).stats()[counter];
        wait_for(counter, || c.node(node).stats()[counter] >= start + 5);
    };
    rising(0, "dsr_encapsulated");
    rising(1, "dsr_decapsulated");
    let maps = c.agent_maps();
    restarted_and_synced(c, 0);
    restarted_and_synced(c, 1);
    wait_for("the maps as before the restarts", || c.agent_maps() == maps);
    rising(0, "dsr_encapsulated");
    rising(1, "dsr_decapsulated");
    let seen = replies();
    wait_for("more replies", || replies() > seen);
    let replies = held.lock().unwrap().clone();
    assert!(replies.iter().all(|r| r == "pod-2-0"), "the held connection broke or moved: {replies:?}");
}
