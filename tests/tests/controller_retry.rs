//! A controller that fails retries by itself, with backoff and without any new input, and the
//! retries show in its metrics: here the routing controller, whose BGP speaker cannot start
//! while another process holds the port (flag mode: no API server, nothing ever changes).
//! As root, in a network namespace.
use std::{
    path::PathBuf,
    process::{Command, Stdio},
    time::Duration,
};

use kube_router_tests::{metric, netprobe_bin, wait_until, Agent, Netns};

const METRICS_PORT: u16 = 20271;

#[test]
fn a_failing_controller_retries_with_backoff_without_new_input_and_recovers() {
    let ns = Netns::new("krt-ctl-retry").unwrap();
    ns.run(&["ip", "link", "set", "lo", "up"]).unwrap();
    ns.run(&["ip", "link", "add", "eth0", "type", "veth", "peer", "name", "eth1"]).unwrap();
    ns.run(&["ip", "addr", "add", "10.98.0.1/24", "dev", "eth0"]).unwrap();
    ns.run(&["ip", "link", "set", "eth0", "up"]).unwrap();
    let mut holder = Command::new("nsenter")
        .arg(format!("--net={}", ns.path()))
        .args([netprobe_bin().to_str().unwrap(), "serve", "holder", "179"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let listening = |who: &str| ns.run(&["ss", "-Hltnp", "sport = :179"]).unwrap_or_default().contains(who);
    wait_until("the holder listens", Duration::from_secs(5), || Ok(listening("krt-netprobe"))).unwrap();

    let dir = std::env::temp_dir().join("krt-ctl-retry");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let services = dir.join("no-services.yaml");
    std::fs::write(&services, "").unwrap();
    let state = dir.join("state");
    let port = METRICS_PORT.to_string();
    let args = [
        "--run-service-proxy=false",
        "--run-firewall=false",
        "--service-file",
        services.to_str().unwrap(),
        "--state-dir",
        state.to_str().unwrap(),
        "--router-id",
        "10.98.0.1",
        "--cluster-asn",
        "64512",
        "--pod-cidrs",
        "10.244.9.0/24",
        "--health-port",
        "0",
        "--metrics-port",
        &port,
    ];
    let agent = Agent::start(&ns, &PathBuf::from("/sys/fs/bpf/krt-ctl-retry-unused"), &args).unwrap();
    let routing = |series: &str| -> Option<f64> {
        let scrape = ns.scrape_metrics(METRICS_PORT).ok()?;
        scrape.contains(series).then(|| metric(&scrape, series))
    };
    let failures = "kube_router_controller_consecutive_failures{controller=\"routing\"}";
    let errors = "kube_router_controller_reconciles_total{controller=\"routing\",outcome=\"error\"}";
    // Attempts at start and after 1 s and 2 s: three failures with nothing changing meanwhile.
    wait_until("three failed starts", Duration::from_secs(15), || Ok(routing(failures).is_some_and(|n| n >= 3.0)))
        .unwrap();
    assert!(!listening("kube-router"), "the speaker listens although the port is held");
    assert!(routing(errors).unwrap() >= 3.0);
    assert_eq!(agent.log_count("cannot start the BGP speaker"), 1, "one line for one unchanged reason");

    holder.kill().unwrap();
    holder.wait().unwrap();
    // The next attempt (at most 30 s later) starts the speaker; the failures are cleared.
    wait_until("the speaker listening on 179", Duration::from_secs(40), || Ok(listening("kube-router"))).unwrap();
    wait_until("the failures cleared", Duration::from_secs(5), || Ok(routing(failures) == Some(0.0))).unwrap();
    drop(agent);
    let _ = std::fs::remove_dir_all(&dir);
}
