//! Our routes in a real kernel routing table (a network namespace), through rtnetlink: only
//! differences are written, other protocols' routes are never touched (not even when we try:
//! writes are create-exclusive and deletes match our protocol), default and multipath routes
//! read back as what was written. Needs root (run it in scripts/isolated.sh).
use std::process::Command;

use kube_router::routing::fib::{
    health::KernelError, netlink::NetlinkRoutes, reconcile, Desired, DesiredSet, Gateways, KernelRoute, RouteOp,
    RouteSet,
};

const NS: &str = "krt-fib";

fn ip(args: &[&str]) -> String {
    let out = Command::new("ip").args(["-n", NS]).args(args).output().unwrap();
    assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn gateways(text: &str) -> KernelRoute {
    Gateways::new(text.split(',').map(|g| g.parse().unwrap()).collect()).unwrap().into()
}

/// destination -> comma-separated gateways
fn set(routes: &[(&str, &str)]) -> RouteSet {
    routes.iter().map(|(d, g)| (d.parse().unwrap(), gateways(g))).collect()
}

fn desired(routes: &RouteSet) -> DesiredSet {
    routes.iter().map(|(d, g)| (*d, Desired { route: g.clone(), peer: None })).collect()
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
            let wanted = set(&[
                ("10.10.1.0/24", "192.0.2.2"),
                ("10.10.2.0/24", "192.0.2.3"),
                ("fd00:10::/64", "fd00:99::2"),
                ("0.0.0.0/0", "192.0.2.4"),
                ("::/0", "fd00:99::4"),
                ("10.10.3.0/24", "192.0.2.5,192.0.2.6"),
                ("fd00:11::/64", "fd00:99::5,fd00:99::6"),
            ]);
            for round in [
                wanted.clone(),
                wanted.clone(),
                set(&[("10.10.1.0/24", "192.0.2.9"), ("fd00:10::/64", "fd00:99::2"), ("10.10.3.0/24", "192.0.2.5")]),
            ] {
                let installed = routes.list().await.unwrap();
                let ops = reconcile(&installed, &desired(&round), true).ops;
                for op in &ops {
                    routes.apply(op).await.unwrap();
                }
                assert_eq!(routes.list().await.unwrap().ours, round);
                log.push(ops);
            }
            // Even a direct attempt never creates over or deletes a route that is not ours
            // (a replace is only ever planned for a route listed as ours: the kernel's
            // NLM_F_REPLACE does not look at the protocol).
            let static_route = "10.77.0.0/16".parse().unwrap();
            let create = routes.apply(&RouteOp::Create(static_route, gateways("192.0.2.8"))).await;
            let delete = routes.apply(&RouteOp::Delete(static_route, gateways("192.0.2.7"))).await;
            // A replace of a route that is gone does not create it.
            let gone = "10.10.9.0/24".parse().unwrap();
            let replace = routes.apply(&RouteOp::Replace(gone, gateways("192.0.2.8"))).await;
            let table = routes.list().await.unwrap();
            assert!(!table.ours.contains_key(&gone));
            (log, [create, replace, delete], table.foreign.get(&static_route).cloned())
        })
    });
    let (report, attempts, static_route) = report;
    assert_eq!(report[0].len(), 7, "first round installs all of them");
    assert!(report[1].is_empty(), "an unchanged desired state writes nothing: {:?}", report[1]);
    assert_eq!(
        report[2],
        vec![
            RouteOp::Replace("10.10.1.0/24".parse().unwrap(), gateways("192.0.2.9")),
            RouteOp::Replace("10.10.3.0/24".parse().unwrap(), gateways("192.0.2.5")),
            RouteOp::Delete("0.0.0.0/0".parse().unwrap(), gateways("192.0.2.4")),
            RouteOp::Delete("10.10.2.0/24".parse().unwrap(), gateways("192.0.2.3")),
            RouteOp::Delete("::/0".parse().unwrap(), gateways("fd00:99::4")),
            RouteOp::Delete("fd00:11::/64".parse().unwrap(), gateways("fd00:99::5,fd00:99::6")),
        ]
    );
    assert_eq!(attempts[0], Err(KernelError::EXISTS), "create is exclusive");
    assert!(attempts[1].is_err(), "replace never creates");
    assert_eq!(attempts[2], Err(KernelError::NO_SUCH_ROUTE), "delete matches our protocol only");
    assert_eq!(static_route.map(|r| r.protocol), Some(4));
    let ours = ip(&["route", "show", "proto", "186"]);
    assert_eq!(ours.trim(), "10.10.1.0/24 via 192.0.2.9 dev peers \n10.10.3.0/24 via 192.0.2.5 dev peers");
    assert!(ip(&["-6", "route", "show", "proto", "186"]).contains("fd00:10::/64 via fd00:99::2 dev peers"));
    assert!(
        ip(&["route", "show", "proto", "static"]).contains("10.77.0.0/16 via 192.0.2.7"),
        "other protocols untouched"
    );
    let _ = Command::new("ip").args(["netns", "delete", NS]).output();
}
