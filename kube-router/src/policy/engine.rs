//! NetworkPolicy enforcement: compiles Pods, Namespaces and NetworkPolicies into the pinned
//! policy maps and keeps them there.
//!
//! Only pods on this node get `pol_pods_v4` entries (their veths are where the programs judge);
//! peer sets stay cluster-wide. Like the service maps, the policy maps are written with
//! differences only, and before the first complete listing of all three kinds nothing is
//! deleted. A policy the compiler rejects (bad CIDR, bad port) is skipped with an error and
//! leaves every other policy as it is.
//!
//! The compiler is fed per object: the first sync (and one after a restore of the stores)
//! compiles every object; after that only the objects the stores recorded as changed are
//! upserted or deleted, and only the entries the compiler's deltas name are flattened and written.
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::IpAddr,
    path::Path,
    sync::Arc,
    time::Instant,
};

use anyhow::{Context, Result};
use k8s_openapi::api::networking::v1::NetworkPolicy;

use crate::{
    exposition::{register, register_optional, sync_histogram, OptionalGauge},
    k8s::{namespace::SlimNamespace, pod::SlimPod, store::ObjectKey},
    map_writes::MapMetrics,
    metrics::{AgentMetrics, Metrics, Subsystem},
    policy::maps::{apply_diff, decode, BpfPolicyMaps, PolicyMaps},
    policy::{
        flatten::{MapEntries, MapFlattener},
        Delta, PodRules, PodSetKey, PolicyCompiler,
    },
};

/// The policy syncs' durations.
#[derive(Debug)]
pub struct PolicyMetrics {
    /// The last policy compile and sync, seconds (absent before the first).
    last_sync_seconds: OptionalGauge,
    /// Every one of them (kube-router: iptables sync, policy chains sync).
    sync_time: prometheus_client::metrics::histogram::Histogram,
}

impl Default for PolicyMetrics {
    fn default() -> Self {
        Self { last_sync_seconds: OptionalGauge::default(), sync_time: sync_histogram() }
    }
}

impl PolicyMetrics {
    pub fn record_sync(&self, took: std::time::Duration) {
        self.last_sync_seconds.set(took.as_secs_f64());
        self.sync_time.observe(took.as_secs_f64());
    }
}

impl Subsystem for PolicyMetrics {
    fn register(this: &std::sync::Arc<Self>, registry: &mut prometheus_client::registry::Registry) {
        register_optional(
            registry,
            "kube_router_policy_sync_seconds",
            "Duration of the last policy compile and sync.",
            this.last_sync_seconds.clone(),
        );
        register(
            registry,
            "kube_router_controller_iptables_sync_time",
            "Time it took for controller to sync iptables",
            this.sync_time.clone(),
        );
        // Our policy sync has no separate chains step: the same observations.
        register(
            registry,
            "kube_router_controller_policy_chains_sync_time",
            "Time it took for controller to sync policy chains",
            this.sync_time.clone(),
        );
    }
}

pub struct PolicyProgrammer<M: PolicyMaps = BpfPolicyMaps> {
    maps: M,
    flattener: MapFlattener,
    /// What the maps hold, as far as we know.
    programmed: MapEntries,
    /// IPv6 entries among `programmed`'s, for the entry gauges (counted as entries come and go,
    /// not by walking 100,000 prefixes at every sync).
    programmed_v6: V6Counts,
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
    /// This node's pods and their IPs, kept up to date from the same changes.
    local: LocalPods,
    last_sync: SyncStats,
}

/// What one sync cost, for tests and the log.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SyncStats {
    /// The compiler was rebuilt from every object.
    pub full_compile: bool,
    /// Objects handed to the compiler one by one (upserts and deletes).
    pub objects_fed: usize,
    /// Pod IP entries the compiler recomputed for them.
    pub pods_recomputed: usize,
    /// Map writes tried (puts, deletes, failures).
    pub writes: u64,
}

/// What changed among the Pods, Namespaces and NetworkPolicies since the last sync, as the
/// object stores recorded it.
pub enum PolicyChanges {
    /// Everything may have (the first sync, after a restore): every object as it is now.
    All { pods: Vec<Arc<SlimPod>>, namespaces: Vec<Arc<SlimNamespace>>, policies: Vec<Arc<NetworkPolicy>> },
    /// Only these keys: each with its object now, `None` when it is gone.
    Keys {
        pods: Vec<(ObjectKey, Option<Arc<SlimPod>>)>,
        namespaces: Vec<(ObjectKey, Option<Arc<SlimNamespace>>)>,
        policies: Vec<(ObjectKey, Option<Arc<NetworkPolicy>>)>,
    },
}

/// The pods scheduled on this node and the IPs they hold: whose `pol_pods` entries we write.
#[derive(Default)]
struct LocalPods {
    ips_of: HashMap<ObjectKey, Vec<IpAddr>>,
    /// Pods holding each IP (two pods may claim one for a while).
    holders: HashMap<IpAddr, usize>,
}

impl LocalPods {
    fn contains(&self, ip: &IpAddr) -> bool {
        self.holders.contains_key(ip)
    }

    fn len(&self) -> usize {
        self.holders.len()
    }

    /// Records `pod` (now, `None`: gone) under `key`; returns the IPs that became or stopped
    /// being this node's.
    fn set(&mut self, node_name: &str, key: &ObjectKey, pod: Option<&SlimPod>, flipped: &mut Vec<IpAddr>) {
        let on_node = |pod: &&SlimPod| pod.node_name.as_deref() == Some(node_name);
        // Every address the pod claims (podIPs and podIP, as the compiler reads them).
        let now: Vec<IpAddr> = pod.filter(on_node).map(|pod| pod.ips.to_vec()).unwrap_or_default();
        let before = self.ips_of.remove(key).unwrap_or_default();
        if before == now {
            if !now.is_empty() {
                self.ips_of.insert(key.clone(), now);
            }
            return;
        }
        for ip in &before {
            if let Some(count) = self.holders.get_mut(ip) {
                *count -= 1;
                if *count == 0 {
                    self.holders.remove(ip);
                    flipped.push(*ip);
                }
            }
        }
        for ip in &now {
            let count = self.holders.entry(*ip).or_default();
            *count += 1;
            if *count == 1 {
                flipped.push(*ip);
            }
        }
        if !now.is_empty() {
            self.ips_of.insert(key.clone(), now);
        }
    }
}

fn present<K>(changes: Vec<(ObjectKey, Option<Arc<K>>)>) -> Vec<Arc<K>> {
    changes.into_iter().filter_map(|(_, object)| object).collect()
}

/// IPv6 entries among a set of map entries.
#[derive(Debug, Clone, Copy, Default)]
struct V6Counts {
    pods: u64,
    peers: u64,
}

impl V6Counts {
    fn of(entries: &MapEntries) -> Self {
        Self {
            pods: entries.pod_slots.keys().filter(|k| k.pod_ip.is_ipv6()).count() as u64,
            peers: entries.peer_prefixes.keys().filter(|k| k.prefix.addr().is_ipv6()).count() as u64,
        }
    }
}

impl PolicyProgrammer {
    /// Opens the pinned policy maps and reads what a previous agent left in them.
    pub fn start(pin_dir: &Path, node_name: &str, metrics: Metrics) -> Result<Self> {
        Self::with_maps(BpfPolicyMaps::open_pinned(pin_dir)?, node_name, metrics)
    }
}

impl<M: PolicyMaps> PolicyProgrammer<M> {
    /// Takes over `maps` with what a previous agent left in them.
    pub fn with_maps(maps: M, node_name: &str, metrics: Metrics) -> Result<Self> {
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
            programmed_v6: V6Counts::of(&programmed),
            programmed,
            node_name: node_name.to_string(),
            metrics,
            reported: BTreeSet::new(),
            adopted: false,
            reported_write_failure: None,
            in_step: false,
            compiler: None,
            local: LocalPods::default(),
            last_sync: SyncStats::default(),
        })
    }

    /// The compiler holds every object already: from now on, changes alone are enough.
    pub fn has_compiled(&self) -> bool {
        self.compiler.is_some()
    }

    pub fn metrics(&self) -> Metrics {
        self.metrics.clone()
    }

    pub fn last_sync(&self) -> SyncStats {
        self.last_sync
    }

    /// The maps' writer (tests read what was written).
    pub fn maps(&self) -> &M {
        &self.maps
    }

    /// Compiles the changes and writes the differences. `complete`: every kind has been listed
    /// completely since start, so entries that are no longer wanted may go. Returns failed writes.
    pub fn apply(&mut self, changes: PolicyChanges, complete: bool) -> u64 {
        let started = Instant::now();
        let mut stats = SyncStats::default();
        // What the compiler's deltas say changed: pod entries (last value wins) and pod sets.
        let mut changed_pods: BTreeMap<IpAddr, Option<PodRules>> = BTreeMap::new();
        let mut changed_sets: BTreeSet<PodSetKey> = BTreeSet::new();
        // IPs that became or stopped being this node's: their entries come or go even when
        // their rules stay the same.
        let mut flipped = Vec::new();
        let compiler = match (changes, self.compiler.as_mut()) {
            (PolicyChanges::Keys { pods, namespaces, policies }, Some(compiler)) => {
                let mut take = |delta: Delta| {
                    stats.objects_fed += 1;
                    stats.pods_recomputed += delta.pods_recomputed;
                    changed_pods.extend(delta.pods);
                    changed_sets.extend(delta.pod_sets.into_keys());
                };
                // Namespaces first: pods and policies resolve against their labels.
                for (ObjectKey { name, .. }, namespace) in &namespaces {
                    take(match namespace {
                        Some(namespace) => compiler.upsert_namespace(namespace),
                        None => compiler.delete_namespace(name),
                    });
                }
                for (key, pod) in &pods {
                    self.local.set(&self.node_name, key, pod.as_deref(), &mut flipped);
                    take(match pod {
                        Some(pod) => compiler.upsert_pod(pod),
                        None => compiler.delete_pod(&key.namespace, &key.name),
                    });
                }
                for (ObjectKey { namespace, name }, policy) in &policies {
                    take(match policy {
                        Some(policy) => compiler.upsert_policy(policy),
                        None => compiler.delete_policy(namespace, name),
                    });
                }
                compiler
            }
            (changes, _) => {
                let (pods, namespaces, policies) = match changes {
                    PolicyChanges::All { pods, namespaces, policies } => (pods, namespaces, policies),
                    // Changes without a compiled start are not enough: the controller sends
                    // everything at first, so this is only reached by a misuse.
                    PolicyChanges::Keys { pods, namespaces, policies } => {
                        (present(pods), present(namespaces), present(policies))
                    }
                };
                stats.full_compile = true;
                self.local = LocalPods::default();
                for pod in &pods {
                    let key = ObjectKey { namespace: pod.namespace.clone(), name: pod.name.clone() };
                    self.local.set(&self.node_name, &key, Some(pod), &mut flipped);
                }
                // Entries for this node's pods only: no other pod's rules are written here.
                let compiler = PolicyCompiler::from_snapshot_on(
                    Some(&self.node_name),
                    pods.iter(),
                    namespaces.iter().map(|n| &**n),
                    policies.iter().map(|p| &**p),
                );
                self.compiler.insert(compiler)
            }
        };
        let incremental = !stats.full_compile;
        let policy_count = compiler.policy_count();
        let policy_errors = compiler.policy_errors();
        let mut broken = BTreeSet::new();
        for error in &policy_errors {
            let id = format!("{}/{}", error.namespace, error.name);
            if !self.reported.contains(&id) {
                tracing::error!(policy = %id, error = %error.kind, "NetworkPolicy rejected; other policies unaffected");
                self.metrics.of::<AgentMetrics>().reject("NetworkPolicy");
            }
            broken.insert(id);
        }
        self.reported = broken;
        let mut diff = if incremental && self.in_step && complete {
            // Only what the compiler says changed: this node's pods (and pods that stopped
            // being this node's), and the members of the pod sets that changed.
            for ip in flipped {
                changed_pods.entry(ip).or_insert_with(|| compiler.model().pods.get(&ip).cloned());
            }
            let local = &self.local;
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
            model.pods.retain(|ip, _| self.local.contains(ip));
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
        if everything_written {
            // Every write took: the maps now hold the old entries with the diff applied (which
            // is the flattener's entries unless deletions were held back).
            let (programmed, v6) = (&mut self.programmed, &mut self.programmed_v6);
            for key in &diff.pod_slots.deletes {
                if programmed.pod_slots.remove(key).is_some() && key.pod_ip.is_ipv6() {
                    v6.pods -= 1;
                }
            }
            for key in &diff.slot_ports.deletes {
                programmed.slot_ports.remove(key);
            }
            for key in &diff.peer_prefixes.deletes {
                if programmed.peer_prefixes.remove(key).is_some() && key.prefix.addr().is_ipv6() {
                    v6.peers -= 1;
                }
            }
            for (key, value) in diff.pod_slots.upserts {
                if programmed.pod_slots.insert(key, value).is_none() && key.pod_ip.is_ipv6() {
                    v6.pods += 1;
                }
            }
            programmed.slot_ports.extend(diff.slot_ports.upserts);
            for (key, value) in diff.peer_prefixes.upserts {
                if programmed.peer_prefixes.insert(key, value).is_none() && key.prefix.addr().is_ipv6() {
                    v6.peers += 1;
                }
            }
        } else {
            // Re-read rather than assume: a failed or skipped write leaves the old entry, and
            // the next sync must see the real difference.
            if let Some(entries) = self.maps.read_all().ok().and_then(|c| decode(&c).ok()) {
                self.programmed_v6 = V6Counts::of(&entries);
                self.programmed = entries;
            }
        }
        tracing::info!(
            writes = report.puts,
            deletes = report.deletes,
            errors = report.errors,
            full = report.full,
            // Not "complete": "complete=true" is what tests and operators grep for service syncs.
            full_listing = complete,
            local_pods = self.local.len(),
            full_compile = stats.full_compile,
            objects_fed = stats.objects_fed,
            policies = policy_count,
            rejected = policy_errors.len(),
            "policy sync complete"
        );
        let maps_metrics = self.metrics.of::<MapMetrics>();
        maps_metrics.record(&report.per_map);
        {
            use kube_router_common::map_names as n;
            let V6Counts { pods: pods_v6, peers: peers_v6 } = self.programmed_v6;
            maps_metrics.set_entries(n::POLICY_PODS, self.programmed.pod_slots.len() as u64 - pods_v6);
            maps_metrics.set_entries(n::POLICY_PODS_V6, pods_v6);
            maps_metrics.set_entries(n::POLICY_PORTS, self.programmed.slot_ports.len() as u64);
            maps_metrics.set_entries(n::POLICY_PEERS, self.programmed.peer_prefixes.len() as u64 - peers_v6);
            maps_metrics.set_entries(n::POLICY_PEERS_V6, peers_v6);
        }
        self.metrics.of::<PolicyMetrics>().record_sync(started.elapsed());
        self.metrics.heartbeat("firewall");
        stats.writes = report.writes() + report.errors;
        self.last_sync = stats;
        report.errors
    }
}
