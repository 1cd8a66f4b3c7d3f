//! Benchmark (no root): decoding a `--service-file` of 10,000 Services and their EndpointSlices,
//! as YAML documents and as kubectl's JSON List (`kubectl get svc,endpointslices -o json`).
//!
//! `parse_objects` against the decode it replaced, rebuilt here as the baseline of the same run
//! (each YAML document to a `serde_norway::Value`, then a `serde_json::Value`, then the typed
//! object through `StateBuilder::add_value`). A counting allocator gives each one's transient
//! peak of live heap. Numbers from a loaded 2-core VM: read the ratios.
use std::{
    alloc::{GlobalAlloc, Layout, System},
    sync::atomic::{AtomicUsize, Ordering::Relaxed},
    time::Instant,
};

use kube_router::services::source::{parse_objects, StateBuilder};
use kube_router_tests::kube_proxy;
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

/// The measured Service's endpoint in the benchmarks the objects come from (any address does).
const BACKEND: &str = "10.0.10.2";

/// The decode `parse_objects` replaced: every document through two generic values.
fn baseline(text: &str) -> StateBuilder {
    let mut builder = StateBuilder::default();
    for document in serde_norway::Deserializer::from_str(text) {
        let value = serde_norway::Value::deserialize(document).unwrap();
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
    // The objects of `tests/benches/service_datapath.rs`: two ports, one ready endpoint each.
    let yaml = kube_proxy::service_yaml(SERVICES, BACKEND);
    let json = kube_proxy::service_json(SERVICES, BACKEND);
    for (format, text) in [("YAML", yaml), ("JSON", json)] {
        let (old_s, old_mib) = measure(&text, baseline);
        let (new_s, new_mib) = measure(&text, |t| parse_objects(t).unwrap());
        println!("  {format} ({:.1} MB):", text.len() as f64 / 1e6);
        println!("    yaml -> yaml Value -> json Value -> typed  {:>8.3} s  {:>7.1} MiB", old_s, old_mib);
        println!("    parse_objects                             {:>8.3} s  {:>7.1} MiB", new_s, new_mib);
        println!("    parse_objects / baseline: time {:.2}x, heap peak {:.2}x", new_s / old_s, new_mib / old_mib);
    }
}
