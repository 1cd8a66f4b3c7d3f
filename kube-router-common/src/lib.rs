//! Keys and values of the pinned BPF maps, shared by the eBPF programs and the agent.
//!
//! Every type here is `#[repr(C)]` with explicit padding so that both sides, and `bpftool map
//! dump`, agree on the bytes. Addresses and ports are stored in network byte order, exactly as
//! they appear in packets, so the datapath never converts. `docs/maps.md` documents each map;
//! changing a layout means bumping [`LAYOUT_VERSION`] (the maps of layout N are pinned under
//! `vN/`) and a migration in the agent's `bpf/migrate.rs`.
//!
//! Size (about 820 lines before its tests): the whole byte contract between the two sides, kept
//! in one file so that a layout change and its version bump are reviewed together.
#![no_std]

mod policy;
pub use policy::*;
mod sock;
pub use sock::*;
mod svc_stats;
pub use svc_stats::*;
mod monitor;
pub use monitor::*;
mod source_check;
pub use source_check::*;
mod plain;
pub use plain::*;

/// Version of the whole map layout. Stored in the `meta` map at index [`META_LAYOUT_VERSION`],
/// and naming the directory the maps are pinned in (`<bpf root>/v3/`), so an upgrade can create
/// the new maps beside the old ones and move state across before it swaps the programs.
/// Layout 1 pinned its maps directly in the bpf root.
pub const LAYOUT_VERSION: u32 = 3;

/// Directory under bpffs where maps and links are pinned.
pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/kube-router";

/// Map names (also their pin file names). BPF object names are limited to 15 bytes.
pub mod map_names {
    pub const SERVICES: &str = "svc_v4";
    pub const BACKEND_SLOTS: &str = "svc_slots_v4";
    pub const BACKENDS: &str = "backends_v4";
    pub const CONNTRACK: &str = "ct_v4";
    pub const AFFINITY: &str = "affinity_v4";
    pub const LB_STATS: &str = "lb_stats";
    pub const META: &str = "meta";
    pub const POLICY_PODS: &str = "pol_pods_v4";
    pub const POLICY_PORTS: &str = "pol_ports";
    pub const POLICY_PEERS: &str = "pol_peers_v4";
    pub const POLICY_CONNTRACK: &str = "pol_ct_v4";
    pub const POLICY_PODS_V6: &str = "pol_pods_v6";
    pub const POLICY_PEERS_V6: &str = "pol_peers_v6";
    pub const POLICY_CONNTRACK_V6: &str = "pol_ct_v6";
    pub const POLICY_STATS: &str = "pol_stats";
    pub const LB_CONFIG: &str = "lb_config";
    pub const FRAGMENTS: &str = "frag_v4";
    pub const CLUSTER_NETS: &str = "cluster_nets_v4";
    pub const SERVICES_V6: &str = "svc_v6";
    pub const BACKEND_SLOTS_V6: &str = "svc_slots_v6";
    pub const BACKENDS_V6: &str = "backends_v6";
    pub const CONNTRACK_V6: &str = "ct_v6";
    pub const AFFINITY_V6: &str = "affinity_v6";
    pub const FRAGMENTS_V6: &str = "frag_v6";
    pub const CLUSTER_NETS_V6: &str = "cluster_nets_v6";
    pub const SOURCE_RANGES: &str = "lb_src_v4";
    pub const SOURCE_RANGES_V6: &str = "lb_src_v6";
    pub const OVERLAY_ROUTES: &str = "ovl_routes_v4";
    pub const OVERLAY_REMOTES: &str = "ovl_remotes_v4";
    pub const OVERLAY_STATS: &str = "ovl_stats";
    pub const XDP_STATS: &str = "xdp_stats";
    pub const DSR_STATS: &str = "dsr_stats";
    pub const POLICY_GUARD_STATS: &str = "pol_guard_stats";
    pub const CT_GATE: &str = "ct_gate_v4";
    pub const CT_GATE_V6: &str = "ct_gate_v6";
    pub const CT_LIFETIMES: &str = "ct_cfg";
    pub const POLICY_CONFIG: &str = "pol_cfg";
}

pub const SERVICES_MAX_ENTRIES: u32 = 65_536;
pub const BACKEND_SLOTS_MAX_ENTRIES: u32 = 262_144;
pub const BACKENDS_MAX_ENTRIES: u32 = 262_144;
pub const CONNTRACK_MAX_ENTRIES: u32 = 262_144;
pub const AFFINITY_MAX_ENTRIES: u32 = 65_536;
pub const META_MAX_ENTRIES: u32 = 4;
pub const FRAGMENTS_MAX_ENTRIES: u32 = 8_192;
pub const CLUSTER_NETS_MAX_ENTRIES: u32 = 16_384;
pub const SOURCE_RANGES_MAX_ENTRIES: u32 = 65_536;
/// `ct_gate_v4/v6`: the (address, port, protocol) endpoints of Service flows, each frontend and
/// backend once however many flows use it. An LRU: an endpoint no packet has touched for longest
/// goes first when it is full.
pub const CT_GATE_MAX_ENTRIES: u32 = 65_536;

/// `cluster_nets_v4` values (LPM over addresses; the longest match decides): what a prefix is
/// inside the cluster. Pod egress to an address with no match at all is masqueraded.
pub const CLUSTER_NET_POD: u32 = 1 << 0;
pub const CLUSTER_NET_NODE: u32 = 1 << 1;
pub const CLUSTER_NET_SERVICE: u32 = 1 << 2;

/// Index in the `meta` array holding [`LAYOUT_VERSION`].
pub const META_LAYOUT_VERSION: u32 = 0;
/// Index in the `meta` array holding the API state the service maps were last written from
/// completely (unix seconds of the cache read; 0: never, or a write that did not finish). The
/// agent alone reads it: at a restart it decides whether the checkpoint is older than the maps.
pub const META_SERVICES_AS_OF: u32 = 1;
/// The same for the policy maps.
pub const META_POLICY_AS_OF: u32 = 2;
/// Index in the `meta` array: nonzero once the load balancer may let a packet that touches no
/// `ct_gate_v4/v6` endpoint, frontend or node address pass without a conntrack lookup. The agent
/// writes 0 before it attaches its programs and sets it once every conntrack entry it found (some
/// perhaps written by an older release, which records no endpoints) has its endpoints recorded.
pub const META_LB_GATE: u32 = 3;

pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;
pub const IPPROTO_ICMP: u8 = 1;
pub const IPPROTO_SCTP: u8 = 132;
pub const IPPROTO_ICMPV6: u8 = 58;

/// An IPv6 address as four 32-bit words, each in network byte order (the packet's bytes).
///
/// A struct rather than a bare `[u32; 4]` for the BPF side: comparing or copying the array lets
/// LLVM use 128-bit integers, which the BPF backend cannot lower. Equality here is word by word.
#[repr(C)]
#[allow(clippy::derived_hash_with_manual_eq)] // the same relation as the derived one
#[derive(Clone, Copy, Debug, Default, Eq, Hash, PartialOrd, Ord)]
pub struct Ipv6Words(pub [u32; 4]);

impl PartialEq for Ipv6Words {
    #[inline(always)]
    fn eq(&self, other: &Self) -> bool {
        let (a, b) = (&self.0, &other.0);
        (a[0] ^ b[0]) | (a[1] ^ b[1]) | (a[2] ^ b[2]) | (a[3] ^ b[3]) == 0
    }
}

impl Ipv6Words {
    pub const UNSPECIFIED: Self = Self([0; 4]);

    /// From the address's 16 packet bytes.
    pub const fn from_octets(o: [u8; 16]) -> Self {
        Self([
            u32::from_ne_bytes([o[0], o[1], o[2], o[3]]),
            u32::from_ne_bytes([o[4], o[5], o[6], o[7]]),
            u32::from_ne_bytes([o[8], o[9], o[10], o[11]]),
            u32::from_ne_bytes([o[12], o[13], o[14], o[15]]),
        ])
    }

    /// The address's 16 packet bytes.
    pub const fn octets(&self) -> [u8; 16] {
        let mut out = [0u8; 16];
        let mut i = 0;
        while i < 4 {
            let bytes = self.0[i].to_ne_bytes();
            out[4 * i] = bytes[0];
            out[4 * i + 1] = bytes[1];
            out[4 * i + 2] = bytes[2];
            out[4 * i + 3] = bytes[3];
            i += 1;
        }
        out
    }
}

/// A service frontend: ClusterIP, ExternalIP, LoadBalancer IP or node IP (NodePort) + port.
/// `A` is the address: `u32` (IPv4) or [`Ipv6Words`], both in network byte order.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey<A> {
    /// Network byte order.
    pub addr: A,
    /// Network byte order.
    pub port: u16,
    pub proto: u8,
    pub pad: u8,
}
pub type ServiceKeyV4 = ServiceKey<u32>;
pub type ServiceKeyV6 = ServiceKey<Ipv6Words>;

/// Service uses ClientIP session affinity (`affinity_timeout_secs` applies).
pub const SVC_FLAG_AFFINITY: u32 = 1 << 0;
/// Frontend only uses node-local endpoints (externalTrafficPolicy: Local).
pub const SVC_FLAG_LOCAL_ONLY: u32 = 1 << 1;
/// Frontend is a NodePort on a node address.
pub const SVC_FLAG_NODEPORT: u32 = 1 << 2;
/// Frontend is reached from outside the cluster (NodePort, ExternalIP, LoadBalancer IP): with
/// externalTrafficPolicy Cluster a flow to a backend on another node is source-NATed to this node
/// so the reply comes back through it.
pub const SVC_FLAG_EXTERNAL: u32 = 1 << 3;
/// A backend connecting to its own service is source-NATed to the frontend address (hairpin),
/// so its own reply is not dropped as coming from itself.
pub const SVC_FLAG_HAIRPIN: u32 = 1 << 4;
/// New flows are accepted only from sources in the frontend's backend set's prefixes in
/// `lb_src_v4` / `lb_src_v6` (`loadBalancerSourceRanges`, on LoadBalancer IP frontends).
pub const SVC_FLAG_SOURCE_RANGES: u32 = 1 << 5;
/// New flows choose their backend by Maglev consistent hashing of the client: the slots hold the
/// service's lookup table (`backend_count` is its prime size) and the slot is the client's hash
/// modulo that size, so every node picks the same backend for the same client.
pub const SVC_FLAG_MAGLEV: u32 = 1 << 6;
/// With [`SVC_FLAG_MAGLEV`]: the client's source port is hashed too (IPVS mh's `mh-port`);
/// without it, only the client address (every connection of a client to one backend).
pub const SVC_FLAG_MAGLEV_PORT: u32 = 1 << 7;
/// Direct server return (`kube-router.io/service.dsr: tunnel`, ExternalIP and LoadBalancer IP
/// frontends, and NodePorts): a new flow whose backend is on another node is not translated
/// here but carried to it in IPIP or IPv6-in-IPv6 (outer destination: the backend's own address,
/// which the cluster routes to its node); that node translates it and its reply goes straight to
/// the client. On a NodePort, for clients outside the cluster only (see `lb::new_flow`).
pub const SVC_FLAG_DSR: u32 = 1 << 8;

/// Addresses as the 32-bit words Maglev's flow hash consumes (packet byte order).
pub trait FlowHashWords {
    fn mix_into(&self, hash: u32) -> u32;
}

impl FlowHashWords for u32 {
    #[inline(always)]
    fn mix_into(&self, hash: u32) -> u32 {
        mix32(hash, *self)
    }
}

impl FlowHashWords for Ipv6Words {
    #[inline(always)]
    fn mix_into(&self, hash: u32) -> u32 {
        mix32(mix32(mix32(mix32(hash, self.0[0]), self.0[1]), self.0[2]), self.0[3])
    }
}

/// One MurmurHash3 (x86, 32-bit) block step.
#[inline(always)]
pub const fn mix32(hash: u32, word: u32) -> u32 {
    let k = word.wrapping_mul(0xcc9e_2d51).rotate_left(15).wrapping_mul(0x1b87_3593);
    (hash ^ k).rotate_left(13).wrapping_mul(5).wrapping_add(0xe654_6b64)
}

/// MurmurHash3's finaliser: every input bit affects every output bit.
#[inline(always)]
pub const fn fmix32(mut hash: u32) -> u32 {
    hash ^= hash >> 16;
    hash = hash.wrapping_mul(0x85eb_ca6b);
    hash ^= hash >> 13;
    hash = hash.wrapping_mul(0xc2b2_ae35);
    hash ^ (hash >> 16)
}

/// The hash a Maglev service's table is indexed with (modulo its size). A fixed seed: nodes
/// must agree. `src_port` in network byte order, as in the packet.
#[inline(always)]
pub fn maglev_flow_hash<A: FlowHashWords>(src_addr: &A, src_port: u16, with_port: bool) -> u32 {
    let hash = src_addr.mix_into(0x6b72_6d67);
    fmix32(if with_port { mix32(hash, src_port as u32) } else { hash })
}

/// `lb_src_v4` / `lb_src_v6` key (an LPM trie key's data): the service id, matched in full,
/// then the source prefix. Prefix length = 32 + the source prefix's length.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SourceRangeKey<A> {
    /// Network byte order, like the address, so the trie compares it whole.
    pub service_id: u32,
    pub addr: A,
}
pub type SourceRangeKeyV4 = SourceRangeKey<u32>;
pub type SourceRangeKeyV6 = SourceRangeKey<Ipv6Words>;

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ServiceValue {
    /// Names the backend set in `svc_slots_v4`. Stable across agent restarts.
    pub service_id: u32,
    /// Slots `0..backend_count` exist in `svc_slots_v4`; 0 means "no endpoints": new flows are
    /// refused at once (TCP RST, UDP ICMP port unreachable), as kube-proxy's REJECT does.
    pub backend_count: u32,
    pub flags: u32,
    pub affinity_timeout_secs: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendSlotKey {
    pub service_id: u32,
    pub slot: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BackendSlotValue {
    pub backend_id: u32,
}

/// The endpoint runs on this node (its traffic needs no source NAT to come back).
pub const BACKEND_FLAG_LOCAL: u16 = 1 << 0;

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Backend<A> {
    /// Network byte order.
    pub addr: A,
    /// Network byte order.
    pub port: u16,
    /// `BACKEND_FLAG_*`.
    pub flags: u16,
}
pub type BackendV4 = Backend<u32>;
pub type BackendV6 = Backend<Ipv6Words>;

/// Conntrack key: the 5-tuple exactly as seen in the packet that looks it up.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CtKey<A> {
    pub src_addr: A,
    pub dst_addr: A,
    pub src_port: u16,
    pub dst_port: u16,
    pub proto: u8,
    pub pad: [u8; 3],
}
pub type CtKeyV4 = CtKey<u32>;
pub type CtKeyV6 = CtKey<Ipv6Words>;

/// The flow's original direction (client -> frontend). Translated at TC ingress.
pub const CT_FLAG_FORWARD: u16 = 1 << 0;
/// The reply direction. Translated at TC egress, after routing (the restored source may be a
/// node address, which the kernel drops as a martian on ingress) — unless [`CT_FLAG_FULL_NAT`].
pub const CT_FLAG_REVERSE: u16 = 1 << 1;
/// A FIN or RST was seen: the entry expires after [`CT_LIFETIME_CLOSING_SECS`].
pub const CT_FLAG_CLOSING: u16 = 1 << 2;
/// Source and destination are both translated (SNAT + DNAT), in both directions at TC ingress.
pub const CT_FLAG_FULL_NAT: u16 = 1 << 3;
/// After translation the packet's source is a node address: it is routed by the program
/// (`bpf_fib_lookup` + `bpf_redirect_neigh`) instead of entering the stack as a martian.
pub const CT_FLAG_REDIRECT: u16 = 1 << 4;
/// A reply has been seen (TCP: the handshake completed). Until then a flow whose backend went
/// away is re-balanced, and its entries live [`CT_LIFETIME_UNREPLIED_SECS`]; afterwards it stays
/// on its backend. A direct-server-return tunnel's entry (no reply passes it) gets it from the
/// client's first ACK.
pub const CT_FLAG_SEEN_REPLY: u16 = 1 << 5;
/// Pod egress masquerade: the forward direction is translated at TC egress, as the packet leaves
/// the node (after NetworkPolicy judged it at the pod's interface), not at ingress.
pub const CT_FLAG_EGRESS: u16 = 1 << 6;
/// Direct server return, on the node the client's packets reach: the forward entry's packets
/// are tunnelled untranslated to the backend `nat_dst_*` (its port travels in the outer
/// header's IP ID). No reverse entry: the replies never come back through this node.
pub const CT_FLAG_DSR_ENCAP: u16 = 1 << 7;
/// Direct server return, on the backend's node: both entries were made from a tunnelled packet
/// (the tunnel named the backend, not a slot of this node's).
pub const CT_FLAG_DSR_DELIVER: u16 = 1 << 8;
/// A flow an outside client opened to a pod's own address (no Service): both entries leave its
/// packets as they are. They exist so that the pod's replies are known as replies and never
/// start a pod egress masquerade flow. Older programs read such a pair as a flow translated to
/// its own tuple: the same packets.
pub const CT_FLAG_UNTRANSLATED: u16 = 1 << 9;

/// An answered TCP flow, idle (default of `--service-tcp-timeout`, [`CtLifetimes::tcp_secs`]).
pub const CT_LIFETIME_TCP_SECS: u64 = 6 * 3600;
/// An answered flow of another protocol, idle (UDP: default of `--service-udp-timeout`,
/// [`CtLifetimes::udp_secs`]).
pub const CT_LIFETIME_NON_TCP_SECS: u64 = 60;
/// After a FIN or RST (default of `--service-tcpfin-timeout`, [`CtLifetimes::closing_secs`]).
pub const CT_LIFETIME_CLOSING_SECS: u64 = 10;
/// A flow nothing has answered yet (a SYN flood, a black-holed destination): it must not hold
/// its entries and its SNAT port for the TCP lifetime.
pub const CT_LIFETIME_UNREPLIED_SECS: u64 = 60;

/// What a packet whose 5-tuple is the key becomes: its whole tuple after translation, so every
/// kind of NAT (DNAT, SNAT, both, reverse) is one rewrite to `nat_*`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CtValue<A> {
    /// Monotonic clock (`bpf_ktime_get_ns`) of the last packet, refreshed at most once a second.
    pub last_seen_ns: u64,
    /// Network byte order, like the key.
    pub nat_src_addr: A,
    pub nat_dst_addr: A,
    pub nat_src_port: u16,
    pub nat_dst_port: u16,
    /// `CT_FLAG_*`.
    pub flags: u16,
    pub pad: u16,
    pub service_id: u32,
    pub backend_id: u32,
}

pub type CtValueV4 = CtValue<u32>;
pub type CtValueV6 = CtValue<Ipv6Words>;

/// `ct_cfg` (one entry): the load balancer conntrack's lifetimes the operator chose, in seconds
/// (`--service-tcp-timeout`, `--service-tcpfin-timeout`, `--service-udp-timeout`). A zero field,
/// or no entry, is the built-in default (`CT_LIFETIME_*`), so a datapath loaded before the agent
/// wrote it behaves as before the map existed. The unreplied lifetime is not configurable.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CtLifetimes {
    /// An answered TCP flow, idle; 0: [`CT_LIFETIME_TCP_SECS`].
    pub tcp_secs: u32,
    /// After a FIN or RST; 0: [`CT_LIFETIME_CLOSING_SECS`].
    pub closing_secs: u32,
    /// An answered UDP flow, idle; 0: [`CT_LIFETIME_NON_TCP_SECS`].
    pub udp_secs: u32,
    pub pad: u32,
}

const fn configured_or(secs: u32, default: u64) -> u64 {
    if secs == 0 {
        default
    } else {
        secs as u64
    }
}

impl CtLifetimes {
    /// The closing lifetime in seconds, `lifetimes` being the map's entry if any.
    pub const fn closing_secs_of(lifetimes: Option<&CtLifetimes>) -> u64 {
        match lifetimes {
            Some(l) => configured_or(l.closing_secs, CT_LIFETIME_CLOSING_SECS),
            None => CT_LIFETIME_CLOSING_SECS,
        }
    }

    /// The answered TCP lifetime in seconds.
    pub const fn tcp_secs_of(lifetimes: Option<&CtLifetimes>) -> u64 {
        match lifetimes {
            Some(l) => configured_or(l.tcp_secs, CT_LIFETIME_TCP_SECS),
            None => CT_LIFETIME_TCP_SECS,
        }
    }

    /// The answered lifetime of protocol `proto` other than TCP, in seconds (UDP configurable).
    pub const fn non_tcp_secs_of(lifetimes: Option<&CtLifetimes>, proto: u8) -> u64 {
        match lifetimes {
            Some(l) if proto == IPPROTO_UDP => configured_or(l.udp_secs, CT_LIFETIME_NON_TCP_SECS),
            _ => CT_LIFETIME_NON_TCP_SECS,
        }
    }
}

impl<A: Copy> CtValue<A> {
    /// How long the entry lives after its last packet, `lifetimes` being `ct_cfg`'s entry (`None`:
    /// the built-in defaults).
    pub const fn lifetime_ns(&self, proto: u8, lifetimes: Option<&CtLifetimes>) -> u64 {
        let secs = if self.flags & CT_FLAG_CLOSING != 0 {
            CtLifetimes::closing_secs_of(lifetimes)
        } else if self.flags & CT_FLAG_SEEN_REPLY == 0 {
            CT_LIFETIME_UNREPLIED_SECS
        } else if proto == IPPROTO_TCP {
            CtLifetimes::tcp_secs_of(lifetimes)
        } else {
            CtLifetimes::non_tcp_secs_of(lifetimes, proto)
        };
        secs * 1_000_000_000
    }

    /// The key of the opposite direction's entry: the translated packet, reversed.
    pub const fn reverse_key(&self, proto: u8) -> CtKey<A> {
        CtKey {
            src_addr: self.nat_dst_addr,
            dst_addr: self.nat_src_addr,
            src_port: self.nat_dst_port,
            dst_port: self.nat_src_port,
            proto,
            pad: [0; 3],
        }
    }
}

/// `lb_config` (one entry): the node's settings the datapath needs, written by the agent.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct LbConfig {
    /// Node address that source-NATed IPv4 flows leave with (network byte order); 0 = no SNAT.
    pub snat_addr: u32,
    /// The same for IPv6; all zero = no SNAT.
    pub snat_addr_v6: Ipv6Words,
    /// Inclusive range of source ports for SNAT, host byte order.
    pub snat_port_min: u16,
    pub snat_port_max: u16,
    /// `LB_CONFIG_*`.
    pub flags: u32,
    pub pad: u32,
}

/// Source-NAT every service flow to the node (`--masquerade-all`).
pub const LB_CONFIG_MASQUERADE_ALL: u32 = 1 << 0;
/// Source-NAT pod traffic leaving the cluster (`--enable-pod-egress`; see `cluster_nets_v4`).
pub const LB_CONFIG_POD_EGRESS: u32 = 1 << 1;

/// A fragmented datagram: its later fragments carry no ports, so the first fragment's are
/// remembered under (source, destination, IP ID, protocol) as they arrive.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FragKey<A> {
    pub src_addr: A,
    pub dst_addr: A,
    /// Network byte order (IPv4's 16-bit identification in the first two bytes; IPv6's 32 bits).
    pub id: u32,
    pub proto: u8,
    pub pad: [u8; 3],
}
pub type FragKeyV4 = FragKey<u32>;
pub type FragKeyV6 = FragKey<Ipv6Words>;

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FragPorts {
    pub src_port: u16,
    pub dst_port: u16,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AffinityKey<A> {
    pub client_addr: A,
    pub service_id: u32,
}
pub type AffinityKeyV4 = AffinityKey<u32>;
pub type AffinityKeyV6 = AffinityKey<Ipv6Words>;

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AffinityValue {
    pub last_used_ns: u64,
    pub backend_id: u32,
    /// Slot the backend was picked from; affinity holds only while that slot still names it.
    pub slot: u32,
}

/// Indices of the per-CPU `lb_stats` array (u64 packet counters).
pub mod lb_stat {
    pub const PACKETS: u32 = 0;
    /// Neither IPv4 nor IPv6 (ARP, ...): passed.
    pub const NOT_IP: u32 = 1;
    pub const NO_SERVICE: u32 = 2;
    pub const NEW_FLOW: u32 = 3;
    pub const CT_HIT: u32 = 4;
    pub const REVERSE_NAT: u32 = 5;
    /// A new flow to a frontend without endpoints, refused (see [`REJECT_SENT`]).
    pub const NO_BACKEND_DROP: u32 = 6;
    pub const AFFINITY_HIT: u32 = 7;
    pub const CT_INSERT_FAILED: u32 = 8;
    /// A later fragment that could not be matched to its first fragment's ports: passed as is.
    pub const FRAGMENT_PASS: u32 = 9;
    pub const REWRITE_FAILED: u32 = 10;
    /// New flows source-NATed (north-south to another node, hairpin, --masquerade-all).
    pub const SNAT_NEW_FLOW: u32 = 11;
    /// New flows refused because every SNAT port tried was taken.
    pub const SNAT_PORTS_EXHAUSTED: u32 = 12;
    /// A TCP RST or ICMP port unreachable sent for a frontend without endpoints.
    pub const REJECT_SENT: u32 = 13;
    /// ICMP errors about a translated flow, translated back.
    pub const ICMP_ERROR_NAT: u32 = 14;
    /// Later fragments of a translated flow, translated with their first fragment's ports.
    pub const FRAGMENT_NAT: u32 = 15;
    /// Packets routed by the program after translation (`bpf_redirect_neigh`).
    pub const REDIRECTED: u32 = 16;
    /// Packets that needed that but had no route (or TTL left): dropped.
    pub const REDIRECT_FAILED: u32 = 17;
    /// Flows balanced again: moved off a backend that is gone (UDP, or TCP before the handshake
    /// completed), or a retried SYN whose flow had lost its reverse entry.
    pub const CT_RESELECTED: u32 = 18;
    /// New pod flows leaving the cluster, masqueraded to the node address.
    pub const EGRESS_MASQUERADE_NEW_FLOW: u32 = 19;
    /// Packets of masqueraded pod flows translated (both directions).
    pub const EGRESS_MASQUERADE: u32 = 20;
    /// A new flow to a LoadBalancer IP from outside its `loadBalancerSourceRanges`: dropped.
    pub const SOURCE_RANGE_DROP: u32 = 21;
    /// A packet we route that does not fit the route's MTU: answered with ICMP "fragmentation
    /// needed" / ICMPv6 "packet too big" quoting it as its sender sent it, and dropped.
    pub const FRAG_NEEDED_SENT: u32 = 22;
    /// A connection opened straight to a backend from the client address and port of a closed
    /// Service flow to that backend (ports are unique per peer, and that flow's peer was the
    /// frontend): the old flow's entries were released so its reverse translation does not
    /// catch the new connection's replies.
    pub const CT_TUPLE_REUSED: u32 = 23;
    /// The same while that Service flow is still open: both have one tuple at the backend; the
    /// open flow keeps its translation and the new connection cannot open (see
    /// `conntrack::release_reply_tuple`).
    pub const CT_TUPLE_CLASH: u32 = 24;
    pub const COUNT: u32 = 25;
    /// Metric label of each index, in index order.
    pub const NAMES: [&str; COUNT as usize] = [
        "packets",
        "not_ip",
        "no_service",
        "new_flow",
        "ct_hit",
        "reverse_nat",
        "no_backend_drop",
        "affinity_hit",
        "ct_insert_failed",
        "fragment_pass",
        "rewrite_failed",
        "snat_new_flow",
        "snat_ports_exhausted",
        "reject_sent",
        "icmp_error_nat",
        "fragment_nat",
        "redirected",
        "redirect_failed",
        "ct_reselected",
        "egress_masquerade_new_flow",
        "egress_masquerade",
        "source_range_drop",
        "frag_needed_sent",
        "ct_tuple_reused",
        "ct_tuple_clash",
    ];
}

/// Pod CIDRs behind an overlay tunnel (`ovl_routes_v4`, an LPM trie keyed by the inner
/// destination) and the nodes we accept tunnelled packets from (`ovl_remotes_v4`, keyed by the
/// outer source).
pub const OVERLAY_ROUTES_MAX_ENTRIES: u32 = 16_384;
pub const OVERLAY_REMOTES_MAX_ENTRIES: u32 = 16_384;

/// LPM key data of `ovl_routes_v4`: an IPv4 network, network byte order.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OverlayPrefixV4 {
    pub addr: u32,
}

/// IPIP: the inner IPv4 packet right after the outer header (IP protocol 4).
pub const OVERLAY_ENCAP_IPIP: u8 = 1;
/// FOU/GUE: outer IPv4 + UDP to `port` + a 4-byte GUE header, then the inner packet (the
/// kernel's `ip fou add port N gue` / `encap gue`).
pub const OVERLAY_ENCAP_FOU: u8 = 2;

/// One tunnel: the value of both overlay maps.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OverlayTunnelV4 {
    /// The other node (outer destination when sending, outer source when receiving).
    pub remote: u32,
    /// This node's address on that tunnel (outer source / destination).
    pub local: u32,
    /// [`OVERLAY_ENCAP_IPIP`] or [`OVERLAY_ENCAP_FOU`].
    pub encap: u8,
    pub pad: u8,
    /// FOU destination port, network byte order (0 for IPIP).
    pub port: u16,
}

/// Indices of the `ovl_stats` per-CPU counters.
pub mod ovl_stat {
    pub const ENCAPSULATED: u32 = 0;
    pub const DECAPSULATED: u32 = 1;
    pub const ENCAP_FAILED: u32 = 2;
    pub const DECAP_FAILED: u32 = 3;
    /// IPIP/GUE packets from an address that is no node we tunnel with: passed untouched.
    pub const UNKNOWN_REMOTE: u32 = 4;
    pub const COUNT: u32 = 5;
    pub const NAMES: [&str; COUNT as usize] =
        ["encapsulated", "decapsulated", "encap_failed", "decap_failed", "unknown_remote"];
}

/// Indices of the `xdp_stats` per-CPU counters of the XDP fast path on node uplinks
/// (`kr_xdp_lb`). Every packet it sees ends in exactly one of the verdict counters
/// (`tx`, `redirect`, `pass_*`, `rewrite_failed`); `new_flow`, `forward` and `reply` say which
/// kind of flow packet was served.
pub mod xdp_stat {
    pub const PACKETS: u32 = 0;
    /// Translated and sent back out of the interface it came in on (`XDP_TX`).
    pub const TX: u32 = 1;
    /// Translated and sent out of another interface (`XDP_REDIRECT`).
    pub const REDIRECT: u32 = 2;
    /// First packets of new flows recorded by XDP (conntrack and NAT entries written).
    pub const NEW_FLOW: u32 = 3;
    /// Client-to-backend packets of known flows served.
    pub const FORWARD: u32 = 4;
    /// Backend-to-client replies of known flows served (reverse NAT).
    pub const REPLY: u32 = 5;
    /// Not IPv4/IPv6 TCP or UDP (ARP, ICMP, other protocols): passed to TC.
    pub const PASS_NOT_LB: u32 = 6;
    pub const PASS_FRAGMENT: u32 = 7;
    /// No flow and no frontend: not service traffic.
    pub const PASS_NO_SERVICE: u32 = 8;
    /// Service traffic whose translation TC does (local backend, no endpoints, source ranges,
    /// masquerade, a gone backend, ...).
    pub const PASS_TO_TC: u32 = 9;
    /// The FIB lookup did not give a complete next hop (no neighbour entry yet, no route, MTU,
    /// TTL): TC routes it (and resolves the neighbour).
    pub const PASS_NO_ROUTE: u32 = 10;
    pub const REWRITE_FAILED: u32 = 11;
    /// A checksum still to be completed by the sender (CHECKSUM_PARTIAL, from a veth peer on
    /// this host): XDP cannot update it correctly without the skb, TC can.
    pub const PASS_CHECKSUM_PARTIAL: u32 = 12;
    pub const COUNT: u32 = 13;
    pub const NAMES: [&str; COUNT as usize] = [
        "packets",
        "tx",
        "redirect",
        "new_flow",
        "forward",
        "reply",
        "pass_not_lb",
        "pass_fragment",
        "pass_no_service",
        "pass_to_tc",
        "pass_no_route",
        "rewrite_failed",
        "pass_checksum_partial",
    ];
}

/// Indices of the `dsr_stats` per-CPU counters (direct server return, both families; a map of
/// its own so that the older maps keep their layout).
pub mod dsr_stat {
    /// New flows the node the client reached sends to another node's backend in a tunnel.
    pub const NEW_FLOW: u32 = 0;
    /// Packets encapsulated and routed to the backend's node (first and later ones).
    pub const ENCAPSULATED: u32 = 1;
    /// Encapsulation (`bpf_skb_adjust_room`) failed: dropped.
    pub const ENCAP_FAILED: u32 = 2;
    /// A packet too big for the route once encapsulated: answered with "fragmentation needed" /
    /// "packet too big" (the route's MTU less the outer header) as its sender sent it.
    pub const FRAG_NEEDED_SENT: u32 = 3;
    /// Tunnelled packets decapsulated on the backend's node (first and later ones).
    pub const DECAPSULATED: u32 = 4;
    /// New flows recorded on the backend's node from a tunnelled packet (translated to the
    /// backend there, replies restored to the frontend and routed straight to the client).
    pub const DELIVER_NEW_FLOW: u32 = 5;
    /// A tunnelled packet for no frontend of this node (nor for this NodePort on another node),
    /// or not TCP or UDP: dropped.
    pub const DECAP_REFUSED: u32 = 6;
    pub const DECAP_FAILED: u32 = 7;
    pub const COUNT: u32 = 8;
    pub const NAMES: [&str; COUNT as usize] = [
        "new_flow",
        "encapsulated",
        "encap_failed",
        "frag_needed_sent",
        "decapsulated",
        "deliver_new_flow",
        "decap_refused",
        "decap_failed",
    ];
}

/// Incremental Internet checksum updates (RFC 1624, eqn. 3) for programs that rewrite packet
/// fields without the kernel's checksum helpers (XDP). Words are taken as they lie in memory:
/// the one's-complement sum does not depend on byte order as long as every word is read alike.
pub mod csum {
    /// `check` after one 16-bit word changed from `old` to `new`.
    #[inline(always)]
    pub fn replace16(check: u16, old: u16, new: u16) -> u16 {
        let sum = u32::from(!check) + u32::from(!old) + u32::from(new);
        !fold(sum)
    }

    /// `check` after a 32-bit field (two words) changed from `old` to `new`.
    #[inline(always)]
    pub fn replace32(check: u16, old: u32, new: u32) -> u16 {
        let sum = u32::from(!check)
            + u32::from(!(old as u16))
            + u32::from(!((old >> 16) as u16))
            + u32::from(new as u16)
            + u32::from((new >> 16) as u16);
        !fold(sum)
    }

    /// A UDP checksum update: 0 means "no checksum" (IPv4) and stays 0; a computed 0 is sent as
    /// 0xffff, its other one's-complement spelling.
    #[inline(always)]
    pub fn udp(check: u16, update: impl FnOnce(u16) -> u16) -> u16 {
        if check == 0 {
            return 0;
        }
        match update(check) {
            0 => 0xffff,
            new => new,
        }
    }

    /// `sum` plus the two words of a 32-bit field (an IPv4 address or a quarter of an IPv6 one).
    #[inline(always)]
    pub fn add32(sum: u32, value: u32) -> u32 {
        sum + (value & 0xffff) + (value >> 16)
    }

    /// The TCP/UDP pseudo-header's sum, folded but not complemented, from the sum of its
    /// addresses (`addr_sum`, see [`add32`]): what a CHECKSUM_PARTIAL packet carries in its
    /// checksum field until the sender's NIC (or the kernel) completes it.
    #[inline(always)]
    pub fn pseudo_header(addr_sum: u32, proto: u8, l4_len: u16) -> u16 {
        fold(addr_sum + u32::from(u16::from_ne_bytes([0, proto])) + u32::from(u16::from_ne_bytes(l4_len.to_be_bytes())))
    }

    #[inline(always)]
    fn fold(sum: u32) -> u16 {
        // Two folds: the first leaves at most 0x1fffe, the second at most 0xffff.
        let sum = (sum & 0xffff) + (sum >> 16);
        ((sum & 0xffff) + (sum >> 16)) as u16
    }
}

#[cfg(feature = "user")]
mod user {
    use super::*;
    // SAFETY: all these types are repr(C), Copy, contain only integers and have no implicit
    // padding (every gap is an explicit `pad` field), so any byte pattern is a valid value.
    unsafe impl aya::Pod for Ipv6Words {}
    unsafe impl aya::Pod for ServiceKeyV4 {}
    unsafe impl aya::Pod for ServiceKeyV6 {}
    unsafe impl aya::Pod for ServiceValue {}
    unsafe impl aya::Pod for BackendSlotKey {}
    unsafe impl aya::Pod for BackendSlotValue {}
    unsafe impl aya::Pod for BackendV4 {}
    unsafe impl aya::Pod for BackendV6 {}
    unsafe impl aya::Pod for CtKeyV4 {}
    unsafe impl aya::Pod for CtKeyV6 {}
    unsafe impl aya::Pod for CtValueV4 {}
    unsafe impl aya::Pod for CtValueV6 {}
    unsafe impl aya::Pod for AffinityKeyV4 {}
    unsafe impl aya::Pod for AffinityKeyV6 {}
    unsafe impl aya::Pod for AffinityValue {}
    unsafe impl aya::Pod for LbConfig {}
    unsafe impl aya::Pod for CtLifetimes {}
    unsafe impl aya::Pod for FragKeyV4 {}
    unsafe impl aya::Pod for FragKeyV6 {}
    unsafe impl aya::Pod for FragPorts {}
    unsafe impl aya::Pod for SourceRangeKeyV4 {}
    unsafe impl aya::Pod for SourceRangeKeyV6 {}
    unsafe impl aya::Pod for OverlayPrefixV4 {}
    unsafe impl aya::Pod for OverlayTunnelV4 {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    // The sizes are part of the user-visible interface (bpftool dumps): pin them.
    #[test]
    fn layouts_have_no_implicit_padding() {
        assert_eq!(size_of::<ServiceKeyV4>(), 8);
        assert_eq!(size_of::<ServiceValue>(), 16);
        assert_eq!(size_of::<BackendSlotKey>(), 8);
        assert_eq!(size_of::<BackendSlotValue>(), 4);
        assert_eq!(size_of::<BackendV4>(), 8);
        assert_eq!(size_of::<CtKeyV4>(), 16);
        assert_eq!(size_of::<CtValueV4>(), 32);
        assert_eq!(size_of::<AffinityKeyV4>(), 8);
        assert_eq!(size_of::<AffinityValue>(), 16);
        assert_eq!(size_of::<LbConfig>(), 32);
        assert_eq!(size_of::<CtLifetimes>(), 16);
        assert_eq!(size_of::<FragKeyV4>(), 16);
        assert_eq!(size_of::<ServiceKeyV6>(), 20);
        assert_eq!(size_of::<BackendV6>(), 20);
        assert_eq!(size_of::<CtKeyV6>(), 40);
        assert_eq!(size_of::<CtValueV6>(), 56);
        assert_eq!(size_of::<AffinityKeyV6>(), 20);
        assert_eq!(size_of::<FragKeyV6>(), 40);
        assert_eq!(size_of::<FragPorts>(), 4);
        assert_eq!(size_of::<OverlayPrefixV4>(), 4);
        assert_eq!(size_of::<OverlayTunnelV4>(), 12);
        assert_eq!(size_of::<ServiceStats>(), 40);
    }

    #[test]
    fn configured_lifetimes_apply_to_answered_flows_and_zero_is_the_default() {
        let entry = |flags| CtValueV4 {
            last_seen_ns: 0,
            nat_src_addr: 0,
            nat_dst_addr: 0,
            nat_src_port: 0,
            nat_dst_port: 0,
            flags,
            pad: 0,
            service_id: 0,
            backend_id: 0,
        };
        let secs = |flags, proto, l: Option<&CtLifetimes>| entry(flags).lifetime_ns(proto, l) / 1_000_000_000;
        let set = CtLifetimes { tcp_secs: 900, closing_secs: 120, udp_secs: 300, pad: 0 };
        let zero = CtLifetimes::default();
        for (l, tcp, closing, udp) in [
            (Some(&set), 900, 120, 300),
            (Some(&zero), CT_LIFETIME_TCP_SECS, CT_LIFETIME_CLOSING_SECS, CT_LIFETIME_NON_TCP_SECS),
            (None, CT_LIFETIME_TCP_SECS, CT_LIFETIME_CLOSING_SECS, CT_LIFETIME_NON_TCP_SECS),
        ] {
            assert_eq!(secs(CT_FLAG_SEEN_REPLY, IPPROTO_TCP, l), tcp);
            assert_eq!(secs(CT_FLAG_SEEN_REPLY | CT_FLAG_CLOSING, IPPROTO_TCP, l), closing);
            assert_eq!(secs(CT_FLAG_SEEN_REPLY, IPPROTO_UDP, l), udp);
            // Not configurable: the unanswered lifetime (issue 26), and protocols other than UDP.
            assert_eq!(secs(0, IPPROTO_TCP, l), CT_LIFETIME_UNREPLIED_SECS);
            assert_eq!(secs(0, IPPROTO_UDP, l), CT_LIFETIME_UNREPLIED_SECS);
            assert_eq!(secs(CT_FLAG_SEEN_REPLY, IPPROTO_ICMP, l), CT_LIFETIME_NON_TCP_SECS);
        }
    }

    /// The full checksum of `words` (RFC 1071), for checking the incremental updates.
    fn full(words: &[u16]) -> u16 {
        let mut sum: u32 = words.iter().map(|&w| u32::from(w)).sum();
        while sum >> 16 != 0 {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        !(sum as u16)
    }

    #[test]
    fn incremental_checksum_matches_a_full_recomputation() {
        let mut words = [0x4500u16, 0x0054, 0x1c46, 0x4000, 0x4006, 0, 0xac10, 0x0a63, 0xac10, 0x0a0c];
        let check = full(&words);
        words[6] = 0xc0a8;
        words[7] = 0x0001;
        // Words 6 and 7 form one 32-bit field: low half first, as a little-endian load reads it.
        let updated = csum::replace32(check, 0x0a63 << 16 | 0xac10, 0x0001 << 16 | 0xc0a8);
        assert_eq!(updated, full(&words));
        let before = full(&words);
        words[9] = 0xffff;
        assert_eq!(csum::replace16(before, 0x0a0c, 0xffff), full(&words));
    }

    #[test]
    fn the_pseudo_header_sum_is_what_a_partial_checksum_holds() {
        // 10.0.0.1 -> 10.0.0.2, TCP, 20 bytes: the pseudo-header's bytes, summed as loaded.
        let (src, dst) = (u32::from_ne_bytes([10, 0, 0, 1]), u32::from_ne_bytes([10, 0, 0, 2]));
        let bytes = [10u8, 0, 0, 1, 10, 0, 0, 2, 0, 6, 0, 20];
        let mut folded: u32 = bytes.chunks(2).map(|c| u32::from(u16::from_ne_bytes([c[0], c[1]]))).sum();
        while folded >> 16 != 0 {
            folded = (folded & 0xffff) + (folded >> 16);
        }
        let sum = csum::add32(csum::add32(0, src), dst);
        assert_eq!(csum::pseudo_header(sum, 6, 20), folded as u16);
    }

    #[test]
    fn udp_checksum_zero_stays_absent_and_a_computed_zero_is_sent_as_ffff() {
        assert_eq!(csum::udp(0, |c| csum::replace16(c, 1, 2)), 0);
        // 0xfffe + (new - old) = 0xffff + 0 ... folds to a sum of 0xffff, whose complement is 0.
        let check = !0xfffeu16;
        assert_eq!(csum::replace16(check, 0, 1), 0);
        assert_eq!(csum::udp(check, |c| csum::replace16(c, 0, 1)), 0xffff);
    }
}
