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
    controllers::services::{cluster_addresses, report_catalog_problems, SERVICE_KINDS},
    k8s::cache::Cache,
    metrics::Metrics,
    runtime::{Action, Controller},
    services::{
        incremental::{Changed, ServiceCatalog},
        model::{ExternalIpPolicy, ServiceName},
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

    /// Brings the view up to date with the `changed` Services (everything when the node's
    /// settings changed) and sends it if the VIPs moved, or if it was never sent.
    pub fn update(
        &mut self,
        catalog: &ServiceCatalog,
        changed: &Changed,
        node_name: &str,
        external_ips: ExternalIpPolicy,
        unavailable_families: BTreeSet<crate::services::family::IpFamily>,
    ) {
        let settings = VipSettings {
            advertise: self.advertise,
            node_name: node_name.to_string(),
            external_ips,
            unavailable_families,
        };
        let (moved, refused) = self.view.update(catalog, changed, &settings);
        if self.report_refusals {
            self.report(changed, refused);
        }
        if moved || self.sender.borrow().is_none() {
            let vips = self.view.vips();
            tracing::debug!(advertised = vips.advertised.len(), known = vips.all.len(), "Service VIPs");
            self.sender.send_replace(Some(Arc::new(vips)));
        }
    }

    fn report(&mut self, changed: &Changed, refused: Vec<(ServiceName, crate::services::model::ExternalIpRefusal)>) {
        let mut now: BTreeMap<ServiceName, BTreeSet<String>> = BTreeMap::new();
        for (service, refusal) in refused {
            let seen = self.reported.get(&service).is_some_and(|s| s.contains(&refusal.message));
            if !seen {
                tracing::error!(service = %service, reason = refusal.reason, error = %refusal.message, "external IP refused; not advertised");
                self.metrics.with(|m| *m.external_ips_refused.entry(refusal.reason).or_default() += 1);
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
    publisher: VipPublisher,
    node_name: String,
    /// The flags' external IP policy; the cluster's addresses are added as they come.
    external_ips: ExternalIpPolicy,
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
            publisher,
            node_name,
            external_ips,
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
        let catalog = &mut self.catalog;
        // Nothing before a complete listing or the checkpoint: the last view stays.
        let Some(listing) = self.cache.update(SERVICE_KINDS, |o| o.update_catalog(catalog)) else {
            return Ok(Action::AwaitChange);
        };
        let mut current = BTreeSet::new();
        report_catalog_problems(&self.catalog, &self.reported, &mut current, &self.metrics);
        self.reported = current;
        let cluster = cluster_addresses(&self.cache, &self.catalog);
        let external_ips = self.external_ips.with_cluster_addresses(cluster.nodes, cluster.api_server);
        self.publisher.update(&self.catalog, &listing.objects, &self.node_name, external_ips, BTreeSet::new());
        Ok(Action::AwaitChange)
    }
}
