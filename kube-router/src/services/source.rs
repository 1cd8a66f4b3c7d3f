//! Building the service state from Kubernetes objects (from a file, or from the API watchers).
use std::path::Path;

use anyhow::{Context, Result};
use k8s_openapi::api::{core::v1 as core, discovery::v1 as discovery};
use serde::Deserialize;
use serde_json::value::RawValue;

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

/// JSON text (kubectl's `-o json`: an object, a List, or an array or stream of them) is decoded
/// by serde_json, each object straight into its type; anything else is YAML documents. Text that
/// only looks like JSON (a YAML flow mapping `{kind: Service}`) is read as YAML.
pub fn parse_objects(text: &str) -> Result<StateBuilder> {
    if text.trim_start().starts_with(['{', '[']) {
        if let Ok(builder) = parse_json(text) {
            return Ok(builder);
        }
    }
    parse_yaml(text)
}

/// Each document goes to a `serde_json::Value` directly, not through a `serde_norway::Value`.
fn parse_yaml(text: &str) -> Result<StateBuilder> {
    let mut builder = StateBuilder::default();
    for document in serde_norway::Deserializer::from_str(text) {
        let value = serde_json::Value::deserialize(document)?;
        if value.is_null() {
            continue;
        }
        builder.add_value(value)?;
    }
    Ok(builder)
}

fn parse_json(text: &str) -> Result<StateBuilder> {
    let mut builder = StateBuilder::default();
    for value in serde_json::Deserializer::from_str(text).into_iter::<&RawValue>() {
        let raw = value?.get();
        if raw.starts_with('[') {
            for item in serde_json::from_str::<Vec<&RawValue>>(raw)? {
                builder.add_json(item.get());
            }
        } else {
            builder.add_json(raw);
        }
    }
    Ok(builder)
}

/// What names an object's kind, and a List's items: the rest of the object is skipped unparsed.
#[derive(Deserialize)]
struct Head<'a> {
    #[serde(borrow)]
    kind: Option<&'a RawValue>,
    #[serde(borrow)]
    items: Option<&'a RawValue>,
}

impl StateBuilder {
    /// Adds one object of JSON text (already checked to be well-formed): decoded into its type
    /// from the text, without a `serde_json::Value` of it unless it does not decode (to name it).
    fn add_json(&mut self, raw: &str) {
        // Not an object (an array, a string, null): not one of ours, as in `add_value`.
        if !raw.starts_with('{') {
            return;
        }
        let Ok(head) = serde_json::from_str::<Head>(raw) else { return };
        let kind: String = head.kind.and_then(|k| serde_json::from_str(k.get()).ok()).unwrap_or_default();
        match kind.as_str() {
            "List" | "ServiceList" | "EndpointSliceList" => {
                let items = head.items.and_then(|i| serde_json::from_str::<Vec<&RawValue>>(i.get()).ok());
                for item in items.into_iter().flatten() {
                    self.add_json(item.get());
                }
            }
            "Service" => match serde_json::from_str::<core::Service>(raw) {
                Ok(service) => self.add_service(&service),
                Err(_) => self.add_undecodable_json(raw),
            },
            "EndpointSlice" => match serde_json::from_str::<discovery::EndpointSlice>(raw) {
                Ok(slice) => self.add_endpoint_slice(&slice),
                Err(_) => self.add_undecodable_json(raw),
            },
            _ => {}
        }
    }

    /// Named, and its Service's programmed state kept, from its value as a YAML document's is:
    /// the same problem, word for word (a position in the text would be relative to the object).
    fn add_undecodable_json(&mut self, raw: &str) {
        if let Ok(value) = serde_json::from_str(raw) {
            // Only a List's items can fail, and a List is not what this object is.
            let _ = self.add_value(value);
        }
    }
}
