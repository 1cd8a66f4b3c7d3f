//! A node on a production fabric. Run as root (in `scripts/isolated.sh`).
//!
//! `a_tor_cannot_take_the_nodes_own_routes`: `krt-fab-node` has its own static default route
//! through an uplink (`krt-fab-gw`, 10.88.0.254) and a link to `krt-fab-tor` (10.77.0.0/24,
//! fd77::/64), where a GoBGP ToR announces a default route, the node's own subnet, martians
//! and a usable prefix, and a raw BGP peer (10.77.0.3) sends an IPv6 multicast NLRI, a
//! multicast range in unicast NLRI and a loopback next hop. The node's own routes stay byte
//! for byte as they were (`ip route` of every table, our protocol excluded), nothing martian is
//! installed, no session is reset; the IPv6 default route (the node has none of its own) is
//! installed, removed exactly when withdrawn, and removed by `kube-router cleanup`.
//!
//! `two_external_peers_never_see_each_others_routes`: two GoBGP routers in different ASNs.
use std::{path::PathBuf, thread, time::Duration};

use kube_router_tests::{
    bgp_status,
    gobgp::{GoBgpd, Neighbor},
    kube_router_bin, metric,
    raw_bgp::{self, announce, attributes, mp_reach, NOTIFICATION},
    remove_bpf_root, veth, wait_until, Agent, Netns, NetnsRuntime,
};

/// The agents' metrics listener (/metrics, /bgp).
const METRICS_PORT: &str = "20263";
const BPF_ROOT: &str = "/sys/fs/bpf/krt-fab-unused";
const POD_V4: &str = "10.244.1.0/24";
const POD_V6: &str = "fd00:244:1::/64";

struct Node {
    ns: Netns,
    dir: PathBuf,
}

impl Node {
    fn new(name: &str, dir: &str) -> Self {
        let dir = PathBuf::from(dir);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("empty.yaml"), "").unwrap();
        Self { ns: Netns::new(name).unwrap(), dir }
    }

    fn start_agent(&self, router_id: &str, peers: &[(&str, u32)], extra: &[&str]) -> Agent {
        let ips: Vec<&str> = peers.iter().map(|(ip, _)| *ip).collect();
        let asns: Vec<String> = peers.iter().map(|(_, asn)| asn.to_string()).collect();
        let mut args = vec![
            "--run-service-proxy=false".to_string(),
            "--run-firewall=false".into(),
            "--service-file".into(),
            self.dir.join("empty.yaml").display().to_string(),
            "--state-dir".into(),
            self.dir.join("state").display().to_string(),
            "--router-id".into(),
            router_id.into(),
            "--cluster-asn".into(),
            "65001".into(),
            "--pod-cidrs".into(),
            format!("{POD_V4},{POD_V6}"),
            "--peer-router-ips".into(),
            ips.join(","),
            "--peer-router-asns".into(),
            asns.join(","),
            "--metrics-port".into(),
            METRICS_PORT.into(),
        ];
        if !extra.iter().any(|a| a.starts_with("--bgp-holdtime")) {
            args.push("--bgp-holdtime=9s".into());
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        Agent::start(&self.ns, &PathBuf::from(BPF_ROOT), &refs).unwrap()
    }

    /// Our routes (protocol 186), both families.
    fn our_routes(&self) -> String {
        let v4 = self.ns.run(&["ip", "route", "show", "proto", "186"]).unwrap();
        let v6 = self.ns.run(&["ip", "-6", "route", "show", "proto", "186"]).unwrap();
        format!("{v4}{v6}")
    }

    /// Every route of every table that is not ours, exactly as `ip route` prints it.
    fn node_routes(&self) -> String {
        let mut out = String::new();
        for family in ["-4", "-6"] {
            let dump = self.ns.run(&["ip", family, "route", "show", "table", "all"]).unwrap();
            for line in dump.lines().filter(|l| !l.contains(" proto bgp ")) {
                out.push_str(line);
                out.push('\n');
            }
        }
        out
    }

    fn bgp(&self) -> String {
        self.ns.run(&[kube_router_bin().to_str().unwrap(), "--metrics-port", METRICS_PORT, "bgp"]).unwrap_or_default()
    }

    fn scrape(&self) -> String {
        self.ns.scrape_metrics(METRICS_PORT).unwrap_or_default()
    }

    /// Seconds our session with `peer` has been up, from `kube-router bgp`.
    fn uptime(&self, peer: &str) -> Option<u64> {
        self.bgp().lines().find(|l| l.starts_with(peer))?.split_whitespace().nth(3)?.parse().ok()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        remove_bpf_root(&PathBuf::from(BPF_ROOT));
    }
}

fn sorted_lines(text: &str) -> Vec<String> {
    let mut lines: Vec<String> = text.lines().map(|l| l.trim().to_string()).filter(|l| !l.is_empty()).collect();
    lines.sort();
    lines
}

#[test]
fn a_tor_cannot_take_the_nodes_own_routes() {
    let node = Node::new("krt-fab-node", "/tmp/krt-fab");
    let tor = Netns::new("krt-fab-tor").unwrap();
    let gw = Netns::new("krt-fab-gw").unwrap();
    veth(&node.ns, "to-tor", "10.77.0.1/24", &tor, "eth0", "10.77.0.2/24").unwrap();
    tor.run(&["ip", "addr", "add", "10.77.0.3/24", "dev", "eth0"]).unwrap();
    node.ns.run(&["ip", "-6", "addr", "add", "fd77::1/64", "dev", "to-tor", "nodad"]).unwrap();
    tor.run(&["ip", "-6", "addr", "add", "fd77::2/64", "dev", "eth0", "nodad"]).unwrap();
    veth(&node.ns, "uplink", "10.88.0.1/24", &gw, "eth0", "10.88.0.254/24").unwrap();
    node.ns.run(&["ip", "route", "add", "default", "via", "10.88.0.254", "proto", "static"]).unwrap();
    node.ns.wait_addresses_settled().unwrap();
    let before = node.node_routes();
    assert!(before.contains("default via 10.88.0.254 dev uplink proto static"), "{before}");

    let gobgp = GoBgpd::start(
        &tor,
        &node.dir,
        (65002, "10.77.0.2"),
        &["10.77.0.2", "fd77::2"],
        &[
            Neighbor { address: "10.77.0.1", asn: 65001, family: "ipv4-unicast" },
            Neighbor { address: "fd77::1", asn: 65001, family: "ipv6-unicast" },
        ],
    )
    .unwrap();
    for prefix in ["0.0.0.0/0", "10.77.0.0/24", "10.77.0.1/32", "127.0.0.0/8", "169.254.0.0/16", "10.100.0.0/24"] {
        gobgp.announce(prefix, &[]).unwrap();
    }
    for prefix in ["::/0", "fd77::/64", "fd00:100::/64"] {
        gobgp.announce(prefix, &[]).unwrap();
    }
    // The raw peer answers our connection to 10.77.0.3.
    let runtime = std::sync::Arc::new(NetnsRuntime::new(&tor).unwrap());
    let accept = thread::spawn({
        let runtime = runtime.clone();
        move || runtime.run(async { raw_bgp::Peer::accept("10.77.0.3:179", 65003, [10, 77, 0, 3]).await })
    });
    let agent = node.start_agent(
        "10.77.0.1",
        &[("10.77.0.2", 65002), ("fd77::2", 65002), ("10.77.0.3", 65003)],
        &["--bgp-accept-default=true"],
    );
    let raw = accept.join().unwrap();
    let send = |bytes: Vec<u8>| {
        let writer = raw.sender();
        runtime.run(async move {
            use tokio::io::AsyncWriteExt;
            writer.lock().await.write_all(&bytes).await.unwrap()
        });
    };
    let raw_attrs = attributes(65003, [10, 77, 0, 3]);
    send(announce(&raw_attrs, &["10.201.0.0/24"]));
    // IPv6 multicast NLRI (nobody negotiated it) next to a usable prefix and a multicast range.
    let fd77_3: std::net::Ipv6Addr = "fd77::3".parse().unwrap();
    let mut mixed = raw_attrs.clone();
    mixed.extend(mp_reach(2, 2, &fd77_3.octets(), &["2001:db8::/32"]));
    send(announce(&mixed, &["10.202.0.0/24", "224.0.0.0/4"]));
    send(announce(&attributes(65003, [127, 0, 0, 1]), &["10.203.0.0/24"]));

    let expected = sorted_lines(
        "10.100.0.0/24 via 10.77.0.2 dev to-tor\n\
         10.201.0.0/24 via 10.77.0.3 dev to-tor\n\
         10.202.0.0/24 via 10.77.0.3 dev to-tor\n\
         default via fd77::2 dev to-tor metric 1024 pref medium\n\
         fd00:100::/64 via fd77::2 dev to-tor metric 1024 pref medium",
    );
    wait_until("exactly the usable routes in the kernel", Duration::from_secs(60), || {
        Ok(sorted_lines(&node.our_routes()) == expected)
    })
    .unwrap_or_else(|e| panic!("{e}\nours:\n{}\nagent:\n{}", node.our_routes(), node.bgp()));
    wait_until("the refusals counted", Duration::from_secs(10), || {
        let s = node.scrape();
        Ok(s.contains("reason=\"martian_prefix\"")
            && s.contains("reason=\"node_local\"")
            && s.contains("reason=\"martian_next_hop\"")
            && metric(&s, "kube_router_bgp_route_conflicts ") == 1.0)
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", node.scrape()));
    assert_eq!(node.node_routes(), before, "the node's own routes changed");
    let scrape = node.scrape();
    assert!(metric(&scrape, "kube_router_bgp_ignored_nlri_total") >= 2.0, "{scrape}");
    assert!(!raw.kinds().contains(&NOTIFICATION), "an unrepresentable NLRI must not reset the session");
    let uptime = node.uptime("10.77.0.3").expect("the raw peer's session is up");
    // Every line about a refused prefix is logged once per peer and reason.
    assert_eq!(agent.log_count("routes refused by the import policy"), 4, "{:?}", agent.log.lock().unwrap());

    // The ToR withdraws its defaults: ours goes, the node's stays.
    gobgp.withdraw("0.0.0.0/0").unwrap();
    gobgp.withdraw("::/0").unwrap();
    wait_until("the learned default route removed", Duration::from_secs(20), || {
        Ok(!node.our_routes().contains("default"))
    })
    .unwrap();
    assert_eq!(node.node_routes(), before, "withdrawing a default removed the node's own");
    wait_until("the conflict ended", Duration::from_secs(10), || {
        Ok(metric(&node.scrape(), "kube_router_bgp_route_conflicts ") == 0.0)
    })
    .unwrap();

    // Again, then stop the agent (routes stay) and uninstall: exactly ours go, the default too.
    gobgp.announce("::/0", &[]).unwrap();
    wait_until("the learned IPv6 default back", Duration::from_secs(20), || {
        Ok(node.our_routes().contains("default via fd77::2"))
    })
    .unwrap();
    assert!(node.uptime("10.77.0.3").unwrap_or(0) >= uptime, "the raw peer's session was reset");
    assert_eq!(gobgp.flops("10.77.0.1"), Some(0), "the ToR's session was reset");
    assert_eq!(node.node_routes(), before);
    let status = bgp_status(&node.ns, METRICS_PORT).unwrap();
    let states: Vec<(&str, &str)> = status["neighbors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| (n["address"].as_str().unwrap_or(""), n["state"].as_str().unwrap_or("")))
        .collect();
    assert_eq!(
        states,
        [("10.77.0.2", "Established"), ("10.77.0.3", "Established"), ("fd77::2", "Established")],
        "{status:#}"
    );
    agent.stop().unwrap();
    assert!(node.our_routes().contains("default via fd77::2"), "a stopped agent leaves its routes");
    let out = node
        .ns
        .run(&[
            kube_router_bin().to_str().unwrap(),
            "--bpf-root",
            BPF_ROOT,
            "--state-dir",
            node.dir.join("state").to_str().unwrap(),
            "cleanup",
        ])
        .unwrap();
    assert!(out.contains("removed 5 kernel routes"), "{out}");
    assert_eq!(node.our_routes(), "");
    assert_eq!(node.node_routes(), before, "cleanup touched a route that is not ours");
    drop(raw);
}

#[test]
fn two_external_peers_never_see_each_others_routes() {
    let node = Node::new("krt-fab2-node", "/tmp/krt-fab2");
    let a = Netns::new("krt-fab2-a").unwrap();
    let b = Netns::new("krt-fab2-b").unwrap();
    veth(&node.ns, "to-a", "10.77.0.1/24", &a, "eth0", "10.77.0.2/24").unwrap();
    veth(&node.ns, "to-b", "10.78.0.1/24", &b, "eth0", "10.78.0.2/24").unwrap();
    let v4 = |address| [Neighbor { address, asn: 65001, family: "ipv4-unicast" }];
    let tor_a = GoBgpd::start(&a, &node.dir, (65002, "10.77.0.2"), &["10.77.0.2"], &v4("10.77.0.1")).unwrap();
    let tor_b = GoBgpd::start(&b, &node.dir, (65003, "10.78.0.2"), &["10.78.0.2"], &v4("10.78.0.1")).unwrap();
    tor_a.announce("10.100.0.0/24", &[]).unwrap();
    tor_b.announce("10.110.0.0/24", &[]).unwrap();
    let _agent = node.start_agent("10.77.0.1", &[("10.77.0.2", 65002), ("10.78.0.2", 65003)], &[]);

    wait_until("both routers' prefixes in our kernel", Duration::from_secs(60), || {
        let ours = node.our_routes();
        Ok(ours.contains("10.100.0.0/24 via 10.77.0.2") && ours.contains("10.110.0.0/24 via 10.78.0.2"))
    })
    .unwrap_or_else(|e| panic!("{e}\n{}\n{}", node.our_routes(), node.bgp()));
    for (tor, own, other) in [(&tor_a, "10.100.0.0/24", "10.110.0.0/24"), (&tor_b, "10.110.0.0/24", "10.100.0.0/24")] {
        wait_until("our pod CIDR at the router", Duration::from_secs(30), || Ok(tor.rib()?.contains(POD_V4))).unwrap();
        let rib = tor.rib().unwrap();
        assert!(rib.contains(own) && !rib.contains(other), "a router got the other's route (transit):\n{rib}");
    }
    // What we advertise to each: only the pod CIDR (IPv4 sessions), in our own Adj-RIB-Out too.
    for peer in ["10.77.0.2", "10.78.0.2"] {
        let sent = |bgp: &str| -> Option<u64> {
            bgp.lines().find(|l| l.starts_with(peer)).and_then(|l| l.split_whitespace().nth(6)?.parse().ok())
        };
        // /bgp is refreshed every second: wait for it to show the session.
        wait_until("the agent's report", Duration::from_secs(10), || Ok(sent(&node.bgp()).is_some())).unwrap();
        assert_eq!(sent(&node.bgp()), Some(1), "{}", node.bgp());
    }
}

/// BFD with BIRD's BFD on a black-holed link: the BGP session (hold time 90 s) goes down
/// within a second and the peer's routes leave the kernel.
#[test]
fn bfd_takes_a_black_holed_session_down_within_a_second() {
    let node = Node::new("krt-bfd-node", "/tmp/krt-bfd");
    let peer = Netns::new("krt-bfd-peer").unwrap();
    veth(&node.ns, "to-peer", "10.77.0.1/24", &peer, "eth0", "10.77.0.2/24").unwrap();
    let conf = node.dir.join("bird.conf");
    std::fs::write(
        &conf,
        "router id 10.77.0.2;\nprotocol device { }\nprotocol static { ipv4; route 10.100.0.0/24 blackhole; }\n\
         protocol bfd { interface \"*\" { min rx interval 100 ms; min tx interval 100 ms; multiplier 3; }; }\n\
         protocol bgp node { local as 65002; neighbor 10.77.0.1 as 65001; hold time 90; connect retry time 1;\n  \
         bfd on; ipv4 { import all; export where source = RTS_STATIC; }; }\n",
    )
    .unwrap();
    let log = std::fs::File::create(node.dir.join("bird.log")).unwrap();
    let mut bird = std::process::Command::new("nsenter")
        .arg(format!("--net={}", peer.path()))
        .args(["bird", "-f", "-c", conf.to_str().unwrap(), "-s", node.dir.join("bird.ctl").to_str().unwrap()])
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let _agent = node.start_agent(
        "10.77.0.1",
        &[("10.77.0.2", 65002)],
        &[
            "--bgp-holdtime=90s",
            "--enable-bfd=true",
            "--bfd-desired-min-tx-interval=100",
            "--bfd-required-min-rx-interval=100",
            "--bfd-detection-multiplier=3",
        ],
    );
    let series = |name: &str| format!("{name}{{peer=\"10.77.0.2\"");
    wait_until("the session up with BFD and the peer's route installed", Duration::from_secs(60), || {
        let s = node.scrape();
        Ok(s.contains(&series("kube_router_bgp_bfd_up"))
            && metric(&s, &series("kube_router_bgp_bfd_up")) == 1.0
            && node.our_routes().contains("10.100.0.0/24 via 10.77.0.2"))
    })
    .unwrap_or_else(|e| panic!("{e}\n{}\n{}", node.scrape(), node.bgp()));
    // Every packet between the two is dropped from now on; TCP alone would notice in 90 s.
    for chain in ["INPUT", "OUTPUT"] {
        peer.run(&["iptables", "-I", chain, "-j", "DROP"]).unwrap();
    }
    let cut = std::time::Instant::now();
    wait_until("the BGP session down", Duration::from_secs(10), || {
        Ok(metric(&node.scrape(), &series("kube_router_bgp_session_established")) == 0.0)
    })
    .unwrap();
    let detected = cut.elapsed();
    eprintln!("BFD brought the session down {detected:?} after the link was black-holed");
    assert!(detected < Duration::from_secs(1), "BFD took {detected:?} to bring the session down");
    wait_until("the peer's route withdrawn", Duration::from_secs(5), || {
        Ok(!node.our_routes().contains("10.100.0.0/24"))
    })
    .unwrap();
    let _ = bird.kill();
    let _ = bird.wait();
}

/// A peer sends 10,000 prefixes whose next hop the node cannot reach (a third-party next hop
/// off every connected subnet). None of them reaches the kernel (RFC 4271 §9.1.2: they do not
/// compete), the session stays up, they are counted per peer, and from the first UPDATE to
/// [`QUIET_FOR`] later the agent logs a handful of lines (the condition once), not one per route.
#[test]
fn ten_thousand_routes_with_an_unreachable_next_hop_cost_a_handful_of_log_lines() {
    const PREFIXES: usize = 10_000;
    // Two of the route reconciler's periodic 30 s passes and seven 9 s hold times: whatever
    // runs on a timer and could repeat the condition or drop the session has run.
    const QUIET_FOR: Duration = Duration::from_secs(65);
    let node = Node::new("krt-fab3-node", "/tmp/krt-fab3");
    let peer = Netns::new("krt-fab3-peer").unwrap();
    veth(&node.ns, "to-peer", "10.77.0.1/24", &peer, "eth0", "10.77.0.3/24").unwrap();
    let runtime = std::sync::Arc::new(NetnsRuntime::new(&peer).unwrap());
    let accept = thread::spawn({
        let runtime = runtime.clone();
        move || runtime.run(async { raw_bgp::Peer::accept("10.77.0.3:179", 65003, [10, 77, 0, 3]).await })
    });
    let agent = node.start_agent("10.77.0.1", &[("10.77.0.3", 65003)], &[]);
    let raw = accept.join().unwrap();
    wait_until("the session up", Duration::from_secs(30), || Ok(node.uptime("10.77.0.3").is_some())).unwrap();
    let lines_before = agent.log.lock().unwrap().len();
    let prefixes: Vec<String> = (0..PREFIXES).map(|i| format!("10.{}.{}.0/24", 128 + i / 256, i % 256)).collect();
    let attrs = attributes(65003, [10, 99, 0, 1]);
    for chunk in prefixes.chunks(900) {
        let refs: Vec<&str> = chunk.iter().map(String::as_str).collect();
        let bytes = announce(&attrs, &refs);
        let writer = raw.sender();
        runtime.run(async move {
            use tokio::io::AsyncWriteExt;
            writer.lock().await.write_all(&bytes).await.unwrap()
        });
    }
    wait_until("every prefix received and counted as unresolved", Duration::from_secs(60), || {
        let s = node.scrape();
        Ok(s.contains(&format!("kube_router_bgp_prefixes_received{{peer=\"10.77.0.3\"}} {PREFIXES}"))
            && s.contains(&format!("kube_router_bgp_prefixes_unresolved{{peer=\"10.77.0.3\"}} {PREFIXES}")))
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", node.scrape()));
    let started = std::time::Instant::now();
    while started.elapsed() < QUIET_FOR {
        thread::sleep(Duration::from_secs(5));
        assert_eq!(node.our_routes(), "", "a route over an unreachable next hop was installed");
    }
    let lines: Vec<String> = agent.log.lock().unwrap()[lines_before..].to_vec();
    println!("{PREFIXES} unusable routes, received and then {QUIET_FOR:?}: {} log lines", lines.len());
    assert!(lines.len() < 10, "{} log lines in {QUIET_FOR:?}:\n{}", lines.len(), lines.join("\n"));
    assert_eq!(agent.log_count("next hop this node cannot reach"), 1, "said once: {lines:?}");
    assert!(node.uptime("10.77.0.3").is_some_and(|up| up >= QUIET_FOR.as_secs()), "{}", node.bgp());
    assert!(!raw.kinds().contains(&NOTIFICATION), "the session was reset");
}

/// Two routers of one AS announce the same prefix with equal attributes: one kernel multipath
/// route over both (ECMP), which the kernel's own lookups spread over both; when one router
/// withdraws, a single-path route over the other.
#[test]
fn equal_paths_from_two_routers_become_one_multipath_route() {
    let node = Node::new("krt-fab4-node", "/tmp/krt-fab4");
    let a = Netns::new("krt-fab4-a").unwrap();
    let b = Netns::new("krt-fab4-b").unwrap();
    veth(&node.ns, "to-a", "10.77.0.1/24", &a, "eth0", "10.77.0.2/24").unwrap();
    veth(&node.ns, "to-b", "10.78.0.1/24", &b, "eth0", "10.78.0.2/24").unwrap();
    let v4 = |address| [Neighbor { address, asn: 65001, family: "ipv4-unicast" }];
    let tor_a = GoBgpd::start(&a, &node.dir, (65002, "10.77.0.2"), &["10.77.0.2"], &v4("10.77.0.1")).unwrap();
    let tor_b = GoBgpd::start(&b, &node.dir, (65002, "10.78.0.2"), &["10.78.0.2"], &v4("10.78.0.1")).unwrap();
    tor_a.announce("10.100.0.0/24", &[]).unwrap();
    tor_b.announce("10.100.0.0/24", &[]).unwrap();
    let _agent = node.start_agent("10.77.0.1", &[("10.77.0.2", 65002), ("10.78.0.2", 65002)], &[]);
    wait_until("one multipath route over both routers", Duration::from_secs(60), || {
        let ours = node.our_routes();
        Ok(ours.contains("10.100.0.0/24")
            && ours.contains("via 10.77.0.2 dev to-a")
            && ours.contains("via 10.78.0.2 dev to-b"))
    })
    .unwrap_or_else(|e| panic!("{e}\n{}\n{}", node.our_routes(), node.bgp()));
    let gateways: std::collections::BTreeSet<String> = (1..=64)
        .map(|host| {
            let route = node.ns.run(&["ip", "route", "get", &format!("10.100.0.{host}")]).unwrap();
            route.split_whitespace().skip_while(|w| *w != "via").nth(1).unwrap_or_default().to_string()
        })
        .collect();
    assert_eq!(gateways, ["10.77.0.2", "10.78.0.2"].map(String::from).into(), "the kernel spreads over both paths");

    tor_a.withdraw("10.100.0.0/24").unwrap();
    wait_until("a single path over the other router", Duration::from_secs(30), || {
        Ok(node.our_routes().contains("10.100.0.0/24 via 10.78.0.2 dev to-b"))
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", node.our_routes()));
}
