//! The agent's metrics registry, which every subsystem registers its own metrics with (see
//! [`Subsystem`]), the health verdict and status pages its listeners serve (`http`), and the
//! metrics several subsystems record into ([`AgentMetrics`]). The text is `prometheus-client`'s encoder's (`exposition`).
use std::{
    any::{Any, TypeId},
    collections::{BTreeMap, HashMap},
    sync::{Arc, Mutex, MutexGuard},
    time::Instant,
};

use prometheus_client::registry::Registry;

pub use crate::exposition::unix_now;
use crate::exposition::{self, register, register_optional, Counter, Family, IntGauge, OptionalGauge, SecondsSince};

/// Renders a status page.
pub type Page = Arc<dyn Fn() -> String + Send + Sync>;

/// Label values of a family with `N` labels, as (name, value).
pub type Labels<const N: usize> = [(&'static str, &'static str); N];

/// One part of the agent's metrics: the metrics a subsystem records into, created and registered
/// the first time it is asked for ([`Metrics::of`]); every later call gets the same instance.
/// Adding a metric is a field and its line in `register`.
pub trait Subsystem: Default + Send + Sync + 'static {
    /// Registers every metric of `this` (metric handles are shared: register clones, or the
    /// `Arc` itself as a collector).
    fn register(this: &Arc<Self>, registry: &mut Registry);
}

#[derive(Clone, Default)]
pub struct Metrics(Arc<Shared>);

#[derive(Default)]
struct Shared {
    /// One registry per subsystem and per collector registered, in registration order: a scrape
    /// takes them (`Arc`s) and encodes without this lock, so a slow client reading a streamed
    /// page never holds up a registration.
    registries: Mutex<Vec<Arc<Registry>>>,
    subsystems: Mutex<HashMap<TypeId, Arc<dyn Any + Send + Sync>>>,
    /// controller name -> last heartbeat.
    heartbeats: Mutex<BTreeMap<&'static str, Instant>>,
    /// Text pages served at `/<name>` (`/bgp`).
    pages: Mutex<BTreeMap<&'static str, Page>>,
    /// The controllers' liveness and the agent's readiness.
    health: Arc<crate::health::Health>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Metrics {
    /// The metrics of subsystem `T`, registered at the first call (a scrape under way does not
    /// list it: it took the registries before).
    pub fn of<T: Subsystem>(&self) -> Arc<T> {
        let mut subsystems = lock(&self.0.subsystems);
        if let Some(existing) = subsystems.get(&TypeId::of::<T>()) {
            return existing.clone().downcast::<T>().expect("keyed by its own type");
        }
        let created = Arc::new(T::default());
        let mut registry = Registry::default();
        T::register(&created, &mut registry);
        lock(&self.0.registries).push(Arc::new(registry));
        subsystems.insert(TypeId::of::<T>(), created.clone());
        created
    }

    /// Families computed on every scrape by a part of the agent that starts later (the BGP
    /// speaker's, the controllers').
    pub fn register_collector(&self, collector: impl prometheus_client::collector::Collector) {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(collector));
        lock(&self.0.registries).push(Arc::new(registry));
    }

    /// The exposition text. The controllers record into atomics and their own snapshots, never
    /// under the registry's lock: a scrape (or a slow client's many) does not stall them.
    pub fn render(&self) -> String {
        let registries = self.registries();
        exposition::encode_all(&registries.iter().map(Arc::as_ref).collect::<Vec<_>>())
    }

    /// The exposition text in pieces of about `chunk` bytes, each given to `sink` when complete
    /// (the `/metrics` page streamed into its connection); the pieces together are `render`'s text.
    pub fn render_chunks(&self, chunk: usize, sink: impl FnMut(String) -> std::fmt::Result) -> std::fmt::Result {
        let registries = self.registries();
        exposition::encode_chunks(&registries.iter().map(Arc::as_ref).collect::<Vec<_>>(), chunk, sink)
    }

    /// The text as it was rendered before it was streamed: every registry into one String, the
    /// upstream counters' TYPE lines restored over the whole (what a streamed page must equal).
    #[cfg(test)]
    pub(crate) fn render_whole(&self) -> String {
        let mut text = String::new();
        for registry in self.registries() {
            prometheus_client::encoding::prometheus_text::encode(&mut text, &registry).unwrap();
        }
        exposition::restore_upstream_counter_types(&mut text);
        text
    }

    fn registries(&self) -> Vec<Arc<Registry>> {
        lock(&self.0.registries).clone()
    }

    pub fn heartbeat(&self, controller: &'static str) {
        lock(&self.0.heartbeats).insert(controller, Instant::now());
    }

    /// The controllers' liveness and the agent's readiness.
    pub fn health_state(&self) -> Arc<crate::health::Health> {
        self.0.health.clone()
    }

    /// Serves the page `render` writes at `/<name>`.
    pub fn register_page(&self, name: &'static str, render: Page) {
        lock(&self.0.pages).insert(name, render);
    }

    /// The page registered as `name`, rendered now.
    pub fn page(&self, name: &str) -> Option<String> {
        let render = lock(&self.0.pages).get(name).cloned()?;
        Some(render())
    }

    /// The health endpoints' answer: `/livez` and `/healthz` 503 when a controller task died or
    /// hangs, `/readyz` 503 also until the first complete sync (see `health`). Never because of
    /// the API server: its reachability is reported in the body only.
    pub fn health(&self, readiness: bool) -> (bool, String) {
        let detail: BTreeMap<&str, f64> =
            lock(&self.0.heartbeats).iter().map(|(k, t)| (*k, t.elapsed().as_secs_f64())).collect();
        let agent = self.of::<AgentMetrics>();
        let last_contact = agent.last_api_contact.get();
        // "unknown" until the API has answered once (or with no API at all, --service-file).
        let api = match (agent.api_reachable.get() == 1, last_contact) {
            (true, _) => "reachable",
            (false, None) => "unknown",
            (false, Some(_)) => "unreachable",
        };
        let api_contact = last_contact.map(|t| (unix_now() - t).round());
        let verdict = self.0.health.check();
        let ok = if readiness { verdict.ready } else { verdict.live };
        let status = match (ok, verdict.live) {
            (true, _) => "ok",
            (false, true) => "not ready",
            (false, false) => "failed",
        };
        let body = serde_json::json!({
            "status": status,
            "ready": verdict.ready,
            "problems": verdict.problems,
            "api": api,
            "seconds_since_api_contact": api_contact,
            "seconds_since_heartbeat": detail,
        })
        .to_string();
        (ok, body)
    }
}

/// What several subsystems record into: objects rejected (Services, EndpointSlices, Nodes,
/// NetworkPolicies, health check ports), the API server's reachability (the watchers, and the
/// health endpoints' body), the checkpoint (its writer, the restore at start, the services and
/// policy controllers that may find it superseded).
#[derive(Default)]
pub struct AgentMetrics {
    rejected_objects: Family<Labels<1>, Counter>,
    pub api_reachable: IntGauge,
    pub api_errors: Counter,
    pub last_api_contact: OptionalGauge,
    pub checkpoint_errors: Counter,
    /// Starts that took the desired state from the checkpoint until the API server lists it.
    pub checkpoint_restores: Counter,
    /// How long the last checkpoint write took (it sets the wait before the next).
    pub checkpoint_write_seconds: OptionalGauge,
    /// Bytes written to the checkpoint, by part (`base`, `journal`).
    checkpoint_written_bytes: Family<Labels<1>, Counter>,
    /// Bases written in place of a journal grown as large as the base.
    pub checkpoint_compactions: Counter,
    /// Restored checkpoints not programmed into a set of maps (`service`, `policy`) that
    /// already held newer API state.
    checkpoint_superseded: Family<Labels<1>, Counter>,
}

impl AgentMetrics {
    /// An object of `kind` rejected as invalid.
    pub fn reject(&self, kind: &'static str) {
        self.rejected_objects.get_or_create(&[("kind", kind)]).inc();
    }

    /// A restored checkpoint not programmed into `maps` (`service`, `policy`).
    pub fn checkpoint_superseded(&self, maps: &'static str) {
        self.checkpoint_superseded.get_or_create(&[("maps", maps)]).inc();
    }

    /// `bytes` written to the checkpoint's `part` (`base`, `journal`).
    pub fn checkpoint_written(&self, part: &'static str, bytes: u64) {
        self.checkpoint_written_bytes.get_or_create(&[("part", part)]).inc_by(bytes);
    }

    pub fn checkpoint_written_bytes(&self, part: &'static str) -> u64 {
        self.checkpoint_written_bytes.get_or_create(&[("part", part)]).get()
    }

    pub fn checkpoint_superseded_count(&self, maps: &'static str) -> u64 {
        self.checkpoint_superseded.get_or_create(&[("maps", maps)]).get()
    }
}

impl Subsystem for AgentMetrics {
    fn register(this: &Arc<Self>, registry: &mut Registry) {
        for maps in ["policy", "service"] {
            drop(this.checkpoint_superseded.get_or_create(&[("maps", maps)]));
        }
        for part in ["base", "journal"] {
            drop(this.checkpoint_written_bytes.get_or_create(&[("part", part)]));
        }
        let m = this.as_ref();
        register(
            registry,
            "kube_router_rejected_objects_total",
            "Objects rejected as invalid (their programmed state is kept).",
            m.rejected_objects.clone(),
        );
        register(
            registry,
            "kube_router_api_reachable",
            "1 while the last API request succeeded, 0 after a failure.",
            m.api_reachable.clone(),
        );
        register(
            registry,
            "kube_router_api_errors_total",
            "Failed API list/watch requests (each retried with backoff).",
            m.api_errors.clone(),
        );
        register(
            registry,
            "kube_router_seconds_since_api_contact",
            "Seconds since the API server last answered (-1 before it ever did).",
            SecondsSince(m.last_api_contact.clone()),
        );
        register(
            registry,
            "kube_router_checkpoint_errors_total",
            "Checkpoints that could not be written or read.",
            m.checkpoint_errors.clone(),
        );
        register(
            registry,
            "kube_router_checkpoint_restores_total",
            "Starts that restored the desired state from the checkpoint until the API server lists it.",
            m.checkpoint_restores.clone(),
        );
        register_optional(
            registry,
            "kube_router_checkpoint_write_duration_seconds",
            "How long the last checkpoint write took; the next waits 20 times as long (at least 1 s).",
            m.checkpoint_write_seconds.clone(),
        );
        register(
            registry,
            "kube_router_checkpoint_written_bytes_total",
            "Bytes written to the checkpoint: whole bases (part=base) and the journal of changes appended after one (part=journal).",
            m.checkpoint_written_bytes.clone(),
        );
        register(
            registry,
            "kube_router_checkpoint_compactions_total",
            "Checkpoint bases written in place of a journal that had grown as large as its base.",
            m.checkpoint_compactions.clone(),
        );
        register(
            registry,
            "kube_router_checkpoint_superseded_total",
            "Restored checkpoints not programmed because the maps already held newer API state (a restart within a second of a change).",
            m.checkpoint_superseded.clone(),
        );
    }
}

#[cfg(test)]
mod tests {
    use std::{collections::BTreeMap, time::Duration};

    use super::*;
    use crate::{
        controllers::{datapath_stats::DatapathMetrics, services::ServiceMetrics},
        map_writes::{MapMetrics, OpCounts, SyncReport},
    };

    /// A minimal Prometheus text-format reader: family -> type, and every sample's family.
    fn parse(text: &str) -> (BTreeMap<String, String>, Vec<(String, f64)>) {
        let mut types = BTreeMap::new();
        let mut samples = Vec::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').expect("TYPE name kind");
                types.insert(name.to_string(), kind.to_string());
            } else if !line.starts_with('#') && !line.is_empty() {
                let (series, value) = line.rsplit_once(' ').expect("sample value");
                let name = series.split('{').next().unwrap().to_string();
                samples.push((name, value.parse().expect("numeric value")));
            }
        }
        (types, samples)
    }

    #[test]
    fn every_sample_belongs_to_a_typed_family_with_the_documented_names() {
        let metrics = Metrics::default();
        crate::agent::register_metrics(&metrics);
        let mut report = SyncReport::default();
        report.per_map.insert("svc_v4", OpCounts { inserts: 3, updates: 1, ..Default::default() });
        metrics.of::<MapMetrics>().record(&report);
        metrics.of::<ServiceMetrics>().record_sync(Duration::from_millis(3), true, None);
        let (types, samples) = parse(&metrics.render());
        for (name, _) in &samples {
            let family = name.trim_end_matches("_bucket").trim_end_matches("_sum").trim_end_matches("_count");
            assert!(types.contains_key(name) || types.contains_key(family), "{name} has no TYPE");
        }
        assert_eq!(types["kube_router_map_writes_total"], "counter");
        assert_eq!(types["kube_router_sync_duration_seconds"], "histogram");
        assert_eq!(types["kube_router_api_reachable"], "gauge");
        assert_eq!(types["kube_router_seconds_since_last_sync"], "gauge");
        assert!(samples.contains(&("kube_router_map_writes_total".into(), 3.0)));
        assert!(samples.contains(&("kube_router_sync_duration_seconds_count".into(), 1.0)));
        assert!(samples.contains(&("kube_router_service_complete_syncs_total".into(), 1.0)));
        assert!(metrics.render().contains("kube_router_map_writes_total{map=\"svc_v4\",op=\"update\"} 1"));
    }

    /// Every family the agent can export, each with a series.
    fn every_family() -> BTreeMap<String, String> {
        let metrics = Metrics::default();
        crate::agent::register_metrics(&metrics);
        metrics.of::<DatapathMetrics>().with(|m| {
            m.policy_packets = vec![("allowed", 1)];
            m.socket_lb_events = vec![("connect", 1)];
        });
        metrics.of::<crate::routing::router::RoutingMetrics>().set_overlay_packets(vec![("encapsulated", 1)]);
        let mut report = SyncReport::default();
        report.per_map.insert("svc_v4", OpCounts { inserts: 1, ..Default::default() });
        let maps = metrics.of::<MapMetrics>();
        maps.record(&report);
        maps.set_entries("svc_v4", 1);
        maps.set_full("svc_v4", false);
        metrics.of::<crate::policy::engine::PolicyMetrics>().record_sync(Duration::from_millis(100));
        let agent = metrics.of::<AgentMetrics>();
        agent.checkpoint_write_seconds.set(0.1);
        agent.reject("Service");
        metrics.of::<ServiceMetrics>().external_ip_refused("loopback");
        let full = Some(crate::services::incremental::FullCompile::Node);
        metrics.of::<ServiceMetrics>().record_sync(Duration::from_millis(3), true, full);
        metrics
            .of::<crate::bpf::socket_lb::SocketLbMetrics>()
            .agent_not_exempt
            .get_or_create(&[("reason", "root_cgroup")])
            .inc();
        let http = metrics.of::<crate::http::HttpMetrics>();
        http.count_rejected("metrics", "peer_limit");
        http.count_accept_error("metrics", "EMFILE");
        metrics.register_collector(crate::exposition::FnCollector(
            |encoder: &mut prometheus_client::encoding::DescriptorEncoder| {
                crate::routing::router::encode_bgp_families(
                    encoder,
                    &crate::routing::bgp::speaker::SpeakerStatus::default(),
                )
            },
        ));
        let (_, status) = tokio::sync::watch::channel(crate::health::Status::default());
        metrics.register_collector(crate::runtime::ControllerMetrics(vec![("services", status)]));
        let text = metrics.render();
        assert!(!text.contains(" untyped\n"), "every family has a type:\n{text}");
        parse(&text).0
    }

    /// The names docs/metrics.md lists (first column of its tables), with its type.
    fn documented_names() -> BTreeMap<String, String> {
        let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/metrics.md")).unwrap();
        page.lines()
            .filter_map(|line| {
                let mut cells = line.strip_prefix("| `")?.split('|');
                let name = cells.next()?.trim().trim_end_matches('`');
                (name.starts_with("kube_router_") || name.starts_with("process_"))
                    .then(|| Some((name.to_string(), cells.next()?.trim().to_string())))?
            })
            .collect()
    }

    #[test]
    fn the_exported_names_and_types_are_exactly_the_ones_the_metrics_page_lists() {
        let (exported, listed) = (every_family(), documented_names());
        let missing: Vec<_> = exported.iter().filter(|(n, t)| listed.get(*n) != Some(t)).collect();
        let extra: Vec<_> = listed.keys().filter(|n| !exported.contains_key(*n)).collect();
        assert!(
            missing.is_empty() && extra.is_empty(),
            "not (or wrongly) in docs/metrics.md: {missing:?}; only there: {extra:?}"
        );
        // Every name kube-router's own dashboard (dashboard/kube-router.json) queries, and the
        // process families its alerts commonly use.
        for name in [
            "kube_router_build_info",
            "kube_router_controller_bgp_advertisements_received",
            "kube_router_controller_bgp_advertisements_sent",
            "kube_router_controller_bgp_internal_peers_sync_time",
            "kube_router_controller_bgp_peers",
            "kube_router_controller_iptables_sync_time",
            "kube_router_controller_ipvs_metrics_export_time",
            "kube_router_controller_ipvs_services",
            "kube_router_controller_ipvs_services_sync_time",
            "kube_router_controller_policy_chains_sync_time",
            "kube_router_controller_routes_sync_time",
            "kube_router_service_bps_in",
            "kube_router_service_bps_out",
            "kube_router_service_bytes_in",
            "kube_router_service_bytes_out",
            "kube_router_service_cps",
            "kube_router_service_packets_in",
            "kube_router_service_packets_out",
            "kube_router_service_pps_in",
            "kube_router_service_pps_out",
            "kube_router_service_total_connections",
            "process_cpu_seconds_total",
            "process_resident_memory_bytes",
            "process_open_fds",
            "process_max_fds",
        ] {
            assert!(exported.contains_key(name), "{name}");
        }
    }

    /// A collector may record into any subsystem while the text is encoded (as any controller
    /// may at that moment): recording never waits for the registry's lock.
    #[test]
    fn recording_while_the_text_is_encoded_does_not_wait_for_it() {
        let metrics = Metrics::default();
        let agent = metrics.of::<AgentMetrics>();
        let recorder = agent.clone();
        metrics.register_collector(crate::exposition::FnCollector(
            move |encoder: &mut prometheus_client::encoding::DescriptorEncoder| {
                recorder.api_errors.inc();
                crate::exposition::single(encoder, "t_recorded", "T.", &crate::exposition::Value::IntGauge(1))
            },
        ));
        let (done, rendered) = std::sync::mpsc::channel();
        std::thread::spawn(move || done.send(metrics.render()).unwrap());
        let text = rendered.recv_timeout(Duration::from_secs(5)).expect("the render finished (no deadlock)");
        assert!(text.contains("\nt_recorded 1\n"), "{text}");
        assert_eq!(agent.api_errors.get(), 1);
    }

    #[test]
    fn health_is_ok_even_when_the_api_is_unreachable() {
        let metrics = Metrics::default();
        let agent = metrics.of::<AgentMetrics>();
        agent.last_api_contact.set(unix_now() - 100.0);
        agent.api_reachable.set(0);
        let (live, health) = metrics.health(false);
        assert!(live);
        let health: serde_json::Value = serde_json::from_str(&health).unwrap();
        assert_eq!(health["status"], "ok");
        assert_eq!(health["api"], "unreachable");
        assert!(health["seconds_since_api_contact"].as_f64().unwrap() >= 100.0);
    }
}
