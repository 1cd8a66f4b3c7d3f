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
    cluster::{ingress_policy, netprobe, node_ip6, request, wait_denied, Cluster, Svc, CLIENT_ADDR6, INTERNET_ADDR6},
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

/// The outage promise with IPv6 routes, a dual-stack Service and an IPv6-judged policy in
/// place: an API black-hole, and an agent killed and restarted from its checkpoint in the middle
/// of it, change no route of either family and no map, and IPv6 traffic keeps flowing.
#[test]
fn an_api_outage_changes_no_ipv6_route_and_ipv6_traffic_keeps_flowing() {
    let c = Cluster::builder("krt-ds-outage").dual_stack().pods_per_node(2).build().unwrap();
    for node in &c.nodes {
        node.ns.wait_addresses_settled().unwrap();
    }
    c.add_service(Svc::cluster_ip("web", "10.96.1.50").dual_stack("fd00:96::50").select("pod", "pod-2-0")).unwrap();
    wait_listed(&c, "fd00:96::50");
    // pod-2-0 admits only pod-1-0: the IPv6 policy maps have entries to keep.
    c.server.apply(ingress_policy("only-pod-1-0", "pod-2-0", Some("pod-1-0"))).unwrap();
    let target = v6(c.pod(1, 0).ip6.as_deref().unwrap(), 8080);
    wait_denied(&c.pod(0, 1).ns, &target).unwrap();
    let probe = |ns: &Netns, target: &str| {
        ns.spawn_collecting(&[netprobe_bin().to_str().unwrap(), "probe", target, "200"]).unwrap()
    };
    let across = probe(&c.pod(0, 0).ns, &target);
    let through_service = probe(&c.pod(0, 0).ns, "[fd00:96::50]:80");
    thread::sleep(Duration::from_secs(2));
    let maps = c.agent_maps();
    let routes = c.routes();
    let v6_routes: Vec<String> =
        c.nodes.iter().map(|n| n.ns.run(&["ip", "-6", "route", "show", "table", "all"]).unwrap()).collect();

    let outage = Duration::from_secs(20);
    c.set_api(FaultMode::BlackHole);
    let started = Instant::now();
    let mut restarted = false;
    while started.elapsed() < outage {
        thread::sleep(Duration::from_secs(5));
        if !restarted {
            // A cold start from the checkpoint with the API still down re-adopts both families.
            c.restart_agent(0).unwrap();
            restarted = true;
            thread::sleep(Duration::from_secs(2));
        }
        assert!(c.agents_running(), "an agent died {:?} into the outage", started.elapsed());
        assert_eq!(c.agent_maps(), maps, "maps changed {:?} into the outage", started.elapsed());
    }
    let v6_after: Vec<String> =
        c.nodes.iter().map(|n| n.ns.run(&["ip", "-6", "route", "show", "table", "all"]).unwrap()).collect();
    assert_eq!(v6_after, v6_routes, "IPv6 routes changed during the outage");
    assert_eq!(c.routes(), routes, "routes changed during the outage");
    c.set_api(FaultMode::Normal);

    for (path, replies) in [("pod to pod", &across), ("through the IPv6 ClusterIP", &through_service)] {
        let replies = replies.lock().unwrap();
        let failed: Vec<&String> = replies.iter().filter(|r| !r.starts_with("pod-2-0")).collect();
        assert!(failed.is_empty(), "{path}: {} of {} IPv6 probes failed: {failed:?}", failed.len(), replies.len());
        assert!(replies.len() > outage.as_millis() as usize / 400, "{path}: only {} probes", replies.len());
    }
    // The policy still holds after all that: the other pod is still denied over IPv6.
    assert!(netprobe(&c.pod(0, 1).ns, &["timed", "tcp", &target]).starts_with("ERR"));
}

/// A pod's kernel keeps source ports unique per peer, and the peer of a connection through a
/// Service is the ClusterIP: right after one, the same port may open a connection straight to the
/// backend that served it. The earlier flow's reverse entry matches that connection's replies
/// (same backend address and port, same client address and port) and, until it expired, would
/// rewrite them to come from the ClusterIP: the connection could not open. Its first packet now
/// releases the closed flow's tuple. Over both families.
/// (An open Service flow keeps its tuple; see `ct_tuple_clash` in docs/maps.md.)
#[test]
fn a_source_port_reused_after_a_service_connection_reaches_the_backend_directly() {
    let c = Cluster::builder("krt-ds-reuse").dual_stack().build().unwrap();
    c.add_service(Svc::cluster_ip("web", "10.96.1.70").dual_stack("fd00:96::70").select("pod", "pod-2-0")).unwrap();
    wait_listed(&c, "fd00:96::70");
    let (client, backend) = (c.pod(0, 0), c.pod(1, 0));
    let paths = [
        ("10.96.1.70:80".to_string(), format!("{}:8080", backend.ip), client.ip.clone()),
        (v6("fd00:96::70", 80), v6(backend.ip6.as_deref().unwrap(), 8080), client.ip6.clone().unwrap()),
    ];
    for (i, (service, direct, own_address)) in paths.iter().enumerate() {
        let port = (40_000 + i).to_string();
        let reused = c.node(0).stats().get("ct_tuple_reused").copied().unwrap_or_default();
        let answer = format!("pod-2-0 {own_address}");
        assert_eq!(netprobe(&client.ns, &["tcp-from", &port, service, "who"]), answer, "{service}");
        assert_eq!(netprobe(&client.ns, &["tcp-from", &port, direct, "who"]), answer, "{direct} after {service}");
        assert_eq!(c.node(0).stats()["ct_tuple_reused"], reused + 1, "{direct}");

        // The same while the connection through the Service is still open: that connection
        // keeps the tuple and keeps working; the clash is counted (the direct one cannot open:
        // both would be one connection at the backend).
        let port = (40_010 + i).to_string();
        let held =
            client.ns.spawn_collecting(&[netprobe_bin().to_str().unwrap(), "hold", service, "100", &port]).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while held.lock().unwrap().is_empty() {
            assert!(Instant::now() < deadline, "{service}: the held connection never answered");
            thread::sleep(Duration::from_millis(20));
        }
        let clashes = c.node(0).stats().get("ct_tuple_clash").copied().unwrap_or_default();
        netprobe(&client.ns, &["tcp-from", &port, direct, "who"]);
        assert!(c.node(0).stats()["ct_tuple_clash"] > clashes, "{direct} while {service} is open from the same port");
        let replies_before = held.lock().unwrap().len();
        let deadline = Instant::now() + Duration::from_secs(10);
        while held.lock().unwrap().len() < replies_before + 3 {
            assert!(Instant::now() < deadline, "{service}: the held connection stopped");
            thread::sleep(Duration::from_millis(20));
        }
        let held = held.lock().unwrap();
        assert!(held.iter().all(|r| r == "pod-2-0"), "{service}: {held:?}");
    }
}

/// Waits until every node's `kube-router services` lists a frontend containing `needle`.
fn wait_listed(c: &Cluster, needle: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !c.nodes.iter().all(|n| n.services().contains(needle)) {
        assert!(Instant::now() < deadline, "{needle} never programmed:\n{}", c.node(0).services());
        thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_dual_stack_service_answers_on_both_cluster_ips_and_its_ipv6_node_port_from_the_same_backend() {
    let c = Cluster::builder("krt-ds-svc").dual_stack().build().unwrap();
    let svc = Svc::node_port("web", "10.96.1.10", 30080).dual_stack("fd00:96::10").select("pod", "pod-2-0");
    c.add_service(svc).unwrap();
    wait_listed(&c, "fd00:96::10");
    let pod = c.pod(0, 0);
    let pod6 = pod.ip6.clone().unwrap();
    for target in ["10.96.1.10:80", "[fd00:96::10]:80"] {
        let replies = pod.request("tcp", target, 10);
        assert!(replies.iter().all(|r| r == "pod-2-0"), "{target}: {replies:?}");
    }
    let replies = pod.request("udp", "[fd00:96::10]:53", 10);
    assert!(replies.iter().all(|r| r == "pod-2-0"), "{replies:?}");
    // East-west over IPv6 keeps the client pod's own address, as over IPv4.
    assert_eq!(netprobe(&pod.ns, &["ask", "tcp", "[fd00:96::10]:80", "who"]), format!("pod-2-0 {pod6}"));
    assert_eq!(netprobe(&pod.ns, &["ask", "tcp", "10.96.1.10:80", "who"]), format!("pod-2-0 {}", pod.ip));

    // From outside, through node-1's IPv6 address: translated to the backend on node-2 and
    // source-NATed to node-1's IPv6 address, as over IPv4.
    let node_port = v6(&node_ip6(0), 30080);
    let replies = request(&c.client, "tcp", &node_port, 10);
    assert!(replies.iter().all(|r| r == "pod-2-0"), "{replies:?}");
    assert_eq!(netprobe(&c.client, &["ask", "tcp", &node_port, "who"]), format!("pod-2-0 {}", node_ip6(0)));
    let replies = request(&c.client, "udp", &v6(&node_ip6(0), 30081), 10);
    assert!(replies.iter().all(|r| r == "pod-2-0"), "{replies:?}");

    // A restarted agent re-adopts both families' entries: no map changes.
    let maps = c.agent_maps();
    c.restart_agent(0).unwrap();
    thread::sleep(Duration::from_secs(3));
    assert_eq!(c.agent_maps(), maps, "a restart rewrote the maps");
    let replies = pod.request("tcp", "[fd00:96::10]:80", 5);
    assert!(replies.iter().all(|r| r == "pod-2-0"), "{replies:?}");
}

/// The IPv6 fail-open is closed: an ingress-isolated pod is judged over IPv6 exactly as over
/// IPv4, for pods on its own node and on the other one.
#[test]
fn an_isolated_pod_is_unreachable_over_ipv6_by_a_denied_peer_and_reachable_by_an_allowed_one() {
    let c = Cluster::builder("krt-ds-pol").dual_stack().pods_per_node(2).build().unwrap();
    let target = c.pod(0, 0);
    let (allowed, denied_remote, denied_local) = (c.pod(1, 0), c.pod(1, 1), c.pod(0, 1));
    let target6 = v6(target.ip6.as_deref().unwrap(), 8080);
    let target4 = format!("{}:8080", target.ip);
    for peer in [allowed, denied_remote, denied_local] {
        assert!(netprobe(&peer.ns, &["timed", "tcp", &target6]).starts_with("OK"), "{} before the policy", peer.name);
    }
    c.server.apply(ingress_policy("only-pod-2-0", &target.name, Some(&allowed.name))).unwrap();
    wait_denied(&denied_remote.ns, &target4).unwrap();
    // All at once: each denied exchange waits out netprobe's 2 s timeout.
    let udp6 = v6(target.ip6.as_deref().unwrap(), 5353);
    let cases: Vec<_> = [(allowed, true), (denied_remote, false), (denied_local, false)]
        .into_iter()
        .flat_map(|(peer, open)| {
            [("tcp", &target6), ("udp", &udp6), ("tcp", &target4)].map(|(proto, addr)| (peer, open, proto, addr))
        })
        .collect();
    let outcomes: Vec<String> = thread::scope(|s| {
        let probes: Vec<_> = cases
            .iter()
            .map(|(peer, _, proto, addr)| s.spawn(move || netprobe(&peer.ns, &["timed", proto, addr])))
            .collect();
        probes.into_iter().map(|p| p.join().unwrap()).collect()
    });
    for ((peer, open, proto, addr), outcome) in cases.iter().zip(&outcomes) {
        assert_eq!(outcome.starts_with("OK"), *open, "{} -> {proto} {addr}: {outcome}", peer.name);
    }
    // The allowed peer is seen with its own IPv6 address.
    let who = netprobe(&allowed.ns, &["ask", "tcp", &target6, "who"]);
    assert_eq!(who, format!("{} {}", target.name, allowed.ip6.as_deref().unwrap()));
}

/// Pod egress over IPv6: the fabric knows no pod CIDR, so a pod reaches the internet only
/// through its node's masquerade (to the node's IPv6 address), as over IPv4.
#[test]
fn a_pod_reaches_the_internet_over_ipv6_masqueraded_to_its_node() {
    let c = Cluster::builder("krt-ds-egress").dual_stack().build().unwrap();
    let pod = c.pod(0, 0);
    let internet = v6(INTERNET_ADDR6, 8080);
    assert_eq!(netprobe(&pod.ns, &["ask", "tcp", &internet, "who"]), format!("internet {}", node_ip6(0)));
    assert_eq!(
        netprobe(&pod.ns, &["ask", "udp", &v6(INTERNET_ADDR6, 5353), "who"]),
        format!("internet {}", node_ip6(0))
    );
    // Pod to pod across nodes stays unmasqueraded.
    let other = v6(c.pod(1, 0).ip6.as_deref().unwrap(), 8080);
    assert_eq!(netprobe(&pod.ns, &["ask", "tcp", &other, "who"]), format!("pod-2-0 {}", pod.ip6.as_deref().unwrap()));
}

/// `kube-router stats` counter `name` on node `i`, read again after `f`: how much `f` added.
fn counted(c: &Cluster, i: usize, name: &str, f: impl FnOnce()) -> u64 {
    let before = c.node(i).stats().get(name).copied().unwrap_or(0);
    f();
    c.node(i).stats().get(name).copied().unwrap_or(0) - before
}

/// One exchange that must be refused at once (a TCP RST or an ICMPv6 port unreachable from the
/// datapath), not time out.
fn assert_refused_at_once(ns: &Netns, proto: &str, target: &str) {
    let out = netprobe(ns, &["timed", proto, target]);
    assert!(out.contains("Connection refused"), "{proto} {target}: {out}");
    let ms: f64 = out.rsplit(' ').next().unwrap().parse().unwrap();
    assert!(ms < 50.0, "{proto} {target} refused only after {ms} ms: not a timeout");
}

fn assert_all_from(replies: &[String], backend: &str, what: &str) {
    assert!(!replies.is_empty() && replies.iter().all(|r| r == backend), "{what}: expected {backend}: {replies:?}");
}

/// The Service paths of `cluster_paths.rs`, over IPv6, walked in sequence on one dual-stack
/// cluster (each path's own IPv4 test stays there): hairpin, `externalTrafficPolicy: Local`,
/// ExternalIP and LoadBalancer IP source-NATed to a backend on the other node, with
/// `loadBalancerSourceRanges`, REJECT without endpoints, fragments and "packet too big" of
/// translated flows, healthCheckNodePort on the node's IPv6 address.
#[test]
fn every_cluster_paths_service_path_over_ipv6() {
    let c = Cluster::builder("krt-ds-paths").dual_stack().build().unwrap();
    let (pod1, client) = (c.pod(0, 0), &c.client);
    let (node1, node2) = (node_ip6(0), node_ip6(1));
    let step = Instant::now();
    let lap = |path: &str| println!("{path}: {} ms", step.elapsed().as_millis());
    let services = [
        Svc::node_port("self", "10.96.1.40", 30080).dual_stack("fd00:96::40").select("pod", "pod-1-0"),
        Svc::load_balancer("local", "10.96.1.30", 30090, "198.51.100.30")
            .dual_stack("fd00:96::30")
            .select("pod", "pod-1-0")
            .load_balancer_ip("2001:db8:51::30")
            .local()
            .health_check_node_port(32000),
        Svc::load_balancer("web", "10.96.1.20", 30100, "198.51.100.20")
            .dual_stack("fd00:96::20")
            .load_balancer_ip("2001:db8:51::20")
            .external_ip("2001:db8:2::20")
            .select("pod", "pod-2-0")
            .source_range("192.168.100.0/24")
            .source_range("fd00:c::/64"),
        Svc::load_balancer("closed", "10.96.1.21", 30110, "198.51.100.21")
            .dual_stack("fd00:96::21")
            .load_balancer_ip("2001:db8:51::21")
            .select("pod", "pod-2-0")
            .source_range("10.1.0.0/16")
            .source_range("fd00:1::/64"),
        Svc::node_port("empty", "10.96.1.50", 30120).dual_stack("fd00:96::50").select("pod", "nobody"),
    ];
    for svc in services {
        c.add_service(svc).unwrap();
    }
    for vip in ["2001:db8:51::20", "2001:db8:2::20", "2001:db8:51::21", "2001:db8:51::30"] {
        c.route_via(vip, 0).unwrap();
    }
    for frontend in ["[fd00:96::50]:80", "[2001:db8:51::21]:80", "[2001:db8:2::20]:80"] {
        c.wait_programmed(frontend, true).unwrap();
    }
    lap("five dual-stack Services programmed");

    // Hairpin: a pod calling its own Service sees the connection come from the Service address.
    assert_all_from(&pod1.request("tcp", "[fd00:96::40]:80", 5), "pod-1-0", "hairpin TCP");
    assert_all_from(&pod1.request("udp", "[fd00:96::40]:53", 5), "pod-1-0", "hairpin UDP");
    assert_eq!(netprobe(&pod1.ns, &["ask", "tcp", "[fd00:96::40]:80", "who"]), "pod-1-0 fd00:96::40");
    assert_all_from(&pod1.request("tcp", &v6(&node1, 30080), 5), "pod-1-0", "hairpin through the NodePort");
    lap("hairpin");

    // Local: the node with the endpoint serves and keeps the client address; the other refuses
    // instead of forwarding.
    assert_eq!(netprobe(client, &["ask", "tcp", &v6(&node1, 30090), "who"]), format!("pod-1-0 {CLIENT_ADDR6}"));
    assert_eq!(netprobe(client, &["ask", "udp", &v6(&node1, 30091), "who"]), format!("pod-1-0 {CLIENT_ADDR6}"));
    let lb_ip = netprobe(client, &["ask", "tcp", "[2001:db8:51::30]:80", "who"]);
    assert_eq!(lb_ip, format!("pod-1-0 {CLIENT_ADDR6}"), "the Local Service's LoadBalancer IP");
    let forwarded = counted(&c, 1, "snat_new_flow", || assert_refused_at_once(client, "tcp", &v6(&node2, 30090)));
    assert_eq!(forwarded, 0, "node-2 forwarded a Local flow");
    lap("traffic policy Local");

    // ExternalIP and LoadBalancer IP through node-1, backend on node-2: source-NATed to node-1.
    let snat = counted(&c, 0, "snat_new_flow", || {
        for frontend in ["[2001:db8:2::20]:80", "[2001:db8:51::20]:80"] {
            assert_all_from(&request(client, "tcp", frontend, 10), "pod-2-0", frontend);
            assert_eq!(netprobe(client, &["ask", "tcp", frontend, "who"]), format!("pod-2-0 {node1}"), "{frontend}");
        }
        assert_all_from(&request(client, "udp", "[2001:db8:2::20]:53", 10), "pod-2-0", "ExternalIP UDP");
        assert_all_from(&request(client, "udp", "[2001:db8:51::20]:53", 10), "pod-2-0", "LoadBalancer IP UDP");
    });
    assert!(snat >= 42, "{snat} SNAT flows for 42 connections");
    println!("ExternalIP / LoadBalancer IP: {snat} flows source-NATed");
    // A client outside the Service's ranges never connects; its NodePort stays open.
    let dropped = counted(&c, 0, "source_range_drop", || {
        let refused = netprobe(client, &["timed", "tcp", "[2001:db8:51::21]:80"]);
        assert!(refused.starts_with("ERR"), "a client outside the ranges connected: {refused}");
    });
    assert!(dropped >= 1, "{dropped}");
    println!("source ranges: {dropped} SYNs dropped");
    assert_all_from(&request(client, "tcp", &v6(&node1, 30110), 5), "pod-2-0", "the closed Service's NodePort");
    lap("ExternalIP, LoadBalancer IP, source ranges");

    // Without endpoints: refused at once from a pod (ClusterIP) and from outside (NodePort).
    let rejected = counted(&c, 0, "reject_sent", || {
        assert_refused_at_once(&pod1.ns, "tcp", "[fd00:96::50]:80");
        assert_refused_at_once(&pod1.ns, "udp", "[fd00:96::50]:53");
    });
    assert!(rejected >= 2, "{rejected}");
    let rejected = counted(&c, 1, "reject_sent", || {
        assert_refused_at_once(client, "tcp", &v6(&node2, 30120));
        assert_refused_at_once(client, "udp", &v6(&node2, 30121));
    });
    assert!(rejected >= 2, "{rejected}");
    lap("REJECT");

    // healthCheckNodePort on each node's IPv6 address (and the same listener's IPv4 one).
    let health = |node: &str, status: &str| -> serde_json::Value {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let out = netprobe(client, &["http", node, "/healthz"]);
            let (got, body) = out.split_once('\n').unwrap_or((&out, ""));
            if got == status {
                return serde_json::from_str(body).unwrap();
            }
            assert!(Instant::now() < deadline, "{node}: health check {out}, expected {status}");
            thread::sleep(Duration::from_millis(100));
        }
    };
    assert_eq!(health(&v6(&node1, 32000), "200")["localEndpoints"], 1);
    assert_eq!(health(&v6(&node2, 32000), "503")["localEndpoints"], 0);
    assert_eq!(health("10.100.0.1:32000", "200")["localEndpoints"], 1);
    lap("healthCheckNodePort");

    // A 4 KB UDP answer leaves the backend in IPv6 fragments, each translated back.
    let translated = counted(&c, 0, "fragment_nat", || {
        assert_eq!(netprobe(&pod1.ns, &["ask", "udp", "[fd00:96::20]:53", "big 4000"]), "pod-2-0 4000 bytes");
    });
    assert!(translated >= 2, "{translated} fragments translated");
    println!("fragments: {translated} translated");
    lap("fragments");

    // "Packet too big" about a translated flow reaches the client translated: node-2 forwards
    // into its pod bridge at MTU 1400 while the backend advertises an MSS for 1500 (last: this
    // changes node-2 for good).
    c.node(1).set_pod_bridge_mtu(1400).unwrap();
    // East-west (destination NAT only) and north-south (source-NATed to node-1 as well: the
    // error comes back to node-1's address and must reach the client).
    for (ns, target) in [(&pod1.ns, "[fd00:96::20]:80"), (client, "[2001:db8:51::20]:80")] {
        let translated = counted(&c, 0, "icmp_error_nat", || {
            let out = netprobe(ns, &["bulk", target, "2000000"]);
            assert_eq!(out, "pod-2-0 2000000", "2 MB to {target} with PMTU discovery");
        });
        assert!(translated >= 1, "{target}: no packet too big translated");
        println!("packet too big to {target}: {translated} translated");
    }
    // node-1's own path to the backend smaller still: node-1 routes the source-NATed segments
    // itself and answers those that do not fit with "packet too big" for the client.
    let backend = format!("{}/128", c.pod(1, 0).ip6.as_ref().unwrap());
    c.node(0).ns.run(&["ip", "-6", "route", "add", &backend, "via", &node2, "mtu", "lock", "1300"]).unwrap();
    let answered = counted(&c, 0, "frag_needed_sent", || {
        let out = netprobe(client, &["bulk", "[2001:db8:51::20]:80", "2000000"]);
        assert_eq!(out, "pod-2-0 2000000", "2 MB over node-1's 1,300-byte path");
    });
    assert!(answered >= 1, "no packet too big sent by node-1");
    println!("upload over a 1,300-byte path: {answered} packet too big sent");
    lap("packet too big");
    assert_eq!(c.node(0).stats()["redirect_failed"], 0, "node-1 dropped packets it routes");
}
