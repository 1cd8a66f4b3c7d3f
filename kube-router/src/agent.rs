//! The agent: wires the controllers and feeds them the desired state.
//!
//! Desired state comes from the API server (watchers) or from a file. Whatever happens to the
//! source — unreachable, slow, failing, an unreadable file — the maps are only ever written
//! with a difference computed from a state we trust, and deletions only happen after a complete
//! listing (the cache hands its readers nothing else; see `k8s::cache`).
//!
//! Each controller runs on its own task (`runtime`), woken only by the kinds it reads; this
//! task writes the watch events into the cache and handles the signals.
use std::{collections::BTreeMap, net::IpAddr, path::Path, sync::Arc, time::Duration};

use anyhow::{Context, Result};
use tokio::{
    signal::unix::{signal, Signal, SignalKind},
    sync::{mpsc, watch},
    task::JoinHandle,
};

pub use crate::config::{AgentConfig, CniOptions, DesiredSource, ListenerOptions};
use crate::services::maps::{BpfServiceMaps, BpfServiceMapsV6};
use crate::{
    bpf::{datapath::Datapath, socket_lb},
    controllers::{
        checkpoint::{CheckpointWriter, CHECKPOINT_KINDS},
        datapath_stats::DatapathStatsController,
        interfaces::{InterfacesController, LinkTrigger, LocalPodsTrigger, Programs},
        node_nets::{sync_egress_nets, CniWriter, EgressNets, NodeNetsController, NODE_KINDS},
        policy::{PolicyController, POLICY_KINDS},
        routing::{self, RoutingController},
        service_view::{ServiceViewController, VipPublisher},
        services::{FileEvents, ServiceProgrammer, ServicesFromApi, ServicesFromFile, SERVICE_TRIGGER_KINDS},
    },
    k8s::{
        cache::Cache,
        checkpoint,
        watch::{self as watchers, ApiOptions, ClusterObjects, WatchUpdate},
    },
    metrics::{self, AgentMetrics, Metrics},
    node::netif,
    policy::engine::PolicyProgrammer,
    routing::router::BgpRouter,
    runtime::{self, NoTrigger, RunOptions, Running, Status},
    services::family::V6,
};

/// Controllers whose latency is measured (a Service change, a new pod veth) run as soon as
/// they are woken: a burst arriving meanwhile is taken by the next run.
const AT_ONCE: RunOptions =
    RunOptions { debounce: Duration::ZERO, retry_initial: Duration::from_secs(1), retry_max: Duration::from_secs(30) };
/// For the controllers whose pass walks every Node (routing, the node networks): in a large
/// cluster Nodes change many times a second, and one pass per 200 ms bounds their cost at any
/// rate of change, for a route that follows a Node at most that much later.
const NODE_PACED: RunOptions = RunOptions {
    debounce: Duration::from_millis(200),
    retry_initial: Duration::from_secs(1),
    retry_max: Duration::from_secs(30),
};

/// SIGTERM and SIGINT, caught from the first moment of the run command
/// (`launch::run` installs them before it reads anything): one that arrives while the agent
/// starts stops it there, in order, as one arriving later does. Without them the kernel's
/// default action would kill the agent mid-start.
pub struct StopSignals {
    terminate: Signal,
    interrupt: Signal,
}

impl StopSignals {
    /// Registers the handlers; call it inside the runtime (tokio's driver receives them).
    pub fn install() -> std::io::Result<Self> {
        Ok(Self { terminate: signal(SignalKind::terminate())?, interrupt: signal(SignalKind::interrupt())? })
    }

    /// The first SIGTERM or SIGINT (one that came before this is awaited counts), by name.
    pub async fn received(&mut self) -> &'static str {
        tokio::select! {
            _ = self.terminate.recv() => "SIGTERM",
            _ = self.interrupt.recv() => "SIGINT",
        }
    }
}

/// Starts the agent and runs it until `signals` says stop. A signal while it starts ends the
/// start at its next wait; one after the start's last wait stops the controllers just spawned,
/// as a later one does. Either way the pinned maps and links the start created or adopted stay,
/// and nothing is withdrawn.
pub async fn run(config: AgentConfig, mut signals: StopSignals) -> Result<()> {
    let started = tokio::select! {
        biased;
        signal = signals.received() => {
            tracing::info!(signal, "stopped while starting; datapath and routes left in place");
            return Ok(());
        }
        started = start(config) => started?,
    };
    started.serve(signals).await
}

/// A started agent: its controllers run; [`Started::serve`] feeds them until a stop signal.
struct Started {
    /// The task applying the watchers' updates to the cache (API source only).
    applier: Option<JoinHandle<()>>,
    tasks: Vec<JoinHandle<()>>,
    stop: watch::Sender<bool>,
    routing: Option<Running<RoutingController>>,
}

async fn start(mut config: AgentConfig) -> Result<Started> {
    // The checkpoint is read and decoded beside the datapath's load: the kernel verifies the
    // programs on another thread meanwhile (a 150,000-pod checkpoint is some 100 MiB of JSON;
    // each took about a second, one after the other).
    let saved = matches!(config.source.source, DesiredSource::Api(_)).then(|| {
        let state_dir = config.state_dir.clone();
        tokio::task::spawn_blocking(move || read_checkpoint(&state_dir))
    });
    let metrics = Metrics::default();
    register_metrics(&metrics);
    serve_http(&config.listeners, &metrics).await;
    if let DesiredSource::Api(options) = &config.source.source {
        config.services.api_server_addresses = watchers::api_server_addresses(options).await;
        tracing::info!(addresses = ?config.services.api_server_addresses, "API server addresses (never a Service's)");
    }

    // Until a BGP speaker runs (if ever), /bgp says so.
    metrics.register_page("bgp", Arc::new(|| crate::routing::router::render_status(None)));
    metrics.register_page("bgp.json", Arc::new(|| crate::routing::bgp::report::BgpReport::page(None)));
    let named = metrics.of::<crate::kr_metrics::ServiceCounters>();
    // Copied under the lock, serialized without it (the services controller names frontends
    // under it, the datapath counters controller samples them).
    metrics.register_page(
        "frontends",
        Arc::new(move || crate::kr_metrics::frontends_page(&named.with(|m| m.frontends.clone()))),
    );
    tokio::spawn(crate::status_socket::serve(config.state_dir.clone(), metrics.clone()));

    // The object holds every program; loading it creates (or re-adopts) every pinned map. The
    // programs are then verified (a third of a cold start's CPU at 150,000 pods) on a blocking
    // thread while the watchers list the cluster: that needs nothing from the API, and changes
    // nothing pinned, so a stop signal meanwhile leaves everything as it was.
    let verifying = if config.services.run || config.policy.run {
        let mut loading =
            Datapath::open_maps(&config.pin_dir, config.datapath.attach_mode, Some(config.datapath.map_sizes))?;
        // Only what this agent attaches (`kr_lb_ingress` alone is 60 % of the verifier's time).
        let attached = programs(&config).attached(config.services.socket_lb.enabled);
        let needed = move |name: &str| attached.contains(&name);
        Some(tokio::task::spawn_blocking(move || loading.verify_only(needed).map(|()| loading)))
    } else {
        None
    };
    // What the watchers deliver is applied to the cache as it comes (the controllers, started
    // once the programs are loaded, read it whole at their first run): the list is most of the
    // start, and the API server's answers the rest.
    let api = match &config.source.source {
        DesiredSource::File(_) => None,
        DesiredSource::Api(options) => {
            let saved = match saved {
                Some(reading) => reading.await.context("reading the checkpoint")?,
                None => Err(checkpoint::CheckpointError::Missing(checkpoint::path_in(&config.state_dir))),
            };
            let (cache, updates) = start_api_source(options, saved, &metrics).await?;
            Some((cache.clone(), tokio::spawn(apply_updates(updates, cache, metrics.clone()))))
        }
    };

    let interfaces = if let Some(verifying) = verifying {
        let mut datapath = verifying.await.context("verifying the datapath's programs")??.finish()?;
        // Closed until every link runs these programs and the entries found have their endpoints
        // recorded (`open_lb_gate`): an older release's programs record none. Not in the loader:
        // the overlay loads the object again later, which must leave an open gate open.
        crate::services::maps::gate::close(&config.pin_dir).context("closing the load balancer's gate")?;
        write_policy_ct_gate(&config.pin_dir)?;
        datapath.set_pod_mode(config.datapath.pod_attach_mode);
        let mut interfaces = InterfacesController::start(
            datapath,
            config.datapath.interfaces.clone(),
            programs(&config),
            config.policy.pod_source_check,
            config
                .services
                .api_server_addresses
                .iter()
                .copied()
                .chain(config.router.iter().flat_map(|r| r.external_peers.iter().map(|p| p.address)))
                .collect(),
            metrics.clone(),
        );
        socket_lb::apply(interfaces.datapath(), &config.services.socket_lb, &metrics);
        // The links run our programs now: an upgrade from the previous map layout can complete.
        interfaces.datapath().finish_upgrade().context("finishing the upgrade of the pinned maps")?;
        if config.services.run {
            open_lb_gate(&config.pin_dir);
        }
        Some(interfaces)
    } else {
        None
    };
    let (health_checks, health_check_ports) = watch::channel(BTreeMap::new());
    tokio::spawn(crate::services::healthcheck::serve(health_check_ports, metrics.clone()));
    let services =
        if config.services.run { Some(ServiceProgrammer::start(&config, &metrics, health_checks)?) } else { None };
    let egress = EgressNets {
        pin_dir: config.pin_dir.clone(),
        cluster_cidrs: config.node.cluster_cidrs.clone(),
        service_ranges: config.node.service_ranges.clone(),
    };
    if services.is_some() && matches!(config.source.source, DesiredSource::File(_)) {
        sync_egress_nets(&egress, []);
    }
    let firewall = if config.policy.run {
        Some(PolicyProgrammer::start(&config.pin_dir, &config.node_name, metrics.clone())?)
    } else {
        None
    };
    let stats = DatapathStatsController::open(
        &config.pin_dir,
        metrics.clone(),
        config.services.run,
        config.policy.run,
        config.datapath.conntrack_gc_interval,
        config.source.max_stale,
    )?;
    let cache = api.as_ref().map(|(cache, _)| cache.clone());

    let (stop_tx, stop) = watch::channel(false);
    let mut tasks = Controllers::default();
    // Without a datapath the node's addresses matter to nobody: a channel that never changes.
    let node_addresses: watch::Receiver<Vec<IpAddr>> = match &interfaces {
        Some(interfaces) => interfaces.node_addresses(),
        None => watch::Sender::new(Vec::new()).subscribe(),
    };
    if let Some(interfaces) = interfaces {
        // Interfaces are attached the moment they appear; the periodic rescan stays as a safety net.
        let events = if config.datapath.link_events {
            netif::LinkEvents::open()
                .map_err(|e| tracing::warn!(error = %e, "no link events; new interfaces are found by a 5 s rescan"))
                .ok()
        } else {
            None
        };
        // A pod's object gets its IPs once the CNI plugin has assigned them: the moment to read
        // its veth's addresses for the source check. Without the check no Pod concerns this
        // controller (in a large cluster Pods change hundreds of times a second).
        let pods = cache
            .as_ref()
            .filter(|_| config.policy.pod_source_check)
            .map(|cache| LocalPodsTrigger::new(cache.clone(), config.node_name.clone()));
        tasks.add(runtime::spawn(interfaces, (LinkTrigger(events), pods), AT_ONCE, stop.clone()));
    }
    // The Service VIPs BGP advertises come from the services catalog: the services
    // controller's, or without the proxy a catalog kept for them alone.
    let advertise = config.router.as_ref().map(|r| r.advertise).filter(|a| a.any());
    let (mut vip_publisher, vip_receiver) = match advertise {
        Some(advertise) => {
            let (publisher, receiver) = VipPublisher::new(advertise, services.is_none(), metrics.clone());
            (Some(publisher), Some(receiver))
        }
        None => (None, None),
    };
    if let Some(controller) = services {
        match (&config.source.source, &cache) {
            (DesiredSource::File(path), _) => {
                let services = ServicesFromFile::new(controller, path.clone(), node_addresses.clone());
                let trigger = (node_addresses.clone(), FileEvents::watch(path));
                tasks.add(runtime::spawn(services, trigger, AT_ONCE, stop.clone()));
            }
            (DesiredSource::Api(_), Some(cache)) => {
                let mut services = ServicesFromApi::new(controller, cache.clone(), node_addresses.clone());
                if let Some(publisher) = vip_publisher.take() {
                    services = services.with_vips(publisher);
                }
                let trigger = (cache.subscribe(SERVICE_TRIGGER_KINDS), node_addresses.clone());
                tasks.add(runtime::spawn(services, trigger, AT_ONCE, stop.clone()));
            }
            (DesiredSource::Api(_), None) => unreachable!("the API source has a cache"),
        }
    }
    if let Some(cache) = &cache {
        if let Some(firewall) = firewall {
            let policy = PolicyController::new(firewall, cache.clone()).with_stamp(&config.pin_dir);
            tasks.add(runtime::spawn(policy, cache.subscribe(POLICY_KINDS), RunOptions::default(), stop.clone()));
        }
        let cni = config.node.cni.clone().map(|options| {
            CniWriter::new(options, config.node_name.clone(), config.node.node_ip.or_else(netif::default_route_source))
        });
        if config.services.run || cni.is_some() {
            let egress = config.services.run.then(|| egress.clone());
            let nets = NodeNetsController::new(cache.clone(), egress, cni, metrics.clone());
            tasks.add(runtime::spawn(nets, cache.subscribe(NODE_KINDS), NODE_PACED, stop.clone()));
        }
        if let Some(publisher) = vip_publisher.take() {
            let view = ServiceViewController::new(
                cache.clone(),
                publisher,
                config.node_name.clone(),
                config.external_ip_policy(),
                metrics.clone(),
            );
            tasks.add(runtime::spawn(view, cache.subscribe(SERVICE_TRIGGER_KINDS), AT_ONCE, stop.clone()));
        }
        let health = metrics.health_state();
        let writer = CheckpointWriter::new(cache.clone(), config.state_dir.clone(), metrics.clone())
            .first_write_when(Box::new(move || health.check().ready));
        tasks.add(runtime::spawn(writer, cache.subscribe(CHECKPOINT_KINDS), RunOptions::default(), stop.clone()));
    }
    tasks.add(runtime::spawn(stats, NoTrigger, RunOptions::default(), stop.clone()));
    // Without the API the configuration comes from flags; with it, from the Node objects (or
    // their checkpoint), as soon as they are known.
    let routing = config.router.clone().map(|options| {
        let router = BgpRouter::new(options, metrics.clone());
        let router = RoutingController::new(router, cache.clone(), vip_receiver.clone());
        // Woken by the Nodes and the VIPs (a channel that never changes when none are advertised).
        let vips = vip_receiver.clone().unwrap_or_else(|| watch::Sender::new(None).subscribe());
        match &cache {
            Some(cache) => {
                runtime::spawn(router, (cache.subscribe(routing::ROUTING_KINDS), vips), NODE_PACED, stop.clone())
            }
            None => runtime::spawn(router, NoTrigger, RunOptions::default(), stop.clone()),
        }
    });

    if let Some(routing) = &routing {
        tasks.statuses.push((routing.name, routing.status.clone()));
    }
    let statuses = std::mem::take(&mut tasks.statuses);
    let synced: crate::health::Synced = match &cache {
        Some(cache) => {
            let cache = cache.clone();
            Arc::new(move || cache.all_synced() || cache.restored())
        }
        None => Arc::new(|| true),
    };
    metrics.health_state().watch(statuses.clone(), synced);
    metrics.register_collector(runtime::ControllerMetrics(statuses));

    let applier = api.map(|(_, applier)| applier);
    tracing::info!("agent running");
    Ok(Started { applier, tasks: tasks.tasks, stop: stop_tx, routing })
}

/// The programs this agent's features put on interfaces.
fn programs(config: &AgentConfig) -> Programs {
    Programs { load_balancer: config.services.run, firewall: config.policy.run, xdp: config.datapath.xdp }
}

/// Writes the watchers' updates into the cache, from the start on, until the agent stops.
async fn apply_updates(mut updates: mpsc::Receiver<WatchUpdate>, cache: Arc<Cache>, metrics: Metrics) {
    while let Some(update) = updates.recv().await {
        record_api_contact(&update, &metrics);
        // Only a real change of a kind wakes its controllers (a relist that starts and fails, or
        // brings back the same objects, changes nothing).
        cache.apply(update);
    }
}

impl Started {
    async fn serve(self, mut signals: StopSignals) -> Result<()> {
        let signal = signals.received().await;
        tracing::info!(signal, "stop signal");
        // No update is applied after the signal: the controllers finish on what they have.
        if let Some(applier) = self.applier {
            applier.abort();
            let _ = applier.await;
        }
        // Leave programs, links, maps and kernel routes exactly as they are: traffic keeps
        // flowing without us. With graceful restart the BGP sessions close without a Cease, so
        // peers keep our routes until we are back. Each controller finishes what it is doing (a
        // checkpoint being written is finished; it is replaced atomically either way).
        let _ = self.stop.send(true);
        for task in self.tasks {
            let _ = task.await;
        }
        tracing::info!("stopping; datapath and routes left in place");
        if let Some(routing) = self.routing {
            if let Ok(routing) = routing.task.await {
                routing.into_router().shutdown().await;
            }
        }
        Ok(())
    }
}

/// The health listener (`--health-addr`, every address by default: the kubelet probes the node's) and the metrics listener
/// (`--metrics-addr`, the loopback address by default). One that cannot bind is logged; the
/// agent runs on without it.
async fn serve_http(config: &ListenerOptions, metrics: &Metrics) {
    if config.health_port != 0 {
        match tokio::net::TcpListener::bind((config.health_addr, config.health_port)).await {
            Ok(listener) => {
                tracing::info!(addr = %config.health_addr, port = config.health_port, "serving /healthz, /livez and /readyz");
                tokio::spawn(crate::http::serve_health(metrics.clone(), listener));
            }
            Err(e) => tracing::error!(port = config.health_port, error = %e, "cannot serve the health endpoints"),
        }
    }
    if config.metrics_port != 0 {
        let addr = std::net::SocketAddr::new(config.metrics_addr, config.metrics_port);
        match tokio::net::TcpListener::bind(addr).await {
            Ok(listener) => {
                tracing::info!(%addr, path = config.metrics_path, "serving metrics, /bgp and health");
                tokio::spawn(crate::http::serve_metrics(metrics.clone(), listener, config.metrics_path.clone()));
            }
            Err(e) => tracing::error!(%addr, error = %e, "cannot serve the metrics"),
        }
    }
}

/// The spawned controllers: their tasks, and their statuses for the metrics.
#[derive(Default)]
struct Controllers {
    tasks: Vec<JoinHandle<()>>,
    statuses: Vec<(&'static str, watch::Receiver<Status>)>,
}

impl Controllers {
    fn add<C: Send + 'static>(&mut self, running: Running<C>) {
        self.statuses.push((running.name, running.status.clone()));
        self.tasks.push(running.detach());
    }
}

/// Every subsystem's metrics, registered before the first scrape (each is also registered by
/// the first use of [`Metrics::of`]; here so that a part that has not recorded anything yet
/// still shows its families, as before it ran).
pub fn register_metrics(metrics: &Metrics) {
    metrics.of::<crate::kr_metrics::BuildInfo>();
    metrics.of::<crate::map_writes::MapMetrics>();
    metrics.of::<crate::controllers::services::ServiceMetrics>();
    metrics.of::<crate::kr_metrics::ServiceCounters>();
    metrics.of::<AgentMetrics>();
    metrics.of::<crate::controllers::datapath_stats::DatapathMetrics>();
    metrics.of::<crate::controllers::node_nets::CniMetrics>();
    metrics.of::<crate::policy::engine::PolicyMetrics>();
    metrics.of::<crate::routing::router::RoutingMetrics>();
    metrics.of::<crate::bpf::socket_lb::SocketLbMetrics>();
    metrics.of::<crate::bpf::attach_metrics::AttachMetrics>();
    metrics.of::<crate::http::HttpMetrics>();
    metrics.of::<crate::process_metrics::ProcessMetrics>();
}

/// The API server's reachability, from what the watchers report.
fn record_api_contact(update: &WatchUpdate, metrics: &Metrics) {
    match update {
        WatchUpdate::Error { resource, message } => {
            // Reachability is the probe's to say: a 500 is an answer, a timeout is not.
            tracing::warn!(resource, error = %message, "API watch failed; retrying with backoff, datapath unchanged");
            metrics.of::<AgentMetrics>().api_errors.inc();
        }
        WatchUpdate::Probe { reachable: false, message } => {
            let api = metrics.of::<AgentMetrics>();
            if api.api_reachable.set(0) == 1 {
                tracing::warn!(error = %message, "API server unreachable; datapath, routes and BGP stay as they are");
            }
            api.api_errors.inc();
        }
        update if update.is_api_answer() => {
            let api = metrics.of::<AgentMetrics>();
            if api.api_reachable.set(1) == 0 {
                tracing::info!("API server reachable");
            }
            api.last_api_contact.set(metrics::unix_now());
        }
        _ => {}
    }
}

/// Starts the watchers; the cache starts from the checkpoint when there is one.
async fn start_api_source(
    options: &ApiOptions,
    saved: Result<checkpoint::Restored, checkpoint::CheckpointError>,
    metrics: &Metrics,
) -> Result<(Arc<Cache>, mpsc::Receiver<WatchUpdate>)> {
    let client = watchers::client(options).await?;
    let (sender, updates) = mpsc::channel(1024);
    watchers::spawn_watchers(client, sender);
    let mut objects = ClusterObjects::default();
    let restored_from_checkpoint: Option<f64> = match saved {
        Ok(saved) => {
            let age = metrics::unix_now() - saved.written_unix;
            tracing::info!(
                services = saved.services.len(),
                endpoint_slices = saved.endpoint_slices.len(),
                age_secs = age as u64,
                "restored desired state from checkpoint until the API server lists it"
            );
            let taken = saved.written_unix;
            objects.restore_from(saved);
            metrics.of::<AgentMetrics>().checkpoint_restores.inc();
            Some(taken)
        }
        Err(checkpoint::CheckpointError::Missing(_)) => None,
        Err(e) => {
            // The maps stay as the previous agent left them; the API will tell us the truth.
            tracing::error!(error = %e, "ignoring checkpoint");
            metrics.of::<AgentMetrics>().checkpoint_errors.inc();
            None
        }
    };
    Ok((Cache::new(objects, restored_from_checkpoint), updates))
}

/// The checkpoint in `state_dir`, its directory and file made private first (an older agent
/// left them 0755 and 0644).
fn read_checkpoint(state_dir: &Path) -> Result<checkpoint::Restored, checkpoint::CheckpointError> {
    if let Err(e) = checkpoint::restrict_permissions(state_dir) {
        tracing::warn!(error = %e, dir = %state_dir.display(), "cannot make the state directory private");
    }
    checkpoint::read_for_restore(state_dir).map(|(restored, _)| restored)
}

/// Used by tests and tooling: what `ServiceMaps::read_all` sees now.
pub fn read_programmed(pin_dir: &Path) -> Result<crate::services::compile::MapContents> {
    use crate::services::sync::ServiceMaps;
    Ok(BpfServiceMaps::open_pinned(pin_dir)?.read_all()?)
}

/// [`read_programmed`] of the IPv6 maps.
pub fn read_programmed_v6(pin_dir: &Path) -> Result<crate::services::compile::MapContents<V6>> {
    use crate::services::sync::ServiceMaps;
    Ok(BpfServiceMapsV6::open_pinned(pin_dir)?.read_all()?)
}

/// The policy programs track only pods a policy isolates (`pol_cfg`, docs/datapath.md);
/// `KUBE_ROUTER_POLICY_CT_GATE=off` tracks every pod's flows, as before the gate: a flow a pod
/// had before its first isolating policy then keeps passing (for benchmarks, and for clusters
/// that need that more than the per-packet cost).
fn write_policy_ct_gate(pin_dir: &std::path::Path) -> Result<()> {
    let track_all = std::env::var("KUBE_ROUTER_POLICY_CT_GATE").is_ok_and(|v| v == "off");
    if track_all {
        tracing::info!("policy conntrack gate off: every pod's flows tracked (KUBE_ROUTER_POLICY_CT_GATE=off)");
    }
    crate::policy::maps::write_policy_ct_gate(pin_dir, track_all).context("writing pol_cfg")
}

/// Opens the load balancer's gate (`services::maps::gate`) now that every link runs our programs.
/// `KUBE_ROUTER_LB_GATE=off` keeps it closed: every packet takes the conntrack lookup, as before
/// the gate (for benchmarks comparing the two in one run). A failure leaves it closed.
fn open_lb_gate(pin_dir: &std::path::Path) {
    if std::env::var("KUBE_ROUTER_LB_GATE").is_ok_and(|v| v == "off") {
        tracing::info!("load balancer gate kept closed (KUBE_ROUTER_LB_GATE=off)");
        return;
    }
    match crate::services::maps::gate::open(pin_dir) {
        Ok(recorded) => tracing::info!(recorded, "load balancer gate open"),
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "cannot open the load balancer gate; every packet is looked up")
        }
    }
}
