//! kube-router datapath: TC programs for service load-balancing and NetworkPolicy.
//!
//! `kr_lb_ingress` runs at TC ingress of every node interface and DNATs packets addressed to a
//! service frontend (ClusterIP, ExternalIP, LoadBalancer IP, node IP + NodePort) to a backend;
//! `kr_lb_egress` runs at TC egress and reverse-NATs the backend's replies. `ct_v4` keeps a
//! flow on its backend. TC rather
//! than XDP because the checksum helpers need an skb (and handle CHECKSUM_PARTIAL packets from
//! local veths), and TC also sees traffic that XDP cannot (pod veths, locally routed packets).
//!
//! `kr_xdp_lb` is an optional XDP fast path in front of `kr_lb_ingress` on node uplinks, for
//! north-south flows whose backend is on another node (see `xdp`).
//!
//! `kr_pol_ingress` / `kr_pol_egress` enforce NetworkPolicy on the host side of pod veths (see
//! `policy`): TC ingress there carries the pod's egress traffic, TC egress its ingress traffic.
//!
//! `kr_ovl_encap` / `kr_ovl_decap` carry pod traffic between nodes on different subnets in
//! IPIP or FOU/GUE packets (see `overlay`).
//!
//! `kr_sk_*` are cgroup sock_addr programs (see `sock`): socket-level load balancing for traffic
//! the node and hostNetwork pods originate, which never crosses a TC ingress.
#![no_std]
#![no_main]

mod backend;
mod conntrack;
mod dsr;
mod events;
mod family;
mod frag;
mod gate;
mod icmp;
mod lb;
mod maps;
mod nat;
mod overlay;
mod packet;
mod parsing;
mod plain;
mod policy;
mod reject;
mod route;
mod sock;
mod source_check;
mod svc_stats;
mod xdp;

use aya_ebpf::{
    bindings::{TC_ACT_SHOT, TC_ACT_UNSPEC},
    macros::{cgroup_sock_addr, classifier, xdp},
    programs::{SockAddrContext, TcContext, XdpContext},
};

// A packet we cannot parse is not ours to judge: it is handed on untouched. On a pod veth the
// first program checks the source address (`source_check`) before anything rewrites it.
#[classifier]
pub fn kr_lb_ingress(ctx: TcContext) -> i32 {
    // The source check first, whatever the cache says of the tuple: it is this interface's.
    plain::probe(&ctx);
    if source_check::spoofed_unless_known(&ctx, kube_router_common::SOURCE_CHECK_BY_LB) {
        return TC_ACT_SHOT;
    }
    if plain::known_again(plain::LB_INGRESS) != 0 {
        return lb::known_plain_ingress();
    }
    lb::handle_ingress(&ctx).unwrap_or(TC_ACT_UNSPEC)
}

#[classifier]
pub fn kr_lb_egress(ctx: TcContext) -> i32 {
    if plain::known(&ctx, plain::LB_EGRESS) != 0 {
        return TC_ACT_UNSPEC;
    }
    lb::handle_egress(&ctx).unwrap_or(TC_ACT_UNSPEC)
}

/// XDP on node uplinks: north-south service flows to backends on other nodes, translated and
/// sent back out before the stack sees them (see `xdp`); everything else passes on to TC.
#[xdp]
pub fn kr_xdp_lb(ctx: XdpContext) -> u32 {
    xdp::handle(&ctx)
}

/// Host side of a pod veth, TC ingress: packets from the pod, judged by its egress policy (and,
/// without the load balancer in front, their source address: `source_check`). A packet the
/// policy cannot read is dropped, not handed on unjudged (see `policy::malformed`).
#[classifier]
pub fn kr_pol_ingress(ctx: TcContext) -> i32 {
    let known = plain::known(&ctx, plain::POLICY_FROM_POD);
    if known != 0 {
        return policy::known_plain(&ctx, policy::VethHook::FromPod, known);
    }
    if source_check::spoofed_unless_known(&ctx, kube_router_common::SOURCE_CHECK_BY_POLICY) {
        return TC_ACT_SHOT;
    }
    policy::enforce(&ctx, policy::VethHook::FromPod)
        .unwrap_or_else(|_| policy::malformed(&ctx, policy::VethHook::FromPod))
}

/// Host side of a pod veth, TC egress: packets to the pod, judged by its ingress policy.
#[classifier]
pub fn kr_pol_egress(ctx: TcContext) -> i32 {
    let known = plain::known(&ctx, plain::POLICY_TO_POD);
    if known != 0 {
        return policy::known_plain(&ctx, policy::VethHook::ToPod, known);
    }
    policy::enforce(&ctx, policy::VethHook::ToPod).unwrap_or_else(|_| policy::malformed(&ctx, policy::VethHook::ToPod))
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

/// `connect()` of a TCP or UDP socket to a frontend: connects to a backend instead.
#[cgroup_sock_addr(connect4)]
pub fn kr_sk_connect4(ctx: SockAddrContext) -> i32 {
    sock::translate(&ctx, sock::Call::Connect)
}

/// UDP `sendmsg()`/`sendto()` to a frontend: the datagram goes to a backend instead.
#[cgroup_sock_addr(sendmsg4)]
pub fn kr_sk_sendmsg4(ctx: SockAddrContext) -> i32 {
    sock::translate(&ctx, sock::Call::SendMsg)
}

/// UDP `recvmsg()`/`recvfrom()`: a reply from the backend is shown as coming from the frontend.
#[cgroup_sock_addr(recvmsg4)]
pub fn kr_sk_recvmsg4(ctx: SockAddrContext) -> i32 {
    sock::restore(&ctx)
}

/// `getpeername()`: a socket connected through the frontend names the frontend as its peer.
#[cgroup_sock_addr(getpeername4)]
pub fn kr_sk_getpeer4(ctx: SockAddrContext) -> i32 {
    sock::restore(&ctx)
}

/// `connect()` of an IPv6 (or dual-stack) socket to a frontend: connects to a backend instead;
/// an IPv4-mapped destination is balanced over the IPv4 Service.
#[cgroup_sock_addr(connect6)]
pub fn kr_sk_connect6(ctx: SockAddrContext) -> i32 {
    sock::translate6(&ctx, sock::Call::Connect)
}

#[cgroup_sock_addr(sendmsg6)]
pub fn kr_sk_sendmsg6(ctx: SockAddrContext) -> i32 {
    sock::translate6(&ctx, sock::Call::SendMsg)
}

#[cgroup_sock_addr(recvmsg6)]
pub fn kr_sk_recvmsg6(ctx: SockAddrContext) -> i32 {
    sock::restore6(&ctx)
}

#[cgroup_sock_addr(getpeername6)]
pub fn kr_sk_getpeer6(ctx: SockAddrContext) -> i32 {
    sock::restore6(&ctx)
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
