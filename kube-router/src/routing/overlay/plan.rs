//! What the overlay maps should hold, and the writes that get them there (pure).
use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
};

use ipnet::Ipv4Net;
use kube_router_common::{OverlayTunnelV4, OVERLAY_ENCAP_FOU, OVERLAY_ENCAP_IPIP};

use super::Encap;

/// The contents of `ovl_routes_v4` and `ovl_remotes_v4`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OverlayMapsState {
    /// Tunnelled pod CIDRs: inner destination -> tunnel.
    pub routes: BTreeMap<Ipv4Net, OverlayTunnelV4>,
    /// Nodes whose tunnelled packets we take, by their (outer source) address.
    pub remotes: BTreeMap<Ipv4Addr, OverlayTunnelV4>,
}

/// Everything the overlay needs in the datapath.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OverlayTarget {
    pub maps: OverlayMapsState,
    /// Interfaces towards tunnel endpoints: the programs are attached there.
    pub interfaces: BTreeSet<String>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MapOp {
    PutRoute(Ipv4Net, OverlayTunnelV4),
    DeleteRoute(Ipv4Net),
    PutRemote(Ipv4Addr, OverlayTunnelV4),
    DeleteRemote(Ipv4Addr),
}

impl MapOp {
    /// The map this op writes and its `op` label in `kube_router_map_writes_total`: a put is an
    /// `insert` or an `update` by whether `installed` has the key.
    pub fn labels(&self, installed: &OverlayMapsState) -> (&'static str, &'static str) {
        use kube_router_common::map_names::{OVERLAY_REMOTES, OVERLAY_ROUTES};
        let put = |present: bool| if present { "update" } else { "insert" };
        match self {
            MapOp::PutRoute(net, _) => (OVERLAY_ROUTES, put(installed.routes.contains_key(net))),
            MapOp::DeleteRoute(_) => (OVERLAY_ROUTES, "delete"),
            MapOp::PutRemote(remote, _) => (OVERLAY_REMOTES, put(installed.remotes.contains_key(remote))),
            MapOp::DeleteRemote(_) => (OVERLAY_REMOTES, "delete"),
        }
    }
}

/// Bytes the encapsulation adds (outer IPv4; for FOU also UDP and GUE).
pub const fn overhead(encap: Encap) -> u32 {
    match encap {
        Encap::Ipip => 20,
        Encap::Fou { .. } => 32,
    }
}

pub fn tunnel(remote: Ipv4Addr, local: Ipv4Addr, encap: Encap) -> OverlayTunnelV4 {
    let (kind, port) = match encap {
        Encap::Ipip => (OVERLAY_ENCAP_IPIP, 0),
        Encap::Fou { port } => (OVERLAY_ENCAP_FOU, port),
    };
    OverlayTunnelV4 {
        remote: u32::from_ne_bytes(remote.octets()),
        local: u32::from_ne_bytes(local.octets()),
        encap: kind,
        pad: 0,
        port: port.to_be(),
    }
}

/// The writes that turn `installed` into `desired`: (before the kernel routes change, after).
/// An entry a new route needs goes in first, so that no packet ever takes the route without
/// its tunnel; an entry no route needs any more goes last.
pub fn diff(installed: &OverlayMapsState, desired: &OverlayMapsState) -> (Vec<MapOp>, Vec<MapOp>) {
    let mut before = Vec::new();
    let mut after = Vec::new();
    for (net, tunnel) in &desired.routes {
        if installed.routes.get(net) != Some(tunnel) {
            before.push(MapOp::PutRoute(*net, *tunnel));
        }
    }
    for (remote, tunnel) in &desired.remotes {
        if installed.remotes.get(remote) != Some(tunnel) {
            before.push(MapOp::PutRemote(*remote, *tunnel));
        }
    }
    after.extend(installed.routes.keys().filter(|n| !desired.routes.contains_key(*n)).map(|n| MapOp::DeleteRoute(*n)));
    after.extend(
        installed.remotes.keys().filter(|r| !desired.remotes.contains_key(*r)).map(|r| MapOp::DeleteRemote(*r)),
    );
    (before, after)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4(s: &str) -> Ipv4Addr {
        s.parse().unwrap()
    }

    #[test]
    fn entries_go_in_before_the_routes_and_out_after_them() {
        let local = v4("10.80.0.1");
        let a = tunnel(v4("10.81.0.2"), local, Encap::Ipip);
        let b = tunnel(v4("10.81.0.3"), local, Encap::Fou { port: 5555 });
        let installed = OverlayMapsState {
            routes: [("10.244.2.0/24".parse().unwrap(), a), ("10.244.9.0/24".parse().unwrap(), a)].into(),
            remotes: [(v4("10.81.0.2"), a)].into(),
        };
        let desired = OverlayMapsState {
            routes: [("10.244.2.0/24".parse().unwrap(), a), ("10.244.3.0/24".parse().unwrap(), b)].into(),
            remotes: [(v4("10.81.0.3"), b)].into(),
        };
        let (before, after) = diff(&installed, &desired);
        assert_eq!(
            before,
            vec![MapOp::PutRoute("10.244.3.0/24".parse().unwrap(), b), MapOp::PutRemote(v4("10.81.0.3"), b)]
        );
        assert_eq!(
            after,
            vec![MapOp::DeleteRoute("10.244.9.0/24".parse().unwrap()), MapOp::DeleteRemote(v4("10.81.0.2"))]
        );
        assert_eq!(diff(&desired, &desired), (vec![], vec![]), "nothing to write when nothing changed");
        // Byte order as in packets.
        assert_eq!(b.port.to_ne_bytes(), [0x15, 0xb3]);
        assert_eq!(a.remote.to_ne_bytes(), [10, 81, 0, 2]);
        assert_eq!((overhead(Encap::Ipip), overhead(Encap::Fou { port: 1 })), (20, 32));
    }

    #[test]
    fn each_write_is_labelled_with_its_map_and_whether_the_key_was_there() {
        let local = v4("10.80.0.1");
        let a = tunnel(v4("10.81.0.2"), local, Encap::Ipip);
        let net = "10.244.2.0/24".parse().unwrap();
        let installed = OverlayMapsState { routes: [(net, a)].into(), remotes: [(v4("10.81.0.2"), a)].into() };
        let empty = OverlayMapsState::default();
        assert_eq!(MapOp::PutRoute(net, a).labels(&installed), ("ovl_routes_v4", "update"));
        assert_eq!(MapOp::PutRoute(net, a).labels(&empty), ("ovl_routes_v4", "insert"));
        assert_eq!(MapOp::DeleteRoute(net).labels(&installed), ("ovl_routes_v4", "delete"));
        assert_eq!(MapOp::PutRemote(v4("10.81.0.2"), a).labels(&installed), ("ovl_remotes_v4", "update"));
        assert_eq!(MapOp::PutRemote(v4("10.81.0.9"), a).labels(&installed), ("ovl_remotes_v4", "insert"));
        assert_eq!(MapOp::DeleteRemote(v4("10.81.0.2")).labels(&empty), ("ovl_remotes_v4", "delete"));
    }
}
