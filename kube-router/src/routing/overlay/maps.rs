//! The overlay's pinned maps and program attachments (I/O), driven by the FIB task.
use std::{
    collections::BTreeSet,
    net::Ipv4Addr,
    path::{Path, PathBuf},
    sync::Arc,
};

use anyhow::{anyhow, Context, Result};
use aya::maps::{lpm_trie::Key, HashMap, LpmTrie, Map, MapData};
use ipnet::Ipv4Net;
use kube_router_common::{map_names, ovl_stat, OverlayPrefixV4, OverlayTunnelV4};

use super::plan::{diff, MapOp, OverlayMapsState, OverlayTarget};
use crate::{
    bpf::datapath::{AttachOutcome, Datapath},
    map_writes::MapMetrics,
};

pub struct OverlayMaps {
    routes: LpmTrie<MapData, OverlayPrefixV4, OverlayTunnelV4>,
    remotes: HashMap<MapData, u32, OverlayTunnelV4>,
}

use crate::pinned::open_pinned as open;

impl OverlayMaps {
    pub fn open_pinned(pin_dir: &Path) -> Result<Self> {
        let routes = LpmTrie::try_from(Map::LpmTrie(open(pin_dir, map_names::OVERLAY_ROUTES)?))?;
        let remotes = HashMap::try_from(Map::HashMap(open(pin_dir, map_names::OVERLAY_REMOTES)?))?;
        Ok(Self { routes, remotes })
    }

    pub fn exist(pin_dir: &Path) -> bool {
        crate::pinned::pinned_map(pin_dir, map_names::OVERLAY_ROUTES).exists()
    }

    pub fn read(&self) -> Result<OverlayMapsState> {
        let mut state = OverlayMapsState::default();
        for entry in self.routes.iter() {
            let (key, tunnel) = entry?;
            let addr = Ipv4Addr::from(key.data().addr.to_ne_bytes());
            let net =
                Ipv4Net::new(addr, key.prefix_len() as u8).map_err(|e| anyhow!("{addr}/{}: {e}", key.prefix_len()))?;
            state.routes.insert(net, tunnel);
        }
        for entry in self.remotes.iter() {
            let (remote, tunnel) = entry?;
            state.remotes.insert(Ipv4Addr::from(remote.to_ne_bytes()), tunnel);
        }
        Ok(state)
    }

    pub fn apply(&mut self, op: &MapOp) -> Result<()> {
        let key = |net: &Ipv4Net| {
            Key::new(u32::from(net.prefix_len()), OverlayPrefixV4 { addr: u32::from_ne_bytes(net.network().octets()) })
        };
        let addr = |a: &Ipv4Addr| u32::from_ne_bytes(a.octets());
        match op {
            MapOp::PutRoute(net, tunnel) => self.routes.insert(&key(net), tunnel, 0),
            MapOp::DeleteRoute(net) => self.routes.remove(&key(net)),
            MapOp::PutRemote(remote, tunnel) => self.remotes.insert(addr(remote), tunnel, 0),
            MapOp::DeleteRemote(remote) => self.remotes.remove(&addr(remote)),
        }
        .with_context(|| format!("writing the overlay maps: {op:?}"))
    }
}

/// Per-counter sums of `ovl_stats` (see [`ovl_stat`]).
pub fn read_stats(pin_dir: &Path) -> Result<Vec<u64>> {
    crate::pinned::counters::read_pinned(pin_dir, map_names::OVERLAY_STATS, ovl_stat::COUNT)
}

/// Brings the datapath to an [`OverlayTarget`]: loads the programs the first time a tunnel is
/// needed (or opens the maps a previous run left), attaches them where tunnels go (pinned
/// links, re-adopted after a restart) and writes only the map entries that differ, each counted
/// in `kube_router_map_writes_total{map="ovl_routes_v4"|"ovl_remotes_v4"}` like every map writer's.
pub struct OverlayDataplane {
    pin_dir: PathBuf,
    datapath: Option<Datapath>,
    maps: Option<OverlayMaps>,
    attached: BTreeSet<String>,
    metrics: Arc<MapMetrics>,
}

impl OverlayDataplane {
    pub fn new(pin_dir: PathBuf, metrics: Arc<MapMetrics>) -> Self {
        Self { pin_dir, datapath: None, maps: None, attached: BTreeSet::new(), metrics }
    }

    /// Attachments and the map entries new routes need; returns the writes to make once the
    /// kernel routes are updated (entries nothing needs any more, only with `allow_deletes`:
    /// while the routes they belong to are kept across a restart, their tunnels stay too).
    pub fn prepare(&mut self, target: &OverlayTarget, allow_deletes: bool) -> Result<Vec<MapOp>> {
        let empty = target.maps == OverlayMapsState::default();
        if empty && self.maps.is_none() && !OverlayMaps::exist(&self.pin_dir) {
            return Ok(Vec::new()); // never used here: nothing to load or clean
        }
        if !empty && self.datapath.is_none() {
            self.datapath =
                Some(Datapath::load_overlay(&self.pin_dir).context("loading the datapath for the overlay")?);
        }
        if self.maps.is_none() {
            self.maps = Some(OverlayMaps::open_pinned(&self.pin_dir)?);
        }
        if let Some(datapath) = self.datapath.as_mut() {
            for interface in target.interfaces.difference(&self.attached.clone()) {
                let outcomes = datapath.attach_overlay(interface)?;
                if outcomes.iter().any(|o| *o != AttachOutcome::Adopted) {
                    tracing::info!(
                        interface,
                        ?outcomes,
                        "overlay attached at TC egress (encapsulation) and ingress (decapsulation)"
                    );
                }
                self.attached.insert(interface.clone());
            }
        }
        let maps = self.maps.as_mut().expect("opened above");
        let installed = maps.read()?;
        let (before, mut after) = diff(&installed, &target.maps);
        if !allow_deletes {
            after.clear();
        }
        if !before.is_empty() || !after.is_empty() {
            tracing::info!(
                writes = before.len() + after.len(),
                tunnels = target.maps.routes.len(),
                "updating the overlay"
            );
        }
        for op in &before {
            write(maps, &self.metrics, op, &installed)?;
        }
        Ok(after)
    }

    /// The deletes [`Self::prepare`] returned, once the kernel routes no longer need them.
    pub fn finish(&mut self, after: &[MapOp]) -> Result<()> {
        let Some(maps) = self.maps.as_mut() else { return Ok(()) };
        let installed = maps.read()?;
        for op in after {
            write(maps, &self.metrics, op, &installed)?;
        }
        Ok(())
    }
}

/// One write, counted by map and operation (`error` when the kernel refused it).
fn write(maps: &mut OverlayMaps, metrics: &MapMetrics, op: &MapOp, installed: &OverlayMapsState) -> Result<()> {
    let (map, label) = op.labels(installed);
    let result = maps.apply(op);
    metrics.count(map, if result.is_ok() { label } else { "error" }, 1);
    result
}
