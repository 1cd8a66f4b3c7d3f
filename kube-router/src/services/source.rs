//! Building the service state from Kubernetes objects (from a file, or from the API watchers).
use std::path::Path;

use anyhow::{Context, Result};
use k8s_openapi::api::{core::v1 as core, discovery::v1 as discovery};
use serde::Deserialize;

use super::{
    from_k8s::{self, ServiceOutcome},
    model::*,
};

/// A problem with one object; the object is skipped (or its frontends protected), others load.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectProblem {
    pub kind: String,
    pub name: String,
    pub message: String,
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
            Ok(ServiceOutcome::Service(service)) => {
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
            Ok(Some((key, slice))) => {
                self.state.slices.insert(key, slice);
            }
            Ok(None) => {}
            Err(e) => self.problem("EndpointSlice", &display_name(&object.metadata), &e.to_string()),
        }
    }

    fn problem(&mut self, kind: &str, name: &str, message: &str) {
        tracing::error!(
            kind,
            object = name,
            error = message,
            "rejected object; its programmed state is kept as it was"
        );
        self.problems.push(ObjectProblem { kind: kind.into(), name: name.into(), message: message.into() });
    }

    /// Adds one decoded object of any kind; kinds that are not ours are ignored.
    pub fn add_value(&mut self, value: serde_json::Value) -> Result<()> {
        let kind = value.get("kind").and_then(|k| k.as_str()).unwrap_or_default().to_string();
        match kind.as_str() {
            "List" | "ServiceList" | "EndpointSliceList" => {
                if let Some(items) = value.get("items").and_then(|i| i.as_array()) {
                    for item in items.clone() {
                        self.add_value(item)?;
                    }
                }
            }
            "Service" => match serde_json::from_value::<core::Service>(value) {
                Ok(service) => self.add_service(&service),
                Err(e) => self.problem("Service", "?", &format!("not a valid Service object: {e}")),
            },
            "EndpointSlice" => match serde_json::from_value::<discovery::EndpointSlice>(value) {
                Ok(slice) => self.add_endpoint_slice(&slice),
                Err(e) => self.problem("EndpointSlice", "?", &format!("not a valid EndpointSlice object: {e}")),
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
