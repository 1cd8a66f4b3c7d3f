//! What the speaker reports: per-peer session and prefix counts, the Loc-RIB, counters.
use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr},
    sync::Arc,
};

use crate::{
    routing::bgp::{
        fsm::State,
        message::Prefix,
        policy::{OriginKind, Rejection},
    },
    routing::fib::health::FibStats,
};

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
pub(super) const STATUS_ROUTES_MAX: usize = 10_000;

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
