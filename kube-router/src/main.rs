//! kube-router: service proxy, network policy and BGP routing for Kubernetes, on eBPF.
//!
//! The dispatcher: the command line is `flags::command_line`, the agent's start `launch`, the
//! other commands `cli`.
use std::process::ExitCode;

use kube_router::{
    cli,
    flags::command_line::{self, invalid, Command},
    launch,
};

/// See `kube_router::allocator`. The `system-alloc` feature leaves glibc's malloc in place, so
/// heap profilers that hook malloc (heaptrack, valgrind) see every allocation (DEVELOPERS.md).
#[cfg(not(feature = "system-alloc"))]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    #[cfg(not(feature = "system-alloc"))]
    kube_router::allocator::configure();
    let cli = command_line::parse_from(std::env::args_os()).unwrap_or_else(|e| e.exit());
    // RUST_LOG wins; upstream's -v only picks the default.
    let default_filter = cli.run.v.map_or("info", kube_router::flags::log_filter_for_verbosity);
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| default_filter.into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let (bpf_root, run) = (&cli.bpf_root, &cli.run);
    let state_dir = &run.api.state_dir;
    let result = match cli.command.as_ref().unwrap_or(&Command::Run) {
        Command::Run if run.cleanup_config => cli::cleanup::ours(bpf_root, state_dir, run.routing.route_protocol),
        Command::Run => launch::run(bpf_root, run),
        Command::InstallCni { cni_bin_dir, plugin_source } => {
            cli::install_cni::run(&kube_router::node::cni_install::InstallOptions {
                plugin_source: plugin_source.clone(),
                bin_dir: cni_bin_dir.clone(),
                conf_file: run.node.cni_conf_file.clone(),
            })
        }
        Command::CheckFlags => {
            let checked = run.check().unwrap_or_else(|message| invalid(message));
            checked.warnings.iter().for_each(|w| println!("warning: {w}"));
            println!("flags accepted ({} external peers)", checked.external_peers.len());
            Ok(())
        }
        Command::FlagsMarkdown => {
            print!("{}", kube_router::flags::markdown(&command_line::command().0));
            Ok(())
        }
        Command::Services { output } => {
            cli::services::collect(bpf_root, state_dir).and_then(|r| cli::print(&r, *output))
        }
        Command::Conntrack { output } => cli::conntrack::collect(bpf_root).and_then(|r| cli::print(&r, *output)),
        Command::Bgp { output } => {
            cli::bgp::show(state_dir, run.metrics.metrics_addr, run.metrics.metrics_port, *output)
                .map(|page| print!("{page}"))
        }
        Command::Policy { output } => cli::policy::collect(bpf_root).and_then(|r| cli::print(&r, *output)),
        Command::Interfaces { output } => cli::interfaces::collect(bpf_root).and_then(|r| cli::print(&r, *output)),
        Command::Checkpoint { output } => cli::checkpoint::collect(state_dir).and_then(|r| cli::print(&r, *output)),
        Command::Monitor { json, filter, rate } => kube_router::monitor::run(&kube_router::monitor::Options {
            pin_dir: bpf_root.clone(),
            state_dir: state_dir.clone(),
            json: *json,
            filter: *filter,
            rate_per_cpu: *rate,
        }),
        Command::Stats { output } => cli::stats::collect(bpf_root).and_then(|r| cli::print(&r, *output)),
        Command::Cleanup { legacy: false, .. } => cli::cleanup::ours(bpf_root, state_dir, run.routing.route_protocol),
        Command::Cleanup { legacy: true, node_pod_cidrs, output } => {
            cli::cleanup::legacy(run.api.api_options(), state_dir, node_pod_cidrs, output == "json")
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            ExitCode::FAILURE
        }
    }
}
