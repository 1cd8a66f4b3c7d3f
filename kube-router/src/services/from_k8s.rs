//! Kubernetes Service / EndpointSlice objects -> the service model, with validation.
use std::{collections::BTreeSet, net::Ipv4Addr, str::FromStr};

use k8s_openapi::api::{core::v1 as core, discovery::v1 as discovery};
use thiserror::Error;

use super::model::*;

pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// kube-router's per-Service hairpin switch (its presence turns hairpin on).
pub const HAIRPIN_ANNOTATION: &str = "kube-router.io/service.hairpin";
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
    Service(Service),
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

/// IPv4 addresses of a list; IPv6 ones are skipped (the datapath is IPv4-only for now).
fn ipv4_addrs<'a>(addrs: impl IntoIterator<Item = &'a String>) -> Result<Vec<Ipv4Addr>, ObjectError> {
    let mut out = Vec::new();
    for addr in addrs {
        match std::net::IpAddr::from_str(addr) {
            Ok(std::net::IpAddr::V4(v4)) => out.push(v4),
            Ok(std::net::IpAddr::V6(_)) => {}
            Err(_) => return Err(ObjectError::InvalidAddress(addr.clone())),
        }
    }
    Ok(out)
}

pub fn service(object: &core::Service) -> Result<ServiceOutcome, ObjectError> {
    let name = name_of(&object.metadata)?;
    let Some(spec) = &object.spec else { return Ok(ServiceOutcome::NotLoadBalanced) };
    let service_type = spec.type_.as_deref().unwrap_or("ClusterIP");
    if service_type == "ExternalName" {
        return Ok(ServiceOutcome::NotLoadBalanced);
    }
    // Whatever else is wrong, remember which frontends the object names so they stay programmed.
    let readable_addrs = |v: Option<&Vec<String>>| -> Vec<Ipv4Addr> {
        v.into_iter().flatten().filter_map(|a| Ipv4Addr::from_str(a).ok()).collect()
    };
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
        .filter_map(|i| i.ip.clone())
        .collect();
    let reject = |reason: ObjectError| {
        let mut addrs = readable_addrs(Some(&cluster_ip_strings));
        addrs.extend(readable_addrs(spec.external_ips.as_ref()));
        addrs.extend(readable_addrs(Some(&lb_strings)));
        let node_ports =
            spec.ports.iter().flatten().filter_map(|p| p.node_port.and_then(|n| u16::try_from(n).ok())).collect();
        Ok(ServiceOutcome::Rejected(name.clone(), RejectedService { reason: reason.to_string(), addrs, node_ports }))
    };

    let headless = cluster_ip_strings.iter().any(|ip| ip == "None");
    let cluster_ips = match ipv4_addrs(cluster_ip_strings.iter().filter(|ip| *ip != "None" && !ip.is_empty())) {
        Ok(ips) => ips,
        Err(e) => return reject(e),
    };
    let external_ips = match ipv4_addrs(spec.external_ips.iter().flatten()) {
        Ok(ips) => ips,
        Err(e) => return reject(e),
    };
    let load_balancer_ips = match ipv4_addrs(lb_strings.iter()) {
        Ok(ips) => ips,
        Err(e) => return reject(e),
    };
    if headless && external_ips.is_empty() {
        return Ok(ServiceOutcome::NotLoadBalanced);
    }

    let mut ports = Vec::new();
    let mut seen_ports = BTreeSet::new();
    let mut seen_names = BTreeSet::new();
    for port in spec.ports.iter().flatten() {
        let converted = (|| {
            let protocol = protocol(port.protocol.as_deref(), port.port)?;
            let number = port_number(port.port)?;
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

    let affinity_timeout_secs = (spec.session_affinity.as_deref() == Some("ClientIP")).then(|| {
        spec.session_affinity_config
            .as_ref()
            .and_then(|c| c.client_ip.as_ref())
            .and_then(|c| c.timeout_seconds)
            .and_then(|t| u32::try_from(t).ok())
            .unwrap_or(DEFAULT_AFFINITY_TIMEOUT_SECS)
    });
    Ok(ServiceOutcome::Service(Service {
        name,
        cluster_ips,
        external_ips,
        load_balancer_ips,
        ports,
        affinity_timeout_secs,
        external_traffic_local: spec.external_traffic_policy.as_deref() == Some("Local"),
        internal_traffic_local: spec.internal_traffic_policy.as_deref() == Some("Local"),
        publish_not_ready: spec.publish_not_ready_addresses.unwrap_or(false),
        hairpin: object.metadata.annotations.as_ref().is_some_and(|a| a.contains_key(HAIRPIN_ANNOTATION)),
        health_check_node_port: spec
            .health_check_node_port
            .filter(|_| spec.external_traffic_policy.as_deref() == Some("Local"))
            .and_then(|p| u16::try_from(p).ok())
            .filter(|p| *p != 0),
    }))
}

/// Converts an EndpointSlice. IPv6 slices yield `Ok(None)`: not load-balanced yet.
pub fn endpoint_slice(object: &discovery::EndpointSlice) -> Result<Option<(SliceKey, EndpointSlice)>, ObjectError> {
    let slice_name = name_of(&object.metadata)?;
    if object.address_type != "IPv4" {
        return Ok(None);
    }
    let service_name = object
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(SERVICE_NAME_LABEL))
        .ok_or(ObjectError::MissingServiceLabel)?;
    let mut ports = Vec::new();
    for port in object.ports.iter().flatten() {
        let Some(number) = port.port else { continue };
        ports.push(EndpointPort {
            name: port.name.clone().unwrap_or_default(),
            protocol: protocol(port.protocol.as_deref(), number)?,
            port: port_number(number)?,
        });
    }
    let mut endpoints = Vec::new();
    for endpoint in &object.endpoints {
        let conditions = endpoint.conditions.clone().unwrap_or_default();
        // API defaults: nil ready/serving mean true, nil terminating means false.
        let ready = conditions.ready.unwrap_or(true);
        for addr in ipv4_addrs(&endpoint.addresses)? {
            endpoints.push(Endpoint {
                addr,
                ready,
                serving: conditions.serving.unwrap_or(ready),
                terminating: conditions.terminating.unwrap_or(false),
                node_name: endpoint.node_name.clone(),
            });
        }
    }
    Ok(Some((
        (slice_name.namespace.clone(), slice_name.name),
        EndpointSlice { service: ServiceName::new(slice_name.namespace, service_name), ports, endpoints },
    )))
}
