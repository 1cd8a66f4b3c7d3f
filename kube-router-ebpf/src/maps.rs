//! The pinned maps. Names and layouts are documented in docs/maps.md.
use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray},
};
use kube_router_common::*;

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

#[map(name = "lb_stats")]
pub static LB_STATS: PerCpuArray<u64> = PerCpuArray::pinned(lb_stat::COUNT, 0);

/// Written by the agent only; present so the layout version travels with the pinned maps.
#[map(name = "meta")]
pub static META: Array<u32> = Array::pinned(META_MAX_ENTRIES, 0);

#[inline(always)]
pub fn count(stat: u32) {
    if let Some(counter) = LB_STATS.get_ptr_mut(stat) {
        // Per-CPU slot: no other CPU writes it, a plain add is enough.
        unsafe { *counter += 1 };
    }
}

// NetworkPolicy (see kube_router_common::policy and docs/policy-layout.md).

#[map(name = "pol_pods_v4")]
pub static POLICY_PODS: HashMap<PolicyPodKeyV4, PolicyPodValue> = HashMap::pinned(POLICY_PODS_MAX_ENTRIES, 0);

#[map(name = "pol_rules")]
pub static POLICY_RULES: HashMap<PolicyRuleKey, PolicyRuleValue> = HashMap::pinned(POLICY_RULES_MAX_ENTRIES, 0);

#[map(name = "pol_peers_v4")]
pub static POLICY_PEERS: LpmTrie<PeerPrefixV4, u8> = LpmTrie::pinned(POLICY_PEERS_MAX_ENTRIES, 0);

#[map(name = "pol_ct_v4")]
pub static POLICY_CONNTRACK: LruHashMap<PolicyCtKeyV4, PolicyCtValue> =
    LruHashMap::pinned(POLICY_CONNTRACK_MAX_ENTRIES, 0);

#[map(name = "pol_stats")]
pub static POLICY_STATS: PerCpuArray<u64> = PerCpuArray::pinned(pol_stat::COUNT, 0);

#[inline(always)]
pub fn count_policy(stat: u32) {
    if let Some(counter) = POLICY_STATS.get_ptr_mut(stat) {
        // Per-CPU slot: no other CPU writes it, a plain add is enough.
        unsafe { *counter += 1 };
    }
}

// Socket load balancer (see kube_router_common::sock and docs/maps.md).

#[map(name = "sock_rev_v4")]
pub static SOCK_REVERSE: LruHashMap<SockReverseKeyV4, SockReverseValueV4> =
    LruHashMap::pinned(SOCK_REVERSE_MAX_ENTRIES, 0);

/// Written by the agent only.
#[map(name = "sock_cfg")]
pub static SOCK_CONFIG: Array<SockLbConfig> = Array::pinned(SOCK_CONFIG_MAX_ENTRIES, 0);

#[map(name = "sock_stats")]
pub static SOCK_STATS: PerCpuArray<u64> = PerCpuArray::pinned(sock_stat::COUNT, 0);

#[inline(always)]
pub fn count_sock(stat: u32) {
    if let Some(counter) = SOCK_STATS.get_ptr_mut(stat) {
        // Per-CPU slot: no other CPU writes it, a plain add is enough.
        unsafe { *counter += 1 };
    }
}
