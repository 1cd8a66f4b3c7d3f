//! The pod overlay between nodes (kube-router's `--enable-overlay`, `--overlay-type`,
//! `--overlay-encap`): a route learned from a node peer whose next hop is on another subnet
//! (or every node route, with `--overlay-type=full`) carries pod traffic inside an IPIP (or
//! FOU/GUE) packet to that node, so the underlay routers only ever see node addresses.
//!
//! Encapsulation is done by the datapath (`kr_ovl_encap` at TC egress of the interface
//! towards the tunnel endpoint, `kr_ovl_decap` at TC ingress), not by kernel tunnel
//! devices: the packets on the wire are the kernel's own IPIP / GUE format, so a node running
//! kube-router's Go implementation with `tun-*` devices interoperates, but no `ipip`/`fou`
//! module is needed. The kernel route to a tunnelled pod CIDR points at the underlay next hop
//! towards the remote node (with the path MTU left inside the tunnel); `ovl_routes_v4` tells
//! the egress program which node to encapsulate for, `ovl_remotes_v4` which nodes' packets the
//! ingress program takes. IPv4 only.
pub mod maps;
pub mod plan;
use std::net::IpAddr;

/// `--overlay-type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OverlayType {
    /// Tunnel only to nodes that are not on one of this node's subnets (the default).
    Subnet,
    /// Tunnel to every node.
    Full,
}

/// `--overlay-encap` (and `--overlay-encap-port` for FOU).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encap {
    Ipip,
    /// IPIP inside UDP with a GUE header (the kernel's `fou ... gue` encapsulation).
    Fou {
        port: u16,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OverlayConfig {
    pub overlay_type: OverlayType,
    pub encap: Encap,
}

impl OverlayConfig {
    /// Whether a route with `next_hop` goes through a tunnel; only routes from node peers
    /// (`from_node_peer`) ever do. Flags rather than BGP's peer role and the kernel's view
    /// (`on_link`: is `next_hop` on one of this node's subnets, asked only when it matters),
    /// so this module imports neither `bgp` nor `fib` (which import it).
    pub fn tunnels(&self, from_node_peer: bool, next_hop: IpAddr, on_link: impl FnOnce() -> bool) -> bool {
        from_node_peer
            && next_hop.is_ipv4()
            && match self.overlay_type {
                OverlayType::Full => true,
                OverlayType::Subnet => !on_link(),
            }
    }
}
