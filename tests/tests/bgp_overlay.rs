//! The pod overlay: two nodes on two subnets behind a router that knows nothing about pods.
//! Run as root (in `scripts/isolated.sh`).
//!
//! `krt-ovl-rt` routes between 10.80.0.0/24 (node-1, 10.80.0.1) and 10.81.0.0/24 (node-2,
//! 10.81.0.1) and runs the fake API server; each node has a "pod" namespace on 10.244.<i>.0/24.
//! The agents (API mode, BGP only, `--enable-overlay` default, `--overlay-type=subnet`) learn
//! each other's pod CIDR with an off-subnet next hop, so it goes through an IPIP tunnel: pod
//! to pod TCP works (short requests, a held connection and a bulk transfer that needs the
//! tunnel's path MTU), also through a 35 s API black-hole during which no route and no overlay
//! map entry changes. Then both agents restart with `--overlay-encap=fou` and pods talk again.
use std::{
    net::SocketAddr,
    path::PathBuf,
    sync::Arc,
    thread,
    time::{Duration, Instant},
};

use kube_router_tests::{
    apiserver::{FakeApiServer, FakeApiServerConfig, FaultMode},
    bgp_status, dump_maps, kube_router_bin, metric, netprobe_bin, remove_bpf_root, veth, wait_until, Agent, Netns,
    NetnsRuntime, Scrape,
};
use serde_json::json;

/// The agents' metrics listener (/metrics, /bgp).
const METRICS_PORT: &str = "20264";

fn node_ip(i: usize) -> String {
    format!("10.{}.0.1", 79 + i)
}

fn pod_ip(i: usize) -> String {
    format!("10.244.{i}.2")
}

fn bpf_root(i: usize) -> PathBuf {
    PathBuf::from(format!("/sys/fs/bpf/krt-ovl-n{i}"))
}

struct Lab {
    router: Netns,
    nodes: Vec<Netns>,
    pods: Vec<Netns>,
    runtime: NetnsRuntime,
    server: Arc<FakeApiServer>,
    dir: PathBuf,
}

impl Lab {
    fn new() -> Self {
        let router = Netns::new("krt-ovl-rt").unwrap();
        router.sysctl("net.ipv4.ip_forward", "1").unwrap();
        let mut nodes = Vec::new();
        let mut pods = Vec::new();
        for i in 1..=2 {
            let node = Netns::new(&format!("krt-ovl-n{i}")).unwrap();
            node.sysctl("net.ipv4.ip_forward", "1").unwrap();
            let net = 79 + i;
            veth(
                &router,
                &format!("to-n{i}"),
                &format!("10.{net}.0.254/24"),
                &node,
                "eth0",
                &format!("{}/24", node_ip(i)),
            )
            .unwrap();
            node.run(&["ip", "route", "add", "default", "via", &format!("10.{net}.0.254")]).unwrap();
            let pod = Netns::new(&format!("krt-ovl-p{i}")).unwrap();
            veth(&node, "pod", &format!("10.244.{i}.1/24"), &pod, "eth0", &format!("{}/24", pod_ip(i))).unwrap();
            pod.run(&["ip", "route", "add", "default", "via", &format!("10.244.{i}.1")]).unwrap();
            pod.spawn(&[netprobe_bin().to_str().unwrap(), "serve", &format!("pod-{i}"), "8080"]).unwrap();
            pod.spawn(&["iperf3", "-s", "-p", "5201"]).unwrap();
            nodes.push(node);
            pods.push(pod);
        }
        let runtime = NetnsRuntime::new(&router).unwrap();
        let config = FakeApiServerConfig {
            bind_address: SocketAddr::from(([10, 80, 0, 254], 0)),
            ..FakeApiServerConfig::default()
        };
        let server = Arc::new(runtime.run(async { FakeApiServer::spawn(config).await.unwrap() }));
        for i in 1..=2 {
            server
                .apply(json!({
                    "apiVersion": "v1", "kind": "Node",
                    "metadata": {"name": format!("node-{i}")},
                    "spec": {"podCIDR": format!("10.244.{i}.0/24"), "podCIDRs": [format!("10.244.{i}.0/24")]},
                    "status": {"addresses": [{"type": "InternalIP", "address": node_ip(i)}]}
                }))
                .unwrap();
        }
        let dir = PathBuf::from("/tmp/krt-ovl");
        let _ = std::fs::remove_dir_all(&dir);
        Lab { router, nodes, pods, runtime, server, dir }
    }

    fn start_agent(&self, i: usize, extra: &[&str]) -> Agent {
        let state = self.dir.join(format!("n{i}"));
        let mut args = vec![
            "--master",
            self.server_url(),
            "--hostname-override",
            if i == 1 { "node-1" } else { "node-2" },
            "--run-service-proxy=false",
            "--run-firewall=false",
            "--state-dir",
            state.to_str().unwrap(),
            "--metrics-port",
            METRICS_PORT,
            "--bgp-holdtime",
            "9s",
        ];
        args.extend_from_slice(extra);
        Agent::start(&self.nodes[i - 1], &bpf_root(i), &args).unwrap()
    }

    fn server_url(&self) -> &'static str {
        Box::leak(self.server.url().into_boxed_str())
    }

    fn routes(&self, i: usize) -> String {
        self.nodes[i - 1].run(&["ip", "route", "show", "proto", "186"]).unwrap()
    }

    /// The overlay's tunnel maps of node `i`, as bpftool dumps them.
    fn tunnels(&self, i: usize) -> String {
        let maps = dump_maps(&bpf_root(i)).unwrap_or_default();
        ["ovl_routes_v4", "ovl_remotes_v4"].iter().map(|m| maps.get(*m).cloned().unwrap_or_default()).collect()
    }

    /// An overlay counter of node `i` (`kube_router_overlay_packets_total{event=...}`).
    fn overlay_stat(&self, i: usize, event: &str) -> f64 {
        let scrape = self.nodes[i - 1].scrape_metrics(METRICS_PORT).unwrap_or_default();
        let series = format!("kube_router_overlay_packets_total{{event=\"{event}\"}}");
        if scrape.contains(&series) {
            metric(&scrape, &series)
        } else {
            0.0
        }
    }

    /// Writes to node `i`'s overlay maps since its agent started, every operation
    /// (`kube_router_map_writes_total{map="ovl_routes_v4"|"ovl_remotes_v4"}`).
    fn overlay_writes(&self, i: usize) -> u64 {
        let text = self.nodes[i - 1].scrape_metrics(METRICS_PORT).unwrap_or_else(|e| panic!("scraping node-{i}: {e}"));
        let scrape = Scrape(text);
        ["ovl_routes_v4", "ovl_remotes_v4"]
            .iter()
            .map(|map| scrape.count("kube_router_map_writes_total", &[("map", map)]))
            .sum()
    }

    /// One TCP request from pod `from` to pod `to`: the answering pod's name, or the error.
    fn request(&self, from: usize, to: usize) -> String {
        let target = format!("{}:8080", pod_ip(to));
        self.pods[from - 1]
            .run(&[netprobe_bin().to_str().unwrap(), "request", "tcp", &target, "1"])
            .unwrap_or_else(|e| format!("ERR {e}"))
            .trim()
            .to_string()
    }

    fn set_mode(&self, mode: FaultMode) {
        let server = self.server.clone();
        self.runtime.run(async move { server.set_mode(mode).await.unwrap() });
    }

    fn bgp(&self, i: usize) -> String {
        self.nodes[i - 1]
            .run(&[kube_router_bin().to_str().unwrap(), "--metrics-port", METRICS_PORT, "bgp"])
            .unwrap_or_default()
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        for i in 1..=2 {
            let _ = self.nodes[i - 1].run(&["ip", "route", "flush", "proto", "186"]);
            remove_bpf_root(&bpf_root(i));
        }
        let _ = &self.router;
    }
}

fn wait_for_pods(lab: &Lab, timeout: Duration) {
    wait_until("pods talking across the overlay", timeout, || {
        Ok(lab.request(1, 2) == "pod-2" && lab.request(2, 1) == "pod-1")
    })
    .unwrap_or_else(|e| {
        panic!(
            "{e}\nnode-1 routes:\n{}\n{}\nnode-2 routes:\n{}\n{}\ntunnels:\n{}\n{}",
            lab.routes(1),
            lab.bgp(1),
            lab.routes(2),
            lab.bgp(2),
            lab.tunnels(1),
            lab.tunnels(2)
        )
    });
}

#[test]
fn pods_on_two_subnets_talk_through_the_overlay_through_an_api_outage() {
    let lab = Lab::new();
    // The underlay router has no route to any pod: only a tunnel can carry pod traffic.
    assert!(!lab.router.run(&["ip", "route"]).unwrap().contains("10.244."));
    let mut agents: Vec<Agent> = (1..=2).map(|i| lab.start_agent(i, &[])).collect();
    wait_for_pods(&lab, Duration::from_secs(60));
    for (i, other) in [(1, 2), (2, 1)] {
        let routes = lab.routes(i);
        let expected = format!("10.244.{other}.0/24 via 10.{}.0.254 dev eth0 mtu 1480", 79 + i);
        assert_eq!(
            routes.trim(),
            expected,
            "node-{i}: the pod CIDR goes to the underlay router, with the tunnel's MTU"
        );
    }
    wait_until("the overlay's counters (published every second)", Duration::from_secs(5), || {
        Ok(lab.overlay_stat(1, "encapsulated") > 0.0 && lab.overlay_stat(2, "decapsulated") > 0.0)
    })
    .expect("packets really were encapsulated and decapsulated");

    // A bulk transfer: full-size segments must fit the tunnel (path MTU, GSO).
    let iperf = lab.pods[0]
        .run(&["iperf3", "-c", &pod_ip(2), "-p", "5201", "-t", "1", "-J"])
        .unwrap_or_else(|e| panic!("iperf3 across the overlay failed: {e}"));
    let report: serde_json::Value = serde_json::from_str(&iperf).unwrap();
    let bytes = report["end"]["sum_received"]["bytes"].as_u64().unwrap_or(0);
    assert!(bytes > 1_000_000, "bulk TCP across the tunnel moved only {bytes} bytes");

    // API black-holed: nothing changes, held and new connections keep working.
    thread::sleep(Duration::from_secs(2)); // let the checkpoint of the complete listing be written
    let held = lab.pods[0]
        .spawn_collecting(&[netprobe_bin().to_str().unwrap(), "hold", &format!("{}:8080", pod_ip(2)), "500"])
        .unwrap();
    let before: Vec<(String, String)> = (1..=2).map(|i| (lab.routes(i), lab.tunnels(i))).collect();
    let writes_before: Vec<u64> = (1..=2).map(|i| lab.overlay_writes(i)).collect();
    // Each agent wrote at least the other node's pod CIDR and its tunnel endpoint.
    assert!(writes_before.iter().all(|w| *w >= 2), "overlay map writes before the outage: {writes_before:?}");
    lab.set_mode(FaultMode::BlackHole);
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(35) {
        thread::sleep(Duration::from_secs(1));
        for i in 1..=2 {
            assert!(agents[i - 1].is_running(), "node-{i}'s agent died during the outage");
            assert_eq!((lab.routes(i), lab.tunnels(i)), before[i - 1], "node-{i} changed during the outage");
        }
        assert_eq!(lab.request(1, 2), "pod-2", "{:?} into the outage", started.elapsed());
    }
    lab.set_mode(FaultMode::Normal);
    let replies = held.lock().unwrap().clone();
    assert!(replies.len() >= 60, "the held connection answered only {} times", replies.len());
    assert!(replies.iter().all(|r| r == "pod-2"), "{replies:?}");
    let writes_after: Vec<u64> = (1..=2).map(|i| lab.overlay_writes(i)).collect();
    assert_eq!(writes_after, writes_before, "the overlay was written during the outage");

    // FOU instead of IPIP: both agents restart with it; the tunnels are rewritten, pods talk.
    for agent in agents.drain(..) {
        agent.stop().unwrap();
    }
    let fou = ["--overlay-encap=fou", "--overlay-encap-port=5555"];
    agents = (1..=2).map(|i| lab.start_agent(i, &fou)).collect();
    for (i, agent) in (1..=2).zip(&mut agents) {
        wait_until("the BGP speaker running", Duration::from_secs(30), || {
            anyhow::ensure!(agent.is_running(), "node-{i}'s agent exited");
            Ok(bgp_status(&lab.nodes[i - 1], METRICS_PORT)?["running"] == true)
        })
        .unwrap();
    }
    wait_until("FOU tunnels (encap 2, port 5555)", Duration::from_secs(60), || {
        Ok((1..=2).all(|i| lab.tunnels(i).contains("02 00 15 b3")))
    })
    .unwrap_or_else(|e| panic!("{e}\n{}\n{}", lab.tunnels(1), lab.tunnels(2)));
    wait_for_pods(&lab, Duration::from_secs(30));
}
