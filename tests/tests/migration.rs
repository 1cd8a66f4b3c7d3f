//! A node migrating in place from upstream kube-router and kube-proxy (issue 28): node-1 is
//! stripped of our datapath (`kube-router cleanup`) and given what upstream kube-router and
//! kube-proxy leave behind when their DaemonSets are replaced (a stale pod firewall chain
//! dropping traffic to an address a new pod now has, ipsets, a tunnel, kube-dummy-if holding the
//! ClusterIP, a protocol-17 route black-holing the other node's pod CIDR, kube-proxy's
//! KUBE-SERVICES DNATing the ClusterIP elsewhere, its nftables table) beside state that is not
//! theirs. Then its agent starts with `--cleanup-legacy-on-start` while connections run through
//! a Service and pod to pod: the leftovers go, the rest stays, traffic flows through this agent
//! alone. `kube-router cleanup --legacy -o json` then removes late leftovers on the running node.
use std::{
    collections::BTreeMap,
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Mutex,
    },
    thread,
    time::{Duration, Instant},
};

use kube_router_tests::{
    cluster::{netprobe, Cluster, Svc},
    kube_router_bin, wait_until, Netns,
};

const VIP: &str = "10.96.0.50";
/// Where the leftovers send traffic: an address on the node subnet nobody has.
const NOWHERE: &str = "10.100.0.77";
const TUNNEL: &str = "tun-0a1b2c3d4e5";
/// A tunnel's name on a device of another kind: not upstream's.
const NOT_A_TUNNEL: &str = "tun-0a1b2c3d4e6";

const BEFORE: usize = 0;
const MIGRATING: usize = 1;
const AFTER: usize = 2;
const PHASES: [&str; 3] = ["before", "migrating", "after"];

/// What upstream kube-router (netpol) and kube-proxy (iptables mode) leave, with a chain of
/// kubelet's and chains of someone else's beside them. `new_pod` is the address a pod that
/// upstream's stale firewall chain drops now has.
fn leftover_rules(new_pod: &str) -> String {
    format!(
        r#"*filter
:KUBE-ROUTER-INPUT - [0:0]
:KUBE-ROUTER-FORWARD - [0:0]
:KUBE-ROUTER-OUTPUT - [0:0]
:KUBE-POD-FW-STALEPOLICY00001 - [0:0]
:KUBE-NWPLCY-STALEPOLICY00001 - [0:0]
:KUBE-FIREWALL - [0:0]
:MY-FIREWALL - [0:0]
-A INPUT -m comment --comment "kube-router netpol - 4IA2OSFRMVNDXBVV" -j KUBE-ROUTER-INPUT
-A FORWARD -m comment --comment "kube-router netpol - TEMCG2JMHZYE7H7T" -j KUBE-ROUTER-FORWARD
-A OUTPUT -m comment --comment "kube-router netpol - VEAAIY32XVBHCSCY" -j KUBE-ROUTER-OUTPUT
-A INPUT -j MY-FIREWALL
-A INPUT -j KUBE-FIREWALL
-A MY-FIREWALL -p tcp -m tcp --dport 9999 -j ACCEPT
-A KUBE-FIREWALL ! -s 127.0.0.0/8 -d 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP
-A KUBE-ROUTER-FORWARD -d {new_pod}/32 -m comment --comment "rule to jump traffic destined to POD name:old-0 namespace: default to chain KUBE-POD-FW-STALEPOLICY00001" -j KUBE-POD-FW-STALEPOLICY00001
-A KUBE-POD-FW-STALEPOLICY00001 -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
-A KUBE-POD-FW-STALEPOLICY00001 -d {new_pod}/32 -j KUBE-NWPLCY-STALEPOLICY00001
-A KUBE-POD-FW-STALEPOLICY00001 -m comment --comment "DROP unmarked traffic" -m mark ! --mark 0x10000/0x10000 -j DROP
-A KUBE-NWPLCY-STALEPOLICY00001 -m set --match-set KUBE-SRC-STALEPOLICY00001 src -m set --match-set KUBE-DST-STALEPOLICY00001 dst -j MARK --set-xmark 0x10000/0x10000
COMMIT
*nat
:KUBE-SERVICES - [0:0]
:KUBE-SVC-MIGRATIONTEST01 - [0:0]
:KUBE-SEP-MIGRATIONTEST01 - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-POSTROUTING - [0:0]
:MY-NAT - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
-A POSTROUTING -m set --match-set kube-router-pod-subnets src -m set ! --match-set kube-router-pod-subnets dst -j MASQUERADE
-A PREROUTING -j MY-NAT
-A MY-NAT -d 198.18.0.1/32 -j RETURN
-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-SERVICES -d {VIP}/32 -p tcp -m comment --comment "default/mig:http cluster IP" -m tcp --dport 80 -j KUBE-SVC-MIGRATIONTEST01
-A KUBE-SVC-MIGRATIONTEST01 -j KUBE-SEP-MIGRATIONTEST01
-A KUBE-SEP-MIGRATIONTEST01 -p tcp -m tcp -j DNAT --to-destination {NOWHERE}:8080
COMMIT
"#
    )
}

fn restore(ns: &Netns, rules: &str) {
    let out = std::process::Command::new("nsenter")
        .arg(format!("--net={}", ns.path()))
        .args(["sh", "-c", "printf '%s' \"$RULES\" | iptables-restore --noflush"])
        .env("RULES", rules)
        .output()
        .unwrap();
    assert!(out.status.success(), "iptables-restore: {}", String::from_utf8_lossy(&out.stderr));
}

/// Upstream's and kube-proxy's firewall leftovers on `node`, and state of others beside them.
fn plant_firewall(node: &Netns, new_pod: &str) {
    let run = |cmd: &str| {
        let args: Vec<&str> = cmd.split_whitespace().collect();
        node.run(&args).unwrap_or_else(|e| panic!("{cmd}: {e}"));
    };
    // ipsets first: the rules match them.
    run("ipset create KUBE-SRC-STALEPOLICY00001 hash:ip");
    run("ipset create KUBE-DST-STALEPOLICY00001 hash:ip");
    run(&format!("ipset add KUBE-DST-STALEPOLICY00001 {new_pod}"));
    run("ipset create kube-router-pod-subnets hash:net");
    run("ipset add kube-router-pod-subnets 10.244.0.0/16");
    run("ipset create inet6:kube-router-node-ips hash:ip family inet6");
    run("ipset create my-allowlist hash:ip");
    restore(node, &leftover_rules(new_pod));
    run("nft add table ip kube-proxy");
    run("nft add chain ip kube-proxy services");
    run("nft add table inet my-table");
    run("nft add chain inet my-table mine");
}

/// Upstream's devices and routes (ours must be gone first: its route has our pod route's
/// destination and metric).
fn plant_routing(node: &Netns) {
    let run = |cmd: &str| {
        let args: Vec<&str> = cmd.split_whitespace().collect();
        node.run(&args).unwrap_or_else(|e| panic!("{cmd}: {e}"));
    };
    // Upstream's IPIP tunnel and dummy, where the kernel has those kinds (this test kernel may
    // not: the planner's unit tests cover them then).
    let add_link = |args: &[&str]| match node.run(&[&["ip", "link", "add"], args].concat()) {
        Ok(_) => true,
        Err(e) => {
            eprintln!("note: not planted, the kernel lacks the kind: {e}");
            false
        }
    };
    if add_link(&[TUNNEL, "type", "ipip", "remote", "10.100.0.2", "local", "10.100.0.1"]) {
        run(&format!("ip link set {TUNNEL} up"));
    }
    if add_link(&["kube-dummy-if", "type", "dummy"]) {
        run(&format!("ip addr add {VIP}/32 dev kube-dummy-if"));
        run("ip link set kube-dummy-if up");
    }
    // Not upstream's: another dummy, and a device with a tunnel's name but another kind.
    add_link(&["my-dummy", "type", "dummy"]);
    assert!(add_link(&[NOT_A_TUNNEL, "type", "vxlan", "id", "7", "dstport", "4789"]));
    run(&format!("ip route add 10.244.2.0/24 via {NOWHERE} proto 17"));
    run("ip route add 198.18.0.0/24 via 10.100.0.254 proto 17");
    run("ip route add 198.18.1.0/24 via 10.100.0.254 proto static");
}

/// What must survive every cleanup: kubelet's chain, someone else's chains, set, table, dummy,
/// the fallback tunnel device the kernel made (with IPIP), and routes of protocol 17 and static
/// to other prefixes.
fn assert_others_untouched(node: &Netns) {
    let save = node.run(&["iptables-save"]).unwrap();
    for needle in [":MY-FIREWALL", "-A INPUT -j MY-FIREWALL", ":KUBE-FIREWALL", "-A INPUT -j KUBE-FIREWALL", ":MY-NAT"]
    {
        assert!(save.contains(needle), "{needle} is gone:\n{save}");
    }
    assert!(save.contains("-A PREROUTING -j MY-NAT"), "{save}");
    assert!(node.run(&["ipset", "list", "-n"]).unwrap().lines().any(|l| l == "my-allowlist"));
    assert!(node.run(&["nft", "list", "tables"]).unwrap().contains("table inet my-table"));
    let links = node.run(&["ip", "-o", "link", "show"]).unwrap();
    assert!(links.contains(&format!(" {NOT_A_TUNNEL}:")), "{links}");
    assert!(links.contains(" my-dummy:") == has_kind(node, "dummy"), "{links}");
    let ipip = node.run(&["ip", "link", "show", "tunl0"]).is_ok();
    assert!(!ipip || links.contains(" tunl0@NONE:"), "{links}");
    assert!(node.run(&["ip", "route", "show", "proto", "17"]).unwrap().contains("198.18.0.0/24 via 10.100.0.254"));
    assert!(node.run(&["ip", "route", "show", "proto", "static"]).unwrap().contains("198.18.1.0/24"));
}

/// The kernel can make links of `kind` (checked with a throwaway one).
fn has_kind(node: &Netns, kind: &str) -> bool {
    let made = node.run(&["ip", "link", "add", "krt-kind-probe", "type", kind]).is_ok();
    let _ = node.run(&["ip", "link", "del", "krt-kind-probe"]);
    made
}

fn assert_leftovers_gone(node: &Netns) {
    let save = node.run(&["iptables-save"]).unwrap();
    for stale in
        ["KUBE-ROUTER-", "KUBE-POD-FW-", "KUBE-NWPLCY-", "KUBE-SERVICES", "KUBE-SVC-", "KUBE-SEP-", "KUBE-MARK-MASQ"]
    {
        assert!(!save.contains(stale), "{stale} left:\n{save}");
    }
    assert!(!save.contains("KUBE-POSTROUTING") && !save.contains("kube-router-pod-subnets"), "{save}");
    let sets = node.run(&["ipset", "list", "-n"]).unwrap();
    assert!(!sets.contains("kube-router-") && !sets.contains("KUBE-SRC-") && !sets.contains("KUBE-DST-"), "{sets}");
    assert!(!node.run(&["nft", "list", "tables"]).unwrap().contains("kube-proxy"));
    let links = node.run(&["ip", "-o", "link", "show"]).unwrap();
    assert!(!links.contains("kube-dummy-if") && !links.contains(TUNNEL), "{links}");
    assert!(!node.run(&["ip", "route", "show", "proto", "17"]).unwrap().contains("10.244."));
}

/// One traffic path probed in a loop: attempts and failures per phase.
struct Path<'a> {
    name: &'static str,
    from: &'a Netns,
    target: String,
    tally: Mutex<[(usize, usize); 3]>,
    last_ok: AtomicBool,
}

#[test]
fn a_node_migrates_from_upstream_kube_router_and_kube_proxy_under_traffic() {
    let c = Cluster::builder("krt-mig").pods_per_node(2).build().unwrap();
    // Backends on node-2 only: node-1's pods reach them across the pod route upstream broke.
    c.add_service(Svc::cluster_ip("mig", VIP).select("node", "node-2")).unwrap();
    // pod-1-1 is the "new pod" holding the address upstream's stale chain drops.
    let new_pod = c.pod(0, 1).ip.clone();
    let paths = [
        Path {
            name: "pod-1-0 -> ClusterIP (backends on node-2)",
            from: &c.pod(0, 0).ns,
            target: format!("{VIP}:80"),
            tally: Mutex::default(),
            last_ok: AtomicBool::new(false),
        },
        Path {
            name: "pod-2-0 -> pod-1-1 (the new pod)",
            from: &c.pod(1, 0).ns,
            target: format!("{new_pod}:8080"),
            tally: Mutex::default(),
            last_ok: AtomicBool::new(false),
        },
        Path {
            name: "pod-1-0 -> pod-2-1",
            from: &c.pod(0, 0).ns,
            target: format!("{}:8080", c.pod(1, 1).ip),
            tally: Mutex::default(),
            last_ok: AtomicBool::new(false),
        },
    ];
    let phase = AtomicUsize::new(BEFORE);
    let stop = AtomicBool::new(false);

    thread::scope(|s| {
        for path in &paths {
            let (phase, stop) = (&phase, &stop);
            s.spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let now = phase.load(Ordering::Relaxed);
                    let ok = netprobe(path.from, &["timed", "tcp", &path.target]).starts_with("OK");
                    // An attempt counts in the phase it started and ended in.
                    if phase.load(Ordering::Relaxed) == now {
                        let mut tally = path.tally.lock().unwrap();
                        tally[now].0 += 1;
                        tally[now].1 += usize::from(!ok);
                    }
                    path.last_ok.store(ok, Ordering::Relaxed);
                    thread::sleep(Duration::from_millis(100));
                }
            });
        }
        // The probes stop however the migration ends (a failed assertion must not leave the
        // scope waiting on them forever).
        let migration =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| migrate(&c, &paths, &phase, &new_pod)));
        stop.store(true, Ordering::Relaxed);
        if let Err(panic) = migration {
            std::panic::resume_unwind(panic);
        }
    });
    report_and_check(&c, &paths);
}

/// Traffic flows; node-1 is turned into a node upstream's DaemonSet left; its agent starts with
/// `--cleanup-legacy-on-start`; traffic flows again.
fn migrate(c: &Cluster, paths: &[Path], phase: &AtomicUsize, new_pod: &str) {
    let node1 = &c.node(0).ns;
    {
        thread::sleep(Duration::from_secs(2));

        // node-1 as upstream's DaemonSet leaves it: no agent of ours, their state in place.
        phase.store(MIGRATING, Ordering::Relaxed);
        plant_firewall(node1, new_pod);
        // Why they must go: the stale chain drops traffic to the new pod even with our agent
        // running (its programs do not take plain pod traffic past the FORWARD chain).
        let to_new_pod = format!("{new_pod}:8080");
        assert!(netprobe(&c.pod(1, 0).ns, &["timed", "tcp", &to_new_pod]).starts_with("ERR"));
        c.stop_agent(0);
        let node = c.node(0);
        let root = node.bpf_root.display().to_string();
        let state = node.state_dir.display().to_string();
        let bin = kube_router_bin().display().to_string();
        node1.run(&[&bin, "--bpf-root", &root, "--state-dir", &state, "cleanup"]).unwrap();
        plant_routing(node1);
        eprintln!("leftovers planted on node-1");
        // Traffic meets them for a while (a failed attempt takes netprobe's 2 s timeout).
        thread::sleep(Duration::from_secs(4));

        let started = Instant::now();
        c.restart_agent_with(0, &["--cleanup-legacy-on-start"]).unwrap();
        c.wait_routes(Duration::from_secs(60)).unwrap();
        eprintln!("pod routes converged {:.1} s after the agent started", started.elapsed().as_secs_f64());
        c.wait_pod_sources().unwrap();
        c.wait_programmed(&format!("{VIP}:80"), true).unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while !paths.iter().all(|p| p.last_ok.load(Ordering::Relaxed)) {
            assert!(Instant::now() < deadline, "traffic did not recover after the migration");
            thread::sleep(Duration::from_millis(100));
        }
        eprintln!("migrated: every path answers {:.1} s after the agent started", started.elapsed().as_secs_f64());
        phase.store(AFTER, Ordering::Relaxed);
        thread::sleep(Duration::from_secs(3));
    }
}

fn report_and_check(c: &Cluster, paths: &[Path]) {
    let node1 = &c.node(0).ns;
    let mut counts = BTreeMap::new();
    for path in paths {
        let tally = *path.tally.lock().unwrap();
        for (i, name) in PHASES.iter().enumerate() {
            eprintln!("{:<44} {name:<9} {:>3} connections, {:>3} failed", path.name, tally[i].0, tally[i].1);
        }
        counts.insert(path.name, tally);
    }
    for (name, tally) in &counts {
        assert!(tally[BEFORE].0 > 0 && tally[BEFORE].1 == 0, "{name} before: {tally:?}");
        assert!(tally[AFTER].0 >= 5 && tally[AFTER].1 == 0, "{name} after the migration: {tally:?}");
    }
    assert_leftovers_gone(node1);
    assert_others_untouched(node1);
    // Our route replaced upstream's.
    let route = node1.run(&["ip", "route", "show", "10.244.2.0/24"]).unwrap();
    assert!(route.contains("via 10.100.0.2") && route.contains("proto bgp"), "{route}");

    // Late leftovers on the running node, removed by the subcommand, reported per kind (node pod
    // CIDRs from the agent's checkpoint); upstream's route beside ours, behind it by metric.
    let node = c.node(0);
    let passes = node.metric("kube_router_host_routes_sync_time_count", "");
    let removed = node.metric("kube_router_host_routes_removed", "");
    node1.run(&["ip", "route", "add", "10.244.2.0/24", "via", NOWHERE, "proto", "17", "metric", "10"]).unwrap();
    // The route change wakes the FIB; the pass it runs sees a fallback behind ours, not a claim.
    wait_until("a FIB pass after the foreign route", Duration::from_secs(10), || {
        Ok(node.metric("kube_router_host_routes_sync_time_count", "") > passes)
    })
    .unwrap();
    assert_eq!(node.metric("kube_router_host_routes_removed", ""), removed, "ours withdrawn for a route behind it");
    node1.run(&["ipset", "create", "kube-router-svip", "hash:ip"]).unwrap();
    restore(
        node1,
        "*filter\n:KUBE-NWPLCY-LATELEFTOVER0001 - [0:0]\n-A FORWARD -j KUBE-NWPLCY-LATELEFTOVER0001\n\
         -A KUBE-NWPLCY-LATELEFTOVER0001 -j DROP\nCOMMIT\n",
    );
    let (root, state) = (node.bpf_root.display().to_string(), node.state_dir.display().to_string());
    let bin = kube_router_bin().display().to_string();
    let out =
        node1.run(&[&bin, "--bpf-root", &root, "--state-dir", &state, "cleanup", "--legacy", "-o", "json"]).unwrap();
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    eprintln!("cleanup --legacy: {report}");
    let expected = [
        ("iptables_rules", 1),
        ("iptables_chains", 1),
        ("ipsets", 1),
        ("nft_tables", 0),
        ("ipvs_services", 0),
        ("routes", 1),
        ("links", 0),
    ];
    for (kind, n) in expected {
        assert_eq!(report["counts"][kind], n, "{kind}: {report}");
    }
    assert!(report["failed"].as_array().unwrap().is_empty(), "{report}");
    assert!(report["notes"].to_string().contains("IPVS is not in this kernel"), "{report}");
    assert_leftovers_gone(node1);
    assert_others_untouched(node1);
    // Ours untouched by it: the agent's route, and traffic.
    let route = node1.run(&["ip", "route", "show", "10.244.2.0/24"]).unwrap();
    assert!(route.contains("via 10.100.0.2") && route.contains("proto bgp"), "{route}");
    for path in paths {
        assert!(netprobe(path.from, &["timed", "tcp", &path.target]).starts_with("OK"), "{}", path.name);
    }
}
