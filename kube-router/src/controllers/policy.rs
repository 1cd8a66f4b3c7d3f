//! NetworkPolicy enforcement as a controller, woken by Pods, Namespaces and NetworkPolicies.
//!
//! It is the only consumer of the change sets of those three stores: each run takes the keys
//! that changed since the last and hands the firewall those objects alone (everything only at
//! the first run, or when a store cannot say what changed).
use std::sync::Arc;

use std::path::Path;

use anyhow::Result;
use kube_router_common::META_POLICY_AS_OF;

use crate::policy::maps::{BpfPolicyMaps, PolicyMaps};
use crate::{
    k8s::{
        cache::Cache,
        store::{Feed, ObjectKey, ObjectStore},
        watch::{ClusterObjects, Kind},
    },
    pinned::stamps::ApiStateStamp,
    policy::engine::{PolicyChanges, PolicyProgrammer},
    runtime::{Action, Controller},
};

pub const POLICY_KINDS: &[Kind] = &[Kind::Pods, Kind::Namespaces, Kind::NetworkPolicies];

pub struct PolicyController<M: PolicyMaps = BpfPolicyMaps> {
    firewall: PolicyProgrammer<M>,
    cache: Arc<Cache>,
    /// How new the API state in the policy maps is (see `pinned::stamps`); none without pinned
    /// maps (tests).
    stamp: ApiStateStamp,
    /// Its own feeds of the policy kinds' changes.
    feeds: Option<PolicyFeeds>,
}

impl<M: PolicyMaps> PolicyController<M> {
    pub fn new(firewall: PolicyProgrammer<M>, cache: Arc<Cache>) -> Self {
        Self { firewall, cache, stamp: ApiStateStamp::none("policy"), feeds: None }
    }

    /// Stamps the pinned policy maps with the API state written into them.
    pub fn with_stamp(mut self, pin_dir: &Path) -> Self {
        self.stamp = ApiStateStamp::open(pin_dir, META_POLICY_AS_OF, "policy");
        self
    }

    pub fn firewall(&self) -> &PolicyProgrammer<M> {
        &self.firewall
    }

    /// One sync; returns the failed map writes.
    fn sync(&mut self) -> Option<u64> {
        // Policy is only ever compiled from a complete picture (or its checkpoint): half a list
        // of pods would deny traffic that is allowed. Before that the change sets stay where
        // they are, and keep growing.
        let restored_only = self.cache.read(POLICY_KINDS, |_| ()).is_some_and(|l| !l.completeness.is_complete());
        if restored_only && self.stamp.keeps_maps_over_checkpoint(self.cache.restored_as_of(), &self.firewall.metrics())
        {
            // Programming the checkpoint would take the maps back to an older state.
            return None;
        }
        let compiled = self.firewall.has_compiled();
        let feeds = &mut self.feeds;
        let listing = self.cache.update(POLICY_KINDS, |o| policy_changes(o, feeds, compiled))?;
        let complete = listing.completeness.is_complete();
        if complete {
            self.stamp.begin_write(&self.firewall.metrics());
        }
        let failed = self.firewall.apply(listing.objects, complete);
        if complete && failed == 0 {
            self.stamp.finish_write(self.firewall.last_sync().writes > 0, listing.as_of_unix, &self.firewall.metrics());
        }
        Some(failed)
    }
}

/// The policy controller's own feeds of the Pod, Namespace and NetworkPolicy stores.
#[derive(Debug, Clone, Copy)]
struct PolicyFeeds {
    pods: Feed,
    namespaces: Feed,
    policies: Feed,
}

/// The changes of the policy kinds since the last call with `feeds` (the first subscribes);
/// every object when the compiler has nothing yet or a store does not know what changed.
fn policy_changes(objects: &mut ClusterObjects, feeds: &mut Option<PolicyFeeds>, compiled: bool) -> PolicyChanges {
    let feeds = *feeds.get_or_insert_with(|| PolicyFeeds {
        pods: objects.pods.subscribe(),
        namespaces: objects.namespaces.subscribe(),
        policies: objects.network_policies.subscribe(),
    });
    let changed = (
        objects.pods.take_changes(feeds.pods),
        objects.namespaces.take_changes(feeds.namespaces),
        objects.network_policies.take_changes(feeds.policies),
    );
    match changed {
        (Some(pods), Some(namespaces), Some(policies)) if compiled => PolicyChanges::Keys {
            pods: keyed(&objects.pods, pods),
            namespaces: keyed(&objects.namespaces, namespaces),
            policies: keyed(&objects.network_policies, policies),
        },
        _ => PolicyChanges::All {
            pods: objects.pods.snapshot(),
            namespaces: objects.namespaces.snapshot(),
            policies: objects.network_policies.snapshot(),
        },
    }
}

fn keyed<K, T>(
    store: &ObjectStore<K, Arc<T>>,
    keys: impl IntoIterator<Item = ObjectKey>,
) -> Vec<(ObjectKey, Option<Arc<T>>)> {
    keys.into_iter()
        .map(|key| {
            let object = store.shared(&key);
            (key, object)
        })
        .collect()
}

impl<M: PolicyMaps + Send + 'static> Controller for PolicyController<M> {
    fn name(&self) -> &'static str {
        "policy"
    }

    async fn reconcile(&mut self) -> Result<Action> {
        let Some(failed) = self.sync() else {
            return Ok(Action::AwaitChange);
        };
        if failed > 0 {
            anyhow::bail!("{failed} policy map writes failed");
        }
        Ok(Action::AwaitChange)
    }
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use k8s_openapi::api::networking::v1::NetworkPolicy;
    use kube::runtime::watcher::Event;
    use serde_json::json;

    use super::*;
    use crate::policy::maps::{decode, PolicyMapContents};
    use crate::{
        k8s::{namespace::NamespaceFields, pod::PodFields, watch::WatchUpdate},
        metrics::Metrics,
        pinned::stamps::MapsStamp,
        policy::engine::SyncStats,
    };

    const NODE: &str = "krt-polx-node";

    fn pod(i: usize, app: &str, version: u64) -> PodFields {
        // Even pods run on this node, odd ones elsewhere.
        let node = if i.is_multiple_of(2) { NODE } else { "krt-polx-other" };
        serde_json::from_value(json!({
            "metadata": {"namespace": format!("ns-{}", i % 3), "name": format!("pod-{i}"),
                         "labels": {"app": app}, "resourceVersion": version.to_string()},
            "spec": {"nodeName": node, "containers": []},
            "status": {"phase": "Running", "podIPs": [{"ip": ip(i).to_string()}]}
        }))
        .unwrap()
    }

    fn ip(i: usize) -> IpAddr {
        IpAddr::from([10, 1, (i / 250) as u8, (i % 250 + 1) as u8])
    }

    fn namespace(i: usize) -> NamespaceFields {
        serde_json::from_value(json!({"metadata": {"name": format!("ns-{i}"), "resourceVersion": "1",
                                                   "labels": {"team": format!("t{i}")}}}))
        .unwrap()
    }

    /// Ingress to `app=db` pods of `ns-<i>` from `app=web` pods of every namespace, TCP 5432.
    fn policy(i: usize) -> NetworkPolicy {
        serde_json::from_value(json!({
            "metadata": {"namespace": format!("ns-{i}"), "name": "db", "resourceVersion": "1"},
            "spec": {"podSelector": {"matchLabels": {"app": "db"}}, "policyTypes": ["Ingress"],
                     "ingress": [{"from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": "web"}}}],
                                  "ports": [{"protocol": "TCP", "port": 5432}]}]}
        }))
        .unwrap()
    }

    const PODS: usize = 300;

    fn app(i: usize) -> &'static str {
        if i.is_multiple_of(5) {
            "db"
        } else {
            "web"
        }
    }

    /// Init, one InitApply per object, InitDone: a complete listing as a watcher delivers it.
    fn list<K>(cache: &Cache, wrap: fn(Event<K>) -> WatchUpdate, objects: impl IntoIterator<Item = K>) {
        cache.apply(wrap(Event::Init));
        for object in objects {
            cache.apply(wrap(Event::InitApply(object)));
        }
        cache.apply(wrap(Event::InitDone));
    }

    fn controller(cache: &Arc<Cache>) -> PolicyController<PolicyMapContents> {
        let firewall = PolicyProgrammer::with_maps(PolicyMapContents::default(), NODE, Metrics::default()).unwrap();
        PolicyController::new(firewall, cache.clone())
    }

    /// The pod IPs with an entry in `pol_pods`.
    fn programmed_pods(controller: &PolicyController<PolicyMapContents>) -> Vec<IpAddr> {
        let entries = decode(controller.firewall().maps()).unwrap();
        let mut ips: Vec<IpAddr> = entries.pod_slots.keys().map(|k| k.pod_ip).collect();
        ips.dedup();
        ips
    }

    fn db_pods_here() -> Vec<IpAddr> {
        (0..PODS).filter(|i| i.is_multiple_of(2) && app(*i) == "db").map(ip).collect()
    }

    #[test]
    fn one_pod_label_change_feeds_the_compiler_that_pod_alone() {
        let cache = Cache::new(ClusterObjects::default(), None);
        list(&cache, WatchUpdate::Namespaces, (0..3).map(namespace));
        list(&cache, WatchUpdate::Pods, (0..PODS).map(|i| pod(i, app(i), 1)));
        list(&cache, WatchUpdate::NetworkPolicies, (0..3).map(policy));
        let mut controller = controller(&cache);
        assert_eq!(controller.sync(), Some(0));
        assert!(controller.firewall().last_sync().full_compile, "the first sync compiles everything");
        assert_eq!(programmed_pods(&controller), db_pods_here());

        // pod-2, on this node, becomes a database: it is isolated now.
        cache.apply(WatchUpdate::Pods(Event::Apply(pod(2, "db", 2))));
        assert_eq!(controller.sync(), Some(0));
        let stats = controller.firewall().last_sync();
        assert!(!stats.full_compile);
        assert_eq!(stats.objects_fed, 1, "{stats:?}");
        assert!(stats.pods_recomputed <= 1, "{stats:?}");
        let mut wanted = db_pods_here();
        wanted.push(ip(2));
        wanted.sort();
        assert_eq!(programmed_pods(&controller), wanted);

        // A pod elsewhere changes: one object fed again, and nothing of it lands in pol_pods.
        cache.apply(WatchUpdate::Pods(Event::Apply(pod(5, "web", 2))));
        assert_eq!(controller.sync(), Some(0));
        assert_eq!(controller.firewall().last_sync().objects_fed, 1);
        assert_eq!(programmed_pods(&controller), wanted);

        // Nothing changed: nothing fed.
        assert_eq!(controller.sync(), Some(0));
        assert_eq!(controller.firewall().last_sync(), SyncStats::default());
    }

    #[test]
    fn nothing_is_compiled_before_a_complete_listing_unless_restored() {
        let cache = Cache::new(ClusterObjects::default(), None);
        list(&cache, WatchUpdate::Namespaces, (0..3).map(namespace));
        list(&cache, WatchUpdate::Pods, (0..PODS).map(|i| pod(i, app(i), 1)));
        cache.apply(WatchUpdate::NetworkPolicies(Event::Init));
        cache.apply(WatchUpdate::NetworkPolicies(Event::InitApply(policy(0))));
        let mut controller = controller(&cache);
        assert_eq!(controller.sync(), None, "half a listing of policies");
        assert!(controller.firewall().maps().is_empty());
    }

    #[test]
    fn a_pod_and_a_policy_deleted_before_the_complete_listing_delete_nothing() {
        let mut restored = ClusterObjects::default();
        restored.namespaces.restore((0..3).map(namespace));
        restored.pods.restore((0..PODS).map(|i| pod(i, app(i), 1)));
        restored.network_policies.restore((0..3).map(policy));
        let cache = Cache::new(restored, Some(1.0));
        let mut controller = controller(&cache);
        assert_eq!(controller.sync(), Some(0));
        let written = controller.firewall().maps().clone();
        assert_eq!(programmed_pods(&controller), db_pods_here());

        // Deleted while the API is still being listed: pod-0 (a database here) and ns-1's policy.
        cache.apply(WatchUpdate::Pods(Event::Delete(pod(0, "db", 2))));
        cache.apply(WatchUpdate::NetworkPolicies(Event::Delete(policy(1))));
        assert_eq!(controller.sync(), Some(0));
        let stats = controller.firewall().last_sync();
        assert_eq!((stats.full_compile, stats.objects_fed), (false, 2), "{stats:?}");
        assert_eq!(controller.firewall().maps(), &written, "nothing deleted before a complete listing");

        // The complete listing (without them) lets them go.
        list(&cache, WatchUpdate::Namespaces, (0..3).map(namespace));
        list(&cache, WatchUpdate::Pods, (1..PODS).map(|i| pod(i, app(i), 1)));
        list(&cache, WatchUpdate::NetworkPolicies, [policy(0), policy(2)]);
        assert_eq!(controller.sync(), Some(0));
        let wanted: Vec<IpAddr> =
            db_pods_here().into_iter().filter(|ip| *ip != self::ip(0) && !in_ns(*ip, 1)).collect();
        assert_eq!(programmed_pods(&controller), wanted);
    }

    fn in_ns(address: IpAddr, namespace: usize) -> bool {
        (0..PODS).any(|i| i % 3 == namespace && ip(i) == address)
    }

    /// A restart within a second of a change (or while the checkpoint could not be written)
    /// has policy maps newer than its checkpoint: a peer the API had revoked must not be
    /// admitted again from the older checkpoint.
    #[test]
    fn a_checkpoint_older_than_the_policy_maps_does_not_take_them_back() {
        let objects = |db_app: &str| {
            let cache = Cache::new(ClusterObjects::default(), None);
            list(&cache, WatchUpdate::Namespaces, (0..3).map(namespace));
            list(&cache, WatchUpdate::Pods, (0..PODS).map(|i| pod(i, if i == 0 { db_app } else { app(i) }, 1)));
            list(&cache, WatchUpdate::NetworkPolicies, (0..3).map(policy));
            cache.with(|o| o.checkpoint())
        };
        // The API's state: pod-0 is no longer a db pod (its policy entries went away).
        let cache = Cache::new(ClusterObjects::default(), None);
        list(&cache, WatchUpdate::Namespaces, (0..3).map(namespace));
        list(&cache, WatchUpdate::Pods, (0..PODS).map(|i| pod(i, if i == 0 { "web" } else { app(i) }, 1)));
        list(&cache, WatchUpdate::NetworkPolicies, (0..3).map(policy));
        let mut live = controller(&cache);
        live.stamp = ApiStateStamp::with("policy", Some(MapsStamp::in_memory(0)));
        assert_eq!(live.sync(), Some(0));
        let stamped = live.stamp.as_of().expect("a complete sync stamps the maps");
        let maps = live.firewall().maps().clone();
        assert!(!programmed_pods(&live).contains(&ip(0)));

        // Restarted during an outage, from checkpoints taken before and after that sync, which
        // still had pod-0 as a db pod.
        let restart = |checkpoint_unix: f64| {
            let mut restored = ClusterObjects::default();
            restored.restore(objects("db"));
            let cache = Cache::new(restored, Some(checkpoint_unix));
            let firewall = PolicyProgrammer::with_maps(maps.clone(), NODE, Metrics::default()).unwrap();
            let mut controller = PolicyController::new(firewall, cache);
            controller.stamp = ApiStateStamp::with("policy", Some(MapsStamp::in_memory(stamped)));
            let outcome = controller.sync();
            (outcome, controller)
        };
        let (outcome, older) = restart(f64::from(stamped) - 10.0);
        assert_eq!(outcome, None, "nothing applied from the older checkpoint");
        assert_eq!(older.firewall().maps(), &maps, "the maps stay as the API left them");
        let superseded =
            older.firewall().metrics().of::<crate::metrics::AgentMetrics>().checkpoint_superseded_count("policy");
        assert_eq!(superseded, 1);

        let (outcome, newer) = restart(f64::from(stamped) + 10.0);
        assert_eq!(outcome, Some(0));
        assert!(programmed_pods(&newer).contains(&ip(0)), "a newer checkpoint is applied");
    }
}
