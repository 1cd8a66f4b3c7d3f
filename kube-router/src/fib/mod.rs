//! The kernel routing table as far as kube-router owns it: routes tagged with our routing
//! protocol number. Reconciling writes only real differences (a route that is already right is
//! never deleted and re-added, so forwarding never flaps) and never touches other protocols'
//! routes.
pub mod netlink;

use std::{collections::BTreeMap, net::IpAddr};

use ipnet::IpNet;

/// Routing protocol number on our routes (`ip route show proto 186`). 186 is "bgp" in
/// iproute2's rt_protos; configurable because FRR's zebra uses it too.
pub const DEFAULT_ROUTE_PROTOCOL: u8 = 186;

/// destination -> gateway, for one routing table and our protocol.
pub type RouteSet = BTreeMap<IpNet, IpAddr>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouteOp {
    /// Add, or atomically replace (NLM_F_REPLACE) a route with another gateway.
    Replace(IpNet, IpAddr),
    Delete(IpNet),
}

/// What to write so that our routes in the kernel become `desired`. Without `allow_deletes`
/// (before the routing state is known to be complete, e.g. during BGP graceful restart) only
/// additions and changes are made.
pub fn reconcile(installed: &RouteSet, desired: &RouteSet, allow_deletes: bool) -> Vec<RouteOp> {
    let mut ops: Vec<RouteOp> = desired
        .iter()
        .filter(|(destination, gateway)| installed.get(*destination) != Some(*gateway))
        .map(|(destination, gateway)| RouteOp::Replace(*destination, *gateway))
        .collect();
    if allow_deletes {
        ops.extend(installed.keys().filter(|d| !desired.contains_key(*d)).map(|d| RouteOp::Delete(*d)));
    }
    ops
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(routes: &[(&str, &str)]) -> RouteSet {
        routes.iter().map(|(d, g)| (d.parse().unwrap(), g.parse().unwrap())).collect()
    }

    #[test]
    fn only_differences_are_written() {
        let installed =
            set(&[("10.1.0.0/24", "192.0.2.1"), ("10.2.0.0/24", "192.0.2.2"), ("10.3.0.0/24", "192.0.2.3")]);
        let desired = set(&[("10.1.0.0/24", "192.0.2.1"), ("10.2.0.0/24", "192.0.2.9"), ("10.4.0.0/24", "192.0.2.4")]);
        assert_eq!(
            reconcile(&installed, &desired, true),
            vec![
                RouteOp::Replace("10.2.0.0/24".parse().unwrap(), "192.0.2.9".parse().unwrap()),
                RouteOp::Replace("10.4.0.0/24".parse().unwrap(), "192.0.2.4".parse().unwrap()),
                RouteOp::Delete("10.3.0.0/24".parse().unwrap()),
            ]
        );
        assert!(reconcile(&desired, &desired, true).is_empty());
    }

    #[test]
    fn nothing_is_deleted_until_deletes_are_allowed() {
        let installed = set(&[("10.1.0.0/24", "192.0.2.1"), ("fd00:1::/64", "fd00::1")]);
        assert!(reconcile(&installed, &RouteSet::new(), false).is_empty());
        assert_eq!(reconcile(&installed, &RouteSet::new(), true).len(), 2);
    }
}
