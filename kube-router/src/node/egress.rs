//! Pod egress masquerade (kube-router's `--enable-pod-egress`): what counts as inside the
//! cluster. A pod's packet to an address with no match in this set leaves the node with the
//! node's address; pod CIDRs (every node's, and `--cluster-cidr`), node addresses and the
//! Service ranges are inside. Pure: Node objects and flags in, the `cluster_nets_v4` / `_v6`
//! contents out.
use std::collections::{BTreeMap, BTreeSet};

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
        if let Some(net) = F::net_of(net) {
            *nets.entry(net).or_insert(0) |= flag;
        }
    };
    for (net, flag) in flag_nets(cluster_cidrs, service_ranges) {
        add(net, flag);
    }
    for node in nodes {
        for (net, flag) in node_nets(node) {
            add(net, flag);
        }
    }
    nets
}

/// The flags' prefixes: `--cluster-cidr` (pods) and the Service ranges.
fn flag_nets(cluster_cidrs: &[IpNet], service_ranges: &[IpNet]) -> BTreeSet<(IpNet, u32)> {
    let pods = cluster_cidrs.iter().map(|net| (net.trunc(), CLUSTER_NET_POD));
    pods.chain(service_ranges.iter().map(|net| (net.trunc(), CLUSTER_NET_SERVICE))).collect()
}

/// What one Node puts inside the cluster: its pod ranges (the annotations' and the spec's:
/// inside either way) and its addresses, each once.
fn node_nets(node: &Node) -> BTreeSet<(IpNet, u32)> {
    let pods = crate::node::pod_cidrs::all_node_pod_cidrs(node).into_iter().map(|net| (net.trunc(), CLUSTER_NET_POD));
    let addresses = node.status.as_ref().and_then(|s| s.addresses.as_ref()).into_iter().flatten();
    let addresses = addresses
        .filter_map(|address| address.address.parse::<std::net::IpAddr>().ok())
        .map(|ip| (IpNet::from(ip), CLUSTER_NET_NODE));
    pods.chain(addresses).collect()
}

/// [`cluster_nets`] of both families kept up to date Node by Node: each prefix counts the
/// sources (a flag, a Node) that name it with each flag, so a changed Node costs its own few
/// prefixes, not a walk of every Node's.
#[derive(Debug, Clone, Default)]
pub struct ClusterNets {
    /// What each Node puts inside, by name, as last set.
    nodes: BTreeMap<String, BTreeSet<(IpNet, u32)>>,
    /// How many sources name each prefix with each flag (never 0: such entries go).
    counts: BTreeMap<(IpNet, u32), usize>,
}

impl ClusterNets {
    /// The flags' prefixes, no Node yet.
    pub fn new(cluster_cidrs: &[IpNet], service_ranges: &[IpNet]) -> Self {
        let mut nets = Self::default();
        for entry in flag_nets(cluster_cidrs, service_ranges) {
            *nets.counts.entry(entry).or_insert(0) += 1;
        }
        nets
    }

    /// Sets the Node named `name` (`None`: it is gone). Returns the prefixes whose flags
    /// changed, each with its flags now (0: no longer inside).
    pub fn set_node(&mut self, name: &str, node: Option<&Node>) -> BTreeMap<IpNet, u32> {
        let new = node.map(node_nets).unwrap_or_default();
        let old = match new.is_empty() {
            true => self.nodes.remove(name),
            false => self.nodes.insert(name.to_string(), new.clone()),
        }
        .unwrap_or_default();
        if old == new {
            return BTreeMap::new();
        }
        let touched: BTreeSet<IpNet> = old.iter().chain(&new).map(|(net, _)| *net).collect();
        let before: Vec<u32> = touched.iter().map(|net| self.flags(net)).collect();
        for entry in old.difference(&new) {
            if let Some(count) = self.counts.get_mut(entry) {
                *count -= 1;
                if *count == 0 {
                    self.counts.remove(entry);
                }
            }
        }
        for entry in new.difference(&old) {
            *self.counts.entry(*entry).or_insert(0) += 1;
        }
        touched
            .into_iter()
            .zip(before)
            .map(|(net, before)| (net, before, self.flags(&net)))
            .filter(|(_, before, now)| before != now)
            .map(|(net, _, now)| (net, now))
            .collect()
    }

    /// What `net` is inside the cluster as (0: not inside).
    pub fn flags(&self, net: &IpNet) -> u32 {
        self.counts.range((*net, 0)..=(*net, u32::MAX)).fold(0, |flags, ((_, flag), _)| flags | flag)
    }

    /// Family `F`'s whole map, as [`cluster_nets_of`] gives it for the same Nodes.
    pub fn of_family<F: AddressFamily>(&self) -> BTreeMap<F::Net, u32> {
        let mut nets = BTreeMap::new();
        for (net, flag) in self.counts.keys() {
            if let Some(net) = F::net_of(*net) {
                *nets.entry(net).or_insert(0) |= flag;
            }
        }
        nets
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::services::family::V6;

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

    fn named(name: &str, pod_cidrs: &[String], addresses: &[(&str, String)]) -> Node {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name},
            "spec": {"podCIDRs": pod_cidrs},
            "status": {"addresses": addresses.iter().map(|(t, a)| serde_json::json!({"type": t, "address": a})).collect::<Vec<_>>()}
        }))
        .unwrap()
    }

    /// Applies `changes` (flags 0: removed) to `written`, as the map writer does.
    fn write(written: &mut BTreeMap<IpNet, u32>, changes: BTreeMap<IpNet, u32>) {
        for (net, flags) in changes {
            match flags {
                0 => written.remove(&net),
                flags => written.insert(net, flags),
            };
        }
    }

    /// Nodes coming, changing and going, sharing prefixes and addresses with each other and with
    /// the flags: the counted prefixes always give what a walk of every Node gives, and the
    /// changes returned, applied one after the other, leave the map holding the same.
    #[test]
    fn node_by_node_is_the_same_as_every_node_at_once() {
        let cluster: Vec<IpNet> = vec!["10.244.0.0/16".parse().unwrap(), "fd00:10:244::/56".parse().unwrap()];
        let services: Vec<IpNet> = vec!["10.96.0.0/12".parse().unwrap(), "10.244.3.0/24".parse().unwrap()];
        let mut lcg: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = |n: u64| {
            lcg = lcg.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            ((lcg >> 33) % n) as usize
        };
        for _ in 0..20 {
            let mut nets = ClusterNets::new(&cluster, &services);
            let mut written: BTreeMap<IpNet, u32> = BTreeMap::new();
            write(&mut written, nets.of_family::<V4>().into_iter().map(|(n, f)| (IpNet::V4(n), f)).collect());
            write(&mut written, nets.of_family::<V6>().into_iter().map(|(n, f)| (IpNet::V6(n), f)).collect());
            let mut nodes: BTreeMap<String, Node> = BTreeMap::new();
            for _ in 0..300 {
                let name = format!("node-{}", next(12));
                let node = (next(5) != 0).then(|| {
                    let pods: Vec<String> = (0..next(3))
                        .map(|_| match next(3) {
                            0 => format!("10.244.{}.0/24", next(6)),
                            1 => format!("fd00:10:244:{}::/64", next(4)),
                            _ => "10.96.0.0/12".to_string(),
                        })
                        .collect();
                    let addresses: Vec<(&str, String)> = (0..next(3))
                        .map(|_| match next(3) {
                            0 => ("InternalIP", format!("192.168.0.{}", next(6))),
                            1 => ("ExternalIP", format!("fd00:100::{}", next(4))),
                            _ => ("Hostname", "host".to_string()),
                        })
                        .collect();
                    named(&name, &pods, &addresses)
                });
                write(&mut written, nets.set_node(&name, node.as_ref()));
                match node {
                    Some(node) => nodes.insert(name, node),
                    None => nodes.remove(&name),
                };
                let v4 = cluster_nets_of::<V4>(nodes.values(), &cluster, &services);
                let v6 = cluster_nets_of::<V6>(nodes.values(), &cluster, &services);
                assert_eq!(nets.of_family::<V4>(), v4);
                assert_eq!(nets.of_family::<V6>(), v6);
                let all: BTreeMap<IpNet, u32> = v4
                    .into_iter()
                    .map(|(n, f)| (IpNet::V4(n), f))
                    .chain(v6.into_iter().map(|(n, f)| (IpNet::V6(n), f)))
                    .collect();
                assert_eq!(written, all);
            }
        }
    }

    /// The cost of one Node's change among 5,000: its own prefixes, against a walk of every Node.
    #[test]
    fn a_node_change_among_thousands_touches_its_own_prefixes() {
        let count = 5_000;
        let make = |i: usize, third: usize| {
            named(
                &format!("node-{i}"),
                &[format!("10.{}.{}.0/24", 64 + (i >> 8), i & 0xff)],
                &[
                    ("InternalIP", format!("10.0.{}.{}", i >> 8, i & 0xff)),
                    ("InternalIP", format!("10.1.{}.{}", third, i & 0xff)),
                ],
            )
        };
        let nodes: Vec<Node> = (0..count).map(|i| make(i, i >> 8)).collect();
        let mut nets = ClusterNets::new(&["10.64.0.0/10".parse().unwrap()], &[]);
        for node in &nodes {
            nets.set_node(node.metadata.name.as_deref().unwrap(), Some(node));
        }
        let rounds = 200;
        let started = std::time::Instant::now();
        let mut touched = 0;
        for round in 0..rounds {
            let changed = make(round * 7 % count, 200 + round % 2);
            touched += nets.set_node(changed.metadata.name.as_deref().unwrap(), Some(&changed)).len();
        }
        let incremental = started.elapsed() / rounds as u32;
        let started = std::time::Instant::now();
        for _ in 0..5 {
            std::hint::black_box(cluster_nets(&nodes, &["10.64.0.0/10".parse().unwrap()], &[]));
        }
        let full = started.elapsed() / 5;
        println!(
            "one Node's change among {count}: {incremental:?} and {} prefixes to write (node by node), {full:?} and {} prefixes to compare (every Node)",
            touched as f64 / rounds as f64,
            nets.of_family::<V4>().len()
        );
        // An address moved: the old one leaves, the new one comes.
        assert_eq!(touched, 2 * rounds);
    }
}
