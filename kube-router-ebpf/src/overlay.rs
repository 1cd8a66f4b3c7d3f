//! The pod overlay between nodes, in the kernel's own wire formats (so nodes with kernel
//! `ipip`/`fou` tunnel devices interoperate) but without tunnel devices:
//!
//! * `encap` (TC egress of the interface towards a tunnel endpoint): an IPv4 packet whose
//!   destination is in `ovl_routes_v4` gets an outer IPv4 header (and for FOU a UDP + GUE
//!   header) in front, from this node to the node behind the prefix. The kernel route already
//!   sent it to the underlay next hop towards that node, so the frame's link layer is right.
//! * `decap` (TC ingress): an IPIP (or FOU/GUE) packet from a node in `ovl_remotes_v4` to its
//!   tunnel's local address loses its outer headers and continues as the inner packet.
//!
//! Anything else is passed untouched. `bpf_skb_adjust_room` keeps GSO and checksum state
//! right (the ENCAP/DECAP flags mark the tunnel for segmentation).
use aya_ebpf::{
    bindings::{
        bpf_adj_room_mode::BPF_ADJ_ROOM_MAC, BPF_F_ADJ_ROOM_DECAP_L3_IPV4, BPF_F_ADJ_ROOM_ENCAP_L3_IPV4,
        BPF_F_ADJ_ROOM_ENCAP_L4_UDP, TC_ACT_UNSPEC,
    },
    helpers::bpf_get_hash_recalc,
    maps::lpm_trie::Key,
    programs::TcContext,
};
use kube_router_common::{ovl_stat, OverlayPrefixV4, OVERLAY_ENCAP_FOU, OVERLAY_ENCAP_IPIP};

use crate::{
    maps::{count_overlay, OVERLAY_REMOTES, OVERLAY_ROUTES},
    parsing::{ETH_HDR_LEN, IP_DST_OFF, IP_SRC_OFF},
};

const ETH_P_IP: u16 = 0x0800;
pub(crate) const IPPROTO_IPIP: u8 = 4;
const IPPROTO_UDP: u8 = 17;
pub(crate) const IP_HDR_LEN: usize = 20;
const UDP_GUE_LEN: usize = 12;
/// Outer headers' TTL (IPv4) or hop limit (IPv6).
pub(crate) const OUTER_TTL: u8 = 64;
pub(crate) const IP_DF: u16 = 0x4000;

/// The outer IPv4 header, as it goes on the wire (multi-byte fields in network order).
#[repr(C)]
struct OuterIpv4 {
    version_ihl: u8,
    tos: u8,
    total_len: u16,
    id: u16,
    frag: u16,
    ttl: u8,
    protocol: u8,
    checksum: u16,
    src: u32,
    dst: u32,
}

/// UDP header followed by a GUE (variant 0) header carrying IPIP.
#[repr(C)]
struct UdpGue {
    src_port: u16,
    dst_port: u16,
    len: u16,
    checksum: u16,
    gue_flags: u8,
    gue_proto: u8,
    gue_more_flags: u16,
}

fn ipv4_checksum(h: &OuterIpv4) -> u16 {
    // Sum of the header's 16-bit words (as stored, i.e. network order read back), folded.
    let words = [
        u16::from_be_bytes([h.version_ihl, h.tos]) as u32,
        u16::from_be(h.total_len) as u32,
        u16::from_be(h.id) as u32,
        u16::from_be(h.frag) as u32,
        u16::from_be_bytes([h.ttl, h.protocol]) as u32,
        (u32::from_be(h.src) >> 16),
        (u32::from_be(h.src) & 0xffff),
        (u32::from_be(h.dst) >> 16),
        (u32::from_be(h.dst) & 0xffff),
    ];
    let mut sum: u32 = 0;
    for w in words {
        sum += w;
    }
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    (!(sum as u16)).to_be()
}

/// The outer IPv4 header to put in front of an IPv4 packet.
pub(crate) struct OuterSpec {
    /// Bytes added in all: the outer IPv4 header and whatever the caller writes after it.
    pub overhead: usize,
    /// `bpf_skb_adjust_room` flags (`BPF_F_ADJ_ROOM_ENCAP_*`).
    pub flags: u64,
    pub protocol: u8,
    pub src: u32,
    pub dst: u32,
    /// The IP ID, as it goes on the wire.
    pub id: u16,
    /// DF whatever the inner packet says (the ID then means nothing to reassembly, RFC 6864).
    pub always_df: bool,
}

/// Makes room for `outer` in front of the IPv4 packet and writes its IPv4 header (the inner
/// packet's TOS; DF as the inner packet has it unless `always_df`); the inner packet's length,
/// or `None` if the room could not be made (the packet is unchanged).
#[inline(always)]
pub(crate) fn push_outer_ipv4(ctx: &TcContext, outer: &OuterSpec) -> Result<Option<u16>, i64> {
    let tos: u8 = ctx.load(ETH_HDR_LEN + 1)?;
    let inner_len = u16::from_be(ctx.load::<u16>(ETH_HDR_LEN + 2)?);
    let inner_frag = u16::from_be(ctx.load::<u16>(ETH_HDR_LEN + 6)?);
    if ctx.adjust_room(outer.overhead as i32, BPF_ADJ_ROOM_MAC, outer.flags).is_err() {
        return Ok(None);
    }
    let mut header = OuterIpv4 {
        version_ihl: 0x45,
        tos,
        total_len: (inner_len + outer.overhead as u16).to_be(),
        id: outer.id,
        // Don't fragment what the inner packet said not to.
        frag: (if outer.always_df { IP_DF } else { inner_frag & IP_DF }).to_be(),
        ttl: OUTER_TTL,
        protocol: outer.protocol,
        checksum: 0,
        src: outer.src,
        dst: outer.dst,
    };
    header.checksum = ipv4_checksum(&header);
    ctx.store(ETH_HDR_LEN, &header, 0)?;
    Ok(Some(inner_len))
}

#[inline(always)]
fn is_ipv4(ctx: &TcContext) -> Result<bool, i64> {
    Ok(u16::from_be(ctx.load::<u16>(12)?) == ETH_P_IP)
}

/// TC egress: encapsulate packets to pod CIDRs behind a tunnel.
#[inline(always)]
pub fn encap(ctx: &TcContext) -> Result<i32, i64> {
    if !is_ipv4(ctx)? {
        return Ok(TC_ACT_UNSPEC);
    }
    let dst: u32 = ctx.load(IP_DST_OFF)?;
    let Some(tunnel) = OVERLAY_ROUTES.get(Key::new(32, OverlayPrefixV4 { addr: dst })) else {
        return Ok(TC_ACT_UNSPEC);
    };
    let tunnel = *tunnel;
    let fou = tunnel.encap == OVERLAY_ENCAP_FOU;
    let (overhead, protocol, flags) = if fou {
        (IP_HDR_LEN + UDP_GUE_LEN, IPPROTO_UDP, (BPF_F_ADJ_ROOM_ENCAP_L3_IPV4 | BPF_F_ADJ_ROOM_ENCAP_L4_UDP) as u64)
    } else {
        (IP_HDR_LEN, IPPROTO_IPIP, BPF_F_ADJ_ROOM_ENCAP_L3_IPV4 as u64)
    };
    // Hashed before the headers move: the inner flow picks the FOU source port (ECMP in the
    // underlay spreads flows, not packets).
    let hash = unsafe { bpf_get_hash_recalc(ctx.skb.skb) };
    let outer = OuterSpec { overhead, flags, protocol, src: tunnel.local, dst: tunnel.remote, id: 0, always_df: false };
    let Some(inner_len) = push_outer_ipv4(ctx, &outer)? else {
        count_overlay(ovl_stat::ENCAP_FAILED);
        return Ok(TC_ACT_UNSPEC);
    };
    if fou {
        let udp = UdpGue {
            src_port: ((hash >> 16) as u16 | 0xc000).to_be(),
            dst_port: tunnel.port,
            len: (inner_len + UDP_GUE_LEN as u16).to_be(),
            // An IPv4 UDP checksum of zero means none (the inner packet carries its own).
            checksum: 0,
            gue_flags: 0,
            gue_proto: IPPROTO_IPIP,
            gue_more_flags: 0,
        };
        ctx.store(ETH_HDR_LEN + IP_HDR_LEN, &udp, 0)?;
    }
    count_overlay(ovl_stat::ENCAPSULATED);
    Ok(TC_ACT_UNSPEC)
}

/// TC ingress: strip the outer headers of tunnelled packets from known nodes.
#[inline(always)]
pub fn decap(ctx: &TcContext) -> Result<i32, i64> {
    if !is_ipv4(ctx)? {
        return Ok(TC_ACT_UNSPEC);
    }
    let version_ihl: u8 = ctx.load(ETH_HDR_LEN)?;
    let protocol: u8 = ctx.load(ETH_HDR_LEN + 9)?;
    // Only option-less outer headers, as every sender of ours writes them.
    if version_ihl != 0x45 || (protocol != IPPROTO_IPIP && protocol != IPPROTO_UDP) {
        return Ok(TC_ACT_UNSPEC);
    }
    let src: u32 = ctx.load(IP_SRC_OFF)?;
    let dst: u32 = ctx.load(IP_DST_OFF)?;
    let overhead = if protocol == IPPROTO_IPIP {
        IP_HDR_LEN
    } else {
        // FOU: UDP to our port, GUE variant 0 without options, carrying IPIP.
        let udp_dst: u16 = ctx.load(ETH_HDR_LEN + IP_HDR_LEN + 2)?;
        let gue_flags: u8 = ctx.load(ETH_HDR_LEN + IP_HDR_LEN + 8)?;
        let gue_proto: u8 = ctx.load(ETH_HDR_LEN + IP_HDR_LEN + 9)?;
        let Some(tunnel) = (unsafe { OVERLAY_REMOTES.get(src) }) else {
            return Ok(TC_ACT_UNSPEC);
        };
        if tunnel.encap != OVERLAY_ENCAP_FOU || udp_dst != tunnel.port || gue_flags != 0 || gue_proto != IPPROTO_IPIP {
            return Ok(TC_ACT_UNSPEC);
        }
        IP_HDR_LEN + UDP_GUE_LEN
    };
    let Some(tunnel) = (unsafe { OVERLAY_REMOTES.get(src) }) else {
        if protocol == IPPROTO_IPIP {
            count_overlay(ovl_stat::UNKNOWN_REMOTE);
        }
        return Ok(TC_ACT_UNSPEC);
    };
    if tunnel.local != dst || (protocol == IPPROTO_IPIP && tunnel.encap != OVERLAY_ENCAP_IPIP) {
        return Ok(TC_ACT_UNSPEC);
    }
    if ctx.adjust_room(-(overhead as i32), BPF_ADJ_ROOM_MAC, BPF_F_ADJ_ROOM_DECAP_L3_IPV4 as u64).is_err() {
        count_overlay(ovl_stat::DECAP_FAILED);
        return Ok(TC_ACT_UNSPEC);
    }
    count_overlay(ovl_stat::DECAPSULATED);
    Ok(TC_ACT_UNSPEC)
}
