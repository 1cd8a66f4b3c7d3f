//! Attacks on the BGP speaker by a hostile or broken peer, each against real gobgpd peers in
//! their own network namespaces (run as root). One test per attack and the guard it checks.
//!
//! Topology: `<p>-node` runs kube-router (BGP only); `<p>-a` (10.77.0.2, AS 65002) and `<p>-b`
//! (10.78.0.2, AS 65003) each run a gobgpd wired to it by a veth (node side 10.77.0.1 and
//! 10.78.0.1).
use std::{
    fs,
    path::PathBuf,
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::Result;
use kube_router_tests::{metric, remove_bpf_root, veth, wait_until, Agent, Netns};

const NODE_ASN: &str = "65001";
const METRICS_PORT: &str = "20261";
const BPF_ROOT: &str = "/sys/fs/bpf/krt-hb-unused";

/// One gobgpd peer: its namespace, addresses and daemon.
struct GoBgpPeer {
    ns: Netns,
    address: &'static str,
    node_address: &'static str,
    asn: u32,
    daemon: Option<Child>,
}

impl GoBgpPeer {
    /// `neighbor_extra`: TOML appended to the neighbor (ttl-security, ebgp-multihop ...).
    fn start(&mut self, dir: &std::path::Path, neighbor_extra: &str) {
        let config = format!(
            r#"[global.config]
  as = {asn}
  router-id = "{address}"
  local-address-list = ["{address}"]
[[neighbors]]
  [neighbors.config]
    neighbor-address = "{node}"
    peer-as = {NODE_ASN}
  [neighbors.timers.config]
    connect-retry = 1
    hold-time = 9
    keepalive-interval = 3
  [[neighbors.afi-safis]]
    [neighbors.afi-safis.config]
      afi-safi-name = "ipv4-unicast"
{neighbor_extra}
"#,
            asn = self.asn,
            address = self.address,
            node = self.node_address,
        );
        let path = dir.join(format!("gobgpd-{}.toml", self.address));
        fs::write(&path, config).unwrap();
        let log = fs::File::create(dir.join(format!("gobgpd-{}.log", self.address))).unwrap();
        let child = Command::new("nsenter")
            .arg(format!("--net={}", self.ns.path()))
            .args(["gobgpd", "-f", path.to_str().unwrap(), "--disable-stdlog", "-l", "info"])
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        self.daemon = Some(child);
        wait_until("gobgpd's API", Duration::from_secs(20), || Ok(self.cli(&["global"]).is_ok())).unwrap();
    }

    fn cli(&self, args: &[&str]) -> Result<String> {
        let mut full = vec!["gobgp"];
        full.extend_from_slice(args);
        self.ns.run(&full)
    }

    /// Announces 10.<second>.<i>.0/24 for each i in `range`.
    fn announce(&self, second: u8, range: std::ops::Range<u8>) {
        for i in range {
            self.cli(&["global", "rib", "add", &format!("10.{second}.{i}.0/24"), "-a", "ipv4"]).unwrap();
        }
    }

    /// gobgpd's own view of the session with the node.
    fn neighbor(&self) -> String {
        self.cli(&["neighbor", self.node_address]).unwrap_or_default()
    }

    fn established(&self) -> bool {
        self.neighbor().to_lowercase().contains("bgp state = established")
    }

    /// NOTIFICATIONs gobgpd received from the node ("Notification: sent rcvd").
    fn notifications_received(&self) -> u64 {
        self.neighbor()
            .lines()
            .find(|l| l.trim_start().starts_with("Notification"))
            .and_then(|l| l.split_whitespace().last()?.parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for GoBgpPeer {
    fn drop(&mut self) {
        if let Some(mut child) = self.daemon.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

struct Lab {
    node: Netns,
    a: GoBgpPeer,
    b: GoBgpPeer,
    dir: PathBuf,
}

impl Lab {
    fn new(prefix: &str) -> Self {
        let node = Netns::new(&format!("{prefix}-node")).unwrap();
        let a = Netns::new(&format!("{prefix}-a")).unwrap();
        let b = Netns::new(&format!("{prefix}-b")).unwrap();
        veth(&node, "to-a", "10.77.0.1/24", &a, "eth0", "10.77.0.2/24").unwrap();
        veth(&node, "to-b", "10.78.0.1/24", &b, "eth0", "10.78.0.2/24").unwrap();
        let dir = PathBuf::from(format!("/tmp/{prefix}"));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let peer = |ns, address, node_address, asn| GoBgpPeer { ns, address, node_address, asn, daemon: None };
        Self { node, a: peer(a, "10.77.0.2", "10.77.0.1", 65002), b: peer(b, "10.78.0.2", "10.78.0.1", 65003), dir }
    }

    fn start_agent(&self, extra: &[&str]) -> Agent {
        let empty = self.dir.join("no-services.yaml");
        fs::write(&empty, "").unwrap();
        let state = self.dir.join("state");
        let mut args = vec![
            "--run-service-proxy=false",
            "--service-file",
            empty.to_str().unwrap(),
            "--state-dir",
            state.to_str().unwrap(),
            "--router-id",
            "10.77.0.1",
            "--cluster-asn",
            NODE_ASN,
            "--pod-cidrs",
            "10.244.1.0/24",
            "--peer-router-ips",
            "10.77.0.2,10.78.0.2",
            "--peer-router-asns",
            "65002,65003",
            "--metrics-port",
            METRICS_PORT,
            "--bgp-holdtime",
            "9s",
            "--bgp-graceful-restart-deferral-time",
            "5s",
        ];
        args.extend_from_slice(extra);
        Agent::start(&self.node, &PathBuf::from(BPF_ROOT), &args).unwrap()
    }

    /// Our routes (protocol 186) in the node's kernel.
    fn kernel_routes(&self) -> String {
        self.node.run(&["ip", "route", "show", "proto", "186"]).unwrap()
    }

    fn scrape(&self) -> String {
        self.node.scrape_metrics(METRICS_PORT).unwrap_or_default()
    }

    /// The value of a metric series, 0 when it is not (yet) exported.
    fn metric(&self, series: &str) -> f64 {
        let scrape = self.scrape();
        if scrape.lines().any(|l| l.starts_with(series)) {
            metric(&scrape, series)
        } else {
            0.0
        }
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        remove_bpf_root(&PathBuf::from(BPF_ROOT));
    }
}

/// Bytes the node sends on a fresh TCP connection from peer A's address to its BGP port
/// within 3 s, until it closes: a session in progress starts with our OPEN; a refused
/// connection is closed at once with nothing sent.
fn bytes_on_a_new_connection(lab: &Lab) -> usize {
    use tokio::io::AsyncReadExt;
    let runtime = kube_router_tests::NetnsRuntime::new(&lab.a.ns).unwrap();
    runtime.run(async {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("10.77.0.2:0".parse().unwrap()).unwrap();
        let Ok(mut stream) = socket.connect("10.77.0.1:179".parse().unwrap()).await else { return 0 };
        let mut got = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(3), stream.read_to_end(&mut got)).await;
        got.len()
    })
}

/// Routes of `10.<second>.x.0/24` in a `kernel_routes` listing.
fn count_routes(routes: &str, second: u8) -> usize {
    routes.lines().filter(|l| l.starts_with(&format!("10.{second}."))).count()
}

/// Guard: the per-peer prefix limit (`--bgp-max-prefixes`, RFC 4486). Peer A announces 15
/// prefixes under a limit of 20, then 10 more: the UPDATE that would take it past 20 is not
/// applied, A gets Cease 1, every route of A leaves the kernel (no graceful-restart retention),
/// A stays down for the idle hold although gobgpd retries every second, the metric counts one
/// violation, and peer B's session and routes are untouched throughout.
#[test]
fn a_peer_over_its_prefix_limit_is_ceased_and_held_down() {
    let mut lab = Lab::new("krt-hb-mp");
    let dir = lab.dir.clone();
    lab.a.start(&dir, "");
    lab.b.start(&dir, "");
    lab.a.announce(200, 0..15);
    lab.b.announce(210, 0..3);
    let agent = lab.start_agent(&["--bgp-max-prefixes", "20"]);
    wait_until("both peers' routes in the kernel", Duration::from_secs(30), || {
        let routes = lab.kernel_routes();
        Ok(count_routes(&routes, 200) == 15 && count_routes(&routes, 210) == 3)
    })
    .unwrap();
    assert_eq!(lab.a.notifications_received(), 0);

    lab.a.announce(200, 15..25);
    wait_until("the Cease at peer A", Duration::from_secs(20), || Ok(lab.a.notifications_received() >= 1)).unwrap();
    wait_until("peer A's routes gone from the kernel", Duration::from_secs(10), || {
        Ok(count_routes(&lab.kernel_routes(), 200) == 0)
    })
    .unwrap();
    // The idle hold (30 s at the first violation): a connection from A's address is closed
    // without an OPEN (gobgpd itself waits 30 s after a NOTIFICATION; FRR or BIRD need not),
    // and A's session stays down; had it come back, its 25 prefixes would trip the limit again.
    assert_eq!(bytes_on_a_new_connection(&lab), 0, "a connection from peer A was taken during the idle hold");
    let held_since = Instant::now();
    while held_since.elapsed() < Duration::from_secs(8) {
        assert!(!lab.a.established(), "peer A re-established during the idle hold");
        assert_eq!(count_routes(&lab.kernel_routes(), 200), 0, "peer A's routes came back");
        thread::sleep(Duration::from_millis(500));
    }
    assert_eq!(lab.metric("kube_router_bgp_max_prefixes_exceeded_total{peer=\"10.77.0.2\"}"), 1.0);
    assert_eq!(lab.metric("kube_router_bgp_max_prefixes_exceeded_total{peer=\"10.78.0.2\"}"), 0.0);
    assert_eq!(lab.metric("kube_router_bgp_prefixes_received{peer=\"10.77.0.2\"}"), 0.0);
    // Peer B never noticed.
    assert!(lab.b.established(), "peer B's session went down:\n{}", lab.b.neighbor());
    assert_eq!(lab.b.notifications_received(), 0);
    assert_eq!(lab.metric("kube_router_bgp_notifications_sent_total{peer=\"10.78.0.2\"}"), 0.0);
    assert_eq!(count_routes(&lab.kernel_routes(), 210), 3);
    agent.stop().unwrap();
}

/// Guard: GTSM (`--peer-router-ttl-security`, RFC 5082). Peer A runs gobgpd with
/// ttl-security (it only accepts TTL 255, so our packets must be sent with 255): the session
/// comes up and routes flow. Peer B is "one hop further": its packets arrive with TTL 254
/// (gobgpd ebgp-multihop 254), and the session never establishes.
#[test]
fn ttl_security_admits_the_adjacent_peer_only() {
    let mut lab = Lab::new("krt-hb-ttl");
    let dir = lab.dir.clone();
    lab.a.start(&dir, "  [neighbors.ttl-security.config]\n    enabled = true\n    ttl-min = 255\n");
    lab.b.start(&dir, "  [neighbors.ebgp-multihop.config]\n    enabled = true\n    multihop-ttl = 254\n");
    lab.a.announce(200, 0..2);
    lab.b.announce(210, 0..2);
    let agent = lab.start_agent(&["--peer-router-ttl-security=true"]);
    wait_until("peer A's routes in the kernel", Duration::from_secs(30), || {
        Ok(count_routes(&lab.kernel_routes(), 200) == 2)
    })
    .unwrap();
    assert!(lab.a.established());
    // Both sides retry every second or so: 10 s is many attempts by both.
    let since = Instant::now();
    while since.elapsed() < Duration::from_secs(10) {
        assert!(!lab.b.established(), "the TTL-254 peer established:\n{}", lab.b.neighbor());
        thread::sleep(Duration::from_millis(500));
    }
    assert_eq!(count_routes(&lab.kernel_routes(), 210), 0);
    assert_eq!(lab.metric("kube_router_bgp_session_established{peer=\"10.78.0.2\""), 0.0);
    assert_eq!(lab.metric("kube_router_bgp_session_established{peer=\"10.77.0.2\""), 1.0);
    agent.stop().unwrap();
}
