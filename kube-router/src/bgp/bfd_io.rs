//! The BFD task: UDP sockets and timers around the pure [`super::bfd`] sessions, one per BGP
//! peer with BFD enabled (RFC 5881 single hop: destination port 3784, one source port in
//! 49152-65535 for every session, TTL 255 sent and required on receipt, so only a directly
//! connected peer can speak to us).
use std::{
    collections::HashMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    os::fd::AsRawFd,
    time::Duration,
};

use tokio::{
    net::UdpSocket,
    sync::mpsc,
    time::{sleep_until, Instant},
};
use tracing::{debug, info, warn};

use super::{
    bfd::{BfdConfig, BfdOutput, BfdSession, BfdState, ControlPacket},
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

fn receiver(address: IpAddr, port: u16) -> std::io::Result<UdpSocket> {
    let socket = bind(SocketAddr::new(address, port))?;
    // GTSM (RFC 5881 §5): only packets sent with TTL 255, i.e. from the link itself.
    let minimum = if address.is_ipv4() {
        set_int_option(socket.as_raw_fd(), libc::IPPROTO_IP, libc::IP_MINTTL, 255)
    } else {
        set_int_option(socket.as_raw_fd(), libc::IPPROTO_IPV6, libc::IPV6_MINHOPCOUNT, 255)
    };
    if let Err(e) = minimum {
        warn!(error = %e, "cannot require TTL 255 on received BFD packets");
    }
    UdpSocket::from_std(socket)
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

async fn recv(socket: &Option<UdpSocket>, buf: &mut [u8]) -> std::io::Result<(usize, SocketAddr)> {
    match socket {
        Some(s) => s.recv_from(buf).await,
        None => std::future::pending().await,
    }
}

/// Runs until `peers` closes. Every list received replaces the set of sessions (a peer whose
/// configuration is unchanged keeps its session).
pub async fn run_bfd(
    port: u16,
    mut peers: mpsc::UnboundedReceiver<Vec<BfdPeer>>,
    events: impl Fn(BfdEvent) + Send + 'static,
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
            r = recv(&v4_rx, &mut buf4) => r.ok().map(|(n, from)| (buf4[..n].to_vec(), from)),
            r = recv(&v6_rx, &mut buf6) => r.ok().map(|(n, from)| (buf6[..n].to_vec(), from)),
            _ = sleep_until(wake) => None,
        };
        if let Some((bytes, from)) = received {
            let from_ip = match from.ip() {
                IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(IpAddr::V6(v6)),
                v4 => v4,
            };
            match ControlPacket::decode(&bytes) {
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
