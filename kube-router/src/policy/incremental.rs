//! Incremental compilation: keeps inputs and output, and on each object
//! change recomputes only the entries that can depend on it, reporting the
//! difference as a [`Delta`] for the agent to write to its maps.
//!
//! Dependencies (what invalidates what):
//! * a pod entry depends on its own pod (labels, ports, IP ownership) and the
//!   policies of its namespace that select it; for policies with *egress named
//!   ports* also on other pods' named ports (the per-destination split);
//! * a pod-set's membership of an IP depends on the owning pod and the labels
//!   of its namespace.
//!
//! So a pod label change recomputes that pod's entries and its pod-set
//! memberships only (plus egress-named-port targets when it carries named
//! ports); other pods see the change through the shared pod-set entries.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;

use k8s_openapi::api::networking::v1::NetworkPolicy;

use super::compile::{compile_counting_references, load_inputs, CompileOutput};
use super::error::PolicyError;
use super::inputs::Inputs;
use super::model::{CompiledModel, PodRef, PodRules, PodSetKey};
use super::parse::{namespace_labels, pod_ref, PodInfo, ValidatedPolicy};
use crate::k8s::{namespace::AsSlimNamespace, pod::AsSlimPod};

/// How a pod set changed in one operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodSetChange {
    /// Newly referenced; these are all of its members.
    Created(BTreeSet<IpAddr>),
    /// No longer referenced by any rule.
    Removed,
    /// Membership edits of a set that exists before and after.
    Updated { added: BTreeSet<IpAddr>, removed: BTreeSet<IpAddr> },
}

/// Compiled entries changed by one operation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Delta {
    /// Pod entries whose rules changed: `Some` = new value, `None` = gone.
    pub pods: BTreeMap<IpAddr, Option<PodRules>>,
    pub pod_sets: BTreeMap<PodSetKey, PodSetChange>,
    /// Errors raised by this operation (an invalid policy version).
    pub policy_errors: Vec<PolicyError>,
    /// How many pod IP entries were recomputed (changed or not): a cost
    /// measure that lets tests check that unrelated pods were left alone.
    pub pods_recomputed: usize,
}

impl Delta {
    /// True when nothing in the compiled model changed.
    pub fn is_empty(&self) -> bool {
        self.pods.is_empty() && self.pod_sets.is_empty()
    }

    /// Applies the delta to a copy of the model it was computed against.
    pub fn apply_to(&self, model: &mut CompiledModel) {
        for (ip, rules) in &self.pods {
            match rules {
                Some(rules) => model.pods.insert(*ip, rules.clone()),
                None => model.pods.remove(ip),
            };
        }
        for (key, change) in &self.pod_sets {
            match change {
                PodSetChange::Created(members) => {
                    model.pod_sets.insert(key.clone(), members.clone());
                }
                PodSetChange::Removed => {
                    model.pod_sets.remove(key);
                }
                PodSetChange::Updated { added, removed } => {
                    let members = model.pod_sets.entry(key.clone()).or_default();
                    members.retain(|ip| !removed.contains(ip));
                    members.extend(added.iter().copied());
                }
            }
        }
    }
}

#[derive(Default)]
struct MembershipEdits {
    added: BTreeSet<IpAddr>,
    removed: BTreeSet<IpAddr>,
}

/// Stateful compiler fed by watch events.
#[derive(Debug, Clone, Default)]
pub struct PolicyCompiler {
    inputs: Inputs,
    model: CompiledModel,
    /// How many rules (across all pod entries) reference each pod set.
    pod_set_refs: HashMap<PodSetKey, usize>,
}

impl PolicyCompiler {
    pub fn new() -> PolicyCompiler {
        PolicyCompiler::default()
    }

    /// A compiler whose model holds the entries of `node`'s pods only (what an agent
    /// programs); the pod sets are those these entries name, with every member of the cluster.
    pub fn on_node(node: &str) -> PolicyCompiler {
        let mut compiler = PolicyCompiler::default();
        compiler.inputs.set_scope(Some(node));
        compiler
    }

    /// Starts from a full snapshot (e.g. after the initial informer list).
    pub fn from_snapshot<'a, P: AsSlimPod + 'a, N: AsSlimNamespace + 'a>(
        pods: impl IntoIterator<Item = &'a P>,
        namespaces: impl IntoIterator<Item = &'a N>,
        policies: impl IntoIterator<Item = &'a NetworkPolicy>,
    ) -> PolicyCompiler {
        Self::from_snapshot_on(None, pods, namespaces, policies)
    }

    /// [`Self::from_snapshot`], with entries for `node`'s pods only ([`Self::on_node`]).
    pub fn from_snapshot_on<'a, P: AsSlimPod + 'a, N: AsSlimNamespace + 'a>(
        node: Option<&str>,
        pods: impl IntoIterator<Item = &'a P>,
        namespaces: impl IntoIterator<Item = &'a N>,
        policies: impl IntoIterator<Item = &'a NetworkPolicy>,
    ) -> PolicyCompiler {
        let mut inputs = load_inputs(pods, namespaces, policies);
        inputs.set_scope(node);
        let (output, pod_set_refs) = compile_counting_references(&inputs);
        PolicyCompiler { inputs, model: output.model, pod_set_refs }
    }

    pub fn model(&self) -> &CompiledModel {
        &self.model
    }

    /// Currently skipped policies, sorted.
    pub fn policy_errors(&self) -> Vec<PolicyError> {
        let mut errors: Vec<PolicyError> = self.inputs.policy_errors().cloned().collect();
        errors.sort();
        errors
    }

    /// Policies held, valid or not.
    pub fn policy_count(&self) -> usize {
        self.inputs.policy_count()
    }

    pub fn skipped_policy_count(&self) -> usize {
        self.inputs.policy_errors().count()
    }

    /// The same view as a from-scratch [`super::compile`] would return.
    pub fn output(&self) -> CompileOutput {
        CompileOutput { model: self.model.clone(), policy_errors: self.policy_errors() }
    }

    pub fn upsert_pod(&mut self, pod: &impl AsSlimPod) -> Delta {
        let pod = pod.slim_pod();
        self.replace_pod(&pod_ref(&pod), PodInfo::from_pod(&pod))
    }

    pub fn delete_pod(&mut self, namespace: &str, name: &str) -> Delta {
        let namespace = if namespace.is_empty() { "default" } else { namespace };
        let pod_ref = PodRef { namespace: namespace.into(), name: name.into() };
        self.replace_pod(&pod_ref, None)
    }

    fn replace_pod(&mut self, pod_ref: &PodRef, new: Option<PodInfo>) -> Delta {
        let old = self.inputs.pod(pod_ref).cloned();
        if old == new {
            // Nothing the compiler reads moved, but the caller's copy (the store's, e.g. a
            // newer version, a readiness flip) is held instead of the old one: otherwise the
            // store and the compiler each keep a copy of such a pod (issue 29, heap profile).
            if let Some(new) = new.filter(|new| old.as_ref().is_some_and(|old| !old.same_object(new))) {
                self.inputs.remove_pod(pod_ref);
                self.inputs.insert_pod(new);
            }
            return Delta::default();
        }
        let touched_ips: BTreeSet<IpAddr> =
            old.iter().chain(new.iter()).flat_map(|info| info.ips().iter().copied()).collect();
        // A contested IP may change owner, and so whose named ports count.
        let contested_before = touched_ips.iter().any(|ip| self.inputs.is_contested(*ip));
        self.inputs.remove_pod(pod_ref);
        let carries_named_ports = old.iter().chain(new.iter()).any(PodInfo::has_named_ports);
        if let Some(info) = new {
            self.inputs.insert_pod(info);
        }
        let contested_after = touched_ips.iter().any(|ip| self.inputs.is_contested(*ip));
        let mut recompute = touched_ips.clone();
        if carries_named_ports || contested_before || contested_after {
            recompute.extend(self.inputs.egress_named_port_targets());
        }
        self.apply(&touched_ips, recompute)
    }

    pub fn upsert_namespace(&mut self, namespace: &impl AsSlimNamespace) -> Delta {
        let Some((name, labels)) = namespace_labels(namespace) else {
            return Delta::default();
        };
        self.inputs.set_namespace(name.clone(), labels);
        self.namespace_changed(&name)
    }

    pub fn delete_namespace(&mut self, name: &str) -> Delta {
        self.inputs.remove_namespace(name);
        self.namespace_changed(name)
    }

    fn namespace_changed(&mut self, name: &str) -> Delta {
        // Namespace labels never select targets, only peers; but peer sets
        // feed the egress named-port split.
        let members = self.inputs.ips_in_namespace(name);
        let recompute = if members.is_empty() { BTreeSet::new() } else { self.inputs.egress_named_port_targets() };
        self.apply(&members, recompute)
    }

    pub fn upsert_policy(&mut self, policy: &NetworkPolicy) -> Delta {
        let namespace = policy.metadata.namespace.clone().unwrap_or_default();
        let name = policy.metadata.name.clone().unwrap_or_default();
        let validated = ValidatedPolicy::from_k8s(policy);
        let error = validated.as_ref().err().cloned();
        let mut recompute = self.policy_targets(&namespace, &name);
        self.inputs.set_policy(&namespace, &name, validated);
        recompute.extend(self.policy_targets(&namespace, &name));
        let mut delta = self.apply(&BTreeSet::new(), recompute);
        delta.policy_errors.extend(error);
        delta
    }

    pub fn delete_policy(&mut self, namespace: &str, name: &str) -> Delta {
        let recompute = self.policy_targets(namespace, name);
        self.inputs.remove_policy(namespace, name);
        self.apply(&BTreeSet::new(), recompute)
    }

    fn policy_targets(&self, namespace: &str, name: &str) -> BTreeSet<IpAddr> {
        self.inputs.policy(namespace, name).map(|p| self.inputs.policy_targets(p)).unwrap_or_default()
    }

    /// Re-evaluates memberships of `membership_ips` in every existing pod set,
    /// then recomputes the entries of `recompute_ips`, creating and dropping
    /// pod sets as their reference counts change.
    fn apply(&mut self, membership_ips: &BTreeSet<IpAddr>, recompute_ips: BTreeSet<IpAddr>) -> Delta {
        let mut delta = Delta::default();
        let mut edits: BTreeMap<PodSetKey, MembershipEdits> = BTreeMap::new();
        for (key, members) in self.model.pod_sets.iter_mut() {
            for ip in membership_ips {
                let now = self.inputs.pod_set_contains(key, *ip);
                if now == members.contains(ip) {
                    continue;
                }
                let edit = edits.entry(key.clone()).or_default();
                if now {
                    members.insert(*ip);
                    edit.added.insert(*ip);
                } else {
                    members.remove(ip);
                    edit.removed.insert(*ip);
                }
            }
        }

        // Net reference-count change per key, applied after all pods so a key
        // moving from one pod to another is never dropped and recreated.
        let mut ref_changes: BTreeMap<PodSetKey, i64> = BTreeMap::new();
        delta.pods_recomputed = recompute_ips.len();
        for ip in recompute_ips {
            let new_rules = self.inputs.compute_pod(ip);
            let old_rules = self.model.pods.get(&ip);
            if old_rules == new_rules.as_ref() {
                continue;
            }
            for key in old_rules.iter().flat_map(|r| r.referenced_pod_sets()) {
                *ref_changes.entry(key.clone()).or_default() -= 1;
            }
            for key in new_rules.iter().flat_map(|r| r.referenced_pod_sets()) {
                *ref_changes.entry(key.clone()).or_default() += 1;
            }
            match &new_rules {
                Some(rules) => self.model.pods.insert(ip, rules.clone()),
                None => self.model.pods.remove(&ip),
            };
            delta.pods.insert(ip, new_rules);
        }

        for (key, change) in ref_changes {
            let before = self.pod_set_refs.get(&key).copied().unwrap_or(0);
            let after = usize::try_from(i64::try_from(before).unwrap_or(i64::MAX).saturating_add(change)).unwrap_or(0);
            match (before, after) {
                (0, 0) => {}
                (_, 0) => {
                    self.pod_set_refs.remove(&key);
                    self.model.pod_sets.remove(&key);
                    edits.remove(&key);
                    delta.pod_sets.insert(key, PodSetChange::Removed);
                }
                (0, _) => {
                    let members: BTreeSet<IpAddr> = self.inputs.pod_set_members(&key);
                    self.pod_set_refs.insert(key.clone(), after);
                    self.model.pod_sets.insert(key.clone(), members.clone());
                    delta.pod_sets.insert(key, PodSetChange::Created(members));
                }
                _ => {
                    self.pod_set_refs.insert(key, after);
                }
            }
        }
        for (key, edit) in edits {
            delta.pod_sets.insert(key, PodSetChange::Updated { added: edit.added, removed: edit.removed });
        }
        delta
    }
}
