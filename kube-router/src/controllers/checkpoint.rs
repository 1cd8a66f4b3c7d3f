//! The checkpoint writer: every kind, after each change, once all have been listed completely,
//! so a restart during an outage has the same Services, Nodes and policies.
//!
//! A write appends the objects changed since the last one (the stores' feeds tell which) to the
//! checkpoint's journal; a whole base is written first, after a failed write, and once the
//! journal has grown as large as the base (`k8s::checkpoint`). Each change is so written about
//! twice in all, once in the journal and once in the base that folds it in: a cost per change,
//! where writing every object each time cost the cluster's size per write.
use std::{
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::Result;

use crate::{
    k8s::{
        cache::Cache,
        checkpoint,
        watch::{CheckpointChanges, CheckpointFeeds, CheckpointSnapshot, Kind},
    },
    metrics::{AgentMetrics, Metrics},
    runtime::{Action, Controller},
};

pub const CHECKPOINT_KINDS: &[Kind] =
    &[Kind::Services, Kind::EndpointSlices, Kind::Pods, Kind::Namespaces, Kind::Nodes, Kind::NetworkPolicies];

/// At most one write this often.
const MIN_INTERVAL: Duration = Duration::from_secs(1);
/// A base takes time in proportion to the cluster (a 150,000-pod cluster's is ~100 MiB): the
/// next write waits this many times as long as the last took, so writing costs at most 1/20 of a
/// core however large the cluster, at the price of a checkpoint that many seconds older when the
/// API goes away.
const INTERVAL_PER_WRITE_TIME: u32 = 20;
/// The first base waits for the agent to be ready (every map written), at most this long: during
/// the start it takes CPU from the first sync (a tenth of a 150,000-pod start), and the sync's
/// state is what it saves anyway.
const FIRST_WRITE_WAITS_FOR_READY_AT_MOST: Duration = Duration::from_secs(10);
const READY_POLL: Duration = Duration::from_millis(250);

/// Says whether the agent is ready (`/readyz`).
pub type ReadyCheck = Box<dyn Fn() -> bool + Send + Sync>;

pub struct CheckpointWriter {
    cache: Arc<Cache>,
    state_dir: PathBuf,
    metrics: Metrics,
    /// The changes already written.
    written: u64,
    /// No write before this.
    next_write: Option<Instant>,
    /// The writer's feed of every store, taken on its first write.
    feeds: Option<CheckpointFeeds>,
    /// The file as this writer left it; `None` before its first base and after a failed write
    /// (a torn record or lost changes): the next write is a base.
    on_disk: Option<OnDisk>,
    /// Holds the first write until it says ready (see [`FIRST_WRITE_WAITS_FOR_READY_AT_MOST`]).
    ready: Option<ReadyCheck>,
    /// When the first write was first due.
    first_due: Option<Instant>,
}

#[derive(Debug, Clone, Copy)]
struct OnDisk {
    base_bytes: u64,
    journal_bytes: u64,
}

impl OnDisk {
    /// The journal has grown as large as the base: folding it into a new base costs no more
    /// than what was appended since the last, so each change is written a bounded number of
    /// times, and a start reads at most twice the base.
    fn wants_compaction(&self) -> bool {
        self.journal_bytes >= self.base_bytes
    }
}

enum Write {
    Base(CheckpointSnapshot),
    Append(CheckpointChanges),
}

impl CheckpointWriter {
    pub fn new(cache: Arc<Cache>, state_dir: PathBuf, metrics: Metrics) -> Self {
        // What was restored is already on disk, but not in a form this writer appends to: its
        // first write is a base.
        Self {
            cache,
            state_dir,
            metrics,
            written: 0,
            next_write: None,
            feeds: None,
            on_disk: None,
            ready: None,
            first_due: None,
        }
    }

    /// The first write waits for `ready` (bounded), so it does not compete with the start.
    pub fn first_write_when(mut self, ready: ReadyCheck) -> Self {
        self.ready = Some(ready);
        self
    }

    /// The first write is due but the agent is still starting: how long to wait before looking again.
    fn waiting_for_ready(&mut self) -> Option<Duration> {
        let ready = self.ready.as_ref()?;
        if self.written != 0 || self.on_disk.is_some() || ready() {
            return None;
        }
        let due = *self.first_due.get_or_insert_with(Instant::now);
        (due.elapsed() < FIRST_WRITE_WAITS_FOR_READY_AT_MOST).then_some(READY_POLL)
    }

    /// What to write: the changes since the last write, or every object when a base is due.
    /// The feeds are taken either way (a base holds their changes).
    fn next(&mut self) -> Option<Write> {
        let cache = &self.cache;
        let feeds = self.feeds.get_or_insert_with(|| cache.with_mut(|o| o.subscribe_checkpoint()));
        let compact = self.on_disk.is_none_or(|d| d.wants_compaction());
        // A snapshot is a pointer per object; the copy and the write happen off the cache's lock.
        cache.with_mut(|o| match o.checkpoint_changes(feeds) {
            Some(changes) if !compact => (!changes.is_empty()).then_some(Write::Append(changes)),
            _ => Some(Write::Base(o.snapshot())),
        })
    }
}

impl Controller for CheckpointWriter {
    fn name(&self) -> &'static str {
        "checkpoint"
    }

    async fn reconcile(&mut self) -> Result<Action> {
        let generation = self.cache.generation(CHECKPOINT_KINDS);
        // Only a whole picture is worth saving.
        if generation == self.written || !self.cache.all_synced() {
            return Ok(Action::AwaitChange);
        }
        if let Some(wait) = self.next_write.and_then(|at| at.checked_duration_since(Instant::now())) {
            return Ok(Action::RequeueAfter(wait));
        }
        if let Some(wait) = self.waiting_for_ready() {
            return Ok(Action::RequeueAfter(wait));
        }
        let started = Instant::now();
        let Some(write) = self.next() else {
            // Changes that changed nothing kept (a relist of the same objects).
            self.written = generation;
            return Ok(Action::AwaitChange);
        };
        let state_dir = self.state_dir.clone();
        let compaction = self.on_disk.is_some() && matches!(write, Write::Base(_));
        let written = tokio::task::spawn_blocking(move || match write {
            Write::Base(snapshot) => checkpoint::write_base(&state_dir, &snapshot).map(|bytes| (bytes, true)),
            Write::Append(changes) => checkpoint::append(&state_dir, &changes).map(|bytes| (bytes, false)),
        })
        .await?;
        let took = started.elapsed();
        self.next_write = Some(started + MIN_INTERVAL.max(took * INTERVAL_PER_WRITE_TIME));
        let metrics = self.metrics.of::<AgentMetrics>();
        metrics.checkpoint_write_seconds.set(took.as_secs_f64());
        match written {
            Ok((bytes, true)) => {
                metrics.checkpoint_written("base", bytes);
                if compaction {
                    metrics.checkpoint_compactions.inc();
                }
                self.on_disk = Some(OnDisk { base_bytes: bytes, journal_bytes: 0 });
            }
            Ok((bytes, false)) => {
                metrics.checkpoint_written("journal", bytes);
                if let Some(on_disk) = self.on_disk.as_mut() {
                    on_disk.journal_bytes += bytes;
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot write checkpoint");
                metrics.checkpoint_errors.inc();
                // The changes taken are in no file, and an append may have left half a record.
                self.on_disk = None;
                return Err(e.into());
            }
        }
        self.written = generation;
        Ok(Action::AwaitChange)
    }
}

#[cfg(test)]
mod tests {
    use kube::runtime::watcher::Event;

    use super::*;
    use crate::k8s::{node::NodeFields, watch::WatchUpdate};

    fn node(name: &str, rv: u64, pod_cidr: &str) -> NodeFields {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "resourceVersion": rv.to_string()},
            "spec": {"podCIDR": pod_cidr, "podCIDRs": [pod_cidr]},
        }))
        .unwrap()
    }

    fn list_every_kind(cache: &Cache, nodes: &[NodeFields]) {
        macro_rules! init_done {
            ($($variant:ident, $field:ident, $ty:ty;)*) => {
                $(cache.apply(WatchUpdate::$variant(Event::Init));)*
                for node in nodes {
                    cache.apply(WatchUpdate::Nodes(Event::InitApply(node.clone())));
                }
                $(cache.apply(WatchUpdate::$variant(Event::InitDone));)*
            };
        }
        crate::watched_kinds!(init_done);
    }

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("krt-checkpoint-writer-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    /// The writer's file read back is the stores, through a base, appends, a compaction and a
    /// failed write; each append costs the change, not the cluster.
    #[tokio::test]
    async fn what_the_writer_leaves_reads_back_as_the_stores() {
        let dir = temp_dir("stores");
        let cache = Cache::new(Default::default(), None);
        let nodes: Vec<NodeFields> =
            (0..50).map(|i| node(&format!("node-{i}"), 1, &format!("10.0.{i}.0/24"))).collect();
        list_every_kind(&cache, &nodes);
        let metrics = Metrics::default();
        let mut writer = CheckpointWriter::new(cache.clone(), dir.clone(), metrics.clone());
        let agent = || metrics.of::<AgentMetrics>();
        let written = |part| agent().checkpoint_written_bytes(part);
        let same_as_stores = || {
            let mut read = checkpoint::read(&dir).unwrap();
            let mut stores = cache.with(|o| o.checkpoint());
            read.nodes.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
            stores.nodes.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
            (read.written_unix, stores.written_unix) = (0.0, 0.0);
            assert_eq!(read, stores);
        };

        writer.reconcile().await.unwrap();
        let base = written("base");
        assert!(base > 0 && written("journal") == 0, "the first write is a base");
        same_as_stores();

        // One change, one deletion: appended, at a fraction of the base's size.
        cache.apply(WatchUpdate::Nodes(Event::Apply(node("node-3", 2, "10.1.3.0/24"))));
        cache.apply(WatchUpdate::Nodes(Event::Delete(node("node-4", 2, "10.0.4.0/24"))));
        writer.next_write = None;
        writer.reconcile().await.unwrap();
        assert_eq!(written("base"), base);
        assert!(written("journal") > 0 && written("journal") < base / 10, "{} of {base}", written("journal"));
        same_as_stores();
        assert_eq!(checkpoint::read(&dir).unwrap().nodes.len(), 49);

        // Appends until the journal is as large as the base: then a base again, with everything.
        let mut rv = 3;
        while agent().checkpoint_compactions.get() == 0 {
            rv += 1;
            let i = rv % 50;
            cache.apply(WatchUpdate::Nodes(Event::Apply(node(
                &format!("node-{i}"),
                rv,
                &format!("10.2.{}.0/24", rv % 250),
            ))));
            writer.next_write = None;
            writer.reconcile().await.unwrap();
            same_as_stores();
            assert!(rv < 10_000, "no compaction");
        }
        assert!(written("journal") >= base, "compacted before the journal was as large as the base");
        let (_, stats) = checkpoint::read_with_stats(&dir).unwrap();
        assert_eq!(stats.journal_records, 0, "the compaction folded the journal in");

        // A failed write (the file gone from under it): an error, then a whole base again.
        std::fs::remove_file(checkpoint::path_in(&dir)).unwrap();
        cache.apply(WatchUpdate::Nodes(Event::Apply(node("node-7", 99_999, "10.3.7.0/24"))));
        writer.next_write = None;
        assert!(writer.reconcile().await.is_err());
        assert_eq!(agent().checkpoint_errors.get(), 1);
        writer.next_write = None;
        writer.reconcile().await.unwrap();
        same_as_stores();
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The first base waits while the agent starts, and is written once it is ready.
    #[tokio::test]
    async fn the_first_write_waits_for_the_agent_to_be_ready() {
        let dir = temp_dir("ready");
        let cache = Cache::new(Default::default(), None);
        list_every_kind(&cache, &[node("node-0", 1, "10.0.0.0/24")]);
        let metrics = Metrics::default();
        let ready = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let check = ready.clone();
        let mut writer = CheckpointWriter::new(cache.clone(), dir.clone(), metrics.clone())
            .first_write_when(Box::new(move || check.load(std::sync::atomic::Ordering::Relaxed)));

        assert!(matches!(writer.reconcile().await.unwrap(), Action::RequeueAfter(READY_POLL)));
        assert!(checkpoint::read(&dir).is_err(), "written while the agent was starting");
        assert_eq!(metrics.of::<AgentMetrics>().checkpoint_written_bytes("base"), 0);

        ready.store(true, std::sync::atomic::Ordering::Relaxed);
        assert!(matches!(writer.reconcile().await.unwrap(), Action::AwaitChange));
        assert_eq!(checkpoint::read(&dir).unwrap().nodes.len(), 1);

        // Later writes do not ask again.
        ready.store(false, std::sync::atomic::Ordering::Relaxed);
        cache.apply(WatchUpdate::Nodes(Event::Apply(node("node-1", 2, "10.0.1.0/24"))));
        writer.next_write = None;
        assert!(matches!(writer.reconcile().await.unwrap(), Action::AwaitChange));
        assert_eq!(checkpoint::read(&dir).unwrap().nodes.len(), 2);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
