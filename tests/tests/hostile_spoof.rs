//! Hostile pods forging their source address (CAP_NET_RAW is in the default container capability
//! set): source-address verification on pod veths (docs/security/spoof.md). Each test is one
//! attack through real veths of the CNI-wired cluster harness, with its expected outcome. As root,
//! in network namespaces `krt-hs*`.
use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use kube_router_tests::{
    cluster::{ingress_policy, netprobe, wait_denied, Cluster, ClusterNode, Pod},
    wait_until,
};

/// Ports nothing serves: the sniffers count what arrives whatever the sockets say.
const GENUINE_PORT: u16 = 7001;
const SPOOFED_PORT: u16 = 7002;
const PACKETS: usize = 20;

fn spoofed_drops(node: &ClusterNode, family: &str) -> f64 {
    node.metric("kube_router_pod_source_check_packets_total", &format!("event=\"spoofed_{family}\""))
}

/// Sources of the packets `pod` receives on `port` (raw sockets, before any socket lookup).
fn sniff(pod: &Pod, proto: &str, port: u16) -> Arc<Mutex<Vec<String>>> {
    let bin = kube_router_tests::netprobe_bin();
    pod.ns.spawn_collecting(&[bin.to_str().unwrap(), "sniff", proto, &port.to_string()]).unwrap()
}

/// `PACKETS` forged packets from `pod`, with source `src`.
fn send(pod: &Pod, proto: &str, src: &str, dst: &str, port: u16) {
    let out = netprobe(&pod.ns, &["spoof", proto, src, dst, &port.to_string(), &PACKETS.to_string()]);
    assert_eq!(out, format!("OK {PACKETS}"), "the raw sender");
}

fn received(lines: &Arc<Mutex<Vec<String>>>) -> Vec<String> {
    lines.lock().unwrap().clone()
}

/// A pod forges the address of the one peer an isolated pod admits, and a random one, over TCP
/// and UDP: nothing reaches the isolated pod and the drops are counted, while the same raw
/// packets from the attacker's own address, and the admitted peer's genuine ones, arrive.
/// Checks the IPv4 source check in the first program at the attacker veth's TC ingress; the
/// control at the end (the check off, `--enable-pod-source-check=false`) shows the policy alone
/// would have let the forged packets in.
#[test]
fn a_pod_forging_an_admitted_peer_never_reaches_the_isolated_pod() {
    let c = Cluster::builder("krt-hs-v4").nodes(1).pods_per_node(3).build().unwrap();
    let (target, peer, attacker) = (c.pod(0, 0), c.pod(0, 1), c.pod(0, 2));
    c.server.apply(ingress_policy("admit-peer", &target.name, Some(&peer.name))).unwrap();
    wait_denied(&attacker.ns, &format!("{}:8080", target.ip)).unwrap();

    let genuine = sniff(target, "udp", GENUINE_PORT);
    let spoofed = sniff(target, "udp", SPOOFED_PORT);
    let spoofed_tcp = sniff(target, "tcp", SPOOFED_PORT);
    // The admitted peer's own packets arrive (the sniffers work, the policy admits it).
    wait_until("the sniffers listen", Duration::from_secs(10), || {
        send(peer, "udp", &peer.ip, &target.ip, GENUINE_PORT);
        Ok(!received(&genuine).is_empty())
    })
    .unwrap();
    let before = spoofed_drops(c.node(0), "v4");

    for proto in ["udp", "tcp"] {
        send(attacker, proto, &peer.ip, &target.ip, SPOOFED_PORT);
        send(attacker, proto, "198.51.100.7", &target.ip, SPOOFED_PORT);
    }
    // The attacker's genuine raw packets, sent last, arrive where no policy stops them: by then
    // the forged ones would have arrived too.
    let at_peer = sniff(peer, "udp", GENUINE_PORT);
    wait_until("the attacker's genuine packets", Duration::from_secs(10), || {
        send(attacker, "udp", &attacker.ip, &peer.ip, GENUINE_PORT);
        Ok(received(&at_peer).contains(&attacker.ip))
    })
    .unwrap();
    assert_eq!(received(&spoofed), Vec::<String>::new(), "forged UDP reached the isolated pod");
    assert_eq!(received(&spoofed_tcp), Vec::<String>::new(), "forged TCP reached the isolated pod");
    let expected = (4 * PACKETS) as f64;
    wait_until(
        "the drops counted",
        Duration::from_secs(10),
        || Ok(spoofed_drops(c.node(0), "v4") - before >= expected),
    )
    .unwrap();

    // Control: without the check the policy admits the forged peer address.
    c.restart_agent_with(0, &["--enable-pod-source-check=false"]).unwrap();
    wait_until("forged packets arrive with the check off", Duration::from_secs(30), || {
        send(attacker, "udp", &peer.ip, &target.ip, SPOOFED_PORT);
        Ok(received(&spoofed).contains(&peer.ip))
    })
    .unwrap();
}

/// A pod wired after the agent started (a new veth, attached on its link event, its addresses
/// read once the pod's object has its IPs) forges another pod's address: dropped and counted;
/// its own traffic passes. Checks that new veths are checked, not only those found at start.
#[test]
fn a_pod_created_after_the_agent_started_is_checked_too() {
    let mut c = Cluster::builder("krt-hs-new").nodes(1).pods_per_node(1).build().unwrap();
    c.add_pod(0).unwrap();
    let (victim, attacker) = (c.pod(0, 0), c.pod(0, 1));
    let genuine = sniff(victim, "udp", GENUINE_PORT);
    let spoofed = sniff(victim, "udp", SPOOFED_PORT);
    let before = spoofed_drops(c.node(0), "v4");
    send(attacker, "udp", "10.244.1.250", &victim.ip, SPOOFED_PORT);
    wait_until("the attacker's genuine packets", Duration::from_secs(10), || {
        send(attacker, "udp", &attacker.ip, &victim.ip, GENUINE_PORT);
        Ok(received(&genuine).contains(&attacker.ip))
    })
    .unwrap();
    assert_eq!(received(&spoofed), Vec::<String>::new(), "a forged source reached the victim");
    wait_until("the drops counted", Duration::from_secs(10), || {
        Ok(spoofed_drops(c.node(0), "v4") - before >= PACKETS as f64)
    })
    .unwrap();
}

/// IPv6: a pod forges another pod's global address and a link-local one for UDP: neither
/// arrives, while its genuine IPv6 packets do (and neighbour discovery, from link-local
/// addresses, keeps working: the genuine exchange needs it). Checks the IPv6 half of the check.
#[test]
fn a_pod_forging_ipv6_sources_is_dropped() {
    let c = Cluster::builder("krt-hs-v6").dual_stack().nodes(1).pods_per_node(3).build().unwrap();
    let (victim, other, attacker) = (c.pod(0, 0), c.pod(0, 1), c.pod(0, 2));
    let (victim6, other6, attacker6) =
        (victim.ip6.clone().unwrap(), other.ip6.clone().unwrap(), attacker.ip6.clone().unwrap());
    let genuine = sniff(victim, "udp", GENUINE_PORT);
    let spoofed = sniff(victim, "udp", SPOOFED_PORT);
    let before = spoofed_drops(c.node(0), "v6");
    send(attacker, "udp", &other6, &victim6, SPOOFED_PORT);
    send(attacker, "udp", "fe80::1234", &victim6, SPOOFED_PORT);
    wait_until("the attacker's genuine IPv6 packets", Duration::from_secs(10), || {
        send(attacker, "udp", &attacker6, &victim6, GENUINE_PORT);
        Ok(received(&genuine).contains(&attacker6))
    })
    .unwrap();
    assert_eq!(received(&spoofed), Vec::<String>::new(), "a forged IPv6 source reached the victim");
    wait_until("the drops counted", Duration::from_secs(10), || {
        Ok(spoofed_drops(c.node(0), "v6") - before >= (2 * PACKETS) as f64)
    })
    .unwrap();
}
