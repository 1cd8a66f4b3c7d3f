//! `kube-router stats`: the datapath's packet counters, by name.
use std::{collections::BTreeMap, path::Path};

use anyhow::Result;
use kube_router_common::{
    dsr_stat, event_stat, lb_stat, map_names, plain_map_names, plain_stat, source_check_map_names, src_stat, xdp_stat,
};
use serde::Serialize;

use crate::bpf::{socket_lb::sock_events, xdp};
use crate::pinned::counters::read_pinned_if_exists;
use crate::services::maps::read_lb_stats;

/// Counter name (prefixed by its group: `xdp_`, `dsr_`, `src_check_`, `plain_cache_`, `sock_`, `monitor_`; the
/// load balancer's have no prefix) to its value summed over CPUs.
#[derive(Serialize, Debug, Default)]
#[serde(transparent)]
pub struct StatsReport {
    pub counters: BTreeMap<String, u64>,
}

pub fn collect(pin_dir: &Path) -> Result<StatsReport> {
    let mut counters = Vec::new();
    let mut add = |prefix: &str, names: &[&str], values: Vec<u64>| {
        for (name, n) in names.iter().zip(values) {
            counters.push((format!("{prefix}{name}"), n));
        }
    };
    add("", &lb_stat::NAMES, read_lb_stats(pin_dir)?);
    // Groups whose programs may never have run on this node read as zero.
    add("xdp_", &xdp_stat::NAMES, xdp::read_stats(pin_dir).ok().flatten().unwrap_or_default());
    add(
        "dsr_",
        &dsr_stat::NAMES,
        read_pinned_if_exists(pin_dir, map_names::DSR_STATS, dsr_stat::COUNT).ok().flatten().unwrap_or_default(),
    );
    add(
        "src_check_",
        &src_stat::NAMES,
        read_pinned_if_exists(pin_dir, source_check_map_names::SOURCE_CHECK_STATS, src_stat::COUNT)
            .ok()
            .flatten()
            .unwrap_or_default(),
    );
    add(
        "plain_cache_",
        &plain_stat::NAMES,
        read_pinned_if_exists(pin_dir, plain_map_names::PLAIN_STATS, plain_stat::COUNT)
            .ok()
            .flatten()
            .unwrap_or_default(),
    );
    add("monitor_", &event_stat::NAMES, crate::monitor::read_stats(pin_dir).unwrap_or_default());
    for (name, n) in sock_events(pin_dir) {
        counters.push((format!("sock_{name}"), n));
    }
    Ok(StatsReport { counters: counters.into_iter().collect() })
}

impl super::Report for StatsReport {
    fn render_text(&self) -> String {
        self.counters.iter().map(|(name, n)| format!("{name} {n}\n")).collect()
    }
}
