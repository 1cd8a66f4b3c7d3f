//! RFC 4724 graceful restart, both roles, as small state machines driven by
//! session events and timer expiries. Timers are requested through
//! [`TimerCommand`]s; the driver reports expiry with `on_timer`.
//!
//! * [`GracefulRestartHelper`] (receiving speaker): keeps a restarting
//!   peer's routes as stale and cleans them up on End-of-RIB or timeout.
//! * [`RestartingSpeaker`]: after our own restart, defers the FIB cleanup
//!   until every GR peer has sent End-of-RIB (or the selection-deferral
//!   timer fires) and then reports which previously installed routes are
//!   really gone.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::Duration;

use super::fsm::{DownReason, Negotiated};
use super::message::{Family, Prefix};
use super::rib::{BestPathChange, Rib, RouteSource};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GrTimer {
    /// Peer's advertised Restart Time: how long to wait for it to come back.
    Restart(IpAddr),
    /// Upper bound on waiting for the peer's End-of-RIB after it is back.
    StalePath(IpAddr),
    /// Restarting speaker: upper bound on waiting for End-of-RIB markers.
    SelectionDeferral,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TimerCommand {
    Start(GrTimer, Duration),
    Stop(GrTimer),
}

/// Result of a helper event: Loc-RIB changes to push to the kernel and to
/// other peers, and timers to (re)arm.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GrOutput {
    pub rib_changes: Vec<BestPathChange>,
    pub timers: Vec<TimerCommand>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum HelperPhase {
    /// Session is down; stale routes of these families are retained.
    AwaitingSession { families: Vec<Family> },
    /// Session is back; waiting for End-of-RIB for these families.
    AwaitingEndOfRib { pending: Vec<Family> },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GracefulRestartHelper {
    stale_path_time: Duration,
    peers: BTreeMap<IpAddr, HelperPhase>,
}

impl GracefulRestartHelper {
    /// `stale_path_time`: how long to keep stale routes after the peer is
    /// back but has not sent End-of-RIB (e.g. 360 s as in FRR/GoBGP).
    pub fn new(stale_path_time: Duration) -> Self {
        Self { stale_path_time, peers: BTreeMap::new() }
    }

    /// Peers whose routes are currently retained as stale.
    pub fn is_helping(&self, peer: IpAddr) -> bool {
        self.peers.contains_key(&peer)
    }

    /// An Established session went down. `negotiated` is what that session
    /// had agreed (it carries the peer's GR capability). Without GR, or on an
    /// orderly NOTIFICATION, the peer's routes are removed right away.
    pub fn on_session_down(
        &mut self,
        rib: &mut Rib,
        peer: IpAddr,
        reason: &DownReason,
        negotiated: &Negotiated,
    ) -> GrOutput {
        let mut out = GrOutput::default();
        out.timers.push(TimerCommand::Stop(GrTimer::StalePath(peer)));
        let retained: Vec<Family> = match &negotiated.peer_graceful_restart {
            Some(gr) if reason.retains_routes_for_graceful_restart() && !gr.restart_time.is_zero() => {
                gr.families.iter().map(|(f, _)| *f).collect()
            }
            _ => Vec::new(),
        };
        let dropped: Vec<Family> = Family::ALL.into_iter().filter(|f| !retained.contains(f)).collect();
        out.rib_changes = rib.clear_peer_routes(peer, &dropped);
        if retained.is_empty() {
            self.peers.remove(&peer);
            out.timers.push(TimerCommand::Stop(GrTimer::Restart(peer)));
            return out;
        }
        // A second drop before End-of-RIB simply re-marks everything.
        rib.mark_stale(peer, &retained);
        let restart_time = negotiated.peer_graceful_restart.as_ref().map_or(Duration::ZERO, |gr| gr.restart_time);
        out.timers.push(TimerCommand::Start(GrTimer::Restart(peer), restart_time));
        self.peers.insert(peer, HelperPhase::AwaitingSession { families: retained });
        out
    }

    /// The peer re-established. Register the new session in the RIB
    /// (`Rib::upsert_peer`) before calling this. Families the new OPEN no
    /// longer covers with GR + F-bit lose their stale routes now.
    pub fn on_session_established(&mut self, rib: &mut Rib, peer: IpAddr, negotiated: &Negotiated) -> GrOutput {
        let mut out = GrOutput::default();
        let Some(HelperPhase::AwaitingSession { families }) = self.peers.get(&peer).cloned() else {
            return out;
        };
        out.timers.push(TimerCommand::Stop(GrTimer::Restart(peer)));
        let (keep, purge): (Vec<Family>, Vec<Family>) = families.into_iter().partition(|f| {
            negotiated.families.contains(f)
                && negotiated.peer_graceful_restart.as_ref().is_some_and(|gr| gr.forwarding_preserved(*f))
        });
        out.rib_changes = rib.purge_stale(peer, &purge);
        if keep.is_empty() {
            self.peers.remove(&peer);
        } else {
            out.timers.push(TimerCommand::Start(GrTimer::StalePath(peer), self.stale_path_time));
            self.peers.insert(peer, HelperPhase::AwaitingEndOfRib { pending: keep });
        }
        out
    }

    /// End-of-RIB from the peer: whatever is still stale in that family was
    /// not re-announced and is gone.
    pub fn on_end_of_rib(&mut self, rib: &mut Rib, peer: IpAddr, family: Family) -> GrOutput {
        let mut out = GrOutput::default();
        let Some(HelperPhase::AwaitingEndOfRib { pending }) = self.peers.get_mut(&peer) else {
            return out;
        };
        if !pending.contains(&family) {
            return out;
        }
        pending.retain(|f| *f != family);
        let done = pending.is_empty();
        out.rib_changes = rib.purge_stale(peer, &[family]);
        if done {
            self.peers.remove(&peer);
            out.timers.push(TimerCommand::Stop(GrTimer::StalePath(peer)));
        }
        out
    }

    pub fn on_timer(&mut self, rib: &mut Rib, timer: GrTimer) -> GrOutput {
        let mut out = GrOutput::default();
        let peer = match timer {
            GrTimer::Restart(p) | GrTimer::StalePath(p) => p,
            GrTimer::SelectionDeferral => return out,
        };
        let families = match (timer, self.peers.get(&peer)) {
            (GrTimer::Restart(_), Some(HelperPhase::AwaitingSession { families })) => families.clone(),
            (GrTimer::StalePath(_), Some(HelperPhase::AwaitingEndOfRib { pending })) => pending.clone(),
            _ => return out, // stale timer from an earlier phase
        };
        self.peers.remove(&peer);
        out.rib_changes = rib.purge_stale(peer, &families);
        out
    }
}

/// Outcome of the restarting-speaker deferral.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestartCompletion {
    /// Routes that were in the kernel before the restart and have no
    /// BGP-learned best path now: remove them from the FIB.
    pub gone_routes: Vec<Prefix>,
    /// Completed because the selection-deferral timer fired.
    pub timed_out: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RestartOutput {
    /// Set once: the driver should now remove `gone_routes` from the kernel,
    /// send each established peer `Rib::initial_advertisement` (which ends
    /// with End-of-RIB) and clear the sessions' `restarting` flag.
    pub completion: Option<RestartCompletion>,
    pub timers: Vec<TimerCommand>,
}

/// Restarting-speaker role (RFC 4724 §4.1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestartingSpeaker {
    previously_installed: BTreeSet<Prefix>,
    /// GR peers we wait for; `None` = session not yet up (families unknown).
    waiting: BTreeMap<IpAddr, Option<BTreeSet<Family>>>,
    complete: bool,
}

impl RestartingSpeaker {
    /// `previously_installed`: BGP routes found in the kernel at start-up.
    /// `gr_peers`: configured peers with graceful restart enabled.
    pub fn start(
        previously_installed: impl IntoIterator<Item = Prefix>,
        gr_peers: impl IntoIterator<Item = IpAddr>,
        selection_deferral: Duration,
        rib: &Rib,
    ) -> (Self, RestartOutput) {
        let mut speaker = Self {
            previously_installed: previously_installed.into_iter().collect(),
            waiting: gr_peers.into_iter().map(|p| (p, None)).collect(),
            complete: false,
        };
        let mut out = RestartOutput {
            completion: None,
            timers: vec![TimerCommand::Start(GrTimer::SelectionDeferral, selection_deferral)],
        };
        if let Some(done) = speaker.check(rib, false) {
            out = done;
        }
        (speaker, out)
    }

    /// Still holding back FIB cleanup and our initial advertisements.
    pub fn is_deferring(&self) -> bool {
        !self.complete
    }

    pub fn on_session_established(&mut self, rib: &Rib, peer: IpAddr, negotiated: &Negotiated) -> RestartOutput {
        if let Some(slot) = self.waiting.get_mut(&peer) {
            if negotiated.peer_graceful_restart.is_some() {
                *slot = Some(negotiated.families.iter().copied().collect());
            } else {
                // A peer without GR will not necessarily send End-of-RIB.
                self.waiting.remove(&peer);
            }
        }
        self.check(rib, false).unwrap_or_default()
    }

    pub fn on_end_of_rib(&mut self, rib: &Rib, peer: IpAddr, family: Family) -> RestartOutput {
        if let Some(Some(families)) = self.waiting.get_mut(&peer) {
            families.remove(&family);
            if families.is_empty() {
                self.waiting.remove(&peer);
            }
        }
        self.check(rib, false).unwrap_or_default()
    }

    pub fn on_deferral_timer_expired(&mut self, rib: &Rib) -> RestartOutput {
        self.waiting.clear();
        self.check(rib, true).unwrap_or_default()
    }

    /// A GR peer configured after start: wait for its End-of-RIB too, unless the initial
    /// picture is already complete.
    pub fn add_peer(&mut self, peer: IpAddr) {
        if !self.complete {
            self.waiting.entry(peer).or_insert(None);
        }
    }

    /// A peer's session went down without us keeping its routes (a NOTIFICATION, BFD): its
    /// End-of-RIB will not come on this session, so it is no longer waited for. Otherwise a
    /// peer lost right after start would hold back the removal of its routes until the
    /// deferral timer.
    pub fn on_session_lost(&mut self, rib: &Rib, peer: IpAddr) -> RestartOutput {
        self.remove_peer(rib, peer)
    }

    /// A peer removed from the configuration is no longer waited for.
    pub fn remove_peer(&mut self, rib: &Rib, peer: IpAddr) -> RestartOutput {
        self.waiting.remove(&peer);
        self.check(rib, false).unwrap_or_default()
    }

    fn check(&mut self, rib: &Rib, timed_out: bool) -> Option<RestartOutput> {
        if self.complete || !self.waiting.is_empty() {
            return None;
        }
        self.complete = true;
        // Needed only for this answer: a restart at 100,000 routes would otherwise keep them
        // for the agent's lifetime.
        let previously_installed = std::mem::take(&mut self.previously_installed);
        let gone_routes = previously_installed
            .into_iter()
            .filter(|p| !rib.best(p).is_some_and(|b| matches!(b.source, RouteSource::Peer(_))))
            .collect();
        let mut timers = Vec::new();
        if !timed_out {
            timers.push(TimerCommand::Stop(GrTimer::SelectionDeferral));
        }
        Some(RestartOutput { completion: Some(RestartCompletion { gone_routes, timed_out }), timers })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::bgp::fsm::{
        Event, GracefulRestartConfig, Output, PeerGracefulRestart, Session, SessionConfig, State,
    };
    use crate::routing::bgp::message::{AsPathSegment, Message, NextHop, Notification, PathAttributes, Update};
    use crate::routing::bgp::rib::{PeerInfo, RibConfig};
    use std::net::Ipv4Addr;

    const LOCAL_ASN: u32 = 64512;
    const PEER_ASN: u32 = 65000;

    fn peer_addr(n: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(192, 168, 0, n))
    }

    fn peer_info(n: u8) -> PeerInfo {
        PeerInfo {
            address: peer_addr(n),
            asn: PEER_ASN,
            router_id: Ipv4Addr::new(10, 0, 0, n),
            route_reflector_client: false,
            local_ipv4: Some(Ipv4Addr::new(192, 168, 0, 1)),
            local_ipv6: None,
            families: vec![Family::Ipv4Unicast, Family::Ipv6Unicast],
            role: crate::routing::bgp::policy::PeerRole::External,
            accept_default: false,
        }
    }

    fn negotiated(gr: Option<Vec<(Family, bool)>>) -> Negotiated {
        Negotiated {
            peer_asn: PEER_ASN,
            peer_router_id: Ipv4Addr::new(10, 0, 0, 2),
            hold_time: Duration::from_secs(90),
            keepalive_interval: Some(Duration::from_secs(30)),
            families: vec![Family::Ipv4Unicast, Family::Ipv6Unicast],
            four_octet_as: true,
            route_refresh: true,
            peer_graceful_restart: gr.map(|families| PeerGracefulRestart {
                restart_state: false,
                restart_time: Duration::from_secs(120),
                families,
            }),
            local_graceful_restart: true,
            ibgp: false,
        }
    }

    fn full_gr() -> Negotiated {
        negotiated(Some(vec![(Family::Ipv4Unicast, true), (Family::Ipv6Unicast, true)]))
    }

    fn pfx(s: &str) -> Prefix {
        s.parse().unwrap()
    }

    fn announce(rib: &mut Rib, n: u8, prefixes: &[&str]) {
        let attributes =
            PathAttributes { as_path: vec![AsPathSegment::Sequence(vec![PEER_ASN])], ..PathAttributes::default() };
        let announced = prefixes
            .iter()
            .map(|p| {
                let p = pfx(p);
                let nh = match p {
                    Prefix::V4 { .. } => NextHop::V4(Ipv4Addr::new(192, 168, 0, n)),
                    Prefix::V6 { .. } => NextHop::V6 { global: "fd00::2".parse().unwrap(), link_local: None },
                };
                (p, nh)
            })
            .collect();
        rib.apply_update(peer_addr(n), &Update { withdrawn: vec![], announced, attributes }).unwrap();
    }

    fn setup() -> (Rib, GracefulRestartHelper) {
        let mut rib = Rib::new(RibConfig::new(LOCAL_ASN, Ipv4Addr::new(10, 0, 0, 1)));
        rib.upsert_peer(peer_info(2));
        announce(&mut rib, 2, &["10.1.0.0/24", "10.2.0.0/24", "fd00:1::/64"]);
        (rib, GracefulRestartHelper::new(Duration::from_secs(360)))
    }

    fn removed(out: &GrOutput) -> Vec<Prefix> {
        out.rib_changes.iter().filter(|c| matches!(c, BestPathChange::Removed { .. })).map(|c| c.prefix()).collect()
    }

    #[test]
    fn drop_stale_reestablish_eor_purges_unrefreshed() {
        let (mut rib, mut helper) = setup();
        let p = peer_addr(2);
        let out = helper.on_session_down(&mut rib, p, &DownReason::TcpConnectionFailed, &full_gr());
        assert!(out.rib_changes.is_empty(), "routes stay in Loc-RIB/kernel");
        assert!(out.timers.contains(&TimerCommand::Start(GrTimer::Restart(p), Duration::from_secs(120))));
        assert_eq!(rib.stale_count(p), 3);
        assert!(helper.is_helping(p));

        rib.upsert_peer(peer_info(2));
        let out = helper.on_session_established(&mut rib, p, &full_gr());
        assert!(out.timers.contains(&TimerCommand::Stop(GrTimer::Restart(p))));
        assert!(out.timers.contains(&TimerCommand::Start(GrTimer::StalePath(p), Duration::from_secs(360))));

        announce(&mut rib, 2, &["10.1.0.0/24"]);
        assert_eq!(rib.stale_count(p), 2);
        let out = helper.on_end_of_rib(&mut rib, p, Family::Ipv4Unicast);
        assert_eq!(removed(&out), vec![pfx("10.2.0.0/24")]);
        assert!(helper.is_helping(p), "still waiting for IPv6 EoR");
        let out = helper.on_end_of_rib(&mut rib, p, Family::Ipv6Unicast);
        assert_eq!(removed(&out), vec![pfx("fd00:1::/64")]);
        assert!(out.timers.contains(&TimerCommand::Stop(GrTimer::StalePath(p))));
        assert!(!helper.is_helping(p));
        assert_eq!(rib.loc_rib().len(), 1);
        assert_eq!(rib.stale_count(p), 0);
    }

    #[test]
    fn restart_timer_expiry_purges_everything() {
        let (mut rib, mut helper) = setup();
        let p = peer_addr(2);
        helper.on_session_down(&mut rib, p, &DownReason::HoldTimerExpired, &full_gr());
        let out = helper.on_timer(&mut rib, GrTimer::Restart(p));
        assert_eq!(removed(&out).len(), 3);
        assert!(rib.loc_rib().is_empty());
        assert!(!helper.is_helping(p));
        // A late stale-path timer is harmless.
        assert_eq!(helper.on_timer(&mut rib, GrTimer::StalePath(p)), GrOutput::default());
    }

    #[test]
    fn reestablished_without_gr_purges_stale() {
        let (mut rib, mut helper) = setup();
        let p = peer_addr(2);
        helper.on_session_down(&mut rib, p, &DownReason::TcpConnectionFailed, &full_gr());
        let out = helper.on_session_established(&mut rib, p, &negotiated(None));
        assert_eq!(removed(&out).len(), 3);
        assert!(!helper.is_helping(p));
    }

    #[test]
    fn f_bit_zero_purges_only_that_family() {
        let (mut rib, mut helper) = setup();
        let p = peer_addr(2);
        helper.on_session_down(&mut rib, p, &DownReason::TcpConnectionFailed, &full_gr());
        let new = negotiated(Some(vec![(Family::Ipv4Unicast, true), (Family::Ipv6Unicast, false)]));
        let out = helper.on_session_established(&mut rib, p, &new);
        assert_eq!(removed(&out), vec![pfx("fd00:1::/64")]);
        assert_eq!(rib.stale_count(p), 2);
        // Stale-path timer fires before the IPv4 EoR.
        let out = helper.on_timer(&mut rib, GrTimer::StalePath(p));
        assert_eq!(removed(&out).len(), 2);
    }

    #[test]
    fn families_without_gr_and_orderly_shutdown_are_removed_at_once() {
        let (mut rib, mut helper) = setup();
        let p = peer_addr(2);
        // GR only for IPv4: IPv6 routes go immediately.
        let out = helper.on_session_down(
            &mut rib,
            p,
            &DownReason::TcpConnectionFailed,
            &negotiated(Some(vec![(Family::Ipv4Unicast, true)])),
        );
        assert_eq!(removed(&out), vec![pfx("fd00:1::/64")]);

        let (mut rib, mut helper) = setup();
        let reason = DownReason::NotificationReceived(Notification::cease(2));
        let out = helper.on_session_down(&mut rib, p, &reason, &full_gr());
        assert_eq!(removed(&out).len(), 3);
        assert!(!helper.is_helping(p));
    }

    /// Drive a real FSM session to Established with a given peer OPEN.
    fn establish(session: Session, peer_open: crate::routing::bgp::message::Open) -> (Session, Vec<Output>) {
        let mut all = Vec::new();
        let mut s = session;
        for e in [
            Event::ManualStart,
            Event::TcpConnectionAcknowledged,
            Event::MessageReceived(Message::Open(peer_open)),
            Event::MessageReceived(Message::Keepalive),
        ] {
            let (n, out) = s.step(e);
            s = n;
            all.extend(out);
        }
        (s, all)
    }

    #[test]
    fn fsm_tcp_drop_feeds_helper_with_negotiated_capability() {
        let cfg = SessionConfig::new(LOCAL_ASN, PEER_ASN, Ipv4Addr::new(10, 0, 0, 1));
        let mut peer_cfg = SessionConfig::new(PEER_ASN, LOCAL_ASN, Ipv4Addr::new(10, 0, 0, 2));
        peer_cfg.graceful_restart = Some(GracefulRestartConfig { restart_time_secs: 90, restarting: false });
        let (s, _) = establish(Session::new(cfg), Session::new(peer_cfg).local_open());
        let (_, out) = s.step(Event::TcpConnectionFails);
        let Some((reason, negotiated)) = out.into_iter().find_map(|o| match o {
            Output::SessionDown { reason, negotiated } => Some((reason, negotiated)),
            _ => None,
        }) else {
            panic!("no SessionDown")
        };
        let (mut rib, mut helper) = setup();
        let out = helper.on_session_down(&mut rib, peer_addr(2), &reason, &negotiated);
        assert!(out.rib_changes.is_empty());
        assert!(out.timers.contains(&TimerCommand::Start(GrTimer::Restart(peer_addr(2)), Duration::from_secs(90))));
        assert_eq!(rib.stale_count(peer_addr(2)), 3);
    }

    #[test]
    fn restarting_speaker_defers_until_all_end_of_rib() {
        // Our sessions advertise R=1/F=1 while restarting.
        let mut cfg = SessionConfig::new(LOCAL_ASN, PEER_ASN, Ipv4Addr::new(10, 0, 0, 1));
        cfg.graceful_restart = Some(GracefulRestartConfig { restart_time_secs: 120, restarting: true });
        let session = Session::new(cfg);
        let our_open = session.local_open();
        let gr = our_open.graceful_restart().unwrap();
        assert!(gr.restart_state && gr.families.iter().all(|f| f.forwarding_preserved));

        // The peer answers with its own GR capability (R=0).
        let mut peer_open = our_open.clone();
        peer_open.my_asn = PEER_ASN;
        peer_open.router_id = Ipv4Addr::new(10, 0, 0, 2);
        let (s, out) = establish(session, peer_open);
        assert_eq!(s.state(), State::Established);
        let Some(Output::SessionEstablished(neg)) = out.last().cloned() else { panic!() };
        assert!(neg.peer_graceful_restart.is_some());

        let mut rib = Rib::new(RibConfig::new(LOCAL_ASN, Ipv4Addr::new(10, 0, 0, 1)));
        rib.upsert_peer(peer_info(2));
        rib.upsert_peer(peer_info(3));
        let installed = [pfx("10.1.0.0/24"), pfx("10.2.0.0/24"), pfx("10.3.0.0/24")];
        let (mut speaker, out) =
            RestartingSpeaker::start(installed, [peer_addr(2), peer_addr(3)], Duration::from_secs(360), &rib);
        assert!(out.timers.contains(&TimerCommand::Start(GrTimer::SelectionDeferral, Duration::from_secs(360))));
        assert!(speaker.is_deferring());

        assert_eq!(speaker.on_session_established(&rib, peer_addr(2), &neg).completion, None);
        assert_eq!(speaker.on_session_established(&rib, peer_addr(3), &neg).completion, None);
        announce(&mut rib, 2, &["10.1.0.0/24"]);
        announce(&mut rib, 3, &["10.3.0.0/24"]);
        for f in Family::ALL {
            assert_eq!(speaker.on_end_of_rib(&rib, peer_addr(2), f).completion, None);
        }
        assert_eq!(speaker.on_end_of_rib(&rib, peer_addr(3), Family::Ipv4Unicast).completion, None);
        let out = speaker.on_end_of_rib(&rib, peer_addr(3), Family::Ipv6Unicast);
        assert_eq!(out.completion, Some(RestartCompletion { gone_routes: vec![pfx("10.2.0.0/24")], timed_out: false }));
        assert!(out.timers.contains(&TimerCommand::Stop(GrTimer::SelectionDeferral)));
        assert!(!speaker.is_deferring());
        // Completion is reported only once.
        assert_eq!(speaker.on_deferral_timer_expired(&rib).completion, None);

        // Then our initial advertisement ends with End-of-RIB per family,
        // and later sessions stop claiming R=1.
        let msgs = rib.initial_advertisement(peer_addr(2));
        assert_eq!(msgs.last(), Some(&Message::end_of_rib(Family::Ipv6Unicast)));
        let mut s = s;
        s.set_restarting(false);
        assert!(!s.local_open().graceful_restart().unwrap().restart_state);
    }

    #[test]
    fn restarting_speaker_deferral_timer_and_non_gr_peers() {
        let mut rib = Rib::new(RibConfig::new(LOCAL_ASN, Ipv4Addr::new(10, 0, 0, 1)));
        rib.upsert_peer(peer_info(2));
        let installed = [pfx("10.1.0.0/24"), pfx("10.2.0.0/24")];
        let (mut speaker, _) =
            RestartingSpeaker::start(installed, [peer_addr(2), peer_addr(3)], Duration::from_secs(1), &rib);
        // Peer 3 comes back without GR: no longer waited for.
        assert_eq!(speaker.on_session_established(&rib, peer_addr(3), &negotiated(None)).completion, None);
        announce(&mut rib, 2, &["10.2.0.0/24"]);
        // Peer 2 never sends EoR: the timer ends the deferral.
        let out = speaker.on_deferral_timer_expired(&rib);
        assert_eq!(out.completion, Some(RestartCompletion { gone_routes: vec![pfx("10.1.0.0/24")], timed_out: true }));

        // No GR peers at all: complete immediately.
        let (speaker, out) = RestartingSpeaker::start([pfx("10.9.0.0/24")], [], Duration::from_secs(1), &rib);
        assert!(!speaker.is_deferring());
        assert_eq!(out.completion.unwrap().gone_routes, vec![pfx("10.9.0.0/24")]);
    }

    #[test]
    fn peers_added_late_are_waited_for_and_removed_ones_release_the_wait() {
        let rib = Rib::new(RibConfig::new(LOCAL_ASN, Ipv4Addr::new(10, 0, 0, 1)));
        let (mut speaker, out) = RestartingSpeaker::start(Vec::new(), [peer_addr(2)], Duration::from_secs(60), &rib);
        assert!(out.completion.is_none());
        speaker.add_peer(peer_addr(3));
        assert!(speaker.remove_peer(&rib, peer_addr(2)).completion.is_none(), "still waiting for peer 3");
        assert!(speaker.remove_peer(&rib, peer_addr(3)).completion.is_some());
        speaker.add_peer(peer_addr(4));
        assert!(!speaker.is_deferring(), "a completed picture is not reopened");
    }

    #[test]
    fn a_peer_lost_before_its_end_of_rib_is_no_longer_waited_for() {
        let rib = Rib::new(RibConfig::new(LOCAL_ASN, Ipv4Addr::new(10, 0, 0, 1)));
        let (mut speaker, _) = RestartingSpeaker::start(Vec::new(), [peer_addr(2)], Duration::from_secs(360), &rib);
        let neg = negotiated(Some(vec![(Family::Ipv4Unicast, true)]));
        assert!(speaker.on_session_established(&rib, peer_addr(2), &neg).completion.is_none());
        // BFD takes the session down before End-of-RIB: its routes are gone, nothing to wait for.
        let out = speaker.on_session_lost(&rib, peer_addr(2));
        assert_eq!(out.completion, Some(RestartCompletion { gone_routes: vec![], timed_out: false }));
        assert!(!speaker.is_deferring());
    }
}
