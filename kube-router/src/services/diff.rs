//! Differences between two sets of map contents, as ordered map writes.
use std::collections::BTreeMap;

use kube_router_common::*;

use super::{
    compile::{MapContents, SourceRange},
    family::{AddressFamily, V4},
};

/// One write to one family's service maps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MapOp<F: AddressFamily = V4> {
    PutBackend(u32, Backend<F::Words>),
    PutSlot(BackendSlotKey, BackendSlotValue),
    PutSourceRange(SourceRange<F::Words>),
    PutService(ServiceKey<F::Words>, ServiceValue),
    DeleteService(ServiceKey<F::Words>),
    DeleteSlot(BackendSlotKey),
    DeleteBackend(u32),
    DeleteSourceRange(SourceRange<F::Words>),
}

impl<F: AddressFamily> crate::map_writes::MapOperation for MapOp<F> {
    fn map_name(&self) -> &'static str {
        MapOp::map_name(self)
    }
    fn is_delete(&self) -> bool {
        MapOp::is_delete(self)
    }
}

impl<F: AddressFamily> MapOp<F> {
    pub fn map_name(&self) -> &'static str {
        match self {
            MapOp::PutBackend(..) | MapOp::DeleteBackend(_) => F::MAPS.backends,
            MapOp::PutSlot(..) | MapOp::DeleteSlot(_) => F::MAPS.slots,
            MapOp::PutService(..) | MapOp::DeleteService(_) => F::MAPS.services,
            MapOp::PutSourceRange(_) | MapOp::DeleteSourceRange(_) => F::MAPS.source_ranges,
        }
    }

    pub fn is_delete(&self) -> bool {
        matches!(
            self,
            MapOp::DeleteService(_) | MapOp::DeleteSlot(_) | MapOp::DeleteBackend(_) | MapOp::DeleteSourceRange(_)
        )
    }
}

/// Writes that turn `current` into `desired`, ordered so the datapath never sees a frontend
/// pointing at a slot, or a slot at a backend, that does not exist yet or any more:
/// backends, slots, source ranges and services are written first, then removed in the reverse
/// order (a frontend's source ranges exist before it is flagged, and outlive the flag).
/// With `allow_deletes` false (before the first complete sync after a restart) nothing is
/// removed.
pub fn diff<F: AddressFamily>(
    current: &MapContents<F>,
    desired: &MapContents<F>,
    allow_deletes: bool,
) -> Vec<MapOp<F>> {
    fn puts<K: Ord + Copy, V: PartialEq + Copy, Op>(
        current: &BTreeMap<K, V>,
        desired: &BTreeMap<K, V>,
        op: impl Fn(K, V) -> Op,
        out: &mut Vec<Op>,
    ) {
        for (k, v) in desired {
            if current.get(k) != Some(v) {
                out.push(op(*k, *v));
            }
        }
    }
    let mut ops = Vec::new();
    puts(&current.backends, &desired.backends, MapOp::PutBackend, &mut ops);
    puts(&current.slots, &desired.slots, MapOp::PutSlot, &mut ops);
    puts(&current.source_ranges, &desired.source_ranges, |k, _| MapOp::PutSourceRange(k), &mut ops);
    // Frontends in priority order: when `svc_v4` cannot take them all, the first get the room.
    let mut services: Vec<(&ServiceKey<F::Words>, &ServiceValue)> =
        desired.services.iter().filter(|(k, v)| current.services.get(k) != Some(v)).collect();
    services.sort_by_key(|(key, value)| frontend_priority(current.services.contains_key(key), value));
    ops.extend(services.into_iter().map(|(k, v)| MapOp::PutService(*k, *v)));
    if allow_deletes {
        ops.extend(deletes(current, desired));
    }
    ops
}

/// The deletes of [`diff`]: what `current` holds and `desired` does not, services first, then
/// slots, backends and source ranges.
pub fn deletes<F: AddressFamily>(current: &MapContents<F>, desired: &MapContents<F>) -> Vec<MapOp<F>> {
    fn gone<K: Ord + Copy, V, Op>(
        current: &BTreeMap<K, V>,
        desired: &BTreeMap<K, V>,
        op: impl Fn(K) -> Op,
        out: &mut Vec<Op>,
    ) {
        for k in current.keys() {
            if !desired.contains_key(k) {
                out.push(op(*k));
            }
        }
    }
    let mut ops = Vec::new();
    gone(&current.services, &desired.services, MapOp::DeleteService, &mut ops);
    gone(&current.slots, &desired.slots, MapOp::DeleteSlot, &mut ops);
    gone(&current.backends, &desired.backends, MapOp::DeleteBackend, &mut ops);
    gone(&current.source_ranges, &desired.source_ranges, MapOp::DeleteSourceRange, &mut ops);
    ops
}

/// The order frontends get room in when the map cannot hold them all (docs/maps.md, "When a
/// map is full"); lower first. A frontend already programmed only changes its value and needs no
/// room; then frontends with endpoints before empty ones (which only refuse); then ClusterIPs
/// (in-cluster traffic: DNS, the API) before NodePorts before external and LoadBalancer IPs.
/// Within a rank, address order (the sort is stable over the key-ordered map).
pub fn frontend_priority(programmed: bool, value: &ServiceValue) -> (bool, bool, u8) {
    let class = if value.flags & SVC_FLAG_EXTERNAL != 0 {
        2
    } else if value.flags & SVC_FLAG_NODEPORT != 0 {
        1
    } else {
        0
    };
    (!programmed, value.backend_count == 0, class)
}

impl<F: AddressFamily> MapContents<F> {
    /// The same contents with full B-tree nodes.
    pub fn compact(&mut self) {
        fn rebuilt<K: Ord, V>(map: &mut BTreeMap<K, V>) {
            *map = std::mem::take(map).into_iter().collect();
        }
        rebuilt(&mut self.services);
        rebuilt(&mut self.slots);
        rebuilt(&mut self.backends);
        rebuilt(&mut self.source_ranges);
    }

    /// Applies one write to an in-memory copy (the model of what the kernel maps hold).
    pub fn apply(&mut self, op: &MapOp<F>) {
        match *op {
            MapOp::PutBackend(k, v) => {
                self.backends.insert(k, v);
            }
            MapOp::PutSlot(k, v) => {
                self.slots.insert(k, v);
            }
            MapOp::PutService(k, v) => {
                self.services.insert(k, v);
            }
            MapOp::DeleteService(k) => {
                self.services.remove(&k);
            }
            MapOp::DeleteSlot(k) => {
                self.slots.remove(&k);
            }
            MapOp::DeleteBackend(k) => {
                self.backends.remove(&k);
            }
            MapOp::PutSourceRange(k) => {
                self.source_ranges.insert(k, 1);
            }
            MapOp::DeleteSourceRange(k) => {
                self.source_ranges.remove(&k);
            }
        }
    }

    /// Whether `op` creates a key that is not there yet (insert) rather than changing one.
    pub fn is_insert(&self, op: &MapOp<F>) -> bool {
        match op {
            MapOp::PutBackend(k, _) => !self.backends.contains_key(k),
            MapOp::PutSlot(k, _) => !self.slots.contains_key(k),
            MapOp::PutService(k, _) => !self.services.contains_key(k),
            MapOp::PutSourceRange(k) => !self.source_ranges.contains_key(k),
            _ => false,
        }
    }
}
