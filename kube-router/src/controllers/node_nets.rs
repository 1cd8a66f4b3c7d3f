//! This node's networks from the Node objects: the cluster prefixes pod egress masquerade
//! treats as inside, and the CNI configuration with the pod bridge.
use std::{net::Ipv4Addr, path::PathBuf, sync::Arc};

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::Node;

use crate::{
    bpf::service_maps::{sync_cluster_nets, sync_cluster_nets_of},
    config::CniOptions,
    exposition::{register, Counter},
    k8s::{cache::Cache, watch::Kind},
    metrics::{Metrics, Subsystem},
    netif,
    runtime::{Action, Controller},
    services::family::V6,
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
    egress: Option<EgressNets>,
    cni: Option<CniWriter>,
    metrics: Metrics,
}

impl NodeNetsController {
    pub fn new(cache: Arc<Cache>, egress: Option<EgressNets>, cni: Option<CniWriter>, metrics: Metrics) -> Self {
        Self { cache, egress, cni, metrics }
    }
}

impl Controller for NodeNetsController {
    fn name(&self) -> &'static str {
        "node-nets"
    }

    async fn reconcile(&mut self) -> Result<Action> {
        // Like the routes: only a complete listing of Nodes (or its checkpoint) counts.
        let Some(listing) = self.cache.read(NODE_KINDS, |o| o.nodes.snapshot()) else {
            return Ok(Action::AwaitChange);
        };
        let nodes = listing.objects;
        if let Some(egress) = &self.egress {
            sync_egress_nets(egress, nodes.iter().map(|n| &**n));
        }
        if let Some(cni) = self.cni.as_mut() {
            // Logged once per reason; retried with backoff (the bridge may need a moment).
            cni.sync(nodes.iter().map(|n| &**n), &self.metrics).await?;
        }
        Ok(Action::AwaitChange)
    }
}

/// The CNI role: this node's configuration and pod bridge, from its Node object. A failure is
/// logged when it first happens (or changes) and counted; nothing else is touched.
pub struct CniWriter {
    options: CniOptions,
    node_name: String,
    snat_addr: Option<Ipv4Addr>,
    last_error: Option<String>,
}

impl CniWriter {
    pub fn new(options: CniOptions, node_name: String, snat_addr: Option<Ipv4Addr>) -> Self {
        Self { options, node_name, snat_addr, last_error: None }
    }
}

impl CniWriter {
    async fn sync<'a>(&mut self, nodes: impl Iterator<Item = &'a Node>, metrics: &Metrics) -> Result<()> {
        let result = self.try_sync(nodes).await;
        match result {
            Ok(written) => {
                if written {
                    tracing::info!(path = %self.options.conf_file.display(), "CNI configuration written");
                }
                self.last_error = None;
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

    async fn try_sync<'a>(&self, mut nodes: impl Iterator<Item = &'a Node>) -> Result<bool> {
        let node = nodes
            .find(|n| n.metadata.name.as_deref() == Some(self.node_name.as_str()))
            .with_context(|| format!("no Node object named {:?}", self.node_name))?;
        // A malformed kube-router.io/pod-cidr(s) annotation leaves the file as it was.
        let pod_cidrs = crate::pod_cidrs::node_pod_cidrs(node)?;
        let mtu = if self.options.auto_mtu { self.snat_addr.and_then(netif::mtu_of_address) } else { None };
        let template = crate::cni::template_at(&self.options.conf_file);
        let conflist = crate::cni::conflist(&template, &pod_cidrs, mtu)?;
        let written = crate::cni::write_if_changed(&self.options.conf_file, &conflist)?;
        netif::ensure_bridge(crate::cni::BRIDGE, &crate::cni::gateways(&pod_cidrs)).await?;
        Ok(written)
    }
}

/// Brings `cluster_nets_v4` and `cluster_nets_v6` (what pod egress masquerade treats as inside) up to date.
pub fn sync_egress_nets<'a>(config: &EgressNets, nodes: impl IntoIterator<Item = &'a Node>) {
    let nodes: Vec<&Node> = nodes.into_iter().collect();
    let nets = crate::egress::cluster_nets(nodes.iter().copied(), &config.cluster_cidrs, &config.service_ranges);
    match sync_cluster_nets(&config.pin_dir, &nets) {
        Ok(0) => {}
        Ok(writes) => tracing::info!(prefixes = nets.len(), writes, "cluster prefixes for pod egress updated"),
        Err(e) => tracing::error!(
            error = format!("{e:#}"),
            "cannot write cluster_nets_v4; pod egress masquerade may be wrong"
        ),
    }
    let nets = crate::egress::cluster_nets_of::<V6>(nodes, &config.cluster_cidrs, &config.service_ranges);
    match sync_cluster_nets_of::<V6>(&config.pin_dir, &nets) {
        Ok(0) => {}
        Ok(writes) => tracing::info!(prefixes = nets.len(), writes, "IPv6 cluster prefixes for pod egress updated"),
        Err(e) => tracing::error!(
            error = format!("{e:#}"),
            "cannot write cluster_nets_v6; pod egress masquerade may be wrong"
        ),
    }
}
