//! The real load-balancer program, loaded into the kernel and run on crafted packets with
//! BPF_PROG_TEST_RUN: exact rewrites, valid checksums, conntrack and affinity. Needs root.
use common::test_run::{packet, run, TC_ACT_REDIRECT, TC_ACT_UNSPEC};
use std::{net::Ipv4Addr, path::PathBuf};

use kube_router::services::maps::{conntrack::Conntrack, read_lb_stats, BpfServiceMaps};
use kube_router::{
    bpf::datapath::{self, Datapath, Hook},
    services::{compile::MapContents, model::NodeContext, sync::ServiceSync},
};
use kube_router_common::lb_stat;

mod common;
use common::{program_services, VIP};

struct Loaded {
    datapath: Datapath,
    pin_dir: PathBuf,
}

impl Drop for Loaded {
    fn drop(&mut self) {
        let _ = datapath::remove_all(&self.pin_dir);
    }
}

fn services_yaml(backends: &[&str], affinity: bool) -> String {
    let endpoints: String =
        backends.iter().map(|b| format!("- addresses: [{b}]\n  conditions: {{ready: true}}\n")).collect();
    let affinity = if affinity { "  sessionAffinity: ClientIP\n" } else { "" };
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{namespace: default, name: web}}\nspec:\n  clusterIP: 10.96.0.10\n{affinity}  ports:\n  - {{name: http, protocol: TCP, port: 80}}\n  - {{name: dns, protocol: UDP, port: 53}}\n---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  namespace: default\n  name: web-1\n  labels: {{kubernetes.io/service-name: web}}\naddressType: IPv4\n\
         ports:\n- {{name: http, protocol: TCP, port: 8080}}\n- {{name: dns, protocol: UDP, port: 5353}}\nendpoints:\n{endpoints}"
    )
}

fn load(test: &str, yaml: &str) -> Loaded {
    let pin_dir = PathBuf::from(format!("/sys/fs/bpf/krt-unit-{test}"));
    let _ = datapath::remove_all(&pin_dir);
    let datapath = Datapath::load(&pin_dir).expect("load datapath (run as root)");
    program(&pin_dir, yaml);
    Loaded { datapath, pin_dir }
}

fn program(pin_dir: &std::path::Path, yaml: &str) {
    program_services(pin_dir, yaml, &NodeContext::default());
}

const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 1, 0, 7);

#[test]
fn dnat_to_a_backend_with_valid_checksums_and_reverse_nat_of_the_reply() {
    let loaded = load("dnat", &services_yaml(&["10.0.0.1", "10.0.0.2"], false));
    let fd = loaded.datapath.program_fd(Hook::Ingress).unwrap();
    let egress = loaded.datapath.program_fd(Hook::Egress).unwrap();
    for (proto, vport, bport) in [(packet::TCP, 80, 8080), (packet::UDP, 53, 5353)] {
        let syn = packet::ipv4(proto, (CLIENT, 40000), (VIP, vport), packet::TCP_SYN, b"hello");
        let out = run(fd, &syn, 1).unwrap();
        assert_eq!(out.retval, TC_ACT_UNSPEC);
        let (src, dst) = packet::endpoints(&out.packet);
        assert_eq!(src, (CLIENT, 40000), "source untouched");
        assert!(dst.0 == Ipv4Addr::new(10, 0, 0, 1) || dst.0 == Ipv4Addr::new(10, 0, 0, 2), "{dst:?}");
        assert_eq!(dst.1, bport);
        assert!(packet::checksums_valid(&out.packet), "checksums after DNAT");
        assert!(packet::checksums_valid(&syn));

        // The same flow keeps its backend (conntrack hit).
        for _ in 0..20 {
            let again = run(fd, &packet::ipv4(proto, (CLIENT, 40000), (VIP, vport), packet::TCP_ACK, b"x"), 1).unwrap();
            assert_eq!(packet::endpoints(&again.packet).1, dst);
        }
        // The backend's reply is rewritten to come from the VIP.
        let reply = packet::ipv4(proto, dst, (CLIENT, 40000), packet::TCP_ACK, b"world");
        let passed_in = run(fd, &reply, 1).unwrap();
        assert_eq!(passed_in.packet, reply, "replies are left alone on ingress");
        let out = run(egress, &reply, 1).unwrap();
        assert_eq!(packet::endpoints(&out.packet), ((VIP, vport), (CLIENT, 40000)));
        assert!(packet::checksums_valid(&out.packet), "checksums after reverse NAT");
    }
    let stats = read_lb_stats(&loaded.pin_dir).unwrap();
    assert_eq!(stats[lb_stat::NEW_FLOW as usize], 2);
    assert_eq!(stats[lb_stat::CT_HIT as usize], 40);
    assert_eq!(stats[lb_stat::REVERSE_NAT as usize], 2);
    let ct = Conntrack::open_pinned(&loaded.pin_dir).unwrap();
    assert_eq!(ct.entries().unwrap().len(), 4, "forward + reverse per flow");
}

#[test]
fn new_flows_spread_over_all_backends() {
    let loaded = load("spread", &services_yaml(&["10.0.0.1", "10.0.0.2", "10.0.0.3"], false));
    let fd = loaded.datapath.program_fd(Hook::Ingress).unwrap();
    let mut seen = std::collections::BTreeMap::new();
    for port in 0..300u16 {
        let out =
            run(fd, &packet::ipv4(packet::TCP, (CLIENT, 20000 + port), (VIP, 80), packet::TCP_SYN, b""), 1).unwrap();
        *seen.entry(packet::endpoints(&out.packet).1 .0).or_insert(0) += 1;
    }
    assert_eq!(seen.len(), 3, "{seen:?}");
    assert!(seen.values().all(|n| *n >= 50), "roughly even: {seen:?}");
}

#[test]
fn client_ip_affinity_pins_new_flows_of_a_client_to_one_backend() {
    let loaded = load("affinity", &services_yaml(&["10.0.0.1", "10.0.0.2", "10.0.0.3"], true));
    let fd = loaded.datapath.program_fd(Hook::Ingress).unwrap();
    let first = run(fd, &packet::ipv4(packet::TCP, (CLIENT, 1000), (VIP, 80), packet::TCP_SYN, b""), 1).unwrap();
    let backend = packet::endpoints(&first.packet).1;
    for port in 1001..1100 {
        let out = run(fd, &packet::ipv4(packet::TCP, (CLIENT, port), (VIP, 80), packet::TCP_SYN, b""), 1).unwrap();
        assert_eq!(packet::endpoints(&out.packet).1, backend);
    }
    assert_eq!(read_lb_stats(&loaded.pin_dir).unwrap()[lb_stat::AFFINITY_HIT as usize], 99);
}

#[test]
fn removed_backend_gets_no_new_flows_but_established_ones_continue() {
    let loaded = load("removal", &services_yaml(&["10.0.0.1", "10.0.0.2"], false));
    let fd = loaded.datapath.program_fd(Hook::Ingress).unwrap();
    // Find a flow that went to 10.0.0.2.
    let mut port = 3000;
    let established = loop {
        let out = run(fd, &packet::ipv4(packet::TCP, (CLIENT, port), (VIP, 80), packet::TCP_SYN, b""), 1).unwrap();
        if packet::endpoints(&out.packet).1 .0 == Ipv4Addr::new(10, 0, 0, 2) {
            break port;
        }
        port += 1;
    };
    // The backend answered: the connection is established (an unanswered one would move).
    let egress = loaded.datapath.program_fd(Hook::Egress).unwrap();
    let reply =
        packet::ipv4(packet::TCP, (Ipv4Addr::new(10, 0, 0, 2), 8080), (CLIENT, established), packet::TCP_ACK, b"");
    run(egress, &reply, 1).unwrap();
    program(&loaded.pin_dir, &services_yaml(&["10.0.0.1"], false));
    for p in 4000..4100 {
        let out = run(fd, &packet::ipv4(packet::TCP, (CLIENT, p), (VIP, 80), packet::TCP_SYN, b""), 1).unwrap();
        assert_eq!(packet::endpoints(&out.packet).1 .0, Ipv4Addr::new(10, 0, 0, 1));
    }
    let out =
        run(fd, &packet::ipv4(packet::TCP, (CLIENT, established), (VIP, 80), packet::TCP_ACK, b"more"), 1).unwrap();
    assert_eq!(packet::endpoints(&out.packet).1 .0, Ipv4Addr::new(10, 0, 0, 2));
}

#[test]
fn unknown_destinations_pass_untouched_and_empty_services_refuse() {
    let loaded = load("miss", &services_yaml(&[], false));
    let fd = loaded.datapath.program_fd(Hook::Ingress).unwrap();
    let other = packet::ipv4(packet::TCP, (CLIENT, 5000), (Ipv4Addr::new(10, 96, 0, 11), 80), packet::TCP_SYN, b"");
    let out = run(fd, &other, 1).unwrap();
    assert_eq!(out.retval, TC_ACT_UNSPEC);
    assert_eq!(out.packet, other);
    let to_empty = packet::ipv4(packet::TCP, (CLIENT, 5000), (VIP, 80), packet::TCP_SYN, b"");
    // Answered with a RST sent back out of the interface (datapath_nat.rs checks the packet).
    assert_eq!(run(fd, &to_empty, 1).unwrap().retval, TC_ACT_REDIRECT);
    let stats = read_lb_stats(&loaded.pin_dir).unwrap();
    assert_eq!(stats[lb_stat::NO_SERVICE as usize], 1);
    assert_eq!(stats[lb_stat::NO_BACKEND_DROP as usize], 1);
    assert_eq!(stats[lb_stat::REJECT_SENT as usize], 1);
}

#[test]
fn reloading_over_pinned_maps_keeps_their_contents() {
    let loaded = load("reload", &services_yaml(&["10.0.0.1"], false));
    let before = BpfServiceMaps::open_pinned(&loaded.pin_dir).unwrap();
    let before = kube_router::services::sync::ServiceMaps::read_all(&before).unwrap();
    assert_ne!(before, MapContents::default());
    let again = Datapath::load(&loaded.pin_dir).unwrap();
    drop(again);
    let after = kube_router::agent::read_programmed(&loaded.pin_dir).unwrap();
    assert_eq!(before, after);
}

#[test]
fn resizing_the_maps_keeps_services_and_established_flows() {
    use kube_router::{bpf::layout::MapSizes, pinned::pinned_map};
    let loaded = load("resize", &services_yaml(&["10.0.0.1", "10.0.0.2"], false));
    let fd = loaded.datapath.program_fd(Hook::Ingress).unwrap();
    let syn = packet::ipv4(packet::TCP, (CLIENT, 40000), (VIP, 80), packet::TCP_SYN, b"");
    let backend = packet::endpoints(&run(fd, &syn, 1).unwrap().packet).1;
    let services = kube_router::agent::read_programmed(&loaded.pin_dir).unwrap();
    let flows = Conntrack::open_pinned(&loaded.pin_dir).unwrap().entries().unwrap();
    assert_eq!(flows.len(), 2);

    let sizes = MapSizes { lb_frontends: 1024, conntrack: 4096 };
    let mut resized = Datapath::load_sized(&loaded.pin_dir, datapath::AttachMode::detect(), Some(sizes)).unwrap();
    let max_entries = |name| aya::maps::MapInfo::from_pin(pinned_map(&loaded.pin_dir, name)).unwrap().max_entries();
    assert_eq!((max_entries("svc_v4"), max_entries("backends_v4"), max_entries("svc_slots_v4")), (1024, 4096, 4096));
    assert_eq!((max_entries("ct_v4"), max_entries("ct_v6"), max_entries("pol_ct_v4")), (4096, 4096, 4096));
    assert_eq!(
        (max_entries("svc_stats_v4"), max_entries("svc_stats_v6")),
        (1024, 1024),
        "counters follow the frontends"
    );
    assert_eq!(max_entries("cluster_nets_v4"), kube_router_common::CLUSTER_NETS_MAX_ENTRIES, "fixed sizes stay");
    // The old programs (still attached in a real node) wrote a flow after the first copy.
    let late = packet::ipv4(packet::TCP, (CLIENT, 40001), (VIP, 80), packet::TCP_SYN, b"");
    let late_backend = packet::endpoints(&run(fd, &late, 1).unwrap().packet).1;
    assert!(pinned_map(&loaded.pin_dir, "ct_v4_resizing").exists(), "the old map stays until the swap");
    resized.finish_upgrade().unwrap();
    assert!(!pinned_map(&loaded.pin_dir, "ct_v4_resizing").exists());

    assert_eq!(kube_router::agent::read_programmed(&loaded.pin_dir).unwrap(), services);
    let new_fd = resized.program_fd(Hook::Ingress).unwrap();
    for (port, expected) in [(40000, backend), (40001, late_backend)] {
        for _ in 0..10 {
            let ack = packet::ipv4(packet::TCP, (CLIENT, port), (VIP, 80), packet::TCP_ACK, b"x");
            assert_eq!(packet::endpoints(&run(new_fd, &ack, 1).unwrap().packet).1, expected, "flow keeps its backend");
        }
    }
    assert_eq!(Conntrack::open_pinned(&loaded.pin_dir).unwrap().entries().unwrap().len(), 4);
    assert_eq!(read_lb_stats(&loaded.pin_dir).unwrap()[lb_stat::CT_HIT as usize], 20);

    // Without sizes (a tool opening the datapath), the pinned sizes are adopted as they are.
    drop(Datapath::load(&loaded.pin_dir).unwrap());
    assert_eq!(max_entries("svc_v4"), 1024);
}

#[test]
fn a_pinned_map_with_another_layout_is_reported_and_left_alone() {
    let pin_dir = PathBuf::from("/sys/fs/bpf/krt-unit-layout");
    let _ = datapath::remove_all(&pin_dir);
    let path = kube_router::pinned::pinned_map(&pin_dir, "svc_v4");
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    // Another layout: 4-byte keys.
    let created = std::process::Command::new("bpftool")
        .args([
            "map",
            "create",
            path.to_str().unwrap(),
            "type",
            "hash",
            "key",
            "4",
            "value",
            "16",
            "entries",
            "16",
            "name",
            "svc_v4",
        ])
        .status()
        .unwrap();
    assert!(created.success());
    let error = Datapath::load(&pin_dir).err().expect("load must refuse a mismatched map");
    let message = format!("{error:#}");
    assert!(message.contains("svc_v4") && message.contains("key=4B") && message.contains("key=8B"), "{message}");
    let info = aya::maps::MapInfo::from_pin(&path).expect("the old map is still pinned");
    assert_eq!(info.key_size(), 4);
    let _ = datapath::remove_all(&pin_dir);
}

#[test]
fn a_full_map_is_counted_and_does_not_disturb_what_is_programmed() {
    use kube_router_common::{ServiceKeyV4, ServiceValue, SERVICES_MAX_ENTRIES};
    let loaded = load("full", &services_yaml(&["10.0.0.1"], false));
    let mut maps = BpfServiceMaps::open_pinned(&loaded.pin_dir).unwrap();
    let mut sync = ServiceSync::adopt(&maps).unwrap();
    let mut desired = sync.programmed().clone();
    let existing = desired.services.len() as u32;
    let extra = SERVICES_MAX_ENTRIES - existing + 5;
    for i in 0..extra {
        let key = ServiceKeyV4 {
            addr: u32::from_ne_bytes([10, 200, (i >> 8) as u8, i as u8]),
            port: (i >> 16) as u16 + 1,
            proto: 6,
            pad: 0,
        };
        desired
            .services
            .insert(key, ServiceValue { service_id: 9999, backend_count: 0, flags: 0, affinity_timeout_secs: 0 });
    }
    let report = sync.sync(&mut maps, desired, true).total();
    assert_eq!(report.errors, 5, "{report:?}");
    assert_eq!(report.full, 5, "reported as map-full");
    assert_eq!(report.inserts, u64::from(extra - 5));
    // The service that was there still works.
    let fd = loaded.datapath.program_fd(Hook::Ingress).unwrap();
    let out = run(fd, &packet::ipv4(packet::TCP, (CLIENT, 7000), (VIP, 80), packet::TCP_SYN, b""), 1).unwrap();
    assert_eq!(packet::endpoints(&out.packet).1, (Ipv4Addr::new(10, 0, 0, 1), 8080));
}

fn maglev_yaml(backends: &[&str], decoy: bool) -> String {
    let endpoints: String =
        backends.iter().map(|b| format!("- addresses: [{b}]\n  conditions: {{ready: true}}\n")).collect();
    // A Service programmed first on one "node" only, so its backend IDs differ from the other's.
    let decoy = if decoy {
        "apiVersion: v1\nkind: Service\nmetadata: {namespace: default, name: aaa}\nspec:\n  clusterIP: 10.96.0.99\n  ports:\n  - {name: http, protocol: TCP, port: 80}\n---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  namespace: default\n  name: aaa-1\n  labels: {kubernetes.io/service-name: aaa}\naddressType: IPv4\n\
         ports:\n- {name: http, protocol: TCP, port: 8080}\nendpoints:\n- addresses: [10.0.9.9]\n  conditions: {ready: true}\n---\n"
    } else {
        ""
    };
    format!(
        "{decoy}apiVersion: v1\nkind: Service\nmetadata:\n  namespace: default\n  name: web\n  annotations: {{kube-router.io/service.scheduler: mh, kube-router.io/service.schedflags: mh-port}}\n\
         spec:\n  clusterIP: 10.96.0.10\n  ports:\n  - {{name: http, protocol: TCP, port: 80}}\n---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  namespace: default\n  name: web-1\n  labels: {{kubernetes.io/service-name: web}}\naddressType: IPv4\n\
         ports:\n- {{name: http, protocol: TCP, port: 8080}}\nendpoints:\n{endpoints}"
    )
}

/// Maglev (`kube-router.io/service.scheduler: mh`): two nodes whose maps number the backends
/// differently send each of 10,000 flows to the same backend, spread over all of them; a node
/// without one of the N backends moves at most 1.2/N of the flows. A table swapped under traffic
/// (a backend removed) leaves every established flow of the other backends where it was.
#[test]
fn maglev_sends_a_flow_to_the_same_backend_on_every_node() {
    const FLOWS: u32 = 10_000;
    let backends = ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"];
    let node_a = load("maglev-a", &maglev_yaml(&backends, false));
    let node_b = load("maglev-b", &maglev_yaml(&[], true));
    program(&node_b.pin_dir, &maglev_yaml(&backends, true));
    let node_c = load("maglev-c", &maglev_yaml(&backends[..4], false));
    let ids = |pin_dir: &PathBuf| kube_router::agent::read_programmed(pin_dir).unwrap().backends;
    assert_ne!(ids(&node_a.pin_dir), ids(&node_b.pin_dir), "the nodes number the backends differently");
    let tuple = |i: u32| (Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 1, 0, 0)) + i / 100), 30000 + (i % 100) as u16);
    let choose = |loaded: &Loaded, i: u32, flags: u8| {
        let fd = loaded.datapath.program_fd(Hook::Ingress).unwrap();
        let packet = packet::ipv4(packet::TCP, tuple(i), (VIP, 80), flags, b"");
        packet::endpoints(&run(fd, &packet, 1).unwrap().packet).1 .0
    };
    let removed = Ipv4Addr::new(10, 0, 0, 5);
    let (mut spread, mut moved) = (std::collections::BTreeMap::new(), 0);
    let mut on_a = Vec::new();
    for i in 0..FLOWS {
        let (a, b, c) = (
            choose(&node_a, i, packet::TCP_SYN),
            choose(&node_b, i, packet::TCP_SYN),
            choose(&node_c, i, packet::TCP_SYN),
        );
        assert_eq!(a, b, "flow {:?}: the nodes disagree", tuple(i));
        *spread.entry(a).or_insert(0) += 1;
        moved += usize::from(a != c);
        on_a.push(a);
    }
    let share = moved as f64 / FLOWS as f64;
    println!(
        "maglev: {FLOWS} flows, {spread:?}; one of 5 backends removed: {:.1} % of flows moved (bound 1.2/N = 24 %)",
        share * 100.0
    );
    assert_eq!(spread.len(), 5, "{spread:?}");
    assert!(spread.values().all(|n| *n >= 1600), "roughly even: {spread:?}");
    assert!(share <= 1.2 / 5.0, "{:.1} % of flows moved", share * 100.0);

    // Node A loses the backend: its table is swapped; established flows stay put.
    program(&node_a.pin_dir, &maglev_yaml(&backends[..4], false));
    for i in (0..FLOWS).step_by(7) {
        if on_a[i as usize] != removed {
            assert_eq!(choose(&node_a, i, packet::TCP_ACK), on_a[i as usize], "an established flow moved");
        }
    }
    let _ = (node_b, node_c);
}

#[test]
fn each_frontend_counts_its_connections_packets_and_bytes_and_a_new_service_starts_from_zero() {
    use kube_router::services::maps::stats::SvcStatsMap;
    use kube_router_common::{ServiceKeyV4, ServiceStats};
    let yaml = services_yaml(&["10.0.0.1"], false);
    let loaded = load("svcstats", &yaml);
    let fd = loaded.datapath.program_fd(Hook::Ingress).unwrap();
    let egress = loaded.datapath.program_fd(Hook::Egress).unwrap();
    let frontend = |port: u16, proto: u8| ServiceKeyV4 {
        addr: u32::from_ne_bytes(VIP.octets()),
        port: port.to_be(),
        proto,
        pad: 0,
    };
    let (http, dns) = (frontend(80, packet::TCP), frontend(53, packet::UDP));
    let ip_len = |p: &[u8]| (p.len() - 14) as u64;
    let syn = packet::ipv4(packet::TCP, (CLIENT, 40000), (VIP, 80), packet::TCP_SYN, b"");
    let data = packet::ipv4(packet::TCP, (CLIENT, 40000), (VIP, 80), packet::TCP_ACK, b"0123456789");
    let reply = packet::ipv4(packet::TCP, (Ipv4Addr::new(10, 0, 0, 1), 8080), (CLIENT, 40000), packet::TCP_ACK, b"ok");
    run(fd, &syn, 1).unwrap();
    for _ in 0..3 {
        run(fd, &data, 1).unwrap();
    }
    for _ in 0..2 {
        assert_eq!(packet::endpoints(&run(egress, &reply, 1).unwrap().packet).0, (VIP, 80));
    }
    // Not a Service flow: counted nowhere.
    run(fd, &packet::ipv4(packet::TCP, (CLIENT, 40001), (Ipv4Addr::new(10, 96, 0, 99), 80), packet::TCP_SYN, b""), 1)
        .unwrap();

    let stats = SvcStatsMap::open_pinned(&loaded.pin_dir).unwrap();
    let all = stats.read_all().unwrap();
    let want = ServiceStats {
        connections: 1,
        packets_in: 4,
        bytes_in: ip_len(&syn) + 3 * ip_len(&data),
        packets_out: 2,
        bytes_out: 2 * ip_len(&reply),
    };
    assert_eq!(all.get(&http), Some(&want));
    assert_eq!(all.get(&dns), None, "the other port of the Service saw nothing: no counters yet");
    assert_eq!(all.len(), 1, "counters only for frontends that saw a packet");

    // The Service is removed, and one is programmed again on the same frontend: it starts at 0.
    program(&loaded.pin_dir, "");
    assert!(stats.read_all().unwrap().is_empty(), "counters removed with their frontends");
    // A packet of the old flow after its frontend went: no counters come back for it.
    run(fd, &data, 1).unwrap();
    assert!(stats.read_all().unwrap().is_empty(), "no counters for a frontend that is not programmed");
    program(&loaded.pin_dir, &yaml);
    assert_eq!(stats.read_all().unwrap().get(&http), None, "not inherited");
    let new_syn = packet::ipv4(packet::TCP, (CLIENT, 40002), (VIP, 80), packet::TCP_SYN, b"");
    run(fd, &new_syn, 1).unwrap();
    let fresh = ServiceStats { connections: 1, packets_in: 1, bytes_in: ip_len(&new_syn), ..Default::default() };
    assert_eq!(stats.read_all().unwrap().get(&http), Some(&fresh), "counted from zero");
}

/// A conntrack entry as an older release leaves it: the flow (client -> 10.96.0.99:80) is
/// translated to 10.0.0.1:8080, and no endpoint of it is recorded in `ct_gate_v4`.
fn plant_unrecorded_flow(pin_dir: &std::path::Path) {
    use aya::maps::{HashMap, Map, MapData};
    use kube_router_common::*;
    let data = MapData::from_pin(kube_router::pinned::pinned_map(pin_dir, map_names::CONNTRACK)).unwrap();
    let mut ct: HashMap<MapData, CtKeyV4, CtValueV4> = HashMap::try_from(Map::LruHashMap(data)).unwrap();
    let be = |a: Ipv4Addr| u32::from(a).to_be();
    let key = CtKey {
        src_addr: be(CLIENT),
        dst_addr: be(Ipv4Addr::new(10, 96, 0, 99)),
        src_port: 7000u16.to_be(),
        dst_port: 80u16.to_be(),
        proto: IPPROTO_TCP,
        pad: [0; 3],
    };
    let value = CtValue {
        last_seen_ns: kube_router::pinned::conntrack_gc::monotonic_now_ns(),
        nat_src_addr: key.src_addr,
        nat_dst_addr: be(Ipv4Addr::new(10, 0, 0, 1)),
        nat_src_port: key.src_port,
        nat_dst_port: 8080u16.to_be(),
        flags: CT_FLAG_FORWARD | CT_FLAG_SEEN_REPLY,
        pad: 0,
        service_id: 7,
        backend_id: 1,
    };
    ct.insert(key, value, 0).unwrap();
}

fn set_gate_flag(pin_dir: &std::path::Path, open: u32) {
    use aya::maps::{Array, Map, MapData};
    let data =
        MapData::from_pin(kube_router::pinned::pinned_map(pin_dir, kube_router_common::map_names::META)).unwrap();
    let mut meta: Array<MapData, u32> = Array::try_from(Map::Array(data)).unwrap();
    meta.set(kube_router_common::META_LB_GATE, open, 0).unwrap();
}

#[test]
fn the_gate_skips_the_lookup_only_for_packets_no_entry_can_hold() {
    let loaded = load("gate", &services_yaml(&["10.0.0.1"], false));
    let (ingress, egress) =
        (loaded.datapath.program_fd(Hook::Ingress).unwrap(), loaded.datapath.program_fd(Hook::Egress).unwrap());
    let unrecorded =
        packet::ipv4(packet::TCP, (CLIENT, 7000), (Ipv4Addr::new(10, 96, 0, 99), 80), packet::TCP_ACK, b"");
    let translated = ((CLIENT, 7000), (Ipv4Addr::new(10, 0, 0, 1), 8080));
    plant_unrecorded_flow(&loaded.pin_dir);
    // Closed (as loaded): every packet is looked up.
    assert_eq!(packet::endpoints(&run(ingress, &unrecorded, 1).unwrap().packet), translated);
    // Open with nothing recorded: the packet touches no frontend, endpoint or node address and
    // passes without a lookup (this is what an agent opening it too early would break).
    set_gate_flag(&loaded.pin_dir, 1);
    assert_eq!(run(ingress, &unrecorded, 1).unwrap().packet, unrecorded, "gated: no lookup");
    // Opened by the agent: the entries it finds get their endpoints first.
    set_gate_flag(&loaded.pin_dir, 0);
    assert!(kube_router::services::maps::gate::open(&loaded.pin_dir).unwrap() >= 2);
    assert_eq!(packet::endpoints(&run(ingress, &unrecorded, 1).unwrap().packet), translated);

    // A flow the datapath opens records its frontend and backend, so it keeps its translation
    // both ways after its Service is gone.
    let syn = packet::ipv4(packet::TCP, (CLIENT, 41000), (VIP, 80), packet::TCP_SYN, b"");
    let backend = packet::endpoints(&run(ingress, &syn, 1).unwrap().packet).1;
    let reply = packet::ipv4(packet::TCP, backend, (CLIENT, 41000), packet::TCP_ACK, b"");
    assert_eq!(packet::endpoints(&run(egress, &reply, 1).unwrap().packet), ((VIP, 80), (CLIENT, 41000)));
    program(&loaded.pin_dir, &services_yaml(&[], false).replace("clusterIP: 10.96.0.10", "clusterIP: 10.96.0.12"));
    let more = packet::ipv4(packet::TCP, (CLIENT, 41000), (VIP, 80), packet::TCP_ACK, b"more");
    assert_eq!(packet::endpoints(&run(ingress, &more, 1).unwrap().packet).1, backend, "forward after removal");
    assert_eq!(
        packet::endpoints(&run(egress, &reply, 1).unwrap().packet),
        ((VIP, 80), (CLIENT, 41000)),
        "reply after removal"
    );
    // Pod to pod, no Service anywhere: untouched, counted as no service.
    let before = read_lb_stats(&loaded.pin_dir).unwrap()[lb_stat::NO_SERVICE as usize];
    let direct = packet::ipv4(packet::UDP, (CLIENT, 9000), (Ipv4Addr::new(10, 1, 0, 8), 9000), 0, b"x");
    assert_eq!(run(ingress, &direct, 1).unwrap().packet, direct);
    assert_eq!(run(egress, &direct, 1).unwrap().packet, direct);
    assert_eq!(read_lb_stats(&loaded.pin_dir).unwrap()[lb_stat::NO_SERVICE as usize], before + 1);
}

fn plain_hits(pin_dir: &std::path::Path) -> u64 {
    use kube_router_common::{plain_map_names, plain_stat};
    let stats = kube_router::pinned::counters::read_pinned(pin_dir, plain_map_names::PLAIN_STATS, plain_stat::COUNT);
    stats.unwrap()[plain_stat::HIT as usize]
}

/// The plain-traffic cache: a tuple the gate let pass is remembered, and judged again once
/// something it rested on changes. A Service flow the datapath opens records its backend, so the
/// backend's packet to that client, remembered as plain before, is reverse-translated; a
/// frontend the agent writes at a remembered destination is translated from the next packet.
#[test]
fn a_tuple_remembered_as_plain_is_judged_again_once_an_endpoint_or_frontend_appears() {
    let loaded = load("plain", &services_yaml(&["10.0.0.1"], false));
    let (ingress, egress) =
        (loaded.datapath.program_fd(Hook::Ingress).unwrap(), loaded.datapath.program_fd(Hook::Egress).unwrap());
    kube_router::services::maps::gate::open(&loaded.pin_dir).unwrap();
    let backend = (Ipv4Addr::new(10, 0, 0, 1), 8080);

    // The backend's packet to a client port, before any flow: plain, then from the cache.
    let reply = packet::ipv4(packet::TCP, backend, (CLIENT, 43000), packet::TCP_ACK, b"");
    assert_eq!(run(egress, &reply, 1).unwrap().packet, reply);
    let hits = plain_hits(&loaded.pin_dir);
    assert_eq!(run(egress, &reply, 1).unwrap().packet, reply);
    assert_eq!(plain_hits(&loaded.pin_dir), hits + 1, "remembered");
    // The client opens a flow through the Service from that port: the backend is recorded.
    let syn = packet::ipv4(packet::TCP, (CLIENT, 43000), (VIP, 80), packet::TCP_SYN, b"");
    assert_eq!(packet::endpoints(&run(ingress, &syn, 1).unwrap().packet).1, backend);
    assert_eq!(
        packet::endpoints(&run(egress, &reply, 1).unwrap().packet),
        ((VIP, 80), (CLIENT, 43000)),
        "the reply is the flow's now"
    );

    // A destination that is no frontend yet: plain at ingress, then from the cache.
    let other_vip = Ipv4Addr::new(10, 96, 0, 20);
    let to_other = packet::ipv4(packet::TCP, (CLIENT, 42000), (other_vip, 80), packet::TCP_SYN, b"");
    assert_eq!(run(ingress, &to_other, 1).unwrap().packet, to_other);
    let hits = plain_hits(&loaded.pin_dir);
    assert_eq!(run(ingress, &to_other, 1).unwrap().packet, to_other);
    assert_eq!(plain_hits(&loaded.pin_dir), hits + 2, "the source check's and the tuple's verdicts");
    program(&loaded.pin_dir, &services_yaml(&["10.0.0.1"], false).replace("10.96.0.10", "10.96.0.20"));
    assert_eq!(packet::endpoints(&run(ingress, &to_other, 1).unwrap().packet).1, backend, "a frontend now");
}

/// A generation the agent cannot change (here a `plain_gen` frozen, `BPF_MAP_FREEZE`: read-only
/// for system calls) is counted at every failed change, for `kube_router_plain_cache_total`'s
/// `generation_write_failed`; one it can change is not.
#[test]
fn a_failed_change_of_the_plain_generation_is_counted_every_time() {
    use kube_router::pinned::plain::{failed_writes, PlainGeneration};
    use kube_router_common::plain_map_names::PLAIN_GENERATION;
    let pin_dir = PathBuf::from("/sys/fs/bpf/krt-unit-plain-gen");
    let _ = datapath::remove_all(&pin_dir);
    let pin = kube_router::pinned::pinned_map(&pin_dir, PLAIN_GENERATION);
    std::fs::create_dir_all(pin.parent().unwrap()).unwrap();
    let bpftool = |args: &[&str]| {
        let status = std::process::Command::new("bpftool").args(args).status().expect("bpftool");
        assert!(status.success(), "bpftool {args:?}");
    };
    let path = pin.to_str().unwrap();
    let create = || {
        let _ = std::fs::remove_file(&pin);
        bpftool(&[
            "map",
            "create",
            path,
            "type",
            "array",
            "key",
            "4",
            "value",
            "8",
            "entries",
            "1",
            "name",
            PLAIN_GENERATION,
        ]);
    };
    create();
    bpftool(&["map", "freeze", "pinned", path]);
    let before = failed_writes();
    let mut generation = PlainGeneration::open(&pin_dir);
    generation.forget_all();
    generation.forget_all();
    kube_router::pinned::plain::forget_all(&pin_dir);
    assert_eq!(failed_writes() - before, 3, "every failed change is counted");
    create();
    let before = failed_writes();
    kube_router::pinned::plain::forget_all(&pin_dir);
    assert_eq!(failed_writes(), before, "a change that succeeds is not");
    let _ = std::fs::remove_dir_all(&pin_dir);
}

/// A pinned map of the right type, key, value and size but created with other flags (here a
/// preallocated `svc_stats_v4`, which the object creates with `BPF_F_NO_PREALLOC`) is a layout
/// mismatch: the agent refuses to load over it instead of adopting a map that behaves otherwise.
#[test]
fn a_pinned_map_with_other_creation_flags_is_refused() {
    use kube_router::bpf::layout::{self, SERVICE_MAPS};
    let pin_dir = PathBuf::from("/sys/fs/bpf/krt-unit-flags");
    let _ = datapath::remove_all(&pin_dir);
    let spec = SERVICE_MAPS.iter().find(|s| s.name == "svc_stats_v4").expect("svc_stats_v4 spec");
    assert_eq!(spec.map_flags, layout::BPF_F_NO_PREALLOC);
    let pin = kube_router::pinned::pinned_map(&pin_dir, spec.name);
    std::fs::create_dir_all(pin.parent().unwrap()).unwrap();
    let create = |flags: u32| {
        let _ = std::fs::remove_file(&pin);
        let status = std::process::Command::new("bpftool")
            .args(["map", "create", pin.to_str().unwrap(), "type", "percpu_hash"])
            .args(["key", &spec.key_size.to_string(), "value", &spec.value_size.to_string()])
            .args(["entries", &spec.max_entries.to_string(), "name", spec.name, "flags", &flags.to_string()])
            .status()
            .expect("bpftool");
        assert!(status.success(), "bpftool map create");
    };
    create(0);
    let refused = layout::check_pinned(&pin_dir, None).expect_err("a preallocated svc_stats_v4 must be refused");
    assert!(refused.found.ends_with("flags=0x0") && refused.expected.ends_with("flags=0x1"), "{refused}");
    create(layout::BPF_F_NO_PREALLOC);
    assert_eq!(layout::check_pinned(&pin_dir, None).expect("the object's own flags").adopted, 1);
    let _ = std::fs::remove_dir_all(&pin_dir);
}

/// The service maps written in batches hold what the same writes one by one leave, counted
/// alike, down to maps that run out of room halfway through a batch (sized for 16 frontends:
/// 64 backends and slots).
#[test]
fn batched_service_map_writes_leave_what_writes_one_by_one_leave() {
    use kube_router::{
        bpf::layout::MapSizes,
        pinned::batch::{update_batch, BatchWrite},
        services::diff::MapOp,
    };
    use kube_router_common::{BackendSlotKey, BackendSlotValue, BackendV4, ServiceKeyV4, ServiceValue};
    let ops = || -> Vec<MapOp> {
        let backend = |id: u32| {
            MapOp::PutBackend(id, BackendV4 { addr: (0x0a00_0000 + id).to_be(), port: 8080u16.to_be(), flags: 0 })
        };
        let slot = |id: u32| {
            MapOp::PutSlot(BackendSlotKey { service_id: id / 4, slot: id % 4 }, BackendSlotValue { backend_id: id })
        };
        let service = |id: u32| {
            let key = ServiceKeyV4 { addr: (0x0a60_0000 + id).to_be(), port: 80u16.to_be(), proto: 6, pad: 0 };
            MapOp::PutService(
                key,
                ServiceValue { service_id: id, backend_count: 4, flags: 0, affinity_timeout_secs: 0 },
            )
        };
        // 70 backends and slots (6 past the room), 20 frontends (4 past it), then an update of
        // an existing backend and more of each.
        let mut ops: Vec<MapOp> = (1..=70).map(backend).collect();
        ops.extend((0..70).map(slot));
        ops.extend((1..=20).map(service));
        ops.extend([backend(3), slot(200), service(1)]);
        ops
    };
    let sizes = MapSizes { lb_frontends: 16, ..Default::default() };
    let mut written = Vec::new();
    for batches in [false, true] {
        let pin_dir = PathBuf::from(format!("/sys/fs/bpf/krt-unit-batch-{batches}"));
        let _ = datapath::remove_all(&pin_dir);
        let datapath = Datapath::load_sized(&pin_dir, datapath::AttachMode::detect(), Some(sizes)).unwrap();
        let mut maps = BpfServiceMaps::open_pinned(&pin_dir).unwrap().with_batches(batches);
        let mut sync = ServiceSync::adopt(&maps).unwrap();
        let report = sync.write(&mut maps, ops());
        let contents = kube_router::agent::read_programmed(&pin_dir).unwrap();
        assert_eq!(&contents, sync.programmed(), "the model follows the maps (batches: {batches})");
        written.push((report.per_map, contents));
        drop(datapath);
        let _ = datapath::remove_all(&pin_dir);
    }
    let (single, batched) = (&written[0], &written[1]);
    assert_eq!(batched, single);
    let backends = &single.0[kube_router_common::map_names::BACKENDS];
    assert_eq!((backends.inserts, backends.updates, backends.errors, backends.full), (64, 1, 6, 6));
    assert_eq!(single.1.services.len(), 16);

    // The kernel's own answer to a batch past the room: how many it wrote, and why it stopped.
    let pin_dir = PathBuf::from("/sys/fs/bpf/krt-unit-batch-raw");
    let _ = datapath::remove_all(&pin_dir);
    let datapath = Datapath::load_sized(&pin_dir, datapath::AttachMode::detect(), Some(sizes)).unwrap();
    let map = kube_router::pinned::open_pinned(&pin_dir, kube_router_common::map_names::BACKENDS).unwrap();
    let keys: Vec<u32> = (1..=70).collect();
    let values = vec![BackendV4 { addr: 1, port: 2, flags: 0 }; 70];
    match update_batch(&map, &keys, &values) {
        BatchWrite::Written { done, error } => {
            assert_eq!(done, 64);
            assert_eq!(error.and_then(|e| e.raw_os_error()), Some(libc::E2BIG));
        }
        BatchWrite::Unsupported => panic!("this kernel has BPF_MAP_UPDATE_BATCH (5.6+)"),
    }
    drop(datapath);
    let _ = datapath::remove_all(&pin_dir);
}

/// A tap device (in the calling thread's network namespace, `netns`, up) whose written frames arrive
/// with only their first written segment in the skb's linear part, the others in page fragments
/// (`IFF_NAPI_FRAGS`), and with GRO off, which would pull the headers of a TCP packet into the
/// linear part. BPF_PROG_TEST_RUN cannot make such an skb: it always builds a linear one.
fn fragmented_tap(netns: &str, name: &str) -> std::fs::File {
    use std::os::fd::AsRawFd;
    let tun = std::fs::OpenOptions::new().read(true).write(true).open("/dev/net/tun").expect("/dev/net/tun");
    // struct ifreq: the name, then the flags (TUNSETIFF) or a data pointer (SIOCETHTOOL).
    #[repr(C)]
    struct IfReq {
        name: [u8; libc::IFNAMSIZ],
        union: [u64; 3],
    }
    let mut request = IfReq { name: [0; libc::IFNAMSIZ], union: [0; 3] };
    request.name[..name.len()].copy_from_slice(name.as_bytes());
    let flags = (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_NAPI | libc::IFF_NAPI_FRAGS) as u16;
    request.union[0] = u64::from(flags);
    // SAFETY: TUNSETIFF reads and writes the ifreq we pass, valid for the call.
    assert_eq!(unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETIFF, &mut request) }, 0, "TUNSETIFF");
    // ETHTOOL_SGRO with `struct ethtool_value { cmd, data }`: GRO off.
    const ETHTOOL_SGRO: u32 = 0x2c;
    let mut gro_off = [ETHTOOL_SGRO, 0u32];
    request.union = [gro_off.as_mut_ptr() as u64, 0, 0];
    // SAFETY: a plain datagram socket for the ioctl, closed below.
    let socket = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM, 0) };
    assert!(socket >= 0, "socket");
    // SAFETY: SIOCETHTOOL reads the ifreq and the ethtool_value it points at, both alive here.
    let turned_off = unsafe { libc::ioctl(socket, libc::SIOCETHTOOL, &mut request) };
    // SAFETY: our own descriptor.
    unsafe { libc::close(socket) };
    assert_eq!(turned_off, 0, "GRO off on {name}: {}", std::io::Error::last_os_error());
    let up = std::process::Command::new("ip").args(["-n", netns, "link", "set", name, "up"]).status().unwrap();
    assert!(up.success(), "ip link set {name} up");
    tun
}

/// Writes `frame` to the tap as two segments: its first `linear` bytes, then the rest.
fn write_split(tap: &std::fs::File, frame: &[u8], linear: usize) {
    use std::os::fd::AsRawFd;
    let (head, rest) = frame.split_at(linear);
    let segments = [
        libc::iovec { iov_base: head.as_ptr() as *mut _, iov_len: head.len() },
        libc::iovec { iov_base: rest.as_ptr() as *mut _, iov_len: rest.len() },
    ];
    // SAFETY: both segments point into `frame`, alive for the call; the kernel only reads them.
    let written = unsafe { libc::writev(tap.as_raw_fd(), segments.as_ptr(), 2) };
    assert_eq!(written, frame.len() as isize, "writev: {}", std::io::Error::last_os_error());
}

/// The load balancer reads a packet's headers in place where they are in the skb's linear part,
/// and through `bpf_skb_load_bytes` where they are not: a Service packet whose IP and TCP
/// headers sit in a page fragment (only the Ethernet header is linear) is translated like one
/// whose headers are linear.
#[test]
fn headers_outside_the_linear_part_are_read_through_the_helper() {
    let mut loaded = load("nonlinear", &services_yaml(&["10.0.0.1"], false));
    let node = common::test_run::NodeNetns::enter("krt-unit-frags", &[]).expect("netns");
    let tap = fragmented_tap(node.name(), "frags0");
    loaded.datapath.attach("frags0").expect("attach the load balancer to the tap");
    let new_flows = || read_lb_stats(&loaded.pin_dir).unwrap()[lb_stat::NEW_FLOW as usize];
    let translated_to_backend = |port: u16| {
        let key = packet::ct_key_v4(packet::TCP, (CLIENT, port), (VIP, 80));
        Conntrack::open_pinned(&loaded.pin_dir).unwrap().entries().unwrap().iter().any(|(k, v)| {
            *k == key
                && v.nat_dst_addr == kube_router::services::compile::addr_be(Ipv4Addr::new(10, 0, 0, 1))
                && v.nat_dst_port == 8080u16.to_be()
        })
    };
    let wait_for = |what: &str, done: &dyn Fn() -> bool| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !done() {
            assert!(std::time::Instant::now() < deadline, "{what}");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    };
    // Only the Ethernet header linear: the direct read fails at the IP header.
    let syn = packet::ipv4(packet::TCP, (CLIENT, 42000), (VIP, 80), packet::TCP_SYN, b"payload");
    write_split(&tap, &syn, 14);
    wait_for("the non-linear SYN opened its flow", &|| new_flows() == 1 && translated_to_backend(42000));
    // Headers linear, payload in a fragment: the common case, read in place.
    let syn = packet::ipv4(packet::TCP, (CLIENT, 42001), (VIP, 80), packet::TCP_SYN, b"payload");
    write_split(&tap, &syn, 14 + 20 + 20);
    wait_for("the linear SYN opened its flow", &|| new_flows() == 2 && translated_to_backend(42001));
    drop(tap);
    drop(node);
}
