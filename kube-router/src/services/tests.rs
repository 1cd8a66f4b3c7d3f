use std::net::{Ipv4Addr, Ipv6Addr};

use kube_router_common::*;
use proptest::prelude::*;

use super::{
    compile::{addr_be, assign_ids, frontend_key, key_of, plan, plan_for, CompileWarning, Limits, MapContents},
    diff::diff,
    family::{AddressFamily, V4, V6},
    model::*,
    source::parse_objects,
    sync::ServiceSync,
};

fn node() -> NodeContext {
    NodeContext {
        name: "node-a".into(),
        node_port_addrs: vec![Ipv4Addr::new(192, 0, 2, 1).into()],
        hairpin_all: false,
        ..Default::default()
    }
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
    assert_eq!(contents.services[&node_port].flags, SVC_FLAG_AFFINITY | SVC_FLAG_EXTERNAL | SVC_FLAG_NODEPORT);
    assert_eq!(contents.services[&http].flags, SVC_FLAG_AFFINITY, "a ClusterIP is not a north-south frontend");
    // Endpoints on this node are marked: their flows need no source NAT to come back.
    let local: Vec<(Ipv4Addr, bool)> = contents
        .backends
        .values()
        .map(|b| (Ipv4Addr::from(b.addr.to_ne_bytes()), b.flags & BACKEND_FLAG_LOCAL != 0))
        .collect();
    assert!(
        local.contains(&(Ipv4Addr::new(10, 0, 0, 2), true)) && local.contains(&(Ipv4Addr::new(10, 0, 0, 1), false))
    );
    assert_eq!(contents.services[&http].affinity_timeout_secs, 60);
    // Not ready, terminating endpoints are not used while ready ones exist.
    assert!(!contents.backends.values().any(|b| b.addr == addr_be(Ipv4Addr::new(10, 0, 0, 3))));
}

#[test]
fn hairpin_follows_the_flag_and_the_annotation() {
    let http = frontend_key(Ipv4Addr::new(10, 96, 0, 10), 80, Protocol::Tcp);
    let flags = |text: &str, hairpin_all: bool| {
        let builder = parse_objects(text).expect("parse");
        let node = NodeContext { hairpin_all, ..node() };
        assign_ids(&plan(&builder.state, &node, Limits::default()), &MapContents::default()).services[&http].flags
    };
    assert_eq!(flags(OBJECTS, false) & SVC_FLAG_HAIRPIN, 0);
    assert_ne!(flags(OBJECTS, true) & SVC_FLAG_HAIRPIN, 0);
    let annotated =
        OBJECTS.replacen("name: web}", "name: web, annotations: {kube-router.io/service.hairpin: \"\"}}", 1);
    assert_ne!(annotated, OBJECTS);
    assert_ne!(flags(&annotated, false) & SVC_FLAG_HAIRPIN, 0);
}

/// The annotations as upstream's: `service.hairpin` covers the ClusterIP and the NodePorts;
/// the externalIPs and LoadBalancer IPs also with `service.hairpin.externalips`. `--hairpin-mode`
/// covers every frontend.
#[test]
fn hairpin_externalips_extends_the_annotation_to_the_external_addresses() {
    let cluster_ip = frontend_key(Ipv4Addr::new(10, 96, 0, 10), 80, Protocol::Tcp);
    let external_ip = frontend_key(Ipv4Addr::new(203, 0, 113, 7), 80, Protocol::Tcp);
    let lb_ip = frontend_key(Ipv4Addr::new(198, 51, 100, 9), 80, Protocol::Tcp);
    let node_port = frontend_key(Ipv4Addr::new(192, 0, 2, 1), 30080, Protocol::Tcp);
    let hairpinned = |annotations: &str, hairpin_all: bool| -> Vec<bool> {
        let text = OBJECTS
            .replacen("name: web}", &format!("name: web, annotations: {{{annotations}}}}}"), 1)
            .replacen("  clusterIP: 10.96.0.10\n", "  clusterIP: 10.96.0.10\n  externalIPs: [203.0.113.7]\n", 1)
            .replacen("---\n", "status: {loadBalancer: {ingress: [{ip: 198.51.100.9}]}}\n---\n", 1);
        let builder = parse_objects(&text).expect("parse");
        let node = NodeContext { hairpin_all, ..node() };
        let contents = assign_ids(&plan(&builder.state, &node, Limits::default()), &MapContents::default());
        [cluster_ip, node_port, external_ip, lb_ip]
            .iter()
            .map(|key| {
                contents.services.get(key).unwrap_or_else(|| panic!("{key:?} in {text}")).flags & SVC_FLAG_HAIRPIN != 0
            })
            .collect()
    };
    let hairpin = r#"kube-router.io/service.hairpin: """#;
    let external_ips = r#"kube-router.io/service.hairpin.externalips: """#;
    assert_eq!(hairpinned("", false), [false, false, false, false]);
    assert_eq!(hairpinned(hairpin, false), [true, true, false, false]);
    assert_eq!(hairpinned(&format!("{hairpin}, {external_ips}"), false), [true, true, true, true]);
    // Without service.hairpin it does nothing (as upstream).
    assert_eq!(hairpinned(external_ips, false), [false, false, false, false]);
    assert_eq!(hairpinned("", true), [true, true, true, true]);
}

#[test]
fn dsr_tunnel_marks_the_external_and_node_port_frontends_and_another_value_is_reported() {
    let with_dsr = |value: &str| {
        OBJECTS.replacen(
            "metadata: {namespace: default, name: web}\nspec:\n  type: NodePort\n  clusterIP: 10.96.0.10\n",
            &format!(
                "metadata: {{namespace: default, name: web, annotations: {{kube-router.io/service.dsr: \"{value}\"}}}}\n\
                 spec:\n  type: NodePort\n  clusterIP: 10.96.0.10\n  externalIPs: [192.0.2.7]\n"
            ),
            1,
        )
    };
    assert_ne!(with_dsr("tunnel"), OBJECTS);
    let flags_of = |text: &str| {
        let builder = parse_objects(text).expect("parse");
        let contents = assign_ids(&plan(&builder.state, &node(), Limits::default()), &MapContents::default());
        let flags = |ip: Ipv4Addr, port: u16| contents.services[&frontend_key(ip, port, Protocol::Tcp)].flags;
        let node_port = contents
            .services
            .iter()
            .find(|(k, _)| k.port == 30080u16.to_be())
            .map(|(_, v)| v.flags)
            .expect("a NodePort frontend");
        let external = flags(Ipv4Addr::new(192, 0, 2, 7), 80);
        let cluster_ip = flags(Ipv4Addr::new(10, 96, 0, 10), 80);
        (external, cluster_ip, node_port, builder.problems)
    };
    let (external, cluster_ip, node_port, problems) = flags_of(&with_dsr("tunnel"));
    assert_ne!(external & SVC_FLAG_DSR, 0, "the ExternalIP is served by DSR");
    assert_eq!(cluster_ip & SVC_FLAG_DSR, 0, "ClusterIPs are not");
    assert_ne!(node_port & SVC_FLAG_DSR, 0, "the NodePort is served by DSR");
    assert!(problems.is_empty(), "{problems:?}");
    // Surrounding blanks are tolerated, as for the scheduler annotation.
    assert_ne!(flags_of(&with_dsr(" tunnel ")).0 & SVC_FLAG_DSR, 0);
    // Any other mode: reported once for the Service, which is served without DSR.
    let (external, _, _, problems) = flags_of(&with_dsr("direct"));
    assert_eq!(external & SVC_FLAG_DSR, 0);
    assert_ne!(external & SVC_FLAG_EXTERNAL, 0, "the ExternalIP is still served");
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(problems[0].partial && problems[0].message.contains("kube-router.io/service.dsr"), "{problems:?}");
    assert!(problems[0].message.contains("\"direct\""), "{problems:?}");
    // No annotation: no DSR, no problem.
    let (external, _, _, problems) = flags_of(&OBJECTS.replacen(
        "  clusterIP: 10.96.0.10\n",
        "  clusterIP: 10.96.0.10\n  externalIPs: [192.0.2.7]\n",
        1,
    ));
    assert_eq!(external & SVC_FLAG_DSR, 0);
    assert!(problems.is_empty());
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

    // A rejected Service (it no longer decodes) keeps its wildcard entry too.
    let bad = OBJECTS.replace("port: 80, targetPort: 8080", "port: \"eighty\", targetPort: 8080");
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
fn a_port_of_an_unsupported_protocol_is_left_out_and_the_other_ports_are_programmed() {
    let text =
        OBJECTS.replace("protocol: UDP, port: 53, targetPort: 5353", "protocol: SCTP, port: 53, targetPort: 5353");
    let builder = parse_objects(&text).unwrap();
    assert_eq!(builder.problems.len(), 1);
    assert!(builder.problems[0].partial, "{:?}", builder.problems);
    assert!(builder.problems[0].message.contains("unsupported protocol \"SCTP\""), "{:?}", builder.problems);
    let contents = assign_ids(&plan(&builder.state, &node(), Limits::default()), &MapContents::default());
    let http = frontend_key(Ipv4Addr::new(10, 96, 0, 10), 80, Protocol::Tcp);
    assert_eq!(backends_of(&contents, &http).len(), 2);
    assert!(!contents.services.contains_key(&frontend_key(Ipv4Addr::new(10, 96, 0, 10), 53, Protocol::Udp)));
}

#[test]
fn a_service_that_no_longer_decodes_keeps_everything_programmed_for_it() {
    let first = compile(OBJECTS, &MapContents::default());
    // A port given as a string: not a Service object at all.
    let broken = OBJECTS.replace("port: 80, targetPort: 8080", "port: \"eighty\", targetPort: 8080");
    let builder = parse_objects(&broken).unwrap();
    assert_eq!(builder.problems.len(), 1);
    assert_eq!(builder.problems[0].name, "default/web", "named from its metadata");
    assert!(!builder.problems[0].partial);
    assert_eq!(assign_ids(&plan(&builder.state, &node(), Limits::default()), &first), first);
    // The same for a slice that does not decode: its Service keeps its backends.
    let broken = OBJECTS.replace("port: 8080}", "port: [8080]}");
    let builder = parse_objects(&broken).unwrap();
    assert_eq!(builder.problems[0].name, "default/web-abc");
    assert_eq!(assign_ids(&plan(&builder.state, &node(), Limits::default()), &first), first);
}

/// `yaml`'s documents as kubectl prints them (`-o json`: one indented List), as a bare array,
/// and as a stream of objects.
fn as_json_files(yaml: &str) -> Vec<String> {
    let items: Vec<serde_json::Value> = serde_norway::Deserializer::from_str(yaml)
        .map(|document| serde::Deserialize::deserialize(document).unwrap())
        .filter(|v: &serde_json::Value| !v.is_null())
        .collect();
    let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "metadata": {}, "items": items});
    let stream: Vec<String> = items.iter().map(|i| serde_json::to_string(i).unwrap()).collect();
    vec![serde_json::to_string_pretty(&list).unwrap(), serde_json::to_string(&items).unwrap(), stream.join("\n")]
}

#[test]
fn a_json_file_gives_the_state_and_problems_of_the_same_objects_in_yaml() {
    let broken_service = OBJECTS.replace("port: 80, targetPort: 8080", "port: \"eighty\", targetPort: 8080");
    let broken_slice = OBJECTS.replace("port: 8080}", "port: [8080]}");
    let partial = OBJECTS.replace("addresses: [10.0.0.2]", "addresses: [10.0.0.299]");
    for yaml in [OBJECTS, DUAL_STACK, &broken_service, &broken_slice, &partial] {
        let from_yaml = parse_objects(yaml).unwrap();
        assert!(!from_yaml.state.services.is_empty() || !from_yaml.state.rejected.is_empty());
        for json in as_json_files(yaml) {
            let from_json = parse_objects(&json).unwrap();
            assert_eq!(from_json.state, from_yaml.state, "{json}");
            assert_eq!(from_json.problems, from_yaml.problems, "{json}");
        }
    }
    // The malformed Service is still named and its programmed state kept from a JSON file.
    let builder = parse_objects(&as_json_files(&broken_service)[0]).unwrap();
    assert_eq!(builder.problems.len(), 1);
    assert_eq!(builder.problems[0].name, "default/web");
    assert!(
        builder.problems[0].message.starts_with("not a valid Service object: invalid type"),
        "{:?}",
        builder.problems
    );
    assert_eq!(builder.state.rejected.len(), 1);
}

#[test]
fn typed_lists_nested_lists_and_stray_values_in_a_json_file_decode_as_in_yaml() {
    let items: Vec<serde_json::Value> =
        serde_norway::Deserializer::from_str(OBJECTS).map(|d| serde::Deserialize::deserialize(d).unwrap()).collect();
    let json = serde_json::json!({"kind": "List", "items": [
        {"kind": "ServiceList", "items": [items[0].clone()]},
        {"kind": "EndpointSliceList", "items": [items[1].clone()]},
        null, "text", [items[0].clone()], {"kind": "ConfigMap", "data": {"kind": "Service"}}, {"kind": 7}
    ]});
    let from_json = parse_objects(&json.to_string()).unwrap();
    let from_yaml = parse_objects(OBJECTS).unwrap();
    assert_eq!(from_json.state, from_yaml.state);
    assert_eq!(from_json.problems, from_yaml.problems);
    // The same text as one YAML document (JSON is YAML) decodes the same.
    let as_yaml = parse_objects(&format!("# a comment first: read as YAML\n{json}")).unwrap();
    assert_eq!(as_yaml.state, from_yaml.state);
}

#[test]
fn a_yaml_flow_mapping_that_looks_like_json_is_read_as_yaml() {
    let text = "{apiVersion: v1, kind: Service, metadata: {namespace: default, name: web}, spec: {clusterIP: 10.96.0.10, ports: [{protocol: TCP, port: 80}]}}\n---\n{kind: ConfigMap}\n";
    let builder = parse_objects(text).unwrap();
    assert_eq!(builder.state.services.len(), 1, "{:?}", builder.problems);
    assert!(builder.problems.is_empty());
}

#[test]
fn one_unreadable_endpoint_address_leaves_the_others_serving() {
    let text = OBJECTS.replace("addresses: [10.0.0.2]", "addresses: [10.0.0.299]");
    let builder = parse_objects(&text).unwrap();
    assert_eq!(builder.problems.len(), 1);
    assert!(builder.problems[0].partial && builder.problems[0].message.contains("10.0.0.299"));
    let contents = assign_ids(&plan(&builder.state, &node(), Limits::default()), &MapContents::default());
    let http = frontend_key(Ipv4Addr::new(10, 96, 0, 10), 80, Protocol::Tcp);
    assert_eq!(backends_of(&contents, &http), vec![(Ipv4Addr::new(10, 0, 0, 1), 8080)]);
}

#[test]
fn legacy_leading_zero_addresses_are_read_as_decimal() {
    let text = OBJECTS
        .replace("clusterIP: 10.96.0.10", "clusterIP: 010.096.000.010")
        .replace("addresses: [10.0.0.2]", "addresses: [\"010.000.000.002\"]");
    let builder = parse_objects(&text).unwrap();
    assert!(builder.problems.is_empty(), "{:?}", builder.problems);
    let contents = assign_ids(&plan(&builder.state, &node(), Limits::default()), &MapContents::default());
    let http = frontend_key(Ipv4Addr::new(10, 96, 0, 10), 80, Protocol::Tcp);
    assert_eq!(backends_of(&contents, &http).len(), 2);
    for bad in ["1.2.3", "1.2.3.4.5", "1.2.3.0256", "a.b.c.d", "1..2.3"] {
        assert!(super::from_k8s::parse_ip(bad).is_err(), "{bad}");
    }
}

#[test]
fn an_endpoint_without_a_serving_condition_is_serving() {
    // Every endpoint terminating, one of them without `serving`: nil means true, so the
    // terminating fallback still has it.
    let text = OBJECTS
        .replace(
            "conditions: {ready: true}\n  nodeName: node-a",
            "conditions: {ready: false, terminating: true}\n  nodeName: node-a",
        )
        .replace(
            "conditions: {ready: true}\n  nodeName: node-b",
            "conditions: {ready: false, serving: false}\n  nodeName: node-b",
        );
    let contents = compile(&text, &MapContents::default());
    let http = frontend_key(Ipv4Addr::new(10, 96, 0, 10), 80, Protocol::Tcp);
    let backends = backends_of(&contents, &http);
    assert!(backends.contains(&(Ipv4Addr::new(10, 0, 0, 2), 8080)), "{backends:?}");
    assert!(!backends.contains(&(Ipv4Addr::new(10, 0, 0, 1), 8080)), "{backends:?}");
}

#[test]
fn services_that_are_not_ours_to_proxy_program_nothing() {
    let cases = [
        // Headless with externalIPs: kube-proxy ignores headless Services entirely.
        OBJECTS.replace("clusterIP: 10.96.0.10", "clusterIP: None\n  externalIPs: [192.0.2.50]"),
        // Handed to another proxy.
        OBJECTS.replace(
            "metadata: {namespace: default, name: web}",
            "metadata: {namespace: default, name: web, labels: {service.kubernetes.io/service-proxy-name: other}}",
        ),
    ];
    for text in cases {
        let builder = parse_objects(&text).unwrap();
        assert!(builder.problems.is_empty(), "{:?}", builder.problems);
        assert!(builder.state.services.is_empty(), "{text}");
    }
}

#[test]
fn a_load_balancer_ip_in_proxy_mode_is_not_short_circuited() {
    let text = OBJECTS.replace(
        "  sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}",
        "  sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}\nstatus: {loadBalancer: {ingress: [{ip: 198.51.100.1, ipMode: Proxy}, {ip: 198.51.100.2, ipMode: VIP}]}}",
    );
    let contents = compile(&text, &MapContents::default());
    assert!(!contents.services.contains_key(&frontend_key(Ipv4Addr::new(198, 51, 100, 1), 80, Protocol::Tcp)));
    assert!(contents.services.contains_key(&frontend_key(Ipv4Addr::new(198, 51, 100, 2), 80, Protocol::Tcp)));
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
        .any(|w| matches!(w, CompileWarning::FrontendConflict { kept, .. } if &*kept.name == "web")));
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
    let first = sync.sync(&mut kernel, desired.clone(), true).total();
    assert_eq!(first.inserts as usize, desired.len());
    assert_eq!(kernel, desired);
    let second = sync.sync(&mut kernel, desired, true).total();
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
    let backend = (1u32..8, 0u32..4, 0u16..3).prop_map(|(id, addr, port)| (id, BackendV4 { addr, port, flags: 0 }));
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
            source_ranges: Default::default(),
            services,
            slots: slots.into_iter().collect(),
            backends: backends.into_iter().collect(),
        })
}

/// Service maps that record every write attempt, with room for `capacity` frontends (`svc_v4`),
/// optionally written in batches (stopping at the first refused write, as the kernel's batch
/// does).
#[derive(Clone, Default)]
struct Recorded {
    inner: MapContents,
    capacity: usize,
    batches: bool,
    log: Vec<super::diff::MapOp>,
}

impl super::sync::ServiceMaps for Recorded {
    fn write(&mut self, op: &super::diff::MapOp) -> Result<(), super::sync::MapWriteError> {
        self.log.push(*op);
        if let super::diff::MapOp::PutService(k, _) = op {
            if !self.inner.services.contains_key(k) && self.inner.services.len() >= self.capacity {
                let message = "E2BIG".into();
                return Err(super::sync::MapWriteError { map: map_names::SERVICES, message, full: true });
            }
        }
        self.inner.apply(op);
        Ok(())
    }
    fn read_all(&self) -> Result<MapContents, super::sync::MapWriteError> {
        Ok(self.inner.clone())
    }
    fn batches(&self, op: &super::diff::MapOp) -> bool {
        self.batches && !op.is_delete()
    }
    fn write_batch(
        &mut self,
        ops: &[super::diff::MapOp],
        _programmed: &MapContents,
    ) -> Option<super::sync::BatchOutcome> {
        for (done, op) in ops.iter().enumerate() {
            if let Err(e) = super::sync::ServiceMaps::write(self, op) {
                return Some(super::sync::BatchOutcome { done, error: Some(e) });
            }
        }
        Some(super::sync::BatchOutcome { done: ops.len(), error: None })
    }
}

proptest! {
    /// A full sync computed and written a slice at a time makes the writes, in the same order,
    /// the counts and the model of one difference written whole, a full map included.
    #[test]
    fn a_sync_in_slices_writes_what_the_whole_difference_writes(
        current in arb_contents(),
        desired in arb_contents(),
        capacity in 0usize..12,
        slice in 1usize..6,
        batches in any::<bool>(),
        allow_deletes in any::<bool>(),
    ) {
        let maps = Recorded { inner: current.clone(), capacity, batches, log: Vec::new() };
        let (mut whole_maps, mut sliced_maps) = (maps.clone(), maps);
        let mut whole = ServiceSync::adopt(&whole_maps).unwrap();
        let mut sliced = ServiceSync::adopt(&sliced_maps).unwrap();
        let ops = diff(whole.programmed(), &desired, allow_deletes);
        let expected = whole.write(&mut whole_maps, ops);
        let report = sliced.sync_in_slices(&mut sliced_maps, desired, allow_deletes, slice);
        prop_assert_eq!(report, expected);
        prop_assert_eq!(&sliced_maps.log, &whole_maps.log);
        prop_assert_eq!(&sliced_maps.inner, &whole_maps.inner);
        prop_assert_eq!(sliced.programmed(), whole.programmed());
    }
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

#[test]
fn external_ips_are_validated_against_the_ranges_and_the_clusters_own_addresses() {
    use crate::services::model::ExternalIpPolicy;
    let text = OBJECTS.replacen(
        "  clusterIP: 10.96.0.10\n",
        "  clusterIP: 10.96.0.10\n  externalIPs: [192.0.2.7, 198.51.100.7, 10.244.0.9]\n",
        1,
    );
    assert_ne!(text, OBJECTS);
    let builder = parse_objects(&text).unwrap();
    let node = NodeContext {
        external_ips: ExternalIpPolicy {
            external_ip_ranges: vec!["192.0.2.0/24".parse().unwrap()],
            forbidden: vec!["10.244.0.0/16".parse().unwrap()],
            ..Default::default()
        },
        ..node()
    };
    let lb_plan = plan(&builder.state, &node, Limits::default());
    let addrs: Vec<u32> = lb_plan.frontends.keys().map(|k| k.addr).collect();
    assert!(addrs.contains(&addr_be(Ipv4Addr::new(192, 0, 2, 7))), "inside the allowed range");
    assert!(!addrs.contains(&addr_be(Ipv4Addr::new(198, 51, 100, 7))), "outside the allowed range");
    assert!(!addrs.contains(&addr_be(Ipv4Addr::new(10, 244, 0, 9))), "inside the pod CIDR");
    assert!(addrs.contains(&addr_be(Ipv4Addr::new(10, 96, 0, 10))), "the rest of the Service is programmed");
    let refused: Vec<&String> = lb_plan
        .warnings
        .iter()
        .filter_map(|w| match w {
            CompileWarning::ExternalIpRefused { refusal, .. } => Some(&refusal.message),
            _ => None,
        })
        .collect();
    assert_eq!(refused.len(), 2, "one warning per refused IP, not per port: {refused:?}");
}

#[test]
fn load_balancer_source_ranges_guard_only_the_load_balancer_ips() {
    let with_status = |extra_spec: &str, annotations: &str| {
        OBJECTS
            .replace("metadata: {namespace: default, name: web}", &format!("metadata: {{namespace: default, name: web{annotations}}}"))
            .replace("  type: NodePort", &format!("  type: LoadBalancer{extra_spec}"))
            .replace(
                "  sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}",
                "  sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}\nstatus: {loadBalancer: {ingress: [{ip: 198.51.100.1}]}}",
            )
    };
    let lb = frontend_key(Ipv4Addr::new(198, 51, 100, 1), 80, Protocol::Tcp);
    let node_port = frontend_key(Ipv4Addr::new(192, 0, 2, 1), 30080, Protocol::Tcp);
    let cluster_ip = frontend_key(Ipv4Addr::new(10, 96, 0, 10), 80, Protocol::Tcp);

    // No ranges: open.
    let open = compile(&with_status("", ""), &MapContents::default());
    assert_eq!(open.services[&lb].flags & SVC_FLAG_SOURCE_RANGES, 0);
    assert!(open.source_ranges.is_empty());

    let spec = "\n  loadBalancerSourceRanges: [192.168.0.0/16, 10.1.2.3/8, \"fd00::/8\"]";
    let guarded = compile(&with_status(spec, ""), &MapContents::default());
    assert_ne!(guarded.services[&lb].flags & SVC_FLAG_SOURCE_RANGES, 0);
    for other in [node_port, cluster_ip] {
        assert_eq!(guarded.services[&other].flags & SVC_FLAG_SOURCE_RANGES, 0, "only LoadBalancer IPs are guarded");
    }
    let id = guarded.services[&lb].service_id;
    let ranges: Vec<(u32, Ipv4Addr, u8)> = guarded
        .source_ranges
        .keys()
        .filter(|r| r.service_id == id)
        .map(|r| (r.service_id, Ipv4Addr::from(r.addr.to_ne_bytes()), r.prefix_len))
        .collect();
    // Host bits cleared, the IPv6 range not in the IPv4 map.
    assert_eq!(ranges, [(id, Ipv4Addr::new(10, 0, 0, 0), 8), (id, Ipv4Addr::new(192, 168, 0, 0), 16)]);

    // The legacy annotation, read when the field is empty.
    let annotation = ", annotations: {service.beta.kubernetes.io/load-balancer-source-ranges: \"203.0.113.0/24\"}";
    let legacy = compile(&with_status("", annotation), &MapContents::default());
    assert_eq!(legacy.source_ranges.len(), 2, "one per port's backend set");

    // Only IPv6 ranges: the IPv4 LoadBalancer IP is closed to every IPv4 source, not opened.
    let closed = compile(&with_status("\n  loadBalancerSourceRanges: [\"fd00::/8\"]", ""), &MapContents::default());
    assert_ne!(closed.services[&lb].flags & SVC_FLAG_SOURCE_RANGES, 0);
    assert!(closed.source_ranges.is_empty());

    // Ranges removed: the flag goes before the entries (writes are ordered by the differ).
    let ops = diff(&guarded, &open, true);
    let put_service = ops.iter().position(|op| matches!(op, super::diff::MapOp::PutService(k, _) if *k == lb));
    let first_delete = ops.iter().position(|op| matches!(op, super::diff::MapOp::DeleteSourceRange(_)));
    assert!(put_service.unwrap() < first_delete.unwrap(), "{ops:?}");
}

#[test]
fn a_full_map_costs_one_failed_write_per_sync_and_keeps_what_it_has() {
    // Three frontends wanted (ClusterIP http + dns, NodePort http), room for two.
    let mut maps = Recorded { capacity: 2, ..Default::default() };
    let mut sync = ServiceSync::adopt(&MapContents::default()).unwrap();
    let desired = compile(OBJECTS, &MapContents::default());
    assert_eq!(desired.services.len(), 3);
    let report = sync.sync(&mut maps, desired.clone(), true);
    assert_eq!(maps.inner.services.len(), 2);
    let svc = report.per_map[map_names::SERVICES];
    assert_eq!((svc.inserts, svc.full), (2, 1));
    // Again with the map still full: one failed attempt, nothing else written.
    maps.log.clear();
    let report = sync.sync(&mut maps, desired.clone(), true);
    assert_eq!((maps.log.len(), report.per_map[map_names::SERVICES].full), (1, 1));
    assert_eq!(maps.inner.services.len(), 2, "what was programmed stays");
}

#[test]
fn when_not_every_frontend_fits_cluster_ips_with_endpoints_come_first() {
    let value = |flags, backend_count| ServiceValue { service_id: 1, backend_count, flags, affinity_timeout_secs: 0 };
    let key = |last: u8| frontend_key(Ipv4Addr::new(10, 96, 0, last), 80, Protocol::Tcp);
    let mut desired = MapContents::default();
    desired.services.insert(key(1), value(SVC_FLAG_EXTERNAL, 2));
    desired.services.insert(key(2), value(SVC_FLAG_NODEPORT, 2));
    desired.services.insert(key(3), value(0, 0));
    desired.services.insert(key(4), value(0, 2));
    desired.services.insert(key(5), value(0, 2));
    // One frontend already programmed (its value changes): it keeps its place before any new one.
    let mut programmed = MapContents::default();
    programmed.services.insert(key(1), value(SVC_FLAG_EXTERNAL, 1));
    let mut maps = Recorded { inner: programmed.clone(), capacity: 4, ..Default::default() };
    let mut sync = ServiceSync::adopt(&programmed).unwrap();
    sync.sync(&mut maps, desired.clone(), true);
    let got: Vec<u8> = maps.inner.services.keys().map(|k| u32::from_be(k.addr).to_be_bytes()[3]).collect();
    assert_eq!(got, [1, 2, 4, 5], "the empty ClusterIP waits; the NodePort got the last room");
    assert_eq!(maps.inner.services[&key(1)], value(SVC_FLAG_EXTERNAL, 2));
    // Room frees (the NodePort goes): the waiting frontend is programmed by the next sync.
    desired.services.remove(&key(2));
    let report = sync.sync(&mut maps, desired.clone(), true);
    let svc = report.per_map[map_names::SERVICES];
    assert_eq!((svc.deletes, svc.full), (1, 1), "inserts come before deletes: one pass still finds it full");
    sync.sync(&mut maps, desired.clone(), true);
    assert!(maps.inner.services.contains_key(&key(3)));
}

#[test]
fn topology_hints_keep_traffic_in_the_node_zone_when_every_endpoint_has_them() {
    let hinted = |a: &str, b: &str| {
        OBJECTS
            .replace(
                "conditions: {ready: true}\n  nodeName: node-a",
                &format!("conditions: {{ready: true}}\n  nodeName: node-a\n  hints: {{forZones: [{{name: {a}}}]}}"),
            )
            .replace(
                "conditions: {ready: true}\n  nodeName: node-b",
                &format!("conditions: {{ready: true}}\n  nodeName: node-b\n  hints: {{forZones: [{{name: {b}}}]}}"),
            )
    };
    let http = frontend_key(Ipv4Addr::new(10, 96, 0, 10), 80, Protocol::Tcp);
    let in_zone = |text: &str, zone: Option<&str>| {
        let builder = parse_objects(text).unwrap();
        let node = NodeContext { zone: zone.map(str::to_string), ..node() };
        let contents = assign_ids(&plan(&builder.state, &node, Limits::default()), &MapContents::default());
        backends_of(&contents, &http).into_iter().map(|(a, _)| a.octets()[3]).collect::<Vec<_>>()
    };
    // 10.0.0.2 hinted for zone-a, 10.0.0.1 for zone-b.
    assert_eq!(in_zone(&hinted("zone-a", "zone-b"), Some("zone-a")), [2]);
    assert_eq!(in_zone(&hinted("zone-a", "zone-b"), Some("zone-b")), [1]);
    // No endpoint for the node's zone, no zone label, or an endpoint without hints: all of them.
    assert_eq!(in_zone(&hinted("zone-a", "zone-b"), Some("zone-c")), [1, 2]);
    assert_eq!(in_zone(&hinted("zone-a", "zone-b"), None), [1, 2]);
    let partial = OBJECTS.replace(
        "conditions: {ready: true}\n  nodeName: node-a",
        "conditions: {ready: true}\n  nodeName: node-a\n  hints: {forZones: [{name: zone-a}]}",
    );
    assert_eq!(in_zone(&partial, Some("zone-a")), [1, 2]);
}

#[test]
fn a_changed_maglev_table_is_written_under_a_new_id_and_swapped_in_one_write() {
    let maglev = |extra_backend: bool| {
        let text = OBJECTS
            .replace(
                "metadata: {namespace: default, name: web}",
                "metadata: {namespace: default, name: web, annotations: {kube-router.io/service.scheduler: mh}}",
            )
            .replace("  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}\n", "");
        if extra_backend {
            text.replace(
                "- addresses: [10.0.0.3]",
                "- addresses: [10.0.0.4]\n  conditions: {ready: true}\n- addresses: [10.0.0.3]",
            )
        } else {
            text
        }
    };
    let http = frontend_key(Ipv4Addr::new(10, 96, 0, 10), 80, Protocol::Tcp);
    let first = compile(&maglev(false), &MapContents::default());
    let table = first.services[&http];
    assert_eq!(table.flags & SVC_FLAG_MAGLEV, SVC_FLAG_MAGLEV);
    assert_eq!(table.flags & SVC_FLAG_MAGLEV_PORT, 0, "mh-port not asked for");
    assert_eq!(table.backend_count, 251, "two backends: the smallest table");
    // Unchanged input: the same ids, nothing to write.
    assert!(diff(&first, &compile(&maglev(false), &first), true).is_empty());

    let second = compile(&maglev(true), &first);
    let moved = second.services[&http];
    assert_ne!(moved.service_id, table.service_id, "a changed table gets a new id");
    let ops = diff(&first, &second, true);
    let position = |wanted: &dyn Fn(&super::diff::MapOp) -> bool| ops.iter().position(wanted);
    use super::diff::MapOp;
    let last_new_slot =
        ops.iter().rposition(|op| matches!(op, MapOp::PutSlot(k, _) if k.service_id == moved.service_id)).unwrap();
    let switch =
        position(&|op| matches!(op, MapOp::PutService(k, v) if *k == http && v.service_id == moved.service_id))
            .unwrap();
    let first_old_delete =
        position(&|op| matches!(op, MapOp::DeleteSlot(k) if k.service_id == table.service_id)).unwrap();
    assert!(last_new_slot < switch && switch < first_old_delete, "{ops:?}");
    assert!(second.slots.keys().all(|k| k.service_id != table.service_id), "the old table is gone");
}

// ---- IPv6 and dual-stack ----

const DUAL_STACK: &str = r#"
apiVersion: v1
kind: Service
metadata: {namespace: default, name: web}
spec:
  type: NodePort
  clusterIP: 10.96.0.10
  clusterIPs: [10.96.0.10, "fd00:96::10"]
  ipFamilies: [IPv4, IPv6]
  ipFamilyPolicy: PreferDualStack
  externalIPs: [192.0.2.50, "2001:db8:50::1"]
  ports:
  - {name: http, protocol: TCP, port: 80, targetPort: 8080, nodePort: 30080}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {namespace: default, name: web-v4, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, protocol: TCP, port: 8080}]
endpoints:
- {addresses: [10.0.0.1], conditions: {ready: true}, nodeName: node-b}
- {addresses: [10.0.0.2], conditions: {ready: true}, nodeName: node-a}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {namespace: default, name: web-v6, labels: {kubernetes.io/service-name: web}}
addressType: IPv6
ports: [{name: http, protocol: TCP, port: 8080}]
endpoints:
- {addresses: ["fd00:244::2"], conditions: {ready: true}, nodeName: node-a}
- {addresses: ["fd00:244::1"], conditions: {ready: true}, nodeName: node-b}
"#;

fn v6(text: &str) -> Ipv6Addr {
    text.parse().unwrap()
}

fn dual_stack_node() -> NodeContext {
    NodeContext { node_port_addrs: vec![Ipv4Addr::new(192, 0, 2, 1).into(), v6("2001:db8::1").into()], ..node() }
}

fn compile_v6(text: &str, node: &NodeContext, current: &MapContents<V6>) -> MapContents<V6> {
    let builder = parse_objects(text).expect("parse");
    assign_ids(&plan_for::<V6>(&builder.state, node, Limits::default()), current)
}

fn backends_of_v6(contents: &MapContents<V6>, key: &ServiceKeyV6) -> Vec<(Ipv6Addr, u16, bool)> {
    let service = contents.services[key];
    (0..service.backend_count)
        .map(|slot| contents.slots[&BackendSlotKey { service_id: service.service_id, slot }].backend_id)
        .map(|id| contents.backends[&id])
        .map(|b| (V6::addr_from_words(b.addr), u16::from_be(b.port), b.flags & BACKEND_FLAG_LOCAL != 0))
        .collect()
}

#[test]
fn a_dual_stack_service_fills_both_families_maps_each_from_its_own_slice() {
    let builder = parse_objects(DUAL_STACK).unwrap();
    assert!(builder.problems.is_empty(), "{:?}", builder.problems);
    let node = dual_stack_node();
    let v4 = assign_ids(&plan_for::<V4>(&builder.state, &node, Limits::default()), &MapContents::default());
    let v6_maps = compile_v6(DUAL_STACK, &node, &MapContents::default());

    let v4_keys: Vec<ServiceKeyV4> = v4.services.keys().copied().collect();
    let mut expected_v4 = vec![
        frontend_key(Ipv4Addr::new(10, 96, 0, 10), 80, Protocol::Tcp),
        frontend_key(Ipv4Addr::new(192, 0, 2, 50), 80, Protocol::Tcp),
        frontend_key(Ipv4Addr::new(192, 0, 2, 1), 30080, Protocol::Tcp),
    ];
    expected_v4.sort();
    assert_eq!(v4_keys, expected_v4);
    assert_eq!(
        backends_of(&v4, &expected_v4[0]),
        vec![(Ipv4Addr::new(10, 0, 0, 1), 8080), (Ipv4Addr::new(10, 0, 0, 2), 8080)]
    );

    let cluster_ip = key_of::<V6>(v6("fd00:96::10"), 80, Protocol::Tcp);
    let external_ip = key_of::<V6>(v6("2001:db8:50::1"), 80, Protocol::Tcp);
    let node_port = key_of::<V6>(v6("2001:db8::1"), 30080, Protocol::Tcp);
    let mut v6_keys: Vec<ServiceKeyV6> = v6_maps.services.keys().copied().collect();
    v6_keys.sort();
    let mut expected_v6 = vec![cluster_ip, external_ip, node_port];
    expected_v6.sort();
    assert_eq!(v6_keys, expected_v6);
    // Only the IPv6 slice's endpoints, ordered by address, the local one flagged.
    let expected_backends = vec![(v6("fd00:244::1"), 8080, false), (v6("fd00:244::2"), 8080, true)];
    assert_eq!(backends_of_v6(&v6_maps, &cluster_ip), expected_backends);
    assert_eq!(backends_of_v6(&v6_maps, &node_port), expected_backends);
    let flags = |key: &ServiceKeyV6| v6_maps.services[key].flags;
    assert_eq!(flags(&cluster_ip) & (SVC_FLAG_NODEPORT | SVC_FLAG_EXTERNAL), 0);
    assert_eq!(flags(&node_port) & (SVC_FLAG_NODEPORT | SVC_FLAG_EXTERNAL), SVC_FLAG_NODEPORT | SVC_FLAG_EXTERNAL);
    assert_eq!(flags(&external_ip) & (SVC_FLAG_NODEPORT | SVC_FLAG_EXTERNAL), SVC_FLAG_EXTERNAL);
    // Each family numbers its own backend sets and backends from 1.
    assert_eq!(v6_maps.services[&cluster_ip].service_id, v4.services[&expected_v4[0]].service_id);
    assert_eq!(v6_maps.backends.keys().copied().collect::<Vec<_>>(), [1, 2]);
}

/// `DUAL_STACK` with its Service `web` annotated `kube-router.io/service.dsr: tunnel`.
fn dual_stack_with_dsr() -> String {
    let annotated = DUAL_STACK.replacen(
        "metadata: {namespace: default, name: web}",
        "metadata: {namespace: default, name: web, annotations: {kube-router.io/service.dsr: tunnel}}",
        1,
    );
    assert_ne!(annotated, DUAL_STACK);
    annotated
}

#[test]
fn dsr_tunnel_marks_the_external_ipv6_frontends_too() {
    let annotated = dual_stack_with_dsr();
    let v6_maps = compile_v6(&annotated, &dual_stack_node(), &MapContents::default());
    let flags = |ip: &str, port: u16| v6_maps.services[&key_of::<V6>(v6(ip), port, Protocol::Tcp)].flags;
    assert_ne!(flags("2001:db8:50::1", 80) & SVC_FLAG_DSR, 0, "the IPv6 ExternalIP is served by DSR");
    assert_eq!(flags("fd00:96::10", 80) & SVC_FLAG_DSR, 0, "ClusterIPs are not");
    assert_ne!(flags("2001:db8::1", 30080) & SVC_FLAG_DSR, 0, "the IPv6 NodePort is served by DSR");
    // Without the annotation: no DSR.
    let plain = compile_v6(DUAL_STACK, &dual_stack_node(), &MapContents::default());
    assert_eq!(plain.services[&key_of::<V6>(v6("2001:db8:50::1"), 80, Protocol::Tcp)].flags & SVC_FLAG_DSR, 0);
}

#[test]
fn ipv6_ids_are_stable_across_recompiles_and_readopted_from_the_maps() {
    let node = dual_stack_node();
    let first = compile_v6(DUAL_STACK, &node, &MapContents::default());
    assert!(diff(&first, &compile_v6(DUAL_STACK, &node, &first), true).is_empty());
    // Programmed by an earlier agent with other ids: kept, nothing rewritten.
    let mut renumbered = MapContents::<V6>::default();
    for (key, value) in &first.services {
        renumbered.services.insert(*key, ServiceValue { service_id: value.service_id + 40, ..*value });
    }
    for (slot, value) in &first.slots {
        let slot = BackendSlotKey { service_id: slot.service_id + 40, ..*slot };
        renumbered.slots.insert(slot, BackendSlotValue { backend_id: value.backend_id + 70 });
    }
    for (id, backend) in &first.backends {
        renumbered.backends.insert(id + 70, *backend);
    }
    let again = compile_v6(DUAL_STACK, &node, &renumbered);
    assert_eq!(again, renumbered);
    assert!(diff(&renumbered, &again, true).is_empty());
    // One endpoint fewer rewrites only the IPv6 set's slots and that backend.
    let fewer =
        DUAL_STACK.replace("- {addresses: [\"fd00:244::1\"], conditions: {ready: true}, nodeName: node-b}\n", "");
    let ops = diff(&first, &compile_v6(&fewer, &node, &first), true);
    assert!(ops.iter().any(|op| matches!(op, super::diff::MapOp::DeleteBackend(_))), "{ops:?}");
    assert!(!ops.iter().any(|op| matches!(op, super::diff::MapOp::DeleteService(_))), "{ops:?}");
}

#[test]
fn ipv6_node_ports_listen_on_the_nodes_ipv6_addresses_and_the_wildcard() {
    let loopback = NodeContext { loopback_node_ports: true, ..dual_stack_node() };
    let contents = compile_v6(DUAL_STACK, &loopback, &MapContents::default());
    let node_ports: Vec<Ipv6Addr> = contents
        .services
        .keys()
        .filter(|k| u16::from_be(k.port) == 30080)
        .map(|k| V6::addr_from_words(k.addr))
        .collect();
    assert_eq!(node_ports.len(), 2, "{node_ports:?}");
    assert!(node_ports.contains(&v6("2001:db8::1")) && node_ports.contains(&Ipv6Addr::UNSPECIFIED));
    // An IPv4-only NodePort address list gives no IPv6 NodePort frontend (the ClusterIP stays).
    let v4_only = NodeContext { node_port_addrs: vec![Ipv4Addr::new(192, 0, 2, 1).into()], ..node() };
    let contents = compile_v6(DUAL_STACK, &v4_only, &MapContents::default());
    assert!(contents.services.keys().all(|k| u16::from_be(k.port) == 80), "{:?}", contents.services);
}

#[test]
fn dsr_tunnel_marks_the_node_ports_of_both_families() {
    let text = dual_stack_with_dsr();
    let node = NodeContext { loopback_node_ports: true, ..dual_stack_node() };
    let compile_v4 = |text: &str| {
        let builder = parse_objects(text).expect("parse");
        assign_ids(&plan_for::<V4>(&builder.state, &node, Limits::default()), &MapContents::default())
    };
    let v4 = compile_v4(&text);
    // The node address and the wildcard the socket load balancer reads.
    for ip in [Ipv4Addr::new(192, 0, 2, 1), Ipv4Addr::UNSPECIFIED] {
        let flags = v4.services[&key_of::<V4>(ip, 30080, Protocol::Tcp)].flags;
        let wanted = SVC_FLAG_NODEPORT | SVC_FLAG_EXTERNAL | SVC_FLAG_DSR;
        assert_eq!(flags & (wanted | SVC_FLAG_LOCAL_ONLY), wanted, "{ip}: {flags:#x}");
    }
    assert_eq!(v4.services[&key_of::<V4>(Ipv4Addr::new(10, 96, 0, 10), 80, Protocol::Tcp)].flags & SVC_FLAG_DSR, 0);
    let v6_contents = compile_v6(&text, &node, &MapContents::default());
    let v6_node_port = v6_contents.services[&key_of::<V6>(v6("2001:db8::1"), 30080, Protocol::Tcp)];
    let wanted = SVC_FLAG_NODEPORT | SVC_FLAG_DSR;
    assert_eq!(v6_node_port.flags & wanted, wanted, "{:#x}", v6_node_port.flags);
    // externalTrafficPolicy: Local: the NodePort serves this node's endpoint alone, so the flag
    // it carries never sends a flow to another node.
    let local = text.replacen("  type: NodePort\n", "  type: NodePort\n  externalTrafficPolicy: Local\n", 1);
    assert_ne!(local, text);
    let node_port = compile_v4(&local).services[&key_of::<V4>(Ipv4Addr::new(192, 0, 2, 1), 30080, Protocol::Tcp)];
    assert_ne!(node_port.flags & SVC_FLAG_LOCAL_ONLY, 0, "{:#x}", node_port.flags);
    assert_eq!(node_port.backend_count, 1, "node-a's endpoint only");
}

#[test]
fn a_malformed_ipv6_endpoint_is_refused_and_the_others_are_programmed() {
    let text = DUAL_STACK.replace("[\"fd00:244::1\"]", "[\"fd00:244::zz\", \"10.0.0.9\"]");
    let builder = parse_objects(&text).unwrap();
    let problems: Vec<&str> = builder.problems.iter().map(|p| p.message.as_str()).collect();
    assert_eq!(builder.problems.len(), 2, "{problems:?}");
    assert!(builder.problems.iter().all(|p| p.partial), "only part of the slice is left out");
    assert!(problems[0].contains("fd00:244::zz") && problems[1].contains("10.0.0.9"), "{problems:?}");
    let node = dual_stack_node();
    let contents = compile_v6(&text, &node, &MapContents::default());
    let cluster_ip = key_of::<V6>(v6("fd00:96::10"), 80, Protocol::Tcp);
    assert_eq!(backends_of_v6(&contents, &cluster_ip), vec![(v6("fd00:244::2"), 8080, true)]);
    // The IPv4 address in the IPv6 slice backs no IPv4 frontend either.
    let v4 = assign_ids(&plan_for::<V4>(&builder.state, &node, Limits::default()), &MapContents::default());
    assert!(!v4.backends.values().any(|b| b.addr == addr_be(Ipv4Addr::new(10, 0, 0, 9))));
}

#[test]
fn an_ipv6_only_service_on_an_ipv4_only_node_is_reported_and_the_ipv4_services_are_unaffected() {
    let text = format!(
        "{OBJECTS}---\n{}",
        DUAL_STACK
            .replace("name: web}", "name: web6}")
            .replace("kubernetes.io/service-name: web}", "kubernetes.io/service-name: web6}")
            .replace("clusterIP: 10.96.0.10\n  clusterIPs: [10.96.0.10, \"fd00:96::10\"]", "clusterIP: \"fd00:96::10\"")
            .replace("ipFamilies: [IPv4, IPv6]", "ipFamilies: [IPv6]")
            .replace("nodePort: 30080", "nodePort: 30081")
    );
    let builder = parse_objects(&text).unwrap();
    let web6 = &builder.state.services[&ServiceName::new("default", "web6")];
    assert_eq!(web6.ip_families, [super::family::IpFamily::IPv6]);
    assert!(web6.external_ips.iter().all(|ip| ip.is_ipv6()), "the IPv4 externalIP is of another family");
    let v4_node = NodeContext { unavailable_families: [super::family::IpFamily::IPv6].into_iter().collect(), ..node() };
    let v6_plan = plan_for::<V6>(&builder.state, &v4_node, Limits::default());
    assert!(v6_plan.frontends.is_empty());
    assert_eq!(
        v6_plan.warnings,
        [CompileWarning::FamilyUnavailable {
            service: ServiceName::new("default", "web6"),
            family: super::family::IpFamily::IPv6
        }]
    );
    // The IPv4 family: exactly the IPv4-only Service's frontends, as without the IPv6 one.
    let v4 = assign_ids(&plan_for::<V4>(&builder.state, &v4_node, Limits::default()), &MapContents::default());
    assert_eq!(v4, compile(OBJECTS, &MapContents::default()));
    // On a dual-stack node the same Service is programmed in IPv6 only.
    let v6_maps = compile_v6(&text, &dual_stack_node(), &MapContents::default());
    assert!(v6_maps.services.contains_key(&key_of::<V6>(v6("fd00:96::10"), 80, Protocol::Tcp)));
    assert!(v6_maps.services.contains_key(&key_of::<V6>(v6("2001:db8::1"), 30081, Protocol::Tcp)));
}

#[test]
fn ipv6_only_services_have_no_ipv4_frontends_nodeports_included() {
    for text in [
        OBJECTS.replace("clusterIP: 10.96.0.10", "clusterIP: fd00::10\n  ipFamilies: [IPv6]"),
        OBJECTS.replace("clusterIP: 10.96.0.10", "clusterIPs: [fd00::10]"),
    ] {
        let builder = parse_objects(&text).unwrap();
        assert!(builder.problems.is_empty(), "{:?}", builder.problems);
        let node = dual_stack_node();
        assert!(plan_for::<V4>(&builder.state, &node, Limits::default()).frontends.is_empty(), "{text}");
        let v6_plan = plan_for::<V6>(&builder.state, &node, Limits::default());
        assert!(v6_plan.frontends.contains_key(&key_of::<V6>(v6("fd00::10"), 80, Protocol::Tcp)), "{text}");
    }
}

#[test]
fn single_stack_policy_keeps_the_first_family_and_ipv6_source_ranges_guard_ipv6_lb_ips() {
    let text = DUAL_STACK.replace("ipFamilyPolicy: PreferDualStack", "ipFamilyPolicy: SingleStack").replace(
        "  externalIPs: [192.0.2.50, \"2001:db8:50::1\"]\n",
        "  loadBalancerSourceRanges: [10.0.0.0/8, \"2001:db8:1::/48\"]\n",
    );
    let builder = parse_objects(&text).unwrap();
    assert_eq!(builder.state.services.values().next().unwrap().ip_families, [super::family::IpFamily::IPv4]);
    assert!(plan_for::<V6>(&builder.state, &dual_stack_node(), Limits::default()).frontends.is_empty());

    let text = DUAL_STACK
        .replace(
            "  externalIPs: [192.0.2.50, \"2001:db8:50::1\"]\n",
            "  loadBalancerSourceRanges: [10.0.0.0/8, \"2001:db8:1::/48\"]\n",
        )
        .replacen(
            "\n---\napiVersion: discovery",
            "\nstatus: {loadBalancer: {ingress: [{ip: \"2001:db8:60::1\"}]}}\n---\napiVersion: discovery",
            1,
        );
    let builder = parse_objects(&text).unwrap();
    let contents = compile_v6(&text, &dual_stack_node(), &MapContents::default());
    let lb = key_of::<V6>(v6("2001:db8:60::1"), 80, Protocol::Tcp);
    let value = contents.services[&lb];
    assert_ne!(value.flags & SVC_FLAG_SOURCE_RANGES, 0);
    let ranges: Vec<(u32, Ipv6Addr, u8)> =
        contents.source_ranges.keys().map(|r| (r.service_id, V6::addr_from_words(r.addr), r.prefix_len)).collect();
    assert_eq!(ranges, [(value.service_id, v6("2001:db8:1::"), 48)]);
    let v4 =
        assign_ids(&plan_for::<V4>(&builder.state, &dual_stack_node(), Limits::default()), &MapContents::default());
    assert!(v4.source_ranges.is_empty(), "the IPv6 LB IP is not an IPv4 frontend");
}

#[test]
fn a_model_written_before_dual_stack_still_reads_as_ipv4() {
    // The model's JSON as an IPv4-only agent wrote it (no ipFamilies, IPv4 address strings).
    let old = r#"{"name":{"namespace":"default","name":"web"},"cluster_ips":["10.96.0.10"],
        "external_ips":[],"load_balancer_ips":["198.51.100.1"],"ports":[{"name":"http","protocol":"Tcp",
        "port":80,"node_port":30080}],"affinity_timeout_secs":null,"external_traffic_local":false,
        "internal_traffic_local":false,"publish_not_ready":false,"source_ranges":["10.0.0.0/8"]}"#;
    let service: Service = serde_json::from_str(old).unwrap();
    assert_eq!(service.cluster_ips, [std::net::IpAddr::from(Ipv4Addr::new(10, 96, 0, 10))]);
    assert!(service.serves(super::family::IpFamily::IPv4) && !service.serves(super::family::IpFamily::IPv6));
    assert_eq!(service.source_ranges, Some(vec!["10.0.0.0/8".parse().unwrap()]));
    let endpoint: Endpoint = serde_json::from_str(
        r#"{"addr":"10.0.0.1","ready":true,"serving":true,"terminating":false,"node_name":"node-a"}"#,
    )
    .unwrap();
    assert_eq!(endpoint.addr, std::net::IpAddr::from(Ipv4Addr::new(10, 0, 0, 1)));
    assert_eq!(endpoint.node_name.as_deref(), Some("node-a"));
    assert_eq!(serde_json::from_str::<Endpoint>(&serde_json::to_string(&endpoint).unwrap()).unwrap(), endpoint);
    let without: Endpoint =
        serde_json::from_str(r#"{"addr":"10.0.0.1","ready":true,"serving":true,"terminating":false}"#).unwrap();
    assert_eq!(without.node_name, None);
}

/// In-memory maps whose `backends_v4` refuses every write (not for lack of room).
struct RefusingBackends {
    inner: MapContents,
}

impl super::sync::ServiceMaps for RefusingBackends {
    fn write(&mut self, op: &super::diff::MapOp) -> Result<(), super::sync::MapWriteError> {
        if op.map_name() == map_names::BACKENDS {
            let message = "EINVAL".into();
            return Err(super::sync::MapWriteError { map: map_names::BACKENDS, message, full: false });
        }
        self.inner.apply(op);
        Ok(())
    }
    fn read_all(&self) -> Result<MapContents, super::sync::MapWriteError> {
        Ok(self.inner.clone())
    }
}

#[test]
fn a_refused_write_is_reported_once_per_map_with_its_first_error_and_retried() {
    let mut maps = RefusingBackends { inner: MapContents::default() };
    let mut sync = ServiceSync::adopt(&MapContents::default()).unwrap();
    let desired = compile(OBJECTS, &MapContents::default());
    let report = sync.sync(&mut maps, desired.clone(), true);
    let backends = report.per_map[map_names::BACKENDS];
    assert_eq!((backends.errors, backends.full), (desired.backends.len() as u64, 0));
    assert_eq!(report.first_errors.keys().copied().collect::<Vec<_>>(), [map_names::BACKENDS]);
    assert_eq!(report.first_errors[map_names::BACKENDS], "EINVAL");
    // Left out of the model: the next sync tries them again.
    let again = sync.sync(&mut maps, desired.clone(), true);
    assert_eq!(again.per_map[map_names::BACKENDS].errors, desired.backends.len() as u64);
}

#[test]
fn every_refused_external_ip_class_is_refused_and_ranges_and_the_strict_flag_decide_the_rest() {
    use std::net::IpAddr;

    use crate::services::model::ExternalIpPolicy;
    let policy = ExternalIpPolicy {
        external_ip_ranges: vec!["192.0.2.0/24".parse().unwrap(), "2001:db8:2::/64".parse().unwrap()],
        strict: true,
        load_balancer_ranges: vec![],
        forbidden: vec!["10.244.0.0/16".parse().unwrap()],
        ..Default::default()
    }
    .with_cluster_addresses(
        ["192.0.2.2".parse::<IpAddr>().unwrap(), "2001:db8:2::2".parse().unwrap()],
        ["192.0.2.100".parse::<IpAddr>().unwrap()],
    );
    let reason = |ip: &str, lb: bool| policy.refusal(ip.parse().unwrap(), lb).map(|r| r.reason);
    for (ip, expected) in [
        ("192.0.2.100", "api-server"),
        ("::ffff:192.0.2.100", "api-server"),
        ("192.0.2.2", "node-address"),
        ("2001:db8:2::2", "node-address"),
        ("10.244.1.9", "cluster-range"),
        ("169.254.169.254", "link-local"),
        ("fe80::1", "link-local"),
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("224.0.0.5", "multicast"),
        ("ff02::1", "multicast"),
        ("255.255.255.255", "multicast"),
        ("198.51.100.7", "outside-range"),
    ] {
        assert_eq!(reason(ip, false), Some(expected), "externalIP {ip}");
        if expected != "outside-range" {
            assert_eq!(reason(ip, true), Some(expected), "LoadBalancer IP {ip}");
        }
    }
    assert_eq!(reason("192.0.2.7", false), None, "inside --service-external-ip-range");
    assert_eq!(reason("2001:db8:2::7", false), None);
    // Strict and --loadbalancer-ip-range unset: no LoadBalancer IP at all (kube-router 2.8).
    assert_eq!(reason("192.0.2.7", true), Some("no-allowed-range"));
    assert_eq!(reason("198.51.100.7", true), Some("no-allowed-range"));

    // Strict, no range: no externalIP and no LoadBalancer IP, each refusal naming its flag.
    let strict = ExternalIpPolicy { strict: true, ..Default::default() };
    for (load_balancer, flag) in [(false, "--service-external-ip-range"), (true, "--loadbalancer-ip-range")] {
        let refusal = strict.refusal("198.51.100.7".parse().unwrap(), load_balancer).unwrap();
        assert_eq!(refusal.reason, "no-allowed-range");
        assert!(refusal.message.contains(flag), "{}", refusal.message);
    }
    let strict_lb_range = ExternalIpPolicy { load_balancer_ranges: vec!["203.0.113.0/24".parse().unwrap()], ..strict };
    assert_eq!(strict_lb_range.refusal("203.0.113.7".parse().unwrap(), true), None);
    assert_eq!(strict_lb_range.refusal("198.51.100.7".parse().unwrap(), true).unwrap().reason, "outside-range");
    assert_eq!(
        strict_lb_range.refusal("203.0.113.7".parse().unwrap(), false).unwrap().reason,
        "no-allowed-range",
        "the LoadBalancer range does not admit externalIPs"
    );
    // Not strict, no range: any address the other checks let through.
    let lax = ExternalIpPolicy { strict: false, ..Default::default() };
    assert_eq!(lax.refusal("198.51.100.7".parse().unwrap(), false), None);
    assert_eq!(lax.refusal("198.51.100.7".parse().unwrap(), true), None);
    assert_eq!(lax.refusal("169.254.169.254".parse().unwrap(), false).unwrap().reason, "link-local");
    assert_eq!(lax.refusal("169.254.169.254".parse().unwrap(), true).unwrap().reason, "link-local");
    let lb_range = ExternalIpPolicy { load_balancer_ranges: vec!["203.0.113.0/24".parse().unwrap()], ..lax };
    assert_eq!(lb_range.refusal("198.51.100.7".parse().unwrap(), true).unwrap().reason, "outside-range");
    assert_eq!(lb_range.refusal("203.0.113.7".parse().unwrap(), true), None);
}

proptest::proptest! {
    /// A pool built at once from the ids the maps hold is the pool taking them one by one:
    /// the same counts, the same free ranges (0, the highest id, repeats and gaps included).
    #[test]
    fn an_id_pool_built_at_once_is_the_one_taken_id_by_id(
        ids in proptest::collection::vec(proptest::prop_oneof![0u32..40, Just(u32::MAX), Just(u32::MAX - 1)], 0..30),
    ) {
        let mut one_by_one = super::compile::IdPool::default();
        for id in &ids {
            one_by_one.take(*id);
        }
        proptest::prop_assert_eq!(super::compile::IdPool::of_taken(ids.iter().copied()), one_by_one);
    }
}
