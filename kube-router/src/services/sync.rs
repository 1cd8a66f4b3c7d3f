//! Applies the difference between desired and programmed map contents, counting every write.
use std::collections::BTreeMap;

use super::{
    compile::MapContents,
    diff::{diff, MapOp},
    family::{AddressFamily, V4},
};

/// One family's service maps, as the sync engine sees them: the pinned BPF maps in the agent,
/// an in-memory copy in tests.
pub trait ServiceMaps<F: AddressFamily = V4> {
    fn write(&mut self, op: &MapOp<F>) -> Result<(), MapWriteError>;
    fn read_all(&self) -> Result<MapContents<F>, MapWriteError>;
}

#[derive(Debug, thiserror::Error)]
#[error("{map}: {message}")]
pub struct MapWriteError {
    pub map: &'static str,
    pub message: String,
    /// The map had no room left (E2BIG / ENOMEM on insert).
    pub full: bool,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpCounts {
    pub inserts: u64,
    pub updates: u64,
    pub deletes: u64,
    pub errors: u64,
    pub full: u64,
}

impl OpCounts {
    pub fn writes(&self) -> u64 {
        self.inserts + self.updates + self.deletes
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SyncReport {
    pub per_map: BTreeMap<&'static str, OpCounts>,
    /// The first failure of each map that refused a write for another reason than room.
    pub first_errors: BTreeMap<&'static str, String>,
}

impl SyncReport {
    /// Adds another report (the other family's) map by map.
    pub fn merge(&mut self, other: SyncReport) {
        for (map, counts) in other.per_map {
            let total = self.per_map.entry(map).or_default();
            total.inserts += counts.inserts;
            total.updates += counts.updates;
            total.deletes += counts.deletes;
            total.errors += counts.errors;
            total.full += counts.full;
        }
        for (map, error) in other.first_errors {
            self.first_errors.entry(map).or_insert(error);
        }
    }

    pub fn total(&self) -> OpCounts {
        let mut total = OpCounts::default();
        for c in self.per_map.values() {
            total.inserts += c.inserts;
            total.updates += c.updates;
            total.deletes += c.deletes;
            total.errors += c.errors;
            total.full += c.full;
        }
        total
    }
}

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
        self.write(maps, ops)
    }

    /// Writes `ops`, a difference computed by the caller (the incremental compiler's, over the
    /// entries of the Services that changed), as [`Self::sync`] writes its own.
    pub fn write(&mut self, maps: &mut impl ServiceMaps<F>, ops: Vec<MapOp<F>>) -> SyncReport {
        let mut report = SyncReport::default();
        // Once a map refuses an insert for lack of room, later inserts into it in this pass are
        // not even tried: a full map costs one failed syscall per sync, not one per entry.
        let mut full: std::collections::BTreeSet<&'static str> = Default::default();
        for op in ops {
            let counts = report.per_map.entry(op.map_name()).or_default();
            let insert = self.programmed.is_insert(&op);
            if insert && full.contains(op.map_name()) {
                counts.errors += 1;
                counts.full += 1;
                continue;
            }
            match maps.write(&op) {
                Ok(()) => {
                    match op {
                        _ if op.is_delete() => counts.deletes += 1,
                        _ if insert => counts.inserts += 1,
                        _ => counts.updates += 1,
                    }
                    self.programmed.apply(&op);
                }
                Err(e) => {
                    counts.errors += 1;
                    if e.full {
                        counts.full += 1;
                        full.insert(op.map_name());
                    } else {
                        // Logged by the controller once per map that starts failing.
                        report.first_errors.entry(op.map_name()).or_insert_with(|| format!("{e} ({op:?})"));
                    }
                }
            }
        }
        report
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
