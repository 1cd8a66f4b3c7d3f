//! The demo: a node namespace running kube-router between a client and three backend pods, and
//! a second node it peers with over BGP, both fed by a fake API server (the real kube-rs client
//! talks to it), which is then black-holed.
use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, Result};
use kube_router_tests::{
    apiserver::{FakeApiServer, FakeApiServerConfig, FaultMode},
    *,
};

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_interrupt(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Between steps: stop early (and let every Drop clean up) after Ctrl-C.
fn step(title: &str) -> Result<()> {
    if INTERRUPTED.load(Ordering::SeqCst) {
        bail!("interrupted: cleaning up");
    }
    println!("\n=== {title}");
    Ok(())
}

fn show(label: &str, replies: &[String]) {
    println!("{label}: {:?}", tally(replies));
}

fn kube_router(root: &std::path::Path, command: &str) -> Result<String> {
    sh(&[kube_router_bin().to_str().unwrap(), "--bpf-root", root.to_str().unwrap(), command])
}

fn summary(line: &str) -> &str {
    line.split("INFO").last().unwrap_or(line).trim()
}

pub fn run() -> Result<()> {
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_interrupt as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_interrupt as *const () as libc::sighandler_t);
    }
    step("Creating namespaces: client (10.0.1.2) -- node-1 (10.0.1.1) -- backend-1..3 (10.0.1x.2); node-1 (10.0.2.1) -- node-2 (10.0.2.2)")?;
    let topo = Topology::new("krt-demo", 3)?;
    let node2 = Netns::new("krt-demo-node2")?;
    veth(&topo.node, "to-node2", "10.0.2.1/24", &node2, "eth0", "10.0.2.2/24")?;
    // A "pod" address inside node-2's pod CIDR, reachable only through the BGP-learned route.
    node2.run(&["ip", "addr", "add", "10.244.2.1/32", "dev", "lo"])?;
    let root = topo.bpf_root();
    remove_bpf_root(&root);
    let result = demo(&topo, &node2);
    remove_bpf_root(&root);
    result
}

fn node_object(name: &str, ip: &str, pod_cidr: &str) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
        "spec": {"podCIDR": pod_cidr, "podCIDRs": [pod_cidr]},
        "status": {"addresses": [{"type": "InternalIP", "address": ip}]}
    })
}

fn bgp_view(ns: &Netns, port: &str) -> Result<String> {
    let status = ns.run(&[kube_router_bin().to_str().unwrap(), "--health-port", port, "bgp"])?;
    let routes = ns.run(&["ip", "route", "show", "proto", "186"])?;
    Ok(format!("{status}kernel (ip route show proto 186):\n{routes}"))
}

fn demo(topo: &Topology, node2: &Netns) -> Result<()> {
    let root = topo.bpf_root();
    let runtime = NetnsRuntime::new(&topo.node)?;
    // On node-1's address towards node-2, so both agents reach it.
    let config = FakeApiServerConfig {
        bind_address: std::net::SocketAddr::from(([10, 0, 2, 1], 0)),
        ..FakeApiServerConfig::default()
    };
    let server = Arc::new(runtime.run(async { FakeApiServer::spawn(config).await })?);
    server.apply(node_object("node-1", "10.0.2.1", "10.244.1.0/24"))?;
    server.apply(node_object("node-2", "10.0.2.2", "10.244.2.0/24"))?;
    let set_mode = |mode: FaultMode| {
        let server = server.clone();
        runtime.run(async move { server.set_mode(mode).await })
    };
    server.apply_yaml(&web_and_sticky(&backend_addrs(3)))?;
    let state_dir = std::env::temp_dir().join("krt-demo-state");
    let _ = std::fs::remove_dir_all(&state_dir);
    let master = server.url();
    let args = [
        "--enable-cni=false",
        "--master",
        &master,
        "--hostname-override",
        "node-1",
        "--state-dir",
        state_dir.to_str().unwrap(),
        "--health-port",
        "20244",
    ];
    let state_dir2 = std::env::temp_dir().join("krt-demo-state-node2");
    let _ = std::fs::remove_dir_all(&state_dir2);
    let args2 = [
        "--enable-cni=false",
        "--master",
        &master,
        "--hostname-override",
        "node-2",
        "--run-service-proxy=false",
        "--state-dir",
        state_dir2.to_str().unwrap(),
        "--health-port",
        "20244",
    ];
    let ping_pod = || -> String {
        match topo.node.run(&["ping", "-c1", "-W1", "-q", "10.244.2.1"]) {
            Ok(_) => "ok".into(),
            Err(e) => format!("FAILED ({e})"),
        }
    };
    let health = || -> Result<String> {
        let out = topo.node.run(&[netprobe_bin().to_str().unwrap(), "http", "127.0.0.1:20244", "/healthz"])?;
        Ok(out.replace('\n', " "))
    };

    step(&format!("Starting kube-router in the node namespace, watching the API server at {master}"))?;
    let mut agent = Agent::start(&topo.node, &root, &args)?;
    println!("{}", summary(&agent.wait_for_log("complete=true", 1, Duration::from_secs(30))?));
    step("Starting kube-router on node-2 (BGP only): the two nodes peer from their Node objects (iBGP, AS 64512)")?;
    let mut agent2 = Agent::start(node2, &std::path::PathBuf::from("/sys/fs/bpf/krt-demo-node2"), &args2)?;
    agent2.wait_for_log("BGP session established", 1, Duration::from_secs(30))?;
    let deadline = Instant::now() + Duration::from_secs(15);
    while !topo.node.run(&["ip", "route", "show", "proto", "186"])?.contains("10.244.2.0/24")
        && Instant::now() < deadline
    {
        thread::sleep(Duration::from_millis(200));
    }
    thread::sleep(Duration::from_millis(1200));
    println!("node-1 (kube-router bgp):\n{}", bgp_view(&topo.node, "20244")?);
    println!("node-2 (kube-router bgp):\n{}", bgp_view(node2, "20244")?);
    println!("ping node-1 -> 10.244.2.1 (a pod address on node-2, via the BGP route): {}", ping_pod());

    step("Services, read back from the pinned maps (kube-router services)")?;
    print!("{}", kube_router(&root, "services")?);

    step("bpftool map dump pinned /sys/fs/bpf/krt-demo/svc_v4  (key: VIP, port, proto | value: id, count, flags, affinity)")?;
    print!(
        "{}",
        sh(&["bpftool", "map", "dump", "pinned", kube_router_tests::maps_dir(&root).join("svc_v4").to_str().unwrap()])?
    );

    step(
        "Client traffic: 30 TCP connections and 30 UDP requests to web's ClusterIP, 30 to its NodePort, 30 to sticky",
    )?;
    show("tcp 10.96.0.10:80  ", &topo.request("tcp", "10.96.0.10:80", 30)?);
    show("udp 10.96.0.10:53  ", &topo.request("udp", "10.96.0.10:53", 30)?);
    show("tcp 10.0.1.1:30080 ", &topo.request("tcp", "10.0.1.1:30080", 30)?);
    show("tcp 10.96.0.11:80 (ClientIP affinity)", &topo.request("tcp", "10.96.0.11:80", 30)?);

    step(
        "Black-holing the API server for 40 s (connections accepted, never answered); a client connects every second",
    )?;
    let programmed = kube_router(&root, "services")?;
    set_mode(FaultMode::BlackHole)?;
    let started = Instant::now();
    let mut replies = Vec::new();
    while started.elapsed() < Duration::from_secs(40) {
        step_quietly()?;
        replies.extend(topo.request("tcp", "10.96.0.10:80", 1)?);
        thread::sleep(Duration::from_millis(900));
    }
    show("tcp 10.96.0.10:80 during the outage", &replies);
    println!("agents running: {} {}   /healthz: {}", agent.is_running(), agent2.is_running(), health()?);
    println!("service maps unchanged: {}", kube_router(&root, "services")? == programmed);
    println!("BGP during the outage: sessions up, routes unchanged:\n{}", bgp_view(&topo.node, "20244")?);
    println!("ping node-1 -> 10.244.2.1: {}", ping_pod());

    step("The API server returns, with backend-3 removed from web: only that difference is written")?;
    server.apply_yaml(&web_and_sticky(&backend_addrs(2)))?;
    set_mode(FaultMode::Normal)?;
    let syncs_before = agent.log_count("service sync complete");
    // web on both ports loses one slot each; its frontends (ClusterIP, NodePorts) get a new count.
    let deadline = Instant::now() + Duration::from_secs(90);
    while agent.sync_totals_after(syncs_before).2 < 2 && Instant::now() < deadline {
        step_quietly()?;
        thread::sleep(Duration::from_millis(100));
    }
    thread::sleep(Duration::from_secs(1));
    println!("writes after the outage (inserts, updates, deletes): {:?}", agent.sync_totals_after(syncs_before));
    show("tcp 10.96.0.10:80  ", &topo.request("tcp", "10.96.0.10:80", 30)?);
    println!("/healthz: {}", health()?);

    step("Stopping the agent: programs, links and maps stay pinned, traffic keeps flowing")?;
    agent.stop()?;
    show("tcp 10.96.0.10:80 (no agent running)", &topo.request("tcp", "10.96.0.10:80", 30)?);

    step("Restarting the agent with the API server down: it programs from its checkpoint and writes nothing")?;
    set_mode(FaultMode::Refuse)?;
    let mut agent = Agent::start(&topo.node, &root, &args)?;
    println!("{}", summary(&agent.wait_for_log("service sync complete", 1, Duration::from_secs(30))?));
    show("tcp 10.96.0.10:80  ", &topo.request("tcp", "10.96.0.10:80", 20)?);
    print!("{}", kube_router(&root, "stats")?);
    agent.stop()?;
    agent2.stop()?;
    // Routes and pinned objects outlive the agents by design; the demo removes them itself.
    remove_bpf_root(&std::path::PathBuf::from("/sys/fs/bpf/krt-demo-node2"));

    step("Cleaning up (namespaces and pinned objects)")?;
    Ok(())
}

fn step_quietly() -> Result<()> {
    if INTERRUPTED.load(Ordering::SeqCst) {
        bail!("interrupted: cleaning up");
    }
    Ok(())
}
