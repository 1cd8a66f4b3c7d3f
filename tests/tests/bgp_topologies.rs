//! kube-router's peering models, configured only with its annotations, route every pod CIDR.
//! Run as root (in `scripts/isolated.sh`). Four agents in API mode (BGP only) each time.
//!
//! * `per_rack_asns_without_full_mesh`: `--nodes-full-mesh=false`, racks 10.91.0.0/24 (node-1,
//!   node-2, AS 65001) and 10.92.0.0/24 (node-3, node-4, AS 65002) set by
//!   `kube-router.io/node.asn`; every node peers with its rack's router (BIRD in the fabric namespace,
//!   AS 65100, installing what it learns) through the `kube-router.io/peers` annotation. Nodes
//!   of a rack peer with each other, never across racks; pods reach every other pod.
//! * `route_reflection_from_annotations`: one subnet, `kube-router.io/rr.server` on node-1 and
//!   `kube-router.io/rr.client` on the others: clients peer only with the reflector, which
//!   reflects their pod CIDRs (next hop unchanged) to each other.
//!
//! Each node has 10.244.<i>.1/32 on lo as its "pod".
use std::{fs, net::SocketAddr, path::PathBuf, process::Command, sync::Arc, time::Duration};

use kube_router_tests::{
    apiserver::{FakeApiServer, FakeApiServerConfig},
    kube_router_bin, remove_bpf_root, wait_until, Agent, Netns, NetnsRuntime,
};
use serde_json::json;

/// The agents' metrics listener (/metrics, /bgp).
const METRICS_PORT: &str = "20265";
const NODES: usize = 4;

struct Fabric {
    fabric: Netns,
    nodes: Vec<Netns>,
    _runtime: NetnsRuntime,
    server: Arc<FakeApiServer>,
    dir: PathBuf,
    /// Names this test's namespaces and bpffs directories, so two tests never share them.
    prefix: String,
    agents: Vec<Agent>,
    bird: Option<std::process::Child>,
}

fn bpf_root(prefix: &str, i: usize) -> PathBuf {
    PathBuf::from(format!("/sys/fs/bpf/{prefix}-n{i}"))
}

impl Fabric {
    /// `subnet_of(i)`: the third octet of node i's subnet 10.X.0.0/24 (a bridge in the fabric
    /// namespace with 10.X.0.254); the API server listens on the first subnet's .254.
    fn new(prefix: &str, subnet_of: impl Fn(usize) -> u8) -> Self {
        let fabric = Netns::new(&format!("{prefix}-fab")).unwrap();
        fabric.sysctl("net.ipv4.ip_forward", "1").unwrap();
        let mut subnets: Vec<u8> = (1..=NODES).map(&subnet_of).collect();
        subnets.dedup();
        for s in &subnets {
            let bridge = format!("br{s}");
            fabric.run(&["ip", "link", "add", &bridge, "type", "bridge"]).unwrap();
            fabric.run(&["ip", "addr", "add", &format!("10.{s}.0.254/24"), "dev", &bridge]).unwrap();
            fabric.run(&["ip", "link", "set", &bridge, "up"]).unwrap();
        }
        let mut nodes = Vec::new();
        for i in 1..=NODES {
            let s = subnet_of(i);
            let ns = Netns::new(&format!("{prefix}-n{i}")).unwrap();
            let port = format!("port{i}");
            fabric
                .run(&["ip", "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns", &ns.path()])
                .unwrap();
            fabric.run(&["ip", "link", "set", &port, "master", &format!("br{s}"), "up"]).unwrap();
            ns.run(&["ip", "addr", "add", &format!("10.{s}.0.{i}/24"), "dev", "eth0"]).unwrap();
            ns.run(&["ip", "link", "set", "eth0", "up"]).unwrap();
            ns.run(&["ip", "addr", "add", &format!("10.244.{i}.1/32"), "dev", "lo"]).unwrap();
            // The API server, not the pods: only BGP routes lead to other nodes' pods.
            if s != subnets[0] {
                let api_net = format!("10.{}.0.0/24", subnets[0]);
                ns.run(&["ip", "route", "add", &api_net, "via", &format!("10.{s}.0.254")]).unwrap();
            }
            nodes.push(ns);
        }
        let runtime = NetnsRuntime::new(&fabric).unwrap();
        let config = FakeApiServerConfig {
            bind_address: SocketAddr::from(([10, subnets[0], 0, 254], 0)),
            ..FakeApiServerConfig::default()
        };
        let server = Arc::new(runtime.run(async { FakeApiServer::spawn(config).await.unwrap() }));
        let dir = PathBuf::from(format!("/tmp/{prefix}"));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        Fabric {
            fabric,
            nodes,
            _runtime: runtime,
            server,
            dir,
            prefix: prefix.to_string(),
            agents: Vec::new(),
            bird: None,
        }
    }

    fn node_ip(&self, i: usize) -> String {
        let out = self.nodes[i - 1].run(&["ip", "-4", "-o", "addr", "show", "dev", "eth0"]).unwrap();
        out.split_whitespace().nth(3).unwrap().split('/').next().unwrap().to_string()
    }

    fn add_node(&self, i: usize, annotations: serde_json::Value) {
        self.server
            .apply(json!({
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": format!("node-{i}"), "annotations": annotations},
                "spec": {"podCIDR": format!("10.244.{i}.0/24"), "podCIDRs": [format!("10.244.{i}.0/24")]},
                "status": {"addresses": [{"type": "InternalIP", "address": self.node_ip(i)}]}
            }))
            .unwrap();
    }

    fn start_agents(&mut self, extra: &[&str]) {
        for i in 1..=NODES {
            let state = self.dir.join(format!("n{i}"));
            let mut args = vec![
                "--master".to_string(),
                self.server.url(),
                "--hostname-override".into(),
                format!("node-{i}"),
                "--run-service-proxy=false".into(),
                "--run-firewall=false".into(),
                "--state-dir".into(),
                state.display().to_string(),
                "--metrics-port".into(),
                METRICS_PORT.into(),
            ];
            args.extend(extra.iter().map(|s| s.to_string()));
            let refs: Vec<&str> = args.iter().map(String::as_str).collect();
            self.agents.push(Agent::start(&self.nodes[i - 1], &bpf_root(&self.prefix, i), &refs).unwrap());
        }
    }

    fn routes(&self, i: usize) -> String {
        let out = self.nodes[i - 1].run(&["ip", "route", "show", "proto", "186"]).unwrap();
        let mut lines: Vec<&str> = out.lines().map(str::trim).collect();
        lines.sort();
        lines.join("\n")
    }

    fn bgp(&self, i: usize) -> String {
        self.nodes[i - 1]
            .run(&[kube_router_bin().to_str().unwrap(), "--metrics-port", METRICS_PORT, "bgp"])
            .unwrap_or_default()
    }

    /// Established neighbors of node `i`, from `kube-router bgp` (its report is refreshed every
    /// second: waits for it to list as many as expected, then returns them sorted).
    fn neighbors(&self, i: usize, count: usize) -> Vec<String> {
        let established = || {
            let mut peers: Vec<String> = self
                .bgp(i)
                .lines()
                .filter(|l| l.contains("Established"))
                .filter_map(|l| l.split_whitespace().next().map(str::to_string))
                .collect();
            peers.sort();
            peers
        };
        let _ = wait_until("the agent's report", Duration::from_secs(10), || Ok(established().len() >= count));
        established()
    }

    /// Waits until every node routes exactly `expected(i)` and pings every other pod.
    fn wait_converged(&self, expected: impl Fn(usize) -> String) {
        wait_until("every node's routes", Duration::from_secs(90), || {
            Ok((1..=NODES).all(|i| self.routes(i) == expected(i)))
        })
        .unwrap_or_else(|e| {
            let detail: Vec<String> =
                (1..=NODES).map(|i| format!("node-{i}:\n{}\n{}", self.routes(i), self.bgp(i))).collect();
            panic!("{e}\n{}", detail.join("\n"))
        });
        for i in 1..=NODES {
            for j in (1..=NODES).filter(|j| *j != i) {
                let from = format!("10.244.{i}.1");
                let to = format!("10.244.{j}.1");
                self.nodes[i - 1]
                    .run(&["ping", "-c1", "-W2", "-q", "-I", &from, &to])
                    .unwrap_or_else(|e| panic!("pod {from} cannot reach pod {to}: {e}"));
            }
        }
    }
}

impl Drop for Fabric {
    fn drop(&mut self) {
        if let Some(mut bird) = self.bird.take() {
            let _ = bird.kill();
            let _ = bird.wait();
        }
        for agent in self.agents.drain(..) {
            agent.kill();
        }
        for i in 1..=NODES {
            let _ = self.nodes[i - 1].run(&["ip", "route", "flush", "proto", "186"]);
            remove_bpf_root(&bpf_root(&self.prefix, i));
        }
        let _ = &self.fabric;
    }
}

#[test]
fn per_rack_asns_without_full_mesh() {
    let rack = |i: usize| if i <= 2 { 91 } else { 92 };
    let mut fabric = Fabric::new("krt-topo-asn", rack);
    let asn = |i: usize| if i <= 2 { 65001 } else { 65002 };
    // The racks' router: BIRD, AS 65100, one session per node, installing what it learns.
    let mut bird_conf =
        String::from("router id 10.91.0.254;\nprotocol device { }\nprotocol kernel { ipv4 { export all; }; }\n");
    for i in 1..=NODES {
        bird_conf.push_str(&format!(
            "protocol bgp node{i} {{ local as 65100; neighbor {} as {}; connect retry time 1;\n  ipv4 {{ import all; export all; }}; }}\n",
            fabric.node_ip(i),
            asn(i)
        ));
    }
    let conf = fabric.dir.join("bird.conf");
    fs::write(&conf, bird_conf).unwrap();
    let log = fs::File::create(fabric.dir.join("bird.log")).unwrap();
    fabric.bird = Some(
        Command::new("nsenter")
            .arg(format!("--net={}", fabric.fabric.path()))
            .args(["bird", "-f", "-c", conf.to_str().unwrap(), "-s", fabric.dir.join("bird.ctl").to_str().unwrap()])
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap(),
    );
    for i in 1..=NODES {
        let peers = format!("- remoteip: 10.{}.0.254\n  remoteasn: 65100\n", rack(i));
        fabric.add_node(i, json!({"kube-router.io/node.asn": asn(i).to_string(), "kube-router.io/peers": peers}));
    }
    fabric.start_agents(&["--nodes-full-mesh=false"]);
    // Within a rack: straight to the other node (iBGP); across: via the rack's router.
    let expected = |i: usize| {
        let mut routes: Vec<String> = (1..=NODES)
            .filter(|j| *j != i)
            .map(|j| {
                let via =
                    if rack(j) == rack(i) { format!("10.{}.0.{j}", rack(j)) } else { format!("10.{}.0.254", rack(i)) };
                format!("10.244.{j}.0/24 via {via} dev eth0")
            })
            .collect();
        routes.sort();
        routes.join("\n")
    };
    fabric.wait_converged(expected);
    for i in 1..=NODES {
        let partner = if i % 2 == 1 { i + 1 } else { i - 1 };
        let mut want = vec![fabric.node_ip(partner), format!("10.{}.0.254", rack(i))];
        want.sort();
        assert_eq!(
            fabric.neighbors(i, 2),
            want,
            "node-{i} peers only within its rack and with its router:\n{}",
            fabric.bgp(i)
        );
    }
}

#[test]
fn route_reflection_from_annotations() {
    let mut fabric = Fabric::new("krt-topo-rr", |_| 93);
    fabric.add_node(1, json!({"kube-router.io/rr.server": "42"}));
    for i in 2..=NODES {
        fabric.add_node(i, json!({"kube-router.io/rr.client": "42"}));
    }
    fabric.start_agents(&[]);
    let expected = |i: usize| {
        (1..=NODES)
            .filter(|j| *j != i)
            .map(|j| format!("10.244.{j}.0/24 via 10.93.0.{j} dev eth0"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    fabric.wait_converged(expected);
    assert_eq!(
        fabric.neighbors(1, 3),
        ["10.93.0.2", "10.93.0.3", "10.93.0.4"],
        "the reflector peers with every client"
    );
    for i in 2..=NODES {
        assert_eq!(fabric.neighbors(i, 1), ["10.93.0.1"], "node-{i}, a client, peers only with the reflector");
    }
}
