//! `kube-router monitor`: events the datapath writes into a ring buffer while a monitor runs.

pub mod monitor_map_names {
    pub const EVENTS: &str = "events";
    pub const EVENTS_CONFIG: &str = "events_cfg";
    pub const EVENTS_BUCKET: &str = "events_bucket";
    pub const EVENTS_STATS: &str = "events_stats";
}

/// Ring buffer size in bytes (a power of two, a multiple of the page size).
pub const EVENTS_RING_BYTES: u32 = 256 * 1024;

/// A NetworkPolicy drop.
pub const EVENT_POLICY_DROP: u8 = 1;
/// A new Service flow: client → frontend translated to a backend.
pub const EVENT_SERVICE_NAT: u8 = 2;
/// A frame a pod veth's policy program dropped unjudged: `proto` is the reason
/// (`FRAME_DROP_*`), `src_port` the ethertype (network byte order), no addresses.
pub const EVENT_POLICY_FRAME_DROP: u8 = 3;
pub const FRAME_DROP_UNKNOWN_L3: u8 = 1;
pub const FRAME_DROP_VLAN: u8 = 2;
pub const FRAME_DROP_MALFORMED: u8 = 3;

/// `events_stats` slots (per CPU).
pub mod event_stat {
    pub const EMITTED: u32 = 0;
    /// Over the rate limit: not written.
    pub const RATE_LIMITED: u32 = 1;
    /// The ring buffer was full (the monitor reads too slowly).
    pub const LOST: u32 = 2;
    pub const COUNT: u32 = 3;
    pub const NAMES: [&str; COUNT as usize] = ["emitted", "rate_limited", "lost"];
}

/// `events_cfg[0]`: events are written while `bpf_ktime_get_ns() < enabled_until_ns`. The
/// monitor extends it every half second, so a monitor that dies turns events off by itself.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MonitorConfig {
    pub enabled_until_ns: u64,
    /// Events per second per CPU (token bucket, burst of the same size).
    pub rate_per_cpu: u64,
}

/// `events_bucket[0]` (per CPU).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TokenBucket {
    /// Tokens × 1e9 (nanosecond resolution without division in the datapath's hot path).
    pub scaled_tokens: u64,
    pub last_ns: u64,
}

/// One event (72 bytes). Addresses in packet byte order: IPv4 in word 0, IPv6 in all four.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MonitorEvent {
    pub timestamp_ns: u64,
    pub kind: u8,
    /// 4 or 6.
    pub family: u8,
    pub proto: u8,
    /// Policy drops: POLICY_DIR_INGRESS / POLICY_DIR_EGRESS (of the pod). NAT: 0.
    pub direction: u8,
    pub ifindex: u32,
    pub src: [u32; 4],
    pub dst: [u32; 4],
    /// NAT: the backend chosen.
    pub nat: [u32; 4],
    /// Network byte order.
    pub src_port: u16,
    pub dst_port: u16,
    pub nat_port: u16,
    pub pad: u16,
}

/// Addresses as the event's four words.
pub trait EventAddr {
    fn event_words(&self) -> [u32; 4];
}

impl EventAddr for u32 {
    #[inline(always)]
    fn event_words(&self) -> [u32; 4] {
        [*self, 0, 0, 0]
    }
}

impl EventAddr for crate::Ipv6Words {
    #[inline(always)]
    fn event_words(&self) -> [u32; 4] {
        self.0
    }
}

#[cfg(feature = "user")]
mod user {
    // SAFETY (all): repr(C), integers only, no implicit padding.
    unsafe impl aya::Pod for super::MonitorConfig {}
    unsafe impl aya::Pod for super::TokenBucket {}
    unsafe impl aya::Pod for super::MonitorEvent {}
}
