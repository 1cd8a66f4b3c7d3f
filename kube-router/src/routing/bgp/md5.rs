//! Socket options of BGP and BFD sessions: TCP MD5 signatures (RFC 2385, `TCP_MD5SIG`), TTLs.
//!
//! libc has the option number but not the kernel's `struct tcp_md5sig`, so it is declared here.
use std::{
    io,
    net::{IpAddr, SocketAddr},
    os::fd::RawFd,
};

/// `TCP_MD5SIG_MAXKEYLEN` in linux/tcp.h.
pub const MAX_KEY_LEN: usize = 80;

/// `struct tcp_md5sig` from linux/tcp.h.
#[repr(C)]
struct TcpMd5Sig {
    addr: libc::sockaddr_storage,
    flags: u8,
    prefix_len: u8,
    key_len: u16,
    ifindex: libc::c_int,
    key: [u8; MAX_KEY_LEN],
}

fn sockaddr_storage(addr: IpAddr) -> libc::sockaddr_storage {
    sockaddr(SocketAddr::new(addr, 0)).0
}

/// A socket address as the kernel takes it, with its length.
pub fn sockaddr(addr: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain old data; all-zero is a valid value.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(v4) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: v4.port().to_be(),
                sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(v4.ip().octets()) },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_in fits in sockaddr_storage, which is designed to hold any sockaddr.
            unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(v6) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: v6.port().to_be(),
                sin6_flowinfo: 0,
                sin6_addr: libc::in6_addr { s6_addr: v6.ip().octets() },
                sin6_scope_id: 0,
            };
            // SAFETY: as above.
            unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (storage, len as libc::socklen_t)
}

/// Sets (or, with an empty key, removes) the MD5 key for segments to and from `peer` on `fd`.
/// On a listening socket it applies to connections accepted from `peer`.
pub fn set_tcp_md5_key(fd: RawFd, peer: IpAddr, key: &[u8]) -> io::Result<()> {
    if key.len() > MAX_KEY_LEN {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("TCP MD5 key is {} bytes, the kernel allows at most {MAX_KEY_LEN}", key.len()),
        ));
    }
    let mut sig = TcpMd5Sig {
        addr: sockaddr_storage(peer),
        flags: 0,
        prefix_len: 0,
        key_len: key.len() as u16,
        ifindex: 0,
        key: [0; MAX_KEY_LEN],
    };
    sig.key[..key.len()].copy_from_slice(key);
    // SAFETY: `sig` is a valid tcp_md5sig and the length passed is its size.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_MD5SIG,
            (&sig as *const TcpMd5Sig).cast(),
            std::mem::size_of::<TcpMd5Sig>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// `setsockopt` of an int-valued option (IP_TTL, IP_MINTTL, IPV6_UNICAST_HOPS, ...).
pub fn set_int_option(fd: RawFd, level: libc::c_int, name: libc::c_int, value: libc::c_int) -> io::Result<()> {
    // SAFETY: fd is an open socket; value outlives the call and its size is passed.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            std::ptr::addr_of!(value).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The TTL (IPv4) or hop limit (IPv6) of packets sent on the socket.
pub fn set_ttl(fd: RawFd, ipv4: bool, ttl: u32) -> io::Result<()> {
    let (level, name) =
        if ipv4 { (libc::IPPROTO_IP, libc::IP_TTL) } else { (libc::IPPROTO_IPV6, libc::IPV6_UNICAST_HOPS) };
    set_int_option(fd, level, name, ttl as libc::c_int)
}

/// `IPV6_MINHOPCOUNT` (linux/in6.h); not exported by libc on every target.
const IPV6_MINHOPCOUNT: libc::c_int = 73;

/// GTSM (RFC 5082): the kernel drops the socket's incoming packets whose TTL (IPv4) or hop
/// limit (IPv6) is below `min`. An IPv4 peer on a dual-stack socket takes the IPv4 option.
pub fn set_min_ttl(fd: RawFd, ipv4: bool, min: u32) -> io::Result<()> {
    let (level, name) = if ipv4 { (libc::IPPROTO_IP, libc::IP_MINTTL) } else { (libc::IPPROTO_IPV6, IPV6_MINHOPCOUNT) };
    set_int_option(fd, level, name, min as libc::c_int)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn struct_matches_the_kernel_abi() {
        // 128 (sockaddr_storage) + 1 + 1 + 2 + 4 + 80
        assert_eq!(std::mem::size_of::<TcpMd5Sig>(), 216);
    }

    #[test]
    fn keys_are_accepted_on_a_tcp_socket_and_overlong_ones_rejected() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let fd = listener.as_raw_fd();
        set_tcp_md5_key(fd, "127.0.0.2".parse().unwrap(), b"secret").unwrap();
        assert!(set_tcp_md5_key(fd, "127.0.0.2".parse().unwrap(), &[b'x'; 81]).is_err());
    }
}
