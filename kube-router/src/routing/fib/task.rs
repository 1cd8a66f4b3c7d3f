//! The FIB task: keeps the kernel's routes of our protocol (and the overlay maps) equal to the
//! BGP speaker's target, from a `watch`, so a slow netlink socket never stalls the speaker.
use std::{
    path::PathBuf,
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::{
    sync::watch,
    time::{sleep_until, Instant},
};
use tracing::{info, warn};

use super::{
    health::{FibHealth, FibStats, Report},
    reconcile,
    resolve::Reachability,
    DesiredSet,
};
use crate::{
    map_writes::MapMetrics,
    routing::overlay::{maps::OverlayDataplane, plan::OverlayTarget},
};

/// Routes the kernel should have (our protocol only) and whether stale ones may go yet.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FibTarget {
    pub routes: Arc<DesiredSet>,
    /// Tunnels of the pod overlay (map entries written with the routes that need them).
    pub overlay: Arc<OverlayTarget>,
    pub allow_deletes: bool,
}

/// The FIB task's side of the speaker: the routes to install, and where to report what the
/// kernel's own routing looks like (for next-hop resolution and the import policy).
pub struct FibLink {
    pub target: watch::Receiver<FibTarget>,
    report_view: Box<dyn Fn(Reachability) + Send + Sync>,
    stats: Arc<Mutex<FibStats>>,
}

impl FibLink {
    pub fn new(
        target: watch::Receiver<FibTarget>,
        report_view: impl Fn(Reachability) + Send + Sync + 'static,
        stats: Arc<Mutex<FibStats>>,
    ) -> Self {
        Self { target, report_view: Box::new(report_view), stats }
    }

    fn report_view(&self, view: Reachability) {
        (self.report_view)(view);
    }

    fn set_stats(&self, stats: FibStats) {
        *self.stats.lock().unwrap_or_else(|p| p.into_inner()) = stats;
    }
}

/// Keeps the kernel's routes of our protocol equal to the speaker's target, writing only
/// differences and never touching a route that is not ours (see [`super`]). Re-reads the
/// table when the kernel's own routes, addresses or links change (and every 30 s, so that a
/// route removed by hand comes back), reports that view to the speaker (next-hop resolution,
/// the node's own subnets), and retries refused writes with backoff ([`FibHealth`]). The overlay's
/// map writes are counted in `map_metrics`.
pub async fn run_fib(
    routes: super::netlink::NetlinkRoutes,
    mut link: FibLink,
    bpf_root: PathBuf,
    map_metrics: Arc<MapMetrics>,
) {
    const PERIODIC: Duration = Duration::from_secs(30);
    let mut health = FibHealth::new();
    let mut overlay = OverlayDataplane::new(bpf_root, map_metrics);
    let mut overlay_error: Option<String> = None;
    let mut last_view: Option<Reachability> = None;
    let mut last_error: Option<String> = None;
    let protocol = routes.protocol();
    let mut changes = match super::netlink::watch_changes() {
        Ok(rx) => Some(rx),
        Err(e) => {
            warn!(error = %e, "cannot watch routing changes; checking every 30 s instead");
            None
        }
    };
    loop {
        let wanted = link.target.borrow_and_update().clone();
        let pass_started = std::time::Instant::now();
        let listed = async {
            Ok::<_, anyhow::Error>((routes.list().await?, routes.local_addresses().await?, routes.links().await?))
        }
        .await;
        match listed {
            Ok((table, local, links)) => {
                last_error = None;
                let view = Reachability::new(&table, &local).with_links(links);
                let table_changed = last_view.as_ref() != Some(&view);
                if table_changed {
                    link.report_view(view.clone());
                    last_view = Some(view);
                }
                let mut report_overlay = |result: anyhow::Result<()>| match result {
                    Ok(()) => overlay_error = None,
                    Err(e) => {
                        let text = format!("{e:#}");
                        if overlay_error.as_ref() != Some(&text) {
                            warn!(error = %text, "cannot program the overlay; retrying");
                            overlay_error = Some(text);
                        }
                    }
                };
                let after = match overlay.prepare(&wanted.overlay, wanted.allow_deletes) {
                    Ok(after) => after,
                    Err(e) => {
                        report_overlay(Err(e));
                        Vec::new()
                    }
                };
                let plan = reconcile(&table, &wanted.routes, wanted.allow_deletes);
                let (ops, reports) = health.admit(plan, std::time::Instant::now(), table_changed);
                log_fib_reports(&reports);
                if !ops.is_empty() {
                    info!(changes = ops.len(), routes = wanted.routes.len(), "updating kernel routes");
                }
                let mut results = Vec::with_capacity(ops.len());
                for op in ops {
                    let result = routes.apply(&op).await;
                    let peer = wanted.routes.get(&op.destination()).and_then(|d| d.peer);
                    results.push((op, peer, result));
                }
                log_fib_reports(&health.record(results, std::time::Instant::now()));
                if !after.is_empty() {
                    report_overlay(overlay.finish(&after));
                }
                health.pass_done(table.ours.len(), pass_started.elapsed());
                link.set_stats(health.stats());
            }
            Err(e) => {
                let text = format!("{e:#}");
                if last_error.as_ref() != Some(&text) {
                    warn!(error = %text, "reading kernel routes failed; retrying");
                    last_error = Some(text);
                }
            }
        }
        let wake = health
            .next_retry()
            .map(|at| Instant::from_std(at).max(Instant::now()))
            .unwrap_or(Instant::now() + PERIODIC)
            .min(Instant::now() + PERIODIC);
        loop {
            tokio::select! {
                changed = link.target.changed() => {
                    if changed.is_err() { return }
                    break;
                }
                _ = sleep_until(wake) => break,
                message = async { match changes.as_mut() { Some(rx) => rx.recv().await, None => std::future::pending().await } } => {
                    match message {
                        // Our own writes echo back: not a change of the kernel's routing.
                        Some(m) if super::netlink::route_protocol(&m) == Some(protocol) => continue,
                        Some(_) => {
                            // Let a burst (an interface going down takes its routes) settle.
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            if let Some(rx) = changes.as_mut() {
                                while rx.try_recv().is_ok() {}
                            }
                            break;
                        }
                        None => {
                            changes = None;
                            continue;
                        }
                    }
                }
            }
        }
    }
}

fn log_fib_reports(reports: &[Report]) {
    for report in reports {
        match report {
            Report::Conflicts { count, examples } => {
                let examples: Vec<String> = examples.iter().map(|(d, why)| format!("{d}: {why}")).collect();
                warn!(count, examples = %examples.join("; "), "learned routes not installed: the node already routes these destinations itself (left untouched, counted in kube_router_bgp_route_conflicts)");
            }
            Report::ConflictsEnded { count } => {
                info!(count, "route conflicts ended: the other route is gone or ours is no longer wanted");
            }
            Report::Refused { peer, error, count, example, retry_in } => {
                warn!(peer = %peer.map(|p| p.to_string()).unwrap_or_else(|| "-".into()), count, error = %error.describe(),
                    example = %format!("{} via {}", example.0, example.1), retry_in_secs = retry_in.as_secs(),
                    "the kernel refused learned routes; retrying with backoff");
            }
            Report::MoreRefused { groups, routes } => {
                warn!(groups, routes, "the kernel refused more learned routes (further peers or reasons)");
            }
        }
    }
}
