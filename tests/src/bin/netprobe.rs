//! A tiny network tool for the end-to-end tests, run inside network namespaces.
//!
//!   krt-netprobe serve NAME PORT            TCP and UDP server on PORT, IPv4 and IPv6, answering every line /
//!                                           datagram with NAME; "who" gets "NAME PEER-ADDRESS", a datagram
//!                                           "big N" gets N bytes starting with NAME, a TCP line "sink N" followed
//!                                           by N bytes gets "NAME N"
//!   krt-netprobe request tcp|udp ADDR COUNT COUNT new connections (or datagrams from COUNT distinct source ports);
//!                                           prints one reply (or ERR ...) per line
//!   krt-netprobe hold ADDR INTERVAL_MS [SRCPORT]  one TCP connection (from SRCPORT if given), a request
//!                                           every INTERVAL_MS, prints each reply, forever
//!   krt-netprobe probe ADDR INTERVAL_MS     a new TCP connection every INTERVAL_MS, prints each reply (or ERR ...), forever
//!   krt-netprobe http ADDR PATH             one HTTP/1.0 GET; prints the status code, then the body
//!   krt-netprobe matrix TIMEOUT_MS PROTO:ADDR...  one attempt per target, all at once; prints
//!                                           "PROTO:ADDR OK NAME" or "PROTO:ADDR ERR ..." per target, in order
//!   krt-netprobe ask tcp|udp ADDR MESSAGE    one exchange sending MESSAGE ("who", "big 4000"); prints the reply
//!   krt-netprobe timed tcp|udp ADDR         one exchange; prints "OK REPLY MS" or "ERR ... MS" (milliseconds taken)
//!   krt-netprobe tcp-from SRCPORT ADDR MESSAGE  one TCP exchange from a fixed source port (SO_REUSEADDR, as
//!                                           a kernel-chosen port may be reused); prints the reply (or ERR ...)
//!   krt-netprobe udp-fixed SRCPORT ADDR COUNT INTERVAL_MS  COUNT datagrams from one fixed source port; one
//!                                           reply (or ERR ...) per line
//!   krt-netprobe bulk ADDR BYTES            one TCP connection carrying BYTES to the server; prints its reply
//!   krt-netprobe feature IFACE tx-checksum on|off
//!                                           sets an interface offload (the ethtool ioctl: no ethtool binary here)
//!   krt-netprobe xdp-pass PIN               loads a two-instruction XDP program returning XDP_PASS and pins it
//!                                           at PIN (for `ip link set dev X xdpdrv pinned PIN`)
//!   krt-netprobe tc-noop IFACE ingress|egress PIN  attaches a TC program that does nothing (TCX_NEXT)
//!                                           through a TCX link, pinned at PIN (what the hook alone costs)
//!   krt-netprobe rate tcp|udp ADDR SECONDS [PAUSE_MS [FIRST_PORT COUNT]]  new flows back to back (a connection or socket
//!                                           per exchange, PAUSE_MS apart) for SECONDS; prints "OK FAILED
//!                                           PER-SECOND", then a line per failure (when, how long it took,
//!                                           the error and the TCP client port). A connect() that finds no
//!                                           free local port (EADDRNOTAVAIL) is no exchange: retried 1 ms later.
//!                                           FIRST_PORT COUNT: TCP from those ports in turn (SO_REUSEADDR)
//!   krt-netprobe peer tcp|udp|udp-connected ADDR COUNT
//!                                           COUNT exchanges; prints "OK NAME PEER MICROS" or "ERR ... MICROS"
//!                                           per line, PEER being what the socket API reports: getpeername
//!                                           (tcp), the recvfrom source (udp), both, which must agree
//!                                           (udp-connected: connect, send, recvfrom)
//!   krt-netprobe raw-ip PROTO DST COUNT     COUNT IPv4 packets of IP protocol PROTO (GRE, IPIP, 253 ...) to DST
//!                                           from a raw socket, each carrying the marker "krt-hostile"
//!   krt-netprobe raw-frame IFACE DST_MAC TAGS ETHERTYPE SRC DST PROTO COUNT
//!                                           COUNT Ethernet frames from a packet socket on IFACE: TAGS "-" or
//!                                           comma-separated tag ethertypes (88a8,8100: 802.1ad outside 802.1Q,
//!                                           VLAN id 0), then ETHERTYPE (hex); for 0800 an IPv4 header SRC -> DST
//!                                           of protocol PROTO, then the marker
//!   krt-netprobe count-ip PROTO SECONDS     prints "ready", then after SECONDS "count N": the IPv4 packets of
//!                                           protocol PROTO carrying the marker that a raw socket received
//!   krt-netprobe count-frames IFACE ETHERTYPE SECONDS
//!                                           the same for frames of ETHERTYPE (hex) a packet socket on IFACE got
//!   krt-netprobe spoof tcp|udp SRC DST PORT COUNT  COUNT TCP SYNs or UDP datagrams from source address SRC
//!                                           (any, through a raw socket: what CAP_NET_RAW allows a pod)
//!   krt-netprobe sniff tcp|udp PORT         prints the source address of every packet to PORT (raw
//!                                           sockets, IPv4 and IPv6, before any socket lookup), forever
//!   krt-netprobe synflood ADDR SRC_PREFIX COUNT SECONDS
//!                                           COUNT raw TCP SYNs to ADDR (IPv4) from random addresses
//!                                           SRC_PREFIX.3-254 and random ports, stopping after SECONDS;
//!                                           prints "SENT MILLIS"
use std::{
    io::{BufRead, BufReader, Read, Write},
    net::{SocketAddr, TcpListener, TcpStream, UdpSocket},
    time::{Duration, Instant},
};

const TIMEOUT: Duration = Duration::from_secs(2);
/// connect()'s EADDRNOTAVAIL as io::Error displays it.
const NO_LOCAL_PORT: &str = "(os error 99)";

/// The peer as a client would write it (an IPv4 client of a dual-stack socket is `::ffff:a.b.c.d`).
fn peer_ip(peer: SocketAddr) -> String {
    match peer.ip() {
        std::net::IpAddr::V6(v6) => v6.to_ipv4_mapped().map(|v4| v4.to_string()).unwrap_or_else(|| v6.to_string()),
        v4 => v4.to_string(),
    }
}

fn answer(name: &str, request: &str, peer: SocketAddr) -> Vec<u8> {
    let request = request.trim();
    if request == "who" {
        return format!("{name} {}\n", peer_ip(peer)).into_bytes();
    }
    if let Some(size) = request.strip_prefix("big ").and_then(|n| n.parse::<usize>().ok()) {
        let mut reply = format!("{name} ").into_bytes();
        reply.resize(size.max(reply.len() + 1), b'.');
        if let Some(last) = reply.last_mut() {
            *last = b'\n';
        }
        return reply;
    }
    format!("{name}\n").into_bytes()
}

fn serve(name: String, port: u16) -> ! {
    // [::] with IPV6_V6ONLY off (Linux's default) serves both families.
    let udp = UdpSocket::bind(("::", port)).expect("bind udp");
    let udp_name = name.clone();
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 65536];
        loop {
            if let Ok((n, peer)) = udp.recv_from(&mut buf) {
                let request = String::from_utf8_lossy(&buf[..n]).into_owned();
                let _ = udp.send_to(&answer(&udp_name, &request, peer), peer);
            }
        }
    });
    let listener = TcpListener::bind(("::", port)).expect("bind tcp");
    println!("listening {port}");
    for stream in listener.incoming().flatten() {
        let name = name.clone();
        std::thread::spawn(move || {
            let Ok(peer) = stream.peer_addr() else { return };
            let Ok(mut writer) = stream.try_clone() else { return };
            let mut reader = BufReader::new(stream);
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).map(|n| n == 0).unwrap_or(true) {
                    break;
                }
                let reply = match line.trim().strip_prefix("sink ").and_then(|n| n.parse::<u64>().ok()) {
                    Some(size) => {
                        let got = std::io::copy(&mut (&mut reader).take(size), &mut std::io::sink()).unwrap_or(0);
                        format!("{name} {got}\n").into_bytes()
                    }
                    None => answer(&name, &line, peer),
                };
                if writer.write_all(&reply).is_err() {
                    break;
                }
            }
        });
    }
    std::process::exit(1)
}

fn tcp_once(addr: SocketAddr) -> Result<String, String> {
    tcp_ask(addr, "hello", TIMEOUT)
}

fn tcp_ask(addr: SocketAddr, message: &str, timeout: Duration) -> Result<String, String> {
    let stream = TcpStream::connect_timeout(&addr, timeout).map_err(|e| format!("connect: {e}"))?;
    tcp_exchange(&stream, message, timeout)
}

/// One line sent on `stream` and the line answered, within `timeout`.
fn tcp_exchange(mut stream: &TcpStream, message: &str, timeout: Duration) -> Result<String, String> {
    stream.set_read_timeout(Some(timeout)).map_err(|e| e.to_string())?;
    stream.write_all(format!("{message}\n").as_bytes()).map_err(|e| format!("write: {e}"))?;
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line).map_err(|e| format!("read: {e}"))?;
    if line.is_empty() {
        return Err("closed".into());
    }
    Ok(line.trim().to_string())
}

/// One TCP connection (or UDP exchange) to "tcp:ADDR" / "udp:ADDR" within `timeout`.
fn probe_once(target: &str, timeout: Duration) -> Result<String, String> {
    let (proto, addr) = target.split_once(':').ok_or("target is PROTO:ADDR")?;
    let addr: SocketAddr = addr.parse().map_err(|e| format!("{addr}: {e}"))?;
    match proto {
        "tcp" => tcp_ask(addr, "hello", timeout),
        "udp" => udp_ask(&udp_socket(addr, 0)?, "hello", timeout),
        other => Err(format!("unknown protocol {other}")),
    }
}

/// A UDP socket connected to `addr`, as resolvers use: it only accepts replies from `addr` and
/// reports ICMP errors (a refusal is "Connection refused").
fn udp_socket(addr: SocketAddr, source_port: u16) -> Result<UdpSocket, String> {
    let any = if addr.is_ipv4() { "0.0.0.0" } else { "::" };
    let socket = UdpSocket::bind((any, source_port)).map_err(|e| e.to_string())?;
    socket.connect(addr).map_err(|e| format!("connect: {e}"))?;
    Ok(socket)
}

/// One datagram and its answer, read whole (up to 64 KiB); a big answer is summarised as its
/// sender and size.
fn udp_ask(socket: &UdpSocket, message: &str, timeout: Duration) -> Result<String, String> {
    socket.set_read_timeout(Some(timeout)).map_err(|e| e.to_string())?;
    socket.send(format!("{message}\n").as_bytes()).map_err(|e| format!("send: {e}"))?;
    let mut buf = vec![0u8; 65536];
    let n = socket.recv(&mut buf).map_err(|e| format!("recv: {e}"))?;
    let reply = String::from_utf8_lossy(&buf[..n]);
    if n > 200 {
        return Ok(format!("{} {n} bytes", reply.split_whitespace().next().unwrap_or("")));
    }
    Ok(reply.trim().to_string())
}

/// A TCP connection from `source_port` (SO_REUSEADDR: the port may be in TIME_WAIT towards
/// another peer), or from a port the kernel picks.
fn connect_from(source_port: Option<u16>, addr: SocketAddr) -> Result<TcpStream, String> {
    use socket2::{Domain, Socket, Type};
    let Some(source_port) = source_port else {
        return TcpStream::connect_timeout(&addr, TIMEOUT).map_err(|e| format!("connect: {e}"));
    };
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None).map_err(|e| e.to_string())?;
    socket.set_reuse_address(true).map_err(|e| e.to_string())?;
    let any: SocketAddr =
        if addr.is_ipv4() { ([0, 0, 0, 0], source_port).into() } else { ([0u16; 8], source_port).into() };
    socket.bind(&any.into()).map_err(|e| format!("bind: {e}"))?;
    socket.connect_timeout(&addr.into(), TIMEOUT).map_err(|e| format!("connect: {e}"))?;
    Ok(socket.into())
}

/// One TCP exchange from a port the kernel picks; a failure names that port.
fn tcp_ask_noting_port(addr: SocketAddr) -> Result<String, String> {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None).map_err(|e| e.to_string())?;
    let port = |s: &Socket| s.local_addr().ok().and_then(|a| a.as_socket()).map_or(0, |a| a.port());
    if let Err(e) = socket.connect_timeout(&addr.into(), TIMEOUT) {
        return Err(format!("connect from port {}: {e}", port(&socket)));
    }
    let from = port(&socket);
    tcp_exchange(&socket.into(), "hello", TIMEOUT).map_err(|e| format!("from port {from}: {e}"))
}

/// One TCP exchange from `source_port`.
fn tcp_ask_from(source_port: u16, addr: SocketAddr, message: &str) -> Result<String, String> {
    tcp_exchange(&connect_from(Some(source_port), addr)?, message, TIMEOUT)
}

fn ask(proto: &str, addr: SocketAddr, message: &str) -> Result<String, String> {
    match proto {
        "udp" => udp_ask(&udp_socket(addr, 0)?, message, TIMEOUT),
        _ => tcp_ask(addr, message, TIMEOUT),
    }
}

fn bulk(addr: SocketAddr, bytes: u64) -> Result<String, String> {
    let timeout = Duration::from_secs(10);
    let mut stream = TcpStream::connect_timeout(&addr, TIMEOUT).map_err(|e| format!("connect: {e}"))?;
    stream.set_read_timeout(Some(timeout)).map_err(|e| e.to_string())?;
    stream.set_write_timeout(Some(timeout)).map_err(|e| e.to_string())?;
    stream.write_all(format!("sink {bytes}\n").as_bytes()).map_err(|e| format!("write: {e}"))?;
    let chunk = vec![b'x'; 64 * 1024];
    let mut left = bytes;
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        stream.write_all(&chunk[..n]).map_err(|e| format!("write after {} bytes: {e}", bytes - left))?;
        left -= n as u64;
    }
    let mut line = String::new();
    BufReader::new(&stream).read_line(&mut line).map_err(|e| format!("read: {e}"))?;
    Ok(line.trim().to_string())
}

/// One exchange; the peer as the socket API shows it to the application.
fn peer_exchange(mode: &str, addr: SocketAddr) -> Result<(String, SocketAddr), String> {
    match mode {
        "tcp" => {
            let stream = TcpStream::connect_timeout(&addr, TIMEOUT).map_err(|e| format!("connect: {e}"))?;
            stream.set_read_timeout(Some(TIMEOUT)).map_err(|e| e.to_string())?;
            (&stream).write_all(b"hello\n").map_err(|e| format!("write: {e}"))?;
            let mut line = String::new();
            BufReader::new(&stream).read_line(&mut line).map_err(|e| format!("read: {e}"))?;
            let peer = stream.peer_addr().map_err(|e| format!("getpeername: {e}"))?;
            Ok((line.trim().to_string(), peer))
        }
        "udp" | "udp-connected" => {
            let socket =
                UdpSocket::bind(if addr.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }).map_err(|e| e.to_string())?;
            socket.set_read_timeout(Some(TIMEOUT)).map_err(|e| e.to_string())?;
            if mode == "udp" {
                socket.send_to(b"hello\n", addr).map_err(|e| format!("send: {e}"))?;
            } else {
                socket.connect(addr).map_err(|e| format!("connect: {e}"))?;
                socket.send(b"hello\n").map_err(|e| format!("send: {e}"))?;
            }
            let mut buf = [0u8; 1500];
            let (n, from) = socket.recv_from(&mut buf).map_err(|e| format!("recv: {e}"))?;
            if mode == "udp-connected" {
                let peer = socket.peer_addr().map_err(|e| format!("getpeername: {e}"))?;
                if peer != from {
                    return Err(format!("getpeername {peer} but recvfrom {from}"));
                }
            }
            Ok((String::from_utf8_lossy(&buf[..n]).trim().to_string(), from))
        }
        other => Err(format!("unknown mode {other}")),
    }
}

fn http_get(addr: SocketAddr, path: &str) -> Result<(String, String), String> {
    let mut stream = TcpStream::connect_timeout(&addr, TIMEOUT).map_err(|e| format!("connect: {e}"))?;
    stream.set_read_timeout(Some(TIMEOUT)).map_err(|e| e.to_string())?;
    stream.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes()).map_err(|e| e.to_string())?;
    let mut response = String::new();
    stream.read_to_string(&mut response).map_err(|e| format!("read: {e}"))?;
    let status = response.split_whitespace().nth(1).unwrap_or("?").to_string();
    let body = response.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    Ok((status, body))
}

fn hold(addr: SocketAddr, interval: Duration, source_port: Option<u16>) -> ! {
    let stream = connect_from(source_port, addr).expect("connect");
    stream.set_read_timeout(Some(TIMEOUT)).expect("timeout");
    let mut reader = BufReader::new(stream.try_clone().expect("clone"));
    loop {
        let mut line = String::new();
        let ok = (&stream).write_all(b"ping\n").is_ok() && reader.read_line(&mut line).map(|n| n > 0).unwrap_or(false);
        if ok {
            println!("{}", line.trim());
        } else {
            println!("ERR connection broken");
            std::process::exit(1);
        }
        let _ = std::io::stdout().flush();
        std::thread::sleep(interval);
    }
}

/// Keeps `count` idle TCP connections to `addr` open, reopening each the server closes, once a
/// second; prints `open <n> connects <total>` after every round (a hostile pod's flood).
fn flood(addr: SocketAddr, count: usize) -> ! {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit with a valid pointer to an rlimit we own.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit);
        limit.rlim_cur = limit.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
    }
    let mut streams: Vec<Option<TcpStream>> = (0..count).map(|_| None).collect();
    let mut connects = 0u64;
    loop {
        for slot in &mut streams {
            // Closed by the server: a read returns 0 (or an error) at once.
            let closed = slot.as_ref().is_none_or(|stream| {
                let mut byte = [0u8; 1];
                stream.set_nonblocking(true).is_ok()
                    && !matches!(stream.peek(&mut byte), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
            });
            if closed {
                *slot = TcpStream::connect_timeout(&addr, Duration::from_millis(500)).ok();
                connects += 1;
            }
        }
        let open = streams.iter().filter(|s| s.is_some()).count();
        println!("open {open} connects {connects}");
        let _ = std::io::stdout().flush();
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// `r0 = XDP_PASS; exit`, loaded and pinned at `path`.
fn pin_xdp_pass(path: &str) -> std::io::Result<()> {
    // r0 = XDP_PASS (2); exit. BPF_PROG_TYPE_XDP = 6.
    let program = load_two_instructions(6, 2, 0)?;
    bpf_obj_pin(&program, path)
}

/// A TC program that does nothing (`TCX_NEXT`) attached through a TCX link at `direction`
/// ("ingress" / "egress") of `interface`, the link pinned at `path`: what the hook alone costs a
/// packet, beside what our programs do in it (the `service_datapath` bench).
fn pin_tcx_noop(interface: &str, direction: &str, path: &str) -> std::io::Result<()> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    // BPF_TCX_INGRESS / BPF_TCX_EGRESS in `enum bpf_attach_type`.
    let attach_type: u32 = match direction {
        "ingress" => 46,
        "egress" => 47,
        other => return Err(std::io::Error::other(format!("direction {other}: ingress or egress"))),
    };
    let name = std::ffi::CString::new(interface).map_err(std::io::Error::other)?;
    // SAFETY: a NUL-terminated name.
    let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
    if ifindex == 0 {
        return Err(std::io::Error::last_os_error());
    }
    // r0 = TCX_NEXT (-1); exit. BPF_PROG_TYPE_SCHED_CLS = 3.
    let program = load_two_instructions(3, -1, attach_type)?;
    // BPF_LINK_CREATE (28): prog_fd, target_ifindex, attach_type, flags 0 (last in the chain).
    let mut attr = [0u64; 16];
    attr[0] = program.as_raw_fd() as u64 | u64::from(ifindex) << 32;
    attr[1] = u64::from(attach_type);
    // SAFETY: a valid BPF_LINK_CREATE attribute.
    let link = unsafe { libc::syscall(libc::SYS_bpf, 28, attr.as_mut_ptr(), 128u32) };
    if link < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the new link fd is ours.
    bpf_obj_pin(&unsafe { OwnedFd::from_raw_fd(link as i32) }, path)
}

/// A program of `prog_type` that returns `verdict` (`r0 = verdict; exit`), loaded (BPF_PROG_LOAD)
/// with `expected_attach_type`.
fn load_two_instructions(
    prog_type: u32,
    verdict: i32,
    expected_attach_type: u32,
) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    let [a, b, c, d] = verdict.to_le_bytes();
    let insns: [u64; 2] =
        [u64::from_le_bytes([0xb7, 0, 0, 0, a, b, c, d]), u64::from_le_bytes([0x95, 0, 0, 0, 0, 0, 0, 0])];
    let license = c"GPL";
    // union bpf_attr, BPF_PROG_LOAD: prog_type, insn_cnt, insns, license; expected_attach_type is
    // the u32 at byte 68.
    let mut attr = [0u64; 16];
    attr[0] = u64::from(prog_type) | (insns.len() as u64) << 32;
    attr[1] = insns.as_ptr() as u64;
    attr[2] = license.as_ptr() as u64;
    attr[8] = u64::from(expected_attach_type) << 32;
    // SAFETY: a valid BPF_PROG_LOAD attribute whose pointers outlive the call.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, 5, attr.as_mut_ptr(), 128u32) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the new program fd is ours.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) })
}

/// BPF_OBJ_PIN: `object` (a program or a link) pinned at `path`.
fn bpf_obj_pin(object: &std::os::fd::OwnedFd, path: &str) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let path = std::ffi::CString::new(path).map_err(std::io::Error::other)?;
    // pathname, bpf_fd.
    let mut attr = [0u64; 16];
    attr[0] = path.as_ptr() as u64;
    attr[1] = object.as_raw_fd() as u64;
    // SAFETY: a valid BPF_OBJ_PIN attribute whose pointer outlives the call.
    if unsafe { libc::syscall(libc::SYS_bpf, 6, attr.as_mut_ptr(), 128u32) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// An offload switched through the legacy ethtool ioctl (`ETHTOOL_STXCSUM`).
fn set_feature(interface: &str, feature: &str, on: bool) -> std::io::Result<()> {
    const SIOCETHTOOL: libc::c_ulong = 0x8946;
    let cmd: u32 = match feature {
        "tx-checksum" => 0x17,
        other => return Err(std::io::Error::other(format!("unknown feature {other}"))),
    };
    // struct ethtool_value { cmd, data }.
    let mut value = [cmd, u32::from(on)];
    // SAFETY: an all-zero ifreq is valid; the name fits (checked) and stays NUL-terminated.
    let mut request: libc::ifreq = unsafe { std::mem::zeroed() };
    if interface.len() >= request.ifr_name.len() {
        return Err(std::io::Error::other("interface name too long"));
    }
    for (dst, src) in request.ifr_name.iter_mut().zip(interface.bytes()) {
        *dst = src as libc::c_char;
    }
    request.ifr_ifru.ifru_data = value.as_mut_ptr().cast();
    // SAFETY: a datagram socket for the ioctl, closed below.
    let socket = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM, 0) };
    if socket < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: request names the interface and points at `value`, which outlives the call.
    let rc = unsafe { libc::ioctl(socket, SIOCETHTOOL, &mut request) };
    let error = std::io::Error::last_os_error();
    // SAFETY: closing the socket opened above.
    unsafe { libc::close(socket) };
    if rc < 0 {
        return Err(error);
    }
    Ok(())
}

fn print_result(result: Result<String, String>) {
    match result {
        Ok(reply) => println!("{reply}"),
        Err(e) => println!("ERR {e}"),
    }
    let _ = std::io::stdout().flush();
}

/// What the hostile-traffic modes put in every packet they send and look for in what arrives.
const MARKER: &[u8] = b"krt-hostile";

fn os_error(what: &str) -> std::io::Error {
    let e = std::io::Error::last_os_error();
    std::io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// The one's complement sum of `data` folded to 16 bits (RFC 1071), starting from `sum`.
fn checksum(data: &[u8], mut sum: u32) -> u16 {
    for pair in data.chunks(2) {
        sum += u32::from(u16::from_be_bytes([pair[0], *pair.get(1).unwrap_or(&0)]));
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// A raw IPv4 socket of `proto`: the kernel writes the IP header and resolves the neighbour.
fn raw_ip_socket(proto: i32) -> std::io::Result<i32> {
    // SAFETY: plain socket(2) call.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, proto) };
    if fd < 0 {
        return Err(os_error("socket(AF_INET, SOCK_RAW)"));
    }
    Ok(fd)
}

fn send_raw_ip(proto: i32, dst: std::net::Ipv4Addr, count: usize) -> std::io::Result<()> {
    let fd = raw_ip_socket(proto)?;
    // SAFETY: an all-zero sockaddr_in is valid; the fields set below make it the destination.
    let mut to: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    to.sin_family = libc::AF_INET as u16;
    to.sin_addr.s_addr = u32::from_ne_bytes(dst.octets());
    send_paced(fd, MARKER, &to, count, "sendto")
}

/// Sends `payload` `count` times to `to` (a sockaddr_*), 20 ms apart.
fn send_paced<A>(fd: i32, payload: &[u8], to: &A, count: usize, what: &str) -> std::io::Result<()> {
    for _ in 0..count {
        // SAFETY: the buffer and address outlive the call; `A` is the socket's address type.
        let sent = unsafe {
            libc::sendto(fd, payload.as_ptr().cast(), payload.len(), 0, (to as *const A).cast(), size_of::<A>() as u32)
        };
        if sent < 0 {
            return Err(os_error(what));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

fn interface_index(iface: &str) -> std::io::Result<i32> {
    let name = std::ffi::CString::new(iface).expect("interface name");
    // SAFETY: a NUL-terminated name.
    match unsafe { libc::if_nametoindex(name.as_ptr()) } {
        0 => Err(os_error(&format!("no interface {iface}"))),
        index => Ok(index as i32),
    }
}

fn mac(text: &str) -> [u8; 6] {
    let bytes: Vec<u8> = text.trim().split(':').map(|b| u8::from_str_radix(b, 16).expect("MAC")).collect();
    bytes.try_into().expect("six MAC bytes")
}

/// `iface`'s MAC address (SIOCGIFHWADDR: /sys/class/net shows the namespace sysfs was mounted
/// in, not ours).
fn hardware_address(iface: &str) -> std::io::Result<[u8; 6]> {
    // SAFETY: plain socket(2) call.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM, 0) };
    if fd < 0 {
        return Err(os_error("socket"));
    }
    // SAFETY: an all-zero ifreq is valid; the name is copied in below.
    let mut request: libc::ifreq = unsafe { std::mem::zeroed() };
    for (to, from) in request.ifr_name.iter_mut().zip(iface.bytes().take(libc::IFNAMSIZ - 1)) {
        *to = from as libc::c_char;
    }
    // SAFETY: the request outlives the call.
    let result = unsafe { libc::ioctl(fd, libc::SIOCGIFHWADDR, &mut request) };
    // SAFETY: closing the descriptor opened above.
    unsafe { libc::close(fd) };
    if result < 0 {
        return Err(os_error("SIOCGIFHWADDR"));
    }
    // SAFETY: SIOCGIFHWADDR filled in the hardware address member.
    let data = unsafe { request.ifr_ifru.ifru_hwaddr.sa_data };
    Ok(std::array::from_fn(|i| data[i] as u8))
}

/// A packet socket on `iface` for frames of `ether_type` (host order), bound to it.
fn packet_socket(iface: &str, ether_type: u16) -> std::io::Result<(i32, libc::sockaddr_ll)> {
    // SAFETY: plain socket(2) call.
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, i32::from(ether_type.to_be())) };
    if fd < 0 {
        return Err(os_error("socket(AF_PACKET)"));
    }
    // SAFETY: an all-zero sockaddr_ll is valid; the fields set below name the interface.
    let mut at: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    at.sll_family = libc::AF_PACKET as u16;
    at.sll_protocol = ether_type.to_be();
    at.sll_ifindex = interface_index(iface)?;
    at.sll_halen = 6;
    // SAFETY: the address outlives the call.
    if unsafe { libc::bind(fd, (&at as *const libc::sockaddr_ll).cast(), size_of::<libc::sockaddr_ll>() as u32) } < 0 {
        return Err(os_error("bind(AF_PACKET)"));
    }
    Ok((fd, at))
}

/// `raw-frame`: see the usage.
fn send_raw_frames(args: &[String]) -> std::io::Result<()> {
    let (iface, dst_mac, tags, ether_type) = (&args[0], mac(&args[1]), &args[2], &args[3]);
    let ether_type = u16::from_str_radix(ether_type, 16).expect("ethertype (hex)");
    let src_mac = hardware_address(iface)?;
    let mut frame = dst_mac.to_vec();
    frame.extend_from_slice(&src_mac);
    for tag in tags.split(',').filter(|t| *t != "-") {
        frame.extend_from_slice(&u16::from_str_radix(tag, 16).expect("tag ethertype (hex)").to_be_bytes());
        frame.extend_from_slice(&[0, 0]); // priority 0, VLAN id 0
    }
    frame.extend_from_slice(&ether_type.to_be_bytes());
    if ether_type == 0x0800 {
        let src: std::net::Ipv4Addr = args[4].parse().expect("source address");
        let dst: std::net::Ipv4Addr = args[5].parse().expect("destination address");
        let total = (20 + MARKER.len()) as u16;
        let mut ip = vec![0x45, 0, 0, 0, 0, 1, 0x40, 0, 64, args[6].parse().expect("protocol"), 0, 0];
        ip[2..4].copy_from_slice(&total.to_be_bytes());
        ip.extend_from_slice(&src.octets());
        ip.extend_from_slice(&dst.octets());
        let sum = checksum(&ip, 0);
        ip[10..12].copy_from_slice(&sum.to_be_bytes());
        frame.extend(ip);
    }
    frame.extend_from_slice(MARKER);
    let (fd, at) = packet_socket(iface, ether_type)?;
    send_paced(fd, &frame, &at, args[7].parse().expect("count"), "sendto(AF_PACKET)")
}

/// Prints "ready", then counts for `seconds` what `fd` receives carrying the marker.
fn count_marked(fd: i32, seconds: f64) -> usize {
    let timeout = libc::timeval { tv_sec: 0, tv_usec: 100_000 };
    // SAFETY: the option value outlives the call.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&timeout as *const libc::timeval).cast(),
            size_of::<libc::timeval>() as u32,
        )
    };
    println!("ready");
    let _ = std::io::stdout().flush();
    let (started, mut count, mut buf) = (Instant::now(), 0, vec![0u8; 65536]);
    while started.elapsed().as_secs_f64() < seconds {
        // SAFETY: the buffer outlives the call.
        let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n > 0 && buf[..n as usize].windows(MARKER.len()).any(|w| w == MARKER) {
            count += 1;
        }
    }
    count
}

/// Raw TCP SYNs from spoofed sources (an attacker's flood): bounded by `count` and `limit`.
/// Returns how many were sent and the milliseconds it took.
fn syn_flood(dst: std::net::SocketAddrV4, src_prefix: [u8; 3], count: u64, limit: Duration) -> (u64, u128) {
    // SAFETY: plain socket syscalls on a descriptor we own.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW) };
    assert!(fd >= 0, "raw socket: {}", std::io::Error::last_os_error());
    let to = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(dst.ip().octets()) },
        sin_zero: [0; 8],
    };
    // xorshift: fast, and reproducible enough for a flood.
    let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ u64::from(std::process::id());
    let mut random = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let started = Instant::now();
    let mut sent = 0;
    while sent < count && started.elapsed() < limit {
        let r = random();
        // Not .1 or .2 (the gateway and the harness's client): a host that exists resets the
        // SYN-ACK sent to it, which closes that flow early and frees its port.
        let src = [src_prefix[0], src_prefix[1], src_prefix[2], 3 + (r % 252) as u8];
        let sport = 1024 + ((r >> 8) % 64_000) as u16;
        let mut packet = [0u8; 40];
        packet[0] = 0x45;
        packet[2..4].copy_from_slice(&40u16.to_be_bytes());
        packet[8] = 64;
        packet[9] = libc::IPPROTO_TCP as u8;
        packet[12..16].copy_from_slice(&src);
        packet[16..20].copy_from_slice(&dst.ip().octets());
        let ip_sum = checksum(&packet[..20], 0);
        packet[10..12].copy_from_slice(&ip_sum.to_be_bytes());
        let tcp = &mut packet[20..];
        tcp[0..2].copy_from_slice(&sport.to_be_bytes());
        tcp[2..4].copy_from_slice(&dst.port().to_be_bytes());
        tcp[4..8].copy_from_slice(&((r >> 24) as u32).to_be_bytes());
        tcp[12] = 5 << 4;
        tcp[13] = 0x02; // SYN
        tcp[14..16].copy_from_slice(&64240u16.to_be_bytes());
        let mut pseudo = Vec::with_capacity(12);
        pseudo.extend_from_slice(&src);
        pseudo.extend_from_slice(&dst.ip().octets());
        pseudo.extend_from_slice(&[0, libc::IPPROTO_TCP as u8, 0, 20]);
        let pseudo_sum = pseudo.chunks(2).map(|p| u32::from(u16::from_be_bytes([p[0], p[1]]))).sum();
        let tcp_sum = checksum(tcp, pseudo_sum);
        tcp[16..18].copy_from_slice(&tcp_sum.to_be_bytes());
        // SAFETY: a valid buffer and address of the sizes given.
        let n = unsafe {
            libc::sendto(
                fd,
                packet.as_ptr().cast(),
                packet.len(),
                0,
                (&to as *const libc::sockaddr_in).cast(),
                size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )
        };
        if n == packet.len() as isize {
            sent += 1;
        }
    }
    // SAFETY: our descriptor, closed once.
    unsafe { libc::close(fd) };
    (sent, started.elapsed().as_millis())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize| {
        args.get(i).cloned().unwrap_or_else(|| panic!("missing argument {i}: see the usage at the top of netprobe.rs"))
    };
    match arg(0).as_str() {
        "serve" => serve(arg(1), arg(2).parse().expect("port")),
        "request" => {
            let addr: SocketAddr = arg(2).parse().expect("addr");
            // Each UDP socket stays bound until the last exchange: the kernel picks a UDP source
            // port at random, and a port freed earlier could come back for a later socket, which
            // would then be the earlier flow again (tests count the new flows).
            let mut held = Vec::new();
            for _ in 0..arg(3).parse::<usize>().expect("count") {
                if arg(1) == "udp" {
                    print_result(udp_socket(addr, 0).and_then(|socket| {
                        let reply = udp_ask(&socket, "hello", TIMEOUT);
                        held.push(socket);
                        reply
                    }));
                } else {
                    print_result(ask(&arg(1), addr, "hello"));
                }
            }
        }
        "probe" => {
            let addr: SocketAddr = arg(1).parse().expect("addr");
            let interval = Duration::from_millis(arg(2).parse().expect("interval"));
            loop {
                let started = std::time::SystemTime::now();
                let result = tcp_once(addr);
                // A failure says when its attempt began (Unix ms), to line it up with the test's events.
                let since_epoch = started.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
                print_result(result.map_err(|e| format!("{e} (attempt at {} ms)", since_epoch.as_millis())));
                std::thread::sleep(interval);
            }
        }
        "http" => match http_get(arg(1).parse().expect("addr"), &arg(2)) {
            Ok((status, body)) => println!("{status}\n{body}"),
            Err(e) => println!("ERR {e}"),
        },
        "matrix" => {
            let timeout = Duration::from_millis(arg(1).parse().expect("timeout"));
            let targets: Vec<String> = std::env::args().skip(3).collect();
            let handles: Vec<_> = targets
                .iter()
                .cloned()
                .map(|target| std::thread::spawn(move || probe_once(&target, timeout)))
                .collect();
            for (target, handle) in targets.iter().zip(handles) {
                match handle.join().expect("probe thread") {
                    Ok(name) => println!("{target} OK {name}"),
                    Err(e) => println!("{target} ERR {e}"),
                }
            }
        }
        "peer" => {
            let addr: SocketAddr = arg(2).parse().expect("addr");
            for _ in 0..arg(3).parse::<usize>().expect("count") {
                let started = std::time::Instant::now();
                let result = peer_exchange(&arg(1), addr);
                let micros = started.elapsed().as_micros();
                match result {
                    Ok((name, peer)) => println!("OK {name} {peer} {micros}"),
                    Err(e) => println!("ERR {e} {micros}"),
                }
            }
        }
        "hold" => hold(
            arg(1).parse().expect("addr"),
            Duration::from_millis(arg(2).parse().expect("interval")),
            args.get(3).map(|port| port.parse().expect("source port")),
        ),
        "flood" => flood(arg(1).parse().expect("addr"), arg(2).parse().expect("connections")),
        "ask" => print_result(ask(&arg(1), arg(2).parse().expect("addr"), &arg(3))),
        "timed" => {
            let started = Instant::now();
            let result = ask(&arg(1), arg(2).parse().expect("addr"), "hello");
            let ms = started.elapsed().as_secs_f64() * 1000.0;
            match result {
                Ok(reply) => println!("OK {reply} {ms:.1}"),
                Err(e) => println!("ERR {e} {ms:.1}"),
            }
        }
        "tcp-from" => {
            print_result(tcp_ask_from(arg(1).parse().expect("source port"), arg(2).parse().expect("addr"), &arg(3)))
        }
        "udp-fixed" => {
            let addr: SocketAddr = arg(2).parse().expect("addr");
            let socket = udp_socket(addr, arg(1).parse().expect("source port")).expect("bind");
            let interval = Duration::from_millis(arg(4).parse().expect("interval"));
            for _ in 0..arg(3).parse::<usize>().expect("count") {
                print_result(udp_ask(&socket, "hello", Duration::from_millis(500)));
                std::thread::sleep(interval);
            }
        }
        "spoof" => spoof(
            &arg(1),
            arg(2).parse().expect("source"),
            arg(3).parse().expect("destination"),
            arg(4).parse().expect("port"),
            arg(5).parse().expect("count"),
        )
        .unwrap_or_else(|e| panic!("spoof: {e}")),
        "sniff" => sniff(&arg(1), arg(2).parse().expect("port")),
        "feature" => {
            let on = match arg(3).as_str() {
                "on" => true,
                "off" => false,
                other => panic!("feature: on or off, not {other}"),
            };
            set_feature(&arg(1), &arg(2), on).unwrap_or_else(|e| panic!("feature {} {}: {e}", arg(1), arg(2)));
        }
        "xdp-pass" => pin_xdp_pass(&arg(1)).unwrap_or_else(|e| panic!("xdp-pass {}: {e}", arg(1))),
        "tc-noop" => pin_tcx_noop(&arg(1), &arg(2), &arg(3)).unwrap_or_else(|e| panic!("tc-noop {}: {e}", arg(1))),
        "bulk" => print_result(bulk(arg(1).parse().expect("addr"), arg(2).parse().expect("bytes"))),
        "rate" => {
            // New flows back to back: a TCP connection (or a UDP socket) per exchange.
            let addr: SocketAddr = arg(2).parse().expect("addr");
            let seconds = Duration::from_secs_f64(arg(3).parse().expect("seconds"));
            let pause = Duration::from_millis(args.get(4).map_or(0, |p| p.parse().expect("pause")));
            // FIRST_PORT COUNT: TCP client ports bound in turn, so each is reused COUNT exchanges later.
            let ports: Option<(u16, u16)> =
                args.get(5).map(|f| (f.parse().expect("first port"), arg(6).parse().expect("port count")));
            let mut turn = 0u16;
            let (started, mut ok, mut failures, mut no_port) = (Instant::now(), 0u64, Vec::new(), 0u64);
            while started.elapsed() < seconds {
                let attempt = Instant::now();
                let result = match arg(1).as_str() {
                    "tcp" => match ports {
                        Some((first, count)) => {
                            turn = (turn + 1) % count;
                            tcp_ask_from(first + turn, addr, "hello")
                                .map_err(|e| format!("from port {}: {e}", first + turn))
                        }
                        None => tcp_ask_noting_port(addr),
                    },
                    _ => udp_socket(addr, 0).and_then(|s| udp_ask(&s, "hello", TIMEOUT)),
                };
                let took = attempt.elapsed();
                std::thread::sleep(pause);
                match result {
                    Ok(_) => ok += 1,
                    // Every local port is still in TIME_WAIT towards ADDR (a narrow
                    // ip_local_port_range): no exchange was tried. Wait for one to free up.
                    Err(e) if e.contains(NO_LOCAL_PORT) => {
                        no_port += 1;
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    Err(e) => failures.push(format!(
                        "ERR at {} ms after {} ms: {e}",
                        started.elapsed().as_millis(),
                        took.as_millis()
                    )),
                }
            }
            println!("{ok} {} {:.1}", failures.len(), ok as f64 / started.elapsed().as_secs_f64());
            // What failed, when and how long it took (a timeout or at once), one line each.
            for failure in failures {
                println!("{failure}");
            }
            if no_port > 0 {
                println!("waited {no_port} times for a free local port");
            }
        }
        "raw-ip" => send_raw_ip(
            arg(1).parse().expect("protocol"),
            arg(2).parse().expect("IPv4 destination"),
            arg(3).parse().expect("count"),
        )
        .unwrap_or_else(|e| panic!("raw-ip: {e}")),
        "raw-frame" => send_raw_frames(&args[1..]).unwrap_or_else(|e| panic!("raw-frame: {e}")),
        "count-ip" => {
            let fd = raw_ip_socket(arg(1).parse().expect("protocol")).unwrap_or_else(|e| panic!("count-ip: {e}"));
            println!("count {}", count_marked(fd, arg(2).parse().expect("seconds")));
        }
        "count-frames" => {
            let ether_type = u16::from_str_radix(&arg(2), 16).expect("ethertype (hex)");
            let (fd, _) = packet_socket(&arg(1), ether_type).unwrap_or_else(|e| panic!("count-frames: {e}"));
            println!("count {}", count_marked(fd, arg(3).parse().expect("seconds")));
        }
        "synflood" => {
            let prefix: Vec<u8> = arg(2).split('.').map(|o| o.parse().expect("prefix octet")).collect();
            let (sent, millis) = syn_flood(
                arg(1).parse().expect("IPv4 addr:port"),
                [prefix[0], prefix[1], prefix[2]],
                arg(3).parse().expect("count"),
                Duration::from_secs_f64(arg(4).parse().expect("seconds")),
            );
            println!("{sent} {millis}");
        }
        other => panic!("unknown command {other}"),
    }
}

fn ip_proto(proto: &str) -> i32 {
    match proto {
        "tcp" => libc::IPPROTO_TCP,
        "udp" => libc::IPPROTO_UDP,
        other => panic!("tcp or udp, not {other}"),
    }
}

fn checksum_add(sum: &mut u32, bytes: &[u8]) {
    for chunk in bytes.chunks(2) {
        *sum += u32::from(u16::from_be_bytes([chunk[0], *chunk.get(1).unwrap_or(&0)]));
    }
}

fn checksum_fold(mut sum: u32) -> u16 {
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// A TCP SYN or a UDP datagram ("spoof") from `src:40000+i` to `dst:port`, checksummed.
fn transport_segment(proto: i32, src: &[u8], dst: &[u8], port: u16, i: u16) -> Vec<u8> {
    let src_port = 40000 + i;
    let mut segment = Vec::new();
    segment.extend(src_port.to_be_bytes());
    segment.extend(port.to_be_bytes());
    if proto == libc::IPPROTO_TCP {
        segment.extend(u32::from(i).to_be_bytes()); // sequence
        segment.extend([0; 4]); // ack
        segment.extend([0x50, 0x02]); // 20-byte header, SYN
        segment.extend(64240u16.to_be_bytes());
        segment.extend([0; 4]); // checksum, urgent
    } else {
        segment.extend((8u16 + 5).to_be_bytes());
        segment.extend([0; 2]);
        segment.extend(b"spoof");
    }
    let mut sum = 0;
    checksum_add(&mut sum, src);
    checksum_add(&mut sum, dst);
    checksum_add(&mut sum, &[0, proto as u8]);
    checksum_add(&mut sum, &(segment.len() as u16).to_be_bytes());
    checksum_add(&mut sum, &segment);
    let check = checksum_fold(sum).to_be_bytes();
    let at = if proto == libc::IPPROTO_TCP { 16 } else { 6 };
    segment[at..at + 2].copy_from_slice(&check);
    segment
}

fn spoof(proto: &str, src: std::net::IpAddr, dst: std::net::IpAddr, port: u16, count: u16) -> std::io::Result<()> {
    use std::net::IpAddr;
    let proto = ip_proto(proto);
    let family = if dst.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 };
    // SAFETY: plain socket(2); closed at the end.
    let fd = unsafe { libc::socket(family, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::IPPROTO_RAW) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    for i in 0..count {
        let (packet, rc) = match (src, dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                let segment = transport_segment(proto, &s.octets(), &d.octets(), port, i);
                let mut packet = vec![0x45, 0];
                packet.extend(((20 + segment.len()) as u16).to_be_bytes());
                packet.extend([0, 0, 0x40, 0, 64, proto as u8, 0, 0]);
                packet.extend(s.octets());
                packet.extend(d.octets());
                let mut sum = 0;
                checksum_add(&mut sum, &packet);
                let check = checksum_fold(sum).to_be_bytes();
                packet[10..12].copy_from_slice(&check);
                packet.extend(segment);
                // SAFETY: sockaddr_in is plain data.
                let mut to: libc::sockaddr_in = unsafe { std::mem::zeroed() };
                to.sin_family = libc::AF_INET as libc::sa_family_t;
                to.sin_addr.s_addr = u32::from_ne_bytes(d.octets());
                // SAFETY: valid buffer and address of the sizes passed.
                let rc = unsafe {
                    libc::sendto(
                        fd,
                        packet.as_ptr().cast(),
                        packet.len(),
                        0,
                        std::ptr::addr_of!(to).cast(),
                        size_of::<libc::sockaddr_in>() as u32,
                    )
                };
                (packet, rc)
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                let segment = transport_segment(proto, &s.octets(), &d.octets(), port, i);
                let mut packet = vec![0x60, 0, 0, 0];
                packet.extend((segment.len() as u16).to_be_bytes());
                packet.extend([proto as u8, 64]);
                packet.extend(s.octets());
                packet.extend(d.octets());
                packet.extend(segment);
                // SAFETY: sockaddr_in6 is plain data.
                let mut to: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
                to.sin6_family = libc::AF_INET6 as libc::sa_family_t;
                to.sin6_addr.s6_addr = d.octets();
                // SAFETY: valid buffer and address of the sizes passed.
                let rc = unsafe {
                    libc::sendto(
                        fd,
                        packet.as_ptr().cast(),
                        packet.len(),
                        0,
                        std::ptr::addr_of!(to).cast(),
                        size_of::<libc::sockaddr_in6>() as u32,
                    )
                };
                (packet, rc)
            }
            _ => panic!("source and destination of one family"),
        };
        if rc != packet.len() as isize {
            let e = std::io::Error::last_os_error();
            // SAFETY: our fd.
            unsafe { libc::close(fd) };
            return Err(e);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: our fd.
    unsafe { libc::close(fd) };
    println!("OK {count}");
    Ok(())
}

fn sniff(proto: &str, port: u16) {
    let proto = ip_proto(proto);
    let threads: Vec<_> = [libc::AF_INET, libc::AF_INET6]
        .into_iter()
        .map(|family| {
            std::thread::spawn(move || {
                // SAFETY: plain socket(2), kept for the process's life.
                let fd = unsafe { libc::socket(family, libc::SOCK_RAW | libc::SOCK_CLOEXEC, proto) };
                assert!(fd >= 0, "raw socket: {}", std::io::Error::last_os_error());
                let mut buf = [0u8; 2048];
                loop {
                    // SAFETY: sockaddr_storage is plain data.
                    let mut from: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
                    let mut len = size_of::<libc::sockaddr_storage>() as u32;
                    // SAFETY: valid buffers of the sizes passed.
                    let n = unsafe {
                        libc::recvfrom(
                            fd,
                            buf.as_mut_ptr().cast(),
                            buf.len(),
                            0,
                            std::ptr::addr_of_mut!(from).cast(),
                            &mut len,
                        )
                    };
                    if n < 0 {
                        continue;
                    }
                    // IPv4 raw sockets deliver the IP header, IPv6 ones the payload alone.
                    let (l4, source) = if family == libc::AF_INET {
                        let header = usize::from(buf[0] & 0xf) * 4;
                        (header, std::net::IpAddr::from([buf[12], buf[13], buf[14], buf[15]]))
                    } else {
                        // SAFETY: an AF_INET6 socket fills a sockaddr_in6.
                        let from: libc::sockaddr_in6 = unsafe { std::ptr::read(std::ptr::addr_of!(from).cast()) };
                        (0, std::net::IpAddr::from(from.sin6_addr.s6_addr))
                    };
                    if (n as usize) < l4 + 4 || u16::from_be_bytes([buf[l4 + 2], buf[l4 + 3]]) != port {
                        continue;
                    }
                    println!("{source}");
                    let _ = std::io::stdout().flush();
                }
            })
        })
        .collect();
    for thread in threads {
        let _ = thread.join();
    }
}
