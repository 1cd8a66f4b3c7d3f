//! Next-hop resolution (RFC 4271 §9.1.2.1) against the kernel's own routes: a BGP next hop is
//! usable only if the node can reach it without BGP. On a connected subnet it is the kernel
//! gateway itself; behind a non-default route (a static route to a peer's loopback, say) the
//! kernel gateway is that route's gateway (one level, as zebra does). Default routes do not
//! resolve BGP next hops (a ToR's default would make every next hop look reachable); they do
//! carry the overlay's tunnel packets, which is what [`Reachability::resolve_underlay`] is for.
//! Our own routes never take part: a BGP route cannot resolve another one.
use std::{
    cell::RefCell,
    collections::{BTreeMap, HashMap},
    net::IpAddr,
};

use ipnet::IpNet;

use super::{ForeignRoute, KernelTable, LocalAddresses};

/// A network interface of the node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    pub name: String,
    pub mtu: u32,
}

/// The node's interfaces by index.
pub type Links = BTreeMap<u32, Link>;

#[derive(Debug, Clone, Default)]
pub struct Reachability {
    /// Foreign unicast routes, most specific first.
    routes: Vec<(IpNet, ForeignRoute)>,
    local: LocalAddresses,
    links: Links,
    cache: RefCell<HashMap<(IpAddr, bool), Option<IpAddr>>>,
}

impl PartialEq for Reachability {
    fn eq(&self, other: &Self) -> bool {
        self.routes == other.routes && self.local == other.local && self.links == other.links
    }
}

impl Eq for Reachability {}

impl Reachability {
    pub fn new(table: &KernelTable, local: &LocalAddresses) -> Self {
        let mut routes: Vec<(IpNet, ForeignRoute)> = table
            .foreign
            .iter()
            .filter(|(_, route)| route.kind == ForeignRoute::UNICAST)
            .map(|(net, route)| (*net, route.clone()))
            .collect();
        routes.sort_by_key(|(net, _)| std::cmp::Reverse(net.prefix_len()));
        Self { routes, local: local.clone(), links: Links::new(), cache: RefCell::default() }
    }

    pub fn with_links(mut self, links: Links) -> Self {
        self.links = links;
        self
    }

    /// The interface a directly reachable address (a kernel gateway) is reached through.
    pub fn link_towards(&self, gateway: IpAddr) -> Option<&Link> {
        let (_, route) = self.routes.iter().find(|(net, r)| r.is_connected() && net.contains(&gateway))?;
        self.links.get(&route.oif?)
    }

    pub fn local_addresses(&self) -> &LocalAddresses {
        &self.local
    }

    pub fn is_local(&self, addr: IpAddr) -> bool {
        self.local.contains(&addr)
    }

    /// Prefixes of the node's connected subnets (link routes).
    pub fn connected(&self) -> impl Iterator<Item = &IpNet> {
        self.routes.iter().filter(|(_, r)| r.is_connected()).map(|(net, _)| net)
    }

    /// On one of the node's connected subnets (directly reachable at layer 2).
    pub fn on_link(&self, addr: IpAddr) -> bool {
        self.connected().any(|net| net.contains(&addr))
    }

    /// The kernel gateway for a BGP next hop, or None if it is unresolvable.
    pub fn resolve(&self, next_hop: IpAddr) -> Option<IpAddr> {
        self.cached(next_hop, false)
    }

    /// The kernel gateway towards a tunnel endpoint: like [`Self::resolve`], but a default
    /// route counts (tunnel packets go wherever the node's own traffic to that address goes).
    pub fn resolve_underlay(&self, remote: IpAddr) -> Option<IpAddr> {
        self.cached(remote, true)
    }

    fn cached(&self, addr: IpAddr, default_ok: bool) -> Option<IpAddr> {
        if let Some(hit) = self.cache.borrow().get(&(addr, default_ok)) {
            return *hit;
        }
        let resolved = self.lookup(addr, default_ok);
        self.cache.borrow_mut().insert((addr, default_ok), resolved);
        resolved
    }

    fn lookup(&self, addr: IpAddr, default_ok: bool) -> Option<IpAddr> {
        if self.is_local(addr) || addr.is_unspecified() {
            return None;
        }
        let (_, route) = self
            .routes
            .iter()
            .filter(|(net, _)| default_ok || net.prefix_len() > 0)
            .find(|(net, _)| net.contains(&addr))?;
        match route.gateway {
            None if route.is_connected() => Some(addr),
            None => None,
            Some(gateway) if gateway.is_ipv4() == addr.is_ipv4() && self.on_link(gateway) => Some(gateway),
            Some(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(routes: &[(&str, Option<&str>)]) -> KernelTable {
        let mut table = KernelTable::default();
        for (net, gateway) in routes {
            table.foreign.insert(
                net.parse().unwrap(),
                ForeignRoute {
                    protocol: if gateway.is_some() { 4 } else { 2 },
                    kind: ForeignRoute::UNICAST,
                    gateway: gateway.map(|g| g.parse().unwrap()),
                    oif: Some(2),
                    metric: 0,
                    linkdown: false,
                },
            );
        }
        table
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn connected_next_hops_resolve_to_themselves_and_static_routes_one_level() {
        let t = table(&[
            ("10.77.0.0/24", None),
            ("192.0.2.0/24", Some("10.77.0.254")),
            ("198.51.100.0/24", Some("203.0.113.1")), // gateway not on a link: unusable
            ("0.0.0.0/0", Some("10.77.0.254")),
        ]);
        let local = [ip("10.77.0.1")].into_iter().collect();
        let r = Reachability::new(&t, &local);
        assert_eq!(r.resolve(ip("10.77.0.2")), Some(ip("10.77.0.2")));
        assert_eq!(r.resolve(ip("192.0.2.9")), Some(ip("10.77.0.254")));
        assert_eq!(r.resolve(ip("198.51.100.9")), None);
        assert_eq!(r.resolve(ip("10.99.0.1")), None, "the default route does not resolve BGP next hops");
        assert_eq!(r.resolve_underlay(ip("10.99.0.1")), Some(ip("10.77.0.254")));
        assert_eq!(r.resolve(ip("10.77.0.1")), None, "our own address is no next hop");
        assert!(r.on_link(ip("10.77.0.200")) && !r.on_link(ip("192.0.2.9")));
        assert_eq!(r.connected().count(), 1);
    }

    #[test]
    fn the_most_specific_route_wins() {
        let t = table(&[("10.0.0.0/8", Some("10.77.0.254")), ("10.77.0.0/24", None)]);
        let r = Reachability::new(&t, &LocalAddresses::new());
        assert_eq!(r.resolve(ip("10.77.0.5")), Some(ip("10.77.0.5")));
        assert_eq!(r.resolve(ip("10.1.0.5")), Some(ip("10.77.0.254")));
    }
}
