//! Ethernet / IPv4 / TCP / UDP (and, for policy, SCTP / ICMP) header parsing with bounds-checked skb loads.
use aya_ebpf::programs::TcContext;
use kube_router_common::{IPPROTO_ICMP, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP};

pub const ETH_HDR_LEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
pub const IP_CSUM_OFF: usize = ETH_HDR_LEN + 10;
pub const IP_SRC_OFF: usize = ETH_HDR_LEN + 12;
pub const IP_DST_OFF: usize = ETH_HDR_LEN + 16;

pub const TCP_FLAG_FIN: u8 = 0x01;
pub const TCP_FLAG_RST: u8 = 0x04;

/// What the load balancer and the policy check need of a packet. Addresses and ports stay in network byte order.
pub struct Flow {
    pub src_addr: u32,
    pub dst_addr: u32,
    pub src_port: u16,
    pub dst_port: u16,
    pub proto: u8,
    pub tcp_flags: u8,
    /// Offset of the L4 header from the start of the frame.
    pub l4_off: usize,
}

pub enum Parsed {
    Flow(Flow),
    NotIpv4,
    /// A non-first fragment (or a fragmented datagram): it carries no ports.
    Fragment,
    /// IPv4 but a protocol this view does not handle (passed untouched).
    OtherProtocol,
}

/// The load balancer's view: TCP and UDP; any fragment is passed (its ports cannot be rewritten).
#[inline(always)]
pub fn parse(ctx: &TcContext) -> Result<Parsed, i64> {
    parse_ipv4(ctx, false)
}

/// The policy view: also SCTP and ICMP (echo identifier in both ports, so a reply's
/// conntrack key matches its request). A first fragment carries the ports and is judged like
/// any packet; only later fragments are `Fragment`.
#[inline(always)]
pub fn parse_for_policy(ctx: &TcContext) -> Result<Parsed, i64> {
    parse_ipv4(ctx, true)
}

const ICMP_ECHO_REPLY: u8 = 0;
const ICMP_ECHO_REQUEST: u8 = 8;

// `policy` is a constant at every call site, so each program only keeps its own branches.
#[inline(always)]
fn parse_ipv4(ctx: &TcContext, policy: bool) -> Result<Parsed, i64> {
    let ether_type = u16::from_be(ctx.load::<u16>(12)?);
    if ether_type != ETH_P_IP {
        return Ok(Parsed::NotIpv4);
    }
    let version_ihl: u8 = ctx.load(ETH_HDR_LEN)?;
    let header_len = ((version_ihl & 0x0f) as usize) * 4;
    if version_ihl >> 4 != 4 || header_len < 20 {
        return Ok(Parsed::NotIpv4);
    }
    let proto: u8 = ctx.load(ETH_HDR_LEN + 9)?;
    let ported = proto == IPPROTO_TCP || proto == IPPROTO_UDP || (policy && proto == IPPROTO_SCTP);
    let icmp = policy && proto == IPPROTO_ICMP;
    if !ported && !icmp {
        return Ok(Parsed::OtherProtocol);
    }
    // More-fragments flag or a fragment offset: ports are not (all) there.
    let frag = u16::from_be(ctx.load::<u16>(ETH_HDR_LEN + 6)?);
    let fragment_mask = if policy { 0x1fff } else { 0x3fff };
    if frag & fragment_mask != 0 {
        return Ok(Parsed::Fragment);
    }
    let l4_off = ETH_HDR_LEN + header_len;
    let (src_port, dst_port) = if icmp {
        let icmp_type: u8 = ctx.load(l4_off)?;
        if icmp_type == ICMP_ECHO_REQUEST || icmp_type == ICMP_ECHO_REPLY {
            let id: u16 = ctx.load(l4_off + 4)?;
            (id, id)
        } else {
            (0, 0)
        }
    } else {
        (ctx.load(l4_off)?, ctx.load(l4_off + 2)?)
    };
    let tcp_flags = if proto == IPPROTO_TCP { ctx.load::<u8>(l4_off + 13)? } else { 0 };
    Ok(Parsed::Flow(Flow {
        src_addr: ctx.load(IP_SRC_OFF)?,
        dst_addr: ctx.load(IP_DST_OFF)?,
        src_port,
        dst_port,
        proto,
        tcp_flags,
        l4_off,
    }))
}
