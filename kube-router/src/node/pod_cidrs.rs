//! A Node's pod CIDRs as upstream kube-router reads them: the `kube-router.io/pod-cidr`
//! annotation (one CIDR) first, then `kube-router.io/pod-cidrs` (comma-separated), then
//! `spec.podCIDRs` (or the older `spec.podCIDR`). The annotations let a node run a pod range the
//! controller-manager did not allocate; every reader (CNI, BGP, egress, `cleanup --legacy`)
//! takes the node's ranges from here, so they agree.
//!
//! Unlike upstream, which skips an unparsable entry and uses what is left, a malformed
//! annotation is an error for the whole node: advertising a shorter list would withdraw a
//! working pod route. The caller keeps what it had and reports it.
use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node;

pub const POD_CIDR_ANNOTATION: &str = "kube-router.io/pod-cidr";
pub const POD_CIDRS_ANNOTATION: &str = "kube-router.io/pod-cidrs";

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("node {node:?} has annotation {annotation}={value:?}, which is not a comma-separated list of CIDRs ({entry:?}: {reason})")]
pub struct PodCidrAnnotationError {
    pub node: String,
    pub annotation: &'static str,
    pub value: String,
    pub entry: String,
    pub reason: String,
}

/// The node's pod CIDRs (truncated to their network, duplicates dropped, in the order given).
/// `spec` entries that do not parse are left out (the API server validates them; this is not
/// the place to second-guess it). A node without any: empty.
pub fn node_pod_cidrs(node: &Node) -> Result<Vec<IpNet>, PodCidrAnnotationError> {
    annotated_pod_cidrs(node).unwrap_or_else(|| Ok(spec_pod_cidrs(node)))
}

/// The annotations' pod CIDRs; `None` when neither annotation is set (or both are empty).
pub fn annotated_pod_cidrs(node: &Node) -> Option<Result<Vec<IpNet>, PodCidrAnnotationError>> {
    let annotation = |key: &'static str| {
        let value = node.metadata.annotations.as_ref()?.get(key)?;
        (!value.trim().is_empty()).then_some((key, value.as_str()))
    };
    let (key, value) = annotation(POD_CIDR_ANNOTATION).or_else(|| annotation(POD_CIDRS_ANNOTATION))?;
    let error = |entry: &str, reason: String| PodCidrAnnotationError {
        node: node.metadata.name.clone().unwrap_or_default(),
        annotation: key,
        value: value.to_string(),
        entry: entry.to_string(),
        reason,
    };
    let mut out = Vec::new();
    for entry in value.split(',').map(str::trim) {
        match entry.parse::<IpNet>() {
            Ok(net) => push_unique(&mut out, net),
            Err(e) => return Some(Err(error(entry, e.to_string()))),
        }
    }
    // The single-CIDR annotation takes one, as upstream's.
    if key == POD_CIDR_ANNOTATION && out.len() > 1 {
        return Some(Err(error(value, format!("one CIDR expected (several go in {POD_CIDRS_ANNOTATION})"))));
    }
    Some(Ok(out))
}

/// `spec.podCIDRs`, else `spec.podCIDR`: what the controller-manager allocated.
pub fn spec_pod_cidrs(node: &Node) -> Vec<IpNet> {
    let spec = node.spec.as_ref();
    let raw: Vec<&str> = match spec.and_then(|s| s.pod_cidrs.as_ref()).filter(|v| !v.is_empty()) {
        Some(list) => list.iter().map(String::as_str).collect(),
        None => spec.and_then(|s| s.pod_cidr.as_deref()).into_iter().collect(),
    };
    let mut out = Vec::new();
    for net in raw.iter().filter_map(|c| c.trim().parse::<IpNet>().ok()) {
        push_unique(&mut out, net);
    }
    out
}

/// Every range the node's pods may hold: the annotations' (when they parse) and the spec's.
/// For readers that must cover any of them (what is inside the cluster, what upstream routed).
pub fn all_node_pod_cidrs(node: &Node) -> Vec<IpNet> {
    let mut out = node_pod_cidrs(node).unwrap_or_default();
    for net in spec_pod_cidrs(node) {
        push_unique(&mut out, net);
    }
    out
}

fn push_unique(out: &mut Vec<IpNet>, net: IpNet) {
    let net = net.trunc();
    if !out.contains(&net) {
        out.push(net);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(annotations: &[(&str, &str)], spec: &[&str]) -> Node {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "node-1", "annotations": annotations.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<std::collections::BTreeMap<_, _>>()},
            "spec": {"podCIDR": spec.first(), "podCIDRs": spec},
        }))
        .unwrap()
    }

    fn nets(list: &[&str]) -> Vec<IpNet> {
        list.iter().map(|n| n.parse().unwrap()).collect()
    }

    #[test]
    fn pod_cidr_wins_over_pod_cidrs_which_wins_over_the_spec() {
        let spec = ["10.244.1.0/24", "fd00:244:1::/64"];
        assert_eq!(node_pod_cidrs(&node(&[], &spec)).unwrap(), nets(&spec));
        let with_list = node(&[(POD_CIDRS_ANNOTATION, "10.50.0.0/24, fd00:50::/64")], &spec);
        assert_eq!(node_pod_cidrs(&with_list).unwrap(), nets(&["10.50.0.0/24", "fd00:50::/64"]));
        let both = node(&[(POD_CIDR_ANNOTATION, "10.60.0.0/24"), (POD_CIDRS_ANNOTATION, "10.50.0.0/24")], &spec);
        assert_eq!(node_pod_cidrs(&both).unwrap(), nets(&["10.60.0.0/24"]));
        // Empty annotations count as unset; host bits are dropped, duplicates once.
        let empty = node(&[(POD_CIDR_ANNOTATION, " "), (POD_CIDRS_ANNOTATION, "10.50.0.7/24,10.50.0.0/24")], &spec);
        assert_eq!(node_pod_cidrs(&empty).unwrap(), nets(&["10.50.0.0/24"]));
        // Only spec.podCIDR (clusters before dual-stack).
        let old: Node = serde_json::from_value(serde_json::json!({"spec": {"podCIDR": "10.244.9.0/24"}})).unwrap();
        assert_eq!(node_pod_cidrs(&old).unwrap(), nets(&["10.244.9.0/24"]));
        assert_eq!(node_pod_cidrs(&Node::default()).unwrap(), Vec::<IpNet>::new());
    }

    #[test]
    fn a_malformed_annotation_is_an_error_naming_it_not_a_shorter_list() {
        let spec = ["10.244.1.0/24"];
        let bad = node(&[(POD_CIDRS_ANNOTATION, "10.50.0.0/24,10.51.0.0/33")], &spec);
        let error = node_pod_cidrs(&bad).unwrap_err();
        assert_eq!(error.annotation, POD_CIDRS_ANNOTATION);
        assert_eq!(error.entry, "10.51.0.0/33");
        assert!(error.to_string().contains("kube-router.io/pod-cidrs=\"10.50.0.0/24,10.51.0.0/33\""), "{error}");
        let bad = node(&[(POD_CIDR_ANNOTATION, "garbage")], &spec);
        assert_eq!(node_pod_cidrs(&bad).unwrap_err().annotation, POD_CIDR_ANNOTATION);
        let two = node(&[(POD_CIDR_ANNOTATION, "10.50.0.0/24,10.51.0.0/24")], &spec);
        assert!(node_pod_cidrs(&two).unwrap_err().reason.contains("one CIDR"));
        // Readers that must cover every range still get the spec's.
        assert_eq!(all_node_pod_cidrs(&bad), nets(&spec));
        let good = node(&[(POD_CIDR_ANNOTATION, "10.60.0.0/24")], &spec);
        assert_eq!(all_node_pod_cidrs(&good), nets(&["10.60.0.0/24", "10.244.1.0/24"]));
    }
}
