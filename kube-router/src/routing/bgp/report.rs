//! The speaker's state as one serializable document: the agent's `bgp.json` status page, which
//! `kube-router bgp -o json` prints (shape in docs/usage.md).
use std::net::{IpAddr, Ipv4Addr};

use serde::{Deserialize, Serialize};

use super::{fsm::State, speaker::SpeakerStatus};

#[derive(Serialize, Deserialize, Debug, Default, PartialEq)]
pub struct BgpReport {
    /// False until the speaker runs (or with --run-router=false); then nothing else is set.
    pub running: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub local_asn: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub router_id: Option<Ipv4Addr>,
    /// Started as a graceful restart: the previous run's routes were kept (R-bit in the OPENs).
    /// (`default`: an agent before 2026-12-06 reports no such field; a CLI of another version
    /// reads its report all the same.)
    #[serde(default)]
    pub restarted: bool,
    /// Restarted and holding our advertisements back until the peers' End-of-RIB.
    #[serde(default)]
    pub restarting: bool,
    /// Holding routes back until the peers' End-of-RIB (after a restart).
    pub deferring: bool,
    /// The first complete routing picture is in (the peers' End-of-RIB, or the deferral timer):
    /// kernel routes kept from before it may be removed.
    #[serde(default)]
    pub routing_complete: bool,
    pub neighbors: Vec<Neighbor>,
    /// Loc-RIB prefixes; `routes` lists them unless there are more than 10,000.
    pub routes_total: usize,
    pub routes: Vec<Route>,
}

#[derive(Serialize, Deserialize, Debug, PartialEq)]
pub struct Neighbor {
    pub address: IpAddr,
    pub asn: u32,
    /// `internal` (same AS) or `external`, as kube-router's `bgp_peer_info`.
    #[serde(rename = "type")]
    pub peer_type: String,
    /// The FSM state, as the text form prints it (`Established`, `Active`, ...).
    pub state: String,
    /// Seconds since the session came up (Established only).
    pub uptime_seconds: Option<u64>,
    pub prefixes_received: usize,
    pub prefixes_stale: usize,
    pub prefixes_advertised: usize,
    pub prefixes_rejected: usize,
    pub prefixes_unresolved: usize,
    pub updates_received: u64,
    pub notifications_received: u64,
    pub notifications_sent: u64,
    /// UPDATEs with a malformed attribute treated as withdrawals, the session kept (RFC 7606).
    #[serde(default)]
    pub updates_treated_as_withdraw: u64,
    /// BFD session Up, for peers BFD watches.
    pub bfd_up: Option<bool>,
    /// Why the session is not Established, when known.
    pub last_error: Option<String>,
}

#[derive(Serialize, Deserialize, Debug, PartialEq)]
pub struct Route {
    pub prefix: String,
    pub next_hop: IpAddr,
    /// The peer it was learned from; `None`: originated here.
    pub from: Option<IpAddr>,
}

impl BgpReport {
    pub fn of(status: Option<&SpeakerStatus>) -> Self {
        let Some(status) = status else { return Self::default() };
        Self {
            running: true,
            local_asn: Some(status.local_asn),
            router_id: status.router_id,
            restarted: status.restarted,
            restarting: status.restarting,
            deferring: status.deferring,
            routing_complete: status.routing_complete,
            neighbors: status
                .peers
                .iter()
                .map(|p| Neighbor {
                    address: p.address,
                    asn: p.asn,
                    peer_type: if p.asn == status.local_asn { "internal" } else { "external" }.to_string(),
                    state: format!("{:?}", p.state),
                    uptime_seconds: p.established_at.map(|t| t.elapsed().as_secs()),
                    prefixes_received: p.prefixes_received,
                    prefixes_stale: p.prefixes_stale,
                    prefixes_advertised: p.prefixes_advertised,
                    prefixes_rejected: p.prefixes_rejected,
                    prefixes_unresolved: p.prefixes_unresolved,
                    updates_received: p.updates_received,
                    notifications_received: p.notifications_received,
                    notifications_sent: p.notifications_sent,
                    updates_treated_as_withdraw: p.updates_treated_as_withdraw,
                    bfd_up: p.bfd_up,
                    last_error: p.last_error.clone().filter(|_| p.state != State::Established),
                })
                .collect(),
            routes_total: status.loc_rib_size,
            routes: status
                .loc_rib
                .iter()
                .map(|r| Route { prefix: r.prefix.to_string(), next_hop: r.next_hop, from: r.from })
                .collect(),
        }
    }

    /// The `bgp.json` page.
    pub fn page(status: Option<&SpeakerStatus>) -> String {
        serde_json::to_string(&Self::of(status)).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::bgp::speaker::{PeerStatus, StatusRoute};

    #[test]
    fn the_report_names_each_neighbor_and_route_as_the_text_page_does() {
        let peer = |address: &str, asn, state| PeerStatus {
            address: address.parse().unwrap(),
            asn,
            state,
            established_at: (state == State::Established).then(std::time::Instant::now),
            prefixes_received: 2,
            prefixes_rejected: 0,
            prefixes_unresolved: 0,
            prefixes_stale: 0,
            prefixes_advertised: 1,
            updates_received: 3,
            notifications_received: 0,
            notifications_sent: 0,
            updates_treated_as_withdraw: 1,
            max_prefix_violations: 0,
            last_error: Some("connection refused".into()),
            bfd_up: None,
        };
        let status = SpeakerStatus {
            local_asn: 64512,
            router_id: Some(Ipv4Addr::new(10, 0, 0, 1)),
            peers: vec![peer("10.0.0.2", 64512, State::Established), peer("192.0.2.1", 65000, State::Active)],
            routing_complete: true,
            loc_rib: std::sync::Arc::new(vec![StatusRoute {
                prefix: "10.244.2.0/24".parse().unwrap(),
                next_hop: "10.0.0.2".parse().unwrap(),
                from: Some("10.0.0.2".parse().unwrap()),
            }]),
            loc_rib_size: 1,
            ..Default::default()
        };
        let json: serde_json::Value = serde_json::from_str(&BgpReport::page(Some(&status))).unwrap();
        assert_eq!(json["running"], true);
        assert_eq!(json["local_asn"], 64512);
        assert_eq!(json["neighbors"][0]["type"], "internal");
        assert_eq!(json["neighbors"][0]["state"], "Established");
        assert_eq!(json["neighbors"][0]["uptime_seconds"], 0);
        assert_eq!(json["neighbors"][0]["last_error"], serde_json::Value::Null, "an Established session has none");
        assert_eq!(json["neighbors"][1]["type"], "external");
        assert_eq!(json["neighbors"][1]["last_error"], "connection refused");
        assert_eq!(json["neighbors"][1]["updates_treated_as_withdraw"], 1);
        assert_eq!((&json["restarted"], &json["routing_complete"]), (&false.into(), &true.into()));
        assert_eq!(json["routes"][0]["prefix"], "10.244.2.0/24");
        assert_eq!(json["routes"][0]["from"], "10.0.0.2");
        let idle: serde_json::Value = serde_json::from_str(&BgpReport::page(None)).unwrap();
        assert_eq!(idle["running"], false);
    }
}
