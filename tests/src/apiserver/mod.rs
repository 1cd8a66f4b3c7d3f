//! A small fake Kubernetes API server for end-to-end tests.
//!
//! It speaks enough of the real HTTP API (LIST with selectors and pagination, GET, WATCH with
//! resume, bookmarks and in-stream 410s) for unmodified kube-rs clients, watchers and reflectors,
//! over plain HTTP without auth. Tests drive it through [`FakeApiServer`]'s methods: store
//! objects, delete them, compact history, and inject faults with [`FaultMode`].
//!
//! ```ignore
//! # async fn example() -> anyhow::Result<()> {
//! use crate::apiserver::{FakeApiServer, FakeApiServerConfig};
//! let server = FakeApiServer::spawn(FakeApiServerConfig::default()).await?;
//! server.apply(serde_json::json!({
//!     "apiVersion": "v1", "kind": "Service",
//!     "metadata": {"name": "web", "namespace": "default"},
//! }))?;
//! // kube::Config::new(server.url().parse()?) then kube::Client::try_from(config)
//! # Ok(()) }
//! ```

mod fault;
mod http;
mod listener;
pub mod resources;
mod selector;
mod store;
mod watch;

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use serde_json::Value;
use tokio::task::JoinHandle;

pub use fault::{FaultMode, StalledRelease};

use listener::RunningListener;
use store::Store;

/// Settings fixed when the server is spawned.
#[derive(Debug, Clone)]
pub struct FakeApiServerConfig {
    /// Where to listen; port 0 picks a free port (kept across stop/start and `Refuse`).
    pub bind_address: SocketAddr,
    /// How often every watch that asked for bookmarks gets a BOOKMARK at the current revision;
    /// `None` sends none (except those requested with `FakeApiServer::send_bookmarks`).
    pub bookmark_interval: Option<Duration>,
    /// How many change events are kept for watch resumption; resuming from before the oldest
    /// kept event gets an in-stream 410 Expired.
    pub history_limit: usize,
    /// Server-side cap on a watch's lifetime, applied on top of the client's `timeoutSeconds`,
    /// to make clients reconnect often (real apiservers cap watches too).
    pub max_watch_duration: Option<Duration>,
    /// Initial policy for work stalled by [`FaultMode::BlackHole`].
    pub stalled_release: StalledRelease,
}

impl Default for FakeApiServerConfig {
    fn default() -> Self {
        Self {
            bind_address: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
            bookmark_interval: Some(Duration::from_secs(1)),
            history_limit: 1000,
            max_watch_duration: None,
            stalled_release: StalledRelease::default(),
        }
    }
}

/// One request as it arrived, for tests that check client retry behaviour.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestRecord {
    /// Time since the server was spawned.
    pub at: Duration,
    pub method: String,
    /// Path and query, as sent.
    pub uri: String,
    /// The fault mode in force when it arrived.
    pub mode: FaultMode,
}

/// Requests kept in the log; older ones are dropped.
const REQUEST_LOG_LIMIT: usize = 10_000;

/// State shared by the handle, the listener and every connection.
struct Shared {
    store: Mutex<Store>,
    modes: tokio::sync::watch::Sender<FaultMode>,
    stalled_release: Mutex<StalledRelease>,
    /// Bumped to end every open watch stream.
    watch_generation: tokio::sync::watch::Sender<u64>,
    open_watches: AtomicUsize,
    requests: Mutex<Vec<RequestRecord>>,
    max_watch_duration: Option<Duration>,
    started_at: Instant,
}

impl Shared {
    fn store(&self) -> MutexGuard<'_, Store> {
        lock(&self.store)
    }

    fn stalled_release(&self) -> StalledRelease {
        *lock(&self.stalled_release)
    }

    fn record_request(&self, method: &str, uri: &str) {
        let record = RequestRecord {
            at: self.started_at.elapsed(),
            method: method.to_string(),
            uri: uri.to_string(),
            mode: self.modes.borrow().clone(),
        };
        let mut requests = lock(&self.requests);
        if requests.len() >= REQUEST_LOG_LIMIT {
            requests.remove(0);
        }
        requests.push(record);
    }
}

/// A panic while holding a lock cannot leave this server's data half-updated in a way that
/// matters to tests, so poisoning is ignored rather than cascading panics.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

struct ListenerControl {
    running: Option<RunningListener>,
    /// Set by `stop()`; listening resumes only on `start()`.
    stopped: bool,
}

/// Handle to a running fake API server. Dropping it shuts the server down.
pub struct FakeApiServer {
    shared: Arc<Shared>,
    address: SocketAddr,
    listener: tokio::sync::Mutex<ListenerControl>,
    bookmark_ticker: Option<JoinHandle<()>>,
}

impl FakeApiServer {
    /// Binds and starts serving. Must be called inside a Tokio runtime.
    pub async fn spawn(config: FakeApiServerConfig) -> anyhow::Result<Self> {
        let shared = Arc::new(Shared {
            store: Mutex::new(Store::new(config.history_limit)),
            modes: tokio::sync::watch::Sender::new(FaultMode::Normal),
            stalled_release: Mutex::new(config.stalled_release),
            watch_generation: tokio::sync::watch::Sender::new(0),
            open_watches: AtomicUsize::new(0),
            requests: Mutex::new(Vec::new()),
            max_watch_duration: config.max_watch_duration,
            started_at: Instant::now(),
        });
        let (running, address) = RunningListener::bind(config.bind_address, shared.clone())
            .with_context(|| format!("binding fake apiserver to {}", config.bind_address))?;
        let bookmark_ticker = config.bookmark_interval.map(|interval| {
            let shared = shared.clone();
            tokio::spawn(async move {
                let mut ticks = tokio::time::interval(interval);
                ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                ticks.tick().await; // the first tick is immediate
                loop {
                    ticks.tick().await;
                    shared.store().broadcast_bookmark();
                }
            })
        });
        tracing::debug!(%address, "fake apiserver listening");
        Ok(Self {
            shared,
            address,
            listener: tokio::sync::Mutex::new(ListenerControl { running: Some(running), stopped: false }),
            bookmark_ticker,
        })
    }

    /// The bound address (the real port when 0 was asked for).
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// `http://ADDRESS:PORT`, the cluster URL to give kube-rs.
    pub fn url(&self) -> String {
        format!("http://{}", self.address)
    }

    /// A kubeconfig document pointing at this server, for agents run as separate processes.
    pub fn kubeconfig_yaml(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {url}\n\
             users:\n- name: fake\n  user: {{}}\ncontexts:\n- name: fake\n  context:\n    \
             cluster: fake\n    user: fake\ncurrent-context: fake\n",
            url = self.url()
        )
    }

    /// Creates or replaces an object (JSON or any serializable Kubernetes type with apiVersion
    /// and kind). Fills in namespace (`default`), uid and creationTimestamp when missing, sets a
    /// new resourceVersion, and emits ADDED or MODIFIED. Returns the object as stored.
    pub fn apply(&self, object: impl Serialize) -> anyhow::Result<Value> {
        let object = serde_json::to_value(object).context("serializing object to apply")?;
        self.shared.store().apply(object)
    }

    /// Applies every document of a multi-document YAML text (empty documents are skipped).
    pub fn apply_yaml(&self, yaml: &str) -> anyhow::Result<()> {
        use serde::Deserialize;
        for doc in serde_norway::Deserializer::from_str(yaml) {
            let value = serde_norway::Value::deserialize(doc).context("parsing YAML to apply")?;
            if !value.is_null() {
                self.apply(value)?;
            }
        }
        Ok(())
    }

    /// Deletes an object (`namespace` is ignored for cluster-scoped kinds) and emits DELETED.
    /// Returns the deleted object, or `None` if there was none.
    pub fn delete(&self, kind: &str, namespace: Option<&str>, name: &str) -> anyhow::Result<Option<Value>> {
        self.shared.store().delete(kind, namespace, name)
    }

    /// The stored object, if any.
    pub fn get(&self, kind: &str, namespace: Option<&str>, name: &str) -> Option<Value> {
        self.shared.store().get(kind, namespace, name)
    }

    /// The current global resource version.
    pub fn resource_version(&self) -> u64 {
        self.shared.store().resource_version()
    }

    /// Drops all event history: a watch resuming from any revision seen so far gets an
    /// in-stream 410 Expired, which makes kube-rs relist. Open streams are not affected
    /// (combine with [`Self::close_watches`] to force the resume).
    pub fn compact(&self) {
        self.shared.store().compact();
    }

    /// Sends a BOOKMARK at the current revision to every watch that asked for bookmarks.
    pub fn send_bookmarks(&self) {
        self.shared.store().broadcast_bookmark();
    }

    /// Ends every open watch stream cleanly, as an apiserver does at a watch's timeout.
    pub fn close_watches(&self) {
        self.shared.watch_generation.send_modify(|generation| *generation += 1);
    }

    /// Number of watch streams currently open (including stalled ones).
    pub fn open_watches(&self) -> usize {
        self.shared.open_watches.load(Ordering::SeqCst)
    }

    /// Waits until at least `count` watch streams are open; false on timeout.
    pub async fn wait_for_open_watches(&self, count: usize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while self.open_watches() < count {
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        true
    }

    /// Every request received so far (bounded), oldest first.
    pub fn requests(&self) -> Vec<RequestRecord> {
        lock(&self.shared.requests).clone()
    }

    pub fn mode(&self) -> FaultMode {
        self.shared.modes.borrow().clone()
    }

    /// Switches the fault mode. Entering `Refuse` closes the port and all connections; leaving it
    /// listens again on the same port (unless `stop()` was called).
    pub async fn set_mode(&self, mode: FaultMode) -> anyhow::Result<()> {
        let mut control = self.listener.lock().await;
        tracing::debug!(?mode, "fake apiserver fault mode");
        self.shared.modes.send_replace(mode.clone());
        if mode == FaultMode::Refuse {
            if let Some(running) = control.running.take() {
                running.shut_down().await;
            }
            Ok(())
        } else if control.stopped {
            Ok(())
        } else {
            self.listen(&mut control)
        }
    }

    /// Changes what happens to black-holed work when `BlackHole` is left.
    pub fn set_stalled_release(&self, release: StalledRelease) {
        *lock(&self.shared.stalled_release) = release;
    }

    /// Stops listening and closes every connection (stalled ones included). State is kept.
    pub async fn stop(&self) {
        let mut control = self.listener.lock().await;
        control.stopped = true;
        if let Some(running) = control.running.take() {
            running.shut_down().await;
        }
    }

    /// Listens again on the same address after `stop()` (stays closed while in `Refuse`).
    pub async fn start(&self) -> anyhow::Result<()> {
        let mut control = self.listener.lock().await;
        control.stopped = false;
        if self.mode() == FaultMode::Refuse {
            return Ok(());
        }
        self.listen(&mut control)
    }

    fn listen(&self, control: &mut ListenerControl) -> anyhow::Result<()> {
        if control.running.is_none() {
            let (running, _) = RunningListener::bind(self.address, self.shared.clone())
                .with_context(|| format!("re-binding fake apiserver to {}", self.address))?;
            control.running = Some(running);
        }
        Ok(())
    }
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        if let Some(ticker) = self.bookmark_ticker.take() {
            ticker.abort();
        }
        // The running listener aborts its tasks when dropped with the mutex.
    }
}
