//! One address family's pass: the changed Services compiled alone when the compiler can, else
//! every Service (and why), the writes, which Service owns each frontend, the UDP backends that
//! left a frontend.
use std::collections::{BTreeMap, BTreeSet};

use anyhow::Result;

use crate::{
    kr_metrics::{FrontendId, FrontendOwner},
    services::{
        compile::{assign_ids, LbPlan, Limits, MapContents},
        departures::{udp_departures, Departure},
        family::{AddressFamily, IpFamily},
        incremental::{FamilyCompiler, FullCompile, ServiceCatalog},
        model::{ExternalIpPolicy, NodeContext, ServiceName},
        sync::{ServiceMaps, ServiceSync, SyncReport},
    },
};

/// How a sync changed which Service owns each programmed frontend (for the metrics' labels).
pub(super) enum OwnerUpdate<F: AddressFamily> {
    /// Everything was compiled: the whole plan.
    All(LbPlan<F>),
    /// Only these frontends were compiled: each one's owner now, `None` when it is not programmed.
    Some(Vec<(FrontendId, Option<FrontendOwner>)>),
}

impl<F: AddressFamily> OwnerUpdate<F> {
    /// Brings the owners of this family's frontends in `owners` (both families') up to date.
    pub(super) fn update(&self, owners: &mut BTreeMap<FrontendId, FrontendOwner>, programmed: &MapContents<F>) {
        match self {
            OwnerUpdate::All(plan) => {
                let family = |id: &FrontendId| IpFamily::of(&id.addr) == F::FAMILY;
                let (mut previous, others) = std::mem::take(owners).into_iter().partition(|(id, _)| family(id));
                *owners = others;
                owners.extend(frontend_owners(programmed, plan, &mut previous));
            }
            OwnerUpdate::Some(touched) => {
                for (id, owner) in touched {
                    match owner {
                        Some(owner) => {
                            owners.insert(*id, owner.clone());
                        }
                        None => {
                            owners.remove(id);
                        }
                    }
                }
            }
        }
    }
}

/// Each programmed frontend of one family with its Service: from the plan, else (a rejected
/// Service's kept frontend) the owner it had.
fn frontend_owners<F: AddressFamily>(
    programmed: &MapContents<F>,
    lb_plan: &LbPlan<F>,
    previous: &mut BTreeMap<FrontendId, FrontendOwner>,
) -> BTreeMap<FrontendId, FrontendOwner> {
    programmed
        .services
        .keys()
        .filter_map(|key| {
            let id = FrontendId::of::<F>(key);
            let owner = match lb_plan.frontends.get(key) {
                Some(f) => FrontendOwner {
                    namespace: f.backend_set.service.namespace.clone(),
                    name: f.backend_set.service.name.clone(),
                },
                None => previous.remove(&id)?,
            };
            Some((id, owner))
        })
        .collect()
}

/// Deletes the programmed external frontends (externalIP, LoadBalancer IP) whose address the
/// policy refuses as either kind; nothing when `complete` (the normal diff removes them then).
pub(super) fn purge_refused<F: AddressFamily>(
    sync: &mut ServiceSync<F>,
    maps: &mut impl ServiceMaps<F>,
    policy: &ExternalIpPolicy,
    complete: bool,
) -> SyncReport {
    use kube_router_common::{SVC_FLAG_EXTERNAL, SVC_FLAG_NODEPORT};
    if complete {
        return SyncReport::default();
    }
    let ops: Vec<_> = sync
        .programmed()
        .services
        .iter()
        .filter(|(_, v)| v.flags & SVC_FLAG_EXTERNAL != 0 && v.flags & SVC_FLAG_NODEPORT == 0)
        .filter(|(k, _)| {
            let addr = FrontendId::of::<F>(k).addr;
            policy.refusal(addr, false).is_some() && policy.refusal(addr, true).is_some()
        })
        .map(|(k, _)| crate::services::diff::MapOp::DeleteService(*k))
        .collect();
    if ops.is_empty() {
        return SyncReport::default();
    }
    tracing::warn!(frontends = ops.len(), "removing refused external frontends found in the maps");
    sync.write(maps, ops)
}

/// What one family's sync wrote, which frontends changed owner, the UDP backends that left a
/// frontend, and why every Service was compiled (`None`: the changed ones alone).
pub(super) type FamilySynced<F> =
    (SyncReport, OwnerUpdate<F>, BTreeSet<Departure<<F as AddressFamily>::Words>>, Option<FullCompile>);

/// Brings one family's maps to the desired state: only the `changed` Services' entries when
/// the compiler can do that, else everything (`changed` is then why).
#[allow(clippy::too_many_arguments)]
pub(super) fn sync_family<F: AddressFamily>(
    compiler: &mut FamilyCompiler<F>,
    sync: &mut ServiceSync<F>,
    maps: &mut impl ServiceMaps<F>,
    catalog: &ServiceCatalog,
    changed: Result<&BTreeSet<ServiceName>, FullCompile>,
    node: &NodeContext,
    limits: Limits,
    complete: bool,
) -> FamilySynced<F> {
    let changed =
        changed.and_then(|changed| compiler.compile_changed(catalog, changed, node, limits, sync.programmed()));
    let full = match changed {
        Ok(increment) => {
            let report = sync.write(maps, increment.ops.clone());
            compiler.written(&increment, report.total().errors == 0);
            // The changed Services' frontends alone (an increment is only compiled after a
            // complete listing).
            let mut departures = udp_departures(&increment.before, sync.programmed());
            if report.total().full > 0 && report.total().deletes > 0 {
                // This pass freed room in a full map: a full pass programs what waited, in the
                // documented priority order, as a full sync's second pass does.
                let lb_plan = compiler.plan_all(catalog, node, limits);
                let (second, more) = sync_all(sync, maps, &lb_plan, complete);
                compiler.adopt(&lb_plan, sync.programmed(), complete && second.total().errors == 0);
                departures.extend(more);
                let report = add_second_pass(report, second);
                return (report, OwnerUpdate::All(lb_plan), departures, Some(FullCompile::FullMap));
            }
            let programmed = sync.programmed();
            let owners = increment
                .frontends()
                .map(|key| {
                    let owner = programmed.services.contains_key(key).then(|| {
                        increment.plan.frontends.get(key).map(|f| FrontendOwner {
                            namespace: f.backend_set.service.namespace.clone(),
                            name: f.backend_set.service.name.clone(),
                        })
                    });
                    (FrontendId::of::<F>(key), owner.flatten())
                })
                .collect();
            return (report, OwnerUpdate::Some(owners), departures, None);
        }
        Err(reason) => reason,
    };
    let lb_plan = compiler.plan_all(catalog, node, limits);
    let (report, departures) = sync_all(sync, maps, &lb_plan, complete);
    compiler.adopt(&lb_plan, sync.programmed(), complete && report.total().errors == 0);
    (report, OwnerUpdate::All(lb_plan), departures, Some(full))
}

/// Brings one family's maps to `lb_plan`. Inserts come before deletes: when a map was full and
/// this pass freed room, one more pass with the same plan programs what waited. Also returns
/// the UDP backends that left a frontend while still programmed (none before a complete
/// listing: a partial state must not move flows).
fn sync_all<F: AddressFamily>(
    sync: &mut ServiceSync<F>,
    maps: &mut impl ServiceMaps<F>,
    lb_plan: &LbPlan<F>,
    complete: bool,
) -> (SyncReport, BTreeSet<Departure<F::Words>>) {
    let desired = assign_ids(lb_plan, sync.programmed());
    // A full compile walks every entry anyway; the desired state stands for the written one (a
    // failed write only makes a flow be balanced again, maybe onto the same backend).
    let mut departures = if complete { udp_departures(sync.programmed(), &desired) } else { BTreeSet::new() };
    let report = sync.sync(maps, desired, complete);
    if report.total().full > 0 && report.total().deletes > 0 {
        let desired = assign_ids(lb_plan, sync.programmed());
        if complete {
            departures.extend(udp_departures(sync.programmed(), &desired));
        }
        let second = sync.sync(maps, desired, complete);
        return (add_second_pass(report, second), departures);
    }
    (report, departures)
}

/// The writes of both passes; the errors of the second (what still waits).
fn add_second_pass(mut report: SyncReport, second: SyncReport) -> SyncReport {
    for (map, counts) in second.per_map {
        let total = report.per_map.entry(map).or_default();
        total.inserts += counts.inserts;
        total.updates += counts.updates;
        total.deletes += counts.deletes;
        total.errors = counts.errors;
        total.full = counts.full;
    }
    report.first_errors = second.first_errors;
    report
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr};

    use kube_router_common::map_names;

    use super::*;
    use crate::services::{
        diff::MapOp,
        family::V4,
        model::{Endpoint, EndpointPort, EndpointSlice, Protocol, Service, ServicePort},
        source::StateBuilder,
        sync::MapWriteError,
    };

    /// Service maps with room for `capacity` frontends.
    struct Capped {
        inner: MapContents,
        capacity: usize,
    }

    impl ServiceMaps for Capped {
        fn write(&mut self, op: &MapOp) -> Result<(), MapWriteError> {
            if let MapOp::PutService(key, _) = op {
                if !self.inner.services.contains_key(key) && self.inner.services.len() >= self.capacity {
                    return Err(MapWriteError { map: map_names::SERVICES, message: "E2BIG".into(), full: true });
                }
            }
            self.inner.apply(op);
            Ok(())
        }
        fn read_all(&self) -> Result<MapContents, MapWriteError> {
            Ok(self.inner.clone())
        }
    }

    /// ClusterIP Services `(name, last octet of 10.96.0.x)`.
    fn catalog(services: &[(&str, u8)]) -> ServiceCatalog {
        let mut builder = StateBuilder::default();
        for (name, octet) in services {
            let name = ServiceName::new("ns", *name);
            let service = Service::cluster_ip(
                name.clone(),
                vec![Ipv4Addr::new(10, 96, 0, *octet).into()],
                vec![ServicePort { name: "http".into(), protocol: Protocol::Tcp, port: 80, node_port: None }],
            );
            builder.state.services.insert(name, service);
        }
        ServiceCatalog::from_builder(builder)
    }

    #[test]
    fn only_the_services_naming_a_moved_node_address_are_compiled_again() {
        let node = |nodes: &[&str], hairpin_all: bool| NodeContext {
            external_ips: ExternalIpPolicy {
                node_addresses: nodes.iter().map(|a| a.parse().unwrap()).collect(),
                ..Default::default()
            },
            hairpin_all,
            ..Default::default()
        };
        let last = node(&["192.0.2.1", "192.0.2.2"], false);
        let moved = last.claimed_moved(&node(&["192.0.2.2", "192.0.2.3"], false));
        let expected: BTreeSet<IpAddr> = ["192.0.2.1".parse().unwrap(), "192.0.2.3".parse().unwrap()].into();
        assert_eq!(moved, Some(expected.clone()));
        assert_eq!(last.claimed_moved(&node(&["192.0.2.2", "192.0.2.3"], true)), None, "a flag too");
        let mut catalog = catalog(&[("a", 1), ("b", 2)]);
        let a = ServiceName::new("ns", "a");
        catalog.state.services.get_mut(&a).unwrap().external_ips = vec!["::ffff:192.0.2.3".parse().unwrap()];
        assert_eq!(catalog.state.naming(&expected), [a].into());
    }

    #[test]
    fn an_increment_that_frees_room_in_a_full_map_programs_what_waited() {
        let node = NodeContext::default();
        let limits = Limits::default();
        let mut compiler = FamilyCompiler::<V4>::default();
        let mut maps = Capped { inner: MapContents::default(), capacity: 2 };
        let mut sync = ServiceSync::adopt(&maps).unwrap();
        let before = catalog(&[("a", 1), ("b", 2)]);
        sync_family(&mut compiler, &mut sync, &mut maps, &before, Err(FullCompile::AllObjects), &node, limits, true);
        assert_eq!(maps.inner.services.len(), 2);

        // a goes, c comes: c's insert is refused before a's delete makes room.
        let after = catalog(&[("b", 2), ("c", 3)]);
        let changed = [ServiceName::new("ns", "a"), ServiceName::new("ns", "c")].into_iter().collect();
        let (report, owners, _, full) =
            sync_family(&mut compiler, &mut sync, &mut maps, &after, Ok(&changed), &node, limits, true);
        assert!(matches!(owners, OwnerUpdate::All(_)), "followed by a full pass");
        assert_eq!(full, Some(FullCompile::FullMap));
        assert_eq!(report.total().errors, 0);
        let addrs: Vec<std::net::IpAddr> = maps.inner.services.keys().map(|k| FrontendId::of::<V4>(k).addr).collect();
        let expected: Vec<std::net::IpAddr> =
            vec![Ipv4Addr::new(10, 96, 0, 2).into(), Ipv4Addr::new(10, 96, 0, 3).into()];
        assert_eq!(addrs, expected);

        // The maps hold the whole plan again: the next change is compiled alone.
        let (report, owners, _, full) =
            sync_family(&mut compiler, &mut sync, &mut maps, &after, Ok(&changed), &node, limits, true);
        assert!(matches!(owners, OwnerUpdate::Some(_)));
        assert_eq!(full, None);
        assert_eq!(report.total().writes(), 0);
    }

    /// DNS Services `(name, last octet of 10.96.0.x, last octets of their endpoints 10.0.0.y)`.
    fn dns_catalog(services: &[(&str, u8, &[u8])]) -> (ServiceCatalog, Vec<ServiceName>) {
        let mut catalog = ServiceCatalog::default();
        let mut changed = Vec::new();
        for (name, octet, endpoints) in services {
            let name = ServiceName::new("ns", *name);
            let mut builder = StateBuilder::default();
            let port = ServicePort { name: "dns".into(), protocol: Protocol::Udp, port: 53, node_port: None };
            let ip = Ipv4Addr::new(10, 96, 0, *octet).into();
            builder.state.services.insert(name.clone(), Service::cluster_ip(name.clone(), vec![ip], vec![port]));
            catalog.set_service(&name, Some(builder));
            let mut builder = StateBuilder::default();
            let endpoints = endpoints
                .iter()
                .map(|y| Endpoint {
                    addr: Ipv4Addr::new(10, 0, 0, *y).into(),
                    ready: true,
                    serving: true,
                    terminating: false,
                    node_name: None,
                    zone_hints: None,
                })
                .collect();
            let ports = vec![EndpointPort { name: "dns".into(), protocol: Protocol::Udp, port: 5353 }];
            let key = ("ns".to_string(), format!("{}-x", name.name));
            builder.state.slices.insert(key.clone(), EndpointSlice { service: name.clone(), ports, endpoints });
            changed.extend(catalog.set_slice(&key, Some(builder)));
            changed.push(name);
        }
        (catalog, changed)
    }

    /// Two Services over 10.0.0.1:5353 and .2: .1 leaves `a` but still backs `b`. Both the
    /// increment and a full sync name it, for `a`'s frontend only; a change that takes no
    /// still-programmed backend out of a frontend names nothing (no conntrack walk).
    #[test]
    fn a_udp_backend_leaving_one_service_while_backing_another_departs_from_that_frontend() {
        let (node, limits) = (NodeContext::default(), Limits::default());
        let setup = || {
            let mut compiler = FamilyCompiler::<V4>::default();
            let mut maps = MapContents::<V4>::default();
            let mut sync = ServiceSync::adopt(&maps).unwrap();
            let (catalog, _) = dns_catalog(&[("a", 1, &[1, 2]), ("b", 2, &[1, 2])]);
            let (_, _, departures, _) = sync_family(
                &mut compiler,
                &mut sync,
                &mut maps,
                &catalog,
                Err(FullCompile::AllObjects),
                &node,
                limits,
                true,
            );
            assert!(departures.is_empty(), "a first sync moves nothing");
            (compiler, maps, sync)
        };
        let expected = BTreeSet::from([Departure {
            frontend: crate::services::compile::frontend_key(Ipv4Addr::new(10, 96, 0, 1), 53, Protocol::Udp),
            addr: u32::from_ne_bytes([10, 0, 0, 1]),
            port: 5353u16.to_be(),
        }]);
        let (after, changed) = dns_catalog(&[("a", 1, &[2]), ("b", 2, &[1, 2])]);
        let changed: BTreeSet<ServiceName> = changed.into_iter().filter(|n| &*n.name == "a").collect();
        for incremental in [true, false] {
            let (mut compiler, mut maps, mut sync) = setup();
            let changed = if incremental { Ok(&changed) } else { Err(FullCompile::AllObjects) };
            let (_, owners, departures, _) =
                sync_family(&mut compiler, &mut sync, &mut maps, &after, changed, &node, limits, true);
            assert_eq!(matches!(owners, OwnerUpdate::Some(_)), incremental);
            assert_eq!(departures, expected, "incremental: {incremental}");
            // Not before a complete listing: a partial state moves no flows.
            let (mut compiler, mut maps, mut sync) = setup();
            let (_, _, departures, _) = sync_family(
                &mut compiler,
                &mut sync,
                &mut maps,
                &after,
                Err(FullCompile::Partial),
                &node,
                limits,
                false,
            );
            assert!(departures.is_empty());
        }
        // .1 leaves both: deleted, the datapath moves its flows by itself. .3 added: nothing left.
        for endpoints in [(&[2u8][..], &[2u8][..]), (&[1, 2, 3][..], &[1, 2][..])] {
            let (mut compiler, mut maps, mut sync) = setup();
            let (after, changed) = dns_catalog(&[("a", 1, endpoints.0), ("b", 2, endpoints.1)]);
            let changed: BTreeSet<ServiceName> = changed.into_iter().collect();
            let (_, owners, departures, _) =
                sync_family(&mut compiler, &mut sync, &mut maps, &after, Ok(&changed), &node, limits, true);
            assert!(matches!(owners, OwnerUpdate::Some(_)));
            assert!(departures.is_empty(), "{endpoints:?}: {departures:?}");
        }
    }
}
