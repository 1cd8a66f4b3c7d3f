//! Connection tracking for load-balanced flows: two entries per flow (`ct_v4` / `ct_v6`), one per
//! direction, each keyed by the 5-tuple as its packets arrive and holding the tuple they become.
use aya_ebpf::{bindings::BPF_NOEXIST, helpers::bpf_get_prandom_u32};
use kube_router_common::*;

use crate::{
    family::Family,
    maps::CtScratch,
    maps::{count, ct_lifetimes},
    parsing::{LbFlow, TCP_FLAG_ACK, TCP_FLAG_FIN, TCP_FLAG_RST, TCP_FLAG_SYN},
    plain,
};

const REFRESH_INTERVAL_NS: u64 = 1_000_000_000;

/// Ports tried for a new source-NATed flow before it is refused. Random probes, so a range that
/// is mostly free almost always succeeds on the first try.
const SNAT_PORT_TRIES: u32 = 16;
/// Used before the agent has written `lb_config` (hairpin must work from the first packet).
pub const DEFAULT_SNAT_PORT_MIN: u16 = 10_000;
pub const DEFAULT_SNAT_PORT_MAX: u16 = 29_999;

#[inline(always)]
pub fn key<A>(src: (A, u16), dst: (A, u16), proto: u8) -> CtKey<A> {
    CtKey { src_addr: src.0, dst_addr: dst.0, src_port: src.1, dst_port: dst.1, proto, pad: [0; 3] }
}

#[inline(always)]
pub fn key_of<A: Copy>(flow: &LbFlow<A>) -> CtKey<A> {
    key((flow.src_addr, flow.src_port), (flow.dst_addr, flow.dst_port), flow.proto)
}

/// The entry's last packet is longer ago than its lifetime (`ct_cfg`'s, else the built-in one).
// Not inlined: a leaf with no frame of its own, so reading `ct_cfg` keeps no value of the
// caller's in a stack slot.
#[inline(never)]
fn expired<A: Copy>(entry: &CtValue<A>, proto: u8, now: u64) -> bool {
    now.saturating_sub(entry.last_seen_ns) > entry.lifetime_ns(proto, ct_lifetimes())
}

/// A live entry for `key`, refreshed; `None` if absent or expired.
// Not inlined: `ingress` -> `new_flow` use the whole 512-byte stack (each frame rounded up to
// 32 bytes), and the call to `expired` inlined here would spill one more of `ingress`'s values.
#[inline(never)]
pub fn lookup<F: Family>(key: &CtKey<F::Addr>, tcp_flags: u8, now: u64) -> Option<&'static mut CtValue<F::Addr>> {
    let entry = F::conntrack().get_ptr_mut(key)?;
    // SAFETY: the pointer comes from a successful map lookup and stays valid for this program run.
    let entry = unsafe { &mut *entry };
    if expired(entry, key.proto, now) {
        return None;
    }
    if tcp_flags & (TCP_FLAG_FIN | TCP_FLAG_RST) != 0 {
        entry.flags |= CT_FLAG_CLOSING;
    }
    // A direct-server-return tunnel's entry: no reply passes this node. The client's ACK (it got
    // the SYN-ACK) tells the connection is answered, so it lives the TCP lifetime.
    if tcp_flags & (TCP_FLAG_SYN | TCP_FLAG_ACK) == TCP_FLAG_ACK
        && entry.flags & (CT_FLAG_DSR_ENCAP | CT_FLAG_SEEN_REPLY) == CT_FLAG_DSR_ENCAP
    {
        entry.flags |= CT_FLAG_SEEN_REPLY;
    }
    // Refresh at most once a second so a busy flow does not write the shared entry per packet.
    if now.saturating_sub(entry.last_seen_ns) > REFRESH_INTERVAL_NS {
        entry.last_seen_ns = now;
    }
    Some(entry)
}

/// Marks the flow as answered, on the entry that was hit and on its opposite (once per flow), by
/// a reply packet `flow`. A TCP reply with SYN (a SYN-ACK) does not count: a backend answers a
/// flood of spoofed SYNs too, and those flows must keep the short unreplied lifetime. The
/// backend's next segment (it got the client's ACK) does.
#[inline(always)]
pub fn mark_seen_reply<F: Family>(entry: &mut CtValue<F::Addr>, flow: &LbFlow<F::Addr>) {
    if entry.flags & CT_FLAG_SEEN_REPLY != 0 || (flow.proto == IPPROTO_TCP && flow.tcp_flags & TCP_FLAG_SYN != 0) {
        return;
    }
    entry.flags |= CT_FLAG_SEEN_REPLY;
    if let Some(forward) = F::conntrack().get_ptr_mut(entry.reverse_key(flow.proto)) {
        // SAFETY: pointer from a successful lookup, valid for this run.
        unsafe { (*forward).flags |= CT_FLAG_SEEN_REPLY };
    }
}

/// A TCP connection that is no Service's flow opens (a SYN without ACK) on a tuple whose replies
/// match the reverse entry of an earlier Service flow: the client's kernel reused that flow's
/// source port towards the backend itself, which it may (ports are unique per peer, and the
/// earlier flow's peer is the frontend). Left alone, the new connection's replies would be
/// rewritten to come from the frontend and it would never open. A closed (or expired) earlier
/// flow gives its tuple up. An open one keeps it, counted: both connections have the same tuple
/// at the backend, and telling their replies apart would need a source port rewrite translated
/// back at the client's own interface, which these programs cannot tell from the bridge's.
// Not inlined: its keys would not fit on the caller's stack beside a new flow's.
#[inline(never)]
pub fn release_reply_tuple<F: Family>(flow: &LbFlow<F::Addr>, now: u64) {
    if flow.proto != IPPROTO_TCP || flow.tcp_flags & (TCP_FLAG_SYN | TCP_FLAG_ACK) != TCP_FLAG_SYN {
        return;
    }
    let reply = key((flow.dst_addr, flow.dst_port), (flow.src_addr, flow.src_port), flow.proto);
    let Some(entry) = F::conntrack().get_ptr_mut(reply) else {
        return;
    };
    // SAFETY: pointer from a successful lookup, valid for this run.
    let entry = unsafe { &*entry };
    // Only replies translated towards a client keeping its own address (a source-NATed flow's
    // reply goes to a node address and a port from the SNAT range, which no kernel picks), and
    // only of an answered flow: an unanswered one's SYN, already translated by an earlier hook
    // on this node (pod interface, then bridge), is that flow's own packet, not a new one.
    if entry.flags & (CT_FLAG_REVERSE | CT_FLAG_FULL_NAT | CT_FLAG_SEEN_REPLY) != CT_FLAG_REVERSE | CT_FLAG_SEEN_REPLY {
        return;
    }
    // SAFETY: read-only use of a map value within this run.
    let forward_closing = match unsafe { F::conntrack().get(entry.reverse_key(flow.proto)) } {
        Some(forward) => forward.flags & CT_FLAG_CLOSING != 0,
        None => true,
    };
    if expired(entry, flow.proto, now) || forward_closing || entry.flags & CT_FLAG_CLOSING != 0 {
        forget::<F>(&reply, entry);
        count(lb_stat::CT_TUPLE_REUSED);
    } else {
        count(lb_stat::CT_TUPLE_CLASH);
    }
}

/// Removes a flow's two entries, given one of them.
#[inline(always)]
pub fn forget<F: Family>(key: &CtKey<F::Addr>, entry: &CtValue<F::Addr>) {
    let _ = F::conntrack().remove(entry.reverse_key(key.proto));
    let _ = F::conntrack().remove(key);
}

/// What a new flow's forward packets become, and how each direction is handled.
pub struct NewFlow<A> {
    pub nat_src: (A, u16),
    pub nat_dst: (A, u16),
    pub forward_flags: u16,
    pub reverse_flags: u16,
    pub service_id: u32,
    pub backend_id: u32,
}

/// Fills the family's scratch entries (per-CPU map memory: IPv6 entries are too big for the BPF
/// stack next to everything else) with the flow's two entries and their keys.
#[inline(always)]
fn entries<F: Family>(
    flow: &LbFlow<F::Addr>,
    new: &NewFlow<F::Addr>,
    now: u64,
) -> Option<&'static mut CtScratch<F::Addr>> {
    let scratch = F::ct_scratch().get_ptr_mut(0)?;
    // SAFETY: per-CPU map memory, used only within this program run on this CPU.
    let scratch = unsafe { &mut *scratch };
    scratch.forward = CtValue {
        last_seen_ns: now,
        nat_src_addr: new.nat_src.0,
        nat_dst_addr: new.nat_dst.0,
        nat_src_port: new.nat_src.1,
        nat_dst_port: new.nat_dst.1,
        flags: CT_FLAG_FORWARD | new.forward_flags,
        pad: 0,
        service_id: new.service_id,
        backend_id: new.backend_id,
    };
    scratch.reverse = CtValue {
        last_seen_ns: now,
        nat_src_addr: flow.dst_addr,
        nat_dst_addr: flow.src_addr,
        nat_src_port: flow.dst_port,
        nat_dst_port: flow.src_port,
        flags: CT_FLAG_REVERSE | new.reverse_flags,
        pad: 0,
        service_id: new.service_id,
        backend_id: new.backend_id,
    };
    scratch.forward_key = key_of(flow);
    scratch.reverse_key = scratch.forward.reverse_key(flow.proto);
    Some(scratch)
}

/// Records a Service flow's frontend (the forward key's destination) and backend (the reverse
/// key's source) in `ct_gate_v4/v6`, before its entries: from then on the gate sends every
/// packet of the flow, either way, to the conntrack lookup (see `gate`). One lookup each for an
/// endpoint already recorded.
// Inlined, the keys built in map memory: a frame of its own would exceed the 512-byte stack
// under DSR's `deliver` for IPv6.
#[allow(clippy::needless_borrows_for_generic_args)] // keys by reference: see `create`
#[inline(always)]
pub fn record_endpoints<F: Family>(flow: &LbFlow<F::Addr>, backend: &(F::Addr, u16), now: u64) -> Result<(), i64> {
    let scratch = F::ct_scratch().get_ptr_mut(0).ok_or(-1i64)?;
    // SAFETY: per-CPU map memory, used only within this program run on this CPU.
    let endpoint = unsafe { &mut (*scratch).endpoint };
    let gate = F::ct_gate();
    *endpoint = ServiceKey { addr: flow.dst_addr, port: flow.dst_port, proto: flow.proto, pad: 0 };
    let mut recorded = false;
    if gate.get_ptr(&*endpoint).is_none() {
        gate.insert(&*endpoint, &now, 0)?;
        recorded = true;
    }
    *endpoint = ServiceKey { addr: backend.0, port: backend.1, proto: flow.proto, pad: 0 };
    if gate.get_ptr(&*endpoint).is_none() {
        gate.insert(&*endpoint, &now, 0)?;
        recorded = true;
    }
    // A tuple of either endpoint's remembered as plain traffic is not any more (`plain`).
    if recorded {
        plain::forget_all(now);
    }
    Ok(())
}

/// Records a new Service flow. The reverse entry goes in first: once the forward entry exists,
/// replies must already be translatable.
// By reference on purpose: by value would copy the scratch entries back onto the stack.
#[allow(clippy::needless_borrows_for_generic_args)]
#[inline(always)]
pub fn create<F: Family>(flow: &LbFlow<F::Addr>, new: &NewFlow<F::Addr>, now: u64) -> Result<(), i64> {
    record_endpoints::<F>(flow, &new.nat_dst, now)?;
    let s = entries::<F>(flow, new, now).ok_or(-1i64)?;
    F::conntrack().insert(&s.reverse_key, &s.reverse, 0).map_err(|e| e as i64)?;
    F::conntrack().insert(&s.forward_key, &s.forward, 0).map_err(|e| e as i64)
}

/// Records a flow's forward entry only: one whose replies never pass this node (direct server
/// return's tunnel).
#[allow(clippy::needless_borrows_for_generic_args)] // see `create`
#[inline(always)]
pub fn create_forward<F: Family>(flow: &LbFlow<F::Addr>, new: &NewFlow<F::Addr>, now: u64) -> Result<(), i64> {
    record_endpoints::<F>(flow, &new.nat_dst, now)?;
    let s = entries::<F>(flow, new, now).ok_or(-1i64)?;
    F::conntrack().insert(&s.forward_key, &s.forward, 0).map_err(|e| e as i64)
}

/// Records a flow an outside client opens to a pod's own address (no Service) while pod egress
/// masquerade is on: a pair of entries that leave its packets as they are
/// (`CT_FLAG_UNTRANSLATED`), so the pod's replies are known as replies, not new flows to
/// masquerade. A live entry of another flow holding the reply's tuple is never taken over (an
/// expired one gives it up); the reply then finds that flow's entry, as it would without this.
#[allow(clippy::needless_borrows_for_generic_args)] // see `create`
#[inline(always)]
pub fn create_untranslated<F: Family>(flow: &LbFlow<F::Addr>, now: u64) {
    // Written straight into the scratch entries: a `NewFlow` on this frame would not fit beside
    // `ingress`'s in 512 bytes.
    let Some(s) = F::ct_scratch().get_ptr_mut(0) else {
        return;
    };
    // SAFETY: per-CPU map memory, used only within this program run on this CPU.
    let s = unsafe { &mut *s };
    s.forward = CtValue {
        last_seen_ns: now,
        nat_src_addr: flow.src_addr,
        nat_dst_addr: flow.dst_addr,
        nat_src_port: flow.src_port,
        nat_dst_port: flow.dst_port,
        flags: CT_FLAG_FORWARD | CT_FLAG_UNTRANSLATED,
        pad: 0,
        service_id: 0,
        backend_id: 0,
    };
    s.reverse = CtValue {
        last_seen_ns: now,
        nat_src_addr: flow.dst_addr,
        nat_dst_addr: flow.src_addr,
        nat_src_port: flow.dst_port,
        nat_dst_port: flow.src_port,
        flags: CT_FLAG_REVERSE | CT_FLAG_UNTRANSLATED,
        pad: 0,
        service_id: 0,
        backend_id: 0,
    };
    s.forward_key = key_of(flow);
    s.reverse_key = s.forward.reverse_key(flow.proto);
    let reply_tuple_ours = F::conntrack().insert(&s.reverse_key, &s.reverse, BPF_NOEXIST as u64).is_ok()
        || (reclaim_stale::<F>(s, now)
            && F::conntrack().insert(&s.reverse_key, &s.reverse, BPF_NOEXIST as u64).is_ok());
    if !reply_tuple_ours || F::conntrack().insert(&s.forward_key, &s.forward, 0).is_err() {
        count(lb_stat::CT_INSERT_FAILED);
    }
}

pub enum SnatError {
    /// Every port tried is in use towards this destination: the flow is refused.
    PortsExhausted,
    Insert,
}

/// Records a new source-NATed flow, choosing a source port from `ports` that no other flow to
/// the same destination uses (the reverse key must be unique). `new.nat_src.1` is ignored.
#[allow(clippy::needless_borrows_for_generic_args)] // see `create`
#[inline(always)]
pub fn create_snat<F: Family>(
    flow: &LbFlow<F::Addr>,
    new: &mut NewFlow<F::Addr>,
    ports: (u16, u16),
    now: u64,
) -> Result<(), SnatError> {
    let (min, max) =
        if ports.0 == 0 || ports.1 < ports.0 { (DEFAULT_SNAT_PORT_MIN, DEFAULT_SNAT_PORT_MAX) } else { ports };
    let range = (max - min) as u32 + 1;
    let start = unsafe { bpf_get_prandom_u32() };
    let echo = flow.proto == IPPROTO_ICMP || flow.proto == IPPROTO_ICMPV6;
    for attempt in 0..SNAT_PORT_TRIES {
        let port = min + (start.wrapping_add(attempt.wrapping_mul(7919)) % range) as u16;
        new.nat_src.1 = port.to_be();
        if echo {
            // An echo's one identifier is both "ports": the reply must carry the new one back.
            new.nat_dst.1 = new.nat_src.1;
        }
        let s = entries::<F>(flow, new, now).ok_or(SnatError::Insert)?;
        // NOEXIST: the port is ours only if no live flow holds this reverse key. A flow that is
        // over but not yet collected by the agent gives it up first.
        let free = F::conntrack().insert(&s.reverse_key, &s.reverse, BPF_NOEXIST as u64).is_ok()
            || (reclaim_stale::<F>(s, now)
                && F::conntrack().insert(&s.reverse_key, &s.reverse, BPF_NOEXIST as u64).is_ok());
        if free {
            return F::conntrack().insert(&s.forward_key, &s.forward, 0).map_err(|_| SnatError::Insert);
        }
    }
    Err(SnatError::PortsExhausted)
}

/// Removes the flow holding the reverse key a new source-NATed flow wants (the scratch's
/// `reverse_key`) if it is over: both its entries idle past their lifetime, or past the closing
/// lifetime once either saw a FIN or RST (a reset flow's other side never closes its entry,
/// which would hold the port for the TCP lifetime). Both entries go, so no entry is left
/// translating to a port that now belongs to another flow. True if the key is free now.
// Inlined, with the old flow's other key and the lifetimes in map memory (the caller's scratch):
// `ingress` -> `new_flow` already uses the whole 512-byte stack, so this adds no frame and no
// key to it.
#[allow(clippy::needless_borrows_for_generic_args)] // keys by reference: see `create`
#[inline(always)]
fn reclaim_stale<F: Family>(s: &mut CtScratch<F::Addr>, now: u64) -> bool {
    // Copied into the scratch: no register holds it across the lookups below.
    s.lifetimes = match ct_lifetimes() {
        Some(lifetimes) => *lifetimes,
        None => CtLifetimes { tcp_secs: 0, closing_secs: 0, udp_secs: 0, pad: 0 },
    };
    let proto = s.reverse_key.proto;
    let Some(held) = F::conntrack().get_ptr(&s.reverse_key) else {
        // Gone since the insert failed (collected, evicted): free.
        return true;
    };
    // SAFETY: pointer from a successful lookup, valid for this run; read only.
    let held = unsafe { &*held };
    s.stale_key = held.reverse_key(proto);
    // SAFETY: as above.
    let opposite = F::conntrack().get_ptr(&s.stale_key).map(|p| unsafe { &*p });
    let closing = held.flags & CT_FLAG_CLOSING != 0 || opposite.is_some_and(|o| o.flags & CT_FLAG_CLOSING != 0);
    let lifetime = if closing {
        CtLifetimes::closing_secs_of(Some(&s.lifetimes)) * 1_000_000_000
    } else {
        held.lifetime_ns(proto, Some(&s.lifetimes))
    };
    // An absent opposite entry (evicted, collected) leaves the held one to decide alone. A new
    // flow's reverse entry is never judged without its forward one: it is fresh.
    if now.saturating_sub(held.last_seen_ns) <= lifetime
        || opposite.is_some_and(|o| now.saturating_sub(o.last_seen_ns) <= lifetime)
    {
        return false;
    }
    let _ = F::conntrack().remove(&s.stale_key);
    let _ = F::conntrack().remove(&s.reverse_key);
    true
}
