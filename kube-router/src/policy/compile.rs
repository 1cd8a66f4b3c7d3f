//! From-scratch compilation of a full set of inputs.

use std::collections::HashMap;

use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;

use super::error::PolicyError;
use super::inputs::Inputs;
use super::model::{CompiledModel, PodSetKey};
use super::parse::{namespace_labels, PodInfo, ValidatedPolicy};
use crate::k8s::{namespace::AsSlimNamespace, pod::AsSlimPod};

/// Everything a compile produces.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CompileOutput {
    pub model: CompiledModel,
    /// Policies skipped as invalid, sorted by namespace/name.
    pub policy_errors: Vec<PolicyError>,
}

impl CompileOutput {
    pub fn skipped_policy_count(&self) -> usize {
        self.policy_errors.len()
    }
}

/// Loads objects into an input store (later duplicates replace earlier ones).
pub(crate) fn load_inputs<'a, P: AsSlimPod + 'a, N: AsSlimNamespace + 'a>(
    pods: impl IntoIterator<Item = &'a P>,
    namespaces: impl IntoIterator<Item = &'a N>,
    policies: impl IntoIterator<Item = &'a NetworkPolicy>,
) -> Inputs {
    let mut inputs = Inputs::default();
    for namespace in namespaces {
        if let Some((name, labels)) = namespace_labels(namespace) {
            inputs.set_namespace(name, labels);
        }
    }
    for pod in pods {
        let pod = pod.slim_pod();
        inputs.remove_pod(&super::parse::pod_ref(&pod));
        if let Some(info) = PodInfo::from_pod(&pod) {
            inputs.insert_pod(info);
        }
    }
    for policy in policies {
        let namespace = policy.metadata.namespace.clone().unwrap_or_default();
        let name = policy.metadata.name.clone().unwrap_or_default();
        inputs.set_policy(&namespace, &name, ValidatedPolicy::from_k8s(policy));
    }
    inputs.pack();
    inputs
}

/// Compiles every pod entry and every referenced pod set of `inputs`.
pub(crate) fn compile_inputs(inputs: &Inputs) -> CompileOutput {
    compile_counting_references(inputs).0
}

/// [`compile_inputs`], with how many rules reference each pod set (what the incremental
/// compiler keeps). 10,000 pods name ~1,000 sets ~50,000 times: they are counted by hash and
/// only the distinct ones sorted.
pub(crate) fn compile_counting_references(inputs: &Inputs) -> (CompileOutput, HashMap<PodSetKey, usize>) {
    let mut output = CompileOutput::default();
    for ip in inputs.pod_ips() {
        if let Some(rules) = inputs.compute_pod(ip) {
            output.model.pods.insert(ip, rules);
        }
    }
    let mut references: HashMap<&PodSetKey, usize> = HashMap::new();
    for key in output.model.pods.values().flat_map(|rules| rules.referenced_pod_sets()) {
        *references.entry(key).or_default() += 1;
    }
    let mut referenced: Vec<&PodSetKey> = references.keys().copied().collect();
    referenced.sort_unstable();
    output.model.pod_sets = referenced.into_iter().map(|key| (key.clone(), inputs.pod_set_members(key))).collect();
    let references = references.into_iter().map(|(key, count)| (key.clone(), count)).collect();
    output.policy_errors = inputs.policy_errors().cloned().collect();
    output.policy_errors.sort();
    (output, references)
}

/// Compiles a complete snapshot of the cluster's pods, namespaces and
/// NetworkPolicies. Invalid policies are skipped and reported; pods without
/// IPs, in a terminal phase or on the host network are ignored.
pub fn compile(pods: &[Pod], namespaces: &[Namespace], policies: &[NetworkPolicy]) -> CompileOutput {
    compile_inputs(&load_inputs(pods, namespaces, policies))
}
