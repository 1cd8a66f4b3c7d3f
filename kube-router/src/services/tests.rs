use std::net::Ipv4Addr;

use kube_router_common::*;
use proptest::prelude::*;

use super::{
    compile::{addr_be, assign_ids, frontend_key, plan, CompileWarning, Limits, MapContents},
    diff::diff,
    model::*,
    source::parse_objects,
    sync::ServiceSync,
};

fn node() -> NodeContext {
    NodeContext { name: "node-a".into(), node_port_addrs: vec![Ipv4Addr::new(192, 0, 2, 1)], ..Default::default() }
}

const OBJECTS: &str = r#"
apiVersion: v1
kind: Service
metadata: {namespace: default, name: web}
spec:
  type: NodePort
  clusterIP: 10.96.0.10
  ports:
  - {name: http, protocol: TCP, port: 80, targetPort: 8080, nodePort: 30080}
  - {name: dns, protocol: UDP, port: 53, targetPort: 5353}
  sessionAffinity: ClientIP
  sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  namespace: default
  name: web-abc
  labels: {kubernetes.io/service-name: web}
addressType: IPv4
ports:
- {name: http, protocol: TCP, port: 8080}
- {name: dns, protocol: UDP, port: 5353}
endpoints:
- addresses: [10.0.0.2]
  conditions: {ready: true}
  nodeName: node-a
- addresses: [10.0.0.1]
  conditions: {ready: true}
  nodeName: node-b
- addresses: [10.0.0.3]
  conditions: {ready: false, serving: true, terminating: true}
"#;

fn compile(text: &str, current: &MapContents) -> MapContents {
    let builder = parse_objects(text).expect("parse");
    assign_ids(&plan(&builder.state, &node(), Limits::default()), current)
}

fn backends_of(contents: &MapContents, key: &ServiceKeyV4) -> Vec<(Ipv4Addr, u16)> {
    let service = contents.services[key];
    (0..service.backend_count)
        .map(|slot| contents.slots[&BackendSlotKey { service_id: service.service_id, slot }].backend_id)
        .map(|id| contents.backends[&id])
        .map(|b| (Ipv4Addr::from(b.addr.to_ne_bytes()), u16::from_be(b.port)))
        .collect()
}

#[test]
fn compiles_cluster_ip_and_node_port_frontends_to_ready_backends() {
    let contents = compile(OBJECTS, &MapContents::default());
    let vip = Ipv4Addr::new(10, 96, 0, 10);
    let http = frontend_key(vip, 80, Protocol::Tcp);
    let dns = frontend_key(vip, 53, Protocol::Udp);
    let node_port = frontend_key(Ipv4Addr::new(192, 0, 2, 1), 30080, Protocol::Tcp);
    assert_eq!(contents.services.len(), 3);
    assert_eq!(
        backends_of(&contents, &http),
        vec![(Ipv4Addr::new(10, 0, 0, 1), 8080), (Ipv4Addr::new(10, 0, 0, 2), 8080)]
    );
    assert_eq!(
        backends_of(&contents, &dns),
        vec![(Ipv4Addr::new(10, 0, 0, 1), 5353), (Ipv4Addr::new(10, 0, 0, 2), 5353)]
    );
    // NodePort shares the ClusterIP's backend set (externalTrafficPolicy: Cluster).
    assert_eq!(contents.services[&node_port].service_id, contents.services[&http].service_id);
    assert_eq!(contents.services[&node_port].flags, SVC_FLAG_AFFINITY | SVC_FLAG_NODEPORT);
    assert_eq!(contents.services[&http].affinity_timeout_secs, 60);
    // Not ready, terminating endpoints are not used while ready ones exist.
    assert!(!contents.backends.values().any(|b| b.addr == addr_be(Ipv4Addr::new(10, 0, 0, 3))));
}

#[test]
fn terminating_endpoints_serve_when_none_is_ready() {
    let text = OBJECTS.replace("conditions: {ready: true}", "conditions: {ready: false}");
    let contents = compile(&text, &MapContents::default());
    let http = frontend_key(Ipv4Addr::new(10, 96, 0, 10), 80, Protocol::Tcp);
    assert_eq!(backends_of(&contents, &http), vec![(Ipv4Addr::new(10, 0, 0, 3), 8080)]);
}

#[test]
fn external_traffic_policy_local_uses_only_this_nodes_endpoints() {
    let text =
        OBJECTS.replace("  sessionAffinity: ClientIP", "  externalTrafficPolicy: Local\n  sessionAffinity: ClientIP");
    let contents = compile(&text, &MapContents::default());
    let node_port = frontend_key(Ipv4Addr::new(192, 0, 2, 1), 30080, Protocol::Tcp);
    let http = frontend_key(Ipv4Addr::new(10, 96, 0, 10), 80, Protocol::Tcp);
    assert_eq!(backends_of(&contents, &node_port), vec![(Ipv4Addr::new(10, 0, 0, 2), 8080)]);
    assert_eq!(backends_of(&contents, &http).len(), 2);
    assert_ne!(contents.services[&node_port].service_id, contents.services[&http].service_id);
    assert_ne!(contents.services[&node_port].flags & SVC_FLAG_LOCAL_ONLY, 0);
}

#[test]
fn loopback_node_ports_add_a_wildcard_frontend_sharing_the_node_ports_backends() {
    let builder = parse_objects(OBJECTS).unwrap();
    let node = NodeContext { loopback_node_ports: true, ..node() };
    let contents = assign_ids(&plan(&builder.state, &node, Limits::default()), &MapContents::default());
    let wildcard = frontend_key(Ipv4Addr::UNSPECIFIED, 30080, Protocol::Tcp);
    let node_port = frontend_key(Ipv4Addr::new(192, 0, 2, 1), 30080, Protocol::Tcp);
    assert_eq!(contents.services.len(), 4, "ClusterIP tcp + udp, NodePort on the node address and 0.0.0.0");
    assert_eq!(contents.services[&wildcard], contents.services[&node_port]);
    // Without the socket load balancer there is no wildcard.
    assert!(!compile(OBJECTS, &MapContents::default()).services.contains_key(&wildcard));

    // A rejected Service keeps its wildcard entry too.
    let bad =
        OBJECTS.replace("protocol: UDP, port: 53, targetPort: 5353", "protocol: SCTP, port: 53, targetPort: 5353");
    let builder = parse_objects(&bad).unwrap();
    let second = assign_ids(&plan(&builder.state, &node, Limits::default()), &contents);
    assert_eq!(second, contents);
}

#[test]
fn recompiling_against_programmed_state_writes_nothing() {
    let first = compile(OBJECTS, &MapContents::default());
    let second = compile(OBJECTS, &first);
    assert_eq!(first, second);
    assert!(diff(&first, &second, true).is_empty());
}

#[test]
fn ids_are_readopted_from_the_maps_not_from_allocation_order() {
    let first = compile(OBJECTS, &MapContents::default());
    // Pretend a previous agent chose other IDs: they must be kept.
    let mut shifted = MapContents::default();
    for (k, mut v) in first.services.clone() {
        v.service_id += 100;
        shifted.services.insert(k, v);
    }
    for (mut k, v) in first.slots.clone() {
        k.service_id += 100;
        shifted.slots.insert(k, BackendSlotValue { backend_id: v.backend_id + 50 });
    }
    for (id, b) in first.backends.clone() {
        shifted.backends.insert(id + 50, b);
    }
    let again = compile(OBJECTS, &shifted);
    assert_eq!(again, shifted);
}

#[test]
fn removing_an_endpoint_rewrites_only_that_service() {
    let first = compile(OBJECTS, &MapContents::default());
    let text = OBJECTS.replace("- addresses: [10.0.0.1]\n  conditions: {ready: true}\n  nodeName: node-b\n", "");
    let second = compile(&text, &first);
    let ops = diff(&first, &second, true);
    let http = frontend_key(Ipv4Addr::new(10, 96, 0, 10), 80, Protocol::Tcp);
    assert_eq!(backends_of(&second, &http), vec![(Ipv4Addr::new(10, 0, 0, 2), 8080)]);
    // Slot 0 rewritten and slot 1 deleted per set; two frontends + nodeport count updated; backends deleted.
    assert!(!ops.is_empty() && ops.len() <= 12, "{ops:?}");
}

#[test]
fn unsupported_protocol_rejects_the_service_and_keeps_what_was_programmed() {
    let first = compile(OBJECTS, &MapContents::default());
    let bad =
        OBJECTS.replace("protocol: UDP, port: 53, targetPort: 5353", "protocol: SCTP, port: 53, targetPort: 5353");
    let builder = parse_objects(&bad).unwrap();
    assert_eq!(builder.problems.len(), 1);
    assert!(builder.problems[0].message.contains("unsupported protocol \"SCTP\""), "{:?}", builder.problems);
    let second = assign_ids(&plan(&builder.state, &node(), Limits::default()), &first);
    assert_eq!(second, first, "a rejected service must leave its map entries untouched");
}

#[test]
fn duplicate_ports_are_rejected() {
    let bad = OBJECTS.replace(
        "{name: dns, protocol: UDP, port: 53, targetPort: 5353}",
        "{name: dns, protocol: TCP, port: 80, targetPort: 5353}",
    );
    let builder = parse_objects(&bad).unwrap();
    assert!(builder.problems[0].message.contains("duplicate port 80"), "{:?}", builder.problems);
    assert!(builder.state.services.is_empty());
}

#[test]
fn invalid_yaml_object_is_reported_not_fatal() {
    let text = format!(
        "{OBJECTS}\n---\napiVersion: v1\nkind: Service\nmetadata: {{namespace: x, name: y}}\nspec: {{ports: 7}}\n"
    );
    let builder = parse_objects(&text).unwrap();
    assert_eq!(builder.problems.len(), 1);
    assert_eq!(builder.state.services.len(), 1);
}

#[test]
fn too_many_endpoints_keeps_the_first_n_by_address_and_counts_the_rest() {
    let builder = parse_objects(OBJECTS).unwrap();
    let plan = plan(&builder.state, &node(), Limits { max_backends_per_service: 1 });
    assert_eq!(plan.dropped_endpoints, 2, "one per backend set (http, dns)");
    assert!(plan.warnings.iter().any(|w| matches!(w, CompileWarning::EndpointsTruncated { kept: 1, dropped: 1, .. })));
    let contents = assign_ids(&plan, &MapContents::default());
    let http = frontend_key(Ipv4Addr::new(10, 96, 0, 10), 80, Protocol::Tcp);
    assert_eq!(backends_of(&contents, &http), vec![(Ipv4Addr::new(10, 0, 0, 1), 8080)]);
}

#[test]
fn a_frontend_claimed_twice_goes_to_the_first_service_by_name() {
    let other = OBJECTS
        .replace("name: web}", "name: web2}")
        .replace("service-name: web}", "service-name: web2}")
        .replace("name: web-abc", "name: web2-abc");
    let text = format!("{OBJECTS}\n---\n{other}");
    let builder = parse_objects(&text).unwrap();
    let plan = plan(&builder.state, &node(), Limits::default());
    assert!(plan
        .warnings
        .iter()
        .any(|w| matches!(w, CompileWarning::FrontendConflict { kept, .. } if kept.name == "web")));
    assert_eq!(plan.frontends.len(), 3);
}

#[test]
fn headless_and_external_name_services_are_not_load_balanced() {
    let text = "apiVersion: v1\nkind: Service\nmetadata: {namespace: a, name: h}\nspec: {clusterIP: None, ports: [{port: 80}]}\n---\napiVersion: v1\nkind: Service\nmetadata: {namespace: a, name: e}\nspec: {type: ExternalName, externalName: example.org}\n";
    let builder = parse_objects(text).unwrap();
    assert!(builder.state.services.is_empty() && builder.problems.is_empty());
}

#[test]
fn sync_counts_writes_and_a_second_sync_writes_nothing() {
    let desired = compile(OBJECTS, &MapContents::default());
    let mut kernel = MapContents::default();
    let mut sync = ServiceSync::adopt(&kernel).unwrap();
    let first = sync.sync(&mut kernel, &desired, true).total();
    assert_eq!(first.inserts as usize, desired.len());
    assert_eq!(kernel, desired);
    let second = sync.sync(&mut kernel, &desired, true).total();
    assert_eq!(second.writes(), 0);
}

#[test]
fn without_deletes_allowed_nothing_is_removed() {
    let desired = compile(OBJECTS, &MapContents::default());
    let ops = diff(&desired, &MapContents::default(), false);
    assert!(ops.is_empty());
}

fn arb_contents() -> impl Strategy<Value = MapContents> {
    let service = (0u32..8, 0u16..4, 1u32..6, 0u32..4, 0u32..3).prop_map(|(addr, port, id, count, flags)| {
        (
            ServiceKeyV4 { addr, port, proto: 6, pad: 0 },
            ServiceValue { service_id: id, backend_count: count, flags, affinity_timeout_secs: 0 },
        )
    });
    let slot = (1u32..6, 0u32..4, 1u32..8).prop_map(|(service_id, slot, backend_id)| {
        (BackendSlotKey { service_id, slot }, BackendSlotValue { backend_id })
    });
    let backend = (1u32..8, 0u32..4, 0u16..3).prop_map(|(id, addr, port)| (id, BackendV4 { addr, port, pad: 0 }));
    (
        proptest::collection::btree_map(
            service.prop_map(|(k, _)| k),
            any::<u32>().prop_map(|id| ServiceValue {
                service_id: id % 5,
                backend_count: id % 3,
                flags: 0,
                affinity_timeout_secs: 0,
            }),
            0..10,
        ),
        proptest::collection::vec(slot, 0..10),
        proptest::collection::vec(backend, 0..10),
    )
        .prop_map(|(services, slots, backends)| MapContents {
            services,
            slots: slots.into_iter().collect(),
            backends: backends.into_iter().collect(),
        })
}

proptest! {
    #[test]
    fn applying_the_diff_yields_the_target(a in arb_contents(), b in arb_contents()) {
        let mut state = a.clone();
        for op in diff(&a, &b, true) {
            state.apply(&op);
        }
        prop_assert_eq!(state, b);
    }

    #[test]
    fn diff_of_equal_states_is_empty(a in arb_contents()) {
        prop_assert!(diff(&a, &a, true).is_empty());
    }
}
