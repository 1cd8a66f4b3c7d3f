//! Address/port rewriting with incremental checksum updates: whole packets (and fragments) of
//! a translated flow, and the packet quoted inside an ICMP error about one.
use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    programs::TcContext,
};
use kube_router_common::{IPPROTO_ICMP, IPPROTO_TCP};

use crate::parsing::{IcmpError, LbFlow, IP_CSUM_OFF, IP_DST_OFF, IP_SRC_OFF};

/// A packet's addresses and ports, network byte order.
#[derive(Clone, Copy)]
pub struct Tuple {
    pub src: (u32, u16),
    pub dst: (u32, u16),
}

/// Rewrites the packet to `to`: the IPv4 header checksum always, the L4 header and its checksum
/// (whose pseudo-header covers the addresses) when this packet carries it. A later fragment only
/// gets its addresses rewritten: the first fragment's checksum covers the whole datagram.
#[inline(always)]
pub fn rewrite(ctx: &TcContext, flow: &LbFlow, to: &Tuple) -> Result<(), i64> {
    if flow.proto == IPPROTO_ICMP {
        return rewrite_echo(ctx, flow, to);
    }
    let l4 = flow.has_l4();
    let (csum_off, mangled) = if flow.proto == IPPROTO_TCP {
        (flow.l4_off + 16, 0)
    } else {
        // A UDP checksum of 0 means "none": keep it 0 instead of inventing one.
        (flow.l4_off + 6, BPF_F_MARK_MANGLED_0 as u64)
    };
    for (addr_off, old, new) in [(IP_SRC_OFF, flow.src_addr, to.src.0), (IP_DST_OFF, flow.dst_addr, to.dst.0)] {
        if old != new {
            if l4 {
                ctx.l4_csum_replace(csum_off, old as u64, new as u64, BPF_F_PSEUDO_HDR as u64 | mangled | 4)?;
            }
            ctx.l3_csum_replace(IP_CSUM_OFF, old as u64, new as u64, 4)?;
            ctx.store(addr_off, &new, 0)?;
        }
    }
    if l4 {
        for (port_off, old, new) in [(flow.l4_off, flow.src_port, to.src.1), (flow.l4_off + 2, flow.dst_port, to.dst.1)]
        {
            if old != new {
                ctx.l4_csum_replace(csum_off, old as u64, new as u64, mangled | 2)?;
                ctx.store(port_off, &new, 0)?;
            }
        }
    }
    Ok(())
}

/// An ICMP echo: the addresses (no pseudo-header in the ICMP checksum) and the identifier, which
/// stands for both ports.
#[inline(always)]
fn rewrite_echo(ctx: &TcContext, flow: &LbFlow, to: &Tuple) -> Result<(), i64> {
    for (addr_off, old, new) in [(IP_SRC_OFF, flow.src_addr, to.src.0), (IP_DST_OFF, flow.dst_addr, to.dst.0)] {
        if old != new {
            ctx.l3_csum_replace(IP_CSUM_OFF, old as u64, new as u64, 4)?;
            ctx.store(addr_off, &new, 0)?;
        }
    }
    if flow.src_port != to.src.1 {
        ctx.l4_csum_replace(flow.l4_off + 2, flow.src_port as u64, to.src.1 as u64, 2)?;
        ctx.store(flow.l4_off + 4, &to.src.1, 0)?;
    }
    Ok(())
}

/// Rewrites the packet quoted in an ICMP error to `quoted` and the error's destination to
/// `outer_dst`: the quoted IPv4 header's checksum, the ICMP checksum (which covers the quote) and
/// the outer IPv4 checksum. The quoted L4 checksum is left as it was (it cannot be recomputed
/// from 8 bytes, and no receiver checks it).
#[inline(always)]
pub fn rewrite_icmp_error(ctx: &TcContext, error: &IcmpError, quoted: &Tuple, outer_dst: u32) -> Result<(), i64> {
    let icmp_csum_off = error.icmp_off + 2;
    let inner_csum_off = error.inner_ip_off + 10;
    let old_inner_csum: u16 = ctx.load(inner_csum_off)?;
    for (addr_off, old, new) in [
        (error.inner_ip_off + 12, error.inner_src_addr, quoted.src.0),
        (error.inner_ip_off + 16, error.inner_dst_addr, quoted.dst.0),
    ] {
        if old != new {
            ctx.l3_csum_replace(inner_csum_off, old as u64, new as u64, 4)?;
            ctx.l4_csum_replace(icmp_csum_off, old as u64, new as u64, 4)?;
            ctx.store(addr_off, &new, 0)?;
        }
    }
    let new_inner_csum: u16 = ctx.load(inner_csum_off)?;
    if new_inner_csum != old_inner_csum {
        ctx.l4_csum_replace(icmp_csum_off, old_inner_csum as u64, new_inner_csum as u64, 2)?;
    }
    for (port_off, old, new) in [
        (error.inner_l4_off, error.inner_src_port, quoted.src.1),
        (error.inner_l4_off + 2, error.inner_dst_port, quoted.dst.1),
    ] {
        if old != new {
            ctx.l4_csum_replace(icmp_csum_off, old as u64, new as u64, 2)?;
            ctx.store(port_off, &new, 0)?;
        }
    }
    if outer_dst != error.outer_dst {
        ctx.l3_csum_replace(IP_CSUM_OFF, error.outer_dst as u64, outer_dst as u64, 4)?;
        ctx.store(IP_DST_OFF, &outer_dst, 0)?;
    }
    Ok(())
}
