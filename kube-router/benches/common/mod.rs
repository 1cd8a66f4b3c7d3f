//! Shared by the benchmarks: a synthetic service model.
use std::net::{Ipv4Addr, Ipv6Addr};

use kube_router::services::model::*;

/// `services` ClusterIP services (10.96.0.0 + i, TCP 80) with `endpoints` ready endpoints each
/// (10.128.0.0 + i * endpoints + e, port 8080, on another node); svc-5000 is also a NodePort
/// (30080), for the north-south cases.
pub fn state(services: usize, endpoints: usize) -> ServiceState {
    let mut state = ServiceState::default();
    for i in 0..services {
        let name = ServiceName::new("bench", format!("svc-{i}"));
        let vip = Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 96, 0, 0)) + i as u32);
        state.services.insert(
            name.clone(),
            Service::cluster_ip(
                name.clone(),
                vec![vip.into()],
                vec![ServicePort {
                    name: "http".into(),
                    protocol: Protocol::Tcp,
                    port: 80,
                    node_port: (i == 5000).then_some(30080),
                }],
            ),
        );
        let endpoints = (0..endpoints)
            .map(|e| Endpoint {
                addr: Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 128, 0, 0)) + (i * endpoints + e) as u32).into(),
                ready: true,
                serving: true,
                terminating: false,
                node_name: Some("node-b".into()),
                zone_hints: None,
            })
            .collect();
        state.slices.insert(
            ("bench".into(), format!("svc-{i}-1")),
            EndpointSlice {
                service: name,
                ports: vec![EndpointPort { name: "http".into(), protocol: Protocol::Tcp, port: 8080 }],
                endpoints,
            },
        );
    }
    state
}

/// The IPv6 twin of [`state`]: ClusterIPs fd00:96::i, endpoints fd00:128::(i * endpoints + e),
/// svc-5000 also a NodePort (30080).
// Each bench compiles this module; only the datapath bench uses the IPv6 state.
#[allow(dead_code)]
pub fn state_v6(services: usize, endpoints: usize) -> ServiceState {
    let mut state = state(services, endpoints);
    let v6 = |base: u128, i: usize| std::net::IpAddr::V6(Ipv6Addr::from(base + i as u128));
    let vips: u128 = 0xfd00_0096_u128 << 96;
    let backends: u128 = 0xfd00_0128_u128 << 96;
    for (i, service) in state.services.values_mut().enumerate() {
        let n: usize = service.name.name.trim_start_matches("svc-").parse().unwrap_or(i);
        service.cluster_ips = vec![v6(vips, n)];
        service.ip_families = vec![kube_router::services::family::IpFamily::IPv6];
    }
    for slice in state.slices.values_mut() {
        let n: usize = slice.service.name.trim_start_matches("svc-").parse().unwrap();
        for (e, endpoint) in slice.endpoints.iter_mut().enumerate() {
            endpoint.addr = v6(backends, n * endpoints + e);
        }
    }
    state
}
