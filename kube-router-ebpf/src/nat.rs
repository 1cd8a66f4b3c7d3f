//! Address/port rewriting with incremental checksum updates.
use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    programs::TcContext,
};
use kube_router_common::IPPROTO_TCP;

use crate::parsing::{Flow, IP_CSUM_OFF, IP_DST_OFF, IP_SRC_OFF};

pub enum Side {
    Source,
    Destination,
}

/// Rewrites one side of the flow to `new_addr:new_port`, fixing the IPv4 header checksum and
/// the L4 checksum (whose pseudo-header covers the addresses).
#[inline(always)]
pub fn rewrite(ctx: &TcContext, flow: &Flow, side: Side, new_addr: u32, new_port: u16) -> Result<(), i64> {
    let (addr_off, port_off, old_addr, old_port) = match side {
        Side::Source => (IP_SRC_OFF, flow.l4_off, flow.src_addr, flow.src_port),
        Side::Destination => (IP_DST_OFF, flow.l4_off + 2, flow.dst_addr, flow.dst_port),
    };
    let (csum_off, mangled) = if flow.proto == IPPROTO_TCP {
        (flow.l4_off + 16, 0)
    } else {
        // A UDP checksum of 0 means "none": keep it 0 instead of inventing one.
        (flow.l4_off + 6, BPF_F_MARK_MANGLED_0 as u64)
    };
    if old_addr != new_addr {
        ctx.l4_csum_replace(csum_off, old_addr as u64, new_addr as u64, BPF_F_PSEUDO_HDR as u64 | mangled | 4)?;
        ctx.l3_csum_replace(IP_CSUM_OFF, old_addr as u64, new_addr as u64, 4)?;
        ctx.store(addr_off, &new_addr, 0)?;
    }
    if old_port != new_port {
        ctx.l4_csum_replace(csum_off, old_port as u64, new_port as u64, mangled | 2)?;
        ctx.store(port_off, &new_port, 0)?;
    }
    Ok(())
}
