//! Keys and values of the NetworkPolicy maps (`pol_*`), read by `kr_pol_ingress`/`kr_pol_egress`
//! and written by the agent from `policy::bpf_maps::MapEntries` (see docs/policy-layout.md for
//! what the entries mean, docs/maps.md for the byte layouts).
//!
//! The maps that hold addresses come in pairs (`_v4`, `_v6`); `pol_rules` holds no address and
//! is shared: a rule's peer set has its IPv4 prefixes in `pol_peers_v4` and its IPv6 ones in
//! `pol_peers_v6`, under the same set id.

/// Upper bound of the datapath's rule loop per pod and direction. The verifier needs a constant
/// bound; 64 keeps the program well inside its complexity limit (each iteration is a hash lookup,
/// up to [`POLICY_PORT_RANGES_PER_RULE`] range compares and an LPM lookup). A pod direction whose
/// `rule_count` exceeds it is **denied** (fail closed) and counted as
/// [`pol_stat::RULE_LIMIT_DENIED`]; the agent should compile with
/// `CompileOptions::max_rules_per_pod` <= this divided by the port-range chunking factor.
pub const MAX_RULES_PER_POD: u32 = 64;

/// Port ranges one `pol_rules` value holds (the flattener splits longer lists).
pub const POLICY_PORT_RANGES_PER_RULE: usize = 8;

/// `PolicyRuleValue::range_count` meaning "every protocol and port" (a rule without `ports`).
pub const POLICY_ALL_PORTS: u8 = 0xff;

/// `PolicyPodKeyV4::direction`. 0 is left unused so a zeroed key never matches.
pub const POLICY_DIR_INGRESS: u8 = 1;
pub const POLICY_DIR_EGRESS: u8 = 2;

/// `pol_peers_v4` values: the verdict of the longest matching prefix.
pub const PEER_DENY: u8 = 0;
pub const PEER_ALLOW: u8 = 1;

/// Bits of an LPM key before the address: the peer-set id, matched exactly, so a lookup never
/// reaches another set's prefixes.
pub const PEER_SET_PREFIX_BITS: u32 = 32;

pub const POLICY_PODS_MAX_ENTRIES: u32 = 65_536;
pub const POLICY_RULES_MAX_ENTRIES: u32 = 65_536;
pub const POLICY_PEERS_MAX_ENTRIES: u32 = 262_144;
pub const POLICY_CONNTRACK_MAX_ENTRIES: u32 = 262_144;

/// An isolated pod direction: `pol_pods_v4` key.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyPodKeyV4 {
    /// Pod IP, network byte order.
    pub addr: u32,
    /// [`POLICY_DIR_INGRESS`] or [`POLICY_DIR_EGRESS`].
    pub direction: u8,
    pub pad: [u8; 3],
}

/// The pod direction's allowed traffic is rules `0..rule_count` of `slot` in `pol_rules`;
/// `rule_count == 0` is default deny.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyPodValue {
    pub slot: u32,
    pub rule_count: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyRuleKey {
    pub slot: u32,
    pub rule_index: u32,
}

/// One inclusive destination-port range. Unlike packet fields the bounds are host-endian:
/// they are compared, not matched byte for byte.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyPortRange {
    /// IP protocol number (6 TCP, 17 UDP, 132 SCTP).
    pub proto: u8,
    pub pad: u8,
    pub start: u16,
    pub end: u16,
}

impl PolicyPortRange {
    #[inline(always)]
    pub const fn contains(&self, proto: u8, port: u16) -> bool {
        self.proto == proto && self.start <= port && port <= self.end
    }
}

/// One allowed (peer set x ports) combination.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyRuleValue {
    /// Peer-set id in `pol_peers_v4`.
    pub peer_set: u32,
    /// Used entries of `ranges`, or [`POLICY_ALL_PORTS`].
    pub range_count: u8,
    pub pad: [u8; 3],
    pub ranges: [PolicyPortRange; POLICY_PORT_RANGES_PER_RULE],
}

impl PolicyRuleValue {
    /// Whether the rule's ports admit `proto`/`port` (`port` host-endian; 0 for ICMP, which
    /// only rules without `ports` admit because no range names protocol 1).
    #[inline(always)]
    pub fn ports_match(&self, proto: u8, port: u16) -> bool {
        if self.range_count == POLICY_ALL_PORTS {
            return true;
        }
        let mut index = 0;
        while index < POLICY_PORT_RANGES_PER_RULE {
            if index >= self.range_count as usize {
                return false;
            }
            if self.ranges[index].contains(proto, port) {
                return true;
            }
            index += 1;
        }
        false
    }
}

/// The data part of a `pol_peers_v4` LPM key (after the u32 prefix length, which is
/// [`PEER_SET_PREFIX_BITS`] + the address prefix length).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerPrefixV4 {
    /// Peer-set id, **big-endian**: the trie matches bytes most significant first.
    pub peer_set_be: u32,
    /// Network byte order.
    pub addr: u32,
}

/// An isolated IPv6 pod direction: `pol_pods_v6` key.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyPodKeyV6 {
    /// Pod IP, network byte order.
    pub addr: crate::Ipv6Words,
    /// [`POLICY_DIR_INGRESS`] or [`POLICY_DIR_EGRESS`].
    pub direction: u8,
    pub pad: [u8; 3],
}

/// The data part of a `pol_peers_v6` LPM key (prefix length = [`PEER_SET_PREFIX_BITS`] + the
/// address prefix length).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerPrefixV6 {
    /// Peer-set id, **big-endian**.
    pub peer_set_be: u32,
    /// Network byte order.
    pub addr: crate::Ipv6Words,
}

/// `pol_ct_v6` key: as [`PolicyCtKeyV4`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyCtKeyV6 {
    pub pod_addr: crate::Ipv6Words,
    pub peer_addr: crate::Ipv6Words,
    pub pod_port: u16,
    pub peer_port: u16,
    pub proto: u8,
    pub pad: [u8; 3],
}

/// Policy conntrack key, normalised to the pod whose veth the hook is on, so that one entry
/// admits both directions of an allowed connection at that pod's veth: at TC ingress (packet
/// from the pod) `pod = src`, at TC egress (packet to the pod) `pod = dst`. Ports network order;
/// for ICMP echo both ports are the echo identifier.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyCtKeyV4 {
    pub pod_addr: u32,
    pub peer_addr: u32,
    pub pod_port: u16,
    pub peer_port: u16,
    pub proto: u8,
    pub pad: [u8; 3],
}

/// The pod opened the connection (its egress was checked).
pub const POLICY_CT_FROM_POD: u8 = 1 << 0;
/// The peer opened the connection (the pod's ingress was checked).
pub const POLICY_CT_TO_POD: u8 = 1 << 1;
/// A FIN or RST was seen: the entry expires after [`crate::CT_LIFETIME_CLOSING_SECS`].
pub const POLICY_CT_CLOSING: u8 = 1 << 2;

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PolicyCtValue {
    /// `bpf_ktime_get_ns` of the last packet, refreshed at most once a second.
    pub last_seen_ns: u64,
    pub flags: u8,
    pub pad: [u8; 7],
}

impl PolicyCtValue {
    /// How long the entry lives after its last packet (same lifetimes as the LB's `ct_v4`).
    pub const fn lifetime_ns(&self, proto: u8) -> u64 {
        let secs = if self.flags & POLICY_CT_CLOSING != 0 {
            crate::CT_LIFETIME_CLOSING_SECS
        } else if proto == crate::IPPROTO_TCP {
            crate::CT_LIFETIME_TCP_SECS
        } else {
            crate::CT_LIFETIME_NON_TCP_SECS
        };
        secs * 1_000_000_000
    }
}

/// Indices of the per-CPU `pol_stats` array (u64 packet counters, summed over both programs).
pub mod pol_stat {
    pub const PACKETS: u32 = 0;
    /// Neither IPv4 nor IPv6, or not TCP/UDP/SCTP/ICMP(v6), or IPv6 neighbour discovery and
    /// router advertisements: passed unevaluated.
    pub const NOT_EVALUATED: u32 = 1;
    /// A non-first fragment (no ports to judge): passed; its first fragment was judged.
    pub const FRAGMENT_PASS: u32 = 2;
    /// A live `pol_ct_v4` entry (established connection or its reply): passed.
    pub const CT_ESTABLISHED: u32 = 3;
    /// New flow, the pod side checked here is not isolated: passed (and tracked).
    pub const NOT_ISOLATED: u32 = 4;
    /// New flow allowed by a rule (and tracked).
    pub const ALLOWED: u32 = 5;
    /// New flow to a pod denied by its ingress policy (at TC egress of its veth).
    pub const DENIED_INGRESS: u32 = 6;
    /// New flow from a pod denied by its egress policy (at TC ingress of its veth).
    pub const DENIED_EGRESS: u32 = 7;
    /// Denied because `rule_count` > [`super::MAX_RULES_PER_POD`] (also counted as denied above).
    pub const RULE_LIMIT_DENIED: u32 = 8;
    /// An allowed new flow could not be tracked (the packet still passes; the next retries).
    pub const CT_INSERT_FAILED: u32 = 9;
    /// New flow to a pod sent by its own node (kubelet probes, hostNetwork pods): passed
    /// whatever the pod's ingress policy, as kube-router accepts `--src-type LOCAL` (and tracked,
    /// so the reply passes the pod's egress policy).
    pub const NODE_EXEMPT: u32 = 10;
    pub const COUNT: u32 = 11;
    /// Metric label of each index, in index order.
    pub const NAMES: [&str; COUNT as usize] = [
        "packets",
        "not_evaluated",
        "fragment_pass",
        "ct_established",
        "not_isolated",
        "allowed",
        "denied_ingress",
        "denied_egress",
        "rule_limit_denied",
        "ct_insert_failed",
        "node_exempt",
    ];
}

#[cfg(feature = "user")]
mod user {
    use super::*;
    // SAFETY: repr(C), Copy, only integers (and arrays of such structs), every gap an explicit
    // `pad` field, so any byte pattern is a valid value.
    unsafe impl aya::Pod for PolicyPodKeyV4 {}
    unsafe impl aya::Pod for PolicyPodValue {}
    unsafe impl aya::Pod for PolicyRuleKey {}
    unsafe impl aya::Pod for PolicyRuleValue {}
    unsafe impl aya::Pod for PeerPrefixV4 {}
    unsafe impl aya::Pod for PolicyCtKeyV4 {}
    unsafe impl aya::Pod for PolicyCtValue {}
    unsafe impl aya::Pod for PolicyPodKeyV6 {}
    unsafe impl aya::Pod for PeerPrefixV6 {}
    unsafe impl aya::Pod for PolicyCtKeyV6 {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    #[test]
    fn layouts_have_no_implicit_padding() {
        assert_eq!(size_of::<PolicyPodKeyV4>(), 8);
        assert_eq!(size_of::<PolicyPodValue>(), 8);
        assert_eq!(size_of::<PolicyRuleKey>(), 8);
        assert_eq!(size_of::<PolicyPortRange>(), 6);
        assert_eq!(size_of::<PolicyRuleValue>(), 8 + 6 * POLICY_PORT_RANGES_PER_RULE);
        assert_eq!(size_of::<PeerPrefixV4>(), 8);
        assert_eq!(size_of::<PolicyCtKeyV4>(), 16);
        assert_eq!(size_of::<PolicyCtValue>(), 16);
        assert_eq!(size_of::<PolicyPodKeyV6>(), 20);
        assert_eq!(size_of::<PeerPrefixV6>(), 20);
        assert_eq!(size_of::<PolicyCtKeyV6>(), 40);
    }

    fn rule(range_count: u8, ranges: &[PolicyPortRange]) -> PolicyRuleValue {
        let mut value =
            PolicyRuleValue { peer_set: 1, range_count, pad: [0; 3], ranges: [PolicyPortRange::default(); 8] };
        value.ranges[..ranges.len()].copy_from_slice(ranges);
        value
    }

    #[test]
    fn ports_match_uses_only_the_counted_ranges_inclusively() {
        let tcp_80_90 = PolicyPortRange { proto: 6, pad: 0, start: 80, end: 90 };
        let udp_53 = PolicyPortRange { proto: 17, pad: 0, start: 53, end: 53 };
        let r = rule(2, &[tcp_80_90, udp_53]);
        assert!(r.ports_match(6, 80) && r.ports_match(6, 90) && r.ports_match(17, 53));
        assert!(!r.ports_match(6, 79) && !r.ports_match(6, 91) && !r.ports_match(17, 80) && !r.ports_match(6, 53));
        // A stale range beyond range_count is ignored.
        assert!(!rule(1, &[tcp_80_90, udp_53]).ports_match(17, 53));
        assert!(!rule(0, &[tcp_80_90]).ports_match(6, 80));
        let all = rule(POLICY_ALL_PORTS, &[]);
        assert!(all.ports_match(1, 0) && all.ports_match(132, 65535));
    }
}
