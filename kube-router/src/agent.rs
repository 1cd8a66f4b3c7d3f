//! The agent's main loop: program the datapath from the desired state and keep it there.
//!
//! Desired state comes from the API server (watchers) or from a file. Whatever happens to the
//! source — unreachable, slow, failing, an unreadable file — the maps are only ever written
//! with a difference computed from a state we trust, and deletions only happen after a complete
//! listing of every kind since start (mark, then sweep).
use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr},
    path::{Path, PathBuf},
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context, Result};
use kube_router_common::{
    lb_stat, map_names, pol_stat, LbConfig, ServiceStats, LB_CONFIG_MASQUERADE_ALL, LB_CONFIG_POD_EGRESS,
};
use tokio::{
    signal::unix::{signal, SignalKind},
    sync::mpsc,
};

use crate::{
    bpf::{
        datapath::{AttachOutcome, Datapath},
        policy_maps::{read_policy_stats, PolicyConntrack},
        service_maps::{
            read_lb_stats, sync_cluster_nets, sync_cluster_nets_of, write_lb_config, BpfServiceMaps, BpfServiceMapsV6,
            Conntrack, ConntrackV6,
        },
        socket_lb::{self, SocketLbOptions},
        svc_stats::{SvcStatsMap, SvcStatsMapV6},
    },
    firewall::FirewallController,
    k8s::{
        checkpoint,
        watch::{self, ApiOptions, ClusterObjects, Kind, WatchUpdate},
    },
    kr_metrics::{FrontendId, FrontendOwner},
    metrics::{self, Metrics},
    netif,
    router::{RouterController, RouterOptions},
    services::{
        compile::{assign_ids, CompileWarning, LbPlan, Limits, MapContents},
        family::{AddressFamily, IpFamily, V4, V6},
        incremental::{Changed, FamilyCompiler, ServiceCatalog},
        model::{ExternalIpPolicy, NodeContext, ServiceName},
        source::{load_file, StateBuilder},
        sync::{ServiceMaps, ServiceSync, SyncReport},
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
    pub nodeport_addresses: Option<Vec<IpAddr>>,
    pub limits: Limits,
    pub metrics_port: u16,
    pub health_port: u16,
    pub conntrack_gc_interval: Duration,
    /// `--hairpin-mode`.
    pub hairpin_mode: bool,
    /// `--bpf-lb-algorithm maglev`.
    pub maglev_all: bool,
    /// `--masquerade-all`.
    pub masquerade_all: bool,
    /// `--snat-port-range`, inclusive.
    pub snat_port_range: (u16, u16),
    /// `--node-ip`: the address source-NATed flows leave with.
    pub node_ip: Option<Ipv4Addr>,
    /// `--enable-pod-egress`: masquerade pod traffic leaving the cluster.
    pub pod_egress: bool,
    /// `--tc-mode`: node interfaces.
    pub attach_mode: crate::bpf::datapath::AttachMode,
    /// `--tc-mode`: pod veths (classic under `auto`).
    pub pod_attach_mode: crate::bpf::datapath::AttachMode,
    /// Netlink link and address notifications (else only the periodic rescan).
    pub link_events: bool,
    /// `--bpf-lb-map-max`, `--bpf-ct-global-max`.
    pub map_sizes: crate::bpf::layout::MapSizes,
    /// `--enable-cni`: write the node's CNI configuration.
    pub cni: Option<CniOptions>,
    /// `--cluster-cidr`.
    pub cluster_cidrs: Vec<ipnet::IpNet>,
    /// `--service-cluster-ip-range`.
    pub service_ranges: Vec<ipnet::IpNet>,
    /// `--service-external-ip-range`.
    pub external_ip_ranges: Vec<ipnet::IpNet>,
    /// `--loadbalancer-ip-range`.
    pub load_balancer_ip_ranges: Vec<ipnet::IpNet>,
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
    maps_v6: BpfServiceMapsV6,
    sync_v6: ServiceSync<V6>,
    metrics: Metrics,
    limits: Limits,
    node_name: String,
    nodeport_addresses: Option<Vec<IpAddr>>,
    hairpin_all: bool,
    external_ips: ExternalIpPolicy,
    /// Warnings already logged, so one that persists is reported once.
    reported: BTreeSet<String>,
    /// Maps that had no room for every entry at the last sync.
    full_maps: BTreeSet<&'static str>,
    /// This node's `topology.kubernetes.io/zone` (topology-aware routing), from its Node.
    zone: Option<String>,
    /// The health check ports the node serves (`spec.healthCheckNodePort`).
    health_checks: tokio::sync::watch::Sender<BTreeMap<u16, crate::healthcheck::LocalEndpoints>>,
    loopback_node_ports: bool,
    maglev_all: bool,
    compiler: FamilyCompiler<V4>,
    compiler_v6: FamilyCompiler<V6>,
    /// The node as the last compile saw it.
    last_node: Option<NodeContext>,
    /// `KUBE_ROUTER_FULL_SERVICE_COMPILE=1`: convert and compile every Service on every change
    /// (the path before incremental compilation; for benchmarks and comparisons).
    full_compile_only: bool,
}

impl ServiceController {
    fn node_context(&self) -> NodeContext {
        let mut external_ips = self.external_ips.clone();
        // The node's own addresses are never a Service's to capture.
        let node_addresses = netif::node_addresses();
        external_ips.forbidden.extend(node_addresses.iter().map(|a| ipnet::IpNet::from(*a)));
        // IPv6 Services need an IPv6 address on the node to carry their traffic. IPv4 is always
        // served, as kube-proxy serves its primary family: a node whose address is not up yet
        // (or a test namespace with only loopback) must not lose every Service.
        let unavailable_families = [IpFamily::IPv6]
            .into_iter()
            .filter(|family| !node_addresses.iter().any(|a| IpFamily::of(a) == *family))
            .collect();
        NodeContext {
            name: self.node_name.clone(),
            node_port_addrs: self.nodeport_addresses.clone().unwrap_or(node_addresses),
            unavailable_families,
            hairpin_all: self.hairpin_all,
            external_ips,
            zone: self.zone.clone(),
            loopback_node_ports: self.loopback_node_ports,
            maglev_all: self.maglev_all,
        }
    }

    /// Compiles the Services of `catalog` that `changed` names (all of them when the node, a
    /// flag, an unfinished listing or a failed write makes that necessary) and writes only the
    /// differences. `complete` says the state reflects a full listing of every kind, which is
    /// what allows deletions. Returns the number of failed writes (left for a retry).
    fn apply(&mut self, catalog: &ServiceCatalog, changed: Changed, complete: bool) -> u64 {
        let started = Instant::now();
        let mut current = BTreeSet::new();
        // Each distinct problem is logged and counted once, however often the state is rebuilt.
        for problem in catalog.problems() {
            let text = format!("{problem:?}");
            if !self.reported.contains(&text) {
                let kind: &'static str = if problem.kind == "Service" { "Service" } else { "EndpointSlice" };
                let (object, error) = (problem.name.as_str(), problem.message.as_str());
                if problem.partial {
                    tracing::warn!(kind, object, error, "part of an object left out; the rest is programmed");
                } else {
                    tracing::error!(kind, object, error, "rejected object; its programmed state is kept as it was");
                }
                self.metrics.with(|m| *m.rejected_objects.entry(kind).or_default() += 1);
            }
            current.insert(text);
        }
        let node = self.node_context();
        // NodePorts, zone hints, families and flags follow the node: a change recompiles all.
        let node_changed = self.last_node.as_ref() != Some(&node);
        self.last_node = Some(node.clone());
        let changed = match changed {
            Changed::Services(names) if complete && !node_changed && !self.full_compile_only => Some(names),
            _ => None,
        };
        let limits = self.limits;
        let (mut report, owners) = sync_family(
            &mut self.compiler,
            &mut self.sync,
            &mut self.maps,
            catalog,
            changed.as_ref(),
            &node,
            limits,
            complete,
        );
        let (report_v6, owners_v6) = sync_family(
            &mut self.compiler_v6,
            &mut self.sync_v6,
            &mut self.maps_v6,
            catalog,
            changed.as_ref(),
            &node,
            limits,
            complete,
        );
        report.merge(report_v6);
        let alone = matches!((&owners, &owners_v6), (OwnerUpdate::Some(_), OwnerUpdate::Some(_)));
        for warning in self.compiler.warnings().chain(self.compiler_v6.warnings()) {
            let text = format!("{warning:?}");
            if !self.reported.contains(&text) {
                match warning {
                    CompileWarning::FrontendConflict { .. } => tracing::error!(?warning, "frontend claimed twice"),
                    CompileWarning::EndpointsTruncated { .. } => tracing::warn!(?warning, "too many endpoints"),
                    CompileWarning::ExternalIpRefused { service, reason } => {
                        tracing::error!(service = %service, reason, "external IP refused; the rest of the Service is programmed");
                        self.metrics.with(|m| *m.rejected_objects.entry("ExternalIP").or_default() += 1);
                    }
                    CompileWarning::FamilyUnavailable { service, family } => {
                        tracing::warn!(service = %service, ?family, "the node has no address of this family; the Service is not programmed in it");
                        self.metrics.with(|m| *m.rejected_objects.entry("IPFamily").or_default() += 1);
                    }
                }
            }
            current.insert(text);
        }
        self.reported = current;
        self.health_checks.send_if_modified(|checks| {
            let now = crate::healthcheck::health_checks(&catalog.state, &self.node_name);
            let changed = *checks != now;
            *checks = now;
            changed
        });
        self.report_full_maps(&report);
        let total = report.total();
        let programmed = self.sync.programmed();
        let programmed_v6 = self.sync_v6.programmed();
        // Totals over both families.
        tracing::info!(
            inserts = total.inserts,
            updates = total.updates,
            deletes = total.deletes,
            errors = total.errors,
            complete,
            incremental = alone,
            services = programmed.services.len() + programmed_v6.services.len(),
            backends = programmed.backends.len() + programmed_v6.backends.len(),
            "service sync complete"
        );
        self.metrics.record_sync(&report, started.elapsed());
        let dropped_endpoints = self.compiler.dropped_endpoints() + self.compiler_v6.dropped_endpoints();
        self.metrics.with(|m| {
            m.dropped_endpoints = dropped_endpoints;
            m.map_entries.insert(map_names::SERVICES, programmed.services.len() as u64);
            m.map_entries.insert(map_names::BACKEND_SLOTS, programmed.slots.len() as u64);
            m.map_entries.insert(map_names::BACKENDS, programmed.backends.len() as u64);
            m.map_entries.insert(map_names::SERVICES_V6, programmed_v6.services.len() as u64);
            m.map_entries.insert(map_names::BACKEND_SLOTS_V6, programmed_v6.slots.len() as u64);
            m.map_entries.insert(map_names::BACKENDS_V6, programmed_v6.backends.len() as u64);
            // Label each frontend with its Service; a rejected Service's kept frontends keep theirs.
            owners.update(&mut m.kr.frontends, programmed);
            owners_v6.update(&mut m.kr.frontends, programmed_v6);
        });
        self.metrics.heartbeat("services");
        // A full map is retried when the desired state changes (space may free), not on a timer.
        total.errors - total.full
    }

    /// Logs a map becoming full, and having room again, once per transition.
    fn report_full_maps(&mut self, report: &crate::services::sync::SyncReport) {
        let now: BTreeSet<&'static str> =
            report.per_map.iter().filter(|(_, c)| c.full > 0).map(|(map, _)| *map).collect();
        for map in now.difference(&self.full_maps) {
            let waiting = report.per_map[map].full;
            tracing::error!(
                map,
                waiting,
                "map is full: entries already programmed stay, new ones wait until space frees"
            );
        }
        for map in self.full_maps.difference(&now) {
            tracing::info!(map, "map has room again; every entry is programmed");
        }
        self.metrics.with(|m| {
            for map in [V4::MAPS, V6::MAPS].iter().flat_map(|f| [f.services, f.slots, f.backends, f.source_ranges]) {
                m.map_full.insert(map, now.contains(map));
            }
        });
        self.full_maps = now;
    }
}

/// How a sync changed which Service owns each programmed frontend (for the metrics' labels).
enum OwnerUpdate<F: AddressFamily> {
    /// Everything was compiled: the whole plan.
    All(LbPlan<F>),
    /// Only these frontends were compiled: each one's owner now, `None` when it is not programmed.
    Some(Vec<(FrontendId, Option<FrontendOwner>)>),
}

impl<F: AddressFamily> OwnerUpdate<F> {
    /// Brings the owners of this family's frontends in `owners` (both families') up to date.
    fn update(&self, owners: &mut BTreeMap<FrontendId, FrontendOwner>, programmed: &MapContents<F>) {
        match self {
            OwnerUpdate::All(plan) => {
                let family = |id: &FrontendId| IpFamily::of(&id.addr) == F::FAMILY;
                let (mut previous, others) = std::mem::take(owners).into_iter().partition(|(id, _)| family(id));
                *owners = others;
                owners.extend(frontend_owners(programmed, plan, &mut previous));
            }
            OwnerUpdate::Some(touched) => {
                for (id, owner) in touched {
                    match owner {
                        Some(owner) => {
                            owners.insert(*id, owner.clone());
                        }
                        None => {
                            owners.remove(id);
                        }
                    }
                }
            }
        }
    }
}

/// Each programmed frontend of one family with its Service: from the plan, else (a rejected
/// Service's kept frontend) the owner it had.
fn frontend_owners<F: AddressFamily>(
    programmed: &MapContents<F>,
    lb_plan: &LbPlan<F>,
    previous: &mut BTreeMap<FrontendId, FrontendOwner>,
) -> BTreeMap<FrontendId, FrontendOwner> {
    programmed
        .services
        .keys()
        .filter_map(|key| {
            let id = FrontendId::of::<F>(key);
            let owner = match lb_plan.frontends.get(key) {
                Some(f) => FrontendOwner {
                    namespace: f.backend_set.service.namespace.to_string(),
                    name: f.backend_set.service.name.to_string(),
                },
                None => previous.remove(&id)?,
            };
            Some((id, owner))
        })
        .collect()
}

/// Every frontend's counters from `svc_stats_v4` and `svc_stats_v6`.
fn read_service_stats(pin_dir: &Path) -> Result<BTreeMap<FrontendId, ServiceStats>> {
    let v4 = SvcStatsMap::open_pinned(pin_dir)?.read_all()?;
    let v6 = SvcStatsMapV6::open_pinned(pin_dir)?.read_all()?;
    let v4 = v4.into_iter().map(|(key, stats)| (FrontendId::of::<V4>(&key), stats));
    Ok(v4.chain(v6.into_iter().map(|(key, stats)| (FrontendId::of::<V6>(&key), stats))).collect())
}

/// Brings one family's maps to the desired state: only the `changed` Services' entries when
/// the compiler can do that, else everything.
#[allow(clippy::too_many_arguments)]
fn sync_family<F: AddressFamily>(
    compiler: &mut FamilyCompiler<F>,
    sync: &mut ServiceSync<F>,
    maps: &mut impl ServiceMaps<F>,
    catalog: &ServiceCatalog,
    changed: Option<&BTreeSet<ServiceName>>,
    node: &NodeContext,
    limits: Limits,
    complete: bool,
) -> (SyncReport, OwnerUpdate<F>) {
    if let Some(changed) = changed {
        if let Some(increment) = compiler.compile_changed(catalog, changed, node, limits, sync.programmed()) {
            let report = sync.write(maps, increment.ops.clone());
            compiler.written(&increment, report.total().errors == 0);
            if report.total().full > 0 && report.total().deletes > 0 {
                // This pass freed room in a full map: a full pass programs what waited, in the
                // documented priority order, as a full sync's second pass does.
                let lb_plan = compiler.plan_all(catalog, node, limits);
                let second = sync_all(sync, maps, &lb_plan, complete);
                compiler.adopt(&lb_plan, sync.programmed(), complete && second.total().errors == 0);
                return (add_second_pass(report, second), OwnerUpdate::All(lb_plan));
            }
            let programmed = sync.programmed();
            let owners = increment
                .frontends()
                .map(|key| {
                    let owner = programmed.services.contains_key(key).then(|| {
                        increment.plan.frontends.get(key).map(|f| FrontendOwner {
                            namespace: f.backend_set.service.namespace.to_string(),
                            name: f.backend_set.service.name.to_string(),
                        })
                    });
                    (FrontendId::of::<F>(key), owner.flatten())
                })
                .collect();
            return (report, OwnerUpdate::Some(owners));
        }
    }
    let lb_plan = compiler.plan_all(catalog, node, limits);
    let report = sync_all(sync, maps, &lb_plan, complete);
    compiler.adopt(&lb_plan, sync.programmed(), complete && report.total().errors == 0);
    (report, OwnerUpdate::All(lb_plan))
}

/// Brings one family's maps to `lb_plan`. Inserts come before deletes: when a map was full and
/// this pass freed room, one more pass with the same plan programs what waited.
fn sync_all<F: AddressFamily>(
    sync: &mut ServiceSync<F>,
    maps: &mut impl ServiceMaps<F>,
    lb_plan: &LbPlan<F>,
    complete: bool,
) -> SyncReport {
    let desired = assign_ids(lb_plan, sync.programmed());
    let report = sync.sync(maps, &desired, complete);
    if report.total().full > 0 && report.total().deletes > 0 {
        let desired = assign_ids(lb_plan, sync.programmed());
        let second = sync.sync(maps, &desired, complete);
        return add_second_pass(report, second);
    }
    report
}

/// The writes of both passes; the errors of the second (what still waits).
fn add_second_pass(mut report: SyncReport, second: SyncReport) -> SyncReport {
    for (map, counts) in second.per_map {
        let total = report.per_map.entry(map).or_default();
        total.inserts += counts.inserts;
        total.updates += counts.updates;
        total.deletes += counts.deletes;
        total.errors = counts.errors;
        total.full = counts.full;
    }
    report
}

const TOPOLOGY_ZONE_LABEL: &str = "topology.kubernetes.io/zone";

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
            if controller.apply(&ServiceCatalog::from_builder(builder), Changed::All, true) > 0 {
                self.stamp = None;
            }
        }
    }
}

struct ApiSource {
    objects: ClusterObjects,
    /// The Services and EndpointSlices converted, kept up to date object by object.
    catalog: ServiceCatalog,
    /// The Services changed since the last sync.
    changed: Changed,
    updates: mpsc::Receiver<WatchUpdate>,
    dirty: bool,
    restored_from_checkpoint: bool,
    retry_at: Option<Instant>,
}

/// Attaches one feature's ingress and egress programs to an interface.
type AttachFn = fn(&mut Datapath, &str) -> Result<[AttachOutcome; 2]>;

/// Attaches both features to every interface (or the `--interfaces` list) not yet attached.
/// `attached` maps names to the interface index they were attached at: an interface deleted
/// and re-created under the same name (a StatefulSet pod's veth) has a new index and is
/// attached again; vanished ones are forgotten.
fn attach_all(
    datapath: &mut Datapath,
    wanted: &Option<Vec<String>>,
    attached: &mut BTreeMap<String, u32>,
    load_balancer: bool,
    firewall: bool,
) {
    let present: BTreeMap<String, u32> = netif::interfaces_with_index().into_iter().collect();
    attached.retain(|name, index| present.get(name) == Some(index));
    crate::bpf::datapath::prune_vanished(datapath.pin_dir(), &present.keys().cloned().collect());
    let interfaces = wanted.clone().unwrap_or_else(|| present.keys().cloned().collect());
    let uplinks = netif::default_route_interfaces();
    for interface in interfaces {
        let Some(&index) = present.get(&interface) else { continue };
        if attached.contains_key(&interface) {
            continue;
        }
        let mut ok = true;
        // Policy on pod veths only (docs/requirements.md), so host and transit flows never
        // fill its conntrack; an explicit --interfaces list gets both everywhere.
        let pod_side = wanted.is_some() || netif::is_pod_interface(&interface, &uplinks);
        if firewall && !pod_side {
            for hook in crate::bpf::datapath::Hook::POLICY {
                match datapath.detach_hook(hook, &interface) {
                    Ok(true) => {
                        tracing::info!(interface, program = hook.program(), "not a pod interface: policy detached")
                    }
                    Ok(false) => {}
                    Err(e) => tracing::warn!(interface, error = format!("{e:#}"), "cannot detach the policy"),
                }
            }
        }
        // Pod veths found by the agent itself are attached in the pod mode (fast); an explicit
        // --interfaces list in the node mode.
        let pod = wanted.is_none() && pod_side;
        let hooks: [(bool, &str, AttachFn); 2] = [
            (load_balancer, "load balancer", if pod { Datapath::attach_pod } else { Datapath::attach }),
            (
                firewall && pod_side,
                "network policy",
                if pod { Datapath::attach_policy_pod } else { Datapath::attach_policy },
            ),
        ];
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
            attached.insert(interface, index);
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

fn refresh_datapath_metrics(pin_dir: &Path, metrics: &Metrics, conntrack: &mut (Conntrack, ConntrackV6), gc: bool) {
    if let Ok(stats) = read_lb_stats(pin_dir) {
        metrics.with(|m| m.datapath_packets = lb_stat::NAMES.iter().copied().zip(stats).collect());
    }
    socket_lb::refresh_metrics(pin_dir, metrics);
    let started = Instant::now();
    match read_service_stats(pin_dir) {
        Ok(stats) => metrics.with(|m| {
            m.kr.sample(started, stats);
            m.kr.stats_export_time.observe(started.elapsed().as_secs_f64());
        }),
        Err(e) => tracing::debug!(error = %e, "cannot read svc_stats_v4/v6"),
    }
    if gc {
        let (v4, v6) = conntrack;
        match v4.collect_garbage().and_then(|a| Ok((a, v6.collect_garbage()?))) {
            Ok(((left, removed), (left_v6, removed_v6))) => metrics.with(|m| {
                m.conntrack_entries = (left + left_v6) as u64;
                m.conntrack_gc_removed += (removed + removed_v6) as u64;
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
    // Converted now: the BGP speaker finds a Service's EndpointSlices through the catalog.
    let mut catalog = ServiceCatalog::default();
    if restored_from_checkpoint {
        objects.update_catalog(&mut catalog);
    }
    Ok(ApiSource {
        objects,
        catalog,
        changed: Changed::All,
        updates,
        dirty: restored_from_checkpoint,
        restored_from_checkpoint,
        retry_at: None,
    })
}

#[derive(Clone, Debug)]
pub struct CniOptions {
    /// `--cni-conf-file`.
    pub conf_file: PathBuf,
    /// `--auto-mtu`.
    pub auto_mtu: bool,
}

/// The CNI role: this node's configuration and pod bridge, from its Node object. A failure is
/// logged when it first happens (or changes) and counted; nothing else is touched.
struct CniWriter {
    options: CniOptions,
    node_name: String,
    snat_addr: Option<Ipv4Addr>,
    last_error: Option<String>,
}

impl CniWriter {
    async fn sync<'a>(&mut self, nodes: impl Iterator<Item = &'a k8s_openapi::api::core::v1::Node>, metrics: &Metrics) {
        let result = self.try_sync(nodes).await;
        match result {
            Ok(written) => {
                if written {
                    tracing::info!(path = %self.options.conf_file.display(), "CNI configuration written");
                }
                self.last_error = None;
            }
            Err(e) => {
                let error = format!("{e:#}");
                if self.last_error.as_ref() != Some(&error) {
                    tracing::error!(
                        node = self.node_name,
                        error,
                        "cannot configure the pod network (CNI); datapath unaffected"
                    );
                    metrics.with(|m| m.cni_errors += 1);
                    self.last_error = Some(error);
                }
            }
        }
    }

    async fn try_sync<'a>(
        &self,
        mut nodes: impl Iterator<Item = &'a k8s_openapi::api::core::v1::Node>,
    ) -> Result<bool> {
        let node = nodes
            .find(|n| n.metadata.name.as_deref() == Some(self.node_name.as_str()))
            .with_context(|| format!("no Node object named {:?}", self.node_name))?;
        let spec = node.spec.as_ref();
        let raw = spec.and_then(|s| s.pod_cidrs.clone()).filter(|c| !c.is_empty());
        let raw = raw.or_else(|| spec.and_then(|s| s.pod_cidr.clone()).map(|c| vec![c])).unwrap_or_default();
        let pod_cidrs = raw
            .iter()
            .map(|c| c.parse::<ipnet::IpNet>().with_context(|| format!("Node podCIDR {c:?} is not a CIDR")))
            .collect::<Result<Vec<_>>>()?;
        let mtu = if self.options.auto_mtu { self.snat_addr.and_then(netif::mtu_of_address) } else { None };
        let template = crate::cni::template_at(&self.options.conf_file);
        let conflist = crate::cni::conflist(&template, &pod_cidrs, mtu)?;
        let written = crate::cni::write_if_changed(&self.options.conf_file, &conflist)?;
        netif::ensure_bridge(crate::cni::BRIDGE, &crate::cni::gateways(&pod_cidrs)).await?;
        Ok(written)
    }
}

/// Brings `cluster_nets_v4` and `cluster_nets_v6` (what pod egress masquerade treats as inside) up to date.
fn sync_egress_nets<'a>(config: &AgentConfig, nodes: impl IntoIterator<Item = &'a k8s_openapi::api::core::v1::Node>) {
    let nodes: Vec<&k8s_openapi::api::core::v1::Node> = nodes.into_iter().collect();
    let nets = crate::egress::cluster_nets(nodes.iter().copied(), &config.cluster_cidrs, &config.service_ranges);
    match sync_cluster_nets(&config.pin_dir, &nets) {
        Ok(0) => {}
        Ok(writes) => tracing::info!(prefixes = nets.len(), writes, "cluster prefixes for pod egress updated"),
        Err(e) => tracing::error!(
            error = format!("{e:#}"),
            "cannot write cluster_nets_v4; pod egress masquerade may be wrong"
        ),
    }
    let nets = crate::egress::cluster_nets_of::<V6>(nodes, &config.cluster_cidrs, &config.service_ranges);
    match sync_cluster_nets_of::<V6>(&config.pin_dir, &nets) {
        Ok(0) => {}
        Ok(writes) => tracing::info!(prefixes = nets.len(), writes, "IPv6 cluster prefixes for pod egress updated"),
        Err(e) => tracing::error!(
            error = format!("{e:#}"),
            "cannot write cluster_nets_v6; pod egress masquerade may be wrong"
        ),
    }
}

/// The load balancer's maps and the controller that writes them.
struct ServiceProxy {
    controller: ServiceController,
    conntrack: (Conntrack, ConntrackV6),
}

impl ServiceProxy {
    fn start(
        config: &AgentConfig,
        metrics: &Metrics,
        health_checks: tokio::sync::watch::Sender<BTreeMap<u16, crate::healthcheck::LocalEndpoints>>,
    ) -> Result<Self> {
        let maps = BpfServiceMaps::open_pinned(&config.pin_dir)?;
        let sync = ServiceSync::adopt(&maps).context("reading the programmed service maps")?;
        let maps_v6 = BpfServiceMapsV6::open_pinned(&config.pin_dir)?;
        let sync_v6 = ServiceSync::adopt(&maps_v6).context("reading the programmed IPv6 service maps")?;
        tracing::info!(
            services = sync.programmed().services.len(),
            backends = sync.programmed().backends.len(),
            services_v6 = sync_v6.programmed().services.len(),
            backends_v6 = sync_v6.programmed().backends.len(),
            "adopted programmed state"
        );
        let controller = ServiceController {
            maps,
            sync,
            maps_v6,
            sync_v6,
            metrics: metrics.clone(),
            limits: config.limits,
            node_name: config.node_name.clone(),
            nodeport_addresses: config.nodeport_addresses.clone(),
            hairpin_all: config.hairpin_mode,
            external_ips: ExternalIpPolicy {
                external_ip_ranges: config.external_ip_ranges.clone(),
                load_balancer_ranges: config.load_balancer_ip_ranges.clone(),
                forbidden: config.cluster_cidrs.iter().chain(&config.service_ranges).copied().collect(),
            },
            reported: BTreeSet::new(),
            full_maps: BTreeSet::new(),
            zone: None,
            health_checks,
            loopback_node_ports: config.socket_lb.enabled,
            maglev_all: config.maglev_all,
            compiler: FamilyCompiler::default(),
            compiler_v6: FamilyCompiler::default(),
            last_node: None,
            full_compile_only: full_compile_only(),
        };
        let snat_addr =
            config.node_ip.or_else(netif::default_route_source).or_else(|| netif::ipv4_addresses().first().copied());
        let snat_addr_v6 = netif::default_route_source_v6().or_else(|| netif::ipv6_addresses().first().copied());
        let lb_config = LbConfig {
            snat_addr: snat_addr.map(crate::services::compile::addr_be).unwrap_or(0),
            snat_addr_v6: snat_addr_v6.map(V6::words).unwrap_or_default(),
            snat_port_min: config.snat_port_range.0,
            snat_port_max: config.snat_port_range.1,
            flags: if config.masquerade_all { LB_CONFIG_MASQUERADE_ALL } else { 0 }
                | if config.pod_egress { LB_CONFIG_POD_EGRESS } else { 0 },
            pad: 0,
        };
        write_lb_config(&config.pin_dir, &lb_config)?;
        tracing::info!(snat_address = ?snat_addr, snat_address_v6 = ?snat_addr_v6, ports = ?config.snat_port_range, masquerade_all = config.masquerade_all, "source NAT configured");
        let conntrack = (Conntrack::open_pinned(&config.pin_dir)?, ConntrackV6::open_pinned(&config.pin_dir)?);
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
    let mut datapath = if config.run_service_proxy || config.run_firewall {
        Some(Datapath::load_sized(&config.pin_dir, config.attach_mode, Some(config.map_sizes))?)
    } else {
        None
    };
    let mut attached = BTreeMap::new();
    if let Some(datapath) = datapath.as_mut() {
        datapath.set_pod_mode(config.pod_attach_mode);
        attach_all(datapath, &config.interfaces, &mut attached, config.run_service_proxy, config.run_firewall);
        socket_lb::apply(datapath, &config.socket_lb, &metrics);
        // The links run our programs now: an upgrade from the previous map layout can complete.
        datapath.finish_upgrade().context("finishing the upgrade of the pinned maps")?;
    }
    let (health_checks, health_check_ports) = tokio::sync::watch::channel(BTreeMap::new());
    tokio::spawn(crate::healthcheck::serve(health_check_ports, metrics.clone()));
    let mut service_proxy =
        if config.run_service_proxy { Some(ServiceProxy::start(&config, &metrics, health_checks)?) } else { None };
    if service_proxy.is_some() && matches!(config.source, DesiredSource::File(_)) {
        sync_egress_nets(&config, []);
    }
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
    let mut cni = config.cni.clone().map(|options| CniWriter {
        options,
        node_name: config.node_name.clone(),
        snat_addr: config.node_ip.or_else(netif::default_route_source),
        last_error: None,
    });
    // Without the API the configuration comes from flags; with it, from the Node objects
    // (or their checkpoint), as soon as they are known.
    let mut router_dirty = api_source.as_ref().is_some_and(|api| api.restored_from_checkpoint);
    let mut policy_dirty = router_dirty;
    let mut nets_dirty = router_dirty;
    let advertise_services = config.router.as_ref().is_some_and(|r| r.advertise.any());
    let mut policy_retry_at: Option<Instant> = None;
    let mut checkpoint_due = false;
    let mut checkpoint_write: Option<tokio::task::JoinHandle<()>> = None;
    let mut last_checkpoint = Instant::now() - Duration::from_secs(60);
    if let (Some(router), None) = (router.as_mut(), api_source.as_ref()) {
        match router.static_config() {
            Ok(bgp) => router.apply(bgp, Default::default()).await,
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
    // Interfaces are attached the moment they appear; the periodic rescan stays as a safety net.
    let mut link_events = match &datapath {
        Some(_) if config.link_events => netif::LinkEvents::open()
            .map_err(|e| tracing::warn!(error = %e, "no link events; new interfaces are found by a 5 s rescan"))
            .ok(),
        _ => None,
    };
    // NodePorts listen on the node's addresses: a changed set recompiles the Services at once.
    let mut node_addresses = netif::node_addresses();
    // A change is applied this soon after it arrives (a burst of watch events is one sync); the
    // 200 ms tick stays for retries and housekeeping.
    let mut sync_soon: Option<tokio::time::Instant> = None;
    // Services and EndpointSlices are compiled incrementally, in well under a millisecond per
    // change: they are applied as soon as no more events are queued (at the latest after
    // SERVICE_SYNC_DEBOUNCE), without waiting for the other controllers' debounce.
    let mut services_soon: Option<tokio::time::Instant> = None;
    tracing::info!("agent running");
    loop {
        let mut due = false;
        let mut services_due = false;
        let link_changed = async {
            match link_events.as_mut() {
                Some(events) => events.changed().await,
                None => std::future::pending().await,
            }
        };
        let update = async {
            match api_source.as_mut() {
                Some(api) => api.updates.recv().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = terminate.recv() => break,
            _ = interrupt.recv() => break,
            changed = link_changed => {
                if let Err(e) = changed {
                    tracing::warn!(error = %e, "link events failed; new interfaces are found by a 5 s rescan");
                    link_events = None;
                }
                if let (Some(datapath), None) = (datapath.as_mut(), &config.interfaces) {
                    attach_all(datapath, &config.interfaces, &mut attached, config.run_service_proxy, config.run_firewall);
                    last_rescan = Instant::now();
                }
                let now = netif::node_addresses();
                if now != node_addresses {
                    tracing::info!(addresses = ?now, "node addresses changed; recompiling Services");
                    node_addresses = now;
                    if let Some(api) = api_source.as_mut() {
                        api.dirty = true;
                        sync_soon.get_or_insert_with(|| tokio::time::Instant::now() + SYNC_DEBOUNCE);
                    }
                    if let (Some(file), Some(proxy)) = (file_source.as_mut(), service_proxy.as_mut()) {
                        file.stamp = None;
                        file.sync(&mut proxy.controller, &metrics);
                    }
                }
            }
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
                    update if update.is_api_answer() => {
                        if !metrics.with(|m| std::mem::replace(&mut m.api_reachable, true)) {
                            tracing::info!("API server reachable");
                        }
                        metrics.with(|m| m.last_api_contact_unix = Some(metrics::unix_now()));
                    }
                    _ => {}
                }
                // Only a real change of a kind wakes its controller (a relist that starts and
                // fails, or brings back the same objects, changes nothing).
                if let Some(kind) = api.objects.apply_kind(update) {
                    checkpoint_due = true;
                    sync_soon.get_or_insert_with(|| tokio::time::Instant::now() + SYNC_DEBOUNCE);
                    if matches!(kind, Kind::Services | Kind::EndpointSlices) {
                        api.dirty = true;
                        let changed = api.objects.update_catalog(&mut api.catalog);
                        api.changed.merge(changed);
                        services_soon.get_or_insert_with(|| tokio::time::Instant::now() + SERVICE_SYNC_DEBOUNCE);
                    }
                    router_dirty |= kind == Kind::Nodes
                        || (advertise_services && matches!(kind, Kind::Services | Kind::EndpointSlices));
                    nets_dirty |= kind == Kind::Nodes;
                    if let (Kind::Nodes, Some(proxy)) = (kind, service_proxy.as_mut()) {
                        // Only this node's zone matters to the Services; other Node changes do not.
                        let zone = api
                            .objects
                            .nodes
                            .objects()
                            .find(|n| n.metadata.name.as_deref() == Some(proxy.controller.node_name.as_str()))
                            .and_then(|n| n.metadata.labels.as_ref()?.get(TOPOLOGY_ZONE_LABEL).cloned());
                        if zone != proxy.controller.zone {
                            tracing::info!(zone = ?zone, "node zone changed; topology hints follow it");
                            proxy.controller.zone = zone;
                            api.dirty = true;
                        }
                    }
                    policy_dirty |= matches!(kind, Kind::Pods | Kind::Namespaces | Kind::NetworkPolicies);
                }
                // Nothing more queued: the Services are compiled now rather than after the
                // timer (whose resolution is a millisecond or more).
                if services_soon.is_some() && api.updates.is_empty() {
                    services_soon = None;
                    services_due = true;
                }
            }
            _ = tick.tick() => due = true,
            _ = sync_at(sync_soon) => {
                sync_soon = None;
                due = true;
            }
            _ = sync_at(services_soon) => {
                services_soon = None;
                services_due = true;
            }
        }
        if due || services_due {
            if let Some(api) = api_source.as_mut() {
                let complete = api.objects.synced();
                // Before the first complete list, only a checkpoint-restored state is worth
                // applying (and then without deletions).
                let retry = api.retry_at.is_some_and(|at| Instant::now() >= at);
                if (api.dirty || retry) && (complete || api.restored_from_checkpoint) {
                    api.dirty = false;
                    if let Some(proxy) = service_proxy.as_mut() {
                        if proxy.controller.full_compile_only {
                            api.catalog = ServiceCatalog::from_builder(api.objects.state());
                        }
                        if api.changed == Changed::All {
                            // Restored from the checkpoint, or never converted yet.
                            api.objects.update_catalog(&mut api.catalog);
                        }
                        let changed = std::mem::take(&mut api.changed);
                        let failed = proxy.controller.apply(&api.catalog, changed, complete);
                        api.retry_at = (failed > 0).then(|| Instant::now() + WRITE_RETRY_INTERVAL);
                    }
                }
            }
        }
        if due {
            if let Some(api) = api_source.as_ref() {
                // Every kind, after each change, once all have been listed completely: a
                // restart during an outage then has the same Services, Nodes and policies.
                // Serialising and syncing 10,000 objects takes long enough to hold back the next
                // change, so it is written off the loop, one write at a time, from a snapshot.
                let writing = checkpoint_write.as_ref().is_some_and(|w| !w.is_finished());
                if checkpoint_due
                    && !writing
                    && api.objects.all_synced()
                    && last_checkpoint.elapsed() >= Duration::from_secs(1)
                {
                    checkpoint_due = false;
                    last_checkpoint = Instant::now();
                    let snapshot = api.objects.snapshot();
                    let (state_dir, metrics) = (config.state_dir.clone(), metrics.clone());
                    checkpoint_write = Some(tokio::task::spawn_blocking(move || {
                        if let Err(e) = checkpoint::write_payload(&state_dir, &snapshot) {
                            tracing::error!(error = %e, "cannot write checkpoint");
                            metrics.with(|m| m.checkpoint_errors += 1);
                        }
                    }));
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
                    let failed = firewall.apply(
                        o.pods.objects(),
                        o.namespaces.objects(),
                        o.network_policies.objects(),
                        complete,
                    );
                    policy_retry_at = (failed > 0).then(|| Instant::now() + WRITE_RETRY_INTERVAL);
                }
            }
            if let Some(api) = api_source.as_ref() {
                // Like the routes: only a complete listing of Nodes (or its checkpoint) counts.
                if nets_dirty && (api.objects.nodes.synced() || api.restored_from_checkpoint) {
                    nets_dirty = false;
                    if service_proxy.is_some() {
                        sync_egress_nets(&config, api.objects.nodes.objects());
                    }
                    if let Some(cni) = cni.as_mut() {
                        cni.sync(api.objects.nodes.objects(), &metrics).await;
                    }
                }
            }
            if let (Some(router), Some(api)) = (router.as_mut(), api_source.as_ref()) {
                // Peers leave the mesh only on a complete listing of Nodes, never because a
                // list failed; the store keeps the last complete one through an outage.
                if router_dirty && (api.objects.nodes.synced() || api.restored_from_checkpoint) {
                    router_dirty = false;
                    let o = &api.objects;
                    let started = Instant::now();
                    // Through the catalog's index: only the slices asked for are decoded.
                    let slices_of =
                        |namespace: &str, name: &str| -> Vec<k8s_openapi::api::discovery::v1::EndpointSlice> {
                            let keys = api.catalog.slice_keys_of(&ServiceName::new(namespace, name));
                            keys.iter().filter_map(|key| o.endpoint_slices.get(key)).collect()
                        };
                    router.update_from_nodes(o.nodes.objects(), o.services.objects(), &slices_of).await;
                    metrics.with(|m| m.kr.bgp_peers_sync_time.observe(started.elapsed().as_secs_f64()));
                }
            }
            if last_housekeeping.elapsed() < Duration::from_secs(1) {
                continue;
            }
            last_housekeeping = Instant::now();
            if let Some(router) = router.as_mut() {
                router.retry_start_if_due().await;
                router.publish_metrics();
            }
            if let Some(datapath) = datapath.as_mut() {
                if config.interfaces.is_none() && last_rescan.elapsed() >= Duration::from_secs(5) {
                    attach_all(
                        datapath,
                        &config.interfaces,
                        &mut attached,
                        config.run_service_proxy,
                        config.run_firewall,
                    );
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
    // Leave programs, links, maps and kernel routes exactly as they are: traffic keeps flowing
    // without us. With graceful restart the BGP sessions close without a Cease, so peers keep
    // our routes until we are back.
    // A checkpoint being written is finished (it is replaced atomically either way).
    if let Some(write) = checkpoint_write.take() {
        let _ = write.await;
    }
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

/// [`read_programmed`] of the IPv6 maps.
pub fn read_programmed_v6(pin_dir: &Path) -> Result<crate::services::compile::MapContents<V6>> {
    Ok(BpfServiceMapsV6::open_pinned(pin_dir)?.read_all()?)
}

/// `KUBE_ROUTER_FULL_SERVICE_COMPILE=1`: see [`ServiceController::full_compile_only`].
fn full_compile_only() -> bool {
    std::env::var("KUBE_ROUTER_FULL_SERVICE_COMPILE").is_ok_and(|v| v == "1")
}

/// How long after a change the controllers run: long enough to take a burst of watch events
/// (a relist, a rollout touching many EndpointSlices) as one sync.
const SYNC_DEBOUNCE: Duration = Duration::from_millis(10);

/// The same for Service and EndpointSlice changes, at the latest (they are applied as soon as no
/// more events are queued): a relist arrives whole (the store swaps it in at its end).
const SERVICE_SYNC_DEBOUNCE: Duration = Duration::from_millis(1);

/// Resolves at `at`, never without one.
async fn sync_at(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::services::{
        diff::MapOp,
        model::{Protocol, Service, ServicePort},
        sync::MapWriteError,
    };

    /// Service maps with room for `capacity` frontends.
    struct Capped {
        inner: MapContents,
        capacity: usize,
    }

    impl ServiceMaps for Capped {
        fn write(&mut self, op: &MapOp) -> Result<(), MapWriteError> {
            if let MapOp::PutService(key, _) = op {
                if !self.inner.services.contains_key(key) && self.inner.services.len() >= self.capacity {
                    return Err(MapWriteError { map: map_names::SERVICES, message: "E2BIG".into(), full: true });
                }
            }
            self.inner.apply(op);
            Ok(())
        }
        fn read_all(&self) -> Result<MapContents, MapWriteError> {
            Ok(self.inner.clone())
        }
    }

    /// ClusterIP Services `(name, last octet of 10.96.0.x)`.
    fn catalog(services: &[(&str, u8)]) -> ServiceCatalog {
        let mut builder = StateBuilder::default();
        for (name, octet) in services {
            let name = ServiceName::new("ns", *name);
            let service = Service::cluster_ip(
                name.clone(),
                vec![Ipv4Addr::new(10, 96, 0, *octet).into()],
                vec![ServicePort { name: "http".into(), protocol: Protocol::Tcp, port: 80, node_port: None }],
            );
            builder.state.services.insert(name, service);
        }
        ServiceCatalog::from_builder(builder)
    }

    #[test]
    fn an_increment_that_frees_room_in_a_full_map_programs_what_waited() {
        let node = NodeContext::default();
        let limits = Limits::default();
        let mut compiler = FamilyCompiler::<V4>::default();
        let mut maps = Capped { inner: MapContents::default(), capacity: 2 };
        let mut sync = ServiceSync::adopt(&maps).unwrap();
        let before = catalog(&[("a", 1), ("b", 2)]);
        sync_family(&mut compiler, &mut sync, &mut maps, &before, None, &node, limits, true);
        assert_eq!(maps.inner.services.len(), 2);

        // a goes, c comes: c's insert is refused before a's delete makes room.
        let after = catalog(&[("b", 2), ("c", 3)]);
        let changed = [ServiceName::new("ns", "a"), ServiceName::new("ns", "c")].into_iter().collect();
        let (report, owners) =
            sync_family(&mut compiler, &mut sync, &mut maps, &after, Some(&changed), &node, limits, true);
        assert!(matches!(owners, OwnerUpdate::All(_)), "followed by a full pass");
        assert_eq!(report.total().errors, 0);
        let addrs: Vec<std::net::IpAddr> = maps.inner.services.keys().map(|k| FrontendId::of::<V4>(k).addr).collect();
        let expected: Vec<std::net::IpAddr> =
            vec![Ipv4Addr::new(10, 96, 0, 2).into(), Ipv4Addr::new(10, 96, 0, 3).into()];
        assert_eq!(addrs, expected);

        // The maps hold the whole plan again: the next change is compiled alone.
        let (report, owners) =
            sync_family(&mut compiler, &mut sync, &mut maps, &after, Some(&changed), &node, limits, true);
        assert!(matches!(owners, OwnerUpdate::Some(_)));
        assert_eq!(report.total().writes(), 0);
    }
}
