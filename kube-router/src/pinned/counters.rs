//! A per-CPU counter array (`lb_stats`, `pol_stats`, `sock_stats`), opened once and read
//! (summed over CPUs) as often as the metrics need.
use std::path::Path;

use anyhow::{Context, Result};
use aya::maps::{Map, MapData, PerCpuArray};

pub struct Counters {
    map: PerCpuArray<MapData, u64>,
    count: u32,
}

impl Counters {
    /// The pinned array `name` of `count` counters.
    pub fn open_pinned(pin_dir: &Path, name: &str, count: u32) -> Result<Self> {
        let path = super::pinned_map(pin_dir, name);
        let data = MapData::from_pin(&path).with_context(|| format!("opening pinned map {}", path.display()))?;
        Ok(Self { map: PerCpuArray::try_from(Map::PerCpuArray(data))?, count })
    }

    /// Each counter summed over the CPUs, in index order.
    pub fn read(&self) -> Result<Vec<u64>> {
        (0..self.count).map(|i| Ok(self.map.get(&i, 0)?.iter().sum())).collect()
    }
}

/// Reads the pinned array `name` of `count` counters once (commands, tests).
pub fn read_pinned(pin_dir: &Path, name: &str, count: u32) -> Result<Vec<u64>> {
    Counters::open_pinned(pin_dir, name, count)?.read()
}

/// Like [`read_pinned`], but `None` when the map was never created (a datapath from before the
/// feature that owns it).
pub fn read_pinned_if_exists(pin_dir: &Path, name: &str, count: u32) -> Result<Option<Vec<u64>>> {
    if !super::pinned_map(pin_dir, name).exists() {
        return Ok(None);
    }
    read_pinned(pin_dir, name, count).map(Some)
}
