//! Direct server return (`kube-router.io/service.dsr: tunnel`) for ExternalIP and LoadBalancer
//! IP frontends and NodePort frontends (a NodePort's for clients outside the cluster), IPv4
//! (IPIP) and IPv6 (IPv6-in-IPv6), in two halves:
//!
//! * On the node the client's packet reaches (`tunnel`): a flow whose backend is on another node
//!   is not translated. The packet, still client -> frontend, gets an outer IPv4 header (IPIP)
//!   from this node to the backend's own address (the cluster already routes pod addresses to
//!   their node) carrying the backend's port in its IP ID (with DF set the ID means nothing to
//!   reassembly, RFC 6864), and is routed out. Its conntrack entry (`CT_FLAG_DSR_ENCAP`) keeps
//!   the flow's later packets on that backend; there is no reverse entry, no reply comes back.
//! * On the backend's node (`decap` + `deliver`): an IPIP packet from a cluster node to a pod
//!   address, DF set, loses its outer header; its inner packet is translated to the backend the
//!   tunnel named and recorded (`CT_FLAG_DSR_DELIVER`, both directions) so the backend's reply
//!   is restored to come from the frontend at TC egress and leaves straight for the client.
//!   The port is taken from the flow's first packet only: a GSO packet segmented after the
//!   outer header went on carries consecutive IDs in its segments. A NodePort flow's inner
//!   destination is the other node's address, no frontend here: it is admitted by this node's
//!   own NodePort (same port, cluster-wide), and its reply leaves from the other node's address.
//! * IPv6 is the same with an outer IPv6 header (next header 41) from this node's IPv6 address.
//!   IPv6 has no IP ID: the port rides in the outer flow label (20 bits, a 16-bit port fits; the
//!   label is the sender's to choose, RFC 6437, and routers leave it alone). Every segment of a
//!   GSO packet keeps it.
use aya_ebpf::{
    bindings::{
        bpf_adj_room_mode::BPF_ADJ_ROOM_MAC, bpf_fib_lookup as FibLookup, bpf_redir_neigh,
        BPF_F_ADJ_ROOM_DECAP_L3_IPV4, BPF_F_ADJ_ROOM_DECAP_L3_IPV6, BPF_F_ADJ_ROOM_ENCAP_L3_IPV4,
        BPF_F_ADJ_ROOM_ENCAP_L3_IPV6, TC_ACT_SHOT,
    },
    helpers::bpf_ktime_get_ns,
    macros::map,
    maps::PerCpuArray,
    programs::TcContext,
};
use kube_router_common::*;

use crate::{
    conntrack::{self, NewFlow},
    family::{Family, V4, V6},
    icmp::Hook,
    lb,
    maps::{count as count_lb, LB_CONFIG},
    nat::Tuple,
    overlay::{push_outer_ipv4, OuterSpec, IPPROTO_IPIP, IP_DF, IP_HDR_LEN, OUTER_TTL},
    packet,
    parsing::{
        ETH_HDR_LEN, IPV6_DST_OFF, IPV6_HDR_LEN, IPV6_PAYLOAD_LEN_OFF, IPV6_SRC_OFF, IP_DST_OFF, IP_SRC_OFF,
        IP_TOT_LEN_OFF,
    },
    route,
    svc_stats::{self, Way},
};

/// IPv6 next header: an IPv6 packet (RFC 2473).
const IPPROTO_IPV6: u8 = 41;
const FLOW_LABEL_MASK: u32 = 0x000f_ffff;

#[map(name = "dsr_stats")]
static DSR_STATS: PerCpuArray<u64> = PerCpuArray::pinned(dsr_stat::COUNT, 0);

#[inline(always)]
pub fn count(stat: u32) {
    crate::maps::bump(&DSR_STATS, stat);
}

/// Tunnels the IPv4 packet as it arrived to `backend` (address, port) from this node's address
/// and routes it; the TC verdict, or `route::FRAG_NEEDED` with the MTU left for the inner packet
/// (the packet untouched: the route is checked before the outer header goes on, so it can be
/// answered as its sender sent it).
// Not inlined: the route lookup's frame stays out of the caller's.
#[inline(never)]
pub fn tunnel(ctx: &TcContext, backend: &(u32, u16), proto: u8, l4_off: usize) -> i32 {
    // `lb::new_flow` makes no DSR flow without it.
    let Some(local) = LB_CONFIG.get(0).map(|c| c.snat_addr).filter(|a| *a != 0) else {
        return TC_ACT_SHOT;
    };
    // SAFETY: an all-zero bpf_fib_lookup is a valid request skeleton (integers and unions of them).
    let mut params: FibLookup = unsafe { core::mem::zeroed() };
    params.family = route::AF_INET;
    params.l4_protocol = IPPROTO_IPIP;
    params.__bindgen_anon_3.ipv4_src = local;
    params.__bindgen_anon_4.ipv4_dst = backend.0;
    let routed = (|| {
        let ip_len = u16::from_be(ctx.load::<u16>(IP_TOT_LEN_OFF)?);
        // SAFETY: reading the skb's GSO segment size from its context.
        let gso = unsafe { (*ctx.skb.skb).gso_size } != 0;
        // A GSO packet's segments keep their size: the encapsulation takes the outer header
        // off each segment's payload (`bpf_skb_adjust_room` lowers gso_size).
        let outer = if gso { 0 } else { IP_HDR_LEN as u16 };
        params.__bindgen_anon_1.tot_len = route::wire_len(ctx, ip_len, proto, l4_off)? + outer;
        route::lookup(ctx, &mut params)?;
        let outer = OuterSpec {
            overhead: IP_HDR_LEN,
            flags: BPF_F_ADJ_ROOM_ENCAP_L3_IPV4 as u64,
            protocol: IPPROTO_IPIP,
            src: local,
            dst: backend.0,
            id: backend.1,
            always_df: true,
        };
        if !matches!(push_outer_ipv4(ctx, &outer), Ok(Some(_))) {
            count(dsr_stat::ENCAP_FAILED);
            return Ok(TC_ACT_SHOT);
        }
        count(dsr_stat::ENCAPSULATED);
        // SAFETY: reading the union member the lookup filled for AF_INET.
        let next_hop = unsafe { params.__bindgen_anon_4.ipv4_dst };
        let mut neigh: bpf_redir_neigh = unsafe { core::mem::zeroed() };
        neigh.nh_family = route::AF_INET as u32;
        neigh.__bindgen_anon_1.ipv4_nh = next_hop;
        Ok(route::send(params.ifindex, &mut neigh))
    })();
    inner_mtu(route::verdict(routed, &params), IP_HDR_LEN)
}

/// A tunnel's TC verdict; a "too big" one (`route::FRAG_NEEDED` with the route's MTU) counted and
/// left with the MTU the inner packet has once the `outer` header's bytes are taken off.
#[inline(always)]
fn inner_mtu(verdict: i32, outer: usize) -> i32 {
    if verdict < route::FRAG_NEEDED {
        return verdict;
    }
    count(dsr_stat::FRAG_NEEDED_SENT);
    let mtu = (verdict & 0xffff) as u16;
    route::FRAG_NEEDED | i32::from(mtu.saturating_sub(outer as u16))
}

/// The backend (address, port) a direct-server-return tunnel packet names, its outer header
/// removed; `None` for any other packet (left untouched).
#[inline(always)]
pub fn decap(ctx: &TcContext) -> Option<(u32, u16)> {
    // The protocol first: it rules out nearly every packet with one read.
    if packet::load::<u8>(ctx, ETH_HDR_LEN + 9).ok()? != IPPROTO_IPIP {
        return None;
    }
    let version_ihl: u8 = ctx.load(ETH_HDR_LEN).ok()?;
    let frag = u16::from_be(ctx.load::<u16>(ETH_HDR_LEN + 6).ok()?);
    // Exactly what `tunnel` writes: no options, DF and nothing else in the fragment field.
    if version_ihl != 0x45 || frag != IP_DF {
        return None;
    }
    let src: u32 = ctx.load(IP_SRC_OFF).ok()?;
    let dst: u32 = ctx.load(IP_DST_OFF).ok()?;
    // From a node of the cluster to a pod: the pod overlay's tunnels run node to node.
    if V4::cluster_net(&src) & CLUSTER_NET_NODE == 0 || V4::cluster_net(&dst) & CLUSTER_NET_POD == 0 {
        return None;
    }
    let port: u16 = ctx.load(ETH_HDR_LEN + 4).ok()?;
    if ctx.adjust_room(-(IP_HDR_LEN as i32), BPF_ADJ_ROOM_MAC, BPF_F_ADJ_ROOM_DECAP_L3_IPV4 as u64).is_err() {
        count(dsr_stat::DECAP_FAILED);
        return None;
    }
    count(dsr_stat::DECAPSULATED);
    Some((dst, port))
}

/// The outer IPv6 header, as it goes on the wire (multi-byte fields in network order).
#[repr(C)]
struct OuterIpv6 {
    /// Version, traffic class and flow label.
    version_class_label: u32,
    payload_len: u16,
    next_header: u8,
    hop_limit: u8,
    src: Ipv6Words,
    dst: Ipv6Words,
}

/// As [`tunnel`], for IPv6: the packet in an outer IPv6 header from this node's IPv6 address to
/// `backend`, the backend's port in the flow label; "too big" leaves the MTU less the 40 bytes.
#[inline(never)]
pub fn tunnel_v6(ctx: &TcContext, backend: &(Ipv6Words, u16), proto: u8, l4_off: usize) -> i32 {
    // `lb::new_flow` makes no DSR flow without it.
    let Some(local) = LB_CONFIG.get(0).and_then(V6::snat_addr) else {
        return TC_ACT_SHOT;
    };
    // SAFETY: an all-zero bpf_fib_lookup is a valid request skeleton (integers and unions of them).
    let mut params: FibLookup = unsafe { core::mem::zeroed() };
    params.family = route::AF_INET6;
    params.l4_protocol = IPPROTO_IPV6;
    params.__bindgen_anon_3.ipv6_src = local.0;
    params.__bindgen_anon_4.ipv6_dst = backend.0 .0;
    let routed = (|| {
        let first_word = u32::from_be(ctx.load::<u32>(ETH_HDR_LEN)?);
        let inner_len = u16::from_be(ctx.load::<u16>(IPV6_PAYLOAD_LEN_OFF)?) + IPV6_HDR_LEN as u16;
        // SAFETY: reading the skb's GSO segment size from its context.
        let gso = unsafe { (*ctx.skb.skb).gso_size } != 0;
        // As IPv4: a GSO packet's segments keep their size (the outer header comes off gso_size).
        let outer = if gso { 0 } else { IPV6_HDR_LEN as u16 };
        params.__bindgen_anon_1.tot_len = route::wire_len(ctx, inner_len, proto, l4_off)? + outer;
        route::lookup(ctx, &mut params)?;
        if ctx.adjust_room(IPV6_HDR_LEN as i32, BPF_ADJ_ROOM_MAC, BPF_F_ADJ_ROOM_ENCAP_L3_IPV6 as u64).is_err() {
            count(dsr_stat::ENCAP_FAILED);
            return Ok(TC_ACT_SHOT);
        }
        // The inner packet's traffic class; the port (host order) as the flow label.
        let class = first_word & 0x0ff0_0000;
        let label = u32::from(u16::from_be(backend.1)) & FLOW_LABEL_MASK;
        let header = OuterIpv6 {
            version_class_label: (6 << 28 | class | label).to_be(),
            payload_len: inner_len.to_be(),
            next_header: IPPROTO_IPV6,
            hop_limit: OUTER_TTL,
            src: local,
            dst: backend.0,
        };
        if ctx.store(ETH_HDR_LEN, &header, 0).is_err() {
            count(dsr_stat::ENCAP_FAILED);
            return Ok(TC_ACT_SHOT);
        }
        count(dsr_stat::ENCAPSULATED);
        // SAFETY: reading the union member the lookup filled for AF_INET6.
        let next_hop = unsafe { params.__bindgen_anon_4.ipv6_dst };
        let mut neigh: bpf_redir_neigh = unsafe { core::mem::zeroed() };
        neigh.nh_family = route::AF_INET6 as u32;
        neigh.__bindgen_anon_1.ipv6_nh = next_hop;
        Ok(route::send(params.ifindex, &mut neigh))
    })();
    inner_mtu(route::verdict(routed, &params), IPV6_HDR_LEN)
}

/// [`receive_v6`]'s answer for a packet that is no tunnel of ours (not a TC verdict).
pub const NOT_TUNNELLED: i32 = i32::MIN + 1;

/// As [`decap`] + [`deliver`], for IPv6: an IPv6-in-IPv6 packet from a cluster node to a pod
/// address, no extension headers, its flow label a port, loses its outer header and is
/// delivered; the TC verdict, or [`NOT_TUNNELLED`] for any other packet (left untouched).
// Not inlined: the addresses would otherwise stay in the program's first frame, under every
// other call's.
#[inline(never)]
pub fn receive_v6(ctx: &TcContext) -> i32 {
    match decap_v6(ctx) {
        Some(backend) => deliver::<V6>(ctx, &backend),
        None => NOT_TUNNELLED,
    }
}

#[inline(always)]
fn decap_v6(ctx: &TcContext) -> Option<(Ipv6Words, u16)> {
    // The next header first: it rules out nearly every packet with one read.
    if packet::load::<u8>(ctx, ETH_HDR_LEN + 6).ok()? != IPPROTO_IPV6 {
        return None;
    }
    let first_word = u32::from_be(ctx.load::<u32>(ETH_HDR_LEN).ok()?);
    let inner_version: u8 = ctx.load(ETH_HDR_LEN + IPV6_HDR_LEN).ok()?;
    let label = first_word & FLOW_LABEL_MASK;
    // Exactly what `tunnel_v6` writes: an IPv6 packet straight after the header, a port (never
    // zero, at most 16 bits) as the label.
    if first_word >> 28 != 6 || inner_version >> 4 != 6 || label == 0 || label > 0xffff {
        return None;
    }
    let src: Ipv6Words = ctx.load(IPV6_SRC_OFF).ok()?;
    let dst: Ipv6Words = ctx.load(IPV6_DST_OFF).ok()?;
    if V6::cluster_net(&src) & CLUSTER_NET_NODE == 0 || V6::cluster_net(&dst) & CLUSTER_NET_POD == 0 {
        return None;
    }
    if ctx.adjust_room(-(IPV6_HDR_LEN as i32), BPF_ADJ_ROOM_MAC, BPF_F_ADJ_ROOM_DECAP_L3_IPV6 as u64).is_err() {
        count(dsr_stat::DECAP_FAILED);
        return None;
    }
    count(dsr_stat::DECAPSULATED);
    Some((dst, (label as u16).to_be()))
}

/// The inner packet of a tunnel to `backend`: translated to it (a new flow recorded first); the
/// TC verdict. A packet for no frontend here is dropped.
// Not inlined: a frame of its own, beside `lb::ingress`'s.
#[inline(never)]
pub fn deliver<F: Family>(ctx: &TcContext, backend: &(F::Addr, u16)) -> i32 {
    let Some(work) = lb::parse_into::<F>(ctx) else {
        count(dsr_stat::DECAP_REFUSED);
        return TC_ACT_SHOT;
    };
    let flow = match lb::flow_of::<F>(ctx, &mut work.parsed, Hook::Ingress) {
        Ok(flow) => flow,
        Err(verdict) => return verdict,
    };
    if !flow.has_l4() || (flow.proto != IPPROTO_TCP && flow.proto != IPPROTO_UDP) {
        count(dsr_stat::DECAP_REFUSED);
        return TC_ACT_SHOT;
    }
    let now = unsafe { bpf_ktime_get_ns() };
    work.key = conntrack::key_of(flow);
    if let Some(entry) = conntrack::lookup::<F>(&work.key, flow.tcp_flags, now) {
        // The address only: the port is exact in a flow's first packet alone (a SYN, a first
        // datagram). Segmenting a GSO packet after encapsulation gives the outer headers
        // consecutive IP IDs.
        if entry.flags & CT_FLAG_DSR_DELIVER != 0 && entry.nat_dst_addr == backend.0 {
            count_lb(lb_stat::CT_HIT);
            svc_stats::count::<F, _>(ctx, flow.dst_addr, flow.dst_port, flow.proto, Way::In);
            return lb::translate::<F>(ctx, flow, entry, &mut work.to);
        }
        // Another backend, or another kind of flow on this tuple: the tunnel decides.
        conntrack::forget::<F>(&work.key, entry);
    }
    let Some(service_id) = tunnelled_service::<F>(flow.dst_addr, flow.dst_port, flow.proto) else {
        count(dsr_stat::DECAP_REFUSED);
        return TC_ACT_SHOT;
    };
    work.new = NewFlow {
        nat_src: (flow.src_addr, flow.src_port),
        nat_dst: *backend,
        forward_flags: CT_FLAG_DSR_DELIVER,
        reverse_flags: CT_FLAG_DSR_DELIVER,
        service_id,
        backend_id: 0,
    };
    if conntrack::create::<F>(flow, &work.new, now).is_err() {
        // Still delivered; the next packet retries the insert.
        count_lb(lb_stat::CT_INSERT_FAILED);
    }
    count(dsr_stat::DELIVER_NEW_FLOW);
    // The connection is counted where its backend was chosen; here only its packets.
    lb::flow_opened::<F, _>(ctx, flow, &work.new, now, Way::In);
    work.to = Tuple { src: work.new.nat_src, dst: work.new.nat_dst };
    lb::apply::<F>(ctx, flow, &work.to, false)
}

/// The service id of the frontend a tunnelled flow is for: a frontend programmed here (a VIP),
/// or, for another node's NodePort, the same NodePort on this node's address (node ports are
/// allocated cluster-wide). `None`: no Service of this node's serves it.
#[inline(always)]
fn tunnelled_service<F: Family>(addr: F::Addr, port: u16, proto: u8) -> Option<u32> {
    let frontend = ServiceKey { addr, port, proto, pad: 0 };
    // SAFETY: read-only use of a map value within this run.
    if let Some(service) = unsafe { F::services().get(frontend) } {
        return Some(service.service_id);
    }
    if F::cluster_net(&addr) & CLUSTER_NET_NODE == 0 {
        return None;
    }
    let local = LB_CONFIG.get(0).and_then(F::snat_addr)?;
    let own = ServiceKey { addr: local, port, proto, pad: 0 };
    // SAFETY: as above.
    let service = unsafe { F::services().get(own) }?;
    (service.flags & SVC_FLAG_NODEPORT != 0).then_some(service.service_id)
}
