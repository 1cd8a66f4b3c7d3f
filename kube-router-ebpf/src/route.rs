//! Forwarding a translated packet ourselves. A packet whose new source is a node address would be
//! dropped by the stack as a martian if it entered the input path, so it is routed here: a FIB
//! lookup for its new destination, TTL decremented as a router does, and `bpf_redirect_neigh`
//! out of the chosen interface (the kernel resolves the next hop's MAC).
use aya_ebpf::{
    bindings::{bpf_fib_lookup as FibLookup, bpf_redir_neigh, TC_ACT_SHOT},
    helpers::{bpf_fib_lookup, bpf_redirect_neigh},
    programs::TcContext,
    EbpfContext,
};

use crate::{
    maps::count,
    parsing::{IP_CSUM_OFF, IP_TOT_LEN_OFF, IP_TTL_OFF},
};
use kube_router_common::lb_stat;

const AF_INET: u8 = 2;
const BPF_FIB_LKUP_RET_SUCCESS: i64 = 0;
const BPF_FIB_LKUP_RET_NO_NEIGH: i64 = 7;

/// Routes the (already translated) packet to `dst`; returns the TC verdict.
// Not inlined: the lookup's parameters would crowd the caller's stack.
#[inline(never)]
pub fn redirect(ctx: &TcContext, src: u32, dst: u32, proto: u8) -> i32 {
    match try_redirect(ctx, src, dst, proto) {
        Ok(verdict) => {
            count(lb_stat::REDIRECTED);
            verdict
        }
        Err(_) => {
            count(lb_stat::REDIRECT_FAILED);
            TC_ACT_SHOT
        }
    }
}

#[inline(always)]
fn try_redirect(ctx: &TcContext, src: u32, dst: u32, proto: u8) -> Result<i32, i64> {
    // SAFETY: an all-zero bpf_fib_lookup is a valid request skeleton (plain integers and unions of them).
    let mut params: FibLookup = unsafe { core::mem::zeroed() };
    params.family = AF_INET;
    params.l4_protocol = proto;
    params.__bindgen_anon_1.tot_len = u16::from_be(ctx.load::<u16>(IP_TOT_LEN_OFF)?);
    // SAFETY: reading the skb's ingress interface index from its context.
    params.ifindex = unsafe { (*ctx.skb.skb).ifindex };
    params.__bindgen_anon_3.ipv4_src = src;
    params.__bindgen_anon_4.ipv4_dst = dst;
    // SAFETY: params is a valid bpf_fib_lookup of the size passed.
    let rc = unsafe { bpf_fib_lookup(ctx.as_ptr(), &mut params, core::mem::size_of::<FibLookup>() as i32, 0) };
    if rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_NO_NEIGH {
        return Err(rc);
    }
    let ttl: u8 = ctx.load(IP_TTL_OFF)?;
    if ttl <= 1 {
        return Err(-1);
    }
    // TTL and protocol share a 16-bit checksum word.
    let old_word = u16::from_ne_bytes([ttl, proto]);
    let new_word = u16::from_ne_bytes([ttl - 1, proto]);
    ctx.l3_csum_replace(IP_CSUM_OFF, old_word as u64, new_word as u64, 2)?;
    ctx.store(IP_TTL_OFF, &(ttl - 1), 0)?;
    // The lookup left the next hop (gateway, or the destination itself when on-link) in ipv4_dst.
    let mut next_hop = bpf_redir_neigh { nh_family: AF_INET as u32, __bindgen_anon_1: unsafe { core::mem::zeroed() } };
    // SAFETY: reading the union member the lookup filled for AF_INET.
    next_hop.__bindgen_anon_1.ipv4_nh = unsafe { params.__bindgen_anon_4.ipv4_dst };
    // SAFETY: next_hop is a valid bpf_redir_neigh of the size passed.
    Ok(unsafe { bpf_redirect_neigh(params.ifindex, &mut next_hop, core::mem::size_of::<bpf_redir_neigh>() as i32, 0) }
        as i32)
}
