//! The BGP speaker: TCP sessions, timers and the kernel FIB around the pure core, cut like
//! holo-bgp:
//! * `instance`: every [`crate::routing::bgp::fsm::Session`], the [`crate::routing::bgp::rib::Rib`] and both
//!   graceful-restart roles, one function per input event, the time passed in with each, typed
//!   actions out (send, connect, close, ...) and the FIB target and status published after a
//!   burst. No tokio, no fds: `tests` replays whole runs through it.
//! * `tasks`: the accept loops, connection attempts and one task per connection (each with
//!   its own [`crate::routing::bgp::codec::WireCodec`]) own the sockets and send typed events; the
//!   driver feeds them to the instance and executes its actions.
//! * The kernel routes are written by a separate FIB task ([`crate::routing::fib::task`]) from a
//!   `watch` of the desired route set, so a slow netlink socket never stalls keepalives.
//!
//! What survives what:
//! * API outage: nothing here depends on the API; peers and prefixes stay as last configured.
//! * Agent stop with graceful restart: no NOTIFICATION is sent, kernel routes stay, peers keep
//!   our routes as stale. On start the OPEN carries R=1/F=1, our advertisements wait until every
//!   peer has sent End-of-RIB (or the selection-deferral timer fires), and only then are kernel
//!   routes that are really gone deleted.
//! * Even without a restart, FIB deletions wait for that first complete picture: a route of our
//!   protocol found at start is never removed just because its session is not up yet.
pub mod instance;
mod status;
mod tasks;
#[cfg(test)]
mod tests;

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    os::fd::AsRawFd,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::sync::{mpsc, oneshot, watch};

pub use self::status::{Advertisements, PeerStatus, SpeakerStatus, StatusRoute};
use self::{
    instance::{Input, Instance},
    tasks::{accept_loop, bind_listener, Driver, DriverParts, TaskEvent, WIRE_QUEUE},
};
use super::{
    fsm::ConnectRetryBackoff,
    message::{Family, Prefix},
    peers::PeerConfig,
    policy::{ExportPolicy, ImportPolicy, OriginKind},
};
pub use crate::routing::fib::task::{FibLink, FibTarget};
use crate::{
    routing::fib::{health::FibStats, resolve::Reachability, Desired, RouteSet},
    routing::overlay::OverlayConfig,
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

/// Handle to the running speaker.
#[derive(Clone)]
pub struct Speaker {
    events: mpsc::UnboundedSender<TaskEvent>,
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
        let marker = marker_path(&config);
        let restarting = config.graceful_restart.is_some() && marker.as_ref().is_some_and(|p| p.exists());
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
        let parts = DriverParts {
            local_asn: config.local_asn,
            bfd_port: config.bfd_port,
            marker,
            graceful_restart: config.graceful_restart.is_some(),
            instance: Instance::new(config, restarting, &installed, &peers, std::time::Instant::now()),
            events: events.clone(),
            wire: wire.clone(),
            status: status.clone(),
            fib: fib_tx,
        };
        let mut driver = Driver::new(parts);
        for listener in listeners {
            driver.listener_fds.push(listener.as_raw_fd());
            tokio::spawn(accept_loop(listener, wire.clone()));
        }
        driver.input(Input::SetPrefixes(prefixes));
        driver.input(Input::SetPeers(peers));
        driver.publish();
        tokio::spawn(driver.run(rx, wire_rx));
        let views = events.clone();
        let link = FibLink::new(
            fib_rx,
            move |view| {
                let _ = views.send(TaskEvent::Input(Input::KernelView(view)));
            },
            fib_stats.clone(),
        );
        Ok((Self { events, status, fib_stats }, link))
    }

    pub fn set_peers(&self, peers: Vec<PeerConfig>) {
        let _ = self.events.send(TaskEvent::Input(Input::SetPeers(peers)));
    }

    pub fn set_prefixes(&self, prefixes: Vec<Originated>) {
        let _ = self.events.send(TaskEvent::Input(Input::SetPrefixes(prefixes)));
    }

    pub fn set_policies(&self, policies: Policies) {
        let _ = self.events.send(TaskEvent::Input(Input::SetPolicies(Box::new(policies))));
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
        if self.events.send(TaskEvent::Shutdown { graceful, done }).is_ok() {
            let _ = tokio::time::timeout(Duration::from_secs(5), wait).await;
        }
    }
}

/// Its presence at start means the previous run advertised our routes and left the kernel's.
fn marker_path(config: &SpeakerConfig) -> Option<PathBuf> {
    config.state_dir.as_ref().map(|d| d.join("bgp-graceful-restart"))
}
