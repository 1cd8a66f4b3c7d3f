//! Building the service state from Kubernetes objects (from a file, or from the API watchers).
use std::path::Path;

use anyhow::{Context, Result};
use k8s_openapi::api::{core::v1 as core, discovery::v1 as discovery};
use serde::Deserialize;

use super::{
    from_k8s::{self, ServiceOutcome},
    model::*,
};

/// A problem with one object. Rejected (`partial` false): the object is skipped and what was
/// programmed for it stays as it was. Partial: only the named part (an endpoint, a port, an
/// address) is left out, the rest is programmed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectProblem {
    pub kind: String,
    pub name: String,
    pub message: String,
    pub partial: bool,
}

#[derive(Default)]
pub struct StateBuilder {
    pub state: ServiceState,
    pub problems: Vec<ObjectProblem>,
}

impl StateBuilder {
    pub fn add_service(&mut self, object: &core::Service) {
        let display = display_name(&object.metadata);
        match from_k8s::service(object) {
            Ok(ServiceOutcome::Service(service, warnings)) => {
                for warning in warnings {
                    self.partial("Service", &display, &warning);
                }
                self.state.services.insert(service.name.clone(), service);
            }
            Ok(ServiceOutcome::NotLoadBalanced) => {}
            Ok(ServiceOutcome::Rejected(name, rejected)) => {
                self.problem("Service", &display, &rejected.reason);
                self.state.rejected.insert(name, rejected);
            }
            Err(e) => self.problem("Service", &display, &e.to_string()),
        }
    }

    pub fn add_endpoint_slice(&mut self, object: &discovery::EndpointSlice) {
        match from_k8s::endpoint_slice(object) {
            Ok(Some((key, slice, warnings))) => {
                for warning in warnings {
                    self.partial("EndpointSlice", &display_name(&object.metadata), &warning);
                }
                self.state.slices.insert(key, slice);
            }
            Ok(None) => {}
            Err(e) => self.problem("EndpointSlice", &display_name(&object.metadata), &e.to_string()),
        }
    }

    // Not logged here: the state is rebuilt on every change, and whoever applies it reports
    // each distinct problem once.
    fn problem(&mut self, kind: &str, name: &str, message: &str) {
        let problem = ObjectProblem { kind: kind.into(), name: name.into(), message: message.into(), partial: false };
        self.problems.push(problem);
    }

    fn partial(&mut self, kind: &str, name: &str, message: &str) {
        let problem = ObjectProblem { kind: kind.into(), name: name.into(), message: message.into(), partial: true };
        self.problems.push(problem);
    }

    /// An object of our kinds that does not even decode (a field of the wrong type): named from
    /// its raw metadata, and whatever is programmed for its Service kept as it was.
    fn undecodable(&mut self, kind: &str, value: &serde_json::Value, error: &serde_json::Error) {
        let text = |v: &serde_json::Value| v.as_str().map(str::to_string);
        let meta = &value["metadata"];
        let namespace = text(&meta["namespace"]).unwrap_or_else(|| "default".into());
        let name = text(&meta["name"]);
        let display = format!("{namespace}/{}", name.as_deref().unwrap_or("?"));
        self.problem(kind, &display, &format!("not a valid {kind} object: {error}"));
        let service = match kind {
            "Service" => name,
            _ => text(&meta["labels"][from_k8s::SERVICE_NAME_LABEL]),
        };
        let Some(service) = service else { return };
        let spec = &value["spec"];
        let strings =
            |v: &serde_json::Value| -> Vec<String> { v.as_array().into_iter().flatten().filter_map(text).collect() };
        let mut addrs: Vec<String> = strings(&spec["clusterIPs"]);
        addrs.extend(text(&spec["clusterIP"]));
        addrs.extend(strings(&spec["externalIPs"]));
        let ingress = value["status"]["loadBalancer"]["ingress"].as_array().cloned().unwrap_or_default();
        addrs.extend(ingress.iter().filter_map(|i| text(&i["ip"])));
        let node_ports = spec["ports"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| p["nodePort"].as_u64().and_then(|n| u16::try_from(n).ok()))
            .collect();
        let rejected = RejectedService {
            reason: format!("{kind} {display} does not decode"),
            addrs: addrs.iter().filter_map(|a| from_k8s::parse_ip(a).ok()).collect(),
            node_ports,
        };
        self.state.rejected.insert(ServiceName::new(namespace, service), rejected);
    }

    /// Adds one decoded object of any kind; kinds that are not ours are ignored.
    pub fn add_value(&mut self, mut value: serde_json::Value) -> Result<()> {
        let kind = value.get("kind").and_then(|k| k.as_str()).unwrap_or_default().to_string();
        match kind.as_str() {
            "List" | "ServiceList" | "EndpointSliceList" => {
                if let Some(serde_json::Value::Array(items)) = value.get_mut("items").map(serde_json::Value::take) {
                    for item in items {
                        self.add_value(item)?;
                    }
                }
            }
            // Decoded from a reference, not a copy of each object (~20 ms of a 10,000-Service
            // file): the value is kept to name an object that does not decode.
            "Service" => match core::Service::deserialize(&value) {
                Ok(service) => self.add_service(&service),
                Err(e) => self.undecodable("Service", &value, &e),
            },
            "EndpointSlice" => match discovery::EndpointSlice::deserialize(&value) {
                Ok(slice) => self.add_endpoint_slice(&slice),
                Err(e) => self.undecodable("EndpointSlice", &value, &e),
            },
            _ => {}
        }
        Ok(())
    }
}

fn display_name(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> String {
    format!("{}/{}", meta.namespace.as_deref().unwrap_or("?"), meta.name.as_deref().unwrap_or("?"))
}

/// Reads a YAML (multi-document) or JSON file of Kubernetes objects.
pub fn load_file(path: &Path) -> Result<StateBuilder> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    parse_objects(&text).with_context(|| format!("parsing {}", path.display()))
}

pub fn parse_objects(text: &str) -> Result<StateBuilder> {
    let mut builder = StateBuilder::default();
    for document in serde_yaml::Deserializer::from_str(text) {
        let value = serde_yaml::Value::deserialize(document)?;
        if value.is_null() {
            continue;
        }
        builder.add_value(serde_json::to_value(value)?)?;
    }
    Ok(builder)
}
