//! `kube-router checkpoint`: the age and contents of the checkpoint in --state-dir.
use std::path::Path;

use anyhow::Result;
use serde::Serialize;

#[derive(Serialize, Debug)]
pub struct CheckpointReport {
    pub state_dir: String,
    pub age_seconds: f64,
    pub services: usize,
    pub endpoint_slices: usize,
    pub pods: usize,
    pub namespaces: usize,
    pub nodes: usize,
    pub network_policies: usize,
}

pub fn collect(state_dir: &Path) -> Result<CheckpointReport> {
    let saved = crate::k8s::checkpoint::read(state_dir)?;
    Ok(CheckpointReport {
        state_dir: state_dir.display().to_string(),
        age_seconds: (crate::metrics::unix_now() - saved.written_unix).round(),
        services: saved.services.len(),
        endpoint_slices: saved.endpoint_slices.len(),
        pods: saved.pods.len(),
        namespaces: saved.namespaces.len(),
        nodes: saved.nodes.len(),
        network_policies: saved.network_policies.len(),
    })
}

impl super::Report for CheckpointReport {
    fn render_text(&self) -> String {
        format!(
            "checkpoint in {}: written {:.0} s ago\nservices {}  endpointslices {}  pods {}  namespaces {}  nodes {}  networkpolicies {}\n",
            self.state_dir,
            self.age_seconds,
            self.services,
            self.endpoint_slices,
            self.pods,
            self.namespaces,
            self.nodes,
            self.network_policies
        )
    }
}
