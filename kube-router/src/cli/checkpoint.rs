//! `kube-router checkpoint`: the age and contents of the checkpoint in --state-dir.
use std::{collections::BTreeMap, path::Path};

use anyhow::Result;
use serde::Serialize;

use crate::k8s::watch::Kind;

#[derive(Serialize, Debug)]
pub struct CheckpointReport {
    pub state_dir: String,
    pub age_seconds: f64,
    /// Objects of each watched kind, by its checkpoint field (`services`, `endpoint_slices`, …).
    #[serde(flatten)]
    pub objects: BTreeMap<&'static str, usize>,
}

pub fn collect(state_dir: &Path) -> Result<CheckpointReport> {
    let saved = crate::k8s::checkpoint::read(state_dir)?;
    Ok(CheckpointReport {
        state_dir: state_dir.display().to_string(),
        age_seconds: (crate::metrics::unix_now() - saved.written_unix).round(),
        objects: Kind::ALL.iter().map(|kind| (kind.field(), saved.count(*kind))).collect(),
    })
}

impl super::Report for CheckpointReport {
    fn render_text(&self) -> String {
        let counts: Vec<String> = Kind::ALL
            .iter()
            .map(|kind| format!("{} {}", kind.resource(), self.objects.get(kind.field()).unwrap_or(&0)))
            .collect();
        format!("checkpoint in {}: written {:.0} s ago\n{}\n", self.state_dir, self.age_seconds, counts.join("  "))
    }
}
