//! kube-router as the node's whole network agent, on the multi-node harness: the CNI role (the
//! configuration written from the Node object, the bridge), pod egress masquerade to the
//! internet. As root, in network namespaces.
use std::{
    fs, thread,
    time::{Duration, Instant},
};

use kube_router_tests::{
    apiserver::FaultMode,
    cluster::{netprobe, Cluster, INTERNET_ADDR},
};

/// Polls `done` for up to 60 s (watches resume with backoff after an outage: up to 30 s).
fn wait(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(Instant::now() < deadline, "{what}");
        thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn the_cni_configuration_comes_from_the_node_object_and_survives_outage_and_restart() {
    let c = Cluster::builder("krt-ni-cni").build().unwrap();
    let node = c.node(0);
    let path = node.cni_conf_file();
    let conflist: serde_json::Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
    let bridge = &conflist["plugins"][0];
    assert_eq!(bridge["ipam"]["ranges"], serde_json::json!([[{"subnet": "10.244.1.0/24"}]]), "from the Node's podCIDR");
    assert!(bridge["ipam"]["dataDir"].is_string(), "the installed template's settings are kept");
    assert_eq!(bridge["mtu"], 1500, "--auto-mtu: the uplink's MTU");
    let addresses = node.ns.run(&["ip", "-o", "-4", "addr", "show", "dev", "kube-bridge"]).unwrap();
    assert!(addresses.contains("10.244.1.1/24"), "the agent created the pods' gateway: {addresses}");
    // Pods the real plugins wired from it got addresses of their node's range, and reach across.
    assert!(c.pod(0, 0).ip.starts_with("10.244.1.") && c.pod(1, 0).ip.starts_with("10.244.2."));
    assert_eq!(c.pod(0, 0).request("tcp", &format!("{}:8080", c.pod(1, 0).ip), 3), ["pod-2-0"; 3]);

    // Rewritten only on change: not through an API outage, nor by a restart while it lasts.
    let written = fs::metadata(&path).unwrap().modified().unwrap();
    c.set_api(FaultMode::BlackHole);
    c.restart_agent(0).unwrap();
    wait("the restarted agent serves, the API unreachable", || node.metrics().contains("kube_router_api_reachable 0"));
    thread::sleep(Duration::from_secs(2));
    assert_eq!(fs::metadata(&path).unwrap().modified().unwrap(), written, "rewritten during the outage");
    c.set_api(FaultMode::Normal);
    wait("the API is back", || node.metrics().contains("kube_router_api_reachable 1"));
    thread::sleep(Duration::from_secs(1));
    assert_eq!(fs::metadata(&path).unwrap().modified().unwrap(), written, "rewritten with nothing changed");

    // Bad input: a Node that loses its podCIDR. Reported, counted; the configuration stays.
    let mut node2 = c.server.get("Node", None, "node-2").unwrap();
    node2["spec"] = serde_json::json!({});
    c.server.apply(node2).unwrap();
    wait("the error is counted", || c.node(1).metric("kube_router_cni_config_errors_total", "") == 1.0);
    assert!(fs::read_to_string(c.node(1).cni_conf_file()).unwrap().contains("10.244.2.0/24"));
    // The node's pod network stays as it was (BGP, rightly, no longer advertises the range).
    assert_eq!(c.node(1).request("tcp", &format!("{}:8080", c.pod(1, 0).ip), 3), ["pod-2-0"; 3]);
}

#[test]
fn an_unwritable_cni_directory_is_reported_and_the_datapath_still_works() {
    // A configuration path under a regular file cannot be created.
    let c = Cluster::builder("krt-ni-nocni").agent_args(&["--cni-conf-file", "/dev/null/10-kuberouter.conflist"]);
    let err = c.build().err().expect("no pod can be wired without a CNI configuration");
    assert!(format!("{err:#}").contains("did not write its CNI configuration"), "{err:#}");
}

#[test]
fn pods_reach_the_internet_through_the_node_masquerade() {
    let c = Cluster::builder("krt-ni-egress").build().unwrap();
    let pod = c.pod(0, 0);
    // The fabric does not know pod CIDRs: replies can only come back to the node's address.
    assert_eq!(netprobe(&pod.ns, &["ask", "tcp", &format!("{INTERNET_ADDR}:8080"), "who"]), "internet 10.100.0.1");
    assert_eq!(netprobe(&pod.ns, &["ask", "udp", &format!("{INTERNET_ADDR}:5353"), "who"]), "internet 10.100.0.1");
    pod.ns.run(&["ping", "-c", "2", "-W", "2", INTERNET_ADDR]).expect("ping from a pod to the internet");
    // Inside the cluster, addresses are kept.
    let across = netprobe(&pod.ns, &["ask", "tcp", &format!("{}:8080", c.pod(1, 0).ip), "who"]);
    assert_eq!(across, format!("pod-2-0 {}", pod.ip));
    assert!(c.node(0).stats()["egress_masquerade_new_flow"] >= 3);

    // Policy only on the pods' veths; the uplink (default route) and the bridge get the load
    // balancer alone, the uplink its XDP fast path too (`--xdp auto`).
    let node = c.node(0);
    let bin = kube_router_tests::kube_router_bin();
    let listed = node.ns.run(&[bin.to_str().unwrap(), "--bpf-root", node.bpf_root.to_str().unwrap(), "interfaces"]);
    let listed = listed.unwrap();
    let programs = |interface: &str| -> Vec<&str> {
        listed
            .lines()
            .filter(|l| l.split_whitespace().next() == Some(interface))
            .filter_map(|l| l.split_whitespace().nth(1))
            .collect()
    };
    assert_eq!(programs("eth0"), ["kr_lb_egress", "kr_lb_ingress", "kr_xdp_lb"], "{listed}");
    assert_eq!(programs("kube-bridge"), ["kr_lb_egress", "kr_lb_ingress"], "{listed}");
    let pod_veths: Vec<&str> =
        listed.lines().filter_map(|l| l.split_whitespace().next()).filter(|i| i.starts_with("veth")).collect();
    assert!(!pod_veths.is_empty(), "{listed}");
    for veth in pod_veths {
        assert_eq!(programs(veth), ["kr_lb_egress", "kr_lb_ingress", "kr_pol_egress", "kr_pol_ingress"], "{listed}");
    }
}
