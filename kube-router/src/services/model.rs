//! The desired-state model of services and their endpoints, independent of both the Kubernetes
//! object shapes and the map layout.
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::IpAddr,
    sync::Arc,
};

use super::family::{AddressFamily, IpFamily};
use super::node_addresses::ClaimedAddresses;

use serde::{Deserialize, Serialize};

/// Shared text: a Service's name is a key of the catalog, of each of its slices, of the
/// compilers' plans, claims and entries and of every backend set (ten copies and more), and
/// a copy is a reference count, not two strings.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceName {
    pub namespace: Arc<str>,
    pub name: Arc<str>,
}

/// As `{"namespace": .., "name": ..}`, as when both were `String`s.
#[derive(Serialize, Deserialize)]
#[serde(rename = "ServiceName")]
struct ServiceNameText<S> {
    namespace: S,
    name: S,
}

impl Serialize for ServiceName {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        ServiceNameText { namespace: &*self.namespace, name: &*self.name }.serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for ServiceName {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = ServiceNameText::<String>::deserialize(deserializer)?;
        Ok(ServiceName::new(text.namespace, text.name))
    }
}

impl ServiceName {
    pub fn new(namespace: impl AsRef<str>, name: impl AsRef<str>) -> Self {
        Self { namespace: namespace.as_ref().into(), name: name.as_ref().into() }
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
    /// Of either family (`spec.clusterIPs`).
    pub cluster_ips: Vec<IpAddr>,
    pub external_ips: Vec<IpAddr>,
    pub load_balancer_ips: Vec<IpAddr>,
    /// The families the Service is load-balanced in: those of its ClusterIPs (else
    /// `spec.ipFamilies`). Empty (a state written before dual-stack): IPv4.
    #[serde(default)]
    pub ip_families: Vec<IpFamily>,
    pub ports: Vec<ServicePort>,
    /// ClientIP session affinity timeout, if enabled.
    pub affinity_timeout_secs: Option<u32>,
    /// externalTrafficPolicy: Local (NodePort, ExternalIP and LoadBalancer frontends).
    pub external_traffic_local: bool,
    /// internalTrafficPolicy: Local (ClusterIP frontends).
    pub internal_traffic_local: bool,
    /// publishNotReadyAddresses: every endpoint counts as ready.
    pub publish_not_ready: bool,
    /// `kube-router.io/service.hairpin`: a backend may reach itself through the service.
    #[serde(default)]
    pub hairpin: bool,
    /// `kube-router.io/service.hairpin.externalips`: with `hairpin`, the externalIPs and
    /// LoadBalancer IPs hairpin too (`hairpin` alone: the ClusterIPs and NodePorts, as upstream).
    #[serde(default)]
    pub hairpin_external_ips: bool,
    /// `spec.healthCheckNodePort` (externalTrafficPolicy Local): where the node answers load
    /// balancers' health checks with its count of local ready endpoints.
    #[serde(default)]
    pub health_check_node_port: Option<u16>,
    /// `loadBalancerSourceRanges` (or the legacy annotation), prefixes of either family: new
    /// flows to the LoadBalancer IPs only from these. A family with no prefix among them gets
    /// no source at all. `None`: open.
    #[serde(default)]
    pub source_ranges: Option<Vec<ipnet::IpNet>>,
    /// `kube-router.io/service.scheduler: mh`: Maglev consistent hashing instead of a random
    /// backend; `Some(true)` with `kube-router.io/service.schedflags: mh-port` (the source port
    /// is hashed too).
    #[serde(default)]
    pub maglev: Option<bool>,
    /// `kube-router.io/service.dsr: tunnel`: direct server return for the ExternalIPs and
    /// LoadBalancer IPs (IPIP or IPv6-in-IPv6 to the backend's node, which answers the client
    /// directly), and for the NodePorts.
    #[serde(default)]
    pub dsr: bool,
    /// `kube-router.io/service.advertise.<kind>`: this Service's word on which of its addresses
    /// the BGP speaker advertises (`services::vips`).
    #[serde(default)]
    pub advertise: AdvertiseAnnotations,
}

/// A Service's `kube-router.io/service.advertise.{clusterip,externalip,loadbalancerip}`
/// annotations: `Some(false)` keeps that kind of address from BGP, `Some(true)` asks for it
/// (granted with `--service-advertise-annotations-override`), `None` leaves it to the flags.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdvertiseAnnotations {
    pub cluster_ip: Option<bool>,
    pub external_ip: Option<bool>,
    pub load_balancer_ip: Option<bool>,
}

impl Service {
    /// A Service with these ClusterIPs and ports and every other field at its Kubernetes
    /// default (no affinity, Cluster traffic policies, no external addresses).
    pub fn cluster_ip(name: ServiceName, cluster_ips: Vec<IpAddr>, ports: Vec<ServicePort>) -> Service {
        Service {
            name,
            cluster_ips,
            external_ips: vec![],
            load_balancer_ips: vec![],
            ip_families: vec![],
            ports,
            affinity_timeout_secs: None,
            external_traffic_local: false,
            internal_traffic_local: false,
            publish_not_ready: false,
            hairpin: false,
            hairpin_external_ips: false,
            health_check_node_port: None,
            source_ranges: None,
            maglev: None,
            dsr: false,
            advertise: AdvertiseAnnotations::default(),
        }
    }

    /// Whether the Service has frontends in `family`.
    pub fn serves(&self, family: IpFamily) -> bool {
        if self.ip_families.is_empty() {
            family == IpFamily::IPv4
        } else {
            self.ip_families.contains(&family)
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointPort {
    pub name: String,
    pub protocol: Protocol,
    pub port: u16,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Endpoint {
    /// The slice's address type: an IPv6 slice's endpoints only back IPv6 frontends.
    pub addr: IpAddr,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    /// Shared with every endpoint on that node (`k8s::intern`): 100,000 endpoints name a few
    /// thousand nodes, and a `String` each was 3 MiB of the catalog (issue 29).
    #[serde(default, with = "optional_shared_text")]
    pub node_name: Option<Arc<str>>,
    /// `hints.forZones` (topology-aware routing, `trafficDistribution: PreferClose`); `None`
    /// without hints.
    #[serde(default)]
    pub zone_hints: Option<Vec<String>>,
}

/// An `Option<Arc<str>>` as the optional string it is (serde's `rc` feature is not on).
mod optional_shared_text {
    use std::sync::Arc;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(text: &Option<Arc<str>>, serializer: S) -> Result<S::Ok, S::Error> {
        text.as_deref().serialize(serializer)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<Arc<str>>, D::Error> {
        Ok(Option::<String>::deserialize(deserializer)?.map(Arc::from))
    }
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

impl ServiceState {
    /// The Services with one of `addresses` as an externalIP or LoadBalancer IP: the only ones
    /// a change of the cluster's claimed addresses can judge differently.
    pub fn naming(&self, addresses: &BTreeSet<IpAddr>) -> BTreeSet<ServiceName> {
        if addresses.is_empty() {
            return BTreeSet::new();
        }
        let named = |ip: &IpAddr| addresses.contains(&ip.to_canonical()) || addresses.contains(ip);
        let services = self.services.iter();
        services
            .filter(|(_, service)| service.external_ips.iter().chain(&service.load_balancer_ips).any(named))
            .map(|(name, _)| name.clone())
            .collect()
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RejectedService {
    pub reason: String,
    /// Frontend addresses we could still read from the object: their map entries are protected.
    pub addrs: Vec<IpAddr>,
    pub node_ports: Vec<u16>,
}

/// Facts about the node the agent runs on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeContext {
    pub name: String,
    /// Addresses NodePort frontends listen on, of both families.
    pub node_port_addrs: Vec<IpAddr>,
    /// Families the node has no address in: their Services are not programmed (and said so).
    pub unavailable_families: BTreeSet<IpFamily>,
    /// `--hairpin-mode`: every service lets its backends reach themselves through it.
    pub hairpin_all: bool,
    /// Which externalIPs and LoadBalancer IPs may be programmed.
    pub external_ips: ExternalIpPolicy,
    /// The node's `topology.kubernetes.io/zone` label: endpoints hinted for it are preferred.
    pub zone: Option<String>,
    /// Also give every NodePort a wildcard frontend (0.0.0.0, ::): the socket load balancer matches
    /// loopback destinations in the node's namespace against it (`localhost:<nodePort>`).
    pub loopback_node_ports: bool,
    /// `--bpf-lb-algorithm maglev`: every Service without a scheduler annotation uses Maglev
    /// over the client's address and port.
    pub maglev_all: bool,
}

impl NodeContext {
    /// The addresses that became or stopped being claimed by the cluster from `self` to `now`,
    /// when nothing else of the node changed (`None`: something else did).
    pub fn claimed_moved(&self, now: &Self) -> Option<BTreeSet<IpAddr>> {
        let NodeContext {
            name,
            node_port_addrs,
            unavailable_families,
            hairpin_all,
            external_ips,
            zone,
            loopback_node_ports,
            maglev_all,
        } = self;
        let rest_same = *name == now.name
            && *node_port_addrs == now.node_port_addrs
            && *unavailable_families == now.unavailable_families
            && *hairpin_all == now.hairpin_all
            && *zone == now.zone
            && *loopback_node_ports == now.loopback_node_ports
            && *maglev_all == now.maglev_all;
        rest_same.then(|| external_ips.claimed_moved(&now.external_ips)).flatten()
    }

    /// The addresses of `F` a NodePort gets a frontend on.
    pub fn node_port_frontend_addrs<F: AddressFamily>(&self) -> impl Iterator<Item = F::Addr> + '_ {
        let wildcard = self.loopback_node_ports.then_some(F::UNSPECIFIED);
        self.node_port_addrs.iter().filter_map(|a| F::addr_of(*a)).chain(wildcard)
    }
}

/// kube-router's external IP validation (the CVE-2020-8554 class): a Service must not capture
/// traffic for addresses it does not own. The service proxy and the BGP speaker both ask
/// [`Self::refusal`]: an address the datapath refuses is never advertised either.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExternalIpPolicy {
    /// `--service-external-ip-range`: externalIPs must be inside one of these.
    pub external_ip_ranges: Vec<ipnet::IpNet>,
    /// `--strict-external-ip-validation`: with no `--service-external-ip-range`, no externalIP
    /// is accepted, with no `--loadbalancer-ip-range` no LoadBalancer IP (without it, any
    /// address the other checks let through is).
    pub strict: bool,
    /// `--loadbalancer-ip-range`: LoadBalancer ingress IPs must be inside one of these (none:
    /// `strict` decides).
    pub load_balancer_ranges: Vec<ipnet::IpNet>,
    /// The cluster's own ranges (pod CIDRs, Service range): never an externalIP or LoadBalancer IP.
    pub forbidden: Vec<ipnet::IpNet>,
    /// This node's addresses (its interfaces), and any given with [`Self::with_cluster_addresses`].
    pub node_addresses: BTreeSet<IpAddr>,
    /// Every Node object's InternalIP/ExternalIP, shared with the index that follows them
    /// ([`super::node_addresses::NodeAddressIndex`]): a copy of the policy costs a pointer.
    pub cluster_node_addresses: ClaimedAddresses,
    /// The API server's addresses (the agent's own kubeconfig/--master, the endpoints of
    /// `default/kubernetes`): a Service on them would cut every node off the API.
    pub api_server_addresses: BTreeSet<IpAddr>,
}

/// Why an externalIP or LoadBalancer IP is refused: `reason` is the metric label.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ExternalIpRefusal {
    pub reason: &'static str,
    pub message: String,
}

impl ExternalIpPolicy {
    /// The addresses that became or stopped being claimed by the cluster (a node's, the API
    /// server's) from `self` to `now`; `None` when the rest of the policy changed too.
    pub fn claimed_moved(&self, now: &Self) -> Option<BTreeSet<IpAddr>> {
        let ExternalIpPolicy {
            external_ip_ranges,
            strict,
            load_balancer_ranges,
            forbidden,
            node_addresses,
            cluster_node_addresses,
            api_server_addresses,
        } = self;
        let rest_same = *external_ip_ranges == now.external_ip_ranges
            && *strict == now.strict
            && *load_balancer_ranges == now.load_balancer_ranges
            && *forbidden == now.forbidden;
        rest_same.then(|| {
            let own = node_addresses.symmetric_difference(&now.node_addresses);
            let api_server = api_server_addresses.symmetric_difference(&now.api_server_addresses);
            let cluster = cluster_node_addresses.symmetric_difference(&now.cluster_node_addresses);
            // An address may move from one source to another and stay claimed.
            own.chain(api_server).chain(cluster).filter(|ip| self.claims(ip) != now.claims(ip)).copied().collect()
        })
    }

    /// A node's or the API server's address.
    fn claims(&self, ip: &IpAddr) -> bool {
        self.node_addresses.contains(ip)
            || self.cluster_node_addresses.contains(ip)
            || self.api_server_addresses.contains(ip)
    }

    /// This policy with every Node object's addresses, shared.
    pub fn with_cluster_node_addresses(&self, nodes: &ClaimedAddresses) -> Self {
        Self { cluster_node_addresses: nodes.clone(), ..self.clone() }
    }

    /// This policy with the cluster's own addresses added: `nodes` (every Node's), `api_server`
    /// (the endpoints of `default/kubernetes`).
    pub fn with_cluster_addresses(
        &self,
        nodes: impl IntoIterator<Item = IpAddr>,
        api_server: impl IntoIterator<Item = IpAddr>,
    ) -> Self {
        let mut policy = self.clone();
        policy.node_addresses.extend(nodes.into_iter().map(|a| a.to_canonical()));
        policy.api_server_addresses.extend(api_server.into_iter().map(|a| a.to_canonical()));
        policy
    }

    /// Why `ip` may not be programmed (or advertised) as an externalIP (`load_balancer`: as a
    /// LoadBalancer ingress IP), if not.
    pub fn refusal(&self, ip: IpAddr, load_balancer: bool) -> Option<ExternalIpRefusal> {
        // `::ffff:a.b.c.d` is judged as the IPv4 address it carries.
        let ip = ip.to_canonical();
        let refuse = |reason: &'static str, message: String| Some(ExternalIpRefusal { reason, message });
        let link_local = match ip {
            IpAddr::V4(v4) => v4.is_link_local(),
            IpAddr::V6(v6) => v6.is_unicast_link_local(),
        };
        if ip.is_unspecified() {
            return refuse("unspecified", format!("{ip} is the unspecified address"));
        }
        if ip.is_loopback() {
            return refuse("loopback", format!("{ip} is a loopback address"));
        }
        if ip.is_multicast() || ip == IpAddr::V4(std::net::Ipv4Addr::BROADCAST) {
            return refuse("multicast", format!("{ip} is a multicast or broadcast address"));
        }
        if link_local {
            return refuse("link-local", format!("{ip} is link-local (169.254.0.0/16, fe80::/10: cloud metadata)"));
        }
        if self.api_server_addresses.contains(&ip) {
            return refuse("api-server", format!("{ip} is an address of the API server"));
        }
        if self.node_addresses.contains(&ip) || self.cluster_node_addresses.contains(&ip) {
            return refuse("node-address", format!("{ip} is a node's address"));
        }
        if let Some(net) = self.forbidden.iter().find(|net| net.contains(&ip)) {
            return refuse("cluster-range", format!("{ip} is inside the cluster's own range {net}"));
        }
        let (ranges, flag) = if load_balancer {
            (&self.load_balancer_ranges, "--loadbalancer-ip-range")
        } else {
            (&self.external_ip_ranges, "--service-external-ip-range")
        };
        if ranges.is_empty() {
            // kube-router 2.8: strict validation without a range refuses every address, for
            // LoadBalancer IPs as for externalIPs (a tenant able to write status could otherwise
            // claim any address).
            if self.strict {
                return refuse(
                    "no-allowed-range",
                    format!("{ip}: no {flag} is configured and --strict-external-ip-validation is on"),
                );
            }
        } else if !ranges.iter().any(|net| net.contains(&ip)) {
            return refuse("outside-range", format!("{ip} is outside {flag}"));
        }
        None
    }
}
