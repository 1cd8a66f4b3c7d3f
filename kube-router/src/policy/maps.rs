//! The pinned NetworkPolicy maps (`pol_pods_v4/v6`, `pol_ports`, `pol_peers_v4/v6`,
//! `pol_ct_v4/v6`, `pol_stats`): encoding of the compiler's [`MapEntries`] / [`MapDiff`] into their byte layouts,
//! a writer that applies a diff in an order that never leaves the datapath following a dangling
//! id, and readers for dumps, stats and conntrack GC.
//!
//! The maps are created and pinned by [`crate::bpf::datapath::Datapath::load`] (they are part of the
//! datapath object); this module only opens them. Pods and prefixes go to the map of their
//! address family; port entries are shared.
use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::Path,
};

use anyhow::Result;
use aya::maps::{
    lpm_trie::{Key, LpmTrie},
    HashMap, Map, MapData, MapError, PerCpuArray,
};
use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use kube_router_common::*;

use crate::pinned::write_error;
use crate::{
    map_writes::{write_ops, MapOperation, MapWriteError, SyncReport, WriteRules, WriteTarget},
    policy::{
        flatten::{
            MapDiff, MapEntries, PeerPrefixKey, PeerSetId, PodSlotKey, PodSlotValue, PortPrefix, PrefixVerdict, SlotId,
            SlotPortKey,
        },
        Direction, Protocol,
    },
};

/// An LPM trie key as stored: prefix length and data. aya's `Key` is packed and not `Ord`; this
/// is the same bytes in a comparable form.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LpmKey<T> {
    pub prefix_len: u32,
    pub data: T,
}

impl<T: aya::Pod> LpmKey<T> {
    fn to_lpm(self) -> Key<T> {
        Key::new(self.prefix_len, self.data)
    }

    fn from_lpm(key: &Key<T>) -> Self {
        LpmKey { prefix_len: key.prefix_len(), data: key.data() }
    }
}

/// A `pol_peers_v4` key: 32 peer-set bits + address bits.
pub type PeerKeyV4 = LpmKey<PeerPrefixV4>;
/// A `pol_peers_v6` key.
pub type PeerKeyV6 = LpmKey<PeerPrefixV6>;
/// A `pol_ports` key: slot, protocol and port bits.
pub type PortKey = LpmKey<PolicyPortKey>;

/// A pod direction key of either family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodKey {
    V4(PolicyPodKeyV4),
    V6(PolicyPodKeyV6),
}

/// A peer prefix key of either family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerKey {
    V4(PeerKeyV4),
    V6(PeerKeyV6),
}

/// One write to the policy maps, already in map byte layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PolicyMapOp {
    PutPeerPrefix(PeerKey, u8),
    PutPort(PortKey, PolicyPortValue),
    PutPod(PodKey, PolicyPodValue),
    DeletePod(PodKey),
    DeletePort(PortKey),
    DeletePeerPrefix(PeerKey),
}

impl PolicyMapOp {
    pub fn map_name(&self) -> &'static str {
        match self {
            PolicyMapOp::PutPeerPrefix(PeerKey::V4(_), _) | PolicyMapOp::DeletePeerPrefix(PeerKey::V4(_)) => {
                map_names::POLICY_PEERS
            }
            PolicyMapOp::PutPeerPrefix(PeerKey::V6(_), _) | PolicyMapOp::DeletePeerPrefix(PeerKey::V6(_)) => {
                map_names::POLICY_PEERS_V6
            }
            PolicyMapOp::PutPort(..) | PolicyMapOp::DeletePort(_) => map_names::POLICY_PORTS,
            PolicyMapOp::PutPod(PodKey::V4(_), _) | PolicyMapOp::DeletePod(PodKey::V4(_)) => map_names::POLICY_PODS,
            PolicyMapOp::PutPod(PodKey::V6(_), _) | PolicyMapOp::DeletePod(PodKey::V6(_)) => map_names::POLICY_PODS_V6,
        }
    }

    pub fn is_delete(&self) -> bool {
        matches!(self, PolicyMapOp::DeletePod(_) | PolicyMapOp::DeletePort(_) | PolicyMapOp::DeletePeerPrefix(_))
    }
}

/// Contents of the five compiled-policy maps, in map byte layout.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PolicyMapContents {
    pub pods: BTreeMap<PolicyPodKeyV4, PolicyPodValue>,
    pub ports: BTreeMap<PortKey, PolicyPortValue>,
    pub peers: BTreeMap<PeerKeyV4, u8>,
    pub pods_v6: BTreeMap<PolicyPodKeyV6, PolicyPodValue>,
    pub peers_v6: BTreeMap<PeerKeyV6, u8>,
}

impl PolicyMapContents {
    pub fn len(&self) -> usize {
        self.pods.len() + self.ports.len() + self.peers.len() + self.pods_v6.len() + self.peers_v6.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn apply(&mut self, op: &PolicyMapOp) {
        match op {
            PolicyMapOp::PutPeerPrefix(PeerKey::V4(k), v) => drop(self.peers.insert(*k, *v)),
            PolicyMapOp::PutPeerPrefix(PeerKey::V6(k), v) => drop(self.peers_v6.insert(*k, *v)),
            PolicyMapOp::PutPort(k, v) => drop(self.ports.insert(*k, *v)),
            PolicyMapOp::PutPod(PodKey::V4(k), v) => drop(self.pods.insert(*k, *v)),
            PolicyMapOp::PutPod(PodKey::V6(k), v) => drop(self.pods_v6.insert(*k, *v)),
            PolicyMapOp::DeletePod(PodKey::V4(k)) => drop(self.pods.remove(k)),
            PolicyMapOp::DeletePod(PodKey::V6(k)) => drop(self.pods_v6.remove(k)),
            PolicyMapOp::DeletePort(k) => drop(self.ports.remove(k)),
            PolicyMapOp::DeletePeerPrefix(PeerKey::V4(k)) => drop(self.peers.remove(k)),
            PolicyMapOp::DeletePeerPrefix(PeerKey::V6(k)) => drop(self.peers_v6.remove(k)),
        }
    }
}

/// Where policy map writes go: the pinned maps, or an in-memory copy in tests.
pub trait PolicyMaps {
    fn write(&mut self, op: &PolicyMapOp) -> Result<(), MapWriteError>;
    fn read_all(&self) -> Result<PolicyMapContents, MapWriteError>;
}

impl PolicyMaps for PolicyMapContents {
    fn write(&mut self, op: &PolicyMapOp) -> Result<(), MapWriteError> {
        self.apply(op);
        Ok(())
    }

    fn read_all(&self) -> Result<PolicyMapContents, MapWriteError> {
        Ok(self.clone())
    }
}

// ---- encoding -------------------------------------------------------------------------------

fn direction_code(direction: Direction) -> u8 {
    match direction {
        Direction::Ingress => POLICY_DIR_INGRESS,
        Direction::Egress => POLICY_DIR_EGRESS,
    }
}

fn ipv4_nbo(addr: Ipv4Addr) -> u32 {
    // Network byte order in memory: the octets as they appear in a packet.
    u32::from_ne_bytes(addr.octets())
}

pub fn encode_pod_key(key: &PodSlotKey) -> PodKey {
    let direction = direction_code(key.direction);
    match key.pod_ip {
        IpAddr::V4(addr) => PodKey::V4(PolicyPodKeyV4 { addr: ipv4_nbo(addr), direction, pad: [0; 3] }),
        IpAddr::V6(addr) => {
            PodKey::V6(PolicyPodKeyV6 { addr: Ipv6Words::from_octets(addr.octets()), direction, pad: [0; 3] })
        }
    }
}

pub fn encode_pod_value(value: &PodSlotValue) -> PolicyPodValue {
    PolicyPodValue { slot: value.slot.0, rule_count: value.rule_count }
}

/// The LPM key of a port entry: the slot (big-endian), then the protocol, then the port's
/// leading bits.
pub fn encode_port_key(key: &SlotPortKey) -> PortKey {
    let slot_be = key.slot.0.to_be();
    match key.ports {
        PortPrefix::AllProtocols => PortKey {
            prefix_len: POLICY_PORT_SLOT_BITS,
            data: PolicyPortKey { slot_be, proto: 0, port: [0; 2], pad: 0 },
        },
        PortPrefix::Ports { protocol, start, bits } => PortKey {
            prefix_len: POLICY_PORT_PROTO_BITS + u32::from(bits),
            data: PolicyPortKey { slot_be, proto: protocol.ip_protocol_number(), port: start.to_be_bytes(), pad: 0 },
        },
    }
}

/// The LPM key of a peer prefix: the peer-set id (big-endian) is matched in full before the
/// address, so `prefix_len = 32 + prefix length`.
pub fn encode_peer_key(key: &PeerPrefixKey) -> PeerKey {
    let peer_set_be = key.peer_set.0.to_be();
    let prefix_len = PEER_SET_PREFIX_BITS + u32::from(key.prefix.prefix_len());
    match key.prefix.trunc() {
        IpNet::V4(net) => {
            PeerKey::V4(PeerKeyV4 { prefix_len, data: PeerPrefixV4 { peer_set_be, addr: ipv4_nbo(net.network()) } })
        }
        IpNet::V6(net) => PeerKey::V6(PeerKeyV6 {
            prefix_len,
            data: PeerPrefixV6 { peer_set_be, addr: Ipv6Words::from_octets(net.network().octets()) },
        }),
    }
}

pub fn encode_verdict(verdict: PrefixVerdict) -> u8 {
    match verdict {
        PrefixVerdict::Allow => PEER_ALLOW,
        PrefixVerdict::Deny => PEER_DENY,
    }
}

/// Orders the writes as `flatten::MapDiff` requires: peer prefixes and port entries first
/// (nothing refers to a new one yet), then pod slots (now pointing at complete entries), then
/// deletes of pod slots, port entries and peer prefixes (nothing refers to them any more).
pub fn encode_diff(diff: &MapDiff) -> Vec<PolicyMapOp> {
    let mut ops = Vec::new();
    for (key, verdict) in &diff.peer_prefixes.upserts {
        ops.push(PolicyMapOp::PutPeerPrefix(encode_peer_key(key), encode_verdict(*verdict)));
    }
    for (key, peers) in &diff.slot_ports.upserts {
        ops.push(PolicyMapOp::PutPort(encode_port_key(key), PolicyPortValue { peer_set: peers.0 }));
    }
    for (key, value) in &diff.pod_slots.upserts {
        ops.push(PolicyMapOp::PutPod(encode_pod_key(key), encode_pod_value(value)));
    }
    ops.extend(diff.pod_slots.deletes.iter().map(|key| PolicyMapOp::DeletePod(encode_pod_key(key))));
    ops.extend(diff.slot_ports.deletes.iter().map(|key| PolicyMapOp::DeletePort(encode_port_key(key))));
    ops.extend(diff.peer_prefixes.deletes.iter().map(|key| PolicyMapOp::DeletePeerPrefix(encode_peer_key(key))));
    ops
}

/// The full contents the maps should hold for `entries`.
pub fn encode_entries(entries: &MapEntries) -> PolicyMapContents {
    let mut contents = PolicyMapContents::default();
    for op in encode_diff(&MapEntries::default().diff(entries)) {
        contents.apply(&op);
    }
    contents
}

// ---- decoding (dumps, adoption after a restart) ---------------------------------------------

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("{map}: unknown {what} {value}")]
    Unknown { map: &'static str, what: &'static str, value: u32 },
}

fn unknown(map: &'static str, what: &'static str, value: u32) -> DecodeError {
    DecodeError::Unknown { map, what, value }
}

pub(crate) fn protocol_from_number(number: u8) -> Option<Protocol> {
    [Protocol::Tcp, Protocol::Udp, Protocol::Sctp].into_iter().find(|p| p.ip_protocol_number() == number)
}

/// Turns map contents back into the compiler's terms (the inverse of [`encode_entries`]).
pub fn decode(contents: &PolicyMapContents) -> Result<MapEntries, DecodeError> {
    let mut entries = MapEntries::default();
    let direction = |map: &'static str, code: u8| match code {
        POLICY_DIR_INGRESS => Ok(Direction::Ingress),
        POLICY_DIR_EGRESS => Ok(Direction::Egress),
        other => Err(unknown(map, "direction", other.into())),
    };
    let slot = |value: &PolicyPodValue| PodSlotValue { slot: SlotId(value.slot), rule_count: value.rule_count };
    for (key, value) in &contents.pods {
        let pod_ip = IpAddr::V4(Ipv4Addr::from(key.addr.to_ne_bytes()));
        let direction = direction(map_names::POLICY_PODS, key.direction)?;
        entries.pod_slots.insert(PodSlotKey { pod_ip, direction }, slot(value));
    }
    for (key, value) in &contents.pods_v6 {
        let pod_ip = IpAddr::V6(Ipv6Addr::from(key.addr.octets()));
        let direction = direction(map_names::POLICY_PODS_V6, key.direction)?;
        entries.pod_slots.insert(PodSlotKey { pod_ip, direction }, slot(value));
    }
    for (key, value) in &contents.ports {
        let map = map_names::POLICY_PORTS;
        let slot = SlotId(u32::from_be(key.data.slot_be));
        let ports = if key.prefix_len == POLICY_PORT_SLOT_BITS {
            PortPrefix::AllProtocols
        } else {
            let protocol =
                protocol_from_number(key.data.proto).ok_or_else(|| unknown(map, "protocol", key.data.proto.into()))?;
            let bits = key
                .prefix_len
                .checked_sub(POLICY_PORT_PROTO_BITS)
                .filter(|bits| *bits <= 16)
                .ok_or_else(|| unknown(map, "prefix length", key.prefix_len))?;
            PortPrefix::Ports { protocol, start: u16::from_be_bytes(key.data.port), bits: bits as u8 }
        };
        entries.slot_ports.insert(SlotPortKey { slot, ports }, PeerSetId(value.peer_set));
    }
    for (key, verdict) in &contents.peers {
        let bits = key.prefix_len.checked_sub(PEER_SET_PREFIX_BITS).filter(|bits| *bits <= 32);
        let bits = bits.ok_or_else(|| unknown(map_names::POLICY_PEERS, "prefix length", key.prefix_len))?;
        let addr = Ipv4Addr::from(key.data.addr.to_ne_bytes());
        let net = Ipv4Net::new(addr, bits as u8)
            .map_err(|_| unknown(map_names::POLICY_PEERS, "prefix length", key.prefix_len))?;
        let verdict = match *verdict {
            PEER_ALLOW => PrefixVerdict::Allow,
            PEER_DENY => PrefixVerdict::Deny,
            other => return Err(unknown(map_names::POLICY_PEERS, "verdict", other.into())),
        };
        let key = PeerPrefixKey { peer_set: PeerSetId(u32::from_be(key.data.peer_set_be)), prefix: IpNet::V4(net) };
        entries.peer_prefixes.insert(key, verdict);
    }
    for (key, verdict) in &contents.peers_v6 {
        let map = map_names::POLICY_PEERS_V6;
        let bits = key.prefix_len.checked_sub(PEER_SET_PREFIX_BITS).filter(|bits| *bits <= 128);
        let bits = bits.ok_or_else(|| unknown(map, "prefix length", key.prefix_len))?;
        let net = Ipv6Net::new(Ipv6Addr::from(key.data.addr.octets()), bits as u8)
            .map_err(|_| unknown(map, "prefix length", key.prefix_len))?;
        let verdict = match *verdict {
            PEER_ALLOW => PrefixVerdict::Allow,
            PEER_DENY => PrefixVerdict::Deny,
            other => return Err(unknown(map, "verdict", other.into())),
        };
        let key = PeerPrefixKey { peer_set: PeerSetId(u32::from_be(key.data.peer_set_be)), prefix: IpNet::V6(net) };
        entries.peer_prefixes.insert(key, verdict);
    }
    Ok(entries)
}

// ---- applying a diff ------------------------------------------------------------------------

/// What [`apply_diff`] did, over the policy maps together, and per map (`per_map`, for the
/// metrics).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PolicyWriteReport {
    /// Successful inserts/updates and deletes, over all three maps.
    pub puts: u64,
    pub deletes: u64,
    pub errors: u64,
    /// Errors that were a full map (E2BIG / ENOMEM).
    pub full: u64,
    /// Deletes not attempted because an upsert failed: the old entries stay, so a pod whose new
    /// entry could not be written keeps a complete old policy instead of a dangling one.
    pub deletes_deferred: u64,
    /// The map and error of the first failed write, for the caller to report once (a full map
    /// fails every write to it, every sync).
    pub first_error: Option<(&'static str, String)>,
    pub per_map: SyncReport,
}

impl PolicyWriteReport {
    pub fn writes(&self) -> u64 {
        self.puts + self.deletes
    }
}

impl MapOperation for PolicyMapOp {
    fn map_name(&self) -> &'static str {
        PolicyMapOp::map_name(self)
    }
    fn is_delete(&self) -> bool {
        PolicyMapOp::is_delete(self)
    }
}

/// A write with whether its key is new to the maps (known from the model, not the maps).
#[derive(Debug)]
struct Write {
    op: PolicyMapOp,
    insert: bool,
}

impl MapOperation for Write {
    fn map_name(&self) -> &'static str {
        self.op.map_name()
    }
    fn is_delete(&self) -> bool {
        self.op.is_delete()
    }
}

struct Target<'a, M>(&'a mut M);

impl<M: PolicyMaps> WriteTarget<Write> for Target<'_, M> {
    fn is_insert(&self, write: &Write) -> bool {
        write.insert
    }
    fn write(&mut self, write: &Write) -> Result<(), MapWriteError> {
        self.0.write(&write.op)
    }
}

/// Applies `diff` (from `programmed`, what the maps hold) in the safe order, through the one map
/// writer the service maps use too. A failed upsert is counted and the writes go on (a missing
/// rule or prefix makes the datapath deny, never allow); the deletes are then held back and left
/// for the next sync, which retries everything that is still different.
pub fn apply_diff(maps: &mut impl PolicyMaps, diff: &MapDiff, programmed: &MapEntries) -> PolicyWriteReport {
    // In `encode_diff`'s order: peer prefixes, port entries and pod slots written, then deleted.
    let new = |existed: bool| !existed;
    let inserts = diff
        .peer_prefixes
        .upserts
        .keys()
        .map(|k| new(programmed.peer_prefixes.contains_key(k)))
        .chain(diff.slot_ports.upserts.keys().map(|k| new(programmed.slot_ports.contains_key(k))))
        .chain(diff.pod_slots.upserts.keys().map(|k| new(programmed.pod_slots.contains_key(k))))
        .chain(std::iter::repeat(false));
    let writes = encode_diff(diff).into_iter().zip(inserts).map(|(op, insert)| Write { op, insert });
    let per_map = write_ops(&mut Target(maps), writes, WriteRules { hold_deletes_after_failure: true });
    let total = per_map.total();
    let first_error = per_map.first_error().map(|(map, e)| (map, e.to_string()));
    PolicyWriteReport {
        puts: total.inserts + total.updates,
        deletes: total.deletes,
        errors: total.errors,
        full: total.full,
        deletes_deferred: total.deferred,
        first_error,
        per_map,
    }
}

// ---- the pinned maps ------------------------------------------------------------------------

use crate::pinned::open_pinned as open;

/// The five compiled-policy maps of a pin directory.
pub struct BpfPolicyMaps {
    pods: HashMap<MapData, PolicyPodKeyV4, PolicyPodValue>,
    ports: LpmTrie<MapData, PolicyPortKey, PolicyPortValue>,
    peers: LpmTrie<MapData, PeerPrefixV4, u8>,
    pods_v6: HashMap<MapData, PolicyPodKeyV6, PolicyPodValue>,
    peers_v6: LpmTrie<MapData, PeerPrefixV6, u8>,
    /// Changed after a pod's entry is put: a tuple remembered as plain traffic may be the
    /// pod's, isolated now.
    plain: crate::pinned::plain::PlainGeneration,
}

impl BpfPolicyMaps {
    pub fn open_pinned(pin_dir: &Path) -> Result<Self> {
        Ok(Self {
            pods: HashMap::try_from(Map::HashMap(open(pin_dir, map_names::POLICY_PODS)?))?,
            ports: LpmTrie::try_from(Map::LpmTrie(open(pin_dir, map_names::POLICY_PORTS)?))?,
            peers: LpmTrie::try_from(Map::LpmTrie(open(pin_dir, map_names::POLICY_PEERS)?))?,
            pods_v6: HashMap::try_from(Map::HashMap(open(pin_dir, map_names::POLICY_PODS_V6)?))?,
            peers_v6: LpmTrie::try_from(Map::LpmTrie(open(pin_dir, map_names::POLICY_PEERS_V6)?))?,
            plain: crate::pinned::plain::PlainGeneration::open(pin_dir),
        })
    }
}

impl PolicyMaps for BpfPolicyMaps {
    fn write(&mut self, op: &PolicyMapOp) -> Result<(), MapWriteError> {
        let result = match op {
            PolicyMapOp::PutPeerPrefix(PeerKey::V4(k), v) => self.peers.insert(&k.to_lpm(), v, 0),
            PolicyMapOp::PutPeerPrefix(PeerKey::V6(k), v) => self.peers_v6.insert(&k.to_lpm(), v, 0),
            PolicyMapOp::PutPort(k, v) => self.ports.insert(&k.to_lpm(), v, 0),
            PolicyMapOp::PutPod(PodKey::V4(k), v) => {
                let put = self.pods.insert(k, v, 0);
                self.plain.forget_all();
                put
            }
            PolicyMapOp::PutPod(PodKey::V6(k), v) => self.pods_v6.insert(k, v, 0),
            PolicyMapOp::DeletePod(PodKey::V4(k)) => self.pods.remove(k),
            PolicyMapOp::DeletePod(PodKey::V6(k)) => self.pods_v6.remove(k),
            PolicyMapOp::DeletePort(k) => self.ports.remove(&k.to_lpm()),
            PolicyMapOp::DeletePeerPrefix(PeerKey::V4(k)) => self.peers.remove(&k.to_lpm()),
            PolicyMapOp::DeletePeerPrefix(PeerKey::V6(k)) => self.peers_v6.remove(&k.to_lpm()),
        };
        match result {
            // A delete of a key that is already gone leaves the map as wanted.
            Err(MapError::SyscallError(e)) if op.is_delete() && e.io_error.raw_os_error() == Some(libc::ENOENT) => {
                Ok(())
            }
            other => other.map_err(|e| write_error(op.map_name(), e)),
        }
    }

    fn read_all(&self) -> Result<PolicyMapContents, MapWriteError> {
        let error = |name| move |e| write_error(name, e);
        Ok(PolicyMapContents {
            pods: self.pods.iter().map(|r| r.map_err(error(map_names::POLICY_PODS))).collect::<Result<_, _>>()?,
            ports: self
                .ports
                .iter()
                .map(|r| r.map(|(k, v)| (PortKey::from_lpm(&k), v)).map_err(error(map_names::POLICY_PORTS)))
                .collect::<Result<_, _>>()?,
            peers: self
                .peers
                .iter()
                .map(|r| r.map(|(k, v)| (PeerKeyV4::from_lpm(&k), v)).map_err(error(map_names::POLICY_PEERS)))
                .collect::<Result<_, _>>()?,
            pods_v6: self
                .pods_v6
                .iter()
                .map(|r| r.map_err(error(map_names::POLICY_PODS_V6)))
                .collect::<Result<_, _>>()?,
            peers_v6: self
                .peers_v6
                .iter()
                .map(|r| r.map(|(k, v)| (PeerKeyV6::from_lpm(&k), v)).map_err(error(map_names::POLICY_PEERS_V6)))
                .collect::<Result<_, _>>()?,
        })
    }
}

/// Sums the per-CPU counters of `pol_stats`, in `pol_stat` index order.
pub fn read_policy_stats(pin_dir: &Path) -> Result<Vec<u64>> {
    let stats: PerCpuArray<MapData, u64> =
        PerCpuArray::try_from(Map::PerCpuArray(open(pin_dir, map_names::POLICY_STATS)?))?;
    (0..pol_stat::COUNT).map(|i| Ok(stats.get(&i, 0)?.iter().sum())).collect()
}

/// Writes `pol_cfg`, only if it differs: `track_all` sets `POLICY_CT_TRACK_ALL` (every pod's flows
/// in `pol_ct_v4/v6`, as before the gate); otherwise only pods a policy isolates are tracked.
pub fn write_policy_ct_gate(pin_dir: &Path, track_all: bool) -> Result<()> {
    let mut map: aya::maps::Array<MapData, u32> =
        aya::maps::Array::try_from(Map::Array(open(pin_dir, map_names::POLICY_CONFIG)?))?;
    let flags = if track_all { POLICY_CT_TRACK_ALL } else { 0 };
    if map.get(&0, 0)? != flags {
        map.set(0, flags, 0)?;
        // Tracking every pod: none is plain to the policy any more.
        crate::pinned::plain::forget_all(pin_dir);
    }
    Ok(())
}

/// `pol_ct_v4` and `pol_ct_v6`: allowed connections per local pod, written by the datapath.
pub struct PolicyConntrack {
    map: HashMap<MapData, PolicyCtKeyV4, PolicyCtValue>,
    map_v6: HashMap<MapData, PolicyCtKeyV6, PolicyCtValue>,
}

impl PolicyConntrack {
    pub fn open_pinned(pin_dir: &Path) -> Result<Self> {
        Ok(Self {
            map: HashMap::try_from(Map::LruHashMap(open(pin_dir, map_names::POLICY_CONNTRACK)?))?,
            map_v6: HashMap::try_from(Map::LruHashMap(open(pin_dir, map_names::POLICY_CONNTRACK_V6)?))?,
        })
    }

    pub fn entries(&self) -> Result<Vec<(PolicyCtKeyV4, PolicyCtValue)>> {
        Ok(self.map.iter().collect::<Result<_, _>>()?)
    }

    pub fn entries_v6(&self) -> Result<Vec<(PolicyCtKeyV6, PolicyCtValue)>> {
        Ok(self.map_v6.iter().collect::<Result<_, _>>()?)
    }

    /// Removes entries idle past their lifetime, so the LRU never has to evict live
    /// connections (whose replies would then be judged as new flows). Returns (left, removed)
    /// over both families.
    pub fn collect_garbage(&mut self) -> Result<(usize, usize)> {
        self.collect_garbage_at(crate::pinned::conntrack_gc::monotonic_now_ns())
    }

    /// `collect_garbage` as if the clock read `now` (tests: entries older than the machine's
    /// uptime cannot be written otherwise).
    pub fn collect_garbage_at(&mut self, now: u64) -> Result<(usize, usize)> {
        use crate::pinned::conntrack_gc::collect_expired;
        let expired = |proto: u8, value: &PolicyCtValue, now: u64| {
            now.saturating_sub(value.last_seen_ns) > value.lifetime_ns(proto)
        };
        let (left4, removed4) = collect_expired(&mut self.map, now, |key, value, now| expired(key.proto, value, now));
        let (left6, removed6) =
            collect_expired(&mut self.map_v6, now, |key, value, now| expired(key.proto, value, now));
        Ok((left4 + left6, removed4 + removed6))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn peer_keys_put_the_big_endian_set_id_before_the_truncated_network() {
        let key = PeerPrefixKey { peer_set: PeerSetId(0x0102_0304), prefix: "10.1.2.3/16".parse().unwrap() };
        let PeerKey::V4(encoded) = encode_peer_key(&key) else { panic!("an IPv4 prefix") };
        assert_eq!(encoded.prefix_len, 32 + 16);
        // The bytes the trie matches, most significant first: set id, then 10.1.0.0.
        let lpm = encoded.to_lpm();
        // SAFETY: Key<PeerPrefixV4> is 12 plain bytes (packed).
        let bytes: [u8; 12] = unsafe { std::mem::transmute(lpm) };
        assert_eq!(bytes[4..], [1, 2, 3, 4, 10, 1, 0, 0]);
        assert_eq!(u32::from_ne_bytes(bytes[..4].try_into().unwrap()), 48);
        let everything = PeerPrefixKey { peer_set: PeerSetId(7), prefix: "0.0.0.0/0".parse().unwrap() };
        assert!(matches!(encode_peer_key(&everything), PeerKey::V4(k) if k.prefix_len == 32));
        // IPv6: the set id, then the truncated 128-bit network, in pol_peers_v6.
        let v6 = PeerPrefixKey { peer_set: PeerSetId(7), prefix: "fd00:1:2::5/48".parse().unwrap() };
        let PeerKey::V6(encoded) = encode_peer_key(&v6) else { panic!("an IPv6 prefix") };
        assert_eq!(encoded.prefix_len, 32 + 48);
        assert_eq!(u32::from_be(encoded.data.peer_set_be), 7);
        assert_eq!(encoded.data.addr.octets(), "fd00:1:2::".parse::<Ipv6Addr>().unwrap().octets());
    }

    #[test]
    fn port_keys_put_the_big_endian_slot_then_protocol_then_the_port_bits() {
        let all = encode_port_key(&SlotPortKey { slot: SlotId(0x0102_0304), ports: PortPrefix::AllProtocols });
        assert_eq!(all.prefix_len, 32);
        assert_eq!(all.data.slot_be.to_ne_bytes(), [1, 2, 3, 4]);
        let http = PortPrefix::Ports { protocol: Protocol::Tcp, start: 0x1f90, bits: 16 };
        let key = encode_port_key(&SlotPortKey { slot: SlotId(5), ports: http });
        assert_eq!(key.prefix_len, 32 + 8 + 16);
        // SAFETY: Key<PolicyPortKey> is 12 plain bytes (packed).
        let bytes: [u8; 12] = unsafe { std::mem::transmute(key.to_lpm()) };
        assert_eq!(bytes[4..11], [0, 0, 0, 5, 6, 0x1f, 0x90], "slot, TCP, port 8080 as the trie matches them");
        let sctp = encode_port_key(&SlotPortKey {
            slot: SlotId(5),
            ports: PortPrefix::Ports { protocol: Protocol::Sctp, start: 0, bits: 0 },
        });
        assert_eq!((sctp.prefix_len, sctp.data.proto), (40, 132));
    }

    #[test]
    fn pod_keys_are_network_order_with_a_nonzero_direction() {
        let PodKey::V4(key) = encode_pod_key(&PodSlotKey { pod_ip: ip("10.0.1.2"), direction: Direction::Egress })
        else {
            panic!("an IPv4 pod")
        };
        assert_eq!(key.addr.to_ne_bytes(), [10, 0, 1, 2]);
        assert_eq!(key.direction, POLICY_DIR_EGRESS);
        assert_ne!(POLICY_DIR_INGRESS, 0);
        let v6 = PodSlotKey { pod_ip: ip("fd00::1"), direction: Direction::Ingress };
        let PodKey::V6(key) = encode_pod_key(&v6) else { panic!("an IPv6 pod") };
        assert_eq!(key.addr.octets(), "fd00::1".parse::<Ipv6Addr>().unwrap().octets());
        assert_eq!(key.direction, POLICY_DIR_INGRESS);
    }

    fn sample_entries() -> MapEntries {
        let mut entries = MapEntries::default();
        let pod = |addr: &str, direction| PodSlotKey { pod_ip: ip(addr), direction };
        entries.pod_slots.insert(pod("10.0.1.1", Direction::Ingress), PodSlotValue { slot: SlotId(1), rule_count: 2 });
        entries.pod_slots.insert(pod("fd00::1", Direction::Ingress), PodSlotValue { slot: SlotId(1), rule_count: 2 });
        entries.slot_ports.insert(SlotPortKey { slot: SlotId(1), ports: PortPrefix::AllProtocols }, PeerSetId(1));
        entries.slot_ports.insert(
            SlotPortKey { slot: SlotId(1), ports: PortPrefix::Ports { protocol: Protocol::Tcp, start: 80, bits: 16 } },
            PeerSetId(2),
        );
        let prefix = |set, net: &str| PeerPrefixKey { peer_set: PeerSetId(set), prefix: net.parse().unwrap() };
        entries.peer_prefixes.insert(prefix(1, "10.0.0.0/8"), PrefixVerdict::Allow);
        entries.peer_prefixes.insert(prefix(1, "10.1.0.0/16"), PrefixVerdict::Deny);
        entries.peer_prefixes.insert(prefix(1, "::/0"), PrefixVerdict::Allow);
        entries.peer_prefixes.insert(prefix(2, "10.0.2.1/32"), PrefixVerdict::Allow);
        entries
    }

    #[test]
    fn decode_inverts_encode_for_both_families() {
        let entries = sample_entries();
        let contents = encode_entries(&entries);
        assert_eq!((contents.pods.len(), contents.pods_v6.len()), (1, 1), "each pod in its family's map");
        assert_eq!((contents.peers.len(), contents.peers_v6.len()), (3, 1), "each prefix in its family's map");
        assert_eq!(decode(&contents), Ok(entries));
    }

    #[test]
    fn diff_is_written_prefixes_and_rules_first_then_pods_then_deletes() {
        let old = sample_entries();
        let mut new = old.clone();
        // A pod moves to a new slot with a new rule; the old slot and one prefix go away.
        let pod = PodSlotKey { pod_ip: ip("10.0.1.1"), direction: Direction::Ingress };
        new.pod_slots.insert(pod, PodSlotValue { slot: SlotId(2), rule_count: 1 });
        new.pod_slots.remove(&PodSlotKey { pod_ip: ip("fd00::1"), direction: Direction::Ingress });
        new.slot_ports.clear();
        new.slot_ports.insert(SlotPortKey { slot: SlotId(2), ports: PortPrefix::AllProtocols }, PeerSetId(3));
        new.peer_prefixes.retain(|k, _| k.peer_set != PeerSetId(2));
        new.peer_prefixes.insert(
            PeerPrefixKey { peer_set: PeerSetId(3), prefix: "10.0.3.0/24".parse().unwrap() },
            PrefixVerdict::Allow,
        );
        let encoded = encode_diff(&old.diff(&new));
        let kinds: Vec<&str> = encoded
            .iter()
            .map(|op| match op {
                PolicyMapOp::PutPeerPrefix(..) => "put-peer",
                PolicyMapOp::PutPort(..) => "put-port",
                PolicyMapOp::PutPod(..) => "put-pod",
                PolicyMapOp::DeletePod(_) => "del-pod",
                PolicyMapOp::DeletePort(_) => "del-port",
                PolicyMapOp::DeletePeerPrefix(_) => "del-peer",
            })
            .collect();
        assert_eq!(kinds, ["put-peer", "put-port", "put-pod", "del-pod", "del-port", "del-port", "del-peer"]);

        let mut maps = encode_entries(&old);
        let report = apply_diff(&mut maps, &old.diff(&new), &old);
        assert_eq!((report.puts, report.deletes, report.errors), (3, 4, 0));
        assert_eq!(maps, encode_entries(&new));
    }

    /// Fails every write to one map, as a full map would.
    struct FullPorts(PolicyMapContents);

    impl PolicyMaps for FullPorts {
        fn write(&mut self, op: &PolicyMapOp) -> Result<(), MapWriteError> {
            if matches!(op, PolicyMapOp::PutPort(..)) {
                return Err(MapWriteError { map: map_names::POLICY_PORTS, message: "full".into(), full: true });
            }
            self.0.write(op)
        }
        fn read_all(&self) -> Result<PolicyMapContents, MapWriteError> {
            Ok(self.0.clone())
        }
    }

    #[test]
    fn a_failed_upsert_holds_back_the_deletes() {
        let old = sample_entries();
        let mut new = MapEntries::default();
        new.slot_ports.insert(SlotPortKey { slot: SlotId(9), ports: PortPrefix::AllProtocols }, PeerSetId(1));
        let mut maps = FullPorts(encode_entries(&old));
        let report = apply_diff(&mut maps, &old.diff(&new), &old);
        assert_eq!((report.errors, report.full), (1, 1));
        assert_eq!(
            report.first_error,
            Some((map_names::POLICY_PORTS, "full".to_string())),
            "reported once, by the caller"
        );
        assert_eq!(report.deletes, 0);
        assert!(report.deletes_deferred > 0);
        assert_eq!(maps.0, encode_entries(&old), "the old, complete policy is still there");
    }
}
