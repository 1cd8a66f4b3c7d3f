//! Applies the difference between desired and programmed map contents, counting every write.
use super::{
    compile::MapContents,
    diff::{diff, MapOp},
    family::{AddressFamily, V4},
};
use crate::map_writes::{write_ops, WriteRules, WriteTarget};

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

    /// Writes only the differences. A failed write is counted and left out of the model, so the
    /// next sync retries it; nothing already programmed is touched because of it.
    pub fn sync(
        &mut self,
        maps: &mut impl ServiceMaps<F>,
        desired: &MapContents<F>,
        allow_deletes: bool,
    ) -> SyncReport {
        let ops = diff(&self.programmed, desired, allow_deletes);
        let many = ops.len();
        let report = self.write(maps, ops);
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
