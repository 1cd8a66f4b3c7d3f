//! The XDP fast path on node uplinks (`--xdp`), on the multi-node harness: an external client's
//! flows to a NodePort and a LoadBalancer IP whose backend is on the other node are served at
//! XDP (its own counters prove it), with the backend seeing the node's address as with TC; a
//! long-lived connection survives restarts and switching XDP off and on. Real TCP and UDP.
//!
//! The node uplinks are veths: the harness turns GRO on at their fabric-side peers (native
//! XDP_TX on a veth needs NAPI there) and, with `full_checksums`, turns checksum offload off
//! where packets start, so they carry complete checksums as from a physical NIC (XDP leaves
//! incomplete CHECKSUM_PARTIAL ones to TC). As root, in network namespaces.

use kube_router_tests::{
    cluster::{assert_all_from, netprobe, node_ip6, request, stats_growth, wait_for, Cluster, Svc},
    kube_router_bin, netprobe_bin,
};

fn web(c: &Cluster) {
    let svc = Svc::load_balancer("web", "10.96.1.20", 30080, "198.51.100.20").select("pod", "pod-2-0");
    c.add_service(svc).unwrap();
    // The LoadBalancer IP reaches the cluster through node-1 (the other node).
    c.route_via("198.51.100.20", 0).unwrap();
    // `add_service` waited for the ClusterIP; the tests count node-1's flows from the first
    // request on, so its NodePorts and LoadBalancer IP must be there too.
    for frontend in ["10.100.0.1:30080", "10.100.0.1:30081", "198.51.100.20:80"] {
        wait_for(frontend, || c.node(0).services().contains(&format!(" {frontend} ")));
    }
}

#[test]
fn north_south_flows_to_the_other_node_are_served_at_xdp() {
    let c = Cluster::builder("krt-xdp-ns").full_checksums().agent_args(&["--xdp", "native"]).build().unwrap();
    web(&c);
    let node = c.node(0);
    wait_for("native XDP on node-1's uplink", || node.uplink_xdp().is_some_and(|(mode, _)| mode == "xdp"));
    // `kube-router interfaces` lists the link with the program the kernel has on the uplink.
    let (_, program) = node.uplink_xdp().unwrap();
    let bin = kube_router_bin();
    let listed =
        node.ns.run(&[bin.to_str().unwrap(), "--bpf-root", node.bpf_root.to_str().unwrap(), "interfaces"]).unwrap();
    assert!(
        listed.lines().any(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            words.first() == Some(&"eth0")
                && words.contains(&"kr_xdp_lb")
                && l.contains(&format!("program {program} "))
                && l.ends_with(" attached")
        }),
        "{listed}"
    );
    let before = node.stats();
    let mut flows = 0;
    for frontend in ["10.100.0.1:30080", "198.51.100.20:80"] {
        assert_all_from(&request(&c.client, "tcp", frontend, 10), "pod-2-0");
        // The backend sees node-1, which took the connection, as with TC.
        assert_eq!(netprobe(&c.client, &["ask", "tcp", frontend, "who"]), "pod-2-0 10.100.0.1", "{frontend}");
        flows += 11;
    }
    assert_all_from(&request(&c.client, "udp", "10.100.0.1:30081", 10), "pod-2-0");
    flows += 10;
    let after = node.stats();
    // Every flow was recorded at XDP, in the conntrack state TC shares (its SNAT counter).
    assert_eq!(stats_growth(&before, &after, "xdp_new_flow"), flows, "{after:?}");
    assert_eq!(stats_growth(&before, &after, "snat_new_flow"), flows, "{after:?}");
    // At least each flow's first packet and first reply went back out at XDP.
    assert!(stats_growth(&before, &after, "xdp_reply") >= flows, "{after:?}");
    assert!(stats_growth(&before, &after, "xdp_tx") >= 2 * flows, "{after:?}");
    // TC routed next to nothing of it (only packets whose next hop the FIB could not give).
    assert!(
        stats_growth(&before, &after, "redirected") <= stats_growth(&before, &after, "xdp_pass_no_route"),
        "{after:?}"
    );
    wait_for("the XDP counters in /metrics", || node.metric("kube_router_xdp_packets_total", "event=\"tx\"") > 0.0);
}

#[test]
fn ipv6_north_south_flows_to_the_other_node_are_served_at_xdp() {
    let c =
        Cluster::builder("krt-xdp-v6").dual_stack().full_checksums().agent_args(&["--xdp", "native"]).build().unwrap();
    let svc = Svc::node_port("web", "10.96.1.10", 30080).dual_stack("fd00:96::10").select("pod", "pod-2-0");
    c.add_service(svc).unwrap();
    let node = c.node(0);
    wait_for("native XDP on node-1's uplink", || node.uplink_xdp().is_some_and(|(mode, _)| mode == "xdp"));
    let node_port = format!("[{}]:30080", node_ip6(0));
    wait_for("the IPv6 NodePort", || request(&c.client, "tcp", &node_port, 1) == ["pod-2-0"]);
    let before = node.stats();
    assert_all_from(&request(&c.client, "tcp", &node_port, 10), "pod-2-0");
    // Source-NATed to node-1's IPv6 address, as at TC.
    assert_eq!(netprobe(&c.client, &["ask", "tcp", &node_port, "who"]), format!("pod-2-0 {}", node_ip6(0)));
    assert_all_from(&request(&c.client, "udp", &format!("[{}]:30081", node_ip6(0)), 10), "pod-2-0");
    let flows = 21;
    let after = node.stats();
    assert_eq!(stats_growth(&before, &after, "xdp_new_flow"), flows, "{after:?}");
    assert!(stats_growth(&before, &after, "xdp_reply") >= flows, "{after:?}");
    assert!(stats_growth(&before, &after, "xdp_tx") >= 2 * flows, "{after:?}");
}

fn restarted_and_synced(c: &Cluster, args: &[&str]) {
    c.restart_agent_with(0, args).unwrap();
    wait_for("the restarted agent's first sync", || {
        c.node(0).metric("kube_router_sync_duration_seconds_count", "") >= 1.0
    });
}

#[test]
fn an_established_connection_survives_restarts_and_switching_xdp_off_and_on() {
    // Default flags: --xdp auto (generic on these veth uplinks).
    let c = Cluster::builder("krt-xdp-restart").full_checksums().build().unwrap();
    web(&c);
    let node = c.node(0);
    wait_for("XDP on node-1's uplink", || node.uplink_xdp().is_some());
    let (mode, program) = node.uplink_xdp().unwrap();
    assert_eq!(mode, "xdpgeneric", "auto attaches a veth generically");
    let held =
        c.client.spawn_collecting(&[netprobe_bin().to_str().unwrap(), "hold", "10.100.0.1:30080", "50"]).unwrap();
    let replies = || held.lock().unwrap().len();
    let rising = |counter: &str| {
        let start = node.stats()[counter];
        wait_for(counter, || node.stats()[counter] >= start + 5);
    };
    rising("xdp_forward");
    let maps = c.agent_maps();

    // The same flags: the link is adopted (the same program stays attached), the maps end as
    // they were, the connection goes on. (A restarted agent's first sync can run before all its
    // lists are in and rewrite entries the complete sync then restores, XDP or not: the maps are
    // compared once it is complete.)
    restarted_and_synced(&c, &[]);
    assert_eq!(node.uplink_xdp(), Some((mode.clone(), program)), "the XDP link was re-adopted, not re-made");
    wait_for("the maps as before the restart", || c.agent_maps() == maps);
    rising("xdp_forward");

    // --xdp off: our program leaves the uplink, TC carries the same connection on.
    restarted_and_synced(&c, &["--xdp", "off"]);
    assert_eq!(node.uplink_xdp(), None);
    assert!(!node.bpf_root.join("links/xdp_eth0").exists());
    let xdp_before = node.stats()["xdp_forward"];
    rising("ct_hit");
    assert_eq!(node.stats()["xdp_forward"], xdp_before, "XDP still serving the flow");

    // And on again: XDP takes the connection over from TC's state.
    restarted_and_synced(&c, &[]);
    wait_for("XDP back on node-1's uplink", || node.uplink_xdp().is_some());
    rising("xdp_forward");

    let seen = replies();
    wait_for("more replies", || replies() > seen);
    let replies = held.lock().unwrap().clone();
    assert!(replies.iter().all(|r| r == "pod-2-0"), "the held connection broke or moved: {replies:?}");
}

/// An XDP program someone else attached to the uplink is never replaced or removed: the agent
/// leaves it (TC serves everything) and `--xdp off` does not take it away either.
#[test]
fn a_foreign_xdp_program_on_the_uplink_is_left_alone() {
    let c = Cluster::builder("krt-xdp-foreign").full_checksums().build().unwrap();
    web(&c);
    let node = c.node(0);
    restarted_and_synced(&c, &["--xdp", "off"]);
    assert_eq!(node.uplink_xdp(), None);
    let pinned = "/sys/fs/bpf/krt-xdp-foreign-prog";
    node.ns.run(&[netprobe_bin().to_str().unwrap(), "xdp-pass", pinned]).unwrap();
    // Attached the legacy (netlink) way, as `ip` does: no bpf_link, no pin of ours.
    node.ns.run(&["ip", "link", "set", "dev", "eth0", "xdpgeneric", "pinned", pinned]).unwrap();
    let foreign = node.uplink_xdp().expect("the foreign program is attached");
    assert_eq!(foreign.0, "xdpgeneric");
    // --xdp auto: the agent tries to attach before its first sync, and must give up.
    restarted_and_synced(&c, &[]);
    assert_eq!(node.uplink_xdp(), Some(foreign.clone()), "the agent replaced a program it did not attach");
    assert!(!node.bpf_root.join("links/xdp_eth0").exists());
    // TC serves the uplink as without XDP.
    assert_all_from(&request(&c.client, "tcp", "10.100.0.1:30080", 5), "pod-2-0");
    restarted_and_synced(&c, &["--xdp", "off"]);
    assert_eq!(node.uplink_xdp(), Some(foreign), "--xdp off removed a program it did not attach");
    let _ = std::fs::remove_file(pinned);
}
