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
    pub body: Body,
}

/// What an answer carries: a text known whole, or one written piece by piece as it is encoded.
pub enum Body {
    Text(String),
    /// Runs on a blocking thread and gives each piece to its sink as it is made; a sink error
    /// (the client gone or too slow) ends it. The `/metrics` page of 10,000 Services is some
    /// 60 MiB: streamed, a scrape holds a few pieces of it, not the page.
    Stream(Producer),
}

/// Where a streamed body's pieces go: an error means the connection is gone.
pub type PieceSink<'a> = &'a mut dyn FnMut(String) -> std::fmt::Result;

/// Writes a streamed body into its sink ([`Body::Stream`]).
pub type Producer = Box<dyn for<'a> FnOnce(PieceSink<'a>) -> std::fmt::Result + Send>;

/// Pieces of a streamed body made ahead of the connection's writes.
const STREAM_AHEAD: usize = 2;

impl Response {
    pub fn new(status: &'static str, content_type: &'static str, body: String) -> Self {
        Self { status, content_type, body: Body::Text(body) }
    }

    /// An answer whose body `produce` writes piece by piece ([`Body::Stream`]).
    pub fn streamed(
        status: &'static str,
        content_type: &'static str,
        produce: impl FnOnce(&mut dyn FnMut(String) -> std::fmt::Result) -> std::fmt::Result + Send + 'static,
    ) -> Self {
        Self { status, content_type, body: Body::Stream(Box::new(produce)) }
    }

    /// Status line and headers. A text's body is written after them as it is: a copy of a
    /// 10,000-Service metrics page beside the page itself was tens of MiB at every scrape. A
    /// streamed body's length is not known up front: chunked to an HTTP/1.1 client (a cut-off
    /// page then shows as one), delimited by the connection's end to an HTTP/1.0 one.
    fn head(&self, chunked: bool) -> String {
        let length = match &self.body {
            Body::Text(text) => format!("Content-Length: {}\r\n", text.len()),
            Body::Stream(_) if chunked => "Transfer-Encoding: chunked\r\n".to_string(),
            Body::Stream(_) => String::new(),
        };
        format!(
            "HTTP/1.1 {}\r\nContent-Type: {}\r\nX-Content-Type-Options: nosniff\r\n{length}Connection: close\r\n\r\n",
            self.status, self.content_type,
        )
    }

    /// Writes the answer; `Err` when the connection failed or a streamed body ended in an error
    /// (a chunked one is then left without its last chunk).
    async fn write_to(self, stream: &mut TcpStream, chunked: bool) -> std::io::Result<()> {
        stream.write_all(self.head(chunked).as_bytes()).await?;
        let produce = match self.body {
            Body::Text(text) => return stream.write_all(text.as_bytes()).await,
            Body::Stream(produce) => produce,
        };
        let (pieces, mut received) = tokio::sync::mpsc::channel::<String>(STREAM_AHEAD);
        let producer = tokio::task::spawn_blocking(move || {
            produce(&mut |piece| pieces.blocking_send(piece).map_err(|_| std::fmt::Error))
        });
        while let Some(piece) = received.recv().await {
            if piece.is_empty() {
                continue;
            }
            if chunked {
                stream.write_all(format!("{:x}\r\n", piece.len()).as_bytes()).await?;
            }
            stream.write_all(piece.as_bytes()).await?;
            if chunked {
                stream.write_all(b"\r\n").await?;
            }
        }
        match producer.await {
            Ok(Ok(())) if chunked => stream.write_all(b"0\r\n\r\n").await,
            Ok(Ok(())) => Ok(()),
            _ => Err(std::io::Error::other("the streamed body ended in an error")),
        }
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
    let mut request_line = request.split_whitespace();
    let path = request_line.nth(1).unwrap_or("/");
    // Chunked only to a client that said it speaks HTTP/1.1 (RFC 9112: never to 1.0).
    let chunked = request_line.next() == Some("HTTP/1.1");
    let Some(response) = handler(path) else { return true };
    tokio::time::timeout(timeout, response.write_to(&mut stream, chunked)).await.is_ok()
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
            let page = state.clone();
            Response::streamed("200 OK", crate::exposition::CONTENT_TYPE, move |sink| {
                page.render_chunks(crate::exposition::CHUNK, sink)
            })
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

    /// `GET /metrics` in `version`, the answer's head and its body as sent (chunks undone).
    async fn scrape(addr: SocketAddr, version: &str) -> (String, String) {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.write_all(format!("GET /metrics {version}\r\nHost: x\r\n\r\n").as_bytes()).await.unwrap();
        let mut reply = Vec::new();
        stream.read_to_end(&mut reply).await.unwrap();
        let reply = String::from_utf8(reply).unwrap();
        let (head, body) = reply.split_once("\r\n\r\n").unwrap();
        if !head.contains("Transfer-Encoding: chunked") {
            return (head.to_string(), body.to_string());
        }
        let (mut rest, mut text, mut last_seen) = (body, String::new(), false);
        while !rest.is_empty() {
            let (size, after) = rest.split_once("\r\n").expect("chunk size line");
            let size = usize::from_str_radix(size, 16).expect("hex chunk size");
            if size == 0 {
                assert_eq!(after, "\r\n", "nothing after the last chunk");
                last_seen = true;
                break;
            }
            text.push_str(&after[..size]);
            rest = after[size..].strip_prefix("\r\n").expect("CRLF after a chunk");
        }
        assert!(last_seen, "the page ends with its last (empty) chunk");
        (head.to_string(), text)
    }

    /// The `/metrics` page, streamed in pieces (chunked to an HTTP/1.1 client, to the
    /// connection's end to an HTTP/1.0 one), is byte for byte the page rendered whole as before:
    /// 3,000 frontends (some 2 MiB, dozens of pieces), names that need escaping, upstream
    /// counters whose TYPE lines are rewritten in each piece.
    #[tokio::test]
    async fn a_streamed_metrics_page_is_the_page_rendered_whole() {
        use crate::kr_metrics::{FrontendId, FrontendOwner, ServiceCounters};
        let metrics = Metrics::default();
        metrics.of::<crate::metrics::AgentMetrics>().reject("Service");
        metrics.of::<ServiceCounters>().with(|m| {
            for i in 0..3_000u32 {
                let addr = std::net::Ipv4Addr::from(0x0a60_0000 + i);
                let name = if i % 7 == 0 { format!("web\"}} 1\n#{i}\\") } else { format!("svc-{i}") };
                let key = FrontendId { addr: addr.into(), port: 80, proto: kube_router_common::IPPROTO_TCP };
                m.frontends
                    .insert(key, FrontendOwner { namespace: format!("ns-{}", i % 50).into(), name: name.into() });
            }
        });
        metrics.of::<HttpMetrics>();
        let whole = metrics.render_whole();
        assert!(whole.len() > 1 << 20 && whole.contains("# TYPE kube_router_service_bytes_in counter\n"));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(serve_metrics(metrics.clone(), listener, "/metrics".into()));
        let (head, body) = scrape(addr, "HTTP/1.1").await;
        assert!(head.starts_with("HTTP/1.1 200 OK") && head.contains("Transfer-Encoding: chunked"), "{head}");
        assert!(!head.contains("Content-Length"), "{head}");
        assert!(body == whole, "HTTP/1.1: {} bytes streamed, {} rendered whole", body.len(), whole.len());
        let (head, body) = scrape(addr, "HTTP/1.0").await;
        assert!(!head.contains("chunked") && !head.contains("Content-Length"), "{head}");
        assert!(body == whole, "HTTP/1.0: {} bytes streamed, {} rendered whole", body.len(), whole.len());
        // In pieces of any size, the same text.
        for chunk in [1, 100, crate::exposition::CHUNK] {
            let mut pieces = Vec::new();
            metrics
                .render_chunks(chunk, |piece| {
                    pieces.push(piece);
                    Ok(())
                })
                .unwrap();
            assert!(pieces.iter().all(|p| p.ends_with('\n')), "whole lines");
            assert!(pieces.concat() == whole, "pieces of {chunk}");
        }
    }

    /// A streamed page whose client stops reading is abandoned at the write deadline: the
    /// encoding stops with it (its sink fails), and the server answers the next request.
    #[tokio::test]
    async fn a_streamed_page_to_a_client_that_stops_reading_ends_at_the_deadline() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let produced = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = produced.clone();
        let handler: Handler = Arc::new(move |path| {
            let counted = counted.clone();
            Some(match path {
                "/endless" => Response::streamed("200 OK", "text/plain", move |sink| loop {
                    sink("x".repeat(64 * 1024) + "\n")?;
                    counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }),
                _ => Response::new("200 OK", "text/plain", "ok\n".into()),
            })
        });
        let limits = Limits { request_timeout: Duration::from_millis(300), ..Limits::default() };
        let metrics = Metrics::default();
        tokio::spawn(serve(listener, "test", limits, metrics.clone(), handler));
        let mut stalled = TcpStream::connect(addr).await.unwrap();
        stalled.write_all(b"GET /endless HTTP/1.1\r\n\r\n").await.unwrap();
        tokio::time::sleep(Duration::from_millis(1_000)).await;
        let after_deadline = produced.load(std::sync::atomic::Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(produced.load(std::sync::atomic::Ordering::Relaxed), after_deadline, "stopped");
        assert!(after_deadline < 1_000, "bounded by the socket's buffers, not the page: {after_deadline}");
        let timeouts =
            metrics.of::<HttpMetrics>().rejected.get(&[("server", "test"), ("reason", "timeout")]).map(|c| c.get());
        assert_eq!(timeouts, Some(1));
        assert!(get(addr, "/x").await.ends_with("ok\n"));
        drop(stalled);
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
