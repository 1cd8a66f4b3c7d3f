//! Frames for the forwarding benchmarks: tiny XDP programs (a generator run with
//! `BPF_PROG_TEST_RUN` in live-frame mode, trivial receivers) and the helpers around them.
// Each benchmark uses part of it.
#![allow(dead_code)]

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// Minimal BPF programs for the generator and the trivial receivers, loaded from instructions
/// (no object file: they belong to the benchmark, not to the datapath).
pub mod raw {
    use super::*;

    const BPF_PROG_LOAD: libc::c_long = 5;
    const BPF_LINK_CREATE: libc::c_long = 28;
    const BPF_PROG_TYPE_XDP: u32 = 6;
    const BPF_XDP: u32 = 37;
    const XDP_FLAGS_DRV_MODE: u32 = 1 << 2;
    pub const XDP_DROP: i32 = 1;
    pub const XDP_PASS: i32 = 2;
    const BPF_FUNC_REDIRECT: i32 = 23;
    const BPF_FUNC_GET_PRANDOM_U32: i32 = 7;

    fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> u64 {
        u64::from(code) | u64::from(dst | src << 4) << 8 | u64::from(off as u16) << 16 | u64::from(imm as u32) << 32
    }
    fn mov_imm(dst: u8, imm: i32) -> u64 {
        insn(0xb7, dst, 0, 0, imm)
    }
    fn exit() -> u64 {
        insn(0x95, 0, 0, 0, 0)
    }

    fn bpf(cmd: libc::c_long, attr: &mut [u8; 128]) -> std::io::Result<OwnedFd> {
        // SAFETY: a zero-padded bpf_attr for `cmd` whose pointers outlive the call.
        let fd = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), 128u32) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: the kernel just gave us this descriptor.
        Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
    }

    fn load(insns: &[u64]) -> OwnedFd {
        let license = c"GPL";
        let mut log = vec![0u8; 65536];
        let mut attr = [0u8; 128];
        attr[0..4].copy_from_slice(&BPF_PROG_TYPE_XDP.to_ne_bytes());
        attr[4..8].copy_from_slice(&(insns.len() as u32).to_ne_bytes());
        attr[8..16].copy_from_slice(&(insns.as_ptr() as u64).to_ne_bytes());
        attr[16..24].copy_from_slice(&(license.as_ptr() as u64).to_ne_bytes());
        attr[24..28].copy_from_slice(&1u32.to_ne_bytes());
        attr[28..32].copy_from_slice(&(log.len() as u32).to_ne_bytes());
        attr[32..40].copy_from_slice(&(log.as_mut_ptr() as u64).to_ne_bytes());
        bpf(BPF_PROG_LOAD, &mut attr).unwrap_or_else(|e| {
            let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
            panic!("loading a benchmark program: {e}\n{}", String::from_utf8_lossy(&log[..end]))
        })
    }

    /// `return action;`
    pub fn verdict(action: i32) -> OwnedFd {
        load(&[mov_imm(0, action), exit()])
    }

    /// The generator: writes `header` (whole 32-bit words) over the start of the frame, so every
    /// frame leaves as built whatever a receiver did to its page before, and redirects it to
    /// `ifindex`. A frame shorter than the header is dropped.
    pub fn generator(header: &[u8], ifindex: u32) -> OwnedFd {
        load(&frame_writer(header, ifindex, &[]))
    }

    /// Like [`generator`], for an IPv4 UDP `header` whose source address ends in 0.0 and whose
    /// IP id is 0xffff: every frame gets a random source port and random last two bytes of its
    /// source address, and the id becomes their complement, so the IPv4 checksum stays valid
    /// (one's complement: x + !x is 0xffff, as 0 + 0xffff was). Each frame is a new flow.
    pub fn new_flow_generator(header: &[u8], ifindex: u32) -> OwnedFd {
        assert_eq!(&header[28..30], &[0, 0], "source address x.y.0.0");
        assert_eq!(&header[18..20], &[0xff, 0xff], "IP id 0xffff");
        let randomise = [
            insn(0x85, 0, 0, 0, BPF_FUNC_GET_PRANDOM_U32),
            insn(0x6b, 6, 0, 34, 0),     // *(u16 *)(r6 + 34) = r0: UDP source port
            insn(0x77, 0, 0, 0, 16),     // r0 >>= 16
            insn(0x6b, 6, 0, 28, 0),     // *(u16 *)(r6 + 28) = r0: source address, last two bytes
            insn(0xa7, 0, 0, 0, 0xffff), // r0 ^= 0xffff
            insn(0x6b, 6, 0, 18, 0),     // *(u16 *)(r6 + 18) = r0: IP id
        ];
        load(&frame_writer(header, ifindex, &randomise))
    }

    /// Instructions that write `header` over the frame (r6 points at it: callee-saved, so
    /// `per_frame` may call helpers and still write through it), run `per_frame`, and redirect
    /// the frame to `ifindex`; a frame shorter than the header is dropped.
    fn frame_writer(header: &[u8], ifindex: u32, per_frame: &[u64]) -> Vec<u64> {
        let words: Vec<i32> = header.chunks_exact(4).map(|w| i32::from_ne_bytes(w.try_into().unwrap())).collect();
        let redirect = [mov_imm(1, ifindex as i32), mov_imm(2, 0), insn(0x85, 0, 0, 0, BPF_FUNC_REDIRECT), exit()];
        let mut p = vec![
            insn(0x61, 6, 1, 0, 0), // r6 = ctx->data
            insn(0x61, 3, 1, 4, 0), // r3 = ctx->data_end
            insn(0xbf, 4, 6, 0, 0), // r4 = r6
            insn(0x07, 4, 0, 0, 4 * words.len() as i32),
            // if r4 > r3: to the drop at the end, past the stores, `per_frame` and the redirect
            insn(0x2d, 4, 3, (words.len() + per_frame.len() + redirect.len()) as i16, 0),
        ];
        for (i, word) in words.iter().enumerate() {
            p.push(insn(0x62, 6, 0, 4 * i as i16, *word)); // *(u32 *)(r6 + 4i) = word
        }
        p.extend_from_slice(per_frame);
        p.extend(redirect);
        p.extend([mov_imm(0, XDP_DROP), exit()]);
        p
    }

    /// Attaches `prog` to `ifindex` in native mode; detached when the link is dropped.
    pub fn attach(prog: &OwnedFd, ifindex: u32) -> OwnedFd {
        let mut attr = [0u8; 128];
        attr[0..4].copy_from_slice(&(prog.as_raw_fd() as u32).to_ne_bytes());
        attr[4..8].copy_from_slice(&ifindex.to_ne_bytes());
        attr[8..12].copy_from_slice(&BPF_XDP.to_ne_bytes());
        attr[12..16].copy_from_slice(&XDP_FLAGS_DRV_MODE.to_ne_bytes());
        bpf(BPF_LINK_CREATE, &mut attr).expect("attach a benchmark XDP program")
    }
}

/// Sets each `name=value` sysctl in network namespace `netns`.
pub fn netns_sysctls(netns: &str, settings: &[&str]) {
    for setting in settings {
        let ok = std::process::Command::new("ip").args(["netns", "exec", netns, "sysctl", "-qw", setting]).status();
        assert!(ok.is_ok_and(|s| s.success()), "{setting}");
    }
}

pub fn pin_to_cpu(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t with one bit set, applied to the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        assert_eq!(libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set), 0, "pin to CPU {cpu}");
    }
}

/// Packets `ga` received (what the contender forwarded), from the kernel's link statistics.
pub fn received_at_ga(netns: &str) -> u64 {
    let out = std::process::Command::new("ip").args(["-n", netns, "-s", "-j", "link", "show", "ga"]).output().unwrap();
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("ip -j output");
    json[0]["stats64"]["rx"]["packets"].as_u64().expect("rx packets")
}
