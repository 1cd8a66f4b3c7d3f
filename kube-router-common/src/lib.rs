//! Keys and values of the pinned BPF maps, shared by the eBPF programs and the agent.
//!
//! Every type here is `#[repr(C)]` with explicit padding so that both sides, and `bpftool map
//! dump`, agree on the bytes. Addresses and ports are stored in network byte order, exactly as
//! they appear in packets, so the datapath never converts. `docs/maps.md` documents each map;
//! changing a layout means bumping [`LAYOUT_VERSION`] and the `_vN` suffix of the map name.
#![no_std]

mod policy;
pub use policy::*;
mod sock;
pub use sock::*;

/// Version of the whole map layout. Stored in the `meta` map at index [`META_LAYOUT_VERSION`].
pub const LAYOUT_VERSION: u32 = 1;

/// Directory under bpffs where maps and links are pinned.
pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/kube-router";

/// Map names (also their pin file names). BPF object names are limited to 15 bytes.
pub mod map_names {
    pub const SERVICES: &str = "svc_v4";
    pub const BACKEND_SLOTS: &str = "svc_slots_v4";
    pub const BACKENDS: &str = "backends_v4";
    pub const CONNTRACK: &str = "ct_v4";
    pub const AFFINITY: &str = "affinity_v4";
    pub const LB_STATS: &str = "lb_stats";
    pub const META: &str = "meta";
    pub const POLICY_PODS: &str = "pol_pods_v4";
    pub const POLICY_RULES: &str = "pol_rules";
    pub const POLICY_PEERS: &str = "pol_peers_v4";
    pub const POLICY_CONNTRACK: &str = "pol_ct_v4";
    pub const POLICY_STATS: &str = "pol_stats";
}

pub const SERVICES_MAX_ENTRIES: u32 = 65_536;
pub const BACKEND_SLOTS_MAX_ENTRIES: u32 = 262_144;
pub const BACKENDS_MAX_ENTRIES: u32 = 262_144;
pub const CONNTRACK_MAX_ENTRIES: u32 = 262_144;
pub const AFFINITY_MAX_ENTRIES: u32 = 65_536;
pub const META_MAX_ENTRIES: u32 = 4;

/// Index in the `meta` array holding [`LAYOUT_VERSION`].
pub const META_LAYOUT_VERSION: u32 = 0;

pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;
pub const IPPROTO_ICMP: u8 = 1;
pub const IPPROTO_SCTP: u8 = 132;

/// A service frontend: ClusterIP, ExternalIP, LoadBalancer IP or node IP (NodePort) + port.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKeyV4 {
    /// Network byte order.
    pub addr: u32,
    /// Network byte order.
    pub port: u16,
    pub proto: u8,
    pub pad: u8,
}

/// Service uses ClientIP session affinity (`affinity_timeout_secs` applies).
pub const SVC_FLAG_AFFINITY: u32 = 1 << 0;
/// Frontend only uses node-local endpoints (externalTrafficPolicy: Local).
pub const SVC_FLAG_LOCAL_ONLY: u32 = 1 << 1;
/// Frontend is a NodePort on a node address.
pub const SVC_FLAG_NODEPORT: u32 = 1 << 2;

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ServiceValue {
    /// Names the backend set in `svc_slots_v4`. Stable across agent restarts.
    pub service_id: u32,
    /// Slots `0..backend_count` exist in `svc_slots_v4`; 0 means "no endpoints": drop.
    pub backend_count: u32,
    pub flags: u32,
    pub affinity_timeout_secs: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendSlotKey {
    pub service_id: u32,
    pub slot: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BackendSlotValue {
    pub backend_id: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendV4 {
    /// Network byte order.
    pub addr: u32,
    /// Network byte order.
    pub port: u16,
    pub pad: u16,
}

/// Conntrack key: the 5-tuple exactly as seen in the packet that looks it up.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CtKeyV4 {
    pub src_addr: u32,
    pub dst_addr: u32,
    pub src_port: u16,
    pub dst_port: u16,
    pub proto: u8,
    pub pad: [u8; 3],
}

/// Forward entry: client -> frontend; rewrite the destination to the backend.
pub const CT_FLAG_FORWARD: u8 = 1 << 0;
/// Reverse entry: backend -> client; rewrite the source back to the frontend.
pub const CT_FLAG_REVERSE: u8 = 1 << 1;
/// A FIN or RST was seen: the entry expires after [`CT_LIFETIME_CLOSING_SECS`].
pub const CT_FLAG_CLOSING: u8 = 1 << 2;

pub const CT_LIFETIME_TCP_SECS: u64 = 6 * 3600;
pub const CT_LIFETIME_NON_TCP_SECS: u64 = 60;
pub const CT_LIFETIME_CLOSING_SECS: u64 = 10;

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CtValueV4 {
    /// Monotonic clock (`bpf_ktime_get_ns`) of the last packet, refreshed at most once a second.
    pub last_seen_ns: u64,
    /// Forward: backend address; reverse: frontend address. Network byte order.
    pub nat_addr: u32,
    pub nat_port: u16,
    pub flags: u8,
    pub pad: u8,
    pub service_id: u32,
    pub backend_id: u32,
}

impl CtValueV4 {
    /// How long the entry lives after its last packet.
    pub const fn lifetime_ns(&self, proto: u8) -> u64 {
        let secs = if self.flags & CT_FLAG_CLOSING != 0 {
            CT_LIFETIME_CLOSING_SECS
        } else if proto == IPPROTO_TCP {
            CT_LIFETIME_TCP_SECS
        } else {
            CT_LIFETIME_NON_TCP_SECS
        };
        secs * 1_000_000_000
    }
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AffinityKeyV4 {
    pub client_addr: u32,
    pub service_id: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AffinityValue {
    pub last_used_ns: u64,
    pub backend_id: u32,
    /// Slot the backend was picked from; affinity holds only while that slot still names it.
    pub slot: u32,
}

/// Indices of the per-CPU `lb_stats` array (u64 packet counters).
pub mod lb_stat {
    pub const PACKETS: u32 = 0;
    pub const NOT_IPV4: u32 = 1;
    pub const NO_SERVICE: u32 = 2;
    pub const NEW_FLOW: u32 = 3;
    pub const CT_HIT: u32 = 4;
    pub const REVERSE_NAT: u32 = 5;
    pub const NO_BACKEND_DROP: u32 = 6;
    pub const AFFINITY_HIT: u32 = 7;
    pub const CT_INSERT_FAILED: u32 = 8;
    pub const FRAGMENT_PASS: u32 = 9;
    pub const REWRITE_FAILED: u32 = 10;
    pub const COUNT: u32 = 11;
    /// Metric label of each index, in index order.
    pub const NAMES: [&str; COUNT as usize] = [
        "packets",
        "not_ipv4",
        "no_service",
        "new_flow",
        "ct_hit",
        "reverse_nat",
        "no_backend_drop",
        "affinity_hit",
        "ct_insert_failed",
        "fragment_pass",
        "rewrite_failed",
    ];
}

#[cfg(feature = "user")]
mod user {
    use super::*;
    // SAFETY: all these types are repr(C), Copy, contain only integers and have no implicit
    // padding (every gap is an explicit `pad` field), so any byte pattern is a valid value.
    unsafe impl aya::Pod for ServiceKeyV4 {}
    unsafe impl aya::Pod for ServiceValue {}
    unsafe impl aya::Pod for BackendSlotKey {}
    unsafe impl aya::Pod for BackendSlotValue {}
    unsafe impl aya::Pod for BackendV4 {}
    unsafe impl aya::Pod for CtKeyV4 {}
    unsafe impl aya::Pod for CtValueV4 {}
    unsafe impl aya::Pod for AffinityKeyV4 {}
    unsafe impl aya::Pod for AffinityValue {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    // The sizes are part of the user-visible interface (bpftool dumps): pin them.
    #[test]
    fn layouts_have_no_implicit_padding() {
        assert_eq!(size_of::<ServiceKeyV4>(), 8);
        assert_eq!(size_of::<ServiceValue>(), 16);
        assert_eq!(size_of::<BackendSlotKey>(), 8);
        assert_eq!(size_of::<BackendSlotValue>(), 4);
        assert_eq!(size_of::<BackendV4>(), 8);
        assert_eq!(size_of::<CtKeyV4>(), 16);
        assert_eq!(size_of::<CtValueV4>(), 24);
        assert_eq!(size_of::<AffinityKeyV4>(), 8);
        assert_eq!(size_of::<AffinityValue>(), 16);
    }
}
