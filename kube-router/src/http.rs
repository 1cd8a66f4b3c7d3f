//! The agent's small HTTP/1.x servers (health probes, metrics, Service health check ports),
//! built to stay up in front of a hostile client: every pod can reach the node's ports.
//!
//! * Bounded connections: the node itself (loopback, or a peer using the very address it
//!   connected to: the kubelet probing a hostNetwork pod) has a pool of its own, so nothing a pod
//!   does takes the probe's slots; other peers share a pool with a cap per peer address. A
//!   connection over a limit is closed at once, counted.
//! * One deadline for reading the request and one for writing the answer: an idle or
//!   trickling (slowloris) connection holds its slot for `request_timeout` at most.
//! * `accept()` errors (EMFILE, ECONNABORTED, ...) never end the server nor spin: each is
//!   counted, logged once per kind, and the loop backs off briefly.
use std::{
    collections::{BTreeSet, HashMap},
    net::{IpAddr, SocketAddr},
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::{OwnedSemaphorePermit, Semaphore},
};

use crate::{
    exposition::{register, Counter, Family},
    metrics::{Labels, Metrics, Subsystem},
};

/// Connections refused and failed accepts of every HTTP server of the agent.
#[derive(Default)]
pub struct HttpMetrics {
    /// (server, reason) -> connections closed unanswered: over a limit, or too slow.
    rejected: Family<Labels<2>, Counter>,
    /// (server, errno name) -> failed `accept()` calls.
    accept_errors: Family<Labels<2>, Counter>,
}

impl HttpMetrics {
    pub(crate) fn count_rejected(&self, server: &'static str, reason: &'static str) {
        self.rejected.get_or_create(&[("server", server), ("reason", reason)]).inc();
    }

    pub(crate) fn count_accept_error(&self, server: &'static str, error: &'static str) {
        self.accept_errors.get_or_create(&[("server", server), ("error", error)]).inc();
    }
}

impl Subsystem for HttpMetrics {
    fn register(this: &Arc<Self>, registry: &mut prometheus_client::registry::Registry) {
        register(
            registry,
            "kube_router_http_connections_rejected_total",
            "Connections to the agent's HTTP servers closed unanswered, by server and reason (a limit, or a timeout).",
            this.rejected.clone(),
        );
        register(
            registry,
            "kube_router_http_accept_errors_total",
            "Failed accept() calls of the agent's HTTP servers, by server and error (each followed by a short backoff).",
            this.accept_errors.clone(),
        );
    }
}

#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Concurrent connections from the node itself.
    pub local: usize,
    /// Concurrent connections from every other peer together.
    pub remote: usize,
    /// Concurrent connections from one other peer address.
    pub per_peer: usize,
    /// Reading the request, and then writing the answer, each within this.
    pub request_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self { local: 32, remote: 128, per_peer: 8, request_timeout: Duration::from_secs(5) }
    }
}

/// An answer: status line, content type, body.
pub struct Response {
    pub status: &'static str,
    pub content_type: &'static str,
    pub body: String,
}

impl Response {
    pub fn new(status: &'static str, content_type: &'static str, body: String) -> Self {
        Self { status, content_type, body }
    }

    /// Status line and headers. The body is written after them as it is: a copy of a
    /// 10,000-Service metrics page beside the page itself was tens of MiB at every scrape.
    fn head(&self) -> String {
        format!(
            "HTTP/1.1 {}\r\nContent-Type: {}\r\nX-Content-Type-Options: nosniff\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            self.status,
            self.content_type,
            self.body.len(),
        )
    }
}

/// Answers `GET <path>`; `None` closes the connection without an answer.
pub type Handler = Arc<dyn Fn(&str) -> Option<Response> + Send + Sync>;

/// First wait after a failed `accept()`; doubles up to [`ACCEPT_BACKOFF_MAX`].
const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(10);
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);
/// Requests are a line and a few headers: more is not read.
const MAX_REQUEST: usize = 4096;

/// Where connections come from: a listening socket (tests inject failures).
pub trait Accept: Send + 'static {
    fn accept(&mut self) -> impl std::future::Future<Output = std::io::Result<(TcpStream, SocketAddr)>> + Send;
}

impl Accept for TcpListener {
    async fn accept(&mut self) -> std::io::Result<(TcpStream, SocketAddr)> {
        TcpListener::accept(self).await
    }
}

/// Serves `listener` forever. `server` names it in logs and metrics.
pub async fn serve(
    mut listener: impl Accept,
    server: &'static str,
    limits: Limits,
    metrics: Metrics,
    handler: Handler,
) {
    let pools = Pools::new(limits);
    let counted = metrics.of::<HttpMetrics>();
    let mut logged_errors: BTreeSet<&'static str> = BTreeSet::new();
    let mut backoff = ACCEPT_BACKOFF_MIN;
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => {
                backoff = ACCEPT_BACKOFF_MIN;
                accepted
            }
            Err(e) => {
                let kind = accept_error_kind(&e);
                counted.count_accept_error(server, kind);
                if logged_errors.insert(kind) {
                    tracing::error!(server, error = %e, "accept() failed; backing off (logged once per kind, counted)");
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(ACCEPT_BACKOFF_MAX);
                continue;
            }
        };
        let local = stream.local_addr().map(|a| a.ip()).ok();
        let slot = match pools.admit(peer.ip(), local) {
            Ok(slot) => slot,
            Err(reason) => {
                counted.count_rejected(server, reason);
                drop(stream);
                continue;
            }
        };
        let (handler, counted) = (handler.clone(), counted.clone());
        tokio::spawn(async move {
            let _slot = slot;
            if !answer(stream, &handler, limits.request_timeout).await {
                counted.count_rejected(server, "timeout");
            }
        });
    }
}

/// Reads one request and answers it; false when the client was too slow.
async fn answer(mut stream: TcpStream, handler: &Handler, timeout: Duration) -> bool {
    let mut buf = vec![0u8; MAX_REQUEST];
    let read = tokio::time::timeout(timeout, async {
        let mut len = 0;
        while len < buf.len() {
            match stream.read(&mut buf[len..]).await {
                Ok(0) | Err(_) => break,
                Ok(n) => len += n,
            }
            if buf[..len].windows(4).any(|w| w == b"\r\n\r\n") || buf[..len].windows(2).any(|w| w == b"\n\n") {
                break;
            }
        }
        len
    })
    .await;
    let Ok(len) = read else { return false };
    let request = String::from_utf8_lossy(&buf[..len]);
    let path = request.split_whitespace().nth(1).unwrap_or("/");
    let Some(response) = handler(path) else { return true };
    let write = async {
        stream.write_all(response.head().as_bytes()).await?;
        stream.write_all(response.body.as_bytes()).await
    };
    tokio::time::timeout(timeout, write).await.is_ok()
}

/// The name of an `accept()` error, for its log line and metric label.
fn accept_error_kind(e: &std::io::Error) -> &'static str {
    match e.raw_os_error() {
        Some(libc::EMFILE) => "EMFILE",
        Some(libc::ENFILE) => "ENFILE",
        Some(libc::ENOBUFS) => "ENOBUFS",
        Some(libc::ENOMEM) => "ENOMEM",
        Some(libc::ECONNABORTED) => "ECONNABORTED",
        Some(libc::EPERM) => "EPERM",
        Some(libc::EPROTO) => "EPROTO",
        _ => "other",
    }
}

/// Connections held per peer address (other than the node's own).
type PeerCounts = Arc<Mutex<HashMap<IpAddr, usize>>>;

/// The connection pools of one server.
struct Pools {
    limits: Limits,
    local: Arc<Semaphore>,
    remote: Arc<Semaphore>,
    per_peer: PeerCounts,
}

/// A connection's place in its pool, given back when dropped.
pub struct Slot {
    _permit: OwnedSemaphorePermit,
    peer: Option<(IpAddr, PeerCounts)>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some((ip, counts)) = &self.peer {
            let mut counts = counts.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(n) = counts.get_mut(ip) {
                *n -= 1;
                if *n == 0 {
                    counts.remove(ip);
                }
            }
        }
    }
}

impl Pools {
    fn new(limits: Limits) -> Self {
        Self {
            limits,
            local: Arc::new(Semaphore::new(limits.local)),
            remote: Arc::new(Semaphore::new(limits.remote)),
            per_peer: Default::default(),
        }
    }

    /// A slot for a connection from `peer` to `local`, or why there is none.
    fn admit(&self, peer: IpAddr, local: Option<IpAddr>) -> Result<Slot, &'static str> {
        let peer = peer.to_canonical();
        if peer.is_loopback() || local.map(|l| l.to_canonical()) == Some(peer) {
            let permit = self.local.clone().try_acquire_owned().map_err(|_| "local_limit")?;
            return Ok(Slot { _permit: permit, peer: None });
        }
        let mut counts = self.per_peer.lock().unwrap_or_else(|p| p.into_inner());
        if counts.get(&peer).is_some_and(|n| *n >= self.limits.per_peer) {
            return Err("peer_limit");
        }
        let permit = self.remote.clone().try_acquire_owned().map_err(|_| "connection_limit")?;
        *counts.entry(peer).or_default() += 1;
        Ok(Slot { _permit: permit, peer: Some((peer, self.per_peer.clone())) })
    }
}

/// Serves the health endpoints (`/healthz`, `/livez`, `/readyz`) and nothing else: the
/// kubelet probes them on the node's address, where every pod reaches them too.
pub async fn serve_health(metrics: Metrics, listener: TcpListener) {
    let health = metrics.clone();
    let handler: Handler = Arc::new(move |path| Some(health_response(&health, path)));
    serve(listener, "health", Limits::default(), metrics, handler).await
}

fn health_response(metrics: &Metrics, path: &str) -> Response {
    let readiness = match path {
        "/healthz" | "/livez" => false,
        "/readyz" => true,
        _ => return Response::new("404 Not Found", "text/plain", "not found\n".to_string()),
    };
    let (ok, body) = metrics.health(readiness);
    Response::new(if ok { "200 OK" } else { "503 Service Unavailable" }, "application/json", body)
}

/// Serves the metrics at `path`, the status pages (`/bgp`) and the health endpoints.
pub async fn serve_metrics(metrics: Metrics, listener: TcpListener, path: String) {
    let state = metrics.clone();
    let handler: Handler = Arc::new(move |request| {
        Some(if request == path {
            Response::new("200 OK", crate::exposition::CONTENT_TYPE, state.render())
        } else if let Some(text) = state.page(request.trim_start_matches('/')) {
            Response::new("200 OK", "text/plain", text)
        } else {
            health_response(&state, request)
        })
    });
    serve(listener, "metrics", Limits::default(), metrics, handler).await
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(10, 0, 0, last))
    }

    #[test]
    fn one_peer_cannot_take_the_nodes_own_slots_nor_every_remote_one() {
        let pools = Pools::new(Limits { local: 2, remote: 3, per_peer: 2, ..Limits::default() });
        let node = ip(1);
        let held: Vec<Slot> = (0..2).map(|_| pools.admit(ip(9), Some(node)).unwrap()).collect();
        assert_eq!(pools.admit(ip(9), Some(node)).err(), Some("peer_limit"));
        let other = pools.admit(ip(8), Some(node)).unwrap();
        assert_eq!(pools.admit(ip(7), Some(node)).err(), Some("connection_limit"));
        // The node's own address and loopback have their pool, whatever the others hold.
        let probe = pools.admit(node, Some(node)).unwrap();
        let lo = pools.admit("::ffff:127.0.0.1".parse().unwrap(), Some(node)).unwrap();
        assert_eq!(pools.admit(IpAddr::V4(Ipv4Addr::LOCALHOST), Some(node)).err(), Some("local_limit"));
        drop((probe, lo, other));
        drop(held);
        assert!(pools.per_peer.lock().unwrap().is_empty(), "slots given back on drop");
        pools.admit(ip(9), Some(node)).unwrap();
    }

    async fn get(addr: SocketAddr, path: &str) -> String {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes()).await.unwrap();
        let mut reply = String::new();
        stream.read_to_string(&mut reply).await.unwrap();
        reply
    }

    async fn server(limits: Limits) -> (SocketAddr, Metrics) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let metrics = Metrics::default();
        let handler: Handler = Arc::new(|path| Some(Response::new("200 OK", "text/plain", format!("{path}\n"))));
        tokio::spawn(serve(listener, "test", limits, metrics.clone(), handler));
        (addr, metrics)
    }

    /// Idle connections holding every slot are closed at their deadline; new requests are
    /// answered after that, and excess connections are refused at once, counted.
    #[tokio::test]
    async fn idle_connections_are_dropped_at_the_deadline_and_excess_ones_at_once() {
        let limits = Limits { local: 4, request_timeout: Duration::from_millis(300), ..Limits::default() };
        let (addr, metrics) = server(limits).await;
        let mut idle = Vec::new();
        for _ in 0..4 {
            idle.push(TcpStream::connect(addr).await.unwrap());
        }
        // A fifth is over the limit: closed without an answer.
        let mut excess = TcpStream::connect(addr).await.unwrap();
        let mut buf = [0u8; 16];
        let n = tokio::time::timeout(Duration::from_secs(2), excess.read(&mut buf)).await.unwrap().unwrap_or(0);
        assert_eq!(n, 0, "closed at once");
        // The idle ones are closed by their deadline, then the server answers again.
        for stream in &mut idle {
            let n = tokio::time::timeout(Duration::from_secs(2), stream.read(&mut buf)).await.unwrap().unwrap_or(0);
            assert_eq!(n, 0);
        }
        assert!(get(addr, "/x").await.ends_with("\r\n\r\n/x\n"));
        let rejected = |reason| {
            metrics.of::<HttpMetrics>().rejected.get(&[("server", "test"), ("reason", reason)]).map(|c| c.get())
        };
        assert_eq!((rejected("local_limit"), rejected("timeout")), (Some(1), Some(4)));
    }

    /// Fails `errors` accepts with EMFILE, then accepts for real, noting when each call came.
    struct FailingListener {
        inner: TcpListener,
        errors: usize,
        calls: Arc<Mutex<Vec<std::time::Instant>>>,
    }

    impl Accept for FailingListener {
        async fn accept(&mut self) -> std::io::Result<(TcpStream, SocketAddr)> {
            if self.errors > 0 {
                self.errors -= 1;
                self.calls.lock().unwrap().push(std::time::Instant::now());
                return Err(std::io::Error::from_raw_os_error(libc::EMFILE));
            }
            self.inner.accept().await
        }
    }

    /// A failing accept() is counted and retried after a growing pause (10, 20, 40, 80 ms ...):
    /// the server neither ends nor spins, and answers once accept() works again.
    #[tokio::test]
    async fn accept_errors_back_off_and_the_server_survives_them() {
        let inner = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = inner.local_addr().unwrap();
        let calls = Arc::new(Mutex::new(Vec::new()));
        let listener = FailingListener { inner, errors: 5, calls: calls.clone() };
        let metrics = Metrics::default();
        let handler: Handler = Arc::new(|path| Some(Response::new("200 OK", "text/plain", format!("{path}\n"))));
        tokio::spawn(serve(listener, "test", Limits::default(), metrics.clone(), handler));
        assert!(get(addr, "/after").await.ends_with("/after\n"), "the server survived");
        let calls = calls.lock().unwrap().clone();
        assert_eq!(calls.len(), 5);
        let waited = calls[4] - calls[0];
        assert!(waited >= Duration::from_millis(140), "backed off between failures, waited {waited:?}");
        let errors =
            metrics.of::<HttpMetrics>().accept_errors.get(&[("server", "test"), ("error", "EMFILE")]).map(|c| c.get());
        assert_eq!(errors, Some(5));
    }
}
