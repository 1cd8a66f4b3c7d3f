//! kube-router datapath: TC programs for service load-balancing.
//!
//! `kr_lb_ingress` runs at TC ingress of every node interface and DNATs packets addressed to a
//! service frontend (ClusterIP, ExternalIP, LoadBalancer IP, node IP + NodePort) to a backend;
//! `kr_lb_egress` runs at TC egress and reverse-NATs the backend's replies. `ct_v4` keeps a
//! flow on its backend. TC rather
//! than XDP because the checksum helpers need an skb (and handle CHECKSUM_PARTIAL packets from
//! local veths), and TC also sees traffic that XDP cannot (pod veths, locally routed packets).
#![no_std]
#![no_main]

mod conntrack;
mod lb;
mod maps;
mod nat;
mod parsing;

use aya_ebpf::{bindings::TC_ACT_UNSPEC, macros::classifier, programs::TcContext};

// A packet we cannot parse is not ours to judge: it is handed on untouched.
#[classifier]
pub fn kr_lb_ingress(ctx: TcContext) -> i32 {
    lb::handle_ingress(&ctx).unwrap_or(TC_ACT_UNSPEC)
}

#[classifier]
pub fn kr_lb_egress(ctx: TcContext) -> i32 {
    lb::handle_egress(&ctx).unwrap_or(TC_ACT_UNSPEC)
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
