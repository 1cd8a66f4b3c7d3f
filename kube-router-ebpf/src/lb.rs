//! Service load-balancing at TC: frontend lookup, DNAT (and SNAT where the reply would not come
//! back otherwise) of new flows, translation of known ones in both directions.
//!
//! Ingress DNATs packets to service frontends and translates replies of source-NATed flows;
//! egress reverse-NATs replies of the others after routing (their restored source may be a node
//! address, which the stack drops as a martian on ingress). A source-NATed packet whose new source
//! is a node address is routed by the program itself (`route`).
use aya_ebpf::{
    bindings::{TC_ACT_SHOT, TC_ACT_UNSPEC},
    helpers::bpf_ktime_get_ns,
    maps::lpm_trie::Key,
    programs::TcContext,
};
use kube_router_common::*;

use crate::{
    backend::select_backend,
    conntrack::{self, NewFlow, SnatError},
    frag,
    icmp::{self, Hook},
    maps::{count, BACKENDS, CLUSTER_NETS, LB_CONFIG, SERVICES},
    nat::{rewrite, Tuple},
    parsing::{parse_lb, Fragment, LbFlow, LbPacket},
    reject, route,
};

/// The packet as our parser sees it, ready for translation (ports resolved for fragments).
#[inline(always)]
fn flow_of(ctx: &TcContext, hook: Hook) -> Result<Result<LbFlow, i32>, i64> {
    let mut flow = match parse_lb(ctx)? {
        LbPacket::Flow(flow) => flow,
        LbPacket::IcmpError(error) => return Ok(Err(icmp::translate(ctx, &error, hook))),
        LbPacket::NotIpv4 => {
            if hook == Hook::Ingress {
                count(lb_stat::NOT_IPV4);
            }
            return Ok(Err(TC_ACT_UNSPEC));
        }
        LbPacket::Other => return Ok(Err(TC_ACT_UNSPEC)),
    };
    if !frag::resolve_ports(&mut flow) {
        return Ok(Err(TC_ACT_UNSPEC));
    }
    Ok(Ok(flow))
}

/// Ingress: DNAT of packets to service frontends (new flows and conntrack hits), and the replies
/// of source-NATed flows.
#[inline(always)]
pub fn handle_ingress(ctx: &TcContext) -> Result<i32, i64> {
    count(lb_stat::PACKETS);
    let flow = match flow_of(ctx, Hook::Ingress)? {
        Ok(flow) => flow,
        Err(verdict) => return Ok(verdict),
    };
    let now = unsafe { bpf_ktime_get_ns() };
    let key = conntrack::key_of(&flow);
    if let Some(entry) = conntrack::lookup(&key, flow.tcp_flags, now) {
        if entry.flags & CT_FLAG_EGRESS != 0 {
            // A masqueraded pod flow: translated as it leaves the node.
            return Ok(TC_ACT_UNSPEC);
        }
        if entry.flags & CT_FLAG_FORWARD != 0 {
            if !(flow.has_l4() && backend_gone(entry) && may_move(entry, flow.proto)) {
                count(if flow.fragment == Fragment::Later { lb_stat::FRAGMENT_NAT } else { lb_stat::CT_HIT });
                return translate(ctx, &flow, entry);
            }
            // Its backend is gone and nothing was answered yet: balance it again.
            count(lb_stat::CT_RESELECTED);
            conntrack::forget(&key, entry);
        } else if entry.flags & CT_FLAG_FULL_NAT != 0 {
            count(if entry.service_id == 0 { lb_stat::EGRESS_MASQUERADE } else { lb_stat::REVERSE_NAT });
            conntrack::mark_seen_reply(entry, flow.proto);
            return translate(ctx, &flow, entry);
        } else {
            // A backend's reply: translated on its way out (egress), after routing.
            return Ok(TC_ACT_UNSPEC);
        }
    }
    if !flow.has_l4() || flow.proto == IPPROTO_ICMP {
        return Ok(TC_ACT_UNSPEC);
    }

    let frontend = ServiceKeyV4 { addr: flow.dst_addr, port: flow.dst_port, proto: flow.proto, pad: 0 };
    // SAFETY: read-only copy of a map value.
    let Some(service) = (unsafe { SERVICES.get(frontend) }).copied() else {
        count(lb_stat::NO_SERVICE);
        return Ok(TC_ACT_UNSPEC);
    };
    let Some(chosen) = select_backend(flow.src_addr, &service, now) else {
        count(lb_stat::NO_BACKEND_DROP);
        return Ok(reject::refuse(ctx, &flow));
    };
    let mut to = Tuple { src: (0, 0), dst: (0, 0) };
    match new_flow(&flow, &service, &chosen, now, &mut to) {
        NewFlowVerdict::DROP => Ok(TC_ACT_SHOT),
        verdict => apply(ctx, &flow, &to, verdict == NewFlowVerdict::ROUTE),
    }
}

/// What to do with a new flow's first packet (an integer: it crosses a BPF function call).
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(transparent)]
struct NewFlowVerdict(i32);

impl NewFlowVerdict {
    const TRANSLATE: Self = Self(0);
    /// Translate, then route it ourselves (its new source is a node address).
    const ROUTE: Self = Self(1);
    const DROP: Self = Self(2);
}

/// Egress: reverse NAT of backend replies, so the client sees the frontend it connected to; pod
/// traffic leaving the cluster masqueraded to the node address.
#[inline(always)]
pub fn handle_egress(ctx: &TcContext) -> Result<i32, i64> {
    let flow = match flow_of(ctx, Hook::Egress)? {
        Ok(flow) => flow,
        Err(verdict) => return Ok(verdict),
    };
    let now = unsafe { bpf_ktime_get_ns() };
    match conntrack::lookup(&conntrack::key_of(&flow), flow.tcp_flags, now) {
        Some(entry) if entry.flags & (CT_FLAG_REVERSE | CT_FLAG_FULL_NAT) == CT_FLAG_REVERSE => {
            count(if flow.fragment == Fragment::Later { lb_stat::FRAGMENT_NAT } else { lb_stat::REVERSE_NAT });
            conntrack::mark_seen_reply(entry, flow.proto);
            translate(ctx, &flow, entry)
        }
        Some(entry) if entry.flags & CT_FLAG_EGRESS != 0 => {
            count(lb_stat::EGRESS_MASQUERADE);
            translate(ctx, &flow, entry)
        }
        Some(_) => Ok(TC_ACT_UNSPEC),
        None if flow.has_l4() => Ok(masquerade(ctx, &flow, now)),
        None => Ok(TC_ACT_UNSPEC),
    }
}

#[inline(always)]
fn cluster_net(addr: u32) -> u32 {
    CLUSTER_NETS.get(Key::new(32, addr)).copied().unwrap_or(0)
}

/// A pod's packet to an address outside the cluster (no pod CIDR, node or service address)
/// leaves with the node's address, as kube-router's pod egress masquerade does.
// Not inlined: keeps its stack out of the egress hot path's.
#[inline(never)]
fn masquerade(ctx: &TcContext, flow: &LbFlow, now: u64) -> i32 {
    let config = LB_CONFIG.get(0).copied().unwrap_or_default();
    if config.flags & LB_CONFIG_POD_EGRESS == 0
        || config.snat_addr == 0
        || cluster_net(flow.src_addr) & CLUSTER_NET_POD == 0
        || cluster_net(flow.dst_addr) != 0
    {
        return TC_ACT_UNSPEC;
    }
    let mut new = NewFlow {
        nat_src: (config.snat_addr, 0),
        nat_dst: (flow.dst_addr, flow.dst_port),
        forward_flags: CT_FLAG_FULL_NAT | CT_FLAG_EGRESS,
        reverse_flags: CT_FLAG_FULL_NAT,
        service_id: 0,
        backend_id: 0,
    };
    match conntrack::create_snat(flow, &mut new, (config.snat_port_min, config.snat_port_max), now) {
        Ok(()) => count(lb_stat::EGRESS_MASQUERADE_NEW_FLOW),
        Err(SnatError::PortsExhausted) => {
            count(lb_stat::SNAT_PORTS_EXHAUSTED);
            return TC_ACT_SHOT;
        }
        Err(SnatError::Insert) => {
            count(lb_stat::CT_INSERT_FAILED);
            return TC_ACT_SHOT;
        }
    }
    let to = Tuple { src: new.nat_src, dst: new.nat_dst };
    match rewrite(ctx, flow, &to) {
        Ok(()) => TC_ACT_UNSPEC,
        Err(_) => {
            count(lb_stat::REWRITE_FAILED);
            TC_ACT_SHOT
        }
    }
}

/// The backend the entry was made for is no longer programmed at that id.
#[inline(always)]
fn backend_gone(entry: &CtValueV4) -> bool {
    // SAFETY: read-only use of a map value within this run.
    match unsafe { BACKENDS.get(entry.backend_id) } {
        Some(backend) => backend.addr != entry.nat_dst_addr || backend.port != entry.nat_dst_port,
        None => true,
    }
}

/// A flow may move to another backend while nothing depends on the old one: UDP, or TCP whose
/// handshake never completed. Established TCP stays (the backend may still be draining).
#[inline(always)]
fn may_move(entry: &CtValueV4, proto: u8) -> bool {
    proto != IPPROTO_TCP || entry.flags & CT_FLAG_SEEN_REPLY == 0
}

#[inline(always)]
fn translate(ctx: &TcContext, flow: &LbFlow, entry: &CtValueV4) -> Result<i32, i64> {
    let to = Tuple { src: (entry.nat_src_addr, entry.nat_src_port), dst: (entry.nat_dst_addr, entry.nat_dst_port) };
    apply(ctx, flow, &to, entry.flags & CT_FLAG_REDIRECT != 0)
}

#[inline(always)]
fn apply(ctx: &TcContext, flow: &LbFlow, to: &Tuple, redirect: bool) -> Result<i32, i64> {
    if rewrite(ctx, flow, to).is_err() {
        count(lb_stat::REWRITE_FAILED);
        return Ok(TC_ACT_SHOT);
    }
    if redirect {
        return Ok(route::redirect(ctx, to.src.0, to.dst.0, flow.proto));
    }
    Ok(TC_ACT_UNSPEC)
}

/// Records and translates the first packet of a flow. Source NAT where the reply would
/// otherwise not come back through this node's translation: a north-south flow sent to another
/// node (to this node's address, as kube-proxy masquerades), a backend reaching itself through
/// its service (hairpin, to the frontend address), or every flow with `--masquerade-all`.
// Not inlined: its stack would not fit beside the caller's in 512 bytes.
#[inline(never)]
fn new_flow(
    flow: &LbFlow,
    service: &ServiceValue,
    chosen: &(u32, BackendV4),
    now: u64,
    to: &mut Tuple,
) -> NewFlowVerdict {
    let (backend_id, backend) = (chosen.0, &chosen.1);
    // Absent or zero: no node address configured (no north-south SNAT yet).
    let config = LB_CONFIG.get(0).copied().unwrap_or_default();
    let mut new = NewFlow {
        nat_src: (flow.src_addr, flow.src_port),
        nat_dst: (backend.addr, backend.port),
        forward_flags: 0,
        reverse_flags: 0,
        service_id: service.service_id,
        backend_id,
    };
    let hairpin = service.flags & SVC_FLAG_HAIRPIN != 0 && backend.addr == flow.src_addr;
    let leaves_node = service.flags & (SVC_FLAG_EXTERNAL | SVC_FLAG_LOCAL_ONLY) == SVC_FLAG_EXTERNAL
        && backend.flags & BACKEND_FLAG_LOCAL == 0;
    let masquerade = config.snat_addr != 0 && (leaves_node || config.flags & LB_CONFIG_MASQUERADE_ALL != 0);
    if hairpin || masquerade {
        // A NodePort frontend is a node address: whichever direction gets it as its new source
        // must be routed by us.
        let nodeport = if service.flags & SVC_FLAG_NODEPORT != 0 { CT_FLAG_REDIRECT } else { 0 };
        new.reverse_flags = CT_FLAG_FULL_NAT | nodeport;
        if hairpin {
            new.nat_src.0 = flow.dst_addr;
            new.forward_flags = CT_FLAG_FULL_NAT | nodeport;
        } else {
            new.nat_src.0 = config.snat_addr;
            new.forward_flags = CT_FLAG_FULL_NAT | CT_FLAG_REDIRECT;
        }
        match conntrack::create_snat(flow, &mut new, (config.snat_port_min, config.snat_port_max), now) {
            Ok(()) => count(lb_stat::SNAT_NEW_FLOW),
            Err(SnatError::PortsExhausted) => {
                count(lb_stat::SNAT_PORTS_EXHAUSTED);
                return NewFlowVerdict::DROP;
            }
            Err(SnatError::Insert) => {
                // Without its entries the reply could not be translated back: refuse the flow.
                count(lb_stat::CT_INSERT_FAILED);
                return NewFlowVerdict::DROP;
            }
        }
    } else if conntrack::create(flow, &new, now).is_err() {
        // Still forward this packet; the next one retries the insert.
        count(lb_stat::CT_INSERT_FAILED);
    }
    count(lb_stat::NEW_FLOW);
    *to = Tuple { src: new.nat_src, dst: new.nat_dst };
    if new.forward_flags & CT_FLAG_REDIRECT != 0 {
        NewFlowVerdict::ROUTE
    } else {
        NewFlowVerdict::TRANSLATE
    }
}
