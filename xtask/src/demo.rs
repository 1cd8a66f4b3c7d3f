//! The demo: a node namespace running kube-router between a client and three backend pods,
//! fed by a fake API server (the real kube-rs client talks to it), which is then black-holed.
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
    step("Creating namespaces: client (10.0.1.2) -- node (10.0.1.1) -- backend-1..3 (10.0.1x.2)")?;
    let topo = Topology::new("krt-demo", 3)?;
    let root = topo.bpf_root();
    remove_bpf_root(&root);
    let result = demo(&topo);
    remove_bpf_root(&root);
    result
}

fn apply(server: &FakeApiServer, yaml: &str) -> Result<()> {
    use serde::Deserialize;
    for doc in serde_yaml::Deserializer::from_str(yaml) {
        let value = serde_yaml::Value::deserialize(doc)?;
        if !value.is_null() {
            server.apply(serde_json::to_value(value)?)?;
        }
    }
    Ok(())
}

fn demo(topo: &Topology) -> Result<()> {
    let root = topo.bpf_root();
    let runtime = NetnsRuntime::new(&topo.node)?;
    let server = Arc::new(runtime.run(async { FakeApiServer::spawn(FakeApiServerConfig::default()).await })?);
    let set_mode = |mode: FaultMode| {
        let server = server.clone();
        runtime.run(async move { server.set_mode(mode).await })
    };
    apply(&server, &web_and_sticky(&backend_addrs(3)))?;
    let state_dir = std::env::temp_dir().join("krt-demo-state");
    let _ = std::fs::remove_dir_all(&state_dir);
    let master = server.url();
    let args = ["--master", &master, "--state-dir", state_dir.to_str().unwrap(), "--health-port", "20244"];
    let health = || -> Result<String> {
        let out = topo.node.run(&[netprobe_bin().to_str().unwrap(), "http", "127.0.0.1:20244", "/healthz"])?;
        Ok(out.replace('\n', " "))
    };

    step(&format!("Starting kube-router in the node namespace, watching the API server at {master}"))?;
    let mut agent = Agent::start(&topo.node, &root, &args)?;
    println!("{}", summary(&agent.wait_for_log("complete=true", 1, Duration::from_secs(30))?));

    step("Services, read back from the pinned maps (kube-router services)")?;
    print!("{}", kube_router(&root, "services")?);

    step("bpftool map dump pinned /sys/fs/bpf/krt-demo/svc_v4  (key: VIP, port, proto | value: id, count, flags, affinity)")?;
    print!("{}", sh(&["bpftool", "map", "dump", "pinned", root.join("svc_v4").to_str().unwrap()])?);

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
    println!("agent running: {}   /healthz: {}", agent.is_running(), health()?);
    println!("service maps unchanged: {}", kube_router(&root, "services")? == programmed);

    step("The API server returns, with backend-3 removed from web: only that difference is written")?;
    apply(&server, &web_and_sticky(&backend_addrs(2)))?;
    set_mode(FaultMode::Normal)?;
    println!("{}", summary(&agent.wait_for_log("complete=true", 2, Duration::from_secs(90))?));
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

    step("Cleaning up (namespaces and pinned objects)")?;
    Ok(())
}

fn step_quietly() -> Result<()> {
    if INTERRUPTED.load(Ordering::SeqCst) {
        bail!("interrupted: cleaning up");
    }
    Ok(())
}
