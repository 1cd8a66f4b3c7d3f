//! Forwarding a translated packet ourselves. A packet whose new source is a node address would be
//! dropped by the stack as a martian if it entered the input path, so it is routed here: a FIB
//! lookup for its new destination, TTL / hop limit decremented as a router does, and
//! `bpf_redirect_neigh` out of the chosen interface (the kernel resolves the next hop's MAC).
//! The route's MTU is checked against what will be on the wire: for a GSO packet (segments the
//! sender's TSO or this node's GRO merged) each segment, as the kernel's own forwarding does; the
//! merged length would be refused and every upload through an SNAT path dropped. A packet that
//! does not fit is not routed: the caller answers it with "fragmentation needed" / "packet too
//! big" (`reject::frag_needed_*`), as the kernel's forwarding would.
use aya_ebpf::{
    bindings::{bpf_fib_lookup as FibLookup, bpf_redir_neigh, TC_ACT_SHOT},
    helpers::{bpf_fib_lookup, bpf_redirect_neigh},
    programs::TcContext,
    EbpfContext,
};
use kube_router_common::{lb_stat, Ipv6Words, IPPROTO_TCP};

use crate::{
    maps::count,
    parsing::{
        ETH_HDR_LEN, IPV6_HDR_LEN, IPV6_HOP_LIMIT_OFF, IPV6_PAYLOAD_LEN_OFF, IP_CSUM_OFF, IP_TOT_LEN_OFF, IP_TTL_OFF,
    },
};

pub(crate) const AF_INET: u8 = 2;
pub(crate) const AF_INET6: u8 = 10;
const BPF_FIB_LKUP_RET_SUCCESS: i64 = 0;
const BPF_FIB_LKUP_RET_NO_NEIGH: i64 = 7;
const BPF_FIB_LKUP_RET_FRAG_NEEDED: i64 = 8;

/// Not a TC verdict: the packet does not fit the route; the low 16 bits are the route's MTU.
/// Above every TC verdict, so it cannot be mistaken for one.
pub const FRAG_NEEDED: i32 = 1 << 24;

/// Routes the (already translated) IPv4 packet to `dst`; returns the TC verdict. `l4_off`: where
/// its TCP or UDP header starts.
// Not inlined: the lookup's parameters would crowd the caller's stack.
#[inline(never)]
pub fn redirect_v4(ctx: &TcContext, src: u32, dst: u32, proto: u8, l4_off: usize) -> i32 {
    // SAFETY: an all-zero bpf_fib_lookup is a valid request skeleton (integers and unions of them).
    let mut params: FibLookup = unsafe { core::mem::zeroed() };
    params.family = AF_INET;
    params.l4_protocol = proto;
    params.__bindgen_anon_3.ipv4_src = src;
    params.__bindgen_anon_4.ipv4_dst = dst;
    let routed = (|| {
        let ip_len = u16::from_be(ctx.load::<u16>(IP_TOT_LEN_OFF)?);
        params.__bindgen_anon_1.tot_len = wire_len(ctx, ip_len, proto, l4_off)?;
        lookup(ctx, &mut params)?;
        let ttl: u8 = ctx.load(IP_TTL_OFF)?;
        if ttl <= 1 {
            return Err(-1);
        }
        // TTL and protocol share a 16-bit checksum word.
        let (old_word, new_word) = (u16::from_ne_bytes([ttl, proto]), u16::from_ne_bytes([ttl - 1, proto]));
        ctx.l3_csum_replace(IP_CSUM_OFF, old_word as u64, new_word as u64, 2)?;
        ctx.store(IP_TTL_OFF, &(ttl - 1), 0)?;
        // The lookup left the next hop (gateway, or the destination itself when on-link) here.
        // SAFETY: reading the union member the lookup filled for AF_INET.
        let next_hop = unsafe { params.__bindgen_anon_4.ipv4_dst };
        let mut neigh: bpf_redir_neigh = unsafe { core::mem::zeroed() };
        neigh.nh_family = AF_INET as u32;
        neigh.__bindgen_anon_1.ipv4_nh = next_hop;
        Ok(send(params.ifindex, &mut neigh))
    })();
    verdict(routed, &params)
}

/// Routes the (already translated) IPv6 packet to `dst`; returns the TC verdict.
#[inline(never)]
pub fn redirect_v6(ctx: &TcContext, src: &Ipv6Words, dst: &Ipv6Words, proto: u8, l4_off: usize) -> i32 {
    // SAFETY: as above.
    let mut params: FibLookup = unsafe { core::mem::zeroed() };
    params.family = AF_INET6;
    params.l4_protocol = proto;
    params.__bindgen_anon_3.ipv6_src = src.0;
    params.__bindgen_anon_4.ipv6_dst = dst.0;
    let routed = (|| {
        let payload = u16::from_be(ctx.load::<u16>(IPV6_PAYLOAD_LEN_OFF)?);
        params.__bindgen_anon_1.tot_len = wire_len(ctx, payload + IPV6_HDR_LEN as u16, proto, l4_off)?;
        lookup(ctx, &mut params)?;
        let hop_limit: u8 = ctx.load(IPV6_HOP_LIMIT_OFF)?;
        if hop_limit <= 1 {
            return Err(-1);
        }
        ctx.store(IPV6_HOP_LIMIT_OFF, &(hop_limit - 1), 0)?;
        // SAFETY: reading the union member the lookup filled for AF_INET6.
        let next_hop = unsafe { params.__bindgen_anon_4.ipv6_dst };
        let mut neigh: bpf_redir_neigh = unsafe { core::mem::zeroed() };
        neigh.nh_family = AF_INET6 as u32;
        neigh.__bindgen_anon_1.ipv6_nh = next_hop;
        Ok(send(params.ifindex, &mut neigh))
    })();
    verdict(routed, &params)
}

/// The IP length of what leaves the node: `ip_len`, or for a GSO packet its segments' (headers
/// up to the end of the TCP or UDP header, plus `gso_size`).
#[inline(always)]
pub(crate) fn wire_len(ctx: &TcContext, ip_len: u16, proto: u8, l4_off: usize) -> Result<u16, i64> {
    // SAFETY: reading the skb's GSO segment size from its context.
    let gso_size = unsafe { (*ctx.skb.skb).gso_size };
    if gso_size == 0 {
        return Ok(ip_len);
    }
    let l4_header = if proto == IPPROTO_TCP {
        // The data offset: the upper 4 bits, in 32-bit words.
        let data_offset: u8 = ctx.load(l4_off + 12)?;
        ((data_offset >> 4) as usize) * 4
    } else {
        8
    };
    let segment = (l4_off - ETH_HDR_LEN + l4_header) as u32 + gso_size;
    Ok(if segment < ip_len as u32 { segment as u16 } else { ip_len })
}

#[inline(always)]
pub(crate) fn lookup(ctx: &TcContext, params: &mut FibLookup) -> Result<(), i64> {
    // SAFETY: reading the skb's ingress interface index from its context.
    params.ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: params is a valid bpf_fib_lookup of the size passed.
    let rc = unsafe { bpf_fib_lookup(ctx.as_ptr(), params, core::mem::size_of::<FibLookup>() as i32, 0) };
    if rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_NO_NEIGH {
        return Err(rc);
    }
    Ok(())
}

#[inline(always)]
pub(crate) fn send(ifindex: u32, neigh: &mut bpf_redir_neigh) -> i32 {
    // SAFETY: neigh is a valid bpf_redir_neigh of the size passed.
    unsafe { bpf_redirect_neigh(ifindex, neigh, core::mem::size_of::<bpf_redir_neigh>() as i32, 0) as i32 }
}

/// The TC verdict, or [`FRAG_NEEDED`] with the MTU the lookup reported (counted by the answer).
#[inline(always)]
pub(crate) fn verdict(routed: Result<i32, i64>, params: &FibLookup) -> i32 {
    match routed {
        Ok(verdict) => {
            count(lb_stat::REDIRECTED);
            verdict
        }
        Err(BPF_FIB_LKUP_RET_FRAG_NEEDED) => {
            // SAFETY: the lookup wrote the route's MTU over tot_len (a union) with this result.
            FRAG_NEEDED | i32::from(unsafe { params.__bindgen_anon_1.mtu_result })
        }
        Err(_) => {
            count(lb_stat::REDIRECT_FAILED);
            TC_ACT_SHOT
        }
    }
}
