//! The BPF-map flattening: layout, LPM except handling and id stability.

use serde_json::json;

use super::fixtures::{ip, policy, Cluster};
use crate::policy::flatten::{
    port_prefixes, union_prefixes, MapFlattener, PeerPrefixKey, PodSlotKey, PortPrefix, PrefixVerdict,
};
use crate::policy::{allows, Direction, PolicyCompiler, Protocol};

#[test]
fn except_entries_become_deny_prefixes() {
    let cluster = Cluster::xyz();
    let out = cluster.compile(&[policy(
        "x",
        "block",
        json!({"podSelector": {}, "ingress": [{"from": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}}]}]}),
    )]);
    let maps = MapFlattener::new().flatten(&out.model);
    let verdicts: Vec<_> = maps.peer_prefixes.iter().map(|(k, v)| (k.prefix.to_string(), *v)).collect();
    assert_eq!(
        verdicts,
        vec![("10.0.0.0/8".to_string(), PrefixVerdict::Allow), ("10.1.0.0/16".to_string(), PrefixVerdict::Deny)]
    );
    let peer_set = maps.peer_prefixes.keys().next().map(|k| k.peer_set).expect("one peer set");
    assert!(maps.peer_set_contains(peer_set, ip("10.2.3.4")));
    assert!(!maps.peer_set_contains(peer_set, ip("10.1.3.4")));
    assert!(!maps.peer_set_contains(peer_set, ip("11.0.0.1")));
}

#[test]
fn identical_rule_lists_share_a_slot_and_only_isolated_directions_get_entries() {
    let cluster = Cluster::xyz();
    let out = cluster.compile(&[policy("x", "deny", json!({"podSelector": {}}))]);
    let maps = MapFlattener::new().flatten(&out.model);
    assert_eq!(maps.pod_slots.len(), 3, "only x's ingress is isolated");
    let slots: std::collections::BTreeSet<_> = maps.pod_slots.values().copied().collect();
    assert_eq!(slots.len(), 1);
    assert_eq!(slots.iter().next().map(|s| s.rule_count), Some(0));
    assert!(maps.slot_ports.is_empty(), "default deny: no port admits anything");
    assert!(maps.pod_slots.contains_key(&PodSlotKey { pod_ip: ip("10.0.1.1"), direction: Direction::Ingress }));
}

#[test]
fn long_port_lists_are_indexed_without_loss() {
    let cluster = Cluster::xyz();
    let ports: Vec<_> = (1000..1017).map(|p| json!({"port": p})).collect();
    let out = cluster.compile(&[policy("x", "many-ports", json!({"podSelector": {}, "ingress": [{"ports": ports}]}))]);
    let maps = MapFlattener::new().flatten(&out.model);
    let slot = maps.pod_slots[&PodSlotKey { pod_ip: ip("10.0.1.1"), direction: Direction::Ingress }];
    assert_eq!(slot.rule_count, 1);
    for port in 995..1022 {
        assert_eq!(
            maps.allows(ip("10.0.2.1"), ip("10.0.1.1"), Protocol::Tcp, port),
            allows(&out.model, ip("10.0.2.1"), ip("10.0.1.1"), Protocol::Tcp, port),
            "port {port}"
        );
    }
}

/// The shapes that hit layout 2's 64-rule limit (and were denied everything): many one-peer
/// policies, one rule with many ipBlock peers, many peers times many port ranges.
#[test]
fn there_is_no_rule_limit() {
    let cluster = Cluster::xyz();
    let one_peer_policies: Vec<_> = (0..65)
        .map(|i| {
            let from = json!([{"ipBlock": {"cidr": format!("192.168.{i}.0/24")}}]);
            policy("x", &format!("p{i}"), json!({"podSelector": {}, "ingress": [{"from": from}]}))
        })
        .collect();
    let many_blocks: Vec<_> = (0..70).map(|i| json!({"ipBlock": {"cidr": format!("172.16.{i}.0/24")}})).collect();
    let peers: Vec<_> = (0..33).map(|i| json!({"ipBlock": {"cidr": format!("198.18.{i}.0/24")}})).collect();
    let ports: Vec<_> = (0..9).map(|i| json!({"port": 8000 + 10 * i, "endPort": 8005 + 10 * i})).collect();
    let cases = [
        ("65 one-peer policies", one_peer_policies),
        (
            "one rule of 70 ipBlocks",
            vec![policy("x", "blocks", json!({"podSelector": {}, "ingress": [{"from": many_blocks}]}))],
        ),
        (
            "33 peers x 9 port ranges",
            vec![policy("x", "grid", json!({"podSelector": {}, "ingress": [{"from": peers, "ports": ports}]}))],
        ),
    ];
    let pod = ip("10.0.1.1");
    for (name, policies) in cases {
        let out = cluster.compile(&policies);
        let maps = MapFlattener::new().flatten(&out.model);
        let mut admitted = 0;
        for peer in
            ["192.168.0.9", "192.168.64.9", "192.168.65.9", "172.16.69.1", "172.16.70.1", "198.18.32.7", "198.18.33.7"]
        {
            for port in [80, 8000, 8005, 8006, 8080, 8085, 8086] {
                let expected = allows(&out.model, ip(peer), pod, Protocol::Tcp, port);
                assert_eq!(maps.allows(ip(peer), pod, Protocol::Tcp, port), expected, "{name}: {peer}:{port}");
                admitted += usize::from(expected);
            }
        }
        assert!(admitted > 0, "{name}: the policies admit someone");
    }
}

#[test]
fn port_ranges_become_the_fewest_aligned_prefixes() {
    let cover = |start, end| port_prefixes(Protocol::Tcp, start, end);
    assert_eq!(cover(80, 80), [PortPrefix::Ports { protocol: Protocol::Tcp, start: 80, bits: 16 }]);
    assert_eq!(cover(0, 65535), [PortPrefix::Ports { protocol: Protocol::Tcp, start: 0, bits: 0 }]);
    assert_eq!(cover(1, 65535).len(), 16);
    for (start, end) in [(0, 0), (1, 1), (3, 17), (1000, 1016), (8000, 8005), (1024, 65535), (65535, 65535), (0, 65534)]
    {
        let prefixes = cover(start, end);
        let covered: Vec<u32> =
            (0..=65535u32).filter(|p| prefixes.iter().any(|x| x.contains(Protocol::Tcp, *p as u16))).collect();
        assert_eq!(covered, (u32::from(start)..=u32::from(end)).collect::<Vec<_>>(), "{start}-{end}");
        assert!(prefixes.len() <= 30);
    }
}

#[test]
fn a_union_keeps_each_sets_exceptions_only_where_no_other_set_admits() {
    let set = |entries: &[(&str, PrefixVerdict)]| -> std::collections::BTreeMap<ipnet::IpNet, PrefixVerdict> {
        entries.iter().map(|(net, v)| (net.parse().unwrap(), *v)).collect()
    };
    use PrefixVerdict::{Allow, Deny};
    // 10/8 except 10.1/16, and 10.1/16 except 10.1.2/24: 10.1.2.x is in neither.
    let a = set(&[("10.0.0.0/8", Allow), ("10.1.0.0/16", Deny)]);
    let b = set(&[("10.1.0.0/16", Allow), ("10.1.2.0/24", Deny)]);
    let c = set(&[("10.1.2.7/32", Allow), ("fd00::/8", Allow), ("fd00:1::/32", Deny)]);
    let union = union_prefixes(&[&a, &b, &c]);
    let lpm = |addr: &str| {
        let addr: std::net::IpAddr = addr.parse().unwrap();
        union.iter().filter(|(net, _)| net.contains(&addr)).max_by_key(|(net, _)| net.prefix_len()).map(|(_, v)| *v)
            == Some(Allow)
    };
    for (addr, member) in [
        ("10.9.0.1", true),
        ("10.1.9.1", true),
        ("10.1.2.1", false),
        ("10.1.2.7", true),
        ("11.0.0.1", false),
        ("fd00::1", true),
        ("fd00:1::1", false),
    ] {
        assert_eq!(lpm(addr), member, "{addr}");
    }
}

#[test]
fn ids_are_stable_across_recompiles_and_diffs_are_minimal() {
    let cluster = Cluster::xyz();
    let from_b = policy(
        "x",
        "from-b",
        json!({"podSelector": {}, "ingress": [{"from": [{"podSelector": {"matchLabels": {"pod": "b"}}}]}]}),
    );
    let from_y = policy(
        "x",
        "from-y",
        json!({"podSelector": {"matchLabels": {"pod": "a"}}, "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"ns": "y"}}}]}]}),
    );
    let mut compiler = PolicyCompiler::from_snapshot(&cluster.pods, &cluster.namespaces, &[from_b]);
    let mut flattener = MapFlattener::new();
    let first = flattener.flatten(compiler.model());

    // A label change only changes peer-set prefixes; slots and rules stay put.
    compiler.upsert_pod(&super::fixtures::pod("x", "c", "10.0.1.3", &[("pod", "b")]));
    let second = flattener.flatten(compiler.model());
    let diff = first.diff(&second);
    assert!(diff.pod_slots.is_empty() && diff.slot_ports.is_empty(), "{diff:?}");
    assert_eq!(diff.peer_prefixes.upserts.len(), 1);
    assert!(diff.peer_prefixes.deletes.is_empty());

    // Adding a policy keeps the existing peer set's id.
    let old_id = first.peer_prefixes.keys().next().map(|k| k.peer_set);
    compiler.upsert_policy(&from_y);
    let third = flattener.flatten(compiler.model());
    assert!(third
        .peer_prefixes
        .keys()
        .any(|k| Some(k.peer_set) == old_id && k.prefix == ipnet::IpNet::from(ip("10.0.1.2"))));
    assert_eq!(second.diff(&third).peer_prefixes.deletes.len(), 0);
}

#[test]
fn released_ids_are_not_reused_in_the_same_flatten() {
    let cluster = Cluster::xyz();
    let a = policy("x", "p", json!({"podSelector": {}, "ingress": [{"from": [{"ipBlock": {"cidr": "1.0.0.0/8"}}]}]}));
    let b = policy("x", "p", json!({"podSelector": {}, "ingress": [{"from": [{"ipBlock": {"cidr": "2.0.0.0/8"}}]}]}));
    let c = policy("x", "p", json!({"podSelector": {}, "ingress": [{"from": [{"ipBlock": {"cidr": "3.0.0.0/8"}}]}]}));
    let mut flattener = MapFlattener::new();
    let id_of = |maps: &crate::policy::flatten::MapEntries| {
        maps.peer_prefixes.keys().next().map(|k: &PeerPrefixKey| k.peer_set)
    };
    let first = flattener.flatten(&cluster.compile(&[a]).model);
    let second = flattener.flatten(&cluster.compile(&[b]).model);
    assert_ne!(id_of(&first), id_of(&second), "a just-released id must not be recycled immediately");
    let third = flattener.flatten(&cluster.compile(&[c]).model);
    assert_eq!(id_of(&third), id_of(&first), "recycled one generation later");
}

#[test]
fn a_restarted_flattener_adopts_the_programmed_ids_and_writes_nothing() {
    let cluster = Cluster::xyz();
    let p =
        |cidr: &str| policy("x", "p", json!({"podSelector": {}, "ingress": [{"from": [{"ipBlock": {"cidr": cidr}}]}]}));
    let from_y = policy(
        "x",
        "q",
        json!({"podSelector": {"matchLabels": {"pod": "a"}}, "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"ns": "y"}}}]}]}),
    );
    // A long-running agent: churn moves its ids away from what a fresh flattener would pick.
    let mut live = MapFlattener::new();
    live.flatten(&cluster.compile(&[p("1.0.0.0/8"), from_y.clone()]).model);
    live.flatten(&cluster.compile(&[p("1.0.0.0/8"), p("3.0.0.0/8"), from_y.clone()]).model);
    let model = cluster.compile(&[p("3.0.0.0/8"), from_y.clone()]).model;
    let programmed = live.flatten(&model);
    assert_ne!(
        MapFlattener::new().flatten(&model),
        programmed,
        "the churn must have moved ids for this test to mean anything"
    );

    let mut restarted = MapFlattener::new();
    let adopted = restarted.adopt(&model, &programmed);
    assert!(programmed.diff(&adopted).is_empty(), "{:?}", programmed.diff(&adopted));
    // And it keeps them: the next flattening of the same model writes nothing either.
    assert!(programmed.diff(&restarted.flatten(&model)).is_empty());

    // Content the maps do not have gets ids the maps do not use.
    let mut other = MapFlattener::new();
    let unrelated = other.adopt(&cluster.compile(&[p("5.0.0.0/8")]).model, &programmed);
    let old_ids: std::collections::BTreeSet<_> = programmed.peer_prefixes.keys().map(|k| k.peer_set).collect();
    assert!(unrelated.peer_prefixes.keys().all(|k| !old_ids.contains(&k.peer_set)));
}
