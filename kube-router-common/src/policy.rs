//! Keys and values of the NetworkPolicy maps (`pol_*`), read by `kr_pol_ingress`/`kr_pol_egress`
//! and written by the agent from `policy::flatten::MapEntries` (see docs/policy-layout.md for
//! what the entries mean, docs/maps.md for the byte layouts).
//!
//! The maps that hold addresses come in pairs (`_v4`, `_v6`); `pol_ports` holds no address and
//! is shared: a peer set has its IPv4 prefixes in `pol_peers_v4` and its IPv6 ones in
//! `pol_peers_v6`, under the same set id.
//!
//! A new flow costs two LPM lookups whatever the number of policies, rules, peers or ports
//! (layout 3; layout 2 scanned up to 64 rules and denied pods with more).

/// Bits of a `pol_ports` LPM key before the port: the slot id (32) and the IP protocol (8). An
/// entry of [`POLICY_PORT_SLOT_BITS`] admits every protocol and port (a rule without `ports`); one
/// of `POLICY_PORT_SLOT_BITS + 8 + n` the ports whose first `n` bits equal the key's.
pub const POLICY_PORT_SLOT_BITS: u32 = 32;
pub const POLICY_PORT_PROTO_BITS: u32 = POLICY_PORT_SLOT_BITS + 8;
/// A lookup's prefix length: slot, protocol and the whole port.
pub const POLICY_PORT_FULL_BITS: u32 = POLICY_PORT_PROTO_BITS + 16;

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
/// Port entries of every slot: a port range takes up to 30 prefixes, usually a few.
pub const POLICY_PORTS_MAX_ENTRIES: u32 = 262_144;
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

/// The pod direction's allowed traffic is what `slot` admits in `pol_ports`; a slot without
/// entries (a policy with no rules) is default deny. `rule_count` is the number of compiled rules,
/// for dumps only: the datapath's work does not depend on it.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyPodValue {
    pub slot: u32,
    pub rule_count: u32,
}

/// The data part of a `pol_ports` LPM key (prefix length: see [`POLICY_PORT_SLOT_BITS`]). The trie
/// matches bytes most significant first, so the port is an array in network order and the slot
/// big-endian.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyPortKey {
    pub slot_be: u32,
    /// IP protocol number (6 TCP, 17 UDP, 132 SCTP; ICMP and others only match slot-wide entries).
    pub proto: u8,
    /// Destination port, network byte order (for ICMP echo, the identifier).
    pub port: [u8; 2],
    pub pad: u8,
}

/// The peers a pod direction admits on the matched protocol and ports: every rule whose ports
/// cover them contributes its peers, merged into one set in `pol_peers_v4/v6` (an id of its own
/// when more than one rule contributes).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyPortValue {
    pub peer_set: u32,
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
/// No packet of the other direction was seen yet: the entry lives
/// [`POLICY_CT_LIFETIME_UNREPLIED_SECS`], not a TCP connection's hours, so a flood of unanswered
/// SYNs cannot hold the map. Set on new entries and cleared by the first reply: entries written
/// before the bit existed lack it and keep their lifetime across an upgrade.
pub const POLICY_CT_UNREPLIED: u8 = 1 << 3;
/// Lifetime of an entry without a reply (Cilium: 60 s until the reply; nf_conntrack's SYN_SENT
/// 120 s).
pub const POLICY_CT_LIFETIME_UNREPLIED_SECS: u64 = 60;

/// `pol_cfg` (one `u32`, written by the agent) flag: track the flows of every pod in `pol_ct_v4/v6`,
/// as before the gate. Without it (the default, and an absent map) a pod isolated in neither
/// direction (no `pol_pods_v4/v6` entry) passes with no policy conntrack lookup and no entry:
/// only pods some policy isolates are tracked. The flag keeps, for every pod, the flows it had
/// before its first isolating policy (`KUBE_ROUTER_POLICY_CT_GATE=off`).
pub const POLICY_CT_TRACK_ALL: u32 = 1 << 0;

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
        } else if self.flags & POLICY_CT_UNREPLIED != 0 {
            POLICY_CT_LIFETIME_UNREPLIED_SECS
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
    /// ARP, or IPv6 neighbour discovery, router advertisements and multicast listener messages:
    /// passed unevaluated (every other frame is judged or dropped, see [`super::pol_guard_stat`]).
    pub const NOT_EVALUATED: u32 = 1;
    /// A non-first fragment (no ports to judge): passed; its first fragment was judged.
    pub const FRAGMENT_PASS: u32 = 2;
    /// A live `pol_ct_v4` entry (established connection or its reply): passed.
    pub const CT_ESTABLISHED: u32 = 3;
    /// New flow, the pod side checked here is not isolated: passed (and tracked if the pod's
    /// other side is). Also every packet of a pod isolated in neither direction, which passes
    /// untracked (see [`super::POLICY_CT_TRACK_ALL`]).
    pub const NOT_ISOLATED: u32 = 4;
    /// New flow allowed by a rule (and tracked).
    pub const ALLOWED: u32 = 5;
    /// New flow to a pod denied by its ingress policy (at TC egress of its veth).
    pub const DENIED_INGRESS: u32 = 6;
    /// New flow from a pod denied by its egress policy (at TC ingress of its veth).
    pub const DENIED_EGRESS: u32 = 7;
    /// Denied because no rule of the pod admits the protocol and port, whatever the peer (also
    /// counted as denied above; the rest of the denials are peers outside the admitted sets).
    pub const NO_PORT_MATCH: u32 = 8;
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
        "no_port_match",
        "ct_insert_failed",
        "node_exempt",
    ];
}

/// Indices of the per-CPU `pol_guard_stats` array: what the policy programs drop before judging
/// a flow, on every pod veth whether the pod is isolated or not, and the flows judged beyond
/// TCP/UDP/SCTP. A map of its own so that `pol_stats` keeps its layout.
pub mod pol_guard_stat {
    /// An ethertype other than IPv4, IPv6 and ARP (Cilium's DROP_UNKNOWN_L3): dropped.
    pub const DROP_UNKNOWN_L3: u32 = 0;
    /// A VLAN-tagged frame (802.1Q / 802.1ad ethertype, or a tag the kernel already took off
    /// into the skb): dropped, tagged IPv4 inside included.
    pub const DROP_VLAN: u32 = 1;
    /// A header shorter than it claims (the program could not read what it must judge):
    /// dropped, isolated pod or not; the receiving stack would drop it anyway.
    pub const DROP_MALFORMED: u32 = 2;
    /// An ICMP(v6) error quoting a live connection of the pod (fragmentation needed, packet
    /// too big, unreachable): passed as part of that connection.
    pub const ICMP_ERROR_RELATED: u32 = 3;
    /// A new flow to or from an isolated pod of an IP protocol other than TCP, UDP, SCTP, ICMP
    /// and ICMPv6 (GRE, IPIP, ...) was judged: only a rule without ports admits it. Counted
    /// whatever the verdict.
    pub const OTHER_PROTOCOL_JUDGED: u32 = 4;
    pub const COUNT: u32 = 5;
    /// Metric label of each index (`kube_router_policy_packets_total{result=...}`), index order.
    pub const NAMES: [&str; COUNT as usize] =
        ["drop_unknown_l3", "drop_vlan", "drop_malformed", "icmp_error_related", "other_protocol_judged"];
}

#[cfg(feature = "user")]
mod user {
    use super::*;
    // SAFETY: repr(C), Copy, only integers (and arrays of such structs), every gap an explicit
    // `pad` field, so any byte pattern is a valid value.
    unsafe impl aya::Pod for PolicyPodKeyV4 {}
    unsafe impl aya::Pod for PolicyPodValue {}
    unsafe impl aya::Pod for PolicyPortKey {}
    unsafe impl aya::Pod for PolicyPortValue {}
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
    fn an_unreplied_entry_lives_a_minute_until_its_reply_and_closing_still_wins() {
        let entry = |flags| PolicyCtValue { last_seen_ns: 0, flags, pad: [0; 7] };
        let secs = |flags, proto| entry(flags).lifetime_ns(proto) / 1_000_000_000;
        assert_eq!(secs(POLICY_CT_TO_POD | POLICY_CT_UNREPLIED, crate::IPPROTO_TCP), 60);
        assert_eq!(secs(POLICY_CT_TO_POD, crate::IPPROTO_TCP), crate::CT_LIFETIME_TCP_SECS);
        assert_eq!(secs(POLICY_CT_UNREPLIED | POLICY_CT_CLOSING, crate::IPPROTO_TCP), crate::CT_LIFETIME_CLOSING_SECS);
        assert_eq!(secs(POLICY_CT_FROM_POD, 47), crate::CT_LIFETIME_NON_TCP_SECS);
    }

    #[test]
    fn layouts_have_no_implicit_padding() {
        assert_eq!(size_of::<PolicyPodKeyV4>(), 8);
        assert_eq!(size_of::<PolicyPodValue>(), 8);
        assert_eq!(size_of::<PolicyPortKey>(), 8);
        assert_eq!(size_of::<PolicyPortValue>(), 4);
        assert_eq!(size_of::<PeerPrefixV4>(), 8);
        assert_eq!(size_of::<PolicyCtKeyV4>(), 16);
        assert_eq!(size_of::<PolicyCtValue>(), 16);
        assert_eq!(size_of::<PolicyPodKeyV6>(), 20);
        assert_eq!(size_of::<PeerPrefixV6>(), 20);
        assert_eq!(size_of::<PolicyCtKeyV6>(), 40);
    }
}
