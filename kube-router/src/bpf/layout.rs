//! The expected layout of every pinned map, checked before the datapath is loaded so that a
//! layout change is reported instead of the program silently using a map it cannot read.
//! `layout_tests.rs` holds these specs to the maps the embedded object declares.
use std::path::Path;

use aya::maps::{lpm_trie::Key, MapInfo, MapType};
use kube_router_common::*;

#[derive(Clone, Copy, Debug)]
pub struct MapSpec {
    pub name: &'static str,
    pub map_type: MapType,
    pub key_size: u32,
    pub value_size: u32,
    pub max_entries: u32,
    /// `BPF_F_*` creation flags: a map re-created with other flags (preallocation, a per-CPU
    /// LRU) behaves differently though its shape is the same, so they are part of the layout.
    pub map_flags: u32,
}

/// `BPF_F_NO_PREALLOC`: entries allocated on insert. LPM tries require it (aya-ebpf sets it on
/// every trie); hash maps that are mostly empty use it to save their preallocated memory.
pub const BPF_F_NO_PREALLOC: u32 = 1;

const fn spec<K, V>(name: &'static str, map_type: MapType, max_entries: u32) -> MapSpec {
    let map_flags = if matches!(map_type, MapType::LpmTrie) { BPF_F_NO_PREALLOC } else { 0 };
    MapSpec {
        name,
        map_type,
        key_size: size_of::<K>() as u32,
        value_size: size_of::<V>() as u32,
        max_entries,
        map_flags,
    }
}

impl MapSpec {
    const fn not_preallocated(self) -> MapSpec {
        MapSpec { map_flags: self.map_flags | BPF_F_NO_PREALLOC, ..self }
    }
}

pub const SERVICE_MAPS: &[MapSpec] = &[
    spec::<ServiceKeyV4, ServiceValue>(map_names::SERVICES, MapType::Hash, SERVICES_MAX_ENTRIES),
    spec::<BackendSlotKey, BackendSlotValue>(map_names::BACKEND_SLOTS, MapType::Hash, BACKEND_SLOTS_MAX_ENTRIES),
    spec::<u32, BackendV4>(map_names::BACKENDS, MapType::Hash, BACKENDS_MAX_ENTRIES),
    spec::<CtKeyV4, CtValueV4>(map_names::CONNTRACK, MapType::LruHash, CONNTRACK_MAX_ENTRIES),
    spec::<AffinityKeyV4, AffinityValue>(map_names::AFFINITY, MapType::LruHash, AFFINITY_MAX_ENTRIES),
    spec::<u32, u64>(map_names::LB_STATS, MapType::PerCpuArray, lb_stat::COUNT),
    spec::<u32, u32>(map_names::META, MapType::Array, META_MAX_ENTRIES),
    spec::<u32, LbConfig>(map_names::LB_CONFIG, MapType::Array, 1),
    spec::<FragKeyV4, FragPorts>(map_names::FRAGMENTS, MapType::LruHash, FRAGMENTS_MAX_ENTRIES),
    spec::<Key<u32>, u32>(map_names::CLUSTER_NETS, MapType::LpmTrie, CLUSTER_NETS_MAX_ENTRIES),
    spec::<ServiceKeyV6, ServiceValue>(map_names::SERVICES_V6, MapType::Hash, SERVICES_MAX_ENTRIES),
    spec::<BackendSlotKey, BackendSlotValue>(map_names::BACKEND_SLOTS_V6, MapType::Hash, BACKEND_SLOTS_MAX_ENTRIES),
    spec::<u32, BackendV6>(map_names::BACKENDS_V6, MapType::Hash, BACKENDS_MAX_ENTRIES),
    spec::<CtKeyV6, CtValueV6>(map_names::CONNTRACK_V6, MapType::LruHash, CONNTRACK_MAX_ENTRIES),
    spec::<AffinityKeyV6, AffinityValue>(map_names::AFFINITY_V6, MapType::LruHash, AFFINITY_MAX_ENTRIES),
    spec::<FragKeyV6, FragPorts>(map_names::FRAGMENTS_V6, MapType::LruHash, FRAGMENTS_MAX_ENTRIES),
    spec::<Key<Ipv6Words>, u32>(map_names::CLUSTER_NETS_V6, MapType::LpmTrie, CLUSTER_NETS_MAX_ENTRIES),
    spec::<Key<SourceRangeKeyV4>, u8>(map_names::SOURCE_RANGES, MapType::LpmTrie, SOURCE_RANGES_MAX_ENTRIES),
    spec::<Key<SourceRangeKeyV6>, u8>(map_names::SOURCE_RANGES_V6, MapType::LpmTrie, SOURCE_RANGES_MAX_ENTRIES),
    spec::<ServiceKeyV4, ServiceStats>(svc_stats_map_names::SVC_STATS, MapType::PerCpuHash, SVC_STATS_MAX_ENTRIES)
        .not_preallocated(),
    spec::<ServiceKeyV6, ServiceStats>(svc_stats_map_names::SVC_STATS_V6, MapType::PerCpuHash, SVC_STATS_MAX_ENTRIES)
        .not_preallocated(),
    spec::<ServiceKeyV4, u64>(map_names::CT_GATE, MapType::LruHash, CT_GATE_MAX_ENTRIES),
    spec::<ServiceKeyV6, u64>(map_names::CT_GATE_V6, MapType::LruHash, CT_GATE_MAX_ENTRIES),
    // A map of its own, created when absent (no layout change): the configured lifetimes.
    spec::<u32, CtLifetimes>(map_names::CT_LIFETIMES, MapType::Array, 1),
];

/// The NetworkPolicy maps. `pol_ports` and `pol_peers_v4/v6` keys are aya's LPM `Key` (u32 prefix
/// length + data).
pub const POLICY_MAPS: &[MapSpec] = &[
    spec::<PolicyPodKeyV4, PolicyPodValue>(map_names::POLICY_PODS, MapType::Hash, POLICY_PODS_MAX_ENTRIES),
    spec::<Key<PolicyPortKey>, PolicyPortValue>(map_names::POLICY_PORTS, MapType::LpmTrie, POLICY_PORTS_MAX_ENTRIES),
    spec::<Key<PeerPrefixV4>, u8>(map_names::POLICY_PEERS, MapType::LpmTrie, POLICY_PEERS_MAX_ENTRIES),
    spec::<PolicyCtKeyV4, PolicyCtValue>(map_names::POLICY_CONNTRACK, MapType::LruHash, POLICY_CONNTRACK_MAX_ENTRIES),
    spec::<u32, u64>(map_names::POLICY_STATS, MapType::PerCpuArray, pol_stat::COUNT),
    spec::<PolicyPodKeyV6, PolicyPodValue>(map_names::POLICY_PODS_V6, MapType::Hash, POLICY_PODS_MAX_ENTRIES),
    spec::<Key<PeerPrefixV6>, u8>(map_names::POLICY_PEERS_V6, MapType::LpmTrie, POLICY_PEERS_MAX_ENTRIES),
    spec::<PolicyCtKeyV6, PolicyCtValue>(
        map_names::POLICY_CONNTRACK_V6,
        MapType::LruHash,
        POLICY_CONNTRACK_MAX_ENTRIES,
    ),
];

/// The pod overlay's maps. `ovl_routes_v4` keys are aya's LPM `Key` (u32 prefix length + data).
pub const OVERLAY_MAPS: &[MapSpec] = &[
    spec::<Key<OverlayPrefixV4>, OverlayTunnelV4>(
        map_names::OVERLAY_ROUTES,
        MapType::LpmTrie,
        OVERLAY_ROUTES_MAX_ENTRIES,
    ),
    spec::<u32, OverlayTunnelV4>(map_names::OVERLAY_REMOTES, MapType::Hash, OVERLAY_REMOTES_MAX_ENTRIES),
    spec::<u32, u64>(map_names::OVERLAY_STATS, MapType::PerCpuArray, ovl_stat::COUNT),
];

/// `kube-router monitor`'s maps (see kube_router_common::monitor).
pub const MONITOR_MAPS: &[MapSpec] = &[
    spec::<(), ()>(monitor_map_names::EVENTS, MapType::RingBuf, EVENTS_RING_BYTES),
    spec::<u32, MonitorConfig>(monitor_map_names::EVENTS_CONFIG, MapType::Array, 1),
    spec::<u32, TokenBucket>(monitor_map_names::EVENTS_BUCKET, MapType::PerCpuArray, 1),
    spec::<u32, u64>(monitor_map_names::EVENTS_STATS, MapType::PerCpuArray, event_stat::COUNT),
];

/// The socket load balancer's own maps (it also reads the service maps).
pub const SOCK_MAPS: &[MapSpec] = &[
    spec::<SockReverseKeyV4, SockReverseValueV4>(
        sock_map_names::SOCK_REVERSE,
        MapType::LruHash,
        SOCK_REVERSE_MAX_ENTRIES,
    ),
    spec::<SockReverseKeyV6, SockReverseValueV6>(
        sock_map_names::SOCK_REVERSE_V6,
        MapType::LruHash,
        SOCK_REVERSE_MAX_ENTRIES,
    ),
    spec::<u32, SockLbConfig>(sock_map_names::SOCK_CONFIG, MapType::Array, SOCK_CONFIG_MAX_ENTRIES),
    spec::<u32, u64>(sock_map_names::SOCK_STATS, MapType::PerCpuArray, sock_stat::COUNT),
];

#[derive(Debug, thiserror::Error)]
#[error(
    "pinned map {path} has layout {found} but this agent expects {expected} (map layout version {version}); \
         refusing to load over it. Migrate or remove it with `kube-router cleanup`"
)]
pub struct LayoutMismatch {
    pub path: String,
    pub found: String,
    pub expected: String,
    pub version: u32,
}

fn describe(map_type: &str, key: u32, value: u32, max: u32, flags: u32) -> String {
    format!("{map_type} key={key}B value={value}B max_entries={max} flags={flags:#x}")
}

/// Capacities the operator chooses (`--bpf-lb-map-max`, `--bpf-ct-global-max`). A change
/// against the pinned maps is a layout change of those maps alone: they are re-created at the new
/// size and their entries carried over (see [`super::migrate::Resize`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapSizes {
    /// Service frontends per family; backends and backend slots get four times as many.
    pub lb_frontends: u32,
    /// Connections tracked per family by the load balancer, and by NetworkPolicy.
    pub conntrack: u32,
}

impl Default for MapSizes {
    fn default() -> Self {
        Self { lb_frontends: SERVICES_MAX_ENTRIES, conntrack: CONNTRACK_MAX_ENTRIES }
    }
}

/// Backends and slots per frontend the sizes provide for (today's defaults keep this ratio).
pub const BACKENDS_PER_FRONTEND: u32 = BACKENDS_MAX_ENTRIES / SERVICES_MAX_ENTRIES;

/// Bounds of the size flags: below them a cluster's system Services alone would not fit, above
/// them one map's preallocated memory passes a gigabyte.
pub const LB_FRONTENDS_RANGE: std::ops::RangeInclusive<u32> = 16..=1 << 22;
pub const CONNTRACK_RANGE: std::ops::RangeInclusive<u32> = 1024..=1 << 24;

impl MapSizes {
    /// The size this configuration gives the named map; `None` for maps of a fixed size.
    pub fn max_entries(&self, name: &str) -> Option<u32> {
        match name {
            map_names::SERVICES
            | map_names::SERVICES_V6
            | svc_stats_map_names::SVC_STATS
            | svc_stats_map_names::SVC_STATS_V6 => Some(self.lb_frontends),
            map_names::BACKEND_SLOTS | map_names::BACKEND_SLOTS_V6 | map_names::BACKENDS | map_names::BACKENDS_V6 => {
                Some(self.lb_frontends * BACKENDS_PER_FRONTEND)
            }
            map_names::CONNTRACK
            | map_names::CONNTRACK_V6
            | map_names::POLICY_CONNTRACK
            | map_names::POLICY_CONNTRACK_V6 => Some(self.conntrack),
            _ => None,
        }
    }

    /// Every sized map and its size, for the loader.
    pub fn all(&self) -> impl Iterator<Item = (&'static str, u32)> + '_ {
        all_specs().filter_map(|spec| Some((spec.name, self.max_entries(spec.name)?)))
    }

    pub fn validate(&self) -> Result<(), String> {
        if !LB_FRONTENDS_RANGE.contains(&self.lb_frontends) {
            return Err(format!(
                "--bpf-lb-map-max {} is outside {}..={}",
                self.lb_frontends,
                LB_FRONTENDS_RANGE.start(),
                LB_FRONTENDS_RANGE.end()
            ));
        }
        if !CONNTRACK_RANGE.contains(&self.conntrack) {
            return Err(format!(
                "--bpf-ct-global-max {} is outside {}..={}",
                self.conntrack,
                CONNTRACK_RANGE.start(),
                CONNTRACK_RANGE.end()
            ));
        }
        Ok(())
    }
}

/// The XDP fast path's counters: a map of its own, created beside the others when absent (no
/// layout change for datapaths from before it).
pub const XDP_MAPS: &[MapSpec] = &[spec::<u32, u64>(map_names::XDP_STATS, MapType::PerCpuArray, xdp_stat::COUNT)];

/// The policy programs' drops before judging a flow: a map of its own so `pol_stats` keeps
/// its layout.
pub const POLICY_GUARD_MAPS: &[MapSpec] =
    &[spec::<u32, u64>(map_names::POLICY_GUARD_STATS, MapType::PerCpuArray, pol_guard_stat::COUNT)];

/// The policy conntrack gate's switch (`POLICY_CT_TRACK_ALL`): a map of its own, created when
/// absent (no layout change; absent, the datapath tracks only isolated pods).
pub const POLICY_CONFIG_MAPS: &[MapSpec] = &[spec::<u32, u32>(map_names::POLICY_CONFIG, MapType::Array, 1)];

/// Direct server return's counters: a map of its own for the same reason.
pub const DSR_MAPS: &[MapSpec] = &[spec::<u32, u64>(map_names::DSR_STATS, MapType::PerCpuArray, dsr_stat::COUNT)];

/// The cgroups the socket load balancer never translates (the agent's own): a map of its own
/// for the same reason.
pub const SOCK_EXEMPT_MAPS: &[MapSpec] =
    &[spec::<u64, u64>(sock_map_names::SOCK_EXEMPT, MapType::PerCpuHash, SOCK_EXEMPT_MAX_ENTRIES)];

/// Source-address verification on pod veths: maps of their own for the same reason.
pub const SOURCE_CHECK_MAPS: &[MapSpec] = &[
    spec::<u32, PodSources>(source_check_map_names::POD_SOURCES, MapType::Hash, POD_SOURCES_MAX_ENTRIES),
    spec::<u32, u64>(source_check_map_names::SOURCE_CHECK_STATS, MapType::PerCpuArray, src_stat::COUNT),
];

/// The plain-traffic cache's generation and counters (`kube_router_common::plain`): maps of
/// their own for the same reason. The cache itself is not pinned: what a program remembered is
/// only good for the programs loaded with it.
pub const PLAIN_MAPS: &[MapSpec] = &[
    spec::<u32, u64>(plain_map_names::PLAIN_GENERATION, MapType::Array, 1),
    spec::<u32, u64>(plain_map_names::PLAIN_STATS, MapType::PerCpuArray, plain_stat::COUNT),
];

pub(crate) fn all_specs() -> impl Iterator<Item = &'static MapSpec> {
    SERVICE_MAPS
        .iter()
        .chain(POLICY_MAPS)
        .chain(OVERLAY_MAPS)
        .chain(SOCK_MAPS)
        .chain(MONITOR_MAPS)
        .chain(XDP_MAPS)
        .chain(DSR_MAPS)
        .chain(POLICY_GUARD_MAPS)
        .chain(POLICY_CONFIG_MAPS)
        .chain(SOURCE_CHECK_MAPS)
        .chain(SOCK_EXEMPT_MAPS)
        .chain(PLAIN_MAPS)
}

/// What the pinned maps hold against what this agent expects.
#[derive(Debug, Default)]
pub struct PinnedLayout {
    /// Maps re-used as they are.
    pub adopted: usize,
    /// Maps of the right layout but another size than asked for: (name, pinned size).
    pub resize: Vec<(&'static str, u32)>,
}

/// Checks the maps already pinned in `pin_dir`. Missing maps are fine (they get created). A sized
/// map (see [`MapSizes`]) of another size is listed for resizing when `sizes` is given, adopted
/// at its size otherwise (a tool or test opening the datapath does not choose sizes).
pub fn check_pinned(pin_dir: &Path, sizes: Option<&MapSizes>) -> Result<PinnedLayout, LayoutMismatch> {
    let mut layout = PinnedLayout::default();
    for spec in all_specs() {
        let path = crate::pinned::pinned_map(pin_dir, spec.name);
        if !path.exists() {
            continue;
        }
        let sized = MapSizes::default().max_entries(spec.name).is_some();
        let wanted = sizes.and_then(|s| s.max_entries(spec.name)).unwrap_or(spec.max_entries);
        let mismatch = |found: String| LayoutMismatch {
            path: path.display().to_string(),
            found,
            expected: describe(&format!("{:?}", spec.map_type), spec.key_size, spec.value_size, wanted, spec.map_flags),
            version: LAYOUT_VERSION,
        };
        let info = MapInfo::from_pin(&path).map_err(|e| mismatch(format!("unreadable ({e})")))?;
        let map_type = info.map_type().map(|t| format!("{t:?}")).unwrap_or_else(|_| "unknown".into());
        let same_shape = map_type == format!("{:?}", spec.map_type)
            && info.key_size() == spec.key_size
            && info.value_size() == spec.value_size
            && info.map_flags() == spec.map_flags;
        if !same_shape || (!sized && info.max_entries() != spec.max_entries) {
            let found = describe(&map_type, info.key_size(), info.value_size(), info.max_entries(), info.map_flags());
            return Err(mismatch(found));
        }
        if sized && sizes.is_some() && info.max_entries() != wanted {
            layout.resize.push((spec.name, info.max_entries()));
        } else {
            layout.adopted += 1;
        }
    }
    Ok(layout)
}
