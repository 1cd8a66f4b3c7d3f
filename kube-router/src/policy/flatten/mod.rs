//! Flattens a [`CompiledModel`] into entries shaped like the BPF maps the
//! datapath reads (see docs/policy-layout.md). Pure: encoding and writing them is
//! `policy::maps`'s. The entries:
//!
//! * `pod_slots`:     (pod IP, direction)            -> slot
//! * `slot_ports`:    (slot, protocol, port prefix)  -> peer set id  (LPM trie)
//! * `peer_prefixes`: (peer set id, IP prefix)       -> Allow | Deny (LPM trie)
//!
//! A slot is a pod direction's rule list. Its rules are indexed by port: the port space of each
//! protocol is cut where some rule's ranges begin or end, and every piece points at one peer set
//! holding the peers of all rules that admit it (a rule's own set when it is alone there, else a
//! merged set). The datapath's work for a new flow is then two lookups whatever the number of
//! rules, peers and ports — there is no rule limit.
//!
//! Ids are stable: a peer set (or merged set) or a rule list keeps its id across
//! flattenings as long as it is in use, so unchanged map entries stay
//! byte-identical and only real changes need writing.
//!
//! One file per seam: this module holds the entries and their diff (and the decision computed
//! over them, [`MapEntries::allows`]); `ports` the port prefixes and a slot's port index,
//! `prefixes` the LPM entries of a peer set and the union of merged sets, `ids` the stable id
//! allocator, `flattener` the incremental [`MapFlattener`] that ties them together.

mod flattener;
mod ids;
mod ports;
mod prefixes;

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net};

use super::model::{Direction, PortRange, Protocol};

pub use flattener::MapFlattener;
pub use ports::{port_index, port_prefixes, PortPrefix};
pub use prefixes::union_prefixes;

/// Id of a peer set in `peer_prefixes`. 0 is never allocated (BPF "none").
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PeerSetId(pub u32);

/// Id of a rule list shared by every pod direction with identical rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SlotId(pub u32);

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PodSlotKey {
    pub pod_ip: IpAddr,
    pub direction: Direction,
}

/// Only isolated directions get an entry; no entry means allow all. A slot
/// without port entries (no rules) is default deny. `rule_count` is informative.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PodSlotValue {
    pub slot: SlotId,
    pub rule_count: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SlotPortKey {
    pub slot: SlotId,
    pub ports: PortPrefix,
}

/// One rule of a slot's rule list: its peers (the id of the rule's own peer
/// set) and ports (`None`: every protocol and port).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SlotRuleValue {
    pub peer_set: PeerSetId,
    pub ports: Option<Vec<PortRange>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PeerPrefixKey {
    pub peer_set: PeerSetId,
    pub prefix: IpNet,
}

/// Verdict of the longest matching prefix: `Deny` entries carve ipBlock
/// `except` ranges out of the enclosing `Allow` cidr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PrefixVerdict {
    Allow,
    Deny,
}

/// Full contents of the maps for one model.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MapEntries {
    pub pod_slots: BTreeMap<PodSlotKey, PodSlotValue>,
    pub slot_ports: BTreeMap<SlotPortKey, PeerSetId>,
    pub peer_prefixes: BTreeMap<PeerPrefixKey, PrefixVerdict>,
}

/// Upserts and deletes that turn one map's contents into another's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapChanges<K, V> {
    pub upserts: BTreeMap<K, V>,
    pub deletes: BTreeSet<K>,
}

impl<K, V> MapChanges<K, V> {
    pub fn is_empty(&self) -> bool {
        self.upserts.is_empty() && self.deletes.is_empty()
    }
}

/// Changes per map. Write order that never exposes a dangling id: first
/// `peer_prefixes` and `slot_ports` upserts, then `pod_slots`, then deletes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapDiff {
    pub pod_slots: MapChanges<PodSlotKey, PodSlotValue>,
    pub slot_ports: MapChanges<SlotPortKey, PeerSetId>,
    pub peer_prefixes: MapChanges<PeerPrefixKey, PrefixVerdict>,
}

impl MapDiff {
    pub fn is_empty(&self) -> bool {
        self.pod_slots.is_empty() && self.slot_ports.is_empty() && self.peer_prefixes.is_empty()
    }
}

fn diff_map<K: Ord + Clone, V: PartialEq + Clone>(old: &BTreeMap<K, V>, new: &BTreeMap<K, V>) -> MapChanges<K, V> {
    MapChanges {
        upserts: new.iter().filter(|(k, v)| old.get(*k) != Some(*v)).map(|(k, v)| (k.clone(), v.clone())).collect(),
        deletes: old.keys().filter(|k| !new.contains_key(*k)).cloned().collect(),
    }
}

impl MapEntries {
    pub fn diff(&self, newer: &MapEntries) -> MapDiff {
        MapDiff {
            pod_slots: diff_map(&self.pod_slots, &newer.pod_slots),
            slot_ports: diff_map(&self.slot_ports, &newer.slot_ports),
            peer_prefixes: diff_map(&self.peer_prefixes, &newer.peer_prefixes),
        }
    }

    /// Longest-prefix-match lookup, as an LPM trie keyed by (id, prefix) does.
    pub fn peer_set_contains(&self, peer_set: PeerSetId, ip: IpAddr) -> bool {
        // All prefixes of one peer set are contiguous in key order.
        let lower = PeerPrefixKey { peer_set, prefix: IpNet::V4(Ipv4Net::default()) };
        let upper = PeerPrefixKey { peer_set, prefix: IpNet::from(IpAddr::V6(Ipv6Addr::from(u128::MAX))) };
        self.peer_prefixes
            .range(lower..=upper)
            .filter(|(key, _)| key.prefix.contains(&ip))
            .max_by_key(|(key, _)| key.prefix.prefix_len())
            .is_some_and(|(_, verdict)| *verdict == PrefixVerdict::Allow)
    }

    /// The peer set a slot admits on `protocol`/`port`: its longest matching port entry.
    pub fn slot_peers(&self, slot: SlotId, protocol: Protocol, port: u16) -> Option<PeerSetId> {
        let lower = SlotPortKey { slot, ports: PortPrefix::AllProtocols };
        let upper =
            SlotPortKey { slot, ports: PortPrefix::Ports { protocol: Protocol::Sctp, start: u16::MAX, bits: u8::MAX } };
        self.slot_ports
            .range(lower..=upper)
            .filter(|(key, _)| key.ports.contains(protocol, port))
            .max_by_key(|(key, _)| key.ports.specificity())
            .map(|(_, peers)| *peers)
    }

    fn side_allows(
        &self,
        pod_ip: IpAddr,
        direction: Direction,
        peer_ip: IpAddr,
        protocol: Protocol,
        dst_port: u16,
    ) -> bool {
        let Some(slot) = self.pod_slots.get(&PodSlotKey { pod_ip, direction }) else {
            return true;
        };
        self.slot_peers(slot.slot, protocol, dst_port).is_some_and(|peers| self.peer_set_contains(peers, peer_ip))
    }

    /// The datapath's decision computed over the flattened maps; must equal
    /// [`super::allows`] on the model the entries came from.
    pub fn allows(&self, src_ip: IpAddr, dst_ip: IpAddr, protocol: Protocol, dst_port: u16) -> bool {
        self.side_allows(src_ip, Direction::Egress, dst_ip, protocol, dst_port)
            && self.side_allows(dst_ip, Direction::Ingress, src_ip, protocol, dst_port)
    }
}
