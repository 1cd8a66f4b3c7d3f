//! The checkpoint writer: every kind, after each change, once all have been listed completely,
//! so a restart during an outage has the same Services, Nodes and policies.
use std::{
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::Result;

use crate::{
    k8s::{cache::Cache, checkpoint, watch::Kind},
    metrics::{AgentMetrics, Metrics},
    runtime::{Action, Controller},
};

pub const CHECKPOINT_KINDS: &[Kind] =
    &[Kind::Services, Kind::EndpointSlices, Kind::Pods, Kind::Namespaces, Kind::Nodes, Kind::NetworkPolicies];

/// At most one write this often.
const MIN_INTERVAL: Duration = Duration::from_secs(1);
/// A write takes time in proportion to the cluster (a 150,000-pod cluster's checkpoint is
/// ~100 MiB): the next waits this many times as long as the last took, so writing costs at
/// most 1/20 of a core however large the cluster, at the price of a checkpoint that many
/// seconds older when the API goes away.
const INTERVAL_PER_WRITE_TIME: u32 = 20;

pub struct CheckpointWriter {
    cache: Arc<Cache>,
    state_dir: PathBuf,
    metrics: Metrics,
    /// The changes already written.
    written: u64,
    /// No write before this.
    next_write: Option<Instant>,
}

impl CheckpointWriter {
    pub fn new(cache: Arc<Cache>, state_dir: PathBuf, metrics: Metrics) -> Self {
        // What was restored is already on disk.
        Self { cache, state_dir, metrics, written: 0, next_write: None }
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
        let started = Instant::now();
        // A snapshot is a pointer per object; the copy and the write happen off the cache's lock.
        let snapshot = self.cache.with(|o| o.snapshot());
        let state_dir = self.state_dir.clone();
        let written = tokio::task::spawn_blocking(move || checkpoint::write_payload(&state_dir, &snapshot)).await?;
        let took = started.elapsed();
        self.next_write = Some(started + MIN_INTERVAL.max(took * INTERVAL_PER_WRITE_TIME));
        self.metrics.of::<AgentMetrics>().checkpoint_write_seconds.set(took.as_secs_f64());
        if let Err(e) = written {
            tracing::error!(error = %e, "cannot write checkpoint");
            self.metrics.of::<AgentMetrics>().checkpoint_errors.inc();
            return Err(e.into());
        }
        self.written = generation;
        Ok(Action::AwaitChange)
    }
}
