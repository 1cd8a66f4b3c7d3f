//! Service VIPs with `externalTrafficPolicy: Local` are advertised only by nodes that run a
//! ready endpoint of the Service, as kube-router does. Run as root (in `scripts/isolated.sh`).
//!
//! Two agents (API mode, BGP only, `--advertise-external-ip`, `--advertise-loadbalancer-ip`)
//! peer with a GoBGP router (`krt-vip-tor`, 10.95.0.254, AS 65100) that also runs the fake API
//! server. What each node advertises is read from GoBGP's RIB (every path, not only the best).
use std::{net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use kube_router_tests::{
    apiserver::{FakeApiServer, FakeApiServerConfig},
    gobgp::{GoBgpd, Neighbor},
    remove_bpf_root, wait_until, Agent, Netns, NetnsRuntime,
};
use serde_json::json;

const LOCAL_EXTERNAL_IP: &str = "192.0.2.10/32";
const LOCAL_LB_IP: &str = "198.51.100.10/32";
const CLUSTER_EXTERNAL_IP: &str = "192.0.2.20/32";
/// `192.0.002.040`, as old API servers stored it.
const LEADING_ZERO_IP: &str = "192.0.2.40/32";
const OTHER_PROXY_IP: &str = "192.0.2.50/32";
const PROXY_MODE_LB_IP: &str = "198.51.100.50/32";
/// Outside the agents' `--loadbalancer-ip-range` (198.51.100.0/25).
const OUTSIDE_RANGE_LB_IP: &str = "198.51.100.200/32";
const FORCED_LOCAL_IP: &str = "192.0.2.60/32";

fn node_ip(i: usize) -> String {
    format!("10.95.0.{i}")
}

fn bpf_root(i: usize) -> PathBuf {
    PathBuf::from(format!("/sys/fs/bpf/krt-vip-n{i}"))
}

fn slice(node: &str, ready: bool) -> serde_json::Value {
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"namespace": "shop", "name": "web-x1", "labels": {"kubernetes.io/service-name": "web"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "protocol": "TCP", "port": 8080}],
        "endpoints": [{"addresses": ["10.244.9.9"], "nodeName": node, "conditions": {"ready": ready}}]
    })
}

#[test]
fn local_traffic_policy_vips_come_only_from_nodes_with_a_ready_endpoint() {
    let tor = Netns::new("krt-vip-tor").unwrap();
    tor.run(&["ip", "link", "add", "br0", "type", "bridge"]).unwrap();
    tor.run(&["ip", "addr", "add", "10.95.0.254/24", "dev", "br0"]).unwrap();
    tor.run(&["ip", "link", "set", "br0", "up"]).unwrap();
    let mut nodes = Vec::new();
    for i in 1..=2 {
        let ns = Netns::new(&format!("krt-vip-n{i}")).unwrap();
        let port = format!("port{i}");
        tor.run(&["ip", "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns", &ns.path()]).unwrap();
        tor.run(&["ip", "link", "set", &port, "master", "br0", "up"]).unwrap();
        ns.run(&["ip", "addr", "add", &format!("{}/24", node_ip(i)), "dev", "eth0"]).unwrap();
        ns.run(&["ip", "link", "set", "eth0", "up"]).unwrap();
        nodes.push(ns);
    }
    let dir = PathBuf::from("/tmp/krt-vip");
    let _ = std::fs::remove_dir_all(&dir);
    let neighbors: Vec<Neighbor> = [node_ip(1), node_ip(2)]
        .iter()
        .map(|a| Neighbor { address: a.clone().leak(), asn: 64512, family: "ipv4-unicast" })
        .collect();
    let gobgp = GoBgpd::start(&tor, &dir, (65100, "10.95.0.254"), &["10.95.0.254"], &neighbors).unwrap();

    let runtime = NetnsRuntime::new(&tor).unwrap();
    let config =
        FakeApiServerConfig { bind_address: SocketAddr::from(([10, 95, 0, 254], 0)), ..FakeApiServerConfig::default() };
    let server = Arc::new(runtime.run(async { FakeApiServer::spawn(config).await.unwrap() }));
    for i in 1..=2 {
        server
            .apply(json!({
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": format!("node-{i}")},
                "spec": {"podCIDR": format!("10.244.{i}.0/24")},
                "status": {"addresses": [{"type": "InternalIP", "address": node_ip(i)}]}
            }))
            .unwrap();
    }
    let service = |name: &str, policy: &str, external_ip: &str, lb_ip: Option<&str>| {
        let mut object = json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"namespace": "shop", "name": name},
            "spec": {"type": "LoadBalancer", "clusterIP": "10.96.0.10", "externalIPs": [external_ip.trim_end_matches("/32")],
                     "externalTrafficPolicy": policy,
                     "ports": [{"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080}]}
        });
        if let Some(lb) = lb_ip {
            object["status"] = json!({"loadBalancer": {"ingress": [{"ip": lb.trim_end_matches("/32")}]}});
        }
        object
    };
    server.apply(service("web", "Local", LOCAL_EXTERNAL_IP, Some(LOCAL_LB_IP))).unwrap();
    server.apply(service("everywhere", "Cluster", CLUSTER_EXTERNAL_IP, None)).unwrap();
    server.apply(slice("node-1", true)).unwrap();
    // The VIPs come from the service proxy's own model (services::vips): what it refuses is
    // never advertised, a legacy leading-zero address is advertised as it programs it, and
    // kube-router.io/service.local forces the Local policy.
    let extra = |name: &str, metadata: serde_json::Value, spec: serde_json::Value, status: serde_json::Value| {
        let mut object =
            json!({"apiVersion": "v1", "kind": "Service", "metadata": metadata, "spec": spec, "status": status});
        object["metadata"]["namespace"] = json!("shop");
        object["metadata"]["name"] = json!(name);
        object["spec"]["ports"] = json!([{"name": "http", "protocol": "TCP", "port": 80}]);
        object
    };
    let ip = |prefix: &str| prefix.trim_end_matches("/32").to_string();
    let refused_lb = json!({"loadBalancer": {"ingress": [{"ip": ip(PROXY_MODE_LB_IP), "ipMode": "Proxy"}]}});
    let outside_range_lb = json!({"loadBalancer": {"ingress": [{"ip": ip(OUTSIDE_RANGE_LB_IP)}]}});
    for (name, metadata, spec, status) in [
        ("legacy", json!({}), json!({"clusterIP": "10.96.0.40", "externalIPs": ["192.0.002.040"]}), json!({})),
        (
            "elsewhere",
            json!({"labels": {"service.kubernetes.io/service-proxy-name": "someone-else"}}),
            json!({"clusterIP": "10.96.0.50", "externalIPs": [ip(OTHER_PROXY_IP)]}),
            json!({}),
        ),
        ("proxied", json!({}), json!({"type": "LoadBalancer", "clusterIP": "10.96.0.51"}), refused_lb),
        ("outside", json!({}), json!({"type": "LoadBalancer", "clusterIP": "10.96.0.52"}), outside_range_lb),
        (
            "forced",
            json!({"annotations": {"kube-router.io/service.local": "true"}}),
            json!({"clusterIP": "10.96.0.60", "externalIPs": [ip(FORCED_LOCAL_IP)]}),
            json!({}),
        ),
    ] {
        server.apply(extra(name, metadata, spec, status)).unwrap();
    }
    let mut forced_slice = slice("node-1", true);
    forced_slice["metadata"] =
        json!({"namespace": "shop", "name": "forced-x1", "labels": {"kubernetes.io/service-name": "forced"}});
    server.apply(forced_slice).unwrap();

    let agents: Vec<Agent> = (1..=2)
        .map(|i| {
            let state = dir.join(format!("n{i}"));
            let args = [
                "--master",
                &server.url(),
                "--hostname-override",
                &format!("node-{i}"),
                "--run-service-proxy=false",
                "--run-firewall=false",
                "--state-dir",
                state.to_str().unwrap(),
                "--peer-router-ips",
                "10.95.0.254",
                "--peer-router-asns",
                "65100",
                "--advertise-external-ip=true",
                "--advertise-loadbalancer-ip=true",
                // As an operator would: externalIPs and LoadBalancer IPs are refused without an
                // allowed range (strict validation, on by default).
                "--service-external-ip-range",
                "192.0.2.0/24",
                "--loadbalancer-ip-range",
                "198.51.100.0/25",
            ];
            Agent::start(&nodes[i - 1], &bpf_root(i), &args).unwrap()
        })
        .collect();

    // Next hops GoBGP holds for `prefix` (every path).
    let advertisers = |prefix: &str| -> Vec<String> {
        let rib = gobgp.cli(&["global", "rib", "-a", "ipv4"]).unwrap_or_default();
        let mut hops: Vec<String> = rib
            .lines()
            .filter(|l| l.split_whitespace().any(|w| w == prefix))
            .filter_map(|l| {
                let words: Vec<&str> = l.split_whitespace().collect();
                let at = words.iter().position(|w| *w == prefix)?;
                words.get(at + 1).map(|s| s.to_string())
            })
            .collect();
        hops.sort();
        hops
    };
    let expect = |what: &str, prefix: &str, nodes: &[usize]| {
        let want: Vec<String> = nodes.iter().map(|i| node_ip(*i)).collect();
        wait_until(what, Duration::from_secs(45), || Ok(advertisers(prefix) == want)).unwrap_or_else(|e| {
            panic!("{e}\n{prefix} from {:?}\n{}", advertisers(prefix), gobgp.rib().unwrap_or_default())
        });
    };
    expect("the Cluster-policy VIP from both nodes", CLUSTER_EXTERNAL_IP, &[1, 2]);
    expect("the Local-policy external IP only from node-1", LOCAL_EXTERNAL_IP, &[1]);
    expect("the Local-policy LoadBalancer IP only from node-1", LOCAL_LB_IP, &[1]);
    assert!(advertisers("10.96.0.10/32").is_empty(), "ClusterIPs are not advertised without --advertise-cluster-ip");
    expect("a leading-zero externalIP as the proxy reads it", LEADING_ZERO_IP, &[1, 2]);
    expect("service.local: the externalIP only from node-1", FORCED_LOCAL_IP, &[1]);
    // Published with the VIPs above (one view of one listing): refused ones are simply absent.
    assert!(advertisers(OTHER_PROXY_IP).is_empty(), "another proxy's Service is not advertised");
    assert!(advertisers(PROXY_MODE_LB_IP).is_empty(), "an ipMode Proxy LoadBalancer IP is not advertised");
    assert!(
        advertisers(OUTSIDE_RANGE_LB_IP).is_empty(),
        "a LoadBalancer IP outside --loadbalancer-ip-range is not advertised"
    );

    // The endpoint moves to node-2: node-1 withdraws, node-2 announces.
    server.apply(slice("node-2", true)).unwrap();
    expect("the Local-policy external IP moved to node-2", LOCAL_EXTERNAL_IP, &[2]);
    expect("the Local-policy LoadBalancer IP moved to node-2", LOCAL_LB_IP, &[2]);
    // The last endpoint is no longer ready: nobody advertises it.
    server.apply(slice("node-2", false)).unwrap();
    expect("the Local-policy external IP withdrawn", LOCAL_EXTERNAL_IP, &[]);
    expect("the Local-policy LoadBalancer IP withdrawn", LOCAL_LB_IP, &[]);
    assert_eq!(advertisers(CLUSTER_EXTERNAL_IP).len(), 2, "the Cluster-policy VIP is unaffected");
    for i in 1..=2 {
        remove_bpf_root(&bpf_root(i));
    }
    drop(agents);
}
