//! Address/port rewriting with incremental checksum updates: whole packets (and fragments) of
//! a translated flow, ICMP echoes, and the packet quoted inside an ICMP error about one.
//!
//! IPv4 has a header checksum and no pseudo-header in ICMP; IPv6 has no header checksum, and
//! its TCP, UDP and ICMPv6 checksums all cover a pseudo-header with both addresses.
use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    programs::TcContext,
};
use kube_router_common::{Ipv6Words, IPPROTO_TCP, IPPROTO_UDP};

use crate::parsing::{IcmpError, LbFlow, IPV6_DST_OFF, IPV6_SRC_OFF, IP_CSUM_OFF, IP_DST_OFF, IP_SRC_OFF};

/// A packet's addresses and ports, network byte order.
#[derive(Clone, Copy)]
pub struct Tuple<A> {
    pub src: (A, u16),
    pub dst: (A, u16),
}

/// Where the L4 checksum is and the flags its updates need (for an ICMP echo: the ICMP checksum).
#[inline(always)]
fn l4_checksum(flow_proto: u8, l4_off: usize) -> (usize, u64) {
    match flow_proto {
        IPPROTO_TCP => (l4_off + 16, 0),
        // A UDP checksum of 0 means "none" (IPv4): keep it 0 instead of inventing one.
        IPPROTO_UDP => (l4_off + 6, BPF_F_MARK_MANGLED_0 as u64),
        // ICMP(v6) echo.
        _ => (l4_off + 2, 0),
    }
}

#[inline(always)]
fn rewrite_ports<A>(
    ctx: &TcContext,
    flow: &LbFlow<A>,
    to: &Tuple<A>,
    csum_off: usize,
    mangled: u64,
) -> Result<(), i64> {
    if flow.proto != IPPROTO_TCP && flow.proto != IPPROTO_UDP {
        // An echo's identifier stands for both ports; the reply direction carries it too.
        if flow.src_port != to.src.1 {
            ctx.l4_csum_replace(csum_off, flow.src_port as u64, to.src.1 as u64, 2)?;
            ctx.store(flow.l4_off + 4, &to.src.1, 0)?;
        }
        return Ok(());
    }
    for (port_off, old, new) in [(flow.l4_off, flow.src_port, to.src.1), (flow.l4_off + 2, flow.dst_port, to.dst.1)] {
        if old != new {
            ctx.l4_csum_replace(csum_off, old as u64, new as u64, mangled | 2)?;
            ctx.store(port_off, &new, 0)?;
        }
    }
    Ok(())
}

/// Rewrites an IPv4 packet to `to`: the header checksum always, the L4 header and its checksum
/// when this packet carries it (an ICMP checksum covers no addresses). A later fragment only gets
/// its addresses rewritten: the first fragment's checksum covers the whole datagram.
#[inline(always)]
pub fn rewrite_v4(ctx: &TcContext, flow: &LbFlow<u32>, to: &Tuple<u32>) -> Result<(), i64> {
    let (csum_off, mangled) = l4_checksum(flow.proto, flow.l4_off);
    let pseudo = flow.has_l4() && (flow.proto == IPPROTO_TCP || flow.proto == IPPROTO_UDP);
    for (addr_off, old, new) in [(IP_SRC_OFF, flow.src_addr, to.src.0), (IP_DST_OFF, flow.dst_addr, to.dst.0)] {
        if old != new {
            if pseudo {
                ctx.l4_csum_replace(csum_off, old as u64, new as u64, BPF_F_PSEUDO_HDR as u64 | mangled | 4)?;
            }
            ctx.l3_csum_replace(IP_CSUM_OFF, old as u64, new as u64, 4)?;
            ctx.store(addr_off, &new, 0)?;
        }
    }
    if flow.has_l4() {
        rewrite_ports(ctx, flow, to, csum_off, mangled)?;
    }
    Ok(())
}

/// Updates the checksum at `csum_off` for an IPv6 address change, word by word.
#[inline(always)]
fn replace_v6_addr(ctx: &TcContext, csum_off: usize, old: &Ipv6Words, new: &Ipv6Words, flags: u64) -> Result<(), i64> {
    for i in 0..4 {
        if old.0[i] != new.0[i] {
            ctx.l4_csum_replace(csum_off, old.0[i] as u64, new.0[i] as u64, flags | 4)?;
        }
    }
    Ok(())
}

/// Rewrites an IPv6 packet to `to` (TCP, UDP or ICMPv6 echo: all three checksums cover the
/// addresses). A later fragment only gets its addresses rewritten.
#[inline(always)]
pub fn rewrite_v6(ctx: &TcContext, flow: &LbFlow<Ipv6Words>, to: &Tuple<Ipv6Words>) -> Result<(), i64> {
    let (csum_off, mangled) = l4_checksum(flow.proto, flow.l4_off);
    for (addr_off, old, new) in [(IPV6_SRC_OFF, &flow.src_addr, &to.src.0), (IPV6_DST_OFF, &flow.dst_addr, &to.dst.0)] {
        if old != new {
            if flow.has_l4() {
                replace_v6_addr(ctx, csum_off, old, new, BPF_F_PSEUDO_HDR as u64 | mangled)?;
            }
            ctx.store(addr_off, new, 0)?;
        }
    }
    if flow.has_l4() {
        rewrite_ports(ctx, flow, to, csum_off, mangled)?;
    }
    Ok(())
}

#[inline(always)]
fn rewrite_quoted_ports<A>(
    ctx: &TcContext,
    error: &IcmpError<A>,
    quoted: &Tuple<A>,
    icmp_csum_off: usize,
) -> Result<(), i64> {
    for (port_off, old, new) in [
        (error.inner_l4_off, error.inner_src_port, quoted.src.1),
        (error.inner_l4_off + 2, error.inner_dst_port, quoted.dst.1),
    ] {
        if old != new {
            ctx.l4_csum_replace(icmp_csum_off, old as u64, new as u64, 2)?;
            ctx.store(port_off, &new, 0)?;
        }
    }
    Ok(())
}

/// Rewrites the packet quoted in an ICMP error to `quoted` and the error's destination to
/// `outer_dst`: the quoted IPv4 header's checksum, the ICMP checksum (which covers the quote) and
/// the outer IPv4 checksum. The quoted L4 checksum is left as it was (it cannot be recomputed
/// from 8 bytes, and no receiver checks it).
#[inline(always)]
pub fn rewrite_icmp_error_v4(
    ctx: &TcContext,
    error: &IcmpError<u32>,
    quoted: &Tuple<u32>,
    outer_dst: u32,
) -> Result<(), i64> {
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
    rewrite_quoted_ports(ctx, error, quoted, icmp_csum_off)?;
    if outer_dst != error.outer_dst {
        ctx.l3_csum_replace(IP_CSUM_OFF, error.outer_dst as u64, outer_dst as u64, 4)?;
        ctx.store(IP_DST_OFF, &outer_dst, 0)?;
    }
    Ok(())
}

/// The IPv6 twin: no header checksums, but the ICMPv6 checksum covers the outer addresses
/// (pseudo-header) as well as the quote.
#[inline(always)]
pub fn rewrite_icmp_error_v6(
    ctx: &TcContext,
    error: &IcmpError<Ipv6Words>,
    quoted: &Tuple<Ipv6Words>,
    outer_dst: &Ipv6Words,
) -> Result<(), i64> {
    let icmp_csum_off = error.icmp_off + 2;
    for (addr_off, old, new) in [
        (error.inner_ip_off + 8, &error.inner_src_addr, &quoted.src.0),
        (error.inner_ip_off + 24, &error.inner_dst_addr, &quoted.dst.0),
    ] {
        if old != new {
            replace_v6_addr(ctx, icmp_csum_off, old, new, 0)?;
            ctx.store(addr_off, new, 0)?;
        }
    }
    rewrite_quoted_ports(ctx, error, quoted, icmp_csum_off)?;
    if *outer_dst != error.outer_dst {
        replace_v6_addr(ctx, icmp_csum_off, &error.outer_dst, outer_dst, BPF_F_PSEUDO_HDR as u64)?;
        ctx.store(IPV6_DST_OFF, outer_dst, 0)?;
    }
    Ok(())
}
