//! Controllers as tasks of their own (the kube-runtime shape): each one waits for a change of
//! what it reads, lets a burst of changes settle, reconciles, and when that fails tries again by
//! itself with capped exponential backoff, without waiting for new input and without anyone
//! else re-applying everything.
use std::{future::Future, time::Duration};

pub use crate::health::Status;

use tokio::{
    sync::watch,
    task::JoinHandle,
    time::{sleep_until, Instant},
};

/// What a controller wants after a successful reconcile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Nothing until its inputs change.
    AwaitChange,
    /// Run again after this long even if nothing changes (periodic work: GC, metrics, rescans).
    RequeueAfter(Duration),
}

/// One controller: brings what it owns to what its inputs say.
pub trait Controller: Send + 'static {
    /// For logs and the status.
    fn name(&self) -> &'static str;

    /// An error is retried with backoff by the runner, also when no input changes meanwhile.
    fn reconcile(&mut self) -> impl Future<Output = anyhow::Result<Action>> + Send;
}

/// What wakes a controller: a change of its inputs.
pub trait Trigger: Send + 'static {
    /// Resolves when the inputs changed since the last call; `false` once they never will again.
    fn changed(&mut self) -> impl Future<Output = bool> + Send;
}

/// No input at all: the controller runs at start, on its requeues and its retries.
pub struct NoTrigger;

impl Trigger for NoTrigger {
    async fn changed(&mut self) -> bool {
        false
    }
}

/// An input that may not exist (a feature turned off): none never changes.
impl<T: Trigger> Trigger for Option<T> {
    async fn changed(&mut self) -> bool {
        match self {
            Some(trigger) => trigger.changed().await,
            None => false,
        }
    }
}

impl<T: Send + Sync + 'static> Trigger for watch::Receiver<T> {
    async fn changed(&mut self) -> bool {
        watch::Receiver::changed(self).await.is_ok()
    }
}

/// Either of two inputs changing.
impl<A: Trigger, B: Trigger> Trigger for (A, B) {
    async fn changed(&mut self) -> bool {
        let (a, b) = self;
        tokio::select! {
            true = a.changed() => true,
            true = b.changed() => true,
            else => false,
        }
    }
}

/// Capped exponential backoff: `initial`, doubling after each failure, at most `max`.
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    failures: u32,
}

impl Backoff {
    pub fn new(initial: Duration, max: Duration) -> Self {
        Self { initial, max, failures: 0 }
    }

    /// The wait before the next attempt, one more failure counted.
    pub fn next_delay(&mut self) -> Duration {
        let delay = self.initial.saturating_mul(1 << self.failures.min(16)).min(self.max);
        self.failures = self.failures.saturating_add(1);
        delay
    }

    pub fn reset(&mut self) {
        self.failures = 0;
    }

    pub fn failures(&self) -> u32 {
        self.failures
    }
}

#[derive(Debug, Clone, Copy)]
pub struct RunOptions {
    /// How long after a change the controller runs: a burst of changes is one reconcile.
    pub debounce: Duration,
    /// First retry after a failed reconcile; doubles up to `retry_max`.
    pub retry_initial: Duration,
    pub retry_max: Duration,
}

impl Default for RunOptions {
    fn default() -> Self {
        Self {
            debounce: Duration::from_millis(10),
            retry_initial: Duration::from_secs(1),
            retry_max: Duration::from_secs(30),
        }
    }
}

/// How often a waiting controller task says it is alive.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(10);

/// A spawned controller: its status, and the controller back once stopped.
pub struct Running<C> {
    pub name: &'static str,
    pub status: watch::Receiver<Status>,
    pub task: JoinHandle<C>,
}

impl<C: Send + 'static> Running<C> {
    /// A handle that only says when the task ended.
    pub fn detach(self) -> JoinHandle<()> {
        tokio::spawn(async move {
            let _ = self.task.await;
        })
    }
}

/// The controllers' reconciles by outcome, and how many times in a row each has failed (it is
/// retrying while that is above 0), read from their statuses on every scrape.
pub struct ControllerMetrics(pub Vec<(&'static str, watch::Receiver<Status>)>);

impl std::fmt::Debug for ControllerMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.0.iter().map(|(name, _)| name)).finish()
    }
}

impl prometheus_client::collector::Collector for ControllerMetrics {
    fn encode(&self, mut encoder: prometheus_client::encoding::DescriptorEncoder) -> std::fmt::Result {
        use prometheus_client::metrics::MetricType::{Counter, Gauge};

        use crate::exposition::{series, Value};
        let statuses: Vec<(&str, Status)> =
            self.0.iter().map(|(name, status)| (*name, status.borrow().clone())).collect();
        let reconciles = statuses.iter().flat_map(|(name, status)| {
            [("success", status.successes), ("error", status.runs - status.successes)]
                .map(|(outcome, n)| (Some([("controller", *name), ("outcome", outcome)]), Value::Counter(n)))
        });
        series(
            &mut encoder,
            "kube_router_controller_reconciles_total",
            "Reconciles run by each controller, by outcome.",
            Counter,
            reconciles,
        )?;
        series(
            &mut encoder,
            "kube_router_controller_consecutive_failures",
            "Failed reconciles of each controller since its last success (retried with backoff while above 0).",
            Gauge,
            statuses
                .iter()
                .map(|(name, status)| (Some([("controller", *name)]), Value::IntGauge(i64::from(status.failures)))),
        )
    }
}

/// Runs `controller` on its own task until `stop` turns true (or its sender goes away); a
/// reconcile under way is finished first. The first reconcile runs at once.
pub fn spawn<C: Controller>(
    controller: C,
    trigger: impl Trigger,
    options: RunOptions,
    stop: watch::Receiver<bool>,
) -> Running<C> {
    let (status, status_rx) = watch::channel(Status { last_beat: Some(Instant::now()), ..Status::default() });
    let name = controller.name();
    let task = tokio::spawn(run(controller, trigger, options, stop, status));
    Running { name, status: status_rx, task }
}

async fn run<C: Controller>(
    mut controller: C,
    mut trigger: impl Trigger,
    options: RunOptions,
    mut stop: watch::Receiver<bool>,
    status: watch::Sender<Status>,
) -> C {
    let mut backoff = Backoff::new(options.retry_initial, options.retry_max);
    let mut due = Some(Instant::now());
    let mut inputs_open = true;
    loop {
        if *stop.borrow() {
            break;
        }
        // Due already: run now. A timer would round up to its next millisecond tick, which is
        // the whole latency budget of a Service change.
        let ready = due.is_some_and(|at| at <= Instant::now());
        if !ready {
            tokio::select! {
                biased;
                stopped = stop.changed() => {
                    if stopped.is_err() {
                        break;
                    }
                    continue;
                }
                open = trigger.changed(), if inputs_open => {
                    if open {
                        // A change runs the controller soon, also when it waits for a retry: the
                        // new input may be what it needed. A burst does not push the run later.
                        let soon = Instant::now() + options.debounce;
                        due = Some(due.map_or(soon, |at| at.min(soon)));
                    } else {
                        inputs_open = false;
                    }
                    continue;
                }
                _ = wait_until(due) => {}
                _ = tokio::time::sleep(HEARTBEAT_INTERVAL) => {
                    // Alive and idle; nobody needs waking for that.
                    status.send_if_modified(|s| {
                        s.last_beat = Some(Instant::now());
                        false
                    });
                    continue;
                }
            }
        }
        let result = controller.reconcile().await;
        let now = Instant::now();
        due = match &result {
            Ok(Action::AwaitChange) => None,
            Ok(Action::RequeueAfter(after)) => Some(now + *after),
            Err(_) => Some(now + backoff.next_delay()),
        };
        match result {
            Ok(_) => backoff.reset(),
            Err(e) => {
                // The controller logs its own errors once per reason; this is the trace.
                tracing::debug!(
                    controller = controller.name(),
                    error = format!("{e:#}"),
                    failures = backoff.failures(),
                    "reconcile failed; retrying with backoff"
                );
                status.send_modify(|s| s.last_error = Some(format!("{e:#}")));
            }
        }
        let failures = backoff.failures();
        status.send_modify(|s| {
            s.last_beat = Some(now);
            s.runs += 1;
            s.failures = failures;
            if failures == 0 {
                s.successes += 1;
                s.last_error = None;
            }
        });
    }
    controller
}

/// Resolves at `at`, never without one.
async fn wait_until(at: Option<Instant>) {
    match at {
        Some(at) => sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{
        atomic::{AtomicU32, Ordering},
        Arc,
    };

    use super::*;

    /// Fails its first `failures` reconciles, then succeeds; counts attempts.
    struct Flaky {
        failures: u32,
        attempts: Arc<AtomicU32>,
    }

    impl Controller for Flaky {
        fn name(&self) -> &'static str {
            "flaky"
        }

        async fn reconcile(&mut self) -> anyhow::Result<Action> {
            let attempt = self.attempts.fetch_add(1, Ordering::SeqCst) + 1;
            if attempt <= self.failures {
                anyhow::bail!("attempt {attempt} failed");
            }
            Ok(Action::AwaitChange)
        }
    }

    #[test]
    fn backoff_doubles_up_to_its_cap_and_resets() {
        let mut backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
        let delays: Vec<u64> = (0..8).map(|_| backoff.next_delay().as_secs()).collect();
        assert_eq!(delays, [1, 2, 4, 8, 16, 30, 30, 30]);
        backoff.reset();
        assert_eq!(backoff.next_delay(), Duration::from_secs(1));
    }

    #[tokio::test(start_paused = true)]
    async fn a_failing_controller_retries_by_itself_until_it_succeeds() {
        let attempts = Arc::new(AtomicU32::new(0));
        let (_stop_tx, stop) = watch::channel(false);
        // Its input never changes (the sender is kept, so it is not closed either).
        let (_input_tx, input) = watch::channel(());
        let started = Instant::now();
        let running = spawn(Flaky { failures: 3, attempts: attempts.clone() }, input, RunOptions::default(), stop);
        let mut status = running.status.clone();
        let done = status.wait_for(|s| s.successes == 1).await.unwrap().clone();
        assert_eq!(attempts.load(Ordering::SeqCst), 4, "three failures, then the success");
        assert_eq!(done.runs, 4);
        assert_eq!((done.failures, done.last_error), (0, None));
        // Retries after 1, 2 and 4 s of (paused, auto-advanced) time.
        assert_eq!(started.elapsed().as_secs(), 7);
        // Nothing more runs once it succeeded and nothing changes.
        tokio::time::sleep(Duration::from_secs(120)).await;
        assert_eq!(attempts.load(Ordering::SeqCst), 4);
    }

    #[tokio::test(start_paused = true)]
    async fn a_change_runs_a_waiting_controller_after_the_debounce_and_a_burst_runs_it_once() {
        let attempts = Arc::new(AtomicU32::new(0));
        let (_stop_tx, stop) = watch::channel(false);
        let (input_tx, input) = watch::channel(0);
        let running = spawn(Flaky { failures: 0, attempts: attempts.clone() }, input, RunOptions::default(), stop);
        let mut status = running.status.clone();
        status.wait_for(|s| s.runs == 1).await.unwrap();
        for n in 1..=5 {
            input_tx.send(n).unwrap();
            tokio::task::yield_now().await;
        }
        status.wait_for(|s| s.runs == 2).await.unwrap();
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(attempts.load(Ordering::SeqCst), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_change_during_a_backoff_runs_the_controller_without_waiting_for_it() {
        let attempts = Arc::new(AtomicU32::new(0));
        let (_stop_tx, stop) = watch::channel(false);
        let (input_tx, input) = watch::channel(0);
        // Fails six times: the backoff has grown to 30 s by then.
        let running = spawn(Flaky { failures: 6, attempts: attempts.clone() }, input, RunOptions::default(), stop);
        let mut status = running.status.clone();
        status.wait_for(|s| s.failures == 6).await.unwrap();
        let failed_at = Instant::now();
        input_tx.send(1).unwrap();
        status.wait_for(|s| s.successes == 1).await.unwrap();
        assert!(failed_at.elapsed() < Duration::from_secs(1), "ran at the change, not after the 30 s backoff");
    }

    #[tokio::test(start_paused = true)]
    async fn stopping_returns_the_controller() {
        let attempts = Arc::new(AtomicU32::new(0));
        let (stop_tx, stop) = watch::channel(false);
        let running =
            spawn(Flaky { failures: u32::MAX, attempts: attempts.clone() }, NoTrigger, RunOptions::default(), stop);
        let mut status = running.status.clone();
        status.wait_for(|s| s.runs >= 2).await.unwrap();
        stop_tx.send(true).unwrap();
        let controller = running.task.await.unwrap();
        assert_eq!(controller.failures, u32::MAX);
    }
}
