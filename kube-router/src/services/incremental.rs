//! Incremental Service compilation: a change to a few Services compiles and diffs only their
//! entries, with the same result as compiling everything.
//!
//! Each Service is planned alone (its *fragment*: the frontends it claims, its backend sets).
//! A frontend claimed by several Services goes to the first by name, as in [`plan_for`]; so a
//! change of one Service also re-plans the Services it shares a frontend with. Ids are assigned
//! over those Services only, against an index of the ids the maps hold, which gives what a full
//! [`assign_ids`] would (the full compile runs new ids in the same order over the same taken
//! ids, and a Service that did not change keeps what it has). That holds only while the maps hold
//! exactly the last compile's result: after a failed write, a sync without deletions, or with a
//! rejected Service (whose entries are kept from the maps), the next compile is a full one.
use std::collections::{BTreeMap, BTreeSet};

use kube_router_common::*;

#[cfg(doc)]
use super::compile::{assign_ids, plan_for};
use super::{
    compile::{
        assign_ids_using, describe_frontend, plan_service, protect_rejected, slices_by_service, BackendSetKey,
        CompileWarning, Frontend, IdsInUse, LbPlan, Limits, MapContents, SourceRange,
    },
    diff::{diff, MapOp},
    family::AddressFamily,
    model::*,
    source::{ObjectProblem, StateBuilder},
};

/// The Services whose objects changed since the last compile.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Changed {
    /// Everything may have: compile it all.
    All,
    Services(BTreeSet<ServiceName>),
}

impl Default for Changed {
    fn default() -> Self {
        Changed::Services(BTreeSet::new())
    }
}

impl Changed {
    pub fn merge(&mut self, other: Changed) {
        match (self, other) {
            (Changed::Services(mine), Changed::Services(theirs)) => mine.extend(theirs),
            (me, _) => *me = Changed::All,
        }
    }
}

/// Why a sync compiled every Service instead of the changed ones alone (the label of
/// `kube_router_service_full_compiles_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FullCompile {
    /// Every object was converted again: the first listing, a restore, a store that forgot
    /// what changed, a service file.
    AllObjects,
    /// Before a complete listing: nothing may be deleted, so nothing is known to be exact.
    Partial,
    /// Something of the node every Service depends on moved: its NodePort addresses, families,
    /// zone or a flag.
    Node,
    /// The maps may not hold exactly the last compile (the first sync, a failed write).
    Inexact,
    /// A rejected Service keeps its entries from the maps, which only a full compile protects.
    Rejected,
    /// A pass freed room in a full map: what waited is programmed in priority order.
    FullMap,
    /// `KUBE_ROUTER_FULL_SERVICE_COMPILE=1`.
    Forced,
}

impl FullCompile {
    pub fn label(self) -> &'static str {
        match self {
            FullCompile::AllObjects => "all_objects",
            FullCompile::Partial => "partial",
            FullCompile::Node => "node",
            FullCompile::Inexact => "inexact",
            FullCompile::Rejected => "rejected",
            FullCompile::FullMap => "full_map",
            FullCompile::Forced => "forced",
        }
    }
}

/// Key of an object's problems: (kind, namespace, name).
pub type ProblemKey = (&'static str, String, String);

/// The converted model kept across syncs, with each Service's EndpointSlices indexed and each
/// object's conversion problems, so that one object can be converted again alone.
#[derive(Clone, Debug, Default)]
pub struct ServiceCatalog {
    pub state: ServiceState,
    /// Sorted; nearly always one slice per Service (a list, not a set's node of eleven).
    slices_of: BTreeMap<ServiceName, Vec<SliceKey>>,
    problems: BTreeMap<ProblemKey, Vec<ObjectProblem>>,
}

impl ServiceCatalog {
    /// A catalog of everything a builder converted (a file, a complete listing).
    pub fn from_builder(builder: StateBuilder) -> Self {
        let mut catalog = ServiceCatalog { state: builder.state, ..Default::default() };
        for (key, slice) in &catalog.state.slices {
            catalog.slices_of.entry(slice.service.clone()).or_default().push(key.clone());
        }
        if !builder.problems.is_empty() {
            catalog.problems.insert(("", String::new(), String::new()), builder.problems);
        }
        catalog
    }

    /// The same catalog with full B-tree nodes, after every object was converted: set one by
    /// one in key order, the nodes split about half full (issue 29, heap profile).
    pub fn compact(&mut self) {
        fn rebuilt<K: Ord, V>(map: &mut BTreeMap<K, V>) {
            *map = std::mem::take(map).into_iter().collect();
        }
        rebuilt(&mut self.state.services);
        rebuilt(&mut self.state.slices);
        rebuilt(&mut self.state.rejected);
        rebuilt(&mut self.slices_of);
        rebuilt(&mut self.problems);
    }

    pub fn slices_of(&self, name: &ServiceName) -> Vec<&EndpointSlice> {
        let keys = self.slices_of.get(name).into_iter().flatten();
        keys.filter_map(|key| self.state.slices.get(key)).collect()
    }

    pub fn problems(&self) -> impl Iterator<Item = &ObjectProblem> {
        self.problems.values().flatten()
    }

    /// Replaces what one Service object converted to (`None`: the object is gone).
    pub fn set_service(&mut self, name: &ServiceName, converted: Option<StateBuilder>) {
        self.state.services.remove(name);
        self.state.rejected.remove(name);
        let key = ("Service", name.namespace.to_string(), name.name.to_string());
        self.problems.remove(&key);
        let Some(builder) = converted else { return };
        self.state.services.extend(builder.state.services);
        self.state.rejected.extend(builder.state.rejected);
        if !builder.problems.is_empty() {
            self.problems.insert(key, builder.problems);
        }
    }

    /// Replaces what one EndpointSlice object (`key`) converted to; returns the Services whose
    /// endpoints this changes (the one it named before and the one it names now).
    pub fn set_slice(&mut self, key: &SliceKey, converted: Option<StateBuilder>) -> Vec<ServiceName> {
        let mut touched = Vec::new();
        if let Some(old) = self.state.slices.remove(key) {
            if let Some(keys) = self.slices_of.get_mut(&old.service) {
                keys.retain(|k| k != key);
                if keys.is_empty() {
                    self.slices_of.remove(&old.service);
                }
            }
            touched.push(old.service);
        }
        let problem_key = ("EndpointSlice", key.0.clone(), key.1.clone());
        self.problems.remove(&problem_key);
        let Some(builder) = converted else { return touched };
        for (slice_key, slice) in builder.state.slices {
            let keys = self.slices_of.entry(slice.service.clone()).or_default();
            if let Err(at) = keys.binary_search(&slice_key) {
                keys.insert(at, slice_key.clone());
            }
            touched.push(slice.service.clone());
            self.state.slices.insert(slice_key, slice);
        }
        if !builder.problems.is_empty() {
            self.problems.insert(problem_key, builder.problems);
        }
        touched
    }
}

/// What one Service has in one family's maps.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Entries<W> {
    frontends: Vec<ServiceKey<W>>,
    service_ids: BTreeSet<u32>,
    backend_ids: BTreeSet<u32>,
}

/// Groups `contents` (holding at least `plan`'s frontends) by the Service owning each frontend.
fn entries_of<F: AddressFamily>(
    plan: &LbPlan<F>,
    contents: &MapContents<F>,
) -> BTreeMap<ServiceName, Entries<F::Words>> {
    let mut entries: BTreeMap<ServiceName, Entries<F::Words>> = BTreeMap::new();
    for (key, frontend) in &plan.frontends {
        let service = entries.entry(frontend.backend_set.service.clone()).or_default();
        service.frontends.push(*key);
        if let Some(value) = contents.services.get(key) {
            service.service_ids.insert(value.service_id);
        }
    }
    for service in entries.values_mut() {
        for id in &service.service_ids {
            for (_, slot) in contents.slots.range(slot_range(*id)) {
                service.backend_ids.insert(slot.backend_id);
            }
        }
    }
    entries
}

fn slot_range(service_id: u32) -> std::ops::RangeInclusive<BackendSlotKey> {
    BackendSlotKey { service_id, slot: 0 }..=BackendSlotKey { service_id, slot: u32::MAX }
}

fn source_range_range<F: AddressFamily>(service_id: u32) -> std::ops::RangeInclusive<SourceRange<F::Words>> {
    SourceRange { service_id, addr: F::Words::default(), prefix_len: 0 }..=SourceRange {
        service_id,
        addr: F::WORDS_MAX,
        prefix_len: u8::MAX,
    }
}

/// The writes for the Services that changed, and what they replace.
#[derive(Clone, Debug)]
pub struct Increment<F: AddressFamily> {
    pub ops: Vec<MapOp<F>>,
    /// The plan of the Services compiled (their frontends name their owner).
    pub plan: LbPlan<F>,
    /// The maps' entries at every key the writes touch, before them.
    pub before: MapContents<F>,
}

impl<F: AddressFamily> Increment<F> {
    /// Every frontend key this increment compiled, before or after.
    pub fn frontends(&self) -> impl Iterator<Item = &ServiceKey<F::Words>> {
        self.before.services.keys().chain(self.plan.frontends.keys())
    }
}

/// One Service's own plan, as [`plan_service`] makes it, in lists cut to their length and
/// sorted by key: most Services have a frontend or two and as many backend sets, and a
/// `BTreeMap` of one entry takes a node of eleven (at 10,000 Services the plans kept as
/// `LbPlan`s took ~30 MiB).
#[derive(Clone, Debug)]
struct Fragment<F: AddressFamily> {
    frontends: Box<[(ServiceKey<F::Words>, Frontend)]>,
    backend_sets: Box<[(BackendSetKey, Backends<F>)]>,
    source_ranges: Box<[(BackendSetKey, Vec<F::Net>)]>,
    maglev_sets: Box<[BackendSetKey]>,
    truncated: Box<[(BackendSetKey, usize)]>,
    warnings: Box<[CompileWarning]>,
}

type Backends<F> = Box<[Backend<<F as AddressFamily>::Words>]>;

impl<F: AddressFamily> From<LbPlan<F>> for Fragment<F> {
    fn from(plan: LbPlan<F>) -> Self {
        Self {
            frontends: plan.frontends.into_iter().collect(),
            backend_sets: plan.backend_sets.into_iter().map(|(set, backends)| (set, backends.into())).collect(),
            source_ranges: plan.source_ranges.into_iter().collect(),
            maglev_sets: plan.maglev_sets.into_iter().collect(),
            truncated: plan.truncated.into_iter().collect(),
            warnings: plan.warnings.into(),
        }
    }
}

/// The value of `key` in a list sorted by key.
fn sorted_get<'a, K: Ord, V>(list: &'a [(K, V)], key: &K) -> Option<&'a V> {
    list.binary_search_by(|(k, _)| k.cmp(key)).ok().map(|i| &list[i].1)
}

/// One family's compiler, keeping each Service's plan and map entries between syncs.
#[derive(Clone, Debug)]
pub struct FamilyCompiler<F: AddressFamily> {
    fragments: BTreeMap<ServiceName, Fragment<F>>,
    /// Every Service claiming each frontend, sorted: the first by name owns it. (Nearly always
    /// one: a list, not a set's node of eleven.)
    claims: BTreeMap<ServiceKey<F::Words>, Vec<ServiceName>>,
    entries: BTreeMap<ServiceName, Entries<F::Words>>,
    /// Backend id -> number of Services using it.
    backend_users: BTreeMap<u32, u32>,
    warnings: BTreeMap<ServiceName, Vec<CompileWarning>>,
    dropped: BTreeMap<ServiceName, u64>,
    ids: IdsInUse<F::Words>,
    /// The maps hold exactly the last compile's result: a change may be compiled alone.
    exact: bool,
    /// The Services the last compile planned again (`None`: every one).
    replanned: Option<Vec<ServiceName>>,
}

impl<F: AddressFamily> Default for FamilyCompiler<F> {
    fn default() -> Self {
        Self {
            fragments: BTreeMap::new(),
            claims: BTreeMap::new(),
            entries: BTreeMap::new(),
            backend_users: BTreeMap::new(),
            warnings: BTreeMap::new(),
            dropped: BTreeMap::new(),
            ids: IdsInUse::default(),
            exact: false,
            replanned: None,
        }
    }
}

impl<F: AddressFamily> FamilyCompiler<F> {
    /// The warnings of the last compile, for every Service.
    pub fn warnings(&self) -> impl Iterator<Item = &CompileWarning> {
        self.warnings.values().flatten()
    }

    /// One Service's warnings of the last compile that planned it.
    pub fn warnings_of(&self, name: &ServiceName) -> &[CompileWarning] {
        self.warnings.get(name).map(Vec::as_slice).unwrap_or_default()
    }

    /// The Services with warnings.
    pub fn warned_services(&self) -> impl Iterator<Item = &ServiceName> {
        self.warnings.keys()
    }

    /// The Services the last compile planned again, whose warnings may have changed: `None`
    /// after a full compile.
    pub fn replanned(&self) -> Option<&[ServiceName]> {
        self.replanned.as_deref()
    }

    /// Endpoints left out for the per-service limit, over every Service.
    pub fn dropped_endpoints(&self) -> u64 {
        self.dropped.values().sum()
    }

    /// Plans every Service again: the whole plan, as [`plan_for`] makes it.
    pub fn plan_all(&mut self, catalog: &ServiceCatalog, node: &NodeContext, limits: Limits) -> LbPlan<F> {
        self.fragments.clear();
        self.claims.clear();
        self.replanned = None;
        self.warnings.clear();
        self.dropped.clear();
        let slices = slices_by_service(&catalog.state);
        for name in catalog.state.services.keys() {
            let slices = slices.get(name).map(Vec::as_slice).unwrap_or(&[]);
            self.replan(name, catalog, slices, node, limits);
        }
        let names: Vec<ServiceName> = self.fragments.keys().cloned().collect();
        let mut plan = self.plan_of(&names);
        protect_rejected(&mut plan, &catalog.state, node);
        plan
    }

    /// After a full sync: `programmed` is what the maps hold now, `exact` whether that is all of
    /// `plan` and nothing else.
    pub fn adopt(&mut self, plan: &LbPlan<F>, programmed: &MapContents<F>, exact: bool) {
        let protected = !plan.protected_addrs.is_empty() || !plan.protected_frontends.is_empty();
        self.exact = exact && !protected;
        self.entries.clear();
        self.backend_users.clear();
        if !self.exact {
            self.ids = IdsInUse::default();
            return;
        }
        self.entries = entries_of(plan, programmed);
        for entries in self.entries.values() {
            for id in &entries.backend_ids {
                *self.backend_users.entry(*id).or_default() += 1;
            }
        }
        self.ids = IdsInUse::of(programmed);
    }

    /// Compiles the `changed` Services (and those sharing a frontend with them) alone: the
    /// writes that bring their entries to what a full compile would program, given that
    /// `programmed` is what the maps hold. An error: a full compile is needed, and why.
    pub fn compile_changed(
        &mut self,
        catalog: &ServiceCatalog,
        changed: &BTreeSet<ServiceName>,
        node: &NodeContext,
        limits: Limits,
        programmed: &MapContents<F>,
    ) -> Result<Increment<F>, FullCompile> {
        if !self.exact {
            return Err(FullCompile::Inexact);
        }
        if !catalog.state.rejected.is_empty() {
            return Err(FullCompile::Rejected);
        }
        let mut touched = BTreeSet::new();
        for name in changed {
            touched.extend(self.replan(name, catalog, &catalog.slices_of(name), node, limits));
        }
        // A frontend changing hands changes the Service that lost or won it too.
        let mut affected = changed.clone();
        for key in &touched {
            affected.extend(self.claims.get(key).into_iter().flatten().cloned());
        }
        let affected: Vec<ServiceName> = affected.into_iter().collect();
        let plan = self.plan_of(&affected);
        self.replanned = Some(affected.clone());
        let mut desired = assign_ids_using(&plan, programmed, &self.ids);
        let new_entries = entries_of(&plan, &desired);
        let old_entries: Vec<Entries<F::Words>> =
            affected.iter().filter_map(|name| self.entries.remove(name)).collect();

        let mut before = MapContents::<F>::default();
        for entries in old_entries.iter().chain(new_entries.values()) {
            for key in &entries.frontends {
                if let Some(value) = programmed.services.get(key) {
                    before.services.insert(*key, *value);
                }
            }
            for id in &entries.service_ids {
                before.slots.extend(programmed.slots.range(slot_range(*id)));
                before.source_ranges.extend(programmed.source_ranges.range(source_range_range::<F>(*id)));
            }
            for id in &entries.backend_ids {
                if let Some(backend) = programmed.backends.get(id) {
                    before.backends.insert(*id, *backend);
                }
            }
        }
        for id in old_entries.iter().flat_map(|e| &e.backend_ids) {
            if let Some(users) = self.backend_users.get_mut(id) {
                *users -= 1;
                if *users == 0 {
                    self.backend_users.remove(id);
                }
            }
        }
        for id in new_entries.values().flat_map(|e| &e.backend_ids) {
            *self.backend_users.entry(*id).or_default() += 1;
        }
        // A backend these Services no longer use stays while another one does.
        for id in old_entries.iter().flat_map(|e| &e.backend_ids) {
            if self.backend_users.contains_key(id) && !desired.backends.contains_key(id) {
                if let Some(backend) = programmed.backends.get(id) {
                    desired.backends.insert(*id, *backend);
                }
            }
        }
        self.entries.extend(new_entries);
        let ops = diff(&before, &desired, true);
        Ok(Increment { ops, plan, before })
    }

    /// After an increment's writes: `ok` if every one was made; otherwise the maps no longer
    /// hold what the compiler believes, and the next compile is a full one.
    pub fn written(&mut self, increment: &Increment<F>, ok: bool) {
        if !ok {
            self.exact = false;
            return;
        }
        let before = &increment.before;
        let ids = &mut self.ids;
        for op in &increment.ops {
            match op {
                MapOp::PutBackend(id, backend) => {
                    match before.backends.get(id) {
                        Some(old) if ids.backend_ids.get(old) == Some(id) => {
                            ids.backend_ids.remove(old);
                        }
                        Some(_) => {}
                        None => ids.backends.take(*id),
                    }
                    ids.backend_ids.insert(*backend, *id);
                }
                MapOp::DeleteBackend(id) => {
                    if let Some(old) = before.backends.get(id) {
                        if ids.backend_ids.get(old) == Some(id) {
                            ids.backend_ids.remove(old);
                        }
                        ids.backends.release(*id);
                    }
                }
                MapOp::PutService(key, value) => {
                    if let Some(old) = before.services.get(key) {
                        ids.services.release(old.service_id);
                    }
                    ids.services.take(value.service_id);
                }
                MapOp::DeleteService(key) => {
                    if let Some(old) = before.services.get(key) {
                        ids.services.release(old.service_id);
                    }
                }
                MapOp::PutSlot(..) | MapOp::DeleteSlot(_) | MapOp::PutSourceRange(_) | MapOp::DeleteSourceRange(_) => {}
            }
        }
    }

    /// Plans `name` alone again; returns the frontends it claimed before or claims now.
    fn replan(
        &mut self,
        name: &ServiceName,
        catalog: &ServiceCatalog,
        slices: &[&EndpointSlice],
        node: &NodeContext,
        limits: Limits,
    ) -> Vec<ServiceKey<F::Words>> {
        let mut touched = Vec::new();
        if let Some(old) = self.fragments.remove(name) {
            for (key, _) in old.frontends.iter() {
                if let Some(claimants) = self.claims.get_mut(key) {
                    claimants.retain(|claimant| claimant != name);
                    if claimants.is_empty() {
                        self.claims.remove(key);
                    }
                }
                touched.push(*key);
            }
        }
        // A Service whose own object or one of whose slices was rejected keeps what it has.
        let service = catalog.state.services.get(name).filter(|_| !catalog.state.rejected.contains_key(name));
        let Some(service) = service else { return touched };
        let mut fragment = LbPlan::<F>::default();
        plan_service(&mut fragment, &mut BTreeMap::new(), service, slices, node, limits);
        for key in fragment.frontends.keys() {
            let claimants = self.claims.entry(*key).or_default();
            if let Err(at) = claimants.binary_search(name) {
                claimants.insert(at, name.clone());
            }
            touched.push(*key);
        }
        if !fragment.frontends.is_empty() || !fragment.warnings.is_empty() {
            self.fragments.insert(name.clone(), fragment.into());
        }
        touched
    }

    /// The part of the whole plan that is `names`' own: the frontends each wins, the backend
    /// sets behind them, its warnings. Records each one's warnings and dropped endpoints.
    fn plan_of(&mut self, names: &[ServiceName]) -> LbPlan<F> {
        let mut plan = LbPlan::<F>::default();
        for name in names {
            self.warnings.remove(name);
            self.dropped.remove(name);
            let Some(fragment) = self.fragments.get(name) else { continue };
            // Truncation is reported for the sets that keep a frontend, below.
            let mut warnings: Vec<CompileWarning> = fragment
                .warnings
                .iter()
                .filter(|w| !matches!(w, CompileWarning::EndpointsTruncated { .. }))
                .cloned()
                .collect();
            let mut used_sets = BTreeSet::new();
            for (key, frontend) in fragment.frontends.iter() {
                let owner = self.claims.get(key).and_then(|c| c.first()).unwrap_or(name);
                if owner != name {
                    warnings.push(CompileWarning::FrontendConflict {
                        frontend: describe_frontend::<F>(key),
                        kept: owner.clone(),
                        ignored: name.clone(),
                    });
                    continue;
                }
                plan.frontends.insert(*key, frontend.clone());
                used_sets.insert(&frontend.backend_set);
            }
            let mut dropped = 0;
            for set in used_sets {
                let backends = sorted_get(&fragment.backend_sets, set).expect("a frontend's backend set is planned");
                if let Some(&count) = sorted_get(&fragment.truncated, set) {
                    warnings.push(CompileWarning::EndpointsTruncated {
                        service: name.clone(),
                        port_name: set.port_name.to_string(),
                        kept: backends.len(),
                        dropped: count,
                    });
                    plan.truncated.insert(set.clone(), count);
                    dropped += count as u64;
                }
                plan.backend_sets.insert(set.clone(), backends.to_vec());
            }
            plan.source_ranges.extend(fragment.source_ranges.iter().map(|(k, v)| (k.clone(), v.clone())));
            plan.maglev_sets.extend(fragment.maglev_sets.iter().cloned());
            plan.dropped_endpoints += dropped;
            plan.warnings.extend(warnings.iter().cloned());
            if dropped > 0 {
                self.dropped.insert(name.clone(), dropped);
            }
            if !warnings.is_empty() {
                self.warnings.insert(name.clone(), warnings);
            }
        }
        plan
    }
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

    use proptest::prelude::*;

    use super::*;
    use crate::services::{
        compile::{assign_ids, plan_for},
        departures::udp_departures,
        family::{IpFamily, V4, V6},
        sync::ServiceSync,
    };

    const SERVICES: u8 = 5;
    const SLICES: u8 = 7;

    fn name(i: u8) -> ServiceName {
        ServiceName::new("ns", format!("svc-{i}"))
    }

    fn node(variant: u8) -> NodeContext {
        let mut node = NodeContext {
            name: "node-a".into(),
            node_port_addrs: vec![Ipv4Addr::new(192, 0, 2, 1).into(), "2001:db8::1".parse().unwrap()],
            zone: Some("zone-a".into()),
            ..Default::default()
        };
        if variant % 2 == 1 {
            node.node_port_addrs.push(Ipv4Addr::new(192, 0, 2, 2).into());
            node.zone = Some("zone-b".into());
        }
        node
    }

    /// One change: a Service (or a rejected one, or none), or an EndpointSlice (or none).
    #[derive(Clone, Debug)]
    enum Change {
        Service(u8, Option<(Vec<u8>, bool)>),
        Slice(u8, Option<(u8, Vec<u8>)>),
        Node(u8),
    }

    fn service(i: u8, knobs: &[u8]) -> Service {
        let k = |n: usize| knobs[n % knobs.len()];
        let v4 = IpAddr::V4(Ipv4Addr::new(10, 96, 0, k(0) % 4));
        let v6 = IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, (k(0) % 4).into()));
        let (cluster_ips, ip_families) = match k(1) % 3 {
            0 => (vec![v4], vec![IpFamily::IPv4]),
            1 => (vec![v6], vec![IpFamily::IPv6]),
            _ => (vec![v4, v6], vec![IpFamily::IPv4, IpFamily::IPv6]),
        };
        let mut ports = vec![ServicePort {
            name: "http".into(),
            protocol: Protocol::Tcp,
            port: 80,
            node_port: (k(2) % 3 != 0).then(|| 30000 + u16::from(k(2) % 3)),
        }];
        if k(3) % 2 == 0 {
            ports.push(ServicePort { name: "dns".into(), protocol: Protocol::Udp, port: 53, node_port: None });
        }
        Service {
            name: name(i),
            cluster_ips,
            external_ips: if k(4) % 3 == 0 { vec![Ipv4Addr::new(203, 0, 113, k(4) % 2).into()] } else { vec![] },
            load_balancer_ips: if k(5) % 3 == 0 { vec![Ipv4Addr::new(198, 51, 100, 1).into()] } else { vec![] },
            ip_families,
            ports,
            affinity_timeout_secs: (k(6) % 3 == 0).then_some(60),
            external_traffic_local: k(7) % 3 == 0,
            internal_traffic_local: k(8) % 4 == 0,
            publish_not_ready: k(9) % 4 == 0,
            hairpin: false,
            hairpin_external_ips: false,
            // Two Services may share a port here, so the index's order is tested too.
            health_check_node_port: (k(7) % 3 == 0).then(|| 32000 + u16::from(k(13) % 2)),
            source_ranges: (k(10) % 2 == 0).then(|| vec!["192.0.2.0/24".parse().unwrap()]),
            maglev: match k(11) % 4 {
                0 => Some(true),
                1 => Some(false),
                _ => None,
            },
            dsr: k(12) % 5 == 0,
            advertise: Default::default(),
        }
    }

    fn slice(service: u8, endpoints: &[u8]) -> EndpointSlice {
        let endpoints = endpoints
            .iter()
            .map(|e| Endpoint {
                addr: if e % 5 == 0 {
                    IpAddr::V6(Ipv6Addr::new(0xfd01, 0, 0, 0, 0, 0, 0, (e % 6).into()))
                } else {
                    IpAddr::V4(Ipv4Addr::new(10, 0, 0, e % 6))
                },
                ready: e % 7 != 0,
                serving: true,
                terminating: e % 7 == 0,
                node_name: Some(if e % 2 == 0 { "node-a" } else { "node-b" }.into()),
                zone_hints: (e % 3 != 0).then(|| vec![if e % 4 == 0 { "zone-a" } else { "zone-b" }.into()]),
            })
            .collect();
        EndpointSlice {
            service: name(service % SERVICES),
            ports: vec![
                EndpointPort { name: "http".into(), protocol: Protocol::Tcp, port: 8080 },
                EndpointPort { name: "dns".into(), protocol: Protocol::Udp, port: 5353 },
            ],
            endpoints,
        }
    }

    fn arb_change() -> impl Strategy<Value = Change> {
        prop_oneof![
            6 => (0..SERVICES, proptest::option::weighted(0.8, (proptest::collection::vec(any::<u8>(), 12), proptest::bool::weighted(0.1)))).prop_map(|(i, s)| Change::Service(i, s)),
            6 => (0..SLICES, proptest::option::weighted(0.8, (0..SERVICES, proptest::collection::vec(any::<u8>(), 0..5)))).prop_map(|(i, s)| Change::Slice(i, s)),
            1 => any::<u8>().prop_map(Change::Node),
        ]
    }

    /// One family's maps, compiled incrementally (as the agent does) and from scratch.
    struct Pair<F: AddressFamily> {
        compiler: FamilyCompiler<F>,
        incremental: ServiceSync<F>,
        incremental_maps: MapContents<F>,
        full: ServiceSync<F>,
        full_maps: MapContents<F>,
    }

    impl<F: AddressFamily> Pair<F> {
        fn new() -> Self {
            let empty = MapContents::<F>::default();
            Self {
                compiler: FamilyCompiler::default(),
                incremental: ServiceSync::adopt(&empty).unwrap(),
                incremental_maps: empty.clone(),
                full: ServiceSync::adopt(&empty).unwrap(),
                full_maps: empty,
            }
        }

        /// Returns whether the change was compiled alone.
        fn step(
            &mut self,
            catalog: &ServiceCatalog,
            changed: Option<&BTreeSet<ServiceName>>,
            node: &NodeContext,
        ) -> bool {
            let limits = Limits { max_backends_per_service: 3 };
            let warnings_before = self.compiler.warnings.clone();
            let increment = changed.and_then(|changed| {
                self.compiler.compile_changed(catalog, changed, node, limits, self.incremental.programmed()).ok()
            });
            let alone = increment.is_some();
            if let Some(replanned) = self.compiler.replanned().filter(|_| alone) {
                // The controller reports the warnings of the Services planned again alone: no
                // other Service's may have changed.
                let names: BTreeSet<&ServiceName> =
                    warnings_before.keys().chain(self.compiler.warned_services()).collect();
                for name in names.into_iter().filter(|name| !replanned.contains(name)) {
                    let before = warnings_before.get(name).map(Vec::as_slice).unwrap_or_default();
                    assert_eq!(self.compiler.warnings_of(name), before, "{name:?} not replanned, its warnings moved");
                }
            }
            match increment {
                Some(increment) => {
                    let whole_before = self.incremental.programmed().clone();
                    let report = self.incremental.write(&mut self.incremental_maps, increment.ops.clone());
                    self.compiler.written(&increment, report.total().errors == 0);
                    // The changed Services' entries alone name every UDP backend that left a
                    // frontend: no other frontend's flows need looking at.
                    let after = self.incremental.programmed();
                    assert_eq!(
                        udp_departures(&increment.before, after),
                        udp_departures(&whole_before, after),
                        "an increment's departures differ from the whole maps'"
                    );
                }
                None => {
                    let plan = self.compiler.plan_all(catalog, node, limits);
                    let desired = assign_ids(&plan, self.incremental.programmed());
                    let report = self.incremental.sync(&mut self.incremental_maps, desired, true);
                    self.compiler.adopt(&plan, self.incremental.programmed(), report.total().errors == 0);
                }
            }
            let plan = plan_for::<F>(&catalog.state, node, limits);
            let desired = assign_ids(&plan, self.full.programmed());
            self.full.sync(&mut self.full_maps, desired, true);

            assert_eq!(self.incremental_maps, self.full_maps, "incremental and full compiles differ");
            let text = |w: &CompileWarning| format!("{w:?}");
            let mut warnings: Vec<String> = self.compiler.warnings().map(text).collect();
            let mut expected: Vec<String> = plan.warnings.iter().map(text).collect();
            warnings.sort();
            warnings.dedup();
            expected.sort();
            expected.dedup();
            assert_eq!(warnings, expected);
            assert_eq!(self.compiler.dropped_endpoints(), plan.dropped_endpoints);
            alone
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]
        #[test]
        fn compiling_the_changed_services_alone_programs_what_a_full_compile_does(
            changes in proptest::collection::vec(proptest::collection::vec(arb_change(), 1..4), 1..25)
        ) {
            let mut catalog = ServiceCatalog::default();
            let (mut v4, mut v6) = (Pair::<V4>::new(), Pair::<V6>::new());
            let mut checks = crate::services::healthcheck::HealthCheckIndex::default();
            let mut node_variant = 0;
            let mut first = true;
            for batch in changes {
                let mut changed = BTreeSet::new();
                let mut node_changed = first;
                first = false;
                for change in batch {
                    match change {
                        Change::Service(i, spec) => {
                            let converted = spec.map(|(knobs, rejected)| {
                                let mut builder = StateBuilder::default();
                                if rejected {
                                    let addrs = vec![Ipv4Addr::new(10, 96, 0, knobs[0] % 4).into()];
                                    let rejected = RejectedService { reason: "bad".into(), addrs, node_ports: vec![30001] };
                                    builder.state.rejected.insert(name(i), rejected);
                                } else {
                                    builder.state.services.insert(name(i), service(i, &knobs));
                                }
                                builder
                            });
                            catalog.set_service(&name(i), converted);
                            changed.insert(name(i));
                        }
                        Change::Slice(i, spec) => {
                            let key = ("ns".to_string(), format!("slice-{i}"));
                            let converted = spec.map(|(service, endpoints)| {
                                let mut builder = StateBuilder::default();
                                builder.state.slices.insert(key.clone(), slice(service, &endpoints));
                                builder
                            });
                            changed.extend(catalog.set_slice(&key, converted));
                        }
                        Change::Node(variant) => {
                            node_changed |= variant % 2 != node_variant % 2;
                            node_variant = variant;
                        }
                    }
                }
                let changed = (!node_changed).then_some(&changed);
                let node = node(node_variant);
                v4.step(&catalog, changed, &node);
                v6.step(&catalog, changed, &node);
                // The health checks counted for the changed Services alone are all of them.
                let before = checks.checks();
                let moved = checks.update(&catalog, changed, &node.name);
                let now = crate::services::healthcheck::health_checks(&catalog.state, &node.name);
                prop_assert_eq!(checks.checks(), now.clone());
                prop_assert!(moved || before == now, "a check moved unannounced");
            }
        }
    }

    proptest! {
        #[test]
        fn the_id_pool_finds_the_lowest_free_id_like_a_walk_over_the_taken_ones(
            ops in proptest::collection::vec((any::<bool>(), 0u32..40), 0..80),
            also in proptest::collection::btree_set(1u32..45, 0..6),
            from in 1u32..50,
        ) {
            let mut pool = crate::services::compile::IdPool::default();
            let mut counts: BTreeMap<u32, usize> = BTreeMap::new();
            for (take, id) in ops {
                if take {
                    pool.take(id);
                    *counts.entry(id).or_default() += 1;
                } else if let Some(count) = counts.get_mut(&id) {
                    pool.release(id);
                    *count -= 1;
                    if *count == 0 {
                        counts.remove(&id);
                    }
                }
            }
            let walked = (from..).find(|id| !counts.contains_key(id) && !also.contains(id)).unwrap();
            prop_assert_eq!(pool.lowest_free(from, &also), walked);
            for id in 0..45 {
                prop_assert_eq!(pool.contains(id), counts.contains_key(&id));
            }
        }
    }

    #[test]
    fn one_endpoint_change_writes_only_that_services_entries() {
        let mut catalog = ServiceCatalog::default();
        // Four Services with ClusterIPs of their own over the same two endpoint addresses.
        for i in 0..4 {
            let mut builder = StateBuilder::default();
            builder.state.services.insert(name(i), service(i, &[i, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2]));
            catalog.set_service(&name(i), Some(builder));
            let mut builder = StateBuilder::default();
            builder.state.slices.insert(("ns".into(), format!("slice-{i}")), slice(i, &[1, 2]));
            catalog.set_slice(&("ns".into(), format!("slice-{i}")), Some(builder));
        }
        let node = node(0);
        let mut pair = Pair::<V4>::new();
        assert!(!pair.step(&catalog, None, &node));
        let mut builder = StateBuilder::default();
        builder.state.slices.insert(("ns".into(), "slice-3".into()), slice(3, &[1, 3]));
        let changed: BTreeSet<ServiceName> =
            catalog.set_slice(&("ns".into(), "slice-3".into()), Some(builder)).into_iter().collect();
        let increment = pair
            .compiler
            .clone()
            .compile_changed(
                &catalog,
                &changed,
                &node,
                Limits { max_backends_per_service: 3 },
                pair.incremental.programmed(),
            )
            .expect("compiled alone");
        // The new backend and svc-3's slot pointing at it; 10.0.0.2 stays for the others.
        assert!(matches!(increment.ops[..], [MapOp::PutBackend(..), MapOp::PutSlot(..)]), "{:?}", increment.ops);
        assert!(pair.step(&catalog, Some(&changed), &node));
    }
}
