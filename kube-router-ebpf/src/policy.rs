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
//! other hook of the same veth — looks up identically. Until that reply comes, the entry lives
//! a minute (`POLICY_CT_UNREPLIED`).
//!
//! Only pods a policy isolates are tracked: a pod with no `pol_pods_v4/v6` entry in either
//! direction passes with no conntrack lookup and no entry (the gate, [`judged`], which reads the pod's
//! address straight from the IP header and nothing after it: such a pod admits every packet, so
//! there is nothing to parse for). A pod isolated in one direction is tracked in both, its reply
//! being judged by the other. `POLICY_CT_TRACK_ALL` in `pol_cfg` tracks (and parses) every pod,
//! as before the gate.
//!
//! Fails closed: every IP protocol is judged (those without ports only by rules without ports),
//! ICMP errors pass only for a live connection they quote or as ICMP, frames of any ethertype
//! but IPv4, IPv6 and ARP (VLAN tags included) and IP headers of the wrong version are dropped
//! on every pod veth, packets whose headers past the addresses cannot be read at an isolated
//! pod's hooks (`pol_guard_stats`).
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
        count_policy as count, count_policy_guard as count_guard, CONNTRACK, CONNTRACK_V6, POLICY_CONFIG,
        POLICY_CONNTRACK, POLICY_CONNTRACK_V6, POLICY_PEERS, POLICY_PEERS_V6, POLICY_PODS, POLICY_PODS_V6,
        POLICY_PORTS,
    },
    packet,
    parsing::{
        parse_for_policy, parse_for_policy_v6, Flow, Parsed, Quoted, ETH_HDR_LEN, IPV6_DST_OFF, IPV6_SRC_OFF,
        TCP_FLAG_FIN, TCP_FLAG_RST,
    },
    plain, source_check,
};

const REFRESH_INTERVAL_NS: u64 = 1_000_000_000;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_ARP: u16 = 0x0806;
const ETH_P_IPV6: u16 = 0x86dd;
const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88a8;

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
    /// The pod's address at this hook read straight from the IP header (the source of a packet
    /// from the pod, the destination of one to it), before the rest is parsed; `None` if the
    /// header is not this family's (the full parse then drops it).
    fn pod_addr(ctx: &TcContext, hook: VethHook) -> Result<Option<Self::Addr>, i64>;
    /// The policy's view of the packet (`parse_for_policy`, `parse_for_policy_v6`).
    fn parse(ctx: &TcContext) -> Result<Parsed<Self::Addr>, i64>;
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
    fn parse(ctx: &TcContext) -> Result<Parsed, i64> {
        parse_for_policy(ctx)
    }
    #[inline(always)]
    fn pod_addr(ctx: &TcContext, hook: VethHook) -> Result<Option<u32>, i64> {
        // The whole fixed header in one read: version, header length and both addresses.
        let header = packet::load::<[u32; 5]>(ctx, ETH_HDR_LEN)?;
        let version_ihl = header[0].to_ne_bytes()[0];
        if version_ihl >> 4 != 4 || version_ihl & 0x0f < 5 {
            return Ok(None);
        }
        Ok(Some(match hook {
            VethHook::FromPod => header[3],
            VethHook::ToPod => header[4],
        }))
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
    fn parse(ctx: &TcContext) -> Result<Parsed<Ipv6Words>, i64> {
        parse_for_policy_v6(ctx)
    }
    #[inline(always)]
    fn pod_addr(ctx: &TcContext, hook: VethHook) -> Result<Option<Ipv6Words>, i64> {
        if packet::load::<u8>(ctx, ETH_HDR_LEN)? >> 4 != 6 {
            return Ok(None);
        }
        let offset = match hook {
            VethHook::FromPod => IPV6_SRC_OFF,
            VethHook::ToPod => IPV6_DST_OFF,
        };
        Ok(Some(packet::load(ctx, offset)?))
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
    let ether_type = u16::from_be(packet::load::<u16>(ctx, 12)?);
    // A tag the kernel already took off into the skb (it does so before TC ingress) leaves the
    // inner ethertype in the frame: a pod sending 802.1ad + 802.1Q tags with VLAN id 0 around
    // IPv4 would otherwise be judged as its inner tag, i.e. not at all, and the receiving pod's
    // stack strips both priority tags and delivers the IPv4 packet.
    // SAFETY: reading a field of the context the program was called with.
    if unsafe { (*ctx.skb.skb).vlan_present } != 0 || ether_type == ETH_P_8021Q || ether_type == ETH_P_8021AD {
        return Ok(drop_frame(ctx, hook, pol_guard_stat::DROP_VLAN, FRAME_DROP_VLAN, ether_type));
    }
    match ether_type {
        ETH_P_IPV6 => enforce_family::<V6>(ctx, hook, ether_type),
        ETH_P_IP => enforce_family::<V4>(ctx, hook, ether_type),
        ETH_P_ARP => {
            count(pol_stat::NOT_EVALUATED);
            Ok(TC_ACT_UNSPEC)
        }
        _ => Ok(drop_frame(ctx, hook, pol_guard_stat::DROP_UNKNOWN_L3, FRAME_DROP_UNKNOWN_L3, ether_type)),
    }
}

/// An IP packet of family `F`: the gate on the pod's address, then the parse and the judgement.
#[inline(always)]
fn enforce_family<F: PolicyFamily>(ctx: &TcContext, hook: VethHook, ether_type: u16) -> Result<i32, i64> {
    if !judged::<F>(ctx, hook)? {
        plain::remember(match hook {
            VethHook::FromPod => plain::POLICY_FROM_POD,
            VethHook::ToPod => plain::POLICY_TO_POD,
        });
        return Ok(pass_untracked(ctx, hook));
    }
    match F::parse(ctx)? {
        Parsed::Flow(flow) => judge::<F>(ctx, hook, &flow),
        parsed => Ok(pass_unjudged(ctx, hook, parsed, ether_type)),
    }
}

/// The verdict on a packet the policy could not read (a header shorter than it claims): dropped.
/// Reached where the pod's address cannot be read (any pod), or past it at an isolated pod's
/// hooks (a pod isolated in neither direction is read no further, [`judged`]); the receiving
/// stack drops such a packet anyway, and a tiny first fragment whose TCP flags are cut off would
/// otherwise pass an isolated pod unjudged, and its later fragments after it.
#[inline(always)]
pub fn malformed(ctx: &TcContext, hook: VethHook) -> i32 {
    let ether_type = ctx.load::<u16>(12).map(u16::from_be).unwrap_or(0);
    drop_frame(ctx, hook, pol_guard_stat::DROP_MALFORMED, FRAME_DROP_MALFORMED, ether_type)
}

#[inline(always)]
fn drop_frame(ctx: &TcContext, hook: VethHook, stat: u32, reason: u8, ether_type: u16) -> i32 {
    count_guard(stat);
    let now = unsafe { bpf_ktime_get_ns() };
    let direction = match hook {
        VethHook::FromPod => POLICY_DIR_EGRESS,
        VethHook::ToPod => POLICY_DIR_INGRESS,
    };
    events::emit(ctx, now, |ifindex| MonitorEvent {
        timestamp_ns: now,
        kind: EVENT_POLICY_FRAME_DROP,
        family: 0,
        proto: reason,
        direction,
        ifindex,
        src: [0; 4],
        dst: [0; 4],
        nat: [0; 4],
        src_port: ether_type.to_be(),
        dst_port: 0,
        nat_port: 0,
        pad: 0,
    });
    TC_ACT_SHOT
}

#[inline(always)]
fn pass_unjudged<A>(ctx: &TcContext, hook: VethHook, parsed: Parsed<A>, ether_type: u16) -> i32 {
    match parsed {
        Parsed::Fragment => count(pol_stat::FRAGMENT_PASS),
        Parsed::LinkControl => count(pol_stat::NOT_EVALUATED),
        // The ethertype names a family whose header this is not.
        _ => return drop_frame(ctx, hook, pol_guard_stat::DROP_MALFORMED, FRAME_DROP_MALFORMED, ether_type),
    }
    TC_ACT_UNSPEC
}

/// The gate, from the pod's address alone: false if the pod is isolated in neither direction.
/// Such a pod is not tracked, and its packets pass whatever an entry would say (an entry only
/// passes, and the pod's sides admit everything): nothing past the address is read, no parse,
/// no conntrack lookup or insert in cold hash chains. True (judged) while every pod is tracked
/// (`POLICY_CT_TRACK_ALL`) or when the header is not the family's (the parse drops it).
// The new-flow verdict looks this side's entry up again rather than take it from here: a value
// carried across the parse is one the verifier cannot follow (an enum the compiler reads
// unconditionally, "R8 !read_ok"), and only an isolated pod's new flows pay the second lookup.
#[inline(always)]
fn judged<F: PolicyFamily>(ctx: &TcContext, hook: VethHook) -> Result<bool, i64> {
    if POLICY_CONFIG.get(0).is_some_and(|flags| *flags & POLICY_CT_TRACK_ALL != 0) {
        return Ok(true);
    }
    let Some(pod_addr) = F::pod_addr(ctx, hook)? else {
        return Ok(true);
    };
    // This hook's side first: the side the hook judges is the one most often isolated alone.
    let (here, other) = match hook {
        VethHook::FromPod => (POLICY_DIR_EGRESS, POLICY_DIR_INGRESS),
        VethHook::ToPod => (POLICY_DIR_INGRESS, POLICY_DIR_EGRESS),
    };
    Ok(F::isolated(pod_addr, here).is_some() || F::isolated(pod_addr, other).is_some())
}

/// A packet the plain-traffic cache knows of a pod isolated in neither direction (`known`: its
/// verdicts): counted and passed as the judgement would have.
#[inline(always)]
pub fn known_plain(ctx: &TcContext, hook: VethHook, known: u32) -> i32 {
    if known & plain::SOURCE_COUNTED_BY_POLICY != 0 && matches!(hook, VethHook::FromPod) {
        source_check::count_passed();
    }
    count(pol_stat::PACKETS);
    pass_untracked(ctx, hook)
}

/// A packet of a pod isolated in neither direction: passed untracked.
#[inline(always)]
fn pass_untracked(ctx: &TcContext, hook: VethHook) -> i32 {
    if matches!(hook, VethHook::ToPod) && sent_by_this_node(ctx) {
        count(pol_stat::NODE_EXEMPT);
    } else {
        count(pol_stat::NOT_ISOLATED);
    }
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
    if established(F::conntrack(), &ct_key, flow.proto, closing, origin, now) {
        count(pol_stat::CT_ESTABLISHED);
        return Ok(TC_ACT_UNSPEC);
    }
    // An ICMP error about a live connection of the pod (fragmentation needed / packet too big
    // keep path MTU discovery working under an isolating policy). Not tracked itself.
    if flow.quoted.proto != 0 && related::<F>(&flow.quoted, hook, now) {
        count_guard(pol_guard_stat::ICMP_ERROR_RELATED);
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
        Some(pod) => match evaluate::<F>(&pod, peer_addr, flow, u16::from_be(flow.dst_port)) {
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
    // Tracked even when this side is not isolated: the reply is judged by the *other* direction
    // of this pod, which is (or, with `POLICY_CT_TRACK_ALL`, may become so while the connection
    // lives).
    let flags = origin | POLICY_CT_UNREPLIED | if closing { POLICY_CT_CLOSING } else { 0 };
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
/// `origin`: the entry flag a packet of this hook would have opened the connection with; an
/// entry opened the other way sees its reply.
#[inline(always)]
fn established<K>(
    conntrack: &LruHashMap<K, PolicyCtValue>,
    key: &K,
    proto: u8,
    closing: bool,
    origin: u8,
    now: u64,
) -> bool {
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
    if entry.flags & POLICY_CT_UNREPLIED != 0 && entry.flags & origin == 0 {
        entry.flags &= !POLICY_CT_UNREPLIED;
    }
    // Refresh at most once a second so a busy flow does not write the shared entry per packet.
    if now.saturating_sub(entry.last_seen_ns) > REFRESH_INTERVAL_NS {
        entry.last_seen_ns = now;
    }
    true
}

/// Whether an ICMP error quotes a live connection of this pod: to the pod, a packet the pod
/// sent; from the pod, a packet it received. Looked up, not refreshed.
#[inline(always)]
fn related<F: PolicyFamily>(quoted: &Quoted<F::Addr>, hook: VethHook, now: u64) -> bool {
    let key = match hook {
        VethHook::ToPod => F::ct_key(quoted.src_addr, quoted.dst_addr, quoted.src_port, quoted.dst_port, quoted.proto),
        VethHook::FromPod => {
            F::ct_key(quoted.dst_addr, quoted.src_addr, quoted.dst_port, quoted.src_port, quoted.proto)
        }
    };
    // SAFETY: read-only copy of a map value.
    unsafe { F::conntrack().get(key) }
        .is_some_and(|entry| now.saturating_sub(entry.last_seen_ns) <= entry.lifetime_ns(quoted.proto))
}

/// The reference lookup of `MapEntries::side_allows`: the longest `pol_ports` entry of the slot
/// for the protocol and destination port names the peers admitted there. A protocol without
/// ports (GRE, IPIP, ICMP errors, ...) has entries only slot-wide, from rules without ports.
#[inline(always)]
fn evaluate<F: PolicyFamily>(pod: &PolicyPodValue, peer_addr: F::Addr, flow: &Flow<F::Addr>, dst_port: u16) -> Verdict {
    let proto = flow.proto;
    if !matches!(proto, IPPROTO_TCP | IPPROTO_UDP | IPPROTO_SCTP | IPPROTO_ICMP | IPPROTO_ICMPV6) {
        count_guard(pol_guard_stat::OTHER_PROTOCOL_JUDGED);
    }
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
