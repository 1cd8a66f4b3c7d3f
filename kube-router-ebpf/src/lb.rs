//! Service frontend lookup, backend selection and session affinity.
use aya_ebpf::{
    bindings::{TC_ACT_SHOT, TC_ACT_UNSPEC},
    helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns},
    programs::TcContext,
};
use kube_router_common::*;

use crate::{
    conntrack,
    maps::{count, AFFINITY, BACKENDS, BACKEND_SLOTS, SERVICES},
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
    let Some((backend_id, backend)) = select_backend(&flow, &service, now) else {
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

#[inline(always)]
fn backend_in_slot(service_id: u32, slot: u32) -> Option<(u32, BackendV4)> {
    let key = BackendSlotKey { service_id, slot };
    // SAFETY: read-only copies of map values.
    let backend_id = unsafe { BACKEND_SLOTS.get(key) }?.backend_id;
    let backend = unsafe { BACKENDS.get(backend_id) }?;
    Some((backend_id, *backend))
}

#[inline(always)]
fn select_backend(flow: &Flow, service: &ServiceValue, now: u64) -> Option<(u32, BackendV4)> {
    if service.backend_count == 0 {
        return None;
    }
    let affinity = service.flags & SVC_FLAG_AFFINITY != 0;
    let affinity_key = AffinityKeyV4 { client_addr: flow.src_addr, service_id: service.service_id };
    if affinity {
        if let Some(chosen) = affine_backend(&affinity_key, service, now) {
            count(lb_stat::AFFINITY_HIT);
            return Some(chosen);
        }
    }
    let slot = unsafe { bpf_get_prandom_u32() } % service.backend_count;
    let chosen = backend_in_slot(service.service_id, slot)?;
    if affinity {
        let value = AffinityValue { last_used_ns: now, backend_id: chosen.0, slot };
        let _ = AFFINITY.insert(affinity_key, value, 0);
    }
    Some(chosen)
}

/// The backend this client used last, if that was within the affinity timeout and the backend
/// still holds the same slot of this service (so a removed backend is never chosen again).
#[inline(always)]
fn affine_backend(key: &AffinityKeyV4, service: &ServiceValue, now: u64) -> Option<(u32, BackendV4)> {
    let entry = AFFINITY.get_ptr_mut(key)?;
    // SAFETY: pointer from a successful lookup, valid for this run.
    let entry = unsafe { &mut *entry };
    let timeout_ns = service.affinity_timeout_secs as u64 * 1_000_000_000;
    if now.saturating_sub(entry.last_used_ns) > timeout_ns {
        return None;
    }
    let (backend_id, backend) = backend_in_slot(service.service_id, entry.slot)?;
    if backend_id != entry.backend_id {
        return None;
    }
    entry.last_used_ns = now;
    Some((backend_id, backend))
}
