//! The BGP speaker: TCP sessions, timers and the kernel FIB around the pure core.
//!
//! One task owns every [`Session`], the [`Rib`] and both graceful-restart roles; it reacts to
//! events (connections, decoded messages, timer expiries, configuration changes) and turns the
//! core's outputs into I/O. Each TCP connection runs in its own task with one [`WireCodec`]
//! (encode and decode share the 4-octet-AS negotiation). The kernel routes are written by a
//! separate FIB task from a `watch` of the desired route set, so a slow netlink socket never
//! stalls keepalives.
//!
//! What survives what:
//! * API outage: nothing here depends on the API; peers and prefixes stay as last configured.
//! * Agent stop with graceful restart: no NOTIFICATION is sent, kernel routes stay, peers keep
//!   our routes as stale. On start the OPEN carries R=1/F=1, our advertisements wait until every
//!   peer has sent End-of-RIB (or the selection-deferral timer fires), and only then are kernel
//!   routes that are really gone deleted.
//! * Even without a restart, FIB deletions wait for that first complete picture: a route of our
//!   protocol found at start is never removed just because its session is not up yet.
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    os::fd::AsRawFd,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::Duration,
};

use bytes::BytesMut;
use ipnet::IpNet;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpSocket, TcpStream},
    sync::{mpsc, oneshot, watch},
    task::JoinHandle,
    time::{sleep_until, Instant},
};
use tracing::{debug, info, warn};

use super::{
    bfd_io::{run_bfd, BfdEvent, BfdPeer},
    codec::{DecodeOutcome, WireCodec},
    fsm::{
        resolve_collision, ConnectRetryBackoff, Direction, DownReason, Event, GracefulRestartConfig, Negotiated,
        Output, Session, SessionConfig, State, TimerKind,
    },
    graceful_restart::{GrTimer, GracefulRestartHelper, RestartOutput, RestartingSpeaker, TimerCommand},
    md5::{set_min_ttl, set_tcp_md5_key, set_ttl},
    message::{Family, Message, NextHop, Origin, PathAttributes, Prefix, Update},
    peers::{PeerConfig, PeerKind},
    policy::{ExportPolicy, ImportPolicy, OriginKind, PeerRole, Rejection},
    rib::{BestPathChange, PeerInfo, Rib, RibConfig, RouteSource},
};
pub use crate::fib::task::{FibLink, FibTarget};
use crate::{
    fib::{
        health::FibStats,
        resolve::Reachability,
        target::{Learned, NodePeer, PathHop, Planner},
        Desired, RouteSet,
    },
    overlay::OverlayConfig,
};

#[derive(Debug, Clone)]
pub struct GracefulRestartSettings {
    /// Restart time we advertise: how long peers keep our routes while we are away.
    pub restart_time: Duration,
    /// How long we keep a restarted peer's stale routes waiting for its End-of-RIB.
    pub stale_path_time: Duration,
    /// Upper bound on waiting for peers' End-of-RIB after our own start.
    pub selection_deferral: Duration,
}

#[derive(Debug, Clone)]
pub struct SpeakerConfig {
    pub local_asn: u32,
    pub router_id: Ipv4Addr,
    /// Where to accept sessions; empty only connects out.
    pub listen: Vec<SocketAddr>,
    pub hold_time_secs: u16,
    pub connect_retry: ConnectRetryBackoff,
    pub families: Vec<Family>,
    pub graceful_restart: Option<GracefulRestartSettings>,
    /// Next hops for the family the session's transport does not give (an IPv6 prefix over an
    /// IPv4 session and vice versa).
    pub ipv4_next_hop: Option<Ipv4Addr>,
    pub ipv6_next_hop: Option<Ipv6Addr>,
    /// Kept across restarts: its presence at start means we are restarting (R-bit).
    pub state_dir: Option<PathBuf>,
    pub overlay: Option<OverlayConfig>,
    /// The kernel's routes and the node's addresses when the speaker starts.
    pub reach: Option<Reachability>,
    pub import: ImportPolicy,
    pub export: ExportPolicy,
    /// UDP port of BFD control packets (`--bfd-port`), for peers with BFD.
    pub bfd_port: u16,
}

impl SpeakerConfig {
    pub fn new(local_asn: u32, router_id: Ipv4Addr) -> Self {
        Self {
            local_asn,
            router_id,
            listen: vec![SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 179)],
            hold_time_secs: 90,
            connect_retry: ConnectRetryBackoff { initial: Duration::from_secs(2), max: Duration::from_secs(60) },
            families: vec![Family::Ipv4Unicast, Family::Ipv6Unicast],
            graceful_restart: Some(GracefulRestartSettings {
                restart_time: Duration::from_secs(90),
                stale_path_time: Duration::from_secs(360),
                selection_deferral: Duration::from_secs(120),
            }),
            ipv4_next_hop: None,
            ipv6_next_hop: None,
            state_dir: None,
            overlay: None,
            reach: None,
            import: ImportPolicy::default(),
            export: ExportPolicy::default(),
            bfd_port: super::bfd::CONTROL_PORT,
        }
    }
}

/// A prefix this node originates, and what it is.
pub type Originated = (Prefix, OriginKind);

/// The policies that come from the cluster's configuration (Node and Service objects).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Policies {
    pub import: ImportPolicy,
    pub export: ExportPolicy,
}

/// Events from the sockets (connections, decoded messages) waiting for the core. Bounded, and
/// their producers await room: a peer that sends faster than the core applies is slowed down
/// by TCP itself instead of growing a queue. The core never sends on this channel and never
/// awaits a connection task while it runs, so the wait cannot deadlock; at shutdown it keeps
/// draining while the connections flush their NOTIFICATIONs.
const WIRE_QUEUE: usize = 1024;

/// How often the per-peer unresolved-path counts may be recomputed while paths change.
const UNRESOLVED_RECOUNT: Duration = Duration::from_secs(1);

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerStatus {
    pub address: IpAddr,
    pub asn: u32,
    pub state: State,
    /// When the session reached Established (None unless it is).
    pub established_at: Option<std::time::Instant>,
    pub prefixes_received: usize,
    /// Received but refused by the import policy (kept, unused).
    pub prefixes_rejected: usize,
    /// Accepted, but their next hop does not resolve (kept, unused until it does).
    pub prefixes_unresolved: usize,
    pub prefixes_stale: usize,
    pub prefixes_advertised: usize,
    pub updates_received: u64,
    pub notifications_received: u64,
    pub notifications_sent: u64,
    /// UPDATEs with a malformed attribute whose prefixes were treated as withdrawn, the
    /// session kept (RFC 7606).
    pub updates_treated_as_withdraw: u64,
    /// Sessions closed because the peer exceeded its prefix limit (RFC 4486).
    pub max_prefix_violations: u32,
    pub last_error: Option<String>,
    /// BFD session Up (Some) when BFD watches this peer.
    pub bfd_up: Option<bool>,
}

/// One Loc-RIB best path as the status shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatusRoute {
    pub prefix: Prefix,
    pub next_hop: IpAddr,
    /// The peer it was learned from; None: originated here.
    pub from: Option<IpAddr>,
}

/// At most this many Loc-RIB routes are listed in the status (all are counted).
const STATUS_ROUTES_MAX: usize = 10_000;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpeakerStatus {
    pub local_asn: u32,
    pub router_id: Option<Ipv4Addr>,
    /// Started as a graceful restart (the previous run's marker was found; OPENs carry R=1).
    pub restarted: bool,
    /// Restarted and still holding our advertisements until the peers' End-of-RIB.
    pub restarting: bool,
    pub deferring: bool,
    /// The first complete routing picture is in (every graceful-restart peer's End-of-RIB, or
    /// the deferral timer): routes of ours the kernel kept from before may now be removed.
    pub routing_complete: bool,
    pub peers: Vec<PeerStatus>,
    /// The Loc-RIB, unless it has more than [`STATUS_ROUTES_MAX`] routes (then empty). Shared:
    /// rebuilt only when the Loc-RIB changed, so publishing and reading the status copy no
    /// routes.
    pub loc_rib: Arc<Vec<StatusRoute>>,
    pub loc_rib_size: usize,
    pub malformed_messages: u64,
    /// Paths refused by the import policy so far, per peer and reason.
    pub rejections: Vec<(IpAddr, Rejection, u64)>,
    /// NLRI of families we do not route, ignored (RFC 7606 §5.4-style, session kept).
    pub ignored_nlri: u64,
    /// BFD control packets dropped for an IP TTL (hop limit) other than 255 (RFC 5881 §5).
    pub bfd_ttl_dropped: u64,
    pub fib: FibStats,
    /// Locally originated prefixes announced and withdrawn since start.
    pub advertisements: Advertisements,
}

/// Changes to the prefixes this node originates, counted as kube-router counts
/// `controller_bgp_advertisements_sent` by `type`: a pod CIDR announced (`pod-route`), a
/// Service VIP announced (`advertise-vip`) or withdrawn (`withdraw-vip`). A withdrawn pod CIDR
/// has no upstream type and is not counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Advertisements {
    pub pod_route: u64,
    pub advertise_vip: u64,
    pub withdraw_vip: u64,
}

impl Advertisements {
    /// Adds the changes from `before` to `after` (a prefix whose kind changed is announced anew).
    pub fn count_changes(&mut self, before: &BTreeMap<Prefix, OriginKind>, after: &BTreeMap<Prefix, OriginKind>) {
        for (prefix, kind) in before {
            if *kind == OriginKind::ServiceVip && after.get(prefix) != Some(kind) {
                self.withdraw_vip += 1;
            }
        }
        for (prefix, kind) in after {
            if before.get(prefix) != Some(kind) {
                match kind {
                    OriginKind::PodCidr => self.pod_route += 1,
                    OriginKind::ServiceVip => self.advertise_vip += 1,
                }
            }
        }
    }
}

enum CoreEvent {
    Connected { peer: IpAddr, id: u64, stream: TcpStream },
    ConnectFailed { peer: IpAddr, id: u64, error: String },
    Accepted { remote: SocketAddr, stream: TcpStream },
    Received { peer: IpAddr, id: u64, outcome: DecodeOutcome },
    Closed { peer: IpAddr, id: u64, error: Option<String> },
    SetPeers(Vec<PeerConfig>),
    SetPrefixes(Vec<Originated>),
    SetPolicies(Box<Policies>),
    KernelView(Reachability),
    Bfd(BfdEvent),
    Shutdown { graceful: bool, done: oneshot::Sender<()> },
}

/// Handle to the running speaker.
#[derive(Clone)]
pub struct Speaker {
    events: mpsc::UnboundedSender<CoreEvent>,
    status: Arc<Mutex<SpeakerStatus>>,
    fib_stats: Arc<Mutex<FibStats>>,
}

impl Speaker {
    /// Starts the speaker. `installed` are the routes of our protocol already in the kernel:
    /// they stay until the first complete routing picture says they are gone.
    pub async fn start(
        config: SpeakerConfig,
        peers: Vec<PeerConfig>,
        prefixes: Vec<Originated>,
        installed: RouteSet,
    ) -> anyhow::Result<(Self, FibLink)> {
        let (events, rx) = mpsc::unbounded_channel();
        let (wire, wire_rx) = mpsc::channel(WIRE_QUEUE);
        let listeners = config.listen.iter().map(|addr| bind_listener(*addr)).collect::<anyhow::Result<Vec<_>>>()?;
        let restarting = config.graceful_restart.is_some() && marker_path(&config).is_some_and(|p| p.exists());
        let initial = FibTarget {
            routes: Arc::new(
                installed.iter().map(|(net, route)| (*net, Desired { route: route.clone(), peer: None })).collect(),
            ),
            overlay: Arc::default(),
            allow_deletes: false,
        };
        let (fib_tx, fib_rx) = watch::channel(initial);
        let status = Arc::new(Mutex::new(SpeakerStatus::default()));
        let fib_stats = Arc::new(Mutex::new(FibStats::default()));
        let mut core = Core::new(
            config,
            restarting,
            installed,
            &peers,
            CoreQueues { events: events.clone(), wire: wire.clone() },
            fib_tx,
            status.clone(),
        );
        for listener in listeners {
            core.listener_fds.push(listener.as_raw_fd());
            tokio::spawn(accept_loop(listener, wire.clone()));
        }
        core.set_prefixes(prefixes);
        core.set_peers(peers);
        core.fib_stats = fib_stats.clone();
        core.publish();
        tokio::spawn(core.run(rx, wire_rx));
        let views = events.clone();
        let link = FibLink::new(
            fib_rx,
            move |view| {
                let _ = views.send(CoreEvent::KernelView(view));
            },
            fib_stats.clone(),
        );
        Ok((Self { events, status, fib_stats }, link))
    }

    pub fn set_peers(&self, peers: Vec<PeerConfig>) {
        let _ = self.events.send(CoreEvent::SetPeers(peers));
    }

    pub fn set_prefixes(&self, prefixes: Vec<Originated>) {
        let _ = self.events.send(CoreEvent::SetPrefixes(prefixes));
    }

    pub fn set_policies(&self, policies: Policies) {
        let _ = self.events.send(CoreEvent::SetPolicies(Box::new(policies)));
    }

    pub fn status(&self) -> SpeakerStatus {
        let mut status = self.status.lock().unwrap_or_else(|p| p.into_inner()).clone();
        status.fib = self.fib_stats.lock().unwrap_or_else(|p| p.into_inner()).clone();
        status
    }

    /// Closes every session. With `graceful` (and graceful restart configured) no Cease is
    /// sent, so peers keep our routes; either way kernel routes are left alone.
    pub async fn shutdown(&self, graceful: bool) {
        let (done, wait) = oneshot::channel();
        if self.events.send(CoreEvent::Shutdown { graceful, done }).is_ok() {
            let _ = tokio::time::timeout(Duration::from_secs(5), wait).await;
        }
    }
}

fn marker_path(config: &SpeakerConfig) -> Option<PathBuf> {
    config.state_dir.as_ref().map(|d| d.join("bgp-graceful-restart"))
}

fn bind_listener(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    let socket = if addr.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
    socket.set_reuseaddr(true)?;
    socket.bind(addr).map_err(|e| anyhow::anyhow!("binding the BGP listener to {addr}: {e}"))?;
    Ok(socket.listen(64)?)
}

async fn accept_loop(listener: TcpListener, wire: mpsc::Sender<CoreEvent>) {
    loop {
        match listener.accept().await {
            Ok((stream, remote)) => {
                // While the core is behind, connections wait in the kernel's backlog.
                if wire.send(CoreEvent::Accepted { remote, stream }).await.is_err() {
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

/// A v4-mapped IPv6 address (from a dual-stack listener) as the IPv4 address it is.
fn canonical(addr: IpAddr) -> IpAddr {
    match addr {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(addr),
        v4 => v4,
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
fn set_session_ttl(fd: std::os::fd::RawFd, peer: &PeerConfig, local_asn: u32) -> std::io::Result<()> {
    let ipv4 = peer.address.is_ipv4();
    if let Some(ttl) = session_ttl(peer, local_asn) {
        set_ttl(fd, ipv4, ttl)?;
    }
    if let Some(min) = session_min_ttl(peer) {
        set_min_ttl(fd, ipv4, min)?;
    }
    Ok(())
}

async fn connect(peer: PeerConfig, local_asn: u32, wire: mpsc::Sender<CoreEvent>, id: u64) {
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
        Ok(stream) => CoreEvent::Connected { peer: peer.address, id, stream },
        Err(e) => CoreEvent::ConnectFailed { peer: peer.address, id, error: e.to_string() },
    };
    let _ = wire.send(event).await;
}

/// Reads and writes one BGP connection until the core drops its sender (after flushing what
/// is queued, so a NOTIFICATION goes out before the close) or the socket fails.
async fn run_connection(
    peer: IpAddr,
    id: u64,
    stream: TcpStream,
    mut outgoing: mpsc::UnboundedReceiver<Message>,
    wire: mpsc::Sender<CoreEvent>,
) {
    let _ = stream.set_nodelay(true);
    let (mut reader, mut writer) = stream.into_split();
    let mut codec = WireCodec::new();
    let mut inbuf = BytesMut::with_capacity(64 * 1024);
    let mut outbuf = BytesMut::new();
    let mut reading = true;
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
                    let _ = wire.send(CoreEvent::Closed { peer, id, error: Some(e.to_string()) }).await;
                    return;
                }
            }
            read = reader.read_buf(&mut inbuf), if reading => {
                match read {
                    Ok(0) => {
                        let _ = wire.send(CoreEvent::Closed { peer, id, error: Some("peer closed the connection".into()) }).await;
                        reading = false;
                    }
                    Err(e) => {
                        let _ = wire.send(CoreEvent::Closed { peer, id, error: Some(e.to_string()) }).await;
                        reading = false;
                    }
                    Ok(_) => {
                        while let Some(outcome) = codec.decode(&mut inbuf) {
                            let fatal = matches!(outcome, DecodeOutcome::Notify(_) | DecodeOutcome::ConnectionError(_));
                            // Waits while the core is behind: reading stops, and TCP slows the peer.
                            let _ = wire.send(CoreEvent::Received { peer, id, outcome }).await;
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

struct Connection {
    id: u64,
    direction: Direction,
    local: Option<SocketAddr>,
    outgoing: mpsc::UnboundedSender<Message>,
    task: JoinHandle<()>,
}

struct Peer {
    config: PeerConfig,
    session: Option<Session>,
    connection: Option<Connection>,
    pending_connect: Option<u64>,
    timers: HashMap<TimerKind, Instant>,
    established_at: Option<Instant>,
    updates_received: u64,
    notifications_received: u64,
    notifications_sent: u64,
    updates_treated_as_withdraw: u64,
    last_error: Option<String>,
    bfd_up: Option<bool>,
}

impl Peer {
    fn state(&self) -> State {
        self.session.as_ref().map_or(State::Idle, Session::state)
    }
}

struct Core {
    config: SpeakerConfig,
    rib: Rib,
    helper: GracefulRestartHelper,
    /// Gates our advertisements after a restart (RFC 4724 §4.1): until every GR peer has sent
    /// End-of-RIB, except peers that are restarting themselves (they wait for ours).
    restart: RestartingSpeaker,
    /// Gates kernel route deletions: until every GR peer has sent End-of-RIB, restarting or
    /// not, so a route is never removed just because its peer has not re-sent it yet.
    fib_gate: RestartingSpeaker,
    fib_deadline: Option<Instant>,
    /// We came back from a restart: hold our advertisements until the deferral completes.
    restarting: bool,
    /// Started as a restart (`restarting` at start; never cleared).
    restarted: bool,
    peers: BTreeMap<IpAddr, Peer>,
    prefixes: BTreeMap<Prefix, OriginKind>,
    gr_timers: HashMap<GrTimer, Instant>,
    events: mpsc::UnboundedSender<CoreEvent>,
    /// For the socket tasks (see [`WIRE_QUEUE`]).
    wire: mpsc::Sender<CoreEvent>,
    fib: watch::Sender<FibTarget>,
    fib_allow_deletes: bool,
    fib_dirty: bool,
    status: Arc<Mutex<SpeakerStatus>>,
    fib_stats: Arc<Mutex<FibStats>>,
    listener_fds: Vec<std::os::fd::RawFd>,
    next_connection_id: u64,
    malformed_messages: u64,
    advertisements: Advertisements,
    /// NLRI of families we do not route, ignored so far.
    ignored_nlri: u64,
    /// (peer, what) already logged once: import refusals, ignored families.
    logged_once: BTreeSet<(IpAddr, String)>,
    /// Per peer, how many accepted paths have a next hop that does not resolve.
    unresolved: BTreeMap<IpAddr, usize>,
    unresolved_dirty: bool,
    unresolved_recount_at: Instant,
    /// The BFD task, once a peer wants BFD: it takes the list of watched peers.
    bfd: Option<mpsc::UnboundedSender<Vec<BfdPeer>>>,
    /// BFD packets refused for a TTL other than 255 (the BFD task counts).
    bfd_ttl_dropped: Arc<std::sync::atomic::AtomicU64>,
    closing: Vec<JoinHandle<()>>,
    /// The last published route list and the Loc-RIB version it was built from.
    status_routes: Option<(u64, Arc<Vec<StatusRoute>>)>,
}

/// The core's two inboxes: its own timers and tasks (unbounded: they never flood), and socket
/// events (bounded, so a flooding peer waits on TCP instead of growing memory).
struct CoreQueues {
    events: mpsc::UnboundedSender<CoreEvent>,
    wire: mpsc::Sender<CoreEvent>,
}

impl Core {
    fn new(
        config: SpeakerConfig,
        restarting: bool,
        installed: RouteSet,
        initial_peers: &[PeerConfig],
        queues: CoreQueues,
        fib: watch::Sender<FibTarget>,
        status: Arc<Mutex<SpeakerStatus>>,
    ) -> Self {
        let CoreQueues { events, wire } = queues;
        let mut rib = Rib::new(RibConfig::new(config.local_asn, config.router_id));
        rib.set_import_policy(config.import.clone());
        rib.set_export_policy(config.export.clone());
        rib.set_overlay(config.overlay);
        if let Some(reach) = &config.reach {
            rib.set_reachability(reach.clone());
        }
        let gr = config.graceful_restart.clone();
        let stale_path_time = gr.as_ref().map_or(Duration::from_secs(360), |g| g.stale_path_time);
        let deferral = gr.as_ref().map_or(Duration::from_secs(120), |g| g.selection_deferral);
        let previously_installed: Vec<Prefix> =
            installed.keys().filter_map(|net| Prefix::new(net.addr(), net.prefix_len()).ok()).collect();
        let peers = || initial_peers.iter().map(|p| p.address);
        let (restart, out) = RestartingSpeaker::start(previously_installed.clone(), peers(), deferral, &rib);
        // Its own timer below; the shared SelectionDeferral timer belongs to `restart`.
        let (fib_gate, fib_out) = RestartingSpeaker::start(previously_installed, peers(), deferral, &rib);
        let mut core = Self {
            config,
            rib,
            helper: GracefulRestartHelper::new(stale_path_time),
            restart,
            fib_gate,
            fib_deadline: Some(Instant::now() + deferral),
            restarting,
            restarted: restarting,
            peers: BTreeMap::new(),
            prefixes: BTreeMap::new(),
            gr_timers: HashMap::new(),
            events,
            wire,
            fib,
            fib_allow_deletes: false,
            fib_dirty: false,
            status,
            fib_stats: Arc::default(),
            listener_fds: Vec::new(),
            next_connection_id: 1,
            malformed_messages: 0,
            advertisements: Advertisements::default(),
            ignored_nlri: 0,
            logged_once: BTreeSet::new(),
            unresolved: BTreeMap::new(),
            unresolved_dirty: false,
            unresolved_recount_at: Instant::now(),
            bfd: None,
            bfd_ttl_dropped: Arc::default(),
            closing: Vec::new(),
            status_routes: None,
        };
        if restarting {
            info!("BGP graceful restart: restarting with forwarding state preserved (R-bit set)");
        }
        core.restart_output(out);
        core.fib_gate_output(fib_out);
        core
    }

    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<CoreEvent>, mut wire: mpsc::Receiver<CoreEvent>) {
        loop {
            let deadline = self.next_deadline();
            tokio::select! {
                event = rx.recv() => {
                    let Some(event) = event else { return };
                    if let CoreEvent::Shutdown { graceful, done } = event {
                        self.shutdown(graceful, &mut wire).await;
                        let _ = done.send(());
                        return;
                    }
                    self.handle(event);
                }
                Some(event) = wire.recv() => self.handle(event),
                _ = sleep_until(deadline) => self.fire_timers(),
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
                if let CoreEvent::Shutdown { graceful, done } = event {
                    self.shutdown(graceful, &mut wire).await;
                    let _ = done.send(());
                    return;
                }
                self.handle(event);
            }
            self.publish();
        }
    }

    fn next_deadline(&self) -> Instant {
        let far = Instant::now() + Duration::from_secs(3600);
        self.peers
            .values()
            .flat_map(|p| p.timers.values())
            .chain(self.gr_timers.values())
            .chain(self.fib_deadline.iter())
            .chain(self.unresolved_dirty.then_some(&self.unresolved_recount_at))
            .copied()
            .min()
            .unwrap_or(far)
            .min(far)
    }

    fn fire_timers(&mut self) {
        let now = Instant::now();
        let mut due = Vec::new();
        for (addr, peer) in &mut self.peers {
            let expired: Vec<TimerKind> = peer.timers.iter().filter(|(_, at)| **at <= now).map(|(k, _)| *k).collect();
            for kind in expired {
                peer.timers.remove(&kind);
                due.push((*addr, kind));
            }
        }
        for (addr, kind) in due {
            let event = match kind {
                TimerKind::ConnectRetry => Event::ConnectRetryTimerExpires,
                TimerKind::Hold => Event::HoldTimerExpires,
                TimerKind::Keepalive => Event::KeepaliveTimerExpires,
            };
            if kind == TimerKind::Hold {
                warn!(peer = %addr, "BGP hold timer expired");
            }
            self.step(addr, event);
        }
        if self.fib_deadline.is_some_and(|at| at <= now) {
            self.fib_deadline = None;
            let out = self.fib_gate.on_deferral_timer_expired(&self.rib);
            self.fib_gate_output(out);
        }
        let expired: Vec<GrTimer> = self.gr_timers.iter().filter(|(_, at)| **at <= now).map(|(t, _)| *t).collect();
        for timer in expired {
            self.gr_timers.remove(&timer);
            match timer {
                GrTimer::SelectionDeferral => {
                    let out = self.restart.on_deferral_timer_expired(&self.rib);
                    self.restart_output(out);
                }
                other => {
                    if let GrTimer::Restart(peer) | GrTimer::StalePath(peer) = other {
                        info!(%peer, timer = ?other, "graceful restart timer expired: removing the peer's stale routes");
                    }
                    let out = self.helper.on_timer(&mut self.rib, other);
                    self.gr_timers_apply(out.timers);
                    self.rib_changed(out.rib_changes);
                }
            }
        }
    }

    fn handle(&mut self, event: CoreEvent) {
        match event {
            CoreEvent::Connected { peer, id, stream } => {
                let Some(p) = self.peers.get_mut(&peer) else { return };
                if p.pending_connect != Some(id) || p.connection.is_some() {
                    return; // superseded (an inbound connection won, or the attempt was abandoned)
                }
                p.pending_connect = None;
                self.attach(peer, stream, Direction::Outbound);
                self.step(peer, Event::TcpConnectionAcknowledged);
            }
            CoreEvent::ConnectFailed { peer, id, error } => {
                let Some(p) = self.peers.get_mut(&peer) else { return };
                if p.pending_connect != Some(id) {
                    return;
                }
                p.pending_connect = None;
                debug!(%peer, %error, "BGP connect failed");
                p.last_error = Some(error);
                self.step(peer, Event::TcpConnectionFails);
            }
            CoreEvent::Accepted { remote, stream } => self.accepted(canonical(remote.ip()), stream),
            CoreEvent::Received { peer, id, outcome } => {
                if !self.current(peer, id) {
                    return;
                }
                match &outcome {
                    DecodeOutcome::Notify(n) => {
                        self.malformed_messages += 1;
                        warn!(%peer, code = n.code, subcode = n.subcode, "malformed BGP message from peer; closing the session");
                    }
                    DecodeOutcome::TreatAsWithdraw { withdrawn, reason } => {
                        self.malformed_messages += 1;
                        if let Some(p) = self.peers.get_mut(&peer) {
                            p.updates_treated_as_withdraw += 1;
                        }
                        warn!(%peer, prefixes = withdrawn.len(), %reason, "malformed UPDATE attribute: its prefixes are treated as withdrawn (RFC 7606)");
                    }
                    DecodeOutcome::PartlyIgnored { ignored, .. } => {
                        self.ignored_nlri += ignored.len() as u64;
                        for what in ignored {
                            if self.logged_once.insert((peer, what.clone())) {
                                warn!(%peer, ignored = %what, "UPDATE part ignored, session kept (RFC 7606); logged once per peer");
                            }
                        }
                    }
                    _ => {}
                }
                if let DecodeOutcome::Message(Message::Notification(n)) = &outcome {
                    if let Some(p) = self.peers.get_mut(&peer) {
                        p.notifications_received += 1;
                        p.last_error = Some(format!("NOTIFICATION received: code {} subcode {}", n.code, n.subcode));
                    }
                    warn!(%peer, code = n.code, subcode = n.subcode, "BGP NOTIFICATION received; session closed, will retry");
                }
                if let DecodeOutcome::Message(Message::Update(_)) = &outcome {
                    if let Some(p) = self.peers.get_mut(&peer) {
                        p.updates_received += 1;
                    }
                }
                self.step(peer, Event::from(outcome));
            }
            CoreEvent::Closed { peer, id, error } => {
                if !self.current(peer, id) {
                    return;
                }
                if let Some(p) = self.peers.get_mut(&peer) {
                    p.last_error = error.clone();
                    if p.state() == State::Established {
                        warn!(%peer, error = error.as_deref().unwrap_or(""), "BGP connection lost");
                    }
                }
                self.step(peer, Event::TcpConnectionFails);
            }
            CoreEvent::SetPeers(peers) => self.set_peers(peers),
            CoreEvent::SetPrefixes(prefixes) => self.set_prefixes(prefixes),
            CoreEvent::SetPolicies(policies) => {
                let changes = self.rib.set_import_policy(policies.import);
                self.rib_changed(changes);
                if self.rib.set_export_policy(policies.export) {
                    self.resync_all_peers();
                }
            }
            CoreEvent::Bfd(event) => self.bfd_event(event),
            CoreEvent::KernelView(reach) => {
                let changes = self.rib.set_reachability(reach);
                if !changes.is_empty() {
                    debug!(changes = changes.len(), "kernel routes or addresses changed: next hops re-resolved");
                }
                self.rib_changed(changes);
                self.fib_dirty = true;
            }
            CoreEvent::Shutdown { .. } => unreachable!("handled by run"),
        }
    }

    fn current(&self, peer: IpAddr, id: u64) -> bool {
        self.peers.get(&peer).and_then(|p| p.connection.as_ref()).is_some_and(|c| c.id == id)
    }

    fn attach(&mut self, peer: IpAddr, stream: TcpStream, direction: Direction) {
        let id = self.next_connection_id;
        self.next_connection_id += 1;
        let local = stream.local_addr().ok();
        let (outgoing, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(run_connection(peer, id, stream, rx, self.wire.clone()));
        if let Some(p) = self.peers.get_mut(&peer) {
            p.connection = Some(Connection { id, direction, local, outgoing, task });
        }
    }

    fn accepted(&mut self, remote: IpAddr, stream: TcpStream) {
        let Some(p) = self.peers.get_mut(&remote) else {
            debug!(%remote, "BGP connection from an unconfigured address refused");
            return;
        };
        if p.session.as_ref().is_some_and(Session::in_idle_hold) {
            debug!(peer = %remote, "connection refused: the peer is held down after exceeding its prefix limit");
            return;
        }
        // Accepted sockets get the session's TTL and GTSM too (outbound ones are set before
        // connect). The handshake itself passed the shared listener, which has no minimum TTL;
        // from here on a GTSM peer's short-TTL packets are dropped, so such a peer never gets
        // past OpenSent.
        if let Err(e) = set_session_ttl(stream.as_raw_fd(), &p.config, self.config.local_asn) {
            warn!(peer = %remote, error = %e, "cannot set the session TTL or GTSM minimum; connection refused");
            return;
        }
        match p.state() {
            State::Established => {
                debug!(peer = %remote, "second connection while Established; refused");
            }
            State::Idle | State::Connect | State::Active => {
                p.pending_connect = None;
                if let Some(old) = p.connection.take() {
                    old.task.abort();
                }
                let was_idle = p.state() == State::Idle;
                self.attach(remote, stream, Direction::Inbound);
                if was_idle {
                    // Waiting for the retry timer: the peer is here now, start at once.
                    self.step_filtered(remote, Event::ManualStart, |o| !matches!(o, Output::Connect));
                }
                self.step(remote, Event::TcpConnectionConfirmed);
            }
            State::OpenSent | State::OpenConfirm => {
                let existing = p.connection.as_ref().map_or(Direction::Outbound, |c| c.direction);
                let remote_id = p
                    .session
                    .as_ref()
                    .and_then(|s| s.negotiated())
                    .map(|n| n.peer_router_id)
                    .or(match remote {
                        // Before its OPEN the peer's identifier is unknown; nodes use their
                        // address as router id, which is the best guess.
                        IpAddr::V4(v4) => Some(v4),
                        IpAddr::V6(_) => None,
                    })
                    .unwrap_or(Ipv4Addr::UNSPECIFIED);
                let keep = resolve_collision(
                    self.config.router_id,
                    self.config.local_asn,
                    remote_id,
                    p.config.asn,
                    existing,
                    false,
                );
                if keep == existing {
                    debug!(peer = %remote, "connection collision: keeping the existing connection");
                    return;
                }
                debug!(peer = %remote, "connection collision: switching to the peer's connection");
                self.step(remote, Event::CollisionLost);
                self.attach(remote, stream, Direction::Inbound);
                self.step_filtered(remote, Event::ManualStart, |o| !matches!(o, Output::Connect));
                self.step(remote, Event::TcpConnectionConfirmed);
            }
        }
    }

    fn step(&mut self, peer: IpAddr, event: Event) {
        self.step_filtered(peer, event, |_| true);
    }

    fn step_filtered(&mut self, peer: IpAddr, event: Event, keep: impl Fn(&Output) -> bool) {
        let Some(p) = self.peers.get_mut(&peer) else { return };
        let Some(session) = p.session.take() else { return };
        let before = session.state();
        let (session, outputs) = session.step(event);
        let after = session.state();
        p.session = Some(session);
        if before != after {
            debug!(%peer, from = ?before, to = ?after, "BGP state change");
        }
        for output in outputs.into_iter().filter(|o| keep(o)) {
            self.output(peer, output);
        }
    }

    fn output(&mut self, peer: IpAddr, output: Output) {
        match output {
            Output::Connect => {
                let id = self.next_connection_id;
                self.next_connection_id += 1;
                let Some(p) = self.peers.get_mut(&peer) else { return };
                if p.config.passive {
                    return;
                }
                p.pending_connect = Some(id);
                tokio::spawn(connect(p.config.clone(), self.config.local_asn, self.wire.clone(), id));
            }
            Output::CloseConnection => {
                if let Some(p) = self.peers.get_mut(&peer) {
                    p.pending_connect = None;
                    if let Some(c) = p.connection.take() {
                        // Dropping the sender lets the task flush and close.
                        self.closing.push(c.task);
                        self.closing.retain(|t| !t.is_finished());
                    }
                }
            }
            Output::SendMessage(message) => {
                if let Some(p) = self.peers.get_mut(&peer) {
                    if let Message::Notification(n) = &message {
                        p.notifications_sent += 1;
                        warn!(%peer, code = n.code, subcode = n.subcode, "sending BGP NOTIFICATION");
                    }
                    if let Some(c) = &p.connection {
                        let _ = c.outgoing.send(message);
                    }
                }
            }
            Output::StartTimer(kind, after) => {
                if let Some(p) = self.peers.get_mut(&peer) {
                    p.timers.insert(kind, Instant::now() + after);
                }
            }
            Output::StopTimer(kind) => {
                if let Some(p) = self.peers.get_mut(&peer) {
                    p.timers.remove(&kind);
                }
            }
            Output::SessionEstablished(negotiated) => self.established(peer, negotiated),
            Output::SessionDown { reason, negotiated } => self.down(peer, reason, negotiated),
            Output::RoutesReceived(update) => {
                if let Some(limit) = self.peers.get(&peer).and_then(|p| p.config.max_prefixes) {
                    // Checked before applying: the excess never reaches the Loc-RIB, the
                    // kernel or other peers.
                    if let Some((family, count)) = self.rib.prefix_limit_exceeded(peer, &update, limit) {
                        self.max_prefixes_exceeded(peer, family, count, limit);
                        return;
                    }
                }
                self.apply_update(peer, update);
            }
            Output::EndOfRibReceived(afi, safi) => {
                let Some(family) = Family::from_afi_safi(afi, safi) else { return };
                debug!(%peer, ?family, "End-of-RIB received");
                let out = self.helper.on_end_of_rib(&mut self.rib, peer, family);
                self.gr_timers_apply(out.timers);
                self.rib_changed(out.rib_changes);
                let out = self.restart.on_end_of_rib(&self.rib, peer, family);
                self.restart_output(out);
                let out = self.fib_gate.on_end_of_rib(&self.rib, peer, family);
                self.fib_gate_output(out);
            }
            Output::RouteRefreshRequested(_, _) => {
                // Re-send everything we advertise (RFC 2918); the End-of-RIB markers that come
                // with the full table are only meaningful after a session start, so drop them.
                if !self.advertising() {
                    return;
                }
                let messages: Vec<Message> = self
                    .rib
                    .initial_advertisement(peer)
                    .into_iter()
                    .filter(|m| !matches!(m, Message::EndOfRib(..)))
                    .collect();
                self.send_all(peer, messages);
            }
        }
    }

    fn apply_update(&mut self, peer: IpAddr, update: Update) {
        match self.rib.apply_update(peer, &update) {
            Ok(changes) => {
                self.rib_changed(changes);
                self.log_new_rejections();
            }
            Err(e) => warn!(%peer, error = %e, "UPDATE for a peer the RIB does not know"),
        }
    }

    /// RFC 4486: Cease 1 and the session down; its routes go as on any session loss. Logged
    /// once per peer (the hold-down bounds how often it can recur; the metric counts each).
    fn max_prefixes_exceeded(&mut self, peer: IpAddr, family: Family, count: usize, limit: u32) {
        if self.logged_once.insert((peer, "max-prefixes".to_string())) {
            warn!(%peer, ?family, count, limit, "BGP peer sent more prefixes than its limit: session closed with Cease 1 (RFC 4486) and held down (logged once per peer; counted in kube_router_bgp_max_prefixes_exceeded_total)");
        }
        if let Some(p) = self.peers.get_mut(&peer) {
            p.last_error = Some(format!("prefix limit {limit} exceeded ({family:?}: {count})"));
        }
        self.step(peer, Event::MaxPrefixesExceeded { family, limit });
    }

    /// Paths whose next hop the node cannot reach, per peer: logged when a peer's count leaves
    /// zero and when it returns to it, never per path or per retry.
    fn count_unresolved(&mut self) {
        for addr in self.peers.keys().copied().collect::<Vec<_>>() {
            let (count, example) = self.rib.unresolved(addr);
            let before = self.unresolved.insert(addr, count).unwrap_or(0);
            match (before, count, example) {
                (0, 1.., Some((prefix, next_hop))) => warn!(
                    peer = %addr,
                    count,
                    example = %format!("{prefix:?} via {next_hop}"),
                    "paths whose next hop this node cannot reach are not used (counted in kube_router_bgp_prefixes_unresolved)"
                ),
                (1.., 0, _) => info!(peer = %addr, "every path's next hop resolves again"),
                _ => {}
            }
        }
        self.unresolved.retain(|addr, _| self.peers.contains_key(addr));
    }

    /// The import policy's refusals, one line per peer and reason, ever.
    fn log_new_rejections(&mut self) {
        let mut new = Vec::new();
        for ((peer, reason), count) in self.rib.rejections() {
            if self.logged_once.insert((*peer, reason.label().to_string())) {
                new.push((*peer, *reason, count.example));
            }
        }
        for (peer, reason, example) in new {
            warn!(%peer, %example, reason = %reason, "routes refused by the import policy (logged once per peer and reason; counted in kube_router_bgp_routes_rejected_total)");
        }
    }

    /// The export policy changed: every established peer gets what it should have now.
    fn resync_all_peers(&mut self) {
        if !self.advertising() {
            return;
        }
        let established: Vec<IpAddr> =
            self.peers.iter().filter(|(_, p)| p.state() == State::Established).map(|(a, _)| *a).collect();
        for peer in established {
            let updates = self.rib.sync_adj_rib_out(peer, None);
            self.send_all(peer, updates.into_iter().map(Message::Update).collect());
        }
    }

    fn advertising(&self) -> bool {
        !(self.restarting && self.restart.is_deferring())
    }

    fn send_all(&mut self, peer: IpAddr, messages: Vec<Message>) {
        if let Some(c) = self.peers.get(&peer).and_then(|p| p.connection.as_ref()) {
            for m in messages {
                let _ = c.outgoing.send(m);
            }
        }
    }

    fn established(&mut self, peer: IpAddr, negotiated: Negotiated) {
        let Some(p) = self.peers.get_mut(&peer) else { return };
        p.established_at = Some(Instant::now());
        p.last_error = None;
        let local = p.connection.as_ref().and_then(|c| c.local).map(|a| canonical(a.ip()));
        info!(%peer, asn = negotiated.peer_asn, router_id = %negotiated.peer_router_id,
            families = ?negotiated.families, graceful_restart = negotiated.peer_graceful_restart.is_some(),
            "BGP session established");
        let info = PeerInfo {
            address: peer,
            asn: negotiated.peer_asn,
            router_id: negotiated.peer_router_id,
            route_reflector_client: p.config.route_reflector_client,
            local_ipv4: match local {
                Some(IpAddr::V4(v4)) => Some(v4),
                _ => self.config.ipv4_next_hop,
            },
            local_ipv6: match local {
                Some(IpAddr::V6(v6)) if !v6.is_unicast_link_local() => Some(v6),
                _ => self.config.ipv6_next_hop,
            },
            families: negotiated.families.clone(),
            role: match p.config.kind {
                PeerKind::Node { .. } => PeerRole::Node,
                PeerKind::External => PeerRole::External,
            },
            accept_default: p.config.accept_default,
        };
        let changes = self.rib.upsert_peer(info);
        self.rib_changed(changes);
        let out = self.helper.on_session_established(&mut self.rib, peer, &negotiated);
        self.gr_timers_apply(out.timers);
        self.rib_changed(out.rib_changes);
        let fib_out = self.fib_gate.on_session_established(&self.rib, peer, &negotiated);
        let mut restart = self.restart.on_session_established(&self.rib, peer, &negotiated);
        if negotiated.peer_graceful_restart.as_ref().is_some_and(|gr| gr.restart_state) {
            // A peer that is itself restarting waits for *our* End-of-RIB first (RFC 4724
            // §4.1); waiting for its own would deadlock until the deferral timer.
            for family in &negotiated.families {
                let out = self.restart.on_end_of_rib(&self.rib, peer, *family);
                if out.completion.is_some() {
                    restart = out;
                }
            }
        }
        // While we defer after our own restart, restart_output sends every established peer
        // its table once the picture is complete; otherwise this peer gets it now.
        if self.advertising() {
            let messages = self.rib.initial_advertisement(peer);
            self.send_all(peer, messages);
        }
        self.restart_output(restart);
        self.fib_gate_output(fib_out);
        self.write_marker();
    }

    fn down(&mut self, peer: IpAddr, reason: DownReason, negotiated: Negotiated) {
        if let Some(p) = self.peers.get_mut(&peer) {
            p.established_at = None;
        }
        if matches!(reason, DownReason::AgentShutdown { .. }) {
            return; // we are going away; the kernel keeps what it has
        }
        warn!(%peer, ?reason, "BGP session down");
        let out = self.helper.on_session_down(&mut self.rib, peer, &reason, &negotiated);
        if self.helper.is_helping(peer) {
            info!(%peer, stale = self.rib.stale_count(peer), "graceful restart helper: keeping the peer's routes as stale");
        }
        self.gr_timers_apply(out.timers);
        self.rib_changed(out.rib_changes);
        if !self.helper.is_helping(peer) {
            let out = self.restart.on_session_lost(&self.rib, peer);
            self.restart_output(out);
            let out = self.fib_gate.on_session_lost(&self.rib, peer);
            self.fib_gate_output(out);
        }
    }

    fn fib_gate_output(&mut self, out: RestartOutput) {
        let Some(completion) = out.completion else { return };
        self.fib_deadline = None;
        info!(
            gone = completion.gone_routes.len(),
            timed_out = completion.timed_out,
            "initial routing picture complete: stale kernel routes may now be removed"
        );
        self.fib_allow_deletes = true;
        self.fib_dirty = true;
    }

    fn restart_output(&mut self, out: RestartOutput) {
        self.gr_timers_apply(out.timers);
        let Some(completion) = out.completion else { return };
        if self.restarting {
            info!(timed_out = completion.timed_out, "graceful restart: peers' End-of-RIB received, advertising");
        }
        let was_deferring = self.restarting;
        self.restarting = false;
        let established: Vec<IpAddr> =
            self.peers.iter().filter(|(_, p)| p.state() == State::Established).map(|(a, _)| *a).collect();
        for p in self.peers.values_mut() {
            if let Some(s) = &mut p.session {
                s.set_restarting(false);
            }
        }
        if was_deferring {
            for peer in established {
                let messages = self.rib.initial_advertisement(peer);
                self.send_all(peer, messages);
            }
        }
    }

    fn gr_timers_apply(&mut self, commands: Vec<TimerCommand>) {
        for command in commands {
            match command {
                TimerCommand::Start(timer, after) => {
                    self.gr_timers.insert(timer, Instant::now() + after);
                }
                TimerCommand::Stop(timer) => {
                    self.gr_timers.remove(&timer);
                }
            }
        }
    }

    /// Pushes Loc-RIB changes to established peers and marks the FIB for an update.
    fn rib_changed(&mut self, changes: Vec<BestPathChange>) {
        // Unusable paths change nothing in the Loc-RIB, but may change the unresolved counts.
        self.unresolved_dirty = true;
        if changes.is_empty() {
            return;
        }
        self.fib_dirty = true;
        if !self.advertising() {
            return;
        }
        let prefixes: Vec<Prefix> = changes.iter().map(BestPathChange::prefix).collect();
        let established: Vec<IpAddr> =
            self.peers.iter().filter(|(_, p)| p.state() == State::Established).map(|(a, _)| *a).collect();
        for peer in established {
            let updates = self.rib.sync_adj_rib_out(peer, Some(&prefixes));
            self.send_all(peer, updates.into_iter().map(Message::Update).collect());
        }
    }

    fn session_config(&self, peer: &PeerConfig) -> SessionConfig {
        let mut config = SessionConfig::new(self.config.local_asn, peer.asn, self.config.router_id);
        config.hold_time_secs = self.config.hold_time_secs;
        config.connect_retry = self.config.connect_retry.clone();
        config.passive = peer.passive;
        config.families = self.config.families.clone();
        config.graceful_restart = self.config.graceful_restart.as_ref().map(|gr| GracefulRestartConfig {
            restart_time_secs: gr.restart_time.as_secs().min(u64::from(u16::MAX)) as u16,
            restarting: self.restarting,
        });
        config
    }

    fn set_peers(&mut self, peers: Vec<PeerConfig>) {
        let wanted: BTreeMap<IpAddr, PeerConfig> = peers.into_iter().map(|p| (p.address, p)).collect();
        let gone: Vec<IpAddr> =
            self.peers.iter().filter(|(addr, p)| wanted.get(*addr) != Some(&p.config)).map(|(addr, _)| *addr).collect();
        for addr in gone {
            info!(peer = %addr, "BGP peer removed from the configuration");
            self.step(addr, Event::ManualStop);
            if let Some(p) = self.peers.remove(&addr) {
                if let Some(c) = p.connection {
                    self.closing.push(c.task);
                }
            }
            let changes = self.rib.remove_peer(addr);
            self.rib_changed(changes);
            let out = self.restart.remove_peer(&self.rib, addr);
            self.restart_output(out);
            let out = self.fib_gate.remove_peer(&self.rib, addr);
            self.fib_gate_output(out);
        }
        for (addr, config) in wanted {
            if self.peers.contains_key(&addr) {
                continue;
            }
            info!(peer = %addr, asn = config.asn, md5 = config.password.is_some(), "BGP peer configured");
            if let Some(password) = &config.password {
                for fd in &self.listener_fds {
                    if let Err(e) = set_tcp_md5_key(*fd, addr, password.as_bytes()) {
                        warn!(peer = %addr, error = %e, "cannot set the TCP MD5 key on the listener");
                    }
                }
            }
            let session = Session::new(self.session_config(&config));
            self.peers.insert(
                addr,
                Peer {
                    config,
                    session: Some(session),
                    connection: None,
                    pending_connect: None,
                    timers: HashMap::new(),
                    established_at: None,
                    updates_received: 0,
                    notifications_received: 0,
                    notifications_sent: 0,
                    updates_treated_as_withdraw: 0,
                    last_error: None,
                    bfd_up: None,
                },
            );
            self.restart_wait_for(addr);
            self.step(addr, Event::ManualStart);
        }
        self.set_bfd_peers();
    }

    /// Tells the BFD task which peers to watch (starting it for the first one).
    fn set_bfd_peers(&mut self) {
        let watched: Vec<BfdPeer> = self
            .peers
            .values()
            .filter_map(|p| p.config.bfd.map(|config| BfdPeer { address: p.config.address, config }))
            .collect();
        if watched.is_empty() && self.bfd.is_none() {
            return;
        }
        let sender = self.bfd.get_or_insert_with(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            let events = self.events.clone();
            tokio::spawn(run_bfd(
                self.config.bfd_port,
                rx,
                move |e| {
                    let _ = events.send(CoreEvent::Bfd(e));
                },
                self.bfd_ttl_dropped.clone(),
            ));
            tx
        });
        let _ = sender.send(watched);
    }

    fn bfd_event(&mut self, event: BfdEvent) {
        match event {
            BfdEvent::Up(peer) => {
                if let Some(p) = self.peers.get_mut(&peer) {
                    p.bfd_up = Some(true);
                }
            }
            BfdEvent::Down(peer) => {
                let Some(p) = self.peers.get_mut(&peer) else { return };
                p.bfd_up = Some(false);
                if p.state() == State::Established {
                    warn!(%peer, "BFD: the path to the peer is down; closing the BGP session");
                    p.last_error = Some("BFD session down".into());
                    self.step(peer, Event::BfdDown);
                }
            }
        }
    }

    /// Adds a peer to those whose End-of-RIB the first complete routing picture waits for.
    fn restart_wait_for(&mut self, peer: IpAddr) {
        self.restart.add_peer(peer);
        self.fib_gate.add_peer(peer);
    }

    fn set_prefixes(&mut self, prefixes: Vec<Originated>) {
        // A prefix that is both (a pod CIDR equal to a VIP) is a pod CIDR.
        let mut wanted: BTreeMap<Prefix, OriginKind> = BTreeMap::new();
        for (prefix, kind) in prefixes {
            let entry = wanted.entry(prefix).or_insert(kind);
            *entry = (*entry).min(kind);
        }
        let mut changes = Vec::new();
        for gone in self.prefixes.keys().filter(|p| !wanted.contains_key(*p)) {
            changes.extend(self.rib.withdraw_originated(*gone));
        }
        for (new, kind) in wanted.iter().filter(|(p, k)| self.prefixes.get(*p) != Some(*k)) {
            let next_hop = match new.family() {
                Family::Ipv4Unicast => NextHop::V4(self.config.ipv4_next_hop.unwrap_or(self.config.router_id)),
                Family::Ipv6Unicast => {
                    NextHop::V6 { global: self.config.ipv6_next_hop.unwrap_or(Ipv6Addr::UNSPECIFIED), link_local: None }
                }
            };
            let attributes = PathAttributes { origin: Origin::Igp, ..PathAttributes::default() };
            changes.extend(self.rib.originate(*new, next_hop, attributes, *kind));
        }
        self.advertisements.count_changes(&self.prefixes, &wanted);
        if self.prefixes != wanted {
            let list: Vec<String> = wanted.keys().map(Prefix::to_string).collect();
            info!(prefixes = %list.join(","), "advertising");
        }
        self.prefixes = wanted;
        self.rib_changed(changes);
    }

    async fn shutdown(&mut self, graceful: bool, wire: &mut mpsc::Receiver<CoreEvent>) {
        info!(graceful, "BGP speaker stopping; kernel routes stay");
        let addrs: Vec<IpAddr> = self.peers.keys().copied().collect();
        for addr in addrs {
            self.step(addr, Event::AgentShutdown { graceful_restart: graceful });
        }
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
        if !graceful || self.config.graceful_restart.is_none() {
            if let Some(path) = marker_path(&self.config) {
                let _ = std::fs::remove_file(path);
            }
        }
    }

    fn write_marker(&self) {
        if self.config.graceful_restart.is_none() {
            return;
        }
        if let Some(path) = marker_path(&self.config) {
            if !path.exists() {
                if let Err(e) = std::fs::write(&path, b"graceful restart: routes were advertised\n") {
                    warn!(path = %path.display(), error = %e, "cannot write the graceful-restart marker");
                }
            }
        }
    }

    /// Our address towards a node, as its tunnel's local end (the one it knows us by).
    fn tunnel_local(&self, peer: IpAddr) -> Ipv4Addr {
        let session = self.peers.get(&peer).and_then(|p| p.connection.as_ref()).and_then(|c| c.local);
        match session.map(|a| canonical(a.ip())) {
            Some(IpAddr::V4(v4)) => v4,
            _ => self.config.ipv4_next_hop.unwrap_or(self.config.router_id),
        }
    }

    fn fib_target(&self) -> FibTarget {
        let own: BTreeSet<IpAddr> = self
            .peers
            .values()
            .filter_map(|p| p.connection.as_ref().and_then(|c| c.local).map(|a| canonical(a.ip())))
            .chain(std::iter::once(IpAddr::V4(self.config.router_id)))
            .collect();
        let hop = |peer: IpAddr, next_hop: IpAddr| PathHop {
            peer,
            next_hop,
            from_node: self.rib.peer(peer).is_some_and(|p| p.role == PeerRole::Node),
            tunnel_local: self.tunnel_local(peer),
        };
        let learned = self.rib.loc_rib().iter().filter_map(|(prefix, best)| {
            let RouteSource::Peer(peer) = best.source else { return None };
            let next_hop = best.next_hop.addr();
            if own.contains(&next_hop) || next_hop.is_unspecified() {
                return None;
            }
            let destination = IpNet::new(prefix.addr(), prefix.prefix_len()).ok()?;
            let multipath = best
                .multipath
                .iter()
                .map(|other| self.rib.peers_with_path(prefix, other).map(|p| hop(p, other.addr())).collect())
                .collect();
            Some(Learned { destination, best: hop(peer, next_hop), multipath })
        });
        let node_peers = self.peers.iter().filter_map(|(address, peer)| match (address, &peer.config.kind) {
            (IpAddr::V4(v4), PeerKind::Node { .. }) => {
                Some(NodePeer { address: *v4, tunnel_local: self.tunnel_local(*address) })
            }
            _ => None,
        });
        Planner { reach: self.rib.reachability(), overlay: self.rib.overlay() }.plan(
            learned,
            node_peers,
            self.fib_allow_deletes,
        )
    }

    fn publish(&mut self) {
        // Counting is a walk over every Adj-RIB-In: at most once a second, while paths arrive.
        if self.unresolved_dirty && Instant::now() >= self.unresolved_recount_at {
            self.unresolved_dirty = false;
            self.unresolved_recount_at = Instant::now() + UNRESOLVED_RECOUNT;
            self.count_unresolved();
        }
        let peers = self
            .peers
            .iter()
            .map(|(addr, p)| PeerStatus {
                address: *addr,
                asn: p.config.asn,
                state: p.state(),
                established_at: p.established_at.filter(|_| p.state() == State::Established).map(Instant::into_std),
                prefixes_received: self.rib.adj_rib_in(*addr).map_or(0, |r| r.len()),
                prefixes_rejected: self.rib.rejected_count(*addr),
                prefixes_unresolved: self.unresolved.get(addr).copied().unwrap_or(0),
                prefixes_stale: self.rib.stale_count(*addr),
                prefixes_advertised: self.rib.adj_rib_out(*addr).map_or(0, |r| r.len()),
                updates_received: p.updates_received,
                notifications_received: p.notifications_received,
                notifications_sent: p.notifications_sent,
                updates_treated_as_withdraw: p.updates_treated_as_withdraw,
                max_prefix_violations: p.session.as_ref().map_or(0, Session::max_prefix_violations),
                last_error: p.last_error.clone(),
                bfd_up: p.bfd_up.filter(|_| p.config.bfd.is_some()),
            })
            .collect();
        let status = SpeakerStatus {
            local_asn: self.config.local_asn,
            router_id: Some(self.config.router_id),
            restarted: self.restarted,
            restarting: self.restarting,
            deferring: self.restart.is_deferring() || self.fib_gate.is_deferring(),
            routing_complete: self.fib_allow_deletes,
            peers,
            loc_rib: self.status_routes(),
            loc_rib_size: self.rib.loc_rib().len(),
            malformed_messages: self.malformed_messages,
            rejections: self.rib.rejections().iter().map(|((peer, reason), c)| (*peer, *reason, c.total)).collect(),
            ignored_nlri: self.ignored_nlri,
            bfd_ttl_dropped: self.bfd_ttl_dropped.load(std::sync::atomic::Ordering::Relaxed),
            fib: FibStats::default(),
            advertisements: self.advertisements,
        };
        *self.status.lock().unwrap_or_else(|p| p.into_inner()) = status;
        // After the status: what the kernel is told (a deletion allowed by `routing_complete`)
        // is never seen before the status that explains it.
        if self.fib_dirty {
            self.fib_dirty = false;
            let target = self.fib_target();
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

    /// The Loc-RIB as the status lists it: the previous list while the Loc-RIB is unchanged.
    fn status_routes(&mut self) -> Arc<Vec<StatusRoute>> {
        let version = self.rib.loc_rib_version();
        if let Some((built_from, routes)) = &self.status_routes {
            if *built_from == version {
                return routes.clone();
            }
        }
        let loc_rib = self.rib.loc_rib();
        let routes: Vec<StatusRoute> = if loc_rib.len() <= STATUS_ROUTES_MAX {
            loc_rib
                .iter()
                .map(|(prefix, best)| StatusRoute {
                    prefix: *prefix,
                    next_hop: best.next_hop.addr(),
                    from: match best.source {
                        RouteSource::Local(_) => None,
                        RouteSource::Peer(a) => Some(a),
                    },
                })
                .collect()
        } else {
            Vec::new() // too large to list; loc_rib_size still counts it
        };
        let routes = Arc::new(routes);
        self.status_routes = Some((version, routes.clone()));
        routes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A core with no peers and no sockets: what `publish` makes of its RIB.
    fn idle_core() -> (Core, Arc<Mutex<SpeakerStatus>>) {
        let (events, _) = mpsc::unbounded_channel();
        let (wire, _) = mpsc::channel(1);
        let (fib, _) = watch::channel(FibTarget::default());
        let status = Arc::new(Mutex::new(SpeakerStatus::default()));
        let config = SpeakerConfig::new(64512, Ipv4Addr::new(10, 0, 0, 1));
        let core = Core::new(config, false, RouteSet::new(), &[], CoreQueues { events, wire }, fib, status.clone());
        (core, status)
    }

    #[tokio::test]
    async fn publishing_reuses_the_route_list_until_the_loc_rib_changes() {
        let (mut core, status) = idle_core();
        let published = || status.lock().unwrap().loc_rib.clone();
        let pod_cidr: Prefix = "10.244.1.0/24".parse().unwrap();
        core.set_prefixes(vec![(pod_cidr, OriginKind::PodCidr)]);
        core.publish();
        let first = published();
        assert_eq!(*first, vec![StatusRoute { prefix: pod_cidr, next_hop: "10.0.0.1".parse().unwrap(), from: None }]);
        // Nothing changed in the Loc-RIB: the same list, not a copy of it.
        core.publish();
        assert!(Arc::ptr_eq(&first, &published()), "an unchanged Loc-RIB was listed again");
        // The same prefixes again change nothing either.
        core.set_prefixes(vec![(pod_cidr, OriginKind::PodCidr)]);
        core.publish();
        assert!(Arc::ptr_eq(&first, &published()));
        // A new route: a new list, with it.
        let vip: Prefix = "10.96.0.10/32".parse().unwrap();
        core.set_prefixes(vec![(pod_cidr, OriginKind::PodCidr), (vip, OriginKind::ServiceVip)]);
        core.publish();
        let second = published();
        assert!(!Arc::ptr_eq(&first, &second));
        assert_eq!(second.iter().map(|r| r.prefix).collect::<Vec<_>>(), vec![vip, pod_cidr]);
        assert_eq!(status.lock().unwrap().loc_rib_size, 2);
    }

    #[test]
    fn advertisements_count_what_kube_router_counts_by_type() {
        let prefix = |s: &str| s.parse::<Prefix>().unwrap();
        let (pod, vip, other_vip) = (prefix("10.244.1.0/24"), prefix("10.96.0.10/32"), prefix("192.0.2.7/32"));
        let mut counts = Advertisements::default();
        let first = BTreeMap::from([(pod, OriginKind::PodCidr), (vip, OriginKind::ServiceVip)]);
        counts.count_changes(&BTreeMap::new(), &first);
        assert_eq!(counts, Advertisements { pod_route: 1, advertise_vip: 1, withdraw_vip: 0 });
        // The same set again changes nothing; a VIP replaced by another is one of each.
        counts.count_changes(&first, &first);
        let second = BTreeMap::from([(pod, OriginKind::PodCidr), (other_vip, OriginKind::ServiceVip)]);
        counts.count_changes(&first, &second);
        assert_eq!(counts, Advertisements { pod_route: 1, advertise_vip: 2, withdraw_vip: 1 });
    }
}
