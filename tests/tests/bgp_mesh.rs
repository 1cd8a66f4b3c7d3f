//! Three agents in API mode form the iBGP full mesh from Node objects, route each other's pod
//! CIDRs, and keep sessions, RIB and kernel routes exactly as they were through an API
//! black-hole and an agent crash during it. As root, in network namespaces.
//!
//! Topology: `krt-mesh-sw` holds a bridge (10.78.0.254) and the fake API server; nodes
//! `krt-mesh-n1..3` (10.78.0.1..3) hang off it. Each node has 10.244.<i>.1 on lo as a "pod".
use std::{
    fs,
    net::SocketAddr,
    path::PathBuf,
    sync::Arc,
    thread,
    time::{Duration, Instant},
};

use kube_router_tests::{
    apiserver::{FakeApiServer, FakeApiServerConfig, FaultMode},
    bgp_status, kube_router_bin, metric, remove_bpf_root, wait_until, Agent, Netns, NetnsRuntime,
};
use serde_json::json;

/// The agents' metrics listener (/metrics, /bgp).
const METRICS_PORT: &str = "20262";
const NODES: usize = 3;

fn node_ip(i: usize) -> String {
    format!("10.78.0.{i}")
}

fn pod_cidr(i: usize) -> String {
    format!("10.244.{i}.0/24")
}

fn bpf_root(i: usize) -> PathBuf {
    PathBuf::from(format!("/sys/fs/bpf/krt-mesh-n{i}"))
}

fn node_object(i: usize) -> serde_json::Value {
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": format!("node-{i}")},
        "spec": {"podCIDR": pod_cidr(i), "podCIDRs": [pod_cidr(i)]},
        "status": {"addresses": [{"type": "InternalIP", "address": node_ip(i)}]}
    })
}

struct Mesh {
    switch: Netns,
    nodes: Vec<Netns>,
    runtime: NetnsRuntime,
    server: Arc<FakeApiServer>,
    dir: PathBuf,
}

impl Mesh {
    fn new() -> Self {
        let switch = Netns::new("krt-mesh-sw").unwrap();
        switch.run(&["ip", "link", "add", "br0", "type", "bridge"]).unwrap();
        switch.run(&["ip", "addr", "add", "10.78.0.254/24", "dev", "br0"]).unwrap();
        switch.run(&["ip", "link", "set", "br0", "up"]).unwrap();
        let mut nodes = Vec::new();
        for i in 1..=NODES {
            let ns = Netns::new(&format!("krt-mesh-n{i}")).unwrap();
            let port = format!("port{i}");
            switch
                .run(&["ip", "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns", &ns.path()])
                .unwrap();
            switch.run(&["ip", "link", "set", &port, "master", "br0", "up"]).unwrap();
            ns.run(&["ip", "addr", "add", &format!("{}/24", node_ip(i)), "dev", "eth0"]).unwrap();
            ns.run(&["ip", "link", "set", "eth0", "up"]).unwrap();
            ns.run(&["ip", "addr", "add", &format!("10.244.{i}.1/32"), "dev", "lo"]).unwrap();
            nodes.push(ns);
        }
        let runtime = NetnsRuntime::new(&switch).unwrap();
        let config = FakeApiServerConfig {
            bind_address: SocketAddr::from(([10, 78, 0, 254], 0)),
            ..FakeApiServerConfig::default()
        };
        let server = Arc::new(runtime.run(async { FakeApiServer::spawn(config).await.unwrap() }));
        for i in 1..=NODES {
            server.apply(node_object(i)).unwrap();
        }
        let dir = PathBuf::from("/tmp/krt-mesh");
        let _ = fs::remove_dir_all(&dir);
        Mesh { switch, nodes, runtime, server, dir }
    }

    fn start_agent(&self, i: usize) -> Agent {
        let state = self.dir.join(format!("n{i}"));
        let args = [
            "--enable-cni=false",
            "--master",
            &self.server.url(),
            "--hostname-override",
            &format!("node-{i}"),
            "--run-service-proxy=false",
            "--state-dir",
            state.to_str().unwrap(),
            "--metrics-port",
            METRICS_PORT,
            "--bgp-holdtime",
            "9s",
            "--bgp-graceful-restart-deferral-time",
            "30s",
        ];
        // One bpffs directory per node, as on real nodes (each agent loads the datapath).
        Agent::start(&self.nodes[i - 1], &bpf_root(i), &args).unwrap()
    }

    fn routes(&self, i: usize) -> String {
        self.nodes[i - 1].run(&["ip", "route", "show", "proto", "186"]).unwrap()
    }

    fn bgp(&self, i: usize) -> String {
        self.nodes[i - 1]
            .run(&[kube_router_bin().to_str().unwrap(), "--metrics-port", METRICS_PORT, "bgp"])
            .unwrap_or_default()
    }

    /// Every node routes every other node's pod CIDR via that node, and nothing else.
    fn expected_routes(&self, i: usize, members: &[usize]) -> String {
        members
            .iter()
            .filter(|j| **j != i)
            .map(|j| format!("{} via {} dev eth0", pod_cidr(*j), node_ip(*j)))
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn normalized_routes(&self, i: usize) -> String {
        self.routes(i).lines().map(|l| l.trim()).collect::<Vec<_>>().join("\n")
    }

    fn wait_for_mesh(&self, members: &[usize], timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let ok = members.iter().all(|i| self.normalized_routes(*i) == self.expected_routes(*i, members));
            if ok {
                return;
            }
            if Instant::now() > deadline {
                let detail: Vec<String> =
                    members.iter().map(|i| format!("node-{i}:\n{}\n{}", self.routes(*i), self.bgp(*i))).collect();
                panic!("mesh not converged within {timeout:?}:\n{}", detail.join("\n"));
            }
            thread::sleep(Duration::from_millis(250));
        }
    }

    /// A "pod" on every other node answers a ping from node `i`.
    fn ping_all_from(&self, i: usize, members: &[usize]) -> Vec<String> {
        members
            .iter()
            .filter(|j| **j != i)
            .filter_map(|j| {
                let target = format!("10.244.{j}.1");
                match self.nodes[i - 1].run(&["ping", "-c1", "-W1", "-q", &target]) {
                    Ok(_) => None,
                    Err(e) => Some(format!("node-{i} -> {target}: {e}")),
                }
            })
            .collect()
    }

    fn set_mode(&self, mode: FaultMode) {
        let server = self.server.clone();
        self.runtime.run(async move { server.set_mode(mode).await.unwrap() });
    }
}

impl Drop for Mesh {
    fn drop(&mut self) {
        for i in 1..=NODES {
            remove_bpf_root(&bpf_root(i));
        }
        let _ = &self.switch;
    }
}

/// Seconds each agent reports its session with `peer` has been up.
fn uptime(bgp: &str, peer: &str) -> Option<u64> {
    bgp.lines().find(|l| l.starts_with(peer))?.split_whitespace().nth(3)?.parse().ok()
}

#[test]
fn full_mesh_from_node_objects_survives_an_api_outage_and_a_crash_during_it() {
    let mesh = Mesh::new();
    let all: Vec<usize> = (1..=NODES).collect();
    let mut agents: Vec<Option<Agent>> = all.iter().map(|i| Some(mesh.start_agent(*i))).collect();
    mesh.wait_for_mesh(&all, Duration::from_secs(60));
    for i in &all {
        assert!(mesh.ping_all_from(*i, &all).is_empty(), "{:?}", mesh.ping_all_from(*i, &all));
    }
    thread::sleep(Duration::from_secs(2)); // let /bgp catch up (published every second)
    let before: Vec<String> = all.iter().map(|i| mesh.normalized_routes(*i)).collect();
    let uptime_before = uptime(&mesh.bgp(2), &node_ip(1)).expect("node-2 reports its session with node-1");
    // The same page from the agent's socket in --state-dir, without the metrics port.
    let from_socket = mesh.nodes[1]
        .run(&[kube_router_bin().to_str().unwrap(), "--state-dir", mesh.dir.join("n2").to_str().unwrap(), "bgp"])
        .unwrap();
    assert!(uptime(&from_socket, &node_ip(1)).is_some() && from_socket.contains("Established"), "{from_socket}");
    let report: serde_json::Value = serde_json::from_str(
        &mesh.nodes[1]
            .run(&[
                kube_router_bin().to_str().unwrap(),
                "--state-dir",
                mesh.dir.join("n2").to_str().unwrap(),
                "bgp",
                "-o",
                "json",
            ])
            .unwrap(),
    )
    .expect("bgp -o json is one JSON document");
    let neighbor = report["neighbors"].as_array().unwrap().iter().find(|n| n["address"] == node_ip(1)).cloned();
    let neighbor = neighbor.unwrap_or_else(|| panic!("node-1 is a neighbor of node-2: {report:#}"));
    assert_eq!((&neighbor["state"], &neighbor["type"]), (&"Established".into(), &"internal".into()), "{report:#}");
    assert!(report["routes"].as_array().unwrap().iter().any(|r| r["from"] == node_ip(1)), "{report:#}");

    // API black-holed for longer than the client's longest timeout (30 s), 3x the hold time.
    mesh.set_mode(FaultMode::BlackHole);
    let outage =
        Duration::from_secs(std::env::var("KRT_MESH_OUTAGE_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(40));
    let started = Instant::now();
    let mut crashed = false;
    while started.elapsed() < outage {
        thread::sleep(Duration::from_secs(2));
        for i in &all {
            let agent = agents[i - 1].as_mut().unwrap();
            assert!(agent.is_running(), "node-{i}'s agent died {:?} into the outage", started.elapsed());
            assert_eq!(mesh.normalized_routes(*i), before[i - 1], "node-{i}'s routes changed during the outage");
            let failures = mesh.ping_all_from(*i, &all);
            assert!(failures.is_empty(), "{failures:?} {:?} into the outage", started.elapsed());
        }
        // Halfway: node-1 crashes and comes back while the API is still unreachable. It
        // restores the Node objects from its checkpoint; peers keep its routes meanwhile.
        if !crashed && started.elapsed() > outage / 2 {
            crashed = true;
            agents[0].take().unwrap().kill();
            thread::sleep(Duration::from_secs(1));
            assert_eq!(mesh.normalized_routes(2), before[1], "node-2 dropped node-1's route while it restarted");
            agents[0] = Some(mesh.start_agent(1));
            wait_until("node-1's BGP speaker running again", Duration::from_secs(20), || {
                Ok(bgp_status(&mesh.nodes[0], METRICS_PORT)?["running"] == true)
            })
            .unwrap();
        }
    }
    assert!(crashed);
    let bgp2 = mesh.bgp(2);
    assert!(
        uptime(&bgp2, &node_ip(3)).unwrap_or(0) >= uptime_before + outage.as_secs() - 5,
        "node-2's session with node-3 must not have flapped:\n{bgp2}"
    );
    let restores = agents[0].as_ref().unwrap().scrape().unwrap().count("kube_router_checkpoint_restores_total", &[]);
    assert_eq!(restores, 1, "node-1 restarted from its checkpoint");
    mesh.wait_for_mesh(&all, Duration::from_secs(30));

    // The API returns with node-3 gone: exactly that changes.
    mesh.server.delete("Node", None, "node-3").unwrap();
    mesh.set_mode(FaultMode::Normal);
    mesh.wait_for_mesh(&[1, 2], Duration::from_secs(90));
    for i in [1, 2] {
        assert!(mesh.ping_all_from(i, &[1, 2]).is_empty());
        // /bgp is a snapshot refreshed every second.
        let deadline = Instant::now() + Duration::from_secs(5);
        while mesh.bgp(i).contains(&node_ip(3)) && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(200));
        }
        let bgp = mesh.bgp(i);
        assert!(!bgp.contains(&node_ip(3)), "node-{i} still peers with the removed node:\n{bgp}");
    }

    // Upstream's kube-router.io/pod-cidrs annotation overrides node-1's spec.podCIDRs: node-1
    // advertises it and node-2 routes it instead.
    let annotated = |value: &str| {
        let mut node = node_object(1);
        node["metadata"]["annotations"] = json!({"kube-router.io/pod-cidrs": value});
        node
    };
    mesh.server.apply(annotated("10.245.1.0/24")).unwrap();
    let moved = format!("10.245.1.0/24 via {} dev eth0", node_ip(1));
    wait_until("node-2 routing node-1's annotated pod CIDR", Duration::from_secs(20), || {
        let routes = mesh.normalized_routes(2);
        anyhow::ensure!(routes == moved, "node-2 routes:\n{routes}");
        Ok(true)
    })
    .unwrap();
    // A malformed value is rejected (counted) and withdraws nothing.
    let rejected = || -> f64 {
        let scrape = mesh.nodes[0].scrape_metrics(METRICS_PORT).unwrap();
        let series = "kube_router_rejected_objects_total{kind=\"Node\"}";
        // Not exported until the first rejection.
        if scrape.lines().any(|l| l.starts_with(series)) {
            metric(&scrape, series)
        } else {
            0.0
        }
    };
    let before_rejection = rejected();
    mesh.server.apply(annotated("10.245.1.0/33")).unwrap();
    wait_until("node-1 counting its malformed pod-cidrs annotation", Duration::from_secs(20), || {
        Ok(rejected() > before_rejection)
    })
    .unwrap();
    thread::sleep(Duration::from_secs(2));
    assert_eq!(mesh.normalized_routes(2), moved, "a malformed annotation changed node-2's routes");
}
