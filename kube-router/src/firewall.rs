//! NetworkPolicy enforcement: compiles Pods, Namespaces and NetworkPolicies into the pinned
//! policy maps and keeps them there.
//!
//! Only pods on this node get `pol_pods_v4` entries (their veths are where the programs judge);
//! peer sets stay cluster-wide. Like the service maps, the policy maps are written with
//! differences only, and before the first complete listing of all three kinds nothing is
//! deleted. A policy the compiler rejects (bad CIDR, bad port) is skipped with an error and
//! leaves every other policy as it is.
use std::{
    collections::{BTreeMap, BTreeSet, HashSet},
    net::IpAddr,
    path::Path,
    time::Instant,
};

use anyhow::{Context, Result};
use k8s_openapi::api::{
    core::v1::{Namespace, Pod},
    networking::v1::NetworkPolicy,
};

use crate::{
    bpf::policy_maps::{apply_diff, decode, BpfPolicyMaps, PolicyMaps},
    metrics::Metrics,
    policy::{
        bpf_maps::{MapEntries, MapFlattener},
        Delta, PodRules, PodSetKey, PolicyCompiler,
    },
};

pub struct FirewallController {
    maps: BpfPolicyMaps,
    flattener: MapFlattener,
    /// What the maps hold, as far as we know.
    programmed: MapEntries,
    node_name: String,
    metrics: Metrics,
    /// Rejected policies already reported, so one that stays broken is logged once.
    reported: BTreeSet<String>,
    adopted: bool,
    /// The map whose failed writes were last reported: a map that stays full is logged once,
    /// not at every sync (the failures are counted in `kube_router_map_writes_total`).
    reported_write_failure: Option<&'static str>,
    /// The maps hold exactly what the flattener holds (the last sync was a complete listing and
    /// every write took): the next change can be flattened and written incrementally.
    in_step: bool,
    /// Incremental compiler, fed only the objects that changed since the last sync: one pod's
    /// label change recompiles what depends on it, not the cluster.
    compiler: Option<PolicyCompiler>,
    seen: Seen,
}

/// The objects the compiler was last fed, by key.
#[derive(Default)]
struct Seen {
    pods: BTreeMap<(String, String), Pod>,
    namespaces: BTreeMap<String, Namespace>,
    policies: BTreeMap<(String, String), NetworkPolicy>,
}

fn values<Id, K: Clone>(map: &BTreeMap<Id, K>) -> Vec<K> {
    map.values().cloned().collect()
}

fn namespaced_key<K: kube::Resource>(object: &K) -> (String, String) {
    let meta = object.meta();
    (meta.namespace.clone().unwrap_or_default(), meta.name.clone().unwrap_or_default())
}

/// What differs between `seen` and `now` (objects to upsert, ids to delete); `seen` becomes `now`.
fn changes<K: Clone + PartialEq, Id: Ord + Clone>(
    seen: &mut BTreeMap<Id, K>,
    now: BTreeMap<Id, K>,
) -> (Vec<K>, Vec<Id>) {
    let upserts = now.iter().filter(|(id, object)| seen.get(*id) != Some(*object)).map(|(_, o)| o.clone()).collect();
    let deletes = seen.keys().filter(|id| !now.contains_key(*id)).cloned().collect();
    *seen = now;
    (upserts, deletes)
}

impl FirewallController {
    /// Opens the pinned policy maps and reads what a previous agent left in them.
    pub fn start(pin_dir: &Path, node_name: &str, metrics: Metrics) -> Result<Self> {
        let maps = BpfPolicyMaps::open_pinned(pin_dir)?;
        let contents = maps.read_all().map_err(|e| anyhow::anyhow!("{}: {}", e.map, e.message))?;
        let programmed = decode(&contents).context("decoding the programmed policy maps")?;
        tracing::info!(
            pod_entries = programmed.pod_slots.len(),
            port_entries = programmed.slot_ports.len(),
            peer_prefixes = programmed.peer_prefixes.len(),
            "adopted programmed network policy"
        );
        Ok(Self {
            maps,
            flattener: MapFlattener::new(),
            programmed,
            node_name: node_name.to_string(),
            metrics,
            reported: BTreeSet::new(),
            adopted: false,
            reported_write_failure: None,
            in_step: false,
            compiler: None,
            seen: Seen::default(),
        })
    }

    /// Compiles the objects and writes the differences. `complete`: every kind has been listed
    /// completely since start, so entries that are no longer wanted may go. Returns failed writes.
    pub fn apply<'a>(
        &mut self,
        pods: impl Iterator<Item = &'a Pod>,
        namespaces: impl Iterator<Item = &'a Namespace>,
        policies: impl Iterator<Item = &'a NetworkPolicy>,
        complete: bool,
    ) -> u64 {
        let started = Instant::now();
        let pods: BTreeMap<(String, String), Pod> = pods.map(|p| (namespaced_key(p), p.clone())).collect();
        let namespaces: BTreeMap<String, Namespace> =
            namespaces.map(|n| (n.metadata.name.clone().unwrap_or_default(), n.clone())).collect();
        let policies: BTreeMap<(String, String), NetworkPolicy> =
            policies.map(|p| (namespaced_key(p), p.clone())).collect();
        let local: HashSet<IpAddr> = pods
            .values()
            .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(self.node_name.as_str()))
            .flat_map(|p| p.status.iter().flat_map(|s| s.pod_ips.iter().flatten().map(|i| i.ip.clone())))
            .filter_map(|ip| ip.parse().ok())
            .collect();
        let policy_count = policies.len();
        // What the compiler's deltas say changed: pod entries (last value wins) and pod sets.
        let mut changed_pods: BTreeMap<IpAddr, Option<PodRules>> = BTreeMap::new();
        let mut changed_sets: BTreeSet<PodSetKey> = BTreeSet::new();
        let incremental = self.compiler.is_some();
        let compiler = match self.compiler.as_mut() {
            Some(compiler) => {
                let mut take = |delta: Delta| {
                    changed_pods.extend(delta.pods);
                    changed_sets.extend(delta.pod_sets.into_keys());
                };
                // Namespaces first: pods and policies resolve against their labels.
                let (upserts, deletes) = changes(&mut self.seen.namespaces, namespaces);
                upserts.iter().for_each(|n| take(compiler.upsert_namespace(n)));
                deletes.iter().for_each(|name| take(compiler.delete_namespace(name)));
                let (upserts, deletes) = changes(&mut self.seen.pods, pods);
                upserts.iter().for_each(|p| take(compiler.upsert_pod(p)));
                deletes.iter().for_each(|(ns, name)| take(compiler.delete_pod(ns, name)));
                let (upserts, deletes) = changes(&mut self.seen.policies, policies);
                upserts.iter().for_each(|p| take(compiler.upsert_policy(p)));
                deletes.iter().for_each(|(ns, name)| take(compiler.delete_policy(ns, name)));
                compiler
            }
            None => {
                let compiler = PolicyCompiler::from_snapshot(&values(&pods), &values(&namespaces), &values(&policies));
                self.seen = Seen { pods, namespaces, policies };
                self.compiler.insert(compiler)
            }
        };
        let policy_errors = compiler.policy_errors();
        let mut broken = BTreeSet::new();
        for error in &policy_errors {
            let id = format!("{}/{}", error.namespace, error.name);
            if !self.reported.contains(&id) {
                tracing::error!(policy = %id, error = %error.kind, "NetworkPolicy rejected; other policies unaffected");
                self.metrics.with(|m| *m.rejected_objects.entry("NetworkPolicy").or_default() += 1);
            }
            broken.insert(id);
        }
        self.reported = broken;
        let mut diff = if incremental && self.in_step && complete {
            // Only what the compiler says changed: this node's pods (and pods that stopped
            // being this node's), and the members of the pod sets that changed.
            let pods: BTreeMap<IpAddr, Option<PodRules>> = changed_pods
                .into_iter()
                .filter_map(|(ip, rules)| {
                    if local.contains(&ip) {
                        Some((ip, rules))
                    } else {
                        self.flattener.holds_pod(ip).then_some((ip, None))
                    }
                })
                .collect();
            self.flattener.update(compiler.model(), &pods, &changed_sets)
        } else {
            let mut model = compiler.model().clone();
            model.pods.retain(|ip, _| local.contains(ip));
            // The first time, take over the ids a previous agent left, so a restart writes nothing.
            let wanted = if self.adopted {
                self.flattener.flatten(&model)
            } else {
                self.adopted = true;
                self.flattener.adopt(&model, &self.programmed)
            };
            self.programmed.diff(&wanted)
        };
        if !complete {
            diff.pod_slots.deletes.clear();
            diff.slot_ports.deletes.clear();
            diff.peer_prefixes.deletes.clear();
        }
        let report = apply_diff(&mut self.maps, &diff, &self.programmed);
        match &report.first_error {
            Some((map, error)) if self.reported_write_failure != Some(*map) => {
                tracing::warn!(
                    map,
                    %error,
                    failed = report.errors,
                    full = report.full,
                    "policy map writes failed; the previous entries stay and deletions wait, retried at every sync"
                );
                self.reported_write_failure = Some(*map);
            }
            None if self.reported_write_failure.take().is_some() => {
                tracing::info!("policy map writes succeed again");
            }
            _ => {}
        }
        let everything_written = report.errors == 0;
        self.in_step = everything_written && complete;
        self.programmed = if everything_written {
            // Every write took: the maps now hold the old entries with the diff applied (which
            // is the flattener's entries unless deletions were held back).
            let mut programmed = std::mem::take(&mut self.programmed);
            for key in &diff.pod_slots.deletes {
                programmed.pod_slots.remove(key);
            }
            for key in &diff.slot_ports.deletes {
                programmed.slot_ports.remove(key);
            }
            for key in &diff.peer_prefixes.deletes {
                programmed.peer_prefixes.remove(key);
            }
            programmed.pod_slots.extend(diff.pod_slots.upserts);
            programmed.slot_ports.extend(diff.slot_ports.upserts);
            programmed.peer_prefixes.extend(diff.peer_prefixes.upserts);
            programmed
        } else {
            // Re-read rather than assume: a failed or skipped write leaves the old entry, and
            // the next sync must see the real difference.
            match self.maps.read_all().ok().and_then(|c| decode(&c).ok()) {
                Some(entries) => entries,
                None => self.programmed.clone(),
            }
        };
        tracing::info!(
            writes = report.puts,
            deletes = report.deletes,
            errors = report.errors,
            full = report.full,
            // Not "complete": "complete=true" is what tests and operators grep for service syncs.
            full_listing = complete,
            local_pods = local.len(),
            policies = policy_count,
            rejected = policy_errors.len(),
            "policy sync complete"
        );
        self.metrics.record_map_writes(&report.per_map);
        self.metrics.with(|m| {
            use kube_router_common::map_names as n;
            let pods_v6 = self.programmed.pod_slots.keys().filter(|k| k.pod_ip.is_ipv6()).count() as u64;
            let peers_v6 = self.programmed.peer_prefixes.keys().filter(|k| k.prefix.addr().is_ipv6()).count() as u64;
            m.map_entries.insert(n::POLICY_PODS, self.programmed.pod_slots.len() as u64 - pods_v6);
            m.map_entries.insert(n::POLICY_PODS_V6, pods_v6);
            m.map_entries.insert(n::POLICY_PORTS, self.programmed.slot_ports.len() as u64);
            m.map_entries.insert(n::POLICY_PEERS, self.programmed.peer_prefixes.len() as u64 - peers_v6);
            m.map_entries.insert(n::POLICY_PEERS_V6, peers_v6);
            m.policy_sync_seconds = Some(started.elapsed().as_secs_f64());
            m.kr.policy_sync_time.observe(started.elapsed().as_secs_f64());
        });
        self.metrics.heartbeat("firewall");
        report.errors
    }
}
