//! The incremental flattener: models (or a few changed pods and pod sets) in, map entries and
//! their diff out, with the reference counts that let one pod direction or pod set come and go
//! on its own.
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{IpAddr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net};

use super::{
    ids::StableIds,
    port_index,
    prefixes::{set_prefixes, union_prefixes},
    MapChanges, MapDiff, MapEntries, PeerPrefixKey, PeerSetId, PodSlotKey, PodSlotValue, PortPrefix, PrefixVerdict,
    SlotId, SlotPortKey, SlotRuleValue,
};
use crate::policy::model::{CompiledModel, Direction, Isolation, PeerSet, PodRules, PodSetKey, PortRange, Ports, Rule};

/// Turns models into map entries, remembering id assignments between calls. It keeps what it
/// flattened last, so a change of a few pods or pod sets ([`MapFlattener::update`]) touches only
/// their entries and yields the diff directly.
#[derive(Debug, Clone)]
pub struct MapFlattener {
    /// A rule's peers are a set of one; merged sets have several members.
    peer_set_ids: StableIds<BTreeSet<PeerSet>>,
    slot_ids: StableIds<Vec<SlotRuleValue>>,
    state: Flattened,
}

/// What the last flattening produced, with the reference counts that let one pod direction or
/// pod set be added or removed on its own.
#[derive(Debug, Clone, Default)]
struct Flattened {
    entries: MapEntries,
    /// Each isolated pod direction's rule list (its slot's key).
    pods: BTreeMap<PodSlotKey, Vec<SlotRuleValue>>,
    slots: BTreeMap<Vec<SlotRuleValue>, SlotState>,
    /// Per peer set: (slots whose rules name it, port entries pointing at it). Its id lives
    /// while either is non-zero; its prefixes are written while the second is.
    sets: BTreeMap<BTreeSet<PeerSet>, (usize, usize)>,
    /// Written sets with a pod-selector member, by pod set: what a membership change rewrites.
    by_pod_set: BTreeMap<PodSetKey, BTreeSet<BTreeSet<PeerSet>>>,
}

#[derive(Debug, Clone)]
struct SlotState {
    /// Pod directions using the slot.
    users: usize,
    /// Its port entries and the peer sets they point at.
    index: Vec<(PortPrefix, BTreeSet<PeerSet>)>,
    /// Each rule's own peer set.
    owns: Vec<BTreeSet<PeerSet>>,
}

/// The entries a flattening touched, with their values before it: the diff is computed from
/// these alone.
#[derive(Default)]
struct Touched {
    /// Off for a full flattening, whose result replaces everything anyway.
    record: bool,
    pod_slots: BTreeMap<PodSlotKey, Option<PodSlotValue>>,
    slot_ports: BTreeMap<SlotPortKey, Option<PeerSetId>>,
    peer_prefixes: BTreeMap<PeerPrefixKey, Option<PrefixVerdict>>,
    /// Each peer set's prefixes, computed once per flattening (the model does not change within
    /// one) however many merged sets it is a member of.
    member_prefixes: HashMap<PeerSet, BTreeMap<IpNet, PrefixVerdict>>,
    /// A full flattening's ids of one-peer sets, by peer: 10,000 pods name the same ~2,000
    /// peers, and this spares each rule a one-element set to look its id up by. Only while
    /// nothing is released (a full flattening releases after all pods are added).
    own_ids: HashMap<PeerSet, u32>,
}

fn touch<K: Ord + Clone, V: Clone>(record: bool, touched: &mut BTreeMap<K, Option<V>>, map: &BTreeMap<K, V>, key: &K) {
    if record && !touched.contains_key(key) {
        touched.insert(key.clone(), map.get(key).cloned());
    }
}

fn changes_of<K: Ord + Clone, V: PartialEq + Clone>(
    touched: BTreeMap<K, Option<V>>,
    now: &BTreeMap<K, V>,
) -> MapChanges<K, V> {
    let mut changes = MapChanges { upserts: BTreeMap::new(), deletes: BTreeSet::new() };
    for (key, before) in touched {
        match (before, now.get(&key)) {
            (before, Some(after)) if before.as_ref() != Some(after) => drop(changes.upserts.insert(key, after.clone())),
            (Some(_), None) => drop(changes.deletes.insert(key)),
            _ => {}
        }
    }
    changes
}

impl Default for MapFlattener {
    fn default() -> Self {
        MapFlattener::new()
    }
}

impl MapFlattener {
    pub fn new() -> MapFlattener {
        MapFlattener { peer_set_ids: StableIds::new(), slot_ids: StableIds::new(), state: Flattened::default() }
    }

    /// The entries of every pod of `model` (ids kept from earlier flattenings where the content
    /// is the same).
    pub fn flatten(&mut self, model: &CompiledModel) -> MapEntries {
        self.state = Flattened::default();
        let mut touched = Touched::default();
        for (ip, pod) in &model.pods {
            for direction in Direction::ALL {
                if let Isolation::Isolated(rules) = pod.direction(direction) {
                    self.add_pod(PodSlotKey { pod_ip: *ip, direction }, rules, model, &mut touched);
                }
            }
        }
        let used_sets: BTreeSet<BTreeSet<PeerSet>> = self.state.sets.keys().cloned().collect();
        let used_slots: BTreeSet<Vec<SlotRuleValue>> = self.state.slots.keys().cloned().collect();
        self.peer_set_ids.release_unused(&used_sets);
        self.slot_ids.release_unused(&used_slots);
        self.peer_set_ids.commit();
        self.slot_ids.commit();
        self.state.entries.clone()
    }

    /// Applies a change of the model: the pods whose entries changed (`Some` rules; `None`:
    /// gone), filtered to those this node programs, and the pod sets whose members changed
    /// (`model` holds their new members). Returns the difference to write.
    pub fn update(
        &mut self,
        model: &CompiledModel,
        pods: &BTreeMap<IpAddr, Option<PodRules>>,
        pod_sets: &BTreeSet<PodSetKey>,
    ) -> MapDiff {
        let mut touched = Touched { record: true, ..Touched::default() };
        for (ip, rules) in pods {
            for direction in Direction::ALL {
                let key = PodSlotKey { pod_ip: *ip, direction };
                let wanted = match rules.as_ref().map(|r| r.direction(direction)) {
                    Some(Isolation::Isolated(rules)) => Some(rules),
                    _ => None,
                };
                let now = self.state.pods.get(&key);
                if let (Some(now), Some(wanted)) = (now, wanted) {
                    if self.rule_values_match(now, wanted) {
                        continue;
                    }
                }
                self.remove_pod(&key, &mut touched);
                if let Some(rules) = wanted {
                    self.add_pod(key, rules, model, &mut touched);
                }
            }
        }
        let sets: BTreeSet<BTreeSet<PeerSet>> =
            pod_sets.iter().filter_map(|key| self.state.by_pod_set.get(key)).flatten().cloned().collect();
        for members in sets {
            self.write_set(&members, model, &mut touched);
        }
        self.peer_set_ids.commit();
        self.slot_ids.commit();
        let entries = &self.state.entries;
        MapDiff {
            pod_slots: changes_of(touched.pod_slots, &entries.pod_slots),
            slot_ports: changes_of(touched.slot_ports, &entries.slot_ports),
            peer_prefixes: changes_of(touched.peer_prefixes, &entries.peer_prefixes),
        }
    }

    /// Whether `ip` has entries (an isolated direction) in what the flattener holds.
    pub fn holds_pod(&self, ip: IpAddr) -> bool {
        Direction::ALL
            .iter()
            .any(|direction| self.state.pods.contains_key(&PodSlotKey { pod_ip: ip, direction: *direction }))
    }

    /// What the flattener holds now (the maps after the last flatten or update).
    pub fn entries(&self) -> &MapEntries {
        &self.state.entries
    }

    fn rule_values_match(&self, values: &[SlotRuleValue], rules: &[Rule]) -> bool {
        values.len() == rules.len()
            && values.iter().zip(rules).all(|(value, rule)| {
                let own = BTreeSet::from([rule.peers.clone()]);
                self.peer_set_ids.ids.get(&own) == Some(&value.peer_set.0)
                    && match (&value.ports, &rule.ports) {
                        (None, Ports::All) => true,
                        (Some(a), Ports::Ranges(b)) => a == b,
                        _ => false,
                    }
            })
    }

    fn add_pod(&mut self, key: PodSlotKey, rules: &[Rule], model: &CompiledModel, touched: &mut Touched) {
        let values: Vec<SlotRuleValue> = rules
            .iter()
            .map(|rule| {
                let peer_set = PeerSetId(match touched.own_ids.get(&rule.peers) {
                    Some(id) => *id,
                    None => {
                        let id = self.peer_set_ids.get_or_allocate(&BTreeSet::from([rule.peers.clone()]));
                        if !touched.record {
                            touched.own_ids.insert(rule.peers.clone(), id);
                        }
                        id
                    }
                });
                let ports = match &rule.ports {
                    Ports::All => None,
                    Ports::Ranges(ranges) => Some(ranges.clone()),
                };
                SlotRuleValue { peer_set, ports }
            })
            .collect();
        let slot = SlotId(self.slot_ids.get_or_allocate(&values));
        if let Some(slot_state) = self.state.slots.get_mut(&values) {
            slot_state.users += 1;
        } else {
            let owns: Vec<BTreeSet<PeerSet>> = rules.iter().map(|rule| BTreeSet::from([rule.peers.clone()])).collect();
            for own in &owns {
                self.state.sets.entry(own.clone()).or_default().0 += 1;
            }
            let indexed: Vec<(&PeerSet, Option<&[PortRange]>)> = rules
                .iter()
                .map(|rule| match &rule.ports {
                    Ports::All => (&rule.peers, None),
                    Ports::Ranges(ranges) => (&rule.peers, Some(ranges.as_slice())),
                })
                .collect();
            let index: Vec<(PortPrefix, BTreeSet<PeerSet>)> = port_index(&indexed)
                .into_iter()
                .map(|(ports, members)| (ports, members.into_iter().cloned().collect()))
                .collect();
            for (ports, members) in &index {
                let peer_set = PeerSetId(self.peer_set_ids.get_or_allocate(members));
                let port_key = SlotPortKey { slot, ports: *ports };
                touch(touched.record, &mut touched.slot_ports, &self.state.entries.slot_ports, &port_key);
                self.state.entries.slot_ports.insert(port_key, peer_set);
                let refs = self.state.sets.entry(members.clone()).or_default();
                refs.1 += 1;
                if refs.1 == 1 {
                    for peers in members {
                        if let PeerSet::Pods(pod_set) = peers {
                            self.state.by_pod_set.entry(pod_set.clone()).or_default().insert(members.clone());
                        }
                    }
                    self.write_set(members, model, touched);
                }
            }
            self.state.slots.insert(values.clone(), SlotState { users: 1, index, owns });
        }
        let rule_count = u32::try_from(rules.len()).unwrap_or(u32::MAX);
        touch(touched.record, &mut touched.pod_slots, &self.state.entries.pod_slots, &key);
        self.state.entries.pod_slots.insert(key, PodSlotValue { slot, rule_count });
        self.state.pods.insert(key, values);
    }

    fn remove_pod(&mut self, key: &PodSlotKey, touched: &mut Touched) {
        let Some(values) = self.state.pods.remove(key) else { return };
        touch(touched.record, &mut touched.pod_slots, &self.state.entries.pod_slots, key);
        self.state.entries.pod_slots.remove(key);
        let Some(slot_state) = self.state.slots.get_mut(&values) else { return };
        slot_state.users -= 1;
        if slot_state.users > 0 {
            return;
        }
        let Some(SlotState { index, owns, .. }) = self.state.slots.remove(&values) else { return };
        let slot = SlotId(self.slot_ids.ids.get(&values).copied().unwrap_or(0));
        for (ports, members) in index {
            let port_key = SlotPortKey { slot, ports };
            touch(touched.record, &mut touched.slot_ports, &self.state.entries.slot_ports, &port_key);
            self.state.entries.slot_ports.remove(&port_key);
            if let Some(refs) = self.state.sets.get_mut(&members) {
                refs.1 -= 1;
                if refs.1 == 0 {
                    self.clear_set(&members, touched);
                    for peers in &members {
                        if let PeerSet::Pods(pod_set) = peers {
                            if let Some(sets) = self.state.by_pod_set.get_mut(pod_set) {
                                sets.remove(&members);
                                if sets.is_empty() {
                                    self.state.by_pod_set.remove(pod_set);
                                }
                            }
                        }
                    }
                }
            }
            self.release_set_if_unused(&members);
        }
        for own in owns {
            if let Some(refs) = self.state.sets.get_mut(&own) {
                refs.0 = refs.0.saturating_sub(1);
            }
            self.release_set_if_unused(&own);
        }
        self.slot_ids.release(&values);
    }

    fn release_set_if_unused(&mut self, members: &BTreeSet<PeerSet>) {
        if self.state.sets.get(members).is_some_and(|refs| *refs == (0, 0)) {
            self.state.sets.remove(members);
            self.peer_set_ids.release(members);
        }
    }

    /// The prefixes a written set must hold now.
    fn set_contents(
        members: &BTreeSet<PeerSet>,
        model: &CompiledModel,
        known: &mut HashMap<PeerSet, BTreeMap<IpNet, PrefixVerdict>>,
    ) -> BTreeMap<IpNet, PrefixVerdict> {
        for member in members {
            if !known.contains_key(member) {
                known.insert(member.clone(), set_prefixes(member, model));
            }
        }
        let prefixes: Vec<&BTreeMap<IpNet, PrefixVerdict>> = members.iter().map(|m| &known[m]).collect();
        match prefixes.as_slice() {
            [only] => (*only).clone(),
            many => union_prefixes(many),
        }
    }

    fn set_range(&self, peer_set: PeerSetId) -> Vec<PeerPrefixKey> {
        let lower = PeerPrefixKey { peer_set, prefix: IpNet::V4(Ipv4Net::default()) };
        let upper = PeerPrefixKey { peer_set, prefix: IpNet::from(IpAddr::V6(Ipv6Addr::from(u128::MAX))) };
        self.state.entries.peer_prefixes.range(lower..=upper).map(|(k, _)| *k).collect()
    }

    /// (Re)writes a set's prefixes from the model, touching only those that change.
    fn write_set(&mut self, members: &BTreeSet<PeerSet>, model: &CompiledModel, touched: &mut Touched) {
        let Some(id) = self.peer_set_ids.ids.get(members).copied() else { return };
        let peer_set = PeerSetId(id);
        let wanted = Self::set_contents(members, model, &mut touched.member_prefixes);
        for key in self.set_range(peer_set) {
            if !wanted.contains_key(&key.prefix) {
                touch(touched.record, &mut touched.peer_prefixes, &self.state.entries.peer_prefixes, &key);
                self.state.entries.peer_prefixes.remove(&key);
            }
        }
        for (prefix, verdict) in wanted {
            let key = PeerPrefixKey { peer_set, prefix };
            if self.state.entries.peer_prefixes.get(&key) != Some(&verdict) {
                touch(touched.record, &mut touched.peer_prefixes, &self.state.entries.peer_prefixes, &key);
                self.state.entries.peer_prefixes.insert(key, verdict);
            }
        }
    }

    fn clear_set(&mut self, members: &BTreeSet<PeerSet>, touched: &mut Touched) {
        let Some(id) = self.peer_set_ids.ids.get(members).copied() else { return };
        for key in self.set_range(PeerSetId(id)) {
            touch(touched.record, &mut touched.peer_prefixes, &self.state.entries.peer_prefixes, &key);
            self.state.entries.peer_prefixes.remove(&key);
        }
    }

    /// Flattens `model` re-using the ids of `programmed` (what a previous agent left in the
    /// maps) wherever a peer set or slot has the same content, so a restarted agent writes
    /// only real differences. Content without a match gets ids unused by `programmed`, so
    /// nothing a pod still points at is overwritten before its new entry is in place.
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
        let slot_ids_of = |entries: &MapEntries| -> BTreeSet<u32> {
            entries.pod_slots.values().map(|v| v.slot.0).chain(entries.slot_ports.keys().map(|k| k.slot.0)).collect()
        };
        let mut taken: BTreeSet<u32> = old_sets.keys().copied().collect();
        taken.extend(slot_ids_of(programmed));
        taken.extend(programmed.slot_ports.values().map(|id| id.0));
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
        // Sets with no prefixes written (a rule's own set that only appears merged) still name
        // rules in slot keys: they move out of the way too.
        for id in self.peer_set_ids.ids.values() {
            if !peer_remap.contains_key(id) {
                peer_remap.insert(*id, fresh_id());
            }
        }
        let slot_contents = |entries: &MapEntries, remap: &BTreeMap<u32, u32>| {
            let mut by_slot: BTreeMap<u32, BTreeMap<PortPrefix, u32>> =
                slot_ids_of(entries).into_iter().map(|slot| (slot, BTreeMap::new())).collect();
            for (key, peers) in &entries.slot_ports {
                let peers = remap.get(&peers.0).copied().unwrap_or(peers.0);
                by_slot.entry(key.slot.0).or_default().insert(key.ports, peers);
            }
            by_slot
        };
        let old_slots = slot_contents(programmed, &BTreeMap::new());
        let new_slots = slot_contents(&fresh, &peer_remap);
        let mut slot_remap = BTreeMap::new();
        let mut claimed = BTreeSet::new();
        for (id, ports) in &new_slots {
            let old = old_slots.iter().find(|(old, p)| *p == ports && !claimed.contains(*old)).map(|(o, _)| *o);
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
                let target = slot_remap.get(&id).copied().unwrap_or_else(&mut fresh_id);
                (rules, target)
            })
            .collect();
        self.peer_set_ids.free.clear();
        self.slot_ids.free.clear();
        self.peer_set_ids.pending.clear();
        self.slot_ids.pending.clear();
        self.peer_set_ids.next = next;
        self.slot_ids.next = next;
        self.flatten(model)
    }
}
