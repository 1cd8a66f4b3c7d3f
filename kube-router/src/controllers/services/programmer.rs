//! One services sync: the node's context, both families' passes, the warnings and problems
//! reported once, the health check ports and the metrics.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    time::Instant,
};

use anyhow::{Context, Result};
use kube_router_common::{map_names, LbConfig, LB_CONFIG_MASQUERADE_ALL, LB_CONFIG_POD_EGRESS, META_SERVICES_AS_OF};
use tokio::sync::watch;

use super::{
    api::ClusterAddresses,
    metrics::ServiceMetrics,
    pass::{purge_refused, sync_family},
    warnings::ReportedWarnings,
};
use crate::services::maps::{
    conntrack::{write_ct_lifetimes, Conntrack, ConntrackV6, FamilyConntrack},
    write_lb_config, BpfServiceMaps, BpfServiceMapsV6,
};
use crate::{
    config::AgentConfig,
    kr_metrics::ServiceCounters,
    map_writes::MapMetrics,
    metrics::{AgentMetrics, Metrics},
    node::netif,
    pinned::stamps::ApiStateStamp,
    services::{
        compile::{CompileWarning, Limits},
        departures::Departure,
        family::{AddressFamily, IpFamily, V4, V6},
        healthcheck::HealthCheckIndex,
        incremental::{Changed, FamilyCompiler, FullCompile, ServiceCatalog},
        model::{ExternalIpPolicy, NodeContext, ServiceName},
        sync::ServiceSync,
    },
};

/// The health check ports the node serves, by port.
pub type HealthChecks = watch::Sender<BTreeMap<u16, crate::services::healthcheck::LocalEndpoints>>;

pub struct ServiceProgrammer {
    maps: BpfServiceMaps,
    sync: ServiceSync,
    maps_v6: BpfServiceMapsV6,
    sync_v6: ServiceSync<V6>,
    /// The Service conntrack, for the UDP flows of a backend that left their frontend.
    conntrack: Conntrack,
    conntrack_v6: ConntrackV6,
    pub(super) metrics: Metrics,
    limits: Limits,
    pub(super) node_name: String,
    nodeport_addresses: Option<Vec<IpAddr>>,
    /// `--enable-ipv4=false` / `--enable-ipv6=false`: families never served.
    disabled_families: BTreeSet<IpFamily>,
    hairpin_all: bool,
    external_ips: ExternalIpPolicy,
    /// Addresses from the API objects no Service may claim (none with a service file).
    pub(super) cluster_addresses: ClusterAddresses,
    /// Warnings already logged, so one that persists is reported once.
    reported: BTreeSet<String>,
    /// The compilers' warnings already logged, by Service: a pass compares those of the
    /// Services it planned again.
    reported_warnings: ReportedWarnings,
    /// Maps that had no room for every entry at the last sync.
    full_maps: BTreeSet<&'static str>,
    /// Maps that refused writes for other reasons at the last sync.
    failing_maps: BTreeSet<&'static str>,
    /// This node's `topology.kubernetes.io/zone` (topology-aware routing), from its Node.
    pub(super) zone: Option<String>,
    /// The health check ports the node serves (`spec.healthCheckNodePort`).
    health_checks: tokio::sync::watch::Sender<BTreeMap<u16, crate::services::healthcheck::LocalEndpoints>>,
    /// The health checks per Service, counted again for the changed Services alone.
    health_check_index: HealthCheckIndex,
    loopback_node_ports: bool,
    maglev_all: bool,
    compiler: FamilyCompiler<V4>,
    compiler_v6: FamilyCompiler<V6>,
    /// The node as the last compile saw it.
    pub(super) last_node: Option<NodeContext>,
    /// `KUBE_ROUTER_FULL_SERVICE_COMPILE=1`: convert and compile every Service on every change
    /// (the path before incremental compilation; for benchmarks and comparisons).
    pub(super) full_compile_only: bool,
    /// How new the API state in the maps is.
    pub(super) stamp: ApiStateStamp,
    /// Map writes (attempted) of the last [`Self::apply`].
    pub(super) last_writes: u64,
    /// The node's addresses as the interfaces controller publishes them; read from the kernel
    /// each pass without one.
    published_addresses: Option<watch::Receiver<Vec<IpAddr>>>,
}

impl ServiceProgrammer {
    pub(super) fn node_context(&self) -> NodeContext {
        // No node's address (this one's interfaces, every Node object's) and no API server
        // endpoint is ever a Service's to capture.
        let node_addresses = match &self.published_addresses {
            // Sent by a live interfaces controller, which follows address events: no dump of
            // every address each pass.
            Some(published) if published.has_changed().is_ok() => published.borrow().clone(),
            _ => netif::node_addresses(),
        };
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
        let (compiler, compiler_v6) = (&self.compiler, &self.compiler_v6);
        let now = |name: &ServiceName| [compiler.warnings_of(name), compiler_v6.warnings_of(name)].concat();
        let new_warnings = match (compiler.replanned(), compiler_v6.replanned()) {
            (Some(v4), Some(v6)) => {
                let replanned: BTreeSet<&ServiceName> = v4.iter().chain(v6).collect();
                self.reported_warnings.update(replanned, now)
            }
            _ => {
                let warned: BTreeSet<&ServiceName> =
                    compiler.warned_services().chain(compiler_v6.warned_services()).collect();
                self.reported_warnings.replace_all(warned, now)
            }
        };
        for warning in &new_warnings {
            match warning {
                CompileWarning::FrontendConflict { .. } => tracing::error!(?warning, "frontend claimed twice"),
                CompileWarning::EndpointsTruncated { .. } => tracing::warn!(?warning, "too many endpoints"),
                CompileWarning::ExternalIpRefused { service, refusal } => {
                    tracing::error!(service = %service, reason = refusal.reason, error = %refusal.message, "external IP refused; the rest of the Service is programmed");
                    self.metrics.of::<AgentMetrics>().reject("ExternalIP");
                    self.metrics.of::<ServiceMetrics>().external_ip_refused(refusal.reason);
                }
                CompileWarning::FamilyUnavailable { service, family } if self.disabled_families.contains(family) => {
                    tracing::info!(service = %service, ?family, "family disabled by --enable-ipv4/--enable-ipv6=false; the Service is not programmed in it");
                }
                CompileWarning::FamilyUnavailable { service, family } => {
                    tracing::warn!(service = %service, ?family, "the node has no address of this family; the Service is not programmed in it");
                    self.metrics.of::<AgentMetrics>().reject("IPFamily");
                }
            }
        }
        self.reported = current;
        // Only the changed Services' endpoints are counted again.
        let recount = changed.as_ref().ok();
        if self.health_check_index.update(catalog, recount, &self.node_name) {
            let now = self.health_check_index.checks();
            self.health_checks.send_if_modified(|checks| {
                let changed = *checks != now;
                *checks = now;
                changed
            });
        }
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

impl ServiceProgrammer {
    /// Reads the node's addresses from `published` (the interfaces controller's) while its
    /// sender lives.
    pub(super) fn follow_addresses(&mut self, published: &watch::Receiver<Vec<IpAddr>>) {
        self.published_addresses = Some(published.clone());
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
            limits: config.services.limits,
            node_name: config.node_name.clone(),
            nodeport_addresses: config.services.nodeport_addresses.clone(),
            disabled_families: config.services.disabled_families.clone(),
            hairpin_all: config.services.hairpin_mode,
            external_ips: config.external_ip_policy(),
            cluster_addresses: ClusterAddresses::default(),
            reported: BTreeSet::new(),
            reported_warnings: ReportedWarnings::default(),
            full_maps: BTreeSet::new(),
            failing_maps: BTreeSet::new(),
            zone: None,
            health_checks,
            health_check_index: HealthCheckIndex::default(),
            loopback_node_ports: config.services.socket_lb.enabled,
            maglev_all: config.services.maglev_all,
            compiler: FamilyCompiler::default(),
            compiler_v6: FamilyCompiler::default(),
            last_node: None,
            full_compile_only: full_compile_only(),
            stamp: ApiStateStamp::open(&config.pin_dir, META_SERVICES_AS_OF, "service"),
            last_writes: 0,
            published_addresses: None,
        };
        let snat_addr = config
            .node
            .node_ip
            .or_else(netif::default_route_source)
            .or_else(|| netif::ipv4_addresses().first().copied());
        let snat_addr_v6 = netif::default_route_source_v6().or_else(|| netif::ipv6_addresses().first().copied());
        let lb_config = LbConfig {
            snat_addr: snat_addr.map(crate::services::compile::addr_be).unwrap_or(0),
            snat_addr_v6: snat_addr_v6.map(V6::words).unwrap_or_default(),
            snat_port_min: config.services.snat_port_range.0,
            snat_port_max: config.services.snat_port_range.1,
            flags: if config.services.masquerade_all { LB_CONFIG_MASQUERADE_ALL } else { 0 }
                | if config.node.pod_egress { LB_CONFIG_POD_EGRESS } else { 0 },
            pad: 0,
        };
        write_lb_config(&config.pin_dir, &lb_config)?;
        write_ct_lifetimes(&config.pin_dir, &config.services.ct_lifetimes)?;
        tracing::info!(lifetimes = ?config.services.ct_lifetimes, "conntrack lifetimes configured (0: the default)");
        tracing::info!(snat_address = ?snat_addr, snat_address_v6 = ?snat_addr_v6, ports = ?config.services.snat_port_range, masquerade_all = config.services.masquerade_all, "source NAT configured");
        Ok(controller)
    }
}

/// `KUBE_ROUTER_FULL_SERVICE_COMPILE=1`: see [`ServiceProgrammer::full_compile_only`].
fn full_compile_only() -> bool {
    std::env::var("KUBE_ROUTER_FULL_SERVICE_COMPILE").is_ok_and(|v| v == "1")
}
