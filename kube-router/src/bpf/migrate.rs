//! Upgrading the pinned maps from the previous layout without dropping a connection.
//!
//! Each layout's maps are pinned in `v<N>/`. An agent finding the previous layout's directory
//! (`v2/`) loads its object, which creates its own maps in `v3/`, then copies the state that must
//! survive: every map both layouts have with the same shape, byte for byte (Service frontends,
//! slots and backends so traffic is served before the first sync, conntrack and NAT state,
//! session affinity, NetworkPolicy pods, peers and conntrack, socket-LB state, counters), and
//! what changed shape converted: layout 3 judges a policy through a port index (`pol_ports`)
//! instead of scanning a pod's rules (`pol_rules`, at most 64), so the index is built from the
//! old rules, with the merged peer sets it needs written under new ids. It swaps the programs
//! through the pinned links (each `bpf_link_update` is atomic), copies what the old programs
//! wrote in the meantime, and only then removes `v2/`. A layout-2 agent started afterwards
//! refuses to run over the newer maps (it finds `v3/`), leaving the programs alone.
//!
//! Layout 1 (maps pinned in the bpf root) is not upgraded directly: run a layout-2 release first.
use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    os::fd::{AsFd, AsRawFd},
    path::{Path, PathBuf},
};

use anyhow::{bail, Context, Result};
use aya::maps::{HashMap, Map, MapData, MapType};
use kube_router_common::*;

use crate::pinned::maps_dir;
use crate::policy::{
    flatten::{port_index, union_prefixes, MapEntries, PeerPrefixKey, PeerSetId, SlotId, SlotPortKey},
    PortRange,
};

/// Layout 2's maps that layout 3 does not have, and their types.
mod v2 {
    pub const DIR: &str = "v2";
    pub const POLICY_RULES: &str = "pol_rules";
    /// `pol_rules` key: rule `rule_index` of `slot`.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub struct PolicyRuleKey {
        pub slot: u32,
        pub rule_index: u32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct PolicyPortRange {
        pub proto: u8,
        pub pad: u8,
        pub start: u16,
        pub end: u16,
    }
    /// `range_count` meaning every protocol and port.
    pub const ALL_PORTS: u8 = 0xff;
    #[repr(C)]
    #[derive(Clone, Copy, Debug)]
    pub struct PolicyRuleValue {
        pub peer_set: u32,
        pub range_count: u8,
        pub pad: [u8; 3],
        pub ranges: [PolicyPortRange; 8],
    }
    // SAFETY: repr(C), integers only, every gap an explicit `pad` field.
    unsafe impl aya::Pod for PolicyRuleKey {}
    unsafe impl aya::Pod for PolicyRuleValue {}
}

/// Refuses to run over maps of a newer layout than ours: the newer agent's programs keep running.
pub fn refuse_downgrade(pin_dir: &Path) -> Result<()> {
    let newer: Vec<String> = fs::read_dir(pin_dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.strip_prefix('v')?.parse::<u32>().ok())
        .filter(|version| *version > LAYOUT_VERSION)
        .map(|version| format!("v{version}"))
        .collect();
    if !newer.is_empty() {
        bail!(
            "{} holds maps of a newer layout ({}) than this agent's (v{LAYOUT_VERSION}): refusing to downgrade; \
             the running programs are left as they are. Run the newer agent, or `kube-router cleanup` to start over",
            pin_dir.display(),
            newer.join(", ")
        );
    }
    if pin_dir.join(map_names::META).exists() {
        bail!(
            "{} holds maps of layout 1 (pinned in the bpf root): this agent upgrades from layout 2 only; \
             run a layout-2 release first, or `kube-router cleanup` to start over",
            pin_dir.display()
        );
    }
    Ok(())
}

/// An upgrade under way: the old layout's maps are still pinned (and used by the programs the
/// links still hold) until [`Upgrade::finish`].
pub struct Upgrade {
    pin_dir: PathBuf,
    pub copied: usize,
}

/// Starts an upgrade if the previous layout's maps are pinned: copies their state into ours
/// (first pass; entries ours already has are kept) and builds the policy port index from the
/// old rules. `None` when there is nothing to upgrade.
pub fn start(pin_dir: &Path) -> Result<Option<Upgrade>> {
    let old = pin_dir.join(v2::DIR);
    if !old.exists() {
        return Ok(None);
    }
    let mut copied = copy_shared(&old, &maps_dir(pin_dir), true).context("copying state from layout 2")?;
    copied += convert_policy_rules(&old, pin_dir).context("indexing layout 2's policy rules by port")?;
    tracing::info!(copied, "upgrading pinned maps from layout 2: state copied, programs swap next");
    Ok(Some(Upgrade { pin_dir: pin_dir.to_path_buf(), copied }))
}

impl Upgrade {
    /// After every link runs the new programs: copies what the old ones wrote since the first
    /// pass (conntrack, NAT, affinity), then removes the old maps.
    pub fn finish(self) -> Result<usize> {
        let old = self.pin_dir.join(v2::DIR);
        let late =
            copy_shared(&old, &maps_dir(&self.pin_dir), false).context("copying state written during the swap")?;
        fs::remove_dir_all(&old).with_context(|| format!("removing {}", old.display()))?;
        tracing::info!(copied = self.copied + late, "upgrade from layout 2 complete; old maps removed");
        Ok(late)
    }
}

/// Copies every map pinned in `from` that `to` has with the same type, key and value size.
/// Hash maps and tries get the entries they lack; arrays (configuration, counters) are copied
/// whole on the first pass only, before the agent writes its own. Returns entries copied.
fn copy_shared(from: &Path, to: &Path, first_pass: bool) -> Result<usize> {
    let mut copied = 0;
    for entry in fs::read_dir(from).with_context(|| format!("listing {}", from.display()))? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let target = to.join(&name);
        if name == map_names::META || !target.exists() {
            continue;
        }
        let (Ok(old), Ok(new)) = (MapData::from_pin(entry.path()), MapData::from_pin(&target)) else {
            continue;
        };
        let (old_info, new_info) = (old.info()?, new.info()?);
        let same_shape = old_info.map_type().ok() == new_info.map_type().ok()
            && old_info.key_size() == new_info.key_size()
            && old_info.value_size() == new_info.value_size();
        if !same_shape {
            tracing::warn!(map = %name, "map changed shape between layouts without a conversion; its entries are not carried over");
            continue;
        }
        let whole = match new_info.map_type() {
            Ok(MapType::Array | MapType::PerCpuArray) => true,
            Ok(MapType::Hash | MapType::LruHash | MapType::PerCpuHash | MapType::LruPerCpuHash | MapType::LpmTrie) => {
                false
            }
            // Ring buffers and the like hold no state to carry.
            _ => continue,
        };
        if whole && !first_pass {
            continue;
        }
        let (n, full) = copy_entries(&old, &new, whole).with_context(|| format!("copying {name}"))?;
        if full {
            tracing::warn!(map = %name, copied = n, "the new map holds fewer entries than the old one had; the rest are left out");
        }
        copied += n;
    }
    Ok(copied)
}

/// Layout 2's rules: (slot, rule index) -> (peer set id, ports; `None` = every port).
pub type Layout2Rules = BTreeMap<(u32, u32), (u32, Option<Vec<PortRange>>)>;

/// Layout 2's `pol_rules` (per slot, a list of (peer set, ports) scanned in order) as layout 3's
/// port index over the same slots and peer sets, plus the merged sets it needs, under ids no
/// old entry uses. Pure: the datapath decision over the result equals the old one.
pub fn ports_from_rules(
    rules: &Layout2Rules,
    peer_prefixes: &BTreeMap<PeerPrefixKey, crate::policy::flatten::PrefixVerdict>,
) -> MapEntries {
    let mut by_set: BTreeMap<u32, BTreeMap<ipnet::IpNet, crate::policy::flatten::PrefixVerdict>> = BTreeMap::new();
    for (key, verdict) in peer_prefixes {
        by_set.entry(key.peer_set.0).or_default().insert(key.prefix, *verdict);
    }
    type SlotRules<'a> = Vec<(u32, Option<&'a [PortRange]>)>;
    let mut slots: BTreeMap<u32, SlotRules> = BTreeMap::new();
    for ((slot, _), (peer_set, ports)) in rules {
        slots.entry(*slot).or_default().push((*peer_set, ports.as_deref()));
    }
    let mut next = by_set.keys().chain(slots.keys()).max().copied().unwrap_or(0) + 1;
    let mut merged: BTreeMap<BTreeSet<u32>, u32> = BTreeMap::new();
    let mut out = MapEntries::default();
    let empty = BTreeMap::new();
    for (slot, slot_rules) in &slots {
        for (ports, members) in port_index(slot_rules) {
            let peer_set = match members.iter().collect::<Vec<_>>().as_slice() {
                [only] => **only,
                _ => *merged.entry(members.clone()).or_insert_with(|| {
                    let id = next;
                    next += 1;
                    let sets: Vec<_> = members.iter().map(|m| by_set.get(m).unwrap_or(&empty)).collect();
                    for (prefix, verdict) in union_prefixes(&sets) {
                        out.peer_prefixes.insert(PeerPrefixKey { peer_set: PeerSetId(id), prefix }, verdict);
                    }
                    id
                }),
            };
            out.slot_ports.insert(SlotPortKey { slot: SlotId(*slot), ports }, PeerSetId(peer_set));
        }
    }
    out
}

/// Reads layout 2's rules and writes the port index (and merged peer sets) into our maps.
fn convert_policy_rules(old: &Path, pin_dir: &Path) -> Result<usize> {
    use crate::policy::maps::{decode, encode_diff, protocol_from_number, BpfPolicyMaps, PolicyMaps};
    let rules_path = old.join(v2::POLICY_RULES);
    if !rules_path.exists() {
        return Ok(0);
    }
    let old_rules: HashMap<MapData, v2::PolicyRuleKey, v2::PolicyRuleValue> =
        HashMap::try_from(Map::HashMap(MapData::from_pin(&rules_path)?))?;
    let mut rules = BTreeMap::new();
    for entry in old_rules.iter() {
        let (key, value) = entry?;
        let ports = if value.range_count == v2::ALL_PORTS {
            None
        } else {
            let used = value.ranges.get(..usize::from(value.range_count)).unwrap_or(&[]);
            Some(
                used.iter()
                    .filter_map(|r| {
                        Some(PortRange { protocol: protocol_from_number(r.proto)?, start: r.start, end: r.end })
                    })
                    .collect(),
            )
        };
        rules.insert((key.slot, key.rule_index), (value.peer_set, ports));
    }
    // The peers were copied into our maps by the first pass.
    let mut maps = BpfPolicyMaps::open_pinned(pin_dir)?;
    let current = maps.read_all().map_err(|e| anyhow::anyhow!("{}: {}", e.map, e.message))?;
    let current = decode(&current).context("decoding the copied policy maps")?;
    let index = ports_from_rules(&rules, &current.peer_prefixes);
    let mut written = 0;
    for op in encode_diff(&MapEntries::default().diff(&index)) {
        maps.write(&op).map_err(|e| anyhow::anyhow!("{}: {}", e.map, e.message))?;
        written += 1;
    }
    Ok(written)
}

/// Maps re-created at another size (`--bpf-lb-map-max`, `--bpf-ct-global-max`). The old map
/// stays pinned beside the new one as `<name>_resizing` (the running programs still use it) until
/// every link runs the new programs; its entries are copied in twice, before the swap and after,
/// so no conntrack, NAT or affinity state is lost. An interrupted resize (a `_resizing` pin left
/// by an agent that died mid-way) is completed by the next start.
pub struct Resize {
    pin_dir: PathBuf,
    maps: Vec<String>,
    pub copied: usize,
}

/// (bpffs refuses names with a dot.)
fn aside_path(pin_dir: &Path, name: &str) -> PathBuf {
    maps_dir(pin_dir).join(format!("{name}_resizing"))
}

/// Before the object is loaded: pins each map to resize aside and unpins it from its name, so
/// the loader creates it anew at the configured size. Also picks up an interrupted resize.
pub fn start_resize(pin_dir: &Path, resize: &[(&'static str, u32)]) -> Result<Option<Resize>> {
    let mut maps: Vec<String> = fs::read_dir(maps_dir(pin_dir))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.strip_suffix("_resizing").map(str::to_string))
        .collect();
    for (name, old_size) in resize {
        let (path, aside) = (maps_dir(pin_dir).join(name), aside_path(pin_dir, name));
        if aside.exists() {
            bail!(
                "{} is being resized already (an earlier start was interrupted) and its size changed again; \
                 start once with the previous size to complete it",
                path.display()
            );
        }
        let map = MapData::from_pin(&path).with_context(|| format!("opening {}", path.display()))?;
        map.pin(&aside).map_err(|e| anyhow::anyhow!("pinning {} aside: {e}", path.display()))?;
        fs::remove_file(&path).with_context(|| format!("unpinning {}", path.display()))?;
        tracing::info!(
            map = name,
            old_size,
            "resizing pinned map: re-created at the configured size, entries carried over"
        );
        maps.push(name.to_string());
    }
    Ok((!maps.is_empty()).then(|| Resize { pin_dir: pin_dir.to_path_buf(), maps, copied: 0 }))
}

impl Resize {
    /// Copies what the old maps hold and the new ones lack.
    pub fn copy(&mut self) -> Result<usize> {
        let mut copied = 0;
        for name in &self.maps {
            let from = MapData::from_pin(aside_path(&self.pin_dir, name))
                .with_context(|| format!("opening {name} being resized"))?;
            let to = MapData::from_pin(maps_dir(&self.pin_dir).join(name))
                .with_context(|| format!("opening the resized {name}"))?;
            let (n, full) =
                copy_entries(&from, &to, false).with_context(|| format!("copying {name} into its new size"))?;
            if full {
                tracing::warn!(map = %name, copied = n, "the new size holds fewer entries than the old map had; the rest are left out");
            }
            copied += n;
        }
        self.copied += copied;
        Ok(copied)
    }

    /// Once every link runs the new programs: copies what the old ones wrote meanwhile, then
    /// unpins the old maps (the kernel frees them with their last program).
    pub fn finish(mut self) -> Result<usize> {
        self.copy()?;
        for name in &self.maps {
            let aside = aside_path(&self.pin_dir, name);
            fs::remove_file(&aside).with_context(|| format!("unpinning {}", aside.display()))?;
        }
        tracing::info!(maps = ?self.maps, copied = self.copied, "pinned maps resized");
        Ok(self.copied)
    }
}

/// Copies every entry of `from` absent from `to` (same key and value sizes), byte for byte, or
/// every entry when `overwrite` (arrays, whose entries always exist). Returns how many, and
/// whether `to` ran out of room (only a plain hash map can).
fn copy_entries(from: &MapData, to: &MapData, overwrite: bool) -> Result<(usize, bool)> {
    const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
    const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
    const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
    const BPF_NOEXIST: u64 = 1;
    #[repr(C)]
    struct ElemAttr {
        map_fd: u32,
        pad: u32,
        key: u64,
        value_or_next_key: u64,
        flags: u64,
    }
    fn bpf(cmd: libc::c_long, attr: &ElemAttr) -> std::io::Result<()> {
        // SAFETY: a valid attribute for the element commands; its pointers are live buffers of
        // the map's key and value sizes.
        let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr, std::mem::size_of::<ElemAttr>() as u32) };
        if rc < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(())
        }
    }
    let info = from.info()?;
    let key_size = info.key_size() as usize;
    // A per-CPU map's element reads and writes carry one 8-byte-aligned value per possible CPU.
    let per_cpu = matches!(info.map_type(), Ok(MapType::PerCpuHash | MapType::LruPerCpuHash | MapType::PerCpuArray));
    let value_size = if per_cpu {
        let cpus = aya::util::nr_cpus().map_err(|(_, e)| e).context("counting the possible CPUs")?;
        (info.value_size() as usize).next_multiple_of(8) * cpus
    } else {
        info.value_size() as usize
    };
    let (from_fd, to_fd) = (from.fd().as_fd().as_raw_fd() as u32, to.fd().as_fd().as_raw_fd() as u32);
    let (mut key, mut next, mut value) = (vec![0u8; key_size], vec![0u8; key_size], vec![0u8; value_size]);
    let mut first = true;
    let mut copied = 0;
    loop {
        let attr = ElemAttr {
            map_fd: from_fd,
            pad: 0,
            key: if first { 0 } else { key.as_ptr() as u64 },
            value_or_next_key: next.as_mut_ptr() as u64,
            flags: 0,
        };
        match bpf(BPF_MAP_GET_NEXT_KEY, &attr) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok((copied, false)),
            Err(e) => return Err(e).context("BPF_MAP_GET_NEXT_KEY"),
        }
        first = false;
        std::mem::swap(&mut key, &mut next);
        let lookup = ElemAttr {
            map_fd: from_fd,
            pad: 0,
            key: key.as_ptr() as u64,
            value_or_next_key: value.as_mut_ptr() as u64,
            flags: 0,
        };
        match bpf(BPF_MAP_LOOKUP_ELEM, &lookup) {
            Ok(()) => {}
            // Removed (a conntrack entry expiring) between the two calls.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => continue,
            Err(e) => return Err(e).context("BPF_MAP_LOOKUP_ELEM"),
        }
        let update = ElemAttr {
            map_fd: to_fd,
            pad: 0,
            key: key.as_ptr() as u64,
            value_or_next_key: value.as_ptr() as u64,
            flags: if overwrite { 0 } else { BPF_NOEXIST },
        };
        match bpf(BPF_MAP_UPDATE_ELEM, &update) {
            Ok(()) => copied += 1,
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
            Err(e) if matches!(e.raw_os_error(), Some(libc::E2BIG) | Some(libc::ENOMEM)) => return Ok((copied, true)),
            Err(e) => return Err(e).context("BPF_MAP_UPDATE_ELEM"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{flatten::PrefixVerdict, Protocol};

    #[test]
    fn layout_2_rules_become_a_port_index_that_decides_alike() {
        let prefix = |set, net: &str| PeerPrefixKey { peer_set: PeerSetId(set), prefix: net.parse().unwrap() };
        let mut peers = BTreeMap::new();
        peers.insert(prefix(1, "10.0.0.0/8"), PrefixVerdict::Allow);
        peers.insert(prefix(1, "10.1.0.0/16"), PrefixVerdict::Deny);
        peers.insert(prefix(2, "10.1.2.3/32"), PrefixVerdict::Allow);
        peers.insert(prefix(3, "fd00::/64"), PrefixVerdict::Allow);
        let tcp = |start, end| PortRange { protocol: Protocol::Tcp, start, end };
        // Slot 7: set 1 on TCP 80-90, set 2 on TCP 85-100; slot 8: set 3 everywhere, set 2 on UDP 53.
        let mut rules = BTreeMap::new();
        rules.insert((7, 0), (1, Some(vec![tcp(80, 90)])));
        rules.insert((7, 1), (2, Some(vec![tcp(85, 100)])));
        rules.insert((8, 0), (3, None));
        rules.insert((8, 1), (2, Some(vec![PortRange::single(Protocol::Udp, 53)])));
        let index = ports_from_rules(&rules, &peers);
        let mut entries = index.clone();
        entries.peer_prefixes.extend(peers.clone());
        // The old decision: any rule whose ports admit and whose set holds the peer.
        let old_allows = |slot: u32, peer: &str, protocol: Protocol, port: u16| {
            let peer = peer.parse().unwrap();
            rules.iter().filter(|((s, _), _)| *s == slot).any(|(_, (set, ports))| {
                let ports_ok = ports.as_ref().is_none_or(|r| r.iter().any(|r| r.contains(protocol, port)));
                ports_ok && entries.peer_set_contains(PeerSetId(*set), peer)
            })
        };
        let new_allows = |slot: u32, peer: &str, protocol: Protocol, port: u16| {
            entries
                .slot_peers(SlotId(slot), protocol, port)
                .is_some_and(|set| entries.peer_set_contains(set, peer.parse().unwrap()))
        };
        let mut checked = 0;
        for slot in [7, 8] {
            for peer in ["10.0.0.1", "10.1.2.3", "10.1.9.9", "192.0.2.1", "fd00::1", "fd01::1"] {
                for protocol in [Protocol::Tcp, Protocol::Udp, Protocol::Sctp] {
                    for port in [1, 53, 79, 80, 84, 85, 90, 91, 100, 101, 65535] {
                        assert_eq!(
                            new_allows(slot, peer, protocol, port),
                            old_allows(slot, peer, protocol, port),
                            "slot {slot} peer {peer} {protocol} {port}"
                        );
                        checked += 1;
                    }
                }
            }
        }
        assert_eq!(checked, 2 * 6 * 3 * 11);
        // TCP 85-90 admits sets 1 and 2: one merged set under a new id, holding 10.1.2.3 although
        // set 1 carves 10.1.0.0/16 out.
        let merged = index.slot_peers(SlotId(7), Protocol::Tcp, 86).unwrap();
        assert!(merged.0 > 8, "a new id: {merged:?}");
        assert!(entries.peer_set_contains(merged, "10.1.2.3".parse().unwrap()));
        assert!(!entries.peer_set_contains(merged, "10.1.2.4".parse().unwrap()));
    }
}
