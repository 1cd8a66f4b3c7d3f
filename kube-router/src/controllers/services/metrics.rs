//! The services proxy's metrics.
use std::sync::Arc;

use crate::{
    exposition::{register, sync_histogram, Counter, Family, IntGauge, OptionalGauge, SecondsSince, Timestamp},
    metrics::{Labels, Subsystem},
    services::incremental::FullCompile,
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
    pub(super) dropped_endpoints: IntGauge,
    /// UDP flows whose entries were removed: their backend left the flow's frontend while
    /// still backing another.
    pub(super) conntrack_purged_flows: Counter,
    /// Conntrack walks for such flows (one per sync that moved a UDP backend out of a frontend).
    pub(super) conntrack_purge_scans: Counter,
    /// Frontends in `svc_v4` (kube-router: IPVS services).
    pub(super) frontends: IntGauge,
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
