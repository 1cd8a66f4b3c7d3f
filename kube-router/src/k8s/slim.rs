//! What the stores keep of each object: only the fields some part of the agent reads.
//!
//! In a 150,000-pod cluster a full Pod (containers, env, volumes, container statuses) is tens
//! of KiB and changes with every container restart or probe; the agent reads its names,
//! labels, node, host network, phase, addresses and container port names. Keeping only those
//! bounds memory, and an update that touches none of them (a kubelet status heartbeat) compares
//! equal to what the store has and wakes no controller.
//!
//! A field added to a reader must be added here too: `every_field_a_reader_uses_survives`
//! below holds the list.
use k8s_openapi::api::{
    core::v1::{Container, Namespace, Node, NodeSpec, NodeStatus, Pod, PodSpec, PodStatus, Service},
    discovery::v1::EndpointSlice,
    networking::v1::NetworkPolicy,
};
use kube::{api::ObjectMeta, Resource};

/// `kubectl apply`'s copy of the whole object, in an annotation: often the largest field.
const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

pub trait Slim: Resource + Sized {
    /// The object without what no reader uses.
    fn slim(self) -> Self;
}

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

impl Slim for Pod {
    /// Names, labels, node, host network, phase, addresses, and the containers' ports (named
    /// ports of NetworkPolicy; init containers with `restartPolicy: Always` serve too).
    /// Environment, volumes and images (secrets among them) are dropped.
    fn slim(self) -> Self {
        let ports_only = |c: Container| Container {
            name: c.name,
            ports: c.ports,
            restart_policy: c.restart_policy,
            ..Default::default()
        };
        Pod {
            metadata: identity(self.metadata),
            spec: self.spec.map(|spec| PodSpec {
                node_name: spec.node_name,
                host_network: spec.host_network,
                containers: spec.containers.into_iter().map(ports_only).collect(),
                init_containers: spec.init_containers.map(|c| c.into_iter().map(ports_only).collect()),
                ..Default::default()
            }),
            status: self.status.map(|status| PodStatus {
                phase: status.phase,
                pod_ip: status.pod_ip,
                pod_ips: status.pod_ips,
                ..Default::default()
            }),
        }
    }
}

impl Slim for Node {
    /// Metadata with annotations (BGP peers, ASN, pod CIDR overrides), the spec (pod CIDRs),
    /// and of the status only the addresses: conditions, images and the node's info change
    /// with every kubelet heartbeat and are read by nobody here.
    fn slim(mut self) -> Self {
        slim_meta(&mut self.metadata);
        Node {
            metadata: self.metadata,
            spec: self.spec.map(|spec| NodeSpec { config_source: None, ..spec }),
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
    /// ingress), and the annotations carry kube-router's per-Service settings.
    fn slim(mut self) -> Self {
        slim_meta(&mut self.metadata);
        self
    }
}

impl Slim for EndpointSlice {
    fn slim(mut self) -> Self {
        slim_meta(&mut self.metadata);
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

    fn full_pod(restarts: i32) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "web-1", "namespace": "shop", "uid": "u1", "resourceVersion": "7",
                "labels": {"app": "web"}, "annotations": {"note": "x"},
                "managedFields": [{"manager": "kubectl"}], "ownerReferences": [{"apiVersion": "apps/v1",
                "kind": "ReplicaSet", "name": "web", "uid": "r1"}]},
            "spec": {"nodeName": "node-1", "hostNetwork": false,
                "containers": [{"name": "app", "image": "web:1", "env": [{"name": "TOKEN", "value": "secret"}],
                    "ports": [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]}],
                "initContainers": [{"name": "proxy", "image": "p:1", "restartPolicy": "Always",
                    "ports": [{"name": "admin", "containerPort": 9901}]}],
                "volumes": [{"name": "data", "emptyDir": {}}]},
            "status": {"phase": "Running", "podIP": "10.0.1.5", "podIPs": [{"ip": "10.0.1.5"}, {"ip": "fd00::5"}],
                "conditions": [{"type": "Ready", "status": "True"}],
                "containerStatuses": [{"name": "app", "image": "web:1", "imageID": "", "ready": true,
                    "restartCount": restarts}]}
        }))
        .unwrap()
    }

    #[test]
    fn every_field_a_reader_uses_survives() {
        let pod = full_pod(0).slim();
        // What policy::parse::PodInfo and the firewall's pod-address index read.
        let info = crate::policy::parse::PodInfo::from_pod(&pod).expect("a running pod with addresses");
        assert_eq!(info, crate::policy::parse::PodInfo::from_pod(&full_pod(0)).unwrap());
        assert!(info.has_named_ports());
        let spec = pod.spec.as_ref().unwrap();
        assert_eq!(spec.node_name.as_deref(), Some("node-1"));
        assert_eq!(spec.init_containers.as_ref().unwrap()[0].restart_policy.as_deref(), Some("Always"));
        assert_eq!(pod.metadata.labels.as_ref().unwrap()["app"], "web");
        assert_eq!(pod.metadata.resource_version.as_deref(), Some("7"));
        // And nothing of what no reader uses: secrets in env are never kept.
        assert!(spec.containers[0].env.is_none() && spec.volumes.is_none());
        assert!(pod.metadata.managed_fields.is_none() && pod.metadata.owner_references.is_none());
    }

    #[test]
    fn a_status_heartbeat_slims_to_the_same_pod() {
        assert_eq!(full_pod(0).slim(), full_pod(3).slim());
    }

    #[test]
    fn a_node_keeps_annotations_addresses_and_pod_cidrs_only_of_what_changes() {
        let node = |heartbeat: &str| -> Node {
            serde_json::from_value(json!({
                "metadata": {"name": "node-1", "resourceVersion": "3",
                    "annotations": {"kube-router.io/node.asn": "64512", LAST_APPLIED: "{...}"}},
                "spec": {"podCIDR": "10.0.1.0/24", "podCIDRs": ["10.0.1.0/24", "fd00:1::/64"]},
                "status": {"addresses": [{"type": "InternalIP", "address": "192.168.0.1"}],
                    "conditions": [{"type": "Ready", "status": "True", "lastHeartbeatTime": heartbeat}],
                    "images": [{"names": ["registry/app:1"], "sizeBytes": 1000}]}
            }))
            .unwrap()
        };
        let slim = node("2026-12-06T00:00:00Z").slim();
        assert_eq!(slim, node("2026-12-06T00:00:10Z").slim());
        let annotations = slim.metadata.annotations.as_ref().unwrap();
        assert_eq!(annotations.len(), 1, "kubectl's last-applied copy is dropped: {annotations:?}");
        assert_eq!(slim.spec.as_ref().unwrap().pod_cidrs.as_ref().unwrap().len(), 2);
        let status = slim.status.as_ref().unwrap();
        assert_eq!(status.addresses.as_ref().unwrap()[0].address, "192.168.0.1");
        assert!(status.images.is_none() && status.conditions.is_none());
    }
}
