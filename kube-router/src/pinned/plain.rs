//! The plain-traffic cache's generation (`plain_gen`, see `kube_router_common::plain` and
//! `kube-router-ebpf/src/plain.rs`): the TC programs trust a tuple they remembered as plain
//! traffic only while the generation is the one they found it under. Every agent write a
//! "plain" verdict may rest on is followed by [`PlainGeneration::forget_all`]: a frontend put,
//! a pod's isolation or source addresses, the load balancer's settings, `cluster_nets`, the
//! gate flag. What makes traffic *more* plain (a delete) needs none.
use std::{
    path::Path,
    sync::atomic::{AtomicBool, AtomicU64, Ordering},
};

use aya::maps::{Array, Map, MapData};
use kube_router_common::plain_map_names;

/// A failed write was said: once per process, whichever writer failed (some open the map per
/// write).
static WARNED: AtomicBool = AtomicBool::new(false);

/// Failed writes of the generation, every one (`kube_router_plain_cache_total`,
/// `event="generation_write_failed"`).
static FAILED_WRITES: AtomicU64 = AtomicU64::new(0);

/// The `kube_router_plain_cache_total` event counting [`failed_writes`].
pub const GENERATION_WRITE_FAILED: &str = "generation_write_failed";

/// Failed changes of the generation since the agent started.
pub fn failed_writes() -> u64 {
    FAILED_WRITES.load(Ordering::Relaxed)
}

/// The generation, opened once by a writer.
pub struct PlainGeneration {
    /// Absent: pinned maps of a datapath from before the cache, whose programs remember nothing.
    map: Option<Array<MapData, u64>>,
}

impl PlainGeneration {
    pub fn open(pin_dir: &Path) -> Self {
        let map = crate::pinned::open_pinned(pin_dir, plain_map_names::PLAIN_GENERATION)
            .ok()
            .and_then(|data| Array::try_from(Map::Array(data)).ok());
        Self { map }
    }

    /// Every remembered verdict is forgotten: call after the write it may rest on. A failure is
    /// logged once; the programs then trust their verdicts for at most a second
    /// (the cache's time bound).
    pub fn forget_all(&mut self) {
        let Some(map) = &mut self.map else {
            return;
        };
        if let Err(e) = map.set(0, fresh_generation(), 0) {
            FAILED_WRITES.fetch_add(1, Ordering::Relaxed);
            if !WARNED.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    error = %e,
                    map = plain_map_names::PLAIN_GENERATION,
                    "cannot change the plain-traffic cache's generation; cached verdicts last up to a second (said once; counted in kube_router_plain_cache_total{{event=\"generation_write_failed\"}})"
                );
            }
        }
    }
}

/// [`PlainGeneration::forget_all`] for a writer that opens its map per write.
pub fn forget_all(pin_dir: &Path) {
    PlainGeneration::open(pin_dir).forget_all();
}

/// A value no writer wrote before: the monotonic clock (the datapath's `bpf_ktime_get_ns`) with
/// the agent's tag `0xff` below it (the datapath tags its writes with the CPU, below 0x80).
/// Never a counter: a value written twice would make verdicts remembered under its first
/// writing trusted again.
fn fresh_generation() -> u64 {
    crate::pinned::conntrack_gc::monotonic_now_ns() << 8 | 0xff
}
