//! How new the API state in the pinned maps is, so a restart can tell whether its checkpoint
//! is older than what the maps already hold.
//!
//! The checkpoint is written at most once a second and after the maps, so an agent killed
//! within that second leaves maps newer than its checkpoint. Programming that checkpoint during
//! an outage would put the older state back (a removed backend, a revoked policy peer). Each
//! writer stamps, in the `meta` map, the time of the API state it wrote completely: cleared
//! before its writes, set after them. A restored checkpoint is applied only to maps whose stamp
//! is older, or missing (maps created fresh, or a write cut off by the kill: the checkpoint then
//! fills in what is missing, without deleting anything).
use std::path::Path;

use anyhow::{Context, Result};
use aya::maps::{Array, MapData};
use kube_router_common::map_names::META;

use crate::{
    map_writes::MapMetrics,
    metrics::{AgentMetrics, Metrics},
};

/// A writer's slot in the `meta` map.
pub struct MapsStamp {
    /// `None`: kept in memory only (tests of the controllers on in-memory maps).
    meta: Option<Array<MapData, u32>>,
    slot: u32,
    /// What the slot holds.
    written: u32,
}

impl MapsStamp {
    /// `slot`: `META_SERVICES_AS_OF` or `META_POLICY_AS_OF`.
    pub fn open(pin_dir: &Path, slot: u32) -> Result<Self> {
        let path = super::pinned_map(pin_dir, META);
        let data = MapData::from_pin(&path).with_context(|| format!("opening pinned map {}", path.display()))?;
        let meta = Array::try_from(aya::maps::Map::Array(data))?;
        let written = meta.get(&slot, 0)?;
        Ok(Self { meta: Some(meta), slot, written })
    }

    /// A stamp of maps that exist in memory only, holding `written`.
    pub fn in_memory(written: u32) -> Self {
        Self { meta: None, slot: 0, written }
    }

    /// Unix seconds of the API state the maps were last written from completely.
    pub fn as_of(&self) -> Option<u32> {
        (self.written != 0).then_some(self.written)
    }

    /// Before writing API state: until [`Self::finish`], the maps may be half-way between two
    /// states.
    pub fn begin(&mut self) -> Result<()> {
        self.set(0)
    }

    /// The maps now hold the API state read at `as_of_unix`, every write done.
    pub fn finish(&mut self, as_of_unix: f64) -> Result<()> {
        self.set(as_of_unix as u32)
    }

    fn set(&mut self, value: u32) -> Result<()> {
        if value != self.written {
            if let Some(meta) = self.meta.as_mut() {
                meta.set(self.slot, value, 0)?;
            }
            self.written = value;
        }
        Ok(())
    }
}

/// What each map writer (services, policy) does with its stamp: decide once, at a restart from
/// the checkpoint, whether its maps are newer (logged and counted once); clear the stamp before
/// writing API state and set it after. A stamp that cannot be read or written is dropped with a
/// warning (a failed write also counted in `kube_router_map_writes_total{map="meta",op="error"}`):
/// the restart then applies the checkpoint, without deletions, as without stamps.
pub struct ApiStateStamp {
    /// `service` or `policy`: the `maps` label of `kube_router_checkpoint_superseded_total`.
    maps: &'static str,
    stamp: Option<MapsStamp>,
    newer_than_checkpoint: Option<bool>,
    /// The stamp before the write in progress.
    before_write: Option<u32>,
}

impl ApiStateStamp {
    /// The stamp of the pinned maps, in `slot` of the `meta` map.
    pub fn open(pin_dir: &Path, slot: u32, maps: &'static str) -> Self {
        let stamp = MapsStamp::open(pin_dir, slot)
            .inspect_err(|e| tracing::warn!(maps, error = %e, "cannot read when the maps were last written"))
            .ok();
        Self::with(maps, stamp)
    }

    /// No stamp: every restored checkpoint is applied.
    pub fn none(maps: &'static str) -> Self {
        Self::with(maps, None)
    }

    pub fn with(maps: &'static str, stamp: Option<MapsStamp>) -> Self {
        Self { maps, stamp, newer_than_checkpoint: None, before_write: None }
    }

    pub fn as_of(&self) -> Option<u32> {
        self.stamp.as_ref().and_then(MapsStamp::as_of)
    }

    /// Whether the maps hold newer API state than the checkpoint restored at `restored_as_of`
    /// (`None`: nothing restored), so that programming it would take them back.
    pub fn keeps_maps_over_checkpoint(&mut self, restored_as_of: Option<f64>, metrics: &Metrics) -> bool {
        let Some(taken) = restored_as_of else { return false };
        let (maps, as_of) = (self.maps, self.as_of());
        *self.newer_than_checkpoint.get_or_insert_with(|| {
            let newer = maps_newer_than_checkpoint(as_of, taken);
            if newer {
                tracing::info!(
                    maps,
                    maps_as_of = as_of,
                    checkpoint_as_of = taken as u64,
                    "the maps hold newer API state than the checkpoint; kept as they are until the API lists everything"
                );
                metrics.of::<AgentMetrics>().checkpoint_superseded(maps);
            }
            newer
        })
    }

    /// Before writing API state: the maps may be half-way between two states until
    /// [`Self::finish_write`].
    pub fn begin_write(&mut self, metrics: &Metrics) {
        self.before_write = self.stamp.as_ref().map(|s| s.as_of().unwrap_or(0));
        self.update(MapsStamp::begin, metrics);
    }

    /// Every write of the API state read at `as_of_unix` took; `wrote` says whether there was
    /// any (none: the maps held this state already, since their previous stamp).
    pub fn finish_write(&mut self, wrote: bool, as_of_unix: f64, metrics: &Metrics) {
        let as_of = match self.before_write.take() {
            Some(previous) if !wrote => f64::from(previous),
            _ => as_of_unix,
        };
        self.update(|stamp| stamp.finish(as_of), metrics);
    }

    /// A failed write drops the stamp, so it is logged and counted once, not at every sync.
    fn update(&mut self, update: impl FnOnce(&mut MapsStamp) -> Result<()>, metrics: &Metrics) {
        if let Some(stamp) = self.stamp.as_mut() {
            if let Err(e) = update(stamp) {
                let maps = self.maps;
                tracing::warn!(maps, error = %e, "cannot stamp the maps; a restart during an outage will apply the checkpoint");
                metrics.of::<MapMetrics>().count(META, "error", 1);
                self.stamp = None;
            }
        }
    }
}

/// Whether maps stamped `maps_as_of` hold newer state than a checkpoint taken at
/// `checkpoint_unix`. Stamps have whole seconds: within the checkpoint's own second the
/// checkpoint is applied (without deletions), as the maps might be the older.
pub fn maps_newer_than_checkpoint(maps_as_of: Option<u32>, checkpoint_unix: f64) -> bool {
    maps_as_of.is_some_and(|stamp| f64::from(stamp) > checkpoint_unix.floor())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unstamped_maps_take_the_checkpoint() {
        assert!(!maps_newer_than_checkpoint(None, 1_000.5));
    }

    #[test]
    fn maps_written_after_the_checkpoint_keep_their_state() {
        assert!(maps_newer_than_checkpoint(Some(1_001), 1_000.5));
        assert!(!maps_newer_than_checkpoint(Some(1_000), 1_000.5), "the same second: the checkpoint");
        assert!(!maps_newer_than_checkpoint(Some(999), 1_000.5));
    }

    #[test]
    fn a_failed_stamp_write_is_counted_once_and_the_stamp_dropped() {
        let metrics = Metrics::default();
        let mut stamp = ApiStateStamp::with("service", Some(MapsStamp::in_memory(1_000)));
        stamp.begin_write(&metrics);
        stamp.finish_write(true, 1_001.0, &metrics);
        assert_eq!(stamp.as_of(), Some(1_001));
        let errors = |metrics: &Metrics| metrics.of::<MapMetrics>().writes(META, "error");
        assert_eq!(errors(&metrics), None, "writes that took count nothing");

        stamp.update(|_| Err(anyhow::anyhow!("EPERM")), &metrics);
        assert_eq!(errors(&metrics), Some(1));
        assert_eq!(stamp.as_of(), None, "no stamp: a restart applies the checkpoint");
        assert!(metrics.render().contains("kube_router_map_writes_total{map=\"meta\",op=\"error\"} 1"));
        // Later syncs do not try (nor count, nor log) again.
        stamp.begin_write(&metrics);
        stamp.finish_write(true, 1_002.0, &metrics);
        assert_eq!(errors(&metrics), Some(1));
    }
}
