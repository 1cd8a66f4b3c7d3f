//! This node's networks from the Node objects: the cluster prefixes pod egress masquerade
//! treats as inside, and the CNI configuration with the pod bridge. Each pass reads only the
//! Nodes changed since the last one (the store's journal): a Node's change writes its own
//! prefixes, and the CNI configuration is written again only when this node's Node changed.
use std::{collections::BTreeMap, net::Ipv4Addr, path::PathBuf, sync::Arc};

use anyhow::{Context, Result};
use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node;

use crate::{
    config::CniOptions,
    exposition::{register, Counter},
    k8s::{
        cache::Cache,
        store::{Cursor, Followed, ObjectKey},
        watch::Kind,
    },
    metrics::{Metrics, Subsystem},
    node::cluster_nets::{sync_cluster_nets, sync_cluster_nets_of, write_cluster_nets_of},
    node::egress::ClusterNets,
    node::netif,
    runtime::{Action, Controller},
    services::family::{AddressFamily, V4, V6},
};

pub const NODE_KINDS: &[Kind] = &[Kind::Nodes];

/// The cluster's prefixes, for pod egress: what is inside.
#[derive(Clone)]
pub struct EgressNets {
    pub pin_dir: PathBuf,
    pub cluster_cidrs: Vec<ipnet::IpNet>,
    pub service_ranges: Vec<ipnet::IpNet>,
}

/// CNI configurations that could not be derived or written (`--enable-cni`).
#[derive(Debug, Default)]
pub struct CniMetrics {
    pub errors: Counter,
}

impl Subsystem for CniMetrics {
    fn register(this: &Arc<Self>, registry: &mut prometheus_client::registry::Registry) {
        register(
            registry,
            "kube_router_cni_config_errors_total",
            "CNI configurations that could not be derived from the Node or written (the datapath is unaffected).",
            this.errors.clone(),
        );
    }
}

pub struct NodeNetsController {
    cache: Arc<Cache>,
    /// With the service proxy.
    egress: Option<EgressState>,
    cni: Option<CniWriter>,
    metrics: Metrics,
    /// The Node changes read so far.
    cursor: Option<Cursor>,
}

impl NodeNetsController {
    pub fn new(cache: Arc<Cache>, egress: Option<EgressNets>, cni: Option<CniWriter>, metrics: Metrics) -> Self {
        let egress = egress.map(|config| EgressState {
            nets: ClusterNets::new(&config.cluster_cidrs, &config.service_ranges),
            config,
            in_maps: false,
        });
        Self { cache, egress, cni, metrics, cursor: None }
    }
}

impl Controller for NodeNetsController {
    fn name(&self) -> &'static str {
        "node-nets"
    }

    async fn reconcile(&mut self) -> Result<Action> {
        let cursor = self.cursor;
        let own_key = self.cni.as_ref().map(|cni| ObjectKey::new("", &cni.node_name));
        // Like the routes: only a complete listing of Nodes (or its checkpoint) counts.
        let Some(listing) = self.cache.read(NODE_KINDS, |o| {
            let (nodes, cursor) = o.nodes.follow(cursor);
            (nodes, cursor, own_key.and_then(|key| o.nodes.shared(&key)))
        }) else {
            return Ok(Action::AwaitChange);
        };
        let (nodes, cursor, own) = listing.objects;
        self.cursor = Some(cursor);
        let egress = self.egress.as_mut().map(|egress| egress.follow(&nodes)).unwrap_or(Ok(()));
        if let Some(cni) = self.cni.as_mut() {
            // Logged once per reason; retried with backoff (the bridge may need a moment).
            cni.sync(own, &self.metrics).await?;
        }
        // Retried with backoff: the next pass writes the maps whole.
        egress.map(|()| Action::AwaitChange)
    }
}

/// The cluster's prefixes for pod egress, followed Node by Node.
struct EgressState {
    config: EgressNets,
    nets: ClusterNets,
    /// The maps hold `nets`: what changes is written as it comes, without reading them back.
    in_maps: bool,
}

impl EgressState {
    fn follow(&mut self, nodes: &Followed<Node>) -> Result<()> {
        let mut changes = BTreeMap::new();
        match nodes {
            Followed::All(nodes) => {
                self.nets = ClusterNets::new(&self.config.cluster_cidrs, &self.config.service_ranges);
                for node in nodes {
                    self.nets.set_node(node.metadata.name.as_deref().unwrap_or_default(), Some(node));
                }
                self.in_maps = false;
            }
            Followed::Changed(nodes) => {
                for (ObjectKey { name, .. }, node) in nodes {
                    changes.extend(self.nets.set_node(name, node.as_deref()));
                }
            }
        }
        let pin_dir = &self.config.pin_dir;
        let written = if self.in_maps {
            let of_family = |v6: bool| changes.iter().filter(move |(net, _)| matches!(net, IpNet::V6(_)) == v6);
            let v4 = of_family(false).filter_map(|(net, flags)| V4::net_of(*net).map(|net| (net, *flags))).collect();
            let v6 = of_family(true).filter_map(|(net, flags)| V6::net_of(*net).map(|net| (net, *flags))).collect();
            write_cluster_nets_of::<V4>(pin_dir, &v4)
                .and_then(|v4| Ok(v4 + write_cluster_nets_of::<V6>(pin_dir, &v6)?))
                .context("cannot write cluster_nets_v4/v6")
        } else {
            sync_cluster_nets_of::<V4>(pin_dir, &self.nets.of_family::<V4>())
                .context("cannot write cluster_nets_v4")
                .and_then(|v4| {
                    Ok(v4
                        + sync_cluster_nets_of::<V6>(pin_dir, &self.nets.of_family::<V6>())
                            .context("cannot write cluster_nets_v6")?)
                })
        };
        match written {
            Ok(writes) => {
                if writes > 0 {
                    tracing::info!(writes, "cluster prefixes for pod egress updated");
                }
                self.in_maps = true;
                Ok(())
            }
            Err(e) => {
                tracing::error!(
                    error = format!("{e:#}"),
                    "pod egress masquerade may be wrong; will write the maps whole"
                );
                self.in_maps = false;
                Err(e)
            }
        }
    }
}

/// The CNI role: this node's configuration and pod bridge, from its Node object. A failure is
/// logged when it first happens (or changes) and counted; nothing else is touched.
pub struct CniWriter {
    options: CniOptions,
    node_name: String,
    snat_addr: Option<Ipv4Addr>,
    last_error: Option<String>,
    /// This node's Node as the configuration was last written from: another Node's change
    /// rewrites nothing.
    written_from: Option<Arc<Node>>,
}

impl CniWriter {
    pub fn new(options: CniOptions, node_name: String, snat_addr: Option<Ipv4Addr>) -> Self {
        Self { options, node_name, snat_addr, last_error: None, written_from: None }
    }
}

impl CniWriter {
    async fn sync(&mut self, node: Option<Arc<Node>>, metrics: &Metrics) -> Result<()> {
        if node.is_some() && self.written_from == node {
            return Ok(());
        }
        let result = self.try_sync(node.as_deref()).await;
        match result {
            Ok(written) => {
                if written {
                    tracing::info!(path = %self.options.conf_file.display(), "CNI configuration written");
                }
                self.last_error = None;
                self.written_from = node;
                Ok(())
            }
            Err(e) => {
                let error = format!("{e:#}");
                if self.last_error.as_ref() != Some(&error) {
                    tracing::error!(
                        node = self.node_name,
                        error,
                        "cannot configure the pod network (CNI); datapath unaffected"
                    );
                    metrics.of::<CniMetrics>().errors.inc();
                    self.last_error = Some(error.clone());
                }
                Err(anyhow::anyhow!(error))
            }
        }
    }

    async fn try_sync(&self, node: Option<&Node>) -> Result<bool> {
        let node = node.with_context(|| format!("no Node object named {:?}", self.node_name))?;
        // A malformed kube-router.io/pod-cidr(s) annotation leaves the file as it was.
        let pod_cidrs = crate::node::pod_cidrs::node_pod_cidrs(node)?;
        let mtu = if self.options.auto_mtu { self.snat_addr.and_then(netif::mtu_of_address) } else { None };
        let template = crate::node::cni::template_at(&self.options.conf_file);
        let conflist = crate::node::cni::conflist(&template, &pod_cidrs, mtu)?;
        let written = crate::node::cni::write_if_changed(&self.options.conf_file, &conflist)?;
        netif::ensure_bridge(crate::node::cni::BRIDGE, &crate::node::cni::gateways(&pod_cidrs)).await?;
        Ok(written)
    }
}

/// Brings `cluster_nets_v4` and `cluster_nets_v6` (what pod egress masquerade treats as inside) up to date.
pub fn sync_egress_nets<'a>(config: &EgressNets, nodes: impl IntoIterator<Item = &'a Node>) {
    let nodes: Vec<&Node> = nodes.into_iter().collect();
    let nets = crate::node::egress::cluster_nets(nodes.iter().copied(), &config.cluster_cidrs, &config.service_ranges);
    match sync_cluster_nets(&config.pin_dir, &nets) {
        Ok(0) => {}
        Ok(writes) => tracing::info!(prefixes = nets.len(), writes, "cluster prefixes for pod egress updated"),
        Err(e) => tracing::error!(
            error = format!("{e:#}"),
            "cannot write cluster_nets_v4; pod egress masquerade may be wrong"
        ),
    }
    let nets = crate::node::egress::cluster_nets_of::<V6>(nodes, &config.cluster_cidrs, &config.service_ranges);
    match sync_cluster_nets_of::<V6>(&config.pin_dir, &nets) {
        Ok(0) => {}
        Ok(writes) => tracing::info!(prefixes = nets.len(), writes, "IPv6 cluster prefixes for pod egress updated"),
        Err(e) => tracing::error!(
            error = format!("{e:#}"),
            "cannot write cluster_nets_v6; pod egress masquerade may be wrong"
        ),
    }
}
