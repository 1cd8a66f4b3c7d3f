//! What goes wrong between the routes we want and the kernel, remembered so that it is logged
//! once and retried only when there is a reason to expect another answer.
//!
//! * A **conflict** (a destination another route already claims) is reported once when it
//!   appears (all new ones of a round in one line), counted, and not written again while it
//!   lasts; when the other route goes, the next round simply installs ours.
//! * A **refusal** (the kernel rejected a write, e.g. a gateway it cannot reach) is reported
//!   as one line per peer and reason per round, and the route is retried with exponential
//!   backoff (30 s doubling to 10 min), or at once when the kernel's own routes or addresses
//!   change, or when we want another gateway for it.
//!
//! Pure: the caller passes the time and performs the writes.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    time::{Duration, Instant},
};

use ipnet::IpNet;
use prometheus_client::{
    encoding::DescriptorEncoder,
    metrics::{counter::ConstCounter, gauge::ConstGauge},
};

use super::{ForeignRoute, KernelRoute, Plan, RouteOp};

const FIRST_RETRY: Duration = Duration::from_secs(30);
const MAX_RETRY: Duration = Duration::from_secs(600);
/// Refusal lines per round; the rest are summed up in one more line.
const MAX_REPORT_GROUPS: usize = 5;
const EXAMPLES: usize = 3;

/// errno of a refused route write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct KernelError(pub i32);

impl KernelError {
    pub const EXISTS: KernelError = KernelError(libc::EEXIST);
    pub const NO_SUCH_ROUTE: KernelError = KernelError(libc::ESRCH);

    pub fn describe(self) -> String {
        std::io::Error::from_raw_os_error(self.0).to_string()
    }
}

/// Something worth one log line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Report {
    /// Destinations we would route that other routes already claim (first seen this round).
    Conflicts { count: usize, examples: Vec<(IpNet, String)> },
    /// Conflicts that ended: the other route is gone (ours follows) or we no longer want it.
    ConflictsEnded { count: usize },
    /// Writes the kernel refused this round, for one peer and reason.
    Refused {
        peer: Option<IpAddr>,
        error: KernelError,
        count: usize,
        example: (IpNet, KernelRoute),
        retry_in: Duration,
    },
    /// Further refusal groups of this round, summed up.
    MoreRefused { groups: usize, routes: usize },
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FibStats {
    pub conflicts: usize,
    pub refused: usize,
    pub conflicts_total: u64,
    pub refusals_total: u64,
    /// Our routes in the kernel after the last pass (kube-router: host routes synced).
    pub installed: usize,
    /// Routes written (created, or replaced with other gateways) and deleted, since start.
    pub added_total: u64,
    pub removed_total: u64,
    /// One reconcile pass: listing the kernel's routes and writing the differences.
    pub pass_time: crate::exposition::Histogram,
}

impl FibStats {
    /// The FIB task's families: kube-router's host routes, and the routes it could not install.
    pub fn encode(&self, encoder: &mut DescriptorEncoder) -> std::fmt::Result {
        use crate::exposition::{single, UPSTREAM_COUNTER};
        single(
            encoder,
            "kube_router_host_routes_synced",
            "Count of host routes currently synced to the system",
            &ConstGauge::new(self.installed as i64),
        )?;
        // kube-router's host routes: the routes learned over BGP that the agent keeps in the
        // kernel (its injected routes). Its counters have no `_total`.
        for (name, help, n) in [
            ("kube_router_host_routes_added", "Total count of host routes added to the system", self.added_total),
            ("kube_router_host_routes_removed", "Total count of host routes removed to the system", self.removed_total),
        ] {
            crate::exposition::series(
                encoder,
                name,
                help,
                UPSTREAM_COUNTER,
                [(None::<[(&str, &str); 0]>, ConstCounter::new(n))],
            )?;
        }
        single(
            encoder,
            "kube_router_host_routes_sync_time",
            "Time it took for the host routes controller to sync to the system",
            &self.pass_time,
        )?;
        single(
            encoder,
            "kube_router_bgp_route_conflicts",
            "Learned destinations not installed because another route (not ours) already claims them.",
            &ConstGauge::new(self.conflicts as i64),
        )?;
        single(
            encoder,
            "kube_router_bgp_route_conflicts_total",
            "Route conflicts seen (each once).",
            &ConstCounter::new(self.conflicts_total),
        )?;
        single(
            encoder,
            "kube_router_bgp_routes_refused",
            "Learned routes the kernel refused, waiting for a retry.",
            &ConstGauge::new(self.refused as i64),
        )?;
        single(
            encoder,
            "kube_router_bgp_route_refusals_total",
            "Kernel route writes refused.",
            &ConstCounter::new(self.refusals_total),
        )
    }
}

#[derive(Clone, Debug)]
struct Refused {
    route: KernelRoute,
    failures: u32,
    retry_at: Instant,
}

#[derive(Debug, Default)]
pub struct FibHealth {
    conflicts: BTreeMap<IpNet, ForeignRoute>,
    refused: BTreeMap<IpNet, Refused>,
    conflicts_total: u64,
    refusals_total: u64,
    added_total: u64,
    removed_total: u64,
    /// Routes created minus routes deleted in the pass being recorded.
    pass_net: i64,
    installed: usize,
    pass_time: crate::exposition::Histogram,
}

fn backoff(failures: u32) -> Duration {
    FIRST_RETRY.saturating_mul(1u32 << failures.saturating_sub(1).min(10)).min(MAX_RETRY)
}

impl FibHealth {
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes a reconcile plan: records its conflicts, and holds back the writes of routes the
    /// kernel refused until their retry time, unless the kernel's own routes changed
    /// (`table_changed`) or the route itself did. Returns the writes to attempt now.
    pub fn admit(&mut self, plan: Plan, now: Instant, table_changed: bool) -> (Vec<RouteOp>, Vec<Report>) {
        let mut reports = Vec::new();
        let mut current = BTreeMap::new();
        let mut new_examples = Vec::new();
        let mut new_count = 0;
        for conflict in plan.conflicts {
            if self.conflicts.get(&conflict.destination) != Some(&conflict.foreign) {
                new_count += 1;
                self.conflicts_total += 1;
                if new_examples.len() < EXAMPLES {
                    new_examples.push((conflict.destination, conflict.foreign.describe()));
                }
            }
            current.insert(conflict.destination, conflict.foreign);
        }
        let ended = self.conflicts.keys().filter(|d| !current.contains_key(*d)).count();
        self.conflicts = current;
        if new_count > 0 {
            reports.push(Report::Conflicts { count: new_count, examples: new_examples });
        }
        if ended > 0 {
            reports.push(Report::ConflictsEnded { count: ended });
        }
        // A refused route that is no longer written is either installed or no longer wanted.
        let pending: BTreeSet<IpNet> = plan.ops.iter().map(RouteOp::destination).collect();
        self.refused.retain(|d, _| pending.contains(d));
        let ops = plan
            .ops
            .into_iter()
            .filter(|op| match op {
                RouteOp::Create(d, g) | RouteOp::Replace(d, g) => match self.refused.get(d) {
                    Some(r) => table_changed || r.route != *g || now >= r.retry_at,
                    None => true,
                },
                RouteOp::Delete(..) => true,
            })
            .collect();
        (ops, reports)
    }

    /// Takes the outcome of the attempted writes (with the peer each route came from).
    pub fn record(
        &mut self,
        results: impl IntoIterator<Item = (RouteOp, Option<IpAddr>, Result<(), KernelError>)>,
        now: Instant,
    ) -> Vec<Report> {
        // Per (peer, error): how many routes, one example, the longest retry delay.
        type Group = (usize, (IpNet, KernelRoute), Duration);
        let mut groups: BTreeMap<(Option<IpAddr>, KernelError), Group> = BTreeMap::new();
        for (op, peer, result) in results {
            let destination = op.destination();
            match (op, result) {
                (op, Ok(())) => {
                    self.refused.remove(&destination);
                    match op {
                        RouteOp::Create(..) => {
                            (self.added_total, self.pass_net) = (self.added_total + 1, self.pass_net + 1)
                        }
                        RouteOp::Replace(..) => self.added_total += 1,
                        RouteOp::Delete(..) => {
                            (self.removed_total, self.pass_net) = (self.removed_total + 1, self.pass_net - 1)
                        }
                    }
                }
                // Already gone: what a delete wanted.
                (RouteOp::Delete(..), Err(KernelError::NO_SUCH_ROUTE)) => self.pass_net -= 1,
                (RouteOp::Create(_, route) | RouteOp::Replace(_, route) | RouteOp::Delete(_, route), Err(error)) => {
                    self.refusals_total += 1;
                    let failures = match self.refused.get(&destination) {
                        Some(r) if r.route == route => r.failures + 1,
                        _ => 1,
                    };
                    let retry_in = backoff(failures);
                    self.refused
                        .insert(destination, Refused { route: route.clone(), failures, retry_at: now + retry_in });
                    let group = groups.entry((peer, error)).or_insert((0, (destination, route), retry_in));
                    group.0 += 1;
                }
            }
        }
        let mut reports: Vec<Report> = groups
            .iter()
            .take(MAX_REPORT_GROUPS)
            .map(|((peer, error), (count, example, retry_in))| Report::Refused {
                peer: *peer,
                error: *error,
                count: *count,
                example: example.clone(),
                retry_in: *retry_in,
            })
            .collect();
        if groups.len() > MAX_REPORT_GROUPS {
            let rest: Vec<usize> = groups.values().skip(MAX_REPORT_GROUPS).map(|g| g.0).collect();
            reports.push(Report::MoreRefused { groups: rest.len(), routes: rest.iter().sum() });
        }
        reports
    }

    /// Ends a pass that found `ours_before` of our routes in the kernel and took `took`.
    pub fn pass_done(&mut self, ours_before: usize, took: Duration) {
        let net = std::mem::take(&mut self.pass_net);
        self.installed = usize::try_from(ours_before as i64 + net).unwrap_or(0);
        self.pass_time.observe(took.as_secs_f64());
    }

    /// When the earliest held-back route is due.
    pub fn next_retry(&self) -> Option<Instant> {
        self.refused.values().map(|r| r.retry_at).min()
    }

    pub fn stats(&self) -> FibStats {
        FibStats {
            conflicts: self.conflicts.len(),
            refused: self.refused.len(),
            conflicts_total: self.conflicts_total,
            refusals_total: self.refusals_total,
            installed: self.installed,
            added_total: self.added_total,
            removed_total: self.removed_total,
            pass_time: self.pass_time.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::fib::{reconcile, Desired, DesiredSet, Gateways, KernelTable};

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn want(n: u32, gateway: &str) -> DesiredSet {
        (0..n)
            .map(|i| {
                let net = IpNet::new(IpAddr::V4(std::net::Ipv4Addr::from(0x0a00_0000 + (i << 8))), 24).unwrap();
                (net, Desired { route: Gateways::One(ip(gateway)).into(), peer: Some(ip("10.77.0.2")) })
            })
            .collect()
    }

    /// Every write refused with EINVAL.
    fn refuse_all(ops: &[RouteOp]) -> Vec<(RouteOp, Option<IpAddr>, Result<(), KernelError>)> {
        ops.iter().map(|op| (op.clone(), Some(ip("10.77.0.2")), Err(KernelError(libc::EINVAL)))).collect()
    }

    #[test]
    fn ten_thousand_refusals_are_one_line_per_round_with_backoff() {
        let mut health = FibHealth::new();
        let desired = want(10_000, "10.50.0.2");
        let table = KernelTable::default();
        let start = Instant::now();
        let mut lines = 0;
        let mut attempts = 0;
        // Two minutes of a FIB loop waking every second.
        for second in 0..120 {
            let now = start + Duration::from_secs(second);
            let (ops, reports) = health.admit(reconcile(&table, &desired, true), now, false);
            lines += reports.len();
            if !ops.is_empty() {
                attempts += 1;
                assert_eq!(ops.len(), 10_000, "a round retries every refused route together");
                let reports = health.record(refuse_all(&ops), now);
                assert!(matches!(&reports[..], [Report::Refused { count: 10_000, .. }]), "{reports:?}");
                lines += reports.len();
            }
        }
        // Rounds at 0 s, 30 s, 90 s.
        assert_eq!(attempts, 3);
        assert_eq!(lines, 3);
        assert_eq!(health.stats().refused, 10_000);
        assert_eq!(health.stats().refusals_total, 30_000);
    }

    #[test]
    fn a_changed_table_or_route_is_retried_at_once_and_success_clears_the_refusal() {
        let mut health = FibHealth::new();
        let table = KernelTable::default();
        let now = Instant::now();
        let desired = want(1, "10.50.0.2");
        let (ops, _) = health.admit(reconcile(&table, &desired, true), now, false);
        health.record(refuse_all(&ops), now);
        assert!(health.admit(reconcile(&table, &desired, true), now, false).0.is_empty());
        assert_eq!(health.admit(reconcile(&table, &desired, true), now, true).0.len(), 1, "table changed");
        let other = want(1, "10.50.0.3");
        let (ops, _) = health.admit(reconcile(&table, &other, true), now, false);
        assert_eq!(ops.len(), 1, "another gateway is another attempt");
        let results: Vec<_> = ops.iter().map(|op| (op.clone(), None, Ok(()))).collect();
        assert!(health.record(results, now).is_empty());
        assert_eq!(health.stats().refused, 0);
        assert_eq!(health.next_retry(), None);
    }

    #[test]
    fn conflicts_are_reported_once_until_they_change() {
        let mut health = FibHealth::new();
        let mut table = KernelTable::default();
        let foreign = ForeignRoute {
            protocol: 4,
            kind: ForeignRoute::UNICAST,
            gateway: Some(ip("192.0.2.254")),
            oif: Some(2),
            metric: 0,
            linkdown: false,
        };
        table.foreign.insert(net("0.0.0.0/0"), foreign.clone());
        let desired: DesiredSet =
            [(net("0.0.0.0/0"), Desired { route: Gateways::One(ip("10.77.0.2")).into(), peer: None })].into();
        let now = Instant::now();
        let (ops, reports) = health.admit(reconcile(&table, &desired, true), now, false);
        assert!(ops.is_empty());
        assert!(matches!(&reports[..], [Report::Conflicts { count: 1, .. }]));
        for _ in 0..5 {
            let (ops, reports) = health.admit(reconcile(&table, &desired, true), now, false);
            assert!(ops.is_empty() && reports.is_empty());
        }
        assert_eq!(health.stats().conflicts_total, 1);
        let mut changed = foreign;
        changed.protocol = 16;
        table.foreign.insert(net("0.0.0.0/0"), changed);
        assert_eq!(health.admit(reconcile(&table, &desired, true), now, true).1.len(), 1);
        table.foreign.clear();
        let (ops, reports) = health.admit(reconcile(&table, &desired, true), now, true);
        assert_eq!(ops.len(), 1, "the other route is gone: ours goes in");
        assert_eq!(reports, vec![Report::ConflictsEnded { count: 1 }]);
        assert_eq!(health.stats().conflicts, 0);
    }

    #[test]
    fn host_route_counts_follow_the_writes_that_succeeded() {
        let mut health = FibHealth::new();
        let desired = want(3, "10.50.0.2");
        let (ops, _) = health.admit(reconcile(&KernelTable::default(), &desired, true), Instant::now(), false);
        let mut results: Vec<_> = ops.iter().map(|op| (op.clone(), None, Ok(()))).collect();
        results[2].2 = Err(KernelError(libc::EINVAL));
        health.record(results, Instant::now());
        health.pass_done(0, Duration::from_millis(2));
        let stats = health.stats();
        assert_eq!((stats.installed, stats.added_total, stats.removed_total), (2, 2, 0), "the refused one is not in");
        // The next pass finds those two, and one of them is no longer wanted.
        let mut table = KernelTable::default();
        for (destination, want) in desired.iter().take(2) {
            table.ours.insert(*destination, want.route.clone());
        }
        let fewer: DesiredSet = desired.iter().take(1).map(|(d, w)| (*d, w.clone())).collect();
        let (ops, _) = health.admit(reconcile(&table, &fewer, true), Instant::now(), false);
        assert!(matches!(&ops[..], [RouteOp::Delete(..)]), "{ops:?}");
        health.record(ops.into_iter().map(|op| (op, None, Ok(()))), Instant::now());
        health.pass_done(2, Duration::from_millis(1));
        let stats = health.stats();
        assert_eq!((stats.installed, stats.added_total, stats.removed_total), (1, 2, 1));
        let text = crate::exposition::encode_with(move |encoder| stats.encode(encoder));
        assert!(text.contains("\nkube_router_host_routes_synced 1\n"), "{text}");
        assert!(text.contains("\nkube_router_host_routes_removed 1\n"), "{text}");
        assert!(text.contains("\nkube_router_host_routes_sync_time_count 2\n"), "{text}");
    }
}
