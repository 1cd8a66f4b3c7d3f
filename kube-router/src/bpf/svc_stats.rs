//! The per-frontend Service counters (`svc_stats_v4` / `svc_stats_v6`): created zeroed with each new frontend,
//! removed with it, read (summed over CPUs) for kube-router's `kube_router_service_*` metrics.
use std::{collections::BTreeMap, path::Path};

use anyhow::{Context, Result};
use aya::maps::{Map, MapData, MapError, PerCpuHashMap, PerCpuValues};
use kube_router_common::*;

use crate::services::family::{AddressFamily, V4, V6};

/// `bpf(2)` update flag: only if absent (a count written meanwhile by the datapath is kept).
const BPF_NOEXIST: u64 = 1;

pub struct FamilySvcStats<F: AddressFamily>
where
    ServiceKey<F::Words>: aya::Pod,
{
    map: PerCpuHashMap<MapData, ServiceKey<F::Words>, ServiceStats>,
    cpus: usize,
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
        let path = super::pinned_map(pin_dir, F::MAPS.stats);
        let data = MapData::from_pin(&path).with_context(|| format!("opening pinned map {}", path.display()))?;
        let cpus = aya::util::nr_cpus().map_err(|(what, e)| anyhow::anyhow!("{what}: {e}"))?;
        Ok(Self { map: PerCpuHashMap::try_from(Map::PerCpuHashMap(data))?, cpus })
    }

    fn zeros(&self) -> PerCpuValues<ServiceStats> {
        PerCpuValues::try_from(vec![ServiceStats::default(); self.cpus]).expect("one value per possible CPU")
    }

    /// Zeroes (or creates) the counters of a frontend: a new Service never inherits old counts.
    pub fn reset(&mut self, frontend: &ServiceKey<F::Words>) -> Result<(), MapError> {
        self.map.insert(frontend, self.zeros(), 0)
    }

    /// Creates zeroed counters for the frontends that have none (programmed by an agent without
    /// this map), keeping existing ones. Returns how many were created.
    pub fn ensure<'a>(
        &mut self,
        frontends: impl IntoIterator<Item = &'a ServiceKey<F::Words>>,
    ) -> Result<usize, MapError> {
        let mut created = 0;
        for frontend in frontends {
            if self.map.get(frontend, 0).is_err() {
                self.map.insert(frontend, self.zeros(), BPF_NOEXIST)?;
                created += 1;
            }
        }
        Ok(created)
    }

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
