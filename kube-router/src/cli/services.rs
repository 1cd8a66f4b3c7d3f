//! `kube-router services`: every frontend in the pinned maps with its flags spelled out, its
//! backends and its packet/byte counters. Reads the maps only, so it works without the agent.
use std::{collections::BTreeMap, net::SocketAddr, path::Path};

use anyhow::Result;
use kube_router_common::*;
use serde::Serialize;

use super::{proto_name, socket_addr};
use crate::{
    bpf::svc_stats::FamilySvcStats,
    services::{
        compile::MapContents,
        family::{AddressFamily, V4, V6},
    },
};

#[derive(Serialize, Debug, Default)]
pub struct ServicesReport {
    pub frontends: Vec<Frontend>,
    /// Why counters are missing, if they are (e.g. a datapath without the per-frontend map).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub counters_unavailable: Option<String>,
}

#[derive(Serialize, Debug, PartialEq)]
pub struct Frontend {
    /// The frontend's id in the maps (names are not in the maps: `monitor` and the metrics
    /// name them from the agent's state).
    pub service_id: u32,
    /// `ClusterIP`, `NodePort` or `External` (an externalIP or LoadBalancer IP).
    pub kind: &'static str,
    pub address: SocketAddr,
    pub protocol: String,
    /// `local`, `dsr`, `hairpin`, `affinity=10800s`, `source-ranges`, `maglev`, `maglev-port`.
    pub flags: Vec<String>,
    pub scheduler: &'static str,
    pub backends: Vec<BackendEntry>,
    pub counters: Counters,
}

#[derive(Serialize, Debug, PartialEq)]
pub struct BackendEntry {
    pub address: SocketAddr,
    /// Whether the backend is on this node.
    pub local: bool,
}

#[derive(Serialize, Debug, Default, PartialEq, Clone, Copy)]
pub struct Counters {
    pub connections: u64,
    pub packets_in: u64,
    pub bytes_in: u64,
    pub packets_out: u64,
    pub bytes_out: u64,
}

pub fn kind(flags: u32) -> &'static str {
    if flags & SVC_FLAG_NODEPORT != 0 {
        "NodePort"
    } else if flags & SVC_FLAG_EXTERNAL != 0 {
        "External"
    } else {
        "ClusterIP"
    }
}

/// The flags an operator reads, in words.
pub fn flag_words(value: &ServiceValue) -> Vec<String> {
    let mut out = Vec::new();
    let named = [
        (SVC_FLAG_LOCAL_ONLY, "local"),
        (SVC_FLAG_DSR, "dsr"),
        (SVC_FLAG_HAIRPIN, "hairpin"),
        (SVC_FLAG_SOURCE_RANGES, "source-ranges"),
    ];
    for (bit, word) in named {
        if value.flags & bit != 0 {
            out.push(word.to_string());
        }
    }
    if value.flags & SVC_FLAG_AFFINITY != 0 {
        out.push(format!("affinity={}s", value.affinity_timeout_secs));
    }
    if value.flags & SVC_FLAG_MAGLEV_PORT != 0 {
        out.push("maglev-port".to_string());
    }
    out
}

/// The frontends of one family, from its map contents and counters (pure).
pub fn frontends_of<F: AddressFamily>(
    contents: &MapContents<F>,
    counters: &BTreeMap<ServiceKey<F::Words>, ServiceStats>,
) -> Vec<Frontend> {
    contents
        .services
        .iter()
        .map(|(key, value)| {
            let maglev = value.flags & SVC_FLAG_MAGLEV != 0;
            let mut ids: Vec<u32> = (0..value.backend_count)
                .filter_map(|slot| contents.slots.get(&BackendSlotKey { service_id: value.service_id, slot }))
                .map(|s| s.backend_id)
                .collect();
            // Maglev's slots repeat each backend many times: list each once.
            if maglev {
                ids.sort_unstable();
                ids.dedup();
            }
            let backends = ids
                .iter()
                .filter_map(|id| contents.backends.get(id))
                .map(|b| BackendEntry {
                    address: socket_addr::<F>(b.addr, b.port),
                    local: b.flags & BACKEND_FLAG_LOCAL != 0,
                })
                .collect();
            let c = counters.get(key).copied().unwrap_or_default();
            Frontend {
                service_id: value.service_id,
                kind: kind(value.flags),
                address: socket_addr::<F>(key.addr, key.port),
                protocol: proto_name(key.proto),
                flags: flag_words(value),
                scheduler: if maglev { "maglev" } else { "random" },
                backends,
                counters: Counters {
                    connections: c.connections,
                    packets_in: c.packets_in,
                    bytes_in: c.bytes_in,
                    packets_out: c.packets_out,
                    bytes_out: c.bytes_out,
                },
            }
        })
        .collect()
}

fn counters_of<F: AddressFamily>(pin_dir: &Path) -> Result<BTreeMap<ServiceKey<F::Words>, ServiceStats>>
where
    ServiceKey<F::Words>: aya::Pod,
{
    Ok(FamilySvcStats::<F>::open_pinned(pin_dir)?.read_all()?)
}

pub fn collect(pin_dir: &Path) -> Result<ServicesReport> {
    let mut report = ServicesReport::default();
    let v4 = crate::agent::read_programmed(pin_dir)?;
    let v6 = crate::agent::read_programmed_v6(pin_dir)?;
    let c4 = counters_of::<V4>(pin_dir);
    let c6 = counters_of::<V6>(pin_dir);
    if let Err(e) = c4.as_ref().and(c6.as_ref()) {
        report.counters_unavailable = Some(format!("{e:#}"));
    }
    report.frontends.extend(frontends_of(&v4, &c4.unwrap_or_default()));
    report.frontends.extend(frontends_of(&v6, &c6.unwrap_or_default()));
    Ok(report)
}

impl super::Report for ServicesReport {
    fn render_text(&self) -> String {
        let mut out = String::new();
        for f in &self.frontends {
            let backends: Vec<String> = f
                .backends
                .iter()
                .map(|b| if b.local { format!("{} (local)", b.address) } else { b.address.to_string() })
                .collect();
            let flags = if f.flags.is_empty() { String::new() } else { format!(" {}", f.flags.join(",")) };
            out.push_str(&format!(
                "{} {} id={} {}{} scheduler={} backends=[{}] conns={} in={}p/{}B out={}p/{}B\n",
                f.protocol,
                f.address,
                f.service_id,
                f.kind,
                flags,
                f.scheduler,
                backends.join(", "),
                f.counters.connections,
                f.counters.packets_in,
                f.counters.bytes_in,
                f.counters.packets_out,
                f.counters.bytes_out,
            ));
        }
        if let Some(why) = &self.counters_unavailable {
            out.push_str(&format!("(no per-frontend counters: {why})\n"));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frontend_flags_and_backends_spelled_out() {
        let mut contents = MapContents::<V4>::default();
        let key = ServiceKey {
            addr: u32::from(std::net::Ipv4Addr::new(10, 96, 0, 10)).to_be(),
            port: 53u16.to_be(),
            proto: 17,
            pad: 0,
        };
        contents.services.insert(
            key,
            ServiceValue {
                service_id: 7,
                backend_count: 2,
                flags: SVC_FLAG_AFFINITY | SVC_FLAG_LOCAL_ONLY | SVC_FLAG_EXTERNAL | SVC_FLAG_DSR,
                affinity_timeout_secs: 10800,
            },
        );
        for (slot, id) in [(0, 1), (1, 2)] {
            contents.slots.insert(BackendSlotKey { service_id: 7, slot }, BackendSlotValue { backend_id: id });
        }
        contents.backends.insert(
            1,
            Backend {
                addr: u32::from(std::net::Ipv4Addr::new(10, 1, 0, 5)).to_be(),
                port: 5353u16.to_be(),
                flags: BACKEND_FLAG_LOCAL,
            },
        );
        contents.backends.insert(
            2,
            Backend { addr: u32::from(std::net::Ipv4Addr::new(10, 2, 0, 5)).to_be(), port: 5353u16.to_be(), flags: 0 },
        );
        let stats = BTreeMap::from([(
            key,
            ServiceStats { connections: 3, packets_in: 9, bytes_in: 900, packets_out: 8, bytes_out: 800 },
        )]);
        let frontends = frontends_of(&contents, &stats);
        assert_eq!(frontends.len(), 1);
        let f = &frontends[0];
        assert_eq!(f.kind, "External");
        assert_eq!(f.address.to_string(), "10.96.0.10:53");
        assert_eq!(f.protocol, "udp");
        assert_eq!(f.flags, ["local", "dsr", "affinity=10800s"]);
        assert_eq!(
            f.backends,
            [
                BackendEntry { address: "10.1.0.5:5353".parse().unwrap(), local: true },
                BackendEntry { address: "10.2.0.5:5353".parse().unwrap(), local: false },
            ]
        );
        assert_eq!(f.counters.connections, 3);
        assert_eq!(f.counters.bytes_out, 800);
        let json = serde_json::to_value(f).unwrap();
        assert_eq!(json["backends"][0]["address"], "10.1.0.5:5353");
        assert_eq!(json["kind"], "External");
    }
}
