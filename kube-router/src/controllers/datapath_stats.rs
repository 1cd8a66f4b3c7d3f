//! Conntrack garbage collection (one schedule over every conntrack map) and the datapath's
//! counters for the metrics. The maps are opened once and kept open: reading them every second
//! costs a lookup per counter, not an open of every pinned map.
use std::{
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::Result;
use kube_router_common::{
    dsr_stat, lb_stat, map_names, plain_map_names, plain_stat, pol_guard_stat, pol_stat, sock_map_names, sock_stat,
    source_check_map_names, src_stat, xdp_stat, ServiceStats,
};

use crate::pinned::counters::Counters;
use crate::policy::maps::PolicyConntrack;
use crate::services::maps::conntrack::{Conntrack, ConntrackV6};
use crate::services::maps::stats::{SvcStatsMap, SvcStatsMapV6};
use crate::{
    bpf::socket_lb::ExemptCounts,
    exposition::{counters_by, single, Value},
    kr_metrics::{FrontendId, ServiceCounters},
    metrics::{Metrics, Subsystem},
    runtime::{Action, Controller},
    services::family::{V4, V6},
};

/// The datapath's counters as last read (every second), and the conntrack maps' fill.
#[derive(Debug, Default)]
pub struct DatapathMetrics(Mutex<DatapathCounters>);

#[derive(Clone, Debug, Default)]
pub struct DatapathCounters {
    /// `lb_stats`: the load balancer's packets by outcome.
    pub datapath_packets: Vec<(&'static str, u64)>,
    /// `xdp_stats`: the XDP fast path's packets by outcome (empty until it ever ran).
    pub xdp_packets: Vec<(&'static str, u64)>,
    /// `dsr_stats`: direct server return's packets and flows by event.
    pub dsr_packets: Vec<(&'static str, u64)>,
    /// `src_chk_stats`: source-address verification on pod veths, packets by outcome.
    pub pod_source_packets: Vec<(&'static str, u64)>,
    /// Pod veths with a `pod_src` entry, and of those the ones whose pod has no address yet.
    pub pod_source_veths: (usize, usize),
    /// `plain_stats`: the plain-traffic cache's hits and verdicts remembered.
    pub plain_cache: Vec<(&'static str, u64)>,
    pub conntrack_entries: u64,
    pub conntrack_gc_removed: u64,
    /// `pol_stats` and `pol_guard_stats` counters (empty without the policy).
    pub policy_packets: Vec<(&'static str, u64)>,
    pub policy_conntrack_entries: u64,
    /// `sock_stats` counters (empty while the socket LB never ran).
    pub socket_lb_events: Vec<(&'static str, u64)>,
}

impl DatapathMetrics {
    pub fn with<R>(&self, f: impl FnOnce(&mut DatapathCounters) -> R) -> R {
        f(&mut self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner()))
    }

    pub fn set_pod_source_veths(&self, counts: (usize, usize)) {
        self.with(|m| m.pod_source_veths = counts);
    }
}

impl Subsystem for DatapathMetrics {
    fn register(this: &Arc<Self>, registry: &mut prometheus_client::registry::Registry) {
        registry.register_collector(Box::new(this.clone()));
    }
}

impl prometheus_client::collector::Collector for DatapathMetrics {
    fn encode(&self, mut encoder: prometheus_client::encoding::DescriptorEncoder) -> std::fmt::Result {
        let m = self.with(|m| m.clone());
        let e = &mut encoder;
        counters_by(
            e,
            "kube_router_datapath_packets_total",
            "Packets seen by the load-balancer program, by outcome (per-CPU counters summed).",
            "event",
            &m.datapath_packets,
        )?;
        counters_by(
            e,
            "kube_router_xdp_packets_total",
            "Packets seen by the XDP fast path on node uplinks, by outcome (per-CPU counters summed).",
            "event",
            &m.xdp_packets,
        )?;
        counters_by(
            e,
            "kube_router_dsr_packets_total",
            "Direct server return: packets tunnelled to and received from other nodes, and flows, by event.",
            "event",
            &m.dsr_packets,
        )?;
        counters_by(
            e,
            "kube_router_pod_source_check_packets_total",
            "Packets from pod veths by source-address verification outcome (spoofed_*: dropped).",
            "event",
            &m.pod_source_packets,
        )?;
        counters_by(
            e,
            "kube_router_plain_cache_total",
            "The TC programs' plain-traffic cache: hit, a packet judged without lookups; remembered, a verdict written; generation_write_failed, the agent could not change its generation.",
            "event",
            &m.plain_cache,
        )?;
        let (checked, unassigned) = m.pod_source_veths;
        crate::exposition::series(
            e,
            "kube_router_pod_source_veths",
            "Pod veths whose source addresses are checked; unassigned: the pod has no address yet (its IP traffic is dropped).",
            prometheus_client::metrics::MetricType::Gauge,
            [("checked", checked), ("unassigned", unassigned)]
                .map(|(state, n)| (Some([("state", state)]), Value::IntGauge(n as i64))),
        )?;
        single(
            e,
            "kube_router_conntrack_entries",
            "Entries in ct_v4 after the last garbage collection.",
            &Value::IntGauge(m.conntrack_entries as i64),
        )?;
        single(
            e,
            "kube_router_conntrack_gc_removed_total",
            "Expired conntrack entries removed by garbage collection.",
            &Value::Counter(m.conntrack_gc_removed),
        )?;
        if !m.policy_packets.is_empty() {
            counters_by(
                e,
                "kube_router_policy_packets_total",
                "NetworkPolicy datapath verdicts, passes and drops before judging (pol_stats, pol_guard_stats), summed over CPUs.",
                "result",
                &m.policy_packets,
            )?;
            single(
                e,
                "kube_router_policy_conntrack_entries",
                "Entries in pol_ct_v4 after the last GC.",
                &Value::IntGauge(m.policy_conntrack_entries as i64),
            )?;
        }
        if !m.socket_lb_events.is_empty() {
            counters_by(
                e,
                "kube_router_socket_lb_events_total",
                "Socket load balancer calls by outcome (sock_stats), summed over CPUs.",
                "event",
                &m.socket_lb_events,
            )?;
        }
        Ok(())
    }
}

/// How often the counters are read.
const REFRESH_INTERVAL: Duration = Duration::from_secs(1);

/// The load balancer's maps read here.
struct ServiceMapsRead {
    conntrack: Conntrack,
    conntrack_v6: ConntrackV6,
    stats: Counters,
    frontends: SvcStatsMap,
    frontends_v6: SvcStatsMapV6,
}

/// The policy's maps read here.
struct PolicyMapsRead {
    conntrack: PolicyConntrack,
    stats: Counters,
    /// `None` until the policy's guard counters exist (a datapath from before them).
    guard_stats: Option<Counters>,
}

pub struct DatapathStatsController {
    pin_dir: PathBuf,
    metrics: Metrics,
    counters: Arc<DatapathMetrics>,
    service_counters: Arc<ServiceCounters>,
    services: Option<ServiceMapsRead>,
    policy: Option<PolicyMapsRead>,
    /// `None` until the socket load balancer's map exists (it may never).
    socket_stats: Option<Counters>,
    socket_exempt: Option<ExemptCounts>,
    /// `None` until the XDP fast path's map exists (`--xdp off` from the start: never).
    xdp_stats: Option<Counters>,
    /// `None` until direct server return's map exists.
    dsr_stats: Option<Counters>,
    source_check_stats: Option<Counters>,
    plain_stats: Option<Counters>,
    /// Every frontend's counters of the last reading.
    frontend_stats: Vec<(FrontendId, ServiceStats)>,
    gc_interval: Duration,
    last_gc: Instant,
    max_stale: Option<Duration>,
    last_stale_warning: Instant,
}

impl DatapathStatsController {
    /// Opens the maps of the parts that run (`load_balancer`, `firewall`).
    pub fn open(
        pin_dir: &Path,
        metrics: Metrics,
        load_balancer: bool,
        firewall: bool,
        gc_interval: Duration,
        max_stale: Option<Duration>,
    ) -> Result<Self> {
        let services = if load_balancer {
            Some(ServiceMapsRead {
                conntrack: Conntrack::open_pinned(pin_dir)?,
                conntrack_v6: ConntrackV6::open_pinned(pin_dir)?,
                stats: Counters::open_pinned(pin_dir, map_names::LB_STATS, lb_stat::COUNT)?,
                frontends: SvcStatsMap::open_pinned(pin_dir)?,
                frontends_v6: SvcStatsMapV6::open_pinned(pin_dir)?,
            })
        } else {
            None
        };
        let policy = if firewall {
            Some(PolicyMapsRead {
                conntrack: PolicyConntrack::open_pinned(pin_dir)?,
                stats: Counters::open_pinned(pin_dir, map_names::POLICY_STATS, pol_stat::COUNT)?,
                guard_stats: None,
            })
        } else {
            None
        };
        let now = Instant::now();
        Ok(Self {
            pin_dir: pin_dir.to_path_buf(),
            counters: metrics.of(),
            service_counters: metrics.of(),
            metrics,
            services,
            policy,
            socket_stats: None,
            socket_exempt: None,
            xdp_stats: None,
            dsr_stats: None,
            source_check_stats: None,
            plain_stats: None,
            frontend_stats: Vec::new(),
            gc_interval,
            last_gc: now,
            max_stale,
            last_stale_warning: now,
        })
    }

    fn refresh_policy(&mut self, gc: bool) {
        let Some(policy) = self.policy.as_mut() else { return };
        if policy.guard_stats.is_none() {
            policy.guard_stats =
                Counters::open_pinned(&self.pin_dir, map_names::POLICY_GUARD_STATS, pol_guard_stat::COUNT).ok();
        }
        if let Ok(stats) = policy.stats.read() {
            let guard = policy.guard_stats.as_ref().and_then(|c| c.read().ok()).unwrap_or_default();
            let guard = pol_guard_stat::NAMES.iter().copied().zip(guard);
            self.counters
                .with(|m| m.policy_packets = pol_stat::NAMES.iter().copied().zip(stats).chain(guard).collect());
        }
        if gc {
            match policy.conntrack.collect_garbage() {
                Ok((left, removed)) => self.counters.with(|m| {
                    m.policy_conntrack_entries = left as u64;
                    m.conntrack_gc_removed += removed as u64;
                }),
                Err(e) => tracing::warn!(error = %e, "policy conntrack GC failed"),
            }
        }
    }

    fn refresh_services(&mut self, gc: bool) {
        let Some(services) = self.services.as_mut() else { return };
        if let Ok(stats) = services.stats.read() {
            self.counters.with(|m| m.datapath_packets = lb_stat::NAMES.iter().copied().zip(stats).collect());
        }
        if self.socket_stats.is_none() {
            self.socket_stats = Counters::open_pinned(&self.pin_dir, sock_map_names::SOCK_STATS, sock_stat::COUNT).ok();
        }
        if self.socket_exempt.is_none() {
            self.socket_exempt = ExemptCounts::open_pinned(&self.pin_dir);
        }
        if let Some(Ok(stats)) = self.socket_stats.as_ref().map(Counters::read) {
            let exempt = self.socket_exempt.as_ref().map(|e| (ExemptCounts::EVENT, e.untranslated()));
            self.counters
                .with(|m| m.socket_lb_events = sock_stat::NAMES.iter().copied().zip(stats).chain(exempt).collect());
        }
        if self.xdp_stats.is_none() {
            self.xdp_stats = Counters::open_pinned(&self.pin_dir, map_names::XDP_STATS, xdp_stat::COUNT).ok();
        }
        if let Some(Ok(stats)) = self.xdp_stats.as_ref().map(Counters::read) {
            self.counters.with(|m| m.xdp_packets = xdp_stat::NAMES.iter().copied().zip(stats).collect());
        }
        if self.dsr_stats.is_none() {
            self.dsr_stats = Counters::open_pinned(&self.pin_dir, map_names::DSR_STATS, dsr_stat::COUNT).ok();
        }
        if let Some(Ok(stats)) = self.dsr_stats.as_ref().map(Counters::read) {
            self.counters.with(|m| m.dsr_packets = dsr_stat::NAMES.iter().copied().zip(stats).collect());
        }
        if self.source_check_stats.is_none() {
            self.source_check_stats =
                Counters::open_pinned(&self.pin_dir, source_check_map_names::SOURCE_CHECK_STATS, src_stat::COUNT).ok();
        }
        if let Some(Ok(stats)) = self.source_check_stats.as_ref().map(Counters::read) {
            self.counters.with(|m| m.pod_source_packets = src_stat::NAMES.iter().copied().zip(stats).collect());
        }
        if self.plain_stats.is_none() {
            self.plain_stats =
                Counters::open_pinned(&self.pin_dir, plain_map_names::PLAIN_STATS, plain_stat::COUNT).ok();
        }
        if let Some(Ok(stats)) = self.plain_stats.as_ref().map(Counters::read) {
            // The agent's own failed changes of the generation beside the datapath's counters.
            let failed = (crate::pinned::plain::GENERATION_WRITE_FAILED, crate::pinned::plain::failed_writes());
            self.counters
                .with(|m| m.plain_cache = plain_stat::NAMES.iter().copied().zip(stats).chain([failed]).collect());
        }
        let started = Instant::now();
        // Read outside the metrics' lock (tens of thousands of syscalls at 10,000 Services)
        // into a buffer kept from one second to the next.
        let buffer = &mut self.frontend_stats;
        buffer.clear();
        let read =
            services.frontends.for_each(|key, stats| buffer.push((FrontendId::of::<V4>(&key), stats))).and_then(|()| {
                services.frontends_v6.for_each(|key, stats| buffer.push((FrontendId::of::<V6>(&key), stats)))
            });
        match read {
            Ok(()) => {
                self.service_counters.with(|m| m.sample(started, buffer.iter().copied()));
                self.service_counters.export_time.0.observe(started.elapsed().as_secs_f64());
            }
            Err(e) => tracing::debug!(error = %e, "cannot read svc_stats_v4/v6"),
        }
        if gc {
            let (v4, v6) = (&mut services.conntrack, &mut services.conntrack_v6);
            match v4.collect_garbage().and_then(|a| Ok((a, v6.collect_garbage()?))) {
                Ok(((left, removed), (left_v6, removed_v6))) => self.counters.with(|m| {
                    m.conntrack_entries = (left + left_v6) as u64;
                    m.conntrack_gc_removed += (removed + removed_v6) as u64;
                }),
                Err(e) => tracing::warn!(error = %e, "conntrack GC failed"),
            }
            self.metrics.heartbeat("conntrack-gc");
        }
    }

    fn warn_if_stale(&mut self) {
        let Some(max_stale) = self.max_stale else { return };
        let last_sync = self.metrics.of::<super::services::ServiceMetrics>().last_sync.get();
        let stale = last_sync.map(|t| crate::metrics::unix_now() - t).unwrap_or(0.0);
        if stale > max_stale.as_secs_f64() && self.last_stale_warning.elapsed() > Duration::from_secs(60) {
            tracing::warn!(stale_secs = stale as u64, "desired state older than --max-stale; still serving it");
            self.last_stale_warning = Instant::now();
        }
    }
}

impl Controller for DatapathStatsController {
    fn name(&self) -> &'static str {
        "datapath-stats"
    }

    async fn reconcile(&mut self) -> Result<Action> {
        let gc = self.last_gc.elapsed() >= self.gc_interval;
        if gc {
            self.last_gc = Instant::now();
        }
        // Tens of thousands of map syscalls at 10,000 Services (every frontend's counters, the
        // conntrack walk): off the async workers, so the controllers that write the maps after
        // a change never wait behind them (two workers on a two-core node).
        tokio::task::block_in_place(|| {
            self.refresh_policy(gc);
            self.refresh_services(gc);
        });
        self.warn_if_stale();
        self.metrics.heartbeat("agent");
        Ok(Action::RequeueAfter(REFRESH_INTERVAL))
    }
}
