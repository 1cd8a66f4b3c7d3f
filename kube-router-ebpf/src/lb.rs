//! Service frontend lookup and DNAT at TC (backend choice is `backend`'s).
use aya_ebpf::{
    bindings::{TC_ACT_SHOT, TC_ACT_UNSPEC},
    helpers::bpf_ktime_get_ns,
    programs::TcContext,
};
use kube_router_common::*;

use crate::{
    backend::select_backend,
    conntrack,
    maps::{count, SERVICES},
    nat::{rewrite, Side},
    parsing::{parse, Flow, Parsed},
};

/// Ingress: DNAT of packets to service frontends (new flows and conntrack hits).
#[inline(always)]
pub fn handle_ingress(ctx: &TcContext) -> Result<i32, i64> {
    count(lb_stat::PACKETS);
    let flow = match parse(ctx)? {
        Parsed::Flow(flow) => flow,
        Parsed::Fragment => {
            count(lb_stat::FRAGMENT_PASS);
            return Ok(TC_ACT_UNSPEC);
        }
        Parsed::NotIpv4 => {
            count(lb_stat::NOT_IPV4);
            return Ok(TC_ACT_UNSPEC);
        }
        Parsed::OtherProtocol => return Ok(TC_ACT_UNSPEC),
    };
    let now = unsafe { bpf_ktime_get_ns() };

    if let Some(entry) = conntrack::lookup(&flow, now) {
        if entry.flags & CT_FLAG_FORWARD != 0 {
            count(lb_stat::CT_HIT);
            return translate(ctx, &flow, Side::Destination, entry.nat_addr, entry.nat_port);
        }
        // A backend's reply: translated on its way out (egress), after routing.
        return Ok(TC_ACT_UNSPEC);
    }

    let frontend = ServiceKeyV4 { addr: flow.dst_addr, port: flow.dst_port, proto: flow.proto, pad: 0 };
    // SAFETY: read-only copy of a map value.
    let Some(service) = (unsafe { SERVICES.get(frontend) }).copied() else {
        count(lb_stat::NO_SERVICE);
        return Ok(TC_ACT_UNSPEC);
    };
    let Some((backend_id, backend)) = select_backend(flow.src_addr, &service, now) else {
        count(lb_stat::NO_BACKEND_DROP);
        return Ok(TC_ACT_SHOT);
    };
    if conntrack::create(&flow, &backend, service.service_id, backend_id).is_err() {
        // Still forward this packet; the next one retries the insert.
        count(lb_stat::CT_INSERT_FAILED);
    }
    count(lb_stat::NEW_FLOW);
    translate(ctx, &flow, Side::Destination, backend.addr, backend.port)
}

/// Egress: reverse NAT of backend replies, so the client sees the frontend it connected to.
/// Done after routing because the restored source may be a local address (NodePort on the
/// node IP), which the kernel drops as a martian if it arrives on ingress.
#[inline(always)]
pub fn handle_egress(ctx: &TcContext) -> Result<i32, i64> {
    let Parsed::Flow(flow) = parse(ctx)? else {
        return Ok(TC_ACT_UNSPEC);
    };
    let now = unsafe { bpf_ktime_get_ns() };
    match conntrack::lookup(&flow, now) {
        Some(entry) if entry.flags & CT_FLAG_REVERSE != 0 => {
            count(lb_stat::REVERSE_NAT);
            translate(ctx, &flow, Side::Source, entry.nat_addr, entry.nat_port)
        }
        _ => Ok(TC_ACT_UNSPEC),
    }
}

#[inline(always)]
fn translate(ctx: &TcContext, flow: &Flow, side: Side, addr: u32, port: u16) -> Result<i32, i64> {
    if rewrite(ctx, flow, side, addr, port).is_err() {
        count(lb_stat::REWRITE_FAILED);
        return Ok(TC_ACT_SHOT);
    }
    Ok(TC_ACT_UNSPEC)
}
