//! Source-address verification on pod veths (`pod_src`, `src_chk_stats`): the agent writes each
//! pod veth's own addresses, read from the pod's network namespace; the first program at TC
//! ingress of the veth drops a packet whose source is not one of them (see docs/security/spoof.md).
//! Maps of their own, so the older maps keep their layout.
use crate::Ipv6Words;

pub mod source_check_map_names {
    pub const POD_SOURCES: &str = "pod_src";
    pub const SOURCE_CHECK_STATS: &str = "src_chk_stats";
}

/// Addresses of each family a pod veth may send from (a pod has one or two per family).
pub const POD_SOURCE_ADDRS: usize = 4;
pub const POD_SOURCES_MAX_ENTRIES: u32 = 16_384;

/// `PodSources::checked_by`: which program of the veth's TC ingress checks its packets, the
/// first one to see them (the load balancer's source NAT must not be mistaken for a spoof).
pub const SOURCE_CHECK_BY_LB: u8 = 1;
pub const SOURCE_CHECK_BY_POLICY: u8 = 2;

/// `pod_src` value, keyed by the host-side veth's ifindex (u32). A veth without an entry is
/// not checked (not a pod veth, or the check is off); an entry with no address of a family
/// drops that family (fail closed until the pod's addresses are known).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodSources {
    pub v4_count: u8,
    pub v6_count: u8,
    /// [`SOURCE_CHECK_BY_LB`] or [`SOURCE_CHECK_BY_POLICY`].
    pub checked_by: u8,
    pub pad: u8,
    /// Network byte order.
    pub v4: [u32; POD_SOURCE_ADDRS],
    /// Global and link-local addresses, network byte order.
    pub v6: [Ipv6Words; POD_SOURCE_ADDRS],
}

/// Indices of the `src_chk_stats` per-CPU counters.
pub mod src_stat {
    /// Packets from checked pod veths.
    pub const PACKETS: u32 = 0;
    /// IPv4 from one of the pod's own addresses, or IPv6 from one or from `::` / link-local
    /// (ICMPv6 only: neighbour discovery, MLD): passed.
    pub const PASSED: u32 = 1;
    /// IPv4 from another address: dropped.
    pub const SPOOFED_V4: u32 = 2;
    /// IPv6 from another address: dropped.
    pub const SPOOFED_V6: u32 = 3;
    /// An ARP frame whose sender address is not the pod's (nor 0.0.0.0, a probe): dropped.
    pub const SPOOFED_ARP: u32 = 4;
    /// Dropped while the veth's addresses of that family are unknown (counted in the above too).
    pub const UNRESOLVED: u32 = 5;
    pub const COUNT: u32 = 6;
    pub const NAMES: [&str; COUNT as usize] =
        ["packets", "passed", "spoofed_v4", "spoofed_v6", "spoofed_arp", "unresolved"];
}

#[cfg(feature = "user")]
// SAFETY: repr(C), Copy, integers only, the one gap an explicit `pad` field.
unsafe impl aya::Pod for PodSources {}

#[cfg(test)]
mod tests {
    #[test]
    fn layout_has_no_implicit_padding() {
        assert_eq!(core::mem::size_of::<super::PodSources>(), 4 + 16 + 64);
    }
}
