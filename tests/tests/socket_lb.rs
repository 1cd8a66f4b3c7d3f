//! End to end, as root: the socket load balancer (cgroup connect4/sendmsg4/recvmsg4/getpeername4)
//! attached to a cgroup of the test's own. Processes of the "node" (its network namespace, in
//! that cgroup) and of a "hostNetwork pod" (same namespace, a child cgroup) reach ClusterIPs and
//! NodePorts with real sockets, see the frontend as their peer, and the TC programs never
//! translate that traffic. Nothing is attached to the machine's root cgroup.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::{Ipv4Addr, SocketAddr},
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    time::Duration,
};

use kube_router_tests::{
    apiserver::{FakeApiServer, FakeApiServerConfig},
    *,
};
use serde::Deserialize;

/// A ClusterIP service without endpoints.
const EMPTY_VIP: &str = "10.96.0.12";
/// The `kubernetes` Service's ClusterIP.
const API_VIP: &str = "10.96.0.1";
/// The agent's metrics listener, in the node namespace.
const METRICS_PORT: &str = "20240";

/// `web` (ClusterIP + NodePorts 30080/tcp and 30053/udp), `sticky` (ClientIP affinity) and
/// `empty` (no endpoints).
fn services() -> String {
    let all = backend_addrs(3);
    let spec = |name, cluster_ip, node_port, affinity, backends| ServiceSpec {
        name,
        cluster_ip,
        node_port,
        affinity,
        backends,
    };
    let web = service_objects(&spec("web", VIP, Some(30080), false, &all))
        .replace("port: 53, targetPort: 5353}", "port: 53, targetPort: 5353, nodePort: 30053}");
    let sticky = service_objects(&spec("sticky", STICKY_VIP, None, true, &all));
    let empty = service_objects(&spec("empty", EMPTY_VIP, None, false, &[]));
    format!("{web}{sticky}{empty}")
}

struct Env {
    topo: Topology,
    file: ServiceFile,
    /// The node's cgroup (what production calls the cgroup v2 root).
    cgroup: TestCgroup,
    /// A hostNetwork pod's cgroup below it: the node's network namespace, its own cgroup.
    host_network_pod: PathBuf,
    /// A pod with its own network namespace (the client's), also below the node's cgroup.
    own_netns_pod: PathBuf,
}

impl Env {
    fn new(prefix: &str) -> Env {
        let topo = Topology::new(prefix, 3).expect("topology");
        remove_bpf_root(&topo.bpf_root());
        let file = ServiceFile::new(prefix);
        file.write(&services()).unwrap();
        let mut cgroup = TestCgroup::new(prefix).unwrap();
        let host_network_pod = cgroup.child("kubepods/hostnet-pod").unwrap();
        let own_netns_pod = cgroup.child("kubepods/own-netns-pod").unwrap();
        Env { topo, file, cgroup, host_network_pod, own_netns_pod }
    }

    fn root(&self) -> PathBuf {
        self.topo.bpf_root()
    }

    /// The agent with the socket load balancer on the test cgroup; returns once the programs
    /// are on the cgroup and the services are in the maps.
    fn agent(&self, extra: &[&str]) -> Agent {
        self.agent_in(None, extra)
    }

    /// As [`Env::agent`], the agent a process of `own_cgroup` when given (else the test's).
    fn agent_in(&self, own_cgroup: Option<&Path>, extra: &[&str]) -> Agent {
        let cgroup = self.cgroup.path.to_str().unwrap();
        let mut args = vec!["--service-file", self.file.path.to_str().unwrap(), "--health-port", "0"];
        args.extend(["--metrics-port", METRICS_PORT, "--cgroup-root", cgroup]);
        args.extend(extra);
        let agent = match own_cgroup {
            Some(own) => Agent::start_in_cgroup(&self.topo.node, own, &self.root(), &args),
            None => Agent::start(&self.topo.node, &self.root(), &args),
        }
        .unwrap();
        wait_until("socket LB attached and services programmed", Duration::from_secs(30), || {
            Ok(self.ours_attached()? == 8 && cli(&self.root(), "services")?.contains(&format!("{EMPTY_VIP}:80")))
        })
        .unwrap();
        agent
    }

    /// How many of our eight programs (four hooks, two families) are on the cgroup.
    fn ours_attached(&self) -> anyhow::Result<usize> {
        Ok(self.cgroup.programs()?.iter().filter(|(_, _, name)| name.starts_with("kr_sk_")).count())
    }

    /// `count` exchanges from a process of `cgroup` in `ns`.
    fn exchanges(&self, ns: &Netns, cgroup: &Path, mode: &str, target: &str, count: usize) -> Vec<Exchange> {
        let out =
            TestCgroup::run(ns, cgroup, &[netprobe_bin().to_str().unwrap(), "peer", mode, target, &count.to_string()])
                .unwrap();
        out.lines().map(Exchange::parse).collect()
    }

    fn ask_from_node(&self, mode: &str, target: &str, count: usize) -> Vec<Exchange> {
        self.exchanges(&self.topo.node, &self.cgroup.path, mode, target, count)
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        remove_bpf_root(&self.topo.bpf_root());
    }
}

/// One line of `krt-netprobe peer`.
#[derive(Debug)]
struct Exchange {
    /// The backend's name, or the error.
    outcome: Result<String, String>,
    /// The peer address the socket API reported.
    peer: String,
    micros: u64,
}

impl Exchange {
    fn parse(line: &str) -> Exchange {
        let (rest, micros) = line.rsplit_once(' ').expect("ends with MICROS");
        let micros = micros.parse().expect("MICROS");
        match rest.strip_prefix("OK ") {
            Some(ok) => {
                let (name, peer) = ok.split_once(' ').expect("NAME PEER");
                Exchange { outcome: Ok(name.to_string()), peer: peer.to_string(), micros }
            }
            None => Exchange { outcome: Err(rest.to_string()), peer: String::new(), micros },
        }
    }
}

/// Every exchange answered by a backend that the application saw as `target`; the backends.
fn backends_behind(target: &str, exchanges: &[Exchange]) -> BTreeSet<String> {
    for e in exchanges {
        assert!(e.outcome.is_ok(), "{target}: {exchanges:?}");
        assert_eq!(e.peer, target, "the application must see the frontend as its peer: {exchanges:?}");
    }
    exchanges.iter().map(|e| e.outcome.clone().unwrap()).collect()
}

/// `kube-router --bpf-root ROOT COMMAND`.
fn cli(root: &Path, command: &str) -> anyhow::Result<String> {
    sh(&[kube_router_bin().to_str().unwrap(), "--bpf-root", root.to_str().unwrap(), command])
}

/// `kube-router stats`: TC counters by name, socket counters as `sock_<name>`.
fn stats(root: &Path) -> BTreeMap<String, u64> {
    cli(root, "stats")
        .unwrap()
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(name, n)| (name.to_string(), n.parse().unwrap()))
        .collect()
}

fn delta(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>, name: &str) -> u64 {
    after[name] - before[name]
}

#[test]
fn node_and_host_network_processes_reach_services_through_the_socket_lb() {
    let env = Env::new("krt-sk");
    let _agent = env.agent(&[]);
    let root = env.root();
    let before = stats(&root);

    let node_port_tcp = format!("{NODE_ADDR}:30080");
    let node_port_udp = format!("{NODE_ADDR}:30053");
    let targets = [
        ("tcp", format!("{VIP}:80"), 3),
        ("udp", format!("{VIP}:53"), 3),
        ("udp-connected", format!("{VIP}:53"), 3),
        ("tcp", "127.0.0.1:30080".to_string(), 2),
        ("udp", "127.0.0.1:30053".to_string(), 2),
        ("tcp", node_port_tcp.clone(), 2),
        ("udp", node_port_udp.clone(), 2),
    ];
    let mut translated = 0;
    for (mode, target, spread) in &targets {
        let exchanges = env.ask_from_node(mode, target, 30);
        let backends = backends_behind(target, &exchanges);
        assert!(backends.len() >= *spread, "{mode} {target} spreads over {spread}+ backends: {backends:?}");
        translated += 30;
    }

    // A hostNetwork pod: the node's namespace, a cgroup below the one the programs are on.
    for (mode, target) in
        [("tcp", format!("{VIP}:80")), ("udp", format!("{VIP}:53")), ("tcp", "127.0.0.1:30080".into())]
    {
        let exchanges = env.exchanges(&env.topo.node, &env.host_network_pod, mode, &target, 12);
        assert!(backends_behind(&target, &exchanges).len() >= 2, "{mode} {target}: {exchanges:?}");
        translated += 12;
    }

    // ClientIP affinity: the node is one client, whichever of its cgroups a process is in.
    let sticky = format!("{STICKY_VIP}:80");
    let from_node = backends_behind(&sticky, &env.ask_from_node("tcp", &sticky, 20));
    let from_pod = backends_behind(&sticky, &env.exchanges(&env.topo.node, &env.host_network_pod, "tcp", &sticky, 10));
    assert_eq!(from_node.len(), 1, "affinity pins the node to one backend: {from_node:?}");
    assert_eq!(from_pod, from_node, "a hostNetwork pod is the same client as the node");
    translated += 30;

    // No endpoints: refused at once, TCP and UDP, not a timeout.
    for mode in ["tcp", "udp"] {
        let target = format!("{EMPTY_VIP}:{}", if mode == "tcp" { 80 } else { 53 });
        for e in env.ask_from_node(mode, &target, 5) {
            let error = e.outcome.as_ref().expect_err("no endpoints must fail");
            assert!(error.contains("Connection refused"), "{mode} {target}: {error}");
            assert!(e.micros < 50_000, "{mode} {target} failed after {} µs, not at once", e.micros);
        }
    }

    // A pod with a network namespace of its own (the client's), in a cgroup below the node's:
    // its sockets are load-balanced too, but its loopback is its own, never a NodePort.
    let pod = &env.own_netns_pod;
    let exchanges = env.exchanges(&env.topo.client, pod, "tcp", &format!("{VIP}:80"), 12);
    assert!(backends_behind(&format!("{VIP}:80"), &exchanges).len() >= 2);
    translated += 12;
    let loopback_before = stats(&root)["sock_loopback_nodeport"];
    let own_loopback = env.exchanges(&env.topo.client, pod, "tcp", "127.0.0.1:30080", 1);
    assert!(own_loopback[0].outcome.as_ref().is_err_and(|e| e.contains("refused")), "{own_loopback:?}");
    assert_eq!(stats(&root)["sock_loopback_nodeport"], loopback_before, "a pod's loopback is not the node's");

    // Every one of those went to its backend from the socket; TC translated none of them.
    let after = stats(&root);
    for tc in ["new_flow", "ct_hit", "reverse_nat", "no_backend_drop"] {
        assert_eq!(delta(&before, &after, tc), 0, "TC {tc} moved: socket-balanced traffic translated twice");
    }
    assert_eq!(cli(&root, "conntrack").unwrap(), "", "no TC conntrack entry for socket-balanced flows");
    assert!(delta(&before, &after, "sock_translated") >= translated, "{before:?} -> {after:?}");
    assert_eq!(delta(&before, &after, "sock_no_backend_refused"), 10);
    assert!(delta(&before, &after, "sock_reverse_restored") >= translated, "{after:?}");
    assert_eq!(delta(&before, &after, "sock_reverse_insert_failed"), 0);
}

/// Whether pinned `sock_exempt` holds cgroup `id` (bpftool exits non-zero for a missing key).
fn exempt_holds(root: &Path, id: u64) -> bool {
    let map = maps_dir(root).join("sock_exempt");
    let key: Vec<String> = id.to_le_bytes().iter().map(|b| format!("{b:02x}")).collect();
    let mut args = vec!["bpftool", "map", "lookup", "pinned", map.to_str().unwrap(), "key", "hex"];
    args.extend(key.iter().map(String::as_str));
    sh(&args).is_ok()
}

/// The agent's own sockets are never translated (issue 26): a process of the agent's cgroup
/// reaches what listens at a frontend's own address, while every other process is balanced. The
/// stand-in for an API server listens on the node's address at the NodePorts' ports, so a
/// frontend (the NodePort) captures exactly its address and port, as a hostile Service on the
/// API server's address would.
#[test]
fn the_agents_own_cgroup_is_never_translated() {
    let mut env = Env::new("krt-skx");
    let agent_cgroup = env.cgroup.child("kube-router").unwrap();
    let agent_cgroup_id = std::fs::metadata(&agent_cgroup).unwrap().ino();
    for ns in [&env.topo.client, &env.topo.node].into_iter().chain(&env.topo.backends) {
        ns.wait_addresses_settled().unwrap();
    }
    env.file.write(&format!("{}{}", services(), ipv6_service())).unwrap();
    for port in ["30080", "30053", "30090"] {
        env.topo.node.spawn(&[netprobe_bin().to_str().unwrap(), "serve", "apiserver", port]).unwrap();
    }
    wait_until("the stand-in API server listening", Duration::from_secs(10), || {
        Ok(!env.topo.node.run(&["ss", "-Hlnt", "sport = :30080"])?.trim().is_empty())
    })
    .unwrap();
    let _agent = env.agent_in(Some(&agent_cgroup), &[]);
    wait_until("the agent's own cgroup exempt, the IPv6 NodePort programmed", Duration::from_secs(20), || {
        Ok(exempt_holds(&env.root(), agent_cgroup_id) && cli(&env.root(), "services")?.contains(VIP6))
    })
    .unwrap();
    let root = env.root();
    let before = stats(&root);

    // The node's processes: balanced as ever, the NodePort included.
    let vip = format!("{VIP}:80");
    let node_port_tcp = format!("{NODE_ADDR}:30080");
    let node_port_udp = format!("{NODE_ADDR}:30053");
    let node_port6 = format!("[{NODE_ADDR6}]:30090");
    let mut translated = 0;
    for (mode, target) in [("tcp", &vip), ("tcp", &node_port_tcp), ("udp", &node_port_udp), ("tcp", &node_port6)] {
        let backends = backends_behind(target, &env.ask_from_node(mode, target, 10));
        assert!(backends.len() >= 2 && !backends.contains("apiserver"), "{mode} {target}: {backends:?}");
        translated += 10;
    }

    // The agent's cgroup: connect (IPv4, IPv6, IPv6 to a mapped IPv4 address) and sendmsg reach
    // the address the application named.
    let mapped = format!("[::ffff:{NODE_ADDR}]:30080");
    let mut untranslated = 0;
    for (mode, target) in [("tcp", &node_port_tcp), ("udp", &node_port_udp), ("tcp", &mapped), ("tcp", &node_port6)] {
        let exchanges = env.exchanges(&env.topo.node, &agent_cgroup, mode, target, 5);
        let answered = backends_behind(target, &exchanges);
        assert_eq!(answered, BTreeSet::from(["apiserver".to_string()]), "{mode} {target}: {exchanges:?}");
        untranslated += 5;
    }
    // Nothing listens at the ClusterIP itself.
    for e in env.exchanges(&env.topo.node, &agent_cgroup, "tcp", &vip, 2) {
        assert!(e.outcome.is_err(), "{vip} from the agent's cgroup reached a backend: {e:?}");
    }
    untranslated += 2;

    let after = stats(&root);
    assert_eq!(delta(&before, &after, "sock_translated"), translated, "{before:?} -> {after:?}");
    assert_eq!(delta(&before, &after, "sock_agent_untranslated"), untranslated, "{after:?}");
    assert_eq!(delta(&before, &after, "new_flow"), 0, "the TC path translated none of them");
}

/// An IPv6-only Service over the IPv6 half of the topology: ClusterIP and `[::1]:<nodePort>`.
fn ipv6_service() -> String {
    let endpoints: String =
        backend_addrs6(3).iter().map(|a| format!("- addresses: [\"{a}\"]\n  conditions: {{ready: true}}\n")).collect();
    format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{namespace: default, name: web6}}\nspec:\n  type: NodePort\n  \
         clusterIP: \"{VIP6}\"\n  clusterIPs: [\"{VIP6}\"]\n  ipFamilies: [IPv6]\n  ports:\n  \
         - {{name: http, protocol: TCP, port: 80, targetPort: 8080, nodePort: 30090}}\n  \
         - {{name: dns, protocol: UDP, port: 53, targetPort: 5353}}\n\
         ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  namespace: default\n  name: web6-1\n  \
         labels: {{kubernetes.io/service-name: web6}}\naddressType: IPv6\nports:\n- {{name: http, protocol: TCP, port: 8080}}\n\
         - {{name: dns, protocol: UDP, port: 5353}}\nendpoints:\n{endpoints}"
    )
}

const VIP6: &str = "fd00:96::20";

/// IPv6 sockets of the node reach an IPv6 Service through connect6/sendmsg6, see the frontend as
/// their peer (recvmsg6/getpeername6), and reach its NodePort on `[::1]`.
#[test]
fn node_processes_reach_an_ipv6_service_through_the_socket_lb() {
    let env = Env::new("krt-sk6");
    for ns in [&env.topo.client, &env.topo.node].into_iter().chain(&env.topo.backends) {
        ns.wait_addresses_settled().unwrap();
    }
    env.file.write(&format!("{}{}", services(), ipv6_service())).unwrap();
    let _agent = env.agent(&[]);
    wait_until("the IPv6 frontend programmed", Duration::from_secs(20), || {
        Ok(cli(&env.root(), "services")?.contains(VIP6))
    })
    .unwrap();
    let before = stats(&env.root());
    for (mode, port) in [("tcp", 80), ("udp", 53), ("udp-connected", 53)] {
        let target = format!("[{VIP6}]:{port}");
        let backends = backends_behind(&target, &env.ask_from_node(mode, &target, 20));
        assert!(backends.len() >= 2, "{mode} {target}: {backends:?}");
    }
    let loopback = "[::1]:30090";
    assert!(backends_behind(loopback, &env.ask_from_node("tcp", loopback, 10)).len() >= 2);
    let after = stats(&env.root());
    assert!(delta(&before, &after, "sock_translated") >= 70, "{after:?}");
    assert!(delta(&before, &after, "sock_loopback_nodeport") >= 10, "{after:?}");
    assert_eq!(delta(&before, &after, "new_flow"), 0, "the TC path translated none of them");
}

/// A dual-stack (AF_INET6) socket talking IPv4 through a mapped address (`::ffff:a.b.c.d`, what
/// Java and many resolvers do) is balanced over the IPv4 Service, and sees the frontend as its peer.
#[test]
fn a_dual_stack_socket_reaches_an_ipv4_service_through_its_mapped_address() {
    let env = Env::new("krt-skm");
    let _agent = env.agent(&[]);
    let before = stats(&env.root());
    for (mode, port) in [("tcp", 80), ("udp", 53), ("udp-connected", 53)] {
        let target = format!("[::ffff:{VIP}]:{port}");
        let backends = backends_behind(&target, &env.ask_from_node(mode, &target, 20));
        assert!(backends.len() >= 2, "{mode} {target}: {backends:?}");
    }
    let node_port = "[::ffff:127.0.0.1]:30080";
    assert!(!backends_behind(node_port, &env.ask_from_node("tcp", node_port, 5)).is_empty());
    let after = stats(&env.root());
    assert!(delta(&before, &after, "sock_translated") >= 65, "{after:?}");
    assert_eq!(delta(&before, &after, "new_flow"), 0, "the TC path translated none of them");
}

#[test]
fn restart_adopts_the_links_and_cleanup_leaves_other_programs_on_the_cgroup() {
    let env = Env::new("krt-skr");
    let root = env.root();
    // Someone else's connect4 program was there first.
    attach_foreign_connect4(&env.cgroup.path).unwrap();
    let foreign = || env.cgroup.programs().unwrap().into_iter().filter(|(_, _, name)| name == "krt_foreign").count();
    let vip = format!("{VIP}:80");
    let works = || assert!(backends_behind(&vip, &env.ask_from_node("tcp", &vip, 20)).len() >= 2);

    let agent = env.agent(&[]);
    let attached = env.cgroup.programs().unwrap();
    assert_eq!((env.ours_attached().unwrap(), foreign()), (8, 1), "{attached:?}");
    works();
    agent.stop().unwrap();
    // No agent: the pinned links keep balancing.
    works();

    let mut agent = env.agent(&[]);
    let synced = agent.wait_for_service_syncs(1, Duration::from_secs(10)).unwrap();
    assert_eq!(synced.writes, Writes::default(), "restart with unchanged state wrote maps: {synced:?}");
    assert_eq!(env.cgroup.programs().unwrap(), attached, "links re-adopted: the same programs, in the same order");
    let links = agent.scrape().unwrap().link_attaches("cgroup");
    assert_eq!(links, LinkAttaches { adopted: 8, updated: 0, created: 0 }, "socket LB links re-adopted");
    works();
    agent.stop().unwrap();

    // Turned off: our links go, the other program stays, the node no longer reaches the VIP.
    let cgroup = env.cgroup.path.to_str().unwrap();
    let args = ["--service-file", env.file.path.to_str().unwrap(), "--health-port", "0", "--cgroup-root", cgroup];
    let agent = Agent::start(&env.topo.node, &root, &[&args[..], &["--bpf-lb-sock", "false"]].concat()).unwrap();
    wait_until("our links removed", Duration::from_secs(20), || Ok(env.ours_attached()? == 0)).unwrap();
    assert_eq!(foreign(), 1);
    assert!(env.ask_from_node("tcp", &vip, 1)[0].outcome.is_err(), "nothing balances the node's sockets any more");
    agent.stop().unwrap();

    // On again, then uninstalled: `cleanup` removes our links and nothing else.
    env.agent(&[]).stop().unwrap();
    assert_eq!(env.ours_attached().unwrap(), 8);
    cli(&root, "cleanup").unwrap();
    assert_eq!((env.ours_attached().unwrap(), foreign()), (0, 1), "{:?}", env.cgroup.programs().unwrap());
}

/// Applies every document of a YAML stream to the fake API server.
fn apply(server: &FakeApiServer, yaml: &str) {
    for doc in serde_norway::Deserializer::from_str(yaml) {
        let value = serde_norway::Value::deserialize(doc).unwrap();
        if !value.is_null() {
            server.apply(serde_json::to_value(value).unwrap()).unwrap();
        }
    }
}

/// The `kubernetes` Service in front of the API server at `api`.
fn kubernetes_service(api: SocketAddr) -> String {
    let (ip, port) = (api.ip(), api.port());
    format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{namespace: default, name: kubernetes}}\nspec:\n  type: ClusterIP\n  \
         clusterIP: {API_VIP}\n  ports:\n  - {{name: https, protocol: TCP, port: 443, targetPort: {port}}}\n\
         ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  namespace: default\n  name: kubernetes\n  \
         labels: {{kubernetes.io/service-name: kubernetes}}\naddressType: IPv4\nports:\n- {{name: https, protocol: TCP, port: {port}}}\n\
         endpoints:\n- addresses: [\"{ip}\"]\n  conditions: {{ready: true, serving: true, terminating: false}}\n"
    )
}

#[test]
fn agent_uses_the_api_servers_real_address_and_host_processes_reach_it_by_its_cluster_ip() {
    let env = Env::new("krt-ska");
    // The API server on the node's real address, as --master names it on a real node.
    let runtime = NetnsRuntime::new(&env.topo.node).unwrap();
    let node_addr: Ipv4Addr = NODE_ADDR.parse().unwrap();
    let config = FakeApiServerConfig { bind_address: SocketAddr::from((node_addr, 0)), ..Default::default() };
    let server = runtime.run(async move { FakeApiServer::spawn(config).await.unwrap() });
    apply(&server, &services());
    apply(&server, &kubernetes_service(server.address()));

    // No kube-proxy: nothing in the node's namespace translates the kubernetes ClusterIP.
    let rules = env.topo.node.run(&["iptables-save"]).unwrap();
    assert!(!rules.lines().any(|l| l.starts_with("-A")), "iptables rules in the node namespace:\n{rules}");
    let http = |cgroup: &Path| {
        TestCgroup::run(
            &env.topo.node,
            cgroup,
            &[netprobe_bin().to_str().unwrap(), "http", &format!("{API_VIP}:443"), "/version"],
        )
        .unwrap()
    };
    assert!(http(&env.host_network_pod).starts_with("ERR"), "the ClusterIP answers before the agent runs");

    // A checkpoint left by an earlier run names an API server port that is gone.
    let state_dir = std::env::temp_dir().join("krt-ska-state");
    let _ = std::fs::remove_dir_all(&state_dir);
    let cgroup = env.cgroup.path.to_str().unwrap();
    let args = ["--master", &server.url(), "--state-dir", state_dir.to_str().unwrap(), "--health-port", "0"];
    let _agent = Agent::start(&env.topo.node, &env.root(), &[&args[..], &["--cgroup-root", cgroup]].concat()).unwrap();
    let api_backend = server.address().to_string();
    wait_until("the kubernetes Service programmed from the API", Duration::from_secs(30), || {
        let services = cli(&env.root(), "services")?;
        Ok(env.ours_attached()? == 8 && services.contains(&format!("{API_VIP}:443")) && services.contains(&api_backend))
    })
    .unwrap();

    // A hostNetwork pod reaches the API server through `kubernetes.default`'s ClusterIP.
    let reply = http(&env.host_network_pod);
    assert!(reply.starts_with("200\n") && reply.contains("gitVersion"), "{reply}");
    // So does the node, while its TC path saw none of it.
    assert!(http(&env.cgroup.path).starts_with("200\n"));
    assert_eq!(stats(&env.root())["new_flow"], 0);
}
