//! A peer set's LPM entries (`peer_prefixes`), and the prefixes of a union of sets (the merged
//! set a port piece admitted by several rules points at).
use std::collections::BTreeMap;

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use super::PrefixVerdict;
use crate::policy::model::{CompiledModel, PeerSet};

/// The prefixes of a union of peer sets, each given by its LPM entries: an address is in the
/// union if any set's longest match for it allows. Every prefix of every set stays a key (the
/// longest match over the union lands on one of them), with the verdict the union gives the
/// addresses that land there.
pub fn union_prefixes(sets: &[&BTreeMap<IpNet, PrefixVerdict>]) -> BTreeMap<IpNet, PrefixVerdict> {
    let mut out = BTreeMap::new();
    for set in sets {
        for (prefix, verdict) in set.iter() {
            if *verdict == PrefixVerdict::Allow {
                out.insert(*prefix, PrefixVerdict::Allow);
            }
        }
    }
    for set in sets {
        for (prefix, verdict) in set.iter() {
            if *verdict == PrefixVerdict::Deny && !out.contains_key(prefix) {
                let allowed = sets.iter().any(|other| longest_containing(other, prefix) == Some(PrefixVerdict::Allow));
                out.insert(*prefix, if allowed { PrefixVerdict::Allow } else { PrefixVerdict::Deny });
            }
        }
    }
    out
}

/// The verdict of `set`'s longest prefix containing all of `prefix`.
pub(super) fn longest_containing(set: &BTreeMap<IpNet, PrefixVerdict>, prefix: &IpNet) -> Option<PrefixVerdict> {
    (0..=prefix.prefix_len()).rev().find_map(|len| {
        let shorter = IpNet::new(prefix.addr(), len).ok()?.trunc();
        set.get(&shorter).copied()
    })
}

/// The LPM entries of one peer set.
pub(super) fn set_prefixes(peers: &PeerSet, model: &CompiledModel) -> BTreeMap<IpNet, PrefixVerdict> {
    let mut out = BTreeMap::new();
    match peers {
        PeerSet::Any => {
            // 0.0.0.0/0 and ::/0.
            out.insert(IpNet::V4(Ipv4Net::default()), PrefixVerdict::Allow);
            out.insert(IpNet::V6(Ipv6Net::default()), PrefixVerdict::Allow);
        }
        PeerSet::Pods(key) => {
            for ip in model.pod_sets.get(key).into_iter().flatten() {
                out.insert(IpNet::from(*ip), PrefixVerdict::Allow);
            }
        }
        PeerSet::Cidr { cidr, except } => {
            out.insert(cidr.trunc(), PrefixVerdict::Allow);
            for e in except {
                out.insert(e.trunc(), PrefixVerdict::Deny);
            }
        }
    }
    out
}
