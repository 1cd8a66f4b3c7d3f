//! BGP interop with real peers (GoBGP, BIRD 2, FRR), each in its own network namespace, and
//! graceful restart across agent crashes and restarts. Run as root.
//!
//! Topology per test: `<p>-node` runs kube-router (BGP only) and is wired by veth to
//! `<p>-peer`, which runs the peer daemon. IPv4 10.77.0.1 <-> 10.77.0.2, IPv6 fd77::1 <-> fd77::2.
use std::{
    fs,
    path::PathBuf,
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::Result;
use kube_router_tests::{bgp_neighbor, bgp_status, metric, remove_bpf_root, veth, wait_until, Agent, Netns};

const NODE_V4: &str = "10.77.0.1";
const PEER_V4: &str = "10.77.0.2";
const NODE_V6: &str = "fd77::1";
const PEER_V6: &str = "fd77::2";
const NODE_ASN: &str = "65001";
const PEER_ASN: &str = "65002";
const POD_CIDR_V4: &str = "10.244.1.0/24";
const POD_CIDR_V6: &str = "fd00:244:1::/64";
/// The agents' metrics listener (/metrics, /bgp).
const METRICS_PORT: &str = "20260";

struct Lab {
    node: Netns,
    peer: Netns,
    dir: PathBuf,
    daemon: Option<Child>,
}

impl Lab {
    fn new(prefix: &str) -> Self {
        let node = Netns::new(&format!("{prefix}-node")).unwrap();
        let peer = Netns::new(&format!("{prefix}-peer")).unwrap();
        veth(&node, "to-peer", &format!("{NODE_V4}/24"), &peer, "eth0", &format!("{PEER_V4}/24")).unwrap();
        node.run(&["ip", "-6", "addr", "add", &format!("{NODE_V6}/64"), "dev", "to-peer", "nodad"]).unwrap();
        peer.run(&["ip", "-6", "addr", "add", &format!("{PEER_V6}/64"), "dev", "eth0", "nodad"]).unwrap();
        let dir = PathBuf::from(format!("/tmp/{prefix}"));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        Self { node, peer, dir, daemon: None }
    }

    fn state_dir(&self) -> String {
        self.dir.join("state").to_string_lossy().into_owned()
    }

    fn agent_args(&self, extra: &[&str]) -> Vec<String> {
        let empty = self.dir.join("no-services.yaml");
        fs::write(&empty, "").unwrap();
        let mut args: Vec<String> = [
            "--run-service-proxy=false",
            "--service-file",
            empty.to_str().unwrap(),
            "--state-dir",
            &self.state_dir(),
            "--router-id",
            NODE_V4,
            "--cluster-asn",
            NODE_ASN,
            "--pod-cidrs",
            &format!("{POD_CIDR_V4},{POD_CIDR_V6}"),
            "--peer-router-ips",
            &format!("{PEER_V4},{PEER_V6}"),
            "--peer-router-asns",
            &format!("{PEER_ASN},{PEER_ASN}"),
            "--metrics-port",
            METRICS_PORT,
            "--bgp-holdtime",
            "9s",
            "--bgp-graceful-restart-time",
            "60s",
            "--bgp-graceful-restart-deferral-time",
            "30s",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    }

    fn start_agent(&self, extra: &[&str]) -> Agent {
        let args = self.agent_args(extra);
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        Agent::start(&self.node, &PathBuf::from("/sys/fs/bpf/krt-bgp-unused"), &refs).unwrap()
    }

    fn spawn_daemon(&mut self, args: &[&str]) {
        let log = fs::File::create(self.dir.join("daemon.log")).unwrap();
        let child = Command::new("nsenter")
            .arg(format!("--net={}", self.peer.path()))
            .args(args)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        self.daemon = Some(child);
    }

    fn daemon_log(&self) -> String {
        fs::read_to_string(self.dir.join("daemon.log")).unwrap_or_default()
    }

    /// Our routes (protocol 186) in the node's kernel, both families.
    fn kernel_routes(&self) -> String {
        let v4 = self.node.run(&["ip", "route", "show", "proto", "186"]).unwrap();
        let v6 = self.node.run(&["ip", "-6", "route", "show", "proto", "186"]).unwrap();
        format!("{v4}{v6}")
    }

    fn agent_bgp(&self) -> String {
        self.node
            .run(&[kube_router_tests::kube_router_bin().to_str().unwrap(), "--metrics-port", METRICS_PORT, "bgp"])
            .unwrap_or_default()
    }

    /// The agent's BGP status (`kube-router bgp -o json`).
    fn agent_status(&self) -> Result<serde_json::Value> {
        bgp_status(&self.node, METRICS_PORT)
    }

    fn scrape(&self) -> String {
        self.node.scrape_metrics(METRICS_PORT).unwrap()
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        if let Some(mut child) = self.daemon.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        remove_bpf_root(&PathBuf::from("/sys/fs/bpf/krt-bgp-unused"));
    }
}

/// How each peer daemon is started, fed prefixes and asked for its RIB.
trait PeerDaemon {
    fn start(&self, lab: &mut Lab);
    /// The peer's RIB as its own CLI prints it (both families).
    fn rib(&self, lab: &Lab) -> Result<String>;
    fn established(&self, lab: &Lab) -> Result<bool>;
    /// Stops announcing 10.101.0.0/24.
    fn withdraw_second_prefix(&self, lab: &Lab);
}

/// GoBGP, optionally requiring a TCP MD5 password on both sessions.
struct GoBgp {
    password: Option<&'static str>,
}

const GOBGP: GoBgp = GoBgp { password: None };

impl GoBgp {
    fn cli(lab: &Lab, args: &[&str]) -> Result<String> {
        let mut full = vec!["gobgp"];
        full.extend_from_slice(args);
        lab.peer.run(&full)
    }
}

impl PeerDaemon for GoBgp {
    fn start(&self, lab: &mut Lab) {
        let auth = self.password.map(|p| format!("\n    auth-password = \"{p}\"")).unwrap_or_default();
        let neighbor = |addr: &str, family: &str| {
            format!(
                r#"
[[neighbors]]
  [neighbors.config]
    neighbor-address = "{addr}"
    peer-as = {NODE_ASN}{auth}
  [neighbors.timers.config]
    connect-retry = 1
    hold-time = 9
    keepalive-interval = 3
  [neighbors.graceful-restart.config]
    enabled = true
    restart-time = 60
  [[neighbors.afi-safis]]
    [neighbors.afi-safis.config]
      afi-safi-name = "{family}"
    [neighbors.afi-safis.mp-graceful-restart.config]
      enabled = true
"#
            )
        };
        let config = format!(
            "[global.config]\n  as = {PEER_ASN}\n  router-id = \"{PEER_V4}\"\n  local-address-list = [\"{PEER_V4}\", \"{PEER_V6}\"]\n{}{}",
            neighbor(NODE_V4, "ipv4-unicast"),
            neighbor(NODE_V6, "ipv6-unicast")
        );
        let path = lab.dir.join("gobgpd.toml");
        fs::write(&path, config).unwrap();
        lab.spawn_daemon(&["gobgpd", "-f", path.to_str().unwrap(), "--disable-stdlog", "-l", "info"]);
        wait_until("gobgpd's API", Duration::from_secs(20), || Ok(GoBgp::cli(lab, &["global"]).is_ok())).unwrap();
        for (prefix, family) in [("10.100.0.0/24", "ipv4"), ("10.101.0.0/24", "ipv4"), ("fd00:100::/64", "ipv6")] {
            GoBgp::cli(lab, &["global", "rib", "add", prefix, "-a", family]).unwrap();
        }
    }

    fn rib(&self, lab: &Lab) -> Result<String> {
        Ok(format!(
            "{}{}",
            GoBgp::cli(lab, &["global", "rib", "-a", "ipv4"])?,
            GoBgp::cli(lab, &["global", "rib", "-a", "ipv6"])?
        ))
    }

    fn established(&self, lab: &Lab) -> Result<bool> {
        let out = GoBgp::cli(lab, &["neighbor"])?;
        Ok(out.lines().filter(|l| l.contains("Establ")).count() == 2)
    }

    fn withdraw_second_prefix(&self, lab: &Lab) {
        GoBgp::cli(lab, &["global", "rib", "del", "10.101.0.0/24", "-a", "ipv4"]).unwrap();
    }
}

struct Bird;

impl Bird {
    fn socket(lab: &Lab) -> String {
        lab.dir.join("bird.ctl").to_string_lossy().into_owned()
    }
    fn cli(lab: &Lab, command: &str) -> Result<String> {
        lab.peer.run(&["birdc", "-s", &Bird::socket(lab), command])
    }
}

impl PeerDaemon for Bird {
    fn start(&self, lab: &mut Lab) {
        let config = format!(
            r#"
router id {PEER_V4};
protocol device {{ }}
protocol static s4 {{ ipv4; route 10.100.0.0/24 blackhole; }}
protocol static s4b {{ ipv4; route 10.101.0.0/24 blackhole; }}
protocol static s6 {{ ipv6; route fd00:100::/64 blackhole; }}
template bgp kr {{
  local as {PEER_ASN};
  hold time 9;
  connect retry time 1;
  graceful restart on;
  graceful restart time 60;
}}
protocol bgp node4 from kr {{
  neighbor {NODE_V4} as {NODE_ASN};
  ipv4 {{ import all; export where source = RTS_STATIC; }};
}}
protocol bgp node6 from kr {{
  neighbor {NODE_V6} as {NODE_ASN};
  ipv6 {{ import all; export where source = RTS_STATIC; }};
}}
"#
        );
        let path = lab.dir.join("bird.conf");
        fs::write(&path, config).unwrap();
        let socket = Bird::socket(lab);
        lab.spawn_daemon(&["bird", "-f", "-c", path.to_str().unwrap(), "-s", &socket]);
        wait_until("bird's control socket", Duration::from_secs(20), || Ok(Bird::cli(lab, "show status").is_ok()))
            .unwrap();
    }

    fn rib(&self, lab: &Lab) -> Result<String> {
        Bird::cli(lab, "show route")
    }

    fn established(&self, lab: &Lab) -> Result<bool> {
        let out = Bird::cli(lab, "show protocols")?;
        Ok(out.lines().filter(|l| l.contains("node") && l.contains("Established")).count() == 2)
    }

    fn withdraw_second_prefix(&self, lab: &Lab) {
        Bird::cli(lab, "disable s4b").unwrap();
    }
}

struct Frr;

impl Frr {
    fn vty_dir(lab: &Lab) -> String {
        lab.dir.join("frr").to_string_lossy().into_owned()
    }
    fn cli(lab: &Lab, command: &str) -> Result<String> {
        lab.peer.run(&["vtysh", "--vty_socket", &Frr::vty_dir(lab), "-d", "bgpd", "-c", command])
    }
}

impl PeerDaemon for Frr {
    fn start(&self, lab: &mut Lab) {
        let config = format!(
            r#"
hostname frr-peer
router bgp {PEER_ASN}
 bgp router-id {PEER_V4}
 no bgp ebgp-requires-policy
 no bgp network import-check
 bgp graceful-restart
 bgp graceful-restart restart-time 60
 timers bgp 3 9
 neighbor {NODE_V4} remote-as {NODE_ASN}
 neighbor {NODE_V4} timers connect 1
 neighbor {NODE_V6} remote-as {NODE_ASN}
 neighbor {NODE_V6} timers connect 1
 address-family ipv4 unicast
  network 10.100.0.0/24
  network 10.101.0.0/24
  no neighbor {NODE_V6} activate
 exit-address-family
 address-family ipv6 unicast
  network fd00:100::/64
  neighbor {NODE_V6} activate
 exit-address-family
"#
        );
        let path = lab.dir.join("bgpd.conf");
        fs::write(&path, config).unwrap();
        let vty = Frr::vty_dir(lab);
        fs::create_dir_all(&vty).unwrap();
        let pid = lab.dir.join("bgpd.pid");
        lab.spawn_daemon(&[
            "/usr/lib/frr/bgpd",
            "-f",
            path.to_str().unwrap(),
            "-Z",
            "-S",
            "--vty_socket",
            &vty,
            "-i",
            pid.to_str().unwrap(),
            "-A",
            "127.0.0.1",
            "-P",
            "0",
        ]);
        wait_until("FRR bgpd's vty", Duration::from_secs(20), || Ok(Frr::cli(lab, "show bgp summary").is_ok()))
            .unwrap();
    }

    fn rib(&self, lab: &Lab) -> Result<String> {
        Ok(format!("{}{}", Frr::cli(lab, "show bgp ipv4 unicast")?, Frr::cli(lab, "show bgp ipv6 unicast")?))
    }

    fn established(&self, lab: &Lab) -> Result<bool> {
        let v4 = Frr::cli(lab, &format!("show bgp neighbors {NODE_V4}"))?;
        let v6 = Frr::cli(lab, &format!("show bgp neighbors {NODE_V6}"))?;
        Ok(v4.contains("BGP state = Established") && v6.contains("BGP state = Established"))
    }

    fn withdraw_second_prefix(&self, lab: &Lab) {
        lab.peer
            .run(&[
                "vtysh",
                "--vty_socket",
                &Frr::vty_dir(lab),
                "-d",
                "bgpd",
                "-c",
                "configure terminal",
                "-c",
                &format!("router bgp {PEER_ASN}"),
                "-c",
                "address-family ipv4 unicast",
                "-c",
                "no network 10.101.0.0/24",
            ])
            .unwrap();
    }
}

/// Both sessions up, our pod CIDRs in the peer's RIB (its own CLI), its prefixes in our
/// kernel table with protocol 186, both families.
fn assert_routes_exchanged(lab: &Lab, daemon: &dyn PeerDaemon) {
    wait_until("both sessions Established", Duration::from_secs(60), || daemon.established(lab))
        .unwrap_or_else(|e| panic!("{e}\nagent:\n{}\ndaemon log:\n{}", lab.agent_bgp(), lab.daemon_log()));
    wait_until("our pod CIDRs in the peer's RIB", Duration::from_secs(30), || {
        let rib = daemon.rib(lab)?;
        Ok(rib.contains(POD_CIDR_V4) && rib.contains("fd00:244:1::/64"))
    })
    .unwrap_or_else(|e| panic!("{e}\npeer RIB:\n{}", daemon.rib(lab).unwrap_or_default()));
    wait_until("the peer's prefixes in our kernel table", Duration::from_secs(30), || {
        let routes = lab.kernel_routes();
        Ok(routes.contains(&format!("10.100.0.0/24 via {PEER_V4}"))
            && routes.contains(&format!("10.101.0.0/24 via {PEER_V4}"))
            && routes.contains(&format!("fd00:100::/64 via {PEER_V6}")))
    })
    .unwrap_or_else(|e| panic!("{e}\nkernel:\n{}\nagent:\n{}", lab.kernel_routes(), lab.agent_bgp()));
    wait_until("the agent to report both sessions", Duration::from_secs(10), || {
        let bgp = lab.agent_bgp();
        let up = |peer: &str| bgp.lines().any(|l| l.starts_with(peer) && l.contains("Established"));
        Ok(up(PEER_V4) && up(PEER_V6))
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", lab.agent_bgp()));
}

fn interop(prefix: &str, daemon: &dyn PeerDaemon) {
    let mut lab = Lab::new(prefix);
    daemon.start(&mut lab);
    let agent = lab.start_agent(&[]);
    // The speaker's own status (not its log text): running, with both peers configured.
    wait_until("the speaker to list both peers", Duration::from_secs(30), || {
        let bgp = lab.agent_bgp();
        Ok([PEER_V4, PEER_V6].iter().all(|peer| bgp.lines().any(|l| l.starts_with(peer))))
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", lab.agent_bgp()));
    assert_routes_exchanged(&lab, daemon);
    // Only our protocol's routes are ours: the connected routes are untouched.
    assert!(lab.node.run(&["ip", "route", "show", "proto", "kernel"]).unwrap().contains("10.77.0.0/24"));
    agent.stop().unwrap();
}

#[test]
fn gobgp_session_exchanges_ipv4_and_ipv6_routes() {
    interop("krt-bgp-gobgp", &GOBGP);
}

#[test]
fn bird_session_exchanges_ipv4_and_ipv6_routes() {
    interop("krt-bgp-bird", &Bird);
}

#[test]
fn frr_session_exchanges_ipv4_and_ipv6_routes() {
    interop("krt-bgp-frr", &Frr);
}

/// kill -9 the agent: the peer keeps our routes (stale, graceful restart helper) and never
/// withdraws them, our kernel routes stay and traffic to the peer's prefix keeps flowing. A
/// prefix withdrawn while we are away disappears from the kernel only after the restarted
/// agent has the peer's End-of-RIB; the others never leave the kernel.
fn graceful_restart_across_an_agent_crash(prefix: &str, daemon: &dyn PeerDaemon) {
    let mut lab = Lab::new(prefix);
    // An address inside the peer's prefix: pinging it uses the BGP-learned route.
    lab.peer.run(&["ip", "addr", "add", "10.100.0.1/32", "dev", "lo"]).unwrap();
    daemon.start(&mut lab);
    let agent = lab.start_agent(&[]);
    assert_routes_exchanged(&lab, daemon);
    let ping = || lab.node.run(&["ping", "-c1", "-W1", "-q", "10.100.0.1"]).is_ok();
    assert!(ping(), "traffic over the learned route");

    agent.kill();
    let down = Instant::now();
    while down.elapsed() < Duration::from_secs(3) {
        let rib = daemon.rib(&lab).unwrap();
        assert!(rib.contains(POD_CIDR_V4), "the peer dropped our route while we were away:\n{rib}");
        assert!(ping(), "traffic stopped while the agent was down");
    }
    let routes = lab.kernel_routes();
    assert!(routes.contains("10.100.0.0/24") && routes.contains("10.101.0.0/24"), "{routes}");

    daemon.withdraw_second_prefix(&lab);
    let _agent = lab.start_agent(&[]);
    wait_until("the agent to report a graceful restart", Duration::from_secs(30), || {
        Ok(lab.agent_status()?["restarted"] == true)
    })
    .unwrap_or_else(|e| panic!("{e}\n{:?}", lab.agent_status()));
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(40) {
        let routes = lab.kernel_routes();
        assert!(routes.contains("10.100.0.0/24"), "a route still announced left the kernel:\n{routes}");
        let rib = daemon.rib(&lab).unwrap();
        assert!(rib.contains(POD_CIDR_V4), "the peer withdrew our route during the restart:\n{rib}");
        if !routes.contains("10.101.0.0/24") {
            // The speaker publishes its status before it lets the kernel routes go: read after
            // the removal, it must say the picture was complete.
            let status = lab.agent_status().unwrap();
            assert_eq!(status["routing_complete"], true, "a route removed before End-of-RIB: {status:#}");
            break;
        }
        thread::sleep(Duration::from_millis(100));
    }
    assert!(!lab.kernel_routes().contains("10.101.0.0/24"), "withdrawn route never removed");
    wait_until("the initial routing picture complete", Duration::from_secs(30), || {
        Ok(lab.agent_status()?["routing_complete"] == true)
    })
    .unwrap();
    // The restarted agent wrote nothing but that one deletion: every other route stayed as the
    // kernel kept it.
    wait_until("the withdrawn route's deletion counted", Duration::from_secs(5), || {
        Ok(metric(&lab.scrape(), "kube_router_host_routes_removed ") == 1.0)
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", lab.scrape()));
    assert_eq!(metric(&lab.scrape(), "kube_router_host_routes_added "), 0.0, "kernel routes rewritten");
    assert!(daemon.rib(&lab).unwrap().contains(POD_CIDR_V4));
    assert!(lab.kernel_routes().contains("fd00:100::/64"));
    assert!(ping());
}

#[test]
fn graceful_restart_across_an_agent_crash_with_gobgp() {
    graceful_restart_across_an_agent_crash("krt-bgp-gr", &GOBGP);
}

#[test]
fn graceful_restart_across_an_agent_crash_with_bird() {
    graceful_restart_across_an_agent_crash("krt-bgp-grb", &Bird);
}

#[test]
fn graceful_restart_across_an_agent_crash_with_frr() {
    graceful_restart_across_an_agent_crash("krt-bgp-grf", &Frr);
}

/// The other role: GoBGP is killed and restarted with its restart flag; we keep its routes
/// (stale) in the RIB and the kernel meanwhile, and the refreshed routes replace them without
/// a withdrawal.
#[test]
fn we_keep_a_restarting_peers_routes_as_stale_until_it_refreshes_them() {
    let mut lab = Lab::new("krt-bgp-help");
    lab.peer.run(&["ip", "addr", "add", "10.100.0.1/32", "dev", "lo"]).unwrap();
    GOBGP.start(&mut lab);
    let agent = lab.start_agent(&[]);
    assert_routes_exchanged(&lab, &GOBGP);
    let stale = |lab: &Lab| -> Result<u64> {
        let status = lab.agent_status()?;
        Ok(bgp_neighbor(&status, PEER_V4)["prefixes_stale"].as_u64().unwrap_or(0))
    };

    let mut gobgpd = lab.daemon.take().unwrap();
    let _ = gobgpd.kill();
    let _ = gobgpd.wait();
    // The helper role: the session is gone, its two IPv4 routes kept, marked stale.
    wait_until("the agent to mark GoBGP's routes stale", Duration::from_secs(15), || Ok(stale(&lab)? == 2))
        .unwrap_or_else(|e| panic!("{e}\n{}", lab.agent_bgp()));
    let status = lab.agent_status().unwrap();
    let gobgp = bgp_neighbor(&status, PEER_V4);
    assert_ne!(gobgp["state"], "Established", "{status:#}");
    assert_eq!(gobgp["prefixes_received"], 2, "{status:#}");
    let routes = lab.kernel_routes();
    assert!(routes.contains("10.100.0.0/24") && routes.contains("10.101.0.0/24"), "{routes}");
    assert!(lab.node.run(&["ping", "-c1", "-W1", "-q", "10.100.0.1"]).is_ok(), "traffic while the peer is away");

    // Back, as a restarting speaker (R-bit), announcing the same prefixes again.
    let config = lab.dir.join("gobgpd.toml");
    lab.spawn_daemon(&["gobgpd", "-f", config.to_str().unwrap(), "--disable-stdlog", "-l", "info", "-r"]);
    wait_until("gobgpd's API", Duration::from_secs(20), || Ok(GoBgp::cli(&lab, &["global"]).is_ok())).unwrap();
    for (prefix, family) in [("10.100.0.0/24", "ipv4"), ("10.101.0.0/24", "ipv4"), ("fd00:100::/64", "ipv6")] {
        GoBgp::cli(&lab, &["global", "rib", "add", prefix, "-a", family]).unwrap();
    }
    let started = Instant::now();
    loop {
        let routes = lab.kernel_routes();
        assert!(routes.contains("10.100.0.0/24") && routes.contains("10.101.0.0/24"), "route withdrawn: {routes}");
        let bgp = lab.agent_bgp();
        if stale(&lab).unwrap() == 0 && bgp.lines().any(|l| l.starts_with(PEER_V4) && l.contains("Established")) {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(60), "stale routes never refreshed:\n{bgp}");
        thread::sleep(Duration::from_millis(200));
    }
    agent.stop().unwrap();
}

/// SIGTERM with graceful restart sends no Cease: GoBGP keeps our routes as stale. Without
/// graceful restart, SIGTERM sends a Cease and GoBGP withdraws them at once.
#[test]
fn sigterm_keeps_peer_routes_only_with_graceful_restart() {
    let mut lab = Lab::new("krt-bgp-term");
    GOBGP.start(&mut lab);
    let agent = lab.start_agent(&[]);
    assert_routes_exchanged(&lab, &GOBGP);
    agent.stop().unwrap();
    thread::sleep(Duration::from_secs(2));
    assert!(GOBGP.rib(&lab).unwrap().contains(POD_CIDR_V4), "graceful stop must leave our routes with the peer");
    assert!(lab.kernel_routes().contains("10.100.0.0/24"), "graceful stop must leave kernel routes");

    let agent = lab.start_agent(&["--bgp-graceful-restart=false"]);
    assert_routes_exchanged(&lab, &GOBGP);
    agent.stop().unwrap();
    wait_until("GoBGP to withdraw our routes after the Cease", Duration::from_secs(10), || {
        Ok(!GOBGP.rib(&lab)?.contains(POD_CIDR_V4))
    })
    .unwrap();
    assert!(lab.kernel_routes().contains("10.100.0.0/24"), "kernel routes stay even then");

    // Uninstall removes what a stop leaves: pinned objects, our routes (only ours), the marker.
    let out = lab
        .node
        .run(&[
            kube_router_tests::kube_router_bin().to_str().unwrap(),
            "--bpf-root",
            "/sys/fs/bpf/krt-bgp-unused",
            "--state-dir",
            &lab.state_dir(),
            "cleanup",
        ])
        .unwrap();
    assert!(out.contains("kernel routes with protocol 186"), "{out}");
    assert_eq!(lab.kernel_routes(), "", "cleanup leaves no route of ours");
    assert!(lab.node.run(&["ip", "route", "show", "proto", "kernel"]).unwrap().contains("10.77.0.0/24"));
    assert!(!kube_router_tests::maps_dir(std::path::Path::new("/sys/fs/bpf/krt-bgp-unused"))
        .join("pol_stats")
        .exists());
}

/// Bad input from one peer never disturbs another: a malformed attribute is treated as a
/// withdrawal (RFC 7606) with the session kept, a broken message resets only that session
/// with a NOTIFICATION, and a NOTIFICATION received is logged and counted.
#[test]
fn a_misbehaving_peer_is_isolated_and_reported() {
    use kube_router_tests::raw_bgp::*;
    let mut lab = Lab::new("krt-bgp-bad");
    lab.peer.run(&["ip", "addr", "add", "10.77.0.3/24", "dev", "eth0"]).unwrap();
    GOBGP.start(&mut lab);
    let runtime = kube_router_tests::NetnsRuntime::new(&lab.peer).unwrap();
    let mut args = lab.agent_args(&[]);
    for (flag, value) in
        [("--peer-router-ips", "10.77.0.2,fd77::2,10.77.0.3"), ("--peer-router-asns", "65002,65002,65003")]
    {
        let at = args.iter().position(|a| a == flag).unwrap();
        args[at + 1] = value.to_string();
    }
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let accept = std::thread::spawn({
        let runtime = std::sync::Arc::new(runtime);
        let r = runtime.clone();
        move || (r.run(async { Peer::accept("10.77.0.3:179", 65003, [10, 77, 0, 3]).await }), runtime)
    });
    let agent = Agent::start(&lab.node, &PathBuf::from("/sys/fs/bpf/krt-bgp-unused"), &refs).unwrap();
    let (peer, runtime) = accept.join().unwrap();
    assert_routes_exchanged(&lab, &GOBGP);
    let send = |bytes: Vec<u8>| {
        let writer = peer.sender();
        runtime.run(async move { writer.lock().await.write_all(&bytes).await.unwrap() });
    };
    use tokio::io::AsyncWriteExt;
    let scrape = || lab.scrape();
    let raw_peer = |field: &str| -> Result<u64> {
        let status = lab.agent_status()?;
        Ok(bgp_neighbor(&status, "10.77.0.3")[field].as_u64().unwrap_or(0))
    };

    // A good UPDATE first: the raw peer really is a peer.
    send(update(65003, [10, 77, 0, 3], [10, 200, 0], 0));
    wait_until("the raw peer's route in the kernel", Duration::from_secs(10), || {
        Ok(lab.kernel_routes().contains("10.200.0.0/24 via 10.77.0.3"))
    })
    .unwrap();
    let gobgp_uptime = || {
        let bgp = lab.agent_bgp();
        bgp.lines().find(|l| l.starts_with(PEER_V4)).and_then(|l| l.split_whitespace().nth(3)?.parse::<u64>().ok())
    };
    let uptime_before = gobgp_uptime().unwrap();

    // ORIGIN 5 does not exist: treat-as-withdraw, the session stays.
    send(update(65003, [10, 77, 0, 3], [10, 200, 0], 5));
    wait_until("the malformed announcement treated as a withdrawal", Duration::from_secs(10), || {
        Ok(!lab.kernel_routes().contains("10.200.0.0/24"))
    })
    .unwrap();
    wait_until("the UPDATE counted as treated as withdrawn", Duration::from_secs(5), || {
        Ok(raw_peer("updates_treated_as_withdraw")? == 1)
    })
    .unwrap_or_else(|e| panic!("{e}\n{:?}", lab.agent_status()));
    assert!(!peer.kinds().contains(&NOTIFICATION), "treat-as-withdraw must not reset the session");
    wait_until("the malformed message counted", Duration::from_secs(5), || {
        Ok(metric(&scrape(), "kube_router_bgp_malformed_messages_total") == 1.0)
    })
    .unwrap();

    // An UPDATE cut short after the withdrawn-routes length: NOTIFICATION, this session only
    // goes down.
    send(update(65003, [10, 77, 0, 3], [10, 201, 0], 0));
    wait_until("the raw peer's second route", Duration::from_secs(10), || {
        Ok(lab.kernel_routes().contains("10.201.0.0/24"))
    })
    .unwrap();
    send(message(UPDATE, &[0, 0]));
    wait_until("a NOTIFICATION to the broken peer", Duration::from_secs(10), || {
        Ok(peer.kinds().contains(&NOTIFICATION))
    })
    .unwrap();
    let notification = peer.received.lock().unwrap().iter().find(|(k, _)| *k == NOTIFICATION).unwrap().1.clone();
    // RFC 4271 §6.3: an UPDATE whose lengths do not add up is a Malformed Attribute List.
    assert_eq!(&notification[..2], &[3, 1], "UPDATE message error / malformed attribute list");
    wait_until("the broken peer's routes gone", Duration::from_secs(10), || {
        Ok(!lab.kernel_routes().contains("10.201.0.0/24"))
    })
    .unwrap();
    wait_until("the agent to report the NOTIFICATION it sent", Duration::from_secs(5), || {
        Ok(raw_peer("notifications_sent")? >= 1)
    })
    .unwrap_or_else(|e| panic!("{e}\n{:?}", lab.agent_status()));

    // The good peer never noticed.
    let routes = lab.kernel_routes();
    assert!(routes.contains("10.100.0.0/24") && routes.contains("fd00:100::/64"), "{routes}");
    assert!(gobgp_uptime().unwrap() >= uptime_before, "the GoBGP session must not have flapped");
    wait_until("the NOTIFICATION counted", Duration::from_secs(5), || {
        Ok(metric(&scrape(), "kube_router_bgp_notifications_sent_total{peer=\"10.77.0.3\"}") >= 1.0)
    })
    .unwrap();
    let scrape = scrape();
    assert_eq!(metric(&scrape, &format!("kube_router_bgp_session_established{{peer=\"{PEER_V4}\"")), 1.0);
    assert!(metric(&scrape, "kube_router_bgp_malformed_messages_total") >= 2.0);
    assert!(metric(&scrape, "kube_router_bgp_notifications_sent_total{peer=\"10.77.0.3\"}") >= 1.0);
    assert_eq!(metric(&scrape, "kube_router_bgp_updates_treated_as_withdraw_total{peer=\"10.77.0.3\"}"), 1.0);
    assert_eq!(
        metric(&scrape, &format!("kube_router_bgp_updates_treated_as_withdraw_total{{peer=\"{PEER_V4}\"}}")),
        0.0
    );
    drop(peer);
    agent.stop().unwrap();
}

/// TCP MD5 (RFC 2385): with the right password the sessions come up; with a wrong one the
/// kernel drops every segment, so nothing is ever established.
#[test]
fn tcp_md5_passwords_protect_the_sessions() {
    let daemon = GoBgp { password: Some("s3cret-Pa55") };
    let mut lab = Lab::new("krt-bgp-md5");
    daemon.start(&mut lab);
    // base64("s3cret-Pa55"), as kube-router's --peer-router-passwords takes it.
    let good = "czNjcmV0LVBhNTU=";
    let agent = lab.start_agent(&["--peer-router-passwords", &format!("{good},{good}")]);
    assert_routes_exchanged(&lab, &daemon);
    agent.kill();

    let _ = GoBgp::cli(&lab, &["neighbor", NODE_V4, "reset"]);
    let wrong = "d3Jvbmc="; // "wrong"
    let agent =
        lab.start_agent(&["--peer-router-passwords", &format!("{wrong},{wrong}"), "--bgp-graceful-restart=false"]);
    thread::sleep(Duration::from_secs(8));
    let neighbors = GoBgp::cli(&lab, &["neighbor"]).unwrap();
    assert!(!neighbors.contains("Establ"), "a wrong MD5 password must not establish:\n{neighbors}");
    assert!(lab.agent_bgp().lines().all(|l| !l.contains("Established")), "{}", lab.agent_bgp());
    agent.kill();
}
