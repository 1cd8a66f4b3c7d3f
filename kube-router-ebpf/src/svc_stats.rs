//! Per-frontend Service counters (`svc_stats_v4` / `svc_stats_v6`), kube-router's IPVS service
//! statistics: connections, packets and bytes in (client to Service) and out (replies).
use aya_ebpf::{
    bindings::BPF_NOEXIST,
    macros::map,
    maps::{Array, PerCpuHashMap},
};
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

/// A zeroed value a new frontend's counters start from, in map memory (the callers' stacks are
/// full). Never written.
#[map(name = "svc_stats_zero")]
static ZERO: Array<ServiceStats> = Array::with_max_entries(1, 0);

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

/// Counts one packet of the frontend `(addr, port, proto)`. A frontend's counters are created
/// here, by its first packet: created by the agent with the frontend, each cost a per-CPU
/// allocation of ~20 µs in the `bpf()` call (20,000 frontends: 0.4 s of programming 10,000
/// Services). The agent removes them with the frontend (and before a new one takes its key); a
/// frontend that is no longer programmed gets none again.
#[inline(always)]
pub fn count<F: Family, C: Packet>(ctx: &C, addr: F::Addr, port: u16, proto: u8, way: Way) {
    let key = ServiceKey { addr, port, proto, pad: 0 };
    let stats = match F::svc_stats().get_ptr_mut(key) {
        Some(stats) => stats,
        None => {
            let Some(zero) = ZERO.get(0) else {
                return;
            };
            // SAFETY: read-only lookup of a map value within this run.
            if unsafe { F::services().get(key) }.is_none() {
                return;
            }
            // NOEXIST: another CPU may have created it meanwhile; its counts stay.
            let _ = F::svc_stats().insert(key, zero, BPF_NOEXIST as u64);
            let Some(stats) = F::svc_stats().get_ptr_mut(key) else {
                return;
            };
            stats
        }
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
