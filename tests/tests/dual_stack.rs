//! The cluster harness in dual-stack mode (`ClusterBuilder::dual_stack`): every node, pod and
//! link has an IPv4 and an IPv6 address, the Node objects carry a pod CIDR of each family, and
//! the agents route both with their own MP-BGP. Real CNI plugins, real TCP and UDP over IPv6.
//! As root, in network namespaces.
use std::{
    thread,
    time::{Duration, Instant},
};

use kube_router_tests::{
    apiserver::FaultMode,
    cluster::{netprobe, Cluster},
    netprobe_bin, Netns,
};

/// `[addr]:port`.
fn v6(addr: &str, port: u16) -> String {
    format!("[{addr}]:{port}")
}

#[test]
fn pods_on_two_nodes_reach_each_other_over_ipv6_through_our_bgp_routes() {
    let c = Cluster::builder("krt-ds-pods").dual_stack().build().unwrap();
    let (a, b) = (c.pod(0, 0), c.pod(1, 0));
    let (a6, b6) = (a.ip6.clone().unwrap(), b.ip6.clone().unwrap());
    // Each pod got an address of its node's IPv6 pod CIDR from host-local.
    assert!(a6.starts_with("fd00:244:1::"), "{a6}");
    assert!(b6.starts_with("fd00:244:2::"), "{b6}");
    // The IPv6 pod CIDR of the other node is a route of ours, via its IPv6 address.
    let routes = c.node(0).bgp_routes();
    assert!(routes.contains("fd00:244:2::/64 via fd00:100::2"), "{routes}");

    // Both families work between the pods, and the server sees the client pod's own address.
    assert_eq!(netprobe(&a.ns, &["ask", "tcp", &v6(&b6, 8080), "who"]), format!("pod-2-0 {a6}"));
    assert_eq!(netprobe(&a.ns, &["ask", "udp", &v6(&b6, 5353), "who"]), format!("pod-2-0 {a6}"));
    assert_eq!(netprobe(&b.ns, &["ask", "tcp", &v6(&a6, 8080), "who"]), format!("pod-1-0 {b6}"));
    assert_eq!(netprobe(&a.ns, &["ask", "tcp", &format!("{}:8080", b.ip), "who"]), format!("pod-2-0 {}", a.ip));
    // The Pod objects carry both addresses, as the kubelet reports them.
    assert_eq!(c.pod(0, 0).ip6.as_deref(), Some(a6.as_str()));
}

/// The outage promise with IPv6 routes in place: an API black-hole changes no route of either
/// family and no map, and IPv6 traffic between nodes keeps flowing throughout.
#[test]
fn an_api_outage_changes_no_ipv6_route_and_ipv6_traffic_keeps_flowing() {
    let c = Cluster::builder("krt-ds-outage").dual_stack().build().unwrap();
    for node in &c.nodes {
        node.ns.wait_addresses_settled().unwrap();
    }
    let target = v6(c.pod(1, 0).ip6.as_deref().unwrap(), 8080);
    let probe = |ns: &Netns, target: &str| {
        ns.spawn_collecting(&[netprobe_bin().to_str().unwrap(), "probe", target, "200"]).unwrap()
    };
    let across = probe(&c.pod(0, 0).ns, &target);
    thread::sleep(Duration::from_secs(2));
    let maps = c.agent_maps();
    let routes = c.routes();
    let v6_routes: Vec<String> =
        c.nodes.iter().map(|n| n.ns.run(&["ip", "-6", "route", "show", "table", "all"]).unwrap()).collect();

    let outage = Duration::from_secs(20);
    c.set_api(FaultMode::BlackHole);
    let started = Instant::now();
    while started.elapsed() < outage {
        thread::sleep(Duration::from_secs(5));
        assert!(c.agents_running(), "an agent died {:?} into the outage", started.elapsed());
        assert_eq!(c.agent_maps(), maps, "maps changed {:?} into the outage", started.elapsed());
    }
    let v6_after: Vec<String> =
        c.nodes.iter().map(|n| n.ns.run(&["ip", "-6", "route", "show", "table", "all"]).unwrap()).collect();
    assert_eq!(v6_after, v6_routes, "IPv6 routes changed during the outage");
    assert_eq!(c.routes(), routes, "routes changed during the outage");
    c.set_api(FaultMode::Normal);

    let replies = across.lock().unwrap();
    let failed: Vec<&String> = replies.iter().filter(|r| !r.starts_with("pod-2-0")).collect();
    assert!(failed.is_empty(), "{} of {} IPv6 probes failed: {failed:?}", failed.len(), replies.len());
    assert!(replies.len() > outage.as_millis() as usize / 400, "only {} probes", replies.len());
}
