//! The desired-state model of services and their endpoints, independent of both the Kubernetes
//! object shapes and the map layout.
use std::{collections::BTreeMap, fmt, net::Ipv4Addr};

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ServiceName {
    pub namespace: String,
    pub name: String,
}

impl ServiceName {
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        Self { namespace: namespace.into(), name: name.into() }
    }
}

impl fmt::Display for ServiceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Protocol {
    Tcp,
    Udp,
}

impl Protocol {
    pub fn ip_proto(self) -> u8 {
        match self {
            Protocol::Tcp => kube_router_common::IPPROTO_TCP,
            Protocol::Udp => kube_router_common::IPPROTO_UDP,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServicePort {
    /// Matches the EndpointSlice port of the same name ("" for an unnamed single port).
    pub name: String,
    pub protocol: Protocol,
    pub port: u16,
    pub node_port: Option<u16>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Service {
    pub name: ServiceName,
    pub cluster_ips: Vec<Ipv4Addr>,
    pub external_ips: Vec<Ipv4Addr>,
    pub load_balancer_ips: Vec<Ipv4Addr>,
    pub ports: Vec<ServicePort>,
    /// ClientIP session affinity timeout, if enabled.
    pub affinity_timeout_secs: Option<u32>,
    /// externalTrafficPolicy: Local (NodePort, ExternalIP and LoadBalancer frontends).
    pub external_traffic_local: bool,
    /// internalTrafficPolicy: Local (ClusterIP frontends).
    pub internal_traffic_local: bool,
    /// publishNotReadyAddresses: every endpoint counts as ready.
    pub publish_not_ready: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointPort {
    pub name: String,
    pub protocol: Protocol,
    pub port: u16,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Endpoint {
    pub addr: Ipv4Addr,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    pub node_name: Option<String>,
}

/// One EndpointSlice, reduced to what load-balancing needs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointSlice {
    pub service: ServiceName,
    pub ports: Vec<EndpointPort>,
    pub endpoints: Vec<Endpoint>,
}

/// An EndpointSlice's identity: (namespace, slice name).
pub type SliceKey = (String, String);

/// Everything the service compiler needs. Slices are keyed by [`SliceKey`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceState {
    pub services: BTreeMap<ServiceName, Service>,
    pub slices: BTreeMap<SliceKey, EndpointSlice>,
    /// Services whose object could not be understood, with the reason. Their frontends already
    /// in the maps are left exactly as they are.
    pub rejected: BTreeMap<ServiceName, RejectedService>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RejectedService {
    pub reason: String,
    /// Frontend addresses we could still read from the object: their map entries are protected.
    pub addrs: Vec<Ipv4Addr>,
    pub node_ports: Vec<u16>,
}

/// Facts about the node the agent runs on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeContext {
    pub name: String,
    /// Addresses NodePort frontends listen on.
    pub node_port_addrs: Vec<Ipv4Addr>,
    /// Also give every NodePort a wildcard frontend (0.0.0.0): the socket load balancer matches
    /// loopback destinations in the node's namespace against it (`localhost:<nodePort>`).
    pub loopback_node_ports: bool,
}

impl NodeContext {
    /// The addresses a NodePort gets a frontend on.
    pub fn node_port_frontend_addrs(&self) -> impl Iterator<Item = Ipv4Addr> + '_ {
        let wildcard = self.loopback_node_ports.then_some(Ipv4Addr::UNSPECIFIED);
        self.node_port_addrs.iter().copied().chain(wildcard)
    }
}
