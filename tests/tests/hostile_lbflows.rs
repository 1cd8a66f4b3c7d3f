//! Attacks on the load balancer's conntrack and pod egress masquerade, on the two-node cluster
//! harness (`kube_router_tests::cluster`, pod egress masquerade on as the harness configures
//! it). Each test is one attack or failure with its expected outcome. As root, in network
//! namespaces. Threat model: docs/security/lbflows.md.
use std::time::{Duration, Instant};

use kube_router_tests::{
    cluster::{assert_all_from, netprobe, request, wait_for, Cluster, Svc, CLIENT_ADDR, INTERNET_ADDR},
    netprobe_bin,
};

/// An outside client whose network routes the pod CIDR to the pod's node (an advertised pod
/// CIDR, a ToR) connects to a pod's own address, over TCP and UDP: the answers come from the
/// pod's address, not masqueraded to the node's (the client's connected UDP socket would drop
/// those, its TCP stack would never see a SYN-ACK). Guards: a reply never starts a masqueraded
/// flow (`LbFlow::opens_flow` in `lb::masquerade`), and ingress records such a flow untranslated
/// (`lb::record_if_outside_to_pod`, `CT_FLAG_UNTRANSLATED`), which UDP needs.
#[test]
fn an_outside_client_reaches_a_pod_by_its_own_address_over_tcp_and_udp() {
    let c = Cluster::builder("krt-hf-direct").build().unwrap();
    let pod = c.pod(0, 0);
    c.route_via(&pod.ip, 0).unwrap();
    let tcp = format!("{}:8080", pod.ip);
    let udp = format!("{}:5353", pod.ip);
    assert_all_from(&request(&c.client, "tcp", &tcp, 5), &pod.name);
    assert_all_from(&request(&c.client, "udp", &udp, 5), &pod.name);
    // The pod sees the client's own address, and the client the pod's.
    assert_eq!(netprobe(&c.client, &["ask", "tcp", &tcp, "who"]), format!("{} {CLIENT_ADDR}", pod.name));
    assert_eq!(netprobe(&c.client, &["ask", "udp", &udp, "who"]), format!("{} {CLIENT_ADDR}", pod.name));
    assert_eq!(c.node(0).stats().get("egress_masquerade_new_flow").copied().unwrap_or(0), 0, "no reply masqueraded");
    // The same pod's own flows to the internet are still masqueraded.
    assert_all_from(&pod.request("tcp", &format!("{INTERNET_ADDR}:8080"), 3), "internet");
    assert_all_from(&pod.request("udp", &format!("{INTERNET_ADDR}:5353"), 3), "internet");
    assert_eq!(c.node(0).stats()["egress_masquerade_new_flow"], 6);
}

/// 300,000 SYNs from spoofed client addresses and ports at a NodePort whose backend is on the
/// other node: each takes a port of `--snat-port-range` towards that backend until none is left
/// (`snat_ports_exhausted`), the backend answers them with SYN-ACKs nobody acknowledges. An
/// established connection through the same NodePort goes on answering throughout (its entries
/// are never evicted or taken over). The flood's entries expire 60 s after their last packet
/// (`CT_LIFETIME_UNREPLIED_SECS`; a SYN-ACK is no answer), and a new client connects again
/// then, not hours later. Guards: the unreplied lifetime in `CtValue::lifetime_ns`, the
/// SYN-ACK rule of `conntrack::mark_seen_reply`, the reclaim of expired holders in
/// `conntrack::create_snat`. The one long test of this file (about 70 s).
#[test]
fn a_syn_flood_at_a_node_port_keeps_established_flows_and_its_snat_ports_free_again_after_60_s() {
    let c = Cluster::builder("krt-hf-flood").build().unwrap();
    c.add_service(Svc::node_port("web", "10.96.1.90", 30080).select("pod", "pod-2-0")).unwrap();
    let frontend = "10.100.0.1:30080";
    assert_all_from(&request(&c.client, "tcp", frontend, 1), "pod-2-0");
    let held = c.client.spawn_collecting(&[netprobe_bin().to_str().unwrap(), "hold", frontend, "100"]).unwrap();
    wait_for("the held connection answering", || held.lock().unwrap().len() >= 3);

    let flood_start = Instant::now();
    let flood = netprobe(&c.client, &["synflood", frontend, "192.168.100", "300000", "40"]);
    let (sent, millis) = flood.split_once(' ').expect("SENT MILLIS");
    assert_eq!(sent, "300000", "the whole flood was sent ({flood})");
    println!("flood: {sent} SYNs in {millis} ms");
    let node = c.node(0);
    wait_for("SNAT ports exhausted", || node.stats()["snat_ports_exhausted"] > 0);
    // Every port taken, or the test measures luck: a loaded kernel can drop part of a fast flood
    // in a veth's queue before any program sees it, and a few ports left free are found by
    // a new client's probes seconds later (a failed run: "freed early: 33.6 s"). Topped up
    // until a burst that reached the datapath (10,000 refusals at least, 160,000 probes over
    // 20,000 ports: a free one is missed with odds of e^-8) takes no port.
    let mut top_ups = 0;
    loop {
        let before = node.stats();
        let (taken, refused) = (before["snat_new_flow"], before["snat_ports_exhausted"]);
        let burst = netprobe(&c.client, &["synflood", frontend, "192.168.100", "20000", "20"]);
        let stats = node.stats();
        let (took, refusals) = (stats["snat_new_flow"] - taken, stats["snat_ports_exhausted"] - refused);
        if took == 0 && refusals >= 10_000 {
            break;
        }
        top_ups += 1;
        assert!(
            top_ups <= 10,
            "the flood never took every SNAT port: a burst ({burst}) took {took}, {refusals} refused"
        );
    }
    let fill_time = flood_start.elapsed();
    println!(
        "every SNAT port taken {:.1} s after the flood began ({top_ups} bursts topped it up)",
        fill_time.as_secs_f64()
    );
    let refused = netprobe(&c.client, &["timed", "tcp", frontend]);
    assert!(refused.starts_with("ERR"), "every SNAT port is taken by the flood: {refused}");

    // A new client connects again once the flood's entries have expired.
    // The ports taken last are free again 60 s after the fill: 40 s of margin.
    let deadline = flood_start + fill_time + Duration::from_secs(100);
    let recovered = loop {
        let attempt = netprobe(&c.client, &["timed", "tcp", frontend]);
        if attempt.starts_with("OK pod-2-0") {
            break flood_start.elapsed();
        }
        assert!(Instant::now() < deadline, "no new connection 100 s after the flood filled the ports: {attempt}");
        std::thread::sleep(Duration::from_secs(1));
    };
    println!("a new client connects {:.1} s after the flood began", recovered.as_secs_f64());
    let collected = node.metric("kube_router_conntrack_gc_removed_total", "");
    assert!(
        recovered >= Duration::from_secs(55),
        "the flood's ports freed early: {recovered:?} (the agent's GC had removed {collected} entries)"
    );
    assert_all_from(&request(&c.client, "tcp", frontend, 5), "pod-2-0");
    // The flood's entries expire over as long as it took to send (and its early SYN-ACK
    // retransmissions), so a new flow may still probe a few held ports first and its SYN be
    // refused once (retransmitted, it connects). Once the whole flood is over, none is: a burst
    // of 20 connections without one refusal comes by the deadline.
    loop {
        let exhausted = node.stats()["snat_ports_exhausted"];
        assert_all_from(&request(&c.client, "tcp", frontend, 20), "pod-2-0");
        if node.stats()["snat_ports_exhausted"] == exhausted {
            break;
        }
        assert!(Instant::now() < deadline, "SNAT ports still refused 100 s after the flood filled them");
    }
    println!("no SNAT refusal {:.1} s after the flood began", flood_start.elapsed().as_secs_f64());

    let seen = held.lock().unwrap().len();
    wait_for("the held connection answering after the flood", || held.lock().unwrap().len() > seen);
    let replies = held.lock().unwrap().clone();
    assert!(replies.iter().all(|r| r == "pod-2-0"), "the held connection lost replies: {replies:?}");
    println!("held connection: {} replies, 0 lost", replies.len());
}
