//! The speaker's tasks: the accept loops, connection attempts and one task per connection own
//! the sockets and send typed events; the driver feeds them, with the time, to the pure
//! [`Instance`] and executes its [`Action`]s. Nothing here decides anything about BGP.
use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    os::fd::{AsRawFd, RawFd},
    path::PathBuf,
    sync::{atomic::AtomicU64, Arc, Mutex},
    time::Duration,
};

use bytes::BytesMut;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpSocket, TcpStream},
    sync::{mpsc, oneshot, watch},
    task::JoinHandle,
    time::{sleep_until, Instant},
};
use tracing::{debug, warn};

use super::{
    instance::{canonical, Action, ConnId, Input, Instance},
    status::SpeakerStatus,
};
use crate::{
    routing::bgp::{
        bfd_io::{run_bfd, BfdPeer},
        codec::{DecodeOutcome, WireCodec},
        md5::{set_min_ttl, set_tcp_md5_key, set_ttl},
        message::Message,
        peers::PeerConfig,
    },
    routing::fib::task::FibTarget,
};

/// Events for the driver: typed inputs for the core, and the streams the socket tasks hand over.
pub(super) enum TaskEvent {
    Input(Input),
    /// Our connection attempt `conn` to `peer` succeeded.
    Connected {
        peer: IpAddr,
        conn: ConnId,
        stream: TcpStream,
    },
    Accepted {
        remote: SocketAddr,
        stream: TcpStream,
    },
    Shutdown {
        graceful: bool,
        done: oneshot::Sender<()>,
    },
}

/// Events from the sockets (connections, decoded messages) waiting for the core. Bounded, and
/// their producers await room: a peer that sends faster than the core applies is slowed down
/// by TCP itself instead of growing a queue. The driver never sends on this channel and never
/// awaits a connection task while the core runs, so the wait cannot deadlock; at shutdown it
/// keeps draining while the connections flush their NOTIFICATIONs.
pub(super) const WIRE_QUEUE: usize = 1024;

pub(super) fn bind_listener(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    let socket = if addr.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
    socket.set_reuseaddr(true)?;
    socket.bind(addr).map_err(|e| anyhow::anyhow!("binding the BGP listener to {addr}: {e}"))?;
    Ok(socket.listen(64)?)
}

pub(super) async fn accept_loop(listener: TcpListener, wire: mpsc::Sender<TaskEvent>) {
    loop {
        match listener.accept().await {
            Ok((stream, remote)) => {
                // While the core is behind, connections wait in the kernel's backlog.
                if wire.send(TaskEvent::Accepted { remote, stream }).await.is_err() {
                    return;
                }
            }
            Err(e) => {
                warn!(error = %e, "accepting a BGP connection failed");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// IP TTL (hop limit) for a session's packets: eBGP peers are directly connected unless
/// multihop is configured (RFC 4271 §5.1.3 practice); iBGP keeps the system default. With
/// GTSM always 255 (RFC 5082 §3).
fn session_ttl(peer: &PeerConfig, local_asn: u32) -> Option<u32> {
    if peer.ttl_security {
        return Some(255);
    }
    (peer.asn != local_asn).then(|| u32::from(peer.multihop_ttl.unwrap_or(1).max(1)))
}

/// GTSM's lowest acceptable TTL on arrival: 255 for a directly connected peer, one less per
/// further hop allowed by `multihop_ttl`.
fn session_min_ttl(peer: &PeerConfig) -> Option<u32> {
    peer.ttl_security.then(|| 256 - u32::from(peer.multihop_ttl.unwrap_or(1).max(1)))
}

/// The session's TTL and GTSM options on a socket (before connect, or right after accept).
fn set_session_ttl(fd: RawFd, peer: &PeerConfig, local_asn: u32) -> std::io::Result<()> {
    let ipv4 = peer.address.is_ipv4();
    if let Some(ttl) = session_ttl(peer, local_asn) {
        set_ttl(fd, ipv4, ttl)?;
    }
    if let Some(min) = session_min_ttl(peer) {
        set_min_ttl(fd, ipv4, min)?;
    }
    Ok(())
}

async fn connect(peer: PeerConfig, local_asn: u32, wire: mpsc::Sender<TaskEvent>, conn: ConnId) {
    let result = async {
        let socket = if peer.address.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
        if let Some(password) = &peer.password {
            set_tcp_md5_key(socket.as_raw_fd(), peer.address, password.as_bytes())?;
        }
        set_session_ttl(socket.as_raw_fd(), &peer, local_asn)?;
        if let Some(local) = peer.local_address.filter(|l| l.is_ipv4() == peer.address.is_ipv4()) {
            socket.bind(SocketAddr::new(local, 0))?;
        }
        let stream =
            tokio::time::timeout(Duration::from_secs(10), socket.connect(SocketAddr::new(peer.address, peer.port)))
                .await
                .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out"))??;
        Ok::<_, std::io::Error>(stream)
    }
    .await;
    let event = match result {
        Ok(stream) => TaskEvent::Connected { peer: peer.address, conn, stream },
        Err(e) => TaskEvent::Input(Input::ConnectFailed { peer: peer.address, conn, error: e.to_string() }),
    };
    let _ = wire.send(event).await;
}

/// Reads and writes one BGP connection until the driver drops its sender (after flushing what
/// is queued, so a NOTIFICATION goes out before the close) or the socket fails.
async fn run_connection(
    peer: IpAddr,
    conn: ConnId,
    stream: TcpStream,
    mut outgoing: mpsc::UnboundedReceiver<Message>,
    wire: mpsc::Sender<TaskEvent>,
) {
    let _ = stream.set_nodelay(true);
    let (mut reader, mut writer) = stream.into_split();
    let mut codec = WireCodec::new();
    let mut inbuf = BytesMut::with_capacity(64 * 1024);
    let mut outbuf = BytesMut::new();
    let mut reading = true;
    let closed = |error: String| TaskEvent::Input(Input::Closed { peer, conn, error: Some(error) });
    loop {
        tokio::select! {
            message = outgoing.recv() => {
                let Some(message) = message else {
                    let _ = writer.shutdown().await;
                    return;
                };
                outbuf.clear();
                let mut batch = vec![message];
                while let Ok(more) = outgoing.try_recv() {
                    batch.push(more);
                    if batch.len() >= 256 {
                        break;
                    }
                }
                for message in &batch {
                    if let Err(e) = codec.encode(message, &mut outbuf) {
                        warn!(%peer, error = %e, "cannot encode a BGP message; dropped");
                    }
                }
                if let Err(e) = writer.write_all(&outbuf).await {
                    let _ = wire.send(closed(e.to_string())).await;
                    return;
                }
            }
            read = reader.read_buf(&mut inbuf), if reading => {
                match read {
                    Ok(0) => {
                        let _ = wire.send(closed("peer closed the connection".into())).await;
                        reading = false;
                    }
                    Err(e) => {
                        let _ = wire.send(closed(e.to_string())).await;
                        reading = false;
                    }
                    Ok(_) => {
                        while let Some(outcome) = codec.decode(&mut inbuf) {
                            let fatal = matches!(outcome, DecodeOutcome::Notify(_) | DecodeOutcome::ConnectionError(_));
                            // Waits while the core is behind: reading stops, and TCP slows the peer.
                            let _ = wire.send(TaskEvent::Input(Input::Received { peer, conn, outcome })).await;
                            if fatal {
                                // The core answers with a NOTIFICATION and closes; nothing after
                                // a framing error can be trusted.
                                reading = false;
                                break;
                            }
                        }
                    }
                }
            }
        }
    }
}

/// A running connection task and the queue of what it is to send.
struct ConnectionTask {
    outgoing: mpsc::UnboundedSender<Message>,
    task: JoinHandle<()>,
}

/// Everything outside the core: sockets, tasks, the marker file and where results go.
pub(super) struct Driver {
    pub instance: Instance,
    pub local_asn: u32,
    pub bfd_port: u16,
    /// The graceful-restart marker; `graceful_restart`: whether it is configured.
    pub marker: Option<PathBuf>,
    pub graceful_restart: bool,
    pub events: mpsc::UnboundedSender<TaskEvent>,
    /// For the socket tasks (see [`WIRE_QUEUE`]).
    pub wire: mpsc::Sender<TaskEvent>,
    pub listener_fds: Vec<RawFd>,
    pub status: Arc<Mutex<SpeakerStatus>>,
    pub fib: watch::Sender<FibTarget>,
    connections: HashMap<ConnId, ConnectionTask>,
    /// Streams handed over by the socket tasks that the core has not opened yet.
    parked: HashMap<ConnId, TcpStream>,
    next_accepted: u64,
    closing: Vec<JoinHandle<()>>,
    /// The BFD task, once a peer wants BFD: it takes the list of watched peers.
    bfd: Option<mpsc::UnboundedSender<Vec<BfdPeer>>>,
    /// BFD packets refused for a TTL other than 255 (the BFD task counts).
    bfd_ttl_dropped: Arc<AtomicU64>,
    /// The status is rebuilt (every peer's line) at most once per [`STATUS_INTERVAL`]; events
    /// in between only mark it stale, and the loop wakes to publish it when the interval ends.
    status_stale: bool,
    next_status_at: Instant,
}

/// How often at most the status is rebuilt while events keep coming. With thousands of peers
/// (a large cluster's nodes) each rebuild walks them all, and their connect-retry timers alone
/// bring hundreds of events a second; readers (metrics, `kube-router bgp`, tests) poll.
const STATUS_INTERVAL: Duration = Duration::from_millis(100);

/// What the driver is built from (see [`Driver::new`]).
pub(super) struct DriverParts {
    pub instance: Instance,
    pub local_asn: u32,
    pub bfd_port: u16,
    pub marker: Option<PathBuf>,
    pub graceful_restart: bool,
    pub events: mpsc::UnboundedSender<TaskEvent>,
    pub wire: mpsc::Sender<TaskEvent>,
    pub status: Arc<Mutex<SpeakerStatus>>,
    pub fib: watch::Sender<FibTarget>,
}

impl Driver {
    pub fn new(parts: DriverParts) -> Self {
        let DriverParts { instance, local_asn, bfd_port, marker, graceful_restart, events, wire, status, fib } = parts;
        Self {
            instance,
            local_asn,
            bfd_port,
            marker,
            graceful_restart,
            events,
            wire,
            listener_fds: Vec::new(),
            status,
            fib,
            connections: HashMap::new(),
            parked: HashMap::new(),
            next_accepted: 1,
            closing: Vec::new(),
            bfd: None,
            bfd_ttl_dropped: Arc::default(),
            status_stale: false,
            next_status_at: Instant::now(),
        }
    }

    pub async fn run(mut self, mut rx: mpsc::UnboundedReceiver<TaskEvent>, mut wire: mpsc::Receiver<TaskEvent>) {
        loop {
            let now = Instant::now();
            let far = now + Duration::from_secs(3600);
            let mut deadline = self.instance.next_deadline().map_or(far, |at| Instant::from_std(at).min(far));
            if self.status_stale {
                deadline = deadline.min(self.next_status_at);
            }
            let event = tokio::select! {
                event = rx.recv() => {
                    let Some(event) = event else { return };
                    event
                }
                Some(event) = wire.recv() => event,
                _ = sleep_until(deadline) => TaskEvent::Input(Input::TimersDue),
            };
            if self.event(event, &mut wire).await.is_break() {
                return;
            }
            // Drain what is already queued before publishing: one FIB update per burst.
            loop {
                let event = match rx.try_recv() {
                    Ok(event) => event,
                    Err(_) => match wire.try_recv() {
                        Ok(event) => event,
                        Err(_) => break,
                    },
                };
                if self.event(event, &mut wire).await.is_break() {
                    return;
                }
            }
            self.publish();
        }
    }

    async fn event(&mut self, event: TaskEvent, wire: &mut mpsc::Receiver<TaskEvent>) -> std::ops::ControlFlow<()> {
        match event {
            TaskEvent::Shutdown { graceful, done } => {
                self.shutdown(graceful, wire).await;
                let _ = done.send(());
                return std::ops::ControlFlow::Break(());
            }
            TaskEvent::Input(input) => self.input(input),
            TaskEvent::Connected { peer, conn, stream } => {
                let local = stream.local_addr().ok();
                self.parked.insert(conn, stream);
                self.input(Input::Connected { peer, conn, local });
            }
            TaskEvent::Accepted { remote, stream } => self.accepted(canonical(remote.ip()), stream),
        }
        std::ops::ControlFlow::Continue(())
    }

    fn accepted(&mut self, remote: IpAddr, stream: TcpStream) {
        // Accepted sockets get the session's TTL and GTSM too (outbound ones are set before
        // connect). The handshake itself passed the shared listener, which has no minimum TTL;
        // from here on a GTSM peer's short-TTL packets are dropped, so such a peer never gets
        // past OpenSent.
        if let Some(config) = self.instance.peer_config(remote) {
            if let Err(e) = set_session_ttl(stream.as_raw_fd(), config, self.local_asn) {
                warn!(peer = %remote, error = %e, "cannot set the session TTL or GTSM minimum; connection refused");
                return;
            }
        }
        let conn = ConnId::Accepted(self.next_accepted);
        self.next_accepted += 1;
        let local = stream.local_addr().ok();
        self.parked.insert(conn, stream);
        self.input(Input::Accepted { remote, conn, local });
    }

    /// Hands `input` to the core and executes what it answers.
    pub fn input(&mut self, input: Input) {
        let actions = self.instance.handle(Instant::now().into_std(), input);
        for action in actions {
            self.execute(action);
        }
        // A stream the core did not open (a refused or superseded connection) closes here.
        self.parked.clear();
    }

    fn execute(&mut self, action: Action) {
        match action {
            Action::Connect { conn, peer } => {
                tokio::spawn(connect(*peer, self.local_asn, self.wire.clone(), conn));
            }
            Action::Open { peer, conn } => {
                let Some(stream) = self.parked.remove(&conn) else {
                    debug!(%peer, ?conn, "no stream to open");
                    return;
                };
                let (outgoing, rx) = mpsc::unbounded_channel();
                let task = tokio::spawn(run_connection(peer, conn, stream, rx, self.wire.clone()));
                self.connections.insert(conn, ConnectionTask { outgoing, task });
            }
            Action::Send { conn, message } => {
                if let Some(c) = self.connections.get(&conn) {
                    let _ = c.outgoing.send(message);
                }
            }
            Action::Close { conn } => {
                // Dropping the sender lets the task flush and close.
                if let Some(c) = self.connections.remove(&conn) {
                    self.closing.push(c.task);
                    self.closing.retain(|t| !t.is_finished());
                }
            }
            Action::Abort { conn } => {
                if let Some(c) = self.connections.remove(&conn) {
                    c.task.abort();
                }
            }
            Action::ListenerMd5(peer) => {
                let Some(password) = &peer.password else { return };
                for fd in &self.listener_fds {
                    if let Err(e) = set_tcp_md5_key(*fd, peer.address, password.as_bytes()) {
                        warn!(peer = %peer.address, error = %e, "cannot set the TCP MD5 key on the listener");
                    }
                }
            }
            Action::WatchBfd(watched) => self.watch_bfd(watched),
            Action::MarkRestartable => self.write_marker(),
        }
    }

    /// Tells the BFD task which peers to watch (starting it for the first one).
    fn watch_bfd(&mut self, watched: Vec<BfdPeer>) {
        if watched.is_empty() && self.bfd.is_none() {
            return;
        }
        let sender = self.bfd.get_or_insert_with(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            let events = self.events.clone();
            tokio::spawn(run_bfd(
                self.bfd_port,
                rx,
                move |e| {
                    let _ = events.send(TaskEvent::Input(Input::Bfd(e)));
                },
                self.bfd_ttl_dropped.clone(),
            ));
            tx
        });
        let _ = sender.send(watched);
    }

    /// Publishes the status, then the kernel's target: what the kernel is told (a deletion
    /// allowed by `routing_complete`) is never seen before the status that explains it.
    pub fn publish(&mut self) {
        let now = Instant::now();
        // A FIB target always goes out with the status that explains it, at once.
        if !self.instance.fib_pending() && now < self.next_status_at {
            self.status_stale = true;
            return;
        }
        self.status_stale = false;
        self.next_status_at = now + STATUS_INTERVAL;
        let published = self.instance.publish(now.into_std());
        let mut status = published.status;
        status.bfd_ttl_dropped = self.bfd_ttl_dropped.load(std::sync::atomic::Ordering::Relaxed);
        *self.status.lock().unwrap_or_else(|p| p.into_inner()) = status;
        if let Some(target) = published.fib {
            self.fib.send_if_modified(|current| {
                if *current == target {
                    false
                } else {
                    *current = target;
                    true
                }
            });
        }
    }

    async fn shutdown(&mut self, graceful: bool, wire: &mut mpsc::Receiver<TaskEvent>) {
        self.input(Input::Shutdown { graceful });
        // A connection task waiting for room in the wire queue would never get to flush its
        // NOTIFICATION: keep taking (and dropping) its events meanwhile.
        let closing = futures_util::future::join_all(self.closing.drain(..));
        let drain = async {
            while wire.recv().await.is_some() {}
            std::future::pending::<()>().await
        };
        let _ = tokio::time::timeout(Duration::from_secs(2), async {
            tokio::select! {
                _ = closing => {}
                _ = drain => {}
            }
        })
        .await;
        if !graceful || !self.graceful_restart {
            if let Some(path) = &self.marker {
                let _ = std::fs::remove_file(path);
            }
        }
    }

    fn write_marker(&self) {
        if !self.graceful_restart {
            return;
        }
        if let Some(path) = &self.marker {
            if !path.exists() {
                if let Err(e) = std::fs::write(path, b"graceful restart: routes were advertised\n") {
                    warn!(path = %path.display(), error = %e, "cannot write the graceful-restart marker");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_ttl_follows_ebgp_multihop_and_gtsm() {
        let flag = crate::routing::bgp::peers::ExternalPeerFlag {
            address: "192.0.2.1".parse().unwrap(),
            asn: 65001,
            password: None,
            port: None,
        };
        let mut peer = flag.peer_config(179);
        assert_eq!(session_ttl(&peer, 64512), Some(1), "eBGP: directly connected");
        assert_eq!(session_ttl(&peer, 65001), None, "iBGP: the system default");
        peer.multihop_ttl = Some(3);
        assert_eq!(session_ttl(&peer, 64512), Some(3));
        assert_eq!(session_min_ttl(&peer), None);
        peer.ttl_security = true;
        assert_eq!(session_ttl(&peer, 64512), Some(255));
        assert_eq!(session_min_ttl(&peer), Some(253), "GTSM: 255 less the hops allowed beyond one");
    }
}
