//! ICMP errors about translated flows ("fragmentation needed" / "packet too big", "port
//! unreachable", "time exceeded"), translated back so that the host that sent the quoted packet
//! recognises it: path MTU discovery and fast failures work through a Service.
//!
//! The quoted packet is one our NAT produced. The entry of the *opposite* direction, keyed by
//! the quoted tuple reversed (which is how a reply to it would arrive), holds the reverse of what
//! the sender originally sent: so the original is that entry's translation, reversed.
use aya_ebpf::{bindings::TC_ACT_UNSPEC, programs::TcContext};
use kube_router_common::lb_stat;

use crate::{conntrack, family::Family, maps::count, nat::Tuple, parsing::IcmpError};

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    Ingress,
    /// After routing: an error whose destination would change can no longer be sent elsewhere.
    Egress,
}

// Not inlined: rare, and its stack would crowd the hot path's.
#[inline(never)]
pub fn translate<F: Family>(ctx: &TcContext, error: &IcmpError<F::Addr>, hook: Hook) -> i32 {
    try_translate::<F>(ctx, error, hook).unwrap_or(TC_ACT_UNSPEC)
}

#[inline(always)]
fn try_translate<F: Family>(ctx: &TcContext, error: &IcmpError<F::Addr>, hook: Hook) -> Result<i32, i64> {
    let key = conntrack::key(
        (error.inner_dst_addr, error.inner_dst_port),
        (error.inner_src_addr, error.inner_src_port),
        error.inner_proto,
    );
    // SAFETY: read-only copy of a map value.
    let Some(entry) = (unsafe { F::conntrack().get(key) }).copied() else {
        return Ok(TC_ACT_UNSPEC);
    };
    let quoted = Tuple { src: (entry.nat_dst_addr, entry.nat_dst_port), dst: (entry.nat_src_addr, entry.nat_src_port) };
    // The error goes to whoever sent the original packet.
    let outer_dst = quoted.src.0;
    if hook == Hook::Egress && outer_dst != error.outer_dst {
        return Ok(TC_ACT_UNSPEC);
    }
    F::rewrite_icmp_error(ctx, error, &quoted, &outer_dst)?;
    count(lb_stat::ICMP_ERROR_NAT);
    Ok(TC_ACT_UNSPEC)
}
