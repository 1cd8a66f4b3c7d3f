//! Watching the API server with kube-rs, outage-proof.
//!
//! Each watcher runs forever with capped exponential backoff (kube-rs `default_backoff`: jittered,
//! capped); errors are reported, never acted on. What the watchers deliver goes through
//! [`ObjectStore`](super::store::ObjectStore), which only changes on real events or complete
//! relists, so an outage leaves the desired state — and therefore the maps — as they were.
use std::{collections::BTreeSet, path::PathBuf, sync::Arc, time::Duration};

use anyhow::{Context, Result};
use futures_util::StreamExt;
use k8s_openapi::api::{
    core::v1::{Namespace, Node, Service},
    discovery::v1::EndpointSlice,
    networking::v1::NetworkPolicy,
};
use kube::{
    config::{KubeConfigOptions, Kubeconfig},
    runtime::{watcher, WatchStreamExt},
    Api, Client, Config,
};
use tokio::sync::mpsc;

use super::{
    checkpoint::Checkpoint,
    pod::{PodFields, SlimPod},
    store::{ObjectStore, Packed},
};
use crate::services::{
    incremental::{Changed, ServiceCatalog},
    model::ServiceName,
    source::StateBuilder,
};

/// How to reach the API server (kube-router's `--kubeconfig` / `--master`).
#[derive(Clone, Debug, Default)]
pub struct ApiOptions {
    pub kubeconfig: Option<PathBuf>,
    pub master: Option<String>,
}

pub async fn client(options: &ApiOptions) -> Result<Client> {
    let mut config = config(options).await?;
    // Bounded reads so a black-holed API server is noticed and retried instead of hanging.
    config.read_timeout = Some(Duration::from_secs(30));
    config.connect_timeout = Some(Duration::from_secs(10));
    Ok(Client::try_from(config)?)
}

/// The addresses the agent reaches the API server at (`--kubeconfig`/`--master`, else the
/// in-cluster config), a host name resolved once. No Service may capture them.
pub async fn api_server_addresses(options: &ApiOptions) -> std::collections::BTreeSet<std::net::IpAddr> {
    let Ok(config) = config(options).await else { return Default::default() };
    let url = &config.cluster_url;
    let Some(host) = url.host() else { return Default::default() };
    let host = host.trim_start_matches('[').trim_end_matches(']').to_string();
    if let Ok(ip) = host.parse() {
        return [ip].into();
    }
    let port = url.port_u16().unwrap_or(443);
    // Bounded: a resolver that does not answer must not hold the agent's start (an outage of the
    // name service changes nothing either).
    let lookup = tokio::net::lookup_host(format!("{host}:{port}"));
    let resolved = match tokio::time::timeout(std::time::Duration::from_secs(2), lookup).await {
        Ok(resolved) => resolved,
        Err(_) => Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer within 2 s")),
    };
    match resolved {
        Ok(addrs) => addrs.map(|a| a.ip()).collect(),
        Err(error) => {
            tracing::warn!(%host, %error, "cannot resolve the API server's name; its endpoints still protect it");
            Default::default()
        }
    }
}

async fn config(options: &ApiOptions) -> Result<Config> {
    let mut config = match (&options.kubeconfig, &options.master) {
        (Some(path), _) => {
            let kubeconfig =
                Kubeconfig::read_from(path).with_context(|| format!("reading kubeconfig {}", path.display()))?;
            Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?
        }
        (None, Some(master)) => {
            Config::new(master.parse().with_context(|| format!("--master {master:?} is not a URL"))?)
        }
        (None, None) => Config::infer().await.context("no --kubeconfig/--master and no in-cluster config")?,
    };
    if let (Some(_), Some(master)) = (&options.kubeconfig, &options.master) {
        config.cluster_url = master.parse().with_context(|| format!("--master {master:?} is not a URL"))?;
    }
    Ok(config)
}

/// (API group, resource) of everything the agent lists and watches; the RBAC in
/// manifests/ grants exactly these (checked by a test).
pub const WATCHED_RESOURCES: [(&str, &str); 6] = [
    ("", "services"),
    ("discovery.k8s.io", "endpointslices"),
    ("", "pods"),
    ("", "namespaces"),
    ("", "nodes"),
    ("networking.k8s.io", "networkpolicies"),
];

/// One watcher's news for the agent loop.
// Moved once through a channel, never stored in bulk: boxing would only add an allocation.
#[allow(clippy::large_enum_variant)]
pub enum WatchUpdate {
    Services(watcher::Event<Service>),
    EndpointSlices(watcher::Event<EndpointSlice>),
    Pods(watcher::Event<PodFields>),
    Namespaces(watcher::Event<Namespace>),
    Nodes(watcher::Event<Node>),
    NetworkPolicies(watcher::Event<NetworkPolicy>),
    /// A watch or list failed; the watcher backs off and retries by itself.
    Error {
        resource: &'static str,
        message: String,
    },
    /// Result of the periodic reachability probe (`GET /version`). Watches can be quiet for
    /// long stretches and only fail after their read timeout; the probe notices a dead API
    /// server within seconds. Any HTTP answer, even an error status, counts as reachable.
    Probe {
        reachable: bool,
        message: String,
    },
}

impl WatchUpdate {
    /// Whether the update carries an answer of the API server. A watcher's `Init` only marks
    /// the start of a relist (kube-runtime emits it before sending the list request), so it
    /// says nothing about reachability.
    pub fn is_api_answer(&self) -> bool {
        fn answered<K>(event: &watcher::Event<K>) -> bool {
            !matches!(event, watcher::Event::Init)
        }
        match self {
            WatchUpdate::Services(e) => answered(e),
            WatchUpdate::EndpointSlices(e) => answered(e),
            WatchUpdate::Pods(e) => answered(e),
            WatchUpdate::Namespaces(e) => answered(e),
            WatchUpdate::Nodes(e) => answered(e),
            WatchUpdate::NetworkPolicies(e) => answered(e),
            WatchUpdate::Error { .. } => false,
            WatchUpdate::Probe { reachable, .. } => *reachable,
        }
    }
}

/// How often, and how patiently, the API server's reachability is probed.
pub const PROBE_INTERVAL: Duration = Duration::from_secs(5);
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

fn spawn_probe(client: Client, updates: mpsc::Sender<WatchUpdate>) {
    tokio::spawn(async move {
        loop {
            let update = match tokio::time::timeout(PROBE_TIMEOUT, client.apiserver_version()).await {
                Ok(Ok(_)) => WatchUpdate::Probe { reachable: true, message: String::new() },
                Ok(Err(kube::Error::Api(status))) => {
                    WatchUpdate::Probe { reachable: true, message: status.to_string() }
                }
                Ok(Err(e)) => WatchUpdate::Probe { reachable: false, message: e.to_string() },
                Err(_) => WatchUpdate::Probe {
                    reachable: false,
                    message: format!("no answer to GET /version within {PROBE_TIMEOUT:?}"),
                },
            };
            if updates.send(update).await.is_err() {
                return;
            }
            tokio::time::sleep(PROBE_INTERVAL).await;
        }
    });
}

/// Starts the watchers; they run until the receiver is dropped.
pub fn spawn_watchers(client: Client, updates: mpsc::Sender<WatchUpdate>) {
    // Watch requests time out server-side after this; shorter than any client read timeout.
    let config = watcher::Config::default().timeout(20);
    spawn_one(Api::<Service>::all(client.clone()), config.clone(), updates.clone(), "services", WatchUpdate::Services);
    spawn_one(
        Api::<EndpointSlice>::all(client.clone()),
        config.clone(),
        updates.clone(),
        "endpointslices",
        WatchUpdate::EndpointSlices,
    );
    // Decoded with only the fields some reader uses (k8s/pod.rs): the rest is skipped unparsed.
    spawn_one(Api::<PodFields>::all(client.clone()), config.clone(), updates.clone(), "pods", WatchUpdate::Pods);
    spawn_one(
        Api::<Namespace>::all(client.clone()),
        config.clone(),
        updates.clone(),
        "namespaces",
        WatchUpdate::Namespaces,
    );
    spawn_one(Api::<Node>::all(client.clone()), config.clone(), updates.clone(), "nodes", WatchUpdate::Nodes);
    spawn_one(
        Api::<NetworkPolicy>::all(client.clone()),
        config,
        updates.clone(),
        "networkpolicies",
        WatchUpdate::NetworkPolicies,
    );
    spawn_probe(client, updates);
}

fn spawn_one<K>(
    api: Api<K>,
    config: watcher::Config,
    updates: mpsc::Sender<WatchUpdate>,
    resource: &'static str,
    wrap: fn(watcher::Event<K>) -> WatchUpdate,
) where
    K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + 'static,
    K::DynamicType: Default,
{
    tokio::spawn(async move {
        let mut stream = watcher(api, config).default_backoff().boxed();
        while let Some(item) = stream.next().await {
            let update = match item {
                Ok(event) => wrap(event),
                Err(e) => WatchUpdate::Error { resource, message: e.to_string() },
            };
            if updates.send(update).await.is_err() {
                return;
            }
        }
    });
}

/// Every object at one moment, shared with the stores.
pub struct CheckpointSnapshot {
    written_unix: f64,
    services: Vec<Arc<Service>>,
    endpoint_slices: Vec<Packed<EndpointSlice>>,
    pods: Vec<Arc<SlimPod>>,
    namespaces: Vec<Arc<Namespace>>,
    nodes: Vec<Arc<Node>>,
    network_policies: Vec<Arc<NetworkPolicy>>,
}

/// Serialises as the [`Checkpoint`] of the same objects, read in place (no copy of them).
impl serde::Serialize for CheckpointSnapshot {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        struct Shared<'a, H>(&'a [H]);
        impl<H: std::ops::Deref<Target: serde::Serialize>> serde::Serialize for Shared<'_, H> {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.collect_seq(self.0.iter().map(|object| &**object))
            }
        }
        let mut checkpoint = serializer.serialize_struct("Checkpoint", 7)?;
        checkpoint.serialize_field("written_unix", &self.written_unix)?;
        checkpoint.serialize_field("services", &Shared(&self.services))?;
        checkpoint.serialize_field("endpoint_slices", &self.endpoint_slices)?;
        // Pods are already kept without what the agent does not read (k8s::pod). Nodes lose
        // their BGP passwords on the way to the disk, each copy made as it is written.
        struct Stripped<'a, K>(&'a [Arc<K>], fn(&K) -> K);
        impl<K: serde::Serialize> serde::Serialize for Stripped<'_, K> {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.collect_seq(self.0.iter().map(|object| (self.1)(object)))
            }
        }
        checkpoint.serialize_field("pods", &Shared(&self.pods))?;
        checkpoint.serialize_field("namespaces", &Shared(&self.namespaces))?;
        checkpoint.serialize_field("nodes", &Stripped(&self.nodes, crate::k8s::checkpoint::node_for_checkpoint))?;
        checkpoint.serialize_field("network_policies", &Shared(&self.network_policies))?;
        checkpoint.end()
    }
}

/// `f` applied to the object an event carries, if any.
fn map_object<K>(event: watcher::Event<K>, f: fn(K) -> K) -> watcher::Event<K> {
    match event {
        watcher::Event::Apply(object) => watcher::Event::Apply(f(object)),
        watcher::Event::InitApply(object) => watcher::Event::InitApply(f(object)),
        other => other,
    }
}

/// Decoding leaves lists with room to grow (4 → 8 → 16); every object is kept as long as it
/// exists, so its lists are cut to their length.
fn compact_service(mut service: Service) -> Service {
    if let Some(spec) = service.spec.as_mut() {
        for list in [&mut spec.cluster_ips, &mut spec.external_ips, &mut spec.ip_families].into_iter().flatten() {
            list.shrink_to_fit();
        }
        if let Some(ports) = spec.ports.as_mut() {
            ports.shrink_to_fit();
        }
    }
    service
}

/// The watched kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Services,
    EndpointSlices,
    Pods,
    Namespaces,
    Nodes,
    NetworkPolicies,
}

/// Every watched object, as last seen. Pods, Namespaces, Nodes and NetworkPolicies are kept
/// (and checkpointed) for the policy and BGP controllers; the service proxy reads the first two.
/// EndpointSlices, the bulk of them (10 endpoints: 5.5 KiB decoded, 1 KiB of JSON), are kept
/// packed: only the changed ones are decoded, for the catalog.
///
/// Each store's change set ([`ObjectStore::take_changed`]) has exactly one consumer: Services
/// and EndpointSlices the services controller ([`Self::update_catalog`]), or without the proxy
/// the service-view controller (the BGP speaker's VIPs); Pods, Namespaces and
/// NetworkPolicies the policy controller. Nodes, read by several controllers, are journaled
/// instead: each reader follows them with its own cursor ([`ObjectStore::changed_since`]).
pub struct ClusterObjects {
    pub services: ObjectStore<Service>,
    pub endpoint_slices: ObjectStore<EndpointSlice, Packed<EndpointSlice>>,
    pub pods: ObjectStore<PodFields, Arc<SlimPod>>,
    pub namespaces: ObjectStore<Namespace>,
    pub nodes: ObjectStore<Node>,
    pub network_policies: ObjectStore<NetworkPolicy>,
}

impl Default for ClusterObjects {
    fn default() -> Self {
        Self {
            services: Default::default(),
            endpoint_slices: Default::default(),
            pods: Default::default(),
            namespaces: Default::default(),
            // Read by several controllers, each following only what changed.
            nodes: ObjectStore::journaled(),
            network_policies: Default::default(),
        }
    }
}

impl ClusterObjects {
    /// Applies a watcher update; returns whether the service proxy's desired state may have
    /// changed. [`Self::apply_kind`] says which kind changed.
    pub fn apply(&mut self, update: WatchUpdate) -> bool {
        self.apply_kind(update).is_some_and(|kind| matches!(kind, Kind::Services | Kind::EndpointSlices))
    }

    /// Applies a watcher update; returns the kind whose visible contents changed, if any.
    pub fn apply_kind(&mut self, update: WatchUpdate) -> Option<Kind> {
        let (kind, changed) = match update {
            WatchUpdate::Services(event) => (Kind::Services, self.services.apply(map_object(event, compact_service))),
            WatchUpdate::EndpointSlices(event) => (Kind::EndpointSlices, self.endpoint_slices.apply(event)),
            WatchUpdate::Pods(event) => (Kind::Pods, self.pods.apply(event)),
            WatchUpdate::Namespaces(event) => (Kind::Namespaces, self.namespaces.apply(event)),
            WatchUpdate::Nodes(event) => (Kind::Nodes, self.nodes.apply(event)),
            WatchUpdate::NetworkPolicies(event) => (Kind::NetworkPolicies, self.network_policies.apply(event)),
            WatchUpdate::Error { .. } | WatchUpdate::Probe { .. } => return None,
        };
        changed.then_some(kind)
    }

    /// Services and EndpointSlices have been listed completely since start: deletions of
    /// service map entries are safe.
    /// A complete listing of Services and EndpointSlices, as the watchers deliver one (Init,
    /// one InitApply per object, InitDone).
    pub fn list_services(&mut self, services: Vec<Service>, slices: Vec<EndpointSlice>) {
        self.apply(WatchUpdate::Services(watcher::Event::Init));
        for s in services {
            self.apply(WatchUpdate::Services(watcher::Event::InitApply(s)));
        }
        self.apply(WatchUpdate::Services(watcher::Event::InitDone));
        self.apply(WatchUpdate::EndpointSlices(watcher::Event::Init));
        for s in slices {
            self.apply(WatchUpdate::EndpointSlices(watcher::Event::InitApply(s)));
        }
        self.apply(WatchUpdate::EndpointSlices(watcher::Event::InitDone));
    }

    pub fn synced(&self) -> bool {
        self.services.synced() && self.endpoint_slices.synced()
    }

    /// Every kind has been listed completely since start: the checkpoint is a whole picture.
    pub fn all_synced(&self) -> bool {
        self.synced()
            && self.pods.synced()
            && self.namespaces.synced()
            && self.nodes.synced()
            && self.network_policies.synced()
    }

    pub fn state(&self) -> StateBuilder {
        let mut builder = StateBuilder::default();
        for service in self.services.objects() {
            builder.add_service(service);
        }
        for slice in self.endpoint_slices.objects() {
            builder.add_endpoint_slice(&slice);
        }
        builder
    }

    /// Converts again the Services and EndpointSlices that changed since the last call, into
    /// `catalog`; returns the Services they concern. The first call converts everything.
    pub fn update_catalog(&mut self, catalog: &mut ServiceCatalog) -> Changed {
        let (services, slices, all) = match (self.services.take_changed(), self.endpoint_slices.take_changed()) {
            (Some(services), Some(slices)) => (services, slices, false),
            // Object by object all the same, so each one's problems are its own to clear.
            _ => {
                *catalog = ServiceCatalog::default();
                (self.services.keys().cloned().collect(), self.endpoint_slices.keys().cloned().collect(), true)
            }
        };
        let mut changed = BTreeSet::new();
        for key in services {
            let name = ServiceName::new(key.0.clone(), key.1.clone());
            let converted = self.services.get(&key).map(|object| {
                let mut builder = StateBuilder::default();
                builder.add_service(object);
                builder
            });
            catalog.set_service(&name, converted);
            changed.insert(name);
        }
        for key in slices {
            let converted = self.endpoint_slices.get(&key).map(|object| {
                let mut builder = StateBuilder::default();
                builder.add_endpoint_slice(&object);
                builder
            });
            changed.extend(catalog.set_slice(&key, converted));
        }
        if all {
            return Changed::All;
        }
        Changed::Services(changed)
    }

    /// Every object, shared, for the checkpoint to be written off the agent's loop.
    pub fn snapshot(&self) -> CheckpointSnapshot {
        CheckpointSnapshot {
            written_unix: crate::metrics::unix_now(),
            services: self.services.snapshot(),
            endpoint_slices: self.endpoint_slices.snapshot(),
            pods: self.pods.snapshot(),
            namespaces: self.namespaces.snapshot(),
            nodes: self.nodes.snapshot(),
            network_policies: self.network_policies.snapshot(),
        }
    }

    pub fn checkpoint(&self) -> Checkpoint {
        Checkpoint {
            written_unix: crate::metrics::unix_now(),
            services: self.services.objects().cloned().collect(),
            endpoint_slices: self.endpoint_slices.objects().collect(),
            pods: self.pods.objects().cloned().collect(),
            namespaces: self.namespaces.objects().cloned().collect(),
            nodes: self.nodes.objects().map(crate::k8s::checkpoint::node_for_checkpoint).collect(),
            network_policies: self.network_policies.objects().cloned().collect(),
        }
    }

    pub fn restore(&mut self, checkpoint: Checkpoint) {
        self.services.restore(checkpoint.services);
        self.endpoint_slices.restore(checkpoint.endpoint_slices);
        self.pods.restore_held(checkpoint.pods.into_iter().map(|pod| {
            let key = (pod.namespace.to_string(), pod.name.to_string());
            (key, Arc::new(pod))
        }));
        self.namespaces.restore(checkpoint.namespaces);
        self.nodes.restore(checkpoint.nodes);
        self.network_policies.restore(checkpoint.network_policies);
    }
}

#[cfg(test)]
mod tests {
    use kube::runtime::watcher::Event;

    use super::*;
    use crate::k8s::checkpoint;
    use crate::services::{
        compile::{assign_ids, plan, Limits, MapContents},
        diff::diff,
        model::NodeContext,
    };

    fn service(name: &str, ip: &str, rv: u64) -> Service {
        serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": "default", "name": name, "resourceVersion": rv.to_string()},
            "spec": {"clusterIP": ip, "ports": [{"name": "http", "port": 80}]}
        }))
        .unwrap()
    }

    fn slice(service: &str, addr: &str, rv: u64) -> EndpointSlice {
        serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": "default", "name": format!("{service}-1"), "resourceVersion": rv.to_string(),
                         "labels": {"kubernetes.io/service-name": service}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080}],
            "endpoints": [{"addresses": [addr]}]
        }))
        .unwrap()
    }

    fn contents(objects: &ClusterObjects, current: &MapContents) -> MapContents {
        assign_ids(&plan(&objects.state().state, &NodeContext::default(), Limits::default()), current)
    }

    fn listed(objects: &mut ClusterObjects, services: Vec<Service>, slices: Vec<EndpointSlice>) {
        objects.list_services(services, slices);
    }

    #[test]
    fn errors_and_broken_relists_leave_the_desired_state_as_it_was() {
        let mut objects = ClusterObjects::default();
        listed(
            &mut objects,
            vec![service("a", "10.96.0.1", 1), service("b", "10.96.0.2", 2)],
            vec![slice("a", "10.0.0.1", 3)],
        );
        assert!(objects.synced());
        let programmed = contents(&objects, &MapContents::default());
        // Outage: errors, then a relist that never completes.
        assert!(!objects.apply(WatchUpdate::Error { resource: "services", message: "connection refused".into() }));
        objects.apply(WatchUpdate::Services(Event::Init));
        objects.apply(WatchUpdate::EndpointSlices(Event::Init));
        assert!(diff(&programmed, &contents(&objects, &programmed), true).is_empty());
    }

    #[test]
    fn a_completed_relist_yields_exactly_the_real_difference() {
        let mut objects = ClusterObjects::default();
        listed(
            &mut objects,
            vec![service("a", "10.96.0.1", 1), service("b", "10.96.0.2", 2)],
            vec![slice("a", "10.0.0.1", 3)],
        );
        let programmed = contents(&objects, &MapContents::default());
        // While we were away: b was deleted and a's endpoint changed.
        listed(&mut objects, vec![service("a", "10.96.0.1", 1)], vec![slice("a", "10.0.0.9", 7)]);
        let next = contents(&objects, &programmed);
        let ops = diff(&programmed, &next, true);
        // The new backend, a's slot pointing at it, b's frontend removed, the old backend removed.
        use crate::services::diff::MapOp::*;
        assert_eq!(next.services.len(), 1);
        assert!(matches!(ops.as_slice(), [PutBackend(..), PutSlot(..), DeleteService(_), DeleteBackend(_)]), "{ops:?}");
    }

    #[test]
    fn checkpoint_round_trip_restores_the_same_desired_state() {
        let mut objects = ClusterObjects::default();
        listed(&mut objects, vec![service("a", "10.96.0.1", 1)], vec![slice("a", "10.0.0.1", 3)]);
        let programmed = contents(&objects, &MapContents::default());
        let mut restored = ClusterObjects::default();
        restored.restore(objects.checkpoint());
        assert!(!restored.synced(), "a checkpoint is not a complete listing");
        assert_eq!(contents(&restored, &programmed), programmed);
    }

    #[test]
    fn the_streamed_snapshot_reads_back_as_the_checkpoint_of_the_same_objects() {
        let mut objects = ClusterObjects::default();
        let mut odd = service("a", "10.96.0.1", 1);
        // Quotes, backslashes, a control character and non-ASCII text inside the payload.
        odd.metadata.annotations =
            Some([("note".to_string(), "say \"hi\" \\ tab\there, ünïcødé \u{1}".to_string())].into());
        listed(&mut objects, vec![odd, service("b", "10.96.0.2", 2)], vec![slice("a", "10.0.0.1", 3)]);
        let dir = std::env::temp_dir().join(format!("krt-snapshot-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let snapshot = objects.snapshot();
        let written_unix = snapshot.written_unix;
        checkpoint::write_payload(&dir, &snapshot).unwrap();
        let read = checkpoint::read(&dir).unwrap();
        // A float read back from JSON may differ in its last bit.
        assert!((read.written_unix - written_unix).abs() < 1e-3);
        assert_eq!(Checkpoint { written_unix: 0.0, ..read }, Checkpoint { written_unix: 0.0, ..objects.checkpoint() });
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_catalog_follows_each_change_and_names_the_services_it_concerns() {
        let mut objects = ClusterObjects::default();
        let mut catalog = ServiceCatalog::default();
        objects.apply(WatchUpdate::Services(Event::Apply(service("d", "not an address", 1))));
        assert_eq!(objects.update_catalog(&mut catalog), Changed::All, "the first call converts everything");
        assert_eq!(catalog.problems().count(), 1);
        objects.apply(WatchUpdate::Services(Event::Delete(service("d", "not an address", 2))));
        objects.update_catalog(&mut catalog);
        assert_eq!(catalog.problems().count(), 0);
        let names = |changed: Changed| match changed {
            Changed::Services(names) => names.into_iter().map(|n| n.name.to_string()).collect::<Vec<_>>(),
            Changed::All => vec!["*".to_string()],
        };
        let same_as_a_full_conversion = |objects: &ClusterObjects, catalog: &ServiceCatalog| {
            assert_eq!(catalog.state, objects.state().state);
            for name in catalog.state.services.keys() {
                let slices: Vec<&crate::services::model::EndpointSlice> =
                    catalog.state.slices.values().filter(|s| &s.service == name).collect();
                assert_eq!(catalog.slices_of(name), slices);
            }
        };
        listed(
            &mut objects,
            vec![service("a", "10.96.0.1", 1), service("b", "10.96.0.2", 2)],
            vec![slice("a", "10.0.0.1", 3)],
        );
        assert_eq!(names(objects.update_catalog(&mut catalog)), ["a", "b"]);
        same_as_a_full_conversion(&objects, &catalog);

        objects.apply(WatchUpdate::EndpointSlices(Event::Apply(slice("a", "10.0.0.2", 4))));
        assert_eq!(names(objects.update_catalog(&mut catalog)), ["a"]);
        same_as_a_full_conversion(&objects, &catalog);

        // A broken relist changes nothing; a complete one with a difference names it.
        objects.apply(WatchUpdate::Services(Event::Init));
        objects.apply(WatchUpdate::Services(Event::InitApply(service("a", "10.96.0.1", 1))));
        assert_eq!(names(objects.update_catalog(&mut catalog)), Vec::<String>::new());
        objects.apply(WatchUpdate::Services(Event::Init));
        objects.apply(WatchUpdate::Services(Event::InitApply(service("a", "10.96.0.1", 1))));
        objects.apply(WatchUpdate::Services(Event::InitApply(service("c", "10.96.0.3", 5))));
        objects.apply(WatchUpdate::Services(Event::InitDone));
        assert_eq!(names(objects.update_catalog(&mut catalog)), ["b", "c"]);
        same_as_a_full_conversion(&objects, &catalog);

        objects.apply(WatchUpdate::EndpointSlices(Event::Delete(slice("a", "10.0.0.2", 6))));
        objects.apply(WatchUpdate::Services(Event::Apply(service("a", "not an address", 7))));
        assert_eq!(names(objects.update_catalog(&mut catalog)), ["a"]);
        same_as_a_full_conversion(&objects, &catalog);
        assert_eq!(catalog.problems().count(), 1);
        objects.apply(WatchUpdate::Services(Event::Apply(service("a", "10.96.0.1", 8))));
        objects.update_catalog(&mut catalog);
        assert_eq!(catalog.problems().count(), 0);
    }
}
