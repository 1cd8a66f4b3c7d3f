//! XDP fast path on node uplinks for north-south service traffic: a flow from outside the
//! cluster to a NodePort, ExternalIP or LoadBalancer IP whose backend is on another node is
//! translated (DNAT to the backend, SNAT to the node address) and sent straight back out, and so
//! are the backend node's replies (reverse NAT), without an skb or the stack.
//!
//! It reads and writes the very conntrack and NAT entries TC does (`lb::known`, `lb::choose`,
//! `lb::new_flow`), so a flow has one state whichever hook saw its first packet. Everything it
//! does not serve goes on untouched (`XDP_PASS`) to the TC path: other traffic, fragments,
//! ICMP, flows translated for local delivery, and packets whose next hop the FIB cannot give
//! completely (no neighbour entry yet: TC's `bpf_redirect_neigh` resolves it).
use aya_ebpf::{
    bindings::{bpf_fib_lookup as FibLookup, xdp_action},
    helpers::{bpf_fib_lookup, bpf_ktime_get_coarse_ns, bpf_redirect},
    macros::map,
    maps::PerCpuArray,
    programs::XdpContext,
    EbpfContext,
};
use kube_router_common::*;

use crate::{
    conntrack,
    family::{Family, V4, V6},
    lb::{choose, flow_opened, known, new_flow, Choice, Known, NewFlowVerdict},
    maps::Work,
    nat::Tuple,
    packet::{xdp_store, Packet},
    parsing::{
        ip_version, Fragment, IpVersion, LbFlow, LbParsed, ETH_HDR_LEN, IPV6_DST_OFF, IPV6_HDR_LEN, IPV6_HOP_LIMIT_OFF,
        IPV6_PAYLOAD_LEN_OFF, IPV6_SRC_OFF, IP_CSUM_OFF, IP_DST_OFF, IP_SRC_OFF, IP_TOT_LEN_OFF, IP_TTL_OFF,
    },
    svc_stats::{self, Way},
};

#[map(name = "xdp_stats")]
static XDP_STATS: PerCpuArray<u64> = PerCpuArray::pinned(xdp_stat::COUNT, 0);

/// The FIB lookup's parameters, in map memory: on the stack they would not fit beside the
/// IPv6 rewrite's. Not pinned: scratch, per CPU.
#[map(name = "xdp_fib")]
static FIB_PARAMS: PerCpuArray<FibLookup> = PerCpuArray::with_max_entries(1, 0);

#[inline(always)]
fn count(stat: u32) {
    crate::maps::bump(&XDP_STATS, stat);
}

#[inline(always)]
fn pass(stat: u32) -> u32 {
    count(stat);
    xdp_action::XDP_PASS
}

const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;
const BPF_FIB_LKUP_RET_SUCCESS: i64 = 0;

#[inline(always)]
pub fn handle(ctx: &XdpContext) -> u32 {
    count(xdp_stat::PACKETS);
    match ip_version(ctx) {
        Ok(IpVersion::V4) => parse_and_serve::<V4>(ctx),
        Ok(IpVersion::V6) => parse_and_serve::<V6>(ctx),
        _ => pass(xdp_stat::PASS_NOT_LB),
    }
}

/// Parses here, beside `serve` rather than inside it: the parser reads the frame directly, and
/// its frame on top of `serve`'s and `send`'s would pass the verifier's 512-byte stack bound.
#[inline(always)]
fn parse_and_serve<F: Forward>(ctx: &XdpContext) -> u32 {
    let Some(work) = F::work().get_ptr_mut(0) else {
        return pass(xdp_stat::PASS_NOT_LB);
    };
    // SAFETY: per-CPU map memory, used by this program run only.
    let work = unsafe { &mut *work };
    if !F::parse(ctx, &mut work.parsed) {
        return pass(xdp_stat::PASS_NOT_LB);
    }
    serve::<F>(ctx, work)
}

// Not inlined: one frame per family, as at TC.
#[inline(never)]
fn serve<F: Forward>(ctx: &XdpContext, work: &mut Work<F::Addr>) -> u32 {
    let LbParsed::Flow(flow) = &work.parsed else {
        return pass(xdp_stat::PASS_NOT_LB);
    };
    if flow.fragment != Fragment::Whole {
        return pass(xdp_stat::PASS_FRAGMENT);
    }
    if flow.proto != IPPROTO_TCP && flow.proto != IPPROTO_UDP {
        return pass(xdp_stat::PASS_NOT_LB);
    }
    // The coarse clock (CLOCK_MONOTONIC_COARSE, a tick behind at most): the same time base as
    // TC's and the agent's, and conntrack ages are seconds; the precise clock cost ~10 % of a
    // forwarded packet here.
    let now = unsafe { bpf_ktime_get_coarse_ns() };
    work.key = conntrack::key_of(flow);
    if let Some(entry) = conntrack::lookup::<F>(&work.key, flow.tcp_flags, now) {
        return match known::<F>(flow, entry) {
            // Only flows TC would route itself after translating (source-NATed to the node
            // address); the rest are delivered or routed by the stack.
            Known::Forward if entry.flags & CT_FLAG_REDIRECT != 0 => {
                work.to = Tuple {
                    src: (entry.nat_src_addr, entry.nat_src_port),
                    dst: (entry.nat_dst_addr, entry.nat_dst_port),
                };
                let verdict = send::<F>(ctx, flow, &work.to);
                if served(verdict) {
                    count(xdp_stat::FORWARD);
                    svc_stats::count::<F, _>(ctx, flow.dst_addr, flow.dst_port, flow.proto, Way::In);
                }
                verdict
            }
            // The backend node's reply to a north-south flow (pod egress masquerade has no
            // service and stays at TC).
            Known::FullNatReply if entry.service_id != 0 => {
                work.to = Tuple {
                    src: (entry.nat_src_addr, entry.nat_src_port),
                    dst: (entry.nat_dst_addr, entry.nat_dst_port),
                };
                let verdict = send::<F>(ctx, flow, &work.to);
                if served(verdict) {
                    count(xdp_stat::REPLY);
                    conntrack::mark_seen_reply::<F>(entry, flow);
                    svc_stats::count::<F, _>(ctx, entry.nat_src_addr, entry.nat_src_port, flow.proto, Way::Out);
                }
                verdict
            }
            _ => pass(xdp_stat::PASS_TO_TC),
        };
    }
    match choose::<F>(flow, now, &mut work.service, &mut work.chosen) {
        Choice::NoService => return pass(xdp_stat::PASS_NO_SERVICE),
        // TC drops or refuses it, and counts it.
        Choice::SourceDenied | Choice::NoBackend => return pass(xdp_stat::PASS_TO_TC),
        Choice::Backend => {}
    }
    // The flow is recorded here whatever its backend: TC choosing again for a flow we leave to
    // it would skew a random choice away from local backends.
    let verdict = new_flow::<F>(flow, &work.service, &work.chosen, now, &mut work.new);
    if verdict == NewFlowVerdict::DROP {
        // Refused (no free SNAT port, no room for its entries), counted by `new_flow`. TC would
        // try the same again, count it a second time and drop it too: under a SYN flood that
        // doubled the work and the count of every refused SYN.
        return xdp_action::XDP_DROP;
    }
    count(xdp_stat::NEW_FLOW);
    let verdict = if verdict == NewFlowVerdict::ROUTE {
        work.to = Tuple { src: work.new.nat_src, dst: work.new.nat_dst };
        send::<F>(ctx, flow, &work.to)
    } else {
        // Delivered here, routed by the stack, or tunnelled to the backend's node (direct server
        // return, whatever the frontend: only TC can add the outer header): TC translates or
        // encapsulates it from the entries just made.
        pass(xdp_stat::PASS_TO_TC)
    };
    flow_opened::<F, _>(ctx, flow, &work.new, now, if served(verdict) { Way::New } else { Way::Opened });
    verdict
}

/// The packet left through XDP (rather than on to TC, or dropped).
#[inline(always)]
fn served(verdict: u32) -> bool {
    verdict == xdp_action::XDP_TX || verdict == xdp_action::XDP_REDIRECT
}

/// Routes the packet as translated to `to` and translates it; `XDP_PASS` (untouched) when the
/// FIB gives no complete next hop.
// Not inlined: the lookup's parameters get a frame of their own.
#[inline(never)]
fn send<F: Forward>(ctx: &XdpContext, flow: &LbFlow<F::Addr>, to: &Tuple<F::Addr>) -> u32 {
    let Some(params) = FIB_PARAMS.get_ptr_mut(0) else {
        return pass(xdp_stat::PASS_NO_ROUTE);
    };
    // SAFETY: per-CPU map memory, used by this program run only; all-zero is a valid request
    // skeleton (integers and unions of them).
    let params = unsafe {
        core::ptr::write_bytes(params, 0, 1);
        &mut *params
    };
    let Ok(hop_limit) = F::fib_request(ctx, to, flow.proto, params) else {
        return pass(xdp_stat::PASS_NO_ROUTE);
    };
    if F::checksum_partial(ctx, flow) {
        // Only TC's helpers know the skb's checksum state.
        return pass(xdp_stat::PASS_CHECKSUM_PARTIAL);
    }
    let ingress = ctx.ingress_ifindex() as u32;
    params.ifindex = ingress;
    // SAFETY: params is a valid bpf_fib_lookup of the size passed.
    let rc = unsafe { bpf_fib_lookup(ctx.as_ptr(), params, size_of::<FibLookup>() as i32, 0) };
    // No neighbour entry, no route, MTU exceeded, forwarding off: TC routes (or answers) it.
    if rc != BPF_FIB_LKUP_RET_SUCCESS || hop_limit <= 1 {
        return pass(xdp_stat::PASS_NO_ROUTE);
    }
    let rewritten = F::rewrite_xdp(ctx, flow, to, hop_limit)
        .and_then(|()| xdp_store(ctx, 0, &params.dmac))
        .and_then(|()| xdp_store(ctx, 6, &params.smac));
    if rewritten.is_err() {
        count(xdp_stat::REWRITE_FAILED);
        return xdp_action::XDP_DROP;
    }
    if params.ifindex == ingress {
        count(xdp_stat::TX);
        return xdp_action::XDP_TX;
    }
    count(xdp_stat::REDIRECT);
    // SAFETY: plain helper call; with flags 0 it returns XDP_REDIRECT, or XDP_ABORTED on error.
    unsafe { bpf_redirect(params.ifindex, 0) as u32 }
}

/// What XDP needs of a family beyond the load balancer's logic: the FIB request and a rewrite
/// without the skb checksum helpers.
pub trait Forward: Family {
    /// Fills the family's part of the FIB request for the packet translated to `to`; returns
    /// its TTL / hop limit as it arrived.
    fn fib_request(ctx: &XdpContext, to: &Tuple<Self::Addr>, proto: u8, params: &mut FibLookup) -> Result<u8, i64>;
    /// The L4 checksum field holds the bare pseudo-header sum: almost surely a packet whose
    /// checksum is still to be completed (CHECKSUM_PARTIAL, from a veth peer on this host), which
    /// XDP cannot see; a full checksum equal to it by chance (1 in 65,536) only goes to TC too.
    fn checksum_partial(ctx: &XdpContext, flow: &LbFlow<Self::Addr>) -> bool;
    /// Rewrites the packet to `to`, updating its checksums, and decrements its TTL / hop limit.
    fn rewrite_xdp(
        ctx: &XdpContext,
        flow: &LbFlow<Self::Addr>,
        to: &Tuple<Self::Addr>,
        hop_limit: u8,
    ) -> Result<(), i64>;
}

/// Where the L4 checksum is, and whether it follows UDP's "0: none" rule.
#[inline(always)]
fn l4_checksum(proto: u8, l4_off: usize) -> (usize, bool) {
    if proto == IPPROTO_TCP {
        (l4_off + 16, false)
    } else {
        (l4_off + 6, true)
    }
}

#[inline(always)]
fn update(check: u16, udp: bool, f: impl FnOnce(u16) -> u16) -> u16 {
    if udp {
        csum::udp(check, f)
    } else {
        f(check)
    }
}

/// Rewrites the two ports (a changed port changes the L4 checksum); returns the checksum.
#[inline(always)]
fn rewrite_ports<A>(ctx: &XdpContext, flow: &LbFlow<A>, to: &Tuple<A>, mut check: u16, udp: bool) -> Result<u16, i64> {
    for (off, old, new) in [(flow.l4_off, flow.src_port, to.src.1), (flow.l4_off + 2, flow.dst_port, to.dst.1)] {
        if old != new {
            check = update(check, udp, |c| csum::replace16(c, old, new));
            xdp_store(ctx, off, &new)?;
        }
    }
    Ok(check)
}

impl Forward for V4 {
    #[inline(always)]
    fn fib_request(ctx: &XdpContext, to: &Tuple<u32>, proto: u8, params: &mut FibLookup) -> Result<u8, i64> {
        params.family = AF_INET;
        params.l4_protocol = proto;
        params.__bindgen_anon_3.ipv4_src = to.src.0;
        params.__bindgen_anon_4.ipv4_dst = to.dst.0;
        params.__bindgen_anon_1.tot_len = u16::from_be(ctx.load::<u16>(IP_TOT_LEN_OFF)?);
        ctx.load(IP_TTL_OFF)
    }

    #[inline(always)]
    fn checksum_partial(ctx: &XdpContext, flow: &LbFlow<u32>) -> bool {
        let (csum_off, _) = l4_checksum(flow.proto, flow.l4_off);
        let (Ok(check), Ok(ip_len)) = (ctx.load::<u16>(csum_off), ctx.load::<u16>(IP_TOT_LEN_OFF)) else {
            return true;
        };
        let l4_len = u16::from_be(ip_len).wrapping_sub((flow.l4_off - ETH_HDR_LEN) as u16);
        let addrs = csum::add32(csum::add32(0, flow.src_addr), flow.dst_addr);
        check == csum::pseudo_header(addrs, flow.proto, l4_len)
    }

    #[inline(always)]
    fn rewrite_xdp(ctx: &XdpContext, flow: &LbFlow<u32>, to: &Tuple<u32>, ttl: u8) -> Result<(), i64> {
        let (l4_off, udp) = l4_checksum(flow.proto, flow.l4_off);
        let mut ip_check: u16 = ctx.load(IP_CSUM_OFF)?;
        let mut l4_check: u16 = ctx.load(l4_off)?;
        for (off, old, new) in [(IP_SRC_OFF, flow.src_addr, to.src.0), (IP_DST_OFF, flow.dst_addr, to.dst.0)] {
            if old != new {
                ip_check = csum::replace32(ip_check, old, new);
                // The TCP and UDP checksums cover the addresses (pseudo-header).
                l4_check = update(l4_check, udp, |c| csum::replace32(c, old, new));
                xdp_store(ctx, off, &new)?;
            }
        }
        l4_check = rewrite_ports(ctx, flow, to, l4_check, udp)?;
        // TTL and protocol share a 16-bit header word.
        let (old_word, new_word) = (u16::from_ne_bytes([ttl, flow.proto]), u16::from_ne_bytes([ttl - 1, flow.proto]));
        ip_check = csum::replace16(ip_check, old_word, new_word);
        xdp_store(ctx, IP_TTL_OFF, &(ttl - 1))?;
        xdp_store(ctx, IP_CSUM_OFF, &ip_check)?;
        xdp_store(ctx, l4_off, &l4_check)
    }
}

impl Forward for V6 {
    #[inline(always)]
    fn fib_request(ctx: &XdpContext, to: &Tuple<Ipv6Words>, proto: u8, params: &mut FibLookup) -> Result<u8, i64> {
        params.family = AF_INET6;
        params.l4_protocol = proto;
        params.__bindgen_anon_3.ipv6_src = to.src.0 .0;
        params.__bindgen_anon_4.ipv6_dst = to.dst.0 .0;
        let payload = u16::from_be(ctx.load::<u16>(IPV6_PAYLOAD_LEN_OFF)?);
        params.__bindgen_anon_1.tot_len = payload + IPV6_HDR_LEN as u16;
        ctx.load(IPV6_HOP_LIMIT_OFF)
    }

    #[inline(always)]
    fn checksum_partial(ctx: &XdpContext, flow: &LbFlow<Ipv6Words>) -> bool {
        let (csum_off, _) = l4_checksum(flow.proto, flow.l4_off);
        let (Ok(check), Ok(payload)) = (ctx.load::<u16>(csum_off), ctx.load::<u16>(IPV6_PAYLOAD_LEN_OFF)) else {
            return true;
        };
        // The payload length counts extension headers; the upper layer's does not.
        let l4_len = u16::from_be(payload).wrapping_sub((flow.l4_off - ETH_HDR_LEN - IPV6_HDR_LEN) as u16);
        let mut addrs = 0;
        for i in 0..4 {
            addrs = csum::add32(csum::add32(addrs, flow.src_addr.0[i]), flow.dst_addr.0[i]);
        }
        check == csum::pseudo_header(addrs, flow.proto, l4_len)
    }

    #[inline(always)]
    fn rewrite_xdp(
        ctx: &XdpContext,
        flow: &LbFlow<Ipv6Words>,
        to: &Tuple<Ipv6Words>,
        hop_limit: u8,
    ) -> Result<(), i64> {
        let (l4_off, udp) = l4_checksum(flow.proto, flow.l4_off);
        let mut l4_check: u16 = ctx.load(l4_off)?;
        for (off, old, new) in [(IPV6_SRC_OFF, &flow.src_addr, &to.src.0), (IPV6_DST_OFF, &flow.dst_addr, &to.dst.0)] {
            if old != new {
                for i in 0..4 {
                    let (o, n) = (old.0[i], new.0[i]);
                    l4_check = update(l4_check, udp, |c| csum::replace32(c, o, n));
                }
                xdp_store(ctx, off, new)?;
            }
        }
        l4_check = rewrite_ports(ctx, flow, to, l4_check, udp)?;
        xdp_store(ctx, IPV6_HOP_LIMIT_OFF, &(hop_limit - 1))?;
        xdp_store(ctx, l4_off, &l4_check)
    }
}
