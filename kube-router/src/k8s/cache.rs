//! The watched objects shared by the controllers, with one writer (the task reading the
//! watchers) and a change counter per kind that wakes only the controllers reading that kind.
//!
//! The outage rules live in what a reader gets: nothing before its kinds have been listed
//! completely or restored from the checkpoint, and a [`Completeness`] that says which, so only
//! a complete listing can lead to deletions.
use std::sync::{Arc, RwLock};

use tokio::sync::watch;

use super::watch::{ClusterObjects, Kind, WatchUpdate};
use crate::runtime::Trigger;

/// How many changes each kind has seen.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Generations([u64; Kind::ALL.len()]);

impl Generations {
    fn of(&self, kinds: &[Kind]) -> Vec<u64> {
        kinds.iter().map(|k| self.0[k.index()]).collect()
    }
}

/// How far a reader may trust the objects of its kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Completeness {
    /// Every kind read has been listed completely since start: what is gone may be deleted.
    Complete,
    /// Restored from the checkpoint and not yet listed completely: apply, never delete.
    Restored,
}

impl Completeness {
    pub fn is_complete(self) -> bool {
        self == Completeness::Complete
    }
}

/// What a controller reads, with how complete it is.
pub struct Listing<T> {
    pub objects: T,
    pub completeness: Completeness,
    /// Unix time of the read: how new the state is that a writer programs from it.
    pub as_of_unix: f64,
}

pub struct Cache {
    objects: RwLock<ClusterObjects>,
    /// The objects came from the checkpoint (taken at this unix time) before the watchers started.
    restored: Option<f64>,
    generations: watch::Sender<Generations>,
}

impl Cache {
    /// `restored`: the unix time of the checkpoint the objects were restored from.
    pub fn new(objects: ClusterObjects, restored: Option<f64>) -> Arc<Self> {
        Arc::new(Self {
            objects: RwLock::new(objects),
            restored,
            generations: watch::Sender::new(Generations::default()),
        })
    }

    pub fn restored(&self) -> bool {
        self.restored.is_some()
    }

    /// When the restored checkpoint was taken.
    pub fn restored_as_of(&self) -> Option<f64> {
        self.restored
    }

    /// The writer: applies one watch update; returns the kind whose contents changed, after
    /// waking its readers.
    pub fn apply(&self, update: WatchUpdate) -> Option<Kind> {
        let kind = self.objects.write().expect("cache lock").apply_kind(update)?;
        self.generations.send_modify(|g| g.0[kind.index()] += 1);
        Some(kind)
    }

    /// How many changes `kinds` have seen in all: a reader that kept the last value knows
    /// whether anything changed since.
    pub fn generation(&self, kinds: &[Kind]) -> u64 {
        self.generations.borrow().of(kinds).iter().sum()
    }

    /// What wakes a controller reading `kinds`: any change of one of them.
    pub fn subscribe(&self, kinds: &'static [Kind]) -> Subscription {
        let changes = self.generations.subscribe();
        let seen = changes.borrow().of(kinds);
        Subscription { changes, kinds, seen }
    }

    fn completeness(&self, objects: &ClusterObjects, kinds: &[Kind]) -> Option<Completeness> {
        if kinds.iter().all(|kind| objects.listed(*kind)) {
            Some(Completeness::Complete)
        } else if self.restored.is_some() {
            Some(Completeness::Restored)
        } else {
            // Half a list is not the cluster: half the pods would deny allowed traffic.
            None
        }
    }

    /// `read` of the objects once `kinds` are listed completely or restored; `None` before.
    /// Copy out what outlives the lock (objects are shared `Arc`s, cheap to collect).
    pub fn read<R>(&self, kinds: &[Kind], read: impl FnOnce(&ClusterObjects) -> R) -> Option<Listing<R>> {
        let objects = self.objects.read().expect("cache lock");
        let completeness = self.completeness(&objects, kinds)?;
        Some(Listing { objects: read(&objects), completeness, as_of_unix: crate::metrics::unix_now() })
    }

    /// Like [`Self::read`], for readers that take the stores' change sets.
    pub fn update<R>(&self, kinds: &[Kind], update: impl FnOnce(&mut ClusterObjects) -> R) -> Option<Listing<R>> {
        let mut objects = self.objects.write().expect("cache lock");
        let completeness = self.completeness(&objects, kinds)?;
        Some(Listing { objects: update(&mut objects), completeness, as_of_unix: crate::metrics::unix_now() })
    }

    /// Every kind has been listed completely since start.
    pub fn all_synced(&self) -> bool {
        self.objects.read().expect("cache lock").all_synced()
    }

    /// The objects as they are, whatever their completeness (tooling, the checkpoint writer).
    pub fn with<R>(&self, read: impl FnOnce(&ClusterObjects) -> R) -> R {
        read(&self.objects.read().expect("cache lock"))
    }

    /// Like [`Self::with`], for the checkpoint writer that takes its feeds of the stores.
    pub fn with_mut<R>(&self, update: impl FnOnce(&mut ClusterObjects) -> R) -> R {
        update(&mut self.objects.write().expect("cache lock"))
    }
}

/// Wakes when one of its kinds changed.
pub struct Subscription {
    changes: watch::Receiver<Generations>,
    kinds: &'static [Kind],
    seen: Vec<u64>,
}

impl Trigger for Subscription {
    async fn changed(&mut self) -> bool {
        loop {
            if self.changes.changed().await.is_err() {
                return false;
            }
            let now = self.changes.borrow_and_update().of(self.kinds);
            if now != self.seen {
                self.seen = now;
                return true;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use kube::runtime::watcher::Event;

    use super::*;
    use crate::k8s::node::NodeFields;

    fn node(name: &str) -> NodeFields {
        serde_json::from_value(serde_json::json!({"metadata": {"name": name, "resourceVersion": "1"}})).unwrap()
    }

    #[tokio::test]
    async fn readers_see_nothing_before_a_complete_listing_unless_restored() {
        let cache = Cache::new(ClusterObjects::default(), None);
        assert!(cache.read(&[Kind::Nodes], |o| o.nodes.len()).is_none());
        cache.apply(WatchUpdate::Nodes(Event::Init));
        cache.apply(WatchUpdate::Nodes(Event::InitApply(node("a"))));
        assert!(cache.read(&[Kind::Nodes], |o| o.nodes.len()).is_none(), "half a listing");
        cache.apply(WatchUpdate::Nodes(Event::InitDone));
        let listing = cache.read(&[Kind::Nodes], |o| o.nodes.len()).unwrap();
        assert_eq!((listing.objects, listing.completeness), (1, Completeness::Complete));
        assert!(cache.read(&[Kind::Nodes, Kind::Pods], |_| ()).is_none());

        let mut restored = ClusterObjects::default();
        restored.nodes.restore([node("a")]);
        let cache = Cache::new(restored, Some(1.0));
        let listing = cache.read(&[Kind::Nodes], |o| o.nodes.len()).unwrap();
        assert_eq!((listing.objects, listing.completeness), (1, Completeness::Restored));
    }

    #[tokio::test]
    async fn a_subscription_wakes_for_its_kinds_only() {
        let cache = Cache::new(ClusterObjects::default(), None);
        let mut nodes = cache.subscribe(&[Kind::Nodes]);
        cache.apply(WatchUpdate::Pods(Event::InitDone));
        let woke = tokio::time::timeout(std::time::Duration::from_millis(50), nodes.changed()).await;
        assert!(woke.is_err(), "a Pod change woke the Node reader");
        cache.apply(WatchUpdate::Nodes(Event::InitDone));
        assert!(nodes.changed().await);
    }

    /// A kubelet's Node: `rv` its resourceVersion, `heartbeat` its Ready condition's time (and
    /// the TTL controller's annotation, which follows the cluster's size).
    fn kubelet_node(rv: u64, heartbeat: &str, pod_cidr: &str) -> NodeFields {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "node-2", "resourceVersion": rv.to_string(),
                "annotations": {"node.alpha.kubernetes.io/ttl": (rv * 15).to_string()}},
            "spec": {"podCIDR": pod_cidr, "podCIDRs": [pod_cidr],
                "taints": [{"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule", "timeAdded": heartbeat}]},
            "status": {"addresses": [{"type": "InternalIP", "address": "192.168.0.2"}],
                "conditions": [{"type": "Ready", "status": "True", "lastHeartbeatTime": heartbeat}]}
        }))
        .unwrap()
    }

    /// A heartbeat (a new resourceVersion and condition time, nothing a reader uses) is no
    /// change: no Node reader wakes, no generation moves. A pod CIDR change is one.
    #[tokio::test]
    async fn a_node_heartbeat_wakes_no_node_reader() {
        let cache = Cache::new(ClusterObjects::default(), None);
        cache.apply(WatchUpdate::Nodes(Event::Init));
        cache.apply(WatchUpdate::Nodes(Event::InitApply(kubelet_node(1, "2026-12-06T00:00:00Z", "10.0.2.0/24"))));
        cache.apply(WatchUpdate::Nodes(Event::InitDone));
        let mut readers = cache.subscribe(&[Kind::Nodes]);
        let generation = cache.generation(&[Kind::Nodes]);
        for (rv, heartbeat) in [(2, "2026-12-06T00:00:10Z"), (3, "2026-12-06T00:00:20Z")] {
            let update = WatchUpdate::Nodes(Event::Apply(kubelet_node(rv, heartbeat, "10.0.2.0/24")));
            assert_eq!(cache.apply(update), None, "heartbeat {rv} is a change");
        }
        assert_eq!(cache.generation(&[Kind::Nodes]), generation);
        let woke = tokio::time::timeout(std::time::Duration::from_millis(50), readers.changed()).await;
        assert!(woke.is_err(), "a heartbeat woke a Node reader");
        // The newest version is kept all the same: a relist bringing it back is no change either.
        cache.apply(WatchUpdate::Nodes(Event::Init));
        cache.apply(WatchUpdate::Nodes(Event::InitApply(kubelet_node(3, "2026-12-06T00:00:20Z", "10.0.2.0/24"))));
        assert_eq!(cache.apply(WatchUpdate::Nodes(Event::InitDone)), None);

        let update = WatchUpdate::Nodes(Event::Apply(kubelet_node(4, "2026-12-06T00:00:20Z", "10.0.3.0/24")));
        assert_eq!(cache.apply(update), Some(Kind::Nodes));
        assert!(readers.changed().await);
        assert_eq!(cache.generation(&[Kind::Nodes]), generation + 1);
    }
}
