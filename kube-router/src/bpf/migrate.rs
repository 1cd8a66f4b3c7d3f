//! Upgrading the pinned maps from the previous layout without dropping a connection.
//!
//! Layout 1 pinned its maps directly in the bpf root; from layout 2 on they live in `v<N>/`. An
//! agent finding layout-1 maps (the root `meta` says 1) creates its own maps beside them, copies
//! the state that must survive — Service frontends, slots and backends (so traffic is served
//! before the first sync), conntrack (translated to the new entry format), session affinity,
//! NetworkPolicy entries and policy conntrack — swaps the programs through the pinned links
//! (each `bpf_link_update` is atomic), copies what the old programs wrote in the meantime, and
//! only then removes the old maps. In their place it leaves a tombstone map the old agent's
//! layout check refuses, so starting the old version again (a downgrade) stops with an error
//! instead of replacing the programs with ones over empty maps.
use std::{
    fs,
    os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd},
    path::{Path, PathBuf},
};

use anyhow::{bail, Context, Result};
use aya::maps::{lpm_trie::Key, Array, HashMap, LpmTrie, Map, MapData, MapType};
use kube_router_common::*;

use super::maps_dir;

/// Layout 1's map names (all pinned in the bpf root).
mod v1 {
    pub const META: &str = "meta";
    pub const SERVICES: &str = "svc_v4";
    pub const BACKEND_SLOTS: &str = "svc_slots_v4";
    pub const BACKENDS: &str = "backends_v4";
    pub const CONNTRACK: &str = "ct_v4";
    pub const AFFINITY: &str = "affinity_v4";
    pub const POLICY_PODS: &str = "pol_pods_v4";
    pub const POLICY_RULES: &str = "pol_rules";
    pub const POLICY_PEERS: &str = "pol_peers_v4";
    pub const POLICY_CONNTRACK: &str = "pol_ct_v4";
    /// Every map layout 1 pinned.
    pub const ALL: [&str; 12] = [
        META,
        SERVICES,
        BACKEND_SLOTS,
        BACKENDS,
        CONNTRACK,
        AFFINITY,
        "lb_stats",
        POLICY_PODS,
        POLICY_RULES,
        POLICY_PEERS,
        POLICY_CONNTRACK,
        "pol_stats",
    ];

    /// Layout 1's conntrack value: one rewrite target (destination of a forward entry, source
    /// of a reverse one).
    #[repr(C)]
    #[derive(Clone, Copy, Debug)]
    pub struct CtValue {
        pub last_seen_ns: u64,
        pub nat_addr: u32,
        pub nat_port: u16,
        pub flags: u8,
        pub pad: u8,
        pub service_id: u32,
        pub backend_id: u32,
    }
    // SAFETY: repr(C), integers only, no implicit padding (24 bytes).
    unsafe impl aya::Pod for CtValue {}

    pub const CT_FLAG_FORWARD: u8 = 1;
    pub const CT_FLAG_REVERSE: u8 = 2;
    pub const CT_FLAG_CLOSING: u8 = 4;
}

/// The layout the maps in the bpf root have, if any (layout 1 left its version in `meta`).
fn root_layout(pin_dir: &Path) -> Option<u32> {
    let meta = MapData::from_pin(pin_dir.join(v1::META)).ok()?;
    let meta: Array<MapData, u32> = Array::try_from(Map::Array(meta)).ok()?;
    meta.get(&META_LAYOUT_VERSION, 0).ok()
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
    Ok(())
}

/// An upgrade under way: the old layout's maps are still pinned (and used by the programs the
/// links still hold) until [`Upgrade::finish`].
pub struct Upgrade {
    pin_dir: PathBuf,
    pub copied: usize,
}

/// Starts an upgrade if the root holds layout-1 maps: copies their state into ours (first pass;
/// entries ours already has are kept). `None` when there is nothing to upgrade.
pub fn start(pin_dir: &Path) -> Result<Option<Upgrade>> {
    match root_layout(pin_dir) {
        None => Ok(None),
        Some(1) => {
            let copied = copy_from_v1(pin_dir).context("copying state from layout 1")?;
            tracing::info!(copied, "upgrading pinned maps from layout 1: state copied, programs swap next");
            Ok(Some(Upgrade { pin_dir: pin_dir.to_path_buf(), copied }))
        }
        Some(other) => bail!("the bpf root holds maps of unknown layout {other}; refusing to touch them"),
    }
}

impl Upgrade {
    /// After every link runs the new programs: copies what the old ones wrote since the first
    /// pass, removes the old maps, and leaves the tombstone that stops a downgrade.
    pub fn finish(self) -> Result<usize> {
        let late = copy_from_v1(&self.pin_dir).context("copying state written during the swap")?;
        for name in v1::ALL {
            let path = self.pin_dir.join(name);
            if path.exists() {
                fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
            }
        }
        pin_tombstone(&self.pin_dir.join(v1::SERVICES)).context("pinning the downgrade tombstone")?;
        tracing::info!(copied = self.copied + late, "upgrade from layout 1 complete; old maps removed");
        Ok(late)
    }
}

fn open_root(pin_dir: &Path, name: &str) -> Result<MapData> {
    MapData::from_pin(pin_dir.join(name)).with_context(|| format!("opening {name} of layout 1"))
}

fn open_ours(pin_dir: &Path, name: &str) -> Result<MapData> {
    MapData::from_pin(maps_dir(pin_dir).join(name)).with_context(|| format!("opening our {name}"))
}

/// Copies (converting) the entries absent from `to`; returns how many.
fn copy_missing<K: aya::Pod + Eq + std::hash::Hash, From: aya::Pod, To: aya::Pod>(
    from: &HashMap<MapData, K, From>,
    to: &mut HashMap<MapData, K, To>,
    convert: impl Fn(&K, From) -> To,
) -> Result<usize> {
    let existing: std::collections::HashSet<K> = to.keys().filter_map(Result::ok).collect();
    let mut copied = 0;
    for entry in from.iter() {
        let (key, value) = entry?;
        if !existing.contains(&key) {
            to.insert(key, convert(&key, value), 0)?;
            copied += 1;
        }
    }
    Ok(copied)
}

fn hash<K: aya::Pod, V: aya::Pod>(data: MapData, lru: bool) -> Result<HashMap<MapData, K, V>> {
    Ok(HashMap::try_from(if lru { Map::LruHashMap(data) } else { Map::HashMap(data) })?)
}

/// Conntrack entries of layout 1 in layout 2's form: the whole translated tuple. A flow that
/// existed before the upgrade counts as answered, so it is never moved off its backend.
fn convert_ct(key: &CtKeyV4, old: v1::CtValue) -> CtValueV4 {
    let mut flags = CT_FLAG_SEEN_REPLY;
    if old.flags & v1::CT_FLAG_CLOSING != 0 {
        flags |= CT_FLAG_CLOSING;
    }
    let (nat_src, nat_dst) = if old.flags & v1::CT_FLAG_REVERSE != 0 {
        flags |= CT_FLAG_REVERSE;
        ((old.nat_addr, old.nat_port), (key.dst_addr, key.dst_port))
    } else {
        if old.flags & v1::CT_FLAG_FORWARD != 0 {
            flags |= CT_FLAG_FORWARD;
        }
        ((key.src_addr, key.src_port), (old.nat_addr, old.nat_port))
    };
    CtValueV4 {
        last_seen_ns: old.last_seen_ns,
        nat_src_addr: nat_src.0,
        nat_dst_addr: nat_dst.0,
        nat_src_port: nat_src.1,
        nat_dst_port: nat_dst.1,
        flags,
        pad: 0,
        service_id: old.service_id,
        backend_id: old.backend_id,
    }
}

fn copy_from_v1(pin_dir: &Path) -> Result<usize> {
    let mut copied = 0;
    macro_rules! copy_hash {
        ($name:expr, $key:ty, $value:ty, $lru:expr) => {{
            if pin_dir.join($name).exists() {
                let from: HashMap<MapData, $key, $value> = hash(open_root(pin_dir, $name)?, $lru)?;
                let mut to: HashMap<MapData, $key, $value> = hash(open_ours(pin_dir, $name)?, $lru)?;
                copied += copy_missing(&from, &mut to, |_, value| value)?;
            }
        }};
    }
    copy_hash!(v1::SERVICES, ServiceKeyV4, ServiceValue, false);
    copy_hash!(v1::BACKEND_SLOTS, BackendSlotKey, BackendSlotValue, false);
    copy_hash!(v1::BACKENDS, u32, BackendV4, false);
    copy_hash!(v1::AFFINITY, AffinityKeyV4, AffinityValue, true);
    copy_hash!(v1::POLICY_PODS, PolicyPodKeyV4, PolicyPodValue, false);
    copy_hash!(v1::POLICY_RULES, PolicyRuleKey, PolicyRuleValue, false);
    copy_hash!(v1::POLICY_CONNTRACK, PolicyCtKeyV4, PolicyCtValue, true);
    if pin_dir.join(v1::CONNTRACK).exists() {
        let from: HashMap<MapData, CtKeyV4, v1::CtValue> = hash(open_root(pin_dir, v1::CONNTRACK)?, true)?;
        let mut to: HashMap<MapData, CtKeyV4, CtValueV4> = hash(open_ours(pin_dir, v1::CONNTRACK)?, true)?;
        copied += copy_missing(&from, &mut to, convert_ct)?;
    }
    if pin_dir.join(v1::POLICY_PEERS).exists() {
        let from: LpmTrie<MapData, PeerPrefixV4, u8> =
            LpmTrie::try_from(Map::LpmTrie(open_root(pin_dir, v1::POLICY_PEERS)?))?;
        let mut to: LpmTrie<MapData, PeerPrefixV4, u8> =
            LpmTrie::try_from(Map::LpmTrie(open_ours(pin_dir, v1::POLICY_PEERS)?))?;
        for entry in from.iter() {
            let (key, value): (Key<PeerPrefixV4>, u8) = entry?;
            if to.get(&key, 0).is_err() {
                to.insert(&key, value, 0)?;
                copied += 1;
            }
        }
    }
    Ok(copied)
}

/// A one-entry hash map with 4-byte keys and values, pinned at `path`: layout 1's check of
/// `svc_v4` (8-byte keys) fails on it, so a layout-1 agent refuses to start here.
fn pin_tombstone(path: &Path) -> Result<()> {
    const BPF_MAP_CREATE: libc::c_long = 0;
    const BPF_OBJ_PIN: libc::c_long = 6;
    const BPF_MAP_TYPE_HASH: u32 = 1;
    #[repr(C)]
    #[derive(Default)]
    struct MapCreate {
        map_type: u32,
        key_size: u32,
        value_size: u32,
        max_entries: u32,
        map_flags: u32,
        inner_map_fd: u32,
        numa_node: u32,
        map_name: [u8; 16],
    }
    #[repr(C)]
    struct ObjPin {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
    }
    let mut name = [0u8; 16];
    name[..9].copy_from_slice(b"tombstone");
    let attr = MapCreate {
        map_type: BPF_MAP_TYPE_HASH,
        key_size: 4,
        value_size: 4,
        max_entries: 1,
        map_name: name,
        ..Default::default()
    };
    // SAFETY: a valid BPF_MAP_CREATE attribute of the size passed.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, BPF_MAP_CREATE, &attr, std::mem::size_of::<MapCreate>() as u32) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("BPF_MAP_CREATE");
    }
    // SAFETY: the syscall returned a new file descriptor we now own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())?;
    let pin = ObjPin { pathname: c_path.as_ptr() as u64, bpf_fd: fd.as_raw_fd() as u32, file_flags: 0 };
    // SAFETY: a valid BPF_OBJ_PIN attribute; the path outlives the call.
    if unsafe { libc::syscall(libc::SYS_bpf, BPF_OBJ_PIN, &pin, std::mem::size_of::<ObjPin>() as u32) } < 0 {
        return Err(std::io::Error::last_os_error()).with_context(|| format!("pinning {}", path.display()));
    }
    Ok(())
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
                copy_absent_entries(&from, &to).with_context(|| format!("copying {name} into its new size"))?;
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

/// Copies every entry of `from` absent from `to` (same key and value sizes), byte for byte.
/// Returns how many, and whether `to` ran out of room (only a plain hash map can).
fn copy_absent_entries(from: &MapData, to: &MapData) -> Result<(usize, bool)> {
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
    let per_cpu = matches!(info.map_type(), Ok(MapType::PerCpuHash | MapType::LruPerCpuHash));
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
            flags: BPF_NOEXIST,
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

    #[test]
    fn conntrack_entries_keep_their_translation_in_the_new_form() {
        let client = (u32::from_ne_bytes([10, 1, 0, 7]), 40000u16.to_be());
        let vip = (u32::from_ne_bytes([10, 96, 0, 10]), 80u16.to_be());
        let backend = (u32::from_ne_bytes([10, 0, 0, 2]), 8080u16.to_be());
        let old = |nat: (u32, u16), flags| v1::CtValue {
            last_seen_ns: 5,
            nat_addr: nat.0,
            nat_port: nat.1,
            flags,
            pad: 0,
            service_id: 3,
            backend_id: 9,
        };
        let key = |src: (u32, u16), dst: (u32, u16)| CtKeyV4 {
            src_addr: src.0,
            dst_addr: dst.0,
            src_port: src.1,
            dst_port: dst.1,
            proto: 6,
            pad: [0; 3],
        };
        let forward = convert_ct(&key(client, vip), old(backend, v1::CT_FLAG_FORWARD));
        assert_eq!((forward.nat_src_addr, forward.nat_src_port), client, "the client stays the source");
        assert_eq!((forward.nat_dst_addr, forward.nat_dst_port), backend);
        assert_eq!(forward.flags, CT_FLAG_FORWARD | CT_FLAG_SEEN_REPLY);
        let reverse = convert_ct(&key(backend, client), old(vip, v1::CT_FLAG_REVERSE | v1::CT_FLAG_CLOSING));
        assert_eq!((reverse.nat_src_addr, reverse.nat_src_port), vip, "replies come from the frontend");
        assert_eq!((reverse.nat_dst_addr, reverse.nat_dst_port), client);
        assert_eq!(reverse.flags, CT_FLAG_REVERSE | CT_FLAG_CLOSING | CT_FLAG_SEEN_REPLY);
        assert_eq!((reverse.last_seen_ns, reverse.service_id, reverse.backend_id), (5, 3, 9));
        // The reverse entry's key is what the forward entry's translation looks like reversed.
        assert_eq!(forward.reverse_key(6), key(backend, client));
    }
}
