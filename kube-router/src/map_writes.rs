//! The one way the agent writes a computed difference into its maps, the service maps and the
//! policy maps alike: each write in the order the differ gave, counted per map (insert, update,
//! delete, error, full); a map that ran out of room is not tried again in the same pass (a
//! full map costs one failed syscall per sync, not one per entry); with
//! [`WriteRules::hold_deletes_after_failure`] no delete follows a failed write (the old entries
//! a failed new one would replace stay). What failed is left for the next sync: it is still
//! a difference then.
use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
};

use prometheus_client::registry::Registry;

use crate::{
    exposition::{register, Counter, Family, IntGauge},
    metrics::{Labels, Subsystem},
};

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
    /// Deletes not tried because a write before them failed.
    pub deferred: u64,
}

impl OpCounts {
    pub fn writes(&self) -> u64 {
        self.inserts + self.updates + self.deletes
    }

    fn add(&mut self, other: &OpCounts) {
        self.inserts += other.inserts;
        self.updates += other.updates;
        self.deletes += other.deletes;
        self.errors += other.errors;
        self.full += other.full;
        self.deferred += other.deferred;
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SyncReport {
    pub per_map: BTreeMap<&'static str, OpCounts>,
    /// The first failure of each map that refused a write (for lack of room or otherwise).
    pub first_errors: BTreeMap<&'static str, String>,
}

impl SyncReport {
    /// Adds another report (the other family's) map by map.
    pub fn merge(&mut self, other: SyncReport) {
        for (map, counts) in other.per_map {
            self.per_map.entry(map).or_default().add(&counts);
        }
        for (map, error) in other.first_errors {
            self.first_errors.entry(map).or_insert(error);
        }
    }

    pub fn total(&self) -> OpCounts {
        let mut total = OpCounts::default();
        self.per_map.values().for_each(|c| total.add(c));
        total
    }

    /// The first error of any map, for a caller that reports one line.
    pub fn first_error(&self) -> Option<(&'static str, &str)> {
        self.first_errors.iter().next().map(|(map, error)| (*map, error.as_str()))
    }
}

/// A write the differ produced.
pub trait MapOperation: std::fmt::Debug {
    fn map_name(&self) -> &'static str;
    fn is_delete(&self) -> bool;
}

/// Where the writes go, with what is known of the maps' contents.
pub trait WriteTarget<O> {
    /// `op` adds a key the maps do not hold yet (an insert, not an update).
    fn is_insert(&self, op: &O) -> bool;
    fn write(&mut self, op: &O) -> Result<(), MapWriteError>;
    /// `op` took effect: a model of the maps' contents follows it.
    fn written(&mut self, _op: &O) {}
    /// `op` may be written in one batch with the writes into the same map around it (a put
    /// into a map the target writes in batches).
    fn batches(&self, _op: &O) -> bool {
        false
    }
    /// Writes `ops` (puts into one map, each [`Self::batches`]) in one go, in order: how many
    /// took effect and the next one's error, as [`Self::write`] would have reported it;
    /// `None` when the kernel cannot (nothing written: they are written one by one).
    fn write_batch(&mut self, _ops: &[O]) -> Option<BatchOutcome> {
        None
    }
}

/// What a batch of writes did: the first `done` took effect, and the one after them (if any)
/// failed with `error`; none after it was tried.
#[derive(Debug)]
pub struct BatchOutcome {
    pub done: usize,
    pub error: Option<MapWriteError>,
}

/// The fewest writes worth a batch: below it the one-by-one writes cost no more.
const MIN_BATCH: usize = 4;

#[derive(Clone, Copy, Debug, Default)]
pub struct WriteRules {
    /// After a failed write, deletes are not tried (counted `deferred`): the policy maps'
    /// entries point at each other, and a pod whose new entries could not all be written keeps
    /// its complete old ones rather than half of either.
    pub hold_deletes_after_failure: bool,
}

/// Writes `ops` in order into `target` under `rules`. Runs of puts into one map go in batches
/// where the target can; the counts, the errors and the model come out as one by one.
pub fn write_ops<O: MapOperation>(
    target: &mut impl WriteTarget<O>,
    ops: impl IntoIterator<Item = O>,
    rules: WriteRules,
) -> SyncReport {
    let ops: Vec<O> = ops.into_iter().collect();
    let mut writer = OpWriter::new(rules);
    writer.write(target, &ops);
    writer.finish()
}

/// [`write_ops`] over a list given a slice at a time, for a writer that computes its writes as
/// it goes (the services' full sync: the whole list of a first sync beside the desired state and
/// the model was the start's high-water mark, issue 29). What one pass keeps from write to write
/// (the full maps, a failure) is kept across slices, so the slices' writes, counts and model are
/// those of the whole list written at once; only a batch ends where its slice does.
pub struct OpWriter {
    rules: WriteRules,
    report: SyncReport,
    full: BTreeSet<&'static str>,
    failed: bool,
}

impl OpWriter {
    pub fn new(rules: WriteRules) -> Self {
        Self { rules, report: SyncReport::default(), full: BTreeSet::new(), failed: false }
    }

    /// Writes the next `ops` of the pass.
    pub fn write<O: MapOperation>(&mut self, target: &mut impl WriteTarget<O>, ops: &[O]) {
        let Self { rules, report, full, failed } = self;
        // Writes before this index go one by one (a batch the kernel could not take).
        let mut singly_until = 0;
        let mut i = 0;
        while i < ops.len() {
            let op = &ops[i];
            let map = op.map_name();
            // A full map's inserts are refused without a try: batches only while it has room.
            if i >= singly_until && !op.is_delete() && !full.contains(map) && target.batches(op) {
                let run = ops[i..]
                    .iter()
                    .take_while(|next| next.map_name() == map && !next.is_delete() && target.batches(next))
                    .count();
                if run >= MIN_BATCH {
                    match target.write_batch(&ops[i..i + run]) {
                        Some(BatchOutcome { done, error }) => {
                            let done = done.min(run);
                            for op in &ops[i..i + done] {
                                let insert = target.is_insert(op);
                                count_written(report.per_map.entry(map).or_default(), op, insert);
                                target.written(op);
                            }
                            i += done;
                            match error {
                                Some(e) if done < run => {
                                    *failed = true;
                                    record_failure(report, full, map, e);
                                    i += 1;
                                }
                                // Stopped without an error: the rest one by one.
                                _ if done < run => singly_until = i + (run - done),
                                _ => {}
                            }
                        }
                        None => singly_until = i + run,
                    }
                    continue;
                }
            }
            let counts = report.per_map.entry(map).or_default();
            if op.is_delete() && *failed && rules.hold_deletes_after_failure {
                counts.deferred += 1;
                i += 1;
                continue;
            }
            let insert = target.is_insert(op);
            if insert && full.contains(map) {
                counts.errors += 1;
                counts.full += 1;
                *failed = true;
                i += 1;
                continue;
            }
            match target.write(op) {
                Ok(()) => {
                    count_written(counts, op, insert);
                    target.written(op);
                }
                Err(e) => {
                    *failed = true;
                    record_failure(report, full, map, e);
                }
            }
            i += 1;
        }
    }

    /// What the pass wrote.
    pub fn finish(self) -> SyncReport {
        self.report
    }
}

fn count_written<O: MapOperation>(counts: &mut OpCounts, op: &O, insert: bool) {
    match () {
        _ if op.is_delete() => counts.deletes += 1,
        _ if insert => counts.inserts += 1,
        _ => counts.updates += 1,
    }
}

fn record_failure(report: &mut SyncReport, full: &mut BTreeSet<&'static str>, map: &'static str, error: MapWriteError) {
    let counts = report.per_map.entry(map).or_default();
    counts.errors += 1;
    if error.full {
        counts.full += 1;
        full.insert(map);
    }
    // Logged by the caller once per map that starts failing, not per entry.
    report.first_errors.entry(map).or_insert(error.message);
}

/// The map writes of every writer (services, policy, the maps' stamps) and the maps' fill.
#[derive(Default)]
pub struct MapMetrics {
    writes: Family<Labels<2>, Counter>,
    entries: Family<Labels<1>, IntGauge>,
    full: Family<Labels<1>, IntGauge>,
}

impl MapMetrics {
    /// The `op` labels that are writes into a map (the rest count refusals and deferrals).
    pub const WRITE_OPS: [&'static str; 3] = ["insert", "update", "delete"];

    /// Every write of one pass of the map writer, by map and operation.
    pub fn record(&self, report: &SyncReport) {
        for (map, c) in &report.per_map {
            let [insert, update, delete] = Self::WRITE_OPS;
            for (op, n) in [
                (insert, c.inserts),
                (update, c.updates),
                (delete, c.deletes),
                ("error", c.errors),
                ("full", c.full),
                ("deferred", c.deferred),
            ] {
                if n > 0 {
                    self.count(map, op, n);
                }
            }
        }
    }

    pub fn count(&self, map: &'static str, op: &'static str, n: u64) {
        self.writes.get_or_create(&[("map", map), ("op", op)]).inc_by(n);
    }

    pub fn writes(&self, map: &'static str, op: &'static str) -> Option<u64> {
        self.writes.get(&[("map", map), ("op", op)]).map(|c| c.get())
    }

    /// Entries in `map` as last programmed.
    pub fn set_entries(&self, map: &'static str, entries: u64) {
        self.entries.get_or_create(&[("map", map)]).set(entries as i64);
    }

    pub fn set_full(&self, map: &'static str, full: bool) {
        self.full.get_or_create(&[("map", map)]).set(i64::from(full));
    }
}

impl Subsystem for MapMetrics {
    fn register(this: &Arc<Self>, registry: &mut Registry) {
        register(
            registry,
            "kube_router_map_writes_total",
            "Writes to pinned BPF maps by map and operation.",
            this.writes.clone(),
        );
        register(
            registry,
            "kube_router_map_full",
            "1 while a pinned BPF map cannot take every desired entry (existing ones are kept).",
            this.full.clone(),
        );
        register(
            registry,
            "kube_router_map_entries",
            "Entries in each pinned BPF map as last programmed.",
            this.entries.clone(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    enum Op {
        Put(&'static str, u32),
        Delete(&'static str, u32),
    }

    impl MapOperation for Op {
        fn map_name(&self) -> &'static str {
            match self {
                Op::Put(map, _) | Op::Delete(map, _) => map,
            }
        }
        fn is_delete(&self) -> bool {
            matches!(self, Op::Delete(..))
        }
    }

    /// Maps of at most `room` keys each; `broken` refuses every write. With `batches`, puts
    /// are written in batches that stop at the first refusal, as the kernel's do; with
    /// `batches_refused`, the kernel has no batch command.
    #[derive(Default)]
    struct Maps {
        keys: BTreeMap<&'static str, BTreeSet<u32>>,
        /// What the writer knows the maps hold (as the services' model): updated by `written`,
        /// not by the kernel's writes, so a batch's inserts still count as inserts.
        model: BTreeMap<&'static str, BTreeSet<u32>>,
        room: usize,
        broken: Option<&'static str>,
        attempts: usize,
        batches: bool,
        batches_refused: bool,
        batch_calls: usize,
    }

    impl WriteTarget<Op> for Maps {
        fn is_insert(&self, op: &Op) -> bool {
            matches!(op, Op::Put(map, key) if !self.model.get(map).is_some_and(|k| k.contains(key)))
        }
        fn written(&mut self, op: &Op) {
            match op {
                Op::Put(map, key) => self.model.entry(map).or_default().insert(*key),
                Op::Delete(map, key) => self.model.entry(map).or_default().remove(key),
            };
        }
        fn write(&mut self, op: &Op) -> Result<(), MapWriteError> {
            self.attempts += 1;
            let map = op.map_name();
            if self.broken == Some(map) {
                return Err(MapWriteError { map, message: "EINVAL".into(), full: false });
            }
            let keys = self.keys.entry(map).or_default();
            match op {
                Op::Put(_, key) if !keys.contains(key) && keys.len() >= self.room => {
                    Err(MapWriteError { map, message: "E2BIG".into(), full: true })
                }
                Op::Put(_, key) => {
                    keys.insert(*key);
                    Ok(())
                }
                Op::Delete(_, key) => {
                    keys.remove(key);
                    Ok(())
                }
            }
        }
        fn batches(&self, op: &Op) -> bool {
            self.batches && matches!(op, Op::Put(..))
        }
        fn write_batch(&mut self, ops: &[Op]) -> Option<BatchOutcome> {
            self.batch_calls += 1;
            if self.batches_refused {
                return None;
            }
            for (done, op) in ops.iter().enumerate() {
                if let Err(e) = self.write(op) {
                    return Some(BatchOutcome { done, error: Some(e) });
                }
            }
            Some(BatchOutcome { done: ops.len(), error: None })
        }
    }

    /// Puts and deletes over three maps, one of which runs out of room halfway through a run.
    fn mixed_ops() -> Vec<Op> {
        let mut ops: Vec<Op> = (0..8).map(|k| Op::Put("a", k)).collect();
        ops.extend((0..3).map(|k| Op::Put("b", k)));
        ops.extend((0..12).map(|k| Op::Put("c", k)));
        ops.extend([Op::Put("a", 0), Op::Put("a", 20), Op::Delete("a", 1), Op::Delete("c", 3)]);
        ops.extend((5..10).map(|k| Op::Put("b", k)));
        ops
    }

    fn preloaded(room: usize) -> Maps {
        let mut maps = Maps { room, ..Default::default() };
        maps.keys.entry("a").or_default().extend([2, 3]);
        maps.model = maps.keys.clone();
        maps
    }
    #[test]
    fn inserts_updates_and_deletes_are_counted_per_map() {
        let mut maps = Maps { room: 10, ..Default::default() };
        maps.keys.entry("a").or_default().insert(1);
        maps.model = maps.keys.clone();
        let ops = [Op::Put("a", 1), Op::Put("a", 2), Op::Put("b", 1), Op::Delete("a", 1)];
        let report = write_ops(&mut maps, ops, WriteRules::default());
        assert_eq!(report.per_map["a"], OpCounts { inserts: 1, updates: 1, deletes: 1, ..Default::default() });
        assert_eq!(report.per_map["b"], OpCounts { inserts: 1, ..Default::default() });
        assert!(report.first_errors.is_empty());
    }

    #[test]
    fn a_full_map_is_tried_once_per_pass_and_the_other_maps_go_on() {
        let mut maps = Maps { room: 1, ..Default::default() };
        let ops = [Op::Put("a", 1), Op::Put("a", 2), Op::Put("a", 3), Op::Put("b", 1), Op::Delete("a", 1)];
        let report = write_ops(&mut maps, ops, WriteRules::default());
        assert_eq!(maps.attempts, 4, "a's third insert not tried");
        assert_eq!((report.per_map["a"].errors, report.per_map["a"].full), (2, 2));
        assert_eq!(report.per_map["b"].inserts, 1);
        assert_eq!(report.per_map["a"].deletes, 1, "deletes still go by default");
        assert_eq!(report.first_error(), Some(("a", "E2BIG")));
    }

    #[test]
    fn held_deletes_wait_for_a_pass_without_failures() {
        let mut maps = Maps { room: 10, broken: Some("b"), ..Default::default() };
        maps.keys.entry("a").or_default().insert(1);
        maps.model = maps.keys.clone();
        let ops = [Op::Put("b", 1), Op::Put("a", 2), Op::Delete("a", 1)];
        let rules = WriteRules { hold_deletes_after_failure: true };
        let report = write_ops(&mut maps, ops, rules);
        assert_eq!(report.per_map["a"], OpCounts { inserts: 1, deferred: 1, ..Default::default() });
        assert_eq!(report.first_error().map(|(map, _)| map), Some("b"));
        assert!(maps.keys["a"].contains(&1), "the old entry stays");
    }

    #[test]
    fn batches_count_fail_and_fill_as_one_by_one() {
        for rules in [WriteRules::default(), WriteRules { hold_deletes_after_failure: true }] {
            let mut single = preloaded(10);
            let expected = write_ops(&mut single, mixed_ops(), rules);
            let mut batched = Maps { batches: true, ..preloaded(10) };
            let report = write_ops(&mut batched, mixed_ops(), rules);
            assert_eq!(report, expected, "{rules:?}");
            assert_eq!(batched.keys, single.keys);
            assert_eq!(report.per_map["c"].full, 2, "c has room for 10 of its 12");
            assert!(batched.batch_calls >= 3, "a, c and b's second run in batches");
        }
    }

    /// A pass written a slice at a time writes, counts and models what the whole list written
    /// at once did, whatever the slices' length: full maps stay full and held deletes held
    /// across slices.
    #[test]
    fn a_pass_in_slices_does_what_the_whole_pass_does() {
        for rules in [WriteRules::default(), WriteRules { hold_deletes_after_failure: true }] {
            for batches in [false, true] {
                let mut whole = Maps { batches, ..preloaded(10) };
                let expected = write_ops(&mut whole, mixed_ops(), rules);
                for slice in 1..=mixed_ops().len() {
                    let mut sliced = Maps { batches, ..preloaded(10) };
                    let mut writer = OpWriter::new(rules);
                    for ops in mixed_ops().chunks(slice) {
                        writer.write(&mut sliced, ops);
                    }
                    assert_eq!(writer.finish(), expected, "{rules:?}, batches {batches}, slices of {slice}");
                    assert_eq!((&sliced.keys, &sliced.model), (&whole.keys, &whole.model));
                    assert_eq!(sliced.attempts, whole.attempts, "a full map is not tried again");
                }
            }
        }
    }

    #[test]
    fn a_kernel_without_batches_gets_the_writes_one_by_one() {
        let mut single = preloaded(10);
        let expected = write_ops(&mut single, mixed_ops(), WriteRules::default());
        let mut refused = Maps { batches: true, batches_refused: true, ..preloaded(10) };
        assert_eq!(write_ops(&mut refused, mixed_ops(), WriteRules::default()), expected);
        assert_eq!(refused.keys, single.keys);
        assert_eq!(refused.attempts, single.attempts, "each write tried once");
    }
}
