//! Ethernet / IPv4 / TCP / UDP (and, for policy, SCTP / ICMP) header parsing with bounds-checked
//! loads; the load balancer's view works on TC and XDP packets alike (see `packet`).
use aya_ebpf::programs::TcContext;

use crate::packet::Packet;
use kube_router_common::{Ipv6Words, IPPROTO_ICMP, IPPROTO_ICMPV6, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP};

pub const ETH_HDR_LEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
pub const IP_TOT_LEN_OFF: usize = ETH_HDR_LEN + 2;
pub const IP_TTL_OFF: usize = ETH_HDR_LEN + 8;
pub const IP_CSUM_OFF: usize = ETH_HDR_LEN + 10;
pub const IP_SRC_OFF: usize = ETH_HDR_LEN + 12;
pub const IP_DST_OFF: usize = ETH_HDR_LEN + 16;

pub const TCP_FLAG_FIN: u8 = 0x01;
pub const TCP_FLAG_RST: u8 = 0x04;
pub const TCP_FLAG_SYN: u8 = 0x02;
pub const TCP_FLAG_ACK: u8 = 0x10;

/// What the policy check needs of a packet. Addresses and ports stay in network byte order;
/// `A` is `u32` (IPv4) or [`Ipv6Words`].
pub struct Flow<A = u32> {
    pub src_addr: A,
    pub dst_addr: A,
    pub src_port: u16,
    pub dst_port: u16,
    pub proto: u8,
    pub tcp_flags: u8,
    /// An ICMP(v6) error: the packet it quotes, as that packet's sender sent it (protocol 0
    /// when there is none, or it is not a TCP/UDP/SCTP header we can read). Not an `Option`:
    /// every byte stays initialised for the verifier.
    pub quoted: Quoted<A>,
}

/// The endpoints of the packet an ICMP(v6) error quotes. Network byte order.
#[derive(Clone, Copy)]
pub struct Quoted<A> {
    /// 0: nothing quoted.
    pub src_addr: A,
    pub dst_addr: A,
    pub src_port: u16,
    pub dst_port: u16,
    pub proto: u8,
}

impl Quoted<u32> {
    const NONE_V4: Self = Quoted { src_addr: 0, dst_addr: 0, src_port: 0, dst_port: 0, proto: 0 };
}

impl Quoted<Ipv6Words> {
    const NONE_V6: Self =
        Quoted { src_addr: Ipv6Words([0; 4]), dst_addr: Ipv6Words([0; 4]), src_port: 0, dst_port: 0, proto: 0 };
}

pub enum Parsed<A = u32> {
    Flow(Flow<A>),
    /// The ethertype's family but not its header (version or header length wrong).
    NotIpv4,
    /// A non-first fragment (or a fragmented datagram): it carries no ports.
    Fragment,
    /// Link control the stack cannot work without (IPv6 neighbour discovery, router
    /// advertisements, multicast listener messages): passed unjudged.
    LinkControl,
}

/// The policy view: every IP protocol. TCP, UDP and SCTP with their ports, ICMP echo with its
/// identifier in both ports (so a reply's conntrack key matches its request), every other
/// protocol (ICMP errors, GRE, IPIP, ...) with ports 0: only a rule without ports admits it.
/// A first fragment carries the ports and is judged like any packet; only later fragments are
/// `Fragment`.
#[inline(always)]
pub fn parse_for_policy(ctx: &TcContext) -> Result<Parsed, i64> {
    parse_ipv4(ctx)
}

/// The policy view of an IPv6 packet: as [`parse_for_policy`], with extension headers looked
/// past (a bounded number). ICMPv6 echo is judged like ICMP echo and errors (types below 128)
/// without ports; the link's own control messages (multicast listener queries, reports and
/// done, types 130-132 and 143; router and neighbour solicitations and advertisements and
/// redirects, 133-137) are `LinkControl`: a pod must always be able to resolve its neighbours
/// and join its groups, and they open no connection to track. Every other ICMPv6 type is judged
/// without ports. A packet whose upper layer lies beyond the headers we look past is judged as
/// protocol 255 without ports, so only a rule admitting every port can let it through: never
/// passed unjudged.
#[inline(always)]
pub fn parse_for_policy_v6(ctx: &TcContext) -> Result<Parsed<Ipv6Words>, i64> {
    let version: u8 = ctx.load(ETH_HDR_LEN)?;
    if version >> 4 != 6 {
        return Ok(Parsed::NotIpv4);
    }
    let next: u8 = ctx.load(ETH_HDR_LEN + 6)?;
    let (src_addr, dst_addr) = (ctx.load(IPV6_SRC_OFF)?, ctx.load(IPV6_DST_OFF)?);
    let Some((proto, l4_off, fragment, _)) = ipv6_upper_layer(ctx, next, ETH_HDR_LEN + IPV6_HDR_LEN)? else {
        return Ok(Parsed::Flow(Flow {
            src_addr,
            dst_addr,
            src_port: 0,
            dst_port: 0,
            proto: 255,
            tcp_flags: 0,
            quoted: Quoted::NONE_V6,
        }));
    };
    if fragment == Fragment::Later {
        return Ok(Parsed::Fragment);
    }
    let mut quoted = Quoted::NONE_V6;
    let (src_port, dst_port) = match proto {
        IPPROTO_TCP | IPPROTO_UDP | IPPROTO_SCTP => (ctx.load(l4_off)?, ctx.load(l4_off + 2)?),
        IPPROTO_ICMPV6 => {
            let icmp_type: u8 = ctx.load(l4_off)?;
            if icmp_type == ICMPV6_ECHO_REQUEST || icmp_type == ICMPV6_ECHO_REPLY {
                let id: u16 = ctx.load(l4_off + 4)?;
                (id, id)
            } else if is_ipv6_link_control(icmp_type) {
                return Ok(Parsed::LinkControl);
            } else {
                if (ICMPV6_DEST_UNREACH..=ICMPV6_PARAMETER_PROBLEM).contains(&icmp_type) {
                    quoted = quoted_v6(ctx, l4_off + 8).unwrap_or(Quoted::NONE_V6);
                }
                (0, 0)
            }
        }
        // Every other protocol is judged without ports.
        _ => (0, 0),
    };
    let tcp_flags = if proto == IPPROTO_TCP { ctx.load::<u8>(l4_off + 13)? } else { 0 };
    Ok(Parsed::Flow(Flow { src_addr, dst_addr, src_port, dst_port, proto, tcp_flags, quoted }))
}

/// ICMPv6 types the link needs whatever the policy: multicast listener query, report, done
/// (130-132), router solicitation and advertisement, neighbour solicitation and advertisement,
/// redirect (133-137), multicast listener report v2 (143).
#[inline(always)]
fn is_ipv6_link_control(icmp_type: u8) -> bool {
    (130..=137).contains(&icmp_type) || icmp_type == 143
}

/// The quoted TCP/UDP/SCTP packet of an ICMP error (its own extension headers not walked);
/// `None` if the quote is anything else or too short to name the connection.
#[inline(always)]
fn quoted_v6(ctx: &TcContext, ip_off: usize) -> Option<Quoted<Ipv6Words>> {
    let proto: u8 = ctx.load(ip_off + 6).ok()?;
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP && proto != IPPROTO_SCTP {
        return None;
    }
    let l4_off = ip_off + IPV6_HDR_LEN;
    Some(Quoted {
        src_addr: ctx.load(ip_off + 8).ok()?,
        dst_addr: ctx.load(ip_off + 24).ok()?,
        src_port: ctx.load(l4_off).ok()?,
        dst_port: ctx.load(l4_off + 2).ok()?,
        proto,
    })
}

/// The same for IPv4.
#[inline(always)]
fn quoted_v4(ctx: &TcContext, ip_off: usize) -> Option<Quoted<u32>> {
    let version_ihl: u8 = ctx.load(ip_off).ok()?;
    let header_len = ((version_ihl & 0x0f) as usize) * 4;
    let proto: u8 = ctx.load(ip_off + 9).ok()?;
    if version_ihl >> 4 != 4 || header_len < 20 {
        return None;
    }
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP && proto != IPPROTO_SCTP {
        return None;
    }
    let l4_off = ip_off + header_len;
    Some(Quoted {
        src_addr: ctx.load(ip_off + 12).ok()?,
        dst_addr: ctx.load(ip_off + 16).ok()?,
        src_port: ctx.load(l4_off).ok()?,
        dst_port: ctx.load(l4_off + 2).ok()?,
        proto,
    })
}

const ICMP_ECHO_REPLY: u8 = 0;
const ICMP_ECHO_REQUEST: u8 = 8;

#[inline(always)]
fn parse_ipv4(ctx: &TcContext) -> Result<Parsed, i64> {
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
    let ported = proto == IPPROTO_TCP || proto == IPPROTO_UDP || proto == IPPROTO_SCTP;
    let icmp = proto == IPPROTO_ICMP;
    // A fragment offset: the ports (if any) are in the first fragment, judged on its own.
    let frag = u16::from_be(ctx.load::<u16>(ETH_HDR_LEN + 6)?);
    if frag & 0x1fff != 0 {
        return Ok(Parsed::Fragment);
    }
    let l4_off = ETH_HDR_LEN + header_len;
    let mut quoted = Quoted::NONE_V4;
    let (src_port, dst_port) = if icmp {
        let icmp_type: u8 = ctx.load(l4_off)?;
        if icmp_type == ICMP_ECHO_REQUEST || icmp_type == ICMP_ECHO_REPLY {
            let id: u16 = ctx.load(l4_off + 4)?;
            (id, id)
        } else {
            if icmp_type == ICMP_DEST_UNREACH || icmp_type == ICMP_TIME_EXCEEDED || icmp_type == ICMP_PARAMETER_PROBLEM
            {
                quoted = quoted_v4(ctx, l4_off + 8).unwrap_or(Quoted::NONE_V4);
            }
            (0, 0)
        }
    } else if ported {
        (ctx.load(l4_off)?, ctx.load(l4_off + 2)?)
    } else {
        (0, 0)
    };
    let tcp_flags = if proto == IPPROTO_TCP { ctx.load::<u8>(l4_off + 13)? } else { 0 };
    Ok(Parsed::Flow(Flow {
        src_addr: ctx.load(IP_SRC_OFF)?,
        dst_addr: ctx.load(IP_DST_OFF)?,
        src_port,
        dst_port,
        proto,
        tcp_flags,
        quoted,
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

/// The load balancer's view of a TCP, UDP or ICMP echo packet, IPv4 (`A = u32`) or IPv6
/// ([`Ipv6Words`]). Addresses and ports in network byte order; an echo's identifier stands for
/// both ports.
#[derive(Clone, Copy)]
pub struct LbFlow<A> {
    pub src_addr: A,
    pub dst_addr: A,
    /// 0 in a [`Fragment::Later`] packet until the first fragment's ports are filled in.
    pub src_port: u16,
    pub dst_port: u16,
    pub proto: u8,
    /// TCP's flags; an ICMP echo request's [`TCP_FLAG_SYN`] (see `echo`).
    pub tcp_flags: u8,
    pub l4_off: usize,
    pub fragment: Fragment,
    /// The datagram's identification (names its fragments).
    pub frag_id: u32,
}

impl<A> LbFlow<A> {
    /// The packet may open a flow: a TCP SYN without ACK, an echo request, any UDP datagram.
    /// A reply (a SYN-ACK, a segment of a connection this node never saw open, an echo reply)
    /// may not.
    #[inline(always)]
    pub fn opens_flow(&self) -> bool {
        match self.proto {
            IPPROTO_UDP => true,
            IPPROTO_TCP => self.tcp_flags & (TCP_FLAG_SYN | TCP_FLAG_ACK) == TCP_FLAG_SYN,
            _ => self.tcp_flags & TCP_FLAG_SYN != 0,
        }
    }

    /// The L4 header (ports, checksum) is in this packet.
    #[inline(always)]
    pub fn has_l4(&self) -> bool {
        self.fragment != Fragment::Later
    }
}

/// An ICMP(v6) error (destination unreachable, packet too big, time exceeded, parameter problem)
/// quoting a TCP or UDP packet: the quoted packet is the one the error is about, as sent.
pub struct IcmpError<A> {
    pub outer_dst: A,
    pub icmp_off: usize,
    pub inner_ip_off: usize,
    pub inner_l4_off: usize,
    pub inner_src_addr: A,
    pub inner_dst_addr: A,
    pub inner_src_port: u16,
    pub inner_dst_port: u16,
    pub inner_proto: u8,
}

pub enum LbParsed<A> {
    Flow(LbFlow<A>),
    IcmpError(IcmpError<A>),
    /// Not something the load balancer translates (other protocols, NDP, ...): passed untouched.
    Other,
}

pub enum IpVersion {
    V4,
    V6,
    Neither,
}

const ETH_P_IPV6: u16 = 0x86dd;
pub const IPV6_HDR_LEN: usize = 40;
pub const IPV6_PAYLOAD_LEN_OFF: usize = ETH_HDR_LEN + 4;
pub const IPV6_HOP_LIMIT_OFF: usize = ETH_HDR_LEN + 7;
pub const IPV6_SRC_OFF: usize = ETH_HDR_LEN + 8;
pub const IPV6_DST_OFF: usize = ETH_HDR_LEN + 24;

const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_TIME_EXCEEDED: u8 = 11;
const ICMP_PARAMETER_PROBLEM: u8 = 12;
const ICMPV6_DEST_UNREACH: u8 = 1;
const ICMPV6_PARAMETER_PROBLEM: u8 = 4;
const ICMPV6_ECHO_REQUEST: u8 = 128;
const ICMPV6_ECHO_REPLY: u8 = 129;

const IPPROTO_HOPOPTS: u8 = 0;
const IPPROTO_ROUTING: u8 = 43;
const IPPROTO_FRAGMENT: u8 = 44;
const IPPROTO_AH: u8 = 51;
const IPPROTO_DSTOPTS: u8 = 60;
/// Extension headers walked before giving up on a packet (passed untouched).
const MAX_IPV6_EXT_HEADERS: usize = 4;

#[inline(always)]
fn ipv4_header_len<C: Packet>(ctx: &C, ip_off: usize) -> Result<Option<usize>, i64> {
    let version_ihl: u8 = ctx.load(ip_off)?;
    let header_len = ((version_ihl & 0x0f) as usize) * 4;
    Ok((version_ihl >> 4 == 4 && header_len >= 20).then_some(header_len))
}

#[inline(always)]
pub fn ip_version<C: Packet>(ctx: &C) -> Result<IpVersion, i64> {
    Ok(match u16::from_be(ctx.load::<u16>(12)?) {
        ETH_P_IP => IpVersion::V4,
        ETH_P_IPV6 => IpVersion::V6,
        _ => IpVersion::Neither,
    })
}

/// The load balancer's parse of an IPv4 packet: TCP, UDP (fragments included: a later fragment
/// has no ports yet), ICMP echo, and ICMP errors about TCP or UDP packets.
#[inline(always)]
pub fn parse_lb_v4<C: Packet>(ctx: &C, out: &mut LbParsed<u32>) -> Result<(), i64> {
    let Some(header_len) = ipv4_header_len(ctx, ETH_HDR_LEN)? else {
        return other(out);
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
    let (src_addr, dst_addr) = (ctx.load(IP_SRC_OFF)?, ctx.load(IP_DST_OFF)?);
    let frag_id = u32::from(ctx.load::<u16>(ETH_HDR_LEN + 4)?);
    if proto == IPPROTO_ICMP {
        if fragment != Fragment::Whole {
            return other(out);
        }
        let icmp_type: u8 = ctx.load(l4_off)?;
        if icmp_type == ICMP_ECHO_REQUEST || icmp_type == ICMP_ECHO_REPLY {
            return echo(ctx, (src_addr, dst_addr), proto, l4_off, frag_id, icmp_type == ICMP_ECHO_REQUEST, out);
        }
        if icmp_type != ICMP_DEST_UNREACH && icmp_type != ICMP_TIME_EXCEEDED && icmp_type != ICMP_PARAMETER_PROBLEM {
            return other(out);
        }
        let inner_ip_off = l4_off + 8;
        let Some(inner_len) = ipv4_header_len(ctx, inner_ip_off)? else {
            return other(out);
        };
        let inner_proto: u8 = ctx.load(inner_ip_off + 9)?;
        return icmp_error(ctx, (dst_addr, l4_off), inner_ip_off, inner_ip_off + inner_len, (12, 16), inner_proto, out);
    }
    transport(ctx, (src_addr, dst_addr), proto, l4_off, (fragment, frag_id), out)
}

/// The same for IPv6 (extension headers skipped, a bounded number of them).
#[inline(always)]
pub fn parse_lb_v6<C: Packet>(ctx: &C, out: &mut LbParsed<Ipv6Words>) -> Result<(), i64> {
    let version: u8 = ctx.load(ETH_HDR_LEN)?;
    if version >> 4 != 6 {
        return other(out);
    }
    let next: u8 = ctx.load(ETH_HDR_LEN + 6)?;
    let Some((proto, l4_off, fragment, frag_id)) = ipv6_upper_layer(ctx, next, ETH_HDR_LEN + IPV6_HDR_LEN)? else {
        return other(out);
    };
    let (src_addr, dst_addr) = (ctx.load(IPV6_SRC_OFF)?, ctx.load(IPV6_DST_OFF)?);
    if proto == IPPROTO_ICMPV6 {
        if fragment != Fragment::Whole {
            return other(out);
        }
        let icmp_type: u8 = ctx.load(l4_off)?;
        if icmp_type == ICMPV6_ECHO_REQUEST || icmp_type == ICMPV6_ECHO_REPLY {
            return echo(ctx, (src_addr, dst_addr), proto, l4_off, frag_id, icmp_type == ICMPV6_ECHO_REQUEST, out);
        }
        // Errors are types 1-4; neighbour discovery, router advertisements and the rest pass.
        if !(ICMPV6_DEST_UNREACH..=ICMPV6_PARAMETER_PROBLEM).contains(&icmp_type) {
            return other(out);
        }
        let inner_ip_off = l4_off + 8;
        let inner_next: u8 = ctx.load(inner_ip_off + 6)?;
        // The quoted packet's own extension headers are not walked: errors about them are rare.
        return icmp_error(
            ctx,
            (dst_addr, l4_off),
            inner_ip_off,
            inner_ip_off + IPV6_HDR_LEN,
            (8, 24),
            inner_next,
            out,
        );
    }
    transport(ctx, (src_addr, dst_addr), proto, l4_off, (fragment, frag_id), out)
}

/// Skips IPv6 extension headers (a bounded number): the upper-layer protocol and its offset, the
/// fragment position and the datagram id. `None`: too many headers to look past.
#[inline(always)]
fn ipv6_upper_layer<C: Packet>(
    ctx: &C,
    mut next: u8,
    mut off: usize,
) -> Result<Option<(u8, usize, Fragment, u32)>, i64> {
    let mut fragment = Fragment::Whole;
    let mut frag_id = 0;
    for _ in 0..MAX_IPV6_EXT_HEADERS {
        match next {
            IPPROTO_HOPOPTS | IPPROTO_ROUTING | IPPROTO_DSTOPTS => {
                let len: u8 = ctx.load(off + 1)?;
                next = ctx.load(off)?;
                off += (len as usize + 1) * 8;
            }
            IPPROTO_AH => {
                let len: u8 = ctx.load(off + 1)?;
                next = ctx.load(off)?;
                off += (len as usize + 2) * 4;
            }
            IPPROTO_FRAGMENT => {
                let offset_flags = u16::from_be(ctx.load::<u16>(off + 2)?);
                fragment = if offset_flags & 0xfff8 != 0 {
                    Fragment::Later
                } else if offset_flags & 1 != 0 {
                    Fragment::First
                } else {
                    Fragment::Whole
                };
                frag_id = ctx.load(off + 4)?;
                next = ctx.load(off)?;
                off += 8;
            }
            _ => return Ok(Some((next, off, fragment, frag_id))),
        }
    }
    Ok(None)
}

#[inline(always)]
fn other<A>(out: &mut LbParsed<A>) -> Result<(), i64> {
    *out = LbParsed::Other;
    Ok(())
}

#[inline(always)]
fn transport<A, C: Packet>(
    ctx: &C,
    (src_addr, dst_addr): (A, A),
    proto: u8,
    l4_off: usize,
    (fragment, frag_id): (Fragment, u32),
    out: &mut LbParsed<A>,
) -> Result<(), i64> {
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP {
        return other(out);
    }
    let (src_port, dst_port, tcp_flags) = if fragment == Fragment::Later {
        (0, 0, 0)
    } else {
        let flags = if proto == IPPROTO_TCP { ctx.load::<u8>(l4_off + 13)? } else { 0 };
        (ctx.load(l4_off)?, ctx.load(l4_off + 2)?, flags)
    };
    *out =
        LbParsed::Flow(LbFlow { src_addr, dst_addr, src_port, dst_port, proto, tcp_flags, l4_off, fragment, frag_id });
    Ok(())
}

/// An echo request or reply: its identifier stands for both ports, so request and reply share
/// the conntrack key. A request carries [`TCP_FLAG_SYN`] in `tcp_flags`: like a SYN, it may open a
/// flow; a reply may not.
#[inline(always)]
fn echo<A, C: Packet>(
    ctx: &C,
    (src_addr, dst_addr): (A, A),
    proto: u8,
    l4_off: usize,
    frag_id: u32,
    request: bool,
    out: &mut LbParsed<A>,
) -> Result<(), i64> {
    let id: u16 = ctx.load(l4_off + 4)?;
    *out = LbParsed::Flow(LbFlow {
        src_addr,
        dst_addr,
        src_port: id,
        dst_port: id,
        proto,
        tcp_flags: if request { TCP_FLAG_SYN } else { 0 },
        l4_off,
        fragment: Fragment::Whole,
        frag_id,
    });
    Ok(())
}

/// `addr_offs`: where the quoted header keeps its source and destination.
#[inline(always)]
fn icmp_error<A, C: Packet>(
    ctx: &C,
    (outer_dst, icmp_off): (A, usize),
    inner_ip_off: usize,
    inner_l4_off: usize,
    addr_offs: (usize, usize),
    inner_proto: u8,
    out: &mut LbParsed<A>,
) -> Result<(), i64> {
    if inner_proto != IPPROTO_TCP && inner_proto != IPPROTO_UDP {
        return other(out);
    }
    *out = LbParsed::IcmpError(IcmpError {
        outer_dst,
        icmp_off,
        inner_ip_off,
        inner_l4_off,
        inner_src_addr: ctx.load(inner_ip_off + addr_offs.0)?,
        inner_dst_addr: ctx.load(inner_ip_off + addr_offs.1)?,
        inner_src_port: ctx.load(inner_l4_off)?,
        inner_dst_port: ctx.load(inner_l4_off + 2)?,
        inner_proto,
    });
    Ok(())
}
