//! Pods as the agent watches, keeps and checkpoints them.
//!
//! A 150,000-pod cluster's Pods are most of what the agent holds. Kept as `k8s-openapi` Pods,
//! even stripped of what nobody reads (k8s/slim.rs), each was ~3.5 KiB: a `PodSpec`, a
//! `PodStatus` and a `Container` are large structs of empty options, labels a `BTreeMap` of
//! `String`s. So the watcher decodes Pods ([`PodFields`]) straight into the [`SlimPod`] the
//! store keeps: only the fields some reader uses, read in place in the list page (everything
//! else in the JSON skipped unparsed: env, volumes, managedFields, statuses), names and labels
//! shared with every other object that has them (`k8s::intern`), addresses parsed, named ports
//! flattened.
//!
//! The checkpoint writes a [`SlimPod`] as the Pod JSON of those fields ([`PodJson`]), which is
//! what an earlier agent wrote (a Pod with fewer fields) and what both read back: the
//! checkpoint's version does not change.
//!
//! A field added to a reader must be added here too: `every_field_a_reader_uses_survives`
//! holds the list.
use std::{borrow::Cow, collections::BTreeMap, net::IpAddr, sync::Arc};

use k8s_openapi::api::core::v1::Pod;
use kube::api::ObjectMeta;
use serde::{Deserialize, Deserializer, Serialize};

use super::{
    intern,
    labels::{Labels, Protocol},
    store::{Held, ObjectKey},
};

/// A Pod as the watcher decodes it (`Api<PodFields>`, the core/v1 Pod it is): straight into the
/// [`SlimPod`] the store keeps, its strings read where they lie in the list page and interned from
/// there (no owned copy of a label, name or address is made only to be dropped again), every
/// other field of the JSON skipped as it is read.
#[derive(Clone, Debug, PartialEq)]
pub struct PodFields {
    /// Name, namespace and resourceVersion: what kube-rs's watcher and the store's key read.
    pub metadata: ObjectMeta,
    pub pod: SlimPod,
}

impl<'de> Deserialize<'de> for PodFields {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let read = PodRead::deserialize(deserializer)?;
        let meta = read.metadata.as_ref();
        let text = |field: Option<&Text<'_>>| field.map(|text| text.0.to_string());
        let metadata = ObjectMeta {
            name: text(meta.and_then(|m| m.name.as_ref())),
            namespace: text(meta.and_then(|m| m.namespace.as_ref())),
            resource_version: text(meta.and_then(|m| m.resource_version.as_ref())),
            ..Default::default()
        };
        Ok(PodFields { metadata, pod: SlimPod::from_read(read) })
    }
}

impl Default for PodFields {
    fn default() -> Self {
        PodFields { metadata: ObjectMeta::default(), pod: SlimPod::from_read(PodRead::default()) }
    }
}

/// Written as the Pod JSON of its fields (the checkpoint's form, [`SlimPod::to_json`]).
impl Serialize for PodFields {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.pod.serialize(serializer)
    }
}

/// The fields of a Pod some reader uses, borrowed from the text they are read from where they
/// need no unescaping. Field by field the types `PodJson` (the written form) had when it was
/// also what the watcher decoded, so a Pod that decoded then decodes now and one that failed
/// fails (`decodes_what_the_owned_form_decoded_and_fails_where_it_failed`).
#[derive(Default, Deserialize)]
struct PodRead<'a> {
    #[serde(default, borrow)]
    metadata: Option<MetaRead<'a>>,
    #[serde(default, borrow)]
    spec: Option<SpecRead<'a>>,
    #[serde(default, borrow)]
    status: Option<StatusRead<'a>>,
}

#[derive(Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct MetaRead<'a> {
    #[serde(default, borrow)]
    name: Option<Text<'a>>,
    #[serde(default, borrow)]
    namespace: Option<Text<'a>>,
    #[serde(default, borrow)]
    resource_version: Option<Text<'a>>,
    /// Later keys win over earlier equal ones, as in the `BTreeMap` decoded before.
    #[serde(default, borrow)]
    labels: Option<BTreeMap<Text<'a>, Text<'a>>>,
}

/// A string read in place when it needs no unescaping (serde's own `Cow` is a copy always, unless
/// it is a field's whole type), a copy otherwise.
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Text<'a>(Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Text<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Read;
        impl<'de> serde::de::Visitor<'de> for Read {
            type Value = Text<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, text: &'de str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Borrowed(text)))
            }
            fn visit_str<E>(self, text: &str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Owned(text.to_owned())))
            }
            fn visit_string<E>(self, text: String) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Owned(text)))
            }
        }
        deserializer.deserialize_str(Read)
    }
}

impl Default for Text<'_> {
    fn default() -> Self {
        Text(Cow::Borrowed(""))
    }
}

impl std::ops::Deref for Text<'_> {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct SpecRead<'a> {
    #[serde(default, borrow)]
    node_name: Option<Text<'a>>,
    #[serde(default)]
    host_network: Option<bool>,
    #[serde(default, borrow, deserialize_with = "null_as_default")]
    containers: Vec<ContainerRead<'a>>,
    #[serde(default, borrow)]
    init_containers: Option<Vec<ContainerRead<'a>>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ContainerRead<'a> {
    /// Read by nobody, but decoded as before: a name that is no string fails the Pod.
    #[serde(default, borrow, rename = "name")]
    _name: Text<'a>,
    #[serde(default, borrow)]
    ports: Option<Vec<PortRead<'a>>>,
    #[serde(default, borrow)]
    restart_policy: Option<Text<'a>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct PortRead<'a> {
    #[serde(default, borrow)]
    name: Option<Text<'a>>,
    #[serde(default)]
    container_port: i32,
    #[serde(default, borrow)]
    protocol: Option<Text<'a>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct StatusRead<'a> {
    #[serde(default, borrow)]
    phase: Option<Text<'a>>,
    #[serde(default, borrow, rename = "podIP")]
    pod_ip: Option<Text<'a>>,
    #[serde(default, borrow, rename = "podIPs")]
    pod_ips: Option<Vec<IpRead<'a>>>,
}

#[derive(Deserialize)]
struct IpRead<'a> {
    #[serde(default, borrow)]
    ip: Text<'a>,
}

/// The Pod JSON of a [`SlimPod`]'s fields: what the checkpoint writes (and what an earlier
/// agent's checkpoint holds, read back through [`PodFields`]).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PodJson {
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
    /// The resourceVersion, when it is a number (as every real API server's is): [`Self::version`].
    version: Version,
    pub labels: Labels,
    pub node_name: Option<Arc<str>>,
    pub host_network: bool,
    pub phase: PodPhase,
    /// Every address of `status.podIPs` and `status.podIP` that parses, sorted, each once.
    pub ips: Box<[IpAddr]>,
    /// The named ports of the containers and sidecars, sorted, each once; ports of other
    /// protocols than TCP, UDP and SCTP, and port 0, are not kept (no policy can use them).
    pub named_ports: Box<[NamedPort]>,
}

impl SlimPod {
    /// The pod of the fields read, interned where it is shared (names, label sets).
    fn from_read(read: PodRead<'_>) -> Self {
        let (meta, spec, status) = (read.metadata.unwrap_or_default(), read.spec, read.status);
        let mut ips: Vec<IpAddr> = status
            .iter()
            .flat_map(|status| status.pod_ips.iter().flatten().map(|p| &*p.ip).chain(status.pod_ip.as_deref()))
            .filter_map(|ip| ip.trim().parse().ok())
            .collect();
        ips.sort();
        ips.dedup();
        let containers = spec.iter().flat_map(|spec| {
            let sidecars =
                spec.init_containers.iter().flatten().filter(|c| c.restart_policy.as_deref() == Some("Always"));
            spec.containers.iter().chain(sidecars)
        });
        let mut named_ports: Vec<NamedPort> = containers
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
        let labels = meta.labels.as_ref().map(|labels| {
            // Sorted by key, each key once already.
            let pairs: Vec<(&str, &str)> = labels.iter().map(|(k, v)| (&**k, &**v)).collect();
            Labels::of_sorted(&pairs)
        });
        SlimPod {
            namespace: intern::string(meta.namespace.as_deref().unwrap_or_default()),
            name: Arc::from(meta.name.as_deref().unwrap_or_default()),
            version: Version::of(meta.resource_version.as_deref().and_then(|v| v.parse().ok())),
            labels: labels.unwrap_or_default(),
            node_name: spec.as_ref().and_then(|spec| spec.node_name.as_deref()).map(intern::string),
            host_network: spec.as_ref().and_then(|spec| spec.host_network).unwrap_or(false),
            phase: PodPhase::of(status.as_ref().and_then(|status| status.phase.as_deref())),
            ips: ips.into(),
            named_ports: named_ports.into(),
        }
    }

    /// The Pod JSON this pod is written as (the checkpoint), and read back from.
    pub fn to_json(&self) -> PodJson {
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
        PodJson {
            metadata: ObjectMeta {
                name: text(&self.name),
                namespace: text(&self.namespace),
                resource_version: self.version().map(|v| v.to_string()),
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
                phase: self.phase.name().map(str::to_string),
                pod_ip: self.ips.first().map(IpAddr::to_string),
                pod_ips: (!self.ips.is_empty())
                    .then(|| self.ips.iter().map(|ip| PodIpFields { ip: ip.to_string() }).collect()),
            }),
        }
    }

    /// The pod is past running: its addresses may already be another pod's.
    pub fn is_terminal(&self) -> bool {
        matches!(self.phase, PodPhase::Succeeded | PodPhase::Failed)
    }

    /// The resourceVersion, when it is a number.
    pub fn version(&self) -> Option<u64> {
        self.version.get()
    }
}

/// A Pod's `status.phase`, as a byte (an interned text was 16).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodPhase {
    None,
    Pending,
    Running,
    Succeeded,
    Failed,
    Unknown,
    /// A phase the API does not define: read as none of the above (not terminal), written as no
    /// phase.
    Other,
}

impl PodPhase {
    const NAMED: [(PodPhase, &'static str); 5] = [
        (PodPhase::Pending, "Pending"),
        (PodPhase::Running, "Running"),
        (PodPhase::Succeeded, "Succeeded"),
        (PodPhase::Failed, "Failed"),
        (PodPhase::Unknown, "Unknown"),
    ];

    fn of(text: Option<&str>) -> Self {
        let Some(text) = text else { return PodPhase::None };
        Self::NAMED.iter().find(|(_, name)| *name == text).map_or(PodPhase::Other, |(phase, _)| *phase)
    }

    pub fn name(self) -> Option<&'static str> {
        Self::NAMED.iter().find(|(phase, _)| *phase == self).map(|(_, name)| *name)
    }
}

/// A resourceVersion number in 8 bytes (`Option<u64>` takes 16): `u64::MAX` stands for none, a
/// number no API server reaches (etcd's revisions count writes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Version(u64);

impl Version {
    fn of(version: Option<u64>) -> Self {
        Self(version.unwrap_or(u64::MAX))
    }

    fn get(self) -> Option<u64> {
        (self.0 != u64::MAX).then_some(self.0)
    }
}

impl From<&Pod> for SlimPod {
    fn from(pod: &Pod) -> Self {
        PodFields::from(pod).pod
    }
}

/// Written as its Pod JSON ([`SlimPod::to_json`]).
impl Serialize for SlimPod {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.to_json().serialize(serializer)
    }
}

/// Read as a Pod (an earlier agent's slimmed `k8s-openapi` Pod too), keeping only its fields.
impl<'de> Deserialize<'de> for SlimPod {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        PodRead::deserialize(deserializer).map(SlimPod::from_read)
    }
}

impl Held<PodFields> for Arc<SlimPod> {
    fn hold(object: PodFields) -> Self {
        Arc::new(object.pod)
    }
    /// Keyed by the pod's own (shared) namespace and name.
    fn keyed(object: PodFields) -> (ObjectKey, Self) {
        let pod = Self::hold(object);
        (ObjectKey { namespace: pod.namespace.clone(), name: pod.name.clone() }, pod)
    }
    fn version(&self) -> Option<u64> {
        SlimPod::version(self)
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
        Arc::new(self.pod.clone())
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
        serde_json::from_value::<PodFields>(json).unwrap().pod
    }

    /// 150,000 are held: with its `Arc`'s two counts a pod fills the allocator's 128-byte size
    /// class (the next is 160).
    #[test]
    fn a_pod_is_at_most_112_bytes() {
        assert!(std::mem::size_of::<SlimPod>() <= 112, "{} bytes", std::mem::size_of::<SlimPod>());
    }

    #[test]
    fn phases_read_back_and_only_the_last_two_end_a_pod() {
        for (phase, terminal, written) in [
            ("Pending", false, Some("Pending")),
            ("Running", false, Some("Running")),
            ("Succeeded", true, Some("Succeeded")),
            ("Failed", true, Some("Failed")),
            ("Unknown", false, Some("Unknown")),
            ("Sleeping", false, None),
        ] {
            let pod = slim(json!({"metadata": {"name": "p"}, "status": {"phase": phase}}));
            assert_eq!(pod.is_terminal(), terminal, "{phase}");
            assert_eq!(pod.to_json().status.unwrap().phase.as_deref(), written, "{phase}");
        }
        let no_phase = slim(json!({"metadata": {"name": "p"}, "status": {}}));
        assert_eq!((no_phase.phase, no_phase.to_json().status.unwrap().phase), (PodPhase::None, None));
    }

    #[test]
    fn every_field_a_reader_uses_survives() {
        let pod = slim(full_pod(0));
        // What the policy compiler (policy::parse::PodInfo) and the firewall's index of this
        // node's pods read.
        assert_eq!((&*pod.namespace, &*pod.name, pod.version()), ("shop", "web-1", Some(7)));
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

    /// The list page's text (strings read in place, escaped ones copied) and a JSON value (every
    /// string a copy) decode to the same pod, which is what the owned form decoded.
    #[test]
    fn text_read_in_place_and_copied_decode_alike() {
        let text = full_pod(0).to_string();
        let in_place: PodFields = serde_json::from_str(&text).unwrap();
        assert_eq!(in_place.pod, slim(full_pod(0)));
        assert_eq!(
            (in_place.metadata.name.as_deref(), in_place.metadata.namespace.as_deref()),
            (Some("web-1"), Some("shop"))
        );
        assert_eq!(in_place.metadata.resource_version.as_deref(), Some("7"));
        // Escaped strings cannot be borrowed: unescaped into copies, the same pod.
        let escaped = text.replace("\"web-1\"", "\"web\\u002d1\"").replace("\"app\":", "\"\\u0061pp\":");
        assert_ne!(escaped, text);
        assert_eq!(serde_json::from_str::<PodFields>(&escaped).unwrap().pod, in_place.pod);
    }

    /// Decoded in place, a Pod decodes where the owned form (`PodJson`, what the watcher decoded
    /// before) decoded, and fails where it failed, with serde's message naming the field's type:
    /// kube-rs reports the list as failed (logged, `kube_router_api_errors_total`) and retries it.
    #[test]
    fn decodes_what_the_owned_form_decoded_and_fails_where_it_failed() {
        let cases = [
            (r#"{}"#, true),
            (r#"{"metadata": null, "spec": null, "status": null, "kind": 5}"#, true),
            (r#"{"metadata": {"labels": {"a": "1", "a": "2"}, "annotations": 5}}"#, true),
            (r#"{"spec": {"containers": [{"env": 5, "ports": [{"containerPort": 80, "extra": []}]}]}}"#, true),
            (r#"{"status": {"podIPs": [{}], "conditions": "x"}}"#, true),
            (r#"{"metadata": {"name": 5}}"#, false),
            (r#"{"metadata": {"labels": {"app": 1}}}"#, false),
            (r#"{"metadata": {"labels": ["app"]}}"#, false),
            (r#"{"metadata": {"resourceVersion": 7}}"#, false),
            (r#"{"spec": {"hostNetwork": "yes"}}"#, false),
            (r#"{"spec": {"nodeName": ["node-1"]}}"#, false),
            (r#"{"spec": {"containers": {}}}"#, false),
            (r#"{"spec": {"containers": [{"name": 5}]}}"#, false),
            (r#"{"spec": {"containers": [{"ports": [{"containerPort": "80"}]}]}}"#, false),
            (r#"{"spec": {"containers": [{"ports": [{"containerPort": null}]}]}}"#, false),
            (r#"{"spec": {"initContainers": [{"restartPolicy": true}]}}"#, false),
            (r#"{"status": {"podIP": 10}}"#, false),
            (r#"{"status": {"podIPs": [{"ip": null}]}}"#, false),
            (r#"{"status": {"phase": {}}}"#, false),
            (r#"{"metadata": {"name": "a"}"#, false),
        ];
        for (text, decodes) in cases {
            let owned = serde_json::from_str::<PodJson>(text);
            let in_place = serde_json::from_str::<PodFields>(text);
            assert_eq!(owned.is_ok(), decodes, "{text}: the owned form");
            assert_eq!(in_place.is_ok(), decodes, "{text}: {:?}", in_place.err());
            if let (Err(owned), Err(in_place)) = (owned, in_place) {
                assert_eq!(in_place.to_string(), owned.to_string(), "{text}");
            }
        }
        // Later keys win, as in the map decoded before.
        let pod = serde_json::from_str::<PodFields>(cases[2].0).unwrap().pod;
        assert_eq!(pod.labels.get("a"), Some("2"));
    }
}
