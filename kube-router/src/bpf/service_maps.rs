//! Reading and writing the pinned service, conntrack and stats maps.
use std::{collections::BTreeMap, path::Path};

use ipnet::Ipv4Net;

use anyhow::{Context, Result};
use aya::maps::{
    lpm_trie::{Key, LpmTrie},
    HashMap, Map, MapData, MapError, PerCpuArray,
};
use kube_router_common::*;

use crate::services::{
    compile::{MapContents, SourceRange},
    diff::MapOp,
    sync::{MapWriteError, ServiceMaps},
};

fn open(pin_dir: &Path, name: &str) -> Result<MapData> {
    let path = super::pinned_map(pin_dir, name);
    MapData::from_pin(&path).with_context(|| format!("opening pinned map {}", path.display()))
}

fn open_hash<K: aya::Pod, V: aya::Pod>(pin_dir: &Path, name: &str) -> Result<HashMap<MapData, K, V>> {
    let data = open(pin_dir, name)?;
    let map = match name {
        map_names::CONNTRACK | map_names::AFFINITY => Map::LruHashMap(data),
        _ => Map::HashMap(data),
    };
    Ok(HashMap::try_from(map)?)
}

/// The service maps the control plane writes.
pub struct BpfServiceMaps {
    services: HashMap<MapData, ServiceKeyV4, ServiceValue>,
    slots: HashMap<MapData, BackendSlotKey, BackendSlotValue>,
    backends: HashMap<MapData, u32, BackendV4>,
    source_ranges: LpmTrie<MapData, SourceRangeKeyV4, u8>,
    stats: super::svc_stats::SvcStatsMap,
}

fn source_range_key(range: &SourceRange) -> Key<SourceRangeKeyV4> {
    let data = SourceRangeKeyV4 { service_id: range.service_id.to_be(), addr: range.addr };
    Key::new(32 + u32::from(range.prefix_len), data)
}

fn source_range_of(key: &Key<SourceRangeKeyV4>) -> SourceRange {
    let data = key.data();
    let prefix_len = key.prefix_len().saturating_sub(32).min(32) as u8;
    SourceRange { service_id: u32::from_be(data.service_id), addr: data.addr, prefix_len }
}

impl BpfServiceMaps {
    pub fn open_pinned(pin_dir: &Path) -> Result<Self> {
        let mut maps = Self {
            services: open_hash(pin_dir, map_names::SERVICES)?,
            slots: open_hash(pin_dir, map_names::BACKEND_SLOTS)?,
            backends: open_hash(pin_dir, map_names::BACKENDS)?,
            source_ranges: LpmTrie::try_from(Map::LpmTrie(open(pin_dir, map_names::SOURCE_RANGES)?))?,
            stats: super::svc_stats::SvcStatsMap::open_pinned(pin_dir)?,
        };
        // Frontends programmed before the counters existed (an upgrade) get them now.
        let frontends: Vec<ServiceKeyV4> = maps.services.keys().collect::<Result<_, _>>()?;
        maps.stats.ensure(&frontends)?;
        Ok(maps)
    }

    /// Before a frontend is written: a new one, or one handed to another backend set, starts
    /// from zeroed counters. Not fatal: the frontend matters more than its counters.
    fn reset_stats(&mut self, key: &ServiceKeyV4, value: &ServiceValue) {
        let same = self.services.get(key, 0).is_ok_and(|old| old.service_id == value.service_id);
        if !same {
            if let Err(e) = self.stats.reset(key) {
                tracing::warn!(error = %e, "cannot reset a frontend's counters in svc_stats_v4");
            }
        }
    }
}

pub(crate) fn write_error(map: &'static str, error: MapError) -> MapWriteError {
    let full = matches!(&error, MapError::SyscallError(e) if matches!(e.io_error.raw_os_error(), Some(libc::E2BIG) | Some(libc::ENOMEM)));
    MapWriteError { map, message: error.to_string(), full }
}

fn read_hash<K: aya::Pod + Ord, V: aya::Pod>(
    map: &HashMap<MapData, K, V>,
    name: &'static str,
) -> Result<std::collections::BTreeMap<K, V>, MapWriteError> {
    map.iter().map(|entry| entry.map_err(|e| write_error(name, e))).collect()
}

impl ServiceMaps for BpfServiceMaps {
    fn write(&mut self, op: &MapOp) -> Result<(), MapWriteError> {
        let name = op.map_name();
        let result = match op {
            MapOp::PutBackend(k, v) => self.backends.insert(k, v, 0),
            MapOp::PutSlot(k, v) => self.slots.insert(k, v, 0),
            MapOp::PutService(k, v) => {
                self.reset_stats(k, v);
                self.services.insert(k, v, 0)
            }
            MapOp::DeleteService(k) => {
                let removed = self.services.remove(k);
                if let Err(e) = self.stats.remove(k) {
                    tracing::warn!(error = %e, "cannot remove a frontend's counters from svc_stats_v4");
                }
                removed
            }
            MapOp::DeleteSlot(k) => self.slots.remove(k),
            MapOp::DeleteBackend(k) => self.backends.remove(k),
            MapOp::PutSourceRange(k) => self.source_ranges.insert(&source_range_key(k), 1, 0),
            MapOp::DeleteSourceRange(k) => self.source_ranges.remove(&source_range_key(k)),
        };
        // A delete of a key that is already gone leaves the map as wanted.
        match result {
            Err(MapError::SyscallError(e)) if op.is_delete() && e.io_error.raw_os_error() == Some(libc::ENOENT) => {
                Ok(())
            }
            other => other.map_err(|e| write_error(name, e)),
        }
    }

    fn read_all(&self) -> Result<MapContents, MapWriteError> {
        Ok(MapContents {
            services: read_hash(&self.services, map_names::SERVICES)?,
            slots: read_hash(&self.slots, map_names::BACKEND_SLOTS)?,
            backends: read_hash(&self.backends, map_names::BACKENDS)?,
            source_ranges: self
                .source_ranges
                .iter()
                .map(|entry| {
                    entry.map(|(k, v)| (source_range_of(&k), v)).map_err(|e| write_error(map_names::SOURCE_RANGES, e))
                })
                .collect::<Result<_, _>>()?,
        })
    }
}

/// Writes the node settings the datapath reads (`lb_config`), only if they differ.
pub fn write_lb_config(pin_dir: &Path, config: &LbConfig) -> Result<()> {
    let mut map: aya::maps::Array<MapData, LbConfig> =
        aya::maps::Array::try_from(Map::Array(open(pin_dir, map_names::LB_CONFIG)?))?;
    if map.get(&0, 0)? != *config {
        map.set(0, config, 0)?;
    }
    Ok(())
}

/// Brings `cluster_nets_v4` to `desired` (prefix -> `CLUSTER_NET_*` flags), writing only the
/// differences; returns the number of writes.
pub fn sync_cluster_nets(pin_dir: &Path, desired: &BTreeMap<Ipv4Net, u32>) -> Result<usize> {
    use aya::maps::lpm_trie::{Key, LpmTrie};
    let mut map: LpmTrie<MapData, u32, u32> = LpmTrie::try_from(Map::LpmTrie(open(pin_dir, map_names::CLUSTER_NETS)?))?;
    let key = |net: &Ipv4Net| Key::new(u32::from(net.prefix_len()), u32::from_ne_bytes(net.network().octets()));
    let current: BTreeMap<Ipv4Net, u32> = map
        .iter()
        .filter_map(Result::ok)
        .filter_map(|(k, v)| {
            let addr = std::net::Ipv4Addr::from(k.data().to_ne_bytes());
            Ipv4Net::new(addr, k.prefix_len() as u8).ok().map(|net| (net, v))
        })
        .collect();
    let mut writes = 0;
    for (net, flags) in desired {
        if current.get(net) != Some(flags) {
            map.insert(&key(net), flags, 0)?;
            writes += 1;
        }
    }
    for net in current.keys().filter(|net| !desired.contains_key(*net)) {
        map.remove(&key(net))?;
        writes += 1;
    }
    Ok(writes)
}

/// Sums the per-CPU packet counters of `lb_stats`, in `lb_stat` index order.
pub fn read_lb_stats(pin_dir: &Path) -> Result<Vec<u64>> {
    let stats: PerCpuArray<MapData, u64> =
        PerCpuArray::try_from(Map::PerCpuArray(open(pin_dir, map_names::LB_STATS)?))?;
    (0..lb_stat::COUNT).map(|i| Ok(stats.get(&i, 0)?.iter().sum())).collect()
}

pub struct Conntrack {
    map: HashMap<MapData, CtKeyV4, CtValueV4>,
}

pub(crate) fn monotonic_now_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: plain syscall writing into a local timespec. bpf_ktime_get_ns is CLOCK_MONOTONIC.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

impl Conntrack {
    pub fn open_pinned(pin_dir: &Path) -> Result<Self> {
        Ok(Self { map: open_hash(pin_dir, map_names::CONNTRACK)? })
    }

    pub fn entries(&self) -> Result<Vec<(CtKeyV4, CtValueV4)>> {
        Ok(self.map.iter().collect::<Result<_, _>>()?)
    }

    /// Active GC: removes entries idle past their lifetime, so the LRU never has to evict live
    /// flows to make room for new ones. Returns (entries left, entries removed).
    pub fn collect_garbage(&mut self) -> Result<(usize, usize)> {
        let now = monotonic_now_ns();
        // One pass over the map: count every entry and pick the expired ones.
        let mut total = 0;
        let mut expired: Vec<CtKeyV4> = Vec::new();
        for (key, value) in self.map.iter().filter_map(Result::ok) {
            total += 1;
            if now.saturating_sub(value.last_seen_ns) > value.lifetime_ns(key.proto) {
                expired.push(key);
            }
        }
        let mut removed = 0;
        for key in &expired {
            if self.map.remove(key).is_ok() {
                removed += 1;
            }
        }
        Ok((total - removed, removed))
    }
}
