//! Security suite: a Service cannot capture the node, another node or the API server, BGP
//! announces only what the service proxy accepts, and the checkpoint on disk is private and
//! holds no TCP-MD5 key. Each test is one attack on the two-node cluster harness
//! (`kube_router_tests::cluster`, agents in API mode against the fake API server, which the
//! agents reach at the fabric's address). As root, in network namespaces.
use std::os::unix::fs::PermissionsExt;

use kube_router_tests::{
    apiserver::FaultMode,
    cluster::{assert_all_from, node_ip, request, wait_for, Cluster, Svc, FABRIC_ADDR},
};
use serde_json::json;

/// A second API server address, published the way a real API server publishes its own: as
/// the endpoints of `default/kubernetes` (an HA control plane's other member).
const OTHER_API_SERVER: &str = "10.100.0.250";

const REFUSED_COUNTER: &str = "kube_router_service_external_ips_refused_total";

fn publish_kubernetes_endpoints(c: &Cluster) {
    c.server
        .apply(json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"namespace": "default", "name": "kubernetes",
                         "labels": {"kubernetes.io/service-name": "kubernetes"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [FABRIC_ADDR]}, {"addresses": [OTHER_API_SERVER]}],
            "ports": [{"name": "https", "port": 6443, "protocol": "TCP"}]
        }))
        .unwrap();
}

/// Guards: `ExternalIpPolicy::refusal` (API server addresses from --master and from
/// `default/kubernetes`, every Node's addresses, link-local), counted by reason; the rest of
/// the Service is programmed, the agent keeps its API connection (a later Service is
/// programmed), and a restart from the checkpoint with the API down refuses them again.
#[test]
fn a_service_cannot_capture_the_api_server_another_node_or_the_metadata_address() {
    // A careless operator allows the node subnet and link-local too, and the Service range
    // (default 10.96.0.0/12) is narrowed off the node subnet: the guards alone refuse.
    let c = Cluster::builder("krt-he-cap")
        .agent_args(&[
            "--service-external-ip-range",
            "10.100.0.0/24,169.254.0.0/16",
            "--service-cluster-ip-range",
            "10.96.0.0/16",
        ])
        .build()
        .unwrap();
    publish_kubernetes_endpoints(&c);
    let other_node = node_ip(1);
    let refused = [FABRIC_ADDR, OTHER_API_SERVER, other_node.as_str(), "169.254.169.254"];
    let mut svc = Svc::cluster_ip("capture", "10.96.1.200").select("pod", "pod-2-0").external_ip("192.0.2.40");
    for ip in refused {
        svc = svc.external_ip(ip);
    }
    c.add_service(svc).unwrap();
    c.wait_programmed("192.0.2.40:80", true).unwrap();
    let assert_refused = |when: &str| {
        for node in &c.nodes {
            let services = node.services();
            for ip in refused {
                assert!(
                    !services.contains(&format!(" {ip}:")),
                    "{when}: {ip} programmed on {}:\n{services}",
                    node.name
                );
            }
            assert!(services.contains(" 10.96.1.200:80 "), "{when}: the rest of the Service:\n{services}");
        }
    };
    assert_refused("first sync");
    for node in &c.nodes {
        wait_for("the refusals counted", || {
            node.metric(REFUSED_COUNTER, "reason=\"api-server\"") == 2.0
                && node.metric(REFUSED_COUNTER, "reason=\"node-address\"") == 1.0
                && node.metric(REFUSED_COUNTER, "reason=\"link-local\"") == 1.0
        });
    }
    // The agents still list and watch: a Service added now is programmed.
    c.add_service(Svc::cluster_ip("after", "10.96.1.201").select("pod", "pod-2-0")).unwrap();
    c.wait_programmed("10.96.1.201:80", true).unwrap();
    c.route_via("192.0.2.40", 0).unwrap();
    assert_all_from(&request(&c.client, "tcp", "192.0.2.40:80", 3), "pod-2-0");

    // Cold start from the checkpoint (Nodes and default/kubernetes included) with the API down.
    let checkpoint = c.nodes[0].state_dir.join("checkpoint.json");
    wait_for("the checkpoint with every object", || {
        std::fs::read_to_string(&checkpoint).is_ok_and(|t| t.contains("10.96.1.201") && t.contains(OTHER_API_SERVER))
    });
    c.set_api(FaultMode::Refuse);
    c.restart_agent(0).unwrap();
    wait_for("the restored Services refused again", || {
        c.nodes[0].metric(REFUSED_COUNTER, "reason=\"api-server\"") == 2.0
            && c.nodes[0].metric(REFUSED_COUNTER, "reason=\"node-address\"") == 1.0
    });
    assert_refused("after a restart from the checkpoint");
    c.set_api(FaultMode::Normal);
}

/// Guards: `--strict-external-ip-validation` (default on) refuses externalIPs outside
/// `--service-external-ip-range`, `--service-advertise-annotations-override` (default off)
/// keeps the advertise annotation from widening the flags, and BGP advertises only the
/// addresses `ExternalIpPolicy::refusal` accepts (LoadBalancer IPs on a node address or
/// link-local are not announced). A namespace user's 5,000 externalIPs reach neither the maps
/// nor the top-of-rack router.
#[test]
fn five_thousand_annotated_external_ips_are_neither_programmed_nor_advertised() {
    let c = Cluster::builder("krt-he-bgp")
        .tor_bgp()
        .agent_args(&["--advertise-external-ip=false", "--advertise-loadbalancer-ip=true"])
        .build()
        .unwrap();
    // 198.18.0.0/19: outside the cluster's --service-external-ip-range (192.0.2.0/24).
    let mut flood = Svc::cluster_ip("flood", "10.96.1.210")
        .select("pod", "pod-1-0")
        .annotate("kube-router.io/service.advertise.externalip", "true")
        .external_ip("192.0.2.60");
    for i in 0..5000u32 {
        flood = flood.external_ip(&std::net::Ipv4Addr::from(0xc612_0000 + i).to_string());
    }
    c.add_service(flood).unwrap();
    let lb = Svc::load_balancer("lb", "10.96.1.211", 30211, "198.51.100.61")
        .load_balancer_ip(&node_ip(0))
        .load_balancer_ip("169.254.10.10")
        .select("pod", "pod-1-0");
    c.add_service(lb).unwrap();
    // The proxy takes the one allowed externalIP, and the LoadBalancer IP outside every refused class.
    c.wait_programmed("192.0.2.60:80", true).unwrap();
    c.wait_programmed("198.51.100.61:80", true).unwrap();
    for (i, node) in c.nodes.iter().enumerate() {
        wait_for("the flood refused", || node.metric(REFUSED_COUNTER, "reason=\"outside-range\"") == 5000.0);
        let services = node.services();
        assert!(!services.contains(" 198.18."), "a flooded externalIP programmed on {}", node.name);
        assert!(!services.contains(" 169.254.10.10:"), "{services}");
        // The allowed LoadBalancer IP is advertised (the session works), nothing else of it.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let received = loop {
            let received = c.tor_received(i);
            if received.contains("198.51.100.61/32") || std::time::Instant::now() > deadline {
                break received;
            }
            std::thread::sleep(std::time::Duration::from_millis(200));
        };
        assert!(received.contains("198.51.100.61/32"), "node-{} advertises the LB IP:\n{received}", i + 1);
        for absent in ["198.18.", "192.0.2.60/32", "169.254.10.10/32", &format!("{}/32", node_ip(0))] {
            assert!(!received.contains(absent), "node-{} advertises {absent}:\n{received}", i + 1);
        }
    }
}

/// Guard: the checkpoint is written 0600 in a 0700 directory and without the Node's
/// `kube-router.io/peer.passwords` (the TCP-MD5 keys) or the Pods' specs beyond what the agent reads.
#[test]
fn the_checkpoint_is_private_and_holds_no_peer_password() {
    let c = Cluster::builder("krt-he-ckpt").nodes(1).build().unwrap();
    let mut node = c.server.get("Node", None, &c.nodes[0].name).unwrap();
    node["metadata"]["annotations"] = json!({
        "kube-router.io/peer.ips": "10.100.0.253",
        "kube-router.io/peer.asns": "65010",
        "kube-router.io/peer.passwords": "c3VwZXItczNjcmV0LW1kNQ==",
    });
    c.server.apply(node).unwrap();
    let path = c.nodes[0].state_dir.join("checkpoint.json");
    wait_for("a checkpoint with the annotated Node", || {
        std::fs::read_to_string(&path).is_ok_and(|text| text.contains("10.100.0.253"))
    });
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(!text.contains("c3VwZXItczNjcmV0LW1kNQ") && !text.contains("peer.passwords"), "{text}");
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&path), 0o600);
    assert_eq!(mode(&c.nodes[0].state_dir), 0o700);
}
