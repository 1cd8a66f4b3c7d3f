//! The BFD task: UDP sockets and timers around the pure [`super::bfd`] sessions, one per BGP
//! peer with BFD enabled (RFC 5881 single hop: destination port 3784, one source port in
//! 49152-65535 for every session, TTL 255 sent and required on receipt, so only a directly
//! connected peer can speak to us). The TTL is checked here, from the IP_TTL / IPV6_HOPLIMIT
//! the kernel reports with each datagram, not with IP_MINTTL: a kernel drop would be
//! invisible, and a peer configured for multihop by mistake should show in a counter.
use std::{
    collections::HashMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    os::fd::{AsRawFd, RawFd},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use tokio::{
    io::Interest,
    net::UdpSocket,
    sync::mpsc,
    time::{sleep_until, Instant},
};
use tracing::{debug, info, warn};

use super::{
    bfd::{BfdConfig, BfdOutput, BfdSession, BfdState, ControlPacket, PacketError},
    md5::{set_int_option, set_ttl},
};

/// A peer BFD watches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BfdPeer {
    pub address: IpAddr,
    pub config: BfdConfig,
}

/// What the BFD task tells the speaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BfdEvent {
    Up(IpAddr),
    /// The session was Up and is not any more.
    Down(IpAddr),
}

struct Entry {
    session: BfdSession,
    next_tx: Instant,
    detect_at: Option<Instant>,
}

/// xorshift jitter: each transmission 75-100 % of the interval (RFC 5880 §6.8.7).
struct Jitter(u32);

impl Jitter {
    fn apply(&mut self, interval: Duration) -> Duration {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 17;
        self.0 ^= self.0 << 5;
        interval.mul_f64(0.75 + f64::from(self.0 % 1000) / 4000.0)
    }
}

/// A UDP socket bound to `addr`; an IPv6 one only for IPv6 (the IPv4 socket has the port).
fn bind(addr: SocketAddr) -> std::io::Result<std::net::UdpSocket> {
    use std::os::fd::FromRawFd;
    let family = if addr.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 };
    // SAFETY: plain socket(2); the fd is owned by the UdpSocket below (or closed on error).
    let fd = unsafe { libc::socket(family, libc::SOCK_DGRAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd was just created and is not owned elsewhere.
    let socket = unsafe { std::net::UdpSocket::from_raw_fd(fd) };
    if addr.is_ipv6() {
        set_int_option(fd, libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, 1)?;
    }
    let (storage, len) = super::md5::sockaddr(addr);
    // SAFETY: storage holds a valid sockaddr of `len` bytes for the socket's family.
    if unsafe { libc::bind(fd, std::ptr::addr_of!(storage).cast(), len) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(socket)
}

/// The receiving socket; each datagram comes with its TTL (hop limit), which RFC 5881 §5
/// requires to be 255. Without that report no packet would be accepted, so it is an error.
fn receiver(address: IpAddr, port: u16) -> std::io::Result<UdpSocket> {
    let socket = bind(SocketAddr::new(address, port))?;
    if address.is_ipv4() {
        set_int_option(socket.as_raw_fd(), libc::IPPROTO_IP, libc::IP_RECVTTL, 1)?;
    } else {
        set_int_option(socket.as_raw_fd(), libc::IPPROTO_IPV6, libc::IPV6_RECVHOPLIMIT, 1)?;
    }
    UdpSocket::from_std(socket)
}

/// One datagram, who sent it, and the IP TTL (hop limit) it arrived with, if reported.
fn recv_with_ttl(fd: RawFd, buf: &mut [u8]) -> std::io::Result<(usize, SocketAddr, Option<u8>)> {
    // SAFETY: all-zero sockaddr_storage / msghdr are valid values.
    let mut name: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // u64s: cmsg headers need their alignment; 64 bytes hold one int cmsg many times over.
    let mut control = [0u64; 8];
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_name = std::ptr::addr_of_mut!(name).cast();
    msg.msg_namelen = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control) as _;
    // SAFETY: msg points at live buffers of the sizes given.
    let n = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_DONTWAIT) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut ttl = None;
    // SAFETY: the CMSG_* walk stays within msg_control as the kernel filled it.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            let (level, kind) = ((*cmsg).cmsg_level, (*cmsg).cmsg_type);
            if (level, kind) == (libc::IPPROTO_IP, libc::IP_TTL)
                || (level, kind) == (libc::IPPROTO_IPV6, libc::IPV6_HOPLIMIT)
            {
                let value = libc::CMSG_DATA(cmsg).cast::<libc::c_int>().read_unaligned();
                ttl = u8::try_from(value).ok();
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    let from = match i32::from(name.ss_family) {
        libc::AF_INET => {
            // SAFETY: the kernel wrote a sockaddr_in.
            let sin = unsafe { *std::ptr::addr_of!(name).cast::<libc::sockaddr_in>() };
            SocketAddr::new(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)).into(), u16::from_be(sin.sin_port))
        }
        libc::AF_INET6 => {
            // SAFETY: the kernel wrote a sockaddr_in6.
            let sin6 = unsafe { *std::ptr::addr_of!(name).cast::<libc::sockaddr_in6>() };
            SocketAddr::new(Ipv6Addr::from(sin6.sin6_addr.s6_addr).into(), u16::from_be(sin6.sin6_port))
        }
        other => return Err(std::io::Error::other(format!("datagram from address family {other}"))),
    };
    Ok((n as usize, from, ttl))
}

fn sender(ipv4: bool) -> std::io::Result<UdpSocket> {
    let any: IpAddr = if ipv4 { Ipv4Addr::UNSPECIFIED.into() } else { Ipv6Addr::UNSPECIFIED.into() };
    let mut last = None;
    for port in 49152..=65535u16 {
        match bind(SocketAddr::new(any, port)) {
            Ok(socket) => {
                set_ttl(socket.as_raw_fd(), ipv4, 255)?;
                return UdpSocket::from_std(socket);
            }
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::other("no free source port")))
}

async fn recv(socket: &Option<UdpSocket>, buf: &mut [u8]) -> std::io::Result<(usize, SocketAddr, Option<u8>)> {
    match socket {
        Some(s) => s.async_io(Interest::READABLE, || recv_with_ttl(s.as_raw_fd(), buf)).await,
        None => std::future::pending().await,
    }
}

/// Runs until `peers` closes. Every list received replaces the set of sessions (a peer whose
/// configuration is unchanged keeps its session). Packets refused for their TTL are counted
/// in `ttl_dropped`.
pub async fn run_bfd(
    port: u16,
    mut peers: mpsc::UnboundedReceiver<Vec<BfdPeer>>,
    events: impl Fn(BfdEvent) + Send + 'static,
    ttl_dropped: Arc<AtomicU64>,
) {
    let v4_rx = receiver(Ipv4Addr::UNSPECIFIED.into(), port)
        .map_err(|e| warn!(port, error = %e, "cannot listen for IPv4 BFD packets"))
        .ok();
    let v6_rx = receiver(Ipv6Addr::UNSPECIFIED.into(), port)
        .map_err(|e| warn!(port, error = %e, "cannot listen for IPv6 BFD packets"))
        .ok();
    let v4_tx = sender(true).map_err(|e| warn!(error = %e, "cannot send IPv4 BFD packets")).ok();
    let v6_tx = sender(false).map_err(|e| warn!(error = %e, "cannot send IPv6 BFD packets")).ok();
    let mut sessions: HashMap<IpAddr, Entry> = HashMap::new();
    let mut configs: HashMap<IpAddr, BfdConfig> = HashMap::new();
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.subsec_nanos());
    let mut jitter = Jitter(seed | 1);
    let mut next_discriminator = seed.rotate_left(13) | 1;
    let (mut buf4, mut buf6) = ([0u8; 128], [0u8; 128]);
    let send = |tx: &Option<UdpSocket>, tx6: &Option<UdpSocket>, peer: IpAddr, packet: &ControlPacket| {
        let socket = if peer.is_ipv4() { tx } else { tx6 };
        if let Some(socket) = socket {
            if let Err(e) = socket.try_send_to(&packet.encode(), SocketAddr::new(peer, port)) {
                debug!(%peer, error = %e, "BFD packet not sent");
            }
        }
    };
    loop {
        let now = Instant::now();
        let wake = sessions
            .values()
            .flat_map(|e| [Some(e.next_tx), e.detect_at])
            .flatten()
            .min()
            .unwrap_or(now + Duration::from_secs(3600));
        let received = tokio::select! {
            list = peers.recv() => {
                let Some(list) = list else { return };
                let wanted: HashMap<IpAddr, BfdConfig> = list.into_iter().map(|p| (p.address, p.config)).collect();
                sessions.retain(|peer, _| wanted.get(peer) == configs.get(peer));
                for (peer, config) in &wanted {
                    sessions.entry(*peer).or_insert_with(|| {
                        next_discriminator = next_discriminator.wrapping_add(0x9e37_79b9) | 1;
                        info!(%peer, ?config, "BFD session configured");
                        Entry { session: BfdSession::new(next_discriminator, *config), next_tx: Instant::now(), detect_at: None }
                    });
                }
                configs = wanted;
                None
            }
            r = recv(&v4_rx, &mut buf4) => r.ok().map(|(n, from, ttl)| (buf4[..n].to_vec(), from, ttl)),
            r = recv(&v6_rx, &mut buf6) => r.ok().map(|(n, from, ttl)| (buf6[..n].to_vec(), from, ttl)),
            _ = sleep_until(wake) => None,
        };
        if let Some((bytes, from, ttl)) = received {
            let from_ip = match from.ip() {
                IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(IpAddr::V6(v6)),
                v4 => v4,
            };
            match ControlPacket::decode_single_hop(&bytes, ttl) {
                Ok(packet) => {
                    // Ours by discriminator once the peer knows it, by address before.
                    let peer = if packet.your_discriminator != 0 {
                        sessions
                            .iter()
                            .find(|(_, e)| e.session.local_discriminator() == packet.your_discriminator)
                            .map(|(p, _)| *p)
                    } else {
                        sessions.contains_key(&from_ip).then_some(from_ip)
                    };
                    if let Some(entry) = peer.and_then(|p| sessions.get_mut(&p)) {
                        let outputs = entry.session.receive(&packet);
                        entry.detect_at = entry.session.detection_time().map(|d| Instant::now() + d);
                        handle(peer.unwrap_or(from_ip), outputs, entry, &events, |p| send(&v4_tx, &v6_tx, from_ip, p));
                    }
                }
                Err(e @ PacketError::TtlNot255(_)) => {
                    if ttl_dropped.fetch_add(1, Ordering::Relaxed) == 0 {
                        warn!(peer = %from_ip, error = %e, "BFD packet dropped: not from a directly connected neighbour (logged once; counted in kube_router_bfd_packets_dropped_total)");
                    }
                }
                Err(e) => debug!(peer = %from_ip, error = %e, "invalid BFD packet dropped"),
            }
        }
        let now = Instant::now();
        for (peer, entry) in sessions.iter_mut() {
            if entry.detect_at.is_some_and(|at| at <= now) {
                entry.detect_at = None;
                let outputs = entry.session.detection_expired();
                handle(*peer, outputs, entry, &events, |p| send(&v4_tx, &v6_tx, *peer, p));
            }
            if entry.next_tx <= now {
                send(&v4_tx, &v6_tx, *peer, &entry.session.packet());
                entry.next_tx = now + jitter.apply(entry.session.tx_interval());
            }
        }
    }
}

fn handle(
    peer: IpAddr,
    outputs: Vec<BfdOutput>,
    entry: &mut Entry,
    events: &impl Fn(BfdEvent),
    send: impl Fn(&ControlPacket),
) {
    for output in outputs {
        match output {
            BfdOutput::SendNow(packet) => send(&packet),
            BfdOutput::StateChanged { from, to, diag } => {
                info!(%peer, ?from, ?to, ?diag, "BFD session state");
                if to == BfdState::Up {
                    events(BfdEvent::Up(peer));
                } else if from == BfdState::Up {
                    events(BfdEvent::Down(peer));
                }
                // A new rate takes effect at once.
                entry.next_tx = Instant::now();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel reports each datagram's TTL: a packet sent with 254 is seen as 254 (and the
    /// single-hop decode refuses it), one sent with 255 as 255.
    #[tokio::test]
    async fn received_packets_carry_their_ttl() {
        let rx = receiver(Ipv4Addr::LOCALHOST.into(), 0).unwrap();
        let to = rx.local_addr().unwrap();
        let tx = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let packet = BfdSession::new(7, BfdConfig::default()).packet().encode();
        let socket = Some(rx);
        let mut buf = [0u8; 128];
        for sent in [254u32, 255] {
            set_ttl(tx.as_raw_fd(), true, sent).unwrap();
            tx.send_to(&packet, to).unwrap();
            let (n, from, ttl) = recv(&socket, &mut buf).await.unwrap();
            assert_eq!((n, from, ttl), (packet.len(), tx.local_addr().unwrap(), Some(sent as u8)));
            let decoded = ControlPacket::decode_single_hop(&buf[..n], ttl);
            assert_eq!(decoded.is_ok(), sent == 255, "{decoded:?}");
        }
    }
}
