//! The agent's command line: the run flags, one group per subsystem (each flag's name,
//! environment variable, default and help written once, in its group), and the subcommands.
//! Upstream kube-router's syntax is kept (`super::go_bool_flags`, `super::join_bool_values`).
use std::path::PathBuf;

use clap::{CommandFactory, FromArgMatches, Parser};
use kube_router_common::DEFAULT_PIN_DIR;

use super::{
    api::ApiFlags,
    datapath::DatapathFlags,
    metrics::MetricsFlags,
    node::NodeFlags,
    policy::PolicyFlags,
    routing::{BfdFlags, OverlayFlags, RoutingFlags},
    service_proxy::ServiceProxyFlags,
    upstream_only::UpstreamOnlyFlags,
};
use crate::routing::bgp::peers::ExternalPeerFlag;

#[derive(Parser)]
#[command(
    name = "kube-router",
    version,
    about = "Kubernetes service proxy, network policy and BGP routing on an eBPF datapath",
    // As Go's flag package: a repeated flag's last value wins (lists append).
    args_override_self = true
)]
pub struct Cli {
    /// bpffs directory holding the pinned maps and links.
    #[arg(long, env = "KUBE_ROUTER_BPF_ROOT", default_value = DEFAULT_PIN_DIR, global = true)]
    pub bpf_root: PathBuf,
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub run: RunArgs,
}

/// The agent's flags: what `run` (the default command) takes; the inspection commands read
/// `--state-dir` and the listener flags among them.
#[derive(clap::Args)]
pub struct RunArgs {
    /// Log verbosity as upstream's klog `-v` (used only when RUST_LOG is unset): 0-1 info for
    /// the agent and warn for its libraries, 2-3 info, 4-5 debug for the agent, 6+ debug.
    #[arg(short = 'v', long = "v", value_name = "N")]
    pub v: Option<u32>,
    /// Remove this agent's pinned maps and links, its kernel routes and the graceful-restart
    /// marker, then exit (as `kube-router cleanup`; upstream removes its iptables, IPVS and ipset
    /// rules).
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    pub cleanup_config: bool,
    /// At start, before anything is attached, remove what upstream kube-router and kube-proxy
    /// left on the node (as `kube-router cleanup --legacy`; docs/migrating.md).
    #[arg(long, env = "KUBE_ROUTER_CLEANUP_LEGACY_ON_START", default_value_t = false, action = clap::ArgAction::Set)]
    pub cleanup_legacy_on_start: bool,
    #[command(flatten)]
    pub api: ApiFlags,
    #[command(flatten)]
    pub node: NodeFlags,
    #[command(flatten)]
    pub service_proxy: ServiceProxyFlags,
    #[command(flatten)]
    pub policy: PolicyFlags,
    #[command(flatten)]
    pub routing: RoutingFlags,
    #[command(flatten)]
    pub bfd: BfdFlags,
    #[command(flatten)]
    pub overlay: OverlayFlags,
    #[command(flatten)]
    pub datapath: DatapathFlags,
    #[command(flatten)]
    pub metrics: MetricsFlags,
    #[command(flatten)]
    pub upstream: UpstreamOnlyFlags,
}

#[derive(clap::Subcommand)]
pub enum Command {
    /// Run the agent (the default).
    Run,
    /// Show service frontends and their backends, read from the pinned maps.
    Services {
        /// Report format: table (text) or json (docs/usage.md).
        #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
        output: crate::cli::Output,
    },
    /// Show conntrack entries.
    Conntrack {
        /// Report format: table (text) or json (docs/usage.md).
        #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
        output: crate::cli::Output,
    },
    /// Show the datapath packet counters.
    Stats {
        /// Report format: table (text) or json (docs/usage.md).
        #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
        output: crate::cli::Output,
    },
    /// Show BGP neighbors and routes of the running agent (asks its socket in --state-dir, else its
    /// metrics port).
    Bgp {
        /// Report format: table (text) or json (docs/usage.md).
        #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
        output: crate::cli::Output,
    },
    /// Show NetworkPolicy verdict counters and what the policy maps hold.
    Policy {
        /// Report format: table (text) or json (docs/usage.md).
        #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
        output: crate::cli::Output,
    },
    /// Show, per interface, which of our programs are attached and how (TCX or classic tc).
    Interfaces {
        /// Report format: table (text) or json (docs/usage.md).
        #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
        output: crate::cli::Output,
    },
    /// Show the age and contents of the checkpoint in --state-dir.
    Checkpoint {
        /// Report format: table (text) or json (docs/usage.md).
        #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
        output: crate::cli::Output,
    },
    /// Stream NetworkPolicy drops and new Service flows from the datapath, with pod, namespace
    /// and Service names from the checkpoint in --state-dir. Events flow only while this runs.
    Monitor {
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
        /// Which events.
        #[arg(long = "type", value_enum, default_value = "all")]
        filter: crate::monitor::EventFilter,
        /// Events per second per CPU the datapath may write (more are counted, not written).
        #[arg(long, default_value_t = 1000)]
        rate: u64,
    },
    /// Uninstall: remove every pinned map and link (TC and cgroup), the kernel routes of our
    /// protocol and the graceful-restart marker. Traffic to services and across nodes stops.
    /// With --legacy: instead remove what upstream kube-router and kube-proxy left behind
    /// (docs/migrating.md), only that, by its known names.
    Cleanup {
        /// Remove upstream kube-router's and kube-proxy's leftovers (their iptables chains,
        /// ipsets, nftables tables, IPVS services, kube-dummy-if, tun-* tunnels, protocol-17 pod
        /// routes), not ours.
        #[arg(long)]
        legacy: bool,
        /// With --legacy: the nodes' pod CIDRs whose protocol-17 routes are taken away (our BGP
        /// installs its own). Default: every Node's, from the API server with
        /// --master/--kubeconfig, else from the checkpoint in --state-dir.
        #[arg(long, value_delimiter = ',', requires = "legacy")]
        node_pod_cidrs: Vec<ipnet::IpNet>,
        /// Report format.
        #[arg(short = 'o', long = "output", default_value = "text", value_parser = ["text", "json"])]
        output: String,
    },
    /// Install the CNI plugins (bridge, host-local, portmap, loopback) from this image into the
    /// host's plugin directory where missing, and kube-router's CNI configuration at
    /// --cni-conf-file where there is none: the DaemonSet's init container (upstream's
    /// install-cni). Nothing already there is replaced.
    InstallCni {
        /// The host's CNI plugin directory.
        #[arg(long, default_value = crate::node::cni_install::DEFAULT_BIN_DIR)]
        cni_bin_dir: PathBuf,
        /// Where the plugins to install are (the image's copy).
        #[arg(long, default_value = crate::node::cni_install::IMAGE_PLUGIN_DIR)]
        plugin_source: PathBuf,
    },
    /// Parse and check the flags (and KUBE_ROUTER_* variables) given before it, as the agent
    /// would at start, and exit: 0 when it would start (warnings printed), 2 when it would refuse
    /// them. E.g. an upstream DaemonSet's args: `kube-router --run-router=true ... check-flags`.
    CheckFlags,
    /// Print docs/flags.md, the flag reference, generated from this command line.
    #[command(hide = true)]
    FlagsMarkdown,
}

/// What the flags say beyond clap's parsing, checked before anything runs.
pub struct CheckedFlags {
    pub external_peers: Vec<ExternalPeerFlag>,
    /// Flags without effect here, each said once.
    pub warnings: Vec<String>,
}

impl RunArgs {
    /// The checks `run` makes before it touches anything (`check-flags` makes only these): the
    /// external peer lists agree, and no upstream flag asks for what this agent cannot do.
    pub fn check(&self) -> Result<CheckedFlags, String> {
        let external_peers = self.routing.external_peers()?;
        let warnings = self.upstream.check()?;
        Ok(CheckedFlags { external_peers, warnings })
    }

    /// An empty string is how upstream's flags say "unset" (their defaults): read it so.
    fn drop_empty_values(&mut self) {
        self.api.drop_empty_values();
        self.node.drop_empty_values();
        self.routing.drop_empty_values();
        self.upstream.drop_empty_values();
    }
}

/// The command line with pflag's boolean syntax (`super::go_bool_flags`), and the boolean
/// flags' names.
pub fn command() -> (clap::Command, Vec<String>) {
    super::go_bool_flags(Cli::command())
}

/// Parses `args` (the program name first) as the agent does.
pub fn parse_from(args: impl IntoIterator<Item = std::ffi::OsString>) -> Result<Cli, clap::Error> {
    let (command, bool_flags) = command();
    let matches = command.try_get_matches_from(super::join_bool_values(args, &bool_flags))?;
    let mut cli = Cli::from_arg_matches(&matches)?;
    cli.run.drop_empty_values();
    Ok(cli)
}

/// Exits as clap does for a bad value (usage, exit code 2): for what the flags ask that the
/// parser could not judge alone (peer lists that disagree, a family the node lacks).
pub fn invalid(message: impl std::fmt::Display) -> ! {
    Cli::command().error(clap::error::ErrorKind::ValueValidation, message).exit()
}

#[cfg(test)]
#[path = "command_line_tests.rs"]
mod tests;
