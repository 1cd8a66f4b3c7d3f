//! Interfaces and addresses of the network namespace the agent runs in. Uses the socket APIs
//! rather than /sys/class/net, which shows the namespace sysfs was mounted in.
use std::{
    ffi::CStr,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

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
    interface_addresses()
        .into_iter()
        .filter_map(|addr| match addr {
            IpAddr::V4(v4) => Some(v4),
            IpAddr::V6(_) => None,
        })
        .collect()
}

/// Global IPv6 addresses (not loopback, not link-local) configured on the node's interfaces:
/// where IPv6 NodePorts listen, and whether the node has IPv6 at all.
pub fn ipv6_addresses() -> Vec<Ipv6Addr> {
    interface_addresses()
        .into_iter()
        .filter_map(|addr| match addr {
            IpAddr::V6(v6) => Some(v6),
            IpAddr::V4(_) => None,
        })
        .collect()
}

/// The node's addresses of both families, sorted, without loopback, link-local or unspecified
/// ones.
fn interface_addresses() -> Vec<IpAddr> {
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
            let addr = if ifa.ifa_addr.is_null() {
                None
            } else {
                match i32::from((*ifa.ifa_addr).sa_family) {
                    libc::AF_INET => {
                        let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                        Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr))))
                    }
                    libc::AF_INET6 => {
                        let sin6 = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                        let v6 = Ipv6Addr::from(sin6.sin6_addr.s6_addr);
                        (!v6.is_unicast_link_local()).then_some(IpAddr::V6(v6))
                    }
                    _ => None,
                }
            };
            if let Some(addr) = addr.filter(|a| !a.is_loopback() && !a.is_unspecified()) {
                addrs.push(addr);
            }
            cursor = ifa.ifa_next;
        }
        libc::freeifaddrs(head);
    }
    addrs.sort();
    addrs.dedup();
    addrs
}

/// Every address of the node, IPv4 then IPv6 (see [`ipv4_addresses`], [`ipv6_addresses`]).
pub fn node_addresses() -> Vec<IpAddr> {
    let v4 = ipv4_addresses().into_iter().map(IpAddr::V4);
    v4.chain(ipv6_addresses().into_iter().map(IpAddr::V6)).collect()
}

/// The IPv6 source address the kernel picks for the default route, if there is one.
pub fn default_route_source_v6() -> Option<Ipv6Addr> {
    let socket = std::net::UdpSocket::bind((Ipv6Addr::UNSPECIFIED, 0)).ok()?;
    // The documentation prefix: routed like any global address; nothing is sent.
    socket.connect((Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1), 9)).ok()?;
    match socket.local_addr().ok()?.ip() {
        IpAddr::V6(addr) if !addr.is_unspecified() && !addr.is_loopback() && !addr.is_unicast_link_local() => {
            Some(addr)
        }
        _ => None,
    }
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

/// Creates the bridge `name` if missing, brings it up and gives it `addresses` (those it lacks);
/// other addresses and settings are left alone. Returns whether anything changed.
pub async fn ensure_bridge(name: &str, addresses: &[ipnet::IpNet]) -> anyhow::Result<bool> {
    use anyhow::Context;
    use futures_util::TryStreamExt;
    use rtnetlink::{packet_route::address::AddressAttribute, LinkBridge, LinkUnspec};

    let (connection, handle, _) = rtnetlink::new_connection().context("opening rtnetlink")?;
    let connection = tokio::spawn(connection);
    let result = async {
        let find = |handle: rtnetlink::Handle| async move {
            let mut links = handle.link().get().match_name(name.to_string()).execute();
            Ok::<_, anyhow::Error>(links.try_next().await.ok().flatten().map(|link| link.header.index))
        };
        let mut changed = false;
        let index = match find(handle.clone()).await? {
            Some(index) => index,
            None => {
                handle
                    .link()
                    .add(LinkBridge::new(name).build())
                    .execute()
                    .await
                    .with_context(|| format!("creating {name}"))?;
                changed = true;
                find(handle.clone()).await?.with_context(|| format!("{name} missing after creation"))?
            }
        };
        handle.link().set(LinkUnspec::new_with_index(index).up().build()).execute().await.context("setting it up")?;
        let mut present = Vec::new();
        let mut stream = handle.address().get().set_link_index_filter(index).execute();
        while let Some(message) = stream.try_next().await.context("listing its addresses")? {
            for attribute in &message.attributes {
                if let AddressAttribute::Address(ip) = attribute {
                    present.push((*ip, message.header.prefix_len));
                }
            }
        }
        for net in addresses {
            if !present.contains(&(net.addr(), net.prefix_len())) {
                handle
                    .address()
                    .add(index, net.addr(), net.prefix_len())
                    .execute()
                    .await
                    .with_context(|| format!("adding {net} to {name}"))?;
                changed = true;
            }
        }
        Ok(changed)
    }
    .await;
    connection.abort();
    result
}

/// The MTU of the interface that holds `addr`, if any.
pub fn mtu_of_address(addr: Ipv4Addr) -> Option<u32> {
    let name = {
        let mut found = None;
        // SAFETY: as in ipv4_addresses: a linked list walked read-only and freed.
        unsafe {
            let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
            if libc::getifaddrs(&mut head) != 0 {
                return None;
            }
            let mut cursor = head;
            while !cursor.is_null() {
                let ifa = &*cursor;
                if !ifa.ifa_addr.is_null() && i32::from((*ifa.ifa_addr).sa_family) == libc::AF_INET {
                    let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                    if Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)) == addr {
                        found = Some(CStr::from_ptr(ifa.ifa_name).to_owned());
                        break;
                    }
                }
                cursor = ifa.ifa_next;
            }
            libc::freeifaddrs(head);
        }
        found?
    };
    // SAFETY: a plain socket for the SIOCGIFMTU ioctl, closed right after.
    unsafe {
        let socket = libc::socket(libc::AF_INET, libc::SOCK_DGRAM, 0);
        if socket < 0 {
            return None;
        }
        let mut request: libc::ifreq = std::mem::zeroed();
        for (slot, byte) in request.ifr_name.iter_mut().zip(name.to_bytes()) {
            *slot = *byte as libc::c_char;
        }
        let rc = libc::ioctl(socket, libc::SIOCGIFMTU as _, &mut request);
        libc::close(socket);
        (rc == 0).then_some(request.ifr_ifru.ifru_mtu as u32)
    }
}

/// The index of the interface `name`, if it exists.
pub fn interface_index(name: &str) -> Option<u32> {
    let name = std::ffi::CString::new(name).ok()?;
    // SAFETY: a valid NUL-terminated name.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    (index != 0).then_some(index)
}

/// The name of the interface with index `index`, if it exists.
pub fn interface_name(index: u32) -> Option<String> {
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: buf holds IF_NAMESIZE bytes, as if_indextoname requires.
    let name = unsafe { libc::if_indextoname(index, buf.as_mut_ptr()) };
    // SAFETY: on success the buffer holds a NUL-terminated name.
    (!name.is_null()).then(|| unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned())
}

/// Interfaces with their indexes (a re-created interface of the same name gets a new index).
pub fn interfaces_with_index() -> Vec<(String, u32)> {
    interfaces().into_iter().filter_map(|name| Some((interface_index_of(&name)?, name))).map(|(i, n)| (n, i)).collect()
}

fn interface_index_of(name: &str) -> Option<u32> {
    let name = std::ffi::CString::new(name).ok()?;
    // SAFETY: name is a valid NUL-terminated string.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    (index != 0).then_some(index)
}

/// Link and address events (RTM_NEWLINK / RTM_DELLINK, RTM_NEWADDR / RTM_DELADDR) of the
/// agent's network namespace, from a netlink socket subscribed to those multicast groups: a
/// new pod veth is seen as the CNI plugin creates it, a new node address (NodePorts listen on
/// it) as it is added, not at the next poll.
pub struct LinkEvents {
    socket: tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>,
}

impl LinkEvents {
    pub fn open() -> std::io::Result<Self> {
        use std::os::fd::FromRawFd;
        const RTMGRP_LINK: u32 = 0x1;
        const RTMGRP_IPV4_IFADDR: u32 = 0x10;
        const RTMGRP_IPV6_IFADDR: u32 = 0x100;
        // SAFETY: plain socket(2); the fd is owned below.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                libc::NETLINK_ROUTE,
            )
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: fd is a new socket nothing else owns.
        let socket = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        // SAFETY: sockaddr_nl is plain data; zeroed is a valid value.
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        addr.nl_groups = RTMGRP_LINK | RTMGRP_IPV4_IFADDR | RTMGRP_IPV6_IFADDR;
        // SAFETY: addr is a valid sockaddr_nl of the size passed.
        let rc = unsafe {
            libc::bind(fd, std::ptr::addr_of!(addr).cast(), std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t)
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: the OwnedFd stays open and the same for the AsyncFd's lifetime (it owns it).
        let socket = unsafe { tokio::io::unix::AsyncFd::register(socket) }.map_err(std::io::Error::from)?;
        Ok(Self { socket })
    }

    /// Waits for at least one link event and consumes every event queued. Which link changed
    /// does not matter: the caller rescans (an overflowing queue, ENOBUFS, also means "rescan").
    pub async fn changed(&mut self) -> std::io::Result<()> {
        use std::os::fd::AsRawFd;
        let mut buf = [0u8; 16 * 1024];
        loop {
            let mut guard = self.socket.readable().await?;
            let mut got = false;
            loop {
                // SAFETY: buf is writable for its whole length.
                let n = unsafe { libc::recv(self.socket.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
                if n >= 0 {
                    got = true;
                    continue;
                }
                let error = std::io::Error::last_os_error();
                match error.raw_os_error() {
                    Some(libc::EAGAIN) => break,
                    Some(libc::ENOBUFS) => got = true,
                    _ => return Err(error),
                }
            }
            guard.clear_ready();
            if got {
                return Ok(());
            }
        }
    }
}

/// The kernel driver behind an interface (`veth`, `bridge`, `virtio_net`, ...), from the
/// ETHTOOL_GDRVINFO ioctl: works in the agent's network namespace, unlike /sys/class/net.
pub fn driver(name: &str) -> Option<String> {
    const SIOCETHTOOL: libc::c_ulong = 0x8946;
    const ETHTOOL_GDRVINFO: u32 = 0x3;
    #[repr(C)]
    struct DrvInfo {
        cmd: u32,
        driver: [u8; 32],
        rest: [u8; 32 * 4 + 12 + 4 * 5],
    }
    #[repr(C)]
    struct IfReq {
        name: [u8; libc::IFNAMSIZ],
        data: *mut DrvInfo,
        pad: [u8; 16],
    }
    if name.len() >= libc::IFNAMSIZ {
        return None;
    }
    let mut info = DrvInfo { cmd: ETHTOOL_GDRVINFO, driver: [0; 32], rest: [0; 32 * 4 + 12 + 4 * 5] };
    let mut request = IfReq { name: [0; libc::IFNAMSIZ], data: &mut info, pad: [0; 16] };
    request.name[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: a plain datagram socket for the ioctl, closed right after; request and info
    // outlive the call and have the layouts the kernel expects.
    let ok = unsafe {
        let socket = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if socket < 0 {
            return None;
        }
        let rc = libc::ioctl(socket, SIOCETHTOOL as _, &mut request);
        libc::close(socket);
        rc == 0
    };
    if !ok {
        return None;
    }
    let len = info.driver.iter().position(|b| *b == 0).unwrap_or(info.driver.len());
    Some(String::from_utf8_lossy(&info.driver[..len]).into_owned())
}

/// The interfaces IPv4 default routes leave through (`/proc/self/net/route` is this namespace's).
pub fn default_route_interfaces() -> Vec<String> {
    let table = std::fs::read_to_string("/proc/self/net/route").unwrap_or_default();
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            (fields.len() > 7 && fields[1] == "00000000" && fields[7] == "00000000").then(|| fields[0].to_string())
        })
        .collect()
}

/// Where NetworkPolicy is enforced: a pod's veth (host end). Every veth except an uplink: one
/// that carries the default route (nodes that are themselves containers or namespaces have veth
/// uplinks) or the route to the API server or a configured BGP peer router; bridges,
/// physical and tunnel devices never carry a pod's own traffic alone.
pub fn is_pod_interface(name: &str, uplinks: &[String]) -> bool {
    driver(name).as_deref() == Some("veth") && !uplinks.iter().any(|u| u == name)
}
