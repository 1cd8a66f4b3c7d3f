//! The gate in front of the load balancer's conntrack lookup: most packets through a node belong
//! to no Service (pod to pod, pod to outside without masquerade), and for them the lookup is a
//! miss walking a hash chain in cold memory. The gate decides from the packet's endpoints alone
//! whether it can belong to a flow the load balancer translates or tracks; a packet that cannot
//! passes untouched.
//!
//! What makes a miss certain: every entry of `ct_v4/v6` is one of
//! - a Service flow's (DNAT, full NAT, hairpin, DSR on either node): its frontend and its backend
//!   (address, port, protocol) are in `ct_gate_v4/v6`, written by the datapath before the entries
//!   (`conntrack::record_endpoints`), and every key of the flow has one of the two as its source
//!   or destination. A frontend not yet recorded is found in `svc_v4/v6` itself (the lookup
//!   `choose` makes), so a new Service's first packet is never gated away;
//! - a masqueraded or source-NATed flow's reply: its destination is the node's SNAT address;
//! - a pod egress masquerade flow, or an outside client's flow to a pod (`CT_FLAG_UNTRANSLATED`):
//!   looked up at ingress when its source is outside the cluster and at egress when its
//!   destination is (`cluster_nets_v4/v6` has no prefix for it), which the gate checks while pod
//!   egress masquerade is on (it records neither otherwise).
//!
//! Endpoints are never removed by the agent: a frontend or backend that goes away keeps its
//! record as long as packets touch it (each gate lookup marks it used), so flows that outlive
//! their Service keep their translation; the LRU drops the endpoint unused for longest when it
//! is full. ICMP errors do not come here (they are translated by the flow they quote).
use kube_router_common::*;

use crate::{
    family::Family,
    icmp::Hook,
    maps::{LB_CONFIG, META},
    parsing::LbFlow,
    plain,
};

/// False if the packet can belong to no flow the load balancer translates or tracks: it needs
/// no conntrack lookup. True while the agent keeps the gate closed (`META_LB_GATE`). `endpoint`
/// is scratch for the keys (map memory: they would crowd the BPF stack of the new-flow path).
// Not inlined: its prefix key and node address would push `lb::ingress`'s IPv6 frame past the
// 512-byte stack along the new-flow path.
#[allow(clippy::needless_borrows_for_generic_args)] // keys by reference, from map memory
#[inline(never)]
pub fn may_be_tracked<F: Family>(flow: &LbFlow<F::Addr>, hook: Hook, endpoint: &mut ServiceKey<F::Addr>) -> bool {
    if META.get(META_LB_GATE).is_none_or(|open| *open == 0) {
        return true;
    }
    let gate = F::ct_gate();
    let src = ServiceKey { addr: flow.src_addr, port: flow.src_port, proto: flow.proto, pad: 0 };
    let dst = ServiceKey { addr: flow.dst_addr, port: flow.dst_port, proto: flow.proto, pad: 0 };
    // The likelier hit first: a client's packet at ingress goes to a frontend, a backend's
    // reply at egress comes from one.
    let (likely, other) = match hook {
        Hook::Ingress => (dst, src),
        Hook::Egress => (src, dst),
    };
    *endpoint = likely;
    if gate.get_ptr(&*endpoint).is_some() {
        return true;
    }
    *endpoint = other;
    if gate.get_ptr(&*endpoint).is_some() {
        return true;
    }
    if let Some(config) = LB_CONFIG.get(0) {
        if F::snat_addr(config).is_some_and(|node| node == flow.dst_addr || node == flow.src_addr) {
            return true;
        }
        let far_end = match hook {
            Hook::Ingress => &flow.src_addr,
            Hook::Egress => &flow.dst_addr,
        };
        if masqueraded_far_end::<F>(config, far_end) {
            return true;
        }
    }
    // Egress creates no Service flow: a frontend matters at ingress only.
    hook == Hook::Ingress && is_frontend::<F>(endpoint, dst)
}

/// Pod egress masquerade is on and `far_end` is outside the cluster: a flow to or from it may be
/// masqueraded or recorded untranslated.
#[inline(always)]
fn masqueraded_far_end<F: Family>(config: &LbConfig, far_end: &F::Addr) -> bool {
    config.flags & LB_CONFIG_POD_EGRESS != 0 && F::cluster_net(far_end) == 0
}

/// `frontend` is in `svc_v4/v6`; `endpoint` is the lookup's key, in map memory.
#[allow(clippy::needless_borrows_for_generic_args)] // keys by reference, from map memory
#[inline(always)]
fn is_frontend<F: Family>(endpoint: &mut ServiceKey<F::Addr>, frontend: ServiceKey<F::Addr>) -> bool {
    *endpoint = frontend;
    F::services().get_ptr(&*endpoint).is_some()
}

/// For a packet `may_be_tracked` found untracked at ingress: the plain-traffic verdicts of its
/// tuple (`plain::LB_INGRESS`, and `LB_EGRESS` where its way out is untracked too) and of its
/// reverse, a reply's (`LB_EGRESS`, and `LB_INGRESS` where a reply is untracked at ingress too).
/// The gate asks the same of a tuple and its reverse (the endpoints, the node's address) but for
/// the far end pod egress masquerade looks at (the source at ingress, the destination at
/// egress) and the frontend (ingress only, at the destination).
#[inline(never)]
pub fn plain_both_ways<F: Family>(flow: &LbFlow<F::Addr>, endpoint: &mut ServiceKey<F::Addr>) -> (u32, u32) {
    if LB_CONFIG.get(0).is_some_and(|config| masqueraded_far_end::<F>(config, &flow.dst_addr)) {
        return (plain::LB_INGRESS, 0);
    }
    let src = ServiceKey { addr: flow.src_addr, port: flow.src_port, proto: flow.proto, pad: 0 };
    let reply_to_frontend = is_frontend::<F>(endpoint, src);
    let both = plain::LB_INGRESS | plain::LB_EGRESS;
    (both, if reply_to_frontend { plain::LB_EGRESS } else { both })
}
