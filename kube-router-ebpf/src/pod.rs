//! The host side of a pod veth in one program per direction (`kr_pod_ingress`, `kr_pod_egress`):
//! the load balancer's and the policy's work, in the order their separate programs run there
//! (`kr_lb_*`, `kr_pol_*`, which node interfaces and older agents' links still use), on one
//! parse of the packet.
//!
//! - TC ingress, packets from the pod: the source check, the load balancer (DNAT, so the policy
//!   judges the backend, not the Service address), then the pod's egress policy on the parse and
//!   tuple the load balancer left in its work area. A verdict of the load balancer's (a drop, a refusal,
//!   a packet it routed) ends the run, as it ends the filter chain.
//! - TC egress, packets to the pod: the pod's ingress policy on the packet as it came (before a
//!   reverse NAT would hide the backend's address the policy entry was made for), then the load
//!   balancer's egress on the same parse.
//!
//! Only TCP and UDP packets with their ports are judged from the load balancer's parse, which
//! reads them as the policy's own parser does; everything else (ICMP, other protocols, later
//! fragments, frames that are not IP) is parsed by the policy as in `kr_pol_*`, so verdicts,
//! counters and `monitor` events are those of the two programs.
use aya_ebpf::{
    bindings::{TC_ACT_SHOT, TC_ACT_UNSPEC},
    programs::TcContext,
};
use kube_router_common::*;

use crate::{
    family::{Family, V4, V6},
    lb,
    maps::Work,
    nat::Tuple,
    parsing::{ip_version, IpVersion, LbFlow, LbParsed},
    policy::{self, PolicyAddr, VethHook},
    source_check,
};

/// TC ingress of a pod veth's host side.
#[inline(always)]
pub fn from_pod(ctx: &TcContext) -> i32 {
    // As the load balancer's program: the first of ours here, before anything rewrites the source.
    if source_check::spoofed(ctx, SOURCE_CHECK_BY_LB) {
        return TC_ACT_SHOT;
    }
    // The load balancer's ingress is `kr_lb_ingress`'s own, the same subprograms: its deepest
    // call chain (the IPv6 new-flow path) is exactly at the verifier's 512 bytes, so it cannot
    // carry anything more. What it passed is read afterwards from the work area (`left_in`),
    // cleared first so that only this run's parse and translation are found there.
    forget_work(ctx);
    match lb::handle_ingress(ctx).unwrap_or(TC_ACT_UNSPEC) {
        TC_ACT_UNSPEC => {}
        // Dropped, refused, routed or tunnelled by the load balancer: the chain ends there.
        verdict => return verdict,
    }
    // The family the frame says (read again: one load, where carrying it out of the load
    // balancer would cost the program's frame). `police` is called from here, not from a
    // function of its own: its frame, the policy's, leaves room for no other beside it.
    let verdict = match ip_version(ctx) {
        Ok(IpVersion::V4) => left_in::<V4>(ctx),
        Ok(IpVersion::V6) => left_in::<V6>(ctx),
        _ => NOT_JUDGED,
    };
    if verdict == NOT_JUDGED {
        policy_alone(ctx)
    } else {
        verdict
    }
}

/// From what the load balancer's ingress left in the work area (its parse of a TCP or UDP
/// packet it passed, and the tuple after any translation): the policy's verdict, or
/// [`NOT_JUDGED`].
#[inline(always)]
fn left_in<F: Family>(ctx: &TcContext) -> i32
where
    F::Addr: PolicyAddr + Default,
{
    let Some(work) = F::work().get_ptr_mut(0) else {
        return NOT_JUDGED;
    };
    // SAFETY: per-CPU map memory the load balancer filled in this same program run.
    let work = unsafe { &mut *work };
    // Not a TCP, UDP or echo flow the load balancer parsed in this run (`forget_work` left
    // `Other`; an ICMP error, another protocol): the policy parses it itself.
    let LbParsed::Flow(flow) = &work.parsed else {
        return NOT_JUDGED;
    };
    // No translation wrote `to` (`forget_work`): the packet carries its parsed tuple.
    if work.to.src.1 == 0 && work.to.dst.1 == 0 {
        leave_as_parsed::<F>(&mut work.to, flow);
    }
    police::<F>(ctx, VethHook::FromPod, work)
}

/// Writes the flow's own tuple into `to`.
// Not inlined: the tuple is built in a frame of its own, not in the program's, which has none
// to spare (see `from_pod`).
#[inline(never)]
fn leave_as_parsed<F: Family>(to: &mut Tuple<F::Addr>, flow: &LbFlow<F::Addr>) {
    *to = Tuple { src: (flow.src_addr, flow.src_port), dst: (flow.dst_addr, flow.dst_port) };
}

/// Clears the work area of the packet's family: its parse to `Other`, the ports of its `to`, so
/// that after the load balancer's ingress they say whether it parsed the packet as a flow and
/// whether it translated it (a translated tuple has ports). The area is per-CPU scratch the last
/// program run on this CPU left behind.
// Not inlined: the program's own frame has no room to spare (see `from_pod`).
#[inline(never)]
fn forget_work(ctx: &TcContext) {
    match ip_version(ctx) {
        Ok(IpVersion::V4) => forget::<V4>(),
        Ok(IpVersion::V6) => forget::<V6>(),
        _ => {}
    }
}

#[inline(always)]
fn forget<F: Family>() {
    if let Some(work) = F::work().get_ptr_mut(0) {
        // SAFETY: per-CPU map memory, this program run's.
        let work = unsafe { &mut *work };
        work.parsed = LbParsed::Other;
        work.to.src.1 = 0;
        work.to.dst.1 = 0;
    }
}

/// The ingress policy, then the load balancer's egress, on one parse.
// Inlined into the program: each part below has a frame of its own, one after the other, so
// the deepest call chain is the load balancer's egress as in `kr_lb_egress`.
#[inline(always)]
fn to_pod_in<F: Family>(ctx: &TcContext) -> i32
where
    F::Addr: PolicyAddr + Default,
{
    let Some(work) = lb::parse_into::<F>(ctx) else {
        // Unreadable for the load balancer, which passes it: the policy alone judges it.
        return policy_alone_to_pod(ctx);
    };
    let verdict = match &work.parsed {
        LbParsed::Flow(flow) => {
            // The packet as it came (`work.to` is scratch the egress writes before it reads).
            leave_as_parsed::<F>(&mut work.to, flow);
            police::<F>(ctx, VethHook::ToPod, work)
        }
        _ => NOT_JUDGED,
    };
    let verdict = if verdict == NOT_JUDGED { policy_alone_to_pod(ctx) } else { verdict };
    if verdict != TC_ACT_UNSPEC {
        return verdict;
    }
    lb::egress_of_parsed::<F>(ctx, work)
}

/// `police`'s answer for a packet the shared parse cannot be judged from (not a TC verdict): the
/// caller has the policy parse it itself (`policy_alone*`, called from the program's own frame:
/// from here its frame would stack on this one).
const NOT_JUDGED: i32 = i32::MIN;

/// The policy's verdict on the packet parsed in `work`, now carrying the tuple `work.to`, when
/// the policy would read it alike; else [`NOT_JUDGED`].
// Not inlined: the policy's flow and keys are built in a frame of their own, after the load
// balancer's have returned or before they are made.
#[inline(never)]
fn police<F: Family>(ctx: &TcContext, hook: VethHook, work: &Work<F::Addr>) -> i32
where
    F::Addr: PolicyAddr + Default,
{
    let view = match &work.parsed {
        LbParsed::Flow(flow) => flow.policy_view(work.to.src, work.to.dst),
        _ => None,
    };
    match view {
        Some(view) => policy::enforce_flow(ctx, hook, &view),
        None => NOT_JUDGED,
    }
}

/// `kr_pol_ingress`'s check alone (the load balancer passed a packet it could not use).
#[inline(never)]
fn policy_alone(ctx: &TcContext) -> i32 {
    policy::enforce(ctx, VethHook::FromPod).unwrap_or_else(|_| policy::malformed(ctx, VethHook::FromPod))
}

/// `kr_pol_egress`'s check alone: a packet the load balancer cannot read, which it passes.
#[inline(never)]
fn policy_alone_to_pod(ctx: &TcContext) -> i32 {
    policy::enforce(ctx, VethHook::ToPod).unwrap_or_else(|_| policy::malformed(ctx, VethHook::ToPod))
}

/// TC egress of a pod veth's host side.
#[inline(always)]
pub fn to_pod(ctx: &TcContext) -> i32 {
    match ip_version(ctx) {
        Ok(IpVersion::V4) => to_pod_in::<V4>(ctx),
        Ok(IpVersion::V6) => to_pod_in::<V6>(ctx),
        // Nothing the load balancer translates (`lb::handle_egress` passes it).
        Ok(IpVersion::Neither) | Err(_) => policy_alone_to_pod(ctx),
    }
}
