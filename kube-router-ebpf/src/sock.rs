//! Socket-level load balancing (cgroup sock_addr hooks) for the sockets of processes in the
//! attached cgroup: the node itself, hostNetwork pods and, attached at the cgroup v2 root, every
//! pod. `connect()` and UDP `sendmsg()` to a frontend go straight to a backend chosen like the
//! TC path chooses (`backend::select_backend`), so no packet to a frontend ever exists and the TC
//! programs see only backend traffic. `recvmsg()` and `getpeername()` show the frontend again,
//! from `sock_rev_v4` (socket cookie + backend -> what the application asked for).
//!
//! The IPv6 hooks do the same over `svc_v6` and `sock_rev_v6`. An IPv6 socket may also talk
//! IPv4 through an IPv4-mapped address (`::ffff:a.b.c.d`, a dual-stack socket): that is balanced
//! over the IPv4 maps and the backend written back as a mapped address.
//!
//! Sockets of the agent's own cgroup (`sock_exempt`) are never translated: a frontend, however it
//! got into the maps, must not capture the agent's way to the API server.
use core::ptr::{addr_of, addr_of_mut, read_volatile, write_volatile};

use aya_ebpf::{
    helpers::{
        bpf_get_current_cgroup_id, bpf_get_netns_cookie, bpf_get_socket_cookie, bpf_ktime_get_ns, bpf_set_retval,
    },
    programs::SockAddrContext,
    EbpfContext,
};
use kube_router_common::*;

use crate::{
    backend::select_backend,
    family::{V4, V6},
    maps::{count_sock, SERVICES, SERVICES_V6, SOCK_CONFIG, SOCK_EXEMPT, SOCK_REVERSE, SOCK_REVERSE_V6},
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
    if exempt() {
        return ALLOW;
    }
    let now = unsafe { bpf_ktime_get_ns() };
    let Some((_, backend)) = // No source port exists yet at connect(): a Maglev service hashes the client (netns) alone.
    select_backend::<V4>(client_id(ctx), 0, &service, now) else {
        return refuse();
    };
    remember_frontend(ctx, &backend, addr, port);
    set_destination(ctx, backend.addr, backend.port);
    count_sock(sock_stat::TRANSLATED);
    ALLOW
}

/// Whether the calling process is in an exempt cgroup (the agent's own); counts the call there.
/// Asked only once a frontend matched, so other connects pay nothing for it.
#[inline(always)]
fn exempt() -> bool {
    // The cgroup v2 id of the calling task, whatever cgroup the program is attached to.
    let cgroup = unsafe { bpf_get_current_cgroup_id() };
    let Some(untranslated) = SOCK_EXEMPT.get_ptr_mut(cgroup) else {
        return false;
    };
    // SAFETY: this CPU's slot of the value: no other CPU writes it.
    unsafe { *untranslated += 1 };
    true
}

/// No endpoints: fail at once, as a closed port would, instead of a connect timeout.
/// bpf_set_retval needs 5.18; without it the caller gets EPERM (see docs/maps.md).
#[inline(always)]
fn refuse() -> i32 {
    count_sock(sock_stat::NO_BACKEND_REFUSED);
    unsafe { bpf_set_retval(-ECONNREFUSED) };
    REJECT
}

/// connect6 / sendmsg6: a frontend destination becomes a backend.
#[inline(always)]
pub fn translate6(ctx: &SockAddrContext, call: Call) -> i32 {
    let Some(proto) = ported_protocol(ctx) else {
        return ALLOW;
    };
    count_sock(if call == Call::Connect { sock_stat::CONNECT } else { sock_stat::SENDMSG });
    let (addr, port) = destination6(ctx);
    if let Some(addr4) = ipv4_mapped(&addr) {
        return translate_mapped(ctx, addr4, port, proto);
    }
    let Some(service) = frontend6(ctx, &addr, port, proto) else {
        return ALLOW;
    };
    if exempt() {
        return ALLOW;
    }
    let now = unsafe { bpf_ktime_get_ns() };
    let client = Ipv6Words([0, 0, 0, client_id(ctx)]);
    let Some((_, backend)) = select_backend::<V6>(client, 0, &service, now) else {
        return refuse();
    };
    remember_frontend6(ctx, &backend.addr, backend.port, &addr, port);
    set_destination6(ctx, &backend.addr, backend.port);
    count_sock(sock_stat::TRANSLATED);
    ALLOW
}

/// An IPv4-mapped destination of an IPv6 socket: balanced over the IPv4 Service, the backend
/// written back mapped.
#[inline(always)]
fn translate_mapped(ctx: &SockAddrContext, addr: u32, port: u16, proto: u8) -> i32 {
    let Some(service) = frontend(ctx, addr, port, proto) else {
        return ALLOW;
    };
    if exempt() {
        return ALLOW;
    }
    let now = unsafe { bpf_ktime_get_ns() };
    let Some((_, backend)) = select_backend::<V4>(client_id(ctx), 0, &service, now) else {
        return refuse();
    };
    remember_frontend(ctx, &backend, addr, port);
    set_destination6(ctx, &mapped(backend.addr), backend.port);
    count_sock(sock_stat::TRANSLATED);
    ALLOW
}

/// recvmsg6 / getpeername6: a backend we sent this socket to is shown as the frontend.
#[inline(always)]
pub fn restore6(ctx: &SockAddrContext) -> i32 {
    if ported_protocol(ctx).is_none() {
        return ALLOW;
    }
    let (addr, port) = destination6(ctx);
    if let Some(addr4) = ipv4_mapped(&addr) {
        // SAFETY: read-only copy of a map value.
        if let Some(frontend) = unsafe { SOCK_REVERSE.get(reverse_key(ctx, addr4, port)) }.copied() {
            set_destination6(ctx, &mapped(frontend.frontend_addr), frontend.frontend_port);
            count_sock(sock_stat::REVERSE_RESTORED);
        }
        return ALLOW;
    }
    let key = reverse_key6(ctx, &addr, port);
    // SAFETY: read-only copy of a map value.
    if let Some(frontend) = unsafe { SOCK_REVERSE_V6.get(key) }.copied() {
        set_destination6(ctx, &frontend.frontend_addr, frontend.frontend_port);
        count_sock(sock_stat::REVERSE_RESTORED);
    }
    ALLOW
}

/// `::ffff:0:0/96` in the words' network byte order.
const IPV4_MAPPED_WORD: u32 = u32::from_ne_bytes([0, 0, 0xff, 0xff]);

#[inline(always)]
fn ipv4_mapped(addr: &Ipv6Words) -> Option<u32> {
    let w = &addr.0;
    (w[0] == 0 && w[1] == 0 && w[2] == IPV4_MAPPED_WORD).then_some(w[3])
}

#[inline(always)]
fn mapped(addr: u32) -> Ipv6Words {
    Ipv6Words([0, 0, IPV4_MAPPED_WORD, addr])
}

#[inline(always)]
fn destination6(ctx: &SockAddrContext) -> (Ipv6Words, u16) {
    // SAFETY: ctx points at the kernel's bpf_sock_addr; user_ip6 is read in 4-byte words.
    unsafe {
        let sa = ctx.sock_addr;
        let addr = Ipv6Words([
            read_volatile(addr_of!((*sa).user_ip6[0])),
            read_volatile(addr_of!((*sa).user_ip6[1])),
            read_volatile(addr_of!((*sa).user_ip6[2])),
            read_volatile(addr_of!((*sa).user_ip6[3])),
        ]);
        (addr, read_volatile(addr_of!((*sa).user_port)) as u16)
    }
}

#[inline(always)]
fn set_destination6(ctx: &SockAddrContext, addr: &Ipv6Words, port: u16) {
    // SAFETY: user_ip6 and user_port are writable in the four IPv6 hooks (4-byte stores).
    unsafe {
        let sa = ctx.sock_addr;
        write_volatile(addr_of_mut!((*sa).user_ip6[0]), addr.0[0]);
        write_volatile(addr_of_mut!((*sa).user_ip6[1]), addr.0[1]);
        write_volatile(addr_of_mut!((*sa).user_ip6[2]), addr.0[2]);
        write_volatile(addr_of_mut!((*sa).user_ip6[3]), addr.0[3]);
        write_volatile(addr_of_mut!((*sa).user_port), port as u32);
    }
}

/// As [`frontend`]: an exact `svc_v6` entry, or for `::1` in the node's namespace the NodePort's
/// wildcard entry (address `::`).
#[inline(always)]
fn frontend6(ctx: &SockAddrContext, addr: &Ipv6Words, port: u16, proto: u8) -> Option<ServiceValue> {
    let exact = ServiceKeyV6 { addr: *addr, port, proto, pad: 0 };
    // SAFETY: read-only copies of map values.
    if let Some(service) = unsafe { SERVICES_V6.get(exact) } {
        return Some(*service);
    }
    let w = &addr.0;
    let loopback = w[0] == 0 && w[1] == 0 && w[2] == 0 && w[3] == u32::from_ne_bytes([0, 0, 0, 1]);
    if !loopback || !in_host_netns(ctx) {
        return None;
    }
    let wildcard = ServiceKeyV6 { addr: Ipv6Words::UNSPECIFIED, port, proto, pad: 0 };
    let service = *unsafe { SERVICES_V6.get(wildcard) }?;
    if service.flags & SVC_FLAG_NODEPORT == 0 {
        return None;
    }
    count_sock(sock_stat::LOOPBACK_NODEPORT);
    Some(service)
}

#[inline(always)]
fn reverse_key6(ctx: &SockAddrContext, backend_addr: &Ipv6Words, backend_port: u16) -> SockReverseKeyV6 {
    SockReverseKeyV6 {
        socket_cookie: unsafe { bpf_get_socket_cookie(ctx.as_ptr()) },
        backend_addr: *backend_addr,
        backend_port,
        pad: 0,
        pad2: 0,
    }
}

#[inline(always)]
fn remember_frontend6(ctx: &SockAddrContext, backend_addr: &Ipv6Words, backend_port: u16, addr: &Ipv6Words, port: u16) {
    let key = reverse_key6(ctx, backend_addr, backend_port);
    let value = SockReverseValueV6 { frontend_addr: *addr, frontend_port: port, pad: 0 };
    // SAFETY: read-only copy of a map value.
    if unsafe { SOCK_REVERSE_V6.get(key) }.copied() == Some(value) {
        return;
    }
    if SOCK_REVERSE_V6.insert(key, value, 0).is_err() {
        count_sock(sock_stat::REVERSE_INSERT_FAILED);
    }
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
