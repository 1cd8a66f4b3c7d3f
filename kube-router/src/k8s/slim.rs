//! What the stores keep of each object: only the fields some part of the agent reads.
//!
//! Keeping only those bounds memory, and an update that touches none of them (a kubelet status
//! heartbeat) compares equal to what the store has and wakes no controller. Pods, most of the
//! objects, are decoded with only those fields in the first place and kept in a compact form of
//! their own (k8s/pod.rs).
//!
//! A field added to a reader must be added here too: `a_node_keeps_what_its_readers_use`
//! below holds the list for Nodes, `every_field_a_reader_uses_survives` in k8s/pod.rs for Pods.
use std::collections::BTreeMap;

use k8s_openapi::api::{
    core::v1::{Namespace, Node, NodeSpec, NodeStatus, Service},
    discovery::v1::EndpointSlice,
    networking::v1::NetworkPolicy,
};
use kube::{api::ObjectMeta, Resource};

use super::TOPOLOGY_ZONE_LABEL;

/// `kubectl apply`'s copy of the whole object, in an annotation: often the largest field.
const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

pub trait Slim: Resource + Sized {
    /// The object without what no reader uses.
    fn slim(self) -> Self;
}

/// A type that decodes only the fields some reader uses of `$kind`, watched as that kind
/// (`Api<$fields>`: the same API path and scope) and already slim as decoded.
macro_rules! decoded_as {
    ($fields:ty, $kind:ty) => {
        impl k8s_openapi::Resource for $fields {
            const API_VERSION: &'static str = <$kind as k8s_openapi::Resource>::API_VERSION;
            const GROUP: &'static str = <$kind as k8s_openapi::Resource>::GROUP;
            const KIND: &'static str = <$kind as k8s_openapi::Resource>::KIND;
            const VERSION: &'static str = <$kind as k8s_openapi::Resource>::VERSION;
            const URL_PATH_SEGMENT: &'static str = <$kind as k8s_openapi::Resource>::URL_PATH_SEGMENT;
            type Scope = <$kind as k8s_openapi::Resource>::Scope;
        }

        impl k8s_openapi::Metadata for $fields {
            type Ty = kube::api::ObjectMeta;
            fn metadata(&self) -> &kube::api::ObjectMeta {
                &self.metadata
            }
            fn metadata_mut(&mut self) -> &mut kube::api::ObjectMeta {
                &mut self.metadata
            }
        }

        impl $crate::k8s::slim::Slim for $fields {
            fn slim(self) -> Self {
                self
            }
        }
    };
}
pub(crate) use decoded_as;

/// Server-side apply bookkeeping and `kubectl apply`'s copy go for every kind.
fn slim_meta(meta: &mut ObjectMeta) {
    meta.managed_fields = None;
    if let Some(annotations) = meta.annotations.as_mut() {
        annotations.remove(LAST_APPLIED);
        if annotations.is_empty() {
            meta.annotations = None;
        }
    }
}

/// Identity, labels and version only: what selectors and the stores read.
fn identity(meta: ObjectMeta) -> ObjectMeta {
    ObjectMeta {
        name: meta.name,
        namespace: meta.namespace,
        uid: meta.uid,
        resource_version: meta.resource_version,
        labels: meta.labels,
        ..Default::default()
    }
}

/// Every Node annotation the agent reads is kube-router's own (BGP peers, ASN, pod CIDR
/// overrides): other controllers' annotations on Nodes (TTL, CSI, autoscalers) change at their
/// own pace and are read by nobody here.
pub const NODE_ANNOTATION_PREFIX: &str = "kube-router.io/";

/// The entries of `map` that `keep` names; `None` when none is left.
fn kept(map: Option<BTreeMap<String, String>>, keep: impl Fn(&str) -> bool) -> Option<BTreeMap<String, String>> {
    let kept: BTreeMap<String, String> = map?.into_iter().filter(|(key, _)| keep(key)).collect();
    (!kept.is_empty()).then_some(kept)
}

impl Slim for Node {
    /// Name, kube-router's annotations, the zone label, the pod CIDRs and the addresses. What
    /// else changes on a Node — status heartbeats, conditions, images, volumes, taints and
    /// cordons, other labels and annotations — is read by nobody here, so an update of only
    /// those compares equal to what the store has and wakes no controller (with 5,000 Nodes
    /// that is most Node updates).
    fn slim(self) -> Self {
        let meta = self.metadata;
        Node {
            metadata: ObjectMeta {
                name: meta.name,
                uid: meta.uid,
                resource_version: meta.resource_version,
                labels: kept(meta.labels, |key| key == TOPOLOGY_ZONE_LABEL),
                annotations: kept(meta.annotations, |key| key.starts_with(NODE_ANNOTATION_PREFIX)),
                ..Default::default()
            },
            spec: self.spec.map(|spec| NodeSpec {
                pod_cidr: spec.pod_cidr,
                pod_cidrs: spec.pod_cidrs,
                ..Default::default()
            }),
            status: self.status.map(|status| NodeStatus { addresses: status.addresses, ..Default::default() }),
        }
    }
}

impl Slim for Namespace {
    /// Namespace selectors read the name and the labels.
    fn slim(self) -> Self {
        Namespace { metadata: identity(self.metadata), ..Default::default() }
    }
}

impl Slim for Service {
    /// Every field of spec and status may be read (ports, IPs, policies, load-balancer
    /// ingress), and the annotations carry kube-router's per-Service settings. Decoding leaves
    /// lists with room to grow (4 → 8 → 16); every object is kept as long as it exists, so its
    /// lists are cut to their length.
    fn slim(mut self) -> Self {
        slim_meta(&mut self.metadata);
        if let Some(spec) = self.spec.as_mut() {
            for list in [&mut spec.cluster_ips, &mut spec.external_ips, &mut spec.ip_families].into_iter().flatten() {
                list.shrink_to_fit();
            }
            if let Some(ports) = spec.ports.as_mut() {
                ports.shrink_to_fit();
            }
        }
        self
    }
}

impl Slim for EndpointSlice {
    fn slim(mut self) -> Self {
        slim_meta(&mut self.metadata);
        // Which pod serves an endpoint, its hostname and zone: no reader uses them (the
        // services layer reads addresses, conditions, node name and hints), and they were a
        // third of each slice's kept text, the stores' largest part after Pods (issue 29).
        for endpoint in &mut self.endpoints {
            endpoint.target_ref = None;
            endpoint.hostname = None;
            endpoint.zone = None;
            endpoint.deprecated_topology = None;
        }
        self
    }
}

impl Slim for NetworkPolicy {
    fn slim(mut self) -> Self {
        slim_meta(&mut self.metadata);
        self
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn full_node(heartbeat: &str, extra: serde_json::Value) -> Node {
        let mut node = json!({
            "metadata": {"name": "node-1", "uid": "n1", "resourceVersion": "3",
                "labels": {"topology.kubernetes.io/zone": "zone-a", "kubernetes.io/hostname": "node-1"},
                "annotations": {"kube-router.io/node.asn": "64512", "kube-router.io/pod-cidrs": "10.9.0.0/24",
                    "node.alpha.kubernetes.io/ttl": "0", LAST_APPLIED: "{...}"},
                "managedFields": [{"manager": "kubelet"}]},
            "spec": {"podCIDR": "10.0.1.0/24", "podCIDRs": ["10.0.1.0/24", "fd00:1::/64"], "providerID": "aws:///i-1"},
            "status": {"addresses": [{"type": "InternalIP", "address": "192.168.0.1"},
                    {"type": "ExternalIP", "address": "198.51.100.1"}, {"type": "Hostname", "address": "node-1"}],
                "conditions": [{"type": "Ready", "status": "True", "lastHeartbeatTime": heartbeat}],
                "images": [{"names": ["registry/app:1"], "sizeBytes": 1000}],
                "nodeInfo": {"kubeletVersion": "v1.31.0", "machineID": "", "systemUUID": "", "bootID": "",
                    "kernelVersion": "", "osImage": "", "containerRuntimeVersion": "", "kubeProxyVersion": "",
                    "operatingSystem": "linux", "architecture": "amd64"}}
        });
        json_patch(&mut node, extra);
        serde_json::from_value(node).unwrap()
    }

    /// `patch` merged into `target` (objects key by key, anything else replaced).
    fn json_patch(target: &mut serde_json::Value, patch: serde_json::Value) {
        match (target, patch) {
            (serde_json::Value::Object(target), serde_json::Value::Object(patch)) => {
                for (key, value) in patch {
                    json_patch(target.entry(key).or_insert(serde_json::Value::Null), value);
                }
            }
            (target, patch) => *target = patch,
        }
    }

    /// The services layer converts a slimmed slice as the whole one; what went is gone.
    #[test]
    fn an_endpoint_slice_keeps_what_its_readers_use() {
        let whole: EndpointSlice = serde_json::from_value(json!({
            "addressType": "IPv4",
            "metadata": {"name": "web-1", "namespace": "shop", "resourceVersion": "4",
                "labels": {"kubernetes.io/service-name": "web"}, "managedFields": [{"manager": "x"}]},
            "endpoints": [
                {"addresses": ["10.0.0.1"], "conditions": {"ready": true, "serving": true, "terminating": false},
                 "nodeName": "node-1", "zone": "zone-a", "hostname": "web-0", "hints": {"forZones": [{"name": "zone-a"}]},
                 "deprecatedTopology": {"a": "b"}, "targetRef": {"kind": "Pod", "namespace": "shop", "name": "web-0"}},
                {"addresses": ["10.0.0.2"], "conditions": {"ready": false, "serving": true, "terminating": true},
                 "nodeName": "node-2", "targetRef": {"kind": "Pod", "namespace": "shop", "name": "web-1"}}],
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}, {"port": 53, "protocol": "UDP"}],
        }))
        .unwrap();
        let slim = whole.clone().slim();
        let convert = crate::services::from_k8s::endpoint_slice;
        assert_eq!(convert(&slim), convert(&whole));
        assert!(convert(&whole).unwrap().is_some());
        let dropped = |e: &k8s_openapi::api::discovery::v1::Endpoint| {
            e.target_ref.is_none() && e.hostname.is_none() && e.zone.is_none() && e.deprecated_topology.is_none()
        };
        assert!(slim.endpoints.iter().all(dropped));
        assert_eq!(slim.endpoints[0].node_name.as_deref(), Some("node-1"));
        assert!(slim.endpoints[0].hints.is_some());
    }

    #[test]
    fn a_node_keeps_what_its_readers_use() {
        let full = full_node("2026-12-06T00:00:00Z", json!({}));
        let slim = full.clone().slim();
        // What BGP, CNI, egress and the service proxy read gives the same answers.
        assert_eq!(crate::node::pod_cidrs::node_pod_cidrs(&slim), crate::node::pod_cidrs::node_pod_cidrs(&full));
        assert_eq!(
            crate::node::pod_cidrs::all_node_pod_cidrs(&slim),
            crate::node::pod_cidrs::all_node_pod_cidrs(&full)
        );
        assert_eq!(crate::node::pod_cidrs::spec_pod_cidrs(&slim).len(), 2);
        let addresses = |n: &Node| crate::services::from_k8s::node_object_addresses(n).collect::<Vec<_>>();
        assert_eq!(addresses(&slim), addresses(&full));
        assert_eq!(
            crate::node::egress::cluster_nets([&slim], &[], &[]),
            crate::node::egress::cluster_nets([&full], &[], &[])
        );
        assert_eq!(slim.status.as_ref().unwrap().addresses.as_ref().unwrap().len(), 3);
        assert_eq!(slim.metadata.labels.as_ref().unwrap()[TOPOLOGY_ZONE_LABEL], "zone-a");
        let annotations: Vec<&str> = slim.metadata.annotations.as_ref().unwrap().keys().map(String::as_str).collect();
        assert_eq!(annotations, ["kube-router.io/node.asn", "kube-router.io/pod-cidrs"]);
        assert_eq!(slim.metadata.resource_version.as_deref(), Some("3"));
        // Nothing else.
        assert!(slim.metadata.managed_fields.is_none() && slim.spec.as_ref().unwrap().provider_id.is_none());
        let status = slim.status.as_ref().unwrap();
        assert!(status.images.is_none() && status.conditions.is_none() && status.node_info.is_none());
    }

    /// Every Node annotation a reader looks up is one the slimmed Node keeps.
    #[test]
    fn every_node_annotation_read_is_kept() {
        use crate::routing::bgp::peers::*;
        let read = [
            NODE_ASN_ANNOTATION,
            ROUTER_ID_ANNOTATION,
            RR_SERVER_ANNOTATION,
            RR_CLIENT_ANNOTATION,
            PEER_IPS_ANNOTATION,
            PEER_ASNS_ANNOTATION,
            PEER_PASSWORDS_ANNOTATION,
            PEER_PORTS_ANNOTATION,
            PEER_LOCAL_IPS_ANNOTATION,
            PEERS_ANNOTATION,
            LOCAL_ADDRESSES_ANNOTATION,
            PATH_PREPEND_AS_ANNOTATION,
            PATH_PREPEND_REPEAT_ANNOTATION,
            COMMUNITIES_ANNOTATION,
            CUSTOM_IMPORT_REJECT_ANNOTATION,
            crate::node::pod_cidrs::POD_CIDR_ANNOTATION,
            crate::node::pod_cidrs::POD_CIDRS_ANNOTATION,
        ];
        for annotation in read {
            assert!(annotation.starts_with(NODE_ANNOTATION_PREFIX), "{annotation} would be dropped");
        }
    }

    /// What changes on a Node all day long, none of it read: each slims to the same Node.
    #[test]
    fn node_updates_of_nothing_read_slim_to_the_same_node() {
        let before = full_node("2026-12-06T00:00:00Z", json!({})).slim();
        let unread = [
            json!({"status": {"conditions": [{"type": "Ready", "status": "True", "lastHeartbeatTime": "2026-12-06T00:05:00Z"}]}}),
            json!({"status": {"conditions": [{"type": "Ready", "status": "False"}], "volumesInUse": ["kubernetes.io/csi/x"]}}),
            json!({"status": {"images": [{"names": ["registry/app:2"], "sizeBytes": 2000}]}}),
            json!({"spec": {"taints": [{"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}]}}),
            json!({"spec": {"unschedulable": true}}),
            json!({"metadata": {"labels": {"feature.node.kubernetes.io/cpu-avx": "true"}}}),
            json!({"metadata": {"annotations": {"node.alpha.kubernetes.io/ttl": "15", "csi.volume.kubernetes.io/nodeid": "{}"}}}),
            json!({"metadata": {"finalizers": ["example.com/drain"], "generation": 4}}),
        ];
        for patch in unread {
            let after = full_node("2026-12-06T00:00:00Z", patch.clone()).slim();
            assert_eq!(before, after, "{patch}");
        }
        let read = [
            json!({"spec": {"podCIDRs": ["10.0.2.0/24"]}}),
            json!({"status": {"addresses": [{"type": "InternalIP", "address": "192.168.0.2"}]}}),
            json!({"metadata": {"labels": {"topology.kubernetes.io/zone": "zone-b"}}}),
            json!({"metadata": {"annotations": {"kube-router.io/rr.client": "1"}}}),
        ];
        for patch in read {
            let after = full_node("2026-12-06T00:00:00Z", patch.clone()).slim();
            assert_ne!(before, after, "{patch}");
        }
    }
}
