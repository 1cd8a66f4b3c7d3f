//! Every Service path of a real cluster, each its own test, on the multi-node harness
//! (`kube_router_tests::cluster`): real CNI-wired pods on two nodes, an external client and an
//! "internet" host behind a router, agents in API mode routing pod CIDRs with their own BGP.
//! Real TCP and UDP connections throughout. As root, in network namespaces. The same paths over
//! IPv6: `dual_stack.rs`, `every_cluster_paths_service_path_over_ipv6`.
use std::{
    thread,
    time::{Duration, Instant},
};

use kube_router_tests::{
    apiserver::FaultMode,
    cluster::{assert_all_from, ingress_policy, netprobe, request, wait_denied, wait_for, Cluster, Svc, CLIENT_ADDR},
    TestCgroup,
};

#[test]
fn cluster_ip_from_a_pod_to_a_backend_on_another_node() {
    let c = Cluster::builder("krt-cp-cip").build().unwrap();
    c.add_service(Svc::cluster_ip("web", "10.96.1.10").select("pod", "pod-2-0")).unwrap();
    assert_all_from(&c.pod(0, 0).request("tcp", "10.96.1.10:80", 10), "pod-2-0");
    assert_all_from(&c.pod(0, 0).request("udp", "10.96.1.10:53", 10), "pod-2-0");
    // The backend sees the client pod's own address (east-west traffic is not source-NATed).
    let who = netprobe(&c.pod(0, 0).ns, &["ask", "tcp", "10.96.1.10:80", "who"]);
    assert_eq!(who, format!("pod-2-0 {}", c.pod(0, 0).ip));
}

#[test]
fn north_south_to_a_backend_on_the_other_node_is_source_natted() {
    let c = Cluster::builder("krt-cp-ns").build().unwrap();
    let svc = Svc::load_balancer("web", "10.96.1.20", 30080, "198.51.100.20")
        .select("pod", "pod-2-0")
        .external_ip("192.0.2.20");
    c.add_service(svc).unwrap();
    // ExternalIP and LoadBalancer IP reach the cluster through node-1 (the other node).
    c.route_via("192.0.2.20", 0).unwrap();
    c.route_via("198.51.100.20", 0).unwrap();
    for frontend in ["10.100.0.1:30080", "192.0.2.20:80", "198.51.100.20:80"] {
        assert_all_from(&request(&c.client, "tcp", frontend, 10), "pod-2-0");
        // The backend sees node-1, which took the connection (as kube-proxy masquerades).
        assert_eq!(netprobe(&c.client, &["ask", "tcp", frontend, "who"]), "pod-2-0 10.100.0.1", "{frontend}");
    }
    assert_all_from(&request(&c.client, "udp", "10.100.0.1:30081", 10), "pod-2-0");
    assert_all_from(&request(&c.client, "udp", "192.0.2.20:53", 10), "pod-2-0");
    assert!(c.node(0).stats()["snat_new_flow"] >= 35, "{:?}", c.node(0).stats());
    // `kube-router services` names each of these frontends by its Service (the type comes from
    // the checkpoint, written shortly after the sync).
    let web = serde_json::json!({"namespace": "default", "name": "web", "type": "LoadBalancer"});
    wait_for("every frontend of web named", || {
        let Some(listing) = c.node(0).services_json() else { return false };
        ["10.96.1.20:80", "10.100.0.1:30080", "192.0.2.20:80", "198.51.100.20:80"].iter().all(|address| {
            let found = listing["frontends"].as_array().into_iter().flatten().find(|f| f["address"] == *address);
            found.is_some_and(|f| f["service"] == web)
        })
    });
    // Upstream's names for the same facts: the learned routes in the kernel, the pod CIDR
    // announced, and the Go client's process families.
    let node = c.node(0);
    wait_for("host_routes_synced equal to the kernel's learned routes", || {
        let kernel = node.bgp_routes().lines().count();
        kernel > 0 && node.metric("kube_router_host_routes_synced", "") == kernel as f64
    });
    assert!(node.metric("kube_router_controller_bgp_advertisements_sent", "type=\"pod-route\"") >= 1.0);
    assert!(node.metric("process_resident_memory_bytes", "") > 1e6, "{}", node.metrics());
    // An upload: the client's segments arrive merged (TSO/GRO) and leave node-1 as they came.
    let failed_before = c.node(0).stats()["redirect_failed"];
    assert_eq!(netprobe(&c.client, &["bulk", "10.100.0.1:30080", "2000000"]), "pod-2-0 2000000");
    assert_eq!(c.node(0).stats()["redirect_failed"], failed_before, "node-1 dropped packets it routes");
}

#[test]
fn local_backends_keep_the_client_address_and_traffic_policy_local_stays_on_the_node() {
    let c = Cluster::builder("krt-cp-local").build().unwrap();
    c.add_service(Svc::node_port("web", "10.96.1.30", 30080).select("pod", "pod-1-0")).unwrap();
    assert_eq!(netprobe(&c.client, &["ask", "tcp", "10.100.0.1:30080", "who"]), format!("pod-1-0 {CLIENT_ADDR}"));

    c.add_service(Svc::node_port("local", "10.96.1.31", 30090).select("pod", "pod-1-0").local()).unwrap();
    assert_eq!(netprobe(&c.client, &["ask", "tcp", "10.100.0.1:30090", "who"]), format!("pod-1-0 {CLIENT_ADDR}"));
    assert_eq!(netprobe(&c.client, &["ask", "udp", "10.100.0.1:30091", "who"]), format!("pod-1-0 {CLIENT_ADDR}"));
    // node-2 has no local endpoint: it refuses instead of forwarding to node-1.
    let refused = netprobe(&c.client, &["timed", "tcp", "10.100.0.2:30090"]);
    assert!(refused.starts_with("ERR connect: Connection refused"), "{refused}");
    assert_eq!(c.node(1).stats()["snat_new_flow"], 0, "node-2 never forwarded a Local flow");
}

#[test]
fn a_pod_reaches_itself_through_its_own_service() {
    let c = Cluster::builder("krt-cp-hairpin").build().unwrap();
    c.add_service(Svc::node_port("self", "10.96.1.40", 30080).select("pod", "pod-1-0")).unwrap();
    let pod = c.pod(0, 0);
    assert_all_from(&pod.request("tcp", "10.96.1.40:80", 5), "pod-1-0");
    assert_all_from(&pod.request("udp", "10.96.1.40:53", 5), "pod-1-0");
    // Its own connection comes in from the Service address (kube-router's hairpin mode).
    assert_eq!(netprobe(&pod.ns, &["ask", "tcp", "10.96.1.40:80", "who"]), "pod-1-0 10.96.1.40");
    // Through its node's NodePort too.
    assert_all_from(&pod.request("tcp", "10.100.0.1:30080", 5), "pod-1-0");
}

#[test]
fn a_service_without_endpoints_refuses_at_once() {
    let c = Cluster::builder("krt-cp-reject").build().unwrap();
    c.add_service(Svc::node_port("empty", "10.96.1.50", 30080).select("pod", "nobody")).unwrap();
    for (ns, proto, target) in [
        (&c.pod(0, 0).ns, "tcp", "10.96.1.50:80"),
        (&c.pod(0, 0).ns, "udp", "10.96.1.50:53"),
        (&c.client, "tcp", "10.100.0.2:30080"),
        (&c.client, "udp", "10.100.0.2:30081"),
    ] {
        let out = netprobe(ns, &["timed", proto, target]);
        assert!(out.contains("Connection refused"), "{proto} {target}: {out}");
        let ms: f64 = out.rsplit(' ').next().unwrap().parse().unwrap();
        assert!(ms < 50.0, "{proto} {target} refused only after {ms} ms: not a timeout");
    }
    assert!(c.node(0).stats()["reject_sent"] >= 2);
}

#[test]
fn path_mtu_discovery_and_large_udp_replies_work_through_a_service() {
    let c = Cluster::builder("krt-cp-mtu").build().unwrap();
    c.add_service(Svc::node_port("web", "10.96.1.60", 30080).select("pod", "pod-2-0")).unwrap();
    // A 1,400-byte hop in front of the backend: node-2 forwards into kube-bridge with MTU 1400,
    // while the backend itself (MTU 1500) advertises a 1460-byte MSS. node-2 answers full-sized
    // segments with "fragmentation needed", which must reach the client translated.
    c.node(1).set_pod_bridge_mtu(1400).unwrap();
    let out = netprobe(&c.pod(0, 0).ns, &["bulk", "10.96.1.60:80", "2000000"]);
    assert_eq!(out, "pod-2-0 2000000", "2 MB through the ClusterIP with PMTU discovery");
    assert!(c.node(0).stats()["icmp_error_nat"] >= 1, "{:?}", c.node(0).stats());
    // North-south, source-NATed to node-1: the error comes to node-1's address, for the client.
    let before = c.node(0).stats()["icmp_error_nat"];
    let out = netprobe(&c.client, &["bulk", "10.100.0.1:30080", "2000000"]);
    assert_eq!(out, "pod-2-0 2000000", "2 MB through the NodePort with PMTU discovery");
    assert!(c.node(0).stats()["icmp_error_nat"] > before, "{:?}", c.node(0).stats());
    // A smaller MTU on node-1's own path to the backend (a tunnel, an overlay: here its route,
    // locked as forwarding needs): node-1 routes the source-NATed segments itself and must
    // answer those that do not fit with "fragmentation needed" for the client (they were
    // dropped silently and the upload stalled).
    let backend = format!("{}/32", c.pod(1, 0).ip);
    c.node(0).ns.run(&["ip", "route", "add", &backend, "via", "10.100.0.2", "mtu", "lock", "1300"]).unwrap();
    let (answered, failed) = (c.node(0).stats()["frag_needed_sent"], c.node(0).stats()["redirect_failed"]);
    let started = Instant::now();
    let out = netprobe(&c.client, &["bulk", "10.100.0.1:30080", "2000000"]);
    assert_eq!(out, "pod-2-0 2000000", "2 MB through the NodePort over node-1's 1,300-byte path");
    let answered = c.node(0).stats()["frag_needed_sent"] - answered;
    assert!(answered >= 1, "{:?}", c.node(0).stats());
    assert_eq!(c.node(0).stats()["redirect_failed"], failed, "node-1 dropped packets it routes");
    println!("upload over a 1,300-byte path: {answered} fragmentation needed sent, {:?}", started.elapsed());

    // A 4 KB UDP answer arrives in fragments, every one translated back to the ClusterIP.
    let c2 = Cluster::builder("krt-cp-frag").build().unwrap();
    c2.add_service(Svc::cluster_ip("web", "10.96.1.61").select("pod", "pod-2-0")).unwrap();
    assert_eq!(netprobe(&c2.pod(0, 0).ns, &["ask", "udp", "10.96.1.61:53", "big 4000"]), "pod-2-0 4000 bytes");
    assert!(c2.node(0).stats()["fragment_nat"] >= 2, "{:?}", c2.node(0).stats());
}

#[test]
fn udp_moves_off_a_removed_backend_while_established_tcp_stays() {
    let c = Cluster::builder("krt-cp-moved").pods_per_node(2).build().unwrap();
    c.add_service(Svc::cluster_ip("web", "10.96.1.70").select("node", "node-2")).unwrap();
    let client = &c.pod(0, 0).ns;
    let tcp = client
        .spawn_collecting(&[kube_router_tests::netprobe_bin().to_str().unwrap(), "hold", "10.96.1.70:80", "100"])
        .unwrap();
    let udp = client
        .spawn_collecting(&[
            kube_router_tests::netprobe_bin().to_str().unwrap(),
            "udp-fixed",
            "40000",
            "10.96.1.70:53",
            "60",
            "100",
        ])
        .unwrap();
    thread::sleep(Duration::from_secs(1));
    let udp_backend = udp.lock().unwrap().last().cloned().expect("UDP replies");
    let tcp_backend = tcp.lock().unwrap().last().cloned().expect("TCP replies");
    // The UDP flow's backend goes away (not ready; the pod still runs).
    c.set_ready(&udp_backend, false).unwrap();
    c.wait_backends("10.96.1.70:53", 1).unwrap();
    let removed_at = Instant::now();
    let moved = loop {
        let last = udp.lock().unwrap().last().cloned().unwrap_or_default();
        if last.starts_with("pod-") && last != udp_backend {
            break removed_at.elapsed();
        }
        assert!(removed_at.elapsed() < Duration::from_secs(3), "UDP still on {udp_backend}: {:?}", udp.lock().unwrap());
        thread::sleep(Duration::from_millis(20));
    };
    assert!(moved < Duration::from_secs(1), "UDP moved only after {moved:?}");
    // The held TCP connection never broke, whichever backend it was on.
    thread::sleep(Duration::from_secs(1));
    let replies = tcp.lock().unwrap().clone();
    assert!(replies.iter().all(|r| *r == tcp_backend), "TCP connection broken or moved: {replies:?}");
}

/// The outage promise on this harness: clients through every path above every 200 ms during an
/// API black-hole; nothing fails, no map the agents write and no route changes.
#[test]
fn an_api_outage_changes_nothing_on_any_path() {
    let c = Cluster::builder("krt-cp-outage").build().unwrap();
    let svc = Svc::load_balancer("web", "10.96.1.80", 30080, "198.51.100.80")
        .select("pod", "pod-2-0")
        .external_ip("192.0.2.80");
    c.add_service(svc).unwrap();
    c.add_service(Svc::node_port("self", "10.96.1.81", 30090).select("pod", "pod-1-0")).unwrap();
    c.add_service(Svc::node_port("local", "10.96.1.82", 30100).select("pod", "pod-1-0").local()).unwrap();
    c.route_via("192.0.2.80", 0).unwrap();
    c.route_via("198.51.100.80", 0).unwrap();
    for node in &c.nodes {
        node.ns.wait_addresses_settled().unwrap();
    }
    let probe = |ns: &kube_router_tests::Netns, target: &str| {
        ns.spawn_collecting(&[kube_router_tests::netprobe_bin().to_str().unwrap(), "probe", target, "200"]).unwrap()
    };
    let probes = [
        ("pod -> ClusterIP on the other node", probe(&c.pod(0, 0).ns, "10.96.1.80:80")),
        ("client -> NodePort, backend on the other node", probe(&c.client, "10.100.0.1:30080")),
        ("client -> ExternalIP", probe(&c.client, "192.0.2.80:80")),
        ("client -> LoadBalancer IP", probe(&c.client, "198.51.100.80:80")),
        ("client -> NodePort, local policy", probe(&c.client, "10.100.0.1:30100")),
        ("pod -> its own Service (hairpin)", probe(&c.pod(0, 0).ns, "10.96.1.81:80")),
    ];
    thread::sleep(Duration::from_secs(2));
    let maps = c.agent_maps();
    let routes = c.routes();

    // Past the agents' longest client timeout (30 s, the API read timeout): every watch has
    // failed and is retrying. api_outage.rs holds its outage through a second timeout.
    let outage = Duration::from_secs(std::env::var("KRT_OUTAGE_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(40));
    c.set_api(FaultMode::BlackHole);
    let started = Instant::now();
    while started.elapsed() < outage {
        thread::sleep(Duration::from_secs(5));
        assert!(c.agents_running(), "an agent died {:?} into the outage", started.elapsed());
        assert_eq!(c.agent_maps(), maps, "maps changed {:?} into the outage", started.elapsed());
    }
    assert_eq!(c.routes(), routes, "routes changed during the outage");
    c.set_api(FaultMode::Normal);
    for (path, replies) in &probes {
        let replies = replies.lock().unwrap();
        let failed: Vec<&String> = replies.iter().filter(|r| !r.starts_with("pod-")).collect();
        assert!(failed.is_empty(), "{path}: {} of {} failed: {failed:?}", failed.len(), replies.len());
        let expected = outage.as_millis() as usize / 400;
        assert!(replies.len() > expected, "{path}: only {} probes", replies.len());
    }
}

#[test]
fn health_check_node_port_answers_as_local_endpoints_come_and_go() {
    let c = Cluster::builder("krt-cp-hc").build().unwrap();
    let svc = Svc::load_balancer("web", "10.96.1.90", 30080, "198.51.100.90")
        .select("pod", "pod-1-0")
        .local()
        .health_check_node_port(32000);
    c.add_service(svc).unwrap();
    let check = |node: &str| -> (String, serde_json::Value) {
        let out = netprobe(&c.client, &["http", &format!("{node}:32000"), "/healthz"]);
        let (status, body) = out.split_once('\n').unwrap_or((&out, ""));
        (status.to_string(), serde_json::from_str(body).unwrap_or_default())
    };
    let wait_for_health = |node: &str, status: &str| {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (got, body) = check(node);
            if got == status {
                return body;
            }
            assert!(Instant::now() < deadline, "{node}: health check {got}, expected {status}");
            thread::sleep(Duration::from_millis(100));
        }
    };
    let body = wait_for_health("10.100.0.1", "200");
    assert_eq!(body["localEndpoints"], 1);
    assert_eq!(body["service"]["name"], "web");
    assert_eq!(wait_for_health("10.100.0.2", "503")["localEndpoints"], 0, "node-2 has no local endpoint");
    c.set_ready("pod-1-0", false).unwrap();
    assert_eq!(wait_for_health("10.100.0.1", "503")["localEndpoints"], 0);
    c.set_ready("pod-1-0", true).unwrap();
    wait_for_health("10.100.0.1", "200");
}

#[test]
fn external_ips_outside_the_allowed_ranges_are_refused_and_the_rest_is_programmed() {
    let c = Cluster::builder("krt-cp-extip")
        .agent_args(&["--service-external-ip-range", "192.0.2.0/24", "--cluster-cidr", "10.244.0.0/16"])
        .build()
        .unwrap();
    let svc = Svc::cluster_ip("web", "10.96.1.95")
        .select("pod", "pod-2-0")
        .external_ip("192.0.2.30")
        .external_ip("198.51.100.30")
        .external_ip("10.244.1.77");
    c.add_service(svc).unwrap();
    c.wait_programmed("192.0.2.30:80", true).unwrap();
    for node in &c.nodes {
        let services = node.services();
        assert!(!services.contains("198.51.100.30") && !services.contains("10.244.1.77"), "{services}");
        assert_eq!(node.metric("kube_router_rejected_objects_total", "kind=\"ExternalIP\""), 2.0);
    }
    c.route_via("192.0.2.30", 0).unwrap();
    assert_all_from(&request(&c.client, "tcp", "192.0.2.30:80", 5), "pod-2-0");
    assert_all_from(&c.pod(0, 0).request("tcp", "10.96.1.95:80", 5), "pod-2-0");
}

#[test]
fn a_local_policy_vip_is_advertised_only_by_nodes_with_a_local_endpoint() {
    let c = Cluster::builder("krt-cp-vip")
        .tor_bgp()
        .agent_args(&["--advertise-external-ip=true", "--advertise-loadbalancer-ip=true"])
        .build()
        .unwrap();
    let svc = Svc::load_balancer("web", "10.96.1.99", 30080, "198.51.100.99")
        .select("pod", "pod-1-0")
        .external_ip("192.0.2.99")
        .local();
    c.add_service(svc).unwrap();
    let wait_tor = |node: usize, present: bool| {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let received = c.tor_received(node);
            let has = received.contains("192.0.2.99/32") && received.contains("198.51.100.99/32");
            let none = !received.contains("192.0.2.99/32") && !received.contains("198.51.100.99/32");
            if (present && has) || (!present && none) {
                return received;
            }
            assert!(Instant::now() < deadline, "node-{} advertises the VIPs: expected {present}\n{received}", node + 1);
            thread::sleep(Duration::from_millis(200));
        }
    };
    // Only node-1 has the endpoint; both advertise their pod CIDRs to the ToR.
    assert!(wait_tor(0, true).contains("10.244.1.0/24"));
    assert!(wait_tor(1, false).contains("10.244.2.0/24"));
    // The endpoint goes away: node-1 withdraws the VIPs.
    c.set_ready("pod-1-0", false).unwrap();
    wait_tor(0, false);
    c.set_ready("pod-1-0", true).unwrap();
    wait_tor(0, true);
    wait_tor(1, false);
}

#[test]
fn load_balancer_source_ranges_admit_only_the_listed_clients() {
    let c = Cluster::builder("krt-cp-lbsr").build().unwrap();
    let open = Svc::load_balancer("open", "10.96.1.110", 30080, "198.51.100.110").select("pod", "pod-2-0");
    let allowed = Svc::load_balancer("allowed", "10.96.1.111", 30090, "198.51.100.111")
        .select("pod", "pod-2-0")
        .source_range("192.168.100.0/24");
    let closed = Svc::load_balancer("closed", "10.96.1.112", 30100, "198.51.100.112")
        .select("pod", "pod-2-0")
        .source_range("10.1.0.0/16")
        .source_range("fd00:1::/64");
    for svc in [open, allowed, closed] {
        c.add_service(svc).unwrap();
    }
    for vip in ["198.51.100.110", "198.51.100.111", "198.51.100.112"] {
        c.route_via(vip, 0).unwrap();
    }
    assert_all_from(&request(&c.client, "tcp", "198.51.100.110:80", 5), "pod-2-0");
    assert_all_from(&request(&c.client, "tcp", "198.51.100.111:80", 5), "pod-2-0");
    assert_all_from(&request(&c.client, "udp", "198.51.100.111:53", 5), "pod-2-0");
    let refused = netprobe(&c.client, &["timed", "tcp", "198.51.100.112:80"]);
    assert!(refused.starts_with("ERR"), "a client outside the ranges connected: {refused}");
    assert!(c.node(0).stats()["source_range_drop"] >= 1, "{:?}", c.node(0).stats());
    // The ranges guard the LoadBalancer IP only: the same Service's NodePort and ClusterIP stay open.
    assert_all_from(&request(&c.client, "tcp", "10.100.0.1:30100", 5), "pod-2-0");
    assert_all_from(&c.pod(0, 0).request("tcp", "10.96.1.112:80", 5), "pod-2-0");
}

#[test]
fn a_default_deny_policy_still_lets_the_node_probe_its_pod() {
    let c = Cluster::builder("krt-cp-probe").build().unwrap();
    let target = c.pod(0, 0);
    let target_addr = format!("{}:8080", target.ip);
    // Before: everyone reaches pod-1-0.
    assert_eq!(netprobe(&c.pod(1, 0).ns, &["ask", "tcp", &target_addr, "who"]), format!("pod-1-0 {}", c.pod(1, 0).ip));
    c.server.apply(ingress_policy("deny-to-pod-1-0", "pod-1-0", None)).unwrap();
    // A pod on the other node is denied once the policy is programmed...
    wait_denied(&c.pod(1, 0).ns, &target_addr).unwrap();
    // ...while the node's own probe (kubelet's liveness check, from the node address) connects.
    for _ in 0..5 {
        let from_node = netprobe(&c.node(0).ns, &["ask", "tcp", &target_addr, "who"]);
        assert!(from_node.starts_with("pod-1-0 "), "the node's probe was denied: {from_node}");
    }
    // Counted as exempt (the counters are published every second).
    let deadline = Instant::now() + Duration::from_secs(5);
    while c.node(0).metric("kube_router_policy_packets_total", "node_exempt") < 1.0 {
        assert!(Instant::now() < deadline, "{}", c.node(0).metrics());
        thread::sleep(Duration::from_millis(200));
    }
    assert!(netprobe(&c.pod(1, 0).ns, &["timed", "tcp", &target_addr]).starts_with("ERR"));
}

#[test]
fn the_node_itself_reaches_services_on_both_nodes_through_the_socket_load_balancer() {
    let c = Cluster::builder("krt-cp-sock").socket_lb().build().unwrap();
    // "web" selects every pod: one backend on each node.
    c.add_service(Svc::node_port("web", "10.96.1.120", 30120)).unwrap();
    let node = c.node(0);
    let netprobe = kube_router_tests::netprobe_bin();
    let ask = |mode: &str, target: &str| -> Vec<(String, String)> {
        let out = node.run_as_host_process(&[netprobe.to_str().unwrap(), "peer", mode, target, "30"]).unwrap();
        out.lines()
            .map(|l| {
                let fields: Vec<&str> = l.split_whitespace().collect();
                assert_eq!(fields.first(), Some(&"OK"), "{target} {mode}: {l}");
                (fields[1].to_string(), fields[2].to_string())
            })
            .collect()
    };
    for (mode, target) in
        [("tcp", "10.96.1.120:80"), ("udp", "10.96.1.120:53"), ("tcp", "127.0.0.1:30120"), ("tcp", "10.100.0.1:30120")]
    {
        let replies = ask(mode, target);
        let backends: std::collections::BTreeSet<&str> = replies.iter().map(|(name, _)| name.as_str()).collect();
        assert_eq!(backends, ["pod-1-0", "pod-2-0"].into(), "{mode} {target}: both nodes' backends");
        // The application sees the address it asked for, never a backend's.
        assert!(replies.iter().all(|(_, peer)| peer == target), "{mode} {target}: {replies:?}");
    }
}

/// A pod's Service traffic through the socket load balancer (its cgroup below the one the
/// agent attaches to, as every pod's is below the cgroup v2 root): its packets carry the backend's
/// address from the start, so NetworkPolicy judges the backend's address and port, never the
/// ClusterIP's (docs/datapath.md, "Pods' own Service traffic takes this path too").
#[test]
fn a_pods_service_flow_through_the_socket_load_balancer_is_judged_at_the_backends_address() {
    let c = Cluster::builder("krt-cp-skpol").socket_lb().pods_per_node(2).build().unwrap();
    const VIP: &str = "10.96.1.160";
    c.add_service(Svc::cluster_ip("web", VIP).select("pod", "pod-2-0")).unwrap();
    let node = c.node(0);
    let (client, backend, other) = (c.pod(0, 0), c.pod(1, 0), c.pod(1, 1));
    // pod-1-0's processes in a cgroup below node-1's, removed before the cluster is.
    struct PodCgroup(std::path::PathBuf);
    impl Drop for PodCgroup {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir(&self.0);
        }
    }
    let cgroup = PodCgroup(node.cgroup.as_ref().expect("socket_lb").path.join("kubepods-pod-1-0"));
    std::fs::create_dir(&cgroup.0).unwrap();
    let netprobe_bin = kube_router_tests::netprobe_bin();
    let vip = format!("{VIP}:80");
    let from_the_pod = |count: &str| -> Vec<String> {
        let out = TestCgroup::run(&client.ns, &cgroup.0, &[netprobe_bin.to_str().unwrap(), "peer", "tcp", &vip, count]);
        out.unwrap().lines().map(str::to_string).collect()
    };
    let stats = || -> std::collections::BTreeMap<String, u64> {
        let bin = kube_router_tests::kube_router_bin();
        let root = node.bpf_root.display().to_string();
        kube_router_tests::sh(&[bin.to_str().unwrap(), "--bpf-root", &root, "stats"])
            .unwrap()
            .lines()
            .filter_map(|l| l.split_once(' '))
            .filter_map(|(name, n)| Some((name.to_string(), n.parse().ok()?)))
            .collect()
    };
    let egress_only_to = |cidr: &str, port: u16| {
        serde_json::json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"namespace": "default", "name": "client-egress"},
            "spec": {"podSelector": {"matchLabels": {"pod": "pod-1-0"}}, "policyTypes": ["Egress"],
                "egress": [{"to": [{"ipBlock": {"cidr": cidr}}], "ports": [{"protocol": "TCP", "port": port}]}]}
        })
    };
    let other_target = format!("{}:8080", other.ip);

    // Egress admitted only to the Service range on the Service's port: the ClusterIP is never
    // on the wire, so the socket-balanced flow is denied.
    c.server.apply(egress_only_to("10.96.0.0/12", 80)).unwrap();
    wait_denied(&client.ns, &other_target).unwrap();
    for line in from_the_pod("2") {
        assert!(line.starts_with("ERR"), "admitted by a rule for the ClusterIP: {line}");
    }

    // Egress admitted only to the backend pod's address and port: the flow to the ClusterIP passes.
    let before = stats();
    c.server.apply(egress_only_to(&format!("{}/32", backend.ip), 8080)).unwrap();
    wait_for("the socket-balanced flow admitted", || from_the_pod("1").iter().all(|l| l.starts_with("OK ")));
    let replies = from_the_pod("10");
    for line in &replies {
        let fields: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(fields.get(..3), Some(&["OK", "pod-2-0", vip.as_str()][..]), "{replies:?}");
    }
    // Still isolated otherwise, and balanced at the socket: TC translated none of it.
    assert!(!netprobe(&client.ns, &["timed", "tcp", &other_target]).starts_with("OK"));
    let after = stats();
    let moved = |name: &str| after[name] - before[name];
    assert!(moved("sock_translated") >= 11, "{before:?} -> {after:?}");
    assert_eq!(moved("new_flow"), 0, "the TC load balancer translated a socket-balanced flow");
}

#[test]
fn per_service_counters_under_kube_router_names_count_exactly_that_services_traffic() {
    let c = Cluster::builder("krt-cp-stats").build().unwrap();
    c.add_service(Svc::cluster_ip("web", "10.96.1.40").select("pod", "pod-2-0")).unwrap();
    c.add_service(Svc::cluster_ip("idle", "10.96.1.41").select("pod", "pod-2-0")).unwrap();
    let node = c.node(0);
    let series = |name: &str, port: &str| {
        let proto = if port == "53" { "udp" } else { "tcp" };
        let vip = if name == "web" { "10.96.1.40" } else { "10.96.1.41" };
        format!("svc_namespace=\"default\",service_name=\"{name}\",service_vip=\"{vip}\",protocol=\"{proto}\",port=\"{port}\"")
    };
    let (web, web_dns, idle) = (series("web", "80"), series("web", "53"), series("idle", "80"));
    let counters = [
        "kube_router_service_total_connections",
        "kube_router_service_packets_in",
        "kube_router_service_bytes_in",
        "kube_router_service_packets_out",
        "kube_router_service_bytes_out",
    ];
    // Every programmed frontend has its series from the start, at 0.
    wait_for("the idle Service's series", || {
        node.metrics().contains(&format!("kube_router_service_bytes_in{{{idle}}} 0\n"))
    });

    // The pod on node-1 calls the Service: node-1 translates both directions and counts them.
    const N: usize = 20;
    assert_all_from(&c.pod(0, 0).request("tcp", "10.96.1.40:80", N), "pod-2-0");
    wait_for("N connections", || node.metric("kube_router_service_total_connections", &web) >= N as f64);
    let first: Vec<f64> = counters.iter().map(|name| node.metric(name, &web)).collect();
    // A TCP connection is at least a SYN, an ACK and a request in, a SYN-ACK and a reply out.
    assert!(first[1] >= 3.0 * N as f64 && first[3] >= 2.0 * N as f64, "{first:?}");
    assert!(first[2] >= 40.0 * first[1] && first[4] >= 40.0 * first[3], "IP bytes, at least a header each: {first:?}");

    assert_all_from(&c.pod(0, 0).request("tcp", "10.96.1.40:80", N), "pod-2-0");
    wait_for("2N connections", || node.metric("kube_router_service_total_connections", &web) >= 2.0 * N as f64);
    wait_for("bytes in and out to grow", || {
        node.metric("kube_router_service_bytes_in", &web) > first[2]
            && node.metric("kube_router_service_bytes_out", &web) > first[4]
    });
    // Rates are the difference between two samples; some second saw connections.
    assert!(node.metrics().contains("kube_router_service_cps{"), "cps exported");

    // The other Service, and the other port of this one, saw nothing.
    let scrape = node.metrics();
    for name in counters {
        for other in [&idle, &web_dns] {
            assert!(scrape.contains(&format!("{name}{{{other}}} 0\n")), "{name}{{{other}}} is not 0:\n{scrape}");
        }
    }
    assert!(scrape.contains("kube_router_build_info{goversion=\"rust"), "{scrape}");
}

/// `kube-router monitor` on a node: a connection its policy denies shows up within a second
/// with both pods' names, a new Service flow with the Service's; the monitor is killed and
/// events stop by themselves when its lease runs out. On the way: a pod isolated for ingress
/// still gets the replies of the Service flows it opens to a backend on another node.
#[test]
fn the_monitor_names_the_pods_of_a_denied_connection_and_the_service_of_a_new_flow() {
    let c = Cluster::builder("krt-cp-mon").build().unwrap();
    c.add_service(Svc::cluster_ip("web", "10.96.1.140").select("pod", "pod-2-0")).unwrap();
    let target = format!("{}:8080", c.pod(0, 0).ip);
    c.server.apply(ingress_policy("deny-to-pod-1-0", "pod-1-0", None)).unwrap();
    let denied = || netprobe(&c.pod(1, 0).ns, &["matrix", "300", &format!("tcp:{target}")]).contains(" ERR");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !denied() {
        assert!(Instant::now() < deadline, "the policy never took effect");
        thread::sleep(Duration::from_millis(200));
    }
    let node = c.node(0);
    let bin = kube_router_tests::kube_router_bin();
    let (root, state) = (node.bpf_root.display().to_string(), node.state_dir.display().to_string());
    let agent_cli = |args: &[&str]| -> Vec<String> {
        [bin.to_str().unwrap(), "--bpf-root", &root, "--state-dir", &state]
            .iter()
            .chain(args)
            .map(|s| s.to_string())
            .collect()
    };
    // The monitor names from the checkpoint, which the agent writes a moment after a change:
    // started before the Service reached it, the monitor could not name the Service's flows yet.
    let checkpoint = node.state_dir.join("checkpoint.json");
    wait_for("the Service in the agent's checkpoint", || {
        std::fs::read(&checkpoint).is_ok_and(|text| String::from_utf8_lossy(&text).contains("\"10.96.1.140\""))
    });
    let monitor = agent_cli(&["monitor", "--json"]);
    let events = node.ns.spawn_collecting(&monitor.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
    // Killed with SIGKILL (no chance to clean up; also when this test fails): the lease must end
    // the events by itself.
    struct KillMonitor(String);
    impl Drop for KillMonitor {
        fn drop(&mut self) {
            let _ = std::process::Command::new("pkill").args(["-KILL", "-f", "--", &self.0]).status();
        }
    }
    let monitor = KillMonitor(format!("--bpf-root {root} --state-dir {state} monitor"));
    let parsed = || -> Vec<serde_json::Value> {
        events.lock().unwrap().iter().filter_map(|l| serde_json::from_str(l).ok()).collect()
    };
    let is_drop = |e: &serde_json::Value| {
        e["type"] == "drop"
            && e["src_name"] == "default/pod-2-0"
            && e["dst_name"] == "default/pod-1-0"
            && e["direction"] == "ingress"
    };
    // The monitor takes its lease as it starts: try until one attempt is seen, each within 1 s.
    let deadline = Instant::now() + Duration::from_secs(5);
    let seen_after = loop {
        assert!(Instant::now() < deadline, "no drop event: {:?}", events.lock().unwrap());
        let attempt = Instant::now();
        assert!(denied());
        let waited = loop {
            if parsed().iter().any(is_drop) || attempt.elapsed() > Duration::from_secs(1) {
                break attempt.elapsed();
            }
            thread::sleep(Duration::from_millis(20));
        };
        if parsed().iter().any(is_drop) {
            break waited;
        }
    };
    println!("monitor: drop event {} ms after the attempt", seen_after.as_millis());
    assert!(seen_after <= Duration::from_secs(1));

    // A new flow from node 0's pod to the Service: NATed there, named.
    // (The isolated pod's own Service flow: its reply, translated back to the Service address on
    // the pod bridge before the veth, must still count as a reply; this once failed.)
    let reply = netprobe(&c.pod(0, 0).ns, &["ask", "tcp", "10.96.1.140:80", "who"]);
    assert!(reply.starts_with("pod-2-0"), "an ingress-isolated pod could not use a Service: {reply}");
    let deadline = Instant::now() + Duration::from_secs(2);
    while !parsed().iter().any(|e| {
        e["type"] == "nat"
            && e["src_name"] == "default/pod-1-0"
            && e["service"] == "default/web"
            && e["backend_name"] == "default/pod-2-0"
    }) {
        assert!(Instant::now() < deadline, "no NAT event: {:?}", events.lock().unwrap());
        thread::sleep(Duration::from_millis(20));
    }

    // After the kill and the lease (2 s): denied connections write nothing.
    let stats = |name: &str| -> u64 {
        let out = node.ns.run(&agent_cli(&["stats"]).iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
        out.lines().find_map(|l| l.strip_prefix(&format!("monitor_{name} "))?.parse().ok()).unwrap()
    };
    drop(monitor);
    thread::sleep(Duration::from_millis(2500));
    let emitted = stats("emitted");
    for _ in 0..3 {
        assert!(denied());
    }
    assert_eq!(stats("emitted"), emitted, "events written with no monitor listening");
}
