//! One function per input event: what a connection, a message, a timer or a configuration
//! change does to the sessions, the RIB and graceful restart.
use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
};

use tracing::{debug, info, warn};

use super::{Action, ConnId, Instance, Peer};
use crate::{
    routing::bgp::{
        bfd_io::{BfdEvent, BfdPeer},
        codec::DecodeOutcome,
        fsm::{resolve_collision, Direction, Event, Output, Session, State, TimerKind},
        graceful_restart::GrTimer,
        message::{Family, Message, NextHop, Origin, PathAttributes, Prefix},
        peers::PeerConfig,
        policy::OriginKind,
        speaker::{Originated, Policies},
    },
    routing::fib::resolve::Reachability,
};

impl Instance {
    pub(super) fn fire_timers(&mut self) {
        let now = self.now;
        self.recount_unresolved_when_due();
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

    pub(super) fn connected(&mut self, peer: IpAddr, conn: ConnId, local: Option<SocketAddr>) {
        let Some(p) = self.peers.get_mut(&peer) else { return };
        if p.pending_connect != Some(conn) || p.connection.is_some() {
            return; // superseded (an inbound connection won, or the attempt was abandoned)
        }
        p.pending_connect = None;
        self.attach(peer, conn, local, Direction::Outbound);
        self.step(peer, Event::TcpConnectionAcknowledged);
    }

    pub(super) fn connect_failed(&mut self, peer: IpAddr, conn: ConnId, error: String) {
        let Some(p) = self.peers.get_mut(&peer) else { return };
        if p.pending_connect != Some(conn) {
            return;
        }
        p.pending_connect = None;
        debug!(%peer, %error, "BGP connect failed");
        p.last_error = Some(error);
        self.step(peer, Event::TcpConnectionFails);
    }

    pub(super) fn received(&mut self, peer: IpAddr, conn: ConnId, outcome: DecodeOutcome) {
        if !self.current(peer, conn) {
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

    pub(super) fn closed(&mut self, peer: IpAddr, conn: ConnId, error: Option<String>) {
        if !self.current(peer, conn) {
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

    pub(super) fn set_policies(&mut self, policies: Policies) {
        let changes = self.rib.set_import_policy(policies.import);
        self.rib_changed(changes);
        if self.rib.set_export_policy(policies.export) {
            self.resync_all_peers();
        }
    }

    pub(super) fn kernel_view(&mut self, reach: Reachability) {
        let changes = self.rib.set_reachability(reach);
        if !changes.is_empty() {
            debug!(changes = changes.len(), "kernel routes or addresses changed: next hops re-resolved");
        }
        self.rib_changed(changes);
        self.fib_dirty = true;
    }

    pub(super) fn accepted(&mut self, remote: IpAddr, conn: ConnId, local: Option<SocketAddr>) {
        let Some(p) = self.peers.get_mut(&remote) else {
            debug!(%remote, "BGP connection from an unconfigured address refused");
            return;
        };
        if p.session.as_ref().is_some_and(Session::in_idle_hold) {
            debug!(peer = %remote, "connection refused: the peer is held down after exceeding its prefix limit");
            return;
        }
        match p.state() {
            State::Established => {
                debug!(peer = %remote, "second connection while Established; refused");
            }
            State::Idle | State::Connect | State::Active => {
                p.pending_connect = None;
                if let Some(old) = p.connection.take() {
                    self.actions.push(Action::Abort { conn: old.id });
                }
                let was_idle = p.state() == State::Idle;
                self.attach(remote, conn, local, Direction::Inbound);
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
                self.attach(remote, conn, local, Direction::Inbound);
                self.step_filtered(remote, Event::ManualStart, |o| !matches!(o, Output::Connect));
                self.step(remote, Event::TcpConnectionConfirmed);
            }
        }
    }

    pub(super) fn set_peers(&mut self, peers: Vec<PeerConfig>) {
        let wanted: BTreeMap<IpAddr, PeerConfig> = peers.into_iter().map(|p| (p.address, p)).collect();
        let gone: Vec<IpAddr> =
            self.peers.iter().filter(|(addr, p)| wanted.get(*addr) != Some(&p.config)).map(|(addr, _)| *addr).collect();
        for addr in gone {
            info!(peer = %addr, "BGP peer removed from the configuration");
            self.step(addr, Event::ManualStop);
            if let Some(p) = self.peers.remove(&addr) {
                if let Some(c) = p.connection {
                    self.actions.push(Action::Close { conn: c.id });
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
            if config.password.is_some() {
                self.actions.push(Action::ListenerMd5(Box::new(config.clone())));
            }
            let session = Session::new(self.session_config(&config));
            self.peers.insert(addr, Peer::new(config, session));
            self.restart_wait_for(addr);
            self.step(addr, Event::ManualStart);
        }
        let watched: Vec<BfdPeer> = self
            .peers
            .values()
            .filter_map(|p| p.config.bfd.map(|config| BfdPeer { address: p.config.address, config }))
            .collect();
        self.actions.push(Action::WatchBfd(watched));
    }

    pub(super) fn bfd_event(&mut self, event: BfdEvent) {
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

    pub(super) fn set_prefixes(&mut self, prefixes: Vec<Originated>) {
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

    pub(super) fn shutdown(&mut self, graceful: bool) {
        info!(graceful, "BGP speaker stopping; kernel routes stay");
        let addrs: Vec<IpAddr> = self.peers.keys().copied().collect();
        for addr in addrs {
            self.step(addr, Event::AgentShutdown { graceful_restart: graceful });
        }
    }
}
