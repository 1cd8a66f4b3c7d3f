//! Benchmark (root, inside scripts/isolated.sh): what the socket load balancer adds to the
//! system calls it hooks. sock_addr programs cannot be run with BPF_PROG_TEST_RUN, so this times
//! real calls in a private network namespace: `connect()` + close (RST, no TIME_WAIT) of TCP and
//! UDP `sendto()`, to a local backend address directly and through a ClusterIP, with the process
//! in a cgroup with the programs and in one without, in the same run (10,000 services
//! programmed). Rounds alternate the cases so that machine noise hits them alike; the median
//! round counts.
use std::{
    fs,
    net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    os::fd::AsRawFd,
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use kube_router::services::maps::BpfServiceMaps;
use kube_router::{
    bpf::{
        datapath::{self, Datapath},
        socket_lb,
    },
    services::{
        compile::{assign_ids, plan, Limits},
        model::*,
        sync::ServiceSync,
    },
};

mod common;

const BACKEND: Ipv4Addr = Ipv4Addr::new(10, 1, 0, 1);
const VIP: Ipv4Addr = Ipv4Addr::new(10, 97, 0, 1);
const ROUNDS: usize = 7;
const CALLS: usize = 2_000;

fn sh(args: &[&str]) {
    let status = Command::new(args[0]).args(&args[1..]).status().expect("spawn");
    assert!(status.success(), "{args:?}");
}

/// One service in front of the local backend (TCP 80 -> 8080, UDP 53 -> 5353), among 10,000.
fn services() -> ServiceState {
    let mut state = common::state(10_000, 1);
    let name = ServiceName::new("bench", "target");
    let port = |name: &str, protocol, port| ServicePort { name: name.into(), protocol, port, node_port: None };
    state.services.insert(
        name.clone(),
        Service::cluster_ip(
            name.clone(),
            vec![VIP.into()],
            vec![port("http", Protocol::Tcp, 80), port("dns", Protocol::Udp, 53)],
        ),
    );
    let endpoint = Endpoint {
        addr: BACKEND.into(),
        ready: true,
        serving: true,
        terminating: false,
        node_name: None,
        zone_hints: None,
    };
    state.slices.insert(
        ("bench".into(), "target-1".into()),
        EndpointSlice {
            service: name,
            ports: vec![
                EndpointPort { name: "http".into(), protocol: Protocol::Tcp, port: 8080 },
                EndpointPort { name: "dns".into(), protocol: Protocol::Udp, port: 5353 },
            ],
            endpoints: vec![endpoint],
        },
    );
    state
}

fn join_cgroup(cgroup: &Path) {
    fs::write(cgroup.join("cgroup.procs"), std::process::id().to_string()).expect("join cgroup");
}

/// Nanoseconds per `connect()` + close to `target`.
fn tcp_connects(target: SocketAddr) -> f64 {
    let started = Instant::now();
    for _ in 0..CALLS {
        let stream = TcpStream::connect(target).expect("connect");
        // Close with RST: no TIME_WAIT, so the ephemeral ports never run out.
        let linger = libc::linger { l_onoff: 1, l_linger: 0 };
        // SAFETY: setsockopt reads a linger struct of the given size.
        unsafe {
            libc::setsockopt(
                stream.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_LINGER,
                (&linger as *const libc::linger).cast(),
                size_of::<libc::linger>() as u32,
            )
        };
    }
    started.elapsed().as_nanos() as f64 / CALLS as f64
}

/// Nanoseconds per `sendto()` to `target`.
fn udp_sends(socket: &UdpSocket, target: SocketAddr) -> f64 {
    let started = Instant::now();
    for _ in 0..CALLS {
        socket.send_to(b"x", target).expect("sendto");
    }
    started.elapsed().as_nanos() as f64 / CALLS as f64
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() {
    // A private network namespace with the backend address on a dummy interface.
    // SAFETY: unshare affects only this (single-threaded so far) process.
    assert_eq!(unsafe { libc::unshare(libc::CLONE_NEWNET) }, 0, "unshare (root needed)");
    sh(&["ip", "link", "set", "lo", "up"]);
    sh(&["ip", "link", "add", "krt-bench", "type", "dummy"]);
    sh(&["ip", "addr", "add", &format!("{BACKEND}/32"), "dev", "krt-bench"]);
    sh(&["ip", "link", "set", "krt-bench", "up"]);
    let listener = TcpListener::bind((BACKEND, 8080)).unwrap();
    std::thread::spawn(move || for _ in listener.incoming() {});
    // Never read: once its buffer is full the kernel drops the datagrams, sendto still succeeds.
    let _udp_backend = UdpSocket::bind((BACKEND, 5353)).unwrap();

    let pin_dir = Path::new("/sys/fs/bpf/krt-bench-sock");
    let _ = datapath::remove_all(pin_dir);
    let mut datapath = Datapath::load(pin_dir).expect("load datapath");
    let mut maps = BpfServiceMaps::open_pinned(pin_dir).unwrap();
    let mut sync = ServiceSync::adopt(&maps).unwrap();
    let desired = assign_ids(&plan(&services(), &NodeContext::default(), Limits::default()), sync.programmed());
    assert_eq!(sync.sync(&mut maps, desired, true).total().errors, 0);

    let base = PathBuf::from("/sys/fs/cgroup/unified");
    let with = base.join(format!("krt-bench-sock-{}", std::process::id()));
    let without = base.join(format!("krt-bench-plain-{}", std::process::id()));
    for dir in [&with, &without] {
        fs::create_dir(dir).expect("create bench cgroup");
    }
    socket_lb::write_host_netns(pin_dir).unwrap();
    socket_lb::attach(&mut datapath, &with).expect("attach");

    let backend_tcp = SocketAddr::from((BACKEND, 8080));
    let vip_tcp = SocketAddr::from((VIP, 80));
    let backend_udp = SocketAddr::from((BACKEND, 5353));
    let vip_udp = SocketAddr::from((VIP, 53));
    let sender = UdpSocket::bind("0.0.0.0:0").unwrap();
    type Case<'a> = (&'a str, &'a Path, Box<dyn Fn() -> f64 + 'a>);
    let cases: Vec<Case> = vec![
        ("tcp connect, no programs (baseline)", &without, Box::new(|| tcp_connects(backend_tcp))),
        ("tcp connect, programs, not a service", &with, Box::new(|| tcp_connects(backend_tcp))),
        ("tcp connect, programs, ClusterIP -> backend", &with, Box::new(|| tcp_connects(vip_tcp))),
        ("udp sendto, no programs (baseline)", &without, Box::new(|| udp_sends(&sender, backend_udp))),
        ("udp sendto, programs, not a service", &with, Box::new(|| udp_sends(&sender, backend_udp))),
        ("udp sendto, programs, ClusterIP -> backend", &with, Box::new(|| udp_sends(&sender, vip_udp))),
    ];
    let mut samples = vec![Vec::new(); cases.len()];
    for _ in 0..ROUNDS {
        for ((_, cgroup, run), samples) in cases.iter().zip(&mut samples) {
            join_cgroup(cgroup);
            samples.push(run());
        }
    }
    join_cgroup(&base);

    println!("== socket load balancer: ns per call, median of {ROUNDS} rounds x {CALLS} calls (10,000 services)");
    let results: Vec<f64> = samples.into_iter().map(median).collect();
    for (i, ((name, _, _), ns)) in cases.iter().zip(&results).enumerate() {
        let baseline = results[i / 3 * 3];
        println!("{name:<46} {ns:>9.0} ns   {:.2}x", ns / baseline);
    }
    let stats = socket_lb::read_sock_stats(pin_dir).unwrap();
    println!("sock_stats: {stats:?}");

    drop(datapath);
    let _ = datapath::remove_all(pin_dir);
    for dir in [&with, &without] {
        let _ = fs::remove_dir(dir);
    }
}
