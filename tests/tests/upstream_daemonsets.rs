//! Upstream kube-router's DaemonSets as a drop-in (issue 28): the `args` of
//! `generic-kuberouter-all-features.yaml`, `kubeadm-kuberouter-all-features-dsr.yaml` and
//! `generic-kuberouter-only-advertise-routes.yaml`, as transcribed in
//! `kube-router/tests/data/upstream_daemon_set_args.rs`, start the agents of the two-node cluster
//! harness (`kube_router_tests::cluster`, `ClusterBuilder::only_agent_args`: the harness adds
//! only its plumbing, and gives the node name and CNI file through `NODE_NAME` and
//! `KUBE_ROUTER_CNI_CONF_FILE` as those DaemonSets do), and the cluster does what each manifest
//! promises, with real packets between CNI-wired pods, an external client and a gobgpd
//! top-of-rack router. As root, in network namespaces.
//!
//! Substituted, and only these: `--kubeconfig=/var/lib/kube-router/kubeconfig` (a file the
//! DaemonSets mount) becomes the harness's kubeconfig for its API server; the only-advertise
//! manifest, which reaches the API through the pod's service account, gets the same
//! `--kubeconfig`; its `<CHANGE ME>` peer (transcribed as 192.0.2.254, AS 65000) becomes the
//! harness's gobgpd (10.100.0.254, AS 64513), its `--cluster-asn` (65001) is kept and the ToR is
//! told to expect it. Added where the test needs externalIPs or LoadBalancer IPs (the DSR phase,
//! the only-advertise args), as an operator of upstream 2.8 or later must:
//! `--service-external-ip-range` and `--loadbalancer-ip-range` (upstream's
//! `--strict-external-ip-validation`, on by default, refuses every externalIP and LoadBalancer IP
//! without them; the manifests predate it). As written, both are refused here too, as upstream
//! refuses them.
use std::{
    fs, thread,
    time::{Duration, Instant},
};

use kube_router_tests::{
    cluster::{
        assert_all_from, ingress_policy, kubeconfig_path, netprobe, node_ip, request, stats_growth, wait_denied,
        wait_for, Cluster, ClusterNode, Svc, CLIENT_ADDR, FABRIC_ADDR, INTERNET_ADDR, TOR_ASN,
    },
    netprobe_bin, Netns,
};
use serde_json::Value;

include!("../../kube-router/tests/data/upstream_daemon_set_args.rs");

/// The args of the upstream DaemonSet file `file`, as transcribed.
fn upstream_args(file: &str) -> Vec<String> {
    let (_, args, _) = UPSTREAM_DAEMON_SET_ARGS.iter().find(|(files, ..)| files.contains(file)).expect("transcribed");
    args.iter().map(|a| a.to_string()).collect()
}

/// `args` with the DaemonSets' kubeconfig mount replaced by the harness's (cluster `prefix`).
fn on_harness(args: Vec<String>, prefix: &str) -> Vec<String> {
    let kubeconfig = format!("--kubeconfig={}", kubeconfig_path(prefix).display());
    args.into_iter().map(|a| if a.starts_with("--kubeconfig=") { kubeconfig.clone() } else { a }).collect()
}

fn refs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// The ranges an operator of upstream 2.8+ configures for externalIPs and LoadBalancer IPs.
const ADDRESS_RANGES: [&str; 2] =
    ["--service-external-ip-range=192.0.2.0/24", "--loadbalancer-ip-range=198.51.100.0/24"];

const DSR: (&str, &str) = ("kube-router.io/service.dsr", "tunnel");

/// The programs attached to interfaces in `ns` (`bpftool net show`): XDP, tc and TCX.
fn attached_programs(ns: &Netns) -> Vec<Value> {
    let out = ns.run(&["bpftool", "-j", "net", "show"]).unwrap();
    let listing: Value = serde_json::from_str(&out).unwrap();
    ["xdp", "tc"].iter().flat_map(|kind| listing[0][kind].as_array().cloned().unwrap_or_default()).collect()
}

/// The name of the host side of each pod veth on `node` (the ports of kube-bridge).
fn pod_veths(node: &ClusterNode) -> Vec<String> {
    let out = node.ns.run(&["ip", "-o", "link", "show", "master", "kube-bridge"]).unwrap();
    out.lines().filter_map(|l| Some(l.split(':').nth(1)?.trim().split('@').next()?.to_string())).collect()
}

/// Node `i`'s BGP neighbor `address` in its `kube-router bgp -o json`.
fn neighbor(c: &Cluster, i: usize, address: &str) -> Value {
    let report = c.node(i).bgp_report();
    let found = report["neighbors"].as_array().into_iter().flatten().find(|n| n["address"] == address);
    found.cloned().unwrap_or_default()
}

/// A TCP connection from `ns` to `target` succeeds within 300 ms (a denied one times out).
fn connects(ns: &Netns, target: &str) -> bool {
    netprobe(ns, &["matrix", "300", &format!("tcp:{target}")]).contains(" OK ")
}

/// Everything the all-features manifests promise that holds from the first start on: pod to pod
/// across nodes untranslated, a ClusterIP from pods and nodes on both sides, a NodePort on both
/// nodes' addresses, hairpin, pod egress masqueraded; once applied, the policy state of
/// [`isolate_and_admit`] (pod-2-0 admitted to pod-1-1, pod-2-1 not).
fn assert_all_features_paths(c: &Cluster, policy_applied: bool) {
    let (pod_1_0, pod_2_0) = (c.pod(0, 0), c.pod(1, 0));
    // Across nodes over the routes BGP learned, neither direction translated.
    assert_eq!(
        netprobe(&pod_1_0.ns, &["ask", "tcp", &format!("{}:8080", pod_2_0.ip), "who"]),
        format!("pod-2-0 {}", pod_1_0.ip)
    );
    assert_eq!(
        netprobe(&pod_2_0.ns, &["ask", "udp", &format!("{}:5353", pod_1_0.ip), "who"]),
        format!("pod-1-0 {}", pod_2_0.ip)
    );
    // The ClusterIP (backend pod-2-0) from a pod on each node and from each node itself.
    for pod in [c.pod(0, 1), c.pod(1, 1)] {
        assert_all_from(&pod.request("tcp", "10.96.2.10:80", 5), "pod-2-0");
        assert_all_from(&pod.request("udp", "10.96.2.10:53", 5), "pod-2-0");
    }
    let netprobe_path = netprobe_bin();
    for node in &c.nodes {
        let out = node.run_as_host_process(&[netprobe_path.to_str().unwrap(), "request", "tcp", "10.96.2.10:80", "5"]);
        let replies: Vec<String> = out.unwrap().lines().map(str::to_string).collect();
        assert_all_from(&replies, "pod-2-0");
    }
    // The NodePort (backend pod-1-0) on both nodes' addresses, from the external client.
    for node in 0..2 {
        assert_all_from(&request(&c.client, "tcp", &format!("{}:30211", node_ip(node)), 5), "pod-1-0");
        assert_all_from(&request(&c.client, "udp", &format!("{}:30212", node_ip(node)), 5), "pod-1-0");
    }
    // Hairpin: pod-1-0 through its own Service (kube-router's hairpin mode: from the Service address).
    assert_eq!(netprobe(&pod_1_0.ns, &["ask", "tcp", "10.96.2.11:80", "who"]), "pod-1-0 10.96.2.11");
    // Pod egress leaves masqueraded to the node.
    assert_eq!(netprobe(&pod_1_0.ns, &["ask", "tcp", &format!("{INTERNET_ADDR}:8080"), "who"]), "internet 10.100.0.1");
    if policy_applied {
        let target = format!("{}:8080", c.pod(0, 1).ip);
        assert!(connects(&pod_2_0.ns, &target), "the admitted pod-2-0 is refused");
        assert!(!connects(&c.pod(1, 1).ns, &target), "pod-2-1 reaches the isolated pod-1-1");
    }
}

/// A NetworkPolicy isolates pod-1-1 (every pod denied), then a rule admits pod-2-0 alone.
fn isolate_and_admit(c: &Cluster) {
    let target = format!("{}:8080", c.pod(0, 1).ip);
    assert!(connects(&c.pod(1, 1).ns, &target), "pod-2-1 cannot reach pod-1-1 before any policy");
    c.server.apply(ingress_policy("isolate-pod-1-1", "pod-1-1", None)).unwrap();
    wait_denied(&c.pod(1, 0).ns, &target).unwrap();
    assert!(!connects(&c.pod(1, 1).ns, &target), "pod-2-1 reaches the isolated pod-1-1");
    c.server.apply(ingress_policy("isolate-pod-1-1", "pod-1-1", Some("pod-2-0"))).unwrap();
    wait_for("the rule admitting pod-2-0", || connects(&c.pod(1, 0).ns, &target));
    assert!(!connects(&c.pod(1, 1).ns, &target), "pod-2-1 reaches pod-1-1: the rule admits more than pod-2-0");
}

/// The agents of both nodes peer with each other (iBGP, the cluster's default ASN) and with
/// nobody else.
fn assert_ibgp_mesh(c: &Cluster) {
    for (i, other) in [(0, 1), (1, 0)] {
        let report = c.node(i).bgp_report();
        let neighbors = report["neighbors"].as_array().cloned().unwrap_or_default();
        assert_eq!(neighbors.len(), 1, "node-{}: {report}", i + 1);
        let peer = &neighbors[0];
        assert_eq!(peer["address"], node_ip(other), "{report}");
        assert_eq!((peer["asn"].as_u64(), peer["type"].as_str()), (Some(64512), Some("internal")), "{report}");
        assert_eq!(peer["state"], "Established", "{report}");
        let route = format!("{} via {}", c.node(other).pod_cidr, node_ip(other));
        assert!(c.node(i).bgp_routes().contains(&route), "node-{}: no {route}", i + 1);
    }
}

/// Kills node `i`'s agent and starts it again with the cluster's args and `more`: meanwhile the
/// other node keeps its routes to node `i`'s pods as stale (graceful restart, helper side) and
/// pod traffic goes on; afterwards the session is back and nothing is stale.
fn restart_gracefully(c: &Cluster, i: usize, more: &[&str]) {
    let other = 1 - i;
    let address = node_ip(i);
    let route = format!("{} via {address}", c.node(i).pod_cidr);
    c.stop_agent(i);
    wait_for("the peer's routes kept as stale", || neighbor(c, other, &address)["prefixes_stale"].as_u64() >= Some(1));
    assert!(c.node(other).bgp_routes().contains(&route), "node-{} dropped {route}", other + 1);
    let target = format!("{}:8080", c.pod(i, 0).ip);
    assert_eq!(
        netprobe(&c.pod(other, 0).ns, &["ask", "tcp", &target, "who"]),
        format!("pod-{}-0 {}", i + 1, c.pod(other, 0).ip)
    );
    c.restart_agent_with(i, more).unwrap();
    // Past wait_for's 15 s: the restarted agent loads (verifies) every program first, which took
    // 8 s here with the cores shared.
    let back = || {
        let peer = neighbor(c, other, &address);
        Ok(peer["state"] == "Established" && peer["prefixes_stale"] == 0)
    };
    kube_router_tests::wait_until("the session back, nothing stale", Duration::from_secs(60), back).unwrap();
    assert!(c.node(other).bgp_routes().contains(&route), "node-{} lost {route}", other + 1);
}

#[test]
fn all_features_and_dsr_daemon_set_args_run_a_cluster_with_every_promised_path() {
    let started = Instant::now();
    let prefix = "krt-up-all";
    let all_features = on_harness(upstream_args("generic-kuberouter-all-features.yaml"), prefix);
    let dsr = on_harness(upstream_args("kubeadm-kuberouter-all-features-dsr.yaml"), prefix);
    // The DSR manifest's list is the all-features one and `--runtime-endpoint`: its agents are
    // the all-features ones restarted with that flag more (and the address ranges its Service needs).
    assert_eq!(dsr[..all_features.len()], all_features[..]);
    let mut dsr_more = dsr[all_features.len()..].to_vec();
    assert_eq!(dsr_more, ["--runtime-endpoint=unix:///run/containerd/containerd.sock"]);
    dsr_more.extend(ADDRESS_RANGES.map(String::from));

    // The socket load balancer (on by default) in a test cgroup per node, not the root cgroup.
    let c =
        Cluster::builder(prefix).only_agent_args(&refs(&all_features)).socket_lb().pods_per_node(2).build().unwrap();
    assert_ibgp_mesh(&c);
    for node in &c.nodes {
        // The agent wrote the CNI configuration the pods were wired with, at KUBE_ROUTER_CNI_CONF_FILE.
        let written: Value = serde_json::from_slice(&fs::read(node.cni_conf_file()).unwrap()).unwrap();
        assert_eq!(written["plugins"][0]["ipam"]["ranges"][0][0]["subnet"], node.pod_cidr.as_str());
        // Every pod veth runs the datapath (what the only-advertise manifest must leave out).
        let programs = attached_programs(&node.ns);
        for veth in pod_veths(node) {
            assert!(programs.iter().any(|p| p["devname"] == veth.as_str()), "{veth}: no programs in {programs:?}");
        }
    }
    c.add_service(Svc::cluster_ip("cip", "10.96.2.10").select("pod", "pod-2-0")).unwrap();
    c.add_service(Svc::node_port("np", "10.96.2.11", 30211).select("pod", "pod-1-0")).unwrap();
    // The DSR Service, published now: as written (no --service-external-ip-range, no
    // --loadbalancer-ip-range), its externalIP and LoadBalancer IP are refused, as upstream's
    // strict validation refuses them.
    let dsr_svc = Svc::load_balancer("dsr", "10.96.2.20", 30220, "198.51.100.20")
        .external_ip("192.0.2.20")
        .select("pod", "pod-2-0")
        .annotate(DSR.0, DSR.1);
    c.add_service(dsr_svc).unwrap();
    wait_for("the externalIP and LoadBalancer IP refused without a range", || {
        c.nodes
            .iter()
            .all(|n| n.metric("kube_router_service_external_ips_refused_total", "reason=\"no-allowed-range\"") >= 2.0)
    });
    for node in &c.nodes {
        let services = node.services();
        assert!(!services.contains(" 192.0.2.20:80 "), "an externalIP programmed without a range: {services}");
        assert!(!services.contains(" 198.51.100.20:80 "), "a LoadBalancer IP programmed without a range: {services}");
        assert!(services.contains(" 10.96.2.20:80 "), "the rest of the Service is programmed: {services}");
    }
    assert_all_features_paths(&c, false);
    isolate_and_admit(&c);
    eprintln!("all-features checked after {:?}", started.elapsed());

    // Graceful restart, both ways, into the DSR manifest's list: one node at a time.
    for i in 0..2 {
        restart_gracefully(&c, i, &refs(&dsr_more));
    }
    wait_for("both agents' first sync after the restart", || {
        c.nodes.iter().all(|n| n.metric("kube_router_sync_duration_seconds_count", "") >= 1.0)
    });
    assert_ibgp_mesh(&c);
    assert_all_features_paths(&c, true);
    // The DSR Service's externalIP and LoadBalancer IP, routed by the fabric to node-1, its
    // backend on node-2: tunnelled, answered straight to the client, which the backend sees.
    for vip in ["192.0.2.20", "198.51.100.20"] {
        c.wait_backends(&format!("{vip}:80"), 1).unwrap();
        c.route_via(vip, 0).unwrap();
    }
    let before = (c.node(0).stats(), c.node(1).stats());
    for frontend in ["192.0.2.20:80", "198.51.100.20:80"] {
        assert_all_from(&request(&c.client, "tcp", frontend, 5), "pod-2-0");
        assert_eq!(netprobe(&c.client, &["ask", "tcp", frontend, "who"]), format!("pod-2-0 {CLIENT_ADDR}"));
    }
    assert_all_from(&request(&c.client, "udp", "198.51.100.20:53", 5), "pod-2-0");
    let after = (c.node(0).stats(), c.node(1).stats());
    assert_eq!(stats_growth(&before.0, &after.0, "dsr_new_flow"), 17, "node-1: {:?}", after.0);
    assert_eq!(stats_growth(&before.0, &after.0, "snat_new_flow"), 0, "node-1: {:?}", after.0);
    assert_eq!(stats_growth(&before.1, &after.1, "dsr_deliver_new_flow"), 17, "node-2: {:?}", after.1);
    eprintln!("all-features and DSR args: {:?}", started.elapsed());
}

/// The ToR's adj-in from node `i`: (prefix, next hop) per route (`gobgp` prints an ID first).
fn tor_routes(c: &Cluster, i: usize) -> Vec<(String, String)> {
    let received = c.tor_received(i);
    received
        .lines()
        .filter_map(|l| {
            let mut fields = l.split_whitespace().skip_while(|f| !f.contains('/'));
            Some((fields.next()?.to_string(), fields.next()?.to_string()))
        })
        .collect()
}

#[test]
fn only_advertise_routes_daemon_set_args_advertise_to_the_peer_and_program_nothing() {
    let started = Instant::now();
    let prefix = "krt-up-adv";
    let kubeconfig = format!("--kubeconfig={}", kubeconfig_path(prefix).display());
    let tor_asn = format!("--peer-router-asns={TOR_ASN}");
    let mut args: Vec<String> = upstream_args("generic-kuberouter-only-advertise-routes.yaml")
        .into_iter()
        .map(|a| match a.as_str() {
            "--peer-router-ips=192.0.2.254" => format!("--peer-router-ips={FABRIC_ADDR}"),
            "--peer-router-asns=65000" => tor_asn.clone(),
            _ => a,
        })
        .collect();
    assert!(args.contains(&"--cluster-asn=65001".to_string()) && args.contains(&tor_asn), "{args:?}");
    args.push(kubeconfig);
    args.extend(ADDRESS_RANGES.map(String::from));
    let c = Cluster::builder(prefix)
        .only_agent_args(&refs(&args))
        .tor_bgp()
        .cluster_asn(65001)
        .pods_per_node(2)
        .build()
        .unwrap();
    let svc = Svc::load_balancer("adv", "10.96.3.10", 30310, "198.51.100.31")
        .external_ip("192.0.2.31")
        .select("pod", "pod-1-0");
    c.publish_service(&svc).unwrap();
    c.server.apply(ingress_policy("isolate-pod-1-0", "pod-1-0", None)).unwrap();

    // Each node advertises its pod CIDR, the ClusterIP, the externalIP and the LoadBalancer IP to
    // the ToR, itself the next hop.
    for (i, node) in c.nodes.iter().enumerate() {
        let expected: Vec<(String, String)> =
            [node.pod_cidr.as_str(), "10.96.3.10/32", "192.0.2.31/32", "198.51.100.31/32"]
                .iter()
                .map(|prefix| (prefix.to_string(), node.ip.clone()))
                .collect();
        let deadline = Instant::now() + Duration::from_secs(30);
        while !expected.iter().all(|route| tor_routes(&c, i).contains(route)) {
            assert!(Instant::now() < deadline, "node-{}: the ToR received {}", i + 1, c.tor_received(i));
            thread::sleep(Duration::from_millis(200));
        }
        // The ToR received the graceful-restart capability (--bgp-graceful-restart=true).
        let session = c.fabric.run(&["gobgp", "neighbor", &node.ip]).unwrap();
        let capability = session.lines().find(|l| l.trim_start().starts_with("graceful-restart:"));
        assert!(capability.is_some_and(|l| l.contains("received")), "node-{}: {session}", i + 1);
        // Its only session is the ToR's (--enable-ibgp=false), in the manifest's ASN.
        let report = node.bgp_report();
        assert_eq!(report["local_asn"], 65001, "{report}");
        let neighbors = report["neighbors"].as_array().cloned().unwrap_or_default();
        assert_eq!(neighbors.len(), 1, "node-{}: {report}", i + 1);
        assert_eq!(neighbors[0]["address"], FABRIC_ADDR, "{report}");
        assert_eq!(
            (neighbors[0]["asn"].as_u64(), neighbors[0]["state"].as_str()),
            (Some(TOR_ASN as u64), Some("Established"))
        );
    }
    // Nothing else: no pinned map (no Service frontend, no policy), no program on any interface,
    // no CNI configuration; the isolating policy is not enforced.
    for node in &c.nodes {
        let pinned: Vec<_> =
            fs::read_dir(&node.bpf_root).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default();
        assert!(pinned.is_empty(), "{}: pinned {pinned:?}", node.name);
        assert!(!node.services().contains("10.96.3.10"), "{}", node.services());
        assert!(pod_veths(node).len() == 2, "{}: pods not wired", node.name);
        assert_eq!(attached_programs(&node.ns), Vec::<Value>::new(), "{}", node.name);
        assert!(!node.cni_conf_file().exists(), "{}: a CNI configuration written", node.name);
    }
    let target = format!("{}:8080", c.pod(0, 0).ip);
    assert_eq!(netprobe(&c.pod(0, 1).ns, &["ask", "tcp", &target, "who"]), format!("pod-1-0 {}", c.pod(0, 1).ip));
    eprintln!("only-advertise args: {:?}", started.elapsed());
}
