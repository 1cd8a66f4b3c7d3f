//! The demo: a node namespace running kube-router between a client and three backend pods.
use std::{
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

use anyhow::{bail, Result};
use kube_router_tests::*;

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

fn demo(topo: &Topology) -> Result<()> {
    let root = topo.bpf_root();
    let file = ServiceFile::new("krt-demo");
    let all: Vec<String> = (0..3).map(backend_addr).collect();
    let web = |backends: &[String]| {
        service_objects(&ServiceSpec {
            name: "web",
            cluster_ip: "10.96.0.10",
            node_port: Some(30080),
            affinity: false,
            backends,
        })
    };
    file.write(&web(&all))?;
    let args = ["--service-file", &file.arg(), "--health-port", "0"];

    step("Starting kube-router in the node namespace (Service web: ClusterIP 10.96.0.10, NodePort 30080)")?;
    let mut agent = Agent::start(&topo.node, &root, &args)?;
    let line = agent.wait_for_log("service sync complete", 1, Duration::from_secs(20))?;
    println!("{}", line.split("INFO").last().unwrap_or(&line).trim());

    step("Services, read back from the pinned maps (kube-router services)")?;
    print!("{}", kube_router(&root, "services")?);

    step("bpftool map dump pinned /sys/fs/bpf/krt-demo/svc_v4  (key: VIP, port, proto | value: id, count, flags, affinity)")?;
    print!("{}", sh(&["bpftool", "map", "dump", "pinned", root.join("svc_v4").to_str().unwrap()])?);

    step("Client traffic: 30 TCP connections and 30 UDP requests to the ClusterIP, 30 to the NodePort")?;
    show("tcp 10.96.0.10:80  ", &topo.request("tcp", "10.96.0.10:80", 30)?);
    show("udp 10.96.0.10:53  ", &topo.request("udp", "10.96.0.10:53", 30)?);
    show("tcp 10.0.1.1:30080 ", &topo.request("tcp", "10.0.1.1:30080", 30)?);

    step("Removing backend-3 from the EndpointSlice")?;
    file.write(&web(&all[..2]))?;
    let line = agent.wait_for_log("service sync complete", 2, Duration::from_secs(10))?;
    println!("{}", line.split("INFO").last().unwrap_or(&line).trim());
    show("tcp 10.96.0.10:80  ", &topo.request("tcp", "10.96.0.10:80", 30)?);

    step("Stopping the agent: programs, links and maps stay pinned, traffic keeps flowing")?;
    agent.stop()?;
    show("tcp 10.96.0.10:80 (no agent running)", &topo.request("tcp", "10.96.0.10:80", 30)?);

    step("Restarting the agent: it re-adopts maps and links and writes nothing")?;
    let mut agent = Agent::start(&topo.node, &root, &args)?;
    let line = agent.wait_for_log("service sync complete", 1, Duration::from_secs(20))?;
    println!("{}", line.split("INFO").last().unwrap_or(&line).trim());
    print!("{}", kube_router(&root, "stats")?);
    agent.stop()?;

    step("Cleaning up (namespaces and pinned objects)")?;
    Ok(())
}
