//! The fixed table of resource types the fake server knows about.

/// One served resource type (a REST collection).
#[derive(Debug, PartialEq, Eq)]
pub struct ResourceType {
    /// API group; empty for the core group.
    pub group: &'static str,
    pub version: &'static str,
    pub kind: &'static str,
    /// Lower-case plural used in URL paths.
    pub plural: &'static str,
    pub namespaced: bool,
}

impl ResourceType {
    /// `apiVersion` as written in objects: `v1` or `group/version`.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_string()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    pub fn list_kind(&self) -> String {
        format!("{}List", self.kind)
    }
}

/// Every resource type the server serves. Adding a row here is all it takes to serve another
/// type, as long as the objects need no server-side behaviour beyond storage.
pub const RESOURCE_TYPES: &[ResourceType] = &[
    ResourceType { group: "", version: "v1", kind: "Namespace", plural: "namespaces", namespaced: false },
    ResourceType { group: "", version: "v1", kind: "Node", plural: "nodes", namespaced: false },
    ResourceType { group: "", version: "v1", kind: "Service", plural: "services", namespaced: true },
    ResourceType { group: "", version: "v1", kind: "Pod", plural: "pods", namespaced: true },
    ResourceType { group: "", version: "v1", kind: "Endpoints", plural: "endpoints", namespaced: true },
    ResourceType {
        group: "discovery.k8s.io",
        version: "v1",
        kind: "EndpointSlice",
        plural: "endpointslices",
        namespaced: true,
    },
    ResourceType {
        group: "networking.k8s.io",
        version: "v1",
        kind: "NetworkPolicy",
        plural: "networkpolicies",
        namespaced: true,
    },
];

/// Looks a type up by the `apiVersion` and `kind` written in an object.
pub fn find_by_api_version_kind(api_version: &str, kind: &str) -> Option<&'static ResourceType> {
    RESOURCE_TYPES.iter().find(|resource| resource.kind == kind && resource.api_version() == api_version)
}

/// Looks a type up by kind alone; kinds are unique within the table.
pub fn find_by_kind(kind: &str) -> Option<&'static ResourceType> {
    RESOURCE_TYPES.iter().find(|resource| resource.kind == kind)
}

/// Looks a type up by the URL coordinates of its collection.
pub fn find_by_plural(group: &str, version: &str, plural: &str) -> Option<&'static ResourceType> {
    RESOURCE_TYPES
        .iter()
        .find(|resource| resource.group == group && resource.version == version && resource.plural == plural)
}
