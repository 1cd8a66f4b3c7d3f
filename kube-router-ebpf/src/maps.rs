//! The pinned maps. Names and layouts are documented in docs/maps.md.
use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, PerCpuHashMap},
};
use kube_router_common::*;

use crate::{conntrack::NewFlow, nat::Tuple, parsing::LbParsed};

#[map(name = "svc_v4")]
pub static SERVICES: HashMap<ServiceKeyV4, ServiceValue> = HashMap::pinned(SERVICES_MAX_ENTRIES, 0);

#[map(name = "svc_slots_v4")]
pub static BACKEND_SLOTS: HashMap<BackendSlotKey, BackendSlotValue> = HashMap::pinned(BACKEND_SLOTS_MAX_ENTRIES, 0);

#[map(name = "backends_v4")]
pub static BACKENDS: HashMap<u32, BackendV4> = HashMap::pinned(BACKENDS_MAX_ENTRIES, 0);

#[map(name = "ct_v4")]
pub static CONNTRACK: LruHashMap<CtKeyV4, CtValueV4> = LruHashMap::pinned(CONNTRACK_MAX_ENTRIES, 0);

#[map(name = "affinity_v4")]
pub static AFFINITY: LruHashMap<AffinityKeyV4, AffinityValue> = LruHashMap::pinned(AFFINITY_MAX_ENTRIES, 0);

#[map(name = "lb_config")]
pub static LB_CONFIG: Array<LbConfig> = Array::pinned(1, 0);

#[map(name = "frag_v4")]
pub static FRAGMENTS: LruHashMap<FragKeyV4, FragPorts> = LruHashMap::pinned(FRAGMENTS_MAX_ENTRIES, 0);

#[map(name = "cluster_nets_v4")]
pub static CLUSTER_NETS: LpmTrie<u32, u32> = LpmTrie::pinned(CLUSTER_NETS_MAX_ENTRIES, 0);

// IPv6 twins of the service maps (ids are per family: a dual-stack Service has one service id
// in each).

#[map(name = "svc_v6")]
pub static SERVICES_V6: HashMap<ServiceKeyV6, ServiceValue> = HashMap::pinned(SERVICES_MAX_ENTRIES, 0);

#[map(name = "svc_slots_v6")]
pub static BACKEND_SLOTS_V6: HashMap<BackendSlotKey, BackendSlotValue> = HashMap::pinned(BACKEND_SLOTS_MAX_ENTRIES, 0);

#[map(name = "backends_v6")]
pub static BACKENDS_V6: HashMap<u32, BackendV6> = HashMap::pinned(BACKENDS_MAX_ENTRIES, 0);

#[map(name = "ct_v6")]
pub static CONNTRACK_V6: LruHashMap<CtKeyV6, CtValueV6> = LruHashMap::pinned(CONNTRACK_MAX_ENTRIES, 0);

#[map(name = "affinity_v6")]
pub static AFFINITY_V6: LruHashMap<AffinityKeyV6, AffinityValue> = LruHashMap::pinned(AFFINITY_MAX_ENTRIES, 0);

#[map(name = "frag_v6")]
pub static FRAGMENTS_V6: LruHashMap<FragKeyV6, FragPorts> = LruHashMap::pinned(FRAGMENTS_MAX_ENTRIES, 0);

#[map(name = "cluster_nets_v6")]
pub static CLUSTER_NETS_V6: LpmTrie<Ipv6Words, u32> = LpmTrie::pinned(CLUSTER_NETS_MAX_ENTRIES, 0);

// The endpoints of Service flows: the gate in front of the conntrack lookup (see `gate`). The
// value is when the datapath first recorded it (ns, `bpf_ktime_get_ns`), for inspection only.
#[map(name = "ct_gate_v4")]
pub static CT_GATE: LruHashMap<ServiceKeyV4, u64> = LruHashMap::pinned(CT_GATE_MAX_ENTRIES, 0);

#[map(name = "ct_gate_v6")]
pub static CT_GATE_V6: LruHashMap<ServiceKeyV6, u64> = LruHashMap::pinned(CT_GATE_MAX_ENTRIES, 0);

// The load balancer conntrack's configured lifetimes (one entry; zero fields and no entry mean
// the built-in defaults). A map of its own, created when absent: no existing layout changes.
#[map(name = "ct_cfg")]
pub static CT_LIFETIMES: Array<CtLifetimes> = Array::pinned(1, 0);

/// `ct_cfg`'s entry, if the agent wrote one.
#[inline(always)]
pub fn ct_lifetimes() -> Option<&'static CtLifetimes> {
    CT_LIFETIMES.get(0)
}

#[map(name = "lb_src_v4")]
pub static SOURCE_RANGES: LpmTrie<SourceRangeKeyV4, u8> = LpmTrie::pinned(SOURCE_RANGES_MAX_ENTRIES, 0);

#[map(name = "lb_src_v6")]
pub static SOURCE_RANGES_V6: LpmTrie<SourceRangeKeyV6, u8> = LpmTrie::pinned(SOURCE_RANGES_MAX_ENTRIES, 0);

/// A new flow's two entries and keys, built in map memory rather than on the BPF stack (the
/// IPv6 ones take 192 bytes of its 512). Per CPU: one program run uses it at a time.
#[repr(C)]
pub struct CtScratch<A> {
    pub forward: CtValue<A>,
    pub reverse: CtValue<A>,
    pub forward_key: CtKey<A>,
    pub reverse_key: CtKey<A>,
    /// The other key of a stale flow holding `reverse_key` (see `conntrack::reclaim_stale`).
    pub stale_key: CtKey<A>,
    /// A new Service flow's endpoint being recorded (see `conntrack::record_endpoints`).
    pub endpoint: ServiceKey<A>,
    /// `ct_cfg`'s entry (zero: the defaults), copied here so no register holds it across the
    /// lookups of `conntrack::reclaim_stale`.
    pub lifetimes: CtLifetimes,
}

/// The packet being handled and what it becomes, in map memory for the same reason.
#[repr(C)]
pub struct Work<A> {
    pub parsed: LbParsed<A>,
    pub key: CtKey<A>,
    /// An endpoint of the packet the gate looks up (see `gate`).
    pub endpoint: ServiceKey<A>,
    pub to: Tuple<A>,
    pub new: NewFlow<A>,
    /// A new flow's frontend and chosen backend (see `lb::choose`).
    pub service: ServiceValue,
    pub chosen: (u32, Backend<A>),
}

// Not pinned: scratch space, nothing to keep across agent restarts.
#[map(name = "work_v4")]
pub static WORK: PerCpuArray<Work<u32>> = PerCpuArray::with_max_entries(1, 0);

#[map(name = "work_v6")]
pub static WORK_V6: PerCpuArray<Work<Ipv6Words>> = PerCpuArray::with_max_entries(1, 0);

#[map(name = "ct_scratch_v4")]
pub static CT_SCRATCH: PerCpuArray<CtScratch<u32>> = PerCpuArray::with_max_entries(1, 0);

#[map(name = "ct_scratch_v6")]
pub static CT_SCRATCH_V6: PerCpuArray<CtScratch<Ipv6Words>> = PerCpuArray::with_max_entries(1, 0);

/// Slots of `forwarded_v4/v6`: more than the packets one receive batch (NAPI's 64) takes
/// through TC ingress before the stack forwards the first of them to TC egress.
pub const FORWARDED_SLOTS: u32 = 256;

// The tuples of packets TC ingress recently left to the stack that TC egress need not look up:
// client packets translated, and packets with no entry of their own, one per slot of their hash
// (see `lb::egress`). Not pinned: a cache, empty after a reload.
#[map(name = "forwarded_v4")]
pub static FORWARDED: PerCpuArray<CtKeyV4> = PerCpuArray::with_max_entries(FORWARDED_SLOTS, 0);

#[map(name = "forwarded_v6")]
pub static FORWARDED_V6: PerCpuArray<CtKeyV6> = PerCpuArray::with_max_entries(FORWARDED_SLOTS, 0);

#[map(name = "lb_stats")]
pub static LB_STATS: PerCpuArray<u64> = PerCpuArray::pinned(lb_stat::COUNT, 0);

/// Written by the agent only; present so the layout version travels with the pinned maps.
#[map(name = "meta")]
pub static META: Array<u32> = Array::pinned(META_MAX_ENTRIES, 0);

/// Adds one to this CPU's `stat` counter of `counters`.
#[inline(always)]
pub fn bump(counters: &PerCpuArray<u64>, stat: u32) {
    if let Some(counter) = counters.get_ptr_mut(stat) {
        // Per-CPU slot: no other CPU writes it, a plain add is enough.
        unsafe { *counter += 1 };
    }
}

#[inline(always)]
pub fn count(stat: u32) {
    bump(&LB_STATS, stat);
}

// NetworkPolicy (see kube_router_common::policy and docs/policy-layout.md).

#[map(name = "pol_pods_v4")]
pub static POLICY_PODS: HashMap<PolicyPodKeyV4, PolicyPodValue> = HashMap::pinned(POLICY_PODS_MAX_ENTRIES, 0);

#[map(name = "pol_ports")]
pub static POLICY_PORTS: LpmTrie<PolicyPortKey, PolicyPortValue> = LpmTrie::pinned(POLICY_PORTS_MAX_ENTRIES, 0);

#[map(name = "pol_peers_v4")]
pub static POLICY_PEERS: LpmTrie<PeerPrefixV4, u8> = LpmTrie::pinned(POLICY_PEERS_MAX_ENTRIES, 0);

#[map(name = "pol_ct_v4")]
pub static POLICY_CONNTRACK: LruHashMap<PolicyCtKeyV4, PolicyCtValue> =
    LruHashMap::pinned(POLICY_CONNTRACK_MAX_ENTRIES, 0);

#[map(name = "pol_pods_v6")]
pub static POLICY_PODS_V6: HashMap<PolicyPodKeyV6, PolicyPodValue> = HashMap::pinned(POLICY_PODS_MAX_ENTRIES, 0);

#[map(name = "pol_peers_v6")]
pub static POLICY_PEERS_V6: LpmTrie<PeerPrefixV6, u8> = LpmTrie::pinned(POLICY_PEERS_MAX_ENTRIES, 0);

#[map(name = "pol_ct_v6")]
pub static POLICY_CONNTRACK_V6: LruHashMap<PolicyCtKeyV6, PolicyCtValue> =
    LruHashMap::pinned(POLICY_CONNTRACK_MAX_ENTRIES, 0);

/// Written by the agent only: `POLICY_CT_TRACK_ALL` or 0. A map of its own, created when absent.
#[map(name = "pol_cfg")]
pub static POLICY_CONFIG: Array<u32> = Array::pinned(1, 0);

#[map(name = "pol_stats")]
pub static POLICY_STATS: PerCpuArray<u64> = PerCpuArray::pinned(pol_stat::COUNT, 0);

/// What the policy programs drop before judging a flow (see `pol_guard_stat`).
#[map(name = "pol_guard_stats")]
pub static POLICY_GUARD_STATS: PerCpuArray<u64> = PerCpuArray::pinned(pol_guard_stat::COUNT, 0);

#[inline(always)]
pub fn count_policy_guard(stat: u32) {
    bump(&POLICY_GUARD_STATS, stat);
}

#[inline(always)]
pub fn count_policy(stat: u32) {
    bump(&POLICY_STATS, stat);
}

// Pod overlay between nodes (see overlay.rs and kube_router_common::OverlayTunnelV4).

#[map(name = "ovl_routes_v4")]
pub static OVERLAY_ROUTES: LpmTrie<OverlayPrefixV4, OverlayTunnelV4> = LpmTrie::pinned(OVERLAY_ROUTES_MAX_ENTRIES, 0);

#[map(name = "ovl_remotes_v4")]
pub static OVERLAY_REMOTES: HashMap<u32, OverlayTunnelV4> = HashMap::pinned(OVERLAY_REMOTES_MAX_ENTRIES, 0);

#[map(name = "ovl_stats")]
pub static OVERLAY_STATS: PerCpuArray<u64> = PerCpuArray::pinned(ovl_stat::COUNT, 0);

#[inline(always)]
pub fn count_overlay(stat: u32) {
    bump(&OVERLAY_STATS, stat);
}

// Socket load balancer (see kube_router_common::sock and docs/maps.md).

#[map(name = "sock_rev_v4")]
pub static SOCK_REVERSE: LruHashMap<SockReverseKeyV4, SockReverseValueV4> =
    LruHashMap::pinned(SOCK_REVERSE_MAX_ENTRIES, 0);

#[map(name = "sock_rev_v6")]
pub static SOCK_REVERSE_V6: LruHashMap<SockReverseKeyV6, SockReverseValueV6> =
    LruHashMap::pinned(SOCK_REVERSE_MAX_ENTRIES, 0);

/// Written by the agent only.
#[map(name = "sock_cfg")]
pub static SOCK_CONFIG: Array<SockLbConfig> = Array::pinned(SOCK_CONFIG_MAX_ENTRIES, 0);

/// Keys written by the agent; the programs only count in the values (per CPU: a plain add).
#[map(name = "sock_exempt")]
pub static SOCK_EXEMPT: PerCpuHashMap<u64, u64> = PerCpuHashMap::pinned(SOCK_EXEMPT_MAX_ENTRIES, 0);

#[map(name = "sock_stats")]
pub static SOCK_STATS: PerCpuArray<u64> = PerCpuArray::pinned(sock_stat::COUNT, 0);

#[inline(always)]
pub fn count_sock(stat: u32) {
    bump(&SOCK_STATS, stat);
}
