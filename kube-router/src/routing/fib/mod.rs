//! The kernel routing table as far as kube-router owns it: routes tagged with our routing
//! protocol number. Reconciling writes only real differences (a route that is already right is
//! never deleted and re-added, so forwarding never flaps) and never touches a route we did not
//! install: a destination some other route already claims (connected, static, DHCP, another
//! routing daemon) is a *conflict*, reported and left alone; new routes are created
//! exclusively (`NLM_F_EXCL`), so a route that appears between our listing and our write makes
//! the kernel refuse ours instead of letting ours replace it.
pub mod health;
pub mod netlink;
pub mod resolve;
pub mod target;
pub mod task;

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::IpAddr,
};

use ipnet::IpNet;

/// Routing protocol number on our routes (`ip route show proto 186`). 186 is "bgp" in
/// iproute2's rt_protos; configurable because FRR's zebra uses it too.
pub const DEFAULT_ROUTE_PROTOCOL: u8 = 186;

/// Where one of our routes sends packets: one gateway, or several for an equal-cost multipath
/// route. Kept sorted and without duplicates so that equal routes compare equal; one gateway
/// (the common case) needs no allocation.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Gateways {
    One(IpAddr),
    Many(Box<[IpAddr]>),
}

impl Gateways {
    /// None for an empty list.
    pub fn new(mut gateways: Vec<IpAddr>) -> Option<Self> {
        gateways.sort();
        gateways.dedup();
        match gateways.len() {
            0 => None,
            1 => Some(Gateways::One(gateways[0])),
            _ => Some(Gateways::Many(gateways.into_boxed_slice())),
        }
    }

    pub fn as_slice(&self) -> &[IpAddr] {
        match self {
            Gateways::One(gateway) => std::slice::from_ref(gateway),
            Gateways::Many(gateways) => gateways,
        }
    }

    pub fn first(&self) -> IpAddr {
        self.as_slice()[0]
    }
}

impl From<IpAddr> for Gateways {
    fn from(gateway: IpAddr) -> Self {
        Gateways::One(gateway)
    }
}

impl fmt::Display for Gateways {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text: Vec<String> = self.as_slice().iter().map(IpAddr::to_string).collect();
        f.write_str(&text.join(","))
    }
}

/// One of our routes as the kernel holds it: its gateway(s) and, for routes into the
/// overlay, the path MTU (the underlay's minus the encapsulation).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct KernelRoute {
    pub gateways: Gateways,
    pub mtu: Option<u32>,
}

impl From<Gateways> for KernelRoute {
    fn from(gateways: Gateways) -> Self {
        Self { gateways, mtu: None }
    }
}

impl fmt::Display for KernelRoute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "via {}", self.gateways)?;
        match self.mtu {
            Some(mtu) => write!(f, " mtu {mtu}"),
            None => Ok(()),
        }
    }
}

/// destination -> route, for one routing table and our protocol.
pub type RouteSet = BTreeMap<IpNet, KernelRoute>;

/// A route we want in the kernel, with the BGP peer it was learned from (so that failures
/// can be reported per peer; the kernel does not know it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Desired {
    pub route: KernelRoute,
    pub peer: Option<IpAddr>,
}

pub type DesiredSet = BTreeMap<IpNet, Desired>;

/// The kernel's preferred (lowest metric) route to a destination that is not ours.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ForeignRoute {
    /// Routing protocol (2 kernel, 3 boot, 4 static, 16 dhcp, 9 ra, ...).
    pub protocol: u8,
    /// Route type (1 unicast, 6 blackhole, 7 unreachable, ...).
    pub kind: u8,
    pub gateway: Option<IpAddr>,
    pub oif: Option<u32>,
    pub metric: u32,
    /// Its next hop's link is down (`linkdown`).
    pub linkdown: bool,
}

impl ForeignRoute {
    pub const UNICAST: u8 = 1;

    /// A link route (a connected subnet): unicast, no gateway, an output interface.
    pub fn is_connected(&self) -> bool {
        self.kind == Self::UNICAST && self.gateway.is_none() && self.oif.is_some()
    }

    pub fn describe(&self) -> String {
        let protocol = match self.protocol {
            2 => "kernel (connected)".to_string(),
            3 => "boot (ip route)".to_string(),
            4 => "static".to_string(),
            9 => "ra".to_string(),
            16 => "dhcp".to_string(),
            n => format!("protocol {n}"),
        };
        match self.gateway {
            Some(gateway) => format!("{protocol} route via {gateway}"),
            None => format!("{protocol} route"),
        }
    }
}

/// One routing table as read from the kernel: our routes, and everyone else's.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelTable {
    pub ours: RouteSet,
    pub foreign: BTreeMap<IpNet, ForeignRoute>,
}

/// The node's own addresses (any interface, any scope but host-local loopback).
pub type LocalAddresses = BTreeSet<IpAddr>;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RouteOp {
    /// A destination nobody routes yet: created exclusively (`NLM_F_CREATE | NLM_F_EXCL`), so a
    /// route that appeared since our listing makes the kernel refuse ours (EEXIST).
    Create(IpNet, KernelRoute),
    /// Our own route with other gateways: replaced atomically (`NLM_F_REPLACE`), so forwarding
    /// never stops.
    Replace(IpNet, KernelRoute),
    /// Our own route, deleted by destination, protocol and gateway, so only ours can match.
    Delete(IpNet, KernelRoute),
}

impl RouteOp {
    pub fn destination(&self) -> IpNet {
        match self {
            RouteOp::Create(d, _) | RouteOp::Replace(d, _) | RouteOp::Delete(d, _) => *d,
        }
    }
}

/// A destination we would route but that another route already claims.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Conflict {
    pub destination: IpNet,
    pub foreign: ForeignRoute,
    pub peer: Option<IpAddr>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub ops: Vec<RouteOp>,
    pub conflicts: Vec<Conflict>,
}

/// The metric the kernel gives our routes (we set none): 0 for IPv4, `IP6_RT_PRIO_USER` for IPv6.
pub fn our_metric(destination: &IpNet) -> u32 {
    match destination {
        IpNet::V4(_) => 0,
        IpNet::V6(_) => 1024,
    }
}

/// What to write so that our routes in the kernel become `desired`, without ever touching
/// another route: a desired destination that another route claims (one the kernel would prefer
/// to ours or rank equal with it; a route behind ours by metric is a fallback, not a claim) is
/// a conflict (and if we
/// had installed ours before that route appeared, ours is withdrawn in its favour). Without
/// `allow_deletes` (before the routing state is known to be complete, e.g. during BGP
/// graceful restart) only additions and changes are made.
pub fn reconcile(table: &KernelTable, desired: &DesiredSet, allow_deletes: bool) -> Plan {
    let mut plan = Plan::default();
    for (destination, want) in desired {
        if let Some(foreign) = table.foreign.get(destination).filter(|f| f.metric <= our_metric(destination)) {
            plan.conflicts.push(Conflict { destination: *destination, foreign: foreign.clone(), peer: want.peer });
            if let Some(ours) = table.ours.get(destination) {
                plan.ops.push(RouteOp::Delete(*destination, ours.clone()));
            }
            continue;
        }
        match table.ours.get(destination) {
            None => plan.ops.push(RouteOp::Create(*destination, want.route.clone())),
            Some(ours) if *ours != want.route => plan.ops.push(RouteOp::Replace(*destination, want.route.clone())),
            Some(_) => {}
        }
    }
    if allow_deletes {
        plan.ops.extend(
            table
                .ours
                .iter()
                .filter(|(destination, _)| !desired.contains_key(*destination))
                .map(|(destination, route)| RouteOp::Delete(*destination, route.clone())),
        );
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    fn gw(s: &str) -> KernelRoute {
        Gateways::One(s.parse().unwrap()).into()
    }

    fn ours(routes: &[(&str, &str)]) -> KernelTable {
        KernelTable { ours: routes.iter().map(|(d, g)| (net(d), gw(g))).collect(), foreign: BTreeMap::new() }
    }

    fn desired(routes: &[(&str, &str)]) -> DesiredSet {
        routes.iter().map(|(d, g)| (net(d), Desired { route: gw(g), peer: None })).collect()
    }

    fn foreign(protocol: u8, gateway: Option<&str>) -> ForeignRoute {
        ForeignRoute {
            protocol,
            kind: ForeignRoute::UNICAST,
            gateway: gateway.map(|g| g.parse().unwrap()),
            oif: Some(2),
            metric: 0,
            linkdown: false,
        }
    }

    #[test]
    fn only_differences_are_written() {
        let installed =
            ours(&[("10.1.0.0/24", "192.0.2.1"), ("10.2.0.0/24", "192.0.2.2"), ("10.3.0.0/24", "192.0.2.3")]);
        let want = desired(&[("10.1.0.0/24", "192.0.2.1"), ("10.2.0.0/24", "192.0.2.9"), ("10.4.0.0/24", "192.0.2.4")]);
        assert_eq!(
            reconcile(&installed, &want, true).ops,
            vec![
                RouteOp::Replace(net("10.2.0.0/24"), gw("192.0.2.9")),
                RouteOp::Create(net("10.4.0.0/24"), gw("192.0.2.4")),
                RouteOp::Delete(net("10.3.0.0/24"), gw("192.0.2.3")),
            ]
        );
        let same = ours(&[("10.1.0.0/24", "192.0.2.1")]);
        assert_eq!(reconcile(&same, &desired(&[("10.1.0.0/24", "192.0.2.1")]), true), Plan::default());
    }

    #[test]
    fn nothing_is_deleted_until_deletes_are_allowed() {
        let installed = ours(&[("10.1.0.0/24", "192.0.2.1"), ("fd00:1::/64", "fd00::1")]);
        assert!(reconcile(&installed, &DesiredSet::new(), false).ops.is_empty());
        assert_eq!(reconcile(&installed, &DesiredSet::new(), true).ops.len(), 2);
    }

    #[test]
    fn a_destination_someone_else_routes_is_a_conflict_never_a_write() {
        let mut table = ours(&[]);
        table.foreign.insert(net("0.0.0.0/0"), foreign(4, Some("192.0.2.254")));
        table.foreign.insert(net("10.77.0.0/24"), foreign(2, None));
        let want = desired(&[("0.0.0.0/0", "10.77.0.2"), ("10.77.0.0/24", "10.77.0.2"), ("10.9.0.0/16", "10.77.0.2")]);
        let plan = reconcile(&table, &want, true);
        assert_eq!(plan.ops, vec![RouteOp::Create(net("10.9.0.0/16"), gw("10.77.0.2"))]);
        let conflicting: Vec<IpNet> = plan.conflicts.iter().map(|c| c.destination).collect();
        assert_eq!(conflicting, vec![net("0.0.0.0/0"), net("10.77.0.0/24")]);
        assert_eq!(plan.conflicts[0].foreign.describe(), "static route via 192.0.2.254");
    }

    #[test]
    fn our_route_steps_back_when_another_route_appears_for_its_destination() {
        let mut table = ours(&[("0.0.0.0/0", "10.77.0.2")]);
        table.foreign.insert(net("0.0.0.0/0"), foreign(16, Some("192.0.2.254")));
        let plan = reconcile(&table, &desired(&[("0.0.0.0/0", "10.77.0.2")]), false);
        assert_eq!(plan.ops, vec![RouteOp::Delete(net("0.0.0.0/0"), gw("10.77.0.2"))]);
        assert_eq!(plan.conflicts.len(), 1);
    }

    #[test]
    fn a_route_behind_ours_by_metric_is_a_fallback_not_a_claim() {
        let behind = |protocol, metric| ForeignRoute { metric, ..foreign(protocol, Some("192.0.2.254")) };
        // Upstream's leftover at metric 10 beside our installed route: ours stays.
        let mut table = ours(&[("10.244.2.0/24", "10.100.0.2")]);
        table.foreign.insert(net("10.244.2.0/24"), behind(17, 10));
        // A DHCP default at metric 100 (a fallback) and IPv6 routes around our metric 1024.
        table.foreign.insert(net("0.0.0.0/0"), behind(16, 100));
        table.foreign.insert(net("fd00:1::/64"), behind(4, 1024));
        table.foreign.insert(net("fd00:2::/64"), behind(4, 1025));
        let want = desired(&[
            ("10.244.2.0/24", "10.100.0.2"),
            ("0.0.0.0/0", "10.77.0.2"),
            ("fd00:1::/64", "fd00::1"),
            ("fd00:2::/64", "fd00::1"),
        ]);
        let plan = reconcile(&table, &want, true);
        assert_eq!(
            plan.ops,
            vec![
                RouteOp::Create(net("0.0.0.0/0"), gw("10.77.0.2")),
                RouteOp::Create(net("fd00:2::/64"), gw("fd00::1")),
            ]
        );
        let conflicting: Vec<IpNet> = plan.conflicts.iter().map(|c| c.destination).collect();
        assert_eq!(conflicting, vec![net("fd00:1::/64")]);
    }

    #[test]
    fn multipath_gateways_are_normalised() {
        let a: IpAddr = "192.0.2.2".parse().unwrap();
        let b: IpAddr = "192.0.2.1".parse().unwrap();
        assert_eq!(Gateways::new(vec![a, b, a]), Gateways::new(vec![b, a]));
        assert_eq!(Gateways::new(vec![a]), Some(Gateways::One(a)));
        assert_eq!(Gateways::new(vec![]), None);
        assert_eq!(Gateways::new(vec![a, b]).unwrap().to_string(), "192.0.2.1,192.0.2.2");
    }
}
