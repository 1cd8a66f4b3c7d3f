//! Per-frontend Service counters (`svc_stats_v4` / `svc_stats_v6`), kube-router's IPVS service
//! statistics: connections, packets and bytes in (client to Service) and out (replies).
use aya_ebpf::{macros::map, maps::PerCpuHashMap};
use kube_router_common::*;

use crate::{family::Family, packet::Packet, parsing::ETH_HDR_LEN};

/// Memory only for the frontends that exist (a preallocated per-CPU map would cost
/// 65,536 × 40 B on every CPU).
const BPF_F_NO_PREALLOC: u32 = 1;

#[map(name = "svc_stats_v4")]
pub static SVC_STATS: PerCpuHashMap<ServiceKeyV4, ServiceStats> =
    PerCpuHashMap::pinned(SVC_STATS_MAX_ENTRIES, BPF_F_NO_PREALLOC);

#[map(name = "svc_stats_v6")]
pub static SVC_STATS_V6: PerCpuHashMap<ServiceKeyV6, ServiceStats> =
    PerCpuHashMap::pinned(SVC_STATS_MAX_ENTRIES, BPF_F_NO_PREALLOC);

/// Which way a packet of a Service flow goes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Way {
    /// The first packet of a new flow (a connection), client to Service.
    New,
    /// Client to Service.
    In,
    /// A new flow recorded by one hook whose first packet another hook translates: only the
    /// connection is counted here (the packet where it is translated).
    Opened,
    /// Backend to client (a reply).
    Out,
}

/// Counts one packet of the frontend `(addr, port, proto)`. Frontends without an entry (the
/// agent has not created it yet) are not counted.
#[inline(always)]
pub fn count<F: Family, C: Packet>(ctx: &C, addr: F::Addr, port: u16, proto: u8, way: Way) {
    let key = ServiceKey { addr, port, proto, pad: 0 };
    let Some(stats) = F::svc_stats().get_ptr_mut(key) else {
        return;
    };
    // IP bytes, as IPVS counts them (TC and XDP see the Ethernet header too).
    let bytes = (ctx.len() as u64).saturating_sub(ETH_HDR_LEN as u64);
    // SAFETY: this CPU's copy of a map value, valid for this run; no other CPU writes it.
    let stats = unsafe { &mut *stats };
    match way {
        Way::Out => {
            stats.packets_out += 1;
            stats.bytes_out += bytes;
        }
        Way::Opened => stats.connections += 1,
        Way::New | Way::In => {
            stats.connections += u64::from(way == Way::New);
            stats.packets_in += 1;
            stats.bytes_in += bytes;
        }
    }
}
