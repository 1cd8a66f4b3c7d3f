//! The watched kinds, each declared once.
//!
//! [`watched_kinds!`] lists them; the kind enum ([`Kind`](super::watch::Kind)), the watch
//! updates, the stores ([`ClusterObjects`](super::watch::ClusterObjects)), the watchers, the
//! completeness of a reader's kinds, the RBAC list, the checkpoint and its inspection are
//! generated from that list. What differs between kinds — how the store keeps an object, how
//! the checkpoint writes and reads it, whether several readers follow its changes — is the
//! kind's [`Watched`] implementation below. Adding a kind is a line in the list, an
//! implementation here, and its consumer.
use std::{fmt::Debug, sync::Arc};

use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
    networking::v1::NetworkPolicy,
};
use kube::Resource;
use serde::{de::DeserializeOwned, Deserialize, Serialize, Serializer};

use super::{
    namespace::{NamespaceFields, SlimNamespace},
    node::NodeFields,
    pod::{PodFields, SlimPod},
    slim::Slim,
    store::{keyed_hold, Held, ObjectKey, Packed},
};

/// Calls `$then!` with every watched kind as `Variant, store_field, WatchedType;`. The order is
/// the checkpoint's field order and the order of the watchers' start.
#[macro_export]
macro_rules! watched_kinds {
    ($then:ident) => {
        $then! {
            Services, services, k8s_openapi::api::core::v1::Service;
            EndpointSlices, endpoint_slices, k8s_openapi::api::discovery::v1::EndpointSlice;
            Pods, pods, $crate::k8s::pod::PodFields;
            Namespaces, namespaces, $crate::k8s::namespace::NamespaceFields;
            Nodes, nodes, $crate::k8s::node::NodeFields;
            NetworkPolicies, network_policies, k8s_openapi::api::networking::v1::NetworkPolicy;
        }
    };
}

/// A watched kind: what the watcher decodes (`Self`), what the store keeps, what the
/// checkpoint holds.
pub trait Watched:
    Slim + Resource<DynamicType = ()> + k8s_openapi::Resource + DeserializeOwned + Clone + Debug + Send + Sync + 'static
{
    /// One object as the store keeps it.
    type Held: Held<Self> + Send + Sync;
    /// One object as the checkpoint reads it back.
    type Saved: Serialize + DeserializeOwned + Clone + Debug + PartialEq;
    /// Read by several controllers, each following the changes with its own cursor
    /// ([`ObjectStore::journaled`](super::store::ObjectStore::journaled)).
    const JOURNALED: bool = false;

    /// A copy of a held object in the checkpoint's form.
    fn saved(held: &Self::Held) -> Self::Saved;
    /// A checkpointed object as the store keeps it, with its key.
    fn restored(saved: Self::Saved) -> (ObjectKey, Self::Held);
    /// The (namespace, name) of a checkpointed object, the key its store keeps it under: what
    /// the checkpoint's journal replaces or deletes.
    fn saved_key(saved: &Self::Saved) -> (&str, &str);
    /// Writes a held object in the checkpoint's form; overridden where no copy is needed.
    fn write_saved<S: Serializer>(held: &Self::Held, serializer: S) -> Result<S::Ok, S::Error> {
        Self::saved(held).serialize(serializer)
    }
}

/// The key a store keeps an API object under (`key_of` in `k8s::store`), borrowed.
fn resource_key<K: Resource>(object: &K) -> (&str, &str) {
    let meta = object.meta();
    let name = meta.name.as_deref().or(meta.generate_name.as_deref()).unwrap_or_default();
    (meta.namespace.as_deref().unwrap_or_default(), name)
}

/// The common case: kept decoded and shared, checkpointed as it is kept.
macro_rules! kept_shared {
    ($ty:ty $(, journaled = $journaled:expr)?) => {
        impl Watched for $ty {
            type Held = Arc<$ty>;
            type Saved = $ty;
            $(const JOURNALED: bool = $journaled;)?
            fn saved(held: &Arc<$ty>) -> $ty {
                (**held).clone()
            }
            fn restored(saved: $ty) -> (ObjectKey, Arc<$ty>) {
                keyed_hold(saved)
            }
            fn saved_key(saved: &$ty) -> (&str, &str) {
                resource_key(saved)
            }
            fn write_saved<S: Serializer>(held: &Arc<$ty>, serializer: S) -> Result<S::Ok, S::Error> {
                (**held).serialize(serializer)
            }
        }
    };
}

kept_shared!(NetworkPolicy);

/// Kept as their JSON text, decoded when read, written to the checkpoint as that text and read
/// back packed one at a time ([`SavedPacked`]): the kinds of which the agent keeps many and whose
/// one reader converts one object at a time (the services catalog, on a change). An
/// EndpointSlice of 10 endpoints is 5.5 KiB decoded and 1 KiB of JSON; a Service 1 KiB or more
/// decoded and ~0.45 KiB of JSON (the heap profile at `KRT_SCALE=0.3`; issue 29).
macro_rules! kept_packed {
    ($ty:ty) => {
        impl Watched for $ty {
            type Held = Packed<$ty>;
            type Saved = SavedPacked<$ty>;
            fn saved(held: &Packed<$ty>) -> SavedPacked<$ty> {
                SavedPacked::from(held.decode())
            }
            fn restored(saved: SavedPacked<$ty>) -> (ObjectKey, Packed<$ty>) {
                (saved.key, saved.held)
            }
            fn saved_key(saved: &SavedPacked<$ty>) -> (&str, &str) {
                (&saved.key.namespace, &saved.key.name)
            }
            fn write_saved<S: Serializer>(held: &Packed<$ty>, serializer: S) -> Result<S::Ok, S::Error> {
                held.serialize(serializer)
            }
        }
    };
}

/// A packed kind's object as the checkpoint reads it: decoded, slimmed and packed as it is read,
/// one at a time (as Pods are), so reading the checkpoint never holds every EndpointSlice
/// decoded: that was a fifth of the start's peak heap (issue 29, heap profile). Written and read
/// as the object's JSON, as before: the format does not change.
#[derive(Clone, PartialEq)]
pub struct SavedPacked<K> {
    key: ObjectKey,
    held: Packed<K>,
}

impl<K: Slim + Serialize> From<K> for SavedPacked<K> {
    fn from(object: K) -> Self {
        let (key, held) = keyed_hold(object);
        Self { key, held }
    }
}

impl<K: DeserializeOwned> SavedPacked<K> {
    /// The object, decoded (tools and tests).
    pub fn decode(&self) -> K {
        self.held.decode()
    }
}

impl<K> Debug for SavedPacked<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SavedPacked").field("key", &self.key).field("json", &self.held.text()).finish()
    }
}

impl<K> Serialize for SavedPacked<K> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.held.serialize(serializer)
    }
}

impl<'de, K: Slim + Serialize + DeserializeOwned> Deserialize<'de> for SavedPacked<K> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        K::deserialize(deserializer).map(Self::from)
    }
}

kept_packed!(Service);
kept_packed!(EndpointSlice);

/// Decoded with only the fields a reader uses, kept compact (`k8s::pod`), written as the Pod
/// JSON of those fields and read back one at a time, so a restore never holds 150,000 decoded
/// Pods besides.
impl Watched for PodFields {
    type Held = Arc<SlimPod>;
    type Saved = SlimPod;
    fn saved(held: &Arc<SlimPod>) -> SlimPod {
        (**held).clone()
    }
    fn restored(saved: SlimPod) -> (ObjectKey, Arc<SlimPod>) {
        (ObjectKey { namespace: saved.namespace.clone(), name: saved.name.clone() }, Arc::new(saved))
    }
    fn saved_key(saved: &SlimPod) -> (&str, &str) {
        (&saved.namespace, &saved.name)
    }
    fn write_saved<S: Serializer>(held: &Arc<SlimPod>, serializer: S) -> Result<S::Ok, S::Error> {
        (**held).serialize(serializer)
    }
}

/// Decoded with only the name, version and labels (`k8s::namespace`), kept compact.
impl Watched for NamespaceFields {
    type Held = Arc<SlimNamespace>;
    type Saved = SlimNamespace;
    fn saved(held: &Arc<SlimNamespace>) -> SlimNamespace {
        (**held).clone()
    }
    fn restored(saved: SlimNamespace) -> (ObjectKey, Arc<SlimNamespace>) {
        (ObjectKey { namespace: super::intern::string(""), name: saved.name.clone() }, Arc::new(saved))
    }
    fn saved_key(saved: &SlimNamespace) -> (&str, &str) {
        ("", &saved.name)
    }
    fn write_saved<S: Serializer>(held: &Arc<SlimNamespace>, serializer: S) -> Result<S::Ok, S::Error> {
        (**held).serialize(serializer)
    }
}

/// Decoded with only the fields a reader uses (`k8s::node`), kept as the slimmed Node the
/// readers take. Read by the routing, services and node-network controllers, each following
/// the changed Nodes. The checkpoint keeps them without their BGP passwords, each copy made as
/// it is written.
impl Watched for NodeFields {
    type Held = Arc<Node>;
    type Saved = Node;
    const JOURNALED: bool = true;
    fn saved(held: &Arc<Node>) -> Node {
        super::checkpoint::node_for_checkpoint(held)
    }
    fn restored(saved: Node) -> (ObjectKey, Arc<Node>) {
        keyed_hold(saved)
    }
    fn saved_key(saved: &Node) -> (&str, &str) {
        resource_key(saved)
    }
}

#[cfg(test)]
mod tests {
    use crate::k8s::watch::{Kind, WATCHED_RESOURCES};

    /// A slice read from the checkpoint is packed as it is read: the same key and text as the
    /// store holds for that slice from the API (so a relist finds it unchanged), written back as
    /// the same JSON; one an earlier agent wrote with the fields no reader uses is slimmed.
    #[test]
    fn a_packed_kind_is_read_from_the_checkpoint_as_the_store_holds_it() {
        use k8s_openapi::api::discovery::v1::EndpointSlice;

        use super::*;
        let written = serde_json::json!({
            "addressType": "IPv4", "metadata": {"name": "web-1", "namespace": "shop", "resourceVersion": "7",
                "labels": {"kubernetes.io/service-name": "web"}},
            "endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": true}, "nodeName": "node-1",
                "targetRef": {"kind": "Pod", "name": "web-1-abc", "namespace": "shop"}}],
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]});
        let saved: SavedPacked<EndpointSlice> = serde_json::from_value(written.clone()).unwrap();
        let from_api: (ObjectKey, Packed<EndpointSlice>) =
            keyed_hold(serde_json::from_value::<EndpointSlice>(written).unwrap());
        let (key, held) = <EndpointSlice as Watched>::restored(saved.clone());
        assert_eq!(key, from_api.0);
        assert!(held == from_api.1, "{} != {}", held.text(), from_api.1.text());
        assert_eq!(key, ObjectKey::new("shop", "web-1"));
        assert_eq!(<EndpointSlice as Watched>::saved_key(&saved), ("shop", "web-1"));
        let text = serde_json::to_string(&saved).unwrap();
        assert!(!text.contains("targetRef"), "slimmed: {text}");
        assert_eq!(serde_json::from_str::<SavedPacked<EndpointSlice>>(&text).unwrap(), saved);
        assert_eq!(<EndpointSlice as Watched>::saved(&held), saved);
    }

    /// The generated lists agree with one another and with what the API calls the kinds.
    #[test]
    fn every_kind_is_watched_checkpointed_and_reported_under_its_names() {
        let resources: Vec<&str> = Kind::ALL.iter().map(|k| k.resource()).collect();
        assert_eq!(resources, ["services", "endpointslices", "pods", "namespaces", "nodes", "networkpolicies"]);
        assert_eq!(WATCHED_RESOURCES.map(|(_, r)| r).to_vec(), resources);
        assert_eq!(WATCHED_RESOURCES[1].0, "discovery.k8s.io");
        assert_eq!(WATCHED_RESOURCES[5].0, "networking.k8s.io");
        let fields: Vec<&str> = Kind::ALL.iter().map(|k| k.field()).collect();
        let checkpoint = serde_json::to_value(crate::k8s::checkpoint::Checkpoint::default()).unwrap();
        let mut written: Vec<&str> = checkpoint.as_object().unwrap().keys().map(String::as_str).collect();
        written.retain(|k| *k != "written_unix");
        written.sort();
        let mut sorted = fields.clone();
        sorted.sort();
        assert_eq!(written, sorted, "the checkpoint holds one list per kind under its field name");
        for (i, kind) in Kind::ALL.iter().enumerate() {
            assert_eq!(kind.index(), i);
        }
    }
}
