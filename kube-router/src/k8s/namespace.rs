//! Namespaces as the agent watches, keeps and checkpoints them: a name and labels, which is all
//! a NetworkPolicy's `namespaceSelector` reads.
//!
//! The watcher decodes a Namespace straight into [`NamespaceFields`] (everything but the name,
//! version and labels skipped unparsed: spec, status, annotations, managedFields), and the store
//! keeps each as a [`SlimNamespace`], its labels the shared set every object with the same
//! labels holds (`k8s::intern`). Kept as `k8s-openapi` Namespaces, 5,000 of them were an
//! `ObjectMeta` of empty options and a `BTreeMap` of `String`s each.
//!
//! The checkpoint writes a [`SlimNamespace`] as the Namespace JSON of those fields, which an
//! earlier agent reads as a Namespace, and reads back what an earlier agent wrote (a slimmed
//! `k8s-openapi` Namespace): the checkpoint's version does not change.
use std::sync::Arc;

use k8s_openapi::api::core::v1::Namespace;
use kube::api::ObjectMeta;
use serde::{Deserialize, Deserializer, Serialize};

use super::labels::Labels;
use super::store::{Held, ObjectKey};

/// A Namespace as the watcher decodes it: only the fields some reader uses. Watched as the
/// core/v1 Namespace it is (`Api<NamespaceFields>`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NamespaceFields {
    #[serde(default, deserialize_with = "super::pod::identity_meta")]
    pub metadata: ObjectMeta,
}

super::slim::decoded_as!(NamespaceFields, Namespace);

/// A Namespace as the store keeps it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlimNamespace {
    pub name: Arc<str>,
    /// The resourceVersion, when it is a number (as every real API server's is).
    pub version: Option<u64>,
    /// The object's own labels (the policy compiler adds `kubernetes.io/metadata.name`).
    pub labels: Labels,
}

impl SlimNamespace {
    pub fn from_fields(fields: NamespaceFields) -> Self {
        let meta = fields.metadata;
        SlimNamespace {
            name: Arc::from(meta.name.as_deref().unwrap_or_default()),
            version: meta.resource_version.as_deref().and_then(|v| v.parse().ok()),
            labels: meta.labels.as_ref().map(Labels::from).unwrap_or_default(),
        }
    }

    /// The Namespace JSON this namespace is written as (the checkpoint), and read back from.
    pub fn to_fields(&self) -> NamespaceFields {
        NamespaceFields {
            metadata: ObjectMeta {
                name: (!self.name.is_empty()).then(|| self.name.to_string()),
                resource_version: self.version.map(|v| v.to_string()),
                labels: (!self.labels.is_empty())
                    .then(|| self.labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()),
                ..Default::default()
            },
        }
    }
}

/// The same fields of a `k8s-openapi` Namespace (tests, tools).
impl From<&Namespace> for SlimNamespace {
    fn from(namespace: &Namespace) -> Self {
        let metadata = ObjectMeta {
            name: namespace.metadata.name.clone(),
            resource_version: namespace.metadata.resource_version.clone(),
            labels: namespace.metadata.labels.clone(),
            ..Default::default()
        };
        SlimNamespace::from_fields(NamespaceFields { metadata })
    }
}

/// Written as its Namespace JSON ([`SlimNamespace::to_fields`]).
impl Serialize for SlimNamespace {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.to_fields().serialize(serializer)
    }
}

/// Read as a Namespace (an earlier agent's slimmed `k8s-openapi` Namespace too), keeping only
/// its fields.
impl<'de> Deserialize<'de> for SlimNamespace {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        NamespaceFields::deserialize(deserializer).map(SlimNamespace::from_fields)
    }
}

/// What a reader of Namespaces may be handed: the store's [`SlimNamespace`], or a
/// `k8s-openapi` Namespace (tests, tools), read the same way.
pub trait AsSlimNamespace {
    fn slim_namespace(&self) -> std::borrow::Cow<'_, SlimNamespace>;
}

impl AsSlimNamespace for SlimNamespace {
    fn slim_namespace(&self) -> std::borrow::Cow<'_, SlimNamespace> {
        std::borrow::Cow::Borrowed(self)
    }
}

impl AsSlimNamespace for Arc<SlimNamespace> {
    fn slim_namespace(&self) -> std::borrow::Cow<'_, SlimNamespace> {
        std::borrow::Cow::Borrowed(self)
    }
}

impl AsSlimNamespace for Namespace {
    fn slim_namespace(&self) -> std::borrow::Cow<'_, SlimNamespace> {
        std::borrow::Cow::Owned(SlimNamespace::from(self))
    }
}

impl Held<NamespaceFields> for Arc<SlimNamespace> {
    fn hold(object: NamespaceFields) -> Self {
        Arc::new(SlimNamespace::from_fields(object))
    }
    /// Keyed by the namespace's own (shared) name.
    fn keyed(object: NamespaceFields) -> (ObjectKey, Self) {
        let namespace = super::intern::string(object.metadata.namespace.as_deref().unwrap_or_default());
        let held = Self::hold(object);
        (ObjectKey { namespace, name: held.name.clone() }, held)
    }
    fn version(&self) -> Option<u64> {
        self.version
    }
    fn same_apart_from_version(&self, other: &Self) -> bool {
        self.name == other.name && self.labels == other.labels
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn full_namespace(team: &str) -> serde_json::Value {
        json!({
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": "shop", "uid": "u1", "resourceVersion": "7",
                "labels": {"kubernetes.io/metadata.name": "shop", "team": team},
                "annotations": {"note": "x"}, "managedFields": [{"manager": "kubectl", "fieldsV1": {"f:metadata": {}}}]},
            "spec": {"finalizers": ["kubernetes"]},
            "status": {"phase": "Active"}
        })
    }

    fn slim(json: serde_json::Value) -> SlimNamespace {
        SlimNamespace::from_fields(serde_json::from_value(json).unwrap())
    }

    #[test]
    fn the_name_and_labels_survive_and_nothing_else_is_kept_or_written() {
        let namespace = slim(full_namespace("a"));
        assert_eq!((&*namespace.name, namespace.version), ("shop", Some(7)));
        assert_eq!(namespace.labels.get("team"), Some("a"));
        let typed: Namespace = serde_json::from_value(full_namespace("a")).unwrap();
        assert_eq!(SlimNamespace::from(&typed), namespace);
        let written = serde_json::to_string(&namespace).unwrap();
        for unread in ["u1", "note", "managedFields", "finalizers", "Active"] {
            assert!(!written.contains(unread), "{unread} in {written}");
        }
    }

    #[test]
    fn the_checkpoint_form_reads_back_here_and_as_a_namespace_elsewhere() {
        let namespace = slim(full_namespace("a"));
        let written = serde_json::to_value(&namespace).unwrap();
        assert_eq!(slim(written.clone()), namespace);
        let typed: Namespace = serde_json::from_value(written).unwrap();
        assert_eq!(SlimNamespace::from(&typed), namespace);
        // What an earlier agent wrote (checkpoint version 1: the Namespace slimmed as
        // k8s/slim.rs did, byte for byte) reads as the same namespace.
        let earlier = r#"{"metadata":{"labels":{"kubernetes.io/metadata.name":"shop","team":"a"},"name":"shop","resourceVersion":"7","uid":"u1"}}"#;
        assert_eq!(slim(serde_json::from_str(earlier).unwrap()), namespace);
    }

    #[test]
    fn a_new_version_alone_is_the_same_namespace_and_a_label_change_is_not() {
        let held = |json| <Arc<SlimNamespace> as Held<NamespaceFields>>::hold(serde_json::from_value(json).unwrap());
        let before = held(full_namespace("a"));
        let mut newer = full_namespace("a");
        newer["metadata"]["resourceVersion"] = json!("8");
        newer["metadata"]["annotations"]["note"] = json!("y");
        assert!(before.same_apart_from_version(&held(newer)));
        assert!(!before.same_apart_from_version(&held(full_namespace("b"))));
        for odd in [json!({}), json!({"metadata": null}), json!({"metadata": {"labels": null}})] {
            assert_eq!(&*slim(odd).name, "");
        }
    }
}
