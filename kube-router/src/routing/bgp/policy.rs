//! Import and export policy, as kube-router applies it to a node on a production fabric.
//!
//! **Import** (every UPDATE, per prefix): refused are martian prefixes (0/8, 127/8,
//! 169.254/16, 224/4, 240/4; ::, ::1, ::ffff:0:0/96, fe80::/10, ff00::/8), default routes
//! unless accepted for that peer (`--bgp-accept-default` or the peer's `acceptdefault`),
//! prefixes equal to or inside one of the node's connected subnets or equal to one of its
//! addresses (a peer must never take the node's own link away), the Service VIPs this cluster
//! advertises (every node originates those itself, as kube-router's import policy rejects
//! them), the node's `kube-router.io/node.bgp.customimportreject` prefixes (and anything
//! inside them), and paths whose next hop is martian, link-local or one of our own addresses.
//! Refused paths stay in the Adj-RIB-In (RFC 4271's is pre-policy) so that a policy change
//! re-evaluates them without a route refresh; they never reach the Loc-RIB, the kernel or
//! another peer.
//!
//! **Export** (kube-router's `kube_router_export`): node peers (the iBGP mesh, route
//! reflection) get this node's pod CIDRs and, by RFC 4456 reflection only, routes learned
//! from other node peers; external peers get only what this node originates: its pod CIDRs
//! (with `--advertise-pod-cidr`) and its Service VIPs, with the node's communities and AS-path
//! prepend, and with `--override-nexthop` the session's own address as next hop. Routes
//! learned from external peers go nowhere: the node is never a transit AS.
use std::{
    collections::BTreeSet,
    fmt,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use ipnet::IpNet;

use super::message::{NextHop, Prefix};
use crate::routing::fib::resolve::Reachability;

/// Which side of the cluster boundary a peer is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum PeerRole {
    /// Another node of the cluster (mesh, same-ASN rack, route reflection).
    #[default]
    Node,
    /// A router outside the cluster (flags or node annotations).
    External,
}

/// What a locally originated prefix is, which decides who may receive it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OriginKind {
    PodCidr,
    ServiceVip,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Rejection {
    MartianPrefix,
    DefaultRoute,
    NodeLocal,
    ServiceVip,
    CustomReject,
    MartianNextHop,
    OwnNextHop,
}

impl Rejection {
    pub const ALL: [Rejection; 7] = [
        Rejection::MartianPrefix,
        Rejection::DefaultRoute,
        Rejection::NodeLocal,
        Rejection::ServiceVip,
        Rejection::CustomReject,
        Rejection::MartianNextHop,
        Rejection::OwnNextHop,
    ];

    /// Metric label value.
    pub fn label(self) -> &'static str {
        match self {
            Rejection::MartianPrefix => "martian_prefix",
            Rejection::DefaultRoute => "default_route",
            Rejection::NodeLocal => "node_local",
            Rejection::ServiceVip => "service_vip",
            Rejection::CustomReject => "custom_import_reject",
            Rejection::MartianNextHop => "martian_next_hop",
            Rejection::OwnNextHop => "own_next_hop",
        }
    }
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Rejection::MartianPrefix => "martian prefix",
            Rejection::DefaultRoute => "default route not accepted from this peer (--bgp-accept-default)",
            Rejection::NodeLocal => "equal to or inside one of the node's own subnets or addresses",
            Rejection::ServiceVip => "a Service VIP this cluster advertises itself",
            Rejection::CustomReject => "in kube-router.io/node.bgp.customimportreject",
            Rejection::MartianNextHop => "martian or link-local next hop",
            Rejection::OwnNextHop => "next hop is this node",
        })
    }
}

const MARTIANS_V4: [(Ipv4Addr, u8); 5] = [
    (Ipv4Addr::new(0, 0, 0, 0), 8),
    (Ipv4Addr::new(127, 0, 0, 0), 8),
    (Ipv4Addr::new(169, 254, 0, 0), 16),
    (Ipv4Addr::new(224, 0, 0, 0), 4),
    (Ipv4Addr::new(240, 0, 0, 0), 4),
];

const MARTIANS_V6: [(Ipv6Addr, u8); 5] = [
    (Ipv6Addr::UNSPECIFIED, 128),
    (Ipv6Addr::LOCALHOST, 128),
    (Ipv6Addr::new(0, 0, 0, 0, 0, 0xffff, 0, 0), 96),
    (Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 0), 10),
    (Ipv6Addr::new(0xff00, 0, 0, 0, 0, 0, 0, 0), 8),
];

fn net_of(prefix: &Prefix) -> IpNet {
    IpNet::new(prefix.addr(), prefix.prefix_len()).expect("a Prefix is a valid network")
}

/// Inside one of the martian ranges (a less specific prefix that merely covers one is not).
pub fn is_martian_prefix(prefix: &Prefix) -> bool {
    let net = net_of(prefix);
    match net {
        IpNet::V4(_) => MARTIANS_V4.iter().any(|(a, l)| IpNet::new(IpAddr::V4(*a), *l).is_ok_and(|m| m.contains(&net))),
        IpNet::V6(_) => MARTIANS_V6.iter().any(|(a, l)| IpNet::new(IpAddr::V6(*a), *l).is_ok_and(|m| m.contains(&net))),
    }
}

/// An address no route may point at: unspecified, loopback, multicast, broadcast/reserved,
/// "this network", link-local, IPv4-mapped.
pub fn is_martian_next_hop(addr: IpAddr) -> bool {
    match addr {
        IpAddr::V4(a) => {
            a.is_unspecified()
                || a.is_loopback()
                || a.is_multicast()
                || a.is_link_local()
                || a.octets()[0] == 0
                || a.octets()[0] >= 240
        }
        IpAddr::V6(a) => {
            a.is_unspecified()
                || a.is_loopback()
                || a.is_multicast()
                || a.is_unicast_link_local()
                || a.to_ipv4_mapped().is_some()
        }
    }
}

/// The cluster-wide part of the import policy (the per-peer part is `accept_default`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImportPolicy {
    /// `--bgp-accept-default`: default routes from every peer.
    pub accept_default: bool,
    /// Every Service VIP this cluster advertises (as /32 or /128).
    pub service_vips: BTreeSet<Prefix>,
    /// `kube-router.io/node.bgp.customimportreject`.
    pub custom_reject: Vec<IpNet>,
}

impl ImportPolicy {
    /// Why a path must not be used, if it must not. `reach` (the node's subnets and addresses,
    /// from the kernel) is None until the kernel has been read.
    pub fn check(
        &self,
        peer_accepts_default: bool,
        prefix: &Prefix,
        next_hop: &NextHop,
        reach: Option<&Reachability>,
    ) -> Option<Rejection> {
        let net = net_of(prefix);
        if is_martian_prefix(prefix) {
            return Some(Rejection::MartianPrefix);
        }
        if net.prefix_len() == 0 {
            if !(self.accept_default || peer_accepts_default) {
                return Some(Rejection::DefaultRoute);
            }
        } else if let Some(reach) = reach {
            if reach.connected().any(|c| c.contains(&net))
                || (net.prefix_len() == net.max_prefix_len() && reach.is_local(net.addr()))
            {
                return Some(Rejection::NodeLocal);
            }
        }
        if self.service_vips.contains(prefix) {
            return Some(Rejection::ServiceVip);
        }
        if self.custom_reject.iter().any(|c| c.contains(&net)) {
            return Some(Rejection::CustomReject);
        }
        let hop = next_hop.addr();
        if is_martian_next_hop(hop) {
            return Some(Rejection::MartianNextHop);
        }
        if reach.is_some_and(|r| r.is_local(hop)) {
            return Some(Rejection::OwnNextHop);
        }
        None
    }
}

/// `kube-router.io/path-prepend.as` repeated `kube-router.io/path-prepend.repeat-n` times.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AsPrepend {
    pub asn: u32,
    pub repeat: u8,
}

/// What external peers receive and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportPolicy {
    /// `--advertise-pod-cidr`: external peers get the node's pod CIDRs (node peers always do).
    pub advertise_pod_cidr: bool,
    /// `kube-router.io/node.bgp.communities`, added towards external peers.
    pub communities: Vec<u32>,
    pub prepend: Option<AsPrepend>,
    /// `--override-nexthop`: external peers get the session's local address as next hop
    /// instead of the node IP.
    pub override_next_hop: bool,
}

impl Default for ExportPolicy {
    fn default() -> Self {
        Self { advertise_pod_cidr: true, communities: Vec::new(), prepend: None, override_next_hop: false }
    }
}

impl ExportPolicy {
    /// May a prefix this node originates go to a peer of `role`?
    pub fn exports_local(&self, kind: OriginKind, role: PeerRole) -> bool {
        match (kind, role) {
            (OriginKind::PodCidr, PeerRole::Node) => true,
            (OriginKind::PodCidr, PeerRole::External) => self.advertise_pod_cidr,
            (OriginKind::ServiceVip, PeerRole::External) => true,
            (OriginKind::ServiceVip, PeerRole::Node) => false,
        }
    }
}

/// Parses one `kube-router.io/node.bgp.communities` entry: a 32-bit number, `ASN:value` with two
/// 16-bit halves, or a well-known name (RFC 1997, RFC 3765, RFC 7999, RFC 8326).
pub fn parse_community(text: &str) -> Option<u32> {
    let text = text.trim();
    let well_known = match text.to_ascii_lowercase().as_str() {
        "internet" => Some(0),
        "planned-shut" | "graceful-shutdown" => Some(0xffff_0000),
        "accept-own" => Some(0xffff_0001),
        "llgr-stale" => Some(0xffff_0006),
        "no-llgr" => Some(0xffff_0007),
        "blackhole" => Some(0xffff_029a),
        "no-export" => Some(0xffff_ff01),
        "no-advertise" => Some(0xffff_ff02),
        "no-export-subconfed" => Some(0xffff_ff03),
        "no-peer" => Some(0xffff_ff04),
        _ => None,
    };
    if well_known.is_some() {
        return well_known;
    }
    if let Some((high, low)) = text.split_once(':') {
        let high: u16 = high.trim().parse().ok()?;
        let low: u16 = low.trim().parse().ok()?;
        return Some((u32::from(high) << 16) | u32::from(low));
    }
    text.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::fib::{ForeignRoute, KernelTable};

    fn p(s: &str) -> Prefix {
        s.parse().unwrap()
    }

    fn nh(s: &str) -> NextHop {
        NextHop::from(s.parse::<IpAddr>().unwrap())
    }

    fn policy() -> (ImportPolicy, Reachability) {
        let mut table = KernelTable::default();
        for net in ["10.77.0.0/24", "fd77::/64", "fe80::/64"] {
            table.foreign.insert(
                net.parse().unwrap(),
                ForeignRoute {
                    protocol: 2,
                    kind: ForeignRoute::UNICAST,
                    gateway: None,
                    oif: Some(2),
                    metric: 0,
                    linkdown: false,
                },
            );
        }
        let local = ["10.77.0.1", "fd77::1", "192.0.2.10"].iter().map(|a| a.parse().unwrap()).collect();
        let policy = ImportPolicy {
            accept_default: false,
            service_vips: [p("10.96.0.10/32")].into_iter().collect(),
            custom_reject: vec!["10.50.0.0/16".parse().unwrap()],
        };
        (policy, Reachability::new(&table, &local))
    }

    #[test]
    fn martians_defaults_and_the_nodes_own_subnets_are_refused() {
        let (policy, reach) = policy();
        let reach = Some(&reach);
        let peer = nh("10.77.0.2");
        let check = |prefix: &str| policy.check(false, &p(prefix), &peer, reach);
        for martian in
            ["127.0.0.0/8", "0.1.0.0/16", "169.254.0.0/16", "224.0.0.0/4", "240.0.0.0/4", "255.255.255.255/32"]
        {
            assert_eq!(check(martian), Some(Rejection::MartianPrefix), "{martian}");
        }
        for martian in ["::1/128", "fe80::/10", "fe80::/64", "ff02::/16", "::ffff:0:0/96"] {
            assert_eq!(
                policy.check(false, &p(martian), &nh("fd77::2"), reach),
                Some(Rejection::MartianPrefix),
                "{martian}"
            );
        }
        assert_eq!(check("0.0.0.0/0"), Some(Rejection::DefaultRoute));
        assert_eq!(policy.check(true, &p("0.0.0.0/0"), &peer, reach), None, "accepted for this peer");
        assert_eq!(check("10.77.0.0/24"), Some(Rejection::NodeLocal));
        assert_eq!(check("10.77.0.128/25"), Some(Rejection::NodeLocal));
        assert_eq!(check("192.0.2.10/32"), Some(Rejection::NodeLocal));
        assert_eq!(check("10.0.0.0/8"), None, "an aggregate covering the link is no threat: longest match keeps it");
        assert_eq!(check("10.96.0.10/32"), Some(Rejection::ServiceVip));
        assert_eq!(check("10.50.3.0/24"), Some(Rejection::CustomReject));
        assert_eq!(check("10.244.2.0/24"), None);
        for (hop, why) in [
            ("127.0.0.1", Rejection::MartianNextHop),
            ("0.0.0.0", Rejection::MartianNextHop),
            ("169.254.1.1", Rejection::MartianNextHop),
            ("10.77.0.1", Rejection::OwnNextHop),
        ] {
            assert_eq!(policy.check(false, &p("10.244.2.0/24"), &nh(hop), reach), Some(why), "{hop}");
        }
        assert_eq!(policy.check(false, &p("fd00:244::/64"), &nh("fe80::1"), reach), Some(Rejection::MartianNextHop));
        assert_eq!(
            policy.check(false, &p("10.77.0.0/24"), &peer, None),
            None,
            "subnets unknown before the kernel is read"
        );
    }

    #[test]
    fn export_follows_kube_routers_policy() {
        let mut export = ExportPolicy::default();
        assert!(export.exports_local(OriginKind::PodCidr, PeerRole::Node));
        assert!(export.exports_local(OriginKind::PodCidr, PeerRole::External));
        assert!(export.exports_local(OriginKind::ServiceVip, PeerRole::External));
        assert!(!export.exports_local(OriginKind::ServiceVip, PeerRole::Node));
        export.advertise_pod_cidr = false;
        assert!(!export.exports_local(OriginKind::PodCidr, PeerRole::External));
        assert!(export.exports_local(OriginKind::PodCidr, PeerRole::Node));
    }

    #[test]
    fn communities_in_every_form_kube_router_accepts() {
        assert_eq!(parse_community("4294967041"), Some(0xffff_ff01));
        assert_eq!(parse_community("65535:65281"), Some(0xffff_ff01));
        assert_eq!(parse_community("no-export"), Some(0xffff_ff01));
        assert_eq!(parse_community(" 64512:100 "), Some((64512 << 16) | 100));
        assert_eq!(parse_community("65536:1"), None);
        assert_eq!(parse_community("nonsense"), None);
    }
}
