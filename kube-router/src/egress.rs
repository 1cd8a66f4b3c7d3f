//! Pod egress masquerade (kube-router's `--enable-pod-egress`): what counts as inside the
//! cluster. A pod's packet to an address with no match in this set leaves the node with the
//! node's address; pod CIDRs (every node's, and `--cluster-cidr`), node addresses and the
//! Service ranges are inside. Pure: Node objects and flags in, the `cluster_nets_v4` / `_v6`
//! contents out.
use std::collections::BTreeMap;

use ipnet::{IpNet, Ipv4Net};
use k8s_openapi::api::core::v1::Node;
use kube_router_common::{CLUSTER_NET_NODE, CLUSTER_NET_POD, CLUSTER_NET_SERVICE};

use crate::services::family::{AddressFamily, V4};

/// The inside of the cluster, IPv4, with what each prefix is (flags OR-ed where they coincide).
pub fn cluster_nets<'a>(
    nodes: impl IntoIterator<Item = &'a Node>,
    cluster_cidrs: &[IpNet],
    service_ranges: &[IpNet],
) -> BTreeMap<Ipv4Net, u32> {
    cluster_nets_of::<V4>(nodes, cluster_cidrs, service_ranges)
}

/// [`cluster_nets`] of family `F` (`cluster_nets_v4` / `cluster_nets_v6`).
pub fn cluster_nets_of<'a, F: AddressFamily>(
    nodes: impl IntoIterator<Item = &'a Node>,
    cluster_cidrs: &[IpNet],
    service_ranges: &[IpNet],
) -> BTreeMap<F::Net, u32> {
    let mut nets = BTreeMap::new();
    let mut add = |net: IpNet, flag: u32| {
        if let Some(net) = F::net_of(net.trunc()) {
            *nets.entry(net).or_insert(0) |= flag;
        }
    };
    for net in cluster_cidrs {
        add(*net, CLUSTER_NET_POD);
    }
    for net in service_ranges {
        add(*net, CLUSTER_NET_SERVICE);
    }
    for node in nodes {
        // The annotations' ranges and the spec's: inside either way.
        for net in crate::pod_cidrs::all_node_pod_cidrs(node) {
            add(net, CLUSTER_NET_POD);
        }
        let addresses = node.status.as_ref().and_then(|s| s.addresses.as_ref());
        for address in addresses.into_iter().flatten() {
            if let Ok(ip) = address.address.parse::<std::net::IpAddr>() {
                add(IpNet::from(ip), CLUSTER_NET_NODE);
            }
        }
    }
    nets
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(pod_cidrs: &[&str], addresses: &[(&str, &str)]) -> Node {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "n"},
            "spec": {"podCIDR": pod_cidrs.first(), "podCIDRs": pod_cidrs},
            "status": {"addresses": addresses.iter().map(|(t, a)| serde_json::json!({"type": t, "address": a})).collect::<Vec<_>>()}
        }))
        .unwrap()
    }

    #[test]
    fn pod_cidrs_node_addresses_and_ranges_are_inside_the_cluster() {
        let nodes = [
            node(&["10.244.1.0/24", "fd00:1::/64"], &[("InternalIP", "10.100.0.1"), ("Hostname", "node-1")]),
            node(&["10.244.2.0/24"], &[("InternalIP", "10.100.0.2"), ("ExternalIP", "198.51.100.2")]),
            node(&[], &[]),
        ];
        let nets = cluster_nets(&nodes, &["10.244.0.0/16".parse().unwrap()], &["10.96.0.0/12".parse().unwrap()]);
        let text: Vec<String> = nets.iter().map(|(n, f)| format!("{n}={f}")).collect();
        assert_eq!(
            text,
            [
                "10.96.0.0/12=4",
                "10.100.0.1/32=2",
                "10.100.0.2/32=2",
                "10.244.0.0/16=1",
                "10.244.1.0/24=1",
                "10.244.2.0/24=1",
                "198.51.100.2/32=2"
            ]
        );
    }

    #[test]
    fn a_node_without_pod_cidrs_only_contributes_its_addresses() {
        let nets = cluster_nets(&[node(&[], &[("InternalIP", "10.0.0.9")])], &[], &[]);
        assert_eq!(nets.len(), 1);
        assert_eq!(nets[&"10.0.0.9/32".parse().unwrap()], CLUSTER_NET_NODE);
    }

    #[test]
    fn the_ipv6_prefixes_go_to_the_ipv6_map_only() {
        let nodes = [node(&["10.244.1.0/24", "fd00:10:244:1::/64"], &[("InternalIP", "fd00:100::1")])];
        let ranges = ["fd00:10:96::/112".parse().unwrap(), "10.96.0.0/12".parse().unwrap()];
        let nets =
            cluster_nets_of::<crate::services::family::V6>(&nodes, &["fd00:10:244::/56".parse().unwrap()], &ranges);
        let text: Vec<String> = nets.iter().map(|(n, f)| format!("{n}={f}")).collect();
        assert_eq!(text, ["fd00:10:96::/112=4", "fd00:10:244::/56=1", "fd00:10:244:1::/64=1", "fd00:100::1/128=2"]);
        let v4 = cluster_nets(&nodes, &[], &ranges);
        assert!(v4.keys().all(|n| n.addr().is_private()), "{v4:?}");
        assert_eq!(v4.len(), 2);
    }
}
