//! The service load balancer's controller: converts the Services and EndpointSlices that
//! changed, compiles just them when it can, and writes only the differences to the pinned maps.
//! Deletions need a complete listing; failed writes are retried by the runner with backoff.
use std::{
    collections::{BTreeMap, BTreeSet, HashSet},
    net::IpAddr,
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;
use kube_router_common::{map_names, LbConfig, LB_CONFIG_MASQUERADE_ALL, LB_CONFIG_POD_EGRESS, META_SERVICES_AS_OF};
use tokio::sync::watch;

use crate::{
    bpf::{
        service_maps::{
            write_ct_lifetimes, write_lb_config, BpfServiceMaps, BpfServiceMapsV6, Conntrack, ConntrackV6,
            FamilyConntrack,
        },
        stamps::ApiStateStamp,
    },
    config::AgentConfig,
    controllers::service_view::VipPublisher,
    exposition::{register, sync_histogram, Counter, Family, IntGauge, OptionalGauge, SecondsSince, Timestamp},
    k8s::{
        cache::{Cache, Completeness},
        store::{Cursor, Followed},
        watch::Kind,
    },
    kr_metrics::{FrontendId, FrontendOwner, ServiceCounters},
    map_writes::MapMetrics,
    metrics::{AgentMetrics, Labels, Metrics, Subsystem},
    netif,
    runtime::{self, Action, Controller},
    services::{
        compile::{assign_ids, CompileWarning, LbPlan, Limits, MapContents},
        departures::{udp_departures, Departure},
        family::{AddressFamily, IpFamily, V4, V6},
        from_k8s::{node_object_addresses, TOPOLOGY_ZONE_LABEL},
        incremental::{Changed, FamilyCompiler, FullCompile, ServiceCatalog},
        model::{ExternalIpPolicy, NodeContext, ServiceName},
        node_addresses::{ClaimedAddresses, NodeAddressIndex},
        source::{load_file, StateBuilder},
        sync::{ServiceMaps, ServiceSync, SyncReport},
    },
};

/// The services proxy's syncs and what they left out.
#[derive(Debug)]
pub struct ServiceMetrics {
    pub sync_duration: prometheus_client::metrics::histogram::Histogram,
    /// The same observations under kube-router's name (IPVS services sync).
    sync_time: prometheus_client::metrics::histogram::Histogram,
    /// Unix time of the last sync.
    pub last_sync: OptionalGauge,
    /// externalIPs and LoadBalancer IPs refused, by reason (once per Service and address).
    external_ips_refused: Family<Labels<1>, Counter>,
    dropped_endpoints: IntGauge,
    /// UDP flows whose entries were removed: their backend left the flow's frontend while
    /// still backing another.
    conntrack_purged_flows: Counter,
    /// Conntrack walks for such flows (one per sync that moved a UDP backend out of a frontend).
    conntrack_purge_scans: Counter,
    /// Frontends in `svc_v4` (kube-router: IPVS services).
    frontends: IntGauge,
    /// Syncs from a complete desired state (every kind listed, or the service file).
    complete_syncs: Counter,
    /// Syncs that compiled every Service, by why ([`FullCompile`]).
    full_compiles: Family<Labels<1>, Counter>,
}

impl Default for ServiceMetrics {
    fn default() -> Self {
        Self {
            sync_duration: sync_histogram(),
            sync_time: sync_histogram(),
            last_sync: OptionalGauge::default(),
            external_ips_refused: Family::default(),
            dropped_endpoints: IntGauge::default(),
            conntrack_purged_flows: Counter::default(),
            conntrack_purge_scans: Counter::default(),
            frontends: IntGauge::default(),
            complete_syncs: Counter::default(),
            full_compiles: Family::default(),
        }
    }
}

impl ServiceMetrics {
    pub fn external_ip_refused(&self, reason: &'static str) {
        self.external_ips_refused.get_or_create(&[("reason", reason)]).inc();
    }

    /// One sync, after its map writes were recorded: a scrape that sees this sync counted sees
    /// its writes too (the tests wait on the count, then read the writes).
    pub(crate) fn record_sync(&self, duration: std::time::Duration, complete: bool, full: Option<FullCompile>) {
        if complete {
            self.complete_syncs.inc();
        }
        if let Some(reason) = full {
            self.full_compiles.get_or_create(&[("reason", reason.label())]).inc();
        }
        self.sync_duration.observe(duration.as_secs_f64());
        self.sync_time.observe(duration.as_secs_f64());
        self.last_sync.set(crate::metrics::unix_now());
    }
}

impl Subsystem for ServiceMetrics {
    fn register(this: &Arc<Self>, registry: &mut prometheus_client::registry::Registry) {
        let m = this.as_ref();
        register(
            registry,
            "kube_router_sync_duration_seconds",
            "Time to compute and apply one service map sync.",
            m.sync_duration.clone(),
        );
        register(
            registry,
            "kube_router_last_sync_timestamp_seconds",
            "Unix time of the last successful sync.",
            Timestamp(m.last_sync.clone()),
        );
        register(
            registry,
            "kube_router_seconds_since_last_sync",
            "Seconds since the last successful sync (-1 before the first).",
            SecondsSince(m.last_sync.clone()),
        );
        register(
            registry,
            "kube_router_service_external_ips_refused_total",
            "Service externalIPs and LoadBalancer IPs refused (not programmed, not advertised), by reason.",
            m.external_ips_refused.clone(),
        );
        register(
            registry,
            "kube_router_service_complete_syncs_total",
            "Service syncs from a complete desired state; the others ran from a checkpoint or a partial listing.",
            m.complete_syncs.clone(),
        );
        register(
            registry,
            "kube_router_service_full_compiles_total",
            "Service syncs that compiled every Service instead of the changed ones alone, by reason.",
            m.full_compiles.clone(),
        );
        register(
            registry,
            "kube_router_dropped_endpoints",
            "Endpoints left out because a service exceeded --max-backends-per-service.",
            m.dropped_endpoints.clone(),
        );
        register(
            registry,
            "kube_router_conntrack_purged_flows_total",
            "UDP flows whose conntrack entries were removed because their backend left the flow's Service frontend while still backing another; the next datagram is balanced again.",
            m.conntrack_purged_flows.clone(),
        );
        register(
            registry,
            "kube_router_conntrack_purge_scans_total",
            "Walks of the Service conntrack for those flows: one per sync that took a still-programmed backend out of a UDP frontend.",
            m.conntrack_purge_scans.clone(),
        );
        register(
            registry,
            "kube_router_controller_ipvs_services",
            "Number of ipvs services in the instance",
            m.frontends.clone(),
        );
        register(
            registry,
            "kube_router_controller_ipvs_services_sync_time",
            "Time it took for controller to sync ipvs services",
            m.sync_time.clone(),
        );
    }
}

/// The health check ports the node serves, by port.
pub type HealthChecks = watch::Sender<BTreeMap<u16, crate::healthcheck::LocalEndpoints>>;

pub struct ServiceProgrammer {
    maps: BpfServiceMaps,
    sync: ServiceSync,
    maps_v6: BpfServiceMapsV6,
    sync_v6: ServiceSync<V6>,
    /// The Service conntrack, for the UDP flows of a backend that left their frontend.
    conntrack: Conntrack,
    conntrack_v6: ConntrackV6,
    metrics: Metrics,
    limits: Limits,
    node_name: String,
    nodeport_addresses: Option<Vec<IpAddr>>,
    /// `--enable-ipv4=false` / `--enable-ipv6=false`: families never served.
    disabled_families: BTreeSet<IpFamily>,
    hairpin_all: bool,
    external_ips: ExternalIpPolicy,
    /// Addresses from the API objects no Service may claim (none with a service file).
    cluster_addresses: ClusterAddresses,
    /// Warnings already logged, so one that persists is reported once.
    reported: BTreeSet<String>,
    /// The compilers' warnings already logged: compared as values, not as text (formatting every
    /// warning on every pass cost 6 % of a large cluster's churn).
    reported_warnings: HashSet<CompileWarning>,
    /// Maps that had no room for every entry at the last sync.
    full_maps: BTreeSet<&'static str>,
    /// Maps that refused writes for other reasons at the last sync.
    failing_maps: BTreeSet<&'static str>,
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
    /// How new the API state in the maps is.
    stamp: ApiStateStamp,
    /// Map writes (attempted) of the last [`Self::apply`].
    last_writes: u64,
}

impl ServiceProgrammer {
    fn node_context(&self) -> NodeContext {
        // No node's address (this one's interfaces, every Node object's) and no API server
        // endpoint is ever a Service's to capture.
        let node_addresses = netif::node_addresses();
        // Every Node's addresses are a shared set: a pointer copied, not 10,000 addresses.
        let external_ips = self
            .external_ips
            .with_cluster_addresses(node_addresses.iter().copied(), self.cluster_addresses.api_server.iter().copied())
            .with_cluster_node_addresses(&self.cluster_addresses.nodes);
        // IPv6 Services need an IPv6 address on the node to carry their traffic. IPv4 is always
        // served, as kube-proxy serves its primary family: a node whose address is not up yet
        // (or a test namespace with only loopback) must not lose every Service.
        let unavailable_families = [IpFamily::IPv6]
            .into_iter()
            .filter(|family| !node_addresses.iter().any(|a| IpFamily::of(a) == *family))
            .chain(self.disabled_families.iter().copied())
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
    pub fn apply(&mut self, catalog: &ServiceCatalog, changed: Changed, complete: bool) -> u64 {
        let started = Instant::now();
        let mut current = BTreeSet::new();
        report_catalog_problems(catalog, &self.reported, &mut current, &self.metrics);
        let node = self.node_context();
        // NodePorts, zone hints, families and flags follow the node: a change recompiles all.
        // Not so the addresses no Service may claim (every Node's, the API server's), which
        // move whenever a node joins or leaves a large cluster: only a Service naming a moved
        // address can compile differently.
        let last_node = self.last_node.replace(node.clone());
        let moved = last_node.as_ref().and_then(|last| last.claimed_moved(&node));
        let node_changed = last_node.as_ref() != Some(&node) && moved.is_none();
        let changed = match changed {
            _ if self.full_compile_only => Err(FullCompile::Forced),
            _ if !complete => Err(FullCompile::Partial),
            Changed::All => Err(FullCompile::AllObjects),
            Changed::Services(_) if node_changed => Err(FullCompile::Node),
            Changed::Services(mut names) => {
                names.extend(catalog.state.naming(&moved.unwrap_or_default()));
                Ok(names)
            }
        };
        let limits = self.limits;
        // Before a complete listing nothing is deleted, except what no Service may hold: a
        // frontend on a node's or the API server's address (or another never-valid one) left in
        // the pinned maps would cut the agent off the listing that could remove it.
        let mut purged = purge_refused(&mut self.sync, &mut self.maps, &node.external_ips, complete);
        purged.merge(purge_refused(&mut self.sync_v6, &mut self.maps_v6, &node.external_ips, complete));
        let (mut report, owners, departures, full) = sync_family(
            &mut self.compiler,
            &mut self.sync,
            &mut self.maps,
            catalog,
            changed.as_ref().map_err(|reason| *reason),
            &node,
            limits,
            complete,
        );
        let (report_v6, owners_v6, departures_v6, full_v6) = sync_family(
            &mut self.compiler_v6,
            &mut self.sync_v6,
            &mut self.maps_v6,
            catalog,
            changed.as_ref().map_err(|reason| *reason),
            &node,
            limits,
            complete,
        );
        let full = full.or(full_v6);
        report.merge(report_v6);
        report.merge(purged);
        // Only after the writes: a datagram balanced again must not find the backend in a slot.
        self.purge_departed(&departures, &departures_v6);
        let mut current_warnings = HashSet::with_capacity(self.reported_warnings.len());
        for warning in self.compiler.warnings().chain(self.compiler_v6.warnings()) {
            if !self.reported_warnings.contains(warning) {
                match warning {
                    CompileWarning::FrontendConflict { .. } => tracing::error!(?warning, "frontend claimed twice"),
                    CompileWarning::EndpointsTruncated { .. } => tracing::warn!(?warning, "too many endpoints"),
                    CompileWarning::ExternalIpRefused { service, refusal } => {
                        tracing::error!(service = %service, reason = refusal.reason, error = %refusal.message, "external IP refused; the rest of the Service is programmed");
                        self.metrics.of::<AgentMetrics>().reject("ExternalIP");
                        self.metrics.of::<ServiceMetrics>().external_ip_refused(refusal.reason);
                    }
                    CompileWarning::FamilyUnavailable { service, family }
                        if self.disabled_families.contains(family) =>
                    {
                        tracing::info!(service = %service, ?family, "family disabled by --enable-ipv4/--enable-ipv6=false; the Service is not programmed in it");
                    }
                    CompileWarning::FamilyUnavailable { service, family } => {
                        tracing::warn!(service = %service, ?family, "the node has no address of this family; the Service is not programmed in it");
                        self.metrics.of::<AgentMetrics>().reject("IPFamily");
                    }
                }
            }
            current_warnings.insert(warning.clone());
        }
        self.reported = current;
        self.reported_warnings = current_warnings;
        self.health_checks.send_if_modified(|checks| {
            let now = crate::healthcheck::health_checks(&catalog.state, &self.node_name);
            let changed = *checks != now;
            *checks = now;
            changed
        });
        self.report_full_maps(&report);
        let total = report.total();
        self.last_writes = total.inserts + total.updates + total.deletes + total.errors;
        let programmed = self.sync.programmed();
        let programmed_v6 = self.sync_v6.programmed();
        // Totals over both families.
        tracing::info!(
            inserts = total.inserts,
            updates = total.updates,
            deletes = total.deletes,
            errors = total.errors,
            complete,
            full = full.map(FullCompile::label),
            services = programmed.services.len() + programmed_v6.services.len(),
            backends = programmed.backends.len() + programmed_v6.backends.len(),
            "service sync complete"
        );
        let maps_metrics = self.metrics.of::<MapMetrics>();
        maps_metrics.record(&report);
        let service_metrics = self.metrics.of::<ServiceMetrics>();
        service_metrics.record_sync(started.elapsed(), complete, full);
        let dropped_endpoints = self.compiler.dropped_endpoints() + self.compiler_v6.dropped_endpoints();
        service_metrics.dropped_endpoints.set(dropped_endpoints as i64);
        service_metrics.frontends.set(programmed.services.len() as i64);
        for (map, entries) in [
            (map_names::SERVICES, programmed.services.len()),
            (map_names::BACKEND_SLOTS, programmed.slots.len()),
            (map_names::BACKENDS, programmed.backends.len()),
            (map_names::SERVICES_V6, programmed_v6.services.len()),
            (map_names::BACKEND_SLOTS_V6, programmed_v6.slots.len()),
            (map_names::BACKENDS_V6, programmed_v6.backends.len()),
        ] {
            maps_metrics.set_entries(map, entries as u64);
        }
        self.metrics.of::<ServiceCounters>().with(|m| {
            // Label each frontend with its Service; a rejected Service's kept frontends keep theirs.
            owners.update(&mut m.frontends, programmed);
            owners_v6.update(&mut m.frontends, programmed_v6);
        });
        self.metrics.heartbeat("services");
        // A full map is retried when the desired state changes (space may free), not on a timer.
        total.errors - total.full
    }

    /// Removes the conntrack entries of UDP flows whose backend left their frontend but is still
    /// programmed for another (`services::departures`). A table walk only when there are some.
    fn purge_departed(
        &mut self,
        v4: &BTreeSet<Departure<u32>>,
        v6: &BTreeSet<Departure<<V6 as AddressFamily>::Words>>,
    ) {
        fn purge<F: AddressFamily>(
            conntrack: &mut FamilyConntrack<F>,
            departures: &BTreeSet<Departure<F::Words>>,
            metrics: &Metrics,
        ) where
            kube_router_common::CtKey<F::Words>: aya::Pod,
            kube_router_common::CtValue<F::Words>: aya::Pod,
        {
            if departures.is_empty() {
                return;
            }
            match conntrack.purge_departed(departures) {
                Ok(flows) => {
                    tracing::info!(
                        backends = departures.len(),
                        flows,
                        map = F::MAPS.conntrack,
                        "UDP flows of backends that left their Service balanced again"
                    );
                    let counted = metrics.of::<ServiceMetrics>();
                    counted.conntrack_purge_scans.inc();
                    counted.conntrack_purged_flows.inc_by(flows as u64);
                }
                // Not retried: those flows keep their backend until they idle out (60 s), as before.
                Err(e) => {
                    tracing::warn!(error = %e, map = F::MAPS.conntrack, "cannot remove the flows of departed UDP backends")
                }
            }
        }
        purge(&mut self.conntrack, v4, &self.metrics);
        purge(&mut self.conntrack_v6, v6, &self.metrics);
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
        let maps_metrics = self.metrics.of::<MapMetrics>();
        for map in [V4::MAPS, V6::MAPS].iter().flat_map(|f| [f.services, f.slots, f.backends, f.source_ranges]) {
            maps_metrics.set_full(map, now.contains(map));
        }
        self.full_maps = now;
        // Other failures: once when a map starts failing and once when it recovers, not per
        // entry and retry (each failed write is counted in kube_router_map_writes_total).
        let failing: BTreeSet<&'static str> =
            report.per_map.iter().filter(|(_, c)| c.errors > c.full).map(|(map, _)| *map).collect();
        for map in failing.difference(&self.failing_maps) {
            let failed = report.per_map[map].errors - report.per_map[map].full;
            tracing::warn!(map, failed, error = %report.first_errors[map], "map writes failed; retried with backoff");
        }
        for map in self.failing_maps.difference(&failing) {
            tracing::info!(map, "map writes succeed again");
        }
        self.failing_maps = failing;
    }
}

/// Logs and counts each distinct problem of the catalog's objects once, however often the state
/// is rebuilt: those not in `reported`; every current one goes into `current`.
pub(crate) fn report_catalog_problems(
    catalog: &ServiceCatalog,
    reported: &BTreeSet<String>,
    current: &mut BTreeSet<String>,
    metrics: &Metrics,
) {
    for problem in catalog.problems() {
        let text = format!("{problem:?}");
        if !reported.contains(&text) {
            let kind: &'static str = if problem.kind == "Service" { "Service" } else { "EndpointSlice" };
            let (object, error) = (problem.name.as_str(), problem.message.as_str());
            if problem.partial {
                tracing::warn!(kind, object, error, "part of an object left out; the rest is programmed");
            } else {
                tracing::error!(kind, object, error, "rejected object; its programmed state is kept as it was");
            }
            metrics.of::<AgentMetrics>().reject(kind);
        }
        current.insert(text);
    }
}

/// Every Node's addresses (from the objects) and the API server's (the endpoints of
/// `default/kubernetes`): no Service may claim them. The Nodes are followed with their own
/// cursor in the store's journal: a pass after one Node changed reads that Node alone.
#[derive(Debug, Default)]
pub(crate) struct ClusterAddressFollower {
    cursor: Option<Cursor>,
    nodes: NodeAddressIndex,
}

impl ClusterAddressFollower {
    /// Reads the Nodes changed since the last call (every Node the first time, after a restore
    /// or when the store forgot what changed).
    pub fn follow_nodes(&mut self, cache: &Cache) {
        let cursor = self.cursor;
        let (followed, cursor) = cache.with(|o| o.nodes.follow(cursor));
        self.cursor = Some(cursor);
        let addresses = |node: &Node| node_object_addresses(node).collect::<BTreeSet<_>>();
        match followed {
            Followed::All(nodes) => {
                self.nodes.replace_all(nodes.iter().map(|node| (node.name_any(), addresses(node))));
            }
            Followed::Changed(changed) => {
                for ((_, name), node) in changed {
                    self.nodes.set_node(&name, node.as_deref().map(addresses).unwrap_or_default());
                }
            }
        }
    }

    /// The addresses as followed, with the API server's from `catalog`.
    pub fn addresses(&self, catalog: &ServiceCatalog) -> ClusterAddresses {
        let kubernetes = ServiceName::new("default", "kubernetes");
        let api_server =
            catalog.slices_of(&kubernetes).into_iter().flat_map(|s| s.endpoints.iter().map(|e| e.addr)).collect();
        ClusterAddresses { nodes: self.nodes.claimed().clone(), api_server }
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

/// Deletes the programmed external frontends (externalIP, LoadBalancer IP) whose address the
/// policy refuses as either kind; nothing when `complete` (the normal diff removes them then).
fn purge_refused<F: AddressFamily>(
    sync: &mut ServiceSync<F>,
    maps: &mut impl ServiceMaps<F>,
    policy: &ExternalIpPolicy,
    complete: bool,
) -> SyncReport {
    use kube_router_common::{SVC_FLAG_EXTERNAL, SVC_FLAG_NODEPORT};
    if complete {
        return SyncReport::default();
    }
    let ops: Vec<_> = sync
        .programmed()
        .services
        .iter()
        .filter(|(_, v)| v.flags & SVC_FLAG_EXTERNAL != 0 && v.flags & SVC_FLAG_NODEPORT == 0)
        .filter(|(k, _)| {
            let addr = FrontendId::of::<F>(k).addr;
            policy.refusal(addr, false).is_some() && policy.refusal(addr, true).is_some()
        })
        .map(|(k, _)| crate::services::diff::MapOp::DeleteService(*k))
        .collect();
    if ops.is_empty() {
        return SyncReport::default();
    }
    tracing::warn!(frontends = ops.len(), "removing refused external frontends found in the maps");
    sync.write(maps, ops)
}

/// What one family's sync wrote, which frontends changed owner, the UDP backends that left a
/// frontend, and why every Service was compiled (`None`: the changed ones alone).
type FamilySynced<F> =
    (SyncReport, OwnerUpdate<F>, BTreeSet<Departure<<F as AddressFamily>::Words>>, Option<FullCompile>);

/// Brings one family's maps to the desired state: only the `changed` Services' entries when
/// the compiler can do that, else everything (`changed` is then why).
#[allow(clippy::too_many_arguments)]
fn sync_family<F: AddressFamily>(
    compiler: &mut FamilyCompiler<F>,
    sync: &mut ServiceSync<F>,
    maps: &mut impl ServiceMaps<F>,
    catalog: &ServiceCatalog,
    changed: Result<&BTreeSet<ServiceName>, FullCompile>,
    node: &NodeContext,
    limits: Limits,
    complete: bool,
) -> FamilySynced<F> {
    let changed = changed.and_then(|changed| compiler.compile_changed(catalog, changed, node, limits, sync.programmed()));
    let full = match changed {
        Ok(increment) => {
            let report = sync.write(maps, increment.ops.clone());
            compiler.written(&increment, report.total().errors == 0);
            // The changed Services' frontends alone (an increment is only compiled after a
            // complete listing).
            let mut departures = udp_departures(&increment.before, sync.programmed());
            if report.total().full > 0 && report.total().deletes > 0 {
                // This pass freed room in a full map: a full pass programs what waited, in the
                // documented priority order, as a full sync's second pass does.
                let lb_plan = compiler.plan_all(catalog, node, limits);
                let (second, more) = sync_all(sync, maps, &lb_plan, complete);
                compiler.adopt(&lb_plan, sync.programmed(), complete && second.total().errors == 0);
                departures.extend(more);
                let report = add_second_pass(report, second);
                return (report, OwnerUpdate::All(lb_plan), departures, Some(FullCompile::FullMap));
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
            return (report, OwnerUpdate::Some(owners), departures, None);
        }
        Err(reason) => reason,
    };
    let lb_plan = compiler.plan_all(catalog, node, limits);
    let (report, departures) = sync_all(sync, maps, &lb_plan, complete);
    compiler.adopt(&lb_plan, sync.programmed(), complete && report.total().errors == 0);
    (report, OwnerUpdate::All(lb_plan), departures, Some(full))
}

/// Brings one family's maps to `lb_plan`. Inserts come before deletes: when a map was full and
/// this pass freed room, one more pass with the same plan programs what waited. Also returns
/// the UDP backends that left a frontend while still programmed (none before a complete
/// listing: a partial state must not move flows).
fn sync_all<F: AddressFamily>(
    sync: &mut ServiceSync<F>,
    maps: &mut impl ServiceMaps<F>,
    lb_plan: &LbPlan<F>,
    complete: bool,
) -> (SyncReport, BTreeSet<Departure<F::Words>>) {
    let desired = assign_ids(lb_plan, sync.programmed());
    // A full compile walks every entry anyway; the desired state stands for the written one (a
    // failed write only makes a flow be balanced again, maybe onto the same backend).
    let mut departures = if complete { udp_departures(sync.programmed(), &desired) } else { BTreeSet::new() };
    let report = sync.sync(maps, &desired, complete);
    if report.total().full > 0 && report.total().deletes > 0 {
        let desired = assign_ids(lb_plan, sync.programmed());
        if complete {
            departures.extend(udp_departures(sync.programmed(), &desired));
        }
        let second = sync.sync(maps, &desired, complete);
        return (add_second_pass(report, second), departures);
    }
    (report, departures)
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
    report.first_errors = second.first_errors;
    report
}

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
                    metrics.of::<AgentMetrics>().reject("file");
                    self.last_error = Some(error);
                }
                None
            }
        }
    }
}

impl ServiceProgrammer {
    /// Adopts what the maps hold and configures source NAT.
    pub fn start(config: &AgentConfig, metrics: &Metrics, health_checks: HealthChecks) -> Result<Self> {
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
        let controller = ServiceProgrammer {
            maps,
            sync,
            maps_v6,
            sync_v6,
            conntrack: Conntrack::open_pinned(&config.pin_dir)?,
            conntrack_v6: ConntrackV6::open_pinned(&config.pin_dir)?,
            metrics: metrics.clone(),
            limits: config.limits,
            node_name: config.node_name.clone(),
            nodeport_addresses: config.nodeport_addresses.clone(),
            disabled_families: config.disabled_families.clone(),
            hairpin_all: config.hairpin_mode,
            external_ips: config.external_ip_policy(),
            cluster_addresses: ClusterAddresses::default(),
            reported: BTreeSet::new(),
            reported_warnings: HashSet::new(),
            full_maps: BTreeSet::new(),
            failing_maps: BTreeSet::new(),
            zone: None,
            health_checks,
            loopback_node_ports: config.socket_lb.enabled,
            maglev_all: config.maglev_all,
            compiler: FamilyCompiler::default(),
            compiler_v6: FamilyCompiler::default(),
            last_node: None,
            full_compile_only: full_compile_only(),
            stamp: ApiStateStamp::open(&config.pin_dir, META_SERVICES_AS_OF, "service"),
            last_writes: 0,
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
        write_ct_lifetimes(&config.pin_dir, &config.ct_lifetimes)?;
        tracing::info!(lifetimes = ?config.ct_lifetimes, "conntrack lifetimes configured (0: the default)");
        tracing::info!(snat_address = ?snat_addr, snat_address_v6 = ?snat_addr_v6, ports = ?config.snat_port_range, masquerade_all = config.masquerade_all, "source NAT configured");
        Ok(controller)
    }
}

/// The addresses of the cluster's objects no Service may claim as an externalIP or
/// LoadBalancer IP.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClusterAddresses {
    /// Every Node's InternalIP and ExternalIP, shared.
    pub nodes: ClaimedAddresses,
    /// The endpoints of `default/kubernetes`: the API servers.
    pub api_server: BTreeSet<IpAddr>,
}

/// The kinds the services controller reads.
pub const SERVICE_KINDS: &[Kind] = &[Kind::Services, Kind::EndpointSlices];
/// What wakes it: those, and Nodes (this node's zone).
pub const SERVICE_TRIGGER_KINDS: &[Kind] = &[Kind::Services, Kind::EndpointSlices, Kind::Nodes];

/// Services from the API server (or the checkpoint until it lists them).
pub struct ServicesFromApi {
    controller: ServiceProgrammer,
    cache: Arc<Cache>,
    /// The Services and EndpointSlices converted, kept up to date object by object.
    catalog: ServiceCatalog,
    /// The Services changed since the last sync.
    changed: Changed,
    /// Something other than the objects (the node's zone or addresses, a failed write) asks
    /// for a sync.
    dirty: bool,
    /// The node's addresses (NodePorts listen on them), as the interfaces controller saw them.
    node_addresses: watch::Receiver<Vec<IpAddr>>,
    /// The changes of the Services and EndpointSlices seen so far.
    generation: u64,
    /// The changes of the Nodes seen so far (their addresses are refused as externalIPs);
    /// `None` before the first run (restored Nodes count no change).
    node_generation: Option<u64>,
    /// The Nodes changed since their addresses were last collected.
    nodes_moved: bool,
    /// Every Node's addresses, followed Node by Node.
    cluster_addresses: ClusterAddressFollower,
    /// The VIPs for the BGP speaker, from the same catalog (when it advertises Services).
    vips: Option<VipPublisher>,
}

impl ServicesFromApi {
    pub fn new(controller: ServiceProgrammer, cache: Arc<Cache>, node_addresses: watch::Receiver<Vec<IpAddr>>) -> Self {
        // Restored from the checkpoint: applied at once (without deletions).
        let dirty = cache.restored();
        Self {
            controller,
            cache,
            catalog: ServiceCatalog::default(),
            changed: Changed::All,
            dirty,
            node_addresses,
            generation: 0,
            node_generation: None,
            nodes_moved: true,
            cluster_addresses: ClusterAddressFollower::default(),
            vips: None,
        }
    }

    /// Also publishes the Service VIPs the BGP speaker advertises.
    pub fn with_vips(mut self, publisher: VipPublisher) -> Self {
        self.vips = Some(publisher);
        self
    }

    /// Every Node's addresses and the API server's endpoints: refused as externalIPs. The
    /// checkpoint restores them with the Services, so a restart never lets a refused address in.
    /// Collected again only when a Node or the API server's endpoints changed: a Service change
    /// walks no Node.
    fn follow_cluster_addresses(&mut self, catalog_changed: &Changed) {
        let api_server_moved = match catalog_changed {
            Changed::All => true,
            Changed::Services(names) => names.contains(&ServiceName::new("default", "kubernetes")),
        };
        if !self.nodes_moved && !api_server_moved {
            return;
        }
        self.nodes_moved = false;
        self.cluster_addresses.follow_nodes(&self.cache);
        let now = self.cluster_addresses.addresses(&self.catalog);
        if now != self.controller.cluster_addresses {
            tracing::info!(nodes = now.nodes.len(), api_server = ?now.api_server, "addresses no Service may claim");
            self.controller.cluster_addresses = now;
        }
    }

    /// The VIPs of the Services changed in this run, judged on the node as the last compile
    /// saw it: what it refuses or cannot serve is not advertised.
    fn publish_vips(&mut self, changed: Option<Changed>) {
        let (Some(vips), Some(changed)) = (self.vips.as_mut(), changed) else { return };
        let node = self.controller.last_node.clone().unwrap_or_else(|| self.controller.node_context());
        let settings = vips.settings(&node.name, node.external_ips, node.unavailable_families);
        vips.update(&self.catalog, &changed, &settings);
    }

    /// Only this node's zone matters to the Services; other Node changes do not.
    fn follow_zone(&mut self) {
        let key = (String::new(), self.controller.node_name.clone());
        let zone = self
            .cache
            .with(|o| o.nodes.get(&key).and_then(|n| n.metadata.labels.as_ref()?.get(TOPOLOGY_ZONE_LABEL).cloned()));
        if zone != self.controller.zone {
            tracing::info!(zone = ?zone, "node zone changed; topology hints follow it");
            self.controller.zone = zone;
            self.dirty = true;
        }
    }
}

impl Controller for ServicesFromApi {
    fn name(&self) -> &'static str {
        "services"
    }

    async fn reconcile(&mut self) -> Result<Action> {
        let node_generation = self.cache.generation(&[Kind::Nodes]);
        if self.node_generation != Some(node_generation) {
            self.node_generation = Some(node_generation);
            self.follow_zone();
            self.nodes_moved = true;
            self.dirty = true;
        }
        if self.node_addresses.has_changed().unwrap_or(false) {
            self.node_addresses.borrow_and_update();
            self.dirty = true;
        }
        let generation = self.cache.generation(SERVICE_KINDS);
        if generation != self.generation {
            self.generation = generation;
            self.dirty = true;
        }
        if !self.dirty {
            return Ok(Action::AwaitChange);
        }
        // Before the first complete listing only a checkpoint-restored state is applied, and
        // then without deletions.
        let full = self.controller.full_compile_only;
        let catalog = &mut self.catalog;
        let Some(listing) = self.cache.update(SERVICE_KINDS, |o| {
            if full {
                *catalog = ServiceCatalog::from_builder(o.state());
            }
            o.update_catalog(catalog)
        }) else {
            return Ok(Action::AwaitChange);
        };
        self.dirty = false;
        self.follow_cluster_addresses(&listing.objects);
        let changed_now = self.vips.is_some().then(|| listing.objects.clone());
        self.changed.merge(listing.objects);
        let complete = listing.completeness == Completeness::Complete;
        let restored_as_of = self.cache.restored_as_of();
        if !complete && self.controller.stamp.keeps_maps_over_checkpoint(restored_as_of, &self.controller.metrics) {
            // Programming the checkpoint would take the maps back to an older state.
            self.publish_vips(changed_now);
            return Ok(Action::AwaitChange);
        }
        let changed = std::mem::take(&mut self.changed);
        if complete {
            self.controller.stamp.begin_write(&self.controller.metrics);
        }
        let failed = self.controller.apply(&self.catalog, changed, complete);
        // After the writes: a VIP is announced once the datapath serves it.
        self.publish_vips(changed_now);
        if failed > 0 {
            // The maps hold less than planned: the next run syncs again, even unchanged.
            self.dirty = true;
            anyhow::bail!("{failed} service map writes failed");
        }
        if complete {
            self.controller.stamp.finish_write(
                self.controller.last_writes > 0,
                listing.as_of_unix,
                &self.controller.metrics,
            );
        }
        Ok(Action::AwaitChange)
    }
}

/// Services from a file (`--service-file`), read again when it changes.
pub struct ServicesFromFile {
    controller: ServiceProgrammer,
    file: FileSource,
    node_addresses: watch::Receiver<Vec<IpAddr>>,
}

impl ServicesFromFile {
    pub fn new(controller: ServiceProgrammer, path: PathBuf, node_addresses: watch::Receiver<Vec<IpAddr>>) -> Self {
        Self { controller, file: FileSource::new(path), node_addresses }
    }
}

/// How often the file's modification time is checked when no inotify event came (a change
/// inotify cannot see, or no inotify at all).
const FILE_POLL: Duration = Duration::from_secs(1);

/// Inotify events of the service file's directory: a file written in place (closed after
/// writing) or replaced by a rename, or a ConfigMap volume's `..data` symlink swapped, wakes the
/// controller at once instead of at the next poll (up to a second later). Any event of the
/// directory wakes it: the run itself checks whether the file's modification time changed.
pub struct FileEvents(Option<tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>>);

impl FileEvents {
    /// Watches `file`'s directory; without inotify the controller polls only.
    pub fn watch(file: &std::path::Path) -> Self {
        let dir = file.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
        match Self::open(dir) {
            Ok(fd) => Self(Some(fd)),
            Err(error) => {
                tracing::warn!(%error, dir = %dir.display(), "cannot watch the service file's directory; it is polled every second");
                Self(None)
            }
        }
    }

    fn open(dir: &std::path::Path) -> std::io::Result<tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>> {
        use std::os::{fd::FromRawFd, unix::ffi::OsStrExt};
        let dir = std::ffi::CString::new(dir.as_os_str().as_bytes())?;
        // SAFETY: plain inotify_init1(2); the fd is owned below.
        let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: fd is a new inotify instance nothing else owns.
        let owned = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        let mask = libc::IN_CLOSE_WRITE | libc::IN_MOVED_TO | libc::IN_CREATE | libc::IN_DELETE | libc::IN_ATTRIB;
        // SAFETY: dir is a NUL-terminated path that outlives the call.
        if unsafe { libc::inotify_add_watch(fd, dir.as_ptr(), mask) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: the OwnedFd stays open and the same for the AsyncFd's lifetime (it owns it).
        unsafe { tokio::io::unix::AsyncFd::register(owned) }.map_err(std::io::Error::from)
    }
}

impl runtime::Trigger for FileEvents {
    async fn changed(&mut self) -> bool {
        use std::os::fd::AsRawFd;
        let Some(fd) = self.0.as_ref() else { return false };
        let mut buf = [0u8; 4096];
        loop {
            let mut guard = match fd.readable().await {
                Ok(guard) => guard,
                Err(error) => {
                    tracing::warn!(%error, "service file events failed; it is polled every second");
                    self.0 = None;
                    return false;
                }
            };
            // Every queued event is consumed: one run takes them all (an overflowed queue too).
            let mut got = false;
            loop {
                // SAFETY: buf is writable for its whole length.
                let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
                if n > 0 {
                    got = true;
                    continue;
                }
                let error = std::io::Error::last_os_error();
                if n == 0 || error.raw_os_error() == Some(libc::EAGAIN) {
                    break;
                }
                tracing::warn!(%error, "service file events failed; it is polled every second");
                self.0 = None;
                return false;
            }
            guard.clear_ready();
            if got {
                return true;
            }
        }
    }
}

impl Controller for ServicesFromFile {
    fn name(&self) -> &'static str {
        "services"
    }

    async fn reconcile(&mut self) -> Result<Action> {
        if self.node_addresses.has_changed().unwrap_or(false) {
            self.node_addresses.borrow_and_update();
            self.file.stamp = None;
        }
        if let Some(builder) = self.file.poll(&self.controller.metrics) {
            let failed = self.controller.apply(&ServiceCatalog::from_builder(builder), Changed::All, true);
            if failed > 0 {
                // Read and applied again at the retry.
                self.file.stamp = None;
                anyhow::bail!("{failed} service map writes failed");
            }
        }
        Ok(Action::RequeueAfter(FILE_POLL))
    }
}

/// `KUBE_ROUTER_FULL_SERVICE_COMPILE=1`: see [`ServiceProgrammer::full_compile_only`].
fn full_compile_only() -> bool {
    std::env::var("KUBE_ROUTER_FULL_SERVICE_COMPILE").is_ok_and(|v| v == "1")
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::services::{
        diff::MapOp,
        model::{Endpoint, EndpointPort, EndpointSlice, Protocol, Service, ServicePort},
        sync::MapWriteError,
    };

    #[tokio::test]
    async fn a_service_file_replaced_by_a_rename_wakes_the_controller_before_the_poll() {
        use runtime::Trigger;
        let dir = std::env::temp_dir().join(format!("krt-file-events-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("services.yaml");
        // Written before the watch: the rename alone is what wakes it.
        let tmp = dir.join("services.tmp");
        std::fs::write(&tmp, "kind: Service\n").unwrap();
        let mut events = FileEvents::watch(&file);
        assert!(events.0.is_some(), "inotify watch");
        std::fs::rename(&tmp, &file).unwrap();
        let woken = tokio::time::timeout(FILE_POLL / 4, events.changed()).await;
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(woken, Ok(true), "woken well within the poll interval");
    }

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
    fn only_the_services_naming_a_moved_node_address_are_compiled_again() {
        let node = |nodes: &[&str], hairpin_all: bool| NodeContext {
            external_ips: ExternalIpPolicy {
                node_addresses: nodes.iter().map(|a| a.parse().unwrap()).collect(),
                ..Default::default()
            },
            hairpin_all,
            ..Default::default()
        };
        let last = node(&["192.0.2.1", "192.0.2.2"], false);
        let moved = last.claimed_moved(&node(&["192.0.2.2", "192.0.2.3"], false));
        let expected: BTreeSet<IpAddr> = ["192.0.2.1".parse().unwrap(), "192.0.2.3".parse().unwrap()].into();
        assert_eq!(moved, Some(expected.clone()));
        assert_eq!(last.claimed_moved(&node(&["192.0.2.2", "192.0.2.3"], true)), None, "a flag too");
        let mut catalog = catalog(&[("a", 1), ("b", 2)]);
        let a = ServiceName::new("ns", "a");
        catalog.state.services.get_mut(&a).unwrap().external_ips = vec!["::ffff:192.0.2.3".parse().unwrap()];
        assert_eq!(catalog.state.naming(&expected), [a].into());
    }

    #[test]
    fn an_increment_that_frees_room_in_a_full_map_programs_what_waited() {
        let node = NodeContext::default();
        let limits = Limits::default();
        let mut compiler = FamilyCompiler::<V4>::default();
        let mut maps = Capped { inner: MapContents::default(), capacity: 2 };
        let mut sync = ServiceSync::adopt(&maps).unwrap();
        let before = catalog(&[("a", 1), ("b", 2)]);
        sync_family(&mut compiler, &mut sync, &mut maps, &before, Err(FullCompile::AllObjects), &node, limits, true);
        assert_eq!(maps.inner.services.len(), 2);

        // a goes, c comes: c's insert is refused before a's delete makes room.
        let after = catalog(&[("b", 2), ("c", 3)]);
        let changed = [ServiceName::new("ns", "a"), ServiceName::new("ns", "c")].into_iter().collect();
        let (report, owners, _, full) =
            sync_family(&mut compiler, &mut sync, &mut maps, &after, Ok(&changed), &node, limits, true);
        assert!(matches!(owners, OwnerUpdate::All(_)), "followed by a full pass");
        assert_eq!(full, Some(FullCompile::FullMap));
        assert_eq!(report.total().errors, 0);
        let addrs: Vec<std::net::IpAddr> = maps.inner.services.keys().map(|k| FrontendId::of::<V4>(k).addr).collect();
        let expected: Vec<std::net::IpAddr> =
            vec![Ipv4Addr::new(10, 96, 0, 2).into(), Ipv4Addr::new(10, 96, 0, 3).into()];
        assert_eq!(addrs, expected);

        // The maps hold the whole plan again: the next change is compiled alone.
        let (report, owners, _, full) =
            sync_family(&mut compiler, &mut sync, &mut maps, &after, Ok(&changed), &node, limits, true);
        assert!(matches!(owners, OwnerUpdate::Some(_)));
        assert_eq!(full, None);
        assert_eq!(report.total().writes(), 0);
    }

    /// DNS Services `(name, last octet of 10.96.0.x, last octets of their endpoints 10.0.0.y)`.
    fn dns_catalog(services: &[(&str, u8, &[u8])]) -> (ServiceCatalog, Vec<ServiceName>) {
        let mut catalog = ServiceCatalog::default();
        let mut changed = Vec::new();
        for (name, octet, endpoints) in services {
            let name = ServiceName::new("ns", *name);
            let mut builder = StateBuilder::default();
            let port = ServicePort { name: "dns".into(), protocol: Protocol::Udp, port: 53, node_port: None };
            let ip = Ipv4Addr::new(10, 96, 0, *octet).into();
            builder.state.services.insert(name.clone(), Service::cluster_ip(name.clone(), vec![ip], vec![port]));
            catalog.set_service(&name, Some(builder));
            let mut builder = StateBuilder::default();
            let endpoints = endpoints
                .iter()
                .map(|y| Endpoint {
                    addr: Ipv4Addr::new(10, 0, 0, *y).into(),
                    ready: true,
                    serving: true,
                    terminating: false,
                    node_name: None,
                    zone_hints: None,
                })
                .collect();
            let ports = vec![EndpointPort { name: "dns".into(), protocol: Protocol::Udp, port: 5353 }];
            let key = ("ns".to_string(), format!("{}-x", name.name));
            builder.state.slices.insert(key.clone(), EndpointSlice { service: name.clone(), ports, endpoints });
            changed.extend(catalog.set_slice(&key, Some(builder)));
            changed.push(name);
        }
        (catalog, changed)
    }

    /// Two Services over 10.0.0.1:5353 and .2: .1 leaves `a` but still backs `b`. Both the
    /// increment and a full sync name it, for `a`'s frontend only; a change that takes no
    /// still-programmed backend out of a frontend names nothing (no conntrack walk).
    #[test]
    fn a_udp_backend_leaving_one_service_while_backing_another_departs_from_that_frontend() {
        let (node, limits) = (NodeContext::default(), Limits::default());
        let setup = || {
            let mut compiler = FamilyCompiler::<V4>::default();
            let mut maps = MapContents::<V4>::default();
            let mut sync = ServiceSync::adopt(&maps).unwrap();
            let (catalog, _) = dns_catalog(&[("a", 1, &[1, 2]), ("b", 2, &[1, 2])]);
            let (_, _, departures, _) =
                sync_family(&mut compiler, &mut sync, &mut maps, &catalog, Err(FullCompile::AllObjects), &node, limits, true);
            assert!(departures.is_empty(), "a first sync moves nothing");
            (compiler, maps, sync)
        };
        let expected = BTreeSet::from([Departure {
            frontend: crate::services::compile::frontend_key(Ipv4Addr::new(10, 96, 0, 1), 53, Protocol::Udp),
            addr: u32::from_ne_bytes([10, 0, 0, 1]),
            port: 5353u16.to_be(),
        }]);
        let (after, changed) = dns_catalog(&[("a", 1, &[2]), ("b", 2, &[1, 2])]);
        let changed: BTreeSet<ServiceName> = changed.into_iter().filter(|n| &*n.name == "a").collect();
        for incremental in [true, false] {
            let (mut compiler, mut maps, mut sync) = setup();
            let changed = if incremental { Ok(&changed) } else { Err(FullCompile::AllObjects) };
            let (_, owners, departures, _) =
                sync_family(&mut compiler, &mut sync, &mut maps, &after, changed, &node, limits, true);
            assert_eq!(matches!(owners, OwnerUpdate::Some(_)), incremental);
            assert_eq!(departures, expected, "incremental: {incremental}");
            // Not before a complete listing: a partial state moves no flows.
            let (mut compiler, mut maps, mut sync) = setup();
            let (_, _, departures, _) =
                sync_family(&mut compiler, &mut sync, &mut maps, &after, Err(FullCompile::Partial), &node, limits, false);
            assert!(departures.is_empty());
        }
        // .1 leaves both: deleted, the datapath moves its flows by itself. .3 added: nothing left.
        for endpoints in [(&[2u8][..], &[2u8][..]), (&[1, 2, 3][..], &[1, 2][..])] {
            let (mut compiler, mut maps, mut sync) = setup();
            let (after, changed) = dns_catalog(&[("a", 1, endpoints.0), ("b", 2, endpoints.1)]);
            let changed: BTreeSet<ServiceName> = changed.into_iter().collect();
            let (_, owners, departures, _) =
                sync_family(&mut compiler, &mut sync, &mut maps, &after, Ok(&changed), &node, limits, true);
            assert!(matches!(owners, OwnerUpdate::Some(_)));
            assert!(departures.is_empty(), "{endpoints:?}: {departures:?}");
        }
    }
}
