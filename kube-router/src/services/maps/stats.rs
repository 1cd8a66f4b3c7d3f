//! The per-frontend Service counters (`svc_stats_v4` / `svc_stats_v6`): created by the datapath
//! with a frontend's first packet, removed with the frontend (and before a new one takes its
//! key), read (summed over CPUs) for kube-router's `kube_router_service_*` metrics. A programmed
//! frontend without an entry has seen no packet: its counters are zero.
use std::{collections::BTreeMap, path::Path};

use anyhow::{Context, Result};
use aya::maps::{Map, MapData, MapError, PerCpuHashMap};
use kube_router_common::*;

use crate::services::family::{AddressFamily, V4, V6};

pub struct FamilySvcStats<F: AddressFamily>
where
    ServiceKey<F::Words>: aya::Pod,
{
    map: PerCpuHashMap<MapData, ServiceKey<F::Words>, ServiceStats>,
}

/// `svc_stats_v4`.
pub type SvcStatsMap = FamilySvcStats<V4>;
/// `svc_stats_v6`.
pub type SvcStatsMapV6 = FamilySvcStats<V6>;

impl<F: AddressFamily> FamilySvcStats<F>
where
    ServiceKey<F::Words>: aya::Pod,
{
    pub fn open_pinned(pin_dir: &Path) -> Result<Self> {
        let path = crate::pinned::pinned_map(pin_dir, F::MAPS.stats);
        let data = MapData::from_pin(&path).with_context(|| format!("opening pinned map {}", path.display()))?;
        Ok(Self { map: PerCpuHashMap::try_from(Map::PerCpuHashMap(data))? })
    }

    /// Removes a frontend's counters (absent ones too). Also how they are zeroed for a new
    /// Service: the datapath creates them again with the frontend's first packet, where a write
    /// from here (per-CPU, not preallocated) would cost a per-CPU allocation of ~20 µs.
    pub fn remove(&mut self, frontend: &ServiceKey<F::Words>) -> Result<(), MapError> {
        match self.map.remove(frontend) {
            Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
            other => other,
        }
    }

    /// Every frontend's counters, summed over CPUs.
    pub fn read_all(&self) -> Result<BTreeMap<ServiceKey<F::Words>, ServiceStats>, MapError> {
        let mut all = BTreeMap::new();
        self.for_each(|key, sum| {
            all.insert(key, sum);
        })?;
        Ok(all)
    }

    /// Each frontend's counters, summed over CPUs, handed to `each` as they are read (no copy
    /// of the whole map: the metrics read it every second).
    pub fn for_each(&self, mut each: impl FnMut(ServiceKey<F::Words>, ServiceStats)) -> Result<(), MapError> {
        for entry in self.map.iter() {
            let (key, values) = entry?;
            let mut sum = ServiceStats::default();
            values.iter().for_each(|cpu| sum.add(cpu));
            each(key, sum);
        }
        Ok(())
    }
}
