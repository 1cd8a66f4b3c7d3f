//! Benchmark (root): a BIRD peer announces 100,000 prefixes; how long until the receiver has
//! them all, and at what memory. Receivers, measured in the same run one after the other:
//! GoBGP (`gobgpd`, the baseline: RIB only, it installs nothing in the kernel) and the agent
//! (RIB, and separately the time until all 100,000 routes are in the kernel table). Then the
//! agent restarts gracefully (SIGTERM, start again with the routes still in the kernel) and
//! its memory is measured again once the restart is complete (End-of-RIB, nothing changed).
//!
//! Topology: `krt-bgpb-src` (BIRD, 10.79.0.1) --veth-- `krt-bgpb-rx` (10.79.0.2), where the
//! receiver under test runs.
use std::{
    fs,
    path::PathBuf,
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use kube_router_tests::*;

const PREFIXES: usize = 100_000;
const SRC: &str = "10.79.0.1";
const RX: &str = "10.79.0.2";

fn prefix(i: usize) -> String {
    format!("{}.{}.{}.0/24", 30 + (i >> 16), (i >> 8) & 0xff, i & 0xff)
}

fn spawn_in(ns: &Netns, args: &[&str], log: &PathBuf) -> Child {
    let file = fs::File::create(log).unwrap();
    Command::new("nsenter")
        .arg(format!("--net={}", ns.path()))
        .args(args)
        .stdout(file.try_clone().unwrap())
        .stderr(file)
        .stdin(Stdio::null())
        .spawn()
        .unwrap()
}

fn rss_kib(pid: u32) -> u64 {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0)
}

fn peak_rss_kib(pid: u32) -> u64 {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0)
}

fn wait(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) -> Duration {
    let started = Instant::now();
    while !done() {
        assert!(started.elapsed() < timeout, "{what} not done within {timeout:?}");
        thread::sleep(Duration::from_millis(100));
    }
    started.elapsed()
}

fn main() {
    let dir = PathBuf::from("/tmp/krt-bgpb");
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    let src = Netns::new("krt-bgpb-src").unwrap();
    let rx = Netns::new("krt-bgpb-rx").unwrap();
    veth(&src, "eth0", &format!("{SRC}/24"), &rx, "eth0", &format!("{RX}/24")).unwrap();

    let statics: String = (0..PREFIXES).map(|i| format!("  route {} blackhole;\n", prefix(i))).collect();
    let bird_conf = format!(
        "router id {SRC};\nprotocol device {{ }}\nprotocol static bench_routes {{ ipv4;\n{statics}}}\n\
         protocol bgp to_receiver {{ local as 65010; neighbor {RX} as 65020; connect retry time 1;\n  \
         ipv4 {{ import none; export where source = RTS_STATIC; }}; }}\n"
    );
    fs::write(dir.join("bird.conf"), bird_conf).unwrap();
    let socket = dir.join("bird.ctl");
    let mut bird = spawn_in(
        &src,
        &["bird", "-f", "-c", dir.join("bird.conf").to_str().unwrap(), "-s", socket.to_str().unwrap()],
        &dir.join("bird.log"),
    );
    wait("BIRD to load its routes", Duration::from_secs(60), || {
        src.run(&["birdc", "-s", socket.to_str().unwrap(), "show", "route", "count"])
            .is_ok_and(|out| out.contains(&format!("{PREFIXES} of {PREFIXES} routes")))
    });

    // Baseline: gobgpd as the receiver.
    let gobgp_conf = format!(
        "[global.config]\n  as = 65020\n  router-id = \"{RX}\"\n[[neighbors]]\n  [neighbors.config]\n    \
         neighbor-address = \"{SRC}\"\n    peer-as = 65010\n  [neighbors.timers.config]\n    connect-retry = 1\n"
    );
    fs::write(dir.join("gobgpd.toml"), gobgp_conf).unwrap();
    let started = Instant::now();
    let mut gobgpd = spawn_in(
        &rx,
        &["gobgpd", "-f", dir.join("gobgpd.toml").to_str().unwrap(), "--disable-stdlog"],
        &dir.join("gobgpd.log"),
    );
    let received = |out: &str| -> usize {
        // `gobgp neighbor` columns: Peer AS Up/Down State |#Received Accepted
        out.lines()
            .find(|l| l.trim_start().starts_with(SRC))
            .and_then(|l| l.split_whitespace().nth(5)?.parse().ok())
            .unwrap_or(0)
    };
    wait("gobgpd to receive every prefix", Duration::from_secs(300), || {
        rx.run(&["gobgp", "neighbor"]).is_ok_and(|out| received(&out) >= PREFIXES)
    });
    let gobgp_time = started.elapsed();
    let gobgp_rss = rss_kib(gobgpd.id());
    let _ = gobgpd.kill();
    let _ = gobgpd.wait();
    // BIRD retries the session after the receiver is gone.
    thread::sleep(Duration::from_secs(2));

    // The agent as the receiver (BGP only), timed from process start like gobgpd.
    let state = dir.join("state");
    let bin = std::env::var("KUBE_ROUTER_BIN").map(PathBuf::from).unwrap_or_else(|_| kube_router_bin());
    let empty = dir.join("empty.yaml");
    fs::write(&empty, "").unwrap();
    let start_agent = |log: &str| {
        Command::new("nsenter")
            .arg(format!("--net={}", rx.path()))
            .arg(&bin)
            .args(["--run-service-proxy=false", "--service-file", empty.to_str().unwrap()])
            .args(["--state-dir", state.to_str().unwrap(), "--router-id", RX, "--cluster-asn", "65020"])
            .args(["--peer-router-ips", SRC, "--peer-router-asns", "65010", "--metrics-port", "20270"])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(fs::File::create(dir.join(log)).unwrap())
            .spawn()
            .unwrap()
    };
    let started = Instant::now();
    let mut agent = start_agent("agent.log");
    let agent_received = || -> usize {
        rx.run(&[bin.to_str().unwrap(), "--metrics-port", "20270", "bgp"])
            .ok()
            .and_then(|out| {
                out.lines().find(|l| l.starts_with(SRC)).and_then(|l| l.split_whitespace().nth(4)?.parse().ok())
            })
            .unwrap_or(0)
    };
    wait("the agent to receive every prefix", Duration::from_secs(300), || agent_received() >= PREFIXES);
    let agent_rib_time = started.elapsed();
    let agent_rss_rib = rss_kib(agent.id());
    let kernel_routes =
        || -> usize { rx.run(&["ip", "route", "show", "proto", "186"]).map(|out| out.lines().count()).unwrap_or(0) };
    wait("the agent to install every route", Duration::from_secs(300), || kernel_routes() >= PREFIXES);
    let agent_fib_time = started.elapsed();
    let agent_rss = rss_kib(agent.id());
    // Graceful restart: SIGTERM (no Cease, routes stay in the kernel), then the same agent again.
    let _ = Command::new("kill").args(["-TERM", &agent.id().to_string()]).status();
    let _ = agent.wait();
    let restart = Instant::now();
    let mut agent = start_agent("agent-restart.log");
    let restarted = || {
        rx.run(&[bin.to_str().unwrap(), "--metrics-port", "20270", "bgp"])
            .is_ok_and(|out| !out.contains("waiting for peers' End-of-RIB") && out.contains("Established"))
    };
    wait("the restarted agent to complete its graceful restart", Duration::from_secs(300), || {
        agent_received() >= PREFIXES && restarted() && kernel_routes() == PREFIXES
    });
    let restart_time = restart.elapsed();
    let restart_rss = rss_kib(agent.id());
    let restart_peak = peak_rss_kib(agent.id());
    let _ = agent.kill();
    let _ = agent.wait();
    // Our routes outlive the agent by design; remove them so the namespace goes quickly.
    let _ = rx.run(&["ip", "route", "flush", "proto", "186"]);
    let _ = bird.kill();
    let _ = bird.wait();

    println!("BGP convergence, {PREFIXES} IPv4 prefixes from BIRD (one session):");
    println!("  gobgpd (baseline) all received:      {:>8.2} s   RSS {:>7} KiB", gobgp_time.as_secs_f64(), gobgp_rss);
    println!(
        "  kube-router all in Loc-RIB:          {:>8.2} s   RSS {:>7} KiB   ({:.2}x time, {:.2}x memory of gobgpd)",
        agent_rib_time.as_secs_f64(),
        agent_rss_rib,
        agent_rib_time.as_secs_f64() / gobgp_time.as_secs_f64(),
        agent_rss_rib as f64 / gobgp_rss.max(1) as f64
    );
    println!(
        "  kube-router all in the kernel table: {:>8.2} s   RSS {:>7} KiB   (gobgpd installs nothing; no baseline)",
        agent_fib_time.as_secs_f64(),
        agent_rss
    );
    println!(
        "  kube-router graceful restart done:   {:>8.2} s   RSS {:>7} KiB   (peak {} KiB; {:.2}x the first run's RSS)",
        restart_time.as_secs_f64(),
        restart_rss,
        restart_peak,
        restart_rss as f64 / agent_rss.max(1) as f64
    );
}
