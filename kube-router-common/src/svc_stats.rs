//! Per-Service datapath counters (`svc_stats_v4` / `svc_stats_v6`): what kube-router reads from
//! IPVS per virtual service, counted by the TC load balancer per frontend.

/// Map names (also their pin file names).
pub mod svc_stats_map_names {
    pub const SVC_STATS: &str = "svc_stats_v4";
    pub const SVC_STATS_V6: &str = "svc_stats_v6";
}

/// One entry per programmed frontend, so as many as `svc_v4` / `svc_v6` can hold.
pub const SVC_STATS_MAX_ENTRIES: u32 = crate::SERVICES_MAX_ENTRIES;

/// `svc_stats_*` value (per CPU), keyed by the frontend's `ServiceKey`. The agent creates a
/// zeroed entry when it programs a frontend (or gives one to another backend set) and removes it
/// with the frontend; the datapath only adds to entries that exist.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceStats {
    /// New flows: both conntrack entries written.
    pub connections: u64,
    /// Client to Service (before DNAT), packets and IP bytes.
    pub packets_in: u64,
    pub bytes_in: u64,
    /// Replies (reverse NAT), packets and IP bytes.
    pub packets_out: u64,
    pub bytes_out: u64,
}

impl ServiceStats {
    /// Adds another CPU's counters.
    pub fn add(&mut self, other: &Self) {
        self.connections = self.connections.wrapping_add(other.connections);
        self.packets_in = self.packets_in.wrapping_add(other.packets_in);
        self.bytes_in = self.bytes_in.wrapping_add(other.bytes_in);
        self.packets_out = self.packets_out.wrapping_add(other.packets_out);
        self.bytes_out = self.bytes_out.wrapping_add(other.bytes_out);
    }
}

#[cfg(feature = "user")]
// SAFETY: repr(C), Copy, five u64s: no padding, any byte pattern is valid.
unsafe impl aya::Pod for ServiceStats {}
