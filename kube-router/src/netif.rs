//! Interfaces and addresses of the network namespace the agent runs in. Uses the socket APIs
//! rather than /sys/class/net, which shows the namespace sysfs was mounted in.
use std::{ffi::CStr, net::Ipv4Addr};

/// Names of all interfaces except loopback.
pub fn interfaces() -> Vec<String> {
    let mut names = Vec::new();
    // SAFETY: if_nameindex returns a NULL-terminated array we free with if_freenameindex.
    unsafe {
        let list = libc::if_nameindex();
        if list.is_null() {
            return names;
        }
        let mut entry = list;
        while (*entry).if_index != 0 && !(*entry).if_name.is_null() {
            let name = CStr::from_ptr((*entry).if_name).to_string_lossy().into_owned();
            if name != "lo" {
                names.push(name);
            }
            entry = entry.add(1);
        }
        libc::if_freenameindex(list);
    }
    names.sort();
    names
}

/// IPv4 addresses configured on non-loopback interfaces.
pub fn ipv4_addresses() -> Vec<Ipv4Addr> {
    let mut addrs = Vec::new();
    // SAFETY: getifaddrs allocates a linked list we walk read-only and free with freeifaddrs.
    unsafe {
        let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
        if libc::getifaddrs(&mut head) != 0 {
            return addrs;
        }
        let mut cursor = head;
        while !cursor.is_null() {
            let ifa = &*cursor;
            if !ifa.ifa_addr.is_null() && i32::from((*ifa.ifa_addr).sa_family) == libc::AF_INET {
                let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                let addr = Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
                if !addr.is_loopback() {
                    addrs.push(addr);
                }
            }
            cursor = ifa.ifa_next;
        }
        libc::freeifaddrs(head);
    }
    addrs.sort();
    addrs.dedup();
    addrs
}

/// The source address the kernel picks for the default route (a UDP "connect" sends nothing),
/// i.e. the address the node talks to the world with.
pub fn default_route_source() -> Option<Ipv4Addr> {
    let socket = std::net::UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).ok()?;
    // Any address outside every private range works; nothing is sent.
    socket.connect((Ipv4Addr::new(192, 0, 2, 1), 9)).ok()?;
    match socket.local_addr().ok()?.ip() {
        std::net::IpAddr::V4(addr) if !addr.is_unspecified() && !addr.is_loopback() => Some(addr),
        _ => None,
    }
}
