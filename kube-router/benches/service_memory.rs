//! Benchmark (no root): where the agent's memory goes at 10,000 Services / 100,000 endpoints.
//!
//! Builds, in this process, the state the agent keeps for Services (the same objects as
//! `tests/benches/api_sync.rs`, decoded as kube-rs decodes them; the per-kind stores; the
//! converted catalog; each family's incremental compiler and programmed-map model), then makes
//! one EndpointSlice change and writes the checkpoint, as the agent does. A counting global
//! allocator gives the bytes each part holds (measured by dropping it) and the transient peak of
//! each phase; `VmRSS`/`VmHWM` and the same after `malloc_trim(0)` show what the allocator keeps.
use std::{
    alloc::{GlobalAlloc, Layout, System},
    collections::BTreeSet,
    sync::atomic::{AtomicUsize, Ordering::Relaxed},
};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use kube::runtime::watcher::Event;
use kube_router::{
    k8s::{
        checkpoint,
        watch::{ClusterObjects, WatchUpdate},
    },
    services::{
        compile::{assign_ids, Limits, MapContents},
        diff::MapOp,
        family::{AddressFamily, V4, V6},
        incremental::{Changed, FamilyCompiler, ServiceCatalog},
        model::NodeContext,
        sync::{MapWriteError, ServiceMaps, ServiceSync},
    },
};
use serde_json::{json, Value};

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static BLOCKS: AtomicUsize = AtomicUsize::new(0);

/// What glibc's malloc takes for a request: 8 bytes of header, 16-byte granules, 32 at least.
fn chunk(size: usize) -> usize {
    ((size + 8 + 15) & !15).max(32)
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let live = LIVE.fetch_add(chunk(layout.size()), Relaxed) + chunk(layout.size());
            PEAK.fetch_max(live, Relaxed);
            BLOCKS.fetch_add(1, Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        unsafe { System.dealloc(p, layout) };
        LIVE.fetch_sub(chunk(layout.size()), Relaxed);
        BLOCKS.fetch_sub(1, Relaxed);
    }
    unsafe fn realloc(&self, p: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let q = unsafe { System.realloc(p, layout, new_size) };
        if !q.is_null() {
            LIVE.fetch_sub(chunk(layout.size()), Relaxed);
            let live = LIVE.fetch_add(chunk(new_size), Relaxed) + chunk(new_size);
            PEAK.fetch_max(live, Relaxed);
        }
        q
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const SERVICES: usize = 10_000;
const ENDPOINTS_PER_SERVICE: usize = 10;

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn status_kib(field: &str) -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with(field)).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

fn ip(base: [u8; 2], n: usize) -> String {
    format!("{}.{}.{}.{}", base[0], base[1], (n >> 8) & 0xff, n & 0xff)
}

/// The objects of `tests/benches/api_sync.rs`, with what the fake API server adds.
fn stored(mut object: Value, version: usize) -> String {
    let meta = object["metadata"].as_object_mut().unwrap();
    meta.insert("uid".into(), json!(format!("3f1c2a9e-0000-4000-8000-{version:012}")));
    meta.insert("creationTimestamp".into(), json!("2026-12-04T08:00:00Z"));
    meta.insert("resourceVersion".into(), json!(version.to_string()));
    object.to_string()
}

fn service(i: usize) -> Service {
    let object = json!({"apiVersion": "v1", "kind": "Service",
           "metadata": {"namespace": "bench", "name": format!("svc-{i}")},
           "spec": {"clusterIP": ip([10, 96], i), "ports": [{"name": "http", "protocol": "TCP", "port": 80}]}});
    serde_json::from_str(&stored(object, i + 1)).unwrap()
}

fn slice(i: usize, generation: usize) -> EndpointSlice {
    let endpoints: Vec<Value> = (0..ENDPOINTS_PER_SERVICE)
        .map(|e| {
            let n = i * ENDPOINTS_PER_SERVICE + e;
            let addr = if e == 0 && generation > 0 {
                ip([10, 200], generation)
            } else {
                format!("10.{}.{}.{}", 128 + (n >> 16), (n >> 8) & 0xff, n & 0xff)
            };
            json!({"addresses": [addr], "conditions": {"ready": true}})
        })
        .collect();
    let object = json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
           "metadata": {"namespace": "bench", "name": format!("svc-{i}-1"), "labels": {"kubernetes.io/service-name": format!("svc-{i}")}},
           "addressType": "IPv4", "ports": [{"name": "http", "protocol": "TCP", "port": 8080}], "endpoints": endpoints});
    serde_json::from_str(&stored(object, SERVICES + i + 1 + generation * 100_000)).unwrap()
}

/// Maps that take every write and hold nothing (the kernel holds the real ones).
struct Kernel;

impl<F: AddressFamily> ServiceMaps<F> for Kernel {
    fn write(&mut self, _: &MapOp<F>) -> Result<(), MapWriteError> {
        Ok(())
    }
    fn read_all(&self) -> Result<MapContents<F>, MapWriteError> {
        Ok(MapContents::default())
    }
}

/// One family as the agent's service controller keeps it.
struct Family<F: AddressFamily> {
    compiler: FamilyCompiler<F>,
    sync: ServiceSync<F>,
}

impl<F: AddressFamily> Family<F> {
    fn new() -> Self {
        Self { compiler: FamilyCompiler::default(), sync: ServiceSync::adopt(&Kernel).unwrap() }
    }

    fn full(&mut self, catalog: &ServiceCatalog, node: &NodeContext) {
        // As the agent's full sync does (agent::sync_all).
        let plan = self.compiler.plan_all(catalog, node, Limits::default());
        let desired = assign_ids(&plan, self.sync.programmed());
        let report = self.sync.sync(&mut Kernel, desired, true);
        self.compiler.adopt(&plan, self.sync.programmed(), report.total().errors == 0);
    }

    fn changed(&mut self, catalog: &ServiceCatalog, changed: &BTreeSet<kube_router::services::model::ServiceName>) {
        let node = NodeContext::default();
        let increment =
            self.compiler.compile_changed(catalog, changed, &node, Limits::default(), self.sync.programmed()).unwrap();
        let report = self.sync.write(&mut Kernel, increment.ops.clone());
        self.compiler.written(&increment, report.total().errors == 0);
    }
}

struct Phase {
    name: &'static str,
    live: isize,
    peak: usize,
    rss_kib: usize,
}

fn phase(name: &'static str, log: &mut Vec<Phase>, f: impl FnOnce()) {
    let before = LIVE.load(Relaxed);
    PEAK.store(before, Relaxed);
    f();
    log.push(Phase {
        name,
        live: LIVE.load(Relaxed) as isize - before as isize,
        peak: PEAK.load(Relaxed) - before,
        rss_kib: status_kib("VmRSS:"),
    });
}

extern "C" {
    fn malloc_trim(pad: usize) -> i32;
}

fn main() {
    let mut log = Vec::new();
    let start_live = LIVE.load(Relaxed);
    let start_rss = status_kib("VmRSS:");
    let mut objects = ClusterObjects::default();
    let mut catalog = ServiceCatalog::default();
    let mut feeds = None;
    let node = NodeContext::default();
    let (mut v4, mut v6) = (Family::<V4>::new(), Family::<V6>::new());

    phase("kube-rs objects in the stores", &mut log, || {
        objects.apply(WatchUpdate::Services(Event::Init));
        for i in 0..SERVICES {
            objects.apply(WatchUpdate::Services(Event::InitApply(service(i))));
        }
        objects.apply(WatchUpdate::Services(Event::InitDone));
        objects.apply(WatchUpdate::EndpointSlices(Event::Init));
        for i in 0..SERVICES {
            objects.apply(WatchUpdate::EndpointSlices(Event::InitApply(slice(i, 0))));
        }
        objects.apply(WatchUpdate::EndpointSlices(Event::InitDone));
    });
    phase("converted catalog", &mut log, || assert_eq!(objects.update_catalog(&mut feeds, &mut catalog), Changed::All));
    // The IPv4 full compile step by step: what each step leaves, and its transient peak.
    let mut plan = None;
    let mut desired = None;
    phase("IPv4 full compile: plan every Service", &mut log, || {
        plan = Some(v4.compiler.plan_all(&catalog, &node, Limits::default()))
    });
    phase("IPv4 full compile: assign ids (desired contents)", &mut log, || {
        desired = Some(assign_ids(plan.as_ref().unwrap(), v4.sync.programmed()))
    });
    // The sync consumes the desired contents as it writes them (`ServiceSync::sync`).
    phase("IPv4 full compile: diff and write", &mut log, || {
        let report = v4.sync.sync(&mut Kernel, desired.take().unwrap(), true);
        assert_eq!(report.total().errors, 0);
    });
    phase("IPv4 full compile: compiler adopts the result", &mut log, || {
        v4.compiler.adopt(plan.as_ref().unwrap(), v4.sync.programmed(), true)
    });
    phase("IPv4 full compile: plan and desired contents dropped", &mut log, || {
        plan = None;
        desired = None;
    });
    phase("IPv6: full compile (no IPv6 Services)", &mut log, || v6.full(&catalog, &node));
    let programmed = v4.sync.programmed();
    let entries = programmed.services.len() + programmed.slots.len() + programmed.backends.len();
    let cold_hwm = status_kib("VmHWM:");
    let cold_rss = status_kib("VmRSS:");
    phase("checkpoint written (snapshot, copy, JSON, file)", &mut log, || {
        let dir = std::env::temp_dir().join(format!("krt-rss-memory-{}", std::process::id()));
        let snapshot = objects.snapshot();
        checkpoint::write_base(&dir, &snapshot).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    });
    phase("100 EndpointSlice changes, compiled alone", &mut log, || {
        for change in 1..=100 {
            objects.apply(WatchUpdate::EndpointSlices(Event::Apply(slice(change * 37 % SERVICES, change))));
            let Changed::Services(changed) = objects.update_catalog(&mut feeds, &mut catalog) else { panic!("all") };
            v4.changed(&catalog, &changed);
            v6.changed(&catalog, &changed);
        }
    });
    let total_live = LIVE.load(Relaxed) - start_live;
    let rss_before_trim = status_kib("VmRSS:");
    unsafe { malloc_trim(0) };
    let rss_after_trim = status_kib("VmRSS:");

    // What each part holds: the bytes freed by dropping it.
    let mut held = Vec::new();
    let mut dropped = |name: &'static str, f: &mut dyn FnMut()| {
        let before = LIVE.load(Relaxed);
        f();
        held.push((name, before - LIVE.load(Relaxed), BLOCKS.load(Relaxed)));
    };
    dropped("IPv6 compiler + model", &mut || v6 = Family::new());
    dropped("IPv4 programmed-map model (ServiceSync)", &mut || v4.sync = ServiceSync::adopt(&Kernel).unwrap());
    dropped("IPv4 compiler (plans, claims, entries, ids)", &mut || v4.compiler = FamilyCompiler::default());
    dropped("catalog (converted Services + slices)", &mut || catalog = ServiceCatalog::default());
    dropped("stores: EndpointSlices (kube-rs objects)", &mut || objects.endpoint_slices = Default::default());
    dropped("stores: Services (kube-rs objects)", &mut || objects = ClusterObjects::default());
    eprintln!(
        "sizes: Service {} EndpointSlice {} Endpoint {} ObjectMeta {} model::Endpoint {} model::Service {} LbPlan {}",
        std::mem::size_of::<Service>(),
        std::mem::size_of::<EndpointSlice>(),
        std::mem::size_of::<k8s_openapi::api::discovery::v1::Endpoint>(),
        std::mem::size_of::<k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta>(),
        std::mem::size_of::<kube_router::services::model::Endpoint>(),
        std::mem::size_of::<kube_router::services::model::Service>(),
        std::mem::size_of::<kube_router::services::compile::LbPlan<V4>>()
    );

    println!(
        "== Service state at {SERVICES} Services / {} endpoints ({entries} IPv4 map entries)",
        SERVICES * ENDPOINTS_PER_SERVICE
    );
    println!("(bytes as glibc malloc takes them: 8-byte header, 16-byte granules, 32 at least)");
    println!("{:<52} {:>10} {:>10} {:>10}", "phase", "kept MiB", "peak MiB", "RSS MiB");
    for p in &log {
        let kept = p.live as f64 / (1024.0 * 1024.0);
        println!("{:<52} {:>10.1} {:>10.1} {:>10.1}", p.name, kept, mib(p.peak), p.rss_kib as f64 / 1024.0);
    }
    println!("{:<52} {:>10}", "part (dropped at the end)", "held MiB");
    for (name, bytes, _) in &held {
        println!("{name:<52} {:>10.1}", mib(*bytes));
    }
    println!(
        "total kept {:.1} MiB; RSS at start {:.1}, after the cold compile {:.1} (peak {:.1}), at the end {:.1}, after malloc_trim(0) {:.1} MiB; peak {:.1} MiB",
        mib(total_live),
        start_rss as f64 / 1024.0,
        cold_rss as f64 / 1024.0,
        cold_hwm as f64 / 1024.0,
        rss_before_trim as f64 / 1024.0,
        rss_after_trim as f64 / 1024.0,
        status_kib("VmHWM:") as f64 / 1024.0
    );
}
