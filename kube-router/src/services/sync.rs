//! Applies the difference between desired and programmed map contents, counting every write.
use std::collections::BTreeMap;

use super::{
    compile::MapContents,
    diff::{deletes, frontend_priority, MapOp},
    family::{AddressFamily, V4},
};
use crate::map_writes::{write_ops, OpWriter, WriteRules, WriteTarget};

/// One family's service maps, as the sync engine sees them: the pinned BPF maps in the agent,
/// an in-memory copy in tests.
pub trait ServiceMaps<F: AddressFamily = V4> {
    fn write(&mut self, op: &MapOp<F>) -> Result<(), MapWriteError>;
    fn read_all(&self) -> Result<MapContents<F>, MapWriteError>;
    /// See [`WriteTarget::batches`].
    fn batches(&self, _op: &MapOp<F>) -> bool {
        false
    }
    /// See [`WriteTarget::write_batch`]; `programmed` is what the maps hold before it.
    fn write_batch(&mut self, _ops: &[MapOp<F>], _programmed: &MapContents<F>) -> Option<BatchOutcome> {
        None
    }
}

pub use crate::map_writes::{BatchOutcome, MapWriteError, OpCounts, SyncReport};

impl<F: AddressFamily> MapContents<F> {
    pub fn len(&self) -> usize {
        self.services.len() + self.slots.len() + self.backends.len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Keeps the model of what is programmed in one family's maps and brings them to a desired
/// state.
pub struct ServiceSync<F: AddressFamily = V4> {
    programmed: MapContents<F>,
}

impl<F: AddressFamily> ServiceSync<F> {
    /// Starts from what the maps hold now (after a restart: the previous agent's work).
    pub fn adopt(maps: &impl ServiceMaps<F>) -> Result<Self, MapWriteError> {
        Ok(Self { programmed: maps.read_all()? })
    }

    pub fn programmed(&self) -> &MapContents<F> {
        &self.programmed
    }

    /// Writes only the differences, as [`super::diff::diff`] orders them. A failed write is
    /// counted and left out of the model, so the next sync retries it; nothing already
    /// programmed is touched because of it.
    ///
    /// The writes are computed a slice at a time, each written before the next, and `desired`
    /// is consumed as they go: a first sync writes every entry, and the whole list of writes
    /// beside the desired state and the model filling up was the agent's high-water mark at
    /// the start (issue 29). A slice's puts are found against the model after the slices before
    /// it, which wrote other keys only: the same writes as one difference taken first.
    pub fn sync(&mut self, maps: &mut impl ServiceMaps<F>, desired: MapContents<F>, allow_deletes: bool) -> SyncReport {
        self.sync_in_slices(maps, desired, allow_deletes, SLICE)
    }

    /// [`Self::sync`] computing `slice` writes at a time.
    pub(super) fn sync_in_slices(
        &mut self,
        maps: &mut impl ServiceMaps<F>,
        desired: MapContents<F>,
        allow_deletes: bool,
        slice: usize,
    ) -> SyncReport {
        // What goes is found before the desired keys are consumed; the puts add only desired
        // keys, so they change none of it.
        let deletes = if allow_deletes { deletes(&self.programmed, &desired) } else { Vec::new() };
        let MapContents { services, slots, backends, source_ranges } = desired;
        // Frontends in priority order, as the model has them before this sync.
        let mut services: Vec<_> =
            services.into_iter().filter(|(k, v)| self.programmed.services.get(k) != Some(v)).collect();
        services.sort_by_key(|(key, value)| frontend_priority(self.programmed.services.contains_key(key), value));
        let mut writer = OpWriter::new(WriteRules::default());
        let mut target = Target { maps, programmed: &mut self.programmed };
        let mut many = 0;
        many += target.put_changed(&mut writer, slice, backends, |m| &m.backends, MapOp::PutBackend);
        many += target.put_changed(&mut writer, slice, slots, |m| &m.slots, MapOp::PutSlot);
        let range = |k, _| MapOp::PutSourceRange(k);
        many += target.put_changed(&mut writer, slice, source_ranges, |m| &m.source_ranges, range);
        for part in services.chunks(slice) {
            let ops: Vec<MapOp<F>> = part.iter().map(|(k, v)| MapOp::PutService(*k, *v)).collect();
            writer.write(&mut target, &ops);
            many += ops.len();
        }
        drop(services);
        for part in deletes.chunks(slice) {
            writer.write(&mut target, part);
        }
        many += deletes.len();
        let report = writer.finish();
        // The model's maps filled in key order (the first sync writes everything) have their
        // B-tree nodes about half full: rebuilt at once, full (issue 29, heap profile).
        if many > 0 && many >= self.programmed.len() / 2 {
            self.programmed.compact();
        }
        report
    }

    /// Writes `ops`, a difference computed by the caller (the incremental compiler's, over the
    /// entries of the Services that changed), as [`Self::sync`] writes its own. A failed write
    /// is left out of the model, so the next sync retries it; nothing already programmed is
    /// touched because of it.
    pub fn write(&mut self, maps: &mut impl ServiceMaps<F>, ops: Vec<MapOp<F>>) -> SyncReport {
        let mut target = Target { maps, programmed: &mut self.programmed };
        write_ops(&mut target, ops, WriteRules::default())
    }
}

/// The maps and the model of what they hold, as the one map writer sees them.
struct Target<'a, F: AddressFamily, M> {
    maps: &'a mut M,
    programmed: &'a mut MapContents<F>,
}

/// The most writes computed ahead of the map writer in a full sync ([`ServiceSync::sync`]);
/// also the largest batch. A few hundred KiB, against tens of MiB for a first sync's whole list.
const SLICE: usize = 8192;

impl<F: AddressFamily, M: ServiceMaps<F>> Target<'_, F, M> {
    /// Writes the entries of `desired` (one map's, consumed) that the model's map (`held`) does
    /// not hold as they are, `slice` at a time, each slice found against the model as the slices
    /// before it left it; returns how many.
    fn put_changed<K: Ord, V: PartialEq>(
        &mut self,
        writer: &mut OpWriter,
        slice: usize,
        desired: BTreeMap<K, V>,
        held: impl Fn(&MapContents<F>) -> &BTreeMap<K, V>,
        op: impl Fn(K, V) -> MapOp<F>,
    ) -> usize {
        let mut entries = desired.into_iter();
        let mut ops = Vec::new();
        let mut many = 0;
        loop {
            ops.clear();
            for (k, v) in entries.by_ref() {
                if held(self.programmed).get(&k) != Some(&v) {
                    ops.push(op(k, v));
                    if ops.len() == slice {
                        break;
                    }
                }
            }
            if ops.is_empty() {
                return many;
            }
            many += ops.len();
            writer.write(self, &ops);
        }
    }
}

impl<F: AddressFamily, M: ServiceMaps<F>> WriteTarget<MapOp<F>> for Target<'_, F, M> {
    fn is_insert(&self, op: &MapOp<F>) -> bool {
        self.programmed.is_insert(op)
    }
    fn write(&mut self, op: &MapOp<F>) -> Result<(), MapWriteError> {
        self.maps.write(op)
    }
    fn written(&mut self, op: &MapOp<F>) {
        self.programmed.apply(op);
    }
    fn batches(&self, op: &MapOp<F>) -> bool {
        self.maps.batches(op)
    }
    fn write_batch(&mut self, ops: &[MapOp<F>]) -> Option<BatchOutcome> {
        self.maps.write_batch(ops, self.programmed)
    }
}

impl<F: AddressFamily> ServiceMaps<F> for MapContents<F> {
    fn write(&mut self, op: &MapOp<F>) -> Result<(), MapWriteError> {
        self.apply(op);
        Ok(())
    }
    fn read_all(&self) -> Result<MapContents<F>, MapWriteError> {
        Ok(self.clone())
    }
}
