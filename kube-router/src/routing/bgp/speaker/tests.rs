//! Replays: typed inputs at chosen instants into the pure [`Instance`], and what comes out
//! (messages to peers, the FIB target, the status) checked. No sockets, no tokio, no clock:
//! every instant is `base` plus an offset, so each run is the same run.
use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    sync::Arc,
    time::{Duration, Instant},
};

use super::{
    instance::{Action, ConnId, Input, Instance},
    Advertisements, GracefulRestartSettings, SpeakerConfig, StatusRoute,
};
use crate::{
    routing::bgp::{
        codec::DecodeOutcome,
        fsm::{GracefulRestartConfig, Session, SessionConfig, State},
        message::{
            AsPathSegment, Capability, Family, Message, NextHop, Notification, Open, PathAttributes, Prefix, Update,
        },
        peers::{ExternalPeerFlag, PeerConfig},
        policy::OriginKind,
    },
    routing::fib::{Gateways, KernelRoute, RouteSet},
};

const LOCAL_ASN: u32 = 64512;
const PEER_ASN: u32 = 65001;
const ROUTER_ID: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
const PEER: IpAddr = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 2));
/// Our end of every session in these replays.
const LOCAL_END: &str = "192.0.2.1:50000";
/// The peer's restart time (its GR capability): how long we keep its routes while it is away.
const PEER_RESTART_TIME: Duration = Duration::from_secs(30);

fn prefix(s: &str) -> Prefix {
    s.parse().unwrap()
}

fn pod_cidr() -> Prefix {
    prefix("10.244.1.0/24")
}

fn peer_config() -> PeerConfig {
    ExternalPeerFlag { address: PEER, asn: PEER_ASN, password: None, port: None }.peer_config(179)
}

/// Graceful restart with short timers, each below the 90 s hold time, so a replay that waits
/// for one needs no keepalives from the peer.
fn speaker_config() -> SpeakerConfig {
    let mut config = SpeakerConfig::new(LOCAL_ASN, ROUTER_ID);
    config.graceful_restart = Some(GracefulRestartSettings {
        restart_time: Duration::from_secs(90),
        stale_path_time: Duration::from_secs(60),
        selection_deferral: Duration::from_secs(80),
    });
    config
}

/// The OPEN the peer sends: graceful restart for both families, `restarting` with R=1 and F=1.
fn peer_open(restarting: bool) -> Open {
    let mut config = SessionConfig::new(PEER_ASN, LOCAL_ASN, Ipv4Addr::new(192, 0, 2, 2));
    config.graceful_restart =
        Some(GracefulRestartConfig { restart_time_secs: PEER_RESTART_TIME.as_secs() as u16, restarting });
    Session::new(config).local_open()
}

/// An UPDATE from the peer announcing `prefixes` with itself as next hop.
fn peer_update(prefixes: &[&str]) -> Message {
    let attributes =
        PathAttributes { as_path: vec![AsPathSegment::Sequence(vec![PEER_ASN])], ..PathAttributes::default() };
    let announced = prefixes.iter().map(|p| (prefix(p), NextHop::V4(Ipv4Addr::new(192, 0, 2, 2)))).collect();
    Message::Update(Update { withdrawn: vec![], announced, attributes })
}

fn kernel_route(gateway: &str) -> KernelRoute {
    KernelRoute { gateways: Gateways::One(gateway.parse().unwrap()), mtu: None }
}

fn net(s: &str) -> ipnet::IpNet {
    s.parse().unwrap()
}

/// One replayed run: the instance, the base instant and the time now.
struct Replay {
    instance: Instance,
    base: Instant,
    now: Instant,
    next_conn: u64,
}

impl Replay {
    /// A speaker with one external peer and one pod CIDR, `installed` left in the kernel by a
    /// previous run (`restarting`: that run advertised them, so this start is a restart).
    fn start(restarting: bool, installed: RouteSet) -> (Self, Vec<Action>) {
        let base = Instant::now();
        let peers = [peer_config()];
        let instance = Instance::new(speaker_config(), restarting, &installed, &peers, base);
        let mut replay = Self { instance, base, now: base, next_conn: 1 };
        let mut actions = replay.input(Input::SetPrefixes(vec![(pod_cidr(), OriginKind::PodCidr)]));
        actions.extend(replay.input(Input::SetPeers(peers.to_vec())));
        (replay, actions)
    }

    fn input(&mut self, input: Input) -> Vec<Action> {
        self.instance.handle(self.now, input)
    }

    /// Moves the clock to `base + secs`, firing every timer due on the way at its instant.
    fn advance_to(&mut self, secs: u64) -> Vec<Action> {
        let until = self.base + Duration::from_secs(secs);
        let mut actions = Vec::new();
        while let Some(at) = self.instance.next_deadline().filter(|at| *at <= until) {
            self.now = self.now.max(at);
            actions.extend(self.input(Input::TimersDue));
        }
        self.now = until;
        actions
    }

    fn received(&mut self, conn: ConnId, message: Message) -> Vec<Action> {
        self.input(Input::Received { peer: PEER, conn, outcome: DecodeOutcome::Message(message) })
    }

    /// Our connection attempt succeeds; answers with the connection's id.
    fn connected(&mut self, actions: &[Action]) -> (ConnId, Vec<Action>) {
        let conn = dialed(actions);
        let local: SocketAddr = LOCAL_END.parse().unwrap();
        let out = self.input(Input::Connected { peer: PEER, conn, local: Some(local) });
        (conn, out)
    }

    /// An inbound connection from the peer.
    fn accepted(&mut self) -> (ConnId, Vec<Action>) {
        let conn = ConnId::Accepted(self.next_conn);
        self.next_conn += 1;
        let local: SocketAddr = LOCAL_END.parse().unwrap();
        (conn, self.input(Input::Accepted { remote: PEER, conn, local: Some(local) }))
    }

    /// From connected to Established: the peer's OPEN, then its KEEPALIVE. Answers with what
    /// the instance did once Established.
    fn establish(&mut self, conn: ConnId, peer_restarting: bool) -> Vec<Action> {
        let out = self.received(conn, Message::Open(peer_open(peer_restarting)));
        assert!(sent(&out, conn).contains(&Message::Keepalive), "an OPEN is answered with a KEEPALIVE: {out:?}");
        let out = self.received(conn, Message::Keepalive);
        assert_eq!(self.peer_state(), State::Established);
        out
    }

    fn end_of_rib(&mut self, conn: ConnId) -> Vec<Action> {
        let mut out = Vec::new();
        for family in [Family::Ipv4Unicast, Family::Ipv6Unicast] {
            out.extend(self.received(conn, Message::end_of_rib(family)));
        }
        out
    }

    fn peer_state(&mut self) -> State {
        self.instance.publish(self.now).status.peers[0].state
    }
}

/// The connection attempt among `actions`.
fn dialed(actions: &[Action]) -> ConnId {
    let conns: Vec<ConnId> = actions
        .iter()
        .filter_map(|a| match a {
            Action::Connect { conn, peer } if peer.address == PEER => Some(*conn),
            _ => None,
        })
        .collect();
    assert_eq!(conns.len(), 1, "one connection attempt to the peer: {actions:?}");
    conns[0]
}

/// The messages `actions` send on `conn`, in order.
fn sent(actions: &[Action], conn: ConnId) -> Vec<Message> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Send { conn: c, message } if *c == conn => Some(message.clone()),
            _ => None,
        })
        .collect()
}

/// The prefixes announced in the UPDATEs among `messages`.
fn announced(messages: &[Message]) -> Vec<Prefix> {
    messages
        .iter()
        .filter_map(|m| match m {
            Message::Update(u) => Some(u.announced.iter().map(|(p, _)| *p)),
            _ => None,
        })
        .flatten()
        .collect()
}

fn end_of_ribs(messages: &[Message]) -> usize {
    messages.iter().filter(|m| matches!(m, Message::EndOfRib(..))).count()
}

fn graceful_restart_capability(open: &Open) -> (bool, Vec<bool>) {
    open.capabilities
        .iter()
        .find_map(|c| match c {
            Capability::GracefulRestart(gr) => {
                Some((gr.restart_state, gr.families.iter().map(|f| f.forwarding_preserved).collect()))
            }
            _ => None,
        })
        .expect("the OPEN carries the graceful-restart capability")
}

#[test]
fn a_session_is_established_routes_are_advertised_and_learned_ones_reach_the_fib_target() {
    let (mut replay, actions) = Replay::start(false, RouteSet::new());
    assert!(actions.contains(&Action::WatchBfd(vec![])), "BFD is told its (empty) list of peers");
    let (conn, out) = replay.connected(&actions);
    assert_eq!(out[0], Action::Open { peer: PEER, conn }, "the connection's task starts first");
    let opens: Vec<Message> = sent(&out, conn);
    let [Message::Open(open)] = opens.as_slice() else { panic!("one OPEN sent on connect: {out:?}") };
    assert_eq!((open.my_asn, open.router_id), (LOCAL_ASN, ROUTER_ID));
    assert_eq!(graceful_restart_capability(open), (false, vec![false, false]), "a fresh start: R=0, F=0");
    assert_eq!(replay.peer_state(), State::OpenSent);

    replay.advance_to(3);
    let out = replay.establish(conn, false);
    let messages = sent(&out, conn);
    assert_eq!(announced(&messages), vec![pod_cidr()], "our pod CIDR goes out once Established");
    assert_eq!(end_of_ribs(&messages), 2, "then End-of-RIB for both families");
    assert!(out.contains(&Action::MarkRestartable), "advertised: a later start is a graceful restart");

    let out = replay.received(conn, peer_update(&["172.16.5.0/24"]));
    assert!(sent(&out, conn).is_empty(), "a learned route is not sent back to the peer it came from");
    let published = replay.instance.publish(replay.now);
    let target = published.fib.expect("a learned route changes the FIB target");
    assert_eq!(*target.routes.keys().collect::<Vec<_>>(), [&net("172.16.5.0/24")]);
    assert_eq!(target.routes[&net("172.16.5.0/24")].route, kernel_route("192.0.2.2"));
    assert_eq!(target.routes[&net("172.16.5.0/24")].peer, Some(PEER));
    let peer = &published.status.peers[0];
    assert_eq!((peer.state, peer.prefixes_received, peer.prefixes_advertised), (State::Established, 1, 1));
    assert_eq!(peer.established_at, Some(replay.base + Duration::from_secs(3)), "the replay's clock, not the wall's");
    assert_eq!(published.status.loc_rib_size, 2);
    // Nothing changed since: no new target.
    assert_eq!(replay.instance.publish(replay.now).fib, None);
}

#[test]
fn restarting_speaker_defers_advertisement_and_fib_deletes_until_the_peers_end_of_rib() {
    let installed = RouteSet::from([
        (net("172.16.5.0/24"), kernel_route("192.0.2.2")),
        (net("172.16.9.0/24"), kernel_route("192.0.2.2")),
    ]);
    let (mut replay, actions) = Replay::start(true, installed);
    let (conn, out) = replay.connected(&actions);
    let opens = sent(&out, conn);
    let [Message::Open(open)] = opens.as_slice() else { panic!("an OPEN: {out:?}") };
    assert_eq!(graceful_restart_capability(open), (true, vec![true, true]), "restarting: R=1, F=1 for both families");

    let out = replay.establish(conn, false);
    assert!(sent(&out, conn).is_empty(), "nothing advertised before the peer's End-of-RIB: {out:?}");
    let published = replay.instance.publish(replay.now);
    assert!(published.status.restarting && published.status.deferring && !published.status.routing_complete);

    // The peer re-sends one of the two routes; the other is gone, but not yet known to be.
    replay.received(conn, peer_update(&["172.16.5.0/24"]));
    let target = replay.instance.publish(replay.now).fib.expect("a learned route");
    assert!(!target.allow_deletes, "kernel routes found at start stay until the picture is complete");

    let out = replay.end_of_rib(conn);
    let messages = sent(&out, conn);
    assert_eq!(announced(&messages), vec![pod_cidr()], "the End-of-RIB releases our advertisement");
    assert_eq!(end_of_ribs(&messages), 2);
    let published = replay.instance.publish(replay.now);
    assert!(published.status.restarted && !published.status.restarting && published.status.routing_complete);
    let target = published.fib.expect("deletes are now allowed");
    assert!(target.allow_deletes);
    assert_eq!(target.routes.keys().collect::<Vec<_>>(), [&net("172.16.5.0/24")], "172.16.9.0/24 may go");
}

#[test]
fn restarting_speaker_stops_deferring_at_the_selection_deferral_timer() {
    let installed = RouteSet::from([(net("172.16.9.0/24"), kernel_route("192.0.2.2"))]);
    let (mut replay, actions) = Replay::start(true, installed);
    let (conn, _) = replay.connected(&actions);
    // Keepalives both ways until just before the deferral (80 s) ends: still deferring.
    let mut out = replay.establish(conn, false);
    for secs in [25, 50, 75] {
        out.extend(replay.advance_to(secs));
        out.extend(replay.received(conn, Message::Keepalive));
    }
    assert!(announced(&sent(&out, conn)).is_empty(), "still deferring: {out:?}");
    assert!(replay.instance.publish(replay.now).status.deferring);

    let out = replay.advance_to(80);
    assert_eq!(announced(&sent(&out, conn)), vec![pod_cidr()], "the deferral timer releases our advertisement");
    let published = replay.instance.publish(replay.now);
    assert!(!published.status.deferring && published.status.routing_complete);
    assert!(published.fib.expect("deletes allowed").allow_deletes);
    assert_eq!(replay.peer_state(), State::Established);
}

#[test]
fn helper_keeps_a_lost_peers_routes_stale_until_its_end_of_rib() {
    let (mut replay, actions) = Replay::start(false, RouteSet::new());
    let (conn, _) = replay.connected(&actions);
    replay.establish(conn, false);
    replay.end_of_rib(conn);
    replay.received(conn, peer_update(&["172.16.5.0/24", "172.16.9.0/24"]));
    replay.instance.publish(replay.now);

    // The connection drops (no NOTIFICATION): the peer is restarting, its routes stay.
    replay.advance_to(10);
    let out = replay.input(Input::Closed { peer: PEER, conn, error: Some("connection reset".into()) });
    assert!(out.contains(&Action::Close { conn }));
    let published = replay.instance.publish(replay.now);
    assert_eq!(published.fib, None, "stale routes stay in the kernel");
    assert_eq!(published.status.peers[0].prefixes_stale, 2);

    // It comes back with R=1 and F=1, re-sends one route and its End-of-RIB.
    let (conn, out) = replay.accepted();
    assert!(out.contains(&Action::Open { peer: PEER, conn }));
    replay.establish(conn, true);
    assert_eq!(replay.instance.publish(replay.now).status.peers[0].prefixes_stale, 2, "stale until End-of-RIB");
    replay.received(conn, peer_update(&["172.16.5.0/24"]));
    replay.end_of_rib(conn);
    let published = replay.instance.publish(replay.now);
    assert_eq!(published.status.peers[0].prefixes_stale, 0);
    let target = published.fib.expect("the route not re-sent is gone");
    assert_eq!(target.routes.keys().collect::<Vec<_>>(), [&net("172.16.5.0/24")]);
}

#[test]
fn helper_drops_stale_routes_when_the_peer_does_not_come_back_in_its_restart_time() {
    let (mut replay, actions) = Replay::start(false, RouteSet::new());
    let (conn, _) = replay.connected(&actions);
    replay.establish(conn, false);
    replay.end_of_rib(conn);
    replay.received(conn, peer_update(&["172.16.5.0/24"]));
    replay.instance.publish(replay.now);
    replay.input(Input::Closed { peer: PEER, conn, error: None });

    replay.advance_to(PEER_RESTART_TIME.as_secs() - 1);
    assert_eq!(replay.instance.publish(replay.now).fib, None, "kept within the peer's restart time");
    replay.advance_to(PEER_RESTART_TIME.as_secs());
    let target = replay.instance.publish(replay.now).fib.expect("the restart timer removed them");
    assert!(target.routes.is_empty());
}

#[test]
fn helper_drops_stale_routes_at_the_stale_path_timer_when_end_of_rib_never_comes() {
    let (mut replay, actions) = Replay::start(false, RouteSet::new());
    let (conn, _) = replay.connected(&actions);
    replay.establish(conn, false);
    replay.end_of_rib(conn);
    replay.received(conn, peer_update(&["172.16.5.0/24"]));
    replay.instance.publish(replay.now);
    replay.input(Input::Closed { peer: PEER, conn, error: None });

    replay.advance_to(5);
    let (conn, _) = replay.accepted();
    replay.establish(conn, true);
    // Stale path time 60 s from the session's return at 5 s.
    replay.advance_to(64);
    let published = replay.instance.publish(replay.now);
    assert_eq!((published.fib, published.status.peers[0].prefixes_stale), (None, 1));
    replay.advance_to(65);
    let published = replay.instance.publish(replay.now);
    assert_eq!(published.status.peers[0].prefixes_stale, 0);
    assert!(published.fib.expect("the stale path timer removed it").routes.is_empty());
}

#[test]
fn route_refresh_resends_our_adj_rib_out_without_end_of_rib() {
    let (mut replay, actions) = Replay::start(false, RouteSet::new());
    replay.input(Input::SetPrefixes(vec![
        (pod_cidr(), OriginKind::PodCidr),
        (prefix("10.96.0.10/32"), OriginKind::ServiceVip),
    ]));
    let (conn, _) = replay.connected(&actions);
    let initial = sent(&replay.establish(conn, false), conn);
    let out = replay.received(conn, Message::RouteRefresh(Family::Ipv4Unicast.afi(), Family::Ipv4Unicast.safi()));
    let refreshed = sent(&out, conn);
    assert_eq!(announced(&refreshed), vec![prefix("10.96.0.10/32"), pod_cidr()]);
    let without_eor: Vec<Message> = initial.into_iter().filter(|m| !matches!(m, Message::EndOfRib(..))).collect();
    assert_eq!(refreshed, without_eor, "the same UPDATEs as at session start, no End-of-RIB");
}

#[test]
fn a_peer_lost_before_its_end_of_rib_with_a_notification_completes_the_picture_at_once() {
    let installed = RouteSet::from([(net("172.16.9.0/24"), kernel_route("192.0.2.2"))]);
    let (mut replay, actions) = Replay::start(false, installed);
    let (conn, _) = replay.connected(&actions);
    replay.establish(conn, false);
    replay.received(conn, peer_update(&["172.16.5.0/24"]));
    let target = replay.instance.publish(replay.now).fib.expect("a learned route");
    assert!(!target.allow_deletes);

    // A Cease before End-of-RIB: its routes go, and its End-of-RIB is no longer waited for.
    let cease = Notification { code: 6, subcode: 2, data: vec![] };
    let out = replay.received(conn, Message::Notification(cease));
    assert!(out.contains(&Action::Close { conn }));
    let published = replay.instance.publish(replay.now);
    assert!(published.status.routing_complete, "no wait for the deferral timer");
    let target = published.fib.expect("the peer's routes are gone and deletes allowed");
    assert!(target.allow_deletes && target.routes.is_empty());
    assert_eq!(published.status.peers[0].notifications_received, 1);
}

#[test]
fn a_peer_lost_before_its_end_of_rib_by_tcp_is_still_waited_for() {
    let installed = RouteSet::from([(net("172.16.9.0/24"), kernel_route("192.0.2.2"))]);
    let (mut replay, actions) = Replay::start(false, installed);
    let (conn, _) = replay.connected(&actions);
    replay.establish(conn, false);
    replay.received(conn, peer_update(&["172.16.5.0/24"]));
    replay.instance.publish(replay.now);

    // The peer may be restarting: its routes stay stale and the picture waits for it.
    replay.input(Input::Closed { peer: PEER, conn, error: Some("connection reset".into()) });
    let published = replay.instance.publish(replay.now);
    assert!(!published.status.routing_complete && published.status.deferring);
    assert_eq!(published.status.peers[0].prefixes_stale, 1);
    // The restart timer (30 s) drops its routes; the deferral (80 s) completes the picture.
    replay.advance_to(79);
    assert!(!replay.instance.publish(replay.now).status.routing_complete);
    replay.advance_to(80);
    let published = replay.instance.publish(replay.now);
    assert!(published.status.routing_complete);
    let target = published.fib.expect("deletes allowed");
    assert!(target.allow_deletes && target.routes.is_empty());
}

#[test]
fn replays_are_deterministic() {
    let run = || {
        let (mut replay, actions) = Replay::start(false, RouteSet::new());
        let (conn, out) = replay.connected(&actions);
        let mut all = [actions, out, replay.establish(conn, false)].concat();
        all.extend(replay.advance_to(200));
        (all, replay.instance.publish(replay.now))
    };
    let (first, second) = (run(), run());
    assert_eq!(first.0, second.0);
    assert_eq!(first.1.status.peers[0].state, second.1.status.peers[0].state);
    // 200 s without a word from the peer: the hold timer (90 s) ended the session.
    assert!(first.0.iter().any(|a| matches!(a, Action::Send { message: Message::Notification(n), .. } if n.code == 4)));
}

#[test]
fn publishing_reuses_the_route_list_until_the_loc_rib_changes() {
    let config = SpeakerConfig::new(LOCAL_ASN, ROUTER_ID);
    let now = Instant::now();
    let mut instance = Instance::new(config, false, &RouteSet::new(), &[], now);
    let pod_cidr = pod_cidr();
    instance.handle(now, Input::SetPrefixes(vec![(pod_cidr, OriginKind::PodCidr)]));
    let first = instance.publish(now).status.loc_rib;
    assert_eq!(*first, vec![StatusRoute { prefix: pod_cidr, next_hop: "10.0.0.1".parse().unwrap(), from: None }]);
    // Nothing changed in the Loc-RIB: the same list, not a copy of it.
    assert!(Arc::ptr_eq(&first, &instance.publish(now).status.loc_rib), "an unchanged Loc-RIB was listed again");
    // The same prefixes again change nothing either.
    instance.handle(now, Input::SetPrefixes(vec![(pod_cidr, OriginKind::PodCidr)]));
    assert!(Arc::ptr_eq(&first, &instance.publish(now).status.loc_rib));
    // A new route: a new list, with it.
    let vip: Prefix = "10.96.0.10/32".parse().unwrap();
    instance.handle(now, Input::SetPrefixes(vec![(pod_cidr, OriginKind::PodCidr), (vip, OriginKind::ServiceVip)]));
    let published = instance.publish(now);
    assert!(!Arc::ptr_eq(&first, &published.status.loc_rib));
    assert_eq!(published.status.loc_rib.iter().map(|r| r.prefix).collect::<Vec<_>>(), vec![vip, pod_cidr]);
    assert_eq!(published.status.loc_rib_size, 2);
}

#[test]
fn advertisements_count_what_kube_router_counts_by_type() {
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
