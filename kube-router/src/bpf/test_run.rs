//! BPF_PROG_TEST_RUN: runs a loaded program on a crafted packet inside the kernel. Used by the
//! datapath tests (exact packet rewrites, checksums) and the per-packet benchmark.
use std::{io, net::Ipv4Addr, os::fd::RawFd};

const BPF_PROG_TEST_RUN: libc::c_long = 10;

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
    let mut out = vec![0u8; packet.len() + 256];
    let mut attr = TestRunAttr {
        prog_fd: prog_fd as u32,
        data_size_in: packet.len() as u32,
        data_size_out: out.len() as u32,
        data_in: packet.as_ptr() as u64,
        data_out: out.as_mut_ptr() as u64,
        repeat,
        ..Default::default()
    };
    // SAFETY: attr points at valid buffers of the stated sizes for the duration of the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_PROG_TEST_RUN,
            &mut attr as *mut TestRunAttr,
            std::mem::size_of::<TestRunAttr>() as u32,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    out.truncate(attr.data_size_out as usize);
    Ok(TestRunResult { retval: attr.retval as i32, duration_ns: attr.duration, packet: out })
}

/// Minimal packet crafting and checking for IPv4 TCP/UDP frames.
pub mod packet {
    use super::*;

    pub const TCP: u8 = 6;
    pub const UDP: u8 = 17;
    pub const TCP_SYN: u8 = 0x02;
    pub const TCP_ACK: u8 = 0x10;

    fn fold(mut sum: u32) -> u16 {
        while sum > 0xffff {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        !(sum as u16)
    }

    fn sum_words(bytes: &[u8]) -> u32 {
        bytes.chunks(2).map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]))).sum()
    }

    fn l4_checksum(src: [u8; 4], dst: [u8; 4], proto: u8, l4: &[u8]) -> u16 {
        let pseudo = sum_words(&src) + sum_words(&dst) + u32::from(proto) + l4.len() as u32;
        fold(pseudo + sum_words(l4))
    }

    /// An Ethernet + IPv4 + TCP (flags given) or UDP frame with valid checksums.
    pub fn ipv4(proto: u8, src: (Ipv4Addr, u16), dst: (Ipv4Addr, u16), tcp_flags: u8, payload: &[u8]) -> Vec<u8> {
        let mut frame = vec![0x02, 0, 0, 0, 0, 2, 0x02, 0, 0, 0, 0, 1, 0x08, 0x00];
        let l4_len = if proto == TCP { 20 } else { 8 } + payload.len();
        let total = (20 + l4_len) as u16;
        let mut ip = vec![0x45, 0, 0, 0, 0x12, 0x34, 0x40, 0, 64, proto, 0, 0];
        ip[2..4].copy_from_slice(&total.to_be_bytes());
        ip.extend_from_slice(&src.0.octets());
        ip.extend_from_slice(&dst.0.octets());
        let ip_sum = fold(sum_words(&ip));
        ip[10..12].copy_from_slice(&ip_sum.to_be_bytes());
        let mut l4 = Vec::new();
        l4.extend_from_slice(&src.1.to_be_bytes());
        l4.extend_from_slice(&dst.1.to_be_bytes());
        if proto == TCP {
            l4.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 0, 0x50, tcp_flags, 0xff, 0xff, 0, 0, 0, 0]);
        } else {
            l4.extend_from_slice(&(l4_len as u16).to_be_bytes());
            l4.extend_from_slice(&[0, 0]);
        }
        l4.extend_from_slice(payload);
        let sum = l4_checksum(src.0.octets(), dst.0.octets(), proto, &l4);
        let off = if proto == TCP { 16 } else { 6 };
        l4[off..off + 2].copy_from_slice(&sum.to_be_bytes());
        frame.extend(ip);
        frame.extend(l4);
        frame
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
}
