//! `kube-router services`: every frontend in the pinned maps with its Service, its flags spelled
//! out, its backends and its packet/byte counters. The maps are read directly, so it works
//! without the agent; the Service names come from the running agent (its `frontends` status
//! page on `<state-dir>/agent.sock`), else from its checkpoint in --state-dir.
use std::{
    collections::{BTreeMap, HashMap},
    net::{IpAddr, SocketAddr},
    path::Path,
};

use k8s_openapi::api::core::v1::Service;

use anyhow::Result;
use kube_router_common::*;
use serde::Serialize;

use super::{proto_name, socket_addr};
use crate::{
    services::maps::stats::FamilySvcStats,
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
    /// Why frontends carry no Service name: neither the agent nor a checkpoint could be read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub names_unavailable: Option<String>,
}

/// The Service a frontend belongs to.
#[derive(Serialize, Debug, PartialEq, Clone)]
pub struct ServiceRef {
    pub namespace: String,
    pub name: String,
    /// The Service's `spec.type` (`ClusterIP`, `NodePort`, `LoadBalancer`), from the checkpoint;
    /// absent without one (`--service-file`).
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub service_type: Option<String>,
}

#[derive(Serialize, Debug, PartialEq)]
pub struct Frontend {
    /// The frontend's id in the maps (names are not in the maps: `monitor` and the metrics
    /// name them from the agent's state).
    pub service_id: u32,
    /// The Service, when the agent or its checkpoint names it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service: Option<ServiceRef>,
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
                service: None,
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

/// Where frontends get their Service names from.
#[derive(Debug, Default)]
pub struct ServiceNames {
    /// The running agent's catalog: (address, protocol) -> (namespace, name).
    agent: HashMap<(SocketAddr, String), (String, String)>,
    /// From the checkpoint's Services: (address, port, protocol) of ClusterIPs, externalIPs and
    /// LoadBalancer IPs, and (nodePort, protocol) of NodePorts.
    by_address: HashMap<(IpAddr, u16, String), (String, String)>,
    by_node_port: HashMap<(u16, String), (String, String)>,
    /// (namespace, name) -> spec.type.
    types: HashMap<(String, String), String>,
}

impl ServiceNames {
    pub fn from_agent(mut self, frontends: Vec<crate::kr_metrics::NamedFrontend>) -> Self {
        for f in frontends {
            self.agent.insert((f.address, f.protocol), (f.namespace, f.name));
        }
        self
    }

    pub fn from_checkpoint(mut self, services: &[Service]) -> Self {
        for service in services {
            let owner = (
                service.metadata.namespace.clone().unwrap_or_else(|| "default".into()),
                service.metadata.name.clone().unwrap_or_default(),
            );
            let spec = service.spec.clone().unwrap_or_default();
            self.types.insert(owner.clone(), spec.type_.clone().unwrap_or_else(|| "ClusterIP".into()));
            let ingress =
                service.status.as_ref().and_then(|s| s.load_balancer.as_ref()).and_then(|l| l.ingress.clone());
            let addresses: Vec<IpAddr> = spec
                .cluster_ips
                .unwrap_or_default()
                .into_iter()
                .chain(spec.cluster_ip)
                .chain(spec.external_ips.unwrap_or_default())
                .chain(ingress.unwrap_or_default().into_iter().filter_map(|i| i.ip))
                .filter_map(|ip| ip.parse().ok())
                .collect();
            for port in spec.ports.unwrap_or_default() {
                let protocol = port.protocol.as_deref().unwrap_or("TCP").to_lowercase();
                let Ok(number) = u16::try_from(port.port) else { continue };
                for addr in &addresses {
                    self.by_address.insert((*addr, number, protocol.clone()), owner.clone());
                }
                if let Some(node_port) = port.node_port.and_then(|p| u16::try_from(p).ok()) {
                    self.by_node_port.insert((node_port, protocol), owner.clone());
                }
            }
        }
        self
    }

    fn is_empty(&self) -> bool {
        self.agent.is_empty() && self.by_address.is_empty() && self.by_node_port.is_empty()
    }

    /// The Service of `frontend`: the agent's word first, then the checkpoint's.
    pub fn of(&self, frontend: &Frontend) -> Option<ServiceRef> {
        let proto = frontend.protocol.clone();
        let addr = frontend.address;
        let (namespace, name) = self.agent.get(&(addr, proto.clone())).or_else(|| {
            if frontend.kind == "NodePort" {
                self.by_node_port.get(&(addr.port(), proto))
            } else {
                self.by_address.get(&(addr.ip(), addr.port(), proto))
            }
        })?;
        let service_type = self.types.get(&(namespace.clone(), name.clone())).cloned();
        Some(ServiceRef { namespace: namespace.clone(), name: name.clone(), service_type })
    }
}

/// Names what it can; says why when there was nothing to name frontends with.
pub fn name_frontends(report: &mut ServicesReport, names: &ServiceNames, why_none: impl FnOnce() -> String) {
    if names.is_empty() && !report.frontends.is_empty() {
        report.names_unavailable = Some(why_none());
    }
    for frontend in &mut report.frontends {
        frontend.service = names.of(frontend);
    }
}

pub fn collect(pin_dir: &Path, state_dir: &Path) -> Result<ServicesReport> {
    let mut report = collect_maps(pin_dir)?;
    let agent = crate::status_socket::request(state_dir, "frontends");
    let checkpoint = crate::k8s::checkpoint::read(state_dir);
    let mut names = ServiceNames::default();
    if let Some(listed) = agent.as_ref().ok().and_then(|page| serde_json::from_str(page).ok()) {
        names = names.from_agent(listed);
    }
    if let Ok(saved) = &checkpoint {
        let services: Vec<_> = saved.services.iter().map(|service| service.decode()).collect();
        names = names.from_checkpoint(&services);
    }
    name_frontends(&mut report, &names, || {
        let agent = agent.err().map_or_else(|| "the agent lists no frontends".to_string(), |e| format!("{e:#}"));
        let checkpoint = checkpoint.err().map_or_else(|| "it holds no Service".to_string(), |e| e.to_string());
        format!("{agent}; {checkpoint}")
    });
    Ok(report)
}

/// The frontends, backends and counters the pinned maps hold.
fn collect_maps(pin_dir: &Path) -> Result<ServicesReport> {
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
            let service = match &f.service {
                Some(s) => match &s.service_type {
                    Some(t) => format!("{}/{} ({t})", s.namespace, s.name),
                    None => format!("{}/{}", s.namespace, s.name),
                },
                None => "-".to_string(),
            };
            out.push_str(&format!(
                "{} {} {service} id={} {}{} scheduler={} backends=[{}] conns={} in={}p/{}B out={}p/{}B\n",
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
        if let Some(why) = &self.names_unavailable {
            out.push_str(&format!("(no Service names: {why})\n"));
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

    fn frontend(kind: &'static str, address: &str, protocol: &str) -> Frontend {
        Frontend {
            service_id: 1,
            service: None,
            kind,
            address: address.parse().unwrap(),
            protocol: protocol.into(),
            flags: Vec::new(),
            scheduler: "random",
            backends: Vec::new(),
            counters: Counters::default(),
        }
    }

    #[test]
    fn frontends_are_named_by_the_agent_first_then_by_the_checkpoints_services() {
        let services: Vec<Service> = serde_json::from_value(serde_json::json!([
            {"metadata": {"namespace": "shop", "name": "web"},
             "spec": {"type": "LoadBalancer", "clusterIP": "10.96.0.10", "externalIPs": ["192.0.2.7"],
                      "ports": [{"port": 80, "nodePort": 30080}, {"port": 53, "protocol": "UDP"}]},
             "status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.1"}]}}},
            {"metadata": {"namespace": "kube-system", "name": "dns"}, "spec": {"clusterIP": "10.96.0.53",
                      "ports": [{"port": 53, "protocol": "UDP"}]}}
        ]))
        .unwrap();
        let mut report = ServicesReport {
            frontends: vec![
                frontend("ClusterIP", "10.96.0.10:80", "tcp"),
                frontend("External", "198.51.100.1:80", "tcp"),
                frontend("NodePort", "10.0.1.1:30080", "tcp"),
                frontend("ClusterIP", "10.96.0.10:53", "udp"),
                frontend("ClusterIP", "10.96.0.53:53", "udp"),
                frontend("ClusterIP", "10.96.0.10:443", "tcp"),
            ],
            ..Default::default()
        };
        // The agent renamed dns (its catalog is newer than the checkpoint).
        let agent = vec![crate::kr_metrics::NamedFrontend {
            address: "10.96.0.53:53".parse().unwrap(),
            protocol: "udp".into(),
            namespace: "kube-system".into(),
            name: "coredns".into(),
        }];
        let names = ServiceNames::default().from_agent(agent).from_checkpoint(&services);
        name_frontends(&mut report, &names, || unreachable!("there are names"));
        let named: Vec<Option<String>> = report
            .frontends
            .iter()
            .map(|f| f.service.as_ref().map(|s| format!("{}/{} {:?}", s.namespace, s.name, s.service_type)))
            .collect();
        let web = Some("shop/web Some(\"LoadBalancer\")".to_string());
        assert_eq!(
            named,
            [web.clone(), web.clone(), web.clone(), web, Some("kube-system/coredns None".to_string()), None,]
        );
        assert!(report.names_unavailable.is_none());
        let json = serde_json::to_value(&report.frontends[0]).unwrap();
        assert_eq!(json["service"], serde_json::json!({"namespace": "shop", "name": "web", "type": "LoadBalancer"}));
        let text = super::super::Report::render_text(&report);
        assert!(text.starts_with("tcp 10.96.0.10:80 shop/web (LoadBalancer) id=1 ClusterIP "), "{text}");

        let mut unnamed =
            ServicesReport { frontends: vec![frontend("ClusterIP", "10.96.0.10:80", "tcp")], ..Default::default() };
        name_frontends(&mut unnamed, &ServiceNames::default(), || "no agent; no checkpoint".into());
        assert_eq!(unnamed.names_unavailable.as_deref(), Some("no agent; no checkpoint"));
        assert!(super::super::Report::render_text(&unnamed).contains(" 10.96.0.10:80 - id=1 "));
    }
}
