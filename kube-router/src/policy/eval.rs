//! Reference evaluator over the compiled model: the semantics the datapath
//! must implement, and the oracle the tests use.

use std::net::IpAddr;

use super::model::{CompiledModel, Direction, Isolation, Protocol};

/// Whether a new connection `src_ip -> dst_ip:dst_port/protocol` is allowed:
/// the egress side of `src` AND the ingress side of `dst` must allow it. An
/// IP that is not a known pod (outside the cluster, host network) has no side
/// to check. Replies of allowed connections are not evaluated here: the
/// datapath admits them via conntrack.
pub fn allows(compiled: &CompiledModel, src_ip: IpAddr, dst_ip: IpAddr, protocol: Protocol, dst_port: u16) -> bool {
    side_allows(compiled, src_ip, Direction::Egress, dst_ip, protocol, dst_port)
        && side_allows(compiled, dst_ip, Direction::Ingress, src_ip, protocol, dst_port)
}

/// Whether the policy of `pod_ip` for `direction` allows talking to `peer_ip`.
pub fn side_allows(
    compiled: &CompiledModel,
    pod_ip: IpAddr,
    direction: Direction,
    peer_ip: IpAddr,
    protocol: Protocol,
    dst_port: u16,
) -> bool {
    let Some(pod) = compiled.pods.get(&pod_ip) else {
        return true;
    };
    match pod.direction(direction) {
        Isolation::NotIsolated => true,
        Isolation::Isolated(rules) => rules
            .iter()
            .any(|rule| rule.ports.allows(protocol, dst_port) && compiled.peer_matches(&rule.peers, peer_ip)),
    }
}
