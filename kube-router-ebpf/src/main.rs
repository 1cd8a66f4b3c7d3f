//! kube-router datapath: TC programs for service load-balancing and NetworkPolicy.
//!
//! `kr_lb_ingress` runs at TC ingress of every node interface and DNATs packets addressed to a
//! service frontend (ClusterIP, ExternalIP, LoadBalancer IP, node IP + NodePort) to a backend;
//! `kr_lb_egress` runs at TC egress and reverse-NATs the backend's replies. `ct_v4` keeps a
//! flow on its backend. TC rather
//! than XDP because the checksum helpers need an skb (and handle CHECKSUM_PARTIAL packets from
//! local veths), and TC also sees traffic that XDP cannot (pod veths, locally routed packets).
//!
//! `kr_pol_ingress` / `kr_pol_egress` enforce NetworkPolicy on the host side of pod veths (see
//! `policy`): TC ingress there carries the pod's egress traffic, TC egress its ingress traffic.
//!
//! `kr_ovl_encap` / `kr_ovl_decap` carry pod traffic between nodes on different subnets in
//! IPIP or FOU/GUE packets (see `overlay`).
#![no_std]
#![no_main]

mod backend;
mod conntrack;
mod family;
mod frag;
mod icmp;
mod lb;
mod maps;
mod nat;
mod overlay;
mod parsing;
mod policy;
mod reject;
mod route;

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

/// Host side of a pod veth, TC ingress: packets from the pod, judged by its egress policy.
#[classifier]
pub fn kr_pol_ingress(ctx: TcContext) -> i32 {
    policy::enforce(&ctx, policy::VethHook::FromPod).unwrap_or(TC_ACT_UNSPEC)
}

/// Host side of a pod veth, TC egress: packets to the pod, judged by its ingress policy.
#[classifier]
pub fn kr_pol_egress(ctx: TcContext) -> i32 {
    policy::enforce(&ctx, policy::VethHook::ToPod).unwrap_or(TC_ACT_UNSPEC)
}

/// TC egress of an interface towards tunnel endpoints: encapsulation.
#[classifier]
pub fn kr_ovl_encap(ctx: TcContext) -> i32 {
    overlay::encap(&ctx).unwrap_or(TC_ACT_UNSPEC)
}

/// TC ingress of an interface tunnelled packets arrive on: decapsulation.
#[classifier]
pub fn kr_ovl_decap(ctx: TcContext) -> i32 {
    overlay::decap(&ctx).unwrap_or(TC_ACT_UNSPEC)
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
