//! Ethernet / IPv4 / TCP / UDP (and, for policy, SCTP / ICMP) header parsing with bounds-checked skb loads.
use aya_ebpf::programs::TcContext;
use kube_router_common::{IPPROTO_ICMP, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP};

pub const ETH_HDR_LEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
pub const IP_TOT_LEN_OFF: usize = ETH_HDR_LEN + 2;
pub const IP_TTL_OFF: usize = ETH_HDR_LEN + 8;
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
}

pub enum Parsed {
    Flow(Flow),
    NotIpv4,
    /// A non-first fragment (or a fragmented datagram): it carries no ports.
    Fragment,
    /// IPv4 but a protocol this view does not handle (passed untouched).
    OtherProtocol,
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
    }))
}

/// Where a packet stands in its datagram.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Fragment {
    /// A whole datagram.
    Whole,
    /// The first fragment: it carries the ports and the L4 checksum of the whole datagram.
    First,
    /// A later fragment: no L4 header; its ports are the first fragment's.
    Later,
}

/// The load balancer's view of a TCP or UDP packet. Addresses and ports in network byte order.
pub struct LbFlow {
    pub src_addr: u32,
    pub dst_addr: u32,
    /// 0 in a [`Fragment::Later`] packet until the first fragment's ports are filled in.
    pub src_port: u16,
    pub dst_port: u16,
    pub proto: u8,
    pub tcp_flags: u8,
    pub l4_off: usize,
    pub fragment: Fragment,
    /// IP identification, network byte order (names a fragmented datagram).
    pub ip_id: u16,
}

impl LbFlow {
    /// The L4 header (ports, checksum) is in this packet.
    #[inline(always)]
    pub fn has_l4(&self) -> bool {
        self.fragment != Fragment::Later
    }
}

/// An ICMP error (destination unreachable, time exceeded, parameter problem) quoting a TCP or
/// UDP packet: the quoted packet is the one the error is about, as its sender sent it.
pub struct IcmpError {
    pub outer_dst: u32,
    pub icmp_off: usize,
    pub inner_ip_off: usize,
    pub inner_l4_off: usize,
    pub inner_src_addr: u32,
    pub inner_dst_addr: u32,
    pub inner_src_port: u16,
    pub inner_dst_port: u16,
    pub inner_proto: u8,
}

pub enum LbPacket {
    Flow(LbFlow),
    IcmpError(IcmpError),
    NotIpv4,
    /// IPv4 but not something the load balancer translates: passed untouched.
    Other,
}

const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_TIME_EXCEEDED: u8 = 11;
const ICMP_PARAMETER_PROBLEM: u8 = 12;

#[inline(always)]
fn ipv4_header_len(ctx: &TcContext, ip_off: usize) -> Result<Option<usize>, i64> {
    let version_ihl: u8 = ctx.load(ip_off)?;
    let header_len = ((version_ihl & 0x0f) as usize) * 4;
    Ok((version_ihl >> 4 == 4 && header_len >= 20).then_some(header_len))
}

/// TCP and UDP, fragments included (a later fragment has no ports yet), ICMP echo (its
/// identifier as both ports), and ICMP errors about TCP or UDP packets.
#[inline(always)]
pub fn parse_lb(ctx: &TcContext) -> Result<LbPacket, i64> {
    let ether_type = u16::from_be(ctx.load::<u16>(12)?);
    if ether_type != ETH_P_IP {
        return Ok(LbPacket::NotIpv4);
    }
    let Some(header_len) = ipv4_header_len(ctx, ETH_HDR_LEN)? else {
        return Ok(LbPacket::NotIpv4);
    };
    let proto: u8 = ctx.load(ETH_HDR_LEN + 9)?;
    let l4_off = ETH_HDR_LEN + header_len;
    let frag = u16::from_be(ctx.load::<u16>(ETH_HDR_LEN + 6)?);
    let fragment = if frag & 0x1fff != 0 {
        Fragment::Later
    } else if frag & 0x2000 != 0 {
        Fragment::First
    } else {
        Fragment::Whole
    };
    if proto == IPPROTO_ICMP {
        if fragment != Fragment::Whole {
            return Ok(LbPacket::Other);
        }
        let icmp_type: u8 = ctx.load(l4_off)?;
        if icmp_type != ICMP_ECHO_REQUEST && icmp_type != ICMP_ECHO_REPLY {
            return parse_icmp_error(ctx, l4_off);
        }
        // An echo's identifier stands for both ports: request and reply share the key.
        let id: u16 = ctx.load(l4_off + 4)?;
        return Ok(LbPacket::Flow(LbFlow {
            src_addr: ctx.load(IP_SRC_OFF)?,
            dst_addr: ctx.load(IP_DST_OFF)?,
            src_port: id,
            dst_port: id,
            proto,
            tcp_flags: 0,
            l4_off,
            fragment,
            ip_id: ctx.load(ETH_HDR_LEN + 4)?,
        }));
    }
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP {
        return Ok(LbPacket::Other);
    }
    let (src_port, dst_port, tcp_flags) = if fragment == Fragment::Later {
        (0, 0, 0)
    } else {
        let flags = if proto == IPPROTO_TCP { ctx.load::<u8>(l4_off + 13)? } else { 0 };
        (ctx.load(l4_off)?, ctx.load(l4_off + 2)?, flags)
    };
    Ok(LbPacket::Flow(LbFlow {
        src_addr: ctx.load(IP_SRC_OFF)?,
        dst_addr: ctx.load(IP_DST_OFF)?,
        src_port,
        dst_port,
        proto,
        tcp_flags,
        l4_off,
        fragment,
        ip_id: ctx.load(ETH_HDR_LEN + 4)?,
    }))
}

#[inline(always)]
fn parse_icmp_error(ctx: &TcContext, icmp_off: usize) -> Result<LbPacket, i64> {
    let icmp_type: u8 = ctx.load(icmp_off)?;
    if icmp_type != ICMP_DEST_UNREACH && icmp_type != ICMP_TIME_EXCEEDED && icmp_type != ICMP_PARAMETER_PROBLEM {
        return Ok(LbPacket::Other);
    }
    let inner_ip_off = icmp_off + 8;
    let Some(inner_len) = ipv4_header_len(ctx, inner_ip_off)? else {
        return Ok(LbPacket::Other);
    };
    let inner_proto: u8 = ctx.load(inner_ip_off + 9)?;
    if inner_proto != IPPROTO_TCP && inner_proto != IPPROTO_UDP {
        return Ok(LbPacket::Other);
    }
    let inner_l4_off = inner_ip_off + inner_len;
    Ok(LbPacket::IcmpError(IcmpError {
        outer_dst: ctx.load(IP_DST_OFF)?,
        icmp_off,
        inner_ip_off,
        inner_l4_off,
        inner_src_addr: ctx.load(inner_ip_off + 12)?,
        inner_dst_addr: ctx.load(inner_ip_off + 16)?,
        inner_src_port: ctx.load(inner_l4_off)?,
        inner_dst_port: ctx.load(inner_l4_off + 2)?,
        inner_proto,
    }))
}
