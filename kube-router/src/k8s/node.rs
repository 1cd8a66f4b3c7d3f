//! Nodes as the agent watches them.
//!
//! Each of a cluster's kubelets rewrites its Node's status every few seconds (conditions'
//! heartbeat times, images, volumes): with 5,000 Nodes that is hundreds of updates a second,
//! and each Node's JSON is mostly what nobody here reads (`status.images` alone is often tens
//! of KiB). So the watcher decodes Nodes straight into [`NodeFields`] — the name, uid and
//! version, the zone label, kube-router's own annotations, the pod CIDRs and the addresses —
//! and skips the rest of the JSON unparsed; an unread label or annotation key is read and
//! dropped without being copied. The store keeps each as the slimmed `k8s-openapi` Node
//! (k8s/slim.rs) its readers take, so a heartbeat costs this small decode and a comparison
//! with what the store has, and wakes no one.
//!
//! The checkpoint still writes and reads that slimmed Node: its format does not change.
//! A field added to a Node reader must be added here and to `Node::slim`;
//! `the_fields_decoded_are_the_slimmed_node` holds both to the same answers.
use std::{collections::BTreeMap, fmt};

use k8s_openapi::api::core::v1::{Node, NodeAddress, NodeSpec, NodeStatus};
use kube::api::ObjectMeta;
use serde::{
    de::{DeserializeSeed, IgnoredAny, MapAccess, Visitor},
    Deserialize, Deserializer,
};

use super::TOPOLOGY_ZONE_LABEL;
use super::{slim::NODE_ANNOTATION_PREFIX, store::Held};

/// A Node as the watcher decodes it: only the fields some reader uses. Watched as the core/v1
/// Node it is (`Api<NodeFields>`).
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct NodeFields {
    #[serde(default, deserialize_with = "read_meta")]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: Option<NodeSpecFields>,
    #[serde(default)]
    pub status: Option<NodeStatusFields>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct NodeSpecFields {
    #[serde(default, rename = "podCIDR")]
    pub pod_cidr: Option<String>,
    #[serde(default, rename = "podCIDRs")]
    pub pod_cidrs: Option<Vec<String>>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct NodeStatusFields {
    #[serde(default)]
    pub addresses: Option<Vec<NodeAddress>>,
}

fn zone_label(key: &str) -> bool {
    key == TOPOLOGY_ZONE_LABEL
}

fn kube_router_annotation(key: &str) -> bool {
    key.starts_with(NODE_ANNOTATION_PREFIX)
}

/// Identity, version, the zone label and kube-router's annotations: what the store and the
/// Node readers use (as `Node::slim` keeps them).
fn read_meta<'de, D: Deserializer<'de>>(d: D) -> Result<ObjectMeta, D::Error> {
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Identity {
        #[serde(default)]
        name: Option<String>,
        #[serde(default)]
        uid: Option<String>,
        #[serde(default)]
        resource_version: Option<String>,
        #[serde(default, deserialize_with = "zone_labels")]
        labels: Option<BTreeMap<String, String>>,
        #[serde(default, deserialize_with = "kube_router_annotations")]
        annotations: Option<BTreeMap<String, String>>,
    }
    let Some(meta) = Option::<Identity>::deserialize(d)? else { return Ok(ObjectMeta::default()) };
    Ok(ObjectMeta {
        name: meta.name,
        uid: meta.uid,
        resource_version: meta.resource_version,
        labels: meta.labels,
        annotations: meta.annotations,
        ..Default::default()
    })
}

fn zone_labels<'de, D: Deserializer<'de>>(d: D) -> Result<Option<BTreeMap<String, String>>, D::Error> {
    d.deserialize_option(KeptEntries(zone_label))
}

fn kube_router_annotations<'de, D: Deserializer<'de>>(d: D) -> Result<Option<BTreeMap<String, String>>, D::Error> {
    d.deserialize_option(KeptEntries(kube_router_annotation))
}

/// A string map's entries whose key `.0` keeps; `None` when none is (as `Node::slim` leaves
/// it). The other entries are read past, their key and value never copied.
struct KeptEntries(fn(&str) -> bool);

impl<'de> Visitor<'de> for KeptEntries {
    type Value = Option<BTreeMap<String, String>>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a map of strings or null")
    }

    fn visit_none<E: serde::de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut kept = BTreeMap::new();
        while let Some(key) = map.next_key_seed(KeptKey(self.0))? {
            match key {
                Some(key) => {
                    kept.insert(key, map.next_value::<String>()?);
                }
                None => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok((!kept.is_empty()).then_some(kept))
    }
}

/// A map key, copied only when `.0` keeps it.
struct KeptKey(fn(&str) -> bool);

impl<'de> DeserializeSeed<'de> for KeptKey {
    type Value = Option<String>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeptKey {
    type Value = Option<String>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string key")
    }

    fn visit_str<E: serde::de::Error>(self, key: &str) -> Result<Self::Value, E> {
        Ok((self.0)(key).then(|| key.to_string()))
    }
}

impl NodeFields {
    /// The slimmed `k8s-openapi` Node the store keeps and the readers take.
    pub fn into_node(self) -> Node {
        Node {
            metadata: self.metadata,
            spec: self.spec.map(|spec| NodeSpec {
                pod_cidr: spec.pod_cidr,
                pod_cidrs: spec.pod_cidrs,
                ..Default::default()
            }),
            status: self.status.map(|status| NodeStatus { addresses: status.addresses, ..Default::default() }),
        }
    }
}

super::slim::decoded_as!(NodeFields, Node);

/// The same fields of a `k8s-openapi` Node (tests, tools): through its JSON, so both decode the
/// same way.
impl From<&Node> for NodeFields {
    fn from(node: &Node) -> Self {
        serde_json::to_value(node).ok().and_then(|json| serde_json::from_value(json).ok()).unwrap_or_default()
    }
}

impl Held<NodeFields> for std::sync::Arc<Node> {
    fn hold(object: NodeFields) -> Self {
        std::sync::Arc::new(object.into_node())
    }
    fn version(&self) -> Option<u64> {
        self.metadata.resource_version.as_deref().and_then(|v| v.parse().ok())
    }
    /// Compared in place, without the copy the generic comparison makes: this is what every
    /// heartbeat costs.
    fn same_apart_from_version(&self, other: &Self) -> bool {
        self.spec == other.spec
            && self.status == other.status
            && meta_equal_but_version(&self.metadata, &other.metadata)
    }
}

/// Every field but the resourceVersion equal (all named, so a new field is not missed).
fn meta_equal_but_version(a: &ObjectMeta, b: &ObjectMeta) -> bool {
    let ObjectMeta {
        annotations,
        creation_timestamp,
        deletion_grace_period_seconds,
        deletion_timestamp,
        finalizers,
        generate_name,
        generation,
        labels,
        managed_fields,
        name,
        namespace,
        owner_references,
        resource_version: _,
        self_link,
        uid,
    } = a;
    *name == b.name
        && *uid == b.uid
        && *labels == b.labels
        && *annotations == b.annotations
        && *namespace == b.namespace
        && *creation_timestamp == b.creation_timestamp
        && *deletion_grace_period_seconds == b.deletion_grace_period_seconds
        && *deletion_timestamp == b.deletion_timestamp
        && *finalizers == b.finalizers
        && *generate_name == b.generate_name
        && *generation == b.generation
        && *managed_fields == b.managed_fields
        && *owner_references == b.owner_references
        && *self_link == b.self_link
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use serde_json::json;

    use super::*;
    use crate::k8s::{checkpoint::node_for_checkpoint, kinds::Watched, slim::Slim};

    /// A Node with the bulk a kubelet's carries.
    fn full_node(heartbeat: &str) -> serde_json::Value {
        json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": "node-1", "uid": "n1", "resourceVersion": "3",
                "labels": {"topology.kubernetes.io/zone": "zone-a", "kubernetes.io/hostname": "node-1",
                    "node.kubernetes.io/instance-type": "m5.large"},
                "annotations": {"kube-router.io/node.asn": "64512", "kube-router.io/pod-cidrs": "10.9.0.0/24",
                    "kube-router.io/peer.ips": "192.168.9.1", "kube-router.io/peer.passwords": "c2VjcmV0",
                    "node.alpha.kubernetes.io/ttl": "0", "kubectl.kubernetes.io/last-applied-configuration": "{...}"},
                "managedFields": [{"manager": "kubelet", "fieldsV1": {"f:status": {}}}],
                "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"podCIDR": "10.0.1.0/24", "podCIDRs": ["10.0.1.0/24", "fd00:1::/64"], "providerID": "aws:///i-1",
                "taints": [{"key": "k", "effect": "NoSchedule"}]},
            "status": {"addresses": [{"type": "InternalIP", "address": "192.168.0.1"},
                    {"type": "ExternalIP", "address": "198.51.100.1"}, {"type": "Hostname", "address": "node-1"}],
                "conditions": [{"type": "Ready", "status": "True", "lastHeartbeatTime": heartbeat}],
                "images": [{"names": ["registry/app:1"], "sizeBytes": 1000}],
                "capacity": {"cpu": "2"},
                "nodeInfo": {"kubeletVersion": "v1.31.0", "machineID": "", "systemUUID": "", "bootID": "",
                    "kernelVersion": "", "osImage": "", "containerRuntimeVersion": "", "kubeProxyVersion": "",
                    "operatingSystem": "linux", "architecture": "amd64"}}
        })
    }

    fn held(json: serde_json::Value) -> Arc<Node> {
        <Arc<Node> as Held<NodeFields>>::hold(serde_json::from_value(json).unwrap())
    }

    fn slimmed(json: serde_json::Value) -> Node {
        serde_json::from_value::<Node>(json).unwrap().slim()
    }

    /// The watcher's decode and the `k8s-openapi` Node slimmed give the same Node, so every
    /// reader's answers and the checkpoint are those of before.
    #[test]
    fn the_fields_decoded_are_the_slimmed_node() {
        let mut odd_meta = full_node("2026-12-06T00:00:00Z");
        odd_meta["metadata"]["labels"] = json!(null);
        odd_meta["metadata"]["annotations"] = json!({"other.io/x": "y"});
        let mut no_zone = full_node("2026-12-06T00:00:00Z");
        no_zone["metadata"]["labels"] = json!({"kubernetes.io/hostname": "node-1"});
        let mut escaped = full_node("2026-12-06T00:00:00Z");
        escaped["metadata"]["annotations"] = json!({"kube-router.io/peer.asns": "6\u{e9}5\"00", "a\"b": "\\"});
        for json in [
            full_node("2026-12-06T00:00:00Z"),
            odd_meta,
            no_zone,
            escaped,
            json!({}),
            json!({"metadata": null, "spec": null, "status": null}),
            json!({"metadata": {"name": "n"}, "spec": {}, "status": {"addresses": null}}),
            json!({"metadata": {"name": "n"}, "spec": {"podCIDRs": null}, "status": {}}),
        ] {
            let from_fields = held(json.clone());
            assert_eq!(*from_fields, slimmed(json.clone()), "{json}");
            // From the watch stream's bytes too (serde_json reads keys in place there).
            let from_bytes: NodeFields = serde_json::from_slice(json.to_string().as_bytes()).unwrap();
            assert_eq!(from_bytes.into_node(), *from_fields, "{json}");
            // Checkpointed and restored, it is the checkpoint's form of it, as before.
            let (key, restored) = <NodeFields as Watched>::restored(<NodeFields as Watched>::saved(&from_fields));
            assert_eq!(*restored, node_for_checkpoint(&Arc::new(slimmed(json))));
            assert_eq!(*key.name, from_fields.metadata.name.clone().unwrap_or_default());
        }
        let node = held(full_node("2026-12-06T00:00:00Z"));
        let annotations: Vec<&str> = node.metadata.annotations.as_ref().unwrap().keys().map(String::as_str).collect();
        assert_eq!(
            annotations,
            [
                "kube-router.io/node.asn",
                "kube-router.io/peer.ips",
                "kube-router.io/peer.passwords",
                "kube-router.io/pod-cidrs"
            ]
        );
        let labels: Vec<&str> = node.metadata.labels.as_ref().unwrap().keys().map(String::as_str).collect();
        assert_eq!(labels, [TOPOLOGY_ZONE_LABEL]);
    }

    #[test]
    fn a_heartbeat_is_the_same_node_and_an_address_change_is_not() {
        let before = held(full_node("2026-12-06T00:00:00Z"));
        let mut beat = full_node("2026-12-06T00:00:10Z");
        beat["metadata"]["resourceVersion"] = json!("4");
        beat["metadata"]["annotations"]["node.alpha.kubernetes.io/ttl"] = json!("15");
        let beat = held(beat);
        assert_ne!(before, beat);
        assert!(Held::<NodeFields>::same_apart_from_version(&before, &beat));
        assert_eq!(Held::<NodeFields>::version(&beat), Some(4));
        for change in [
            json!({"status": {"addresses": [{"type": "InternalIP", "address": "192.168.0.2"}]}}),
            json!({"spec": {"podCIDRs": ["10.0.2.0/24"]}}),
            json!({"metadata": {"name": "node-1", "labels": {"topology.kubernetes.io/zone": "zone-b"}}}),
            json!({"metadata": {"name": "node-1", "annotations": {"kube-router.io/rr.client": "1"}}}),
        ] {
            let mut changed = full_node("2026-12-06T00:00:00Z");
            for (part, value) in change.as_object().unwrap() {
                for (field, value) in value.as_object().unwrap() {
                    changed[part][field] = value.clone();
                }
            }
            assert!(!Held::<NodeFields>::same_apart_from_version(&before, &held(changed)), "{change}");
        }
    }

    #[test]
    fn not_a_node_is_an_error() {
        let wrong = [
            json!({"metadata": {"labels": {"topology.kubernetes.io/zone": 1}}}),
            json!({"metadata": {"annotations": []}}),
            json!({"status": {"addresses": "x"}}),
            json!("node-1"),
        ];
        for bad in wrong {
            assert!(serde_json::from_value::<NodeFields>(bad.clone()).is_err(), "{bad}");
        }
    }
}
