//! Service model -> map contents: which frontends exist, which backends each one spreads over,
//! and stable numeric IDs for both, re-adopted from what the maps already hold.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr},
};

use kube_router_common::*;

use super::{
    family::{AddressFamily, IpFamily, V4},
    model::*,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// More ready endpoints than this in one service port: the first N by address are kept.
    pub max_backends_per_service: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self { max_backends_per_service: 1024 }
    }
}

/// Names one list of backends: a service port, possibly restricted to node-local endpoints.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct BackendSetKey {
    pub service: ServiceName,
    /// Shared by the set's keys in the plans (a frontend names its set).
    pub port_name: std::sync::Arc<str>,
    pub protocol: Protocol,
    pub local_only: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frontend {
    pub flags: u32,
    pub affinity_timeout_secs: u32,
    pub backend_set: BackendSetKey,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum CompileWarning {
    FrontendConflict {
        /// `address:port/protocol`.
        frontend: String,
        kept: ServiceName,
        ignored: ServiceName,
    },
    EndpointsTruncated {
        service: ServiceName,
        port_name: String,
        kept: usize,
        dropped: usize,
    },
    /// An externalIP / LoadBalancer IP the policy refuses: not programmed, the rest of the
    /// Service is.
    ExternalIpRefused {
        service: ServiceName,
        refusal: super::model::ExternalIpRefusal,
    },
    /// The Service is load-balanced in a family the node has no address in: nothing of it is
    /// programmed in that family; its other family is.
    FamilyUnavailable {
        service: ServiceName,
        family: IpFamily,
    },
}

/// One `loadBalancerSourceRanges` prefix of a backend set, as `lb_src_v4` / `lb_src_v6` hold it.
/// `W`: the family's address words.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SourceRange<W = u32> {
    pub service_id: u32,
    /// Network byte order, host bits cleared.
    pub addr: W,
    pub prefix_len: u8,
}

/// The load-balancing plan of one family before IDs are assigned.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LbPlan<F: AddressFamily = V4> {
    pub frontends: BTreeMap<ServiceKey<F::Words>, Frontend>,
    pub backend_sets: BTreeMap<BackendSetKey, Vec<Backend<F::Words>>>,
    /// `loadBalancerSourceRanges` of the backend sets behind LoadBalancer IP frontends.
    pub source_ranges: BTreeMap<BackendSetKey, Vec<F::Net>>,
    /// Backend sets whose slots hold a Maglev table rather than one slot per backend.
    pub maglev_sets: BTreeSet<BackendSetKey>,
    /// Frontend addresses / keys of rejected services: existing entries stay as they are.
    pub protected_addrs: BTreeSet<F::Words>,
    pub protected_frontends: BTreeSet<ServiceKey<F::Words>>,
    pub warnings: Vec<CompileWarning>,
    pub dropped_endpoints: u64,
    /// Backend sets that had more endpoints than the limit, with how many were left out (the
    /// incremental compiler counts them only for sets that keep a frontend).
    pub truncated: BTreeMap<BackendSetKey, usize>,
}

pub fn addr_be(addr: Ipv4Addr) -> u32 {
    V4::words(addr)
}

pub fn frontend_key(addr: Ipv4Addr, port: u16, protocol: Protocol) -> ServiceKeyV4 {
    key_of::<V4>(addr, port, protocol)
}

/// A frontend of family `F`.
pub fn key_of<F: AddressFamily>(addr: F::Addr, port: u16, protocol: Protocol) -> ServiceKey<F::Words> {
    ServiceKey { addr: F::words(addr), port: port.to_be(), proto: protocol.ip_proto(), pad: 0 }
}

/// `address:port/protocol` of a frontend, for logs.
pub fn describe_frontend<F: AddressFamily>(key: &ServiceKey<F::Words>) -> String {
    let proto = if key.proto == IPPROTO_UDP { "udp" } else { "tcp" };
    let addr: IpAddr = F::addr_from_words(key.addr).into();
    format!("{}/{proto}", std::net::SocketAddr::new(addr, u16::from_be(key.port)))
}

/// The IPv4 plan (see [`plan_for`]).
pub fn plan(state: &ServiceState, node: &NodeContext, limits: Limits) -> LbPlan {
    plan_for::<V4>(state, node, limits)
}

/// The plan of family `F`: the frontends of every Service load-balanced in `F`, over its
/// endpoints of `F`.
pub fn plan_for<F: AddressFamily>(state: &ServiceState, node: &NodeContext, limits: Limits) -> LbPlan<F> {
    let mut plan = LbPlan::<F>::default();
    let mut owners: BTreeMap<ServiceKey<F::Words>, ServiceName> = BTreeMap::new();
    let slices_by_service = slices_by_service(state);
    // A Service whose own object or one of whose slices was rejected keeps what it has.
    for service in state.services.values().filter(|s| !state.rejected.contains_key(&s.name)) {
        let slices = slices_by_service.get(&service.name).map(Vec::as_slice).unwrap_or(&[]);
        plan_service(&mut plan, &mut owners, service, slices, node, limits);
    }
    protect_rejected(&mut plan, state, node);
    plan
}

/// Each Service's EndpointSlices.
pub fn slices_by_service(state: &ServiceState) -> BTreeMap<&ServiceName, Vec<&EndpointSlice>> {
    let mut slices_by_service: BTreeMap<&ServiceName, Vec<&EndpointSlice>> = BTreeMap::new();
    for slice in state.slices.values() {
        slices_by_service.entry(&slice.service).or_default().push(slice);
    }
    slices_by_service
}

/// Adds one Service's frontends to `plan`; a frontend already in `owners` stays with the
/// Service that claimed it first (a conflict warning when that is another Service).
pub fn plan_service<F: AddressFamily>(
    plan: &mut LbPlan<F>,
    owners: &mut BTreeMap<ServiceKey<F::Words>, ServiceName>,
    service: &Service,
    slices: &[&EndpointSlice],
    node: &NodeContext,
    limits: Limits,
) {
    let of_family = |ips: &[IpAddr]| -> Vec<F::Addr> { ips.iter().filter_map(|ip| F::addr_of(*ip)).collect() };
    if !service.serves(F::FAMILY) {
        return;
    }
    if node.unavailable_families.contains(&F::FAMILY) {
        plan.warnings.push(CompileWarning::FamilyUnavailable { service: service.name.clone(), family: F::FAMILY });
        return;
    }
    for port in &service.ports {
        let affinity_flags = if service.affinity_timeout_secs.is_some() { SVC_FLAG_AFFINITY } else { 0 };
        let affinity_timeout_secs = service.affinity_timeout_secs.unwrap_or(0);
        let port_name: std::sync::Arc<str> = port.name.as_str().into();
        let set = |local_only: bool| BackendSetKey {
            service: service.name.clone(),
            port_name: port_name.clone(),
            protocol: port.protocol,
            local_only,
        };
        let internal = set(service.internal_traffic_local);
        let external = set(service.external_traffic_local);
        let local_flag = |local: bool| if local { SVC_FLAG_LOCAL_ONLY } else { 0 };
        // --hairpin-mode: every frontend. The annotations as upstream's: the ClusterIPs and
        // NodePorts, the external addresses only with service.hairpin.externalips.
        let hairpin = if service.hairpin || node.hairpin_all { SVC_FLAG_HAIRPIN } else { 0 };
        let external_hairpin =
            if node.hairpin_all || (service.hairpin && service.hairpin_external_ips) { SVC_FLAG_HAIRPIN } else { 0 };
        let maglev = match service.maglev.or(node.maglev_all.then_some(true)) {
            Some(true) => SVC_FLAG_MAGLEV | SVC_FLAG_MAGLEV_PORT,
            Some(false) => SVC_FLAG_MAGLEV,
            None => 0,
        };
        if maglev != 0 {
            plan.maglev_sets.insert(internal.clone());
            plan.maglev_sets.insert(external.clone());
        }
        let affinity_flags = affinity_flags | maglev;

        let mut frontends = Vec::new();
        for ip in of_family(&service.cluster_ips) {
            frontends.push((
                key_of::<F>(ip, port.port, port.protocol),
                affinity_flags | hairpin | local_flag(internal.local_only),
                internal.clone(),
            ));
        }
        // Direct server return: IPIP for IPv4 frontends, IPv6-in-IPv6 for IPv6 ones, NodePorts
        // included. Its node-local (`Local` traffic policy) frontends never send a flow to
        // another node: the flag is inert there.
        let dsr = if service.dsr { SVC_FLAG_DSR } else { 0 };
        let external_ips = of_family(&service.external_ips).into_iter().map(|ip| (ip, false));
        let load_balancer_ips = of_family(&service.load_balancer_ips).into_iter().map(|ip| (ip, true));
        for (ip, is_lb) in external_ips.chain(load_balancer_ips) {
            if let Some(refusal) = node.external_ips.refusal(ip.into(), is_lb) {
                if port == &service.ports[0] {
                    plan.warnings.push(CompileWarning::ExternalIpRefused { service: service.name.clone(), refusal });
                }
                continue;
            }
            // As kube-proxy: the source ranges guard the LoadBalancer IPs only.
            let ranges = service.source_ranges.as_ref().filter(|_| is_lb);
            let guarded = if ranges.is_some() { SVC_FLAG_SOURCE_RANGES } else { 0 };
            if let Some(ranges) = ranges {
                let ranges = ranges.iter().filter_map(|net| F::net_of(*net)).collect();
                plan.source_ranges.insert(external.clone(), ranges);
            }
            frontends.push((
                key_of::<F>(ip, port.port, port.protocol),
                affinity_flags | external_hairpin | local_flag(external.local_only) | SVC_FLAG_EXTERNAL | guarded | dsr,
                external.clone(),
            ));
        }
        if let Some(node_port) = port.node_port {
            for ip in node.node_port_frontend_addrs::<F>() {
                frontends.push((
                    key_of::<F>(ip, node_port, port.protocol),
                    affinity_flags
                        | hairpin
                        | local_flag(external.local_only)
                        | SVC_FLAG_EXTERNAL
                        | SVC_FLAG_NODEPORT
                        | dsr,
                    external.clone(),
                ));
            }
        }
        for (key, flags, backend_set) in frontends {
            if let Some(owner) = owners.get(&key) {
                if owner != &service.name {
                    plan.warnings.push(CompileWarning::FrontendConflict {
                        frontend: describe_frontend::<F>(&key),
                        kept: owner.clone(),
                        ignored: service.name.clone(),
                    });
                }
                continue;
            }
            owners.insert(key, service.name.clone());
            if !plan.backend_sets.contains_key(&backend_set) {
                let backends = backends_for::<F>(service, port, slices, backend_set.local_only, node, limits, plan);
                if backends.1 > 0 {
                    plan.truncated.insert(backend_set.clone(), backends.1);
                }
                plan.backend_sets.insert(backend_set.clone(), backends.0);
            }
            plan.frontends.insert(key, Frontend { flags, affinity_timeout_secs, backend_set });
        }
    }
}

/// The frontends of rejected Services (by address, and their NodePorts) keep what the maps hold.
pub fn protect_rejected<F: AddressFamily>(plan: &mut LbPlan<F>, state: &ServiceState, node: &NodeContext) {
    let of_family = |ips: &[IpAddr]| -> Vec<F::Addr> { ips.iter().filter_map(|ip| F::addr_of(*ip)).collect() };
    for (name, rejected) in &state.rejected {
        let mut addrs = rejected.addrs.clone();
        let mut node_ports = rejected.node_ports.clone();
        if let Some(service) = state.services.get(name) {
            addrs.extend(service.cluster_ips.iter().chain(&service.external_ips).chain(&service.load_balancer_ips));
            node_ports.extend(service.ports.iter().filter_map(|p| p.node_port));
        }
        plan.protected_addrs.extend(of_family(&addrs).into_iter().map(F::words));
        for node_port in &node_ports {
            for ip in node.node_port_frontend_addrs::<F>() {
                for protocol in [Protocol::Tcp, Protocol::Udp] {
                    plan.protected_frontends.insert(key_of::<F>(ip, *node_port, protocol));
                }
            }
        }
    }
}

/// kube-proxy's topology-aware routing: the node's zone, if every ready endpoint carries zone
/// hints and at least one is hinted for that zone (otherwise all endpoints are used, as a
/// missing hint means the EndpointSlice controller could not balance the zones).
fn preferred_zone<'a, A>(
    hints: &BTreeMap<(A, u16, bool), Option<&Vec<String>>>,
    zone: Option<&'a str>,
) -> Option<&'a str> {
    let zone = zone.filter(|z| !z.is_empty())?;
    if hints.is_empty() || hints.values().any(|h| h.is_none_or(|zones| zones.is_empty())) {
        return None;
    }
    hints.values().any(|h| h.is_some_and(|zones| zones.iter().any(|z| z == zone))).then_some(zone)
}

/// An endpoint as a backend: address, port, on this node.
type EndpointKey<F> = (<F as AddressFamily>::Addr, u16, bool);

/// kube-proxy's endpoint choice: ready endpoints; if there are none, serving-but-terminating
/// ones so that connections drain gracefully during a rollout.
fn backends_for<F: AddressFamily>(
    service: &Service,
    port: &ServicePort,
    slices: &[&EndpointSlice],
    local_only: bool,
    node: &NodeContext,
    limits: Limits,
    plan: &mut LbPlan<F>,
) -> (Vec<Backend<F::Words>>, usize) {
    let mut ready = BTreeSet::new();
    let mut terminating = BTreeSet::new();
    // Ready endpoints' zone hints, for topology-aware routing.
    let mut hints: BTreeMap<EndpointKey<F>, Option<&Vec<String>>> = BTreeMap::new();
    for slice in slices {
        let Some(endpoint_port) = slice.ports.iter().find(|p| p.name == port.name && p.protocol == port.protocol)
        else {
            continue;
        };
        for endpoint in &slice.endpoints {
            // An IPv6 slice's endpoints back the IPv6 frontends only, and the other way round.
            let Some(addr) = F::addr_of(endpoint.addr) else { continue };
            let local = endpoint.node_name.as_deref() == Some(node.name.as_str());
            if local_only && !local {
                continue;
            }
            let key = (addr, endpoint_port.port, local);
            if endpoint.ready || service.publish_not_ready {
                ready.insert(key);
                hints.insert(key, endpoint.zone_hints.as_ref());
            } else if endpoint.serving && endpoint.terminating {
                terminating.insert(key);
            }
        }
    }
    if !local_only {
        if let Some(zone) = preferred_zone(&hints, node.zone.as_deref()) {
            ready.retain(|key| hints[key].is_some_and(|zones| zones.iter().any(|z| z == zone)));
        }
    }
    let chosen = if ready.is_empty() { terminating } else { ready };
    let total = chosen.len();
    let kept: Vec<Backend<F::Words>> = chosen
        .into_iter()
        .take(limits.max_backends_per_service)
        .map(|(addr, port, local)| Backend {
            addr: F::words(addr),
            port: port.to_be(),
            flags: if local { BACKEND_FLAG_LOCAL } else { 0 },
        })
        .collect();
    let dropped = total - kept.len();
    if dropped > 0 {
        plan.dropped_endpoints += dropped as u64;
        plan.warnings.push(CompileWarning::EndpointsTruncated {
            service: service.name.clone(),
            port_name: port.name.clone(),
            kept: kept.len(),
            dropped,
        });
    }
    (kept, dropped)
}

/// The exact contents of one family's service maps.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MapContents<F: AddressFamily = V4> {
    pub services: BTreeMap<ServiceKey<F::Words>, ServiceValue>,
    pub slots: BTreeMap<BackendSlotKey, BackendSlotValue>,
    pub backends: BTreeMap<u32, Backend<F::Words>>,
    /// `lb_src_v4` / `lb_src_v6` (the value is always 1).
    pub source_ranges: BTreeMap<SourceRange<F::Words>, u8>,
}

/// The IDs a family's maps hold, indexed for allocation: which backend address:port has which
/// id, and which ids are taken. Built from the maps once, then kept up to date by the
/// incremental compiler, so that assigning ids to a few Services costs nothing per entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdsInUse<W: Ord> {
    pub backend_ids: BTreeMap<Backend<W>, u32>,
    pub backends: IdPool,
    /// Service ids, counted once per frontend carrying them.
    pub services: IdPool,
}

impl<W: Ord> Default for IdsInUse<W> {
    fn default() -> Self {
        Self { backend_ids: BTreeMap::new(), backends: IdPool::default(), services: IdPool::default() }
    }
}

impl<W: Copy + Ord> IdsInUse<W> {
    /// Built at once, each map with full B-tree nodes: taken one by one in key order, as the
    /// maps are read, the nodes split about half full (issue 29, heap profile). A backend held
    /// under two ids is found under the higher, as when they were taken in order.
    pub fn of<F: AddressFamily<Words = W>>(current: &MapContents<F>) -> Self {
        Self {
            backend_ids: current.backends.iter().map(|(id, backend)| (*backend, *id)).collect(),
            backends: IdPool::of_taken(current.backends.keys().copied()),
            services: IdPool::of_taken(current.services.values().map(|value| value.service_id)),
        }
    }
}

/// Taken ids (each with a count of its holders) and the free ranges between them, so the lowest
/// free id is found without walking the taken ones.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdPool {
    counts: BTreeMap<u32, u32>,
    /// Free ranges from 1 on: start -> end (exclusive).
    free: BTreeMap<u32, u64>,
}

impl Default for IdPool {
    fn default() -> Self {
        Self { counts: BTreeMap::new(), free: BTreeMap::from([(1, u64::from(u32::MAX) + 1)]) }
    }
}

impl IdPool {
    /// A pool with `ids` taken, each as often as it comes: what [`Self::take`] of each gives,
    /// built at once.
    pub fn of_taken(ids: impl IntoIterator<Item = u32>) -> Self {
        let mut sorted: Vec<u32> = ids.into_iter().collect();
        sorted.sort_unstable();
        let mut counts: Vec<(u32, u32)> = Vec::new();
        for id in sorted {
            match counts.last_mut() {
                Some((last, count)) if *last == id => *count += 1,
                _ => counts.push((id, 1)),
            }
        }
        // The free ranges are the gaps between taken ids, from 1 on (0 is never free).
        let mut free: Vec<(u32, u64)> = Vec::new();
        let mut start = 1u64;
        for &(id, _) in &counts {
            let id = u64::from(id);
            if id > start {
                free.push((start as u32, id));
            }
            start = start.max(id + 1);
        }
        if start <= u64::from(u32::MAX) {
            free.push((start as u32, u64::from(u32::MAX) + 1));
        }
        Self { counts: counts.into_iter().collect(), free: free.into_iter().collect() }
    }

    pub fn contains(&self, id: u32) -> bool {
        self.counts.contains_key(&id)
    }

    /// One more holder of `id`.
    pub fn take(&mut self, id: u32) {
        let count = self.counts.entry(id).or_default();
        *count += 1;
        if *count > 1 {
            return;
        }
        let Some((&start, &end)) = self.free.range(..=id).next_back() else { return };
        if end <= u64::from(id) {
            return;
        }
        self.free.remove(&start);
        if start < id {
            self.free.insert(start, u64::from(id));
        }
        if u64::from(id) + 1 < end {
            self.free.insert(id + 1, end);
        }
    }

    /// One holder of `id` fewer; the last one frees it.
    pub fn release(&mut self, id: u32) {
        let Some(count) = self.counts.get_mut(&id) else { return };
        *count -= 1;
        if *count > 0 {
            return;
        }
        self.counts.remove(&id);
        if id == 0 {
            return;
        }
        let (mut start, mut end) = (id, u64::from(id) + 1);
        if let Some((&before, &before_end)) = self.free.range(..id).next_back() {
            if before_end == u64::from(id) {
                self.free.remove(&before);
                start = before;
            }
        }
        if let Some(after_end) = u32::try_from(end).ok().and_then(|after| self.free.remove(&after)) {
            end = after_end;
        }
        self.free.insert(start, end);
    }

    /// The lowest free id from `from` on that `also` does not hold either.
    pub fn lowest_free(&self, from: u32, also: &BTreeSet<u32>) -> u32 {
        let containing = self.free.range(..=from).next_back().filter(|(_, end)| **end > u64::from(from));
        let ranges = containing.into_iter().chain(self.free.range(from.saturating_add(1)..));
        for (&start, &end) in ranges {
            let mut id = u64::from(start.max(from));
            while id < end && also.contains(&(id as u32)) {
                id += 1;
            }
            if id < end {
                return id as u32;
            }
        }
        u32::MAX
    }
}

/// The lowest id from `next` on that neither `taken` nor `used` holds; `next` moves past it.
fn lowest_free(taken: &IdPool, used: &mut BTreeSet<u32>, next: &mut u32) -> u32 {
    let id = taken.lowest_free(*next, used);
    *next = id.saturating_add(1);
    used.insert(id);
    id
}

/// Turns a plan into map contents. IDs already used in `current` for the same frontend (service
/// IDs) or the same address:port (backend IDs) are kept, so a restart or a resync rewrites
/// nothing that is already right; new IDs never reuse one still present in `current`.
pub fn assign_ids<F: AddressFamily>(plan: &LbPlan<F>, current: &MapContents<F>) -> MapContents<F> {
    let mut desired = assign_ids_using(plan, current, &IdsInUse::of(current));
    keep_protected(plan, current, &mut desired);
    desired
}

/// [`assign_ids`] with `ids` the index of `current`, and without the entries of rejected
/// Services: the contents of exactly the frontends, backend sets and backends of `plan`. Only
/// looks `current` up by key, so its cost follows the plan's size, not the maps'.
pub fn assign_ids_using<F: AddressFamily>(
    plan: &LbPlan<F>,
    current: &MapContents<F>,
    ids: &IdsInUse<F::Words>,
) -> MapContents<F> {
    let mut desired = MapContents::<F>::default();

    // Backend IDs.
    let needed: BTreeSet<Backend<F::Words>> = plan.backend_sets.values().flatten().copied().collect();
    let mut used = BTreeSet::new();
    let mut backend_ids = BTreeMap::new();
    let mut next = 1;
    for backend in &needed {
        let id = match ids.backend_ids.get(backend) {
            Some(id) => *id,
            None => lowest_free(&ids.backends, &mut used, &mut next),
        };
        backend_ids.insert(*backend, id);
        desired.backends.insert(id, *backend);
    }

    // Service (backend set) IDs, adopted through any frontend that already carries one.
    let mut set_ids: BTreeMap<&BackendSetKey, u32> = BTreeMap::new();
    let mut claimed = BTreeSet::new();
    for (key, frontend) in &plan.frontends {
        if set_ids.contains_key(&frontend.backend_set) {
            continue;
        }
        if let Some(existing) = current.services.get(key) {
            if claimed.insert(existing.service_id) {
                set_ids.insert(&frontend.backend_set, existing.service_id);
            }
        }
    }
    let mut used = claimed;
    let mut next = 1;
    for set in plan.backend_sets.keys() {
        set_ids.entry(set).or_insert_with(|| lowest_free(&ids.services, &mut used, &mut next));
    }

    // One slot per backend, or a Maglev table over them.
    let mut slot_counts: BTreeMap<&BackendSetKey, u32> = BTreeMap::new();
    for (set, backends) in &plan.backend_sets {
        let mut service_id = set_ids[set];
        let maglev = plan.maglev_sets.contains(set);
        let table: Vec<u32> = if maglev {
            super::maglev::table(backends, super::maglev::table_size(backends.len()))
        } else {
            (0..backends.len()).collect()
        }
        .into_iter()
        .map(|index| backend_ids[&backends[index]])
        .collect();
        if maglev && holds_other_slots(current, service_id, &table) {
            // A changed Maglev table is written under a new id and each frontend switches to it
            // in one write: no flow ever hashes into a half-written table. The old one goes after.
            service_id = lowest_free(&ids.services, &mut used, &mut next);
            set_ids.insert(set, service_id);
        }
        slot_counts.insert(set, table.len() as u32);
        for (slot, backend_id) in table.into_iter().enumerate() {
            desired.slots.insert(BackendSlotKey { service_id, slot: slot as u32 }, BackendSlotValue { backend_id });
        }
    }
    for (set, ranges) in &plan.source_ranges {
        let Some(&service_id) = set_ids.get(set) else { continue };
        for range in ranges {
            let entry =
                SourceRange { service_id, addr: F::words(F::net_addr(*range)), prefix_len: F::net_prefix_len(*range) };
            desired.source_ranges.insert(entry, 1);
        }
    }
    for (key, frontend) in &plan.frontends {
        let set = &frontend.backend_set;
        desired.services.insert(
            *key,
            ServiceValue {
                service_id: set_ids[set],
                backend_count: slot_counts[set],
                flags: frontend.flags,
                affinity_timeout_secs: frontend.affinity_timeout_secs,
            },
        );
    }
    desired
}

/// Whether `current` holds slots for `service_id` other than exactly `table`.
fn holds_other_slots<F: AddressFamily>(current: &MapContents<F>, service_id: u32, table: &[u32]) -> bool {
    let held: Vec<u32> = current
        .slots
        .range(BackendSlotKey { service_id, slot: 0 }..=BackendSlotKey { service_id, slot: u32::MAX })
        .map(|(_, value)| value.backend_id)
        .collect();
    !held.is_empty() && held != table
}

/// Entries of rejected services stay exactly as they are in the maps, with everything they use.
fn keep_protected<F: AddressFamily>(plan: &LbPlan<F>, current: &MapContents<F>, desired: &mut MapContents<F>) {
    for (key, value) in &current.services {
        let protected = plan.protected_addrs.contains(&key.addr) || plan.protected_frontends.contains(key);
        if !protected || desired.services.contains_key(key) {
            continue;
        }
        desired.services.insert(*key, *value);
        for (range, one) in current.source_ranges.range(
            SourceRange { service_id: value.service_id, addr: F::Words::default(), prefix_len: 0 }..=SourceRange {
                service_id: value.service_id,
                addr: F::WORDS_MAX,
                prefix_len: u8::MAX,
            },
        ) {
            desired.source_ranges.insert(*range, *one);
        }
        for slot in 0..value.backend_count {
            let slot_key = BackendSlotKey { service_id: value.service_id, slot };
            if let Some(slot_value) = current.slots.get(&slot_key) {
                desired.slots.insert(slot_key, *slot_value);
                if let Some(backend) = current.backends.get(&slot_value.backend_id) {
                    desired.backends.insert(slot_value.backend_id, *backend);
                }
            }
        }
    }
}
