//! The agent's main loop: program the datapath from the desired state and keep it there.
//!
//! Desired state comes from the API server (watchers) or from a file. Whatever happens to the
//! source — unreachable, slow, failing, an unreadable file — the maps are only ever written
//! with a difference computed from a state we trust, and deletions only happen after a complete
//! listing of every kind since start (mark, then sweep).
use std::{
    net::Ipv4Addr,
    path::{Path, PathBuf},
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context, Result};
use kube_router_common::{lb_stat, map_names, pol_stat};
use tokio::{
    signal::unix::{signal, SignalKind},
    sync::mpsc,
};

use crate::{
    bpf::{
        datapath::{AttachOutcome, Datapath},
        policy_maps::{read_policy_stats, PolicyConntrack},
        service_maps::{read_lb_stats, BpfServiceMaps, Conntrack},
        socket_lb::{self, SocketLbOptions},
    },
    firewall::FirewallController,
    k8s::{
        checkpoint,
        watch::{self, ApiOptions, ClusterObjects, Kind, WatchUpdate},
    },
    metrics::{self, Metrics},
    netif,
    router::{RouterController, RouterOptions},
    services::{
        compile::{assign_ids, plan, CompileWarning, Limits},
        model::NodeContext,
        source::{load_file, StateBuilder},
        sync::{ServiceMaps, ServiceSync},
    },
};

pub enum DesiredSource {
    /// A YAML/JSON file of Service and EndpointSlice objects, re-read when it changes.
    File(PathBuf),
    /// The API server.
    Api(ApiOptions),
}

pub struct AgentConfig {
    pub pin_dir: PathBuf,
    pub source: DesiredSource,
    pub state_dir: PathBuf,
    /// Warn when the desired state is older than this while the API is unreachable.
    pub max_stale: Option<Duration>,
    pub interfaces: Option<Vec<String>>,
    pub node_name: String,
    pub nodeport_addresses: Option<Vec<Ipv4Addr>>,
    pub limits: Limits,
    pub metrics_port: u16,
    pub health_port: u16,
    pub conntrack_gc_interval: Duration,
    /// Program the service load balancer (`--run-service-proxy`).
    pub run_service_proxy: bool,
    /// Enforce NetworkPolicy (`--run-firewall`).
    pub run_firewall: bool,
    /// Socket-level load balancing for the node's own sockets (`--bpf-lb-sock`, `--cgroup-root`).
    pub socket_lb: SocketLbOptions,
    /// BGP pod routing (`--run-router`), when enabled.
    pub router: Option<RouterOptions>,
}

struct ServiceController {
    maps: BpfServiceMaps,
    sync: ServiceSync,
    metrics: Metrics,
    limits: Limits,
    node_name: String,
    nodeport_addresses: Option<Vec<Ipv4Addr>>,
    loopback_node_ports: bool,
}

impl ServiceController {
    fn node_context(&self) -> NodeContext {
        NodeContext {
            name: self.node_name.clone(),
            node_port_addrs: self.nodeport_addresses.clone().unwrap_or_else(netif::ipv4_addresses),
            loopback_node_ports: self.loopback_node_ports,
        }
    }

    /// Compiles `builder` and writes only the differences. `complete` says the state reflects a
    /// full listing of every kind, which is what allows deletions. Returns the number of failed
    /// writes (left for a retry).
    fn apply(&mut self, builder: &StateBuilder, complete: bool) -> u64 {
        let started = Instant::now();
        for problem in &builder.problems {
            let kind: &'static str = if problem.kind == "Service" { "Service" } else { "EndpointSlice" };
            self.metrics.with(|m| *m.rejected_objects.entry(kind).or_default() += 1);
        }
        let lb_plan = plan(&builder.state, &self.node_context(), self.limits);
        for warning in &lb_plan.warnings {
            match warning {
                CompileWarning::FrontendConflict { .. } => tracing::error!(?warning, "frontend claimed twice"),
                CompileWarning::EndpointsTruncated { .. } => tracing::warn!(?warning, "too many endpoints"),
            }
        }
        let desired = assign_ids(&lb_plan, self.sync.programmed());
        let report = self.sync.sync(&mut self.maps, &desired, complete);
        let total = report.total();
        let programmed = self.sync.programmed();
        tracing::info!(
            inserts = total.inserts,
            updates = total.updates,
            deletes = total.deletes,
            errors = total.errors,
            complete,
            services = programmed.services.len(),
            backends = programmed.backends.len(),
            "service sync complete"
        );
        self.metrics.record_sync(&report, started.elapsed());
        self.metrics.with(|m| {
            m.dropped_endpoints = lb_plan.dropped_endpoints;
            m.map_entries.insert(map_names::SERVICES, programmed.services.len() as u64);
            m.map_entries.insert(map_names::BACKEND_SLOTS, programmed.slots.len() as u64);
            m.map_entries.insert(map_names::BACKENDS, programmed.backends.len() as u64);
        });
        self.metrics.heartbeat("services");
        total.errors
    }
}

/// Failed map writes (a full map, say) are retried this long after, even if nothing changes.
const WRITE_RETRY_INTERVAL: Duration = Duration::from_secs(10);

struct FileSource {
    path: PathBuf,
    stamp: Option<SystemTime>,
    /// The last read error, so a file that stays broken is reported once, not every second.
    last_error: Option<String>,
}

impl FileSource {
    fn new(path: PathBuf) -> Self {
        Self { path, stamp: None, last_error: None }
    }

    /// The file's objects if it changed since the last read.
    fn poll(&mut self, metrics: &Metrics) -> Option<StateBuilder> {
        let stamp = std::fs::metadata(&self.path).and_then(|m| m.modified()).ok();
        if stamp.is_some() && stamp == self.stamp {
            return None;
        }
        self.stamp = stamp;
        match load_file(&self.path) {
            Ok(builder) => {
                self.last_error = None;
                Some(builder)
            }
            Err(e) => {
                let error = format!("{e:#}");
                if self.last_error.as_ref() != Some(&error) {
                    // An unreadable desired state is not an empty one: keep everything programmed.
                    tracing::error!(error, "cannot read desired state; maps left as they are");
                    metrics.with(|m| *m.rejected_objects.entry("file").or_default() += 1);
                    self.last_error = Some(error);
                }
                None
            }
        }
    }
}

impl FileSource {
    /// Applies the file if it changed; failed writes make the next poll re-apply it.
    fn sync(&mut self, controller: &mut ServiceController, metrics: &Metrics) {
        if let Some(builder) = self.poll(metrics) {
            if controller.apply(&builder, true) > 0 {
                self.stamp = None;
            }
        }
    }
}

struct ApiSource {
    objects: ClusterObjects,
    updates: mpsc::Receiver<WatchUpdate>,
    dirty: bool,
    restored_from_checkpoint: bool,
    retry_at: Option<Instant>,
}

/// Attaches one feature's ingress and egress programs to an interface.
type AttachFn = fn(&mut Datapath, &str) -> Result<[AttachOutcome; 2]>;

fn attach_all(
    datapath: &mut Datapath,
    wanted: &Option<Vec<String>>,
    attached: &mut Vec<String>,
    load_balancer: bool,
    firewall: bool,
) {
    let interfaces = wanted.clone().unwrap_or_else(netif::interfaces);
    for interface in interfaces {
        if attached.contains(&interface) {
            continue;
        }
        let mut ok = true;
        let hooks: [(bool, &str, AttachFn); 2] =
            [(load_balancer, "load balancer", Datapath::attach), (firewall, "network policy", Datapath::attach_policy)];
        for (_, what, attach) in hooks.into_iter().filter(|(enabled, _, _)| *enabled) {
            match attach(datapath, &interface) {
                Ok([ingress, egress]) => {
                    tracing::info!(interface, ?ingress, ?egress, "{what} attached at TC ingress and egress")
                }
                Err(e) => {
                    tracing::error!(interface, error = format!("{e:#}"), "cannot attach the {what}");
                    ok = false;
                }
            }
        }
        if ok {
            attached.push(interface);
        }
    }
}

fn refresh_policy_metrics(pin_dir: &Path, metrics: &Metrics, conntrack: &mut PolicyConntrack, gc: bool) {
    if let Ok(stats) = read_policy_stats(pin_dir) {
        metrics.with(|m| m.policy_packets = pol_stat::NAMES.iter().copied().zip(stats).collect());
    }
    if gc {
        match conntrack.collect_garbage() {
            Ok((left, removed)) => metrics.with(|m| {
                m.policy_conntrack_entries = left as u64;
                m.conntrack_gc_removed += removed as u64;
            }),
            Err(e) => tracing::warn!(error = %e, "policy conntrack GC failed"),
        }
    }
}

fn refresh_datapath_metrics(pin_dir: &Path, metrics: &Metrics, conntrack: &mut Conntrack, gc: bool) {
    if let Ok(stats) = read_lb_stats(pin_dir) {
        metrics.with(|m| m.datapath_packets = lb_stat::NAMES.iter().copied().zip(stats).collect());
    }
    socket_lb::refresh_metrics(pin_dir, metrics);
    if gc {
        match conntrack.collect_garbage() {
            Ok((left, removed)) => metrics.with(|m| {
                m.conntrack_entries = left as u64;
                m.conntrack_gc_removed += removed as u64;
            }),
            Err(e) => tracing::warn!(error = %e, "conntrack GC failed"),
        }
        metrics.heartbeat("conntrack-gc");
    }
}

async fn start_api_source(options: &ApiOptions, state_dir: &Path, metrics: &Metrics) -> Result<ApiSource> {
    let client = watch::client(options).await?;
    let (sender, updates) = mpsc::channel(1024);
    watch::spawn_watchers(client, sender);
    let mut objects = ClusterObjects::default();
    let restored_from_checkpoint = match checkpoint::read(state_dir) {
        Ok(saved) => {
            let age = metrics::unix_now() - saved.written_unix;
            tracing::info!(
                services = saved.services.len(),
                endpoint_slices = saved.endpoint_slices.len(),
                age_secs = age as u64,
                "restored desired state from checkpoint until the API server lists it"
            );
            metrics.with(|m| m.checkpoint_age_at_start = Some(age));
            objects.restore(saved);
            true
        }
        Err(checkpoint::CheckpointError::Missing(_)) => false,
        Err(e) => {
            // The maps stay as the previous agent left them; the API will tell us the truth.
            tracing::error!(error = %e, "ignoring checkpoint");
            metrics.with(|m| m.checkpoint_errors += 1);
            false
        }
    };
    Ok(ApiSource { objects, updates, dirty: restored_from_checkpoint, restored_from_checkpoint, retry_at: None })
}

/// The load balancer's maps and the controller that writes them.
struct ServiceProxy {
    controller: ServiceController,
    conntrack: Conntrack,
}

impl ServiceProxy {
    fn start(config: &AgentConfig, metrics: &Metrics) -> Result<Self> {
        let maps = BpfServiceMaps::open_pinned(&config.pin_dir)?;
        let sync = ServiceSync::adopt(&maps).context("reading the programmed service maps")?;
        tracing::info!(
            services = sync.programmed().services.len(),
            backends = sync.programmed().backends.len(),
            "adopted programmed state"
        );
        let controller = ServiceController {
            maps,
            sync,
            metrics: metrics.clone(),
            limits: config.limits,
            node_name: config.node_name.clone(),
            nodeport_addresses: config.nodeport_addresses.clone(),
            loopback_node_ports: config.socket_lb.enabled,
        };
        let conntrack = Conntrack::open_pinned(&config.pin_dir)?;
        Ok(Self { controller, conntrack })
    }
}

pub async fn run(config: AgentConfig) -> Result<()> {
    let metrics = Metrics::default();
    let mut ports = vec![config.health_port, config.metrics_port];
    ports.retain(|p| *p != 0);
    ports.dedup();
    for port in ports {
        let metrics = metrics.clone();
        tokio::spawn(async move {
            if let Err(e) = metrics::serve(metrics, port).await {
                tracing::error!(port, error = %e, "metrics/health server failed");
            }
        });
    }

    // The object holds every program; loading it creates (or re-adopts) every pinned map.
    let mut datapath =
        if config.run_service_proxy || config.run_firewall { Some(Datapath::load(&config.pin_dir)?) } else { None };
    let mut attached = Vec::new();
    if let Some(datapath) = datapath.as_mut() {
        attach_all(datapath, &config.interfaces, &mut attached, config.run_service_proxy, config.run_firewall);
        socket_lb::apply(datapath, &config.socket_lb, &metrics);
    }
    let mut service_proxy = if config.run_service_proxy { Some(ServiceProxy::start(&config, &metrics)?) } else { None };
    let mut firewall = if config.run_firewall {
        Some(FirewallController::start(&config.pin_dir, &config.node_name, metrics.clone())?)
    } else {
        None
    };
    let mut policy_conntrack =
        if config.run_firewall { Some(PolicyConntrack::open_pinned(&config.pin_dir)?) } else { None };
    let mut file_source = None;
    let mut api_source = None;
    match &config.source {
        DesiredSource::File(path) => file_source = Some(FileSource::new(path.clone())),
        DesiredSource::Api(options) => api_source = Some(start_api_source(options, &config.state_dir, &metrics).await?),
    }
    if let (Some(file), Some(proxy)) = (file_source.as_mut(), service_proxy.as_mut()) {
        file.sync(&mut proxy.controller, &metrics);
    }

    let mut router = config.router.clone().map(|options| RouterController::new(options, metrics.clone()));
    // Without the API the configuration comes from flags; with it, from the Node objects
    // (or their checkpoint), as soon as they are known.
    let mut router_dirty = api_source.as_ref().is_some_and(|api| api.restored_from_checkpoint);
    let mut policy_dirty = router_dirty;
    let advertise_services = config.router.as_ref().is_some_and(|r| r.advertise.any());
    let mut policy_retry_at: Option<Instant> = None;
    let mut checkpoint_due = false;
    let mut last_checkpoint = Instant::now() - Duration::from_secs(60);
    if let (Some(router), None) = (router.as_mut(), api_source.as_ref()) {
        match router.static_config() {
            Ok(bgp) => router.apply(bgp).await,
            Err(e) => tracing::info!(reason = %e, "BGP not started"),
        }
    }

    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    let mut last_gc = Instant::now();
    let mut last_rescan = Instant::now();
    let mut last_housekeeping = Instant::now();
    let mut last_stale_warning = Instant::now();
    tracing::info!("agent running");
    loop {
        let update = async {
            match api_source.as_mut() {
                Some(api) => api.updates.recv().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = terminate.recv() => break,
            _ = interrupt.recv() => break,
            Some(update) = update => {
                let api = api_source.as_mut().expect("updates come from the API source");
                match &update {
                    WatchUpdate::Error { resource, message } => {
                        // Reachability is the probe's to say: a 500 is an answer, a timeout is not.
                        tracing::warn!(resource, error = %message, "API watch failed; retrying with backoff, datapath unchanged");
                        metrics.with(|m| m.api_errors += 1);
                    }
                    WatchUpdate::Probe { reachable: false, message } => {
                        if metrics.with(|m| std::mem::replace(&mut m.api_reachable, false)) {
                            tracing::warn!(error = %message, "API server unreachable; datapath, routes and BGP stay as they are");
                        }
                        metrics.with(|m| m.api_errors += 1);
                    }
                    _ => {
                        if !metrics.with(|m| std::mem::replace(&mut m.api_reachable, true)) {
                            tracing::info!("API server reachable");
                        }
                        metrics.with(|m| m.last_api_contact_unix = Some(metrics::unix_now()));
                    }
                }
                // Only a real change of a kind wakes its controller (a relist that starts and
                // fails, or brings back the same objects, changes nothing).
                if let Some(kind) = api.objects.apply_kind(update) {
                    checkpoint_due = true;
                    api.dirty |= matches!(kind, Kind::Services | Kind::EndpointSlices);
                    router_dirty |= kind == Kind::Nodes || (advertise_services && kind == Kind::Services);
                    policy_dirty |= matches!(kind, Kind::Pods | Kind::Namespaces | Kind::NetworkPolicies);
                }
            }
            _ = tick.tick() => {
                if let Some(api) = api_source.as_mut() {
                    let complete = api.objects.synced();
                    // Before the first complete list, only a checkpoint-restored state is worth
                    // applying (and then without deletions).
                    let retry = api.retry_at.is_some_and(|at| Instant::now() >= at);
                    if (api.dirty || retry) && (complete || api.restored_from_checkpoint) {
                        api.dirty = false;
                        if let Some(proxy) = service_proxy.as_mut() {
                            let failed = proxy.controller.apply(&api.objects.state(), complete);
                            api.retry_at = (failed > 0).then(|| Instant::now() + WRITE_RETRY_INTERVAL);
                        }

                    }
                }
                if let Some(api) = api_source.as_ref() {
                    // Every kind, after each change, once all have been listed completely: a
                    // restart during an outage then has the same Services, Nodes and policies.
                    if checkpoint_due && api.objects.all_synced() && last_checkpoint.elapsed() >= Duration::from_secs(1) {
                        checkpoint_due = false;
                        last_checkpoint = Instant::now();
                        if let Err(e) = checkpoint::write(&config.state_dir, &api.objects.checkpoint()) {
                            tracing::error!(error = %e, "cannot write checkpoint");
                            metrics.with(|m| m.checkpoint_errors += 1);
                        }
                    }
                }
                if let (Some(firewall), Some(api)) = (firewall.as_mut(), api_source.as_ref()) {
                    let o = &api.objects;
                    let complete = o.pods.synced() && o.namespaces.synced() && o.network_policies.synced();
                    let retry = policy_retry_at.is_some_and(|at| Instant::now() >= at);
                    // Policy is only ever compiled from a complete picture (or its checkpoint):
                    // half a list of pods would deny traffic that is allowed.
                    if (policy_dirty || retry) && (complete || api.restored_from_checkpoint) {
                        policy_dirty = false;
                        let failed = firewall.apply(o.pods.objects(), o.namespaces.objects(), o.network_policies.objects(), complete);
                        policy_retry_at = (failed > 0).then(|| Instant::now() + WRITE_RETRY_INTERVAL);
                    }
                }
                if let (Some(router), Some(api)) = (router.as_mut(), api_source.as_ref()) {
                    // Peers leave the mesh only on a complete listing of Nodes, never because a
                    // list failed; the store keeps the last complete one through an outage.
                    if router_dirty && (api.objects.nodes.synced() || api.restored_from_checkpoint) {
                        router_dirty = false;
                        router.update_from_nodes(api.objects.nodes.objects(), api.objects.services.objects()).await;
                    }
                }
                if last_housekeeping.elapsed() < Duration::from_secs(1) {
                    continue;
                }
                last_housekeeping = Instant::now();
                if let Some(router) = router.as_ref() {
                    router.publish_metrics();
                }
                if let Some(datapath) = datapath.as_mut() {
                    if config.interfaces.is_none() && last_rescan.elapsed() >= Duration::from_secs(5) {
                        attach_all(datapath, &config.interfaces, &mut attached, config.run_service_proxy, config.run_firewall);
                        last_rescan = Instant::now();
                    }
                }
                // One GC schedule for both conntrack maps.
                let gc = last_gc.elapsed() >= config.conntrack_gc_interval;
                if gc {
                    last_gc = Instant::now();
                }
                if let Some(ct) = policy_conntrack.as_mut() {
                    refresh_policy_metrics(&config.pin_dir, &metrics, ct, gc);
                }
                if let Some(proxy) = service_proxy.as_mut() {
                    if let Some(file) = file_source.as_mut() {
                        file.sync(&mut proxy.controller, &metrics);
                    }
                    refresh_datapath_metrics(&config.pin_dir, &metrics, &mut proxy.conntrack, gc);
                }
                if let Some(max_stale) = config.max_stale {
                    let stale = metrics.with(|m| m.last_sync_unix.map(|t| metrics::unix_now() - t)).unwrap_or(0.0);
                    if stale > max_stale.as_secs_f64() && last_stale_warning.elapsed() > Duration::from_secs(60) {
                        tracing::warn!(stale_secs = stale as u64, "desired state older than --max-stale; still serving it");
                        last_stale_warning = Instant::now();
                    }
                }
                metrics.heartbeat("agent");
            }
        }
    }
    // Leave programs, links, maps and kernel routes exactly as they are: traffic keeps flowing
    // without us. With graceful restart the BGP sessions close without a Cease, so peers keep
    // our routes until we are back.
    tracing::info!("stopping; datapath and routes left in place");
    if let Some(router) = router.as_ref() {
        router.shutdown().await;
    }
    Ok(())
}

/// Used by tests and tooling: what `ServiceMaps::read_all` sees now.
pub fn read_programmed(pin_dir: &Path) -> Result<crate::services::compile::MapContents> {
    Ok(BpfServiceMaps::open_pinned(pin_dir)?.read_all()?)
}
