//! End to end, as root: dual-stack Services over the IPv6 half of the test topology. The agent
//! programs `svc_v6` & co. in a "node" namespace; real TCP and UDP over IPv6 from a "client"
//! namespace reach the backends' IPv6 addresses through the veths.
use std::{collections::BTreeSet, path::Path, time::Duration};

use kube_router_tests::*;

const VIP6: &str = "fd00:96::10";
const METRICS_PORT: &str = "20261";

/// `web`: ClusterIPs [`VIP`] and [`VIP6`], NodePort 30080, one EndpointSlice per family over
/// the same three backends.
fn dual_stack_web() -> String {
    let endpoints = |addrs: Vec<String>| -> String {
        addrs.iter().map(|a| format!("- addresses: [\"{a}\"]\n  conditions: {{ready: true}}\n")).collect()
    };
    let slice = |family: &str, addrs: Vec<String>| {
        format!(
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  namespace: default\n  name: web-{family}\n  labels: {{kubernetes.io/service-name: web}}\naddressType: {family}\nports:\n- {{name: http, protocol: TCP, port: 8080}}\n- {{name: dns, protocol: UDP, port: 5353}}\nendpoints:\n{}",
            endpoints(addrs)
        )
    };
    format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{namespace: default, name: web}}\nspec:\n  type: NodePort\n  clusterIP: {VIP}\n  clusterIPs: [\"{VIP}\", \"{VIP6}\"]\n  ipFamilies: [IPv4, IPv6]\n  ipFamilyPolicy: RequireDualStack\n  ports:\n  - {{name: http, protocol: TCP, port: 80, targetPort: 8080, nodePort: 30080}}\n  - {{name: dns, protocol: UDP, port: 53, targetPort: 5353}}\n{}{}",
        slice("IPv4", backend_addrs(3)),
        slice("IPv6", backend_addrs6(3)),
    )
}

struct Env {
    topo: Topology,
    file: ServiceFile,
}

impl Env {
    fn new(prefix: &str) -> Env {
        let topo = Topology::new(prefix, 3).expect("topology");
        // Until duplicate address detection of the link-local addresses is over, neighbour
        // discovery on the new links can hold the first IPv6 packets back past a request's timeout.
        for ns in [&topo.client, &topo.node].into_iter().chain(&topo.backends) {
            ns.wait_addresses_settled().expect("addresses settled");
        }
        remove_bpf_root(&topo.bpf_root());
        let file = ServiceFile::new(prefix);
        file.write(&dual_stack_web()).unwrap();
        Env { topo, file }
    }

    fn agent(&self) -> Agent {
        let root = self.topo.bpf_root();
        let mut agent = Agent::start(
            &self.topo.node,
            &root,
            &["--service-file", &self.file.arg(), "--health-port", "0", "--metrics-port", METRICS_PORT],
        )
        .unwrap();
        agent.wait_for_service_syncs(1, Duration::from_secs(20)).unwrap();
        agent
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        remove_bpf_root(&self.topo.bpf_root());
    }
}

/// `kube-router --bpf-root ROOT COMMAND`.
fn cli(root: &Path, command: &str) -> anyhow::Result<String> {
    sh(&[kube_router_bin().to_str().unwrap(), "--bpf-root", root.to_str().unwrap(), command])
}

fn assert_all_ok(replies: &[String]) {
    assert!(replies.iter().all(|r| r.starts_with("backend-")), "failed requests: {replies:?}");
}

fn answered_by(replies: &[String]) -> BTreeSet<String> {
    tally(replies).into_keys().collect()
}

/// Waits until `kube-router services` lists the IPv6 frontend `frontend` with `backends`
/// backends (state, not log text).
fn wait_for_v6_frontend(root: &Path, frontend: &str, backends: usize) {
    let wanted = format!("{frontend} ");
    wait_until(&format!("{frontend} in svc_v6"), Duration::from_secs(10), || {
        let listing = cli(root, "services")?;
        Ok(listing.lines().any(|l| l.contains(&wanted) && l.matches("]:").count() == 1 + backends))
    })
    .unwrap();
}

#[test]
fn a_dual_stack_service_answers_on_both_cluster_ips_from_the_same_backends() {
    let env = Env::new("krt6s-ds");
    let _agent = env.agent();
    let topo = &env.topo;
    let root = topo.bpf_root();
    wait_for_v6_frontend(&root, &format!("[{VIP6}]:80"), 3);

    let every_backend: BTreeSet<String> = (1..=3).map(|i| format!("backend-{i}")).collect();
    for (proto, port) in [("tcp", 80), ("udp", 53)] {
        let v4 = topo.request(proto, &format!("{VIP}:{port}"), 60).unwrap();
        let v6 = topo.request(proto, &format!("[{VIP6}]:{port}"), 60).unwrap();
        assert_all_ok(&v4);
        assert_all_ok(&v6);
        assert_eq!(answered_by(&v4), every_backend, "{proto} over IPv4: {:?}", tally(&v4));
        assert_eq!(answered_by(&v6), every_backend, "{proto} over IPv6: {:?}", tally(&v6));
    }
    // The flows are IPv6 conntrack entries: the client's address to the ClusterIP, translated
    // to a backend's IPv6 address.
    let conntrack = cli(&root, "conntrack").unwrap();
    let v6_flow =
        conntrack.lines().find(|l| l.starts_with("forward") && l.contains(&format!("-> [{VIP6}]:80 becomes")));
    let v6_flow = v6_flow.unwrap_or_else(|| panic!("no IPv6 forward entry:\n{conntrack}"));
    assert!(v6_flow.contains(&format!("[{CLIENT_ADDR6}]:")), "{v6_flow}");
    assert!(backend_addrs6(3).iter().any(|b| v6_flow.contains(&format!("[{b}]:8080"))), "{v6_flow}");
    // A port that is not a frontend is not intercepted: nothing listens on the VIP, so it fails.
    let replies = topo.request("tcp", &format!("[{VIP6}]:81"), 1).unwrap();
    assert!(replies[0].starts_with("ERR"), "{replies:?}");

    // The IPv6 frontend's counters (svc_stats_v6) are exported under kube-router's names.
    let series = format!(
        "kube_router_service_total_connections{{svc_namespace=\"default\",service_name=\"web\",service_vip=\"{VIP6}\",protocol=\"tcp\",port=\"80\"}}"
    );
    wait_until("IPv6 connections counted", Duration::from_secs(10), || {
        let scrape = topo.node.scrape_metrics(METRICS_PORT)?;
        Ok(scrape.contains(&series) && metric(&scrape, &series) >= 60.0)
    })
    .unwrap();
}

#[test]
fn an_ipv6_node_port_answers_the_client_beside_the_ipv4_one() {
    let env = Env::new("krt6s-np");
    let _agent = env.agent();
    let topo = &env.topo;
    wait_for_v6_frontend(&topo.bpf_root(), &format!("[{NODE_ADDR6}]:30080"), 3);

    // The backends are not on this node: the flows are source-NATed to the node's IPv6 address
    // (lb_config.snat_addr_v6) and their replies routed back to the client by the program.
    let v6 = topo.request("tcp", &format!("[{NODE_ADDR6}]:30080"), 40).unwrap();
    assert_all_ok(&v6);
    assert!(answered_by(&v6).len() >= 2, "NodePort spreads: {:?}", tally(&v6));
    let v4 = topo.request("tcp", &format!("{NODE_ADDR}:30080"), 20).unwrap();
    assert_all_ok(&v4);
    let conntrack = cli(&topo.bpf_root(), "conntrack").unwrap();
    assert!(
        conntrack.lines().any(|l| l.starts_with("forward snat") && l.contains(&format!("becomes [{NODE_ADDR6}]:"))),
        "no source-NATed IPv6 flow:\n{conntrack}"
    );
}

#[test]
fn restart_with_unchanged_state_writes_nothing_and_ipv6_flows_while_the_agent_is_down() {
    let env = Env::new("krt6s-rs");
    let agent = env.agent();
    let topo = &env.topo;
    let root = topo.bpf_root();
    wait_for_v6_frontend(&root, &format!("[{VIP6}]:80"), 3);
    assert_all_ok(&topo.request("tcp", &format!("[{VIP6}]:80"), 10).unwrap());

    let v6_service_maps = || {
        let dump = dump_maps(&root).unwrap();
        ["svc_v6", "svc_slots_v6", "backends_v6", "svc_v4", "svc_slots_v4", "backends_v4"].map(|n| dump[n].clone())
    };
    let before = v6_service_maps();
    agent.stop().unwrap();

    // No agent: the pinned programs and maps keep serving both families.
    for (proto, port) in [("tcp", 80), ("udp", 53)] {
        assert_all_ok(&topo.request(proto, &format!("[{VIP6}]:{port}"), 20).unwrap());
        assert_all_ok(&topo.request(proto, &format!("{VIP}:{port}"), 10).unwrap());
    }
    assert_all_ok(&topo.request("tcp", &format!("[{NODE_ADDR6}]:30080"), 10).unwrap());

    // `env.agent()` returns after the restarted agent's first sync.
    let mut agent = env.agent();
    let synced = agent.service_syncs().unwrap();
    assert_eq!(synced.writes, Writes::default(), "restart with unchanged state wrote maps: {synced:?}");
    assert_eq!(before, v6_service_maps(), "the service maps of both families are as they were");
    assert_all_ok(&topo.request("udp", &format!("[{VIP6}]:53"), 10).unwrap());
    assert!(agent.is_running());
}

#[test]
fn on_a_node_without_ipv6_the_ipv6_family_is_reported_once_and_ipv4_serves() {
    let env = Env::new("krt6s-v4");
    let topo = &env.topo;
    topo.node.run(&["ip", "-6", "addr", "flush", "scope", "global"]).unwrap();
    let mut agent = env.agent();
    agent.wait_for_rejected("IPFamily", 1, Duration::from_secs(10)).unwrap();
    assert_eq!(agent.scrape().unwrap().rejected("IPFamily"), 1);
    let listing = cli(&topo.bpf_root(), "services").unwrap();
    assert!(!listing.contains("]:"), "no IPv6 frontend is programmed:\n{listing}");
    for (proto, port) in [("tcp", 80), ("udp", 53)] {
        assert_all_ok(&topo.request(proto, &format!("{VIP}:{port}"), 20).unwrap());
    }

    // Another sync with the condition unchanged: not counted again.
    let synced = agent.service_syncs().unwrap();
    env.file.write(&format!("{}\n# touched\n", dual_stack_web())).unwrap();
    agent.wait_for_service_sync_after(&synced, Duration::from_secs(10)).unwrap();
    assert_eq!(agent.scrape().unwrap().rejected("IPFamily"), 1);
}
