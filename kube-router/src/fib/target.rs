//! Which learned paths become kernel routes, and which of them go through an overlay tunnel
//! (pure). The BGP speaker describes its Loc-RIB in these terms; this module owns the
//! resolution against the kernel's view and the overlay planning, so `bgp` needs neither.
use std::{
    net::{IpAddr, Ipv4Addr},
    sync::Arc,
};

use ipnet::IpNet;

use super::{resolve::Reachability, task::FibTarget, Desired, DesiredSet, Gateways, KernelRoute};
use crate::overlay::{
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
