//! Keys and values of the socket load balancer's maps (`sock_*`), used by the cgroup programs
//! `kr_sk_connect4`, `kr_sk_sendmsg4`, `kr_sk_recvmsg4`, `kr_sk_getpeer4` and their IPv6 twins
//! `kr_sk_connect6`, `kr_sk_sendmsg6`, `kr_sk_recvmsg6`, `kr_sk_getpeer6` (see docs/maps.md).
//!
//! The socket load balancer reads the service maps (`svc_v4`, `svc_slots_v4`, `backends_v4`,
//! `affinity_v4`) like the TC programs; these maps only hold what is particular to sockets.

/// Map names (also their pin file names).
pub mod sock_map_names {
    pub const SOCK_REVERSE: &str = "sock_rev_v4";
    pub const SOCK_REVERSE_V6: &str = "sock_rev_v6";
    pub const SOCK_CONFIG: &str = "sock_cfg";
    pub const SOCK_STATS: &str = "sock_stats";
    pub const SOCK_EXEMPT: &str = "sock_exempt";
}

pub const SOCK_REVERSE_MAX_ENTRIES: u32 = 262_144;
pub const SOCK_CONFIG_MAX_ENTRIES: u32 = 1;

/// `sock_exempt`: key the cgroup v2 id of a cgroup whose processes' sockets are never translated
/// (the agent's own), value `u64` per CPU how many calls to a frontend it made, left untranslated. A map
/// of its own so that `sock_cfg` and `sock_stats` keep their layout.
pub const SOCK_EXEMPT_MAX_ENTRIES: u32 = 8;

/// Index of the one [`SockLbConfig`] in `sock_cfg`.
pub const SOCK_CONFIG_INDEX: u32 = 0;

/// `sock_rev_v4` key: a socket (its cookie, unique for the life of the kernel) and the backend it
/// was sent to. The backend is part of the key because an unconnected UDP socket may talk to
/// several backends of one service, and to several services.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SockReverseKeyV4 {
    pub socket_cookie: u64,
    /// Network byte order.
    pub backend_addr: u32,
    /// Network byte order.
    pub backend_port: u16,
    pub pad: u16,
}

/// `sock_rev_v4` value: the address the application asked for (a frontend, or a loopback
/// address for a NodePort), shown again by `recvmsg` and `getpeername`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SockReverseValueV4 {
    /// Network byte order.
    pub frontend_addr: u32,
    /// Network byte order.
    pub frontend_port: u16,
    pub pad: u16,
}

/// `sock_rev_v6` key: as [`SockReverseKeyV4`], for an IPv6 backend.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SockReverseKeyV6 {
    pub socket_cookie: u64,
    /// Network byte order.
    pub backend_addr: crate::Ipv6Words,
    /// Network byte order.
    pub backend_port: u16,
    pub pad: u16,
    pub pad2: u32,
}

/// `sock_rev_v6` value: as [`SockReverseValueV4`], for an IPv6 frontend.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SockReverseValueV6 {
    /// Network byte order.
    pub frontend_addr: crate::Ipv6Words,
    /// Network byte order.
    pub frontend_port: u16,
    pub pad: u16,
}

/// `sock_cfg[0]`, written by the agent.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockLbConfig {
    /// Cookie of the node's (the agent's) network namespace: only sockets there reach a NodePort
    /// through a loopback address. 0 = unknown: loopback is never load-balanced.
    pub host_netns_cookie: u64,
}

/// Indices of the per-CPU `sock_stats` array (u64 counters).
pub mod sock_stat {
    /// TCP or UDP `connect()` seen.
    pub const CONNECT: u32 = 0;
    /// UDP `sendmsg()` with a destination address seen.
    pub const SENDMSG: u32 = 1;
    /// Destination rewritten from a frontend to a backend.
    pub const TRANSLATED: u32 = 2;
    /// Frontend without endpoints: the call failed with ECONNREFUSED.
    pub const NO_BACKEND_REFUSED: u32 = 3;
    /// `recvmsg()` / `getpeername()` shown the frontend instead of the backend.
    pub const REVERSE_RESTORED: u32 = 4;
    /// `sock_rev_v4` insert failed: the call still goes to the backend, but the application
    /// will see the backend's address.
    pub const REVERSE_INSERT_FAILED: u32 = 5;
    /// A loopback destination matched a NodePort (wildcard frontend) in the node's namespace.
    pub const LOOPBACK_NODEPORT: u32 = 6;
    pub const COUNT: u32 = 7;
    /// Metric label of each index, in index order.
    pub const NAMES: [&str; COUNT as usize] = [
        "connect",
        "sendmsg",
        "translated",
        "no_backend_refused",
        "reverse_restored",
        "reverse_insert_failed",
        "loopback_nodeport",
    ];
}

#[cfg(feature = "user")]
mod user {
    use super::*;
    // SAFETY: repr(C), Copy, integers only, every gap an explicit `pad` field.
    unsafe impl aya::Pod for SockReverseKeyV4 {}
    unsafe impl aya::Pod for SockReverseValueV4 {}
    unsafe impl aya::Pod for SockReverseKeyV6 {}
    unsafe impl aya::Pod for SockReverseValueV6 {}
    unsafe impl aya::Pod for SockLbConfig {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    #[test]
    fn layouts_have_no_implicit_padding() {
        assert_eq!(size_of::<SockReverseKeyV4>(), 16);
        assert_eq!(size_of::<SockReverseValueV4>(), 8);
        assert_eq!(size_of::<SockReverseKeyV6>(), 32);
        assert_eq!(size_of::<SockReverseValueV6>(), 20);
        assert_eq!(size_of::<SockLbConfig>(), 8);
    }
}
