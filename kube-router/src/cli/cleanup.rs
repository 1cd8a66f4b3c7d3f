//! `cleanup` (and `--cleanup-config`): this agent's pinned objects, kernel routes and
//! graceful-restart marker; `cleanup --legacy`: upstream kube-router's and kube-proxy's
//! leftovers instead, reported per kind.
use std::{path::Path, time::Duration};

use anyhow::Result;

use crate::{bpf::datapath, k8s::watch::ApiOptions};

/// Uninstall: pinned programs, links and maps, our kernel routes and the graceful-restart marker.
pub fn ours(bpf_root: &Path, state_dir: &Path, route_protocol: u8) -> Result<()> {
    let removed = datapath::remove_all(bpf_root)?;
    println!("removed {removed} pinned objects from {}", bpf_root.display());
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let routes = runtime.block_on(async {
        let fib = crate::routing::fib::netlink::NetlinkRoutes::connect(route_protocol, 254)?;
        // Reconciling towards nothing deletes exactly our routes (default routes included).
        let ops = crate::routing::fib::reconcile(&fib.list().await?, &Default::default(), true).ops;
        for op in &ops {
            fib.apply(op).await.map_err(|e| anyhow::anyhow!("deleting {:?}: {}", op, e.describe()))?;
        }
        anyhow::Ok(ops.len())
    })?;
    println!("removed {routes} kernel routes with protocol {route_protocol}");
    let marker = state_dir.join("bgp-graceful-restart");
    if std::fs::remove_file(&marker).is_ok() {
        println!("removed {}", marker.display());
    }
    Ok(())
}

/// `cleanup --legacy`: the nodes' pod CIDRs are `node_pod_cidrs`, else every Node's from the
/// API server (`api`), else from the checkpoint in `state_dir`.
pub fn legacy(api: Option<ApiOptions>, state_dir: &Path, node_pod_cidrs: &[ipnet::IpNet], json: bool) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let report = runtime.block_on(async {
        let cidrs = if node_pod_cidrs.is_empty() {
            let (cidrs, from) =
                crate::legacy::exec::node_pod_cidrs(api.as_ref(), state_dir, Duration::from_secs(10)).await;
            tracing::info!(?cidrs, %from, "node pod CIDRs");
            cidrs
        } else {
            node_pod_cidrs.iter().map(|c| c.trunc()).collect()
        };
        crate::legacy::exec::cleanup(&cidrs).await
    })?;
    if json {
        println!("{}", report.to_json());
    } else {
        print!("{}", report.render_text());
    }
    if !report.failed.is_empty() {
        anyhow::bail!("{} removals failed", report.failed.len());
    }
    Ok(())
}
