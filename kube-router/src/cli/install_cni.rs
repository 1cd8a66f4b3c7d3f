//! `install-cni`: the DaemonSets' init container (`cni_install`), its report as JSON.
use anyhow::Result;

use crate::node::cni_install::{install, InstallOptions};

pub fn run(options: &InstallOptions) -> Result<()> {
    let report = install(options)?;
    if !report.shadowing_configs.is_empty() {
        tracing::warn!(
            configs = ?report.shadowing_configs,
            "another CNI configuration sorts before {}: the container runtime uses that one (left as it is)",
            options.conf_file.display()
        );
    }
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}
