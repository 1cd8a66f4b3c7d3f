//! Services from the API server (or the checkpoint until it lists them), with the addresses of
//! the cluster's objects no Service may claim.
use std::{collections::BTreeSet, net::IpAddr, sync::Arc};

use anyhow::Result;
use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;
use tokio::sync::watch;

use super::programmer::ServiceProgrammer;
use crate::{
    controllers::service_view::VipPublisher,
    k8s::{
        cache::{Cache, Completeness},
        store::{Cursor, Followed, ObjectKey},
        watch::Kind,
    },
    runtime::{Action, Controller},
    services::{
        from_k8s::{node_object_addresses, TOPOLOGY_ZONE_LABEL},
        incremental::{Changed, ServiceCatalog},
        model::ServiceName,
        node_addresses::{ClaimedAddresses, NodeAddressIndex},
    },
};

/// Every Node's addresses (from the objects) and the API server's (the endpoints of
/// `default/kubernetes`): no Service may claim them. The Nodes are followed with their own
/// cursor in the store's journal: a pass after one Node changed reads that Node alone.
#[derive(Debug, Default)]
pub(crate) struct ClusterAddressFollower {
    cursor: Option<Cursor>,
    nodes: NodeAddressIndex,
}

impl ClusterAddressFollower {
    /// Reads the Nodes changed since the last call (every Node the first time, after a restore
    /// or when the store forgot what changed).
    pub fn follow_nodes(&mut self, cache: &Cache) {
        let cursor = self.cursor;
        let (followed, cursor) = cache.with(|o| o.nodes.follow(cursor));
        self.cursor = Some(cursor);
        let addresses = |node: &Node| node_object_addresses(node).collect::<BTreeSet<_>>();
        match followed {
            Followed::All(nodes) => {
                self.nodes.replace_all(nodes.iter().map(|node| (node.name_any(), addresses(node))));
            }
            Followed::Changed(changed) => {
                for (ObjectKey { name, .. }, node) in changed {
                    self.nodes.set_node(&name, node.as_deref().map(addresses).unwrap_or_default());
                }
            }
        }
    }

    /// The addresses as followed, with the API server's from `catalog`.
    pub fn addresses(&self, catalog: &ServiceCatalog) -> ClusterAddresses {
        let kubernetes = ServiceName::new("default", "kubernetes");
        let api_server =
            catalog.slices_of(&kubernetes).into_iter().flat_map(|s| s.endpoints.iter().map(|e| e.addr)).collect();
        ClusterAddresses { nodes: self.nodes.claimed().clone(), api_server }
    }
}

/// The addresses of the cluster's objects no Service may claim as an externalIP or
/// LoadBalancer IP.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClusterAddresses {
    /// Every Node's InternalIP and ExternalIP, shared.
    pub nodes: ClaimedAddresses,
    /// The endpoints of `default/kubernetes`: the API servers.
    pub api_server: BTreeSet<IpAddr>,
}

/// The kinds the services controller reads.
pub const SERVICE_KINDS: &[Kind] = &[Kind::Services, Kind::EndpointSlices];
/// What wakes it: those, and Nodes (this node's zone).
pub const SERVICE_TRIGGER_KINDS: &[Kind] = &[Kind::Services, Kind::EndpointSlices, Kind::Nodes];

/// Services from the API server (or the checkpoint until it lists them).
pub struct ServicesFromApi {
    controller: ServiceProgrammer,
    cache: Arc<Cache>,
    /// The Services and EndpointSlices converted, kept up to date object by object.
    catalog: ServiceCatalog,
    /// The catalog's own feeds of the Service and EndpointSlice stores.
    feeds: Option<crate::services::from_stores::CatalogFeeds>,
    /// The Services changed since the last sync.
    changed: Changed,
    /// Something other than the objects (the node's zone or addresses, a failed write) asks
    /// for a sync.
    dirty: bool,
    /// The node's addresses (NodePorts listen on them), as the interfaces controller saw them.
    node_addresses: watch::Receiver<Vec<IpAddr>>,
    /// The changes of the Services and EndpointSlices seen so far.
    generation: u64,
    /// The changes of the Nodes seen so far (their addresses are refused as externalIPs);
    /// `None` before the first run (restored Nodes count no change).
    node_generation: Option<u64>,
    /// The Nodes changed since their addresses were last collected.
    nodes_moved: bool,
    /// Every Node's addresses, followed Node by Node.
    cluster_addresses: ClusterAddressFollower,
    /// The VIPs for the BGP speaker, from the same catalog (when it advertises Services).
    vips: Option<VipPublisher>,
}

impl ServicesFromApi {
    pub fn new(
        mut controller: ServiceProgrammer,
        cache: Arc<Cache>,
        node_addresses: watch::Receiver<Vec<IpAddr>>,
    ) -> Self {
        controller.follow_addresses(&node_addresses);
        // Restored from the checkpoint: applied at once (without deletions).
        let dirty = cache.restored();
        Self {
            controller,
            cache,
            catalog: ServiceCatalog::default(),
            feeds: None,
            changed: Changed::All,
            dirty,
            node_addresses,
            generation: 0,
            node_generation: None,
            nodes_moved: true,
            cluster_addresses: ClusterAddressFollower::default(),
            vips: None,
        }
    }

    /// Also publishes the Service VIPs the BGP speaker advertises.
    pub fn with_vips(mut self, publisher: VipPublisher) -> Self {
        self.vips = Some(publisher);
        self
    }

    /// Every Node's addresses and the API server's endpoints: refused as externalIPs. The
    /// checkpoint restores them with the Services, so a restart never lets a refused address in.
    /// Collected again only when a Node or the API server's endpoints changed: a Service change
    /// walks no Node.
    fn follow_cluster_addresses(&mut self, catalog_changed: &Changed) {
        let api_server_moved = match catalog_changed {
            Changed::All => true,
            Changed::Services(names) => names.contains(&ServiceName::new("default", "kubernetes")),
        };
        if !self.nodes_moved && !api_server_moved {
            return;
        }
        self.nodes_moved = false;
        self.cluster_addresses.follow_nodes(&self.cache);
        let now = self.cluster_addresses.addresses(&self.catalog);
        if now != self.controller.cluster_addresses {
            tracing::info!(nodes = now.nodes.len(), api_server = ?now.api_server, "addresses no Service may claim");
            self.controller.cluster_addresses = now;
        }
    }

    /// The VIPs of the Services changed in this run, judged on the node as the last compile
    /// saw it: what it refuses or cannot serve is not advertised.
    fn publish_vips(&mut self, changed: Option<Changed>) {
        let (Some(vips), Some(changed)) = (self.vips.as_mut(), changed) else { return };
        let node = self.controller.last_node.clone().unwrap_or_else(|| self.controller.node_context());
        let settings = vips.settings(&node.name, node.external_ips, node.unavailable_families);
        vips.update(&self.catalog, &changed, &settings);
    }

    /// Only this node's zone matters to the Services; other Node changes do not.
    fn follow_zone(&mut self) {
        let key = ObjectKey::new("", &self.controller.node_name);
        let zone = self
            .cache
            .with(|o| o.nodes.get(&key).and_then(|n| n.metadata.labels.as_ref()?.get(TOPOLOGY_ZONE_LABEL).cloned()));
        if zone != self.controller.zone {
            tracing::info!(zone = ?zone, "node zone changed; topology hints follow it");
            self.controller.zone = zone;
            self.dirty = true;
        }
    }
}

impl Controller for ServicesFromApi {
    fn name(&self) -> &'static str {
        "services"
    }

    async fn reconcile(&mut self) -> Result<Action> {
        let node_generation = self.cache.generation(&[Kind::Nodes]);
        if self.node_generation != Some(node_generation) {
            self.node_generation = Some(node_generation);
            self.follow_zone();
            self.nodes_moved = true;
            self.dirty = true;
        }
        if self.node_addresses.has_changed().unwrap_or(false) {
            self.node_addresses.borrow_and_update();
            self.dirty = true;
        }
        let generation = self.cache.generation(SERVICE_KINDS);
        if generation != self.generation {
            self.generation = generation;
            self.dirty = true;
        }
        if !self.dirty {
            return Ok(Action::AwaitChange);
        }
        // Before the first complete listing only a checkpoint-restored state is applied, and
        // then without deletions.
        let full = self.controller.full_compile_only;
        let (catalog, feeds) = (&mut self.catalog, &mut self.feeds);
        let Some(listing) = self.cache.update(SERVICE_KINDS, |o| {
            if full {
                *catalog = ServiceCatalog::from_builder(o.state());
            }
            o.update_catalog(feeds, catalog)
        }) else {
            return Ok(Action::AwaitChange);
        };
        self.dirty = false;
        self.follow_cluster_addresses(&listing.objects);
        let changed_now = self.vips.is_some().then(|| listing.objects.clone());
        self.changed.merge(listing.objects);
        let complete = listing.completeness == Completeness::Complete;
        let restored_as_of = self.cache.restored_as_of();
        if !complete && self.controller.stamp.keeps_maps_over_checkpoint(restored_as_of, &self.controller.metrics) {
            // Programming the checkpoint would take the maps back to an older state.
            self.publish_vips(changed_now);
            return Ok(Action::AwaitChange);
        }
        let changed = std::mem::take(&mut self.changed);
        if complete {
            self.controller.stamp.begin_write(&self.controller.metrics);
        }
        let failed = self.controller.apply(&self.catalog, changed, complete);
        // After the writes: a VIP is announced once the datapath serves it.
        self.publish_vips(changed_now);
        if failed > 0 {
            // The maps hold less than planned: the next run syncs again, even unchanged.
            self.dirty = true;
            anyhow::bail!("{failed} service map writes failed");
        }
        if complete {
            self.controller.stamp.finish_write(
                self.controller.last_writes > 0,
                listing.as_of_unix,
                &self.controller.metrics,
            );
        }
        Ok(Action::AwaitChange)
    }
}
