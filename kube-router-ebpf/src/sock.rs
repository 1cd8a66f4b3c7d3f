//! Socket-level load balancing (cgroup sock_addr hooks) for the sockets of processes in the
//! attached cgroup: the node itself, hostNetwork pods and, attached at the cgroup v2 root, every
//! pod. `connect()` and UDP `sendmsg()` to a frontend go straight to a backend chosen like the
//! TC path chooses (`backend::select_backend`), so no packet to a frontend ever exists and the TC
//! programs see only backend traffic. `recvmsg()` and `getpeername()` show the frontend again,
//! from `sock_rev_v4` (socket cookie + backend -> what the application asked for).
use core::ptr::{addr_of, addr_of_mut, read_volatile, write_volatile};

use aya_ebpf::{
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie, bpf_ktime_get_ns, bpf_set_retval},
    programs::SockAddrContext,
    EbpfContext,
};
use kube_router_common::*;

use crate::{
    backend::select_backend,
    family::V4,
    maps::{count_sock, SERVICES, SOCK_CONFIG, SOCK_REVERSE},
};

/// Return values of cgroup sock_addr programs.
const ALLOW: i32 = 1;
const REJECT: i32 = 0;
const ECONNREFUSED: i32 = 111;

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Call {
    Connect,
    SendMsg,
}

/// connect4 / sendmsg4: a frontend destination becomes a backend.
#[inline(always)]
pub fn translate(ctx: &SockAddrContext, call: Call) -> i32 {
    let Some(proto) = ported_protocol(ctx) else {
        return ALLOW;
    };
    count_sock(if call == Call::Connect { sock_stat::CONNECT } else { sock_stat::SENDMSG });
    let (addr, port) = destination(ctx);
    let Some(service) = frontend(ctx, addr, port, proto) else {
        return ALLOW;
    };
    let now = unsafe { bpf_ktime_get_ns() };
    let Some((_, backend)) = // No source port exists yet at connect(): a Maglev service hashes the client (netns) alone.
    select_backend::<V4>(client_id(ctx), 0, &service, now) else {
        // No endpoints: fail at once, as a closed port would, instead of a connect timeout.
        // bpf_set_retval needs 5.18; without it the caller gets EPERM (see docs/maps.md).
        count_sock(sock_stat::NO_BACKEND_REFUSED);
        unsafe { bpf_set_retval(-ECONNREFUSED) };
        return REJECT;
    };
    remember_frontend(ctx, &backend, addr, port);
    set_destination(ctx, backend.addr, backend.port);
    count_sock(sock_stat::TRANSLATED);
    ALLOW
}

/// recvmsg4 / getpeername4: a backend we sent this socket to is shown as the frontend.
#[inline(always)]
pub fn restore(ctx: &SockAddrContext) -> i32 {
    if ported_protocol(ctx).is_none() {
        return ALLOW;
    }
    let (addr, port) = destination(ctx);
    let key = reverse_key(ctx, addr, port);
    // SAFETY: read-only copy of a map value.
    if let Some(frontend) = unsafe { SOCK_REVERSE.get(key) }.copied() {
        set_destination(ctx, frontend.frontend_addr, frontend.frontend_port);
        count_sock(sock_stat::REVERSE_RESTORED);
    }
    ALLOW
}

#[inline(always)]
fn ported_protocol(ctx: &SockAddrContext) -> Option<u8> {
    // SAFETY: ctx points at the kernel's bpf_sock_addr for this call; 4-byte context reads.
    let protocol = unsafe { read_volatile(addr_of!((*ctx.sock_addr).protocol)) } as u8;
    (protocol == IPPROTO_TCP || protocol == IPPROTO_UDP).then_some(protocol)
}

/// The sockaddr of the call (network byte order): the destination of connect/sendmsg, the
/// source of a received datagram, the peer for getpeername.
#[inline(always)]
fn destination(ctx: &SockAddrContext) -> (u32, u16) {
    // SAFETY: as above. user_port holds the 16-bit port, network byte order, zero-extended.
    unsafe {
        (read_volatile(addr_of!((*ctx.sock_addr).user_ip4)), read_volatile(addr_of!((*ctx.sock_addr).user_port)) as u16)
    }
}

#[inline(always)]
fn set_destination(ctx: &SockAddrContext, addr: u32, port: u16) {
    // SAFETY: user_ip4 and user_port are writable in all four hooks (4-byte stores).
    unsafe {
        write_volatile(addr_of_mut!((*ctx.sock_addr).user_ip4), addr);
        write_volatile(addr_of_mut!((*ctx.sock_addr).user_port), port as u32);
    }
}

/// The frontend for this destination: an exact `svc_v4` entry, or — for a loopback address in
/// the node's own network namespace — the NodePort's wildcard entry (address 0.0.0.0), written
/// by the agent besides the per-address ones. A pod's loopback is its own and is left alone.
#[inline(always)]
fn frontend(ctx: &SockAddrContext, addr: u32, port: u16, proto: u8) -> Option<ServiceValue> {
    let exact = ServiceKeyV4 { addr, port, proto, pad: 0 };
    // SAFETY: read-only copies of map values.
    if let Some(service) = unsafe { SERVICES.get(exact) } {
        return Some(*service);
    }
    if addr.to_ne_bytes()[0] != 127 || !in_host_netns(ctx) {
        return None;
    }
    let wildcard = ServiceKeyV4 { addr: 0, port, proto, pad: 0 };
    let service = *unsafe { SERVICES.get(wildcard) }?;
    if service.flags & SVC_FLAG_NODEPORT == 0 {
        return None;
    }
    count_sock(sock_stat::LOOPBACK_NODEPORT);
    Some(service)
}

#[inline(always)]
fn in_host_netns(ctx: &SockAddrContext) -> bool {
    let Some(config) = SOCK_CONFIG.get(SOCK_CONFIG_INDEX) else {
        return false;
    };
    let host = config.host_netns_cookie;
    host != 0 && host == unsafe { bpf_get_netns_cookie(ctx.as_ptr()) }
}

/// The affinity client of a socket: its network namespace (the node, or one pod), because the
/// source address is not chosen yet at connect time. Written as an address in 0.0.0.0/8, which
/// is never the source of a packet, so it cannot meet a TC client's key in `affinity_v4`.
#[inline(always)]
fn client_id(ctx: &SockAddrContext) -> u32 {
    let cookie = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    let [b0, b1, b2, _] = (cookie as u32).to_le_bytes();
    u32::from_ne_bytes([0, b0, b1, b2])
}

#[inline(always)]
fn reverse_key(ctx: &SockAddrContext, backend_addr: u32, backend_port: u16) -> SockReverseKeyV4 {
    SockReverseKeyV4 {
        socket_cookie: unsafe { bpf_get_socket_cookie(ctx.as_ptr()) },
        backend_addr,
        backend_port,
        pad: 0,
    }
}

#[inline(always)]
fn remember_frontend(ctx: &SockAddrContext, backend: &BackendV4, addr: u32, port: u16) {
    let key = reverse_key(ctx, backend.addr, backend.port);
    let value = SockReverseValueV4 { frontend_addr: addr, frontend_port: port, pad: 0 };
    // A UDP socket sending many datagrams to one backend writes its entry once.
    // SAFETY: read-only copy of a map value.
    if unsafe { SOCK_REVERSE.get(key) }.copied() == Some(value) {
        return;
    }
    if SOCK_REVERSE.insert(key, value, 0).is_err() {
        count_sock(sock_stat::REVERSE_INSERT_FAILED);
    }
}
