//! Pods as the agent watches, keeps and checkpoints them.
//!
//! A 150,000-pod cluster's Pods are most of what the agent holds. Kept as `k8s-openapi` Pods,
//! even stripped of what nobody reads (k8s/slim.rs), each was ~3.5 KiB: a `PodSpec`, a
//! `PodStatus` and a `Container` are large structs of empty options, labels a `BTreeMap` of
//! `String`s. So the watcher decodes Pods straight into [`PodFields`] (the fields some reader
//! uses, everything else in the JSON skipped unparsed: env, volumes, managedFields,
//! statuses), and the store keeps each as a [`SlimPod`]: names and labels shared with every
//! other object that has them (`k8s::intern`), addresses parsed, named ports flattened.
//!
//! The checkpoint writes a [`SlimPod`] as the Pod JSON of its [`PodFields`], which is what an
//! earlier agent wrote (a Pod with fewer fields) and what both read back: the checkpoint's
//! version does not change.
//!
//! A field added to a reader must be added here too: `every_field_a_reader_uses_survives`
//! holds the list.
use std::{collections::BTreeMap, net::IpAddr, sync::Arc};

use k8s_openapi::api::core::v1::Pod;
use kube::api::ObjectMeta;
use serde::{Deserialize, Deserializer, Serialize};

use super::{
    intern,
    labels::{Labels, Protocol},
    store::{Held, ObjectKey},
};

/// A Pod as the watcher decodes it: only the fields some reader uses. Watched as the core/v1
/// Pod it is (`Api<PodFields>`); every other field of the JSON is skipped as it is read.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PodFields {
    #[serde(default, deserialize_with = "identity_meta")]
    pub metadata: ObjectMeta,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec: Option<PodSpecFields>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<PodStatusFields>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodSpecFields {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_network: Option<bool>,
    #[serde(default, deserialize_with = "null_as_default")]
    pub containers: Vec<ContainerFields>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init_containers: Option<Vec<ContainerFields>>,
}

/// A container's name and ports (named ports of NetworkPolicy); init containers with
/// `restartPolicy: Always` (sidecars) serve too.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerFields {
    #[serde(default)]
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ports: Option<Vec<ContainerPortFields>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_policy: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerPortFields {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default)]
    pub container_port: i32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodStatusFields {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    #[serde(default, rename = "podIP", skip_serializing_if = "Option::is_none")]
    pub pod_ip: Option<String>,
    #[serde(default, rename = "podIPs", skip_serializing_if = "Option::is_none")]
    pub pod_ips: Option<Vec<PodIpFields>>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PodIpFields {
    #[serde(default)]
    pub ip: String,
}

fn null_as_default<'de, D: Deserializer<'de>, T: Default + Deserialize<'de>>(d: D) -> Result<T, D::Error> {
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// Identity, labels and version: what the store and the selectors read. The rest of the
/// metadata (managedFields, annotations, owners) is skipped unparsed.
pub(super) fn identity_meta<'de, D: Deserializer<'de>>(d: D) -> Result<ObjectMeta, D::Error> {
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Identity {
        #[serde(default)]
        name: Option<String>,
        #[serde(default)]
        namespace: Option<String>,
        #[serde(default)]
        resource_version: Option<String>,
        #[serde(default)]
        labels: Option<BTreeMap<String, String>>,
    }
    let Some(meta) = Option::<Identity>::deserialize(d)? else { return Ok(ObjectMeta::default()) };
    Ok(ObjectMeta {
        name: meta.name,
        namespace: meta.namespace,
        resource_version: meta.resource_version,
        labels: meta.labels,
        ..Default::default()
    })
}

super::slim::decoded_as!(PodFields, Pod);

/// The same fields of a `k8s-openapi` Pod (tests, tools, the policy compiler's whole-snapshot
/// entry point): through its JSON, so both decode the same way.
impl From<&Pod> for PodFields {
    fn from(pod: &Pod) -> Self {
        serde_json::to_value(pod).ok().and_then(|json| serde_json::from_value(json).ok()).unwrap_or_default()
    }
}

/// A named container port: what a NetworkPolicy's named port resolves to.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NamedPort {
    pub name: Arc<str>,
    pub protocol: Protocol,
    pub port: u16,
}

/// A Pod as the store keeps it (see the module's documentation).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlimPod {
    pub namespace: Arc<str>,
    pub name: Arc<str>,
    /// The resourceVersion, when it is a number (as every real API server's is).
    pub version: Option<u64>,
    pub labels: Labels,
    pub node_name: Option<Arc<str>>,
    pub host_network: bool,
    pub phase: Option<Arc<str>>,
    /// Every address of `status.podIPs` and `status.podIP` that parses, sorted, each once.
    pub ips: Box<[IpAddr]>,
    /// The named ports of the containers and sidecars, sorted, each once; ports of other
    /// protocols than TCP, UDP and SCTP, and port 0, are not kept (no policy can use them).
    pub named_ports: Box<[NamedPort]>,
}

impl SlimPod {
    pub fn from_fields(fields: PodFields) -> Self {
        let meta = fields.metadata;
        let spec = fields.spec.unwrap_or_default();
        let status = fields.status.unwrap_or_default();
        let mut ips: Vec<IpAddr> = status
            .pod_ips
            .iter()
            .flatten()
            .map(|p| p.ip.as_str())
            .chain(status.pod_ip.as_deref())
            .filter_map(|ip| ip.trim().parse().ok())
            .collect();
        ips.sort();
        ips.dedup();
        let sidecars = spec.init_containers.iter().flatten().filter(|c| c.restart_policy.as_deref() == Some("Always"));
        let mut named_ports: Vec<NamedPort> = spec
            .containers
            .iter()
            .chain(sidecars)
            .flat_map(|c| c.ports.iter().flatten())
            .filter_map(|port| {
                let name = port.name.as_deref()?;
                let protocol = match port.protocol.as_deref() {
                    None => Protocol::Tcp,
                    Some(p) => Protocol::from_k8s(p)?,
                };
                let port = u16::try_from(port.container_port).ok().filter(|p| *p != 0)?;
                Some(NamedPort { name: intern::string(name), protocol, port })
            })
            .collect();
        named_ports.sort();
        named_ports.dedup();
        SlimPod {
            namespace: intern::string(meta.namespace.as_deref().unwrap_or_default()),
            name: Arc::from(meta.name.as_deref().unwrap_or_default()),
            version: meta.resource_version.as_deref().and_then(|v| v.parse().ok()),
            labels: meta.labels.as_ref().map(Labels::from).unwrap_or_default(),
            node_name: spec.node_name.as_deref().map(intern::string),
            host_network: spec.host_network.unwrap_or(false),
            phase: status.phase.as_deref().map(intern::string),
            ips: ips.into(),
            named_ports: named_ports.into(),
        }
    }

    /// The Pod JSON this pod is written as (the checkpoint), and read back from.
    pub fn to_fields(&self) -> PodFields {
        let text = |s: &Arc<str>| (!s.is_empty()).then(|| s.to_string());
        // One container holds every named port: readers take them from all containers alike.
        let containers = (!self.named_ports.is_empty())
            .then(|| ContainerFields {
                name: String::new(),
                ports: Some(
                    self.named_ports
                        .iter()
                        .map(|p| ContainerPortFields {
                            name: Some(p.name.to_string()),
                            container_port: i32::from(p.port),
                            protocol: Some(p.protocol.to_string()),
                        })
                        .collect(),
                ),
                restart_policy: None,
            })
            .into_iter()
            .collect();
        PodFields {
            metadata: ObjectMeta {
                name: text(&self.name),
                namespace: text(&self.namespace),
                resource_version: self.version.map(|v| v.to_string()),
                labels: (!self.labels.is_empty())
                    .then(|| self.labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()),
                ..Default::default()
            },
            spec: Some(PodSpecFields {
                node_name: self.node_name.as_deref().map(str::to_string),
                host_network: self.host_network.then_some(true),
                containers,
                init_containers: None,
            }),
            status: Some(PodStatusFields {
                phase: self.phase.as_deref().map(str::to_string),
                pod_ip: self.ips.first().map(IpAddr::to_string),
                pod_ips: (!self.ips.is_empty())
                    .then(|| self.ips.iter().map(|ip| PodIpFields { ip: ip.to_string() }).collect()),
            }),
        }
    }

    /// The pod is past running: its addresses may already be another pod's.
    pub fn is_terminal(&self) -> bool {
        matches!(self.phase.as_deref(), Some("Succeeded" | "Failed"))
    }
}

impl From<&Pod> for SlimPod {
    fn from(pod: &Pod) -> Self {
        SlimPod::from_fields(PodFields::from(pod))
    }
}

/// Written as its Pod JSON ([`SlimPod::to_fields`]).
impl Serialize for SlimPod {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.to_fields().serialize(serializer)
    }
}

/// Read as a Pod (an earlier agent's slimmed `k8s-openapi` Pod too), keeping only its fields.
impl<'de> Deserialize<'de> for SlimPod {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        PodFields::deserialize(deserializer).map(SlimPod::from_fields)
    }
}

impl Held<PodFields> for Arc<SlimPod> {
    fn hold(object: PodFields) -> Self {
        Arc::new(SlimPod::from_fields(object))
    }
    /// Keyed by the pod's own (shared) namespace and name.
    fn keyed(object: PodFields) -> (ObjectKey, Self) {
        let pod = Self::hold(object);
        (ObjectKey { namespace: pod.namespace.clone(), name: pod.name.clone() }, pod)
    }
    fn version(&self) -> Option<u64> {
        self.version
    }
    fn same_apart_from_version(&self, other: &Self) -> bool {
        SlimPod { version: other.version, ..(**self).clone() } == **other
    }
}

/// What a reader of Pods may be handed: the store's shared [`SlimPod`], or a `k8s-openapi` Pod
/// (tests, tools), read the same way.
pub trait AsSlimPod {
    fn slim_pod(&self) -> Arc<SlimPod>;
}

impl AsSlimPod for Arc<SlimPod> {
    fn slim_pod(&self) -> Arc<SlimPod> {
        self.clone()
    }
}

impl AsSlimPod for SlimPod {
    fn slim_pod(&self) -> Arc<SlimPod> {
        Arc::new(self.clone())
    }
}

impl AsSlimPod for PodFields {
    fn slim_pod(&self) -> Arc<SlimPod> {
        Arc::new(SlimPod::from_fields(self.clone()))
    }
}

impl AsSlimPod for Pod {
    fn slim_pod(&self) -> Arc<SlimPod> {
        Arc::new(SlimPod::from(self))
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// A Pod with the bulk a real one carries.
    fn full_pod(restarts: i32) -> serde_json::Value {
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "web-1", "namespace": "shop", "uid": "u1", "resourceVersion": "7",
                "labels": {"app": "web"}, "annotations": {"note": "x"},
                "managedFields": [{"manager": "kubectl", "fieldsV1": {"f:metadata": {}}}], "ownerReferences": [{"apiVersion": "apps/v1",
                "kind": "ReplicaSet", "name": "web", "uid": "r1"}]},
            "spec": {"nodeName": "node-1", "hostNetwork": false,
                "containers": [{"name": "app", "image": "web:1", "env": [{"name": "TOKEN", "value": "secret"}],
                    "ports": [{"name": "http", "containerPort": 8080, "protocol": "TCP"}, {"containerPort": 9000}]}],
                "initContainers": [{"name": "proxy", "image": "p:1", "restartPolicy": "Always",
                    "ports": [{"name": "admin", "containerPort": 9901}]},
                    {"name": "setup", "image": "s:1", "ports": [{"name": "init", "containerPort": 1}]}],
                "volumes": [{"name": "data", "emptyDir": {}}]},
            "status": {"phase": "Running", "podIP": "10.0.1.5", "podIPs": [{"ip": "10.0.1.5"}, {"ip": "fd00::5"}],
                "conditions": [{"type": "Ready", "status": "True"}],
                "containerStatuses": [{"name": "app", "image": "web:1", "imageID": "", "ready": true,
                    "restartCount": restarts}]}
        })
    }

    fn slim(json: serde_json::Value) -> SlimPod {
        SlimPod::from_fields(serde_json::from_value(json).unwrap())
    }

    #[test]
    fn every_field_a_reader_uses_survives() {
        let pod = slim(full_pod(0));
        // What the policy compiler (policy::parse::PodInfo) and the firewall's index of this
        // node's pods read.
        assert_eq!((&*pod.namespace, &*pod.name, pod.version), ("shop", "web-1", Some(7)));
        assert_eq!(pod.labels.get("app"), Some("web"));
        assert_eq!(pod.node_name.as_deref(), Some("node-1"));
        assert!(!pod.host_network && !pod.is_terminal());
        assert_eq!(&*pod.ips, ["10.0.1.5".parse::<IpAddr>().unwrap(), "fd00::5".parse().unwrap()]);
        // The containers' and the sidecar's named ports; not the init container's.
        let ports: Vec<(&str, Protocol, u16)> =
            pod.named_ports.iter().map(|p| (&*p.name, p.protocol, p.port)).collect();
        assert_eq!(ports, [("admin", Protocol::Tcp, 9901), ("http", Protocol::Tcp, 8080)]);
        // The same as the k8s-openapi Pod gives.
        let typed: Pod = serde_json::from_value(full_pod(0)).unwrap();
        assert_eq!(SlimPod::from(&typed), pod);
        // And nothing of what no reader uses: secrets in env are never kept, nor written.
        let written = serde_json::to_string(&pod).unwrap();
        for unread in ["TOKEN", "secret", "image", "managedFields", "ownerReferences", "u1", "note"] {
            assert!(!written.contains(unread), "{unread} in {written}");
        }
    }

    #[test]
    fn the_checkpoint_form_reads_back_as_the_same_pod_here_and_as_a_pod_elsewhere() {
        let pod = slim(full_pod(0));
        let written = serde_json::to_value(&pod).unwrap();
        assert_eq!(slim(written.clone()), pod);
        // An earlier agent's checkpoint holds k8s-openapi Pods: it reads this one too, with the
        // same policy inputs.
        let typed: Pod = serde_json::from_value(written).unwrap();
        assert_eq!(SlimPod::from(&typed), pod);
        // And what an earlier agent wrote (checkpoint version 1: the Pod slimmed as k8s/slim.rs
        // did, byte for byte) reads as the same pod.
        let earlier = r#"{"metadata":{"labels":{"app":"web"},"name":"web-1","namespace":"shop","resourceVersion":"7","uid":"u1"},"spec":{"containers":[{"name":"app","ports":[{"containerPort":8080,"name":"http","protocol":"TCP"},{"containerPort":9000}]}],"hostNetwork":false,"initContainers":[{"name":"proxy","ports":[{"containerPort":9901,"name":"admin"}],"restartPolicy":"Always"},{"name":"setup","ports":[{"containerPort":1,"name":"init"}]}],"nodeName":"node-1"},"status":{"phase":"Running","podIP":"10.0.1.5","podIPs":[{"ip":"10.0.1.5"},{"ip":"fd00::5"}]}}"#;
        assert_eq!(slim(serde_json::from_str(earlier).unwrap()), pod);
    }

    #[test]
    fn a_status_heartbeat_is_the_same_pod_and_a_label_change_is_not() {
        let held = |json| <Arc<SlimPod> as Held<PodFields>>::hold(serde_json::from_value(json).unwrap());
        let (before, restarted) = (held(full_pod(0)), held(full_pod(3)));
        assert_eq!(before, restarted);
        let mut newer = full_pod(0);
        newer["metadata"]["resourceVersion"] = json!("8");
        assert!(before.same_apart_from_version(&held(newer.clone())));
        newer["metadata"]["labels"]["app"] = json!("api");
        assert!(!before.same_apart_from_version(&held(newer)));
    }

    #[test]
    fn pods_share_their_strings_and_label_sets() {
        let (a, b) = (slim(full_pod(0)), slim(full_pod(1)));
        assert!(Arc::ptr_eq(&a.namespace, &b.namespace));
        assert!(a.labels.same_set(&b.labels));
    }

    #[test]
    fn odd_pods_decode() {
        for odd in [
            json!({}),
            json!({"metadata": null, "spec": null, "status": null}),
            json!({"metadata": {"name": "p"}, "spec": {"containers": null}, "status": {"podIPs": null, "podIP": "not an address"}}),
            json!({"spec": {"containers": [{"name": "c", "ports": [{"name": "big", "containerPort": 70000}, {"name": "odd", "containerPort": 80, "protocol": "ICMP"}]}]}}),
        ] {
            let pod = slim(odd.clone());
            assert!(pod.ips.is_empty() && pod.named_ports.is_empty(), "{odd}");
        }
    }
}
