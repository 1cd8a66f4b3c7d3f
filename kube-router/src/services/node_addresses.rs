//! The addresses the cluster's Node objects claim (every InternalIP and ExternalIP): no Service
//! may capture them. Followed Node by Node, so that a Node's change costs its own addresses, and
//! shared between the copies of the policy that refuses them, so that a services pass that
//! judges Services on the node copies a pointer, not every Node's addresses.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    sync::Arc,
};

/// A set of addresses shared by every copy. Two copies of one set compare equal without a walk.
#[derive(Clone, Debug, Default)]
pub struct ClaimedAddresses(Arc<BTreeSet<IpAddr>>);

impl PartialEq for ClaimedAddresses {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.0 == other.0
    }
}

impl Eq for ClaimedAddresses {}

impl FromIterator<IpAddr> for ClaimedAddresses {
    fn from_iter<I: IntoIterator<Item = IpAddr>>(addresses: I) -> Self {
        Self(Arc::new(addresses.into_iter().map(|a| a.to_canonical()).collect()))
    }
}

impl ClaimedAddresses {
    pub fn contains(&self, ip: &IpAddr) -> bool {
        self.0.contains(ip)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = &IpAddr> {
        self.0.iter()
    }

    /// Copies of the same set: nothing can differ.
    pub fn same_set(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// The addresses in one set only: no walk for copies of one set (every services pass but
    /// those after a Node's addresses moved).
    pub fn symmetric_difference<'a>(&'a self, other: &'a Self) -> impl Iterator<Item = &'a IpAddr> + 'a {
        (!self.same_set(other)).then(|| self.0.symmetric_difference(&other.0)).into_iter().flatten()
    }
}

/// Every Node's addresses, with how many Nodes claim each (two Nodes may report one address
/// for a while, as when a node is replaced under the same IP).
#[derive(Debug, Default)]
pub struct NodeAddressIndex {
    by_node: BTreeMap<String, BTreeSet<IpAddr>>,
    claims: BTreeMap<IpAddr, usize>,
    claimed: ClaimedAddresses,
}

impl NodeAddressIndex {
    /// Every Node's addresses at once (the first listing, a restore, a reader that fell behind).
    pub fn replace_all(&mut self, nodes: impl IntoIterator<Item = (String, BTreeSet<IpAddr>)>) {
        *self = Self::default();
        for (name, addresses) in nodes {
            self.set_node(&name, addresses);
        }
    }

    /// One Node's addresses now (empty: gone, or it reports none). Returns the addresses that
    /// became or stopped being claimed by any Node.
    pub fn set_node(&mut self, name: &str, addresses: BTreeSet<IpAddr>) -> BTreeSet<IpAddr> {
        let addresses: BTreeSet<IpAddr> = addresses.into_iter().map(|a| a.to_canonical()).collect();
        let before = match addresses.is_empty() {
            true => self.by_node.remove(name),
            false => self.by_node.insert(name.to_string(), addresses.clone()),
        }
        .unwrap_or_default();
        let mut moved = BTreeSet::new();
        for gone in before.difference(&addresses) {
            if let Some(count) = self.claims.get_mut(gone) {
                *count -= 1;
                if *count == 0 {
                    self.claims.remove(gone);
                    moved.insert(*gone);
                }
            }
        }
        for new in addresses.difference(&before) {
            let count = self.claims.entry(*new).or_default();
            *count += 1;
            if *count == 1 {
                moved.insert(*new);
            }
        }
        if !moved.is_empty() {
            // Edited in place unless a policy still holds this set: then copied once.
            let claimed = Arc::make_mut(&mut self.claimed.0);
            for address in &moved {
                if self.claims.contains_key(address) {
                    claimed.insert(*address);
                } else {
                    claimed.remove(address);
                }
            }
        }
        moved
    }

    /// The addresses some Node claims, shared.
    pub fn claimed(&self) -> &ClaimedAddresses {
        &self.claimed
    }

    pub fn nodes(&self) -> usize {
        self.by_node.len()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn addresses(picks: &[u8]) -> BTreeSet<IpAddr> {
        // Few addresses, so that Nodes share them; IPv4-mapped IPv6 is the IPv4 address.
        picks
            .iter()
            .map(|p| match p % 5 {
                4 => IpAddr::V6(std::net::Ipv4Addr::new(10, 0, 0, 1).to_ipv6_mapped()),
                n => IpAddr::from([10, 0, 0, n]),
            })
            .collect()
    }

    proptest! {
        /// Following Node changes gives the set a collection from every Node gives, and reports
        /// exactly the addresses whose claim changed.
        #[test]
        fn following_nodes_claims_what_every_node_does(
            changes in proptest::collection::vec((0usize..6, proptest::collection::vec(any::<u8>(), 0..3)), 1..60),
        ) {
            let mut index = NodeAddressIndex::default();
            let mut nodes: BTreeMap<String, BTreeSet<IpAddr>> = BTreeMap::new();
            // A policy holding the set between changes: edits must not reach it.
            let mut held = index.claimed().clone();
            for (node, picks) in changes {
                let name = format!("node-{node}");
                let now = addresses(&picks);
                nodes.insert(name.clone(), now.clone());
                let before: BTreeSet<IpAddr> = held.iter().copied().collect();
                let moved = index.set_node(&name, now);
                let every: ClaimedAddresses = nodes.values().flatten().copied().collect();
                prop_assert_eq!(index.claimed(), &every);
                let after: BTreeSet<IpAddr> = every.iter().copied().collect();
                prop_assert_eq!(moved, before.symmetric_difference(&after).copied().collect::<BTreeSet<_>>());
                prop_assert_eq!(held.iter().copied().collect::<BTreeSet<_>>(), before, "a held copy does not move");
                held = index.claimed().clone();
            }
            let mut rebuilt = NodeAddressIndex::default();
            rebuilt.replace_all(nodes.clone());
            prop_assert_eq!(rebuilt.claimed(), index.claimed());
            prop_assert_eq!(rebuilt.nodes(), nodes.values().filter(|a| !a.is_empty()).count());
        }
    }

    #[test]
    fn a_copy_of_the_same_set_is_equal_without_a_walk() {
        let mut index = NodeAddressIndex::default();
        index.replace_all((0..5_000u16).map(|i| (format!("node-{i}"), addresses(&[i as u8]))));
        let copy = index.claimed().clone();
        assert!(copy.same_set(index.claimed()) && copy == *index.claimed());
        // One Node's change: a new set; the copy keeps what it had.
        let moved = index.set_node("node-1", [IpAddr::from([192, 168, 0, 1])].into());
        assert_eq!(moved, [IpAddr::from([192, 168, 0, 1])].into(), "10.0.0.1 is still node-6's");
        assert!(!copy.same_set(index.claimed()) && copy != *index.claimed());
        assert!(!copy.contains(&IpAddr::from([192, 168, 0, 1])));
    }
}
