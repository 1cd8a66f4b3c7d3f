//! The Service addresses the BGP speaker advertises, derived from the services catalog's model:
//! what the service proxy would program, not a second reading of the objects. A Service the
//! converter skips (another proxy's, headless, ipMode Proxy, skiplbips), an address it cannot
//! read or the external IP policy refuses, is never advertised; a legacy leading-zero address
//! is advertised as the proxy programs it; a `Local` traffic policy (or
//! `kube-router.io/service.local`) withdraws the VIP where the datapath has no local backend.
//!
//! [`VipView`] keeps each Service's share with a count per address, so a change to one Service
//! costs that Service's addresses and endpoints, not the cluster's.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use ipnet::IpNet;

use super::{
    family::IpFamily,
    incremental::{Changed, ServiceCatalog},
    model::{EndpointSlice, ExternalIpPolicy, ExternalIpRefusal, Service, ServiceName},
};

/// Which Service addresses every node advertises as host routes (kube-router's
/// `--advertise-cluster-ip`, `--advertise-external-ip`, `--advertise-loadbalancer-ip`). A
/// Service can turn each off with the annotation `kube-router.io/service.advertise.<kind>:
/// "false"`; "true" turns one on only with `annotations_override`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AdvertiseServices {
    pub cluster_ip: bool,
    pub external_ip: bool,
    pub load_balancer_ip: bool,
    /// `--service-advertise-annotations-override`: "true" annotations widen the flags.
    pub annotations_override: bool,
}

impl AdvertiseServices {
    /// Some Service address may be advertised (the Services are worth watching).
    pub fn any(&self) -> bool {
        self.cluster_ip || self.external_ip || self.load_balancer_ip || self.annotations_override
    }

    fn wants(&self, flag: bool, annotation: Option<bool>) -> bool {
        match annotation {
            Some(true) => flag || self.annotations_override,
            Some(false) => false,
            None => flag,
        }
    }
}

/// Service VIPs as host prefixes (/32, /128), sorted, without duplicates.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServiceVips {
    /// What this node advertises.
    pub advertised: Vec<IpNet>,
    /// Every VIP the cluster advertises from some node (never imported from a peer).
    pub all: Vec<IpNet>,
}

/// Everything besides the Services that decides what is advertised. A change recomputes every
/// Service.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VipSettings {
    pub advertise: AdvertiseServices,
    /// This node's name: an endpoint is local when its `nodeName` is this (the datapath's rule).
    pub node_name: String,
    /// The service proxy's external IP policy, with the cluster's addresses.
    pub external_ips: ExternalIpPolicy,
    /// Families the proxy does not serve on this node: their VIPs are not advertised either.
    pub unavailable_families: BTreeSet<IpFamily>,
}

impl VipSettings {
    /// The claimed addresses that moved from `self` to `now`, when nothing else did.
    fn claimed_moved(&self, now: &Self) -> Option<BTreeSet<IpAddr>> {
        let VipSettings { advertise, node_name, external_ips, unavailable_families } = self;
        let rest_same = *advertise == now.advertise
            && *node_name == now.node_name
            && *unavailable_families == now.unavailable_families;
        rest_same.then(|| external_ips.claimed_moved(&now.external_ips)).flatten()
    }
}

/// One Service's share of the view.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServiceShare {
    pub advertised: BTreeSet<IpAddr>,
    pub all: BTreeSet<IpAddr>,
    /// The externalIPs and LoadBalancer IPs the policy refused (logged by the reader).
    pub refused: Vec<ExternalIpRefusal>,
}

/// A ready (or, with `publishNotReadyAddresses`, any) endpoint of `family` on `node`: the
/// datapath has a backend for the Service's node-local frontends there.
fn has_local_endpoint(service: &Service, slices: &[&EndpointSlice], node: &str, family: IpFamily) -> bool {
    slices.iter().flat_map(|slice| &slice.endpoints).any(|endpoint| {
        endpoint.node_name.as_deref() == Some(node)
            && IpFamily::of(&endpoint.addr) == family
            && (endpoint.ready || service.publish_not_ready)
    })
}

/// The addresses of one Service the speaker advertises (`advertised`) and knows as VIPs (`all`).
pub fn service_share(service: &Service, slices: &[&EndpointSlice], settings: &VipSettings) -> ServiceShare {
    let mut share = ServiceShare::default();
    let advertise = &settings.advertise;
    let served =
        |ip: &IpAddr| service.serves(IpFamily::of(ip)) && !settings.unavailable_families.contains(&IpFamily::of(ip));
    let add = |ips: &[IpAddr], needs_local: bool, load_balancer: Option<bool>, share: &mut ServiceShare| {
        for ip in ips.iter().filter(|ip| served(ip)) {
            if let Some(load_balancer) = load_balancer {
                if let Some(refusal) = settings.external_ips.refusal(*ip, load_balancer) {
                    share.refused.push(refusal);
                    continue;
                }
            }
            share.all.insert(*ip);
            if !needs_local || has_local_endpoint(service, slices, &settings.node_name, IpFamily::of(ip)) {
                share.advertised.insert(*ip);
            }
        }
    };
    if advertise.wants(advertise.cluster_ip, service.advertise.cluster_ip) {
        add(&service.cluster_ips, service.internal_traffic_local, None, &mut share);
    }
    if advertise.wants(advertise.external_ip, service.advertise.external_ip) {
        add(&service.external_ips, service.external_traffic_local, Some(false), &mut share);
    }
    if advertise.wants(advertise.load_balancer_ip, service.advertise.load_balancer_ip) {
        add(&service.load_balancer_ips, service.external_traffic_local, Some(true), &mut share);
    }
    share
}

/// Every Service's share, and the union of them kept with a count per address.
#[derive(Debug, Default)]
pub struct VipView {
    settings: Option<VipSettings>,
    shares: BTreeMap<ServiceName, ServiceShare>,
    advertised: BTreeMap<IpAddr, u32>,
    all: BTreeMap<IpAddr, u32>,
}

/// Moves one Service's addresses in `counts` from `old` to `new`; `moved` when an address
/// appears or disappears from the union.
fn recount(counts: &mut BTreeMap<IpAddr, u32>, old: &BTreeSet<IpAddr>, new: &BTreeSet<IpAddr>, moved: &mut bool) {
    for addr in old.difference(new) {
        if let Some(n) = counts.get_mut(addr) {
            *n -= 1;
            if *n == 0 {
                counts.remove(addr);
                *moved = true;
            }
        }
    }
    for addr in new.difference(old) {
        let n = counts.entry(*addr).or_default();
        *n += 1;
        *moved |= *n == 1;
    }
}

impl VipView {
    /// Brings the view up to date with the `changed` Services of `catalog` (all of them when
    /// the settings changed). Returns whether the advertised or known VIPs changed, and the
    /// refusals of the Services recomputed. A rejected Service keeps its last share, as the
    /// proxy keeps its frontends.
    pub fn update(
        &mut self,
        catalog: &ServiceCatalog,
        changed: &Changed,
        settings: &VipSettings,
    ) -> (bool, Vec<(ServiceName, ExternalIpRefusal)>) {
        // A node joining or leaving moves only the addresses no Service may claim: the
        // Services naming one of them are judged again, not all.
        let moved = self.settings.as_ref().and_then(|last| last.claimed_moved(settings));
        let differs = self.settings.as_ref() != Some(settings);
        let settings_changed = differs && moved.is_none();
        if differs {
            self.settings = Some(settings.clone());
        }
        let everything = settings_changed || matches!(changed, Changed::All);
        let names: BTreeSet<ServiceName> = match changed {
            Changed::Services(names) if !everything => {
                names.iter().cloned().chain(catalog.state.naming(&moved.unwrap_or_default())).collect()
            }
            _ => self.shares.keys().chain(catalog.state.services.keys()).cloned().collect(),
        };
        let mut moved = false;
        let mut refused = Vec::new();
        for name in names {
            if catalog.state.rejected.contains_key(&name) {
                continue;
            }
            let share = catalog.state.services.get(&name).map(|service| {
                let share = service_share(service, &catalog.slices_of(&name), settings);
                refused.extend(share.refused.iter().map(|r| (name.clone(), r.clone())));
                share
            });
            if self.shares.get(&name) == share.as_ref() {
                continue;
            }
            let old = self.shares.remove(&name).unwrap_or_default();
            let new = share.unwrap_or_default();
            recount(&mut self.advertised, &old.advertised, &new.advertised, &mut moved);
            recount(&mut self.all, &old.all, &new.all, &mut moved);
            if catalog.state.services.contains_key(&name) {
                self.shares.insert(name, new);
            }
        }
        (moved, refused)
    }

    /// The VIPs as host prefixes.
    pub fn vips(&self) -> ServiceVips {
        let prefixes = |counts: &BTreeMap<IpAddr, u32>| counts.keys().map(|a| IpNet::from(*a)).collect::<Vec<_>>();
        let mut vips = ServiceVips { advertised: prefixes(&self.advertised), all: prefixes(&self.all) };
        // IpNet orders IPv4 before IPv6 as IpAddr does: already sorted.
        vips.advertised.dedup();
        vips.all.dedup();
        vips
    }
}

#[cfg(test)]
mod tests {
    use kube_router_common::SVC_FLAG_LOCAL_ONLY;
    use serde_json::{json, Value};

    use super::*;
    use crate::services::{
        compile::{plan, Limits},
        family::{AddressFamily, V4},
        model::NodeContext,
        source::StateBuilder,
    };

    fn catalog(services: &[Value], slices: &[Value]) -> ServiceCatalog {
        let mut builder = StateBuilder::default();
        for service in services {
            builder.add_service(&serde_json::from_value(service.clone()).unwrap());
        }
        for slice in slices {
            builder.add_endpoint_slice(&serde_json::from_value(slice.clone()).unwrap());
        }
        ServiceCatalog::from_builder(builder)
    }

    fn settings(advertise: AdvertiseServices, external_ips: ExternalIpPolicy) -> VipSettings {
        VipSettings { advertise, node_name: "node-1".into(), external_ips, unavailable_families: BTreeSet::new() }
    }

    fn view(catalog: &ServiceCatalog, settings: &VipSettings) -> ServiceVips {
        let mut view = VipView::default();
        view.update(catalog, &Changed::All, settings);
        view.vips()
    }

    fn advertised(services: &[Value], advertise: AdvertiseServices, slices: &[Value]) -> Vec<String> {
        let vips = view(&catalog(services, slices), &settings(advertise, ExternalIpPolicy::default()));
        vips.advertised.iter().map(ToString::to_string).collect()
    }

    const ALL: AdvertiseServices =
        AdvertiseServices { cluster_ip: true, external_ip: true, load_balancer_ip: true, annotations_override: false };

    /// A Service `shop/<name>` with one TCP port 80; `extra` is merged into the object.
    fn service(name: &str, extra: Value) -> Value {
        let mut object = json!({"metadata": {"namespace": "shop", "name": name},
            "spec": {"ports": [{"name": "http", "port": 80, "protocol": "TCP"}]}});
        merge(&mut object, extra);
        object
    }

    fn merge(into: &mut Value, from: Value) {
        match (into, from) {
            (Value::Object(into), Value::Object(from)) => {
                for (key, value) in from {
                    merge(into.entry(key).or_insert(Value::Null), value);
                }
            }
            (into, from) => *into = from,
        }
    }

    fn slice(service: &str, node: &str, ready: bool) -> Value {
        json!({"metadata": {"namespace": "shop", "name": format!("{service}-1"),
                "labels": {"kubernetes.io/service-name": service}},
            "addressType": "IPv4", "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": ["10.244.1.5"], "nodeName": node, "conditions": {"ready": ready}}]})
    }

    #[test]
    fn service_addresses_follow_the_flags_and_the_per_service_annotations() {
        let services = [
            service(
                "web",
                json!({"spec": {"clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10", "fd00:96::10"],
                    "ipFamilyPolicy": "PreferDualStack", "externalIPs": ["192.0.2.7"]},
                "status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.1"}, {"hostname": "lb.example"}]}}}),
            ),
            service("headless", json!({"spec": {"clusterIP": "None", "externalIPs": ["192.0.2.99"]}})),
            service(
                "private",
                json!({"metadata": {"annotations": {"kube-router.io/service.advertise.clusterip": "false"}},
                "spec": {"clusterIP": "10.96.0.20"}}),
            ),
            service(
                "opt-in",
                json!({"metadata": {"annotations": {"kube-router.io/service.advertise.externalip": "true"}},
                "spec": {"clusterIP": "10.96.0.30", "externalIPs": ["192.0.2.30"]}}),
            ),
        ];
        // "true" annotations widen the flags only when the operator lets them.
        assert!(advertised(&services, AdvertiseServices::default(), &[]).is_empty());
        let override_on = AdvertiseServices { annotations_override: true, ..Default::default() };
        assert_eq!(advertised(&services, override_on, &[]), ["192.0.2.30/32"]);
        let cluster = AdvertiseServices { cluster_ip: true, annotations_override: true, ..Default::default() };
        assert_eq!(
            advertised(&services, cluster, &[]),
            ["10.96.0.10/32", "10.96.0.30/32", "192.0.2.30/32", "fd00:96::10/128"]
        );
        assert_eq!(
            advertised(&services, ALL, &[]),
            ["10.96.0.10/32", "10.96.0.30/32", "192.0.2.7/32", "192.0.2.30/32", "198.51.100.1/32", "fd00:96::10/128"]
        );
    }

    #[test]
    fn local_traffic_policy_vips_come_only_from_nodes_with_a_ready_local_endpoint() {
        let services = [service(
            "web",
            json!({
            "spec": {"clusterIP": "10.96.0.10", "externalIPs": ["192.0.2.7"], "externalTrafficPolicy": "Local"},
            "status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.1"}]}}}),
        )];
        // No endpoint here: only the ClusterIP (cluster-wide policy) is advertised.
        assert_eq!(advertised(&services, ALL, &[slice("web", "node-2", true)]), ["10.96.0.10/32"]);
        assert_eq!(advertised(&services, ALL, &[slice("web", "node-1", false)]), ["10.96.0.10/32"], "not ready");
        assert_eq!(
            advertised(&services, ALL, &[slice("web", "node-1", true)]),
            ["10.96.0.10/32", "192.0.2.7/32", "198.51.100.1/32"]
        );
        // A slice of another namespace's Service of the same name does not count.
        let mut other = slice("web", "node-1", true);
        other["metadata"]["namespace"] = json!("default");
        assert_eq!(advertised(&services, ALL, &[other]), ["10.96.0.10/32"]);
        // publishNotReadyAddresses: every endpoint counts, as in the datapath.
        let published = [service(
            "web",
            json!({
            "spec": {"clusterIP": "10.96.0.10", "externalIPs": ["192.0.2.7"], "externalTrafficPolicy": "Local",
                "publishNotReadyAddresses": true}}),
        )];
        assert_eq!(advertised(&published, ALL, &[slice("web", "node-1", false)]).len(), 2);
        // Every VIP stays known to the import policy either way.
        let vips = view(&catalog(&services, &[]), &settings(ALL, ExternalIpPolicy::default()));
        assert_eq!(vips.all.len(), 3);
    }

    /// Every advertised address is an address the proxy programs a frontend on, given the same node.
    fn assert_served(catalog: &ServiceCatalog, vips: &ServiceVips, node: &NodeContext) {
        let planned: BTreeSet<IpAddr> = plan(&catalog.state, node, Limits::default())
            .frontends
            .keys()
            .map(|k| V4::addr_from_words(k.addr).into())
            .collect();
        for vip in vips.all.iter().filter(|v| v.addr().is_ipv4()) {
            assert!(planned.contains(&vip.addr()), "{vip} advertised but not programmed: {planned:?}");
        }
    }

    #[test]
    fn a_vip_the_service_proxy_refuses_is_never_advertised() {
        let many: Vec<String> = (0..5000u32).map(|i| std::net::Ipv4Addr::from(0xc633_0000 + i).to_string()).collect();
        let services = [
            service(
                "capture",
                json!({"spec": {"clusterIP": "10.96.0.10",
                    "externalIPs": ["192.168.0.1", "192.168.0.100", "169.254.169.254", "192.0.2.7", "10.244.0.9"]},
                "status": {"loadBalancer": {"ingress": [{"ip": "192.168.0.1"}, {"ip": "203.0.113.5"}]}}}),
            ),
            service("flood", json!({"spec": {"clusterIP": "10.96.0.11", "externalIPs": many}})),
            // Another proxy's Service, an ipMode Proxy load balancer, skiplbips: the converter skips them.
            service(
                "elsewhere",
                json!({"metadata": {"labels": {"service.kubernetes.io/service-proxy-name": "other"}},
                "spec": {"clusterIP": "10.96.0.12", "externalIPs": ["192.0.2.12"]}}),
            ),
            service(
                "proxied",
                json!({"spec": {"clusterIP": "10.96.0.13", "type": "LoadBalancer"},
                "status": {"loadBalancer": {"ingress": [{"ip": "203.0.113.13", "ipMode": "Proxy"}]}}}),
            ),
            service(
                "skipped",
                json!({"metadata": {"annotations": {"kube-router.io/service.skiplbips": "true"}},
                "spec": {"clusterIP": "10.96.0.14", "type": "LoadBalancer"},
                "status": {"loadBalancer": {"ingress": [{"ip": "203.0.113.14"}]}}}),
            ),
        ];
        let policy = ExternalIpPolicy {
            external_ip_ranges: vec!["192.0.2.0/24".parse().unwrap()],
            strict: true,
            load_balancer_ranges: vec!["203.0.113.0/24".parse().unwrap()],
            forbidden: vec!["10.244.0.0/16".parse().unwrap()],
            ..Default::default()
        };
        let policy =
            policy.with_cluster_addresses(["192.168.0.1".parse().unwrap()], ["192.168.0.100".parse().unwrap()]);
        let catalog = catalog(&services, &[]);
        let external = AdvertiseServices { external_ip: true, load_balancer_ip: true, ..Default::default() };
        let mut view = VipView::default();
        let (_, refused) = view.update(&catalog, &Changed::All, &settings(external, policy.clone()));
        let vips = view.vips();
        let advertised: Vec<String> = vips.advertised.iter().map(ToString::to_string).collect();
        assert_eq!(advertised, ["192.0.2.7/32", "203.0.113.5/32"]);
        assert_eq!(vips.all, vips.advertised, "refused addresses are not kept from import either");
        assert_eq!(refused.len(), 5 + 5000, "each refusal reported");
        let node = NodeContext { name: "node-1".into(), external_ips: policy.clone(), ..Default::default() };
        assert_served(&catalog, &self::view(&catalog, &settings(ALL, policy.clone())), &node);
        // Nor is a family the proxy does not serve on this node.
        let dual = self::catalog(
            &[service(
                "dual",
                json!({"spec": {"clusterIPs": ["10.96.0.20", "fd00:96::20"], "ipFamilyPolicy": "RequireDualStack"}}),
            )],
            &[],
        );
        let mut no_v6 = settings(ALL, policy);
        no_v6.unavailable_families.insert(IpFamily::IPv6);
        assert_eq!(self::view(&dual, &no_v6).all, ["10.96.0.20/32".parse::<IpNet>().unwrap()]);
    }

    #[test]
    fn strict_validation_without_a_load_balancer_range_neither_serves_nor_advertises_load_balancer_ips() {
        let services = [service(
            "shop",
            json!({"spec": {"clusterIP": "10.96.0.10", "type": "LoadBalancer", "externalIPs": ["192.0.2.7"]},
            "status": {"loadBalancer": {"ingress": [{"ip": "203.0.113.5"}]}}}),
        )];
        let catalog = catalog(&services, &[]);
        let strict = ExternalIpPolicy {
            external_ip_ranges: vec!["192.0.2.0/24".parse().unwrap()],
            strict: true,
            ..Default::default()
        };
        let external = AdvertiseServices { external_ip: true, load_balancer_ip: true, ..Default::default() };
        let mut view = VipView::default();
        let (_, refused) = view.update(&catalog, &Changed::All, &settings(external, strict.clone()));
        let advertised: Vec<String> = view.vips().advertised.iter().map(ToString::to_string).collect();
        assert_eq!(advertised, ["192.0.2.7/32"], "the LoadBalancer IP is not advertised");
        let reasons: Vec<&str> = refused.iter().map(|(_, r)| r.reason).collect();
        assert_eq!(reasons, ["no-allowed-range"]);
        assert!(refused[0].1.message.contains("--loadbalancer-ip-range"), "{}", refused[0].1.message);
        let programmed = |policy: &ExternalIpPolicy| -> BTreeSet<IpAddr> {
            let node = NodeContext { name: "node-1".into(), external_ips: policy.clone(), ..Default::default() };
            assert_served(&catalog, &self::view(&catalog, &settings(ALL, policy.clone())), &node);
            plan(&catalog.state, &node, Limits::default())
                .frontends
                .keys()
                .map(|k| V4::addr_from_words(k.addr).into())
                .collect()
        };
        let lb_ip: IpAddr = "203.0.113.5".parse().unwrap();
        assert!(!programmed(&strict).contains(&lb_ip), "the proxy refuses it too");

        // Without strict validation the LoadBalancer IP is served and advertised, as before.
        let lax = ExternalIpPolicy { strict: false, ..strict };
        let advertised: Vec<String> =
            self::view(&catalog, &settings(external, lax.clone())).advertised.iter().map(ToString::to_string).collect();
        assert_eq!(advertised, ["192.0.2.7/32", "203.0.113.5/32"]);
        assert!(programmed(&lax).contains(&lb_ip));
    }

    #[test]
    fn a_leading_zero_address_is_advertised_as_the_proxy_programs_it() {
        let services =
            [service("legacy", json!({"spec": {"clusterIP": "010.096.000.010", "externalIPs": ["192.000.002.007"]}}))];
        let catalog = catalog(&services, &[]);
        let settings = settings(ALL, ExternalIpPolicy::default());
        let vips = view(&catalog, &settings);
        let advertised: Vec<String> = vips.advertised.iter().map(ToString::to_string).collect();
        assert_eq!(advertised, ["10.96.0.10/32", "192.0.2.7/32"]);
        assert_served(&catalog, &vips, &NodeContext { name: "node-1".into(), ..Default::default() });
    }

    #[test]
    fn service_local_forces_local_in_the_datapath_and_withdraws_the_vip_without_a_local_endpoint() {
        let services = [service(
            "web",
            json!({
            "metadata": {"annotations": {"kube-router.io/service.local": "true"}},
            "spec": {"clusterIP": "10.96.0.10", "externalIPs": ["192.0.2.7"]}}),
        )];
        let node = NodeContext { name: "node-1".into(), ..Default::default() };
        for (endpoint_on, advertised_here) in [("node-2", false), ("node-1", true)] {
            let catalog = catalog(&services, &[slice("web", endpoint_on, true)]);
            let external = plan(&catalog.state, &node, Limits::default())
                .frontends
                .into_iter()
                .find(|(k, _)| V4::addr_from_words(k.addr) == std::net::Ipv4Addr::new(192, 0, 2, 7))
                .expect("the externalIP is programmed")
                .1;
            assert_ne!(external.flags & SVC_FLAG_LOCAL_ONLY, 0, "the datapath serves it from local endpoints only");
            let vips = view(&catalog, &settings(ALL, ExternalIpPolicy::default()));
            let external_ip: IpNet = "192.0.2.7/32".parse().unwrap();
            assert_eq!(vips.advertised.contains(&external_ip), advertised_here, "endpoint on {endpoint_on}");
            assert!(vips.all.contains(&external_ip));
            assert!(vips.advertised.contains(&"10.96.0.10/32".parse().unwrap()), "the ClusterIP is not local");
        }
    }

    #[test]
    fn a_node_address_moving_judges_again_only_the_services_naming_it() {
        let with_nodes = |nodes: &[&str]| {
            let policy = ExternalIpPolicy {
                node_addresses: nodes.iter().map(|a| a.parse().unwrap()).collect(),
                ..Default::default()
            };
            settings(ALL, policy)
        };
        let named = service("a", json!({"spec": {"clusterIP": "10.96.0.1", "externalIPs": ["192.0.2.7"]}}));
        let other = service("b", json!({"spec": {"clusterIP": "10.96.0.2", "externalIPs": ["192.0.2.8"]}}));
        let catalog = catalog(&[named, other], &[slice("a", "node-1", true), slice("b", "node-1", true)]);
        let mut view = VipView::default();
        view.update(&catalog, &Changed::All, &with_nodes(&["192.0.2.100"]));
        let claimed: IpNet = "192.0.2.7/32".parse().unwrap();
        assert!(view.vips().advertised.contains(&claimed));
        // A node joins with a's externalIP as its address: a is judged again although no
        // Service changed, and the address is withdrawn; the view equals a full recompute.
        let joined = with_nodes(&["192.0.2.100", "192.0.2.7"]);
        let none_changed = Changed::Services(BTreeSet::new());
        assert!(view.update(&catalog, &none_changed, &joined).0);
        assert!(!view.vips().advertised.contains(&claimed));
        assert_eq!(view.vips(), self::view(&catalog, &joined));
        // The node leaves again: back.
        assert!(view.update(&catalog, &none_changed, &with_nodes(&["192.0.2.100"])).0);
        assert!(view.vips().advertised.contains(&claimed));
    }

    #[test]
    fn one_service_changed_alone_gives_what_a_full_recompute_does() {
        let settings = settings(ALL, ExternalIpPolicy::default());
        let shared = |name: &str, octet: u8| {
            service(
                name,
                json!({"spec": {"clusterIP": format!("10.96.0.{octet}"), "externalIPs": ["192.0.2.1"],
                "externalTrafficPolicy": "Local"}}),
            )
        };
        let before =
            catalog(&[shared("a", 1), shared("b", 2)], &[slice("a", "node-1", true), slice("b", "node-1", true)]);
        let mut view = VipView::default();
        view.update(&before, &Changed::All, &settings);
        // b loses its local endpoint: the shared externalIP stays, a still has one.
        let mut after = before.clone();
        after.set_slice(&("shop".into(), "b-1".into()), None);
        let changed = Changed::Services([ServiceName::new("shop", "b")].into());
        assert!(!view.update(&after, &changed, &settings).0, "nothing moved");
        assert_eq!(view.vips(), self::view(&after, &settings));
        // a goes too: the externalIP is withdrawn but still known.
        after.set_service(&ServiceName::new("shop", "a"), None);
        let changed = Changed::Services([ServiceName::new("shop", "a")].into());
        assert!(view.update(&after, &changed, &settings).0);
        assert_eq!(view.vips(), self::view(&after, &settings));
        assert!(!view.vips().advertised.contains(&"192.0.2.1/32".parse().unwrap()));
        // A Service the converter rejects keeps what it had, as the proxy keeps its frontends.
        let mut builder = StateBuilder::default();
        builder.add_service(
            &serde_json::from_value(service(
                "b",
                json!({"spec": {"clusterIP": "10.96.0.2",
                "ports": [{"name": "x", "port": 80}, {"name": "x", "port": 81}]}}),
            ))
            .unwrap(),
        );
        after.set_service(&ServiceName::new("shop", "b"), Some(builder));
        assert!(after.state.rejected.contains_key(&ServiceName::new("shop", "b")));
        let kept = view.vips();
        view.update(&after, &Changed::Services([ServiceName::new("shop", "b")].into()), &settings);
        assert_eq!(view.vips(), kept);
    }
}
