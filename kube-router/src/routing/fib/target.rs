//! Which learned paths become kernel routes, and which of them go through an overlay tunnel
//! (pure). The BGP speaker describes its Loc-RIB in these terms; this module owns the
//! resolution against the kernel's view and the overlay planning, so `bgp` needs neither.
use std::{
    net::{IpAddr, Ipv4Addr},
    sync::Arc,
};

use ipnet::IpNet;

use super::{resolve::Reachability, task::FibTarget, Desired, DesiredSet, Gateways, KernelRoute};
use crate::routing::overlay::{
    plan::{overhead, tunnel, OverlayTarget},
    OverlayConfig,
};

/// One way to a learned destination: the peer it came from and that path's next hop.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathHop {
    pub peer: IpAddr,
    pub next_hop: IpAddr,
    /// Learned from another node of the cluster (only those paths may be tunnelled).
    pub from_node: bool,
    /// Our address towards `peer`, the local end of a tunnel to it.
    pub tunnel_local: Ipv4Addr,
}

/// A Loc-RIB best path learned from a peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Learned {
    pub destination: IpNet,
    pub best: PathHop,
    /// Per further equal-cost next hop, every peer that sent a path with it.
    pub multipath: Vec<Vec<PathHop>>,
}

/// A node peer whose tunnelled packets we may receive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodePeer {
    pub address: Ipv4Addr,
    pub tunnel_local: Ipv4Addr,
}

struct PathTunnel {
    tunnel: kube_router_common::OverlayTunnelV4,
    interface: Option<String>,
    mtu: Option<u32>,
}

struct KernelPath {
    gateway: IpAddr,
    tunnel: Option<PathTunnel>,
}

/// The kernel's view (None until the FIB task first reported it) and the overlay, if enabled.
pub struct Planner<'a> {
    pub reach: Option<&'a Reachability>,
    pub overlay: Option<&'a OverlayConfig>,
}

impl Planner<'_> {
    /// The routes and tunnels for `learned`, and the tunnels `node_peers` may reach us by.
    pub fn plan(
        &self,
        learned: impl IntoIterator<Item = Learned>,
        node_peers: impl IntoIterator<Item = NodePeer>,
        allow_deletes: bool,
    ) -> FibTarget {
        let mut routes = DesiredSet::new();
        let mut overlay = OverlayTarget::default();
        for route in learned {
            let net = route.destination;
            let peer = route.best.peer;
            let Some(path) = self.kernel_path(&route.best) else { continue };
            if let (Some(t), IpNet::V4(v4)) = (path.tunnel, net) {
                overlay.maps.routes.insert(v4, t.tunnel);
                overlay.interfaces.extend(t.interface);
                let route = KernelRoute { gateways: Gateways::One(path.gateway), mtu: t.mtu };
                routes.insert(net, Desired { route, peer: Some(peer) });
                continue;
            }
            let mut gateways = vec![path.gateway];
            // Equal-cost paths become one multipath route, when each resolves on its own (a
            // tunnelled path is never part of one: the tunnel is chosen per destination).
            for hops in &route.multipath {
                let gateway = hops
                    .iter()
                    .filter_map(|hop| self.kernel_path(hop))
                    .find(|path| path.tunnel.is_none())
                    .map(|path| path.gateway);
                gateways.extend(gateway);
            }
            if let Some(gateways) = Gateways::new(gateways) {
                routes.insert(net, Desired { route: KernelRoute { gateways, mtu: None }, peer: Some(peer) });
            }
        }
        self.overlay_remotes(node_peers, &mut overlay);
        FibTarget { routes: Arc::new(routes), overlay: Arc::new(overlay), allow_deletes }
    }

    /// How a path goes into the kernel (None: not installable): its gateway, and through the
    /// overlay its tunnel, the interface towards the tunnel's other end and the path MTU left
    /// inside the tunnel.
    fn kernel_path(&self, hop: &PathHop) -> Option<KernelPath> {
        let next_hop = hop.next_hop;
        let Some(reach) = self.reach else {
            return Some(KernelPath { gateway: next_hop, tunnel: None });
        };
        match (self.overlay, next_hop) {
            (Some(overlay), IpAddr::V4(remote))
                if overlay.tunnels(hop.from_node, next_hop, || reach.on_link(next_hop)) =>
            {
                let gateway = reach.resolve_underlay(next_hop)?;
                let link = reach.link_towards(gateway);
                Some(KernelPath {
                    gateway,
                    tunnel: Some(PathTunnel {
                        tunnel: tunnel(remote, hop.tunnel_local, overlay.encap),
                        interface: link.map(|l| l.name.clone()),
                        mtu: link.map(|l| l.mtu.saturating_sub(overhead(overlay.encap))),
                    }),
                })
            }
            _ => Some(KernelPath { gateway: reach.resolve(next_hop)?, tunnel: None }),
        }
    }

    /// The tunnels node peers may send us packets through (they see us on another subnet, as
    /// we see them, or every node with `--overlay-type=full`).
    fn overlay_remotes(&self, node_peers: impl IntoIterator<Item = NodePeer>, target: &mut OverlayTarget) {
        let (Some(overlay), Some(reach)) = (self.overlay, self.reach) else { return };
        for peer in node_peers {
            let address = IpAddr::V4(peer.address);
            if !overlay.tunnels(true, address, || reach.on_link(address)) {
                continue;
            }
            target.maps.remotes.insert(peer.address, tunnel(peer.address, peer.tunnel_local, overlay.encap));
            if let Some(link) = reach.resolve_underlay(address).and_then(|g| reach.link_towards(g)) {
                target.interfaces.insert(link.name.clone());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::{
        routing::fib::{resolve::Link, ForeignRoute, KernelTable},
        routing::overlay::{Encap, OverlayType},
    };

    const LOCAL: Ipv4Addr = Ipv4Addr::new(172, 16, 0, 100);

    fn addr(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    /// This node: 172.16.0.100 on 172.16.0.0/24 (eth0, MTU 1500), a default route via
    /// 172.16.0.1.
    fn reach() -> Reachability {
        let mut table = KernelTable::default();
        let route = |protocol, gateway| ForeignRoute {
            protocol,
            kind: ForeignRoute::UNICAST,
            gateway,
            oif: Some(2),
            metric: 0,
            linkdown: false,
        };
        table.foreign.insert("172.16.0.0/24".parse().unwrap(), route(2, None));
        table.foreign.insert("0.0.0.0/0".parse().unwrap(), route(4, Some(addr("172.16.0.1"))));
        let links = BTreeMap::from([(2, Link { name: "eth0".into(), mtu: 1500 })]);
        Reachability::new(&table, &[IpAddr::V4(LOCAL)].into()).with_links(links)
    }

    fn hop(peer: &str, from_node: bool) -> PathHop {
        PathHop { peer: addr(peer), next_hop: addr(peer), from_node, tunnel_local: LOCAL }
    }

    fn learned(destination: &str, best: PathHop, multipath: Vec<Vec<PathHop>>) -> Learned {
        Learned { destination: destination.parse().unwrap(), best, multipath }
    }

    fn node(address: &str) -> NodePeer {
        NodePeer { address: address.parse().unwrap(), tunnel_local: LOCAL }
    }

    #[test]
    fn off_subnet_node_paths_are_tunnelled_the_rest_resolve_through_the_kernel() {
        let reach = reach();
        let overlay = OverlayConfig { overlay_type: OverlayType::Subnet, encap: Encap::Ipip };
        let planner = Planner { reach: Some(&reach), overlay: Some(&overlay) };
        let routes = [
            // A node on another subnet: through the tunnel, towards the default gateway.
            learned("10.244.2.0/24", hop("10.1.0.5", true), vec![]),
            // A node on our subnet: directly.
            learned("10.244.3.0/24", hop("172.16.0.7", true), vec![]),
            // An external peer's path that only the default route would reach: not installed.
            learned("192.168.50.0/24", hop("10.9.9.9", false), vec![]),
            // Equal-cost paths: a candidate that would be tunnelled is no multipath member.
            learned(
                "198.51.100.0/24",
                hop("172.16.0.8", false),
                vec![vec![hop("10.1.0.5", true), hop("172.16.0.9", false)]],
            ),
        ];
        let target = planner.plan(routes, [node("10.1.0.5"), node("172.16.0.7")], true);

        let tunnelled = &target.routes[&"10.244.2.0/24".parse().unwrap()];
        assert_eq!(tunnelled.route, KernelRoute { gateways: Gateways::One(addr("172.16.0.1")), mtu: Some(1480) });
        assert_eq!(tunnelled.peer, Some(addr("10.1.0.5")));
        let tunnel_to_node = tunnel(Ipv4Addr::new(10, 1, 0, 5), LOCAL, Encap::Ipip);
        assert_eq!(target.overlay.maps.routes, BTreeMap::from([("10.244.2.0/24".parse().unwrap(), tunnel_to_node)]));
        assert_eq!(target.overlay.maps.remotes, BTreeMap::from([(Ipv4Addr::new(10, 1, 0, 5), tunnel_to_node)]));
        assert_eq!(target.overlay.interfaces.iter().collect::<Vec<_>>(), ["eth0"]);

        let direct = &target.routes[&"10.244.3.0/24".parse().unwrap()];
        assert_eq!(direct.route, KernelRoute { gateways: Gateways::One(addr("172.16.0.7")), mtu: None });
        assert!(!target.routes.contains_key(&"192.168.50.0/24".parse().unwrap()));
        let multipath = &target.routes[&"198.51.100.0/24".parse().unwrap()];
        assert_eq!(multipath.route.gateways.as_slice(), [addr("172.16.0.8"), addr("172.16.0.9")]);
        assert!(target.allow_deletes);
    }

    #[test]
    fn before_the_kernel_is_read_next_hops_are_the_gateways_and_nothing_is_tunnelled() {
        let overlay = OverlayConfig { overlay_type: OverlayType::Full, encap: Encap::Ipip };
        let planner = Planner { reach: None, overlay: Some(&overlay) };
        let target = planner.plan([learned("10.244.2.0/24", hop("10.1.0.5", true), vec![])], [node("10.1.0.5")], false);
        let route = &target.routes[&"10.244.2.0/24".parse().unwrap()].route;
        assert_eq!(route.gateways, Gateways::One(addr("10.1.0.5")));
        assert_eq!(*target.overlay, OverlayTarget::default());
        assert!(!target.allow_deletes);
    }
}
