//! `kube-router policy`: NetworkPolicy verdict counters and what the policy maps hold.
use std::{collections::BTreeMap, net::IpAddr, path::Path};

use anyhow::Result;
use kube_router_common::{map_names, pol_guard_stat, pol_stat};
use serde::Serialize;

use crate::pinned::counters::read_pinned_if_exists;
use crate::policy::maps::{decode, read_policy_stats, BpfPolicyMaps, PolicyMaps};

#[derive(Serialize, Debug, Default)]
pub struct PolicyReport {
    /// Verdict and guard counters by name, summed over CPUs.
    pub counters: BTreeMap<String, u64>,
    /// Every isolated pod direction.
    pub pods: Vec<IsolatedPod>,
    pub port_entries: usize,
    pub peer_prefixes: usize,
}

#[derive(Serialize, Debug)]
pub struct IsolatedPod {
    pub pod_ip: IpAddr,
    /// `ingress` or `egress`.
    pub direction: String,
    /// 0: everything denied (isolated by a policy without rules for this direction).
    pub rules: u32,
    pub slot: u32,
}

pub fn collect(pin_dir: &Path) -> Result<PolicyReport> {
    let mut report = PolicyReport::default();
    for (name, n) in pol_stat::NAMES.iter().zip(read_policy_stats(pin_dir)?) {
        report.counters.insert(name.to_string(), n);
    }
    let guard =
        read_pinned_if_exists(pin_dir, map_names::POLICY_GUARD_STATS, pol_guard_stat::COUNT)?.unwrap_or_default();
    for (name, n) in pol_guard_stat::NAMES.iter().zip(guard) {
        report.counters.insert(name.to_string(), n);
    }
    let maps = BpfPolicyMaps::open_pinned(pin_dir)?;
    let contents = maps.read_all().map_err(|e| anyhow::anyhow!("{}: {}", e.map, e.message))?;
    let entries = decode(&contents)?;
    report.pods = entries
        .pod_slots
        .iter()
        .map(|(key, value)| IsolatedPod {
            pod_ip: key.pod_ip,
            direction: format!("{:?}", key.direction).to_lowercase(),
            rules: value.rule_count,
            slot: value.slot.0,
        })
        .collect();
    report.port_entries = entries.slot_ports.len();
    report.peer_prefixes = entries.peer_prefixes.len();
    Ok(report)
}

impl super::Report for PolicyReport {
    fn render_text(&self) -> String {
        let mut out: String = self.counters.iter().map(|(name, n)| format!("{name} {n}\n")).collect();
        for p in &self.pods {
            out.push_str(&format!(
                "pod {} {}: {} rule(s) in slot {}{}\n",
                p.pod_ip,
                p.direction,
                p.rules,
                p.slot,
                if p.rules == 0 { " (default deny)" } else { "" }
            ));
        }
        out.push_str(&format!(
            "{} isolated pod directions, {} port entries, {} peer prefixes\n",
            self.pods.len(),
            self.port_entries,
            self.peer_prefixes
        ));
        out
    }
}
