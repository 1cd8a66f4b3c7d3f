//! The Service VIPs for the BGP speaker (`services::vips`), published on a watch channel that
//! wakes the routing controller. Whoever keeps the services catalog up to date publishes them:
//! the services controller, or with `--run-service-proxy=false` the [`ServiceViewController`]
//! here, which keeps a catalog for this alone (each store's change set has one consumer).
use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
};

use anyhow::Result;
use tokio::sync::watch;

use crate::{
    controllers::services::{report_catalog_problems, ClusterAddressFollower, SERVICE_KINDS},
    k8s::{cache::Cache, watch::Kind},
    metrics::Metrics,
    runtime::{Action, Controller},
    services::{
        family::IpFamily,
        incremental::{Changed, ServiceCatalog},
        model::{ExternalIpPolicy, ExternalIpRefusal, ServiceName},
        vips::{AdvertiseServices, ServiceVips, VipSettings, VipView},
    },
};

/// `None` until the Services have been listed or restored from the checkpoint.
pub type VipReceiver = watch::Receiver<Option<Arc<ServiceVips>>>;

/// Keeps the view and sends it when the VIPs change.
pub struct VipPublisher {
    view: VipView,
    sender: watch::Sender<Option<Arc<ServiceVips>>>,
    advertise: AdvertiseServices,
    /// Log and count the external IPs the policy refuses (the service proxy does when it runs).
    report_refusals: bool,
    /// The refusals logged, per Service, so one that persists is logged once.
    reported: BTreeMap<ServiceName, BTreeSet<String>>,
    metrics: Metrics,
}

impl VipPublisher {
    pub fn new(advertise: AdvertiseServices, report_refusals: bool, metrics: Metrics) -> (Self, VipReceiver) {
        let (sender, receiver) = watch::channel(None);
        let publisher =
            Self { view: VipView::default(), sender, advertise, report_refusals, reported: BTreeMap::new(), metrics };
        (publisher, receiver)
    }

    /// The settings of this node: `external_ips` refused, `unavailable_families` not served.
    pub fn settings(
        &self,
        node_name: &str,
        external_ips: ExternalIpPolicy,
        unavailable_families: BTreeSet<IpFamily>,
    ) -> VipSettings {
        VipSettings { advertise: self.advertise, node_name: node_name.to_string(), external_ips, unavailable_families }
    }

    /// Brings the view up to date with the `changed` Services (everything when the settings
    /// changed) and sends it if the VIPs moved, or if it was never sent.
    pub fn update(&mut self, catalog: &ServiceCatalog, changed: &Changed, settings: &VipSettings) {
        let (moved, refused) = self.view.update(catalog, changed, settings);
        if self.report_refusals {
            self.report(changed, refused);
        }
        if moved || self.sender.borrow().is_none() {
            let vips = self.view.vips();
            tracing::debug!(advertised = vips.advertised.len(), known = vips.all.len(), "Service VIPs");
            self.sender.send_replace(Some(Arc::new(vips)));
        }
    }

    fn report(&mut self, changed: &Changed, refused: Vec<(ServiceName, ExternalIpRefusal)>) {
        let mut now: BTreeMap<ServiceName, BTreeSet<String>> = BTreeMap::new();
        for (service, refusal) in refused {
            let seen = self.reported.get(&service).is_some_and(|s| s.contains(&refusal.message));
            if !seen {
                tracing::error!(service = %service, reason = refusal.reason, error = %refusal.message, "external IP refused; not advertised");
                self.metrics.of::<super::services::ServiceMetrics>().external_ip_refused(refusal.reason);
            }
            now.entry(service).or_default().insert(refusal.message);
        }
        match changed {
            Changed::Services(names) => {
                for name in names {
                    self.reported.remove(name);
                }
                self.reported.extend(now);
            }
            Changed::All => self.reported = now,
        }
    }
}

/// With `--run-service-proxy=false`: keeps the services catalog for the VIPs alone.
pub struct ServiceViewController {
    cache: Arc<Cache>,
    catalog: ServiceCatalog,
    /// The catalog's own feeds of the Service and EndpointSlice stores.
    feeds: Option<crate::services::from_stores::CatalogFeeds>,
    publisher: VipPublisher,
    node_name: String,
    /// The flags' external IP policy; the cluster's addresses are added as they come.
    external_ips: ExternalIpPolicy,
    /// The view's settings, with the cluster's addresses in the policy: rebuilt when a Node or
    /// the API server's endpoints change.
    settings: Option<VipSettings>,
    /// The Node changes the policy reflects.
    node_generation: u64,
    /// Every Node's addresses, followed Node by Node.
    cluster_addresses: ClusterAddressFollower,
    /// Catalog problems already logged.
    reported: BTreeSet<String>,
    metrics: Metrics,
}

impl ServiceViewController {
    pub fn new(
        cache: Arc<Cache>,
        publisher: VipPublisher,
        node_name: String,
        external_ips: ExternalIpPolicy,
        metrics: Metrics,
    ) -> Self {
        Self {
            cache,
            catalog: ServiceCatalog::default(),
            feeds: None,
            publisher,
            node_name,
            external_ips,
            settings: None,
            node_generation: 0,
            cluster_addresses: ClusterAddressFollower::default(),
            reported: BTreeSet::new(),
            metrics,
        }
    }
}

impl Controller for ServiceViewController {
    fn name(&self) -> &'static str {
        "service-view"
    }

    async fn reconcile(&mut self) -> Result<Action> {
        let (catalog, feeds) = (&mut self.catalog, &mut self.feeds);
        // Nothing before a complete listing or the checkpoint: the last view stays.
        let Some(listing) = self.cache.update(SERVICE_KINDS, |o| o.update_catalog(feeds, catalog)) else {
            return Ok(Action::AwaitChange);
        };
        let mut current = BTreeSet::new();
        report_catalog_problems(&self.catalog, &self.reported, &mut current, &self.metrics);
        self.reported = current;
        let node_generation = self.cache.generation(&[Kind::Nodes]);
        let api_server = ServiceName::new("default", "kubernetes");
        let api_server_moved = match &listing.objects {
            Changed::All => true,
            Changed::Services(names) => names.contains(&api_server),
        };
        let settings = match self.settings.take() {
            Some(settings) if !api_server_moved && node_generation == self.node_generation => settings,
            _ => {
                self.node_generation = node_generation;
                self.cluster_addresses.follow_nodes(&self.cache);
                let cluster = self.cluster_addresses.addresses(&self.catalog);
                let policy = self
                    .external_ips
                    .with_cluster_addresses([], cluster.api_server)
                    .with_cluster_node_addresses(&cluster.nodes);
                self.publisher.settings(&self.node_name, policy, BTreeSet::new())
            }
        };
        self.publisher.update(&self.catalog, &listing.objects, &settings);
        self.settings = Some(settings);
        Ok(Action::AwaitChange)
    }
}

#[cfg(test)]
mod tests {
    use kube::runtime::watcher::Event;
    use serde_json::json;

    use super::*;
    use crate::k8s::watch::{ClusterObjects, WatchUpdate};

    fn listed(cache: &Cache, kind: fn(Event<serde_json::Value>) -> WatchUpdate, objects: &[serde_json::Value]) {
        cache.apply(kind(Event::Init));
        for object in objects {
            cache.apply(kind(Event::InitApply(object.clone())));
        }
        cache.apply(kind(Event::InitDone));
    }

    fn typed<K: serde::de::DeserializeOwned>(event: Event<serde_json::Value>) -> Event<K> {
        let object = |o| serde_json::from_value(o).unwrap();
        match event {
            Event::Init => Event::Init,
            Event::InitApply(o) => Event::InitApply(object(o)),
            Event::InitDone => Event::InitDone,
            Event::Apply(o) => Event::Apply(object(o)),
            Event::Delete(o) => Event::Delete(object(o)),
        }
    }

    fn services(event: Event<serde_json::Value>) -> WatchUpdate {
        WatchUpdate::Services(typed(event))
    }

    fn slices(event: Event<serde_json::Value>) -> WatchUpdate {
        WatchUpdate::EndpointSlices(typed(event))
    }

    fn slice(node: &str) -> serde_json::Value {
        json!({"metadata": {"namespace": "shop", "name": "web-1", "resourceVersion": node,
                "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4", "endpoints": [{"addresses": ["10.244.1.5"], "nodeName": node}]})
    }

    /// The view of node-1, advertising externalIPs, over an empty cache.
    fn external_ip_view() -> (Arc<Cache>, ServiceViewController, VipReceiver) {
        let cache = Cache::new(ClusterObjects::default(), None);
        let advertise = AdvertiseServices { external_ip: true, ..Default::default() };
        let (publisher, vips) = VipPublisher::new(advertise, true, Metrics::default());
        let view = ServiceViewController::new(
            cache.clone(),
            publisher,
            "node-1".into(),
            Default::default(),
            Metrics::default(),
        );
        (cache, view, vips)
    }

    /// With the proxy off the VIPs are still computed, from a complete listing only, and a
    /// slice change moves them.
    #[tokio::test]
    async fn without_the_proxy_the_vips_follow_the_catalog() {
        let (cache, mut view, vips) = external_ip_view();
        let web = json!({"metadata": {"namespace": "shop", "name": "web", "resourceVersion": "1"},
            "spec": {"clusterIP": "10.96.0.10", "externalIPs": ["192.0.2.7"], "externalTrafficPolicy": "Local",
                "ports": [{"port": 80}]}});
        listed(&cache, services, &[web]);
        view.reconcile().await.unwrap();
        assert!(vips.borrow().is_none(), "nothing before the slices are listed too");
        listed(&cache, slices, &[slice("node-1")]);
        view.reconcile().await.unwrap();
        let advertised = |vips: &VipReceiver| vips.borrow().as_ref().unwrap().advertised.clone();
        assert_eq!(advertised(&vips), ["192.0.2.7/32".parse().unwrap()]);
        cache.apply(slices(Event::Apply(slice("node-2"))));
        view.reconcile().await.unwrap();
        assert!(advertised(&vips).is_empty(), "the local endpoint left this node");
        assert_eq!(vips.borrow().as_ref().unwrap().all.len(), 1);
    }

    fn nodes(event: Event<serde_json::Value>) -> WatchUpdate {
        WatchUpdate::Nodes(typed(event))
    }

    fn node(name: &str, version: &str, address: &str) -> serde_json::Value {
        json!({"metadata": {"name": name, "resourceVersion": version},
            "status": {"addresses": [{"type": "InternalIP", "address": address}]}})
    }

    /// A Node taking a Service's externalIP as its address takes the VIP out of what is
    /// advertised; the Node moving away, or leaving, gives it back. Each step is one Node's
    /// change, followed from the store's journal.
    #[tokio::test]
    async fn a_node_claiming_an_external_ip_withdraws_it_until_the_node_lets_go() {
        let (cache, mut view, vips) = external_ip_view();
        let web = json!({"metadata": {"namespace": "shop", "name": "web", "resourceVersion": "1"},
            "spec": {"clusterIP": "10.96.0.10", "externalIPs": ["192.0.2.7"], "ports": [{"port": 80}]}});
        listed(&cache, services, &[web]);
        listed(&cache, slices, &[slice("node-1")]);
        listed(&cache, nodes, &[node("node-1", "1", "192.0.2.1"), node("node-2", "1", "192.0.2.2")]);
        view.reconcile().await.unwrap();
        let advertised = |vips: &VipReceiver| vips.borrow().as_ref().unwrap().advertised.clone();
        let vip: Vec<ipnet::IpNet> = vec!["192.0.2.7/32".parse().unwrap()];
        assert_eq!(advertised(&vips), vip);
        cache.apply(nodes(Event::Apply(node("node-2", "2", "192.0.2.7"))));
        view.reconcile().await.unwrap();
        assert!(advertised(&vips).is_empty(), "node-2's address now");
        // A second Node on the same address: the address is claimed until both let go.
        cache.apply(nodes(Event::Apply(node("node-3", "3", "192.0.2.7"))));
        cache.apply(nodes(Event::Apply(node("node-2", "4", "192.0.2.2"))));
        view.reconcile().await.unwrap();
        assert!(advertised(&vips).is_empty(), "still node-3's");
        cache.apply(nodes(Event::Delete(node("node-3", "5", "192.0.2.7"))));
        view.reconcile().await.unwrap();
        assert_eq!(advertised(&vips), vip, "no Node claims it any more");
    }
}
