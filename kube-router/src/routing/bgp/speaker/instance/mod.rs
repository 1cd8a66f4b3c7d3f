//! The speaker's pure core: every session, the RIB and both graceful-restart roles, driven by
//! typed inputs and answering with typed actions. No sockets, no tasks, no clock of its own:
//! each input comes with the time it happens, so a recorded run replays exactly
//! (`super::tests`). The tasks in `super::tasks` own the sockets and execute the actions.
//!
//! Cut like holo-bgp's instance: this file holds the state, construction, the dispatch of
//! inputs and what is published; `events` has one function per input event, `outputs`
//! applies what the session FSM and graceful restart answer.
mod events;
mod outputs;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr, SocketAddr},
    sync::Arc,
    time::{Duration, Instant},
};

use ipnet::IpNet;
use tracing::info;

use super::{
    status::{Advertisements, PeerStatus, SpeakerStatus, StatusRoute, STATUS_ROUTES_MAX},
    Originated, Policies, SpeakerConfig,
};
use crate::{
    routing::bgp::{
        bfd_io::{BfdEvent, BfdPeer},
        codec::DecodeOutcome,
        fsm::{Direction, Session, State, TimerKind},
        graceful_restart::{GrTimer, GracefulRestartHelper, RestartingSpeaker},
        message::{Message, Prefix},
        peers::{PeerConfig, PeerKind},
        policy::{OriginKind, PeerRole},
        rib::{Rib, RibConfig, RouteSource},
    },
    routing::fib::{
        health::FibStats,
        resolve::Reachability,
        target::{Learned, NodePeer, PathHop, Planner},
        task::FibTarget,
        RouteSet,
    },
};

/// How often the per-peer unresolved-path counts may be recomputed while paths change.
const UNRESOLVED_RECOUNT: Duration = Duration::from_secs(1);

/// A TCP connection as the core knows it: who opened it and a number. The stream itself stays
/// in its task.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ConnId {
    /// Our connection attempt, numbered by the core.
    Dialed(u64),
    /// A connection a listener accepted, numbered by the accept side.
    Accepted(u64),
}

/// Something that happened, for the core to react to.
#[derive(Debug)]
pub enum Input {
    /// Our attempt `conn` to reach `peer` succeeded; `local` is our end.
    Connected {
        peer: IpAddr,
        conn: ConnId,
        local: Option<SocketAddr>,
    },
    ConnectFailed {
        peer: IpAddr,
        conn: ConnId,
        error: String,
    },
    /// A connection from `remote` (already carrying the session's TTL and GTSM options, set
    /// by the accept side from [`Instance::peer_config`]).
    Accepted {
        remote: IpAddr,
        conn: ConnId,
        local: Option<SocketAddr>,
    },
    Received {
        peer: IpAddr,
        conn: ConnId,
        outcome: DecodeOutcome,
    },
    /// The connection failed or the peer closed it.
    Closed {
        peer: IpAddr,
        conn: ConnId,
        error: Option<String>,
    },
    SetPeers(Vec<PeerConfig>),
    SetPrefixes(Vec<Originated>),
    SetPolicies(Box<Policies>),
    /// The kernel's routes and addresses as the FIB task last read them.
    KernelView(Reachability),
    Bfd(BfdEvent),
    /// The clock passed [`Instance::next_deadline`]: every timer due fires.
    TimersDue,
    /// The agent stops: sessions close (without a Cease when `graceful`), kernel routes stay.
    Shutdown {
        graceful: bool,
    },
}

/// What the core wants done, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Open a TCP connection to `peer` (its address, port, password, TTL); report as `conn`.
    Connect {
        conn: ConnId,
        peer: Box<PeerConfig>,
    },
    /// Start reading and writing `conn` (its stream waits at the socket side until then;
    /// a stream never opened is closed).
    Open {
        peer: IpAddr,
        conn: ConnId,
    },
    Send {
        conn: ConnId,
        message: Message,
    },
    /// Flush what was sent on `conn`, then close it.
    Close {
        conn: ConnId,
    },
    /// Drop `conn` at once (a newer connection from the same peer replaces it).
    Abort {
        conn: ConnId,
    },
    /// Accept the peer's connections only with its TCP MD5 key (RFC 2385) on the listeners.
    ListenerMd5(Box<PeerConfig>),
    /// The peers BFD watches now.
    WatchBfd(Vec<BfdPeer>),
    /// Our routes were advertised: a later start of the agent is a graceful restart.
    MarkRestartable,
}

/// What the core publishes after a burst of inputs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    pub status: SpeakerStatus,
    /// A new target for the kernel, when something that goes into it changed.
    pub fib: Option<FibTarget>,
}

#[derive(Debug)]
struct Connection {
    id: ConnId,
    direction: Direction,
    local: Option<SocketAddr>,
}

#[derive(Debug)]
struct Peer {
    config: PeerConfig,
    session: Option<Session>,
    connection: Option<Connection>,
    pending_connect: Option<ConnId>,
    timers: BTreeMap<TimerKind, Instant>,
    established_at: Option<Instant>,
    updates_received: u64,
    notifications_received: u64,
    notifications_sent: u64,
    updates_treated_as_withdraw: u64,
    last_error: Option<String>,
    bfd_up: Option<bool>,
}

impl Peer {
    fn new(config: PeerConfig, session: Session) -> Self {
        Self {
            config,
            session: Some(session),
            connection: None,
            pending_connect: None,
            timers: BTreeMap::new(),
            established_at: None,
            updates_received: 0,
            notifications_received: 0,
            notifications_sent: 0,
            updates_treated_as_withdraw: 0,
            last_error: None,
            bfd_up: None,
        }
    }

    fn state(&self) -> State {
        self.session.as_ref().map_or(State::Idle, Session::state)
    }
}

/// The BGP instance: sessions, RIB, graceful restart, and the counters the status shows.
pub struct Instance {
    config: SpeakerConfig,
    /// The time of the input being handled.
    now: Instant,
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
    gr_timers: BTreeMap<GrTimer, Instant>,
    fib_allow_deletes: bool,
    fib_dirty: bool,
    next_dial: u64,
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
    /// The last published route list and the Loc-RIB version it was built from.
    status_routes: Option<(u64, Arc<Vec<StatusRoute>>)>,
    /// Actions of the input being handled.
    actions: Vec<Action>,
}

impl Instance {
    /// A speaker starting at `now`. `restarting`: the previous run advertised our routes and
    /// left the kernel's (graceful restart, R-bit). `installed`: routes of our protocol the
    /// kernel has; they stay until the first complete routing picture says they are gone.
    pub fn new(
        config: SpeakerConfig,
        restarting: bool,
        installed: &RouteSet,
        initial_peers: &[PeerConfig],
        now: Instant,
    ) -> Self {
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
        let mut instance = Self {
            config,
            now,
            rib,
            helper: GracefulRestartHelper::new(stale_path_time),
            restart,
            fib_gate,
            fib_deadline: Some(now + deferral),
            restarting,
            restarted: restarting,
            peers: BTreeMap::new(),
            prefixes: BTreeMap::new(),
            gr_timers: BTreeMap::new(),
            fib_allow_deletes: false,
            fib_dirty: false,
            next_dial: 1,
            malformed_messages: 0,
            advertisements: Advertisements::default(),
            ignored_nlri: 0,
            logged_once: BTreeSet::new(),
            unresolved: BTreeMap::new(),
            unresolved_dirty: false,
            unresolved_recount_at: now,
            status_routes: None,
            actions: Vec::new(),
        };
        if restarting {
            info!("BGP graceful restart: restarting with forwarding state preserved (R-bit set)");
        }
        instance.restart_output(out);
        instance.fib_gate_output(fib_out);
        instance
    }

    /// Reacts to `input`, which happened at `now`.
    pub fn handle(&mut self, now: Instant, input: Input) -> Vec<Action> {
        self.now = now;
        match input {
            Input::Connected { peer, conn, local } => self.connected(peer, conn, local),
            Input::ConnectFailed { peer, conn, error } => self.connect_failed(peer, conn, error),
            Input::Accepted { remote, conn, local } => self.accepted(remote, conn, local),
            Input::Received { peer, conn, outcome } => self.received(peer, conn, outcome),
            Input::Closed { peer, conn, error } => self.closed(peer, conn, error),
            Input::SetPeers(peers) => self.set_peers(peers),
            Input::SetPrefixes(prefixes) => self.set_prefixes(prefixes),
            Input::SetPolicies(policies) => self.set_policies(*policies),
            Input::KernelView(reach) => self.kernel_view(reach),
            Input::Bfd(event) => self.bfd_event(event),
            Input::TimersDue => self.fire_timers(),
            Input::Shutdown { graceful } => self.shutdown(graceful),
        }
        std::mem::take(&mut self.actions)
    }

    /// When [`Input::TimersDue`] is next wanted (None: no timer runs).
    pub fn next_deadline(&self) -> Option<Instant> {
        self.peers
            .values()
            .flat_map(|p| p.timers.values())
            .chain(self.gr_timers.values())
            .chain(self.fib_deadline.iter())
            .chain(self.unresolved_dirty.then_some(&self.unresolved_recount_at))
            .copied()
            .min()
    }

    /// A configured peer's settings (the accept side sets its TTL options from them).
    pub fn peer_config(&self, address: IpAddr) -> Option<&PeerConfig> {
        self.peers.get(&address).map(|p| &p.config)
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

    /// Counting is a walk over every Adj-RIB-In: at most once a second, while paths arrive.
    fn recount_unresolved_when_due(&mut self) {
        if self.unresolved_dirty && self.now >= self.unresolved_recount_at {
            self.unresolved_dirty = false;
            self.unresolved_recount_at = self.now + UNRESOLVED_RECOUNT;
            self.count_unresolved();
        }
    }

    /// The status, and the kernel's target when it changed, as of `now`.
    /// A new FIB target waits for the next [`Self::publish`].
    pub fn fib_pending(&self) -> bool {
        self.fib_dirty
    }

    pub fn publish(&mut self, now: Instant) -> Published {
        self.now = now;
        self.recount_unresolved_when_due();
        let peers = self
            .peers
            .iter()
            .map(|(addr, p)| PeerStatus {
                address: *addr,
                asn: p.config.asn,
                state: p.state(),
                established_at: p.established_at.filter(|_| p.state() == State::Established),
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
            bfd_ttl_dropped: 0, // counted by the BFD task
            fib: FibStats::default(),
            advertisements: self.advertisements,
        };
        let fib = std::mem::take(&mut self.fib_dirty).then(|| self.fib_target());
        Published { status, fib }
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

/// A v4-mapped IPv6 address (from a dual-stack listener) as the IPv4 address it is.
pub(super) fn canonical(addr: IpAddr) -> IpAddr {
    match addr {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(addr),
        v4 => v4,
    }
}
