//! The pure instance without sockets: what it publishes.
use std::{collections::BTreeMap, net::Ipv4Addr, sync::Arc, time::Instant};

use super::{
    instance::{Input, Instance},
    Advertisements, SpeakerConfig, StatusRoute,
};
use crate::{
    bgp::{message::Prefix, policy::OriginKind},
    fib::RouteSet,
};

const LOCAL_ASN: u32 = 64512;
const ROUTER_ID: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);

fn prefix(s: &str) -> Prefix {
    s.parse().unwrap()
}

fn pod_cidr() -> Prefix {
    prefix("10.244.1.0/24")
}

#[test]
fn publishing_reuses_the_route_list_until_the_loc_rib_changes() {
    let config = SpeakerConfig::new(LOCAL_ASN, ROUTER_ID);
    let now = Instant::now();
    let mut instance = Instance::new(config, false, &RouteSet::new(), &[], now);
    let pod_cidr = pod_cidr();
    instance.handle(now, Input::SetPrefixes(vec![(pod_cidr, OriginKind::PodCidr)]));
    let first = instance.publish(now).status.loc_rib;
    assert_eq!(*first, vec![StatusRoute { prefix: pod_cidr, next_hop: "10.0.0.1".parse().unwrap(), from: None }]);
    // Nothing changed in the Loc-RIB: the same list, not a copy of it.
    assert!(Arc::ptr_eq(&first, &instance.publish(now).status.loc_rib), "an unchanged Loc-RIB was listed again");
    // The same prefixes again change nothing either.
    instance.handle(now, Input::SetPrefixes(vec![(pod_cidr, OriginKind::PodCidr)]));
    assert!(Arc::ptr_eq(&first, &instance.publish(now).status.loc_rib));
    // A new route: a new list, with it.
    let vip: Prefix = "10.96.0.10/32".parse().unwrap();
    instance.handle(now, Input::SetPrefixes(vec![(pod_cidr, OriginKind::PodCidr), (vip, OriginKind::ServiceVip)]));
    let published = instance.publish(now);
    assert!(!Arc::ptr_eq(&first, &published.status.loc_rib));
    assert_eq!(published.status.loc_rib.iter().map(|r| r.prefix).collect::<Vec<_>>(), vec![vip, pod_cidr]);
    assert_eq!(published.status.loc_rib_size, 2);
}

#[test]
fn advertisements_count_what_kube_router_counts_by_type() {
    let (pod, vip, other_vip) = (prefix("10.244.1.0/24"), prefix("10.96.0.10/32"), prefix("192.0.2.7/32"));
    let mut counts = Advertisements::default();
    let first = BTreeMap::from([(pod, OriginKind::PodCidr), (vip, OriginKind::ServiceVip)]);
    counts.count_changes(&BTreeMap::new(), &first);
    assert_eq!(counts, Advertisements { pod_route: 1, advertise_vip: 1, withdraw_vip: 0 });
    // The same set again changes nothing; a VIP replaced by another is one of each.
    counts.count_changes(&first, &first);
    let second = BTreeMap::from([(pod, OriginKind::PodCidr), (other_vip, OriginKind::ServiceVip)]);
    counts.count_changes(&first, &second);
    assert_eq!(counts, Advertisements { pod_route: 1, advertise_vip: 2, withdraw_vip: 1 });
}
