//! Reading and writing the pinned service, conntrack and stats maps.
use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
};

use ipnet::Ipv4Net;

use anyhow::Result;
use aya::maps::{
    lpm_trie::{Key, LpmTrie},
    HashMap, Map, MapData, MapError,
};
use kube_router_common::*;

use crate::services::{
    compile::{MapContents, SourceRange},
    departures::{departed, Departure},
    diff::MapOp,
    family::{AddressFamily, V4, V6},
    sync::{MapWriteError, ServiceMaps},
};

use super::{open_pinned as open, write_error};

fn open_hash<K: aya::Pod, V: aya::Pod>(pin_dir: &Path, name: &str) -> Result<HashMap<MapData, K, V>> {
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
    stats: super::svc_stats::FamilySvcStats<F>,
    /// A counter reset failed and was said: once, not for every frontend of every sync (the
    /// counters map fills with the frontends map, whose refusals are logged and counted).
    stats_reset_warned: bool,
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
            stats: super::svc_stats::FamilySvcStats::open_pinned(pin_dir)?,
            stats_reset_warned: false,
        })
    }

    /// Before a frontend is written: a new one, or one handed to another backend set, starts
    /// from zeroed counters. Not fatal: the frontend matters more than its counters.
    fn reset_stats(&mut self, key: &ServiceKey<F::Words>, value: &ServiceValue) {
        let same = self.services.get(key, 0).is_ok_and(|old| old.service_id == value.service_id);
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
                self.services.insert(k, v, 0)
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
fn write_setting<V: aya::Pod + PartialEq>(pin_dir: &Path, name: &str, value: &V) -> Result<()> {
    let mut map: aya::maps::Array<MapData, V> = aya::maps::Array::try_from(Map::Array(open(pin_dir, name)?))?;
    if map.get(&0, 0)? != *value {
        map.set(0, value, 0)?;
    }
    Ok(())
}

/// Writes the load balancer conntrack's lifetimes (`ct_cfg`), only if they differ. The pinned
/// entry follows the running agent's flags: all zero (the built-in defaults) when none is given.
pub fn write_ct_lifetimes(pin_dir: &Path, lifetimes: &CtLifetimes) -> Result<()> {
    write_setting(pin_dir, map_names::CT_LIFETIMES, lifetimes)
}

/// The GC's verdict on a Service conntrack entry at `now`: idle past its lifetime.
fn expired_at<A: Copy>(lifetimes: Option<CtLifetimes>) -> impl Fn(&CtKey<A>, &CtValue<A>, u64) -> bool {
    move |key, value, now| now.saturating_sub(value.last_seen_ns) > value.lifetime_ns(key.proto, lifetimes.as_ref())
}

/// The lifetimes the datapath reads now (`ct_cfg`): `None` when the map is absent (a datapath
/// from before it), which is the built-in defaults, as in the datapath.
pub fn read_ct_lifetimes(pin_dir: &Path) -> Result<Option<CtLifetimes>> {
    if !super::pinned_map(pin_dir, map_names::CT_LIFETIMES).exists() {
        return Ok(None);
    }
    let map: aya::maps::Array<MapData, CtLifetimes> =
        aya::maps::Array::try_from(Map::Array(open(pin_dir, map_names::CT_LIFETIMES)?))?;
    Ok(Some(map.get(&0, 0)?))
}

/// Brings `cluster_nets_v4` to `desired` (prefix -> `CLUSTER_NET_*` flags), writing only the
/// differences; returns the number of writes.
pub fn sync_cluster_nets(pin_dir: &Path, desired: &BTreeMap<Ipv4Net, u32>) -> Result<usize> {
    sync_cluster_nets_of::<V4>(pin_dir, desired)
}

/// [`sync_cluster_nets`] for family `F` (`cluster_nets_v4` / `cluster_nets_v6`).
pub fn sync_cluster_nets_of<F: AddressFamily>(pin_dir: &Path, desired: &BTreeMap<F::Net, u32>) -> Result<usize>
where
    F::Words: aya::Pod,
{
    use aya::maps::lpm_trie::{Key, LpmTrie};
    let mut map: LpmTrie<MapData, F::Words, u32> =
        LpmTrie::try_from(Map::LpmTrie(open(pin_dir, F::MAPS.cluster_nets)?))?;
    let key = |net: &F::Net| Key::new(u32::from(F::net_prefix_len(*net)), F::words(F::net_addr(*net)));
    let current: BTreeMap<F::Net, u32> = map
        .iter()
        .filter_map(Result::ok)
        .filter_map(|(k, v)| {
            let addr: std::net::IpAddr = F::addr_from_words(k.data()).into();
            let net = ipnet::IpNet::new(addr, k.prefix_len() as u8).ok()?;
            F::net_of(net).map(|net| (net, v))
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

/// Writes `changes` (flags 0: no longer inside) into `cluster_nets_v4` / `cluster_nets_v6`,
/// without reading the map: for a writer that knows what it holds. Returns the writes.
pub fn write_cluster_nets_of<F: AddressFamily>(pin_dir: &Path, changes: &BTreeMap<F::Net, u32>) -> Result<usize>
where
    F::Words: aya::Pod,
{
    use aya::maps::lpm_trie::{Key, LpmTrie};
    if changes.is_empty() {
        return Ok(0);
    }
    let mut map: LpmTrie<MapData, F::Words, u32> =
        LpmTrie::try_from(Map::LpmTrie(open(pin_dir, F::MAPS.cluster_nets)?))?;
    for (net, flags) in changes {
        let key = Key::new(u32::from(F::net_prefix_len(*net)), F::words(F::net_addr(*net)));
        match flags {
            0 => map.remove(&key)?,
            flags => map.insert(&key, flags, 0)?,
        }
    }
    Ok(changes.len())
}

/// Sums the per-CPU packet counters of `lb_stats`, in `lb_stat` index order.
pub fn read_lb_stats(pin_dir: &Path) -> Result<Vec<u64>> {
    super::counters::read_pinned(pin_dir, map_names::LB_STATS, lb_stat::COUNT)
}

/// One family's Service conntrack (`ct_v4` / `ct_v6`).
pub struct FamilyConntrack<F: AddressFamily> {
    map: HashMap<MapData, CtKey<F::Words>, CtValue<F::Words>>,
    /// Where `ct_cfg` is read from at each collection, so the GC judges entries by the lifetimes
    /// the datapath uses now.
    pin_dir: std::path::PathBuf,
}

/// One conntrack entry of family `F`.
pub type CtEntry<F> = (CtKey<<F as AddressFamily>::Words>, CtValue<<F as AddressFamily>::Words>);

/// The IPv4 Service conntrack.
pub type Conntrack = FamilyConntrack<V4>;
/// The IPv6 Service conntrack.
pub type ConntrackV6 = FamilyConntrack<V6>;

impl<F: AddressFamily> FamilyConntrack<F>
where
    CtKey<F::Words>: aya::Pod,
    CtValue<F::Words>: aya::Pod,
{
    pub fn open_pinned(pin_dir: &Path) -> Result<Self> {
        Ok(Self { map: open_hash(pin_dir, F::MAPS.conntrack)?, pin_dir: pin_dir.to_path_buf() })
    }

    pub fn entries(&self) -> Result<Vec<CtEntry<F>>> {
        Ok(self.map.iter().collect::<Result<_, _>>()?)
    }

    /// Active GC: removes entries idle past their lifetime, so the LRU never has to evict live
    /// flows to make room for new ones. Returns (entries left, entries removed).
    pub fn collect_garbage(&mut self) -> Result<(usize, usize)> {
        self.collect_garbage_at(super::conntrack_gc::monotonic_now_ns())
    }

    /// `collect_garbage` as if the clock read `now` (tests: entries older than the machine's
    /// uptime cannot be written otherwise).
    pub fn collect_garbage_at(&mut self, now: u64) -> Result<(usize, usize)> {
        let lifetimes = read_ct_lifetimes(&self.pin_dir)?;
        Ok(super::conntrack_gc::collect_expired(&mut self.map, now, expired_at(lifetimes)))
    }

    /// `collect_garbage_at`'s walk alone: (entries, keys of the expired ones).
    pub fn expired_keys_at(&self, now: u64) -> Result<(usize, Vec<CtKey<F::Words>>)> {
        let lifetimes = read_ct_lifetimes(&self.pin_dir)?;
        Ok(super::conntrack_gc::expired_keys(&self.map, now, expired_at(lifetimes)))
    }

    /// `collect_garbage_at`'s removals alone, of the keys its walk found (`expired_keys_at`):
    /// those still expired. Returns how many.
    pub fn remove_expired_at(&mut self, keys: &[CtKey<F::Words>], now: u64) -> Result<usize> {
        let lifetimes = read_ct_lifetimes(&self.pin_dir)?;
        Ok(super::conntrack_gc::remove_expired(&mut self.map, keys, now, expired_at(lifetimes)))
    }
}

impl<F: AddressFamily> FamilyConntrack<F>
where
    CtKey<F::Words>: aya::Pod,
    CtValue<F::Words>: aya::Pod,
{
    /// Removes the flows `departures` moves (see `services::departures`): each one's forward
    /// entry, and its reverse entry when that still belongs to it, so the next datagram is
    /// balanced again. One walk of the table however many departures. Returns the flows removed.
    pub fn purge_departed(&mut self, departures: &BTreeSet<Departure<F::Words>>) -> Result<usize> {
        if departures.is_empty() {
            return Ok(0);
        }
        let flows: Vec<CtEntry<F>> =
            self.map.iter().filter_map(Result::ok).filter(|(key, value)| departed(key, value, departures)).collect();
        let mut removed = 0;
        for (key, value) in &flows {
            // The reverse first, as the datapath's `conntrack::forget`: a reply never finds an
            // entry whose forward half is gone. Another flow's entry on that tuple stays.
            let reverse = value.reverse_key(key.proto);
            if self.map.get(&reverse, 0).is_ok_and(|r| r.reverse_key(key.proto) == *key) {
                let _ = self.map.remove(&reverse);
            }
            // Gone already (expired, evicted, or the datapath re-balanced it): nothing to count.
            if self.map.remove(key).is_ok() {
                removed += 1;
            }
        }
        Ok(removed)
    }
}
