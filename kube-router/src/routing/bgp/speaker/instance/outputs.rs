//! The session FSM's and graceful restart's answers applied: messages and timers, Loc-RIB
//! changes pushed to peers, the advertisement and FIB-deletion gates.
use std::net::{IpAddr, SocketAddr};

use tracing::{debug, info, warn};

use super::{canonical, Action, ConnId, Connection, Instance};
use crate::routing::bgp::{
    fsm::{Direction, DownReason, Event, GracefulRestartConfig, Negotiated, Output, SessionConfig, State},
    graceful_restart::{RestartOutput, TimerCommand},
    message::{Family, Message, Prefix, Update},
    peers::{PeerConfig, PeerKind},
    policy::PeerRole,
    rib::{BestPathChange, PeerInfo},
};

impl Instance {
    pub(super) fn current(&self, peer: IpAddr, conn: ConnId) -> bool {
        self.peers.get(&peer).and_then(|p| p.connection.as_ref()).is_some_and(|c| c.id == conn)
    }

    pub(super) fn attach(&mut self, peer: IpAddr, conn: ConnId, local: Option<SocketAddr>, direction: Direction) {
        if let Some(p) = self.peers.get_mut(&peer) {
            p.connection = Some(Connection { id: conn, direction, local });
            self.actions.push(Action::Open { peer, conn });
        }
    }

    pub(super) fn step(&mut self, peer: IpAddr, event: Event) {
        self.step_filtered(peer, event, |_| true);
    }

    pub(super) fn step_filtered(&mut self, peer: IpAddr, event: Event, keep: impl Fn(&Output) -> bool) {
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

    pub(super) fn output(&mut self, peer: IpAddr, output: Output) {
        match output {
            Output::Connect => {
                let conn = ConnId::Dialed(self.next_dial);
                self.next_dial += 1;
                let Some(p) = self.peers.get_mut(&peer) else { return };
                if p.config.passive {
                    return;
                }
                p.pending_connect = Some(conn);
                self.actions.push(Action::Connect { conn, peer: Box::new(p.config.clone()) });
            }
            Output::CloseConnection => {
                if let Some(p) = self.peers.get_mut(&peer) {
                    p.pending_connect = None;
                    if let Some(c) = p.connection.take() {
                        self.actions.push(Action::Close { conn: c.id });
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
                        self.actions.push(Action::Send { conn: c.id, message });
                    }
                }
            }
            Output::StartTimer(kind, after) => {
                if let Some(p) = self.peers.get_mut(&peer) {
                    p.timers.insert(kind, self.now + after);
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

    pub(super) fn apply_update(&mut self, peer: IpAddr, update: Update) {
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
    pub(super) fn max_prefixes_exceeded(&mut self, peer: IpAddr, family: Family, count: usize, limit: u32) {
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
    pub(super) fn count_unresolved(&mut self) {
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
    pub(super) fn log_new_rejections(&mut self) {
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

    pub(super) fn established_peers(&self) -> Vec<IpAddr> {
        self.peers.iter().filter(|(_, p)| p.state() == State::Established).map(|(a, _)| *a).collect()
    }

    /// The export policy changed: every established peer gets what it should have now.
    pub(super) fn resync_all_peers(&mut self) {
        if !self.advertising() {
            return;
        }
        for peer in self.established_peers() {
            let updates = self.rib.sync_adj_rib_out(peer, None);
            self.send_all(peer, updates.into_iter().map(Message::Update).collect());
        }
    }

    pub(super) fn advertising(&self) -> bool {
        !(self.restarting && self.restart.is_deferring())
    }

    pub(super) fn send_all(&mut self, peer: IpAddr, messages: Vec<Message>) {
        if let Some(c) = self.peers.get(&peer).and_then(|p| p.connection.as_ref()) {
            let conn = c.id;
            self.actions.extend(messages.into_iter().map(|message| Action::Send { conn, message }));
        }
    }

    pub(super) fn established(&mut self, peer: IpAddr, negotiated: Negotiated) {
        let Some(p) = self.peers.get_mut(&peer) else { return };
        p.established_at = Some(self.now);
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
        if self.config.graceful_restart.is_some() {
            self.actions.push(Action::MarkRestartable);
        }
    }

    pub(super) fn down(&mut self, peer: IpAddr, reason: DownReason, negotiated: Negotiated) {
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

    pub(super) fn fib_gate_output(&mut self, out: RestartOutput) {
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

    pub(super) fn restart_output(&mut self, out: RestartOutput) {
        self.gr_timers_apply(out.timers);
        let Some(completion) = out.completion else { return };
        if self.restarting {
            info!(timed_out = completion.timed_out, "graceful restart: peers' End-of-RIB received, advertising");
        }
        let was_deferring = self.restarting;
        self.restarting = false;
        let established = self.established_peers();
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

    pub(super) fn gr_timers_apply(&mut self, commands: Vec<TimerCommand>) {
        for command in commands {
            match command {
                TimerCommand::Start(timer, after) => {
                    self.gr_timers.insert(timer, self.now + after);
                }
                TimerCommand::Stop(timer) => {
                    self.gr_timers.remove(&timer);
                }
            }
        }
    }

    /// Pushes Loc-RIB changes to established peers and marks the FIB for an update.
    pub(super) fn rib_changed(&mut self, changes: Vec<BestPathChange>) {
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
        for peer in self.established_peers() {
            let updates = self.rib.sync_adj_rib_out(peer, Some(&prefixes));
            self.send_all(peer, updates.into_iter().map(Message::Update).collect());
        }
    }

    pub(super) fn session_config(&self, peer: &PeerConfig) -> SessionConfig {
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

    /// Adds a peer to those whose End-of-RIB the first complete routing picture waits for.
    pub(super) fn restart_wait_for(&mut self, peer: IpAddr) {
        self.restart.add_peer(peer);
        self.fib_gate.add_peer(peer);
    }
}
