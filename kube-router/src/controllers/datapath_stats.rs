//! Conntrack garbage collection (one schedule over every conntrack map) and the datapath's
//! counters for the metrics. The maps are opened once and kept open: reading them every second
//! costs a lookup per counter, not an open of every pinned map.
use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::Result;
use kube_router_common::{
    dsr_stat, lb_stat, map_names, pol_guard_stat, pol_stat, sock_map_names, sock_stat, source_check_map_names,
    src_stat, xdp_stat, ServiceStats,
};

use crate::{
    bpf::{
        counters::Counters,
        policy_maps::PolicyConntrack,
        service_maps::{Conntrack, ConntrackV6},
        socket_lb::ExemptCounts,
        svc_stats::{SvcStatsMap, SvcStatsMapV6},
    },
    kr_metrics::FrontendId,
    metrics::{self, Metrics},
    runtime::{Action, Controller},
    services::family::{V4, V6},
};

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
            metrics,
            services,
            policy,
            socket_stats: None,
            socket_exempt: None,
            xdp_stats: None,
            dsr_stats: None,
            source_check_stats: None,
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
            self.metrics.with(|m| m.policy_packets = pol_stat::NAMES.iter().copied().zip(stats).chain(guard).collect());
        }
        if gc {
            match policy.conntrack.collect_garbage() {
                Ok((left, removed)) => self.metrics.with(|m| {
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
            self.metrics.with(|m| m.datapath_packets = lb_stat::NAMES.iter().copied().zip(stats).collect());
        }
        if self.socket_stats.is_none() {
            self.socket_stats = Counters::open_pinned(&self.pin_dir, sock_map_names::SOCK_STATS, sock_stat::COUNT).ok();
        }
        if self.socket_exempt.is_none() {
            self.socket_exempt = ExemptCounts::open_pinned(&self.pin_dir);
        }
        if let Some(Ok(stats)) = self.socket_stats.as_ref().map(Counters::read) {
            let exempt = self.socket_exempt.as_ref().map(|e| (ExemptCounts::EVENT, e.untranslated()));
            self.metrics
                .with(|m| m.socket_lb_events = sock_stat::NAMES.iter().copied().zip(stats).chain(exempt).collect());
        }
        if self.xdp_stats.is_none() {
            self.xdp_stats = Counters::open_pinned(&self.pin_dir, map_names::XDP_STATS, xdp_stat::COUNT).ok();
        }
        if let Some(Ok(stats)) = self.xdp_stats.as_ref().map(Counters::read) {
            self.metrics.with(|m| m.xdp_packets = xdp_stat::NAMES.iter().copied().zip(stats).collect());
        }
        if self.dsr_stats.is_none() {
            self.dsr_stats = Counters::open_pinned(&self.pin_dir, map_names::DSR_STATS, dsr_stat::COUNT).ok();
        }
        if let Some(Ok(stats)) = self.dsr_stats.as_ref().map(Counters::read) {
            self.metrics.with(|m| m.dsr_packets = dsr_stat::NAMES.iter().copied().zip(stats).collect());
        }
        if self.source_check_stats.is_none() {
            self.source_check_stats =
                Counters::open_pinned(&self.pin_dir, source_check_map_names::SOURCE_CHECK_STATS, src_stat::COUNT).ok();
        }
        if let Some(Ok(stats)) = self.source_check_stats.as_ref().map(Counters::read) {
            self.metrics.with(|m| m.pod_source_packets = src_stat::NAMES.iter().copied().zip(stats).collect());
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
            Ok(()) => self.metrics.with(|m| {
                m.kr.sample(started, buffer.iter().copied());
                m.kr.stats_export_time.observe(started.elapsed().as_secs_f64());
            }),
            Err(e) => tracing::debug!(error = %e, "cannot read svc_stats_v4/v6"),
        }
        if gc {
            let (v4, v6) = (&mut services.conntrack, &mut services.conntrack_v6);
            match v4.collect_garbage().and_then(|a| Ok((a, v6.collect_garbage()?))) {
                Ok(((left, removed), (left_v6, removed_v6))) => self.metrics.with(|m| {
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
        let stale = self.metrics.with(|m| m.last_sync_unix.map(|t| metrics::unix_now() - t)).unwrap_or(0.0);
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
