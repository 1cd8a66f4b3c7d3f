//! RFC 4271 §8 session finite state machine as a pure transition function.
//!
//! `Session::step(self, event) -> (Session, Vec<Output>)`. The driver owns
//! the socket and the timer wheel: it turns `Output`s into actions and timer
//! expiries / socket events back into `Event`s. Timers are relative
//! `Duration`s, so the FSM needs no clock.
//!
//! Simplifications vs. RFC 4271 §8: no DelayOpen, no peer-oscillation
//! damping beyond the capped exponential connect-retry backoff, no separate
//! AutomaticStart events (after an error we schedule the ConnectRetry timer
//! in Idle and its expiry restarts the session while administratively up).
//! Second-connection tracking / collision handling is done by the driver
//! with [`resolve_collision`] and [`Event::CollisionLost`].

use std::net::Ipv4Addr;
use std::time::Duration;

use super::codec::DecodeOutcome;
use super::message::{
    cease_subcode, fsm_subcode, open_subcode, Afi, Capability, Family, GracefulRestartCapability,
    GracefulRestartFamily, Message, Notification, Open, Safi, Update, BGP_VERSION, MAX_RESTART_TIME_SECS,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Idle,
    Connect,
    Active,
    OpenSent,
    OpenConfirm,
    Established,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TimerKind {
    ConnectRetry,
    Hold,
    Keepalive,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectRetryBackoff {
    pub initial: Duration,
    pub max: Duration,
}

impl ConnectRetryBackoff {
    /// initial * 2^failures, capped at `max`.
    pub fn delay(&self, failures: u32) -> Duration {
        let factor = 1u32.checked_shl(failures.min(31)).unwrap_or(u32::MAX);
        self.initial.saturating_mul(factor).min(self.max)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GracefulRestartConfig {
    /// Restart time we advertise (how long peers should keep our routes).
    pub restart_time_secs: u16,
    /// We are coming back from a restart with forwarding state preserved:
    /// advertise R=1 and F=1. Clear it once the restart is complete.
    pub restarting: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionConfig {
    pub local_asn: u32,
    pub peer_asn: u32,
    pub router_id: Ipv4Addr,
    /// Proposed hold time (seconds); 0 disables keepalives, 1-2 are invalid
    /// and are raised to 3.
    pub hold_time_secs: u16,
    pub connect_retry: ConnectRetryBackoff,
    /// Only accept connections, never initiate them.
    pub passive: bool,
    pub families: Vec<Family>,
    pub graceful_restart: Option<GracefulRestartConfig>,
    /// How long the session stays down after the peer exceeded its prefix limit (doubled on
    /// each further violation, capped at `max`): a peer that keeps sending too much is not
    /// re-accepted in a tight loop.
    pub max_prefix_idle_hold: ConnectRetryBackoff,
}

impl SessionConfig {
    pub fn new(local_asn: u32, peer_asn: u32, router_id: Ipv4Addr) -> Self {
        Self {
            local_asn,
            peer_asn,
            router_id,
            hold_time_secs: 90,
            connect_retry: ConnectRetryBackoff { initial: Duration::from_secs(5), max: Duration::from_secs(120) },
            passive: false,
            families: vec![Family::Ipv4Unicast, Family::Ipv6Unicast],
            graceful_restart: None,
            max_prefix_idle_hold: MAX_PREFIX_IDLE_HOLD,
        }
    }
    pub fn is_ibgp(&self) -> bool {
        self.local_asn == self.peer_asn
    }
}

/// What the peer's GR capability told us (RFC 4724).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerGracefulRestart {
    pub restart_state: bool,
    pub restart_time: Duration,
    /// Families with the peer's F-bit; only families also negotiated.
    pub families: Vec<(Family, bool)>,
}

impl PeerGracefulRestart {
    pub fn forwarding_preserved(&self, family: Family) -> bool {
        self.families.iter().any(|(f, fb)| *f == family && *fb)
    }
}

/// Parameters agreed when the session reached Established.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Negotiated {
    pub peer_asn: u32,
    pub peer_router_id: Ipv4Addr,
    /// Zero means no hold timer and no keepalives.
    pub hold_time: Duration,
    pub keepalive_interval: Option<Duration>,
    /// Families both sides support.
    pub families: Vec<Family>,
    pub four_octet_as: bool,
    pub route_refresh: bool,
    pub peer_graceful_restart: Option<PeerGracefulRestart>,
    /// We advertised GR on this session.
    pub local_graceful_restart: bool,
    pub ibgp: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DownReason {
    ManualStop,
    AgentShutdown {
        graceful_restart: bool,
    },
    HoldTimerExpired,
    TcpConnectionFailed,
    NotificationReceived(Notification),
    NotificationSent(Notification),
    /// BFD saw the forwarding path die (RFC 5882 §4.2): the session goes down at once. Its
    /// routes are not kept for graceful restart: BFD's point is to stop forwarding into a dead
    /// link now, not after the restart time.
    BfdDown,
    /// The peer sent more prefixes of `family` than `limit` (RFC 4486 Cease 1 sent). Its
    /// routes are dropped, never retained for graceful restart: they are the problem.
    MaxPrefixesExceeded {
        family: Family,
        limit: u32,
    },
}

impl DownReason {
    /// The peer vanished without an orderly NOTIFICATION exchange, which is
    /// when RFC 4724 helpers retain its routes as stale.
    pub fn retains_routes_for_graceful_restart(&self) -> bool {
        matches!(self, DownReason::HoldTimerExpired | DownReason::TcpConnectionFailed)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    ManualStart,
    ManualStop,
    /// The agent itself is stopping. With `graceful_restart` (and GR
    /// configured) no Cease is sent, so peers keep our routes as stale.
    AgentShutdown {
        graceful_restart: bool,
    },
    ConnectRetryTimerExpires,
    HoldTimerExpires,
    KeepaliveTimerExpires,
    /// Inbound connection accepted (RFC event 17).
    TcpConnectionConfirmed,
    /// Our outbound connection completed (RFC event 16).
    TcpConnectionAcknowledged,
    TcpConnectionFails,
    MessageReceived(Message),
    /// The codec wants this NOTIFICATION sent and the session torn down.
    DecodeError(Notification),
    /// Collision resolution decided this connection must go (Cease 6/7).
    CollisionLost,
    /// The BFD session with the peer went from Up to Down.
    BfdDown,
    /// An UPDATE would take the peer's prefixes of `family` past `limit` (the driver checks
    /// with [`crate::routing::bgp::rib::Rib::prefix_limit_exceeded`] before applying it).
    MaxPrefixesExceeded {
        family: Family,
        limit: u32,
    },
}

impl From<DecodeOutcome> for Event {
    fn from(outcome: DecodeOutcome) -> Self {
        match outcome {
            DecodeOutcome::Message(m) => Event::MessageReceived(m),
            DecodeOutcome::TreatAsWithdraw { withdrawn, .. } => {
                Event::MessageReceived(Message::Update(Update { withdrawn, ..Update::default() }))
            }
            DecodeOutcome::PartlyIgnored { update, .. } => Event::MessageReceived(Message::Update(update)),
            DecodeOutcome::Notify(n) => Event::DecodeError(n),
            DecodeOutcome::ConnectionError(_) => Event::TcpConnectionFails,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    /// Initiate an outbound TCP connection.
    Connect,
    CloseConnection,
    SendMessage(Message),
    StartTimer(TimerKind, Duration),
    StopTimer(TimerKind),
    SessionEstablished(Negotiated),
    /// Emitted only when leaving Established; carries what that session had
    /// negotiated (the GR helper needs the peer's capability).
    SessionDown {
        reason: DownReason,
        negotiated: Negotiated,
    },
    RoutesReceived(Update),
    EndOfRibReceived(Afi, Safi),
    RouteRefreshRequested(Afi, Safi),
}

/// Idle hold after a prefix-limit violation: 30 s, then 1, 2, 4 ... minutes up to 15.
pub const MAX_PREFIX_IDLE_HOLD: ConnectRetryBackoff =
    ConnectRetryBackoff { initial: Duration::from_secs(30), max: Duration::from_secs(15 * 60) };

/// Hold time used while waiting for the peer's OPEN (RFC 4271 §8: "large").
const OPEN_HOLD_TIME: Duration = Duration::from_secs(240);

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    pub config: SessionConfig,
    state: State,
    /// RFC 4271 ConnectRetryCounter; drives the backoff.
    connect_retry_counter: u32,
    /// ManualStart seen and no ManualStop since: Idle auto-restarts.
    admin_up: bool,
    negotiated: Option<Negotiated>,
    /// Prefix-limit violations since the peer was configured; drives the idle hold (never
    /// reset, so a peer that keeps doing it settles at the longest hold).
    max_prefix_violations: u32,
    /// In Idle after a prefix-limit violation, until the ConnectRetry timer fires: the driver
    /// refuses the peer's connections meanwhile.
    idle_hold: bool,
}

impl Session {
    pub fn new(config: SessionConfig) -> Self {
        Self {
            config,
            state: State::Idle,
            connect_retry_counter: 0,
            admin_up: false,
            negotiated: None,
            max_prefix_violations: 0,
            idle_hold: false,
        }
    }
    /// Held down after a prefix-limit violation: no connection is accepted or made.
    pub fn in_idle_hold(&self) -> bool {
        self.state == State::Idle && self.idle_hold
    }
    pub fn max_prefix_violations(&self) -> u32 {
        self.max_prefix_violations
    }
    pub fn state(&self) -> State {
        self.state
    }
    /// Available from OpenConfirm on.
    pub fn negotiated(&self) -> Option<&Negotiated> {
        self.negotiated.as_ref()
    }
    pub fn connect_retry_counter(&self) -> u32 {
        self.connect_retry_counter
    }
    pub fn set_restarting(&mut self, restarting: bool) {
        if let Some(gr) = &mut self.config.graceful_restart {
            gr.restarting = restarting;
        }
    }

    pub fn step(mut self, event: Event) -> (Self, Vec<Output>) {
        let mut out = Vec::new();
        self.handle(event, &mut out);
        (self, out)
    }

    fn handle(&mut self, event: Event, out: &mut Vec<Output>) {
        use Event as E;
        use State as S;

        // Events with the same handling in every non-Idle state.
        match (&event, self.state) {
            (E::ManualStart, _) if self.state != S::Idle => return,
            (E::ManualStop, S::Idle) => {
                self.admin_up = false;
                self.connect_retry_counter = 0;
                out.push(Output::StopTimer(TimerKind::ConnectRetry));
                return;
            }
            (E::AgentShutdown { .. }, S::Idle) => {
                self.admin_up = false;
                out.push(Output::StopTimer(TimerKind::ConnectRetry));
                return;
            }
            (E::ManualStop, _) => {
                self.admin_up = false;
                self.connect_retry_counter = 0;
                let notify =
                    self.is_open_exchanged().then(|| Notification::cease(cease_subcode::ADMINISTRATIVE_SHUTDOWN));
                self.teardown(notify, DownReason::ManualStop, false, out);
                return;
            }
            (E::AgentShutdown { graceful_restart }, _) => {
                let graceful = *graceful_restart && self.config.graceful_restart.is_some();
                self.admin_up = false;
                let notify = (self.is_open_exchanged() && !graceful)
                    .then(|| Notification::cease(cease_subcode::ADMINISTRATIVE_SHUTDOWN));
                self.teardown(notify, DownReason::AgentShutdown { graceful_restart: graceful }, false, out);
                return;
            }
            (E::CollisionLost, S::Idle) => return,
            // Without an open BGP session there is nothing for BFD to bring down.
            (E::BfdDown, S::Idle | S::Connect | S::Active) => return,
            (E::MaxPrefixesExceeded { .. }, S::Idle | S::Connect | S::Active) => return,
            (E::MaxPrefixesExceeded { family, limit }, _) => {
                let (family, limit) = (*family, *limit);
                self.max_prefix_violations = self.max_prefix_violations.saturating_add(1);
                let n = Notification::max_prefixes(family, limit);
                self.teardown(Some(n), DownReason::MaxPrefixesExceeded { family, limit }, true, out);
                // teardown scheduled the usual retry; the idle hold replaces it.
                if self.admin_up {
                    out.push(Output::StartTimer(
                        TimerKind::ConnectRetry,
                        self.config.max_prefix_idle_hold.delay(self.max_prefix_violations - 1),
                    ));
                    self.idle_hold = true;
                }
                return;
            }
            (E::CollisionLost, _) => {
                let n = Notification::cease(cease_subcode::CONNECTION_COLLISION_RESOLUTION);
                self.teardown(Some(n.clone()), DownReason::NotificationSent(n), false, out);
                return;
            }
            _ => {}
        }

        match (self.state, event) {
            // ---------------- Idle ----------------
            (S::Idle, E::ManualStart) => {
                self.admin_up = true;
                self.connect_retry_counter = 0;
                self.idle_hold = false;
                self.start();
                self.start_connecting(out);
            }
            (S::Idle, E::ConnectRetryTimerExpires) if self.admin_up => {
                self.idle_hold = false;
                self.start_connecting(out);
            }
            (S::Idle, _) => {}

            // ---------------- Connect / Active ----------------
            (S::Connect | S::Active, E::ConnectRetryTimerExpires) => {
                if self.state == S::Connect {
                    out.push(Output::CloseConnection);
                }
                self.start_connecting(out);
            }
            (S::Connect | S::Active, E::TcpConnectionAcknowledged | E::TcpConnectionConfirmed) => {
                out.push(Output::StopTimer(TimerKind::ConnectRetry));
                out.push(Output::SendMessage(Message::Open(self.local_open())));
                out.push(Output::StartTimer(TimerKind::Hold, OPEN_HOLD_TIME));
                self.state = S::OpenSent;
            }
            (S::Connect, E::TcpConnectionFails) => {
                // Keep listening; retry when the timer fires.
                out.push(Output::StartTimer(TimerKind::ConnectRetry, self.retry_delay()));
                self.state = S::Active;
            }
            (S::Connect | S::Active, _) => {
                self.teardown(None, DownReason::TcpConnectionFailed, true, out);
            }

            // ---------------- OpenSent ----------------
            (S::OpenSent, E::MessageReceived(Message::Open(open))) => match self.validate_open(&open) {
                Err(n) => self.teardown(Some(n.clone()), DownReason::NotificationSent(n), true, out),
                Ok(negotiated) => {
                    out.push(Output::SendMessage(Message::Keepalive));
                    self.arm_session_timers(&negotiated, out);
                    self.negotiated = Some(negotiated);
                    self.state = S::OpenConfirm;
                }
            },
            (S::OpenSent, E::TcpConnectionFails) => {
                // RFC 4271: back to Active and keep listening.
                out.push(Output::CloseConnection);
                out.push(Output::StopTimer(TimerKind::Hold));
                out.push(Output::StartTimer(TimerKind::ConnectRetry, self.retry_delay()));
                self.state = S::Active;
            }

            // ---------------- OpenConfirm ----------------
            (S::OpenConfirm, E::MessageReceived(Message::Keepalive)) => {
                self.restart_hold_timer(out);
                self.connect_retry_counter = 0;
                self.state = S::Established;
                if let Some(n) = &self.negotiated {
                    out.push(Output::SessionEstablished(n.clone()));
                }
            }
            (S::OpenConfirm | S::Established, E::KeepaliveTimerExpires) => {
                out.push(Output::SendMessage(Message::Keepalive));
                if let Some(interval) = self.negotiated.as_ref().and_then(|n| n.keepalive_interval) {
                    out.push(Output::StartTimer(TimerKind::Keepalive, interval));
                }
            }

            // ---------------- Established ----------------
            (S::Established, E::MessageReceived(msg)) => match msg {
                Message::Keepalive => self.restart_hold_timer(out),
                Message::Update(update) => {
                    self.restart_hold_timer(out);
                    out.push(Output::RoutesReceived(update));
                }
                Message::EndOfRib(afi, safi) => {
                    self.restart_hold_timer(out);
                    out.push(Output::EndOfRibReceived(afi, safi));
                }
                Message::RouteRefresh(afi, safi) => {
                    self.restart_hold_timer(out);
                    out.push(Output::RouteRefreshRequested(afi, safi));
                }
                Message::Notification(n) => self.teardown(None, DownReason::NotificationReceived(n), true, out),
                Message::Open(_) => self.fsm_error(fsm_subcode::UNEXPECTED_IN_ESTABLISHED, out),
            },

            // ---------------- shared by OpenSent/OpenConfirm/Established ----
            (_, E::HoldTimerExpires) => {
                let n = Notification::hold_timer_expired();
                self.teardown(Some(n), DownReason::HoldTimerExpired, true, out);
            }
            (_, E::TcpConnectionFails) => self.teardown(None, DownReason::TcpConnectionFailed, true, out),
            (_, E::BfdDown) => {
                let n = Notification::cease(cease_subcode::BFD_DOWN);
                self.teardown(Some(n), DownReason::BfdDown, true, out);
            }
            (_, E::MessageReceived(Message::Notification(n))) => {
                self.teardown(None, DownReason::NotificationReceived(n), true, out)
            }
            (_, E::DecodeError(n)) => self.teardown(Some(n.clone()), DownReason::NotificationSent(n), true, out),
            // A second connection is the driver's business (collision).
            (_, E::TcpConnectionConfirmed | E::TcpConnectionAcknowledged) => {}
            // Anything else is unexpected in this state: FSM error.
            (state, _) => {
                let subcode = match state {
                    S::OpenSent => fsm_subcode::UNEXPECTED_IN_OPEN_SENT,
                    S::OpenConfirm => fsm_subcode::UNEXPECTED_IN_OPEN_CONFIRM,
                    _ => fsm_subcode::UNEXPECTED_IN_ESTABLISHED,
                };
                self.fsm_error(subcode, out);
            }
        }
    }

    fn start(&mut self) {
        self.negotiated = None;
    }

    fn is_open_exchanged(&self) -> bool {
        matches!(self.state, State::OpenSent | State::OpenConfirm | State::Established)
    }

    fn retry_delay(&self) -> Duration {
        self.config.connect_retry.delay(self.connect_retry_counter)
    }

    fn start_connecting(&mut self, out: &mut Vec<Output>) {
        out.push(Output::StartTimer(TimerKind::ConnectRetry, self.retry_delay()));
        if self.config.passive {
            self.state = State::Active;
        } else {
            out.push(Output::Connect);
            self.state = State::Connect;
        }
    }

    fn fsm_error(&mut self, subcode: u8, out: &mut Vec<Output>) {
        let n = Notification::fsm_error(subcode);
        self.teardown(Some(n.clone()), DownReason::NotificationSent(n), true, out);
    }

    /// Common exit to Idle: optional NOTIFICATION, close, stop timers, report
    /// SessionDown if we were Established, and schedule an automatic restart
    /// (with backoff) while administratively up.
    fn teardown(
        &mut self,
        notification: Option<Notification>,
        reason: DownReason,
        count_failure: bool,
        out: &mut Vec<Output>,
    ) {
        let was_established = self.state == State::Established;
        if let Some(n) = notification {
            out.push(Output::SendMessage(Message::Notification(n)));
        }
        if self.state != State::Idle {
            out.push(Output::CloseConnection);
        }
        out.push(Output::StopTimer(TimerKind::Hold));
        out.push(Output::StopTimer(TimerKind::Keepalive));
        if count_failure {
            self.connect_retry_counter = self.connect_retry_counter.saturating_add(1);
        }
        let negotiated = self.negotiated.take();
        if let (true, Some(negotiated)) = (was_established, negotiated) {
            out.push(Output::SessionDown { reason, negotiated });
        }
        self.state = State::Idle;
        if self.admin_up {
            out.push(Output::StartTimer(TimerKind::ConnectRetry, self.retry_delay()));
        } else {
            out.push(Output::StopTimer(TimerKind::ConnectRetry));
        }
    }

    fn restart_hold_timer(&self, out: &mut Vec<Output>) {
        if let Some(n) = &self.negotiated {
            if !n.hold_time.is_zero() {
                out.push(Output::StartTimer(TimerKind::Hold, n.hold_time));
            }
        }
    }

    fn arm_session_timers(&self, n: &Negotiated, out: &mut Vec<Output>) {
        match n.keepalive_interval {
            Some(interval) => {
                out.push(Output::StartTimer(TimerKind::Keepalive, interval));
                out.push(Output::StartTimer(TimerKind::Hold, n.hold_time));
            }
            None => {
                out.push(Output::StopTimer(TimerKind::Keepalive));
                out.push(Output::StopTimer(TimerKind::Hold));
            }
        }
    }

    fn proposed_hold_time(&self) -> u16 {
        match self.config.hold_time_secs {
            1 | 2 => 3,
            h => h,
        }
    }

    /// The OPEN we send on this session.
    pub fn local_open(&self) -> Open {
        let c = &self.config;
        let mut capabilities: Vec<Capability> =
            c.families.iter().map(|f| Capability::MultiProtocol(f.afi(), f.safi())).collect();
        capabilities.push(Capability::FourOctetAs(c.local_asn));
        capabilities.push(Capability::RouteRefresh);
        if let Some(gr) = &c.graceful_restart {
            capabilities.push(Capability::GracefulRestart(GracefulRestartCapability {
                restart_state: gr.restarting,
                restart_time_secs: gr.restart_time_secs.min(MAX_RESTART_TIME_SECS),
                families: c
                    .families
                    .iter()
                    .map(|f| GracefulRestartFamily {
                        afi: f.afi(),
                        safi: f.safi(),
                        // Kernel routes are left in place across an agent
                        // restart, so forwarding survives exactly then.
                        forwarding_preserved: gr.restarting,
                    })
                    .collect(),
            }));
        }
        Open {
            version: BGP_VERSION,
            my_asn: c.local_asn,
            hold_time: self.proposed_hold_time(),
            router_id: c.router_id,
            capabilities,
        }
    }

    /// RFC 4271 §6.2 OPEN checks plus capability negotiation.
    pub fn validate_open(&self, open: &Open) -> Result<Negotiated, Notification> {
        let c = &self.config;
        if open.version != BGP_VERSION {
            return Err(Notification::open_error(
                open_subcode::UNSUPPORTED_VERSION,
                u16::from(BGP_VERSION).to_be_bytes().to_vec(),
            ));
        }
        if open.my_asn != c.peer_asn {
            return Err(Notification::open_error(
                open_subcode::BAD_PEER_AS,
                open.two_octet_asn().to_be_bytes().to_vec(),
            ));
        }
        if matches!(open.hold_time, 1 | 2) {
            return Err(Notification::open_error(
                open_subcode::UNACCEPTABLE_HOLD_TIME,
                open.hold_time.to_be_bytes().to_vec(),
            ));
        }
        let id = open.router_id;
        // RFC 6286: any non-zero 32-bit value is a valid identifier, but it
        // must differ from ours within an AS.
        if id.is_unspecified() || (c.is_ibgp() && id == c.router_id) {
            return Err(Notification::open_error(open_subcode::BAD_BGP_IDENTIFIER, id.octets().to_vec()));
        }

        let hold = self.proposed_hold_time().min(open.hold_time);
        let hold_time = Duration::from_secs(u64::from(hold));
        let keepalive_interval = (hold > 0).then(|| Duration::from_secs(u64::from((hold / 3).max(1))));

        // RFC 4760 §8: a peer without MP capabilities speaks IPv4 unicast.
        let peer_mp: Vec<(Afi, Safi)> = open.multiprotocol().collect();
        let peer_supports = |f: Family| {
            if peer_mp.is_empty() {
                f == Family::Ipv4Unicast
            } else {
                peer_mp.contains(&(f.afi(), f.safi()))
            }
        };
        let families: Vec<Family> = c.families.iter().copied().filter(|f| peer_supports(*f)).collect();

        let peer_graceful_restart = open.graceful_restart().map(|gr| PeerGracefulRestart {
            restart_state: gr.restart_state,
            restart_time: Duration::from_secs(u64::from(gr.restart_time_secs.min(MAX_RESTART_TIME_SECS))),
            families: gr
                .families
                .iter()
                .filter_map(|f| Family::from_afi_safi(f.afi, f.safi).map(|fam| (fam, f.forwarding_preserved)))
                .filter(|(fam, _)| families.contains(fam))
                .collect(),
        });

        Ok(Negotiated {
            peer_asn: open.my_asn,
            peer_router_id: id,
            hold_time,
            keepalive_interval,
            families,
            four_octet_as: open.four_octet_asn_capability().is_some(),
            route_refresh: open.supports_route_refresh(),
            peer_graceful_restart,
            local_graceful_restart: c.graceful_restart.is_some(),
            ibgp: c.is_ibgp(),
        })
    }
}

/// Which end opened a TCP connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// We connected to the peer.
    Outbound,
    /// The peer connected to us.
    Inbound,
}

/// RFC 4271 §6.8 connection collision: given two connections to the same
/// peer, return the direction of the one to keep. The other receives Cease
/// 6/7 ([`Event::CollisionLost`]). An Established connection always wins
/// (pass `existing_established = true`). Equal BGP identifiers are broken by
/// ASN (RFC 6286 §2.3): the connection initiated by the larger ASN survives.
pub fn resolve_collision(
    local_id: Ipv4Addr,
    local_asn: u32,
    remote_id: Ipv4Addr,
    remote_asn: u32,
    existing: Direction,
    existing_established: bool,
) -> Direction {
    if existing_established {
        return existing;
    }
    let local_wins =
        if local_id == remote_id { local_asn > remote_asn } else { u32::from(local_id) > u32::from(remote_id) };
    // The higher identifier keeps the connection *it* initiated.
    if local_wins {
        Direction::Outbound
    } else {
        Direction::Inbound
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::bgp::message::error_code;

    const LOCAL_ID: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
    const PEER_ID: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 2);

    fn config() -> SessionConfig {
        SessionConfig::new(64512, 64513, LOCAL_ID)
    }

    fn peer_open() -> Open {
        Open {
            version: 4,
            my_asn: 64513,
            hold_time: 30,
            router_id: PEER_ID,
            capabilities: vec![
                Capability::MultiProtocol(Afi::Ipv4, Safi::Unicast),
                Capability::MultiProtocol(Afi::Ipv6, Safi::Unicast),
                Capability::FourOctetAs(64513),
                Capability::RouteRefresh,
                Capability::GracefulRestart(GracefulRestartCapability {
                    restart_state: false,
                    restart_time_secs: 120,
                    families: vec![
                        GracefulRestartFamily { afi: Afi::Ipv4, safi: Safi::Unicast, forwarding_preserved: true },
                        GracefulRestartFamily { afi: Afi::Ipv6, safi: Safi::Unicast, forwarding_preserved: false },
                    ],
                }),
            ],
        }
    }

    fn run(session: Session, events: Vec<Event>) -> (Session, Vec<Output>) {
        let mut all = Vec::new();
        let mut s = session;
        for e in events {
            let (next, out) = s.step(e);
            s = next;
            all.extend(out);
        }
        (s, all)
    }

    fn established(cfg: SessionConfig) -> Session {
        let (s, _) = run(
            Session::new(cfg),
            vec![
                Event::ManualStart,
                Event::TcpConnectionAcknowledged,
                Event::MessageReceived(Message::Open(peer_open())),
                Event::MessageReceived(Message::Keepalive),
            ],
        );
        assert_eq!(s.state(), State::Established);
        s
    }

    fn down_reason(out: &[Output]) -> Option<DownReason> {
        out.iter().find_map(|o| match o {
            Output::SessionDown { reason, .. } => Some(reason.clone()),
            _ => None,
        })
    }

    fn sent_notification(out: &[Output]) -> Option<(u8, u8)> {
        out.iter().find_map(|o| match o {
            Output::SendMessage(Message::Notification(n)) => Some((n.code, n.subcode)),
            _ => None,
        })
    }

    #[test]
    fn max_prefixes_sends_rfc4486_cease_and_holds_the_session_down() {
        let s = established(config());
        let (s, out) = s.step(Event::MaxPrefixesExceeded { family: Family::Ipv6Unicast, limit: 100 });
        assert_eq!(s.state(), State::Idle);
        let n = out
            .iter()
            .find_map(|o| match o {
                Output::SendMessage(Message::Notification(n)) => Some(n.clone()),
                _ => None,
            })
            .expect("a NOTIFICATION is sent");
        // Cease / Maximum Number of Prefixes Reached, data: AFI 2, SAFI 1, upper bound 100.
        assert_eq!((n.code, n.subcode), (error_code::CEASE, cease_subcode::MAX_PREFIXES));
        assert_eq!(n.data, vec![0, 2, 1, 0, 0, 0, 100]);
        let reason = down_reason(&out).expect("the session went down");
        assert_eq!(reason, DownReason::MaxPrefixesExceeded { family: Family::Ipv6Unicast, limit: 100 });
        assert!(!reason.retains_routes_for_graceful_restart(), "a limit violation never keeps routes as stale");
        // The retry waits the idle hold (the last ConnectRetry start wins in the driver).
        let retry = out.iter().rev().find_map(|o| match o {
            Output::StartTimer(TimerKind::ConnectRetry, d) => Some(*d),
            _ => None,
        });
        assert_eq!(retry, Some(Duration::from_secs(30)));
        assert!(s.in_idle_hold(), "connections are refused during the idle hold");

        // The hold expires: the session connects again; a second violation holds twice as long.
        let (s, out) = s.step(Event::ConnectRetryTimerExpires);
        assert!(!s.in_idle_hold());
        assert!(out.contains(&Output::Connect));
        let (s, _) = run(
            s,
            vec![
                Event::TcpConnectionAcknowledged,
                Event::MessageReceived(Message::Open(peer_open())),
                Event::MessageReceived(Message::Keepalive),
            ],
        );
        assert_eq!(s.state(), State::Established);
        let (s, out) = s.step(Event::MaxPrefixesExceeded { family: Family::Ipv4Unicast, limit: 100 });
        let retry = out.iter().rev().find_map(|o| match o {
            Output::StartTimer(TimerKind::ConnectRetry, d) => Some(*d),
            _ => None,
        });
        assert_eq!(retry, Some(Duration::from_secs(60)));
        assert_eq!(s.max_prefix_violations(), 2);

        // Outside a session there is nothing to tear down.
        let (s, out) =
            Session::new(config()).step(Event::MaxPrefixesExceeded { family: Family::Ipv4Unicast, limit: 1 });
        assert!(out.is_empty() && !s.in_idle_hold());
    }

    #[test]
    fn happy_path_transitions() {
        let s = Session::new(config());
        let (s, out) = s.step(Event::ManualStart);
        assert_eq!(s.state(), State::Connect);
        assert!(out.contains(&Output::Connect));
        assert!(out.contains(&Output::StartTimer(TimerKind::ConnectRetry, Duration::from_secs(5))));

        let (s, out) = s.step(Event::TcpConnectionAcknowledged);
        assert_eq!(s.state(), State::OpenSent);
        assert!(matches!(out[1], Output::SendMessage(Message::Open(_))));
        assert!(out.contains(&Output::StartTimer(TimerKind::Hold, OPEN_HOLD_TIME)));

        let (s, out) = s.step(Event::MessageReceived(Message::Open(peer_open())));
        assert_eq!(s.state(), State::OpenConfirm);
        assert_eq!(
            out,
            vec![
                Output::SendMessage(Message::Keepalive),
                Output::StartTimer(TimerKind::Keepalive, Duration::from_secs(10)),
                Output::StartTimer(TimerKind::Hold, Duration::from_secs(30)),
            ]
        );

        let (s, out) = s.step(Event::MessageReceived(Message::Keepalive));
        assert_eq!(s.state(), State::Established);
        let Some(Output::SessionEstablished(n)) = out.last() else { panic!("{out:?}") };
        assert_eq!(n.hold_time, Duration::from_secs(30));
        assert_eq!(n.families, vec![Family::Ipv4Unicast, Family::Ipv6Unicast]);
        assert!(n.four_octet_as && n.route_refresh && !n.ibgp);
        let gr = n.peer_graceful_restart.as_ref().unwrap();
        assert!(gr.forwarding_preserved(Family::Ipv4Unicast));
        assert!(!gr.forwarding_preserved(Family::Ipv6Unicast));
        assert_eq!(gr.restart_time, Duration::from_secs(120));

        let update = Update::default();
        let (s, out) = s.step(Event::MessageReceived(Message::Update(update.clone())));
        assert_eq!(s.state(), State::Established);
        assert!(out.contains(&Output::RoutesReceived(update)));
        assert!(out.contains(&Output::StartTimer(TimerKind::Hold, Duration::from_secs(30))));

        let (_, out) = s.step(Event::MessageReceived(Message::end_of_rib(Family::Ipv6Unicast)));
        assert!(out.contains(&Output::EndOfRibReceived(Afi::Ipv6, Safi::Unicast)));
    }

    #[test]
    fn table_of_error_transitions() {
        type Case = (&'static str, Vec<Event>, State, Option<(u8, u8)>);
        let to_open_sent = vec![Event::ManualStart, Event::TcpConnectionAcknowledged];
        let to_open_confirm = [to_open_sent.clone(), vec![Event::MessageReceived(Message::Open(peer_open()))]].concat();
        let with = |base: &Vec<Event>, e: Event| [base.clone(), vec![e]].concat();
        let cases: Vec<Case> = vec![
            ("OpenSent hold timer", with(&to_open_sent, Event::HoldTimerExpires), State::Idle, Some((4, 0))),
            ("OpenConfirm hold timer", with(&to_open_confirm, Event::HoldTimerExpires), State::Idle, Some((4, 0))),
            (
                "keepalive in OpenSent",
                with(&to_open_sent, Event::MessageReceived(Message::Keepalive)),
                State::Idle,
                Some((5, 1)),
            ),
            (
                "update in OpenConfirm",
                with(&to_open_confirm, Event::MessageReceived(Message::Update(Update::default()))),
                State::Idle,
                Some((5, 2)),
            ),
            (
                "OPEN in OpenConfirm",
                with(&to_open_confirm, Event::MessageReceived(Message::Open(peer_open()))),
                State::Idle,
                Some((5, 2)),
            ),
            ("TCP fails in OpenSent", with(&to_open_sent, Event::TcpConnectionFails), State::Active, None),
            ("TCP fails in Connect", vec![Event::ManualStart, Event::TcpConnectionFails], State::Active, None),
            (
                "Active retry timer reconnects",
                vec![Event::ManualStart, Event::TcpConnectionFails, Event::ConnectRetryTimerExpires],
                State::Connect,
                None,
            ),
            (
                "ManualStop in OpenConfirm sends Cease",
                with(&to_open_confirm, Event::ManualStop),
                State::Idle,
                Some((6, 2)),
            ),
            ("ManualStop in Connect is silent", vec![Event::ManualStart, Event::ManualStop], State::Idle, None),
            (
                "decode error",
                with(&to_open_confirm, Event::DecodeError(Notification::new(1, 2, vec![]))),
                State::Idle,
                Some((1, 2)),
            ),
            ("collision loser", with(&to_open_confirm, Event::CollisionLost), State::Idle, Some((6, 7))),
            (
                "notification received",
                with(&to_open_confirm, Event::MessageReceived(Message::Notification(Notification::cease(2)))),
                State::Idle,
                None,
            ),
            ("events in Idle are ignored", vec![Event::HoldTimerExpires, Event::TcpConnectionFails], State::Idle, None),
        ];
        for (name, events, want_state, want_notification) in cases {
            let (s, out) = run(Session::new(config()), events);
            assert_eq!(s.state(), want_state, "{name}");
            assert_eq!(sent_notification(&out), want_notification, "{name}: {out:?}");
        }
    }

    #[test]
    fn hold_timer_expiry_in_established_sends_4_0_and_reports_down() {
        let s = established(config());
        let (s, out) = s.step(Event::HoldTimerExpires);
        assert_eq!(s.state(), State::Idle);
        assert_eq!(sent_notification(&out), Some((error_code::HOLD_TIMER_EXPIRED, 0)));
        assert!(out.contains(&Output::CloseConnection));
        assert_eq!(down_reason(&out), Some(DownReason::HoldTimerExpired));
        assert!(DownReason::HoldTimerExpired.retains_routes_for_graceful_restart());
        // Auto-restart is scheduled with backoff (counter now 1 -> 10 s).
        assert!(out.contains(&Output::StartTimer(TimerKind::ConnectRetry, Duration::from_secs(10))));
        let (s, out) = s.step(Event::ConnectRetryTimerExpires);
        assert_eq!(s.state(), State::Connect);
        assert!(out.contains(&Output::Connect));
    }

    #[test]
    fn open_validation_errors() {
        let s = Session::new(config());
        let mut cases: Vec<(Open, u8)> = Vec::new();
        let mut o = peer_open();
        o.version = 3;
        cases.push((o, open_subcode::UNSUPPORTED_VERSION));
        let mut o = peer_open();
        o.my_asn = 65000;
        cases.push((o, open_subcode::BAD_PEER_AS));
        let mut o = peer_open();
        o.router_id = Ipv4Addr::UNSPECIFIED;
        cases.push((o, open_subcode::BAD_BGP_IDENTIFIER));
        for bad_hold in [1, 2] {
            let mut o = peer_open();
            o.hold_time = bad_hold;
            cases.push((o, open_subcode::UNACCEPTABLE_HOLD_TIME));
        }
        for (open, subcode) in cases {
            let n = s.validate_open(&open).unwrap_err();
            assert_eq!((n.code, n.subcode), (2, subcode), "{open:?}");
            let (after, out) = run(
                s.clone(),
                vec![Event::ManualStart, Event::TcpConnectionConfirmed, Event::MessageReceived(Message::Open(open))],
            );
            assert_eq!(after.state(), State::Idle);
            assert_eq!(sent_notification(&out), Some((2, subcode)));
        }
        // iBGP peer using our own router id.
        let mut cfg = config();
        cfg.peer_asn = 64512;
        let mut o = peer_open();
        o.my_asn = 64512;
        o.router_id = LOCAL_ID;
        let n = Session::new(cfg).validate_open(&o).unwrap_err();
        assert_eq!(n.subcode, open_subcode::BAD_BGP_IDENTIFIER);
    }

    #[test]
    fn hold_time_negotiation() {
        let mut cfg = config();
        cfg.hold_time_secs = 90;
        let s = Session::new(cfg);
        let mut o = peer_open();
        o.hold_time = 9;
        let n = s.validate_open(&o).unwrap();
        assert_eq!(n.hold_time, Duration::from_secs(9));
        assert_eq!(n.keepalive_interval, Some(Duration::from_secs(3)));
        o.hold_time = 0;
        let n = s.validate_open(&o).unwrap();
        assert_eq!(n.hold_time, Duration::ZERO);
        assert_eq!(n.keepalive_interval, None);
        // With hold 0 no keepalive/hold timers are started.
        let (s2, out) = run(
            s.clone(),
            vec![
                Event::ManualStart,
                Event::TcpConnectionAcknowledged,
                Event::MessageReceived(Message::Open(o)),
                Event::MessageReceived(Message::Keepalive),
            ],
        );
        assert_eq!(s2.state(), State::Established);
        let after_open =
            out.iter().skip_while(|o| !matches!(o, Output::SendMessage(Message::Keepalive))).collect::<Vec<_>>();
        assert!(!after_open.iter().any(|o| matches!(o, Output::StartTimer(TimerKind::Hold | TimerKind::Keepalive, _))));
        // We never propose 1 or 2.
        let mut cfg = config();
        cfg.hold_time_secs = 2;
        assert_eq!(Session::new(cfg).local_open().hold_time, 3);
    }

    #[test]
    fn capability_negotiation_without_mp_means_ipv4_only() {
        let mut o = peer_open();
        o.capabilities = vec![];
        let n = Session::new(config()).validate_open(&o).unwrap();
        assert_eq!(n.families, vec![Family::Ipv4Unicast]);
        assert!(!n.four_octet_as && !n.route_refresh);
        assert!(n.peer_graceful_restart.is_none());
    }

    #[test]
    fn four_octet_asn_is_validated_against_capability() {
        let mut cfg = config();
        cfg.peer_asn = 4_200_000_000;
        let mut o = peer_open();
        o.my_asn = 4_200_000_000;
        assert!(Session::new(cfg).validate_open(&o).is_ok());
    }

    #[test]
    fn keepalive_timer_sends_keepalive() {
        let s = established(config());
        let (_, out) = s.step(Event::KeepaliveTimerExpires);
        assert_eq!(
            out,
            vec![
                Output::SendMessage(Message::Keepalive),
                Output::StartTimer(TimerKind::Keepalive, Duration::from_secs(10))
            ]
        );
    }

    #[test]
    fn established_error_paths_report_session_down() {
        let (s, out) = established(config()).step(Event::TcpConnectionFails);
        assert_eq!(s.state(), State::Idle);
        assert_eq!(down_reason(&out), Some(DownReason::TcpConnectionFailed));
        assert_eq!(sent_notification(&out), None);

        let n = Notification::cease(cease_subcode::ADMINISTRATIVE_RESET);
        let (_, out) = established(config()).step(Event::MessageReceived(Message::Notification(n.clone())));
        assert_eq!(down_reason(&out), Some(DownReason::NotificationReceived(n)));

        let (_, out) = established(config()).step(Event::MessageReceived(Message::Open(peer_open())));
        assert_eq!(sent_notification(&out), Some((5, 3)));

        let (s, out) = established(config()).step(Event::ManualStop);
        assert_eq!(sent_notification(&out), Some((6, 2)));
        assert!(out.contains(&Output::StopTimer(TimerKind::ConnectRetry)));
        // Administratively down: the retry timer does nothing.
        let (s, out) = s.step(Event::ConnectRetryTimerExpires);
        assert_eq!(s.state(), State::Idle);
        assert!(out.is_empty());
    }

    #[test]
    fn agent_shutdown_with_graceful_restart_sends_no_cease() {
        let mut cfg = config();
        cfg.graceful_restart = Some(GracefulRestartConfig { restart_time_secs: 120, restarting: false });
        let (s, out) = established(cfg.clone()).step(Event::AgentShutdown { graceful_restart: true });
        assert_eq!(s.state(), State::Idle);
        assert_eq!(sent_notification(&out), None);
        assert!(out.contains(&Output::CloseConnection));
        assert_eq!(down_reason(&out), Some(DownReason::AgentShutdown { graceful_restart: true }));

        // Non-graceful shutdown, or GR not configured: Cease as usual.
        let (_, out) = established(cfg).step(Event::AgentShutdown { graceful_restart: false });
        assert_eq!(sent_notification(&out), Some((6, 2)));
        let (_, out) = established(config()).step(Event::AgentShutdown { graceful_restart: true });
        assert_eq!(sent_notification(&out), Some((6, 2)));
    }

    #[test]
    fn restarting_speaker_open_has_r_and_f_bits() {
        let mut cfg = config();
        cfg.graceful_restart = Some(GracefulRestartConfig { restart_time_secs: 5000, restarting: true });
        let mut s = Session::new(cfg);
        let gr = s.local_open().graceful_restart().cloned().unwrap();
        assert!(gr.restart_state);
        assert_eq!(gr.restart_time_secs, MAX_RESTART_TIME_SECS);
        assert!(gr.families.iter().all(|f| f.forwarding_preserved));
        assert_eq!(gr.families.len(), 2);
        s.set_restarting(false);
        let gr = s.local_open().graceful_restart().cloned().unwrap();
        assert!(!gr.restart_state);
        assert!(gr.families.iter().all(|f| !f.forwarding_preserved));
    }

    #[test]
    fn connect_retry_backoff_is_exponential_and_capped() {
        let b = ConnectRetryBackoff { initial: Duration::from_secs(5), max: Duration::from_secs(60) };
        let delays: Vec<u64> = (0..6).map(|n| b.delay(n).as_secs()).collect();
        assert_eq!(delays, vec![5, 10, 20, 40, 60, 60]);
        assert_eq!(b.delay(u32::MAX), Duration::from_secs(60));

        // Repeated failures from Active grow the counter and the delay.
        let (s, _) =
            run(Session::new(config()), vec![Event::ManualStart, Event::TcpConnectionFails, Event::TcpConnectionFails]);
        assert_eq!(s.state(), State::Idle);
        assert_eq!(s.connect_retry_counter(), 1);
        // Success resets it.
        let s = established(config());
        assert_eq!(s.connect_retry_counter(), 0);
    }

    #[test]
    fn passive_session_waits_in_active() {
        let mut cfg = config();
        cfg.passive = true;
        let (s, out) = Session::new(cfg).step(Event::ManualStart);
        assert_eq!(s.state(), State::Active);
        assert!(!out.contains(&Output::Connect));
        let (s, _) = s.step(Event::TcpConnectionConfirmed);
        assert_eq!(s.state(), State::OpenSent);
    }

    #[test]
    fn decode_outcome_maps_to_events() {
        let p = "10.0.0.0/8".parse().unwrap();
        let e = Event::from(DecodeOutcome::TreatAsWithdraw { withdrawn: vec![p], reason: String::new() });
        let (_, out) = established(config()).step(e);
        assert!(out
            .iter()
            .any(|o| matches!(o, Output::RoutesReceived(u) if u.withdrawn == vec![p] && u.announced.is_empty())));
        assert_eq!(Event::from(DecodeOutcome::ConnectionError("x".into())), Event::TcpConnectionFails);
    }

    #[test]
    fn collision_keeps_connection_of_higher_router_id() {
        let low = Ipv4Addr::new(1, 1, 1, 1);
        let high = Ipv4Addr::new(2, 2, 2, 2);
        // We are higher: keep the connection we initiated.
        assert_eq!(resolve_collision(high, 1, low, 2, Direction::Inbound, false), Direction::Outbound);
        // We are lower: keep the peer's.
        assert_eq!(resolve_collision(low, 1, high, 2, Direction::Outbound, false), Direction::Inbound);
        // Established always wins.
        assert_eq!(resolve_collision(low, 1, high, 2, Direction::Outbound, true), Direction::Outbound);
        // Equal ids: larger ASN's connection survives.
        assert_eq!(resolve_collision(low, 65001, low, 65000, Direction::Inbound, false), Direction::Outbound);
        assert_eq!(resolve_collision(low, 65000, low, 65001, Direction::Outbound, false), Direction::Inbound);
    }
}
