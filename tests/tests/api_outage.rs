//! End to end against a fake API server that speaks the real list/watch protocol (the agent
//! runs the real kube-rs client): programming from the API, an outage that changes nothing,
//! a crash during the outage, a SIGTERM while starting, and a 410 relist. As root, in network
//! namespaces.
use std::{
    sync::Arc,
    thread,
    time::{Duration, Instant},
};

use kube_router_tests::{
    apiserver::{FakeApiServer, FakeApiServerConfig, FaultMode},
    *,
};

const HEALTH_PORT: &str = "20244";

/// What `web` losing backend-3 writes: 2 slots deleted (one per port), 6 frontends (ClusterIP
/// tcp + udp, 4 NodePort addresses) get a new count; the backend stays (sticky still uses it).
const WEB_LOSES_A_BACKEND: Writes = Writes { inserts: 0, updates: 6, deletes: 2, errors: 0 };

struct Env {
    topo: Topology,
    runtime: NetnsRuntime,
    server: Arc<FakeApiServer>,
    state_dir: std::path::PathBuf,
}

impl Env {
    fn new(prefix: &str) -> Env {
        let topo = Topology::new(prefix, 3).expect("topology");
        remove_bpf_root(&topo.bpf_root());
        // The API server listens on the node namespace's loopback, where the agent runs.
        let runtime = NetnsRuntime::new(&topo.node).unwrap();
        let server =
            Arc::new(runtime.run(async { FakeApiServer::spawn(FakeApiServerConfig::default()).await.unwrap() }));
        let state_dir = std::env::temp_dir().join(format!("{prefix}-state"));
        let _ = std::fs::remove_dir_all(&state_dir);
        let env = Env { topo, runtime, server, state_dir };
        env.apply(&web_and_sticky(&backend_addrs(3)));
        env
    }

    fn apply(&self, yaml: &str) {
        self.server.apply_yaml(yaml).unwrap();
    }

    fn set_mode(&self, mode: FaultMode) {
        let server = self.server.clone();
        self.runtime.run(async move { server.set_mode(mode).await.unwrap() });
    }

    /// The checkpoint follows the first complete listing of every kind, not of Services alone:
    /// an agent killed before it has none.
    fn wait_for_checkpoint(&self) {
        let checkpoint = self.state_dir.join("checkpoint.json");
        wait_until("the first checkpoint", Duration::from_secs(20), || {
            Ok(std::fs::read_to_string(&checkpoint).is_ok_and(|text| text.contains("sticky")))
        })
        .unwrap();
    }

    fn agent(&self) -> Agent {
        self.agent_with(&["--master", &self.server.url(), "--enable-cni=false"])
    }

    fn agent_with(&self, source: &[&str]) -> Agent {
        let state_dir = self.state_dir.display().to_string();
        let mut args = source.to_vec();
        args.extend(["--state-dir", &state_dir, "--health-port", HEALTH_PORT, "--metrics-port", "20241"]);
        Agent::start(&self.topo.node, &self.topo.bpf_root(), &args).unwrap()
    }

    /// The maps the agent writes (the datapath itself writes ct_v4, affinity_v4, lb_stats).
    fn agent_maps(&self) -> Vec<String> {
        let dumps = dump_maps(&self.topo.bpf_root()).unwrap();
        ["svc_v4", "svc_slots_v4", "backends_v4", "meta"].iter().map(|n| dumps[*n].clone()).collect()
    }

    fn routes(&self) -> String {
        self.topo.node.wait_addresses_settled().unwrap();
        self.topo.node.run(&["ip", "route", "show", "table", "all"]).unwrap()
    }

    fn health(&self) -> (String, String) {
        self.health_at("/healthz")
    }

    /// Status and body of a health endpoint (`/healthz`, `/livez`, `/readyz`).
    fn health_at(&self, path: &str) -> (String, String) {
        let out = self
            .topo
            .node
            .run(&[netprobe_bin().to_str().unwrap(), "http", &format!("127.0.0.1:{HEALTH_PORT}"), path])
            .unwrap();
        let (status, body) = out.split_once('\n').unwrap_or((&out, ""));
        (status.trim().to_string(), body.trim().to_string())
    }

    fn try_scrape(&self) -> Option<String> {
        self.topo.node.scrape_metrics(20241).ok()
    }

    fn scrape(&self) -> String {
        self.try_scrape().expect("metrics endpoint")
    }

    /// A client opening a new connection to the ClusterIP every 200 ms, until the test ends.
    fn prober(&self) -> Arc<std::sync::Mutex<Vec<String>>> {
        self.topo
            .client
            .spawn_collecting(&[netprobe_bin().to_str().unwrap(), "probe", &format!("{VIP}:80"), "200"])
            .unwrap()
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        remove_bpf_root(&self.topo.bpf_root());
    }
}

fn failures(probes: &[String]) -> Vec<&String> {
    probes.iter().filter(|p| !p.starts_with("backend-")).collect()
}

fn assert_all_ok(replies: &[String]) {
    assert!(failures(replies).is_empty(), "failed requests: {replies:?}");
}

fn outage_secs() -> u64 {
    // Longest client-side timeout in the agent: 30 s (the read timeout; a black-holed server
    // accepts and never answers, so every request ends there). 65 s: every watch times out,
    // backs off and times out again. `KRT_OUTAGE_SECS=N` holds it longer.
    std::env::var("KRT_OUTAGE_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(65)
}

#[test]
fn programs_from_the_api_and_applies_changes() {
    let env = Env::new("krt-api");
    // Through a kubeconfig file this time, as on a real node.
    let kubeconfig = env.state_dir.with_extension("kubeconfig");
    std::fs::write(&kubeconfig, env.server.kubeconfig_yaml()).unwrap();
    let mut agent = env.agent_with(&["--kubeconfig", kubeconfig.to_str().unwrap()]);
    let synced = agent.wait_for_complete_service_sync(Duration::from_secs(30)).unwrap();
    assert!(synced.writes.inserts > 0, "{synced:?}");
    let replies = env.topo.request("tcp", &format!("{VIP}:80"), 30).unwrap();
    assert_all_ok(&replies);
    assert_eq!(tally(&replies).len(), 3);
    let scrape = env.topo.node.scrape_metrics(20241).unwrap();
    for needle in [
        "kube_router_map_writes_total{map=\"svc_v4\",op=\"insert\"} 8",
        "kube_router_map_entries{map=\"backends_v4\"} 6",
        "kube_router_api_reachable 1",
        "# TYPE kube_router_sync_duration_seconds histogram",
    ] {
        assert!(scrape.contains(needle), "metrics lack {needle}:\n{scrape}");
    }

    let before = agent.service_syncs().unwrap();
    env.apply(&web_and_sticky(&backend_addrs(2)));
    agent.wait_for_service_writes(&before, WEB_LOSES_A_BACKEND, Duration::from_secs(30)).unwrap();
    let replies = env.topo.request("tcp", &format!("{VIP}:80"), 30).unwrap();
    assert_all_ok(&replies);
    assert!(!replies.iter().any(|r| r == "backend-3"));
}

#[test]
fn an_api_outage_changes_nothing_and_recovery_applies_only_the_real_difference() {
    let env = Env::new("krt-out");
    let mut agent = env.agent();
    agent.wait_for_complete_service_sync(Duration::from_secs(30)).unwrap();
    let probes = env.prober();
    thread::sleep(Duration::from_secs(1));
    let maps_before = env.agent_maps();
    let routes_before = env.routes();

    env.set_mode(FaultMode::BlackHole);
    let started = Instant::now();
    let mut checks = 0;
    while started.elapsed() < Duration::from_secs(outage_secs()) {
        thread::sleep(Duration::from_secs(5));
        assert!(agent.is_running(), "agent died {:?} into the outage", started.elapsed());
        let (status, body) = env.health();
        assert_eq!(status, "200", "liveness must stay OK during an outage: {body}");
        // The reachability probe runs every 5 s with a 5 s timeout.
        if started.elapsed() > Duration::from_secs(15) {
            assert!(body.contains("\"api\":\"unreachable\""), "{:?} into the outage: {body}", started.elapsed());
        }
        assert_eq!(env.agent_maps(), maps_before, "maps changed {:?} into the outage", started.elapsed());
        checks += 1;
    }
    assert!(checks as u64 >= outage_secs() / 6, "{checks} checks");
    let (_, body) = env.health();
    assert!(body.contains("\"api\":\"unreachable\""), "health reports the outage: {body}");
    assert!(agent.scrape().unwrap().count("kube_router_api_errors_total", &[]) > 0, "outage counted");
    assert_eq!(env.routes(), routes_before);
    let outage_probes = probes.lock().unwrap().clone();
    assert!(outage_probes.len() as u64 >= outage_secs() * 3, "prober ran: {} probes", outage_probes.len());
    assert!(
        failures(&outage_probes).is_empty(),
        "connections failed during the outage: {:?}",
        failures(&outage_probes)
    );

    // The API comes back with one Service changed: exactly that change is applied.
    let before = agent.service_syncs().unwrap();
    env.apply(&web_and_sticky(&backend_addrs(2)));
    env.set_mode(FaultMode::Normal);
    agent.wait_for_service_writes(&before, WEB_LOSES_A_BACKEND, Duration::from_secs(90)).unwrap();
    thread::sleep(Duration::from_secs(1));
    let all = probes.lock().unwrap().clone();
    assert!(failures(&all).is_empty(), "connections failed: {:?}", failures(&all));
    let (_, body) = env.health();
    assert!(body.contains("\"api\":\"reachable\""), "{body}");
}

#[test]
fn killed_during_an_outage_the_agent_restarts_from_its_checkpoint() {
    let env = Env::new("krt-ck");
    let mut agent = env.agent();
    agent.wait_for_complete_service_sync(Duration::from_secs(30)).unwrap();
    env.wait_for_checkpoint();
    let probes = env.prober();
    let maps_before = env.agent_maps();

    env.set_mode(FaultMode::Refuse);
    agent.kill();
    let mut agent = env.agent();
    // The API refuses every request: a sync now can only come from the restored checkpoint.
    let synced = agent.wait_for_service_syncs(1, Duration::from_secs(20)).unwrap();
    assert_eq!(synced.complete, 0, "a checkpoint is not a complete listing: {synced:?}");
    assert_eq!(synced.writes, Writes::default(), "restore rewrote maps: {synced:?}");
    // Four interfaces, each with the load balancer's and the network policy's pair of links.
    let links = agent.scrape().unwrap().link_attaches("tc");
    assert_eq!(links, LinkAttaches { adopted: 16, updated: 0, created: 0 }, "every link re-adopted as it was");
    thread::sleep(Duration::from_secs(3));
    assert_eq!(env.agent_maps(), maps_before);
    assert!(agent.is_running());
    // Restored from the checkpoint with the API down: live and ready (the kubelet neither
    // restarts it nor holds a rollout).
    for path in ["/livez", "/readyz"] {
        let (status, body) = env.health_at(path);
        assert_eq!(status, "200", "{path} after a cold start from the checkpoint during an outage: {body}");
    }

    // A 500-answering API is no better; then it recovers with nothing changed.
    env.set_mode(FaultMode::Errors500);
    thread::sleep(Duration::from_secs(3));
    env.set_mode(FaultMode::Normal);
    let synced = agent.wait_for_complete_service_sync(Duration::from_secs(60)).unwrap();
    assert_eq!(synced.writes, Writes::default(), "nothing changed, nothing written: {synced:?}");
    assert_eq!(env.agent_maps(), maps_before);
    let all = probes.lock().unwrap().clone();
    assert!(all.len() > 20);
    assert!(failures(&all).is_empty(), "traffic stopped: {:?}", failures(&all));
}

/// The checkpoint follows the maps by up to a second (and not at all while it cannot be
/// written): an agent killed in between has maps newer than its checkpoint, and programming
/// the checkpoint during an outage would bring back a backend the API had removed.
#[test]
fn a_checkpoint_older_than_the_maps_does_not_take_them_back() {
    let env = Env::new("krt-cknew");
    let mut agent = env.agent();
    agent.wait_for_complete_service_sync(Duration::from_secs(30)).unwrap();
    env.wait_for_checkpoint();
    // The checkpoint as it is now, with three web backends, put back after the API went on to
    // two: what an agent killed before its checkpoint followed its maps leaves.
    let checkpoint = env.state_dir.join("checkpoint.json");
    let older = std::fs::read(&checkpoint).unwrap();
    // Stamps have whole seconds: the change must be read in a later second than the checkpoint.
    thread::sleep(Duration::from_millis(1100));
    let maps_before_change = env.agent_maps();
    let before = agent.service_syncs().unwrap();
    env.apply(&web_and_sticky(&backend_addrs(2)));
    agent.wait_for_service_writes(&before, WEB_LOSES_A_BACKEND, Duration::from_secs(30)).unwrap();
    let maps_after_change = env.agent_maps();
    assert_ne!(maps_after_change, maps_before_change);
    let probes = env.prober();

    env.set_mode(FaultMode::Refuse);
    agent.kill();
    std::fs::write(&checkpoint, &older).unwrap();
    let _agent = env.agent();
    wait_until("the restart to find its checkpoint older than the maps", Duration::from_secs(20), || {
        Ok(env
            .try_scrape()
            .is_some_and(|s| s.lines().any(|l| l == "kube_router_checkpoint_superseded_total{maps=\"service\"} 1")))
    })
    .unwrap();
    // Long enough for a restored sync to have happened, had it been going to.
    thread::sleep(Duration::from_secs(3));
    assert_eq!(env.agent_maps(), maps_after_change, "the older checkpoint was programmed");
    let all = probes.lock().unwrap().clone();
    assert!(all.len() > 10, "prober ran: {all:?}");
    assert!(failures(&all).is_empty(), "traffic stopped: {:?}", failures(&all));
    assert!(!all.iter().any(|p| p.starts_with("backend-3")), "the removed backend answered: {all:?}");
}

#[test]
fn a_corrupt_checkpoint_is_rejected_and_the_maps_are_left_alone() {
    let env = Env::new("krt-cc");
    let mut agent = env.agent();
    agent.wait_for_complete_service_sync(Duration::from_secs(30)).unwrap();
    env.wait_for_checkpoint();
    let maps_before = env.agent_maps();
    agent.kill();
    let checkpoint = env.state_dir.join("checkpoint.json");
    let text = std::fs::read_to_string(&checkpoint).unwrap();
    // Cut within its base (the journal after it is never much larger): what no crash leaves.
    std::fs::write(&checkpoint, &text[..text.len() / 4]).unwrap();

    env.set_mode(FaultMode::Refuse);
    let mut agent = env.agent();
    agent
        .wait_for_metrics("the checkpoint refused", Duration::from_secs(20), |s| {
            (s.count("kube_router_checkpoint_errors_total", &[]) >= 1).then_some(())
        })
        .unwrap();
    thread::sleep(Duration::from_secs(3));
    assert!(agent.is_running());
    assert_eq!(agent.service_syncs().unwrap().syncs, 0, "nothing synced from a corrupt checkpoint");
    assert_eq!(env.agent_maps(), maps_before);
    assert_all_ok(&env.topo.request("tcp", &format!("{VIP}:80"), 10).unwrap());

    env.set_mode(FaultMode::Normal);
    let synced = agent.wait_for_complete_service_sync(Duration::from_secs(60)).unwrap();
    assert_eq!(synced.writes.updates, 0, "{synced:?}");
    assert_eq!(env.agent_maps(), maps_before);
}

#[test]
fn a_410_relist_flushes_nothing() {
    let env = Env::new("krt-410");
    let _agent = env.agent();
    let syncs = || metric(&env.scrape(), "kube_router_sync_duration_seconds_count");
    // The first listing may reach the controller in more than one wake-up (one sync per batch):
    // wait for a first sync, then for the count to hold still for a second.
    let mut settled = 0.0;
    wait_until("the first service sync, then no more", Duration::from_secs(30), || {
        let now = env
            .try_scrape()
            .and_then(|s| {
                s.lines().find_map(|l| l.strip_prefix("kube_router_sync_duration_seconds_count ")?.parse::<f64>().ok())
            })
            .unwrap_or(0.0);
        let quiet = now >= 1.0 && now == settled;
        settled = now;
        if !quiet {
            thread::sleep(Duration::from_secs(1));
        }
        Ok(quiet)
    })
    .unwrap();
    let syncs_before = syncs();
    let maps_before = env.agent_maps();
    let watches = env.server.open_watches();
    let compacted = env.server.requests().last().map(|r| r.at).unwrap_or_default();
    env.server.compact();
    env.server.close_watches();
    // The watchers resume from a version that is gone, get 410 in-stream, and relist: a list
    // request (no `watch=`) of every watched resource after the compaction, then their watches
    // open again.
    wait_until("every resource relisted and watched again", Duration::from_secs(30), || {
        let relists = env
            .server
            .requests()
            .into_iter()
            .filter(|r| r.at > compacted && r.method == "GET" && !r.uri.contains("watch="))
            .map(|r| r.uri.split('?').next().unwrap_or_default().to_string())
            .collect::<std::collections::BTreeSet<_>>();
        Ok(relists.len() >= watches && env.server.open_watches() >= watches)
    })
    .unwrap();
    // Nothing would be written or synced after it: give a sync the time it would take.
    thread::sleep(Duration::from_secs(2));
    assert_eq!(env.agent_maps(), maps_before);
    assert_eq!(syncs(), syncs_before, "an identical relist syncs nothing");
    assert_all_ok(&env.topo.request("tcp", &format!("{VIP}:80"), 10).unwrap());
}

/// The agent's programs on its interfaces, as `kube-router interfaces -o json` reports them
/// (the program ids aside: a restart may load the programs again behind links it keeps).
fn attachments(env: &Env) -> Vec<serde_json::Value> {
    let root = env.topo.bpf_root();
    let out = env
        .topo
        .node
        .run(&[kube_router_bin().to_str().unwrap(), "--bpf-root", root.to_str().unwrap(), "interfaces", "-o", "json"])
        .unwrap();
    let mut report: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    report.iter_mut().for_each(|a| drop(a.as_object_mut().unwrap().remove("program_id")));
    report
}

/// A SIGTERM while the agent starts stops it in order: exit status 0, and the maps, links and
/// routes the previous agent left are as they were (the handler used to be installed last, so a
/// SIGTERM in the first seconds killed the agent mid-start). Twice, during an outage: at the
/// first moment the agent handles the signal, and while its start waits on the checkpoint read
/// (a FIFO in the checkpoint's place holds it there) after it loaded the datapath and took the
/// links back.
#[test]
fn a_sigterm_while_starting_stops_in_order_and_changes_nothing() {
    let env = Env::new("krt-term");
    let mut agent = env.agent();
    agent.wait_for_complete_service_sync(Duration::from_secs(30)).unwrap();
    env.wait_for_checkpoint();
    agent.stop().unwrap();
    let checkpoint_path = env.state_dir.join("checkpoint.json");
    let checkpoint = std::fs::read(&checkpoint_path).unwrap();
    let (maps, routes, links) = (env.agent_maps(), env.routes(), attachments(&env));
    assert!(!links.is_empty() && links.iter().all(|l| l["attached"] == true), "{links:?}");
    env.set_mode(FaultMode::Refuse);

    let mut agent = env.agent();
    wait_until("the agent to handle SIGTERM", Duration::from_secs(10), || Ok(agent.catches_sigterm())).unwrap();
    agent.sigterm().unwrap();
    let status = agent.wait_exit(Duration::from_secs(30)).unwrap();
    assert!(status.success(), "SIGTERM at the start: {status}");
    assert_eq!(env.agent_maps(), maps);
    assert_eq!(attachments(&env), links);
    assert_eq!(env.routes(), routes);

    std::fs::remove_file(&checkpoint_path).unwrap();
    sh(&["mkfifo", "-m", "600", checkpoint_path.to_str().unwrap()]).unwrap();
    let mut agent = env.agent();
    // Opening a FIFO to write returns once a reader opened it: the agent, at its checkpoint read.
    let (opened, reader_came) = std::sync::mpsc::channel();
    let fifo = checkpoint_path.clone();
    thread::spawn(move || opened.send(std::fs::OpenOptions::new().write(true).open(fifo)));
    let mut writer =
        reader_came.recv_timeout(Duration::from_secs(30)).expect("the agent reads its checkpoint").unwrap();
    assert!(agent.catches_sigterm(), "the checkpoint is read before the handler is installed");
    agent.sigterm().unwrap();
    // Only now may the read end: the signal came while the start was held.
    let _ = std::io::Write::write_all(&mut writer, &checkpoint);
    drop(writer);
    let status = agent.wait_exit(Duration::from_secs(30)).unwrap();
    assert!(status.success(), "SIGTERM during the start: {status}");
    assert_eq!(env.agent_maps(), maps);
    assert_eq!(attachments(&env), links);
    assert_eq!(env.routes(), routes);
}
