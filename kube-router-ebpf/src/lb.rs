//! Service load-balancing at TC, for IPv4 and IPv6 alike: frontend lookup, DNAT (and SNAT where
//! the reply would not come back otherwise) of new flows, translation of known ones in both
//! directions, pod egress masquerade.
//!
//! Ingress DNATs packets to service frontends and translates replies of source-NATed flows;
//! egress reverse-NATs replies of the others after routing (their restored source may be a node
//! address, which the stack drops as a martian on ingress) and masquerades pod traffic leaving
//! the cluster. A source-NATed packet whose new source is a node address is routed by the
//! program itself (`route`).
use aya_ebpf::{
    bindings::{TC_ACT_SHOT, TC_ACT_UNSPEC},
    helpers::bpf_ktime_get_ns,
    programs::TcContext,
};
use kube_router_common::*;

use crate::{
    backend::select_backend,
    conntrack::{self, NewFlow, SnatError},
    dsr, events,
    family::{Family, V4, V6},
    frag, gate,
    icmp::{self, Hook},
    maps::{count, Work, FORWARDED_SLOTS, LB_CONFIG},
    nat::Tuple,
    packet::{Packet, TcDirect},
    parsing::{ip_version, Fragment, IpVersion, LbFlow, LbParsed, TCP_FLAG_ACK, TCP_FLAG_SYN},
    plain, route,
    svc_stats::{self, Way},
};

/// The flow of the parsed packet, ready for translation (ports resolved for fragments); or the
/// verdict for a packet that is not one (ICMP errors are translated here).
#[inline(always)]
pub(crate) fn flow_of<F: Family>(
    ctx: &TcContext,
    parsed: &mut LbParsed<F::Addr>,
    hook: Hook,
) -> Result<&'static mut LbFlow<F::Addr>, i32> {
    let flow = match parsed {
        LbParsed::Flow(flow) => flow,
        LbParsed::IcmpError(error) => return Err(icmp::translate::<F>(ctx, error, hook)),
        LbParsed::Other => return Err(TC_ACT_UNSPEC),
    };
    if !frag::resolve_ports::<F>(flow) {
        return Err(TC_ACT_UNSPEC);
    }
    // SAFETY: `parsed` lives in per-CPU map memory, valid (and ours alone) for this program run.
    Ok(unsafe { &mut *(flow as *mut LbFlow<F::Addr>) })
}

/// Ingress: DNAT of packets to service frontends (new flows and conntrack hits), and the replies
/// of source-NATed flows.
#[inline(always)]
pub fn handle_ingress(ctx: &TcContext) -> Result<i32, i64> {
    count(lb_stat::PACKETS);
    // A refusal or a "too big" answer is built here, not inside `ingress`: the two frames would
    // not fit on one stack.
    Ok(match ip_version(TcDirect::of(ctx)).or_else(|_| ip_version(ctx))? {
        IpVersion::V4 => answer::<V4>(
            ctx,
            dsr::decap(ctx).map(|backend| dsr::deliver::<V4>(ctx, &backend)).unwrap_or_else(|| ingress::<V4>(ctx)),
        ),
        IpVersion::V6 => answer::<V6>(
            ctx,
            match dsr::receive_v6(ctx) {
                dsr::NOT_TUNNELLED => ingress::<V6>(ctx),
                delivered => delivered,
            },
        ),
        IpVersion::Neither => {
            count(lb_stat::NOT_IP);
            TC_ACT_UNSPEC
        }
    })
}

/// A packet the plain-traffic cache knows not tracked at ingress (`plain::LB_INGRESS`): counted
/// as the judgement would have.
#[inline(always)]
pub fn known_plain_ingress() -> i32 {
    count(lb_stat::PACKETS);
    count(lb_stat::NO_SERVICE);
    TC_ACT_UNSPEC
}

/// `ingress`'s answer for a new flow to a frontend without endpoints (not a TC verdict).
const REFUSE: i32 = i32::MIN;

/// The TC verdict for what ingress said: a refusal or a "too big" answer is built here.
#[inline(always)]
fn answer<F: Family>(ctx: &TcContext, said: i32) -> i32 {
    match said {
        REFUSE => refuse::<F>(ctx),
        too_big if too_big >= route::FRAG_NEEDED => frag_needed::<F>(ctx, too_big as u16),
        verdict => verdict,
    }
}

/// Answers the packet in the work area, which `ingress` found to be a new flow to a frontend
/// without endpoints.
#[inline(always)]
fn refuse<F: Family>(ctx: &TcContext) -> i32 {
    let Some(work) = F::work().get_ptr(0) else {
        return TC_ACT_SHOT;
    };
    // SAFETY: per-CPU map memory `ingress` just filled, read within the same program run.
    match unsafe { &(*work).parsed } {
        LbParsed::Flow(flow) => F::refuse(ctx, flow),
        _ => TC_ACT_SHOT,
    }
}

/// Answers the packet in the work area, which `ingress` translated (to `work.to`) but could not
/// route: it does not fit the route's `mtu`.
#[inline(always)]
fn frag_needed<F: Family>(ctx: &TcContext, mtu: u16) -> i32 {
    let Some(work) = F::work().get_ptr(0) else {
        return TC_ACT_SHOT;
    };
    // SAFETY: per-CPU map memory `ingress` just filled, read within the same program run.
    match unsafe { &(*work).parsed } {
        LbParsed::Flow(flow) => F::frag_needed(ctx, flow, unsafe { &(*work).to }, mtu),
        _ => TC_ACT_SHOT,
    }
}

/// Egress: reverse NAT of backend replies, so the client sees the frontend it connected to; pod
/// traffic leaving the cluster masqueraded to the node address.
#[inline(always)]
pub fn handle_egress(ctx: &TcContext) -> Result<i32, i64> {
    Ok(match ip_version(TcDirect::of(ctx)).or_else(|_| ip_version(ctx))? {
        IpVersion::V4 => egress::<V4>(ctx),
        IpVersion::V6 => egress::<V6>(ctx),
        IpVersion::Neither => TC_ACT_UNSPEC,
    })
}

/// The packet parsed into the family's per-CPU work area.
///
/// Read in place first (`TcDirect`): the headers are in the skb's linear part for nearly every
/// packet, and a `bpf_skb_load_bytes` call per field was the largest part of the parse's cost.
/// Only where that read fails (a header beyond the linear part, or a truncated packet) is the
/// packet parsed again through the helper, which reads the whole packet. Two instantiations of
/// the parser, each verified on its own path: not a fallback per field, whose paths the verifier
/// would have to follow in every combination. No `bpf_skb_pull_data`: it would copy (unclone)
/// the cloned skbs TCP sends, for every packet.
#[inline(always)]
pub(crate) fn parse_into<F: Family>(ctx: &TcContext) -> Option<&'static mut Work<F::Addr>> {
    let work = F::work().get_ptr_mut(0)?;
    // SAFETY: per-CPU map memory, used by this program run only.
    let work = unsafe { &mut *work };
    parse_either_way::<F>(ctx, &mut work.parsed).then_some(work)
}

// Not inlined: what the second parse needs, kept across the first, is spilled in a frame of its
// own. In `ingress::<V6>`'s it took that frame from 256 to 272 bytes, and its deepest chain (to
// `new_flow`) past the verifier's 512.
#[inline(never)]
fn parse_either_way<F: Family>(ctx: &TcContext, parsed: &mut LbParsed<F::Addr>) -> bool {
    F::parse(TcDirect::of(ctx), parsed) || F::parse(ctx, parsed)
}

// Not inlined: one frame per family, so IPv4's and IPv6's stacks are not added up.
#[inline(never)]
fn ingress<F: Family>(ctx: &TcContext) -> i32 {
    let Some(work) = parse_into::<F>(ctx) else {
        return TC_ACT_UNSPEC;
    };
    let flow = match flow_of::<F>(ctx, &mut work.parsed, Hook::Ingress) {
        Ok(flow) => flow,
        Err(verdict) => return verdict,
    };
    // No frontend, Service endpoint, node address or (with masquerade) outside source: no entry
    // can hold it and no flow starts here. Its egress decides for itself (no "no entry" note).
    if !gate::may_be_tracked::<F>(flow, Hook::Ingress, &mut work.endpoint) {
        count(lb_stat::NO_SERVICE);
        // What the gate found answers the packet's way out of the node and its flow's replies
        // too, but for the far end masquerade looks at and a frontend at the source.
        let (forward, reverse) = gate::plain_both_ways::<F>(flow, &mut work.endpoint);
        plain::remember(forward);
        plain::remember_reverse(reverse);
        return TC_ACT_UNSPEC;
    }
    let now = unsafe { bpf_ktime_get_ns() };
    work.key = conntrack::key_of(flow);
    if let Some(entry) = conntrack::lookup::<F>(&work.key, flow.tcp_flags, now) {
        match known::<F>(flow, entry) {
            // A masqueraded pod flow (translated as it leaves the node), a backend's reply
            // (translated on its way out, egress, after routing), or an outside client's flow to a
            // pod (marked answered at egress, where the pod's reply leaves): egress must look each up.
            Known::Masqueraded | Known::BackendReply | Known::Untranslated => {
                forget_no_entry::<F>(&work.key);
                return TC_ACT_UNSPEC;
            }
            Known::Forward => {
                count(if flow.fragment == Fragment::Later { lb_stat::FRAGMENT_NAT } else { lb_stat::CT_HIT });
                svc_stats::count::<F, _>(ctx, flow.dst_addr, flow.dst_port, flow.proto, Way::In);
                if entry.flags & CT_FLAG_DSR_ENCAP != 0 {
                    return tunnel::<F>(ctx, flow, &(entry.nat_dst_addr, entry.nat_dst_port), &mut work.to);
                }
                let verdict = translate::<F>(ctx, flow, entry, &mut work.to);
                note_forwarded::<F>(&work.to, flow.proto, verdict);
                return verdict;
            }
            Known::Reselect => {
                count(lb_stat::CT_RESELECTED);
                conntrack::forget::<F>(&work.key, entry);
            }
            Known::FullNatReply => {
                if entry.service_id == 0 {
                    count(lb_stat::EGRESS_MASQUERADE);
                } else {
                    count(lb_stat::REVERSE_NAT);
                    // The reverse entry restores the frontend as the source.
                    svc_stats::count::<F, _>(ctx, entry.nat_src_addr, entry.nat_src_port, flow.proto, Way::Out);
                }
                conntrack::mark_seen_reply::<F>(entry, flow);
                return translate::<F>(ctx, flow, entry, &mut work.to);
            }
        }
    }
    if !flow.has_l4() || (flow.proto != IPPROTO_TCP && flow.proto != IPPROTO_UDP) {
        return TC_ACT_UNSPEC;
    }

    match choose::<F>(flow, now, &mut work.service, &mut work.chosen) {
        Choice::NoService => {
            count(lb_stat::NO_SERVICE);
            conntrack::release_reply_tuple::<F>(flow, now);
            if flow.opens_flow() && pod_egress_masquerade::<F>() {
                record_if_outside_to_pod::<F>(flow, now);
            }
            // Not service traffic and no entry holds its tuple: its TC egress, with the same
            // tuple, would only miss again.
            note_no_entry::<F>(&work.key);
            return TC_ACT_UNSPEC;
        }
        Choice::SourceDenied => {
            count(lb_stat::SOURCE_RANGE_DROP);
            return TC_ACT_SHOT;
        }
        Choice::NoBackend => {
            count(lb_stat::NO_BACKEND_DROP);
            return REFUSE;
        }
        Choice::Backend => {}
    }
    match new_flow::<F>(flow, &work.service, &work.chosen, now, &mut work.new) {
        NewFlowVerdict::DROP => TC_ACT_SHOT,
        NewFlowVerdict::TUNNEL => {
            flow_opened::<F, _>(ctx, flow, &work.new, now, Way::New);
            tunnel::<F>(ctx, flow, &work.new.nat_dst, &mut work.to)
        }
        verdict => {
            flow_opened::<F, _>(ctx, flow, &work.new, now, Way::New);
            work.to = Tuple { src: work.new.nat_src, dst: work.new.nat_dst };
            let verdict = apply::<F>(ctx, flow, &work.to, verdict == NewFlowVerdict::ROUTE);
            note_forwarded::<F>(&work.to, flow.proto, verdict);
            verdict
        }
    }
}

/// Remembers the tuple a client's packet was just translated to (`to`) when the stack forwards
/// it on: its TC egress then skips the conntrack lookup (see `egress`).
#[inline(always)]
fn note_forwarded<F: Family>(to: &Tuple<F::Addr>, proto: u8, verdict: i32) {
    if verdict != TC_ACT_UNSPEC {
        return;
    }
    note_no_entry::<F>(&conntrack::key(to.src, to.dst, proto));
}

/// Remembers a tuple TC egress would find no conntrack entry for (see `egress`).
#[inline(always)]
fn note_no_entry<F: Family>(key: &CtKey<F::Addr>) {
    if let Some(slot) = F::forwarded().get_ptr_mut(forwarded_slot(key)) {
        // SAFETY: per-CPU map memory; no other program run on this CPU is in between.
        unsafe { *slot = *key };
    }
}

/// Ingress found an entry for `key`: a note that an earlier packet of the same tuple left (before
/// a flow took that tuple, e.g. a client port reused from a direct connection for one through a
/// Service) must not make egress skip the translation this packet needs. Notes are never
/// expired otherwise: a slot keeps its tuple until another one hashes there.
#[inline(always)]
fn forget_no_entry<F: Family>(key: &CtKey<F::Addr>) {
    if let Some(slot) = F::forwarded().get_ptr_mut(forwarded_slot(key)) {
        // SAFETY: per-CPU map memory; no other program run on this CPU is in between.
        let slot = unsafe { &mut *slot };
        if slot == key {
            // No TCP or UDP tuple has protocol 0: the slot matches nothing now.
            slot.proto = 0;
        }
    }
}

/// `key`'s slot in the family's `forwarded` table: a hash of the whole tuple.
#[inline(always)]
fn forwarded_slot<A: FlowHashWords>(key: &CtKey<A>) -> u32 {
    let hash = key.dst_addr.mix_into(key.src_addr.mix_into(0));
    let hash = mix32(hash, ((key.src_port as u32) << 16) | (key.dst_port as u32 ^ ((key.proto as u32) << 8)));
    fmix32(hash) % FORWARDED_SLOTS
}

/// TC ingress left a packet with tuple `key` to the stack, translated for a client
/// (`note_forwarded`) or untouched, with no entry of its own (`note_no_entry`).
#[inline(always)]
fn was_forwarded<F: Family>(key: &CtKey<F::Addr>) -> bool {
    // SAFETY: read-only per-CPU map memory.
    F::forwarded().get(forwarded_slot(key)).is_some_and(|noted| noted == key)
}

/// What a conntrack entry found for an arriving packet says about it. Shared by the TC and XDP
/// ingress hooks, so both read the one conntrack state alike.
pub(crate) enum Known {
    /// A masqueraded pod flow's reply or packet: translated at TC egress.
    Masqueraded,
    /// A flow an outside client opened to a pod's own address: left as it is.
    Untranslated,
    /// Client to backend: translated as the entry says.
    Forward,
    /// Client to a backend that is gone, and the flow may move: balance it again.
    Reselect,
    /// The reply of a source-NATed flow (to the node address): reverse-translated on arrival.
    FullNatReply,
    /// A backend's reply to a flow not source-NATed: translated at TC egress, after routing.
    BackendReply,
}

#[inline(always)]
pub(crate) fn known<F: Family>(flow: &LbFlow<F::Addr>, entry: &CtValue<F::Addr>) -> Known {
    if entry.flags & CT_FLAG_EGRESS != 0 {
        Known::Masqueraded
    } else if entry.flags & CT_FLAG_UNTRANSLATED != 0 {
        Known::Untranslated
    } else if entry.flags & CT_FLAG_FORWARD != 0 {
        // A backend gone while nothing was answered yet: the flow is balanced again.
        // A backend named by a direct-server-return tunnel is no slot's: never gone here.
        if flow.has_l4()
            && entry.flags & CT_FLAG_DSR_DELIVER == 0
            && backend_gone::<F>(entry)
            && may_move(entry.flags, flow.proto)
        {
            Known::Reselect
        } else if flow.proto == IPPROTO_TCP
            && flow.tcp_flags & (TCP_FLAG_SYN | TCP_FLAG_ACK) == TCP_FLAG_SYN
            && entry.flags & (CT_FLAG_SEEN_REPLY | CT_FLAG_DSR_ENCAP | CT_FLAG_DSR_DELIVER) == 0
            && reverse_entry_gone::<F>(entry, flow.proto)
        {
            // A client's retried SYN of a flow nothing answered, whose reverse entry is gone
            // (evicted by the LRU from a full table, or removed): translated by the lone forward
            // entry, its SYN-ACK would leave untranslated and be reset by the client, on every
            // retry for as long as the retries keep that entry. Opened again, with both entries.
            // Not a direct-server-return tunnel's entry (no reverse entry by design).
            Known::Reselect
        } else {
            Known::Forward
        }
    } else if entry.flags & CT_FLAG_FULL_NAT != 0 {
        Known::FullNatReply
    } else {
        Known::BackendReply
    }
}

/// The backend choice for a new flow's first packet (TCP or UDP with its ports).
pub(crate) enum Choice {
    /// No frontend at the destination: not service traffic.
    NoService,
    /// Outside the service's `loadBalancerSourceRanges`.
    SourceDenied,
    /// The frontend has no endpoints.
    NoBackend,
    /// The frontend and the backend chosen are in `service` and `chosen`.
    Backend,
}

/// Looks up the flow's frontend and chooses its backend, into `service` and `chosen` (the work
/// area: map memory, not the BPF stack).
#[inline(always)]
pub(crate) fn choose<F: Family>(
    flow: &LbFlow<F::Addr>,
    now: u64,
    service: &mut ServiceValue,
    chosen: &mut (u32, Backend<F::Addr>),
) -> Choice {
    let frontend = ServiceKey { addr: flow.dst_addr, port: flow.dst_port, proto: flow.proto, pad: 0 };
    // SAFETY: read-only copy of a map value.
    let Some(found) = (unsafe { F::services().get(frontend) }) else {
        return Choice::NoService;
    };
    *service = *found;
    // loadBalancerSourceRanges: a firewall in front of the load balancer, for new flows.
    if service.flags & SVC_FLAG_SOURCE_RANGES != 0 && !F::source_allowed(service.service_id, &flow.src_addr) {
        return Choice::SourceDenied;
    }
    match select_backend::<F>(flow.src_addr, flow.src_port, service, now) {
        Some(backend) => {
            *chosen = backend;
            Choice::Backend
        }
        None => Choice::NoBackend,
    }
}

/// Counts a flow `new_flow` recorded (`way`: `New` where its first packet is translated too,
/// `Opened` where another hook translates it) and tells a listening monitor.
// Not inlined: the event is built in a frame of its own, not beside the caller's.
#[inline(never)]
pub(crate) fn flow_opened<F: Family, C: Packet>(
    ctx: &C,
    flow: &LbFlow<F::Addr>,
    new: &NewFlow<F::Addr>,
    now: u64,
    way: Way,
) {
    svc_stats::count::<F, C>(ctx, flow.dst_addr, flow.dst_port, flow.proto, way);
    let backend = new.nat_dst;
    events::emit(ctx, now, |ifindex| MonitorEvent {
        timestamp_ns: now,
        kind: EVENT_SERVICE_NAT,
        family: if size_of::<F::Addr>() == 4 { 4 } else { 6 },
        proto: flow.proto,
        direction: 0,
        ifindex,
        src: flow.src_addr.event_words(),
        dst: flow.dst_addr.event_words(),
        nat: backend.0.event_words(),
        src_port: flow.src_port,
        dst_port: flow.dst_port,
        nat_port: backend.1,
        pad: 0,
    });
}

#[inline(never)]
fn egress<F: Family>(ctx: &TcContext) -> i32 {
    let Some(work) = parse_into::<F>(ctx) else {
        return TC_ACT_UNSPEC;
    };
    let flow = match flow_of::<F>(ctx, &mut work.parsed, Hook::Egress) {
        Ok(flow) => flow,
        Err(verdict) => return verdict,
    };
    work.key = conntrack::key_of(flow);
    // A packet TC ingress translated for a client, forwarded by the stack: a client's packet,
    // not a backend's reply, so no reverse entry is its (one would be another flow's clashing
    // tuple). Or one that is no service traffic at all, whose tuple ingress has just looked up
    // in vain (pod to pod, or a packet XDP translated). Only pod egress masquerade could still
    // apply, to an address outside the cluster. The lookup would be a miss: for a translated
    // tuple a walk of the table's chain on cold memory that costs about what ingress's lookup
    // does. Ingress runs a whole receive batch before the stack forwards the first packet of
    // it, hence a table of recent tuples, not the last one.
    if was_forwarded::<F>(&work.key) && !masquerade_candidate::<F>(flow) {
        return TC_ACT_UNSPEC;
    }
    if !gate::may_be_tracked::<F>(flow, Hook::Egress, &mut work.endpoint) {
        plain::remember(plain::LB_EGRESS);
        return TC_ACT_UNSPEC;
    }
    let now = unsafe { bpf_ktime_get_ns() };
    match conntrack::lookup::<F>(&work.key, flow.tcp_flags, now) {
        // A pod's reply to an outside client that connected to it directly: leaves as it is.
        Some(entry) if entry.flags & CT_FLAG_UNTRANSLATED != 0 => {
            if entry.flags & CT_FLAG_REVERSE != 0 {
                conntrack::mark_seen_reply::<F>(entry, flow);
            }
            TC_ACT_UNSPEC
        }
        Some(entry) if entry.flags & (CT_FLAG_REVERSE | CT_FLAG_FULL_NAT) == CT_FLAG_REVERSE => {
            count(if flow.fragment == Fragment::Later { lb_stat::FRAGMENT_NAT } else { lb_stat::REVERSE_NAT });
            svc_stats::count::<F, _>(ctx, entry.nat_src_addr, entry.nat_src_port, flow.proto, Way::Out);
            conntrack::mark_seen_reply::<F>(entry, flow);
            translate::<F>(ctx, flow, entry, &mut work.to)
        }
        Some(entry) if entry.flags & CT_FLAG_EGRESS != 0 => {
            count(lb_stat::EGRESS_MASQUERADE);
            translate::<F>(ctx, flow, entry, &mut work.to)
        }
        Some(_) => TC_ACT_UNSPEC,
        None if flow.has_l4() => masquerade::<F>(ctx, flow, now, &mut work.to),
        None => TC_ACT_UNSPEC,
    }
}

/// Direct server return: the packet, untranslated, tunnelled to `backend`'s node (see `dsr`);
/// `to` is scratch, left naming the packet's own tuple for a "fragmentation needed" answer.
#[inline(always)]
fn tunnel<F: Family>(
    ctx: &TcContext,
    flow: &LbFlow<F::Addr>,
    backend: &(F::Addr, u16),
    to: &mut Tuple<F::Addr>,
) -> i32 {
    *to = Tuple { src: (flow.src_addr, flow.src_port), dst: (flow.dst_addr, flow.dst_port) };
    F::tunnel(ctx, backend, flow.proto, flow.l4_off)
}

/// The backend the entry was made for is no longer programmed at that id.
#[inline(always)]
fn backend_gone<F: Family>(entry: &CtValue<F::Addr>) -> bool {
    // SAFETY: read-only use of a map value within this run.
    match unsafe { F::backends().get(entry.backend_id) } {
        Some(backend) => backend.addr != entry.nat_dst_addr || backend.port != entry.nat_dst_port,
        None => true,
    }
}

/// The entry's opposite (the reverse entry of a forward one) is not in the table.
// Not inlined: the key lives in this frame, not in `ingress`'s.
#[inline(never)]
fn reverse_entry_gone<F: Family>(entry: &CtValue<F::Addr>, proto: u8) -> bool {
    F::conntrack().get_ptr(entry.reverse_key(proto)).is_none()
}

/// A flow may move to another backend while nothing depends on the old one: UDP, or TCP whose
/// handshake never completed. Established TCP stays (the backend may still be draining).
#[inline(always)]
fn may_move(flags: u16, proto: u8) -> bool {
    proto != IPPROTO_TCP || flags & CT_FLAG_SEEN_REPLY == 0
}

/// Translates the packet as the entry says; `to` is scratch for the new tuple.
#[inline(always)]
pub(crate) fn translate<F: Family>(
    ctx: &TcContext,
    flow: &LbFlow<F::Addr>,
    entry: &CtValue<F::Addr>,
    to: &mut Tuple<F::Addr>,
) -> i32 {
    *to = Tuple { src: (entry.nat_src_addr, entry.nat_src_port), dst: (entry.nat_dst_addr, entry.nat_dst_port) };
    apply::<F>(ctx, flow, to, entry.flags & CT_FLAG_REDIRECT != 0)
}

#[inline(always)]
pub(crate) fn apply<F: Family>(ctx: &TcContext, flow: &LbFlow<F::Addr>, to: &Tuple<F::Addr>, route: bool) -> i32 {
    if F::rewrite(ctx, flow, to).is_err() {
        count(lb_stat::REWRITE_FAILED);
        return TC_ACT_SHOT;
    }
    if route {
        // Or route::FRAG_NEEDED with the MTU, answered by `handle_ingress` (routing happens at
        // ingress only).
        return F::redirect(ctx, to, flow.proto, flow.l4_off);
    }
    TC_ACT_UNSPEC
}

/// What to do with a new flow's first packet (an integer: it crosses a BPF function call).
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(transparent)]
pub(crate) struct NewFlowVerdict(i32);

impl NewFlowVerdict {
    pub(crate) const TRANSLATE: Self = Self(0);
    /// Translate, then route it ourselves (its new source is a node address).
    pub(crate) const ROUTE: Self = Self(1);
    pub(crate) const DROP: Self = Self(2);
    /// Direct server return: tunnel it, untranslated, to the backend's node (`lb::tunnel`).
    pub(crate) const TUNNEL: Self = Self(3);
}

/// Records the first packet of a flow and says what it becomes (`new`, in the work area). Source NAT where the reply
/// would otherwise not come back through this node's translation: a north-south flow sent to
/// another node (to this node's address, as kube-proxy masquerades), a backend reaching itself
/// through its service (hairpin, to the frontend address), or every flow with `--masquerade-all`.
// Not inlined: its stack would not fit beside the caller's in 512 bytes.
#[inline(never)]
pub(crate) fn new_flow<F: Family>(
    flow: &LbFlow<F::Addr>,
    service: &ServiceValue,
    chosen: &(u32, Backend<F::Addr>),
    now: u64,
    new: &mut NewFlow<F::Addr>,
) -> NewFlowVerdict {
    let (backend_id, backend) = (chosen.0, &chosen.1);
    // Absent or zero: no node address configured (no north-south SNAT yet).
    let Some(config) = LB_CONFIG.get(0) else {
        return NewFlowVerdict::DROP;
    };
    *new = NewFlow {
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
    let snat_addr = F::snat_addr(config);
    // Direct server return (IPIP, IPv6-in-IPv6): the backend's node translates, its reply goes
    // straight to the client. The node address is the tunnel's source.
    let dsr = service.flags & SVC_FLAG_DSR != 0
        && leaves_node
        && !hairpin
        && (service.flags & SVC_FLAG_NODEPORT == 0 || node_port_dsr::<F>(flow));
    if dsr && snat_addr.is_some() {
        new.forward_flags = CT_FLAG_DSR_ENCAP;
        if conntrack::create_forward::<F>(flow, new, now).is_err() {
            // Still tunnelled; the next packet retries the insert (and may choose again).
            count(lb_stat::CT_INSERT_FAILED);
        }
        count(lb_stat::NEW_FLOW);
        dsr::count(dsr_stat::NEW_FLOW);
        return NewFlowVerdict::TUNNEL;
    }
    let masquerade = snat_addr.is_some() && (leaves_node || config.flags & LB_CONFIG_MASQUERADE_ALL != 0);
    if hairpin || masquerade {
        // A NodePort frontend is a node address: whichever direction gets it as its new source
        // must be routed by us.
        let nodeport = if service.flags & SVC_FLAG_NODEPORT != 0 { CT_FLAG_REDIRECT } else { 0 };
        new.reverse_flags = CT_FLAG_FULL_NAT | nodeport;
        match snat_addr {
            Some(addr) if !hairpin => {
                new.nat_src.0 = addr;
                new.forward_flags = CT_FLAG_FULL_NAT | CT_FLAG_REDIRECT;
            }
            _ => {
                new.nat_src.0 = flow.dst_addr;
                new.forward_flags = CT_FLAG_FULL_NAT | nodeport;
            }
        }
        // Before the entries (`gate`); a masqueraded pod flow (`masquerade`) records none.
        if conntrack::record_endpoints::<F>(flow, &new.nat_dst, now).is_err() {
            count(lb_stat::CT_INSERT_FAILED);
            return NewFlowVerdict::DROP;
        }
        match conntrack::create_snat::<F>(flow, new, (config.snat_port_min, config.snat_port_max), now) {
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
    } else if conntrack::create::<F>(flow, new, now).is_err() {
        // Still forward this packet; the next one retries the insert.
        count(lb_stat::CT_INSERT_FAILED);
    }
    count(lb_stat::NEW_FLOW);
    if new.forward_flags & CT_FLAG_REDIRECT != 0 {
        NewFlowVerdict::ROUTE
    } else {
        NewFlowVerdict::TRANSLATE
    }
}

/// Pod egress masquerade is on and the packet goes from a pod to an address outside the cluster
/// (no pod CIDR, node or service address).
#[inline(always)]
fn masquerade_candidate<F: Family>(flow: &LbFlow<F::Addr>) -> bool {
    LB_CONFIG.get(0).is_some_and(|config| {
        config.flags & LB_CONFIG_POD_EGRESS != 0
            && F::cluster_net(&flow.src_addr) & CLUSTER_NET_POD != 0
            && F::cluster_net(&flow.dst_addr) == 0
    })
}

/// Pod egress masquerade is on (and has an address for this family).
#[inline(always)]
fn pod_egress_masquerade<F: Family>() -> bool {
    LB_CONFIG.get(0).is_some_and(|config| config.flags & LB_CONFIG_POD_EGRESS != 0 && F::snat_addr(config).is_some())
}

/// An outside client's first packet to a pod's own address (no Service), while pod egress
/// masquerade could take the pod's replies for flows of its own: the flow is recorded
/// (`conntrack::create_untranslated`) so they leave as they are. In-cluster sources stop at
/// the first lookup.
// Not inlined: the prefix lookups' keys would not fit on `ingress`'s stack.
#[inline(never)]
fn record_if_outside_to_pod<F: Family>(flow: &LbFlow<F::Addr>, now: u64) {
    if F::cluster_net(&flow.src_addr) == 0 && F::cluster_net(&flow.dst_addr) & CLUSTER_NET_POD != 0 {
        conntrack::create_untranslated::<F>(flow, now);
    }
}

/// A NodePort flow may be tunnelled: its client is outside the cluster (a reply from this
/// node's own address would be dropped here as a martian on its way to a pod of this node, and
/// delivered untranslated to a node's own address on the backend's node), and its frontend is a
/// node address `cluster_nets` knows (the backend's node admits the tunnel by it). Otherwise it
/// is source-NATed.
#[inline(always)]
fn node_port_dsr<F: Family>(flow: &LbFlow<F::Addr>) -> bool {
    F::cluster_net(&flow.src_addr) == 0 && F::cluster_net(&flow.dst_addr) & CLUSTER_NET_NODE != 0
}

/// A pod's packet to an address outside the cluster (no pod CIDR, node or service address)
/// leaves with the node's address, as kube-router's pod egress masquerade does.
// Not inlined: keeps its stack out of the egress hot path's.
#[inline(never)]
fn masquerade<F: Family>(ctx: &TcContext, flow: &LbFlow<F::Addr>, now: u64, to: &mut Tuple<F::Addr>) -> i32 {
    let Some(config) = LB_CONFIG.get(0) else {
        return TC_ACT_UNSPEC;
    };
    let Some(snat_addr) = F::snat_addr(config) else {
        return TC_ACT_UNSPEC;
    };
    // Only a packet that opens a flow starts a masqueraded one, as iptables' MASQUERADE applies
    // to NEW connections only: a reply this node has no entry for (a SYN-ACK, a UDP answer to an
    // outside client whose entry is gone) leaves as it is, never with the node's address.
    if !flow.opens_flow() || !masquerade_candidate::<F>(flow) {
        return TC_ACT_UNSPEC;
    }
    let mut new = NewFlow {
        nat_src: (snat_addr, 0),
        nat_dst: (flow.dst_addr, flow.dst_port),
        forward_flags: CT_FLAG_FULL_NAT | CT_FLAG_EGRESS,
        reverse_flags: CT_FLAG_FULL_NAT,
        service_id: 0,
        backend_id: 0,
    };
    match conntrack::create_snat::<F>(flow, &mut new, (config.snat_port_min, config.snat_port_max), now) {
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
    *to = Tuple { src: new.nat_src, dst: new.nat_dst };
    apply::<F>(ctx, flow, to, false)
}
