//! kube-router as the node's whole network agent, on the multi-node harness: the CNI role (the
//! configuration written from the Node object, the bridge), pod egress masquerade to the
//! internet. As root, in network namespaces.
use std::{
    fs, thread,
    time::{Duration, Instant},
};

use kube_router_tests::{
    apiserver::FaultMode,
    cluster::{ingress_policy, netprobe, wait_denied, Cluster, Svc, INTERNET_ADDR},
    netprobe_bin,
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

    // Policy only on the pods' veths, there with the load balancer in one program per direction;
    // the uplink (default route) and the bridge get the load balancer alone, the uplink its XDP
    // fast path too (`--xdp auto`).
    let (listed, programs) = attached_programs(&c, 0);
    assert_eq!(programs["eth0"], ["kr_lb_egress", "kr_lb_ingress", "kr_xdp_lb"], "{listed}");
    assert_eq!(programs["kube-bridge"], ["kr_lb_egress", "kr_lb_ingress"], "{listed}");
    let pod_veths: Vec<&String> = programs.keys().filter(|i| i.starts_with("veth")).collect();
    assert!(!pod_veths.is_empty(), "{listed}");
    for veth in pod_veths {
        assert_eq!(programs[veth], ["kr_pod_egress", "kr_pod_ingress"], "{listed}");
    }
}

/// `kube-router interfaces` on node `i`: its output, and each interface's programs by name.
fn attached_programs(c: &Cluster, i: usize) -> (String, std::collections::BTreeMap<String, Vec<String>>) {
    let node = c.node(i);
    let bin = kube_router_tests::kube_router_bin();
    let listed = node.ns.run(&[bin.to_str().unwrap(), "--bpf-root", node.bpf_root.to_str().unwrap(), "interfaces"]);
    let listed = listed.unwrap();
    let mut programs = std::collections::BTreeMap::<String, Vec<String>>::new();
    for line in listed.lines() {
        let mut words = line.split_whitespace();
        if let (Some(interface), Some(program)) = (words.next(), words.next()) {
            if program.starts_with("kr_") {
                programs.entry(interface.to_string()).or_default().push(program.to_string());
            }
        }
    }
    (listed, programs)
}

/// An agent that attached the load balancer's and the policy's programs apart, four per pod
/// veth (agents before the combined programs; `KUBE_ROUTER_POD_PROGRAMS=separate` does the
/// same), replaced by one that attaches the combined programs: every pod veth moves to two,
/// in place, while long-lived connections through a Service and to a pod a policy isolates
/// keep talking, a new connection through the Service opens and the pod the policy denies
/// stays denied.
#[test]
fn an_upgrade_moves_pod_veths_from_four_programs_to_two_and_keeps_their_connections() {
    let c = Cluster::builder("krt-ni-onehook")
        .pods_per_node(2)
        .agent_env(&[("KUBE_ROUTER_POD_PROGRAMS", "separate")])
        .build()
        .unwrap();
    c.add_service(Svc::cluster_ip("web", "10.96.1.80").select("pod", "pod-2-0")).unwrap();
    c.wait_backends("10.96.1.80:80", 1).unwrap();
    // pod-1-1 admits pod-1-0 only (same node: its veths judge both ends).
    c.server.apply(ingress_policy("only-pod-1-0", "pod-1-1", Some("pod-1-0"))).unwrap();
    let isolated = format!("{}:8080", c.pod(0, 1).ip);
    wait_denied(&c.pod(1, 0).ns, &isolated).unwrap();
    let pod_veths = |programs: &std::collections::BTreeMap<String, Vec<String>>| -> Vec<Vec<String>> {
        programs.iter().filter(|(i, _)| i.starts_with("veth")).map(|(_, p)| p.clone()).collect()
    };
    let (listed, before) = attached_programs(&c, 0);
    let four = ["kr_lb_egress", "kr_lb_ingress", "kr_pol_egress", "kr_pol_ingress"].map(String::from).to_vec();
    assert_eq!(pod_veths(&before), vec![four; 2], "the older agent's four on each pod veth: {listed}");

    let hold = |from: usize, target: &str| {
        c.pod(0, from).ns.spawn_collecting(&[netprobe_bin().to_str().unwrap(), "hold", target, "100"]).unwrap()
    };
    let through_service = hold(0, "10.96.1.80:80");
    let to_isolated = hold(0, &isolated);
    thread::sleep(Duration::from_secs(1));
    let replies = |held: &std::sync::Arc<std::sync::Mutex<Vec<String>>>| held.lock().unwrap().clone();
    let (service_before, isolated_before) = (replies(&through_service).len(), replies(&to_isolated).len());
    assert!(service_before > 0 && isolated_before > 0, "both connections talk before the upgrade");

    c.restart_agent_with_env(0, &[]).unwrap();
    let two = ["kr_pod_egress", "kr_pod_ingress"].map(String::from).to_vec();
    wait("every pod veth on the two combined programs", || {
        pod_veths(&attached_programs(&c, 0).1) == vec![two.clone(); 2]
    });
    thread::sleep(Duration::from_secs(2));

    for (what, held, before) in [
        ("through the Service", &through_service, service_before),
        ("to the isolated pod", &to_isolated, isolated_before),
    ] {
        let lines = replies(held);
        let broken: Vec<&String> = lines.iter().filter(|l| !l.starts_with("pod-")).collect();
        assert!(broken.is_empty(), "the connection {what} broke: {broken:?}");
        assert!(lines.len() > before + 20, "the connection {what} kept talking: {} replies", lines.len());
    }
    assert!(netprobe(&c.pod(0, 1).ns, &["ask", "tcp", "10.96.1.80:80", "who"]).starts_with("pod-2-0"));
    assert!(netprobe(&c.pod(1, 0).ns, &["timed", "tcp", &isolated]).starts_with("ERR"), "still denied");
    // Nothing of the four is left behind: their pins went with them.
    let (listed, _) = attached_programs(&c, 0);
    assert!(!listed.contains("kr_pol_") && listed.matches("kr_pod_").count() == 4, "{listed}");
}
