//! Benchmark (root): from a cold list of 10,000 Services / 100,000 endpoints served by the fake
//! API server (real kube-rs client in the agent) to programmed maps, the agent's peak memory,
//! and the latency of single endpoint changes. Baseline in the same run: the same objects
//! loaded from a file (`--service-file`), which skips the API client entirely.
use std::{
    sync::Arc,
    thread,
    time::{Duration, Instant},
};

use kube_router_tests::{
    apiserver::{FakeApiServer, FakeApiServerConfig},
    *,
};
use serde_json::{json, Value};

const SERVICES: usize = 10_000;
const ENDPOINTS_PER_SERVICE: usize = 10;
/// The count; `KRT_BENCH_CHANGES` overrides it (e.g. to look for growth over more).
const CHANGES: usize = 1_000;

fn ip(base: [u8; 2], n: usize) -> String {
    format!("{}.{}.{}.{}", base[0], base[1], (n >> 8) & 0xff, n & 0xff)
}

fn service(i: usize) -> Value {
    json!({"apiVersion": "v1", "kind": "Service",
           "metadata": {"namespace": "bench", "name": format!("svc-{i}")},
           "spec": {"clusterIP": ip([10, 96], i), "ports": [{"name": "http", "protocol": "TCP", "port": 80}]}})
}

fn slice(i: usize, generation: usize) -> Value {
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
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
           "metadata": {"namespace": "bench", "name": format!("svc-{i}-1"), "labels": {"kubernetes.io/service-name": format!("svc-{i}")}},
           "addressType": "IPv4", "ports": [{"name": "http", "protocol": "TCP", "port": 8080}], "endpoints": endpoints})
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn main() {
    std::env::set_var("KRT_QUIET_AGENT", "1");
    let node = Netns::new("krt-bench-api").unwrap();
    let root = std::path::PathBuf::from("/sys/fs/bpf/krt-bench-api");
    let state_dir = std::env::temp_dir().join("krt-bench-api-state");

    // Baseline: the same objects from a file.
    let items: Vec<Value> = (0..SERVICES).flat_map(|i| [service(i), slice(i, 0)]).collect();
    let file = std::env::temp_dir().join("krt-bench-objects.json");
    std::fs::write(&file, serde_json::to_string(&json!({"apiVersion": "v1", "kind": "List", "items": items})).unwrap())
        .unwrap();
    remove_bpf_root(&root);
    let started = Instant::now();
    let mut agent =
        Agent::start(&node, &root, &["--service-file", file.to_str().unwrap(), "--health-port", "0"]).unwrap();
    agent.wait_for_log("service sync complete", 1, Duration::from_secs(300)).unwrap();
    let file_time = started.elapsed();
    let file_rss = agent.peak_rss_kib().unwrap_or(0);
    agent.kill();

    // The API server, in the agent's namespace.
    let runtime = NetnsRuntime::new(&node).unwrap();
    let server = Arc::new(runtime.run(async { FakeApiServer::spawn(FakeApiServerConfig::default()).await.unwrap() }));
    for item in items {
        server.apply(item).unwrap();
    }
    remove_bpf_root(&root);
    let _ = std::fs::remove_dir_all(&state_dir);
    let args = [
        "--enable-cni=false",
        "--master",
        &server.url(),
        "--state-dir",
        state_dir.to_str().unwrap(),
        "--health-port",
        "0",
    ];
    let started = Instant::now();
    let mut agent = Agent::start(&node, &root, &args).unwrap();
    let line = agent.wait_for_log("complete=true", 1, Duration::from_secs(300)).unwrap();
    let api_time = started.elapsed();
    let api_rss = agent.peak_rss_kib().unwrap_or(0);
    assert!(line.contains("services=10000"), "{line}");

    let mut latencies = Vec::new();
    let mut incremental = 0;
    let changes: usize = std::env::var("KRT_BENCH_CHANGES").ok().and_then(|n| n.parse().ok()).unwrap_or(CHANGES);
    let mut rss_every_500 = Vec::new();
    for change in 1..=changes {
        let before = agent.log_count("service sync complete");
        let scanned = agent.log.lock().unwrap().len();
        let started = Instant::now();
        server.apply(slice(change * 37 % SERVICES, change)).unwrap();
        // Polled every 0.2 ms (the harness's own wait polls every 50 ms, coarser than what
        // is measured here), looking at the new lines only: counting over the whole log, which
        // grows by thousands of lines, held the lock the agent's output is appended under.
        let synced = || agent.log.lock().unwrap()[scanned..].iter().any(|l| l.contains("service sync complete"));
        while !synced() && started.elapsed() < Duration::from_secs(30) {
            thread::sleep(Duration::from_micros(200));
        }
        latencies.push(started.elapsed());
        let line = agent.wait_for_log("service sync complete", before + 1, Duration::from_secs(30)).unwrap();
        if change == 1 {
            eprintln!("{line}");
        }
        incremental += usize::from(line.contains("incremental=true"));
        if change % 500 == 0 {
            rss_every_500.push(agent.rss_kib().unwrap_or(0) / 1024);
        }
        thread::sleep(Duration::from_millis(50));
    }
    latencies.sort();
    let total_rss = agent.peak_rss_kib().unwrap_or(0);
    agent.kill();
    remove_bpf_root(&root);

    let secs = |d: Duration| d.as_secs_f64();
    println!("== cold start to programmed maps: {SERVICES} services, {} endpoints", SERVICES * ENDPOINTS_PER_SERVICE);
    println!(
        "from the API server (kube-rs list + watch) {:>8.2} s   peak RSS {:>6.1} MiB",
        secs(api_time),
        api_rss as f64 / 1024.0
    );
    println!(
        "from a file (baseline)                     {:>8.2} s   peak RSS {:>6.1} MiB",
        secs(file_time),
        file_rss as f64 / 1024.0
    );
    println!(
        "ratio API / file                           {:>8.2}x  memory {:.2}x",
        secs(api_time) / secs(file_time),
        api_rss as f64 / file_rss.max(1) as f64
    );
    println!("== one endpoint changed -> maps updated ({changes} changes, includes the log pipe)");
    println!("RSS every 500 changes (MiB): {rss_every_500:?}");
    println!(
        "p50 {:>7.1} ms   p90 {:>7.1} ms   p99 {:>7.1} ms   max {:>7.1} ms   peak RSS after changes {:.1} MiB",
        percentile(&latencies, 0.5).as_secs_f64() * 1e3,
        percentile(&latencies, 0.9).as_secs_f64() * 1e3,
        percentile(&latencies, 0.99).as_secs_f64() * 1e3,
        latencies.last().unwrap().as_secs_f64() * 1e3,
        total_rss as f64 / 1024.0
    );
    println!(
        "{incremental} of {changes} changes compiled alone (KUBE_ROUTER_FULL_SERVICE_COMPILE={})",
        std::env::var("KUBE_ROUTER_FULL_SERVICE_COMPILE").unwrap_or_default()
    );
}
