//! Benchmark (root): real packets through a Service, this datapath against what users run today,
//! on the same topology, in one run. Each contender gets its own client / node / backend
//! namespaces (`kube_router_tests::Topology`); the node translates a ClusterIP (TCP 80, UDP 53) to
//! the backend (8080, 5353):
//!
//! * plain routing: the client talks to the backend's own address (the floor);
//! * this agent as a Service proxy only (TC programs, from a `--service-file`,
//!   `--run-firewall=false`), as kube-proxy is one; and the agent with its NetworkPolicy programs
//!   as well (the default; no policy selects anything), a row of its own;
//! * plain routing through the node the agent runs in (the client talks to the backend's own
//!   address, on ports of its own): what the programs cost traffic that uses no Service; once
//!   through the Service-proxy-only agent, once through the default one (load balancer and policy
//!   programs, "ours+pol"). The client and backend are pods (`--cluster-cidr`, [`cluster_cidr`]):
//!   pod-to-pod traffic, which the load balancer's gate lets pass without a conntrack lookup;
//! * the socket load balancer (cgroup connect4/sendmsg4/recvmsg4 on a cgroup of the bench's own,
//!   `--cgroup-root`): the client in a pod's cgroup below it reaches the ClusterIP translated at
//!   the socket, as a cluster's pods are (the agent attaches to the cgroup v2 root), with an agent
//!   of its own (Service proxy only) and with the default agent with every program attached (TC
//!   load balancer, policy, socket load balancer, XDP on an uplink); checked on the agent's
//!   counters: socket translations, no TC `new_flow`. Through that last agent also plain routing
//!   from the pod's cgroup ("plain through every program");
//! * kube-proxy's iptables mode, its rule shape (KUBE-SERVICES -> KUBE-SVC-* -> KUBE-SEP-* DNAT),
//!   loaded with iptables-restore through both backends (legacy and nft);
//! * kube-proxy's nftables mode, its table shape (a `service-ips` verdict map, per-service chains
//!   with `numgen random`, endpoint chains with `dnat`), loaded with `nft -f`.
//!
//! Client and servers run on one CPU (`taskset`), the agent wherever the scheduler puts it.
//! At 1 and at 10,000 Services (two ports each; the measured one generated last): new TCP
//! connections per second, new UDP flows (a socket per request) per second, one TCP flow's
//! throughput; two rounds (`KRT_BENCH_ROUNDS`) interleaved across the contenders, averaged, and
//! each row's ratio to plain routing per round, min-max. `KRT_BENCH_PROGRAM_TIMES=1` gives each
//! row's nanoseconds per run of each of our programs (the kernel's BPF run-time statistics, on
//! for the run). `KRT_BENCH_PROFILE=<row name>` runs
//! `perf record -a -g` on the measured CPU during that row in the last round. Also the time to program
//! the 10,000 Services, from writing the file to the agent's log line for the sync that
//! programmed them all (`KRT_BENCH_PROGRAMMING_ONLY=1`: only that, and the same objects given
//! to a second agent as kubectl's JSON). Numbers from a loaded
//! 2-core VM: read the ratios.
use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
    rc::Rc,
    thread,
    time::{Duration, Instant},
};

use kube_router_tests::{
    kube_proxy::{self, vip},
    kube_router_bin, netprobe_bin, remove_bpf_root, sh, wait_until, Agent, ServiceFile, TestCgroup, Topology,
    CLIENT_ADDR,
};

const BACKEND: &str = "10.0.10.2";
const SECONDS: &str = "3";
const BULK_BYTES: u64 = 1 << 30;
/// The Service's (TCP, UDP) ports, and its backend's.
const VIP_PORTS: (u16, u16) = (80, 53);
const BACKEND_PORTS: (u16, u16) = (8080, 5353);
/// Extra servers on the backend for plain routing through the agent's node.
const PASSING_PORTS: (u16, u16) = (8081, 5354);
const METRICS_PORT: &str = "20290";
/// Client and backend processes run on this CPU (and so does the packets' processing on the
/// node, in their softirqs): a one-exchange-at-a-time figure otherwise follows where the
/// scheduler happens to put the two ends (up to 3x apart between runs on 2 cores).
const CPU: &str = "1";

struct Contender {
    name: &'static str,
    /// Shared by "this datapath (TC)" and the plain routing through its node.
    topo: Rc<Topology>,
    /// Where the client sends: the Service address, or the backend itself for plain routing.
    target: String,
    /// The (TCP, UDP) ports at `target`.
    ports: (u16, u16),
    agent: Option<Agent>,
    /// Seconds to program the Services.
    programmed_in: f64,
    /// The client runs in this cgroup, below the one the agent attached its socket load
    /// balancer to (a pod's cgroup under the node's): its connect()/sendmsg() to the ClusterIP
    /// are translated at the socket. None: the client's processes stay where the bench runs.
    client_cgroup: Option<PathBuf>,
    /// Keeps the node's cgroup (and the pod's below it) until the contender is dropped.
    _cgroup: Option<Rc<TestCgroup>>,
}

impl Contender {
    fn new(name: &'static str, topo: Rc<Topology>, target: &str, ports: (u16, u16)) -> Contender {
        Contender {
            name,
            topo,
            target: target.into(),
            ports,
            agent: None,
            programmed_in: 0.0,
            client_cgroup: None,
            _cgroup: None,
        }
    }

    /// `args` run in the client's namespace (and cgroup, for a socket-balanced row).
    fn client_run(&self, args: &[&str]) -> String {
        match &self.client_cgroup {
            Some(cgroup) => TestCgroup::run(&self.topo.client, cgroup, args),
            None => self.topo.client.run(args),
        }
        .unwrap_or_else(|e| panic!("{}: {e:#}", self.name))
    }
}

/// The prefixes that make the client and the backend pods (`--cluster-cidr`): without them the
/// agent's `cluster_nets` holds only the Service range and the plain rows measure traffic from
/// outside the cluster (which the gate sends to the conntrack lookup while pod egress masquerade
/// is on), not pod-to-pod traffic. `KRT_BENCH_CLUSTER_CIDR=<list>` for others, `none` for that
/// outside-the-cluster case.
fn cluster_cidr() -> Option<String> {
    match std::env::var("KRT_BENCH_CLUSTER_CIDR") {
        Ok(v) if v == "none" => None,
        Ok(v) => Some(v),
        Err(_) => Some(format!("{CLIENT_ADDR}/32,10.0.10.0/24")),
    }
}

/// The node's socket load balancer cgroup (`--cgroup-root`) for the agent in `prefix`'s
/// topology, and a pod's cgroup below it for the client.
fn node_cgroup(prefix: &str) -> (Rc<TestCgroup>, PathBuf) {
    let mut cgroup = TestCgroup::new(prefix).unwrap();
    let pod = cgroup.child("kubepods/client-pod").unwrap();
    (Rc::new(cgroup), pod)
}

/// An uplink for the node: an interface carrying the default route (a veth whose peer stays in
/// the node, no dummy driver on this kernel), where the agent attaches its XDP fast path
/// (`--xdp auto`: generic on a veth) as on a node's NIC. The bench's client and backend are
/// pods of this node: their traffic does not cross it.
fn add_uplink(topo: &Topology) {
    for cmd in [
        "ip link add krt-uplink type veth peer name krt-uplink-p",
        "ip link set krt-uplink-p up",
        "ip link set krt-uplink up",
        "ip addr add 192.0.2.1/24 dev krt-uplink",
        "ip route add default via 192.0.2.254 dev krt-uplink",
    ] {
        topo.node.run(&cmd.split(' ').collect::<Vec<_>>()).unwrap();
    }
}

/// `kube-router stats` of the agent pinned at `root`: counters by name (socket ones `sock_*`).
fn stats(root: &Path) -> BTreeMap<String, u64> {
    sh(&[kube_router_bin().to_str().unwrap(), "--bpf-root", root.to_str().unwrap(), "stats"])
        .unwrap()
        .lines()
        .filter_map(|l| l.split_once(' '))
        .filter_map(|(name, n)| Some((name.to_string(), n.parse().ok()?)))
        .collect()
}

fn load_rules(topo: &Topology, tool: &str, args: &[&str], rules: &str, dir: &Path) -> f64 {
    let file = dir.join(format!("{tool}.rules"));
    fs::write(&file, rules).unwrap();
    let started = Instant::now();
    let mut command = vec![tool];
    command.extend(args);
    command.push(file.to_str().unwrap());
    topo.node.run(&command).unwrap_or_else(|e| panic!("{tool}: {e}"));
    started.elapsed().as_secs_f64()
}

/// The agent in a topology of its own, the `n` Services programmed from a file of `text`; also
/// the seconds from writing the file to the log line of the sync that programmed them all.
/// `with_uplink`: the node gets an uplink ([`add_uplink`]) first, where the XDP fast path goes.
fn start_agent(prefix: &str, n: usize, text: &str, extra_args: &[&str], with_uplink: bool) -> (Topology, Agent, f64) {
    let topo = Topology::new(prefix, 1).unwrap();
    if with_uplink {
        add_uplink(&topo);
    }
    let root = topo.bpf_root();
    remove_bpf_root(&root);
    let file = ServiceFile::new(prefix);
    file.write("").unwrap();
    let file_arg = file.arg();
    let mut args = vec!["--service-file", &file_arg, "--health-port", "0", "--metrics-port", METRICS_PORT];
    let cidr = cluster_cidr();
    if let Some(cidr) = &cidr {
        args.extend(["--cluster-cidr", cidr]);
    }
    args.extend_from_slice(extra_args);
    let mut agent = Agent::start(&topo.node, &root, &args).unwrap();
    let scrape =
        || topo.node.run(&[netprobe_bin().to_str().unwrap(), "http", &format!("127.0.0.1:{METRICS_PORT}"), "/metrics"]);
    wait_until("agent serving metrics", Duration::from_secs(20), || Ok(scrape().is_ok())).unwrap();
    // Metrics are served before the datapath is loaded: the clock starts once the empty file
    // is programmed, so that what is timed is the Services, not the agent's start.
    agent.wait_for_log("service sync complete", 1, Duration::from_secs(60)).unwrap();
    let scanned = agent.log.lock().unwrap().len();
    let started = Instant::now();
    file.write(text).unwrap();
    // Timed to the agent's log line for the sync that programmed every frontend, looked for
    // every 0.2 ms in the new lines only (a metrics scrape spawns a process in the namespace:
    // tens of milliseconds, as long as what is measured).
    let all_programmed = format!("services={}", 2 * n);
    let programmed = || {
        agent.log.lock().unwrap()[scanned..]
            .iter()
            .any(|l| l.contains("service sync complete") && l.contains(&all_programmed))
    };
    while !programmed() && started.elapsed() < Duration::from_secs(300) {
        thread::sleep(Duration::from_micros(200));
    }
    let programmed_in = started.elapsed().as_secs_f64();
    let wanted = format!("kube_router_map_entries{{map=\"svc_v4\"}} {}\n", 2 * n);
    wait_until("every frontend programmed", Duration::from_secs(10), || Ok(scrape()?.contains(&wanted))).unwrap();
    if with_uplink {
        agent.wait_for_log("XDP fast path attached", 1, Duration::from_secs(20)).unwrap();
    }
    (topo, agent, programmed_in)
}

/// Traffic straight to the backend through the node an agent runs in: what its programs cost
/// traffic that uses no Service. Ports of their own: a client port the Service rows used would
/// match their reverse entries (docs/datapath.md, "A client port reused").
fn plain_routing_through(name: &'static str, topo: Rc<Topology>) -> Contender {
    for port in [PASSING_PORTS.0, PASSING_PORTS.1] {
        let port = port.to_string();
        topo.backends[0].spawn(&[netprobe_bin().to_str().unwrap(), "serve", "backend-1", &port]).unwrap();
    }
    thread::sleep(Duration::from_millis(300));
    Contender::new(name, topo, BACKEND, PASSING_PORTS)
}

/// A node with a do-nothing TC program (`TCX_NEXT`) at ingress and egress of both its interfaces,
/// where the agent puts its load balancer; the links are pinned in a directory of the bench's own
/// and go with the interfaces.
fn noop_tc_topology() -> Topology {
    let topo = Topology::new("krt-sb-noop", 1).unwrap();
    let pins = PathBuf::from("/sys/fs/bpf/krt-sb-noop");
    let _ = std::fs::remove_dir_all(&pins);
    std::fs::create_dir_all(&pins).unwrap();
    for interface in ["to-client", "to-b1"] {
        for direction in ["ingress", "egress"] {
            let pin = pins.join(format!("{interface}-{direction}"));
            topo.node
                .run(&[netprobe_bin().to_str().unwrap(), "tc-noop", interface, direction, pin.to_str().unwrap()])
                .unwrap();
        }
    }
    topo
}

/// The ClusterIP from a client pod whose cgroup is below the agent's `--cgroup-root`, as every
/// pod's is below the node's cgroup v2 root in a cluster: translated at connect()/sendmsg().
fn through_the_socket(
    name: &'static str,
    topo: Rc<Topology>,
    vip: &str,
    cgroup: (Rc<TestCgroup>, PathBuf),
) -> Contender {
    let mut c = Contender::new(name, topo, vip, VIP_PORTS);
    c.client_cgroup = Some(cgroup.1);
    c._cgroup = Some(cgroup.0);
    c
}

/// `with_packets` false: the contenders are only programmed (no `nft -f`, which takes a minute).
fn contenders(n: usize, dir: &Path, with_packets: bool) -> Vec<Contender> {
    let mut list = Vec::new();
    let vip = vip(n - 1);
    let plain = Topology::new("krt-sb-plain", 1).unwrap();
    list.push(Contender::new("plain routing", Rc::new(plain), BACKEND, BACKEND_PORTS));

    // kube-proxy is a Service proxy only: so is the agent compared with it (the "Service proxy
    // only" manifest). The agent as deployed with NetworkPolicy is a row of its own: its policy
    // programs on both pod-facing interfaces, no policy selecting anything.
    let yaml = kube_proxy::service_yaml(n, BACKEND);
    let (topo, agent, programmed_in) = start_agent("krt-sb-ours", n, &yaml, &["--run-firewall=false"], false);
    let topo = Rc::new(topo);
    let mut ours = Contender::new("this datapath (TC)", topo.clone(), &vip, VIP_PORTS);
    ours.agent = Some(agent);
    ours.programmed_in = programmed_in;
    list.push(ours);
    if with_packets {
        // Plain routing through the node the agent runs in: what the programs cost traffic that
        // uses no Service (pod to pod), with the conntrack table as the Service rows left it.
        list.push(plain_routing_through("plain routing through ours", topo));
        // The hooks alone: a program that does nothing at the four places ours run (TCX ingress
        // and egress of the node's interfaces to the client and the backend).
        list.push(plain_routing_through("plain routing through no-op TC", Rc::new(noop_tc_topology())));
        let (topo, agent, programmed_in) = start_agent("krt-sb-pol", n, &yaml, &[], false);
        let topo = Rc::new(topo);
        let mut pol = Contender::new("this datapath + policy programs", topo.clone(), &vip, VIP_PORTS);
        pol.agent = Some(agent);
        pol.programmed_in = programmed_in;
        list.push(pol);
        // The same, traffic that uses no Service: the load balancer's and the policy's TC
        // programs on the way, no policy isolating either end.
        list.push(plain_routing_through("plain routing through ours+pol", topo));

        // The socket load balancer, each agent on a cgroup of the bench's own (never the
        // machine's root), the client in a pod's cgroup below it. Agents of their own: the TC
        // rows' flows leave reverse entries on nearly every client port (tens of thousands of
        // flows in 3 s), which a socket-balanced flow on a reused port to the same backend
        // would match (docs/datapath.md, "A client port reused").
        let cgroup = node_cgroup("krt-sb-sock");
        let root = cgroup.0.path.to_str().unwrap().to_string();
        let args = ["--run-firewall=false", "--cgroup-root", &root];
        let (topo, agent, _) = start_agent("krt-sb-sock", n, &yaml, &args, false);
        let mut sock = through_the_socket("this datapath (socket LB)", Rc::new(topo), &vip, cgroup);
        sock.agent = Some(agent);
        list.push(sock);
        // The agent as deployed by default, every program attached: TC load balancer, policy,
        // socket load balancer, and the XDP fast path on the node's uplink.
        let cgroup = node_cgroup("krt-sb-all");
        let root = cgroup.0.path.to_str().unwrap().to_string();
        let (topo, agent, _) = start_agent("krt-sb-all", n, &yaml, &["--cgroup-root", &root], true);
        let topo = Rc::new(topo);
        let mut all = through_the_socket("ours+pol (socket LB)", topo.clone(), &vip, cgroup.clone());
        all.agent = Some(agent);
        list.push(all);
        // Traffic that uses no Service from a pod under every program: connect()/sendmsg() pass
        // the socket programs (no frontend), the packets the TC ones.
        let mut plain = plain_routing_through("plain through every program", topo);
        plain.client_cgroup = Some(cgroup.1);
        plain._cgroup = Some(cgroup.0);
        list.push(plain);
    }

    for (name, prefix, tool) in [
        ("kube-proxy iptables (legacy)", "krt-sb-ipl", "iptables-legacy-restore"),
        ("kube-proxy iptables (nft)", "krt-sb-ipn", "iptables-nft-restore"),
    ] {
        let topo = Topology::new(prefix, 1).unwrap();
        let mut c = Contender::new(name, Rc::new(topo), &vip, VIP_PORTS);
        c.programmed_in = load_rules(&c.topo, tool, &[], &kube_proxy::iptables_rules(n, BACKEND), dir);
        list.push(c);
    }
    if !with_packets {
        // A second agent given the same objects as kubectl's JSON, after the baselines (the
        // ratios are against the YAML file's agent).
        let json = kube_proxy::service_json(n, BACKEND);
        let (topo, agent, programmed_in) = start_agent("krt-sb-json", n, &json, &["--run-firewall=false"], false);
        let mut c = Contender::new("this datapath (TC), JSON file", Rc::new(topo), &vip, VIP_PORTS);
        c.agent = Some(agent);
        c.programmed_in = programmed_in;
        list.push(c);
        return list;
    }
    let topo = Topology::new("krt-sb-nft", 1).unwrap();
    let mut c = Contender::new("kube-proxy nftables", Rc::new(topo), &vip, VIP_PORTS);
    c.programmed_in = load_rules(&c.topo, "nft", &["-f"], &kube_proxy::nftables_rules(n, BACKEND), dir);
    list.push(c);
    list
}

#[derive(Default, Clone, Copy)]
struct Figures {
    tcp_per_s: f64,
    udp_per_s: f64,
    gbit_per_s: f64,
}

fn measure(c: &Contender) -> Figures {
    let probe = netprobe_bin();
    // A socket row must be translated at the socket, never by TC: checked on the agent's
    // counters around the row.
    let socket_balanced = c.client_cgroup.is_some() && c.ports == VIP_PORTS;
    let before = socket_balanced.then(|| stats(&c.topo.bpf_root()));
    let rate = |proto: &str, port: u16| -> f64 {
        let target = format!("{}:{port}", c.target);
        let out = c.client_run(&["taskset", "-c", CPU, probe.to_str().unwrap(), "rate", proto, &target, SECONDS]);
        let fields: Vec<&str> = out.split_whitespace().collect();
        assert_eq!(fields.get(1), Some(&"0"), "{}: failed exchanges: {out}", c.name);
        fields[2].parse().unwrap()
    };
    let (tcp_port, udp_port) = c.ports;
    let tcp_per_s = rate("tcp", tcp_port);
    let udp_per_s = rate("udp", udp_port);
    let started = Instant::now();
    let bytes = BULK_BYTES.to_string();
    let target = format!("{}:{tcp_port}", c.target);
    let out = c.client_run(&["taskset", "-c", CPU, probe.to_str().unwrap(), "bulk", &target, &bytes]);
    assert!(out.starts_with("backend-1"), "{}: bulk transfer failed: {out}", c.name);
    let gbit_per_s = BULK_BYTES as f64 * 8.0 / started.elapsed().as_secs_f64() / 1e9;
    if let Some(before) = before {
        let after = stats(&c.topo.bpf_root());
        let moved = |name: &str| after.get(name).copied().unwrap_or(0) - before.get(name).copied().unwrap_or(0);
        // Every TCP connection and UDP flow (one exchange each) is one translation at least.
        let exchanges = ((tcp_per_s + udp_per_s) * SECONDS.parse::<f64>().unwrap()) as u64;
        assert!(
            moved("sock_translated") >= exchanges,
            "{}: {} socket translations for {exchanges} exchanges",
            c.name,
            moved("sock_translated")
        );
        assert_eq!(moved("new_flow"), 0, "{}: TC translated socket-balanced flows", c.name);
    }
    Figures { tcp_per_s, udp_per_s, gbit_per_s }
}

fn main() {
    let dir = std::env::temp_dir().join("krt-sb");
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    // `cargo xtask bench` runs the release build (KUBE_ROUTER_BIN); a debug agent parses and
    // compiles several times slower.
    println!("agent: {}", kube_router_bin().display());
    // KRT_BENCH_PROGRAMMING_ONLY=1: only the time to program 10,000 Services, ours against
    // iptables-restore (seconds instead of minutes, to iterate on the agent).
    if std::env::var("KRT_BENCH_PROGRAMMING_ONLY").is_ok_and(|v| v == "1") {
        let list = contenders(10_000, &dir, false);
        println!("\n10000 Services, two ports each: programmed in");
        for c in &list[1..] {
            println!("  {:<30} {:>8.3} s", c.name, c.programmed_in);
        }
        report_programming(&list);
        stop_agents(list);
        return;
    }
    // KRT_BENCH_SERVICES=1 (or 10000): only that measurement.
    let sizes: Vec<usize> = match std::env::var("KRT_BENCH_SERVICES") {
        Ok(n) => vec![n.parse().expect("KRT_BENCH_SERVICES: a number of Services")],
        Err(_) => vec![1, 10_000],
    };
    for n in sizes {
        let list = contenders(n, &dir, true);
        for c in &list {
            c.topo.client.sysctl("net.ipv4.tcp_tw_reuse", "1").unwrap();
            // A port in TIME_WAIT is reused a second after the connection closed: with the
            // default 28,232 ports every contender levelled at about 14,000 connections per
            // second on a fast run, whatever its cost. The client runs no server.
            c.topo.client.sysctl("net.ipv4.ip_local_port_range", "1024 65535").unwrap();
            pin_servers(&c.topo);
        }
        // KRT_BENCH_ROUNDS=N: rounds interleaved across the contenders (default 2), averaged;
        // the ratios to plain routing are also given per round, min-max.
        let rounds: usize = std::env::var("KRT_BENCH_ROUNDS").ok().and_then(|r| r.parse().ok()).unwrap_or(2);
        let mut sums = vec![Figures::default(); list.len()];
        let mut per_round: Vec<Vec<Figures>> = vec![Vec::new(); list.len()];
        // KRT_BENCH_PROFILE=<words of a row's name>: `perf record -a -g` on the measured CPU
        // while that row is measured in the last round (target/perf-service-datapath.data).
        let profile = std::env::var("KRT_BENCH_PROFILE").ok();
        // KRT_BENCH_PROGRAM_TIMES=1: the kernel's run-time statistics of our programs on (they
        // cost every program run two clock reads, so the ratios are lower), each row's average
        // nanoseconds per run of each program, over every round.
        let stats_switch = std::env::var("KRT_BENCH_PROGRAM_TIMES").is_ok_and(|v| v == "1").then(BpfStats::on);
        let mut program_times = stats_switch.as_ref().map(|_| Vec::new());
        for round in 0..rounds {
            for ((c, sum), seen) in list.iter().zip(sums.iter_mut()).zip(per_round.iter_mut()) {
                let perf = profile.as_deref().filter(|row| round + 1 == rounds && c.name == *row).map(|_| {
                    let out = kube_router_tests::target_dir().join("perf-service-datapath.data");
                    let child = std::process::Command::new("perf")
                        .args(["record", "-a", "-g", "-C", CPU, "-o", out.to_str().unwrap()])
                        .stdout(std::process::Stdio::null())
                        .stderr(std::process::Stdio::null())
                        .spawn()
                        .expect("perf record");
                    thread::sleep(Duration::from_millis(500));
                    child
                });
                let times_before = program_times.as_ref().map(|_| program_run_times());
                let f = measure(c);
                if let (Some(times), Some(before)) = (program_times.as_mut(), times_before) {
                    times.push((c.name, before, program_run_times()));
                }
                if let Some(mut child) = perf {
                    let _ = std::process::Command::new("kill").args(["-INT", &child.id().to_string()]).status();
                    let _ = child.wait();
                }
                sum.tcp_per_s += f.tcp_per_s / rounds as f64;
                sum.udp_per_s += f.udp_per_s / rounds as f64;
                sum.gbit_per_s += f.gbit_per_s / rounds as f64;
                seen.push(f);
                thread::sleep(Duration::from_millis(200));
            }
        }
        let (ours, plain) = (sums[1], sums[0]);
        println!("\n{n} Service(s), two ports each; the measured one generated last:");
        println!(
            "  {:<30} {:>13} {:>13} {:>10} {:>14}   ours / this: tcp, udp   this / plain: tcp, udp, Gbit/s",
            "", "TCP conn/s", "UDP flows/s", "Gbit/s", "programmed in"
        );
        for (c, f) in list.iter().zip(&sums) {
            println!(
                "  {:<30} {:>13.0} {:>13.0} {:>10.2} {:>12.3} s   {:.2}x, {:.2}x            {:.3}x, {:.3}x, {:.3}x",
                c.name,
                f.tcp_per_s,
                f.udp_per_s,
                f.gbit_per_s,
                c.programmed_in,
                ours.tcp_per_s / f.tcp_per_s,
                ours.udp_per_s / f.udp_per_s,
                f.tcp_per_s / plain.tcp_per_s,
                f.udp_per_s / plain.udp_per_s,
                f.gbit_per_s / plain.gbit_per_s,
            );
        }
        if let Some(times) = &program_times {
            report_program_times(times);
        }
        drop(stats_switch);
        println!("  per round, this / plain routing in the same round (min-max over {rounds} rounds):");
        let span = |values: Vec<f64>| values.iter().fold((f64::MAX, 0.0f64), |(lo, hi), v| (lo.min(*v), hi.max(*v)));
        for (c, seen) in list.iter().zip(&per_round).skip(1) {
            let ratios = |field: fn(&Figures) -> f64| {
                span(seen.iter().zip(&per_round[0]).map(|(f, p)| field(f) / field(p)).collect())
            };
            let (t, u, g) = (ratios(|f| f.tcp_per_s), ratios(|f| f.udp_per_s), ratios(|f| f.gbit_per_s));
            println!(
                "  {:<30} tcp {:.3}-{:.3}x  udp {:.3}-{:.3}x  Gbit/s {:.3}-{:.3}x",
                c.name, t.0, t.1, u.0, u.1, g.0, g.1
            );
        }
        report_programming(&list);
        stop_agents(list);
    }
}

/// Moves the backends' servers (every thread, and so the threads they start) to [`CPU`].
fn pin_servers(topo: &Topology) {
    for backend in &topo.backends {
        let pids = std::process::Command::new("ip").args(["netns", "pids", &backend.name]).output().unwrap();
        for pid in String::from_utf8_lossy(&pids.stdout).split_whitespace() {
            let ok = std::process::Command::new("taskset").args(["-a", "-p", "-c", CPU, pid]).output().unwrap();
            assert!(ok.status.success(), "taskset {pid}: {}", String::from_utf8_lossy(&ok.stderr));
        }
    }
}

fn report_programming(list: &[Contender]) {
    let ours_programmed = list[1].programmed_in;
    for c in list[2..].iter().filter(|c| c.agent.is_none() && c.programmed_in > 0.0) {
        println!("  programming: {} / this datapath = {:.1}x", c.name, c.programmed_in / ours_programmed);
    }
}

fn stop_agents(list: Vec<Contender>) {
    for mut c in list {
        if let Some(agent) = c.agent.take() {
            let _ = agent.stop();
            remove_bpf_root(&c.topo.bpf_root());
        }
    }
}

/// `kernel.bpf_stats_enabled` on while it lives, then back to what it was.
struct BpfStats(String);

impl BpfStats {
    const PATH: &str = "/proc/sys/kernel/bpf_stats_enabled";
    fn on() -> BpfStats {
        let was = fs::read_to_string(Self::PATH).unwrap().trim().to_string();
        fs::write(Self::PATH, "1").unwrap();
        BpfStats(was)
    }
}

impl Drop for BpfStats {
    fn drop(&mut self) {
        let _ = fs::write(Self::PATH, &self.0);
    }
}

/// Run counts and nanoseconds by program name.
type RunTimes = BTreeMap<String, (u64, u64)>;

/// Our programs' (`kr_*`) run counts and run times, summed by name over every one loaded.
fn program_run_times() -> RunTimes {
    let out = sh(&["bpftool", "prog", "show", "--json"]).unwrap();
    let programs: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    let mut times = BTreeMap::new();
    for program in programs {
        let name = program["name"].as_str().unwrap_or_default();
        if name.starts_with("kr_") {
            let sum: &mut (u64, u64) = times.entry(name.to_string()).or_default();
            sum.0 += program["run_cnt"].as_u64().unwrap_or(0);
            sum.1 += program["run_time_ns"].as_u64().unwrap_or(0);
        }
    }
    times
}

/// Each row's average nanoseconds per run of each program that ran during it (only the row's
/// own agent carries traffic then), over every round.
fn report_program_times(times: &[(&'static str, RunTimes, RunTimes)]) {
    let mut by_row: BTreeMap<&str, RunTimes> = BTreeMap::new();
    let mut order = Vec::new();
    for (row, before, after) in times {
        if !order.contains(row) {
            order.push(*row);
        }
        for (name, (runs, ns)) in after {
            let (runs_before, ns_before) = before.get(name).copied().unwrap_or_default();
            let sum = by_row.entry(row).or_default().entry(name.clone()).or_default();
            sum.0 += runs - runs_before;
            sum.1 += ns - ns_before;
        }
    }
    println!("  our programs' run time (kernel.bpf_stats_enabled), ns per run:");
    for row in order {
        let programs: Vec<String> = by_row[row]
            .iter()
            .filter(|(_, (runs, _))| *runs > 1000)
            .map(|(name, (runs, ns))| format!("{}={}", name.trim_start_matches("kr_"), ns / runs))
            .collect();
        if !programs.is_empty() {
            println!("    {row:<30} {}", programs.join(" "));
        }
    }
}
