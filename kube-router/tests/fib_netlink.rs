//! Our routes in a real kernel routing table (a network namespace), through rtnetlink: only
//! differences are written, other protocols' routes are never touched. Needs root.
use std::process::Command;

use kube_router::fib::{netlink::NetlinkRoutes, reconcile, RouteOp, RouteSet};

const NS: &str = "krt-fib";

fn ip(args: &[&str]) -> String {
    let out = Command::new("ip").args(["-n", NS]).args(args).output().unwrap();
    assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn set(routes: &[(&str, &str)]) -> RouteSet {
    routes.iter().map(|(d, g)| (d.parse().unwrap(), g.parse().unwrap())).collect()
}

/// Runs `f` on a thread inside the namespace, with its own runtime (netlink sockets are opened
/// in the thread's namespace).
fn in_netns<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(move || {
        let file = std::fs::File::open(format!("/run/netns/{NS}")).unwrap();
        // SAFETY: setns on this thread only, with a valid namespace fd.
        assert_eq!(unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&file), libc::CLONE_NEWNET) }, 0);
        f()
    })
    .join()
    .unwrap()
}

#[test]
fn reconciles_only_our_routes_and_only_the_differences() {
    let _ = Command::new("ip").args(["netns", "delete", NS]).output();
    assert!(Command::new("ip").args(["netns", "add", NS]).status().unwrap().success());
    ip(&["link", "add", "peers", "type", "veth", "peer", "name", "peers-b"]);
    ip(&["link", "set", "peers-b", "up"]);
    ip(&["addr", "add", "192.0.2.1/24", "dev", "peers"]);
    ip(&["-6", "addr", "add", "fd00:99::1/64", "dev", "peers", "nodad"]);
    ip(&["link", "set", "peers", "up"]);
    ip(&["route", "add", "10.77.0.0/16", "via", "192.0.2.7", "proto", "static"]);

    let report = in_netns(|| {
        tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
            let routes = NetlinkRoutes::connect(186, 254).unwrap();
            let mut log = Vec::new();
            let desired =
                set(&[("10.10.1.0/24", "192.0.2.2"), ("10.10.2.0/24", "192.0.2.3"), ("fd00:10::/64", "fd00:99::2")]);
            for round in [
                desired.clone(),
                desired.clone(),
                set(&[("10.10.1.0/24", "192.0.2.9"), ("fd00:10::/64", "fd00:99::2")]),
            ] {
                let installed = routes.list().await.unwrap();
                let ops = reconcile(&installed, &round, true);
                for op in &ops {
                    routes.apply(*op).await.unwrap();
                }
                assert_eq!(routes.list().await.unwrap(), round);
                log.push(ops);
            }
            log
        })
    });
    assert_eq!(report[0].len(), 3, "first round installs all three");
    assert!(report[1].is_empty(), "an unchanged desired state writes nothing: {:?}", report[1]);
    assert_eq!(
        report[2],
        vec![
            RouteOp::Replace("10.10.1.0/24".parse().unwrap(), "192.0.2.9".parse().unwrap()),
            RouteOp::Delete("10.10.2.0/24".parse().unwrap()),
        ]
    );
    let ours = ip(&["route", "show", "proto", "186"]);
    assert_eq!(ours.trim(), "10.10.1.0/24 via 192.0.2.9 dev peers");
    assert!(ip(&["-6", "route", "show", "proto", "186"]).contains("fd00:10::/64 via fd00:99::2 dev peers"));
    assert!(
        ip(&["route", "show", "proto", "static"]).contains("10.77.0.0/16 via 192.0.2.7"),
        "other protocols untouched"
    );
    let _ = Command::new("ip").args(["netns", "delete", NS]).output();
}
