//! Golden files: real-shaped Service / EndpointSlice YAML in (`tests/golden/services/*.yaml`),
//! the map contents the compiler makes of them out (`*.expected`: the IPv4 maps, then the IPv6
//! maps, their lines starting `v6`), for a node `node-a` in `zone-a` with NodePorts on 192.0.2.1
//! and 2001:db8::1. Each file goes through both sources the agent has:
//! the file source (`--service-file`: YAML, decoded per object) and the API source (objects
//! decoded as kube-rs decodes the API server's JSON, through the watch store). Files whose
//! first line says `file-only` hold objects the API server would never serve.
//!
//! `GOLDEN_UPDATE=1 cargo test --test service_golden` rewrites the expected files.
use std::{
    fmt::Write,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::Path,
};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use kube_router::{
    k8s::watch::ClusterObjects,
    services::{
        compile::{assign_ids, plan_for, Limits, MapContents},
        family::{AddressFamily, V4, V6},
        model::{NodeContext, ServiceState},
        source::{parse_objects, ObjectProblem},
    },
};
use kube_router_common::*;
use serde::Deserialize;

fn node() -> NodeContext {
    NodeContext {
        name: "node-a".into(),
        node_port_addrs: vec![Ipv4Addr::new(192, 0, 2, 1).into(), "2001:db8::1".parse().unwrap()],
        zone: Some("zone-a".into()),
        ..Default::default()
    }
}

fn addr<F: AddressFamily>(a: F::Words, port: u16) -> String {
    let ip: IpAddr = F::addr_from_words(a).into();
    SocketAddr::new(ip, u16::from_be(port)).to_string()
}

/// The maps as text, one frontend per line, IDs left out (they are arbitrary but stable).
fn render(state: &ServiceState, problems: &[ObjectProblem]) -> String {
    let mut out = String::new();
    render_family::<V4>(state, "", &mut out);
    render_family::<V6>(state, "v6 ", &mut out);
    for problem in problems {
        let what = if problem.partial { "left out" } else { "rejected" };
        let _ = writeln!(out, "{what}: {} {}: {}", problem.kind, problem.name, problem.message);
    }
    out
}

fn render_family<F: AddressFamily>(state: &ServiceState, prefix: &str, out: &mut String) {
    let contents = assign_ids(&plan_for::<F>(state, &node(), Limits::default()), &MapContents::<F>::default());
    for (key, value) in &contents.services {
        let proto = if key.proto == IPPROTO_TCP { "tcp" } else { "udp" };
        let flags: Vec<&str> = [
            (SVC_FLAG_AFFINITY, "affinity"),
            (SVC_FLAG_LOCAL_ONLY, "local"),
            (SVC_FLAG_NODEPORT, "nodeport"),
            (SVC_FLAG_EXTERNAL, "external"),
            (SVC_FLAG_HAIRPIN, "hairpin"),
            (SVC_FLAG_SOURCE_RANGES, "source-ranges"),
            (SVC_FLAG_DSR, "dsr"),
        ]
        .into_iter()
        .filter(|(bit, _)| value.flags & bit != 0)
        .map(|(_, name)| name)
        .collect();
        let backends: Vec<String> = (0..value.backend_count)
            .map(|slot| contents.slots[&BackendSlotKey { service_id: value.service_id, slot }].backend_id)
            .map(|id| contents.backends[&id])
            .map(|b| {
                let local = if b.flags & BACKEND_FLAG_LOCAL != 0 { " (local)" } else { "" };
                format!("{}{local}", addr::<F>(b.addr, b.port))
            })
            .collect();
        let _ = write!(
            out,
            "{prefix}{proto} {} [{}] -> [{}]",
            addr::<F>(key.addr, key.port),
            flags.join(","),
            backends.join(", ")
        );
        if let Some(timeout) = Some(value.affinity_timeout_secs).filter(|t| *t > 0) {
            let _ = write!(out, " affinity {timeout}s");
        }
        let ranges: Vec<String> = contents
            .source_ranges
            .keys()
            .filter(|r| value.flags & SVC_FLAG_SOURCE_RANGES != 0 && r.service_id == value.service_id)
            .map(|r| format!("{}/{}", F::addr_from_words(r.addr), r.prefix_len))
            .collect();
        if !ranges.is_empty() {
            let _ = write!(out, " from [{}]", ranges.join(", "));
        }
        out.push('\n');
    }
}

/// The API source: each object as kube-rs decodes it, listed through the watch store.
fn through_the_api(text: &str) -> ServiceState {
    let mut services = Vec::new();
    let mut slices = Vec::new();
    for (i, document) in serde_norway::Deserializer::from_str(text).enumerate() {
        let mut value = serde_json::to_value(serde_norway::Value::deserialize(document).unwrap()).unwrap();
        if value.is_null() {
            continue;
        }
        value["metadata"]["resourceVersion"] = serde_json::json!((i + 1).to_string());
        match value["kind"].as_str() {
            Some("Service") => services.push(serde_json::from_value::<Service>(value).unwrap()),
            Some("EndpointSlice") => slices.push(serde_json::from_value::<EndpointSlice>(value).unwrap()),
            _ => {}
        }
    }
    let mut objects = ClusterObjects::default();
    objects.list_services(services, slices);
    assert!(objects.synced());
    objects.state().state
}

#[test]
fn every_golden_file_compiles_to_its_expected_maps_from_both_sources() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/services");
    let update = std::env::var_os("GOLDEN_UPDATE").is_some();
    let mut files: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().map(|e| e.path()).collect();
    files.retain(|p| p.extension().is_some_and(|e| e == "yaml"));
    files.sort();
    assert!(files.len() >= 10, "golden files missing in {}", dir.display());
    let mut failures = Vec::new();
    for path in &files {
        let text = std::fs::read_to_string(path).unwrap();
        let builder = parse_objects(&text).unwrap();
        let from_file = render(&builder.state, &builder.problems);
        let expected_path = path.with_extension("expected");
        if update {
            std::fs::write(&expected_path, &from_file).unwrap();
        }
        let expected = std::fs::read_to_string(&expected_path).unwrap_or_default();
        if from_file != expected {
            failures.push(format!("{} (file source):\n--- expected\n{expected}--- got\n{from_file}", path.display()));
        }
        if !text.lines().next().unwrap_or_default().contains("file-only") {
            // Problems are the same objects' in both; compare the maps.
            let from_api = render(&through_the_api(&text), &[]);
            let maps_only: String = from_file.lines().filter(|l| !l.contains(": ")).map(|l| format!("{l}\n")).collect();
            if from_api != maps_only {
                failures.push(format!(
                    "{} (API source):\n--- file source\n{maps_only}--- API source\n{from_api}",
                    path.display()
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
