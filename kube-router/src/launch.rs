//! The `run` command: from the checked flags to a running agent (`agent::run`). The stop
//! signals are caught before anything else, so that one arriving while the agent starts stops
//! it in order, with an exit status of 0 and nothing withdrawn ([`StopSignals`]).
use std::{
    net::{IpAddr, Ipv4Addr},
    path::Path,
    time::Duration,
};

use anyhow::Result;

use crate::{
    agent::{self, AgentConfig, DesiredSource, StopSignals},
    flags::{
        command_line::{invalid, CheckedFlags, RunArgs},
        routing::RouterContext,
    },
    node::netif,
    routing::bgp::peers::ExternalPeerFlag,
};

/// Runs the agent until SIGTERM or SIGINT. Flags the parser accepted but the node cannot
/// honour exit as a usage error (2), as clap's own.
pub fn run(bpf_root: &Path, args: &RunArgs) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let mut signals = {
        let _inside = runtime.enter();
        StopSignals::install()?
    };
    let CheckedFlags { external_peers, warnings } = args.check().unwrap_or_else(|message| invalid(message));
    warnings.iter().for_each(|w| tracing::warn!("{w}"));
    let config = agent_config(bpf_root, args, external_peers)?;
    raise_fd_limit();
    let cleanup_legacy = args.cleanup_legacy_on_start;
    runtime.block_on(async move {
        if cleanup_legacy {
            tokio::select! {
                biased;
                signal = signals.received() => {
                    tracing::info!(signal, "stopped during the legacy cleanup, before the agent started");
                    return Ok(());
                }
                () = cleanup_legacy_on_start(&config) => {}
            }
        }
        agent::run(config, signals).await
    })
}

/// The agent's configuration: each group of flags gives its subsystem's options; what depends
/// on the node (its addresses, its name) is read here.
fn agent_config(bpf_root: &Path, args: &RunArgs, external_peers: Vec<ExternalPeerFlag>) -> Result<AgentConfig> {
    let disabled_families =
        args.node.disabled_families(&netif::node_addresses()).unwrap_or_else(|message| invalid(message));
    let node_name = args.node.node_name(std::env::var("NODE_NAME").ok());
    let router = args.routing.router_options(
        &args.bfd,
        &args.overlay,
        RouterContext {
            node_name: node_name.clone(),
            state_dir: args.api.state_dir.clone(),
            bpf_root: bpf_root.to_path_buf(),
            external_peers,
        },
    );
    Ok(AgentConfig {
        pin_dir: bpf_root.to_path_buf(),
        state_dir: args.api.state_dir.clone(),
        node_name,
        source: (&args.api).into(),
        node: (&args.node).into(),
        datapath: (&args.datapath).try_into().map_err(anyhow::Error::msg)?,
        services: args.service_proxy.service_options(|| node_ips(args.node.node_ip), disabled_families),
        policy: (&args.policy).into(),
        router,
        listeners: (&args.metrics).into(),
    })
}

/// The node IP of each family: `--node-ip`, else the default route's source address (else the
/// first IPv4 address); the IPv6 default route's source.
fn node_ips(node_ip: Option<Ipv4Addr>) -> Vec<IpAddr> {
    let v4 = node_ip
        .or_else(netif::default_route_source)
        .or_else(|| netif::ipv4_addresses().first().copied())
        .map(IpAddr::V4);
    v4.into_iter().chain(netif::default_route_source_v6().map(Into::into)).collect()
}

/// `--cleanup-legacy-on-start`: never fatal (the agent is what repairs the node), each removal
/// and failure logged.
async fn cleanup_legacy_on_start(config: &AgentConfig) {
    let api = match &config.source.source {
        DesiredSource::Api(options) => Some(options),
        DesiredSource::File(_) => None,
    };
    let (cidrs, from) = crate::legacy::exec::node_pod_cidrs(api, &config.state_dir, Duration::from_secs(10)).await;
    tracing::info!(?cidrs, %from, "legacy cleanup: node pod CIDRs");
    match crate::legacy::exec::cleanup(&cidrs).await {
        Ok(report) => {
            for kind in crate::legacy::KINDS {
                let items = report.removed.get(kind).cloned().unwrap_or_default();
                tracing::info!(kind, count = items.len(), ?items, "legacy cleanup: removed");
            }
            for failure in &report.failed {
                tracing::warn!(%failure, "legacy cleanup: a removal failed");
            }
            for note in &report.notes {
                tracing::info!(%note, "legacy cleanup");
            }
        }
        Err(e) => tracing::warn!("legacy cleanup failed: {e:#}"),
    }
}

/// Raises the soft limit of open files to the hard limit, as the Go runtime does for every Go
/// program (kube-router upstream included): the soft default of 1,024 is used up by a few
/// hundred connections to the agent's servers plus its maps, links and sockets.
fn raise_fd_limit() {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit with a valid pointer to an rlimit we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(), "cannot read the open files limit");
        return;
    }
    if limit.rlim_cur >= limit.rlim_max {
        tracing::info!(soft = limit.rlim_cur, "open files limit already at its hard limit");
        return;
    }
    let before = limit.rlim_cur;
    limit.rlim_cur = limit.rlim_max;
    // SAFETY: as above.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } != 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(), soft = before, "cannot raise the open files limit");
        return;
    }
    tracing::info!(from = before, to = limit.rlim_cur, "raised the open files soft limit to the hard limit");
}
