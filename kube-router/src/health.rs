//! Health that tells the truth: liveness from every controller task's heartbeat, readiness from
//! the first complete sync (docs/operations.md, "Health").
//!
//! * Live (`/livez`, `/healthz`): every controller task still runs and has beaten within
//!   [`STUCK_AFTER`] (a waiting task beats every `runtime::HEARTBEAT_INTERVAL`, a reconcile beats
//!   when it ends). A failing reconcile retried with backoff is alive: an unreachable API server
//!   never makes the agent unhealthy, or kubelet would restart it for nothing.
//! * Ready (`/readyz`): live, and once the desired state was complete (listed from the API
//!   server or restored from the checkpoint) every controller reconciled successfully. It
//!   latches: an API outage afterwards changes nothing.
use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use tokio::{sync::watch, time::Instant};

/// A controller's state as its task last left it: what tests wait on instead of log lines.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Status {
    /// Reconciles run, successful or not.
    pub runs: u64,
    /// Reconciles that succeeded.
    pub successes: u64,
    /// Failures since the last success.
    pub failures: u32,
    pub last_error: Option<String>,
    /// When the task last showed it is alive: a reconcile ended, or it waited
    /// [`HEARTBEAT_INTERVAL`] for work. Stale only while a reconcile hangs, or the task is gone.
    pub last_beat: Option<Instant>,
}

/// A controller whose task has not beaten for this long hangs in a reconcile.
pub const STUCK_AFTER: Duration = Duration::from_secs(180);

/// Whether the desired state is complete (API listed, or restored from the checkpoint).
pub type Synced = Arc<dyn Fn() -> bool + Send + Sync>;

#[derive(Default)]
pub struct Health {
    controllers: Mutex<Vec<(&'static str, watch::Receiver<Status>)>>,
    synced: Mutex<Option<Synced>>,
    ready: AtomicBool,
}

/// The verdict of one look at the controllers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub live: bool,
    pub ready: bool,
    /// What is wrong, one line per controller.
    pub problems: Vec<String>,
}

impl Health {
    /// The controllers to watch, and what says the desired state is complete. Until this is
    /// called the agent is starting: live, not ready.
    pub fn watch(&self, controllers: Vec<(&'static str, watch::Receiver<Status>)>, synced: Synced) {
        *self.controllers.lock().unwrap_or_else(|p| p.into_inner()) = controllers;
        *self.synced.lock().unwrap_or_else(|p| p.into_inner()) = Some(synced);
    }

    pub fn check(&self) -> Verdict {
        let now = Instant::now();
        let controllers = self.controllers.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let mut problems = Vec::new();
        let mut all_succeeded = !controllers.is_empty();
        for (name, status) in &controllers {
            // The sender lives in the controller's task: gone means the task ended (panicked).
            if status.has_changed().is_err() {
                problems.push(format!("controller {name}: task ended"));
                continue;
            }
            let status = status.borrow().clone();
            let since = status.last_beat.map(|beat| now.saturating_duration_since(beat));
            if since.is_some_and(|since| since > STUCK_AFTER) {
                let since = since.unwrap_or_default().as_secs();
                problems.push(format!("controller {name}: no heartbeat for {since} s (stuck in a reconcile)"));
            }
            all_succeeded &= status.successes > 0 && status.failures == 0;
        }
        let live = problems.is_empty();
        let synced = self.synced.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if live && all_succeeded && synced.is_some_and(|synced| synced()) {
            self.ready.store(true, Ordering::Relaxed);
        }
        Verdict { live, ready: live && self.ready.load(Ordering::Relaxed), problems }
    }
}

#[cfg(test)]
mod tests {
    use std::future::pending;

    use super::*;
    use crate::runtime::{spawn, Action, Controller, NoTrigger, RunOptions};

    /// Succeeds, fails, hangs, panics or waits for input at its second reconcile, as told.
    struct Scripted {
        second: &'static str,
        runs: u32,
    }

    impl Controller for Scripted {
        fn name(&self) -> &'static str {
            "scripted"
        }

        async fn reconcile(&mut self) -> anyhow::Result<Action> {
            self.runs += 1;
            if self.runs >= 2 {
                match self.second {
                    "fail" => anyhow::bail!("API server unreachable"),
                    "hang" => pending::<()>().await,
                    "panic" => panic!("a bug"),
                    "idle" => return Ok(Action::AwaitChange),
                    _ => {}
                }
            }
            Ok(Action::RequeueAfter(Duration::from_secs(1)))
        }
    }

    fn health_of(second: &'static str, synced: bool) -> (Health, watch::Sender<bool>) {
        let (stop_tx, stop) = watch::channel(false);
        let running = spawn(Scripted { second, runs: 0 }, NoTrigger, RunOptions::default(), stop);
        let health = Health::default();
        health.watch(vec![("scripted", running.status.clone())], Arc::new(move || synced));
        (health, stop_tx)
    }

    #[tokio::test(start_paused = true)]
    async fn failing_reconciles_with_the_api_down_stay_live_for_ever() {
        let (health, _stop) = health_of("fail", true);
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert!(health.check().ready, "synced and reconciled once: ready");
        // An hour of failing retries (the backoff caps at 30 s): alive, and still ready.
        tokio::time::sleep(Duration::from_secs(3600)).await;
        let verdict = health.check();
        assert_eq!((verdict.live, verdict.ready), (true, true), "{:?}", verdict.problems);
    }

    #[tokio::test(start_paused = true)]
    async fn a_panicked_controller_fails_liveness_naming_it() {
        let (health, _stop) = health_of("panic", true);
        tokio::time::sleep(Duration::from_secs(2)).await;
        let verdict = health.check();
        assert!(!verdict.live && !verdict.ready);
        assert_eq!(verdict.problems, ["controller scripted: task ended"]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_hanging_reconcile_fails_liveness_after_the_bound_only() {
        let (health, _stop) = health_of("hang", true);
        tokio::time::sleep(STUCK_AFTER).await;
        assert!(health.check().live, "not yet: a reconcile may take a while");
        tokio::time::sleep(Duration::from_secs(5)).await;
        let verdict = health.check();
        assert!(!verdict.live);
        assert!(verdict.problems[0].contains("no heartbeat"), "{:?}", verdict.problems);
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_controller_stays_live_and_ready_waits_for_the_sync() {
        // Waits for a change that never comes: only the runner's idle heartbeat shows it alive.
        let (health, _stop) = health_of("idle", false);
        tokio::time::sleep(Duration::from_secs(3600)).await;
        let verdict = health.check();
        assert_eq!((verdict.live, verdict.ready), (true, false), "not synced: not ready");
    }

    #[test]
    fn before_the_controllers_start_the_agent_is_live_and_not_ready() {
        let verdict = Health::default().check();
        assert_eq!((verdict.live, verdict.ready), (true, false));
    }
}
