//! Flattens a [`CompiledModel`] into entries shaped like the BPF maps the
//! datapath reads (see docs/policy-layout.md):
//!
//! * `pod_slots`:     (pod IP, direction)      -> (slot, rule count)
//! * `slot_rules`:    (slot, rule index)       -> (peer set id, ports)
//! * `peer_prefixes`: (peer set id, IP prefix) -> Allow | Deny  (LPM trie)
//!
//! Ids are stable: a peer set definition or a rule list keeps its id across
//! flattenings as long as it is in use, so unchanged map entries stay
//! byte-identical and only real changes need writing.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use super::model::{CompiledModel, Direction, Isolation, PeerSet, PortRange, Ports, Protocol};

/// Port ranges one `slot_rules` value can hold; longer lists are split into
/// several rules with the same peer set (a union, so nothing is lost).
pub const MAX_PORT_RANGES_PER_RULE: usize = 8;

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

/// Only isolated directions get an entry; no entry means allow all.
/// `rule_count == 0` is default deny.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PodSlotValue {
    pub slot: SlotId,
    pub rule_count: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SlotRuleKey {
    pub slot: SlotId,
    pub rule_index: u32,
}

/// `ports: None` means all protocols and ports; otherwise
/// 1..=[`MAX_PORT_RANGES_PER_RULE`] ranges.
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
    pub slot_rules: BTreeMap<SlotRuleKey, SlotRuleValue>,
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
/// `peer_prefixes` and `slot_rules` upserts, then `pod_slots`, then deletes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapDiff {
    pub pod_slots: MapChanges<PodSlotKey, PodSlotValue>,
    pub slot_rules: MapChanges<SlotRuleKey, SlotRuleValue>,
    pub peer_prefixes: MapChanges<PeerPrefixKey, PrefixVerdict>,
}

impl MapDiff {
    pub fn is_empty(&self) -> bool {
        self.pod_slots.is_empty() && self.slot_rules.is_empty() && self.peer_prefixes.is_empty()
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
            slot_rules: diff_map(&self.slot_rules, &newer.slot_rules),
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
        (0..slot.rule_count).any(|rule_index| {
            self.slot_rules.get(&SlotRuleKey { slot: slot.slot, rule_index }).is_some_and(|rule| {
                let ports_ok = match &rule.ports {
                    None => true,
                    Some(ranges) => ranges.iter().any(|r| r.contains(protocol, dst_port)),
                };
                ports_ok && self.peer_set_contains(rule.peer_set, peer_ip)
            })
        })
    }

    /// The datapath's decision computed over the flattened maps; must equal
    /// [`super::allows`] on the model the entries came from.
    pub fn allows(&self, src_ip: IpAddr, dst_ip: IpAddr, protocol: Protocol, dst_port: u16) -> bool {
        self.side_allows(src_ip, Direction::Egress, dst_ip, protocol, dst_port)
            && self.side_allows(dst_ip, Direction::Ingress, src_ip, protocol, dst_port)
    }
}

/// Allocates ids that stay put while their definition is in use. Released
/// ids are recycled only from the *next* flattening on, so an id is never
/// reused for a new definition in the same batch of writes that stops
/// using it for the old one.
#[derive(Debug, Clone)]
struct StableIds<K: Ord> {
    ids: BTreeMap<K, u32>,
    free: Vec<u32>,
    next: u32,
}

impl<K: Ord + Clone> StableIds<K> {
    fn new() -> Self {
        StableIds { ids: BTreeMap::new(), free: Vec::new(), next: 1 }
    }

    fn get_or_allocate(&mut self, key: &K) -> u32 {
        if let Some(id) = self.ids.get(key) {
            return *id;
        }
        let id = self.free.pop().unwrap_or_else(|| {
            let id = self.next;
            self.next = self.next.saturating_add(1);
            id
        });
        self.ids.insert(key.clone(), id);
        id
    }

    fn release_unused(&mut self, used: &BTreeSet<K>) {
        let unused: Vec<K> = self.ids.keys().filter(|k| !used.contains(*k)).cloned().collect();
        for key in unused {
            if let Some(id) = self.ids.remove(&key) {
                self.free.push(id);
            }
        }
        // Pop smallest ids first to keep the id space compact.
        self.free.sort_unstable_by(|a, b| b.cmp(a));
    }
}

/// Turns models into map entries, remembering id assignments between calls.
#[derive(Debug, Clone)]
pub struct MapFlattener {
    peer_set_ids: StableIds<PeerSet>,
    slot_ids: StableIds<Vec<SlotRuleValue>>,
}

impl Default for MapFlattener {
    fn default() -> Self {
        MapFlattener::new()
    }
}

impl MapFlattener {
    pub fn new() -> MapFlattener {
        MapFlattener { peer_set_ids: StableIds::new(), slot_ids: StableIds::new() }
    }

    pub fn flatten(&mut self, model: &CompiledModel) -> MapEntries {
        let mut entries = MapEntries::default();
        let mut used_peer_sets: BTreeSet<PeerSet> = BTreeSet::new();
        let mut used_slots: BTreeSet<Vec<SlotRuleValue>> = BTreeSet::new();

        for (ip, pod) in &model.pods {
            for direction in Direction::ALL {
                let Isolation::Isolated(rules) = pod.direction(direction) else {
                    continue;
                };
                let mut values = Vec::new();
                for rule in rules {
                    let peer_set = PeerSetId(self.peer_set_ids.get_or_allocate(&rule.peers));
                    used_peer_sets.insert(rule.peers.clone());
                    match &rule.ports {
                        Ports::All => values.push(SlotRuleValue { peer_set, ports: None }),
                        Ports::Ranges(ranges) => values.extend(
                            ranges
                                .chunks(MAX_PORT_RANGES_PER_RULE)
                                .map(|chunk| SlotRuleValue { peer_set, ports: Some(chunk.to_vec()) }),
                        ),
                    }
                }
                let slot = SlotId(self.slot_ids.get_or_allocate(&values));
                let rule_count = u32::try_from(values.len()).unwrap_or(u32::MAX);
                entries.pod_slots.insert(PodSlotKey { pod_ip: *ip, direction }, PodSlotValue { slot, rule_count });
                if used_slots.insert(values.clone()) {
                    for (index, value) in values.into_iter().enumerate() {
                        let rule_index = u32::try_from(index).unwrap_or(u32::MAX);
                        entries.slot_rules.insert(SlotRuleKey { slot, rule_index }, value);
                    }
                }
            }
        }

        for peers in &used_peer_sets {
            let peer_set = PeerSetId(self.peer_set_ids.get_or_allocate(peers));
            let mut put = |prefix: IpNet, verdict| {
                entries.peer_prefixes.insert(PeerPrefixKey { peer_set, prefix }, verdict);
            };
            match peers {
                PeerSet::Any => {
                    // 0.0.0.0/0 and ::/0.
                    put(IpNet::V4(Ipv4Net::default()), PrefixVerdict::Allow);
                    put(IpNet::V6(Ipv6Net::default()), PrefixVerdict::Allow);
                }
                PeerSet::Pods(key) => {
                    for ip in model.pod_sets.get(key).into_iter().flatten() {
                        put(IpNet::from(*ip), PrefixVerdict::Allow);
                    }
                }
                PeerSet::Cidr { cidr, except } => {
                    put(*cidr, PrefixVerdict::Allow);
                    for e in except {
                        put(*e, PrefixVerdict::Deny);
                    }
                }
            }
        }

        self.peer_set_ids.release_unused(&used_peer_sets);
        self.slot_ids.release_unused(&used_slots);
        entries
    }

    /// Flattens `model` re-using the ids of `programmed` (what a previous agent left in the
    /// maps) wherever a peer set or rule list has the same content, so a restarted agent
    /// writes only real differences. Content without a match gets ids unused by `programmed`,
    /// so nothing a pod still points at is overwritten before its new entry is in place.
    pub fn adopt(&mut self, model: &CompiledModel, programmed: &MapEntries) -> MapEntries {
        let fresh = self.flatten(model);
        let contents = |entries: &MapEntries| {
            let mut by_id: BTreeMap<u32, BTreeSet<(IpNet, PrefixVerdict)>> = BTreeMap::new();
            for (key, verdict) in &entries.peer_prefixes {
                by_id.entry(key.peer_set.0).or_default().insert((key.prefix, *verdict));
            }
            by_id
        };
        let old_sets = contents(programmed);
        let new_sets = contents(&fresh);
        let mut taken: BTreeSet<u32> = old_sets.keys().copied().collect();
        taken.extend(programmed.slot_rules.keys().map(|k| k.slot.0));
        let mut next = taken.iter().max().copied().unwrap_or(0).max(self.peer_set_ids.next).max(self.slot_ids.next) + 1;
        let mut fresh_id = || {
            let id = next;
            next += 1;
            id
        };
        let mut peer_remap = BTreeMap::new();
        let mut claimed = BTreeSet::new();
        for (id, content) in &new_sets {
            let old = old_sets.iter().find(|(old, c)| *c == content && !claimed.contains(*old)).map(|(o, _)| *o);
            let target = old.unwrap_or_else(&mut fresh_id);
            claimed.insert(target);
            peer_remap.insert(*id, target);
        }
        let rule_lists = |entries: &MapEntries, remap: &BTreeMap<u32, u32>| {
            let mut by_slot: BTreeMap<u32, Vec<SlotRuleValue>> = BTreeMap::new();
            for (key, value) in &entries.slot_rules {
                let mut value = value.clone();
                value.peer_set = PeerSetId(remap.get(&value.peer_set.0).copied().unwrap_or(value.peer_set.0));
                by_slot.entry(key.slot.0).or_default().push(value);
            }
            by_slot
        };
        let old_slots = rule_lists(programmed, &BTreeMap::new());
        let new_slots = rule_lists(&fresh, &peer_remap);
        let mut slot_remap = BTreeMap::new();
        let mut claimed = BTreeSet::new();
        for (id, rules) in &new_slots {
            let old = old_slots.iter().find(|(old, r)| *r == rules && !claimed.contains(*old)).map(|(o, _)| *o);
            let target = old.unwrap_or_else(&mut fresh_id);
            claimed.insert(target);
            slot_remap.insert(*id, target);
        }
        for id in self.peer_set_ids.ids.values_mut() {
            *id = peer_remap.get(id).copied().unwrap_or(*id);
        }
        // Rule lists are keyed by their content, which names peer sets: rename those too.
        let slot_ids = std::mem::take(&mut self.slot_ids.ids);
        self.slot_ids.ids = slot_ids
            .into_iter()
            .map(|(mut rules, id)| {
                for rule in &mut rules {
                    rule.peer_set = PeerSetId(peer_remap.get(&rule.peer_set.0).copied().unwrap_or(rule.peer_set.0));
                }
                (rules, slot_remap.get(&id).copied().unwrap_or(id))
            })
            .collect();
        self.peer_set_ids.free.clear();
        self.slot_ids.free.clear();
        self.peer_set_ids.next = next;
        self.slot_ids.next = next;
        self.flatten(model)
    }
}
