//! The agent's main loop: program the datapath from the desired state and keep it there.
use std::{
    net::Ipv4Addr,
    path::{Path, PathBuf},
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context, Result};
use kube_router_common::{lb_stat, map_names};
use tokio::signal::unix::{signal, SignalKind};

use crate::{
    bpf::{
        datapath::Datapath,
        service_maps::{read_lb_stats, BpfServiceMaps, Conntrack},
    },
    metrics::{self, Metrics},
    netif,
    services::{
        compile::{assign_ids, plan, CompileWarning, Limits},
        model::NodeContext,
        source::load_file,
        sync::{ServiceMaps, ServiceSync},
    },
};

pub struct AgentConfig {
    pub pin_dir: PathBuf,
    pub service_file: Option<PathBuf>,
    pub interfaces: Option<Vec<String>>,
    pub node_name: String,
    pub nodeport_addresses: Option<Vec<Ipv4Addr>>,
    pub limits: Limits,
    pub metrics_port: u16,
    pub health_port: u16,
    pub conntrack_gc_interval: Duration,
}

struct ServiceController {
    maps: BpfServiceMaps,
    sync: ServiceSync,
    metrics: Metrics,
    file: PathBuf,
    file_stamp: Option<SystemTime>,
    limits: Limits,
    node_name: String,
    nodeport_addresses: Option<Vec<Ipv4Addr>>,
}

impl ServiceController {
    fn node_context(&self) -> NodeContext {
        NodeContext {
            name: self.node_name.clone(),
            node_port_addrs: self.nodeport_addresses.clone().unwrap_or_else(netif::ipv4_addresses),
        }
    }

    /// Re-reads the desired state if the file changed, and writes only the differences.
    fn poll(&mut self, force: bool) {
        let stamp = std::fs::metadata(&self.file).and_then(|m| m.modified()).ok();
        if !force && stamp == self.file_stamp {
            return;
        }
        let started = Instant::now();
        let builder = match load_file(&self.file) {
            Ok(builder) => builder,
            Err(e) => {
                // An unreadable desired state is not an empty one: keep everything programmed.
                tracing::error!(error = format!("{e:#}"), "cannot read desired state; maps left as they are");
                self.metrics.with(|m| *m.rejected_objects.entry("file").or_default() += 1);
                return;
            }
        };
        self.file_stamp = stamp;
        for problem in &builder.problems {
            let kind: &'static str = if problem.kind == "Service" { "Service" } else { "EndpointSlice" };
            self.metrics.with(|m| *m.rejected_objects.entry(kind).or_default() += 1);
        }
        let lb_plan = plan(&builder.state, &self.node_context(), self.limits);
        for warning in &lb_plan.warnings {
            match warning {
                CompileWarning::FrontendConflict { .. } => tracing::error!(?warning, "frontend claimed twice"),
                CompileWarning::EndpointsTruncated { .. } => tracing::warn!(?warning, "too many endpoints"),
            }
        }
        let desired = assign_ids(&lb_plan, self.sync.programmed());
        let report = self.sync.sync(&mut self.maps, &desired, true);
        let total = report.total();
        let programmed = self.sync.programmed();
        tracing::info!(
            inserts = total.inserts,
            updates = total.updates,
            deletes = total.deletes,
            errors = total.errors,
            services = programmed.services.len(),
            backends = programmed.backends.len(),
            "service sync complete"
        );
        self.metrics.record_sync(&report, started.elapsed());
        self.metrics.with(|m| {
            m.dropped_endpoints = lb_plan.dropped_endpoints;
            m.map_entries.insert(map_names::SERVICES, programmed.services.len() as u64);
            m.map_entries.insert(map_names::BACKEND_SLOTS, programmed.slots.len() as u64);
            m.map_entries.insert(map_names::BACKENDS, programmed.backends.len() as u64);
        });
        self.metrics.heartbeat("services");
    }
}

fn attach_all(datapath: &mut Datapath, wanted: &Option<Vec<String>>, attached: &mut Vec<String>) {
    let interfaces = wanted.clone().unwrap_or_else(netif::interfaces);
    for interface in interfaces {
        if attached.contains(&interface) {
            continue;
        }
        match datapath.attach(&interface) {
            Ok([ingress, egress]) => {
                tracing::info!(interface, ?ingress, ?egress, "load balancer attached at TC ingress and egress");
                attached.push(interface);
            }
            Err(e) => tracing::error!(interface, error = format!("{e:#}"), "cannot attach"),
        }
    }
}

fn refresh_datapath_metrics(pin_dir: &Path, metrics: &Metrics, conntrack: &mut Conntrack, gc: bool) {
    if let Ok(stats) = read_lb_stats(pin_dir) {
        metrics.with(|m| m.datapath_packets = lb_stat::NAMES.iter().copied().zip(stats).collect());
    }
    if gc {
        match conntrack.collect_garbage() {
            Ok((left, removed)) => metrics.with(|m| {
                m.conntrack_entries = left as u64;
                m.conntrack_gc_removed += removed as u64;
            }),
            Err(e) => tracing::warn!(error = %e, "conntrack GC failed"),
        }
        metrics.heartbeat("conntrack-gc");
    }
}

pub async fn run(config: AgentConfig) -> Result<()> {
    let metrics = Metrics::default();
    let mut ports = vec![config.health_port, config.metrics_port];
    ports.retain(|p| *p != 0);
    ports.dedup();
    for port in ports {
        let metrics = metrics.clone();
        tokio::spawn(async move {
            if let Err(e) = metrics::serve(metrics, port).await {
                tracing::error!(port, error = %e, "metrics/health server failed");
            }
        });
    }

    let mut datapath = Datapath::load(&config.pin_dir)?;
    let mut attached = Vec::new();
    attach_all(&mut datapath, &config.interfaces, &mut attached);

    let maps = BpfServiceMaps::open_pinned(&config.pin_dir)?;
    let sync = ServiceSync::adopt(&maps).context("reading the programmed service maps")?;
    tracing::info!(
        services = sync.programmed().services.len(),
        backends = sync.programmed().backends.len(),
        "adopted programmed state"
    );
    let mut controller = config.service_file.clone().map(|file| ServiceController {
        maps,
        sync,
        metrics: metrics.clone(),
        file,
        file_stamp: None,
        limits: config.limits,
        node_name: config.node_name.clone(),
        nodeport_addresses: config.nodeport_addresses.clone(),
    });
    if let Some(c) = controller.as_mut() {
        c.poll(true);
    }
    let mut conntrack = Conntrack::open_pinned(&config.pin_dir)?;

    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut last_gc = Instant::now();
    let mut last_rescan = Instant::now();
    tracing::info!("agent running");
    loop {
        tokio::select! {
            _ = terminate.recv() => break,
            _ = interrupt.recv() => break,
            _ = tick.tick() => {
                if let Some(c) = controller.as_mut() {
                    c.poll(false);
                }
                if config.interfaces.is_none() && last_rescan.elapsed() >= Duration::from_secs(5) {
                    attach_all(&mut datapath, &config.interfaces, &mut attached);
                    last_rescan = Instant::now();
                }
                let gc = last_gc.elapsed() >= config.conntrack_gc_interval;
                if gc {
                    last_gc = Instant::now();
                }
                refresh_datapath_metrics(&config.pin_dir, &metrics, &mut conntrack, gc);
                metrics.heartbeat("agent");
            }
        }
    }
    // Leave programs, links and maps exactly as they are: traffic keeps flowing without us.
    tracing::info!("stopping; datapath left in place");
    Ok(())
}

/// Used by tests and tooling: what `ServiceMaps::read_all` sees now.
pub fn read_programmed(pin_dir: &Path) -> Result<crate::services::compile::MapContents> {
    Ok(BpfServiceMaps::open_pinned(pin_dir)?.read_all()?)
}
