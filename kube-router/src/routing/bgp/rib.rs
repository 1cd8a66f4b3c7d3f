//! Adj-RIB-In per peer, Loc-RIB with RFC 4271 §9.1 best-path selection, and
//! Adj-RIB-Out per peer with iBGP split horizon / RFC 4456 route reflection.
//!
//! Size (about 860 lines before its tests): selection, the Adj-RIBs and their re-evaluation on
//! policy or kernel changes share the per-prefix state; kept in one file.
//!
//! The Adj-RIB-In is pre-policy: every path a peer sent is kept, with the import policy's
//! verdict ([`super::policy`]); refused paths, and paths whose next hop does not resolve
//! (RFC 4271 §9.1.2.1, against the kernel's own routes), never take part in selection. When the
//! policy or the kernel's routes change, every path is judged again.
//!
//! Every mutation returns the Loc-RIB deltas it caused, which the agent
//! turns into kernel route changes; outbound UPDATEs are computed per peer
//! from those deltas with [`Rib::sync_adj_rib_out`].

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use super::message::{
    as_path_contains, as_path_length, neighbour_as, AsPathSegment, Family, Message, NextHop, PathAttributes, Prefix,
    Update,
};
use super::policy::{ExportPolicy, ImportPolicy, OriginKind, PeerRole, Rejection};
use crate::{routing::fib::resolve::Reachability, routing::overlay::OverlayConfig};

/// RFC 4271 §5.1.5: LOCAL_PREF assumed when absent (common default).
pub const DEFAULT_LOCAL_PREF: u32 = 100;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RibConfig {
    pub local_asn: u32,
    pub router_id: Ipv4Addr,
    /// RFC 4456 cluster id; used when any peer is a route-reflector client.
    pub cluster_id: Ipv4Addr,
}

impl RibConfig {
    pub fn new(local_asn: u32, router_id: Ipv4Addr) -> Self {
        Self { local_asn, router_id, cluster_id: router_id }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerInfo {
    pub address: IpAddr,
    pub asn: u32,
    pub router_id: Ipv4Addr,
    /// We reflect iBGP routes to/from this peer (we are its RR server).
    pub route_reflector_client: bool,
    /// Our own addresses on this session; next hop for what we originate
    /// and for eBGP (next-hop-self).
    pub local_ipv4: Option<Ipv4Addr>,
    pub local_ipv6: Option<Ipv6Addr>,
    /// Families negotiated on the session; nothing else is exported.
    pub families: Vec<Family>,
    /// Another node, or a router outside the cluster: decides import and export.
    pub role: PeerRole,
    /// Default routes from this peer are accepted.
    pub accept_default: bool,
}

impl PeerInfo {
    fn local_next_hop(&self, family: Family) -> Option<NextHop> {
        match family {
            Family::Ipv4Unicast => self.local_ipv4.map(NextHop::V4),
            Family::Ipv6Unicast => self.local_ipv6.map(|global| NextHop::V6 { global, link_local: None }),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RouteSource {
    /// Originated by this node (its pod CIDR, a Service VIP).
    Local(OriginKind),
    Peer(IpAddr),
}

/// One path in an Adj-RIB-In.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub next_hop: NextHop,
    /// Shared by every prefix of the UPDATE that carried them.
    pub attributes: Arc<PathAttributes>,
    /// Retained across a peer's graceful restart and not yet refreshed.
    pub stale: bool,
    /// The import policy's verdict: a refused path is kept (pre-policy Adj-RIB-In) but unused.
    pub rejected: Option<Rejection>,
}

/// The selected path for a prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BestRoute {
    pub source: RouteSource,
    pub next_hop: NextHop,
    pub attributes: Arc<PathAttributes>,
    /// Next hops of other paths as good as this one for multipath (ECMP), sorted; empty when
    /// there is only one.
    pub multipath: Box<[NextHop]>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BestPathChange {
    Added { prefix: Prefix, new: BestRoute },
    Changed { prefix: Prefix, old: BestRoute, new: BestRoute },
    Removed { prefix: Prefix, old: BestRoute },
}

impl BestPathChange {
    pub fn prefix(&self) -> Prefix {
        match self {
            BestPathChange::Added { prefix, .. }
            | BestPathChange::Changed { prefix, .. }
            | BestPathChange::Removed { prefix, .. } => *prefix,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RibError {
    #[error("unknown peer {0}")]
    UnknownPeer(IpAddr),
}

/// A best-path candidate as seen by the selection algorithm.
#[derive(Debug, Clone, Copy)]
pub struct Candidate<'a> {
    pub source: &'a RouteSource,
    pub route: &'a Route,
    /// None for locally originated routes.
    pub peer: Option<&'a PeerInfo>,
}

impl Candidate<'_> {
    fn local_pref(&self) -> u32 {
        self.route.attributes.local_pref.unwrap_or(DEFAULT_LOCAL_PREF)
    }
    fn is_ebgp(&self, local_asn: u32) -> bool {
        self.peer.is_some_and(|p| p.asn != local_asn)
    }
    /// RFC 4456 §9: a reflected route is compared by its ORIGINATOR_ID.
    fn effective_router_id(&self) -> u32 {
        self.route.attributes.originator_id.or(self.peer.map(|p| p.router_id)).map(u32::from).unwrap_or(0)
    }
    /// Equal to `other` in every step of the decision process before the IGP cost (and from the
    /// same neighbouring AS): both may carry traffic for the prefix (multipath).
    fn multipath_equal(&self, other: &Candidate<'_>, local_asn: u32) -> bool {
        let (a, b) = (&self.route.attributes, &other.route.attributes);
        self.local_pref() == other.local_pref()
            && as_path_length(&a.as_path) == as_path_length(&b.as_path)
            && neighbour_as(&a.as_path) == neighbour_as(&b.as_path)
            && a.origin == b.origin
            && a.med.unwrap_or(0) == b.med.unwrap_or(0)
            && self.is_ebgp(local_asn) == other.is_ebgp(local_asn)
    }
}

/// Inserts `n` copies of `asn` at position `at` (0 or 1) of the path's leading sequence.
fn prepend_path(path: &mut Vec<AsPathSegment>, at: usize, asn: u32, n: usize) {
    match path.first_mut() {
        Some(AsPathSegment::Sequence(asns)) if asns.len() + n <= 255 && at <= asns.len() => {
            asns.splice(at..at, std::iter::repeat_n(asn, n));
        }
        _ => path.insert(at.min(path.len()), AsPathSegment::Sequence(vec![asn; n])),
    }
}

fn keep_min<T: Ord + Copy>(set: &mut Vec<Candidate<'_>>, key: impl Fn(&Candidate<'_>) -> T) {
    if let Some(min) = set.iter().map(&key).min() {
        set.retain(|c| key(c) == min);
    }
}

/// RFC 4271 §9.1.2.2 decision process, written as successive elimination
/// over the whole candidate set (pairwise comparison would be wrong because
/// MED is only comparable within one neighbouring AS). Returns the index of
/// the winner in `candidates`.
///
/// Order: locally originated > highest LOCAL_PREF > shortest AS_PATH >
/// lowest ORIGIN > lowest MED per neighbour AS (missing = 0) > eBGP over
/// iBGP > lowest router id (ORIGINATOR_ID if reflected) > shortest
/// CLUSTER_LIST > lowest peer address. IGP cost to the next hop is skipped
/// (there is no IGP here).
pub fn select_best(local_asn: u32, candidates: &[Candidate<'_>]) -> Option<usize> {
    if let Some(i) = candidates.iter().position(|c| c.peer.is_none()) {
        return Some(i);
    }
    let mut set: Vec<Candidate<'_>> = candidates.to_vec();
    keep_min(&mut set, |c| std::cmp::Reverse(c.local_pref()));
    keep_min(&mut set, |c| as_path_length(&c.route.attributes.as_path));
    keep_min(&mut set, |c| c.route.attributes.origin);
    // MED: within each neighbour-AS group drop everything above the group min.
    let snapshot = set.clone();
    set.retain(|c| {
        let group = neighbour_as(&c.route.attributes.as_path);
        let med = c.route.attributes.med.unwrap_or(0);
        snapshot
            .iter()
            .filter(|o| neighbour_as(&o.route.attributes.as_path) == group)
            .all(|o| med <= o.route.attributes.med.unwrap_or(0))
    });
    if set.iter().any(|c| c.is_ebgp(local_asn)) {
        set.retain(|c| c.is_ebgp(local_asn));
    }
    keep_min(&mut set, |c| c.effective_router_id());
    keep_min(&mut set, |c| c.route.attributes.cluster_list.len());
    keep_min(&mut set, |c| c.peer.map(|p| p.address));
    let winner = set.first()?;
    candidates.iter().position(|c| std::ptr::eq(c.route, winner.route))
}

/// How often the import policy refused paths of one peer for one reason, with an example.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RejectionCount {
    pub total: u64,
    pub example: Prefix,
}

#[derive(Debug, Clone)]
struct PeerEntry {
    info: PeerInfo,
    adj_rib_in: BTreeMap<Prefix, Route>,
    /// Paths in `adj_rib_in` the import policy refused.
    rejected: usize,
    /// Paths in `adj_rib_in` kept as stale (graceful restart helper): the status reads it on
    /// every publish, so it is kept, not counted.
    stale: usize,
    /// Prefixes in `adj_rib_in` per family (indexed by [`family_slot`]): the prefix limit
    /// is checked on every UPDATE, so it is kept, not counted.
    received: [usize; 2],
    /// What we last advertised to this peer.
    adj_rib_out: BTreeMap<Prefix, (NextHop, Arc<PathAttributes>)>,
}

impl PeerEntry {
    fn new(info: PeerInfo) -> Self {
        Self {
            info,
            adj_rib_in: BTreeMap::new(),
            rejected: 0,
            stale: 0,
            received: [0; 2],
            adj_rib_out: BTreeMap::new(),
        }
    }

    fn insert(&mut self, prefix: Prefix, route: Route) {
        let (rejected, stale) = (usize::from(route.rejected.is_some()), usize::from(route.stale));
        match self.adj_rib_in.insert(prefix, route) {
            Some(old) => {
                self.rejected -= usize::from(old.rejected.is_some());
                self.stale -= usize::from(old.stale);
            }
            None => self.received[family_slot(prefix.family())] += 1,
        }
        self.rejected += rejected;
        self.stale += stale;
    }

    fn remove(&mut self, prefix: &Prefix) {
        if let Some(old) = self.adj_rib_in.remove(prefix) {
            self.rejected -= usize::from(old.rejected.is_some());
            self.stale -= usize::from(old.stale);
            self.received[family_slot(prefix.family())] -= 1;
        }
    }
}

fn family_slot(family: Family) -> usize {
    match family {
        Family::Ipv4Unicast => 0,
        Family::Ipv6Unicast => 1,
    }
}

#[derive(Debug, Clone)]
pub struct Rib {
    config: RibConfig,
    peers: BTreeMap<IpAddr, PeerEntry>,
    local: BTreeMap<Prefix, (Route, OriginKind)>,
    loc_rib: BTreeMap<Prefix, BestRoute>,
    /// Bumped whenever `loc_rib` changes, so readers can keep a copy until it does.
    loc_rib_version: u64,
    import: ImportPolicy,
    export: ExportPolicy,
    /// The kernel's routes and the node's addresses; None (until the kernel has been read, and
    /// in tests) resolves every next hop and knows no local subnet.
    reach: Option<Reachability>,
    overlay: Option<OverlayConfig>,
    rejections: BTreeMap<(IpAddr, Rejection), RejectionCount>,
}

impl Rib {
    pub fn new(config: RibConfig) -> Self {
        Self {
            config,
            peers: BTreeMap::new(),
            local: BTreeMap::new(),
            loc_rib: BTreeMap::new(),
            loc_rib_version: 0,
            import: ImportPolicy::default(),
            export: ExportPolicy::default(),
            reach: None,
            overlay: None,
            rejections: BTreeMap::new(),
        }
    }

    pub fn config(&self) -> &RibConfig {
        &self.config
    }

    pub fn loc_rib(&self) -> &BTreeMap<Prefix, BestRoute> {
        &self.loc_rib
    }

    /// Changes whenever the Loc-RIB does (equal versions: the same Loc-RIB).
    pub fn loc_rib_version(&self) -> u64 {
        self.loc_rib_version
    }

    pub fn best(&self, prefix: &Prefix) -> Option<&BestRoute> {
        self.loc_rib.get(prefix)
    }

    pub fn adj_rib_in(&self, peer: IpAddr) -> Option<&BTreeMap<Prefix, Route>> {
        self.peers.get(&peer).map(|p| &p.adj_rib_in)
    }

    /// Paths of `peer` the import policy refused (kept in its Adj-RIB-In).
    pub fn rejected_count(&self, peer: IpAddr) -> usize {
        self.peers.get(&peer).map_or(0, |p| p.rejected)
    }

    /// Paths of `peer` the import policy accepted whose next hop does not resolve (kept, unused),
    /// and one of them as an example (prefix, next hop).
    pub fn unresolved(&self, peer: IpAddr) -> (usize, Option<(Prefix, IpAddr)>) {
        let Some(entry) = self.peers.get(&peer) else { return (0, None) };
        let mut example = None;
        let count = entry
            .adj_rib_in
            .iter()
            .filter(|(_, route)| route.rejected.is_none() && !self.usable(&entry.info, route))
            .inspect(|(prefix, route)| {
                example.get_or_insert((**prefix, route.next_hop.addr()));
            })
            .count();
        (count, example)
    }

    /// Every refusal so far, per peer and reason.
    pub fn rejections(&self) -> &BTreeMap<(IpAddr, Rejection), RejectionCount> {
        &self.rejections
    }

    pub fn adj_rib_out(&self, peer: IpAddr) -> Option<&BTreeMap<Prefix, (NextHop, Arc<PathAttributes>)>> {
        self.peers.get(&peer).map(|p| &p.adj_rib_out)
    }

    pub fn peer(&self, peer: IpAddr) -> Option<&PeerInfo> {
        self.peers.get(&peer).map(|p| &p.info)
    }

    /// Peers whose usable path for `prefix` has `next_hop` (to find where a multipath next hop
    /// came from).
    pub fn peers_with_path<'a>(
        &'a self,
        prefix: &'a Prefix,
        next_hop: &'a NextHop,
    ) -> impl Iterator<Item = IpAddr> + 'a {
        self.peers.iter().filter_map(move |(addr, entry)| {
            let route = entry.adj_rib_in.get(prefix)?;
            (route.next_hop == *next_hop && self.usable(&entry.info, route)).then_some(*addr)
        })
    }

    pub fn reachability(&self) -> Option<&Reachability> {
        self.reach.as_ref()
    }

    pub fn overlay(&self) -> Option<&OverlayConfig> {
        self.overlay.as_ref()
    }

    /// New import policy: every stored path is judged again.
    pub fn set_import_policy(&mut self, import: ImportPolicy) -> Vec<BestPathChange> {
        if self.import == import {
            return Vec::new();
        }
        self.import = import;
        self.rejudge_all()
    }

    /// The kernel's routes or the node's addresses changed: next hops resolve differently and
    /// the node's own subnets may have changed.
    pub fn set_reachability(&mut self, reach: Reachability) -> Vec<BestPathChange> {
        if self.reach.as_ref() == Some(&reach) {
            return Vec::new();
        }
        self.reach = Some(reach);
        self.rejudge_all()
    }

    pub fn set_overlay(&mut self, overlay: Option<OverlayConfig>) -> Vec<BestPathChange> {
        if self.overlay == overlay {
            return Vec::new();
        }
        self.overlay = overlay;
        self.rejudge_all()
    }

    /// New export policy; the caller re-syncs every peer's Adj-RIB-Out.
    pub fn set_export_policy(&mut self, export: ExportPolicy) -> bool {
        let changed = self.export != export;
        self.export = export;
        changed
    }

    fn rejudge_all(&mut self) -> Vec<BestPathChange> {
        let mut touched: Vec<Prefix> = self.loc_rib.keys().copied().collect();
        for entry in self.peers.values_mut() {
            let mut rejected = 0;
            for (prefix, route) in entry.adj_rib_in.iter_mut() {
                route.rejected =
                    self.import.check(entry.info.accept_default, prefix, &route.next_hop, self.reach.as_ref());
                rejected += usize::from(route.rejected.is_some());
            }
            entry.rejected = rejected;
            touched.extend(entry.adj_rib_in.keys().copied());
        }
        self.recompute(touched)
    }

    /// Register a peer or refresh its session parameters (router id and
    /// families change per session). Existing Adj-RIB-In entries are kept,
    /// which is what graceful-restart helpers need.
    pub fn upsert_peer(&mut self, info: PeerInfo) -> Vec<BestPathChange> {
        let address = info.address;
        let prefixes: Vec<Prefix> = match self.peers.get_mut(&address) {
            Some(entry) => {
                let rejudge = entry.info.accept_default != info.accept_default;
                entry.info = info;
                if rejudge {
                    let mut rejected = 0;
                    for (prefix, route) in entry.adj_rib_in.iter_mut() {
                        route.rejected =
                            self.import.check(entry.info.accept_default, prefix, &route.next_hop, self.reach.as_ref());
                        rejected += usize::from(route.rejected.is_some());
                    }
                    entry.rejected = rejected;
                }
                entry.adj_rib_in.keys().copied().collect()
            }
            None => {
                self.peers.insert(address, PeerEntry::new(info));
                Vec::new()
            }
        };
        self.recompute(prefixes)
    }

    /// Forget a peer and all of its routes (session down without GR, or
    /// peer deconfigured).
    pub fn remove_peer(&mut self, peer: IpAddr) -> Vec<BestPathChange> {
        let Some(entry) = self.peers.remove(&peer) else {
            return Vec::new();
        };
        self.recompute(entry.adj_rib_in.into_keys().collect())
    }

    /// Drop every route of `peer` in `families` but keep the peer.
    pub fn clear_peer_routes(&mut self, peer: IpAddr, families: &[Family]) -> Vec<BestPathChange> {
        self.remove_routes_where(peer, |p, _| families.contains(&p.family()))
    }

    /// RFC 4724 helper: keep the routes but flag them stale.
    pub fn mark_stale(&mut self, peer: IpAddr, families: &[Family]) {
        if let Some(entry) = self.peers.get_mut(&peer) {
            let mut stale = 0;
            for (prefix, route) in entry.adj_rib_in.iter_mut() {
                if families.contains(&prefix.family()) {
                    route.stale = true;
                }
                stale += usize::from(route.stale);
            }
            entry.stale = stale;
        }
    }

    /// Delete the still-stale routes of `peer` in `families`.
    pub fn purge_stale(&mut self, peer: IpAddr, families: &[Family]) -> Vec<BestPathChange> {
        self.remove_routes_where(peer, |p, r| r.stale && families.contains(&p.family()))
    }

    pub fn stale_count(&self, peer: IpAddr) -> usize {
        self.peers.get(&peer).map_or(0, |e| e.stale)
    }

    fn remove_routes_where(&mut self, peer: IpAddr, pred: impl Fn(&Prefix, &Route) -> bool) -> Vec<BestPathChange> {
        let Some(entry) = self.peers.get_mut(&peer) else {
            return Vec::new();
        };
        let doomed: Vec<Prefix> = entry.adj_rib_in.iter().filter(|(p, r)| pred(p, r)).map(|(p, _)| *p).collect();
        for p in &doomed {
            entry.remove(p);
        }
        self.recompute(doomed)
    }

    /// Prefixes of `family` in the peer's Adj-RIB-In (everything received, before the import
    /// policy: the limit protects memory, and refused paths are kept too).
    pub fn received_count(&self, peer: IpAddr, family: Family) -> usize {
        self.peers.get(&peer).map_or(0, |e| e.received[family_slot(family)])
    }

    /// The first family whose prefixes from `peer` would number more than `limit` once
    /// `update` is applied (RFC 4486), with that number; the RIB is not changed. Announcements
    /// that fail the loop checks are withdrawals here as in [`Self::apply_update`].
    pub fn prefix_limit_exceeded(&self, peer: IpAddr, update: &Update, limit: u32) -> Option<(Family, usize)> {
        let entry = self.peers.get(&peer)?;
        let accept = self.loop_free(&entry.info, &update.attributes);
        // Whether each touched prefix is present afterwards (the last mention wins).
        let mut after: BTreeMap<Prefix, bool> = BTreeMap::new();
        for prefix in &update.withdrawn {
            after.insert(*prefix, false);
        }
        for (prefix, _) in &update.announced {
            after.insert(*prefix, accept);
        }
        let mut counts = entry.received.map(|n| n as i64);
        for (prefix, present) in after {
            counts[family_slot(prefix.family())] +=
                i64::from(present) - i64::from(entry.adj_rib_in.contains_key(&prefix));
        }
        Family::ALL.into_iter().map(|f| (f, counts[family_slot(f)].max(0) as usize)).find(|(_, n)| *n > limit as usize)
    }

    /// Apply an UPDATE received from `peer`. Announcements that fail the loop
    /// checks (AS loop, RR loop) act as implicit withdrawals; those the import
    /// policy refuses are kept, marked, and unused.
    pub fn apply_update(&mut self, peer: IpAddr, update: &Update) -> Result<Vec<BestPathChange>, RibError> {
        let accept = {
            let entry = self.peers.get(&peer).ok_or(RibError::UnknownPeer(peer))?;
            self.loop_free(&entry.info, &update.attributes)
        };
        let entry = self.peers.get_mut(&peer).ok_or(RibError::UnknownPeer(peer))?;
        let mut touched = Vec::with_capacity(update.withdrawn.len() + update.announced.len());
        for prefix in &update.withdrawn {
            entry.remove(prefix);
            touched.push(*prefix);
        }
        let attributes = Arc::new(update.attributes.clone());
        for (prefix, next_hop) in &update.announced {
            if accept {
                let rejected = self.import.check(entry.info.accept_default, prefix, next_hop, self.reach.as_ref());
                if let Some(reason) = rejected {
                    self.rejections
                        .entry((peer, reason))
                        .or_insert(RejectionCount { total: 0, example: *prefix })
                        .total += 1;
                }
                // Re-announcing an unchanged path keeps the attributes it already shares.
                let attributes = match entry.adj_rib_in.get(prefix) {
                    Some(old) if old.attributes == attributes => old.attributes.clone(),
                    _ => attributes.clone(),
                };
                entry.insert(*prefix, Route { next_hop: *next_hop, attributes, stale: false, rejected });
            } else {
                entry.remove(prefix);
            }
            touched.push(*prefix);
        }
        Ok(self.recompute(touched))
    }

    fn loop_free(&self, from: &PeerInfo, attrs: &PathAttributes) -> bool {
        let ebgp = from.asn != self.config.local_asn;
        // RFC 4271 §9.1.2: our own AS in the path is a loop.
        if ebgp && as_path_contains(&attrs.as_path, self.config.local_asn) {
            return false;
        }
        // RFC 4456 §8: reflected back to us.
        if attrs.originator_id == Some(self.config.router_id) || attrs.cluster_list.contains(&self.config.cluster_id) {
            return false;
        }
        true
    }

    /// Originate (or replace) a local route, e.g. this node's pod CIDR.
    pub fn originate(
        &mut self,
        prefix: Prefix,
        next_hop: NextHop,
        attributes: PathAttributes,
        kind: OriginKind,
    ) -> Vec<BestPathChange> {
        let route = Route { next_hop, attributes: Arc::new(attributes), stale: false, rejected: None };
        self.local.insert(prefix, (route, kind));
        self.recompute(vec![prefix])
    }

    pub fn withdraw_originated(&mut self, prefix: Prefix) -> Vec<BestPathChange> {
        self.local.remove(&prefix);
        self.recompute(vec![prefix])
    }

    fn recompute(&mut self, mut prefixes: Vec<Prefix>) -> Vec<BestPathChange> {
        prefixes.sort();
        prefixes.dedup();
        let sources: Vec<RouteSource> = self.peers.keys().map(|a| RouteSource::Peer(*a)).collect();
        let mut changes = Vec::new();
        for prefix in prefixes {
            let new = self.compute_best(&prefix, &sources);
            let old = self.loc_rib.get(&prefix);
            let change = match (old, new) {
                (None, None) => None,
                (None, Some(new)) => Some(BestPathChange::Added { prefix, new }),
                (Some(old), None) => Some(BestPathChange::Removed { prefix, old: old.clone() }),
                (Some(old), Some(new)) if *old != new => {
                    Some(BestPathChange::Changed { prefix, old: old.clone(), new })
                }
                (Some(_), Some(_)) => None,
            };
            if let Some(change) = change {
                match &change {
                    BestPathChange::Removed { .. } => {
                        self.loc_rib.remove(&prefix);
                    }
                    BestPathChange::Added { new, .. } | BestPathChange::Changed { new, .. } => {
                        self.loc_rib.insert(prefix, new.clone());
                    }
                }
                changes.push(change);
            }
        }
        if !changes.is_empty() {
            self.loc_rib_version += 1;
        }
        changes
    }

    /// A peer's path may compete: the policy accepted it and its next hop resolves.
    fn usable(&self, peer: &PeerInfo, route: &Route) -> bool {
        route.rejected.is_none()
            && self
                .reach
                .as_ref()
                .is_none_or(|reach| next_hop_resolvable(self.overlay.as_ref(), peer.role, route.next_hop.addr(), reach))
    }

    fn compute_best(&self, prefix: &Prefix, sources: &[RouteSource]) -> Option<BestRoute> {
        let local_source;
        let mut candidates = Vec::new();
        if let Some((route, kind)) = self.local.get(prefix) {
            local_source = RouteSource::Local(*kind);
            candidates.push(Candidate { source: &local_source, route, peer: None });
        }
        for (entry, source) in self.peers.values().zip(sources) {
            if let Some(route) = entry.adj_rib_in.get(prefix) {
                if self.usable(&entry.info, route) {
                    candidates.push(Candidate { source, route, peer: Some(&entry.info) });
                }
            }
        }
        let winner = candidates.get(select_best(self.config.local_asn, &candidates)?)?;
        let mut multipath: Vec<NextHop> = match winner.peer {
            None => Vec::new(),
            Some(_) => candidates
                .iter()
                .filter(|c| c.peer.is_some() && !std::ptr::eq(c.route, winner.route))
                .filter(|c| c.multipath_equal(winner, self.config.local_asn))
                .map(|c| c.route.next_hop)
                .filter(|nh| *nh != winner.route.next_hop)
                .collect(),
        };
        multipath.sort();
        multipath.dedup();
        Some(BestRoute {
            source: winner.source.clone(),
            next_hop: winner.route.next_hop,
            attributes: winner.route.attributes.clone(),
            multipath: multipath.into_boxed_slice(),
        })
    }

    /// What we would advertise to `target` for `best`, or None if export
    /// rules forbid it (policy, split horizon, family not negotiated, no next hop).
    fn export(&self, target: &PeerInfo, prefix: &Prefix, best: &BestRoute) -> Option<(NextHop, PathAttributes)> {
        let family = prefix.family();
        if !target.families.contains(&family) {
            return None;
        }
        let local_asn = self.config.local_asn;
        let target_ibgp = target.asn == local_asn;
        let source_peer = match &best.source {
            RouteSource::Local(kind) => {
                if !self.export.exports_local(*kind, target.role) {
                    return None;
                }
                None
            }
            RouteSource::Peer(addr) => {
                if *addr == target.address {
                    return None; // never send a route back to where it came from
                }
                let source = &self.peers.get(addr)?.info;
                // Learned routes travel only between nodes, and only by reflection: never
                // to or from outside the cluster (the node is no transit AS).
                if source.role == PeerRole::External || target.role == PeerRole::External {
                    return None;
                }
                Some(source)
            }
        };
        let source_ibgp = source_peer.is_some_and(|p| p.asn == local_asn);
        let reflecting = target_ibgp && source_ibgp;
        if source_peer.is_some() && !reflecting {
            return None;
        }
        if reflecting {
            // RFC 4456 §6: from a client -> everyone; from a non-client ->
            // clients only. Without RR involvement: iBGP split horizon.
            let source_client = source_peer.is_some_and(|p| p.route_reflector_client);
            if !source_client && !target.route_reflector_client {
                return None;
            }
        }

        let mut attrs = (*best.attributes).clone();
        let external = target.role == PeerRole::External;
        // Our own routes: node peers get the session's address (they reach us over it);
        // external peers the node IP, or with --override-nexthop the session's address.
        let own_next_hop = || match (external, self.export.override_next_hop) {
            (true, false) => Some(best.next_hop),
            _ => target.local_next_hop(family).or(Some(best.next_hop)),
        };
        let next_hop;
        if target_ibgp {
            attrs.local_pref = Some(attrs.local_pref.unwrap_or(DEFAULT_LOCAL_PREF));
            next_hop = match source_peer {
                None => own_next_hop()?,
                Some(_) => best.next_hop,
            };
            if let (true, Some(src)) = (reflecting, source_peer) {
                attrs.originator_id.get_or_insert(src.router_id);
                attrs.cluster_list.insert(0, self.config.cluster_id);
            }
        } else {
            attrs.local_pref = None;
            attrs.originator_id = None;
            attrs.cluster_list.clear();
            match attrs.as_path.first_mut() {
                Some(AsPathSegment::Sequence(asns)) if asns.len() < 255 => asns.insert(0, local_asn),
                _ => attrs.as_path.insert(0, AsPathSegment::Sequence(vec![local_asn])),
            }
            next_hop = own_next_hop()?;
        }
        if external {
            if let Some(prepend) = self.export.prepend {
                // After our own AS on eBGP (the peer checks that it comes first), first on iBGP.
                prepend_path(&mut attrs.as_path, usize::from(!target_ibgp), prepend.asn, usize::from(prepend.repeat));
            }
            for community in &self.export.communities {
                if !attrs.communities.contains(community) {
                    attrs.communities.push(*community);
                }
            }
        }
        Some((next_hop, attrs))
    }

    /// Bring `peer`'s Adj-RIB-Out in line with the Loc-RIB for `prefixes`
    /// (or all known prefixes if None) and return the UPDATEs to send.
    /// Announcements sharing attributes are batched into one `Update`.
    pub fn sync_adj_rib_out(&mut self, peer: IpAddr, prefixes: Option<&[Prefix]>) -> Vec<Update> {
        let Some(entry) = self.peers.get(&peer) else {
            return Vec::new();
        };
        let scope: Vec<Prefix> = match prefixes {
            Some(p) => p.to_vec(),
            None => {
                let mut all: Vec<Prefix> = self.loc_rib.keys().copied().collect();
                all.extend(entry.adj_rib_out.keys().copied());
                all.sort();
                all.dedup();
                all
            }
        };
        let mut withdrawn = Vec::new();
        let mut desired_changes: Vec<(Prefix, NextHop, PathAttributes)> = Vec::new();
        for prefix in scope {
            let desired = self.loc_rib.get(&prefix).and_then(|best| self.export(&entry.info, &prefix, best));
            let current = entry.adj_rib_out.get(&prefix);
            match (current, desired) {
                (Some(_), None) => withdrawn.push(prefix),
                (cur, Some((nh, attrs))) if cur.is_none_or(|(c_nh, c_attrs)| *c_nh != nh || **c_attrs != attrs) => {
                    desired_changes.push((prefix, nh, attrs))
                }
                _ => {}
            }
        }
        let Some(entry) = self.peers.get_mut(&peer) else {
            return Vec::new();
        };
        let mut updates = Vec::new();
        if !withdrawn.is_empty() {
            for p in &withdrawn {
                entry.adj_rib_out.remove(p);
            }
            updates.push(Update { withdrawn, ..Update::default() });
        }
        let mut batches: Vec<(Arc<PathAttributes>, Update)> = Vec::new();
        for (prefix, nh, attrs) in desired_changes {
            let shared = match batches.iter_mut().find(|(a, _)| **a == attrs) {
                Some((shared, update)) => {
                    update.announced.push((prefix, nh));
                    shared.clone()
                }
                None => {
                    let shared = Arc::new(attrs.clone());
                    batches.push((
                        shared.clone(),
                        Update { withdrawn: vec![], announced: vec![(prefix, nh)], attributes: attrs },
                    ));
                    shared
                }
            };
            entry.adj_rib_out.insert(prefix, (nh, shared));
        }
        updates.extend(batches.into_iter().map(|(_, u)| u));
        updates
    }

    /// Full table for a freshly established session followed by End-of-RIB
    /// for each negotiated family (RFC 4724 §2: send EoR after the initial
    /// update, whether or not we restarted).
    pub fn initial_advertisement(&mut self, peer: IpAddr) -> Vec<Message> {
        let Some(entry) = self.peers.get_mut(&peer) else {
            return Vec::new();
        };
        entry.adj_rib_out.clear();
        let families = entry.info.families.clone();
        let mut msgs: Vec<Message> = self.sync_adj_rib_out(peer, None).into_iter().map(Message::Update).collect();
        msgs.extend(families.into_iter().map(Message::end_of_rib));
        msgs
    }
}

/// Whether a route learned from a peer of `role` is usable (RFC 4271 §9.1.2.1): through a
/// tunnel when the overlay takes it (the tunnel endpoint must be reachable, by any route),
/// otherwise its next hop must resolve without the default route.
pub fn next_hop_resolvable(
    overlay: Option<&OverlayConfig>,
    role: PeerRole,
    next_hop: IpAddr,
    reach: &Reachability,
) -> bool {
    match overlay {
        Some(o) if o.tunnels(role == PeerRole::Node, next_hop, || reach.on_link(next_hop)) => {
            reach.resolve_underlay(next_hop).is_some()
        }
        _ => reach.resolve(next_hop).is_some(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::bgp::message::Origin;
    use crate::routing::bgp::policy::ImportPolicy;
    use proptest::prelude::*;

    const LOCAL_ASN: u32 = 64512;
    const POD: OriginKind = OriginKind::PodCidr;

    /// Next hops of the candidates as good as `winner` for multipath (the model's view).
    fn multipath_of(local_asn: u32, cands: &[Candidate<'_>], winner: &Candidate<'_>) -> Box<[NextHop]> {
        let mut hops: Vec<NextHop> = cands
            .iter()
            .filter(|c| !std::ptr::eq(c.route, winner.route) && c.multipath_equal(winner, local_asn))
            .map(|c| c.route.next_hop)
            .filter(|nh| *nh != winner.route.next_hop)
            .collect();
        hops.sort();
        hops.dedup();
        hops.into_boxed_slice()
    }

    fn pfx(s: &str) -> Prefix {
        s.parse().unwrap()
    }

    fn peer(last: u8, asn: u32) -> PeerInfo {
        PeerInfo {
            address: IpAddr::V4(Ipv4Addr::new(192, 168, 0, last)),
            asn,
            router_id: Ipv4Addr::new(10, 0, 0, last),
            route_reflector_client: false,
            local_ipv4: Some(Ipv4Addr::new(192, 168, 0, 1)),
            local_ipv6: Some("fd00::1".parse().unwrap()),
            families: vec![Family::Ipv4Unicast, Family::Ipv6Unicast],
            role: if asn == LOCAL_ASN { PeerRole::Node } else { PeerRole::External },
            accept_default: false,
        }
    }

    fn rib_with(peers: &[PeerInfo]) -> Rib {
        let mut rib = Rib::new(RibConfig::new(LOCAL_ASN, Ipv4Addr::new(10, 0, 0, 1)));
        for p in peers {
            rib.upsert_peer(p.clone());
        }
        rib
    }

    fn attrs(path: &[u32]) -> PathAttributes {
        PathAttributes {
            as_path: if path.is_empty() { vec![] } else { vec![AsPathSegment::Sequence(path.to_vec())] },
            ..PathAttributes::default()
        }
    }

    fn announce(prefix: Prefix, nh: Ipv4Addr, attributes: PathAttributes) -> Update {
        Update { withdrawn: vec![], announced: vec![(prefix, NextHop::V4(nh))], attributes }
    }

    fn nh(last: u8) -> Ipv4Addr {
        Ipv4Addr::new(172, 16, 0, last)
    }

    /// Announce the same prefix from two peers with the given attributes;
    /// return the winning peer address.
    fn winner(a: (PeerInfo, PathAttributes), b: (PeerInfo, PathAttributes)) -> IpAddr {
        let prefix = pfx("10.10.0.0/24");
        let mut rib = rib_with(&[a.0.clone(), b.0.clone()]);
        rib.apply_update(a.0.address, &announce(prefix, nh(1), a.1)).unwrap();
        rib.apply_update(b.0.address, &announce(prefix, nh(2), b.1)).unwrap();
        match &rib.best(&prefix).unwrap().source {
            RouteSource::Peer(addr) => *addr,
            RouteSource::Local(_) => panic!("local"),
        }
    }

    #[test]
    fn prefix_limit_counts_per_family_what_the_update_would_leave() {
        let tor = peer(2, 65002);
        let mut rib = rib_with(std::slice::from_ref(&tor));
        let v4 = |i: u8| pfx(&format!("10.1.{i}.0/24"));
        let batch = |range: std::ops::Range<u8>| Update {
            withdrawn: vec![],
            announced: range.map(|i| (v4(i), NextHop::V4(nh(1)))).collect(),
            attributes: attrs(&[65002]),
        };
        // 3 prefixes against a limit of 3: allowed; a 4th new one is not.
        assert_eq!(rib.prefix_limit_exceeded(tor.address, &batch(0..3), 3), None);
        rib.apply_update(tor.address, &batch(0..3)).unwrap();
        assert_eq!(rib.received_count(tor.address, Family::Ipv4Unicast), 3);
        assert_eq!(rib.prefix_limit_exceeded(tor.address, &batch(3..4), 3), Some((Family::Ipv4Unicast, 4)));
        // Re-announcing known prefixes (and repeats inside one UPDATE) adds nothing.
        let mut repeat = batch(0..3);
        repeat.announced.extend(batch(0..3).announced);
        assert_eq!(rib.prefix_limit_exceeded(tor.address, &repeat, 3), None);
        // A withdrawal in the same UPDATE makes room.
        let mut swap = batch(3..4);
        swap.withdrawn.push(v4(0));
        assert_eq!(rib.prefix_limit_exceeded(tor.address, &swap, 3), None);
        // Announcements that fail the loop check are withdrawals and free room too.
        let mut looped = batch(0..2);
        looped.attributes = attrs(&[65002, LOCAL_ASN]);
        assert_eq!(rib.prefix_limit_exceeded(tor.address, &looped, 1), None, "3 - 2 looped = 1");
        // The other family has its own count: 3 IPv6 prefixes do not trip a limit of 3.
        let v6 = Update {
            withdrawn: vec![],
            announced: (0..3u8)
                .map(|i| {
                    let global = format!("fd00:{i}::1").parse().unwrap();
                    (pfx(&format!("fd10:{i}::/64")), NextHop::V6 { global, link_local: None })
                })
                .collect(),
            attributes: attrs(&[65002]),
        };
        assert_eq!(rib.prefix_limit_exceeded(tor.address, &v6, 3), None);
        rib.apply_update(tor.address, &v6).unwrap();
        assert_eq!(rib.received_count(tor.address, Family::Ipv6Unicast), 3);
        // Prefixes the import policy refuses are counted: they are kept in the Adj-RIB-In.
        let default = announce(pfx("0.0.0.0/0"), nh(1), attrs(&[65002]));
        assert_eq!(rib.prefix_limit_exceeded(tor.address, &default, 3), Some((Family::Ipv4Unicast, 4)));
        rib.apply_update(tor.address, &default).unwrap();
        assert_eq!(rib.rejected_count(tor.address), 1);
        assert_eq!(rib.received_count(tor.address, Family::Ipv4Unicast), 4);
        // Withdrawals and session loss keep the count exact.
        let withdraw = Update { withdrawn: vec![v4(0), v4(0), pfx("10.99.0.0/24")], ..Update::default() };
        rib.apply_update(tor.address, &withdraw).unwrap();
        assert_eq!(rib.received_count(tor.address, Family::Ipv4Unicast), 3);
        rib.clear_peer_routes(tor.address, &[Family::Ipv4Unicast]);
        assert_eq!(rib.received_count(tor.address, Family::Ipv4Unicast), 0);
        assert_eq!(rib.received_count(tor.address, Family::Ipv6Unicast), 3);
        assert_eq!(rib.prefix_limit_exceeded("192.0.2.1".parse().unwrap(), &batch(0..9), 1), None, "unknown peer");
    }

    #[test]
    fn best_path_tie_breaks_in_order() {
        let (p2, p3) = (peer(2, 65002), peer(3, 65003));
        // 1. local pref beats a shorter path.
        let mut hi = attrs(&[65002, 1, 2]);
        hi.local_pref = Some(200);
        assert_eq!(winner((p2.clone(), hi), (p3.clone(), attrs(&[65003]))), p2.address);
        // 2. shorter AS path.
        assert_eq!(winner((p2.clone(), attrs(&[65002, 9])), (p3.clone(), attrs(&[65003]))), p3.address);
        // 3. lower origin.
        let mut incomplete = attrs(&[65002]);
        incomplete.origin = Origin::Incomplete;
        let mut egp = attrs(&[65003]);
        egp.origin = Origin::Egp;
        assert_eq!(winner((p2.clone(), incomplete), (p3.clone(), egp)), p3.address);
        // 4. lower MED, same neighbour AS (both peers in AS 65002).
        let p3_same_as = peer(3, 65002);
        let mut med_hi = attrs(&[65002]);
        med_hi.med = Some(50);
        let mut med_lo = attrs(&[65002]);
        med_lo.med = Some(10);
        assert_eq!(winner((p2.clone(), med_hi.clone()), (p3_same_as.clone(), med_lo.clone())), p3_same_as.address);
        // ... but MED is ignored across different neighbour ASes: falls
        // through to router id (p2 lower).
        let mut other_as_lo = attrs(&[65003]);
        other_as_lo.med = Some(10);
        assert_eq!(winner((p2.clone(), med_hi), (p3.clone(), other_as_lo)), p2.address);
        // 5. eBGP over iBGP.
        let ibgp = peer(2, LOCAL_ASN);
        assert_eq!(winner((ibgp, attrs(&[65003])), (p3.clone(), attrs(&[65003]))), p3.address);
        // 6. lowest router id.
        let mut p9 = peer(9, 65009);
        p9.router_id = Ipv4Addr::new(1, 1, 1, 1);
        assert_eq!(winner((p2.clone(), attrs(&[1])), (p9.clone(), attrs(&[1]))), p9.address);
        // 7. lowest peer address when router ids are equal.
        let mut p4 = peer(4, 65004);
        p4.router_id = p2.router_id;
        assert_eq!(winner((p4, attrs(&[1])), (p2.clone(), attrs(&[1]))), p2.address);
    }

    #[test]
    fn med_elimination_is_group_wise_not_pairwise() {
        // Classic MED non-transitivity: A(AS1, med 10), B(AS1, med 5),
        // C(AS2, med 0). B eliminates A; then router id picks among B, C.
        let prefix = pfx("10.0.0.0/8");
        let a = peer(2, 65001);
        let b = peer(3, 65001);
        let c = peer(4, 65002);
        let mut rib = rib_with(&[a.clone(), b.clone(), c.clone()]);
        let with_med = |asn, med| {
            let mut x = attrs(&[asn]);
            x.med = Some(med);
            x
        };
        rib.apply_update(a.address, &announce(prefix, nh(1), with_med(65001, 10))).unwrap();
        rib.apply_update(b.address, &announce(prefix, nh(2), with_med(65001, 5))).unwrap();
        rib.apply_update(c.address, &announce(prefix, nh(3), with_med(65002, 0))).unwrap();
        assert_eq!(rib.best(&prefix).unwrap().source, RouteSource::Peer(b.address));
    }

    #[test]
    fn deltas_report_added_changed_removed() {
        let (p2, p3) = (peer(2, 65002), peer(3, 65003));
        let prefix = pfx("10.1.0.0/16");
        let mut rib = rib_with(&[p2.clone(), p3.clone()]);
        let d = rib.apply_update(p2.address, &announce(prefix, nh(2), attrs(&[65002, 1]))).unwrap();
        assert!(matches!(d.as_slice(), [BestPathChange::Added { .. }]));
        let d = rib.apply_update(p3.address, &announce(prefix, nh(3), attrs(&[65003]))).unwrap();
        assert!(
            matches!(d.as_slice(), [BestPathChange::Changed { new, .. }] if new.source == RouteSource::Peer(p3.address))
        );
        // Re-announcing the losing path unchanged: no delta.
        let d = rib.apply_update(p2.address, &announce(prefix, nh(2), attrs(&[65002, 1]))).unwrap();
        assert!(d.is_empty());
        let d = rib.remove_peer(p3.address);
        assert!(
            matches!(d.as_slice(), [BestPathChange::Changed { new, .. }] if new.source == RouteSource::Peer(p2.address))
        );
        let withdraw = Update { withdrawn: vec![prefix], ..Update::default() };
        let d = rib.apply_update(p2.address, &withdraw).unwrap();
        assert!(matches!(d.as_slice(), [BestPathChange::Removed { .. }]));
        assert!(rib.loc_rib().is_empty());
        assert_eq!(
            rib.apply_update(IpAddr::V4(Ipv4Addr::LOCALHOST), &withdraw),
            Err(RibError::UnknownPeer(IpAddr::V4(Ipv4Addr::LOCALHOST)))
        );
    }

    #[test]
    fn as_loop_is_rejected_as_implicit_withdraw() {
        let p2 = peer(2, 65002);
        let prefix = pfx("10.2.0.0/16");
        let mut rib = rib_with(std::slice::from_ref(&p2));
        rib.apply_update(p2.address, &announce(prefix, nh(2), attrs(&[65002]))).unwrap();
        let d = rib.apply_update(p2.address, &announce(prefix, nh(2), attrs(&[65002, LOCAL_ASN]))).unwrap();
        assert!(matches!(d.as_slice(), [BestPathChange::Removed { .. }]));
    }

    #[test]
    fn ibgp_split_horizon_and_route_reflection() {
        let ibgp_a = peer(2, LOCAL_ASN);
        let ibgp_b = peer(3, LOCAL_ASN);
        let ebgp = peer(4, 65004);
        let prefix = pfx("10.3.0.0/24");
        let mut rib = rib_with(&[ibgp_a.clone(), ibgp_b.clone(), ebgp.clone()]);
        rib.apply_update(ibgp_a.address, &announce(prefix, nh(2), attrs(&[]))).unwrap();
        // Not reflected to the other iBGP peer, not echoed to the source...
        assert!(rib.sync_adj_rib_out(ibgp_b.address, None).is_empty());
        assert!(rib.sync_adj_rib_out(ibgp_a.address, None).is_empty());
        // ...and never to an external peer: the node is no transit AS.
        assert!(rib.sync_adj_rib_out(ebgp.address, None).is_empty());

        // Make B a route-reflector client: now the route is reflected.
        let mut client_b = ibgp_b.clone();
        client_b.route_reflector_client = true;
        rib.upsert_peer(client_b);
        let out = rib.sync_adj_rib_out(ibgp_b.address, None);
        assert_eq!(out.len(), 1);
        let a = &out[0].attributes;
        assert_eq!(a.originator_id, Some(ibgp_a.router_id));
        assert_eq!(a.cluster_list, vec![rib.config().cluster_id]);
        assert_eq!(a.local_pref, Some(DEFAULT_LOCAL_PREF));
        assert_eq!(out[0].announced[0].1, NextHop::V4(nh(2)), "next hop unchanged on iBGP");

        // A route from a client is reflected to non-clients too.
        let prefix2 = pfx("10.4.0.0/24");
        rib.apply_update(ibgp_b.address, &announce(prefix2, nh(3), attrs(&[]))).unwrap();
        let out = rib.sync_adj_rib_out(ibgp_a.address, Some(&[prefix2]));
        assert_eq!(out.len(), 1);

        // Withdrawal propagates as a withdraw to peers that had it.
        let d = rib.apply_update(ibgp_a.address, &Update { withdrawn: vec![prefix], ..Update::default() }).unwrap();
        let prefixes: Vec<Prefix> = d.iter().map(|c| c.prefix()).collect();
        let out = rib.sync_adj_rib_out(ibgp_b.address, Some(&prefixes));
        assert_eq!(out, vec![Update { withdrawn: vec![prefix], ..Update::default() }]);
    }

    #[test]
    fn reflected_route_coming_back_is_rejected() {
        let ibgp = peer(2, LOCAL_ASN);
        let mut rib = rib_with(std::slice::from_ref(&ibgp));
        let mut a = attrs(&[]);
        a.cluster_list = vec![rib.config().cluster_id];
        let d = rib.apply_update(ibgp.address, &announce(pfx("10.5.0.0/24"), nh(2), a)).unwrap();
        assert!(d.is_empty());
    }

    #[test]
    fn local_routes_win_and_are_advertised_with_eor() {
        let ebgp = peer(4, 65004);
        let mut ebgp_v4_only = ebgp.clone();
        ebgp_v4_only.families = vec![Family::Ipv4Unicast];
        let mut rib = rib_with(&[ebgp_v4_only]);
        let v4 = pfx("10.244.1.0/24");
        let v6 = pfx("fd00:244:1::/64");
        rib.apply_update(ebgp.address, &announce(v4, nh(4), attrs(&[65004]))).unwrap();
        let d = rib.originate(v4, NextHop::V4(Ipv4Addr::new(192, 168, 0, 1)), PathAttributes::default(), POD);
        assert!(matches!(d.as_slice(), [BestPathChange::Changed { new, .. }] if new.source == RouteSource::Local(POD)));
        rib.originate(
            v6,
            NextHop::V6 { global: "fd00::1".parse().unwrap(), link_local: None },
            PathAttributes::default(),
            POD,
        );
        let msgs = rib.initial_advertisement(ebgp.address);
        // v4 local route announced (v6 family not negotiated), then EoR.
        assert_eq!(msgs.len(), 2, "{msgs:?}");
        let Message::Update(u) = &msgs[0] else { panic!() };
        assert_eq!(u.announced[0].0, v4);
        assert_eq!(msgs[1], Message::end_of_rib(Family::Ipv4Unicast));
        let d = rib.withdraw_originated(v4);
        assert!(
            matches!(d.as_slice(), [BestPathChange::Changed { new, .. }] if new.source == RouteSource::Peer(ebgp.address))
        );
    }

    #[test]
    fn stale_marking_and_purge() {
        let p2 = peer(2, 65002);
        let mut rib = rib_with(std::slice::from_ref(&p2));
        let v4 = pfx("10.6.0.0/24");
        let v6 = pfx("fd00:6::/64");
        rib.apply_update(p2.address, &announce(v4, nh(2), attrs(&[65002]))).unwrap();
        rib.apply_update(
            p2.address,
            &Update {
                withdrawn: vec![],
                announced: vec![(v6, NextHop::V6 { global: "fd00::2".parse().unwrap(), link_local: None })],
                attributes: attrs(&[65002]),
            },
        )
        .unwrap();
        rib.mark_stale(p2.address, &Family::ALL);
        assert_eq!(rib.stale_count(p2.address), 2);
        assert_eq!(rib.loc_rib().len(), 2, "stale routes stay in Loc-RIB");
        // Re-announce refreshes without a Loc-RIB delta.
        let d = rib.apply_update(p2.address, &announce(v4, nh(2), attrs(&[65002]))).unwrap();
        assert!(d.is_empty());
        assert_eq!(rib.stale_count(p2.address), 1);
        let d = rib.purge_stale(p2.address, &[Family::Ipv4Unicast]);
        assert!(d.is_empty());
        let d = rib.purge_stale(p2.address, &[Family::Ipv6Unicast]);
        assert!(matches!(d.as_slice(), [BestPathChange::Removed { prefix, .. }] if *prefix == v6));
    }

    fn reach(connected: &[&str], routes: &[(&str, &str)], local: &[&str]) -> Reachability {
        use crate::routing::fib::{ForeignRoute, KernelTable};
        let mut table = KernelTable::default();
        let route = |gateway: Option<IpAddr>| ForeignRoute {
            protocol: if gateway.is_some() { 4 } else { 2 },
            kind: ForeignRoute::UNICAST,
            gateway,
            oif: Some(2),
            metric: 0,
            linkdown: false,
        };
        for c in connected {
            table.foreign.insert(c.parse().unwrap(), route(None));
        }
        for (dst, gw) in routes {
            table.foreign.insert(dst.parse().unwrap(), route(Some(gw.parse().unwrap())));
        }
        Reachability::new(&table, &local.iter().map(|a| a.parse().unwrap()).collect())
    }

    #[test]
    fn refused_paths_stay_in_the_adj_rib_in_and_are_judged_again_when_the_policy_changes() {
        let tor = peer(2, 65002);
        let mut rib = rib_with(std::slice::from_ref(&tor));
        rib.set_reachability(reach(&["172.16.0.0/24"], &[], &["172.16.0.100"]));
        let default = pfx("0.0.0.0/0");
        let martian = pfx("127.0.0.0/8");
        let own_subnet = pfx("172.16.0.0/24");
        let good = pfx("10.9.0.0/16");
        let update = Update {
            withdrawn: vec![],
            announced: [default, martian, own_subnet, good].iter().map(|p| (*p, NextHop::V4(nh(2)))).collect(),
            attributes: attrs(&[65002]),
        };
        let d = rib.apply_update(tor.address, &update).unwrap();
        assert_eq!(d.iter().map(BestPathChange::prefix).collect::<Vec<_>>(), vec![good]);
        assert_eq!(rib.adj_rib_in(tor.address).unwrap().len(), 4, "pre-policy Adj-RIB-In keeps everything");
        assert_eq!(rib.rejected_count(tor.address), 3);
        let reasons: Vec<Rejection> = rib.rejections().keys().map(|(_, r)| *r).collect();
        assert_eq!(reasons, vec![Rejection::MartianPrefix, Rejection::DefaultRoute, Rejection::NodeLocal]);
        // Accepting default routes from this peer brings the stored path in, no refresh needed.
        let mut accepting = tor.clone();
        accepting.accept_default = true;
        let d = rib.upsert_peer(accepting);
        assert!(matches!(d.as_slice(), [BestPathChange::Added { prefix, .. }] if *prefix == default));
        assert_eq!(rib.rejected_count(tor.address), 2);
        // A cluster-wide policy change too.
        let d = rib.set_import_policy(ImportPolicy {
            custom_reject: vec!["10.9.0.0/16".parse().unwrap()],
            ..Default::default()
        });
        assert!(matches!(d.as_slice(), [BestPathChange::Removed { prefix, .. }] if *prefix == good));
        // Nothing refused ever reaches another peer.
        let node = peer(3, LOCAL_ASN);
        rib.upsert_peer(node.clone());
        assert!(rib.sync_adj_rib_out(node.address, None).is_empty());
    }

    #[test]
    fn an_unresolvable_next_hop_does_not_win() {
        let (p2, p3) = (peer(2, 65002), peer(3, 65003));
        let prefix = pfx("10.20.0.0/16");
        let mut rib = rib_with(&[p2.clone(), p3.clone()]);
        // p2's next hop is on the link; p3's (better: shorter path) is not reachable at all.
        rib.set_reachability(reach(&["172.16.0.0/24"], &[], &[]));
        let far = Ipv4Addr::new(192, 0, 2, 1);
        rib.apply_update(p2.address, &announce(prefix, nh(2), attrs(&[65002, 1]))).unwrap();
        rib.apply_update(p3.address, &announce(prefix, far, attrs(&[65003]))).unwrap();
        assert_eq!(rib.best(&prefix).unwrap().source, RouteSource::Peer(p2.address));
        // A static route to p3's next hop appears: it resolves now and wins.
        let d = rib.set_reachability(reach(&["172.16.0.0/24"], &[("192.0.2.0/24", "172.16.0.254")], &[]));
        assert!(
            matches!(d.as_slice(), [BestPathChange::Changed { new, .. }] if new.source == RouteSource::Peer(p3.address))
        );
        // The default route alone does not resolve a BGP next hop.
        let d = rib.set_reachability(reach(&["172.16.0.0/24"], &[("0.0.0.0/0", "172.16.0.254")], &[]));
        assert!(
            matches!(d.as_slice(), [BestPathChange::Changed { new, .. }] if new.source == RouteSource::Peer(p2.address))
        );
    }

    #[test]
    fn node_routes_behind_the_overlay_resolve_through_the_tunnel_endpoint() {
        use crate::routing::overlay::{Encap, OverlayConfig, OverlayType};
        let remote_node = PeerInfo { address: IpAddr::V4(Ipv4Addr::new(10, 81, 0, 2)), ..peer(9, LOCAL_ASN) };
        let prefix = pfx("10.244.2.0/24");
        let mut rib = rib_with(std::slice::from_ref(&remote_node));
        rib.set_reachability(reach(&["10.80.0.0/24"], &[("0.0.0.0/0", "10.80.0.254")], &[]));
        rib.apply_update(remote_node.address, &announce(prefix, Ipv4Addr::new(10, 81, 0, 2), attrs(&[]))).unwrap();
        assert!(rib.best(&prefix).is_none(), "another subnet, no overlay: unresolvable");
        let overlay = OverlayConfig { overlay_type: OverlayType::Subnet, encap: Encap::Ipip };
        let d = rib.set_overlay(Some(overlay));
        assert!(matches!(d.as_slice(), [BestPathChange::Added { .. }]), "the tunnel endpoint is reachable");
    }

    #[test]
    fn equal_paths_from_the_same_neighbour_as_are_multipath() {
        let (a, b, c) = (peer(2, 65002), peer(3, 65002), peer(4, 65004));
        let prefix = pfx("10.30.0.0/16");
        let mut rib = rib_with(&[a.clone(), b.clone(), c.clone()]);
        rib.apply_update(a.address, &announce(prefix, nh(2), attrs(&[65002, 7]))).unwrap();
        rib.apply_update(b.address, &announce(prefix, nh(3), attrs(&[65002, 7]))).unwrap();
        rib.apply_update(c.address, &announce(prefix, nh(4), attrs(&[65004, 7]))).unwrap();
        let best = rib.best(&prefix).unwrap();
        let mut hops = vec![best.next_hop];
        hops.extend(best.multipath.iter().copied());
        hops.sort();
        assert_eq!(hops, vec![NextHop::V4(nh(2)), NextHop::V4(nh(3))], "another neighbour AS is not equal");
        assert_eq!(rib.peers_with_path(&prefix, &NextHop::V4(nh(3))).collect::<Vec<_>>(), vec![b.address]);
        // A worse path from b leaves a single path.
        let d = rib.apply_update(b.address, &announce(prefix, nh(3), attrs(&[65002, 7, 8]))).unwrap();
        assert!(matches!(d.as_slice(), [BestPathChange::Changed { new, .. }] if new.multipath.is_empty()));
    }

    #[test]
    fn export_follows_peer_roles_vips_prepend_communities_and_next_hop_override() {
        let node = peer(2, LOCAL_ASN);
        let tor = peer(3, 65003);
        let mut rib = rib_with(&[node.clone(), tor.clone()]);
        let node_ip = NextHop::V4(Ipv4Addr::new(10, 0, 0, 1));
        rib.originate(pfx("10.244.1.0/24"), node_ip, PathAttributes::default(), POD);
        rib.originate(pfx("192.0.2.7/32"), node_ip, PathAttributes::default(), OriginKind::ServiceVip);
        rib.apply_update(tor.address, &announce(pfx("10.99.0.0/16"), nh(3), attrs(&[65003]))).unwrap();
        let announced = |out: &[Update]| -> Vec<Prefix> {
            let mut all: Vec<Prefix> = out.iter().flat_map(|u| u.announced.iter().map(|(p, _)| *p)).collect();
            all.sort();
            all
        };
        // Node peers: pod CIDR only (no VIP, nothing learned from outside).
        assert_eq!(announced(&rib.sync_adj_rib_out(node.address, None)), vec![pfx("10.244.1.0/24")]);
        // External peers: what we originate, with the node IP as next hop.
        let out = rib.sync_adj_rib_out(tor.address, None);
        assert_eq!(announced(&out), vec![pfx("10.244.1.0/24"), pfx("192.0.2.7/32")]);
        assert!(out.iter().all(|u| u.announced.iter().all(|(_, h)| *h == node_ip)));
        rib.set_export_policy(ExportPolicy {
            advertise_pod_cidr: false,
            communities: vec![0xffff_ff01],
            prepend: Some(crate::routing::bgp::policy::AsPrepend { asn: 65000, repeat: 2 }),
            override_next_hop: true,
        });
        let out = rib.sync_adj_rib_out(tor.address, None);
        assert_eq!(out[0].withdrawn, vec![pfx("10.244.1.0/24")], "--advertise-pod-cidr=false");
        let vip = &out[1];
        assert_eq!(vip.announced, vec![(pfx("192.0.2.7/32"), NextHop::V4(Ipv4Addr::new(192, 168, 0, 1)))]);
        assert_eq!(vip.attributes.as_path, vec![AsPathSegment::Sequence(vec![LOCAL_ASN, 65000, 65000])]);
        assert_eq!(vip.attributes.communities, vec![0xffff_ff01]);
    }

    // ---------------- property test ----------------

    #[derive(Debug, Clone)]
    enum Op {
        Announce { peer: usize, prefix: usize, path_len: usize, local_pref: u32, med: u32 },
        Withdraw { peer: usize, prefix: usize },
        RemovePeer { peer: usize },
        MarkStale { peer: usize },
        PurgeStale { peer: usize },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0..4usize, 0..6usize, 0..3usize, 99..102u32, 0..3u32).prop_map(
                |(peer, prefix, path_len, local_pref, med)| Op::Announce { peer, prefix, path_len, local_pref, med }
            ),
            2 => (0..4usize, 0..6usize).prop_map(|(peer, prefix)| Op::Withdraw { peer, prefix }),
            1 => (0..4usize).prop_map(|peer| Op::RemovePeer { peer }),
            1 => (0..4usize).prop_map(|peer| Op::MarkStale { peer }),
            1 => (0..4usize).prop_map(|peer| Op::PurgeStale { peer }),
        ]
    }

    fn test_peers() -> Vec<PeerInfo> {
        // Two eBGP peers in the same AS (MED comparable), one in another AS,
        // one iBGP peer.
        vec![peer(2, 65002), peer(3, 65002), peer(4, 65004), peer(5, LOCAL_ASN)]
    }

    fn test_prefix(i: usize) -> Prefix {
        if i.is_multiple_of(2) {
            Prefix::new(IpAddr::V4(Ipv4Addr::new(10, i as u8, 0, 0)), 16).unwrap()
        } else {
            Prefix::new(IpAddr::V6(Ipv6Addr::new(0xfd00, i as u16, 0, 0, 0, 0, 0, 0)), 48).unwrap()
        }
    }

    proptest! {
        #[test]
        fn loc_rib_matches_brute_force(ops in proptest::collection::vec(op(), 1..60)) {
            let peers = test_peers();
            let mut rib = rib_with(&peers);
            // Model: (peer index, prefix) -> route, kept independently.
            let mut model: BTreeMap<(usize, Prefix), Route> = BTreeMap::new();
            for op in ops {
                let (loc_rib_before, version_before) = (rib.loc_rib().clone(), rib.loc_rib_version());
                let deltas = match op {
                    Op::Announce { peer, prefix, path_len, local_pref, med } => {
                        let p = &peers[peer];
                        let mut path = vec![p.asn];
                        path.extend(std::iter::repeat_n(64999, path_len));
                        if p.asn == LOCAL_ASN { path.clear(); }
                        let mut a = attrs(&path);
                        a.local_pref = Some(local_pref);
                        a.med = Some(med);
                        let prefix = test_prefix(prefix);
                        let next_hop = match prefix {
                            Prefix::V4 { .. } => NextHop::V4(nh(peer as u8)),
                            Prefix::V6 { .. } => NextHop::V6 {
                                global: Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, peer as u16),
                                link_local: None,
                            },
                        };
                        if rib.peer(p.address).is_none() {
                            rib.upsert_peer(p.clone());
                        }
                        model.insert((peer, prefix), Route { next_hop, attributes: Arc::new(a.clone()), stale: false, rejected: None });
                        rib.apply_update(p.address, &Update { withdrawn: vec![], announced: vec![(prefix, next_hop)], attributes: a }).unwrap()
                    }
                    Op::Withdraw { peer, prefix } => {
                        let prefix = test_prefix(prefix);
                        model.remove(&(peer, prefix));
                        let w = Update { withdrawn: vec![prefix], ..Update::default() };
                        rib.apply_update(peers[peer].address, &w).unwrap_or_default()
                    }
                    Op::RemovePeer { peer } => {
                        model.retain(|(i, _), _| *i != peer);
                        rib.remove_peer(peers[peer].address)
                    }
                    Op::MarkStale { peer } => {
                        model.iter_mut().filter(|((i, _), _)| *i == peer).for_each(|(_, r)| r.stale = true);
                        rib.mark_stale(peers[peer].address, &Family::ALL);
                        Vec::new()
                    }
                    Op::PurgeStale { peer } => {
                        model.retain(|(i, _), r| *i != peer || !r.stale);
                        rib.purge_stale(peers[peer].address, &Family::ALL)
                    }
                };
                // The version moves exactly when the Loc-RIB does (readers keep copies by it).
                prop_assert_eq!(rib.loc_rib_version() != version_before, rib.loc_rib() != &loc_rib_before);
                // The kept stale counts are what a walk over the Adj-RIB-In finds.
                for (i, p) in peers.iter().enumerate() {
                    let walked = model.iter().filter(|((j, _), r)| *j == i && r.stale).count();
                    prop_assert_eq!(rib.stale_count(p.address), walked);
                }
                // Every delta must describe the new Loc-RIB state.
                for d in &deltas {
                    match d {
                        BestPathChange::Removed { prefix, .. } => prop_assert!(rib.best(prefix).is_none()),
                        BestPathChange::Added { prefix, new } | BestPathChange::Changed { prefix, new, .. } => {
                            prop_assert_eq!(rib.best(prefix), Some(new))
                        }
                    }
                }
            }
            // Brute force: recompute every prefix from the model.
            let mut expected: BTreeMap<Prefix, BestRoute> = BTreeMap::new();
            for i in 0..6 {
                let prefix = test_prefix(i);
                let sources: Vec<RouteSource> = peers.iter().map(|p| RouteSource::Peer(p.address)).collect();
                let cands: Vec<Candidate> = model
                    .iter()
                    .filter(|((_, p), _)| *p == prefix)
                    .map(|((i, _), r)| Candidate { source: &sources[*i], route: r, peer: Some(&peers[*i]) })
                    .collect();
                if let Some(w) = select_best(LOCAL_ASN, &cands) {
                    let w = &cands[w];
                    expected.insert(prefix, BestRoute { source: w.source.clone(), next_hop: w.route.next_hop, attributes: w.route.attributes.clone(), multipath: multipath_of(LOCAL_ASN, &cands, w) });
                }
            }
            prop_assert_eq!(rib.loc_rib(), &expected);
        }

        #[test]
        fn selection_is_independent_of_candidate_order(
            seeds in proptest::collection::vec((0..4usize, 0..3usize, 99..102u32, 0..3u32), 1..6),
        ) {
            let peers = test_peers();
            let mut routes = Vec::new();
            let mut used = Vec::new();
            for (peer, path_len, lp, med) in seeds {
                if used.contains(&peer) { continue; }
                used.push(peer);
                let mut path = vec![peers[peer].asn];
                path.extend(std::iter::repeat_n(64999, path_len));
                let mut a = attrs(&path);
                a.local_pref = Some(lp);
                a.med = Some(med);
                routes.push((peer, RouteSource::Peer(peers[peer].address), Route { next_hop: NextHop::V4(nh(1)), attributes: Arc::new(a), stale: false, rejected: None }));
            }
            let forward: Vec<Candidate> = routes.iter().map(|(i, s, r)| Candidate { source: s, route: r, peer: Some(&peers[*i]) }).collect();
            let mut backward = forward.clone();
            backward.reverse();
            let f = select_best(LOCAL_ASN, &forward).map(|i| forward[i].source.clone());
            let b = select_best(LOCAL_ASN, &backward).map(|i| backward[i].source.clone());
            prop_assert_eq!(f, b);
        }
    }
}
