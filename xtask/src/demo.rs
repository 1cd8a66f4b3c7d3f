//! The demo, on the multi-node cluster harness (`kube_router_tests::cluster`): two nodes running
//! kube-router in API mode against the fake API server (the real kube-rs client talks to it),
//! pods wired by the real CNI plugins from the configuration the agents write, an external
//! client, an "internet" host and a gobgpd top-of-rack router. It walks every Service path of a
//! real cluster over IPv4 and IPv6 (the cluster is dual-stack), enforces a NetworkPolicy in
//! both families, then black-holes the API while traffic runs on all of them and crashes an agent
//! in the middle: nothing changes.
use std::{
    sync::atomic::{AtomicBool, Ordering},
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Result};
use kube_router_tests::{
    apiserver::FaultMode,
    cluster::{ingress_policy, netprobe, request, Cluster, Svc, FABRIC_ADDR, INTERNET_ADDR},
    netprobe_bin, tally, Netns,
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
    println!("  {label:<58} {:?}", tally(replies));
}

fn indent(text: &str) -> String {
    text.lines().map(|l| format!("    {l}")).collect::<Vec<_>>().join("\n")
}

pub fn run() -> Result<()> {
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_interrupt as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_interrupt as *const () as libc::sighandler_t);
    }
    // The agents' own logs would drown the demo's output; the steps show their state instead.
    std::env::set_var("KRT_QUIET_AGENT", "1");
    step("Building a dual-stack cluster: fabric router + API server, node-1 and node-2 with two pods each, a client, an internet host, a gobgpd top-of-rack")?;
    let c = Cluster::builder("krt-demo")
        .dual_stack()
        .pods_per_node(2)
        .tor_bgp()
        .agent_args(&["--advertise-external-ip=true", "--advertise-loadbalancer-ip=true"])
        .build()?;
    demo(&c)
}

fn demo(c: &Cluster) -> Result<()> {
    for node in &c.nodes {
        let (ip6, cidr6) = (node.ip6.as_deref().unwrap_or("-"), node.pod_cidr6.as_deref().unwrap_or("-"));
        println!(
            "  {} {} {ip6} pod CIDRs {} {cidr6} (CNI config written by the agent: {})",
            node.name,
            node.ip,
            node.pod_cidr,
            node.cni_conf_file().display()
        );
    }
    for pod in &c.pods {
        println!("  {} {} {} on {}", pod.name, pod.ip, pod.ip6.as_deref().unwrap_or("-"), c.nodes[pod.node].name);
    }

    step("Pod routes between the nodes come from the agents' own BGP (ip route show proto 186)")?;
    c.wait_routes(Duration::from_secs(60))?;
    for node in &c.nodes {
        println!("  {}:\n{}", node.name, indent(&node.bgp_routes()));
    }

    step("Services from real Service/EndpointSlice objects")?;
    // Both backends on node-2; reached through node-1 from outside. Its externalIP and
    // LoadBalancer IPs are inside the harness's --service-external-ip-range and
    // --loadbalancer-ip-range (strict validation refuses any without them).
    let web = Svc::load_balancer("web", "10.96.0.10", 30080, "198.51.100.10")
        .dual_stack("fd00:96::10")
        .select("node", "node-2")
        .external_ip("192.0.2.10");
    c.add_service(web)?;
    c.add_service(Svc::node_port("self", "10.96.0.11", 30090).select("pod", "pod-1-0"))?;
    c.add_service(Svc::node_port("empty", "10.96.0.12", 30100).select("pod", "nobody"))?;
    let local = Svc::load_balancer("local", "10.96.0.13", 30110, "198.51.100.13").select("pod", "pod-1-1").local();
    c.add_service(local)?;
    c.route_via("192.0.2.10", 0)?;
    c.route_via("198.51.100.10", 0)?;
    println!("  kube-router services (node-1):\n{}", indent(&c.node(0).services()));

    step("Every path, real TCP and UDP connections")?;
    let pod = c.pod(0, 0);
    show("pod-1-0 -> ClusterIP 10.96.0.10:80 (backends on node-2)", &pod.request("tcp", "10.96.0.10:80", 20));
    show("pod-1-0 -> ClusterIP 10.96.0.10:53 udp", &pod.request("udp", "10.96.0.10:53", 20));
    show("pod-1-0 -> ClusterIP [fd00:96::10]:80 (the same Service, IPv6)", &pod.request("tcp", "[fd00:96::10]:80", 20));
    show(
        "client -> NodePort [fd00:100::1]:30080 (IPv6, backend elsewhere)",
        &request(&c.client, "tcp", "[fd00:100::1]:30080", 20),
    );
    show("client -> NodePort 10.100.0.1:30080 (backend elsewhere)", &request(&c.client, "tcp", "10.100.0.1:30080", 20));
    show("client -> ExternalIP 192.0.2.10:80", &request(&c.client, "tcp", "192.0.2.10:80", 20));
    show("client -> LoadBalancer IP 198.51.100.10:80", &request(&c.client, "tcp", "198.51.100.10:80", 20));
    println!(
        "  the backend sees (source NAT to the node that took it): {}",
        netprobe(&c.client, &["ask", "tcp", "10.100.0.1:30080", "who"])
    );
    println!(
        "  pod-1-0 -> its own Service (hairpin), backend sees:      {}",
        netprobe(&pod.ns, &["ask", "tcp", "10.96.0.11:80", "who"])
    );
    println!(
        "  no ready endpoints: refused at once (REJECT):            {}",
        netprobe(&c.client, &["timed", "tcp", "10.100.0.1:30100"])
    );
    println!(
        "  pod-1-0 -> internet (egress masquerade), server sees:    {}",
        netprobe(&pod.ns, &["ask", "tcp", &format!("{INTERNET_ADDR}:8080"), "who"])
    );
    println!(
        "  externalTrafficPolicy Local, via node-2 (no endpoint):   {}",
        netprobe(&c.client, &["timed", "tcp", "10.100.0.2:30110"])
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while !c.tor_received(0).contains("198.51.100.13/32") && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(200));
    }
    let vip = |i: usize| c.tor_received(i).contains("198.51.100.13/32");
    println!("  the Local Service's LB IP at the top-of-rack: from node-1 {}, from node-2 {}", vip(0), vip(1));
    let stats = c.node(0).stats();
    let interesting = ["new_flow", "ct_hit", "snat_new_flow", "reject_sent", "egress_masquerade_new_flow"];
    let counters: Vec<String> = interesting.iter().filter_map(|k| stats.get(*k).map(|n| format!("{k}={n}"))).collect();
    println!("  node-1 datapath counters: {}", counters.join(" "));
    // From outside, the uplink's XDP program takes new flows and their later packets before TC.
    let xdp = ["xdp_new_flow", "xdp_forward", "xdp_reply", "xdp_tx", "xdp_pass_to_tc"];
    let counters: Vec<String> = xdp.iter().filter_map(|k| stats.get(*k).map(|n| format!("{k}={n}"))).collect();
    let mode = c.node(0).uplink_xdp().map_or_else(|| "none".to_string(), |(mode, _)| mode);
    println!("  node-1 uplink XDP ({mode}): {}", counters.join(" "));
    println!("  (the client's veth sends partial checksums, which XDP leaves to TC; cluster_xdp.rs shows XDP_TX with complete ones)");

    step("Direct server return (kube-router.io/service.dsr: tunnel): node-1 tunnels, node-2's pod answers the client itself")?;
    let dsr = Svc::load_balancer("dsr", "10.96.0.14", 30120, "198.51.100.14")
        .select("pod", "pod-2-0")
        .annotate("kube-router.io/service.dsr", "tunnel");
    c.add_service(dsr)?;
    c.wait_backends("198.51.100.14:80", 1)?;
    c.route_via("198.51.100.14", 0)?;
    let before = (c.node(0).stats(), c.node(1).stats());
    show("client -> DSR LoadBalancer IP 198.51.100.14:80", &request(&c.client, "tcp", "198.51.100.14:80", 20));
    println!(
        "  the backend sees (no source NAT: the client itself):    {}",
        netprobe(&c.client, &["ask", "tcp", "198.51.100.14:80", "who"])
    );
    let after = (c.node(0).stats(), c.node(1).stats());
    let grown =
        |before: &std::collections::BTreeMap<String, u64>, after: &std::collections::BTreeMap<String, u64>, k: &str| {
            format!("{k}=+{}", after.get(k).copied().unwrap_or(0) - before.get(k).copied().unwrap_or(0))
        };
    println!(
        "  node-1: {} {} {}   node-2: {} {}",
        grown(&before.0, &after.0, "dsr_new_flow"),
        grown(&before.0, &after.0, "dsr_encapsulated"),
        grown(&before.0, &after.0, "reverse_nat"),
        grown(&before.1, &after.1, "dsr_decapsulated"),
        grown(&before.1, &after.1, "dsr_deliver_new_flow"),
    );

    step("NetworkPolicy: pod-1-1 admits only pod-2-0, over IPv4 and IPv6 alike")?;
    c.server.apply(ingress_policy("only-pod-2-0", "pod-1-1", Some("pod-2-0")))?;
    let target = c.pod(0, 1);
    let (target4, target6) =
        (format!("{}:8080", target.ip), format!("[{}]:8080", target.ip6.as_deref().unwrap_or("::")));
    let deadline = Instant::now() + Duration::from_secs(20);
    while netprobe(&c.pod(1, 1).ns, &["timed", "tcp", &target4]).starts_with("OK") && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(200));
    }
    for peer in [c.pod(1, 0), c.pod(1, 1), c.pod(0, 0)] {
        let verdict =
            |addr: &str| netprobe(&peer.ns, &["timed", "tcp", addr]).split(' ').next().unwrap_or("").to_string();
        println!("  {} -> pod-1-1: IPv4 {:<4} IPv6 {}", peer.name, verdict(&target4), verdict(&target6));
    }

    step("Hostile inputs fail closed: an outside client reaches a pod by its own address, a forged source never reaches the isolated pod, GRE only from the peer a rule without ports admits, no Service takes the API server's address")?;
    hostile(c)?;

    step("API black-holed for 40 s, a client connecting every 200 ms on every path; node-1's agent crashes and restarts in the middle")?;
    let probe =
        |ns: &Netns, target: &str| ns.spawn_collecting(&[netprobe_bin().to_str().unwrap(), "probe", target, "200"]);
    let probes = [
        ("pod -> ClusterIP on the other node", probe(&pod.ns, "10.96.0.10:80")?),
        ("pod -> IPv6 ClusterIP on the other node", probe(&pod.ns, "[fd00:96::10]:80")?),
        ("client -> NodePort, backend on the other node", probe(&c.client, "10.100.0.1:30080")?),
        ("client -> LoadBalancer IP", probe(&c.client, "198.51.100.10:80")?),
        ("client -> DSR LoadBalancer IP", probe(&c.client, "198.51.100.14:80")?),
        ("pod -> its own Service (hairpin)", probe(&pod.ns, "10.96.0.11:80")?),
        ("pod -> internet", probe(&pod.ns, &format!("{INTERNET_ADDR}:8080"))?),
    ];
    thread::sleep(Duration::from_secs(1));
    let maps = c.agent_maps();
    let routes = c.routes();
    c.set_api(FaultMode::BlackHole);
    let started = Instant::now();
    let mut restarted = false;
    while started.elapsed() < Duration::from_secs(40) {
        if INTERRUPTED.load(Ordering::SeqCst) {
            break;
        }
        thread::sleep(Duration::from_secs(5));
        if !restarted && started.elapsed() >= Duration::from_secs(15) {
            c.restart_agent(0)?;
            restarted = true;
            println!(
                "  {:>4.1} s: node-1's agent killed and started again (API still down)",
                started.elapsed().as_secs_f64()
            );
        }
        let same = c.agent_maps() == maps;
        println!(
            "  {:>4.1} s: agents running {}, maps unchanged {same}, node-1 API reachable metric {}",
            started.elapsed().as_secs_f64(),
            c.agents_running(),
            c.node(0).metric("kube_router_api_reachable", "")
        );
        ensure!(same, "maps changed during the outage");
    }
    ensure!(c.routes() == routes, "routes changed during the outage");
    println!("  kernel routes on both nodes unchanged: true");
    c.set_api(FaultMode::Normal);
    let mut failures = 0;
    for (path, replies) in &probes {
        let replies = replies.lock().unwrap();
        let failed = replies.iter().filter(|r| r.starts_with("ERR")).count();
        failures += failed;
        println!("  {path:<48} {} connections, {failed} failed", replies.len());
    }
    ensure!(failures == 0, "{failures} connections failed during the outage");

    step("Done: tearing the cluster down")?;
    Ok(())
}

/// What a tenant or an outside client may try, and what it gets (docs/security.md).
fn hostile(c: &Cluster) -> Result<()> {
    // Pod CIDRs are routed to the cluster: the client reaches pod-2-0 itself, and its replies
    // leave with the pod's address although pod egress masquerade is on.
    let direct = c.pod(1, 0);
    c.route_via(&direct.ip, 1)?;
    for proto in ["tcp", "udp"] {
        let port = if proto == "tcp" { 8080 } else { 5353 };
        let answer = netprobe(&c.client, &["ask", proto, &format!("{}:{port}", direct.ip), "who"]);
        println!("  client -> pod-2-0 {} directly ({proto}), pod-2-0 sees: {answer}", direct.ip);
    }
    // pod-1-1 admits only pod-2-0 (the policy above); pod-1-0 forges pod-2-0's address.
    let (target, attacker, admitted) = (c.pod(0, 1), c.pod(0, 0), c.pod(1, 0));
    let drops = || c.node(0).metric("kube_router_pod_source_check_packets_total", "event=\"spoofed_v4\"");
    let before = drops();
    let sniffed = target.ns.spawn_collecting(&[netprobe_bin().to_str().unwrap(), "sniff", "udp", "7002"])?;
    thread::sleep(Duration::from_millis(500));
    netprobe(&attacker.ns, &["spoof", "udp", &admitted.ip, &target.ip, "7002", "20"]);
    thread::sleep(Duration::from_secs(1));
    println!(
        "  pod-1-0 sends 20 UDP packets as pod-2-0 ({}) to pod-1-1: {} arrived, {} dropped at pod-1-0's veth",
        admitted.ip,
        sniffed.lock().unwrap().len(),
        drops() - before
    );
    // GRE: the rule admitting pod-2-0 has no ports, so it admits every protocol from pod-2-0;
    // nothing admits pod-2-1.
    for sender in [c.pod(1, 1), admitted] {
        let counter = target.ns.spawn_collecting(&[netprobe_bin().to_str().unwrap(), "count-ip", "47", "3"])?;
        thread::sleep(Duration::from_millis(500));
        netprobe(&sender.ns, &["raw-ip", "47", &target.ip, "10"]);
        let deadline = Instant::now() + Duration::from_secs(10);
        let count = loop {
            let line = counter.lock().unwrap().iter().find_map(|l| l.strip_prefix("count ").map(str::to_string));
            match line {
                Some(count) => break count,
                None if Instant::now() > deadline => break "?".to_string(),
                None => thread::sleep(Duration::from_millis(200)),
            }
        };
        println!("  {} sends 10 GRE packets to pod-1-1: {count} arrived", sender.name);
    }
    // A namespace user asks for the API server's address as an externalIP.
    let refused = || c.node(0).metric("kube_router_service_external_ips_refused_total", "");
    let before = refused();
    c.add_service(Svc::cluster_ip("capture", "10.96.0.20").select("pod", "pod-2-0").external_ip(FABRIC_ADDR))?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while refused() <= before && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(200));
    }
    let programmed = c.node(0).services().contains(FABRIC_ADDR);
    println!(
        "  Service \"capture\" with externalIPs [{FABRIC_ADDR}] (the API server): refused {} time(s), programmed: {programmed}",
        refused() - before
    );
    Ok(())
}
