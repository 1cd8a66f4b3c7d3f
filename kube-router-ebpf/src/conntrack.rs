//! Connection tracking: a forward and a reverse entry per load-balanced flow in `ct_v4`.
use aya_ebpf::helpers::bpf_ktime_get_ns;
use kube_router_common::*;

use crate::{
    maps::CONNTRACK,
    parsing::{Flow, TCP_FLAG_FIN, TCP_FLAG_RST},
};

const REFRESH_INTERVAL_NS: u64 = 1_000_000_000;

pub fn key_of(flow: &Flow) -> CtKeyV4 {
    CtKeyV4 {
        src_addr: flow.src_addr,
        dst_addr: flow.dst_addr,
        src_port: flow.src_port,
        dst_port: flow.dst_port,
        proto: flow.proto,
        pad: [0; 3],
    }
}

/// A live entry for this packet's 5-tuple, refreshed; `None` if absent or expired.
#[inline(always)]
pub fn lookup(flow: &Flow, now: u64) -> Option<CtValueV4> {
    let entry = CONNTRACK.get_ptr_mut(key_of(flow))?;
    // SAFETY: the pointer comes from a successful map lookup and stays valid for this program run.
    let entry = unsafe { &mut *entry };
    if now.saturating_sub(entry.last_seen_ns) > entry.lifetime_ns(flow.proto) {
        return None;
    }
    if flow.tcp_flags & (TCP_FLAG_FIN | TCP_FLAG_RST) != 0 {
        entry.flags |= CT_FLAG_CLOSING;
    }
    // Refresh at most once a second so a busy flow does not write the shared entry per packet.
    if now.saturating_sub(entry.last_seen_ns) > REFRESH_INTERVAL_NS {
        entry.last_seen_ns = now;
    }
    Some(*entry)
}

/// Records a new flow `client -> frontend` that was sent to `backend`.
#[inline(always)]
pub fn create(flow: &Flow, backend: &BackendV4, service_id: u32, backend_id: u32) -> Result<(), i64> {
    let now = unsafe { bpf_ktime_get_ns() };
    let forward = CtValueV4 {
        last_seen_ns: now,
        nat_addr: backend.addr,
        nat_port: backend.port,
        flags: CT_FLAG_FORWARD,
        pad: 0,
        service_id,
        backend_id,
    };
    let reverse_key = CtKeyV4 {
        src_addr: backend.addr,
        dst_addr: flow.src_addr,
        src_port: backend.port,
        dst_port: flow.src_port,
        proto: flow.proto,
        pad: [0; 3],
    };
    let reverse = CtValueV4 { nat_addr: flow.dst_addr, nat_port: flow.dst_port, flags: CT_FLAG_REVERSE, ..forward };
    // Reverse first: once the forward entry exists, replies must already be translatable.
    CONNTRACK.insert(reverse_key, reverse, 0).map_err(|e| e as i64)?;
    CONNTRACK.insert(key_of(flow), forward, 0).map_err(|e| e as i64)
}
