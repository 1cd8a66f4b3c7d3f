//! Pod routing as a controller: the BGP speaker follows the Node objects (and the Services it
//! advertises), or the flags alone without the API server. A speaker that fails to start is an
//! error of this controller, so the runner tries again with backoff, with no new input needed.
use std::{collections::HashMap, sync::Arc, time::Duration};

use anyhow::Result;
use k8s_openapi::{api::discovery::v1::EndpointSlice, apimachinery::pkg::apis::meta::v1::ObjectMeta};

use crate::{
    k8s::{cache::Cache, store::Packed, watch::Kind},
    router::RouterController,
    runtime::{Action, Controller},
};

/// The kinds the routes are derived from.
pub const ROUTING_KINDS: &[Kind] = &[Kind::Nodes, Kind::Services, Kind::EndpointSlices];

/// What wakes the routing controller: Nodes, and Services and EndpointSlices when it
/// advertises Service addresses.
pub fn trigger_kinds(advertise_services: bool) -> &'static [Kind] {
    if advertise_services {
        ROUTING_KINDS
    } else {
        &[Kind::Nodes]
    }
}

/// How often the speaker's state is published to the metrics.
const PUBLISH_INTERVAL: Duration = Duration::from_secs(1);

pub struct RoutingController {
    router: RouterController,
    /// `None`: configuration from the flags only.
    cache: Option<Arc<Cache>>,
    /// The kinds whose changes re-derive the configuration.
    kinds: &'static [Kind],
    /// The changes of the kinds read, as last applied.
    generation: Option<u64>,
    /// Flags only: the configuration is incomplete (logged once).
    static_config_missing: bool,
}

impl RoutingController {
    pub fn new(router: RouterController, cache: Option<Arc<Cache>>, advertise_services: bool) -> Self {
        let kinds = trigger_kinds(advertise_services);
        Self { router, cache, kinds, generation: None, static_config_missing: false }
    }

    /// For the ordered shutdown.
    pub fn into_router(self) -> RouterController {
        self.router
    }

    async fn sync(&mut self) -> Result<()> {
        let Some(cache) = self.cache.as_ref() else {
            return match self.router.static_config() {
                Ok(bgp) => self.router.apply(bgp, Default::default()).await,
                Err(e) => {
                    if !std::mem::replace(&mut self.static_config_missing, true) {
                        tracing::info!(reason = %e, "BGP not started");
                    }
                    Ok(())
                }
            };
        };
        let generation = cache.generation(self.kinds);
        if self.generation == Some(generation) && !self.router.start_failed() {
            return Ok(());
        }
        // Peers leave the mesh only on a complete listing of Nodes (or its checkpoint), never
        // because a list failed; the cache keeps the last complete one through an outage.
        let Some(listing) =
            cache.read(&[Kind::Nodes], |o| (o.nodes.snapshot(), o.services.snapshot(), o.endpoint_slices.snapshot()))
        else {
            return Ok(());
        };
        self.generation = Some(generation);
        let (nodes, services, slices) = listing.objects;
        let started = std::time::Instant::now();
        // The slices stay packed; only those of Services with a local traffic policy are decoded.
        let owners = std::sync::OnceLock::new();
        let slices_of = |namespace: &str, name: &str| -> Vec<EndpointSlice> {
            let owners = owners.get_or_init(|| slices_by_service(&slices));
            owners
                .get(&(namespace.to_string(), name.to_string()))
                .map_or_else(Vec::new, |found: &Vec<usize>| found.iter().map(|&i| slices[i].decode()).collect())
        };
        let result =
            self.router.update_from_nodes(nodes.iter().map(|n| &**n), services.iter().map(|s| &**s), &slices_of).await;
        self.router.metrics().with(|m| m.kr.bgp_peers_sync_time.observe(started.elapsed().as_secs_f64()));
        result
    }
}

impl Controller for RoutingController {
    fn name(&self) -> &'static str {
        "routing"
    }

    async fn reconcile(&mut self) -> Result<Action> {
        let result = self.sync().await;
        self.router.publish_metrics();
        result.map(|()| Action::RequeueAfter(PUBLISH_INTERVAL))
    }
}

/// Indices of the slices of each Service (namespace, `kubernetes.io/service-name`), from their
/// metadata alone.
fn slices_by_service(slices: &[Packed<EndpointSlice>]) -> HashMap<(String, String), Vec<usize>> {
    #[derive(serde::Deserialize)]
    struct Owner {
        metadata: ObjectMeta,
    }
    let mut owners: HashMap<(String, String), Vec<usize>> = HashMap::new();
    for (i, slice) in slices.iter().enumerate() {
        let Some(Owner { metadata }) = slice.decode_as::<Owner>() else { continue };
        let Some(service) = metadata.labels.and_then(|mut l| l.remove("kubernetes.io/service-name")) else { continue };
        owners.entry((metadata.namespace.unwrap_or_else(|| "default".into()), service)).or_default().push(i);
    }
    owners
}
