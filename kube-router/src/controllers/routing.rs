//! Pod routing as a controller: the BGP speaker follows the Node objects and the Service VIPs
//! the services catalog publishes (`controllers::service_view`), or the flags alone without the
//! API server. It decodes no Service or EndpointSlice itself. A speaker that fails to start is
//! an error of this controller, so the runner tries again with backoff, with no new input needed.
use std::{sync::Arc, time::Duration};

use anyhow::Result;

use crate::{
    controllers::service_view::VipReceiver,
    k8s::{cache::Cache, store::Cursor, watch::Kind},
    routing::router::BgpRouter,
    runtime::{Action, Controller},
};

/// The kinds the routes are derived from (the Services come as VIPs).
pub const ROUTING_KINDS: &[Kind] = &[Kind::Nodes];

/// How often the speaker's state is published to the metrics.
const PUBLISH_INTERVAL: Duration = Duration::from_secs(1);

pub struct RoutingController {
    router: BgpRouter,
    /// `None`: configuration from the flags only.
    cache: Option<Arc<Cache>>,
    /// The Service VIPs, when Services are advertised.
    vips: Option<VipReceiver>,
    /// The Node changes, as last applied.
    generation: Option<u64>,
    /// The Node changes read so far: a pass reads the changed Nodes, not every Node.
    cursor: Option<Cursor>,
    /// Flags only: the configuration is incomplete (logged once).
    static_config_missing: bool,
}

impl RoutingController {
    pub fn new(router: BgpRouter, cache: Option<Arc<Cache>>, vips: Option<VipReceiver>) -> Self {
        Self { router, cache, vips, generation: None, cursor: None, static_config_missing: false }
    }

    /// For the ordered shutdown.
    pub fn into_router(self) -> BgpRouter {
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
        let generation = cache.generation(ROUTING_KINDS);
        let vips_changed = self.vips.as_ref().is_some_and(|v| v.has_changed().unwrap_or(false));
        if self.generation == Some(generation) && !vips_changed && !self.router.start_failed() {
            return Ok(());
        }
        // Restored from the checkpoint, the VIPs come at once: the speaker starts with them, so
        // peers holding our routes through a restart see none withdrawn.
        let vips = match &mut self.vips {
            Some(receiver) => {
                let vips = receiver.borrow_and_update().clone();
                if vips.is_none() && cache.restored() {
                    return Ok(());
                }
                vips.unwrap_or_default()
            }
            None => Default::default(),
        };
        // Peers leave the mesh only on a complete listing of Nodes (or its checkpoint), never
        // because a list failed; the cache keeps the last complete one through an outage.
        let cursor = self.cursor;
        let Some(listing) = cache.read(ROUTING_KINDS, |o| o.nodes.follow(cursor)) else {
            return Ok(());
        };
        let (nodes, cursor) = listing.objects;
        self.generation = Some(generation);
        self.cursor = Some(cursor);
        let started = std::time::Instant::now();
        let result = self.router.update_from_nodes(nodes, &vips).await;
        self.router.routing_metrics().sync_time.observe(started.elapsed().as_secs_f64());
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
