//! A BGP speaker that cannot start is tried again with backoff until it can, also in flag mode
//! (no API server, no Node change to wake it), and the failure is logged once, not per attempt.
//! As root, in a network namespace.
use std::{
    path::PathBuf,
    process::{Command, Stdio},
    thread,
    time::Duration,
};

use kube_router_tests::{netprobe_bin, wait_until, Agent, Netns};

#[test]
fn a_speaker_whose_port_is_taken_starts_once_the_port_is_free() {
    let ns = Netns::new("krt-bsr").unwrap();
    ns.run(&["ip", "link", "add", "eth0", "type", "veth", "peer", "name", "eth1"]).unwrap();
    ns.run(&["ip", "addr", "add", "10.97.0.1/24", "dev", "eth0"]).unwrap();
    ns.run(&["ip", "link", "set", "eth0", "up"]).unwrap();
    // Another process holds the BGP port (an old agent still exiting, say).
    let mut holder = Command::new("nsenter")
        .arg(format!("--net={}", ns.path()))
        .args([netprobe_bin().to_str().unwrap(), "serve", "holder", "179"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let listening = |who: &str| ns.run(&["ss", "-Hltnp", "sport = :179"]).unwrap_or_default().contains(who);
    wait_until("the holder listens", Duration::from_secs(5), || Ok(listening("krt-netprobe"))).unwrap();

    let dir = std::env::temp_dir().join("krt-bsr");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let services = dir.join("no-services.yaml");
    std::fs::write(&services, "").unwrap();
    let state = dir.join("state");
    let args = [
        "--run-service-proxy=false",
        "--run-firewall=false",
        "--service-file",
        services.to_str().unwrap(),
        "--state-dir",
        state.to_str().unwrap(),
        "--router-id",
        "10.97.0.1",
        "--cluster-asn",
        "64512",
        "--pod-cidrs",
        "10.244.7.0/24",
        "--health-port",
        "0",
    ];
    let agent = Agent::start(&ns, &PathBuf::from("/sys/fs/bpf/krt-bsr-unused"), &args).unwrap();
    // Attempts at about 1, 2 and 4 s fail while the port is held...
    thread::sleep(Duration::from_secs(5));
    assert!(!listening("kube-router"), "the speaker listens although the port is held");
    assert_eq!(agent.log_count("cannot start the BGP speaker"), 1, "one line for one unchanged reason");
    // ...and once it is free, the next attempt (backoff at most 8 s by now) starts the speaker.
    holder.kill().unwrap();
    holder.wait().unwrap();
    wait_until("the speaker listening on 179", Duration::from_secs(20), || Ok(listening("kube-router"))).unwrap();
    drop(agent);
    let _ = std::fs::remove_dir_all(&dir);
}
