//! IPv4 and IPv6 behind one interface, so the load balancer's logic (lookups, conntrack, NAT
//! decisions) is written once and compiled for each address family.
use aya_ebpf::{
    maps::{lpm_trie::Key, HashMap, LruHashMap, PerCpuArray, PerCpuHashMap},
    programs::TcContext,
};
use kube_router_common::*;

use crate::{
    dsr,
    maps::*,
    nat::{self, Tuple},
    packet::Packet,
    parsing::{self, IcmpError, LbFlow, LbParsed},
    reject, route,
    svc_stats::{SVC_STATS, SVC_STATS_V6},
};

pub trait Family: 'static {
    /// `u32` or [`Ipv6Words`], network byte order.
    type Addr: Copy + PartialEq + FlowHashWords + EventAddr;

    fn services() -> &'static HashMap<ServiceKey<Self::Addr>, ServiceValue>;
    fn slots() -> &'static HashMap<BackendSlotKey, BackendSlotValue>;
    fn backends() -> &'static HashMap<u32, Backend<Self::Addr>>;
    fn conntrack() -> &'static LruHashMap<CtKey<Self::Addr>, CtValue<Self::Addr>>;
    /// `ct_gate_v4/v6`: the endpoints of Service flows (see `gate`).
    fn ct_gate() -> &'static LruHashMap<ServiceKey<Self::Addr>, u64>;
    fn affinity() -> &'static LruHashMap<AffinityKey<Self::Addr>, AffinityValue>;
    fn fragments() -> &'static LruHashMap<FragKey<Self::Addr>, FragPorts>;
    fn ct_scratch() -> &'static PerCpuArray<CtScratch<Self::Addr>>;
    fn work() -> &'static PerCpuArray<Work<Self::Addr>>;
    fn forwarded() -> &'static PerCpuArray<CtKey<Self::Addr>>;
    fn svc_stats() -> &'static PerCpuHashMap<ServiceKey<Self::Addr>, ServiceStats>;
    /// Parses the packet into `out` (per-CPU map memory); `false` if it cannot be read.
    fn parse<C: Packet>(ctx: &C, out: &mut LbParsed<Self::Addr>) -> bool;
    /// `CLUSTER_NET_*` flags of the longest prefix holding `addr` (0: outside the cluster).
    fn cluster_net(addr: &Self::Addr) -> u32;
    /// The node address source-NATed flows of this family leave with, if configured.
    fn snat_addr(config: &LbConfig) -> Option<Self::Addr>;
    /// `src` is inside one of the service's `loadBalancerSourceRanges`.
    fn source_allowed(service_id: u32, src: &Self::Addr) -> bool;

    fn rewrite(ctx: &TcContext, flow: &LbFlow<Self::Addr>, to: &Tuple<Self::Addr>) -> Result<(), i64>;
    fn rewrite_icmp_error(
        ctx: &TcContext,
        error: &IcmpError<Self::Addr>,
        quoted: &Tuple<Self::Addr>,
        outer_dst: &Self::Addr,
    ) -> Result<(), i64>;
    /// Routes the translated packet (its new source is a node address); the TC verdict.
    fn redirect(ctx: &TcContext, to: &Tuple<Self::Addr>, proto: u8, l4_off: usize) -> i32;
    /// Answers a new flow to a frontend without endpoints; the TC verdict.
    fn refuse(ctx: &TcContext, flow: &LbFlow<Self::Addr>) -> i32;
    /// Answers a routed packet (`flow` as it arrived, translated to `to`) that does not fit the
    /// route's `mtu`; the TC verdict.
    fn frag_needed(ctx: &TcContext, flow: &LbFlow<Self::Addr>, to: &Tuple<Self::Addr>, mtu: u16) -> i32;
    /// Direct server return: tunnels the untranslated packet from this node to `backend` and
    /// routes it; the TC verdict, or `route::FRAG_NEEDED` with the MTU left for the packet
    /// itself. IPIP for IPv4, IPv6-in-IPv6 for IPv6.
    fn tunnel(ctx: &TcContext, backend: &(Self::Addr, u16), proto: u8, l4_off: usize) -> i32;
}

pub struct V4;
pub struct V6;

impl Family for V4 {
    type Addr = u32;

    fn services() -> &'static HashMap<ServiceKeyV4, ServiceValue> {
        &SERVICES
    }
    fn slots() -> &'static HashMap<BackendSlotKey, BackendSlotValue> {
        &BACKEND_SLOTS
    }
    fn backends() -> &'static HashMap<u32, BackendV4> {
        &BACKENDS
    }
    fn ct_gate() -> &'static LruHashMap<ServiceKeyV4, u64> {
        &CT_GATE
    }
    fn conntrack() -> &'static LruHashMap<CtKeyV4, CtValueV4> {
        &CONNTRACK
    }
    fn affinity() -> &'static LruHashMap<AffinityKeyV4, AffinityValue> {
        &AFFINITY
    }
    fn fragments() -> &'static LruHashMap<FragKeyV4, FragPorts> {
        &FRAGMENTS
    }
    fn ct_scratch() -> &'static PerCpuArray<CtScratch<u32>> {
        &CT_SCRATCH
    }
    fn work() -> &'static PerCpuArray<Work<u32>> {
        &WORK
    }
    fn forwarded() -> &'static PerCpuArray<CtKeyV4> {
        &FORWARDED
    }
    fn svc_stats() -> &'static PerCpuHashMap<ServiceKeyV4, ServiceStats> {
        &SVC_STATS
    }
    // Not inlined: the parser's temporaries get a frame of their own.
    #[inline(never)]
    fn parse<C: Packet>(ctx: &C, out: &mut LbParsed<u32>) -> bool {
        parsing::parse_lb_v4(ctx, out).is_ok()
    }
    #[inline(always)]
    fn cluster_net(addr: &u32) -> u32 {
        CLUSTER_NETS.get(Key::new(32, *addr)).copied().unwrap_or(0)
    }
    #[inline(always)]
    fn source_allowed(service_id: u32, src: &u32) -> bool {
        let key = SourceRangeKey { service_id: service_id.to_be(), addr: *src };
        SOURCE_RANGES.get(Key::new(64, key)).is_some()
    }
    #[inline(always)]
    fn snat_addr(config: &LbConfig) -> Option<u32> {
        (config.snat_addr != 0).then_some(config.snat_addr)
    }
    #[inline(always)]
    fn rewrite(ctx: &TcContext, flow: &LbFlow<u32>, to: &Tuple<u32>) -> Result<(), i64> {
        nat::rewrite_v4(ctx, flow, to)
    }
    #[inline(always)]
    fn rewrite_icmp_error(
        ctx: &TcContext,
        error: &IcmpError<u32>,
        quoted: &Tuple<u32>,
        outer_dst: &u32,
    ) -> Result<(), i64> {
        nat::rewrite_icmp_error_v4(ctx, error, quoted, *outer_dst)
    }
    #[inline(always)]
    fn redirect(ctx: &TcContext, to: &Tuple<u32>, proto: u8, l4_off: usize) -> i32 {
        route::redirect_v4(ctx, to.src.0, to.dst.0, proto, l4_off)
    }
    #[inline(always)]
    fn refuse(ctx: &TcContext, flow: &LbFlow<u32>) -> i32 {
        reject::refuse_v4(ctx, flow)
    }
    #[inline(always)]
    fn frag_needed(ctx: &TcContext, flow: &LbFlow<u32>, to: &Tuple<u32>, mtu: u16) -> i32 {
        reject::frag_needed_v4(ctx, flow, to, mtu)
    }
    #[inline(always)]
    fn tunnel(ctx: &TcContext, backend: &(u32, u16), proto: u8, l4_off: usize) -> i32 {
        dsr::tunnel(ctx, backend, proto, l4_off)
    }
}

impl Family for V6 {
    type Addr = Ipv6Words;

    fn services() -> &'static HashMap<ServiceKeyV6, ServiceValue> {
        &SERVICES_V6
    }
    fn slots() -> &'static HashMap<BackendSlotKey, BackendSlotValue> {
        &BACKEND_SLOTS_V6
    }
    fn backends() -> &'static HashMap<u32, BackendV6> {
        &BACKENDS_V6
    }
    fn ct_gate() -> &'static LruHashMap<ServiceKeyV6, u64> {
        &CT_GATE_V6
    }
    fn conntrack() -> &'static LruHashMap<CtKeyV6, CtValueV6> {
        &CONNTRACK_V6
    }
    fn affinity() -> &'static LruHashMap<AffinityKeyV6, AffinityValue> {
        &AFFINITY_V6
    }
    fn fragments() -> &'static LruHashMap<FragKeyV6, FragPorts> {
        &FRAGMENTS_V6
    }
    fn ct_scratch() -> &'static PerCpuArray<CtScratch<Ipv6Words>> {
        &CT_SCRATCH_V6
    }
    fn work() -> &'static PerCpuArray<Work<Ipv6Words>> {
        &WORK_V6
    }
    fn forwarded() -> &'static PerCpuArray<CtKeyV6> {
        &FORWARDED_V6
    }
    fn svc_stats() -> &'static PerCpuHashMap<ServiceKeyV6, ServiceStats> {
        &SVC_STATS_V6
    }
    #[inline(never)]
    fn parse<C: Packet>(ctx: &C, out: &mut LbParsed<Ipv6Words>) -> bool {
        parsing::parse_lb_v6(ctx, out).is_ok()
    }
    #[inline(always)]
    fn cluster_net(addr: &Ipv6Words) -> u32 {
        CLUSTER_NETS_V6.get(Key::new(128, *addr)).copied().unwrap_or(0)
    }
    #[inline(always)]
    fn source_allowed(service_id: u32, src: &Ipv6Words) -> bool {
        let key = SourceRangeKey { service_id: service_id.to_be(), addr: *src };
        SOURCE_RANGES_V6.get(Key::new(160, key)).is_some()
    }
    #[inline(always)]
    fn snat_addr(config: &LbConfig) -> Option<Ipv6Words> {
        (config.snat_addr_v6 != Ipv6Words::UNSPECIFIED).then_some(config.snat_addr_v6)
    }
    #[inline(always)]
    fn rewrite(ctx: &TcContext, flow: &LbFlow<Ipv6Words>, to: &Tuple<Ipv6Words>) -> Result<(), i64> {
        nat::rewrite_v6(ctx, flow, to)
    }
    #[inline(always)]
    fn rewrite_icmp_error(
        ctx: &TcContext,
        error: &IcmpError<Ipv6Words>,
        quoted: &Tuple<Ipv6Words>,
        outer_dst: &Ipv6Words,
    ) -> Result<(), i64> {
        nat::rewrite_icmp_error_v6(ctx, error, quoted, outer_dst)
    }
    #[inline(always)]
    fn redirect(ctx: &TcContext, to: &Tuple<Ipv6Words>, proto: u8, l4_off: usize) -> i32 {
        route::redirect_v6(ctx, &to.src.0, &to.dst.0, proto, l4_off)
    }
    #[inline(always)]
    fn refuse(ctx: &TcContext, flow: &LbFlow<Ipv6Words>) -> i32 {
        reject::refuse_v6(ctx, flow)
    }
    #[inline(always)]
    fn frag_needed(ctx: &TcContext, flow: &LbFlow<Ipv6Words>, to: &Tuple<Ipv6Words>, mtu: u16) -> i32 {
        reject::frag_needed_v6(ctx, flow, to, mtu)
    }
    #[inline(always)]
    fn tunnel(ctx: &TcContext, backend: &(Ipv6Words, u16), proto: u8, l4_off: usize) -> i32 {
        dsr::tunnel_v6(ctx, backend, proto, l4_off)
    }
}
