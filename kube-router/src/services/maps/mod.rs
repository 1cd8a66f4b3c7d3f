//! The load balancer's maps: reading and writing the frontends, backends and source ranges
//! (`FamilyServiceMaps`), its settings (`lb_config`) and counters (`lb_stats`); its conntrack
//! (`conntrack`), per-Service counters (`stats`) and the gate in front of the conntrack lookup
//! (`gate`) each in their own module.
use std::path::Path;

use anyhow::Result;
use aya::{
    maps::{
        lpm_trie::{Key, LpmTrie},
        HashMap, IterableMap, Map, MapData, MapError,
    },
    sys::SyscallError,
};
use kube_router_common::*;

pub mod conntrack;
pub mod gate;
pub mod stats;

use crate::services::{
    compile::{MapContents, SourceRange},
    diff::MapOp,
    family::{AddressFamily, V4, V6},
    sync::{BatchOutcome, MapWriteError, ServiceMaps},
};

use crate::pinned::{
    batch::{update_batch, BatchWrite},
    open_pinned as open, write_error,
};

pub(super) fn open_hash<K: aya::Pod, V: aya::Pod>(pin_dir: &Path, name: &str) -> Result<HashMap<MapData, K, V>> {
    let data = open(pin_dir, name)?;
    let map = match name {
        map_names::CONNTRACK | map_names::AFFINITY | map_names::CONNTRACK_V6 | map_names::AFFINITY_V6 => {
            Map::LruHashMap(data)
        }
        _ => Map::HashMap(data),
    };
    Ok(HashMap::try_from(map)?)
}

/// One family's service maps the control plane writes (`svc_v4`, `svc_slots_v4`,
/// `backends_v4`, `lb_src_v4`, `svc_stats_v4`, or their `_v6` twins).
pub struct FamilyServiceMaps<F: AddressFamily>
where
    ServiceKey<F::Words>: aya::Pod,
{
    services: HashMap<MapData, ServiceKey<F::Words>, ServiceValue>,
    slots: HashMap<MapData, BackendSlotKey, BackendSlotValue>,
    backends: HashMap<MapData, u32, Backend<F::Words>>,
    source_ranges: LpmTrie<MapData, SourceRangeKey<F::Words>, u8>,
    stats: stats::FamilySvcStats<F>,
    /// A counter reset failed and was said: once, not for every frontend of every sync (the
    /// counters map fills with the frontends map, whose refusals are logged and counted).
    stats_reset_warned: bool,
    /// Puts into the hash maps go in batches (`KUBE_ROUTER_MAP_BATCHES=off`: one by one, for
    /// comparisons).
    batch_writes: bool,
    /// Changed after a frontend is put: a tuple remembered as plain traffic may go to it now.
    plain: crate::pinned::plain::PlainGeneration,
}

/// The IPv4 service maps.
pub type BpfServiceMaps = FamilyServiceMaps<V4>;
/// The IPv6 service maps.
pub type BpfServiceMapsV6 = FamilyServiceMaps<V6>;

fn source_range_key<W: Copy>(range: &SourceRange<W>) -> Key<SourceRangeKey<W>>
where
    SourceRangeKey<W>: aya::Pod,
{
    let data = SourceRangeKey { service_id: range.service_id.to_be(), addr: range.addr };
    Key::new(32 + u32::from(range.prefix_len), data)
}

fn source_range_of<W: Copy>(key: &Key<SourceRangeKey<W>>) -> SourceRange<W>
where
    SourceRangeKey<W>: aya::Pod,
{
    let data = key.data();
    let bits = 8 * std::mem::size_of::<W>() as u32;
    let prefix_len = key.prefix_len().saturating_sub(32).min(bits) as u8;
    SourceRange { service_id: u32::from_be(data.service_id), addr: data.addr, prefix_len }
}

impl<F: AddressFamily> FamilyServiceMaps<F>
where
    ServiceKey<F::Words>: aya::Pod,
    Backend<F::Words>: aya::Pod,
    SourceRangeKey<F::Words>: aya::Pod,
{
    pub fn open_pinned(pin_dir: &Path) -> Result<Self> {
        Ok(Self {
            services: open_hash(pin_dir, F::MAPS.services)?,
            slots: open_hash(pin_dir, F::MAPS.slots)?,
            backends: open_hash(pin_dir, F::MAPS.backends)?,
            source_ranges: LpmTrie::try_from(Map::LpmTrie(open(pin_dir, F::MAPS.source_ranges)?))?,
            stats: stats::FamilySvcStats::open_pinned(pin_dir)?,
            stats_reset_warned: false,
            batch_writes: std::env::var("KUBE_ROUTER_MAP_BATCHES").map_or(true, |v| v != "off"),
            plain: crate::pinned::plain::PlainGeneration::open(pin_dir),
        })
    }

    /// Puts into the hash maps in batches (`true`, the default) or one by one.
    pub fn with_batches(mut self, batches: bool) -> Self {
        self.batch_writes = batches;
        self
    }

    /// Before a frontend is written: a new one, or one handed to another backend set, starts
    /// from zeroed counters. Not fatal: the frontend matters more than its counters.
    fn reset_stats(&mut self, key: &ServiceKey<F::Words>, value: &ServiceValue) {
        let same = self.services.get(key, 0).is_ok_and(|old| old.service_id == value.service_id);
        self.reset_stats_unless(same, key);
    }

    fn reset_stats_unless(&mut self, same: bool, key: &ServiceKey<F::Words>) {
        if !same {
            match self.stats.remove(key) {
                Err(e) if !self.stats_reset_warned => {
                    tracing::warn!(error = %e, map = F::MAPS.stats, "cannot reset a frontend's counters (said once)");
                    self.stats_reset_warned = true;
                }
                Err(e) => tracing::debug!(error = %e, map = F::MAPS.stats, "cannot reset a frontend's counters"),
                Ok(()) => {}
            }
        }
    }
}

/// One batch into `map`, if every one of the `expected` writes was a put into it.
/// The keys and values of a run of puts into one map; `None` if one of `ops` is of another kind.
fn puts_of<O, K, V>(ops: &[O], put: impl Fn(&O) -> Option<(K, V)>) -> Option<(Vec<K>, Vec<V>)> {
    let (keys, values): (Vec<K>, Vec<V>) = ops.iter().filter_map(put).unzip();
    (keys.len() == ops.len()).then_some((keys, values))
}

fn batch_of<K: aya::Pod, V: aya::Pod>(map: &HashMap<MapData, K, V>, keys: &[K], values: &[V]) -> BatchWrite {
    update_batch(IterableMap::map(map), keys, values)
}

fn read_hash<K: aya::Pod + Ord, V: aya::Pod>(
    map: &HashMap<MapData, K, V>,
    name: &'static str,
) -> Result<std::collections::BTreeMap<K, V>, MapWriteError> {
    map.iter().map(|entry| entry.map_err(|e| write_error(name, e))).collect()
}

impl<F: AddressFamily> ServiceMaps<F> for FamilyServiceMaps<F>
where
    ServiceKey<F::Words>: aya::Pod,
    Backend<F::Words>: aya::Pod,
    SourceRangeKey<F::Words>: aya::Pod,
{
    fn write(&mut self, op: &MapOp<F>) -> Result<(), MapWriteError> {
        let name = op.map_name();
        let result = match op {
            MapOp::PutBackend(k, v) => self.backends.insert(k, v, 0),
            MapOp::PutSlot(k, v) => self.slots.insert(k, v, 0),
            MapOp::PutService(k, v) => {
                self.reset_stats(k, v);
                let put = self.services.insert(k, v, 0);
                self.plain.forget_all();
                put
            }
            MapOp::DeleteService(k) => {
                let removed = self.services.remove(k);
                if let Err(e) = self.stats.remove(k) {
                    tracing::warn!(error = %e, map = F::MAPS.stats, "cannot remove a frontend's counters");
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

    fn batches(&self, op: &MapOp<F>) -> bool {
        self.batch_writes && matches!(op, MapOp::PutBackend(..) | MapOp::PutSlot(..) | MapOp::PutService(..))
    }

    fn write_batch(&mut self, ops: &[MapOp<F>], programmed: &MapContents<F>) -> Option<BatchOutcome> {
        let name = ops.first()?.map_name();
        let written = match ops[0] {
            MapOp::PutBackend(..) => {
                let (keys, values) =
                    puts_of(ops, |op| if let MapOp::PutBackend(k, v) = op { Some((*k, *v)) } else { None })?;
                batch_of(&self.backends, &keys, &values)
            }
            MapOp::PutSlot(..) => {
                let (keys, values) =
                    puts_of(ops, |op| if let MapOp::PutSlot(k, v) = op { Some((*k, *v)) } else { None })?;
                batch_of(&self.slots, &keys, &values)
            }
            MapOp::PutService(..) => {
                let (keys, values) =
                    puts_of(ops, |op| if let MapOp::PutService(k, v) = op { Some((*k, *v)) } else { None })?;
                // Each frontend's counters reset before it is written, as one by one (the
                // model, which is what the map holds, says which are new: no lookup); one the
                // batch then refuses had its counters zeroed a sync early, nothing more.
                for (k, v) in keys.iter().zip(&values) {
                    let same = programmed.services.get(k).is_some_and(|old| old.service_id == v.service_id);
                    self.reset_stats_unless(same, k);
                }
                let written = batch_of(&self.services, &keys, &values);
                self.plain.forget_all();
                written
            }
            _ => return None,
        };
        match written {
            BatchWrite::Unsupported => None,
            BatchWrite::Written { done, error } => Some(BatchOutcome {
                done,
                error: error.map(|io_error| {
                    write_error(name, MapError::SyscallError(SyscallError { call: "bpf_map_update_batch", io_error }))
                }),
            }),
        }
    }

    fn read_all(&self) -> Result<MapContents<F>, MapWriteError> {
        Ok(MapContents {
            services: read_hash(&self.services, F::MAPS.services)?,
            slots: read_hash(&self.slots, F::MAPS.slots)?,
            backends: read_hash(&self.backends, F::MAPS.backends)?,
            source_ranges: self
                .source_ranges
                .iter()
                .map(|entry| {
                    entry.map(|(k, v)| (source_range_of(&k), v)).map_err(|e| write_error(F::MAPS.source_ranges, e))
                })
                .collect::<Result<_, _>>()?,
        })
    }
}

/// Writes the node settings the datapath reads (`lb_config`), only if they differ.
pub fn write_lb_config(pin_dir: &Path, config: &LbConfig) -> Result<()> {
    write_setting(pin_dir, map_names::LB_CONFIG, config)
}

/// Writes entry 0 of the one-entry array `name`, only if it differs.
pub(super) fn write_setting<V: aya::Pod + PartialEq>(pin_dir: &Path, name: &str, value: &V) -> Result<()> {
    let mut map: aya::maps::Array<MapData, V> = aya::maps::Array::try_from(Map::Array(open(pin_dir, name)?))?;
    if map.get(&0, 0)? != *value {
        map.set(0, value, 0)?;
        // The load balancer's settings decide what its gate lets pass.
        crate::pinned::plain::forget_all(pin_dir);
    }
    Ok(())
}

/// Sums the per-CPU packet counters of `lb_stats`, in `lb_stat` index order.
pub fn read_lb_stats(pin_dir: &Path) -> Result<Vec<u64>> {
    crate::pinned::counters::read_pinned(pin_dir, map_names::LB_STATS, lb_stat::COUNT)
}
