//! The load balancer's conntrack (`ct_v4` / `ct_v6`): reading it, its garbage collection, the
//! flows a backend's departure moves, and the lifetimes the datapath gives entries (`ct_cfg`).
use std::{collections::BTreeSet, path::Path};

use anyhow::Result;
use aya::maps::{HashMap, Map, MapData};
use kube_router_common::*;

use super::{open_hash, write_setting};
use crate::{
    pinned::open_pinned as open,
    services::{
        departures::{departed, Departure},
        family::{AddressFamily, V4, V6},
    },
};

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
    if !crate::pinned::pinned_map(pin_dir, map_names::CT_LIFETIMES).exists() {
        return Ok(None);
    }
    let map: aya::maps::Array<MapData, CtLifetimes> =
        aya::maps::Array::try_from(Map::Array(open(pin_dir, map_names::CT_LIFETIMES)?))?;
    Ok(Some(map.get(&0, 0)?))
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
        self.collect_garbage_at(crate::pinned::conntrack_gc::monotonic_now_ns())
    }

    /// `collect_garbage` as if the clock read `now` (tests: entries older than the machine's
    /// uptime cannot be written otherwise).
    pub fn collect_garbage_at(&mut self, now: u64) -> Result<(usize, usize)> {
        let lifetimes = read_ct_lifetimes(&self.pin_dir)?;
        Ok(crate::pinned::conntrack_gc::collect_expired(&mut self.map, now, expired_at(lifetimes)))
    }

    /// `collect_garbage_at`'s walk alone: (entries, keys of the expired ones).
    pub fn expired_keys_at(&self, now: u64) -> Result<(usize, Vec<CtKey<F::Words>>)> {
        let lifetimes = read_ct_lifetimes(&self.pin_dir)?;
        Ok(crate::pinned::conntrack_gc::expired_keys(&self.map, now, expired_at(lifetimes)))
    }

    /// `collect_garbage_at`'s removals alone, of the keys its walk found (`expired_keys_at`):
    /// those still expired. Returns how many.
    pub fn remove_expired_at(&mut self, keys: &[CtKey<F::Words>], now: u64) -> Result<usize> {
        let lifetimes = read_ct_lifetimes(&self.pin_dir)?;
        Ok(crate::pinned::conntrack_gc::remove_expired(&mut self.map, keys, now, expired_at(lifetimes)))
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
