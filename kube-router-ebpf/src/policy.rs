//! NetworkPolicy enforcement on the host side of pod veths.
//!
//! On the host end of a pod's veth, TC **ingress** sees packets *from* the pod, so it enforces
//! the pod's **egress** policy (peer = destination); TC **egress** sees packets *to* the pod and
//! enforces its **ingress** policy (peer = source). Each hook checks only the side of the pod it
//! is attached to; the other end of the connection is checked at that pod's own veth (on this or
//! another node), so a pod-to-pod connection on one node passes both checks.
//!
//! IPv4 and IPv6 are judged alike, each over its own maps (`pol_pods_v4/v6`, `pol_peers_v4/v6`,
//! `pol_ct_v4/v6`; `pol_ports` is shared). A new flow is judged with two LPM lookups, whatever
//! the pod's number of policies, rules, peers and ports: its slot's entry for the protocol and
//! port names the one peer set those ports admit, and the peer is looked up in it.
//!
//! Replies are never judged: an allowed new flow is recorded in `pol_ct_v4` under a key
//! normalised to the local pod (pod, peer, pod port, peer port), which the reply — seen by the
//! other hook of the same veth — looks up identically.
use aya_ebpf::{
    bindings::{TC_ACT_SHOT, TC_ACT_UNSPEC},
    helpers::bpf_ktime_get_ns,
    maps::{lpm_trie::Key, LruHashMap},
    programs::TcContext,
};
use kube_router_common::*;

use crate::{
    events,
    maps::{
        count_policy as count, CONNTRACK, CONNTRACK_V6, POLICY_CONNTRACK, POLICY_CONNTRACK_V6, POLICY_PEERS,
        POLICY_PEERS_V6, POLICY_PODS, POLICY_PODS_V6, POLICY_PORTS,
    },
    parsing::{parse_for_policy, parse_for_policy_v6, Flow, Parsed, TCP_FLAG_FIN, TCP_FLAG_RST},
};

const REFRESH_INTERVAL_NS: u64 = 1_000_000_000;
const ETH_P_IPV6: u16 = 0x86dd;

/// Which end of the pod's veth the program is attached to.
#[derive(Clone, Copy)]
pub enum VethHook {
    /// TC ingress of the host-side veth: the packet comes from the pod.
    FromPod,
    /// TC egress of the host-side veth: the packet goes to the pod.
    ToPod,
}

enum Verdict {
    Allow,
    /// The peer is outside the set the ports admit.
    Deny,
    /// No rule admits the protocol and port.
    NoPortMatch,
}

/// The per-family maps and keys of the policy check; the logic in [`judge`] is written once.
trait PolicyFamily {
    type Addr: Copy;
    type CtKey: Copy + 'static;
    const FAMILY: u8;
    fn ct_key(pod: Self::Addr, peer: Self::Addr, pod_port: u16, peer_port: u16, proto: u8) -> Self::CtKey;
    fn conntrack() -> &'static LruHashMap<Self::CtKey, PolicyCtValue>;
    fn isolated(addr: Self::Addr, direction: u8) -> Option<PolicyPodValue>;
    fn peer_in_set(peer_set: u32, addr: Self::Addr) -> bool;
    /// Whether the load balancer holds the forward entry of a flow the pod opened to this peer
    /// (a Service address): only flows the pod itself started have one.
    fn opened_through_a_service(pod: Self::Addr, peer: Self::Addr, pod_port: u16, peer_port: u16, proto: u8) -> bool;
    fn event_addr(addr: Self::Addr) -> [u32; 4];
}

struct V4;
struct V6;

impl PolicyFamily for V4 {
    type Addr = u32;
    type CtKey = PolicyCtKeyV4;
    const FAMILY: u8 = 4;

    #[inline(always)]
    fn ct_key(pod_addr: u32, peer_addr: u32, pod_port: u16, peer_port: u16, proto: u8) -> PolicyCtKeyV4 {
        PolicyCtKeyV4 { pod_addr, peer_addr, pod_port, peer_port, proto, pad: [0; 3] }
    }
    #[inline(always)]
    fn conntrack() -> &'static LruHashMap<PolicyCtKeyV4, PolicyCtValue> {
        &POLICY_CONNTRACK
    }
    #[inline(always)]
    fn isolated(addr: u32, direction: u8) -> Option<PolicyPodValue> {
        // SAFETY: read-only copy of a map value.
        unsafe { POLICY_PODS.get(PolicyPodKeyV4 { addr, direction, pad: [0; 3] }) }.copied()
    }
    #[inline(always)]
    fn peer_in_set(peer_set: u32, addr: u32) -> bool {
        let key = Key::new(PEER_SET_PREFIX_BITS + 32, PeerPrefixV4 { peer_set_be: peer_set.to_be(), addr });
        matches!(POLICY_PEERS.get(&key), Some(verdict) if *verdict == PEER_ALLOW)
    }
    #[inline(always)]
    fn opened_through_a_service(pod: u32, peer: u32, pod_port: u16, peer_port: u16, proto: u8) -> bool {
        let forward =
            CtKeyV4 { src_addr: pod, dst_addr: peer, src_port: pod_port, dst_port: peer_port, proto, pad: [0; 3] };
        // SAFETY: read-only copy of a map value.
        unsafe { CONNTRACK.get(forward) }.is_some_and(|entry| entry.flags & CT_FLAG_FORWARD != 0)
    }
    #[inline(always)]
    fn event_addr(addr: u32) -> [u32; 4] {
        [addr, 0, 0, 0]
    }
}

impl PolicyFamily for V6 {
    type Addr = Ipv6Words;
    type CtKey = PolicyCtKeyV6;
    const FAMILY: u8 = 6;

    #[inline(always)]
    fn ct_key(pod_addr: Ipv6Words, peer_addr: Ipv6Words, pod_port: u16, peer_port: u16, proto: u8) -> PolicyCtKeyV6 {
        PolicyCtKeyV6 { pod_addr, peer_addr, pod_port, peer_port, proto, pad: [0; 3] }
    }
    #[inline(always)]
    fn conntrack() -> &'static LruHashMap<PolicyCtKeyV6, PolicyCtValue> {
        &POLICY_CONNTRACK_V6
    }
    #[inline(always)]
    fn isolated(addr: Ipv6Words, direction: u8) -> Option<PolicyPodValue> {
        // SAFETY: read-only copy of a map value.
        unsafe { POLICY_PODS_V6.get(PolicyPodKeyV6 { addr, direction, pad: [0; 3] }) }.copied()
    }
    #[inline(always)]
    fn peer_in_set(peer_set: u32, addr: Ipv6Words) -> bool {
        let key = Key::new(PEER_SET_PREFIX_BITS + 128, PeerPrefixV6 { peer_set_be: peer_set.to_be(), addr });
        matches!(POLICY_PEERS_V6.get(&key), Some(verdict) if *verdict == PEER_ALLOW)
    }
    #[inline(always)]
    fn opened_through_a_service(pod: Ipv6Words, peer: Ipv6Words, pod_port: u16, peer_port: u16, proto: u8) -> bool {
        let forward =
            CtKeyV6 { src_addr: pod, dst_addr: peer, src_port: pod_port, dst_port: peer_port, proto, pad: [0; 3] };
        // SAFETY: read-only copy of a map value.
        unsafe { CONNTRACK_V6.get(forward) }.is_some_and(|entry| entry.flags & CT_FLAG_FORWARD != 0)
    }
    #[inline(always)]
    fn event_addr(addr: Ipv6Words) -> [u32; 4] {
        addr.0
    }
}

#[inline(always)]
pub fn enforce(ctx: &TcContext, hook: VethHook) -> Result<i32, i64> {
    count(pol_stat::PACKETS);
    let ether_type = u16::from_be(ctx.load::<u16>(12)?);
    if ether_type == ETH_P_IPV6 {
        return match parse_for_policy_v6(ctx)? {
            Parsed::Flow(flow) => judge::<V6>(ctx, hook, &flow),
            parsed => Ok(pass_unjudged(parsed)),
        };
    }
    match parse_for_policy(ctx)? {
        Parsed::Flow(flow) => judge::<V4>(ctx, hook, &flow),
        parsed => Ok(pass_unjudged(parsed)),
    }
}

#[inline(always)]
fn pass_unjudged<A>(parsed: Parsed<A>) -> i32 {
    count(if matches!(parsed, Parsed::Fragment) { pol_stat::FRAGMENT_PASS } else { pol_stat::NOT_EVALUATED });
    TC_ACT_UNSPEC
}

#[inline(always)]
fn judge<F: PolicyFamily>(ctx: &TcContext, hook: VethHook, flow: &Flow<F::Addr>) -> Result<i32, i64> {
    let (pod_addr, peer_addr, pod_port, peer_port, direction, origin, denied) = match hook {
        VethHook::FromPod => (
            flow.src_addr,
            flow.dst_addr,
            flow.src_port,
            flow.dst_port,
            POLICY_DIR_EGRESS,
            POLICY_CT_FROM_POD,
            pol_stat::DENIED_EGRESS,
        ),
        VethHook::ToPod => (
            flow.dst_addr,
            flow.src_addr,
            flow.dst_port,
            flow.src_port,
            POLICY_DIR_INGRESS,
            POLICY_CT_TO_POD,
            pol_stat::DENIED_INGRESS,
        ),
    };
    let ct_key = F::ct_key(pod_addr, peer_addr, pod_port, peer_port, flow.proto);
    let now = unsafe { bpf_ktime_get_ns() };
    let closing = flow.tcp_flags & (TCP_FLAG_FIN | TCP_FLAG_RST) != 0;
    if established(F::conntrack(), &ct_key, flow.proto, closing, now) {
        count(pol_stat::CT_ESTABLISHED);
        return Ok(TC_ACT_UNSPEC);
    }
    // A reply to a Service flow the pod opened, already translated back to the Service address
    // before this hook (by the load balancer on a bridge the veth is a port of): the policy entry
    // was recorded under the backend's address, the load balancer's under the Service's.
    if matches!(hook, VethHook::ToPod)
        && F::opened_through_a_service(pod_addr, peer_addr, pod_port, peer_port, flow.proto)
    {
        count(pol_stat::CT_ESTABLISHED);
        let entry = PolicyCtValue { last_seen_ns: now, flags: POLICY_CT_FROM_POD, pad: [0; 7] };
        let _ = F::conntrack().insert(ct_key, entry, 0);
        return Ok(TC_ACT_UNSPEC);
    }

    // A new connection: its destination port is this packet's, whichever hook sees it.
    match F::isolated(pod_addr, direction) {
        _ if matches!(hook, VethHook::ToPod) && sent_by_this_node(ctx) => count(pol_stat::NODE_EXEMPT),
        None => count(pol_stat::NOT_ISOLATED),
        Some(pod) => match evaluate::<F>(&pod, peer_addr, flow.proto, u16::from_be(flow.dst_port)) {
            Verdict::Allow => count(pol_stat::ALLOWED),
            Verdict::Deny => {
                count(denied);
                report_drop::<F>(ctx, flow, direction, now);
                return Ok(TC_ACT_SHOT);
            }
            Verdict::NoPortMatch => {
                count(pol_stat::NO_PORT_MATCH);
                count(denied);
                report_drop::<F>(ctx, flow, direction, now);
                return Ok(TC_ACT_SHOT);
            }
        },
    }
    // Tracked even when not isolated: the reply is judged by the *other* direction of this pod,
    // which may be isolated (or become so while the connection lives).
    let flags = origin | if closing { POLICY_CT_CLOSING } else { 0 };
    let entry = PolicyCtValue { last_seen_ns: now, flags, pad: [0; 7] };
    if F::conntrack().insert(ct_key, entry, 0).is_err() {
        count(pol_stat::CT_INSERT_FAILED);
    }
    Ok(TC_ACT_UNSPEC)
}

/// The packet was sent by this node's own stack (a host process, kubelet, a hostNetwork pod):
/// it never arrived on an interface, so the kernel left its input interface at 0. Forwarded
/// packets (other pods, other nodes, Service traffic from outside) all carry one.
#[inline(always)]
fn sent_by_this_node(ctx: &TcContext) -> bool {
    // SAFETY: reading a field of the context the program was called with.
    unsafe { (*ctx.skb.skb).ingress_ifindex == 0 }
}

/// A live entry for this connection at this pod, refreshed; expired entries count as absent.
#[inline(always)]
fn established<K>(conntrack: &LruHashMap<K, PolicyCtValue>, key: &K, proto: u8, closing: bool, now: u64) -> bool {
    let Some(entry) = conntrack.get_ptr_mut(key) else {
        return false;
    };
    // SAFETY: the pointer comes from a successful lookup and stays valid for this program run.
    let entry = unsafe { &mut *entry };
    if now.saturating_sub(entry.last_seen_ns) > entry.lifetime_ns(proto) {
        return false;
    }
    if closing {
        entry.flags |= POLICY_CT_CLOSING;
    }
    // Refresh at most once a second so a busy flow does not write the shared entry per packet.
    if now.saturating_sub(entry.last_seen_ns) > REFRESH_INTERVAL_NS {
        entry.last_seen_ns = now;
    }
    true
}

/// The reference lookup of `MapEntries::side_allows`: the longest `pol_ports` entry of the slot
/// for the protocol and destination port names the peers admitted there.
#[inline(always)]
fn evaluate<F: PolicyFamily>(pod: &PolicyPodValue, peer_addr: F::Addr, proto: u8, dst_port: u16) -> Verdict {
    let key = Key::new(
        POLICY_PORT_FULL_BITS,
        PolicyPortKey { slot_be: pod.slot.to_be(), proto, port: dst_port.to_be_bytes(), pad: 0 },
    );
    match POLICY_PORTS.get(&key) {
        None => Verdict::NoPortMatch,
        Some(ports) if F::peer_in_set(ports.peer_set, peer_addr) => Verdict::Allow,
        Some(_) => Verdict::Deny,
    }
}

/// A drop for `kube-router monitor` (nothing unless one listens).
#[inline(always)]
fn report_drop<F: PolicyFamily>(ctx: &TcContext, flow: &Flow<F::Addr>, direction: u8, now: u64) {
    events::emit(ctx, now, |ifindex| MonitorEvent {
        timestamp_ns: now,
        kind: EVENT_POLICY_DROP,
        family: F::FAMILY,
        proto: flow.proto,
        direction,
        ifindex,
        src: F::event_addr(flow.src_addr),
        dst: F::event_addr(flow.dst_addr),
        nat: [0; 4],
        src_port: flow.src_port,
        dst_port: flow.dst_port,
        nat_port: 0,
        pad: 0,
    });
}
