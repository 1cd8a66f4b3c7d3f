//! Kubernetes Service / EndpointSlice objects -> the service model, with validation.
use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr},
    str::FromStr,
};

use k8s_openapi::api::{core::v1 as core, discovery::v1 as discovery};
use thiserror::Error;

use super::{family::IpFamily, model::*};

pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// A Node's zone (declared by the API layer, which keeps it on slimmed Nodes).
pub use crate::k8s::TOPOLOGY_ZONE_LABEL;
/// kube-router's per-Service hairpin switch (its presence turns hairpin on).
pub const HAIRPIN_ANNOTATION: &str = "kube-router.io/service.hairpin";
/// With it, hairpin for the externalIPs (and LoadBalancer IPs) too (presence).
pub const HAIRPIN_EXTERNAL_IPS_ANNOTATION: &str = "kube-router.io/service.hairpin.externalips";
/// The pre-1.x form of `spec.loadBalancerSourceRanges`, still read by kube-proxy.
pub const SOURCE_RANGES_ANNOTATION: &str = "service.beta.kubernetes.io/load-balancer-source-ranges";
/// kube-router's IPVS scheduler annotation; `mh` (Maglev hashing) and `sh` (source hashing, as
/// Maglev on the client address) are honoured, IPVS's other schedulers mean the default choice
/// here (docs/annotations.md), any other value is reported as a warning.
pub const SCHEDULER_ANNOTATION: &str = "kube-router.io/service.scheduler";
/// IPVS's scheduler names that upstream passes through; served by the default choice here.
const IPVS_SCHEDULERS: &[&str] =
    &["rr", "wrr", "lc", "wlc", "lblc", "lblcr", "dh", "sh", "sed", "nq", "fo", "ovf", "twos"];
/// kube-router's "force Local traffic policy" switch: `"true"` acts as externalTrafficPolicy Local.
pub const LOCAL_ANNOTATION: &str = "kube-router.io/service.local";
/// kube-router's switch (its presence) to leave a Service's LoadBalancer IPs unserved.
pub const SKIP_LB_IPS_ANNOTATION: &str = "kube-router.io/service.skiplbips";
pub const SCHEDFLAGS_ANNOTATION: &str = "kube-router.io/service.schedflags";
/// kube-router's direct server return annotation; `tunnel` (IPIP) is the one mode.
pub const DSR_ANNOTATION: &str = "kube-router.io/service.dsr";
/// kube-router's per-Service BGP switches: `<prefix><kind>: "true" | "false"`, kind one of
/// `clusterip`, `externalip`, `loadbalancerip`.
pub const ADVERTISE_ANNOTATION_PREFIX: &str = "kube-router.io/service.advertise.";
const DEFAULT_AFFINITY_TIMEOUT_SECS: u32 = 10_800;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum ObjectError {
    #[error("object has no namespace or name")]
    MissingName,
    #[error("port {port}: unsupported protocol {protocol:?} (TCP and UDP are load-balanced)")]
    UnsupportedProtocol { port: i32, protocol: String },
    #[error("duplicate port {port}/{protocol:?}")]
    DuplicatePort { port: u16, protocol: Protocol },
    #[error("duplicate port name {0:?}")]
    DuplicatePortName(String),
    #[error("port {0} is out of range 1-65535")]
    PortOutOfRange(i32),
    #[error("invalid IP address {0:?}")]
    InvalidAddress(String),
    #[error("EndpointSlice has no {SERVICE_NAME_LABEL} label")]
    MissingServiceLabel,
}

/// What the converter made of one Service object.
pub enum ServiceOutcome {
    /// The Service, and what of it was left out (a port of an unsupported protocol, an
    /// unreadable external address): the rest is programmed.
    Service(Service, Vec<String>),
    /// Headless or ExternalName: nothing to load-balance.
    NotLoadBalanced,
    Rejected(ServiceName, RejectedService),
}

fn name_of(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> Result<ServiceName, ObjectError> {
    match (&meta.namespace, &meta.name) {
        (Some(ns), Some(name)) if !ns.is_empty() && !name.is_empty() => Ok(ServiceName::new(ns, name)),
        _ => Err(ObjectError::MissingName),
    }
}

fn port_number(port: i32) -> Result<u16, ObjectError> {
    u16::try_from(port).ok().filter(|p| *p != 0).ok_or(ObjectError::PortOutOfRange(port))
}

fn protocol(protocol: Option<&str>, port: i32) -> Result<Protocol, ObjectError> {
    match protocol.unwrap_or("TCP") {
        "TCP" => Ok(Protocol::Tcp),
        "UDP" => Ok(Protocol::Udp),
        other => Err(ObjectError::UnsupportedProtocol { port, protocol: other.to_string() }),
    }
}

/// The label that hands a Service to another proxy (kube-proxy skips such Services).
pub const SERVICE_PROXY_NAME_LABEL: &str = "service.kubernetes.io/service-proxy-name";

/// A Node's InternalIP and ExternalIP addresses (both families): no Service may claim them.
pub fn node_object_addresses(node: &core::Node) -> impl Iterator<Item = IpAddr> + '_ {
    node.status
        .as_ref()
        .and_then(|s| s.addresses.as_ref())
        .into_iter()
        .flatten()
        .filter(|a| a.type_ == "InternalIP" || a.type_ == "ExternalIP")
        .filter_map(|a| a.address.parse().ok())
}

/// Every endpoint address of `slices` (the API server's: the slices of `default/kubernetes`).
pub fn endpoint_addresses(slices: &[discovery::EndpointSlice]) -> Vec<IpAddr> {
    slices.iter().flat_map(|s| &s.endpoints).flat_map(|e| &e.addresses).filter_map(|a| a.parse().ok()).collect()
}

/// An address as the API server accepts it, of either family: also the legacy IPv4 form with
/// leading zeros (`010.000.010.002`), which old API servers stored and which means the decimal
/// value (as Go's parser read it before 1.17).
pub fn parse_ip(addr: &str) -> Result<IpAddr, ObjectError> {
    if let Ok(ip) = IpAddr::from_str(addr) {
        return Ok(ip);
    }
    let octets: Vec<u8> = addr
        .split('.')
        .map(|part| {
            let digits = !part.is_empty() && part.len() <= 3 && part.bytes().all(|b| b.is_ascii_digit());
            if digits {
                part.parse::<u8>().ok()
            } else {
                None
            }
        })
        .collect::<Option<_>>()
        .ok_or_else(|| ObjectError::InvalidAddress(addr.to_string()))?;
    match octets[..] {
        [a, b, c, d] => Ok(IpAddr::V4(Ipv4Addr::new(a, b, c, d))),
        _ => Err(ObjectError::InvalidAddress(addr.to_string())),
    }
}

fn ip_addrs<'a>(addrs: impl IntoIterator<Item = &'a String>) -> Result<Vec<IpAddr>, ObjectError> {
    addrs.into_iter().map(|a| parse_ip(a)).collect()
}

/// Like [`ip_addrs`], but an unreadable address is skipped (and reported in `skipped`)
/// instead of failing the list: one bad entry must not take the rest with it.
fn ip_addrs_lenient<'a>(addrs: impl IntoIterator<Item = &'a String>, skipped: &mut Vec<String>) -> Vec<IpAddr> {
    let mut out = Vec::new();
    for addr in addrs {
        match parse_ip(addr) {
            Ok(ip) => out.push(ip),
            Err(e) => skipped.push(e.to_string()),
        }
    }
    out
}

/// The families a Service is load-balanced in, as kube-proxy's per-family proxiers decide: a
/// family in which it has a ClusterIP. Without an assigned ClusterIP (objects the API server
/// would not serve), `spec.ipFamilies`, else IPv4. `ipFamilyPolicy: SingleStack` keeps the first.
fn served_families(spec: &core::ServiceSpec, cluster_ips: &[IpAddr]) -> Vec<IpFamily> {
    let listed: Vec<IpFamily> = if cluster_ips.is_empty() {
        let named: Vec<IpFamily> = spec.ip_families.iter().flatten().filter_map(|f| IpFamily::from_k8s(f)).collect();
        if named.is_empty() {
            vec![IpFamily::IPv4]
        } else {
            named
        }
    } else {
        cluster_ips.iter().map(IpFamily::of).collect()
    };
    let mut families: Vec<IpFamily> = Vec::new();
    for family in listed {
        if !families.contains(&family) {
            families.push(family);
        }
    }
    if spec.ip_family_policy.as_deref() == Some("SingleStack") {
        families.truncate(1);
    }
    families
}

pub fn service(object: &core::Service) -> Result<ServiceOutcome, ObjectError> {
    let name = name_of(&object.metadata)?;
    let Some(spec) = &object.spec else { return Ok(ServiceOutcome::NotLoadBalanced) };
    let service_type = spec.type_.as_deref().unwrap_or("ClusterIP");
    if service_type == "ExternalName" {
        return Ok(ServiceOutcome::NotLoadBalanced);
    }
    // Meant for another proxy, as kube-proxy reads the label.
    let labels = object.metadata.labels.as_ref();
    if labels.and_then(|l| l.get(SERVICE_PROXY_NAME_LABEL)).is_some_and(|v| !v.is_empty()) {
        return Ok(ServiceOutcome::NotLoadBalanced);
    }
    // Whatever else is wrong, remember which frontends the object names so they stay programmed.
    let readable_addrs =
        |v: Option<&Vec<String>>| -> Vec<IpAddr> { v.into_iter().flatten().filter_map(|a| parse_ip(a).ok()).collect() };
    let cluster_ip_strings: Vec<String> = match (&spec.cluster_ips, &spec.cluster_ip) {
        (Some(ips), _) if !ips.is_empty() => ips.clone(),
        (_, Some(ip)) => vec![ip.clone()],
        _ => vec![],
    };
    let lb_strings: Vec<String> = object
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref())
        .into_iter()
        .flatten()
        // ipMode Proxy: the load balancer proxies, so traffic for its address must go to it.
        .filter(|i| i.ip_mode.as_deref() != Some("Proxy"))
        .filter_map(|i| i.ip.clone())
        .collect();
    let annotations = object.metadata.annotations.as_ref();
    let annotation = |key: &str| annotations.and_then(|a| a.get(key)).map(|v| v.trim());
    // skiplbips: the LoadBalancer IPs are someone else's to serve; not even claimed on rejection.
    let lb_strings = if annotation(SKIP_LB_IPS_ANNOTATION).is_some() { Vec::new() } else { lb_strings };
    let reject = |reason: ObjectError| {
        let mut addrs = readable_addrs(Some(&cluster_ip_strings));
        addrs.extend(readable_addrs(spec.external_ips.as_ref()));
        addrs.extend(readable_addrs(Some(&lb_strings)));
        let node_ports =
            spec.ports.iter().flatten().filter_map(|p| p.node_port.and_then(|n| u16::try_from(n).ok())).collect();
        Ok(ServiceOutcome::Rejected(name.clone(), RejectedService { reason: reason.to_string(), addrs, node_ports }))
    };

    // Headless: no proxying at all, externalIPs included (kube-proxy ignores the Service).
    if cluster_ip_strings.iter().any(|ip| ip == "None") {
        return Ok(ServiceOutcome::NotLoadBalanced);
    }
    let assigned: Vec<&String> = cluster_ip_strings.iter().filter(|ip| !ip.is_empty()).collect();
    let mut cluster_ips = match ip_addrs(assigned.iter().copied()) {
        Ok(ips) => ips,
        Err(e) => return reject(e),
    };
    let ip_families = served_families(spec, &cluster_ips);
    cluster_ips.retain(|ip| ip_families.contains(&IpFamily::of(ip)));
    let mut warnings = Vec::new();
    // Addresses of a family the Service is not load-balanced in are ignored, as kube-proxy does.
    let mut served = |ips: Vec<IpAddr>, what: &str| -> Vec<IpAddr> {
        let (kept, ignored): (Vec<IpAddr>, Vec<IpAddr>) =
            ips.into_iter().partition(|ip| ip_families.contains(&IpFamily::of(ip)));
        for ip in ignored {
            warnings.push(format!("{what} {ip} is of a family the Service does not have; ignored"));
        }
        kept
    };
    let mut unreadable = Vec::new();
    let external_ips = served(ip_addrs_lenient(spec.external_ips.iter().flatten(), &mut unreadable), "externalIP");
    let load_balancer_ips = served(ip_addrs_lenient(lb_strings.iter(), &mut unreadable), "LoadBalancer IP");
    warnings.extend(unreadable);

    let mut ports = Vec::new();
    let mut seen_ports = BTreeSet::new();
    let mut seen_names = BTreeSet::new();
    for port in spec.ports.iter().flatten() {
        // A port we cannot serve (SCTP, out of range) is left out; the others are programmed.
        let usable = protocol(port.protocol.as_deref(), port.port).and_then(|p| Ok((p, port_number(port.port)?)));
        let (protocol, number) = match usable {
            Ok(usable) => usable,
            Err(e) => {
                warnings.push(e.to_string());
                continue;
            }
        };
        let converted = (|| {
            let node_port = match port.node_port {
                Some(n) if n != 0 && service_type != "ClusterIP" => Some(port_number(n)?),
                _ => None,
            };
            let name = port.name.clone().unwrap_or_default();
            if !seen_ports.insert((number, protocol)) {
                return Err(ObjectError::DuplicatePort { port: number, protocol });
            }
            if !seen_names.insert(name.clone()) {
                return Err(ObjectError::DuplicatePortName(name));
            }
            Ok(ServicePort { name, protocol, port: number, node_port })
        })();
        match converted {
            Ok(p) => ports.push(p),
            Err(e) => return reject(e),
        }
    }

    let source_ranges = source_ranges(object, &mut warnings);
    if let Some(scheduler) = annotation(SCHEDULER_ANNOTATION) {
        if scheduler != "mh" && !IPVS_SCHEDULERS.contains(&scheduler) {
            warnings
                .push(format!("{SCHEDULER_ANNOTATION}: {scheduler:?} is not a known scheduler; served by the default"));
        }
    }
    let external_traffic_local =
        spec.external_traffic_policy.as_deref() == Some("Local") || annotation(LOCAL_ANNOTATION) == Some("true");
    let affinity_timeout_secs = (spec.session_affinity.as_deref() == Some("ClientIP")).then(|| {
        spec.session_affinity_config
            .as_ref()
            .and_then(|c| c.client_ip.as_ref())
            .and_then(|c| c.timeout_seconds)
            .and_then(|t| u32::try_from(t).ok())
            .unwrap_or(DEFAULT_AFFINITY_TIMEOUT_SECS)
    });
    let has_annotation = |key: &str| object.metadata.annotations.as_ref().is_some_and(|a| a.contains_key(key));
    Ok(ServiceOutcome::Service(
        Service {
            name,
            cluster_ips,
            external_ips,
            load_balancer_ips,
            ip_families,
            ports,
            affinity_timeout_secs,
            external_traffic_local,
            internal_traffic_local: spec.internal_traffic_policy.as_deref() == Some("Local"),
            publish_not_ready: spec.publish_not_ready_addresses.unwrap_or(false),
            hairpin: has_annotation(HAIRPIN_ANNOTATION),
            hairpin_external_ips: has_annotation(HAIRPIN_EXTERNAL_IPS_ANNOTATION),
            health_check_node_port: spec
                .health_check_node_port
                .filter(|_| spec.external_traffic_policy.as_deref() == Some("Local"))
                .and_then(|p| u16::try_from(p).ok())
                .filter(|p| *p != 0),
            source_ranges,
            maglev: maglev(object),
            dsr: dsr(object, &mut warnings),
            advertise: advertise_annotations(object),
        },
        warnings,
    ))
}

/// The Service's `kube-router.io/service.advertise.*` annotations; a value other than "true"
/// or "false" leaves that kind to the flags, as upstream reads them.
fn advertise_annotations(object: &core::Service) -> AdvertiseAnnotations {
    let annotations = object.metadata.annotations.as_ref();
    let switch = |kind: &str| match annotations?.get(&format!("{ADVERTISE_ANNOTATION_PREFIX}{kind}"))?.trim() {
        "true" => Some(true),
        "false" => Some(false),
        _ => None,
    };
    AdvertiseAnnotations {
        cluster_ip: switch("clusterip"),
        external_ip: switch("externalip"),
        load_balancer_ip: switch("loadbalancerip"),
    }
}

/// `Some(hash the port too)` for a Service scheduled by Maglev hashing (`mh`) or by source
/// hashing (`sh`): a Maglev table keyed on the client's address alone sends every connection
/// of one client to one backend, on every node. `mh-port` / `sh-port` hash the port too.
fn maglev(object: &core::Service) -> Option<bool> {
    let annotations = object.metadata.annotations.as_ref()?;
    let port_flag = match annotations.get(SCHEDULER_ANNOTATION).map(|s| s.trim()) {
        Some("mh") => "mh-port",
        Some("sh") => "sh-port",
        _ => return None,
    };
    let flags = annotations.get(SCHEDFLAGS_ANNOTATION).map(String::as_str).unwrap_or("");
    Some(flags.split(',').any(|f| f.trim() == port_flag))
}

/// Whether the Service asks for direct server return (`tunnel`); another value is reported in
/// `warnings` and the Service is served without it.
fn dsr(object: &core::Service, warnings: &mut Vec<String>) -> bool {
    let Some(value) = object.metadata.annotations.as_ref().and_then(|a| a.get(DSR_ANNOTATION)) else {
        return false;
    };
    if value.trim() == "tunnel" {
        return true;
    }
    warnings.push(format!("{DSR_ANNOTATION}: {value:?} is not supported (only \"tunnel\"); served without DSR"));
    false
}

/// `spec.loadBalancerSourceRanges`, else the legacy annotation (comma-separated), as kube-proxy
/// reads them. An unreadable entry is left out, which only narrows what is allowed.
fn source_ranges(object: &core::Service, warnings: &mut Vec<String>) -> Option<Vec<ipnet::IpNet>> {
    let spec = object.spec.as_ref()?;
    let listed: Vec<String> = match spec.load_balancer_source_ranges.as_ref().filter(|r| !r.is_empty()) {
        Some(ranges) => ranges.clone(),
        None => {
            let annotation = object.metadata.annotations.as_ref()?.get(SOURCE_RANGES_ANNOTATION)?;
            annotation.split(',').map(|r| r.trim().to_string()).filter(|r| !r.is_empty()).collect()
        }
    };
    if listed.is_empty() {
        return None;
    }
    let mut ranges = Vec::new();
    for range in &listed {
        match range.trim().parse::<ipnet::IpNet>() {
            Ok(net) => ranges.push(net.trunc()),
            Err(_) => warnings.push(format!("loadBalancerSourceRanges entry {range:?} is not a CIDR; left out")),
        }
    }
    ranges.sort();
    ranges.dedup();
    Some(ranges)
}

/// A converted EndpointSlice, with what of it was left out (an unreadable address, a port of an
/// unsupported protocol): kube-proxy skips the one endpoint or port, not the slice.
pub type ConvertedSlice = (SliceKey, EndpointSlice, Vec<String>);

/// Converts an EndpointSlice of address type IPv4 or IPv6; FQDN slices yield `Ok(None)`: not
/// load-balanced. An address not of the slice's type is left out like an unreadable one.
pub fn endpoint_slice(object: &discovery::EndpointSlice) -> Result<Option<ConvertedSlice>, ObjectError> {
    let slice_name = name_of(&object.metadata)?;
    let Some(family) = IpFamily::from_k8s(&object.address_type) else {
        return Ok(None);
    };
    let service_name = object
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(SERVICE_NAME_LABEL))
        .ok_or(ObjectError::MissingServiceLabel)?;
    let mut warnings = Vec::new();
    let mut ports = Vec::new();
    for port in object.ports.iter().flatten() {
        let Some(number) = port.port else { continue };
        match protocol(port.protocol.as_deref(), number).and_then(|p| Ok((p, port_number(number)?))) {
            Ok((protocol, port_number)) => {
                ports.push(EndpointPort { name: port.name.clone().unwrap_or_default(), protocol, port: port_number })
            }
            Err(e) => warnings.push(e.to_string()),
        }
    }
    let mut endpoints = Vec::new();
    for endpoint in &object.endpoints {
        let conditions = endpoint.conditions.clone().unwrap_or_default();
        // API defaults (and kube-proxy's reading): nil ready and nil serving mean true, nil
        // terminating means false.
        let ready = conditions.ready.unwrap_or(true);
        let mut addrs = ip_addrs_lenient(&endpoint.addresses, &mut warnings);
        addrs.retain(|addr| {
            let fits = IpFamily::of(addr) == family;
            if !fits {
                warnings.push(format!("address {addr} in an {} EndpointSlice; left out", object.address_type));
            }
            fits
        });
        for addr in addrs {
            endpoints.push(Endpoint {
                addr,
                ready,
                serving: conditions.serving.unwrap_or(true),
                terminating: conditions.terminating.unwrap_or(false),
                node_name: endpoint.node_name.as_deref().map(crate::k8s::intern::string),
                zone_hints: endpoint
                    .hints
                    .as_ref()
                    .and_then(|h| h.for_zones.as_ref())
                    .map(|zones| zones.iter().map(|z| z.name.clone()).collect()),
            });
        }
    }
    // Kept as long as the slice exists (the agent's catalog): no room to grow.
    ports.shrink_to_fit();
    endpoints.shrink_to_fit();
    Ok(Some((
        (slice_name.namespace.to_string(), slice_name.name.to_string()),
        EndpointSlice { service: ServiceName::new(slice_name.namespace, service_name), ports, endpoints },
        warnings,
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A LoadBalancer Service `default/web` with the given annotations.
    fn load_balancer(annotations: serde_json::Value) -> core::Service {
        serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": "default", "name": "web", "annotations": annotations},
            "spec": {"type": "LoadBalancer", "clusterIP": "10.96.0.10",
                     "ports": [{"port": 80, "nodePort": 30080}]},
            "status": {"loadBalancer": {"ingress": [{"ip": "203.0.113.7"}]}},
        }))
        .unwrap()
    }

    fn converted(annotations: serde_json::Value) -> (Service, Vec<String>) {
        match service(&load_balancer(annotations)).unwrap() {
            ServiceOutcome::Service(service, warnings) => (service, warnings),
            _ => panic!("not converted to a Service"),
        }
    }

    #[test]
    fn service_local_true_forces_local_external_traffic() {
        assert!(!converted(serde_json::json!({})).0.external_traffic_local);
        assert!(converted(serde_json::json!({LOCAL_ANNOTATION: "true"})).0.external_traffic_local);
        assert!(!converted(serde_json::json!({LOCAL_ANNOTATION: "false"})).0.external_traffic_local);
        // Upstream's switch is about external traffic only.
        assert!(!converted(serde_json::json!({LOCAL_ANNOTATION: "true"})).0.internal_traffic_local);
    }

    #[test]
    fn skiplbips_leaves_the_load_balancer_ips_out() {
        let lb_ip: IpAddr = "203.0.113.7".parse().unwrap();
        assert_eq!(converted(serde_json::json!({})).0.load_balancer_ips, vec![lb_ip]);
        let (skipped, warnings) = converted(serde_json::json!({SKIP_LB_IPS_ANNOTATION: ""}));
        assert!(skipped.load_balancer_ips.is_empty());
        assert_eq!(skipped.cluster_ips, vec!["10.96.0.10".parse::<IpAddr>().unwrap()]);
        assert!(warnings.is_empty(), "{warnings:?}");
    }

    #[test]
    fn source_hashing_is_maglev_on_the_client_address_unless_sh_port() {
        assert_eq!(converted(serde_json::json!({SCHEDULER_ANNOTATION: "sh"})).0.maglev, Some(false));
        let with_port = serde_json::json!({SCHEDULER_ANNOTATION: "sh", SCHEDFLAGS_ANNOTATION: "sh-fallback,sh-port"});
        assert_eq!(converted(with_port).0.maglev, Some(true));
        // mh's port flag is not sh's.
        let mh_flag = serde_json::json!({SCHEDULER_ANNOTATION: "sh", SCHEDFLAGS_ANNOTATION: "mh-port"});
        assert_eq!(converted(mh_flag).0.maglev, Some(false));
    }

    #[test]
    fn ipvs_schedulers_are_accepted_and_an_unknown_one_is_reported() {
        for scheduler in ["mh", "rr", "lc", "sh", "dh", "wrr"] {
            let (service, warnings) = converted(serde_json::json!({SCHEDULER_ANNOTATION: scheduler}));
            assert!(warnings.is_empty(), "{scheduler}: {warnings:?}");
            assert_eq!(service.maglev.is_some(), scheduler == "mh" || scheduler == "sh", "{scheduler}");
        }
        let (service, warnings) = converted(serde_json::json!({SCHEDULER_ANNOTATION: "fastest"}));
        assert!(service.maglev.is_none());
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].contains(SCHEDULER_ANNOTATION) && warnings[0].contains("fastest"), "{warnings:?}");
    }
}
