//! Source-address verification on pod veths (anti-spoofing), as Cilium's source IP verification
//! and Calico's RPF check on workload interfaces: a packet from a pod whose source address is not
//! one of that pod's own is dropped. The agent writes each pod veth's addresses into `pod_src`
//! (read from the pod's network namespace, which the pod cannot change without CAP_NET_ADMIN).
//!
//! The first of our programs at TC ingress of the veth checks (`PodSources::checked_by`): the load
//! balancer when it is attached, since its source NAT (hairpin, masquerade) changes the source
//! before the policy program sees it; the policy program otherwise.
use aya_ebpf::{
    macros::map,
    maps::{HashMap, PerCpuArray},
    programs::TcContext,
};
use kube_router_common::*;

use crate::{packet, plain};

#[map(name = "pod_src")]
static POD_SOURCES: HashMap<u32, PodSources> = HashMap::pinned(POD_SOURCES_MAX_ENTRIES, 0);

#[map(name = "src_chk_stats")]
static SOURCE_CHECK_STATS: PerCpuArray<u64> = PerCpuArray::pinned(src_stat::COUNT, 0);

const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const ETH_P_ARP: u16 = 0x0806;
const IPPROTO_ICMPV6: u8 = 58;
const IPV4_SRC_OFFSET: usize = 14 + 12;
const IPV6_NEXT_HEADER_OFFSET: usize = 14 + 6;
const IPV6_SRC_OFFSET: usize = 14 + 8;
const ARP_PROTO_OFFSET: usize = 14 + 2;
const ARP_PROTO_LEN_OFFSET: usize = 14 + 5;
const ARP_SENDER_IP_OFFSET: usize = 14 + 14;

#[inline(always)]
fn count(stat: u32) {
    crate::maps::bump(&SOURCE_CHECK_STATS, stat);
}

/// `spoofed`, unless the plain-traffic cache knows the packet's source passes this interface's
/// check (then counted as the check would have).
#[inline(always)]
pub fn spoofed_unless_known(ctx: &TcContext, checker: u8) -> bool {
    let passes = if checker == SOURCE_CHECK_BY_LB { plain::SOURCE_OK_LB } else { plain::SOURCE_OK_POLICY };
    let known = plain::known_again(passes);
    if known != 0 {
        let counted = counted_by(checker);
        if known & counted != 0 {
            count_passed();
            plain::note(counted);
        }
        return false;
    }
    if spoofed(ctx, checker) {
        return true;
    }
    plain::remember(passes);
    false
}

#[inline(always)]
fn counted_by(checker: u8) -> u32 {
    if checker == SOURCE_CHECK_BY_LB {
        plain::SOURCE_COUNTED_BY_LB
    } else {
        plain::SOURCE_COUNTED_BY_POLICY
    }
}

/// The packet comes from a pod veth `checker` checks, with a source that is not the pod's: drop.
// Not inlined: a frame of its own, called before the callers' deep call chains, adds nothing to
// their combined stack (512 bytes at most).
#[inline(never)]
fn spoofed(ctx: &TcContext, checker: u8) -> bool {
    // SAFETY: reading a field of the context the program was called with.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: the value is only read, in place (the agent replaces entries whole).
    let Some(sources) = (unsafe { POD_SOURCES.get(ifindex) }) else {
        return false;
    };
    if sources.checked_by != checker {
        return false;
    }
    count(src_stat::PACKETS);
    // A frame too short for the header it announces cannot be judged: dropped as spoofed.
    let refused = match packet::load::<u16>(ctx, 12).map(u16::from_be) {
        Ok(ETH_P_IP) => ipv4_refused(ctx, sources).unwrap_or(Some(src_stat::SPOOFED_V4)),
        Ok(ETH_P_IPV6) => ipv6_refused(ctx, sources).unwrap_or(Some(src_stat::SPOOFED_V6)),
        Ok(ETH_P_ARP) => arp_refused(ctx, sources).unwrap_or(Some(src_stat::SPOOFED_ARP)),
        // Neither IP nor ARP: no source address to check (the bridge's peers ignore it).
        _ => None,
    };
    match refused {
        None => {
            count(src_stat::PASSED);
            plain::note(counted_by(checker));
            false
        }
        Some(stat) => {
            count(stat);
            count_if_unresolved(sources, stat);
            true
        }
    }
}

/// A packet the plain-traffic cache knows checked and passed: counted as the check would have.
#[inline(always)]
pub fn count_passed() {
    count(src_stat::PACKETS);
    count(src_stat::PASSED);
}

/// Counts a drop of a family whose addresses are not known yet as such too.
#[inline(always)]
fn count_if_unresolved(sources: &PodSources, stat: u32) {
    let unresolved = match stat {
        src_stat::SPOOFED_V6 => sources.v6_count == 0,
        _ => sources.v4_count == 0,
    };
    if unresolved {
        count(src_stat::UNRESOLVED);
    }
}

#[inline(always)]
fn own_v4(sources: &PodSources, addr: u32) -> bool {
    let mut i = 0;
    while i < POD_SOURCE_ADDRS {
        if i < sources.v4_count as usize && sources.v4[i] == addr {
            return true;
        }
        i += 1;
    }
    false
}

#[inline(always)]
fn ipv4_refused(ctx: &TcContext, sources: &PodSources) -> Result<Option<u32>, i64> {
    let src = packet::load::<u32>(ctx, IPV4_SRC_OFFSET)?;
    Ok((!own_v4(sources, src)).then_some(src_stat::SPOOFED_V4))
}

#[inline(always)]
fn ipv6_refused(ctx: &TcContext, sources: &PodSources) -> Result<Option<u32>, i64> {
    let src = Ipv6Words(packet::load::<[u32; 4]>(ctx, IPV6_SRC_OFFSET)?);
    let mut i = 0;
    while i < POD_SOURCE_ADDRS {
        if i < sources.v6_count as usize && sources.v6[i] == src {
            return Ok(None);
        }
        i += 1;
    }
    // Neighbour discovery and MLD before (or whatever) the pod's addresses are known: from the
    // unspecified address (duplicate address detection) or a link-local one, ICMPv6 only.
    let unspecified = src.0 == [0; 4];
    let link_local = u32::from_be(src.0[0]) & 0xffc0_0000 == 0xfe80_0000;
    let next_header = ctx.load::<u8>(IPV6_NEXT_HEADER_OFFSET)?;
    if (unspecified || link_local) && next_header == IPPROTO_ICMPV6 {
        return Ok(None);
    }
    Ok(Some(src_stat::SPOOFED_V6))
}

/// ARP for IPv4 must name one of the pod's addresses as its sender (or none: an RFC 5227 probe),
/// or the pod could take another pod's address over on the bridge.
#[inline(always)]
fn arp_refused(ctx: &TcContext, sources: &PodSources) -> Result<Option<u32>, i64> {
    let proto = u16::from_be(ctx.load::<u16>(ARP_PROTO_OFFSET)?);
    if proto != ETH_P_IP || ctx.load::<u8>(ARP_PROTO_LEN_OFFSET)? != 4 {
        return Ok(None);
    }
    let sender = ctx.load::<u32>(ARP_SENDER_IP_OFFSET)?;
    Ok((sender != 0 && !own_v4(sources, sender)).then_some(src_stat::SPOOFED_ARP))
}
