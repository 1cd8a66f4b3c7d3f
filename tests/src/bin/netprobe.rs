//! A tiny network tool for the end-to-end tests, run inside network namespaces.
//!
//!   krt-netprobe serve NAME PORT            TCP and UDP server on PORT answering every line / datagram with NAME
//!   krt-netprobe request tcp|udp ADDR COUNT COUNT new connections (or datagrams); prints one reply (or ERR ...) per line
//!   krt-netprobe hold ADDR INTERVAL_MS      one TCP connection, a request every INTERVAL_MS, prints each reply, forever
//!   krt-netprobe probe ADDR INTERVAL_MS     a new TCP connection every INTERVAL_MS, prints each reply (or ERR ...), forever
//!   krt-netprobe http ADDR PATH             one HTTP/1.0 GET; prints the status code, then the body
//!   krt-netprobe matrix TIMEOUT_MS PROTO:ADDR...  one attempt per target, all at once; prints
//!                                           "PROTO:ADDR OK NAME" or "PROTO:ADDR ERR ..." per target, in order
//!   krt-netprobe peer tcp|udp|udp-connected ADDR COUNT
//!                                           COUNT exchanges; prints "OK NAME PEER MICROS" or "ERR ... MICROS"
//!                                           per line, PEER being what the socket API reports: getpeername
//!                                           (tcp), the recvfrom source (udp), both, which must agree
//!                                           (udp-connected: connect, send, recvfrom)
use std::{
    io::{BufRead, BufReader, Write},
    net::{SocketAddr, TcpListener, TcpStream, UdpSocket},
    time::Duration,
};

const TIMEOUT: Duration = Duration::from_secs(2);

fn serve(name: String, port: u16) -> ! {
    let udp = UdpSocket::bind(("0.0.0.0", port)).expect("bind udp");
    let udp_name = name.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 1500];
        loop {
            if let Ok((_, peer)) = udp.recv_from(&mut buf) {
                let _ = udp.send_to(format!("{udp_name}\n").as_bytes(), peer);
            }
        }
    });
    let listener = TcpListener::bind(("0.0.0.0", port)).expect("bind tcp");
    println!("listening {port}");
    for stream in listener.incoming().flatten() {
        let name = name.clone();
        std::thread::spawn(move || {
            let mut writer = stream.try_clone().expect("clone");
            for line in BufReader::new(stream).lines() {
                if line.is_err() || writer.write_all(format!("{name}\n").as_bytes()).is_err() {
                    break;
                }
            }
        });
    }
    std::process::exit(1)
}

fn tcp_once(addr: SocketAddr) -> Result<String, String> {
    tcp_exchange(addr, TIMEOUT)
}

fn tcp_exchange(addr: SocketAddr, timeout: Duration) -> Result<String, String> {
    let stream = TcpStream::connect_timeout(&addr, timeout).map_err(|e| format!("connect: {e}"))?;
    stream.set_read_timeout(Some(timeout)).map_err(|e| e.to_string())?;
    (&stream).write_all(b"hello\n").map_err(|e| format!("write: {e}"))?;
    let mut line = String::new();
    BufReader::new(&stream).read_line(&mut line).map_err(|e| format!("read: {e}"))?;
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
        "tcp" => tcp_exchange(addr, timeout),
        "udp" => udp_exchange(addr, timeout),
        other => Err(format!("unknown protocol {other}")),
    }
}

fn udp_once(addr: SocketAddr) -> Result<String, String> {
    udp_exchange(addr, TIMEOUT)
}

fn udp_exchange(addr: SocketAddr, timeout: Duration) -> Result<String, String> {
    let socket = UdpSocket::bind("0.0.0.0:0").map_err(|e| e.to_string())?;
    socket.set_read_timeout(Some(timeout)).map_err(|e| e.to_string())?;
    socket.send_to(b"hello\n", addr).map_err(|e| format!("send: {e}"))?;
    let mut buf = [0u8; 1500];
    let (n, from) = socket.recv_from(&mut buf).map_err(|e| format!("recv: {e}"))?;
    if from != addr {
        return Err(format!("reply from {from}, not {addr}"));
    }
    Ok(String::from_utf8_lossy(&buf[..n]).trim().to_string())
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
            let socket = UdpSocket::bind("0.0.0.0:0").map_err(|e| e.to_string())?;
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
    use std::io::Read;
    let mut stream = TcpStream::connect_timeout(&addr, TIMEOUT).map_err(|e| format!("connect: {e}"))?;
    stream.set_read_timeout(Some(TIMEOUT)).map_err(|e| e.to_string())?;
    stream.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes()).map_err(|e| e.to_string())?;
    let mut response = String::new();
    stream.read_to_string(&mut response).map_err(|e| format!("read: {e}"))?;
    let status = response.split_whitespace().nth(1).unwrap_or("?").to_string();
    let body = response.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    Ok((status, body))
}

fn hold(addr: SocketAddr, interval: Duration) -> ! {
    let stream = TcpStream::connect_timeout(&addr, TIMEOUT).expect("connect");
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

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize| {
        args.get(i).cloned().unwrap_or_else(|| panic!("missing argument {i}: see the usage at the top of netprobe.rs"))
    };
    match arg(0).as_str() {
        "serve" => serve(arg(1), arg(2).parse().expect("port")),
        "request" => {
            let addr: SocketAddr = arg(2).parse().expect("addr");
            let count: usize = arg(3).parse().expect("count");
            for _ in 0..count {
                let result = if arg(1) == "udp" { udp_once(addr) } else { tcp_once(addr) };
                match result {
                    Ok(name) => println!("{name}"),
                    Err(e) => println!("ERR {e}"),
                }
            }
        }
        "probe" => {
            let addr: SocketAddr = arg(1).parse().expect("addr");
            let interval = Duration::from_millis(arg(2).parse().expect("interval"));
            loop {
                match tcp_once(addr) {
                    Ok(name) => println!("{name}"),
                    Err(e) => println!("ERR {e}"),
                }
                let _ = std::io::stdout().flush();
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
        "hold" => hold(arg(1).parse().expect("addr"), Duration::from_millis(arg(2).parse().expect("interval"))),
        other => panic!("unknown command {other}"),
    }
}
