//! BPF_PROG_TEST_RUN: runs a loaded program on a crafted packet inside the kernel. Used by the
//! datapath tests (exact packet rewrites, checksums) and the per-packet benchmarks, which include
//! this file (test-only code: not in the agent's library). Each binary uses part of it.
#![allow(dead_code)]
use std::{
    io,
    net::{Ipv4Addr, Ipv6Addr},
    os::fd::RawFd,
};

const BPF_PROG_TEST_RUN: libc::c_long = 10;

/// What a TC program returns (the kernel's `TC_ACT_*`).
pub const TC_ACT_UNSPEC: i32 = -1;
pub const TC_ACT_SHOT: i32 = 2;
pub const TC_ACT_REDIRECT: i32 = 7;
/// What an XDP program returns (the kernel's `XDP_*`).
pub const XDP_DROP: i32 = 1;
pub const XDP_PASS: i32 = 2;
pub const XDP_TX: i32 = 3;

#[repr(C)]
#[derive(Default)]
struct TestRunAttr {
    prog_fd: u32,
    retval: u32,
    data_size_in: u32,
    data_size_out: u32,
    data_in: u64,
    data_out: u64,
    repeat: u32,
    duration: u32,
    ctx_size_in: u32,
    ctx_size_out: u32,
    ctx_in: u64,
    ctx_out: u64,
    flags: u32,
    cpu: u32,
    batch_size: u32,
    _pad: u32,
}

pub struct TestRunResult {
    /// The program's return code (TC action).
    pub retval: i32,
    /// Average run time per repetition, as measured by the kernel.
    pub duration_ns: u32,
    /// The packet as the program left it.
    pub packet: Vec<u8>,
}

pub fn run(prog_fd: RawFd, packet: &[u8], repeat: u32) -> io::Result<TestRunResult> {
    run_on(prog_fd, packet, repeat, None)
}

/// Size of the kernel's `struct __sk_buff` and the offsets of its `ingress_ifindex` and
/// `ifindex` fields.
const SK_BUFF_SIZE: usize = 192;
const SK_BUFF_INGRESS_IFINDEX_OFF: usize = 36;
const SK_BUFF_IFINDEX_OFF: usize = 40;
const SK_BUFF_GSO_SEGS_OFF: usize = 164;
const SK_BUFF_GSO_SIZE_OFF: usize = 176;

/// Like [`run`], with the packet arriving on interface `ifindex` of the calling thread's network
/// namespace (so FIB lookups and redirects in the program see that namespace's routes).
pub fn run_on(prog_fd: RawFd, packet: &[u8], repeat: u32, ifindex: Option<u32>) -> io::Result<TestRunResult> {
    run_with(prog_fd, packet, repeat, ifindex, None, None)
}

/// Like [`run_on`], for a GSO packet: `segs` segments of `size` payload bytes merged into one (as
/// a sender's TSO or a receiver's GRO leaves them).
pub fn run_gso(prog_fd: RawFd, packet: &[u8], ifindex: u32, (segs, size): (u32, u32)) -> io::Result<TestRunResult> {
    run_with(prog_fd, packet, 1, Some(ifindex), None, Some((segs, size)))
}

/// Like [`run`], for a packet the node forwards (it came in on interface `ingress_ifindex`)
/// rather than one its own stack sent (input interface 0).
pub fn run_forwarded(prog_fd: RawFd, packet: &[u8], repeat: u32, ingress_ifindex: u32) -> io::Result<TestRunResult> {
    run_with(prog_fd, packet, repeat, None, Some(ingress_ifindex), None)
}

fn run_with(
    prog_fd: RawFd,
    packet: &[u8],
    repeat: u32,
    ifindex: Option<u32>,
    ingress_ifindex: Option<u32>,
    gso: Option<(u32, u32)>,
) -> io::Result<TestRunResult> {
    let mut out = vec![0u8; packet.len() + 256];
    let mut ctx = [0u8; SK_BUFF_SIZE];
    if let Some(ifindex) = ifindex {
        ctx[SK_BUFF_IFINDEX_OFF..SK_BUFF_IFINDEX_OFF + 4].copy_from_slice(&ifindex.to_ne_bytes());
    }
    if let Some(ingress) = ingress_ifindex {
        ctx[SK_BUFF_INGRESS_IFINDEX_OFF..SK_BUFF_INGRESS_IFINDEX_OFF + 4].copy_from_slice(&ingress.to_ne_bytes());
    }
    if let Some((segs, size)) = gso {
        ctx[SK_BUFF_GSO_SEGS_OFF..SK_BUFF_GSO_SEGS_OFF + 4].copy_from_slice(&segs.to_ne_bytes());
        ctx[SK_BUFF_GSO_SIZE_OFF..SK_BUFF_GSO_SIZE_OFF + 4].copy_from_slice(&size.to_ne_bytes());
    }
    let mut attr = TestRunAttr {
        prog_fd: prog_fd as u32,
        data_size_in: packet.len() as u32,
        data_size_out: out.len() as u32,
        data_in: packet.as_ptr() as u64,
        data_out: out.as_mut_ptr() as u64,
        repeat,
        ..Default::default()
    };
    if ifindex.is_some() || ingress_ifindex.is_some() || gso.is_some() {
        attr.ctx_size_in = SK_BUFF_SIZE as u32;
        attr.ctx_in = ctx.as_ptr() as u64;
    }
    test_run(&mut attr, out)
}

/// BPF_PROG_TEST_RUN with `attr`, whose output buffer is `out`.
fn test_run(attr: &mut TestRunAttr, mut out: Vec<u8>) -> io::Result<TestRunResult> {
    // SAFETY: attr points at valid buffers of the stated sizes for the duration of the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_PROG_TEST_RUN,
            attr as *mut TestRunAttr,
            std::mem::size_of::<TestRunAttr>() as u32,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    out.truncate(attr.data_size_out as usize);
    Ok(TestRunResult { retval: attr.retval as i32, duration_ns: attr.duration, packet: out })
}

/// Runs an XDP program on `packet` arriving on interface `ingress_ifindex` of the calling
/// thread's network namespace (so its FIB lookups see that namespace's routes and neighbours).
/// `retval` is the XDP action.
pub fn run_xdp(prog_fd: RawFd, packet: &[u8], repeat: u32, ingress_ifindex: u32) -> io::Result<TestRunResult> {
    // struct xdp_md: data, data_end, data_meta, ingress_ifindex, rx_queue_index, egress_ifindex.
    let ctx: [u32; 6] = [0, packet.len() as u32, 0, ingress_ifindex, 0, 0];
    let mut out = vec![0u8; packet.len() + 256];
    let mut attr = TestRunAttr {
        prog_fd: prog_fd as u32,
        data_size_in: packet.len() as u32,
        data_size_out: out.len() as u32,
        data_in: packet.as_ptr() as u64,
        data_out: out.as_mut_ptr() as u64,
        repeat,
        ctx_size_in: size_of_val(&ctx) as u32,
        ctx_in: ctx.as_ptr() as u64,
        ..Default::default()
    };
    test_run(&mut attr, out)
}

/// `BPF_F_TEST_XDP_LIVE_FRAMES`: the XDP program's verdicts are carried out (a redirected frame
/// really is sent), which makes an XDP program a packet generator.
const BPF_F_TEST_XDP_LIVE_FRAMES: u32 = 1 << 1;

/// Runs XDP program `prog_fd` `repeat` times in live-frame mode on copies of `packet` (arriving
/// on `ingress_ifindex`), on the calling thread's CPU; returns the time the call took. The
/// kernel does not restore a frame's bytes when it reuses its page, so a generator that is to
/// send the same packet again must write it itself.
pub fn run_xdp_live(
    prog_fd: RawFd,
    packet: &[u8],
    repeat: u32,
    ingress_ifindex: u32,
) -> io::Result<std::time::Duration> {
    let ctx: [u32; 6] = [0, packet.len() as u32, 0, ingress_ifindex, 0, 0];
    let mut attr = TestRunAttr {
        prog_fd: prog_fd as u32,
        data_size_in: packet.len() as u32,
        data_in: packet.as_ptr() as u64,
        repeat,
        ctx_size_in: size_of_val(&ctx) as u32,
        ctx_in: ctx.as_ptr() as u64,
        flags: BPF_F_TEST_XDP_LIVE_FRAMES,
        ..Default::default()
    };
    let started = std::time::Instant::now();
    test_run(&mut attr, Vec::new())?;
    Ok(started.elapsed())
}

/// A network namespace for packets that programs route themselves (FIB lookup + redirect): the
/// calling thread enters it, so TEST_RUN packets given one of its interfaces arrive there and
/// lookups see its routes. Deleted on drop.
pub struct NodeNetns {
    name: String,
}

impl NodeNetns {
    /// Creates `name`, runs each `ip` command in it (e.g. `["link", "add", ...]`), turns on
    /// forwarding and enters it on this thread.
    pub fn enter(name: &str, ip_commands: &[&[&str]]) -> io::Result<Self> {
        use std::{os::fd::AsRawFd, process::Command};
        let failed = |what: String| io::Error::other(what);
        let _ = Command::new("ip").args(["netns", "delete", name]).output();
        let ns = Self { name: name.to_string() };
        let run = |args: &[&str]| -> io::Result<()> {
            let out = Command::new("ip").args(args).output()?;
            if !out.status.success() {
                return Err(failed(format!("ip {args:?}: {}", String::from_utf8_lossy(&out.stderr))));
            }
            Ok(())
        };
        run(&["netns", "add", name])?;
        run(&["-n", name, "link", "set", "lo", "up"])?;
        for args in ip_commands {
            let mut full = vec!["-n", name];
            full.extend_from_slice(args);
            run(&full)?;
        }
        run(&["netns", "exec", name, "sysctl", "-qw", "net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1"])?;
        let file = std::fs::File::open(format!("/run/netns/{name}"))?;
        // SAFETY: setns on the calling thread only, with a valid namespace fd.
        if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(ns)
    }

    /// Moves the calling thread (back) into the namespace.
    pub fn join(&self) -> io::Result<()> {
        use std::os::fd::AsRawFd;
        let file = std::fs::File::open(format!("/run/netns/{}", self.name))?;
        // SAFETY: setns on the calling thread only, with a valid namespace fd.
        if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// The namespace's name (for `ip -n`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The index of `interface` in the namespace (the calling thread must be in it).
    pub fn ifindex(&self, interface: &str) -> u32 {
        let name = std::ffi::CString::new(interface).expect("interface name");
        // SAFETY: a valid NUL-terminated name, looked up in this thread's namespace.
        unsafe { libc::if_nametoindex(name.as_ptr()) }
    }
}

impl Drop for NodeNetns {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip").args(["netns", "delete", &self.name]).output();
    }
}

/// Minimal packet crafting and checking for IPv4 TCP/UDP frames.
pub mod packet {
    use super::*;

    pub const TCP: u8 = 6;
    pub const UDP: u8 = 17;
    pub const ICMP: u8 = 1;
    pub const TCP_SYN: u8 = 0x02;
    pub const TCP_ACK: u8 = 0x10;
    pub const TCP_RST: u8 = 0x04;

    /// A `ct_v4` key of a flow from `src` to `dst` (addresses and ports as given, stored in
    /// network order as the datapath keeps them).
    pub fn ct_key_v4(proto: u8, src: (Ipv4Addr, u16), dst: (Ipv4Addr, u16)) -> kube_router_common::CtKeyV4 {
        kube_router_common::CtKeyV4 {
            src_addr: kube_router::services::compile::addr_be(src.0),
            dst_addr: kube_router::services::compile::addr_be(dst.0),
            src_port: src.1.to_be(),
            dst_port: dst.1.to_be(),
            proto,
            pad: [0; 3],
        }
    }

    fn fold(mut sum: u32) -> u16 {
        while sum > 0xffff {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        !(sum as u16)
    }

    fn sum_words(bytes: &[u8]) -> u32 {
        bytes.chunks(2).map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]))).sum()
    }

    /// The checksum of an IPv4 header whose checksum field is zero.
    pub fn ipv4_header_checksum(ip: &[u8]) -> u16 {
        fold(sum_words(ip))
    }

    fn l4_checksum(src: [u8; 4], dst: [u8; 4], proto: u8, l4: &[u8]) -> u16 {
        let pseudo = sum_words(&src) + sum_words(&dst) + u32::from(proto) + l4.len() as u32;
        fold(pseudo + sum_words(l4))
    }

    /// Source and destination MAC of the frames built here.
    pub const SRC_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 1];
    pub const DST_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 2];

    /// An Ethernet + IPv4 header (no options, TTL 64, id 0x1234) around `l4`, checksum valid.
    /// `fragment`: the flags + offset field (0x4000 = DF, 0x2000 = more fragments).
    pub fn ipv4_frame(proto: u8, src: Ipv4Addr, dst: Ipv4Addr, fragment: u16, l4: &[u8]) -> Vec<u8> {
        let mut frame = DST_MAC.to_vec();
        frame.extend_from_slice(&SRC_MAC);
        frame.extend_from_slice(&[0x08, 0x00]);
        let total = (20 + l4.len()) as u16;
        let mut ip = vec![0x45, 0, 0, 0, 0x12, 0x34, 0, 0, 64, proto, 0, 0];
        ip[2..4].copy_from_slice(&total.to_be_bytes());
        ip[6..8].copy_from_slice(&fragment.to_be_bytes());
        ip.extend_from_slice(&src.octets());
        ip.extend_from_slice(&dst.octets());
        let ip_sum = ipv4_header_checksum(&ip);
        ip[10..12].copy_from_slice(&ip_sum.to_be_bytes());
        frame.extend(ip);
        frame.extend_from_slice(l4);
        frame
    }

    /// A TCP (flags given) or UDP header and its payload, checksum field zero (both families).
    fn unchecksummed_segment(proto: u8, src_port: u16, dst_port: u16, tcp_flags: u8, payload: &[u8]) -> Vec<u8> {
        let mut l4 = Vec::new();
        l4.extend_from_slice(&src_port.to_be_bytes());
        l4.extend_from_slice(&dst_port.to_be_bytes());
        if proto == TCP {
            l4.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 0, 0x50, tcp_flags, 0xff, 0xff, 0, 0, 0, 0]);
        } else {
            l4.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
            l4.extend_from_slice(&[0, 0]);
        }
        l4.extend_from_slice(payload);
        l4
    }

    /// The L4 header and payload of a TCP (flags given) or UDP segment with a valid checksum.
    pub fn l4_segment(proto: u8, src: (Ipv4Addr, u16), dst: (Ipv4Addr, u16), tcp_flags: u8, payload: &[u8]) -> Vec<u8> {
        let mut l4 = unchecksummed_segment(proto, src.1, dst.1, tcp_flags, payload);
        let sum = l4_checksum(src.0.octets(), dst.0.octets(), proto, &l4);
        let off = if proto == TCP { 16 } else { 6 };
        l4[off..off + 2].copy_from_slice(&sum.to_be_bytes());
        l4
    }

    /// An Ethernet + IPv4 + TCP (flags given) or UDP frame with valid checksums (DF set).
    pub fn ipv4(proto: u8, src: (Ipv4Addr, u16), dst: (Ipv4Addr, u16), tcp_flags: u8, payload: &[u8]) -> Vec<u8> {
        ipv4_frame(proto, src.0, dst.0, 0x4000, &l4_segment(proto, src, dst, tcp_flags, payload))
    }

    /// An ICMP error (`icmp_type`/`code`, e.g. 3/4 "fragmentation needed") from `from` to `to`
    /// quoting the IPv4 packet inside `quoted_frame` (its header and first 8 L4 bytes).
    pub fn icmp_error(icmp_type: u8, code: u8, from: Ipv4Addr, to: Ipv4Addr, quoted_frame: &[u8]) -> Vec<u8> {
        let quoted = &quoted_frame[14..14 + 20 + 8];
        let mut icmp = vec![icmp_type, code, 0, 0, 0, 0, 0x05, 0x78]; // next-hop MTU 1400
        icmp.extend_from_slice(quoted);
        let sum = fold(sum_words(&icmp));
        icmp[2..4].copy_from_slice(&sum.to_be_bytes());
        ipv4_frame(ICMP, from, to, 0, &icmp)
    }

    /// An ICMP echo request (type 8) or reply (type 0) with identifier `id`.
    pub fn icmp_echo(icmp_type: u8, src: Ipv4Addr, dst: Ipv4Addr, id: u16) -> Vec<u8> {
        let mut icmp = vec![icmp_type, 0, 0, 0, 0, 0, 0, 1, b'p', b'i', b'n', b'g'];
        icmp[4..6].copy_from_slice(&id.to_be_bytes());
        let sum = fold(sum_words(&icmp));
        icmp[2..4].copy_from_slice(&sum.to_be_bytes());
        ipv4_frame(ICMP, src, dst, 0, &icmp)
    }

    /// (source, destination, identifier) of an ICMP echo, and whether both checksums verify.
    pub fn echo_of(frame: &[u8]) -> (Ipv4Addr, Ipv4Addr, u16, bool) {
        let ip = &frame[14..];
        let icmp = &ip[20..usize::from(u16::from_be_bytes([ip[2], ip[3]]))];
        let addr = |o: usize| Ipv4Addr::new(ip[o], ip[o + 1], ip[o + 2], ip[o + 3]);
        let valid = ip_header_valid(ip) && fold(sum_words(icmp)) == 0;
        (addr(12), addr(16), u16::from_be_bytes([icmp[4], icmp[5]]), valid)
    }

    /// An IPv4 header's checksum verifies.
    pub fn ip_header_valid(ip: &[u8]) -> bool {
        fold(sum_words(&ip[..usize::from(ip[0] & 0xf) * 4])) == 0
    }

    /// The ICMP checksum and the quoted IPv4 header's checksum of an ICMP message verify.
    pub fn icmp_checksums_valid(frame: &[u8]) -> bool {
        let ip = &frame[14..];
        let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
        let icmp = &ip[20..total];
        ip_header_valid(ip) && fold(sum_words(icmp)) == 0 && ip_header_valid(&icmp[8..])
    }

    /// (source, destination) of the packet quoted in an ICMP message.
    pub fn quoted_endpoints(frame: &[u8]) -> ((Ipv4Addr, u16), (Ipv4Addr, u16)) {
        let mut inner = frame[..14].to_vec();
        inner.extend_from_slice(&frame[14 + 20 + 8..]);
        endpoints(&inner)
    }

    /// (source, destination) as written in the frame.
    pub fn endpoints(frame: &[u8]) -> ((Ipv4Addr, u16), (Ipv4Addr, u16)) {
        let ip = &frame[14..];
        let l4 = &ip[usize::from(ip[0] & 0xf) * 4..];
        let addr = |o: usize| Ipv4Addr::new(ip[o], ip[o + 1], ip[o + 2], ip[o + 3]);
        let port = |o: usize| u16::from_be_bytes([l4[o], l4[o + 1]]);
        ((addr(12), port(0)), (addr(16), port(2)))
    }

    /// Both the IPv4 header checksum and the TCP/UDP checksum verify.
    pub fn checksums_valid(frame: &[u8]) -> bool {
        let ip = &frame[14..];
        let header_len = usize::from(ip[0] & 0xf) * 4;
        if fold(sum_words(&ip[..header_len])) != 0 {
            return false;
        }
        let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
        let l4 = &ip[header_len..total];
        let src: [u8; 4] = ip[12..16].try_into().unwrap_or_default();
        let dst: [u8; 4] = ip[16..20].try_into().unwrap_or_default();
        if ip[9] == UDP && l4[6..8] == [0, 0] {
            return true;
        }
        l4_checksum(src, dst, ip[9], l4) == 0
    }

    // ---- IPv6 ----------------------------------------------------------------------------

    pub const ICMPV6: u8 = 58;

    fn v6_pseudo_sum(src: &Ipv6Addr, dst: &Ipv6Addr, next: u8, len: usize) -> u32 {
        sum_words(&src.octets()) + sum_words(&dst.octets()) + len as u32 + u32::from(next)
    }

    /// An Ethernet + IPv6 frame (hop limit 64) around `payload`, whose first header is `next`.
    pub fn ipv6_frame(next: u8, src: Ipv6Addr, dst: Ipv6Addr, payload: &[u8]) -> Vec<u8> {
        let mut frame = DST_MAC.to_vec();
        frame.extend_from_slice(&SRC_MAC);
        frame.extend_from_slice(&[0x86, 0xdd, 0x60, 0, 0, 0]);
        frame.extend_from_slice(&(payload.len() as u16).to_be_bytes());
        frame.extend_from_slice(&[next, 64]);
        frame.extend_from_slice(&src.octets());
        frame.extend_from_slice(&dst.octets());
        frame.extend_from_slice(payload);
        frame
    }

    /// A TCP (flags given), UDP or ICMPv6 message's bytes with its pseudo-header checksum set.
    /// For ICMPv6, `l4` is the whole message with a zero checksum.
    pub fn l4_segment_v6(
        proto: u8,
        src: (Ipv6Addr, u16),
        dst: (Ipv6Addr, u16),
        tcp_flags: u8,
        payload: &[u8],
    ) -> Vec<u8> {
        let mut l4 = unchecksummed_segment(proto, src.1, dst.1, tcp_flags, payload);
        set_checksum_v6(proto, &src.0, &dst.0, &mut l4);
        l4
    }

    /// Where the checksum sits: TCP 16, ICMPv6 2, UDP (and other port-carrying protocols,
    /// built like UDP as `ipv4` builds them: SCTP) 6.
    fn checksum_offset(proto: u8) -> usize {
        match proto {
            TCP => 16,
            ICMPV6 => 2,
            _ => 6,
        }
    }

    fn set_checksum_v6(proto: u8, src: &Ipv6Addr, dst: &Ipv6Addr, l4: &mut [u8]) {
        let off = checksum_offset(proto);
        l4[off..off + 2].copy_from_slice(&[0, 0]);
        let sum = fold(v6_pseudo_sum(src, dst, proto, l4.len()) + sum_words(l4));
        l4[off..off + 2].copy_from_slice(&sum.to_be_bytes());
    }

    /// An Ethernet + IPv6 + TCP or UDP frame with a valid checksum.
    pub fn ipv6(proto: u8, src: (Ipv6Addr, u16), dst: (Ipv6Addr, u16), tcp_flags: u8, payload: &[u8]) -> Vec<u8> {
        ipv6_frame(proto, src.0, dst.0, &l4_segment_v6(proto, src, dst, tcp_flags, payload))
    }

    /// An ICMPv6 echo request (128) or reply (129) with identifier `id`.
    pub fn icmpv6_echo(icmp_type: u8, src: Ipv6Addr, dst: Ipv6Addr, id: u16) -> Vec<u8> {
        let mut icmp = vec![icmp_type, 0, 0, 0, 0, 0, 0, 1, b'p', b'i', b'n', b'g'];
        icmp[4..6].copy_from_slice(&id.to_be_bytes());
        set_checksum_v6(ICMPV6, &src, &dst, &mut icmp);
        ipv6_frame(ICMPV6, src, dst, &icmp)
    }

    /// An ICMPv6 error (e.g. 2/0 "packet too big") from `from` to `to` quoting the IPv6 packet
    /// in `quoted_frame` (its header and the first 8 bytes after it).
    pub fn icmpv6_error(icmp_type: u8, code: u8, from: Ipv6Addr, to: Ipv6Addr, quoted_frame: &[u8]) -> Vec<u8> {
        let mut icmp = vec![icmp_type, code, 0, 0, 0, 0, 0x05, 0x00]; // MTU 1280
        icmp.extend_from_slice(&quoted_frame[14..14 + 40 + 8]);
        set_checksum_v6(ICMPV6, &from, &to, &mut icmp);
        ipv6_frame(ICMPV6, from, to, &icmp)
    }

    /// A fragment of `l4` (an upper-layer `proto` datagram): bytes `offset..offset + len`, with
    /// a fragment header (id, more-fragments flag).
    pub fn ipv6_fragment(
        proto: u8,
        src: Ipv6Addr,
        dst: Ipv6Addr,
        l4: &[u8],
        offset: usize,
        len: usize,
        id: u32,
    ) -> Vec<u8> {
        let more = offset + len < l4.len();
        let mut payload = vec![proto, 0];
        payload.extend_from_slice(&((offset as u16) | u16::from(more)).to_be_bytes());
        payload.extend_from_slice(&id.to_be_bytes());
        payload.extend_from_slice(&l4[offset..offset + len]);
        ipv6_frame(44, src, dst, &payload)
    }

    fn v6_addr(bytes: &[u8]) -> Ipv6Addr {
        let octets: [u8; 16] = bytes.try_into().expect("16 bytes");
        Ipv6Addr::from(octets)
    }

    /// (source, destination) of an IPv6 TCP/UDP frame without extension headers (an echo's id
    /// as both ports).
    pub fn endpoints_v6(frame: &[u8]) -> ((Ipv6Addr, u16), (Ipv6Addr, u16)) {
        let ip = &frame[14..];
        let l4 = &ip[40..];
        let (sport, dport) = if ip[6] == ICMPV6 {
            let id = u16::from_be_bytes([l4[4], l4[5]]);
            (id, id)
        } else {
            (u16::from_be_bytes([l4[0], l4[1]]), u16::from_be_bytes([l4[2], l4[3]]))
        };
        ((v6_addr(&ip[8..24]), sport), (v6_addr(&ip[24..40]), dport))
    }

    /// The L4 (or ICMPv6) checksum of an IPv6 frame without extension headers verifies.
    pub fn checksums_valid_v6(frame: &[u8]) -> bool {
        let ip = &frame[14..];
        let len = usize::from(u16::from_be_bytes([ip[4], ip[5]]));
        let l4 = &ip[40..40 + len];
        fold(v6_pseudo_sum(&v6_addr(&ip[8..24]), &v6_addr(&ip[24..40]), ip[6], len) + sum_words(l4)) == 0
    }

    /// (source, destination) of the packet quoted in an ICMPv6 message.
    pub fn quoted_endpoints_v6(frame: &[u8]) -> ((Ipv6Addr, u16), (Ipv6Addr, u16)) {
        let mut inner = frame[..14].to_vec();
        inner.extend_from_slice(&frame[14 + 40 + 8..]);
        endpoints_v6(&inner)
    }
}
