//! Benchmark (no root): decoding a `--service-file` of 10,000 Services and their EndpointSlices,
//! as YAML documents and as kubectl's JSON List (`kubectl get svc,endpointslices -o json`).
//!
//! `parse_objects` against the decode it replaced, rebuilt here as the baseline of the same run
//! (each YAML document to a `serde_yaml::Value`, then a `serde_json::Value`, then the typed
//! object through `StateBuilder::add_value`). A counting allocator gives each one's transient
//! peak of live heap. Numbers from a loaded 2-core VM: read the ratios.
use std::{
    alloc::{GlobalAlloc, Layout, System},
    fmt::Write as _,
    sync::atomic::{AtomicUsize, Ordering::Relaxed},
    time::Instant,
};

use kube_router::services::source::{parse_objects, StateBuilder};
use serde::Deserialize;

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let live = LIVE.fetch_add(layout.size(), Relaxed) + layout.size();
            PEAK.fetch_max(live, Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        unsafe { System.dealloc(p, layout) };
        LIVE.fetch_sub(layout.size(), Relaxed);
    }
    unsafe fn realloc(&self, p: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let q = unsafe { System.realloc(p, layout, new_size) };
        if !q.is_null() {
            LIVE.fetch_sub(layout.size(), Relaxed);
            let live = LIVE.fetch_add(new_size, Relaxed) + new_size;
            PEAK.fetch_max(live, Relaxed);
        }
        q
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const SERVICES: usize = 10_000;
const ROUNDS: usize = 5;

fn vip(i: usize) -> std::net::Ipv4Addr {
    std::net::Ipv4Addr::from(u32::from(std::net::Ipv4Addr::new(10, 100, 0, 0)) + 1 + i as u32)
}

fn backend(i: usize) -> std::net::Ipv4Addr {
    std::net::Ipv4Addr::from(u32::from(std::net::Ipv4Addr::new(10, 200, 0, 0)) + 1 + i as u32)
}

/// The objects of `tests/benches/service_datapath.rs`: two ports, one ready endpoint each.
fn yaml_file() -> String {
    let mut out = String::new();
    for i in 0..SERVICES {
        let _ = write!(
            out,
            "---\napiVersion: v1\nkind: Service\nmetadata: {{namespace: bench, name: s{i}}}\nspec:\n  clusterIP: {}\n  ports:\n  - {{name: http, protocol: TCP, port: 80}}\n  - {{name: dns, protocol: UDP, port: 53}}\n\
             ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  namespace: bench\n  name: s{i}-1\n  labels: {{kubernetes.io/service-name: s{i}}}\naddressType: IPv4\n\
             ports:\n- {{name: http, protocol: TCP, port: 8080}}\n- {{name: dns, protocol: UDP, port: 5353}}\nendpoints:\n- addresses: [\"{}\"]\n  conditions: {{ready: true}}\n",
            vip(i),
            backend(i)
        );
    }
    out
}

/// The same objects as kubectl prints them: one indented `List`.
fn json_file() -> String {
    let mut items = Vec::new();
    for i in 0..SERVICES {
        items.push(serde_json::json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"namespace": "bench", "name": format!("s{i}")},
            "spec": {"clusterIP": vip(i).to_string(), "ports": [
                {"name": "http", "protocol": "TCP", "port": 80},
                {"name": "dns", "protocol": "UDP", "port": 53}]}
        }));
        items.push(serde_json::json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"namespace": "bench", "name": format!("s{i}-1"),
                         "labels": {"kubernetes.io/service-name": format!("s{i}")}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "protocol": "TCP", "port": 8080},
                      {"name": "dns", "protocol": "UDP", "port": 5353}],
            "endpoints": [{"addresses": [backend(i).to_string()], "conditions": {"ready": true}}]
        }));
    }
    serde_json::to_string_pretty(&serde_json::json!({"apiVersion": "v1", "kind": "List", "items": items})).unwrap()
}

/// The decode `parse_objects` replaced: every document through two generic values.
fn baseline(text: &str) -> StateBuilder {
    let mut builder = StateBuilder::default();
    for document in serde_yaml::Deserializer::from_str(text) {
        let value = serde_yaml::Value::deserialize(document).unwrap();
        if value.is_null() {
            continue;
        }
        builder.add_value(serde_json::to_value(value).unwrap()).unwrap();
    }
    builder
}

/// Best of `ROUNDS` (seconds) and the transient peak of live heap above what was live before (MiB).
fn measure(text: &str, decode: impl Fn(&str) -> StateBuilder) -> (f64, f64) {
    let mut best = f64::MAX;
    let mut peak = 0;
    for _ in 0..ROUNDS {
        let before = LIVE.load(Relaxed);
        PEAK.store(before, Relaxed);
        let started = Instant::now();
        let builder = decode(text);
        best = best.min(started.elapsed().as_secs_f64());
        peak = peak.max(PEAK.load(Relaxed) - before);
        assert_eq!(builder.state.services.len(), SERVICES);
        assert_eq!(builder.state.slices.len(), SERVICES);
        assert!(builder.problems.is_empty(), "{:?}", builder.problems.first());
    }
    (best, peak as f64 / (1024.0 * 1024.0))
}

fn main() {
    println!("{SERVICES} Services + {SERVICES} EndpointSlices; best of {ROUNDS}, transient heap peak");
    for (format, text) in [("YAML", yaml_file()), ("JSON", json_file())] {
        let (old_s, old_mib) = measure(&text, baseline);
        let (new_s, new_mib) = measure(&text, |t| parse_objects(t).unwrap());
        println!("  {format} ({:.1} MB):", text.len() as f64 / 1e6);
        println!("    yaml -> yaml Value -> json Value -> typed  {:>8.3} s  {:>7.1} MiB", old_s, old_mib);
        println!("    parse_objects                             {:>8.3} s  {:>7.1} MiB", new_s, new_mib);
        println!("    parse_objects / baseline: time {:.2}x, heap peak {:.2}x", new_s / old_s, new_mib / old_mib);
    }
}
