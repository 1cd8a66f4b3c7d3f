//! Refusing a new flow to a frontend without endpoints at once, as kube-proxy's REJECT does:
//! the packet is turned into the answer (a TCP RST, or an ICMP port unreachable quoting it) and
//! sent back out of the interface it arrived on, so the client fails in a round trip instead of
//! waiting for a timeout. A routed packet too big for its route is answered the same way.
use aya_ebpf::{
    bindings::{bpf_adj_room_mode::BPF_ADJ_ROOM_MAC, TC_ACT_SHOT},
    helpers::{bpf_csum_diff, bpf_redirect, bpf_skb_change_tail, bpf_skb_load_bytes},
    programs::TcContext,
    EbpfContext,
};
use kube_router_common::{lb_stat, Ipv6Words, IPPROTO_ICMP, IPPROTO_ICMPV6, IPPROTO_TCP, IPPROTO_UDP};

use crate::{
    maps::count,
    nat::Tuple,
    parsing::{LbFlow, ETH_HDR_LEN, IPV6_HDR_LEN, IPV6_PAYLOAD_LEN_OFF, IP_TOT_LEN_OFF, TCP_FLAG_FIN, TCP_FLAG_RST},
};

const TCP_FLAG_SYN: u8 = 0x02;
const TCP_FLAG_ACK: u8 = 0x10;
const IP_HDR_LEN: usize = 20;
const TCP_HDR_LEN: usize = 20;
const ICMP_HDR_LEN: usize = 8;
/// What an ICMP error quotes of the refused packet: its (option-less) IPv4 header and 8 bytes.
const QUOTE_LEN: usize = IP_HDR_LEN + 8;
const TTL: u8 = 64;

/// Word-aligned scratch for `bpf_csum_diff`, which sums 32-bit words.
#[repr(C, align(4))]
struct Words<const N: usize>([u8; N]);

/// The ones'-complement checksum of `bytes` (N a multiple of 4), ready to store as is.
#[inline(always)]
fn checksum<const N: usize>(bytes: &mut Words<N>) -> Result<u16, i64> {
    // SAFETY: the buffer is N bytes, word aligned; no "from" buffer.
    let sum = unsafe { bpf_csum_diff(core::ptr::null_mut(), 0, bytes.0.as_mut_ptr().cast(), N as u32, 0) };
    if sum < 0 {
        return Err(sum);
    }
    let mut sum = sum as u64;
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    Ok(!(sum as u16))
}

/// An IPv4 header from `src` to `dst`, checksum filled in.
#[inline(always)]
fn ipv4_header(proto: u8, total_len: u16, src: u32, dst: u32) -> Result<Words<IP_HDR_LEN>, i64> {
    let mut header = Words([0u8; IP_HDR_LEN]);
    let h = &mut header.0;
    h[0] = 0x45;
    h[2..4].copy_from_slice(&total_len.to_be_bytes());
    h[8] = TTL;
    h[9] = proto;
    h[12..16].copy_from_slice(&src.to_ne_bytes());
    h[16..20].copy_from_slice(&dst.to_ne_bytes());
    let csum = checksum(&mut header)?;
    header.0[10..12].copy_from_slice(&csum.to_ne_bytes());
    Ok(header)
}

/// Sends the (rewritten) packet back out of the interface it came in on, MACs swapped.
#[inline(always)]
fn bounce(ctx: &TcContext, macs: &[u8; 12]) -> Result<i32, i64> {
    let mut swapped = [0u8; 12];
    swapped[..6].copy_from_slice(&macs[6..]);
    swapped[6..].copy_from_slice(&macs[..6]);
    ctx.store(0, &swapped, 0)?;
    // SAFETY: reading the ingress interface index from the skb context.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: plain helper call; redirects to that interface's egress.
    Ok(unsafe { bpf_redirect(ifindex, 0) } as i32)
}

#[inline(always)]
fn truncate(ctx: &TcContext, len: usize) -> Result<(), i64> {
    // SAFETY: the context is this program's skb.
    let rc = unsafe { bpf_skb_change_tail(ctx.as_ptr().cast(), len as u32, 0) };
    if rc < 0 {
        return Err(rc);
    }
    Ok(())
}

/// Answers the IPv4 packet with a refusal; returns the TC verdict (a drop if it cannot be built).
// Not inlined: its scratch buffers would not fit beside the caller's stack.
#[inline(never)]
pub fn refuse_v4(ctx: &TcContext, flow: &LbFlow<u32>) -> i32 {
    let answer = if flow.proto == IPPROTO_TCP { tcp_reset(ctx, flow) } else { icmp_port_unreachable(ctx, flow) };
    sent(answer)
}

/// Answers the IPv6 packet with a refusal; returns the TC verdict.
#[inline(never)]
pub fn refuse_v6(ctx: &TcContext, flow: &LbFlow<Ipv6Words>) -> i32 {
    let answer = if flow.proto == IPPROTO_TCP { tcp_reset_v6(ctx, flow) } else { icmpv6_port_unreachable(ctx, flow) };
    sent(answer)
}

#[inline(always)]
fn sent(answer: Result<i32, i64>) -> i32 {
    match answer {
        Ok(verdict) => {
            count(lb_stat::REJECT_SENT);
            verdict
        }
        Err(_) => TC_ACT_SHOT,
    }
}

/// The RST's sequence number, acknowledgment number and flags (network byte order), per RFC
/// 9293 3.10.7.1: an ACK is answered with its acknowledgment number as sequence number;
/// otherwise everything the segment occupied is acknowledged. `l4_len`: the TCP segment's length.
#[inline(always)]
fn reset_numbers<A>(ctx: &TcContext, flow: &LbFlow<A>, l4_len: u32) -> Result<(u32, u32, u8), i64> {
    let seq = u32::from_be(ctx.load::<u32>(flow.l4_off + 4)?);
    let ack: u32 = ctx.load(flow.l4_off + 8)?;
    let data_off = ((ctx.load::<u8>(flow.l4_off + 12)? >> 4) as u32) * 4;
    let payload = l4_len.saturating_sub(data_off);
    Ok(if flow.tcp_flags & TCP_FLAG_ACK != 0 {
        (ack, 0u32, TCP_FLAG_RST)
    } else {
        let occupied =
            payload + u32::from(flow.tcp_flags & TCP_FLAG_SYN != 0) + u32::from(flow.tcp_flags & TCP_FLAG_FIN != 0);
        (0u32, seq.wrapping_add(occupied).to_be(), TCP_FLAG_RST | TCP_FLAG_ACK)
    })
}

/// Fills a TCP header answering `flow` (ports swapped) into `t`; the checksum is left zero.
#[inline(always)]
fn reset_header<A>(t: &mut [u8], flow: &LbFlow<A>, numbers: (u32, u32, u8)) {
    t[0..2].copy_from_slice(&flow.dst_port.to_ne_bytes());
    t[2..4].copy_from_slice(&flow.src_port.to_ne_bytes());
    t[4..8].copy_from_slice(&numbers.0.to_ne_bytes());
    t[8..12].copy_from_slice(&numbers.1.to_ne_bytes());
    t[12] = (TCP_HDR_LEN as u8 / 4) << 4;
    t[13] = numbers.2;
}

#[inline(always)]
fn tcp_reset(ctx: &TcContext, flow: &LbFlow<u32>) -> Result<i32, i64> {
    if flow.tcp_flags & TCP_FLAG_RST != 0 {
        return Ok(TC_ACT_SHOT);
    }
    let macs: [u8; 12] = ctx.load(0)?;
    let total_len = u16::from_be(ctx.load::<u16>(IP_TOT_LEN_OFF)?) as u32;
    let numbers = reset_numbers(ctx, flow, total_len.saturating_sub((flow.l4_off - ETH_HDR_LEN) as u32))?;

    // Pseudo-header then the TCP header, summed together.
    let mut segment = Words([0u8; 12 + TCP_HDR_LEN]);
    let s = &mut segment.0;
    s[0..4].copy_from_slice(&flow.dst_addr.to_ne_bytes());
    s[4..8].copy_from_slice(&flow.src_addr.to_ne_bytes());
    s[9] = IPPROTO_TCP;
    s[11] = TCP_HDR_LEN as u8;
    reset_header(&mut s[12..], flow, numbers);
    let csum = checksum(&mut segment)?;
    segment.0[12 + 16..12 + 18].copy_from_slice(&csum.to_ne_bytes());
    let ip = ipv4_header(IPPROTO_TCP, (IP_HDR_LEN + TCP_HDR_LEN) as u16, flow.dst_addr, flow.src_addr)?;

    truncate(ctx, ETH_HDR_LEN + IP_HDR_LEN + TCP_HDR_LEN)?;
    ctx.store(ETH_HDR_LEN, &ip.0, 0)?;
    let tcp: [u8; TCP_HDR_LEN] = segment.0[12..].try_into().map_err(|_| -1i64)?;
    ctx.store(ETH_HDR_LEN + IP_HDR_LEN, &tcp, 0)?;
    bounce(ctx, &macs)
}

/// An IPv6 header from `src` to `dst` (no checksum in IPv6).
#[inline(always)]
fn ipv6_header(next: u8, payload_len: u16, src: &Ipv6Words, dst: &Ipv6Words) -> [u8; IPV6_HDR_LEN] {
    let mut h = [0u8; IPV6_HDR_LEN];
    fill_ipv6_header(&mut h, next, payload_len, src, dst);
    h
}

/// The same into the first 40 (zeroed) bytes of `h`.
#[inline(always)]
fn fill_ipv6_header(h: &mut [u8], next: u8, payload_len: u16, src: &Ipv6Words, dst: &Ipv6Words) {
    h[0] = 0x60;
    h[4..6].copy_from_slice(&payload_len.to_be_bytes());
    h[6] = next;
    h[7] = TTL;
    put_addr(&mut h[8..24], src);
    put_addr(&mut h[24..40], dst);
}

/// Writes an address held as words (network byte order) as its 16 packet bytes, word by word.
#[inline(always)]
fn put_addr(out: &mut [u8], addr: &Ipv6Words) {
    for (i, word) in addr.0.iter().enumerate() {
        out[4 * i..4 * i + 4].copy_from_slice(&word.to_ne_bytes());
    }
}

/// The IPv6 pseudo-header (RFC 8200 8.1) into the first 40 bytes of `p`.
#[inline(always)]
fn ipv6_pseudo_header(p: &mut [u8], src: &Ipv6Words, dst: &Ipv6Words, upper_len: u32, next: u8) {
    put_addr(&mut p[0..16], src);
    put_addr(&mut p[16..32], dst);
    p[32..36].copy_from_slice(&upper_len.to_be_bytes());
    p[39] = next;
}

// Not inlined: the IPv6 answers' buffers get a frame each.
#[inline(never)]
fn tcp_reset_v6(ctx: &TcContext, flow: &LbFlow<Ipv6Words>) -> Result<i32, i64> {
    if flow.tcp_flags & TCP_FLAG_RST != 0 {
        return Ok(TC_ACT_SHOT);
    }
    let macs: [u8; 12] = ctx.load(0)?;
    let payload_len = u16::from_be(ctx.load::<u16>(IPV6_PAYLOAD_LEN_OFF)?) as u32;
    let extension_len = (flow.l4_off - ETH_HDR_LEN - IPV6_HDR_LEN) as u32;
    let numbers = reset_numbers(ctx, flow, payload_len.saturating_sub(extension_len))?;
    let mut segment = Words([0u8; IPV6_HDR_LEN + TCP_HDR_LEN]);
    ipv6_pseudo_header(&mut segment.0, &flow.dst_addr, &flow.src_addr, TCP_HDR_LEN as u32, IPPROTO_TCP);
    reset_header(&mut segment.0[IPV6_HDR_LEN..], flow, numbers);
    let csum = checksum(&mut segment)?;
    segment.0[IPV6_HDR_LEN + 16..IPV6_HDR_LEN + 18].copy_from_slice(&csum.to_ne_bytes());
    let ip = ipv6_header(IPPROTO_TCP, TCP_HDR_LEN as u16, &flow.dst_addr, &flow.src_addr);

    truncate(ctx, ETH_HDR_LEN + IPV6_HDR_LEN + TCP_HDR_LEN)?;
    ctx.store(ETH_HDR_LEN, &ip, 0)?;
    let tcp: [u8; TCP_HDR_LEN] = segment.0[IPV6_HDR_LEN..].try_into().map_err(|_| -1i64)?;
    ctx.store(ETH_HDR_LEN + IPV6_HDR_LEN, &tcp, 0)?;
    bounce(ctx, &macs)
}

/// What an ICMPv6 error quotes here: the datagram's IPv6 header (no extension headers) and 8 bytes.
const QUOTE_V6_LEN: usize = IPV6_HDR_LEN + 8;

#[inline(never)]
fn icmpv6_port_unreachable(ctx: &TcContext, flow: &LbFlow<Ipv6Words>) -> Result<i32, i64> {
    if flow.l4_off != ETH_HDR_LEN + IPV6_HDR_LEN {
        return Ok(TC_ACT_SHOT);
    }
    let macs: [u8; 12] = ctx.load(0)?;
    let upper_len = (ICMP_HDR_LEN + QUOTE_V6_LEN) as u32;
    let mut message = Words([0u8; IPV6_HDR_LEN + ICMP_HDR_LEN + QUOTE_V6_LEN]);
    ipv6_pseudo_header(&mut message.0, &flow.dst_addr, &flow.src_addr, upper_len, IPPROTO_ICMPV6);
    message.0[IPV6_HDR_LEN] = 1; // destination unreachable
    message.0[IPV6_HDR_LEN + 1] = 4; // port unreachable
                                     // Straight into place, with a constant length the verifier can check.
    let quote = &mut message.0[IPV6_HDR_LEN + ICMP_HDR_LEN..];
    // SAFETY: `quote` is QUOTE_V6_LEN writable bytes; the helper bounds-checks the packet side.
    let rc =
        unsafe { bpf_skb_load_bytes(ctx.as_ptr(), ETH_HDR_LEN as u32, quote.as_mut_ptr().cast(), QUOTE_V6_LEN as u32) };
    if rc < 0 {
        return Err(rc);
    }
    let csum = checksum(&mut message)?;
    let icmp_header: [u8; ICMP_HDR_LEN] = [1, 4, csum.to_ne_bytes()[0], csum.to_ne_bytes()[1], 0, 0, 0, 0];
    let ip = ipv6_header(IPPROTO_ICMPV6, upper_len as u16, &flow.dst_addr, &flow.src_addr);

    truncate(ctx, ETH_HDR_LEN + QUOTE_V6_LEN)?;
    ctx.adjust_room((IPV6_HDR_LEN + ICMP_HDR_LEN) as i32, BPF_ADJ_ROOM_MAC, 0)?;
    ctx.store(ETH_HDR_LEN, &ip, 0)?;
    ctx.store(ETH_HDR_LEN + IPV6_HDR_LEN, &icmp_header, 0)?;
    bounce(ctx, &macs)
}

#[inline(always)]
fn icmp_port_unreachable(ctx: &TcContext, flow: &LbFlow<u32>) -> Result<i32, i64> {
    // A datagram with IP options is rare enough to be dropped rather than quoted.
    if flow.l4_off != ETH_HDR_LEN + IP_HDR_LEN {
        return Ok(TC_ACT_SHOT);
    }
    let macs: [u8; 12] = ctx.load(0)?;
    let mut message = Words([0u8; ICMP_HDR_LEN + QUOTE_LEN]);
    message.0[0] = 3; // destination unreachable
    message.0[1] = 3; // port unreachable
    let quote: [u8; QUOTE_LEN] = ctx.load(ETH_HDR_LEN)?;
    message.0[ICMP_HDR_LEN..].copy_from_slice(&quote);
    let csum = checksum(&mut message)?;
    let icmp_header: [u8; ICMP_HDR_LEN] = [3, 3, csum.to_ne_bytes()[0], csum.to_ne_bytes()[1], 0, 0, 0, 0];
    let ip = ipv4_header(IPPROTO_ICMP, (IP_HDR_LEN + ICMP_HDR_LEN + QUOTE_LEN) as u16, flow.dst_addr, flow.src_addr)?;

    // Keep the quote, then open room for the new IPv4 and ICMP headers in front of it.
    truncate(ctx, ETH_HDR_LEN + QUOTE_LEN)?;
    ctx.adjust_room((IP_HDR_LEN + ICMP_HDR_LEN) as i32, BPF_ADJ_ROOM_MAC, 0)?;
    ctx.store(ETH_HDR_LEN, &ip.0, 0)?;
    ctx.store(ETH_HDR_LEN + IP_HDR_LEN, &icmp_header, 0)?;
    bounce(ctx, &macs)
}

// "Fragmentation needed" / "packet too big": a packet we route (translated, source-NATed) does
// not fit the route's MTU. The sender learns the MTU only if the error quotes the packet as it
// sent it, so the quote's addresses, ports (and UDP checksum) are restored from the flow. One
// answer per packet that does not fit: no rate limit beyond the packet rate.

/// Adds the 16-bit halves of `add` and the ones' complement of those of `sub` to a
/// ones'-complement sum (halves as they lie in memory: byte order does not matter).
#[inline(always)]
fn sum_diff(sum: u64, add: u32, sub: u32) -> u64 {
    let sub = !sub;
    sum + (add & 0xffff) as u64 + (add >> 16) as u64 + (sub & 0xffff) as u64 + (sub >> 16) as u64
}

/// The checksum `csum` made for the translated words, moved back to the original ones (RFC 1624).
/// A UDP checksum of 0 means "none" and stays so; a computed 0 is sent as 0xffff.
#[inline(always)]
fn restored_udp_checksum(csum: u16, sum: u64) -> u16 {
    if csum == 0 {
        return 0;
    }
    let mut sum = sum + (!csum) as u64;
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    match !(sum as u16) {
        0 => 0xffff,
        restored => restored,
    }
}

/// Both ports in one word, as they lie in the header.
#[inline(always)]
fn ports_word(src: u16, dst: u16) -> u32 {
    let (s, d) = (src.to_ne_bytes(), dst.to_ne_bytes());
    u32::from_ne_bytes([s[0], s[1], d[0], d[1]])
}

/// Writes the flow's original ports into the quoted L4 header `l4` (8 bytes) and restores its
/// UDP checksum; `sum`: the address difference (original minus translated) so far.
#[inline(always)]
fn restore_quoted_ports<A>(l4: &mut [u8], flow: &LbFlow<A>, to: &Tuple<A>, sum: u64) {
    if !flow.has_l4() {
        // A later fragment: the quote's 8 bytes are payload.
        return;
    }
    l4[0..2].copy_from_slice(&flow.src_port.to_ne_bytes());
    l4[2..4].copy_from_slice(&flow.dst_port.to_ne_bytes());
    if flow.proto == IPPROTO_UDP {
        let sum = sum_diff(sum, ports_word(flow.src_port, flow.dst_port), ports_word(to.src.1, to.dst.1));
        let csum = u16::from_ne_bytes([l4[6], l4[7]]);
        l4[6..8].copy_from_slice(&restored_udp_checksum(csum, sum).to_ne_bytes());
    }
}

/// Answers the (translated) IPv4 packet that does not fit with ICMP 3/4 carrying `mtu` (RFC
/// 1191), from the address the client sent it to; the TC verdict. Without DF the kernel would
/// fragment; TC cannot, so such packets get the same answer (a Linux sender then fragments to
/// the MTU itself). A packet with IP options is dropped.
#[inline(never)]
pub fn frag_needed_v4(ctx: &TcContext, flow: &LbFlow<u32>, to: &Tuple<u32>, mtu: u16) -> i32 {
    needed(frag_needed_v4_answer(ctx, flow, to, mtu))
}

#[inline(always)]
fn frag_needed_v4_answer(ctx: &TcContext, flow: &LbFlow<u32>, to: &Tuple<u32>, mtu: u16) -> Result<i32, i64> {
    if flow.l4_off != ETH_HDR_LEN + IP_HDR_LEN {
        return Err(-1);
    }
    let macs: [u8; 12] = ctx.load(0)?;
    // The quoted header as sent: original addresses, its checksum computed again over them.
    let mut quoted = Words([0u8; IP_HDR_LEN]);
    quoted.0 = ctx.load(ETH_HDR_LEN)?;
    quoted.0[10..12].copy_from_slice(&[0, 0]);
    quoted.0[12..16].copy_from_slice(&flow.src_addr.to_ne_bytes());
    quoted.0[16..20].copy_from_slice(&flow.dst_addr.to_ne_bytes());
    let quoted_csum = checksum(&mut quoted)?;
    quoted.0[10..12].copy_from_slice(&quoted_csum.to_ne_bytes());

    let mut message = Words([0u8; ICMP_HDR_LEN + QUOTE_LEN]);
    let m = &mut message.0;
    m[0] = 3; // destination unreachable
    m[1] = 4; // fragmentation needed and DF set
    m[6..8].copy_from_slice(&mtu.to_be_bytes());
    m[ICMP_HDR_LEN..ICMP_HDR_LEN + IP_HDR_LEN].copy_from_slice(&quoted.0);
    let l4: [u8; 8] = ctx.load(flow.l4_off)?;
    m[ICMP_HDR_LEN + IP_HDR_LEN..].copy_from_slice(&l4);
    let sum = sum_diff(sum_diff(0, flow.src_addr, to.src.0), flow.dst_addr, to.dst.0);
    restore_quoted_ports(&mut m[ICMP_HDR_LEN + IP_HDR_LEN..], flow, to, sum);
    let csum = checksum(&mut message)?;
    message.0[2..4].copy_from_slice(&csum.to_ne_bytes());
    let ip = ipv4_header(IPPROTO_ICMP, (IP_HDR_LEN + ICMP_HDR_LEN + QUOTE_LEN) as u16, flow.dst_addr, flow.src_addr)?;

    truncate(ctx, ETH_HDR_LEN + IP_HDR_LEN + ICMP_HDR_LEN + QUOTE_LEN)?;
    ctx.store(ETH_HDR_LEN, &ip.0, 0)?;
    ctx.store(ETH_HDR_LEN + IP_HDR_LEN, &message.0, 0)?;
    bounce(ctx, &macs)
}

/// Answers the (translated) IPv6 packet that does not fit with ICMPv6 2/0 carrying `mtu` (RFC
/// 4443 3.2); the TC verdict. A packet with extension headers is dropped.
#[inline(never)]
pub fn frag_needed_v6(ctx: &TcContext, flow: &LbFlow<Ipv6Words>, to: &Tuple<Ipv6Words>, mtu: u16) -> i32 {
    needed(frag_needed_v6_answer(ctx, flow, to, mtu))
}

#[inline(always)]
fn frag_needed_v6_answer(
    ctx: &TcContext,
    flow: &LbFlow<Ipv6Words>,
    to: &Tuple<Ipv6Words>,
    mtu: u16,
) -> Result<i32, i64> {
    if flow.l4_off != ETH_HDR_LEN + IPV6_HDR_LEN {
        return Err(-1);
    }
    let macs: [u8; 12] = ctx.load(0)?;
    const QUOTE_AT: usize = IPV6_HDR_LEN + ICMP_HDR_LEN;
    let upper_len = (ICMP_HDR_LEN + QUOTE_V6_LEN) as u32;
    // The answer as it goes out; its first 40 bytes hold the pseudo-header while the checksum is
    // summed (one buffer: two would not fit on the stack).
    let mut answer = Words([0u8; IPV6_HDR_LEN + ICMP_HDR_LEN + QUOTE_V6_LEN]);
    ipv6_pseudo_header(&mut answer.0, &flow.dst_addr, &flow.src_addr, upper_len, IPPROTO_ICMPV6);
    answer.0[IPV6_HDR_LEN] = 2; // packet too big
    answer.0[IPV6_HDR_LEN + 4..QUOTE_AT].copy_from_slice(&(mtu as u32).to_be_bytes());
    let quote = &mut answer.0[QUOTE_AT..];
    // SAFETY: `quote` is QUOTE_V6_LEN writable bytes; the helper bounds-checks the packet side.
    let rc =
        unsafe { bpf_skb_load_bytes(ctx.as_ptr(), ETH_HDR_LEN as u32, quote.as_mut_ptr().cast(), QUOTE_V6_LEN as u32) };
    if rc < 0 {
        return Err(rc);
    }
    put_addr(&mut quote[8..24], &flow.src_addr);
    put_addr(&mut quote[24..40], &flow.dst_addr);
    let mut sum = 0;
    for i in 0..4 {
        sum = sum_diff(sum, flow.src_addr.0[i], to.src.0 .0[i]);
        sum = sum_diff(sum, flow.dst_addr.0[i], to.dst.0 .0[i]);
    }
    restore_quoted_ports(&mut quote[IPV6_HDR_LEN..], flow, to, sum);
    let csum = checksum(&mut answer)?;
    answer.0[IPV6_HDR_LEN + 2..IPV6_HDR_LEN + 4].copy_from_slice(&csum.to_ne_bytes());
    answer.0[..IPV6_HDR_LEN].fill(0);
    fill_ipv6_header(&mut answer.0, IPPROTO_ICMPV6, upper_len as u16, &flow.dst_addr, &flow.src_addr);

    truncate(ctx, ETH_HDR_LEN + IPV6_HDR_LEN + upper_len as usize)?;
    ctx.store(ETH_HDR_LEN, &answer.0, 0)?;
    bounce(ctx, &macs)
}

#[inline(always)]
fn needed(answer: Result<i32, i64>) -> i32 {
    match answer {
        Ok(verdict) => {
            count(lb_stat::FRAG_NEEDED_SENT);
            verdict
        }
        Err(_) => {
            count(lb_stat::REDIRECT_FAILED);
            TC_ACT_SHOT
        }
    }
}
